/* A strict JSON (RFC 8259) parser with a small DOM, and a writer.
 *
 * - Input must be valid UTF-8 (overlong forms, surrogates encoded in UTF-8
 *   and code points past U+10FFFF are refused); \u escapes are decoded,
 *   surrogate pairs combined, lone surrogates refused.
 * - Nesting deeper than LOOM_JSON_MAX_DEPTH is refused (no stack overflow).
 * - Numbers keep their exact value: an integer literal (no fraction, no
 *   exponent) that fits int64 is stored exactly in `i` (is_int = true); every
 *   number also has `d`, the correctly rounded double. Integer literals
 *   outside int64 have is_int = false.
 * - Object keys keep their file order; duplicate keys are refused (with the
 *   key named). Lookup by key is O(log n).
 * - Errors say where: "<what>: line L, column C: <problem>", where `what`
 *   names the source (usually the file path).
 *
 * The DOM owns all its memory; free the root with loom_json_free.
 */
#ifndef LOOM_JSON_H
#define LOOM_JSON_H

#include "core.h"

#define LOOM_JSON_MAX_DEPTH 128

typedef enum loom_json_type {
    LOOM_JSON_NULL = 0,
    LOOM_JSON_BOOL,
    LOOM_JSON_NUMBER,
    LOOM_JSON_STRING,
    LOOM_JSON_ARRAY,
    LOOM_JSON_OBJECT
} loom_json_type;

typedef struct loom_json loom_json;
struct loom_json {
    loom_json_type type;
    bool b;          /* BOOL */
    bool is_int;     /* NUMBER: exact int64 in i */
    int64_t i;       /* NUMBER: exact value when is_int */
    double d;        /* NUMBER: value as double (always set) */
    char *s;         /* STRING: NUL-terminated UTF-8 (may contain \0: use slen) */
    size_t slen;     /* STRING: length in bytes */
    size_t n;        /* ARRAY / OBJECT: number of items */
    size_t cap;      /* ARRAY / OBJECT: allocated items */
    loom_json **items; /* ARRAY / OBJECT: values, in file order */
    char **keys;     /* OBJECT: keys, in file order (NUL-terminated) */
    size_t *order;   /* OBJECT: indices of items sorted by key (for lookup) */
};

/* Parses text[0..len). `what` names the source in error messages. */
loom_status loom_json_parse(loom_ctx *ctx, const char *text, size_t len, const char *what,
                            loom_json **out);
/* Reads and parses a file; errors name the path. */
loom_status loom_json_parse_file(loom_ctx *ctx, const char *path, loom_json **out);
void loom_json_free(loom_json *v);

/* Lookup: NULL when obj is not an object or the key is absent. */
const loom_json *loom_json_get(const loom_json *obj, const char *key);
/* Element i of an array (NULL when out of range or not an array). */
const loom_json *loom_json_at(const loom_json *arr, size_t i);
const char *loom_json_type_name(loom_json_type t);

/* Typed getters for config-style reading. Each returns LOOM_OK and sets *out;
 * LOOM_ERR_NOT_FOUND when the key is absent or null (message names the key
 * and `what`), LOOM_ERR_CONFIG when the type is wrong ("'hidden_size' must be
 * an integer, got string"). The *_opt variants return LOOM_OK and leave *out
 * unchanged when the key is absent or null. */
loom_status loom_json_get_int(loom_ctx *ctx, const loom_json *obj, const char *key,
                              const char *what, int64_t *out);
loom_status loom_json_get_num(loom_ctx *ctx, const loom_json *obj, const char *key,
                              const char *what, double *out);
loom_status loom_json_get_bool(loom_ctx *ctx, const loom_json *obj, const char *key,
                               const char *what, bool *out);
loom_status loom_json_get_str(loom_ctx *ctx, const loom_json *obj, const char *key,
                              const char *what, const char **out);
loom_status loom_json_get_int_opt(loom_ctx *ctx, const loom_json *obj, const char *key,
                                  const char *what, int64_t *out);
loom_status loom_json_get_num_opt(loom_ctx *ctx, const loom_json *obj, const char *key,
                                  const char *what, double *out);
loom_status loom_json_get_bool_opt(loom_ctx *ctx, const loom_json *obj, const char *key,
                                   const char *what, bool *out);
loom_status loom_json_get_str_opt(loom_ctx *ctx, const loom_json *obj, const char *key,
                                  const char *what, const char **out);

/* Building a DOM (for writing config.json, safetensors headers, meta.json).
 * Constructors return NULL on allocation failure (error set in ctx). */
loom_json *loom_json_new_null(loom_ctx *ctx);
loom_json *loom_json_new_bool(loom_ctx *ctx, bool b);
loom_json *loom_json_new_int(loom_ctx *ctx, int64_t i);
loom_json *loom_json_new_num(loom_ctx *ctx, double d);
loom_json *loom_json_new_str(loom_ctx *ctx, const char *s);
loom_json *loom_json_new_array(loom_ctx *ctx);
loom_json *loom_json_new_object(loom_ctx *ctx);
/* Deep copy. */
loom_json *loom_json_clone(loom_ctx *ctx, const loom_json *v);
/* Appends to an array; takes ownership of item (freed on failure). */
loom_status loom_json_push(loom_ctx *ctx, loom_json *arr, loom_json *item);
/* Sets obj[key] = item: replaces an existing key in place (keeping its
 * position) or appends. Takes ownership of item (freed on failure). */
loom_status loom_json_set(loom_ctx *ctx, loom_json *obj, const char *key, loom_json *item);
/* Removes obj[key] if present; returns whether it was. */
bool loom_json_remove(loom_json *obj, const char *key);

/* Serialises v. indent < 0: compact, one line; indent >= 0: pretty, with
 * that many spaces per level (like Python's json.dumps(indent=N)). Doubles
 * use the shortest text that reads back to the same value; non-finite
 * doubles are refused (JSON has no NaN/Infinity) with LOOM_ERR_INVALID_ARG. */
loom_status loom_json_write(loom_ctx *ctx, const loom_json *v, int indent, loom_sb *out);
/* Strict UTF-8 check (no overlong forms, surrogates, or code points past
 * U+10FFFF), as the parser applies it. */
bool loom_utf8_valid(const char *s, size_t n);
/* Appends s as a JSON string literal (quoted, escaped). */
void loom_json_write_string(loom_sb *out, const char *s, size_t len);
/* Appends the shortest round-tripping text of a finite double. */
void loom_json_write_double(loom_sb *out, double d);

#endif /* LOOM_JSON_H */
