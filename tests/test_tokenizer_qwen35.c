/* Qwen3.5's pre-tokenizer regex and tokenizer against Hugging Face
 * tokenizers 0.23.3, on the cases of tests/fixtures_tokenizer_qwen35 (written
 * by tools/make_tokenizer_qwen35_fixtures.py: multilingual text with
 * combining marks in every position the regex distinguishes, and 300 random
 * strings over an alphabet of each class it tells apart):
 * - the split pieces of the regex alone (HF's pre_tokenize_str);
 * - the ids of the real 248k vocabulary trimmed to what those texts reach
 *   (tokenizer.json, ids renumbered), and their decoded text;
 * - the ids of the full 248k tokenizer.json (tokenizer.json.xz, unpacked
 *   with xz; skipped when xz is not installed). */
#include <stdlib.h>

#include "../src/core/json.h"
#include "../src/data/tokenizer.h"
#include "../src/data/tokenizer_impl.h"
#include "harness.h"

#define DIR "tests/fixtures_tokenizer_qwen35"
#define N_CASES 321

/* One case of a JSONL fixture, parsed; returns whether it passed. */
typedef bool (*case_fn)(loom_ctx *ctx, const loom_json *c, int k, void *arg);

/* Runs fn on every line of the JSONL file at path; the number of cases, or -1
 * when the file is unreadable or a line is not JSON. *passed: how many passed. */
static int each_case(loom_ctx *ctx, const char *path, case_fn fn, void *arg, int *passed) {
    char *data = NULL;
    size_t n = 0;
    *passed = 0;
    if (loom_read_file(ctx, path, 0, &data, &n) != LOOM_OK) return -1;
    int k = 0;
    for (char *line = data; *line; k++) {
        char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        loom_json *j = NULL;
        if (loom_json_parse(ctx, line, len, path, &j) != LOOM_OK) {
            k = -1;
            break;
        }
        *passed += fn(ctx, j, k, arg);
        loom_json_free(j);
        line += len + (nl != NULL);
    }
    free(data);
    return k;
}

static const char *str_of(const loom_json *c, const char *key) {
    const loom_json *v = loom_json_get(c, key);
    return v && v->type == LOOM_JSON_STRING ? v->s : NULL;
}

/* ---- the regex alone ---- */

static bool split_case(loom_ctx *ctx, const loom_json *c, int k, void *arg) {
    (void)ctx;
    (void)arg;
    const loom_json *text = loom_json_get(c, "text"), *want = loom_json_get(c, "pieces");
    if (!text || !want || want->type != LOOM_JSON_ARRAY) {
        loom_test_fail(__FILE__, __LINE__, "case %d: no text or pieces", k);
        return false;
    }
    size_t pos = 0, a, e, i = 0;
    bool ok = true;
    while (ok && loom_pretok_next(LOOM_PAT_QWEN35, text->s, text->slen, pos, &a, &e)) {
        const loom_json *w = i < want->n ? want->items[i] : NULL;
        ok = a == pos && w && w->slen == e - a && !memcmp(w->s, text->s + a, e - a);
        if (!ok)
            loom_test_fail(__FILE__, __LINE__, "case %d (\"%s\"): piece %zu is \"%.*s\", HF \"%s\"",
                           k, text->s, i, (int)(e - a), text->s + a, w ? w->s : "(none)");
        pos = e;
        i++;
    }
    if (ok && i != want->n) {
        loom_test_fail(__FILE__, __LINE__, "case %d (\"%s\"): %zu pieces, HF %zu", k, text->s, i,
                       want->n);
        ok = false;
    }
    return ok;
}

TEST(tokenizer_qwen35_split_cases) {
    const char *path = DIR "/split_cases.jsonl";
    REQUIRE_FIXTURE(path);
    loom_ctx *ctx = NULL;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    int passed, n = each_case(ctx, path, split_case, NULL, &passed);
    CHECK_MSG(n == N_CASES, "%s: %d cases, want %d (%s)", path, n, N_CASES, loom_last_error(ctx));
    CHECK_EQ_INT(passed, n);
    loom_ctx_free(ctx);
}

/* ---- encoding ---- */

typedef struct enc_arg {
    const loom_tokenizer *t;
    const char *ids_key;
} enc_arg;

static bool encode_case(loom_ctx *ctx, const loom_json *c, int k, void *arg) {
    const enc_arg *ea = arg;
    const loom_json *text = loom_json_get(c, "text"), *ids = loom_json_get(c, ea->ids_key);
    const char *dec = str_of(c, "decoded");
    if (!text || !dec || !ids || ids->type != LOOM_JSON_ARRAY) {
        loom_test_fail(__FILE__, __LINE__, "case %d: no text, decoded or %s", k, ea->ids_key);
        return false;
    }
    int32_t *want = malloc((ids->n + 1) * sizeof *want), *got = NULL;
    for (size_t i = 0; i < ids->n; i++) want[i] = (int32_t)ids->items[i]->i;
    int64_t ng = 0;
    char *d = NULL;
    size_t dl = 0;
    bool ok = loom_tokenizer_encode(ctx, ea->t, text->s, text->slen, &got, &ng) == LOOM_OK;
    if (!ok || ng != (int64_t)ids->n || memcmp(got, want, ids->n * sizeof *want)) {
        loom_test_fail(__FILE__, __LINE__, "case %d: encode(\"%s\") differs (%s)", k, text->s,
                       ok ? "ids" : loom_last_error(ctx));
        ok = false;
    }
    if (loom_tokenizer_decode_n(ctx, ea->t, want, (int64_t)ids->n, &d, &dl) != LOOM_OK ||
        dl != strlen(dec) || memcmp(d, dec, dl)) {
        loom_test_fail(__FILE__, __LINE__, "case %d: decode gives \"%s\", HF \"%s\"", k,
                       d ? d : loom_last_error(ctx), dec);
        ok = false;
    }
    free(want);
    free(got);
    free(d);
    return ok;
}

/* Encodes every case with t and compares with the ids under ids_key. */
static void check_encode_cases(loom_ctx *ctx, const loom_tokenizer *t, const char *ids_key) {
    enc_arg ea = {t, ids_key};
    int passed, n = each_case(ctx, DIR "/encode_cases.jsonl", encode_case, &ea, &passed);
    CHECK_MSG(n == N_CASES, "encode_cases.jsonl: %d cases, want %d", n, N_CASES);
    CHECK_MSG(passed == n, "%s: %d of %d cases as HF", ids_key, passed, n);
}

TEST(tokenizer_qwen35_trimmed_vocabulary) {
    REQUIRE_FIXTURE(DIR "/encode_cases.jsonl");
    loom_ctx *ctx = NULL;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_load(ctx, DIR "/tokenizer.json", &t));
    CHECK_EQ_INT(loom_tokenizer_token_id(t, "<|im_start|>"), 912);
    check_encode_cases(ctx, t, "ids_trimmed");
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

TEST(tokenizer_qwen35_full_vocabulary) {
    const char *xz = DIR "/tokenizer.json.xz";
    REQUIRE_FIXTURE(xz);
    char *json = NULL;
    int rc = loom_test_run(&json, (const char *const[]){"xz", "-dc", xz, NULL});
    if (rc == 127 || rc < 0) {
        free(json);
        SKIP("xz is not installed: it unpacks " DIR "/tokenizer.json.xz");
    }
    CHECK_MSG(rc == 0, "xz -dc %s: exit %d", xz, rc);
    loom_ctx *ctx = NULL;
    loom_tokenizer *t = NULL;
    if (rc == 0 && loom_ctx_create(&ctx) == LOOM_OK) {
        CHECK_OK(ctx, loom_tokenizer_parse(ctx, json, strlen(json), xz, &t));
        if (t) {
            CHECK_EQ_INT(loom_tokenizer_vocab_size(t), 248070);
            CHECK_EQ_INT(loom_tokenizer_token_id(t, "<|im_end|>"), 248046);
            check_encode_cases(ctx, t, "ids");
        }
    }
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
    free(json);
}
