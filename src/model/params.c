/* Parameter plans, built-in model shapes, and random-weight checkpoints. */
#include "params.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rng.h"
#include "../io/export.h"
#include "../io/outdir.h"
#include "../io/safetensors.h"
#include "block.h"

static const char *comp_names[LOOM_COMP_COUNT] = {
    "embedding", "attention", "mlp", "router", "experts", "norms", "lm_head"};

const char *loom_component_name(loom_component c) {
    return (int)c >= 0 && c < LOOM_COMP_COUNT ? comp_names[c] : "?";
}

int64_t loom_param_numel(const loom_param_spec *p) {
    return p->ndim == 1 ? p->shape[0] : p->shape[0] * p->shape[1];
}

void loom_param_plan_free(loom_param_plan *plan) {
    if (!plan) return;
    for (size_t i = 0; i < plan->n; i++) free(plan->p[i].name);
    free(plan->p);
    plan->p = NULL;
    plan->n = 0;
}

/* The plan being built; inside a layer, the block whose tensors come. */
struct loom_param_sink {
    loom_ctx *ctx;
    loom_param_plan *plan;
    size_t cap;
    loom_status st;
    int64_t layer;
    int block;
    const loom_block_kind *kind;
};

static void add(loom_param_sink *b, loom_component comp, int64_t expert, int slot, int64_t d0,
                int64_t d1, const char *fmt, ...) LOOM_PRINTF(7, 8);

static void add(loom_param_sink *b, loom_component comp, int64_t expert, int slot, int64_t d0,
                int64_t d1, const char *fmt, ...) {
    if (b->st) return;
    if (b->plan->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        loom_param_spec *p = loom_realloc(b->ctx, b->plan->p, cap * sizeof *p, "parameter plan");
        if (!p) {
            b->st = LOOM_ERR_OOM;
            return;
        }
        b->plan->p = p;
        b->cap = cap;
    }
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    loom_param_spec *s = &b->plan->p[b->plan->n];
    s->name = loom_strdup(b->ctx, name);
    if (!s->name) {
        b->st = LOOM_ERR_OOM;
        return;
    }
    s->ndim = d1 > 0 ? 2 : 1;
    s->shape[0] = d0;
    s->shape[1] = d1 > 0 ? d1 : 0;
    s->comp = comp;
    s->layer = b->layer;
    s->expert = expert;
    s->block = b->layer >= 0 ? b->block : -1;
    s->slot = b->layer >= 0 ? slot : -1;
    s->nparts = 0;
    b->plan->n++;
}

/* a layer tensor: "model.layers.<l>." and the leaf (formatted with the expert) */
static void put(loom_param_sink *s, int slot, int64_t e, int64_t d0, int64_t d1) {
    const loom_block_slot *k = &s->kind->slots[slot];
    char leaf[160];
    snprintf(leaf, sizeof leaf, k->leaf, (long long)e);
    add(s, k->comp, e, slot, d0, d1, "model.layers.%lld.%s", (long long)s->layer, leaf);
}

void loom_param_put(loom_param_sink *s, int slot, int64_t d0, int64_t d1) {
    put(s, slot, -1, d0, d1);
}

void loom_param_put_expert(loom_param_sink *s, int slot, int64_t e, int64_t d0, int64_t d1) {
    put(s, slot, e, d0, d1);
}

void loom_param_put_parts(loom_param_sink *s, int slot, int64_t d1, int nparts,
                          const int64_t *part) {
    int64_t d0 = 0;
    for (int k = 0; k < nparts; k++) d0 += part[k];
    put(s, slot, -1, d0, d1);
    if (s->st) return;
    loom_param_spec *p = &s->plan->p[s->plan->n - 1];
    p->nparts = nparts;
    for (int k = 0; k < nparts; k++) p->part[k] = part[k];
}

loom_ctx *loom_param_sink_ctx(loom_param_sink *s) { return s->ctx; }

/* Layer l: each block's input norm, then the block's own tensors. */
static void add_layer(loom_param_sink *b, const loom_model_config *c, int64_t l) {
    const loom_block_kind *k[LOOM_LAYER_MAX_BLOCKS];
    const int nb = loom_layer_kinds(c, l, k);
    b->layer = l;
    for (int j = 0; j < nb && !b->st; j++) {
        b->block = j;
        b->kind = k[j];
        add(b, LOOM_COMP_NORM, -1, LOOM_SLOT_NORM, c->hidden_size, 0, "model.layers.%lld.%s",
            (long long)l, k[j]->norm);
        loom_status st = k[j]->params(c, l, b);
        if (st && !b->st) b->st = st;
    }
    b->layer = -1;
}

loom_status loom_param_plan_build(loom_ctx *ctx, const loom_model_config *c,
                                  loom_param_plan *plan) {
    memset(plan, 0, sizeof *plan);
    loom_param_sink b = {.ctx = ctx, .plan = plan, .layer = -1};
    const int64_t H = c->hidden_size;
    add(&b, LOOM_COMP_EMBED, -1, -1, c->vocab_size, H, "model.embed_tokens.weight");
    for (int64_t l = 0; l < c->num_layers; l++) add_layer(&b, c, l);
    add(&b, LOOM_COMP_NORM, -1, -1, H, 0, "model.norm.weight");
    if (!c->tie_word_embeddings)
        add(&b, LOOM_COMP_HEAD, -1, -1, c->vocab_size, H, "lm_head.weight");
    if (b.st) loom_param_plan_free(plan);
    return b.st;
}

int64_t loom_param_plan_count(const loom_param_plan *plan, int64_t *counts) {
    int64_t total = 0;
    if (counts) memset(counts, 0, sizeof(int64_t) * LOOM_COMP_COUNT);
    for (size_t i = 0; i < plan->n; i++) {
        int64_t n = loom_param_numel(&plan->p[i]);
        total += n;
        if (counts) counts[plan->p[i].comp] += n;
    }
    return total;
}

/* ---- built-in shapes ---- */

#define QWEN3_COMMON                                                                         \
    "\"attention_bias\": false, \"attention_dropout\": 0.0, \"hidden_act\": \"silu\", "      \
    "\"initializer_range\": 0.02, \"rms_norm_eps\": 1e-06, \"rope_scaling\": null, "         \
    "\"sliding_window\": null, \"use_cache\": true, \"use_sliding_window\": false, "

/* Qwen3.5's text model (the hub's text_config, text-only layout): three
 * Gated DeltaNet layers, then one of gated attention */
#define QWEN35_COMMON                                                                        \
    "\"architectures\": [\"Qwen3_5ForCausalLM\"], \"model_type\": \"qwen3_5_text\", "        \
    "\"attention_bias\": false, \"attn_output_gate\": true, \"hidden_act\": \"silu\", "      \
    "\"initializer_range\": 0.02, \"rms_norm_eps\": 1e-06, \"linear_conv_kernel_dim\": 4, "    \
    "\"full_attention_interval\": 4, \"max_position_embeddings\": 262144, "                  \
    "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000000, "           \
    "\"partial_rotary_factor\": 0.25}, \"torch_dtype\": \"bfloat16\", "
#define QWEN35_FOUR                                                                          \
    "\"linear_attention\", \"linear_attention\", \"linear_attention\", \"full_attention\""
#define QWEN35_TWENTY_FOUR                                                                   \
    QWEN35_FOUR ", " QWEN35_FOUR ", " QWEN35_FOUR ", " QWEN35_FOUR ", " QWEN35_FOUR ", " QWEN35_FOUR

static const struct {
    const char *name, *json;
} presets[] = {
    {"tiny-qwen3",
     "{\"architectures\": [\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\", " QWEN3_COMMON
     "\"head_dim\": 16, \"hidden_size\": 64, \"intermediate_size\": 128, "
     "\"max_position_embeddings\": 512, \"num_attention_heads\": 4, \"num_hidden_layers\": 4, "
     "\"num_key_value_heads\": 2, \"rope_theta\": 1000000.0, \"tie_word_embeddings\": true, "
     "\"torch_dtype\": \"float32\", \"vocab_size\": 1024}"},
    {"tiny-qwen2",
     "{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", "
     "\"hidden_act\": \"silu\", \"initializer_range\": 0.02, \"rms_norm_eps\": 1e-06, "
     "\"hidden_size\": 64, \"intermediate_size\": 128, \"max_position_embeddings\": 512, "
     "\"num_attention_heads\": 4, \"num_hidden_layers\": 4, \"num_key_value_heads\": 2, "
     "\"rope_theta\": 1000000.0, \"tie_word_embeddings\": false, \"use_sliding_window\": false, "
     "\"torch_dtype\": \"float32\", \"vocab_size\": 1024}"},
    {"tiny-llama",
     "{\"architectures\": [\"LlamaForCausalLM\"], \"model_type\": \"llama\", "
     "\"attention_bias\": false, \"mlp_bias\": false, \"hidden_act\": \"silu\", "
     "\"initializer_range\": 0.02, \"rms_norm_eps\": 1e-06, \"hidden_size\": 64, "
     "\"intermediate_size\": 128, \"max_position_embeddings\": 512, \"num_attention_heads\": 4, "
     "\"num_hidden_layers\": 4, \"num_key_value_heads\": 2, \"rope_theta\": 500000.0, "
     "\"tie_word_embeddings\": false, \"torch_dtype\": \"float32\", \"vocab_size\": 1024}"},
    {"tiny-qwen3-moe",
     "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", " QWEN3_COMMON
     "\"head_dim\": 16, \"hidden_size\": 64, \"intermediate_size\": 128, "
     "\"moe_intermediate_size\": 32, \"num_experts\": 8, \"num_experts_per_tok\": 2, "
     "\"norm_topk_prob\": true, \"decoder_sparse_step\": 1, \"mlp_only_layers\": [], "
     "\"router_aux_loss_coef\": 0.01, \"max_position_embeddings\": 512, "
     "\"num_attention_heads\": 4, \"num_hidden_layers\": 4, \"num_key_value_heads\": 2, "
     "\"rope_theta\": 1000000.0, \"tie_word_embeddings\": false, \"torch_dtype\": \"float32\", "
     "\"vocab_size\": 1024}"},
    {"tiny-qwen2-moe",
     "{\"architectures\": [\"Qwen2MoeForCausalLM\"], \"model_type\": \"qwen2_moe\", "
     "\"hidden_act\": \"silu\", \"initializer_range\": 0.02, \"rms_norm_eps\": 1e-06, "
     "\"hidden_size\": 64, \"intermediate_size\": 96, \"moe_intermediate_size\": 32, "
     "\"shared_expert_intermediate_size\": 48, \"num_experts\": 8, "
     "\"num_experts_per_tok\": 2, \"norm_topk_prob\": false, \"decoder_sparse_step\": 1, "
     "\"mlp_only_layers\": [2], \"router_aux_loss_coef\": 0.01, \"qkv_bias\": true, "
     "\"max_position_embeddings\": 512, \"num_attention_heads\": 4, "
     "\"num_hidden_layers\": 4, \"num_key_value_heads\": 2, \"rope_theta\": 1000000.0, "
     "\"sliding_window\": null, \"use_sliding_window\": false, "
     "\"tie_word_embeddings\": false, \"torch_dtype\": \"float32\", \"vocab_size\": 1024}"},
    {"qwen3-0.6b",
     "{\"architectures\": [\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\", " QWEN3_COMMON
     "\"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, "
     "\"hidden_size\": 1024, \"intermediate_size\": 3072, \"max_position_embeddings\": 40960, "
     "\"max_window_layers\": 28, \"num_attention_heads\": 16, \"num_hidden_layers\": 28, "
     "\"num_key_value_heads\": 8, \"rope_theta\": 1000000, \"tie_word_embeddings\": true, "
     "\"torch_dtype\": \"bfloat16\", \"vocab_size\": 151936}"},
    {"qwen3-4b",
     "{\"architectures\": [\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\", " QWEN3_COMMON
     "\"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, "
     "\"hidden_size\": 2560, \"intermediate_size\": 9728, \"max_position_embeddings\": 40960, "
     "\"max_window_layers\": 36, \"num_attention_heads\": 32, \"num_hidden_layers\": 36, "
     "\"num_key_value_heads\": 8, \"rope_theta\": 1000000, \"tie_word_embeddings\": true, "
     "\"torch_dtype\": \"bfloat16\", \"vocab_size\": 151936}"},
    {"qwen3-8b",
     "{\"architectures\": [\"Qwen3ForCausalLM\"], \"model_type\": \"qwen3\", " QWEN3_COMMON
     "\"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, "
     "\"hidden_size\": 4096, \"intermediate_size\": 12288, \"max_position_embeddings\": 40960, "
     "\"max_window_layers\": 36, \"num_attention_heads\": 32, \"num_hidden_layers\": 36, "
     "\"num_key_value_heads\": 8, \"rope_theta\": 1000000, \"tie_word_embeddings\": false, "
     "\"torch_dtype\": \"bfloat16\", \"vocab_size\": 151936}"},
    {"qwen3-30b-a3b",
     "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", " QWEN3_COMMON
     "\"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, "
     "\"hidden_size\": 2048, \"intermediate_size\": 6144, \"moe_intermediate_size\": 768, "
     "\"num_experts\": 128, \"num_experts_per_tok\": 8, \"norm_topk_prob\": true, "
     "\"decoder_sparse_step\": 1, \"mlp_only_layers\": [], \"router_aux_loss_coef\": 0.001, "
     "\"max_position_embeddings\": 40960, \"max_window_layers\": 48, "
     "\"num_attention_heads\": 32, \"num_hidden_layers\": 48, \"num_key_value_heads\": 4, "
     "\"rope_theta\": 1000000.0, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", "
     "\"vocab_size\": 151936}"},
    /* tests/fixtures_qwen3_5's tiny-qwen3_5, text only */
    {"tiny-qwen3.5",
     "{" QWEN35_COMMON "\"head_dim\": 16, \"hidden_size\": 64, \"intermediate_size\": 128, "
     "\"layer_types\": [" QWEN35_FOUR "], \"linear_key_head_dim\": 16, "
     "\"linear_num_key_heads\": 2, \"linear_num_value_heads\": 4, "
     "\"linear_value_head_dim\": 16, \"num_attention_heads\": 4, \"num_hidden_layers\": 4, "
     "\"num_key_value_heads\": 2, \"tie_word_embeddings\": true, \"vocab_size\": 1024}"},
    /* Qwen/Qwen3.5-0.8B's and -4B's text_config */
    {"qwen3.5-0.8b",
     "{" QWEN35_COMMON "\"eos_token_id\": 248044, \"head_dim\": 256, \"hidden_size\": 1024, "
     "\"intermediate_size\": 3584, \"layer_types\": [" QWEN35_TWENTY_FOUR "], "
     "\"linear_key_head_dim\": 128, \"linear_num_key_heads\": 16, "
     "\"linear_num_value_heads\": 16, \"linear_value_head_dim\": 128, "
     "\"num_attention_heads\": 8, \"num_hidden_layers\": 24, \"num_key_value_heads\": 2, "
     "\"tie_word_embeddings\": true, \"vocab_size\": 248320}"},
    {"qwen3.5-4b",
     "{" QWEN35_COMMON "\"eos_token_id\": 248044, \"head_dim\": 256, \"hidden_size\": 2560, "
     "\"intermediate_size\": 9216, \"layer_types\": [" QWEN35_TWENTY_FOUR ", " QWEN35_FOUR
     ", " QWEN35_FOUR "], \"linear_key_head_dim\": 128, \"linear_num_key_heads\": 16, "
     "\"linear_num_value_heads\": 32, \"linear_value_head_dim\": 128, "
     "\"num_attention_heads\": 16, \"num_hidden_layers\": 32, \"num_key_value_heads\": 4, "
     "\"tie_word_embeddings\": true, \"vocab_size\": 248320}"},
};

const char *loom_preset_config(const char *name) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (!strcmp(presets[i].name, name)) return presets[i].json;
    return NULL;
}

/* ---- random checkpoints ---- */

/* The plan's tensors with random values: norms 1, biases 0, matrices
 * normal(0, std) from (seed, the tensor's name, the index); the token
 * embedding normal(0, embed_std). */
typedef struct random_src {
    const loom_model_config *cfg;
    const loom_param_plan *plan;
    uint64_t seed;
    double std, embed_std;
    float norm_w; /* a norm's weight: 1, or 0 for zero-centred ones (1 + w) */
} random_src;

static void random_info(void *u, size_t i, char *name, size_t cap, int *ndim, int64_t shape[2]) {
    const loom_param_spec *p = &((const random_src *)u)->plan->p[i];
    snprintf(name, cap, "%s", p->name);
    *ndim = p->ndim;
    shape[0] = p->shape[0];
    shape[1] = p->shape[1];
}

static loom_status random_fetch(void *u, size_t i, float *buf) {
    const random_src *r = u;
    const loom_param_spec *p = &r->plan->p[i];
    const size_t n = (size_t)loom_param_numel(p);
    const char *leaf = strrchr(p->name, '.');
    const uint64_t key = loom_hash_str(p->name);
    const loom_block_kind *k[LOOM_LAYER_MAX_BLOCKS];
    const loom_init init = p->slot >= 0 && loom_layer_kinds(r->cfg, p->layer, k) > p->block
                               ? k[p->block]->slots[p->slot].init
                               : LOOM_INIT_SHAPE;
    if (init == LOOM_INIT_ONES || init == LOOM_INIT_LOG_U16) {
        for (size_t j = 0; j < n; j++)
            buf[j] = init == LOOM_INIT_ONES
                         ? 1.0f
                         : (float)log(16.0 * loom_rng_uniform(r->seed, key, (uint64_t)j));
        return LOOM_OK;
    }
    if (p->ndim == 1) {
        const float v = leaf && !strcmp(leaf, ".bias") ? 0.0f : r->norm_w;
        for (size_t j = 0; j < n; j++) buf[j] = v;
        return LOOM_OK;
    }
    const size_t nl = strlen(p->name), ne = strlen("embed_tokens.weight");
    const bool embed = nl >= ne && !strcmp(p->name + nl - ne, "embed_tokens.weight");
    loom_rng_normal_fill(r->seed, key, 0, n, embed ? r->embed_std : r->std, buf);
    return LOOM_OK;
}

loom_status loom_write_random_model(loom_ctx *ctx, const loom_model_config *cfg,
                                    const char *out_dir, uint64_t seed, double embed_std,
                                    loom_dtype dtype, uint64_t max_shard_bytes) {
    double std = 0.02;
    loom_status st = loom_json_get_num_opt(ctx, cfg->raw, "initializer_range", "config", &std);
    if (st) return st;
    if (!(embed_std >= 0) || !isfinite(embed_std))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "init_embedding_std = %g: give 0 (the "
                         "config's initializer_range) or a positive standard deviation", embed_std);
    loom_param_plan plan;
    if ((st = loom_param_plan_build(ctx, cfg, &plan))) return st;
    random_src r = {cfg, &plan, seed, std, embed_std > 0 ? embed_std : std,
                    cfg->norm_offset ? 0.0f : 1.0f};
    const loom_tensor_source src = {&r, plan.n, random_info, random_fetch};
    st = loom_hf_dir_write(ctx, "out", out_dir, true, &src, dtype, max_shard_bytes, cfg, NULL,
                           false);
    loom_param_plan_free(&plan);
    return st;
}

loom_status loom_hf_save_estimate(loom_ctx *ctx, const loom_model_config *cfg,
                                  const char *model_dir, loom_dtype dtype, uint64_t *bytes) {
    *bytes = 0;
    loom_param_plan plan;
    loom_status st = loom_param_plan_build(ctx, cfg, &plan);
    if (st) return st;
    if (dtype == LOOM_DTYPE_COUNT && model_dir) { /* the checkpoint's own: its first tensor's */
        loom_safetensors *in = NULL;
        if ((st = loom_hf_dir_open(ctx, model_dir, &in)) == LOOM_OK)
            for (size_t i = 0; i < plan.n && dtype == LOOM_DTYPE_COUNT; i++) {
                const loom_st_tensor *t = loom_st_find(in, plan.p[i].name);
                if (t) dtype = t->dtype;
            }
        loom_st_close(in);
    }
    if (dtype == LOOM_DTYPE_COUNT) dtype = LOOM_F32;
    if (!st) {
        *bytes = (uint64_t)loom_param_plan_count(&plan, NULL) * loom_dtype_size(dtype);
        if (model_dir) *bytes += loom_out_side_files_size(model_dir);
    }
    loom_param_plan_free(&plan);
    return st;
}
