/* Hugging Face config.json for the model families loom trains: qwen2,
 * qwen3, llama, qwen3_moe, qwen2_moe, and Qwen3.5's hybrid qwen3_5 and
 * qwen3_5_moe (the hub's vision-language layout, text model under
 * "text_config" and its tensors under model.language_model., or the
 * text-only qwen3_5_text / qwen3_5_moe_text). Both layouts are read:
 *   classic hub layout:     "rope_theta", "rope_scaling", "num_experts", "torch_dtype"
 *   transformers v5 layout: "rope_parameters": {"rope_theta", "rope_type", ...},
 *                           "num_local_experts", "dtype"
 * The parsed document is kept so that a saved model writes config.json back
 * in the layout it was read in. */
#ifndef LOOM_HF_CONFIG_H
#define LOOM_HF_CONFIG_H

#include "../core/core.h"
#include "../core/json.h"

typedef enum loom_arch {
    LOOM_ARCH_QWEN2 = 0,
    LOOM_ARCH_QWEN3,
    LOOM_ARCH_LLAMA,
    LOOM_ARCH_QWEN3_MOE,
    LOOM_ARCH_QWEN2_MOE,
    LOOM_ARCH_QWEN3_5,
    LOOM_ARCH_QWEN3_5_MOE,
    LOOM_ARCH_COUNT
} loom_arch;

typedef enum loom_rope_type {
    LOOM_ROPE_DEFAULT = 0, /* theta^(-2i/d) */
    LOOM_ROPE_LINEAR,      /* positions / factor */
    LOOM_ROPE_LLAMA3,      /* Llama 3.1 frequency-band scaling */
} loom_rope_type;

typedef struct loom_model_config {
    loom_arch arch;
    const char *model_type;       /* "qwen3", ... (static string) */
    bool v5_layout;               /* rope_parameters / num_local_experts */

    int64_t vocab_size;           /* as in the checkpoint (may be padded) */
    int64_t hidden_size;
    int64_t intermediate_size;    /* dense MLP */
    int64_t num_layers;
    int64_t num_heads;
    int64_t num_kv_heads;         /* defaults to num_heads */
    int64_t head_dim;             /* given or hidden_size / num_heads */
    bool head_dim_given;
    int64_t max_position_embeddings;
    double rms_norm_eps;
    bool tie_word_embeddings;
    bool qk_norm;                 /* qwen3, qwen3_moe */
    bool qkv_bias;                /* qwen2 always; llama when attention_bias; qwen2_moe
                                   * unless qkv_bias is false */
    bool o_bias;                  /* llama attention_bias */
    bool mlp_bias;                /* llama mlp_bias */

    loom_rope_type rope_type;
    double rope_theta;
    double rope_factor;           /* linear, llama3 */
    double rope_low_freq_factor;  /* llama3 */
    double rope_high_freq_factor; /* llama3 */
    int64_t rope_original_max_pos;/* llama3 */

    /* MoE (qwen3_moe, qwen2_moe) */
    int64_t num_experts;          /* 0 for dense models */
    int64_t num_experts_per_tok;
    int64_t moe_intermediate_size;
    int64_t decoder_sparse_step;
    bool norm_topk_prob;
    double router_aux_loss_coef;
    bool *mlp_only;               /* [num_layers]: layer uses a dense MLP */
    int64_t shared_expert_intermediate_size; /* qwen2_moe's shared expert (0: none), its
                                   * output scaled by sigmoid(shared_expert_gate) */

    /* Qwen3.5 (qwen3_5, qwen3_5_moe) */
    bool nested_text;             /* config.json holds the text model under "text_config" (the
                                   * vision-language checkpoint: tensors under
                                   * model.language_model., beside model.visual.* and mtp.*) */
    bool *linear_attn;            /* [num_layers]: a Gated DeltaNet layer (layer_types'
                                   * linear_attention), else full attention; NULL: none */
    int64_t rotary_dim;           /* the leading dimensions of a head RoPE turns: head_dim,
                                   * or head_dim * partial_rotary_factor */
    bool attn_gate;               /* q_proj gives each head's query and an output gate
                                   * (2 head_dim rows a head, interleaved per head) */
    bool norm_offset;             /* zero-centred RMSNorm weights: y = (1 + w) norm(x) */
    int64_t lin_conv_kernel;      /* linear_conv_kernel_dim */
    int64_t lin_k_heads, lin_v_heads; /* linear_num_key_heads, linear_num_value_heads */
    int64_t lin_k_dim, lin_v_dim; /* linear_key_head_dim, linear_value_head_dim */

    char dtype[16];               /* "bfloat16", "float32", "float16" or "" */
    loom_json *raw;               /* the parsed document (owned) */
} loom_model_config;

/* Reads <dir>/config.json (or the file itself when path is a file). */
loom_status loom_config_load(loom_ctx *ctx, const char *path, loom_model_config *cfg);
/* The same with the keys of the JSON object `overrides` replacing the
 * file's (loom_config_override; NULL or "": none). */
loom_status loom_config_load_with(loom_ctx *ctx, const char *path, const char *overrides,
                                  loom_model_config *cfg);
/* Replaces keys of a parsed config.json (an object) with those of the JSON
 * object `overrides` ({"num_hidden_layers": 2}); NULL or "" changes nothing. */
loom_status loom_config_override(loom_ctx *ctx, loom_json *doc, const char *overrides);
/* Parses a config document (copied); `what` names it in messages. On an
 * error nothing is left to free (loom_config_free is then a no-op). */
loom_status loom_config_parse(loom_ctx *ctx, const loom_json *doc, const char *what,
                              loom_model_config *cfg);
void loom_config_free(loom_model_config *cfg);

/* Writes <dir>/config.json: the document as read (same layout, same keys),
 * with the dtype entry ("torch_dtype" classic, "dtype" v5) set to `dtype`. */
loom_status loom_config_save(loom_ctx *ctx, const loom_model_config *cfg, const char *dir,
                             loom_dtype dtype);

/* The prefix of the text model's tensors in the checkpoint: "model." or,
 * for a vision-language checkpoint (nested_text), "model.language_model.". */
const char *loom_config_text_prefix(const loom_model_config *cfg);
/* The number of Gated DeltaNet layers (0 for every other family). */
int64_t loom_config_linear_layers(const loom_model_config *cfg);

/* True when layer l has experts (qwen3_moe, qwen2_moe: not in mlp_only_layers, and on
 * decoder_sparse_step). */
bool loom_config_layer_is_moe(const loom_model_config *cfg, int64_t layer);
const char *loom_arch_name(loom_arch a);
const char *loom_rope_type_name(loom_rope_type t);

#endif /* LOOM_HF_CONFIG_H */
