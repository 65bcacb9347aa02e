/* config.json of Hugging Face checkpoints: qwen2, qwen3, llama, qwen3_moe, qwen2_moe,
 * qwen3_5, qwen3_5_moe. */
#include "hf_config.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *arch_names[LOOM_ARCH_COUNT] = {"qwen2",     "qwen3",   "llama",
                                                   "qwen3_moe", "qwen2_moe", "qwen3_5",
                                                   "qwen3_5_moe"};

const char *loom_arch_name(loom_arch a) {
    return (int)a >= 0 && a < LOOM_ARCH_COUNT ? arch_names[a] : "?";
}

const char *loom_rope_type_name(loom_rope_type t) {
    switch (t) {
    case LOOM_ROPE_DEFAULT: return "default";
    case LOOM_ROPE_LINEAR: return "linear";
    case LOOM_ROPE_LLAMA3: return "llama3";
    }
    return "?";
}

void loom_config_free(loom_model_config *cfg) {
    if (!cfg) return;
    loom_json_free(cfg->raw);
    free(cfg->mlp_only);
    free(cfg->linear_attn);
    memset(cfg, 0, sizeof *cfg);
}

const char *loom_config_text_prefix(const loom_model_config *cfg) {
    return cfg->nested_text ? "model.language_model." : "model.";
}

int64_t loom_config_linear_layers(const loom_model_config *cfg) {
    int64_t n = 0;
    for (int64_t l = 0; cfg->linear_attn && l < cfg->num_layers; l++) n += cfg->linear_attn[l];
    return n;
}

bool loom_config_layer_is_moe(const loom_model_config *cfg, int64_t layer) {
    if (cfg->num_experts <= 0 || layer < 0 || layer >= cfg->num_layers) return false;
    if (cfg->mlp_only && cfg->mlp_only[layer]) return false;
    int64_t step = cfg->decoder_sparse_step > 0 ? cfg->decoder_sparse_step : 1;
    return (layer + 1) % step == 0;
}

/* A positive integer field; `required` says whether absence is an error. */
/* The most layers a config may have (real models have a few hundred at most). */
enum { LOOM_CONFIG_MAX_LAYERS = 1 << 16 };

static loom_status get_pos(loom_ctx *ctx, const loom_json *doc, const char *key, const char *what,
                           bool required, int64_t *out) {
    loom_status st = required ? loom_json_get_int(ctx, doc, key, what, out)
                              : loom_json_get_int_opt(ctx, doc, key, what, out);
    if (st == LOOM_ERR_NOT_FOUND) {
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: missing required field '%s'", what, key);
    }
    if (st) return st;
    if (*out <= 0 && (required || loom_json_get(doc, key)))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' must be a positive integer, got %lld",
                         what, key, (long long)*out);
    return LOOM_OK;
}

/* Rope: "rope_parameters" (v5) or "rope_theta" + "rope_scaling" (classic). */
static loom_status parse_rope(loom_ctx *ctx, const loom_json *doc, const char *what,
                              loom_model_config *cfg) {
    cfg->rope_type = LOOM_ROPE_DEFAULT;
    cfg->rope_theta = 10000.0;
    cfg->rope_factor = 1.0;
    const loom_json *params = loom_json_get(doc, "rope_parameters");
    const loom_json *scaling = NULL;
    loom_status st;
    if (params && params->type != LOOM_JSON_NULL) {
        cfg->v5_layout = true;
        if (params->type != LOOM_JSON_OBJECT)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: 'rope_parameters' must be an object, got %s",
                             what, loom_json_type_name(params->type));
        /* per-layer-type form: {"full_attention": {...}} */
        const loom_json *full = loom_json_get(params, "full_attention");
        if (full && full->type == LOOM_JSON_OBJECT) params = full;
        st = loom_json_get_num_opt(ctx, params, "rope_theta", what, &cfg->rope_theta);
        if (st) return st;
        scaling = params;
    } else {
        st = loom_json_get_num_opt(ctx, doc, "rope_theta", what, &cfg->rope_theta);
        if (st) return st;
        scaling = loom_json_get(doc, "rope_scaling");
        if (scaling && scaling->type == LOOM_JSON_NULL) scaling = NULL;
        if (scaling && scaling->type != LOOM_JSON_OBJECT)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: 'rope_scaling' must be an object or null, got %s",
                             what, loom_json_type_name(scaling->type));
    }
    if (!(cfg->rope_theta > 0) || !isfinite(cfg->rope_theta))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: rope_theta must be positive, got %g", what,
                         cfg->rope_theta);
    if (!scaling) return LOOM_OK;
    const char *type = NULL;
    st = loom_json_get_str_opt(ctx, scaling, "rope_type", what, &type);
    if (st) return st;
    if (!type) {
        st = loom_json_get_str_opt(ctx, scaling, "type", what, &type);
        if (st) return st;
    }
    if (!type || !strcmp(type, "default")) return LOOM_OK;
    if (!strcmp(type, "linear")) {
        cfg->rope_type = LOOM_ROPE_LINEAR;
        st = loom_json_get_num(ctx, scaling, "factor", what, &cfg->rope_factor);
        if (st) return st;
    } else if (!strcmp(type, "llama3")) {
        cfg->rope_type = LOOM_ROPE_LLAMA3;
        if ((st = loom_json_get_num(ctx, scaling, "factor", what, &cfg->rope_factor)) ||
            (st = loom_json_get_num(ctx, scaling, "low_freq_factor", what,
                                    &cfg->rope_low_freq_factor)) ||
            (st = loom_json_get_num(ctx, scaling, "high_freq_factor", what,
                                    &cfg->rope_high_freq_factor)) ||
            (st = loom_json_get_int(ctx, scaling, "original_max_position_embeddings", what,
                                    &cfg->rope_original_max_pos)))
            return st == LOOM_ERR_NOT_FOUND ? loom_err_prefix(ctx, "llama3 rope scaling") : st;
        if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor) ||
            cfg->rope_original_max_pos <= 0)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "%s: llama3 rope scaling needs high_freq_factor > low_freq_factor "
                             "and original_max_position_embeddings > 0",
                             what);
    } else {
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: rope scaling type '%s' is not implemented (loom implements default, "
                         "linear and llama3); remove the rope scaling entry to train at the "
                         "model's original context length",
                         what, type);
    }
    if (!(cfg->rope_factor > 0) || !isfinite(cfg->rope_factor))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: rope scaling factor must be positive, got %g",
                         what, cfg->rope_factor);
    return LOOM_OK;
}

static loom_status parse_moe(loom_ctx *ctx, const loom_json *doc, const char *what,
                             loom_model_config *cfg) {
    loom_status st;
    const char *experts_key = loom_json_get(doc, "num_local_experts") ? "num_local_experts"
                                                                      : "num_experts";
    if (!strcmp(experts_key, "num_local_experts")) cfg->v5_layout = true;
    if ((st = get_pos(ctx, doc, experts_key, what, true, &cfg->num_experts)) ||
        (st = get_pos(ctx, doc, "num_experts_per_tok", what, true, &cfg->num_experts_per_tok)) ||
        (st = get_pos(ctx, doc, "moe_intermediate_size", what, true,
                      &cfg->moe_intermediate_size)))
        return st;
    if (cfg->num_experts_per_tok > cfg->num_experts)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s: num_experts_per_tok=%lld is larger than the number of experts (%lld)",
                         what, (long long)cfg->num_experts_per_tok, (long long)cfg->num_experts);
    cfg->decoder_sparse_step = 1;
    if ((st = get_pos(ctx, doc, "decoder_sparse_step", what, false, &cfg->decoder_sparse_step)))
        return st;
    cfg->norm_topk_prob = false;
    if ((st = loom_json_get_bool_opt(ctx, doc, "norm_topk_prob", what, &cfg->norm_topk_prob)))
        return st;
    cfg->router_aux_loss_coef = 0.001;
    if ((st = loom_json_get_num_opt(ctx, doc, "router_aux_loss_coef", what,
                                    &cfg->router_aux_loss_coef)))
        return st;
    /* Qwen3.5-MoE normalises the top-k weights always (its config has no
     * norm_topk_prob) */
    if (cfg->arch == LOOM_ARCH_QWEN3_5_MOE) cfg->norm_topk_prob = true;
    /* the shared expert of Qwen2-MoE and Qwen3.5-MoE (transformers' default
     * width when absent) */
    if (cfg->arch == LOOM_ARCH_QWEN2_MOE || cfg->arch == LOOM_ARCH_QWEN3_5_MOE) {
        cfg->shared_expert_intermediate_size = cfg->arch == LOOM_ARCH_QWEN2_MOE ? 5632 : 512;
        if ((st = get_pos(ctx, doc, "shared_expert_intermediate_size", what, false,
                          &cfg->shared_expert_intermediate_size)))
            return st;
    }
    cfg->mlp_only = loom_calloc(ctx, (size_t)cfg->num_layers, sizeof(bool), "mlp_only_layers");
    if (!cfg->mlp_only) return LOOM_ERR_OOM;
    const loom_json *mol = loom_json_get(doc, "mlp_only_layers");
    if (mol && mol->type != LOOM_JSON_NULL) {
        if (mol->type != LOOM_JSON_ARRAY)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: 'mlp_only_layers' must be a list, got %s",
                             what, loom_json_type_name(mol->type));
        for (size_t i = 0; i < mol->n; i++) {
            const loom_json *e = mol->items[i];
            if (e->type != LOOM_JSON_NUMBER || !e->is_int || e->i < 0 || e->i >= cfg->num_layers)
                return loom_errf(ctx, LOOM_ERR_CONFIG,
                                 "%s: mlp_only_layers[%zu] must be a layer index in [0, %lld)",
                                 what, i, (long long)cfg->num_layers);
            cfg->mlp_only[e->i] = true;
        }
    }
    return LOOM_OK;
}

/* A positive integer field with transformers' default when absent. */
static loom_status get_pos_or(loom_ctx *ctx, const loom_json *doc, const char *key,
                              const char *what, int64_t dflt, int64_t *out) {
    *out = dflt;
    return get_pos(ctx, doc, key, what, false, out);
}

/* Qwen3.5's hybrid layers (qwen3_5, qwen3_5_moe; doc: the text model's
 * config): layer_types (or full_attention_interval, 4 by default, as
 * transformers derives them), the Gated DeltaNet's sizes, the gated
 * attention's partial rotary factor (0.25 by default). */
static loom_status parse_qwen35(loom_ctx *ctx, const loom_json *doc, const char *what,
                                loom_model_config *cfg) {
    loom_status st;
    cfg->qk_norm = cfg->attn_gate = cfg->norm_offset = true;
    if ((st = get_pos_or(ctx, doc, "linear_conv_kernel_dim", what, 4, &cfg->lin_conv_kernel)) ||
        (st = get_pos_or(ctx, doc, "linear_key_head_dim", what, 128, &cfg->lin_k_dim)) ||
        (st = get_pos_or(ctx, doc, "linear_value_head_dim", what, 128, &cfg->lin_v_dim)) ||
        (st = get_pos_or(ctx, doc, "linear_num_key_heads", what, 16, &cfg->lin_k_heads)) ||
        (st = get_pos_or(ctx, doc, "linear_num_value_heads", what, 32, &cfg->lin_v_heads)))
        return st;
    if (cfg->lin_v_heads % cfg->lin_k_heads != 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s: linear_num_value_heads=%lld is not a multiple of "
                         "linear_num_key_heads=%lld",
                         what, (long long)cfg->lin_v_heads, (long long)cfg->lin_k_heads);
    /* partial_rotary_factor: the config's, else rope_parameters', else 0.25 */
    double f = 0.25;
    const loom_json *rp = loom_json_get(doc, "rope_parameters");
    if (rp && rp->type == LOOM_JSON_OBJECT &&
        (st = loom_json_get_num_opt(ctx, rp, "partial_rotary_factor", what, &f)))
        return st;
    if ((st = loom_json_get_num_opt(ctx, doc, "partial_rotary_factor", what, &f))) return st;
    /* range first: the product of an out-of-range factor may not fit an int64 */
    cfg->rotary_dim = (f > 0 && f <= 1) ? (int64_t)((double)cfg->head_dim * f) : 0;
    if (!(f > 0 && f <= 1) || cfg->rotary_dim < 2 || cfg->rotary_dim % 2)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s: partial_rotary_factor=%g gives %lld rotary dimensions of head_dim "
                         "%lld: it must be in (0, 1] and give an even number",
                         what, f, (long long)cfg->rotary_dim, (long long)cfg->head_dim);
    cfg->linear_attn = loom_calloc(ctx, (size_t)cfg->num_layers, sizeof(bool), "layer_types");
    if (!cfg->linear_attn) return LOOM_ERR_OOM;
    const loom_json *lt = loom_json_get(doc, "layer_types");
    if (lt && lt->type != LOOM_JSON_NULL) {
        if (lt->type != LOOM_JSON_ARRAY || (int64_t)lt->n != cfg->num_layers)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "%s: 'layer_types' must be a list of num_hidden_layers=%lld entries "
                             "(an override of num_hidden_layers needs one of layer_types too)",
                             what, (long long)cfg->num_layers);
        for (size_t i = 0; i < lt->n; i++) {
            const loom_json *e = lt->items[i];
            const bool lin = e->type == LOOM_JSON_STRING && !strcmp(e->s, "linear_attention");
            if (!lin && !(e->type == LOOM_JSON_STRING && !strcmp(e->s, "full_attention")))
                return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                                 "%s: layer_types[%zu] must be 'linear_attention' or "
                                 "'full_attention'",
                                 what, i);
            cfg->linear_attn[i] = lin;
        }
        return LOOM_OK;
    }
    int64_t every = 4;
    if ((st = get_pos(ctx, doc, "full_attention_interval", what, false, &every))) return st;
    for (int64_t l = 0; l < cfg->num_layers; l++) cfg->linear_attn[l] = (l + 1) % every != 0;
    return LOOM_OK;
}

/* model_type -> arch; Qwen3.5's text-only names (qwen3_5_text,
 * qwen3_5_moe_text) are the same arch. -1: not supported. */
static int arch_of(const char *mt) {
    for (int a = 0; a < LOOM_ARCH_COUNT; a++)
        if (!strcmp(mt, arch_names[a])) return a;
    if (!strcmp(mt, "qwen3_5_text")) return LOOM_ARCH_QWEN3_5;
    if (!strcmp(mt, "qwen3_5_moe_text")) return LOOM_ARCH_QWEN3_5_MOE;
    return -1;
}

/* The text model's config: the document, or its "text_config" (Qwen3.5's
 * vision-language layout, whose model_type must then be the text one). */
static loom_status text_doc(loom_ctx *ctx, const loom_json *doc, const char *what,
                            loom_model_config *cfg, const loom_json **out) {
    *out = doc;
    const loom_json *tc = loom_json_get(doc, "text_config");
    const bool q35 = cfg->arch == LOOM_ARCH_QWEN3_5 || cfg->arch == LOOM_ARCH_QWEN3_5_MOE;
    if (!q35 || !tc || tc->type == LOOM_JSON_NULL) {
        const char *mt = NULL;
        loom_json_get_str_opt(ctx, doc, "model_type", what, &mt);
        if (q35 && mt && !strstr(mt, "_text"))
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "%s: model_type '%s' holds the text model under 'text_config', "
                             "which is missing (a text-only checkpoint says '%s_text')",
                             what, mt, mt);
        return LOOM_OK;
    }
    if (tc->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: 'text_config' must be an object, got %s", what,
                         loom_json_type_name(tc->type));
    const char *tm = NULL;
    loom_status st = loom_json_get_str_opt(ctx, tc, "model_type", what, &tm);
    if (st) return st;
    if (tm && arch_of(tm) != (int)cfg->arch)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s: text_config.model_type '%s' does not match model_type '%s'", what,
                         tm, cfg->model_type);
    cfg->nested_text = true;
    *out = tc;
    return LOOM_OK;
}

static loom_status parse_config(loom_ctx *ctx, const loom_json *doc, const char *what,
                                loom_model_config *cfg);

loom_status loom_config_parse(loom_ctx *ctx, const loom_json *doc, const char *what,
                              loom_model_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    loom_status st = parse_config(ctx, doc, what, cfg);
    if (st) loom_config_free(cfg); /* nothing half-parsed is left behind */
    return st;
}

static loom_status parse_config(loom_ctx *ctx, const loom_json *doc, const char *what,
                                loom_model_config *cfg) {
    if (!doc || doc->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: must be a JSON object", what);
    loom_status st;
    const char *mt = NULL;
    if ((st = loom_json_get_str(ctx, doc, "model_type", what, &mt)))
        return st == LOOM_ERR_NOT_FOUND
                   ? loom_errf(ctx, LOOM_ERR_CONFIG, "%s: missing required field 'model_type'", what)
                   : st;
    const int arch = arch_of(mt);
    if (arch < 0)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: model_type '%s' is not supported (loom supports qwen2, qwen3, llama, "
                         "qwen3_moe, qwen2_moe, qwen3_5 and qwen3_5_moe)",
                         what, mt);
    cfg->arch = (loom_arch)arch;
    cfg->model_type = arch_names[arch];
    const bool moe = cfg->arch == LOOM_ARCH_QWEN3_MOE || cfg->arch == LOOM_ARCH_QWEN2_MOE ||
                     cfg->arch == LOOM_ARCH_QWEN3_5_MOE;
    const bool q35 = cfg->arch == LOOM_ARCH_QWEN3_5 || cfg->arch == LOOM_ARCH_QWEN3_5_MOE;
    const loom_json *top = doc;
    if ((st = text_doc(ctx, top, what, cfg, &doc))) return st;

    if ((st = get_pos(ctx, doc, "vocab_size", what, true, &cfg->vocab_size)) ||
        (st = get_pos(ctx, doc, "hidden_size", what, true, &cfg->hidden_size)) ||
        (st = get_pos(ctx, doc, "intermediate_size", what, !moe, &cfg->intermediate_size)) ||
        (st = get_pos(ctx, doc, "num_hidden_layers", what, true, &cfg->num_layers)) ||
        (st = get_pos(ctx, doc, "num_attention_heads", what, true, &cfg->num_heads)))
        return st;
    /* per-layer tables (layer_types, mlp_only_layers) are sized by it before any weight is read */
    if (cfg->num_layers > LOOM_CONFIG_MAX_LAYERS)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s: num_hidden_layers=%lld is more than the %d layers loom supports: is "
                         "the config right?",
                         what, (long long)cfg->num_layers, LOOM_CONFIG_MAX_LAYERS);
    cfg->num_kv_heads = cfg->num_heads;
    if ((st = get_pos(ctx, doc, "num_key_value_heads", what, false, &cfg->num_kv_heads))) return st;
    if (cfg->num_heads % cfg->num_kv_heads != 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s: num_attention_heads=%lld is not a multiple of "
                         "num_key_value_heads=%lld",
                         what, (long long)cfg->num_heads, (long long)cfg->num_kv_heads);
    const loom_json *hd = loom_json_get(doc, "head_dim");
    cfg->head_dim_given = hd && hd->type != LOOM_JSON_NULL;
    if (cfg->head_dim_given) {
        if ((st = get_pos(ctx, doc, "head_dim", what, true, &cfg->head_dim))) return st;
    } else {
        if (cfg->hidden_size % cfg->num_heads != 0)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "%s: no head_dim given and hidden_size=%lld is not a multiple of "
                             "num_attention_heads=%lld",
                             what, (long long)cfg->hidden_size, (long long)cfg->num_heads);
        cfg->head_dim = cfg->hidden_size / cfg->num_heads;
    }
    if (cfg->head_dim % 2 != 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: head_dim=%lld must be even for rotary embeddings",
                         what, (long long)cfg->head_dim);
    if ((st = get_pos(ctx, doc, "max_position_embeddings", what, false,
                      &cfg->max_position_embeddings)))
        return st;
    cfg->rms_norm_eps = 1e-6;
    if ((st = loom_json_get_num_opt(ctx, doc, "rms_norm_eps", what, &cfg->rms_norm_eps))) return st;
    if (!(cfg->rms_norm_eps > 0) || !isfinite(cfg->rms_norm_eps))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: rms_norm_eps must be positive, got %g", what,
                         cfg->rms_norm_eps);
    /* the text model's, else (a vision-language config) the top level's */
    if ((st = loom_json_get_bool_opt(ctx, top, "tie_word_embeddings", what,
                                     &cfg->tie_word_embeddings)) ||
        (st = loom_json_get_bool_opt(ctx, doc, "tie_word_embeddings", what,
                                     &cfg->tie_word_embeddings)))
        return st;

    const char *act = "silu";
    if ((st = loom_json_get_str_opt(ctx, doc, "hidden_act", what, &act))) return st;
    if (strcmp(act, "silu") != 0)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: hidden_act '%s' is not supported (loom implements silu)", what, act);
    bool sliding = false;
    if ((st = loom_json_get_bool_opt(ctx, doc, "use_sliding_window", what, &sliding))) return st;
    if (sliding)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: use_sliding_window=true is not supported (loom implements full "
                         "causal attention)",
                         what);
    const loom_json *lt = q35 ? NULL : loom_json_get(doc, "layer_types");
    if (lt && lt->type == LOOM_JSON_ARRAY)
        for (size_t i = 0; i < lt->n; i++)
            if (lt->items[i]->type != LOOM_JSON_STRING ||
                strcmp(lt->items[i]->s, "full_attention") != 0)
                return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                                 "%s: layer_types[%zu] is not 'full_attention' (loom implements "
                                 "full causal attention only)",
                                 what, i);

    cfg->qk_norm = cfg->arch == LOOM_ARCH_QWEN3 || cfg->arch == LOOM_ARCH_QWEN3_MOE;
    if (cfg->arch == LOOM_ARCH_QWEN2) {
        cfg->qkv_bias = true; /* Qwen2 attention always has q/k/v biases */
    } else if (cfg->arch == LOOM_ARCH_QWEN2_MOE) {
        cfg->qkv_bias = true; /* Qwen2-MoE's q/k/v biases unless qkv_bias says none; no o bias */
        if ((st = loom_json_get_bool_opt(ctx, doc, "qkv_bias", what, &cfg->qkv_bias))) return st;
    } else {
        bool ab = false;
        if ((st = loom_json_get_bool_opt(ctx, doc, "attention_bias", what, &ab))) return st;
        cfg->qkv_bias = ab; /* Llama and Qwen3: attention_bias covers q, k, v and o */
        cfg->o_bias = ab;
    }
    if (cfg->arch == LOOM_ARCH_LLAMA) {
        if ((st = loom_json_get_bool_opt(ctx, doc, "mlp_bias", what, &cfg->mlp_bias))) return st;
    }
    if ((st = parse_rope(ctx, doc, what, cfg))) return st;
    cfg->rotary_dim = cfg->head_dim;
    if (q35 && (st = parse_qwen35(ctx, doc, what, cfg))) return st;
    if (moe && (st = parse_moe(ctx, doc, what, cfg))) return st;
    if (!moe && loom_json_get(doc, "num_local_experts")) cfg->v5_layout = true;

    const char *dt = NULL;
    if ((st = loom_json_get_str_opt(ctx, top, "dtype", what, &dt))) return st;
    if (dt) {
        cfg->v5_layout = true;
    } else if ((st = loom_json_get_str_opt(ctx, top, "torch_dtype", what, &dt))) {
        return st;
    }
    if (dt) snprintf(cfg->dtype, sizeof cfg->dtype, "%s", dt);

    cfg->raw = loom_json_clone(ctx, top);
    if (!cfg->raw) return LOOM_ERR_OOM;
    return LOOM_OK;
}

loom_status loom_config_load(loom_ctx *ctx, const char *path, loom_model_config *cfg) {
    return loom_config_load_with(ctx, path, NULL, cfg);
}

loom_status loom_config_load_with(loom_ctx *ctx, const char *path, const char *overrides,
                                  loom_model_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    char *file = loom_dir_exists(path) ? loom_path_join(ctx, path, "config.json")
                                       : loom_strdup(ctx, path);
    if (!file) return LOOM_ERR_OOM;
    if (!loom_file_exists(file)) {
        loom_status st = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                                   "%s: not found (a model directory holds config.json and "
                                   "*.safetensors files)",
                                   file);
        free(file);
        return st;
    }
    loom_json *doc;
    loom_status st = loom_json_parse_file(ctx, file, &doc);
    if (st == LOOM_OK) {
        st = loom_config_override(ctx, doc, overrides);
        if (!st) st = loom_config_parse(ctx, doc, file, cfg);
        loom_json_free(doc);
        if (st) loom_config_free(cfg);
    }
    free(file);
    return st;
}

static const char *torch_dtype_name(loom_dtype dt) {
    return dt == LOOM_BF16 ? "bfloat16" : dt == LOOM_F16 ? "float16" : "float32";
}

loom_status loom_config_save(loom_ctx *ctx, const loom_model_config *cfg, const char *dir,
                             loom_dtype dtype) {
    loom_json *doc = loom_json_clone(ctx, cfg->raw);
    if (!doc) return LOOM_ERR_OOM;
    const char *key = cfg->v5_layout ? "dtype" : "torch_dtype";
    loom_status st = loom_json_set(ctx, doc, key, loom_json_new_str(ctx, torch_dtype_name(dtype)));
    loom_sb sb;
    loom_sb_init(&sb);
    if (!st) st = loom_json_write(ctx, doc, 2, &sb);
    if (!st) loom_sb_putc(&sb, '\n');
    if (!st && sb.failed) st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory writing config.json");
    char *path = st ? NULL : loom_path_join(ctx, dir, "config.json");
    if (!st && !path) st = LOOM_ERR_OOM;
    if (!st) st = loom_write_file_atomic(ctx, path, sb.buf, sb.len);
    free(path);
    loom_sb_free(&sb);
    loom_json_free(doc);
    return st;
}

loom_status loom_config_override(loom_ctx *ctx, loom_json *doc, const char *overrides) {
    if (!overrides || !*overrides) return LOOM_OK;
    loom_json *ov = NULL;
    loom_status st = loom_json_parse(ctx, overrides, strlen(overrides), "config overrides", &ov);
    if (st) return st;
    if (ov->type != LOOM_JSON_OBJECT || doc->type != LOOM_JSON_OBJECT)
        st = loom_errf(ctx, LOOM_ERR_CONFIG,
                       "config overrides must be a JSON object such as {\"num_hidden_layers\": 2}");
    /* a vision-language config (Qwen3.5) holds the text model under
     * text_config: a key goes there, and to the top level too where that
     * has it (tie_word_embeddings) */
    loom_json *tc = st ? NULL : (loom_json *)loom_json_get(doc, "text_config"); /* doc is ours */
    if (tc && tc->type != LOOM_JSON_OBJECT) tc = NULL;
    for (size_t i = 0; !st && i < ov->n; i++) {
        const bool at_top = !tc || loom_json_get(doc, ov->keys[i]);
        loom_json *item = at_top ? loom_json_clone(ctx, ov->items[i]) : NULL;
        st = !at_top ? LOOM_OK : item ? loom_json_set(ctx, doc, ov->keys[i], item) : LOOM_ERR_OOM;
        if (!st && tc) {
            item = loom_json_clone(ctx, ov->items[i]);
            st = item ? loom_json_set(ctx, tc, ov->keys[i], item) : LOOM_ERR_OOM;
        }
    }
    loom_json_free(ov);
    return st;
}
