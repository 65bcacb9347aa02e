/* libFuzzer target for the JSON parser and writer.
 *
 * Whatever parses must write back (compact) to text that parses again and
 * writes to the same bytes; the pretty form must read back to the same
 * document too. Lookups, getters, clone, set and remove run on the result.
 * Any mismatch aborts; leaks are caught by ASan. */
#include <stdlib.h>
#include <string.h>

#include "../src/core/json.h"

#define CHECK(c)                                                                   \
    do {                                                                           \
        if (!(c)) {                                                                \
            fprintf(stderr, "fuzz_json: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                               \
        }                                                                          \
    } while (0)

/* Writes v and returns the text (caller frees); aborts on failure, since any
 * parsed document must be writable. */
static char *write_or_die(loom_ctx *ctx, const loom_json *v, int indent, size_t *len) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_status st = loom_json_write(ctx, v, indent, &sb);
    if (st != LOOM_OK) fprintf(stderr, "fuzz_json: write failed: %s\n", loom_last_error(ctx));
    CHECK(st == LOOM_OK && sb.buf);
    *len = sb.len;
    return loom_sb_take(&sb);
}

static loom_json *parse_or_die(loom_ctx *ctx, const char *text, size_t len) {
    loom_json *v = NULL;
    loom_status st = loom_json_parse(ctx, text, len, "rewritten", &v);
    if (st != LOOM_OK) fprintf(stderr, "fuzz_json: re-parse failed: %s\n", loom_last_error(ctx));
    CHECK(st == LOOM_OK && v);
    return v;
}

/* Exercises lookups and getters on every key of an object (and on a few that
 * are absent); checks each key finds its own value. */
static void poke_object(loom_ctx *ctx, const loom_json *o) {
    for (size_t k = 0; k < o->n; k++) {
        CHECK(loom_json_get(o, o->keys[k]) == o->items[k]);
        if (k) CHECK(strcmp(o->keys[o->order[k - 1]], o->keys[o->order[k]]) < 0);
        int64_t i;
        double d;
        bool b;
        const char *s;
        loom_json_get_int_opt(ctx, o, o->keys[k], "fuzz", &i);
        loom_json_get_num_opt(ctx, o, o->keys[k], "fuzz", &d);
        loom_json_get_bool_opt(ctx, o, o->keys[k], "fuzz", &b);
        loom_json_get_str_opt(ctx, o, o->keys[k], "fuzz", &s);
    }
    const char *absent[] = {"", "a", "hidden_size", "\xff", "zzzzzzzz"};
    for (size_t k = 0; k < sizeof absent / sizeof *absent; k++) {
        const loom_json *v = loom_json_get(o, absent[k]);
        int64_t i;
        if (loom_json_get_int(ctx, o, absent[k], "fuzz", &i) == LOOM_OK) CHECK(v && v->is_int);
    }
}

static void poke(loom_ctx *ctx, const loom_json *v, int depth) {
    if (depth > LOOM_JSON_MAX_DEPTH) abort();
    if (v->type == LOOM_JSON_OBJECT) poke_object(ctx, v);
    if (v->type == LOOM_JSON_NUMBER && v->is_int) CHECK(v->d == (double)v->i || v->i == 0);
    for (size_t k = 0; k < v->n; k++) poke(ctx, v->items[k], depth + 1);
}

/* Clone, then edit the clone: remove the first key, replace another and set
 * a new one; lookups must stay consistent. */
static void edit_clone(loom_ctx *ctx, const loom_json *v) {
    loom_json *c = loom_json_clone(ctx, v);
    CHECK(c);
    if (c->type == LOOM_JSON_OBJECT) {
        if (c->n) {
            char *k0 = strdup(c->keys[0]);
            CHECK(k0 && loom_json_remove(c, k0));
            CHECK(loom_json_get(c, k0) == NULL);
            free(k0);
        }
        if (c->n > 1) {
            char *k = strdup(c->keys[c->n / 2]);
            CHECK(k && loom_json_set(ctx, c, k, loom_json_new_null(ctx)) == LOOM_OK);
            CHECK(loom_json_get(c, k)->type == LOOM_JSON_NULL);
            free(k);
        }
        CHECK(loom_json_set(ctx, c, "fuzz-new", loom_json_new_int(ctx, 7)) == LOOM_OK);
        poke_object(ctx, c);
        CHECK(loom_json_get(c, "fuzz-new") && loom_json_get(c, "fuzz-new")->i == 7);
    } else if (c->type == LOOM_JSON_ARRAY) {
        CHECK(loom_json_push(ctx, c, loom_json_new_str(ctx, "x")) == LOOM_OK);
        CHECK(loom_json_at(c, c->n - 1)->type == LOOM_JSON_STRING);
    }
    size_t n;
    free(write_or_die(ctx, c, -1, &n));
    loom_json_free(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_json *v = NULL;
    loom_status st = loom_json_parse(ctx, (const char *)data, size, "fuzz", &v);
    if (st != LOOM_OK) {
        CHECK(v == NULL && st == LOOM_ERR_FORMAT);
        CHECK(strncmp(loom_last_error(ctx), "fuzz: line ", 11) == 0);
        loom_ctx_free(ctx);
        return 0;
    }
    poke(ctx, v, 0);

    size_t n1, n2, n3;
    char *s1 = write_or_die(ctx, v, -1, &n1);
    loom_json *w = parse_or_die(ctx, s1, n1);
    char *s2 = write_or_die(ctx, w, -1, &n2);
    if (n1 != n2 || memcmp(s1, s2, n1) != 0) {
        fprintf(stderr, "fuzz_json: unstable output:\n%s\n%s\n", s1, s2);
        abort();
    }
    /* pretty output reads back to the same document */
    char *p = write_or_die(ctx, v, 2, &n3);
    loom_json *x = parse_or_die(ctx, p, n3);
    char *s3 = write_or_die(ctx, x, -1, &n3);
    CHECK(n3 == n1 && memcmp(s1, s3, n1) == 0);

    edit_clone(ctx, v);

    free(s1);
    free(s2);
    free(s3);
    free(p);
    loom_json_free(x);
    loom_json_free(w);
    loom_json_free(v);
    loom_ctx_free(ctx);
    return 0;
}
