/* loom: a distributed LLM training engine in C.
 *
 * This is the only published header. Every public function returns a
 * loom_status; on failure the context keeps a message that says what went
 * wrong and what to do (loom_last_error). The library never exits the
 * process and keeps no global state: everything lives in a loom_ctx.
 */
#ifndef LOOM_H
#define LOOM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with hidden visibility (-fvisibility=hidden): what
 * this header declares is all libloom.so exports. */
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC visibility push(default)
#endif

#define LOOM_VERSION_MAJOR 0
#define LOOM_VERSION_MINOR 1
#define LOOM_VERSION_PATCH 0

typedef enum loom_status {
    LOOM_OK = 0,
    LOOM_ERR_INVALID_ARG,  /* a caller passed something that cannot be used */
    LOOM_ERR_IO,           /* open/read/write/mmap of a file failed */
    LOOM_ERR_FORMAT,       /* a file's contents are malformed (JSON, safetensors, ...) */
    LOOM_ERR_CONFIG,       /* a configuration is missing a field or has a bad value */
    LOOM_ERR_UNSUPPORTED,  /* well-formed, but not something loom implements */
    LOOM_ERR_SHAPE,        /* tensor shapes or sizes do not agree */
    LOOM_ERR_NOT_FOUND,    /* a named tensor, file or key does not exist */
    LOOM_ERR_OOM,          /* an allocation failed */
    LOOM_ERR_DEVICE,       /* CUDA / cuBLASLt / cuDNN error */
    LOOM_ERR_COMM,         /* a collective failed or timed out */
    LOOM_ERR_INTERNAL,     /* a broken invariant inside loom: a bug */
    LOOM_STATUS_COUNT
} loom_status;

typedef enum loom_dtype {
    LOOM_F32 = 0,
    LOOM_BF16,
    LOOM_F16,
    LOOM_F64,
    LOOM_I64,
    LOOM_I32,
    LOOM_I16,
    LOOM_I8,
    LOOM_U8,
    LOOM_BOOL,
    LOOM_DTYPE_COUNT
} loom_dtype;

typedef enum loom_log_level {
    LOOM_LOG_ERROR = 0,
    LOOM_LOG_WARN,
    LOOM_LOG_INFO,
    LOOM_LOG_DEBUG
} loom_log_level;

typedef struct loom_ctx loom_ctx;

/* Context: last-error text, rank, logging. */
loom_status loom_ctx_create(loom_ctx **out);
void loom_ctx_free(loom_ctx *ctx);
const char *loom_last_error(const loom_ctx *ctx);
void loom_clear_error(loom_ctx *ctx);
/* Rank and world size, used to prefix log lines ("[rank 3/8]"). */
void loom_ctx_set_rank(loom_ctx *ctx, int rank, int world_size);
void loom_ctx_set_log_level(loom_ctx *ctx, loom_log_level level);
loom_log_level loom_ctx_log_level(const loom_ctx *ctx);

const char *loom_status_str(loom_status st);
const char *loom_version(void);
/* What this build has, space-separated: "cpu openmp blas mpi gloo cuda"
 * (those built in). */
const char *loom_features(void);
/* GPUs this process can see (0 in a build without CUDA, or none visible). */
int loom_gpu_count(void);

/* dtypes: names as safetensors spells them ("F32", "BF16", ...). */
const char *loom_dtype_name(loom_dtype dt);
size_t loom_dtype_size(loom_dtype dt);
/* Returns 0 and sets *out when the name is known, -1 otherwise. */
int loom_dtype_from_name(const char *name, loom_dtype *out);

/* ---- Learning-rate and weight-decay schedule (Megatron's
 * OptimizerParamScheduler). The k-th optimizer step uses lr(k-1), wd(k-1). */
typedef enum loom_lr_decay_style {
    LOOM_LR_CONSTANT = 0,
    LOOM_LR_LINEAR,
    LOOM_LR_COSINE,
    LOOM_LR_INVERSE_SQRT, /* "inverse-square-root" */
    LOOM_LR_WSD,          /* warmup-stable-decay: constant, then anneal over wsd_decay_steps */
    LOOM_LR_STYLE_COUNT
} loom_lr_decay_style;

/* How WSD anneals over its last wsd_decay_steps steps. */
typedef enum loom_wsd_style {
    LOOM_WSD_LINEAR = 0,
    LOOM_WSD_COSINE,
    LOOM_WSD_EXPONENTIAL, /* Megatron's default for --lr-wsd-decay-style */
    LOOM_WSD_MINUS_SQRT,
    LOOM_WSD_STYLE_COUNT
} loom_wsd_style;

typedef enum loom_wd_incr_style {
    LOOM_WD_CONSTANT = 0,
    LOOM_WD_LINEAR,
    LOOM_WD_COSINE,
    LOOM_WD_STYLE_COUNT
} loom_wd_incr_style;

typedef struct loom_sched_config {
    double init_lr, max_lr, min_lr;   /* warmup goes init_lr -> max_lr; decay max_lr -> min_lr */
    int64_t lr_warmup_steps;          /* 0: no warmup */
    int64_t lr_decay_steps;           /* > lr_warmup_steps; after it lr = min_lr */
    loom_lr_decay_style lr_decay_style;
    int64_t wsd_decay_steps;          /* WSD only: length of the anneal; -1 = not set */
    loom_wsd_style lr_wsd_decay_style;
    double start_wd, end_wd;          /* weight decay goes start_wd -> end_wd */
    int64_t wd_incr_steps;            /* after it wd = end_wd */
    loom_wd_incr_style wd_incr_style;
} loom_sched_config;

/* Defaults: constant lr 1e-4 (init 0, min 0), no warmup, decay_steps 1,
 * wd 0.01 constant. */
loom_sched_config loom_sched_config_default(void);

/* ---- Models ----
 * A model is created from a Hugging Face directory (config.json and
 * model.safetensors, or shards with model.safetensors.index.json). It keeps
 * the parameters under their HF names. Training follows the verbs of
 * Megatron's MegatronModel: set_optimizer, set_lr_scheduler,
 * forward_backward (any number of calls accumulate gradients),
 * clip_grad_and_step. */
typedef struct loom_model loom_model;

/* Where a model computes. */
typedef enum loom_device { LOOM_DEVICE_CPU = 0, LOOM_DEVICE_CUDA } loom_device;

/* Activation recomputation: compute traded for memory, same results.
 *   NONE  every layer keeps its activations for the backward;
 *   MLP   ("selective") the MLP's gate, up and SwiGLU outputs, the largest
 *         tensors of a layer, are not kept: they are computed again from the
 *         kept normed input just before the layer's backward (2 of its 7
 *         matmuls again);
 *   FULL  each layer keeps only its input and runs its forward again just
 *         before its backward (Megatron's full, uniform recomputation of
 *         one layer at a time). */
typedef enum loom_recompute {
    LOOM_RECOMPUTE_NONE = 0,
    LOOM_RECOMPUTE_MLP,
    LOOM_RECOMPUTE_FULL
} loom_recompute;

/* A mixture of experts' load-balancing loss, over one micro-batch's router
 * rows (C_e: the choices of expert e, each of a token's k counted; P_e: the
 * sum of its probabilities; N: the rows):
 *  GLOBAL     transformers' load_balancing_loss_func, all MoE layers' rows
 *             as one: E * sum_e (C_e / N) (P_e / N)   (the default)
 *  PER_LAYER  Megatron's "aux_loss": each layer's E / (k N^2) sum_e C_e P_e,
 *             summed over the layers */
typedef enum loom_moe_aux { LOOM_MOE_AUX_GLOBAL = 0, LOOM_MOE_AUX_PER_LAYER } loom_moe_aux;

/* Which of an expert's choices a capacity drops (Megatron's
 * --moe-token-drop-policy): PROBS those of the lowest routing weight (ties:
 * the later token), POSITION those of the latest tokens. */
typedef enum loom_moe_drop { LOOM_MOE_DROP_PROBS = 0, LOOM_MOE_DROP_POSITION } loom_moe_drop;

typedef struct loom_model_options {
    /* JSON object whose keys replace those of config.json before it is read,
     * e.g. {"num_hidden_layers": 2}; NULL for none. */
    const char *config_overrides;
    /* Compute dtype of activations and of the weights' compute copies:
     * LOOM_BF16 (the GPU default), LOOM_F16 (dynamic loss scaling) or
     * LOOM_F32. Master weights, gradients and optimizer state are fp32
     * always. The CPU backend computes in LOOM_F32 only. */
    loom_dtype dtype;
    /* LOOM_DEVICE_CPU (default) or LOOM_DEVICE_CUDA: one GPU per process,
     * the process's local rank's (a loom built with CUDA; several processes
     * talk over NCCL). */
    loom_device device;
    /* The output layer and embedding are padded to a multiple of this many
     * rows times tp (0: 128); padded rows never receive probability and are
     * not saved. */
    int64_t vocab_pad_multiple;
    /* Parallel layout (Megatron's DeviceMesh.from_sizes): 0 means 1, except
     * dp, where 0 means what the world size leaves, and etp, where 0 means
     * tp (Megatron's default). ep and etp (MoE models only) fold each
     * pipeline stage's tp*cp*dp ranks into etp x ep x edp for the expert
     * layers, etp fastest. Every process of a job (mpirun -np N) calls
     * loom_model_create with the same options. */
    int tp, cp, dp, pp, vpp, ep, etp;
    int sequence_parallel;
    /* Interleaved pipeline (vpp > 1): micro-batches each model chunk runs in
     * a row, Megatron's microbatch_group_size_per_vp_stage (0: pp). The
     * number of micro-batches must be at least this, and leave a last group
     * of 0 or at least pp. */
    int microbatch_group;
    /* Distributed-optimizer bucket size in parameters (0: 40M). */
    int64_t bucket_elems;
    /* What the backward recomputes instead of keeping (loom_recompute). */
    loom_recompute recompute;
    /* Mixture of experts: which load-balancing loss router_aux_loss_coef
     * scales (loom_moe_aux). */
    int moe_aux;
    /* Mixture of experts: the router z-loss's coefficient (Megatron's
     * --moe-z-loss-coeff; 0: off, the default; negative is refused). Each
     * MoE layer's z-loss is the mean over its router rows of lse(z)^2 (z a
     * token's router logits, lse their logsumexp); the layers' sum times
     * this coefficient is added to each micro-batch's loss as the
     * load-balancing loss is (times its target tokens). */
    double moe_z_loss_coeff;
    /* Mixture of experts: the experts' capacity factor (Megatron's
     * --moe-expert-capacity-factor; 0: dropless, the default; negative is
     * refused). Each router call (the tokens one rank routes: the
     * micro-batch's on this cp rank, and under the expert fold this tp
     * rank's slice, as Megatron's router sees its sequence-parallel shard)
     * lets each expert keep at most ceil(tokens k / E x factor) of its
     * choices; a dropped choice adds nothing to its token's output and has
     * no gradient, while the probabilities and the load-balancing loss still
     * count it (Megatron's). The experts' buffers are sized by it. */
    double moe_expert_capacity_factor;
    /* Which choices the capacity drops (loom_moe_drop; Megatron's
     * --moe-token-drop-policy, "probs" by default). */
    int moe_token_drop_policy;
    /* Mixture of experts, for benchmarks only (Megatron's
     * --moe-router-force-load-balancing): each router's logits are replaced
     * by random draws (a fixed stream per layer and token), so the tokens
     * spread evenly over the experts whatever the weights, as in a trained
     * model; the router gets no gradient. Random weights otherwise send
     * nearly every token to the same few experts. Not for real training. */
    int moe_router_force_load_balancing;
    /* Time each part of every training step on the device
     * (loom_model_profile; costs a device wait at each step's end). */
    int profile;
} loom_model_options;

void loom_model_options_default(loom_model_options *o);
loom_status loom_model_create(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                              loom_model **out);
void loom_model_free(loom_model *m);

/* Shapes of the loaded model (after overrides). */
typedef struct loom_model_info {
    const char *model_type;   /* "qwen3", "qwen2", "llama", ... */
    int64_t vocab_size;       /* as in config.json */
    int64_t padded_vocab_size;
    int64_t hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim;
    int64_t num_params;       /* distinct trainable parameters (tied counted once) */
    int64_t num_tensors;      /* HF tensors */
    int64_t max_position_embeddings; /* as in config.json; 0 when it has none */
    int64_t num_experts, num_experts_per_tok; /* mixture of experts; 0 for a dense model */
} loom_model_info;
void loom_model_get_info(const loom_model *m, loom_model_info *info);
/* This process's rank and the world size of the model's job. */
int loom_model_rank(const loom_model *m);
int loom_model_world_size(const loom_model *m);
/* The mesh the model runs on: sizes (resolved: no zeros) and this rank's
 * coordinates, rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)). */
typedef struct loom_mesh_info {
    int world_size, rank;
    int tp, cp, dp, pp, vpp, ep, etp, sequence_parallel, microbatch_group;
    int tp_rank, cp_rank, dp_rank, pp_rank;
    /* where per-token outputs and losses are computed: the last pipeline
     * stage, tensor-parallel rank 0, context-parallel rank 0 */
    int is_output_rank;
    /* the expert layers' view of the stage: edp = tp*cp*dp / (etp*ep), and
     * tp_rank + tp*(cp_rank + cp*dp_rank) = etp_rank + etp*(ep_rank +
     * ep*edp_rank) */
    int edp, etp_rank, ep_rank, edp_rank;
} loom_mesh_info;
void loom_model_get_mesh(const loom_model *m, loom_mesh_info *out);
/* Where the model computes; *gpu (may be NULL) is set to its CUDA device,
 * -1 on the CPU. */
loom_device loom_model_device(const loom_model *m, int *gpu);
/* The most GPU memory in use since the model was created, above what was
 * in use then (sampled at each of its allocations): bytes, 0 on the CPU. */
uint64_t loom_model_peak_memory(const loom_model *m);
/* The most bytes of the model's own device buffers in use at once
 * (weights, gradients, optimizer state, activations, scratch: what `loom
 * inspect` predicts); loom_model_peak_memory adds what the CUDA libraries
 * take after the model was created (cuBLAS, cuDNN and NCCL workspaces,
 * kernels loaded on first use). 0 on the CPU. */
uint64_t loom_model_buffer_memory(const loom_model *m);
/* The same peak as the device counts it (what was in use when the model
 * was created, its CUDA context included, plus loom_model_peak_memory: with
 * the CUDA libraries' own memory and any other process's on that GPU), the
 * figure to set beside a peer's device-wide one: bytes, 0 on the CPU. */
uint64_t loom_model_device_memory(const loom_model *m);

/* Where this rank's training steps spent their time (the model created
 * with loom_model_options.profile): a table, in text, of the parts of a
 * step (phase and part: forward attn, backward moe.a2a, step optimizer,
 * ...) with each part's time on the device per step, its share and how
 * often it ran, over the steps after the first (the first, warm-up, apart),
 * and the host's time per step beside it. A part's time is its span on the
 * device's queue, from its start to the next part's: the kernels it
 * queued, the collectives it waited on, and the device's idle time while
 * the host was in it. A step ends at loom_model_clip_grad_and_step's
 * optimizer step; forward_only's parts count with the next step. Written
 * into buf (n bytes, cut short if it does not fit); without profiling, a
 * line saying so. */
void loom_model_profile(const loom_model *m, char *buf, size_t n);

/* The same profile's step time by kind, per step over the steps ended since
 * the last call (first: since the model was made), then reset: compute; the
 * exposed communication (the collectives loom waited on: tensor and context
 * parallelism's, expert all-to-alls, the gradients' reduce, the parameters'
 * gather, the loss sums); the pipeline bubble (the exchanges between
 * stages: a stage's waits for its neighbours and the transfers); idle (host
 * waits inside a step, and the host's time between steps). steps 0 (all
 * zero) when profiling is off or no step ended since. */
typedef struct loom_step_breakdown {
    int64_t steps;
    double compute_ms, comm_ms, bubble_ms, idle_ms;
} loom_step_breakdown;
void loom_model_profile_interval(loom_model *m, loom_step_breakdown *out);

/* AdamW (torch semantics, fp32 master weights; no weight decay on 1-D
 * parameters). Without a scheduler lr and weight_decay are constant. */
typedef struct loom_optimizer_config {
    double lr;           /* default 1e-4 */
    double beta1, beta2; /* default 0.9, 0.999 */
    double eps;          /* default 1e-8 */
    double weight_decay; /* default 0.01 */
} loom_optimizer_config;
loom_optimizer_config loom_optimizer_config_default(void);
loom_status loom_model_set_optimizer(loom_model *m, const loom_optimizer_config *c);
/* From now on lr and weight decay come from the schedule (its max_lr,
 * start_wd/end_wd replace the optimizer's lr and weight_decay). */
loom_status loom_model_set_lr_scheduler(loom_model *m, const loom_sched_config *c);

/* A batch of `rows` sequences of `seq_len` tokens, row-major. Under a
 * parallel layout every rank passes the same global batch; each takes its
 * data-parallel rows and its context-parallel tokens. */
typedef struct loom_batch {
    int64_t rows, seq_len;
    const int32_t *input_ids;    /* (rows, seq_len), each in [0, vocab_size) */
    const int32_t *targets;      /* (rows, seq_len): the token position t predicts; -100: no loss */
    /* Optional. Packed documents: cu_seqlens (n_docs + 1) are document starts
     * over the flattened rows*seq_len tokens (0 first, rows*seq_len last,
     * every row start included); attention never crosses a document. NULL:
     * each row is one document. */
    const int32_t *cu_seqlens;
    int64_t n_docs;
    /* Optional (rows, seq_len); NULL: positions restart at 0 in every document. */
    const int32_t *position_ids;
    /* 0: the batch is the global batch, the same on every rank; each
     * data-parallel rank takes its rows. 1: the rows are this data-parallel
     * rank's own (the ranks of one replica, loom_model_mesh's `dp_rank`,
     * pass the same rows; other replicas may pass other rows, any number
     * and length): the way a data loader that slices by data-parallel rank
     * feeds Megatron. Losses and token counts still cover every rank's
     * rows; per-token outputs cover this rank's rows. */
    int local;
    /* Optional (rows, seq_len), finite: each token's loss and its gradient
     * times this weight (a policy gradient's advantages, a soft mask). NULL:
     * 1. A token without a target (-100) still has no loss, and the mean
     * still divides by the count of tokens with a target. */
    const float *loss_weights;
} loom_batch;

typedef struct loom_fb_result {
    double loss;      /* loss_sum / n_tokens of this call (0 when no token has a target) */
    double loss_sum;  /* sum of token losses of this call */
    int64_t n_tokens; /* tokens with a target in this call */
    double aux_loss;  /* mixture of experts: the load-balancing loss over all MoE layers
                       * (transformers' load_balancing_loss_func, before router_aux_loss_coef),
                       * the mean over this call's micro-batches; `loss` includes coef times
                       * each micro-batch's, weighted by its tokens. 0 without experts */
    double z_loss;    /* mixture of experts with moe_z_loss_coeff > 0: the router z-loss summed
                       * over the MoE layers (each layer's mean lse^2, before the coefficient),
                       * the mean over this call's micro-batches; else 0 */
} loom_fb_result;

/* Runs the batch split into num_micro_batches (dividing rows) and adds the
 * gradient of the summed token losses to the fp32 main grads. The gradient
 * applied at the step is that of the mean loss over every token of every
 * call since the last step. A non-finite loss is an error; the gradients
 * accumulated since the last step are then discarded. */
loom_status loom_model_forward_backward(loom_model *m, const loom_batch *b,
                                        int64_t num_micro_batches, loom_fb_result *out);
/* Forward only. Any output may be NULL: token_logprobs and entropy are
 * (rows*seq_len) (0 logprob where target is -100), logits (rows*seq_len,
 * vocab_size). */
loom_status loom_model_forward_only(loom_model *m, const loom_batch *b, int64_t num_micro_batches,
                                    float *token_logprobs, float *entropy, float *logits,
                                    loom_fb_result *out);

typedef struct loom_step_result {
    int stepped;          /* 1 when the optimizer stepped */
    double grad_norm;     /* global L2 norm of the mean-loss gradient before clipping */
    double lr, weight_decay; /* used by this step */
    int64_t step;         /* optimizer steps taken so far */
    double loss;          /* mean loss over the tokens of the accumulated calls */
    int64_t n_tokens;     /* tokens those calls had */
    int skipped;          /* fp16: 1 when the gradients overflowed and the step was skipped */
    double loss_scale;    /* fp16: the dynamic loss scale used by these calls (else 1) */
    /* mixture of experts (0 without experts): the load-balancing loss (the mean
     * over the step's micro-batches, before router_aux_loss_coef), and the tokens
     * each expert of each MoE layer was sent over the step's calls (each of a
     * token's top-k choices counted): min, mean and max over every (layer,
     * expert), and the largest max/mean of one layer (1: perfectly balanced) */
    double aux_loss;
    double expert_tokens_min, expert_tokens_mean, expert_tokens_max, expert_imbalance;
    /* with moe_z_loss_coeff > 0: the router z-loss (loom_fb_result's), the mean
     * over the step's micro-batches; else 0 */
    double z_loss;
    /* the layer whose max/mean is expert_imbalance (-1 without experts, or
     * when the step is not taken) */
    int64_t expert_imbalance_layer;
} loom_step_result;
/* Counts a call; every accumulation_steps-th call (1: every call) scales the
 * accumulated gradient to the mean loss, clips it to max_grad_norm (<= 0: no
 * clipping), takes an AdamW step, advances the schedule and zeroes the
 * gradients. Without a set_optimizer call the defaults are used. */
loom_status loom_model_clip_grad_and_step(loom_model *m, double max_grad_norm,
                                          int64_t accumulation_steps, loom_step_result *out);
/* Mixture of experts: the tokens each expert of each layer was sent over
 * the last optimizer step, summed over every rank of the mesh (each of a
 * token's top-k choices counted: loom_step_result's statistics are made of
 * these), as (num_layers, num_experts) doubles, row-major, into out (n of
 * them, at least num_layers * num_experts); dense layers' rows are 0, and
 * all are 0 before the first step. An error for a model without experts or
 * a shorter out. */
loom_status loom_model_expert_tokens(const loom_model *m, double *out, int64_t n);
void loom_model_zero_grad(loom_model *m);

/* Parameters by HF name (i < num_tensors). get_param copies fp32 values;
 * get_grad copies the gradient of the mean loss over the tokens accumulated
 * since the last step (n = the tensor's element count). Under a parallel
 * layout both are collective (every rank calls them, with the same name)
 * and give every rank the whole, unsharded tensor. */
const char *loom_model_tensor_name(const loom_model *m, int64_t i, int *ndim, int64_t shape[2]);
loom_status loom_model_get_param(loom_model *m, const char *name, float *dst, int64_t n);
loom_status loom_model_get_grad(loom_model *m, const char *name, float *dst, int64_t n);

/* The parameter table: tensor i (< loom_model_info.num_tensors) by its HF
 * name, its whole shape and the block this rank holds, where it lives. */
typedef struct loom_param_info {
    const char *name;        /* HF name; valid while the model lives */
    int ndim;                /* 1 or 2 */
    int64_t shape[2];        /* the whole tensor ([n, 1] for 1-D) */
    int64_t local_shape[2];  /* held by this rank ({0, 0}: on another pipeline stage) */
    int layer;               /* decoder layer, -1 for embedding, final norm, output layer */
    int pp_stage;            /* pipeline rank holding it; the tied embedding's first stage */
    int trainable;           /* 1 when it gets gradients (0 under LoRA) */
} loom_param_info;
loom_status loom_model_param_info(const loom_model *m, int64_t i, loom_param_info *out);
/* Full fine-tuning: trainable 0 freezes the tensor `name` (HF name; a tied
 * embedding freezes with its output-layer copy): it then gets no gradient
 * (loom_model_get_grad gives zeros), no optimizer state and no update, and
 * stays out of the gradient norm; 1 makes it trainable again. Collective in
 * effect: every rank calls it with the same names (ranks that do not hold
 * the tensor only record it). Before the first forward_backward only, and
 * not on a model with adapters (LoRA freezes the whole base). */
loom_status loom_model_set_trainable(loom_model *m, const char *name, int trainable);

/* ---- Training state (checkpoints) ----
 * The trained tensors (the whole model's, or the active adapter's) as fp32
 * master values, their AdamW moments, the step, the fp16 loss scale, the
 * dropout stream, and the caller's progress, under their HF / PEFT names:
 * a state saved on any mesh loads on any mesh (each rank assembles the
 * tensors it holds, and takes its blocks and its part of the distributed
 * optimizer's shard).
 * Collective. save writes into an existing directory (shared by the ranks)
 * one file per rank, rank_NNNNN.safetensors, with the slices of the state
 * that rank's distributed optimizer owns (fp32 master values; the AdamW
 * moments once a step was taken and `optimizer` is set), and meta.json
 * (rank 0): the step, progress, loss scale, dropout stream, each file's
 * SHA-256, and for every tensor its shape and which file holds which
 * slice. load, on a model made like the one that saved (same config; same
 * LoRA settings, adapter added), before it trains, on any mesh: optimizer
 * 0 takes the weights only (step 0, fresh moments). */
typedef struct loom_train_progress {
    int64_t step;               /* optimizer steps taken (set by load) */
    int64_t consumed_samples, consumed_tokens;
    int64_t data_epoch, data_index, data_offset; /* the data loader's position (a token
                                                   * file's packer: document and offset) */
} loom_train_progress;
loom_status loom_model_save_state(loom_model *m, const char *dir, const loom_train_progress *p,
                                  int optimizer);
loom_status loom_model_load_state(loom_model *m, const char *dir, int optimizer,
                                  loom_train_progress *p);
/* save_state in three steps, for a write in the background (Megatron's
 * async save):
 *  - take (every rank; no communication) copies this rank's part of the
 *    state into host memory: the only pause training takes. *sn is NULL, or
 *    an earlier snapshot (written or not) whose buffers are reused: on a
 *    GPU they are page-locked, so after the first take the copy runs at the
 *    link's speed.
 *  - write (every rank, on any thread, with a context of that thread's)
 *    writes this rank's file into dir and its checksum; training may go on.
 *  - commit (collective, once every rank's write returned) gathers the
 *    writes' verdicts, checksums and slices: rank 0 writes meta.json. The
 *    directory is complete when commit returns LOOM_OK on every rank.
 * free releases the snapshot and its buffers. */
typedef struct loom_state_snapshot loom_state_snapshot;
loom_status loom_state_snapshot_take(loom_model *m, const loom_train_progress *p, int optimizer,
                                     loom_state_snapshot **sn);
loom_status loom_state_snapshot_write(loom_ctx *ctx, loom_state_snapshot *sn, const char *dir);
loom_status loom_state_snapshot_commit(loom_model *m, loom_state_snapshot *sn, const char *dir);
void loom_state_snapshot_free(loom_state_snapshot *sn);
/* Checks a saved state without a model: meta.json readable and of a known
 * version, every file it lists present with its SHA-256. The error names
 * the file and what is wrong. (load_state checks the same first.) */
loom_status loom_verify_state(loom_ctx *ctx, const char *dir);

/* ---- The model without its weights (Megatron-Bridge's meta model) ----
 * From config.json alone, nothing read or allocated but tables: the
 * parameter table as the ranks of each pipeline stage hold it, and each
 * stage's predicted device memory for a step (the same layout code as the
 * model allocates with). `opts` as for loom_model_create (dp 0: what
 * world_size leaves); the mesh is checked against the model as there. */
typedef struct loom_memory_estimate {
    int pp_rank;           /* the stage */
    int in_flight;         /* micro-batches whose activations it keeps */
    uint64_t weights, grads, optimizer, activations, workspace, total; /* bytes per rank */
} loom_memory_estimate;
typedef struct loom_meta_query {
    int world_size;                 /* ranks of the job */
    int64_t micro_batch_size, seq_len, num_micro_batches;
    int lora_r;                     /* 0: full fine-tuning */
    const char *lora_target;        /* NULL: "all-linear" */
} loom_meta_query;
typedef struct loom_meta loom_meta;
loom_status loom_meta_create(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                             const loom_meta_query *q, loom_meta **out);
void loom_meta_free(loom_meta *mt);
void loom_meta_get_info(const loom_meta *mt, loom_model_info *info);
/* local_shape: what each rank of the tensor's pipeline stage holds. */
loom_status loom_meta_param_info(const loom_meta *mt, int64_t i, loom_param_info *out);
loom_status loom_meta_memory(const loom_meta *mt, int pp_rank, loom_memory_estimate *out);

/* ---- Tokenizing samples with the model's tokenizer and chat template ---- */
typedef struct loom_encoder loom_encoder;
/* From a model or tokenizer directory: tokenizer.json, the chat template
 * (tokenizer_config.json / chat_template.jinja) and the EOS token. */
loom_status loom_encoder_create(loom_ctx *ctx, const char *dir, loom_encoder **out);
void loom_encoder_free(loom_encoder *e);
/* One sample, a JSON object as `loom train` reads in JSONL: {"text": ...},
 * {"messages": [{"role", "content"}, ...]} (the chat template; loss on the
 * assistant's tokens; an optional "tools": HF's apply_chat_template tools=,
 * a list of tool objects or that list JSON-encoded in a string) or
 * {"prompt", "completion"} (loss on the completion).
 * *ids and *mask (1: the token is predicted; may be all 1) are malloc'd:
 * free them with loom_free. append_eos: an EOS token after text and
 * completion samples. */
loom_status loom_encoder_encode(loom_ctx *ctx, const loom_encoder *e, const char *json,
                                size_t len, int append_eos, int32_t **ids, uint8_t **mask,
                                int64_t *n);
/* Text of ids (malloc'd; loom_free). */
loom_status loom_encoder_decode(loom_ctx *ctx, const loom_encoder *e, const int32_t *ids,
                                int64_t n, char **text);
int64_t loom_encoder_vocab_size(const loom_encoder *e);
int32_t loom_encoder_eos_id(const loom_encoder *e); /* -1: none */
/* NULL when the encoder has a chat template, else why it has none. */
const char *loom_encoder_chat_error(const loom_encoder *e);
/* Frees what loom allocated for the caller. */
void loom_free(void *p);

/* ---- LoRA adapters (PEFT's LoRA) ----
 * target_modules: "all-linear" (q, k, v, o, gate, up and down projections;
 * never the output layer) or a comma-separated list of those names
 * ("q_proj,v_proj"). scale = lora_alpha / r, or lora_alpha / sqrt(r) with
 * use_rslora. A fresh adapter starts as PEFT's: A uniform in
 * +-1/sqrt(in_features) (from `seed`, the same on any mesh), B zero.
 * Adding or loading an adapter freezes the base model: it then has no
 * gradients and no optimizer state. Several adapters may live on one model;
 * the active one (the last added or loaded, or set_adapter's) is applied in
 * the forward and is the only one trained. */
typedef struct loom_lora_config {
    int r;                       /* rank, >= 1 */
    double lora_alpha;           /* default: r (scale 1) when 0 */
    double lora_dropout;         /* in [0, 1): dropout on the adapter input while training */
    const char *target_modules;  /* NULL: "all-linear" */
    int use_rslora;
    uint64_t seed;
} loom_lora_config;
loom_status loom_model_add_adapter(loom_model *m, const char *name, const loom_lora_config *c);
/* Reads a PEFT adapter directory (adapter_config.json, adapter_model.safetensors;
 * F32, BF16 or F64 weights) under `name`. */
loom_status loom_model_load_adapter(loom_model *m, const char *name, const char *dir);
/* Writes the adapter as PEFT does (collective; rank 0 writes; replaces `dir`
 * whole, as loom_model_save_hf). base_model_name_or_path is the name of the
 * directory the model was created from. */
loom_status loom_model_save_adapter(loom_model *m, const char *name, const char *dir,
                                    loom_dtype dtype);
/* Makes `name` the active adapter (NULL: none; the base stays frozen). */
loom_status loom_model_set_adapter(loom_model *m, const char *name);
/* W += scale * B A into the base weights (merge), or back (unmerge); a
 * merged adapter is not applied again in the forward. */
loom_status loom_model_merge_adapter(loom_model *m, const char *name);
loom_status loom_model_unmerge_adapter(loom_model *m, const char *name);
/* Adapter tensors go by their PEFT names in get_param / get_grad:
 * "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" (the
 * active adapter; a vision-language checkpoint's text model:
 * "base_model.model.model.language_model.layers.0..."), or with the adapter
 * named: "...q_proj.lora_A.<name>.weight".
 * The i-th tensor of adapter `name` (NULL past the end): */
const char *loom_model_adapter_tensor(loom_model *m, const char *name, int64_t i, char *buf,
                                      size_t cap, int64_t shape[2]);

/* Writes an HF directory: config.json in the layout it was read in and the
 * weights in `dtype` (LOOM_DTYPE_COUNT: the checkpoint's own), vocabulary
 * padding removed, split into shards of at most max_shard_bytes (0: 5 GB).
 * Collective: every rank calls it; rank 0 writes the unsharded tensors, with
 * the tokenizer files of the model's directory, into a temporary directory
 * beside `dir` that replaces `dir` whole when complete (src/io/outdir.h); an
 * existing `dir` holding other files than a model's is refused. */
loom_status loom_model_save_hf(loom_model *m, const char *dir, loom_dtype dtype,
                               uint64_t max_shard_bytes);

#if defined(__GNUC__) || defined(__clang__)
#pragma GCC visibility pop
#endif

#ifdef __cplusplus
}
#endif
#endif /* LOOM_H */
