/* CPU reference ops of a mixture-of-experts block (issue 37; moe.c): the
 * router, the load-balancing loss, and the permutation of tokens into
 * per-expert groups and back. fp32, row-major; the CUDA versions will have
 * the same semantics and these as their oracle.
 *
 * Router (Qwen2/3-MoE, as transformers computes it): p = softmax(z) over the
 * E experts in fp32, the k largest (ties to the lower expert index) in
 * descending order, their weights p renormalised to sum 1 when norm_topk.
 * The load-balancing loss (transformers' load_balancing_loss_func, over the
 * N rows given: all layers' tokens concatenated): aux = E * sum_e f_e P_e,
 * f_e the fraction of the N*k choices that picked e over N (each of the k
 * slots counted: sum_e f_e = k), P_e the mean of p[., e]. */
#ifndef LOOM_CPU_MOE_H
#define LOOM_CPU_MOE_H

#include <stdbool.h>
#include <stdint.h>

/* z (N, E) -> probs (N, E), idx (N, k) and w (N, k). k <= E. psum (E;
 * NULL: not wanted) += the column sums of probs (the loss's P over layers;
 * each summed in double, then added in fp32). */
void loom_cpu_router_fwd(const float *z, int64_t N, int64_t E, int k, bool norm_topk,
                         float *probs, int32_t *idx, float *w, float *psum);
/* dz (N, E) = the gradient through the routing weights (dw (N, k); NULL:
 * none) and through the probabilities, d/dprobs[n][e] = ga[e] (E; the
 * load-balancing loss's, the same for every token; NULL: none), from the
 * forward's probs and idx. The choice itself has no gradient. */
void loom_cpu_router_bwd(const float *probs, const int32_t *idx, const float *dw,
                         const float *ga, int64_t N, int64_t E, int k, bool norm_topk,
                         float *dz);
/* The load-balancing loss of N rows (probs, idx of router_fwd); with ga
 * (E) not NULL, ga[e] = scale * d aux / d probs[n][e] (the choices held
 * fixed, as autograd sees them; the same for every n). scratch: 2E doubles
 * (f and P). Returns aux. */
double loom_cpu_moe_aux_loss(const float *probs, const int32_t *idx, int64_t N, int64_t E, int k,
                             float scale, double *scratch, float *ga);

/* Tokens to experts: the N*k choices of idx grouped by expert, in token
 * order within an expert (stable). counts (E): choices per expert;
 * order (N*k): the flat choice n*k + j at each grouped position; pos
 * (N*k): the grouped position of each flat choice (order's inverse). */
void loom_cpu_moe_route(const int32_t *idx, int64_t N, int64_t E, int k, int32_t *counts,
                        int32_t *order, int32_t *pos);
/* xg (N*k, H): row p = x[order[p] / k] (the grouped inputs). */
void loom_cpu_moe_permute(const float *x, const int32_t *order, int64_t N, int k, int64_t H,
                          float *xg);
/* y (N, H) = sum over the token's k choices of w * yg[its grouped row,
 * pos] (in slot order: the same sum whatever the grouping). */
void loom_cpu_moe_combine(const float *yg, const int32_t *pos, const float *w, int64_t N, int k,
                          int64_t H, float *y);
/* The backward of combine: dyg (N*k, H) row p = w[c] * dy[c / k] and
 * dw (N, k)[c] = dot(dy[c / k], yg[p]), c = order[p]; and of permute:
 * dx (N, H) = the sum of dxg's rows of each token's choices, in slot order. */
void loom_cpu_moe_combine_bwd(const float *dy, const float *yg, const int32_t *order,
                              const float *w, int64_t N, int k, int64_t H, float *dyg, float *dw);
void loom_cpu_moe_permute_bwd(const float *dxg, const int32_t *pos, int64_t N, int k, int64_t H,
                              float *dx);

/* The shared expert's gate (Qwen2-MoE: its output scaled by sigmoid of a
 * 1-wide projection of the input). Forward: g (N) = sigmoid(z) (z NULL: g
 * given), and with s (N, H) not NULL y = g[n] s[n] (+ y when acc), one fp32
 * product a row: the shared output into the block's, and in the backward
 * the scaled output gradient. */
void loom_cpu_moe_gate_fwd(const float *z, const float *s, int64_t N, int64_t H, bool acc,
                           float *g, float *y);
/* Its backward through g: dz (N) = (1 - g[n]) dot(da[n], a[n]) (in double),
 * a (N, I) the shared expert's down projection's input and da its gradient
 * from the gated output's (g dy): since that output s is linear in a,
 * dot(da, a) = g dot(dy, s), so dz = g (1 - g) dot(dy, s) without s. */
void loom_cpu_moe_gate_bwd(const float *da, const float *a, const float *g, int64_t N, int64_t I,
                           float *dz);

#endif /* LOOM_CPU_MOE_H */
