/* SHA-256 (src/core/sha256.h): the FIPS 180-4 / NIST example vectors,
 * streaming in odd pieces equal to one call, files against sha256sum, and
 * a missing file's error naming it. */
#include <stdlib.h>

#include "../src/core/sha256.h"
#include "harness.h"

static void hex_of(const void *data, size_t len, char hex[65]) {
    loom_sha256 s;
    uint8_t d[32];
    loom_sha256_init(&s);
    loom_sha256_update(&s, data, len);
    loom_sha256_final(&s, d);
    loom_sha256_hex(d, hex);
}

#define MILLION_A "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"

TEST(sha256_vectors) {
    static const struct {
        const char *msg, *hex;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", /* 448 bits */
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqr"
         "lmnopqrsmnopqrstnopqrstu", /* 896 bits */
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    char hex[65];
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        hex_of(v[i].msg, strlen(v[i].msg), hex);
        CHECK_STR(hex, v[i].hex);
    }
    /* one million 'a', fed 1000 at a time */
    char a[1000];
    memset(a, 'a', sizeof a);
    loom_sha256 s;
    uint8_t d[32];
    loom_sha256_init(&s);
    for (int i = 0; i < 1000; i++) loom_sha256_update(&s, a, sizeof a);
    loom_sha256_final(&s, d);
    loom_sha256_hex(d, hex);
    CHECK_STR(hex, MILLION_A);
}

/* Bytes that repeat nowhere (an LCG), so a misplaced piece changes the hash. */
static uint8_t *noise(size_t n) {
    uint8_t *p = malloc(n);
    uint32_t x = 12345;
    for (size_t i = 0; p && i < n; i++) {
        x = x * 1664525u + 1013904223u;
        p[i] = (uint8_t)(x >> 24);
    }
    return p;
}

TEST(sha256_streaming_equals_one_shot) {
    const size_t n = 5000;
    uint8_t *p = noise(n);
    REQUIRE(p);
    /* every length across the padding edges (55, 56, 63, 64, 119, 120, ...) */
    for (size_t len = 0; len <= 200; len++) {
        char one[65], many[65];
        hex_of(p, len, one);
        loom_sha256 s;
        uint8_t d[32];
        loom_sha256_init(&s);
        for (size_t o = 0, k = 1; o < len; k = k % 7 + 1) {
            size_t take = len - o < k ? len - o : k;
            loom_sha256_update(&s, p + o, take);
            o += take;
        }
        loom_sha256_final(&s, d);
        loom_sha256_hex(d, many);
        CHECK_MSG(!strcmp(one, many), "length %zu: %s in pieces, %s at once", len, many, one);
    }
    /* the whole buffer in pieces of 1, 3, 63, 64, 65, 127, 1000 */
    const size_t sizes[] = {1, 3, 63, 64, 65, 127, 1000};
    char one[65];
    hex_of(p, n, one);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        loom_sha256 s;
        uint8_t d[32];
        char many[65];
        loom_sha256_init(&s);
        loom_sha256_update(&s, p, 0); /* empty updates change nothing */
        for (size_t o = 0; o < n; o += sizes[i])
            loom_sha256_update(&s, p + o, n - o < sizes[i] ? n - o : sizes[i]);
        loom_sha256_final(&s, d);
        loom_sha256_hex(d, many);
        CHECK_MSG(!strcmp(one, many), "pieces of %zu: %s, at once %s", sizes[i], many, one);
    }
    free(p);
}

/* The CPU's SHA instructions, where it has them, against the portable
 * code on fresh random inputs of every length to 300 and a long one. */
TEST(sha256_accelerated_equals_portable) {
    if (!loom_sha256_accelerated()) SKIP("this CPU has no SHA instructions (x86-64 SHA-NI)");
    const size_t n = 100000;
    uint8_t *p = noise(n);
    REQUIRE(p);
    uint64_t seed = (uint64_t)loom_now_s() * 1000003u;
    for (size_t i = 0; i < n; i++) { /* fresh each run: the noise xored with a new stream */
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        p[i] ^= (uint8_t)(seed >> 56);
    }
    for (size_t len = 0; len <= n; len = len < 300 ? len + 1 : len * 3) {
        const size_t l = len > n ? n : len;
        char hx[2][65];
        for (int k = 0; k < 2; k++) {
            loom_sha256 s;
            uint8_t d[32];
            loom_sha256_init(&s);
            s.portable = k == 1;
            loom_sha256_update(&s, p, l);
            loom_sha256_final(&s, d);
            loom_sha256_hex(d, hx[k]);
        }
        CHECK_MSG(!strcmp(hx[0], hx[1]), "length %zu: accelerated %s, portable %s", l, hx[0],
                  hx[1]);
    }
    free(p);
}

TEST(sha256_file) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char hex[65], path[1024];
    /* one million 'a': the NIST vector, the file read in one chunk */
    char *a = malloc(1000000);
    REQUIRE(a);
    memset(a, 'a', 1000000);
    snprintf(path, sizeof path, "%s", loom_test_write("million_a", a, 1000000));
    free(a);
    CHECK_OK(ctx, loom_sha256_file(ctx, path, hex));
    CHECK_STR(hex, MILLION_A);
    /* 2.5 MiB of noise (the reader's chunks are 1 MiB): sha256sum's hash */
    size_t n = (5u << 20) / 2 + 17;
    uint8_t *p = noise(n);
    REQUIRE(p);
    char want[65];
    hex_of(p, n, want);
    snprintf(path, sizeof path, "%s", loom_test_write("noise", p, n));
    free(p);
    CHECK_OK(ctx, loom_sha256_file(ctx, path, hex));
    CHECK_STR(hex, want);
    char *out = NULL;
    int rc = loom_test_run(&out, (const char *const[]){"sha256sum", path, NULL});
    if (rc == 0 && out) {
        CHECK_MSG(strlen(out) > 64 && out[64] == ' ', "sha256sum said: %s", out);
        out[64] = 0;
        CHECK_STR(hex, out);
    } else {
        fprintf(stderr, "    (no sha256sum here: compared with the vector and one-shot only)\n");
    }
    free(out);
    /* an empty file */
    snprintf(path, sizeof path, "%s", loom_test_write("empty", "", 0));
    CHECK_OK(ctx, loom_sha256_file(ctx, path, hex));
    CHECK_STR(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    loom_ctx_free(ctx);
}

TEST(sha256_file_errors) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char path[1024], hex[65] = "x";
    snprintf(path, sizeof path, "%s/no-such-shard.safetensors", loom_test_tmpdir());
    CHECK(loom_sha256_file(ctx, path, hex) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), path);
    CHECK_CONTAINS(loom_last_error(ctx), "No such file");
    CHECK_STR(hex, "");
    /* a directory: opened, but not readable as a file */
    CHECK(loom_sha256_file(ctx, loom_test_tmpdir(), hex) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), loom_test_tmpdir());
    loom_ctx_free(ctx);
}
