/* What the three test programs share (tests/main.c, tests/mpi/main.c,
 * tests/nccl/main.c): the registry TEST() fills, the selection by name
 * substrings, the clock, the fixtures' place and the closing line. The two
 * that run every test in process on every rank add tests/common/ranks.c. */
#include <stdlib.h>
#include <time.h>

#include "../harness.h"

#define MAX_TESTS 4096

static loom_test_entry tests[MAX_TESTS];
static int n_tests;

void loom_test_register(const char *name, const char *file, loom_test_fn fn) {
    if (n_tests >= MAX_TESTS) {
        fprintf(stderr, "too many tests\n");
        exit(2);
    }
    tests[n_tests++] = (loom_test_entry){name, file, fn};
}

int loom_test_count(void) { return n_tests; }
const loom_test_entry *loom_test_at(int i) { return &tests[i]; }

bool loom_test_selected(const char *name, int nargs, char *const *args) {
    if (nargs <= 0) return true;
    for (int i = 0; i < nargs; i++)
        if (strstr(name, args[i])) return true;
    return false;
}

double loom_test_now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

const char *loom_test_fixtures(void) {
    const char *e = getenv("LOOM_FIXTURES");
    if (e && *e) return e;
    /* the repository's copy (tools/sync_fixtures.sh); tests run from its root */
    return "tests/fixtures";
}

const char *loom_test_fixtures_of(const char *model) {
    static char moe[1024];
    if (!model || strcmp(model, "tiny-qwen2-moe")) return loom_test_fixtures();
    snprintf(moe, sizeof moe, "%s_moe", loom_test_fixtures());
    return moe;
}

void loom_test_summary(int passed, int failed, int skipped) {
    if (skipped)
        printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
    else
        printf("%d passed, %d failed\n", passed, failed);
    fflush(stdout);
}
