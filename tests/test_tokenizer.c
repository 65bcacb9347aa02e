/* The tokenizer: every case of the Hugging Face fixture (ids and decoded
 * text), NFC on chosen strings, the pre-tokenizer regexes on tricky strings,
 * a tiny tokenizer.json written here (merges as strings and as pairs, added
 * tokens with lstrip/rstrip/normalized, a post-processor template, bytes
 * outside the vocabulary), the reusable encoder, round trips on random text,
 * and a clear message for every malformed or unsupported file and input.
 * Expected ids of the hand-made cases come from Hugging Face tokenizers
 * 0.23.3. */
#include <stdint.h>
#include <stdlib.h>

#include "../src/core/json.h"
#include "../src/data/tokenizer.h"
#include "../src/data/tokenizer_impl.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static const char *fixture_dir(void) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer", loom_test_fixtures());
    return path;
}

static bool ids_equal(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    if (na != nb) return false;
    for (int64_t i = 0; i < na; i++)
        if (a[i] != b[i]) return false;
    return true;
}

static void print_ids(const char *label, const int32_t *v, int64_t n) {
    fprintf(stderr, "      %s:", label);
    for (int64_t i = 0; i < n && i < 40; i++) fprintf(stderr, " %d", v[i]);
    fprintf(stderr, "%s\n", n > 40 ? " ..." : "");
}

/* ---------------------------------------------------------------------- */
/* The Hugging Face fixture                                                */
/* ---------------------------------------------------------------------- */

TEST(tokenizer_fixture_encode_cases) {
    char path[1200];
    snprintf(path, sizeof path, "%s/encode_cases.jsonl", fixture_dir());
    REQUIRE_FIXTURE(path);
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_load(ctx, fixture_dir(), &t));
    CHECK_EQ_INT(loom_tokenizer_vocab_size(t), 1000);
    CHECK_EQ_INT(loom_tokenizer_token_id(t, "<|im_end|>"), 995);
    CHECK_EQ_INT(loom_tokenizer_token_id(t, "<think>"), 996);
    CHECK_EQ_INT(loom_tokenizer_token_id(t, "Ġ"), 220);
    CHECK_EQ_INT(loom_tokenizer_token_id(t, "no such token"), -1);
    CHECK(loom_tokenizer_is_special(t, 995) && !loom_tokenizer_is_special(t, 996));
    size_t len;
    const char *s = loom_tokenizer_id_to_token(t, 220, &len);
    CHECK(s && len == 2 && !memcmp(s, "Ġ", 2));
    CHECK(loom_tokenizer_id_to_token(t, 1000, &len) == NULL);
    loom_tokenizer_encoder *enc = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_encoder_create(ctx, t, &enc));

    char *data;
    size_t n;
    REQUIRE_OK(ctx, loom_read_file(ctx, path, 0, &data, &n));
    int cases = 0, passed = 0;
    for (char *line = data; *line;) {
        char *nl = strchr(line, '\n');
        size_t ll = nl ? (size_t)(nl - line) : strlen(line);
        loom_json *j = NULL;
        REQUIRE_OK(ctx, loom_json_parse(ctx, line, ll, "encode_cases.jsonl", &j));
        const loom_json *text = loom_json_get(j, "text"), *ids = loom_json_get(j, "ids"),
                        *dec = loom_json_get(j, "decoded");
        REQUIRE(text && ids && dec && ids->type == LOOM_JSON_ARRAY);
        int32_t *want = malloc((ids->n + 1) * sizeof *want);
        for (size_t i = 0; i < ids->n; i++) want[i] = (int32_t)ids->items[i]->i;
        int32_t *got = NULL, *got2 = NULL, *got3 = NULL;
        int64_t ng = 0, ng2 = 0, ng3 = 0;
        char *d = NULL;
        size_t dl = 0;
        bool ok = true;
        CHECK_OK(ctx, loom_tokenizer_encode(ctx, t, text->s, text->slen, &got, &ng));
        CHECK_OK(ctx, loom_tokenizer_encode_ex(ctx, t, text->s, text->slen, true, &got2, &ng2));
        CHECK_OK(ctx, loom_tokenizer_encoder_encode(ctx, enc, text->s, text->slen, false, &got3, &ng3));
        CHECK_OK(ctx, loom_tokenizer_decode_n(ctx, t, want, (int64_t)ids->n, &d, &dl));
        if (!got || !ids_equal(got, ng, want, (int64_t)ids->n)) {
            ok = false;
            loom_test_fail(__FILE__, __LINE__, "case %d: encode(\"%s\") differs", cases, text->s);
            print_ids("loom", got, ng);
            print_ids("HF  ", want, (int64_t)ids->n);
        }
        /* the fixture's post-processor adds nothing; the encoder agrees */
        CHECK(got2 && ids_equal(got2, ng2, want, (int64_t)ids->n));
        CHECK(got3 && ids_equal(got3, ng3, want, (int64_t)ids->n));
        if (!d || dl != dec->slen || memcmp(d, dec->s, dl)) {
            ok = false;
            loom_test_fail(__FILE__, __LINE__, "case %d: decode gives \"%s\", HF \"%s\"", cases,
                           d ? d : "(null)", dec->s);
        }
        passed += ok;
        cases++;
        free(want);
        free(got);
        free(got2);
        free(got3);
        free(d);
        loom_json_free(j);
        line += ll + (nl != NULL);
    }
    CHECK_EQ_INT(cases, 70);
    CHECK_EQ_INT(passed, cases);
    free(data);
    loom_tokenizer_encoder_free(enc);
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

/* decode(encode(s)) is NFC(s) for the fixture (every byte is in its
 * vocabulary), on random strings over a mixed alphabet; the encoder, a fresh
 * encode, and encoding piece by piece at newlines agree. */
TEST(tokenizer_round_trip_random) {
    char tok[1200];
    snprintf(tok, sizeof tok, "%s/tokenizer.json", fixture_dir());
    REQUIRE_FIXTURE(tok);
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_load(ctx, tok, &t));
    loom_tokenizer_encoder *enc = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_encoder_create(ctx, t, &enc));
    static const char *const alpha[] = {
        "a", "b", "Z", " ", "  ", "\n", "\r\n", "\t", "'s", "'LL", "1", "23", ",", "!?", "é",
        "e\xCC\x81", "\xE6\x9D\xB1", "\xF0\x9F\x99\x82", "\xE3\x80\x80", "\xC2\xA0", "<|im_end|>",
        "<think>", "<|im", "\xE1\x84\x80\xE1\x85\xA1", "\xCC\x81", "\xC5\xBF", "A\xCC\x8A"};
    uint64_t rng = 42;
    for (int it = 0; it < 400; it++) {
        loom_sb s;
        loom_sb_init(&s);
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int n = (int)(rng >> 59) * 3;
        for (int k = 0; k < n; k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            loom_sb_puts(&s, alpha[(rng >> 33) % (sizeof alpha / sizeof alpha[0])]);
        }
        const char *text = s.buf ? s.buf : "";
        int32_t *a = NULL, *b = NULL;
        int64_t na = 0, nb = 0;
        CHECK_OK(ctx, loom_tokenizer_encode(ctx, t, text, s.len, &a, &na));
        CHECK_OK(ctx, loom_tokenizer_encoder_encode(ctx, enc, text, s.len, false, &b, &nb));
        CHECK(a && b && ids_equal(a, na, b, nb));
        char *d = NULL;
        size_t dl = 0;
        CHECK_OK(ctx, loom_tokenizer_decode_n(ctx, t, a, na, &d, &dl));
        loom_sb want;
        loom_sb_init(&want);
        loom_nfc_append(&want, text, s.len);
        CHECK_MSG(d && dl == want.len && !memcmp(d, want.buf ? want.buf : "", dl),
                  "decode(encode(\"%s\")) = \"%s\", NFC is \"%s\"", text, d ? d : "",
                  want.buf ? want.buf : "");
        for (int64_t i = 0; a && i < na; i++) CHECK(a[i] >= 0 && a[i] < 1000);
        free(a);
        free(b);
        free(d);
        loom_sb_free(&want);
        loom_sb_free(&s);
    }
    loom_tokenizer_encoder_free(enc);
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* NFC and the regexes                                                     */
/* ---------------------------------------------------------------------- */

static char *nfc(const char *s) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_nfc_append(&sb, s, strlen(s));
    return loom_sb_take(&sb);
}

#define CHECK_NFC(in, out)                                                           \
    do {                                                                             \
        char *_r = nfc(in);                                                          \
        CHECK_STR(_r, out);                                                          \
        char *_r2 = nfc(out); /* NFC is idempotent */                                \
        CHECK_STR(_r2, out);                                                         \
        free(_r);                                                                    \
        free(_r2);                                                                   \
    } while (0)

TEST(tokenizer_nfc) {
    CHECK_NFC("e\xCC\x81", "\xC3\xA9");                     /* e + acute -> U+00E9 */
    CHECK_NFC("caf\xC3\xA9", "caf\xC3\xA9");                /* already composed */
    CHECK_NFC("A\xCC\x8A", "\xC3\x85");                     /* A + ring -> U+00C5 */
    CHECK_NFC("\xE2\x84\xAB", "\xC3\x85");                  /* ANGSTROM SIGN (singleton) -> U+00C5 */
    CHECK_NFC("\xE2\x84\xA6", "\xCE\xA9");                  /* OHM SIGN -> GREEK CAPITAL OMEGA */
    /* Hangul: L + V -> LV, LV + T -> LVT, L + V + T -> LVT */
    CHECK_NFC("\xE1\x84\x80\xE1\x85\xA1", "\xEA\xB0\x80");  /* U+1100 U+1161 -> U+AC00 */
    CHECK_NFC("\xEA\xB0\x80\xE1\x86\xA8", "\xEA\xB0\x81");  /* U+AC00 U+11A8 -> U+AC01 */
    CHECK_NFC("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8", "\xEA\xB0\x81");
    /* a composition exclusion: U+0958 DEVANAGARI QA stays decomposed */
    CHECK_NFC("\xE0\xA5\x98", "\xE0\xA4\x95\xE0\xA4\xBC");
    CHECK_NFC("\xE0\xA4\x95\xE0\xA4\xBC", "\xE0\xA4\x95\xE0\xA4\xBC");
    /* canonical order: below (220) before above (230), then a + acute composes
     * past the unblocked below mark */
    CHECK_NFC("a\xCC\x81\xCC\x96", "\xC3\xA1\xCC\x96");
    CHECK_NFC("a\xCC\x96\xCC\x81", "\xC3\xA1\xCC\x96");
    /* blocked: a second acute stays a mark */
    CHECK_NFC("e\xCC\x81\xCC\x81", "\xC3\xA9\xCC\x81");
    /* a non-starter alone, and a decomposing non-starter (U+0344) */
    CHECK_NFC("\xCC\x81x", "\xCC\x81x");
    CHECK_NFC("\xCD\x84", "\xCC\x88\xCC\x81");
    /* Hugging Face normalizes with Unicode 9.0 tables: DIVES AKURU (13.0)
     * U+11935 U+11930 does not compose to U+11938 */
    CHECK_NFC("\xF0\x91\xA4\xB5\xF0\x91\xA4\xB0", "\xF0\x91\xA4\xB5\xF0\x91\xA4\xB0");
    /* a long run of marks (the linear sort) equals the short-run sort */
    loom_sb in, want;
    loom_sb_init(&in);
    loom_sb_init(&want);
    loom_sb_putc(&in, 'o');
    loom_sb_append(&want, "\xC3\xB3", 2); /* o + acute */
    for (int i = 0; i < 40; i++) loom_sb_append(&in, "\xCC\x81\xCC\x96", 4);
    for (int i = 0; i < 40; i++) loom_sb_append(&want, "\xCC\x96", 2);
    for (int i = 0; i < 39; i++) loom_sb_append(&want, "\xCC\x81", 2);
    char *r = nfc(in.buf);
    CHECK_STR(r, want.buf);
    free(r);
    loom_sb_free(&in);
    loom_sb_free(&want);
    /* the quick check stops at the first code point NFC may change */
    CHECK_EQ_INT(loom_nfc_quick("abc\xCC\x81", 5), 3);
    CHECK_EQ_INT(loom_nfc_quick("caf\xC3\xA9 \xE6\x9D\xB1", 9), 9);
}

/* The pieces of s under pattern p, joined with '|'. */
static char *pieces(loom_pretok_pattern p, const char *s) {
    loom_sb sb;
    loom_sb_init(&sb);
    size_t n = strlen(s), pos = 0, a, e;
    while (loom_pretok_next(p, s, n, pos, &a, &e)) {
        if (sb.len) loom_sb_putc(&sb, '|');
        loom_sb_append(&sb, s + a, e - a);
        pos = e;
    }
    return loom_sb_take(&sb);
}

#define CHECK_SPLIT(p, in, out)                                                      \
    do {                                                                             \
        char *_r = pieces(p, in);                                                    \
        CHECK_STR(_r, out);                                                          \
        free(_r);                                                                    \
    } while (0)

TEST(tokenizer_pretokenizer_regexes) {
    const loom_pretok_pattern Q = LOOM_PAT_QWEN2, L = LOOM_PAT_LLAMA3, G = LOOM_PAT_GPT2;
    /* \s+(?!\S) leaves the last space to the word; at the end it takes all */
    CHECK_SPLIT(Q, "  two  spaces  ", " | two| | spaces|  ");
    CHECK_SPLIT(Q, "a\r\n\r\nb", "a|\r\n\r\n|b");
    CHECK_SPLIT(Q, "x \n y", "x| \n| y");
    CHECK_SPLIT(Q, "hi!!\n\n", "hi|!!\n\n");
    /* contractions, case-insensitive (and U+017F folds to s) */
    CHECK_SPLIT(Q, "'S", "'S");
    CHECK_SPLIT(Q, "'Sure", "'S|ure");
    CHECK_SPLIT(Q, "I'm", "I|'m");
    CHECK_SPLIT(Q, "'\xC5\xBF", "'\xC5\xBF");
    CHECK_SPLIT(Q, "they'LL've", "they|'LL|'ve");
    /* numbers: one digit (Qwen2), up to three (Llama 3) */
    CHECK_SPLIT(Q, "12345 and 1,000", "1|2|3|4|5| and| |1|,|0|0|0");
    CHECK_SPLIT(L, "12345 and 1,000", "123|45| and| |1|,|000");
    /* U+3000 and U+00A0 are white space; a space joins the next letters */
    CHECK_SPLIT(Q, "\xE3\x80\x80x\xC2\xA0 y", "\xE3\x80\x80x|\xC2\xA0| y");
    /* GPT-2: case-sensitive contractions, " ?" before each class */
    CHECK_SPLIT(G, "Hello world!!  \n", "Hello| world|!!|  \n");
    CHECK_SPLIT(G, "I'm 'S 123  x", "I|'m| '|S| 123| | x");
    CHECK_STR(loom_pretok_regex(Q), "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
                                    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
                                    "\\s+(?!\\S)|\\s+");
    const char *re = loom_pretok_regex(L);
    CHECK_EQ_INT(loom_pretok_find(re, strlen(re)), L);
    CHECK_EQ_INT(loom_pretok_find("\\s+", 3), -1);
}

/* Qwen3.5's regex: a mark (U+0301 here) joins the letters around it, starts
 * a word, and follows the one space or "other" before it; for Qwen2's regex a
 * mark is "other". tests/test_tokenizer_qwen35.c has HF's pieces of many
 * more texts. */
TEST(tokenizer_pretokenizer_qwen35_marks) {
    const loom_pretok_pattern Q = LOOM_PAT_QWEN2, Q35 = LOOM_PAT_QWEN35;
    CHECK_SPLIT(Q35, "cafe\xCC\x81!", "cafe\xCC\x81|!");
    CHECK_SPLIT(Q, "cafe\xCC\x81!", "cafe|\xCC\x81!");
    CHECK_SPLIT(Q35, "e\xCC\x81x", "e\xCC\x81x");
    CHECK_SPLIT(Q, "e\xCC\x81x", "e|\xCC\x81x");
    CHECK_SPLIT(Q35, " \xCC\x81\xCC\x81 1\xCC\x81", " \xCC\x81\xCC\x81| |1|\xCC\x81");
    CHECK_SPLIT(Q35, "!\xCC\x81\n\xCC\x81", "!\xCC\x81|\n|\xCC\x81");
    CHECK_SPLIT(Q35, "x's\xCC\x81", "x|'s|\xCC\x81");
    const char *re = loom_pretok_regex(Q35);
    CHECK_EQ_INT(loom_pretok_find(re, strlen(re)), Q35);
}

/* ---------------------------------------------------------------------- */
/* A tiny tokenizer.json                                                   */
/* ---------------------------------------------------------------------- */

/* Vocabulary a b c Ġ ab abc Ġa Ċ < > x; merges (a b) (ab c) (Ġ a); added
 * tokens <x> (lstrip, special), <y> (rstrip), cab (normalized); ByteLevel
 * with the GPT-2 regex; NFC; a template putting <x> first. MERGES is
 * replaced by the merges. */
static const char TINY[] =
    "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": ["
    "{\"id\": 11, \"content\": \"<x>\", \"single_word\": false, \"lstrip\": true, \"rstrip\": "
    "false, \"normalized\": false, \"special\": true},"
    "{\"id\": 12, \"content\": \"<y>\", \"single_word\": false, \"lstrip\": false, \"rstrip\": "
    "true, \"normalized\": false, \"special\": false},"
    "{\"id\": 13, \"content\": \"cab\", \"single_word\": false, \"lstrip\": false, \"rstrip\": "
    "false, \"normalized\": true, \"special\": false}],"
    " \"normalizer\": NORMALIZER,"
    " \"pre_tokenizer\": PRE,"
    " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": "
    "{\"id\": \"<x>\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], "
    "\"pair\": [{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"B\", "
    "\"type_id\": 1}}], \"special_tokens\": {\"<x>\": {\"id\": \"<x>\", \"ids\": [11], "
    "\"tokens\": [\"<x>\"]}}},"
    " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, "
    "\"use_regex\": true},"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
    "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
    "\"byte_fallback\": BYTE_FALLBACK, \"ignore_merges\": false, \"vocab\": {\"a\": 0, \"b\": 1, "
    "\"c\": 2, \"\\u0120\": 3, \"ab\": 4, \"abc\": 5, \"\\u0120a\": 6, \"\\u010a\": 7, \"<\": 8, "
    "\">\": 9, \"x\": 10}, \"merges\": MERGES}}";

#define PAIRS "[[\"a\", \"b\"], [\"ab\", \"c\"], [\"\\u0120\", \"a\"]]"
#define STRINGS "[\"a b\", \"ab c\", \"\\u0120 a\"]"
#define BYTE_LEVEL                                                                   \
    "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "  \
    "\"use_regex\": true}"

/* TINY with each (key, value) substituted; malloc'd. */
static char *tiny_json(const char *const *subst) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_puts(&sb, TINY);
    static const char *const defaults[][2] = {{"NORMALIZER", "{\"type\": \"NFC\"}"},
                                              {"PRE", BYTE_LEVEL},
                                              {"BYTE_FALLBACK", "false"},
                                              {"MERGES", PAIRS}};
    for (int d = 0; d < 4; d++) {
        const char *key = defaults[d][0], *val = defaults[d][1];
        for (const char *const *s = subst; s && *s; s += 2)
            if (!strcmp(s[0], key)) val = s[1];
        char *at = strstr(sb.buf, key);
        if (!at) abort();
        size_t pre = (size_t)(at - sb.buf), kl = strlen(key);
        loom_sb out;
        loom_sb_init(&out);
        loom_sb_append(&out, sb.buf, pre);
        loom_sb_puts(&out, val);
        loom_sb_puts(&out, at + kl);
        loom_sb_free(&sb);
        sb = out;
    }
    return loom_sb_take(&sb);
}

static loom_status parse_tiny(loom_ctx *ctx, const char *const *subst, loom_tokenizer **t) {
    char *j = tiny_json(subst);
    loom_status st = loom_tokenizer_parse(ctx, j, strlen(j), "tiny.json", t);
    free(j);
    return st;
}

static void check_encode(loom_ctx *ctx, const loom_tokenizer *t, const char *text, bool special,
                         const int32_t *want, int64_t nw, int line) {
    int32_t *got = NULL;
    int64_t n = 0;
    loom_status st = loom_tokenizer_encode_ex(ctx, t, text, strlen(text), special, &got, &n);
    if (st != LOOM_OK) {
        loom_test_fail(__FILE__, line, "encode(\"%s\"): %s", text, loom_last_error(ctx));
        return;
    }
    if (!ids_equal(got, n, want, nw)) {
        loom_test_fail(__FILE__, line, "encode(\"%s\"%s) differs", text, special ? ", special" : "");
        print_ids("loom", got, n);
        print_ids("HF  ", want, nw);
    }
    free(got);
}
#define CHECK_ENCODE(ctx, t, text, special, ...)                                     \
    do {                                                                             \
        static const int32_t _w[] = {__VA_ARGS__};                                   \
        check_encode(ctx, t, text, special, _w, (int64_t)(sizeof _w / sizeof _w[0]), __LINE__); \
    } while (0)

static void check_decode(loom_ctx *ctx, const loom_tokenizer *t, const int32_t *ids, int64_t n,
                         const char *want, int line) {
    char *d = NULL;
    loom_status st = loom_tokenizer_decode(ctx, t, ids, n, &d);
    if (st != LOOM_OK) loom_test_fail(__FILE__, line, "decode: %s", loom_last_error(ctx));
    else if (strcmp(d, want))
        loom_test_fail(__FILE__, line, "decode gives \"%s\", want \"%s\"", d, want);
    free(d);
}

TEST(tokenizer_tiny_merges_pairs_and_strings) {
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *tp = NULL, *ts = NULL;
    const char *const pairs[] = {"MERGES", PAIRS, NULL};
    const char *const strings[] = {"MERGES", STRINGS, NULL};
    REQUIRE_OK(ctx, parse_tiny(ctx, pairs, &tp));
    REQUIRE_OK(ctx, parse_tiny(ctx, strings, &ts));
    static const char *const texts[] = {"abc ab", "abc  <x> ab<y>  a", "xcab\nab", ("a\xCC\x81" "b"),
                                        "cabc", "ab  <x>", "", "aaabbbccc abcabc"};
    for (size_t k = 0; k < sizeof texts / sizeof texts[0]; k++) {
        int32_t *a = NULL, *b = NULL;
        int64_t na = 0, nb = 0;
        CHECK_OK(ctx, loom_tokenizer_encode(ctx, tp, texts[k], strlen(texts[k]), &a, &na));
        CHECK_OK(ctx, loom_tokenizer_encode(ctx, ts, texts[k], strlen(texts[k]), &b, &nb));
        CHECK_MSG(a && b && ids_equal(a, na, b, nb), "pairs and strings differ on \"%s\"",
                  texts[k]);
        free(a);
        free(b);
    }
    for (int k = 0; k < 2; k++) {
        const loom_tokenizer *t = k ? ts : tp;
        /* (a b) first, then (ab c); " ab" is Ġ a b: (a b) ranks before (Ġ a) */
        CHECK_ENCODE(ctx, t, "abc ab", false, 5, 3, 4);
        CHECK_ENCODE(ctx, t, "abc ab", true, 11, 5, 3, 4);
        /* <x> takes the spaces before it (lstrip), <y> those after (rstrip) */
        CHECK_ENCODE(ctx, t, "abc  <x> ab<y>  a", false, 5, 11, 3, 4, 12, 0);
        CHECK_ENCODE(ctx, t, "abc  <x> ab<y>  a", true, 11, 5, 11, 3, 4, 12, 0);
        /* cab is matched on the normalized text, inside a word */
        CHECK_ENCODE(ctx, t, "xcab\nab", false, 10, 13, 7, 4);
        CHECK_ENCODE(ctx, t, "cabc", false, 13, 2);
        /* a character outside the vocabulary (no unk_token) is dropped, as HF does */
        CHECK_ENCODE(ctx, t, "a\xCC\x81" "b", false, 1);
        CHECK_ENCODE(ctx, t, "ab  <x>", false, 4, 11);
        static const int32_t ids[] = {5, 11, 3, 4, 12, 0};
        check_decode(ctx, t, ids, 6, "abc<x> ab<y>a", __LINE__);
    }
    loom_tokenizer_free(tp);
    loom_tokenizer_free(ts);
    loom_ctx_free(ctx);
}

/* Added tokens that are white space, with lstrip/rstrip: HF cuts them out of
 * the text in an order where one token's rstrip can swallow the next match;
 * an emptied token is dropped, and where the ranges cross HF panics
 * ("AddedVocabulary bad split"): loom refuses that text. */
TEST(tokenizer_added_token_strip_overlaps) {
    loom_ctx *ctx = new_ctx();
    char *j = tiny_json(NULL);
    loom_sb sb;
    loom_sb_init(&sb);
    /* <x> (lstrip) becomes "\t", <y> (rstrip) becomes " " */
    const char *x = strstr(j, "\"content\": \"<x>\""), *y = strstr(j, "\"content\": \"<y>\"");
    REQUIRE(x && y && x < y);
    loom_sb_append(&sb, j, (size_t)(x - j));
    loom_sb_puts(&sb, "\"content\": \"\\t\"");
    loom_sb_append(&sb, x + 16, (size_t)(y - x - 16));
    loom_sb_puts(&sb, "\"content\": \" \"");
    loom_sb_puts(&sb, y + 16);
    free(j);
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_parse(ctx, sb.buf, sb.len, "tiny-ws.json", &t));
    loom_sb_free(&sb);
    CHECK_ENCODE(ctx, t, " \ta b", false, 12, 0, 12, 1);
    CHECK_ENCODE(ctx, t, "ab\t \tc", false, 4, 11, 12, 2);
    CHECK_ENCODE(ctx, t, "a  \t", false, 0, 12, 12);
    int32_t *ids = (int32_t *)1;
    int64_t n = 3;
    CHECK_EQ_INT(loom_tokenizer_encode(ctx, t, "a \t b", 5, &ids, &n), LOOM_ERR_UNSUPPORTED);
    CHECK(ids == NULL && n == 0);
    CHECK_CONTAINS(loom_last_error(ctx), "AddedVocabulary bad split");
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

TEST(tokenizer_decode) {
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, parse_tiny(ctx, NULL, &t));
    static const int32_t some[] = {7, 3, 6, 13, 12};
    check_decode(ctx, t, some, 5, "\n  acab<y>", __LINE__);
    check_decode(ctx, t, some, 0, "", __LINE__);
    /* an unknown id is an error naming it and its position */
    static const int32_t bad[] = {0, 14};
    char *d = (char *)1;
    CHECK_EQ_INT(loom_tokenizer_decode(ctx, t, bad, 2, &d), LOOM_ERR_INVALID_ARG);
    CHECK(d == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "id 14 (position 1)");
    static const int32_t neg[] = {-1};
    CHECK_EQ_INT(loom_tokenizer_decode(ctx, t, neg, 1, &d), LOOM_ERR_INVALID_ARG);
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

/* Bytes that are not UTF-8 on their own (a character cut between ids)
 * become U+FFFD per maximal ill-formed subsequence, as from_utf8_lossy. */
TEST(tokenizer_decode_lossy_utf8) {
    struct {
        const char *in, *out;
    } cases[] = {
        {"ok", "ok"},
        {"\xE6\x9D", "\xEF\xBF\xBD"},                       /* a cut 3-byte character */
        {"\xE6\x9D" "a", "\xEF\xBF\xBD" "a"},
        {"\xFF\xFE", "\xEF\xBF\xBD\xEF\xBF\xBD"},           /* two bytes never in UTF-8 */
        {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, /* a surrogate: 3 subparts */
        {"\xF0\x9F\x99", "\xEF\xBF\xBD"},
        {"\xC3", "\xEF\xBF\xBD"},
        {"\xC0\xAF", "\xEF\xBF\xBD\xEF\xBF\xBD"},           /* overlong */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        loom_sb sb;
        loom_sb_init(&sb);
        loom_utf8_lossy(&sb, cases[k].in, strlen(cases[k].in));
        CHECK_STR(sb.buf ? sb.buf : "", cases[k].out);
        loom_sb_free(&sb);
    }
}

TEST(tokenizer_invalid_utf8_input) {
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, parse_tiny(ctx, NULL, &t));
    int32_t *ids = (int32_t *)1;
    int64_t n = 7;
    CHECK_EQ_INT(loom_tokenizer_encode(ctx, t, "abc\xE6\x9D" "d", 6, &ids, &n), LOOM_ERR_INVALID_ARG);
    CHECK(ids == NULL && n == 0);
    CHECK_CONTAINS(loom_last_error(ctx), "not valid UTF-8 at byte offset 3");
    CHECK_EQ_INT(loom_tokenizer_encode(ctx, t, "\xED\xA0\x80", 3, &ids, &n), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "byte offset 0");
    CHECK_EQ_INT(loom_tokenizer_encode(ctx, t, "ab\xC0\xAF", 4, &ids, &n), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "byte offset 2");
    /* NUL is a character */
    CHECK_OK(ctx, loom_tokenizer_encode(ctx, t, "a\0b", 3, &ids, &n));
    CHECK_EQ_INT(n, 2); /* the NUL byte's character is not in this vocabulary */
    free(ids);
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Refused and malformed files                                             */
/* ---------------------------------------------------------------------- */

static void check_refused(const char *const *subst, loom_status want, const char *msg, int line) {
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = (loom_tokenizer *)1;
    loom_status st = parse_tiny(ctx, subst, &t);
    if (st != want)
        loom_test_fail(__FILE__, line, "status %s, want %s (%s)", loom_status_str(st),
                       loom_status_str(want), loom_last_error(ctx));
    if (t) loom_test_fail(__FILE__, line, "a refused file left a tokenizer");
    if (!strstr(loom_last_error(ctx), msg))
        loom_test_fail(__FILE__, line, "\"%s\" does not contain \"%s\"", loom_last_error(ctx), msg);
    if (!strstr(loom_last_error(ctx), "tiny.json"))
        loom_test_fail(__FILE__, line, "\"%s\" does not name the file", loom_last_error(ctx));
    loom_ctx_free(ctx);
}
#define CHECK_REFUSED(want, msg, ...)                                                \
    do {                                                                             \
        const char *const _s[] = {__VA_ARGS__, NULL};                                \
        check_refused(_s, want, msg, __LINE__);                                      \
    } while (0)

TEST(tokenizer_refuses_unsupported) {
    const loom_status U = LOOM_ERR_UNSUPPORTED;
    CHECK_REFUSED(U, "normalizer \"Lowercase\" is not supported", "NORMALIZER",
                  "{\"type\": \"Lowercase\"}");
    CHECK_REFUSED(U, "normalizer.normalizers[1]: normalizer \"NFKC\"", "NORMALIZER",
                  "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"}, {\"type\": "
                  "\"NFKC\"}]}");
    CHECK_REFUSED(U, "the regex \"\\\\s+\" is not supported", "PRE",
                  "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
                  "{\"Regex\": \"\\\\s+\"}, \"behavior\": \"Isolated\", \"invert\": false}, " BYTE_LEVEL
                  "]}");
    /* Qwen3.5's regex with \p{M} in one class only: refused, the message lists the four */
    CHECK_REFUSED(U, "the regexes of Qwen2/Qwen3, Qwen3.5, Llama 3 and GPT-2", "PRE",
                  "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
                  "{\"Regex\": \"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
                  "[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?[\\\\p{L}\\\\p{M}]+|\\\\p{N}| "
                  "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|"
                  "\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Isolated\", "
                  "\"invert\": false}, " BYTE_LEVEL "]}");
    CHECK_REFUSED(U, "behavior \"Removed\" is not supported", "PRE",
                  "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
                  "{\"Regex\": \"'s|'t|'re|'ve|'m|'ll|'d| ?\\\\p{L}+| ?\\\\p{N}+| "
                  "?[^\\\\s\\\\p{L}\\\\p{N}]+|\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Removed\", "
                  "\"invert\": false}, " BYTE_LEVEL "]}");
    CHECK_REFUSED(U, "a String pattern is not supported", "PRE",
                  "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
                  "{\"String\": \" \"}, \"behavior\": \"Isolated\", \"invert\": false}, " BYTE_LEVEL
                  "]}");
    CHECK_REFUSED(U, "ByteLevel must be the last", "PRE",
                  "{\"type\": \"Sequence\", \"pretokenizers\": [" BYTE_LEVEL ", " BYTE_LEVEL "]}");
    CHECK_REFUSED(U, "pre-tokenizer \"Whitespace\" is not supported", "PRE",
                  "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Whitespace\"}]}");
    CHECK_REFUSED(U, "pre_tokenizer is null", "PRE", "null");
    CHECK_REFUSED(U, "model.byte_fallback = true is not supported", "BYTE_FALLBACK", "true");
    loom_ctx *ctx = new_ctx();
    static const struct {
        const char *from, *to, *msg;
    } edits[] = {
        {"\"dropout\": null", "\"dropout\": 0.1", "model.dropout = 0.1 is not supported"},
        {"\"type\": \"BPE\"", "\"type\": \"WordPiece\"", "model \"WordPiece\" is not supported"},
        {"\"continuing_subword_prefix\": null", "\"continuing_subword_prefix\": \"##\"",
         "continuing_subword_prefix = \"##\" is not supported"},
        {"\"decoder\": {\"type\": \"ByteLevel\"", "\"decoder\": {\"type\": \"Metaspace\"",
         "decoder \"Metaspace\" is not supported"},
        {"\"single_word\": false, \"lstrip\": true", "\"single_word\": true, \"lstrip\": true",
         "single_word = true is not supported"},
        {"\"type\": \"TemplateProcessing\"", "\"type\": \"BertProcessing\"",
         "post_processor \"BertProcessing\" is not supported"},
        {"\"truncation\": null", "\"truncation\": {\"max_length\": 5}", "truncation is set"},
        {"\"version\": \"1.0\"", "\"version\": \"2.0\"", "version \"2.0\" is not supported"},
        {"\"x\": 10}", "\"x\": 900000000}", "the largest id, 900000000, is far beyond"},
    };
    for (size_t k = 0; k < sizeof edits / sizeof edits[0]; k++) {
        char *j = tiny_json(NULL);
        char *at = strstr(j, edits[k].from);
        REQUIRE(at);
        loom_sb sb;
        loom_sb_init(&sb);
        loom_sb_append(&sb, j, (size_t)(at - j));
        loom_sb_puts(&sb, edits[k].to);
        loom_sb_puts(&sb, at + strlen(edits[k].from));
        loom_tokenizer *t = NULL;
        loom_status st = loom_tokenizer_parse(ctx, sb.buf, sb.len, "tiny.json", &t);
        CHECK_MSG(st == LOOM_ERR_UNSUPPORTED && !t, "edit %zu: %s", k, loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), edits[k].msg);
        loom_tokenizer_free(t);
        loom_sb_free(&sb);
        free(j);
    }
    /* dropout 0 is no dropout (HF treats it so) */
    {
        char *j = tiny_json(NULL);
        char *at = strstr(j, "\"dropout\": null");
        memcpy(at, "\"dropout\": 0.0 ", 15);
        loom_tokenizer *t = NULL;
        CHECK_OK(ctx, loom_tokenizer_parse(ctx, j, strlen(j), "tiny.json", &t));
        loom_tokenizer_free(t);
        free(j);
    }
    loom_ctx_free(ctx);
}

TEST(tokenizer_refuses_malformed) {
    loom_ctx *ctx = new_ctx();
    static const struct {
        const char *from, *to, *msg;
    } edits[] = {
        {"\"x\": 10}", "\"x\": 10, \"y\": 10}", "id 10 is given to both \"x\" and \"y\""},
        {"\"x\": 10}", "\"x\": -1}", "model.vocab[\"x\"] must be an id"},
        {"\"x\": 10}", "\"x\": \"10\"}", "model.vocab[\"x\"] must be an id"},
        {"\"x\": 10}", "\"x\": 1.5}", "model.vocab[\"x\"] must be an id"},
        {"[\"ab\", \"c\"]", "[\"ab\", \"q\"]", "\"q\" is not in the vocabulary"},
        {"[\"ab\", \"c\"]", "[\"b\", \"c\"]", "the merged token \"bc\" is not in the vocabulary"},
        {"[\"ab\", \"c\"]", "[\"ab\"]", "model.merges[1] must be a pair of strings"},
        {"[\"ab\", \"c\"]", "\"ab c\"", "model.merges[1] must be a pair of strings"},
        {"\"merges\": [[", "\"merges\": 5, \"m\": [[", "model.merges must be an array"},
        {"\"id\": 12,", "\"id\": 20,", "has id 20, but Hugging Face tokenizers gives it id 12"},
        {"\"id\": 12, \"content\": \"<y>\"", "\"id\": 12, \"content\": \"<x>\"", "\"<x>\" is listed twice"},
        {"\"id\": 12, \"content\": \"<y>\"", "\"id\": 12, \"content\": \"\"", "the content is empty"},
        {"\"id\": 13,", "\"id\": \"13\",", "added_tokens[2].id must be an integer"},
        {"\"rstrip\": true", "\"rstrip\": 1", "added_tokens[1].rstrip must be true or false"},
        {", \"normalized\": true", "", "added_tokens[2].normalized must be true or false"},
        {"\"ids\": [11]", "\"ids\": [99]", "is not a token id of this tokenizer"},
        {"\"vocab\": {", "\"vocab\": [], \"v\": {", "model.vocab must be an object"},
        {"\"added_tokens\": [", "\"added_tokens\": {}, \"a\": [", "added_tokens must be an array"},
        {"\"unk_token\": null", "\"unk_token\": \"<unk>\"", "unk_token \"<unk>\" is not in model.vocab"},
        {"\"fuse_unk\": false", "\"fuse_unk\": \"no\"", "model.fuse_unk must be true or false"},
        {"\"model\": {", "\"model\": 3, \"m\": {", "model must be an object"},
    };
    for (size_t k = 0; k < sizeof edits / sizeof edits[0]; k++) {
        char *j = tiny_json(NULL);
        char *at = strstr(j, edits[k].from);
        REQUIRE(at);
        loom_sb sb;
        loom_sb_init(&sb);
        loom_sb_append(&sb, j, (size_t)(at - j));
        loom_sb_puts(&sb, edits[k].to);
        loom_sb_puts(&sb, at + strlen(edits[k].from));
        loom_tokenizer *t = NULL;
        loom_status st = loom_tokenizer_parse(ctx, sb.buf, sb.len, "tiny.json", &t);
        CHECK_MSG(st == LOOM_ERR_FORMAT && !t, "edit %zu: %s: %s", k, loom_status_str(st),
                  loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), edits[k].msg);
        CHECK_CONTAINS(loom_last_error(ctx), "tiny.json");
        loom_tokenizer_free(t);
        loom_sb_free(&sb);
        free(j);
    }
    /* not JSON, not an object, empty */
    static const char *const bad[] = {"{\"model\": ", "[]", "", "{}", "{\"model\": {}}"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        loom_tokenizer *t = NULL;
        loom_status st = loom_tokenizer_parse(ctx, bad[k], strlen(bad[k]), "tiny.json", &t);
        CHECK_MSG(st != LOOM_OK && !t, "\"%s\" accepted", bad[k]);
        CHECK_CONTAINS(loom_last_error(ctx), "tiny.json");
    }
    /* a missing file names the path */
    loom_tokenizer *t = NULL;
    CHECK_EQ_INT(loom_tokenizer_load(ctx, "/nonexistent/dir/tokenizer.json", &t), LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "/nonexistent/dir/tokenizer.json");
    loom_ctx_free(ctx);
}
