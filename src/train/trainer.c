/* The training verbs of loom_model: batches checked and cut into
 * micro-batches, forward_backward / forward_only, and clip_grad_and_step
 * (mean-loss scaling, global grad norm, clipping, AdamW, schedule). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"
#include "adamw.h"
#include "scheduler.h"

loom_optimizer_config loom_optimizer_config_default(void) {
    loom_optimizer_config c = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                               .weight_decay = 0.01};
    return c;
}

loom_status loom_model_set_optimizer(loom_model *m, const loom_optimizer_config *c) {
    loom_ctx *ctx = m->ctx;
    if (!(c->lr >= 0.0) || !isfinite(c->lr))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "optimizer: lr=%g must be a finite number >= 0",
                         c->lr);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0) || !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "optimizer: betas (%g, %g) must lie in [0, 1), e.g. 0.9 and 0.999",
                         c->beta1, c->beta2);
    if (!(c->eps > 0.0) || !isfinite(c->eps))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "optimizer: eps=%g must be > 0, e.g. 1e-8", c->eps);
    if (!(c->weight_decay >= 0.0) || !isfinite(c->weight_decay))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "optimizer: weight_decay=%g must be >= 0",
                         c->weight_decay);
    m->opt = *c;
    return LOOM_OK;
}

loom_status loom_model_set_lr_scheduler(loom_model *m, const loom_sched_config *c) {
    loom_status st = loom_sched_validate(m->ctx, c);
    if (st) return st;
    m->sched = *c;
    m->has_sched = true;
    return LOOM_OK;
}

void loom_model_zero_grad(loom_model *m) {
    memset(m->g, 0, m->nparams * sizeof(float));
    m->acc_calls = 0;
    m->acc_tokens = 0;
    m->acc_loss = 0.0;
}

/* Everything about a batch that can be wrong is found here, before any
 * compute, with the place named. */
static loom_status check_batch(loom_model *m, const loom_batch *b, int64_t nmicro) {
    loom_ctx *ctx = m->ctx;
    if (!b || !b->input_ids || !b->targets)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "batch: input_ids and targets are required");
    if (b->rows < 1 || b->seq_len < 1)
        return loom_errf(ctx, LOOM_ERR_SHAPE, "batch: shape (%lld, %lld): rows and seq_len must be "
                         ">= 1", (long long)b->rows, (long long)b->seq_len);
    if (b->seq_len > INT32_MAX / b->rows)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "batch: %lld x %lld tokens is more than one call can take (2^31 - 1)",
                         (long long)b->rows, (long long)b->seq_len);
    if (nmicro < 1 || b->rows % nmicro)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "batch: %lld rows cannot be split into %lld micro-batches; use a number "
                         "of micro-batches that divides the rows",
                         (long long)b->rows, (long long)nmicro);
    const int64_t S = b->seq_len, T = b->rows * S;
    for (int64_t t = 0; t < T; t++) {
        int32_t id = b->input_ids[t], tg = b->targets[t];
        if (id < 0 || id >= m->V)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "batch: input_ids[%lld, %lld] = %d is outside the vocabulary [0, "
                             "%lld) of this %s model; was the data tokenized for another model?",
                             (long long)(t / S), (long long)(t % S), id, (long long)m->V,
                             m->cfg.model_type);
        if (tg != -100 && (tg < 0 || tg >= m->V))
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "batch: targets[%lld, %lld] = %d is outside the vocabulary [0, %lld) "
                             "and is not -100 (no loss)",
                             (long long)(t / S), (long long)(t % S), tg, (long long)m->V);
        if (b->position_ids && b->position_ids[t] < 0)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "batch: position_ids[%lld, %lld] = %d < 0",
                             (long long)(t / S), (long long)(t % S), b->position_ids[t]);
    }
    if (b->cu_seqlens) {
        const int32_t *cu = b->cu_seqlens;
        if (b->n_docs < 1 || b->n_docs > T)
            return loom_errf(ctx, LOOM_ERR_SHAPE, "batch: n_docs=%lld must lie in [1, %lld]",
                             (long long)b->n_docs, (long long)T);
        if (cu[0] != 0 || cu[b->n_docs] != T)
            return loom_errf(ctx, LOOM_ERR_SHAPE,
                             "batch: cu_seqlens must start at 0 and end at rows*seq_len = %lld "
                             "(got %d ... %d)",
                             (long long)T, cu[0], cu[b->n_docs]);
        int64_t next_row = S;
        for (int64_t d = 1; d <= b->n_docs; d++) {
            if (cu[d] <= cu[d - 1])
                return loom_errf(ctx, LOOM_ERR_SHAPE,
                                 "batch: cu_seqlens[%lld] = %d does not exceed cu_seqlens[%lld] = "
                                 "%d (documents must be non-empty and in order)",
                                 (long long)d, cu[d], (long long)(d - 1), cu[d - 1]);
            if (cu[d] > next_row)
                return loom_errf(ctx, LOOM_ERR_SHAPE,
                                 "batch: document %lld (tokens %d..%d) crosses the start of row "
                                 "%lld; a document must lie within one row",
                                 (long long)(d - 1), cu[d - 1], cu[d] - 1,
                                 (long long)(next_row / S));
            if (cu[d] == next_row) next_row += S;
        }
    }
    return LOOM_OK;
}

/* Runs every micro-batch; fills per-token outputs when given. */
static loom_status run(loom_model *m, const loom_batch *b, int64_t nmicro, bool backward,
                       float *tlp, float *ent, float *logits, loom_fb_result *out) {
    loom_status st = check_batch(m, b, nmicro);
    if (st) return st;
    const int64_t S = b->seq_len, rows = b->rows / nmicro, Tm = rows * S;
    if ((st = loom_model_reserve(m, Tm))) return st;
    int32_t *pos = m->a.pos, *cu = m->a.cu;
    double sum = 0.0;
    int64_t count = 0;
    int64_t d0 = 0; /* first document of the micro-batch in b->cu_seqlens */
    for (int64_t mb = 0; mb < nmicro; mb++) {
        const int64_t t0 = mb * Tm;
        int64_t nd = 0;
        if (b->cu_seqlens) {
            cu[0] = 0;
            while (d0 + nd < b->n_docs) {
                int64_t e = b->cu_seqlens[d0 + nd + 1];
                if (e > t0 + Tm) break;
                cu[++nd] = (int32_t)(e - t0);
                if (e == t0 + Tm) break;
            }
            d0 += nd;
        } else {
            for (int64_t r = 0; r <= rows; r++) cu[r] = (int32_t)(r * S);
            nd = rows;
        }
        if (b->position_ids)
            memcpy(pos, b->position_ids + t0, (size_t)Tm * sizeof *pos);
        else
            for (int64_t d = 0; d < nd; d++)
                for (int32_t t = cu[d]; t < cu[d + 1]; t++) pos[t] = t - cu[d];
        double s = 0.0;
        int64_t n = 0;
        st = loom_model_run_micro(m, b->input_ids + t0, b->targets + t0, pos, cu, nd, Tm, backward,
                                  tlp ? tlp + t0 : NULL, ent ? ent + t0 : NULL,
                                  logits ? logits + t0 * m->V : NULL, &s, &n);
        if (st) {
            if (backward) {
                char why[256];
                snprintf(why, sizeof why, "%s", loom_last_error(m->ctx));
                loom_model_zero_grad(m);
                return loom_errf(m->ctx, st,
                                 "%s at micro-batch %lld of %lld; the gradients accumulated "
                                 "since the last step were discarded. Lower the learning rate, "
                                 "or check the data and the checkpoint (loom inspect)",
                                 why, (long long)mb + 1, (long long)nmicro);
            }
            return st;
        }
        sum += s;
        count += n;
    }
    if (backward) {
        m->acc_loss += sum;
        m->acc_tokens += count;
    }
    if (out) {
        out->loss_sum = sum;
        out->n_tokens = count;
        out->loss = count ? sum / (double)count : 0.0;
    }
    return LOOM_OK;
}

loom_status loom_model_forward_backward(loom_model *m, const loom_batch *b,
                                        int64_t num_micro_batches, loom_fb_result *out) {
    return run(m, b, num_micro_batches, true, NULL, NULL, NULL, out);
}

loom_status loom_model_forward_only(loom_model *m, const loom_batch *b, int64_t num_micro_batches,
                                    float *token_logprobs, float *entropy, float *logits,
                                    loom_fb_result *out) {
    return run(m, b, num_micro_batches, false, token_logprobs, entropy, logits, out);
}

loom_status loom_model_clip_grad_and_step(loom_model *m, double max_grad_norm,
                                          int64_t accumulation_steps, loom_step_result *out) {
    loom_ctx *ctx = m->ctx;
    loom_step_result r;
    memset(&r, 0, sizeof r);
    if (accumulation_steps < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "accumulation_steps=%lld must be >= 1",
                         (long long)accumulation_steps);
    m->acc_calls++;
    r.step = m->step;
    r.n_tokens = m->acc_tokens;
    r.loss = m->acc_tokens ? m->acc_loss / (double)m->acc_tokens : 0.0;
    if (m->acc_calls < accumulation_steps) {
        if (out) *out = r;
        return LOOM_OK;
    }
    if (m->acc_tokens == 0) {
        LOOM_LOG_W(ctx, "step %lld skipped: the %lld accumulated call%s had no token with a target",
                   (long long)m->step + 1, (long long)m->acc_calls, m->acc_calls == 1 ? "" : "s");
        loom_model_zero_grad(m);
        if (out) *out = r;
        return LOOM_OK;
    }
    if (!m->adam_m) {
        m->adam_m = loom_calloc(ctx, m->nparams, sizeof(float), "AdamW first moments");
        m->adam_v = loom_calloc(ctx, m->nparams, sizeof(float), "AdamW second moments");
        if (!m->adam_m || !m->adam_v) {
            free(m->adam_m);
            free(m->adam_v);
            m->adam_m = m->adam_v = NULL;
            return LOOM_ERR_OOM;
        }
    }
    /* The gradient of the mean loss, its norm (tensor by tensor in a fixed
     * order), and clipping. */
    loom_scale(m->g, m->nparams, (float)(1.0 / (double)m->acc_tokens));
    double sumsq = 0.0;
    for (int i = 0; i < m->nslots; i++) sumsq += loom_sumsq(m->g + m->slots[i].off, m->slots[i].numel);
    double norm = sqrt(sumsq);
    if (!isfinite(norm)) {
        loom_model_zero_grad(m);
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "step %lld: the gradient norm is %s; the step was not taken and the "
                         "gradients were discarded. Lower the learning rate or check the data",
                         (long long)m->step + 1, isnan(norm) ? "nan" : "inf");
    }
    float coeff = loom_clip_coeff(norm, max_grad_norm);
    if (coeff < 1.0f) loom_scale(m->g, m->nparams, coeff);

    loom_adamw_hp hp = {.lr = m->opt.lr, .beta1 = m->opt.beta1, .beta2 = m->opt.beta2,
                        .eps = m->opt.eps, .weight_decay = m->opt.weight_decay};
    if (m->has_sched) {
        hp.lr = loom_sched_lr(&m->sched, m->step);
        hp.weight_decay = loom_sched_wd(&m->sched, m->step);
    }
    int64_t t = m->step + 1;
    for (int i = 0; i < m->nslots; i++) {
        const loom_slot *s = &m->slots[i];
        loom_adamw_step(m->w + s->off, m->g + s->off, m->adam_m + s->off, m->adam_v + s->off,
                        s->numel, &hp, t, s->decay);
    }
    m->step = t;
    r.stepped = 1;
    r.grad_norm = norm;
    r.lr = hp.lr;
    r.weight_decay = hp.weight_decay;
    r.step = m->step;
    loom_model_zero_grad(m);
    if (out) *out = r;
    return LOOM_OK;
}
