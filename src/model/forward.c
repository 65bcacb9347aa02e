/* Forward and backward of one model chunk on one micro-batch, with tensor,
 * sequence and context parallelism (model.h says who holds what). One
 * layer, as DESIGN.md draws it:
 *
 *   h1 = rmsnorm(x)               SP: all-gather over tp
 *   q,k,v = h1 W^T (+b)           column-parallel: this rank's heads
 *   q,k = qk_norm (qwen3), rope   CP: k, v all-gathered over cp
 *   o = attention(q, k, v)        causal, GQA, documents from cu_seqlens
 *   x += o Wo^T (+bo)             row-parallel: SP reduce-scatter, else all-reduce
 *   h2 = rmsnorm(x)               SP: all-gather
 *   x += (silu(h2 Wg^T) * h2 Wu^T) Wd^T (+bd)   row-parallel as above
 *
 * then the final norm, the vocab-parallel output layer and loss, a block of
 * rows at a time, with the loss backward fused in. Each backward walks the
 * same steps in reverse, with the dual collectives. HF weights are
 * (out, in): y = x W^T. Parameter gradients accumulate (+=) into m->base.g. */
#include <math.h>
#include <string.h>

#include "kern.h"
#include "loss.h"
#include "model.h"

/* Activation (compute dtype) and fp32 buffers of layer i of a chunk */
#define AT(buf, i, per) ((void *)((char *)(buf) + (size_t)(i) * (size_t)(per) * m->dev.esz))
#define ATF(buf, i, per) ((buf) + (size_t)(i) * (size_t)(per))

/* ---- tensor-parallel collectives on (tokens, H) activations ---- */

/* Sequence-parallel gather: src (Tn, H) -> dst (Tc, H); without SP a copy
 * (or nothing when dst == src). */
static loom_status sp_gather(loom_model *m, const void *src, void *dst) {
    size_t n = (size_t)(m->Tn * m->H);
    if (m->sp) return loom_comm_allgather(m->mesh->tp, src, dst, n, m->dev.adt);
    return loom_k_copy(m, dst, src, n * m->dev.esz);
}

/* Sum of the tp ranks' partial results: src (Tc, H), modified -> dst (Tn, H):
 * reduce-scatter under SP, else all-reduce. */
static loom_status tp_reduce(loom_model *m, void *src, void *dst) {
    size_t n = (size_t)(m->Tn * m->H);
    if (m->sp) return loom_comm_reduce_scatter(m->mesh->tp, src, dst, n, m->dev.adt, LOOM_RED_SUM);
    if (m->tp > 1) CK(loom_comm_allreduce(m->mesh->tp, src, n, m->dev.adt, LOOM_RED_SUM));
    return loom_k_copy(m, dst, src, n * m->dev.esz);
}

/* ---- context parallel: keys and values of the whole micro-batch ---- */

/* loc (Tc, w) of every cp rank -> full (T, w) in token order. */
static loom_status cp_gather(loom_model *m, const void *loc, int64_t w, void *full) {
    if (m->cp == 1) return loom_k_copy(m, full, loc, (size_t)(m->Tc * w) * m->dev.esz);
    CK(loom_comm_allgather(m->mesh->cp, loc, m->kvblk, (size_t)(m->Tc * w), m->dev.adt));
    return loom_k_rows_scatter(m, full, m->kvblk, m->d_perm, m->T, w);
}

/* full (T, w) gradients from this rank's queries -> loc (Tc, w) summed over cp. */
static loom_status cp_reduce(loom_model *m, const void *full, int64_t w, void *loc) {
    if (m->cp == 1) return loom_k_copy(m, loc, full, (size_t)(m->Tc * w) * m->dev.esz);
    CK(loom_k_rows_gather(m, m->kvblk, full, m->d_perm, m->T, w));
    return loom_comm_reduce_scatter(m->mesh->cp, m->kvblk, loc, (size_t)(m->Tc * w), m->dev.adt,
                                    LOOM_RED_SUM);
}

/* Global token index (within the micro-batch) of this rank's local tokens,
 * on the host and as the ops read it. */
static const int32_t *my_qidx(const loom_model *m) {
    return m->cp == 1 ? NULL : m->perm + (int64_t)m->mesh->cp_rank * m->Tc;
}
static const int32_t *my_qidx_d(const loom_model *m) {
    return m->cp == 1 ? NULL : m->d_perm + (int64_t)m->mesh->cp_rank * m->Tc;
}

/* y = x W^T plus, where an adapter covers the linear, LoRA's s (x A^T) B^T:
 * the LoRA term is written first and the base GEMM accumulates onto it (its
 * read of y hides under the GEMM's compute; adding the LoRA term afterwards
 * was one more pass over y). */
#define LIN(mod, x, T, in, W, out, y)                                                              \
    do {                                                                                           \
        const bool lo_ = loom_lora_covers(m, l, mod);                                              \
        bool both_ = false;                                                                        \
        if (lo_) CK(loom_lora_fwd(m, b->la, b->li, l, mod, x, T, y, 0.0f, W, &both_));             \
        if (!both_) CK(loom_k_lin_fwd(m, x, T, in, W, out, 1.0f, lo_ ? 1.0f : 0.0f, y));           \
    } while (0)
/* LoRA's backward on `mod`: dx = d/dx of its term + beta dx, *acc set once
 * it wrote dx. LORA_T, for the last LoRA backward before a block's input
 * gradient: the term du A appended to the block's terms t[*n] instead where
 * it can be (loom_k_lin_dx_sum then sums it with the base's in one GEMM). */
#define LORA_BT(mod, x, T, dy, dx, acc, defer)                                                     \
    do {                                                                                           \
        bool wrote_ = false;                                                                       \
        CK(loom_lora_bwd(m, b->la, b->li, l, mod, x, T, dy, dx, *(acc) ? 1.0f : 0.0f, &wrote_,     \
                         defer));                                                                  \
        if (wrote_) *(acc) = true;                                                                 \
    } while (0)
#define LORA_B(mod, x, T, dy, dx, acc) LORA_BT(mod, x, T, dy, dx, acc, NULL)
#define LORA_T(mod, x, T, g_, dx, acc, t, n)                                                       \
    do {                                                                                           \
        LORA_BT(mod, x, T, g_, dx, acc, &(t)[*(n)]);                                               \
        if ((t)[*(n)].dy) (*(n))++;                                                                \
    } while (0)
/* a base projection's term dy (T, out) W (out, in) of an input gradient */
#define TERM(t, n, dy_, out_, W_) ((t)[(n)++] = (loom_dx_term){(dy_), (out_), (out_), (W_)})

/* ---- one layer ---- */

/* Where layer i's activations are: its input and output in a->x; the rest
 * in a (kept for the backward) or, for the groups recomputed, in m->rc
 * (one layer; model.h). */
typedef struct lbuf {
    const void *x;
    void *xn, *xmid, *h1, *h2, *qpre, *kpre, *q, *k, *v, *o, *g, *u, *act;
    float *rstd1, *rstd2, *rstdq, *rstdk, *lse;
    loom_acts *la; /* LoRA's x A^T stash: la->lora_u at layer li */
    int64_t li;
} lbuf;

static void layer_bufs(loom_model *m, loom_acts *a, int64_t i, lbuf *b) {
    const int64_t H = m->H, Il = m->Il, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc, Tn = m->Tn;
    const bool full = m->recompute == LOOM_RECOMPUTE_FULL;
    loom_acts *w = full ? &m->rc : a, *p = m->recompute != LOOM_RECOMPUTE_NONE ? &m->rc : a;
    const int64_t wi = full ? 0 : i, pi = p == a ? i : 0;
    b->x = AT(a->x, i, Tn * H);
    b->xn = AT(a->x, i + 1, Tn * H);
    b->xmid = AT(w->xmid, wi, Tn * H);
    b->h1 = AT(w->h1, wi, Tc * H);
    b->h2 = AT(w->h2, wi, Tc * H);
    b->qpre = m->cfg.qk_norm ? AT(w->qpre, wi, Tc * QD) : NULL;
    b->kpre = m->cfg.qk_norm ? AT(w->kpre, wi, Tc * KD) : NULL;
    b->q = AT(w->q, wi, Tc * QD);
    b->k = AT(w->k, wi, T * KD);
    b->v = AT(w->v, wi, T * KD);
    b->o = AT(w->o, wi, Tc * QD);
    b->rstd1 = ATF(w->rstd1, wi, Tn);
    b->rstd2 = ATF(w->rstd2, wi, Tn);
    b->rstdq = m->cfg.qk_norm ? ATF(w->rstdq, wi, Tc * m->Hql) : NULL;
    b->rstdk = m->cfg.qk_norm ? ATF(w->rstdk, wi, Tc * m->Hkvl) : NULL;
    b->lse = ATF(w->lse, wi, Tc * m->Hql);
    b->g = AT(p->gate, pi, Tc * Il);
    b->u = AT(p->up, pi, Tc * Il);
    b->act = AT(p->act, pi, Tc * Il);
    b->la = w;
    b->li = wi;
}

/* Attention half: x -> h1, q, k, v, o -> xmid = x + o Wo^T, then h2 = norm(xmid). */
static loom_status attn_fwd(loom_model *m, const lbuf *b, int64_t l, const loom_micro *mb) {
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc, Tn = m->Tn;
    const float eps = (float)m->cfg.rms_norm_eps;
    void *h1 = b->h1, *q = b->q, *k = b->k, *v = b->v, *o = b->o, *xmid = b->xmid;
    /* k and v of the local tokens: straight into the full buffers without cp */
    void *kl = m->cp == 1 ? k : m->dkl, *vl = m->cp == 1 ? v : m->dvl;

    CK(loom_k_rmsnorm_fwd(m, b->x, loom_wc(m, s->ln1), Tn, H, eps, m->sp ? m->dtmp : h1, b->rstd1));
    if (m->sp) CK(sp_gather(m, m->dtmp, h1));
    void *qdst = m->cfg.qk_norm ? b->qpre : q;
    void *kdst = m->cfg.qk_norm ? b->kpre : kl;
    LIN(LOOM_LORA_Q, h1, Tc, H, loom_wc(m, s->wq), QD, qdst);
    LIN(LOOM_LORA_K, h1, Tc, H, loom_wc(m, s->wk), KD, kdst);
    LIN(LOOM_LORA_V, h1, Tc, H, loom_wc(m, s->wv), KD, vl);
    if (s->bq >= 0) CK(loom_k_bias_fwd(m, qdst, loom_wc(m, s->bq), Tc, QD));
    if (s->bk >= 0) CK(loom_k_bias_fwd(m, kdst, loom_wc(m, s->bk), Tc, KD));
    if (s->bv >= 0) CK(loom_k_bias_fwd(m, vl, loom_wc(m, s->bv), Tc, KD));
    if (m->cfg.qk_norm) {
        CK(loom_k_qknorm_rope_fwd(m, mb, qdst, loom_wc(m, s->qn), m->Hql, eps, q, b->rstdq));
        CK(loom_k_qknorm_rope_fwd(m, mb, kdst, loom_wc(m, s->kn), m->Hkvl, eps, kl, b->rstdk));
    } else {
        CK(loom_k_rope(m, false, q, Tc, m->Hql, mb->d_pos));
        CK(loom_k_rope(m, false, kl, Tc, m->Hkvl, mb->d_pos));
    }
    CK(cp_gather(m, kl, KD, k));
    CK(cp_gather(m, vl, KD, v));
    CK(loom_k_attn_fwd(m, q, my_qidx_d(m), Tc, k, v, T, m->Hql, m->Hkvl, mb->d_cu, mb->ndocs,
                       mb->even_len, o, b->lse));

    /* the projection straight into xmid unless SP scatters it there */
    void *part = m->sp ? m->dtmp : xmid, *h2 = m->sp ? m->dtmp : b->h2;
    LIN(LOOM_LORA_O, o, Tc, QD, loom_wc(m, s->wo), H, part);
    CK(tp_reduce(m, part, xmid));
    if (s->bo >= 0) {
        CK(loom_k_add(m, xmid, b->x, Tn * H));
        CK(loom_k_bias_fwd(m, xmid, loom_wc(m, s->bo), Tn, H));
        CK(loom_k_rmsnorm_fwd(m, xmid, loom_wc(m, s->ln2), Tn, H, eps, h2, b->rstd2));
    } else {
        CK(loom_k_add_rmsnorm_fwd(m, xmid, b->x, xmid, loom_wc(m, s->ln2), Tn, H, eps, h2, b->rstd2));
    }
    if (m->sp) CK(sp_gather(m, m->dtmp, b->h2));
    return LOOM_OK;
}

/* MLP up to the down projection's input: act = silu(h2 Wg^T) * h2 Wu^T. */
static loom_status mlp_front(loom_model *m, const lbuf *b, int64_t l) {
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, Il = m->Il, Tc = m->Tc;
    LIN(LOOM_LORA_GATE, b->h2, Tc, H, loom_wc(m, s->wg), Il, b->g);
    LIN(LOOM_LORA_UP, b->h2, Tc, H, loom_wc(m, s->wu), Il, b->u);
    if (s->bg >= 0) CK(loom_k_bias_fwd(m, b->g, loom_wc(m, s->bg), Tc, Il));
    if (s->bu >= 0) CK(loom_k_bias_fwd(m, b->u, loom_wc(m, s->bu), Tc, Il));
    return loom_k_swiglu_fwd(m, b->g, b->u, Tc * Il, b->act);
}

static loom_status layer_fwd(loom_model *m, loom_acts *a, int64_t i, int64_t l,
                             const loom_micro *mb) {
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, Il = m->Il, Tc = m->Tc, Tn = m->Tn;
    lbuf bb, *b = &bb;
    layer_bufs(m, a, i, b);
    CK(attn_fwd(m, b, l, mb));
    CK(mlp_front(m, b, l));
    void *part = m->sp ? m->dtmp : b->xn;
    LIN(LOOM_LORA_DOWN, b->act, Tc, Il, loom_wc(m, s->wd), H, part);
    CK(tp_reduce(m, part, b->xn));
    CK(loom_k_add(m, b->xn, b->xmid, Tn * H));
    if (s->bdn >= 0) CK(loom_k_bias_fwd(m, b->xn, loom_wc(m, s->bdn), Tn, H));
    return LOOM_OK;
}

/* Before layer i's backward: what recomputation left out, computed again
 * from the kept inputs with the same ops (so the same values). FULL: the
 * layer's forward but its output (the down projection itself is not needed;
 * LoRA's down stash is, and its output lands in scratch). */
static loom_status layer_recompute(loom_model *m, const lbuf *b, int64_t l, const loom_micro *mb) {
    if (m->recompute == LOOM_RECOMPUTE_NONE) return LOOM_OK;
    if (m->recompute == LOOM_RECOMPUTE_FULL) CK(attn_fwd(m, b, l, mb));
    CK(mlp_front(m, b, l));
    if (m->recompute == LOOM_RECOMPUTE_FULL)
        CK(loom_lora_fwd(m, b->la, b->li, l, LOOM_LORA_DOWN, b->act, m->Tc, m->dtmp, 0.0f, NULL,
                         NULL));
    return LOOM_OK;
}

#define DW(dy, x, T, out, in, dW) CK(loom_k_lin_dw(m, dy, x, T, out, in, 1.0f, dW))

/* m->dx holds d loss / d x[i+1] (Tn, H) on entry and d loss / d x[i] on return. */
static loom_status layer_bwd(loom_model *m, loom_acts *a, int64_t i, int64_t l,
                             const loom_micro *mb) {
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, Il = m->Il, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc, Tn = m->Tn;
    lbuf bb, *b = &bb;
    layer_bufs(m, a, i, b);
    CK(layer_recompute(m, b, l, mb));
    const void *x = b->x, *xmid = b->xmid, *h1 = b->h1, *h2 = b->h2;
    const void *q = b->q, *k = b->k, *v = b->v, *o = b->o;
    const void *g = b->g, *u = b->u, *act = b->act;
    void *dx = m->dx, *dtmp = m->dtmp, *dg = m->dg, *du = m->du;
    void *dfull = m->sp ? m->dfull : m->dx;
    void *dq = m->dq, *dk = m->dk, *dv = m->dv, *dout = m->dout;
    void *dkl = m->cp == 1 ? dk : m->dkl, *dvl = m->cp == 1 ? dv : m->dvl;

    /* MLP */
    if (s->bdn >= 0) CK(loom_k_bias_bwd(m, dx, Tn, H, loom_g(m, s->bdn)));
    if (m->sp) CK(sp_gather(m, dx, dfull));
    /* Each input gradient is LoRA's term and the base projections' as one
     * sum (loom_k_lin_dx_sum): at most one LoRA term and three projections */
    bool acc = false;
    loom_dx_term t[4];
    int nt = 0;
    LORA_T(LOOM_LORA_DOWN, act, Tc, dfull, dg, &acc, t, &nt);
    TERM(t, nt, dfull, H, loom_wc(m, s->wd));
    CK(loom_k_lin_dx_sum(m, Tc, Il, nt, t, acc ? 1.0f : 0.0f, dg));
    DW(dfull, act, Tc, H, Il, loom_g(m, s->wd));
    CK(loom_k_swiglu_bwd(m, dg, g, u, Tc * Il, dg, du));
    if (s->bg >= 0) CK(loom_k_bias_bwd(m, dg, Tc, Il, loom_g(m, s->bg)));
    if (s->bu >= 0) CK(loom_k_bias_bwd(m, du, Tc, Il, loom_g(m, s->bu)));
    acc = false;
    nt = 0;
    LORA_B(LOOM_LORA_GATE, h2, Tc, dg, dtmp, &acc);
    LORA_T(LOOM_LORA_UP, h2, Tc, du, dtmp, &acc, t, &nt);
    TERM(t, nt, dg, Il, loom_wc(m, s->wg));
    TERM(t, nt, du, Il, loom_wc(m, s->wu));
    CK(loom_k_lin_dx_sum(m, Tc, H, nt, t, acc ? 1.0f : 0.0f, dtmp));
    DW(dg, h2, Tc, Il, H, loom_g(m, s->wg));
    DW(du, h2, Tc, Il, H, loom_g(m, s->wu));
    void *red = m->sp ? m->dfull : dtmp; /* reduce-scatter needs distinct buffers */
    CK(tp_reduce(m, dtmp, red));
    CK(loom_k_rmsnorm_bwd_add(m, red, xmid, loom_wc(m, s->ln2), b->rstd2, Tn, H, dx,
                              loom_g(m, s->ln2)));

    /* attention */
    if (s->bo >= 0) CK(loom_k_bias_bwd(m, dx, Tn, H, loom_g(m, s->bo)));
    if (m->sp) CK(sp_gather(m, dx, dfull));
    acc = false;
    nt = 0;
    LORA_T(LOOM_LORA_O, o, Tc, dfull, dout, &acc, t, &nt);
    TERM(t, nt, dfull, H, loom_wc(m, s->wo));
    CK(loom_k_lin_dx_sum(m, Tc, QD, nt, t, acc ? 1.0f : 0.0f, dout));
    DW(dfull, o, Tc, H, QD, loom_g(m, s->wo));
    CK(loom_k_attn_bwd(m, dout, q, my_qidx_d(m), Tc, k, v, o, b->lse, T, m->Hql, m->Hkvl, mb->d_cu,
                       mb->ndocs, mb->even_len, dq, dk, dv));
    CK(cp_reduce(m, dk, KD, dkl));
    CK(cp_reduce(m, dv, KD, dvl));
    if (m->cfg.qk_norm) {
        CK(loom_k_qknorm_rope_bwd(m, mb, dq, b->qpre, loom_wc(m, s->qn), b->rstdq, m->Hql,
                                  loom_g(m, s->qn)));
        CK(loom_k_qknorm_rope_bwd(m, mb, dkl, b->kpre, loom_wc(m, s->kn), b->rstdk, m->Hkvl,
                                  loom_g(m, s->kn)));
    } else {
        CK(loom_k_rope(m, true, dq, Tc, m->Hql, mb->d_pos));
        CK(loom_k_rope(m, true, dkl, Tc, m->Hkvl, mb->d_pos));
    }
    if (s->bq >= 0) CK(loom_k_bias_bwd(m, dq, Tc, QD, loom_g(m, s->bq)));
    if (s->bk >= 0) CK(loom_k_bias_bwd(m, dkl, Tc, KD, loom_g(m, s->bk)));
    if (s->bv >= 0) CK(loom_k_bias_bwd(m, dvl, Tc, KD, loom_g(m, s->bv)));
    /* The first layer's input gradient feeds only the embedding's and this
     * norm's gradients: with both frozen (LoRA) it is not formed, and the
     * weight gradients below are all the rest of the backward. */
    const bool want_dx = l > 0 || loom_g(m, m->embed) || loom_g(m, s->ln1);
    void *dxa = want_dx ? dtmp : NULL;
    acc = false;
    nt = 0;
    LORA_B(LOOM_LORA_Q, h1, Tc, dq, dxa, &acc);
    LORA_B(LOOM_LORA_K, h1, Tc, dkl, dxa, &acc);
    LORA_T(LOOM_LORA_V, h1, Tc, dvl, dxa, &acc, t, &nt);
    if (want_dx) {
        TERM(t, nt, dq, QD, loom_wc(m, s->wq));
        TERM(t, nt, dkl, KD, loom_wc(m, s->wk));
        TERM(t, nt, dvl, KD, loom_wc(m, s->wv));
        CK(loom_k_lin_dx_sum(m, Tc, H, nt, t, acc ? 1.0f : 0.0f, dtmp));
    }
    DW(dq, h1, Tc, QD, H, loom_g(m, s->wq));
    DW(dkl, h1, Tc, KD, H, loom_g(m, s->wk));
    DW(dvl, h1, Tc, KD, H, loom_g(m, s->wv));
    if (!want_dx) return LOOM_OK;
    CK(tp_reduce(m, dtmp, red));
    return loom_k_rmsnorm_bwd_add(m, red, x, loom_wc(m, s->ln1), b->rstd1, Tn, H, dx,
                                  loom_g(m, s->ln1));
}

/* ---- embedding (vocab-parallel: rows outside this rank's block give zeros) ---- */

static loom_status embed_fwd(loom_model *m, const loom_micro *mb, void *x0) {
    const loom_slot *s = &m->base.slots[m->embed];
    CK(loom_k_embed_fwd(m, mb->d_ids, m->Tc, loom_wc(m, m->embed), s->row0, s->rows, m->dtmp));
    return tp_reduce(m, m->dtmp, x0);
}

static loom_status embed_bwd(loom_model *m, const loom_micro *mb) {
    const loom_slot *s = &m->base.slots[m->embed];
    float *dW = loom_g(m, m->embed);
    void *dfull = m->sp ? m->dfull : m->dx;
    if (!dW) return LOOM_OK; /* frozen */
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
    if (ch->first) CK(embed_fwd(m, mb, a->x));
    for (int64_t i = 0; i < ch->nl; i++) CK(layer_fwd(m, a, i, ch->l0 + i, mb));
    if (ch->last)
        CK(head_fwd_bwd(m, a, mb, backward, token_logprob, entropy, logits, loss_sum, n_tokens));
    return LOOM_OK;
}

loom_status loom_chunk_backward(loom_model *m, int c, loom_acts *a, const loom_micro *mb) {
    const loom_chunk *ch = &m->chunks[c];
    m->cur_mb = mb;
    if (ch->last) CK(loom_k_copy(m, m->dx, a->dstash, (size_t)(m->Tn * m->H) * m->dev.esz));
    for (int64_t i = ch->nl - 1; i >= 0; i--) CK(layer_bwd(m, a, i, ch->l0 + i, mb));
    CK(loom_k_dw_flush(m)); /* the layer norms' weight gradients, batched */
    if (ch->first) CK(embed_bwd(m, mb));
    return LOOM_OK;
}
