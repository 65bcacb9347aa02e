/* The model's ops on its device. forward.c, lora.c and the trainer call
 * these instead of a backend directly: each runs the CPU reference op
 * (src/backend/cpu) or the CUDA op (src/backend/cuda) with the same
 * semantics, so one code path drives both.
 *
 * Buffers. Activations (`void *` here) are in the model's compute dtype
 * m->dev.adt (F32 on CPU; BF16, F16 or F32 on a GPU), and so are the
 * weights' compute copies (loom_wc). Statistics (rstd, lse), parameter
 * gradients and optimizer state are fp32; loss partial sums are doubles.
 * On a GPU every pointer passed here is device memory (token ids,
 * positions, cu_seqlens and permutations too), and the kernels are queued
 * on m->dev.stream (the legacy default stream: ordered with cudaMemcpy and
 * with the NCCL groups' blocking streams).
 *
 * Every function returns a loom_status (CPU ops cannot fail). */
#ifndef LOOM_MODEL_KERN_H
#define LOOM_MODEL_KERN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../backend/adamw.h"
#include "../backend/backend.h"
#include "loom.h"

/* Return the status of a call that failed (the model code's error flow). */
#define CK(expr)                                                                          \
    do {                                                                                  \
        loom_status st_ = (expr);                                                         \
        if (st_) return st_;                                                              \
    } while (0)

typedef struct loom_model loom_model;
typedef struct loom_micro loom_micro;
struct loom_arena;

/* Sets up the device side of `m` (m->dev.cuda and adt already set): on a
 * GPU, the cuBLASLt handle and the small scratch buffers. */
loom_status loom_dev_init(loom_model *m);
void loom_dev_release(loom_model *m);

/* Which kernels ran the GPU attention: "cuDNN N/N forward, M/M backward",
 * with why cuDNN was not used where it was not. */
void loom_dev_attn_note(const loom_model *m, char *buf, size_t n);

/* Memory of the model's device: zeroed on allocation; `what` names it in
 * the out-of-memory message. */
loom_status loom_dev_alloc(loom_model *m, void **p, size_t bytes, const char *what);
void loom_dev_free(loom_model *m, void *p);
/* Host memory for copies to and from the device: page-locked on a GPU
 * (*pinned set; pageable when the system will not lock it), else malloc's.
 * loom_k_host_free takes the flag; it needs no model (any thread). */
loom_status loom_k_host_alloc(loom_model *m, void **p, size_t bytes, bool *pinned,
                              const char *what);
void loom_k_host_free(void *p, bool pinned);
/* Copies in stream order; src and dst may be host or device memory (on CPU
 * both are host). dst == src is a no-op. */
loom_status loom_k_copy(loom_model *m, void *dst, const void *src, size_t bytes);
loom_status loom_k_zero(loom_model *m, void *p, size_t bytes);
/* Waits (with the groups' deadline) for collectives the MoE dispatch left
 * queued (loom_comm_defer); download and upload call it first, as they
 * wait on the GPU without a deadline. */
loom_status loom_k_settle(loom_model *m);
/* Copies between host and the device, returning when the data is there. */
loom_status loom_k_download(loom_model *m, void *host, const void *dev, size_t bytes);
loom_status loom_k_upload(loom_model *m, void *dev, const void *host, size_t bytes);
/* host (n floats) = the n compute-dtype elements at dev, widened to fp32
 * (in place on the host, from the back). */
loom_status loom_k_download_f32(loom_model *m, float *host, const void *dev, size_t n);
/* dst[i] = src[i] between F32/BF16/F16 device buffers (n elements). */
loom_status loom_k_convert(loom_model *m, void *dst, loom_dtype d, const void *src, loom_dtype s,
                           size_t n);

/* ---- linear layers: x, y, dy, dx and W in adt, dW fp32 (accumulated) ---- */
/* y (T, out) = x (T, in) W^T + beta y */
loom_status loom_k_lin_fwd(loom_model *m, const void *x, int64_t T, int64_t in, const void *W,
                           int64_t out, float alpha, float beta, void *y);
/* dx (T, in) = alpha dy (T, out) W + beta dx */
loom_status loom_k_lin_dx(loom_model *m, const void *dy, int64_t T, int64_t out, const void *W,
                          int64_t in, float alpha, float beta, void *dx);
/* dx (T, in) = sum of the n terms' dy W + beta dx: the projections that
 * share an input, with LoRA's du A among them. Where the device has the
 * kernel (Hopper, BF16: loom_cuda_gemm_dx), its tiles fill the GPU's waves
 * (loom_cuda_gemm_wave_fill at least 0.9: Qwen3-4B's 2560 columns are 0.81,
 * and cuBLASLt's sequence runs them faster), LOOM_LORA_KERNELS is not cublas
 * and beta is 0, the first four terms are one GEMM with one fp32
 * accumulator; otherwise, and for any further terms, one GEMM a term
 * accumulating in dx. */
loom_status loom_k_lin_dx_sum(loom_model *m, int64_t T, int64_t in, int n, const loom_dx_term *t,
                              float beta, void *dx);
/* dW (out, in) += alpha dy^T x; nothing when dW is NULL (frozen) */
loom_status loom_k_lin_dw(loom_model *m, const void *dy, const void *x, int64_t T, int64_t out,
                          int64_t in, float alpha, float *dW);
/* C = alpha op(A) op(B) + beta C, row-major with leading dimensions (strided
 * blocks: LoRA's grouped projections); A, B in the compute dtype, C too or
 * fp32 (accumulated gradients) with c_f32. */
loom_status loom_k_gemm_ld(loom_model *m, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                           float alpha, const void *A, int64_t lda, const void *B, int64_t ldb,
                           float beta, void *C, bool c_f32, int64_t ldc);
/* fp32 C = alpha A B + beta C (row-major, all fp32; merges of adapters) */
loom_status loom_k_sgemm(loom_model *m, int64_t M, int64_t N, int64_t K, float alpha,
                         const float *A, const float *B, float beta, float *C);

/* the same with A, B and C in the compute dtype (merges into a compute copy) */
loom_status loom_k_gemm_c(loom_model *m, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                          const void *B, float beta, void *C);

/* A projection with LoRA's term, y (T, out) = x W^T + s u B^T (u (T, r; ldu),
 * B (out, r)), as one GEMM where the device has a kernel for it (Hopper,
 * BF16: loom_cuda_gemm_lora) and LOOM_LORA_KERNELS is not cublas; *done
 * false (nothing written) where it has not: the caller runs the pair. */
loom_status loom_k_lin_lora_fwd(loom_model *m, const void *x, int64_t T, int64_t in, const void *W,
                                int64_t out, const void *u, int64_t ldu, const void *B, int64_t r,
                                float s, void *y, bool *done);

/* LoRA's backward over one projection's output gradient dy (T, out):
 * du (T, r; lddu) = s dy B and dB (out, r; fp32) += s dy^T u, u (T, r; ldu),
 * B (out, r). The two GEMMs of loom_k_gemm_ld; on a GPU one read of dy in
 * loom's kernel (BF16/F16, r a multiple of 8 up to 32, 16-byte rows) unless
 * LOOM_LORA_KERNELS=cublas. */
loom_status loom_k_lora_dy(loom_model *m, int64_t T, int64_t out, int64_t r, float s, const void *dy,
                           const void *B, const void *u, int64_t ldu, void *du, int64_t lddu,
                           float *dB);
/* The same for up to 3 projections of a group (q, k, v or gate, up), all of
 * T rows, rank r and scale s, u and du with the strides ldu and lddu: on a
 * GPU one launch over all their dy (the same bits as one at a time). */
loom_status loom_k_lora_dy_n(loom_model *m, int64_t T, int64_t r, float s, int n,
                             const loom_lora_dy_op *ops, int64_t ldu, int64_t lddu);

/* ---- the transformer ops (cpu_ops.h has their exact semantics) ---- */
loom_status loom_k_rmsnorm_fwd(loom_model *m, const void *x, const void *w, int64_t N, int64_t H,
                               float eps, void *y, float *rstd);
loom_status loom_k_rmsnorm_bwd(loom_model *m, const void *dy, const void *x, const void *w,
                               const float *rstd, int64_t N, int64_t H, void *dx, float *dw);
loom_status loom_k_rope(loom_model *m, bool backward, void *x, int64_t T, int64_t nh,
                        const int32_t *pos);
/* Two ops in one pass where the GPU can (its fused kernels give the values
 * of the ops apart), the ops one after the other elsewhere:
 * - add_rmsnorm_fwd: xsum = x + res (may alias x), then rmsnorm_fwd(xsum);
 * - rmsnorm_bwd_add: dx += rmsnorm_bwd(dy); dy is left undefined;
 * - qknorm_rope_fwd: y = rope(rmsnorm(x)) per head of Qwen3's q or k,
 *   x (Tc, nh, D); _bwd: dy -> dx in place, dw accumulated.
 * rope_table: the micro-batch's (cos, sin) table for the fused RoPE (GPU). */
loom_status loom_k_add_rmsnorm_fwd(loom_model *m, void *x, const void *res, void *xsum,
                                   const void *w, int64_t N, int64_t H, float eps, void *y,
                                   float *rstd);
loom_status loom_k_rmsnorm_bwd_add(loom_model *m, void *dy, const void *x, const void *w,
                                   const float *rstd, int64_t N, int64_t H, void *dx, float *dw);
loom_status loom_k_qknorm_rope_fwd(loom_model *m, const loom_micro *mb, const void *x,
                                   const void *w, int64_t nh, float eps, void *y, float *rstd);
loom_status loom_k_qknorm_rope_bwd(loom_model *m, const loom_micro *mb, void *dy, const void *x,
                                   const void *w, const float *rstd, int64_t nh, float *dw);
loom_status loom_k_rope_table(loom_model *m, loom_micro *mb);
/* seqlen: the length of every document when all are equally long, else 0.
 * With every query, a GPU tries cuDNN's fused attention first. */
loom_status loom_k_attn_fwd(loom_model *m, const void *q, const int32_t *qidx, int64_t Tq,
                            const void *k, const void *v, int64_t T, int64_t Hq, int64_t Hkv,
                            const int32_t *cu, int64_t ndocs, int64_t seqlen, void *out, float *lse);
loom_status loom_k_attn_bwd(loom_model *m, const void *dout, const void *q, const int32_t *qidx,
                            int64_t Tq, const void *k, const void *v, const void *out,
                            const float *lse, int64_t T, int64_t Hq, int64_t Hkv,
                            const int32_t *cu, int64_t ndocs, int64_t seqlen, void *dq, void *dk,
                            void *dv);
/* Qwen3.5's gated attention: y = o * sigmoid(g) over n, its backward (dout
 * may alias dy, dg g); rows of width bytes between strided buffers (the
 * q_proj output split into each head's query and gate, and back) */
loom_status loom_k_gate_fwd(loom_model *m, const void *o, const void *g, int64_t n, void *y);
loom_status loom_k_gate_bwd(loom_model *m, const void *dy, const void *o, const void *g,
                            int64_t n, void *dout, void *dg);
loom_status loom_k_copy2d(loom_model *m, void *dst, size_t ldd, const void *src, size_t lds,
                          size_t width, size_t rows);
loom_status loom_k_swiglu_fwd(loom_model *m, const void *g, const void *u, int64_t n, void *h);
loom_status loom_k_swiglu_bwd(loom_model *m, const void *dh, const void *g, const void *u,
                              int64_t n, void *dg, void *du);
loom_status loom_k_add(loom_model *m, void *y, const void *x, int64_t n); /* y += x */
loom_status loom_k_bias_fwd(loom_model *m, void *y, const void *b, int64_t T, int64_t N);
loom_status loom_k_bias_bwd(loom_model *m, const void *dy, int64_t T, int64_t N, float *db);

/* ---- vocabulary-parallel embedding and loss (cpu_glue.h) ---- */
loom_status loom_k_embed_fwd(loom_model *m, const int32_t *ids, int64_t T, const void *W,
                             int64_t row0, int64_t rows, void *out);
loom_status loom_k_embed_bwd(loom_model *m, const int32_t *ids, int64_t T, const void *dout,
                             int64_t row0, int64_t rows, float *dW);
loom_status loom_k_ce_max(loom_model *m, const void *z, int64_t c, int64_t ld, int64_t nvalid,
                          double *mx);
loom_status loom_k_ce_sums(loom_model *m, const void *z, int64_t c, int64_t ld, int64_t nvalid,
                           const int32_t *tgt, int64_t v0, const double *mx, double *ce);
loom_status loom_k_ce_grad(loom_model *m, void *z, int64_t c, int64_t ld, int64_t nvalid,
                           const int32_t *tgt, int64_t v0, const double *mx, const double *ce,
                           float scale);
/* z (c rows of ld) row r times w[r] (fp32 weights where the ops read them) */
loom_status loom_k_rows_scale(loom_model *m, void *z, int64_t c, int64_t ld, const float *w);
/* max, sums and (with grad) the gradient in place, when the row is all the
 * vocabulary (tensor-parallel size 1): on a GPU one pass (ce_vp_fused) */
loom_status loom_k_ce_fused(loom_model *m, void *z, int64_t c, int64_t ld, int64_t nvalid,
                            const int32_t *tgt, int64_t v0, double *mx, double *ce, float scale,
                            bool grad);

/* ---- context parallel: rows of `w` activations permuted ---- */
/* dst row j = src row idx[j] */
loom_status loom_k_rows_gather(loom_model *m, void *dst, const void *src, const int32_t *idx,
                               int64_t n, int64_t w);
/* dst row idx[j] = src row j */
loom_status loom_k_rows_scatter(loom_model *m, void *dst, const void *src, const int32_t *idx,
                                int64_t n, int64_t w);

/* x (n, adt) = near-normal values of stream base (loom_rng_gauss4_at) */
loom_status loom_k_fill_randn(loom_model *m, void *x, int64_t n, uint64_t base);

/* LoRA dropout (lora.c's mask rule; x NULL: in place on out) */
loom_status loom_k_dropout(loom_model *m, void *out, const void *x, int64_t T, int64_t in,
                           int64_t full, int64_t col0, const int32_t *qidx, int64_t out0,
                           uint64_t seed, uint64_t key, double p);

/* ---- optimizer, fp32 ---- */
/* AdamW over every part on the gradients times gs[0] times gs[1], and the
 * sum of (g s)^2 over the parts that count in the norm (*sum, host), in a
 * few launches on a GPU: the parts are cut in chunks once per arena (the
 * layout never changes) and kept on the device (A->lists). The gradients are only
 * read: unscaling and clipping happen inside these passes. */
/* wc_too: the caller will not gather other ranks' parameters (dp x cp = 1),
 * so a GPU may write the compute copy in the same pass (*wc_done then set;
 * otherwise loom_arena_sync is still to run). */
loom_status loom_k_adamw_parts(loom_model *m, struct loom_arena *A, const loom_k_part *parts,
                               int n, const loom_adamw_hp *hp, int64_t t, const float gs[2],
                               bool wc_too, bool *wc_done);
loom_status loom_k_sumsq_parts(loom_model *m, struct loom_arena *A, const loom_k_part *parts,
                               int n, float s, double *sum);
/* Adds the norms' weight gradients that the backward ops left pending (a
 * GPU's dw batch); the end of every chunk's backward. */
loom_status loom_k_dw_flush(loom_model *m);
/* Forgets them (zero_grad: a backward that failed before its flush). */
void loom_k_dw_drop(loom_model *m);
/* Clears the gradients of the slots whose zeroing is not deferred (those
 * with A->gdefer[i] 0): on a GPU one launch over a chunk list built at the
 * first call (kept in A->zlists). */
loom_status loom_k_zero_eager(loom_model *m, struct loom_arena *A);
/* Releases what the backend keeps of the arena's parts: the optimizer's
 * (A->lists), or with zero_list zero_eager's (A->zparts, A->zlists). */
void loom_k_lists_free(loom_model *m, struct loom_arena *A, bool zero_list);

/* ---- mixture of experts (backend.h's moe_* ops; block_moe.c) ---- */
/* the once-per-rank dispatch's tables (cpu_moe.h) */
loom_status loom_k_moe_dest(loom_model *m, const int32_t *idx, int64_t N, int k, int64_t El, int P,
                            int32_t *dest);
loom_status loom_k_moe_dedup_meta(loom_model *m, const int32_t *ord, int64_t U, const int32_t *idx,
                                  const float *w, int k, int64_t El, int P, int32_t *tok,
                                  int32_t *mid, float *mw);
loom_status loom_k_moe_mask(loom_model *m, const int32_t *key, int64_t N, int k, int32_t none,
                            int32_t *order, int32_t *pos);
loom_status loom_k_moe_dedup_dw(loom_model *m, const float *dwb, const int32_t *pos, int64_t N,
                                int P, int k, float *dw);
/* ix (2 Rt) on the device from the table rc (S, El; cpu_moe.h) */
loom_status loom_k_moe_regroup(loom_model *m, const int32_t *rc, int64_t S, int64_t El,
                               int64_t Rt, int32_t *ix);
loom_status loom_k_moe_router_fwd(loom_model *m, const void *z, int64_t N, int64_t E, int k,
                                  bool norm_topk, float *probs, int32_t *idx, float *w, float *psum,
                                  float *lse);
loom_status loom_k_moe_router_bwd(loom_model *m, const float *probs, const int32_t *idx,
                                  const float *dw, const float *ga, const float *lse,
                                  const float *zc, int64_t N, int64_t E, int k, bool norm_topk,
                                  void *dz);
loom_status loom_k_moe_route(loom_model *m, const int32_t *idx, const float *w, int64_t N,
                             int64_t E, int k, int64_t cap, bool by_position, int32_t *counts,
                             int32_t *order, int32_t *pos);
loom_status loom_k_moe_permute(loom_model *m, const void *x, const int32_t *order, int64_t N,
                               int k, int64_t H, void *xg);
loom_status loom_k_moe_combine(loom_model *m, const void *yg, const int32_t *pos, const float *w,
                               int64_t N, int k, int64_t H, void *y);
loom_status loom_k_moe_combine_bwd(loom_model *m, const void *dy, const void *yg,
                                   const int32_t *order, const float *w, int64_t N, int k,
                                   int64_t H, void *dyg, float *dw);
loom_status loom_k_moe_permute_bwd(loom_model *m, const void *dxg, const int32_t *pos, int64_t N,
                                   int k, int64_t H, void *dx);
/* The shared expert's gate (backend.h's moe_gate_*): g (N, fp32) = sigmoid(z)
 * (z NULL: g given), y (N, H) = g s (+ y when acc; s NULL: g only); dz (N) =
 * (1 - g) rowdot(da, a) over a's I columns */
loom_status loom_k_moe_gate_fwd(loom_model *m, const void *z, const void *s, int64_t N, int64_t H,
                                bool acc, float *g, void *y);
loom_status loom_k_moe_gate_bwd(loom_model *m, const void *da, const void *a, const float *g,
                                int64_t N, int64_t I, void *dz);
/* G GEMMs of the compute dtype (backend.h's gemm_grouped); c_f32: C fp32
 * (accumulated weight gradients) */
loom_status loom_k_gemm_grouped(loom_model *m, bool ta, bool tb, int G, const loom_gemm_group *g,
                                float alpha, int64_t lda, int64_t ldb, float beta, bool c_f32,
                                int64_t ldc);

/* ---- Gated DeltaNet, Qwen3.5's linear attention (backend.h's gdn_*,
 * cpu_gdn.h's semantics): T tokens in documents cu (ndocs + 1) (the
 * micro-batch's d_cu), activations and weights in adt, g and beta fp32 (T,
 * H), weight gradients fp32 added to (NULL: frozen). Each fails with
 * LOOM_ERR_UNSUPPORTED on a backend without these kernels (CUDA for now).
 * conv: y (T, C) = silu(causal depthwise conv of x by w (C, K)), the
 *   convolution restarting at each document; bwd dx (T, C), dw (C, K).
 * gate: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (a, b:
 *   (T, H)); bwd da, db, dA_log, ddt_bias (H).
 * rule: o (T, Hv, dv) from qkv (T, 2 Hk dk + Hv dv: the convolution's q, k,
 *   v, q and k L2-normalised inside), the state restarting at each
 *   document; bwd dqkv (qkv's layout), dg, dbeta (T, Hv), from the inputs
 *   and, where the backend keeps (gdn_ws.h), the forward's keep buffer of
 *   loom_gdn_keep_bytes for keep_chunks chunks (NULL: none); a batch whose
 *   documents can make more chunks goes without (recomputed).
 * norm: y = w rmsnorm(x) silu(z) over N rows of D, rstd (N) for the
 *   backward: dx, dz (N, D), dw (D). */
loom_status loom_k_gdn_conv_fwd(loom_model *m, const void *x, const void *w, int64_t T, int64_t C,
                                int64_t K, const int32_t *cu, int64_t ndocs, void *y);
loom_status loom_k_gdn_conv_bwd(loom_model *m, const void *dy, const void *x, const void *w,
                                int64_t T, int64_t C, int64_t K, const int32_t *cu, int64_t ndocs,
                                void *dx, float *dw);
loom_status loom_k_gdn_gate_fwd(loom_model *m, const void *a, const void *b, const void *A_log,
                                const void *dt_bias, int64_t T, int64_t H, float *g, float *beta);
loom_status loom_k_gdn_gate_bwd(loom_model *m, const float *dg, const float *dbeta, const void *a,
                                const void *b, const void *A_log, const void *dt_bias, int64_t T,
                                int64_t H, void *da, void *db, float *dA_log, float *ddt_bias);
loom_status loom_k_gdn_fwd(loom_model *m, const void *qkv, const float *g, const float *beta,
                           int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                           const int32_t *cu, int64_t ndocs, void *o, void *keep,
                           int64_t keep_chunks);
loom_status loom_k_gdn_bwd(loom_model *m, const void *dout, const void *qkv, const float *g,
                           const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                           int64_t dv, const int32_t *cu, int64_t ndocs, void *dqkv, float *dg,
                           float *dbeta, const void *keep, int64_t keep_chunks);
loom_status loom_k_gdn_norm_fwd(loom_model *m, const void *x, const void *z, const void *w,
                                int64_t N, int64_t D, float eps, void *y, float *rstd);
loom_status loom_k_gdn_norm_bwd(loom_model *m, const void *dy, const void *x, const void *z,
                                const void *w, const float *rstd, int64_t N, int64_t D, void *dx,
                                void *dz, float *dw);

#endif /* LOOM_MODEL_KERN_H */
