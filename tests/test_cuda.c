/* CUDA ops against the CPU reference on fresh random inputs. Built only with
 * `make CUDA=1`; skipped when no GPU is visible. */
#ifdef LOOM_HAVE_CUDA
#include <stdlib.h>

#include "../src/backend/cuda/cuda_backend.h"
#include "../src/core/rng.h"
#include "harness.h"

static loom_ctx *need_gpu(void) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx)) return NULL;
    loom_cuda_info info;
    if (loom_cuda_query(ctx, 0, &info) != LOOM_OK) {
        loom_ctx_free(ctx);
        SKIP("no CUDA device visible");
    }
    return ctx;
}

TEST(cuda_query) {
    loom_ctx *ctx = need_gpu();
    REQUIRE(ctx);
    loom_cuda_info info;
    REQUIRE_OK(ctx, loom_cuda_query(ctx, 0, &info));
    printf("    %s, sm_%d%d, %d SMs, %.1f GiB, runtime %d, cuBLASLt %zu, cuDNN %zu, NCCL %d\n",
           info.name, info.cc_major, info.cc_minor, info.sm_count,
           (double)info.total_mem / (1 << 30), info.runtime_version, info.cublaslt_version,
           info.cudnn_version, info.nccl_version);
    CHECK(info.device_count >= 1);
    CHECK(info.total_mem > 0);
    CHECK(loom_cuda_query(ctx, info.device_count, &info) == LOOM_ERR_INVALID_ARG);
    loom_ctx_free(ctx);
}

/* Every pair of F32/BF16/F16, bit-exact against loom_convert. */
TEST(cuda_convert_matches_cpu) {
    loom_ctx *ctx = need_gpu();
    REQUIRE(ctx);
    const size_t n = 1u << 20;
    const loom_dtype types[3] = {LOOM_F32, LOOM_BF16, LOOM_F16};
    float *src32 = malloc(n * 4);
    for (size_t i = 0; i < n; i++) /* wide range incl. subnormal halves, overflow, exact ties */
        src32[i] = (float)(loom_rng_normal(11, 1, i) * ldexp(1.0, (int)(i % 48) - 30));
    src32[0] = 65520.0f;
    src32[1] = 1.00390625f;
    src32[2] = 2.9802322e-08f;
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++) {
            loom_dtype s = types[a], d = types[b];
            size_t ss = loom_dtype_size(s), ds = loom_dtype_size(d);
            void *hs = malloc(n * ss), *want = malloc(n * ds), *got = malloc(n * ds);
            REQUIRE_OK(ctx, loom_convert(ctx, hs, s, src32, LOOM_F32, n));
            REQUIRE_OK(ctx, loom_convert(ctx, want, d, hs, s, n));
            void *dsrc, *ddst;
            REQUIRE_OK(ctx, loom_cuda_malloc(ctx, &dsrc, n * ss, "test"));
            REQUIRE_OK(ctx, loom_cuda_malloc(ctx, &ddst, n * ds, "test"));
            REQUIRE_OK(ctx, loom_cuda_memcpy_h2d(ctx, dsrc, hs, n * ss));
            REQUIRE_OK(ctx, loom_cuda_convert(ctx, ddst, d, dsrc, s, n, NULL));
            REQUIRE_OK(ctx, loom_cuda_sync(ctx));
            REQUIRE_OK(ctx, loom_cuda_memcpy_d2h(ctx, got, ddst, n * ds));
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < n; i++)
                if (memcmp((char *)got + i * ds, (char *)want + i * ds, ds) != 0 && !bad++) first = i;
            CHECK_MSG(bad == 0, "%s -> %s: %zu of %zu differ (first at %zu, input %g)",
                      loom_dtype_name(s), loom_dtype_name(d), bad, n, first, src32[first]);
            loom_cuda_free(dsrc);
            loom_cuda_free(ddst);
            free(hs);
            free(want);
            free(got);
        }
    free(src32);
    loom_ctx_free(ctx);
}
#endif
