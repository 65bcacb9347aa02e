/* The CPU backend's table (backend.h): host memory is the device's. */
#include <stdlib.h>
#include <string.h>

#include "../../core/core.h"
#include "../backend.h"
#include "cpu_glue.h"
#include "cpu_ops.h"

#define F(p) ((float *)(p))
#define CF(p) ((const float *)(p))

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

/* ---- element-wise: the CPU computes in fp32 ---- */

static loom_status cpu_swiglu_fwd(loom_dev *d, loom_ctx *ctx, const void *g, const void *u,
                                  int64_t n, void *h) {
    (void)d, (void)ctx;
    loom_cpu_swiglu_fwd(CF(g), CF(u), n, F(h));
    return LOOM_OK;
}

static loom_status cpu_swiglu_bwd(loom_dev *d, loom_ctx *ctx, const void *dh, const void *g,
                                  const void *u, int64_t n, void *dg, void *du) {
    (void)d, (void)ctx;
    loom_cpu_swiglu_bwd(CF(dh), CF(g), CF(u), n, F(dg), F(du));
    return LOOM_OK;
}

static loom_status cpu_add(loom_dev *d, loom_ctx *ctx, void *y, const void *x, int64_t n) {
    (void)d, (void)ctx;
    loom_cpu_residual_add(F(y), CF(x), n);
    return LOOM_OK;
}

static loom_status cpu_bias_fwd(loom_dev *d, loom_ctx *ctx, void *y, const void *b, int64_t T,
                                int64_t N) {
    (void)d, (void)ctx;
    loom_cpu_add_bias_fwd(F(y), CF(b), T, N);
    return LOOM_OK;
}

static loom_status cpu_bias_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, int64_t T, int64_t N,
                                float *db) {
    (void)d, (void)ctx;
    loom_cpu_add_bias_bwd(CF(dy), T, N, db);
    return LOOM_OK;
}

static loom_status cpu_embed_fwd(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                                 const void *W, int64_t row0, int64_t rows, int64_t H, void *out) {
    (void)d, (void)ctx;
    loom_cpu_embedding_vp_fwd(ids, T, CF(W), row0, rows, H, F(out));
    return LOOM_OK;
}

static loom_status cpu_embed_bwd(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                                 const void *dout, int64_t row0, int64_t rows, int64_t H,
                                 float *dW) {
    (void)d, (void)ctx;
    loom_cpu_embedding_vp_bwd(ids, T, CF(dout), row0, rows, H, dW);
    return LOOM_OK;
}

static loom_status cpu_rows_gather(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                   const int32_t *idx, int64_t n, int64_t width) {
    (void)ctx;
    loom_cpu_rows_gather(dst, src, idx, n, width, d->esz);
    return LOOM_OK;
}

static loom_status cpu_rows_scatter(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                    const int32_t *idx, int64_t n, int64_t width) {
    (void)ctx;
    loom_cpu_rows_scatter(dst, src, idx, n, width, d->esz);
    return LOOM_OK;
}

static loom_status cpu_dropout(loom_dev *d, loom_ctx *ctx, void *out, const void *x, int64_t T,
                               int64_t in, int64_t full, int64_t col0, const int32_t *qidx,
                               int64_t out0, uint64_t seed, uint64_t key, double p) {
    (void)d, (void)ctx;
    loom_cpu_lora_dropout(F(out), CF(x), T, in, full, col0, qidx, out0, seed, key, p);
    return LOOM_OK;
}

/* ---- RMSNorm ---- */

static loom_status cpu_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                   int64_t N, int64_t H, float eps, void *y, float *rstd) {
    (void)d, (void)ctx;
    loom_cpu_rmsnorm_fwd(CF(x), CF(w), N, H, eps, F(y), rstd);
    return LOOM_OK;
}

static loom_status cpu_rmsnorm_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                   const void *w, const float *rstd, int64_t N, int64_t H,
                                   void *dx, float *dw) {
    (void)d, (void)ctx;
    loom_cpu_rmsnorm_bwd(CF(dy), CF(x), CF(w), rstd, N, H, F(dx), dw);
    return LOOM_OK;
}

static loom_status cpu_add_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, void *x, const void *res,
                                       void *xsum, const void *w, int64_t N, int64_t H, float eps,
                                       void *y, float *rstd) {
    if (xsum != x) memmove(xsum, x, (size_t)(N * H) * sizeof(float));
    loom_cpu_residual_add(F(xsum), CF(res), N * H);
    return cpu_rmsnorm_fwd(d, ctx, xsum, w, N, H, eps, y, rstd);
}

static loom_status cpu_rmsnorm_bwd_add(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                       const void *w, const float *rstd, int64_t N, int64_t H,
                                       void *dx, float *dw) {
    loom_status st = cpu_rmsnorm_bwd(d, ctx, dy, x, w, rstd, N, H, dy, dw);
    if (!st) loom_cpu_residual_add(F(dx), CF(dy), N * H);
    return st;
}

static loom_status cpu_dw_flush(loom_dev *d, loom_ctx *ctx) {
    (void)d, (void)ctx;
    return LOOM_OK;
}

static void cpu_dw_drop(loom_dev *d) { (void)d; }

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
        .swiglu_fwd = cpu_swiglu_fwd,
        .swiglu_bwd = cpu_swiglu_bwd,
        .add = cpu_add,
        .bias_fwd = cpu_bias_fwd,
        .bias_bwd = cpu_bias_bwd,
        .embed_fwd = cpu_embed_fwd,
        .embed_bwd = cpu_embed_bwd,
        .rows_gather = cpu_rows_gather,
        .rows_scatter = cpu_rows_scatter,
        .dropout = cpu_dropout,
        .rmsnorm_fwd = cpu_rmsnorm_fwd,
        .rmsnorm_bwd = cpu_rmsnorm_bwd,
        .add_rmsnorm_fwd = cpu_add_rmsnorm_fwd,
        .rmsnorm_bwd_add = cpu_rmsnorm_bwd_add,
        .dw_flush = cpu_dw_flush,
        .dw_drop = cpu_dw_drop,
    };
    return &be;
}
