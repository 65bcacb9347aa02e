/* Gated DeltaNet's small CPU ops (src/backend/cpu/gdn.c): the causal
 * convolution with SiLU, the gates and the gated RMSNorm against float64
 * formulas and central differences of them (the loss sum(dout * f) in
 * double); each document alone equals its rows packed; and kern.c's
 * wrappers on a backend without the ops. test_gdn.c holds the rule itself. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend/cpu/cpu_gdn.h"
#include "../src/core/rng.h"
#include "../src/model/kern.h"
#include "../src/model/model.h"
#include "harness.h"

/* n floats uniform in [lo, hi) and the same values as doubles */
static float *ufill(int64_t n, uint64_t key, double lo, double hi, double **d) {
    float *f = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    *d = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    for (int64_t i = 0; i < n; i++)
        (*d)[i] = f[i] = (float)(lo + (hi - lo) * loom_rng_uniform(3805, key, (uint64_t)i));
    return f;
}

/* max |a - b| / max(max |b|, 1e-3) */
static double err_of(const float *a, const double *b, int64_t n) {
    double e = 0, m = 1e-3;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= e)) e = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return e / m;
}

static double sigd(double x) { return 1 / (1 + exp(-x)); }

/* ---- the convolution ---- */

enum { CONV_T = 100, CONV_C = 12, CONV_K = 4, CONV_DOCS = 4 };
static const int32_t conv_cu[CONV_DOCS + 1] = {0, 2, 9, 79, 100}; /* 2 < K - 1 tokens first */

static double conv_ref(const double *x, const double *w, const double *dy, double *y) {
    double loss = 0;
    for (int n = 0; n < CONV_DOCS; n++)
        for (int64_t t = conv_cu[n]; t < conv_cu[n + 1]; t++)
            for (int64_t c = 0; c < CONV_C; c++) {
                double p = 0;
                for (int64_t j = 0; j < CONV_K; j++) {
                    int64_t u = t - (CONV_K - 1) + j;
                    p += u < conv_cu[n] ? 0 : w[c * CONV_K + j] * x[u * CONV_C + c];
                }
                y[t * CONV_C + c] = p * sigd(p);
                loss += dy[t * CONV_C + c] * y[t * CONV_C + c];
            }
    return loss;
}

/* the gradient of loss(xs) at every coordinate of xs (n) by central differences */
typedef double (*loss_fn)(void *arg);
static void fd_grad(double *xs, int64_t n, loss_fn f, void *arg, double *grad) {
    for (int64_t i = 0; i < n; i++) {
        const double x0 = xs[i], h = 1e-6;
        xs[i] = x0 + h;
        double lp = f(arg);
        xs[i] = x0 - h;
        double lm = f(arg);
        xs[i] = x0;
        grad[i] = (lp - lm) / (2 * h);
    }
}

typedef struct conv_args {
    double *x, *w, *dy, *y;
} conv_args;
static double conv_loss(void *a) {
    conv_args *c = a;
    return conv_ref(c->x, c->w, c->dy, c->y);
}

TEST(gdn_conv_matches_float64) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    const int64_t n = CONV_T * CONV_C, nw = CONV_C * CONV_K;
    conv_args a;
    float *x = ufill(n, 1, -2, 2, &a.x), *w = ufill(nw, 2, -1, 1, &a.w);
    float *dy = ufill(n, 3, -1, 1, &a.dy), *y = calloc(n, sizeof(float));
    float *dx = calloc(n, sizeof(float)), *dw = calloc(nw, sizeof(float));
    double *gx = calloc(n, sizeof(double)), *gw = calloc(nw, sizeof(double));
    a.y = calloc(n, sizeof(double));
    conv_ref(a.x, a.w, a.dy, a.y);
    CHECK_OK(ctx, loom_cpu_gdn_conv_fwd(ctx, x, w, CONV_T, CONV_C, CONV_K, conv_cu, CONV_DOCS, y));
    double ey = err_of(y, a.y, n);
    for (int64_t i = 0; i < nw; i++) dw[i] = 0.5f; /* dw is added to */
    CHECK_OK(ctx, loom_cpu_gdn_conv_bwd(ctx, dy, x, w, CONV_T, CONV_C, CONV_K, conv_cu, CONV_DOCS,
                                        dx, dw));
    for (int64_t i = 0; i < nw; i++) dw[i] -= 0.5f;
    fd_grad(a.x, n, conv_loss, &a, gx);
    fd_grad(a.w, nw, conv_loss, &a, gw);
    double ex = err_of(dx, gx, n), ew = err_of(dw, gw, nw);
    printf("  conv: y %.2e, dx %.2e, dw %.2e (vs float64 / differences)\n", ey, ex, ew);
    CHECK_MSG(ey < 1e-6, "conv forward off by %.3g", ey);
    CHECK_MSG(ex < 1e-6, "conv dx off by %.3g", ex);
    CHECK_MSG(ew < 1e-6, "conv dw off by %.3g", ew);
    /* the third document alone: the same rows, bit for bit */
    const int32_t one[2] = {0, conv_cu[3] - conv_cu[2]};
    float *y1 = calloc(n, sizeof(float)), *dx1 = calloc(n, sizeof(float));
    const int64_t off = conv_cu[2] * CONV_C, rows = one[1];
    CHECK_OK(ctx, loom_cpu_gdn_conv_fwd(ctx, x + off, w, rows, CONV_C, CONV_K, one, 1, y1));
    CHECK_OK(ctx, loom_cpu_gdn_conv_bwd(ctx, dy + off, x + off, w, rows, CONV_C, CONV_K, one, 1,
                                        dx1, NULL));
    CHECK(memcmp(y1, y + off, (size_t)(rows * CONV_C) * sizeof(float)) == 0);
    CHECK(memcmp(dx1, dx + off, (size_t)(rows * CONV_C) * sizeof(float)) == 0);
    free(x), free(w), free(dy), free(y), free(dx), free(dw), free(gx), free(gw), free(y1);
    free(dx1), free(a.x), free(a.w), free(a.dy), free(a.y);
    loom_ctx_free(ctx);
}

/* ---- the gates ---- */

enum { GATE_T = 50, GATE_H = 4 };

typedef struct gate_args {
    double *a, *b, *A_log, *dt, *dg, *dbeta, *g, *beta;
} gate_args;

static double gate_loss(void *p) {
    gate_args *s = p;
    double loss = 0;
    for (int64_t i = 0; i < GATE_T * GATE_H; i++) {
        const int64_t h = i % GATE_H;
        const double x = s->a[i] + s->dt[h];
        s->g[i] = -exp(s->A_log[h]) * (x > 20 ? x : log(1 + exp(x)));
        s->beta[i] = sigd(s->b[i]);
        loss += s->dg[i] * s->g[i] + s->dbeta[i] * s->beta[i];
    }
    return loss;
}

TEST(gdn_gate_matches_float64) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    const int64_t n = GATE_T * GATE_H;
    gate_args s;
    float *a = ufill(n, 10, -6, 6, &s.a), *b = ufill(n, 11, -8, 8, &s.b);
    float *A_log = ufill(GATE_H, 12, log(0.01), log(16), &s.A_log);
    float *dt = ufill(GATE_H, 13, -1, 1, &s.dt), *dg = ufill(n, 14, -1, 1, &s.dg);
    float *dbeta = ufill(n, 15, -1, 1, &s.dbeta);
    for (int i = 0; i < 3; i++) s.a[i] = a[i] = 25.0f; /* softplus past its threshold */
    float *g = calloc(n, 4), *beta = calloc(n, 4), *da = calloc(n, 4), *db = calloc(n, 4);
    float dA[GATE_H] = {0}, ddt[GATE_H] = {0};
    s.g = calloc(n, 8), s.beta = calloc(n, 8);
    double *ga = calloc(n, 8), *gb = calloc(n, 8), gA[GATE_H], gdt[GATE_H];
    gate_loss(&s);
    CHECK_OK(ctx, loom_cpu_gdn_gate_fwd(ctx, a, b, A_log, dt, GATE_T, GATE_H, g, beta));
    const double eg = err_of(g, s.g, n), eb = err_of(beta, s.beta, n);
    CHECK_OK(ctx, loom_cpu_gdn_gate_bwd(ctx, dg, dbeta, a, b, A_log, dt, GATE_T, GATE_H, da, db, dA,
                                        ddt));
    fd_grad(s.a, n, gate_loss, &s, ga);
    fd_grad(s.b, n, gate_loss, &s, gb);
    fd_grad(s.A_log, GATE_H, gate_loss, &s, gA);
    fd_grad(s.dt, GATE_H, gate_loss, &s, gdt);
    const double e[4] = {err_of(da, ga, n), err_of(db, gb, n), err_of(dA, gA, GATE_H),
                         err_of(ddt, gdt, GATE_H)};
    printf("  gate: g %.2e, beta %.2e, da %.2e, db %.2e, dA_log %.2e, ddt_bias %.2e\n", eg, eb,
           e[0], e[1], e[2], e[3]);
    CHECK(eg < 1e-6 && eb < 1e-6);
    for (int i = 0; i < 4; i++) CHECK_MSG(e[i] < 1e-6, "gate gradient %d off by %.3g", i, e[i]);
    free(a), free(b), free(A_log), free(dt), free(dg), free(dbeta), free(g), free(beta), free(da);
    free(db), free(s.a), free(s.b), free(s.A_log), free(s.dt), free(s.dg), free(s.dbeta);
    free(s.g), free(s.beta), free(ga), free(gb);
    loom_ctx_free(ctx);
}

/* ---- the gated RMSNorm ---- */

enum { NORM_N = 30, NORM_D = 16 };
#define NORM_EPS 1e-6f

typedef struct norm_args {
    double *x, *z, *w, *dy, *y;
} norm_args;

static double norm_loss(void *p) {
    norm_args *s = p;
    double loss = 0;
    for (int64_t r = 0; r < NORM_N; r++) {
        double ss = 0;
        for (int64_t j = 0; j < NORM_D; j++) ss += s->x[r * NORM_D + j] * s->x[r * NORM_D + j];
        const double rs = 1 / sqrt(ss / NORM_D + (double)NORM_EPS);
        for (int64_t j = 0; j < NORM_D; j++) {
            const int64_t i = r * NORM_D + j;
            s->y[i] = s->w[j] * s->x[i] * rs * s->z[i] * sigd(s->z[i]);
            loss += s->dy[i] * s->y[i];
        }
    }
    return loss;
}

TEST(gdn_norm_matches_float64) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    const int64_t n = NORM_N * NORM_D;
    norm_args s;
    float *x = ufill(n, 20, -2, 2, &s.x), *z = ufill(n, 21, -4, 4, &s.z);
    float *w = ufill(NORM_D, 22, 0.5, 1.5, &s.w), *dy = ufill(n, 23, -1, 1, &s.dy);
    float *y = calloc(n, 4), *dx = calloc(n, 4), *dz = calloc(n, 4), rstd[NORM_N], dw[NORM_D];
    double *gx = calloc(n, 8), *gz = calloc(n, 8), gw[NORM_D];
    s.y = calloc(n, 8);
    norm_loss(&s);
    CHECK_OK(ctx, loom_cpu_gdn_norm_fwd(ctx, x, z, w, NORM_N, NORM_D, NORM_EPS, y, rstd));
    const double ey = err_of(y, s.y, n);
    for (int j = 0; j < NORM_D; j++) dw[j] = 0.25f;
    CHECK_OK(ctx, loom_cpu_gdn_norm_bwd(ctx, dy, x, z, w, rstd, NORM_N, NORM_D, dx, dz, dw));
    for (int j = 0; j < NORM_D; j++) dw[j] -= 0.25f;
    fd_grad(s.x, n, norm_loss, &s, gx);
    fd_grad(s.z, n, norm_loss, &s, gz);
    fd_grad(s.w, NORM_D, norm_loss, &s, gw);
    const double ex = err_of(dx, gx, n), ez = err_of(dz, gz, n), ew = err_of(dw, gw, NORM_D);
    printf("  norm: y %.2e, dx %.2e, dz %.2e, dw %.2e\n", ey, ex, ez, ew);
    CHECK_MSG(ey < 1e-6, "gated norm forward off by %.3g", ey);
    CHECK_MSG(ex < 1e-6 && ez < 1e-6 && ew < 1e-6, "gated norm gradients off: %.3g %.3g %.3g", ex,
              ez, ew);
    free(x), free(z), free(w), free(dy), free(y), free(dx), free(dz), free(gx), free(gz);
    free(s.x), free(s.z), free(s.w), free(s.dy), free(s.y);
    loom_ctx_free(ctx);
}

/* ---- the rule: a document alone equals its rows packed ---- */

TEST(gdn_rule_documents_are_independent) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    const int64_t Hk = 2, Hv = 4, dk = 8, dv = 8, C = 2 * Hk * dk + Hv * dv, T = 98;
    const int32_t cu[4] = {0, 7, 77, 98}, one[2] = {0, 70};
    double *d[4];
    float *qkv = ufill(T * C, 30, -1, 1, &d[0]), *g = ufill(T * Hv, 31, -2, 0, &d[1]);
    float *beta = ufill(T * Hv, 32, 0, 1, &d[2]), *dout = ufill(T * Hv * dv, 33, -1, 1, &d[3]);
    float *o = calloc(T * Hv * dv, 4), *o1 = calloc(T * Hv * dv, 4), *dq = calloc(T * C, 4);
    float *dq1 = calloc(T * C, 4), *dg = calloc(T * Hv, 4), *dg1 = calloc(T * Hv, 4);
    float *db = calloc(T * Hv, 4), *db1 = calloc(T * Hv, 4);
    for (int i = 0; i < 4; i++) free(d[i]);
    CHECK_OK(ctx, loom_cpu_gdn_fwd(ctx, qkv, g, beta, T, Hk, Hv, dk, dv, cu, 3, o));
    CHECK_OK(ctx, loom_cpu_gdn_bwd(ctx, dout, qkv, g, beta, T, Hk, Hv, dk, dv, cu, 3, dq, dg, db));
    CHECK_OK(ctx, loom_cpu_gdn_fwd(ctx, qkv + 7 * C, g + 7 * Hv, beta + 7 * Hv, 70, Hk, Hv, dk, dv,
                                   one, 1, o1));
    CHECK_OK(ctx, loom_cpu_gdn_bwd(ctx, dout + 7 * Hv * dv, qkv + 7 * C, g + 7 * Hv, beta + 7 * Hv,
                                   70, Hk, Hv, dk, dv, one, 1, dq1, dg1, db1));
    CHECK(memcmp(o1, o + 7 * Hv * dv, 70 * Hv * dv * 4) == 0);
    CHECK(memcmp(dq1, dq + 7 * C, 70 * C * 4) == 0);
    CHECK(memcmp(dg1, dg + 7 * Hv, 70 * Hv * 4) == 0);
    CHECK(memcmp(db1, db + 7 * Hv, 70 * Hv * 4) == 0);
    /* bad documents: an error, not a crash */
    const int32_t bad[3] = {0, 50, 97};
    CHECK(loom_cpu_gdn_fwd(ctx, qkv, g, beta, T, Hk, Hv, dk, dv, bad, 2, o) ==
          LOOM_ERR_INVALID_ARG);
    CHECK(loom_cpu_gdn_fwd(ctx, qkv, g, beta, T, 3, Hv, dk, dv, cu, 3, o) == LOOM_ERR_INVALID_ARG);
    free(qkv), free(g), free(beta), free(dout), free(o), free(o1), free(dq), free(dq1), free(dg);
    free(dg1), free(db), free(db1);
    loom_ctx_free(ctx);
}

/* ---- kern.c's wrappers ---- */

/* On the CPU table they run the op; on a table whose Gated DeltaNet slots
 * are NULL (none of loom's own since CUDA has them: a table made so here)
 * they fail with LOOM_ERR_UNSUPPORTED, naming it. */
TEST(gdn_kern_wrappers_need_the_ops) {
    loom_model *m = calloc(1, sizeof *m);
    REQUIRE(m && loom_ctx_create(&m->ctx) == LOOM_OK);
    loom_backend be = *loom_backend_cpu();
    m->dev = (loom_dev){.be = &be, .adt = LOOM_F32, .esz = 4, .device = -1};
    const int32_t cu[2] = {0, 5};
    float qkv[5 * 12] = {0}, g[5] = {0}, beta[5] = {0}, o[5 * 4], x[5 * 3] = {0}, y[5 * 3];
    float w[3 * 2] = {0};
    CHECK_OK(m->ctx, loom_k_gdn_fwd(m, qkv, g, beta, 5, 1, 1, 4, 4, cu, 1, o, NULL, 0));
    CHECK_OK(m->ctx, loom_k_gdn_conv_fwd(m, x, w, 5, 3, 2, cu, 1, y));
    be.gdn_conv_fwd = NULL, be.gdn_conv_bwd = NULL, be.gdn_gate_fwd = NULL, be.gdn_gate_bwd = NULL;
    be.gdn_fwd = NULL, be.gdn_bwd = NULL, be.gdn_norm_fwd = NULL, be.gdn_norm_bwd = NULL;
    m->dev.cuda = true;
    CHECK(loom_k_gdn_fwd(m, qkv, g, beta, 5, 1, 1, 4, 4, cu, 1, o, NULL, 0) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(m->ctx), "Gated DeltaNet ops are not on the CUDA backend yet");
    CHECK(loom_k_gdn_norm_bwd(m, o, o, o, w, g, 5, 4, o, o, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK(loom_k_gdn_conv_bwd(m, x, x, w, 5, 3, 2, cu, 1, y, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK(loom_k_gdn_gate_fwd(m, g, g, g, g, 5, 1, o, o) == LOOM_ERR_UNSUPPORTED);
    const loom_backend *cuda = loom_backend_cuda();
    if (cuda) /* built with CUDA: its slots are filled (test_backend_gdn.c compares them) */
        CHECK(cuda->gdn_fwd && cuda->gdn_bwd && cuda->gdn_conv_fwd && cuda->gdn_norm_fwd);
    loom_ctx_free(m->ctx);
    free(m);
}
