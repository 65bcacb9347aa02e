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
 * Today the kind declares the layer's tensors (the parameter plan, the
 * checkpoint's names and shapes, LoRA's targets: in_proj_qkv, in_proj_z and
 * out_proj under all-linear; in_proj_a and in_proj_b when named); a model
 * with such layers is refused before it is built (loom_config_check_built)
 * until the forward and backward exist (issue 38). The conv1d weight,
 * [C, 1, K] in the checkpoint, is (C, K) here (export.c presents it so). */
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
    [ALOG] = {"linear_attn.A_log", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [DTB] = {"linear_attn.dt_bias", LOOM_COMP_ATTN, LOOM_SHARD_ROWS},
    [NORMW] = {"linear_attn.norm.weight", LOOM_COMP_ATTN, LOOM_SHARD_NONE, true},
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
    const int64_t hv = c->lin_v_heads * c->lin_v_dim, C = 2 * hk + hv;
    loom_param_put(s, WQKV, C, H);
    loom_param_put(s, WZ, hv, H);
    loom_param_put(s, WB, c->lin_v_heads, H);
    loom_param_put(s, WA, c->lin_v_heads, H);
    loom_param_put(s, CONV, C, c->lin_conv_kernel);
    loom_param_put(s, ALOG, c->lin_v_heads, 0);
    loom_param_put(s, DTB, c->lin_v_heads, 0);
    loom_param_put(s, NORMW, c->lin_v_dim, 0);
    loom_param_put(s, WOUT, H, hv);
    return LOOM_OK;
}

static loom_status gdn_unbuilt(const loom_blk *b) {
    return loom_errf(b->m->ctx, LOOM_ERR_UNSUPPORTED,
                     "layer %lld: the Gated DeltaNet's forward and backward are not built yet",
                     (long long)b->l);
}

static loom_status gdn_fwd(const loom_blk *b, const void *h, void *out) {
    (void)h, (void)out;
    return gdn_unbuilt(b);
}

static loom_status gdn_bwd(const loom_blk *b, const void *h, const void *dy, void *dx) {
    (void)h, (void)dy, (void)dx;
    return gdn_unbuilt(b);
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
    .fwd = gdn_fwd,
    .bwd = gdn_bwd,
};
