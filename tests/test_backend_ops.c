/* The backend table's compute families (src/backend/backend.h) on every
 * backend built in and usable here, held to the CPU backend's results on
 * fresh random inputs: the GEMMs with LoRA's and the input gradient's
 * paths, RoPE with Qwen3's q/k norm, attention (every query, and context
 * parallelism's subset), the vocabulary-parallel cross-entropy, the
 * mixture-of-experts ops (router, route, the rows' moves, the shared
 * expert's gate, grouped GEMMs) and
 * the optimizer's passes. In fp32 and, where the GPU has kernels for it, bf16
 * (the inputs rounded to bf16 first, so both sides see the same values).
 * test_backend.c holds the memory, element-wise and RMSNorm families. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/backend/backend.h"
#include "../src/core/core.h"
#include "../src/core/rng.h"
#include "common/backend_pair.h"
#include "harness.h"

/* n values in [-a, a), rounded to side 1's dtype when act */
static float *rnd(bp_run *r, int64_t n, float a, bool act) { return bp_rnd(r, n, -a, a, act); }

/* ---- GEMMs ---- */

static void gemm_family(bp_run *r) {
    const int64_t T = 192, in_ = 256, o[3] = {128, 64, 64}, R = 8;
    float *x = rnd(r, T * in_, 1, true), *W = rnd(r, 256 * in_, 0.1f, true);
    float *dy[3], *B[3], *u = rnd(r, T * 3 * R, 1, true);
    for (int i = 0; i < 3; i++)
        dy[i] = rnd(r, T * o[i], 1, true), B[i] = rnd(r, o[i] * R, 0.1f, true);
    float *dW0 = rnd(r, o[0] * in_, 1, false);
    void *y[2], *yt[2], *dW[2], *dx[2], *du[2], *dB[2], *yl[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        const loom_dtype t = d->adt;
        void *X = bp_in(r, k, x, T * in_, true), *WW = bp_in(r, k, W, 256 * in_, true);
        void *U = bp_in(r, k, u, T * 3 * R, true), *DY[3], *BB[3];
        for (int i = 0; i < 3; i++)
            DY[i] = bp_in(r, k, dy[i], T * o[i], true), BB[i] = bp_in(r, k, B[i], o[i] * R, true);
        /* y = x W^T; y^T-shaped product with both transposes; dW += dy^T x (fp32 C) */
        y[k] = bp_keep(r, k, (size_t)(T * o[0]) * d->esz);
        REQUIRE_OK(r->ctx, be->gemm(d, r->ctx, false, true, T, o[0], in_, 1.0f, X, in_, WW, in_, t,
                                    0.0f, y[k], t, o[0]));
        yt[k] = bp_keep(r, k, (size_t)(T * in_) * d->esz); /* dy (T, o0) W0 (o0, in), alpha 0.5 */
        REQUIRE_OK(r->ctx, be->gemm(d, r->ctx, false, false, T, in_, o[0], 0.5f, DY[0], o[0], WW,
                                    in_, t, 0.0f, yt[k], t, in_));
        dW[k] = bp_in(r, k, dW0, o[0] * in_, false);
        REQUIRE_OK(r->ctx, be->gemm(d, r->ctx, true, false, o[0], in_, T, 1.0f, DY[0], o[0], X, in_,
                                    t, 1.0f, dW[k], LOOM_F32, in_));
        /* dx = dy0 W0 + dy1 W1 + dy2 W2 (W's first rows as the three weights) */
        loom_dx_term terms[3];
        for (int i = 0, row = 0; i < 3; row += (int)o[i], i++)
            terms[i] = (loom_dx_term){DY[i], o[i], o[i], (char *)WW + (size_t)(row * in_) * d->esz};
        dx[k] = bp_keep(r, k, (size_t)(T * in_) * d->esz);
        REQUIRE_OK(r->ctx, be->dx_sum(d, r->ctx, T, in_, 3, terms, 0.0f, dx[k]));
        /* LoRA's backward over three projections: du (T, 3R), dB += */
        du[k] = bp_keep(r, k, (size_t)(T * 3 * R) * d->esz);
        dB[k] = bp_keep(r, k, (size_t)(256 * R) * 4);
        loom_lora_dy_op ops[3];
        for (int i = 0, row = 0; i < 3; row += (int)o[i], i++)
            ops[i] = (loom_lora_dy_op){o[i],
                                       DY[i],
                                       BB[i],
                                       (char *)U + (size_t)(i * R) * d->esz,
                                       (char *)du[k] + (size_t)(i * R) * d->esz,
                                       (float *)dB[k] + row * R};
        REQUIRE_OK(r->ctx, be->lora_dy_n(d, r->ctx, T, R, 2.0f, 3, ops, 3 * R, 3 * R));
        /* x W^T + s u B^T: the fused GEMM where there is one, else the pair */
        yl[k] = bp_keep(r, k, (size_t)(T * o[0]) * d->esz);
        bool done = false;
        REQUIRE_OK(r->ctx, be->lin_lora_fwd(d, r->ctx, X, T, in_, WW, o[0], U, 3 * R, BB[0], R,
                                            2.0f, yl[k], &done));
        if (!done) {
            REQUIRE_OK(r->ctx, be->gemm(d, r->ctx, false, true, T, o[0], R, 2.0f, U, 3 * R, BB[0],
                                        R, t, 0.0f, yl[k], t, o[0]));
            REQUIRE_OK(r->ctx, be->gemm(d, r->ctx, false, true, T, o[0], in_, 1.0f, X, in_, WW, in_,
                                        t, 1.0f, yl[k], t, o[0]));
        }
    }
    const double tol = bp_tol(r);
    bp_same(r, "gemm (x W^T)", y, T * o[0], true, tol);
    bp_same(r, "gemm (dy W)", yt, T * in_, true, tol);
    bp_same(r, "gemm (dW += dy^T x, fp32)", dW, o[0] * in_, false, tol);
    bp_same(r, "dx_sum", dx, T * in_, true, tol);
    bp_same(r, "lora_dy_n du", du, T * 3 * R, true, tol);
    bp_same(r, "lora_dy_n dB", dB, 256 * R, false, tol);
    bp_same(r, "lin_lora_fwd", yl, T * o[0], true, tol);
    free(x), free(W), free(u), free(dW0);
    for (int i = 0; i < 3; i++)
        free(dy[i]), free(B[i]);
}

/* ---- RoPE, q/k norm with RoPE, attention ---- */

static void attention_family(bp_run *r, bool cp_subset) {
    const int64_t T = 96, Hq = 4, Hkv = 2, D = 128, nd = 3;
    const int32_t cu[4] = {0, 40, 41, 96}; /* a one-token document too */
    int32_t pos[96], qidx[48];
    for (int64_t t = 0, doc = 0; t < T; t++) {
        while (t >= cu[doc + 1])
            doc++;
        pos[t] = (int32_t)(t - cu[doc]);
    }
    const int64_t Tq = cp_subset ? 48 : T;
    for (int64_t i = 0; i < 48; i++)
        qidx[i] = (int32_t)(i < 24 ? i : T - 48 + i); /* cp's halves */
    float inv[64];
    for (int i = 0; i < D / 2; i++)
        inv[i] = (float)pow(1e6, -2.0 * i / (double)D);
    float *q = rnd(r, Tq * Hq * D, 1, true), *kk = rnd(r, T * Hkv * D, 1, true),
          *v = rnd(r, T * Hkv * D, 1, true), *dout = rnd(r, Tq * Hq * D, 1, true),
          *w = rnd(r, D, 1, true), *dyq = rnd(r, Tq * Hq * D, 1, true);
    void *o[2], *lse[2], *dq[2], *dk[2], *dv[2], *qr[2], *qn[2], *rs[2], *dqn[2], *dw[2];
    void *qp[2], *qnp[2], *rsp[2], *dqnp[2], *dwp[2]; /* a partial rotary factor */
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        void *Q = bp_in(r, k, q, Tq * Hq * D, true), *K = bp_in(r, k, kk, T * Hkv * D, true),
             *V = bp_in(r, k, v, T * Hkv * D, true), *DO = bp_in(r, k, dout, Tq * Hq * D, true),
             *WQ = bp_in(r, k, w, D, true), *CU = bp_raw(r, k, cu, sizeof cu),
             *QI = cp_subset ? bp_raw(r, k, qidx, sizeof qidx) : NULL,
             *IF = bp_raw(r, k, inv, sizeof inv);
        int32_t qpos[96];
        for (int64_t i = 0; i < Tq; i++)
            qpos[i] = pos[cp_subset ? qidx[i] : i];
        void *P = bp_raw(r, k, qpos, (size_t)Tq * 4);
        o[k] = bp_keep(r, k, (size_t)(Tq * Hq * D) * d->esz);
        lse[k] = bp_keep(r, k, (size_t)(Tq * Hq) * 4);
        dq[k] = bp_keep(r, k, (size_t)(Tq * Hq * D) * d->esz);
        dk[k] = bp_keep(r, k, (size_t)(T * Hkv * D) * d->esz);
        dv[k] = bp_keep(r, k, (size_t)(T * Hkv * D) * d->esz);
        const float sc = 1.0f / sqrtf((float)D);
        REQUIRE_OK(r->ctx, be->attn_fwd(d, r->ctx, Q, QI, Tq, K, V, T, Hq, Hkv, D, CU, nd, 0, sc,
                                        o[k], lse[k]));
        REQUIRE_OK(r->ctx, be->attn_bwd(d, r->ctx, DO, Q, QI, Tq, K, V, o[k], lse[k], T, Hq, Hkv, D,
                                        CU, nd, 0, sc, dq[k], dk[k], dv[k]));
        /* RoPE forward then backward on a copy of q; q/k norm + RoPE with the
         * table (a GPU's fused kernels) and without */
        qr[k] = bp_keep(r, k, (size_t)(Tq * Hq * D) * d->esz);
        REQUIRE_OK(r->ctx, be->copy(d, r->ctx, qr[k], Q, (size_t)(Tq * Hq * D) * d->esz));
        REQUIRE_OK(r->ctx, be->rope(d, r->ctx, false, qr[k], Tq, Hq, D, D, P, IF));
        /* a partial rotary factor (Qwen3.5): half the head turns */
        qp[k] = bp_keep(r, k, (size_t)(Tq * Hq * D) * d->esz);
        REQUIRE_OK(r->ctx, be->copy(d, r->ctx, qp[k], Q, (size_t)(Tq * Hq * D) * d->esz));
        REQUIRE_OK(r->ctx, be->rope(d, r->ctx, false, qp[k], Tq, Hq, D, D / 2, P, IF));
        REQUIRE_OK(r->ctx, be->rope(d, r->ctx, true, qp[k], Tq, Hq, D, D / 4, P, IF));
        float *tab = k ? bp_keep(r, k, (size_t)(Tq * D) * 4) : NULL;
        const float woff = cp_subset ? 1.0f : 0.0f; /* zero-centred weights (Qwen3.5's) too */
        REQUIRE_OK(r->ctx, be->rope_table(d, r->ctx, P, Tq, D, IF, tab));
        qn[k] = bp_keep(r, k, (size_t)(Tq * Hq * D) * d->esz);
        rs[k] = bp_keep(r, k, (size_t)(Tq * Hq) * 4);
        REQUIRE_OK(r->ctx, be->qknorm_rope_fwd(d, r->ctx, Q, WQ, woff, Tq, Hq, D, D, 1e-6f, P, IF,
                                               tab, qn[k], rs[k]));
        qnp[k] = bp_keep(r, k, (size_t)(Tq * Hq * D) * d->esz);
        rsp[k] = bp_keep(r, k, (size_t)(Tq * Hq) * 4);
        REQUIRE_OK(r->ctx, be->qknorm_rope_fwd(d, r->ctx, Q, WQ, woff, Tq, Hq, D, D / 2, 1e-6f, P,
                                               IF, tab, qnp[k], rsp[k]));
        dqn[k] = bp_in(r, k, dyq, Tq * Hq * D, true);
        dw[k] = bp_keep(r, k, (size_t)D * 4);
        REQUIRE_OK(r->ctx, be->qknorm_rope_bwd(d, r->ctx, dqn[k], Q, WQ, woff, rs[k], Tq, Hq, D, D,
                                               P, IF, tab, dw[k]));
        dqnp[k] = bp_in(r, k, dyq, Tq * Hq * D, true);
        dwp[k] = bp_keep(r, k, (size_t)D * 4);
        REQUIRE_OK(r->ctx, be->qknorm_rope_bwd(d, r->ctx, dqnp[k], Q, WQ, woff, rsp[k], Tq, Hq, D,
                                               D / 2, P, IF, tab, dwp[k]));
        REQUIRE_OK(r->ctx, be->dw_flush(d, r->ctx));
    }
    const double tol = bp_tol(r);
    bp_same(r, "attn_fwd out", o, Tq * Hq * D, true, tol);
    bp_same(r, "attn_fwd lse", lse, Tq * Hq, false, tol);
    bp_same(r, "attn_bwd dq", dq, Tq * Hq * D, true, tol);
    bp_same(r, "attn_bwd dk", dk, T * Hkv * D, true, tol);
    bp_same(r, "attn_bwd dv", dv, T * Hkv * D, true, tol);
    bp_same(r, "rope", qr, Tq * Hq * D, true, tol);
    bp_same(r, "qknorm_rope_fwd", qn, Tq * Hq * D, true, tol);
    bp_same(r, "qknorm_rope_fwd rstd", rs, Tq * Hq, false, tol);
    bp_same(r, "qknorm_rope_bwd dx", dqn, Tq * Hq * D, true, tol);
    bp_same(r, "qknorm_rope_bwd dw", dw, D, false, tol);
    bp_same(r, "rope rd D/2, then back D/4", qp, Tq * Hq * D, true, tol);
    bp_same(r, "qknorm_rope_fwd rd D/2", qnp, Tq * Hq * D, true, tol);
    bp_same(r, "qknorm_rope_bwd rd D/2 dx", dqnp, Tq * Hq * D, true, tol);
    bp_same(r, "qknorm_rope_bwd rd D/2 dw", dwp, D, false, tol);
    free(q), free(kk), free(v), free(dout), free(w), free(dyq);
}

/* ---- the vocabulary-parallel cross-entropy ---- */

static void loss_family(bp_run *r) {
    const int64_t c = 33, ld = 256, nvalid = 250, v0 = 512;
    float *z = rnd(r, c * ld, 8, true);
    int32_t tgt[33];
    for (int64_t i = 0; i < c; i++) /* local, other ranks', ignored */
        tgt[i] = i % 7 == 3 ? -100 : (int32_t)(i % 3 ? v0 + (i * 37) % nvalid : (i * 101) % 2048);
    double *mx[2], *ce[2], *mxf[2], *cef[2];
    void *g[2], *gf[2], *rs[2];
    float *wts = rnd(r, c, 2, false);
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        void *Z = bp_in(r, k, z, c * ld, true), *TG = bp_raw(r, k, tgt, sizeof tgt);
        gf[k] = bp_in(r, k, z, c * ld, true);
        rs[k] = bp_in(r, k, z, c * ld, true);
        REQUIRE_OK(r->ctx, be->rows_scale(d, r->ctx, rs[k], c, ld, bp_in(r, k, wts, c, false)));
        mx[k] = bp_keep(r, k, (size_t)c * 8);
        ce[k] = bp_keep(r, k, (size_t)c * 24);
        mxf[k] = bp_keep(r, k, (size_t)c * 8);
        cef[k] = bp_keep(r, k, (size_t)c * 24);
        REQUIRE_OK(r->ctx, be->ce_max(d, r->ctx, Z, c, ld, nvalid, mx[k]));
        REQUIRE_OK(r->ctx, be->ce_sums(d, r->ctx, Z, c, ld, nvalid, TG, v0, mx[k], ce[k]));
        REQUIRE_OK(r->ctx, be->ce_grad(d, r->ctx, Z, c, ld, nvalid, TG, v0, mx[k], ce[k], 0.5f));
        g[k] = Z;
        REQUIRE_OK(r->ctx, be->ce_fused(d, r->ctx, gf[k], c, ld, nvalid, TG, v0, mxf[k], cef[k],
                                        0.5f, true));
    }
    double *h[2][4];
    for (int k = 0; k < 2; k++) {
        void *src[4] = {mx[k], ce[k], mxf[k], cef[k]};
        for (int j = 0; j < 4; j++) {
            const size_t n = (size_t)c * (j % 2 ? 3 : 1);
            REQUIRE((h[k][j] = malloc(n * 8)));
            REQUIRE_OK(r->ctx, r->be[k]->download(&r->d[k], r->ctx, h[k][j], src[j], n * 8));
        }
    }
    static const char *const what[4] = {"ce_max", "ce_sums", "ce_fused max", "ce_fused sums"};
    for (int j = 0; j < 4; j++) {
        double e = 0.0;
        for (int64_t i = 0; i < c * (j % 2 ? 3 : 1); i++)
            /* exp in fp32 on a GPU: a few ulp a term */
            e = fmax(e, fabs(h[1][j][i] - h[0][j][i]) / (1.0 + fabs(h[0][j][i])));
        CHECK_MSG(e <= 1e-5, "%s (%s): %s differs from the CPU's by %.3g", r->be[1]->name,
                  loom_dtype_name(r->t), what[j], e);
        free(h[0][j]), free(h[1][j]);
    }
    bp_same(r, "ce_grad", g, c * ld, true, bp_tol(r));
    bp_same(r, "ce_fused grad", gf, c * ld, true, bp_tol(r));
    bp_same(r, "rows_scale", rs, c * ld, true, r->t == LOOM_F32 ? 0.0 : bp_tol(r));
    free(z), free(wts);
}

/* ---- the optimizer's passes (fp32): AdamW bit for bit, the norm's sum to
 * rounding, zero_parts exactly ---- */

static void optimizer_family(bp_run *r) {
    const loom_k_part parts[4] = {{0, 0, 40000, true, true},
                                  {40064, 40000, 17, false, true},
                                  {50000, 40017, 20000, true, false}, /* not in the norm */
                                  {70000, 60017, 3, false, true}};
    const int64_t np = 70003, ns = 60020;
    float *w = rnd(r, np, 1, false), *g = rnd(r, ns, 1, false), *m0 = rnd(r, ns, 0.1f, false),
          *v0 = rnd(r, ns, 0.1f, false);
    for (int64_t i = 0; i < ns; i++)
        v0[i] = fabsf(v0[i]);
    const loom_adamw_hp hp = {
        .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    const float gs[2] = {0.5f, 0.8f};
    double sum[2];
    void *W[2], *M[2], *V[2], *G[2];
    for (int k = 0; k < 2; k++) {
        loom_part_lists lists = {0}, zl = {0};
        W[k] = bp_in(r, k, w, np, false), G[k] = bp_in(r, k, g, ns, false);
        M[k] = bp_in(r, k, m0, ns, false), V[k] = bp_in(r, k, v0, ns, false);
        bool wc_done = true;
        REQUIRE_OK(r->ctx, r->be[k]->adamw(&r->d[k], r->ctx, W[k], G[k], M[k], V[k], parts, 4, &hp,
                                           3, gs, NULL, &lists, &wc_done));
        CHECK(!wc_done);
        REQUIRE_OK(r->ctx,
                   r->be[k]->sumsq(&r->d[k], r->ctx, G[k], parts, 4, 0.5f, &lists, &sum[k]));
        REQUIRE_OK(r->ctx, r->be[k]->zero_parts(&r->d[k], r->ctx, G[k], parts + 1, 2, &zl));
        REQUIRE_OK(r->ctx, r->be[k]->zero_parts(&r->d[k], r->ctx, G[k], parts + 1, 2, &zl));
        r->be[k]->lists_free(&r->d[k], &lists);
        r->be[k]->lists_free(&r->d[k], &zl);
        CHECK(!lists.chunks && !zl.chunks);
    }
    CHECK_MSG(fabs(sum[1] - sum[0]) <= 1e-12 * sum[0], "%s: sumsq %.17g, the CPU's %.17g",
              r->be[1]->name, sum[1], sum[0]);
    const char *what[4] = {"adamw w", "adamw m", "adamw v", "zero_parts g"};
    void **bufs[4] = {W, M, V, G};
    for (int j = 0; j < 4; j++) {
        const int64_t n = j ? ns : np;
        float *a = bp_get(r, 1, bufs[j][1], n, false), *b = bp_get(r, 0, bufs[j][0], n, false);
        CHECK_MSG(!memcmp(a, b, (size_t)n * 4), "%s: %s is not the CPU's bit for bit",
                  r->be[1]->name, what[j]);
        free(a), free(b);
    }
    free(w), free(g), free(m0), free(v0);
}

/* ---- mixture of experts ---- */

/* p rounded to side 1's dtype in place (what rnd does for activations) */
static void round_act(bp_run *r, float *p, int64_t n) {
    if (r->t == LOOM_F32)
        return;
    uint16_t *h = malloc((size_t)n * 2);
    MUST(h);
    MUST_OK(r->ctx, loom_convert(r->ctx, h, r->t, p, LOOM_F32, (size_t)n));
    MUST_OK(r->ctx, loom_convert(r->ctx, p, LOOM_F32, h, r->t, (size_t)n));
    free(h);
}

/* int32 output `what` (n values) equal to the CPU's, value for value */
static void same_ints(bp_run *r, const char *what, void *const p[2], int64_t n) {
    int32_t *h[2];
    for (int k = 0; k < 2; k++) {
        MUST((h[k] = malloc((size_t)(n ? n : 1) * 4)));
        MUST_OK(r->ctx, r->be[k]->download(&r->d[k], r->ctx, h[k], p[k], (size_t)n * 4));
    }
    int64_t i = 0;
    while (i < n && h[0][i] == h[1][i])
        i++;
    CHECK_MSG(i == n, "%s (%s): %s[%lld] is %d, the CPU's %d", r->be[1]->name,
              loom_dtype_name(r->t), what, (long long)i, i < n ? h[1][i] : 0, i < n ? h[0][i] : 0);
    free(h[0]), free(h[1]);
}

/* Router logits (N, E), E a power of two: each row a permutation of E levels
 * 8 / E apart, so that no two probabilities of a row are near each other
 * (fp32 softmaxes differing in the last bits choose the same experts) but
 * for deliberate exact ties: rows n % 5 == 1 repeat the largest logit on the
 * second largest's expert (a tie for the first slot), rows n % 5 == 2 come
 * in runs of four equal levels (ties at every slot), rows n % 7 == 3 are all
 * 0 (the first k experts). With E = 8 the last expert is the smallest of
 * every other row: no token picks it while k < E. Rounded to side 1's dtype
 * (distinct levels stay apart or become exact ties). */
static float *router_logits(bp_run *r, int64_t N, int64_t E) {
    float *z = malloc((size_t)(N * E) * sizeof *z);
    MUST(z);
    const double step = 8.0 / (double)E;
    for (int64_t n = 0; n < N; n++) {
        float *zr = z + n * E;
        const uint64_t h = loom_splitmix64(r->seed + (uint64_t)n);
        const int64_t a = (int64_t)(h % (uint64_t)E) | 1, b = (int64_t)((h >> 20) % (uint64_t)E);
        int64_t top = 0, second = 0;
        for (int64_t e = 0; e < E; e++) {
            int64_t lv = (a * e + b) % E; /* a permutation: a is odd, E a power of two */
            if (lv == E - 1)
                top = e;
            if (lv == E - 2)
                second = e;
            if (n % 5 == 2)
                lv = lv / 4 * 4;
            zr[e] = (float)((double)(lv - E / 2) * step);
        }
        if (n % 5 == 1)
            zr[second] = zr[top];
        if (n % 7 == 3)
            for (int64_t e = 0; e < E; e++)
                zr[e] = 0.0f;
        else if (E == 8)
            zr[E - 1] = -6.0f;
    }
    r->seed += 0x9e3779b97f4a7c15ull;
    round_act(r, z, N * E);
    return z;
}

typedef struct router_case {
    int64_t N, E;
    int k;
    bool norm, psum, ga, dw, z; /* z: the z-loss's lse and its gradient */
} router_case;

/* The router forward (probs, w and lse within rounding, idx exactly, psum
 * added to), its backward from the CPU's probs, idx and lse, and route from
 * the CPU's idx (counts, order and pos exactly). */
static void moe_router_family(bp_run *r, const router_case *c) {
    const int64_t N = c->N, E = c->E, NK = N * c->k;
    float *z = router_logits(r, N, E), *ps0 = rnd(r, E, 1, false), *dw = rnd(r, NK, 1, false),
          *ga = rnd(r, E, 0.5f, false);
    const float zc = 0.375f;
    for (int64_t e = 0; e < E; e++)
        ps0[e] = fabsf(ps0[e]);
    void *pr[2], *ix[2], *w[2], *ps[2], *ls[2], *dz[2], *cnt[2], *ord[2], *pos[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        void *Z = bp_in(r, k, z, N * E, true);
        pr[k] = bp_keep(r, k, (size_t)(N * E) * 4);
        ix[k] = bp_keep(r, k, (size_t)NK * 4);
        w[k] = bp_keep(r, k, (size_t)NK * 4);
        ps[k] = c->psum ? bp_in(r, k, ps0, E, false) : NULL;
        ls[k] = c->z ? bp_keep(r, k, (size_t)N * 4) : NULL;
        REQUIRE_OK(r->ctx, be->moe_router_fwd(d, r->ctx, Z, N, E, c->k, c->norm, pr[k], ix[k], w[k],
                                              ps[k], ls[k]));
    }
    const double ptol = 1e-5; /* fp32 softmaxes: a few ulp apart */
    bp_same(r, "moe_router_fwd probs", pr, N * E, false, ptol);
    same_ints(r, "moe_router_fwd idx", ix, NK);
    bp_same(r, "moe_router_fwd w", w, NK, false, ptol);
    if (c->psum)
        bp_same(r, "moe_router_fwd psum", ps, E, false, ptol);
    if (c->z)
        bp_same(r, "moe_router_fwd lse", ls, N, false, ptol);
    /* the backward and route on the CPU's forward, on both sides */
    float *hp = bp_get(r, 0, pr[0], N * E, false), *hl = c->z ? bp_get(r, 0, ls[0], N, false) : NULL;
    int32_t *hi = malloc((size_t)NK * 4);
    MUST(hi);
    memcpy(hi, ix[0], (size_t)NK * 4); /* side 0's memory is the host's */
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        void *P = bp_in(r, k, hp, N * E, false), *I = bp_raw(r, k, hi, (size_t)NK * 4);
        void *DW = c->dw ? bp_in(r, k, dw, NK, false) : NULL,
             *GA = c->ga ? bp_in(r, k, ga, E, false) : NULL,
             *LS = c->z ? bp_in(r, k, hl, N, false) : NULL,
             *ZC = c->z ? bp_in(r, k, &zc, 1, false) : NULL;
        dz[k] = bp_keep(r, k, (size_t)(N * E) * d->esz);
        REQUIRE_OK(r->ctx,
                   be->moe_router_bwd(d, r->ctx, P, I, DW, GA, LS, ZC, N, E, c->k, c->norm, dz[k]));
        cnt[k] = bp_keep(r, k, (size_t)E * 4);
        ord[k] = bp_keep(r, k, (size_t)NK * 4);
        pos[k] = bp_keep(r, k, (size_t)NK * 4);
        REQUIRE_OK(r->ctx, be->moe_route(d, r->ctx, I, NULL, N, E, c->k, -1, false, cnt[k], ord[k],
                                         pos[k]));
    }
    bp_same(r, "moe_router_bwd dz", dz, N * E, true, bp_tol(r));
    same_ints(r, "moe_route counts", cnt, E);
    same_ints(r, "moe_route order", ord, NK);
    same_ints(r, "moe_route pos", pos, NK);
    if (E == 8 && c->k < 8) /* the expert no token picks */
        CHECK_EQ_INT(((const int32_t *)cnt[0])[7], 0);
    free(z), free(ps0), free(dw), free(ga), free(hp), free(hl), free(hi);
}

/* route alone on larger choice lists (many chunks, up to the most experts),
 * synthetic choices: experts e >= E - 3 get none */
static void moe_route_family(bp_run *r, int64_t N, int64_t E, int kk) {
    const int64_t NK = N * kk;
    int32_t *idx = malloc((size_t)NK * 4);
    MUST(idx);
    for (int64_t n = 0; n < N; n++) {
        const uint64_t h = loom_splitmix64(r->seed + (uint64_t)n);
        for (int j = 0; j < kk; j++) /* distinct within a token */
            idx[n * kk + j] = (int32_t)(((int64_t)(h % (uint64_t)(E - 3)) + j) % (E - 3));
    }
    r->seed += 0x9e3779b97f4a7c15ull;
    void *cnt[2], *ord[2], *pos[2];
    for (int k = 0; k < 2; k++) {
        void *I = bp_raw(r, k, idx, (size_t)NK * 4);
        cnt[k] = bp_keep(r, k, (size_t)E * 4);
        ord[k] = bp_keep(r, k, (size_t)NK * 4);
        pos[k] = bp_keep(r, k, (size_t)NK * 4);
        REQUIRE_OK(r->ctx, r->be[k]->moe_route(&r->d[k], r->ctx, I, NULL, N, E, kk, -1, false,
                                               cnt[k], ord[k], pos[k]));
    }
    same_ints(r, "moe_route counts", cnt, E);
    same_ints(r, "moe_route order", ord, NK);
    same_ints(r, "moe_route pos", pos, NK);
    free(idx);
}

/* route with a capacity of cap choices an expert, dropping by weight or by
 * position: skewed choices (expert h % (E / 4) first, so a few experts
 * overflow), weights on a coarse grid (exact ties among an expert's) */
static void moe_route_cap_family(bp_run *r, int64_t N, int64_t E, int kk, int64_t cap, bool by_pos) {
    const int64_t NK = N * kk;
    int32_t *idx = malloc((size_t)NK * 4);
    float *w = malloc((size_t)NK * 4);
    MUST(idx && w);
    for (int64_t n = 0; n < N; n++) {
        const uint64_t h = loom_splitmix64(r->seed + (uint64_t)n);
        for (int j = 0; j < kk; j++) {
            idx[n * kk + j] = (int32_t)(((int64_t)(h % (uint64_t)(E / 4)) + j) % E);
            w[n * kk + j] = (float)((h >> (8 + 4 * j)) % 16) / 16.0f;
        }
    }
    r->seed += 0x9e3779b97f4a7c15ull;
    void *cnt[2], *ord[2], *pos[2];
    for (int k = 0; k < 2; k++) {
        void *I = bp_raw(r, k, idx, (size_t)NK * 4), *W = bp_in(r, k, w, NK, false);
        cnt[k] = bp_keep(r, k, (size_t)E * 4);
        ord[k] = bp_keep(r, k, (size_t)NK * 4);
        pos[k] = bp_keep(r, k, (size_t)NK * 4);
        REQUIRE_OK(r->ctx, r->be[k]->moe_route(&r->d[k], r->ctx, I, W, N, E, kk, cap, by_pos,
                                               cnt[k], ord[k], pos[k]));
    }
    same_ints(r, by_pos ? "moe_route (position) counts" : "moe_route (probs) counts", cnt, E);
    same_ints(r, by_pos ? "moe_route (position) order" : "moe_route (probs) order", ord, NK);
    same_ints(r, by_pos ? "moe_route (position) pos" : "moe_route (probs) pos", pos, NK);
    int64_t dropped = 0;
    for (int64_t c = 0; c < NK; c++)
        dropped += ((const int32_t *)pos[0])[c] < 0;
    CHECK_MSG(dropped > 0, "N=%lld E=%lld cap=%lld: no choice dropped", (long long)N, (long long)E,
              (long long)cap);
    free(idx), free(w);
}

/* permute, combine and their backwards on the CPU's route of synthetic
 * choices (cap >= 0: with that capacity, dropping by weight; the rows of
 * the dropped are not written, so only the kept ones are compared); H a
 * multiple of 8 takes the GPU's 16-byte paths, others not */
static void moe_rows_family(bp_run *r, int64_t N, int64_t E, int kk, int64_t H, int64_t cap) {
    const int64_t NK = N * kk;
    int32_t *idx = malloc((size_t)NK * 4), *cnt = malloc((size_t)E * 4),
            *order = malloc((size_t)NK * 4), *pos = malloc((size_t)NK * 4);
    MUST(idx && cnt && order && pos);
    for (int64_t n = 0; n < N; n++) {
        const uint64_t h = loom_splitmix64(r->seed + (uint64_t)n);
        for (int j = 0; j < kk; j++) /* distinct; the upper half of the experts less often */
            idx[n * kk + j] = (int32_t)(((int64_t)(h % (uint64_t)(E / 2)) + j) % E);
    }
    float *x = rnd(r, N * H, 1, true), *yg = rnd(r, NK * H, 1, true), *dy = rnd(r, N * H, 1, true),
          *dxg = rnd(r, NK * H, 1, true), *w = rnd(r, NK, 1, false);
    MUST_OK(r->ctx,
            r->be[0]->moe_route(&r->d[0], r->ctx, idx, w, N, E, kk, cap, false, cnt, order, pos));
    int64_t R = 0; /* the kept rows */
    for (int64_t e = 0; e < E; e++)
        R += cap >= 0 && cnt[e] > cap ? cap : cnt[e];
    if (cap >= 0)
        CHECK(R < NK);
    void *xg[2], *y[2], *dyg[2], *dw[2], *dx[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        void *O = bp_raw(r, k, order, (size_t)NK * 4), *P = bp_raw(r, k, pos, (size_t)NK * 4),
             *W = bp_in(r, k, w, NK, false), *X = bp_in(r, k, x, N * H, true),
             *YG = bp_in(r, k, yg, NK * H, true), *DY = bp_in(r, k, dy, N * H, true),
             *DXG = bp_in(r, k, dxg, NK * H, true);
        xg[k] = bp_keep(r, k, (size_t)(NK * H) * d->esz);
        y[k] = bp_keep(r, k, (size_t)(N * H) * d->esz);
        dyg[k] = bp_keep(r, k, (size_t)(NK * H) * d->esz);
        dw[k] = bp_keep(r, k, (size_t)NK * 4);
        dx[k] = bp_keep(r, k, (size_t)(N * H) * d->esz);
        REQUIRE_OK(r->ctx, be->moe_permute(d, r->ctx, X, O, N, kk, H, xg[k]));
        REQUIRE_OK(r->ctx, be->moe_combine(d, r->ctx, YG, P, W, N, kk, H, y[k]));
        REQUIRE_OK(r->ctx, be->moe_combine_bwd(d, r->ctx, DY, YG, O, W, N, kk, H, dyg[k], dw[k]));
        REQUIRE_OK(r->ctx, be->moe_permute_bwd(d, r->ctx, DXG, P, N, kk, H, dx[k]));
    }
    const double tol = bp_tol(r);
    bp_same(r, "moe_permute", xg, R * H, true, 0.0);
    bp_same(r, "moe_combine", y, N * H, true, tol);
    bp_same(r, "moe_combine_bwd dyg", dyg, R * H, true, tol);
    bp_same(r, "moe_combine_bwd dw", dw, NK, false, 1e-4); /* dots of the same values */
    bp_same(r, "moe_permute_bwd", dx, N * H, true, tol);
    free(idx), free(cnt), free(order), free(pos);
    free(x), free(yg), free(dy), free(dxg), free(w);
}

/* The shared expert's gate: g = sigmoid(z), y = g s accumulated and not,
 * g alone, and the gate's gradient (1 - g) rowdot(da, a); H and I multiples
 * of 8 take the GPU's 16-byte paths, others not */
static void moe_gate_family(bp_run *r, int64_t N, int64_t H, int64_t I) {
    float *z = rnd(r, N, 4, true), *s = rnd(r, N * H, 1, true), *y0 = rnd(r, N * H, 1, true),
          *da = rnd(r, N * I, 1, true), *a = rnd(r, N * I, 1, true);
    void *g[2], *g2[2], *y[2], *y2[2], *dz[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        void *Z = bp_in(r, k, z, N, true), *S = bp_in(r, k, s, N * H, true),
             *DA = bp_in(r, k, da, N * I, true), *A = bp_in(r, k, a, N * I, true);
        y[k] = bp_in(r, k, y0, N * H, true);
        y2[k] = bp_keep(r, k, (size_t)(N * H) * d->esz);
        g[k] = bp_keep(r, k, (size_t)N * 4);
        g2[k] = bp_keep(r, k, (size_t)N * 4);
        dz[k] = bp_keep(r, k, (size_t)N * d->esz);
        REQUIRE_OK(r->ctx, be->moe_gate_fwd(d, r->ctx, Z, S, N, H, true, g[k], y[k]));
        REQUIRE_OK(r->ctx, be->moe_gate_fwd(d, r->ctx, NULL, S, N, H, false, g[k], y2[k]));
        REQUIRE_OK(r->ctx, be->moe_gate_fwd(d, r->ctx, Z, NULL, N, H, false, g2[k], NULL));
        REQUIRE_OK(r->ctx, be->moe_gate_bwd(d, r->ctx, DA, A, g[k], N, I, dz[k]));
    }
    const double tol = bp_tol(r);
    bp_same(r, "moe_gate_fwd g", g, N, false, 1e-6);
    bp_same(r, "moe_gate_fwd g alone", g2, N, false, 1e-6);
    bp_same(r, "moe_gate_fwd y += g s", y, N * H, true, tol);
    bp_same(r, "moe_gate_fwd y = g s", y2, N * H, true, tol);
    bp_same(r, "moe_gate_bwd dz", dz, N, true, r->t == LOOM_F32 ? 1e-4 : 1e-2);
    free(z), free(s), free(y0), free(da), free(a);
}

TEST(backend_moe_gate_ops_equal_cpu) {
    static const struct {
        int64_t N, H, I;
    } cases[] = {{37, 72, 48}, {37, 70, 30}, {300, 136, 200}, {1, 6, 3}};
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            bp_run r;
            if (!bp_begin(&r, dts[i]))
                SKIP("no GPU (or loom built without CUDA): this compares the CUDA table with the "
                     "CPU's");
            moe_gate_family(&r, cases[c].N, cases[c].H, cases[c].I);
            bp_end(&r);
        }
}

/* The experts' three grouped GEMMs over G groups of cnt[g] rows (zeros
 * among them): forward y_g = x_g W_g^T, input gradient dx_g = dy_g W_g, and
 * weight gradient dW_g += dy_g^T x_g into fp32 (K = cnt[g], 0 included); then
 * the weight gradient with beta 0, alpha 0.5 (the groups of no rows zeroed). */
static void moe_gemm_family(bp_run *r, int G, const int64_t *cnt, int64_t in_, int64_t out_) {
    int64_t T = 0;
    for (int i = 0; i < G; i++)
        T += cnt[i];
    float *x = rnd(r, T * in_, 1, true), *W = rnd(r, G * out_ * in_, 0.1f, true),
          *dy = rnd(r, T * out_, 1, true), *dW0 = rnd(r, G * out_ * in_, 1, false);
    loom_gemm_group *g = malloc((size_t)G * sizeof *g);
    MUST(g);
    void *y[2], *dx[2], *dW[2], *dWz[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        const loom_dtype t = d->adt;
        const size_t es = d->esz;
        char *X = bp_in(r, k, x, T * in_, true), *WW = bp_in(r, k, W, G * out_ * in_, true),
             *DY = bp_in(r, k, dy, T * out_, true);
        char *Y = bp_keep(r, k, (size_t)(T * out_) * es), *DX = bp_keep(r, k, (size_t)(T * in_) * es);
        char *DWp = bp_in(r, k, dW0, G * out_ * in_, false),
             *DWz = bp_in(r, k, dW0, G * out_ * in_, false);
        y[k] = Y, dx[k] = DX, dW[k] = DWp, dWz[k] = DWz;
        int64_t off = 0;
        for (int i = 0; i < G; off += cnt[i], i++)
            g[i] = (loom_gemm_group){.A = X + (size_t)(off * in_) * es,
                                     .B = WW + (size_t)(i * out_ * in_) * es,
                                     .C = Y + (size_t)(off * out_) * es,
                                     .M = cnt[i],
                                     .N = out_,
                                     .K = in_};
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, false, true, G, g, 1.0f, in_, in_, t, 0.0f,
                                            t, out_));
        off = 0;
        for (int i = 0; i < G; off += cnt[i], i++)
            g[i] = (loom_gemm_group){.A = DY + (size_t)(off * out_) * es,
                                     .B = WW + (size_t)(i * out_ * in_) * es,
                                     .C = DX + (size_t)(off * in_) * es,
                                     .M = cnt[i],
                                     .N = in_,
                                     .K = out_};
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, false, false, G, g, 1.0f, out_, in_, t, 0.0f,
                                            t, in_));
        for (int pass = 0; pass < 2; pass++) {
            off = 0;
            for (int i = 0; i < G; off += cnt[i], i++)
                g[i] = (loom_gemm_group){.A = DY + (size_t)(off * out_) * es,
                                         .B = X + (size_t)(off * in_) * es,
                                         .C = (pass ? DWz : DWp) + (size_t)(i * out_ * in_) * 4,
                                         .M = out_,
                                         .N = in_,
                                         .K = cnt[i]};
            REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, true, false, G, g, pass ? 0.5f : 1.0f,
                                                out_, in_, t, pass ? 0.0f : 1.0f, LOOM_F32, in_));
        }
    }
    const double tol = bp_tol(r);
    bp_same(r, "gemm_grouped (x_g W_g^T)", y, T * out_, true, tol);
    bp_same(r, "gemm_grouped (dy_g W_g)", dx, T * in_, true, tol);
    bp_same(r, "gemm_grouped (dW_g += dy_g^T x_g, fp32)", dW, G * out_ * in_, false, tol);
    bp_same(r, "gemm_grouped (dW_g = dy_g^T x_g / 2, fp32)", dWz, G * out_ * in_, false, tol);
    free(x), free(W), free(dy), free(dW0), free(g);
}

/* LoRA's six grouped products on the experts (block_moe.c's lora_gemm), rank
 * rk, over G groups of cnt[g] rows: u = x A_g^T, y += s u B_g^T, du = s dy
 * B_g, dx += du A_g, dB_g += s dy_g^T u_g and dA_g += du_g^T x_g (fp32),
 * then dA_g = du_g^T x_g / 2 (beta 0: the groups of no rows zeroed). On a GPU
 * these are loom_cuda_gemm_skinny's rowdot, expand and reduce kernels. */
static void moe_lora_gemm_family(bp_run *r, int G, const int64_t *cnt, int64_t rk, int64_t out_) {
    const int64_t in_ = 64;
    const float sc = 2.0f;
    int64_t T = 0;
    for (int i = 0; i < G; i++)
        T += cnt[i];
    float *x = rnd(r, T * in_, 1, true), *A = rnd(r, G * rk * in_, 0.1f, true),
          *B = rnd(r, G * out_ * rk, 0.1f, true), *dy = rnd(r, T * out_, 1, true),
          *y0 = rnd(r, T * out_, 1, true), *dx0 = rnd(r, T * in_, 1, true),
          *dB0 = rnd(r, G * out_ * rk, 1, false), *dA0 = rnd(r, G * rk * in_, 1, false);
    loom_gemm_group *g = malloc((size_t)G * sizeof *g);
    MUST(g);
    void *u[2], *y[2], *du[2], *dx[2], *dB[2], *dA[2], *dAz[2];
    for (int k = 0; k < 2; k++) {
        const loom_backend *be = r->be[k];
        loom_dev *d = &r->d[k];
        const loom_dtype t = d->adt;
        const size_t es = d->esz;
        char *X = bp_in(r, k, x, T * in_, true), *AA = bp_in(r, k, A, G * rk * in_, true),
             *BB = bp_in(r, k, B, G * out_ * rk, true), *DY = bp_in(r, k, dy, T * out_, true);
        char *U = bp_keep(r, k, (size_t)(T * rk) * es), *DU = bp_keep(r, k, (size_t)(T * rk) * es);
        char *Y = bp_in(r, k, y0, T * out_, true), *DX = bp_in(r, k, dx0, T * in_, true);
        char *DB = bp_in(r, k, dB0, G * out_ * rk, false), *DA = bp_in(r, k, dA0, G * rk * in_, false),
             *DAz = bp_in(r, k, dA0, G * rk * in_, false);
        u[k] = U, y[k] = Y, du[k] = DU, dx[k] = DX, dB[k] = DB, dA[k] = DA, dAz[k] = DAz;
#define GROUPS(a, b, c, m, n, kk)                                                                  \
    do {                                                                                           \
        int64_t off = 0;                                                                           \
        for (int i = 0; i < G; off += cnt[i], i++)                                                 \
            g[i] = (loom_gemm_group){.A = (a), .B = (b), .C = (c), .M = (m), .N = (n), .K = (kk)}; \
    } while (0)
        GROUPS(X + (size_t)(off * in_) * es, AA + (size_t)(i * rk * in_) * es,
               U + (size_t)(off * rk) * es, cnt[i], rk, in_);
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, false, true, G, g, 1.0f, in_, in_, t, 0.0f,
                                            t, rk));
        GROUPS(U + (size_t)(off * rk) * es, BB + (size_t)(i * out_ * rk) * es,
               Y + (size_t)(off * out_) * es, cnt[i], out_, rk);
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, false, true, G, g, sc, rk, rk, t, 1.0f, t,
                                            out_));
        GROUPS(DY + (size_t)(off * out_) * es, BB + (size_t)(i * out_ * rk) * es,
               DU + (size_t)(off * rk) * es, cnt[i], rk, out_);
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, false, false, G, g, sc, out_, rk, t, 0.0f,
                                            t, rk));
        GROUPS(DU + (size_t)(off * rk) * es, AA + (size_t)(i * rk * in_) * es,
               DX + (size_t)(off * in_) * es, cnt[i], in_, rk);
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, false, false, G, g, 1.0f, rk, in_, t, 1.0f,
                                            t, in_));
        GROUPS(DY + (size_t)(off * out_) * es, U + (size_t)(off * rk) * es,
               DB + (size_t)(i * out_ * rk) * 4, out_, rk, cnt[i]);
        REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, true, false, G, g, sc, out_, rk, t, 1.0f,
                                            LOOM_F32, rk));
        for (int pass = 0; pass < 2; pass++) {
            GROUPS(DU + (size_t)(off * rk) * es, X + (size_t)(off * in_) * es,
                   (pass ? DAz : DA) + (size_t)(i * rk * in_) * 4, rk, in_, cnt[i]);
            REQUIRE_OK(r->ctx, be->gemm_grouped(d, r->ctx, true, false, G, g, pass ? 0.5f : 1.0f,
                                                rk, in_, t, pass ? 0.0f : 1.0f, LOOM_F32, in_));
        }
#undef GROUPS
    }
    const double tol = bp_tol(r);
    bp_same(r, "gemm_grouped (LoRA u = x A_g^T)", u, T * rk, true, tol);
    bp_same(r, "gemm_grouped (LoRA y += s u B_g^T)", y, T * out_, true, tol);
    bp_same(r, "gemm_grouped (LoRA du = s dy B_g)", du, T * rk, true, tol);
    bp_same(r, "gemm_grouped (LoRA dx += du A_g)", dx, T * in_, true, tol);
    bp_same(r, "gemm_grouped (LoRA dB_g += s dy_g^T u_g, fp32)", dB, G * out_ * rk, false, tol);
    bp_same(r, "gemm_grouped (LoRA dA_g += du_g^T x_g, fp32)", dA, G * rk * in_, false, tol);
    bp_same(r, "gemm_grouped (LoRA dA_g = du_g^T x_g / 2, fp32)", dAz, G * rk * in_, false, tol);
    free(x), free(A), free(B), free(dy), free(y0), free(dx0), free(dB0), free(dA0), free(g);
}

#define GPU_OR_SKIP(r, t)                                                                          \
    do {                                                                                           \
        if (!bp_begin(&(r), (t)))                                                                 \
            SKIP("no GPU (or loom built without CUDA): this compares the CUDA table with the "     \
                 "CPU's");                                                                         \
    } while (0)

TEST(backend_gemm_ops_equal_cpu) {
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++) {
        bp_run r;
        GPU_OR_SKIP(r, dts[i]);
        gemm_family(&r);
        bp_end(&r);
    }
}

TEST(backend_attention_ops_equal_cpu) {
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 4; i++) {
        bp_run r;
        GPU_OR_SKIP(r, dts[i / 2]);
        attention_family(&r, i % 2);
        bp_end(&r);
    }
}

TEST(backend_loss_ops_equal_cpu) {
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++) {
        bp_run r;
        GPU_OR_SKIP(r, dts[i]);
        loss_family(&r);
        bp_end(&r);
    }
}

TEST(backend_optimizer_ops_equal_cpu) {
    bp_run r;
    GPU_OR_SKIP(r, LOOM_F32);
    optimizer_family(&r);
    bp_end(&r);
}

/* E = 8 and 128 (and the most, 2048), k = 1, 2 and 8, N not a multiple of
 * the GPU's rows a block; norm_topk, psum, ga, dw and the z-loss each on
 * and off */
TEST(backend_moe_router_ops_equal_cpu) {
    static const router_case cases[] = {
        {37, 8, 1, false, false, true, true, true},
        {37, 8, 2, true, true, false, true, false},
        {1000, 8, 8, true, true, true, false, true},
        {1000, 128, 2, false, true, true, true, false},
        {300, 128, 8, true, false, false, true, true},
        {129, 128, 1, true, true, true, true, false},
        {50, 2048, 8, true, true, true, true, true},
        {7, 128, 2, false, false, false, false, true},
    };
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            bp_run r;
            GPU_OR_SKIP(r, dts[i]);
            moe_router_family(&r, &cases[c]);
            bp_end(&r);
        }
}

TEST(backend_moe_route_equals_cpu) {
    static const struct {
        int64_t N, E;
        int k;
    } cases[] = {{40000, 128, 8}, {3001, 512, 8}, {700, 2048, 16}, {1, 8, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        bp_run r;
        GPU_OR_SKIP(r, LOOM_F32);
        moe_route_family(&r, cases[c].N, cases[c].E, cases[c].k);
        bp_end(&r);
    }
}

/* capacities below, at and near an expert's load; both policies; many
 * chunks and the most experts (the second pass groups 2E) */
TEST(backend_moe_route_capacity_equals_cpu) {
    static const struct {
        int64_t N, E;
        int k;
        int64_t cap;
    } cases[] = {{37, 8, 2, 5},        {37, 8, 2, 0},      {3001, 128, 8, 40},
                 {40000, 128, 8, 700}, {700, 2048, 16, 3}, {300, 16, 4, 90}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int by_pos = 0; by_pos < 2; by_pos++) {
            bp_run r;
            GPU_OR_SKIP(r, LOOM_F32);
            moe_route_cap_family(&r, cases[c].N, cases[c].E, cases[c].k, cases[c].cap, by_pos);
            bp_end(&r);
        }
}

/* cap >= 0: with a capacity (the dropped choices' rows skipped) */
TEST(backend_moe_rows_ops_equal_cpu) {
    static const struct {
        int64_t N, E;
        int k;
        int64_t H, cap;
    } cases[] = {{37, 8, 2, 72, -1}, {37, 8, 8, 70, -1}, {300, 128, 8, 136, -1},
                 {5, 128, 1, 6, -1}, {37, 8, 2, 72, 5},  {300, 128, 8, 136, 12}};
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            bp_run r;
            GPU_OR_SKIP(r, dts[i]);
            moe_rows_family(&r, cases[c].N, cases[c].E, cases[c].k, cases[c].H, cases[c].cap);
            bp_end(&r);
        }
}

/* each dtype with cuBLAS's grouped call where it applies, then with one GEMM
 * a group (LOOM_GEMM_GROUPED=loop, read when the GPU's table is set up) */
TEST(backend_moe_gemm_grouped_equals_cpu) {
    static const int64_t c8[8] = {5, 0, 17, 1, 0, 33, 9, 2}, c4[4] = {700, 0, 129, 1100};
    int64_t c128[128];
    for (int i = 0; i < 128; i++) {
        const uint64_t h = loom_splitmix64((uint64_t)i * 7919u);
        c128[i] = h % 5 == 0 ? 0 : (int64_t)(h >> 8) % 13;
    }
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int mode = 0; mode < 2; mode++)
        for (int i = 0; i < 2; i++) {
            if (mode)
                setenv("LOOM_GEMM_GROUPED", "loop", 1);
            else
                unsetenv("LOOM_GEMM_GROUPED");
            bp_run r;
            GPU_OR_SKIP(r, dts[i]);
            moe_gemm_family(&r, 8, c8, 64, 48);
            moe_gemm_family(&r, 128, c128, 64, 48);
            moe_gemm_family(&r, 4, c4, 256, 256); /* a group alone (1100 rows: cuBLASLt) */
            bp_end(&r);
        }
    unsetenv("LOOM_GEMM_GROUPED");
}

/* LoRA's grouped products on the experts: on a GPU loom's skinny kernels
 * (the row dot products on tensor cores where K is a multiple of 32: K = 64
 * and 96 take them, K = 48 the FMA kernel; the sums over rows by the
 * vector kernel), then (LOOM_GEMM_GROUPED=loop) one cuBLASLt GEMM a group,
 * then with the FMA row dot products and the scalar sums over rows
 * (LOOM_SKINNY_MMA=0, LOOM_SKINNY_REDUCE=scalar); ranks 4, 8 and 16, groups
 * of no rows among them, and groups longer than a chunk of the sums over
 * rows (128) */
TEST(backend_moe_lora_gemm_grouped_equals_cpu) {
    static const int64_t c8[8] = {5, 0, 17, 1, 0, 33, 9, 2}, c4[4] = {700, 0, 129, 1100};
    int64_t c128[128];
    for (int i = 0; i < 128; i++) {
        const uint64_t h = loom_splitmix64((uint64_t)i * 104729u);
        c128[i] = h % 4 == 0 ? 0 : (int64_t)(h >> 8) % 11;
    }
    const struct {
        int G;
        const int64_t *cnt;
        int64_t rk;
    } cases[] = {{8, c8, 8}, {128, c128, 4}, {8, c8, 16}, {4, c4, 8}};
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int mode = 0; mode < 3; mode++)
        for (int i = 0; i < 2; i++)
            for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
                if (mode == 1)
                    setenv("LOOM_GEMM_GROUPED", "loop", 1);
                else
                    unsetenv("LOOM_GEMM_GROUPED");
                if (mode == 2) {
                    setenv("LOOM_SKINNY_MMA", "0", 1);
                    setenv("LOOM_SKINNY_REDUCE", "scalar", 1);
                } else {
                    unsetenv("LOOM_SKINNY_MMA");
                    unsetenv("LOOM_SKINNY_REDUCE");
                }
                bp_run r;
                GPU_OR_SKIP(r, dts[i]);
                moe_lora_gemm_family(&r, cases[c].G, cases[c].cnt, cases[c].rk, c % 2 ? 96 : 48);
                bp_end(&r);
            }
    unsetenv("LOOM_GEMM_GROUPED");
    unsetenv("LOOM_SKINNY_MMA");
    unsetenv("LOOM_SKINNY_REDUCE");
}

/* Every backend fills every slot of its table (a NULL would crash the model
 * on the first use of that op, far from here), the Gated DeltaNet ops
 * (gdn_conv_fwd .. gdn_norm_bwd) included. */
TEST(backend_tables_are_complete) {
    const loom_backend *all[2] = {loom_backend_cpu(), loom_backend_cuda()};
    for (int b = 0; b < 2; b++) {
        if (!all[b])
            continue;
        const void *const *p = (const void *const *)all[b];
        const size_t n = offsetof(loom_backend, attn_max_d) / sizeof(void *);
        for (size_t i = 1; i < n; i++)
            CHECK_MSG(p[i] != NULL, "%s backend: table slot %zu is empty", all[b]->name, i);
        CHECK(all[b]->attn_max_d >= 128);
        const size_t from = offsetof(loom_backend, ce_max) / sizeof(void *),
                     to = sizeof(loom_backend) / sizeof(void *);
        for (size_t i = from; i < to; i++)
            CHECK_MSG(p[i] != NULL, "%s backend: table slot %zu is empty", all[b]->name, i);
    }
}
