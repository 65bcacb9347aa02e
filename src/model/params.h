/* The parameter plan of an architecture: every tensor a checkpoint of this
 * config holds, with its Hugging Face name, shape and component. It is how
 * loom checks a checkpoint against its config, counts parameters, and later
 * lays out and shards the weights. */
#ifndef LOOM_PARAMS_H
#define LOOM_PARAMS_H

#include "../io/hf_config.h"

typedef enum loom_component {
    LOOM_COMP_EMBED = 0, /* token embedding */
    LOOM_COMP_ATTN,      /* q/k/v/o projections, their biases, q/k norms */
    LOOM_COMP_MLP,       /* dense gate/up/down */
    LOOM_COMP_ROUTER,    /* MoE router */
    LOOM_COMP_EXPERTS,   /* MoE expert gate/up/down */
    LOOM_COMP_NORM,      /* input / post-attention / final RMSNorm weights */
    LOOM_COMP_HEAD,      /* output layer (absent when tied) */
    LOOM_COMP_COUNT
} loom_component;

/* How a tensor is split over tensor-parallel ranks: not (replicated), by
 * rows (column-parallel linears, the vocabulary) or by columns
 * (row-parallel linears). */
typedef enum loom_shard { LOOM_SHARD_NONE = 0, LOOM_SHARD_ROWS, LOOM_SHARD_COLS } loom_shard;

/* Parts of a fused tensor's rows at most (loom_param_spec.part). */
#define LOOM_ROW_PARTS_MAX 4

/* A layer tensor's slot in its block (block.h) when it is the block's input
 * norm, which the layer walker owns. */
#define LOOM_SLOT_NORM (-2)

typedef struct loom_param_spec {
    char *name;          /* HF name, e.g. "model.layers.0.self_attn.q_proj.weight" */
    int ndim;            /* 1 or 2 */
    int64_t shape[2];
    loom_component comp;
    int64_t layer;       /* -1 outside the decoder layers */
    int64_t expert;      /* -1 unless an expert weight */
    int block;           /* inside a layer: its block (block.h), else -1 */
    int slot;            /* the block kind's slot, or LOOM_SLOT_NORM; -1 outside layers */
    int nparts;          /* 0, or its rows are nparts fused tensors of part[k] rows each (Gated
                          * DeltaNet's in_proj_qkv: q, k, v), each split over tp on its own */
    int64_t part[LOOM_ROW_PARTS_MAX];
} loom_param_spec;

typedef struct loom_param_plan {
    loom_param_spec *p;
    size_t n;
} loom_param_plan;

loom_status loom_param_plan_build(loom_ctx *ctx, const loom_model_config *cfg,
                                  loom_param_plan *plan);
void loom_param_plan_free(loom_param_plan *plan);
int64_t loom_param_numel(const loom_param_spec *p);
const char *loom_component_name(loom_component c);
/* Total parameter count, and per component (counts[LOOM_COMP_COUNT], may be NULL). */
int64_t loom_param_plan_count(const loom_param_plan *plan, int64_t *counts);

/* Built-in model shapes (config.json text in the classic hub layout):
 * tiny-qwen3, tiny-qwen2, tiny-llama, tiny-qwen3-moe, tiny-qwen2-moe (the
 * shape of tests/fixtures_moe's), qwen3-0.6b, qwen3-4b, qwen3-8b,
 * qwen3-30b-a3b, and Qwen3.5's text models: tiny-qwen3.5 (the fixture's
 * shape), qwen3.5-0.8b, qwen3.5-4b. NULL for an unknown name. */
const char *loom_preset_config(const char *name);

/* Writes a model directory (config.json + safetensors) with random weights:
 * matrices and embeddings ~ N(0, initializer_range (default 0.02)), norm
 * weights 1 (0 where they are zero-centred: Qwen3.5's 1 + w), biases 0, a
 * kind's own tensors as transformers initialises them (block.h's
 * loom_init: Gated DeltaNet's A_log = log(U(0, 16)), dt_bias and gated
 * norm 1); embed_std > 0 gives the token embedding that std
 * instead (0: initializer_range). Values depend only on (seed, tensor name,
 * element index), not on the shard layout. */
loom_status loom_write_random_model(loom_ctx *ctx, const loom_model_config *cfg,
                                    const char *out_dir, uint64_t seed, double embed_std,
                                    loom_dtype dtype, uint64_t max_shard_bytes);

/* Bytes a saved HF directory of this config takes: the parameters in dtype
 * (LOOM_DTYPE_COUNT: that of model_dir's weights, F32 when unknown) plus
 * model_dir's tokenizer files (model_dir may be NULL). For the free-space
 * check made before any work (src/io/outdir.h). */
loom_status loom_hf_save_estimate(loom_ctx *ctx, const loom_model_config *cfg,
                                  const char *model_dir, loom_dtype dtype, uint64_t *bytes);

#endif /* LOOM_PARAMS_H */
