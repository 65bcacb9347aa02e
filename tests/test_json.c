/* JSON: strict parsing, errors with positions, numbers, strings, typed
 * getters, building, writing, round trips, the repository's fixtures. */
#include <dirent.h>
#include <float.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>

#include "../src/core/json.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

/* Parses a NUL-terminated text (NULL on error, message in ctx). */
static loom_json *parse(loom_ctx *ctx, const char *text) {
    loom_json *v = NULL;
    if (loom_json_parse(ctx, text, strlen(text), "t.json", &v) != LOOM_OK) return NULL;
    return v;
}

/* Writes v (indent as in loom_json_write) into a new string (caller frees). */
static char *write_json(loom_ctx *ctx, const loom_json *v, int indent) {
    loom_sb sb;
    loom_sb_init(&sb);
    if (loom_json_write(ctx, v, indent, &sb) != LOOM_OK) {
        loom_sb_free(&sb);
        return NULL;
    }
    return loom_sb_take(&sb);
}

/* ---- valid documents ---- */

TEST(json_literals_and_whitespace) {
    loom_ctx *ctx = new_ctx();
    loom_json *v = parse(ctx, " \t\r\n true \n");
    REQUIRE(v && v->type == LOOM_JSON_BOOL && v->b);
    loom_json_free(v);
    v = parse(ctx, "false");
    REQUIRE(v && v->type == LOOM_JSON_BOOL && !v->b);
    loom_json_free(v);
    v = parse(ctx, "null");
    REQUIRE(v && v->type == LOOM_JSON_NULL);
    loom_json_free(v);
    v = parse(ctx, "\"\"");
    REQUIRE(v && v->type == LOOM_JSON_STRING && v->slen == 0 && v->s[0] == '\0');
    loom_json_free(v);
    v = parse(ctx, "[]");
    REQUIRE(v && v->type == LOOM_JSON_ARRAY && v->n == 0);
    CHECK(loom_json_at(v, 0) == NULL);
    loom_json_free(v);
    v = parse(ctx, "{ }");
    REQUIRE(v && v->type == LOOM_JSON_OBJECT && v->n == 0);
    CHECK(loom_json_get(v, "a") == NULL);
    loom_json_free(v);
    CHECK_STR(loom_json_type_name(LOOM_JSON_OBJECT), "object");
    CHECK_STR(loom_json_type_name(LOOM_JSON_BOOL), "boolean");
    loom_ctx_free(ctx);
}

TEST(json_nested_document) {
    loom_ctx *ctx = new_ctx();
    const char *text = "{\"z\": [1, {\"y\": [true, null]}, \"s\"], \"a\": {}, \"m\": -2.5}";
    loom_json *v = parse(ctx, text);
    REQUIRE(v);
    REQUIRE(v->type == LOOM_JSON_OBJECT && v->n == 3);
    /* keys in file order; order sorted */
    CHECK_STR(v->keys[0], "z");
    CHECK_STR(v->keys[1], "a");
    CHECK_STR(v->keys[2], "m");
    CHECK_EQ_INT(v->order[0], 1);
    CHECK_EQ_INT(v->order[1], 2);
    CHECK_EQ_INT(v->order[2], 0);
    const loom_json *z = loom_json_get(v, "z");
    REQUIRE(z && z->type == LOOM_JSON_ARRAY && z->n == 3);
    CHECK(loom_json_at(z, 0)->is_int && loom_json_at(z, 0)->i == 1);
    const loom_json *y = loom_json_get(loom_json_at(z, 1), "y");
    REQUIRE(y && y->n == 2);
    CHECK(loom_json_at(y, 1)->type == LOOM_JSON_NULL);
    CHECK(loom_json_at(z, 3) == NULL);
    CHECK_STR(loom_json_at(z, 2)->s, "s");
    CHECK(loom_json_get(v, "m")->d == -2.5);
    CHECK(loom_json_get(v, "zz") == NULL);
    CHECK(loom_json_get(z, "a") == NULL); /* not an object */
    CHECK(loom_json_get(NULL, "a") == NULL);
    loom_json_free(v);
    loom_ctx_free(ctx);
}

TEST(json_int64_edges) {
    loom_ctx *ctx = new_ctx();
    static const struct {
        const char *text;
        bool is_int;
        int64_t i;
        double d;
    } cases[] = {
        {"0", true, 0, 0.0},
        {"-1", true, -1, -1.0},
        {"9223372036854775807", true, INT64_MAX, 9223372036854775807.0},
        {"-9223372036854775808", true, INT64_MIN, -9223372036854775808.0},
        {"-9223372036854775807", true, -INT64_MAX, -9223372036854775807.0},
        {"9223372036854775808", false, 0, 9223372036854775808.0},
        {"-9223372036854775809", false, 0, -9223372036854775808.0},
        {"18446744073709551615", false, 0, 18446744073709551615.0},
        {"18446744073709551616", false, 0, 18446744073709551616.0},
        {"99999999999999999999", false, 0, 1e20},
        {"123456789012345678901234567890", false, 0, 1.2345678901234568e29},
        {"9007199254740993", true, 9007199254740993LL, 9007199254740992.0}, /* ties to even */
        {"9007199254740995", true, 9007199254740995LL, 9007199254740996.0},
        {"1E2", false, 0, 100.0},
        {"64.0", false, 0, 64.0},
        {"1e0", false, 0, 1.0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        loom_json *v = parse(ctx, cases[k].text);
        CHECK_MSG(v && v->type == LOOM_JSON_NUMBER, "%s: %s", cases[k].text, loom_last_error(ctx));
        if (!v) continue;
        CHECK_MSG(v->is_int == cases[k].is_int, "%s: is_int", cases[k].text);
        if (cases[k].is_int)
            CHECK_MSG(v->i == cases[k].i, "%s: i=%lld", cases[k].text, (long long)v->i);
        CHECK_MSG(v->d == cases[k].d, "%s: d=%.17g", cases[k].text, v->d);
        loom_json_free(v);
    }
    /* "-0" is the integer 0, and its double is -0.0 */
    loom_json *v = parse(ctx, "-0");
    REQUIRE(v);
    CHECK(v->is_int && v->i == 0 && v->d == 0.0 && signbit(v->d));
    loom_json_free(v);
    loom_ctx_free(ctx);
}

TEST(json_doubles) {
    loom_ctx *ctx = new_ctx();
    static const struct {
        const char *text;
        double d;
    } cases[] = {
        {"0.1", 0.1},
        {"1e-6", 1e-6},
        {"1e-06", 1e-6},
        {"1.7976931348623157e308", DBL_MAX},
        {"5e-324", 4.9406564584124654e-324},
        {"2.2250738585072014E-308", DBL_MIN},
        {"-0.0", -0.0},
        {"1000000.0", 1e6},
        {"0.30000000000000004", 0.30000000000000004},
        {"2.5e+3", 2500.0},
        {"2.5e-3", 0.0025},
        {"1e-400", 0.0}, /* underflows to zero: accepted */
        {"7.11936591050941", 7.11936591050941},
        {"0.00000000000000000000000000000000000000000000000000000000000000001", 1e-65},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        loom_json *v = parse(ctx, cases[k].text);
        CHECK_MSG(v != NULL, "%s: %s", cases[k].text, loom_last_error(ctx));
        if (!v) continue;
        CHECK_MSG(!v->is_int && v->d == cases[k].d, "%s: d=%.17g", cases[k].text, v->d);
        loom_json_free(v);
    }
    loom_json *v = parse(ctx, "-0.0");
    REQUIRE(v);
    CHECK(signbit(v->d));
    loom_json_free(v);
    loom_ctx_free(ctx);
}

TEST(json_strings) {
    loom_ctx *ctx = new_ctx();
    static const struct {
        const char *text, *want;
        size_t want_len;
    } cases[] = {
        {"\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\/\b\f\n\r\t", 8},
        {"\"\\u00e9\\u00E9\"", "\xc3\xa9\xc3\xa9", 4},
        {"\"\\u20ac\"", "\xe2\x82\xac", 3},
        {"\"\\ud83d\\ude00\"", "\xf0\x9f\x98\x80", 4},
        {"\"\\uDBFF\\uDFFF\"", "\xf4\x8f\xbf\xbf", 4},
        {"\"a\\u0000b\"", "a\0b", 3},
        {"\"\xe6\x97\xa5\xe6\x9c\xac\"", "\xe6\x97\xa5\xe6\x9c\xac", 6},
        {"\"\xf0\x9f\x98\x80\"", "\xf0\x9f\x98\x80", 4},
        {"\"\xf4\x8f\xbf\xbf\"", "\xf4\x8f\xbf\xbf", 4},
        {"\"\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf\"", "\xc2\x80\xdf\xbf\xe0\xa0\x80\xef\xbf\xbf",
         10},
        {"\"\x7f\"", "\x7f", 1},
        {"\"tab\\tand space\"", "tab\tand space", 13},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        loom_json *v = parse(ctx, cases[k].text);
        CHECK_MSG(v && v->type == LOOM_JSON_STRING, "%s: %s", cases[k].text, loom_last_error(ctx));
        if (!v) continue;
        CHECK_MSG(v->slen == cases[k].want_len && !memcmp(v->s, cases[k].want, v->slen) &&
                      v->s[v->slen] == '\0',
                  "case %zu: got %zu bytes", k, v->slen);
        loom_json_free(v);
    }
    loom_ctx_free(ctx);
}

/* ---- invalid documents ---- */

static const struct bad_case {
    const char *text;
    size_t len; /* 0: strlen(text) */
    const char *frag;
} bad_cases[] = {
    {"", 0, "empty input"},
    {" \n\t ", 0, "empty input"},
    {"[1,2,]", 0, "trailing comma before ']'"},
    {"{\"a\":1,}", 0, "trailing comma before '}'"},
    {"01", 0, "leading zeros are not allowed"},
    {"-01", 0, "leading zeros are not allowed"},
    {"[00]", 0, "leading zeros are not allowed"},
    {"1.", 0, "expected a digit after '.'"},
    {"1.e5", 0, "expected a digit after '.'"},
    {".5", 0, "a number needs a digit before '.'"},
    {"+1", 0, "'+' is not allowed before a number"},
    {"1e", 0, "expected a digit in the exponent"},
    {"1e+", 0, "expected a digit in the exponent"},
    {"1.5E-x", 0, "expected a digit in the exponent"},
    {"-", 0, "expected a digit after '-'"},
    {"[-]", 0, "expected a digit after '-'"},
    {"- 1", 0, "expected a digit after '-'"},
    {"0x10", 0, "unexpected 'x' after the JSON value"},
    {"1e400", 0, "number 1e400 is out of range for a double"},
    {"-1e400", 0, "out of range for a double"},
    {"NaN", 0, "NaN and Infinity are not valid JSON"},
    {"[Infinity]", 0, "NaN and Infinity are not valid JSON"},
    {"-Infinity", 0, "-Infinity is not valid JSON"},
    {"\"abc", 0, "unterminated string"},
    {"\"abc\\\"", 0, "unterminated string"},
    {"\"a\nb\"", 0, "control character 0x0a in string"},
    {"\"a\tb\"", 0, "control character 0x09 in string"},
    {"\"a\0b\"", 5, "control character 0x00 in string"},
    {"\"\\x\"", 0, "invalid escape '\\x'"},
    {"\"\\U0041\"", 0, "invalid escape '\\U'"},
    {"\"\\'\"", 0, "invalid escape '\\''"},
    {"\"\\\x01\"", 0, "invalid escape in string: '\\' followed by byte 0x01"},
    {"\"\\\xc3\xa9\"", 0, "invalid escape in string: '\\' followed by byte 0xc3"},
    {"\"\\u12\"", 0, "expected 4 hex digits"},
    {"\"\\u12g4\"", 0, "expected 4 hex digits"},
    {"\"\\ud800\"", 0, "lone surrogate \\ud800"},
    {"\"\\ud800x\"", 0, "lone surrogate \\ud800"},
    {"\"\\ud800\\u0041\"", 0, "lone surrogate \\ud800"},
    {"\"\\ud800\\ud800\"", 0, "lone surrogate \\ud800"},
    {"\"\\udc00\"", 0, "lone low surrogate \\udc00"},
    {"\"\\uDFFF\\uD800\"", 0, "lone low surrogate \\uDFFF"},
    {"\"\xff\"", 0, "invalid UTF-8 byte 0xff in string"},
    {"\"\xfe\"", 0, "invalid UTF-8 byte 0xfe in string"},
    {"\"\xf5\x80\x80\x80\"", 0, "invalid UTF-8 byte 0xf5 in string"},
    {"\"\x80\"", 0, "invalid UTF-8 byte 0x80 in string (unexpected continuation byte)"},
    {"\"a\xbf\"", 0, "unexpected continuation byte"},
    {"\"\xc0\x80\"", 0, "invalid UTF-8 in string: overlong encoding"},
    {"\"\xc1\xbf\"", 0, "overlong encoding"},
    {"\"\xe0\x80\x80\"", 0, "overlong encoding"},
    {"\"\xe0\x9f\xbf\"", 0, "overlong encoding"},
    {"\"\xf0\x8f\xbf\xbf\"", 0, "overlong encoding"},
    {"\"\xed\xa0\x80\"", 0, "invalid UTF-8 in string: encoded surrogate U+D800"},
    {"\"\xed\xbf\xbf\"", 0, "encoded surrogate U+DFFF"},
    {"\"\xf4\x90\x80\x80\"", 0, "invalid UTF-8 in string: code point above U+10FFFF"},
    {"\"\xe2\x82\"", 0, "invalid UTF-8 in string: truncated sequence"},
    {"\"\xe2\x82x\"", 0, "truncated sequence"},
    {"\"\xf0\x9f\x98\"", 0, "truncated sequence"},
    {"\"\xc3\"", 0, "truncated sequence"},
    {"[1] x", 0, "unexpected 'x' after the JSON value"},
    {"{} {}", 0, "unexpected '{' after the JSON value"},
    {"1 2", 0, "unexpected '2' after the JSON value"},
    {"1\0", 2, "unexpected byte 0x00 after the JSON value"},
    {"{\"a\":1,\"a\":2}", 0, "duplicate key \"a\""},
    {"{\"a\":{\"x\":1,\"x\":1}}", 0, "duplicate key \"x\""},
    {"{\"\\u0061\":1,\"a\":2}", 0, "duplicate key \"a\""},
    {"[1 2]", 0, "expected ',' or ']' after array element, got '2'"},
    {"[1:2]", 0, "expected ',' or ']' after array element, got ':'"},
    {"{\"a\":1 \"b\":2}", 0, "expected ',' or '}' after object member, got '\"'"},
    {"{\"a\":1]", 0, "expected ',' or '}' after object member"},
    {"[1}", 0, "expected ',' or ']' after array element, got '}'"},
    {"{\"a\" 1}", 0, "expected ':' after object key, got '1'"},
    {"{a:1}", 0, "expected a string key in object, got 'a'"},
    {"{1:1}", 0, "expected a string key in object, got '1'"},
    {"{\"a\":1,,\"b\":2}", 0, "expected a string key in object, got ','"},
    {"[1,,2]", 0, "unexpected ',' (expected a value)"},
    {"[,]", 0, "unexpected ',' (expected a value)"},
    {"{,}", 0, "expected a string key in object, got ','"},
    {"{\"a\":}", 0, "unexpected '}' (expected a value)"},
    {"tru", 0, "invalid literal (expected 'true')"},
    {"nul", 0, "invalid literal (expected 'null')"},
    {"fals", 0, "invalid literal (expected 'false')"},
    {"nulL", 0, "invalid literal (expected 'null')"},
    {"True", 0, "unexpected 'T' (expected a value)"},
    {"truex", 0, "unexpected 'x' after the JSON value"},
    {"[", 0, "unexpected end of input (unclosed '[' from line 1, column 1)"},
    {"[1,", 0, "unexpected end of input (expected a value)"},
    {"[1", 0, "unexpected end of input (unclosed '['"},
    {"{", 0, "unexpected end of input (unclosed '{'"},
    {"{\"a\"", 0, "unexpected end of input (unclosed '{'"},
    {"{\"a\":", 0, "unexpected end of input (expected a value)"},
    {"{\"a\":1", 0, "unexpected end of input (unclosed '{'"},
    {"\f1", 0, "unexpected byte 0x0c (expected a value)"},
    {"[1,\v2]", 0, "unexpected byte 0x0b (expected a value)"},
    {"\xc2\xa0" "1", 0, "unexpected byte 0xc2 (expected a value)"},
    {"\xef\xbb\xbf{}", 0, "unexpected byte 0xef (expected a value)"},
    {"/* c */ 1", 0, "unexpected '/' (expected a value)"},
    {"// c\n1", 0, "unexpected '/' (expected a value)"},
    {"'a'", 0, "unexpected ''' (expected a value)"},
    {"{\"a\\u0000b\":1}", 0, "object key contains \\u0000"},
    {"\"\\", 0, "unterminated string"},
    {"\"\\u", 0, "unterminated string"},
};

TEST(json_invalid_table) {
    loom_ctx *ctx = new_ctx();
    size_t n = sizeof bad_cases / sizeof *bad_cases;
    CHECK(n >= 40);
    for (size_t k = 0; k < n; k++) {
        const struct bad_case *c = &bad_cases[k];
        size_t len = c->len ? c->len : strlen(c->text);
        loom_json *v = (loom_json *)1;
        loom_status st = loom_json_parse(ctx, c->text, len, "bad.json", &v);
        CHECK_MSG(st == LOOM_ERR_FORMAT, "case %zu (%s): status %s", k, c->text,
                  loom_status_str(st));
        CHECK_MSG(v == NULL, "case %zu: *out not NULL", k);
        const char *msg = loom_last_error(ctx);
        CHECK_MSG(strncmp(msg, "bad.json: line ", 15) == 0, "case %zu: message \"%s\"", k, msg);
        CHECK_MSG(strstr(msg, c->frag) != NULL, "case %zu (%s): \"%s\" lacks \"%s\"", k, c->text,
                  msg, c->frag);
        if (st == LOOM_OK) loom_json_free(v);
        loom_clear_error(ctx);
    }
    loom_ctx_free(ctx);
}

/* Nested arrays and objects of the given depth. */
static char *nested(int depth, bool objects) {
    char *s = malloc((size_t)depth * 6 + 8);
    size_t n = 0;
    for (int k = 0; k < depth; k++) {
        if (objects) memcpy(s + n, "{\"a\":", 5), n += 5;
        else s[n++] = '[';
    }
    s[n++] = '1';
    for (int k = 0; k < depth; k++) s[n++] = objects ? '}' : ']';
    s[n] = '\0';
    return s;
}

TEST(json_depth_limit) {
    loom_ctx *ctx = new_ctx();
    for (int objects = 0; objects < 2; objects++) {
        char *ok = nested(LOOM_JSON_MAX_DEPTH, objects);
        loom_json *v = parse(ctx, ok);
        CHECK_MSG(v != NULL, "depth 128: %s", loom_last_error(ctx));
        char *back = v ? write_json(ctx, v, -1) : NULL;
        CHECK(back && strcmp(back, ok) == 0);
        free(back);
        loom_json_free(v);
        free(ok);
        char *bad = nested(LOOM_JSON_MAX_DEPTH + 1, objects);
        CHECK(parse(ctx, bad) == NULL);
        CHECK_CONTAINS(loom_last_error(ctx), "nesting deeper than 128");
        CHECK_CONTAINS(loom_last_error(ctx), objects ? "column 641" : "column 129");
        free(bad);
    }
    /* very deep input fails fast, without recursing past the limit */
    size_t big = 1000000;
    char *deep = malloc(big);
    memset(deep, '[', big);
    loom_json *v = NULL;
    CHECK(loom_json_parse(ctx, deep, big, "deep", &v) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "nesting deeper than 128");
    free(deep);
    loom_ctx_free(ctx);
}

TEST(json_error_positions) {
    loom_ctx *ctx = new_ctx();
    CHECK(parse(ctx, "{\n  \"a\": 1,\n  \"b\": x\n}") == NULL);
    CHECK_STR(loom_last_error(ctx), "t.json: line 3, column 8: unexpected 'x' (expected a value)");
    /* columns count characters, not bytes */
    CHECK(parse(ctx, "[\"\xc3\xa9\", x]") == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "line 1, column 7:");
    /* the duplicate is reported where it appears; the first in file order wins */
    CHECK(parse(ctx, "{\"a\":1,\n\"a\":2}") == NULL);
    CHECK_STR(loom_last_error(ctx), "t.json: line 2, column 1: duplicate key \"a\"");
    CHECK(parse(ctx, "{\"b\":1,\"a\":1,\"b\":2,\"a\":2}") == NULL);
    CHECK_STR(loom_last_error(ctx), "t.json: line 1, column 14: duplicate key \"b\"");
    /* errors inside strings point at the offending byte */
    CHECK(parse(ctx, "\n  \"abc\\q\"") == NULL);
    CHECK_STR(loom_last_error(ctx), "t.json: line 2, column 7: invalid escape '\\q' in string");
    CHECK(parse(ctx, "[1,\n2,\n]") == NULL);
    CHECK_STR(loom_last_error(ctx), "t.json: line 2, column 2: trailing comma before ']'");
    CHECK(parse(ctx, "[1,\n2\n") == NULL);
    CHECK_STR(loom_last_error(ctx),
              "t.json: line 3, column 1: unexpected end of input (unclosed '[' from line 1, "
              "column 1)");
    /* what = NULL */
    loom_json *v = NULL;
    CHECK(loom_json_parse(ctx, "x", 1, NULL, &v) == LOOM_ERR_FORMAT);
    CHECK_STR(loom_last_error(ctx), "JSON: line 1, column 1: unexpected 'x' (expected a value)");
    /* keys in messages are escaped and cut */
    CHECK(parse(ctx, "{\"a\\u0001\\\"\":1,\"a\\u0001\\\"\":2}") == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "duplicate key \"a\\x01\\\"\"");
    char longdoc[700];
    char key[301];
    memset(key, 'k', 300);
    key[300] = '\0';
    snprintf(longdoc, sizeof longdoc, "{\"%s\":1,\"%s\":2}", key, key);
    CHECK(parse(ctx, longdoc) == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "duplicate key \"kkkkkkkkkk");
    CHECK_CONTAINS(loom_last_error(ctx), "kkk...\"");
    CHECK(strlen(loom_last_error(ctx)) < 150);
    loom_ctx_free(ctx);
}

/* ---- getters ---- */

TEST(json_typed_getters) {
    loom_ctx *ctx = new_ctx();
    loom_json *cfg = parse(ctx, "{\"hidden_size\": 64, \"eps\": 1e-06, \"name\": \"x\", "
                                "\"flag\": true, \"f\": 1.5, \"big\": 1e30, \"n\": null, "
                                "\"s0\": \"a\\u0000b\", \"float_int\": 64.0, \"arr\": [1]}");
    REQUIRE(cfg);
    int64_t i = -1;
    double d = -1;
    bool b = false;
    const char *s = NULL;
    CHECK_OK(ctx, loom_json_get_int(ctx, cfg, "hidden_size", "cfg", &i));
    CHECK_EQ_INT(i, 64);
    CHECK_OK(ctx, loom_json_get_num(ctx, cfg, "hidden_size", "cfg", &d));
    CHECK(d == 64.0);
    CHECK_OK(ctx, loom_json_get_num(ctx, cfg, "eps", "cfg", &d));
    CHECK(d == 1e-6);
    CHECK_OK(ctx, loom_json_get_bool(ctx, cfg, "flag", "cfg", &b));
    CHECK(b);
    CHECK_OK(ctx, loom_json_get_str(ctx, cfg, "name", "cfg", &s));
    CHECK_STR(s, "x");

    CHECK(loom_json_get_int(ctx, cfg, "name", "cfg", &i) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'name' must be an integer, got string");
    CHECK(loom_json_get_int(ctx, cfg, "f", "cfg", &i) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'f' must be an integer, got 1.5");
    CHECK(loom_json_get_int(ctx, cfg, "big", "cfg", &i) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'big' must be an integer, got 1e+30");
    CHECK(loom_json_get_int(ctx, cfg, "float_int", "cfg", &i) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'float_int' must be an integer, got 64.0");
    CHECK(loom_json_get_int(ctx, cfg, "arr", "cfg", &i) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'arr' must be an integer, got array");
    CHECK_EQ_INT(i, 64); /* untouched on error */
    CHECK(loom_json_get_num(ctx, cfg, "name", "cfg", &d) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'name' must be a number, got string");
    CHECK(loom_json_get_bool(ctx, cfg, "hidden_size", "cfg", &b) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'hidden_size' must be a boolean, got number");
    CHECK(loom_json_get_str(ctx, cfg, "flag", "cfg", &s) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'flag' must be a string, got boolean");
    CHECK(loom_json_get_str(ctx, cfg, "s0", "cfg", &s) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "\\u0000");

    CHECK(loom_json_get_int(ctx, cfg, "hidden", "cfg", &i) == LOOM_ERR_NOT_FOUND);
    CHECK_STR(loom_last_error(ctx), "cfg: missing required field 'hidden'");
    CHECK(loom_json_get_str(ctx, cfg, "n", "cfg", &s) == LOOM_ERR_NOT_FOUND);
    CHECK_STR(loom_last_error(ctx), "cfg: missing required field 'n'");
    CHECK(loom_json_get_bool(ctx, loom_json_get(cfg, "arr"), "x", "cfg", &b) ==
          LOOM_ERR_NOT_FOUND);
    CHECK(loom_json_get_num(ctx, NULL, "x", NULL, &d) == LOOM_ERR_NOT_FOUND);
    CHECK_STR(loom_last_error(ctx), "JSON: missing required field 'x'");

    /* optional: absent or null leaves the default; a wrong type is still an error */
    i = 7, d = 0.5, b = false, s = "dflt";
    CHECK_OK(ctx, loom_json_get_int_opt(ctx, cfg, "absent", "cfg", &i));
    CHECK_OK(ctx, loom_json_get_int_opt(ctx, cfg, "n", "cfg", &i));
    CHECK_OK(ctx, loom_json_get_num_opt(ctx, cfg, "n", "cfg", &d));
    CHECK_OK(ctx, loom_json_get_bool_opt(ctx, cfg, "absent", "cfg", &b));
    CHECK_OK(ctx, loom_json_get_str_opt(ctx, cfg, "n", "cfg", &s));
    CHECK_EQ_INT(i, 7);
    CHECK(d == 0.5 && !b);
    CHECK_STR(s, "dflt");
    CHECK_OK(ctx, loom_json_get_int_opt(ctx, cfg, "hidden_size", "cfg", &i));
    CHECK_EQ_INT(i, 64);
    CHECK_OK(ctx, loom_json_get_num_opt(ctx, cfg, "f", "cfg", &d));
    CHECK(d == 1.5);
    CHECK_OK(ctx, loom_json_get_bool_opt(ctx, cfg, "flag", "cfg", &b));
    CHECK(b);
    CHECK_OK(ctx, loom_json_get_str_opt(ctx, cfg, "name", "cfg", &s));
    CHECK_STR(s, "x");
    CHECK(loom_json_get_int_opt(ctx, cfg, "name", "cfg", &i) == LOOM_ERR_CONFIG);
    CHECK(loom_json_get_num_opt(ctx, cfg, "flag", "cfg", &d) == LOOM_ERR_CONFIG);
    CHECK(loom_json_get_bool_opt(ctx, cfg, "f", "cfg", &b) == LOOM_ERR_CONFIG);
    CHECK(loom_json_get_str_opt(ctx, cfg, "arr", "cfg", &s) == LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "cfg: 'arr' must be a string, got array");
    loom_json_free(cfg);
    loom_ctx_free(ctx);
}

/* ---- building and writing ---- */

TEST(json_build_and_write) {
    loom_ctx *ctx = new_ctx();
    loom_json *o = loom_json_new_object(ctx);
    REQUIRE(o);
    CHECK_OK(ctx, loom_json_set(ctx, o, "a", loom_json_new_int(ctx, 1)));
    loom_json *arr = loom_json_new_array(ctx);
    CHECK_OK(ctx, loom_json_push(ctx, arr, loom_json_new_int(ctx, 1)));
    CHECK_OK(ctx, loom_json_push(ctx, arr, loom_json_new_int(ctx, 2)));
    CHECK_OK(ctx, loom_json_set(ctx, o, "b", arr));
    char *s = write_json(ctx, o, -1);
    CHECK_STR(s, "{\"a\":1,\"b\":[1,2]}");
    free(s);
    s = write_json(ctx, o, 2);
    CHECK_STR(s, "{\n  \"a\": 1,\n  \"b\": [\n    1,\n    2\n  ]\n}");
    free(s);
    s = write_json(ctx, o, 0);
    CHECK_STR(s, "{\n\"a\": 1,\n\"b\": [\n1,\n2\n]\n}");
    free(s);

    /* replace in place keeps the position; new keys append and stay findable */
    CHECK_OK(ctx, loom_json_set(ctx, o, "a", loom_json_new_str(ctx, "x")));
    CHECK_OK(ctx, loom_json_set(ctx, o, "0", loom_json_new_null(ctx)));
    CHECK_OK(ctx, loom_json_set(ctx, o, "e", loom_json_new_object(ctx)));
    CHECK_OK(ctx, loom_json_set(ctx, o, "f", loom_json_new_array(ctx)));
    CHECK_OK(ctx, loom_json_set(ctx, o, "t", loom_json_new_bool(ctx, true)));
    CHECK_OK(ctx, loom_json_set(ctx, o, "d", loom_json_new_num(ctx, 0.5)));
    s = write_json(ctx, o, -1);
    CHECK_STR(s, "{\"a\":\"x\",\"b\":[1,2],\"0\":null,\"e\":{},\"f\":[],\"t\":true,\"d\":0.5}");
    free(s);
    CHECK(loom_json_get(o, "0")->type == LOOM_JSON_NULL);
    CHECK(loom_json_get(o, "d")->d == 0.5);
    CHECK(loom_json_get(o, "a")->type == LOOM_JSON_STRING);
    CHECK(loom_json_remove(o, "a"));
    CHECK(!loom_json_remove(o, "a"));
    CHECK(!loom_json_remove(o, "zz"));
    CHECK(loom_json_get(o, "a") == NULL);
    CHECK(loom_json_remove(o, "e"));
    s = write_json(ctx, o, 2);
    CHECK_STR(s, "{\n  \"b\": [\n    1,\n    2\n  ],\n  \"0\": null,\n  \"f\": [],\n"
                 "  \"t\": true,\n  \"d\": 0.5\n}");
    free(s);
    const char *keys[] = {"b", "0", "f", "t", "d"};
    for (int k = 0; k < 5; k++) CHECK_MSG(loom_json_get(o, keys[k]) == o->items[k], "%s", keys[k]);
    for (size_t k = 1; k < o->n; k++)
        CHECK(strcmp(o->keys[o->order[k - 1]], o->keys[o->order[k]]) < 0);

    /* clone is deep */
    loom_json *c = loom_json_clone(ctx, o);
    REQUIRE(c);
    CHECK_OK(ctx, loom_json_set(ctx, c, "b", loom_json_new_str(ctx, "changed")));
    CHECK(loom_json_get(o, "b")->type == LOOM_JSON_ARRAY);
    CHECK_OK(ctx, loom_json_set(ctx, c, "b", loom_json_clone(ctx, loom_json_get(o, "b"))));
    char *s1 = write_json(ctx, o, -1), *s2 = write_json(ctx, c, -1);
    CHECK_STR(s1, s2);
    free(s1);
    free(s2);
    loom_json_free(c);

    /* misuse: ownership is taken even on failure (no leak under ASan) */
    CHECK(loom_json_push(ctx, o, loom_json_new_int(ctx, 3)) == LOOM_ERR_INVALID_ARG);
    CHECK(loom_json_set(ctx, arr, "k", loom_json_new_int(ctx, 3)) == LOOM_ERR_INVALID_ARG);
    CHECK(loom_json_set(ctx, o, NULL, loom_json_new_int(ctx, 3)) == LOOM_ERR_INVALID_ARG);
    CHECK(loom_json_new_str(ctx, NULL) == NULL);
    loom_json_free(o);
    loom_ctx_free(ctx);
}

TEST(json_write_numbers) {
    loom_ctx *ctx = new_ctx();
    static const struct {
        double d;
        const char *want; /* Python's repr() */
    } cases[] = {
        {1e-06, "1e-06"},
        {1e6, "1000000.0"},
        {0.1, "0.1"},
        {1.0 / 3, "0.3333333333333333"},
        {0.1 + 0.2, "0.30000000000000004"},
        {1e16, "1e+16"},
        {1e15, "1000000000000000.0"},
        {1234567890123456.0, "1234567890123456.0"},
        {123.456, "123.456"},
        {-0.0, "-0.0"},
        {0.0, "0.0"},
        {4.9406564584124654e-324, "5e-324"},
        {DBL_MAX, "1.7976931348623157e+308"},
        {DBL_MIN, "2.2250738585072014e-308"},
        {0.0001, "0.0001"},
        {0.00001, "1e-05"},
        {1.5e300, "1.5e+300"},
        {2.5, "2.5"},
        {-1.5, "-1.5"},
        {100.0, "100.0"},
        {1e22, "1e+22"},
        {9007199254740993.0, "9007199254740992.0"},
        {1234567890123456789.0, "1.2345678901234568e+18"},
        {0.95, "0.95"},
        {7.11936591050941, "7.11936591050941"},
        {1e-08, "1e-08"},
        {123e-20, "1.23e-18"},
        {0.000123, "0.000123"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        loom_sb sb;
        loom_sb_init(&sb);
        loom_json_write_double(&sb, cases[k].d);
        CHECK_MSG(sb.buf && !strcmp(sb.buf, cases[k].want), "%.17g: got %s want %s", cases[k].d,
                  sb.buf ? sb.buf : "(null)", cases[k].want);
        loom_json *v = sb.buf ? parse(ctx, sb.buf) : NULL;
        CHECK_MSG(v && v->d == cases[k].d && !v->is_int, "%s does not read back", sb.buf);
        loom_json_free(v);
        loom_sb_free(&sb);
    }
    /* integers are exact */
    loom_json *a = loom_json_new_array(ctx);
    CHECK_OK(ctx, loom_json_push(ctx, a, loom_json_new_int(ctx, INT64_MIN)));
    CHECK_OK(ctx, loom_json_push(ctx, a, loom_json_new_int(ctx, INT64_MAX)));
    CHECK_OK(ctx, loom_json_push(ctx, a, loom_json_new_num(ctx, 3.0)));
    char *s = write_json(ctx, a, -1);
    CHECK_STR(s, "[-9223372036854775808,9223372036854775807,3.0]");
    free(s);
    /* non-finite doubles are refused and leave the buffer as it was */
    double bad[] = {NAN, INFINITY, -INFINITY};
    for (int k = 0; k < 3; k++) {
        loom_json *x = loom_json_new_array(ctx);
        CHECK_OK(ctx, loom_json_push(ctx, x, loom_json_new_num(ctx, bad[k])));
        loom_sb sb;
        loom_sb_init(&sb);
        loom_sb_puts(&sb, "pre");
        CHECK(loom_json_write(ctx, x, -1, &sb) == LOOM_ERR_INVALID_ARG);
        CHECK_CONTAINS(loom_last_error(ctx), "NaN or Infinity");
        CHECK_STR(sb.buf, "pre");
        loom_sb_free(&sb);
        loom_json_free(x);
    }
    loom_json_free(a);
    loom_ctx_free(ctx);
}

/* Random bit patterns: every finite double is written so that it reads back
 * to the same bits. */
TEST(json_double_round_trip_random) {
    loom_ctx *ctx = new_ctx();
    uint64_t x = 0x9E3779B97F4A7C15ull;
    loom_sb sb;
    loom_sb_init(&sb);
    int bad = 0;
    for (int k = 0; k < 50000 && bad < 5; k++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        uint64_t bits = k % 4 == 0 ? x >> (k % 64) : x; /* include subnormals and small */
        double d;
        memcpy(&d, &bits, sizeof d);
        if (!isfinite(d)) continue;
        sb.len = 0;
        loom_json_write_double(&sb, d);
        loom_json *v = NULL;
        loom_status st = loom_json_parse(ctx, sb.buf, sb.len, "d", &v);
        uint64_t back = 0;
        if (st == LOOM_OK) memcpy(&back, &v->d, sizeof back);
        if (st != LOOM_OK || back != bits || v->is_int) {
            CHECK_MSG(0, "%.17g written as %s", d, sb.buf);
            bad++;
        }
        loom_json_free(v);
    }
    loom_sb_free(&sb);
    loom_ctx_free(ctx);
}

TEST(json_write_strings) {
    loom_ctx *ctx = new_ctx();
    loom_sb sb;
    loom_sb_init(&sb);
    const char raw[] = "a\"b\\c/\n\t\r\b\f\x01\x1f\x7f \xc3\xa9\0z";
    loom_json_write_string(&sb, raw, sizeof raw - 1);
    CHECK_STR(sb.buf, "\"a\\\"b\\\\c/\\n\\t\\r\\b\\f\\u0001\\u001f\x7f \xc3\xa9\\u0000z\"");
    loom_json *v = parse(ctx, sb.buf);
    REQUIRE(v);
    CHECK(v->slen == sizeof raw - 1 && !memcmp(v->s, raw, v->slen));
    loom_json_free(v);
    loom_sb_free(&sb);
    /* a DOM string that is not UTF-8 cannot be written */
    loom_json *bad = loom_json_new_str(ctx, "ok\xff");
    loom_sb_init(&sb);
    CHECK(loom_json_write(ctx, bad, -1, &sb) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "UTF-8");
    loom_sb_free(&sb);
    loom_json_free(bad);
    loom_ctx_free(ctx);
}

TEST(json_round_trip) {
    loom_ctx *ctx = new_ctx();
    /* canonical compact documents come back byte for byte */
    const char *docs[] = {
        ("{\"a\":[1,2.5,\"x\",null,true,false,{}],\"b\":{\"c\":[]},\"d\":-9223372036854775808,"
         "\"e\":1e-06,\"f\":\"\\u0000\xc3\xa9\\n\\\"\",\"g\":1e+300,\"h\":-0.0}"),
        "[]",
        "{}",
        "\"\xf0\x9f\x98\x80\"",
        "[[[[[]]]],{\"\":{\"\":\"\"}}]",
        "[0.1,0.2,0.30000000000000004,1000000.0,123456789,-1]",
        "{\"z\":1,\"y\":2,\"x\":{\"b\":[true],\"a\":null}}",
    };
    for (size_t k = 0; k < sizeof docs / sizeof *docs; k++) {
        loom_json *v = parse(ctx, docs[k]);
        CHECK_MSG(v != NULL, "%s: %s", docs[k], loom_last_error(ctx));
        if (!v) continue;
        char *c = write_json(ctx, v, -1), *pretty = write_json(ctx, v, 3);
        CHECK_STR(c, docs[k]);
        loom_json *w = pretty ? parse(ctx, pretty) : NULL;
        char *c2 = w ? write_json(ctx, w, -1) : NULL;
        CHECK_STR(c2, docs[k]);
        free(c);
        free(c2);
        free(pretty);
        loom_json_free(w);
        loom_json_free(v);
    }
    /* non-canonical text settles after one write */
    const char *loose[] = {
        " { \"a\" : 1E2 , \"b\" : [ 1.50 , -0 , 0e0, 5E-324 ] , \"c\" : \"\\u00e9\\/\" } ",
        "[9223372036854775808, 1e400000000000000000000000000000000000000000000000000000000]",
    };
    for (size_t k = 0; k < sizeof loose / sizeof *loose; k++) {
        loom_json *v = parse(ctx, loose[k]);
        if (k == 1) { /* the second does not parse: 1e400... is out of range */
            CHECK(v == NULL);
            continue;
        }
        REQUIRE(v);
        char *c = write_json(ctx, v, -1);
        CHECK_STR(c, "{\"a\":100.0,\"b\":[1.5,0,0.0,5e-324],\"c\":\"\xc3\xa9/\"}");
        loom_json *w = parse(ctx, c);
        char *c2 = w ? write_json(ctx, w, -1) : NULL;
        CHECK_STR(c2, c);
        free(c);
        free(c2);
        loom_json_free(w);
        loom_json_free(v);
    }
    loom_ctx_free(ctx);
}

TEST(json_big_object) {
    loom_ctx *ctx = new_ctx();
    const size_t n = 100000;
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_putc(&sb, '{');
    for (size_t k = 0; k < n; k++) { /* a permutation of 0..n-1, not sorted */
        size_t key = (k * 7919) % n;
        loom_sb_printf(&sb, "%s\"key%06zu\":%zu", k ? "," : "", key, key);
    }
    loom_sb_putc(&sb, '}');
    REQUIRE(!sb.failed);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    loom_json *v = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, sb.buf, sb.len, "big", &v));
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    CHECK_MSG(secs < 5.0, "100k keys took %.2f s", secs);
    CHECK_EQ_INT(v->n, n);
    char key[32];
    for (size_t k = 0; k < n; k++) {
        snprintf(key, sizeof key, "key%06zu", k);
        const loom_json *x = loom_json_get(v, key);
        if (!x || x->i != (int64_t)k) {
            CHECK_MSG(0, "lookup %s", key);
            break;
        }
    }
    CHECK(loom_json_get(v, "key100000") == NULL);
    CHECK(loom_json_get(v, "") == NULL);
    char *out = write_json(ctx, v, -1);
    CHECK(out && strcmp(out, sb.buf) == 0);
    free(out);
    loom_json_free(v);
    /* a duplicate far apart is found and named */
    sb.len--;
    loom_sb_puts(&sb, ",\"key050000\":1}");
    CHECK(loom_json_parse(ctx, sb.buf, sb.len, "big", &v) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "duplicate key \"key050000\"");
    loom_sb_free(&sb);
    loom_ctx_free(ctx);
}

/* ---- files and fixtures ---- */

TEST(json_parse_file) {
    loom_ctx *ctx = new_ctx();
    const char *path = loom_test_write("bad.json", "{\n\"a\":,}", 8);
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", path);
    loom_json *v = (loom_json *)1;
    CHECK(loom_json_parse_file(ctx, saved, &v) == LOOM_ERR_FORMAT);
    CHECK(v == NULL);
    char want[1100];
    snprintf(want, sizeof want, "%s: line 2, column 5: unexpected ',' (expected a value)", saved);
    CHECK_STR(loom_last_error(ctx), want);
    CHECK(loom_json_parse_file(ctx, "/nonexistent/x.json", &v) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "/nonexistent/x.json");
    path = loom_test_write("ok.json", "{\"a\": [1]}\n", 11);
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, path, &v));
    CHECK(loom_json_at(loom_json_get(v, "a"), 0)->i == 1);
    loom_json_free(v);
    loom_ctx_free(ctx);
}

/* Parses every .json under dir; checks each survives write/parse. */
static int walk_json(loom_ctx *ctx, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int count = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat st;
        if (stat(path, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) {
            count += walk_json(ctx, path);
            continue;
        }
        size_t nl = strlen(de->d_name);
        if (nl < 5 || strcmp(de->d_name + nl - 5, ".json") != 0) continue;
        loom_json *v = NULL;
        loom_status s = loom_json_parse_file(ctx, path, &v);
        CHECK_MSG(s == LOOM_OK, "%s: %s", path, loom_last_error(ctx));
        if (s != LOOM_OK) continue;
        count++;
        char *c = write_json(ctx, v, -1), *p = write_json(ctx, v, 2);
        loom_json *w = p ? parse(ctx, p) : NULL;
        char *c2 = w ? write_json(ctx, w, -1) : NULL;
        CHECK_MSG(c && c2 && !strcmp(c, c2), "%s does not round-trip", path);
        /* HF writes config.json with json.dumps(indent=2, sort_keys=True) + "\n":
         * loom writes the same bytes back */
        if (!strcmp(de->d_name, "config.json") && p) {
            char *orig;
            size_t len;
            if (loom_read_file(ctx, path, 0, &orig, &len) == LOOM_OK) {
                CHECK_MSG(len == strlen(p) + 1 && !memcmp(orig, p, len - 1),
                          "%s: pretty output differs from the file", path);
                free(orig);
            }
        }
        free(c);
        free(c2);
        free(p);
        loom_json_free(w);
        loom_json_free(v);
    }
    closedir(d);
    return count;
}

TEST(json_fixtures) {
    loom_ctx *ctx = new_ctx();
    const char *fx = loom_test_fixtures();
    REQUIRE_FIXTURE(fx);
    int n = walk_json(ctx, fx);
    CHECK_MSG(n >= 20, "only %d JSON fixtures", n);

    char path[1024];
    snprintf(path, sizeof path, "%s/models/tiny-qwen3/config.json", fx);
    loom_json *cfg = NULL;
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, path, &cfg));
    int64_t hidden = 0;
    CHECK_OK(ctx, loom_json_get_int(ctx, cfg, "hidden_size", path, &hidden));
    CHECK_EQ_INT(hidden, 64);
    const loom_json *rope = loom_json_get(cfg, "rope_parameters");
    double theta = 0, eps = 0;
    CHECK_OK(ctx, loom_json_get_num(ctx, rope, "rope_theta", path, &theta));
    CHECK(theta == 1000000.0);
    CHECK(!loom_json_get(rope, "rope_theta")->is_int);
    CHECK_OK(ctx, loom_json_get_num(ctx, cfg, "rms_norm_eps", path, &eps));
    CHECK(eps == 1e-06);
    bool tie = false;
    CHECK_OK(ctx, loom_json_get_bool(ctx, cfg, "tie_word_embeddings", path, &tie));
    CHECK(tie);
    const char *mt = NULL;
    CHECK_OK(ctx, loom_json_get_str(ctx, cfg, "model_type", path, &mt));
    CHECK_STR(mt, "qwen3");
    CHECK_EQ_INT(loom_json_get(cfg, "layer_types")->n, 4);
    int64_t bos = 42;
    CHECK_OK(ctx, loom_json_get_int_opt(ctx, cfg, "bos_token_id", path, &bos));
    CHECK_EQ_INT(bos, 42);
    loom_json_free(cfg);

    snprintf(path, sizeof path, "%s/models/tiny-qwen3-untied/model.safetensors.index.json", fx);
    loom_json *idx = NULL;
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, path, &idx));
    int64_t total = 0;
    CHECK_OK(ctx,
             loom_json_get_int(ctx, loom_json_get(idx, "metadata"), "total_size", path, &total));
    CHECK_EQ_INT(total, 1116928);
    const char *shard = NULL;
    CHECK_OK(ctx, loom_json_get_str(ctx, loom_json_get(idx, "weight_map"), "lm_head.weight", path,
                                    &shard));
    CHECK_CONTAINS(shard, ".safetensors");
    loom_json_free(idx);

    snprintf(path, sizeof path, "%s/golden/tiny-qwen3.json", fx);
    loom_json *g = NULL;
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, path, &g));
    CHECK(loom_json_get(g, "loss")->d == 7.11936591050941);
    CHECK(loom_json_at(loom_json_get(loom_json_get(g, "hp"), "betas"), 1)->d == 0.95);
    loom_json_free(g);

    snprintf(path, sizeof path, "%s/tokenizer/tokenizer.json", fx);
    loom_json *tok = NULL;
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, path, &tok));
    const loom_json *added = loom_json_at(loom_json_get(tok, "added_tokens"), 0);
    REQUIRE(added);
    CHECK_EQ_INT(loom_json_get(added, "id")->i, 993);
    CHECK_STR(loom_json_get(added, "content")->s, "<|endoftext|>");
    CHECK(loom_json_get(tok, "model") && loom_json_get(tok, "model")->type == LOOM_JSON_OBJECT);
    loom_json_free(tok);
    loom_ctx_free(ctx);
}
