/* AdamW (torch semantics, decoupled weight decay), deterministic sum of
 * squares, gradient clipping. */
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "harness.h"

#include "../src/backend/adamw.h"

/* Reproducible values in [-1, 1) (splitmix64). */
static double urand(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

/* Textbook AdamW in double: the oracle. */
static void ref_step(double *p, const float *g, double *m, double *v, size_t n,
                     const loom_adamw_hp *hp, int64_t t, bool decay) {
    for (size_t i = 0; i < n; i++) {
        if (decay) p[i] -= hp->lr * hp->weight_decay * p[i];
        m[i] = hp->beta1 * m[i] + (1 - hp->beta1) * g[i];
        v[i] = hp->beta2 * v[i] + (1 - hp->beta2) * (double)g[i] * g[i];
        double mhat = m[i] / (1 - pow(hp->beta1, (double)t));
        double vhat = v[i] / (1 - pow(hp->beta2, (double)t));
        p[i] -= hp->lr * mhat / (sqrt(vhat) + hp->eps);
    }
}

static void check_against_reference(bool decay) {
    enum { N = 1000, STEPS = 8 };
    const loom_adamw_hp hp = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                              .weight_decay = 0.1};
    static float p[N], g[N], m[N], v[N];
    static double pr[N], mr[N], vr[N];
    uint64_t s = decay ? 1 : 2;
    for (int i = 0; i < N; i++) {
        double x = urand(&s);
        p[i] = (float)(x + (x < 0 ? -0.5 : 0.5)); /* |p| in [0.5, 1.5) */
        pr[i] = p[i];
        m[i] = v[i] = 0.0f;
        mr[i] = vr[i] = 0.0;
    }
    double worst_p = 0, worst_m = 0, worst_v = 0;
    for (int64_t t = 1; t <= STEPS; t++) {
        for (int i = 0; i < N; i++) g[i] = (float)(urand(&s) * (i % 7 == 0 ? 1e-3 : 1.0));
        loom_adamw_step(p, g, m, v, N, &hp, t, decay);
        ref_step(pr, g, mr, vr, N, &hp, t, decay);
        double mmax = 0;
        for (int i = 0; i < N; i++) mmax = fmax(mmax, fabs(mr[i]));
        for (int i = 0; i < N; i++) {
            worst_p = fmax(worst_p, fabs(p[i] - pr[i]) / fabs(pr[i]));
            worst_m = fmax(worst_m, fabs(m[i] - mr[i]) / mmax);
            if (vr[i] > 0) worst_v = fmax(worst_v, fabs(v[i] - vr[i]) / vr[i]);
        }
    }
    CHECK_MSG(worst_p < 1e-6, "p relative error %g", worst_p);
    CHECK_MSG(worst_m < 1e-6, "m relative error %g", worst_m);
    CHECK_MSG(worst_v < 1e-6, "v relative error %g", worst_v);
}

TEST(adamw_matches_reference_decay) { check_against_reference(true); }
TEST(adamw_matches_reference_no_decay) { check_against_reference(false); }

/* Step 1: mhat = g and vhat = g*g, so each parameter moves by lr*g/(|g|+eps)
 * = about lr*sign(g), whatever the size of g. */
TEST(adamw_first_step_bias_correction) {
    const loom_adamw_hp hp = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                              .weight_decay = 0.0};
    float p[6] = {1, 1, 1, 1, 1, 1}, m[6] = {0}, v[6] = {0};
    const float g[6] = {3.0f, -0.02f, 1e-2f, -100.0f, 0.5f, -1.0f};
    loom_adamw_step(p, g, m, v, 6, &hp, 1, true);
    for (int i = 0; i < 6; i++) {
        double moved = (double)p[i] - 1.0;
        double want = g[i] > 0 ? -1e-2 : 1e-2;
        CHECK_MSG(fabs(moved - want) < 1e-2 * 1e-5, "p[%d] moved %.9g, want %.9g", i, moved,
                  want);
    }
}

/* Zero gradients from zero moments: only the decay acts, p *= (1 - lr*wd). */
TEST(adamw_zero_grad_decay) {
    const loom_adamw_hp hp = {.lr = 3e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                              .weight_decay = 0.1};
    enum { N = 64 };
    float p[N], q[N], g[N] = {0}, m[N] = {0}, v[N] = {0}, m2[N] = {0}, v2[N] = {0};
    uint64_t s = 7;
    for (int i = 0; i < N; i++) p[i] = q[i] = (float)urand(&s);
    float p0[N];
    memcpy(p0, p, sizeof p);
    loom_adamw_step(p, g, m, v, N, &hp, 1, true);
    loom_adamw_step(q, g, m2, v2, N, &hp, 1, false);
    const float shrink = (float)(1.0 - 3e-4 * 0.1);
    for (int i = 0; i < N; i++) {
        CHECK_MSG(p[i] == p0[i] * shrink, "p[%d] %.9g != %.9g", i, p[i], p0[i] * shrink);
        CHECK_NEAR(p[i], (double)p0[i] * (1.0 - 3e-5), 1e-7 * fabs(p0[i]));
        CHECK(q[i] == p0[i]); /* no decay: unchanged */
        CHECK(m[i] == 0.0f && v[i] == 0.0f);
    }
}

TEST(adamw_decays_rule) {
    CHECK(!loom_adamw_decays(1));
    CHECK(loom_adamw_decays(2));
    CHECK(loom_adamw_decays(3));
    CHECK(!loom_adamw_decays(0));
}

#ifdef _OPENMP
TEST(adamw_step_thread_independent) {
    enum { N = 300000 };
    const loom_adamw_hp hp = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                              .weight_decay = 0.01};
    float *buf = calloc(8 * (size_t)N, sizeof(float));
    REQUIRE(buf);
    float *p1 = buf, *m1 = buf + N, *v1 = buf + 2 * N, *p2 = buf + 3 * N, *m2 = buf + 4 * N,
          *v2 = buf + 5 * N, *g = buf + 6 * N;
    uint64_t s = 11;
    for (int i = 0; i < N; i++) p1[i] = p2[i] = (float)urand(&s);
    int saved = omp_get_max_threads();
    for (int64_t t = 1; t <= 3; t++) {
        for (int i = 0; i < N; i++) g[i] = (float)urand(&s);
        omp_set_num_threads(1);
        loom_adamw_step(p1, g, m1, v1, N, &hp, t, true);
        omp_set_num_threads(2);
        loom_adamw_step(p2, g, m2, v2, N, &hp, t, true);
    }
    omp_set_num_threads(saved);
    CHECK(memcmp(p1, p2, N * sizeof(float)) == 0);
    CHECK(memcmp(m1, m2, N * sizeof(float)) == 0);
    CHECK(memcmp(v1, v2, N * sizeof(float)) == 0);
    free(buf);
}
#endif

TEST(adamw_sumsq_deterministic) {
    enum { N = 1000000 };
    float *g = malloc(N * sizeof(float));
    REQUIRE(g);
    uint64_t s = 3;
    for (int i = 0; i < N; i++) g[i] = (float)(urand(&s) * 10.0);
    long double exact = 0; /* plain serial sum, a looser check of the value */
    for (int i = 0; i < N; i++) exact += (long double)g[i] * g[i];
#ifdef _OPENMP
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    double a = loom_sumsq(g, N);
    omp_set_num_threads(2);
    double b = loom_sumsq(g, N);
    omp_set_num_threads(3);
    double c = loom_sumsq(g, N);
    omp_set_num_threads(saved);
    CHECK_MSG(memcmp(&a, &b, sizeof a) == 0, "1 thread %.17g, 2 threads %.17g", a, b);
    CHECK_MSG(memcmp(&a, &c, sizeof a) == 0, "1 thread %.17g, 3 threads %.17g", a, c);
#else
    double a = loom_sumsq(g, N);
#endif
    CHECK_NEAR(a, (double)exact, 1e-12 * (double)exact);
    /* sizes around the chunk and block edges */
    for (size_t n = 0; n < 3 * LOOM_SUMSQ_CHUNK + 5; n += LOOM_SUMSQ_CHUNK / 2 + 1) {
        long double e = 0;
        for (size_t i = 0; i < n; i++) e += (long double)g[i] * g[i];
        CHECK_NEAR(loom_sumsq(g, n), (double)e, 1e-12 * (double)e);
    }
    /* non-finite gradients surface in the norm */
    g[123456] = NAN;
    CHECK(!isfinite(loom_sumsq(g, N)));
    g[123456] = INFINITY;
    CHECK(!isfinite(sqrt(loom_sumsq(g, N))));
    free(g);
}

TEST(adamw_clip) {
    /* below max_norm: no scaling */
    CHECK(loom_clip_coeff(0.5, 1.0) == 1.0f);
    /* at the limit the 1e-6 still makes the coefficient < 1: Megatron scales then too */
    CHECK(loom_clip_coeff(1.0, 1.0) == (float)(1.0 / (1.0 + 1e-6)));
    CHECK(loom_clip_coeff(1.0, 1.0) < 1.0f);
    CHECK(loom_clip_coeff(1.0 - 1e-5, 1.0) == 1.0f);
    CHECK(loom_clip_coeff(0.0, 1.0) == 1.0f);
    CHECK(loom_clip_coeff(10.0, 0.0) == 1.0f); /* clipping off */
    CHECK(isnan(loom_clip_coeff(NAN, 1.0)));
    CHECK(isnan(loom_clip_coeff(INFINITY, 1.0)));
    CHECK(loom_clip_coeff(10.0, 1.0) == (float)(1.0 / (10.0 + 1e-6)));
    /* clip a gradient of norm 5 (3,4) to max_norm 1 */
    float g[2] = {3.0f, 4.0f};
    double norm = sqrt(loom_sumsq(g, 2));
    CHECK(norm == 5.0);
    float c = loom_clip_coeff(norm, 1.0);
    CHECK(c < 1.0f);
    CHECK_NEAR(sqrt(loom_sumsq_scaled(g, 2, c)), 1.0, 1e-6);
    /* the clipped step: the same as stepping on the clipped gradient, bit for bit */
    const loom_adamw_hp hp = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
    const float gs[2] = {0.5f, c}, g2[2] = {g[0] * 0.5f * c, g[1] * 0.5f * c};
    float p1[2] = {1.0f, -2.0f}, m1[2] = {0.1f, 0.2f}, v1[2] = {0.01f, 0.02f};
    float p2[2] = {1.0f, -2.0f}, m2[2] = {0.1f, 0.2f}, v2[2] = {0.01f, 0.02f};
    loom_adamw_step_scaled(p1, g, m1, v1, 2, &hp, 2, true, gs);
    loom_adamw_step(p2, g2, m2, v2, 2, &hp, 2, true);
    CHECK(memcmp(p1, p2, sizeof p1) == 0 && memcmp(m1, m2, sizeof m1) == 0 &&
          memcmp(v1, v2, sizeof v1) == 0);
    CHECK_NEAR(g2[0], 0.3, 1e-6);
}
