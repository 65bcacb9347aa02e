/* A tiny test harness: TEST(name) { ... } registers a test; CHECK* record a
 * failure with file:line and keep going; REQUIRE* stop the test. The runner
 * (tests/main.c) prints one line per failure and the closing line
 * "N passed, M failed". */
#ifndef LOOM_TEST_HARNESS_H
#define LOOM_TEST_HARNESS_H

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "../src/core/core.h"

typedef void (*loom_test_fn)(void);
void loom_test_register(const char *name, const char *file, loom_test_fn fn);

/* The registry and what every runner needs (tests/common/runner.c). */
typedef struct loom_test_entry {
    const char *name, *file;
    loom_test_fn fn;
} loom_test_entry;
int loom_test_count(void);
const loom_test_entry *loom_test_at(int i);
/* No args: every test; else those whose name contains one of them. */
bool loom_test_selected(const char *name, int nargs, char *const *args);
double loom_test_now_ms(void);
/* "N passed, M failed[, K skipped]" */
void loom_test_summary(int passed, int failed, int skipped);

/* Runners of in-process tests on every rank (tests/common/ranks.c): the
 * world's rank and size for the messages; one test's run (1 when it
 * skipped; *failed_here when a check failed on this rank); rank 0's line
 * from every rank's failed flag (failed[r * stride]). */
void loom_ranks_init(int (*rank)(void), int (*size)(void));
int loom_ranks_run(const loom_test_entry *t, bool *failed_here);
void loom_ranks_verdict(const loom_test_entry *t, double t0_ms, int n_bad, bool any_skip,
                        const int *failed, int stride);
/* Ranks started by hand (tests/common/spawn.c): a free TCP port on
 * 127.0.0.1; torchrun's variables for rank of n (RANK, WORLD_SIZE,
 * LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT=port),
 * an MPI launcher's and Slurm's removed; --spawn N: n copies of this
 * program (argv[0] = prog) with them, waited for (limit_var: the seconds
 * before they are killed, default 900); 0 when every rank succeeded. */
int loom_test_free_port(void);
int loom_test_hold_port(int *held); /* the port, its socket kept bound in *held till closed */
void loom_test_rank_env(int rank, int n, int port);
int loom_test_spawn(int n, int argc, char **argv, const char *prog, const char *limit_var);
void loom_test_fail(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Set when the current test must stop (REQUIRE failed). */
extern bool loom_test_abort;

#define TEST(name)                                                                   \
    static void test_##name(void);                                                   \
    __attribute__((constructor)) static void register_##name(void) {                 \
        loom_test_register(#name, __FILE__, test_##name);                            \
    }                                                                                \
    static void test_##name(void)

/* Ends the current test as skipped, with the reason printed (exit code 77 of
 * the test's process). Only for tests whose prerequisite is absent on this
 * machine (a Python package, a GPU); CI installs what its tests need. */
void loom_test_skip(const char *reason) __attribute__((noreturn));
#define SKIP(reason) loom_test_skip(reason)
/* A CUDA build with a GPU visible (GPU tests skip otherwise). */
bool loom_test_have_gpu(void);

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) loom_test_fail(__FILE__, __LINE__, "CHECK(%s)", #cond);         \
    } while (0)
#define CHECK_MSG(cond, ...)                                                         \
    do {                                                                             \
        if (!(cond)) loom_test_fail(__FILE__, __LINE__, __VA_ARGS__);                \
    } while (0)
#define REQUIRE(cond)                                                                \
    do {                                                                             \
        if (!(cond)) {                                                               \
            loom_test_fail(__FILE__, __LINE__, "REQUIRE(%s)", #cond);                \
            loom_test_abort = true;                                                  \
            return;                                                                  \
        }                                                                            \
    } while (0)
/* A fixture file or directory the test needs: its absence is a failure (the
 * fixtures are part of the repository: tests/fixtures/README.md). */
#define REQUIRE_FIXTURE(path)                                                        \
    do {                                                                             \
        const char *_p = (path);                                                     \
        if (!loom_file_exists(_p) && !loom_dir_exists(_p)) {                         \
            loom_test_fail(__FILE__, __LINE__,                                       \
                           "no fixture %s (tests/fixtures of the repository, or "    \
                           "$LOOM_FIXTURES; tests run from the repository root)", _p); \
            loom_test_abort = true;                                                  \
            return;                                                                  \
        }                                                                            \
    } while (0)
#define CHECK_EQ_INT(a, b)                                                           \
    do {                                                                             \
        long long _a = (long long)(a), _b = (long long)(b);                          \
        if (_a != _b)                                                                \
            loom_test_fail(__FILE__, __LINE__, "%s == %s: %lld != %lld", #a, #b, _a, _b); \
    } while (0)
#define CHECK_STR(a, b)                                                              \
    do {                                                                             \
        const char *_a = (a), *_b = (b);                                             \
        if (!_a || !_b || strcmp(_a, _b) != 0)                                       \
            loom_test_fail(__FILE__, __LINE__, "%s == %s: \"%s\" != \"%s\"", #a, #b,   \
                           _a ? _a : "(null)", _b ? _b : "(null)");                  \
    } while (0)
#define CHECK_CONTAINS(hay, needle)                                                  \
    do {                                                                             \
        const char *_h = (hay), *_n = (needle);                                      \
        if (!_h || !strstr(_h, _n))                                                  \
            loom_test_fail(__FILE__, __LINE__, "\"%s\" does not contain \"%s\"",       \
                           _h ? _h : "(null)", _n);                                  \
    } while (0)
/* Checks a status is LOOM_OK; on failure prints the context's message. */
#define CHECK_OK(ctx, expr)                                                          \
    do {                                                                             \
        loom_status _st = (expr);                                                    \
        if (_st != LOOM_OK)                                                          \
            loom_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr,                \
                           loom_status_str(_st), loom_last_error(ctx));              \
    } while (0)
#define REQUIRE_OK(ctx, expr)                                                        \
    do {                                                                             \
        loom_status _st = (expr);                                                    \
        if (_st != LOOM_OK) {                                                        \
            loom_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr,                \
                           loom_status_str(_st), loom_last_error(ctx));              \
            loom_test_abort = true;                                                  \
            return;                                                                  \
        }                                                                            \
    } while (0)
#define CHECK_NEAR(a, b, tol)                                                        \
    do {                                                                             \
        double _a = (double)(a), _b = (double)(b);                                   \
        if (!(fabs(_a - _b) <= (tol)))                                               \
            loom_test_fail(__FILE__, __LINE__, "%s ~= %s: %.9g vs %.9g (tol %g)", #a,  \
                           #b, _a, _b, (double)(tol));                               \
    } while (0)

/* Paths: the repository root (where the tests run) and tests/fixtures. */
const char *loom_test_fixtures(void); /* $LOOM_FIXTURES, else tests/fixtures */
/* The set holding a fixture model: <fixtures>_moe (tools/make_fixtures_moe.py's
 * MoE variants: tiny-qwen2-moe) or loom_test_fixtures(). */
const char *loom_test_fixtures_of(const char *model);
/* A fresh empty temporary directory for this test (removed at exit). */
const char *loom_test_tmpdir(void);
/* Writes bytes to tmpdir/name and returns the full path (static buffer per call
 * site is not kept: copy it if needed across calls). */
const char *loom_test_write(const char *name, const void *data, size_t len);

/* Runs a command (argv[0] resolved through PATH or given as a path) with
 * stdin from /dev/null, captures stdout+stderr into *out (caller frees).
 * Returns the exit code, or 128+signal if it died by a signal, or -1. */
int loom_test_run(char **out, const char *const argv[]);
/* Whether `mpirun --version` runs; and the environment the tests run
 * mpirun in (as root, oversubscribed, no cross-process memory copy, a
 * 120 s communication timeout, no leak reports from OpenMPI's own
 * allocations). */
bool loom_test_have_mpirun(void);
void loom_test_mpi_env(void);
/* The loom binary under test ($LOOM_BIN or build/loom). */
const char *loom_test_bin(void);

/* Context parallel cp=2 as loom lays it out: the T tokens in 4 chunks, rank r
 * holding chunks r and 3-r. Writes rank r's token indices (ascending) to
 * qidx (T/2 of them) and returns how many. */
static inline int loom_test_cp2_queries(int64_t T, int r, int32_t *qidx) {
    const int64_t C = T / 4;
    int n = 0;
    for (int c = 0; c < 4; c++)
        if (c == r || c == 3 - r)
            for (int64_t t = c * C; t < (c + 1) * C; t++) qidx[n++] = (int32_t)t;
    return n;
}

#endif
