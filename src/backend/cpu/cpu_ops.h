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

/* ---- Transformer ops (ops.c, attention.c), fp32, row-major ----
 * T is the number of tokens of a micro-batch, all sequences flattened.
 * Backward functions overwrite their input gradients (dx, dq, ...) and
 * accumulate (+=) into parameter gradients (dW, dw, db), unless stated; a
 * NULL dw or db means the parameter is frozen and gets no gradient. */

/* Embedding. ids: (T) in [0, rows of W), already validated; W: (V, H);
 * out: (T, H). bwd: dW[ids[t], :] += dout[t, :], deterministic order. */
void loom_cpu_embedding_fwd(const int32_t *ids, int64_t T, const float *W, int64_t H, float *out);
void loom_cpu_embedding_bwd(const int32_t *ids, int64_t T, const float *dout, int64_t H,
                            float *dW);

/* RMSNorm over N rows of width H: y = x * rsqrt(mean(x^2) + eps) * (woff + w)
 * (the mean in double, y rounded as HF does: (woff + w) * (x * rstd) in
 * fp32; woff 0, or 1 for zero-centred weights, Qwen3.5's, whose 1 + w HF
 * forms in fp32). x, y: (N, H); w: (H); rstd: (N), saved for the
 * backward. With rows of head_dim over T*heads rows this is Qwen3's
 * per-head q/k norm. bwd: dx (N, H) overwritten (may alias dy), dw (H)
 * accumulated (d/dw: the offset does not change it). */
void loom_cpu_rmsnorm_fwd(const float *x, const float *w, float woff, int64_t N, int64_t H,
                          float eps, float *y, float *rstd);
void loom_cpu_rmsnorm_bwd(const float *dy, const float *x, const float *w, float woff,
                          const float *rstd, int64_t N, int64_t H, float *dx, float *dw);

/* RoPE inverse frequencies inv_freq[D/2] as HF computes them (fp32).
 * rope_type 0: default, inv_freq[i] = 1 / theta^((float)(2i)/D);
 * 1: linear, default / factor; 2: llama3 (factor, low_freq_factor,
 * high_freq_factor, original_max_pos = original_max_position_embeddings).
 * The other arguments are ignored for the types that do not use them. */
void loom_rope_inv_freq(int rope_type, double theta, int64_t D, double factor,
                        double low_freq_factor, double high_freq_factor, int64_t original_max_pos,
                        float *inv_freq);
/* RoPE, HF rotate_half convention, in place. x: (T, nh, D), D even;
 * pos: (T) position ids (restart per packed document); inv_freq: (D/2).
 * angle = fp32(pos * inv_freq[i]) (fp32 product, as HF), cos/sin of that
 * float angle computed in double and rounded to fp32. Only the first rd
 * dimensions of each head turn (rd = D but for a partial rotary factor,
 * Qwen3.5's; inv_freq then has rd/2 entries): for i < rd/2,
 * x[i] = x1*cos - x2*sin, x[i+rd/2] = x2*cos + x1*sin (x1 = x[i], x2 = x[i+rd/2]);
 * the rest pass. bwd applies the inverse rotation to the gradient dx in place. */
void loom_cpu_rope_fwd(float *x, int64_t T, int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                       const float *inv_freq);
void loom_cpu_rope_bwd(float *dx, int64_t T, int64_t nh, int64_t D, int64_t rd,
                       const int32_t *pos, const float *inv_freq);

/* Causal grouped-query attention with document masking.
 * q: (T, Hq, D); k, v: (T, Hkv, D), Hq a multiple of Hkv, query head h uses
 * kv head h / (Hq/Hkv); cu_seqlens: (ndocs+1), 0 = c0 < c1 < ... = T. Token i
 * attends to j iff both lie in the same document and j <= i. scores are
 * scale * q.k; out: (T, Hq, D); lse: (T, Hq), natural log-sum-exp of the
 * scaled scores. Dot products and softmax sums in double; D <= 1024.
 * bwd: dq (T, Hq, D), dk, dv (T, Hkv, D), all overwritten. */
#define LOOM_CPU_ATTN_MAX_D 1024
void loom_cpu_attention_fwd(const float *q, const float *k, const float *v, int64_t T,
                            int64_t Hq, int64_t Hkv, int64_t D, const int32_t *cu_seqlens,
                            int64_t ndocs, float scale, float *out, float *lse);
void loom_cpu_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                            const float *out, const float *lse, int64_t T, int64_t Hq,
                            int64_t Hkv, int64_t D, const int32_t *cu_seqlens, int64_t ndocs,
                            float scale, float *dq, float *dk, float *dv);

/* The same for Tq local queries of a longer sequence (context parallel):
 * query t is token qidx[t] (ascending) of the T tokens that k, v and
 * cu_seqlens describe; qidx NULL means qidx[t] = t and Tq = T. dk and dv
 * (T, Hkv, D) receive the contributions of these queries only. */
void loom_cpu_attention_fwd_q(const float *q, const int32_t *qidx, int64_t Tq, const float *k,
                              const float *v, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                              const int32_t *cu_seqlens, int64_t ndocs, float scale, float *out,
                              float *lse);
void loom_cpu_attention_bwd_q(const float *dout, const float *q, const int32_t *qidx, int64_t Tq,
                              const float *k, const float *v, const float *out, const float *lse,
                              int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                              const int32_t *cu_seqlens, int64_t ndocs, float scale, float *dq,
                              float *dk, float *dv);

/* SwiGLU: h = silu(g) * u over n elements, silu(x) = x * sigmoid(x).
 * bwd: dg, du overwritten (dg may alias g or dh; du may alias u or dh). */
/* Gated attention's output gate: y = o * sigmoid(g) over n (fp32).
 * bwd: do_ = dy sigmoid(g), dg = dy o sigmoid(g) (1 - sigmoid(g)); do_ may
 * alias dy, dg may alias g. */
void loom_cpu_gate_fwd(const float *o, const float *g, int64_t n, float *y);
void loom_cpu_gate_bwd(const float *dy, const float *o, const float *g, int64_t n, float *do_,
                       float *dg);
void loom_cpu_swiglu_fwd(const float *g, const float *u, int64_t n, float *h);
void loom_cpu_swiglu_bwd(const float *dh, const float *g, const float *u, int64_t n, float *dg,
                         float *du);

/* y += x over n elements (residual add; its backward is the identity). */
void loom_cpu_residual_add(float *y, const float *x, int64_t n);

/* Bias (Qwen2 q/k/v): y: (T, N), b: (N); fwd y[t, :] += b;
 * bwd db[:] += sum_t dy[t, :] (summed in double). */
void loom_cpu_add_bias_fwd(float *y, const float *b, int64_t T, int64_t N);
void loom_cpu_add_bias_bwd(const float *dy, int64_t T, int64_t N, float *db);

/* Cross-entropy over the first V of Vp columns (V..Vp-1 are vocabulary
 * padding and never receive probability). logits: (T, Vp); targets: (T),
 * in [0, V) or -100 (ignored). Returns the sum over valid tokens of
 * -log p(target) (summed in token order, double). Writes for every token:
 * token_logprob[t] = log p(target) (0 when ignored), entropy[t] =
 * -sum_c<V p log p, lse[t] = log sum_c<V exp(logit). Each of the three output
 * pointers may be NULL (the backward needs lse).
 * bwd: dlogits[t, c] = scale * (p(c) - [c == target]) for valid tokens and
 * c < V; 0 for padding columns and ignored tokens. dlogits may alias logits. */
double loom_cpu_cross_entropy_fwd(const float *logits, const int32_t *targets, int64_t T,
                                  int64_t V, int64_t Vp, float *token_logprob, float *entropy,
                                  float *lse);
void loom_cpu_cross_entropy_bwd(const float *logits, const float *lse, const int32_t *targets,
                                int64_t T, int64_t V, int64_t Vp, float scale, float *dlogits);

#endif
