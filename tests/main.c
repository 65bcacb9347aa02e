/* Test runner: runs every registered test in a child process (so a crash is
 * reported as a failure of that test, not of the run), prints failures, and
 * closes with "N passed, M failed". Arguments are substrings: only tests
 * whose name contains one of them run. */

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#ifdef LOOM_HAVE_CUDA
#include "../src/backend/cuda/cuda_backend.h"
#endif

static int n_fail_in_test;
static char tmpdir_path[512];
bool loom_test_abort;

void loom_test_fail(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "    %s:%d: ", file, line);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    n_fail_in_test++;
}

const char *loom_test_bin(void) {
    const char *e = getenv("LOOM_BIN");
    return e && *e ? e : "build/loom";
}

static void rm_rf(const char *path) {
    DIR *d = opendir(path);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            char sub[1024];
            snprintf(sub, sizeof sub, "%s/%s", path, de->d_name);
            rm_rf(sub);
        }
        closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

const char *loom_test_tmpdir(void) {
    if (!tmpdir_path[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(tmpdir_path, sizeof tmpdir_path, "%s/loom-test-XXXXXX",
                 base && *base ? base : "/tmp");
        if (!mkdtemp(tmpdir_path)) {
            perror("mkdtemp");
            exit(2);
        }
    }
    return tmpdir_path;
}

const char *loom_test_write(const char *name, const void *data, size_t len) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/%s", loom_test_tmpdir(), name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
    return path;
}

int loom_test_run(char **out, const char *const argv[]) {
    char path[1024];
    snprintf(path, sizeof path, "%s/cmd-out-XXXXXX", loom_test_tmpdir());
    int fd = mkstemp(path);
    if (fd < 0) return -1;
    pid_t pid = fork();
    if (pid < 0) return -1;
    if (pid == 0) {
        int nul = open("/dev/null", O_RDONLY);
        dup2(nul, 0);
        dup2(fd, 1);
        dup2(fd, 2);
        execvp(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    close(fd);
    if (out) {
        size_t len;
        if (loom_read_file(NULL, path, 0, out, &len) != LOOM_OK) *out = NULL;
    }
    unlink(path);
    if (WIFEXITED(status)) return WEXITSTATUS(status);
    if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
    return -1;
}

bool loom_test_have_gpu(void) {
#ifdef LOOM_HAVE_CUDA
    static int have = -1;
    if (have < 0) {
        loom_ctx *ctx = NULL;
        loom_cuda_info info;
        have = !loom_ctx_create(&ctx) && loom_cuda_query(ctx, 0, &info) == LOOM_OK;
        loom_ctx_free(ctx);
    }
    return have == 1;
#else
    return false;
#endif
}

void loom_test_skip(const char *reason) {
    fprintf(stderr, "    skipped: %s\n", reason);
    fflush(stdout);
    fflush(stderr);
    if (tmpdir_path[0]) rm_rf(tmpdir_path);
    _exit(77);
}

bool loom_test_have_mpirun(void) {
    char *out = NULL;
    int rc = loom_test_run(&out, (const char *const[]){"mpirun", "--version", NULL});
    free(out);
    return rc == 0;
}

void loom_test_mpi_env(void) {
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    setenv("OMPI_MCA_rmaps_base_oversubscribe", "1", 1);
    /* containers often forbid the cross-process memory copy OpenMPI tries */
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
    setenv("LOOM_COMM_TIMEOUT", "120", 1);
    const char *a = getenv("ASAN_OPTIONS");
    if (a && strstr(a, "detect_leaks=0")) return;
    char buf[512];
    snprintf(buf, sizeof buf, "%s%sdetect_leaks=0", a ? a : "", a && *a ? ":" : "");
    setenv("ASAN_OPTIONS", buf, 1);
}

int main(int argc, char **argv) {
    int passed = 0, failed = 0, skipped = 0;
    bool nofork = getenv("LOOM_TEST_NOFORK") != NULL;
    if (!loom_dir_exists(loom_test_fixtures()))
        fprintf(stderr,
                "warning: no fixtures at %s: tests that compare with Hugging Face will fail "
                "(run from the repository root, which has tests/fixtures, or set LOOM_FIXTURES)\n",
                loom_test_fixtures());
    for (int i = 0; i < loom_test_count(); i++) {
        const loom_test_entry *t = loom_test_at(i);
        if (!loom_test_selected(t->name, argc - 1, argv + 1)) continue;
        const double t0 = loom_test_now_ms();
        bool ok, skip = false;
        if (nofork) {
            n_fail_in_test = 0;
            loom_test_abort = false;
            t->fn();
            ok = n_fail_in_test == 0;
        } else {
            fflush(stdout);
            fflush(stderr);
            pid_t pid = fork();
            if (pid == 0) {
                n_fail_in_test = 0;
                tmpdir_path[0] = '\0';
                t->fn();
                if (tmpdir_path[0]) rm_rf(tmpdir_path);
                fflush(stdout);
                fflush(stderr);
                _exit(n_fail_in_test == 0 ? 0 : 1);
            }
            int status = 0;
            while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
            }
            ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
            skip = WIFEXITED(status) && WEXITSTATUS(status) == 77;
            if (WIFSIGNALED(status))
                fprintf(stderr, "    killed by signal %d\n", WTERMSIG(status));
            else if (WIFEXITED(status) && WEXITSTATUS(status) > 1 && !skip)
                fprintf(stderr, "    exited with status %d\n", WEXITSTATUS(status));
        }
        printf("%s %-48s %8.1f ms  (%s)\n", ok ? "ok  " : skip ? "skip" : "FAIL", t->name,
               loom_test_now_ms() - t0, t->file);
        fflush(stdout);
        if (ok)
            passed++;
        else if (skip)
            skipped++;
        else
            failed++;
    }
    if (tmpdir_path[0]) rm_rf(tmpdir_path);
    loom_test_summary(passed, failed, skipped);
    return failed ? 1 : 0;
}
