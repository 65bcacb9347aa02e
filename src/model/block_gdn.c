/* Qwen3.5's linear-attention block (block.h's kind "linear attention"):
 * the Gated DeltaNet of transformers' Qwen3_5GatedDeltaNet.
 *
 *   qkv = h Wqkv^T                       q, k (Hk heads of dk), v (Hv heads of dv)
 *   qkv = silu(causal_conv1d(qkv))       depthwise, kernel K, per document
 *   z = h Wz^T; b = h Wb^T; a = h Wa^T   the output gate, beta and decay inputs
 *   beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)
 *   o = gated_delta_rule(l2norm(q) / sqrt(dk), l2norm(k), v, g, beta)
 *                                        the key heads repeated to the value heads
 *   out = (w rmsnorm(o) silu(z)) Wout^T  per value head
 *
 * Tensor parallelism splits the heads, as attention's: a rank holds Hk/tp
 * key heads and Hv/tp value heads (value head h still reads key head
 * h / (Hv / Hk)), so in_proj_qkv and the conv weight, whose rows are the
 * q, k and v channels fused, split each of the three parts over tp on its
 * own (loom_param_put_parts); z, b, a, A_log and dt_bias by rows, out_proj
 * by columns, the gated norm's weight replicated (its gradient a partial
 * sum over tp).
 *
 * Context parallelism (a rank holds Tc of the micro-batch's T tokens, two
 * chunks of each sequence): the rule and the convolution run along whole
 * sequences, so the projections' qkv and the gates g, beta are all-gathered
 * over cp and every rank runs the convolution and the rule on the whole
 * micro-batch, keeping its own tokens' outputs; the projections, the gated
 * norm and out_proj (most of the work) stay split. Backward: this rank's
 * output gradients, zero elsewhere, through the whole rule and convolution,
 * then the q, k, v and gate gradients reduce-scattered over cp (each rank's
 * share of the sums, as attention's keys and values); the conv weight's
 * gradient from those shares is a partial sum that the gradients' reduction
 * over cp completes. The rule's work is repeated on every cp rank (it is
 * linear in T and small beside the projections; passing the state between
 * ranks would not repeat it). The conv1d weight, [C, 1, K] in the
 * checkpoint, is (C, K) here (export.c presents it so). Kept for the
 * backward: the projections' outputs, the convolution's, the gates, the
 * rule's output, the norm's rstd and output (out_proj's input), and where
 * the backend keeps (gdn_ws.h: CUDA in bf16, dk <= 128) the rule's keep
 * buffer: its chunks' inverses, states, W, U and U0, which its backward
 * reads instead of running those passes again, with room for documents
 * of 128 tokens on average (a micro-batch of shorter ones goes without:
 * its backward recomputes them, as the CPU's always does). */
#include "../backend/gdn_ws.h"
#include "block.h"
#include "model.h"

enum { WQKV, WZ, WB, WA, CONV, ALOG, DTB, NORMW, WOUT, NSLOT };
enum { LQKV, LZ, LB, LA, LOUT, NLIN };

static const loom_block_slot slots[NSLOT] = {
    [WQKV] = {"linear_attn.in_proj_qkv.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [WZ] = {"linear_attn.in_proj_z.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [WB] = {"linear_attn.in_proj_b.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [WA] = {"linear_attn.in_proj_a.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [CONV] = {"linear_attn.conv1d.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [ALOG] = {"linear_attn.A_log", LOOM_COMP_ATTN, LOOM_SHARD_ROWS, .init = LOOM_INIT_LOG_U16},
    [DTB] = {"linear_attn.dt_bias", LOOM_COMP_ATTN, LOOM_SHARD_ROWS, .init = LOOM_INIT_ONES},
    [NORMW] = {"linear_attn.norm.weight", LOOM_COMP_ATTN, LOOM_SHARD_NONE, true, LOOM_INIT_ONES},
    [WOUT] = {"linear_attn.out_proj.weight", LOOM_COMP_ATTN, LOOM_SHARD_COLS},
};

/* qkv and z read h (one LoRA group), b and a too (another: named only) */
static const loom_block_linear linears[NLIN] = {
    [LQKV] = {"linear_attn", "in_proj_qkv", WQKV, LQKV},
    [LZ] = {"linear_attn", "in_proj_z", WZ, LQKV},
    [LB] = {"linear_attn", "in_proj_b", WB, LB, .named = true},
    [LA] = {"linear_attn", "in_proj_a", WA, LB, .named = true},
    [LOUT] = {"linear_attn", "out_proj", WOUT, LOUT},
};

static loom_status gdn_params(const loom_model_config *c, int64_t l, loom_param_sink *s) {
    (void)l;
    const int64_t H = c->hidden_size, hk = c->lin_k_heads * c->lin_k_dim;
    const int64_t hv = c->lin_v_heads * c->lin_v_dim, qkv[3] = {hk, hk, hv};
    loom_param_put_parts(s, WQKV, H, 3, qkv);
    loom_param_put(s, WZ, hv, H);
    loom_param_put(s, WB, c->lin_v_heads, H);
    loom_param_put(s, WA, c->lin_v_heads, H);
    loom_param_put_parts(s, CONV, c->lin_conv_kernel, 3, qkv);
    loom_param_put(s, ALOG, c->lin_v_heads, 0);
    loom_param_put(s, DTB, c->lin_v_heads, 0);
    loom_param_put(s, NORMW, c->lin_v_dim, 0);
    loom_param_put(s, WOUT, H, hv);
    return LOOM_OK;
}

/* activations per layer (PRE, QKV, G, BETA of the whole micro-batch: T
 * rows under cp), scratch (the last ones only under cp: this rank's
 * projections and gates before the exchange, the whole micro-batch's
 * output and gradients, the exchange's blocks) */
enum { PRE, QKV, Z, A, B, G, BETA, O, RSTD, Y, KEEP, NBUF };
enum { DY, DO, DZ, DQKV, DPRE, DG, DBETA, DA, DB, PL, GL, BL, OF, DOF, DQF, DPF, DGF, DBF, XBLK,
       NSCRATCH };

/* the sizes of a layer on this rank (its heads of tp): key and value
 * widths, the conv's channels */
typedef struct gdims {
    int64_t Hk, Hv, dk, dv, hv, C, K;
} gdims;

static gdims dims(const loom_model *m) {
    const loom_model_config *c = &m->cfg;
    gdims d = {c->lin_k_heads / m->tp, c->lin_v_heads / m->tp, c->lin_k_dim, c->lin_v_dim, 0, 0,
               c->lin_conv_kernel};
    d.hv = d.Hv * d.dv;
    d.C = 2 * d.Hk * d.dk + d.hv;
    return d;
}

/* The rule's keep buffer for micro-batches of T tokens (0: none). */
static size_t keep_bytes(const loom_model *m, const gdims *d, int64_t T) {
    const int tc = m->dev.cuda && loom_gdn_ws_tc(m->dev.adt, d->dk);
    return loom_gdn_keep_bytes(T, d->Hk, d->Hv, d->dk, d->dv, tc, loom_gdn_keep_chunks(T));
}

static loom_status gdn_fwd(const loom_blk *b, const void *h, void *out) {
    loom_model *m = b->m;
    const int *w = b->w;
    void *const *a = b->act, *const *sc = b->scratch;
    const gdims d = dims(m);
    const int64_t H = m->H, Tc = m->Tc, T = m->T;
    const int32_t *cu = b->mb->d_cu;
    const int64_t nd = b->mb->ndocs;
    const bool cpx = m->cp > 1; /* the whole micro-batch's rows apart from this rank's */
    void *pre = cpx ? sc[PL] : a[PRE], *g = cpx ? sc[GL] : a[G], *be = cpx ? sc[BL] : a[BETA];
    void *o = cpx ? sc[OF] : a[O];
    CK(loom_blk_lin(b, LQKV, h, Tc, H, loom_wc(m, w[WQKV]), d.C, pre));
    CK(loom_blk_lin(b, LZ, h, Tc, H, loom_wc(m, w[WZ]), d.hv, a[Z]));
    CK(loom_blk_lin(b, LB, h, Tc, H, loom_wc(m, w[WB]), d.Hv, a[B]));
    CK(loom_blk_lin(b, LA, h, Tc, H, loom_wc(m, w[WA]), d.Hv, a[A]));
    CK(loom_k_gdn_gate_fwd(m, a[A], a[B], loom_wc(m, w[ALOG]), loom_wc(m, w[DTB]), Tc, d.Hv, g,
                           be));
    if (cpx) {
        CK(loom_cp_gather(m, pre, d.C, m->dev.adt, a[PRE], sc[XBLK]));
        CK(loom_cp_gather(m, g, d.Hv, LOOM_F32, a[G], sc[XBLK]));
        CK(loom_cp_gather(m, be, d.Hv, LOOM_F32, a[BETA], sc[XBLK]));
    }
    CK(loom_k_gdn_conv_fwd(m, a[PRE], loom_wc(m, w[CONV]), T, d.C, d.K, cu, nd, a[QKV]));
    CK(loom_k_gdn_fwd(m, a[QKV], a[G], a[BETA], T, d.Hk, d.Hv, d.dk, d.dv, cu, nd, o, a[KEEP],
                      loom_gdn_keep_chunks(T)));
    if (cpx) CK(loom_cp_take(m, o, d.hv, a[O]));
    CK(loom_k_gdn_norm_fwd(m, a[O], a[Z], loom_wc(m, w[NORMW]), Tc * d.Hv, d.dv,
                           (float)m->cfg.rms_norm_eps, a[Y], a[RSTD]));
    if (!out) return loom_blk_lora_fwd(b, LOUT, a[Y], Tc, m->dtmp);
    return loom_blk_lin(b, LOUT, a[Y], Tc, d.hv, loom_wc(m, w[WOUT]), H, out);
}

#define DW(dy, x, T, out, in, dW) CK(loom_k_lin_dw(m, dy, x, T, out, in, 1.0f, dW))

static loom_status gdn_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    loom_model *m = b->m;
    const int *w = b->w;
    void *const *a = b->act, *const *sc = b->scratch;
    const gdims d = dims(m);
    const int64_t H = m->H, Tc = m->Tc, T = m->T;
    const int32_t *cu = b->mb->d_cu;
    const int64_t nd = b->mb->ndocs;
    const bool cpx = m->cp > 1;
    void *dof = cpx ? sc[DOF] : sc[DO], *dq = cpx ? sc[DQF] : sc[DQKV];
    void *dp = cpx ? sc[DPF] : sc[DPRE], *dg = cpx ? sc[DGF] : sc[DG];
    void *db = cpx ? sc[DBF] : sc[DBETA];
    /* out_proj: d of the gated norm's output */
    bool acc = false;
    loom_dx_term t[4];
    int nt = 0;
    CK(loom_blk_lora_bwd(b, LOUT, a[Y], Tc, dy, sc[DY], &acc, t, &nt));
    t[nt++] = loom_dx_base(dy, H, loom_wc(m, w[WOUT]));
    CK(loom_k_lin_dx_sum(m, Tc, d.hv, nt, t, acc ? 1.0f : 0.0f, sc[DY]));
    DW(dy, a[Y], Tc, H, d.hv, loom_g(m, w[WOUT]));
    /* the gated norm, the rule, the gates, the convolution */
    CK(loom_k_gdn_norm_bwd(m, sc[DY], a[O], a[Z], loom_wc(m, w[NORMW]), a[RSTD], Tc * d.Hv,
                           d.dv, sc[DO], sc[DZ], loom_g(m, w[NORMW])));
    if (cpx) CK(loom_cp_place(m, sc[DO], d.hv, dof));
    CK(loom_k_gdn_bwd(m, dof, a[QKV], a[G], a[BETA], T, d.Hk, d.Hv, d.dk, d.dv, cu, nd, dq, dg,
                      db, a[KEEP], loom_gdn_keep_chunks(T)));
    CK(loom_k_gdn_conv_bwd(m, dq, a[PRE], loom_wc(m, w[CONV]), T, d.C, d.K, cu, nd, dp,
                           loom_g(m, w[CONV])));
    if (cpx) {
        CK(loom_cp_reduce(m, dp, d.C, m->dev.adt, sc[DPRE], sc[XBLK]));
        CK(loom_cp_reduce(m, dg, d.Hv, LOOM_F32, sc[DG], sc[XBLK]));
        CK(loom_cp_reduce(m, db, d.Hv, LOOM_F32, sc[DBETA], sc[XBLK]));
    }
    CK(loom_k_gdn_gate_bwd(m, sc[DG], sc[DBETA], a[A], a[B], loom_wc(m, w[ALOG]),
                           loom_wc(m, w[DTB]), Tc, d.Hv, sc[DA], sc[DB], loom_g(m, w[ALOG]),
                           loom_g(m, w[DTB])));
    /* the four projections of h: LoRA's terms, then the base's two at a
     * time (qkv and z, then b and a) */
    acc = false;
    nt = 0;
    CK(loom_blk_lora_bwd(b, LQKV, h, Tc, sc[DPRE], dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, LZ, h, Tc, sc[DZ], dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, LB, h, Tc, sc[DB], dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, LA, h, Tc, sc[DA], dx, &acc, t, &nt));
    if (dx) {
        t[nt++] = loom_dx_base(sc[DPRE], d.C, loom_wc(m, w[WQKV]));
        t[nt++] = loom_dx_base(sc[DZ], d.hv, loom_wc(m, w[WZ]));
        CK(loom_k_lin_dx_sum(m, Tc, H, nt, t, acc ? 1.0f : 0.0f, dx));
        const loom_dx_term ab[2] = {loom_dx_base(sc[DB], d.Hv, loom_wc(m, w[WB])),
                                    loom_dx_base(sc[DA], d.Hv, loom_wc(m, w[WA]))};
        CK(loom_k_lin_dx_sum(m, Tc, H, 2, ab, 1.0f, dx));
    }
    DW(sc[DPRE], h, Tc, d.C, H, loom_g(m, w[WQKV]));
    DW(sc[DZ], h, Tc, d.hv, H, loom_g(m, w[WZ]));
    DW(sc[DB], h, Tc, d.Hv, H, loom_g(m, w[WB]));
    DW(sc[DA], h, Tc, d.Hv, H, loom_g(m, w[WA]));
    return LOOM_OK;
}

static int gdn_acts(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out) {
    (void)Tn;
    const size_t e = m->dev.esz, f = sizeof(float);
    const bool any = loom_config_linear_layers(&m->cfg) > 0;
    const gdims d = dims(m);
    out[PRE].bytes = out[QKV].bytes = any ? (size_t)(T * d.C) * e : 0;
    out[Z].bytes = out[O].bytes = out[Y].bytes = any ? (size_t)(Tc * d.hv) * e : 0;
    out[A].bytes = out[B].bytes = any ? (size_t)(Tc * d.Hv) * e : 0;
    out[G].bytes = out[BETA].bytes = any ? (size_t)(T * d.Hv) * f : 0;
    out[RSTD].bytes = any ? (size_t)(Tc * d.Hv) * f : 0;
    out[KEEP].bytes = any ? keep_bytes(m, &d, T) : 0;
    return NBUF; /* all kept under selective recomputation */
}

static int gdn_scratch(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes) {
    const size_t e = m->dev.esz, f = sizeof(float);
    const bool any = loom_config_linear_layers(&m->cfg) > 0, cpx = any && m->cp > 1;
    const gdims d = dims(m);
    bytes[DY] = bytes[DO] = bytes[DZ] = any ? (size_t)(Tc * d.hv) * e : 0;
    bytes[DQKV] = bytes[DPRE] = any ? (size_t)(Tc * d.C) * e : 0;
    bytes[DG] = bytes[DBETA] = any ? (size_t)(Tc * d.Hv) * f : 0;
    bytes[DA] = bytes[DB] = any ? (size_t)(Tc * d.Hv) * e : 0;
    bytes[PL] = cpx ? (size_t)(Tc * d.C) * e : 0;
    bytes[GL] = bytes[BL] = cpx ? (size_t)(Tc * d.Hv) * f : 0;
    bytes[OF] = bytes[DOF] = cpx ? (size_t)(T * d.hv) * e : 0;
    bytes[DQF] = bytes[DPF] = cpx ? (size_t)(T * d.C) * e : 0;
    bytes[DGF] = bytes[DBF] = cpx ? (size_t)(T * d.Hv) * f : 0;
    const size_t xb = (size_t)(T * d.C) * e, xg = (size_t)(T * d.Hv) * f;
    bytes[XBLK] = cpx ? (xb > xg ? xb : xg) : 0;
    return NSCRATCH;
}

const loom_block_kind loom_block_gdn = {
    .name = "linear attention",
    .id = LOOM_KIND_GDN,
    .norm = "input_layernorm.weight",
    .slots = slots,
    .nslots = NSLOT,
    .lin = linears,
    .nlin = NLIN,
    .out_bias = -1,
    .params = gdn_params,
    .acts = gdn_acts,
    .scratch = gdn_scratch,
    .fwd = gdn_fwd,
    .bwd = gdn_bwd,
};
