/* CPU glue ops (src/backend/cpu/cpu_glue.h) against direct brute-force
 * computations: the vocab-parallel embedding and cross-entropy (split over
 * several simulated tensor-parallel ranks and recombined, compared with the
 * whole vocabulary in long double), the row permutations, the LoRA dropout
 * mask (its statistics and its invariance under sharding). */
#include <stdlib.h>

#include "../src/backend/cpu/cpu_glue.h"
#include "../src/core/rng.h"
#include "harness.h"

static void fill(float *x, int64_t n, uint64_t key, float sd) {
    for (int64_t i = 0; i < n; i++) x[i] = sd * (float)loom_rng_normal(17, key, (uint64_t)i);
}

static float *falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* ---------------- vocab-parallel embedding ---------------- */

/* This rank holds rows [row0, row0 + rows) of a V-row table; ids cover all
 * of [0, V), so some tokens are another rank's. */
static void embed_case(int64_t V, int64_t row0, int64_t rows, int64_t H, int64_t T) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t t = 0; t < T; t++) /* repeats: every third token is the rank's first row */
        ids[t] = t % 3 == 1 ? (int32_t)row0
                            : (int32_t)(loom_splitmix64((uint64_t)t * 5 + 1) % (uint64_t)V);
    if (T > 1) ids[T - 1] = (int32_t)(row0 + rows); /* just past this rank's rows */
    if (T > 2 && row0 > 0) ids[T - 2] = (int32_t)(row0 - 1); /* just before */
    float *W = falloc(rows * H), *out = falloc(T * H), *dout = falloc(T * H);
    float *dW = falloc(rows * H), *ref = falloc(rows * H);
    fill(W, rows * H, 1, 1);
    fill(dout, T * H, 2, 1);
    fill(dW, rows * H, 3, 1);
    memcpy(ref, dW, sizeof(float) * (size_t)(rows * H));
    for (int64_t i = 0; i < T * H; i++) out[i] = NAN; /* every element must be written */

    loom_cpu_embedding_vp_fwd(ids, T, W, row0, rows, H, out);
    int64_t bad = 0, here = 0;
    for (int64_t t = 0; t < T; t++) {
        bool in = ids[t] >= row0 && ids[t] < row0 + rows;
        here += in;
        for (int64_t j = 0; j < H; j++) {
            float want = in ? W[(ids[t] - row0) * H + j] : 0.0f;
            bad += memcmp(&out[t * H + j], &want, sizeof want) != 0;
        }
    }
    CHECK_MSG(bad == 0, "embedding_vp_fwd V=%lld row0=%lld rows=%lld H=%lld T=%lld: %lld wrong",
              (long long)V, (long long)row0, (long long)rows, (long long)H, (long long)T,
              (long long)bad);
    CHECK(T < 3 || (here > 0 && here < T)); /* the case has tokens of both kinds */

    /* bwd: per element, the in-range tokens added in token order */
    loom_cpu_embedding_vp_bwd(ids, T, dout, row0, rows, H, dW);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < H; j++)
            for (int64_t t = 0; t < T; t++)
                if (ids[t] == row0 + r) ref[r * H + j] += dout[t * H + j];
    CHECK_MSG(memcmp(dW, ref, sizeof(float) * (size_t)(rows * H)) == 0,
              "embedding_vp_bwd V=%lld row0=%lld rows=%lld H=%lld T=%lld not the token-order sums",
              (long long)V, (long long)row0, (long long)rows, (long long)H, (long long)T);
    free(ids), free(W), free(out), free(dout), free(dW), free(ref);
}

TEST(glue_embedding_vp) {
    embed_case(50, 0, 17, 8, 40);     /* first rank */
    embed_case(50, 17, 17, 8, 40);    /* middle rank */
    embed_case(50, 34, 16, 72, 37);   /* last rank */
    embed_case(50, 10, 5, 3, 1);      /* T = 1 */
    embed_case(50, 0, 50, 5, 9);      /* the whole table */
    embed_case(1000, 500, 300, 300, 320); /* T * H past the OpenMP threshold */
}

/* ---------------- vocab-parallel cross-entropy ---------------- */

/* Rows of V logits split over `tp` ranks of Vl columns each (Vl * tp >= V,
 * the rest vocabulary padding, filled with huge values that must be
 * ignored). Each rank's pieces are computed on its columns, combined as the
 * all-reduces would, and compared with the whole row in long double. */
static void ce_case(int64_t c, int64_t V, int tp, int64_t Vl, float sd, float scale) {
    float *full = falloc(c * V);
    int32_t *tgt = malloc(sizeof(int32_t) * (size_t)c);
    fill(full, c * V, 10 + (uint64_t)V, sd);
    for (int64_t r = 0; r < c; r++) {
        tgt[r] = (int32_t)(loom_splitmix64((uint64_t)r + 7) % (uint64_t)V);
        if (r % 5 == 3) tgt[r] = -100;
    }
    if (c > 1) tgt[1] = (int32_t)(V - 1); /* the last real column */
    if (c > 2) full[2 * V + tgt[2]] = 30.0f; /* a confident row */
    float **loc = malloc(sizeof(float *) * (size_t)tp);
    double *mx = malloc(sizeof(double) * (size_t)c), *m1 = malloc(sizeof(double) * (size_t)c);
    double *ce = calloc((size_t)(3 * c), sizeof(double));
    double *c1 = malloc(sizeof(double) * (size_t)(3 * c));
    for (int64_t r = 0; r < c; r++) mx[r] = -INFINITY;
    for (int k = 0; k < tp; k++) { /* the local logits and the max all-reduce */
        const int64_t v0 = k * Vl, nvalid = V - v0; /* may be < 0 or > Vl: clamped */
        loc[k] = falloc(c * Vl);
        for (int64_t r = 0; r < c; r++)
            for (int64_t j = 0; j < Vl; j++)
                loc[k][r * Vl + j] = v0 + j < V ? full[r * V + v0 + j] : 1e30f;
        loom_cpu_ce_vp_max(loc[k], c, Vl, nvalid, m1);
        for (int64_t r = 0; r < c; r++) {
            double want = -INFINITY;
            for (int64_t j = 0; j < Vl && v0 + j < V; j++) want = fmax(want, loc[k][r * Vl + j]);
            CHECK_MSG(m1[r] == want, "ce_vp_max rank %d row %lld: %g vs %g", k, (long long)r,
                      m1[r], want);
            if (m1[r] > mx[r]) mx[r] = m1[r];
        }
    }
    for (int k = 0; k < tp; k++) { /* the sums and their all-reduce */
        const int64_t v0 = k * Vl, nvalid = V - v0;
        loom_cpu_ce_vp_sums(loc[k], c, Vl, nvalid, tgt, v0, mx, c1);
        for (int64_t r = 0; r < c; r++) {
            double se = 0, sez = 0, sabs = 0, zt = 0;
            for (int64_t j = 0; j < Vl && v0 + j < V; j++) {
                double z = loc[k][r * Vl + j], e = exp(z - mx[r]);
                se += e, sez += e * z, sabs += e * fabs(z);
                if (v0 + j == tgt[r]) zt = z;
            }
            CHECK_MSG(fabs(c1[3 * r] - se) <= 1e-13 * se &&
                          fabs(c1[3 * r + 1] - sez) <= 1e-13 * sabs && c1[3 * r + 2] == zt,
                      "ce_vp_sums rank %d row %lld: (%.17g %.17g %.17g) vs (%.17g %.17g %.17g)", k,
                      (long long)r, c1[3 * r], c1[3 * r + 1], c1[3 * r + 2], se, sez, zt);
            for (int i = 0; i < 3; i++) ce[3 * r + i] += c1[3 * r + i];
        }
    }
    /* combined: log-sum-exp, log p(target) and entropy of the whole row */
    double *L = malloc(sizeof(double) * (size_t)c);
    for (int64_t r = 0; r < c; r++) {
        const float *z = full + r * V;
        long double m = -INFINITY, s = 0, sz = 0;
        for (int64_t j = 0; j < V; j++) m = z[j] > m ? z[j] : m;
        for (int64_t j = 0; j < V; j++) s += expl((long double)z[j] - m);
        const long double lse = m + logl(s);
        for (int64_t j = 0; j < V; j++) {
            long double lp = (long double)z[j] - lse;
            sz += expl(lp) * lp;
        }
        L[r] = mx[r] + log(ce[3 * r]);
        CHECK_NEAR(L[r], (double)lse, 1e-12 * (1 + fabsl(lse)));
        CHECK_NEAR(L[r] - ce[3 * r + 1] / ce[3 * r], (double)-sz, 1e-10); /* entropy */
        if (tgt[r] != -100)
            CHECK_NEAR(ce[3 * r + 2] - L[r], (double)(z[tgt[r]] - lse), 1e-12 * (1 + fabsl(lse)));
        else
            CHECK(ce[3 * r + 2] == 0);
    }
    /* grad per rank against scale * (softmax - onehot) of the whole row */
    for (int k = 0; k < tp; k++) {
        const int64_t v0 = k * Vl, nvalid = V - v0;
        float *z = falloc(c * Vl);
        memcpy(z, loc[k], sizeof(float) * (size_t)(c * Vl));
        loom_cpu_ce_vp_grad(z, c, Vl, nvalid, tgt, v0, mx, ce, scale);
        double worst = 0;
        int64_t nonzero = 0, inexact = 0;
        for (int64_t r = 0; r < c; r++)
            for (int64_t j = 0; j < Vl; j++) {
                const float got = z[r * Vl + j], x = loc[k][r * Vl + j];
                if (tgt[r] == -100 || v0 + j >= V) {
                    nonzero += got != 0.0f || signbit(got);
                    continue;
                }
                double p = exp((double)x - L[r]);
                double want = scale * (p - (v0 + j == tgt[r]));
                worst = fmax(worst, fabs(got - want));
                if (scale == 1.0f) { /* bit for bit what head_fwd_bwd computed inline */
                    float old = (float)exp((double)x - L[r]);
                    if (v0 + j == tgt[r]) old -= 1.0f;
                    inexact += memcmp(&old, &got, sizeof old) != 0;
                }
            }
        CHECK_MSG(worst <= 1e-6 * fabs(scale), "ce_vp_grad rank %d: max err %g (scale %g)", k,
                  worst, scale);
        CHECK_MSG(nonzero == 0, "ce_vp_grad rank %d: %lld padding/ignored entries not +0", k,
                  (long long)nonzero);
        CHECK_MSG(inexact == 0, "ce_vp_grad rank %d: %lld entries differ from the old loop", k,
                  (long long)inexact);
        free(z);
    }
    for (int k = 0; k < tp; k++) free(loc[k]);
    free(loc), free(full), free(tgt), free(mx), free(m1), free(ce), free(c1), free(L);
}

TEST(glue_ce_vp) {
    ce_case(23, 100, 1, 100, 3, 1.0f);       /* one rank, no padding */
    ce_case(23, 100, 1, 128, 3, 1.0f);       /* one rank, nvalid < ld */
    ce_case(23, 100, 3, 40, 3, 1.0f);        /* last rank 20 real + 20 padding */
    ce_case(9, 100, 4, 34, 2, 0.25f);        /* last rank nothing real (nvalid < 0) */
    ce_case(1, 77, 2, 39, 5, 1.0f / 3);      /* T = 1 */
    ce_case(40, 5000, 2, 2560, 4, 1.0f / 29); /* past the OpenMP threshold */
}

TEST(glue_ce_vp_edges) {
    /* nvalid = 0: max -inf, sums 0, grad 0 everywhere; ld = 0 touches nothing */
    float z[6] = {1, 2, 3, 4, 5, 6};
    int32_t tg[2] = {0, 4};
    double mx[2], ce[6];
    loom_cpu_ce_vp_max(z, 2, 3, 0, mx);
    CHECK(isinf(mx[0]) && mx[0] < 0 && isinf(mx[1]) && mx[1] < 0);
    double m0[2] = {0, 0};
    loom_cpu_ce_vp_sums(z, 2, 3, 0, tg, 0, m0, ce);
    for (int i = 0; i < 6; i++) CHECK(ce[i] == 0);
    loom_cpu_ce_vp_grad(z, 2, 3, 0, tg, 0, mx, ce, 1.0f);
    for (int i = 0; i < 6; i++) CHECK(z[i] == 0);
    /* a target on this rank but in the padding (global id >= V) is not counted */
    float y[4] = {1, 2, 3, 4};
    int32_t t2[1] = {13};
    loom_cpu_ce_vp_sums(y, 1, 4, 2, t2, 10, m0, ce);
    CHECK(ce[2] == 0);
    t2[0] = 11;
    loom_cpu_ce_vp_sums(y, 1, 4, 2, t2, 10, m0, ce);
    CHECK(ce[2] == 2);
    CHECK_NEAR(ce[0], exp(1.0) + exp(2.0), 1e-12);
}

/* ---------------- row permutations ---------------- */

static void rows_case(int64_t n, int64_t width, size_t esz, uint64_t key) {
    const size_t row = (size_t)width * esz, bytes = (size_t)n * row;
    unsigned char *src = malloc(bytes ? bytes : 1), *dst = malloc(bytes ? bytes : 1),
                  *back = malloc(bytes ? bytes : 1);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    for (size_t i = 0; i < bytes; i++) src[i] = (unsigned char)loom_splitmix64(key + i);
    for (int64_t j = 0; j < n; j++) idx[j] = (int32_t)j;
    for (int64_t j = n - 1; j > 0; j--) { /* Fisher-Yates */
        int64_t k = (int64_t)(loom_splitmix64(key * 31 + (uint64_t)j) % (uint64_t)(j + 1));
        int32_t tmp = idx[j];
        idx[j] = idx[k], idx[k] = tmp;
    }
    loom_cpu_rows_gather(dst, src, idx, n, width, esz);
    int64_t bad = 0;
    for (int64_t j = 0; j < n; j++)
        for (size_t b = 0; b < row; b++)
            bad += dst[(size_t)j * row + b] != src[(size_t)idx[j] * row + b];
    CHECK_MSG(bad == 0, "rows_gather n=%lld width=%lld esz=%zu: %lld bytes wrong", (long long)n,
              (long long)width, esz, (long long)bad);
    /* scatter with the same idx is the inverse (cp_gather undoes cp_reduce's reorder) */
    memset(back, 0xa5, bytes);
    loom_cpu_rows_scatter(back, dst, idx, n, width, esz);
    CHECK_MSG(memcmp(back, src, bytes) == 0,
              "rows_scatter n=%lld width=%lld esz=%zu: not the inverse", (long long)n,
              (long long)width, esz);
    bad = 0;
    loom_cpu_rows_scatter(back, src, idx, n, width, esz);
    for (int64_t j = 0; j < n; j++)
        for (size_t b = 0; b < row; b++)
            bad += back[(size_t)idx[j] * row + b] != src[(size_t)j * row + b];
    CHECK_MSG(bad == 0, "rows_scatter n=%lld width=%lld esz=%zu: %lld bytes wrong", (long long)n,
              (long long)width, esz, (long long)bad);
    free(src), free(dst), free(back), free(idx);
}

TEST(glue_rows_perm) {
    rows_case(1, 5, 4, 1);
    rows_case(37, 24, 2, 2);
    rows_case(37, 24, 4, 3);
    rows_case(20, 7, 3, 4);      /* any element size */
    rows_case(16, 0, 4, 5);      /* empty rows */
    rows_case(0, 8, 4, 6);       /* no rows */
    rows_case(600, 1024, 4, 7);  /* past the OpenMP threshold */
}

/* ---------------- LoRA dropout ---------------- */

TEST(glue_lora_dropout) {
    enum { T = 48, IN = 96, FULL = 384, COL0 = 192 };
    const uint64_t seed = 0x5eed, key = 0xbeef;
    float *x = falloc(T * IN), *out = falloc(T * IN), *io = falloc(T * IN);
    fill(x, T * IN, 40, 1);
    for (int64_t i = 0; i < T * IN; i++)
        if (x[i] == 0) x[i] = 1; /* a dropped element must be told from a kept one */

    /* p = 0: everything kept, unscaled */
    loom_cpu_lora_dropout(out, x, T, IN, FULL, COL0, NULL, 0, seed, key, 0.0);
    CHECK(memcmp(out, x, sizeof(float) * T * IN) == 0);

    /* p = 0.5: about half kept, kept ones doubled, the mask the rng's */
    loom_cpu_lora_dropout(out, x, T, IN, FULL, COL0, NULL, 7, seed, key, 0.5);
    int64_t kept = 0, bad = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < IN; k++) {
            uint64_t i = (uint64_t)(7 + t) * FULL + (uint64_t)(COL0 + k);
            bool keep = loom_rng_uniform(seed, key, i) >= 0.5;
            float v = out[t * IN + k];
            kept += keep;
            bad += keep ? v != 2.0f * x[t * IN + k] : v != 0.0f;
        }
    CHECK_MSG(bad == 0, "lora_dropout p=0.5: %lld elements not x*2 / 0 by the mask",
              (long long)bad);
    CHECK_MSG(kept > T * IN * 45 / 100 && kept < T * IN * 55 / 100, "lora_dropout kept %lld of %d",
              (long long)kept, T * IN);

    /* in place (x NULL) equals out of place */
    memcpy(io, x, sizeof(float) * T * IN);
    loom_cpu_lora_dropout(io, NULL, T, IN, FULL, COL0, NULL, 7, seed, key, 0.5);
    CHECK(memcmp(io, out, sizeof(float) * T * IN) == 0);

    /* p = 0.1: the scale (float)(1 / 0.9) */
    loom_cpu_lora_dropout(out, x, T, IN, FULL, COL0, NULL, 0, seed, key, 0.1);
    const float s = (float)(1.0 / 0.9);
    kept = bad = 0;
    for (int64_t i = 0; i < T * IN; i++) {
        kept += out[i] != 0;
        bad += out[i] != 0 && out[i] != x[i] * s;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_MSG(kept > T * IN * 86 / 100 && kept < T * IN * 94 / 100, "lora_dropout p=0.1 kept %lld",
              (long long)kept);

    /* Sharding does not change the mask: the rows a cp rank holds (qidx) and
     * the columns a tp rank holds (col0) of the full batch's dropout. */
    enum { TF = 64, INF = FULL };
    float *xf = falloc(TF * INF), *of = falloc(TF * INF), *xs = falloc(T * IN);
    fill(xf, TF * INF, 41, 1);
    loom_cpu_lora_dropout(of, xf, TF, INF, FULL, 0, NULL, 100, seed, key, 0.3);
    int32_t qidx[T];
    for (int t = 0; t < T; t++) qidx[t] = (int32_t)((t * 37 + 5) % TF); /* distinct rows */
    for (int t = 0; t < T; t++) memcpy(xs + t * IN, xf + qidx[t] * INF + COL0, sizeof(float) * IN);
    loom_cpu_lora_dropout(out, xs, T, IN, FULL, COL0, qidx, 100, seed, key, 0.3);
    bad = 0;
    for (int t = 0; t < T; t++)
        bad += memcmp(out + t * IN, of + qidx[t] * INF + COL0, sizeof(float) * IN) != 0;
    CHECK_MSG(bad == 0, "lora_dropout: %lld shard rows differ from the full batch's",
              (long long)bad);
    /* T = 1 at global token 100 + 9 */
    loom_cpu_lora_dropout(out, xf + 9 * INF, 1, INF, FULL, 0, NULL, 109, seed, key, 0.3);
    CHECK(memcmp(out, of + 9 * INF, sizeof(float) * INF) == 0);
    /* another key or seed: another mask */
    loom_cpu_lora_dropout(out, xf, 1, INF, FULL, 0, NULL, 100, seed, key + 1, 0.3);
    CHECK(memcmp(out, of, sizeof(float) * INF) != 0);
    free(x), free(out), free(io), free(xf), free(of), free(xs);
}
