/* The directories transformers, PEFT and vLLM load, written whole (outdir):
 * a Hugging Face model directory and a PEFT LoRA adapter, and the adapter's
 * adapter_config.json read back. The model hands its tensors over one at a
 * time through a loom_tensor_source; io/ knows the file layouts, model/
 * knows none of them. */
#ifndef LOOM_IO_EXPORT_H
#define LOOM_IO_EXPORT_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/core.h"
#include "hf_config.h"

/* Tensors produced one at a time. info names tensor i (0 <= i < n) and
 * gives its shape; fetch puts its values (fp32, row-major) in dst. Under a
 * mesh every rank calls fetch for every tensor in the same order (it
 * gathers), whatever the writer's state; only the writer writes. The order
 * is 0, 1, ..., n - 1, except where the experts are written fused
 * (loom_hf_dir_write): there each layer's experts are fetched in the order
 * of the fused tensors (gate 0, up 0, gate 1, up 1, ..., then down 0,
 * down 1, ...). */
typedef struct loom_tensor_source {
    void *u;
    size_t n;
    void (*info)(void *u, size_t i, char *name, size_t cap, int *ndim, int64_t shape[2]);
    loom_status (*fetch)(void *u, size_t i, float *dst);
} loom_tensor_source;

/* A Hugging Face model directory at dir: model.safetensors (or shards of
 * at most max_shard_bytes with their index) in dtype, config.json from cfg,
 * and the tokenizer and generation files found in side_dir (may be NULL).
 * Collective through src->fetch; writer: this rank writes. what: the
 * option naming dir in errors ("save_hf", "out"). fused_experts: src's
 * per-expert tensors of the hub layout (<P>experts.<e>.{gate,up,down}_proj
 * .weight) are written as transformers v5's fused <P>experts.gate_up_proj
 * [E, 2I, H] and <P>experts.down_proj [E, H, I] (hf_experts.h); refused
 * with per-expert biases, which that layout does not have. */
loom_status loom_hf_dir_write(loom_ctx *ctx, const char *what, const char *dir, bool writer,
                              const loom_tensor_source *src, loom_dtype dtype,
                              uint64_t max_shard_bytes, const loom_model_config *cfg,
                              const char *side_dir, bool fused_experts);

/* A PEFT LoRA adapter's settings, as adapter_config.json holds them. */
typedef struct loom_peft_config {
    int64_t r;
    double lora_alpha, lora_dropout;
    bool use_rslora;
    char target_modules[256]; /* comma-separated module names, or "all-linear" */
    char base_model[1024];    /* base_model_name_or_path ("" when absent) */
} loom_peft_config;

/* adapter_config.json of the adapter directory dir. Refused, naming the
 * file and the key: a missing file, another peft_type, DoRA, fan_in_fan_out,
 * per-module ranks or alphas, extra trained modules, layers_to_transform,
 * target_parameters, biases, bad target_modules. */
loom_status loom_peft_config_read(loom_ctx *ctx, const char *dir, loom_peft_config *out);

/* A PEFT adapter directory at dir: adapter_model.safetensors (src, in
 * dtype) and adapter_config.json from c, with target_modules the names
 * given (ntargets). Collective through src->fetch; writer: this rank writes. */
loom_status loom_peft_dir_write(loom_ctx *ctx, const char *dir, bool writer,
                                const loom_tensor_source *src, loom_dtype dtype,
                                const loom_peft_config *c, const char *const *targets,
                                int ntargets);

/* PEFT's name of a decoder layer's LoRA weight: "base_model.model.<text
 * prefix>layers.<layer>.<block>.<module>.lora_<A|B>.weight", text_prefix
 * the checkpoint's (loom_config_text_prefix: "model." for a text-only one,
 * "model.language_model." for a vision-language one, whose PEFT model wraps
 * the ...ForConditionalGeneration) (block: self_attn, mlp,
 * mlp.shared_expert, or an expert's mlp.experts.<e>). parse takes either
 * layout and gives layer, the expert (-1: not an expert's), the block (an
 * expert's: mlp.experts), module, 'A'/'B' and whether the name had the
 * vision-language prefix (nested may be NULL); false for any other name. */
void loom_peft_weight_name(char *buf, size_t cap, const char *text_prefix, int64_t layer,
                           const char *block, const char *module, char ab);
bool loom_peft_weight_parse(const char *name, int64_t *layer, int64_t *expert, char block[64],
                            char module[32], char *ab, bool *nested);

/* ---- reading ---- */

/* The weights of a Hugging Face model directory (model.safetensors, or its
 * shards through model.safetensors.index.json), by HF name. The fused
 * experts of transformers v5 (<P>experts.gate_up_proj, <P>experts.down_proj)
 * are found under the hub's per-expert names instead, as views of them
 * (hf_experts.h says what is refused). */
struct loom_safetensors;
loom_status loom_hf_dir_open(loom_ctx *ctx, const char *dir, struct loom_safetensors **out);
/* Whether the checkpoint loom_hf_dir_open read has its experts fused: save
 * it with fused_experts to keep its layout. */
bool loom_hf_dir_experts_fused(const struct loom_safetensors *st);
/* A tensor of a vision-language checkpoint (cfg->nested_text) outside its
 * text model (the vision tower, the mtp head): loom carries it through
 * every export as read. */
bool loom_hf_carried(const loom_model_config *cfg, const char *name);

/* A PEFT adapter directory opened for reading: adapter_config.json's
 * settings (checked as loom_peft_config_read does) and the tensors of
 * adapter_model.safetensors. */
typedef struct loom_peft_dir loom_peft_dir;
loom_status loom_peft_dir_open(loom_ctx *ctx, const char *dir, loom_peft_dir **out);
void loom_peft_dir_close(loom_peft_dir *d);
const loom_peft_config *loom_peft_dir_config(const loom_peft_dir *d);
const char *loom_peft_dir_config_path(const loom_peft_dir *d); /* for messages */
size_t loom_peft_dir_count(const loom_peft_dir *d);

/* Tensor i of the adapter file; `lora` false when its name is not a decoder
 * layer's LoRA weight (loom_peft_weight_parse), else layer, block, module and ab
 * set. A tensor of another dtype than F32, BF16, F16 or F64 is refused
 * here, naming it. */
typedef struct loom_peft_tensor {
    const char *name;
    bool lora;
    int64_t layer;
    int64_t expert;        /* an expert's module (mlp.experts.<e>.<module>), else -1 */
    bool nested;           /* named under model.language_model. (a vision-language model's) */
    char block[64];        /* the module's path in the layer: self_attn, mlp.shared_expert */
    char module[32];
    char ab;               /* 'A' or 'B' */
    int ndim;
    int64_t shape[2];      /* shape[1] 0 for 1-D */
    loom_dtype dtype;
    const void *data;      /* in the mapping, valid until close */
} loom_peft_tensor;
loom_status loom_peft_dir_tensor(loom_ctx *ctx, const loom_peft_dir *d, size_t i,
                                 loom_peft_tensor *t);

/* Whether the base an adapter names (base_model_name_or_path) is a local
 * directory with a config.json; out its model_type ("" when unreadable). */
bool loom_peft_base_model_type(const char *base, char *out, size_t cap);

#endif /* LOOM_IO_EXPORT_H */
