/* Core: status strings, errors, string buffer, dtype conversions. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/rng.h"
#include "harness.h"

TEST(core_status_and_errors) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    CHECK_STR(loom_last_error(ctx), "");
    CHECK(loom_errf(ctx, LOOM_ERR_CONFIG, "bad %s=%d", "tp", 3) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "bad tp=3");
    CHECK(loom_err_prefix(ctx, "%s", "config.json") == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "config.json: bad tp=3");
    loom_clear_error(ctx);
    CHECK_STR(loom_last_error(ctx), "");
    for (int s = 0; s < LOOM_STATUS_COUNT; s++) CHECK(strlen(loom_status_str((loom_status)s)) > 0);
    loom_ctx_free(ctx);
}

TEST(core_string_buffer) {
    loom_sb sb;
    loom_sb_init(&sb);
    for (int i = 0; i < 1000; i++) loom_sb_printf(&sb, "%d,", i);
    CHECK(!sb.failed);
    CHECK(strncmp(sb.buf, "0,1,2,", 6) == 0);
    CHECK_EQ_INT(sb.len, strlen(sb.buf));
    char *s = loom_sb_take(&sb);
    CHECK(sb.buf == NULL);
    free(s);
}

TEST(core_fmt) {
    char b[32];
    CHECK_STR(loom_fmt_int(b, 0), "0");
    CHECK_STR(loom_fmt_int(b, 999), "999");
    CHECK_STR(loom_fmt_int(b, 1000), "1,000");
    CHECK_STR(loom_fmt_int(b, -1234567), "-1,234,567");
    CHECK_STR(loom_fmt_int(b, INT64_MIN), "-9,223,372,036,854,775,808");
    CHECK_STR(loom_fmt_bytes(b, 512), "512 B");
    CHECK_STR(loom_fmt_bytes(b, 3 * 1024 * 1024 + 256 * 1024), "3.25 MiB");
}

TEST(dtype_names) {
    for (int i = 0; i < LOOM_DTYPE_COUNT; i++) {
        loom_dtype d;
        REQUIRE(loom_dtype_from_name(loom_dtype_name((loom_dtype)i), &d) == 0);
        CHECK_EQ_INT(d, i);
    }
    loom_dtype d;
    CHECK(loom_dtype_from_name("F8_E4M3", &d) != 0);
    CHECK_EQ_INT(loom_dtype_size(LOOM_BF16), 2);
    CHECK_EQ_INT(loom_dtype_size(LOOM_I64), 8);
}

/* Every finite half and bfloat16 survives a round trip through f32. */
TEST(dtype_half_roundtrip_exhaustive) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = loom_f16_to_f32((uint16_t)h);
        if (f != f) continue;
        uint16_t back = loom_f32_to_f16(f);
        if (back != h) {
            CHECK_MSG(0, "f16 0x%04x -> %g -> 0x%04x", h, f, back);
            return;
        }
        float g = loom_bf16_to_f32((uint16_t)h);
        if (g == g && loom_f32_to_bf16(g) != h) {
            CHECK_MSG(0, "bf16 0x%04x -> %g -> 0x%04x", h, g, loom_f32_to_bf16(g));
            return;
        }
    }
}

TEST(dtype_rounding) {
    /* known values */
    CHECK_EQ_INT(loom_f32_to_f16(1.0f), 0x3c00);
    CHECK_EQ_INT(loom_f32_to_f16(65504.0f), 0x7bff);
    CHECK_EQ_INT(loom_f32_to_f16(65520.0f), 0x7c00);  /* rounds to inf */
    CHECK_EQ_INT(loom_f32_to_f16(65519.0f), 0x7bff);
    CHECK_EQ_INT(loom_f32_to_f16(5.9604645e-08f), 0x0001); /* smallest subnormal */
    CHECK_EQ_INT(loom_f32_to_f16(2.9802322e-08f), 0x0000); /* half of it: ties to even (0) */
    CHECK_EQ_INT(loom_f32_to_f16(-2.0f), 0xc000);
    CHECK_EQ_INT(loom_f32_to_bf16(1.0f), 0x3f80);
    /* 1 + 2^-8 is a tie between bf16 1.0 and 1.0078125: rounds to even (1.0) */
    CHECK_EQ_INT(loom_f32_to_bf16(1.00390625f), 0x3f80);
    CHECK_EQ_INT(loom_f32_to_bf16(1.01171875f), 0x3f82); /* tie, rounds up to even */
    /* f16 rounding against a double-precision reference on a sweep */
    for (int i = 0; i < 200000; i++) {
        float f = ldexpf((float)(i % 9973) / 9973.0f + 1.0f, (i % 40) - 26) * ((i & 1) ? -1 : 1);
        float r = loom_f16_to_f32(loom_f32_to_f16(f));
        /* the nearest half: neither neighbour is strictly closer */
        uint16_t h = loom_f32_to_f16(f);
        float up = loom_f16_to_f32((uint16_t)(h + 1)), dn = loom_f16_to_f32((uint16_t)(h - 1));
        double e = fabs((double)r - f);
        if ((h & 0x7fff) != 0x7c00 && (h & 0x7fff) != 0 &&
            (fabs((double)up - f) < e || fabs((double)dn - f) < e)) {
            CHECK_MSG(0, "f16(%g) = %g is not nearest", f, r);
            return;
        }
    }
}

TEST(dtype_convert) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    float f[4] = {1.5f, -2.0f, 0.0f, 3.0f};
    uint16_t b[4];
    double d[4];
    CHECK_OK(ctx, loom_convert(ctx, b, LOOM_BF16, f, LOOM_F32, 4));
    CHECK_OK(ctx, loom_convert(ctx, d, LOOM_F64, b, LOOM_BF16, 4));
    for (int i = 0; i < 4; i++) CHECK(d[i] == f[i]);
    int64_t ids[3] = {1, 2, 300};
    int32_t i32[3];
    uint8_t u8[3];
    CHECK_OK(ctx, loom_convert(ctx, i32, LOOM_I32, ids, LOOM_I64, 3));
    CHECK_EQ_INT(i32[2], 300);
    CHECK(loom_convert(ctx, u8, LOOM_U8, ids, LOOM_I64, 3) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "300");
    CHECK(loom_convert(ctx, i32, LOOM_I32, f, LOOM_F32, 4) == LOOM_ERR_FORMAT); /* 1.5 */
    float g[3];
    CHECK_OK(ctx, loom_convert(ctx, g, LOOM_F32, ids, LOOM_I64, 3));
    CHECK(g[2] == 300.0f);
    /* integers a float cannot hold exactly are refused (found by the fuzzer:
     * these used to convert back through an out-of-range cast) */
    int64_t huge[2] = {INT64_MAX - 2, 16777217};
    CHECK(loom_convert(ctx, g, LOOM_F32, huge, LOOM_I64, 1) == LOOM_ERR_FORMAT);
    CHECK(loom_convert(ctx, g, LOOM_F32, huge + 1, LOOM_I64, 1) == LOOM_ERR_FORMAT); /* 2^24+1 */
    double dd;
    CHECK_OK(ctx, loom_convert(ctx, &dd, LOOM_F64, huge + 1, LOOM_I64, 1));
    int32_t big32 = 70000;
    uint16_t h;
    CHECK(loom_convert(ctx, &h, LOOM_F16, &big32, LOOM_I32, 1) == LOOM_ERR_FORMAT); /* inf */
    CHECK_CONTAINS(loom_last_error(ctx), "70000");
    loom_ctx_free(ctx);
}

/* Long conversions run on threads: the same values as one at a time, and a
 * narrowing in place (overlapping buffers) still right. */
TEST(dtype_convert_long_runs) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    enum { N = 300001 };
    float *f = malloc(N * sizeof *f), *back = malloc(N * sizeof *back);
    uint16_t *b = malloc(N * sizeof *b);
    REQUIRE(f && b && back);
    loom_rng_normal_fill(3, 4, 0, N, 1.0, f);
    CHECK_OK(ctx, loom_convert(ctx, b, LOOM_BF16, f, LOOM_F32, N));
    CHECK_OK(ctx, loom_convert(ctx, back, LOOM_F32, b, LOOM_BF16, N));
    int bad = 0;
    for (int i = 0; i < N; i++) {
        uint16_t one;
        CHECK_OK(ctx, loom_convert(ctx, &one, LOOM_BF16, f + i, LOOM_F32, 1));
        bad += one != b[i] || back[i] != loom_bf16_to_f32(one);
    }
    CHECK_EQ_INT(bad, 0);
    memcpy(back, f, N * sizeof *f); /* f32 -> bf16 in place, front to back */
    CHECK_OK(ctx, loom_convert(ctx, back, LOOM_BF16, back, LOOM_F32, N));
    CHECK(!memcmp(back, b, N * sizeof *b));
    free(f), free(b), free(back);
    loom_ctx_free(ctx);
}

/* loom_rng_normal_fill: loom_rng_normal's values bit for bit, from an odd or
 * even start, odd and even lengths, long enough for threads. */
TEST(rng_normal_fill_matches_one_at_a_time) {
    const uint64_t starts[] = {0, 1, 6, 77777};
    const size_t lens[] = {1, 2, 5, 70001};
    float *out = malloc(70001 * sizeof *out);
    REQUIRE(out);
    int bad = 0;
    for (int a = 0; a < 4; a++)
        for (int l = 0; l < 4; l++) {
            loom_rng_normal_fill(9, 12345, starts[a], lens[l], 0.02, out);
            for (size_t j = 0; j < lens[l]; j++)
                bad += out[j] != (float)(0.02 * loom_rng_normal(9, 12345, starts[a] + j));
        }
    CHECK_EQ_INT(bad, 0);
    /* and loom_rng_normal is Box-Muller on loom_rng_uniform's pairs */
    for (uint64_t i = 0; i < 64; i++) {
        const double u1 = loom_rng_uniform(9, 5, 2 * (i >> 1)), u2 = loom_rng_uniform(9, 5, 2 * (i >> 1) + 1);
        const double r = sqrt(-2.0 * log(u1)), t = 6.283185307179586 * u2;
        CHECK(loom_rng_normal(9, 5, i) == ((i & 1) ? r * sin(t) : r * cos(t)));
    }
    free(out);
}

TEST(core_logging_rank_prefix_and_levels) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    REQUIRE(f);
    ctx->log_stream = f;
    LOOM_LOG_I(ctx, "one %d", 1);
    loom_ctx_set_rank(ctx, 3, 8);
    LOOM_LOG_W(ctx, "two");
    LOOM_LOG_D(ctx, "hidden at info level");
    loom_ctx_set_log_level(ctx, LOOM_LOG_DEBUG);
    LOOM_LOG_D(ctx, "three\n");
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    LOOM_LOG_W(ctx, "hidden at error level");
    LOOM_LOG_E(ctx, "four");
    fclose(f);
    CHECK_STR(buf, "one 1\n[rank 3/8] warning: two\n[rank 3/8] debug: three\n"
                   "[rank 3/8] error: four\n");
    free(buf);
    loom_ctx_free(ctx);
}

TEST(core_files) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/a/b/c", loom_test_tmpdir());
    REQUIRE_OK(ctx, loom_mkdirs(ctx, dir));
    CHECK(loom_dir_exists(dir));
    char *p = loom_path_join(ctx, dir, "f.txt");
    REQUIRE_OK(ctx, loom_write_file_atomic(ctx, p, "hello", 5));
    char *data;
    size_t len;
    REQUIRE_OK(ctx, loom_read_file(ctx, p, 0, &data, &len));
    CHECK(len == 5 && !strcmp(data, "hello"));
    free(data);
    CHECK(loom_read_file(ctx, p, 3, &data, &len) == LOOM_ERR_FORMAT); /* over the limit */
    CHECK(loom_read_file(ctx, dir, 0, &data, &len) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "is a directory");
    CHECK(loom_mkdirs(ctx, p) == LOOM_ERR_IO); /* a file is in the way */
    free(p);
    loom_ctx_free(ctx);
}
