/* CUDA glue ops (src/backend/cuda/cuda_glue.h) against the CPU glue ops
 * (src/backend/cpu/cpu_glue.h) on fresh random inputs. Built only with
 * `make CUDA=1`; skipped when no GPU is visible. Inputs are rounded to the
 * tested dtype first, so both sides see the same values; outputs that the
 * ops promise bit for bit (embedding, row permutations, dropout, the
 * max) are compared exactly, the rest within 1e-5 relative (fp32 outputs),
 * 1e-2 (bf16/f16 outputs) or 1e-11 (the double sums, another order). */
#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime.h>
#include <stdlib.h>

#include "../src/backend/cpu/cpu_glue.h"
#include "../src/backend/cuda/cuda_backend.h"
#include "../src/backend/cuda/cuda_glue.h"
#include "../src/core/rng.h"
#include "harness.h"

#include "cuda_test.h"

/* ---------------- vocab-parallel embedding ---------------- */

static void embed_case(gpu *g, int64_t V, int64_t row0, int64_t rows, int64_t H, int64_t T,
                       loom_dtype wdt, loom_dtype odt) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t t = 0; t < T; t++) /* repeats inside a batch of 16, other ranks' tokens */
        ids[t] = t % 5 == 2 ? (int32_t)row0
                            : (int32_t)(loom_splitmix64((uint64_t)t * 7 + 3) % (uint64_t)V);
    if (T > 1) ids[T - 1] = (int32_t)(row0 + rows);
    float *W = falloc(rows * H), *out = falloc(T * H), *got = falloc(T * H);
    float *dout = falloc(T * H), *dW = falloc(rows * H), *gotdW = falloc(rows * H);
    fill(W, rows * H, 31, 1);
    fill(dout, T * H, 32, 1);
    fill(dW, rows * H, 33, 1);
    round_to(g, W, rows * H, wdt);
    round_to(g, dout, T * H, odt);
    for (int64_t i = 0; i < T * H; i++) out[i] = NAN; /* every element must be written */
    void *dids = up_raw(g, ids, sizeof(int32_t) * (size_t)T), *dWt = up(g, W, rows * H, wdt);
    void *d_out = up(g, out, T * H, odt);
    void *dg = up(g, dout, T * H, odt), *ddW = up(g, dW, rows * H, LOOM_F32);
    if (g->bad) return;
    loom_cpu_embedding_vp_fwd(ids, T, W, row0, rows, H, out);
    round_to(g, out, T * H, odt);
    CHECK_OK(g->ctx, loom_cuda_embedding_vp_fwd(g->ctx, dids, T, dWt, wdt, row0, rows, H, d_out,
                                                odt, NULL));
    down(g, got, d_out, T * H, odt);
    CHECK_MSG(n_differ(got, out, T * H) == 0,
              "embedding_vp_fwd rows=%lld row0=%lld H=%lld T=%lld %s -> %s differs",
              (long long)rows, (long long)row0, (long long)H, (long long)T, dn(wdt), dn(odt));
    /* bwd: fp32 sums in token order on both sides, whatever dout's dtype */
    loom_cpu_embedding_vp_bwd(ids, T, dout, row0, rows, H, dW);
    CHECK_OK(g->ctx,
             loom_cuda_embedding_vp_bwd(g->ctx, dids, T, dg, odt, row0, rows, H, ddW, NULL));
    down(g, gotdW, ddW, rows * H, LOOM_F32);
    CHECK_MSG(n_differ(gotdW, dW, rows * H) == 0,
              "embedding_vp_bwd rows=%lld row0=%lld H=%lld T=%lld %s: not bit-identical "
              "(rel err %g)",
              (long long)rows, (long long)row0, (long long)H, (long long)T, dn(odt),
              rel_err(gotdW, dW, rows * H));
    free(ids), free(W), free(out), free(got), free(dout), free(dW), free(gotdW);
    gpu_free_all(g);
}

TEST(cuda_glue_embedding_vp) {
    gpu g;
    REQUIRE(gpu_open(&g));
    embed_case(&g, 50, 0, 17, 72, 37, LOOM_F32, LOOM_F32);
    embed_case(&g, 50, 17, 17, 72, 37, LOOM_F32, LOOM_F32);
    embed_case(&g, 50, 34, 16, 5, 1, LOOM_F32, LOOM_F32); /* T = 1 */
    embed_case(&g, 21, 7, 7, 200, 1000, LOOM_F32, LOOM_F32); /* many repeats per row */
    embed_case(&g, 50, 25, 25, 72, 37, LOOM_BF16, LOOM_BF16);
    embed_case(&g, 50, 25, 25, 33, 37, LOOM_F16, LOOM_F32);
    embed_case(&g, 600, 300, 300, 4096, 64, LOOM_F32, LOOM_BF16);
    REQUIRE(!g.bad);
    /* errors name the op */
    CHECK(loom_cuda_embedding_vp_fwd(g.ctx, NULL, 1, NULL, LOOM_I32, 0, 1, 1, NULL, LOOM_F32,
                                     NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda embedding_vp_fwd");
    CHECK(loom_cuda_embedding_vp_bwd(g.ctx, NULL, 1, NULL, LOOM_I32, 0, 1, 1, NULL, NULL) ==
          LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda embedding_vp_bwd");
    gpu_close(&g);
}

/* ---------------- vocab-parallel cross-entropy ---------------- */

/* |a - b| <= tol * scale for each of n doubles. */
static int64_t n_far(const double *a, const double *b, int64_t n, double tol, const double *scale) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) k += !(fabs(a[i] - b[i]) <= tol * scale[i]);
    return k;
}

/* One rank's piece: c rows of ld columns, the first nvalid real (clamped by
 * the ops), global ids from v0; the rows' global max taken a bit above the
 * local one (as if another rank held the max) on every third row. */
static void ce_case(gpu *g, int64_t c, int64_t ld, int64_t nvalid, int64_t v0, loom_dtype dt,
                    float scale, uint64_t key) {
    const int64_t n = c * ld, nv = nvalid < 0 ? 0 : nvalid > ld ? ld : nvalid;
    float *z = falloc(n), *grad = falloc(n), *got = falloc(n);
    int32_t *tgt = malloc(sizeof(int32_t) * (size_t)(c ? c : 1));
    double *mx = calloc((size_t)(c ? c : 1), sizeof(double)), *gmx = calloc((size_t)(c ? c : 1), 8);
    double *ce = calloc((size_t)(3 * c + 1), 8), *gce = calloc((size_t)(3 * c + 1), 8);
    double *sc = calloc((size_t)(3 * c + 1), 8);
    fill(z, n, key, 3);
    for (int64_t r = 0; r < c; r++) {
        for (int64_t j = nv; j < ld; j++) z[r * ld + j] = 1e4f; /* padding must be ignored */
        const int kind = (int)(r % 6);
        const int64_t pick = nv ? (int64_t)(loom_splitmix64(key + (uint64_t)r) % (uint64_t)nv) : 0;
        if (kind == 0)
            tgt[r] = -100;
        else if (kind == 1)
            tgt[r] = (int32_t)(v0 + ld + 3); /* another rank's */
        else if (kind == 2 && v0 > 0)
            tgt[r] = (int32_t)(v0 - 1); /* the previous rank's last */
        else if (kind == 3 && nv < ld)
            tgt[r] = (int32_t)(v0 + nv); /* in the local padding: nobody's */
        else
            tgt[r] = (int32_t)(v0 + pick);
        if (kind == 4 && nv > 0) z[r * ld + (tgt[r] - v0)] = 35.0f; /* a confident row */
    }
    round_to(g, z, n, dt);
    void *dz = up(g, z, n, dt), *dtg = up_raw(g, tgt, sizeof(int32_t) * (size_t)(c ? c : 1));
    double *dmx = dalloc(g, (size_t)(c ? c : 1) * 8), *dce = dalloc(g, (size_t)(3 * c + 1) * 8);
    if (g->bad) return;

    loom_cpu_ce_vp_max(z, c, ld, nvalid, mx);
    CHECK_OK(g->ctx, loom_cuda_ce_vp_max(g->ctx, dz, dt, c, ld, nvalid, dmx, NULL));
    down_raw(g, gmx, dmx, (size_t)c * 8);
    int64_t bad = 0;
    for (int64_t r = 0; r < c; r++) bad += !(gmx[r] == mx[r]); /* exact; -inf == -inf */
    CHECK_MSG(bad == 0, "ce_vp_max c=%lld ld=%lld nvalid=%lld %s: %lld rows differ", (long long)c,
              (long long)ld, (long long)nvalid, dn(dt), (long long)bad);

    /* the sums against the all-reduced max (raised on some rows) */
    for (int64_t r = 0; r < c; r++)
        if (r % 3 == 1 && nv > 0) mx[r] += 0.75;
    if (c) CHECK_OK(g->ctx, loom_cuda_memcpy_async(g->ctx, dmx, mx, (size_t)c * 8, NULL));
    loom_cpu_ce_vp_sums(z, c, ld, nvalid, tgt, v0, mx, ce);
    CHECK_OK(g->ctx, loom_cuda_ce_vp_sums(g->ctx, dz, dt, c, ld, nvalid, dtg, v0, dmx,
                                          dce, NULL));
    down_raw(g, gce, dce, (size_t)(3 * c) * 8);
    for (int64_t r = 0; r < c; r++) { /* tolerance scales: sum e, sum e |z|, exact */
        double sabs = 0;
        for (int64_t j = 0; j < nv; j++) {
            double x = z[r * ld + j];
            sabs += exp(x - mx[r]) * fabs(x);
        }
        sc[3 * r] = ce[3 * r], sc[3 * r + 1] = sabs, sc[3 * r + 2] = 0;
    }
    bad = n_far(gce, ce, 3 * c, 1e-5, sc); /* exp in fp32 on the GPU: a few ulp per term */
    CHECK_MSG(bad == 0, "ce_vp_sums c=%lld ld=%lld nvalid=%lld %s: %lld values off (row 0: %.17g "
              "%.17g %.17g vs %.17g %.17g %.17g)", (long long)c, (long long)ld, (long long)nvalid,
              dn(dt), (long long)bad, c ? gce[0] : 0, c ? gce[1] : 0, c ? gce[2] : 0, c ? ce[0] : 0,
              c ? ce[1] : 0, c ? ce[2] : 0);
    /* deterministic: the same call again gives the same bits */
    double *again = calloc((size_t)(3 * c + 1), 8);
    CHECK_OK(g->ctx, loom_cuda_ce_vp_sums(g->ctx, dz, dt, c, ld, nvalid, dtg, v0, dmx, dce, NULL));
    down_raw(g, again, dce, (size_t)(3 * c) * 8);
    CHECK_MSG(memcmp(again, gce, (size_t)(3 * c) * 8) == 0, "ce_vp_sums not reproducible");
    free(again);

    /* grad in place, from the CPU's max and sums (as if all-reduced) */
    if (c) CHECK_OK(g->ctx, loom_cuda_memcpy_async(g->ctx, dce, ce, (size_t)(3 * c) * 8, NULL));
    memcpy(grad, z, sizeof(float) * (size_t)n);
    loom_cpu_ce_vp_grad(grad, c, ld, nvalid, tgt, v0, mx, ce, scale);
    round_to(g, grad, n, dt);
    CHECK_OK(g->ctx, loom_cuda_ce_vp_grad(g->ctx, dz, dt, c, ld, nvalid, dtg, v0, dmx, dce, scale, NULL));
    down(g, got, dz, n, dt);
    double e = rel_err(got, grad, n);
    CHECK_MSG(e <= tol_for(dt), "ce_vp_grad c=%lld ld=%lld nvalid=%lld %s: rel err %.3g",
              (long long)c, (long long)ld, (long long)nvalid, dn(dt), e);
    if (getenv("LOOM_CUDA_OPS_VERBOSE"))
        fprintf(stderr, "    ce_vp_grad c=%lld ld=%lld nvalid=%lld %s: rel err %.3g\n",
                (long long)c, (long long)ld, (long long)nvalid, dn(dt), e);
    bad = 0; /* padding and ignored rows: exactly +0 */
    for (int64_t r = 0; r < c; r++)
        for (int64_t j = 0; j < ld; j++)
            if (tgt[r] == -100 || j >= nv)
                bad += got[r * ld + j] != 0.0f || signbit(got[r * ld + j]);
    CHECK_MSG(bad == 0, "ce_vp_grad c=%lld ld=%lld nvalid=%lld %s: %lld padding/ignored entries "
              "not zero", (long long)c, (long long)ld, (long long)nvalid, dn(dt), (long long)bad);

    /* fused (one rank): against the CPU's max, sums and grad with its own max */
    loom_cpu_ce_vp_max(z, c, ld, nvalid, mx);
    loom_cpu_ce_vp_sums(z, c, ld, nvalid, tgt, v0, mx, ce);
    memcpy(grad, z, sizeof(float) * (size_t)n);
    loom_cpu_ce_vp_grad(grad, c, ld, nvalid, tgt, v0, mx, ce, scale);
    round_to(g, grad, n, dt);
    for (int64_t r = 0; r < c; r++) {
        double sabs = 0;
        for (int64_t j = 0; j < nv; j++) sabs += exp(z[r * ld + j] - mx[r]) * fabs(z[r * ld + j]);
        sc[3 * r] = ce[3 * r], sc[3 * r + 1] = sabs, sc[3 * r + 2] = 0;
    }
    float *z2 = falloc(n), *got2 = falloc(n);
    double *gce2 = calloc((size_t)(3 * c + 1), 8), *gmx2 = calloc((size_t)(c ? c : 1), 8);
    void *dz2 = up(g, z, n, dt);
    double *dmx2 = dalloc(g, (size_t)(c ? c : 1) * 8), *dce2 = dalloc(g, (size_t)(3 * c + 1) * 8);
    if (g->bad) return;
    for (int pass = 0; pass < 2; pass++) { /* without the gradient, then with it */
        void *zz = pass ? dz2 : dz;
        if (!pass) CHECK_OK(g->ctx, loom_cuda_memcpy_async(g->ctx, dz, dz2, (size_t)n * loom_dtype_size(dt), NULL));
        CHECK_OK(g->ctx, loom_cuda_ce_vp_fused(g->ctx, zz, dt, c, ld, nvalid, dtg, v0, dmx2, dce2,
                                               scale, pass == 1, NULL));
        down_raw(g, pass ? gmx2 : gmx, dmx2, (size_t)c * 8);
        down_raw(g, pass ? gce2 : gce, dce2, (size_t)(3 * c) * 8);
        down(g, pass ? got2 : z2, zz, n, dt);
    }
    bad = 0;
    for (int64_t r = 0; r < c; r++) bad += !(gmx[r] == mx[r]) + !(gmx2[r] == mx[r]);
    bad += n_far(gce, ce, 3 * c, 1e-5, sc);
    CHECK_MSG(bad == 0, "ce_vp_fused c=%lld ld=%lld nvalid=%lld %s: %lld max/sums off (row 0: "
              "%.17g %.17g %.17g vs %.17g %.17g %.17g)", (long long)c, (long long)ld,
              (long long)nvalid, dn(dt), (long long)bad, c ? gce[0] : 0, c ? gce[1] : 0,
              c ? gce[2] : 0, c ? ce[0] : 0, c ? ce[1] : 0, c ? ce[2] : 0);
    CHECK_MSG(memcmp(gce, gce2, (size_t)(3 * c) * 8) == 0,
              "ce_vp_fused: the sums differ with and without the gradient (not reproducible)");
    CHECK_MSG(memcmp(z2, z, sizeof(float) * (size_t)n) == 0,
              "ce_vp_fused without grad changed the logits");
    e = rel_err(got2, grad, n);
    CHECK_MSG(e <= tol_for(dt), "ce_vp_fused grad c=%lld ld=%lld nvalid=%lld %s: rel err %.3g",
              (long long)c, (long long)ld, (long long)nvalid, dn(dt), e);
    /* its gradient is ce_vp_grad's, bit for bit, from the same max and sums */
    CHECK_OK(g->ctx, loom_cuda_ce_vp_grad(g->ctx, dz, dt, c, ld, nvalid, dtg, v0, dmx2, dce2, scale, NULL));
    down(g, got, dz, n, dt);
    CHECK_MSG(memcmp(got, got2, sizeof(float) * (size_t)n) == 0,
              "ce_vp_fused c=%lld ld=%lld %s: gradient differs from ce_vp_grad's", (long long)c,
              (long long)ld, dn(dt));
    free(z2), free(got2), free(gce2), free(gmx2);
    free(z), free(grad), free(got), free(tgt), free(mx), free(gmx), free(ce), free(gce), free(sc);
    gpu_free_all(g);
}

TEST(cuda_glue_ce_vp) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const loom_dtype types[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int ti = 0; ti < 3; ti++) {
        const loom_dtype dt = types[ti];
        ce_case(&g, 37, 32000, 31900, 64000, dt, 1.0f, 100 + (uint64_t)ti); /* realistic width */
        ce_case(&g, 13, 1000, 1000, 0, dt, 1.0f / 29, 110 + (uint64_t)ti);
        ce_case(&g, 7, 77, 50, 77, dt, 0.5f, 120 + (uint64_t)ti);       /* odd sizes */
        ce_case(&g, 1, 33, 33, 33, dt, 1.0f, 130 + (uint64_t)ti);       /* c = 1 */
        ce_case(&g, 9, 300, 0, 600, dt, 1.0f, 140 + (uint64_t)ti);      /* nothing real here */
        ce_case(&g, 9, 300, -5, 600, dt, 1.0f, 150 + (uint64_t)ti);     /* nvalid < 0: clamped */
        ce_case(&g, 6, 257, 4000, 0, dt, 1.0f, 160 + (uint64_t)ti);     /* nvalid > ld: clamped */
        ce_case(&g, 3, 5, 5, 10, dt, 1.0f, 170 + (uint64_t)ti);         /* under a warp wide */
    }
    ce_case(&g, 4, 152064, 151936, 0, LOOM_F32, 1.0f / 4096, 180); /* a whole Qwen vocabulary */
    ce_case(&g, 600, 512, 500, 1024, LOOM_BF16, 1.0f, 190);        /* many rows */
    /* the fused kernel's rows of a whole vocabulary, more than SMs; a wide
     * 16-bit row with padding past the last whole vector of real columns */
    ce_case(&g, 160, 151936, 151936, 0, LOOM_BF16, 1.0f / 8192, 210);
    /* fewer rows than SMs with every kind of target; real columns that end
     * early in the row (the gradient's whole-vector path and its edges) */
    ce_case(&g, 6, 4096, 4000, 0, LOOM_BF16, 1.0f, 230);
    ce_case(&g, 70, 2048, 300, 100, LOOM_F16, 0.25f, 240);
    ce_case(&g, 9, 262144, 261997, 0, LOOM_F16, 1.0f, 220);
    ce_case(&g, 0, 512, 500, 0, LOOM_F32, 1.0f, 200);              /* no rows */
    REQUIRE(!g.bad);
    /* errors name the op */
    CHECK(loom_cuda_ce_vp_max(g.ctx, NULL, LOOM_I32, 1, 1, 1, NULL, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda ce_vp_max");
    CHECK(loom_cuda_ce_vp_sums(g.ctx, NULL, LOOM_F32, -1, 1, 1, NULL, 0, NULL, NULL, NULL) ==
          LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda ce_vp_sums");
    CHECK(loom_cuda_ce_vp_grad(g.ctx, NULL, LOOM_F32, 1, -1, 1, NULL, 0, NULL, NULL, 1, NULL) ==
          LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda ce_vp_grad");
    CHECK(loom_cuda_ce_vp_fused(g.ctx, NULL, LOOM_F32, -2, 1, 1, NULL, 0, NULL, NULL, 1, true, NULL) ==
          LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda ce_vp_fused");
    gpu_close(&g);
}

/* ---------------- row permutations ---------------- */

/* Gather and scatter of n rows of width elements of esz bytes, with dst and
 * src offset by `skew` bytes from the allocation (so the vector width falls
 * back), against the CPU, byte for byte. */
static void rows_case(gpu *g, int64_t n, int64_t width, size_t esz, size_t skew, uint64_t key) {
    const size_t row = (size_t)width * esz, bytes = (size_t)n * row;
    unsigned char *src = malloc(bytes + 1), *ref = malloc(bytes + 1), *got = malloc(bytes + 1);
    unsigned char *init = malloc(bytes + 1);
    memset(init, 0x5a, bytes + 1); /* what dst holds before: rows not written stay so */
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)(n ? n : 1));
    for (size_t i = 0; i < bytes; i++) src[i] = (unsigned char)loom_splitmix64(key + i);
    for (int64_t j = 0; j < n; j++) idx[j] = (int32_t)j;
    for (int64_t j = n - 1; j > 0; j--) {
        int64_t k = (int64_t)(loom_splitmix64(key * 31 + (uint64_t)j) % (uint64_t)(j + 1));
        int32_t t = idx[j];
        idx[j] = idx[k], idx[k] = t;
    }
    unsigned char *ds = dalloc(g, bytes + skew), *dd = dalloc(g, bytes + skew);
    void *di = up_raw(g, idx, sizeof(int32_t) * (size_t)(n ? n : 1));
    if (g->bad) return;
    CHECK_OK(g->ctx, loom_cuda_memcpy_async(g->ctx, ds + skew, src, bytes, NULL));
    for (int s = 0; s < 2; s++) {
        const char *op = s ? "rows_scatter" : "rows_gather";
        memcpy(ref, init, bytes);
        CHECK_OK(g->ctx, loom_cuda_memcpy_async(g->ctx, dd + skew, init, bytes, NULL));
        if (s) {
            loom_cpu_rows_scatter(ref, src, idx, n, width, esz);
            CHECK_OK(g->ctx, loom_cuda_rows_scatter(g->ctx, dd + skew, ds + skew, di, n, width, esz,
                                                    NULL));
        } else {
            loom_cpu_rows_gather(ref, src, idx, n, width, esz);
            CHECK_OK(g->ctx, loom_cuda_rows_gather(g->ctx, dd + skew, ds + skew, di, n, width, esz,
                                                   NULL));
        }
        down_raw(g, got, dd + skew, bytes);
        CHECK_MSG(memcmp(got, ref, bytes) == 0, "%s n=%lld width=%lld esz=%zu skew=%zu differs", op,
                  (long long)n, (long long)width, esz, skew);
    }
    free(src), free(ref), free(got), free(init), free(idx);
    gpu_free_all(g);
}

TEST(cuda_glue_rows_perm) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const size_t eszs[2] = {2, 4};
    for (int e = 0; e < 2; e++)
        for (size_t skew = 0; skew <= 8; skew += 2) { /* 16-, 8-, 4-, 2-byte copies */
            rows_case(&g, 37, 1024, eszs[e], skew * eszs[e] / 2, 1 + skew);
            rows_case(&g, 300, 24, eszs[e], skew * eszs[e] / 2, 2 + skew);
            rows_case(&g, 5, 7, eszs[e], skew * eszs[e] / 2, 3 + skew); /* odd row size */
        }
    rows_case(&g, 1, 8, 4, 0, 4);         /* one row */
    rows_case(&g, 20, 5, 3, 1, 5);        /* any element size, byte copies */
    rows_case(&g, 4096, 256, 2, 0, 6);    /* many short rows */
    rows_case(&g, 16, 0, 4, 0, 7);        /* empty rows */
    rows_case(&g, 0, 8, 4, 0, 8);         /* no rows */
    REQUIRE(!g.bad);
    CHECK(loom_cuda_rows_gather(g.ctx, NULL, NULL, NULL, -1, 1, 4, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda rows_gather");
    CHECK(loom_cuda_rows_scatter(g.ctx, NULL, NULL, NULL, 1, 1, 0, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda rows_scatter");
    gpu_close(&g);
}

/* ---------------- LoRA dropout ---------------- */

static void dropout_case(gpu *g, int64_t T, int64_t in, int64_t full, int64_t col0, bool use_qidx,
                         int64_t out0, double p, loom_dtype dt, bool in_place, uint64_t key) {
    const int64_t n = T * in;
    const uint64_t seed = 0xfeed ^ key;
    float *x = falloc(n), *ref = falloc(n), *got = falloc(n);
    int32_t *qidx = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t t = 0; t < T; t++) qidx[t] = (int32_t)((t * 7 + 3) % (3 * T)); /* sparse rows */
    fill(x, n, key, 1);
    round_to(g, x, n, dt);
    for (int64_t i = 0; i < n; i++)
        if (x[i] == 0) x[i] = 1; /* so that a zero means dropped */
    void *dx = up(g, x, n, dt), *dout = in_place ? dx : dalloc(g, (size_t)n * loom_dtype_size(dt));
    void *dq = up_raw(g, qidx, sizeof(int32_t) * (size_t)T);
    if (g->bad) return;
    loom_cpu_lora_dropout(ref, x, T, in, full, col0, use_qidx ? qidx : NULL, out0, seed, key, p);
    round_to(g, ref, n, dt); /* v * scale rounded once to dt, as the GPU stores it */
    CHECK_OK(g->ctx, loom_cuda_lora_dropout(g->ctx, dout, in_place ? NULL : dx, T, in, full, col0,
                                            use_qidx ? dq : NULL, out0, seed, key, p, dt, NULL));
    down(g, got, dout, n, dt);
    int64_t mask = 0, kept = 0;
    for (int64_t i = 0; i < n; i++) {
        mask += (got[i] == 0) != (ref[i] == 0);
        kept += ref[i] != 0;
    }
    CHECK_MSG(mask == 0, "lora_dropout T=%lld in=%lld p=%g %s%s%s: %lld mask bits differ",
              (long long)T, (long long)in, p, dn(dt), use_qidx ? " qidx" : "",
              in_place ? " in place" : "", (long long)mask);
    CHECK_MSG(n_differ(got, ref, n) == 0, "lora_dropout T=%lld in=%lld p=%g %s%s%s: values differ "
              "(rel err %g)", (long long)T, (long long)in, p, dn(dt), use_qidx ? " qidx" : "",
              in_place ? " in place" : "", rel_err(got, ref, n));
    if (n >= 10000) /* not vacuous: about 1 - p kept */
        CHECK_MSG(fabs((double)kept / (double)n - (1 - p)) < 0.02, "lora_dropout kept %lld of %lld",
                  (long long)kept, (long long)n);
    free(x), free(ref), free(got), free(qidx);
    gpu_free_all(g);
}

TEST(cuda_glue_lora_dropout) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const loom_dtype types[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int ti = 0; ti < 3; ti++)
        for (int v = 0; v < 4; v++) {
            const bool q = v & 1, ip = v >> 1;
            const uint64_t key = 10 * (uint64_t)ti + (uint64_t)v;
            dropout_case(&g, 100, 384, 1536, 768, q, 4096, 0.1, types[ti], ip, key);
            dropout_case(&g, 37, 77, 77, 0, q, 0, 0.5, types[ti], ip, key + 100);
        }
    dropout_case(&g, 1, 4096, 4096, 0, false, 123456, 0.3, LOOM_F32, false, 1);  /* T = 1 */
    dropout_case(&g, 64, 96, 96, 0, false, 0, 0.0, LOOM_F32, false, 2);          /* keeps all */
    dropout_case(&g, 2048, 1024, 4096, 3072, true, 1 << 20, 0.05, LOOM_BF16, true, 3); /* big */
    REQUIRE(!g.bad);
    CHECK(loom_cuda_lora_dropout(g.ctx, NULL, NULL, 1, 1, 1, 0, NULL, 0, 0, 0, 0.1, LOOM_I32,
                                 NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda lora_dropout");
    gpu_close(&g);
}

/* ---------------- memset / memcpy on a stream ---------------- */

TEST(cuda_glue_memory) {
    gpu g;
    REQUIRE(gpu_open(&g));
    enum { N = 100003 };
    unsigned char *h = malloc(N), *back = malloc(N), *zero = calloc(N, 1);
    for (int i = 0; i < N; i++) h[i] = (unsigned char)(i * 13 + 1);
    unsigned char *a = dalloc(&g, N), *b = dalloc(&g, N);
    REQUIRE(!g.bad);
    cudaStream_t s = NULL;
    REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
    /* host -> device, device -> device, device -> host, all on one stream */
    CHECK_OK(g.ctx, loom_cuda_memcpy_async(g.ctx, a, h, N, s));
    CHECK_OK(g.ctx, loom_cuda_memset_async(g.ctx, b, N, s));
    CHECK_OK(g.ctx, loom_cuda_memcpy_async(g.ctx, b + 1, a + 2, N - 7, s));
    CHECK_OK(g.ctx, loom_cuda_memcpy_async(g.ctx, back, b, N, s));
    REQUIRE(cudaStreamSynchronize(s) == cudaSuccess);
    CHECK(back[0] == 0 && memcmp(back + 1, h + 2, N - 7) == 0 &&
          memcmp(back + N - 6, zero, 6) == 0);
    /* memset on the default stream; zero bytes are a no-op */
    CHECK_OK(g.ctx, loom_cuda_memset_async(g.ctx, a + 10, 1000, NULL));
    CHECK_OK(g.ctx, loom_cuda_memset_async(g.ctx, NULL, 0, NULL));
    CHECK_OK(g.ctx, loom_cuda_memcpy_async(g.ctx, NULL, NULL, 0, NULL));
    down_raw(&g, back, a, N);
    CHECK(memcmp(back, h, 10) == 0 && memcmp(back + 10, zero, 1000) == 0 &&
          memcmp(back + 1010, h + 1010, N - 1010) == 0);
    cudaStreamDestroy(s);
    free(h), free(back), free(zero);
    gpu_close(&g);
}
#endif
