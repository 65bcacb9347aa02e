/* The dense MLP block (block.h's kind "mlp"), SwiGLU:
 *
 *   g, u = h Wg^T (+bg), h Wu^T (+bu)   column-parallel: I/tp columns here
 *   act = silu(g) * u
 *   out = act Wd^T                      row-parallel: a partial sum over tp
 *
 * Selective recomputation drops g, u and act (the wide ones) and computes
 * them again from h before the backward. */
#include "block.h"
#include "model.h"

/* its tensors, its linears, its activation buffers per layer, its scratch */
enum { WG, WU, WD, BG, BU, BD, NSLOT };
enum { LG, LU, LD, NLIN };
enum { G, U, ACT, NBUF };
enum { DG, DU, NSCRATCH };

static const loom_block_slot slots[NSLOT] = {
    [WG] = {"mlp.gate_proj.weight", LOOM_COMP_MLP, LOOM_SHARD_ROWS},
    [WU] = {"mlp.up_proj.weight", LOOM_COMP_MLP, LOOM_SHARD_ROWS},
    [WD] = {"mlp.down_proj.weight", LOOM_COMP_MLP, LOOM_SHARD_COLS},
    [BG] = {"mlp.gate_proj.bias", LOOM_COMP_MLP, LOOM_SHARD_ROWS},
    [BU] = {"mlp.up_proj.bias", LOOM_COMP_MLP, LOOM_SHARD_ROWS},
    [BD] = {"mlp.down_proj.bias", LOOM_COMP_MLP, LOOM_SHARD_NONE},
};

static const loom_block_linear linears[NLIN] = {
    [LG] = {"mlp", "gate_proj", WG, LG},
    [LU] = {"mlp", "up_proj", WU, LG},
    [LD] = {"mlp", "down_proj", WD, LD},
};

/* gate, up, down (and their biases, mlp_bias) of width `inter`: slots from
 * `slot0` on (WG's place), of expert e (-1: none); the MoE block's experts
 * are these too */
void loom_mlp_params(const loom_model_config *c, loom_param_sink *s, int slot0, int64_t e,
                     int64_t inter) {
    const int64_t H = c->hidden_size;
    loom_param_put_expert(s, slot0 + WG, e, inter, H);
    loom_param_put_expert(s, slot0 + WU, e, inter, H);
    loom_param_put_expert(s, slot0 + WD, e, H, inter);
    if (!c->mlp_bias) return;
    loom_param_put_expert(s, slot0 + BG, e, inter, 0);
    loom_param_put_expert(s, slot0 + BU, e, inter, 0);
    loom_param_put_expert(s, slot0 + BD, e, H, 0);
}

static loom_status mlp_params(const loom_model_config *c, int64_t l, loom_param_sink *s) {
    if (c->intermediate_size <= 0)
        return loom_errf(loom_param_sink_ctx(s), LOOM_ERR_CONFIG,
                         "layer %lld has a dense MLP but the config has no intermediate_size",
                         (long long)l);
    loom_mlp_params(c, s, WG, -1, c->intermediate_size);
    return LOOM_OK;
}

/* up to the down projection's input: act = silu(h Wg^T) * h Wu^T */
static loom_status mlp_front(const loom_blk *b, const void *h) {
    loom_model *m = b->m;
    const int *w = b->w;
    void *const *a = b->act;
    const int64_t H = m->H, Il = m->Il, Tc = m->Tc;
    CK(loom_blk_lin(b, LG, h, Tc, H, loom_wc(m, w[WG]), Il, a[G]));
    CK(loom_blk_lin(b, LU, h, Tc, H, loom_wc(m, w[WU]), Il, a[U]));
    if (w[BG] >= 0) CK(loom_k_bias_fwd(m, a[G], loom_wc(m, w[BG]), Tc, Il));
    if (w[BU] >= 0) CK(loom_k_bias_fwd(m, a[U], loom_wc(m, w[BU]), Tc, Il));
    return loom_k_swiglu_fwd(m, a[G], a[U], Tc * Il, a[ACT]);
}

static loom_status mlp_fwd(const loom_blk *b, const void *h, void *out) {
    loom_model *m = b->m;
    CK(mlp_front(b, h));
    /* recomputed in full: the down projection's LoRA stash, its output in scratch */
    if (!out) return loom_blk_lora_fwd(b, LD, b->act[ACT], m->Tc, m->dtmp);
    return loom_blk_lin(b, LD, b->act[ACT], m->Tc, m->Il, loom_wc(m, b->w[WD]), m->H,
                        out);
}

#define DW(dy, x, T, out, in, dW) CK(loom_k_lin_dw(m, dy, x, T, out, in, 1.0f, dW))

static loom_status mlp_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    loom_model *m = b->m;
    const int *w = b->w;
    void *const *a = b->act;
    const int64_t H = m->H, Il = m->Il, Tc = m->Tc;
    void *dg = b->scratch[DG], *du = b->scratch[DU];
    /* Each input gradient is LoRA's term and the base projections' as one
     * sum (loom_k_lin_dx_sum): at most one LoRA term and two projections */
    bool acc = false;
    loom_dx_term t[4];
    int nt = 0;
    CK(loom_blk_lora_bwd(b, LD, a[ACT], Tc, dy, dg, &acc, t, &nt));
    t[nt++] = loom_dx_base(dy, H, loom_wc(m, w[WD]));
    CK(loom_k_lin_dx_sum(m, Tc, Il, nt, t, acc ? 1.0f : 0.0f, dg));
    DW(dy, a[ACT], Tc, H, Il, loom_g(m, w[WD]));
    CK(loom_k_swiglu_bwd(m, dg, a[G], a[U], Tc * Il, dg, du));
    if (w[BG] >= 0) CK(loom_k_bias_bwd(m, dg, Tc, Il, loom_g(m, w[BG])));
    if (w[BU] >= 0) CK(loom_k_bias_bwd(m, du, Tc, Il, loom_g(m, w[BU])));
    acc = false;
    nt = 0;
    CK(loom_blk_lora_bwd(b, LG, h, Tc, dg, dx, &acc, NULL, NULL));
    CK(loom_blk_lora_bwd(b, LU, h, Tc, du, dx, &acc, t, &nt));
    if (dx) {
        t[nt++] = loom_dx_base(dg, Il, loom_wc(m, w[WG]));
        t[nt++] = loom_dx_base(du, Il, loom_wc(m, w[WU]));
        CK(loom_k_lin_dx_sum(m, Tc, H, nt, t, acc ? 1.0f : 0.0f, dx));
    }
    DW(dg, h, Tc, Il, H, loom_g(m, w[WG]));
    DW(du, h, Tc, Il, H, loom_g(m, w[WU]));
    return LOOM_OK;
}

static int mlp_acts(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out) {
    for (int k = 0; k < NBUF; k++)
        out[k] = (loom_block_buf){.bytes = (size_t)(Tc * m->Il) * m->dev.esz, .cheap = true};
    return NBUF;
}

static int mlp_scratch(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes) {
    bytes[DG] = bytes[DU] = (size_t)(Tc * m->Il) * m->dev.esz;
    return NSCRATCH;
}

const loom_block_kind loom_block_mlp = {
    .name = "mlp",
    .id = LOOM_KIND_MLP,
    .norm = "post_attention_layernorm.weight",
    .slots = slots,
    .nslots = NSLOT,
    .lin = linears,
    .nlin = NLIN,
    .out_bias = BD,
    .params = mlp_params,
    .acts = mlp_acts,
    .scratch = mlp_scratch,
    .fwd = mlp_fwd,
    .bwd = mlp_bwd,
    .recompute = mlp_front,
};
