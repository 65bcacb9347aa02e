/* UTF-8 helpers, character classes and NFC for the tokenizer.
 *
 * NFC is the algorithm of the crate Hugging Face tokenizers normalizes with
 * (unicode-normalization-alignments 0.1.12, Unicode 9.0 data, see
 * tools/gen_unicode.py): full canonical decomposition (Hangul by
 * arithmetic), a stable sort of every run of non-starters by combining
 * class, then canonical composition (a starter composes with the next
 * character that is not blocked). Text is only rewritten between
 * normalization boundaries around the code points NFC can touch; everything
 * else is copied. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_impl.h"

/* ---------------------------------------------------------------------- */
/* UTF-8                                                                   */
/* ---------------------------------------------------------------------- */

size_t loom_utf8_put(uint32_t c, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (c < 0x80) {
        o[0] = (unsigned char)c;
        return 1;
    }
    if (c < 0x800) {
        o[0] = (unsigned char)(0xC0 | c >> 6);
        o[1] = (unsigned char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        o[0] = (unsigned char)(0xE0 | c >> 12);
        o[1] = (unsigned char)(0x80 | (c >> 6 & 0x3F));
        o[2] = (unsigned char)(0x80 | (c & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | c >> 18);
    o[1] = (unsigned char)(0x80 | (c >> 12 & 0x3F));
    o[2] = (unsigned char)(0x80 | (c >> 6 & 0x3F));
    o[3] = (unsigned char)(0x80 | (c & 0x3F));
    return 4;
}

/* Length of the valid UTF-8 sequence at s[i] (1..4), or 0 with *good set to
 * the number of bytes that are a valid prefix of some sequence (the
 * "maximal subpart" of Unicode's substitution practice, at least 1). */
static size_t utf8_seq(const unsigned char *s, size_t n, size_t i, size_t *good) {
    unsigned char b = s[i];
    if (b < 0x80) return 1;
    size_t need;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
        need = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 3;
        if (b == 0xE0) lo = 0xA0;
        if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 4;
        if (b == 0xF0) lo = 0x90;
        if (b == 0xF4) hi = 0x8F;
    } else {
        *good = 1;
        return 0;
    }
    size_t k = 1;
    for (; k < need; k++) {
        if (i + k >= n) break;
        unsigned char c = s[i + k];
        if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
    }
    if (k == need) return need;
    *good = k;
    return 0;
}

size_t loom_utf8_check(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t good, l = utf8_seq(s, n, i, &good);
        if (!l) return i;
        i += l;
    }
    return n;
}

void loom_utf8_lossy(loom_sb *out, const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0, run = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        size_t good, l = utf8_seq(s, n, i, &good);
        if (l) {
            i += l;
            continue;
        }
        loom_sb_append(out, str + run, i - run);
        loom_sb_append(out, "\xEF\xBF\xBD", 3);
        i += good;
        run = i;
    }
    loom_sb_append(out, str + run, n - run);
}

/* ---------------------------------------------------------------------- */
/* Classes                                                                 */
/* ---------------------------------------------------------------------- */

/* Index of the range holding c, or -1. */
static long find_range(const loom_uc_range *r, uint32_t n, uint32_t c) {
    uint32_t lo = 0, hi = n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (r[mid].lo <= c) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0) return -1;
    return c <= LOOM_UC_HI(r[lo - 1]) ? (long)lo - 1 : -1;
}

int loom_uc_class_slow(uint32_t c, uint32_t *hint) {
    const loom_uc_range *r = loom_uc_class_ranges;
    uint32_t h = *hint;
    if (h < loom_uc_n_class_ranges && r[h].lo <= c && c <= LOOM_UC_HI(r[h]))
        return (int)LOOM_UC_V(r[h]);
    long k = find_range(r, loom_uc_n_class_ranges, c);
    if (k < 0) return LOOM_UC_OTHER;
    *hint = (uint32_t)k;
    return (int)LOOM_UC_V(r[k]);
}

/* ---------------------------------------------------------------------- */
/* NFC                                                                     */
/* ---------------------------------------------------------------------- */

enum {
    S_BASE = 0xAC00, L_BASE = 0x1100, V_BASE = 0x1161, T_BASE = 0x11A7,
    L_COUNT = 19, V_COUNT = 21, T_COUNT = 28, N_COUNT = V_COUNT * T_COUNT,
    S_COUNT = L_COUNT * N_COUNT
};

static inline bool nfc_unsafe(uint32_t c) {
    return c >= 0x300 && find_range(loom_uc_nfc_unsafe, loom_uc_n_nfc_unsafe, c) >= 0;
}

static inline uint8_t ccc_of(uint32_t c) {
    if (c < 0x300) return 0;
    long k = find_range(loom_uc_ccc_ranges, loom_uc_n_ccc_ranges, c);
    return k < 0 ? 0 : (uint8_t)LOOM_UC_V(loom_uc_ccc_ranges[k]);
}

/* The full canonical decomposition of c (Hangul excluded): pool slice or NULL. */
static const uint32_t *decomp_of(uint32_t c, uint32_t *len) {
    if (c < 0xC0) return NULL;
    uint32_t lo = 0, hi = loom_uc_n_decomp;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (loom_uc_decomp_cp[mid] < c) lo = mid + 1;
        else hi = mid;
    }
    if (lo == loom_uc_n_decomp || loom_uc_decomp_cp[lo] != c) return NULL;
    uint32_t at = loom_uc_decomp_at[lo];
    *len = at & 0xFF;
    return loom_uc_decomp_pool + (at >> 8);
}

/* The primary composite of (a, b), or 0. */
static uint32_t compose(uint32_t a, uint32_t b) {
    if (a - L_BASE < L_COUNT && b - V_BASE < V_COUNT)
        return S_BASE + ((a - L_BASE) * V_COUNT + (b - V_BASE)) * T_COUNT;
    if (a - S_BASE < S_COUNT && b - T_BASE - 1 < T_COUNT - 1 && (a - S_BASE) % T_COUNT == 0)
        return a + (b - T_BASE);
    uint64_t key = (uint64_t)a << 21 | b;
    uint32_t lo = 0, hi = loom_uc_n_comp;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (loom_uc_comp_key[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo < loom_uc_n_comp && loom_uc_comp_key[lo] == key ? loom_uc_comp_val[lo] : 0;
}

size_t loom_nfc_quick(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0xCC) { /* a code point below U+0300, or a continuation byte of one */
            i++;
            continue;
        }
        size_t at = i;
        uint32_t c = loom_utf8_next(s, &i);
        if (nfc_unsafe(c)) return at;
    }
    return n;
}

typedef struct nfc_buf {
    uint32_t *cp;
    uint8_t *cc;
    size_t n, cap;
    bool failed;
} nfc_buf;

static void buf_push(nfc_buf *b, uint32_t c, uint8_t cc) {
    if (b->failed) return;
    if (b->n == b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 64;
        uint32_t *cp = realloc(b->cp, cap * sizeof *cp);
        if (!cp) {
            b->failed = true;
            return;
        }
        b->cp = cp;
        uint8_t *k = realloc(b->cc, cap);
        if (!k) {
            b->failed = true;
            return;
        }
        b->cc = k;
        b->cap = cap;
    }
    b->cp[b->n] = c;
    b->cc[b->n] = cc;
    b->n++;
}

/* Stable sort of cp/cc[a, e) by class (all non-zero). */
static bool sort_run(nfc_buf *b, size_t a, size_t e) {
    size_t len = e - a;
    if (len < 2) return true;
    if (len <= 32) {
        for (size_t i = a + 1; i < e; i++) {
            uint32_t c = b->cp[i];
            uint8_t k = b->cc[i];
            size_t j = i;
            while (j > a && b->cc[j - 1] > k) {
                b->cp[j] = b->cp[j - 1];
                b->cc[j] = b->cc[j - 1];
                j--;
            }
            b->cp[j] = c;
            b->cc[j] = k;
        }
        return true;
    }
    /* long runs (adversarial input): a counting sort keeps it linear */
    uint32_t *tmp = malloc(len * sizeof *tmp);
    if (!tmp) return false;
    size_t start[257] = {0};
    for (size_t i = a; i < e; i++) start[b->cc[i] + 1]++;
    for (int k = 1; k <= 256; k++) start[k] += start[k - 1];
    for (size_t i = a; i < e; i++) tmp[start[b->cc[i]]++] = b->cp[i];
    memcpy(b->cp + a, tmp, len * sizeof *tmp);
    free(tmp);
    for (size_t i = a; i < e; i++) b->cc[i] = ccc_of(b->cp[i]);
    return true;
}

/* Appends NFC of one segment s[0, n). */
static void nfc_segment(loom_sb *out, const unsigned char *s, size_t n) {
    nfc_buf b = {0};
    /* decompose */
    for (size_t i = 0; i < n;) {
        uint32_t c = loom_utf8_next(s, &i), len;
        const uint32_t *d;
        if (c - S_BASE < S_COUNT) {
            uint32_t x = c - S_BASE;
            buf_push(&b, L_BASE + x / N_COUNT, 0);
            buf_push(&b, V_BASE + x % N_COUNT / T_COUNT, 0);
            if (x % T_COUNT) buf_push(&b, T_BASE + x % T_COUNT, 0);
        } else if ((d = decomp_of(c, &len))) {
            for (uint32_t k = 0; k < len; k++) buf_push(&b, d[k], ccc_of(d[k]));
        } else {
            buf_push(&b, c, ccc_of(c));
        }
    }
    if (b.failed) goto oom;
    /* canonical order */
    for (size_t i = 0; i < b.n;) {
        if (!b.cc[i]) {
            i++;
            continue;
        }
        size_t e = i;
        while (e < b.n && b.cc[e]) e++;
        if (!sort_run(&b, i, e)) goto oom;
        i = e;
    }
    /* compose: out_n chars written in place at the front of the buffer */
    size_t w = 0;           /* next write position */
    long composee = -1;     /* index of the starter being composed into */
    int last = -1;          /* class of the last character left uncomposed since it */
    for (size_t i = 0; i < b.n; i++) {
        uint32_t ch = b.cp[i];
        int cls = b.cc[i];
        if (composee < 0) {
            if (cls == 0) composee = (long)w;
            b.cp[w] = ch;
            b.cc[w++] = (uint8_t)cls;
            continue;
        }
        if (last < 0 || last < cls) {
            uint32_t r = compose(b.cp[composee], ch);
            if (r) {
                b.cp[composee] = r;
                continue;
            }
        }
        if (cls == 0) {
            composee = (long)w;
            last = -1;
        } else {
            last = cls;
        }
        b.cp[w] = ch;
        b.cc[w++] = (uint8_t)cls;
    }
    char u[4];
    for (size_t i = 0; i < w; i++) loom_sb_append(out, u, loom_utf8_put(b.cp[i], u));
    free(b.cp);
    free(b.cc);
    return;
oom:
    free(b.cp);
    free(b.cc);
    out->failed = true;
}

void loom_nfc_append(loom_sb *out, const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t copied = 0;   /* s[0, copied) is in out */
    size_t boundary = 0; /* start of the last safe code point seen (a boundary before it) */
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0xCC) {
            if (s[i] < 0x80 || s[i] >= 0xC0) boundary = i; /* a code point starts here */
            i++;
            continue;
        }
        size_t at = i;
        uint32_t c = loom_utf8_next(s, &i);
        if (!nfc_unsafe(c)) {
            boundary = at;
            continue;
        }
        /* the segment: from the boundary before to the next safe code point */
        size_t a = boundary > copied ? boundary : copied, e = i;
        while (e < n) {
            size_t k = e;
            uint32_t d = loom_utf8_next(s, &k);
            if (!nfc_unsafe(d)) break;
            e = k;
        }
        loom_sb_append(out, str + copied, a - copied);
        nfc_segment(out, s + a, e - a);
        copied = boundary = i = e;
    }
    loom_sb_append(out, str + copied, n - copied);
}
