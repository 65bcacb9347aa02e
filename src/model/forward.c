/* Forward and backward of one micro-batch through a dense decoder (Qwen3,
 * Qwen2, Llama) on the CPU ops, fp32. The shape of one layer:
 *
 *   h1 = rmsnorm(x)                     q = h1 Wq^T (+bq), k, v likewise
 *   q, k = qk_norm (qwen3), rope(pos)   o = attention(q, k, v; cu_seqlens)
 *   xmid = x + o Wo^T (+bo)             h2 = rmsnorm(xmid)
 *   x' = xmid + (silu(h2 Wg^T) * (h2 Wu^T)) Wd^T
 *
 * then hf = rmsnorm(x_L), logits = hf Whead^T in row chunks, cross-entropy.
 * HF weights are (out, in): y = x W^T. The backward walks the same steps in
 * reverse; parameter gradients accumulate (+=) into m->g. */
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
/* dW (out, in) += dy^T x */
static void lin_dw(const float *dy, const float *x, int64_t T, int64_t out, int64_t in, float *dW) {
    loom_cpu_sgemm(true, false, out, in, T, 1.0f, dy, out, x, in, 1.0f, dW, in);
}

#define AT(buf, l, per) ((buf) + (size_t)(l) * (size_t)(per))

static void layer_fwd(loom_model *m, int64_t l, int64_t T, const int32_t *pos, const int32_t *cu,
                      int64_t ndocs) {
    loom_acts *a = &m->a;
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, I = m->I, QD = m->Hq * m->D, KD = m->Hkv * m->D;
    const float eps = (float)m->cfg.rms_norm_eps;
    const float *x = AT(a->x, l, T * H);
    float *xn = AT(a->x, l + 1, T * H);
    float *h1 = AT(a->h1, l, T * H), *h2 = AT(a->h2, l, T * H), *xmid = AT(a->xmid, l, T * H);
    float *q = AT(a->q, l, T * QD), *k = AT(a->k, l, T * KD), *v = AT(a->v, l, T * KD);
    float *o = AT(a->o, l, T * QD);

    loom_cpu_rmsnorm_fwd(x, loom_w(m, s->ln1), T, H, eps, h1, AT(a->rstd1, l, T));
    float *qdst = m->cfg.qk_norm ? AT(a->qpre, l, T * QD) : q;
    float *kdst = m->cfg.qk_norm ? AT(a->kpre, l, T * KD) : k;
    lin_fwd(h1, T, H, loom_w(m, s->wq), QD, 0.0f, qdst);
    lin_fwd(h1, T, H, loom_w(m, s->wk), KD, 0.0f, kdst);
    lin_fwd(h1, T, H, loom_w(m, s->wv), KD, 0.0f, v);
    if (s->bq >= 0) loom_cpu_add_bias_fwd(qdst, loom_w(m, s->bq), T, QD);
    if (s->bk >= 0) loom_cpu_add_bias_fwd(kdst, loom_w(m, s->bk), T, KD);
    if (s->bv >= 0) loom_cpu_add_bias_fwd(v, loom_w(m, s->bv), T, KD);
    if (m->cfg.qk_norm) {
        loom_cpu_rmsnorm_fwd(qdst, loom_w(m, s->qn), T * m->Hq, m->D, eps, q,
                             AT(a->rstdq, l, T * m->Hq));
        loom_cpu_rmsnorm_fwd(kdst, loom_w(m, s->kn), T * m->Hkv, m->D, eps, k,
                             AT(a->rstdk, l, T * m->Hkv));
    }
    loom_cpu_rope_fwd(q, T, m->Hq, m->D, pos, m->inv_freq);
    loom_cpu_rope_fwd(k, T, m->Hkv, m->D, pos, m->inv_freq);
    loom_cpu_attention_fwd(q, k, v, T, m->Hq, m->Hkv, m->D, cu, ndocs, m->attn_scale, o,
                           AT(a->lse, l, T * m->Hq));

    memcpy(xmid, x, (size_t)(T * H) * sizeof *x);
    lin_fwd(o, T, QD, loom_w(m, s->wo), H, 1.0f, xmid);
    if (s->bo >= 0) loom_cpu_add_bias_fwd(xmid, loom_w(m, s->bo), T, H);

    float *g = AT(a->gate, l, T * I), *u = AT(a->up, l, T * I), *act = AT(a->act, l, T * I);
    loom_cpu_rmsnorm_fwd(xmid, loom_w(m, s->ln2), T, H, eps, h2, AT(a->rstd2, l, T));
    lin_fwd(h2, T, H, loom_w(m, s->wg), I, 0.0f, g);
    lin_fwd(h2, T, H, loom_w(m, s->wu), I, 0.0f, u);
    if (s->bg >= 0) loom_cpu_add_bias_fwd(g, loom_w(m, s->bg), T, I);
    if (s->bu >= 0) loom_cpu_add_bias_fwd(u, loom_w(m, s->bu), T, I);
    loom_cpu_swiglu_fwd(g, u, T * I, act);
    memcpy(xn, xmid, (size_t)(T * H) * sizeof *x);
    lin_fwd(act, T, I, loom_w(m, s->wd), H, 1.0f, xn);
    if (s->bdn >= 0) loom_cpu_add_bias_fwd(xn, loom_w(m, s->bdn), T, H);
}

/* a->dx holds d loss / d x_{l+1} on entry and d loss / d x_l on return. */
static void layer_bwd(loom_model *m, int64_t l, int64_t T, const int32_t *pos, const int32_t *cu,
                      int64_t ndocs) {
    loom_acts *a = &m->a;
    const loom_layer_slots *s = &m->layer[l];
    const int64_t H = m->H, I = m->I, QD = m->Hq * m->D, KD = m->Hkv * m->D;
    const float *x = AT(a->x, l, T * H);
    const float *h1 = AT(a->h1, l, T * H), *h2 = AT(a->h2, l, T * H);
    const float *xmid = AT(a->xmid, l, T * H);
    const float *q = AT(a->q, l, T * QD), *k = AT(a->k, l, T * KD), *v = AT(a->v, l, T * KD);
    const float *o = AT(a->o, l, T * QD);
    const float *g = AT(a->gate, l, T * I), *u = AT(a->up, l, T * I);
    const float *act = AT(a->act, l, T * I);
    float *dx = a->dx, *dtmp = a->dtmp, *dg = a->dg, *du = a->du;
    float *dq = a->dq, *dk = a->dk, *dv = a->dv, *dout = a->dout;

    /* MLP */
    if (s->bdn >= 0) loom_cpu_add_bias_bwd(dx, T, H, loom_g(m, s->bdn));
    lin_dx(dx, T, H, loom_w(m, s->wd), I, 0.0f, dg);
    lin_dw(dx, act, T, H, I, loom_g(m, s->wd));
    loom_cpu_swiglu_bwd(dg, g, u, T * I, dg, du);
    if (s->bg >= 0) loom_cpu_add_bias_bwd(dg, T, I, loom_g(m, s->bg));
    if (s->bu >= 0) loom_cpu_add_bias_bwd(du, T, I, loom_g(m, s->bu));
    lin_dx(dg, T, I, loom_w(m, s->wg), H, 0.0f, dtmp);
    lin_dx(du, T, I, loom_w(m, s->wu), H, 1.0f, dtmp);
    lin_dw(dg, h2, T, I, H, loom_g(m, s->wg));
    lin_dw(du, h2, T, I, H, loom_g(m, s->wu));
    loom_cpu_rmsnorm_bwd(dtmp, xmid, loom_w(m, s->ln2), AT(a->rstd2, l, T), T, H, dtmp,
                         loom_g(m, s->ln2));
    loom_cpu_residual_add(dx, dtmp, T * H);

    /* attention */
    if (s->bo >= 0) loom_cpu_add_bias_bwd(dx, T, H, loom_g(m, s->bo));
    lin_dx(dx, T, H, loom_w(m, s->wo), QD, 0.0f, dout);
    lin_dw(dx, o, T, H, QD, loom_g(m, s->wo));
    loom_cpu_attention_bwd(dout, q, k, v, o, AT(a->lse, l, T * m->Hq), T, m->Hq, m->Hkv, m->D, cu,
                           ndocs, m->attn_scale, dq, dk, dv);
    loom_cpu_rope_bwd(dq, T, m->Hq, m->D, pos, m->inv_freq);
    loom_cpu_rope_bwd(dk, T, m->Hkv, m->D, pos, m->inv_freq);
    if (m->cfg.qk_norm) {
        loom_cpu_rmsnorm_bwd(dq, AT(a->qpre, l, T * QD), loom_w(m, s->qn),
                             AT(a->rstdq, l, T * m->Hq), T * m->Hq, m->D, dq, loom_g(m, s->qn));
        loom_cpu_rmsnorm_bwd(dk, AT(a->kpre, l, T * KD), loom_w(m, s->kn),
                             AT(a->rstdk, l, T * m->Hkv), T * m->Hkv, m->D, dk, loom_g(m, s->kn));
    }
    if (s->bq >= 0) loom_cpu_add_bias_bwd(dq, T, QD, loom_g(m, s->bq));
    if (s->bk >= 0) loom_cpu_add_bias_bwd(dk, T, KD, loom_g(m, s->bk));
    if (s->bv >= 0) loom_cpu_add_bias_bwd(dv, T, KD, loom_g(m, s->bv));
    lin_dx(dq, T, QD, loom_w(m, s->wq), H, 0.0f, dtmp);
    lin_dx(dk, T, KD, loom_w(m, s->wk), H, 1.0f, dtmp);
    lin_dx(dv, T, KD, loom_w(m, s->wv), H, 1.0f, dtmp);
    lin_dw(dq, h1, T, QD, H, loom_g(m, s->wq));
    lin_dw(dk, h1, T, KD, H, loom_g(m, s->wk));
    lin_dw(dv, h1, T, KD, H, loom_g(m, s->wv));
    loom_cpu_rmsnorm_bwd(dtmp, x, loom_w(m, s->ln1), AT(a->rstd1, l, T), T, H, dtmp,
                         loom_g(m, s->ln1));
    loom_cpu_residual_add(dx, dtmp, T * H);
}

loom_status loom_model_run_micro(loom_model *m, const int32_t *ids, const int32_t *targets,
                                 const int32_t *pos, const int32_t *cu, int64_t ndocs, int64_t T,
                                 bool backward, float *token_logprob, float *entropy,
                                 float *logits, double *loss_sum, int64_t *n_tokens) {
    loom_acts *a = &m->a;
    LOOM_ASSERT(T <= a->cap);
    const int64_t H = m->H, V = m->V, Vp = m->Vp;
    const float *Wh = loom_w(m, m->head);

    loom_cpu_embedding_fwd(ids, T, loom_w(m, m->embed), H, a->x);
    for (int64_t l = 0; l < m->L; l++) layer_fwd(m, l, T, pos, cu, ndocs);
    const float *xL = AT(a->x, m->L, T * H);
    loom_cpu_rmsnorm_fwd(xL, loom_w(m, m->final_norm), T, H, (float)m->cfg.rms_norm_eps, a->hf,
                         a->rstdf);

    /* Output layer and loss, a chunk of rows at a time: the logits of the
     * whole micro-batch never exist at once. */
    double sum = 0.0;
    int64_t count = 0;
    for (int64_t r0 = 0; r0 < T; r0 += a->chunk) {
        int64_t c = T - r0 < a->chunk ? T - r0 : a->chunk;
        const float *hf = a->hf + r0 * H;
        lin_fwd(hf, c, H, Wh, Vp, 0.0f, a->logits);
        if (logits)
            for (int64_t r = 0; r < c; r++)
                memcpy(logits + (r0 + r) * V, a->logits + r * Vp, (size_t)V * sizeof(float));
        sum += loom_cpu_cross_entropy_fwd(a->logits, targets + r0, c, V, Vp,
                                          token_logprob ? token_logprob + r0 : NULL,
                                          entropy ? entropy + r0 : NULL, a->celse);
        for (int64_t r = 0; r < c; r++) count += targets[r0 + r] != -100;
        if (backward) {
            loom_cpu_cross_entropy_bwd(a->logits, a->celse, targets + r0, c, V, Vp, 1.0f,
                                       a->logits);
            lin_dx(a->logits, c, Vp, Wh, H, 0.0f, a->dx + r0 * H);
            lin_dw(a->logits, hf, c, Vp, H, loom_g(m, m->head));
        }
    }
    *loss_sum = sum;
    *n_tokens = count;
    if (!backward) return LOOM_OK;
    if (!isfinite(sum))
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG, "loss is %s", isnan(sum) ? "nan" : "inf");

    loom_cpu_rmsnorm_bwd(a->dx, xL, loom_w(m, m->final_norm), a->rstdf, T, H, a->dx,
                         loom_g(m, m->final_norm));
    for (int64_t l = m->L - 1; l >= 0; l--) layer_bwd(m, l, T, pos, cu, ndocs);
    loom_cpu_embedding_bwd(ids, T, a->dx, H, loom_g(m, m->embed));
    return LOOM_OK;
}
