/* `loom train|golden --nproc-per-node N`: this process becomes a small
 * torchrun. It starts N copies of itself on this host, one per GPU, each
 * told its place by the variables the NCCL backend reads (RANK, LOCAL_RANK,
 * WORLD_SIZE, MASTER_ADDR, MASTER_PORT; see "The NCCL backend" in
 * src/comm/comm.h), waits for them, and ends the job as a whole: the first
 * worker that fails takes the others down, and its status is the job's.
 *
 * Linux only (/proc/self/exe, /proc/self/cmdline, PR_SET_PDEATHSIG), like the
 * GPU builds it serves. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

#define LAUNCH_MAX_PROCS 1024
#define LAUNCH_GRACE_S 10.0 /* SIGTERM -> SIGKILL */
#define LAUNCH_POLL_NS (50 * 1000 * 1000)

/* Variables the launcher sets for each worker; inherited values are dropped. */
enum { V_RANK, V_LOCAL_RANK, V_WORLD_SIZE, V_LOCAL_WORLD_SIZE, V_GROUP_RANK, V_MASTER_ADDR,
       V_MASTER_PORT, V_LOOM_LAUNCHED, N_SET_VARS };
static const char *const set_vars[N_SET_VARS] = {
    [V_RANK] = "RANK", [V_LOCAL_RANK] = "LOCAL_RANK", [V_WORLD_SIZE] = "WORLD_SIZE",
    [V_LOCAL_WORLD_SIZE] = "LOCAL_WORLD_SIZE", [V_GROUP_RANK] = "GROUP_RANK",
    [V_MASTER_ADDR] = "MASTER_ADDR", [V_MASTER_PORT] = "MASTER_PORT",
    [V_LOOM_LAUNCHED] = "LOOM_LAUNCHED"};

/* Another launcher's rank variables, removed from the workers' environment:
 * under a one-task mpirun or srun step they would make every worker an MPI
 * rank 0 of 1 (the MPI bootstrap wins over RANK in the NCCL backend), and
 * OMPI_COMM_WORLD_LOCAL_SIZE would hide LOCAL_WORLD_SIZE from the thread
 * split in cli/job.c. */
static const char *const cleared_vars[] = {
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK", "PMI_SIZE", "PMI_RANK",
    "PMIX_RANK", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "MPI_LOCALRANKID"};
#define N_CLEARED_VARS (sizeof cleared_vars / sizeof cleared_vars[0])

/* ---- signals: recorded by the handler, acted on by the wait loop ---- */

static volatile sig_atomic_t pending_signal; /* the last SIGINT/SIGTERM received */
static volatile sig_atomic_t signal_count;   /* how many so far */

static void on_signal(int sig) {
    pending_signal = sig;
    signal_count++; /* both signals are blocked while either handler runs */
}

/* The dispositions before the launcher took over, restored at the end and
 * in each worker before exec (so a worker started with SIGINT ignored, as
 * under nohup, keeps ignoring it). */
typedef struct saved_signals {
    struct sigaction intr, term, chld;
} saved_signals;

static loom_status take_signals(loom_ctx *ctx, saved_signals *old) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    if (sigemptyset(&sa.sa_mask) || sigaddset(&sa.sa_mask, SIGINT) ||
        sigaddset(&sa.sa_mask, SIGTERM))
        return loom_errf(ctx, LOOM_ERR_IO, "sigset: %s", strerror(errno));
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    if (sigemptyset(&dfl.sa_mask))
        return loom_errf(ctx, LOOM_ERR_IO, "sigemptyset: %s", strerror(errno));
    pending_signal = 0;
    signal_count = 0;
    /* SIGCHLD ignored (inherited from whoever started us) would reap the
     * workers behind our back and lose their exit status */
    if (sigaction(SIGCHLD, &dfl, &old->chld) || sigaction(SIGINT, NULL, &old->intr) ||
        sigaction(SIGTERM, NULL, &old->term))
        return loom_errf(ctx, LOOM_ERR_IO, "sigaction: %s", strerror(errno));
    if ((old->intr.sa_handler != SIG_IGN && sigaction(SIGINT, &sa, NULL)) ||
        (old->term.sa_handler != SIG_IGN && sigaction(SIGTERM, &sa, NULL))) {
        int e = errno;
        sigaction(SIGCHLD, &old->chld, NULL);
        sigaction(SIGINT, &old->intr, NULL);
        return loom_errf(ctx, LOOM_ERR_IO, "sigaction: %s", strerror(e));
    }
    return LOOM_OK;
}

static void give_back_signals(const saved_signals *old) {
    /* restoring what sigaction handed us cannot fail */
    sigaction(SIGINT, &old->intr, NULL);
    sigaction(SIGTERM, &old->term, NULL);
    sigaction(SIGCHLD, &old->chld, NULL);
}

/* ---- the workers' environment ---- */

static bool env_name_is(const char *entry, const char *name) {
    size_t n = strlen(name);
    return strncmp(entry, name, n) == 0 && entry[n] == '=';
}

static bool env_dropped(const char *entry) {
    for (size_t i = 0; i < N_SET_VARS; i++)
        if (env_name_is(entry, set_vars[i])) return true;
    for (size_t i = 0; i < N_CLEARED_VARS; i++)
        if (env_name_is(entry, cleared_vars[i])) return true;
    return false;
}

/* The environment of one worker: this process's, less the dropped names,
 * plus the launcher's variables. `own` holds the strings made here, filled
 * per worker. */
typedef struct worker_env {
    char **envp;           /* kept entries, then N_SET_VARS of own, then NULL */
    size_t n_kept;
    char own[N_SET_VARS][64];
    char *master_addr;     /* "MASTER_ADDR=..." (any length) */
} worker_env;

static loom_status worker_env_init(loom_ctx *ctx, worker_env *w, int nproc, const char *addr,
                                   const char *port) {
    memset(w, 0, sizeof *w);
    size_t n = 0;
    for (char **e = environ; e && *e; e++) n++;
    w->envp = loom_calloc(ctx, n + N_SET_VARS + 1, sizeof *w->envp, "worker environment");
    size_t alen = strlen("MASTER_ADDR=") + strlen(addr) + 1;
    w->master_addr = w->envp ? loom_malloc(ctx, alen, "MASTER_ADDR") : NULL;
    if (!w->envp || !w->master_addr) {
        free(w->envp);
        w->envp = NULL;
        return LOOM_ERR_OOM;
    }
    for (char **e = environ; e && *e; e++)
        if (!env_dropped(*e)) w->envp[w->n_kept++] = *e;
    snprintf(w->master_addr, alen, "MASTER_ADDR=%s", addr);
    snprintf(w->own[V_WORLD_SIZE], sizeof w->own[0], "WORLD_SIZE=%d", nproc);
    snprintf(w->own[V_LOCAL_WORLD_SIZE], sizeof w->own[0], "LOCAL_WORLD_SIZE=%d", nproc);
    snprintf(w->own[V_GROUP_RANK], sizeof w->own[0], "GROUP_RANK=0"); /* one host */
    snprintf(w->own[V_MASTER_PORT], sizeof w->own[0], "MASTER_PORT=%s", port);
    snprintf(w->own[V_LOOM_LAUNCHED], sizeof w->own[0], "LOOM_LAUNCHED=1");
    for (size_t i = 0; i < N_SET_VARS; i++)
        w->envp[w->n_kept + i] = i == V_MASTER_ADDR ? w->master_addr : w->own[i];
    w->envp[w->n_kept + N_SET_VARS] = NULL;
    return LOOM_OK;
}

static void worker_env_set_rank(worker_env *w, int rank) {
    snprintf(w->own[V_RANK], sizeof w->own[0], "RANK=%d", rank);
    snprintf(w->own[V_LOCAL_RANK], sizeof w->own[0], "LOCAL_RANK=%d", rank);
}

static void worker_env_free(worker_env *w) {
    free(w->envp);
    free(w->master_addr);
    memset(w, 0, sizeof *w);
}

/* A TCP port nobody uses now, for rank 0's rendezvous. Probed on the
 * wildcard address, as rank 0 will listen: a port taken on any one address
 * would make that listen fail. Another program may still take it before
 * rank 0 binds; MASTER_PORT set by the user avoids the race. */
static loom_status free_port(loom_ctx *ctx, int *port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return loom_errf(ctx, LOOM_ERR_IO,
                         "cannot open a socket to find a free port for the workers' rendezvous "
                         "(%s); set MASTER_PORT to a free port",
                         strerror(errno));
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        int e = errno;
        (void)close(fd); /* nothing was sent: a failed close loses nothing */
        return loom_errf(ctx, LOOM_ERR_IO,
                         "cannot find a free TCP port for the workers' rendezvous (%s); set "
                         "MASTER_PORT to a free port",
                         strerror(e));
    }
    (void)close(fd);
    *port = ntohs(a.sin_port);
    return LOOM_OK;
}

/* ---- starting and watching the workers ---- */

/* Starts one worker. An exec that fails is reported here, with its reason,
 * through a close-on-exec pipe: the child writes errno into it only when
 * execve returns, and a successful exec closes it (EOF). Only
 * async-signal-safe calls run between fork and exec: everything the child
 * needs was built before fork. */
static loom_status start_worker(loom_ctx *ctx, const char *exe, char *const argv[],
                                char *const envp[], const saved_signals *old, int rank,
                                pid_t *out) {
    *out = 0;
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return loom_errf(ctx, LOOM_ERR_IO, "cannot start local rank %d: pipe: %s", rank,
                         strerror(errno));
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        (void)close(p[0]);
        (void)close(p[1]);
        return loom_errf(ctx, LOOM_ERR_IO, "cannot start local rank %d: fork: %s", rank,
                         strerror(e));
    }
    if (pid == 0) {
        sigaction(SIGINT, &old->intr, NULL);
        sigaction(SIGTERM, &old->term, NULL);
        sigaction(SIGCHLD, &old->chld, NULL);
        /* a launcher killed outright (SIGKILL, OOM killer) must not leave
         * workers holding GPUs; getppid catches a parent that died first */
        int e = 0;
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) != 0)
            e = errno;
        else if (getppid() != parent)
            e = ESRCH;
        if (!e) {
            execve(exe, argv, envp);
            e = errno;
        }
        ssize_t w = write(p[1], &e, sizeof e);
        (void)w; /* nothing else to tell the parent with; it sees status 127 */
        _exit(127);
    }
    (void)close(p[1]);
    int e = 0;
    ssize_t r;
    do
        r = read(p[0], &e, sizeof e);
    while (r < 0 && errno == EINTR);
    int read_errno = errno;
    (void)close(p[0]);
    if (r == 0) {
        *out = pid;
        return LOOM_OK;
    }
    /* exec failed (or the pipe did: then stop the child, whatever it is doing) */
    if (r != (ssize_t)sizeof e && kill(pid, SIGKILL) != 0 && errno != ESRCH)
        LOOM_LOG_W(ctx, "kill local rank %d: %s", rank, strerror(errno));
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
    }
    if (r == (ssize_t)sizeof e)
        return loom_errf(ctx, LOOM_ERR_IO, "cannot start local rank %d: %s: %s", rank, exe,
                         strerror(e));
    return loom_errf(ctx, LOOM_ERR_IO, "cannot start local rank %d: reading its start-up pipe: %s",
                     rank, r < 0 ? strerror(read_errno) : "short read");
}

static void signal_workers(loom_ctx *ctx, const pid_t *pids, int n, int sig) {
    for (int i = 0; i < n; i++)
        if (pids[i] > 0 && kill(pids[i], sig) != 0 && errno != ESRCH)
            LOOM_LOG_W(ctx, "cannot signal local rank %d (pid %ld): %s", i, (long)pids[i],
                       strerror(errno));
}

static int count_running(const pid_t *pids, int n) {
    int k = 0;
    for (int i = 0; i < n; i++) k += pids[i] > 0;
    return k;
}

/* Waits for every worker in pids (0: none in that slot). The first failure
 * (non-zero exit, death by a signal) sends SIGTERM to the rest, SIGKILL
 * LAUNCH_GRACE_S later; a SIGINT/SIGTERM received here is passed on the
 * same way, and a second one kills at once. `stop` starts that shutdown
 * from the beginning (a worker could not be started). Returns the job's
 * status: the first failure's (128 + signal for a death by a signal), else
 * 128 + the signal this process received, else 0. Every worker is reaped. */
static int supervise(loom_ctx *ctx, pid_t *pids, int n, bool stop) {
    int status = 0, received = 0;
    sig_atomic_t seen = 0;
    double deadline = -1;
    bool killed = false;
    if (stop) {
        signal_workers(ctx, pids, n, SIGTERM);
        deadline = loom_now_s() + LAUNCH_GRACE_S;
    }
    while (count_running(pids, n) > 0) {
        for (int i = 0; i < n; i++) {
            if (pids[i] <= 0) continue;
            int ws = 0;
            pid_t r = waitpid(pids[i], &ws, WNOHANG);
            if (r == 0 || (r < 0 && errno == EINTR)) continue;
            int code;
            char how[96];
            if (r < 0) { /* ECHILD: reaped elsewhere; its status is lost */
                code = 1;
                snprintf(how, sizeof how, "vanished (its status is lost: %s)", strerror(errno));
            } else if (WIFSIGNALED(ws)) {
                code = 128 + WTERMSIG(ws);
                snprintf(how, sizeof how, "was killed by signal %d (%s), status %d",
                         WTERMSIG(ws), strsignal(WTERMSIG(ws)), code);
            } else {
                code = WIFEXITED(ws) ? WEXITSTATUS(ws) : 1;
                snprintf(how, sizeof how, "exited with status %d", code);
            }
            pids[i] = 0;
            if (code == 0 || status != 0) continue;
            status = code;
            if (stop) continue; /* stopped by us after a failed start: said there */
            int left = count_running(pids, n);
            if (left && deadline < 0) {
                if (left == 1)
                    fprintf(stderr, "loom: error: local rank %d %s; stopping the other worker\n",
                            i, how);
                else
                    fprintf(stderr,
                            "loom: error: local rank %d %s; stopping the other %d workers\n", i,
                            how, left);
                signal_workers(ctx, pids, n, SIGTERM);
                deadline = loom_now_s() + LAUNCH_GRACE_S;
            } else {
                fprintf(stderr, "loom: error: local rank %d %s\n", i, how);
            }
        }
        int running = count_running(pids, n);
        if (!running) break;
        if (signal_count != seen) {
            seen = signal_count;
            int sig = pending_signal;
            if (!received) received = sig;
            if (deadline < 0) {
                fprintf(stderr, "loom: %s: passing it to the %d worker%s\n", strsignal(sig),
                        running, running == 1 ? "" : "s");
                signal_workers(ctx, pids, n, sig);
                deadline = loom_now_s() + LAUNCH_GRACE_S;
            } else if (!killed) {
                fprintf(stderr, "loom: %s while stopping: killing the %d worker%s now\n",
                        strsignal(sig), running, running == 1 ? "" : "s");
                signal_workers(ctx, pids, n, SIGKILL);
                killed = true;
            }
        }
        if (deadline >= 0 && !killed && loom_now_s() >= deadline) {
            fprintf(stderr, "loom: %d worker%s still running %.0f s after being told to stop: "
                            "killing\n",
                    running, running == 1 ? " is" : "s are", LAUNCH_GRACE_S);
            signal_workers(ctx, pids, n, SIGKILL);
            killed = true;
        }
        /* a signal cuts the nap short (EINTR), which is what we want */
        struct timespec ts = {0, LAUNCH_POLL_NS};
        nanosleep(&ts, NULL);
    }
    if (!status && received) status = 128 + received;
    return status;
}

int loom_launch_local(loom_ctx *ctx, int nproc, char *const argv[], const char *exe) {
    if (nproc < 1 || nproc > LAUNCH_MAX_PROCS) {
        loom_errf(ctx, LOOM_ERR_INVALID_ARG, "--nproc-per-node %d: give 1 to %d workers", nproc,
                  LAUNCH_MAX_PROCS);
        return -1;
    }
    if (!argv || !argv[0] || !exe || !*exe) {
        loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_launch_local: no program to start");
        return -1;
    }
    const char *addr = getenv("MASTER_ADDR");
    if (!addr || !*addr) addr = "127.0.0.1";
    char port[32];
    const char *p = getenv("MASTER_PORT");
    if (p && *p) {
        /* the workers check it (a number in 1..65535); here only its length */
        if (strlen(p) >= 16) {
            loom_errf(ctx, LOOM_ERR_CONFIG, "MASTER_PORT='%s' is not a port (1-65535)", p);
            return -1;
        }
        snprintf(port, sizeof port, "%s", p);
    } else {
        int free_p = 0;
        if (free_port(ctx, &free_p)) return -1;
        snprintf(port, sizeof port, "%d", free_p);
    }
    worker_env w;
    if (worker_env_init(ctx, &w, nproc, addr, port)) return -1;
    pid_t *pids = loom_calloc(ctx, (size_t)nproc, sizeof *pids, "worker ids");
    saved_signals old;
    if (!pids || take_signals(ctx, &old)) {
        free(pids);
        worker_env_free(&w);
        return -1;
    }
    LOOM_LOG_I(ctx, "starting %d worker%s on this host (MASTER_ADDR=%s MASTER_PORT=%s): %s",
               nproc, nproc == 1 ? "" : "s", addr, port, exe);
    /* what is buffered now must not come out once per worker */
    fflush(stdout);
    fflush(stderr);
    loom_status st = LOOM_OK;
    for (int i = 0; i < nproc && !st; i++) {
        worker_env_set_rank(&w, i);
        st = start_worker(ctx, exe, argv, w.envp, &old, i, &pids[i]);
    }
    int rc;
    if (st) {
        /* the message of the failed start is the one to keep */
        char msg[LOOM_ERR_MAX];
        snprintf(msg, sizeof msg, "%s", loom_last_error(ctx));
        supervise(ctx, pids, nproc, true);
        loom_errf(ctx, st, "%s", msg);
        rc = -1;
    } else {
        rc = supervise(ctx, pids, nproc, false);
    }
    give_back_signals(&old);
    free(pids);
    worker_env_free(&w);
    return rc;
}

/* ---- the hook of train and golden ---- */

static bool env_set(const char *name) {
    const char *v = getenv(name);
    return v && *v;
}

/* A launcher that started more than one task of this command. srun sets
 * SLURM_STEP_NUM_TASKS for its tasks; SLURM_NTASKS alone is the allocation's
 * count, also set in an sbatch script, which runs once and may launch. */
static const char *outer_launcher(long *tasks) {
    static const char *const vars[] = {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                       "SLURM_STEP_NUM_TASKS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (!v || !*v) continue;
        char *end;
        errno = 0;
        long x = strtol(v, &end, 10);
        if (!errno && !*end && x > 1) {
            *tasks = x;
            return vars[i];
        }
    }
    return NULL;
}

/* This process's arguments as main() received them, from /proc/self/cmdline
 * (NUL-separated): the commands are handed parsed settings, not argv.
 * *buf holds the strings, *args the NULL-terminated array; caller frees both. */
static loom_status own_arguments(loom_ctx *ctx, char **buf, char ***args) {
    *buf = NULL;
    *args = NULL;
    const char *path = "/proc/self/cmdline";
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return loom_errf(ctx, LOOM_ERR_IO, "%s: %s (the workers get this process's arguments)",
                         path, strerror(errno));
    loom_sb sb;
    loom_sb_init(&sb);
    char chunk[4096];
    for (;;) {
        ssize_t r = read(fd, chunk, sizeof chunk);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            (void)close(fd);
            loom_sb_free(&sb);
            return loom_errf(ctx, LOOM_ERR_IO, "%s: %s", path, strerror(e));
        }
        if (r == 0) break;
        loom_sb_append(&sb, chunk, (size_t)r);
    }
    (void)close(fd); /* read-only */
    if (sb.failed) {
        loom_sb_free(&sb);
        return loom_errf(ctx, LOOM_ERR_OOM, "out of memory reading %s", path);
    }
    size_t len = sb.len;
    char *b = loom_sb_take(&sb); /* NUL-terminated, so a last argument is closed too */
    if (!b || len == 0) {
        free(b);
        return loom_errf(ctx, LOOM_ERR_IO, "%s is empty", path);
    }
    if (b[len - 1] != '\0') len++; /* the terminator the buffer already has */
    size_t n = 0;
    for (size_t i = 0; i < len; i++) n += b[i] == '\0';
    char **a = loom_calloc(ctx, n + 1, sizeof *a, "arguments");
    if (!a) {
        free(b);
        return LOOM_ERR_OOM;
    }
    size_t k = 0;
    for (size_t i = 0; i < len; i += strlen(b + i) + 1) a[k++] = b + i;
    a[k] = NULL;
    *buf = b;
    *args = a;
    return LOOM_OK;
}

/* The path of the running binary. */
static loom_status own_exe(loom_ctx *ctx, char *exe, size_t cap) {
    ssize_t r = readlink("/proc/self/exe", exe, cap - 1);
    if (r < 0)
        return loom_errf(ctx, LOOM_ERR_IO, "readlink /proc/self/exe: %s (the workers run this "
                                           "binary)",
                         strerror(errno));
    if ((size_t)r >= cap - 1)
        return loom_errf(ctx, LOOM_ERR_IO, "the path of this binary is longer than %zu bytes",
                         cap - 2);
    exe[r] = '\0';
    return LOOM_OK;
}

int loom_cli_maybe_launch(loom_ctx *ctx, const loom_settings *s, bool *launched) {
    *launched = false;
    if (s->nproc_per_node <= 0 || env_set("LOOM_LAUNCHED")) return 0;
    *launched = true;
    int n = (int)s->nproc_per_node;
    char *argbuf = NULL, **args = NULL;
    if (own_arguments(ctx, &argbuf, &args)) return loom_cli_fail(ctx);
    const char *cmd = args[0] && args[1] ? args[1] : "train";
    int rc = 1;
    long tasks = 0;
    const char *outer = outer_launcher(&tasks);
    char exe[PATH_MAX];
    if (outer) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "--nproc-per-node starts the workers itself; it cannot be used inside "
                  "mpirun/torchrun/srun (%s=%ld here: this is one of %ld tasks already): drop "
                  "the flag or the launcher",
                  outer, tasks, tasks);
        goto fail;
    }
    if (!strcmp(s->device, "cpu")) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "--nproc-per-node starts GPU workers (one per GPU, talking over NCCL), and "
                  "--device cpu asks for CPU ranks: those run under mpirun (MPI) or under "
                  "torchrun/srun (Gloo, no MPI needed), as `mpirun -np %d loom "
                  "%s ...` without --nproc-per-node",
                  n, cmd);
        goto fail;
    }
#ifndef LOOM_HAVE_CUDA
    loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
              "--nproc-per-node starts GPU workers (one per GPU, talking over NCCL), but this "
              "loom was built without CUDA: rebuild with `make CUDA=1`, or run CPU ranks under "
              "mpirun or torchrun, as `mpirun -np %d loom %s ...` without --nproc-per-node",
              n, cmd);
    goto fail;
#else
    {
        /* counting GPUs initialises the CUDA driver here but makes no
         * context, so this process holds no GPU memory while it waits */
        loom_cuda_info info;
        loom_status qs = loom_cuda_query(ctx, 0, &info);
        const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
        char vis[300];
        if (cvd)
            snprintf(vis, sizeof vis, "CUDA_VISIBLE_DEVICES=%s", cvd);
        else
            snprintf(vis, sizeof vis, "CUDA_VISIBLE_DEVICES is not set");
        if (info.device_count <= 0) {
            char why[LOOM_ERR_MAX];
            snprintf(why, sizeof why, "%s", qs ? loom_last_error(ctx) : "device count is 0");
            loom_errf(ctx, LOOM_ERR_DEVICE,
                      "--nproc-per-node %d starts one worker per GPU, but no GPU is visible "
                      "(%s; %s): check nvidia-smi and CUDA_VISIBLE_DEVICES, or run CPU ranks "
                      "under mpirun or torchrun, as `mpirun -np %d loom %s ...` without "
                      "--nproc-per-node",
                      n, why, vis, n, cmd);
            goto fail;
        }
        if (info.device_count < n) {
            loom_errf(ctx, LOOM_ERR_CONFIG,
                      "--nproc-per-node %d needs %d GPUs; this host has %d visible (%s): give "
                      "--nproc-per-node %d or fewer, or make more GPUs visible",
                      n, n, info.device_count, vis, info.device_count);
            goto fail;
        }
    }
#endif
    if (own_exe(ctx, exe, sizeof exe)) goto fail;
    rc = loom_launch_local(ctx, n, args, exe);
    if (rc < 0) goto fail;
    free(args);
    free(argbuf);
    return rc;
fail:
    free(args);
    free(argbuf);
    return loom_cli_fail(ctx);
}
