/* The training verbs of loom_model: batches checked and cut into
 * micro-batches, forward_backward / forward_only, and clip_grad_and_step
 * (mean-loss scaling, global grad norm, clipping, AdamW, schedule). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../model/model.h"
#include "../model/prof.h"
#include "../backend/adamw.h"
#include "trainer.h"
#include "scheduler.h"
#include "metrics.h"
#include "../parallel/schedule.h"

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
    m->opt_set = true;
    return LOOM_OK;
}

loom_status loom_model_set_lr_scheduler(loom_model *m, const loom_sched_config *c) {
    loom_status st = loom_sched_validate(m->ctx, c);
    if (st) return st;
    m->sched = *c;
    m->has_sched = true;
    return LOOM_OK;
}

static loom_status check_batch(loom_model *m, const loom_batch *b, int64_t n_micro) {
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
    if (n_micro < 1 || b->rows % n_micro)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "batch: %lld rows cannot be split into %lld micro-batches; use a number "
                         "of micro-batches that divides the rows",
                         (long long)b->rows, (long long)n_micro);
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
        if (b->loss_weights && !isfinite(b->loss_weights[t]))
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "batch: loss_weights[%lld, %lld] = %g is not a finite number",
                             (long long)(t / S), (long long)(t % S), (double)b->loss_weights[t]);
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

/* Global token index (within a micro-batch of rows x S) of each cp rank's
 * tokens: each row cut in 2*cp chunks, rank r keeping chunks r and
 * 2cp-1-r, rank blocks one after another. */
static void build_perm(loom_model *m, int64_t rows, int64_t S) {
    const int cp = m->cp;
    const int64_t C = S / (2 * cp);
    int64_t n = 0;
    for (int r = 0; r < cp; r++)
        for (int64_t i = 0; i < rows; i++)
            for (int half = 0; half < 2; half++) {
                int64_t chunk = half ? 2 * cp - 1 - r : r;
                for (int64_t j = 0; j < C; j++) m->perm[n++] = (int32_t)(i * S + chunk * C + j);
            }
}

/* First token of the document holding token g of cu (ndocs+1). */
static int32_t doc_start(const int32_t *cu, int64_t ndocs, int64_t g) {
    int64_t lo = 0, hi = ndocs;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= g)
            lo = mid;
        else
            hi = mid;
    }
    return cu[lo];
}

/* This rank's view of micro-batch k: rows row0.. of the global batch, on
 * the host and uploaded for the ops. */
static loom_status prepare_micro(loom_model *m, const loom_batch *b, int64_t row0, int64_t rows,
                                 loom_micro *u) {
    const int64_t S = b->seq_len, T = rows * S, t0 = row0 * S;
    u->out0 = t0;
    u->key0 = t0 + (b->local ? (int64_t)m->mesh->dp_rank * b->rows * S : 0);
    u->ndocs = 0;
    u->cu[0] = 0;
    if (b->cu_seqlens) {
        int64_t d = 0;
        while (b->cu_seqlens[d + 1] <= t0) d++; /* the document starting at t0 */
        for (; d < b->n_docs && b->cu_seqlens[d + 1] <= t0 + T; d++)
            u->cu[++u->ndocs] = (int32_t)(b->cu_seqlens[d + 1] - t0);
    } else {
        for (int64_t r = 1; r <= rows; r++) u->cu[++u->ndocs] = (int32_t)(r * S);
    }
    u->even_len = u->cu[1]; /* every document as long as the first, or 0 */
    for (int64_t d = 1; d < u->ndocs && u->even_len; d++)
        if (u->cu[d + 1] - u->cu[d] != u->even_len) u->even_len = 0;
    u->wt = NULL;
    if (u->aux) memset(u->aux, 0, loom_moe_aux_len(m) * sizeof(double));
    if (b->loss_weights) {
        if (!u->wt_buf && !(u->wt_buf = loom_malloc(m->ctx, (size_t)m->Tc * sizeof(float),
                                                    "loss weights")))
            return LOOM_ERR_OOM;
        u->wt = u->wt_buf;
    }
    const int32_t *mine = m->perm + (int64_t)m->mesh->cp_rank * m->Tc;
    for (int64_t t = 0; t < m->Tc; t++) {
        int64_t g = m->cp == 1 ? t : mine[t];
        u->ids[t] = b->input_ids[t0 + g];
        u->tgt[t] = b->targets[t0 + g];
        if (u->wt) u->wt[t] = b->loss_weights[t0 + g];
        u->pos[t] = b->position_ids ? b->position_ids[t0 + g]
                                    : (int32_t)(g - doc_start(u->cu, u->ndocs, g));
    }
    const size_t nb = (size_t)m->Tc * sizeof(int32_t);
    loom_status st;
    if ((st = loom_k_upload(m, u->d_ids, u->ids, nb)) || (st = loom_k_upload(m, u->d_tgt, u->tgt, nb)) ||
        (st = loom_k_upload(m, u->d_pos, u->pos, nb)))
        return st;
    if ((st = loom_k_upload(m, u->d_cu, u->cu, (size_t)(u->ndocs + 1) * sizeof(int32_t))))
        return st;
    return loom_k_rope_table(m, u);
}

static loom_acts *acquire(loom_chunk *ch, int mb) {
    for (int i = 0; i < ch->npool; i++)
        if (ch->pool[i].mb < 0) {
            ch->pool[i].mb = mb;
            return &ch->pool[i];
        }
    return NULL;
}

static loom_acts *find_acts(loom_chunk *ch, int mb) {
    for (int i = 0; i < ch->npool; i++)
        if (ch->pool[i].mb == mb) return &ch->pool[i];
    return NULL;
}

/* Pipeline message tags: forward activations and backward gradients, by
 * the receiving chunk and micro-batch (MPI matches by tag; NCCL by order,
 * which the plan keeps the same on both ends). */
#define TAG_BWD 16384
static int msg_tag(bool fwd, int chunk, int mb, int n_micro) {
    return (fwd ? 0 : TAG_BWD) + chunk * n_micro + mb;
}

/* One round's messages (schedule.h) as one group: sends straight from the
 * step's output, receives into their staging slots. */
static loom_status pp_exchange(loom_model *m, const loom_pp_plan *pl, const loom_pp_round *rd,
                               const void *fwd_out, const void *bwd_out, size_t n, int n_micro) {
    if (!rd->nmsg) return LOOM_OK;
    loom_comm *c = m->mesh->pp;
    loom_status st = loom_comm_group_start(c), st2;
    for (int i = 0; i < rd->nmsg && !st; i++) {
        const loom_pp_msg *g = &pl->msgs[rd->msg0 + i];
        const int tag = msg_tag(g->forward, g->chunk, g->mb, n_micro);
        if (g->send)
            st = loom_comm_send(c, g->forward ? fwd_out : bwd_out, n, m->dev.adt, g->peer, tag);
        else
            st = loom_comm_recv(c, m->pp_stage[g->slot], n, m->dev.adt, g->peer, tag);
        /* then the layers' auxiliary state (MoE), with the same tag: both
         * ends post the two in this order, which every transport keeps */
        const size_t na = loom_moe_aux_len(m);
        if (st || !na) continue;
        const loom_micro *u = &m->micro[g->mb];
        const size_t ne = g->forward ? na : loom_moe_grad_len(m);
        const loom_dtype dt = g->forward ? LOOM_F64 : LOOM_F32;
        if (g->send)
            st = loom_comm_send(c, g->forward ? (void *)u->d_aux : (void *)u->d_aux_g, ne, dt,
                                g->peer, tag);
        else
            st = loom_comm_recv(c, loom_pp_aux_at(m, g->slot), ne, dt, g->peer, tag);
    }
    st2 = loom_comm_group_end(c);
    return st ? st : st2;
}

/* NCCL connects a pair of ranks at their first point-to-point operation,
 * and both ranks must take part; a group that waits on one direction before
 * the peer has posted anything in the other would wait forever. So before
 * the first schedule every rank exchanges one element with both neighbours
 * in one group, which sets up every connection the pipeline uses. */
#define TAG_CONNECT 32760
static loom_status pp_connect(loom_model *m) {
    if (m->pp == 1 || m->pp_connected) return LOOM_OK;
    loom_comm *c = m->mesh->pp;
    const int pr = m->mesh->pp_rank, next = (pr + 1) % m->pp, prev = (pr + m->pp - 1) % m->pp;
    loom_status st = loom_comm_group_start(c), st2;
    if (!st) st = loom_comm_send(c, m->pp_stage[0], 1, m->dev.adt, next, TAG_CONNECT);
    if (!st) st = loom_comm_recv(c, m->dx, 1, m->dev.adt, prev, TAG_CONNECT);
    if (!st) st = loom_comm_send(c, m->pp_stage[0], 1, m->dev.adt, prev, TAG_CONNECT + 1);
    if (!st) st = loom_comm_recv(c, m->dtmp, 1, m->dev.adt, next, TAG_CONNECT + 1);
    st2 = loom_comm_group_end(c);
    if (!st && !st2) m->pp_connected = true;
    return st ? st : st2;
}

/* Every rank's verdict on its own batch: when some rank refused its batch,
 * every rank returns an error (that rank its own message, the others one
 * naming it). */
static loom_status agree(loom_model *m, loom_status mine) {
    loom_comm *w = m->world;
    const int n = loom_comm_size(w);
    if (n == 1) return mine;
    int32_t *all = malloc((size_t)n * sizeof *all), me = (int32_t)mine;
    if (!all) return mine ? mine : loom_errf(m->ctx, LOOM_ERR_OOM, "batch: out of memory");
    loom_status st = loom_comm_allgather(w, &me, all, 1, LOOM_I32);
    if (!st && !mine)
        for (int q = 0; q < n; q++)
            if (all[q]) {
                st = loom_errf(m->ctx, (loom_status)all[q],
                               "batch: rank %d refused its batch (%s; its message says why); "
                               "no rank ran this call", q, loom_status_str((loom_status)all[q]));
                break;
            }
    free(all);
    return mine ? mine : st;
}

/* A replica's ranks (tp x cp x pp) run one batch together: with local
 * batches they must agree on its shape, which is checked before anything
 * waits on a peer that runs another shape. */
static loom_status check_replica(loom_model *m, const loom_batch *b, int64_t n_micro) {
    loom_comm *g = m->mesh->mp;
    const int n = loom_comm_size(g);
    if (n == 1) return LOOM_OK;
    int64_t mine[3] = {b->rows, b->seq_len, n_micro}, *all;
    if (!(all = loom_malloc(m->ctx, (size_t)n * sizeof mine, "batch shapes"))) return LOOM_ERR_OOM;
    loom_status st = loom_comm_allgather(g, mine, all, 3, LOOM_I64);
    for (int q = 0; q < n && !st; q++)
        if (memcmp(all + 3 * q, mine, sizeof mine))
            st = loom_errf(m->ctx, LOOM_ERR_SHAPE,
                           "batch: the ranks of data-parallel replica %d disagree on the local "
                           "batch: this rank has %lld rows x %lld tokens in %lld micro-batches, "
                           "rank %d of the replica %lld x %lld in %lld; give the tensor, context "
                           "and pipeline ranks of a replica the same rows",
                           m->mesh->dp_rank, (long long)mine[0], (long long)mine[1],
                           (long long)mine[2], q, (long long)all[3 * q],
                           (long long)all[3 * q + 1], (long long)all[3 * q + 2]);
    free(all);
    return st;
}

/* Runs every micro-batch through this rank's chunks in the pipeline
 * schedule; fills the per-token outputs (global batch layout) when given. */
static loom_status run(loom_model *m, const loom_batch *b, int64_t num_micro_batches, bool backward,
                       float *tlp, float *ent, float *logits, loom_fb_result *out) {
    loom_ctx *ctx = m->ctx;
    loom_mesh_sizes n = m->mesh->n;
    /* the pipeline's rule for the micro-batch count first (rows and length
     * 0: only that), as it names the setting to change; then the batch */
    loom_status st = loom_mesh_check_batch(ctx, &n, 0, 0, num_micro_batches);
    if (!st) st = check_batch(m, b, num_micro_batches);
    if (!st)
        st = loom_mesh_check_batch(ctx, &n, b->local ? b->rows * m->dp : b->rows, b->seq_len,
                                   num_micro_batches);
    /* local batches differ between replicas: a batch refused on one rank
     * stops every rank here, before anything waits on it */
    if (b && b->local && (st = agree(m, st))) return st;
    if (st || (b->local && (st = check_replica(m, b, num_micro_batches)))) return st;
    if ((int64_t)m->vpp * num_micro_batches >= TAG_BWD)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%lld micro-batches x vpp=%d is more than the pipeline can tag (%d)",
                         (long long)num_micro_batches, m->vpp, TAG_BWD);
    const int n_micro = (int)num_micro_batches;
    const int64_t S = b->seq_len, rows_dp = b->local ? b->rows : b->rows / m->dp,
                  micro_batch_size = rows_dp / n_micro,
                  row_base = b->local ? 0 : m->mesh->dp_rank * rows_dp;
    const loom_pp_shape shape = {
        .pp = m->pp, .vpp = m->vpp, .group = n.vpp_group, .n_micro = n_micro};
    loom_pp_plan plan;
    if ((st = loom_pp_plan_build(ctx, &shape, m->mesh->pp_rank, backward, &plan))) return st;
    loom_prof_phase(m, "step");
    if ((st = loom_prof_mark(m, "batch upload"))) goto done;
    if ((st = loom_model_reserve(m, micro_batch_size, S, n_micro, plan.in_flight, plan.nslots)))
        goto done;
    build_perm(m, micro_batch_size, S);
    if ((st = loom_k_upload(m, m->d_perm, m->perm,
                            (size_t)(micro_batch_size * S) * sizeof(int32_t))))
        goto done;
    for (int k = 0; k < n_micro && !st; k++)
        st = prepare_micro(m, b, row_base + (int64_t)k * micro_batch_size, micro_batch_size,
                           &m->micro[k]);
    if (st) goto done;
    const int64_t T = b->rows * S;
    if (tlp) memset(tlp, 0, (size_t)T * sizeof *tlp);
    if (ent) memset(ent, 0, (size_t)T * sizeof *ent);
    if (logits) memset(logits, 0, (size_t)(T * m->V) * sizeof *logits);

    m->training = backward;
    if (backward) m->dropout_calls++; /* the same count on every rank */
    const size_t act_n = (size_t)(m->Tn * m->H), act_b = act_n * m->dev.esz;
    double acc[4] = {0.0, 0.0, 0.0, 0.0}; /* loss sum, tokens, load-balancing and z-losses */
    if ((st = pp_connect(m))) goto done;
    if (backward) { /* the trained arena's gradients, at its first backward */
        loom_arena *A = loom_model_trainable(m);
        if ((st = loom_arena_master_to_device(m, A))) goto done;
        if (!A->g && (st = loom_dev_alloc(m, (void **)&A->g, A->ngrad * sizeof(float),
                                          "gradients")))
            goto done;
    }
    for (int r = 0; r < plan.nrounds && !st; r++) {
        const loom_pp_round *rd = &plan.rounds[r];
        const void *fwd_out = NULL;
        if (rd->step >= 0) {
            const loom_pp_step sp = plan.steps[rd->step];
            const int slot = plan.in_slot[rd->step];
            loom_chunk *ch = &m->chunks[sp.chunk];
            loom_acts *a;
            if (sp.forward) {
                a = acquire(ch, sp.mb);
                LOOM_ASSERT(a);
                if (slot >= 0 && (st = loom_k_copy(m, a->x, m->pp_stage[slot], act_b))) break;
                loom_micro *u = &m->micro[sp.mb];
                if (slot >= 0 && u->aux &&
                    (st = loom_k_download(m, u->aux, loom_pp_aux_at(m, slot),
                                          loom_pp_aux_bytes(m))))
                    break;
                double s = 0.0;
                int64_t cnt = 0;
                if ((st = loom_chunk_forward(m, sp.chunk, a, u, backward, tlp, ent,
                                             logits, &s, &cnt)))
                    break;
                double aux = 0.0; /* the layers' load-balancing loss (MoE) */
                if (ch->last && (st = loom_moe_finish(m, u, backward, &aux)))
                    break;
                if (ch->last && m->mesh->tp_rank == 0) {
                    acc[0] += s + aux;
                    acc[1] += (double)cnt;
                    if (m->mesh->cp_rank == 0 && u->aux) {
                        acc[2] += u->aux_loss;
                        acc[3] += u->z_loss;
                        if (backward)
                            m->acc_aux += u->aux_loss, m->acc_z += u->z_loss, m->acc_aux_n++;
                    }
                }
                /* the sums so far travel on with the activations */
                if (!ch->last && u->aux && u->d_aux != u->aux &&
                    (st = loom_k_upload(m, u->d_aux, u->aux, loom_pp_aux_bytes(m))))
                    break;
                fwd_out = (char *)a->x + (size_t)ch->nl * act_b;
                if (!backward) a->mb = -1;
            } else {
                a = find_acts(ch, sp.mb);
                LOOM_ASSERT(a);
                if (slot >= 0 && (st = loom_k_copy(m, m->dx, m->pp_stage[slot], act_b))) break;
                const loom_micro *u = &m->micro[sp.mb]; /* the aux loss's gradient, with dy */
                if (slot >= 0 && u->aux_g &&
                    (st = loom_k_copy(m, u->d_aux_g, loom_pp_aux_at(m, slot),
                                      loom_moe_grad_len(m) * sizeof(float))))
                    break;
                if ((st = loom_chunk_backward(m, sp.chunk, a, &m->micro[sp.mb]))) break;
                a->mb = -1;
            }
        }
        /* a forward's output stays in its activations until its backward;
         * the backward's dx until the next step, after this exchange */
        if (rd->nmsg) {
            loom_prof_phase(m, "step");
            if ((st = loom_prof_mark(m, "pipeline send/recv"))) break;
        }
        st = pp_exchange(m, &plan, rd, fwd_out, m->dx, act_n, n_micro);
    }
    loom_prof_phase(m, "step");
    if (!st) st = loom_prof_mark(m, "loss sums");
    if (!st) st = loom_k_settle(m); /* no collective left queued past the call */
    if (st) goto done;
    /* the whole mesh's loss and token count; per-token outputs from the ranks
     * that computed them */
    if (loom_comm_size(m->world) > 1) {
        /* a replica's own rows (local) are computed within its model group */
        loom_comm *og = b->local ? m->mesh->mp : m->world;
        if ((st = loom_comm_allreduce(m->world, acc, 4, LOOM_F64, LOOM_RED_SUM))) goto done;
        if (tlp && (st = loom_comm_allreduce(og, tlp, (size_t)T, LOOM_F32, LOOM_RED_SUM)))
            goto done;
        if (ent && (st = loom_comm_allreduce(og, ent, (size_t)T, LOOM_F32, LOOM_RED_SUM)))
            goto done;
        if (logits && (st = loom_comm_allreduce(og, logits, (size_t)(T * m->V), LOOM_F32,
                                                LOOM_RED_SUM)))
            goto done;
    }
    const double sum = acc[0];
    const int64_t count = (int64_t)acc[1];
    if (backward && !isfinite(sum)) {
        loom_model_zero_grad(m);
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "loss is %s (over %lld micro-batch%s); the gradients accumulated since "
                       "the last step were discarded. Lower the learning rate, or check the data "
                       "and the checkpoint (loom inspect)",
                       isnan(sum) ? "nan" : "inf", (long long)n_micro, n_micro == 1 ? "" : "es");
        goto done;
    }
    if (backward) {
        m->acc_loss += sum;
        m->acc_tokens += count;
    }
    if (out) {
        out->loss_sum = sum;
        out->n_tokens = count;
        out->loss = count ? sum / (double)count : 0.0;
        out->aux_loss = acc[2] / (double)(n_micro * m->dp); /* each replica ran n_micro */
        out->z_loss = acc[3] / (double)(n_micro * m->dp);
    }
done:
    /* a failed call leaves no micro-batch in flight */
    for (int c = 0; c < m->vpp; c++)
        for (int i = 0; i < m->chunks[c].npool; i++) m->chunks[c].pool[i].mb = -1;
    loom_pp_plan_free(&plan);
    return st;
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

loom_comm *loom_bucket_comm(const loom_model *m, const loom_arena *A, int b) {
    return A->bucket_ex && A->bucket_ex[b] ? m->mesh->edp : m->mesh->dpcp;
}

void loom_shard_range(const loom_model *m, const loom_arena *A, int b, size_t *s0, size_t *per,
                      size_t *base) {
    loom_comm *c = loom_bucket_comm(m, A, b);
    const int n = loom_comm_size(c), r = loom_comm_rank(c);
    *per = A->bucket_len[b] / (size_t)n;
    *s0 = A->bucket_off[b] + (size_t)r * *per;
    *base = 0; /* the shard buffers hold the buckets' shards one after another */
    for (int k = 0; k < b; k++)
        *base += A->bucket_len[k] / (size_t)loom_comm_size(loom_bucket_comm(m, A, k));
}

/* One rank holds every bucket whole (no group to shard over): the gradients
 * serve as the shard. */
static bool unsharded(const loom_model *m, const loom_arena *A) {
    for (int b = 0; b < A->nbuckets; b++)
        if (loom_comm_size(loom_bucket_comm(m, A, b)) > 1) return false;
    return true;
}

/* The part of slot i inside this rank's shard of bucket b: flat offset o0,
 * length, and offset in the shard buffers. False when they do not meet. */
bool loom_shard_part(const loom_model *m, const loom_arena *A, int b, int i, size_t *o0,
                     size_t *len, size_t *so) {
    size_t s0, per, base;
    loom_shard_range(m, A, b, &s0, &per, &base);
    const size_t s1 = s0 + per;
    const loom_slot *sl = &A->slots[i];
    size_t a0 = sl->off > s0 ? sl->off : s0, a1 = sl->off + sl->numel < s1 ? sl->off + sl->numel : s1;
    if (a0 >= a1) return false;
    *o0 = a0;
    *len = a1 - a0;
    *so = base + (a0 - s0);
    return true;
}

/* Each distinct parameter enters the norm once: replicated tensors from tp
 * rank 0 only, a tied embedding from the first stage only. */
static bool counts_in_norm(const loom_model *m, const loom_arena *A, int i) {
    const loom_slot *s = &A->slots[i];
    if (s->head_copy) return false;
    return s->shard != LOOM_SHARD_NONE || (s->expert ? m->mesh->etp_rank : m->mesh->tp_rank) == 0;
}

/* After the buckets' queued collectives: waits for both of their groups
 * (also after a failure, so none is left in flight). */
static loom_status settle_buckets(loom_model *m, loom_status st) {
    loom_status a = loom_comm_settle(m->mesh->dpcp), b = loom_comm_settle(m->mesh->edp);
    return st ? st : a ? a : b;
}

/* Sums partial gradients over tp (replicated tensors that saw some heads or
 * tokens), a tied embedding's two stages, then reduce-scatters every
 * bucket over dp x cp into the shard buffer. */
static loom_status reduce_grads(loom_model *m, loom_arena *A) {
    loom_status st = LOOM_OK;
    for (int i = 0; i < A->nslots && !st; i++) {
        const loom_slot *s = &A->slots[i];
        if ((s->tp_partial || s->etp_partial) && !s->frozen)
            st = loom_comm_allreduce(s->etp_partial ? m->mesh->etp : m->mesh->tp, A->g + s->off,
                                     s->numel, LOOM_F32, LOOM_RED_SUM);
    }
    if (!st && A == &m->base && m->mesh->embed && m->cfg.tie_word_embeddings &&
        loom_g(m, m->mesh->pp_rank == 0 ? m->embed : m->head)) {
        int s = m->mesh->pp_rank == 0 ? m->embed : m->head;
        st = loom_comm_allreduce(m->mesh->embed, loom_g(m, s), A->slots[s].numel, LOOM_F32,
                                 LOOM_RED_SUM);
    }
    /* the buckets' collectives queued one after another, waited for once a
     * group at the end; a bucket of a one-rank group is its own shard, with
     * no collective (each cost 0.13-0.25 ms on 2 H200s whatever its size,
     * which is also why the LoRA arena keeps its buckets few: lora.c) */
    size_t so = 0;
    for (int b = 0; b < A->nbuckets && !st && !A->gshard_is_g; b++) {
        loom_comm *c = loom_bucket_comm(m, A, b);
        const size_t per = A->bucket_len[b] / (size_t)loom_comm_size(c);
        if (loom_comm_size(c) == 1) {
            st = loom_k_copy(m, A->gshard + so, A->g + A->bucket_off[b], per * sizeof(float));
        } else {
            loom_comm_defer(c);
            st = loom_comm_reduce_scatter(c, A->g + A->bucket_off[b], A->gshard + so, per,
                                          LOOM_F32, LOOM_RED_SUM);
        }
        so += per;
    }
    return settle_buckets(m, st);
}

/* Every dp x cp rank's updated shard back into everyone's parameters
 * (queued, then one wait a group, as reduce_grads). */
static loom_status gather_params(loom_model *m, loom_arena *A) {
    loom_status st = LOOM_OK;
    for (int b = 0; b < A->nbuckets && !st; b++) {
        loom_comm *c = loom_bucket_comm(m, A, b);
        const size_t n = (size_t)loom_comm_size(c), r = (size_t)loom_comm_rank(c);
        if (n == 1) continue; /* in place */
        size_t per = A->bucket_len[b] / n;
        float *base = A->w + A->bucket_off[b];
        loom_comm_defer(c);
        st = loom_comm_allgather(c, base + r * per, base, per, LOOM_F32);
    }
    return settle_buckets(m, st);
}

/* MoE: the step's load-balancing loss and tokens per expert, over the
 * whole mesh (collective). */
static loom_status expert_stats(loom_model *m, loom_step_result *r) {
    const int64_t E = m->cfg.num_experts, n = m->L * E;
    double *v = loom_malloc(m->ctx, (size_t)(n + 3) * sizeof *v, "expert statistics");
    if (!v) return LOOM_ERR_OOM;
    memcpy(v, m->moe_load, (size_t)n * sizeof *v);
    v[n] = m->acc_aux;
    v[n + 1] = (double)m->acc_aux_n;
    v[n + 2] = m->acc_z;
    loom_status st = loom_comm_size(m->world) > 1
                         ? loom_comm_allreduce(m->world, v, (size_t)n + 3, LOOM_F64, LOOM_RED_SUM)
                         : LOOM_OK;
    if (!st) {
        r->aux_loss = v[n + 1] > 0 ? v[n] / v[n + 1] : 0.0;
        r->z_loss = v[n + 1] > 0 ? v[n + 2] / v[n + 1] : 0.0;
        memcpy(m->moe_load + n, v, (size_t)n * sizeof *v); /* the step's, for loom_model_expert_tokens */
        double lo = INFINITY, hi = 0.0, sum = 0.0, imb = 0.0;
        int64_t nl = 0, worst = -1;
        for (int64_t l = 0; l < m->L; l++) {
            if (!loom_config_layer_is_moe(&m->cfg, l)) continue;
            loom_expert_layer_stats ls;
            loom_expert_layer_stats_of(v + l * E, E, &ls);
            lo = fmin(lo, ls.min), hi = fmax(hi, ls.max), sum += ls.mean * (double)E;
            nl++;
            if (worst < 0 || ls.imbalance > imb) imb = ls.imbalance, worst = l;
        }
        r->expert_tokens_min = nl ? lo : 0.0;
        r->expert_tokens_max = hi;
        r->expert_tokens_mean = nl ? sum / (double)(nl * E) : 0.0;
        r->expert_imbalance = imb;
        r->expert_imbalance_layer = worst;
    }
    free(v);
    return st;
}

loom_status loom_model_expert_tokens(const loom_model *m, double *out, int64_t n) {
    if (!m || !out) return LOOM_ERR_INVALID_ARG;
    const int64_t le = m->L * m->cfg.num_experts;
    if (!m->moe_load)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG, "expert_tokens: the model has no experts");
    if (n < le)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG, "expert_tokens: room for %lld values, "
                         "the model has %lld layers x %lld experts",
                         (long long)n, (long long)m->L, (long long)m->cfg.num_experts);
    memcpy(out, m->moe_load + le, (size_t)le * sizeof *out);
    return LOOM_OK;
}

static loom_status step_parts(loom_model *m, loom_arena *A, const loom_k_part *parts, int nparts,
                              double max_grad_norm, loom_step_result *rp, loom_step_result *out);

/* This rank's parts of every bucket, made once per arena (the step of a
 * model with thousands of adapter slots spent tens of ms here): what AdamW
 * updates and what the norm counts (each parameter once over the mesh). */
static loom_status optim_parts(loom_model *m, loom_arena *A) {
    loom_k_part *parts = malloc(((size_t)A->nbuckets * (size_t)A->nslots + 1) * sizeof *parts);
    if (!parts) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the optimizer's parts");
    int nparts = 0;
    for (int b = 0; b < A->nbuckets; b++)
        for (int i = 0; i < A->nslots; i++) {
            size_t o0, len, so;
            if (loom_shard_part(m, A, b, i, &o0, &len, &so))
                parts[nparts++] = (loom_k_part){.p_off = o0, .s_off = so, .len = len,
                                                .decay = A->slots[i].decay,
                                                .norm = counts_in_norm(m, A, i)};
        }
    A->parts = parts;
    A->nparts = nparts;
    return LOOM_OK;
}

static loom_status clip_grad_and_step(loom_model *m, double max_grad_norm,
                                      int64_t accumulation_steps, loom_step_result *out) {
    loom_ctx *ctx = m->ctx;
    loom_step_result r;
    memset(&r, 0, sizeof r);
    r.expert_imbalance_layer = -1;
    loom_arena *A = loom_model_trainable(m);
    if (accumulation_steps < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "accumulation_steps=%lld must be >= 1",
                         (long long)accumulation_steps);
    m->acc_calls++;
    r.step = A->step;
    r.n_tokens = m->acc_tokens;
    r.loss = m->acc_tokens ? m->acc_loss / (double)m->acc_tokens : 0.0;
    if (m->acc_calls < accumulation_steps) {
        if (out) *out = r;
        return LOOM_OK;
    }
    loom_prof_phase(m, "step");
    if (m->moe_load) {
        loom_status st = loom_prof_mark(m, "expert stats");
        if (st || (st = expert_stats(m, &r))) return st;
    }
    if (m->acc_tokens == 0) {
        LOOM_LOG_W(ctx, "step %lld skipped: the %lld accumulated call%s had no token with a target",
                   (long long)A->step + 1, (long long)m->acc_calls, m->acc_calls == 1 ? "" : "s");
        loom_model_zero_grad(m);
        if (out) *out = r;
        return LOOM_OK;
    }
    loom_status sa = loom_optim_alloc(m, A);
    if (sa) return sa;
    if (!A->parts && (sa = optim_parts(m, A))) return sa;
    return step_parts(m, A, A->parts, A->nparts, max_grad_norm, &r, out);
}

/* The step, then (the last call of an accumulation) the end of the step's
 * profile. */
loom_status loom_model_clip_grad_and_step(loom_model *m, double max_grad_norm,
                                          int64_t accumulation_steps, loom_step_result *out) {
    const bool last = accumulation_steps >= 1 && m->acc_calls + 1 >= accumulation_steps;
    loom_status st = clip_grad_and_step(m, max_grad_norm, accumulation_steps, out);
    return !st && last ? loom_prof_step_end(m) : st;
}

loom_status loom_optim_alloc(loom_model *m, loom_arena *A) {
    if (A->gshard) return LOOM_OK;
    if (!A->g) { /* the gradients first: with one rank over dp x cp they are the shard */
        loom_status st = loom_arena_master_to_device(m, A);
        if (!st) st = loom_dev_alloc(m, (void **)&A->g, A->ngrad * sizeof(float), "gradients");
        if (!st) st = loom_k_zero(m, A->g, A->ngrad * sizeof(float));
        if (st) return st;
    }
    size_t n = A->shard_numel;
    /* one rank over dp x cp: the shard is the whole gradient buffer, the
     * buckets back to back (checked), so the gradients serve as it (no
     * copy, and one fp32 copy of the gradients less) */
    bool is_g = unsharded(m, A);
    for (size_t b = 0, so = 0; is_g && b < (size_t)A->nbuckets; so += A->bucket_len[b++])
        is_g = A->bucket_off[b] == so;
    float *blk = NULL;
    loom_status sa = loom_dev_alloc(m, (void **)&blk, (is_g ? 2 : 3) * n * sizeof(float),
                                    is_g ? "AdamW moments" : "AdamW moments and the gradient shard");
    if (sa) return sa;
    if ((sa = loom_k_zero(m, blk, (is_g ? 2 : 3) * n * sizeof(float)))) {
        loom_dev_free(m, blk);
        return sa;
    }
    A->gshard_is_g = is_g;
    A->gshard = is_g ? A->g : blk;
    A->adam_m = is_g ? blk : blk + n;
    A->adam_v = A->adam_m + n;
    return LOOM_OK;
}

/* The step proper, on the parts of this rank's shard. */
static loom_status step_parts(loom_model *m, loom_arena *A, const loom_k_part *parts, int nparts,
                              double max_grad_norm, loom_step_result *rp, loom_step_result *out) {
    loom_ctx *ctx = m->ctx;
    loom_step_result r = *rp;
    loom_status st = loom_prof_mark(m, "gradient reduce");
    if (!st) st = loom_grad_settle(m);
    if (!st) st = reduce_grads(m, A);
    if (!st) st = loom_prof_mark(m, "gradient norm");
    if (st) return st;
    /* The gradient of the mean loss (unscaled), its global norm (each
     * parameter once, in a fixed order), and clipping: the unscale and clip
     * factors are applied inside the norm and AdamW passes (the same fp32
     * products as scaling the gradients in place, without the two passes). */
    const float unscale = (float)(1.0 / ((double)m->acc_tokens * m->loss_scale));
    double sumsq = 0.0;
    if ((st = loom_k_sumsq_parts(m, A, parts, nparts, unscale, &sumsq))) return st;
    if (loom_comm_size(m->world) > 1 &&
        (st = loom_comm_allreduce(m->world, &sumsq, 1, LOOM_F64, LOOM_RED_SUM)))
        return st;
    double norm = sqrt(sumsq);
    if (!isfinite(norm) && m->dev.adt == LOOM_F16) {
        /* fp16: the loss scale was too large; skip the step and halve it */
        r.loss_scale = m->loss_scale;
        m->loss_scale = m->loss_scale / 2 >= 1.0 ? m->loss_scale / 2 : 1.0;
        m->good_steps = 0;
        LOOM_LOG_I(ctx, "step %lld skipped: fp16 gradients overflowed; loss scale %g -> %g",
                   (long long)A->step + 1, r.loss_scale, m->loss_scale);
        loom_model_zero_grad(m);
        r.skipped = 1;
        if (out) *out = r;
        return LOOM_OK;
    }
    if (!isfinite(norm)) {
        loom_model_zero_grad(m);
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "step %lld: the gradient norm is %s; the step was not taken and the "
                         "gradients were discarded. Lower the learning rate or check the data",
                         (long long)A->step + 1, isnan(norm) ? "nan" : "inf");
    }
    const float gs[2] = {unscale, loom_clip_coeff(norm, max_grad_norm)};

    loom_adamw_hp hp = {.lr = m->opt.lr, .beta1 = m->opt.beta1, .beta2 = m->opt.beta2,
                        .eps = m->opt.eps, .weight_decay = m->opt.weight_decay};
    if (m->has_sched) {
        hp.lr = loom_sched_lr(&m->sched, A->step);
        hp.weight_decay = loom_sched_wd(&m->sched, A->step);
    }
    int64_t t = A->step + 1;
    /* AdamW on this rank's shard of every bucket, then every rank gets the
     * updated parameters back */
    bool wc_done;
    if ((st = loom_prof_mark(m, "optimizer"))) return st;
    if ((st = loom_k_adamw_parts(m, A, parts, nparts, &hp, t, gs,
                                 unsharded(m, A), &wc_done)))
        return st;
    if ((st = loom_prof_mark(m, "parameter gather")) || (st = gather_params(m, A))) return st;
    if (!wc_done && (st = loom_arena_sync(m, A))) return st;
    if (m->dev.adt == LOOM_F16 && ++m->good_steps >= 2000) { /* torch GradScaler's growth */
        m->loss_scale *= 2;
        m->good_steps = 0;
    }
    A->step = t;
    r.stepped = 1;
    r.grad_norm = norm;
    r.lr = hp.lr;
    r.weight_decay = hp.weight_decay;
    r.step = A->step;
    r.loss_scale = m->loss_scale;
    loom_model_zero_grad(m);
    if (out) *out = r;
    return LOOM_OK;
}
