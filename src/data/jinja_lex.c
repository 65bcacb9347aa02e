/* Jinja templates: the arena and the lexer (jinja2's whitespace rules with
 * trim_blocks and lstrip_blocks: a template's text and tags as tokens). */
#include <stdlib.h>
#include <string.h>

#include "jinja_impl.h"

/* ---------------------------------------------------------------------- */
/* Arena                                                                   */
/* ---------------------------------------------------------------------- */

struct ja_block {
    ja_block *next;
    size_t used, cap;
    _Alignas(16) unsigned char mem[];
};

void *ja_alloc(ja *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->cap - a->head->used < n) {
        size_t cap = n > 65536 ? n : 65536;
        if (a->limit && a->total + cap > a->limit) {
            loom_errf(a->ctx, LOOM_ERR_OOM,
                      "jinja: the template needs over %zu MiB to render (a runaway loop?)",
                      a->limit >> 20);
            longjmp(*a->jb, 1);
        }
        a->total += cap;
        ja_block *b = malloc(sizeof *b + cap);
        if (!b) {
            loom_errf(a->ctx, LOOM_ERR_OOM, "jinja: out of memory (%zu bytes)", n);
            longjmp(*a->jb, 1);
        }
        b->next = a->head, b->used = 0, b->cap = cap;
        a->head = b;
    }
    void *p = a->head->mem + a->head->used;
    a->head->used += n;
    memset(p, 0, n);
    return p;
}

void *ja_grow(ja *a, void *v, size_t n, size_t *cap, size_t elem) {
    if (n < *cap)
        return v;
    size_t c = *cap ? *cap * 2 : 8;
    void *nv = ja_alloc(a, c * elem);
    if (n)
        memcpy(nv, v, n * elem);
    *cap = c;
    return nv;
}

char *ja_strndup(ja *a, const char *s, size_t n) {
    char *p = ja_alloc(a, n + 1);
    memcpy(p, s, n);
    return p;
}

void ja_free(ja *a) {
    while (a->head) {
        ja_block *b = a->head;
        a->head = b->next;
        free(b);
    }
}

/* ---------------------------------------------------------------------- */
/* Lexer                                                                   */
/* ---------------------------------------------------------------------- */

void jx_line_col(const jp *P, size_t off, int *line, int *col) {
    int l = 1, c = 1;
    for (size_t i = 0; i < off && i < P->len; i++) {
        if (P->src[i] == '\n')
            l++, c = 1;
        else if (((unsigned char)P->src[i] & 0xC0) != 0x80)
            c++;
    }
    *line = l, *col = c;
}

_Noreturn void jx_perr_at(jp *P, int line, int col, loom_status st, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    loom_errf(P->ctx, st, "%s:%d:%d: %s", P->what, line, col, msg);
    longjmp(P->jb, 1);
}

_Noreturn static void perr_off(jp *P, size_t off, const char *msg) {
    int l, c;
    jx_line_col(P, off, &l, &c);
    jx_perr_at(P, l, c, LOOM_ERR_FORMAT, "%s", msg);
}

static tok *push_tok(jp *P, tk kind, size_t off) {
    P->toks = ja_grow(P->a, P->toks, P->ntok, &P->cap, sizeof *P->toks);
    tok *t = &P->toks[P->ntok++];
    memset(t, 0, sizeof *t);
    t->kind = kind;
    jx_line_col(P, off, &t->line, &t->col);
    return t;
}

/* Python's str.isspace() for the code point at s (ASCII and the common
 * Unicode spaces); *len gets its byte length. */
bool jx_space_at(const char *s, size_t n, size_t *len) {
    unsigned char c = (unsigned char)s[0];
    *len = 1;
    if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f))
        return true;
    if (c == 0xc2 && n >= 2 && ((unsigned char)s[1] == 0x85 || (unsigned char)s[1] == 0xa0))
        return *len = 2, true;
    if (c == 0xe1 && n >= 3 && (unsigned char)s[1] == 0x9a && (unsigned char)s[2] == 0x80)
        return *len = 3, true;
    if (c == 0xe2 && n >= 3) {
        unsigned b1 = (unsigned char)s[1], b2 = (unsigned char)s[2];
        if (b1 == 0x80 && ((b2 >= 0x80 && b2 <= 0x8a) || b2 == 0xa8 || b2 == 0xa9 || b2 == 0xaf))
            return *len = 3, true;
        if (b1 == 0x81 && b2 == 0x9f)
            return *len = 3, true;
    }
    if (c == 0xe3 && n >= 3 && (unsigned char)s[1] == 0x80 && (unsigned char)s[2] == 0x80)
        return *len = 3, true;
    return false;
}

/* Length of s without its trailing Python whitespace. */
static size_t rstrip_len(const char *s, size_t n) {
    size_t keep = 0, i = 0, k;
    while (i < n) {
        if (jx_space_at(s + i, n - i, &k))
            i += k;
        else {
            i += 1;
            while (i < n && ((unsigned char)s[i] & 0xC0) == 0x80)
                i++;
            keep = i;
        }
    }
    return keep;
}

static bool all_space(const char *s, size_t n) {
    size_t k;
    for (size_t i = 0; i < n; i += k)
        if (!jx_space_at(s + i, n - i, &k))
            return false;
    return true;
}

static size_t skip_space(const jp *P, size_t i) {
    size_t k;
    while (i < P->len && jx_space_at(P->src + i, P->len - i, &k))
        i += k;
    return i;
}

/* Decodes a string literal's body as Python's unicode-escape does. */
static void lex_string(jp *P, size_t *pi) {
    size_t i = *pi, start = i;
    char q = P->src[i++];
    char *buf = ja_alloc(P->a, P->len - i + 1);
    size_t n = 0;
    for (;;) {
        if (i >= P->len)
            perr_off(P, start, "unterminated string literal");
        char c = P->src[i];
        if (c == q)
            break;
        if (c != '\\') {
            buf[n++] = c, i++;
            continue;
        }
        if (i + 1 >= P->len)
            perr_off(P, start, "unterminated string literal");
        char e = P->src[i + 1];
        i += 2;
        switch (e) {
        case 'n':
            buf[n++] = '\n';
            break;
        case 't':
            buf[n++] = '\t';
            break;
        case 'r':
            buf[n++] = '\r';
            break;
        case 'b':
            buf[n++] = '\b';
            break;
        case 'f':
            buf[n++] = '\f';
            break;
        case 'v':
            buf[n++] = '\v';
            break;
        case 'a':
            buf[n++] = '\a';
            break;
        case '\\':
            buf[n++] = '\\';
            break;
        case '\'':
            buf[n++] = '\'';
            break;
        case '"':
            buf[n++] = '"';
            break;
        case '\n':
            break;
        case 'x':
        case 'u':
        case 'U': {
            int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int k = 0; k < digits; k++, i++) {
                char h = i < P->len ? P->src[i] : 0;
                int d = h >= '0' && h <= '9'   ? h - '0'
                        : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                               : -1;
                if (d < 0)
                    perr_off(P, i, "truncated \\x, \\u or \\U escape in a string literal");
                cp = cp * 16 + (uint32_t)d;
            }
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
                perr_off(P, i, "string escape outside Unicode scalar values");
            if (cp < 0x80)
                buf[n++] = (char)cp;
            else if (cp < 0x800) {
                buf[n++] = (char)(0xC0 | (cp >> 6));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                buf[n++] = (char)(0xE0 | (cp >> 12));
                buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            } else {
                buf[n++] = (char)(0xF0 | (cp >> 18));
                buf[n++] = (char)(0x80 | ((cp >> 12) & 0x3F));
                buf[n++] = (char)(0x80 | ((cp >> 6) & 0x3F));
                buf[n++] = (char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default:
            if (e >= '0' && e <= '7') {
                int v = e - '0';
                for (int k = 0; k < 2 && i < P->len && P->src[i] >= '0' && P->src[i] <= '7'; k++)
                    v = v * 8 + (P->src[i++] - '0');
                if (v >= 0x80)
                    perr_off(P, start, "octal escapes above \\177 are not supported");
                buf[n++] = (char)v;
            } else {
                buf[n++] = '\\';
                i--; /* unknown escape: kept as written */
            }
        }
    }
    tok *t = push_tok(P, T_STR, start);
    t->p = buf, t->n = n;
    *pi = i + 1;
}

static const char *const OPS[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                  "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                  ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};

/* Lexes the expression tokens of a {{ }} or {% %} tag from *pi up to its end
 * marker; returns whether the end had '-' (0), '+' (1) or nothing (2). */
static int lex_tag(jp *P, size_t *pi, bool block, size_t tag_off) {
    size_t i = *pi;
    int balance = 0;
    char endc = block ? '%' : '}';
    for (;;) {
        i = skip_space(P, i);
        if (i >= P->len)
            perr_off(P, tag_off,
                     block ? "unclosed '{%' tag: '%}' missing" : "unclosed '{{': '}}' missing");
        const char *s = P->src + i;
        size_t left = P->len - i;
        if (balance == 0) {
            int sign = 2;
            size_t k = 0;
            if (left >= 3 && (s[0] == '-' || s[0] == '+') && s[1] == endc && s[2] == '}')
                sign = s[0] == '-' ? 0 : 1, k = 1;
            if (left >= k + 2 && s[k] == endc && s[k + 1] == '}' && (block || sign != 1)) {
                *pi = i + k + 2;
                push_tok(P, T_END, i);
                return sign;
            }
        }
        char c = *s;
        if (c == '\'' || c == '"') {
            lex_string(P, &i);
            continue;
        }
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t j = i;
            while (j < P->len && ((P->src[j] >= 'a' && P->src[j] <= 'z') ||
                                  (P->src[j] >= 'A' && P->src[j] <= 'Z') ||
                                  (P->src[j] >= '0' && P->src[j] <= '9') || P->src[j] == '_'))
                j++;
            tok *t = push_tok(P, T_NAME, i);
            t->p = P->src + i, t->n = j - i;
            i = j;
            continue;
        }
        if (c >= '0' && c <= '9') {
            size_t j = i;
            bool flt = false;
            while (j < P->len && ((P->src[j] >= '0' && P->src[j] <= '9') || P->src[j] == '_'))
                j++;
            if (j + 1 < P->len && P->src[j] == '.' && P->src[j + 1] >= '0' &&
                P->src[j + 1] <= '9') {
                flt = true;
                j++;
                while (j < P->len && P->src[j] >= '0' && P->src[j] <= '9')
                    j++;
            }
            if (j < P->len && (P->src[j] == 'e' || P->src[j] == 'E')) {
                size_t k = j + 1;
                if (k < P->len && (P->src[k] == '+' || P->src[k] == '-'))
                    k++;
                if (k < P->len && P->src[k] >= '0' && P->src[k] <= '9') {
                    flt = true;
                    j = k;
                    while (j < P->len && P->src[j] >= '0' && P->src[j] <= '9')
                        j++;
                }
            }
            char num[64];
            size_t nn = 0;
            for (size_t k = i; k < j && nn < sizeof num - 1; k++)
                if (P->src[k] != '_')
                    num[nn++] = P->src[k];
            num[nn] = 0;
            tok *t = push_tok(P, flt ? T_FLOAT : T_INT, i);
            if (flt)
                t->f = strtod(num, NULL);
            else {
                char *end;
                unsigned long long v = strtoull(num, &end, 10);
                if (nn > 18 && (v > INT64_MAX || nn > 19))
                    perr_off(P, i, "integer literal too large (loom's Jinja integers are 64-bit)");
                t->i = (int64_t)v;
            }
            i = j;
            continue;
        }
        size_t k = 0;
        for (; k < sizeof OPS / sizeof *OPS; k++) {
            size_t ol = strlen(OPS[k]);
            if (left >= ol && memcmp(s, OPS[k], ol) == 0)
                break;
        }
        if (k == sizeof OPS / sizeof *OPS)
            perr_off(P, i, "unexpected character in a tag");
        tok *t = push_tok(P, T_OP, i);
        t->p = OPS[k], t->n = strlen(OPS[k]);
        if (*s == '(' || *s == '[' || *s == '{')
            balance++;
        if (*s == ')' || *s == ']' || *s == '}')
            balance--;
        i += t->n;
    }
}

void jx_lex(jp *P) {
    for (size_t k = 0; k < P->len; k++)
        if (P->src[k] == 0)
            perr_off(P, k, "NUL byte in the template");
    size_t i = 0;
    bool line_starting = true;
    while (i < P->len) {
        /* the next tag start */
        size_t j = i;
        char kind = 0;
        for (; j + 1 < P->len; j++)
            if (P->src[j] == '{' &&
                (P->src[j + 1] == '{' || P->src[j + 1] == '%' || P->src[j + 1] == '#')) {
                kind = P->src[j + 1];
                break;
            }
        if (!kind)
            j = P->len;
        const char *text = P->src + i;
        size_t tn = j - i;
        char sign = kind && j + 2 < P->len ? P->src[j + 2] : 0;
        if (kind && sign == '-')
            tn = rstrip_len(text, tn);
        else if (kind && sign != '+' && kind != '{') {
            size_t l = tn;
            while (l > 0 && text[l - 1] != '\n')
                l--;
            if ((l > 0 || line_starting) && tn > l && all_space(text + l, tn - l))
                tn = l;
        }
        if (tn) {
            tok *t = push_tok(P, T_DATA, i);
            t->p = text, t->n = tn;
        }
        if (!kind)
            break;
        size_t tag = j;
        i = j + 2 + (sign == '-' || sign == '+');
        if (kind == '#') {
            const char *e = NULL;
            for (size_t k = i; k + 1 < P->len; k++)
                if (P->src[k] == '#' && P->src[k + 1] == '}') {
                    e = P->src + k;
                    break;
                }
            if (!e)
                perr_off(P, tag, "unclosed comment: '#}' missing");
            size_t k = (size_t)(e - P->src);
            char es = k > i ? P->src[k - 1] : 0;
            i = k + 2;
            if (es == '-')
                i = skip_space(P, i);
            else if (es != '+' && i < P->len && P->src[i] == '\n')
                i++;
        } else {
            if (kind == '%') {
                /* {% raw %} would need a lexer state of its own */
                size_t k = skip_space(P, i);
                if (P->len - k >= 3 && memcmp(P->src + k, "raw", 3) == 0 &&
                    (k + 3 >= P->len || !(P->src[k + 3] == '_' || (P->src[k + 3] | 32) >= 'a'))) {
                    int l, c;
                    jx_line_col(P, tag, &l, &c);
                    jx_perr_at(P, l, c, LOOM_ERR_UNSUPPORTED,
                               "unsupported statement 'raw' (loom's Jinja interpreter lacks it)");
                }
            }
            push_tok(P, kind == '%' ? T_BLOCK : T_VAR, tag);
            int es = lex_tag(P, &i, kind == '%', tag);
            if (es == 0)
                i = skip_space(P, i);
            else if (es == 2 && kind == '%' && i < P->len && P->src[i] == '\n')
                i++;
        }
        line_starting = i > 0 && P->src[i - 1] == '\n';
    }
    push_tok(P, T_EOF, P->len);
}
