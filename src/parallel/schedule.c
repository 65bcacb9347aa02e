/* Pipeline schedules and their messages (see schedule.h). */
#include <stdlib.h>
#include <string.h>

#include "schedule.h"

static int group_of(const loom_pp_shape *s) { return s->group > 0 ? s->group : s->pp; }

loom_status loom_pp_check(loom_ctx *ctx, const loom_pp_shape *s) {
    if (s->pp < 1 || s->vpp < 1 || s->vpp > 64 || s->n_micro < 1 || s->group < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "pipeline schedule: pp=%d vpp=%d micro-batch group=%d micro-batches=%d",
                         s->pp, s->vpp, s->group, s->n_micro);
    if (s->vpp == 1) return LOOM_OK;
    if (s->pp == 1)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "vpp=%d needs pipeline parallelism (pp > 1)", s->vpp);
    const int g = group_of(s), pp = s->pp, n_micro = s->n_micro;
    if (g < pp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "interleaved pipeline (vpp=%d): the micro-batch group "
                         "(--microbatch-group-size-per-virtual-pipeline-stage %d) must be at least pp=%d",
                         s->vpp, g, pp);
    if (n_micro < g)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "interleaved pipeline (vpp=%d) needs at least %d micro-batches (the "
                         "micro-batch group, %s%d), not %d: raise the number of micro-batches "
                         "(global batch / micro-batch size / dp)",
                         s->vpp, g, s->group > 0 ? "--microbatch-group-size-per-virtual-pipeline-stage " : "pp=",
                         g, n_micro);
    const int rest = n_micro % g;
    if (rest && rest < pp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "interleaved pipeline (vpp=%d): %d micro-batches in groups of %d leave "
                         "a last group of %d, fewer than pp=%d (Megatron's rule: micro-batches %% "
                         "group must be 0 or at least pp). Use a multiple of %d micro-batches%s",
                         s->vpp, n_micro, g, rest, pp, g,
                         g == pp ? ", or set --microbatch-group-size-per-virtual-pipeline-stage to a size whose "
                                   "remainder is 0 or at least pp"
                                 : "");
    return LOOM_OK;
}

/* The k-th entry of the forward order: micro-batch and chunk. */
static void table_at(const loom_pp_shape *s, int k, int *mb, int *chunk) {
    const int g = s->vpp == 1 ? s->n_micro : group_of(s), vpp = s->vpp, n_micro = s->n_micro;
    int g0 = 0;
    for (;;) {
        int len = g0 + g >= n_micro ? n_micro - g0 : g;
        if (k < len * vpp) {
            *chunk = k / len;
            *mb = g0 + k % len;
            return;
        }
        k -= len * vpp;
        g0 += len;
    }
}

loom_status loom_pp_schedule(loom_ctx *ctx, const loom_pp_shape *s, int rank, bool backward,
                             loom_pp_step **out, int *nsteps) {
    *out = NULL;
    *nsteps = 0;
    loom_status st = loom_pp_check(ctx, s);
    if (st) return st;
    if (rank < 0 || rank >= s->pp)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "pipeline schedule: rank %d of pp=%d", rank,
                         s->pp);
    const int pp = s->pp, vpp = s->vpp, total = s->n_micro * vpp;
    int warmup = vpp == 1 ? pp - rank - 1 : (pp - rank - 1) * 2 + (vpp - 1) * group_of(s);
    if (!backward || warmup > total) warmup = total;
    loom_pp_step *o = loom_malloc(ctx, sizeof *o * (size_t)(2 * total), "pipeline schedule");
    if (!o) return LOOM_ERR_OOM;
    int n = 0;
#define STEP(k, fwd)                                                                      \
    do {                                                                                  \
        int mb_, c_;                                                                      \
        table_at(s, (k), &mb_, &c_);                                                      \
        o[n++] = (loom_pp_step){.forward = (fwd), .chunk = (fwd) ? c_ : vpp - 1 - c_,     \
                                .mb = mb_};                                               \
    } while (0)
    for (int k = 0; k < warmup; k++) STEP(k, true);
    for (int k = 0; k < total - warmup; k++) {
        STEP(k + warmup, true);
        STEP(k, false);
    }
    if (backward)
        for (int k = total - warmup; k < total; k++) STEP(k, false);
#undef STEP
    *out = o;
    *nsteps = n;
    return LOOM_OK;
}

int loom_pp_max_in_flight(const loom_pp_step *s, int nsteps) {
    int best = 0, live[64] = {0};
    for (int i = 0; i < nsteps; i++) {
        int c = s[i].chunk < 64 ? s[i].chunk : 63;
        live[c] += s[i].forward ? 1 : -1;
        if (live[c] > best) best = live[c];
    }
    return best;
}

/* ---- messages: every rank's steps played in rounds ---- */

typedef struct sim_rank {
    loom_pp_step *steps;
    int n, pos;
    int *arrived; /* (2 * vpp * n_micro) round a message arrived in, -1: not yet */
    int *slot_of; /* (2 * vpp * n_micro) its slot (this rank only) */
} sim_rank;

typedef struct sim_msg {
    int from, to;
    bool forward;
    int chunk, mb; /* receiving chunk */
} sim_msg;

static int msg_key(const loom_pp_shape *s, bool forward, int chunk, int mb) {
    return ((forward ? 0 : 1) * s->vpp + chunk) * s->n_micro + mb;
}

static bool grow(loom_ctx *ctx, void **p, int *cap, int need, size_t elem) {
    if (need <= *cap) return true;
    int c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void *q = loom_realloc(ctx, *p, (size_t)c * elem, "pipeline plan");
    if (!q) return false;
    *p = q;
    *cap = c;
    return true;
}

void loom_pp_plan_free(loom_pp_plan *p) {
    if (!p) return;
    free(p->steps);
    free(p->in_slot);
    free(p->rounds);
    free(p->msgs);
    memset(p, 0, sizeof *p);
}

loom_status loom_pp_plan_build(loom_ctx *ctx, const loom_pp_shape *s, int rank, bool backward,
                               loom_pp_plan *out) {
    memset(out, 0, sizeof *out);
    loom_status st = loom_pp_check(ctx, s);
    if (st) return st;
    const int pp = s->pp, V = pp * s->vpp, nkeys = 2 * s->vpp * s->n_micro;
    sim_rank *R = loom_calloc(ctx, (size_t)pp, sizeof *R, "pipeline plan");
    sim_msg *pend = loom_calloc(ctx, (size_t)pp, sizeof *pend, "pipeline plan");
    bool *busy = loom_calloc(ctx, (size_t)nkeys, sizeof *busy, "pipeline plan");
    int cap_r = 0, cap_m = 0;
    if (!R || !pend || !busy) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    for (int r = 0; r < pp && !st; r++) {
        if ((st = loom_pp_schedule(ctx, s, r, backward, &R[r].steps, &R[r].n))) break;
        R[r].arrived = loom_malloc(ctx, sizeof(int) * (size_t)nkeys, "pipeline plan");
        R[r].slot_of = loom_malloc(ctx, sizeof(int) * (size_t)nkeys, "pipeline plan");
        if (!R[r].arrived || !R[r].slot_of) st = LOOM_ERR_OOM;
        for (int k = 0; !st && k < nkeys; k++) R[r].arrived[k] = R[r].slot_of[k] = -1;
    }
    if (st) goto done;
    sim_rank *me = &R[rank];
    out->nsteps = me->n;
    out->in_flight = backward ? loom_pp_max_in_flight(me->steps, me->n) : 1;
    out->in_slot = loom_malloc(ctx, sizeof(int) * (size_t)(me->n ? me->n : 1), "pipeline plan");
    if (!out->in_slot) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    for (int round = 0;; round++) {
        int npend = 0, mystep = -1;
        bool left = false, ran = false;
        for (int r = 0; r < pp; r++) {
            sim_rank *x = &R[r];
            if (x->pos == x->n) continue;
            left = true;
            const loom_pp_step sp = x->steps[x->pos];
            const int v = sp.chunk * pp + r;
            const bool needs = sp.forward ? v > 0 : v < V - 1;
            const int key = msg_key(s, sp.forward, sp.chunk, sp.mb);
            if (needs && (x->arrived[key] < 0 || x->arrived[key] >= round)) continue;
            ran = true;
            if (r == rank) {
                mystep = x->pos;
                out->in_slot[x->pos] = needs ? x->slot_of[key] : -1;
                if (needs) busy[x->slot_of[key]] = false; /* free once the step read it */
            }
            x->pos++;
            const int w = sp.forward ? v + 1 : v - 1; /* the virtual stage fed */
            if (w >= 0 && w < V)
                pend[npend++] = (sim_msg){.from = r, .to = w % pp, .forward = sp.forward,
                                          .chunk = w / pp, .mb = sp.mb};
        }
        if (!left) break;
        if (!ran) {
            st = loom_errf(ctx, LOOM_ERR_INTERNAL,
                           "pipeline schedule pp=%d vpp=%d group=%d micro-batches=%d stops "
                           "making progress in round %d (a loom bug: please report it)",
                           pp, s->vpp, group_of(s), s->n_micro, round);
            goto done;
        }
        const int m0 = out->nmsgs;
        for (int i = 0; i < npend; i++) {
            const sim_msg *g = &pend[i];
            const int key = msg_key(s, g->forward, g->chunk, g->mb);
            R[g->to].arrived[key] = round;
            if (g->from != rank && g->to != rank) continue;
            if (!grow(ctx, (void **)&out->msgs, &cap_m, out->nmsgs + 2, sizeof *out->msgs)) {
                st = LOOM_ERR_OOM;
                goto done;
            }
            if (g->from == rank)
                out->msgs[out->nmsgs++] = (loom_pp_msg){.send = true, .forward = g->forward,
                                                        .peer = g->to, .chunk = g->chunk,
                                                        .mb = g->mb, .slot = -1};
            if (g->to == rank) {
                int slot = 0;
                while (busy[slot]) slot++;
                busy[slot] = true;
                me->slot_of[key] = slot;
                if (slot + 1 > out->nslots) out->nslots = slot + 1;
                out->msgs[out->nmsgs++] = (loom_pp_msg){.send = false, .forward = g->forward,
                                                        .peer = g->from, .chunk = g->chunk,
                                                        .mb = g->mb, .slot = slot};
            }
        }
        if (mystep < 0 && out->nmsgs == m0) continue;
        if (!grow(ctx, (void **)&out->rounds, &cap_r, out->nrounds + 1, sizeof *out->rounds)) {
            st = LOOM_ERR_OOM;
            goto done;
        }
        out->rounds[out->nrounds++] =
            (loom_pp_round){.step = mystep, .msg0 = m0, .nmsg = out->nmsgs - m0};
    }
    out->steps = me->steps;
    me->steps = NULL;
done:
    for (int r = 0; R && r < pp; r++) {
        free(R[r].steps);
        free(R[r].arrived);
        free(R[r].slot_of);
    }
    free(R);
    free(pend);
    free(busy);
    if (st) loom_pp_plan_free(out);
    return st;
}
