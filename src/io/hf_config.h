/* Hugging Face config.json for the model families loom trains: qwen2,
 * qwen3, llama, qwen3_moe, qwen2_moe. Both layouts are read:
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

    char dtype[16];               /* "bfloat16", "float32", "float16" or "" */
    loom_json *raw;               /* the parsed document (owned) */
} loom_model_config;

/* Reads <dir>/config.json (or the file itself when path is a file). */
loom_status loom_config_load(loom_ctx *ctx, const char *path, loom_model_config *cfg);
/* The same with the keys of the JSON object `overrides` replacing the
 * file's (loom_config_override; NULL or "": none). */
loom_status loom_config_load_with(loom_ctx *ctx, const char *path, const char *overrides,
                                  loom_model_config *cfg);
/* Parses a config document (copied); `what` names it in messages. */
/* Replaces keys of a parsed config.json (an object) with those of the JSON
 * object `overrides` ({"num_hidden_layers": 2}); NULL or "" changes nothing. */
loom_status loom_config_override(loom_ctx *ctx, loom_json *doc, const char *overrides);
loom_status loom_config_parse(loom_ctx *ctx, const loom_json *doc, const char *what,
                              loom_model_config *cfg);
void loom_config_free(loom_model_config *cfg);

/* Writes <dir>/config.json: the document as read (same layout, same keys),
 * with the dtype entry ("torch_dtype" classic, "dtype" v5) set to `dtype`. */
loom_status loom_config_save(loom_ctx *ctx, const loom_model_config *cfg, const char *dir,
                             loom_dtype dtype);

/* True when layer l has experts (qwen3_moe, qwen2_moe: not in mlp_only_layers, and on
 * decoder_sparse_step). */
bool loom_config_layer_is_moe(const loom_model_config *cfg, int64_t layer);
const char *loom_arch_name(loom_arch a);
const char *loom_rope_type_name(loom_rope_type t);

#endif /* LOOM_HF_CONFIG_H */
