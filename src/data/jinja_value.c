/* Jinja values: constructors, lists and dicts (insertion order), JSON in
 * and out (json.dumps as transformers' tojson calls it), and the parts of
 * Python's semantics jinja2 delegates to: truthiness, ==, ordering, str()
 * and repr(). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "jinja_impl.h"

jv jv_undef(const char *name) { return (jv){.t = JV_UNDEF, .name = name}; }
jv jv_none(void) { return (jv){.t = JV_NONE}; }
jv jv_bool(bool b) { return (jv){.t = JV_BOOL, .b = b}; }
jv jv_int(int64_t i) { return (jv){.t = JV_INT, .i = i}; }
jv jv_float(double f) { return (jv){.t = JV_FLOAT, .f = f}; }
jv jv_str(const char *p, size_t n) { return (jv){.t = JV_STR, .s = {p, n}}; }
jv jv_cstr(const char *p) { return jv_str(p, strlen(p)); }

jv jv_newlist(jr *r) {
    jv v = {.t = JV_LIST};
    v.l = ja_alloc(&r->arena, sizeof *v.l);
    return v;
}
jv jv_newdict(jr *r, jt t) {
    jv v = {.t = t};
    v.d = ja_alloc(&r->arena, sizeof *v.d);
    return v;
}

enum { MAX_NESTING = 200 };

/* Nesting depth a container gets by holding v (namespaces are mutable and
 * compared by identity: they do not count). */
static void hold(jr *r, int *depth, jv v) {
    int d = v.t == JV_LIST ? v.l->depth + 1 : v.t == JV_DICT ? v.d->depth + 1 : 0;
    if (d > MAX_NESTING)
        jr_fail(r, NULL, LOOM_ERR_FORMAT, "lists and dicts nested over %d deep", MAX_NESTING);
    if (d > *depth)
        *depth = d;
}

void jl_push(jr *r, jlist *l, jv v) {
    hold(r, &l->depth, v);
    l->v = ja_grow(&r->arena, l->v, l->n, &l->cap, sizeof *l->v);
    l->v[l->n++] = v;
}

const jv *jd_get(const jdict *d, jv k) {
    for (size_t i = 0; i < d->n; i++)
        if (jv_eq(d->k[i], k))
            return &d->v[i];
    return NULL;
}
const jv *jd_gets(const jdict *d, const char *k) {
    size_t n = strlen(k);
    for (size_t i = 0; i < d->n; i++)
        if (d->k[i].t == JV_STR && d->k[i].s.n == n && memcmp(d->k[i].s.p, k, n) == 0)
            return &d->v[i];
    return NULL;
}

void jd_set(jr *r, jdict *d, jv k, jv v) {
    hold(r, &d->depth, k);
    hold(r, &d->depth, v);
    jv *old = (jv *)jd_get(d, k);
    if (old) {
        *old = v;
        return;
    }
    size_t cap = d->cap;
    d->k = ja_grow(&r->arena, d->k, d->n, &cap, sizeof *d->k);
    d->v = ja_grow(&r->arena, d->v, d->n, &d->cap, sizeof *d->v);
    d->k[d->n] = k, d->v[d->n] = v;
    d->n++;
}

jv jv_from_json(jr *r, const loom_json *j) {
    switch (j->type) {
    case LOOM_JSON_NULL:
        return jv_none();
    case LOOM_JSON_BOOL:
        return jv_bool(j->b);
    case LOOM_JSON_NUMBER:
        return j->is_int ? jv_int(j->i) : jv_float(j->d);
    case LOOM_JSON_STRING:
        return jv_str(j->s, j->slen);
    case LOOM_JSON_ARRAY: {
        jv l = jv_newlist(r);
        for (size_t i = 0; i < j->n; i++)
            jl_push(r, l.l, jv_from_json(r, j->items[i]));
        return l;
    }
    case LOOM_JSON_OBJECT: {
        jv d = jv_newdict(r, JV_DICT);
        for (size_t i = 0; i < j->n; i++)
            jd_set(r, d.d, jv_cstr(j->keys[i]), jv_from_json(r, j->items[i]));
        return d;
    }
    }
    return jv_none();
}

bool jv_truthy(jv v) {
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE:
        return false;
    case JV_BOOL:
        return v.b;
    case JV_INT:
        return v.i != 0;
    case JV_FLOAT:
        return v.f != 0;
    case JV_STR:
        return v.s.n != 0;
    case JV_LIST:
        return v.l->n != 0;
    case JV_DICT:
        return v.d->n != 0;
    default:
        return true;
    }
}

static bool is_num(jv v) { return v.t == JV_BOOL || v.t == JV_INT || v.t == JV_FLOAT; }
static double num_d(jv v) {
    return v.t == JV_FLOAT ? v.f : v.t == JV_INT ? (double)v.i : (double)v.b;
}
static int64_t num_i(jv v) { return v.t == JV_INT ? v.i : v.b; }

bool jv_eq(jv a, jv b) {
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT)
            return num_i(a) == num_i(b);
        return num_d(a) == num_d(b);
    }
    if (a.t != b.t)
        return false;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE:
        return true;
    case JV_STR:
        return a.s.n == b.s.n && memcmp(a.s.p, b.s.p, a.s.n) == 0;
    case JV_LIST:
        if (a.tuple != b.tuple || a.l->n != b.l->n)
            return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!jv_eq(a.l->v[i], b.l->v[i]))
                return false;
        return true;
    case JV_DICT:
        if (a.d->n != b.d->n)
            return false;
        for (size_t i = 0; i < a.d->n; i++) {
            const jv *o = jd_get(b.d, a.d->k[i]);
            if (!o || !jv_eq(a.d->v[i], *o))
                return false;
        }
        return true;
    case JV_NS:
        return a.d == b.d;
    case JV_MACRO:
        return a.mac == b.mac;
    case JV_FUNC:
        return a.fn == b.fn;
    default:
        return false;
    }
}

const char *jv_typename(jv v) {
    static const char *const N[] = {"undefined", "NoneType", "bool",      "int",   "float",   "str",
                                    "list",      "dict",     "Namespace", "macro", "function"};
    if (v.t == JV_LIST && v.tuple)
        return "tuple";
    return N[v.t];
}

int jv_cmp(jr *r, const jnode *at, jv a, jv b) {
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT)
            return num_i(a) < num_i(b) ? -1 : num_i(a) > num_i(b);
        double x = num_d(a), y = num_d(b);
        return x < y ? -1 : x > y;
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t n = a.s.n < b.s.n ? a.s.n : b.s.n;
        int c = memcmp(a.s.p, b.s.p, n);
        if (c)
            return c < 0 ? -1 : 1;
        return a.s.n < b.s.n ? -1 : a.s.n > b.s.n;
    }
    if (a.t == JV_LIST && b.t == JV_LIST) {
        for (size_t i = 0; i < a.l->n && i < b.l->n; i++) {
            if (jv_eq(a.l->v[i], b.l->v[i]))
                continue;
            return jv_cmp(r, at, a.l->v[i], b.l->v[i]);
        }
        return a.l->n < b.l->n ? -1 : a.l->n > b.l->n;
    }
    if (a.t == JV_UNDEF || b.t == JV_UNDEF)
        jr_fail(r, at, LOOM_ERR_FORMAT, "'%s' is undefined",
                (a.t == JV_UNDEF ? a : b).name ? (a.t == JV_UNDEF ? a : b).name : "value");
    jr_fail(r, at, LOOM_ERR_FORMAT, "'<' not supported between instances of '%s' and '%s'",
            jv_typename(a), jv_typename(b));
}

/* ---------------------------------------------------------------------- */
/* Buffers, UTF-8                                                          */
/* ---------------------------------------------------------------------- */

void jb_put(jr *r, jbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = ja_alloc(&r->arena, cap);
        if (b->n)
            memcpy(p, b->p, b->n);
        b->p = p, b->cap = cap;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}
void jb_puts(jr *r, jbuf *b, const char *s) { jb_put(r, b, s, strlen(s)); }

size_t utf8_count(const char *p, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)p[i] & 0xC0) != 0x80)
            c++;
    return c;
}
size_t utf8_offset(const char *p, size_t n, size_t cp) {
    size_t i = 0;
    for (size_t c = 0; i < n; i++)
        if (((unsigned char)p[i] & 0xC0) != 0x80 && c++ == cp)
            return i;
    return n;
}

/* ---------------------------------------------------------------------- */
/* str(), repr()                                                           */
/* ---------------------------------------------------------------------- */

/* Python's repr(float): the shortest digits that read back to f. */
static void write_float(jr *r, jbuf *b, double f, bool json) {
    char buf[64];
    if (isnan(f))
        return jb_puts(r, b, json ? "NaN" : "nan");
    if (isinf(f))
        return jb_puts(r, b, f < 0 ? (json ? "-Infinity" : "-inf") : (json ? "Infinity" : "inf"));
    if (f == 0)
        return jb_puts(r, b, signbit(f) ? "-0.0" : "0.0");
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, f);
        if (strtod(buf, NULL) == f)
            break;
    }
    /* buf: [-]d.ddde[+-]XX */
    char digits[32];
    int nd = 0, exp10;
    const char *p = buf;
    bool neg = *p == '-';
    if (neg)
        p++;
    for (; *p && *p != 'e'; p++)
        if (*p != '.')
            digits[nd++] = *p;
    exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    char out[64];
    int o = 0;
    if (neg)
        out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[o++] = '0', out[o++] = '.';
            for (int k = 0; k < -exp10 - 1; k++)
                out[o++] = '0';
            for (int k = 0; k < nd; k++)
                out[o++] = digits[k];
        } else {
            for (int k = 0; k <= exp10; k++)
                out[o++] = k < nd ? digits[k] : '0';
            out[o++] = '.';
            if (nd > exp10 + 1)
                for (int k = exp10 + 1; k < nd; k++)
                    out[o++] = digits[k];
            else
                out[o++] = '0';
        }
        out[o] = 0;
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int k = 1; k < nd; k++)
                out[o++] = digits[k];
        }
        o +=
            snprintf(out + o, sizeof out - (size_t)o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    jb_put(r, b, out, (size_t)o);
}

static void write_repr_str(jr *r, jbuf *b, const char *s, size_t n) {
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    jb_put(r, b, &q, 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[8];
        if (c == '\\')
            jb_puts(r, b, "\\\\");
        else if (c == (unsigned char)q)
            jb_put(r, b, (const char[]){'\\', (char)q}, 2);
        else if (c == '\n')
            jb_puts(r, b, "\\n");
        else if (c == '\r')
            jb_puts(r, b, "\\r");
        else if (c == '\t')
            jb_puts(r, b, "\\t");
        else if (c < 0x20 || c == 0x7f) {
            snprintf(e, sizeof e, "\\x%02x", c);
            jb_puts(r, b, e);
        } else
            jb_put(r, b, (const char *)&c, 1);
    }
    jb_put(r, b, &q, 1);
}

static void write_str(jr *r, jbuf *b, jv v, bool repr, int depth);

void jv_write_str(jr *r, jbuf *b, jv v, bool repr) { write_str(r, b, v, repr, 0); }

static void write_str(jr *r, jbuf *b, jv v, bool repr, int depth) {
    char buf[32];
    if (depth > MAX_NESTING + 8)
        jr_fail(r, NULL, LOOM_ERR_FORMAT, "str(): namespaces nested over %d deep", MAX_NESTING);
    switch (v.t) {
    case JV_UNDEF:
        return;
    case JV_NONE:
        return jb_puts(r, b, "None");
    case JV_BOOL:
        return jb_puts(r, b, v.b ? "True" : "False");
    case JV_INT:
        snprintf(buf, sizeof buf, "%lld", (long long)v.i);
        return jb_puts(r, b, buf);
    case JV_FLOAT:
        return write_float(r, b, v.f, false);
    case JV_STR:
        if (repr)
            return write_repr_str(r, b, v.s.p, v.s.n);
        return jb_put(r, b, v.s.p, v.s.n);
    case JV_LIST:
        jb_puts(r, b, v.tuple ? "(" : "[");
        for (size_t i = 0; i < v.l->n; i++) {
            if (i)
                jb_puts(r, b, ", ");
            write_str(r, b, v.l->v[i], true, depth + 1);
        }
        if (v.tuple && v.l->n == 1)
            jb_puts(r, b, ",");
        return jb_puts(r, b, v.tuple ? ")" : "]");
    case JV_NS:
    case JV_DICT:
        jb_puts(r, b, v.t == JV_NS ? "<Namespace {" : "{");
        for (size_t i = 0; i < v.d->n; i++) {
            if (i)
                jb_puts(r, b, ", ");
            write_str(r, b, v.d->k[i], true, depth + 1);
            jb_puts(r, b, ": ");
            write_str(r, b, v.d->v[i], true, depth + 1);
        }
        return jb_puts(r, b, v.t == JV_NS ? "}>" : "}");
    case JV_MACRO:
        return jb_puts(r, b, "<Macro>");
    case JV_FUNC:
        return jb_puts(r, b, "<function>");
    }
}

jv jv_to_str(jr *r, jv v) {
    if (v.t == JV_STR)
        return v;
    jbuf b = {0};
    jv_write_str(r, &b, v, false);
    return jv_str(b.p ? b.p : "", b.n);
}

/* ---------------------------------------------------------------------- */
/* json.dumps(ensure_ascii=False)                                          */
/* ---------------------------------------------------------------------- */

static uint32_t decode_cp(const char *p, size_t n, size_t *len);

static void write_json_str(jr *r, jbuf *b, const char *s, size_t n, bool ascii) {
    jb_puts(r, b, "\"");
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *e = NULL;
        char u[8];
        if (c == '"')
            e = "\\\"";
        else if (c == '\\')
            e = "\\\\";
        else if (c == '\n')
            e = "\\n";
        else if (c == '\r')
            e = "\\r";
        else if (c == '\t')
            e = "\\t";
        else if (c == '\b')
            e = "\\b";
        else if (c == '\f')
            e = "\\f";
        else if (c < 0x20) {
            snprintf(u, sizeof u, "\\u%04x", c);
            e = u;
        }
        size_t k = 1;
        char w[16];
        if (!e && ascii && c >= 0x80) {
            uint32_t cp = decode_cp(s + i, n - i, &k);
            if (cp >= 0x10000)
                snprintf(w, sizeof w, "\\u%04x\\u%04x", 0xD800 + ((cp - 0x10000) >> 10),
                         0xDC00 + ((cp - 0x10000) & 0x3FF));
            else
                snprintf(w, sizeof w, "\\u%04x", cp);
            e = w;
        }
        if (!e)
            continue;
        jb_put(r, b, s + run, i - run);
        jb_puts(r, b, e);
        i += k - 1;
        run = i + 1;
    }
    jb_put(r, b, s + run, n - run);
    jb_puts(r, b, "\"");
}

static void newline_indent(jr *r, jbuf *b, int indent, int level) {
    jb_puts(r, b, "\n");
    for (int k = 0; k < indent * level; k++)
        jb_puts(r, b, " ");
}

/* A dict key as json.dumps writes it: str as is; int, float, bool and None as their JSON text. */
static void write_json_key(jr *r, jbuf *b, jv k, const jjson *o) {
    if (k.t == JV_STR) {
        write_json_str(r, b, k.s.p, k.s.n, o->ascii);
    } else if (k.t == JV_INT || k.t == JV_FLOAT || k.t == JV_BOOL || k.t == JV_NONE) {
        jbuf kb = {0};
        jv_write_json(r, &kb, k, o, 0);
        write_json_str(r, b, kb.p, kb.n, false);
    } else {
        jr_fail(r, NULL, LOOM_ERR_FORMAT,
                "tojson: keys must be str, int, float, bool or None, not %s", jv_typename(k));
    }
    jb_puts(r, b, o->key_sep);
}

void jv_write_json(jr *r, jbuf *b, jv v, const jjson *o, int level) {
    int indent = o->indent;
    if (level > 128)
        jr_fail(r, NULL, LOOM_ERR_FORMAT, "tojson: value nested too deeply");
    switch (v.t) {
    case JV_NONE:
        return jb_puts(r, b, "null");
    case JV_BOOL:
        return jb_puts(r, b, v.b ? "true" : "false");
    case JV_INT:
    case JV_FLOAT:
        return v.t == JV_INT ? jv_write_str(r, b, v, false) : write_float(r, b, v.f, true);
    case JV_STR:
        return write_json_str(r, b, v.s.p, v.s.n, o->ascii);
    case JV_LIST:
    case JV_DICT: {
        bool dict = v.t == JV_DICT;
        size_t n = dict ? v.d->n : v.l->n;
        if (!n)
            return jb_puts(r, b, dict ? "{}" : "[]");
        jv *keys = dict ? v.d->k : NULL, *vals = dict ? v.d->v : v.l->v;
        if (dict && o->sort_keys) {
            keys = ja_alloc(&r->arena, n * sizeof *keys),
            vals = ja_alloc(&r->arena, n * sizeof *vals);
            memcpy(keys, v.d->k, n * sizeof *keys), memcpy(vals, v.d->v, n * sizeof *vals);
            jx_sort(r, NULL, keys, vals, n, false);
        }
        jb_puts(r, b, dict ? "{" : "[");
        for (size_t i = 0; i < n; i++) {
            if (i)
                jb_puts(r, b, o->item_sep);
            if (indent >= 0)
                newline_indent(r, b, indent, level + 1);
            if (dict)
                write_json_key(r, b, keys[i], o);
            jv_write_json(r, b, vals[i], o, level + 1);
        }
        if (indent >= 0)
            newline_indent(r, b, indent, level);
        return jb_puts(r, b, dict ? "}" : "]");
    }
    default:
        jr_fail(r, NULL, LOOM_ERR_FORMAT, "tojson: Object of type %s is not JSON serializable",
                v.t == JV_UNDEF ? "Undefined" : jv_typename(v));
    }
}

/* ---------------------------------------------------------------------- */
/* Case mapping                                                            */
/* ---------------------------------------------------------------------- */

static uint32_t decode_cp(const char *p, size_t n, size_t *len) {
    unsigned char c = (unsigned char)p[0];
    int k = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if ((size_t)k > n)
        k = 1;
    uint32_t cp = k == 1 ? c : c & (0x7F >> k);
    for (int i = 1; i < k; i++)
        cp = cp << 6 | ((unsigned char)p[i] & 0x3F);
    *len = (size_t)k;
    return cp;
}

static void encode(jr *r, jbuf *b, uint32_t cp) {
    char o[4];
    size_t n;
    if (cp < 0x80)
        o[0] = (char)cp, n = 1;
    else if (cp < 0x800)
        o[0] = (char)(0xC0 | cp >> 6), o[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
    else if (cp < 0x10000)
        o[0] = (char)(0xE0 | cp >> 12), o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)),
        o[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
    else
        o[0] = (char)(0xF0 | cp >> 18), o[1] = (char)(0x80 | ((cp >> 12) & 0x3F)),
        o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), o[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
    jb_put(r, b, o, n);
}

/* The other case of cp (cp when it has none); *cased: cp is a cased letter;
 * false return: a cased letter loom cannot map. Multi-character results
 * (German sharp s, dotted capital I) are written by the caller. */
static bool other_case(uint32_t cp, bool up, uint32_t *out, bool *cased) {
    *out = cp, *cased = false;
    uint32_t lo = 0, hi = 0; /* a block where upper + d = lower */
    int d = 0;
    if ((cp >= 'A' && cp <= 'Z') || (cp >= 0xC0 && cp <= 0xDE && cp != 0xD7))
        lo = cp, hi = cp, d = 32;
    else if ((cp >= 'a' && cp <= 'z') || (cp >= 0xE0 && cp <= 0xFE && cp != 0xF7))
        lo = cp - 32, hi = cp, d = 32;
    else if (cp >= 0x391 && cp <= 0x3A9 && cp != 0x3A2 && cp != 0x3A3)
        lo = cp, hi = cp, d = 32;
    else if (cp >= 0x3B1 && cp <= 0x3C9 && cp != 0x3C2)
        lo = cp - 32, hi = cp, d = 32;
    else if (cp >= 0x410 && cp <= 0x42F)
        lo = cp, hi = cp, d = 32;
    else if (cp >= 0x430 && cp <= 0x44F)
        lo = cp - 32, hi = cp, d = 32;
    else if (cp >= 0x400 && cp <= 0x40F)
        lo = cp, hi = cp, d = 80;
    else if (cp >= 0x450 && cp <= 0x45F)
        lo = cp - 80, hi = cp, d = 80;
    else if (cp >= 0x100 && cp <= 0x17F && cp != 0x130 && cp != 0x131 && cp != 0x138 &&
             cp != 0x149 && cp != 0x178 && cp != 0x17F) {
        /* Latin Extended-A: pairs, upper first; from U+0139 to U+0148 and U+0179 to U+017E
         * the upper one is odd */
        bool odd_upper = (cp >= 0x139 && cp <= 0x148) || (cp >= 0x179 && cp <= 0x17E);
        bool is_upper = (cp % 2 == 1) == odd_upper;
        *cased = true;
        if (is_upper != up)
            *out = is_upper ? cp + 1 : cp - 1;
        return true;
    } else if (cp == 0xFF || cp == 0x178) {
        *cased = true;
        if (up && cp == 0xFF)
            *out = 0x178;
        if (!up && cp == 0x178)
            *out = 0xFF;
        return true;
    } else if (cp == 0xB5 || cp == 0x131 || cp == 0x17F) {
        *cased = true;
        if (up)
            *out = cp == 0xB5 ? 0x39C : cp == 0x131 ? 'I' : 'S';
        return true;
    } else if (cp == 0x138 || cp == 0xDF || cp == 0x130) {
        *cased = true;
        return true;
    } else {
        /* cased letters outside the blocks above: refused */
        bool other = (cp >= 0x180 && cp <= 0x24F) || (cp >= 0x370 && cp <= 0x3FF) ||
                     (cp >= 0x460 && cp <= 0x52F) || (cp >= 0x531 && cp <= 0x587) ||
                     (cp >= 0x10A0 && cp <= 0x10FF) || (cp >= 0x13A0 && cp <= 0x13FF) ||
                     (cp >= 0x1C80 && cp <= 0x1CBF) || (cp >= 0x1E00 && cp <= 0x1FFF) ||
                     (cp >= 0x2C00 && cp <= 0x2C7F) || (cp >= 0x2C80 && cp <= 0x2CFF) ||
                     (cp >= 0xA640 && cp <= 0xA69F) || (cp >= 0xA720 && cp <= 0xA7FF) ||
                     (cp >= 0xAB70 && cp <= 0xABBF) || (cp >= 0xFB00 && cp <= 0xFB17) ||
                     (cp >= 0xFF21 && cp <= 0xFF5A) || (cp >= 0x10400 && cp <= 0x1E95F) ||
                     (cp >= 0x2160 && cp <= 0x217F) || (cp >= 0x24B6 && cp <= 0x24E9) ||
                     cp == 0x149 || cp == 0x345;
        return !other;
    }
    *cased = true;
    bool is_upper = cp == lo;
    if (is_upper && !up)
        *out = cp + (uint32_t)d;
    else if (!is_upper && up)
        *out = cp - (uint32_t)d;
    (void)hi;
    return true;
}

jv jv_case(jr *r, const jnode *at, jv s, int mode) {
    jbuf b = {0};
    bool start = true; /* title: at the start of a word; capitalize: at the start */
    for (size_t i = 0, k; i < s.s.n; i += k) {
        uint32_t cp = decode_cp(s.s.p + i, s.s.n - i, &k), out;
        bool up = mode == 1 || (mode >= 2 && start), cased;
        if (!other_case(cp, up, &out, &cased))
            jr_fail(r, at, LOOM_ERR_UNSUPPORTED,
                    "%s of U+%04X: loom's Jinja interpreter maps case for ASCII, Latin-1, "
                    "Latin Extended-A, basic Greek and Cyrillic only",
                    mode == 0   ? "lower"
                    : mode == 1 ? "upper"
                                : "capitalize/title",
                    (unsigned)cp);
        if (up && cp == 0xDF)
            jb_puts(r, &b, "SS");
        else if (!up && cp == 0x130)
            jb_puts(r, &b, "i\xcc\x87");
        else
            encode(r, &b, out);
        if (mode == 2)
            start = false;
        else if (mode == 3)
            start = !cased;
    }
    return jv_str(b.p ? b.p : "", b.n);
}
