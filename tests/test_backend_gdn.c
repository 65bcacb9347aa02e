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
#include "../src/backend/gdn_ws.h"
#include "../src/core/core.h"
#include "../src/core/rng.h"
#include "common/backend_pair.h"
#include "harness.h"

/* ---- the convolution, the gates, the gated norm ---- */

/* The convolution over T tokens of C channels packed as nd documents. */
static void conv_family(bp_run *r, int64_t T, int64_t C, int64_t K, const int32_t *cu,
                        int64_t nd) {
    float *x = bp_rnd(r, T * C, -1, 1, true), *w = bp_rnd(r, C * K, -1, 1, true);
    float *dy = bp_rnd(r, T * C, -1, 1, true), *dw0 = bp_rnd(r, C * K, -1, 1, false);
    void *y[2], *dx[2], *dw[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *B = r->be[k];
        loom_dev *d = &r->d[k];
        void *CU = bp_raw(r, k, cu, (size_t)(nd + 1) * sizeof *cu);
        void *X = bp_in(r, k, x, T * C, true), *W = bp_in(r, k, w, C * K, true);
        void *DY = bp_in(r, k, dy, T * C, true);
        y[k] = bp_outbuf(r, k, T * C, true), dx[k] = bp_outbuf(r, k, T * C, true);
        dw[k] = bp_in(r, k, dw0, C * K, false);
        REQUIRE_OK(r->ctx, B->gdn_conv_fwd(d, r->ctx, X, W, T, C, K, CU, nd, y[k]));
        REQUIRE_OK(r->ctx, B->gdn_conv_bwd(d, r->ctx, DY, X, W, T, C, K, CU, nd, dx[k], dw[k]));
    }
    const double tol = bp_tol(r);
    bp_same(r, "gdn_conv_fwd y", y, T * C, true, tol);
    bp_same(r, "gdn_conv_bwd dx", dx, T * C, true, tol);
    bp_same(r, "gdn_conv_bwd dw", dw, C * K, false, tol);
    free(x), free(w), free(dy), free(dw0);
}

/* The gated RMSNorm over N rows of D, with dw and without (a frozen weight:
 * the 16-bit kernels' other variant). */
static void norm_family(bp_run *r, int64_t N, int64_t D) {
    float *nx = bp_rnd(r, N * D, -2, 2, true), *nz = bp_rnd(r, N * D, -3, 3, true);
    float *nw = bp_rnd(r, D, -1, 1, true), *ndy = bp_rnd(r, N * D, -1, 1, true);
    float *ndw0 = bp_rnd(r, D, -1, 1, false);
    void *ny[2], *nrs[2], *ndx[2], *ndz[2], *ndw[2], *ndx1[2], *ndz1[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *B = r->be[k];
        loom_dev *d = &r->d[k];
        void *NX = bp_in(r, k, nx, N * D, true), *NZ = bp_in(r, k, nz, N * D, true);
        void *NW = bp_in(r, k, nw, D, true), *NDY = bp_in(r, k, ndy, N * D, true);
        ny[k] = bp_outbuf(r, k, N * D, true), nrs[k] = bp_outbuf(r, k, N, false);
        ndx[k] = bp_outbuf(r, k, N * D, true), ndz[k] = bp_outbuf(r, k, N * D, true);
        ndx1[k] = bp_outbuf(r, k, N * D, true), ndz1[k] = bp_outbuf(r, k, N * D, true);
        ndw[k] = bp_in(r, k, ndw0, D, false);
        REQUIRE_OK(r->ctx, B->gdn_norm_fwd(d, r->ctx, NX, NZ, NW, N, D, 1e-6f, ny[k], nrs[k]));
        REQUIRE_OK(r->ctx, B->gdn_norm_bwd(d, r->ctx, NDY, NX, NZ, NW, nrs[k], N, D, ndx[k], ndz[k],
                                           ndw[k]));
        REQUIRE_OK(r->ctx, B->gdn_norm_bwd(d, r->ctx, NDY, NX, NZ, NW, nrs[k], N, D, ndx1[k],
                                           ndz1[k], NULL));
    }
    const double tol = bp_tol(r);
    bp_same(r, "gdn_norm_fwd y", ny, N * D, true, tol);
    bp_same(r, "gdn_norm_fwd rstd", nrs, N, false, tol);
    bp_same(r, "gdn_norm_bwd dx", ndx, N * D, true, tol);
    bp_same(r, "gdn_norm_bwd dz", ndz, N * D, true, tol);
    bp_same(r, "gdn_norm_bwd dw", ndw, D, false, tol);
    bp_same(r, "gdn_norm_bwd dx without dw", ndx1, N * D, true, tol);
    bp_same(r, "gdn_norm_bwd dz without dw", ndz1, N * D, true, tol);
    free(nx), free(nz), free(nw), free(ndy), free(ndw0);
}

static void small_family(bp_run *r) {
    enum { T = 150, C = 40, K = 4, H = 6, ND = 4 };
    const int32_t cu[ND + 1] = {0, 2, 3, 70, 150}; /* 2 and 1 tokens: shorter than K */
    float *a = bp_rnd(r, T * H, -4, 4, true), *b = bp_rnd(r, T * H, -4, 4, true);
    float *alog = bp_rnd(r, H, -1, 1, true), *dtb = bp_rnd(r, H, -1, 1, true);
    float *dg = bp_rnd(r, T * H, -1, 1, false), *dbeta = bp_rnd(r, T * H, -1, 1, false);
    float *dal0 = bp_rnd(r, H, -1, 1, false), *ddt0 = bp_rnd(r, H, -1, 1, false);
    a[0] = 25.0f, a[1] = 21.0f; /* softplus past its threshold (20) */
    void *g[2], *be[2], *da[2], *db[2], *dal[2], *ddt[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *B = r->be[k];
        loom_dev *d = &r->d[k];
        void *A = bp_in(r, k, a, T * H, true), *Bb = bp_in(r, k, b, T * H, true);
        void *AL = bp_in(r, k, alog, H, true), *DT = bp_in(r, k, dtb, H, true);
        void *DG = bp_in(r, k, dg, T * H, false), *DB = bp_in(r, k, dbeta, T * H, false);
        g[k] = bp_outbuf(r, k, T * H, false), be[k] = bp_outbuf(r, k, T * H, false);
        da[k] = bp_outbuf(r, k, T * H, true), db[k] = bp_outbuf(r, k, T * H, true);
        dal[k] = bp_in(r, k, dal0, H, false), ddt[k] = bp_in(r, k, ddt0, H, false);
        REQUIRE_OK(r->ctx, B->gdn_gate_fwd(d, r->ctx, A, Bb, AL, DT, T, H, g[k], be[k]));
        REQUIRE_OK(r->ctx, B->gdn_gate_bwd(d, r->ctx, DG, DB, A, Bb, AL, DT, T, H, da[k], db[k],
                                           dal[k], ddt[k]));
    }
    const double tol = bp_tol(r);
    bp_same(r, "gdn_gate_fwd g", g, T * H, false, tol);
    bp_same(r, "gdn_gate_fwd beta", be, T * H, false, tol);
    bp_same(r, "gdn_gate_bwd da", da, T * H, true, tol);
    bp_same(r, "gdn_gate_bwd db", db, T * H, true, tol);
    bp_same(r, "gdn_gate_bwd dA_log", dal, H, false, tol);
    bp_same(r, "gdn_gate_bwd ddt_bias", ddt, H, false, tol);
    conv_family(r, T, C, K, cu, ND);
    float *all[] = {a, b, alog, dtb, dg, dbeta, dal0, ddt0};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        free(all[i]);
}

/* ---- the chunked rule ---- */

typedef struct rule_case {
    int64_t Hk, Hv, dk, dv, ndocs;
    int32_t cu[6];
} rule_case;

/* Side 1's n values at p and q: the same bits. */
static bool same_bits(bp_run *r, const void *p, const void *q, int64_t n, bool act) {
    float *a = bp_get(r, 1, p, n, act), *b = bp_get(r, 1, q, n, act);
    const bool same = !memcmp(a, b, (size_t)n * sizeof(float));
    free(a), free(b);
    return same;
}

/* The CUDA rule with a keep buffer (gdn_ws.h; bf16, dk <= 128) against
 * itself without one (o, dq, dg, db): the same bits; the backward reads
 * the buffer (poisoned, its outputs are not finite); a buffer with room for
 * fewer chunks than the documents can make is refused. */
static void rule_kept(bp_run *r, const rule_case *rc, void *Q, void *G, void *BE, void *DO,
                      void *CU, void *o, void *dq, void *dg, void *db) {
    const int64_t Hk = rc->Hk, Hv = rc->Hv, dk = rc->dk, dv = rc->dv, nd = rc->ndocs;
    const int64_t T = rc->cu[nd], C = 2 * Hk * dk + Hv * dv, kc = loom_gdn_ws_chunks(T, nd);
    const size_t bytes = loom_gdn_keep_bytes(T, Hk, Hv, dk, dv, loom_gdn_ws_tc(r->t, dk), kc);
    if (!bytes) return; /* fp32, or dk past the tensor-core kernels: nothing kept */
    const loom_backend *B = r->be[1];
    loom_dev *d = &r->d[1];
    void *K = bp_keep(r, 1, bytes);
    void *o2 = bp_outbuf(r, 1, T * Hv * dv, true), *dq2 = bp_outbuf(r, 1, T * C, true);
    void *dg2 = bp_outbuf(r, 1, T * Hv, false), *db2 = bp_outbuf(r, 1, T * Hv, false);
    REQUIRE_OK(r->ctx, B->gdn_fwd(d, r->ctx, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, o2, K, kc));
    REQUIRE_OK(r->ctx, B->gdn_bwd(d, r->ctx, DO, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, dq2, dg2,
                                  db2, K, kc));
    CHECK_MSG(same_bits(r, o, o2, T * Hv * dv, true) && same_bits(r, dq, dq2, T * C, true) &&
                  same_bits(r, dg, dg2, T * Hv, false) && same_bits(r, db, db2, T * Hv, false),
              "T %lld dk %lld: the rule with a keep buffer differs from it without",
              (long long)T, (long long)dk);
    uint8_t *junk = malloc(bytes);
    REQUIRE(junk);
    memset(junk, 0xff, bytes); /* NaN in every fp32 and bf16 element */
    REQUIRE_OK(r->ctx, B->upload(d, r->ctx, K, junk, bytes));
    free(junk);
    REQUIRE_OK(r->ctx, B->gdn_bwd(d, r->ctx, DO, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, dq2, dg2,
                                  db2, K, kc));
    float *x = bp_get(r, 1, dq2, T * C, true);
    int64_t bad = 0;
    for (int64_t i = 0; i < T * C; i++) bad += !isfinite(x[i]);
    free(x);
    CHECK_MSG(bad > 0, "dk %lld: the backward did not read its keep buffer", (long long)dk);
    CHECK(B->gdn_fwd(d, r->ctx, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, o2, K, kc - 1) ==
          LOOM_ERR_INVALID_ARG);
}

static void rule_family(bp_run *r, const rule_case *rc) {
    const int64_t Hk = rc->Hk, Hv = rc->Hv, dk = rc->dk, dv = rc->dv, nd = rc->ndocs;
    const int64_t T = rc->cu[nd], C = 2 * Hk * dk + Hv * dv;
    float *qkv = bp_rnd(r, T * C, -1, 1, true), *dout = bp_rnd(r, T * Hv * dv, -1, 1, true);
    /* the decay's log in (-0.6, -0.01) (the gates' range, ~ -exp(A_log) softplus),
     * the write strength in (0.05, 0.95) */
    float *g = bp_rnd(r, T * Hv, -0.6f, -0.01f, false), *beta = bp_rnd(r, T * Hv, 0.05f, 0.95f, false);
    void *o[2], *dq[2], *dg[2], *db[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *B = r->be[k];
        loom_dev *d = &r->d[k];
        void *CU = bp_raw(r, k, rc->cu, (size_t)(nd + 1) * 4), *Q = bp_in(r, k, qkv, T * C, true);
        void *G = bp_in(r, k, g, T * Hv, false), *BE = bp_in(r, k, beta, T * Hv, false);
        void *DO = bp_in(r, k, dout, T * Hv * dv, true);
        o[k] = bp_outbuf(r, k, T * Hv * dv, true), dq[k] = bp_outbuf(r, k, T * C, true);
        dg[k] = bp_outbuf(r, k, T * Hv, false), db[k] = bp_outbuf(r, k, T * Hv, false);
        REQUIRE_OK(r->ctx, B->gdn_fwd(d, r->ctx, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, o[k], NULL,
                                      0));
        REQUIRE_OK(r->ctx, B->gdn_bwd(d, r->ctx, DO, Q, G, BE, T, Hk, Hv, dk, dv, CU, nd, dq[k],
                                      dg[k], db[k], NULL, 0));
        if (k == 1) rule_kept(r, rc, Q, G, BE, DO, CU, o[1], dq[1], dg[1], db[1]);
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
    bp_same(r, w2, o, T * Hv * dv, true, tol);
    snprintf(w2, sizeof w2, "%sgdn_bwd dqkv", what);
    bp_same(r, w2, dq, T * C, true, tol);
    snprintf(w2, sizeof w2, "%sgdn_bwd dg", what);
    bp_same(r, w2, dg, T * Hv, false, tol);
    snprintf(w2, sizeof w2, "%sgdn_bwd dbeta", what);
    bp_same(r, w2, db, T * Hv, false, tol);
    free(qkv), free(dout), free(g), free(beta);
}

#define GPU_OR_SKIP(r, t)                                                                          \
    do {                                                                                           \
        if (!bp_begin(&(r), (t)))                                                                 \
            SKIP("no GPU (or loom built without CUDA): this compares the CUDA table with the "     \
                 "CPU's");                                                                         \
    } while (0)

TEST(backend_gdn_small_ops_equal_cpu) {
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++) {
        bp_run r;
        GPU_OR_SKIP(r, dts[i]);
        small_family(&r);
        /* 16-bit rows by half-warps at D 48 (part of a half idle) and 128
         * (Qwen3.5's), 900 rows (a block's part); D 160 in passes */
        static const int64_t Ds[] = {48, 128, 160};
        for (size_t k = 0; k < sizeof Ds / sizeof *Ds; k++)
            norm_family(&r, 900, Ds[k]);
        bp_end(&r);
    }
}

/* The convolution's layouts: runs of rows inside one document (the kernels'
 * unchecked path; 64-row runs from 0: [64, 256) here), an odd channel count
 * (no channel pairs in 16-bit data), a kernel past 4 taps. */
TEST(backend_gdn_conv_layouts_equal_cpu) {
    static const int32_t one[] = {0, 260, 300}, two[] = {0, 5, 70, 300};
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++) {
        bp_run r;
        GPU_OR_SKIP(r, dts[i]);
        conv_family(&r, 300, 48, 4, one, 2);
        conv_family(&r, 300, 41, 4, two, 3);
        conv_family(&r, 300, 48, 6, two, 3);
        bp_end(&r);
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
        /* Qwen3.5's dk = dv = 128: prep's X in whole v and k blocks of 64,
         * the later ones copied a block ahead (cp.async) */
        {1, 2, 128, 128, 2, {0, 130, 197}},
        /* 16 value heads over 3 documents: enough units that the state passes
         * put four in a block (of four warps each at dk = dv = 128: 192 blocks
         * of two would be more than the multiprocessors of an H100 or H200) */
        {4, 16, 128, 128, 3, {0, 64, 65, 150}},
        /* 8 over 3: two a block (of eight warps: 96 blocks); the cases above
         * have one a block on a GPU of 100 or more multiprocessors */
        {2, 8, 128, 128, 3, {0, 64, 65, 150}},
    };
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            bp_run r;
            GPU_OR_SKIP(r, dts[i]);
            rule_family(&r, &cases[c]);
            bp_end(&r);
        }
}
