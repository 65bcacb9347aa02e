/* CPU reference ops of Gated DeltaNet, the linear attention of three of
 * every four Qwen3.5 layers (transformers' Qwen3_5GatedDeltaNet): the
 * causal depthwise convolution over q, k, v, the decay and the write
 * strength from the projections, the gated delta rule (chunks of 64) and
 * the gated RMSNorm of its output. fp32 tensors, row-major; sums and the
 * recurrence in double. The CUDA backend has no kernels for these yet.
 *
 * Documents: the T tokens are packed documents cu (ndocs + 1), 0 = cu[0] <
 * ... < cu[ndocs] = T, as attention's cu_seqlens (the batch's positions
 * restart at 0 at each cu[i]). The convolution sees zeros before a
 * document's first token and the recurrent state starts at zero in each
 * document.
 *
 * Backward functions overwrite the activations' gradients and add (+=) to
 * the parameters' (a NULL parameter gradient: frozen, none computed). None
 * of them needs anything saved by its forward beyond its inputs (and
 * norm's rstd): the convolution's pre-activation and the recurrence's
 * states are recomputed. Each returns LOOM_ERR_OOM (ctx) when its scratch
 * cannot be had. */
#ifndef LOOM_CPU_GDN_H
#define LOOM_CPU_GDN_H

#include <stdint.h>

#include "loom.h"

/* The chunk length of the gated delta rule (transformers' and fla's). */
#define LOOM_GDN_CHUNK 64

/* y (T, C) = silu(conv(x)) channel by channel: y[t, c] = silu(sum_j<K
 * w[c, j] x[t - K + 1 + j, c]), x = 0 before the document of t starts
 * (torch's Conv1d(C, C, K, groups=C, padding=K-1, bias=False), its first T
 * outputs; w is its weight (C, 1, K) as (C, K)). bwd: dx (T, C), dw (C, K)
 * added to. */
loom_status loom_cpu_gdn_conv_fwd(loom_ctx *ctx, const float *x, const float *w, int64_t T,
                                  int64_t C, int64_t K, const int32_t *cu, int64_t ndocs, float *y);
loom_status loom_cpu_gdn_conv_bwd(loom_ctx *ctx, const float *dy, const float *x, const float *w,
                                  int64_t T, int64_t C, int64_t K, const int32_t *cu, int64_t ndocs,
                                  float *dx, float *dw);

/* Per token t and value head h: g[t, h] = -exp(A_log[h]) softplus(a[t, h]
 * + dt_bias[h]) (torch's softplus: x above 20 is its own value), beta[t,
 * h] = sigmoid(b[t, h]). a, b, g, beta: (T, H). bwd from dg, dbeta: da, db
 * (T, H), dA_log and ddt_bias (H) added to. */
loom_status loom_cpu_gdn_gate_fwd(loom_ctx *ctx, const float *a, const float *b, const float *A_log,
                                  const float *dt_bias, int64_t T, int64_t H, float *g,
                                  float *beta);
loom_status loom_cpu_gdn_gate_bwd(loom_ctx *ctx, const float *dg, const float *dbeta,
                                  const float *a, const float *b, const float *A_log,
                                  const float *dt_bias, int64_t T, int64_t H, float *da, float *db,
                                  float *dA_log, float *ddt_bias);

/* The gated delta rule with q and k L2-normalised inside (transformers'
 * use_qk_l2norm_in_kernel): qkv (T, 2 Hk dk + Hv dv) is the convolution's
 * output in transformers' channel order, q (Hk, dk), then k (Hk, dk), then v
 * (Hv, dv), per token. Value head h reads key head h / (Hv / Hk). Per head,
 * with q_t <- q_t / sqrt(|q_t|^2 + 1e-6) / sqrt(dk), k_t <- k_t /
 * sqrt(|k_t|^2 + 1e-6) and the state S (dk, dv) zero at each document's
 * start:
 *   S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
 * g, beta: (T, Hv) fp32; o: (T, Hv, dv). Computed by chunks of
 * LOOM_GDN_CHUNK tokens from each document's start (the UT transform within
 * a chunk, the state carried from chunk to chunk), in double.
 * bwd from dout (T, Hv, dv): dqkv (qkv's layout: the gradients of the
 * unnormalised q, k and of v), dg and dbeta (T, Hv). Nothing is saved
 * between the two: the backward recomputes the normalised q, k and each
 * chunk's starting state. Scratch, a (document, key head) a thread at a
 * time, in doubles, for a document of n tokens: forward 2 n dk + dk dv + 4
 * 64^2 + 64 (dk + 2 dv); backward that plus (ceil(n / 64) + 2) dk dv (the
 * states) + 2 n dk + 64 (dk + 2 dv). */
loom_status loom_cpu_gdn_fwd(loom_ctx *ctx, const float *qkv, const float *g, const float *beta,
                             int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                             const int32_t *cu, int64_t ndocs, float *o);
loom_status loom_cpu_gdn_bwd(loom_ctx *ctx, const float *dout, const float *qkv, const float *g,
                             const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                             int64_t dv, const int32_t *cu, int64_t ndocs, float *dqkv, float *dg,
                             float *dbeta);

/* The gated RMSNorm over N rows of D (transformers' Qwen3_5RMSNormGated, a
 * row per token and value head): y = w * (x * rstd) * silu(z), rstd = (mean(x^2)
 * + eps)^-1/2 (the mean in double; x * rstd rounded to fp32 first, as
 * transformers). x, z, y: (N, D); w: (D); rstd (N) saved for the backward.
 * bwd: dx, dz (N, D) (not aliasing dy), dw (D) added to. */
loom_status loom_cpu_gdn_norm_fwd(loom_ctx *ctx, const float *x, const float *z, const float *w,
                                  int64_t N, int64_t D, float eps, float *y, float *rstd);
loom_status loom_cpu_gdn_norm_bwd(loom_ctx *ctx, const float *dy, const float *x, const float *z,
                                  const float *w, const float *rstd, int64_t N, int64_t D,
                                  float *dx, float *dz, float *dw);

#endif
