/* The pre-tokenizer regexes of Qwen2/Qwen3, Qwen3.5, Llama 3 and GPT-2, each
 * matched by hand over code points with the semantics of the backtracking
 * engine Hugging Face tokenizers runs them in (Oniguruma): at a position, the
 * alternatives are tried in order and the first that matches wins; inside
 * one, greedy quantifiers take the longest run that lets the rest match.
 * Classes: \p{L} letters, \p{N} numbers, \p{M} marks, \s White_Space, from
 * Unicode 16.0.0 as in Oniguruma 6.9.10 (see unicode_tables.h); "other" =
 * none of them. Only Qwen3.5's regex names \p{M}: for the others a mark is
 * "other". */
#include <string.h>

#include "tokenizer_impl.h"

static const char *const REGEX[] = {
    [LOOM_PAT_QWEN2] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                       "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    [LOOM_PAT_LLAMA3] = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| "
                        "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    [LOOM_PAT_GPT2] = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
    [LOOM_PAT_QWEN35] =
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| "
        "?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
};

const char *loom_pretok_regex(loom_pretok_pattern p) { return REGEX[p]; }

int loom_pretok_find(const char *re, size_t len) {
    for (int p = 0; p < (int)(sizeof REGEX / sizeof REGEX[0]); p++)
        if (strlen(REGEX[p]) == len && memcmp(REGEX[p], re, len) == 0) return p;
    return -1;
}

/* A cursor over valid UTF-8; marks: whether the pattern tells \p{M} from
 * "other". */
typedef struct cur {
    const unsigned char *s;
    size_t n;
    uint32_t hint;
    bool marks;
} cur;

/* The code point at i (i < n), its class, and the index after it. */
static inline uint32_t at(cur *c, size_t i, int *cls, size_t *next) {
    *next = i;
    uint32_t cp = loom_utf8_next(c->s, next);
    *cls = loom_uc_class(cp, &c->hint);
    if (*cls == LOOM_UC_M && !c->marks) *cls = LOOM_UC_OTHER;
    return cp;
}

#define BIT(k) (1u << (k))

/* End of the run of code points whose class is in the set `set` (of BIT(k))
 * starting at i. */
static size_t run_in(cur *c, size_t i, unsigned set) {
    while (i < c->n) {
        int cls;
        size_t j;
        at(c, i, &cls, &j);
        if (!(set & BIT(cls))) break;
        i = j;
    }
    return i;
}

static size_t run_crlf(cur *c, size_t i) {
    while (i < c->n && (c->s[i] == '\r' || c->s[i] == '\n')) i++;
    return i;
}

/* ASCII letters folded to lower case; U+017F LATIN SMALL LETTER LONG S folds
 * to 's' (tools/gen_unicode.py checks no other code point folds to one of
 * the contraction letters). */
static inline uint32_t fold(uint32_t c) {
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c == 0x17F) return 's';
    return c;
}

/* 's 't 're 've 'm 'll 'd at i (s[i] is '\''): end, or 0. */
static size_t contraction(cur *c, size_t i, bool ci) {
    size_t j = i + 1, k;
    if (j >= c->n) return 0;
    int cls;
    uint32_t a = at(c, j, &cls, &k);
    if (ci) a = fold(a);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return k;
    if ((a == 'r' || a == 'v' || a == 'l') && k < c->n) {
        size_t m;
        uint32_t b = at(c, k, &cls, &m);
        if (ci) b = fold(b);
        if (b == (a == 'l' ? 'l' : 'e')) return m;
    }
    return 0;
}

/* The white-space run from i (s[i] is white space): its end q, the start of
 * its last code point, and the end of its last \r or \n (0 if none). */
static void ws_run(cur *c, size_t i, size_t *q, size_t *last, size_t *crlf_end) {
    *crlf_end = 0;
    *last = i;
    while (i < c->n) {
        int cls;
        size_t j;
        uint32_t cp = at(c, i, &cls, &j);
        if (cls != LOOM_UC_WS) break;
        if (cp == '\r' || cp == '\n') *crlf_end = j;
        *last = i;
        i = j;
    }
    *q = i;
}

/* \s+(?!\S)|\s+ at i (s[i] is white space). */
static size_t ws_tail(cur *c, size_t i, bool crlf_alt) {
    size_t q, last, crlf_end;
    ws_run(c, i, &q, &last, &crlf_end);
    if (crlf_alt && crlf_end) return crlf_end; /* \s*[\r\n]+ */
    if (q == c->n || last == i) return q;      /* \s+(?!\S) up to the end, else \s+ */
    return last;                               /* \s+(?!\S): all but the last */
}

/* Qwen2 / Llama 3 / Qwen3.5 at i: the match end (> i), or 0. Qwen3.5 is
 * Qwen2 with [\p{L}\p{M}]+ for \p{L}+ (c->marks: a mark is not "other"). */
static size_t match_qwen(cur *c, size_t i, bool llama) {
    int k0, k1;
    size_t i1, i2;
    uint32_t c0 = at(c, i, &k0, &i1);
    /* (?i:'s|'t|'re|'ve|'m|'ll|'d) */
    if (c0 == '\'') {
        size_t e = contraction(c, i, true);
        if (e) return e;
    }
    /* [^\r\n\p{L}\p{N}]?\p{L}+, or [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+: a leading
     * mark is taken by either part, the end is the same */
    const unsigned word = c->marks ? BIT(LOOM_UC_L) | BIT(LOOM_UC_M) : BIT(LOOM_UC_L);
    if (word & BIT(k0)) return run_in(c, i1, word);
    if (c0 != '\r' && c0 != '\n' && k0 != LOOM_UC_N && i1 < c->n) {
        at(c, i1, &k1, &i2);
        if (word & BIT(k1)) return run_in(c, i2, word);
    }
    /* \p{N} or \p{N}{1,3} */
    if (k0 == LOOM_UC_N) {
        size_t e = i1;
        for (int r = 1; llama && r < 3 && e < c->n; r++) {
            size_t j;
            at(c, e, &k1, &j);
            if (k1 != LOOM_UC_N) break;
            e = j;
        }
        return e;
    }
    /*  ?[^\s\p{L}\p{N}]+[\r\n]* (Qwen3.5: [^\s\p{L}\p{M}\p{N}]: "other") */
    if (c0 == ' ' && i1 < c->n) {
        at(c, i1, &k1, &i2);
        if (k1 == LOOM_UC_OTHER) return run_crlf(c, run_in(c, i2, BIT(LOOM_UC_OTHER)));
    }
    if (k0 == LOOM_UC_OTHER) return run_crlf(c, run_in(c, i1, BIT(LOOM_UC_OTHER)));
    /* \s*[\r\n]+|\s+(?!\S)|\s+ */
    return ws_tail(c, i, true);
}

/* GPT-2 at i. */
static size_t match_gpt2(cur *c, size_t i) {
    int k0, k1 = -1;
    size_t i1, i2 = 0;
    uint32_t c0 = at(c, i, &k0, &i1);
    if (c0 == '\'') {
        size_t e = contraction(c, i, false);
        if (e) return e;
    }
    /*  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+ */
    if (c0 == ' ' && i1 < c->n) {
        at(c, i1, &k1, &i2);
        if (k1 != LOOM_UC_WS) return run_in(c, i2, BIT(k1));
    }
    if (k0 != LOOM_UC_WS) return run_in(c, i1, BIT(k0));
    /* \s+(?!\S)|\s+ */
    return ws_tail(c, i, false);
}

bool loom_pretok_next(loom_pretok_pattern p, const char *s, size_t n, size_t pos, size_t *start,
                      size_t *end) {
    cur c = {(const unsigned char *)s, n, 0, p == LOOM_PAT_QWEN35};
    /* Every code point begins a match of these patterns (each class has an
     * alternative), so the leftmost match starts at pos. */
    if (pos >= n) return false;
    size_t e = p == LOOM_PAT_GPT2 ? match_gpt2(&c, pos) : match_qwen(&c, pos, p == LOOM_PAT_LLAMA3);
    LOOM_ASSERT(e > pos && e <= n);
    *start = pos;
    *end = e;
    return true;
}
