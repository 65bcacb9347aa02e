/* JSON out (json.h): strings escaped, doubles in their shortest
 * round-tripping digits laid out like Python's repr(), indented or compact. */
#include "json.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static bool is_digit(uint8_t c) { return c >= '0' && c <= '9'; }

/* ---- writer ---- */

void loom_json_write_string(loom_sb *out, const char *s, size_t len) {
    static const char hex[] = "0123456789abcdef";
    loom_sb_putc(out, '"');
    size_t run = 0; /* start of the pending run of bytes that need no escape */
    for (size_t i = 0; i < len; i++) {
        uint8_t c = (uint8_t)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        loom_sb_append(out, s + run, i - run);
        run = i + 1;
        char e[7] = {'\\', 0};
        switch (c) {
        case '"': e[1] = '"'; break;
        case '\\': e[1] = '\\'; break;
        case '\n': e[1] = 'n'; break;
        case '\t': e[1] = 't'; break;
        case '\r': e[1] = 'r'; break;
        case '\b': e[1] = 'b'; break;
        case '\f': e[1] = 'f'; break;
        default:
            memcpy(e + 1, "u00", 3);
            e[4] = hex[c >> 4];
            e[5] = hex[c & 15];
        }
        loom_sb_append(out, e, strlen(e));
    }
    loom_sb_append(out, s + run, len - run);
    loom_sb_putc(out, '"');
}

/* Shortest round-tripping digits of d, laid out like Python's repr():
 * fixed notation for exponents in [-4, 16), else d.ddde+XX. */
static void fmt_double(char buf[40], double d) {
    if (d == 0) {
        strcpy(buf, signbit(d) ? "-0.0" : "0.0");
        return;
    }
    /* 15 significant digits always read back for normal doubles when the
     * shortest form has <= 15; subnormals carry fewer, so search from 1 */
    char e[48];
    for (int prec = fabs(d) < DBL_MIN ? 1 : 15; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, d);
        if (prec == 17 || strtod(e, NULL) == d) break; /* same locale both ways */
    }
    /* split "-d.ddde+XX" (the decimal point may be the locale's) */
    char dig[24];
    int nd = 0, exp10 = 0;
    const char *q = e + (e[0] == '-');
    for (; *q && *q != 'e'; q++)
        if (is_digit((uint8_t)*q) && nd < 20) dig[nd++] = *q;
    if (*q == 'e') exp10 = atoi(q + 1);
    while (nd > 1 && dig[nd - 1] == '0') nd--;
    char *o = buf;
    if (d < 0) *o++ = '-';
    if (exp10 >= 16 || exp10 < -4) {
        *o++ = dig[0];
        if (nd > 1) {
            *o++ = '.';
            memcpy(o, dig + 1, (size_t)nd - 1);
            o += nd - 1;
        }
        snprintf(o, 16, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
        return;
    }
    if (exp10 < 0) {
        memcpy(o, "0.", 2);
        o += 2;
        for (int k = 0; k < -exp10 - 1; k++) *o++ = '0';
        memcpy(o, dig, (size_t)nd);
        o += nd;
    } else {
        for (int k = 0; k <= exp10; k++) *o++ = k < nd ? dig[k] : '0';
        *o++ = '.';
        if (nd > exp10 + 1) {
            memcpy(o, dig + exp10 + 1, (size_t)(nd - exp10 - 1));
            o += nd - exp10 - 1;
        } else {
            *o++ = '0';
        }
    }
    *o = '\0';
}

void loom_json_write_double(loom_sb *out, double d) {
    if (!isfinite(d)) { /* not representable: keep the output valid JSON */
        loom_sb_puts(out, "null");
        return;
    }
    char buf[40];
    fmt_double(buf, d);
    loom_sb_puts(out, buf);
}

static void newline(loom_sb *out, int indent, int level) {
    loom_sb_putc(out, '\n');
    for (long k = 0; k < (long)indent * level; k++) loom_sb_putc(out, ' ');
}

static loom_status write_value(loom_ctx *ctx, const loom_json *v, int indent, int level,
                               loom_sb *out) {
    if (!v) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "JSON write: NULL value");
    switch (v->type) {
    case LOOM_JSON_NULL: loom_sb_puts(out, "null"); return LOOM_OK;
    case LOOM_JSON_BOOL: loom_sb_puts(out, v->b ? "true" : "false"); return LOOM_OK;
    case LOOM_JSON_NUMBER:
        if (v->is_int) {
            loom_sb_printf(out, "%" PRId64, v->i);
        } else {
            if (!isfinite(v->d))
                return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                                 "JSON write: cannot write %g (JSON has no NaN or Infinity)", v->d);
            loom_json_write_double(out, v->d);
        }
        return LOOM_OK;
    case LOOM_JSON_STRING:
        if (!v->s || !loom_utf8_valid(v->s, v->slen))
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "JSON write: string is not valid UTF-8");
        loom_json_write_string(out, v->s, v->slen);
        return LOOM_OK;
    case LOOM_JSON_ARRAY:
    case LOOM_JSON_OBJECT: break;
    default: return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "JSON write: bad value type %d", v->type);
    }
    bool obj = v->type == LOOM_JSON_OBJECT;
    if (level >= LOOM_JSON_MAX_DEPTH)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "JSON write: nesting deeper than %d",
                         LOOM_JSON_MAX_DEPTH);
    loom_sb_putc(out, obj ? '{' : '[');
    for (size_t k = 0; k < v->n; k++) {
        if (k) loom_sb_putc(out, ',');
        if (indent >= 0) newline(out, indent, level + 1);
        if (obj) {
            size_t kl = strlen(v->keys[k]);
            if (!loom_utf8_valid(v->keys[k], kl))
                return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "JSON write: key is not valid UTF-8");
            loom_json_write_string(out, v->keys[k], kl);
            loom_sb_puts(out, indent >= 0 ? ": " : ":");
        }
        loom_status st = write_value(ctx, v->items[k], indent, level + 1, out);
        if (st != LOOM_OK) return st;
    }
    if (indent >= 0 && v->n) newline(out, indent, level);
    loom_sb_putc(out, obj ? '}' : ']');
    return LOOM_OK;
}

loom_status loom_json_write(loom_ctx *ctx, const loom_json *v, int indent, loom_sb *out) {
    if (!out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "JSON write: NULL buffer");
    size_t start = out->len;
    loom_status st = write_value(ctx, v, indent, 0, out);
    if (st == LOOM_OK && out->failed) {
        st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory writing JSON (%zu bytes so far)",
                       out->len);
    }
    if (st != LOOM_OK && out->buf && !out->failed) { /* drop the partial output */
        out->len = start;
        out->buf[start] = '\0';
    }
    return st;
}
