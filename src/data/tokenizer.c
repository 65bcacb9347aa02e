/* Hugging Face tokenizer.json, byte-level BPE (Qwen2, Qwen3, Llama 3, GPT-2),
 * reproducing `tokenizers` (0.2x) id for id:
 *
 *   text -> added tokens with normalized=false matched on the raw text
 *        -> each other piece: normalizer (NFC or none), then added tokens
 *           with normalized=true matched on the normalized piece
 *        -> each other piece: Split pre-tokenizers (regex, Isolated), then
 *           ByteLevel (prefix space, GPT-2 regex when use_regex, bytes)
 *        -> BPE per pre-token (tokenizer_bpe.c)
 *        -> post-processor template (loom_tokenizer_encode_ex only).
 *
 * Added tokens are matched leftmost-longest (aho-corasick's LeftmostLongest,
 * as HF builds its matchers), with lstrip/rstrip as HF's find_matches
 * applies them. Decoding maps every id to its string (added tokens to their
 * content), the ByteLevel decoder maps strings made of byte-level characters
 * back to bytes (others stay as they are), and the bytes are made UTF-8 as
 * Rust's from_utf8_lossy does.
 *
 * Loading refuses, naming the field, whatever this file does not implement:
 * loom never approximates a tokenizer. */
#include "tokenizer.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "../core/json.h"
#include "tokenizer_impl.h"

/* ---------------------------------------------------------------------- */
/* Small helpers                                                           */
/* ---------------------------------------------------------------------- */

static bool is_ws(uint32_t c) {
    uint32_t hint = 0;
    return loom_uc_class(c, &hint) == LOOM_UC_WS;
}

/* Start of the code point that ends at s[i) (i > 0). */
static size_t utf8_prev(const unsigned char *s, size_t i) {
    do i--;
    while (i > 0 && (s[i] & 0xC0) == 0x80);
    return i;
}

/* ---------------------------------------------------------------------- */
/* Added tokens: HF's find_matches                                         */
/* ---------------------------------------------------------------------- */

static void trie_free(loom_trie *tr) {
    free(tr->key);
    free(tr->child);
    free(tr->token);
}

/* The leftmost-longest match at or after pos: true and [*ms, *me), token *k. */
static bool trie_find(const loom_trie *tr, const unsigned char *s, size_t n, size_t pos, size_t *ms,
                      size_t *me, int32_t *k) {
    if (tr->n_nodes <= 1) return false;
    for (size_t p = pos; p < n; p++) {
        if (!(tr->first_byte[s[p] >> 3] >> (s[p] & 7) & 1)) continue;
        uint32_t node = 0;
        int32_t best = -1;
        size_t end = 0;
        for (size_t j = p; j < n; j++) {
            int64_t c = loom_trie_child(tr, node, s[j]);
            if (c < 0) break;
            node = (uint32_t)c;
            if (tr->token[node] >= 0) {
                best = tr->token[node];
                end = j + 1;
            }
        }
        if (best >= 0) {
            *ms = p;
            *me = end;
            *k = best;
            return true;
        }
    }
    return false;
}

/* ---------------------------------------------------------------------- */
/* Encoding                                                                */
/* ---------------------------------------------------------------------- */

typedef struct enc {
    const loom_tokenizer *t;
    loom_bpe_work *work;
    loom_ids ids;
    int32_t bad_split; /* an added token HF cannot cut out (it panics), else -1 */
    loom_sb norm;    /* the normalized piece */
    loom_sb prefix;  /* a piece with the ByteLevel prefix space */
} enc;

/* The ByteLevel pre-tokenizer and the model, on one piece. */
static void byte_level(enc *e, const char *s, size_t n) {
    const loom_tokenizer *t = e->t;
    if (t->prefix_space && s[0] != ' ') {
        e->prefix.len = 0;
        loom_sb_putc(&e->prefix, ' ');
        loom_sb_append(&e->prefix, s, n);
        if (e->prefix.failed) {
            e->ids.failed = true;
            return;
        }
        s = e->prefix.buf;
        n = e->prefix.len;
    }
    if (!t->use_regex) {
        loom_bpe_encode(t, e->work, (const unsigned char *)s, n, &e->ids);
        return;
    }
    size_t pos = 0, ms, me;
    while (loom_pretok_next(LOOM_PAT_GPT2, s, n, pos, &ms, &me)) {
        loom_bpe_encode(t, e->work, (const unsigned char *)s + ms, me - ms, &e->ids);
        pos = me;
    }
}

/* Split pre-tokenizer `stage` (Isolated: matches and the text between them
 * are pieces), then the next stages. */
static void pre_tokenize(enc *e, int stage, const char *s, size_t n) {
    if (!n) return;
    if (stage == e->t->n_splits) {
        byte_level(e, s, n);
        return;
    }
    size_t pos = 0, ms, me;
    while (loom_pretok_next(e->t->splits[stage], s, n, pos, &ms, &me)) {
        pre_tokenize(e, stage + 1, s + pos, ms - pos);
        pre_tokenize(e, stage + 1, s + ms, me - ms);
        pos = me;
    }
    pre_tokenize(e, stage + 1, s + pos, n - pos);
}

/* HF's AddedVocabulary::find_matches over s[0, n): text pieces go to
 * piece(), tokens to the ids. */
static void split_added(enc *e, const loom_trie *tr, const char *str, size_t n,
                        void (*piece)(enc *, const char *, size_t)) {
    const loom_tokenizer *t = e->t;
    const unsigned char *s = (const unsigned char *)str;
    size_t start_offset = 0, pos = 0, ms, me;
    size_t ws_a = 1, ws_b = 0; /* [ws_a, ws_b): white space seen by the last rstrip */
    int32_t k;
    while (pos < n && trie_find(tr, s, n, pos, &ms, &me, &k)) {
        const loom_added_token *a = &t->added[k];
        size_t start = ms, stop = me;
        if (a->lstrip) {
            /* back over the white space before the match; stopping at
             * start_offset gives the same max(newstart, start_offset) and
             * keeps this linear */
            size_t ns = start;
            while (ns > start_offset) {
                size_t p = utf8_prev(s, ns), q = p;
                if (!is_ws(loom_utf8_next(s, &q))) break;
                ns = p;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (a->rstrip) { /* and over the white space after it */
            if (stop >= ws_a && stop <= ws_b) {
                stop = ws_b; /* inside a run already measured */
            } else {
                ws_a = stop;
                while (stop < n) {
                    size_t q = stop;
                    if (!is_ws(loom_utf8_next(s, &q))) break;
                    stop = q;
                }
                ws_b = stop;
            }
        }
        if (start > stop) {
            /* the white space before this token was taken by the previous
             * one's rstrip and this one's lstrip starts after its own end:
             * HF's split fails ("AddedVocabulary bad split" panic) */
            e->bad_split = k;
            return;
        }
        if (start_offset < start) piece(e, str + start_offset, start - start_offset);
        if (e->bad_split >= 0) return;
        /* HF drops empty splits, a token whose range stripping emptied too */
        if (start < stop) loom_ids_push(&e->ids, a->id);
        start_offset = stop;
        pos = me;
    }
    if (start_offset < n) piece(e, str + start_offset, n - start_offset);
}

static void normalized_piece(enc *e, const char *s, size_t n) { pre_tokenize(e, 0, s, n); }

/* A piece of the raw text between non-normalized added tokens. */
static void raw_piece(enc *e, const char *s, size_t n) {
    const loom_tokenizer *t = e->t;
    if (t->nfc && loom_nfc_quick(s, n) < n) {
        /* (pre_tokenize does not touch e->norm: one buffer serves every piece) */
        e->norm.len = 0;
        loom_nfc_append(&e->norm, s, n);
        if (e->norm.failed) {
            e->ids.failed = true;
            return;
        }
        s = e->norm.buf;
        n = e->norm.len;
    }
    split_added(e, &t->trie_norm, s, n, normalized_piece);
}

struct loom_tokenizer_encoder {
    const loom_tokenizer *t;
    loom_bpe_work *work;
    loom_sb norm, prefix;
};

loom_status loom_tokenizer_encoder_create(loom_ctx *ctx, const loom_tokenizer *t,
                                          loom_tokenizer_encoder **out) {
    if (!t || !out)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_tokenizer_encoder_create: NULL argument");
    loom_tokenizer_encoder *e = calloc(1, sizeof *e);
    if (!e || !(e->work = loom_bpe_work_new())) {
        free(e);
        *out = NULL;
        return loom_errf(ctx, LOOM_ERR_OOM, "tokenizer encoder: out of memory");
    }
    e->t = t;
    *out = e;
    return LOOM_OK;
}

void loom_tokenizer_encoder_free(loom_tokenizer_encoder *e) {
    if (!e) return;
    loom_bpe_work_free(e->work);
    loom_sb_free(&e->norm);
    loom_sb_free(&e->prefix);
    free(e);
}

loom_status loom_tokenizer_encoder_encode(loom_ctx *ctx, loom_tokenizer_encoder *encoder,
                                          const char *text, size_t len, bool add_special_tokens,
                                          int32_t **ids, int64_t *n) {
    if (!encoder || !ids || !n || (!text && len))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_tokenizer_encode: NULL argument");
    const loom_tokenizer *t = encoder->t;
    *ids = NULL;
    *n = 0;
    if (len > (size_t)INT32_MAX)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "tokenizer encode: the text has %zu bytes, more than %d: split it", len,
                         INT32_MAX);
    size_t bad = loom_utf8_check(text, len);
    if (bad < len)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "tokenizer encode: the text is not valid UTF-8 at byte offset %zu (byte "
                         "0x%02X)",
                         bad, (unsigned char)text[bad]);
    enc e = {.t = t, .work = encoder->work, .norm = encoder->norm, .prefix = encoder->prefix,
             .bad_split = -1};
    if (len) split_added(&e, &t->trie_raw, text, len, raw_piece);
    /* the buffers stay with the encoder; a failed one is dropped */
    encoder->norm = e.norm;
    encoder->prefix = e.prefix;
    if (e.norm.failed) loom_sb_free(&encoder->norm);
    if (e.prefix.failed) loom_sb_free(&encoder->prefix);
    if (e.ids.failed) loom_bpe_work_reset(encoder->work);
    if (e.bad_split >= 0) {
        free(e.ids.v);
        const loom_added_token *a = &t->added[e.bad_split];
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "tokenizer encode: added token %" PRId32
                         " (lstrip) overlaps the white space the token before it took (rstrip); "
                         "Hugging Face tokenizers fails on this text too (\"AddedVocabulary bad "
                         "split\")",
                         a->id);
    }
    if (!e.ids.failed && add_special_tokens && t->n_tmpl) {
        loom_ids out = {0};
        for (int32_t k = 0; k < t->n_tmpl; k++) {
            if (t->tmpl[k] != LOOM_TOK_SEQ) {
                loom_ids_push(&out, t->tmpl[k]);
                continue;
            }
            for (size_t i = 0; i < e.ids.n; i++) loom_ids_push(&out, e.ids.v[i]);
        }
        free(e.ids.v);
        e.ids = out;
    }
    if (e.ids.failed) {
        free(e.ids.v);
        return loom_errf(ctx, LOOM_ERR_OOM, "tokenizer encode: out of memory (%zu bytes of text)",
                         len);
    }
    if (!e.ids.v && !(e.ids.v = malloc(sizeof(int32_t))))
        return loom_errf(ctx, LOOM_ERR_OOM, "tokenizer encode: out of memory");
    *ids = e.ids.v;
    *n = (int64_t)e.ids.n;
    return LOOM_OK;
}

loom_status loom_tokenizer_encode_ex(loom_ctx *ctx, const loom_tokenizer *t, const char *text,
                                     size_t len, bool add_special_tokens, int32_t **ids,
                                     int64_t *n) {
    if (!t || !ids || !n)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_tokenizer_encode: NULL argument");
    *ids = NULL;
    *n = 0;
    loom_tokenizer_encoder *e;
    loom_status st = loom_tokenizer_encoder_create(ctx, t, &e);
    if (st) return st;
    st = loom_tokenizer_encoder_encode(ctx, e, text, len, add_special_tokens, ids, n);
    loom_tokenizer_encoder_free(e);
    return st;
}

loom_status loom_tokenizer_encode(loom_ctx *ctx, const loom_tokenizer *t, const char *text,
                                  size_t len, int32_t **ids, int64_t *n) {
    return loom_tokenizer_encode_ex(ctx, t, text, len, false, ids, n);
}

/* ---------------------------------------------------------------------- */
/* Decoding and lookups                                                    */
/* ---------------------------------------------------------------------- */

loom_status loom_tokenizer_decode_n(loom_ctx *ctx, const loom_tokenizer *t, const int32_t *ids,
                                    int64_t n, char **text, size_t *len) {
    if (!t || !text || n < 0 || (!ids && n))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_tokenizer_decode: NULL argument");
    *text = NULL;
    if (len) *len = 0;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->n_ids || t->str_len[ids[i]] < 0)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "tokenizer decode: id %" PRId32 " (position %" PRId64
                             ") is not a token of this tokenizer (ids are below %" PRId64 ")",
                             ids[i], i, t->n_ids);
    loom_sb raw, out;
    loom_sb_init(&raw);
    loom_sb_init(&out);
    for (int64_t i = 0; i < n; i++)
        loom_sb_append(&raw, t->dec + t->dec_off[ids[i]], t->dec_len[ids[i]]);
    loom_utf8_lossy(&out, raw.buf ? raw.buf : "", raw.len);
    loom_sb_free(&raw);
    if (!out.buf) loom_sb_append(&out, "", 0);
    if (raw.failed || out.failed || !out.buf) {
        loom_sb_free(&out);
        return loom_errf(ctx, LOOM_ERR_OOM, "tokenizer decode: out of memory");
    }
    if (len) *len = out.len;
    *text = loom_sb_take(&out);
    return LOOM_OK;
}

loom_status loom_tokenizer_decode(loom_ctx *ctx, const loom_tokenizer *t, const int32_t *ids,
                                  int64_t n, char **text) {
    return loom_tokenizer_decode_n(ctx, t, ids, n, text, NULL);
}

int64_t loom_tokenizer_vocab_size(const loom_tokenizer *t) { return t ? t->n_ids : 0; }

int32_t loom_tokenizer_token_id(const loom_tokenizer *t, const char *token) {
    if (!t || !token) return -1;
    size_t n = strlen(token);
    int32_t k = loom_tok_lookup(t, &t->added_hash, false, token, n);
    if (k >= 0) return k;
    return loom_tok_lookup(t, &t->vocab, false, token, n);
}

const char *loom_tokenizer_id_to_token(const loom_tokenizer *t, int32_t id, size_t *len) {
    if (!t || id < 0 || id >= t->n_ids || t->str_len[id] < 0) return NULL;
    if (len) *len = (size_t)t->str_len[id];
    return t->pool + t->str_off[id];
}

bool loom_tokenizer_is_special(const loom_tokenizer *t, int32_t id) {
    if (!t) return false;
    for (int32_t k = 0; k < t->n_added; k++)
        if (t->added[k].id == id) return t->added[k].special;
    return false;
}

void loom_tokenizer_free(loom_tokenizer *t) {
    if (!t) return;
    free(t->pool);
    free(t->str_off);
    free(t->str_len);
    free(t->dec);
    free(t->dec_off);
    free(t->dec_len);
    free(t->is_model);
    free(t->is_bytes);
    free(t->vocab.slot);
    free(t->vocab_bytes.slot);
    free(t->merges);
    free(t->added);
    free(t->added_hash.slot);
    trie_free(&t->trie_raw);
    trie_free(&t->trie_norm);
    free(t->tmpl);
    free(t);
}

/* The loader is in tokenizer_load.c. */
