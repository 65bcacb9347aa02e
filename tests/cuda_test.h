/* Helpers shared by the CUDA tests (tests/test_cuda_ops.c,
 * tests/test_cuda_glue.c): a GPU context that skips the test without a GPU,
 * device buffers freed at the end, uploads and downloads through any dtype,
 * and error measures. Only for LOOM_HAVE_CUDA builds. */
#ifndef LOOM_TESTS_CUDA_TEST_H
#define LOOM_TESTS_CUDA_TEST_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend/cuda/cuda_backend.h"
#include "../src/core/rng.h"
#include "harness.h"

typedef struct gpu {
    loom_ctx *ctx;
    void *ptrs[512];
    int n;
    bool bad; /* an allocation or copy failed (already reported) */
} gpu;

static inline bool gpu_open(gpu *g) {
    memset(g, 0, sizeof *g);
    if (loom_ctx_create(&g->ctx)) return false;
    loom_cuda_info info;
    if (loom_cuda_query(g->ctx, 0, &info) != LOOM_OK) {
        loom_ctx_free(g->ctx);
        SKIP("no CUDA device visible");
    }
    return true;
}

static inline void gpu_free_all(gpu *g) {
    while (g->n > 0) loom_cuda_free(g->ptrs[--g->n]);
}

static inline void gpu_close(gpu *g) {
    gpu_free_all(g);
    loom_ctx_free(g->ctx);
}

static inline void *dalloc(gpu *g, size_t bytes) {
    void *p = NULL;
    if (g->n >= (int)(sizeof g->ptrs / sizeof g->ptrs[0]) ||
        loom_cuda_malloc(g->ctx, &p, bytes ? bytes : 1, "test") != LOOM_OK) {
        loom_test_fail(__FILE__, __LINE__, "device allocation of %zu bytes: %s", bytes,
                       loom_last_error(g->ctx));
        g->bad = true;
        return NULL;
    }
    g->ptrs[g->n++] = p;
    return p;
}

static inline float *falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

static inline void fill(float *x, int64_t n, uint64_t key, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = sd * (float)loom_rng_normal(23, key, (uint64_t)i);
}

/* x rounded to dt and back (in place), so the CPU sees what the GPU sees. */
static inline void round_to(gpu *g, float *x, int64_t n, loom_dtype dt) {
    if (dt == LOOM_F32 || n <= 0) return;
    void *tmp = malloc((size_t)n * loom_dtype_size(dt));
    if (loom_convert(g->ctx, tmp, dt, x, LOOM_F32, (size_t)n) ||
        loom_convert(g->ctx, x, LOOM_F32, tmp, dt, (size_t)n))
        g->bad = true;
    free(tmp);
}

/* Device copy of host fp32 x[0..n) in dtype dt. */
static inline void *up(gpu *g, const float *x, int64_t n, loom_dtype dt) {
    size_t bytes = (size_t)(n > 0 ? n : 1) * loom_dtype_size(dt);
    void *d = dalloc(g, bytes), *tmp = malloc(bytes);
    if (!d || loom_convert(g->ctx, tmp, dt, x, LOOM_F32, (size_t)n) ||
        loom_cuda_memcpy_h2d(g->ctx, d, tmp, (size_t)n * loom_dtype_size(dt))) {
        loom_test_fail(__FILE__, __LINE__, "upload: %s", loom_last_error(g->ctx));
        g->bad = true;
    }
    free(tmp);
    return d;
}

static inline void *up_raw(gpu *g, const void *x, size_t bytes) {
    void *d = dalloc(g, bytes);
    if (d && bytes && loom_cuda_memcpy_h2d(g->ctx, d, x, bytes)) {
        loom_test_fail(__FILE__, __LINE__, "upload: %s", loom_last_error(g->ctx));
        g->bad = true;
    }
    return d;
}

/* Host copy of device bytes (synchronises first). */
static inline void down_raw(gpu *g, void *x, const void *d, size_t bytes) {
    if (!bytes) return;
    loom_status st = loom_cuda_sync(g->ctx);
    if (!st) st = loom_cuda_memcpy_d2h(g->ctx, x, d, bytes);
    if (st) {
        loom_test_fail(__FILE__, __LINE__, "download: %s", loom_last_error(g->ctx));
        g->bad = true;
        memset(x, 0xff, bytes); /* NaNs */
    }
}

/* Host fp32 copy of device d[0..n) of dtype dt. */
static inline void down(gpu *g, float *x, const void *d, int64_t n, loom_dtype dt) {
    if (n <= 0) return;
    size_t bytes = (size_t)n * loom_dtype_size(dt);
    void *tmp = malloc(bytes);
    down_raw(g, tmp, d, bytes);
    if (loom_convert(g->ctx, x, LOOM_F32, tmp, dt, (size_t)n)) g->bad = true;
    free(tmp);
}

/* max |a - b| / max |b| (NaN: infinite). */
static inline double rel_err(const float *a, const float *b, int64_t n) {
    double w = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= w)) w = isnan(d) ? INFINITY : d;
        m = fmax(m, fabs((double)b[i]));
    }
    return w / (m > 0 ? m : 1.0);
}

/* Elements whose bits differ (so -0 vs +0 and NaN payloads count). */
static inline int64_t n_differ(const float *a, const float *b, int64_t n) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) k += memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return k;
}

static inline double tol_for(loom_dtype dt) { return dt == LOOM_F32 ? 1e-5 : 1e-2; }

static inline const char *dn(loom_dtype dt) { return loom_dtype_name(dt); }

/* LOOM_CUDA_OPS_VERBOSE=1 prints every comparison's error (to stderr). */
#define CHECK_CLOSE(got, ref, n, dt, ...)                                                      \
    do {                                                                                       \
        double _e = rel_err((got), (ref), (n));                                                \
        bool _bad = !(_e <= tol_for(dt));                                                      \
        if (_bad || getenv("LOOM_CUDA_OPS_VERBOSE")) {                                         \
            char _what[256];                                                                   \
            snprintf(_what, sizeof _what, __VA_ARGS__);                                        \
            if (_bad)                                                                          \
                loom_test_fail(__FILE__, __LINE__, "%s: rel err %.3g > %.0e", _what, _e,        \
                               tol_for(dt));                                                   \
            else                                                                               \
                fprintf(stderr, "    %s: rel err %.3g\n", _what, _e);                          \
        }                                                                                      \
    } while (0)

/* ---- timings (LOOM_CUDA_OPS_BENCH=1): not checks ---- */

static inline void *bench_buf(gpu *g, int64_t n, loom_dtype dt) { /* values in [-0.5, 0.5) */
    float *h = falloc(n);
    for (int64_t i = 0; i < n; i++) h[i] = (float)((uint64_t)i * 2654435761u % 1000) / 1000.0f - 0.5f;
    void *d = up(g, h, n, dt);
    free(h);
    return d;
}

typedef struct bench_op {
    gpu *g;
    cudaEvent_t a, b;
    float last; /* ms a call of the last BENCH */
} bench_op;

/* Times `reps` calls of the statement after two warm-up calls; prints ms and
 * work / time (work in TFLOP or TB, so T/s). */
#define BENCH(bo, label, work, reps, call)                                                     \
    do {                                                                                       \
        loom_status _st = LOOM_OK;                                                             \
        for (int _w = 0; _w < 2 && !_st; _w++) _st = (call);                                  \
        if (_st) {                                                                             \
            loom_test_fail(__FILE__, __LINE__, "%s: %s", label, loom_last_error((bo)->g->ctx)); \
            break;                                                                             \
        }                                                                                      \
        cudaEventRecord((bo)->a, 0);                                                           \
        for (int _r = 0; _r < (reps); _r++) (void)(call);                                      \
        cudaEventRecord((bo)->b, 0);                                                           \
        cudaEventSynchronize((bo)->b);                                                         \
        float _ms = 0;                                                                         \
        cudaEventElapsedTime(&_ms, (bo)->a, (bo)->b);                                          \
        _ms /= (reps);                                                                         \
        (bo)->last = _ms;                                                                      \
        fprintf(stderr, "    %-46s %9.3f ms %8.1f T/s\n", label, _ms, (work) / (_ms * 1e-3) / 1e12); \
    } while (0)

#endif
