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

#include "../backend/cpu/cpu_ops.h"
#include "model.h"

/* y (T, out) = x (T, in) W^T + beta y */
static void lin_fwd(const float *x, int64_t T, int64_t in, const float *W, int64_t out, float beta,
                    float *y) {
    loom_cpu_sgemm(false, true, T, out, in, 1.0f, x, in, W, in, beta, y, out);
}
/* dx (T, in) = dy (T, out) W + beta dx */
static void lin_dx(const float *dy, int64_t T, int64_t out, const float *W, int64_t in, float beta,
                   float *dx) {
    loom_cpu_sgemm(false, false, T, in, out, 1.0f, dy, out, W, in, beta, dx, in);
}
/* dW (out, in) += dy^T x; nothing for a frozen weight (dW NULL) */
static void lin_dw(const float *dy, const float *x, int64_t T, int64_t out, int64_t in, float *dW) {
    if (!dW) return;
    loom_cpu_sgemm(true, false, out, in, T, 1.0f, dy, out, x, in, 1.0f, dW, in);
}

#define AT(buf, i, per) ((buf) + (size_t)(i) * (size_t)(per))
#define CK(expr)                                                                          \
    do {                                                                                  \
        loom_status st_ = (expr);                                                         \
        if (st_) return st_;                                                              \
    } while (0)

/* ---- tensor-parallel collectives on (tokens, H) activations ---- */

/* Sequence-parallel gather: src (Tn, H) -> dst (Tc, H); without SP a copy
 * (or nothing when dst == src). */
static loom_status sp_gather(loom_model *m, const float *src, float *dst) {
    size_t n = (size_t)(m->Tn * m->H);
    if (m->sp) return loom_comm_allgather(m->mesh->tp, src, dst, n, LOOM_F32);
    if (dst != src) memcpy(dst, src, n * sizeof *dst);
    return LOOM_OK;
}

/* Sum of the tp ranks' partial results: src (Tc, H), modified -> dst (Tn, H):
 * reduce-scatter under SP, else all-reduce. */
static loom_status tp_reduce(loom_model *m, float *src, float *dst) {
    size_t n = (size_t)(m->Tn * m->H);
    if (m->sp) return loom_comm_reduce_scatter(m->mesh->tp, src, dst, n, LOOM_F32, LOOM_RED_SUM);
    if (m->tp > 1) CK(loom_comm_allreduce(m->mesh->tp, src, n, LOOM_F32, LOOM_RED_SUM));
    if (dst != src) memcpy(dst, src, n * sizeof *dst);
    return LOOM_OK;
}

/* ---- context parallel: keys and values of the whole micro-batch ---- */

/* loc (Tc, w) of every cp rank -> full (T, w) in token order. */
static loom_status cp_gather(loom_model *m, const float *loc, int64_t w, float *full) {
    if (m->cp == 1) {
        if (full != loc) memcpy(full, loc, (size_t)(m->Tc * w) * sizeof *full);
        return LOOM_OK;
    }
    CK(loom_comm_allgather(m->mesh->cp, loc, m->kvblk, (size_t)(m->Tc * w), LOOM_F32));
    for (int64_t j = 0; j < m->T; j++)
        memcpy(full + (int64_t)m->perm[j] * w, m->kvblk + j * w, (size_t)w * sizeof *full);
    return LOOM_OK;
}

/* full (T, w) gradients from this rank's queries -> loc (Tc, w) summed over cp. */
static loom_status cp_reduce(loom_model *m, const float *full, int64_t w, float *loc) {
    if (m->cp == 1) {
        if (loc != full) memcpy(loc, full, (size_t)(m->Tc * w) * sizeof *loc);
        return LOOM_OK;
    }
    for (int64_t j = 0; j < m->T; j++)
        memcpy(m->kvblk + j * w, full + (int64_t)m->perm[j] * w, (size_t)w * sizeof *loc);
    return loom_comm_reduce_scatter(m->mesh->cp, m->kvblk, loc, (size_t)(m->Tc * w), LOOM_F32,
                                    LOOM_RED_SUM);
}

/* Global token index (within the micro-batch) of this rank's local tokens. */
static const int32_t *my_qidx(const loom_model *m) {
    return m->cp == 1 ? NULL : m->perm + (int64_t)m->mesh->cp_rank * m->Tc;
}

/* ---- one layer ---- */

static loom_status layer_fwd(loom_model *m, loom_acts *a, int64_t i, int64_t l,
                             const loom_micro *mb) {
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, Il = m->Il, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc, Tn = m->Tn;
    const float eps = (float)m->cfg.rms_norm_eps;
    const float *x = AT(a->x, i, Tn * H);
    float *xn = AT(a->x, i + 1, Tn * H), *xmid = AT(a->xmid, i, Tn * H);
    float *h1 = AT(a->h1, i, Tc * H), *h2 = AT(a->h2, i, Tc * H);
    float *q = AT(a->q, i, Tc * QD), *k = AT(a->k, i, T * KD), *v = AT(a->v, i, T * KD);
    float *o = AT(a->o, i, Tc * QD);
    /* k and v of the local tokens: straight into the full buffers without cp */
    float *kl = m->cp == 1 ? k : m->dkl, *vl = m->cp == 1 ? v : m->dvl;

    loom_cpu_rmsnorm_fwd(x, loom_w(m, s->ln1), Tn, H, eps, m->sp ? m->dtmp : h1,
                         AT(a->rstd1, i, Tn));
    if (m->sp) CK(sp_gather(m, m->dtmp, h1));
    float *qdst = m->cfg.qk_norm ? AT(a->qpre, i, Tc * QD) : q;
    float *kdst = m->cfg.qk_norm ? AT(a->kpre, i, Tc * KD) : kl;
    lin_fwd(h1, Tc, H, loom_w(m, s->wq), QD, 0.0f, qdst);
    lin_fwd(h1, Tc, H, loom_w(m, s->wk), KD, 0.0f, kdst);
    lin_fwd(h1, Tc, H, loom_w(m, s->wv), KD, 0.0f, vl);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_Q, h1, Tc, qdst);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_K, h1, Tc, kdst);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_V, h1, Tc, vl);
    if (s->bq >= 0) loom_cpu_add_bias_fwd(qdst, loom_w(m, s->bq), Tc, QD);
    if (s->bk >= 0) loom_cpu_add_bias_fwd(kdst, loom_w(m, s->bk), Tc, KD);
    if (s->bv >= 0) loom_cpu_add_bias_fwd(vl, loom_w(m, s->bv), Tc, KD);
    if (m->cfg.qk_norm) {
        loom_cpu_rmsnorm_fwd(qdst, loom_w(m, s->qn), Tc * m->Hql, m->D, eps, q,
                             AT(a->rstdq, i, Tc * m->Hql));
        loom_cpu_rmsnorm_fwd(kdst, loom_w(m, s->kn), Tc * m->Hkvl, m->D, eps, kl,
                             AT(a->rstdk, i, Tc * m->Hkvl));
    }
    loom_cpu_rope_fwd(q, Tc, m->Hql, m->D, mb->pos, m->inv_freq);
    loom_cpu_rope_fwd(kl, Tc, m->Hkvl, m->D, mb->pos, m->inv_freq);
    CK(cp_gather(m, kl, KD, k));
    CK(cp_gather(m, vl, KD, v));
    loom_cpu_attention_fwd_q(q, my_qidx(m), Tc, k, v, T, m->Hql, m->Hkvl, m->D, mb->cu, mb->ndocs,
                             m->attn_scale, o, AT(a->lse, i, Tc * m->Hql));

    lin_fwd(o, Tc, QD, loom_w(m, s->wo), H, 0.0f, m->dtmp);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_O, o, Tc, m->dtmp);
    CK(tp_reduce(m, m->dtmp, xmid));
    loom_cpu_residual_add(xmid, x, Tn * H);
    if (s->bo >= 0) loom_cpu_add_bias_fwd(xmid, loom_w(m, s->bo), Tn, H);

    float *g = AT(a->gate, i, Tc * Il), *u = AT(a->up, i, Tc * Il), *act = AT(a->act, i, Tc * Il);
    loom_cpu_rmsnorm_fwd(xmid, loom_w(m, s->ln2), Tn, H, eps, m->sp ? m->dtmp : h2,
                         AT(a->rstd2, i, Tn));
    if (m->sp) CK(sp_gather(m, m->dtmp, h2));
    lin_fwd(h2, Tc, H, loom_w(m, s->wg), Il, 0.0f, g);
    lin_fwd(h2, Tc, H, loom_w(m, s->wu), Il, 0.0f, u);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_GATE, h2, Tc, g);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_UP, h2, Tc, u);
    if (s->bg >= 0) loom_cpu_add_bias_fwd(g, loom_w(m, s->bg), Tc, Il);
    if (s->bu >= 0) loom_cpu_add_bias_fwd(u, loom_w(m, s->bu), Tc, Il);
    loom_cpu_swiglu_fwd(g, u, Tc * Il, act);
    lin_fwd(act, Tc, Il, loom_w(m, s->wd), H, 0.0f, m->dtmp);
    loom_lora_fwd(m, a, i, l, LOOM_LORA_DOWN, act, Tc, m->dtmp);
    CK(tp_reduce(m, m->dtmp, xn));
    loom_cpu_residual_add(xn, xmid, Tn * H);
    if (s->bdn >= 0) loom_cpu_add_bias_fwd(xn, loom_w(m, s->bdn), Tn, H);
    return LOOM_OK;
}

/* m->dx holds d loss / d x[i+1] (Tn, H) on entry and d loss / d x[i] on return. */
static loom_status layer_bwd(loom_model *m, loom_acts *a, int64_t i, int64_t l,
                             const loom_micro *mb) {
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, Il = m->Il, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    const int64_t T = m->T, Tc = m->Tc, Tn = m->Tn;
    const float *x = AT(a->x, i, Tn * H), *xmid = AT(a->xmid, i, Tn * H);
    const float *h1 = AT(a->h1, i, Tc * H), *h2 = AT(a->h2, i, Tc * H);
    const float *q = AT(a->q, i, Tc * QD), *k = AT(a->k, i, T * KD), *v = AT(a->v, i, T * KD);
    const float *o = AT(a->o, i, Tc * QD);
    const float *g = AT(a->gate, i, Tc * Il), *u = AT(a->up, i, Tc * Il);
    const float *act = AT(a->act, i, Tc * Il);
    float *dx = m->dx, *dtmp = m->dtmp, *dg = m->dg, *du = m->du;
    float *dfull = m->sp ? m->dfull : m->dx;
    float *dq = m->dq, *dk = m->dk, *dv = m->dv, *dout = m->dout;
    float *dkl = m->cp == 1 ? dk : m->dkl, *dvl = m->cp == 1 ? dv : m->dvl;

    /* MLP */
    if (s->bdn >= 0) loom_cpu_add_bias_bwd(dx, Tn, H, loom_g(m, s->bdn));
    if (m->sp) CK(sp_gather(m, dx, dfull));
    lin_dx(dfull, Tc, H, loom_w(m, s->wd), Il, 0.0f, dg);
    lin_dw(dfull, act, Tc, H, Il, loom_g(m, s->wd));
    loom_lora_bwd(m, a, i, l, LOOM_LORA_DOWN, act, Tc, dfull, dg);
    loom_cpu_swiglu_bwd(dg, g, u, Tc * Il, dg, du);
    if (s->bg >= 0) loom_cpu_add_bias_bwd(dg, Tc, Il, loom_g(m, s->bg));
    if (s->bu >= 0) loom_cpu_add_bias_bwd(du, Tc, Il, loom_g(m, s->bu));
    lin_dx(dg, Tc, Il, loom_w(m, s->wg), H, 0.0f, dtmp);
    lin_dx(du, Tc, Il, loom_w(m, s->wu), H, 1.0f, dtmp);
    lin_dw(dg, h2, Tc, Il, H, loom_g(m, s->wg));
    lin_dw(du, h2, Tc, Il, H, loom_g(m, s->wu));
    loom_lora_bwd(m, a, i, l, LOOM_LORA_GATE, h2, Tc, dg, dtmp);
    loom_lora_bwd(m, a, i, l, LOOM_LORA_UP, h2, Tc, du, dtmp);
    float *red = m->sp ? m->dfull : dtmp; /* reduce-scatter needs distinct buffers */
    CK(tp_reduce(m, dtmp, red));
    loom_cpu_rmsnorm_bwd(red, xmid, loom_w(m, s->ln2), AT(a->rstd2, i, Tn), Tn, H, red,
                         loom_g(m, s->ln2));
    loom_cpu_residual_add(dx, red, Tn * H);

    /* attention */
    if (s->bo >= 0) loom_cpu_add_bias_bwd(dx, Tn, H, loom_g(m, s->bo));
    if (m->sp) CK(sp_gather(m, dx, dfull));
    lin_dx(dfull, Tc, H, loom_w(m, s->wo), QD, 0.0f, dout);
    lin_dw(dfull, o, Tc, H, QD, loom_g(m, s->wo));
    loom_lora_bwd(m, a, i, l, LOOM_LORA_O, o, Tc, dfull, dout);
    loom_cpu_attention_bwd_q(dout, q, my_qidx(m), Tc, k, v, o, AT(a->lse, i, Tc * m->Hql), T,
                             m->Hql, m->Hkvl, m->D, mb->cu, mb->ndocs, m->attn_scale, dq, dk, dv);
    CK(cp_reduce(m, dk, KD, dkl));
    CK(cp_reduce(m, dv, KD, dvl));
    loom_cpu_rope_bwd(dq, Tc, m->Hql, m->D, mb->pos, m->inv_freq);
    loom_cpu_rope_bwd(dkl, Tc, m->Hkvl, m->D, mb->pos, m->inv_freq);
    if (m->cfg.qk_norm) {
        loom_cpu_rmsnorm_bwd(dq, AT(a->qpre, i, Tc * QD), loom_w(m, s->qn),
                             AT(a->rstdq, i, Tc * m->Hql), Tc * m->Hql, m->D, dq,
                             loom_g(m, s->qn));
        loom_cpu_rmsnorm_bwd(dkl, AT(a->kpre, i, Tc * KD), loom_w(m, s->kn),
                             AT(a->rstdk, i, Tc * m->Hkvl), Tc * m->Hkvl, m->D, dkl,
                             loom_g(m, s->kn));
    }
    if (s->bq >= 0) loom_cpu_add_bias_bwd(dq, Tc, QD, loom_g(m, s->bq));
    if (s->bk >= 0) loom_cpu_add_bias_bwd(dkl, Tc, KD, loom_g(m, s->bk));
    if (s->bv >= 0) loom_cpu_add_bias_bwd(dvl, Tc, KD, loom_g(m, s->bv));
    lin_dx(dq, Tc, QD, loom_w(m, s->wq), H, 0.0f, dtmp);
    lin_dx(dkl, Tc, KD, loom_w(m, s->wk), H, 1.0f, dtmp);
    lin_dx(dvl, Tc, KD, loom_w(m, s->wv), H, 1.0f, dtmp);
    lin_dw(dq, h1, Tc, QD, H, loom_g(m, s->wq));
    lin_dw(dkl, h1, Tc, KD, H, loom_g(m, s->wk));
    lin_dw(dvl, h1, Tc, KD, H, loom_g(m, s->wv));
    loom_lora_bwd(m, a, i, l, LOOM_LORA_Q, h1, Tc, dq, dtmp);
    loom_lora_bwd(m, a, i, l, LOOM_LORA_K, h1, Tc, dkl, dtmp);
    loom_lora_bwd(m, a, i, l, LOOM_LORA_V, h1, Tc, dvl, dtmp);
    CK(tp_reduce(m, dtmp, red));
    loom_cpu_rmsnorm_bwd(red, x, loom_w(m, s->ln1), AT(a->rstd1, i, Tn), Tn, H, red,
                         loom_g(m, s->ln1));
    loom_cpu_residual_add(dx, red, Tn * H);
    return LOOM_OK;
}

/* ---- embedding (vocab-parallel) ---- */

static loom_status embed_fwd(loom_model *m, const loom_micro *mb, float *x0) {
    const loom_slot *s = &m->base.slots[m->embed];
    const float *W = loom_w(m, m->embed);
    const int64_t H = m->H;
    for (int64_t t = 0; t < m->Tc; t++) {
        int64_t r = (int64_t)mb->ids[t] - s->row0;
        float *dst = m->dtmp + t * H;
        if (r >= 0 && r < s->rows)
            memcpy(dst, W + r * H, (size_t)H * sizeof *dst);
        else
            memset(dst, 0, (size_t)H * sizeof *dst);
    }
    return tp_reduce(m, m->dtmp, x0);
}

static loom_status embed_bwd(loom_model *m, const loom_micro *mb) {
    const loom_slot *s = &m->base.slots[m->embed];
    float *dW = loom_g(m, m->embed), *dfull = m->sp ? m->dfull : m->dx;
    const int64_t H = m->H;
    if (!dW) return LOOM_OK; /* frozen */
    if (m->sp) CK(sp_gather(m, m->dx, dfull));
    for (int64_t t = 0; t < m->Tc; t++) { /* token order: deterministic */
        int64_t r = (int64_t)mb->ids[t] - s->row0;
        if (r < 0 || r >= s->rows) continue;
        const float *d = dfull + t * H;
        float *w = dW + r * H;
        for (int64_t j = 0; j < H; j++) w[j] += d[j];
    }
    return LOOM_OK;
}

/* ---- output layer and loss (vocab-parallel) ---- */

/* Rows [r0, r0+c) of the local logits in m->logits: log-sum-exp over the
 * whole vocabulary from per-rank max, sum of exp, sum of p*z and the target
 * logit, all-reduced over tp. ce[r*4 + 0..3] = lse, sum exp(z - max),
 * sum exp(z - max) z, target logit. */
static loom_status vocab_ce(loom_model *m, const int32_t *tgt, int64_t c, double *lse) {
    const loom_slot *s = &m->base.slots[m->head];
    const int64_t Vl = m->Vl, v0 = s->row0;
    int64_t nvalid = m->V - v0; /* columns of this rank inside the real vocabulary */
    if (nvalid > Vl) nvalid = Vl;
    if (nvalid < 0) nvalid = 0;
    double *ce = m->ce;
    for (int64_t r = 0; r < c; r++) {
        const float *z = m->logits + r * Vl;
        double mx = -INFINITY;
        for (int64_t j = 0; j < nvalid; j++)
            if (z[j] > mx) mx = z[j];
        lse[r] = mx;
    }
    if (m->tp > 1) CK(loom_comm_allreduce(m->mesh->tp, lse, (size_t)c, LOOM_F64, LOOM_RED_MAX));
#pragma omp parallel for schedule(static) if (c * nvalid > 65536)
    for (int64_t r = 0; r < c; r++) {
        const float *z = m->logits + r * Vl;
        double se = 0, sez = 0, zt = 0, mx = lse[r];
        for (int64_t j = 0; j < nvalid; j++) {
            double e = exp((double)z[j] - mx);
            se += e;
            sez += e * z[j];
        }
        int64_t t = (int64_t)tgt[r] - v0;
        if (tgt[r] != -100 && t >= 0 && t < nvalid) zt = z[t];
        ce[r * 3 + 0] = se;
        ce[r * 3 + 1] = sez;
        ce[r * 3 + 2] = zt;
    }
    if (m->tp > 1)
        CK(loom_comm_allreduce(m->mesh->tp, ce, (size_t)(3 * c), LOOM_F64, LOOM_RED_SUM));
    return LOOM_OK;
}

static loom_status head_fwd_bwd(loom_model *m, loom_acts *a, const loom_micro *mb, bool backward,
                                float *token_logprob, float *entropy, float *logits,
                                double *loss_sum, int64_t *n_tokens) {
    const loom_slot *s = &m->base.slots[m->head];
    const int64_t H = m->H, Tn = m->Tn, Tc = m->Tc, Vl = m->Vl, v0 = s->row0;
    const float *xL = a->x + (size_t)m->chunks[m->vpp - 1].nl * (size_t)(Tn * H);
    const float *Wh = loom_w(m, m->head);
    float *hf = m->dfull; /* (Tc, H): the final norm's output, gathered under SP */
    loom_cpu_rmsnorm_fwd(xL, loom_w(m, m->final_norm), Tn, H, (float)m->cfg.rms_norm_eps, a->hf,
                         a->rstdf);
    CK(sp_gather(m, a->hf, hf));
    const int32_t *qidx = my_qidx(m);
    double sum = 0.0;
    int64_t count = 0;
    double *lse = m->ce + 3 * m->chunk_rows; /* (chunk_rows) after the 3 sums */
    for (int64_t r0 = 0; r0 < Tc; r0 += m->chunk_rows) {
        int64_t c = Tc - r0 < m->chunk_rows ? Tc - r0 : m->chunk_rows;
        lin_fwd(hf + r0 * H, c, H, Wh, Vl, 0.0f, m->logits);
        CK(vocab_ce(m, mb->tgt + r0, c, lse));
        for (int64_t r = 0; r < c; r++) {
            double L = lse[r] + log(m->ce[r * 3]); /* max + log sum exp */
            int64_t gt = mb->out0 + (qidx ? qidx[r0 + r] : r0 + r); /* global token */
            int32_t tg = mb->tgt[r0 + r];
            double lp = tg == -100 ? 0.0 : m->ce[r * 3 + 2] - L;
            if (tg != -100) {
                sum += -lp;
                count++;
            }
            if (m->mesh->tp_rank == 0) { /* the same on every tp rank: written once */
                if (token_logprob) token_logprob[gt] = (float)lp;
                if (entropy) entropy[gt] = (float)(L - m->ce[r * 3 + 1] / m->ce[r * 3]);
            }
            if (logits)
                for (int64_t j = 0; j < Vl && v0 + j < m->V; j++)
                    logits[gt * m->V + v0 + j] = m->logits[r * Vl + j];
            lse[r] = L;
        }
        if (!backward) continue;
        /* d(sum of token losses)/d logits = p - onehot(target), 0 on padding */
        int64_t nvalid = m->V - v0 < Vl ? m->V - v0 : Vl;
#pragma omp parallel for schedule(static) if (c * Vl > 65536)
        for (int64_t r = 0; r < c; r++) {
            float *z = m->logits + r * Vl;
            int32_t tg = mb->tgt[r0 + r];
            if (tg == -100) {
                memset(z, 0, (size_t)Vl * sizeof *z);
                continue;
            }
            for (int64_t j = 0; j < Vl; j++)
                z[j] = j < nvalid ? (float)exp((double)z[j] - lse[r]) : 0.0f;
            int64_t t = (int64_t)tg - v0;
            if (t >= 0 && t < nvalid) z[t] -= 1.0f;
        }
        lin_dx(m->logits, c, Vl, Wh, H, 0.0f, m->dtmp + r0 * H);
        lin_dw(m->logits, hf + r0 * H, c, Vl, H, loom_g(m, m->head));
    }
    *loss_sum = sum;
    *n_tokens = count;
    if (!backward) return LOOM_OK;
    CK(tp_reduce(m, m->dtmp, a->dstash));
    loom_cpu_rmsnorm_bwd(a->dstash, xL, loom_w(m, m->final_norm), a->rstdf, Tn, H, a->dstash,
                         loom_g(m, m->final_norm));
    return LOOM_OK;
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
    if (ch->last) memcpy(m->dx, a->dstash, (size_t)(m->Tn * m->H) * sizeof *m->dx);
    for (int64_t i = ch->nl - 1; i >= 0; i--) CK(layer_bwd(m, a, i, ch->l0 + i, mb));
    if (ch->first) CK(embed_bwd(m, mb));
    return LOOM_OK;
}
