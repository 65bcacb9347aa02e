/* fp32 GEMM on the CPU: the system BLAS when present, else OpenMP C loops. */
#include "cpu_ops.h"

#ifdef LOOM_HAVE_BLAS
#include <cblas.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(LOOM_HAVE_BLAS) && defined(_OPENMP)
/* OpenMP is loom's only thread pool. A BLAS with a pool of its own
 * (OpenBLAS built with pthreads) competes with OpenMP's spinning workers
 * for the same cores and runs several times slower; so the BLAS is asked
 * for one thread and loom splits each GEMM across its OpenMP threads. */
extern void openblas_set_num_threads(int n) __attribute__((weak));
static void blas_single_thread(void) {
    static int done;
    if (!__atomic_exchange_n(&done, 1, __ATOMIC_ACQ_REL) && openblas_set_num_threads)
        openblas_set_num_threads(1);
}
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
#ifdef _OPENMP
        blas_single_thread();
        int nt = omp_in_parallel() ? 1 : omp_get_max_threads();
        /* Enough work per thread to be worth a fork (about 1 MFLOP each). */
        int64_t work = M * N * K / (1 << 20);
        if (nt > work) nt = work > 1 ? (int)work : 1;
        if (nt > 1) {
            bool by_rows = M >= N || M >= 8 * nt;
            int64_t len = by_rows ? M : N;
#pragma omp parallel num_threads(nt)
            {
                int t = omp_get_thread_num(), n = omp_get_num_threads();
                int64_t p0 = len * t / n, p1 = len * (t + 1) / n;
                if (p1 > p0) {
                    const float *a = A, *b = B;
                    float *c = C;
                    int64_t m = M, nn = N;
                    if (by_rows) {
                        a = ta ? A + p0 : A + p0 * lda;
                        c = C + p0 * ldc;
                        m = p1 - p0;
                    } else {
                        b = tb ? B + p0 * ldb : B + p0;
                        c = C + p0;
                        nn = p1 - p0;
                    }
                    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                                tb ? CblasTrans : CblasNoTrans, (int)m, (int)nn, (int)K, alpha, a,
                                (int)lda, b, (int)ldb, beta, c, (int)ldc);
                }
            }
            return;
        }
#endif
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
