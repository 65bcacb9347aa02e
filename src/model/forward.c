/* Forward and backward of one model chunk on one micro-batch, with tensor,
 * sequence and context parallelism (model.h says who holds what): the
 * embedding, the layers, then the final norm, the vocab-parallel output
 * layer and loss, a block of rows at a time, with the loss backward fused
 * in. A layer is a sequence of blocks (block.h), each as DESIGN.md draws it:
 *
 *   h = rmsnorm(x)              SP: all-gather over tp
 *   x += reduce(block(h)) (+b)  SP: reduce-scatter, else all-reduce
 *
 * with the block's own work (attention, MLP) in its kind's file. Each
 * backward walks the same steps in reverse, with the dual collectives.
 * Parameter gradients accumulate (+=) into m->base.g. */
#include <math.h>
#include <string.h>

#include "block.h"
#include "kern.h"
#include "loss.h"
#include "model.h"
#include "prof.h"

/* Activations of layer i of a chunk (compute dtype) */
#define AT(buf, i, per) ((void *)((char *)(buf) + (size_t)(i) * (size_t)(per) * m->dev.esz))

/* ---- tensor-parallel collectives on (tokens, H) activations ---- */

/* Sequence-parallel gather: src (Tn, H) -> dst (Tc, H); without SP a copy
 * (or nothing when dst == src). */
static loom_status sp_gather(loom_model *m, const void *src, void *dst) {
    size_t n = (size_t)(m->Tn * m->H);
    if (m->sp) {
        LOOM_PROF_AROUND(m, "tp comm", loom_comm_allgather(m->mesh->tp, src, dst, n, m->dev.adt));
        return LOOM_OK;
    }
    return loom_k_copy(m, dst, src, n * m->dev.esz);
}

/* Sum of the tp ranks' partial results: src (Tc, H), modified -> dst (Tn, H):
 * reduce-scatter under SP, else all-reduce. */
static loom_status tp_reduce(loom_model *m, void *src, void *dst) {
    size_t n = (size_t)(m->Tn * m->H);
    if (m->sp) {
        LOOM_PROF_AROUND(m, "tp comm",
                         loom_comm_reduce_scatter(m->mesh->tp, src, dst, n, m->dev.adt,
                                                  LOOM_RED_SUM));
        return LOOM_OK;
    }
    if (m->tp > 1)
        LOOM_PROF_AROUND(m, "tp comm",
                         loom_comm_allreduce(m->mesh->tp, src, n, m->dev.adt, LOOM_RED_SUM));
    return loom_k_copy(m, dst, src, n * m->dev.esz);
}

/* Global token index (within the micro-batch) of this rank's local tokens
 * on the host. */
static const int32_t *my_qidx(const loom_model *m) {
    return m->cp == 1 ? NULL : m->perm + (int64_t)m->mesh->cp_rank * m->Tc;
}

/* ---- one layer: its blocks in order (block.h) ---- */

/* Layer i of a chunk: its blocks, their slots, and where its activations
 * are (its input and output in a->x, the rest in its loom_layer_acts). */
typedef struct lbuf {
    int nb;
    const loom_block *blk;              /* (nb): kinds and slots (m->layer) */
    int bias[LOOM_LAYER_MAX_BLOCKS];    /* output biases' slots; -1 none */
    const void *x;
    void *r[LOOM_LAYER_MAX_BLOCKS];     /* (Tn, H): the residual stream after block j */
    const loom_layer_acts *t;
} lbuf;

static void layer_bufs(loom_model *m, loom_acts *a, int64_t i, int64_t l, lbuf *b) {
    const loom_layer *L = &m->layer[l];
    const int64_t Tn = m->Tn, H = m->H;
    b->nb = L->nb;
    b->blk = L->b;
    for (int j = 0; j < b->nb; j++) {
        const int ob = L->b[j].kind->out_bias;
        b->bias[j] = ob >= 0 ? L->b[j].w[ob] : -1;
    }
    b->t = &a->lay[i];
    b->x = AT(a->x, i, Tn * H);
    for (int j = 0; j + 1 < b->nb; j++) b->r[j] = b->t->r[j];
    b->r[b->nb - 1] = AT(a->x, i + 1, Tn * H);
}

static loom_blk blk(loom_model *m, const lbuf *b, int j, int64_t l, const loom_micro *mb) {
    const loom_block *k = &b->blk[j];
    return (loom_blk){.m = m, .l = l, .mb = mb, .act = b->t->act[j],
                      .scratch = m->scratch[k->kind->id], .host = m->host_scratch[k->kind->id],
                      .lora_u = b->t->lora_u, .w = k->w,
                      .lin0 = k->lin0};
}

/* After block j computed its partial output `part`: the tp reduce into
 * r[j], the residual and the output bias; then, inside the layer, the next
 * block's input norm (fused with the add where no bias comes between) and
 * its SP gather. */
static loom_status residual(loom_model *m, const lbuf *b, int j, void *part) {
    const int64_t H = m->H, Tn = m->Tn;
    const float eps = (float)m->cfg.rms_norm_eps;
    void *r = b->r[j];
    const void *rin = j ? b->r[j - 1] : b->x;
    const int bias = b->bias[j];
    CK(tp_reduce(m, part, r));
    if (j + 1 == b->nb) {
        CK(loom_k_add(m, r, rin, Tn * H));
        return bias >= 0 ? loom_k_bias_fwd(m, r, loom_wc(m, bias), Tn, H) : LOOM_OK;
    }
    const void *w = loom_wc(m, b->blk[j + 1].norm);
    void *h = m->sp ? m->dtmp : b->t->h[j + 1];
    if (bias >= 0) {
        CK(loom_k_add(m, r, rin, Tn * H));
        CK(loom_k_bias_fwd(m, r, loom_wc(m, bias), Tn, H));
        CK(loom_k_rmsnorm_fwd(m, r, w, Tn, H, eps, h, b->t->rstd[j + 1]));
    } else {
        CK(loom_k_add_rmsnorm_fwd(m, r, rin, r, w, Tn, H, eps, h, b->t->rstd[j + 1]));
    }
    return m->sp ? sp_gather(m, m->dtmp, b->t->h[j + 1]) : LOOM_OK;
}

/* The layer's blocks in order. full: the layer recomputed in full, its
 * output kept (the last block runs without producing it). */
static loom_status layer_run(loom_model *m, const lbuf *b, int64_t l, const loom_micro *mb,
                             bool full) {
    CK(loom_prof_mark(m, b->blk[0].kind->name)); /* a block's part: from its norm */
    CK(loom_k_rmsnorm_fwd(m, b->x, loom_wc(m, b->blk[0].norm), m->Tn, m->H,
                          (float)m->cfg.rms_norm_eps, m->sp ? m->dtmp : b->t->h[0], b->t->rstd[0]));
    if (m->sp) CK(sp_gather(m, m->dtmp, b->t->h[0]));
    for (int j = 0; j < b->nb; j++) {
        const loom_blk c = blk(m, b, j, l, mb);
        if (j) CK(loom_prof_mark(m, b->blk[j].kind->name));
        if (full && j + 1 == b->nb) return b->blk[j].kind->fwd(&c, b->t->h[j], NULL);
        /* the output straight into the residual stream unless SP scatters it there */
        void *part = m->sp ? m->dtmp : b->r[j];
        CK(b->blk[j].kind->fwd(&c, b->t->h[j], part));
        CK(residual(m, b, j, part));
    }
    return LOOM_OK;
}

static loom_status layer_fwd(loom_model *m, loom_acts *a, int64_t i, int64_t l,
                             const loom_micro *mb) {
    lbuf b;
    layer_bufs(m, a, i, l, &b);
    return layer_run(m, &b, l, mb, false);
}

/* Before layer i's backward: what recomputation left out, computed again
 * from the kept inputs with the same ops (so the same values): the blocks'
 * dropped buffers (MLP), or the whole layer but its output (FULL). */
static loom_status layer_recompute(loom_model *m, const lbuf *b, int64_t l, const loom_micro *mb) {
    if (m->recompute == LOOM_RECOMPUTE_NONE) return LOOM_OK;
    loom_prof_phase(m, "recompute");
    if (m->recompute == LOOM_RECOMPUTE_FULL) {
        CK(layer_run(m, b, l, mb, true));
    } else {
        for (int j = 0; j < b->nb; j++) {
            const loom_blk c = blk(m, b, j, l, mb);
            if (!b->blk[j].kind->recompute) continue;
            CK(loom_prof_mark(m, b->blk[j].kind->name));
            CK(b->blk[j].kind->recompute(&c, b->t->h[j]));
        }
    }
    loom_prof_phase(m, "backward");
    return LOOM_OK;
}

/* Block j's backward: m->dx holds d loss / d r[j] (Tn, H) on entry and
 * d loss / d r[j-1] on return. */
static loom_status block_bwd(loom_model *m, const lbuf *b, int j, int64_t l,
                             const loom_micro *mb) {
    const int64_t H = m->H, Tn = m->Tn;
    void *dx = m->dx, *dtmp = m->dtmp, *dfull = m->sp ? m->dfull : m->dx;
    CK(loom_prof_mark(m, b->blk[j].kind->name));
    if (b->bias[j] >= 0) CK(loom_k_bias_bwd(m, dx, Tn, H, loom_g(m, b->bias[j])));
    if (m->sp) CK(sp_gather(m, dx, dfull));
    /* The first layer's input gradient feeds only the embedding's and its
     * norm's gradients: with both frozen (LoRA) it is not formed, and the
     * weight gradients are all the rest of the backward. */
    const bool want_dx = j > 0 || l > 0 || loom_g(m, m->embed) || loom_g(m, b->blk[0].norm);
    const loom_blk c = blk(m, b, j, l, mb);
    CK(b->blk[j].kind->bwd(&c, b->t->h[j], dfull, want_dx ? dtmp : NULL));
    if (!want_dx) return LOOM_OK;
    void *red = m->sp ? m->dfull : dtmp; /* reduce-scatter needs distinct buffers */
    CK(tp_reduce(m, dtmp, red));
    return loom_k_rmsnorm_bwd_add(m, red, j ? b->r[j - 1] : b->x, loom_wc(m, b->blk[j].norm),
                                  b->t->rstd[j], Tn, H, dx, loom_g(m, b->blk[j].norm));
}

/* m->dx holds d loss / d x[i+1] (Tn, H) on entry and d loss / d x[i] on return. */
static loom_status layer_bwd(loom_model *m, loom_acts *a, int64_t i, int64_t l,
                             const loom_micro *mb) {
    lbuf b;
    layer_bufs(m, a, i, l, &b);
    CK(layer_recompute(m, &b, l, mb));
    for (int j = b.nb - 1; j >= 0; j--) CK(block_bwd(m, &b, j, l, mb));
    return LOOM_OK;
}

/* ---- embedding (vocab-parallel: rows outside this rank's block give zeros) ---- */

static loom_status embed_fwd(loom_model *m, const loom_micro *mb, void *x0) {
    const loom_slot *s = &m->base.slots[m->embed];
    CK(loom_prof_mark(m, "embedding"));
    CK(loom_k_embed_fwd(m, mb->d_ids, m->Tc, loom_wc(m, m->embed), s->row0, s->rows, m->dtmp));
    return tp_reduce(m, m->dtmp, x0);
}

static loom_status embed_bwd(loom_model *m, const loom_micro *mb) {
    const loom_slot *s = &m->base.slots[m->embed];
    float *dW = loom_g(m, m->embed);
    void *dfull = m->sp ? m->dfull : m->dx;
    if (!dW) return LOOM_OK; /* frozen */
    CK(loom_prof_mark(m, "embedding"));
    if (m->sp) CK(sp_gather(m, m->dx, dfull));
    return loom_k_embed_bwd(m, mb->d_ids, m->Tc, dfull, s->row0, s->rows, dW);
}

/* ---- output layer (vocab-parallel), its logits handed to the loss (loss.h) ---- */

/* forward_only's logits: rows of this rank's columns into the global batch */
static loom_status put_logits(loom_model *m, int64_t r0, int64_t c, int64_t v0,
                              const loom_micro *mb, float *logits) {
    const int64_t Vl = m->Vl;
    const float *z = m->logits;
    if (m->dev.cuda) {
        if (!m->logits_h) {
            m->logits_h = loom_malloc(m->ctx, (size_t)(m->chunk_rows * Vl) * sizeof(float),
                                      "logits (host copy)");
            if (!m->logits_h) return LOOM_ERR_OOM;
        }
        CK(loom_k_download_f32(m, m->logits_h, m->logits, (size_t)(c * Vl)));
        z = m->logits_h;
    }
    const int32_t *qidx = my_qidx(m);
    for (int64_t r = 0; r < c; r++) {
        int64_t gt = mb->out0 + (qidx ? qidx[r0 + r] : r0 + r);
        for (int64_t j = 0; j < Vl && v0 + j < m->V; j++) logits[gt * m->V + v0 + j] = z[r * Vl + j];
    }
    return LOOM_OK;
}

static loom_status head_fwd_bwd(loom_model *m, loom_acts *a, const loom_micro *mb, bool backward,
                                float *token_logprob, float *entropy, float *logits,
                                double *loss_sum, int64_t *n_tokens) {
    const loom_slot *s = &m->base.slots[m->head];
    const int64_t H = m->H, Tn = m->Tn, Tc = m->Tc, Vl = m->Vl, v0 = s->row0;
    const void *xL = AT(a->x, m->chunks[m->vpp - 1].nl, Tn * H);
    const void *Wh = loom_wc(m, m->head);
    void *hf = m->dfull; /* (Tc, H): the final norm's output, gathered under SP */
    int64_t nvalid = m->V - v0; /* columns of this rank inside the real vocabulary */
    nvalid = nvalid > Vl ? Vl : nvalid < 0 ? 0 : nvalid;
    CK(loom_prof_mark(m, backward ? "output layer, loss" : "output layer"));
    CK(loom_k_rmsnorm_fwd(m, xL, loom_wc(m, m->final_norm), Tn, H, (float)m->cfg.rms_norm_eps,
                          a->hf, a->rstdf));
    CK(sp_gather(m, a->hf, hf));
    for (int64_t r0 = 0; r0 < Tc; r0 += m->chunk_rows) {
        int64_t c = Tc - r0 < m->chunk_rows ? Tc - r0 : m->chunk_rows;
        CK(loom_k_lin_fwd(m, (const char *)hf + (size_t)(r0 * H) * m->dev.esz, c, H, Wh, Vl, 1.0f,
                          0.0f, m->logits));
        /* forward_only's logits are copied out before they become gradients */
        const loom_loss_block blk = {m->logits, r0, c, Vl, v0, nvalid};
        CK(m->loss->block(m, mb, &blk, backward && !logits));
        if (logits) CK(put_logits(m, r0, c, v0, mb, logits));
        if (!backward) continue;
        CK(loom_k_lin_dx(m, m->logits, c, Vl, Wh, H, 1.0f, 0.0f,
                         (char *)m->dtmp + (size_t)(r0 * H) * m->dev.esz));
        CK(loom_k_lin_dw(m, m->logits, (const char *)hf + (size_t)(r0 * H) * m->dev.esz, c, Vl, H,
                         1.0f, loom_g(m, m->head)));
    }
    CK(m->loss->finish(m, mb, token_logprob, entropy, loss_sum, n_tokens));
    if (!backward) return LOOM_OK;
    CK(tp_reduce(m, m->dtmp, a->dstash));
    return loom_k_rmsnorm_bwd(m, a->dstash, xL, loom_wc(m, m->final_norm), a->rstdf, Tn, H,
                              a->dstash, loom_g(m, m->final_norm));
}

loom_status loom_chunk_forward(loom_model *m, int c, loom_acts *a, const loom_micro *mb,
                               bool backward, float *token_logprob, float *entropy,
                               float *logits, double *loss_sum, int64_t *n_tokens) {
    const loom_chunk *ch = &m->chunks[c];
    *loss_sum = 0.0;
    *n_tokens = 0;
    m->cur_mb = mb;
    loom_prof_phase(m, "forward");
    if (ch->first) CK(embed_fwd(m, mb, a->x));
    for (int64_t i = 0; i < ch->nl; i++) CK(layer_fwd(m, a, i, ch->l0 + i, mb));
    if (ch->last)
        CK(head_fwd_bwd(m, a, mb, backward, token_logprob, entropy, logits, loss_sum, n_tokens));
    return LOOM_OK;
}

loom_status loom_chunk_backward(loom_model *m, int c, loom_acts *a, const loom_micro *mb) {
    const loom_chunk *ch = &m->chunks[c];
    m->cur_mb = mb;
    loom_prof_phase(m, "backward");
    if (ch->last) CK(loom_k_copy(m, m->dx, a->dstash, (size_t)(m->Tn * m->H) * m->dev.esz));
    for (int64_t i = ch->nl - 1; i >= 0; i--) CK(layer_bwd(m, a, i, ch->l0 + i, mb));
    CK(loom_prof_mark(m, "norm weights"));
    CK(loom_k_dw_flush(m)); /* the layer norms' weight gradients, batched */
    if (ch->first) CK(embed_bwd(m, mb));
    return LOOM_OK;
}
