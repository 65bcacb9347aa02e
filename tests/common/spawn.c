/* --spawn N of the NCCL and Gloo test programs: starts N ranks of this
 * program with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
 * LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT free) and no MPI
 * launcher's, and waits for them. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../harness.h"

/* A port on 127.0.0.1 the system gave, its socket kept bound (not
 * listening, SO_REUSEADDR, close-on-exec) in *held: rank 0's listener binds
 * it all the same (the rendezvous sets SO_REUSEADDR too), while no other
 * bind to port 0 and no connect's ephemeral port can take it in between.
 * Close *held once the ranks are done. (Choosing a free port and closing
 * it left that gap: once, under other processes' connections, rank 0 found
 * it taken.) */
int loom_test_hold_port(int *held) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), one = 1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = 0;
    if (fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
        bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (!port && fd >= 0) {
        close(fd);
        fd = -1;
    }
    *held = fd;
    return port ? port : 29500 + (int)(getpid() % 1000);
}

int loom_test_free_port(void) {
    int fd = -1, port = loom_test_hold_port(&fd);
    if (fd >= 0) close(fd);
    return port;
}

void loom_test_rank_env(int rank, int n, int port) {
    static const char *const clear[] = {
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID",
        "SLURM_NTASKS", "SLURM_LOCALID", "MPI_LOCALRANKID"};
    for (size_t i = 0; i < sizeof clear / sizeof clear[0]; i++) unsetenv(clear[i]);
    char v[32];
    snprintf(v, sizeof v, "%d", rank);
    setenv("RANK", v, 1);
    setenv("LOCAL_RANK", v, 1);
    snprintf(v, sizeof v, "%d", n);
    setenv("WORLD_SIZE", v, 1);
    setenv("LOCAL_WORLD_SIZE", v, 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    snprintf(v, sizeof v, "%d", port);
    setenv("MASTER_PORT", v, 1);
}

int loom_test_spawn(int n, int argc, char **argv, const char *prog, const char *limit_var) {
    if (n < 1 || n > 1024) {
        fprintf(stderr, "--spawn N: N in 1..1024\n");
        return 2;
    }
    int held = -1, port = loom_test_hold_port(&held);
    printf("spawn: %d rank(s), MASTER_ADDR=127.0.0.1 MASTER_PORT=%d\n", n, port);
    fflush(stdout);
    pid_t *pids = calloc((size_t)n, sizeof *pids);
    int *codes = calloc((size_t)n, sizeof *codes);
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (!pids || !codes || !args) return 2;
    args[0] = (char *)prog;
    for (int i = 0; i < argc; i++) args[i + 1] = argv[i];
    for (int r = 0; r < n; r++) {
        pid_t p = fork();
        if (p < 0) {
            perror("fork");
            return 2;
        }
        if (p == 0) {
            loom_test_rank_env(r, n, port);
            execv("/proc/self/exe", args);
            perror("execv /proc/self/exe");
            _exit(127);
        }
        pids[r] = p;
    }
    /* wait; once a rank fails, give the others a grace period, then kill */
    const char *lim = getenv(limit_var);
    double limit_ms = (lim && *lim ? atof(lim) : 900.0) * 1e3, t0 = loom_test_now_ms(), kill_at = -1;
    int left = n, failed = 0;
    while (left > 0) {
        int status = 0;
        pid_t p = waitpid(-1, &status, WNOHANG);
        if (p > 0) {
            for (int r = 0; r < n; r++) {
                if (pids[r] != p) continue;
                codes[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                pids[r] = 0;
                left--;
                if (codes[r] != 0) {
                    failed++;
                    if (kill_at < 0) kill_at = loom_test_now_ms() + 20e3;
                }
            }
            continue;
        }
        double t = loom_test_now_ms();
        if ((kill_at >= 0 && t > kill_at) || t - t0 > limit_ms) {
            for (int r = 0; r < n; r++)
                if (pids[r] > 0) kill(pids[r], SIGKILL);
            kill_at = t + 1e9;
            limit_ms = 1e12;
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    for (int r = 0; r < n; r++)
        if (codes[r]) printf("spawn: rank %d exited with status %d\n", r, codes[r]);
    printf("spawn: %d of %d rank(s) succeeded\n", n - failed, n);
    if (held >= 0) close(held);
    free(pids);
    free(codes);
    free(args);
    return failed ? 1 : 0;
}
