/* libFuzzer target for the tokenizer.
 *
 * 1. The input as a tokenizer.json: loom_tokenizer_parse either refuses it
 *    (a message naming the input, no handle) or accepts it; an accepted
 *    tokenizer then encodes a few fixed texts and the input itself (with and
 *    without the post-processor, fresh and with a reused encoder, which must
 *    agree), every id is below vocab_size, and the ids decode. Encoding fails
 *    only for invalid UTF-8 or where HF itself fails (crossing lstrip/rstrip
 *    ranges of added tokens).
 * 2. The input as text, encoded by the fixture tokenizer
 *    ($LOOM_FIXTURES/tokenizer/tokenizer.json, else the repository's
 *    tests/fixtures/tokenizer/tokenizer.json; skipped when absent):
 *    invalid UTF-8 is an error naming the byte offset; valid text encodes,
 *    and since that vocabulary has every byte, NFC(decode(encode(x))) is
 *    NFC(x) (each piece between added tokens is normalized on its own, as
 *    HF does, hence the outer NFC).
 * Leaks are caught by ASan. */
#include <stdlib.h>
#include <string.h>

#include "../src/data/tokenizer.h"
#include "../src/data/tokenizer_impl.h"

#define CHECK(c)                                                                     \
    do {                                                                             \
        if (!(c)) {                                                                  \
            fprintf(stderr, "fuzz_tokenizer: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                                 \
        }                                                                            \
    } while (0)

static loom_tokenizer *fixture;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    const char *dir = getenv("LOOM_FIXTURES");
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer/tokenizer.json", dir && *dir ? dir : "tests/fixtures");
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    if (loom_file_exists(path) && loom_tokenizer_load(ctx, path, &fixture) != LOOM_OK) {
        fprintf(stderr, "fuzz_tokenizer: %s\n", loom_last_error(ctx));
        abort(); /* the fixture must load */
    }
    if (!fixture) fprintf(stderr, "fuzz_tokenizer: no %s: fuzzing the parser only\n", path);
    loom_ctx_free(ctx);
    return 0;
}

static char *nfc(const char *s, size_t n, size_t *len) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_nfc_append(&sb, s, n);
    if (!sb.buf) loom_sb_append(&sb, "", 0);
    CHECK(!sb.failed);
    *len = sb.len;
    return loom_sb_take(&sb);
}

/* Encodes text every way and checks the ids agree, are in range and decode. */
static void exercise(loom_ctx *ctx, const loom_tokenizer *t, const char *text, size_t len) {
    int32_t *a = NULL, *b = NULL, *c = NULL;
    int64_t na = 0, nb = 0, nc = 0;
    loom_status st = loom_tokenizer_encode(ctx, t, text, len, &a, &na);
    if (st != LOOM_OK) {
        CHECK(a == NULL && na == 0);
        bool bad_utf8 = loom_utf8_check(text, len) < len;
        CHECK(st == LOOM_ERR_OOM ||
              (st == LOOM_ERR_INVALID_ARG && bad_utf8 &&
               strstr(loom_last_error(ctx), "byte offset")) ||
              /* lstrip/rstrip tokens whose ranges cross: HF panics, loom refuses */
              (st == LOOM_ERR_UNSUPPORTED && !bad_utf8 &&
               strstr(loom_last_error(ctx), "AddedVocabulary bad split")));
        return;
    }
    CHECK(loom_utf8_check(text, len) == len);
    int64_t V = loom_tokenizer_vocab_size(t);
    for (int64_t i = 0; i < na; i++) CHECK(a[i] >= 0 && a[i] < V);
    loom_tokenizer_encoder *e = NULL;
    CHECK(loom_tokenizer_encoder_create(ctx, t, &e) == LOOM_OK);
    for (int rep = 0; rep < 2; rep++) { /* the second time from its word cache */
        CHECK(loom_tokenizer_encoder_encode(ctx, e, text, len, false, &b, &nb) == LOOM_OK);
        CHECK(nb == na && (na == 0 || memcmp(a, b, (size_t)na * sizeof *a) == 0));
        free(b);
    }
    loom_tokenizer_encoder_free(e);
    CHECK(loom_tokenizer_encode_ex(ctx, t, text, len, true, &c, &nc) == LOOM_OK);
    CHECK(nc >= na);
    for (int64_t i = 0; i < nc; i++) CHECK(c[i] >= 0 && c[i] < V);
    char *d = NULL;
    size_t dl = 0;
    CHECK(loom_tokenizer_decode_n(ctx, t, a, na, &d, &dl) == LOOM_OK);
    CHECK(loom_utf8_check(d, dl) == dl);
    free(d);
    free(a);
    free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    const char *text = (const char *)data;

    /* 1. the input as a tokenizer.json */
    loom_tokenizer *t = NULL;
    loom_status st = loom_tokenizer_parse(ctx, text, size, "fuzz.json", &t);
    if (st != LOOM_OK) {
        CHECK(t == NULL);
        CHECK(strstr(loom_last_error(ctx), "fuzz.json") != NULL || st == LOOM_ERR_OOM);
    } else {
        static const char *const fixed[] = {
            "Hello world", "<|im_start|>user\nhi<|im_end|>", "  a\r\n\r\nb 'S 123 \xE3\x80\x80x",
            "\xC3\xA9 e\xCC\x81 \xEA\xB0\x80 \xF0\x9F\x99\x82", ""};
        for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++)
            exercise(ctx, t, fixed[k], strlen(fixed[k]));
        exercise(ctx, t, text, size);
        CHECK(loom_tokenizer_token_id(t, "") == -1 || loom_tokenizer_vocab_size(t) > 0);
        loom_tokenizer_free(t);
    }

    /* 2. the input as text for the fixture tokenizer */
    if (fixture) {
        exercise(ctx, fixture, text, size);
        int32_t *ids = NULL;
        int64_t n = 0;
        if (loom_tokenizer_encode(ctx, fixture, text, size, &ids, &n) == LOOM_OK) {
            char *d = NULL;
            size_t dl = 0, l1, l2;
            CHECK(loom_tokenizer_decode_n(ctx, fixture, ids, n, &d, &dl) == LOOM_OK);
            char *x = nfc(text, size, &l1), *y = nfc(d, dl, &l2);
            CHECK(l1 == l2 && memcmp(x, y, l1) == 0);
            free(x);
            free(y);
            free(d);
            free(ids);
        }
    }
    loom_ctx_free(ctx);
    return 0;
}
