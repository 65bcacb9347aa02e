/* What the Gloo backend does differently from MPI (src/comm/comm.h, "The
 * Gloo backend"): a timed-out wait breaks the group, a failed collective
 * names the members that are not in it, groups of one rank message
 * themselves, and AUTO picks Gloo under torchrun's variables. */
#include <stdlib.h>
#include <time.h>

#include "../mpi/mpi_harness.h"

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* A receive nobody sends times out naming peer and tag; the group is then
 * refused (Gloo closed its connections). */
TEST(gloo_recv_timeout) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    loom_comm *t = NULL;
    REQUIRE_OK(mt_ctx(), loom_comm_split(w, 0, rank, "slow", &t));
    int x = 0;
    if (size == 1) {
        /* the only peer is this rank, which sent nothing: refused at once */
        CHECK_EQ_INT(loom_comm_recv(t, &x, 1, LOOM_I32, 0, 77), LOOM_ERR_COMM);
        CHECK_CONTAINS(loom_last_error(mt_ctx()), "sent itself no such message");
    } else if (rank == 0) {
        loom_comm_set_timeout(t, 0.3);
        CHECK_EQ_INT(loom_comm_recv(t, &x, 1, LOOM_I32, size - 1, 77), LOOM_ERR_COMM);
        char want[128];
        snprintf(want, sizeof want, "recv from rank %d (tag 77) on group 'slow' (rank 0 of %d) "
                 "timed out after 0.3 s", size - 1, size);
        CHECK_CONTAINS(loom_last_error(mt_ctx()), want);
        CHECK_EQ_INT(loom_comm_barrier(t), LOOM_ERR_COMM);
        CHECK_CONTAINS(loom_last_error(mt_ctx()), "cannot be used after");
    }
    /* the others touch 'slow' no more: they wait here, then free it */
    CHECK_OK(mt_ctx(), loom_comm_barrier(w));
    loom_comm_free(t);
}

/* One member is late to a collective: the others give up after the timeout
 * naming it (its thread answers that it is not waiting on the group), and
 * its own call fails too once it comes. */
TEST(gloo_timeout_names_the_late_rank) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    if (size < 2) SKIP("needs 2 ranks");
    loom_comm *g = NULL;
    REQUIRE_OK(mt_ctx(), loom_comm_split(w, 0, rank, "stall", &g));
    loom_comm_set_timeout(g, 1.0);
    const int late = size - 1;
    if (rank == late) sleep_s(3.0);
    const double t0 = loom_now_s();
    float v = 1.f;
    CHECK_EQ_INT(loom_comm_allreduce(g, &v, 1, LOOM_F32, LOOM_RED_SUM), LOOM_ERR_COMM);
    const double took = loom_now_s() - t0;
    const char *e = loom_last_error(mt_ctx());
    CHECK_CONTAINS(e, "Gloo allreduce on group 'stall'");
    if (rank != late) {
        char want[160];
        snprintf(want, sizeof want, "rank %d of the group (world rank %d), which is not waiting "
                 "on this group", late, late);
        CHECK_CONTAINS(e, want);
        CHECK_MSG(took < 6, "gave up after %.1f s (timeout 1 s)", took);
    } else {
        CHECK_MSG(took < 4, "the late rank failed after %.1f s (timeout 1 s)", took);
    }
    CHECK_EQ_INT(loom_comm_barrier(g), LOOM_ERR_COMM);
    CHECK_OK(mt_ctx(), loom_comm_barrier(w));
    loom_comm_free(g);
}

/* Groups of one rank use no Gloo: collectives copy, messages to oneself
 * match by tag, in and out of group_start/end. */
TEST(gloo_groups_of_one) {
    loom_comm *w = mt_world();
    int rank = mt_rank();
    loom_comm *me = NULL;
    REQUIRE_OK(mt_ctx(), loom_comm_split(w, rank, 0, "self", &me));
    CHECK_EQ_INT(loom_comm_size(me), 1);
    int32_t a[3] = {1, 2, 3}, b[3] = {0, 0, 0};
    CHECK_OK(mt_ctx(), loom_comm_allgather(me, a, b, 3, LOOM_I32));
    CHECK(b[0] == 1 && b[2] == 3);
    CHECK_OK(mt_ctx(), loom_comm_send(me, a, 3, LOOM_I32, 0, 5));
    a[0] = 9; /* the send copied */
    CHECK_OK(mt_ctx(), loom_comm_send(me, a, 1, LOOM_I32, 0, 6));
    CHECK_OK(mt_ctx(), loom_comm_recv(me, b, 1, LOOM_I32, 0, 6));
    CHECK_EQ_INT(b[0], 9);
    CHECK_OK(mt_ctx(), loom_comm_recv(me, b, 3, LOOM_I32, 0, 5));
    CHECK(b[0] == 1 && b[1] == 2);
    CHECK_EQ_INT(loom_comm_recv(me, b, 2, LOOM_I32, 0, 5), LOOM_ERR_COMM);
    CHECK_OK(mt_ctx(), loom_comm_group_start(me));
    CHECK_OK(mt_ctx(), loom_comm_recv(me, b, 3, LOOM_I32, 0, 7));
    CHECK_OK(mt_ctx(), loom_comm_send(me, a, 3, LOOM_I32, 0, 7));
    CHECK_OK(mt_ctx(), loom_comm_group_end(me));
    CHECK(b[0] == 9 && b[1] == 2 && b[2] == 3);
    /* a size mismatch is an error, not a silent truncation */
    CHECK_OK(mt_ctx(), loom_comm_send(me, a, 3, LOOM_I32, 0, 8));
    CHECK_EQ_INT(loom_comm_recv(me, b, 2, LOOM_I32, 0, 8), LOOM_ERR_COMM);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), "another size");
    loom_comm_free(me);
}

/* AUTO is Gloo under torchrun's variables (no MPI launcher); a second world
 * meets on the same MASTER_PORT once the first has met. LOOM_COMM_BACKEND
 * overrides the choice, and a bad value is refused naming it. */
TEST(gloo_auto_and_override) {
    int size = mt_size(), rank = mt_rank();
    loom_ctx *ctx = NULL;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_comm *w2 = NULL;
    CHECK_OK(ctx, loom_comm_world(ctx, LOOM_COMM_AUTO, &w2));
    if (w2) {
        CHECK_STR(loom_comm_backend_name(w2), size > 1 ? "gloo" : "single");
        CHECK_EQ_INT(loom_comm_rank(w2), rank);
        CHECK_EQ_INT(loom_comm_size(w2), size);
        int64_t s = rank + 1;
        CHECK_OK(ctx, loom_comm_allreduce(w2, &s, 1, LOOM_I64, LOOM_RED_SUM));
        CHECK_EQ_INT(s, (int64_t)size * (size + 1) / 2);
        loom_comm_free(w2);
    }
    setenv("LOOM_COMM_BACKEND", "single", 1);
    w2 = NULL;
    CHECK_OK(ctx, loom_comm_world(ctx, LOOM_COMM_AUTO, &w2));
    if (w2) CHECK_STR(loom_comm_backend_name(w2), "single");
    loom_comm_free(w2);
    setenv("LOOM_COMM_BACKEND", "openmpi", 1);
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_AUTO, &w2), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "LOOM_COMM_BACKEND='openmpi': give mpi, gloo, single");
    unsetenv("LOOM_COMM_BACKEND");
    loom_ctx_free(ctx);
    CHECK_OK(mt_ctx(), loom_comm_barrier(mt_world()));
}
