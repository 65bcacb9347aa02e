/* Internals of the tokenizer (src/data/tokenizer*.c, unicode_nfc.c): UTF-8,
 * character classes, NFC, the pre-tokenizer regexes and the BPE model. Not
 * part of loom's API. */
#ifndef LOOM_TOKENIZER_IMPL_H
#define LOOM_TOKENIZER_IMPL_H

#include "../core/core.h"
#include "tokenizer.h"
#include "unicode_tables.h"

/* ---- UTF-8 (input already validated) ---- */

/* Decodes the code point at s[*i] (valid UTF-8) and advances *i. */
static inline uint32_t loom_utf8_next(const unsigned char *s, size_t *i) {
    uint32_t c = s[*i];
    if (c < 0x80) {
        *i += 1;
        return c;
    }
    if (c < 0xE0) {
        c = (c & 0x1F) << 6 | (s[*i + 1] & 0x3F);
        *i += 2;
    } else if (c < 0xF0) {
        c = (c & 0x0F) << 12 | (uint32_t)(s[*i + 1] & 0x3F) << 6 | (s[*i + 2] & 0x3F);
        *i += 3;
    } else {
        c = (c & 0x07) << 18 | (uint32_t)(s[*i + 1] & 0x3F) << 12 |
            (uint32_t)(s[*i + 2] & 0x3F) << 6 | (s[*i + 3] & 0x3F);
        *i += 4;
    }
    return c;
}
/* Writes the UTF-8 form of c into out (4 bytes room); returns its length. */
size_t loom_utf8_put(uint32_t c, char *out);
/* Offset of the first byte that is not valid UTF-8 (strict: no overlong
 * forms, surrogates or code points past U+10FFFF), or n when all is valid. */
size_t loom_utf8_check(const char *s, size_t n);
/* Appends s to out with every maximal ill-formed subsequence replaced by
 * U+FFFD, as Rust's String::from_utf8_lossy does. */
void loom_utf8_lossy(loom_sb *out, const char *s, size_t n);

/* ---- character classes (LOOM_UC_L / N / WS / OTHER) ---- */

/* hint: the index of the range found last (per caller, starts at 0). */
int loom_uc_class_slow(uint32_t c, uint32_t *hint);
static inline int loom_uc_class(uint32_t c, uint32_t *hint) {
    return c < 128 ? loom_uc_ascii_class[c] : loom_uc_class_slow(c, hint);
}

/* ---- NFC (Unicode 9.0 data, as Hugging Face tokenizers) ---- */

/* Length of the longest prefix of s that NFC leaves unchanged by the quick
 * check (n when all of s is normalized already). */
size_t loom_nfc_quick(const char *s, size_t n);
/* Appends NFC(s) to out (s valid UTF-8). */
void loom_nfc_append(loom_sb *out, const char *s, size_t n);

/* ---- pre-tokenizer regexes ---- */

typedef enum loom_pretok_pattern {
    LOOM_PAT_QWEN2 = 0, /* Qwen2 / Qwen2.5 / Qwen3: \p{N} alone */
    LOOM_PAT_LLAMA3,    /* Llama 3: \p{N}{1,3} */
    LOOM_PAT_GPT2,      /* GPT-2 (ByteLevel use_regex) */
    LOOM_PAT_QWEN35,    /* Qwen3.5: marks join letters ([\p{L}\p{M}]+) */
} loom_pretok_pattern;

/* The exact regex text of a pattern (as in tokenizer.json). */
const char *loom_pretok_regex(loom_pretok_pattern p);
/* The pattern whose regex is exactly `re`, or -1. */
int loom_pretok_find(const char *re, size_t len);
/* Leftmost-first match of pattern p in s[pos, n) as Oniguruma finds it:
 * returns true and [*start, *end) (never empty), or false when none. */
bool loom_pretok_next(loom_pretok_pattern p, const char *s, size_t n, size_t pos, size_t *start,
                      size_t *end);

/* ---- the tokenizer ---- */

/* Open addressing over ids: slot = id + 1, 0 = empty. */
typedef struct loom_tok_hash {
    int32_t *slot;
    uint32_t mask;
} loom_tok_hash;

uint64_t loom_tok_hash_bytes(const void *p, size_t n);

#define LOOM_TOK_MAX_STAGES 8
#define LOOM_TOK_SEQ (-1) /* the sequence's place in a post-processor template */

typedef struct loom_added_token {
    int32_t id;
    uint32_t off, len; /* content in the tokenizer's pool */
    bool lstrip, rstrip, normalized, special;
} loom_added_token;

/* A byte trie of added tokens: edges (node << 8 | byte) -> child in an open
 * addressing table; node 0 is the root. */
typedef struct loom_trie {
    uint64_t *key;     /* UINT64_MAX = empty */
    uint32_t *child;
    uint32_t mask;
    int32_t *token;    /* (n_nodes): index into added[] of the token ending here, or -1 */
    uint32_t n_nodes;
    uint8_t first_byte[32]; /* bit set of the bytes that start a token */
} loom_trie;

static inline uint32_t loom_trie_mix(uint64_t k) {
    k ^= k >> 31;
    k *= 0x9E3779B97F4A7C15ull;
    k ^= k >> 29;
    return (uint32_t)k;
}
/* The child of node by byte b, or -1. */
static inline int64_t loom_trie_child(const loom_trie *tr, uint32_t node, unsigned char b) {
    uint64_t key = (uint64_t)node << 8 | b;
    for (uint32_t i = loom_trie_mix(key) & tr->mask;; i = (i + 1) & tr->mask) {
        if (tr->key[i] == key) return tr->child[i];
        if (tr->key[i] == UINT64_MAX) return -1;
    }
}

/* A merge: the pair key = a << 32 | b (UINT64_MAX: an empty slot), its rank
 * (the place in model.merges) and the token it makes. */
typedef struct loom_merge {
    uint64_t key;
    uint32_t rank;
    int32_t new_id;
} loom_merge;

static inline uint32_t loom_merge_slot(uint64_t key) {
    key ^= key >> 33;
    key *= 0xFF51AFD7ED558CCDull;
    key ^= key >> 33;
    return (uint32_t)key;
}

struct loom_tokenizer {
    int64_t n_ids;      /* largest id + 1 */
    char *pool;         /* token strings */
    uint32_t *str_off;  /* (n_ids) */
    int32_t *str_len;   /* (n_ids): -1 for an id that names nothing */
    char *dec;          /* decoded bytes (ByteLevel decoder) of every id */
    uint32_t *dec_off;  /* (n_ids) */
    uint32_t *dec_len;  /* (n_ids) */
    uint8_t *is_model;  /* (n_ids): in the model's vocabulary */
    uint8_t *is_bytes;  /* (n_ids): a model token made of byte-level characters only */

    /* model: BPE */
    int64_t n_model;            /* entries of the model vocabulary */
    loom_tok_hash vocab;        /* model token string -> id */
    loom_tok_hash vocab_bytes;  /* decoded bytes -> id (is_bytes tokens) */
    int32_t byte_id[256];       /* the token of each byte's character, -1 if none */
    loom_merge *merges;         /* open addressing over (a, b) */
    uint32_t merge_mask;
    int64_t n_merges;
    bool ignore_merges, fuse_unk;
    int32_t unk_id;             /* -1: characters outside the vocabulary are dropped */

    /* added tokens */
    loom_added_token *added;
    int32_t n_added;
    loom_tok_hash added_hash;   /* content -> index into added */
    loom_trie trie_raw, trie_norm; /* normalized = false / true tokens */

    /* pipeline */
    bool nfc;
    int n_splits;
    loom_pretok_pattern splits[LOOM_TOK_MAX_STAGES];
    bool prefix_space, use_regex; /* the ByteLevel pre-tokenizer */
    int32_t *tmpl;   /* post-processor template (single sequence): ids and LOOM_TOK_SEQ */
    int32_t n_tmpl;  /* 0: adds nothing */
};

/* Looks a string up in a hash over ids (compared with the strings of kind
 * `dec` = false: token strings, true: decoded bytes). */
int32_t loom_tok_lookup(const loom_tokenizer *t, const loom_tok_hash *h, bool dec, const void *s,
                        size_t n);

/* A growable id list; `failed` on allocation failure. */
typedef struct loom_ids {
    int32_t *v;
    size_t n, cap;
    bool failed;
} loom_ids;
void loom_ids_push(loom_ids *a, int32_t id);

/* Scratch space of encoding (the BPE word, its heap, a word cache). */
typedef struct loom_bpe_work loom_bpe_work;
loom_bpe_work *loom_bpe_work_new(void);
void loom_bpe_work_free(loom_bpe_work *w);
/* Forgets the cached words (they belong to another tokenizer). */
void loom_bpe_work_reset(loom_bpe_work *w);
/* Appends the BPE tokens of one pre-token (raw bytes, before the byte-level
 * mapping) to out. */
void loom_bpe_encode(const loom_tokenizer *t, loom_bpe_work *w, const unsigned char *s, size_t n,
                     loom_ids *out);

#endif /* LOOM_TOKENIZER_IMPL_H */
