/* `--nproc-per-node N` (cli/launch.c): the local launcher with /bin/sh as the
 * worker (every rank once, its variables, the first failure ending the job,
 * death by a signal, SIGTERM passed on, no fd or child left behind), and the
 * loom command refusing the flag where it cannot work (--device cpu, a CPU
 * build or no GPU, inside another launcher), quickly and with a message.
 *
 * The launcher lives in cli/, which the test binary does not link (only
 * libloom.a): it is compiled into this file instead, with the one cli/
 * function it calls. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../cli/launch.c"
#include "harness.h"

int loom_cli_fail(loom_ctx *ctx) {
    fprintf(stderr, "loom: error: %s\n", loom_last_error(ctx));
    return 1;
}

#define RUN(out, ...) loom_test_run(out, (const char *const[]){loom_test_bin(), __VA_ARGS__, NULL})

static int open_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (de->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* True when this process has no child left (reaped or not). */
static bool no_children(void) {
    return waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD;
}

static void unset_launcher_vars(void) {
    static const char *const vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                       "MASTER_ADDR", "MASTER_PORT", "LOOM_LAUNCHED",
                                       "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                       "SLURM_STEP_NUM_TASKS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) unsetenv(vars[i]);
}

/* Runs `script` under /bin/sh as nproc workers; $1 is "arg1". */
static int launch_sh(loom_ctx *ctx, int nproc, const char *script) {
    char *const argv[] = {"sh", "-c", (char *)script, "sh", "arg1", NULL};
    return loom_launch_local(ctx, nproc, argv, "/bin/sh");
}

static char *read_text(const char *path) {
    char *data = NULL;
    size_t len;
    if (loom_read_file(NULL, path, 0, &data, &len) != LOOM_OK) return NULL;
    return data;
}

TEST(launch_every_rank_once_with_its_variables) {
    unset_launcher_vars();
    setenv("OMPI_COMM_WORLD_SIZE", "1", 1); /* another launcher's variable: not passed on */
    setenv("LOCAL_RANK", "7", 1);           /* replaced */
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    int fds = open_fds();
    char script[1024];
    snprintf(script, sizeof script,
             "echo \"$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR "
             "$MASTER_PORT $LOOM_LAUNCHED ${OMPI_COMM_WORLD_SIZE-unset} $1\" >> %s/out.$RANK",
             loom_test_tmpdir());
    int rc = launch_sh(ctx, 3, script);
    CHECK_MSG(rc == 0, "rc %d: %s", rc, loom_last_error(ctx));
    long port = -1;
    for (int r = 0; r < 4; r++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/out.%d", loom_test_tmpdir(), r);
        char *text = read_text(path);
        if (r == 3) {
            CHECK_MSG(!text, "a fourth worker ran");
            free(text);
            continue;
        }
        CHECK_MSG(text, "rank %d did not run", r);
        if (!text) continue;
        CHECK_MSG(strchr(text, '\n') == text + strlen(text) - 1, "rank %d ran more than once: %s",
                  r, text);
        int rank = -1, local = -1, ws = -1, lws = -1, group = -1, launched = -1;
        char addr[64] = "", ompi[16] = "", arg[16] = "";
        long p = -1;
        int got = sscanf(text, "%d %d %d %d %d %63s %ld %d %15s %15s", &rank, &local, &ws, &lws,
                         &group, addr, &p, &launched, ompi, arg);
        CHECK_MSG(got == 10, "rank %d wrote '%s'", r, text);
        CHECK_EQ_INT(rank, r);
        CHECK_EQ_INT(local, r);
        CHECK_EQ_INT(ws, 3);
        CHECK_EQ_INT(lws, 3);
        CHECK_EQ_INT(group, 0);
        CHECK_STR(addr, "127.0.0.1");
        CHECK_MSG(p >= 1 && p <= 65535, "MASTER_PORT %ld", p);
        if (r == 0) port = p;
        CHECK_EQ_INT(p, port);
        CHECK_EQ_INT(launched, 1);
        CHECK_STR(ompi, "unset");
        CHECK_STR(arg, "arg1");
        free(text);
    }
    CHECK_EQ_INT(open_fds(), fds);
    CHECK(no_children());
    loom_ctx_free(ctx);
}

TEST(launch_keeps_master_addr_and_port) {
    unset_launcher_vars();
    setenv("MASTER_ADDR", "10.1.2.3", 1);
    setenv("MASTER_PORT", "23456", 1);
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    char script[1024];
    snprintf(script, sizeof script, "echo \"$MASTER_ADDR $MASTER_PORT\" > %s/m.$RANK",
             loom_test_tmpdir());
    CHECK_EQ_INT(launch_sh(ctx, 2, script), 0);
    for (int r = 0; r < 2; r++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/m.%d", loom_test_tmpdir(), r);
        char *text = read_text(path);
        CHECK_STR(text, "10.1.2.3 23456\n");
        free(text);
    }
    loom_ctx_free(ctx);
}

/* Rank 0 fails at once while rank 1 would sleep a minute: the job ends with
 * rank 0's status within seconds, the sleeper killed and reaped. */
TEST(launch_first_failure_stops_the_others) {
    unset_launcher_vars();
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    int fds = open_fds();
    char script[2200], pidfile[1024];
    snprintf(pidfile, sizeof pidfile, "%s/sleeper.pid", loom_test_tmpdir());
    snprintf(script, sizeof script,
             "if [ \"$RANK\" = 0 ]; then sleep 0.3; exit 3; fi; echo $$ > %s; exec sleep 60",
             pidfile);
    double t0 = loom_now_s();
    int rc = launch_sh(ctx, 2, script);
    double took = loom_now_s() - t0;
    CHECK_EQ_INT(rc, 3);
    CHECK_MSG(took < 5, "took %.1f s", took);
    char *text = read_text(pidfile);
    CHECK_MSG(text, "the sleeper did not start");
    if (text) {
        pid_t pid = (pid_t)atol(text);
        CHECK_MSG(pid > 0 && kill(pid, 0) != 0 && errno == ESRCH, "sleeper %ld still exists",
                  (long)pid);
    }
    free(text);
    CHECK_EQ_INT(open_fds(), fds);
    CHECK(no_children());

    /* every worker fails: still the first failure's status */
    rc = launch_sh(ctx, 3, "exit $((RANK + 5))");
    CHECK_MSG(rc >= 5 && rc <= 7, "rc %d", rc);
    CHECK(no_children());
    loom_ctx_free(ctx);
}

TEST(launch_death_by_signal_is_128_plus_signal) {
    unset_launcher_vars();
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    double t0 = loom_now_s();
    int rc = launch_sh(ctx, 2, "if [ \"$RANK\" = 1 ]; then kill -KILL $$; fi; exec sleep 60");
    CHECK_EQ_INT(rc, 128 + SIGKILL);
    CHECK_MSG(loom_now_s() - t0 < 5, "took %.1f s", loom_now_s() - t0);
    CHECK_EQ_INT(launch_sh(ctx, 1, "kill -USR1 $$; sleep 5"), 128 + SIGUSR1);
    CHECK(no_children());
    loom_ctx_free(ctx);
}

TEST(launch_exec_failure_is_an_error) {
    unset_launcher_vars();
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    int fds = open_fds();
    char *const argv[] = {"loom", "train", NULL};
    CHECK_EQ_INT(loom_launch_local(ctx, 2, argv, "/nonexistent/loom"), -1);
    CHECK_CONTAINS(loom_last_error(ctx), "cannot start local rank 0");
    CHECK_CONTAINS(loom_last_error(ctx), "/nonexistent/loom");
    CHECK_CONTAINS(loom_last_error(ctx), strerror(ENOENT));
    CHECK_EQ_INT(loom_launch_local(ctx, 0, argv, "/bin/sh"), -1);
    CHECK_CONTAINS(loom_last_error(ctx), "1 to 1024");
    CHECK_EQ_INT(open_fds(), fds);
    CHECK(no_children());
    loom_ctx_free(ctx);
}

/* SIGTERM to the launcher reaches the workers, and the launcher returns
 * 128 + SIGTERM once they are gone. The launcher runs in a child process
 * here, so that the test can signal it. */
TEST(launch_passes_sigterm_on) {
    unset_launcher_vars();
    char script[1024];
    snprintf(script, sizeof script, "echo $$ > %s/p.$RANK.tmp && mv %s/p.$RANK.tmp %s/p.$RANK "
             "&& exec sleep 60",
             loom_test_tmpdir(), loom_test_tmpdir(), loom_test_tmpdir());
    fflush(stdout);
    fflush(stderr);
    pid_t launcher = fork();
    REQUIRE(launcher >= 0);
    if (launcher == 0) {
        loom_ctx *ctx;
        if (loom_ctx_create(&ctx) != LOOM_OK) _exit(99);
        loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
        int rc = launch_sh(ctx, 2, script);
        _exit(rc < 0 ? 98 : rc);
    }
    pid_t workers[2] = {0, 0};
    for (double t0 = loom_now_s(); loom_now_s() - t0 < 10 && !(workers[0] && workers[1]);) {
        for (int r = 0; r < 2; r++) {
            char path[1024];
            snprintf(path, sizeof path, "%s/p.%d", loom_test_tmpdir(), r);
            char *text = workers[r] ? NULL : read_text(path);
            if (text) workers[r] = (pid_t)atol(text);
            free(text);
        }
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    CHECK_MSG(workers[0] > 0 && workers[1] > 0, "the workers did not start");
    CHECK(kill(launcher, SIGTERM) == 0);
    int status = 0;
    pid_t r = 0;
    for (double t0 = loom_now_s(); loom_now_s() - t0 < 5 && r == 0;) {
        r = waitpid(launcher, &status, WNOHANG);
        struct timespec ts = {0, 20 * 1000 * 1000};
        if (r == 0) nanosleep(&ts, NULL);
    }
    if (r == 0) {
        loom_test_fail(__FILE__, __LINE__, "the launcher is still running 5 s after SIGTERM");
        kill(launcher, SIGKILL);
        waitpid(launcher, &status, 0);
        for (int i = 0; i < 2; i++)
            if (workers[i] > 0) kill(workers[i], SIGKILL);
        return;
    }
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM,
              "launcher status 0x%x (want exit %d)", status, 128 + SIGTERM);
    for (int i = 0; i < 2; i++)
        CHECK_MSG(workers[i] <= 0 || (kill(workers[i], 0) != 0 && errno == ESRCH),
                  "worker %d (pid %ld) is still there", i, (long)workers[i]);
}

TEST(launch_own_arguments_and_outer_launcher) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char *buf = NULL, **args = NULL;
    REQUIRE_OK(ctx, own_arguments(ctx, &buf, &args));
    CHECK(args[0] && strstr(args[0], "loom_tests"));
    free(args);
    free(buf);
    char exe[PATH_MAX];
    CHECK_OK(ctx, own_exe(ctx, exe, sizeof exe));
    CHECK(strstr(exe, "loom_tests") != NULL);

    unset_launcher_vars();
    long tasks = 0;
    CHECK(outer_launcher(&tasks) == NULL);
    setenv("WORLD_SIZE", "1", 1); /* torchrun --nproc-per-node 1: one task, allowed */
    setenv("SLURM_NTASKS", "8", 1); /* an sbatch script: runs once, allowed */
    CHECK(outer_launcher(&tasks) == NULL);
    setenv("SLURM_STEP_NUM_TASKS", "4", 1);
    CHECK_STR(outer_launcher(&tasks), "SLURM_STEP_NUM_TASKS");
    CHECK_EQ_INT(tasks, 4);
    setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
    CHECK_STR(outer_launcher(&tasks), "OMPI_COMM_WORLD_SIZE");
    loom_ctx_free(ctx);
}

/* The hook itself: nothing to do without the flag or inside a worker. */
TEST(launch_hook_in_process) {
    unset_launcher_vars();
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_settings s;
    REQUIRE_OK(ctx, loom_settings_init(ctx, &s));
    bool launched = true;
    CHECK_EQ_INT(loom_cli_maybe_launch(ctx, &s, &launched), 0);
    CHECK(!launched);
    s.nproc_per_node = 2;
    setenv("LOOM_LAUNCHED", "1", 1);
    launched = true;
    CHECK_EQ_INT(loom_cli_maybe_launch(ctx, &s, &launched), 0);
    CHECK(!launched);
    unsetenv("LOOM_LAUNCHED");
    free(s.device);
    s.device = loom_strdup(ctx, "cpu");
    CHECK_EQ_INT(loom_cli_maybe_launch(ctx, &s, &launched), 1);
    CHECK(launched);
    CHECK_CONTAINS(loom_last_error(ctx), "--device cpu");
    CHECK(no_children());
    loom_settings_free(&s);
    loom_ctx_free(ctx);
}

/* ---- the loom command ---- */

static void check_quick_refusal(const char *what, int rc, const char *out, double took,
                                const char *needle) {
    CHECK_MSG(rc == 1, "%s: exit %d: %s", what, rc, out ? out : "");
    CHECK_MSG(out && strstr(out, needle), "%s: no '%s' in: %s", what, needle, out ? out : "");
    CHECK_MSG(!out || !strstr(out, "nonexistent"), "%s: read its input: %s", what, out);
    CHECK_MSG(took < 10, "%s took %.1f s", what, took);
}

TEST(launch_cli_refuses_cpu_ranks) {
    unset_launcher_vars();
    char *out = NULL;
    double t0 = loom_now_s();
    int rc = RUN(&out, "train", "--nproc-per-node", "2", "--device", "cpu", "--model",
                 "/nonexistent-model", "--data", "/nonexistent.tokens");
    check_quick_refusal("train --device cpu", rc, out, loom_now_s() - t0,
                        "mpirun -np 2 loom train");
    CHECK_CONTAINS(out, "--device cpu");
    free(out);
    t0 = loom_now_s();
    rc = RUN(&out, "golden", "--nproc-per-node", "2", "--device", "cpu", "--model",
             "/nonexistent-model", "--batch", "/nonexistent.safetensors", "--out",
             "/nonexistent-out.safetensors");
    check_quick_refusal("golden --device cpu", rc, out, loom_now_s() - t0,
                        "mpirun -np 2 loom golden");
    free(out);
}

TEST(launch_cli_needs_cuda_and_gpus) {
    unset_launcher_vars();
    char *out = NULL;
    double t0 = loom_now_s();
#ifdef LOOM_HAVE_CUDA
    /* more GPUs than any host has: refused with or without GPUs here */
    int rc = RUN(&out, "train", "--nproc-per-node", "1024", "--model", "/nonexistent-model",
                 "--data", "/nonexistent.tokens");
    check_quick_refusal("train (CUDA build)", rc, out, loom_now_s() - t0, "--nproc-per-node 1024");
    CHECK_MSG(out && (strstr(out, "no GPU is visible") || strstr(out, "needs 1024 GPUs")), "%s",
              out ? out : "");
    CHECK_CONTAINS(out, "CUDA_VISIBLE_DEVICES");
#else
    int rc = RUN(&out, "train", "--nproc-per-node", "2", "--model", "/nonexistent-model",
                 "--data", "/nonexistent.tokens");
    check_quick_refusal("train (CPU build)", rc, out, loom_now_s() - t0, "built without CUDA");
    CHECK_CONTAINS(out, "make CUDA=1");
    CHECK_CONTAINS(out, "mpirun -np 2 loom train");
#endif
    free(out);
}

TEST(launch_cli_refused_inside_a_launcher) {
    unset_launcher_vars();
    setenv("RANK", "0", 1);
    setenv("WORLD_SIZE", "2", 1);
    char *out = NULL;
    double t0 = loom_now_s();
    int rc = RUN(&out, "train", "--nproc-per-node", "2", "--model", "/nonexistent-model",
                 "--data", "/nonexistent.tokens");
    check_quick_refusal("train under torchrun", rc, out, loom_now_s() - t0,
                        "cannot be used inside mpirun/torchrun/srun");
    CHECK_CONTAINS(out, "WORLD_SIZE=2");
    CHECK_CONTAINS(out, "drop the flag or the launcher");
    free(out);
}

/* A worker (LOOM_LAUNCHED set) ignores the flag and runs the command: here
 * it gets as far as the missing model. */
TEST(launch_cli_worker_does_not_launch_again) {
    unset_launcher_vars();
    setenv("LOOM_LAUNCHED", "1", 1);
    char *out = NULL;
    int rc = RUN(&out, "train", "--nproc-per-node", "2", "--device", "cpu", "--model",
                 "/nonexistent-model", "--data", "/nonexistent.tokens", "--log-level", "warn");
    CHECK_MSG(rc == 1, "exit %d: %s", rc, out ? out : "");
    CHECK_CONTAINS(out, "nonexistent-model");
    CHECK_MSG(out && !strstr(out, "--nproc-per-node"), "%s", out ? out : "");
    free(out);
}
