/* The mixture-of-experts block (block.h's kind "moe"): Qwen3-MoE's router
 * and experts in the layers loom_config_layer_is_moe names. So far it only
 * declares its tensors, in the hub's per-expert naming, for the parameter
 * plan (`loom inspect`, checkpoint checks); it has no forward yet, so a
 * model with it is refused before anything is laid out. The forward,
 * backward, activations, LoRA linears and the etp x ep sharding of the
 * experts come with issue 37. */
#include "block.h"
#include "model.h"

/* its tensors: the router, then each expert's gate, up, down (in the dense
 * MLP's slot order, loom_mlp_params) */
enum { ROUTER, EG, EU, ED, EBG, EBU, EBD, NSLOT };

static const loom_block_slot slots[NSLOT] = {
    [ROUTER] = {"mlp.gate.weight", LOOM_COMP_ROUTER, LOOM_SHARD_NONE},
    [EG] = {"mlp.experts.%lld.gate_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_NONE},
    [EU] = {"mlp.experts.%lld.up_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_NONE},
    [ED] = {"mlp.experts.%lld.down_proj.weight", LOOM_COMP_EXPERTS, LOOM_SHARD_NONE},
    [EBG] = {"mlp.experts.%lld.gate_proj.bias", LOOM_COMP_EXPERTS, LOOM_SHARD_NONE},
    [EBU] = {"mlp.experts.%lld.up_proj.bias", LOOM_COMP_EXPERTS, LOOM_SHARD_NONE},
    [EBD] = {"mlp.experts.%lld.down_proj.bias", LOOM_COMP_EXPERTS, LOOM_SHARD_NONE},
};

static loom_status moe_params(const loom_model_config *c, int64_t l, loom_param_sink *s) {
    loom_param_put(s, ROUTER, c->num_experts, c->hidden_size);
    for (int64_t e = 0; e < c->num_experts; e++)
        loom_mlp_params(c, s, EG, e, c->moe_intermediate_size);
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
};
