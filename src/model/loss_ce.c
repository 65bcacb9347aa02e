/* The cross-entropy of the next token on vocabulary-parallel logits
 * (loss.h), each token's loss and gradient times its weight when the batch
 * has weights. Per row of the block: the maximum over the whole vocabulary
 * (all-reduced over tp) at m->ce + 3 Tc + r, and against it the sum of exp,
 * the sum of p*z and the target logit (all-reduced over tp) at m->ce + 3 r;
 * with grad the logits then become loss_scale * (p - onehot(target)) * w,
 * 0 on rows without a target. Without tp all of it is one pass over the
 * block (the weights one more, only when given). */
#include <math.h>

#include "loss.h"
#include "model.h"

/* The weights of the micro-batch's local tokens where the ops read them:
 * the host array on a CPU, else a device copy (made at the first block;
 * sized for the buffers' Tc, freed with them). */
static loom_status weights_on_device(loom_model *m, const loom_micro *mb, const float **out) {
    *out = mb->wt;
    if (!m->dev.cuda) return LOOM_OK;
    if (!m->d_wt) CK(loom_dev_alloc(m, (void **)&m->d_wt, (size_t)m->Tc * sizeof(float),
                                    "loss weights"));
    *out = m->d_wt;
    return loom_k_upload(m, m->d_wt, mb->wt, (size_t)m->Tc * sizeof(float));
}

static loom_status ce_block(loom_model *m, const loom_micro *mb, const loom_loss_block *b,
                            bool grad) {
    const int64_t r0 = b->r0, c = b->c, Vl = b->Vl;
    const int32_t *tgt = mb->d_tgt + r0;
    double *ce = m->ce + 3 * r0, *mx = m->ce + 3 * m->Tc + r0;
    const float scale = (float)m->loss_scale;
    if (m->tp == 1) {
        CK(loom_k_ce_fused(m, b->z, c, Vl, b->nvalid, tgt, b->v0, mx, ce, scale, grad));
    } else {
        CK(loom_k_ce_max(m, b->z, c, Vl, b->nvalid, mx));
        CK(loom_comm_allreduce(m->mesh->tp, mx, (size_t)c, LOOM_F64, LOOM_RED_MAX));
        CK(loom_k_ce_sums(m, b->z, c, Vl, b->nvalid, tgt, b->v0, mx, ce));
        CK(loom_comm_allreduce(m->mesh->tp, ce, (size_t)(3 * c), LOOM_F64, LOOM_RED_SUM));
        if (grad) CK(loom_k_ce_grad(m, b->z, c, Vl, b->nvalid, tgt, b->v0, mx, ce, scale));
    }
    if (!grad || !mb->wt) return LOOM_OK;
    const float *w = mb->wt;
    if (r0 == 0) CK(weights_on_device(m, mb, &w));
    else if (m->dev.cuda) w = m->d_wt;
    return loom_k_rows_scale(m, b->z, c, Vl, w + r0);
}

static loom_status ce_finish(loom_model *m, const loom_micro *mb, float *token_logprob,
                             float *entropy, double *loss_sum, int64_t *n_tokens) {
    const int64_t Tc = m->Tc;
    /* the per-token sums of all blocks, copied to the host once */
    CK(loom_k_download(m, m->ce_h, m->ce, (size_t)(4 * Tc) * sizeof(double)));
    const double *ce = m->ce_h, *mx = m->ce_h + 3 * Tc;
    const int32_t *qidx = m->cp == 1 ? NULL : m->perm + (int64_t)m->mesh->cp_rank * Tc;
    double sum = 0.0;
    int64_t count = 0;
    for (int64_t r = 0; r < Tc; r++) {
        double L = mx[r] + log(ce[r * 3]); /* max + log sum exp */
        int64_t gt = mb->out0 + (qidx ? qidx[r] : r); /* global token */
        int32_t tg = mb->tgt[r];
        double lp = tg == -100 ? 0.0 : ce[r * 3 + 2] - L;
        if (tg != -100) {
            sum += mb->wt ? -lp * (double)mb->wt[r] : -lp;
            count++;
        }
        if (m->mesh->tp_rank == 0) { /* the same on every tp rank: written once */
            if (token_logprob) token_logprob[gt] = (float)lp;
            if (entropy) entropy[gt] = (float)(L - ce[r * 3 + 1] / ce[r * 3]);
        }
    }
    *loss_sum = sum;
    *n_tokens = count;
    return LOOM_OK;
}

const loom_loss_kind *loom_loss_cross_entropy(void) {
    static const loom_loss_kind k = {
        .name = "cross_entropy",
        .block = ce_block,
        .finish = ce_finish,
    };
    return &k;
}
