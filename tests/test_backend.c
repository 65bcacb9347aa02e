/* The backend table (src/backend/backend.h): every backend built in and
 * usable here runs its ops on fresh random bytes and is held to the CPU
 * backend's results (ggml's test-backend-ops). On a machine without a GPU
 * the CPU backend is held to the C library (memcpy, loom_convert). */
#include <stdlib.h>
#include <string.h>

#include "../src/backend/backend.h"
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
