/* The MPI and NCCL test programs run every test in process, in the same
 * order on every rank (tests/mpi/mpi_harness.h): a failure prints with its
 * rank and test, a skip jumps back to the runner, and after the ranks agree
 * on the verdict (each program through its own group) rank 0 prints it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdlib.h>

#include "../harness.h"

static int (*rank_of)(void), (*size_of)(void);
static const char *current;
static int n_fail_in_test;
static jmp_buf skip_jump;
bool loom_test_abort;

void loom_ranks_init(int (*rank)(void), int (*size)(void)) {
    rank_of = rank;
    size_of = size;
}

void loom_test_fail(const char *file, int line, const char *fmt, ...) {
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "    [rank %d/%d] %s: %s:%d: %s\n", rank_of(), size_of(), current, file, line,
            msg);
    fflush(stderr);
    n_fail_in_test++;
}

void loom_test_skip(const char *reason) {
    if (rank_of() == 0) fprintf(stderr, "    skipped: %s\n", reason);
    longjmp(skip_jump, 1);
}

/* 1 when the test skipped (the setjmp is kept apart from the caller's loops). */
static int run_guarded(loom_test_fn fn) {
    if (setjmp(skip_jump) == 0) {
        fn();
        return 0;
    }
    return 1;
}

int loom_ranks_run(const loom_test_entry *t, bool *failed_here) {
    current = t->name;
    n_fail_in_test = 0;
    loom_test_abort = false;
    int skip = run_guarded(t->fn);
    fflush(stdout);
    fflush(stderr);
    *failed_here = n_fail_in_test != 0;
    return skip;
}

void loom_ranks_verdict(const loom_test_entry *t, double t0_ms, int n_bad, bool any_skip,
                        const int *failed, int stride) {
    const int size = size_of();
    char who[256] = "";
    if (n_bad) {
        int len = snprintf(who, sizeof who, "  failed on rank");
        for (int r = 0; r < size && len < (int)sizeof who - 8; r++)
            if (failed[r * stride]) len += snprintf(who + len, sizeof who - (size_t)len, " %d", r);
    }
    printf("%s %-44s %8.1f ms  (np %d, %s)%s\n", n_bad ? "FAIL" : any_skip ? "skip" : "ok  ",
           t->name, loom_test_now_ms() - t0_ms, size, t->file, who);
    fflush(stdout);
}
