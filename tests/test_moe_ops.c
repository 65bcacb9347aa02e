/* The mixture-of-experts CPU reference ops (src/backend/cpu/cpu_moe.h,
 * issue 37's first step): the load-balancing loss against transformers'
 * value on the tiny-qwen3-moe fixture's router logits, the router's
 * logsumexp (the z-loss's) against a double-precision one of the same
 * logits, the router's backward with the loss's and the z-loss's gradients
 * against finite differences, the grouping of tokens by expert and back
 * (dropless, and with a capacity under both drop policies) against a
 * per-token loop, and the shared expert's gate against its definition and
 * finite differences. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend/cpu/cpu_moe.h"
#include "../src/core/rng.h"
#include "../src/core/core.h"
#include "../src/io/safetensors.h"
#include "../src/model/moe_tabs.h"
#include "harness.h"

static float frnd(uint64_t seed, int64_t i, float a) {
    return (float)((double)(loom_splitmix64(seed + (uint64_t)i) >> 11) / 9007199254740992.0 *
                   2.0 - 1.0) * a;
}

/* transformers' load_balancing_loss_func over the four layers' router
 * logits of the fixture (concatenated), top-2 of 8 experts */
TEST(moe_aux_loss_matches_hf) {
    char path[1024], jpath[1024];
    snprintf(path, sizeof path, "%s/golden/tiny-qwen3-moe.safetensors", loom_test_fixtures());
    snprintf(jpath, sizeof jpath, "%s/golden/tiny-qwen3-moe.json", loom_test_fixtures());
    REQUIRE_FIXTURE(path);
    REQUIRE_FIXTURE(jpath);
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, path, &st));
    enum { L = 4, T = 48, E = 8, K = 2, N = L * T };
    float *z = malloc(sizeof(float) * N * E), *p = malloc(sizeof(float) * N * E),
          *w = malloc(sizeof(float) * N * K);
    int32_t *idx = malloc(sizeof(int32_t) * N * K);
    REQUIRE(z && p && w && idx);
    for (int l = 0; l < L; l++) {
        char name[64];
        snprintf(name, sizeof name, "router_logits.%d", l);
        const loom_st_tensor *t = loom_st_find(st, name);
        REQUIRE(t && t->numel == T * E);
        REQUIRE_OK(ctx, loom_st_read(ctx, t, LOOM_F32, z + (size_t)l * T * E, t->numel));
    }
    float *lse = malloc(sizeof(float) * N);
    REQUIRE(lse);
    loom_cpu_router_fwd(z, N, E, K, true, p, idx, w, NULL, lse);
    double scratch[2 * E];
    const double aux = loom_cpu_moe_aux_loss(p, idx, N, E, K, 1.0f, scratch, NULL);
    char *json = NULL;
    size_t len = 0;
    REQUIRE_OK(ctx, loom_read_file(ctx, jpath, 1 << 20, &json, &len));
    const char *at = strstr(json, "\"hf_aux_loss_unscaled\":");
    REQUIRE(at);
    const double hf = strtod(at + strlen("\"hf_aux_loss_unscaled\":"), NULL);
    CHECK_NEAR(aux, hf, 1e-6 * hf);
    for (int64_t n = 0; n < N; n++) { /* renormalised top-2 weights sum to 1, descending */
        CHECK_NEAR(w[n * K] + w[n * K + 1], 1.0, 1e-6);
        CHECK(w[n * K] >= w[n * K + 1] && idx[n * K] != idx[n * K + 1]);
    }
    /* the z-loss (Megatron's z_loss_func per layer, summed over layers):
     * from the router's fp32 lse against logsumexp in double */
    double zl = 0.0, want = 0.0, worst = 0.0;
    for (int l = 0; l < L; l++)
        for (int t = 0; t < T; t++) {
            const float *zr = z + (size_t)(l * T + t) * E;
            double mx = -INFINITY, sum = 0.0;
            for (int e = 0; e < E; e++) mx = fmax(mx, zr[e]);
            for (int e = 0; e < E; e++) sum += exp(zr[e] - mx);
            const double ref = mx + log(sum), got = lse[l * T + t];
            worst = fmax(worst, fabs(got - ref));
            zl += got * got / T, want += ref * ref / T;
        }
    CHECK_MSG(worst < 1e-5, "lse off by %.3g", worst);
    CHECK_MSG(fabs(zl - want) <= 1e-6 * want && want > 0.1, "z-loss %.9g, want %.9g", zl, want);
    free(json);
    free(z), free(p), free(w), free(idx), free(lse);
    loom_st_close(st);
    loom_ctx_free(ctx);
}

/* L(z) = sum c * w + sum d[e] * probs[., e] (+ the aux loss times a, + the
 * z-loss, mean lse^2, times az): the router's backward against central
 * differences, with and without renormalisation */
static double objective(const float *z, int64_t N, int64_t E, int k, bool norm, const float *c,
                        const float *d, float a, float az, float *p, int32_t *idx, float *w,
                        float *lse, double *scratch) {
    loom_cpu_router_fwd(z, N, E, k, norm, p, idx, w, NULL, lse);
    double L = a * loom_cpu_moe_aux_loss(p, idx, N, E, k, 1.0f, scratch, NULL);
    for (int64_t n = 0; n < N; n++) L += az * (double)lse[n] * lse[n] / (double)N;
    for (int64_t i = 0; i < N * k; i++) L += (double)c[i] * w[i];
    for (int64_t i = 0; i < N * E; i++) L += (double)d[i % E] * p[i];
    return L;
}

TEST(moe_router_backward_matches_differences) {
    enum { N = 6, E = 7, K = 3 };
    const uint64_t seed = (uint64_t)loom_now_s() * 31u;
    float z[N * E], c[N * K], d[E], p[N * E], w[N * K], dz[N * E], dw[N * K], dp[E], lse[N];
    int32_t idx[N * K], idx0[N * K];
    double scratch[2 * E];
    for (int i = 0; i < N * E; i++) z[i] = frnd(seed, i, 3.0f);
    for (int i = 0; i < E; i++) d[i] = frnd(seed + 99, i, 1.0f);
    for (int i = 0; i < N * K; i++) c[i] = frnd(seed + 7, i, 1.0f);
    for (int norm = 0; norm < 4; norm++) { /* norm 2, 3: with the z-loss */
        const float a = 0.5f, az = norm >= 2 ? 0.75f : 0.0f, zc = 2.0f * az / N;
        objective(z, N, E, K, norm & 1, c, d, a, az, p, idx0, w, lse, scratch);
        loom_cpu_moe_aux_loss(p, idx0, N, E, K, a, scratch, dp);
        for (int i = 0; i < E; i++) dp[i] += d[i];
        memcpy(dw, c, sizeof dw);
        loom_cpu_router_bwd(p, idx0, dw, dp, az > 0 ? lse : NULL, &zc, N, E, K, norm & 1, dz);
        double worst = 0.0;
        int checked = 0;
        for (int i = 0; i < N * E; i++) {
            const float h = 1e-3f, z0 = z[i];
            z[i] = z0 + h;
            const double up = objective(z, N, E, K, norm & 1, c, d, a, az, p, idx, w, lse, scratch);
            bool flip = memcmp(idx, idx0, sizeof idx) != 0;
            z[i] = z0 - h;
            const double dn = objective(z, N, E, K, norm & 1, c, d, a, az, p, idx, w, lse, scratch);
            flip |= memcmp(idx, idx0, sizeof idx) != 0;
            z[i] = z0;
            if (flip) continue; /* a near tie: the step changed the experts chosen */
            checked++;
            worst = fmax(worst, fabs((up - dn) / (2.0 * h) - dz[i]));
        }
        CHECK_MSG(checked >= N * E * 9 / 10, "only %d of %d logits away from a tie", checked,
                  N * E);
        CHECK_MSG(worst < 2e-3, "norm_topk=%d z-loss=%d: router gradient off by %.3g", norm & 1,
                  norm >= 2, worst);
    }
}

/* Grouped by expert and back: expert e's work is x * (e + 1) on its rows */
TEST(moe_route_permute_combine_match_a_token_loop) {
    enum { N = 11, E = 5, K = 2, H = 6 };
    const uint64_t seed = (uint64_t)loom_now_s() * 17u;
    float z[N * E], p[N * E], w[N * K], x[N * H], dy[N * H];
    int32_t idx[N * K], counts[E], order[N * K], pos[N * K];
    for (int i = 0; i < N * E; i++) z[i] = frnd(seed, i, 2.0f);
    for (int i = 0; i < N * H; i++) x[i] = frnd(seed + 5, i, 1.0f), dy[i] = frnd(seed + 9, i, 1.0f);
    float psum[E];
    for (int e = 0; e < E; e++) psum[e] = 0.25f;
    loom_cpu_router_fwd(z, N, E, K, true, p, idx, w, psum, NULL);
    for (int e = 0; e < E; e++) { /* psum += the column sums of probs */
        double s = 0.25;
        for (int n = 0; n < N; n++) s += p[n * E + e];
        CHECK_NEAR(psum[e], s, 1e-6);
    }
    loom_cpu_moe_route(idx, w, N, E, K, -1, false, counts, order, pos);
    float xg[N * K * H], yg[N * K * H], y[N * H], dyg[N * K * H], dw[N * K], dx[N * H];
    loom_cpu_moe_permute(x, order, N, K, H, xg);
    int64_t row = 0, total = 0;
    for (int e = 0; e < E; e++) {
        for (int32_t r = 0; r < counts[e]; r++, row++) {
            CHECK_EQ_INT(idx[order[row]], e); /* grouped by expert */
            if (r) CHECK(order[row] > order[row - 1]); /* in token order */
            for (int h = 0; h < H; h++) yg[row * H + h] = xg[row * H + h] * (float)(e + 1);
        }
        total += counts[e];
    }
    CHECK_EQ_INT(total, N * K);
    for (int c = 0; c < N * K; c++) CHECK_EQ_INT(order[pos[c]], c);
    loom_cpu_moe_combine(yg, pos, w, N, K, H, y);
    loom_cpu_moe_combine_bwd(dy, yg, order, w, N, K, H, dyg, dw);
    for (int64_t r = 0; r < N * K; r++) /* the experts' backward: times (e + 1) */
        for (int h = 0; h < H; h++) dyg[r * H + h] *= (float)(idx[order[r]] + 1);
    loom_cpu_moe_permute_bwd(dyg, pos, N, K, H, dx);
    double worst = 0.0;
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            double want = 0.0, want_dx = 0.0;
            for (int j = 0; j < K; j++) {
                const int e = idx[n * K + j];
                want += (double)w[n * K + j] * x[n * H + h] * (e + 1);
                want_dx += (double)w[n * K + j] * (e + 1) * dy[n * H + h];
            }
            worst = fmax(worst, fabs(y[n * H + h] - want) + fabs(dx[n * H + h] - want_dx));
        }
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) {
            double want = 0.0;
            for (int h = 0; h < H; h++)
                want += (double)dy[n * H + h] * x[n * H + h] * (idx[n * K + j] + 1);
            worst = fmax(worst, fabs(dw[n * K + j] - want));
        }
    CHECK_MSG(worst < 1e-5, "grouped compute differs from the token loop by %.3g", worst);
}

/* Capacity (Megatron's token dropping): each expert keeps its cap choices
 * of the largest weight (ties: the earlier token) or of the first tokens,
 * against choices kept by sorting each expert's; then the rows' ops with
 * the dropped choices against a loop over the kept ones (expert e's work:
 * x * (e + 1)). Skewed choices (expert 0 or 1 first) overflow a few
 * experts; weights on a grid of 8 levels make ties. */
static int by_weight(const void *a, const void *b, void *u) {
    const float *w = u;
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (w[x] != w[y]) return w[x] > w[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

TEST(moe_route_capacity_matches_a_sort) {
    enum { N = 40, E = 6, K = 2, H = 5 };
    const uint64_t seed = (uint64_t)loom_now_s() * 13u;
    int32_t idx[N * K], counts[E], order[N * K], pos[N * K];
    float w[N * K], x[N * H], dy[N * H];
    for (int n = 0; n < N; n++) {
        const uint64_t h = loom_splitmix64(seed + (uint64_t)n);
        idx[n * K] = (int32_t)(h % 2);
        idx[n * K + 1] = (int32_t)(2 + (h >> 8) % 4);
        for (int j = 0; j < K; j++) w[n * K + j] = (float)((h >> (16 + 3 * j)) % 8) / 8.0f;
    }
    for (int i = 0; i < N * H; i++) x[i] = frnd(seed + 5, i, 1.0f), dy[i] = frnd(seed + 9, i, 1.0f);
    const int64_t caps[] = {0, 3, 9, 17, 39, 40, -1};
    for (size_t ci = 0; ci < sizeof caps / sizeof *caps; ci++)
        for (int by_pos = 0; by_pos < 2; by_pos++) {
            const int64_t cap = caps[ci];
            loom_cpu_moe_route(idx, w, N, E, K, cap, by_pos, counts, order, pos);
            /* the want: each expert's choices in token order, sorted by
             * weight for "probs"; the first cap kept */
            bool keep[N * K];
            int64_t kept = 0, total = 0;
            for (int e = 0; e < E; e++) {
                int32_t mine[N * K];
                int n = 0;
                for (int c = 0; c < N * K; c++)
                    if (idx[c] == e) mine[n++] = c;
                CHECK_EQ_INT(counts[e], n);
                if (!by_pos) qsort_r(mine, (size_t)n, sizeof *mine, by_weight, w);
                for (int i = 0; i < n; i++) keep[mine[i]] = cap < 0 || i < cap;
                kept += cap < 0 || n < cap ? n : cap;
                total += n;
            }
            CHECK_EQ_INT(total, N * K);
            /* the layout: the kept grouped by expert in token order, then
             * the dropped the same way, as -1 - c */
            int64_t p = 0;
            for (int pass = 0; pass < 2; pass++)
                for (int e = 0; e < E; e++)
                    for (int c = 0; c < N * K; c++) {
                        if (idx[c] != e || keep[c] != !pass) continue;
                        CHECK_EQ_INT(order[p], pass ? -1 - c : c);
                        CHECK_EQ_INT(pos[c], pass ? -1 : p);
                        p++;
                    }
            CHECK_EQ_INT(p, N * K);
            /* the rows: kept rows only; a dropped choice adds nothing and
             * its weight's gradient is 0 */
            float xg[N * K * H], yg[N * K * H], y[N * H], dyg[N * K * H], dw[N * K], dx[N * H];
            for (int i = 0; i < N * K * H; i++) xg[i] = yg[i] = dyg[i] = NAN; /* never read */
            loom_cpu_moe_permute(x, order, N, K, H, xg);
            for (int64_t r = 0; r < N * K; r++)
                for (int h = 0; h < H; h++)
                    if (r < kept) {
                        CHECK(xg[r * H + h] == x[order[r] / K * H + h]);
                        yg[r * H + h] = xg[r * H + h] * (float)(idx[order[r]] + 1);
                    } else {
                        CHECK(isnan(xg[r * H + h])); /* a dropped row is left alone */
                    }
            loom_cpu_moe_combine(yg, pos, w, N, K, H, y);
            for (int i = 0; i < N * K; i++) dw[i] = NAN;
            loom_cpu_moe_combine_bwd(dy, yg, order, w, N, K, H, dyg, dw);
            for (int64_t r = 0; r < kept; r++)
                for (int h = 0; h < H; h++) dyg[r * H + h] *= (float)(idx[order[r]] + 1);
            loom_cpu_moe_permute_bwd(dyg, pos, N, K, H, dx);
            double worst = 0.0;
            for (int n = 0; n < N; n++)
                for (int h = 0; h < H; h++) {
                    double want = 0.0, want_dx = 0.0;
                    for (int j = 0; j < K; j++) {
                        const int c = n * K + j, e = idx[c];
                        if (!keep[c]) continue;
                        want += (double)w[c] * x[n * H + h] * (e + 1);
                        want_dx += (double)w[c] * (e + 1) * dy[n * H + h];
                    }
                    worst = fmax(worst, fabs(y[n * H + h] - want) + fabs(dx[n * H + h] - want_dx));
                }
            for (int c = 0; c < N * K; c++) {
                double want = 0.0;
                for (int h = 0; keep[c] && h < H; h++)
                    want += (double)dy[c / K * H + h] * x[c / K * H + h] * (idx[c] + 1);
                worst = fmax(worst, fabs(dw[c] - want));
            }
            CHECK_MSG(worst < 1e-5, "cap %lld, %s: grouped compute differs from the loop by %.3g",
                      (long long)cap, by_pos ? "position" : "probs", worst);
        }
}

/* The z-loss against tools/make_fixtures_moe.py's router_z_loss of the
 * tiny-qwen2-moe fixture (torch's logsumexp of each MoE layer's router
 * logits, squared, its mean, summed over the layers), when that fixture is
 * there. */
TEST(moe_z_loss_matches_the_qwen2_moe_fixture) {
    char path[1024], jpath[1024];
    const char *fx = loom_test_fixtures_of("tiny-qwen2-moe");
    snprintf(path, sizeof path, "%s/golden/tiny-qwen2-moe.safetensors", fx);
    snprintf(jpath, sizeof jpath, "%s/golden/tiny-qwen2-moe.json", fx);
    if (!loom_file_exists(path) || !loom_file_exists(jpath))
        SKIP("no tiny-qwen2-moe fixture (tools/make_fixtures_moe.py writes it)");
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, path, &st));
    char *json = NULL;
    size_t len = 0;
    REQUIRE_OK(ctx, loom_read_file(ctx, jpath, 1 << 20, &json, &len));
    const char *at = strstr(json, "\"router_z_loss\":");
    REQUIRE(at);
    const double want = strtod(at + strlen("\"router_z_loss\":"), NULL);
    double got = 0.0;
    int layers = 0;
    for (;; layers++) {
        char name[64];
        snprintf(name, sizeof name, "router_logits.%d", layers);
        const loom_st_tensor *t = loom_st_find(st, name);
        if (!t) break;
        REQUIRE(t->ndim == 2);
        const int64_t N = t->shape[0], E = t->shape[1], K = E < 2 ? E : 2;
        float *z = malloc(sizeof(float) * (size_t)(N * E)),
              *p = malloc(sizeof(float) * (size_t)(N * E)),
              *w = malloc(sizeof(float) * (size_t)(N * K)),
              *lse = malloc(sizeof(float) * (size_t)N);
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)(N * K));
        REQUIRE(z && p && w && lse && idx);
        REQUIRE_OK(ctx, loom_st_read(ctx, t, LOOM_F32, z, t->numel));
        loom_cpu_router_fwd(z, N, E, (int)K, false, p, idx, w, NULL, lse);
        double s = 0.0;
        for (int64_t n = 0; n < N; n++) s += (double)lse[n] * lse[n];
        got += s / (double)N;
        free(z), free(p), free(w), free(lse), free(idx);
    }
    CHECK(layers > 0);
    CHECK_MSG(fabs(got - want) <= 1e-5 * want, "z-loss over %d layers %.9g, fixture %.9g", layers,
              got, want);
    free(json);
    loom_st_close(st);
    loom_ctx_free(ctx);
}

/* The shared expert's gate: g = sigmoid(z) and y += g s against the
 * definition, and its backward against central differences of L = sum
 * c . y through a down projection s = a D^T (D fixed): dz from the
 * projection's input gradient da = (g c) D must be dL/dz. */
TEST(moe_gate_matches_definition_and_differences) {
    enum { N = 5, H = 6, I = 4 };
    float z[N], a[N * I], D[H * I], c[N * H], y0[N * H];
    for (int i = 0; i < N; i++) z[i] = frnd(11, i, 3.0f);
    for (int i = 0; i < N * I; i++) a[i] = frnd(12, i, 1.0f);
    for (int i = 0; i < H * I; i++) D[i] = frnd(13, i, 1.0f);
    for (int i = 0; i < N * H; i++) c[i] = frnd(14, i, 1.0f), y0[i] = frnd(15, i, 1.0f);
    float s[N * H], g[N], y[N * H], da[N * I], dz[N], g2[N], y2[N * H];
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++) {
            double v = 0.0;
            for (int i = 0; i < I; i++) v += (double)a[n * I + i] * D[h * I + i];
            s[n * H + h] = (float)v;
        }
    memcpy(y, y0, sizeof y);
    loom_cpu_moe_gate_fwd(z, s, N, H, true, g, y);
    for (int n = 0; n < N; n++) {
        const double gw = 1.0 / (1.0 + exp(-(double)z[n]));
        CHECK_NEAR(g[n], gw, 1e-6);
        for (int h = 0; h < H; h++) CHECK_NEAR(y[n * H + h], y0[n * H + h] + gw * s[n * H + h], 1e-5);
    }
    loom_cpu_moe_gate_fwd(z, NULL, N, H, false, g2, NULL); /* g alone */
    CHECK(!memcmp(g, g2, sizeof g));
    loom_cpu_moe_gate_fwd(NULL, s, N, H, false, g, y2); /* g given, not accumulated */
    for (int i = 0; i < N * H; i++) CHECK_NEAR(y2[i], g[i / H] * s[i], 1e-7);
    /* da = (g c) D, then dz */
    for (int n = 0; n < N; n++)
        for (int i = 0; i < I; i++) {
            double v = 0.0;
            for (int h = 0; h < H; h++) v += (double)g[n] * c[n * H + h] * D[h * I + i];
            da[n * I + i] = (float)v;
        }
    loom_cpu_moe_gate_bwd(da, a, g, N, I, dz);
    for (int n = 0; n < N; n++) {
        double f[2];
        for (int sg = 0; sg < 2; sg++) {
            const double zz = z[n] + (sg ? -1e-4 : 1e-4), gg = 1.0 / (1.0 + exp(-zz));
            f[sg] = 0.0;
            for (int h = 0; h < H; h++) f[sg] += c[n * H + h] * gg * s[n * H + h];
        }
        CHECK_NEAR(dz[n], (f[0] - f[1]) / 2e-4, 1e-4);
    }
}

/* The routing tables' host copies (src/model/moe_tabs.h): per layer and
 * key, the last put wins; another layer, another key or other sizes find
 * nothing; the count table may be empty (one rank's experts all local). */
TEST(moe_tabs_keep_each_layers_tables_by_key) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_moe_tabs *t = NULL;
    int32_t cnt[8], rc[6], got[8], gotrc[6];
    int keys[3];
    CHECK(!loom_moe_tabs_get(t, 0, &keys[0], got, 8, gotrc, 6)); /* none made yet */
    for (int l = 0; l < 3; l++)
        for (int k = 0; k < 3; k++) {
            for (int i = 0; i < 8; i++) cnt[i] = 100 * l + 10 * k + i;
            for (int i = 0; i < 6; i++) rc[i] = -(100 * l + 10 * k + i);
            REQUIRE_OK(ctx, loom_moe_tabs_put(ctx, &t, 3, l, &keys[k], cnt, 8, rc, l == 2 ? 0 : 6));
        }
    for (int l = 0; l < 3; l++)
        for (int k = 0; k < 3; k++) {
            const int64_t nrc = l == 2 ? 0 : 6;
            REQUIRE(loom_moe_tabs_get(t, l, &keys[k], got, 8, gotrc, nrc));
            for (int i = 0; i < 8; i++) CHECK_EQ_INT(got[i], 100 * l + 10 * k + i);
            for (int i = 0; i < nrc; i++) CHECK_EQ_INT(gotrc[i], -(100 * l + 10 * k + i));
            CHECK(!loom_moe_tabs_get(t, l, &keys[k], got, 7, gotrc, nrc)); /* other sizes */
        }
    CHECK(!loom_moe_tabs_get(t, 3, &keys[0], got, 8, gotrc, 6)); /* past the layers */
    CHECK(!loom_moe_tabs_get(t, 0, &cnt[0], got, 8, gotrc, 6));  /* a key never put */
    /* a new forward of the same set replaces its tables, also in size */
    for (int i = 0; i < 8; i++) cnt[i] = 7 * i;
    REQUIRE_OK(ctx, loom_moe_tabs_put(ctx, &t, 3, 1, &keys[2], cnt, 8, rc, 0));
    CHECK(!loom_moe_tabs_get(t, 1, &keys[2], got, 8, gotrc, 6));
    REQUIRE(loom_moe_tabs_get(t, 1, &keys[2], got, 8, gotrc, 0));
    CHECK_EQ_INT(got[5], 35);
    CHECK(loom_moe_tabs_put(ctx, &t, 3, 3, &keys[0], cnt, 8, rc, 0) == LOOM_ERR_INTERNAL);
    loom_moe_tabs_free(t);
    loom_ctx_free(ctx);
}

/* The expert-parallel regrouping (loom_cpu_moe_regroup): the gathered rows,
 * (source, expert) blocks in turn, listed by (expert, source) keep each
 * block's order; the second half inverts the first. */
TEST(moe_regroup_orders_rows_by_expert_then_source) {
    enum { S = 3, El = 5 };
    int32_t rc[S * El];
    const uint64_t seed = (uint64_t)loom_now_s();
    int64_t Rt = 0;
    for (int i = 0; i < S * El; i++) Rt += rc[i] = (int32_t)(loom_splitmix64(seed + (uint64_t)i) % 7);
    int32_t *ix = malloc((size_t)(2 * Rt + 1) * sizeof *ix), *want = malloc((size_t)(Rt + 1) * 4);
    REQUIRE(ix && want);
    loom_cpu_moe_regroup(rc, S, El, Rt, ix);
    int64_t j = 0;
    for (int f = 0; f < El; f++)
        for (int s = 0; s < S; s++) {
            int64_t first = 0; /* block (s, f)'s first gathered row */
            for (int b = 0; b < s * El + f; b++) first += rc[b];
            for (int r = 0; r < rc[s * El + f]; r++) want[j++] = (int32_t)(first + r);
        }
    CHECK_EQ_INT(j, Rt);
    for (int64_t g = 0; g < Rt; g++) {
        CHECK_MSG(ix[g] == want[g], "grouped row %lld: gathered %d, want %d", (long long)g, ix[g],
                  want[g]);
        CHECK(ix[Rt + want[g]] == (int32_t)g);
    }
    free(ix), free(want);
}

/* The once-per-rank dispatch's tables (cpu_moe.h): each token goes once to
 * each rank holding one of its experts, with its choices as that rank's
 * local experts (El where elsewhere) and its weights; the masked grouping
 * leaves only those; the weight gradients come back from the one rank of
 * each choice. */
TEST(moe_dedup_tables_send_each_token_once_a_rank) {
    enum { N = 37, K = 3, El = 4, P = 3 };
    int32_t idx[N * K], dest[N * P], ord[N * P], pos[N * P], cnt[P + 1];
    float w[N * K];
    const uint64_t seed = (uint64_t)loom_now_s();
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) { /* distinct experts a token */
            idx[n * K + j] = (int32_t)((loom_splitmix64(seed + (uint64_t)n) + (uint64_t)j * 5) %
                                       (El * P));
            w[n * K + j] = (float)(n * K + j);
        }
    loom_cpu_moe_dest(idx, N, K, El, P, dest);
    loom_cpu_moe_route(dest, NULL, N, P + 1, P, -1, false, cnt, ord, pos);
    int64_t U = 0;
    for (int p = 0; p < P; p++) U += cnt[p];
    int32_t tok[N * P], mid[N * P * K];
    float mw[N * P * K];
    loom_cpu_moe_dedup_meta(ord, U, idx, w, K, El, P, tok, mid, mw);
    int64_t i = 0;
    for (int p = 0; p < P; p++)
        for (int n = 0; n < N; n++) {
            bool has = false;
            for (int j = 0; j < K; j++) has |= idx[n * K + j] / El == p;
            CHECK_EQ_INT(dest[n * P + p], has ? p : P);
            if (!has) continue;
            CHECK_EQ_INT(tok[i], n); /* rank by rank, tokens in order */
            for (int j = 0; j < K; j++) {
                CHECK_EQ_INT(mid[i * K + j], idx[n * K + j] / El == p ? idx[n * K + j] % El : El);
                CHECK(mw[i * K + j] == w[n * K + j]);
            }
            i++;
        }
    CHECK_EQ_INT(i, U);
    loom_cpu_moe_mask(dest, N, P, P, ord, pos);
    float dwb[N * P * K], dw[N * K];
    for (int64_t u = 0; u < U; u++) /* a rank's gradient: its own choices only */
        for (int j = 0; j < K; j++)
            dwb[u * K + j] = mid[u * K + j] < El ? 1000.0f * (float)tok[u] + (float)j : 0.0f;
    loom_cpu_moe_dedup_dw(dwb, pos, N, P, K, dw);
    for (int n = 0; n < N; n++) {
        for (int p = 0; p < P; p++) CHECK((pos[n * P + p] >= 0) == (dest[n * P + p] == p));
        for (int j = 0; j < K; j++) CHECK(dw[n * K + j] == 1000.0f * (float)n + (float)j);
    }
}
