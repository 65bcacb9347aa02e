/* Pipeline schedules and their messages. Every rank's plan is played
 * together under the strictest matching the backends have (NCCL's: a send
 * and a receive between two ranks match by order, not by tag, and a group
 * returns only when every operation in it has met its peer): the plans must
 * complete without deadlock, each message must land where the step that
 * reads it looks, each (virtual stage, micro-batch) must run forward once
 * after its input arrived and backward once after its output gradient
 * arrived, and 1F1B must keep at most pp - rank micro-batches in flight. */
#include <stdlib.h>

#include "../src/parallel/schedule.h"
#include "harness.h"

enum { MAXR = 8, MAXV = 24, MAXMB = 64 };

typedef struct posted {
    int rank, msg; /* index into that rank's plan.msgs */
    bool matched;
} posted;

/* A directed pair's queue of posted sends or receives, in posting order. */
typedef struct fifo {
    posted q[4 * MAXV * MAXMB];
    int n, head;
} fifo;

static fifo sends[MAXR][MAXR], recvs[MAXR][MAXR];

typedef struct msg_id {
    bool set, forward;
    int chunk, mb; /* receiving chunk */
} msg_id;

static bool play(int pp, int vpp, int group, int n_micro, bool backward, char *why, size_t cap) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_pp_shape shape = {.pp = pp, .vpp = vpp, .group = group, .n_micro = n_micro};
    loom_pp_plan pl[MAXR];
    int round[MAXR] = {0}, nposted[MAXR] = {0};
    bool in_group[MAXR] = {false}, ok = true;
    static msg_id slot[MAXR][4 * MAXV * MAXMB];
    static int fdone[MAXV][MAXMB], bdone[MAXV][MAXMB], fwd_live[MAXR][MAXV];
    memset(slot, 0, sizeof slot);
    memset(fdone, 0, sizeof fdone);
    memset(bdone, 0, sizeof bdone);
    memset(fwd_live, 0, sizeof fwd_live);
    memset(sends, 0, sizeof sends);
    memset(recvs, 0, sizeof recvs);
    const int V = pp * vpp;
    for (int r = 0; r < pp; r++)
        if (loom_pp_plan_build(ctx, &shape, r, backward, &pl[r])) {
            snprintf(why, cap, "rank %d: %s", r, loom_last_error(ctx));
            for (int q = 0; q < r; q++) loom_pp_plan_free(&pl[q]);
            loom_ctx_free(ctx);
            return false;
        }
#define FAIL(...)                                                                        \
    do {                                                                                 \
        if (ok) snprintf(why, cap, __VA_ARGS__);                                         \
        ok = false;                                                                      \
    } while (0)
    bool progress = true;
    while (progress && ok) {
        progress = false;
        for (int r = 0; r < pp && ok; r++) {
            loom_pp_plan *p = &pl[r];
            if (round[r] == p->nrounds) continue;
            const loom_pp_round *rd = &p->rounds[round[r]];
            if (!in_group[r]) { /* run the step, then post the group */
                if (rd->step >= 0) {
                    const loom_pp_step sp = p->steps[rd->step];
                    const int v = sp.chunk * pp + r, mb = sp.mb, s = p->in_slot[rd->step];
                    const bool needs = sp.forward ? v > 0 : v < V - 1;
                    if (needs != (s >= 0)) FAIL("rank %d step %d: input slot %d", r, rd->step, s);
                    if (s >= 0) {
                        msg_id *m = &slot[r][s];
                        if (!m->set || m->forward != sp.forward || m->chunk != sp.chunk ||
                            m->mb != mb)
                            FAIL("rank %d: %s of chunk %d mb %d reads slot %d holding %s%d/%d",
                                 r, sp.forward ? "forward" : "backward", sp.chunk, mb, s,
                                 m->set ? (m->forward ? "F" : "B") : "nothing ", m->chunk, m->mb);
                        m->set = false;
                    }
                    if (sp.forward) {
                        if (fdone[v][mb]++) FAIL("stage %d mb %d forward twice", v, mb);
                        if (v > 0 && !fdone[v - 1][mb]) FAIL("stage %d mb %d early", v, mb);
                        if (++fwd_live[r][sp.chunk] > p->in_flight)
                            FAIL("rank %d chunk %d: more than %d in flight", r, sp.chunk,
                                 p->in_flight);
                        if (!backward) fwd_live[r][sp.chunk]--; /* forward-only frees at once */
                    } else {
                        if (bdone[v][mb]++) FAIL("stage %d mb %d backward twice", v, mb);
                        if (!fdone[v][mb] || (v < V - 1 && !bdone[v + 1][mb]))
                            FAIL("stage %d mb %d backward early", v, mb);
                        fwd_live[r][sp.chunk]--;
                    }
                }
                for (int i = 0; i < rd->nmsg; i++) {
                    const loom_pp_msg *g = &p->msgs[rd->msg0 + i];
                    if (g->peer < 0 || g->peer >= pp || g->peer == r)
                        FAIL("rank %d: message to rank %d", r, g->peer);
                    else if (g->send)
                        sends[r][g->peer].q[sends[r][g->peer].n++] = (posted){r, rd->msg0 + i, 0};
                    else
                        recvs[g->peer][r].q[recvs[g->peer][r].n++] = (posted){r, rd->msg0 + i, 0};
                    nposted[r]++;
                }
                in_group[r] = true;
                progress = true;
            }
            /* match what both ends of each pair have posted, in order */
            for (int a = 0; a < pp; a++)
                for (int b = 0; b < pp; b++) {
                    fifo *S = &sends[a][b], *R = &recvs[a][b];
                    while (S->head < S->n && R->head < R->n) {
                        const loom_pp_msg *gs = &pl[a].msgs[S->q[S->head].msg];
                        const loom_pp_msg *gr = &pl[b].msgs[R->q[R->head].msg];
                        if (gs->forward != gr->forward || gs->chunk != gr->chunk ||
                            gs->mb != gr->mb)
                            FAIL("rank %d -> %d: sent %c%d/%d is received as %c%d/%d", a, b,
                                 gs->forward ? 'F' : 'B', gs->chunk, gs->mb,
                                 gr->forward ? 'F' : 'B', gr->chunk, gr->mb);
                        if (slot[b][gr->slot].set) FAIL("rank %d: slot %d overwritten", b, gr->slot);
                        if (gr->slot < 0 || gr->slot >= pl[b].nslots)
                            FAIL("rank %d: slot %d of %d", b, gr->slot, pl[b].nslots);
                        else
                            slot[b][gr->slot] = (msg_id){true, gr->forward, gr->chunk, gr->mb};
                        nposted[a]--;
                        nposted[b]--;
                        S->head++;
                        R->head++;
                        progress = true;
                    }
                }
            if (in_group[r] && nposted[r] == 0) { /* the group completed */
                in_group[r] = false;
                round[r]++;
                progress = true;
            }
        }
    }
    for (int r = 0; r < pp && ok; r++) {
        if (round[r] != pl[r].nrounds)
            FAIL("deadlock: rank %d stuck in round %d of %d", r, round[r], pl[r].nrounds);
        if (pl[r].nsteps != (backward ? 2 : 1) * n_micro * vpp)
            FAIL("rank %d: %d steps", r, pl[r].nsteps);
        if (backward && vpp == 1 && pl[r].in_flight > pp - r)
            FAIL("rank %d: %d in flight", r, pl[r].in_flight);
    }
    for (int v = 0; v < V && ok; v++)
        for (int mb = 0; mb < n_micro; mb++)
            if (fdone[v][mb] != 1 || bdone[v][mb] != (backward ? 1 : 0))
                FAIL("stage %d mb %d: %d forwards, %d backwards", v, mb, fdone[v][mb], bdone[v][mb]);
#undef FAIL
    for (int r = 0; r < pp; r++) loom_pp_plan_free(&pl[r]);
    loom_ctx_free(ctx);
    return ok;
}

/* Every shape Megatron accepts, pp 1..6, vpp 1..4, micro-batches 1..4*pp
 * (and more), every group size; forward-only too. */
TEST(schedule_plans_complete_without_deadlock) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    int played = 0;
    char why[256];
    for (int pp = 1; pp <= 6; pp++)
        for (int vpp = 1; vpp <= 4; vpp++)
            for (int n_micro = 1; n_micro <= 4 * pp + 3 && n_micro <= MAXMB; n_micro++)
                for (int group = 0; group <= (vpp > 1 ? n_micro : 0); group++) {
                    loom_pp_shape s = {.pp = pp, .vpp = vpp, .group = group, .n_micro = n_micro};
                    if (loom_pp_check(ctx, &s)) continue;
                    for (int bw = 0; bw < 2; bw++) {
                        why[0] = 0;
                        CHECK_MSG(play(pp, vpp, group, n_micro, bw, why, sizeof why),
                                  "pp=%d vpp=%d group=%d n_micro=%d%s: %s", pp, vpp, group, n_micro,
                                  bw ? "" : " forward-only", why);
                        played++;
                    }
                }
    CHECK_MSG(played > 1000, "only %d plans played", played);
    loom_ctx_free(ctx);
}

TEST(schedule_1f1b_shape) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_pp_step *s;
    int n;
    /* pp=4, rank 1, 6 micro-batches: 2 warm-up forwards, then F B pairs */
    REQUIRE_OK(ctx, loom_pp_schedule(ctx, &(loom_pp_shape){.pp = 4, .vpp = 1, .n_micro = 6}, 1,
                                     true, &s, &n));
    const char *want = "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5";
    char got[128] = "";
    for (int i = 0; i < n; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%c%d", i ? " " : "",
                 s[i].forward ? 'F' : 'B', s[i].mb);
    CHECK_STR(got, want);
    free(s);
    loom_ctx_free(ctx);
}

/* Megatron's order with groups: PP2, vpp 2, 5 micro-batches in groups of 3
 * (its own example: micro-batches 0 1 2 0 1 2 3 4 3 4, chunks 0 0 0 1 1 1
 * 0 0 1 1), rank 0: warm-up (2-0-1)*2 + (2-1)*3 = 5 forwards. */
TEST(schedule_interleaved_groups) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_pp_step *s;
    int n;
    REQUIRE_OK(ctx,
               loom_pp_schedule(ctx, &(loom_pp_shape){.pp = 2, .vpp = 2, .group = 3, .n_micro = 5},
                                0, true, &s, &n));
    char got[256] = "";
    for (int i = 0; i < n; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%c%d.%d", i ? " " : "",
                 s[i].forward ? 'F' : 'B', s[i].chunk, s[i].mb);
    CHECK_STR(got, "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 F0.3 B1.1 F0.4 B1.2 F1.3 B0.0 F1.4 B0.1 "
                   "B0.2 B1.3 B1.4 B0.3 B0.4");
    free(s);
    loom_ctx_free(ctx);
}

/* The rules, each refused with its numbers. */
TEST(schedule_refuses_what_megatron_refuses) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    static const struct {
        int pp, vpp, group, n_micro;
        const char *want;
    } bad[] = {
        {2, 2, 0, 3, "3 micro-batches in groups of 2 leave a last group of 1, fewer than pp=2"},
        {2, 2, 0, 1, "needs at least 2 micro-batches"},
        {4, 2, 0, 6, "last group of 2, fewer than pp=4"},
        {3, 2, 2, 6, "must be at least pp=3"},
        {2, 3, 5, 4, "needs at least 5 micro-batches"},
        {2, 2, 3, 7, "last group of 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        loom_pp_shape s = {
            .pp = bad[i].pp, .vpp = bad[i].vpp, .group = bad[i].group, .n_micro = bad[i].n_micro};
        CHECK_MSG(loom_pp_check(ctx, &s) == LOOM_ERR_CONFIG, "case %zu accepted", i);
        CHECK_CONTAINS(loom_last_error(ctx), bad[i].want);
    }
    /* accepted: multiples of the group, or a last group of at least pp */
    static const int good[][4] = {{2, 2, 0, 4}, {2, 2, 3, 5}, {3, 2, 4, 7}, {2, 3, 2, 6}, {4, 1, 0, 3}};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        loom_pp_shape s = {
            .pp = good[i][0], .vpp = good[i][1], .group = good[i][2], .n_micro = good[i][3]};
        CHECK_OK(ctx, loom_pp_check(ctx, &s));
    }
    loom_ctx_free(ctx);
}
