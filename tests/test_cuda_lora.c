/* LoRA's pass kernel on the GPU (src/backend/cuda/ops_lora.cu) against a
 * float64 reference on fresh random inputs: partial tiles, row strides with
 * padding (left untouched), both weight layouts, its three uses (s alone,
 * g alone, both), g transposed, the same bits run to run. And the Hopper
 * GEMM with LoRA's term (gemm_sm90.cu) the same way. Built only with
 * `make CUDA=1`; skipped without a GPU. */
#ifdef LOOM_HAVE_CUDA
#include <stdlib.h>

#include "../src/backend/cuda/cuda_ops.h"
#include "cuda_test.h"

/* c (M, N; ldc) = alpha a (M, K) b (K, N) + beta c in double, a(i, j) and
 * b(i, j) read through strides (so transposes are strides). */
static void ref_gemm(int64_t M, int64_t N, int64_t K, double alpha, const float *a, int64_t ar,
                     int64_t ac, const float *b, int64_t br, int64_t bc, double beta, float *c,
                     int64_t ldc) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0;
            for (int64_t k = 0; k < K; k++) s += (double)a[i * ar + k * ac] * (double)b[k * br + j * bc];
            c[i * ldc + j] = (float)(alpha * s + (beta != 0.0 ? beta * (double)c[i * ldc + j] : 0.0));
        }
}

/* Bits of got and want equal outside the first `cols` columns of each row. */
static void check_padding(const float *got, const float *want, int64_t rows, int64_t cols, int64_t ld,
                          const char *what) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = cols; j < ld; j++)
            if (memcmp(&got[i * ld + j], &want[i * ld + j], sizeof(float))) {
                loom_test_fail(__FILE__, __LINE__, "%s wrote padding (%lld, %lld)", what, (long long)i,
                               (long long)j);
                return;
            }
}

static void pass_case(gpu *g, int64_t T, int64_t K, int64_t k, bool w_kk, bool hs, bool hg, bool g_t,
                      loom_dtype dt) {
    const int64_t ldx = K + 8, ldw = w_kk ? K + 8 : k + 8, lds = k + 8, ldv = k + 16;
    const int64_t wr = w_kk ? k : K, gr = g_t ? k : K, ldg = (g_t ? K : k) + 4;
    const float as = 0.75f, ag = 1.25f;
    float *x = falloc(T * ldx), *w = falloc(wr * ldw), *v = falloc(T * ldv), *s = falloc(T * lds);
    float *gg = falloc(gr * ldg), *sref = falloc(T * lds), *gref = falloc(gr * ldg), *got = falloc(T * lds);
    float *gotg = falloc(gr * ldg);
    uint64_t key = (uint64_t)(T * 131 + K * 7 + k) * 16 + w_kk * 8 + hs * 4 + hg * 2 + g_t;
    fill(x, T * ldx, key, 1), fill(w, wr * ldw, key + 1, 1), fill(v, T * ldv, key + 2, 1);
    fill(s, T * lds, key + 3, 1), fill(gg, gr * ldg, key + 4, 1);
    round_to(g, x, T * ldx, dt), round_to(g, w, wr * ldw, dt), round_to(g, v, T * ldv, dt);
    round_to(g, s, T * lds, dt);
    memcpy(sref, s, sizeof(float) * (size_t)(T * lds));
    memcpy(gref, gg, sizeof(float) * (size_t)(gr * ldg));
    if (hs) {
        ref_gemm(T, k, K, as, x, ldx, 1, w, w_kk ? 1 : ldw, w_kk ? ldw : 1, 0.0, sref, lds);
        round_to(g, sref, T * lds, dt);
        for (int64_t i = 0; i < T; i++) /* s must be written, not read */
            for (int64_t j = 0; j < k; j++) s[i * lds + j] = NAN;
    }
    if (hg) {
        if (g_t) ref_gemm(k, K, T, ag, v, 1, ldv, x, ldx, 1, 1.0, gref, ldg);
        else ref_gemm(K, k, T, ag, x, 1, ldx, v, ldv, 1, 1.0, gref, ldg);
    }
    void *dx = up(g, x, T * ldx, dt), *dw = up(g, w, wr * ldw, dt), *dv = up(g, v, T * ldv, dt);
    void *ds = up(g, s, T * lds, dt);
    float *dg = up(g, gg, gr * ldg, LOOM_F32);
    const size_t sb = loom_cuda_lora_pass_scratch_bytes(T, K, k, hs, hg);
    void *scr = dalloc(g, sb);
    if (g->bad) return;
    CHECK_OK(g->ctx, loom_cuda_lora_pass(g->ctx, T, K, k, dx, ldx, hs ? dw : NULL, w_kk, ldw, as,
                                         hs ? ds : NULL, lds, hg ? dv : NULL, ldv, ag, hg ? dg : NULL, g_t,
                                         ldg, dt, scr, sb, NULL));
    char what[160];
    snprintf(what, sizeof what, "lora_pass T=%lld K=%lld k=%lld w_kk=%d s=%d g=%d g_t=%d %s", (long long)T,
             (long long)K, (long long)k, w_kk, hs, hg, g_t, dn(dt));
    down(g, got, ds, T * lds, dt);
    CHECK_CLOSE(got, sref, T * lds, dt, "%s: s", what);
    check_padding(got, sref, T, hs ? k : 0, lds, what);
    down(g, gotg, dg, gr * ldg, LOOM_F32);
    CHECK_CLOSE(gotg, gref, gr * ldg, LOOM_F32, "%s: g", what);
    check_padding(gotg, gref, gr, hg ? (g_t ? K : k) : 0, ldg, what);
    /* again on the same scratch, into a poisoned s and the first g: the same
     * bits (fixed-order sums) */
    float *again = falloc(T * lds), *againg = falloc(gr * ldg);
    void *ds2 = up(g, s, T * lds, dt);
    float *dg2 = up(g, gg, gr * ldg, LOOM_F32);
    if (g->bad || cudaMemset(ds2, 0xff, (size_t)(T * lds) * loom_dtype_size(dt)) != cudaSuccess) return;
    CHECK_OK(g->ctx, loom_cuda_lora_pass(g->ctx, T, K, k, dx, ldx, hs ? dw : NULL, w_kk, ldw, as,
                                         hs ? ds2 : NULL, lds, hg ? dv : NULL, ldv, ag, hg ? dg2 : NULL, g_t,
                                         ldg, dt, scr, sb, NULL));
    down(g, again, ds2, T * lds, dt);
    down(g, againg, dg2, gr * ldg, LOOM_F32);
    for (int64_t i = 0; hs && i < T; i++) /* s's columns (its padding was poisoned this time) */
        if (n_differ(got + i * lds, again + i * lds, k)) {
            loom_test_fail(__FILE__, __LINE__, "%s: s row %lld differs between runs", what, (long long)i);
            break;
        }
    CHECK_MSG(n_differ(gotg, againg, gr * ldg) == 0, "%s: g differs between runs", what);
    free(again), free(againg);
    free(x), free(w), free(v), free(s), free(gg), free(sref), free(gref), free(got), free(gotg);
    gpu_free_all(g);
}

TEST(cuda_ops_lora_pass) {
    gpu g;
    REQUIRE(gpu_open(&g));
    /* T, K, k: partial tiles; several row and column ranges; one tile; tiny */
    const int64_t shapes[][3] = {{333, 520, 24}, {1100, 1416, 16}, {4096, 1024, 8}, {64, 128, 32}, {5, 8, 8}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const loom_dtype dt = si % 2 ? LOOM_F16 : LOOM_BF16;
        const int64_t T = shapes[si][0], K = shapes[si][1], k = shapes[si][2];
        pass_case(&g, T, K, k, true, true, false, false, dt);  /* u = x A^T */
        pass_case(&g, T, K, k, false, true, true, false, dt); /* du = dy B, dB += dy^T u */
        pass_case(&g, T, K, k, false, false, true, true, dt); /* dA += du^T x */
        pass_case(&g, T, K, k, true, true, true, true, dt);
    }
    pass_case(&g, 4096, 256, 8, false, false, true, false, LOOM_BF16); /* g alone, many row ranges */
    gpu_close(&g);
}

/* A group's dy passes in one launch (loom_cuda_lora_pass_n, as the model's
 * q/k/v and gate/up run them): du of each module into its columns of one
 * (T, n k) buffer and dB += of each, the same bits as the passes one at a
 * time (each is split as it would be alone), and within tolerance of
 * float64. Then a batch of the wrong size or of mixed k is refused. */
static void pass_n_case(gpu *g, int64_t T, int n, const int64_t *Ks, int64_t k, loom_dtype dt) {
    const int64_t ld = n * k;
    float *x[3], *w[3], *gg[3], *gref[3];
    void *dx[3], *dw[3];
    float *dg1[3], *dgn[3];
    float *u = falloc(T * ld), *sref = falloc(T * ld);
    fill(u, T * ld, (uint64_t)T * 7 + n, 1), round_to(g, u, T * ld, dt);
    void *du = up(g, u, T * ld, dt);
    for (int i = 0; i < n; i++) {
        const int64_t K = Ks[i];
        x[i] = falloc(T * K), w[i] = falloc(K * k), gg[i] = falloc(K * k), gref[i] = falloc(K * k);
        fill(x[i], T * K, 100 + i, 1), fill(w[i], K * k, 200 + i, 1), fill(gg[i], K * k, 300 + i, 1);
        round_to(g, x[i], T * K, dt), round_to(g, w[i], K * k, dt);
        memcpy(gref[i], gg[i], sizeof(float) * (size_t)(K * k));
        ref_gemm(T, k, K, 0.5, x[i], K, 1, w[i], k, 1, 0.0, sref + i * k, ld);
        ref_gemm(K, k, T, 0.5, x[i], 1, K, u + i * k, ld, 1, 1.0, gref[i], k);
        dx[i] = up(g, x[i], T * K, dt), dw[i] = up(g, w[i], K * k, dt);
        dg1[i] = up(g, gg[i], K * k, LOOM_F32), dgn[i] = up(g, gg[i], K * k, LOOM_F32);
    }
    round_to(g, sref, T * ld, dt);
    void *s1 = dalloc(g, (size_t)(T * ld) * loom_dtype_size(dt)), *sn = dalloc(g, (size_t)(T * ld) * loom_dtype_size(dt));
    loom_cuda_pass_op ops[3];
    for (int i = 0; i < n; i++)
        ops[i] = (loom_cuda_pass_op){T, Ks[i], k, dx[i], Ks[i], dw[i], false, k, 0.5f,
                                     (char *)sn + (size_t)(i * k) * loom_dtype_size(dt), ld,
                                     (const char *)du + (size_t)(i * k) * loom_dtype_size(dt), ld, 0.5f, dgn[i], false, k};
    const size_t sb = loom_cuda_lora_pass_n_scratch_bytes(n, ops);
    void *scr = dalloc(g, sb);
    if (g->bad) return;
    for (int i = 0; i < n; i++) /* one at a time, each with the scratch alone */
        CHECK_OK(g->ctx, loom_cuda_lora_pass(g->ctx, T, Ks[i], k, dx[i], Ks[i], dw[i], false, k, 0.5f,
                                             (char *)s1 + (size_t)(i * k) * loom_dtype_size(dt), ld,
                                             (const char *)du + (size_t)(i * k) * loom_dtype_size(dt), ld, 0.5f,
                                             dg1[i], false, k, dt, scr, sb, NULL));
    CHECK_OK(g->ctx, loom_cuda_lora_pass_n(g->ctx, n, ops, dt, scr, sb, NULL));
    char what[96];
    snprintf(what, sizeof what, "lora_pass_n T=%lld n=%d k=%lld %s", (long long)T, n, (long long)k, dn(dt));
    float *a = falloc(T * ld), *b = falloc(T * ld);
    down(g, a, s1, T * ld, dt), down(g, b, sn, T * ld, dt);
    CHECK_MSG(n_differ(a, b, T * ld) == 0, "%s: du differs from the passes one at a time", what);
    CHECK_CLOSE(b, sref, T * ld, dt, "%s: du", what);
    for (int i = 0; i < n; i++) {
        const int64_t K = Ks[i];
        float *c = falloc(K * k), *d = falloc(K * k);
        down(g, c, dg1[i], K * k, LOOM_F32), down(g, d, dgn[i], K * k, LOOM_F32);
        CHECK_MSG(n_differ(c, d, K * k) == 0, "%s: dB of pass %d differs from the pass alone", what, i);
        CHECK_CLOSE(d, gref[i], K * k, LOOM_F32, "%s: dB of pass %d", what, i);
        free(c), free(d);
        free(x[i]), free(w[i]), free(gg[i]), free(gref[i]);
    }
    free(a), free(b), free(u), free(sref);
    gpu_free_all(g);
}

TEST(cuda_ops_lora_pass_n) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const int64_t qkv[3] = {520, 136, 136}, gu[2] = {1416, 1416}, big[3] = {4096, 1024, 1024};
    pass_n_case(&g, 333, 3, qkv, 8, LOOM_BF16);
    pass_n_case(&g, 1100, 2, gu, 16, LOOM_F16);
    pass_n_case(&g, 4096, 3, big, 8, LOOM_BF16);
    void *p = dalloc(&g, 1 << 16);
    REQUIRE(p);
    loom_cuda_pass_op o[4];
    for (int i = 0; i < 4; i++) o[i] = (loom_cuda_pass_op){4, 8, 8, p, 8, p, false, 8, 1, p, 8, p, 8, 1, p, false, 8};
    CHECK(loom_cuda_lora_pass_n(g.ctx, 4, o, LOOM_BF16, p, 1 << 16, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "1 to 3 passes");
    CHECK(loom_cuda_lora_pass_n(g.ctx, 0, o, LOOM_BF16, p, 1 << 16, NULL) == LOOM_ERR_INVALID_ARG);
    o[1].k = 16, o[1].ldw = 16, o[1].lds = 16, o[1].ldv = 16, o[1].ldg = 16;
    CHECK(loom_cuda_lora_pass_n(g.ctx, 2, o, LOOM_BF16, p, 1 << 16, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "share k");
    gpu_close(&g);
}

TEST(cuda_ops_lora_refuses) {
    gpu g;
    REQUIRE(gpu_open(&g));
    void *p = dalloc(&g, 1 << 16);
    REQUIRE(p);
    CHECK(!loom_cuda_lora_ok(LOOM_F32, 8) && !loom_cuda_lora_ok(LOOM_BF16, 12) &&
          !loom_cuda_lora_ok(LOOM_BF16, 40) && loom_cuda_lora_ok(LOOM_F16, 32));
    CHECK(loom_cuda_lora_pass(g.ctx, 4, 8, 12, p, 8, p, true, 8, 1, p, 16, NULL, 0, 0, NULL, false, 0,
                              LOOM_BF16, p, 1 << 16, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda lora_pass");
    CHECK(loom_cuda_lora_pass(g.ctx, 4, 8, 8, (char *)p + 2, 8, p, true, 8, 1, p, 8, NULL, 0, 0, NULL,
                              false, 0, LOOM_BF16, p, 1 << 16, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "16-byte");
    CHECK(loom_cuda_lora_pass(g.ctx, 4, 12, 8, p, 16, p, true, 16, 1, p, 8, NULL, 0, 0, NULL, false, 0,
                              LOOM_BF16, p, 1 << 16, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda lora_pass");
    CHECK(loom_cuda_lora_pass(g.ctx, 4096, 4096, 8, p, 4096, p, true, 4096, 1, p, 8, NULL, 0, 0, NULL,
                              false, 0, LOOM_BF16, p, 16, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "scratch");
    gpu_close(&g);
}

/* The ops benches' GPU, events and cuBLASLt handle. */
/* The output's bits the same as a first run's (got) */
static void check_same_bits(gpu *g, const char *what, const void *dout, int64_t n, const float *got, float *again) {
    down(g, again, dout, n, LOOM_BF16);
    CHECK_MSG(n_differ(got, again, n) == 0, "%s: differs between runs", what);
}

static bool is_hopper(void) {
    struct cudaDeviceProp p;
    return cudaGetDeviceProperties(&p, 0) == cudaSuccess && p.major == 9 && p.minor == 0;
}

/* The Hopper GEMM with LoRA's term (src/backend/cuda/gemm_sm90.cu): y = x W^T
 * + s u B^T against float64 on fresh random inputs; u read through a row
 * stride and a column offset (a group's slice); y poisoned first. */
static void gemm_lora_case(gpu *g, int64_t T, int64_t N, int64_t K, int64_t r, int64_t ldu, int64_t uoff,
                           float sc) {
    float *x = falloc(T * K), *w = falloc(N * K), *u = falloc(T * ldu), *b = falloc(N * r);
    float *ref = falloc(T * N), *got = falloc(T * N), *again = falloc(T * N);
    const uint64_t key = (uint64_t)(T * 977 + N * 31 + K * 7 + r);
    fill(x, T * K, key, 1), fill(w, N * K, key + 1, 0.05f), fill(u, T * ldu, key + 2, 1);
    fill(b, N * r, key + 3, 0.5f);
    round_to(g, x, T * K, LOOM_BF16), round_to(g, w, N * K, LOOM_BF16);
    round_to(g, u, T * ldu, LOOM_BF16), round_to(g, b, N * r, LOOM_BF16);
    ref_gemm(T, N, K, 1.0, x, K, 1, w, 1, K, 0.0, ref, N);
    ref_gemm(T, N, r, sc, u + uoff, ldu, 1, b, 1, r, 1.0, ref, N);
    void *dx = up(g, x, T * K, LOOM_BF16), *dw = up(g, w, N * K, LOOM_BF16);
    void *du = up(g, u, T * ldu, LOOM_BF16), *db = up(g, b, N * r, LOOM_BF16);
    void *dy = dalloc(g, (size_t)(T * N) * 2);
    if (g->bad || cudaMemset(dy, 0xff, (size_t)(T * N) * 2) != cudaSuccess) return;
    const void *dus = (const char *)du + uoff * 2;
    char what[128];
    snprintf(what, sizeof what, "gemm_lora T=%lld N=%lld K=%lld r=%lld ldu=%lld s=%g", (long long)T,
             (long long)N, (long long)K, (long long)r, (long long)ldu, sc);
    CHECK_MSG(loom_cuda_gemm_lora_ok(LOOM_BF16, T, N, K, dx, dw, dus, ldu, db, r, dy), "%s: refused", what);
    CHECK_OK(g->ctx, loom_cuda_gemm_lora(g->ctx, T, N, K, dx, dw, dus, ldu, db, r, sc, dy, NULL));
    down(g, got, dy, T * N, LOOM_BF16);
    CHECK_CLOSE(got, ref, T * N, LOOM_BF16, "%s", what);
    CHECK_OK(g->ctx, loom_cuda_gemm_lora(g->ctx, T, N, K, dx, dw, dus, ldu, db, r, sc, dy, NULL));
    check_same_bits(g, what, dy, T * N, got, again);
    free(x), free(w), free(u), free(b), free(ref), free(got), free(again);
    gpu_free_all(g);
}

TEST(cuda_ops_gemm_lora) {
    gpu g;
    REQUIRE(gpu_open(&g));
    if (!is_hopper()) {
        gpu_close(&g);
        SKIP("the kernel is for sm_90 (Hopper)");
    }
    /* partial tiles in every dimension, a group's slice (ldu 24, offset 8) */
    gemm_lora_case(&g, 200, 264, 136, 8, 24, 8, 1.75f);
    gemm_lora_case(&g, 333, 520, 1000, 16, 16, 0, 0.5f);
    gemm_lora_case(&g, 1030, 768, 640, 64, 64, 0, 1.0f); /* the rank a whole k block; no scaling */
    gemm_lora_case(&g, 2048, 2048, 128, 8, 16, 8, 2.0f); /* several tiles per cluster */
    /* refusals: dtype, N or K not a multiple of 8, the rank, the stride, alignment */
    void *q = dalloc(&g, 1 << 20);
    REQUIRE(q);
    CHECK(loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 64, 64, q, q, q, 8, q, 8, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_F16, 64, 64, 64, q, q, q, 8, q, 8, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 60, 64, q, q, q, 8, q, 8, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 64, 60, q, q, q, 8, q, 8, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 64, 64, q, q, q, 8, q, 4, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 64, 64, q, q, q, 72, q, 72, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 64, 64, q, q, q, 12, q, 8, q));
    CHECK(!loom_cuda_gemm_lora_ok(LOOM_BF16, 64, 64, 64, (char *)q + 2, q, q, 8, q, 8, q));
    CHECK(loom_cuda_gemm_lora(g.ctx, 64, 60, 64, q, q, q, 8, q, 8, 1.0f, q, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda gemm_lora");
    gpu_close(&g);
}

/* The input gradients' sum (gemm_sm90.cu): d = sum a_s b_s, b_s (K_s, N)
 * N-major, against float64 on fresh random inputs; d poisoned first. Each
 * segment's a has row stride lda (K_s + pad). */
static void gemm_dx_case(gpu *g, int64_t T, int64_t N, int nseg, const int64_t *K, const int64_t *pad) {
    float *a[4], *b[4];
    const void *da[4], *db[4];
    int64_t lda[4];
    float *ref = falloc(T * N), *got = falloc(T * N), *again = falloc(T * N);
    const uint64_t key = (uint64_t)(T * 131 + N * 7 + nseg);
    char what[160];
    int at = snprintf(what, sizeof what, "gemm_dx T=%lld N=%lld K=", (long long)T, (long long)N);
    for (int i = 0; i < nseg; i++) {
        lda[i] = K[i] + pad[i];
        a[i] = falloc(T * lda[i]), b[i] = falloc(K[i] * N);
        fill(a[i], T * lda[i], key + 2 * (uint64_t)i, 1), fill(b[i], K[i] * N, key + 2 * (uint64_t)i + 1, 0.05f);
        round_to(g, a[i], T * lda[i], LOOM_BF16), round_to(g, b[i], K[i] * N, LOOM_BF16);
        ref_gemm(T, N, K[i], 1.0, a[i], lda[i], 1, b[i], N, 1, i ? 1.0 : 0.0, ref, N);
        da[i] = up(g, a[i], T * lda[i], LOOM_BF16), db[i] = up(g, b[i], K[i] * N, LOOM_BF16);
        at += snprintf(what + at, sizeof what - (size_t)at, "%s%lld/%lld", i ? "+" : "", (long long)K[i],
                       (long long)lda[i]);
    }
    void *dd = dalloc(g, (size_t)(T * N) * 2);
    if (!g->bad && cudaMemset(dd, 0xff, (size_t)(T * N) * 2) == cudaSuccess) {
        CHECK_MSG(loom_cuda_gemm_dx_ok(LOOM_BF16, T, N, nseg, da, lda, K, db, dd), "%s: refused", what);
        CHECK_OK(g->ctx, loom_cuda_gemm_dx(g->ctx, T, N, nseg, da, lda, K, db, dd, NULL));
        down(g, got, dd, T * N, LOOM_BF16);
        CHECK_CLOSE(got, ref, T * N, LOOM_BF16, "%s", what);
        CHECK_OK(g->ctx, loom_cuda_gemm_dx(g->ctx, T, N, nseg, da, lda, K, db, dd, NULL));
        check_same_bits(g, what, dd, T * N, got, again);
    }
    for (int i = 0; i < nseg; i++) free(a[i]), free(b[i]);
    free(ref), free(got), free(again);
    gpu_free_all(g);
}

TEST(cuda_ops_gemm_dx) {
    gpu g;
    REQUIRE(gpu_open(&g));
    if (!is_hopper()) {
        gpu_close(&g);
        SKIP("the kernel is for sm_90 (Hopper)");
    }
    /* partial tiles in every dimension; a segment's K under one k block, not
     * a multiple of 8, through a row stride; LoRA's du A (K 24 = 3 x r 8)
     * first, as the library sums q, k, v; several tiles per cluster */
    gemm_dx_case(&g, 200, 264, 1, (const int64_t[]){136}, (const int64_t[]){0});
    gemm_dx_case(&g, 333, 520, 3, (const int64_t[]){1000, 37, 24}, (const int64_t[]){0, 3, 8});
    gemm_dx_case(&g, 333, 520, 4, (const int64_t[]){24, 512, 128, 128}, (const int64_t[]){0, 0, 0, 0});
    gemm_dx_case(&g, 2048, 2048, 2, (const int64_t[]){8, 192}, (const int64_t[]){0, 0});
    /* refusals: dtype, N not a multiple of 8, the segment count, a stride, alignment */
    void *q = dalloc(&g, 1 << 20);
    REQUIRE(q);
    const void *v[5] = {q, q, q, q, q}, *mis[1] = {(char *)q + 2};
    const int64_t k8[5] = {8, 8, 8, 8, 8}, k12[1] = {12}, l4[1] = {4};
    CHECK(loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 4, v, k8, k8, v, q));
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_F16, 64, 64, 1, v, k8, k8, v, q));
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 60, 1, v, k8, k8, v, q));
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 0, v, k8, k8, v, q));
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 5, v, k8, k8, v, q));
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 1, v, k12, k12, v, q)); /* lda 12 */
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 1, v, l4, k8, v, q));   /* lda < K */
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 1, mis, k8, k8, v, q));
    CHECK(!loom_cuda_gemm_dx_ok(LOOM_BF16, 64, 64, 1, v, k8, k8, mis, q));
    CHECK(loom_cuda_gemm_dx(g.ctx, 64, 60, 1, v, k8, k8, v, q, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda gemm_dx");
    /* wave fill: tiles of 256 x 256 (clusters of two 128-row tiles), one a
     * cluster slot, half the SMs' slots */
    struct cudaDeviceProp p;
    REQUIRE(cudaGetDeviceProperties(&p, 0) == cudaSuccess);
    const int64_t slots = p.multiProcessorCount / 2;
    CHECK(loom_cuda_gemm_wave_fill(256, 256 * slots) == 1.0);
    CHECK(loom_cuda_gemm_wave_fill(200, 256 * slots - 8) == 1.0);
    CHECK(fabs(loom_cuda_gemm_wave_fill(256, 256 * (slots + 1)) - (double)(slots + 1) / (double)(2 * slots)) < 1e-12);
    CHECK(loom_cuda_gemm_wave_fill(0, 256) == 0.0);
    gpu_close(&g);
}

static bool lora_bench_open(gpu *g, bench_op *bo, loom_cuda_gemm_handle **h) {
    *h = NULL;
    if (!gpu_open(g)) return false;
    *bo = (bench_op){g, NULL, NULL, 0};
    if (cudaEventCreate(&bo->a) != cudaSuccess || cudaEventCreate(&bo->b) != cudaSuccess ||
        loom_cuda_gemm_create(g->ctx, 0, h)) {
        loom_test_fail(__FILE__, __LINE__, "bench setup: %s", loom_last_error(g->ctx));
        return false;
    }
    return true;
}

static void lora_bench_close(gpu *g, bench_op *bo, loom_cuda_gemm_handle *h) {
    loom_cuda_gemm_free(h);
    cudaEventDestroy(bo->a);
    cudaEventDestroy(bo->b);
    gpu_close(g);
}

/* LOOM_CUDA_OPS_BENCH=1: the Qwen3-8B LoRA r=8 products (4096 tokens) the
 * pass kernel can run, against the cuBLASLt GEMMs (TB/s over x, read once
 * by the kernel). */
TEST(cuda_lora_bench) {
    if (!getenv("LOOM_CUDA_OPS_BENCH")) return;
    gpu g;
    bench_op bo;
    loom_cuda_gemm_handle *h;
    REQUIRE(lora_bench_open(&g, &bo, &h));
    const int64_t T = 4096, big = 12288;
    const loom_dtype dt = LOOM_BF16;
    void *x = bench_buf(&g, T * big, dt), *w = bench_buf(&g, 32 * big, dt);
    void *u = bench_buf(&g, T * 32, dt), *s = bench_buf(&g, T * 32, dt);
    float *gr = dalloc(&g, (size_t)(32 * big) * 4);
    const size_t sb = loom_cuda_lora_pass_scratch_bytes(T, big, 32, true, true);
    void *scr = dalloc(&g, sb);
    REQUIRE(!g.bad);
    REQUIRE(cudaMemset(gr, 0, (size_t)(32 * big) * 4) == cudaSuccess);
    char lab[128];
    const int64_t pass_k[][2] = {{4096, 8}, {12288, 8}, {1024, 8}, {4096, 24}, {4096, 16}};
    for (size_t i = 0; i < sizeof pass_k / sizeof pass_k[0]; i++) {
        const int64_t K = pass_k[i][0], k = pass_k[i][1];
        const double bytes = 2.0 * (double)(T * K);
        snprintf(lab, sizeof lab, "lora du, dB from dy  K=%lld k=%lld loom", (long long)K, (long long)k);
        BENCH(&bo, lab, bytes, 20,
              loom_cuda_lora_pass(g.ctx, T, K, k, x, K, w, false, k, 2, s, k, u, k, 2, gr, false, k, dt, scr,
                                  sb, NULL));
        snprintf(lab, sizeof lab, "lora du, dB from dy  K=%lld k=%lld cuBLASLt x2", (long long)K,
                 (long long)k);
        BENCH(&bo, lab, bytes, 20,
              (loom_cuda_gemm(g.ctx, h, false, false, T, k, K, 2, x, dt, K, w, dt, k, 0, s, dt, k, NULL),
               loom_cuda_gemm(g.ctx, h, true, false, K, k, T, 2, x, dt, K, u, dt, k, 1, gr, LOOM_F32, k,
                              NULL)));
        snprintf(lab, sizeof lab, "lora u = x A^T  K=%lld k=%lld loom", (long long)K, (long long)k);
        BENCH(&bo, lab, bytes, 20,
              loom_cuda_lora_pass(g.ctx, T, K, k, x, K, w, true, K, 1, s, k, NULL, 0, 0, NULL, false, 0, dt,
                                  scr, sb, NULL));
        snprintf(lab, sizeof lab, "lora u = x A^T  K=%lld k=%lld cuBLASLt", (long long)K, (long long)k);
        BENCH(&bo, lab, bytes, 20,
              loom_cuda_gemm(g.ctx, h, false, true, T, k, K, 1, x, dt, K, w, dt, K, 0, s, dt, k, NULL));
        snprintf(lab, sizeof lab, "lora dA += du^T x  K=%lld k=%lld loom", (long long)K, (long long)k);
        BENCH(&bo, lab, bytes, 20,
              loom_cuda_lora_pass(g.ctx, T, K, k, x, K, NULL, false, 0, 0, NULL, 0, u, k, 1, gr, true, K, dt,
                                  scr, sb, NULL));
        snprintf(lab, sizeof lab, "lora dA += du^T x  K=%lld k=%lld cuBLASLt", (long long)K, (long long)k);
        BENCH(&bo, lab, bytes, 20,
              loom_cuda_gemm(g.ctx, h, true, false, k, K, T, 1, u, dt, k, x, dt, K, 1, gr, LOOM_F32, K, NULL));
    }
    lora_bench_close(&g, &bo, h);
}

/* LOOM_CUDA_OPS_BENCH=1: LoRA's term folded into the base GEMM by
 * concatenating along K, against the two GEMMs loom runs (Qwen3-8B, r = 8,
 * 4096 tokens). Forward: y = [x | s u] [W | B]^T (x and W with row pitch
 * in + e) against y = s u B^T, then y += x W^T. Input gradient: dx = [dy |
 * du] [W ; A] (A's rows after W's) against dx = du A, then dx += dy W. e is
 * the columns the group's u or du take (r for one module, 2r or 3r for a
 * group sharing an input). */
TEST(cuda_lora_fold_bench) {
    if (!getenv("LOOM_CUDA_OPS_BENCH")) return;
    gpu g;
    bench_op bo;
    loom_cuda_gemm_handle *h;
    REQUIRE(lora_bench_open(&g, &bo, &h));
    const int64_t T = 4096, big = 12288 + 64;
    const loom_dtype dt = LOOM_BF16;
    void *x = bench_buf(&g, T * big, dt), *w = bench_buf(&g, big * big, dt);
    void *u = bench_buf(&g, T * 64, dt), *ab = bench_buf(&g, 64 * big, dt);
    void *y = bench_buf(&g, T * big, dt);
    REQUIRE(!g.bad);
    typedef struct {
        const char *what;
        int64_t in, out, e;
    } mod;
    const mod fw[] = {{"q fwd (e=3r)", 4096, 4096, 24},   {"k fwd (e=3r)", 4096, 1024, 24},
                      {"v fwd (e=3r)", 4096, 1024, 24},   {"o fwd (e=r)", 4096, 4096, 8},
                      {"gate fwd (e=2r)", 4096, 12288, 16}, {"up fwd (e=2r)", 4096, 12288, 16},
                      {"down fwd (e=r)", 12288, 4096, 8}};
    /* the group's input gradient folded into one module's GEMM (the
     * others' unchanged): v for q/k/v, up for gate/up */
    const mod bw[] = {{"qkv dx via v (e=3r)", 4096, 1024, 24}, {"o dx (e=r)", 4096, 4096, 8},
                      {"gate/up dx via up (e=2r)", 4096, 12288, 16}, {"down dx (e=r)", 12288, 4096, 8}};
    char lab[128];
    double cur = 0, fold = 0;
    for (int pass = 0; pass < 2; pass++) {
        const mod *ms = pass ? bw : fw;
        const int nm = pass ? 4 : 7;
        for (int i = 0; i < nm; i++) {
            const mod *c = &ms[i];
            float t0, t1;
            if (!pass) {
                const double fl = 2.0 * T * c->out * c->in;
                snprintf(lab, sizeof lab, "%s: s u B^T, x W^T + y", c->what);
                BENCH(&bo, lab, fl, 20,
                      (loom_cuda_gemm(g.ctx, h, false, true, T, c->out, 8, 2, u, dt, c->e, ab, dt, 8, 0,
                                      y, dt, c->out, NULL),
                       loom_cuda_gemm(g.ctx, h, false, true, T, c->out, c->in, 1, x, dt, c->in, w, dt,
                                      c->in, 1, y, dt, c->out, NULL)));
                t0 = bo.last;
                snprintf(lab, sizeof lab, "%s: [x|su] [W|B]^T", c->what);
                BENCH(&bo, lab, fl, 20,
                      loom_cuda_gemm(g.ctx, h, false, true, T, c->out, c->in + c->e, 1, x, dt,
                                     c->in + c->e, w, dt, c->in + c->e, 0, y, dt, c->out, NULL));
                t1 = bo.last;
                if (c->e == 8) { /* o and down: the residual as C (beta 1) */
                    snprintf(lab, sizeof lab, "%s: [x|su] [W|B]^T + res", c->what);
                    BENCH(&bo, lab, fl, 20,
                          loom_cuda_gemm(g.ctx, h, false, true, T, c->out, c->in + c->e, 1, x, dt,
                                         c->in + c->e, w, dt, c->in + c->e, 1, y, dt, c->out, NULL));
                }
            } else {
                const double fl = 2.0 * T * c->out * c->in;
                snprintf(lab, sizeof lab, "%s: du A, dy W + dx", c->what);
                BENCH(&bo, lab, fl, 20,
                      (loom_cuda_gemm(g.ctx, h, false, false, T, c->in, c->e, 1, u, dt, c->e, ab, dt,
                                      c->in, 0, y, dt, c->in, NULL),
                       loom_cuda_gemm(g.ctx, h, false, false, T, c->in, c->out, 1, x, dt, c->out, w,
                                      dt, c->in, 1, y, dt, c->in, NULL)));
                t0 = bo.last;
                snprintf(lab, sizeof lab, "%s: [dy|du] [W;A]", c->what);
                BENCH(&bo, lab, fl, 20,
                      loom_cuda_gemm(g.ctx, h, false, false, T, c->in, c->out + c->e, 1, x, dt,
                                     c->out + c->e, w, dt, c->in, 0, y, dt, c->in, NULL));
                t1 = bo.last;
            }
            cur += t0, fold += t1;
            fprintf(stderr, "      saves %.3f ms (%.1f%%)\n", t0 - t1, 100.0 * (t0 - t1) / t0);
        }
    }
    fprintf(stderr, "    a layer: two GEMMs %.3f ms, folded %.3f ms; 36 layers: %.2f ms saved a step\n", cur,
            fold, 36.0 * (cur - fold));
    lora_bench_close(&g, &bo, h);
}
#endif
