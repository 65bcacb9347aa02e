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
 * recomputation policy. A block kind (loom_block_kind) owns the rest: the
 * block's forward from the gathered normed input to its partial output, and
 * the backward from the gathered output gradient to the partial input
 * gradient. Kinds: block_attn.c (attention), block_mlp.c (dense SwiGLU MLP);
 * docs/DESIGN.md walks through adding one. */
#ifndef LOOM_MODEL_BLOCK_H
#define LOOM_MODEL_BLOCK_H

#include "../io/hf_config.h"
#include "kern.h"

typedef struct loom_block_kind loom_block_kind;

enum {
    LOOM_LAYER_MAX_BLOCKS = 4,   /* blocks of one layer */
    LOOM_BLOCK_MAX_BUFS = 16,    /* activation buffers of one block, per layer */
    LOOM_BLOCK_MAX_SCRATCH = 8,  /* scratch buffers of one kind */
};

/* The kinds, in the order their scratch buffers are carved. */
enum { LOOM_KIND_ATTN, LOOM_KIND_MLP, LOOM_NKINDS };
extern const loom_block_kind *const loom_block_kinds[LOOM_NKINDS];

/* One activation buffer of a block, per layer and micro-batch in flight. */
typedef struct loom_block_buf {
    size_t bytes; /* 0: the config has none */
    bool cheap;   /* dropped under selective recomputation, made again by `recompute` */
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
} loom_blk;

struct loom_block_kind {
    const char *name;
    int id;                    /* LOOM_KIND_* */
    /* its activation buffers per layer (out: LOOM_BLOCK_MAX_BUFS) and its
     * scratch (bytes: LOOM_BLOCK_MAX_SCRATCH), for micro-batches of T tokens,
     * Tc on this rank, Tn in the residual stream; return their numbers */
    int (*acts)(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, loom_block_buf *out);
    int (*scratch)(const loom_model *m, int64_t T, int64_t Tc, size_t *bytes);
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

extern const loom_block_kind loom_block_attn, loom_block_mlp;

/* The kinds of layer l's blocks in order (k has LOOM_LAYER_MAX_BLOCKS
 * entries); the number of blocks. */
int loom_layer_kinds(const loom_model_config *c, int64_t l, const loom_block_kind **k);

/* ---- for the kinds: linears with LoRA (lora.c's hooks) ---- */

/* y (T, out) = x W^T plus, where an adapter covers layer linear `mod`,
 * LoRA's s (x A^T) B^T: the LoRA term is written first and the base GEMM
 * accumulates onto it (its read of y hides under the GEMM's compute; adding
 * the LoRA term afterwards was one more pass over y). */
loom_status loom_blk_lin(const loom_blk *b, int mod, const void *x, int64_t T, int64_t in,
                         const void *W, int64_t out, void *y);
/* LoRA's forward alone on `mod` (the base GEMM not needed): its stash, and
 * its term into y. */
loom_status loom_blk_lora_fwd(const loom_blk *b, int mod, const void *x, int64_t T, void *y);
/* LoRA's backward on `mod`: dx = d/dx of its term + (*acc ? dx : 0), *acc
 * set once it wrote dx; dx NULL: dA and dB only. With t (not NULL), for the
 * last LoRA backward before an input gradient's sum: the term du A appended
 * as t[*n] where it can be (loom_k_lin_dx_sum then adds it in with the base
 * projections' terms, one GEMM). */
loom_status loom_blk_lora_bwd(const loom_blk *b, int mod, const void *x, int64_t T,
                              const void *dy, void *dx, bool *acc, loom_dx_term *t, int *n);

/* A base projection's term dy (T, out) W (out, in) of an input gradient. */
static inline loom_dx_term loom_dx_base(const void *dy, int64_t out, const void *W) {
    return (loom_dx_term){dy, out, out, W};
}

#endif /* LOOM_MODEL_BLOCK_H */
