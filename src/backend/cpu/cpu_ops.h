/* CPU reference ops. Every CUDA op has the same signature and semantics as
 * its CPU counterpart here; the CPU path is the oracle for the CUDA path. */
#ifndef LOOM_CPU_OPS_H
#define LOOM_CPU_OPS_H

#include <stdbool.h>
#include <stdint.h>

/* C = alpha * op(A) * op(B) + beta * C, fp32, row-major.
 * op(A) is M x K (A is M x K, or K x M when ta), op(B) is K x N (B is K x N,
 * or N x K when tb); lda/ldb/ldc are row strides in elements. beta == 0
 * overwrites C (NaNs in C do not propagate). Uses the system BLAS when loom
 * was built with one, else loom_cpu_sgemm_ref. */
void loom_cpu_sgemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                    const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                    int64_t ldc);
/* The plain C (OpenMP) implementation, always built. */
void loom_cpu_sgemm_ref(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float beta,
                        float *C, int64_t ldc);
/* Which implementation loom_cpu_sgemm uses: "blas" or "c". */
const char *loom_cpu_gemm_impl(void);

#endif
