/* Gated DeltaNet's backend ops (backend.h's gdn_conv_fwd .. gdn_norm_bwd) on
 * the CUDA table held to the CPU's (src/backend/cpu/gdn.c, in double) on
 * fresh random inputs, as test_backend_ops.c does for the other families:
 * fp32 and bf16 (the inputs rounded to bf16 first, so both sides see the
 * same values). Packed documents whose lengths are not multiples of the
 * rule's 64-token chunks, documents shorter than the convolution's kernel,
 * two value heads per key head, dk != dv, and Qwen3.5's head sizes (128,
 * with dv past one pass of the backward's columns). Skipped without a GPU.
 *
 * The CUDA kernels (ops_gdn.cu, ops_gdn_rule.cu) were written and compiled
 * on a machine without a GPU: these tests are their first run. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/backend/backend.h"
#include "../src/core/core.h"
#include "../src/core/rng.h"
#include "harness.h"

/* REQUIRE for the helpers that return a buffer (the runner forks one
 * process per test: a failure ends it as failed) */
#define MUST(cond)                                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            loom_test_fail(__FILE__, __LINE__, "MUST(%s)", #cond);                                 \
            fflush(stderr);                                                                        \
            _exit(1);                                                                              \
        }                                                                                          \
    } while (0)
#define MUST_OK(ctx, expr)                                                                         \
    do {                                                                                           \
        loom_status st_ = (expr);                                                                  \
        if (st_) {                                                                                 \
            loom_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, loom_status_str(st_),        \
                           loom_last_error(ctx));                                                  \
            fflush(stderr);                                                                        \
            _exit(1);                                                                              \
        }                                                                                          \
    } while (0)

/* Side 0 is the CPU table (fp32), side 1 CUDA's (dtype t). */
typedef struct run {
    loom_ctx *ctx;
    const loom_backend *be[2];
    loom_dev d[2];
    loom_dtype t;
    uint64_t seed;
    void *keep[2][64];
    int nkeep[2];
} run;

static bool run_begin(run *r, loom_dtype t) {
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

static void run_end(run *r) {
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < r->nkeep[k]; i++)
            r->be[k]->free(&r->d[k], r->keep[k][i]);
        r->be[k]->release(&r->d[k]);
    }
    loom_ctx_free(r->ctx);
}

/* n values in [lo, hi), rounded to side 1's dtype when act */
static float *rnd(run *r, int64_t n, float lo, float hi, bool act) {
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

static void *keep(run *r, int k, size_t bytes) {
    void *p = NULL;
    MUST_OK(r->ctx, r->be[k]->alloc(&r->d[k], r->ctx, &p, bytes ? bytes : 1, "test"));
    MUST(r->nkeep[k] < 64);
    r->keep[k][r->nkeep[k]++] = p;
    return p;
}

/* host data on side k: act buffers in the side's compute dtype, else fp32 */
static void *in(run *r, int k, const float *h, int64_t n, bool act) {
    const loom_dtype t = act ? r->d[k].adt : LOOM_F32;
    const size_t es = loom_dtype_size(t);
    void *p = keep(r, k, (size_t)n * es), *tmp = NULL;
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

static void *raw(run *r, int k, const void *h, size_t bytes) {
    void *p = keep(r, k, bytes);
    MUST_OK(r->ctx, r->be[k]->upload(&r->d[k], r->ctx, p, h, bytes));
    return p;
}

/* an output buffer of n values on side k (act: the side's dtype) */
static void *outbuf(run *r, int k, int64_t n, bool act) {
    return keep(r, k, (size_t)n * (act ? r->d[k].esz : 4));
}

/* side k's n values at p as fp32 */
static float *get(run *r, int k, const void *p, int64_t n, bool act) {
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
static double rel_err(const float *a, const float *b, int64_t n) {
    double w = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]);
        if (!(d <= w))
            w = isnan(d) ? INFINITY : d;
        m = fmax(m, fabs((double)b[i]));
    }
    return w / (m > 0 ? m : 1.0);
}

static void same(run *r, const char *what, void *const p[2], int64_t n, bool act, double tol) {
    float *a = get(r, 1, p[1], n, act), *b = get(r, 0, p[0], n, act);
    const double e = rel_err(a, b, n);
    CHECK_MSG(e <= tol, "%s (%s): %s differs from the CPU's by %.3g (tol %.3g)", r->be[1]->name,
              loom_dtype_name(r->t), what, e, tol);
    free(a), free(b);
}

/* fp32: the GPU's fp32 arithmetic against the CPU's double, rounded once;
 * bf16: the outputs' rounding (inputs are the same values on both sides) */
static double tol_of(const run *r) { return r->t == LOOM_F32 ? 1e-4 : 3e-2; }

/* ---- the convolution, the gates, the gated norm ---- */

static void small_family(run *r) {
    enum { T = 150, C = 40, K = 4, H = 6, ND = 4 };
    const int32_t cu[ND + 1] = {0, 2, 3, 70, 150}; /* 2 and 1 tokens: shorter than K */
    float *x = rnd(r, T * C, -1, 1, true), *w = rnd(r, C * K, -1, 1, true);
    float *dy = rnd(r, T * C, -1, 1, true), *dw0 = rnd(r, C * K, -1, 1, false);
    float *a = rnd(r, T * H, -4, 4, true), *b = rnd(r, T * H, -4, 4, true);
    float *alog = rnd(r, H, -1, 1, true), *dtb = rnd(r, H, -1, 1, true);
    float *dg = rnd(r, T * H, -1, 1, false), *dbeta = rnd(r, T * H, -1, 1, false);
    float *dal0 = rnd(r, H, -1, 1, false), *ddt0 = rnd(r, H, -1, 1, false);
    a[0] = 25.0f, a[1] = 21.0f; /* softplus past its threshold (20) */
    const int64_t N = T * H, D = 48;
    float *nx = rnd(r, N * D, -2, 2, true), *nz = rnd(r, N * D, -3, 3, true);
    float *nw = rnd(r, D, -1, 1, true), *ndy = rnd(r, N * D, -1, 1, true);
    float *ndw0 = rnd(r, D, -1, 1, false);
    void *y[2], *dx[2], *dw[2], *g[2], *be[2], *da[2], *db[2], *dal[2], *ddt[2];
    void *ny[2], *nrs[2], *ndx[2], *ndz[2], *ndw[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *B = r->be[k];
        loom_dev *d = &r->d[k];
        void *CU = raw(r, k, cu, sizeof cu), *X = in(r, k, x, T * C, true);
        void *W = in(r, k, w, C * K, true), *DY = in(r, k, dy, T * C, true);
        y[k] = outbuf(r, k, T * C, true), dx[k] = outbuf(r, k, T * C, true);
        dw[k] = in(r, k, dw0, C * K, false);
        REQUIRE_OK(r->ctx, B->gdn_conv_fwd(d, r->ctx, X, W, T, C, K, CU, ND, y[k]));
        REQUIRE_OK(r->ctx, B->gdn_conv_bwd(d, r->ctx, DY, X, W, T, C, K, CU, ND, dx[k], dw[k]));
        void *A = in(r, k, a, T * H, true), *Bb = in(r, k, b, T * H, true);
        void *AL = in(r, k, alog, H, true), *DT = in(r, k, dtb, H, true);
        void *DG = in(r, k, dg, T * H, false), *DB = in(r, k, dbeta, T * H, false);
        g[k] = outbuf(r, k, T * H, false), be[k] = outbuf(r, k, T * H, false);
        da[k] = outbuf(r, k, T * H, true), db[k] = outbuf(r, k, T * H, true);
        dal[k] = in(r, k, dal0, H, false), ddt[k] = in(r, k, ddt0, H, false);
        REQUIRE_OK(r->ctx, B->gdn_gate_fwd(d, r->ctx, A, Bb, AL, DT, T, H, g[k], be[k]));
        REQUIRE_OK(r->ctx, B->gdn_gate_bwd(d, r->ctx, DG, DB, A, Bb, AL, DT, T, H, da[k], db[k],
                                           dal[k], ddt[k]));
        void *NX = in(r, k, nx, N * D, true), *NZ = in(r, k, nz, N * D, true);
        void *NW = in(r, k, nw, D, true), *NDY = in(r, k, ndy, N * D, true);
        ny[k] = outbuf(r, k, N * D, true), nrs[k] = outbuf(r, k, N, false);
        ndx[k] = outbuf(r, k, N * D, true), ndz[k] = outbuf(r, k, N * D, true);
        ndw[k] = in(r, k, ndw0, D, false);
        REQUIRE_OK(r->ctx, B->gdn_norm_fwd(d, r->ctx, NX, NZ, NW, N, D, 1e-6f, ny[k], nrs[k]));
        REQUIRE_OK(r->ctx, B->gdn_norm_bwd(d, r->ctx, NDY, NX, NZ, NW, nrs[k], N, D, ndx[k], ndz[k],
                                           ndw[k]));
    }
    const double tol = tol_of(r);
    same(r, "gdn_conv_fwd y", y, T * C, true, tol);
    same(r, "gdn_conv_bwd dx", dx, T * C, true, tol);
    same(r, "gdn_conv_bwd dw", dw, C * K, false, tol);
    same(r, "gdn_gate_fwd g", g, T * H, false, tol);
    same(r, "gdn_gate_fwd beta", be, T * H, false, tol);
    same(r, "gdn_gate_bwd da", da, T * H, true, tol);
    same(r, "gdn_gate_bwd db", db, T * H, true, tol);
    same(r, "gdn_gate_bwd dA_log", dal, H, false, tol);
    same(r, "gdn_gate_bwd ddt_bias", ddt, H, false, tol);
    same(r, "gdn_norm_fwd y", ny, N * D, true, tol);
    same(r, "gdn_norm_fwd rstd", nrs, N, false, tol);
    same(r, "gdn_norm_bwd dx", ndx, N * D, true, tol);
    same(r, "gdn_norm_bwd dz", ndz, N * D, true, tol);
    same(r, "gdn_norm_bwd dw", ndw, D, false, tol);
    float *all[] = {x, w, dy, dw0, a, b, alog, dtb, dg, dbeta, dal0, ddt0, nx, nz, nw, ndy, ndw0};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        free(all[i]);
}

/* ---- the chunked rule ---- */

typedef struct rule_case {
    int64_t Hk, Hv, dk, dv, ndocs;
    int32_t cu[6];
} rule_case;

static void rule_family(run *r, const rule_case *rc) {
    const int64_t Hk = rc->Hk, Hv = rc->Hv, dk = rc->dk, dv = rc->dv, nd = rc->ndocs;
    const int64_t T = rc->cu[nd], C = 2 * Hk * dk + Hv * dv;
    float *qkv = rnd(r, T * C, -1, 1, true), *dout = rnd(r, T * Hv * dv, -1, 1, true);
    /* the decay's log in (-0.6, -0.01) (the gates' range, ~ -exp(A_log) softplus),
     * the write strength in (0.05, 0.95) */
    float *g = rnd(r, T * Hv, -0.6f, -0.01f, false), *beta = rnd(r, T * Hv, 0.05f, 0.95f, false);
    void *o[2], *dq[2], *dg[2], *db[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *B = r->be[k];
        loom_dev *d = &r->d[k];
        void *CU = raw(r, k, rc->cu, (size_t)(nd + 1) * 4), *Q = in(r, k, qkv, T * C, true);
        void *G = in(r, k, g, T * Hv, false), *BE = in(r, k, beta, T * Hv, false);
        void *DO = in(r, k, dout, T * Hv * dv, true);
        o[k] = outbuf(r, k, T * Hv * dv, true), dq[k] = outbuf(r, k, T * C, true);
        dg[k] = outbuf(r, k, T * Hv, false), db[k] = outbuf(r, k, T * Hv, false);
        REQUIRE_OK(r->ctx, B->gdn_fwd(d, r->ctx, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, o[k]));
        REQUIRE_OK(r->ctx, B->gdn_bwd(d, r->ctx, DO, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, dq[k],
                                      dg[k], db[k]));
    }
    /* fp32: chunks of 64 in fp32 (a triangular solve, states carried over
     * the chunks) against the CPU's double */
    const double tol = r->t == LOOM_F32 ? 1e-3 : 3e-2;
    char what[96];
    snprintf(what, sizeof what,
             "gdn T %lld Hk %lld Hv %lld dk %lld dv %lld docs %lld: ", (long long)T, (long long)Hk,
             (long long)Hv, (long long)dk, (long long)dv, (long long)nd);
    char w2[160];
    snprintf(w2, sizeof w2, "%sgdn_fwd o", what);
    same(r, w2, o, T * Hv * dv, true, tol);
    snprintf(w2, sizeof w2, "%sgdn_bwd dqkv", what);
    same(r, w2, dq, T * C, true, tol);
    snprintf(w2, sizeof w2, "%sgdn_bwd dg", what);
    same(r, w2, dg, T * Hv, false, tol);
    snprintf(w2, sizeof w2, "%sgdn_bwd dbeta", what);
    same(r, w2, db, T * Hv, false, tol);
    free(qkv), free(dout), free(g), free(beta);
}

#define GPU_OR_SKIP(r, t)                                                                          \
    do {                                                                                           \
        if (!run_begin(&(r), (t)))                                                                 \
            SKIP("no GPU (or loom built without CUDA): this compares the CUDA table with the "     \
                 "CPU's");                                                                         \
    } while (0)

TEST(backend_gdn_small_ops_equal_cpu) {
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++) {
        run r;
        GPU_OR_SKIP(r, dts[i]);
        small_family(&r);
        run_end(&r);
    }
}

TEST(backend_gdn_rule_equals_cpu) {
    static const rule_case cases[] = {
        /* three documents, 3 tokens (one chunk shorter than the conv's kernel too),
         * 67 (a chunk and 3), 80; two value heads per key head, dk != dv */
        {2, 4, 32, 48, 3, {0, 3, 70, 150}},
        /* one document of exactly two chunks, one head */
        {1, 1, 16, 16, 1, {0, 128}},
        /* Qwen3.5's head size; dv 144: two column passes of the backward
         * (dv + dk > 256), part tiles of the state passes (32) and of the
         * output (64) (160, a multiple of 32, had no part tile of 32) */
        {1, 2, 128, 144, 2, {0, 130, 197}},
        /* a document of 1 token among others */
        {2, 2, 64, 64, 3, {0, 1, 65, 100}},
    };
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            run r;
            GPU_OR_SKIP(r, dts[i]);
            rule_family(&r, &cases[c]);
            run_end(&r);
        }
}
