/* The mixture-of-experts block (block.h's kind "moe"): Qwen3-MoE's router
 * and experts in the layers loom_config_layer_is_moe names.
 *
 *   z = h Wr^T                      router logits (Tc, E); Wr replicated
 *   p = softmax(z) (fp32); the top k of each token, w their weights
 *                                   (renormalised under norm_topk_prob)
 *   xg = h's rows grouped by expert (each token once per choice)
 *   per expert e, on its rows:      g, u = xg We_g^T, xg We_u^T
 *                                   yg = (silu(g) * u) We_d^T
 *   out = sum over a token's choices of w * yg
 *
 * The experts' projections run as grouped GEMMs (one call a projection).
 * Under tensor parallelism each expert is split like the dense MLP (gate
 * and up by rows, down by columns: etp = tp), the router's work is the
 * same on every tp rank and `out` is a partial sum the walker reduces.
 *
 * The load-balancing loss (transformers' load_balancing_loss_func over all
 * the model's MoE layers): aux = E sum_e f_e P_e over the micro-batch's
 * N = layers x tokens router rows, f_e the fraction of them choosing e
 * (each of the k choices counted), P_e the mean probability of e. Each
 * forward adds its layer's counts and probability sums into the
 * micro-batch's `aux` (loom_micro); loom_moe_finish, after the micro-batch's
 * forward, turns them into the loss and its gradient per expert, which
 * every layer's backward adds through the probabilities (the choices carry
 * none). */
#include <math.h>
#include <string.h>

#include "../comm/comm.h"
#include "block.h"
#include "model.h"

/* its tensors: the router, then each expert's gate, up, down (the dense
 * MLP's slot order, loom_mlp_params); expert e's are NPER slots after
 * expert 0's */
enum { ROUTER, EG, EU, ED, NSLOT, NPER = 3 };
/* activation buffers per layer: the routing (kept), the experts' (dropped
 * under selective recomputation) */
enum { PROBS, IDX, WT, CNT, ORD, POS, XG, G, U, ACT, YG, NBUF };
/* scratch: logits and their gradient, probability sums on the device, the
 * choices' weight gradients, the experts' gradients */
enum { Z, PSUM, DW, DYG, DG, DU, NSCRATCH };

static const loom_block_slot slots[NSLOT] = {
    /* its gradient is a partial sum over tp (the combine weights' part) */
    [ROUTER] = {"mlp.gate.weight", LOOM_COMP_ROUTER, LOOM_SHARD_NONE, true},
    [EG] = {"mlp.experts.%lld.gate_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_ROWS},
    [EU] = {"mlp.experts.%lld.up_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_ROWS},
    [ED] = {"mlp.experts.%lld.down_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_COLS},
};

static loom_status moe_params(const loom_model_config *c, int64_t l, loom_param_sink *s) {
    if (c->mlp_bias)
        return loom_errf(loom_param_sink_ctx(s), LOOM_ERR_UNSUPPORTED,
                         "layer %lld: experts with biases (mlp_bias) are not supported; "
                         "Qwen2/3-MoE experts have none",
                         (long long)l);
    loom_param_put(s, ROUTER, c->num_experts, c->hidden_size);
    for (int64_t e = 0; e < c->num_experts; e++)
        loom_mlp_params(c, s, EG, e, c->moe_intermediate_size);
    return LOOM_OK;
}

/* This rank's width of an expert (gate/up rows, down columns). */
static int64_t ie(const loom_model *m) { return m->cfg.moe_intermediate_size / m->tp; }

static int moe_acts(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out) {
    (void)T, (void)Tn;
    const int64_t E = m->cfg.num_experts, R = Tc * m->cfg.num_experts_per_tok;
    const size_t esz = m->dev.esz;
    out[PROBS] = (loom_block_buf){(size_t)(Tc * E) * sizeof(float), false};
    out[IDX] = (loom_block_buf){(size_t)R * sizeof(int32_t), false};
    out[WT] = (loom_block_buf){(size_t)R * sizeof(float), false};
    out[CNT] = (loom_block_buf){(size_t)E * sizeof(int32_t), false};
    out[ORD] = (loom_block_buf){(size_t)R * sizeof(int32_t), false};
    out[POS] = (loom_block_buf){(size_t)R * sizeof(int32_t), false};
    out[XG] = (loom_block_buf){(size_t)(R * m->H) * esz, true};
    out[G] = out[U] = out[ACT] = (loom_block_buf){(size_t)(R * ie(m)) * esz, true};
    out[YG] = (loom_block_buf){(size_t)(R * m->H) * esz, true};
    return NBUF;
}

static int moe_scratch(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes) {
    (void)T;
    const int64_t E = m->cfg.num_experts, R = Tc * m->cfg.num_experts_per_tok;
    const size_t esz = m->dev.esz;
    bytes[Z] = (size_t)(Tc * E) * esz;
    bytes[PSUM] = (size_t)E * sizeof(float);
    bytes[DW] = (size_t)R * sizeof(float);
    bytes[DYG] = (size_t)(R * m->H) * esz; /* also the grouped input gradient */
    bytes[DG] = bytes[DU] = (size_t)(R * ie(m)) * esz;
    return NSCRATCH;
}

/* host: the counts (E int32) and the probability sums (E floats) */
static size_t moe_host(const loom_model *m) {
    return (size_t)m->cfg.num_experts * (sizeof(int32_t) + sizeof(float));
}

/* The layer's counts on the host (the grouped GEMMs' sizes). */
static loom_status counts_host(const loom_blk *b, int32_t **cnt) {
    *cnt = b->host;
    return loom_k_download(b->m, *cnt, b->act[CNT],
                           (size_t)b->m->cfg.num_experts * sizeof(int32_t));
}

/* One grouped GEMM over the experts: group e has rows[e] rows starting at
 * row0 (their sum before e) of A (ld lda) and C (ld ldc) in the compute
 * dtype, and expert e's weight of slot `slot` as B. */
static loom_status experts_gemm(const loom_blk *b, const int32_t *rows, int slot, bool tb,
                                const void *A, int64_t lda, int64_t N, int64_t K, void *C,
                                int64_t ldc, loom_gemm_group *g) {
    loom_model *m = b->m;
    const size_t esz = m->dev.esz;
    const int E = (int)m->cfg.num_experts;
    int64_t r0 = 0;
    for (int e = 0; e < E; e++) {
        g[e] = (loom_gemm_group){(const char *)A + (size_t)(r0 * lda) * esz,
                                 loom_wc(m, b->w[slot] + e * NPER),
                                 (char *)C + (size_t)(r0 * ldc) * esz, rows[e], N, K};
        r0 += rows[e];
    }
    return loom_k_gemm_grouped(m, false, tb, E, g, lda, tb ? K : N, 0.0f, false, ldc);
}

/* The weight gradients of one projection: dW_e (out, in) += dY_e^T X_e. */
static loom_status experts_dw(const loom_blk *b, const int32_t *rows, int slot, const void *dY,
                              int64_t out, const void *X, int64_t in, loom_gemm_group *g) {
    loom_model *m = b->m;
    const size_t esz = m->dev.esz;
    const int E = (int)m->cfg.num_experts;
    if (!loom_g(m, b->w[slot])) return LOOM_OK; /* frozen */
    int64_t r0 = 0;
    for (int e = 0; e < E; e++) {
        g[e] = (loom_gemm_group){(const char *)dY + (size_t)(r0 * out) * esz,
                                 (const char *)X + (size_t)(r0 * in) * esz,
                                 loom_g(m, b->w[slot] + e * NPER), out, in, rows[e]};
        r0 += rows[e];
    }
    return loom_k_gemm_grouped(m, true, false, E, g, out, in, 1.0f, true, in);
}

/* The experts' forward from the routing: xg, g, u, act and yg. */
static loom_status experts_fwd(const loom_blk *b, const void *h, const int32_t *cnt) {
    loom_model *m = b->m;
    void *const *a = b->act;
    const int64_t H = m->H, Ie = ie(m), Tc = m->Tc, k = m->cfg.num_experts_per_tok;
    loom_gemm_group g[LOOM_MOE_MAX_EXPERTS];
    CK(loom_k_moe_permute(m, h, a[ORD], Tc, (int)k, H, a[XG]));
    CK(experts_gemm(b, cnt, EG, true, a[XG], H, Ie, H, a[G], Ie, g));
    CK(experts_gemm(b, cnt, EU, true, a[XG], H, Ie, H, a[U], Ie, g));
    CK(loom_k_swiglu_fwd(m, a[G], a[U], Tc * k * Ie, a[ACT]));
    return experts_gemm(b, cnt, ED, true, a[ACT], Ie, H, Ie, a[YG], H, g);
}

static loom_status moe_fwd(const loom_blk *b, const void *h, void *out) {
    loom_model *m = b->m;
    void *const *a = b->act;
    const int64_t H = m->H, Tc = m->Tc, E = m->cfg.num_experts;
    const int k = (int)m->cfg.num_experts_per_tok;
    void *z = b->scratch[Z];
    float *psum = b->scratch[PSUM];
    CK(loom_k_lin_fwd(m, h, Tc, H, loom_wc(m, b->w[ROUTER]), E, 1.0f, 0.0f, z));
    CK(loom_k_zero(m, psum, (size_t)E * sizeof(float)));
    CK(loom_k_moe_router_fwd(m, z, Tc, E, k, m->cfg.norm_topk_prob, a[PROBS], a[IDX], a[WT],
                             psum));
    CK(loom_k_moe_route(m, a[IDX], Tc, E, k, a[CNT], a[ORD], a[POS]));
    int32_t *cnt;
    CK(counts_host(b, &cnt));
    /* the load-balancing loss's sums, once per forward (not when recomputed) */
    if (out && b->mb->aux) {
        float *ps = (float *)(cnt + E);
        CK(loom_k_download(m, ps, psum, (size_t)E * sizeof(float)));
        double *acc = b->mb->aux;
        for (int64_t e = 0; e < E; e++) acc[e] += cnt[e], acc[E + e] += ps[e];
        acc[2 * E] += (double)Tc;
    }
    if (out && m->training && m->moe_load && m->mesh->tp_rank == 0)
        for (int64_t e = 0; e < E; e++) m->moe_load[b->l * E + e] += cnt[e];
    CK(experts_fwd(b, h, cnt));
    if (!out) return LOOM_OK;
    return loom_k_moe_combine(m, a[YG], a[POS], a[WT], Tc, k, H, out);
}

/* selective recomputation: the experts' buffers from h and the kept routing */
static loom_status moe_recompute(const loom_blk *b, const void *h) {
    int32_t *cnt;
    CK(counts_host(b, &cnt));
    return experts_fwd(b, h, cnt);
}

static loom_status moe_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    loom_model *m = b->m;
    void *const *a = b->act;
    void *const *s = b->scratch;
    const int64_t H = m->H, Ie = ie(m), Tc = m->Tc, E = m->cfg.num_experts;
    const int k = (int)m->cfg.num_experts_per_tok;
    const size_t esz = m->dev.esz;
    loom_gemm_group g[LOOM_MOE_MAX_EXPERTS];
    int32_t *cnt;
    CK(counts_host(b, &cnt));
    /* combine: dyg = w dy per choice, dw = dy . yg */
    CK(loom_k_moe_combine_bwd(m, dy, a[YG], a[ORD], a[WT], Tc, k, H, s[DYG], s[DW]));
    /* down: dact = dyg Wd, dWd += dyg^T act */
    CK(experts_dw(b, cnt, ED, s[DYG], H, a[ACT], Ie, g));
    int64_t r0 = 0;
    for (int e = 0; e < E; e++) {
        g[e] = (loom_gemm_group){(char *)s[DYG] + (size_t)(r0 * H) * esz,
                                 loom_wc(m, b->w[ED] + e * NPER),
                                 (char *)s[DG] + (size_t)(r0 * Ie) * esz, cnt[e], Ie, H};
        r0 += cnt[e];
    }
    CK(loom_k_gemm_grouped(m, false, false, (int)E, g, H, Ie, 0.0f, false, Ie));
    CK(loom_k_swiglu_bwd(m, s[DG], a[G], a[U], Tc * k * Ie, s[DG], s[DU]));
    CK(experts_dw(b, cnt, EG, s[DG], Ie, a[XG], H, g));
    CK(experts_dw(b, cnt, EU, s[DU], Ie, a[XG], H, g));
    /* the grouped input gradient dxg = dg Wg + du Wu (into DYG, done with) */
    void *dxg = s[DYG];
    for (int pass = 0; pass < 2 && dx; pass++) {
        r0 = 0;
        for (int e = 0; e < E; e++) {
            const void *d = pass ? s[DU] : s[DG];
            g[e] = (loom_gemm_group){(const char *)d + (size_t)(r0 * Ie) * esz,
                                     loom_wc(m, b->w[pass ? EU : EG] + e * NPER),
                                     (char *)dxg + (size_t)(r0 * H) * esz, cnt[e], H, Ie};
            r0 += cnt[e];
        }
        CK(loom_k_gemm_grouped(m, false, false, (int)E, g, Ie, H, pass ? 1.0f : 0.0f, false, H));
    }
    if (dx) CK(loom_k_moe_permute_bwd(m, dxg, a[POS], Tc, k, H, dx));
    /* router: dz from the choices' weights and, on one tp rank (the rest
     * add partial sums), the load-balancing loss */
    const float *ga = m->mesh->tp_rank == 0 ? b->mb->d_aux_g : NULL;
    CK(loom_k_moe_router_bwd(m, a[PROBS], a[IDX], s[DW], ga, Tc, E, k, m->cfg.norm_topk_prob,
                             s[Z]));
    CK(loom_k_lin_dw(m, s[Z], h, Tc, E, H, 1.0f, loom_g(m, b->w[ROUTER])));
    if (dx) CK(loom_k_lin_dx(m, s[Z], Tc, E, loom_wc(m, b->w[ROUTER]), H, 1.0f, 1.0f, dx));
    return LOOM_OK;
}

const loom_block_kind loom_block_moe = {
    .name = "moe",
    .id = LOOM_KIND_MOE,
    .norm = "post_attention_layernorm.weight",
    .slots = slots,
    .nslots = NSLOT,
    .out_bias = -1,
    .params = moe_params,
    .acts = moe_acts,
    .scratch = moe_scratch,
    .host = moe_host,
    .fwd = moe_fwd,
    .bwd = moe_bwd,
    .recompute = moe_recompute,
};

/* ---- the load-balancing loss of a micro-batch ---- */

size_t loom_moe_aux_len(const loom_model_config *c) {
    return c->num_experts > 0 ? (size_t)(2 * c->num_experts + 2) : 0;
}

loom_status loom_moe_finish(loom_model *m, loom_micro *mb, bool backward, double *loss_sum) {
    *loss_sum = 0.0;
    double *acc = mb->aux;
    if (!acc) return LOOM_OK;
    const int64_t E = m->cfg.num_experts;
    int64_t ntgt = 0;
    for (int64_t t = 0; t < m->Tc; t++) ntgt += mb->tgt[t] != -100;
    acc[2 * E + 1] = (double)ntgt;
    /* the micro-batch's tokens are split over cp (each rank routes its own) */
    if (m->cp > 1)
        CK(loom_comm_allreduce(m->mesh->cp, acc, loom_moe_aux_len(&m->cfg), LOOM_F64,
                               LOOM_RED_SUM));
    const double N = acc[2 * E], coef = m->cfg.router_aux_loss_coef;
    double aux = 0.0;
    for (int64_t e = 0; N > 0 && e < E; e++) aux += (acc[e] / N) * (acc[E + e] / N);
    aux *= (double)E;
    mb->aux_loss = aux;
    /* the step divides the summed losses by the targets of the batch: the
     * micro-batch's term is coef aux times its own targets, so one
     * micro-batch gives transformers' loss + coef aux exactly */
    const double scale = coef * acc[2 * E + 1];
    if (m->mesh->cp_rank == 0) *loss_sum = scale * aux;
    if (!backward) return LOOM_OK;
    for (int64_t e = 0; e < E; e++)
        mb->aux_g[e] = N > 0 ? (float)(m->loss_scale * scale * (double)E * acc[e] / (N * N)) : 0.0f;
    return loom_k_upload(m, mb->d_aux_g, mb->aux_g, (size_t)E * sizeof(float));
}
