/* The model object behind include/loom.h's loom_model: this rank's share of
 * the parameters (under their HF names) in one flat fp32 buffer, fp32 main
 * grads in the same layout, the distributed optimizer's shard of the AdamW
 * state, and the activation buffers of the micro-batches in flight.
 *
 * Sharding (DESIGN.md, "One transformer layer, sharded"). A rank at mesh
 * coordinates (tp, cp, dp, pp) holds:
 *  - the layers of its model chunks: chunk c is virtual pipeline stage
 *    v = c*pp + pp_rank and holds layers [v*Lc, (v+1)*Lc), Lc = L/(pp*vpp);
 *    the first virtual stage has the embedding, the last the final norm and
 *    the output layer (with tied embeddings and pp > 1, a copy of the
 *    embedding whose gradient is summed with the first stage's);
 *  - of every layer, its tensor-parallel share: q/k/v/gate/up and the
 *    embedding/output rows split over tp (column-parallel), o/down columns
 *    split (row-parallel), norms and q/k norms replicated;
 *  - the vocabulary padded to a multiple of 128*tp; padded rows stay zero,
 *    never get probability and are never written to files.
 *
 * Tokens. A micro-batch of T = rows*seq tokens is cut for context
 * parallelism into 2*cp chunks per row; this rank keeps chunks cp_rank and
 * 2cp-1-cp_rank: Tc tokens. Under sequence parallelism the residual stream
 * holds Tn = Tc/tp of them (else Tn = Tc).
 *
 * Gradient convention. forward_backward adds the gradient of the SUM of
 * token losses into `g` and counts the tokens of the whole mesh;
 * clip_grad_and_step divides by that count (DESIGN.md, "The loss,
 * exactly"), so no layout or batch cut changes the result. */
#ifndef LOOM_MODEL_H
#define LOOM_MODEL_H

#include "../io/hf_config.h"
#include "../parallel/mesh.h"
#include "block.h"
#include "kern.h"
#include "meta.h"
#include "params.h"

typedef struct loom_slot {
    char *name;         /* HF name */
    int ndim;
    int64_t shape[2];   /* full HF shape ([n, 1] for 1-D) */
    int64_t rows, cols; /* held here */
    int64_t row0, col0; /* where the held block starts in the (vocab-padded) full tensor */
    /* the held rows as runs of the full tensor's: one (row0, rows) but for a
     * tensor of fused parts split over tp part by part (loom_slot_row_parts),
     * whose local rows are run k's after run k-1's */
    int nruns;
    int64_t run0[LOOM_ROW_PARTS_MAX], runn[LOOM_ROW_PARTS_MAX];
    loom_shard shard;
    size_t off, numel;  /* in w / g */
    bool decay;         /* AdamW weight decay applies (2-D) */
    bool tp_partial;    /* its gradient is a partial sum over tp (summed before the step) */
    bool head_copy;     /* the last stage's copy of a tied embedding (pp > 1) */
    bool frozen;        /* no gradient, no optimizer state (loom_model_set_trainable) */
    bool expert;        /* an expert's tensor: split over etp (not tp), held by one ep rank's
                         * experts, replicated over edp: its buckets reduce there */
    bool etp_partial;   /* an expert's LoRA half replicated over etp: its gradient is a
                         * partial sum over etp (summed before the step) */
} loom_slot;

/* A set of tensors in one flat buffer: the base model's, or one adapter's.
 * g is NULL when the arena is frozen (the base under LoRA: no gradients, no
 * optimizer state). The distributed optimizer's buckets cut the buffer into
 * parts padded to a multiple of dp*cp; this rank owns 1/(dp*cp) of each. */
typedef struct loom_arena {
    loom_slot *slots;
    int nslots;
    size_t nparams;          /* floats in w (buckets padded, then any frozen slots) */
    size_t ngrad;            /* floats in g: the buckets; frozen slots lie past them, last */
    float *w, *g;            /* fp32 master values (NULL: a frozen base kept in the compute
                              * dtype only), main grads (the model's device memory) */
    bool w_on_dev;           /* w is device memory (committed on a GPU) */
    bool w_in_wc;            /* w is NULL and wc holds its values exactly (a base loaded
                              * in the compute dtype, not trained yet): widened into w by
                              * loom_arena_master_to_device */
    void *wc;                /* compute copy of w in the compute dtype (== w when that is F32) */
    int nbuckets;
    size_t *bucket_off, *bucket_len; /* (nbuckets) */
    uint8_t *bucket_ex;      /* (nbuckets): 1 for the experts' buckets, sharded over edp (the
                              * rest over dp x cp; loom_bucket_comm) */
    size_t shard_numel;      /* sum of bucket_len / (dp*cp) */
    float *gshard;           /* (shard_numel): this rank's reduced gradient shard; g itself
                              * when dp*cp = 1 (gshard_is_g) */
    float *adam_m, *adam_v;  /* (shard_numel), allocated at the first step (one block, with
                              * gshard unless that is g) */
    bool gshard_is_g;
    loom_k_part *parts;      /* the optimizer's parts of this rank's shard (nparts; made at
                              * the first step, freed with lists: loom_k_lists_free) */
    int nparts;
    loom_part_lists lists;   /* the backend's copy of them (a GPU's chunks) */
    int64_t step;            /* optimizer steps taken on this arena */
    /* Deferred zeroing (the base model's gradients; grads.c): after
     * zero_grad the slots marked in gfresh hold stale values that count as
     * zero. A linear weight's first gradient GEMM of the step overwrites its
     * slot (beta 0) instead of adding; any other first writer clears the slot
     * first (loom_grad_prepare); loom_grad_settle clears what no backward
     * wrote before anything reads g. Slots only norms, biases or the
     * embedding's scatter write are cleared at zero_grad, on a GPU by one
     * kernel over the chunk list kept in zlists. */
    uint8_t *gdefer;         /* (nslots): 1 for a linear weight's slot; NULL until set up */
    uint8_t *gfresh;         /* (nslots): stale, counts as zero */
    bool gpending;           /* some slot is fresh */
    loom_k_part *zparts;     /* the slots cleared at zero_grad (nzparts), made at the first */
    int nzparts;
    loom_part_lists zlists;  /* the backend's copy of them */
} loom_arena;

typedef struct loom_adapter {
    char *name;
    int r;
    double alpha, dropout;
    bool rslora, merged;
    uint64_t seed;                /* dropout masks (and a fresh adapter's A) */
    float scale;                  /* alpha / r, or alpha / sqrt(r) */
    bool target[LOOM_LORA_NMOD];  /* by target number; only names some layer has */
    loom_arena ar;                /* its A and B blocks on this rank */
    int (*slot)[LOOM_LAYER_MAX_LINEARS][2]; /* (L): by the layer's linear (loom_layer.lin), arena
                                   * slot of A [0] and B [1], -1 when absent */
    char **names;                 /* slot names (PEFT, without the adapter name) */
} loom_adapter;

/* Activations of one model chunk for one micro-batch in flight, saved by
 * the forward for the backward: the layers' inputs and outputs, where each
 * layer's other buffers are (block.h's loom_layer_acts: with recomputation
 * those not kept lie in one layer's region shared by all), and the last
 * stage's final norm and loss gradient. */
typedef struct loom_acts {
    void *x;            /* (nl+1, Tn, H): input of layer i; x[nl] = the chunk's output */
    loom_layer_acts *lay; /* (nl) */
    void *hf;           /* (Tn, H): final norm (last stage) */
    float *rstdf;       /* (Tn) */
    void *dstash;       /* (Tn, H): d loss / d x[nl], from the loss (last stage) */
    int mb;             /* micro-batch held, -1 when free */
} loom_acts;

/* One micro-batch's tokens as this rank sees them: on the host, and the
 * copies the ops read (d_*: device memory on a GPU, the host arrays on CPU). */
struct loom_micro {
    int32_t *ids, *tgt, *pos; /* (Tc) */
    int32_t *cu;        /* (ndocs+1) over the micro-batch's T tokens */
    int32_t *d_ids, *d_tgt, *d_pos, *d_cu;
    float *wt;          /* (Tc) the tokens' loss weights (host; NULL: the batch has none) */
    float *wt_buf;      /* wt's storage, kept between calls */
    float *d_rope;      /* GPU: (Tc, D/2) cos, sin of the positions (loom_k_rope_table) */
    int64_t ndocs;
    int64_t even_len;   /* every document's length when all are equally long, else 0 */
    int64_t out0;       /* flat index of the micro-batch's first token in the batch passed */
    double *aux;        /* (loom_moe_aux_len) host: the MoE layers' sums over the micro-batch
                         * for the load-balancing loss (block_moe.c); NULL: no experts */
    double *d_aux;      /* its device copy (a pipeline message's source) */
    float *aux_g;       /* (loom_moe_grad_len) its gradient per expert: host, and d_aux_g on
                         * the device */
    float *d_aux_g;
    double aux_loss;    /* the micro-batch's load-balancing loss (loom_moe_finish) */
    double z_loss;      /* its router z-loss, over its MoE layers (0: off) */
    int64_t key0;       /* the same in the global batch: dropout masks are drawn by it (local
                         * batches: as if the replicas' equal batches were one, in dp order) */
};

typedef struct loom_chunk {
    int64_t l0, nl;     /* first global layer, number of layers */
    bool first, last;   /* first / last virtual stage */
    loom_acts *pool;    /* (npool) */
    int npool;
} loom_chunk;

struct loom_model {
    loom_ctx *ctx;
    loom_model_config cfg;
    char dir_name[256];      /* the model directory's own name (loom_path_name) */
    loom_param_plan plan;
    loom_dtype file_dtype;   /* dtype of the checkpoint's weights */
    bool experts_fused;      /* its experts in transformers v5's fused layout (hf_experts.h) */
    char *src_dir;           /* the directory it was created from (side files, adapter names) */
    char *overrides;         /* the config overrides it was created with (NULL: none) */
    loom_comm *world;        /* owned when own_world */
    bool own_world;
    loom_mesh *mesh;
    int tp, cp, dp, pp, vpp; /* sizes */
    int ep, etp, edp;        /* the expert layers' folding of tp x cp x dp (mesh.h) */
    loom_moe_aux moe_aux;    /* the load-balancing loss's form (loom.h) */
    double moe_z_coef;       /* the router z-loss's coefficient (0: off; loom.h) */
    double moe_cap_factor;   /* the experts' capacity factor (0: dropless; loom.h) */
    loom_moe_drop moe_drop;  /* which choices over capacity are dropped */
    bool moe_force_balance;  /* random router logits (benchmarks; loom.h) */
    struct loom_prof *prof;  /* the step's timeline by part (--profile; prof.h), else NULL */
    bool comm_deferred;      /* ep / etp collectives left queued (loom_comm_defer): settled
                              * before the host waits on the GPU (loom_k_settle) */
    bool moe_dedup;          /* ep rows once per rank (block_moe.c; LOOM_MOE_DEDUP=1), else once
                              * per choice */
    bool sp;

    int64_t V, Vp, H, I, L, Hq, Hkv, D;  /* full model */
    int64_t rd;                          /* the leading dimensions of a head RoPE turns */
    float norm_off;                      /* RMSNorm weights are norm_off + w (1: zero-centred) */
    int64_t Vl, Il, Hql, Hkvl;           /* per tp rank */
    float attn_scale;

    loom_dev dev;            /* where it computes (kern.h) */
    loom_arena base;         /* this rank's share of the model's tensors */
    int embed, final_norm, head; /* base slots; -1 when not on this rank; head == embed when tied, pp == 1 */
    loom_layer *layer;       /* (L): the layer table (block.h); slots -1 in other stages' layers */
    float *inv_freq;         /* (D/2): rd/2 frequencies, zero after */
    float *d_inv_freq;       /* its device copy (== inv_freq on CPU) */
    int64_t bucket_elems;

    /* LoRA adapters (lora.c); `active` is the one applied and trained, -1 none */
    struct loom_adapter *adapters;
    int nadapters, active;
    uint8_t *pfrozen;             /* (plan.n): 1 for a tensor set not trainable; NULL: none */

    /* activations */
    loom_chunk *chunks;      /* (vpp) */
    loom_recompute recompute;/* what the backward recomputes (loom.h) */
    int64_t cap_T;           /* micro-batch tokens the buffers were sized for */
    int64_t T, Tc, Tn;       /* of the current micro-batch shape */
    loom_micro *micro;       /* (cap_micro) */
    int cap_micro;
    int32_t *perm;           /* (T): global token index of position j of the cp-gathered blocks */
    int32_t *d_perm;         /* its device copy */
    void *act_mem;           /* the one allocation all activation buffers are carved from */
    size_t act_bytes;
    void *dx, *dtmp, *dfull; /* (Tc, H) each: scratch */
    void *scratch[LOOM_NKINDS][LOOM_BLOCK_MAX_SCRATCH]; /* the block kinds' (block.h) */
    void *host_scratch[LOOM_NKINDS]; /* the kinds' host scratch */
    void *lora_du;           /* (Tc, 3 r): a LoRA group's du */
    loom_lora_dy_op lora_pend[3]; /* a LoRA group's dy passes, run at its last module */
    int lora_npend;
    int64_t lora_pend_l;     /* their layer */
    void *lora_xd;           /* (Tc, max in_l): the dropped-out LoRA input (dropout > 0) */
    void **pp_stage;         /* (npp_stage) (Tn, H): pipeline messages received, not yet used */
    int npp_stage;
    bool pp_connected;       /* the pipeline's point-to-point connections are set up */
    bool training;           /* forward_backward (LoRA dropout on) vs forward_only */
    uint64_t dropout_calls;  /* forward_backward calls: part of the dropout mask's key */
    const loom_micro *cur_mb;/* the micro-batch being run */
    int lora_r;              /* r the activation buffers were sized for (0: none) */
    const struct loom_loss_kind *loss; /* the loss on the logits (loss.h) */
    float *d_wt;             /* (Tc) GPU: the current micro-batch's loss weights (loss_ce.c) */
    void *logits;            /* (chunk_rows, Vl) */
    double *ce;              /* (Tc, 3) loss sums, then (Tc) row maxima (device) */
    double *ce_h;            /* their host copy (== ce on CPU) */
    float *logits_h;         /* (chunk_rows, Vl) host fp32 copy for forward_only's logits (GPU) */
    int64_t chunk_rows;

    /* optimizer and schedule */
    loom_optimizer_config opt;
    bool opt_set;            /* set_optimizer was called (else opt holds the defaults) */
    bool has_sched;
    loom_sched_config sched;
    int64_t acc_calls, acc_tokens; /* since the last step (tokens: whole mesh) */
    bool grad_memset;        /* zero_grad clears every gradient at once (no deferral; tests) */
    double loss_scale;       /* the backward's seed: 1, or fp16's dynamic loss scale */
    int64_t good_steps;      /* fp16: steps since the scale last changed */
    double acc_loss;
    double acc_aux;          /* MoE: load-balancing losses of the micro-batches since the last
                              * step (their count acc_aux_n), on one rank of each tp x cp group */
    int64_t acc_aux_n;
    double acc_z;            /* MoE: their router z-losses (the same micro-batches) */
    double *moe_load;        /* (L, E): tokens sent to each expert since the last step (tp rank 0;
                              * NULL without experts); then (L, E) more: the last step's, summed
                              * over the mesh (loom_model_expert_tokens) */
    struct loom_moe_tabs *moe_tabs; /* MoE: each layer's routing tables as its forward made
                                     * them, per activation set (moe_tabs.h) */
};

/* A pipeline message (pp_stage) is the activations (Tn, H), then from byte
 * loom_pp_aux_off the layers' auxiliary state of the micro-batch: forward,
 * the load-balancing loss's sums so far (loom_micro.aux); backward, its
 * gradient per expert (aux_g). 0 bytes without experts. */
static inline size_t loom_pp_aux_off(const loom_model *m, int64_t Tn) {
    return ((size_t)(Tn * m->H) * m->dev.esz + 255) & ~(size_t)255;
}
static inline size_t loom_pp_aux_bytes(const loom_model *m) {
    return loom_moe_aux_len(m) * sizeof(double);
}
static inline void *loom_pp_aux_at(const loom_model *m, int slot) {
    return (char *)m->pp_stage[slot] + loom_pp_aux_off(m, m->Tn);
}

/* loom_model_create on a given world group (borrowed; the CLI keeps it to
 * end the job when a rank fails). */
loom_status loom_model_create_in(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                                 loom_comm *world, loom_model **out);

/* Grows the activation buffers for micro-batches of micro_batch_size rows
 * of seq tokens, n_micro micro-batches per call and the pipeline's
 * activations in flight. */
loom_status loom_model_reserve(loom_model *m, int64_t micro_batch_size, int64_t seq, int n_micro,
                               int in_flight, int pp_slots);
/* Slot index of an HF name on this rank, -1 when absent (head copies are
 * not found by name). */
int loom_model_find_slot(const loom_model *m, const char *name);

/* forward.c: one model chunk on one micro-batch. The forward takes its input
 * from the embedding (first stage) or m->dx... see forward.c. */
loom_status loom_chunk_forward(loom_model *m, int c, loom_acts *a, const loom_micro *mb,
                               bool backward, float *token_logprob, float *entropy,
                               float *logits, double *loss_sum, int64_t *n_tokens);
loom_status loom_chunk_backward(loom_model *m, int c, loom_acts *a, const loom_micro *mb);

/* Base tensors by slot: fp32 master values, compute copies (what the ops
 * read), and gradients (NULL when absent or frozen). */
static inline float *loom_w(loom_model *m, int s) {
    return s < 0 ? NULL : m->base.w + m->base.slots[s].off;
}
static inline void *loom_wc(loom_model *m, int s) {
    return s < 0 ? NULL : (char *)m->base.wc + m->base.slots[s].off * m->dev.esz;
}
static inline float *loom_g(loom_model *m, int s) {
    return s < 0 || !m->base.g || m->base.slots[s].frozen ? NULL
                                                          : m->base.g + m->base.slots[s].off;
}
/* lora.c: an adapter tensor by PEFT name (with or without ".<adapter>"
 * before ".weight"): its arena, its name there, its shape. */
loom_status loom_lora_find(loom_model *m, const char *name, loom_arena **a, char *key,
                           size_t cap, int64_t *rows, int64_t *cols);
/* lora.c: the active, unmerged adapter on layer l's expert linear `mod`
 * (its kind's linear marked `experts`): false when it does not cover it;
 * else its rank and scale, and for this rank's local expert e its A (r,
 * in) and B (out, r) compute copies and their fp32 gradients. */
bool loom_lora_expert(loom_model *m, int64_t l, int mod, int64_t *r, float *scale);
void loom_lora_expert_at(loom_model *m, int64_t l, int mod, int64_t e, const void **A,
                         const void **B, float **dA, float **dB);
/* lora.c: the active, unmerged adapter's path on linear `mod` of layer l
 * (its number among the layer's linears, loom_layer.lin; stash: the
 * layer's loom_layer_acts.lora_u). fwd: y (T, out_l) = scale (x A^T) B^T +
 * beta y, saving x A^T in the stash. bwd: dA, dB accumulate; dx (T, in_l) =
 * d/dx + beta dx, *wrote set when dx was written (dx NULL: the input
 * gradient is not wanted, only dA and dB); with defer (not NULL), where the
 * term is du A (no dropout) it is not computed but described in *defer
 * (defer->dy NULL otherwise) for the caller's loom_k_lin_dx_sum, which must
 * run before the next LoRA backward (du is LoRA's scratch). fwd with the
 * base weight W (out, in) and beta 0: where the device can, y = x W^T + the
 * term in one GEMM and *with_base set (the caller's base GEMM is then not
 * run); W NULL: the term alone. beta is 0 or 1; no-ops where no adapter
 * covers the linear (loom_lora_covers). Linears of a group (block.h's
 * loom_block_linear: q, k, v; gate, up) may run as one: called in order,
 * the first computes the group's x A^T and the last writes the group's dx. */
loom_status loom_lora_fwd(loom_model *m, void *stash, int64_t l, int mod,
                          const void *x, int64_t T, void *y, float beta, const void *W,
                          bool *with_base);
loom_status loom_lora_bwd(loom_model *m, void *stash, int64_t l, int mod,
                          const void *x, int64_t T, const void *dy, void *dx, float beta,
                          bool *wrote, loom_dx_term *defer);
bool loom_lora_covers(loom_model *m, int64_t l, int mod);
/* The active adapter when it is applied (unmerged), else NULL. */
loom_adapter *loom_model_lora(loom_model *m);
void loom_adapters_free(loom_model *m);

/* model.c helpers shared with lora.c */
loom_slot *loom_slot_add(loom_model *m, loom_arena *a, const char *name, int64_t rows,
                         int64_t cols, int ndim, loom_shard shard, bool vocab, bool expert);
/* A ROWS slot of fused parts (loom_param_spec.part): each part split over
 * tp on its own; the rank's rows are its share of each, in part order. */
void loom_slot_row_parts(loom_model *m, loom_slot *sl, int nparts, const int64_t *part);
/* The full tensor's row of the slot's held row r. */
static inline int64_t loom_slot_grow(const loom_slot *s, int64_t r) {
    int k = 0;
    while (k + 1 < s->nruns && r >= s->runn[k]) r -= s->runn[k++];
    return s->run0[k] + r;
}
loom_status loom_slot_read(loom_ctx *ctx, const void *data, loom_dtype dt, const loom_slot *sl,
                           float *dst);
/* The whole tensor on every rank from the arena's blocks named `name` (see
 * get_param / get_grad for who contributes). */
loom_status loom_gather_full(loom_model *m, loom_arena *a, const char *name, int64_t rows,
                             int64_t cols, bool grads, float scale, float *dst);

/* The arena the optimizer trains: the active adapter's, else the base. */
loom_arena *loom_model_trainable(loom_model *m);
/* Before a kernel writes n floats of gradient at g: with beta (a GEMM that
 * can overwrite), *beta becomes 0 when g is the whole of a slot whose
 * zeroing was deferred (the write assigns) and 1 otherwise (it adds); with
 * beta NULL, such a slot is cleared first. Only the base arena defers. */
loom_status loom_grad_prepare(loom_model *m, float *g, size_t n, float *beta);
/* Clears every slot still deferred: before the gradients are read. */
loom_status loom_grad_settle(loom_model *m);
/* Forgets the deferral (g freed or reallocated). */
void loom_grad_defer_reset(loom_model *m, loom_arena *a);
/* Lays out an arena's slots (already filled) in buckets and allocates w
 * in host memory, to be filled, and g (zero, on the device) unless frozen. */
loom_status loom_arena_layout(loom_model *m, loom_arena *a, bool frozen);
/* Offsets of the slots in index order (64-byte aligned) and the buckets
 * over the trainable ones; frozen slots must come last (freeze.c). */
loom_status loom_arena_place(loom_model *m, loom_arena *a);
/* Moves a filled arena's w to the model's device and makes the compute
 * copy wc. */
loom_status loom_arena_commit(loom_model *m, loom_arena *a);
/* With defer_master (a GPU model in bf16/fp16): the compute copy only; w
 * stays in host memory until loom_arena_master_to_device (the arena is
 * trained) or loom_arena_drop_master (it is frozen). */
loom_status loom_arena_commit_ex(loom_model *m, loom_arena *a, bool defer_master);
loom_status loom_arena_master_to_device(loom_model *m, loom_arena *a);
/* wc from w again (after the optimizer or a merge changed w). */
loom_status loom_arena_sync(loom_model *m, loom_arena *a);
/* This rank's values (or gradients) of slot i as host fp32: a pointer into
 * the arena on CPU, else a copy in *tmp (grown; the caller frees it). */
loom_status loom_arena_host(loom_model *m, const loom_arena *a, int i, bool grads, float **tmp,
                            size_t *tmp_cap, const float **out);
/* A frozen arena on a GPU in bf16/fp16 needs no fp32 master: frees it (w
 * becomes NULL; values are read from wc). */
void loom_arena_drop_master(loom_model *m, loom_arena *a);
void loom_arena_free(loom_model *m, loom_arena *a);

/* model.c's layout code, shared with the memory predictor (meta.c). */
loom_status loom_model_build_slots(loom_model *m);
void loom_model_set_sizes(loom_model *m, const loom_mesh_sizes *n, const loom_model_config *c,
                          int64_t pad);
int64_t loom_loss_block_rows(bool cuda, int64_t Vl, int64_t Tc);
/* Activation buffers are carved from one allocation (act_mem) by acts.c's
 * layout, run twice: first to measure (base NULL), then to assign. Pools
 * whose lay is NULL are only measured (the memory predictor). */
typedef struct loom_carve {
    char *base;
    size_t used;
} loom_carve;
void loom_acts_layout(loom_model *m, loom_carve *c, int64_t T, int64_t Tc, int64_t Tn, int n_micro,
                      int in_flight, int lr, bool dropout);
/* The pipeline rank holding a tensor (a tied embedding: the first). */
int loom_param_stage(const loom_param_spec *p, int64_t L, int pp, int vpp);
/* The same for one pipeline stage. */
loom_status loom_memory_predict_stage(loom_ctx *ctx, const loom_model_config *cfg,
                                      const loom_mem_in *in, int pp_rank, loom_mem_report *out);

#endif /* LOOM_MODEL_H */
