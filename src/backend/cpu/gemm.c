/* fp32 GEMM on the CPU: the system BLAS when present, else OpenMP C loops. */
#include "cpu_ops.h"

#ifdef LOOM_HAVE_BLAS
#include <cblas.h>
#endif

/* One row of C: c[j] = beta*c[j] + alpha * sum_k a(k) * opB(k, j). */
static void gemm_row(bool ta, bool tb, int64_t i, int64_t N, int64_t K, float alpha,
                     const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                     float *c) {
    for (int64_t j = 0; j < N; j++) c[j] = beta == 0.0f ? 0.0f : beta * c[j];
    if (tb) { /* B is N x K: dot products over contiguous rows of B */
        for (int64_t j = 0; j < N; j++) {
            const float *b = B + j * ldb;
            float acc = 0.0f;
            if (ta)
                for (int64_t k = 0; k < K; k++) acc += A[k * lda + i] * b[k];
            else
                for (int64_t k = 0; k < K; k++) acc += A[i * lda + k] * b[k];
            c[j] += alpha * acc;
        }
    } else { /* B is K x N: accumulate scaled rows of B */
        for (int64_t k = 0; k < K; k++) {
            float a = alpha * (ta ? A[k * lda + i] : A[i * lda + k]);
            const float *b = B + k * ldb;
            for (int64_t j = 0; j < N; j++) c[j] += a * b[j];
        }
    }
}

void loom_cpu_sgemm_ref(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                        float *C, int64_t ldc) {
#pragma omp parallel for schedule(static) if (M * N * K > 32768)
    for (int64_t i = 0; i < M; i++) gemm_row(ta, tb, i, N, K, alpha, A, lda, B, ldb, beta, C + i * ldc);
}

void loom_cpu_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                    const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                    int64_t ldc) {
#ifdef LOOM_HAVE_BLAS
    if (M > 0 && N > 0 && K > 0 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX &&
        lda <= INT32_MAX && ldb <= INT32_MAX && ldc <= INT32_MAX) {
        if (beta == 0.0f) /* BLAS may read C when beta == 0; make NaNs in C harmless */
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < N; j++) C[i * ldc + j] = 0.0f;
        cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
                    (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);
        return;
    }
#endif
    loom_cpu_sgemm_ref(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

const char *loom_cpu_gemm_impl(void) {
#ifdef LOOM_HAVE_BLAS
    return "blas";
#else
    return "c";
#endif
}
