/* The mixture-of-experts block (block.h's kind "moe"): Qwen3-MoE's router
 * and experts in the layers loom_config_layer_is_moe names, and Qwen2-MoE's
 * shared expert beside them.
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
 * The shared expert (shared_expert_intermediate_size > 0; Qwen2-MoE): a
 * SwiGLU MLP that every token goes through, gated per token,
 *
 *   out += sigmoid(h Wsg^T) (silu(h Ws_g^T) * h Ws_u^T) Ws_d^T
 *
 * its projections split over tp like the dense MLP (whatever ep and etp
 * are), Wsg (1, H) replicated; it runs on all Tc rows of h on both paths,
 * and each tp rank's share is a partial sum that adds into the block's
 * partial output (on the folded path, over the rows the routed part left
 * zero too). The gate's gradient, and through it Wsg's and its part of dx,
 * are partial sums over tp.
 *
 * The load-balancing loss (transformers' load_balancing_loss_func over all
 * the model's MoE layers): aux = E sum_e f_e P_e over the micro-batch's
 * N = layers x tokens router rows, f_e the fraction of them choosing e
 * (each of the k choices counted), P_e the mean probability of e. Each
 * forward adds its layer's counts and probability sums into the
 * micro-batch's `aux` (loom_micro); loom_moe_finish, after the micro-batch's
 * forward, turns them into the loss and its gradient per expert, which
 * every layer's backward adds through the probabilities (the choices carry
 * none).
 *
 * With a capacity factor (Megatron's --moe-expert-capacity-factor) each
 * router call lets an expert keep cap = ceil(n k / E x factor) of its
 * choices (route drops the others: by weight or by position); the load-
 * balancing loss counts every choice, the experts see the kept ones, and
 * their buffers are sized by cap instead of the dropless worst case.
 *
 * The router z-loss (Megatron's --moe-z-loss-coeff, ST-MoE's): each layer's
 * mean over its router rows of lse(z)^2, summed over the layers. Its sums
 * ride in the same micro-batch block; its gradient, zc lse p per router
 * row, from one factor zc at the end of the gradient block.
 *
 * Not local (ep > 1 or etp != tp), the rows travel by moe_dispatch.c;
 * moe_impl.h holds what the two files share. */
#include <math.h>
#include <string.h>

#include "../comm/comm.h"
#include "../core/rng.h"
#include "block.h"
#include "model.h"
#include "moe_impl.h"
#include "moe_dedup.h"
#include "moe_tabs.h"
#include "prof.h"

/* its tensors: the router, then each expert's gate, up, down (the dense
 * MLP's slot order, loom_mlp_params); this rank's expert e (local number)
 * has its NPER slots after expert e-1's; then the shared expert's gate, up,
 * down and its gate's weight (absent without one) */
enum { ROUTER, EG, EU, ED, SG, SU, SD, SGATE, NSLOT, NPER = LOOM_MOE_EXPERT_SLOTS };
/* its linears: each expert's three projections (LoRA's mlp.experts.<e>.*),
 * the shared expert's three and its gate (absent without one), the router
 * (LoRA's mlp.gate, only when named) */
enum { LG, LU, LD, SLG, SLU, SLD, SLGATE, LROUTER, NLIN };

static const loom_block_slot slots[NSLOT] = {
    /* its gradient is a partial sum over tp (the combine weights' part) */
    [ROUTER] = {"mlp.gate.weight", LOOM_COMP_ROUTER, LOOM_SHARD_NONE, true},
    [EG] = {"mlp.experts.%lld.gate_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_ROWS},
    [EU] = {"mlp.experts.%lld.up_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_ROWS},
    [ED] = {"mlp.experts.%lld.down_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_COLS},
    /* the shared expert, split like the dense MLP; its gate replicated, its
     * gradient a partial sum over tp (the gated output's) */
    [SG] = {"mlp.shared_expert.gate_proj.weight", LOOM_COMP_MLP, LOOM_SHARD_ROWS},
    [SU] = {"mlp.shared_expert.up_proj.weight", LOOM_COMP_MLP, LOOM_SHARD_ROWS},
    [SD] = {"mlp.shared_expert.down_proj.weight", LOOM_COMP_MLP, LOOM_SHARD_COLS},
    [SGATE] = {"mlp.shared_expert_gate.weight", LOOM_COMP_ROUTER, LOOM_SHARD_NONE, true},
};

static const loom_block_linear linears[NLIN] = {
    [LG] = {"mlp.experts", "gate_proj", EG, LG, true},
    [LU] = {"mlp.experts", "up_proj", EU, LG, true},
    [LD] = {"mlp.experts", "down_proj", ED, LD, true},
    [SLG] = {"mlp.shared_expert", "gate_proj", SG, SLG},
    [SLU] = {"mlp.shared_expert", "up_proj", SU, SLG},
    [SLD] = {"mlp.shared_expert", "down_proj", SD, SLD},
    [SLGATE] = {"mlp", "shared_expert_gate", SGATE, SLGATE},
    /* replicated like its base, so its A and B gradients are partial sums
     * over tp as the router's is */
    [LROUTER] = {"mlp", "gate", ROUTER, LROUTER, .named = true},
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
    if (c->shared_expert_intermediate_size > 0) { /* the hub's order: after the experts */
        loom_mlp_params(c, s, SG, -1, c->shared_expert_intermediate_size);
        loom_param_put(s, SGATE, 1, c->hidden_size);
    }
    return LOOM_OK;
}


/* The choices an expert keeps of n tokens' (Megatron's get_capacity over
 * the n k choices: ceil(n k / E x factor)); -1 without a capacity factor.
 * No expert has more than n, so more is n. */
static int64_t capacity(const loom_model *m, int64_t n) {
    if (m->moe_cap_factor <= 0.0) return -1;
    const double c = ceil((double)(n * m->cfg.num_experts_per_tok) / (double)m->cfg.num_experts *
                          m->moe_cap_factor);
    return c < (double)n ? (int64_t)c : n;
}

static geo geometry(const loom_model *m, int64_t Tc) {
    geo g;
    g.E = m->cfg.num_experts;
    g.k = (int)m->cfg.num_experts_per_tok;
    g.P = m->ep;
    g.Q = m->etp;
    g.El = g.E / g.P;
    g.e0 = m->mesh ? (int64_t)m->mesh->ep_rank * g.El : 0;
    g.Ie = m->cfg.moe_intermediate_size / g.Q;
    g.H = m->H;
    g.local = g.P == 1 && g.Q == m->tp;
    g.dedup = m->moe_dedup;
    g.n = g.local ? Tc : Tc / m->tp;
    g.o0 = g.local || !m->mesh ? 0 : (int64_t)m->mesh->tp_rank * g.n;
    g.R = g.n * g.k;
    g.cap = capacity(m, g.n);
    g.Rk = g.cap < 0 ? g.R : g.R < g.E * g.cap ? g.R : g.E * g.cap;
    const int64_t per = g.cap < 0 || g.R < g.El * g.cap ? g.R : g.El * g.cap; /* to El experts */
    g.Rmax = g.local ? g.Rk : g.Q * g.P * per;
    return g;
}

/* The shared expert's width on this rank (0: none). */
static int64_t shared_width(const loom_model *m) {
    return m->cfg.shared_expert_intermediate_size / m->tp;
}

static int moe_acts(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out) {
    (void)T, (void)Tn;
    const geo g = geometry(m, Tc);
    const size_t esz = m->dev.esz, i4 = sizeof(int32_t);
    /* the routing (kept under full recomputation too: the forward run
     * again reuses it, no router, no count exchange, no host wait) */
    out[PROBS] = (loom_block_buf){.bytes = (size_t)(g.n * g.E) * sizeof(float), .route = true};
    out[IDX] = (loom_block_buf){.bytes = (size_t)g.R * i4, .route = true};
    out[WT] = (loom_block_buf){.bytes = (size_t)g.R * sizeof(float), .route = true};
    out[CNT] = (loom_block_buf){.bytes = (size_t)g.E * i4, .route = true};
    out[ORD] = out[POS] = (loom_block_buf){.bytes = (size_t)g.R * i4, .route = true};
    out[RC] =
        (loom_block_buf){.bytes = g.local ? 0 : (size_t)(g.Q * g.P * g.El) * i4, .route = true};
    out[XE] = (loom_block_buf){.bytes = (size_t)(g.Rmax * g.H) * esz, .cheap = true};
    out[G] = out[U] = out[ACT] =
        (loom_block_buf){.bytes = (size_t)(g.Rmax * g.Ie) * esz, .cheap = true};
    out[LST] = (loom_block_buf){.bytes = (size_t)(3 * g.Rmax * m->lora_r) * esz, .cheap = true};
    /* the experts' outputs: at the tokens' rank, or (dedup_on) at the experts' */
    const bool dd = dedup_on(&g);
    out[YS] = (loom_block_buf){.bytes = (size_t)((dd ? g.Rmax : g.Rk) * g.H) * esz};
    out[LSE] = (loom_block_buf){.bytes = (size_t)g.n * sizeof(float), .route = true};
    /* the shared expert's g, u and act (dropped), its gate's values (kept) */
    const int64_t Is = shared_width(m);
    out[SHG] = out[SHU] = out[SHACT] =
        (loom_block_buf){.bytes = (size_t)(Tc * Is) * esz, .cheap = true};
    out[SHSIG] = (loom_block_buf){.bytes = Is ? (size_t)Tc * sizeof(float) : 0};
    const size_t nP = dd ? (size_t)(g.n * g.P) * i4 : 0, rm = dd ? (size_t)g.Rmax * i4 : 0;
    out[DEST] = out[ORD2] = out[POS2] = (loom_block_buf){.bytes = nP, .route = true};
    out[TOK] = (loom_block_buf){.bytes = nP};
    out[CNT2] = (loom_block_buf){.bytes = dd ? (size_t)(g.P + 1) * i4 : 0, .route = true};
    out[RMID] = out[RMW] = out[RORD] = out[RPOS] = (loom_block_buf){.bytes = rm};
    out[RCNT] = (loom_block_buf){.bytes = dd ? (size_t)(g.El + 1) * i4 : 0};
    return NBUF;
}

static int moe_scratch(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes) {
    (void)T;
    const geo g = geometry(m, Tc);
    const size_t esz = m->dev.esz;
    bytes[Z] = (size_t)(g.n * g.E) * esz;
    bytes[PSUM] = rc_at(g.E) + (size_t)table_len(&g) * sizeof(int32_t);
    bytes[DW] = (size_t)g.R * sizeof(float);
    bytes[S1] = bytes[S2] = bytes[S3] = (size_t)(g.Rmax * g.H) * esz;
    bytes[DG] = bytes[DU] = (size_t)(g.Rmax * g.Ie) * esz;
    bytes[IX] = g.local ? 0 : (size_t)(2 * g.Rmax) * sizeof(int32_t);
    /* the once-per-rank dispatch (dedup_on): the routing weights' gradients
     * at the experts' rank and back at the tokens' */
    bytes[DX] = dedup_on(&g) ? (size_t)(2 * g.Rmax) * sizeof(float) : 0;
    bytes[DLU] = (size_t)(g.Rmax * m->lora_r) * esz;
    const int64_t Is = shared_width(m);
    bytes[SZ] = Is ? (size_t)Tc * esz : 0;
    bytes[SY] = Is ? (size_t)(Tc * g.H) * esz : 0;
    bytes[SDG] = bytes[SDU] = (size_t)(Tc * Is) * esz;
    return NSCRATCH;
}


static size_t hs_carve(const loom_model *m, int64_t Tc, hs *h, char *base) {
    const geo g = geometry(m, Tc);
    const int64_t PQ = g.P > g.Q ? g.P : g.Q;
    size_t off = 0;
#define TAKE(f, n)                                                                   \
    do {                                                                             \
        off = (off + 15) & ~(size_t)15;                                              \
        if (h) h->f = (void *)(base + off);                                          \
        off += (size_t)(n) * sizeof(*h->f);                                          \
    } while (0)
    TAKE(cnt, g.E);
    TAKE(psum, g.E); /* right after cnt, as in the PSUM scratch (psum_at) */
    TAKE(rc, g.Q * g.P * g.El + (dedup_on(&g) ? 2 * g.P : 0));
    TAKE(ce, g.El);
    TAKE(ix, 2 * g.Rmax);
    TAKE(tab, g.P * g.El);
    TAKE(sc, 2 * PQ);
    TAKE(rcv, 2 * PQ);
    TAKE(lse, g.n);
#undef TAKE
    return off;
}

static size_t moe_host(const loom_model *m) { return hs_carve(m, m->Tc, NULL, NULL); }

static hs host_of(const loom_blk *b) {
    hs h;
    hs_carve(b->m, b->m->Tc, &h, b->host);
    return h;
}

/* ---- the experts' GEMMs over this rank's El experts, rows[e] each, in
 * order: A, C row-major in the compute dtype ---- */

static loom_status experts_gemm(const loom_blk *b, const geo *q, const int32_t *rows, int slot,
                                bool tb, const void *A, int64_t lda, int64_t N, int64_t K,
                                float beta, void *C, int64_t ldc) {
    loom_model *m = b->m;
    const size_t esz = m->dev.esz;
    loom_gemm_group g[LOOM_MOE_MAX_EXPERTS];
    int64_t r0 = 0;
    for (int64_t e = 0; e < q->El; e++) {
        g[e] = (loom_gemm_group){(const char *)A + (size_t)(r0 * lda) * esz,
                                 loom_wc(m, b->w[slot] + (int)e * NPER),
                                 (char *)C + (size_t)(r0 * ldc) * esz, rows[e], N, K};
        r0 += rows[e];
    }
    return loom_k_gemm_grouped(m, false, tb, (int)q->El, g, 1.0f, lda, tb ? K : N, beta, false,
                               ldc);
}

/* dW_e (out, in) += dY_e^T X_e of one projection */
static loom_status experts_dw(const loom_blk *b, const geo *q, const int32_t *rows, int slot,
                              const void *dY, int64_t out, const void *X, int64_t in) {
    loom_model *m = b->m;
    const size_t esz = m->dev.esz;
    if (!loom_g(m, b->w[slot])) return LOOM_OK; /* frozen */
    loom_gemm_group g[LOOM_MOE_MAX_EXPERTS];
    int64_t r0 = 0;
    for (int64_t e = 0; e < q->El; e++) {
        g[e] = (loom_gemm_group){(const char *)dY + (size_t)(r0 * out) * esz,
                                 (const char *)X + (size_t)(r0 * in) * esz,
                                 loom_g(m, b->w[slot] + (int)e * NPER), out, in, rows[e]};
        r0 += rows[e];
    }
    return loom_k_gemm_grouped(m, true, false, (int)q->El, g, 1.0f, out, in, 1.0f, true, in);
}

/* ---- LoRA on the experts' projections (the active adapter's, when it
 * covers them): y_e += s (x_e A_e^T) B_e^T, x A^T kept in LST ---- */

static void *lora_stash(const loom_blk *b, const geo *q, int lin, int64_t r) {
    return (char *)b->act[LST] + (size_t)(lin * q->Rmax * r) * b->m->dev.esz;
}

/* One grouped GEMM over the experts with LoRA's per-expert A or B (which:
 * 0, 1) as the B operand, or their gradients as C (dw). */
typedef enum { L_XA, L_UB, L_DYB, L_DUA, L_DB, L_DA } lora_op;

static loom_status lora_gemm(const loom_blk *b, const geo *q, const int32_t *ce, int lin,
                             lora_op op, const void *X, int64_t ldx, const void *Y, int64_t ldy,
                             void *C, int64_t ldc, float alpha, float beta) {
    loom_model *m = b->m;
    const size_t esz = m->dev.esz;
    int64_t r;
    float sc;
    loom_lora_expert(m, b->l, b->lin0 + lin, &r, &sc);
    loom_gemm_group g[LOOM_MOE_MAX_EXPERTS];
    int64_t r0 = 0;
    for (int64_t e = 0; e < q->El; e++) {
        const void *A, *B;
        float *dA, *dB;
        loom_lora_expert_at(m, b->l, b->lin0 + lin, e, &A, &B, &dA, &dB);
        const char *x = (const char *)X + (size_t)(r0 * ldx) * esz;
        const char *y = Y ? (const char *)Y + (size_t)(r0 * ldy) * esz : NULL;
        char *c = (char *)C + (size_t)(r0 * ldc) * esz;
        switch (op) {
        case L_XA: g[e] = (loom_gemm_group){x, A, c, ce[e], r, ldx}; break;   /* u = x A^T */
        case L_UB: g[e] = (loom_gemm_group){x, B, c, ce[e], ldc, r}; break;   /* y += s u B^T */
        case L_DYB: g[e] = (loom_gemm_group){x, B, c, ce[e], r, ldx}; break;  /* du = s dy B */
        case L_DUA: g[e] = (loom_gemm_group){x, A, c, ce[e], ldc, r}; break;  /* dx += du A */
        case L_DB: g[e] = (loom_gemm_group){x, y, dB, ldx, r, ce[e]}; break;  /* dB += s dy^T u */
        case L_DA: g[e] = (loom_gemm_group){x, y, dA, r, ldy, ce[e]}; break;  /* dA += du^T x */
        }
        r0 += ce[e];
    }
    const int ng = (int)q->El;
    switch (op) {
    case L_XA: return loom_k_gemm_grouped(m, false, true, ng, g, alpha, ldx, ldx, beta, false, r);
    case L_UB: return loom_k_gemm_grouped(m, false, true, ng, g, alpha, r, r, beta, false, ldc);
    case L_DYB: return loom_k_gemm_grouped(m, false, false, ng, g, alpha, ldx, r, beta, false, r);
    case L_DUA: return loom_k_gemm_grouped(m, false, false, ng, g, alpha, r, ldc, beta, false, ldc);
    case L_DB: return loom_k_gemm_grouped(m, true, false, ng, g, alpha, ldx, r, 1.0f, true, r);
    case L_DA: return loom_k_gemm_grouped(m, true, false, ng, g, alpha, r, ldy, 1.0f, true, ldy);
    }
    return LOOM_OK;
}

/* forward of projection lin on x (rows, in): the stash, and with y (rows,
 * out) not NULL its term added */
static loom_status lora_fwd(const loom_blk *b, const geo *q, const int32_t *ce, int lin,
                            const void *x, int64_t in, void *y, int64_t out) {
    int64_t r;
    float sc;
    if (!loom_lora_expert(b->m, b->l, b->lin0 + lin, &r, &sc)) return LOOM_OK;
    void *u = lora_stash(b, q, lin, r);
    CK(lora_gemm(b, q, ce, lin, L_XA, x, in, NULL, 0, u, r, 1.0f, 0.0f));
    return y ? lora_gemm(b, q, ce, lin, L_UB, u, r, NULL, 0, y, out, sc, 1.0f) : LOOM_OK;
}

/* backward of projection lin: dB, dA, and dx (rows, in; NULL: not wanted)
 * += d/dx of its term */
static loom_status lora_bwd(const loom_blk *b, const geo *q, const int32_t *ce, int lin,
                            const void *x, int64_t in, const void *dy, int64_t out, void *dx) {
    int64_t r;
    float sc;
    if (!loom_lora_expert(b->m, b->l, b->lin0 + lin, &r, &sc)) return LOOM_OK;
    const void *u = lora_stash(b, q, lin, r);
    void *du = b->scratch[DLU];
    CK(lora_gemm(b, q, ce, lin, L_DB, dy, out, u, r, NULL, 0, sc, 1.0f));
    CK(lora_gemm(b, q, ce, lin, L_DYB, dy, out, NULL, 0, du, r, sc, 0.0f));
    CK(lora_gemm(b, q, ce, lin, L_DA, du, r, x, in, NULL, 0, 1.0f, 1.0f));
    return dx ? lora_gemm(b, q, ce, lin, L_DUA, du, r, NULL, 0, dx, in, 1.0f, 1.0f) : LOOM_OK;
}

/* up to the down projection: g, u, act from the experts' rows xe */
static loom_status experts_front(const loom_blk *b, const geo *q, const int32_t *ce, int64_t rows) {
    void *const *a = b->act;
    CK(experts_gemm(b, q, ce, EG, true, a[XE], q->H, q->Ie, q->H, 0.0f, a[G], q->Ie));
    CK(lora_fwd(b, q, ce, LG, a[XE], q->H, a[G], q->Ie));
    CK(experts_gemm(b, q, ce, EU, true, a[XE], q->H, q->Ie, q->H, 0.0f, a[U], q->Ie));
    CK(lora_fwd(b, q, ce, LU, a[XE], q->H, a[U], q->Ie));
    return loom_k_swiglu_fwd(b->m, a[G], a[U], rows * q->Ie, a[ACT]);
}

/* ---- the shared expert: all Tc rows of h, this rank's tp share ---- */

/* g, u, act */
static loom_status shared_front(const loom_blk *b, const void *h) {
    loom_model *m = b->m;
    void *const *a = b->act;
    const int64_t H = m->H, Is = shared_width(m), Tc = m->Tc;
    CK(loom_blk_lin(b, SLG, h, Tc, H, loom_wc(m, b->w[SG]), Is, a[SHG]));
    CK(loom_blk_lin(b, SLU, h, Tc, H, loom_wc(m, b->w[SU]), Is, a[SHU]));
    return loom_k_swiglu_fwd(m, a[SHG], a[SHU], Tc * Is, a[SHACT]);
}

/* out += sigmoid(h Wsg^T) (act Wd^T), the gate's values kept; out NULL
 * (recomputed in full): the gate's values and the LoRA stashes only */
static loom_status shared_fwd(const loom_blk *b, const void *h, void *out) {
    loom_model *m = b->m;
    if (!shared_width(m)) return LOOM_OK;
    void *const *a = b->act, *const *s = b->scratch;
    const int64_t H = m->H, Is = shared_width(m), Tc = m->Tc;
    CK(loom_prof_mark(m, "moe.shared"));
    CK(shared_front(b, h));
    CK(loom_blk_lin(b, SLGATE, h, Tc, H, loom_wc(m, b->w[SGATE]), 1, s[SZ]));
    if (!out) {
        CK(loom_blk_lora_fwd(b, SLD, a[SHACT], Tc, s[SY]));
        return loom_k_moe_gate_fwd(m, s[SZ], NULL, Tc, H, false, a[SHSIG], NULL);
    }
    CK(loom_blk_lin(b, SLD, a[SHACT], Tc, Is, loom_wc(m, b->w[SD]), H, s[SY]));
    return loom_k_moe_gate_fwd(m, s[SZ], s[SY], Tc, H, true, a[SHSIG], out);
}

/* After the routed part's backward (dx holds its input gradient): ds = g dy,
 * the dense MLP's backward on ds, and the gate's dz = (1 - g) rowdot(dact,
 * act) = g (1 - g) dot(dy, act Wd^T) before the SwiGLU's backward overwrites
 * dact; dx += dg Wg + du Wu + dz Wsg (and LoRA's terms) */
static loom_status shared_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    loom_model *m = b->m;
    if (!shared_width(m)) return LOOM_OK;
    const int *w = b->w;
    void *const *a = b->act, *const *s = b->scratch;
    const int64_t H = m->H, Is = shared_width(m), Tc = m->Tc;
    void *ds = s[SY], *dg = s[SDG], *du = s[SDU], *dz = s[SZ];
    CK(loom_prof_mark(m, "moe.shared"));
    CK(loom_k_moe_gate_fwd(m, NULL, dy, Tc, H, false, a[SHSIG], ds));
    /* down: dact = ds Wd (+ LoRA's term, deferred into the one sum) */
    bool acc = false;
    loom_dx_term t[4];
    int nt = 0;
    CK(loom_blk_lora_bwd(b, SLD, a[SHACT], Tc, ds, dg, &acc, t, &nt));
    t[nt++] = loom_dx_base(ds, H, loom_wc(m, w[SD]));
    CK(loom_k_lin_dx_sum(m, Tc, Is, nt, t, acc ? 1.0f : 0.0f, dg));
    CK(loom_k_lin_dw(m, ds, a[SHACT], Tc, H, Is, 1.0f, loom_g(m, w[SD])));
    CK(loom_k_moe_gate_bwd(m, dg, a[SHACT], a[SHSIG], Tc, Is, dz));
    CK(loom_k_swiglu_bwd(m, dg, a[SHG], a[SHU], Tc * Is, dg, du));
    /* the gate's LoRA first (its du would overwrite gate and up's deferred
     * term), then theirs, up's term deferred into the sum */
    acc = true;
    nt = 0;
    CK(loom_blk_lora_bwd(b, SLGATE, h, Tc, dz, dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, SLG, h, Tc, dg, dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, SLU, h, Tc, du, dx, &acc, t, &nt));
    if (dx) {
        t[nt++] = loom_dx_base(dg, Is, loom_wc(m, w[SG]));
        t[nt++] = loom_dx_base(du, Is, loom_wc(m, w[SU]));
        t[nt++] = loom_dx_base(dz, 1, loom_wc(m, w[SGATE]));
        CK(loom_k_lin_dx_sum(m, Tc, H, nt, t, 1.0f, dx));
    }
    CK(loom_k_lin_dw(m, dg, h, Tc, Is, H, 1.0f, loom_g(m, w[SG])));
    CK(loom_k_lin_dw(m, du, h, Tc, Is, H, 1.0f, loom_g(m, w[SU])));
    return loom_k_lin_dw(m, dz, h, Tc, 1, H, 1.0f, loom_g(m, w[SGATE]));
}

/* ---- forward, recomputation, backward ---- */

/* Where the micro-batch's z-loss sums are in its block: [sum of lse^2, rows],
 * over all its MoE layers, after the load-balancing loss's blocks. */
static size_t z_sums_at(const loom_model *m) { return loom_moe_aux_len(m) - 3; }

/* The layer's z-loss sums into the micro-batch's block (its rows' lse^2 in
 * double, in row order). */
static loom_status z_sums(const loom_blk *b, const geo *q, const hs *hh) {
    CK(loom_k_download(b->m, hh->lse, b->act[LSE], (size_t)q->n * sizeof(float)));
    double s = 0.0;
    for (int64_t t = 0; t < q->n; t++) s += (double)hh->lse[t] * hh->lse[t];
    double *acc = b->mb->aux + z_sums_at(b->m);
    acc[0] += s, acc[1] += (double)q->n;
    return LOOM_OK;
}

/* The experts' rows xe from the routing (and, not local, the table): the
 * rows of h grouped by expert, dispatched; *rows and h->ce set. */
static loom_status gather_rows(const loom_blk *b, const geo *q, const hs *hh, const void *h,
                               int64_t *rows) {
    loom_model *m = b->m;
    void *const *a = b->act;
    const void *hs0 = (const char *)h + (size_t)(q->o0 * q->H) * m->dev.esz;
    if (q->local) {
        memcpy(hh->ce, hh->cnt, (size_t)q->E * sizeof *hh->ce);
        *rows = table_rows(q, hh->cnt);
        return loom_k_moe_permute(m, hs0, a[ORD], q->n, q->k, q->H, a[XE]);
    }
    if (dedup_on(q)) {
        CK(loom_moe_regroup_orders(b, q, hh, rows));
        return loom_moe_dd_dispatch(b, q, hh, hs0, b->scratch[S1], b->scratch[S2], b->scratch[S3],
                                    a[XE]);
    }
    CK(loom_k_moe_permute(m, hs0, a[ORD], q->n, q->k, q->H, b->scratch[S1]));
    CK(loom_moe_regroup_orders(b, q, hh, rows));
    return loom_moe_dispatch(b, q, hh, b->scratch[S1], a[XE], b->scratch[S2], *rows);
}

/* The host copies of the layer's counts (kept) and table: the forward's
 * (moe_tabs.h), else downloaded. */

static loom_status tables_host(const loom_blk *b, const geo *q, const hs *h) {
    if (loom_moe_tabs_get(b->m->moe_tabs, b->l, b->act[CNT], h->cnt, q->E, h->rc, table_len(q)))
        return LOOM_OK;
    CK(loom_k_download(b->m, h->cnt, b->act[CNT], (size_t)q->E * sizeof(int32_t)));
    keep_counts(q, h->cnt);
    if (q->local) return LOOM_OK;
    if (dedup_on(q)) /* its row counts are the forward's only */
        return loom_errf(b->m->ctx, LOOM_ERR_INTERNAL, "MoE layer %lld: its forward's routing "
                         "tables were not kept", (long long)b->l);
    return loom_k_download(b->m, h->rc, b->act[RC], (size_t)rc_len(q) * sizeof(int32_t));
}

/* The forced balance's router logits (benchmarks; loom.h): a stream per
 * layer, value (token's index in the global batch, expert), so every mesh
 * without cp draws the same; cp ranks, whose rows are not one run of the
 * batch, draw from their own. */
static loom_status random_logits(const loom_blk *b, const geo *q, void *z) {
    const loom_model *m = b->m;
    const uint64_t key = ((uint64_t)b->l << 8) ^ (m->cp > 1 ? (uint64_t)m->mesh->cp_rank + 1 : 0);
    const uint64_t base = loom_rng_base(0x6d6f652d72616e64ull, key) +
                          (uint64_t)((b->mb->key0 + q->o0) * q->E);
    return loom_k_fill_randn(b->m, z, q->n * q->E, base);
}

/* The forward run again under full recomputation (out NULL): the kept
 * routing and the forward's host tables, the rows dispatched again, the
 * experts' buffers and outputs, the shared expert's. */
static loom_status moe_refwd(const loom_blk *b, const void *h) {
    loom_model *m = b->m;
    const geo q = geometry(m, m->Tc);
    const hs hh = host_of(b);
    int64_t rows;
    CK(loom_prof_mark(m, "moe.dispatch"));
    CK(tables_host(b, &q, &hh));
    CK(gather_rows(b, &q, &hh, h, &rows));
    CK(loom_prof_mark(m, "moe.experts"));
    CK(experts_front(b, &q, hh.ce, rows));
    const bool dd = dedup_on(&q);
    void *ye = q.local || dd ? b->act[YS] : b->scratch[S1];
    CK(experts_gemm(b, &q, hh.ce, ED, true, b->act[ACT], q.Ie, q.H, q.Ie, 0.0f, ye, q.H));
    CK(lora_fwd(b, &q, hh.ce, LD, b->act[ACT], q.Ie, ye, q.H));
    if (!q.local && !dd) {
        CK(loom_prof_mark(m, "moe.combine"));
        CK(loom_moe_undispatch(b, &q, &hh, ye, b->act[YS], b->scratch[S2], rows));
    }
    return shared_fwd(b, h, NULL);
}

static loom_status moe_fwd(const loom_blk *b, const void *h, void *out) {
    loom_model *m = b->m;
    if (!out && m->recompute == LOOM_RECOMPUTE_FULL) return moe_refwd(b, h);
    void *const *a = b->act;
    const geo q = geometry(m, m->Tc);
    const hs hh = host_of(b);
    const size_t esz = m->dev.esz;
    void *z = b->scratch[Z];
    float *psum = (float *)((char *)b->scratch[PSUM] + psum_at(q.E));
    const void *hs0 = (const char *)h + (size_t)(q.o0 * q.H) * esz;
    CK(loom_prof_mark(m, "moe.router"));
    CK(loom_blk_lin(b, LROUTER, hs0, q.n, q.H, loom_wc(m, b->w[ROUTER]), q.E, z));
    if (m->moe_force_balance) CK(random_logits(b, &q, z));
    CK(loom_k_zero(m, psum, (size_t)q.E * sizeof(float)));
    const bool zl = m->moe_z_coef > 0.0;
    CK(loom_k_moe_router_fwd(m, z, q.n, q.E, q.k, m->cfg.norm_topk_prob, a[PROBS], a[IDX], a[WT],
                             psum, zl ? a[LSE] : NULL));
    CK(loom_k_moe_route(m, a[IDX], a[WT], q.n, q.E, q.k, q.cap,
                        m->moe_drop == LOOM_MOE_DROP_POSITION, a[CNT], a[ORD], a[POS]));
    /* the counts and the probability sums (the load-balancing loss's, once
     * per forward, not when recomputed), and the dispatch's table when it
     * travels on the device: one download */
    const bool dev_tab = tables_on_device(&q);
    CK(loom_prof_mark(m, "moe.counts (host wait)"));
    if (dedup_on(&q)) /* the table with the plan's counts */
        CK(loom_moe_dd_plan(b, &q, &hh));
    else if (dev_tab)
        CK(loom_moe_exchange_counts_dev(b, &q));
    if ((char *)hh.psum != (char *)hh.cnt + psum_at(q.E) ||
        (!q.local && (char *)hh.rc != (char *)hh.cnt + rc_at(q.E)))
        return loom_errf(m->ctx, LOOM_ERR_INTERNAL, "MoE host tables: not laid out as PSUM");
    const size_t tab = (size_t)table_len(&q) * sizeof(int32_t);
    CK(loom_k_copy(m, b->scratch[PSUM], a[CNT], (size_t)q.E * sizeof(int32_t)));
    const size_t rcb = (size_t)rc_len(&q) * sizeof(int32_t);
    if (dev_tab) CK(loom_k_copy(m, (char *)b->scratch[PSUM] + rc_at(q.E), a[RC], rcb));
    CK(loom_k_download(m, hh.cnt, b->scratch[PSUM],
                       dev_tab ? rc_at(q.E) + tab : psum_at(q.E) + (size_t)q.E * sizeof(float)));
    if (out && b->mb->aux) {
        /* the layer's own block per layer (Megatron's), else one for all */
        double *acc = b->mb->aux + (m->moe_aux == LOOM_MOE_AUX_PER_LAYER ? b->l * (2 * q.E + 1) : 0);
        for (int64_t e = 0; e < q.E; e++) acc[e] += hh.cnt[e], acc[q.E + e] += hh.psum[e];
        acc[2 * q.E] += (double)q.n;
        if (zl) CK(z_sums(b, &q, &hh));
    }
    keep_counts(&q, hh.cnt); /* from here the experts' rows */
    /* the step's tokens per expert: each rank its own tokens (local: all
     * tp ranks route the same ones, tp rank 0 counts) */
    if (out && m->training && m->moe_load && (!q.local || m->mesh->tp_rank == 0))
        for (int64_t e = 0; e < q.E; e++) m->moe_load[b->l * q.E + e] += hh.cnt[e];
    if (!q.local && !dev_tab) {
        CK(loom_moe_exchange_counts(m, &q, &hh));
        CK(loom_k_upload(m, a[RC], hh.rc, rcb));
    }
    CK(loom_moe_tabs_put(m->ctx, &m->moe_tabs, m->L, b->l, a[CNT], hh.cnt, q.E, hh.rc,
                         table_len(&q)));
    int64_t rows;
    CK(loom_prof_mark(m, "moe.dispatch"));
    CK(gather_rows(b, &q, &hh, h, &rows));
    CK(loom_prof_mark(m, "moe.experts"));
    CK(experts_front(b, &q, hh.ce, rows));
    const bool dd = dedup_on(&q);
    void *ye = q.local || dd ? a[YS] : b->scratch[S1];
    CK(experts_gemm(b, &q, hh.ce, ED, true, a[ACT], q.Ie, q.H, q.Ie, 0.0f, ye, q.H));
    CK(lora_fwd(b, &q, hh.ce, LD, a[ACT], q.Ie, ye, q.H));
    CK(loom_prof_mark(m, "moe.combine"));
    if (!q.local && !dd) CK(loom_moe_undispatch(b, &q, &hh, ye, a[YS], b->scratch[S2], rows));
    if (!out) return shared_fwd(b, h, NULL);
    if (!q.local) CK(loom_k_zero(m, out, (size_t)(m->Tc * q.H) * esz));
    void *o = (char *)out + (size_t)(q.o0 * q.H) * esz;
    if (dd)
        CK(loom_moe_dd_combine(b, &q, &hh, a[YS], b->scratch[S1], b->scratch[S2], o));
    else
        CK(loom_k_moe_combine(m, a[YS], a[POS], a[WT], q.n, q.k, q.H, o));
    return shared_fwd(b, h, out);
}

/* selective recomputation: the experts' rows and buffers from h and the
 * kept routing, and the shared expert's */
static loom_status moe_recompute(const loom_blk *b, const void *h) {
    const geo q = geometry(b->m, b->m->Tc);
    const hs hh = host_of(b);
    int64_t rows;
    CK(loom_prof_mark(b->m, "moe.dispatch"));
    CK(tables_host(b, &q, &hh));
    CK(gather_rows(b, &q, &hh, h, &rows));
    CK(loom_prof_mark(b->m, "moe.experts"));
    CK(experts_front(b, &q, hh.ce, rows));
    CK(lora_fwd(b, &q, hh.ce, LD, b->act[ACT], q.Ie, NULL, q.H)); /* the down's stash */
    return shared_width(b->m) ? shared_front(b, h) : LOOM_OK;
}

static loom_status moe_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    loom_model *m = b->m;
    void *const *a = b->act;
    void *const *s = b->scratch;
    const geo q = geometry(m, m->Tc);
    const hs hh = host_of(b);
    const size_t esz = m->dev.esz;
    const size_t so = (size_t)(q.o0 * q.H) * esz;
    CK(loom_prof_mark(m, "moe.combine"));
    CK(tables_host(b, &q, &hh));
    int64_t rows = table_rows(&q, hh.cnt);
    if (q.local)
        memcpy(hh.ce, hh.cnt, (size_t)q.E * sizeof *hh.ce);
    else
        CK(loom_moe_regroup_orders(b, &q, &hh, &rows));
    /* combine: dys = w dy per choice, dw = dy . ys; then to the experts */
    void *dye = s[S3];
    const bool dd = dedup_on(&q);
    if (dd) { /* dy once per rank, times each choice's weight there */
        CK(loom_moe_dd_dispatch_bwd(b, &q, &hh, (const char *)dy + so, s[S1], s[S2], dye));
    } else {
        CK(loom_k_moe_combine_bwd(m, (const char *)dy + so, a[YS], a[ORD], a[WT], q.n, q.k, q.H,
                                  q.local ? dye : s[S1], s[DW]));
        if (!q.local) CK(loom_moe_dispatch(b, &q, &hh, s[S1], dye, s[S2], rows));
    }
    /* down: dact = dye Wd, dWd += dye^T act */
    CK(loom_prof_mark(m, "moe.experts"));
    CK(experts_dw(b, &q, hh.ce, ED, dye, q.H, a[ACT], q.Ie));
    CK(experts_gemm(b, &q, hh.ce, ED, false, dye, q.H, q.Ie, q.H, 0.0f, s[DG], q.Ie));
    CK(lora_bwd(b, &q, hh.ce, LD, a[ACT], q.Ie, dye, q.H, s[DG]));
    CK(loom_k_swiglu_bwd(m, s[DG], a[G], a[U], rows * q.Ie, s[DG], s[DU]));
    CK(experts_dw(b, &q, hh.ce, EG, s[DG], q.Ie, a[XE], q.H));
    CK(experts_dw(b, &q, hh.ce, EU, s[DU], q.Ie, a[XE], q.H));
    /* dxe = dg Wg + du Wu (and LoRA's terms), back to the tokens' ranks,
     * summed per token */
    void *dxe = dx ? s[S1] : NULL;
    if (dx) {
        CK(experts_gemm(b, &q, hh.ce, EG, false, s[DG], q.Ie, q.H, q.Ie, 0.0f, dxe, q.H));
        CK(experts_gemm(b, &q, hh.ce, EU, false, s[DU], q.Ie, q.H, q.Ie, 1.0f, dxe, q.H));
    }
    CK(lora_bwd(b, &q, hh.ce, LG, a[XE], q.H, s[DG], q.Ie, dxe));
    CK(lora_bwd(b, &q, hh.ce, LU, a[XE], q.H, s[DU], q.Ie, dxe));
    CK(loom_prof_mark(m, "moe.dispatch"));
    if (dd) { /* summed per received row on the experts' rank, then per rank; with them
               * the routing weights' gradients */
        if (dx) CK(loom_k_zero(m, dx, (size_t)(m->Tc * q.H) * esz));
        CK(loom_moe_dd_return_dx(b, &q, &hh, dxe, s[S3], s[S2], dx ? (char *)dx + so : NULL,
                                 s[DW]));
    } else if (dx) {
        void *dxs = dxe;
        if (!q.local) {
            CK(loom_moe_undispatch(b, &q, &hh, dxe, s[S2], s[S3], rows));
            dxs = s[S2];
        }
        if (!q.local) CK(loom_k_zero(m, dx, (size_t)(m->Tc * q.H) * esz));
        CK(loom_k_moe_permute_bwd(m, dxs, a[POS], q.n, q.k, q.H, (char *)dx + so));
    }
    /* router: dz from the choices' weights, the load-balancing loss and the
     * z-loss (their part once: local, tp rank 0's; else each rank its own
     * tokens) */
    const float *ga = !q.local || m->mesh->tp_rank == 0 ? b->mb->d_aux_g : NULL;
    const float *zc = ga ? b->mb->d_aux_g + loom_moe_grad_len(m) - 1 : NULL;
    if (ga && m->moe_aux == LOOM_MOE_AUX_PER_LAYER) ga += b->l * q.E; /* the layer's own */
    const void *hs0 = (const char *)h + so;
    CK(loom_prof_mark(m, "moe.router"));
    CK(loom_k_moe_router_bwd(m, a[PROBS], a[IDX], s[DW], ga,
                             zc && m->moe_z_coef > 0.0 ? a[LSE] : NULL, zc, q.n, q.E, q.k,
                             m->cfg.norm_topk_prob, s[Z]));
    /* forced balance: the logits were drawn, not computed (the GEMMs still run) */
    if (m->moe_force_balance) CK(loom_k_zero(m, s[Z], (size_t)(q.n * q.E) * esz));
    CK(loom_k_lin_dw(m, s[Z], hs0, q.n, q.E, q.H, 1.0f, loom_g(m, b->w[ROUTER])));
    bool acc = true; /* dx holds the experts' part */
    CK(loom_blk_lora_bwd(b, LROUTER, hs0, q.n, s[Z], dx ? (char *)dx + so : NULL, &acc, NULL,
                         NULL));
    if (dx)
        CK(loom_k_lin_dx(m, s[Z], q.n, q.E, loom_wc(m, b->w[ROUTER]), q.H, 1.0f, 1.0f,
                         (char *)dx + so));
    return shared_bwd(b, h, dy, dx);
}

const loom_block_kind loom_block_moe = {
    .name = "moe",
    .id = LOOM_KIND_MOE,
    .norm = "post_attention_layernorm.weight",
    .slots = slots,
    .nslots = NSLOT,
    .lin = linears,
    .nlin = NLIN,
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

/* The sums: GLOBAL, one block [C (E), P (E), N] for all layers; PER_LAYER,
 * one per layer (l at l (2E + 1)); then the z-loss's two (z_sums_at), then
 * the micro-batch's targets. */
size_t loom_moe_aux_len(const loom_model *m) {
    const int64_t E = m->cfg.num_experts;
    if (E <= 0) return 0;
    const int64_t blocks = m->moe_aux == LOOM_MOE_AUX_PER_LAYER ? m->L : 1;
    return (size_t)(blocks * (2 * E + 1) + 3);
}

/* The gradient: per expert (per layer under PER_LAYER), then the z-loss's
 * factor zc (d loss / d lse = zc lse for every router row). */
size_t loom_moe_grad_len(const loom_model *m) {
    const int64_t E = m->cfg.num_experts;
    if (E <= 0) return 0;
    return (size_t)((m->moe_aux == LOOM_MOE_AUX_PER_LAYER ? m->L : 1) * E + 1);
}

loom_status loom_moe_finish(loom_model *m, loom_micro *mb, bool backward, double *loss_sum) {
    *loss_sum = 0.0;
    double *acc = mb->aux;
    if (!acc) return LOOM_OK;
    const int64_t E = m->cfg.num_experts, k = m->cfg.num_experts_per_tok;
    const size_t n = loom_moe_aux_len(m);
    int64_t ntgt = 0;
    for (int64_t t = 0; t < m->Tc; t++) ntgt += mb->tgt[t] != -100;
    /* the micro-batch's tokens are split over cp, and (not local) over tp:
     * each rank routes its own */
    const bool local = geometry(m, m->Tc).local;
    acc[n - 1] = (double)ntgt * (local || m->mesh->tp_rank == 0 ? 1.0 : 0.0);
    loom_comm *grp = local ? m->mesh->cp : m->mesh->tpcp;
    if (loom_comm_size(grp) > 1) CK(loom_comm_allreduce(grp, acc, n, LOOM_F64, LOOM_RED_SUM));
    const double coef = m->cfg.router_aux_loss_coef;
    /* the step divides the summed losses by the targets of the batch: the
     * micro-batch's term is coef aux times its own targets, so one
     * micro-batch gives transformers' loss + coef aux exactly */
    const double scale = coef * acc[n - 1];
    const bool per_layer = m->moe_aux == LOOM_MOE_AUX_PER_LAYER;
    const int64_t blocks = per_layer ? m->L : 1;
    double aux = 0.0;
    for (int64_t l = 0; l < blocks; l++) {
        const double *a = acc + l * (2 * E + 1), N = a[2 * E];
        /* d aux / d probs[n][e] = w C_e with w = E / N^2 (global), E / (k N^2) (per layer) */
        const double w = N > 0 ? (double)E / (N * N) / (per_layer ? (double)k : 1.0) : 0.0;
        for (int64_t e = 0; e < E; e++) aux += w * a[e] * a[E + e];
        for (int64_t e = 0; backward && e < E; e++)
            mb->aux_g[l * E + e] = (float)(m->loss_scale * scale * w * a[e]);
    }
    mb->aux_loss = aux;
    /* the z-loss: every MoE layer routes the micro-batch's rows, so each
     * one's mean is the sums' over nl layers' rows / nl; d/dlse = 2 lse / N */
    int64_t nl = 0;
    for (int64_t l = 0; l < m->L; l++) nl += loom_config_layer_is_moe(&m->cfg, l);
    const double *zs = acc + z_sums_at(m), zn = nl ? zs[1] / (double)nl : 0.0;
    const double zcoef = m->moe_z_coef * acc[n - 1];
    mb->z_loss = zn > 0 ? zs[0] / zn : 0.0;
    if (backward)
        mb->aux_g[loom_moe_grad_len(m) - 1] =
            zn > 0 ? (float)(m->loss_scale * zcoef * 2.0 / zn) : 0.0f;
    if (m->mesh->cp_rank == 0 && m->mesh->tp_rank == 0)
        *loss_sum = scale * aux + zcoef * mb->z_loss;
    if (!backward) return LOOM_OK;
    return loom_k_upload(m, mb->d_aux_g, mb->aux_g, loom_moe_grad_len(m) * sizeof(float));
}
