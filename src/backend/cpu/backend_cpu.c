/* The CPU backend's table (backend.h): host memory is the device's. */
#include <stdlib.h>
#include <string.h>

#include "../../core/core.h"
#include "../backend.h"

static loom_status cpu_init(loom_dev *d, loom_ctx *ctx) {
    (void)ctx;
    d->device = -1;
    return LOOM_OK;
}

static void cpu_release(loom_dev *d) { (void)d; }

static void cpu_attn_note(const loom_dev *d, char *buf, size_t n) {
    (void)d;
    snprintf(buf, n, "loom's attention kernels");
}

static loom_status cpu_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                             const char *what) {
    (void)d;
    *p = loom_calloc(ctx, bytes ? bytes : 1, 1, what);
    return *p ? LOOM_OK : LOOM_ERR_OOM;
}

static void cpu_free(loom_dev *d, void *p) {
    (void)d;
    free(p);
}

static loom_status cpu_host_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                                  bool *pinned, const char *what) {
    (void)d;
    *pinned = false;
    *p = loom_malloc(ctx, bytes ? bytes : 1, what);
    return *p ? LOOM_OK : LOOM_ERR_OOM;
}

static loom_status cpu_copy(loom_dev *d, loom_ctx *ctx, void *dst, const void *src, size_t bytes) {
    (void)d, (void)ctx;
    memmove(dst, src, bytes);
    return LOOM_OK;
}

static loom_status cpu_zero(loom_dev *d, loom_ctx *ctx, void *p, size_t bytes) {
    (void)d, (void)ctx;
    memset(p, 0, bytes);
    return LOOM_OK;
}

static loom_status cpu_convert(loom_dev *d, loom_ctx *ctx, void *dst, loom_dtype dt,
                               const void *src, loom_dtype sdt, size_t n) {
    (void)d;
    if (dst == src && dt == sdt) return LOOM_OK;
    return loom_convert(ctx, dst, dt, src, sdt, n);
}

const loom_backend *loom_backend_cpu(void) {
    static const loom_backend be = {
        .name = "cpu",
        .init = cpu_init,
        .release = cpu_release,
        .attn_note = cpu_attn_note,
        .alloc = cpu_alloc,
        .free = cpu_free,
        .host_alloc = cpu_host_alloc,
        .copy = cpu_copy,
        .zero = cpu_zero,
        .download = cpu_copy, /* host and device memory are one */
        .upload = cpu_copy,
        .convert = cpu_convert,
    };
    return &be;
}
