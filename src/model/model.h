/* The model object behind include/loom.h's loom_model: parameters under
 * their HF names in one flat fp32 buffer, fp32 main grads in another, the
 * AdamW state, and the activation buffers of one micro-batch.
 *
 * Layout. Every HF tensor of the parameter plan gets a slot (offset, numel)
 * in `w` and `g`. The embedding and the output layer hold padded_vocab rows;
 * rows V..Vp-1 stay zero and are never written to files. With tied
 * embeddings lm_head.weight has no slot of its own: the output layer reads
 * and accumulates into the embedding's slot.
 *
 * Gradient convention. forward_backward adds the gradient of the SUM of
 * token losses into `g` and counts the tokens; clip_grad_and_step divides by
 * the count, so the step applies the gradient of the mean loss over every
 * token since the last step, however the batch was cut (DESIGN.md, "The
 * loss, exactly"). */
#ifndef LOOM_MODEL_H
#define LOOM_MODEL_H

#include "../io/hf_config.h"
#include "params.h"

/* Indices into loom_model.slots of one decoder layer's tensors (-1: absent). */
typedef struct loom_layer_slots {
    int ln1, ln2;                /* input_layernorm, post_attention_layernorm */
    int wq, wk, wv, wo;          /* (Hq*D, H), (Hkv*D, H), (Hkv*D, H), (H, Hq*D) */
    int bq, bk, bv, bo;          /* qkv biases (qwen2, llama attention_bias), o bias */
    int qn, kn;                  /* q_norm, k_norm (D) (qwen3) */
    int wg, wu, wd;              /* gate (I, H), up (I, H), down (H, I) */
    int bg, bu, bdn;             /* llama mlp_bias */
} loom_layer_slots;

typedef struct loom_slot {
    char *name;         /* HF name */
    int ndim;
    int64_t shape[2];   /* as in HF files */
    int64_t rows;       /* rows held (shape[0], or the padded vocabulary) */
    size_t off, numel;  /* in w / g; numel counts held rows */
    bool decay;         /* AdamW weight decay applies (2-D) */
} loom_slot;

/* Activations saved by the forward of one micro-batch of T tokens, for the
 * backward. Per layer l (offsets l * stride). */
typedef struct loom_acts {
    int64_t cap;        /* tokens the buffers hold */
    float *x;           /* (L+1, T, H): input of layer l; x[L] = last layer's output */
    float *h1, *h2;     /* (L, T, H): normed inputs of attention and MLP */
    float *rstd1, *rstd2; /* (L, T) */
    float *xmid;        /* (L, T, H): residual after attention */
    float *qpre, *kpre; /* (L, T, Hq*D), (L, T, Hkv*D): q, k before q/k norm (qk_norm only) */
    float *rstdq, *rstdk; /* (L, T*Hq), (L, T*Hkv) */
    float *q, *k, *v;   /* (L, T, Hq*D), (L, T, Hkv*D) x2: attention inputs (after rope) */
    float *o, *lse;     /* (L, T, Hq*D), (L, T*Hq) */
    float *gate, *up, *act; /* (L, T, I) */
    float *hf, *rstdf;  /* (T, H), (T): final norm */
    /* scratch */
    float *dx, *dtmp;   /* (T, H) */
    float *dq, *dk, *dv;/* (T, Hq*D), (T, Hkv*D) x2 */
    float *dout;        /* (T, Hq*D): gradient of the attention output */
    float *dg, *du;     /* (T, I) */
    float *logits;      /* (chunk, Vp) */
    float *celse;       /* (chunk): log-sum-exp of each logits row */
    int64_t chunk;      /* rows of logits computed at a time */
    int32_t *pos;       /* (T) */
    int32_t *cu;        /* (T+1) */
} loom_acts;

struct loom_model {
    loom_ctx *ctx;
    loom_model_config cfg;
    loom_param_plan plan;
    loom_dtype file_dtype;   /* dtype of the checkpoint's weights */

    int64_t V, Vp, H, I, L, Hq, Hkv, D;
    float attn_scale;

    loom_slot *slots;        /* one per HF tensor of the plan except a tied lm_head */
    int nslots;
    int embed, final_norm, head; /* head == embed when tied */
    loom_layer_slots *layer; /* (L) */
    size_t nparams;          /* total floats in w */
    float *w, *g;            /* parameters (fp32 master = compute copy on CPU), main grads */
    float *adam_m, *adam_v;  /* allocated at the first step */
    float *inv_freq;         /* (D/2) */

    loom_acts a;

    /* optimizer and schedule */
    loom_optimizer_config opt;
    bool has_sched;
    loom_sched_config sched;
    int64_t step;            /* optimizer steps taken */
    /* accumulation since the last step */
    int64_t acc_calls, acc_tokens;
    double acc_loss;
};

/* forward.c: one micro-batch. ids/targets/pos: (T); cu: (ndocs+1) over T.
 * With backward, adds d(sum of token losses)/dw into m->g. Per-token
 * outputs (token_logprob, entropy: (T); logits (T, V)) may be NULL. */
loom_status loom_model_run_micro(loom_model *m, const int32_t *ids, const int32_t *targets,
                                 const int32_t *pos, const int32_t *cu, int64_t ndocs, int64_t T,
                                 bool backward, float *token_logprob, float *entropy,
                                 float *logits, double *loss_sum, int64_t *n_tokens);

/* Grows the activation buffers to hold micro-batches of T tokens. */
loom_status loom_model_reserve(loom_model *m, int64_t T);
/* Slot index of an HF name, -1 when absent. */
int loom_model_find_slot(const loom_model *m, const char *name);

static inline float *loom_w(loom_model *m, int s) { return s < 0 ? NULL : m->w + m->slots[s].off; }
static inline float *loom_g(loom_model *m, int s) { return s < 0 ? NULL : m->g + m->slots[s].off; }

#endif /* LOOM_MODEL_H */
