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
 * slots counted: sum_e f_e = k), P_e the mean of p[., e].
 *
 * The router z-loss (ST-MoE's, Megatron's --moe-z-loss-coeff) is the mean
 * over tokens of lse(z)^2, lse the logsumexp of a token's logits: the
 * router writes lse, its backward adds d/dz = zc lse p (zc lse = d loss /
 * d lse), the caller sums and scales.
 *
 * Capacity (Megatron's --moe-expert-capacity-factor): route may keep at
 * most cap of each expert's choices, dropping those of the lowest weight w
 * (ties: the later token; Megatron's "probs") or of the latest tokens
 * ("position"). A dropped choice is in no expert's group: permute and
 * combine pass over it, its row gets nothing and its weight's gradient is
 * 0 (the output does not depend on it); the router's probabilities and the
 * load-balancing loss still count it, as Megatron's do. */
#ifndef LOOM_CPU_MOE_H
#define LOOM_CPU_MOE_H

#include <stdbool.h>
#include <stdint.h>

/* z (N, E) -> probs (N, E), idx (N, k) and w (N, k). k <= E. psum (E;
 * NULL: not wanted) += the column sums of probs (the loss's P over layers;
 * each summed in double, then added in fp32). lse (N; NULL: not wanted) =
 * each row's logsumexp, max + log(sum of exp(z - max)) in fp32. */
void loom_cpu_router_fwd(const float *z, int64_t N, int64_t E, int k, bool norm_topk, float *probs,
                         int32_t *idx, float *w, float *psum, float *lse);
/* dz (N, E) = the gradient through the routing weights (dw (N, k); NULL:
 * none) and through the probabilities, d/dprobs[n][e] = ga[e] (E; the
 * load-balancing loss's, the same for every token; NULL: none), from the
 * forward's probs and idx; then, with lse (N) not NULL, the z-loss's
 * zc[0] lse[n] probs[n][e] added (zc: one float, d loss / d lse[n] over
 * lse[n]). The choice itself has no gradient. */
void loom_cpu_router_bwd(const float *probs, const int32_t *idx, const float *dw, const float *ga,
                         const float *lse, const float *zc, int64_t N, int64_t E, int k,
                         bool norm_topk, float *dz);
/* The load-balancing loss of N rows (probs, idx of router_fwd); with ga
 * (E) not NULL, ga[e] = scale * d aux / d probs[n][e] (the choices held
 * fixed, as autograd sees them; the same for every n). scratch: 2E doubles
 * (f and P). Returns aux. */
double loom_cpu_moe_aux_loss(const float *probs, const int32_t *idx, int64_t N, int64_t E, int k,
                             float scale, double *scratch, float *ga);

/* Tokens to experts: the N*k choices of idx grouped by expert, in token
 * order within an expert (stable). counts (E): choices per expert (all of
 * them, before any is dropped); order (N*k): the flat choice n*k + j at
 * each grouped position; pos (N*k): the grouped position of each flat
 * choice (order's inverse).
 * cap >= 0 keeps at most cap choices an expert (min(counts[e], cap)), by
 * w (N, k: the routing weights; "probs") or, by_position, the first in
 * token order; the kept rows of all experts come first, grouped as above
 * (R = sum_e min(counts[e], cap) of them), then the dropped choices, as
 * -1 - c, grouped the same way; a dropped choice's pos is -1. cap < 0:
 * dropless (w may be NULL). */
void loom_cpu_moe_route(const int32_t *idx, const float *w, int64_t N, int64_t E, int k,
                        int64_t cap, bool by_position, int32_t *counts, int32_t *order,
                        int32_t *pos);
/* The kept choices of an expert that had n: min(n, cap), all when cap < 0. */
static inline int64_t loom_moe_kept(int64_t n, int64_t cap) {
    return cap >= 0 && cap < n ? cap : n;
}
/* The expert-parallel regrouping: the rows a rank gathered are ordered by
 * (source s, local expert f), rc[s El + f] of each (S sources, El
 * experts, Rt rows in all); grouped by (f, s) they are the experts' GEMM
 * inputs. ix[j] (j < Rt) = the gathered row at grouped place j, ix[Rt + i]
 * = the grouped place of gathered row i. */
void loom_cpu_moe_regroup(const int32_t *rc, int64_t S, int64_t El, int64_t Rt, int32_t *ix);
/* The once-per-rank dispatch (ep ranks of El experts each, P of them):
 * - dest (N, P): p where token n has a choice among rank p's experts
 *   (idx / El == p), else P (none);
 * - dedup_meta: the U rows sent, rank by rank in ord's order (route's over
 *   dest): for i < U, c = ord[i], t = c / P, p = c % P: tok[i] = t, and
 *   for each of t's choices j, mid[i k + j] its expert on rank p (idx - p
 *   El) or El when on another rank, mw[i k + j] its weight;
 * - mask: choices c < N k with key[c] == none get route's dropped form
 *   (order[pos[c]] = -1 - c, pos[c] = -1);
 * - dedup_dw: dw[n k + j] = the sum over p in order of dwb[pos[n P + p] k
 *   + j] where pos[n P + p] >= 0 (the ranks' routing-weight gradients back
 *   at the token's). */
void loom_cpu_moe_dest(const int32_t *idx, int64_t N, int k, int64_t El, int P, int32_t *dest);
void loom_cpu_moe_dedup_meta(const int32_t *ord, int64_t U, const int32_t *idx, const float *w,
                             int k, int64_t El, int P, int32_t *tok, int32_t *mid, float *mw);
void loom_cpu_moe_mask(const int32_t *key, int64_t N, int k, int32_t none, int32_t *order,
                       int32_t *pos);
void loom_cpu_moe_dedup_dw(const float *dwb, const int32_t *pos, int64_t N, int P, int k,
                           float *dw);
/* xg (N*k, H): row p = x[order[p] / k] (the grouped inputs); rows of a
 * dropped choice (order[p] < 0) are left as they are. */
void loom_cpu_moe_permute(const float *x, const int32_t *order, int64_t N, int k, int64_t H,
                          float *xg);
/* y (N, H) = sum over the token's k choices of w * yg[its grouped row,
 * pos] (in slot order: the same sum whatever the grouping); a dropped
 * choice (pos -1) adds nothing. */
void loom_cpu_moe_combine(const float *yg, const int32_t *pos, const float *w, int64_t N, int k,
                          int64_t H, float *y);
/* The backward of combine: dyg (N*k, H) row p = w[c] * dy[c / k] and
 * dw (N, k)[c] = dot(dy[c / k], yg[p]), c = order[p] (a dropped choice:
 * dw 0, its row left as it is); and of permute: dx (N, H) = the sum of
 * dxg's rows of each token's kept choices, in slot order. */
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
