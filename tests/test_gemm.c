/* CPU GEMM (BLAS and the C fallback) against a double-precision reference. */
#include <stdlib.h>

#include "../src/backend/cpu/cpu_ops.h"
#include "../src/core/rng.h"
#include "harness.h"

static void fill(float *x, size_t n, uint64_t key) {
    for (size_t i = 0; i < n; i++) x[i] = (float)loom_rng_normal(7, key, i);
}

static void check_case(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, float beta,
                       bool use_ref) {
    int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
    size_t na = (size_t)((ta ? K : M) * lda), nb = (size_t)((tb ? N : K) * ldb),
           nc = (size_t)(M * ldc);
    float *A = malloc(na * 4), *B = malloc(nb * 4), *C = malloc(nc * 4), *C0 = malloc(nc * 4);
    fill(A, na, 1 + (uint64_t)M);
    fill(B, nb, 2 + (uint64_t)N);
    fill(C0, nc, 3 + (uint64_t)K);
    if (beta == 0.0f) C0[0] = NAN; /* must not propagate */
    memcpy(C, C0, nc * 4);
    (use_ref ? loom_cpu_sgemm_ref : loom_cpu_sgemm)(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta,
                                                     C, ldc);
    double worst = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                double a = ta ? A[k * lda + i] : A[i * lda + k];
                double b = tb ? B[j * ldb + k] : B[k * ldb + j];
                acc += a * b;
                mag += fabs(a * b);
            }
            double want = alpha * acc + (beta == 0.0f ? 0.0 : beta * C0[i * ldc + j]);
            double err = fabs(C[i * ldc + j] - want) / (fabs(alpha) * mag + fabs(beta) + 1e-30);
            if (!(err <= worst)) worst = err; /* also catches NaN */
        }
    CHECK_MSG(worst < 1e-6, "%s ta=%d tb=%d M=%lld N=%lld K=%lld: rel err %g",
              use_ref ? "ref" : loom_cpu_gemm_impl(), ta, tb, (long long)M, (long long)N,
              (long long)K, worst);
    free(A);
    free(B);
    free(C);
    free(C0);
}

TEST(gemm_all_transposes) {
    /* the last two are large enough to be split over threads: by rows, by columns */
    const int64_t shapes[][3] = {{1, 1, 1},   {3, 5, 7},      {17, 33, 9},   {64, 48, 80},
                                 {5, 1, 130}, {300, 70, 200}, {12, 400, 600}};
    for (int ref = 0; ref < 2; ref++)
        for (int t = 0; t < 4; t++)
            for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
                check_case(t & 1, t & 2, shapes[s][0], shapes[s][1], shapes[s][2], 1.0f, 0.0f, ref);
                check_case(t & 1, t & 2, shapes[s][0], shapes[s][1], shapes[s][2], -0.5f, 1.0f, ref);
            }
}

TEST(gemm_k_zero_scales_c) {
    float C[4] = {1, 2, 3, 4}, A[1] = {0}, B[1] = {0};
    loom_cpu_sgemm(false, false, 2, 2, 0, 1.0f, A, 1, B, 2, 2.0f, C, 2);
    CHECK(C[0] == 2 && C[3] == 8);
}
