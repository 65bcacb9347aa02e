/* The Gloo world's start (src/comm/comm_gloo.cc) when it cannot happen:
 * every error names the rank, the address and port, and the variables they
 * came from, within the timeout. The collectives themselves are tested by
 * tests/gloo (make test-gloo), on ranks started together. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../src/comm/comm.h"
#include "harness.h"

/* torchrun's variables for `rank` of 2 on 127.0.0.1:port, 1 s to meet. */
static void two_ranks(int rank, int port) {
    loom_test_rank_env(rank, 2, port);
    unsetenv("LOOM_COMM_BACKEND");
    setenv("LOOM_COMM_TIMEOUT", "1", 1);
}

TEST(comm_gloo_world_errors) {
#ifndef LOOM_HAVE_GLOO
    SKIP("loom was built without Gloo (apt-get install libgloo-dev)");
#endif
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_comm *w = NULL;
    char want[200];
    int port = loom_test_free_port();
    /* nobody listens on MASTER_PORT */
    two_ranks(1, port);
    double t0 = loom_now_s();
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_AUTO, &w), LOOM_ERR_COMM);
    CHECK(w == NULL);
    CHECK_MSG(loom_now_s() - t0 < 5, "gave up after %.1f s", loom_now_s() - t0);
    snprintf(want, sizeof want, "Gloo world (rank 1 of 2 from RANK): rendezvous: rank 1 could not "
             "connect to rank 0 at 127.0.0.1:%d (MASTER_ADDR:MASTER_PORT) within 1 s", port);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    /* MASTER_ADDR that does not resolve, or missing */
    setenv("MASTER_ADDR", "no-such-host.invalid", 1);
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_GLOO, &w), LOOM_ERR_COMM);
    CHECK_CONTAINS(loom_last_error(ctx), "cannot resolve MASTER_ADDR 'no-such-host.invalid'");
    unsetenv("MASTER_ADDR");
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_GLOO, &w), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "rank 1 of 2 needs MASTER_ADDR");
    /* MASTER_PORT that is not a port */
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "99999", 1);
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_AUTO, &w), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "MASTER_PORT='99999' is not a port");
    /* rank 0: its port is taken, or rank 1 never comes */
    two_ranks(0, port);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons((uint16_t)port);
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 4) == 0) {
        CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_GLOO, &w), LOOM_ERR_COMM);
        snprintf(want, sizeof want, "rank 0 cannot listen on port %d (MASTER_PORT)", port);
        CHECK_CONTAINS(loom_last_error(ctx), want);
    }
    if (fd >= 0) close(fd);
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_GLOO, &w), LOOM_ERR_COMM);
    CHECK_CONTAINS(loom_last_error(ctx), "heard from 1 of 2 ranks within 1 s; missing: 1");
    /* one rank: no rendezvous at all */
    loom_test_rank_env(0, 1, port);
    CHECK_OK(ctx, loom_comm_world(ctx, LOOM_COMM_GLOO, &w));
    if (w) {
        CHECK_STR(loom_comm_backend_name(w), "gloo");
        CHECK_EQ_INT(loom_comm_size(w), 1);
        uint16_t h = 0;
        CHECK_EQ_INT(loom_comm_allreduce(w, &h, 1, LOOM_BF16, LOOM_RED_SUM), LOOM_ERR_UNSUPPORTED);
        loom_comm_free(w);
    }
    loom_ctx_free(ctx);
}
