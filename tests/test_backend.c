/* The backend table (src/backend/backend.h): every backend built in and
 * usable here runs its ops on fresh random bytes and is held to the CPU
 * backend's results (ggml's test-backend-ops). On a machine without a GPU
 * the CPU backend is held to the C library (memcpy, loom_convert). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend/backend.h"
#include "../src/backend/cpu/cpu_moe.h"
#include "../src/core/core.h"
#include "../src/core/rng.h"
#include "harness.h"

/* The memory ops of one backend: zeroed allocation, upload / download
 * round trip, copy and zero on the device, F32 <-> BF16 / F16 conversion
 * (bit for bit against loom_convert), page-locked or plain host memory. */
static void memory_ops(loom_ctx *ctx, const loom_backend *be, loom_dev *d) {
    enum { N = 4099 }; /* odd: no size is a multiple of anything */
    float *h = malloc(N * sizeof *h), *back = malloc(N * sizeof *back);
    uint16_t *half = malloc(N * sizeof *half), *want = malloc(N * sizeof *want);
    REQUIRE(h && back && half && want);
    uint64_t seed = (uint64_t)loom_now_s() * 2654435761u + 17;
    for (int i = 0; i < N; i++)
        h[i] = (float)((double)(loom_splitmix64(seed + (uint64_t)i) >> 11) / 9007199254740992.0 *
                       200.0 - 100.0);
    void *a = NULL, *b = NULL, *c = NULL;
    REQUIRE_OK(ctx, be->alloc(d, ctx, &a, N * sizeof(float), "test a"));
    REQUIRE_OK(ctx, be->alloc(d, ctx, &b, N * sizeof(float), "test b"));
    REQUIRE_OK(ctx, be->alloc(d, ctx, &c, N * sizeof(uint16_t), "test c"));
    /* zeroed on allocation */
    REQUIRE_OK(ctx, be->download(d, ctx, back, a, N * sizeof(float)));
    bool zero = true;
    for (int i = 0; i < N; i++) zero &= back[i] == 0.0f;
    CHECK_MSG(zero, "%s: alloc did not zero", be->name);
    /* up, copy on the device, down */
    REQUIRE_OK(ctx, be->upload(d, ctx, a, h, N * sizeof(float)));
    REQUIRE_OK(ctx, be->copy(d, ctx, b, a, N * sizeof(float)));
    REQUIRE_OK(ctx, be->download(d, ctx, back, b, N * sizeof(float)));
    CHECK_MSG(!memcmp(back, h, N * sizeof *h), "%s: upload, copy, download changed the data",
              be->name);
    /* conversions, bit for bit against the C reference */
    const loom_dtype halves[2] = {LOOM_BF16, LOOM_F16};
    for (int k = 0; k < 2; k++) { /* a holds h throughout */
        REQUIRE_OK(ctx, loom_convert(ctx, want, halves[k], h, LOOM_F32, N));
        REQUIRE_OK(ctx, be->convert(d, ctx, c, halves[k], a, LOOM_F32, N));
        REQUIRE_OK(ctx, be->download(d, ctx, half, c, N * sizeof(uint16_t)));
        CHECK_MSG(!memcmp(half, want, N * sizeof *half), "%s: F32 -> %s differs from loom_convert",
                  be->name, loom_dtype_name(halves[k]));
        float *wide = malloc(N * sizeof *wide);
        REQUIRE(wide);
        REQUIRE_OK(ctx, loom_convert(ctx, wide, LOOM_F32, want, halves[k], N));
        REQUIRE_OK(ctx, be->convert(d, ctx, b, LOOM_F32, c, halves[k], N));
        REQUIRE_OK(ctx, be->download(d, ctx, back, b, N * sizeof(float)));
        CHECK_MSG(!memcmp(back, wide, N * sizeof *wide), "%s: %s -> F32 differs from loom_convert",
                  be->name, loom_dtype_name(halves[k]));
        free(wide);
    }
    /* zero on the device */
    REQUIRE_OK(ctx, be->zero(d, ctx, b, N * sizeof(float)));
    REQUIRE_OK(ctx, be->download(d, ctx, back, b, N * sizeof(float)));
    zero = true;
    for (int i = 0; i < N; i++) zero &= back[i] == 0.0f;
    CHECK_MSG(zero, "%s: zero left data", be->name);
    /* host memory for copies */
    void *p = NULL;
    bool pinned = true;
    REQUIRE_OK(ctx, be->host_alloc(d, ctx, &p, N * sizeof(float), &pinned, "test host"));
    REQUIRE_OK(ctx, be->download(d, ctx, p, a, N * sizeof(float)));
    CHECK_MSG(!memcmp(p, h, N * sizeof *h), "%s: download into host_alloc's memory differs",
              be->name);
    CHECK(strcmp(be->name, "cpu") || !pinned); /* the CPU has no page-locked memory */
    loom_backend_host_free(p, pinned);
    /* the timeline's marks: spans of zero or more, within the host's time
     * around them; a mark out of range or a read of none is an error */
    const double t0 = loom_now_s();
    double ms[2] = {-1.0, -1.0};
    REQUIRE_OK(ctx, be->mark(d, ctx, 0));
    REQUIRE_OK(ctx, be->zero(d, ctx, a, N * sizeof(float)));
    REQUIRE_OK(ctx, be->mark(d, ctx, 1));
    REQUIRE_OK(ctx, be->mark(d, ctx, 2));
    REQUIRE_OK(ctx, be->marks_ms(d, ctx, 3, ms));
    const double wall = 1e3 * (loom_now_s() - t0);
    CHECK_MSG(ms[0] >= 0.0 && ms[1] >= 0.0 && ms[0] + ms[1] <= wall + 1e-3,
              "%s: marks %.4f + %.4f ms, host %.4f ms", be->name, ms[0], ms[1], wall);
    CHECK(be->mark(d, ctx, LOOM_MARKS_MAX) != LOOM_OK);
    CHECK(be->marks_ms(d, ctx, 0, ms) != LOOM_OK);
    be->free(d, a);
    be->free(d, b);
    be->free(d, c);
    free(h), free(back), free(half), free(want);
}

TEST(backend_cpu_memory_ops) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    const loom_backend *be = loom_backend_for(ctx, false);
    REQUIRE(be && !strcmp(be->name, "cpu"));
    loom_dev d = {.adt = LOOM_F32, .esz = 4, .device = 7};
    REQUIRE_OK(ctx, be->init(&d, ctx));
    CHECK_EQ_INT(d.device, -1);
    memory_ops(ctx, be, &d);
    be->release(&d);
    loom_ctx_free(ctx);
}

TEST(backend_cuda_memory_ops_equal_cpu) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    if (!loom_backend_cuda()) {
        /* not built in: asking for it is an error that says how to get it */
        CHECK(!loom_backend_for(ctx, true));
        CHECK_CONTAINS(loom_last_error(ctx), "make CUDA=1");
        loom_ctx_free(ctx);
        SKIP("loom was built without CUDA");
    }
    if (!loom_test_have_gpu()) {
        loom_ctx_free(ctx);
        SKIP("no GPU visible");
    }
    const loom_backend *be = loom_backend_for(ctx, true);
    REQUIRE(be && !strcmp(be->name, "cuda"));
    loom_dev d = {.cuda = true, .adt = LOOM_F32, .esz = 4, .device = 0};
    REQUIRE_OK(ctx, be->init(&d, ctx));
    memory_ops(ctx, be, &d);
    be->release(&d);
    loom_ctx_free(ctx);
}

/* The forced-balance router's logits: near-normal (mean 0, variance 1,
 * bounded), a pure function of (base, i), new values for a new base. */
TEST(backend_cpu_fill_randn) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    const loom_backend *be = loom_backend_cpu();
    loom_dev d = {.adt = LOOM_F32, .esz = 4};
    REQUIRE_OK(ctx, be->init(&d, ctx));
    enum { N = 200000 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b);
    REQUIRE(a && b);
    const uint64_t base = (uint64_t)loom_now_s() * 2654435761u;
    REQUIRE_OK(ctx, be->fill_randn(&d, ctx, a, N, base));
    double s = 0.0, s2 = 0.0, mx = 0.0;
    for (int i = 0; i < N; i++) s += a[i], s2 += (double)a[i] * a[i], mx = fmax(mx, fabs(a[i]));
    const double mean = s / N, var = s2 / N - mean * mean;
    CHECK_MSG(fabs(mean) < 0.01 && fabs(var - 1.0) < 0.02 && mx < 3.47 && mx > 2.5,
              "mean %g, variance %g, largest |x| %g", mean, var, mx);
    REQUIRE_OK(ctx, be->fill_randn(&d, ctx, b, N, base));
    CHECK(!memcmp(a, b, N * sizeof *a));
    REQUIRE_OK(ctx, be->fill_randn(&d, ctx, b, N, loom_rng_base(base, 1)));
    int same = 0;
    for (int i = 0; i < N; i++) same += a[i] == b[i];
    CHECK_MSG(same < N / 100, "%d of %d values unchanged by a new base", same, N);
    free(a), free(b);
    be->release(&d);
    loom_ctx_free(ctx);
}

/* ---- the element-wise family: a backend against the CPU table, in fp32 ---- */

typedef struct side {
    const loom_backend *be;
    loom_dev *d;
} side;

static float *frand(int64_t n, uint64_t seed) {
    float *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; p && i < n; i++)
        p[i] = (float)((double)(loom_splitmix64(seed + (uint64_t)i) >> 11) / 9007199254740992.0 *
                       4.0 - 2.0);
    return p;
}

/* n floats of host data on a side's device (the host pointer itself on the CPU) */
static void *put(loom_ctx *ctx, side s, const void *h, size_t bytes) {
    void *p = NULL;
    if (s.be->alloc(s.d, ctx, &p, bytes, "test") || s.be->upload(s.d, ctx, p, h, bytes)) return NULL;
    return p;
}

/* the largest |a - b| within tol of the largest |b| (as tests/cuda_test.h
 * judges: a value near zero is held to the tensor's scale, not its own) */
static bool close_to(const float *a, const float *b, int64_t n, double tol) {
    double w = 0.0, m = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - b[i]);
        if (!(d <= w)) w = isnan(d) ? INFINITY : d;
        m = fmax(m, fabs((double)b[i]));
    }
    return w <= tol * (m > 0 ? m : 1.0);
}

/* Runs the family on side x and on the CPU table, inputs from one seed,
 * and compares every output. */
static void elementwise_ops(loom_ctx *ctx, side x) {
    const loom_backend *cpu = loom_backend_cpu();
    loom_dev cd = {.adt = LOOM_F32, .esz = 4};
    REQUIRE_OK(ctx, cpu->init(&cd, ctx));
    side sides[2] = {{cpu, &cd}, x};
    const int64_t T = 37, N = 53, n = T * N, V = 101, H = N, row0 = 40, rows = 30;
    const uint64_t seed = (uint64_t)loom_now_s() * 1000003u;
    float *g = frand(n, seed), *u = frand(n, seed + 1 * n), *dh = frand(n, seed + 2 * n),
          *b = frand(N, seed + 3 * n), *W = frand(rows * H, seed + 4 * n);
    int32_t ids[37];
    for (int64_t t = 0; t < T; t++) ids[t] = (int32_t)(loom_splitmix64(seed + 99 + (uint64_t)t) % V);
    float *out[2][16];
    for (int k = 0; k < 2; k++) {
        side s = sides[k];
        void *G = put(ctx, s, g, n * 4), *U = put(ctx, s, u, n * 4), *DH = put(ctx, s, dh, n * 4),
             *B = put(ctx, s, b, N * 4), *WW = put(ctx, s, W, rows * H * 4),
             *ID = put(ctx, s, ids, sizeof ids);
        void *h = NULL, *dg = NULL, *du = NULL, *db = NULL, *e = NULL, *dW = NULL;
        REQUIRE(G && U && DH && B && WW && ID);
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &h, n * 4, "h"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dg, n * 4, "dg"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &du, n * 4, "du"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &db, N * 4, "db"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &e, T * H * 4, "e"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dW, rows * H * 4, "dW"));
        REQUIRE_OK(ctx, s.be->swiglu_fwd(s.d, ctx, G, U, n, h));
        REQUIRE_OK(ctx, s.be->swiglu_bwd(s.d, ctx, DH, G, U, n, dg, du));
        REQUIRE_OK(ctx, s.be->add(s.d, ctx, h, DH, n));            /* h += dh */
        REQUIRE_OK(ctx, s.be->bias_fwd(s.d, ctx, h, B, T, N));     /* h += b */
        REQUIRE_OK(ctx, s.be->bias_bwd(s.d, ctx, DH, T, N, db));   /* db = sum over rows of dh */
        REQUIRE_OK(ctx, s.be->embed_fwd(s.d, ctx, ID, T, WW, row0, rows, H, e));
        REQUIRE_OK(ctx, s.be->embed_bwd(s.d, ctx, ID, T, DH, row0, rows, H, dW));
        /* rows of g in the order perm (a rotation), back with scatter; the
         * dropout mask on u, with and without a token index */
        void *pg = NULL, *ps = NULL, *dr = NULL, *dq = NULL;
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &pg, n * 4, "pg"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &ps, n * 4, "ps"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dr, n * 4, "dr"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dq, n * 4, "dq"));
        int32_t perm[37];
        for (int64_t t = 0; t < T; t++) perm[t] = (int32_t)((t * 11 + 5) % T);
        void *PI = put(ctx, s, perm, sizeof perm);
        REQUIRE(PI);
        REQUIRE_OK(ctx, s.be->rows_gather(s.d, ctx, pg, G, PI, T, N));
        REQUIRE_OK(ctx, s.be->rows_scatter(s.d, ctx, ps, pg, PI, T, N)); /* = g again */
        REQUIRE_OK(ctx, s.be->dropout(s.d, ctx, dr, U, T, N, 3 * N, N, NULL, 7, seed, 42, 0.3));
        REQUIRE_OK(ctx, s.be->dropout(s.d, ctx, dq, U, T, N, N, 0, PI, 0, seed, 43, 0.5));
        s.be->free(s.d, PI);
        void *rn = NULL;
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &rn, n * 4, "rn"));
        REQUIRE_OK(ctx, s.be->fill_randn(s.d, ctx, rn, n, seed));
        /* the gated attention's gate (o = u, g = g) and its backward; 20
         * columns of every row of g (the q_proj split into query and gate) */
        void *gy = NULL, *gdo = NULL, *gdg = NULL, *c2 = NULL, *c3 = NULL;
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &gy, n * 4, "gy"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &gdo, n * 4, "gdo"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &gdg, n * 4, "gdg"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &c2, T * 20 * 4, "c2"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &c3, T * 16 * 4, "c3"));
        REQUIRE_OK(ctx, s.be->gate_fwd(s.d, ctx, U, G, n, gy));
        REQUIRE_OK(ctx, s.be->gate_bwd(s.d, ctx, DH, U, G, n, gdo, gdg));
        REQUIRE_OK(ctx, s.be->copy2d(s.d, ctx, c2, 20 * 4, (const float *)G + 5, (size_t)N * 4,
                                     20 * 4, (size_t)T));
        /* 16-byte rows, strides and addresses (CUDA: its own kernel): 16 floats
         * of every 52 of g from float 4 */
        REQUIRE_OK(ctx, s.be->copy2d(s.d, ctx, c3, 16 * 4, (const float *)G + 4, 52 * 4, 16 * 4,
                                     (size_t)T));
        void *dev[16] = {h, dg, du, db, e, dW, pg, ps, dr, dq, rn, gy, gdo, gdg, c2, c3};
        const int64_t len[16] = {n, n, n, N, T * H, rows * H, n, n, n, n, n, n, n, n, T * 20, T * 16};
        for (int j = 0; j < 16; j++) {
            out[k][j] = malloc((size_t)len[j] * 4);
            REQUIRE_OK(ctx, s.be->download(s.d, ctx, out[k][j], dev[j], (size_t)len[j] * 4));
            s.be->free(s.d, dev[j]);
        }
        void *in[6] = {G, U, DH, B, WW, ID};
        for (int j = 0; j < 6; j++) s.be->free(s.d, in[j]);
    }
    static const char *const what[16] = {
        "swiglu_fwd + add + bias_fwd", "swiglu_bwd dg", "swiglu_bwd du", "bias_bwd", "embed_fwd",
        "embed_bwd", "rows_gather", "rows_scatter", "dropout", "dropout (token index)",
        "fill_randn", "gate_fwd", "gate_bwd do", "gate_bwd dg", "copy2d", "copy2d (16-byte rows)"};
    const int64_t len[16] = {n, n, n, N, T * H, rows * H, n, n, n, n, n, n, n, n, T * 20, T * 16};
    for (int64_t t = 0; t < T; t++) { /* copy2d moved the right bytes */
        CHECK(!memcmp(out[1][14] + t * 20, g + t * N + 5, 20 * 4));
        CHECK(!memcmp(out[1][15] + t * 16, g + t * 52 + 4, 16 * 4));
    }
    CHECK(!memcmp(out[1][7], g, (size_t)n * 4)); /* scatter undid gather */
    CHECK_MSG(!memcmp(out[1][10], out[0][10], (size_t)n * 4), "%s: fill_randn is not the CPU's "
              "bits", x.be->name);
    for (int j = 0; j < 16; j++) {
        CHECK_MSG(close_to(out[1][j], out[0][j], len[j], 1e-5), "%s: %s differs from the CPU's",
                  x.be->name, what[j]);
        free(out[0][j]);
        free(out[1][j]);
    }
    free(g), free(u), free(dh), free(b), free(W);
    cpu->release(&cd);
}

/* Runs fn against the CUDA table (fp32 compute, GPU 0); skips without one. */
static void on_cuda_f32(void (*fn)(loom_ctx *ctx, side g)) {
    if (!loom_backend_cuda() || !loom_test_have_gpu())
        SKIP("no GPU (or loom built without CUDA): this compares the CUDA table with the CPU's");
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_dev gd = {.cuda = true, .adt = LOOM_F32, .esz = 4, .device = 0};
    const loom_backend *be = loom_backend_cuda();
    REQUIRE_OK(ctx, be->init(&gd, ctx));
    fn(ctx, (side){be, &gd});
    be->release(&gd);
    loom_ctx_free(ctx);
}

TEST(backend_elementwise_ops_equal_cpu) { on_cuda_f32(elementwise_ops); }

/* The expert-parallel regrouping's tables on the GPU against the CPU's, bit
 * for bit: one or many sources, few or many experts, empty blocks, no rows. */
static void regroup_ops(loom_ctx *ctx, side g) {
    static const struct { int64_t S, El; int most; } cases[] = {
        {2, 64, 700}, {16, 8, 300}, {1, 3000, 9}, {8, 16, 0}, {4, 128, 3}, {2, 1, 40000}};
    const uint64_t seed = (uint64_t)loom_now_s() * 31u;
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int64_t n = cases[c].S * cases[c].El;
        int32_t *rc = malloc((size_t)n * 4);
        int64_t Rt = 0;
        for (int64_t i = 0; i < n; i++)
            Rt += rc[i] = (int32_t)(loom_splitmix64(seed + c * 7919u + (uint64_t)i) %
                                    (uint64_t)(cases[c].most + 1));
        int32_t *want = malloc((size_t)(2 * Rt + 1) * 4), *got = malloc((size_t)(2 * Rt + 1) * 4);
        REQUIRE(rc && want && got);
        loom_cpu_moe_regroup(rc, cases[c].S, cases[c].El, Rt, want);
        void *drc = put(ctx, g, rc, (size_t)n * 4), *dix = NULL;
        REQUIRE(drc);
        REQUIRE_OK(ctx, g.be->alloc(g.d, ctx, &dix, (size_t)(2 * Rt + 1) * 4, "ix"));
        REQUIRE_OK(ctx, g.be->moe_regroup(g.d, ctx, drc, cases[c].S, cases[c].El, Rt, dix));
        if (Rt) REQUIRE_OK(ctx, g.be->download(g.d, ctx, got, dix, (size_t)(2 * Rt) * 4));
        CHECK_MSG(!memcmp(got, want, (size_t)(2 * Rt) * 4), "%lld sources x %lld experts, %lld "
                  "rows: the tables differ from the CPU's", (long long)cases[c].S,
                  (long long)cases[c].El, (long long)Rt);
        g.be->free(g.d, drc);
        g.be->free(g.d, dix);
        free(rc), free(want), free(got);
    }
    /* a table the kernel cannot hold is refused, saying so */
    CHECK(g.be->moe_regroup(g.d, ctx, NULL, 4, 1024, 1, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "4 x 1024");
}

TEST(backend_moe_regroup_equals_cpu) { on_cuda_f32(regroup_ops); }

/* The once-per-rank dispatch's tables on the GPU against the CPU's, bit for
 * bit: dest, then (route's grouping made on the host) mask, meta and the
 * routing-weight gradients' gather. */
static void dedup_ops(loom_ctx *ctx, side g) {
    enum { N = 3001, K = 8, El = 16, P = 4 };
    const uint64_t seed = (uint64_t)loom_now_s() * 131u;
    int32_t *idx = malloc(N * K * 4), *dest = malloc(N * P * 4), *gdest = malloc(N * P * 4);
    int32_t *ord = malloc(N * P * 4), *pos = malloc(N * P * 4), cnt[P + 1];
    float *w = frand(N * K, seed), *dwb = frand(N * P * K, seed + 7);
    REQUIRE(idx && dest && gdest && ord && pos && w && dwb);
    for (int n = 0; n < N; n++)
        for (int j = 0; j < K; j++) /* distinct experts a token, some tokens on one rank only */
            idx[n * K + j] = (int32_t)((loom_splitmix64(seed + (uint64_t)n) % (n % 5 ? El * P : El) +
                                        (uint64_t)j * (n % 5 ? 7 : 1)) % (n % 5 ? El * P : El));
    loom_cpu_moe_dest(idx, N, K, El, P, dest);
    void *di = put(ctx, g, idx, N * K * 4), *dd = NULL;
    REQUIRE(di);
    REQUIRE_OK(ctx, g.be->alloc(g.d, ctx, &dd, N * P * 4, "dest"));
    REQUIRE_OK(ctx, g.be->moe_dest(g.d, ctx, di, N, K, El, P, dd));
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, gdest, dd, N * P * 4));
    CHECK_MSG(!memcmp(gdest, dest, N * P * 4), "moe_dest differs from the CPU's");
    loom_cpu_moe_route(dest, NULL, N, P + 1, P, -1, false, cnt, ord, pos);
    int32_t *ord_m = malloc(N * P * 4), *pos_m = malloc(N * P * 4);
    REQUIRE(ord_m && pos_m);
    memcpy(ord_m, ord, N * P * 4), memcpy(pos_m, pos, N * P * 4);
    loom_cpu_moe_mask(dest, N, P, P, ord_m, pos_m);
    void *dord = put(ctx, g, ord, N * P * 4), *dpos = put(ctx, g, pos, N * P * 4);
    REQUIRE(dord && dpos);
    REQUIRE_OK(ctx, g.be->moe_mask(g.d, ctx, dd, N, P, P, dord, dpos));
    int32_t *got = malloc(N * P * K * 4);
    float *gotf = malloc(N * P * K * 4);
    REQUIRE(got && gotf);
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, got, dord, N * P * 4));
    CHECK_MSG(!memcmp(got, ord_m, N * P * 4), "moe_mask: order differs from the CPU's");
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, got, dpos, N * P * 4));
    CHECK_MSG(!memcmp(got, pos_m, N * P * 4), "moe_mask: pos differs from the CPU's");
    int64_t U = 0;
    for (int p = 0; p < P; p++) U += cnt[p];
    int32_t *tok = malloc((size_t)U * 4), *mid = malloc((size_t)U * K * 4);
    float *mw = malloc((size_t)U * K * 4), *dw = malloc(N * K * 4);
    REQUIRE(tok && mid && mw && dw);
    loom_cpu_moe_dedup_meta(ord, U, idx, w, K, El, P, tok, mid, mw);
    void *dw_ = put(ctx, g, w, N * K * 4), *dtok = NULL, *dmid = NULL, *dmw = NULL, *ddw = NULL;
    void *ddwb = put(ctx, g, dwb, N * P * K * 4);
    REQUIRE(dw_ && ddwb);
    REQUIRE_OK(ctx, g.be->alloc(g.d, ctx, &dtok, (size_t)U * 4, "tok"));
    REQUIRE_OK(ctx, g.be->alloc(g.d, ctx, &dmid, (size_t)U * K * 4, "mid"));
    REQUIRE_OK(ctx, g.be->alloc(g.d, ctx, &dmw, (size_t)U * K * 4, "mw"));
    REQUIRE_OK(ctx, g.be->alloc(g.d, ctx, &ddw, N * K * 4, "dw"));
    void *dord2 = put(ctx, g, ord, N * P * 4);
    REQUIRE(dord2);
    REQUIRE_OK(ctx, g.be->moe_dedup_meta(g.d, ctx, dord2, U, di, dw_, K, El, P, dtok, dmid, dmw));
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, got, dtok, (size_t)U * 4));
    CHECK_MSG(!memcmp(got, tok, (size_t)U * 4), "moe_dedup_meta: tok differs");
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, got, dmid, (size_t)U * K * 4));
    CHECK_MSG(!memcmp(got, mid, (size_t)U * K * 4), "moe_dedup_meta: mid differs");
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, gotf, dmw, (size_t)U * K * 4));
    CHECK_MSG(!memcmp(gotf, mw, (size_t)U * K * 4), "moe_dedup_meta: mw differs");
    loom_cpu_moe_dedup_dw(dwb, pos_m, N, P, K, dw);
    REQUIRE_OK(ctx, g.be->moe_dedup_dw(g.d, ctx, ddwb, dpos, N, P, K, ddw));
    REQUIRE_OK(ctx, g.be->download(g.d, ctx, gotf, ddw, N * K * 4));
    CHECK_MSG(!memcmp(gotf, dw, N * K * 4), "moe_dedup_dw differs from the CPU's");
    void *all[] = {di, dd, dord, dpos, dw_, ddwb, dtok, dmid, dmw, ddw, dord2};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) g.be->free(g.d, all[i]);
    free(idx), free(dest), free(gdest), free(ord), free(pos), free(w), free(dwb), free(ord_m);
    free(pos_m), free(got), free(gotf), free(tok), free(mid), free(mw), free(dw);
}

TEST(backend_moe_dedup_ops_equal_cpu) { on_cuda_f32(dedup_ops); }

/* ---- RMSNorm: a backend against the CPU table, in fp32 (the CUDA kernels'
 * plain forms) and bf16 (the fused forms, with the dw batch), with plain
 * (woff 0) and zero-centred (woff 1, Qwen3.5's) weights ---- */

static void norm_ops(loom_ctx *ctx, side x, loom_dtype adt, float woff) {
    const loom_backend *cpu = loom_backend_cpu();
    loom_dev cd = {.adt = LOOM_F32, .esz = 4};
    REQUIRE_OK(ctx, cpu->init(&cd, ctx));
    const int64_t N = 29, H = 256, n = N * H;
    const size_t esz = loom_dtype_size(adt);
    const uint64_t seed = (uint64_t)loom_now_s() * 7919u;
    float *in[4];
    for (int k = 0; k < 4; k++) { /* x, res, w, dy: rounded to adt so both sides see the same */
        in[k] = frand(k == 2 ? H : n, seed + (uint64_t)k * 100003u);
        REQUIRE(in[k]);
        if (adt != LOOM_F32) {
            const int64_t len = k == 2 ? H : n;
            uint16_t *t = malloc((size_t)len * 2);
            REQUIRE_OK(ctx, loom_convert(ctx, t, adt, in[k], LOOM_F32, (size_t)len));
            REQUIRE_OK(ctx, loom_convert(ctx, in[k], LOOM_F32, t, adt, (size_t)len));
            free(t);
        }
    }
    float *out[2][6]; /* y, xsum, dx (bwd), dw (bwd), dx (bwd_add), dw (bwd_add) */
    side sides[2] = {{cpu, &cd}, x};
    for (int k = 0; k < 2; k++) {
        side s = sides[k];
        const loom_dtype t = k ? adt : LOOM_F32;
        const size_t es = k ? esz : 4;
        void *dev_in[4];
        for (int j = 0; j < 4; j++) {
            const int64_t len = j == 2 ? H : n;
            void *h = in[j];
            uint16_t *tmp = NULL;
            if (t != LOOM_F32) {
                tmp = malloc((size_t)len * 2);
                REQUIRE_OK(ctx, loom_convert(ctx, tmp, t, in[j], LOOM_F32, (size_t)len));
                h = tmp;
            }
            dev_in[j] = put(ctx, s, h, (size_t)len * es);
            free(tmp);
            REQUIRE(dev_in[j]);
        }
        void *y = NULL, *xs = NULL, *dx = NULL, *dx2 = NULL, *dyc = NULL, *rstd = NULL, *dw = NULL,
             *dw2 = NULL;
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &y, (size_t)n * es, "y"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &xs, (size_t)n * es, "xsum"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dx, (size_t)n * es, "dx"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dx2, (size_t)n * es, "dx2"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dyc, (size_t)n * es, "dy copy"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &rstd, (size_t)N * 4, "rstd"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dw, (size_t)H * 4, "dw"));
        REQUIRE_OK(ctx, s.be->alloc(s.d, ctx, &dw2, (size_t)H * 4, "dw2"));
        REQUIRE_OK(ctx, s.be->add_rmsnorm_fwd(s.d, ctx, dev_in[0], dev_in[1], xs, dev_in[2], woff,
                                              N, H, 1e-6f, y, rstd));
        REQUIRE_OK(ctx,
                   s.be->rmsnorm_bwd(s.d, ctx, dev_in[3], xs, dev_in[2], woff, rstd, N, H, dx, dw));
        REQUIRE_OK(ctx, s.be->copy(s.d, ctx, dyc, dev_in[3], (size_t)n * es));
        REQUIRE_OK(ctx, s.be->copy(s.d, ctx, dx2, dev_in[1], (size_t)n * es)); /* dx2 = res */
        REQUIRE_OK(ctx,
                   s.be->rmsnorm_bwd_add(s.d, ctx, dyc, xs, dev_in[2], woff, rstd, N, H, dx2, dw2));
        REQUIRE_OK(ctx, s.be->dw_flush(s.d, ctx));
        void *dev[6] = {y, xs, dx, dw, dx2, dw2};
        const int64_t len[6] = {n, n, n, H, n, H};
        const bool f32[6] = {false, false, false, true, false, true};
        for (int j = 0; j < 6; j++) {
            out[k][j] = malloc((size_t)len[j] * 4);
            const size_t eb = f32[j] ? 4 : es;
            void *h = malloc((size_t)len[j] * eb);
            REQUIRE_OK(ctx, s.be->download(s.d, ctx, h, dev[j], (size_t)len[j] * eb));
            REQUIRE_OK(ctx, loom_convert(ctx, out[k][j], LOOM_F32, h, f32[j] ? LOOM_F32 : t,
                                         (size_t)len[j]));
            free(h);
        }
        void *all[12] = {y, xs, dx, dx2, dyc, rstd, dw, dw2, dev_in[0], dev_in[1], dev_in[2],
                         dev_in[3]};
        for (int j = 0; j < 12; j++) s.be->free(s.d, all[j]);
    }
    static const char *const what[6] = {"add_rmsnorm_fwd y", "add_rmsnorm_fwd xsum",
                                        "rmsnorm_bwd dx", "rmsnorm_bwd dw", "rmsnorm_bwd_add dx",
                                        "rmsnorm_bwd_add dw"};
    const int64_t len[6] = {n, n, n, H, n, H};
    const double tol = adt == LOOM_F32 ? 1e-5 : 2e-2;
    for (int j = 0; j < 6; j++) {
        CHECK_MSG(close_to(out[1][j], out[0][j], len[j], tol),
                  "%s (%s, woff %g): %s differs from the CPU's", x.be->name, loom_dtype_name(adt),
                  (double)woff, what[j]);
        free(out[0][j]);
        free(out[1][j]);
    }
    for (int k = 0; k < 4; k++) free(in[k]);
    cpu->release(&cd);
}

TEST(backend_norm_ops_equal_cpu) {
    if (!loom_backend_cuda() || !loom_test_have_gpu())
        SKIP("no GPU (or loom built without CUDA): this compares the CUDA table with the CPU's");
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    const loom_dtype dts[2] = {LOOM_F32, LOOM_BF16};
    for (int i = 0; i < 2; i++) {
        loom_dev gd = {.cuda = true, .adt = dts[i], .esz = loom_dtype_size(dts[i]), .device = 0};
        const loom_backend *be = loom_backend_cuda();
        REQUIRE_OK(ctx, be->init(&gd, ctx));
        norm_ops(ctx, (side){be, &gd}, dts[i], 0.0f);
        norm_ops(ctx, (side){be, &gd}, dts[i], 1.0f);
        be->release(&gd);
    }
    loom_ctx_free(ctx);
}
