/* The attention block (block.h's kind "attention"):
 *
 *   q,k,v = h Wq^T, h Wk^T, h Wv^T (+b)   column-parallel: this rank's heads
 *   q,k = qk_norm (qwen3), rope           CP: k, v all-gathered over cp
 *   o = attention(q, k, v)                causal, GQA, documents from cu_seqlens
 *   out = o Wo^T                          row-parallel: a partial sum over tp
 *
 * Qwen3.5's gated attention (attn_gate): h Wq^T gives each head's query and
 * an output gate side by side (2 head_dim columns a head), split apart
 * (copy2d); o = attention(...) * sigmoid(gate) before Wo. Its RoPE turns
 * the first rd dimensions of a head, its norms' weights are 1 + w (the ops'
 * woff).
 *
 * HF weights are (out, in): y = x W^T. */
#include "block.h"
#include "model.h"

/* its tensors, its linears, its activation buffers per layer, its scratch */
enum { WQ, WK, WV, WO, BQ, BK, BV, BO, QN, KN, NSLOT };
enum { LQ, LK, LV, LO, NLIN };
enum { QPRE, KPRE, RSTDQ, RSTDK, Q, K, V, O, LSE, GATE, OG, NBUF };
enum { DQ, DOUT, DK, DV, DKL, DVL, KVBLK, QG, DGATE, NSCRATCH };

static const loom_block_slot slots[NSLOT] = {
    [WQ] = {"self_attn.q_proj.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [WK] = {"self_attn.k_proj.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [WV] = {"self_attn.v_proj.weight", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [WO] = {"self_attn.o_proj.weight", LOOM_COMP_ATTN, LOOM_SHARD_COLS},
    [BQ] = {"self_attn.q_proj.bias", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [BK] = {"self_attn.k_proj.bias", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [BV] = {"self_attn.v_proj.bias", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [BO] = {"self_attn.o_proj.bias", LOOM_COMP_ATTN, LOOM_SHARD_NONE},
    [QN] = {"self_attn.q_norm.weight", LOOM_COMP_ATTN, LOOM_SHARD_NONE, true},
    [KN] = {"self_attn.k_norm.weight", LOOM_COMP_ATTN, LOOM_SHARD_NONE, true},
};

static const loom_block_linear linears[NLIN] = {
    [LQ] = {"self_attn", "q_proj", WQ, LQ}, [LK] = {"self_attn", "k_proj", WK, LQ},
    [LV] = {"self_attn", "v_proj", WV, LQ}, [LO] = {"self_attn", "o_proj", WO, LO},
};

static loom_status attn_params(const loom_model_config *c, int64_t l, loom_param_sink *s) {
    const int64_t H = c->hidden_size, D = c->head_dim;
    const int64_t q = c->num_heads * D, kv = c->num_kv_heads * D;
    /* Qwen3.5's gated attention: each head's query and output gate, 2 D rows */
    loom_param_put(s, WQ, c->attn_gate ? 2 * q : q, H);
    loom_param_put(s, WK, kv, H);
    loom_param_put(s, WV, kv, H);
    loom_param_put(s, WO, H, q);
    if (c->qkv_bias) {
        loom_param_put(s, BQ, c->attn_gate ? 2 * q : q, 0);
        loom_param_put(s, BK, kv, 0);
        loom_param_put(s, BV, kv, 0);
    }
    if (c->o_bias) loom_param_put(s, BO, H, 0);
    if (c->qk_norm) {
        loom_param_put(s, QN, D, 0);
        loom_param_put(s, KN, D, 0);
    }
    return LOOM_OK;
}

/* ---- context parallel: keys and values of the whole micro-batch ---- */

/* Global token index (within the micro-batch) of this rank's local tokens,
 * as the ops read it. */
static const int32_t *my_qidx_d(const loom_model *m) {
    return m->cp == 1 ? NULL : m->d_perm + (int64_t)m->mesh->cp_rank * m->Tc;
}

/* The gated q_proj's rows (Tc, heads, [query, gate] of D each) <-> query
 * and gate (Tc, heads, D) each: apart (back false) or together (back). */
static loom_status gate_split(loom_model *m, void *qg, void *q, void *g, bool back) {
    const size_t e = m->dev.esz, D = (size_t)m->D, rows = (size_t)(m->Tc * m->Hql);
    char *qgc = qg;
    if (back) {
        CK(loom_k_copy2d(m, qgc, 2 * D * e, q, D * e, D * e, rows));
        return loom_k_copy2d(m, qgc + D * e, 2 * D * e, g, D * e, D * e, rows);
    }
    CK(loom_k_copy2d(m, q, D * e, qgc, 2 * D * e, D * e, rows));
    return loom_k_copy2d(m, g, D * e, qgc + D * e, 2 * D * e, D * e, rows);
}

static loom_status attn_fwd(const loom_blk *b, const void *h, void *out) {
    loom_model *m = b->m;
    const int *w = b->w;
    const loom_micro *mb = b->mb;
    void *const *a = b->act;
    const int64_t H = m->H, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc;
    const float eps = (float)m->cfg.rms_norm_eps;
    void *q = a[Q], *k = a[K], *v = a[V], *o = a[O];
    /* k and v of the local tokens: straight into the full buffers without cp */
    void *kl = m->cp == 1 ? k : b->scratch[DKL], *vl = m->cp == 1 ? v : b->scratch[DVL];
    void *qdst = m->cfg.qk_norm ? a[QPRE] : q;
    void *kdst = m->cfg.qk_norm ? a[KPRE] : kl;
    const bool gated = m->cfg.attn_gate;
    /* gated: each head's query and gate into QG, then apart */
    void *qproj = gated ? b->scratch[QG] : qdst;
    const int64_t QW = gated ? 2 * QD : QD;
    CK(loom_blk_lin(b, LQ, h, Tc, H, loom_wc(m, w[WQ]), QW, qproj));
    CK(loom_blk_lin(b, LK, h, Tc, H, loom_wc(m, w[WK]), KD, kdst));
    CK(loom_blk_lin(b, LV, h, Tc, H, loom_wc(m, w[WV]), KD, vl));
    if (w[BQ] >= 0) CK(loom_k_bias_fwd(m, qproj, loom_wc(m, w[BQ]), Tc, QW));
    if (gated) CK(gate_split(m, qproj, qdst, a[GATE], false));
    if (w[BK] >= 0) CK(loom_k_bias_fwd(m, kdst, loom_wc(m, w[BK]), Tc, KD));
    if (w[BV] >= 0) CK(loom_k_bias_fwd(m, vl, loom_wc(m, w[BV]), Tc, KD));
    if (m->cfg.qk_norm) {
        CK(loom_k_qknorm_rope_fwd(m, mb, qdst, loom_wc(m, w[QN]), m->Hql, eps, q, a[RSTDQ]));
        CK(loom_k_qknorm_rope_fwd(m, mb, kdst, loom_wc(m, w[KN]), m->Hkvl, eps, kl, a[RSTDK]));
    } else {
        CK(loom_k_rope(m, false, q, Tc, m->Hql, mb->d_pos));
        CK(loom_k_rope(m, false, kl, Tc, m->Hkvl, mb->d_pos));
    }
    CK(loom_cp_gather(m, kl, KD, m->dev.adt, k, b->scratch[KVBLK]));
    CK(loom_cp_gather(m, vl, KD, m->dev.adt, v, b->scratch[KVBLK]));
    CK(loom_k_attn_fwd(m, q, my_qidx_d(m), Tc, k, v, T, m->Hql, m->Hkvl, mb->d_cu, mb->ndocs,
                       mb->even_len, o, a[LSE]));
    if (gated) CK(loom_k_gate_fwd(m, o, a[GATE], Tc * QD, a[OG]));
    void *oin = gated ? a[OG] : o; /* o_proj's input */
    if (!out) return loom_blk_lora_fwd(b, LO, oin, Tc, m->dtmp);
    return loom_blk_lin(b, LO, oin, Tc, QD, loom_wc(m, w[WO]), H, out);
}

#define DW(dy, x, T, out, in, dW) CK(loom_k_lin_dw(m, dy, x, T, out, in, 1.0f, dW))

/* dq, dk, dv (local) from dy through o and the attention */
static loom_status attn_bwd_core(const loom_blk *b, const void *dy, void *dkl, void *dvl) {
    loom_model *m = b->m;
    const int *w = b->w;
    const loom_micro *mb = b->mb;
    void *const *a = b->act;
    const int64_t H = m->H, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc;
    void *const *sc = b->scratch;
    void *dq = sc[DQ], *dk = sc[DK], *dv = sc[DV], *dout = sc[DOUT];
    /* Each input gradient is LoRA's term and the base projections' as one
     * sum (loom_k_lin_dx_sum): at most one LoRA term and three projections */
    bool acc = false;
    loom_dx_term t[4];
    int nt = 0;
    const bool gated = m->cfg.attn_gate;
    const void *oin = gated ? a[OG] : a[O]; /* o_proj's input */
    CK(loom_blk_lora_bwd(b, LO, oin, Tc, dy, dout, &acc, t, &nt));
    t[nt++] = loom_dx_base(dy, H, loom_wc(m, w[WO]));
    CK(loom_k_lin_dx_sum(m, Tc, QD, nt, t, acc ? 1.0f : 0.0f, dout));
    DW(dy, oin, Tc, H, QD, loom_g(m, w[WO]));
    /* through the gate: d o in place, d gate aside */
    if (gated) CK(loom_k_gate_bwd(m, dout, a[O], a[GATE], Tc * QD, dout, sc[DGATE]));
    CK(loom_k_attn_bwd(m, dout, a[Q], my_qidx_d(m), Tc, a[K], a[V], a[O], a[LSE], T, m->Hql,
                       m->Hkvl, mb->d_cu, mb->ndocs, mb->even_len, dq, dk, dv));
    CK(loom_cp_reduce(m, dk, KD, m->dev.adt, dkl, sc[KVBLK]));
    CK(loom_cp_reduce(m, dv, KD, m->dev.adt, dvl, sc[KVBLK]));
    if (m->cfg.qk_norm) {
        CK(loom_k_qknorm_rope_bwd(m, mb, dq, a[QPRE], loom_wc(m, w[QN]), a[RSTDQ], m->Hql,
                                  loom_g(m, w[QN])));
        CK(loom_k_qknorm_rope_bwd(m, mb, dkl, a[KPRE], loom_wc(m, w[KN]), a[RSTDK], m->Hkvl,
                                  loom_g(m, w[KN])));
    } else {
        CK(loom_k_rope(m, true, dq, Tc, m->Hql, mb->d_pos));
        CK(loom_k_rope(m, true, dkl, Tc, m->Hkvl, mb->d_pos));
    }
    if (gated) CK(gate_split(m, sc[QG], dq, sc[DGATE], true)); /* d q_proj's output */
    void *dqw = gated ? sc[QG] : dq;
    if (w[BQ] >= 0) CK(loom_k_bias_bwd(m, dqw, Tc, gated ? 2 * QD : QD, loom_g(m, w[BQ])));
    if (w[BK] >= 0) CK(loom_k_bias_bwd(m, dkl, Tc, KD, loom_g(m, w[BK])));
    if (w[BV] >= 0) CK(loom_k_bias_bwd(m, dvl, Tc, KD, loom_g(m, w[BV])));
    return LOOM_OK;
}

static loom_status attn_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    loom_model *m = b->m;
    const int *w = b->w;
    const int64_t H = m->H, QD = m->Hql * m->D, KD = m->Hkvl * m->D, Tc = m->Tc;
    void *const *sc = b->scratch;
    void *dkl = sc[m->cp == 1 ? DK : DKL], *dvl = sc[m->cp == 1 ? DV : DVL];
    CK(attn_bwd_core(b, dy, dkl, dvl));
    /* d of q_proj's output: the query's, or (gated) the query's and the
     * gate's side by side */
    void *dq = m->cfg.attn_gate ? sc[QG] : sc[DQ];
    const int64_t QW = m->cfg.attn_gate ? 2 * QD : QD;
    bool acc = false;
    loom_dx_term t[4];
    int nt = 0;
    CK(loom_blk_lora_bwd(b, LQ, h, Tc, dq, dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, LK, h, Tc, dkl, dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, LV, h, Tc, dvl, dx, &acc, t, &nt));
    if (dx) {
        t[nt++] = loom_dx_base(dq, QW, loom_wc(m, w[WQ]));
        t[nt++] = loom_dx_base(dkl, KD, loom_wc(m, w[WK]));
        t[nt++] = loom_dx_base(dvl, KD, loom_wc(m, w[WV]));
        CK(loom_k_lin_dx_sum(m, Tc, H, nt, t, acc ? 1.0f : 0.0f, dx));
    }
    DW(dq, h, Tc, QW, H, loom_g(m, w[WQ]));
    DW(dkl, h, Tc, KD, H, loom_g(m, w[WK]));
    DW(dvl, h, Tc, KD, H, loom_g(m, w[WV]));
    return LOOM_OK;
}

static int attn_acts(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out) {
    const size_t e = m->dev.esz, f = sizeof(float);
    const int64_t QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const bool qkn = m->cfg.qk_norm;
    out[QPRE].bytes = qkn ? (size_t)(Tc * QD) * e : 0;
    out[KPRE].bytes = qkn ? (size_t)(Tc * KD) * e : 0;
    out[RSTDQ].bytes = qkn ? (size_t)(Tc * m->Hql) * f : 0;
    out[RSTDK].bytes = qkn ? (size_t)(Tc * m->Hkvl) * f : 0;
    out[Q].bytes = (size_t)(Tc * QD) * e;
    out[K].bytes = out[V].bytes = (size_t)(T * KD) * e; /* the whole micro-batch's (over cp) */
    out[O].bytes = (size_t)(Tc * QD) * e;
    out[LSE].bytes = (size_t)(Tc * m->Hql) * f;
    /* gated: the gate, and o * sigmoid(gate) (o_proj's input) */
    out[GATE].bytes = out[OG].bytes = m->cfg.attn_gate ? (size_t)(Tc * QD) * e : 0;
    return NBUF; /* all kept under selective recomputation */
}

static int attn_scratch(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes) {
    const size_t e = m->dev.esz;
    const int64_t QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    bytes[DQ] = bytes[DOUT] = (size_t)(Tc * QD) * e;
    bytes[DK] = bytes[DV] = (size_t)(T * KD) * e;
    bytes[DKL] = bytes[DVL] = (size_t)(Tc * KD) * e;
    bytes[KVBLK] = (size_t)(T * KD) * e; /* a cp exchange's gathered blocks */
    /* gated: q_proj's output (the forward's, then its gradient), d gate */
    bytes[QG] = m->cfg.attn_gate ? (size_t)(Tc * 2 * QD) * e : 0;
    bytes[DGATE] = m->cfg.attn_gate ? (size_t)(Tc * QD) * e : 0;
    return NSCRATCH;
}

const loom_block_kind loom_block_attn = {
    .name = "attention",
    .id = LOOM_KIND_ATTN,
    .norm = "input_layernorm.weight",
    .slots = slots,
    .nslots = NSLOT,
    .lin = linears,
    .nlin = NLIN,
    .out_bias = BO,
    .params = attn_params,
    .acts = attn_acts,
    .scratch = attn_scratch,
    .fwd = attn_fwd,
    .bwd = attn_bwd,
    .recompute = NULL, /* keeps every buffer under selective recomputation */
};
