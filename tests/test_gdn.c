/* Gated DeltaNet's CPU ops (src/backend/cpu/gdn.c) against float64
 * references written independently of them: the gated delta rule against
 * the token-by-token recurrence (transformers' torch_recurrent_gated_delta_rule)
 * and its reverse mode, itself held to central finite differences; the
 * convolution, the gates and the gated norm against direct float64
 * formulas and finite differences of them. Packed documents of 7, 70 and 21
 * tokens (as the Qwen3.5 fixture's), lengths across chunk boundaries and not
 * multiples of 64, and grouped key heads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend/cpu/cpu_gdn.h"
#include "../src/core/rng.h"
#include "harness.h"

static double *dalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }
static float *salloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* uniform in [lo, hi) */
static void uni(double *x, int64_t n, uint64_t key, double lo, double hi) {
    for (int64_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * loom_rng_uniform(38, key, (uint64_t)i);
}

/* the doubles rounded to fp32, and back (the op and the reference read the same values) */
static float *to_f(double *x, int64_t n) {
    float *f = salloc(n);
    for (int64_t i = 0; i < n; i++) x[i] = f[i] = (float)x[i];
    return f;
}

/* max |a - b| / max(max |b|, floor) */
static double rel_err(const float *a, const double *b, int64_t n, double floor) {
    double e = 0, m = floor;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= e)) e = isnan(d) ? INFINITY : d;
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return e / m;
}

static int64_t docs_of(const int *len, int n, int32_t *cu) {
    cu[0] = 0;
    for (int i = 0; i < n; i++) cu[i + 1] = cu[i] + len[i];
    return cu[n];
}

/* ---- the gated delta rule ---- */

typedef struct gcase {
    int ndocs, len[6];
    int64_t Hk, Hv, dk, dv;
    double gmax; /* g in (-gmax, 0], most of it mild */
} gcase;

static const gcase gcases[] = {
    {3, {7, 70, 21}, 2, 4, 16, 16, 4},       /* the fixture's documents and heads */
    {1, {150}, 1, 2, 8, 12, 4},              /* three chunks, the last short */
    {5, {64, 65, 1, 128, 3}, 2, 2, 8, 8, 4}, /* chunk multiples, a single token */
    {2, {100, 37}, 1, 3, 4, 6, 40},          /* decays to e^-40 a token: e^G underflows */
};

/* L = sum dout . o of the token-by-token recurrence in double (q, k
 * normalised inside, as the op), with its reverse mode when dqkv is given. */
static double ref_gdn(const gcase *c, const int32_t *cu, const double *qkv, const double *g,
                      const double *beta, const double *dout, double *o, double *dqkv, double *dg,
                      double *dbeta) {
    const int64_t dk = c->dk, dv = c->dv, Hk = c->Hk, Hv = c->Hv, C = 2 * Hk * dk + Hv * dv;
    const int64_t T = cu[c->ndocs], grp = Hv / Hk;
    double *qn = dalloc(T * Hk * dk), *kn = dalloc(T * Hk * dk);
    double *dqn = dalloc(T * Hk * dk), *dkn = dalloc(T * Hk * dk);
    double *S = dalloc((T + 1) * dk * dv), *dS = dalloc(dk * dv), *Sd = dalloc(dk * dv);
    double *m = dalloc(dv), *dl = dalloc(dv), *dm = dalloc(dv), loss = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < Hk; h++) {
            const double *q = qkv + t * C + h * dk, *k = q + Hk * dk;
            double sq = 0, sk = 0;
            for (int64_t a = 0; a < dk; a++) sq += q[a] * q[a], sk += k[a] * k[a];
            for (int64_t a = 0; a < dk; a++) {
                qn[(t * Hk + h) * dk + a] = q[a] / sqrt(sq + 1e-6) / sqrt((double)dk);
                kn[(t * Hk + h) * dk + a] = k[a] / sqrt(sk + 1e-6);
            }
        }
    for (int n = 0; n < c->ndocs; n++)
        for (int64_t h = 0; h < Hv; h++) {
            const int64_t s = cu[n], e = cu[n + 1], hk = h / grp;
            /* S + (t - s + 1) dk dv: the state after token t; S itself the zero state */
            memset(S, 0, (size_t)(dk * dv) * sizeof(double));
            for (int64_t t = s; t < e; t++) {
                const double *Sp = S + (t - s) * dk * dv, *k = kn + (t * Hk + hk) * dk;
                const double *q = qn + (t * Hk + hk) * dk, *v = qkv + t * C + 2 * Hk * dk + h * dv;
                double *Sn = S + (t - s + 1) * dk * dv, eg = exp(g[t * Hv + h]);
                const double b = beta[t * Hv + h];
                for (int64_t j = 0; j < dv; j++) {
                    m[j] = 0;
                    for (int64_t a = 0; a < dk; a++) m[j] += eg * Sp[a * dv + j] * k[a];
                }
                for (int64_t a = 0; a < dk; a++)
                    for (int64_t j = 0; j < dv; j++)
                        Sn[a * dv + j] = eg * Sp[a * dv + j] + k[a] * b * (v[j] - m[j]);
                for (int64_t j = 0; j < dv; j++) {
                    double oj = 0;
                    for (int64_t a = 0; a < dk; a++) oj += Sn[a * dv + j] * q[a];
                    o[(t * Hv + h) * dv + j] = oj;
                    loss += dout[(t * Hv + h) * dv + j] * oj;
                }
            }
            if (!dqkv) continue;
            memset(dS, 0, (size_t)(dk * dv) * sizeof(double));
            for (int64_t t = e - 1; t >= s; t--) {
                const double *Sp = S + (t - s) * dk * dv, *Sn = Sp + dk * dv;
                const double *k = kn + (t * Hk + hk) * dk, *q = qn + (t * Hk + hk) * dk;
                const double *v = qkv + t * C + 2 * Hk * dk + h * dv, *d = dout + (t * Hv + h) * dv;
                double *dq = dqn + (t * Hk + hk) * dk, *dk_ = dkn + (t * Hk + hk) * dk;
                const double eg = exp(g[t * Hv + h]), b = beta[t * Hv + h];
                for (int64_t i = 0; i < dk * dv; i++) Sd[i] = eg * Sp[i];
                for (int64_t j = 0; j < dv; j++) {
                    m[j] = 0;
                    for (int64_t a = 0; a < dk; a++) m[j] += Sd[a * dv + j] * k[a];
                }
                /* o = Sn^T q */
                for (int64_t a = 0; a < dk; a++)
                    for (int64_t j = 0; j < dv; j++) {
                        dS[a * dv + j] += q[a] * d[j];
                        dq[a] += Sn[a * dv + j] * d[j];
                    }
                /* Sn = Sd + k delta^T, delta = b (v - m), m = Sd^T k */
                double db = 0;
                for (int64_t j = 0; j < dv; j++) {
                    dl[j] = 0;
                    for (int64_t a = 0; a < dk; a++) dl[j] += dS[a * dv + j] * k[a];
                    db += dl[j] * (v[j] - m[j]);
                    dqkv[t * C + 2 * Hk * dk + h * dv + j] = b * dl[j];
                    dm[j] = -b * dl[j];
                }
                dbeta[t * Hv + h] = db;
                double dgt = 0;
                for (int64_t a = 0; a < dk; a++)
                    for (int64_t j = 0; j < dv; j++) {
                        dk_[a] += dS[a * dv + j] * b * (v[j] - m[j]) + Sd[a * dv + j] * dm[j];
                        dS[a * dv + j] += k[a] * dm[j];
                        dgt += Sd[a * dv + j] * dS[a * dv + j];
                        dS[a * dv + j] *= eg;
                    }
                dg[t * Hv + h] = dgt;
            }
        }
    if (dqkv) /* through the normalisation: y = x sc / |x|_eps */
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < Hk; h++)
                for (int w = 0; w < 2; w++) {
                    const double *x = qkv + t * C + w * Hk * dk + h * dk;
                    const double *dy = (w ? dkn : dqn) + (t * Hk + h) * dk;
                    const double sc = w ? 1.0 : 1.0 / sqrt((double)dk);
                    double ss = 0, xd = 0;
                    for (int64_t a = 0; a < dk; a++) ss += x[a] * x[a], xd += x[a] * dy[a];
                    const double r = 1.0 / sqrt(ss + 1e-6);
                    for (int64_t a = 0; a < dk; a++)
                        dqkv[t * C + w * Hk * dk + h * dk + a] =
                            sc * (r * dy[a] - r * r * r * xd * x[a]);
                }
    free(qn), free(kn), free(dqn), free(dkn), free(S), free(dS), free(Sd), free(m), free(dl);
    free(dm);
    return loss;
}

typedef struct ginputs {
    int32_t cu[7];
    int64_t T, C;
    double *qkv, *g, *beta, *dout;
    float *fqkv, *fg, *fbeta, *fdout;
} ginputs;

static void ginputs_make(ginputs *in, const gcase *c, uint64_t key) {
    in->T = docs_of(c->len, c->ndocs, in->cu);
    in->C = 2 * c->Hk * c->dk + c->Hv * c->dv;
    const int64_t T = in->T, n = T * in->C, nh = T * c->Hv;
    in->qkv = dalloc(n), in->g = dalloc(nh), in->beta = dalloc(nh);
    in->dout = dalloc(nh * c->dv);
    uni(in->qkv, n, key, -1, 1);
    uni(in->g, nh, key + 1, 0, 1);
    for (int64_t i = 0; i < nh; i++) in->g[i] = -c->gmax * in->g[i] * in->g[i] * in->g[i];
    uni(in->beta, nh, key + 2, 0.05, 1);
    uni(in->dout, nh * c->dv, key + 3, -1, 1);
    in->fqkv = to_f(in->qkv, n), in->fg = to_f(in->g, nh), in->fbeta = to_f(in->beta, nh);
    in->fdout = to_f(in->dout, nh * c->dv);
}

static void ginputs_free(ginputs *in) {
    free(in->qkv), free(in->g), free(in->beta), free(in->dout);
    free(in->fqkv), free(in->fg), free(in->fbeta), free(in->fdout);
}

TEST(gdn_fwd_matches_float64_recurrence) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    for (size_t ci = 0; ci < sizeof gcases / sizeof *gcases; ci++) {
        const gcase *c = &gcases[ci];
        ginputs in;
        ginputs_make(&in, c, 100 + 10 * ci);
        const int64_t no = in.T * c->Hv * c->dv;
        double *o = dalloc(no);
        float *fo = salloc(no);
        ref_gdn(c, in.cu, in.qkv, in.g, in.beta, in.dout, o, NULL, NULL, NULL);
        CHECK_OK(ctx, loom_cpu_gdn_fwd(ctx, in.fqkv, in.fg, in.fbeta, in.T, c->Hk, c->Hv, c->dk,
                                       c->dv, in.cu, c->ndocs, fo));
        double e = rel_err(fo, o, no, 1e-3);
        printf("  gdn_fwd case %zu (T %lld): max error %.2e of max |o|\n", ci, (long long)in.T, e);
        CHECK_MSG(e < 5e-7, "case %zu: gdn_fwd off the float64 recurrence by %.3g", ci, e);
        free(o), free(fo);
        ginputs_free(&in);
    }
    loom_ctx_free(ctx);
}

TEST(gdn_bwd_matches_float64_reverse_mode) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    for (size_t ci = 0; ci < sizeof gcases / sizeof *gcases; ci++) {
        const gcase *c = &gcases[ci];
        ginputs in;
        ginputs_make(&in, c, 200 + 10 * ci);
        const int64_t no = in.T * c->Hv * c->dv, nq = in.T * in.C, nh = in.T * c->Hv;
        double *o = dalloc(no), *dqkv = dalloc(nq), *dg = dalloc(nh), *db = dalloc(nh);
        float *fdqkv = salloc(nq), *fdg = salloc(nh), *fdb = salloc(nh);
        for (int64_t i = 0; i < nq; i++) fdqkv[i] = NAN; /* every element is written */
        ref_gdn(c, in.cu, in.qkv, in.g, in.beta, in.dout, o, dqkv, dg, db);
        CHECK_OK(ctx, loom_cpu_gdn_bwd(ctx, in.fdout, in.fqkv, in.fg, in.fbeta, in.T, c->Hk, c->Hv,
                                       c->dk, c->dv, in.cu, c->ndocs, fdqkv, fdg, fdb));
        /* q, k and v separately: their scales differ */
        const int64_t Qw = c->Hk * c->dk, parts[4] = {0, Qw, 2 * Qw, in.C};
        const char *names[3] = {"dq", "dk", "dv"};
        for (int p = 0; p < 3; p++) {
            const int64_t w = parts[p + 1] - parts[p];
            double *r = dalloc(in.T * w);
            float *f = salloc(in.T * w);
            for (int64_t t = 0; t < in.T; t++)
                for (int64_t j = 0; j < w; j++) {
                    r[t * w + j] = dqkv[t * in.C + parts[p] + j];
                    f[t * w + j] = fdqkv[t * in.C + parts[p] + j];
                }
            double e = rel_err(f, r, in.T * w, 1e-3);
            printf("  gdn_bwd case %zu: %s max error %.2e of max\n", ci, names[p], e);
            CHECK_MSG(e < 5e-7, "case %zu: %s off the float64 reverse mode by %.3g", ci, names[p],
                      e);
            free(r), free(f);
        }
        double eg = rel_err(fdg, dg, nh, 1e-3), eb = rel_err(fdb, db, nh, 1e-3);
        printf("  gdn_bwd case %zu: dg %.2e, dbeta %.2e of max\n", ci, eg, eb);
        CHECK_MSG(eg < 5e-7, "case %zu: dg off by %.3g", ci, eg);
        CHECK_MSG(eb < 5e-7, "case %zu: dbeta off by %.3g", ci, eb);
        free(o), free(dqkv), free(dg), free(db), free(fdqkv), free(fdg), free(fdb);
        ginputs_free(&in);
    }
    loom_ctx_free(ctx);
}

/* The reference's reverse mode is itself held to central differences of its
 * loss (doubles), at random coordinates of each input. */
TEST(gdn_reference_gradients_match_finite_differences) {
    const gcase *c = &gcases[0];
    ginputs in;
    ginputs_make(&in, c, 300);
    const int64_t no = in.T * c->Hv * c->dv, nq = in.T * in.C, nh = in.T * c->Hv;
    double *o = dalloc(no), *dqkv = dalloc(nq), *dg = dalloc(nh), *db = dalloc(nh);
    ref_gdn(c, in.cu, in.qkv, in.g, in.beta, in.dout, o, dqkv, dg, db);
    double *xs[3] = {in.qkv, in.g, in.beta}, *gs[3] = {dqkv, dg, db};
    const int64_t ns[3] = {nq, nh, nh};
    const char *names[3] = {"qkv", "g", "beta"};
    double worst = 0;
    for (int p = 0; p < 3; p++)
        for (int r = 0; r < 40; r++) {
            int64_t i = (int64_t)(loom_rng_uniform(38, 400 + p, (uint64_t)r) * (double)ns[p]);
            const double x0 = xs[p][i], hstep = 1e-5;
            xs[p][i] = x0 + hstep;
            double lp = ref_gdn(c, in.cu, in.qkv, in.g, in.beta, in.dout, o, NULL, NULL, NULL);
            xs[p][i] = x0 - hstep;
            double lm = ref_gdn(c, in.cu, in.qkv, in.g, in.beta, in.dout, o, NULL, NULL, NULL);
            xs[p][i] = x0;
            double fd = (lp - lm) / (2 * hstep), e = fabs(fd - gs[p][i]) / (1 + fabs(fd));
            if (e > worst) worst = e;
            CHECK_MSG(e < 1e-7, "d%s[%lld]: reverse mode %.10g, differences %.10g", names[p],
                      (long long)i, gs[p][i], fd);
        }
    printf("  float64 reverse mode vs central differences: max error %.2e\n", worst);
    free(o), free(dqkv), free(dg), free(db);
    ginputs_free(&in);
}
