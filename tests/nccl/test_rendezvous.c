/* Without a GPU (--cpu): the launcher variables, the TCP rendezvous between
 * forked processes (ranks, local ranks, the id, a rank that cannot take
 * part, errors that name the address) and what loom_comm_world(NCCL) says
 * on a machine without a GPU. */

#include <arpa/inet.h>
#include <cuda_runtime_api.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "nccl_harness.h"

static const char *const launch_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "MPI_LOCALRANKID", "MASTER_ADDR", "MASTER_PORT", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"};
#define N_VARS (sizeof launch_vars / sizeof launch_vars[0])

static void clear_launch_env(void) {
    for (size_t i = 0; i < N_VARS; i++) unsetenv(launch_vars[i]);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Exit code of a child; 128+signal when it died. */
static int wait_child(pid_t p) {
    int status = 0;
    if (waitpid(p, &status, 0) != p) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

TEST(cpu_launch_env) {
    char *saved[N_VARS];
    for (size_t i = 0; i < N_VARS; i++) {
        const char *v = getenv(launch_vars[i]);
        saved[i] = v ? strdup(v) : NULL;
    }
    loom_ctx *ctx = nt_ctx();
    loom_launch l;

    clear_launch_env();
    CHECK_OK(ctx, loom_launch_from_env(ctx, &l));
    CHECK_EQ_INT(l.rank, 0);
    CHECK_EQ_INT(l.size, 1);
    CHECK_EQ_INT(l.local_rank, -1);
    CHECK_EQ_INT(l.port, 29500);
    CHECK_STR(l.addr, "");
    CHECK(l.rank_var == NULL);

    setenv("RANK", "1", 1);
    setenv("WORLD_SIZE", "4", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("MASTER_ADDR", "node7", 1);
    setenv("MASTER_PORT", "1234", 1);
    setenv("OMPI_COMM_WORLD_RANK", "3", 1); /* RANK/WORLD_SIZE come first */
    setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
    CHECK_OK(ctx, loom_launch_from_env(ctx, &l));
    CHECK_EQ_INT(l.rank, 1);
    CHECK_EQ_INT(l.size, 4);
    CHECK_EQ_INT(l.local_rank, 1);
    CHECK_STR(l.local_var, "LOCAL_RANK");
    CHECK_STR(l.rank_var, "RANK");
    CHECK_STR(l.addr, "node7");
    CHECK_EQ_INT(l.port, 1234);

    clear_launch_env();
    setenv("OMPI_COMM_WORLD_RANK", "2", 1);
    setenv("OMPI_COMM_WORLD_SIZE", "3", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
    CHECK_OK(ctx, loom_launch_from_env(ctx, &l));
    CHECK_EQ_INT(l.rank, 2);
    CHECK_EQ_INT(l.size, 3);
    CHECK_EQ_INT(l.local_rank, 0);
    CHECK_STR(l.rank_var, "OMPI_COMM_WORLD_RANK");
    CHECK_STR(l.local_var, "OMPI_COMM_WORLD_LOCAL_RANK");

    clear_launch_env();
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_NTASKS", "6", 1);
    setenv("SLURM_LOCALID", "1", 1);
    CHECK_OK(ctx, loom_launch_from_env(ctx, &l));
    CHECK_EQ_INT(l.rank, 5);
    CHECK_EQ_INT(l.size, 6);
    CHECK_EQ_INT(l.local_rank, 1);
    CHECK_STR(l.rank_var, "SLURM_PROCID");

    clear_launch_env();
    setenv("RANK", "1", 1);
    CHECK_EQ_INT(loom_launch_from_env(ctx, &l), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "RANK is set but WORLD_SIZE is not");
    setenv("WORLD_SIZE", "1", 1);
    CHECK_EQ_INT(loom_launch_from_env(ctx, &l), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "RANK=1 is not below WORLD_SIZE=1");
    setenv("WORLD_SIZE", "two", 1);
    CHECK_EQ_INT(loom_launch_from_env(ctx, &l), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "WORLD_SIZE='two'");
    setenv("WORLD_SIZE", "2", 1);
    setenv("MASTER_PORT", "70000", 1);
    CHECK_EQ_INT(loom_launch_from_env(ctx, &l), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "MASTER_PORT='70000'");
    unsetenv("MASTER_PORT");
    setenv("LOCAL_RANK", "-1", 1);
    CHECK_EQ_INT(loom_launch_from_env(ctx, &l), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "LOCAL_RANK='-1'");

    clear_launch_env();
    for (size_t i = 0; i < N_VARS; i++) {
        if (saved[i]) setenv(launch_vars[i], saved[i], 1);
        free(saved[i]);
    }
}

/* Children exit 0 when their rendezvous ended as expected. */
static int rdv_child(int port, int rank, int size, bool ok, int bad_rank) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 10;
    unsigned char blob[128];
    for (int i = 0; i < 128; i++) blob[i] = rank == 0 ? (unsigned char)(i * 7 + 3) : 0;
    int lr = -1, ls = -1;
    loom_status st = loom_rendezvous(ctx, "127.0.0.1", port, rank, size, 20.0, ok,
                                     ok ? "" : "no GPU here", blob, sizeof blob, &lr, &ls);
    int rc = 0;
    if (bad_rank < 0) {
        if (st != LOOM_OK) {
            fprintf(stderr, "rank %d: %s\n", rank, loom_last_error(ctx));
            rc = 1;
        }
        for (int i = 0; i < 128 && !rc; i++)
            if (blob[i] != (unsigned char)(i * 7 + 3)) rc = 2;
        if (!rc && (lr != rank || ls != size)) rc = 3; /* one host: local rank = rank */
    } else {
        char want[64];
        snprintf(want, sizeof want, "rank %d cannot take part: no GPU here", bad_rank);
        if (st != LOOM_ERR_COMM || !strstr(loom_last_error(ctx), want)) {
            fprintf(stderr, "rank %d: status %d: %s\n", rank, (int)st, loom_last_error(ctx));
            rc = 4;
        }
    }
    loom_ctx_free(ctx);
    return rc;
}

static void run_ranks(int size, int bad_rank) {
    int port = loom_test_free_port();
    REQUIRE(port > 0);
    pid_t *p = calloc((size_t)size, sizeof *p);
    REQUIRE(p);
    /* the others first: they retry until rank 0 listens */
    for (int r = size - 1; r >= 0; r--) {
        p[r] = fork();
        if (p[r] == 0) _exit(rdv_child(port, r, size, r != bad_rank, bad_rank));
    }
    for (int r = 0; r < size; r++) {
        int rc = wait_child(p[r]);
        CHECK_MSG(rc == 0, "rank %d of %d (bad rank %d) exited with %d", r, size, bad_rank, rc);
    }
    free(p);
}

TEST(cpu_rendezvous) {
    run_ranks(2, -1);
    run_ranks(5, -1);
    /* a rank that cannot take part: everyone fails naming it */
    run_ranks(3, 2);
    run_ranks(3, 0);
}

TEST(cpu_rendezvous_errors) {
    loom_ctx *ctx = nt_ctx();
    int lr, ls;
    unsigned char id[16] = {0};
    /* nobody listens: the error names the address and the variables */
    int port = loom_test_free_port();
    double t0 = now_s();
    CHECK_EQ_INT(loom_rendezvous(ctx, "127.0.0.1", port, 1, 2, 0.5, true, "", id, sizeof id, &lr,
                                 &ls),
                 LOOM_ERR_COMM);
    char want[128];
    snprintf(want, sizeof want, "rank 1 could not connect to rank 0 at 127.0.0.1:%d "
             "(MASTER_ADDR:MASTER_PORT) within 0.5 s", port);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    CHECK(now_s() - t0 < 5.0);
    /* no address */
    CHECK_EQ_INT(loom_rendezvous(ctx, "", port, 1, 2, 0.5, true, "", id, sizeof id, &lr, &ls),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "needs MASTER_ADDR");
    /* a name that does not resolve */
    CHECK_EQ_INT(loom_rendezvous(ctx, "no-such-host.invalid", port, 1, 2, 0.5, true, "", id,
                                 sizeof id, &lr, &ls),
                 LOOM_ERR_COMM);
    CHECK_CONTAINS(loom_last_error(ctx), "cannot resolve MASTER_ADDR 'no-such-host.invalid'");

    /* rank 2 of 3 never comes: rank 0 says who is missing, rank 1 loses rank 0 */
    port = loom_test_free_port();
    pid_t c = fork();
    if (c == 0) {
        loom_ctx *cc = NULL;
        loom_ctx_create(&cc);
        unsigned char b[16];
        int a, z;
        loom_status st = loom_rendezvous(cc, "127.0.0.1", port, 1, 3, 20.0, true, "", b,
                                         sizeof b, &a, &z);
        _exit(st == LOOM_ERR_COMM && strstr(loom_last_error(cc), "lost its connection") ? 0 : 1);
    }
    CHECK_EQ_INT(loom_rendezvous(ctx, "127.0.0.1", port, 0, 3, 1.0, true, "", id, sizeof id, &lr,
                                 &ls),
                 LOOM_ERR_COMM);
    snprintf(want, sizeof want, "rank 0 listening on port %d (MASTER_PORT) heard from 2 of 3 "
             "ranks within 1 s; missing: 2", port);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    CHECK_EQ_INT(wait_child(c), 0);

    /* world sizes that disagree */
    port = loom_test_free_port();
    c = fork();
    if (c == 0) {
        loom_ctx *cc = NULL;
        loom_ctx_create(&cc);
        unsigned char b[16];
        int a, z;
        loom_status st = loom_rendezvous(cc, "127.0.0.1", port, 1, 3, 20.0, true, "", b,
                                         sizeof b, &a, &z);
        _exit(st == LOOM_ERR_COMM ? 0 : 1);
    }
    CHECK_EQ_INT(loom_rendezvous(ctx, "127.0.0.1", port, 0, 2, 20.0, true, "", id, sizeof id,
                                 &lr, &ls),
                 LOOM_ERR_COMM);
    CHECK_CONTAINS(loom_last_error(ctx), "rank 1 was started with a world size of 3, rank 0 "
                                         "with 2");
    CHECK_EQ_INT(wait_child(c), 0);

    /* the port is taken */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t alen = sizeof a;
    REQUIRE(fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && listen(fd, 1) == 0 &&
            getsockname(fd, (struct sockaddr *)&a, &alen) == 0);
    port = ntohs(a.sin_port);
    CHECK_EQ_INT(loom_rendezvous(ctx, "127.0.0.1", port, 0, 2, 0.5, true, "", id, sizeof id, &lr,
                                 &ls),
                 LOOM_ERR_COMM);
    snprintf(want, sizeof want, "rank 0 cannot listen on port %d (MASTER_PORT)", port);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    close(fd);
}

/* In a child (CUDA and the environment stay untouched here): exit 0 when
 * loom_comm_world(NCCL) failed as expected. */
static int world_child(int expect_status, const char *expect_msg) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 10;
    loom_comm *w = NULL;
    loom_status st = loom_comm_world(ctx, LOOM_COMM_NCCL, &w);
    int rc = 0;
    if ((int)st != expect_status || !strstr(loom_last_error(ctx), expect_msg)) {
        fprintf(stderr, "    [pid %d] loom_comm_world(NCCL): %s: %s (expected %s: '%s')\n",
                (int)getpid(), loom_status_str(st), loom_last_error(ctx),
                loom_status_str((loom_status)expect_status), expect_msg);
        rc = 1;
    }
    const char *nv = getenv("NCCL_NVLS_ENABLE");
    if (!nv || strcmp(nv, "0") != 0) {
        fprintf(stderr, "    NCCL_NVLS_ENABLE is '%s', not 0\n", nv ? nv : "(unset)");
        rc = 1;
    }
    loom_comm_free(w);
    loom_ctx_free(ctx);
    return rc;
}

TEST(cpu_nccl_world_without_gpu) {
    pid_t c = fork();
    if (c == 0) {
        int n = 0;
        _exit(cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? 77 : 0);
    }
    int rc = wait_child(c);
    if (rc == 77) SKIP("a GPU is visible: the world tests cover this machine");
    CHECK_EQ_INT(rc, 0);

    /* one rank */
    c = fork();
    if (c == 0) {
        clear_launch_env();
        unsetenv("NCCL_NVLS_ENABLE");
        _exit(world_child(LOOM_ERR_DEVICE, "NCCL world: no CUDA device is visible"));
    }
    CHECK_EQ_INT(wait_child(c), 0);
    /* two ranks without MASTER_ADDR */
    c = fork();
    if (c == 0) {
        clear_launch_env();
        setenv("RANK", "1", 1);
        setenv("WORLD_SIZE", "2", 1);
        _exit(world_child(LOOM_ERR_CONFIG, "but MASTER_ADDR is not set"));
    }
    CHECK_EQ_INT(wait_child(c), 0);
    /* two ranks through the rendezvous: both fail, naming rank 0 */
    int port = loom_test_free_port();
    pid_t p[2];
    for (int r = 1; r >= 0; r--) {
        p[r] = fork();
        if (p[r] == 0) {
            char v[16];
            clear_launch_env();
            snprintf(v, sizeof v, "%d", r);
            setenv("RANK", v, 1);
            setenv("WORLD_SIZE", "2", 1);
            setenv("MASTER_ADDR", "localhost", 1);
            snprintf(v, sizeof v, "%d", port);
            setenv("MASTER_PORT", v, 1);
            setenv("LOOM_COMM_TIMEOUT", "20", 1);
            _exit(world_child(LOOM_ERR_COMM, "rank 0 cannot take part: no CUDA device"));
        }
    }
    for (int r = 0; r < 2; r++) CHECK_EQ_INT(wait_child(p[r]), 0);
}
