/* CUDA ops: the GPU versions of the CPU reference ops (src/backend/cpu/cpu_ops.h,
 * src/train/adamw.h), with the same semantics. C interface; implementations in
 * src/backend/cuda/ops_*.cu (one op family per file), built with `make CUDA=1`.
 *
 * Conventions, for every function here:
 * - Every tensor and index pointer is a device pointer (ids, targets,
 *   positions, cu_seqlens, qidx too); scalars are host values.
 * - `stream` is a cudaStream_t, or NULL for the default stream. Kernels are
 *   queued on it and the call returns without waiting; launch errors are
 *   returned as LOOM_ERR_DEVICE with the op's name ("cuda rmsnorm_fwd: ...").
 *   A failure inside a kernel shows up at the next synchronisation.
 * - Activations may be F32, BF16 or F16 (a loom_dtype says which); arithmetic
 *   is fp32 (sums in fp32 or double, as documented per op), rounded once to
 *   the output dtype (round to nearest even). Parameter gradients and
 *   optimizer state are fp32.
 * - Like the CPU ops: input gradients are overwritten, parameter gradients
 *   (dW, dw, db) accumulate (+=), a NULL dw/db means a frozen parameter.
 * - Every reduction runs in a fixed order that depends only on the shapes
 *   (never on the GPU, the launch or timing): results are bit-reproducible
 *   run to run. No atomics on floating point anywhere.
 * - Indices (ids, targets, positions, cu_seqlens, qidx) are trusted: the
 *   caller validates batches on the host before upload, as for the CPU ops. */
#ifndef LOOM_CUDA_OPS_H
#define LOOM_CUDA_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../adamw.h"
#include "loom.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- GEMM (ops_gemm.cu): cuBLASLt ----
 * A handle owns a cuBLASLt handle, a device workspace and a cache of
 * matmul descriptors and chosen algorithms per shape (dtypes, transposes,
 * sizes, strides, pointer alignment). Not thread-safe; the workspace is
 * shared by the calls made through the handle, so use one handle per
 * stream (or keep the streams that share one ordered). */
typedef struct loom_cuda_gemm_handle loom_cuda_gemm_handle;

#define LOOM_CUDA_GEMM_WORKSPACE_DEFAULT ((size_t)32 << 20)
/* workspace_bytes 0: LOOM_CUDA_GEMM_WORKSPACE_DEFAULT (32 MiB). */
loom_status loom_cuda_gemm_create(loom_ctx *ctx, size_t workspace_bytes, loom_cuda_gemm_handle **out);
void loom_cuda_gemm_free(loom_cuda_gemm_handle *h);

/* C = alpha * op(A) * op(B) + beta * C, row-major, with loom_cpu_sgemm's
 * semantics: op(A) is M x K (A is M x K, or K x M when ta), op(B) is K x N
 * (B is K x N, or N x K when tb); lda/ldb/ldc are row strides in elements.
 * beta == 0 overwrites C (C is not read). A and B: both F32, both BF16 or
 * both F16; C: F32 or the dtype of A and B. Accumulation is fp32
 * (CUBLAS_COMPUTE_32F, never TF32). beta == 1 with an F32 C accumulates
 * into it (weight gradients into fp32 main grads). */
loom_status loom_cuda_gemm(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb, int64_t M,
                           int64_t N, int64_t K, float alpha, const void *A, loom_dtype a_dtype,
                           int64_t lda, const void *B, loom_dtype b_dtype, int64_t ldb, float beta,
                           void *C, loom_dtype c_dtype, int64_t ldc, void *stream);
/* How many shapes the handle has cached (for tests and logs). */
int loom_cuda_gemm_cached(const loom_cuda_gemm_handle *h);
/* G GEMMs of one call's transposes, leading dimensions, alpha, beta and
 * dtypes (A, B in ab; C in cdt: ab, or F32), each its own M, N, K and
 * pointers (g: a host array of backend.h's loom_gemm_group), each with
 * loom_cuda_gemm's semantics: M or N 0 skips the group, K 0 scales C by beta
 * (beta 0 writes zeros). Where cdt is ab and every pointer is 16-byte
 * aligned (cuBLAS 12.5 or later), the groups with work (two or more) go to
 * cublasGemmGroupedBatchedEx in one call (the handle's cuBLAS handle and a
 * device array of their pointers, both made at the first use); otherwise (an
 * F32 C of 16-bit inputs: weight gradients), when cuBLAS refuses the call,
 * or with LOOM_GEMM_GROUPED=loop in the environment at the handle's
 * creation, one loom_cuda_gemm a group. Calls with a side of at most 16
 * (LoRA's rank: loom_cuda_gemm_skinny's shapes) go to loom's own kernels
 * first (not with LOOM_GEMM_GROUPED=loop). */
struct loom_gemm_group;
loom_status loom_cuda_gemm_grouped(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb, int G,
                                   const struct loom_gemm_group *g, float alpha, int64_t lda,
                                   int64_t ldb, loom_dtype ab, float beta, loom_dtype cdt,
                                   int64_t ldc, void *stream);
/* The grouped GEMMs with a skinny side (ops_gemm_skinny.cu says which):
 * one launch for all groups with work (two for sums over rows, through fp32
 * partial sums in ws), their descriptors copied to desc (desc_cap bytes, at
 * least LOOM_CUDA_SKINNY_DESC_BYTES a group) in stream order; flags:
 * LOOM_CUDA_SKINNY_MMA runs x A^T's dot products of 16-bit rows on tensor
 * cores (the handle's default; LOOM_SKINNY_MMA=0 runs the FMA kernel),
 * LOOM_CUDA_SKINNY_SCALAR_REDUCE the sums over rows by the scalar kernel
 * even where the vector one applies (LOOM_SKINNY_REDUCE=scalar: to compare,
 * and for the tests). *done false, nothing launched, when the call is not
 * of those shapes or alignments. */
#define LOOM_CUDA_SKINNY_DESC_BYTES 64
#define LOOM_CUDA_SKINNY_MMA 1u
#define LOOM_CUDA_SKINNY_SCALAR_REDUCE 2u
/* A grouped GEMM's group of this many rows or more (ta false, N and K at
 * least 256) runs as a GEMM of its own (loom_cuda_gemm). */
#define LOOM_CUDA_GROUP_ALONE_ROWS 1024
loom_status loom_cuda_gemm_skinny(loom_ctx *ctx, bool ta, bool tb, int G,
                                  const struct loom_gemm_group *g, float alpha, int64_t lda,
                                  int64_t ldb, loom_dtype ab, float beta, loom_dtype cdt,
                                  int64_t ldc, void *desc, size_t desc_cap, void *ws,
                                  size_t ws_bytes, unsigned flags, void *stream, bool *done);
/* For the ops bench: ms[i] = the mean time of cuBLASLt's i-th candidate
 * for this GEMM (alpha 1; i = 0 is the heuristic's choice, the one
 * loom_cuda_gemm runs), reps runs each on the default stream, up to
 * max_algos of them; *n how many were timed (ms[i] = -1: it failed).
 * With sets, sets[i] = how many memsets the candidate launches besides its
 * kernels (from a stream capture of one call; -1 when it cannot be
 * captured). */
loom_status loom_cuda_gemm_survey(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb,
                                  int64_t M, int64_t N, int64_t K, const void *A, loom_dtype a_dtype,
                                  int64_t lda, const void *B, int64_t ldb, float beta, void *C,
                                  loom_dtype c_dtype, int64_t ldc, int max_algos, int reps, float *ms,
                                  int *sets, int *n);

/* ---- the forward projection with LoRA's term (gemm_sm90.cu): Hopper, BF16 ----
 * y (T, N) = x W^T + s u b^T in one GEMM: x (T, K), W (N, K), u (T, r; ldu),
 * b (N, r), all row-major, fp32 accumulation, y written (not read). _ok says
 * whether the kernel takes these operands on the current device (sm_90, BF16,
 * N and K multiples of 8, r a multiple of 8 up to 64, ldu a multiple of 8,
 * 16-byte aligned pointers); the caller runs cuBLASLt's pair where it does not. */
bool loom_cuda_gemm_lora_ok(loom_dtype dtype, int64_t T, int64_t N, int64_t K, const void *x,
                            const void *W, const void *u, int64_t ldu, const void *b, int64_t r,
                            const void *y);
loom_status loom_cuda_gemm_lora(loom_ctx *ctx, int64_t T, int64_t N, int64_t K, const void *x,
                                const void *W, const void *u, int64_t ldu, const void *b, int64_t r,
                                float s, void *y, void *stream);

/* ---- input gradients as one GEMM (gemm_sm90.cu): Hopper, BF16 ----
 * d (T, N) = sum over s < nseg of a[s] (T, K[s]; lda[s]) b[s] (K[s], N), all
 * row-major, one fp32 accumulator, d written (not read): the projections that
 * share an input (dx = dq Wq + dk Wk + dv Wv) and LoRA's du A with them.
 * _ok: sm_90, BF16, 1 to 4 segments, N and every lda a multiple of 8, 16-byte
 * aligned pointers; the caller runs one GEMM a segment where it says no. */
bool loom_cuda_gemm_dx_ok(loom_dtype dtype, int64_t T, int64_t N, int nseg, const void *const *a,
                          const int64_t *lda, const int64_t *K, const void *const *b, const void *d);
loom_status loom_cuda_gemm_dx(loom_ctx *ctx, int64_t T, int64_t N, int nseg, const void *const *a,
                              const int64_t *lda, const int64_t *K, const void *const *b, void *d,
                              void *stream);
/* How full the kernel's waves of tiles are for a (T, N) output on the current
 * device: tiles over whole waves' worth of tile slots (0 where it does not
 * run). Under 0.9 cuBLASLt's own tile choice can win back what the sum saves. */
double loom_cuda_gemm_wave_fill(int64_t T, int64_t N);

/* ---- LoRA's pass over dy (ops_lora.cu): BF16/F16 on tensor cores ----
 * k is the small dimension (an adapter's rank, or a group's ranks side by
 * side): a multiple of 8 up to LOOM_CUDA_LORA_MAX_K (loom_cuda_lora_ok).
 * From one read of x (T, K; ldx), when s is not NULL s (T, k; lds, x's
 * dtype) = alpha_s x op(W), op(W) = W^T for W (k, K; ldw) when w_kk, else W
 * (K, k; ldw); when g is not NULL the fp32 g += alpha_g x^T v with v (T, k;
 * ldv), g (K, k; ldg) or, with g_t, its transpose (k, K; ldg). Every operand
 * 16-byte aligned with a row stride of whole 16-byte units, K a multiple of
 * 8. Arithmetic in fp32, s rounded once; fixed-order sums (the split
 * depends on the shape only). scratch: loom_cuda_lora_pass_scratch_bytes(T,
 * K, k, s != NULL, g != NULL) bytes of device memory (the blocks' partial
 * sums). */
#define LOOM_CUDA_LORA_MAX_K 32
bool loom_cuda_lora_ok(loom_dtype dtype, int64_t k);
/* Whether loom_cuda_lora_pass takes these operands (v NULL: no g). */
bool loom_cuda_lora_pass_ok(loom_dtype dtype, int64_t T, int64_t K, int64_t k, const void *x,
                            int64_t ldx, const void *w, bool w_kk, int64_t ldw, const void *s,
                            int64_t lds, const void *v, int64_t ldv, bool g_t, int64_t ldg);
size_t loom_cuda_lora_pass_scratch_bytes(int64_t T, int64_t K, int64_t k, bool s, bool g);
loom_status loom_cuda_lora_pass(loom_ctx *ctx, int64_t T, int64_t K, int64_t k, const void *x,
                                int64_t ldx, const void *w, bool w_kk, int64_t ldw, float alpha_s,
                                void *s, int64_t lds, const void *v, int64_t ldv, float alpha_g,
                                float *g, bool g_t, int64_t ldg, loom_dtype dtype, void *scratch,
                                size_t scratch_bytes, void *stream);
/* Up to 3 passes in one launch (and one launch of their sums), each as
 * loom_cuda_lora_pass with its arguments below; all of one k and one w_kk.
 * Each pass is split as it would be alone, so its results are the same bits.
 * scratch: loom_cuda_lora_pass_n_scratch_bytes(n, ops) bytes. */
typedef struct loom_cuda_pass_op {
    int64_t T, K, k;
    const void *x;
    int64_t ldx;
    const void *w;
    bool w_kk;
    int64_t ldw;
    float alpha_s;
    void *s;
    int64_t lds;
    const void *v;
    int64_t ldv;
    float alpha_g;
    float *g;
    bool g_t;
    int64_t ldg;
} loom_cuda_pass_op;
size_t loom_cuda_lora_pass_n_scratch_bytes(int n, const loom_cuda_pass_op *ops);
loom_status loom_cuda_lora_pass_n(loom_ctx *ctx, int n, const loom_cuda_pass_op *ops, loom_dtype dtype,
                                  void *scratch, size_t scratch_bytes, void *stream);

/* ---- embedding (ops_embedding.cu) ----
 * ids: (T) in [0, rows of W); W: (V, H) in w_dtype; out: (T, H) in out_dtype.
 * bwd: dW (V, H) fp32 += dout (T, H); deterministic and bit-identical to the
 * CPU: each thread owns one column and adds the tokens in token order. */
loom_status loom_cuda_embedding_fwd(loom_ctx *ctx, const int32_t *ids, int64_t T, const void *W,
                                    loom_dtype w_dtype, int64_t H, void *out, loom_dtype out_dtype,
                                    void *stream);
loom_status loom_cuda_embedding_bwd(loom_ctx *ctx, const int32_t *ids, int64_t T, const void *dout,
                                    loom_dtype dout_dtype, int64_t H, float *dW, void *stream);

/* ---- RMSNorm (ops_rmsnorm.cu) ----
 * y = (woff + w) * (x * rstd) (woff + w formed in fp32 wherever w is read;
 * woff 1: Qwen3.5's zero-centred weights, 0: the others), rstd = 1/sqrt(mean(x^2) + eps) with the mean in double
 * (as the CPU; on 16-bit rows, fp32 sums of 8 elements added in double, and
 * the backward's element products in fp32). x: (N, H) x_dtype; w: (H) w_dtype; y: (N, H) y_dtype (may be
 * x when the dtypes agree); rstd: (N) fp32, saved for the backward.
 * bwd: dx (N, H) overwritten, may alias dy (same dtype); dw (H) fp32
 * accumulated, NULL when frozen. dw is reduced deterministically: per chunk
 * of rows into `scratch` (doubles), then the chunks by a fixed tree (a warp
 * per column). scratch:
 * loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) bytes of device memory (not
 * needed, may be NULL, when dw is NULL). */
loom_status loom_cuda_rmsnorm_fwd(loom_ctx *ctx, const void *x, loom_dtype x_dtype, const void *w,
                                  loom_dtype w_dtype, float woff, int64_t N, int64_t H, float eps, void *y,
                                  loom_dtype y_dtype, float *rstd, void *stream);
size_t loom_cuda_rmsnorm_bwd_scratch_bytes(int64_t N, int64_t H);
loom_status loom_cuda_rmsnorm_bwd(loom_ctx *ctx, const void *dy, loom_dtype dy_dtype, const void *x,
                                  loom_dtype x_dtype, const void *w, loom_dtype w_dtype, float woff,
                                  const float *rstd, int64_t N, int64_t H, void *dx,
                                  loom_dtype dx_dtype, float *dw, void *scratch, void *stream);

/* Fused forms (16-bit rows, 16-byte aligned; loom_cuda_rmsnorm_fused_ok /
 * loom_cuda_qknorm_rope_ok say which shapes; others get LOOM_ERR_UNSUPPORTED),
 * each giving the values of its ops run apart:
 * - add_rmsnorm_fwd: xsum = x + res (rounded as loom_cuda_residual_add;
 *   xsum may alias x or res), then rmsnorm_fwd of xsum.
 * - rmsnorm_bwd_add: dx += rmsnorm_bwd's dx (rounded to dtype first, as
 *   rmsnorm_bwd then residual_add); dx must not alias dy.
 * - qknorm_rope_fwd / _bwd: the per-head norm of Qwen3's q and k, then
 *   RoPE: x (N = T * nh rows of D), w (D); y = rope(rmsnorm(x)); bwd takes
 *   dy of y and gives dx (may alias dy), dw as rmsnorm_bwd. cs: the
 *   (cos, sin) table of loom_cuda_rope_table for the T tokens.
 * With dw, rows of 256, 512 or 1024 and heads of 64, 128 or 256 take one pass
 * for dx and dw; other rows run the weight gradient as its own pass. */
bool loom_cuda_rmsnorm_fused_ok(loom_dtype dtype, int64_t H);
bool loom_cuda_qknorm_rope_ok(loom_dtype dtype, int64_t D);
loom_status loom_cuda_add_rmsnorm_fwd(loom_ctx *ctx, const void *x, const void *res, void *xsum,
                                      loom_dtype dtype, const void *w, loom_dtype w_dtype, float woff,
                                      int64_t N, int64_t H, float eps, void *y, float *rstd,
                                      void *stream);
/* The weight gradient's last stage deferred over many ops: with a batch,
 * rmsnorm_bwd_add and qknorm_rope_bwd leave their chunks' partial sums in
 * scratch taken from the batch (loom_cuda_dw_batch_scratch) and record where;
 * loom_cuda_dw_batch_flush adds every recorded op's partials into its dw in
 * one launch, each column by the same tree as the op's own last stage (the
 * same bits). A layer's four norms cost one small launch a batch instead of
 * one each. */
typedef struct loom_cuda_dw_batch loom_cuda_dw_batch;
loom_status loom_cuda_dw_batch_create(loom_ctx *ctx, size_t scratch_bytes, loom_cuda_dw_batch **out);
void loom_cuda_dw_batch_free(loom_cuda_dw_batch *b);
/* Scratch for one op of N rows of H (loom_cuda_rmsnorm_bwd_scratch_bytes),
 * or NULL when the batch has no room left for it (flush, then ask again;
 * still NULL: the op is larger than the whole batch). */
void *loom_cuda_dw_batch_scratch(loom_cuda_dw_batch *b, int64_t N, int64_t H);
/* Adds what was recorded and empties the batch (nothing recorded: no launch). */
loom_status loom_cuda_dw_batch_flush(loom_ctx *ctx, loom_cuda_dw_batch *b, void *stream);
/* Forgets what was recorded (after a failed backward) without adding it. */
void loom_cuda_dw_batch_drop(loom_cuda_dw_batch *b);
/* batch: NULL, or the batch that `scratch` came from (dw then added at its flush) */
loom_status loom_cuda_rmsnorm_bwd_add(loom_ctx *ctx, const void *dy, const void *x, loom_dtype dtype,
                                      const void *w, loom_dtype w_dtype, float woff,
                                      const float *rstd, int64_t N,
                                      int64_t H, void *dx, float *dw, void *scratch,
                                      loom_cuda_dw_batch *batch, void *stream);
loom_status loom_cuda_qknorm_rope_fwd(loom_ctx *ctx, const void *x, loom_dtype dtype, const void *w,
                                      loom_dtype w_dtype, float woff, int64_t N, int64_t nh, int64_t D, float eps,
                                      const float *cs, void *y, float *rstd, void *stream);
loom_status loom_cuda_qknorm_rope_bwd(loom_ctx *ctx, const void *dy, const void *x, loom_dtype dtype,
                                      const void *w, loom_dtype w_dtype, float woff,
                                      const float *rstd, int64_t N,
                                      int64_t nh, int64_t D, const float *cs, void *dx, float *dw,
                                      void *scratch, loom_cuda_dw_batch *batch, void *stream);

/* ---- Gated DeltaNet (ops_gdn.cu: convolution, gates, gated norm;
 * ops_gdn_rule.cu: the chunked gated delta rule) ----
 * The semantics of src/backend/cpu/cpu_gdn.h (the CPU reference, in double):
 * T tokens packed as documents cu (ndocs + 1, device, trusted), activations
 * and weights in `dtype`, g / beta and parameter gradients fp32, parameter
 * gradients added to (NULL: frozen). Arithmetic in fp32 (sums of the
 * reductions over tokens in double); every reduction in a fixed order (no
 * atomics). `scratch`: device memory of the size the matching
 * *_scratch_bytes gives (nothing kept in it between calls).
 * tests/test_backend_gdn.c compares them with the CPU's on a GPU (run on an
 * H200 by tests/gpu/qwen35.sh); `make test-emu` runs them on the CPU. */
/* y (T, C) = silu(causal depthwise conv of x (T, C) by w (C, K)), K <= 16;
 * bwd: dx (T, C), dw (C, K) += (scratch only with dw). 16-bit data takes the
 * sigmoid's hardware approximations (ops_gdn.cu). */
size_t loom_cuda_gdn_conv_scratch_bytes(int64_t T, int64_t C, int64_t K);
loom_status loom_cuda_gdn_conv_fwd(loom_ctx *ctx, const void *x, const void *w, loom_dtype dtype,
                                   int64_t T, int64_t C, int64_t K, const int32_t *cu,
                                   int64_t ndocs, void *y, void *stream);
loom_status loom_cuda_gdn_conv_bwd(loom_ctx *ctx, const void *dy, const void *x, const void *w,
                                   loom_dtype dtype, int64_t T, int64_t C, int64_t K,
                                   const int32_t *cu, int64_t ndocs, void *dx, float *dw,
                                   void *scratch, void *stream);
/* g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), (T, H) fp32;
 * bwd: da, db (T, H) in dtype, dA_log, ddt_bias (H) += (scratch with either) */
size_t loom_cuda_gdn_gate_scratch_bytes(int64_t T, int64_t H);
loom_status loom_cuda_gdn_gate_fwd(loom_ctx *ctx, const void *a, const void *b, const void *A_log,
                                   const void *dt_bias, loom_dtype dtype, int64_t T, int64_t H,
                                   float *g, float *beta, void *stream);
loom_status loom_cuda_gdn_gate_bwd(loom_ctx *ctx, const float *dg, const float *dbeta,
                                   const void *a, const void *b, const void *A_log,
                                   const void *dt_bias, loom_dtype dtype, int64_t T, int64_t H,
                                   void *da, void *db, float *dA_log, float *ddt_bias,
                                   void *scratch, void *stream);
/* y = w (x rstd) silu(z) over N rows of D, rstd (N) fp32; bwd: dx, dz (N, D)
 * (not aliasing dy), dw (D) += (scratch only with dw) */
size_t loom_cuda_gdn_norm_scratch_bytes(int64_t N, int64_t D);
loom_status loom_cuda_gdn_norm_fwd(loom_ctx *ctx, const void *x, const void *z, const void *w,
                                   loom_dtype dtype, int64_t N, int64_t D, float eps, void *y,
                                   float *rstd, void *stream);
loom_status loom_cuda_gdn_norm_bwd(loom_ctx *ctx, const void *dy, const void *x, const void *z,
                                   const void *w, loom_dtype dtype, const float *rstd, int64_t N,
                                   int64_t D, void *dx, void *dz, float *dw, void *scratch,
                                   void *stream);
/* The rule: qkv (T, 2 Hk dk + Hv dv), o (T, Hv, dv); bwd: dqkv (qkv's
 * layout), dg, dbeta (T, Hv). dk <= 256, Hv a multiple of Hk. The scratch
 * (forward's, or backward's with bwd) holds the normalised q and k, each
 * chunk's matrices and starting states: loom_cuda_gdn_scratch_bytes (with
 * the keep_chunks passed to the call, 0 without a keep buffer). keep: NULL,
 * or loom_cuda_gdn_keep_bytes for keep_chunks chunks (0 bytes: this dtype
 * and dk keep nothing, and keep is not read), which the forward fills and
 * the backward of the same inputs reads instead of running the forward's
 * chunk passes again; refused when the documents can make more chunks than
 * that (gdn_ws.h's loom_gdn_ws_chunks). */
size_t loom_cuda_gdn_scratch_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                   int64_t ndocs, bool bwd, loom_dtype dtype,
                                   int64_t keep_chunks);
size_t loom_cuda_gdn_keep_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                loom_dtype dtype, int64_t keep_chunks);
loom_status loom_cuda_gdn_fwd(loom_ctx *ctx, const void *qkv, loom_dtype dtype, const float *g,
                              const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                              int64_t dv, const int32_t *cu, int64_t ndocs, void *o,
                              void *scratch, void *keep, int64_t keep_chunks, void *stream);
loom_status loom_cuda_gdn_bwd(loom_ctx *ctx, const void *dout, const void *qkv, loom_dtype dtype,
                              const float *g, const float *beta, int64_t T, int64_t Hk, int64_t Hv,
                              int64_t dk, int64_t dv, const int32_t *cu, int64_t ndocs,
                              void *dqkv, float *dg, float *dbeta, void *scratch,
                              const void *keep, int64_t keep_chunks, void *stream);

/* ---- RoPE (ops_rope.cu) ----
 * In place on x: (T, nh, D) in dtype, the first rd dimensions of a head
 * turned (rd even, <= D: cpu_ops.h's pairing); pos: (T); inv_freq: (rd/2)
 * fp32 (from loom_rope_inv_freq, uploaded). The CPU's exact angle rule:
 * angle = fp32(pos * inv_freq[i]), cos/sin of it in double, rounded to fp32;
 * the rotation in fp32 without fused multiply-adds. bwd rotates dx by -angle. */
loom_status loom_cuda_rope_fwd(loom_ctx *ctx, void *x, loom_dtype dtype, int64_t T, int64_t nh,
                               int64_t D, int64_t rd, const int32_t *pos, const float *inv_freq,
                               void *stream);
loom_status loom_cuda_rope_bwd(loom_ctx *ctx, void *dx, loom_dtype dtype, int64_t T, int64_t nh,
                               int64_t D, int64_t rd, const int32_t *pos, const float *inv_freq,
                               void *stream);
/* cs (T, D/2, 2) fp32: cos and sin of every token's angle per frequency, by
 * the rule above (computed once per micro-batch for the fused ops). */
loom_status loom_cuda_rope_table(loom_ctx *ctx, const int32_t *pos, int64_t T, int64_t D,
                                 const float *inv_freq, float *cs, void *stream);

/* ---- element-wise (ops_elementwise.cu) ----
 * SwiGLU over n elements, all tensors in dtype: h = silu(g) * u.
 * bwd: dg, du overwritten (dg may alias g or dh; du may alias u or dh). */
loom_status loom_cuda_swiglu_fwd(loom_ctx *ctx, const void *g, const void *u, int64_t n, void *h,
                                 loom_dtype dtype, void *stream);
loom_status loom_cuda_swiglu_bwd(loom_ctx *ctx, const void *dh, const void *g, const void *u,
                                 int64_t n, void *dg, void *du, loom_dtype dtype, void *stream);
/* The gated attention's output gate over n elements in dtype: y = o *
 * sigmoid(g) in fp32, rounded once. bwd: do_ = dy sigmoid(g) (may alias
 * dy), dg = dy o sigmoid(g) (1 - sigmoid(g)) (may alias g). */
loom_status loom_cuda_gate_fwd(loom_ctx *ctx, const void *o, const void *g, int64_t n, void *y,
                               loom_dtype dtype, void *stream);
loom_status loom_cuda_gate_bwd(loom_ctx *ctx, const void *dy, const void *o, const void *g,
                               int64_t n, void *do_, void *dg, loom_dtype dtype, void *stream);
/* y += x over n elements (y_dtype and x_dtype may differ, e.g. an fp32
 * residual stream and a bf16 branch). */
loom_status loom_cuda_residual_add(loom_ctx *ctx, void *y, loom_dtype y_dtype, const void *x,
                                   loom_dtype x_dtype, int64_t n, void *stream);
/* x (n, dtype) = loom_rng_gauss4_at(base, i), rounded to dtype. */
loom_status loom_cuda_fill_randn(loom_ctx *ctx, void *x, loom_dtype dtype, int64_t n, uint64_t base,
                                 void *stream);
/* y: (T, N) y_dtype; b: (N) b_dtype; fwd y[t, :] += b.
 * bwd: db (N) fp32 += sum_t dy[t, :] (double, fixed order); NULL db: no-op. */
loom_status loom_cuda_add_bias_fwd(loom_ctx *ctx, void *y, loom_dtype y_dtype, const void *b,
                                   loom_dtype b_dtype, int64_t T, int64_t N, void *stream);
loom_status loom_cuda_add_bias_bwd(loom_ctx *ctx, const void *dy, loom_dtype dy_dtype, int64_t T,
                                   int64_t N, float *db, void *stream);

/* ---- cross-entropy (ops_xent.cu) ----
 * logits: (T, Vp) in dtype, the first V columns real; targets: (T) in [0, V)
 * or -100 (ignored). Per row: max in fp32, exp in fp32 (CPU: double; ~1e-7
 * relative), sums of exp and the entropy in double. Writes token_logprob, entropy, lse (T, fp32; each may be NULL, the
 * backward needs lse) as loom_cpu_cross_entropy_fwd, and:
 * token_loss: (T) double, -log p(target) (0 when ignored), may be NULL;
 * loss: (1) double, the sum of token_loss over the T tokens (a fixed-order
 * tree in double, not token order), may be NULL; needs token_loss.
 * bwd: dlogits[t, c] = scale * (p(c) - [c == target]) for valid tokens and
 * c < V, 0 for padding columns and ignored tokens; dlogits may alias logits
 * (then dlogits_dtype must equal dtype). */
loom_status loom_cuda_cross_entropy_fwd(loom_ctx *ctx, const void *logits, loom_dtype dtype,
                                        const int32_t *targets, int64_t T, int64_t V, int64_t Vp,
                                        float *token_logprob, float *entropy, float *lse,
                                        double *token_loss, double *loss, void *stream);
loom_status loom_cuda_cross_entropy_bwd(loom_ctx *ctx, const void *logits, loom_dtype dtype,
                                        const float *lse, const int32_t *targets, int64_t T,
                                        int64_t V, int64_t Vp, float scale, void *dlogits,
                                        loom_dtype dlogits_dtype, void *stream);

/* ---- attention (ops_attention.cu) ----
 * Causal grouped-query attention with document masking, as
 * loom_cpu_attention_*: q, out, dout, dq: (Tq, Hq, D); k, v, dk, dv:
 * (T, Hkv, D), all in dtype (F32, BF16 or F16); cu_seqlens: (ndocs+1) with
 * 0 = c0 < ... < c_ndocs = T; lse: (Tq, Hq) fp32 natural log-sum-exp of the
 * scaled scores. Tiled kernels with an online softmax and fp32 accumulators.
 * BF16/F16 with D = 64 or 128 (and 16-byte aligned tensors) run on tensor
 * cores (mma.sync), the probabilities P and dS rounded to the input type
 * for the products with V, K and Q, as FlashAttention does; everything else
 * (F32, other D) on CUDA cores in fp32. D <= LOOM_CUDA_ATTN_MAX_D (refused
 * above).
 * The _q variants: query t is token qidx[t] (ascending) of the T tokens of
 * k, v and cu_seqlens (context parallel); qidx NULL means qidx[t] = t, Tq = T.
 * bwd: dq, dk, dv overwritten; dk and dv get the contributions of these Tq
 * queries only. Deterministic: dq by one kernel over query tiles, dk/dv by
 * one over key tiles, each summing in a fixed order (no atomics). */
#define LOOM_CUDA_ATTN_MAX_D 256
loom_status loom_cuda_attention_fwd(loom_ctx *ctx, const void *q, const void *k, const void *v,
                                    loom_dtype dtype, int64_t T, int64_t Hq, int64_t Hkv,
                                    int64_t D, const int32_t *cu_seqlens, int64_t ndocs,
                                    float scale, void *out, float *lse, void *stream);
loom_status loom_cuda_attention_bwd(loom_ctx *ctx, const void *dout, const void *q, const void *k,
                                    const void *v, const void *out, const float *lse,
                                    loom_dtype dtype, int64_t T, int64_t Hq, int64_t Hkv,
                                    int64_t D, const int32_t *cu_seqlens, int64_t ndocs,
                                    float scale, void *dq, void *dk, void *dv, void *stream);
loom_status loom_cuda_attention_fwd_q(loom_ctx *ctx, const void *q, const int32_t *qidx,
                                      int64_t Tq, const void *k, const void *v, loom_dtype dtype,
                                      int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                      const int32_t *cu_seqlens, int64_t ndocs, float scale,
                                      void *out, float *lse, void *stream);
loom_status loom_cuda_attention_bwd_q(loom_ctx *ctx, const void *dout, const void *q,
                                      const int32_t *qidx, int64_t Tq, const void *k,
                                      const void *v, const void *out, const float *lse,
                                      loom_dtype dtype, int64_t T, int64_t Hq, int64_t Hkv,
                                      int64_t D, const int32_t *cu_seqlens, int64_t ndocs,
                                      float scale, void *dq, void *dk, void *dv, void *stream);

/* ---- attention through cuDNN (ops_attention_cudnn.cu) ----
 * cuDNN's fused flash-attention engines, reached through its graph API, for
 * every query of the documents of cu_seqlens: the contract of
 * loom_cuda_attention_fwd/bwd (layouts, natural-log lse, overwritten
 * outputs), BF16/F16, D a multiple of 8 up to 128, 16-byte aligned tensors.
 * L > 0 says every document is L tokens long (B = T / L sequences; cu_seqlens
 * is not read); L = 0 reads the lengths from cu_seqlens on the device (at
 * most 512 documents; cuDNN's packed layout). The backward adds dQ with
 * atomics (its last bits vary by run), like loom's fused backward.
 * A handle owns a cuDNN handle and the plans built per shape (the first
 * call of a shape builds them). *taken is false, with LOOM_OK, when the
 * inputs do not fit or cuDNN has no engine for the shape (the reason is kept,
 * see loom_cuda_attn_counts): the caller then runs loom's kernels. Not
 * thread-safe: one handle per stream. */
typedef struct loom_cuda_attn_handle loom_cuda_attn_handle;
loom_status loom_cuda_attn_create(loom_ctx *ctx, loom_cuda_attn_handle **out);
void loom_cuda_attn_free(loom_cuda_attn_handle *h);
/* A tool for the benchmarks, not for training: with out set, the first call
 * of each shape (equal documents) also times every engine config cuDNN has
 * for its graph (each engine's knobs: all combinations up to 128, else one at
 * a time) on the call's own buffers, against the heuristics' choice, and
 * prints each with the largest difference of its outputs. NULL turns it off. */
void loom_cuda_attn_survey(loom_cuda_attn_handle *h, FILE *out);
/* Calls run through cuDNN so far, and why cuDNN last refused a shape ("" if
 * it never did). */
void loom_cuda_attn_counts(const loom_cuda_attn_handle *h, long long *fwd, long long *bwd,
                           const char **why);
loom_status loom_cuda_attention_cudnn_fwd(loom_ctx *ctx, loom_cuda_attn_handle *h, const void *q,
                                          const void *k, const void *v, loom_dtype dtype, int64_t T,
                                          int64_t Hq, int64_t Hkv, int64_t D,
                                          const int32_t *cu_seqlens, int64_t ndocs, int64_t L,
                                          float scale, void *out, float *lse, void *stream,
                                          bool *taken);
loom_status loom_cuda_attention_cudnn_bwd(loom_ctx *ctx, loom_cuda_attn_handle *h, const void *dout,
                                          const void *q, const void *k, const void *v,
                                          const void *out, const float *lse, loom_dtype dtype,
                                          int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                                          const int32_t *cu_seqlens, int64_t ndocs, int64_t L,
                                          float scale, void *dq, void *dk, void *dv, void *stream,
                                          bool *taken);

/* ---- mixture of experts (ops_moe.cu) ----
 * cpu_moe.h's semantics (N tokens, E experts, the top k of each): x, xg, yg,
 * y, dy, dyg, dxg, dx and z, dz in dtype; probs, w, dw, psum and ga fp32;
 * idx, counts, order and pos int32; N k below 2^31, E up to
 * LOOM_CUDA_MOE_MAX_E. One warp per row (a token's E logits, a token's or a
 * grouped row's H features); every sum in a fixed order.
 * - router_fwd: probs = softmax(z) in fp32 (z widened first; expf, the sum a
 *   warp tree, IEEE division), the top k with ties to the lower expert, w
 *   renormalised when norm_topk (the k weights summed in slot order); psum
 *   (NULL: not wanted) += the column sums of probs, in double over chunks of
 *   rows, then the chunks in order (two more launches; scratch:
 *   loom_cuda_moe_router_scratch_bytes(N, E, psum != NULL) bytes of device
 *   memory). Probabilities within a few fp32 ulp of the CPU's, so the choice
 *   is the CPU's wherever no two of a row's are that close or exactly equal.
 *   lse (NULL: not wanted): each row's max + logf(the warp's sum).
 * - router_bwd: dz written; dw, ga and lse may be NULL (as the CPU, in
 *   double where it is); zc (with lse) one float on the device.
 * - route: counts (E), order and pos (N k), stable (a choice c = n k + j
 *   ranks in c order within its expert); three launches; scratch:
 *   loom_cuda_moe_route_scratch_bytes(N, E, k, false) bytes. With a
 *   capacity (0 <= cap < N) seven, and _bytes(N, E, k, true): a choice's
 *   place among its expert's, then a second grouping of kept and dropped.
 * - permute: xg row p = x row order[p] / k (copied as bytes; none where
 *   order[p] < 0).
 * - combine: y row n = sum_j w[n k + j] yg row pos[n k + j]; permute_bwd: dx
 *   row n = sum_j dxg row pos[n k + j]: in slot order, fp32, the CPU's
 *   operations without fused multiply-adds; slots of pos -1 skipped.
 * - combine_bwd: dyg row p = w[c] dy row c / k and dw[c] (written) =
 *   dot(dy row c / k, yg row p) in fp32, c = order[p] (order -1 - c: dw[c]
 *   0, no row). */
#define LOOM_CUDA_MOE_MAX_E 2048
size_t loom_cuda_moe_router_scratch_bytes(int64_t N, int64_t E, bool psum);
loom_status loom_cuda_moe_router_fwd(loom_ctx *ctx, const void *z, loom_dtype dtype, int64_t N,
                                     int64_t E, int k, bool norm_topk, float *probs, int32_t *idx,
                                     float *w, float *psum, float *lse, void *scratch,
                                     size_t scratch_bytes, void *stream);
loom_status loom_cuda_moe_router_bwd(loom_ctx *ctx, const float *probs, const int32_t *idx,
                                     const float *dw, const float *ga, const float *lse,
                                     const float *zc, int64_t N, int64_t E, int k, bool norm_topk,
                                     void *dz, loom_dtype dtype, void *stream);
size_t loom_cuda_moe_route_scratch_bytes(int64_t N, int64_t E, int k, bool cap);
loom_status loom_cuda_moe_route(loom_ctx *ctx, const int32_t *idx, const float *w, int64_t N,
                                int64_t E, int k, int64_t cap, bool by_position, int32_t *counts,
                                int32_t *order, int32_t *pos, void *scratch, size_t scratch_bytes,
                                void *stream);
/* cpu_moe.h's once-per-rank dispatch tables (ops_moe_dedup.cu). */
loom_status loom_cuda_moe_dest(loom_ctx *ctx, const int32_t *idx, int64_t N, int k, int64_t El,
                               int P, int32_t *dest, void *stream);
loom_status loom_cuda_moe_dedup_meta(loom_ctx *ctx, const int32_t *ord, int64_t U,
                                     const int32_t *idx, const float *w, int k, int64_t El, int P,
                                     int32_t *tok, int32_t *mid, float *mw, void *stream);
loom_status loom_cuda_moe_mask(loom_ctx *ctx, const int32_t *key, int64_t N, int k, int32_t none,
                               int32_t *order, int32_t *pos, void *stream);
loom_status loom_cuda_moe_dedup_dw(loom_ctx *ctx, const float *dwb, const int32_t *pos, int64_t N,
                                   int P, int k, float *dw, void *stream);
/* cpu_moe.h's loom_cpu_moe_regroup: one block; S El <= LOOM_CUDA_MOE_REGROUP_MAX. */
#define LOOM_CUDA_MOE_REGROUP_MAX 3072
loom_status loom_cuda_moe_regroup(loom_ctx *ctx, const int32_t *rc, int64_t S, int64_t El,
                                  int64_t Rt, int32_t *ix, void *stream);
loom_status loom_cuda_moe_permute(loom_ctx *ctx, const void *x, const int32_t *order, int64_t N,
                                  int k, int64_t H, void *xg, loom_dtype dtype, void *stream);
loom_status loom_cuda_moe_combine(loom_ctx *ctx, const void *yg, const int32_t *pos, const float *w,
                                  int64_t N, int k, int64_t H, void *y, loom_dtype dtype,
                                  void *stream);
loom_status loom_cuda_moe_combine_bwd(loom_ctx *ctx, const void *dy, const void *yg,
                                      const int32_t *order, const float *w, int64_t N, int k,
                                      int64_t H, void *dyg, float *dw, loom_dtype dtype,
                                      void *stream);
loom_status loom_cuda_moe_permute_bwd(loom_ctx *ctx, const void *dxg, const int32_t *pos, int64_t N,
                                      int k, int64_t H, void *dx, loom_dtype dtype, void *stream);
/* The shared expert's gate (ops_moe_gate.cu; cpu_moe.h's semantics), one
 * warp a row: g (fp32) = sigmoid(z) as 1 / (1 + exp(-z)) with IEEE division
 * (z NULL: g given), y = g s (+ y when acc; s NULL: g only) without fused
 * multiply-adds; dz = (1 - g) dot(da, a), the dot in fp32. */
loom_status loom_cuda_moe_gate_fwd(loom_ctx *ctx, const void *z, const void *s, int64_t N,
                                   int64_t H, bool acc, float *g, void *y, loom_dtype dtype,
                                   void *stream);
loom_status loom_cuda_moe_gate_bwd(loom_ctx *ctx, const void *da, const void *a, const float *g,
                                   int64_t N, int64_t I, void *dz, loom_dtype dtype, void *stream);

/* ---- optimizer (ops_optim.cu): fp32 flat buffers ----
 * AdamW: loom_adamw_step's formula with the same fp32 operations in the same
 * order (no fused multiply-adds): the results are bit-identical to the CPU. */
loom_status loom_cuda_adamw_step(loom_ctx *ctx, float *p, const float *g, float *m, float *v,
                                 size_t n, const loom_adamw_hp *hp, int64_t t, bool decay,
                                 void *stream);
/* *result (device, one double) = sum of g[i]^2 in double. Deterministic: a
 * fixed grid-stride split over LOOM_CUDA_SUMSQ_BLOCKS blocks, block partials
 * into scratch (LOOM_CUDA_SUMSQ_BLOCKS doubles of device memory), then one
 * fixed-order tree. Equal to loom_sumsq up to double rounding. */
#define LOOM_CUDA_SUMSQ_BLOCKS 1024
loom_status loom_cuda_sumsq(loom_ctx *ctx, const float *g, size_t n, double *result,
                            double *scratch, void *stream);

/* The optimizer over many parameter blocks in one launch: a list of chunks
 * (device memory), each up to LOOM_CUDA_CHUNK elements of one block:
 * parameters at p + p_off, gradient and moments at g/m/v + s_off. AdamW
 * applies weight decay where decay is 1 to the gradient times gs[0] times
 * gs[1] (bit-identical to loom_adamw_step_scaled on each block); sumsq
 * writes out[c] = sum over chunk c of (g s)^2 (double, a fixed order; decay
 * is ignored). The gradients are only read. */
#define LOOM_CUDA_CHUNK 16384
typedef struct loom_cuda_chunk {
    int64_t p_off, s_off;
    int32_t len;
    int32_t decay;
} loom_cuda_chunk;
/* wc: when not NULL, every updated parameter p[i] is also stored to wc[i] in
 * wc_dtype (the compute copy, rounded as loom_cuda_convert) in the same pass. */
loom_status loom_cuda_adamw_chunks(loom_ctx *ctx, float *p, const float *g, float *m, float *v,
                                   const loom_cuda_chunk *chunks, int64_t nchunks,
                                   const loom_adamw_hp *hp, int64_t t, const float gs[2],
                                   void *wc, loom_dtype wc_dtype, void *stream);
loom_status loom_cuda_sumsq_chunks(loom_ctx *ctx, const float *g, const loom_cuda_chunk *chunks,
                                   int64_t nchunks, float s, double *out, void *stream);
/* g[s_off .. s_off + len) = 0 for every chunk: one launch for many small
 * ranges (the gradients cleared at zero_grad). */
loom_status loom_cuda_zero_chunks(loom_ctx *ctx, float *g, const loom_cuda_chunk *chunks,
                                  int64_t nchunks, void *stream);

#ifdef __cplusplus
}
#endif
#endif
