/* Strict JSON (RFC 8259): parser into a small DOM, DOM helpers (the writer
 * is json_write.c).
 *
 * The parser is a recursive descent bounded by LOOM_JSON_MAX_DEPTH. Strings
 * are found in a first pass (closing quote) and decoded in a second, which
 * validates UTF-8 and escapes. Objects are collected in file order; when an
 * object closes, its `order` array (which holds each key's byte offset while
 * the object is being read, for error messages) is replaced by the indices
 * sorted by key, and adjacent equal keys in that order are duplicates.
 *
 * Object keys cannot contain U+0000: the DOM keeps keys as NUL-terminated
 * strings, so "\u0000" inside a key is refused with a clear message. */
#include "json.h"

#include <float.h>
#include <inttypes.h>
#include <locale.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define FILE_LIMIT ((size_t)1 << 30) /* loom_json_parse_file refuses larger files */
#define KEYBUF 96                    /* room for a key quoted in a message */

/* ---- shared helpers ---- */

static bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

/* Formats a key for an error message: non-printables escaped, long keys cut
 * (at a character boundary) with "...". */
static const char *fmt_key(char buf[KEYBUF], const char *s) {
    if (!s) return "(null)";
    size_t n = 0;
    for (const uint8_t *p = (const uint8_t *)s; *p; p++) {
        if (n >= 60 && (*p & 0xC0) != 0x80) {
            memcpy(buf + n, "...", 3);
            n += 3;
            break;
        }
        if (*p == '"' || *p == '\\') {
            buf[n++] = '\\';
            buf[n++] = (char)*p;
        } else if (*p < 0x20 || *p == 0x7f) {
            n += (size_t)snprintf(buf + n, KEYBUF - n, "\\x%02x", *p);
        } else {
            buf[n++] = (char)*p;
        }
    }
    buf[n] = '\0';
    return buf;
}

/* Describes the byte at text[pos] for "got ..." messages. */
static const char *fmt_char(char buf[24], const uint8_t *t, size_t len, size_t pos) {
    if (pos >= len) return "end of input";
    uint8_t c = t[pos];
    if (c > 0x20 && c < 0x7f) snprintf(buf, 24, "'%c'", c);
    else snprintf(buf, 24, "byte 0x%02x", c);
    return buf;
}

/* UTF-8 decoding. Returns the sequence length (1-4) or one of these. */
enum { U8_BAD = -1, U8_TRUNC = -2, U8_OVERLONG = -3, U8_SURROGATE = -4, U8_RANGE = -5 };

static int utf8_seq(const uint8_t *s, size_t n, uint32_t *cp_out) {
    uint8_t c = s[0];
    if (c < 0x80) {
        *cp_out = c;
        return 1;
    }
    int need;
    uint32_t cp, min;
    if (c < 0xC0) return U8_BAD; /* stray continuation byte */
    if (c < 0xC2) return U8_OVERLONG;
    if (c < 0xE0) need = 1, cp = c & 0x1Fu, min = 0x80;
    else if (c < 0xF0) need = 2, cp = c & 0x0Fu, min = 0x800;
    else if (c < 0xF5) need = 3, cp = c & 0x07u, min = 0x10000;
    else return U8_BAD;
    for (int k = 1; k <= need; k++) {
        if ((size_t)k >= n || (s[k] & 0xC0) != 0x80) return U8_TRUNC;
        cp = (cp << 6) | (s[k] & 0x3Fu);
    }
    *cp_out = cp;
    if (cp < min) return U8_OVERLONG;
    if (cp >= 0xD800 && cp <= 0xDFFF) return U8_SURROGATE;
    if (cp > 0x10FFFF) return U8_RANGE;
    return need + 1;
}

bool loom_utf8_valid(const char *s, size_t n) {
    uint32_t cp;
    for (size_t i = 0; i < n;) {
        int k = utf8_seq((const uint8_t *)s + i, n - i, &cp);
        if (k < 0) return false;
        i += (size_t)k;
    }
    return true;
}

static size_t utf8_put(char *out, uint32_t cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (cp >> 18));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* strtod of a NUL-terminated C-syntax number. strtod follows LC_NUMERIC;
 * loom never calls setlocale, but a host program may, so when the locale's
 * decimal point is not '.', the '.' is replaced by it first. */
static double c_strtod(const char *s, size_t n) {
    const char *dp = localeconv()->decimal_point;
    size_t dpl = dp ? strlen(dp) : 0;
    if (dpl == 0 || (dpl == 1 && dp[0] == '.')) dp = ".", dpl = 1;
    char small[96], *buf = small;
    if (n + dpl + 1 > sizeof small && !(buf = malloc(n + dpl + 1))) return NAN;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '.') {
            memcpy(buf + k, dp, dpl);
            k += dpl;
        } else {
            buf[k++] = s[i];
        }
    }
    buf[k] = '\0';
    double d = strtod(buf, NULL);
    if (buf != small) free(buf);
    return d;
}

/* ---- DOM allocation ---- */

static loom_json *new_node(loom_ctx *ctx, loom_json_type t) {
    loom_json *v = loom_calloc(ctx, 1, sizeof *v, "a JSON value");
    if (v) v->type = t;
    return v;
}

/* Makes room for one more item (and key and order slot for objects). */
static bool reserve_one(loom_ctx *ctx, loom_json *c) {
    if (c->n < c->cap) return true;
    size_t cap = c->cap ? c->cap * 2 : 4, bytes;
    if (!loom_mul_ok(cap, sizeof(size_t), &bytes) || !loom_mul_ok(cap, sizeof(void *), &bytes)) {
        loom_errf(ctx, LOOM_ERR_OOM, "JSON container too large (%zu items)", c->n);
        return false;
    }
    loom_json **items = loom_realloc(ctx, c->items, cap * sizeof *items, "JSON items");
    if (!items) return false;
    c->items = items;
    if (c->type == LOOM_JSON_OBJECT) {
        char **keys = loom_realloc(ctx, c->keys, cap * sizeof *keys, "JSON keys");
        if (!keys) return false;
        c->keys = keys;
        size_t *order = loom_realloc(ctx, c->order, cap * sizeof *order, "JSON key order");
        if (!order) return false;
        c->order = order;
    }
    c->cap = cap;
    return true;
}

void loom_json_free(loom_json *v) {
    if (!v) return;
    for (size_t k = 0; k < v->n; k++) {
        loom_json_free(v->items[k]);
        if (v->keys) free(v->keys[k]);
    }
    free(v->items);
    free(v->keys);
    free(v->order);
    free(v->s);
    free(v);
}

/* Stable merge sort of idx[0..n) by keys[idx[.]]; tmp holds n/2 entries. */
static void sort_by_key(char *const *keys, size_t *idx, size_t *tmp, size_t n) {
    if (n <= 8) {
        for (size_t i = 1; i < n; i++) {
            size_t x = idx[i], j = i;
            for (; j > 0 && strcmp(keys[idx[j - 1]], keys[x]) > 0; j--) idx[j] = idx[j - 1];
            idx[j] = x;
        }
        return;
    }
    size_t h = n / 2;
    sort_by_key(keys, idx, tmp, h);
    sort_by_key(keys, idx + h, tmp, n - h);
    if (strcmp(keys[idx[h - 1]], keys[idx[h]]) <= 0) return; /* already in order */
    memcpy(tmp, idx, h * sizeof *tmp);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) idx[k++] = strcmp(keys[tmp[i]], keys[idx[j]]) <= 0 ? tmp[i++] : idx[j++];
    while (i < h) idx[k++] = tmp[i++];
}

/* Position in obj->order of the first key >= key; *found says whether equal. */
static size_t lower_bound(const loom_json *obj, const char *key, bool *found) {
    size_t lo = 0, hi = obj->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (strcmp(obj->keys[obj->order[mid]], key) < 0) lo = mid + 1;
        else hi = mid;
    }
    *found = lo < obj->n && strcmp(obj->keys[obj->order[lo]], key) == 0;
    return lo;
}

/* ---- parser ---- */

typedef struct parser {
    loom_ctx *ctx;
    const uint8_t *t;
    size_t len, pos;
    const char *what;
} parser;

static void line_col(const uint8_t *t, size_t pos, size_t *line, size_t *col) {
    size_t l = 1, c = 1;
    for (size_t i = 0; i < pos; i++) {
        if (t[i] == '\n') l++, c = 1;
        else if ((t[i] & 0xC0) != 0x80) c++; /* columns count characters */
    }
    *line = l;
    *col = c;
}

static loom_status perr(parser *p, size_t pos, const char *fmt, ...) LOOM_PRINTF(3, 4);
static loom_status perr(parser *p, size_t pos, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t line, col;
    line_col(p->t, pos, &line, &col);
    return loom_errf(p->ctx, LOOM_ERR_FORMAT, "%s: line %zu, column %zu: %s", p->what, line, col,
                     msg);
}

/* An allocation failed (loom_malloc set the message): name the source. */
static loom_status poom(parser *p) {
    if (!p->ctx) return LOOM_ERR_OOM;
    return loom_err_prefix(p->ctx, "%s", p->what);
}

static void skip_ws(parser *p) {
    while (p->pos < p->len) {
        uint8_t c = p->t[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static bool starts_with(const parser *p, size_t pos, const char *lit) {
    size_t n = strlen(lit);
    return p->len - pos >= n && memcmp(p->t + pos, lit, n) == 0;
}

static loom_status parse_value(parser *p, int depth, loom_json **out);

static int hex4(const uint8_t *s) {
    int v = 0;
    for (int k = 0; k < 4; k++) {
        uint8_t c = s[k];
        uint8_t l = c | 0x20;
        int d = is_digit(c) ? c - '0' : l >= 'a' && l <= 'f' ? l - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

static loom_status utf8_error(parser *p, size_t pos, int code, uint32_t cp) {
    switch (code) {
    case U8_TRUNC:
        return perr(p, pos, "invalid UTF-8 in string: truncated sequence (lead byte 0x%02x)",
                    p->t[pos]);
    case U8_OVERLONG:
        return perr(p, pos, "invalid UTF-8 in string: overlong encoding (lead byte 0x%02x)",
                    p->t[pos]);
    case U8_SURROGATE:
        return perr(p, pos, "invalid UTF-8 in string: encoded surrogate U+%04" PRIX32, cp);
    case U8_RANGE: return perr(p, pos, "invalid UTF-8 in string: code point above U+10FFFF");
    default:
        return perr(p, pos, "invalid UTF-8 byte 0x%02x in string%s", p->t[pos],
                    p->t[pos] < 0xC0 ? " (unexpected continuation byte)" : "");
    }
}

/* Decodes the escape at t[i] (a backslash) into out; end is the closing
 * quote. Sets *used to the input bytes consumed, *outn to the bytes written. */
static loom_status parse_escape(parser *p, size_t i, size_t end, char *out, size_t *used,
                                size_t *outn) {
    const uint8_t *t = p->t;
    uint8_t e = t[i + 1]; /* exists: the first pass skipped it */
    static const char simple[] = "\"\"\\\\//b\bf\fn\nr\rt\t";
    for (const char *s = simple; *s; s += 2) {
        if (e == (uint8_t)s[0]) {
            out[0] = s[1];
            *used = 2;
            *outn = 1;
            return LOOM_OK;
        }
    }
    if (e != 'u' && e > 0x20 && e < 0x7f) return perr(p, i, "invalid escape '\\%c' in string", e);
    if (e != 'u') return perr(p, i, "invalid escape in string: '\\' followed by byte 0x%02x", e);
    int hi = end - i >= 6 ? hex4(t + i + 2) : -1;
    if (hi < 0) return perr(p, i, "invalid \\u escape in string (expected 4 hex digits)");
    uint32_t cp = (uint32_t)hi;
    *used = 6;
    if (cp >= 0xDC00 && cp <= 0xDFFF)
        return perr(p, i, "lone low surrogate \\u%.4s in string", (const char *)t + i + 2);
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        int lo = end - i >= 12 && t[i + 6] == '\\' && t[i + 7] == 'u' ? hex4(t + i + 8) : -1;
        if (lo < 0xDC00 || lo > 0xDFFF)
            return perr(p, i, "lone surrogate \\u%.4s in string (not followed by a low "
                        "surrogate \\uDC00-\\uDFFF)", (const char *)t + i + 2);
        cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
        *used = 12;
    }
    *outn = utf8_put(out, cp);
    return LOOM_OK;
}

/* Parses the string starting at the quote at p->pos into a new buffer. */
static loom_status parse_string(parser *p, char **out, size_t *outlen) {
    const uint8_t *t = p->t;
    size_t open = p->pos, i = open + 1;
    bool plain = true; /* printable ASCII only, no escapes: copy as is */
    while (i < p->len && t[i] != '"') {
        if (t[i] == '\\') plain = false, i++;
        else if (t[i] < 0x20 || t[i] >= 0x80) plain = false;
        i++;
    }
    if (i >= p->len) return perr(p, open, "unterminated string (unexpected end of input)");
    size_t end = i, n = 0;
    char *s = loom_malloc(p->ctx, end - open, "a JSON string");
    if (!s) return poom(p);
    if (plain) {
        n = end - open - 1;
        memcpy(s, t + open + 1, n);
    }
    for (i = open + 1; !plain && i < end;) {
        uint8_t c = t[i];
        loom_status st = LOOM_OK;
        if (c == '\\') {
            size_t used = 0, w = 0;
            st = parse_escape(p, i, end, s + n, &used, &w);
            i += used;
            n += w;
        } else if (c < 0x20) {
            st = perr(p, i, "control character 0x%02x in string (must be escaped)", c);
        } else if (c < 0x80) {
            s[n++] = (char)c;
            i++;
        } else {
            uint32_t cp = 0;
            int k = utf8_seq(t + i, end - i, &cp);
            if (k < 0) {
                st = utf8_error(p, i, k, cp);
            } else {
                memcpy(s + n, t + i, (size_t)k);
                n += (size_t)k;
                i += (size_t)k;
            }
        }
        if (st != LOOM_OK) {
            free(s);
            return st;
        }
    }
    s[n] = '\0';
    p->pos = end + 1;
    *out = s;
    *outlen = n;
    return LOOM_OK;
}

static loom_status parse_number(parser *p, loom_json **out) {
    const uint8_t *t = p->t;
    size_t start = p->pos, i = start, len = p->len;
    bool neg = false, is_int = true, overflow = false;
    uint64_t mag = 0;
    if (t[i] == '-') neg = true, i++;
    if (i >= len || !is_digit(t[i])) {
        if (starts_with(p, i, "Infinity")) return perr(p, start, "-Infinity is not valid JSON");
        return perr(p, i, "expected a digit after '-'");
    }
    if (t[i] == '0') {
        i++;
        if (i < len && is_digit(t[i]))
            return perr(p, i - 1, "leading zeros are not allowed in numbers");
    } else {
        for (; i < len && is_digit(t[i]); i++) {
            unsigned d = t[i] - '0';
            if (mag > (UINT64_MAX - d) / 10) overflow = true;
            else mag = mag * 10 + d;
        }
    }
    if (i < len && t[i] == '.') {
        is_int = false;
        if (++i >= len || !is_digit(t[i])) return perr(p, i, "expected a digit after '.'");
        while (i < len && is_digit(t[i])) i++;
    }
    if (i < len && (t[i] == 'e' || t[i] == 'E')) {
        is_int = false;
        if (++i < len && (t[i] == '+' || t[i] == '-')) i++;
        if (i >= len || !is_digit(t[i])) return perr(p, i, "expected a digit in the exponent");
        while (i < len && is_digit(t[i])) i++;
    }
    loom_json *v = new_node(p->ctx, LOOM_JSON_NUMBER);
    if (!v) return poom(p);
    const uint64_t lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    if (is_int && !overflow && mag <= lim) {
        v->is_int = true;
        v->i = mag == (uint64_t)INT64_MAX + 1 ? INT64_MIN : neg ? -(int64_t)mag : (int64_t)mag;
    }
    if (v->is_int && mag <= (1ull << 53)) {
        v->d = neg ? -(double)mag : (double)mag; /* exact ("-0" gives -0.0) */
    } else {
        v->d = c_strtod((const char *)t + start, i - start);
        if (isnan(v->d)) {
            free(v);
            return perr(p, start, "out of memory reading a number");
        }
        if (isinf(v->d)) {
            free(v);
            size_t n = i - start;
            return perr(p, start, "number %.*s%s is out of range for a double",
                        n > 40 ? 40 : (int)n, (const char *)t + start, n > 40 ? "..." : "");
        }
    }
    p->pos = i;
    *out = v;
    return LOOM_OK;
}

/* Error for end of input inside a container opened at `open`. */
static loom_status eof_in(parser *p, size_t open) {
    size_t line, col;
    line_col(p->t, open, &line, &col);
    return perr(p, p->len, "unexpected end of input (unclosed '%c' from line %zu, column %zu)",
                p->t[open], line, col);
}

static loom_status parse_array(parser *p, int depth, loom_json **out) {
    size_t open = p->pos;
    loom_json *a = new_node(p->ctx, LOOM_JSON_ARRAY);
    if (!a) return poom(p);
    loom_status st = LOOM_OK;
    char cb[24];
    p->pos++;
    skip_ws(p);
    if (p->pos >= p->len) {
        loom_json_free(a);
        return eof_in(p, open);
    }
    if (p->t[p->pos] == ']') {
        p->pos++;
        *out = a;
        return LOOM_OK;
    }
    for (;;) {
        loom_json *item;
        if ((st = parse_value(p, depth, &item)) != LOOM_OK) goto fail;
        if (!reserve_one(p->ctx, a)) {
            loom_json_free(item);
            st = poom(p);
            goto fail;
        }
        a->items[a->n++] = item;
        skip_ws(p);
        if (p->pos >= p->len) {
            st = eof_in(p, open);
            goto fail;
        }
        uint8_t c = p->t[p->pos];
        if (c == ']') break;
        if (c != ',') {
            st = perr(p, p->pos, "expected ',' or ']' after array element, got %s",
                      fmt_char(cb, p->t, p->len, p->pos));
            goto fail;
        }
        size_t comma = p->pos++;
        skip_ws(p);
        if (p->pos < p->len && p->t[p->pos] == ']') {
            st = perr(p, comma, "trailing comma before ']'");
            goto fail;
        }
    }
    p->pos++;
    *out = a;
    return LOOM_OK;
fail:
    loom_json_free(a);
    return st;
}

/* Called when an object closes: order (holding key offsets) becomes the
 * indices sorted by key; the earliest duplicate key in file order is an error. */
static loom_status finish_object(parser *p, loom_json *o) {
    size_t n = o->n;
    if (n == 0) return LOOM_OK;
    size_t small[48], *idx = small;
    if (n > sizeof small / sizeof *small / 2 &&
        !(idx = loom_calloc(p->ctx, n, 2 * sizeof *idx, "JSON key order")))
        return poom(p);
    for (size_t k = 0; k < n; k++) idx[k] = k;
    sort_by_key(o->keys, idx, idx + n, n);
    size_t dup = SIZE_MAX;
    for (size_t k = 1; k < n; k++) {
        if (idx[k] < dup && strcmp(o->keys[idx[k - 1]], o->keys[idx[k]]) == 0) dup = idx[k];
    }
    loom_status st = LOOM_OK;
    if (dup != SIZE_MAX) {
        char kb[KEYBUF];
        st = perr(p, o->order[dup], "duplicate key \"%s\"", fmt_key(kb, o->keys[dup]));
    } else {
        memcpy(o->order, idx, n * sizeof *idx);
    }
    if (idx != small) free(idx);
    return st;
}

static loom_status parse_object(parser *p, int depth, loom_json **out) {
    size_t open = p->pos;
    loom_json *o = new_node(p->ctx, LOOM_JSON_OBJECT);
    if (!o) return poom(p);
    loom_status st = LOOM_OK;
    char cb[24];
    p->pos++;
    skip_ws(p);
    bool first = true;
    for (;;) {
        if (p->pos >= p->len) {
            st = eof_in(p, open);
            goto fail;
        }
        if (first && p->t[p->pos] == '}') break;
        if (p->t[p->pos] != '"') {
            st = perr(p, p->pos, "expected a string key in object, got %s",
                      fmt_char(cb, p->t, p->len, p->pos));
            goto fail;
        }
        first = false;
        size_t kpos = p->pos, klen;
        char *key;
        if ((st = parse_string(p, &key, &klen)) != LOOM_OK) goto fail;
        if (strlen(key) != klen) {
            free(key);
            st = perr(p, kpos, "object key contains \\u0000 (not supported)");
            goto fail;
        }
        skip_ws(p);
        if (p->pos >= p->len || p->t[p->pos] != ':') {
            free(key);
            st = p->pos >= p->len ? eof_in(p, open)
                                  : perr(p, p->pos, "expected ':' after object key, got %s",
                                         fmt_char(cb, p->t, p->len, p->pos));
            goto fail;
        }
        p->pos++;
        loom_json *item;
        if ((st = parse_value(p, depth, &item)) != LOOM_OK) {
            free(key);
            goto fail;
        }
        if (!reserve_one(p->ctx, o)) {
            free(key);
            loom_json_free(item);
            st = poom(p);
            goto fail;
        }
        o->keys[o->n] = key;
        o->order[o->n] = kpos; /* key offset until finish_object */
        o->items[o->n++] = item;
        skip_ws(p);
        if (p->pos >= p->len) {
            st = eof_in(p, open);
            goto fail;
        }
        uint8_t c = p->t[p->pos];
        if (c == '}') break;
        if (c != ',') {
            st = perr(p, p->pos, "expected ',' or '}' after object member, got %s",
                      fmt_char(cb, p->t, p->len, p->pos));
            goto fail;
        }
        size_t comma = p->pos++;
        skip_ws(p);
        if (p->pos < p->len && p->t[p->pos] == '}') {
            st = perr(p, comma, "trailing comma before '}'");
            goto fail;
        }
    }
    p->pos++;
    if ((st = finish_object(p, o)) != LOOM_OK) goto fail;
    *out = o;
    return LOOM_OK;
fail:
    loom_json_free(o);
    return st;
}

static loom_status parse_literal(parser *p, const char *lit, loom_json_type t, bool b,
                                 loom_json **out) {
    if (!starts_with(p, p->pos, lit))
        return perr(p, p->pos, "invalid literal (expected '%s')", lit);
    loom_json *v = new_node(p->ctx, t);
    if (!v) return poom(p);
    v->b = b;
    p->pos += strlen(lit);
    *out = v;
    return LOOM_OK;
}

static loom_status parse_value(parser *p, int depth, loom_json **out) {
    char cb[24];
    skip_ws(p);
    if (p->pos >= p->len) return perr(p, p->pos, "unexpected end of input (expected a value)");
    uint8_t c = p->t[p->pos];
    if ((c == '{' || c == '[') && depth >= LOOM_JSON_MAX_DEPTH)
        return perr(p, p->pos, "nesting deeper than %d", LOOM_JSON_MAX_DEPTH);
    switch (c) {
    case '{': return parse_object(p, depth + 1, out);
    case '[': return parse_array(p, depth + 1, out);
    case 't': return parse_literal(p, "true", LOOM_JSON_BOOL, true, out);
    case 'f': return parse_literal(p, "false", LOOM_JSON_BOOL, false, out);
    case 'n': return parse_literal(p, "null", LOOM_JSON_NULL, false, out);
    case '"': {
        loom_json *v = new_node(p->ctx, LOOM_JSON_STRING);
        if (!v) return poom(p);
        loom_status st = parse_string(p, &v->s, &v->slen);
        if (st != LOOM_OK) {
            free(v);
            return st;
        }
        *out = v;
        return LOOM_OK;
    }
    case '+': return perr(p, p->pos, "'+' is not allowed before a number");
    case '.': return perr(p, p->pos, "a number needs a digit before '.'");
    default:
        if (c == '-' || is_digit(c)) return parse_number(p, out);
        if (starts_with(p, p->pos, "NaN") || starts_with(p, p->pos, "Infinity"))
            return perr(p, p->pos, "NaN and Infinity are not valid JSON");
        return perr(p, p->pos, "unexpected %s (expected a value)",
                    fmt_char(cb, p->t, p->len, p->pos));
    }
}

loom_status loom_json_parse(loom_ctx *ctx, const char *text, size_t len, const char *what,
                            loom_json **out) {
    if (!out || (!text && len))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_json_parse: NULL argument");
    *out = NULL;
    parser p = {ctx, (const uint8_t *)(text ? text : ""), len, 0, what ? what : "JSON"};
    skip_ws(&p);
    if (p.pos >= p.len) return perr(&p, p.pos, "empty input (expected a JSON value)");
    loom_json *v;
    loom_status st = parse_value(&p, 0, &v);
    if (st != LOOM_OK) return st;
    skip_ws(&p);
    if (p.pos < p.len) {
        char cb[24];
        loom_json_free(v);
        return perr(&p, p.pos, "unexpected %s after the JSON value",
                    fmt_char(cb, p.t, p.len, p.pos));
    }
    *out = v;
    return LOOM_OK;
}

loom_status loom_json_parse_file(loom_ctx *ctx, const char *path, loom_json **out) {
    char *data;
    size_t len;
    if (out) *out = NULL;
    loom_status st = loom_read_file(ctx, path, FILE_LIMIT, &data, &len);
    if (st != LOOM_OK) return st;
    st = loom_json_parse(ctx, data, len, path, out);
    free(data);
    return st;
}

/* ---- lookup and typed getters ---- */

const loom_json *loom_json_get(const loom_json *obj, const char *key) {
    if (!obj || obj->type != LOOM_JSON_OBJECT || !key) return NULL;
    bool found;
    size_t pos = lower_bound(obj, key, &found);
    return found ? obj->items[obj->order[pos]] : NULL;
}

const loom_json *loom_json_at(const loom_json *arr, size_t i) {
    if (!arr || arr->type != LOOM_JSON_ARRAY || i >= arr->n) return NULL;
    return arr->items[i];
}

const char *loom_json_type_name(loom_json_type t) {
    switch (t) {
    case LOOM_JSON_NULL: return "null";
    case LOOM_JSON_BOOL: return "boolean";
    case LOOM_JSON_NUMBER: return "number";
    case LOOM_JSON_STRING: return "string";
    case LOOM_JSON_ARRAY: return "array";
    case LOOM_JSON_OBJECT: return "object";
    }
    return "unknown";
}

/* Finds obj[key]; absent or null is LOOM_ERR_NOT_FOUND when required, else
 * LOOM_OK with *v = NULL. */
static loom_status lookup(loom_ctx *ctx, const loom_json *obj, const char *key, const char *what,
                          bool required, const loom_json **v) {
    const loom_json *x = loom_json_get(obj, key);
    *v = NULL;
    if (x && x->type != LOOM_JSON_NULL) {
        *v = x;
        return LOOM_OK;
    }
    if (!required) return LOOM_OK;
    char kb[KEYBUF];
    return loom_errf(ctx, LOOM_ERR_NOT_FOUND, "%s: missing required field '%s'",
                     what ? what : "JSON", fmt_key(kb, key));
}

static loom_status type_error(loom_ctx *ctx, const char *key, const char *what, const char *want,
                              const loom_json *v) {
    char kb[KEYBUF], nb[32];
    const char *got = loom_json_type_name(v->type);
    if (v->type == LOOM_JSON_NUMBER && !strcmp(want, "an integer")) {
        loom_sb sb;
        loom_sb_init(&sb);
        loom_json_write_double(&sb, v->d);
        snprintf(nb, sizeof nb, "%s", sb.failed ? "a non-integer number" : sb.buf);
        loom_sb_free(&sb);
        got = nb;
    }
    return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' must be %s, got %s", what ? what : "JSON",
                     fmt_key(kb, key), want, got);
}

static loom_status get_int(loom_ctx *ctx, const loom_json *obj, const char *key, const char *what,
                           int64_t *out, bool required) {
    const loom_json *v;
    loom_status st = lookup(ctx, obj, key, what, required, &v);
    if (st != LOOM_OK || !v) return st;
    if (v->type != LOOM_JSON_NUMBER || !v->is_int)
        return type_error(ctx, key, what, "an integer", v);
    *out = v->i;
    return LOOM_OK;
}

static loom_status get_num(loom_ctx *ctx, const loom_json *obj, const char *key, const char *what,
                           double *out, bool required) {
    const loom_json *v;
    loom_status st = lookup(ctx, obj, key, what, required, &v);
    if (st != LOOM_OK || !v) return st;
    if (v->type != LOOM_JSON_NUMBER) return type_error(ctx, key, what, "a number", v);
    *out = v->d;
    return LOOM_OK;
}

static loom_status get_bool(loom_ctx *ctx, const loom_json *obj, const char *key, const char *what,
                            bool *out, bool required) {
    const loom_json *v;
    loom_status st = lookup(ctx, obj, key, what, required, &v);
    if (st != LOOM_OK || !v) return st;
    if (v->type != LOOM_JSON_BOOL) return type_error(ctx, key, what, "a boolean", v);
    *out = v->b;
    return LOOM_OK;
}

static loom_status get_str(loom_ctx *ctx, const loom_json *obj, const char *key, const char *what,
                           const char **out, bool required) {
    const loom_json *v;
    loom_status st = lookup(ctx, obj, key, what, required, &v);
    if (st != LOOM_OK || !v) return st;
    if (v->type != LOOM_JSON_STRING) return type_error(ctx, key, what, "a string", v);
    if (strlen(v->s) != v->slen) {
        char kb[KEYBUF];
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' must be a string without \\u0000",
                         what ? what : "JSON", fmt_key(kb, key));
    }
    *out = v->s;
    return LOOM_OK;
}

#define GETTERS(name, type)                                                                     \
    loom_status loom_json_##name(loom_ctx *ctx, const loom_json *obj, const char *key,          \
                                 const char *what, type *out) {                                 \
        return name(ctx, obj, key, what, out, true);                                            \
    }                                                                                           \
    loom_status loom_json_##name##_opt(loom_ctx *ctx, const loom_json *obj, const char *key,    \
                                       const char *what, type *out) {                           \
        return name(ctx, obj, key, what, out, false);                                           \
    }
GETTERS(get_int, int64_t)
GETTERS(get_num, double)
GETTERS(get_bool, bool)
GETTERS(get_str, const char *)

/* ---- building ---- */

loom_json *loom_json_new_null(loom_ctx *ctx) { return new_node(ctx, LOOM_JSON_NULL); }
loom_json *loom_json_new_array(loom_ctx *ctx) { return new_node(ctx, LOOM_JSON_ARRAY); }
loom_json *loom_json_new_object(loom_ctx *ctx) { return new_node(ctx, LOOM_JSON_OBJECT); }

loom_json *loom_json_new_bool(loom_ctx *ctx, bool b) {
    loom_json *v = new_node(ctx, LOOM_JSON_BOOL);
    if (v) v->b = b;
    return v;
}

loom_json *loom_json_new_int(loom_ctx *ctx, int64_t i) {
    loom_json *v = new_node(ctx, LOOM_JSON_NUMBER);
    if (v) v->is_int = true, v->i = i, v->d = (double)i;
    return v;
}

loom_json *loom_json_new_num(loom_ctx *ctx, double d) {
    loom_json *v = new_node(ctx, LOOM_JSON_NUMBER);
    if (v) v->d = d;
    return v;
}

static loom_json *new_strn(loom_ctx *ctx, const char *s, size_t n) {
    loom_json *v = new_node(ctx, LOOM_JSON_STRING);
    if (v && !(v->s = loom_strndup(ctx, s, n))) {
        free(v);
        return NULL;
    }
    if (v) v->slen = n;
    return v;
}

loom_json *loom_json_new_str(loom_ctx *ctx, const char *s) {
    if (!s) {
        loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_json_new_str: NULL string");
        return NULL;
    }
    return new_strn(ctx, s, strlen(s));
}

loom_json *loom_json_clone(loom_ctx *ctx, const loom_json *v) {
    if (!v) {
        loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_json_clone: NULL value");
        return NULL;
    }
    if (v->type == LOOM_JSON_STRING) return new_strn(ctx, v->s, v->slen);
    loom_json *c = new_node(ctx, v->type);
    if (!c) return NULL;
    c->b = v->b;
    c->is_int = v->is_int;
    c->i = v->i;
    c->d = v->d;
    if (v->type != LOOM_JSON_ARRAY && v->type != LOOM_JSON_OBJECT) return c;
    bool obj = v->type == LOOM_JSON_OBJECT;
    if (v->n) {
        c->items = loom_calloc(ctx, v->n, sizeof *c->items, "JSON items");
        if (c->items && obj) {
            c->keys = loom_calloc(ctx, v->n, sizeof *c->keys, "JSON keys");
            c->order = loom_calloc(ctx, v->n, sizeof *c->order, "JSON key order");
        }
        if (!c->items || (obj && (!c->keys || !c->order))) goto fail;
        c->cap = v->n;
        if (obj) memcpy(c->order, v->order, v->n * sizeof *c->order);
    }
    for (size_t k = 0; k < v->n; k++) {
        if (obj && !(c->keys[k] = loom_strdup(ctx, v->keys[k]))) goto fail;
        if (!(c->items[k] = loom_json_clone(ctx, v->items[k]))) {
            if (obj) free(c->keys[k]);
            goto fail;
        }
        c->n = k + 1;
    }
    return c;
fail:
    loom_json_free(c);
    return NULL;
}

loom_status loom_json_push(loom_ctx *ctx, loom_json *arr, loom_json *item) {
    if (!arr || arr->type != LOOM_JSON_ARRAY || !item) {
        loom_json_free(item);
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_json_push: not an array or no item");
    }
    if (!reserve_one(ctx, arr)) {
        loom_json_free(item);
        return LOOM_ERR_OOM;
    }
    arr->items[arr->n++] = item;
    return LOOM_OK;
}

loom_status loom_json_set(loom_ctx *ctx, loom_json *obj, const char *key, loom_json *item) {
    if (!obj || obj->type != LOOM_JSON_OBJECT || !key || !item) {
        loom_json_free(item);
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loom_json_set: not an object, or no key or item");
    }
    bool found;
    size_t pos = lower_bound(obj, key, &found);
    if (found) {
        size_t idx = obj->order[pos];
        loom_json_free(obj->items[idx]);
        obj->items[idx] = item;
        return LOOM_OK;
    }
    char *k = loom_strdup(ctx, key);
    if (!k || !reserve_one(ctx, obj)) {
        free(k);
        loom_json_free(item);
        return LOOM_ERR_OOM;
    }
    memmove(obj->order + pos + 1, obj->order + pos, (obj->n - pos) * sizeof *obj->order);
    obj->order[pos] = obj->n;
    obj->keys[obj->n] = k;
    obj->items[obj->n++] = item;
    return LOOM_OK;
}

bool loom_json_remove(loom_json *obj, const char *key) {
    if (!obj || obj->type != LOOM_JSON_OBJECT || !key) return false;
    bool found;
    size_t pos = lower_bound(obj, key, &found);
    if (!found) return false;
    size_t idx = obj->order[pos], n = obj->n;
    loom_json_free(obj->items[idx]);
    free(obj->keys[idx]);
    memmove(obj->items + idx, obj->items + idx + 1, (n - idx - 1) * sizeof *obj->items);
    memmove(obj->keys + idx, obj->keys + idx + 1, (n - idx - 1) * sizeof *obj->keys);
    memmove(obj->order + pos, obj->order + pos + 1, (n - pos - 1) * sizeof *obj->order);
    obj->n = n - 1;
    for (size_t k = 0; k < obj->n; k++)
        if (obj->order[k] > idx) obj->order[k]--;
    return true;
}
