/* The layer table. A decoder layer is a sequence of blocks, each
 *
 *   h = rmsnorm(x)            its input norm; SP: all-gathered over tp
 *   p = block(h)              this rank's partial sum of the block's output
 *   x = x + reduce(p) (+ b)   tp: reduce-scatter under SP, else all-reduce
 *
 * today [attention, dense MLP]. The walker (forward.c) owns what every
 * block shares: the input norm (fused with the previous block's residual
 * add where the layer has one), the sequence-parallel gather, the
 * tensor-parallel reduce, the residual, the output bias and the
 * recomputation policy. A block kind (loom_block_kind) owns the rest: its
 * tensors (the parameter plan, their tensor-parallel split), its linears
 * (LoRA's targets), its activation buffers, and its forward from the
 * gathered normed input to its partial output, backward from the gathered
 * output gradient to the partial input gradient, and recompute. Kinds:
 * block_attn.c (attention), block_mlp.c (dense SwiGLU MLP), block_moe.c
 * (Qwen3-MoE's router and experts, local or dispatched over ep x etp, and
 * Qwen2-MoE's gated shared expert), block_gdn.c (Qwen3.5's Gated DeltaNet);
 * docs/DESIGN.md, "The layer table", walks through adding one. */
#ifndef LOOM_MODEL_BLOCK_H
#define LOOM_MODEL_BLOCK_H

#include "../io/hf_config.h"
#include "kern.h"
#include "params.h"

typedef struct loom_block_kind loom_block_kind;

enum {
    LOOM_LAYER_MAX_BLOCKS = 4,   /* blocks of one layer */
    LOOM_BLOCK_MAX_SLOTS = 16,   /* tensors of one block */
    LOOM_BLOCK_MAX_LINEARS = 8,  /* linears of one block */
    LOOM_LAYER_MAX_LINEARS = 16, /* linears of one layer */
    LOOM_BLOCK_MAX_BUFS = 32,    /* activation buffers of one block, per layer */
    LOOM_BLOCK_MAX_SCRATCH = 24, /* scratch buffers of one kind */
    LOOM_MOE_MAX_EXPERTS = 512,  /* experts of a MoE layer */
    LOOM_MOE_EXPERT_SLOTS = 3,   /* an expert's tensors (gate, up, down): expert e's slots
                                  * lie this many after expert e-1's */
};

/* The kinds, in the order their scratch buffers are carved. */
enum { LOOM_KIND_ATTN, LOOM_KIND_MLP, LOOM_KIND_MOE, LOOM_KIND_GDN, LOOM_NKINDS };
extern const loom_block_kind *const loom_block_kinds[LOOM_NKINDS];

/* ---- parameters ---- */

/* How random weights (loom_write_random_model) fill a tensor: by its shape
 * (matrices ~ N(0, initializer_range), 1-D weights 1, or 0 where norms are
 * zero-centred, biases 0), or as transformers initialises the kind's own. */
typedef enum loom_init {
    LOOM_INIT_SHAPE = 0,
    LOOM_INIT_ONES,  /* 1 (the gated norm's weight, Gated DeltaNet's dt_bias) */
    LOOM_INIT_LOG_U16 /* log(U(0, 16)) (Gated DeltaNet's A_log) */
} loom_init;

/* One tensor of a kind, by the kind's slot number. */
typedef struct loom_block_slot {
    const char *leaf;   /* HF name after "model.layers.<l>.", e.g. "self_attn.q_proj.weight"
                         * (an expert's holds its number as %lld) */
    loom_component comp;
    loom_shard shard;   /* tensor-parallel split: ROWS for a column-parallel linear, COLS for a
                         * row-parallel one, NONE replicated */
    bool headwise;      /* replicated but applied to this rank's heads only (q/k norms): its
                         * gradient is a partial sum over tp */
    loom_init init;     /* its random values */
} loom_block_slot;

/* A linear of a kind: y = x W^T, W (out, in) its weight's slot. LoRA can
 * target it by its PEFT module name. Linears that read the same input
 * (q, k, v) lie together, `group` the first of them (its own number when
 * it is alone): LoRA runs their A projections as one GEMM. */
typedef struct loom_block_linear {
    const char *path, *name; /* PEFT's module: "self_attn", "q_proj" */
    int w;                   /* slot of its weight */
    int group;
    bool experts;            /* one per expert (path "mlp.experts", PEFT's module
                              * mlp.experts.<e>.<name>): the kind runs its LoRA itself
                              * (lora.c's loom_lora_expert_*) */
    bool named;              /* a target only when named (not in "all-linear": the
                              * MoE router, whose PEFT all-linear skips it too) */
} loom_block_linear;

/* The parameter plan being built (params.c): a kind's `params` declares the
 * tensors a layer of the config holds, in the plan's order. */
typedef struct loom_param_sink loom_param_sink;
/* Slot `slot` of the kind, full shape d0 x d1 (d1 0: 1-D). */
void loom_param_put(loom_param_sink *s, int slot, int64_t d0, int64_t d1);
/* The same for expert e's tensor (the slot's leaf formats e). */
void loom_param_put_expert(loom_param_sink *s, int slot, int64_t e, int64_t d0, int64_t d1);
/* Slot `slot` of the kind whose rows are nparts (<= LOOM_ROW_PARTS_MAX)
 * fused tensors of part[k] rows each, d1 columns: a ROWS slot splits each
 * part over tp on its own, so a rank holds its share of every part. */
void loom_param_put_parts(loom_param_sink *s, int slot, int64_t d1, int nparts,
                          const int64_t *part);
loom_ctx *loom_param_sink_ctx(loom_param_sink *s);
/* block_mlp.c: a SwiGLU MLP's gate, up and down (and their biases under
 * mlp_bias) of width `inter`, expert e's (-1: none), as the calling kind's
 * slots from slot0 on in the dense MLP's order: gate, up, down weights, then
 * biases. */
void loom_mlp_params(const loom_model_config *c, loom_param_sink *s, int slot0, int64_t e,
                     int64_t inter);

/* ---- the layer table of a model (model.h's m->layer) ---- */

/* One block of a layer: its kind, and the base slots of its tensors on this
 * rank (-1: absent, or another pipeline stage's layer). */
typedef struct loom_block {
    const loom_block_kind *kind;
    int norm;                      /* its input RMSNorm's weight */
    int w[LOOM_BLOCK_MAX_SLOTS];   /* by the kind's slot number */
    int lin0;                      /* its first linear's number in the layer */
} loom_block;

/* The layer's linears in block order (LoRA's modules of the layer). */
typedef struct loom_layer_lin {
    int b, k;          /* its block and the kind's linear number */
    int target;        /* its LoRA target (loom_lora_target_name) */
    int group, gn;     /* its group: the layer's number of the first, and their count */
    int64_t in, out;   /* full features; 0: the config gives the layer no such linear
                        * (a MoE layer without a shared expert; target -1) */
    bool row_par;      /* row-parallel (input split over tp), else column-parallel */
    bool rep;          /* replicated, neither split (the shared expert's gate) */
    int nparts;        /* its weight's fused row parts (loom_param_spec.part), 0: none; LoRA's
                        * B splits over tp as they do */
    int64_t part[LOOM_ROW_PARTS_MAX];
} loom_layer_lin;

typedef struct loom_layer {
    int nb, nlin;
    bool held;         /* this rank holds it */
    loom_block b[LOOM_LAYER_MAX_BLOCKS];
    loom_layer_lin lin[LOOM_LAYER_MAX_LINEARS];
} loom_layer;

/* The layer table from the parameter plan: every layer's blocks and
 * linears; the slots stay -1 (model.c's build_slots fills them). */
loom_status loom_layers_build(loom_ctx *ctx, const loom_model_config *c,
                              const loom_param_plan *plan, loom_layer *layers);

/* One activation buffer of a block, per layer and micro-batch in flight. */
typedef struct loom_block_buf {
    size_t bytes; /* 0: the config has none */
    bool cheap;   /* dropped under selective recomputation, made again by `recompute` */
    bool route;   /* kept under full recomputation too (small: a router's choices and
                   * their tables), so the forward run again routes as the first did
                   * without the router */
} loom_block_buf;

/* Where one layer's activations are for one micro-batch (loom_acts_layout
 * carves them; with recomputation the buffers not kept point into one
 * layer's region that every layer shares). Block j reads the residual
 * stream r[j-1] (the layer's input x[i] for the first) and writes r[j] (the
 * layer's output x[i+1] for the last, not here). */
typedef struct loom_layer_acts {
    void *r[LOOM_LAYER_MAX_BLOCKS];      /* (Tn, H) */
    void *h[LOOM_LAYER_MAX_BLOCKS];      /* (Tc, H): block j's normed input, gathered under SP */
    float *rstd[LOOM_LAYER_MAX_BLOCKS];  /* (Tn) */
    void *act[LOOM_LAYER_MAX_BLOCKS][LOOM_BLOCK_MAX_BUFS]; /* the kinds' buffers */
    void *lora_u;                        /* (linears, Tc, r): LoRA's x A^T of the active adapter */
} loom_layer_acts;

/* One block of one layer, as the walker hands it to its kind. */
typedef struct loom_blk {
    loom_model *m;
    int64_t l;                 /* the global layer */
    const loom_micro *mb;      /* the micro-batch */
    void *const *act;          /* its activation buffers of this layer, by the kind's index
                                * (NULL where the config has none) */
    void *const *scratch;      /* its kind's scratch buffers (one set for every layer) */
    void *lora_u;              /* the layer's LoRA stash */
    void *host;                /* its kind's host scratch (one for every layer) */
    const int *w;              /* its tensors' base slots, by the kind's slot number
                                * (an expert's: expert 0's; the kind knows the stride) */
    int lin0;                  /* its first linear's number in the layer (LoRA's module) */
} loom_blk;

struct loom_block_kind {
    const char *name;
    int id;                    /* LOOM_KIND_* */
    /* its input norm's HF leaf under the layer ("input_layernorm.weight") */
    const char *norm;
    /* its tensors and linears; the slot of the output bias that the walker
     * adds (-1: none) */
    const loom_block_slot *slots;
    int nslots;
    const loom_block_linear *lin;
    int nlin;
    int out_bias;
    /* declares layer l's tensors (loom_param_put) */
    loom_status (*params)(const loom_model_config *c, int64_t l, loom_param_sink *s);
    /* its activation buffers per layer (out: LOOM_BLOCK_MAX_BUFS) and its
     * scratch (bytes: LOOM_BLOCK_MAX_SCRATCH), for micro-batches of T tokens,
     * Tc on this rank, Tn in the residual stream; return their numbers */
    int (*acts)(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out);
    int (*scratch)(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes);
    /* bytes of host scratch it needs (NULL: none) */
    size_t (*host)(const loom_model *m);
    /* forward: h (Tc, H), the normed input gathered over tp under SP ->
     * out (Tc, H), this rank's partial sum of the output (the walker reduces
     * it over tp). out NULL: the layer's last block recomputed in full (the
     * layer's output is kept): everything its backward reads, LoRA's stash
     * included, but not the output. */
    loom_status (*fwd)(const loom_blk *b, const void *h, void *out);
    /* backward: dy (Tc, H), the output gradient gathered under SP -> dx
     * (Tc, H), this rank's partial sum of d/dh; dx NULL: not wanted (the
     * first layer's first block with the embedding and its norm frozen),
     * only the weight gradients. Weight gradients accumulate. */
    loom_status (*bwd)(const loom_blk *b, const void *h, const void *dy, void *dx);
    /* selective recomputation (LOOM_RECOMPUTE_MLP): the buffers it drops,
     * computed again from h and those kept; NULL: it drops none */
    loom_status (*recompute)(const loom_blk *b, const void *h);
};

extern const loom_block_kind loom_block_attn, loom_block_mlp, loom_block_moe, loom_block_gdn;

/* block_moe.c: the load-balancing loss (loom.h's loom_moe_aux) and the
 * router z-loss. Doubles a micro-batch's `aux` holds (0: a model without
 * experts); after the micro-batch's forward on
 * the last stage: the losses over its layers (into mb->aux_loss and
 * mb->z_loss), coef times each times the micro-batch's targets into
 * *loss_sum (on one rank of the tp x cp group; 0 elsewhere), and with
 * backward their gradient (mb->d_aux_g) for the layers' backward. */
size_t loom_moe_aux_len(const loom_model *m);
/* Floats of its gradient (aux_g): E, or per layer L x E (LOOM_MOE_AUX_PER_LAYER),
 * then the z-loss's factor. */
size_t loom_moe_grad_len(const loom_model *m);
loom_status loom_moe_finish(loom_model *m, loom_micro *mb, bool backward, double *loss_sum);

/* The kinds of layer l's blocks in order (k has LOOM_LAYER_MAX_BLOCKS
 * entries); the number of blocks. */
int loom_layer_kinds(const loom_model_config *c, int64_t l, const loom_block_kind **k);

/* ---- LoRA targets: the kinds' linears by PEFT module name ---- */

/* The distinct module names of every kind's linears, in kind then linear
 * order (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, the
 * shared expert's gate, the MoE router's gate); "all-linear" is all of them
 * but the ones taken only when named (loom_lora_target_named). A target set
 * is a bool array indexed by these numbers (model.h's LOOM_LORA_NMOD of them
 * at most). */
int loom_lora_ntargets(void);
const char *loom_lora_target_name(int t);
/* Target t is taken only when named (block.h's loom_block_linear.named). */
bool loom_lora_target_named(int t);
/* The number of the name p[0..n), -1 when no kind has such a linear. */
int loom_lora_target_find(const char *p, size_t n);

/* ---- for the kinds: linears with LoRA (lora.c's hooks) ---- */

/* y (T, out) = x W^T plus, where an adapter covers the kind's linear k,
 * LoRA's s (x A^T) B^T: the LoRA term is written first and the base GEMM
 * accumulates onto it (its read of y hides under the GEMM's compute; adding
 * the LoRA term afterwards was one more pass over y). */
loom_status loom_blk_lin(const loom_blk *b, int k, const void *x, int64_t T, int64_t in,
                         const void *W, int64_t out, void *y);
/* LoRA's forward alone on linear k (the base GEMM not needed): its stash,
 * and its term into y. */
loom_status loom_blk_lora_fwd(const loom_blk *b, int k, const void *x, int64_t T, void *y);
/* LoRA's backward on linear k: dx = d/dx of its term + (*acc ? dx : 0), *acc
 * set once it wrote dx; dx NULL: dA and dB only. With t (not NULL), for the
 * last LoRA backward before an input gradient's sum: the term du A appended
 * as t[*n] where it can be (loom_k_lin_dx_sum then adds it in with the base
 * projections' terms, one GEMM). */
loom_status loom_blk_lora_bwd(const loom_blk *b, int k, const void *x, int64_t T,
                              const void *dy, void *dx, bool *acc, loom_dx_term *t, int *n);

/* ---- for the kinds: context parallelism (cp > 1: this rank holds Tc of
 * the micro-batch's T tokens, m->d_perm says which) ---- */

/* loc (Tc, w) of every cp rank -> full (T, w) in token order, elements of
 * dt (the model's or F32); blk: (T, w) scratch. A copy when cp is 1. */
loom_status loom_cp_gather(loom_model *m, const void *loc, int64_t w, loom_dtype dt, void *full,
                           void *blk);
/* full (T, w) partial sums (this rank's share of a gradient) -> loc (Tc, w),
 * the sums over cp of this rank's rows. */
loom_status loom_cp_reduce(loom_model *m, const void *full, int64_t w, loom_dtype dt, void *loc,
                           void *blk);
/* this rank's rows of full (T, w) -> loc (Tc, w), the model's elements */
loom_status loom_cp_take(loom_model *m, const void *full, int64_t w, void *loc);
/* loc (Tc, w) -> its rows of full (T, w), zero elsewhere */
loom_status loom_cp_place(loom_model *m, const void *loc, int64_t w, void *full);

/* A base projection's term dy (T, out) W (out, in) of an input gradient. */
static inline loom_dx_term loom_dx_base(const void *dy, int64_t out, const void *W) {
    return (loom_dx_term){dy, out, out, W};
}

#endif /* LOOM_MODEL_BLOCK_H */
