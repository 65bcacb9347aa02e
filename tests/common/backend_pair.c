/* Two backend tables side by side (backend_pair.h). */
#include "backend_pair.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../src/core/core.h"
#include "../../src/core/rng.h"

bool bp_begin(bp_run *r, loom_dtype t) {
    memset(r, 0, sizeof *r);
    if (!loom_backend_cuda() || !loom_test_have_gpu() || loom_ctx_create(&r->ctx))
        return false;
    r->be[0] = loom_backend_cpu();
    r->be[1] = loom_backend_cuda();
    r->d[0] = (loom_dev){.adt = LOOM_F32, .esz = 4};
    r->d[1] = (loom_dev){.cuda = true, .adt = t, .esz = loom_dtype_size(t), .device = 0};
    r->t = t;
    r->seed = (uint64_t)loom_now_s() * 2654435761u;
    for (int k = 0; k < 2; k++)
        if (r->be[k]->init(&r->d[k], r->ctx))
            return false;
    return true;
}

void bp_end(bp_run *r) {
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < r->nkeep[k]; i++)
            r->be[k]->free(&r->d[k], r->keep[k][i]);
        r->be[k]->release(&r->d[k]);
    }
    loom_ctx_free(r->ctx);
}

/* n values in [lo, hi), rounded to side 1's dtype when act */
float *bp_rnd(bp_run *r, int64_t n, float lo, float hi, bool act) {
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    MUST(p);
    r->seed += 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < n; i++)
        p[i] = lo + (hi - lo) * (float)((double)(loom_splitmix64(r->seed + (uint64_t)i) >> 11) /
                                        9007199254740992.0);
    if (act && r->t != LOOM_F32) {
        uint16_t *h = malloc((size_t)n * 2);
        MUST(h);
        MUST_OK(r->ctx, loom_convert(r->ctx, h, r->t, p, LOOM_F32, (size_t)n));
        MUST_OK(r->ctx, loom_convert(r->ctx, p, LOOM_F32, h, r->t, (size_t)n));
        free(h);
    }
    return p;
}

void *bp_keep(bp_run *r, int k, size_t bytes) {
    void *p = NULL;
    MUST_OK(r->ctx, r->be[k]->alloc(&r->d[k], r->ctx, &p, bytes ? bytes : 1, "test"));
    MUST(r->nkeep[k] < 64);
    r->keep[k][r->nkeep[k]++] = p;
    return p;
}

/* host data on side k: act buffers in the side's compute dtype, else fp32 */
void *bp_in(bp_run *r, int k, const float *h, int64_t n, bool act) {
    const loom_dtype t = act ? r->d[k].adt : LOOM_F32;
    const size_t es = loom_dtype_size(t);
    void *p = bp_keep(r, k, (size_t)n * es), *tmp = NULL;
    const void *src = h;
    if (t != LOOM_F32) {
        MUST((tmp = malloc((size_t)n * es)));
        MUST_OK(r->ctx, loom_convert(r->ctx, tmp, t, h, LOOM_F32, (size_t)n));
        src = tmp;
    }
    MUST_OK(r->ctx, r->be[k]->upload(&r->d[k], r->ctx, p, src, (size_t)n * es));
    free(tmp);
    return p;
}

void *bp_raw(bp_run *r, int k, const void *h, size_t bytes) {
    void *p = bp_keep(r, k, bytes);
    MUST_OK(r->ctx, r->be[k]->upload(&r->d[k], r->ctx, p, h, bytes));
    return p;
}

/* an output buffer of n values on side k (act: the side's dtype) */
void *bp_outbuf(bp_run *r, int k, int64_t n, bool act) {
    return bp_keep(r, k, (size_t)n * (act ? r->d[k].esz : 4));
}

/* side k's n values at p as fp32 */
float *bp_get(bp_run *r, int k, const void *p, int64_t n, bool act) {
    const loom_dtype t = act ? r->d[k].adt : LOOM_F32;
    const size_t es = loom_dtype_size(t);
    float *h = malloc((size_t)(n ? n : 1) * 4);
    void *tmp = malloc((size_t)(n ? n : 1) * es);
    MUST(h && tmp);
    MUST_OK(r->ctx, r->be[k]->download(&r->d[k], r->ctx, tmp, p, (size_t)n * es));
    MUST_OK(r->ctx, loom_convert(r->ctx, h, LOOM_F32, tmp, t, (size_t)n));
    free(tmp);
    return h;
}

/* the largest |a - b| over the largest |b| (as test_backend_ops.c's) */
double bp_rel_err(const float *a, const float *b, int64_t n) {
    double w = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]);
        if (!(d <= w))
            w = isnan(d) ? INFINITY : d;
        m = fmax(m, fabs((double)b[i]));
    }
    return w / (m > 0 ? m : 1.0);
}

void bp_same(bp_run *r, const char *what, void *const p[2], int64_t n, bool act, double tol) {
    float *a = bp_get(r, 1, p[1], n, act), *b = bp_get(r, 0, p[0], n, act);
    const double e = bp_rel_err(a, b, n);
    CHECK_MSG(e <= tol, "%s (%s): %s differs from the CPU's by %.3g (tol %.3g)", r->be[1]->name,
              loom_dtype_name(r->t), what, e, tol);
    free(a), free(b);
}

/* fp32: the GPU's fp32 arithmetic against the CPU's double, rounded once;
 * bf16: the outputs' rounding (inputs are the same values on both sides) */
double bp_tol(const bp_run *r) { return r->t == LOOM_F32 ? 1e-4 : 3e-2; }

