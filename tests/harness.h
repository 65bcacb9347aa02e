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

/* Paths: the repository root (where the tests run) and ../shared/fixtures. */
const char *loom_test_fixtures(void); /* $LOOM_FIXTURES, ../shared/fixtures or shared/fixtures */
/* A fresh empty temporary directory for this test (removed at exit). */
const char *loom_test_tmpdir(void);
/* Writes bytes to tmpdir/name and returns the full path (static buffer per call
 * site is not kept: copy it if needed across calls). */
const char *loom_test_write(const char *name, const void *data, size_t len);

/* Runs a command (argv[0] resolved through PATH or given as a path) with
 * stdin from /dev/null, captures stdout+stderr into *out (caller frees).
 * Returns the exit code, or 128+signal if it died by a signal, or -1. */
int loom_test_run(char **out, const char *const argv[]);
/* The loom binary under test ($LOOM_BIN or build/loom). */
const char *loom_test_bin(void);

#endif
