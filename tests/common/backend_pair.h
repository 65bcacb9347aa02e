/* Two backend tables side by side for the tests that hold an op family of
 * a backend to the CPU's (test_backend_ops.c, test_backend_gdn.c): side 0
 * the CPU table in fp32, side 1 the backend under test in dtype t (CUDA;
 * skipped without a GPU), fresh random inputs each run (rounded to side
 * 1's dtype first where they are activations, so both sides see the same
 * values), and the comparison of an output of both. */
#ifndef LOOM_TEST_BACKEND_PAIR_H
#define LOOM_TEST_BACKEND_PAIR_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "../../src/backend/backend.h"
#include "../harness.h"

/* REQUIRE for the helpers that return a buffer: a failure ends the test's
 * process as failed (the runner forks one per test). */
#define MUST(cond)                                                                                 \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            loom_test_fail(__FILE__, __LINE__, "MUST(%s)", #cond);                                 \
            fflush(stderr);                                                                        \
            _exit(1);                                                                              \
        }                                                                                          \
    } while (0)
#define MUST_OK(ctx, expr)                                                                         \
    do {                                                                                           \
        loom_status st_ = (expr);                                                                  \
        if (st_) {                                                                                 \
            loom_test_fail(__FILE__, __LINE__, "%s -> %s: %s", #expr, loom_status_str(st_),        \
                           loom_last_error(ctx));                                                  \
            fflush(stderr);                                                                        \
            _exit(1);                                                                              \
        }                                                                                          \
    } while (0)

typedef struct bp_run {
    loom_ctx *ctx;
    const loom_backend *be[2];
    loom_dev d[2];
    loom_dtype t; /* side 1's compute dtype */
    uint64_t seed;
    void *keep[2][64]; /* device buffers, freed by bp_end */
    int nkeep[2];
} bp_run;

/* false (nothing to free) without CUDA built in or a GPU visible */
bool bp_begin(bp_run *r, loom_dtype t);
void bp_end(bp_run *r);
/* n values in [lo, hi), rounded to side 1's dtype when act (malloc'd) */
float *bp_rnd(bp_run *r, int64_t n, float lo, float hi, bool act);
/* a buffer of side k, freed by bp_end */
void *bp_keep(bp_run *r, int k, size_t bytes);
/* host data on side k: act buffers in the side's compute dtype, else fp32 */
void *bp_in(bp_run *r, int k, const float *h, int64_t n, bool act);
/* bytes copied as they are */
void *bp_raw(bp_run *r, int k, const void *h, size_t bytes);
/* an output buffer of n values on side k (act: the side's dtype, else fp32) */
void *bp_outbuf(bp_run *r, int k, int64_t n, bool act);
/* side k's n values at p as fp32 (malloc'd) */
float *bp_get(bp_run *r, int k, const void *p, int64_t n, bool act);
/* the largest |a - b| over the largest |b| (a NaN counts as infinite) */
double bp_rel_err(const float *a, const float *b, int64_t n);
/* output `what` (n values at p[0] on the CPU, p[1] on side 1) within tol */
void bp_same(bp_run *r, const char *what, void *const p[2], int64_t n, bool act, double tol);
/* fp32: the GPU's fp32 arithmetic against the CPU's double, rounded once;
 * bf16: the outputs' rounding */
double bp_tol(const bp_run *r);

#endif
