/* The model module without a model object: config.json as the model reads
 * it, LoRA's target modules and the size of a saved adapter, and the device
 * memory a run will need, predicted from the shapes (meta.c). For what
 * happens before a model is created or without one: `loom inspect --mesh`,
 * the memory table every run prints first, the free-space checks of
 * --save-adapter. The model object itself is model.h. */
#ifndef LOOM_MODEL_META_H
#define LOOM_MODEL_META_H

#include "../io/hf_config.h"
#include "../parallel/mesh.h"

struct loom_slot; /* model.h */

/* LoRA targets are the block kinds' linears by PEFT module name (block.h's
 * loom_lora_target_name); a set of targets is a bool array of this many
 * (at least loom_lora_ntargets), by target number. */
enum { LOOM_LORA_NMOD = 32 };

/* LoRA target_modules ("all-linear" or a list of the block kinds' linears'
 * names: q_proj, ..., down_proj) as a set of target numbers. */
loom_status loom_lora_parse_targets(loom_ctx *ctx, const char *spec, bool target[LOOM_LORA_NMOD]);
/* Bytes of the tensors of a saved adapter (F32) of rank r on the targets,
 * for the free-space check of --save-adapter. */
uint64_t loom_lora_save_estimate(const loom_model_config *cfg, int r,
                                 const bool target[LOOM_LORA_NMOD]);

/* config.json of dir with the overrides applied (as loom_model_create reads it). */
loom_status loom_model_load_config(loom_ctx *ctx, const char *dir, const char *overrides,
                                   loom_model_config *cfg);

/* Device memory one rank needs, predicted from the shapes alone with the
 * layout code the model allocates with (`loom inspect --mesh`, and printed
 * by every run). The pipeline stage that needs the most is reported. */
typedef struct loom_mem_in {
    loom_mesh_sizes n;        /* resolved sizes */
    loom_dtype adt;           /* compute dtype */
    bool cuda;
    int lora_r;               /* 0: full fine-tuning */
    bool lora_target[LOOM_LORA_NMOD];
    int64_t micro_batch_size, seq; /* rows of one micro-batch, their length */
    int n_micro;                  /* micro-batches per forward_backward call */
    bool training;
    int64_t vocab_pad;        /* 0: 128 */
    loom_recompute recompute;
    double moe_capacity_factor; /* MoE: the experts' buffers sized by it (0: dropless) */
    /* Optional: called with each slot the stage holds (its local shape) */
    void (*on_slot)(void *u, const struct loom_slot *s);
    void *u;
} loom_mem_in;

typedef struct loom_mem_report {
    int pp_rank, in_flight;
    bool cuda;
    uint64_t weights;         /* master values and compute copies (base and adapter) */
    uint64_t grads, optim, acts, work, total;
    /* MoE models: what of the above is the experts'. A rank holds E/ep
     * experts of each MoE layer of its stage, each split over etp (gate/up
     * rows, down columns); their gradients are reduced and the distributed
     * optimizer shards them over edp (the router, replicated, goes with the
     * dense parameters over dp*cp). moe_acts: the MoE blocks' activations,
     * part of acts, sized for dropless routing's worst case (every token of
     * the ep x etp group to this rank's experts). */
    uint64_t expert_numel;    /* expert parameters held (floats, buckets padded) */
    uint64_t expert_weights, expert_grads, expert_optim, moe_acts;
} loom_mem_report;

loom_status loom_memory_predict(loom_ctx *ctx, const loom_model_config *cfg, const loom_mem_in *in,
                                loom_mem_report *out);

/* One log line: each class and the total. */
void loom_memory_print(loom_ctx *ctx, const loom_mem_report *r, loom_log_level level);

#endif /* LOOM_MODEL_META_H */
