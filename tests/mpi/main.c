/* Runner of the MPI tests (see mpi_harness.h). Arguments are substrings:
 * only tests whose name contains one of them run. The verdicts are agreed
 * with plain MPI on MPI_COMM_WORLD, independent of the code under test. */

#include <mpi.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>
#include <time.h>

#include "mpi_harness.h"

#define MAX_TESTS 1024

static struct {
    const char *name, *file;
    loom_test_fn fn;
} tests[MAX_TESTS];
static int n_tests;
static int n_fail_in_test;
static const char *current;
static jmp_buf skip_jump;
static loom_comm *world;
static loom_ctx *ctx;
bool loom_test_abort;

loom_comm *mt_world(void) { return world; }
loom_ctx *mt_ctx(void) { return ctx; }
int mt_rank(void) { return loom_comm_rank(world); }
int mt_size(void) { return loom_comm_size(world); }

void loom_test_register(const char *name, const char *file, loom_test_fn fn) {
    if (n_tests >= MAX_TESTS) {
        fprintf(stderr, "too many tests\n");
        exit(2);
    }
    tests[n_tests].name = name;
    tests[n_tests].file = file;
    tests[n_tests].fn = fn;
    n_tests++;
}

void loom_test_fail(const char *file, int line, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "    [rank %d/%d] %s: %s:%d: %s\n", mt_rank(), mt_size(), current, file,
            line, msg);
    fflush(stderr);
    n_fail_in_test++;
}

void loom_test_skip(const char *reason) {
    if (mt_rank() == 0) fprintf(stderr, "    skipped: %s\n", reason);
    longjmp(skip_jump, 1);
}

const char *loom_test_fixtures(void) {
    const char *e = getenv("LOOM_FIXTURES");
    if (e && *e) return e;
    return loom_dir_exists("../shared/fixtures") || !loom_dir_exists("shared/fixtures")
               ? "../shared/fixtures"
               : "shared/fixtures";
}

static bool selected(const char *name, int argc, char **argv) {
    if (argc <= 1) return true;
    for (int i = 1; i < argc; i++)
        if (strstr(name, argv[i])) return true;
    return false;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
    if (loom_ctx_create(&ctx) != LOOM_OK) return 2;
    if (loom_comm_world(ctx, LOOM_COMM_AUTO, &world) != LOOM_OK) {
        fprintf(stderr, "loom_comm_world: %s\n", loom_last_error(ctx));
        return 2;
    }
    if (strcmp(loom_comm_backend_name(world), "mpi") != 0) {
        fprintf(stderr, "loom_mpi_tests: the world backend is '%s', not mpi: run under mpirun\n",
                loom_comm_backend_name(world));
        loom_comm_free(world);
        loom_ctx_free(ctx);
        return 2;
    }
    int rank = mt_rank(), size = mt_size();
    int passed = 0, failed = 0, skipped = 0;
    int *flags = calloc((size_t)size, sizeof *flags);
    for (int i = 0; i < n_tests; i++) {
        if (!selected(tests[i].name, argc, argv)) continue;
        current = tests[i].name;
        n_fail_in_test = 0;
        loom_test_abort = false;
        loom_clear_error(ctx);
        double t0 = now_ms();
        int skip = 0;
        if (setjmp(skip_jump) == 0)
            tests[i].fn();
        else
            skip = 1;
        fflush(stdout);
        fflush(stderr);
        int mine = n_fail_in_test ? 1 : 0, any_skip = 0;
        MPI_Gather(&mine, 1, MPI_INT, flags, 1, MPI_INT, 0, MPI_COMM_WORLD);
        MPI_Allreduce(&skip, &any_skip, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        int n_bad = 0;
        MPI_Allreduce(&mine, &n_bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (n_bad)
            failed++;
        else if (any_skip)
            skipped++;
        else
            passed++;
        if (rank == 0) {
            char who[256] = "";
            if (n_bad) {
                int len = snprintf(who, sizeof who, "  failed on rank");
                for (int r = 0; r < size && len < (int)sizeof who - 8; r++)
                    if (flags[r]) len += snprintf(who + len, sizeof who - (size_t)len, " %d", r);
            }
            printf("%s %-44s %8.1f ms  (np %d, %s)%s\n",
                   n_bad ? "FAIL" : any_skip ? "skip" : "ok  ", tests[i].name, now_ms() - t0,
                   size, tests[i].file, who);
            fflush(stdout);
        }
    }
    free(flags);
    if (rank == 0) {
        if (skipped)
            printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
        else
            printf("%d passed, %d failed\n", passed, failed);
        fflush(stdout);
    }
    loom_comm_free(world); /* finalises MPI: loom initialised it */
    loom_ctx_free(ctx);
    return failed ? 1 : 0;
}
