/* CUDA ops (src/backend/cuda/cuda_ops.h) against the CPU reference ops on
 * fresh random inputs. Built only with `make CUDA=1`; skipped when no GPU is
 * visible. Errors are max |gpu - cpu| / max |cpu| over a tensor: fp32 outputs
 * within 1e-5, bf16/f16 outputs within 1e-2 (the CPU runs on the same
 * rounded inputs, so only the GPU's arithmetic and output rounding differ). */
#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "../src/backend/cpu/cpu_ops.h"
#include "../src/backend/cuda/cuda_backend.h"
#include "../src/backend/cuda/cuda_ops.h"
#include "../src/core/rng.h"
#include "../src/backend/adamw.h"
#include "harness.h"

#include "cuda_test.h"

/* ---------------- GEMM ---------------- */

TEST(cuda_ops_gemm) {
    gpu g;
    REQUIRE(gpu_open(&g));
    loom_cuda_gemm_handle *h;
    REQUIRE_OK(g.ctx, loom_cuda_gemm_create(g.ctx, 0, &h));
    const int64_t shapes[][3] = {{37, 72, 16}, {64, 128, 256}, {5, 3, 1}, {130, 70, 33}, {1, 300, 64}};
    const loom_dtype types[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    int planned = -1;
    for (int pass = 0; pass < 2; pass++) /* the second pass must hit the handle's cache */
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int64_t M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
            for (int ti = 0; ti < 3; ti++)
                for (int ci = 0; ci < 2; ci++) {
                    loom_dtype dt = types[ti], cdt = ci ? dt : LOOM_F32;
                    if (ci && dt == LOOM_F32) continue;
                    for (int v = 0; v < 8; v++) {
                        bool ta = v & 1, tb = (v >> 1) & 1;
                        float beta = (v >> 2) ? 1.0f : 0.0f, alpha = 0.7f;
                        int64_t ar = ta ? K : M, ac = ta ? M : K, br = tb ? N : K, bc = tb ? K : N;
                        int64_t lda = ac + 3, ldb = bc + 5, ldc = N + 2;
                        float *A = falloc(ar * lda), *B = falloc(br * ldb), *C = falloc(M * ldc);
                        float *ref = falloc(M * ldc), *got = falloc(M * ldc);
                        uint64_t key = 1000 + si * 100 + (uint64_t)ti * 10 + (uint64_t)v;
                        fill(A, ar * lda, key, 1);
                        fill(B, br * ldb, key + 7, 1);
                        fill(C, M * ldc, key + 13, 1);
                        round_to(&g, A, ar * lda, dt);
                        round_to(&g, B, br * ldb, dt);
                        round_to(&g, C, M * ldc, cdt);
                        memcpy(ref, C, sizeof(float) * (size_t)(M * ldc));
                        loom_cpu_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, ref, ldc);
                        if (beta == 0.0f) /* C must not be read */
                            for (int64_t i = 0; i < M; i++)
                                for (int64_t j = 0; j < N; j++) C[i * ldc + j] = NAN;
                        void *dA = up(&g, A, ar * lda, dt), *dB = up(&g, B, br * ldb, dt);
                        void *dC = up(&g, C, M * ldc, cdt);
                        REQUIRE(!g.bad);
                        REQUIRE_OK(g.ctx, loom_cuda_gemm(g.ctx, h, ta, tb, M, N, K, alpha, dA, dt, lda,
                                                         dB, dt, ldb, beta, dC, cdt, ldc, NULL));
                        down(&g, got, dC, M * ldc, cdt);
                        CHECK_CLOSE(got, ref, M * ldc, cdt,
                                    "gemm M=%lld N=%lld K=%lld ta=%d tb=%d beta=%g %s -> %s",
                                    (long long)M, (long long)N, (long long)K, ta, tb, beta, dn(dt),
                                    dn(cdt));
                        for (int64_t i = 0; i < M; i++) /* the padding columns are not touched */
                            for (int64_t j = N; j < ldc; j++)
                                if (got[i * ldc + j] != ref[i * ldc + j]) {
                                    loom_test_fail(__FILE__, __LINE__, "gemm wrote padding (%lld, %lld)",
                                                   (long long)i, (long long)j);
                                    i = M;
                                    break;
                                }
                        free(A), free(B), free(C), free(ref), free(got);
                        for (int k = 0; k < 3; k++) loom_cuda_free(g.ptrs[--g.n]);
                    }
                }
            if (pass == 1 && si + 1 == sizeof shapes / sizeof shapes[0])
                CHECK_EQ_INT(loom_cuda_gemm_cached(h), planned);
            if (pass == 0 && si + 1 == sizeof shapes / sizeof shapes[0]) planned = loom_cuda_gemm_cached(h);
        }
    if (getenv("LOOM_CUDA_OPS_VERBOSE")) fprintf(stderr, "    %d gemm shapes planned and cached\n", planned);
    /* K = 0: C = beta * C */
    float c0[12], c1[12];
    fill(c0, 12, 9, 1);
    void *d = up(&g, c0, 12, LOOM_F32);
    REQUIRE(d);
    REQUIRE_OK(g.ctx, loom_cuda_gemm(g.ctx, h, 0, 0, 3, 4, 0, 1, d, LOOM_F32, 1, d, LOOM_F32, 4, 0.5f,
                                     d, LOOM_F32, 4, NULL));
    down(&g, c1, d, 12, LOOM_F32);
    for (int i = 0; i < 12; i++) c0[i] *= 0.5f;
    CHECK_MSG(memcmp(c0, c1, sizeof c0) == 0, "gemm with K = 0 must scale C by beta");
    /* refused: mixed input dtypes, C in another half type */
    d = dalloc(&g, 4096);
    REQUIRE(d);
    CHECK(loom_cuda_gemm(g.ctx, h, 0, 0, 4, 4, 4, 1, d, LOOM_BF16, 4, d, LOOM_F16, 4, 0, d, LOOM_F32,
                         4, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda gemm");
    CHECK(loom_cuda_gemm(g.ctx, h, 0, 0, 4, 4, 4, 1, d, LOOM_BF16, 4, d, LOOM_BF16, 4, 0, d,
                         LOOM_F16, 4, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK(loom_cuda_gemm(g.ctx, h, 0, 0, 4, 4, 4, 1, d, LOOM_F32, 3, d, LOOM_F32, 4, 0, d, LOOM_F32,
                         4, NULL) == LOOM_ERR_INVALID_ARG);
    loom_cuda_gemm_free(h);
    gpu_close(&g);
}

/* ---------------- embedding ---------------- */

static void embedding_case(gpu *g, int64_t V, int64_t H, int64_t T, loom_dtype wdt, loom_dtype odt) {
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t t = 0; t < T; t++) /* many repeats, also inside a batch of 16 tokens */
        ids[t] = (t % 5 == 2) ? 1 : (int32_t)(loom_splitmix64((uint64_t)t * 7 + 3) % (uint64_t)V);
    float *W = falloc(V * H), *out = falloc(T * H), *got = falloc(T * H);
    float *dout = falloc(T * H), *dW = falloc(V * H), *gotdW = falloc(V * H);
    fill(W, V * H, 31, 1);
    fill(dout, T * H, 32, 1);
    fill(dW, V * H, 33, 1);
    round_to(g, W, V * H, wdt);
    round_to(g, dout, T * H, odt);
    void *dids = up_raw(g, ids, sizeof(int32_t) * (size_t)T), *dWt = up(g, W, V * H, wdt);
    void *d_out = dalloc(g, (size_t)(T * H) * loom_dtype_size(odt));
    void *dg = up(g, dout, T * H, odt), *ddW = up(g, dW, V * H, LOOM_F32);
    if (g->bad) return;
    loom_cpu_embedding_fwd(ids, T, W, H, out);
    round_to(g, out, T * H, odt);
    CHECK_OK(g->ctx, loom_cuda_embedding_fwd(g->ctx, dids, T, dWt, wdt, H, d_out, odt, NULL));
    down(g, got, d_out, T * H, odt);
    CHECK_MSG(rel_err(got, out, T * H) == 0, "embedding_fwd V=%lld H=%lld T=%lld %s -> %s differs",
              (long long)V, (long long)H, (long long)T, dn(wdt), dn(odt));
    loom_cpu_embedding_bwd(ids, T, dout, H, dW);
    CHECK_OK(g->ctx, loom_cuda_embedding_bwd(g->ctx, dids, T, dg, odt, H, ddW, NULL));
    down(g, gotdW, ddW, V * H, LOOM_F32);
    /* same additions in the same order: bit-identical */
    CHECK_MSG(rel_err(gotdW, dW, V * H) == 0, "embedding_bwd V=%lld H=%lld T=%lld %s: rel err %g",
              (long long)V, (long long)H, (long long)T, dn(odt), rel_err(gotdW, dW, V * H));
    free(ids), free(W), free(out), free(got), free(dout), free(dW), free(gotdW);
    while (g->n > 0) loom_cuda_free(g->ptrs[--g->n]);
}

TEST(cuda_ops_embedding) {
    gpu g;
    REQUIRE(gpu_open(&g));
    embedding_case(&g, 50, 72, 37, LOOM_F32, LOOM_F32);
    embedding_case(&g, 7, 200, 1000, LOOM_F32, LOOM_F32);
    embedding_case(&g, 50, 72, 37, LOOM_BF16, LOOM_BF16);
    embedding_case(&g, 300, 4096, 64, LOOM_F32, LOOM_BF16);
    REQUIRE(!g.bad);
    gpu_close(&g);
}

/* ---------------- RMSNorm ---------------- */

static void rmsnorm_case(gpu *g, int64_t N, int64_t H, loom_dtype xdt, loom_dtype wdt,
                         loom_dtype ydt) {
    const float eps = 1e-6f;
    float *x = falloc(N * H), *w = falloc(H), *y = falloc(N * H), *rs = falloc(N);
    float *got = falloc(N * H), *gotrs = falloc(N);
    float *dy = falloc(N * H), *dx = falloc(N * H), *dw = falloc(H), *gotdw = falloc(H);
    fill(x, N * H, 41, 2);
    fill(w, H, 42, 1);
    fill(dy, N * H, 43, 1);
    fill(dw, H, 44, 1);
    round_to(g, x, N * H, xdt);
    round_to(g, w, H, wdt);
    round_to(g, dy, N * H, xdt);
    void *dx_d = up(g, x, N * H, xdt), *dw_d = up(g, w, H, wdt), *dy_d = dalloc(g, (size_t)(N * H) * 4);
    float *drs = dalloc(g, (size_t)N * 4);
    if (g->bad) return;
    /* forward */
    loom_cpu_rmsnorm_fwd(x, w, 0.0f, N, H, eps, y, rs);
    round_to(g, y, N * H, ydt);
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_fwd(g->ctx, dx_d, xdt, dw_d, wdt, 0.0f, N, H, eps, dy_d, ydt, drs, NULL));
    down(g, got, dy_d, N * H, ydt);
    down(g, gotrs, drs, N, LOOM_F32);
    CHECK_CLOSE(got, y, N * H, ydt, "rmsnorm_fwd y N=%lld H=%lld x %s w %s y %s", (long long)N,
                (long long)H, dn(xdt), dn(wdt), dn(ydt));
    CHECK_CLOSE(gotrs, rs, N, LOOM_F32, "rmsnorm_fwd rstd N=%lld H=%lld", (long long)N, (long long)H);
    /* backward: dy in x's dtype, dx written over dy (aliased), dw accumulated */
    void *ddy = up(g, dy, N * H, xdt), *ddw = up(g, dw, H, LOOM_F32);
    float *drs2 = up(g, rs, N, LOOM_F32);
    void *scratch = dalloc(g, loom_cuda_rmsnorm_bwd_scratch_bytes(N, H));
    if (g->bad) return;
    loom_cpu_rmsnorm_bwd(dy, x, w, 0.0f, rs, N, H, dx, dw);
    round_to(g, dx, N * H, xdt);
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_bwd(g->ctx, ddy, xdt, dx_d, xdt, dw_d, wdt, 0.0f, drs2, N, H, ddy,
                                           xdt, ddw, scratch, NULL));
    down(g, got, ddy, N * H, xdt);
    down(g, gotdw, ddw, H, LOOM_F32);
    CHECK_CLOSE(got, dx, N * H, xdt, "rmsnorm_bwd dx N=%lld H=%lld x %s w %s", (long long)N,
                (long long)H, dn(xdt), dn(wdt));
    CHECK_CLOSE(gotdw, dw, H, LOOM_F32, "rmsnorm_bwd dw N=%lld H=%lld x %s w %s", (long long)N,
                (long long)H, dn(xdt), dn(wdt));
    /* frozen weight: dw NULL, no scratch; dx into a separate fp32 buffer */
    void *ddy2 = up(g, dy, N * H, xdt), *ddx = dalloc(g, (size_t)(N * H) * 4);
    if (g->bad) return;
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_bwd(g->ctx, ddy2, xdt, dx_d, xdt, dw_d, wdt, 0.0f, drs2, N, H, ddx,
                                           LOOM_F32, NULL, NULL, NULL));
    loom_cpu_rmsnorm_bwd(dy, x, w, 0.0f, rs, N, H, dx, NULL);
    down(g, got, ddx, N * H, LOOM_F32);
    CHECK_CLOSE(got, dx, N * H, LOOM_F32, "rmsnorm_bwd (frozen) dx N=%lld H=%lld", (long long)N,
                (long long)H);
    free(x), free(w), free(y), free(rs), free(got), free(gotrs), free(dy), free(dx), free(dw),
        free(gotdw);
    while (g->n > 0) loom_cuda_free(g->ptrs[--g->n]);
}

TEST(cuda_ops_rmsnorm) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const int64_t shapes[][2] = {{37, 72}, {300, 128}, {6, 4096}, {2100, 16}, {70001, 8}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        rmsnorm_case(&g, shapes[i][0], shapes[i][1], LOOM_F32, LOOM_F32, LOOM_F32);
        rmsnorm_case(&g, shapes[i][0], shapes[i][1], LOOM_BF16, LOOM_F32, LOOM_BF16);
        rmsnorm_case(&g, shapes[i][0], shapes[i][1], LOOM_BF16, LOOM_BF16, LOOM_F32);
    }
    rmsnorm_case(&g, 37, 72, LOOM_F32, LOOM_BF16, LOOM_F16);
    rmsnorm_case(&g, 300, 1024, LOOM_F16, LOOM_F16, LOOM_F16); /* the F16 vector path */
    rmsnorm_case(&g, 33, 2560, LOOM_BF16, LOOM_BF16, LOOM_BF16);
    rmsnorm_case(&g, 2000, 256, LOOM_BF16, LOOM_BF16, LOOM_BF16); /* one pass for dx and dw */
    rmsnorm_case(&g, 70, 512, LOOM_BF16, LOOM_F32, LOOM_BF16);
    REQUIRE(!g.bad);
    /* errors name the op */
    CHECK(loom_cuda_rmsnorm_fwd(g.ctx, NULL, LOOM_I32, NULL, LOOM_F32, 0.0f, 1, 1, 1e-6f, NULL, LOOM_F32,
                                NULL, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda rmsnorm_fwd");
    gpu_close(&g);
}

/* ---------------- RoPE ---------------- */

TEST(cuda_ops_rope) {
    gpu g;
    REQUIRE(gpu_open(&g));
    enum { T = 37, NH = 6 };
    const int32_t cu[4] = {0, 10, 23, 37};
    int32_t pos[T];
    for (int d = 0; d < 3; d++) /* positions restart per document; the last one far out */
        for (int t = cu[d]; t < cu[d + 1]; t++) pos[t] = t - cu[d] + (d == 2 ? 30000 : 0);
    const int64_t Ds[3] = {16, 64, 128};
    const loom_dtype types[2] = {LOOM_F32, LOOM_BF16};
    for (int di = 0; di < 3; di++)
        for (int ti = 0; ti < 2; ti++) {
            const int64_t D = Ds[di], n = T * NH * D;
            const loom_dtype dt = types[ti];
            float inv[64], *x = falloc(n), *got = falloc(n);
            loom_rope_inv_freq(0, 1e6, D, 1, 1, 1, 0, inv);
            fill(x, n, 50 + (uint64_t)di, 1);
            round_to(&g, x, n, dt);
            void *dxp = up(&g, x, n, dt), *dpos = up_raw(&g, pos, sizeof pos),
                 *dinv = up(&g, inv, D / 2, LOOM_F32);
            REQUIRE(!g.bad);
            loom_cpu_rope_fwd(x, T, NH, D, D, pos, inv);
            round_to(&g, x, n, dt);
            CHECK_OK(g.ctx, loom_cuda_rope_fwd(g.ctx, dxp, dt, T, NH, D, D, dpos, dinv, NULL));
            down(&g, got, dxp, n, dt);
            CHECK_CLOSE(got, x, n, dt, "rope_fwd D=%lld %s", (long long)D, dn(dt));
            /* backward on the rotated buffer: both sides start from the GPU's output */
            memcpy(x, got, sizeof(float) * (size_t)n);
            loom_cpu_rope_bwd(x, T, NH, D, D, pos, inv);
            round_to(&g, x, n, dt);
            CHECK_OK(g.ctx, loom_cuda_rope_bwd(g.ctx, dxp, dt, T, NH, D, D, dpos, dinv, NULL));
            down(&g, got, dxp, n, dt);
            CHECK_CLOSE(got, x, n, dt, "rope_bwd D=%lld %s", (long long)D, dn(dt));
            free(x), free(got);
        }
    gpu_close(&g);
}

/* ---------------- fused norms ---------------- */

/* Bits of two device tensors of n elements of dt the same. */
#define CHECK_SAME(g, da, db, n, dt, ...)                                                          \
    do {                                                                                           \
        float *a_ = falloc(n), *b_ = falloc(n);                                                    \
        char w_[256];                                                                              \
        snprintf(w_, sizeof w_, __VA_ARGS__);                                                      \
        down(g, a_, da, n, dt);                                                                    \
        down(g, b_, db, n, dt);                                                                    \
        int64_t k_ = n_differ(a_, b_, n);                                                          \
        CHECK_MSG(k_ == 0, "%s: %lld of %lld elements differ", w_, (long long)k_, (long long)(n)); \
        free(a_), free(b_);                                                                        \
    } while (0)

/* A backward's dw through a loom_cuda_dw_batch sized for one op: the batch
 * then has no room for a second; dw stays as it was until the flush, which
 * gives the bits of the op run on its own (want, on the device). */
typedef struct {
    loom_cuda_dw_batch *b;
    float *dw, *dw0;
    void *scratch;
    int64_t H;
} dw_batch;

static bool dw_batch_begin(gpu *g, dw_batch *bt, int64_t N, int64_t H, const float *dw) {
    memset(bt, 0, sizeof *bt);
    bt->H = H;
    loom_status st = loom_cuda_dw_batch_create(g->ctx, loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) + 255,
                                               &bt->b);
    CHECK_OK(g->ctx, st);
    if (st) return false;
    bt->dw = up(g, dw, H, LOOM_F32);
    bt->dw0 = up(g, dw, H, LOOM_F32);
    bt->scratch = loom_cuda_dw_batch_scratch(bt->b, N, H);
    CHECK_MSG(bt->scratch && !loom_cuda_dw_batch_scratch(bt->b, N, H),
              "a batch sized for one op must take one (%p) and then no more", bt->scratch);
    return !g->bad && bt->scratch;
}

static void dw_batch_end(gpu *g, dw_batch *bt, const float *want, const char *op) {
    CHECK_SAME(g, bt->dw, bt->dw0, bt->H, LOOM_F32, "%s with a batch: dw before the flush", op);
    CHECK_OK(g->ctx, loom_cuda_dw_batch_flush(g->ctx, bt->b, NULL));
    CHECK_SAME(g, bt->dw, want, bt->H, LOOM_F32, "%s with a batch: dw after the flush", op);
    CHECK_OK(g->ctx, loom_cuda_dw_batch_flush(g->ctx, bt->b, NULL)); /* empty: adds nothing */
    CHECK_SAME(g, bt->dw, want, bt->H, LOOM_F32, "%s: a second flush", op);
    CHECK(loom_cuda_dw_batch_scratch(bt->b, 1, bt->H) != NULL); /* emptied by the flush */
    loom_cuda_dw_batch_drop(bt->b);
    loom_cuda_dw_batch_free(bt->b);
}

/* add + RMSNorm forward and RMSNorm backward + add, fused, against the ops
 * apart on the GPU (the same bits; dw within rounding: the fused pass sums
 * rows in another order) and against the CPU. */
static void add_norm_case(gpu *g, int64_t N, int64_t H, loom_dtype dt, bool with_dw) {
    const float eps = 1e-6f;
    const int64_t n = N * H;
    const size_t eb = (size_t)n * loom_dtype_size(dt);
    float *x = falloc(n), *res = falloc(n), *w = falloc(H), *dy = falloc(n), *dx0 = falloc(n);
    float *xs = falloc(n), *y = falloc(n), *rs = falloc(N), *dx = falloc(n), *dw = falloc(H);
    float *got = falloc(n), *gdw = falloc(H);
    fill(x, n, 61, 2), fill(res, n, 62, 1), fill(w, H, 63, 1), fill(dy, n, 64, 1);
    fill(dx0, n, 65, 1), fill(dw, H, 66, 1);
    round_to(g, x, n, dt), round_to(g, res, n, dt), round_to(g, w, H, dt), round_to(g, dy, n, dt);
    round_to(g, dx0, n, dt);
    void *d_x = up(g, x, n, dt), *d_x2 = up(g, x, n, dt), *d_res = up(g, res, n, dt);
    void *d_w = up(g, w, H, dt), *d_y = dalloc(g, eb), *d_y2 = dalloc(g, eb);
    float *d_rs = dalloc(g, (size_t)N * 4), *d_rs2 = dalloc(g, (size_t)N * 4);
    void *d_dy = up(g, dy, n, dt), *d_dy2 = up(g, dy, n, dt), *d_dx = up(g, dx0, n, dt),
         *d_dx2 = up(g, dx0, n, dt);
    float *d_dw = with_dw ? up(g, dw, H, LOOM_F32) : NULL;
    void *scr = dalloc(g, loom_cuda_rmsnorm_bwd_scratch_bytes(N, H));
    if (g->bad) return;
    /* forward, in place on x as the model runs it */
    CHECK_OK(g->ctx, loom_cuda_add_rmsnorm_fwd(g->ctx, d_x, d_res, d_x, dt, d_w, dt, 0.0f, N, H, eps, d_y,
                                               d_rs, NULL));
    CHECK_OK(g->ctx, loom_cuda_residual_add(g->ctx, d_x2, dt, d_res, dt, n, NULL));
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_fwd(g->ctx, d_x2, dt, d_w, dt, 0.0f, N, H, eps, d_y2, dt, d_rs2, NULL));
    CHECK_SAME(g, d_x, d_x2, n, dt, "add_rmsnorm_fwd sum N=%lld H=%lld", (long long)N, (long long)H);
    CHECK_SAME(g, d_y, d_y2, n, dt, "add_rmsnorm_fwd y N=%lld H=%lld", (long long)N, (long long)H);
    CHECK_SAME(g, d_rs, d_rs2, N, LOOM_F32, "add_rmsnorm_fwd rstd N=%lld", (long long)N);
    for (int64_t i = 0; i < n; i++) xs[i] = x[i] + res[i];
    round_to(g, xs, n, dt);
    loom_cpu_rmsnorm_fwd(xs, w, 0.0f, N, H, eps, y, rs);
    round_to(g, y, n, dt);
    down(g, got, d_y, n, dt);
    CHECK_CLOSE(got, y, n, dt, "add_rmsnorm_fwd y vs CPU N=%lld H=%lld", (long long)N, (long long)H);
    /* backward: dx += rmsnorm_bwd(dy) */
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_bwd_add(g->ctx, d_dy, d_x, dt, d_w, dt, 0.0f, d_rs, N, H, d_dx, d_dw,
                                               scr, NULL, NULL));
    if (with_dw) { /* dw through a batch */
        dw_batch bt;
        void *bdx = up(g, dx0, n, dt);
        if (dw_batch_begin(g, &bt, N, H, dw)) {
            CHECK_OK(g->ctx, loom_cuda_rmsnorm_bwd_add(g->ctx, d_dy, d_x, dt, d_w, dt, 0.0f, d_rs, N, H, bdx,
                                                       bt.dw, bt.scratch, bt.b, NULL));
            dw_batch_end(g, &bt, d_dw, "rmsnorm_bwd_add");
        }
    }
    /* without dw the backward is the vector kernel: the fused kernels' dx
     * must have its bits */
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_bwd(g->ctx, d_dy2, dt, d_x, dt, d_w, dt, 0.0f, d_rs, N, H, d_dy2, dt,
                                           NULL, scr, NULL));
    CHECK_OK(g->ctx, loom_cuda_residual_add(g->ctx, d_dx2, dt, d_dy2, dt, n, NULL));
    CHECK_SAME(g, d_dx, d_dx2, n, dt, "rmsnorm_bwd_add dx N=%lld H=%lld", (long long)N, (long long)H);
    down(g, got, d_rs, N, LOOM_F32);
    float *cdw = falloc(H);
    memcpy(cdw, dw, sizeof(float) * (size_t)H);
    loom_cpu_rmsnorm_bwd(dy, xs, w, 0.0f, got, N, H, dx, with_dw ? cdw : NULL);
    round_to(g, dx, n, dt);
    for (int64_t i = 0; i < n; i++) dx[i] += dx0[i];
    round_to(g, dx, n, dt);
    down(g, got, d_dx, n, dt);
    CHECK_CLOSE(got, dx, n, dt, "rmsnorm_bwd_add dx vs CPU N=%lld H=%lld", (long long)N, (long long)H);
    if (with_dw) {
        down(g, gdw, d_dw, H, LOOM_F32);
        CHECK_CLOSE(gdw, cdw, H, LOOM_F32, "rmsnorm_bwd_add dw vs CPU N=%lld H=%lld", (long long)N,
                    (long long)H);
    }
    free(x), free(res), free(w), free(dy), free(dx0), free(xs), free(y), free(rs), free(dx), free(dw),
        free(got), free(gdw), free(cdw);
    gpu_free_all(g);
}

/* Qwen3's q/k norm + RoPE, fused, against rmsnorm then rope (and back)
 * apart on the GPU and on the CPU. */
static void qknorm_rope_case(gpu *g, int64_t T, int64_t nh, int64_t D, loom_dtype dt, bool with_dw) {
    const float eps = 1e-6f;
    const int64_t N = T * nh, n = N * D;
    const size_t eb = (size_t)n * loom_dtype_size(dt);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)T);
    for (int64_t t = 0; t < T; t++) pos[t] = (int32_t)(t % 50 + (t >= T / 2 ? 30000 : 0));
    float inv[128], *x = falloc(n), *w = falloc(D), *dy = falloc(n), *dw = falloc(D);
    float *y = falloc(n), *rs = falloc(N), *got = falloc(n), *gdw = falloc(D), *cdw = falloc(D);
    loom_rope_inv_freq(0, 1e6, D, 1, 1, 1, 0, inv);
    fill(x, n, 71, 2), fill(w, D, 72, 1), fill(dy, n, 73, 1), fill(dw, D, 74, 1);
    round_to(g, x, n, dt), round_to(g, w, D, dt), round_to(g, dy, n, dt);
    void *d_x = up(g, x, n, dt), *d_w = up(g, w, D, dt), *d_y = dalloc(g, eb), *d_y2 = dalloc(g, eb);
    float *d_rs = dalloc(g, (size_t)N * 4), *d_rs2 = dalloc(g, (size_t)N * 4);
    void *d_pos = up_raw(g, pos, sizeof(int32_t) * (size_t)T), *d_inv = up(g, inv, D / 2, LOOM_F32);
    float *cs = dalloc(g, (size_t)(T * D) * 4);
    void *d_dy = up(g, dy, n, dt), *d_dy2 = up(g, dy, n, dt);
    float *d_dw = with_dw ? up(g, dw, D, LOOM_F32) : NULL, *d_dw2 = with_dw ? up(g, dw, D, LOOM_F32) : NULL;
    void *scr = dalloc(g, loom_cuda_rmsnorm_bwd_scratch_bytes(N, D));
    if (g->bad) return;
    CHECK_OK(g->ctx, loom_cuda_rope_table(g->ctx, d_pos, T, D, d_inv, cs, NULL));
    CHECK_OK(g->ctx, loom_cuda_qknorm_rope_fwd(g->ctx, d_x, dt, d_w, dt, 0.0f, N, nh, D, eps, cs, d_y, d_rs,
                                               NULL));
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_fwd(g->ctx, d_x, dt, d_w, dt, 0.0f, N, D, eps, d_y2, dt, d_rs2, NULL));
    CHECK_OK(g->ctx, loom_cuda_rope_fwd(g->ctx, d_y2, dt, T, nh, D, D, d_pos, d_inv, NULL));
    CHECK_SAME(g, d_y, d_y2, n, dt, "qknorm_rope_fwd T=%lld nh=%lld D=%lld", (long long)T,
               (long long)nh, (long long)D);
    CHECK_SAME(g, d_rs, d_rs2, N, LOOM_F32, "qknorm_rope_fwd rstd D=%lld", (long long)D);
    loom_cpu_rmsnorm_fwd(x, w, 0.0f, N, D, eps, y, rs);
    round_to(g, y, n, dt);
    loom_cpu_rope_fwd(y, T, nh, D, D, pos, inv);
    round_to(g, y, n, dt);
    down(g, got, d_y, n, dt);
    CHECK_CLOSE(got, y, n, dt, "qknorm_rope_fwd vs CPU D=%lld", (long long)D);
    /* backward, dx over dy */
    void *d_dy3 = up(g, dy, n, dt);
    CHECK_OK(g->ctx, loom_cuda_qknorm_rope_bwd(g->ctx, d_dy, d_x, dt, d_w, dt, 0.0f, d_rs, N, nh, D, cs,
                                               d_dy, d_dw, scr, NULL, NULL));
    if (with_dw) { /* dw through a batch */
        dw_batch bt;
        if (dw_batch_begin(g, &bt, N, D, dw)) {
            CHECK_OK(g->ctx, loom_cuda_qknorm_rope_bwd(g->ctx, d_dy3, d_x, dt, d_w, dt, 0.0f, d_rs, N, nh, D,
                                                       cs, d_dy3, bt.dw, bt.scratch, bt.b, NULL));
            dw_batch_end(g, &bt, d_dw, "qknorm_rope_bwd");
        }
    }
    CHECK_OK(g->ctx, loom_cuda_rope_bwd(g->ctx, d_dy2, dt, T, nh, D, D, d_pos, d_inv, NULL));
    CHECK_OK(g->ctx, loom_cuda_rmsnorm_bwd(g->ctx, d_dy2, dt, d_x, dt, d_w, dt, 0.0f, d_rs, N, D, d_dy2, dt,
                                           d_dw2, scr, NULL));
    CHECK_SAME(g, d_dy, d_dy2, n, dt, "qknorm_rope_bwd dx T=%lld nh=%lld D=%lld", (long long)T,
               (long long)nh, (long long)D);
    loom_cpu_rope_bwd(dy, T, nh, D, D, pos, inv);
    round_to(g, dy, n, dt);
    memcpy(cdw, dw, sizeof(float) * (size_t)D);
    float *dx = falloc(n);
    loom_cpu_rmsnorm_bwd(dy, x, w, 0.0f, rs, N, D, dx, with_dw ? cdw : NULL);
    round_to(g, dx, n, dt);
    down(g, got, d_dy, n, dt);
    CHECK_CLOSE(got, dx, n, dt, "qknorm_rope_bwd dx vs CPU D=%lld", (long long)D);
    if (with_dw) {
        down(g, gdw, d_dw, D, LOOM_F32);
        CHECK_CLOSE(gdw, cdw, D, LOOM_F32, "qknorm_rope_bwd dw vs CPU D=%lld", (long long)D);
        down(g, got, d_dw2, D, LOOM_F32);
        CHECK_CLOSE(gdw, got, D, LOOM_F32, "qknorm_rope_bwd dw vs the ops apart D=%lld", (long long)D);
    }
    free(pos), free(x), free(w), free(dy), free(dw), free(y), free(rs), free(got), free(gdw), free(cdw),
        free(dx);
    gpu_free_all(g);
}

TEST(cuda_ops_fused_norms) {
    gpu g;
    REQUIRE(gpu_open(&g));
    add_norm_case(&g, 37, 72, LOOM_BF16, true);
    add_norm_case(&g, 300, 1024, LOOM_BF16, true); /* dx and dw in one pass */
    add_norm_case(&g, 300, 1024, LOOM_F16, false);
    add_norm_case(&g, 2000, 256, LOOM_BF16, true);
    add_norm_case(&g, 33, 2560, LOOM_BF16, true); /* wide rows: a block per range of rows */
    add_norm_case(&g, 300, 4096, LOOM_BF16, true);
    add_norm_case(&g, 129, 2048, LOOM_F16, true);
    add_norm_case(&g, 50, 3072, LOOM_F16, false);
    add_norm_case(&g, 40, 8192, LOOM_BF16, true);
    add_norm_case(&g, 300, 4096, LOOM_BF16, false); /* a frozen norm: dx alone */
    add_norm_case(&g, 77, 2560, LOOM_F16, false);
    add_norm_case(&g, 130, 512, LOOM_BF16, false);
    qknorm_rope_case(&g, 37, 3, 128, LOOM_BF16, true);
    qknorm_rope_case(&g, 700, 4, 128, LOOM_BF16, true); /* rows over many blocks */
    qknorm_rope_case(&g, 300, 2, 64, LOOM_F16, true);
    qknorm_rope_case(&g, 50, 5, 256, LOOM_BF16, false);
    qknorm_rope_case(&g, 129, 8, 128, LOOM_BF16, false); /* Qwen3's head counts */
    qknorm_rope_case(&g, 33, 32, 64, LOOM_F16, false);
    qknorm_rope_case(&g, 40, 16, 256, LOOM_BF16, false);
    qknorm_rope_case(&g, 37, 3, 128, LOOM_BF16, false);
    REQUIRE(!g.bad);
    /* what the fused kernels do not take is refused with the op's name */
    void *p = dalloc(&g, 4096);
    REQUIRE(p);
    CHECK(!loom_cuda_rmsnorm_fused_ok(LOOM_F32, 64) && !loom_cuda_rmsnorm_fused_ok(LOOM_BF16, 36));
    CHECK(loom_cuda_add_rmsnorm_fwd(g.ctx, p, p, p, LOOM_F32, p, LOOM_F32, 0.0f, 2, 64, 1e-6f, p, p, NULL) ==
          LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda add_rmsnorm_fwd");
    CHECK(!loom_cuda_qknorm_rope_ok(LOOM_BF16, 48));
    CHECK(loom_cuda_qknorm_rope_fwd(g.ctx, p, LOOM_BF16, p, LOOM_BF16, 0.0f, 4, 2, 48, 1e-6f, p, p, p, NULL) ==
          LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda qknorm_rope_fwd");
    CHECK(loom_cuda_qknorm_rope_fwd(g.ctx, p, LOOM_BF16, p, LOOM_BF16, 0.0f, 5, 2, 128, 1e-6f, p, p, p, NULL) ==
          LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "not tokens of 2 heads");
    CHECK(loom_cuda_rmsnorm_bwd_add(g.ctx, (char *)p + 2, p, LOOM_BF16, p, LOOM_BF16, 0.0f, p, 2, 64,
                                    (char *)p + 512, NULL, NULL, NULL, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(g.ctx), "16-byte aligned");
    gpu_close(&g);
}

/* ---------------- SwiGLU, residual, bias ---------------- */

/* An element-wise op of two inputs (a, b) with its backward (d, a, b ->
 * two gradients), the CUDA one against the CPU's in fp32, bf16 and f16, at
 * n % 8 != 0 and n % 8 == 0 (16-bit vector paths); the backward writes its
 * outputs over the inputs the model lets them alias (over[k]: 0 d, 1 a, 2 b). */
typedef struct {
    const char *name;
    float sd_a, sd_b; /* the random inputs' scales */
    void (*cpu_fwd)(const float *a, const float *b, int64_t n, float *y);
    void (*cpu_bwd)(const float *d, const float *a, const float *b, int64_t n, float *o1, float *o2);
    loom_status (*cuda_fwd)(loom_ctx *, const void *a, const void *b, int64_t n, void *y,
                            loom_dtype, void *stream);
    loom_status (*cuda_bwd)(loom_ctx *, const void *d, const void *a, const void *b, int64_t n,
                            void *o1, void *o2, loom_dtype, void *stream);
    int over[2];
} pair_op;

static void check_pair_op(const pair_op *op) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const loom_dtype types[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    for (int ti = 0; ti < 6; ti++) {
        const loom_dtype dt = types[ti % 3];
        const int64_t n = ti < 3 ? 100037 : 100032;
        float *in[3] = {falloc(n), falloc(n), falloc(n)}, *y = falloc(n), *o[2] = {falloc(n), falloc(n)},
              *got = falloc(n);
        const float sd[3] = {1, op->sd_a, op->sd_b};
        void *d_in[3];
        for (int k = 0; k < 3; k++) {
            fill(in[k], n, 61 + (uint64_t)k, sd[k]);
            round_to(&g, in[k], n, dt);
            d_in[k] = up(&g, in[k], n, dt);
        }
        void *d_y = dalloc(&g, (size_t)n * 4);
        REQUIRE(!g.bad);
        op->cpu_fwd(in[1], in[2], n, y);
        round_to(&g, y, n, dt);
        CHECK_OK(g.ctx, op->cuda_fwd(g.ctx, d_in[1], d_in[2], n, d_y, dt, NULL));
        down(&g, got, d_y, n, dt);
        CHECK_CLOSE(got, y, n, dt, "%s fwd %s n=%lld", op->name, dn(dt), (long long)n);
        op->cpu_bwd(in[0], in[1], in[2], n, o[0], o[1]);
        CHECK_OK(g.ctx, op->cuda_bwd(g.ctx, d_in[0], d_in[1], d_in[2], n, d_in[op->over[0]],
                                     d_in[op->over[1]], dt, NULL));
        for (int k = 0; k < 2; k++) {
            round_to(&g, o[k], n, dt);
            down(&g, got, d_in[op->over[k]], n, dt);
            CHECK_CLOSE(got, o[k], n, dt, "%s bwd output %d %s n=%lld", op->name, k, dn(dt),
                        (long long)n);
        }
        for (int k = 0; k < 3; k++) free(in[k]);
        free(y), free(o[0]), free(o[1]), free(got);
    }
    gpu_close(&g);
}

/* SwiGLU h = silu(g) u: dg over g, du over u */
TEST(cuda_ops_swiglu) {
    const pair_op op = {"swiglu", 3, 1, loom_cpu_swiglu_fwd, loom_cpu_swiglu_bwd,
                        loom_cuda_swiglu_fwd, loom_cuda_swiglu_bwd, {1, 2}};
    check_pair_op(&op);
}

/* The gated attention's output gate, y = o sigmoid(g): dout over dy, dg over g */
TEST(cuda_ops_gate) {
    const pair_op op = {"gate", 2, 4, loom_cpu_gate_fwd, loom_cpu_gate_bwd, loom_cuda_gate_fwd,
                        loom_cuda_gate_bwd, {0, 2}};
    check_pair_op(&op);
}

TEST(cuda_ops_residual_and_bias) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const int64_t shapes[][2] = {{37, 72}, {1000, 33}, {5, 4096}};
    const loom_dtype pairs[][2] = {{LOOM_F32, LOOM_F32}, {LOOM_F32, LOOM_BF16}, {LOOM_BF16, LOOM_BF16}};
    for (size_t si = 0; si < 3; si++)
        for (size_t pi = 0; pi < 3; pi++) {
            const int64_t T = shapes[si][0], N = shapes[si][1], n = T * N;
            const loom_dtype ydt = pairs[pi][0], xdt = pairs[pi][1];
            float *y = falloc(n), *x = falloc(n), *b = falloc(N), *db = falloc(N), *got = falloc(n);
            fill(y, n, 71, 1);
            fill(x, n, 72, 1);
            fill(b, N, 73, 1);
            fill(db, N, 74, 1);
            round_to(&g, y, n, ydt);
            round_to(&g, x, n, xdt);
            round_to(&g, b, N, xdt);
            void *d_y = up(&g, y, n, ydt), *d_x = up(&g, x, n, xdt), *d_b = up(&g, b, N, xdt);
            float *d_db = up(&g, db, N, LOOM_F32);
            REQUIRE(!g.bad);
            loom_cpu_residual_add(y, x, n);
            round_to(&g, y, n, ydt);
            CHECK_OK(g.ctx, loom_cuda_residual_add(g.ctx, d_y, ydt, d_x, xdt, n, NULL));
            down(&g, got, d_y, n, ydt);
            CHECK_CLOSE(got, y, n, ydt, "residual_add T=%lld N=%lld %s += %s", (long long)T,
                        (long long)N, dn(ydt), dn(xdt));
            loom_cpu_add_bias_fwd(y, b, T, N);
            round_to(&g, y, n, ydt);
            CHECK_OK(g.ctx, loom_cuda_add_bias_fwd(g.ctx, d_y, ydt, d_b, xdt, T, N, NULL));
            down(&g, got, d_y, n, ydt);
            CHECK_CLOSE(got, y, n, ydt, "add_bias_fwd T=%lld N=%lld %s + %s", (long long)T,
                        (long long)N, dn(ydt), dn(xdt));
            /* bwd over x (as dy) */
            loom_cpu_add_bias_bwd(x, T, N, db);
            CHECK_OK(g.ctx, loom_cuda_add_bias_bwd(g.ctx, d_x, xdt, T, N, d_db, NULL));
            down(&g, got, d_db, N, LOOM_F32);
            CHECK_CLOSE(got, db, N, LOOM_F32, "add_bias_bwd T=%lld N=%lld %s", (long long)T,
                        (long long)N, dn(xdt));
            CHECK_OK(g.ctx, loom_cuda_add_bias_bwd(g.ctx, d_x, xdt, T, N, NULL, NULL)); /* frozen */
            free(y), free(x), free(b), free(db), free(got);
        }
    gpu_close(&g);
}

/* ---------------- cross-entropy ---------------- */

static void xent_case(gpu *g, int64_t T, int64_t V, int64_t Vp, loom_dtype dt, bool alias) {
    const int64_t n = T * Vp;
    float *z = falloc(n), *dz = falloc(n), *got = falloc(n);
    float *lp = falloc(T), *ent = falloc(T), *lse = falloc(T), *glp = falloc(T), *gent = falloc(T),
          *glse = falloc(T);
    int32_t *tg = malloc(sizeof(int32_t) * (size_t)T);
    fill(z, n, 81, 3);
    for (int64_t t = 0; t < T; t++) {
        tg[t] = (int32_t)(loom_splitmix64((uint64_t)t + 99) % (uint64_t)V);
        if (t % 7 == 3) tg[t] = -100;
        for (int64_t c = V; c < Vp; c++) z[t * Vp + c] = 1e4f; /* padding must be ignored */
    }
    if (T > 5) z[5 * Vp + tg[5]] = 40.0f; /* one confident row */
    round_to(g, z, n, dt);
    void *dz_d = up(g, z, n, dt), *dtg = up_raw(g, tg, sizeof(int32_t) * (size_t)T);
    float *dlp = dalloc(g, (size_t)T * 4), *dent = dalloc(g, (size_t)T * 4), *dlse = dalloc(g, (size_t)T * 4);
    double *dtl = dalloc(g, (size_t)T * 8), *dloss = dalloc(g, 8);
    if (g->bad) return;
    double loss = loom_cpu_cross_entropy_fwd(z, tg, T, V, Vp, lp, ent, lse);
    CHECK_OK(g->ctx, loom_cuda_cross_entropy_fwd(g->ctx, dz_d, dt, dtg, T, V, Vp, dlp, dent, dlse, dtl,
                                                 dloss, NULL));
    double gloss = NAN;
    down(g, glp, dlp, T, LOOM_F32);
    down(g, gent, dent, T, LOOM_F32);
    down(g, glse, dlse, T, LOOM_F32);
    CHECK_OK(g->ctx, loom_cuda_memcpy_d2h(g->ctx, &gloss, dloss, sizeof gloss));
    CHECK_CLOSE(glp, lp, T, LOOM_F32, "xent token_logprob T=%lld V=%lld %s", (long long)T, (long long)V, dn(dt));
    CHECK_CLOSE(gent, ent, T, LOOM_F32, "xent entropy T=%lld V=%lld %s", (long long)T, (long long)V, dn(dt));
    CHECK_CLOSE(glse, lse, T, LOOM_F32, "xent lse T=%lld V=%lld %s", (long long)T, (long long)V, dn(dt));
    CHECK_MSG(fabs(gloss - loss) <= 1e-9 * fabs(loss), "xent loss %.17g vs %.17g", gloss, loss);
    /* backward from the CPU's lse, into dlogits of the logits' dtype */
    float *dlse2 = up(g, lse, T, LOOM_F32);
    void *ddz = alias ? dz_d : dalloc(g, (size_t)n * loom_dtype_size(dt));
    if (g->bad) return;
    const float scale = 1.0f / 29;
    loom_cpu_cross_entropy_bwd(z, lse, tg, T, V, Vp, scale, dz);
    round_to(g, dz, n, dt);
    CHECK_OK(g->ctx, loom_cuda_cross_entropy_bwd(g->ctx, dz_d, dt, dlse2, dtg, T, V, Vp, scale, ddz, dt,
                                                 NULL));
    down(g, got, ddz, n, dt);
    CHECK_CLOSE(got, dz, n, dt, "xent_bwd T=%lld V=%lld Vp=%lld %s%s", (long long)T, (long long)V,
                (long long)Vp, dn(dt), alias ? " (in place)" : "");
    free(z), free(dz), free(got), free(lp), free(ent), free(lse), free(glp), free(gent), free(glse), free(tg);
    while (g->n > 0) loom_cuda_free(g->ptrs[--g->n]);
}

TEST(cuda_ops_cross_entropy) {
    gpu g;
    REQUIRE(gpu_open(&g));
    xent_case(&g, 37, 1000, 1024, LOOM_F32, false);
    xent_case(&g, 37, 1000, 1024, LOOM_F32, true);
    xent_case(&g, 37, 77, 77, LOOM_F32, false);
    xent_case(&g, 37, 1000, 1024, LOOM_BF16, true);
    xent_case(&g, 4, 151936, 152064, LOOM_F32, true);
    REQUIRE(!g.bad);
    gpu_close(&g);
}

/* ---------------- attention ---------------- */

/* One attention case: GPU forward and backward against the CPU on the same
 * (rounded) inputs; with qidx, the query-subset variant. The backward gets
 * the CPU's out and lse on both sides, so it is checked on its own. */
/* The cuDNN cases: equal documents by their length, others as ragged (0). */
static int64_t cudnn_len(const int32_t *cu, int64_t ndocs) {
    for (int64_t d = 1; d < ndocs; d++)
        if (cu[d + 1] - cu[d] != cu[1] - cu[0]) return 0;
    return cu[1] - cu[0];
}

static void attn_case_h(gpu *g, loom_cuda_attn_handle *h, int64_t T, int64_t Hq, int64_t Hkv,
                        int64_t D, const int32_t *cu, int64_t ndocs, const int32_t *qidx, int64_t Tq,
                        loom_dtype dt, uint64_t key) {
    const int64_t nq = Tq * Hq * D, nk = T * Hkv * D;
    const float scale = (float)(1.0 / sqrt((double)D));
    float *q = falloc(nq), *k = falloc(nk), *v = falloc(nk), *o = falloc(nq), *l = falloc(Tq * Hq);
    float *dout = falloc(nq), *dq = falloc(nq), *dk = falloc(nk), *dv = falloc(nk);
    float *go = falloc(nq), *gl = falloc(Tq * Hq), *gdq = falloc(nq), *gdk = falloc(nk),
          *gdv = falloc(nk);
    fill(q, nq, key, 1);
    fill(k, nk, key + 1, 1);
    fill(v, nk, key + 2, 1);
    fill(dout, nq, key + 3, 1);
    round_to(g, q, nq, dt);
    round_to(g, k, nk, dt);
    round_to(g, v, nk, dt);
    round_to(g, dout, nq, dt);
    void *d_q = up(g, q, nq, dt), *d_k = up(g, k, nk, dt), *d_v = up(g, v, nk, dt);
    void *d_cu = up_raw(g, cu, sizeof(int32_t) * (size_t)(ndocs + 1));
    void *d_qi = qidx ? up_raw(g, qidx, sizeof(int32_t) * (size_t)Tq) : NULL;
    void *d_o = dalloc(g, (size_t)nq * 4);
    float *d_l = dalloc(g, (size_t)(Tq * Hq) * 4);
    if (g->bad) return;
    char what[160];
    const char *det = getenv("LOOM_ATTN_DETERMINISTIC");
    snprintf(what, sizeof what, "attention T=%lld Tq=%lld Hq=%lld Hkv=%lld D=%lld ndocs=%lld %s%s%s",
             (long long)T, (long long)Tq, (long long)Hq, (long long)Hkv, (long long)D,
             (long long)ndocs, dn(dt), qidx ? " (query subset)" : "",
             h ? " (cuDNN)" : det && strcmp(det, "1") == 0 ? " (deterministic backward)" : "");
    loom_cpu_attention_fwd_q(q, qidx, Tq, k, v, T, Hq, Hkv, D, cu, ndocs, scale, o, l);
    bool taken = false;
    if (h) { /* equal documents: T / ndocs tokens each */
        CHECK_OK(g->ctx, loom_cuda_attention_cudnn_fwd(g->ctx, h, d_q, d_k, d_v, dt, T, Hq, Hkv, D,
                                                       d_cu, ndocs, cudnn_len(cu, ndocs), scale, d_o,
                                                       d_l, NULL, &taken));
        const char *why;
        loom_cuda_attn_counts(h, NULL, NULL, &why);
        CHECK_MSG(taken, "%s: cuDNN did not take the forward: %s", what, why);
    } else if (qidx)
        CHECK_OK(g->ctx, loom_cuda_attention_fwd_q(g->ctx, d_q, d_qi, Tq, d_k, d_v, dt, T, Hq, Hkv, D,
                                                   d_cu, ndocs, scale, d_o, d_l, NULL));
    else
        CHECK_OK(g->ctx, loom_cuda_attention_fwd(g->ctx, d_q, d_k, d_v, dt, T, Hq, Hkv, D, d_cu, ndocs,
                                                 scale, d_o, d_l, NULL));
    down(g, go, d_o, nq, dt);
    down(g, gl, d_l, Tq * Hq, LOOM_F32);
    round_to(g, o, nq, dt);
    CHECK_CLOSE(go, o, nq, dt, "%s: out", what);
    CHECK_CLOSE(gl, l, Tq * Hq, LOOM_F32, "%s: lse", what);

    /* backward from the CPU's (rounded) out and lse */
    void *d_o2 = up(g, o, nq, dt), *d_do = up(g, dout, nq, dt);
    float *d_l2 = up(g, l, Tq * Hq, LOOM_F32);
    void *d_dq = dalloc(g, (size_t)nq * 4), *d_dk = dalloc(g, (size_t)nk * 4), *d_dv = dalloc(g, (size_t)nk * 4);
    if (g->bad) return;
    loom_cpu_attention_bwd_q(dout, q, qidx, Tq, k, v, o, l, T, Hq, Hkv, D, cu, ndocs, scale, dq, dk, dv);
    if (h) {
        CHECK_OK(g->ctx, loom_cuda_attention_cudnn_bwd(g->ctx, h, d_do, d_q, d_k, d_v, d_o2, d_l2, dt, T,
                                                       Hq, Hkv, D, d_cu, ndocs, cudnn_len(cu, ndocs),
                                                       scale, d_dq, d_dk, d_dv, NULL, &taken));
        const char *why;
        loom_cuda_attn_counts(h, NULL, NULL, &why);
        CHECK_MSG(taken, "%s: cuDNN did not take the backward: %s", what, why);
    } else if (qidx)
        CHECK_OK(g->ctx, loom_cuda_attention_bwd_q(g->ctx, d_do, d_q, d_qi, Tq, d_k, d_v, d_o2, d_l2,
                                                   dt, T, Hq, Hkv, D, d_cu, ndocs, scale, d_dq, d_dk,
                                                   d_dv, NULL));
    else
        CHECK_OK(g->ctx, loom_cuda_attention_bwd(g->ctx, d_do, d_q, d_k, d_v, d_o2, d_l2, dt, T, Hq,
                                                 Hkv, D, d_cu, ndocs, scale, d_dq, d_dk, d_dv, NULL));
    down(g, gdq, d_dq, nq, dt);
    down(g, gdk, d_dk, nk, dt);
    down(g, gdv, d_dv, nk, dt);
    round_to(g, dq, nq, dt);
    round_to(g, dk, nk, dt);
    round_to(g, dv, nk, dt);
    CHECK_CLOSE(gdq, dq, nq, dt, "%s: dq", what);
    CHECK_CLOSE(gdk, dk, nk, dt, "%s: dk", what);
    CHECK_CLOSE(gdv, dv, nk, dt, "%s: dv", what);
    free(q), free(k), free(v), free(o), free(l), free(dout), free(dq), free(dk), free(dv);
    free(go), free(gl), free(gdq), free(gdk), free(gdv);
    while (g->n > 0) loom_cuda_free(g->ptrs[--g->n]);
}

static void attn_case(gpu *g, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, const int32_t *cu,
                      int64_t ndocs, const int32_t *qidx, int64_t Tq, loom_dtype dt, uint64_t key) {
    attn_case_h(g, NULL, T, Hq, Hkv, D, cu, ndocs, qidx, Tq, dt, key);
}

/* Both backwards of the tensor-core path: the fused one (dQ by atomics) and,
 * with LOOM_ATTN_DETERMINISTIC=1, the two-kernel one; the F32 and odd-D
 * cases (CUDA-core path) run twice alike. */
TEST(cuda_ops_attention) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const int32_t cu3[4] = {0, 10, 23, 37}, cu1[2] = {0, 37};
    const int32_t cuL[5] = {0, 100, 101, 230, 300}; /* a one-token document */
    const int64_t Ds[5] = {16, 64, 128, 72, 256};
    const loom_dtype types[2] = {LOOM_F32, LOOM_BF16};
    for (int mode = 0; mode < 2; mode++) {
    setenv("LOOM_ATTN_DETERMINISTIC", mode ? "1" : "0", 1);
    for (int ti = 0; ti < 2; ti++) {
        for (int di = 0; di < 5; di++) {
            attn_case(&g, 37, 6, 2, Ds[di], cu3, 3, NULL, 37, types[ti], 100 + (uint64_t)di);
            attn_case(&g, 37, 4, 4, Ds[di], cu1, 1, NULL, 37, types[ti], 110 + (uint64_t)di);
        }
        attn_case(&g, 300, 6, 2, 64, cuL, 4, NULL, 300, types[ti], 120);
        attn_case(&g, 300, 2, 1, 128, cuL, 4, NULL, 300, types[ti], 121);
    }
    attn_case(&g, 37, 6, 2, 64, cu3, 3, NULL, 37, LOOM_F16, 130);
    attn_case(&g, 300, 4, 2, 128, cuL, 4, NULL, 300, LOOM_F16, 131);
    const int32_t cuM[6] = {0, 1, 200, 517, 900, 1000}; /* many 64-row tiles across documents */
    attn_case(&g, 1000, 8, 2, 128, cuM, 5, NULL, 1000, LOOM_BF16, 140);
    attn_case(&g, 1000, 4, 4, 64, cuM, 5, NULL, 1000, LOOM_BF16, 141);
    }
    unsetenv("LOOM_ATTN_DETERMINISTIC");
    REQUIRE(!g.bad);
    /* D past the limit is refused with the op's name */
    CHECK(loom_cuda_attention_fwd(g.ctx, NULL, NULL, NULL, LOOM_F32, 4, 1, 1, 300, NULL, 1, 1.0f, NULL,
                                  NULL, NULL) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(g.ctx), "cuda attention_fwd");
    gpu_close(&g);
}

/* cuDNN's fused attention against the CPU: equal documents (B sequences of
 * L tokens, L not a multiple of the engines' tiles) and documents of other
 * lengths (the ragged graphs, one-token documents included), under grouped
 * and plain heads, D 64, 72, 128 and 256 (Qwen3.5's), BF16 and F16; inputs it does not take
 * come back untaken, with no error. */
TEST(cuda_ops_attention_cudnn) {
    gpu g;
    REQUIRE(gpu_open(&g));
    loom_cuda_attn_handle *h = NULL;
    REQUIRE_OK(g.ctx, loom_cuda_attn_create(g.ctx, &h));
    const int32_t cu1[2] = {0, 256}, cu2[3] = {0, 100, 200}, cu3[4] = {0, 37, 74, 111};
    attn_case_h(&g, h, 256, 4, 2, 128, cu1, 1, NULL, 256, LOOM_BF16, 200);
    attn_case_h(&g, h, 256, 8, 2, 64, cu1, 1, NULL, 256, LOOM_BF16, 201);
    attn_case_h(&g, h, 200, 4, 4, 128, cu2, 2, NULL, 200, LOOM_BF16, 202);
    attn_case_h(&g, h, 200, 6, 2, 128, cu2, 2, NULL, 200, LOOM_F16, 203);
    attn_case_h(&g, h, 111, 2, 1, 64, cu3, 3, NULL, 111, LOOM_BF16, 204);
    attn_case_h(&g, h, 200, 4, 2, 72, cu2, 2, NULL, 200, LOOM_BF16, 205);
    attn_case_h(&g, h, 256, 4, 2, 128, cu1, 1, NULL, 256, LOOM_BF16, 206); /* a cached plan */
    const int32_t cu4[4] = {0, 10, 23, 37}, cuL[5] = {0, 100, 101, 230, 300};
    const int32_t cuM[6] = {0, 1, 200, 517, 900, 1000};
    attn_case_h(&g, h, 37, 6, 2, 128, cu4, 3, NULL, 37, LOOM_BF16, 210);
    attn_case_h(&g, h, 37, 4, 4, 64, cu4, 3, NULL, 37, LOOM_BF16, 211);
    attn_case_h(&g, h, 300, 4, 2, 128, cuL, 4, NULL, 300, LOOM_F16, 212);
    attn_case_h(&g, h, 1000, 8, 2, 128, cuM, 5, NULL, 1000, LOOM_BF16, 213);
    attn_case_h(&g, h, 1000, 4, 4, 64, cuM, 5, NULL, 1000, LOOM_BF16, 214);
    attn_case_h(&g, h, 256, 4, 2, 256, cu1, 1, NULL, 256, LOOM_BF16, 215);
    attn_case_h(&g, h, 300, 4, 1, 256, cuL, 4, NULL, 300, LOOM_BF16, 216);
    attn_case_h(&g, h, 200, 2, 2, 256, cu2, 2, NULL, 200, LOOM_F16, 217);
    long long nf = 0, nb = 0;
    loom_cuda_attn_counts(h, &nf, &nb, NULL);
    CHECK_MSG(nf == 15 && nb == 15, "cuDNN ran %lld forwards and %lld backwards of 15", nf, nb);
    /* F32, D = 36 or 264 and 513 documents are not for cuDNN: untaken, no error,
     * nothing run */
    void *buf = dalloc(&g, 600 * 4 * 128 * 4);
    float *lse = dalloc(&g, 600 * 4 * 4);
    int32_t many[514];
    for (int i = 0; i <= 512; i++) many[i] = i;
    many[513] = 600;
    void *d_many = up_raw(&g, many, sizeof many);
    REQUIRE(!g.bad);
    bool taken = true;
    CHECK_OK(g.ctx, loom_cuda_attention_cudnn_fwd(g.ctx, h, buf, buf, buf, LOOM_F32, 256, 4, 2, 128,
                                                  NULL, 1, 256, 0.1f, buf, lse, NULL, &taken));
    CHECK(!taken);
    taken = true;
    CHECK_OK(g.ctx, loom_cuda_attention_cudnn_fwd(g.ctx, h, buf, buf, buf, LOOM_BF16, 256, 4, 2, 36,
                                                  NULL, 1, 256, 0.1f, buf, lse, NULL, &taken));
    CHECK(!taken);
    taken = true;
    CHECK_OK(g.ctx, loom_cuda_attention_cudnn_fwd(g.ctx, h, buf, buf, buf, LOOM_BF16, 600, 4, 2, 128,
                                                  d_many, 513, 0, 0.1f, buf, lse, NULL, &taken));
    CHECK(!taken);
    taken = true;
    CHECK_OK(g.ctx, loom_cuda_attention_cudnn_fwd(g.ctx, h, buf, buf, buf, LOOM_BF16, 64, 4, 2, 264,
                                                  NULL, 1, 64, 0.1f, buf, lse, NULL, &taken));
    CHECK(!taken);
    loom_cuda_attn_counts(h, &nf, NULL, NULL);
    CHECK(nf == 15);
    loom_cuda_attn_free(h);
    REQUIRE(!g.bad);
    gpu_close(&g);
}

/* Context parallel cp=2: the sequence in 4 chunks, rank r holds chunks r and
 * 3-r (as tests/test_ops.c's ops_attention_query_subset), against the CPU's
 * query-subset ops (which that test checks against the full attention). */
TEST(cuda_ops_attention_query_subset) {
    gpu g;
    REQUIRE(gpu_open(&g));
    enum { T = 96 };
    const int32_t cu[4] = {0, 17, 60, 96};
    const loom_dtype types[2] = {LOOM_F32, LOOM_BF16};
    const int64_t Ds[3] = {16, 64, 128};
    for (int mode = 0; mode < 2; mode++) { /* fused, then deterministic backward */
        setenv("LOOM_ATTN_DETERMINISTIC", mode ? "1" : "0", 1);
        for (int ti = 0; ti < 2; ti++)
            for (int di = 0; di < 3; di++)
                for (int r = 0; r < 2; r++) {
                    int32_t qidx[T / 2];
                    const int n = loom_test_cp2_queries(T, r, qidx);
                    attn_case(&g, T, 6, 2, Ds[di], cu, 3, qidx, n, types[ti], 200 + (uint64_t)di);
                }
    }
    unsetenv("LOOM_ATTN_DETERMINISTIC");
    REQUIRE(!g.bad);
    gpu_close(&g);
}

/* ---------------- optimizer ---------------- */

TEST(cuda_ops_adamw) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const size_t n = 100003;
    const loom_adamw_hp hps[2] = {{1e-3, 0.9, 0.999, 1e-8, 0.1}, {3e-2, 0.3, 0.95, 1e-6, 0.01}};
    for (int hi = 0; hi < 2; hi++)
        for (int dec = 0; dec < 2; dec++)
            for (int64_t t = 1; t <= 7; t += 6) {
                float *p = falloc((int64_t)n), *gr = falloc((int64_t)n), *m = falloc((int64_t)n),
                      *v = falloc((int64_t)n);
                float *gp = falloc((int64_t)n), *gm = falloc((int64_t)n), *gv = falloc((int64_t)n);
                fill(p, (int64_t)n, 91, 1);
                fill(gr, (int64_t)n, 92, 1e-2f);
                fill(m, (int64_t)n, 93, 1e-3f);
                fill(v, (int64_t)n, 94, 1e-3f);
                for (size_t i = 0; i < n; i++) v[i] = v[i] * v[i];
                if (t == 1)
                    for (size_t i = 0; i < n; i++) m[i] = v[i] = 0;
                float *dp = up(&g, p, (int64_t)n, LOOM_F32), *dg = up(&g, gr, (int64_t)n, LOOM_F32);
                float *dm = up(&g, m, (int64_t)n, LOOM_F32), *dv = up(&g, v, (int64_t)n, LOOM_F32);
                REQUIRE(!g.bad);
                loom_adamw_step(p, gr, m, v, n, &hps[hi], t, dec);
                CHECK_OK(g.ctx, loom_cuda_adamw_step(g.ctx, dp, dg, dm, dv, n, &hps[hi], t, dec, NULL));
                down(&g, gp, dp, (int64_t)n, LOOM_F32);
                down(&g, gm, dm, (int64_t)n, LOOM_F32);
                down(&g, gv, dv, (int64_t)n, LOOM_F32);
                size_t diff = 0;
                for (size_t i = 0; i < n; i++)
                    diff += memcmp(&gp[i], &p[i], 4) != 0 || memcmp(&gm[i], &m[i], 4) != 0 ||
                            memcmp(&gv[i], &v[i], 4) != 0;
                double e = fmax(rel_err(gp, p, (int64_t)n), fmax(rel_err(gm, m, (int64_t)n), rel_err(gv, v, (int64_t)n)));
                CHECK_MSG(e <= 1e-6, "adamw hp %d decay %d t %lld: rel err %g", hi, dec, (long long)t, e);
                CHECK_MSG(diff == 0, "adamw hp %d decay %d t %lld: %zu elements not bit-identical",
                          hi, dec, (long long)t, diff);
                free(p), free(gr), free(m), free(v), free(gp), free(gm), free(gv);
                while (g.n > 0) loom_cuda_free(g.ptrs[--g.n]);
            }
    gpu_close(&g);
}

/* AdamW and the sum of squares over many blocks in one launch (the chunk
 * lists of the distributed optimizer) against loom_adamw_step / double sums
 * per block: parameters in one buffer, gradients and moments in another at
 * other offsets, blocks with and without decay, some longer than a chunk. */
/* AdamW over chunks of parameter blocks against loom_adamw_step_scaled, bit
 * for bit, with the compute copy in wdt. align4: every block starts at a
 * multiple of 4 elements (the kernel's 16-byte path and its ragged ends);
 * else the offsets are odd (one element at a time). */
static void adamw_chunks_case(gpu *g, bool align4, loom_dtype wdt) {
    const int nb = 7;
    const size_t lens[7] = {5, 70000, 1, 16384, 16385, 333, 40000};
    size_t P = 0, S = 0, poff[7], soff[7];
    for (int b = 0; b < nb; b++) {
        poff[b] = P + 3; /* parameters padded apart, shard dense */
        soff[b] = S;
        if (align4) poff[b] = (poff[b] + 3) / 4 * 4, soff[b] = (soff[b] + 3) / 4 * 4;
        P = poff[b] + lens[b];
        S = soff[b] + lens[b];
    }
    float *p = falloc((int64_t)P), *gr = falloc((int64_t)S), *m = falloc((int64_t)S),
          *v = falloc((int64_t)S), *gp = falloc((int64_t)P), *gm = falloc((int64_t)S),
          *gv = falloc((int64_t)S);
    fill(p, (int64_t)P, 71, 1);
    fill(gr, (int64_t)S, 72, 1e-2f);
    fill(m, (int64_t)S, 73, 1e-3f);
    fill(v, (int64_t)S, 74, 1e-3f);
    for (size_t i = 0; i < S; i++) v[i] = v[i] * v[i];
    float *dp = up(g, p, (int64_t)P, LOOM_F32), *dg = up(g, gr, (int64_t)S, LOOM_F32);
    float *dm = up(g, m, (int64_t)S, LOOM_F32), *dv = up(g, v, (int64_t)S, LOOM_F32);
    loom_cuda_chunk ch[64];
    double want_chunk[64];
    int nc = 0;
    for (int b = 0; b < nb; b++)
        for (size_t o = 0; o < lens[b]; o += LOOM_CUDA_CHUNK) {
            size_t len = lens[b] - o < LOOM_CUDA_CHUNK ? lens[b] - o : LOOM_CUDA_CHUNK;
            ch[nc] = (loom_cuda_chunk){.p_off = (int64_t)(poff[b] + o),
                                       .s_off = (int64_t)(soff[b] + o), .len = (int32_t)len,
                                       .decay = b % 2};
            want_chunk[nc++] = loom_sumsq_scaled(gr + soff[b] + o, len, 0.37f);
        }
    loom_cuda_chunk *dch = up_raw(g, ch, (size_t)nc * sizeof ch[0]);
    double *dsum = dalloc(g, (size_t)nc * sizeof(double));
    if (g->bad) return;
    const loom_adamw_hp hp = {3e-3, 0.9, 0.95, 1e-8, 0.1};
    const float gs[2] = {0.37f, 0.61f}; /* unscale and clip inside the passes */
    for (int b = 0; b < nb; b++)
        loom_adamw_step_scaled(p + poff[b], gr + soff[b], m + soff[b], v + soff[b], lens[b], &hp, 3,
                               b % 2, gs);
    CHECK_OK(g->ctx, loom_cuda_sumsq_chunks(g->ctx, dg, dch, nc, 0.37f, dsum, NULL));
    float *zero = falloc((int64_t)P);
    void *dwc = up(g, zero, (int64_t)P, wdt), *dwc2 = up(g, zero, (int64_t)P, wdt);
    free(zero);
    if (g->bad) return;
    CHECK_OK(g->ctx, loom_cuda_adamw_chunks(g->ctx, dp, dg, dm, dv, dch, nc, &hp, 3, gs, dwc, wdt, NULL));
    /* the compute copy written in the same pass: the new parameters in bf16,
     * as a convert of them gives (blocks only: the padding stays zero) */
    for (int b = 0; b < nb; b++)
        CHECK_OK(g->ctx, loom_cuda_convert(g->ctx, (char *)dwc2 + poff[b] * loom_dtype_size(wdt), wdt,
                                          dp + poff[b], LOOM_F32, lens[b], NULL));
    CHECK_SAME(g, dwc, dwc2, (int64_t)P, wdt, "adamw_chunks compute copy (%s, align4 %d)",
               loom_dtype_name(wdt), (int)align4);
    down(g, gp, dp, (int64_t)P, LOOM_F32);
    down(g, gm, dm, (int64_t)S, LOOM_F32);
    down(g, gv, dv, (int64_t)S, LOOM_F32);
    size_t diff = 0;
    for (size_t i = 0; i < P; i++) /* the padding between blocks is not touched either */
        diff += memcmp(&gp[i], &p[i], 4) != 0;
    for (size_t i = 0; i < S; i++) diff += memcmp(&gm[i], &m[i], 4) || memcmp(&gv[i], &v[i], 4);
    CHECK_MSG(diff == 0, "adamw_chunks (align4 %d): %zu elements differ from loom_adamw_step_scaled",
              (int)align4, diff);
    double got[64];
    CHECK_OK(g->ctx, loom_cuda_memcpy_d2h(g->ctx, got, dsum, (size_t)nc * sizeof(double)));
    for (int c = 0; c < nc; c++)
        CHECK_MSG(fabs(got[c] - want_chunk[c]) <= 1e-12 * want_chunk[c] + 1e-300,
                  "sumsq chunk %d: %.17g vs %.17g", c, got[c], want_chunk[c]);
    free(p), free(gr), free(m), free(v), free(gp), free(gm), free(gv);
    gpu_free_all(g);
}

TEST(cuda_ops_adamw_and_sumsq_chunks) {
    gpu g;
    REQUIRE(gpu_open(&g));
    adamw_chunks_case(&g, false, LOOM_BF16);
    adamw_chunks_case(&g, true, LOOM_BF16);
    adamw_chunks_case(&g, true, LOOM_F32);
    adamw_chunks_case(&g, true, LOOM_F16);
    REQUIRE(!g.bad);
    gpu_close(&g);
}

/* zero_chunks clears exactly its chunks' ranges (one element, a whole
 * LOOM_CUDA_CHUNK, a long tail) and nothing else */
TEST(cuda_ops_zero_chunks) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const int64_t n = 100000;
    float *x = falloc(n), *got = falloc(n);
    fill(x, n, 77, 1);
    const loom_cuda_chunk ch[3] = {{.s_off = 5, .len = 1}, {.s_off = 1000, .len = LOOM_CUDA_CHUNK},
                                   {.s_off = 60001, .len = 39999}};
    float *dx = up(&g, x, n, LOOM_F32);
    void *dch = up_raw(&g, ch, sizeof ch);
    REQUIRE(!g.bad);
    REQUIRE_OK(g.ctx, loom_cuda_zero_chunks(g.ctx, dx, dch, 3, NULL));
    down(&g, got, dx, n, LOOM_F32);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        bool in = false;
        for (int c = 0; c < 3; c++) in = in || (i >= ch[c].s_off && i < ch[c].s_off + ch[c].len);
        if (in ? got[i] != 0.0f : memcmp(&got[i], &x[i], sizeof(float)) != 0) bad++;
    }
    CHECK_MSG(bad == 0, "zero_chunks: %lld elements wrong", (long long)bad);
    free(x), free(got);
    gpu_close(&g);
}

TEST(cuda_ops_sumsq) {
    gpu g;
    REQUIRE(gpu_open(&g));
    const size_t sizes[4] = {1, 4095, 262145, 3000017};
    for (int si = 0; si < 4; si++) {
        const size_t n = sizes[si];
        float *x = falloc((int64_t)n);
        fill(x, (int64_t)n, 95 + (uint64_t)si, 3);
        float *dx = up(&g, x, (int64_t)n, LOOM_F32);
        double *res = dalloc(&g, 2 * sizeof(double)), *scratch = dalloc(&g, LOOM_CUDA_SUMSQ_BLOCKS * sizeof(double));
        REQUIRE(!g.bad);
        double want = loom_sumsq(x, n), got1 = NAN, got2 = NAN;
        CHECK_OK(g.ctx, loom_cuda_sumsq(g.ctx, dx, n, res, scratch, NULL));
        CHECK_OK(g.ctx, loom_cuda_sumsq(g.ctx, dx, n, res + 1, scratch, NULL));
        CHECK_OK(g.ctx, loom_cuda_sync(g.ctx));
        CHECK_OK(g.ctx, loom_cuda_memcpy_d2h(g.ctx, &got1, res, sizeof got1));
        CHECK_OK(g.ctx, loom_cuda_memcpy_d2h(g.ctx, &got2, res + 1, sizeof got2));
        CHECK_MSG(fabs(got1 - want) <= 1e-12 * want, "sumsq n=%zu: %.17g vs %.17g", n, got1, want);
        CHECK_MSG(memcmp(&got1, &got2, sizeof got1) == 0, "sumsq n=%zu not reproducible", n);
        free(x);
        while (g.n > 0) loom_cuda_free(g.ptrs[--g.n]);
    }
    gpu_close(&g);
}

/* Same inputs twice: bit-identical outputs from the deterministic backward
 * (LOOM_ATTN_DETERMINISTIC=1: no atomics, fixed reduction order). */
TEST(cuda_ops_deterministic) {
    gpu g;
    REQUIRE(gpu_open(&g));
    setenv("LOOM_ATTN_DETERMINISTIC", "1", 1);
    enum { T = 300, HQ = 4, HKV = 2, D = 64 };
    const int32_t cu[3] = {0, 130, 300};
    const int64_t nq = T * HQ * D, nk = T * HKV * D;
    float *q = falloc(nq), *k = falloc(nk), *v = falloc(nk), *dout = falloc(nq);
    fill(q, nq, 301, 1), fill(k, nk, 302, 1), fill(v, nk, 303, 1), fill(dout, nq, 304, 1);
    void *d_q = up(&g, q, nq, LOOM_BF16), *d_k = up(&g, k, nk, LOOM_BF16), *d_v = up(&g, v, nk, LOOM_BF16);
    void *d_do = up(&g, dout, nq, LOOM_BF16), *d_cu = up_raw(&g, cu, sizeof cu);
    void *d_o = dalloc(&g, (size_t)nq * 2);
    float *d_l = dalloc(&g, (size_t)T * HQ * 4);
    void *grads[2][3];
    for (int rep = 0; rep < 2; rep++)
        for (int i = 0; i < 3; i++) grads[rep][i] = dalloc(&g, (size_t)(i ? nk : nq) * 2);
    REQUIRE(!g.bad);
    REQUIRE_OK(g.ctx, loom_cuda_attention_fwd(g.ctx, d_q, d_k, d_v, LOOM_BF16, T, HQ, HKV, D, d_cu, 2,
                                              0.125f, d_o, d_l, NULL));
    for (int rep = 0; rep < 2; rep++)
        REQUIRE_OK(g.ctx, loom_cuda_attention_bwd(g.ctx, d_do, d_q, d_k, d_v, d_o, d_l, LOOM_BF16, T,
                                                  HQ, HKV, D, d_cu, 2, 0.125f, grads[rep][0],
                                                  grads[rep][1], grads[rep][2], NULL));
    REQUIRE_OK(g.ctx, loom_cuda_sync(g.ctx));
    for (int i = 0; i < 3; i++) {
        size_t bytes = (size_t)(i ? nk : nq) * 2;
        char *a = malloc(bytes), *b = malloc(bytes);
        CHECK_OK(g.ctx, loom_cuda_memcpy_d2h(g.ctx, a, grads[0][i], bytes));
        CHECK_OK(g.ctx, loom_cuda_memcpy_d2h(g.ctx, b, grads[1][i], bytes));
        CHECK_MSG(memcmp(a, b, bytes) == 0, "attention_bwd output %d differs between runs", i);
        free(a), free(b);
    }
    unsetenv("LOOM_ATTN_DETERMINISTIC");
    free(q), free(k), free(v), free(dout);
    gpu_close(&g);
}

/* ---------------- timings (LOOM_CUDA_OPS_BENCH=1) ----------------
 * Not a check: with LOOM_CUDA_OPS_BENCH=1 it prints the time of each op at
 * training sizes (to stderr); otherwise it returns at once. */

/* Attention's inputs for T tokens (the bench's values, in dt) and outputs
 * (o, dq, dk, dv of osz bytes an element; lse fp32): ATTN_BUFS allocations on
 * g, the last ones made. */
enum { ATTN_BUFS = 9 };
typedef struct {
    void *q, *k, *v, *dout, *o, *dq, *dk, *dv;
    float *lse;
} attn_bufs;

static void attn_bufs_alloc(gpu *g, attn_bufs *b, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                            loom_dtype dt, size_t osz) {
    b->q = bench_buf(g, T * Hq * D, dt), b->k = bench_buf(g, T * Hkv * D, dt);
    b->v = bench_buf(g, T * Hkv * D, dt), b->dout = bench_buf(g, T * Hq * D, dt);
    b->o = dalloc(g, (size_t)(T * Hq * D) * osz), b->dq = dalloc(g, (size_t)(T * Hq * D) * osz);
    b->dk = dalloc(g, (size_t)(T * Hkv * D) * osz), b->dv = dalloc(g, (size_t)(T * Hkv * D) * osz);
    b->lse = dalloc(g, (size_t)(T * Hq) * 4);
}

TEST(cuda_ops_bench) {
    if (!getenv("LOOM_CUDA_OPS_BENCH")) return;
    gpu g;
    REQUIRE(gpu_open(&g));
    bench_op bo = {&g, NULL, NULL, 0};
    REQUIRE(cudaEventCreate(&bo.a) == cudaSuccess && cudaEventCreate(&bo.b) == cudaSuccess);
    char lab[128];
    { /* attention: causal FLOPs (fwd 2 matmuls, bwd 5 counted as 2.5x) */
        const int64_t T = 4096, Hq = 32, Hkv = 8;
        const int32_t cu[2] = {0, 4096};
        void *dcu = up_raw(&g, cu, sizeof cu);
        for (int64_t D = 64; D <= 128; D *= 2)
            for (int f = 0; f < 2; f++) {
                const loom_dtype dt = f ? LOOM_F32 : LOOM_BF16;
                attn_bufs ab;
                attn_bufs_alloc(&g, &ab, T, Hq, Hkv, D, dt, 4);
                void *q = ab.q, *k = ab.k, *v = ab.v, *dout = ab.dout, *o = ab.o, *dq = ab.dq,
                     *dk = ab.dk, *dv = ab.dv;
                float *lse = ab.lse;
                REQUIRE(!g.bad);
                const double fl = 4.0 * T * T / 2 * D * Hq;
                snprintf(lab, sizeof lab, "attention fwd T=%lld Hq=%lld Hkv=%lld D=%lld %s", (long long)T,
                         (long long)Hq, (long long)Hkv, (long long)D, dn(dt));
                BENCH(&bo, lab, fl, 3,
                      loom_cuda_attention_fwd(g.ctx, q, k, v, dt, T, Hq, Hkv, D, dcu, 1, 0.1f, o, lse, NULL));
                snprintf(lab, sizeof lab, "attention bwd T=%lld Hq=%lld Hkv=%lld D=%lld %s", (long long)T,
                         (long long)Hq, (long long)Hkv, (long long)D, dn(dt));
                BENCH(&bo, lab, 2.5 * fl, 2,
                      loom_cuda_attention_bwd(g.ctx, dout, q, k, v, o, lse, dt, T, Hq, Hkv, D, dcu, 1,
                                              0.1f, dq, dk, dv, NULL));
                if (dt != LOOM_F32) { /* cuDNN's fused attention on the same inputs */
                    loom_cuda_attn_handle *ah = NULL;
                    bool tk = false;
                    REQUIRE_OK(g.ctx, loom_cuda_attn_create(g.ctx, &ah));
                    snprintf(lab, sizeof lab, "attention fwd T=%lld Hq=%lld Hkv=%lld D=%lld %s cuDNN",
                             (long long)T, (long long)Hq, (long long)Hkv, (long long)D, dn(dt));
                    BENCH(&bo, lab, fl, 3,
                          loom_cuda_attention_cudnn_fwd(g.ctx, ah, q, k, v, dt, T, Hq, Hkv, D, NULL, 1,
                                                        T, 0.1f, o, lse, NULL, &tk));
                    CHECK_MSG(tk, "cuDNN did not take the forward");
                    snprintf(lab, sizeof lab, "attention bwd T=%lld Hq=%lld Hkv=%lld D=%lld %s cuDNN",
                             (long long)T, (long long)Hq, (long long)Hkv, (long long)D, dn(dt));
                    BENCH(&bo, lab, 2.5 * fl, 2,
                          loom_cuda_attention_cudnn_bwd(g.ctx, ah, dout, q, k, v, o, lse, dt, T, Hq, Hkv,
                                                        D, NULL, 1, T, 0.1f, dq, dk, dv, NULL, &tk));
                    CHECK_MSG(tk, "cuDNN did not take the backward");
                    /* the same tokens as three documents (the ragged graph): the
                     * causal work is 3/8 of one 4096-token sequence's */
                    const int32_t cu3[4] = {0, 1024, 3072, 4096};
                    void *dcu3 = up_raw(&g, cu3, sizeof cu3);
                    const double fl3 = fl * (1024.0 * 1024 + 2048.0 * 2048 + 1024.0 * 1024) / (4096.0 * 4096);
                    snprintf(lab, sizeof lab, "attention fwd 1024+2048+1024 D=%lld %s cuDNN ragged",
                             (long long)D, dn(dt));
                    BENCH(&bo, lab, fl3, 3,
                          loom_cuda_attention_cudnn_fwd(g.ctx, ah, q, k, v, dt, T, Hq, Hkv, D, dcu3, 3,
                                                        0, 0.1f, o, lse, NULL, &tk));
                    CHECK_MSG(tk, "cuDNN did not take the ragged forward");
                    snprintf(lab, sizeof lab, "attention bwd 1024+2048+1024 D=%lld %s cuDNN ragged",
                             (long long)D, dn(dt));
                    BENCH(&bo, lab, 2.5 * fl3, 2,
                          loom_cuda_attention_cudnn_bwd(g.ctx, ah, dout, q, k, v, o, lse, dt, T, Hq, Hkv,
                                                        D, dcu3, 3, 0, 0.1f, dq, dk, dv, NULL, &tk));
                    CHECK_MSG(tk, "cuDNN did not take the ragged backward");
                    snprintf(lab, sizeof lab, "attention fwd 1024+2048+1024 D=%lld %s loom", (long long)D,
                             dn(dt));
                    BENCH(&bo, lab, fl3, 3,
                          loom_cuda_attention_fwd(g.ctx, q, k, v, dt, T, Hq, Hkv, D, dcu3, 3, 0.1f, o,
                                                  lse, NULL));
                    snprintf(lab, sizeof lab, "attention bwd 1024+2048+1024 D=%lld %s loom", (long long)D,
                             dn(dt));
                    BENCH(&bo, lab, 2.5 * fl3, 2,
                          loom_cuda_attention_bwd(g.ctx, dout, q, k, v, o, lse, dt, T, Hq, Hkv, D, dcu3, 3,
                                                  0.1f, dq, dk, dv, NULL));
                    loom_cuda_free(g.ptrs[--g.n]);
                    loom_cuda_attn_free(ah);
                }
                if (dt != LOOM_F32) { /* the bitwise-repeatable backward */
                    setenv("LOOM_ATTN_DETERMINISTIC", "1", 1);
                    snprintf(lab, sizeof lab, "attention bwd T=%lld Hq=%lld Hkv=%lld D=%lld %s determ.",
                             (long long)T, (long long)Hq, (long long)Hkv, (long long)D, dn(dt));
                    BENCH(&bo, lab, 2.5 * fl, 2,
                          loom_cuda_attention_bwd(g.ctx, dout, q, k, v, o, lse, dt, T, Hq, Hkv, D, dcu,
                                                  1, 0.1f, dq, dk, dv, NULL));
                    unsetenv("LOOM_ATTN_DETERMINISTIC");
                }
                for (int i = 0; i < 9; i++) loom_cuda_free(g.ptrs[--g.n]);
            }
    }
    { /* GEMM */
        loom_cuda_gemm_handle *h;
        REQUIRE_OK(g.ctx, loom_cuda_gemm_create(g.ctx, 0, &h));
        int64_t n = 8192;
        void *A = bench_buf(&g, n * n, LOOM_BF16), *B = bench_buf(&g, n * n, LOOM_BF16);
        void *C = dalloc(&g, (size_t)(n * n) * 4);
        REQUIRE(!g.bad);
        BENCH(&bo, "gemm 8192^3 bf16 -> f32 (A B^T)", 2.0 * n * n * n, 5,
              loom_cuda_gemm(g.ctx, h, 0, 1, n, n, n, 1, A, LOOM_BF16, n, B, LOOM_BF16, n, 0, C,
                             LOOM_F32, n, NULL));
        BENCH(&bo, "gemm 8192^3 bf16 -> bf16 (A B)", 2.0 * n * n * n, 5,
              loom_cuda_gemm(g.ctx, h, 0, 0, n, n, n, 1, A, LOOM_BF16, n, B, LOOM_BF16, n, 0, C,
                             LOOM_BF16, n, NULL));
        BENCH(&bo, "gemm 8192^3 bf16, += into f32 (A^T B)", 2.0 * n * n * n, 5,
              loom_cuda_gemm(g.ctx, h, 1, 0, n, n, n, 1, A, LOOM_BF16, n, B, LOOM_BF16, n, 1, C,
                             LOOM_F32, n, NULL));
        n = 4096;
        BENCH(&bo, "gemm 4096^3 f32 (A B^T)", 2.0 * n * n * n, 3,
              loom_cuda_gemm(g.ctx, h, 0, 1, n, n, n, 1, A, LOOM_F32, n, B, LOOM_F32, n, 0, C,
                             LOOM_F32, n, NULL));
        loom_cuda_gemm_free(h);
        for (int i = 0; i < 3; i++) loom_cuda_free(g.ptrs[--g.n]);
    }
    { /* loss, embedding: bytes moved (TB/s) */
        const int64_t T = 4096, V = 151936, Vp = 152064, TT = 8192, H = 4096;
        int32_t *tg = malloc(sizeof(int32_t) * (size_t)TT);
        for (int64_t i = 0; i < TT; i++) tg[i] = (int32_t)((uint64_t)i * 7919u % (uint64_t)V);
        void *dtg = up_raw(&g, tg, sizeof(int32_t) * (size_t)TT), *z = bench_buf(&g, T * Vp, LOOM_BF16);
        float *lse = dalloc(&g, (size_t)T * 4), *lp = dalloc(&g, (size_t)T * 4), *ent = dalloc(&g, (size_t)T * 4);
        double *tl = dalloc(&g, (size_t)T * 8), *loss = dalloc(&g, 8);
        void *W = bench_buf(&g, V * H, LOOM_BF16), *out = dalloc(&g, (size_t)(TT * H) * 2);
        float *dW = dalloc(&g, (size_t)(V * H) * 4);
        REQUIRE(!g.bad);
        BENCH(&bo, "cross_entropy fwd T=4096 V=152k bf16 (TB/s)", 2.0 * T * Vp, 3,
              loom_cuda_cross_entropy_fwd(g.ctx, z, LOOM_BF16, dtg, T, V, Vp, lp, ent, lse, tl, loss, NULL));
        BENCH(&bo, "cross_entropy bwd in place (TB/s)", 4.0 * T * Vp, 3,
              loom_cuda_cross_entropy_bwd(g.ctx, z, LOOM_BF16, lse, dtg, T, V, Vp, 1e-3f, z, LOOM_BF16, NULL));
        BENCH(&bo, "embedding fwd T=8192 H=4096 bf16 (TB/s)", 4.0 * TT * H, 5,
              loom_cuda_embedding_fwd(g.ctx, dtg, TT, W, LOOM_BF16, H, out, LOOM_BF16, NULL));
        BENCH(&bo, "embedding bwd T=8192 H=4096 bf16 (TB/s)", 10.0 * TT * H, 3,
              loom_cuda_embedding_bwd(g.ctx, dtg, TT, out, LOOM_BF16, H, dW, NULL));
        free(tg);
        while (g.n > 0) loom_cuda_free(g.ptrs[--g.n]);
    }
    { /* layer element-wise ops (TB/s) */
        const int64_t N = 8192, H = 4096, NQ = 8192 * 32;
        void *x = bench_buf(&g, N * H, LOOM_BF16), *w = bench_buf(&g, H, LOOM_BF16);
        void *y = dalloc(&g, (size_t)(N * H) * 2);
        float *rs = dalloc(&g, (size_t)NQ * 4), *dw = dalloc(&g, (size_t)H * 4);
        void *scr = dalloc(&g, loom_cuda_rmsnorm_bwd_scratch_bytes(NQ, 128) > loom_cuda_rmsnorm_bwd_scratch_bytes(N, H)
                                   ? loom_cuda_rmsnorm_bwd_scratch_bytes(NQ, 128)
                                   : loom_cuda_rmsnorm_bwd_scratch_bytes(N, H));
        void *pos = dalloc(&g, (size_t)N * 4), *inv = dalloc(&g, 64 * 4);
        REQUIRE(!g.bad);
        REQUIRE(cudaMemset(pos, 0, (size_t)N * 4) == cudaSuccess && cudaMemset(inv, 0, 64 * 4) == cudaSuccess);
        BENCH(&bo, "rmsnorm fwd 8192x4096 bf16 (TB/s)", 4.0 * N * H, 5,
              loom_cuda_rmsnorm_fwd(g.ctx, x, LOOM_BF16, w, LOOM_BF16, 0.0f, N, H, 1e-6f, y, LOOM_BF16, rs, NULL));
        BENCH(&bo, "rmsnorm bwd 8192x4096 bf16 (TB/s)", 8.0 * N * H, 5,
              loom_cuda_rmsnorm_bwd(g.ctx, y, LOOM_BF16, x, LOOM_BF16, w, LOOM_BF16, 0.0f, rs, N, H, y,
                                    LOOM_BF16, dw, scr, NULL));
        BENCH(&bo, "rmsnorm bwd 262144x128 (q/k norm) (TB/s)", 8.0 * NQ * 128, 5,
              loom_cuda_rmsnorm_bwd(g.ctx, y, LOOM_BF16, x, LOOM_BF16, w, LOOM_BF16, 0.0f, rs, NQ, 128, y,
                                    LOOM_BF16, dw, scr, NULL));
        BENCH(&bo, "swiglu fwd 8192x4096 bf16 (TB/s)", 6.0 * N * H, 5,
              loom_cuda_swiglu_fwd(g.ctx, x, y, N * H, y, LOOM_BF16, NULL));
        BENCH(&bo, "rope fwd T=8192 nh=32 D=128 bf16 (TB/s)", 4.0 * N * H, 5,
              loom_cuda_rope_fwd(g.ctx, x, LOOM_BF16, N, 32, 128, 128, pos, inv, NULL));
        { /* x is read as (cos, sin) pairs: any finite values */
            const float *cs = (const float *)x;
            BENCH(&bo, "q/k norm + rope fwd T=8192 nh=32 D=128 bf16 (TB/s)", 4.0 * N * H, 5,
                  loom_cuda_qknorm_rope_fwd(g.ctx, x, LOOM_BF16, w, LOOM_BF16, 0.0f, NQ, 32, 128, 1e-6f, cs, y, rs,
                                            NULL));
        }
        BENCH(&bo, "bias bwd T=8192 N=4096 bf16 (TB/s)", 2.0 * N * H, 5,
              loom_cuda_add_bias_bwd(g.ctx, x, LOOM_BF16, N, H, dw, NULL));
        while (g.n > 0) loom_cuda_free(g.ptrs[--g.n]);
    }
    { /* optimizer over 256M parameters (TB/s) */
        const size_t n = (size_t)256 << 20;
        float *p = dalloc(&g, n * 4), *gr = dalloc(&g, n * 4), *m = dalloc(&g, n * 4), *v = dalloc(&g, n * 4);
        double *r = dalloc(&g, 8), *sc = dalloc(&g, 8 * LOOM_CUDA_SUMSQ_BLOCKS);
        REQUIRE(!g.bad);
        REQUIRE(cudaMemset(p, 0, n * 4) == cudaSuccess && cudaMemset(gr, 0, n * 4) == cudaSuccess &&
                cudaMemset(m, 0, n * 4) == cudaSuccess && cudaMemset(v, 0, n * 4) == cudaSuccess);
        const loom_adamw_hp hp = {1e-3, 0.9, 0.999, 1e-8, 0.1};
        BENCH(&bo, "adamw 256M (TB/s)", 28.0 * (double)n, 3,
              loom_cuda_adamw_step(g.ctx, p, gr, m, v, n, &hp, 3, true, NULL));
        BENCH(&bo, "sumsq 256M (TB/s)", 4.0 * (double)n, 3, loom_cuda_sumsq(g.ctx, gr, n, r, sc, NULL));
    }
    CHECK_OK(g.ctx, loom_cuda_sync(g.ctx));
    cudaEventDestroy(bo.a);
    cudaEventDestroy(bo.b);
    gpu_close(&g);
}

/* LOOM_CUDA_OPS_BENCH=1: every engine config cuDNN offers for the attention
 * of the benchmarked models (one 4096-token document a row: 0.6B with two
 * rows, 16 query heads; 8B and 4B with one, 32 heads, 8 KV heads of 128;
 * Qwen3.5-0.8B with four rows, 8 query heads, 2 KV heads of 256, and
 * Qwen3.5-4B with one, 16 and 4), timed against the heuristics' choice
 * (loom_cuda_attn_survey prints them to stderr). */
TEST(cuda_ops_attention_cudnn_survey) {
    if (!getenv("LOOM_CUDA_OPS_BENCH")) return;
    gpu g;
    REQUIRE(gpu_open(&g));
    const struct { int64_t T, Hq, Hkv, D; } sh[] = {
        {8192, 16, 8, 128}, {4096, 32, 8, 128}, {16384, 8, 2, 256}, {4096, 16, 4, 256}};
    const int64_t L = 4096;
    const loom_dtype dt = LOOM_BF16;
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        const int64_t T = sh[i].T, Hq = sh[i].Hq, Hkv = sh[i].Hkv, D = sh[i].D;
        const float sc = 1.0f / sqrtf((float)D);
        loom_cuda_attn_handle *h = NULL;
        bool tk = false;
        REQUIRE_OK(g.ctx, loom_cuda_attn_create(g.ctx, &h));
        loom_cuda_attn_survey(h, stderr);
        attn_bufs ab;
        attn_bufs_alloc(&g, &ab, T, Hq, Hkv, D, dt, 2);
        void *q = ab.q, *k = ab.k, *v = ab.v, *dout = ab.dout, *o = ab.o, *dq = ab.dq, *dk = ab.dk,
             *dv = ab.dv;
        float *lse = ab.lse;
        REQUIRE(!g.bad);
        CHECK_OK(g.ctx, loom_cuda_attention_cudnn_fwd(g.ctx, h, q, k, v, dt, T, Hq, Hkv, D, NULL, T / L,
                                                      L, sc, o, lse, NULL, &tk));
        CHECK(tk);
        CHECK_OK(g.ctx, loom_cuda_attention_cudnn_bwd(g.ctx, h, dout, q, k, v, o, lse, dt, T, Hq, Hkv,
                                                      D, NULL, T / L, L, sc, dq, dk, dv, NULL,
                                                      &tk));
        CHECK(tk);
        loom_cuda_attn_free(h);
        for (int b = 0; b < ATTN_BUFS; b++) loom_cuda_free(g.ptrs[--g.n]);
    }
    gpu_close(&g);
}

/* The ops bench's GEMM part (LOOM_CUDA_OPS_BENCH=1): each GEMM shape of the
 * benchmarked models, cuBLASLt's heuristic choice (what loom runs) against
 * the fastest of its first 16 candidates. */
TEST(cuda_ops_gemm_survey) {
    if (!getenv("LOOM_CUDA_OPS_BENCH")) return;
    gpu g;
    REQUIRE(gpu_open(&g));
    loom_cuda_gemm_handle *h = NULL;
    REQUIRE_OK(g.ctx, loom_cuda_gemm_create(g.ctx, 32u << 20, &h));
    typedef struct {
        const char *what;
        bool ta, tb;
        int64_t M, N, K;
        float beta;
        bool f32;
    } shape;
    /* y = x W^T: (T, out, in), tb; dx = dy W: (T, in, out); dW += dy^T x: ta, fp32 */
    const shape sh[] = {
        {"8B q/o fwd", false, true, 4096, 4096, 4096, 1, false},
        {"8B k/v fwd", false, true, 4096, 1024, 4096, 1, false},
        {"8B gate/up fwd", false, true, 4096, 12288, 4096, 1, false},
        {"8B down fwd", false, true, 4096, 4096, 12288, 1, false},
        {"8B q/o dx", false, false, 4096, 4096, 4096, 1, false},
        {"8B k/v dx", false, false, 4096, 4096, 1024, 1, false},
        {"8B gate/up dx", false, false, 4096, 4096, 12288, 1, false},
        {"8B down dx", false, false, 4096, 12288, 4096, 1, false},
        {"8B head fwd (1766 rows)", false, true, 1766, 151936, 4096, 0, false},
        {"8B head dx", false, false, 1766, 4096, 151936, 0, false},
        {"0.6B q fwd", false, true, 8192, 2048, 1024, 0, false},
        {"0.6B k/v fwd", false, true, 8192, 1024, 1024, 0, false},
        {"0.6B gate/up fwd", false, true, 8192, 3072, 1024, 0, false},
        {"0.6B down fwd", false, true, 8192, 1024, 3072, 0, false},
        {"0.6B o fwd", false, true, 8192, 1024, 2048, 0, false},
        {"0.6B gate/up dx", false, false, 8192, 1024, 3072, 1, false},
        {"0.6B down dx", false, false, 8192, 3072, 1024, 0, false},
        {"0.6B gate/up dW", true, false, 3072, 1024, 8192, 1, true},
        {"0.6B down dW", true, false, 1024, 3072, 8192, 1, true},
        {"0.6B q dW", true, false, 2048, 1024, 8192, 1, true},
        {"0.6B o dW", true, false, 1024, 2048, 8192, 1, true},
        {"0.6B k/v dW", true, false, 1024, 1024, 8192, 1, true},
        {"0.6B q dx", false, false, 8192, 1024, 2048, 1, false},
        {"0.6B o dx", false, false, 8192, 2048, 1024, 0, false},
        {"8B LoRA x A^T", false, true, 4096, 8, 4096, 0, false},
        {"8B LoRA u B^T (q)", false, true, 4096, 4096, 8, 0, false},
        {"8B LoRA u B^T (gate)", false, true, 4096, 12288, 8, 0, false},
        {"8B LoRA dB (q)", true, false, 4096, 8, 4096, 1, true},
        {"8B LoRA dA", true, false, 8, 4096, 4096, 1, true},
        {"8B LoRA du (gate)", false, false, 4096, 8, 12288, 0, false},
        {"8B LoRA dx += du A", false, false, 4096, 4096, 8, 1, false},
        {"0.6B head fwd (1766 rows)", false, true, 1766, 151936, 1024, 0, false},
        {"0.6B head dW", true, false, 151936, 1024, 1766, 1, true},
    };
    double tot_h = 0, tot_b = 0;
    for (size_t i = 0; i < sizeof sh / sizeof sh[0]; i++) {
        const shape *c = &sh[i];
        const int64_t lda = c->ta ? c->M : c->K, ldb = c->tb ? c->K : c->N;
        void *A = bench_buf(&g, c->M * c->K, LOOM_BF16), *B = bench_buf(&g, c->K * c->N, LOOM_BF16);
        void *C = bench_buf(&g, c->M * c->N, c->f32 ? LOOM_F32 : LOOM_BF16);
        REQUIRE(!g.bad);
        float ms[16];
        int sets[16], n = 0;
        CHECK_OK(g.ctx, loom_cuda_gemm_survey(g.ctx, h, c->ta, c->tb, c->M, c->N, c->K, A, LOOM_BF16,
                                              lda, B, ldb, c->beta, C, c->f32 ? LOOM_F32 : LOOM_BF16,
                                              c->N, 16, 10, ms, sets, &n));
        int best = 0, free_best = -1; /* fastest, and fastest without a memset */
        for (int k = 1; k < n; k++)
            if (ms[k] > 0 && (ms[best] <= 0 || ms[k] < ms[best])) best = k;
        for (int k = 0; k < n; k++)
            if (ms[k] > 0 && sets[k] == 0 && (free_best < 0 || ms[k] < ms[free_best])) free_best = k;
        const double fl = 2.0 * (double)c->M * (double)c->N * (double)c->K;
        if (n > 0 && ms[0] > 0) {
            fprintf(stderr, "    gemm %-26s M=%-6lld N=%-6lld K=%-6lld heuristic %8.3f ms %6.1f T/s | best #%-2d "
                            "of %2d %8.3f ms %6.1f T/s (%.3fx)\n",
                    c->what, (long long)c->M, (long long)c->N, (long long)c->K, ms[0],
                    fl / (ms[0] * 1e-3) / 1e12, best, n, ms[best], fl / (ms[best] * 1e-3) / 1e12,
                    ms[0] / ms[best]);
            fprintf(stderr, "      memsets: heuristic %d; without memsets the fastest is #%d (%.3f ms)\n",
                    sets[0], free_best, free_best >= 0 ? ms[free_best] : 0.0f);
            tot_h += ms[0], tot_b += ms[best];
        }
        gpu_free_all(&g);
    }
    fprintf(stderr, "    gemm shapes above: heuristic %.3f ms, best %.3f ms (%.3fx)\n", tot_h, tot_b,
            tot_b > 0 ? tot_h / tot_b : 0.0);
    loom_cuda_gemm_free(h);
    gpu_close(&g);
}

/* LOOM_CUDA_OPS_SUSTAIN=S (whole seconds, 1-600): an energy bench, not a
 * check. Parts of the Qwen3-8B LoRA step's work (4096 tokens), each run back
 * to back for S seconds with 3 s of idle before it, so that a power log
 * beside the run (bench/energy.py, which integrates nvidia-smi's instant
 * power) can tell what each costs under the board's power limit:
 *   gemm        cuBLASLt's x W^T for gate, 4096 x 12288 x 4096 (TFLOP)
 *   attention   cuDNN's forward and backward, 32/8 heads of 128, causal
 *               (TFLOP, the causal part: forward 2 products, backward 5)
 *   norm_fwd    residual add + norm, 4096 x 4096 (TB moved, here and below)
 *   swiglu_fwd  SwiGLU, 4096 x 12288
 *   swiglu_bwd  its backward
 *   norm_bwd    the norm's backward with its residual add, 4096 x 4096
 * The memory-bound parts take the random bits of bench_buf: constant inputs
 * draw ~140 W less at the same bandwidth (bit toggling in the memory path).
 * Each part's first call (cuDNN's plans, cuBLASLt's choice) runs before the
 * idle and is not counted. Prints a line a part: "sustain <part> <t0> <t1>
 * <calls> <work>" with t0 and t1 the wall clock (seconds since the epoch) of
 * its first timed launch and its last completion, and work in TFLOP or TB. */
static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

TEST(cuda_ops_sustain) {
    const char *env = getenv("LOOM_CUDA_OPS_SUSTAIN");
    if (!env) return;
    char *end = NULL;
    const long secs = strtol(env, &end, 10);
    if (end == env || *end || secs < 1 || secs > 600) {
        CHECK_MSG(false, "LOOM_CUDA_OPS_SUSTAIN=%s: give whole seconds from 1 to 600", env);
        return;
    }
    gpu g;
    REQUIRE(gpu_open(&g));
    const int64_t T = 4096, H = 4096, F = 12288, Hq = 32, Hkv = 8, D = 128;
    const loom_dtype dt = LOOM_BF16;
    loom_cuda_gemm_handle *gh = NULL;
    loom_cuda_attn_handle *ah = NULL;
    REQUIRE_OK(g.ctx, loom_cuda_gemm_create(g.ctx, 32u << 20, &gh));
    REQUIRE_OK(g.ctx, loom_cuda_attn_create(g.ctx, &ah));
    void *x = bench_buf(&g, T * H, dt), *wg = bench_buf(&g, F * H, dt), *y = dalloc(&g, (size_t)(T * F) * 2);
    void *res = bench_buf(&g, T * H, dt), *xs = dalloc(&g, (size_t)(T * H) * 2);
    void *xn = dalloc(&g, (size_t)(T * H) * 2), *nw = bench_buf(&g, H, dt);
    void *gt = bench_buf(&g, T * F, dt), *up = bench_buf(&g, T * F, dt), *dh = bench_buf(&g, T * F, dt);
    void *dg = dalloc(&g, (size_t)(T * F) * 2), *du = dalloc(&g, (size_t)(T * F) * 2);
    float *rs = dalloc(&g, (size_t)T * 4);
    attn_bufs ab;
    attn_bufs_alloc(&g, &ab, T, Hq, Hkv, D, dt, 2);
    REQUIRE(!g.bad);
    const double afl = 4.0 * T * T / 2 * D * Hq; /* the forward's causal FLOPs */
    const float scale = 1.0f / sqrtf((float)D);
    bool tk = true;
    for (int part = 0; part < 6 && tk; part++) {
        static const char *const names[] = {"gemm",       "attention",  "norm_fwd",
                                            "swiglu_fwd", "swiglu_bwd", "norm_bwd"};
        static const int batch[] = {50, 10, 80, 40, 30, 80}; /* calls between clock reads */
        double work = 0;
        long calls = -1; /* the first call (cuDNN's plans, cuBLASLt's choice) is not timed */
        loom_status st = LOOM_OK;
        double t0 = 0, t1 = 0;
        while (!st && (calls <= 0 || t1 - t0 < (double)secs)) {
            if (calls == 0) {
                sleep(3);
                t0 = t1 = wall_now(), work = 0;
            }
            const int n = calls < 0 ? 1 : batch[part];
            for (int i = 0; i < n && !st; i++, calls++) {
                /* work: TFLOP, or TB of bf16 tensors read and written */
                if (part == 0) {
                    st = loom_cuda_gemm(g.ctx, gh, 0, 1, T, F, H, 1, x, dt, H, wg, dt, H, 0, y, dt, F, NULL);
                    work += 2.0 * T * F * H * 1e-12;
                } else if (part == 1) {
                    st = loom_cuda_attention_cudnn_fwd(g.ctx, ah, ab.q, ab.k, ab.v, dt, T, Hq, Hkv, D, NULL, 1, T,
                                                       scale, ab.o, ab.lse, NULL, &tk);
                    if (!st && tk)
                        st = loom_cuda_attention_cudnn_bwd(g.ctx, ah, ab.dout, ab.q, ab.k, ab.v, ab.o, ab.lse, dt,
                                                           T, Hq, Hkv, D, NULL, 1, T, scale, ab.dq, ab.dk,
                                                           ab.dv, NULL, &tk);
                    if (!tk) break;
                    work += 3.5 * afl * 1e-12;
                } else if (part == 2) { /* x, res in; sum, normed out */
                    st = loom_cuda_add_rmsnorm_fwd(g.ctx, x, res, xs, dt, nw, dt, 0.0f, T, H, 1e-6f, xn, rs, NULL);
                    work += 2.0 * 4.0 * T * H * 1e-12;
                } else if (part == 3) { /* g, u in; h out */
                    st = loom_cuda_swiglu_fwd(g.ctx, gt, up, T * F, y, dt, NULL);
                    work += 2.0 * 3.0 * T * F * 1e-12;
                } else if (part == 4) { /* dh, g, u in; dg, du out */
                    st = loom_cuda_swiglu_bwd(g.ctx, dh, gt, up, T * F, dg, du, dt, NULL);
                    work += 2.0 * 5.0 * T * F * 1e-12;
                } else { /* dy, x, dres in; dres out */
                    st = loom_cuda_rmsnorm_bwd_add(g.ctx, xn, xs, dt, nw, dt, 0.0f, rs, T, H, res, NULL, NULL, NULL,
                                                   NULL);
                    work += 2.0 * 4.0 * T * H * 1e-12;
                }
            }
            if (!st && !tk) break;
            if (!st) st = loom_cuda_sync(g.ctx);
            t1 = wall_now();
        }
        CHECK_OK(g.ctx, st);
        CHECK_MSG(tk, "cuDNN did not take the attention");
        if (st || !tk) break;
        fprintf(stderr, "sustain %s %.3f %.3f %ld %.4f\n", names[part], t0, t1, calls, work);
        fprintf(stderr, "    %s: %.1f T/s over %.1f s\n", names[part], work / (t1 - t0), t1 - t0);
    }
    loom_cuda_attn_free(ah);
    loom_cuda_gemm_free(gh);
    gpu_close(&g);
}
#endif
