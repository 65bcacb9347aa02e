/* Loading tokenizer.json: every field checked, everything loom does not
 * implement refused with the field named (see tokenizer.h). Ids of added
 * tokens are checked against the ones Hugging Face tokenizers would assign
 * them (it renumbers silently, with a warning, where a file disagrees). */
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "../core/json.h"
#include "tokenizer.h"
#include "tokenizer_impl.h"

#define ID_SLACK 4
#define ID_MARGIN 65536
#define MAX_TEMPLATE 4096

typedef struct ld {
    loom_ctx *ctx;
    const char *what;
    loom_tokenizer *t;
} ld;

static loom_status bad(ld *l, loom_status st, const char *fmt, ...) LOOM_PRINTF(3, 4);
static loom_status bad(ld *l, loom_status st, const char *fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return loom_errf(l->ctx, st, "%s: %s", l->what, msg);
}

static loom_status oom(ld *l) { return bad(l, LOOM_ERR_OOM, "out of memory"); }

static const char *tname(const loom_json *v) { return v ? loom_json_type_name(v->type) : "nothing"; }

static bool is_null(const loom_json *v) { return !v || v->type == LOOM_JSON_NULL; }

/* A printable excerpt of a string for messages (escaped, truncated). */
static const char *show(const char *s, size_t n, char buf[112]) {
    size_t o = 0;
    size_t i = 0;
    for (; i < n && o < 80; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7F)
            o += (size_t)snprintf(buf + o, 112 - o, "\\x%02X", c);
        else if (c == '"' || c == '\\')
            buf[o++] = '\\', buf[o++] = (char)c;
        else
            buf[o++] = (char)c;
    }
    if (i < n) {
        while (o > 0 && ((unsigned char)buf[o - 1] & 0xC0) == 0x80) o--;
        if (o > 0 && (unsigned char)buf[o - 1] >= 0xC0) o--;
        memcpy(buf + o, "...", 4);
    } else {
        buf[o] = '\0';
    }
    return buf;
}

/* Optional boolean: absent/null keeps *out. */
static loom_status get_bool(ld *l, const loom_json *obj, const char *key, const char *where,
                            bool *out) {
    const loom_json *v = loom_json_get(obj, key);
    if (is_null(v)) return LOOM_OK;
    if (v->type != LOOM_JSON_BOOL)
        return bad(l, LOOM_ERR_FORMAT, "%s.%s must be true or false, got %s", where, key, tname(v));
    *out = v->b;
    return LOOM_OK;
}

/* Required boolean. */
static loom_status need_bool(ld *l, const loom_json *obj, const char *key, const char *where,
                             bool *out) {
    const loom_json *v = loom_json_get(obj, key);
    if (!v || v->type != LOOM_JSON_BOOL)
        return bad(l, LOOM_ERR_FORMAT, "%s.%s must be true or false, got %s", where, key, tname(v));
    *out = v->b;
    return LOOM_OK;
}

/* The "type" of a component object. */
static loom_status type_of(ld *l, const loom_json *v, const char *where, const char **type) {
    if (v->type != LOOM_JSON_OBJECT)
        return bad(l, LOOM_ERR_FORMAT, "%s must be an object, got %s", where, tname(v));
    const loom_json *ty = loom_json_get(v, "type");
    if (!ty || ty->type != LOOM_JSON_STRING)
        return bad(l, LOOM_ERR_FORMAT, "%s.type must be a string, got %s", where, tname(ty));
    *type = ty->s;
    return LOOM_OK;
}

/* ---------------------------------------------------------------------- */
/* Hash tables and the added-token tries                                   */
/* ---------------------------------------------------------------------- */

static uint32_t pow2_at_least(size_t n) {
    uint32_t c = 16;
    while (c < n) c *= 2;
    return c;
}

static bool hash_init(loom_tok_hash *h, size_t n) {
    uint32_t cap = pow2_at_least(2 * n + 1);
    h->slot = calloc(cap, sizeof *h->slot);
    h->mask = cap - 1;
    return h->slot != NULL;
}

/* Inserts id under s; returns the id already there for an equal key, or -1. */
static int32_t hash_put(const loom_tokenizer *t, loom_tok_hash *h, bool dec, const char *s,
                        size_t n, int32_t id) {
    int32_t old = loom_tok_lookup(t, h, dec, s, n);
    if (old >= 0) return old;
    uint32_t i = (uint32_t)loom_tok_hash_bytes(s, n) & h->mask;
    while (h->slot[i]) i = (i + 1) & h->mask;
    h->slot[i] = id + 1;
    return -1;
}

/* The trie of the added tokens whose `normalized` flag is `norm`. */
static bool trie_build(loom_tokenizer *t, loom_trie *tr, bool norm) {
    size_t bytes = 0;
    for (int32_t k = 0; k < t->n_added; k++)
        if (t->added[k].normalized == norm) bytes += t->added[k].len;
    uint32_t cap = pow2_at_least(2 * bytes + 1);
    tr->key = malloc(cap * sizeof *tr->key);
    tr->child = malloc(cap * sizeof *tr->child);
    tr->token = malloc((bytes + 1) * sizeof *tr->token);
    if (!tr->key || !tr->child || !tr->token) return false;
    memset(tr->key, 0xFF, cap * sizeof *tr->key);
    tr->mask = cap - 1;
    tr->n_nodes = 1;
    tr->token[0] = -1;
    for (int32_t k = 0; k < t->n_added; k++) {
        const loom_added_token *a = &t->added[k];
        if (a->normalized != norm) continue;
        const unsigned char *s = (const unsigned char *)t->pool + a->off;
        tr->first_byte[s[0] >> 3] |= (uint8_t)(1u << (s[0] & 7));
        uint32_t node = 0;
        for (uint32_t j = 0; j < a->len; j++) {
            int64_t c = loom_trie_child(tr, node, s[j]);
            if (c < 0) {
                uint64_t key = (uint64_t)node << 8 | s[j];
                uint32_t i = loom_trie_mix(key) & tr->mask;
                while (tr->key[i] != UINT64_MAX) i = (i + 1) & tr->mask;
                tr->key[i] = key;
                tr->child[i] = tr->n_nodes;
                tr->token[tr->n_nodes] = -1;
                c = tr->n_nodes++;
            }
            node = (uint32_t)c;
        }
        tr->token[node] = k;
    }
    return true;
}

/* ---------------------------------------------------------------------- */
/* The byte-level alphabet                                                 */
/* ---------------------------------------------------------------------- */

static bool printable_byte(int b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* GPT-2's bytes_to_unicode: char_of[b]; byte_of[c] for c < 324, else -1. */
static void byte_alphabet(uint32_t char_of[256], int16_t byte_of[324]) {
    for (int c = 0; c < 324; c++) byte_of[c] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        char_of[b] = printable_byte(b) ? (uint32_t)b : 256 + (uint32_t)n++;
        byte_of[char_of[b]] = (int16_t)b;
    }
}

/* ---------------------------------------------------------------------- */
/* Components                                                              */
/* ---------------------------------------------------------------------- */

static loom_status parse_normalizer(ld *l, const loom_json *root) {
    const loom_json *n = loom_json_get(root, "normalizer");
    if (is_null(n)) return LOOM_OK;
    const char *type;
    loom_status st = type_of(l, n, "normalizer", &type);
    if (st) return st;
    if (!strcmp(type, "NFC")) {
        l->t->nfc = true;
        return LOOM_OK;
    }
    if (!strcmp(type, "Sequence")) {
        const loom_json *list = loom_json_get(n, "normalizers");
        if (!list || list->type != LOOM_JSON_ARRAY)
            return bad(l, LOOM_ERR_FORMAT, "normalizer.normalizers must be an array, got %s",
                       tname(list));
        for (size_t i = 0; i < list->n; i++) {
            char where[64];
            snprintf(where, sizeof where, "normalizer.normalizers[%zu]", i);
            if ((st = type_of(l, list->items[i], where, &type))) return st;
            if (strcmp(type, "NFC"))
                return bad(l, LOOM_ERR_UNSUPPORTED,
                           "%s: normalizer \"%s\" is not supported (loom implements NFC, or none)",
                           where, type);
            l->t->nfc = true; /* NFC twice is NFC */
        }
        return LOOM_OK;
    }
    return bad(l, LOOM_ERR_UNSUPPORTED,
               "normalizer \"%s\" is not supported (loom implements NFC, or none)", type);
}

static loom_status parse_byte_level(ld *l, const loom_json *v, const char *where, bool is_last) {
    if (!is_last)
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "%s: ByteLevel must be the last pre-tokenizer (loom splits before it only)",
                   where);
    loom_tokenizer *t = l->t;
    t->use_regex = true; /* HF's default when the field is absent */
    bool trim = false;
    loom_status st = need_bool(l, v, "add_prefix_space", where, &t->prefix_space);
    if (!st) st = get_bool(l, v, "trim_offsets", where, &trim); /* offsets only */
    if (!st) st = get_bool(l, v, "use_regex", where, &t->use_regex);
    return st;
}

static loom_status parse_split(ld *l, const loom_json *v, const char *where) {
    loom_tokenizer *t = l->t;
    const loom_json *pat = loom_json_get(v, "pattern");
    if (!pat || pat->type != LOOM_JSON_OBJECT || pat->n != 1)
        return bad(l, LOOM_ERR_FORMAT, "%s.pattern must be {\"Regex\": ...} or {\"String\": ...}",
                   where);
    const loom_json *re = loom_json_get(pat, "Regex");
    if (!re) {
        if (loom_json_get(pat, "String"))
            return bad(l, LOOM_ERR_UNSUPPORTED,
                       "%s.pattern: a String pattern is not supported (loom implements the "
                       "regexes of Qwen2/Qwen3, Qwen3.5, Llama 3 and GPT-2)",
                       where);
        return bad(l, LOOM_ERR_FORMAT, "%s.pattern must be {\"Regex\": ...} or {\"String\": ...}",
                   where);
    }
    if (re->type != LOOM_JSON_STRING)
        return bad(l, LOOM_ERR_FORMAT, "%s.pattern.Regex must be a string, got %s", where,
                   tname(re));
    int p = loom_pretok_find(re->s, re->slen);
    if (p < 0) {
        char b[112];
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "%s: the regex \"%s\" is not supported (loom implements exactly the regexes of "
                   "Qwen2/Qwen3, Qwen3.5, Llama 3 and GPT-2)",
                   where, show(re->s, re->slen, b));
    }
    const loom_json *beh = loom_json_get(v, "behavior");
    if (!beh || beh->type != LOOM_JSON_STRING)
        return bad(l, LOOM_ERR_FORMAT, "%s.behavior must be a string, got %s", where, tname(beh));
    if (strcmp(beh->s, "Isolated"))
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "%s.behavior \"%s\" is not supported (loom implements Isolated)", where, beh->s);
    bool invert = false;
    loom_status st = need_bool(l, v, "invert", where, &invert);
    if (st) return st;
    if (invert)
        return bad(l, LOOM_ERR_UNSUPPORTED, "%s.invert = true is not supported", where);
    if (t->n_splits == LOOM_TOK_MAX_STAGES)
        return bad(l, LOOM_ERR_UNSUPPORTED, "%s: more than %d Split pre-tokenizers", where,
                   LOOM_TOK_MAX_STAGES);
    t->splits[t->n_splits++] = (loom_pretok_pattern)p;
    return LOOM_OK;
}

static loom_status parse_pre_tokenizer(ld *l, const loom_json *root) {
    const loom_json *pt = loom_json_get(root, "pre_tokenizer");
    if (is_null(pt))
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "pre_tokenizer is null: loom implements byte-level BPE, which needs a ByteLevel "
                   "pre-tokenizer");
    const char *type;
    loom_status st = type_of(l, pt, "pre_tokenizer", &type);
    if (st) return st;
    if (!strcmp(type, "ByteLevel")) return parse_byte_level(l, pt, "pre_tokenizer", true);
    if (strcmp(type, "Sequence"))
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "pre_tokenizer \"%s\" is not supported (loom implements ByteLevel, or a "
                   "Sequence of Split pre-tokenizers and ByteLevel)",
                   type);
    const loom_json *list = loom_json_get(pt, "pretokenizers");
    if (!list || list->type != LOOM_JSON_ARRAY)
        return bad(l, LOOM_ERR_FORMAT, "pre_tokenizer.pretokenizers must be an array, got %s",
                   tname(list));
    bool have_bl = false;
    for (size_t i = 0; i < list->n; i++) {
        char where[64];
        snprintf(where, sizeof where, "pre_tokenizer.pretokenizers[%zu]", i);
        if ((st = type_of(l, list->items[i], where, &type))) return st;
        if (!strcmp(type, "Split")) {
            if (have_bl)
                return bad(l, LOOM_ERR_UNSUPPORTED,
                           "%s: a Split after ByteLevel is not supported", where);
            st = parse_split(l, list->items[i], where);
        } else if (!strcmp(type, "ByteLevel")) {
            st = parse_byte_level(l, list->items[i], where, i + 1 == list->n);
            have_bl = true;
        } else {
            st = bad(l, LOOM_ERR_UNSUPPORTED,
                     "%s: pre-tokenizer \"%s\" is not supported (loom implements Split and "
                     "ByteLevel)",
                     where, type);
        }
        if (st) return st;
    }
    if (!have_bl)
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "pre_tokenizer: a Sequence without ByteLevel is not supported (loom implements "
                   "byte-level BPE)");
    return LOOM_OK;
}

static loom_status parse_decoder(ld *l, const loom_json *root) {
    const loom_json *d = loom_json_get(root, "decoder");
    if (is_null(d))
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "decoder is null: loom implements byte-level BPE, whose decoder is ByteLevel");
    const char *type;
    loom_status st = type_of(l, d, "decoder", &type);
    if (st) return st;
    if (strcmp(type, "ByteLevel"))
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "decoder \"%s\" is not supported (loom implements ByteLevel)", type);
    return LOOM_OK; /* its flags only matter for offsets */
}

/* Applies a TemplateProcessing's single-sequence template to cur (a list of
 * ids and LOOM_TOK_SEQ). */
static loom_status apply_template(ld *l, const loom_json *pp, const char *where, int32_t **cur,
                                  int32_t *n_cur) {
    const loom_json *single = loom_json_get(pp, "single");
    const loom_json *specials = loom_json_get(pp, "special_tokens");
    if (!single || single->type != LOOM_JSON_ARRAY)
        return bad(l, LOOM_ERR_FORMAT, "%s.single must be an array, got %s", where, tname(single));
    if (!is_null(specials) && specials->type != LOOM_JSON_OBJECT)
        return bad(l, LOOM_ERR_FORMAT, "%s.special_tokens must be an object, got %s", where,
                   tname(specials));
    loom_ids out = {0};
    for (size_t i = 0; i < single->n; i++) {
        const loom_json *piece = single->items[i];
        if (piece->type != LOOM_JSON_OBJECT || piece->n != 1) {
            free(out.v);
            return bad(l, LOOM_ERR_FORMAT,
                       "%s.single[%zu] must be {\"Sequence\": ...} or {\"SpecialToken\": ...}",
                       where, i);
        }
        const loom_json *body = piece->items[0];
        const loom_json *id = loom_json_get(body, "id");
        if (!id || id->type != LOOM_JSON_STRING) {
            free(out.v);
            return bad(l, LOOM_ERR_FORMAT, "%s.single[%zu].%s.id must be a string, got %s", where,
                       i, piece->keys[0], tname(id));
        }
        if (!strcmp(piece->keys[0], "Sequence")) {
            if (strcmp(id->s, "A")) {
                free(out.v);
                return bad(l, LOOM_ERR_FORMAT,
                           "%s.single[%zu]: the single-sequence template names sequence \"%s\"",
                           where, i, id->s);
            }
            for (int32_t k = 0; k < *n_cur; k++) loom_ids_push(&out, (*cur)[k]);
        } else if (!strcmp(piece->keys[0], "SpecialToken")) {
            const loom_json *sp = loom_json_get(specials, id->s);
            const loom_json *ids = loom_json_get(sp, "ids");
            char b[112];
            if (!ids || ids->type != LOOM_JSON_ARRAY) {
                free(out.v);
                return bad(l, LOOM_ERR_FORMAT,
                           "%s: special token \"%s\" of single[%zu] has no ids in special_tokens",
                           where, show(id->s, id->slen, b), i);
            }
            for (size_t k = 0; k < ids->n; k++) {
                const loom_json *x = ids->items[k];
                if (x->type != LOOM_JSON_NUMBER || !x->is_int || x->i < 0 || x->i >= l->t->n_ids ||
                    l->t->str_len[x->i] < 0) {
                    free(out.v);
                    return bad(l, LOOM_ERR_FORMAT,
                               "%s.special_tokens[\"%s\"].ids[%zu] is not a token id of this "
                               "tokenizer",
                               where, show(id->s, id->slen, b), k);
                }
                loom_ids_push(&out, (int32_t)x->i);
            }
        } else {
            free(out.v);
            return bad(l, LOOM_ERR_FORMAT,
                       "%s.single[%zu] must be {\"Sequence\": ...} or {\"SpecialToken\": ...}, "
                       "got \"%s\"",
                       where, i, piece->keys[0]);
        }
        if (out.n > MAX_TEMPLATE) {
            free(out.v);
            return bad(l, LOOM_ERR_UNSUPPORTED, "%s: the template adds more than %d tokens", where,
                       MAX_TEMPLATE);
        }
    }
    if (out.failed) {
        free(out.v);
        return oom(l);
    }
    free(*cur);
    *cur = out.v;
    *n_cur = (int32_t)out.n;
    return LOOM_OK;
}

static loom_status parse_processor(ld *l, const loom_json *pp, const char *where, int32_t **cur,
                                   int32_t *n_cur, int depth) {
    const char *type;
    loom_status st = type_of(l, pp, where, &type);
    if (st) return st;
    if (!strcmp(type, "ByteLevel")) return LOOM_OK; /* offsets only */
    if (!strcmp(type, "TemplateProcessing")) return apply_template(l, pp, where, cur, n_cur);
    if (!strcmp(type, "Sequence") && depth == 0) {
        const loom_json *list = loom_json_get(pp, "processors");
        if (!list || list->type != LOOM_JSON_ARRAY)
            return bad(l, LOOM_ERR_FORMAT, "%s.processors must be an array, got %s", where,
                       tname(list));
        for (size_t i = 0; i < list->n; i++) {
            char w[96];
            snprintf(w, sizeof w, "%s.processors[%zu]", where, i);
            if ((st = parse_processor(l, list->items[i], w, cur, n_cur, depth + 1))) return st;
        }
        return LOOM_OK;
    }
    return bad(l, LOOM_ERR_UNSUPPORTED,
               "%s \"%s\" is not supported (loom implements ByteLevel, TemplateProcessing and a "
               "Sequence of them)",
               where, type);
}

static loom_status parse_post_processor(ld *l, const loom_json *root) {
    const loom_json *pp = loom_json_get(root, "post_processor");
    if (is_null(pp)) return LOOM_OK;
    int32_t *cur = malloc(sizeof *cur);
    if (!cur) return oom(l);
    cur[0] = LOOM_TOK_SEQ;
    int32_t n = 1;
    loom_status st = parse_processor(l, pp, "post_processor", &cur, &n, 0);
    if (st) {
        free(cur);
        return st;
    }
    if (n == 1 && cur[0] == LOOM_TOK_SEQ) { /* adds nothing */
        free(cur);
        return LOOM_OK;
    }
    l->t->tmpl = cur;
    l->t->n_tmpl = n;
    return LOOM_OK;
}

/* ---------------------------------------------------------------------- */
/* Model and vocabulary                                                    */
/* ---------------------------------------------------------------------- */

static loom_status parse_model_options(ld *l, const loom_json *m, const char **unk) {
    loom_tokenizer *t = l->t;
    const char *type;
    loom_status st = type_of(l, m, "model", &type);
    if (st) return st;
    if (strcmp(type, "BPE"))
        return bad(l, LOOM_ERR_UNSUPPORTED, "model \"%s\" is not supported (loom implements BPE)",
                   type);
    const loom_json *v = loom_json_get(m, "dropout");
    if (!is_null(v)) {
        if (v->type != LOOM_JSON_NUMBER)
            return bad(l, LOOM_ERR_FORMAT, "model.dropout must be a number or null, got %s",
                       tname(v));
        if (!(v->d >= 0 && v->d <= 1))
            return bad(l, LOOM_ERR_FORMAT, "model.dropout = %g must be in [0, 1]", v->d);
        if (v->d > 0)
            return bad(l, LOOM_ERR_UNSUPPORTED,
                       "model.dropout = %g is not supported (BPE dropout is random; loom encodes "
                       "deterministically)",
                       v->d);
    }
    static const char *const affixes[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        v = loom_json_get(m, affixes[i]);
        if (is_null(v)) continue;
        if (v->type != LOOM_JSON_STRING)
            return bad(l, LOOM_ERR_FORMAT, "model.%s must be a string or null, got %s", affixes[i],
                       tname(v));
        if (v->slen)
            return bad(l, LOOM_ERR_UNSUPPORTED, "model.%s = \"%s\" is not supported", affixes[i],
                       v->s);
    }
    v = loom_json_get(m, "unk_token");
    if (!is_null(v)) {
        if (v->type != LOOM_JSON_STRING)
            return bad(l, LOOM_ERR_FORMAT, "model.unk_token must be a string or null, got %s",
                       tname(v));
        *unk = v->s;
    }
    bool byte_fallback = false;
    if ((st = get_bool(l, m, "fuse_unk", "model", &t->fuse_unk))) return st;
    if ((st = get_bool(l, m, "byte_fallback", "model", &byte_fallback))) return st;
    if ((st = get_bool(l, m, "ignore_merges", "model", &t->ignore_merges))) return st;
    if (byte_fallback)
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "model.byte_fallback = true is not supported (loom implements byte-level BPE)");
    return LOOM_OK;
}

/* Adds a string to the pool; its offset. */
static bool pool_add(loom_sb *pool, const char *s, size_t n, uint32_t *off) {
    if (pool->len + n > UINT32_MAX) return false;
    *off = (uint32_t)pool->len;
    if (n) loom_sb_append(pool, s, n);
    return !pool->failed;
}

static loom_status parse_merges(ld *l, const loom_json *m) {
    loom_tokenizer *t = l->t;
    const loom_json *merges = loom_json_get(m, "merges");
    if (!merges || merges->type != LOOM_JSON_ARRAY)
        return bad(l, LOOM_ERR_FORMAT, "model.merges must be an array, got %s", tname(merges));
    size_t n = merges->n;
    if (n > INT32_MAX) return bad(l, LOOM_ERR_UNSUPPORTED, "model.merges: too many merges");
    uint32_t cap = 16;
    while (cap < 2 * n + 1) cap *= 2;
    t->merges = malloc((size_t)cap * sizeof *t->merges);
    if (!t->merges) return oom(l);
    for (uint32_t i = 0; i < cap; i++) t->merges[i].key = UINT64_MAX;
    t->merge_mask = cap - 1;
    loom_sb cat;
    loom_sb_init(&cat);
    bool strings = n && merges->items[0]->type == LOOM_JSON_STRING;
    int64_t rank = 0;
    loom_status st = LOOM_OK;
    char b1[112], b2[112];
    for (size_t i = 0; i < n && !st; i++) {
        const loom_json *it = merges->items[i];
        const char *a, *bb;
        size_t na, nb;
        if (strings) {
            if (it->type != LOOM_JSON_STRING) {
                st = bad(l, LOOM_ERR_FORMAT,
                         "model.merges[%zu] is %s, but the merges before it are \"a b\" strings",
                         i, tname(it));
                break;
            }
            if (it->slen >= 8 && !memcmp(it->s, "#version", 8)) continue; /* HF skips these */
            const char *sp = memchr(it->s, ' ', it->slen);
            if (!sp || memchr(sp + 1, ' ', it->slen - (size_t)(sp + 1 - it->s))) {
                st = bad(l, LOOM_ERR_FORMAT,
                         "model.merges[%zu] = \"%s\" must be two tokens separated by one space",
                         i, show(it->s, it->slen, b1));
                break;
            }
            a = it->s;
            na = (size_t)(sp - it->s);
            bb = sp + 1;
            nb = it->slen - na - 1;
        } else {
            if (it->type != LOOM_JSON_ARRAY || it->n != 2 ||
                it->items[0]->type != LOOM_JSON_STRING || it->items[1]->type != LOOM_JSON_STRING) {
                st = bad(l, LOOM_ERR_FORMAT,
                         "model.merges[%zu] must be a pair of strings [\"a\", \"b\"] like the "
                         "merges before it, got %s",
                         i, tname(it));
                break;
            }
            a = it->items[0]->s;
            na = it->items[0]->slen;
            bb = it->items[1]->s;
            nb = it->items[1]->slen;
        }
        int32_t ia = loom_tok_lookup(t, &t->vocab, false, a, na);
        int32_t ib = loom_tok_lookup(t, &t->vocab, false, bb, nb);
        if (ia < 0 || ib < 0) {
            st = bad(l, LOOM_ERR_FORMAT, "model.merges[%zu] (\"%s\" \"%s\"): \"%s\" is not in the vocabulary",
                     i, show(a, na, b1), show(bb, nb, b2), ia < 0 ? b1 : b2);
            break;
        }
        cat.len = 0;
        loom_sb_append(&cat, a, na);
        loom_sb_append(&cat, bb, nb);
        if (cat.failed) {
            st = oom(l);
            break;
        }
        int32_t inew = loom_tok_lookup(t, &t->vocab, false, cat.buf, cat.len);
        if (inew < 0) {
            char b3[112];
            st = bad(l, LOOM_ERR_FORMAT,
                     "model.merges[%zu] (\"%s\" \"%s\"): the merged token \"%s\" is not in the "
                     "vocabulary",
                     i, b1, show(bb, nb, b2), show(cat.buf, cat.len, b3));
            (void)show(a, na, b1);
            break;
        }
        /* a pair listed twice keeps its last rank (HF collects into a map) */
        uint64_t key = (uint64_t)(uint32_t)ia << 32 | (uint32_t)ib;
        uint32_t s = loom_merge_slot(key) & t->merge_mask;
        while (t->merges[s].key != UINT64_MAX && t->merges[s].key != key) s = (s + 1) & t->merge_mask;
        t->merges[s] = (loom_merge){key, (uint32_t)rank++, inew};
    }
    loom_sb_free(&cat);
    t->n_merges = rank;
    return st;
}

/* The ByteLevel decoding of a string: its bytes when every character is in
 * the byte-level alphabet (*all = true), else the string itself. */
static void decode_bytes(const int16_t byte_of[324], const char *s, size_t n, loom_sb *out,
                         bool *all) {
    size_t start = out->len;
    *all = true;
    for (size_t i = 0; i < n;) {
        uint32_t c = loom_utf8_next((const unsigned char *)s, &i);
        int b = c < 324 ? byte_of[c] : -1;
        if (b < 0) {
            *all = false;
            break;
        }
        loom_sb_putc(out, (char)b);
    }
    if (!*all) {
        out->len = start;
        if (n) loom_sb_append(out, s, n);
    }
}

static loom_status build(ld *l, const loom_json *root) {
    loom_tokenizer *t = l->t;
    loom_status st;
    char b1[112];
    if (root->type != LOOM_JSON_OBJECT)
        return bad(l, LOOM_ERR_FORMAT, "a tokenizer.json is an object, got %s", tname(root));
    const loom_json *ver = loom_json_get(root, "version");
    if (!is_null(ver) && (ver->type != LOOM_JSON_STRING || strcmp(ver->s, "1.0")))
        return bad(l, LOOM_ERR_UNSUPPORTED, "version %s%s%s is not supported (loom reads \"1.0\")",
                   ver->type == LOOM_JSON_STRING ? "\"" : "",
                   ver->type == LOOM_JSON_STRING ? show(ver->s, ver->slen, b1) : tname(ver),
                   ver->type == LOOM_JSON_STRING ? "\"" : "");
    static const char *const off[] = {"truncation", "padding"};
    for (int i = 0; i < 2; i++)
        if (!is_null(loom_json_get(root, off[i])))
            return bad(l, LOOM_ERR_UNSUPPORTED,
                       "%s is set: loom encodes whole texts (save the tokenizer without %s)",
                       off[i], off[i]);

    /* ---- model options and vocabulary */
    const loom_json *m = loom_json_get(root, "model");
    if (!m) return bad(l, LOOM_ERR_FORMAT, "no \"model\"");
    const char *unk = NULL;
    if ((st = parse_model_options(l, m, &unk))) return st;
    if ((st = parse_normalizer(l, root))) return st;
    const loom_json *vocab = loom_json_get(m, "vocab");
    if (!vocab || vocab->type != LOOM_JSON_OBJECT)
        return bad(l, LOOM_ERR_FORMAT, "model.vocab must be an object, got %s", tname(vocab));
    const loom_json *added = loom_json_get(root, "added_tokens");
    if (!is_null(added) && added->type != LOOM_JSON_ARRAY)
        return bad(l, LOOM_ERR_FORMAT, "added_tokens must be an array, got %s", tname(added));
    size_t n_added = is_null(added) ? 0 : added->n;
    int64_t max_id = -1;
    for (size_t i = 0; i < vocab->n; i++) {
        const loom_json *v = vocab->items[i];
        if (v->type != LOOM_JSON_NUMBER || !v->is_int || v->i < 0 || v->i > INT32_MAX - 1)
            return bad(l, LOOM_ERR_FORMAT,
                       "model.vocab[\"%s\"] must be an id (an integer in [0, %d]), got %s",
                       show(vocab->keys[i], strlen(vocab->keys[i]), b1), INT32_MAX - 1,
                       v->type == LOOM_JSON_NUMBER ? "another number" : tname(v));
        if (v->i > max_id) max_id = v->i;
    }
    for (size_t i = 0; i < n_added; i++) {
        const loom_json *a = added->items[i];
        const loom_json *id = loom_json_get(a, "id");
        const loom_json *content = loom_json_get(a, "content");
        if (a->type != LOOM_JSON_OBJECT)
            return bad(l, LOOM_ERR_FORMAT, "added_tokens[%zu] must be an object, got %s", i,
                       tname(a));
        if (!id || id->type != LOOM_JSON_NUMBER || !id->is_int || id->i < 0 ||
            id->i > INT32_MAX - 1)
            return bad(l, LOOM_ERR_FORMAT,
                       "added_tokens[%zu].id must be an integer in [0, %d], got %s", i,
                       INT32_MAX - 1, id && id->type == LOOM_JSON_NUMBER ? "another number" : tname(id));
        if (!content || content->type != LOOM_JSON_STRING)
            return bad(l, LOOM_ERR_FORMAT, "added_tokens[%zu].content must be a string, got %s", i,
                       tname(content));
        if (id->i > max_id) max_id = id->i;
    }
    size_t count = vocab->n + n_added;
    if (max_id >= 0 && (uint64_t)max_id >= (uint64_t)ID_SLACK * count + ID_MARGIN)
        return bad(l, LOOM_ERR_UNSUPPORTED,
                   "the largest id, %" PRId64 ", is far beyond the %zu tokens (loom keeps ids in "
                   "dense arrays)",
                   max_id, count);
    t->n_ids = max_id + 1;
    t->n_model = (int64_t)vocab->n;
    size_t nid = (size_t)(t->n_ids ? t->n_ids : 1);
    t->str_off = calloc(nid, sizeof *t->str_off);
    t->str_len = malloc(nid * sizeof *t->str_len);
    t->dec_off = calloc(nid, sizeof *t->dec_off);
    t->dec_len = calloc(nid, sizeof *t->dec_len);
    t->is_model = calloc(nid, 1);
    t->is_bytes = calloc(nid, 1);
    if (!t->str_off || !t->str_len || !t->dec_off || !t->dec_len || !t->is_model || !t->is_bytes ||
        !hash_init(&t->vocab, vocab->n) || !hash_init(&t->vocab_bytes, vocab->n) ||
        !hash_init(&t->added_hash, n_added))
        return oom(l);
    for (size_t i = 0; i < nid; i++) t->str_len[i] = -1;
    st = LOOM_OK;

    /* ---- every string in one pool: the model's tokens, then added contents */
    loom_sb pool;
    loom_sb_init(&pool);
    for (size_t i = 0; i < vocab->n && !st; i++) {
        int32_t id = (int32_t)vocab->items[i]->i;
        const char *key = vocab->keys[i];
        size_t n = strlen(key);
        if (t->str_len[id] >= 0) {
            char b2[112];
            st = bad(l, LOOM_ERR_FORMAT,
                     "model.vocab: id %" PRId32 " is given to both \"%s\" and \"%s\"", id,
                     show(pool.buf + t->str_off[id], (size_t)t->str_len[id], b2),
                     show(key, n, b1));
        } else if (!pool_add(&pool, key, n, &t->str_off[id])) {
            st = oom(l);
        }
        t->str_len[id] = (int32_t)n;
        t->is_model[id] = 1;
    }
    t->added = calloc(n_added ? n_added : 1, sizeof *t->added);
    if (!st && !t->added) st = oom(l);
    for (size_t i = 0; i < n_added && !st; i++) {
        const loom_json *a = added->items[i];
        const loom_json *content = loom_json_get(a, "content");
        loom_added_token *at = &t->added[i];
        bool single_word = false;
        char where[48];
        snprintf(where, sizeof where, "added_tokens[%zu]", i);
        at->id = (int32_t)loom_json_get(a, "id")->i;
        if ((st = need_bool(l, a, "single_word", where, &single_word)) ||
            (st = need_bool(l, a, "lstrip", where, &at->lstrip)) ||
            (st = need_bool(l, a, "rstrip", where, &at->rstrip)) ||
            (st = need_bool(l, a, "normalized", where, &at->normalized)) ||
            (st = need_bool(l, a, "special", where, &at->special)))
            break;
        if (!content->slen) {
            st = bad(l, LOOM_ERR_FORMAT, "%s: the content is empty", where);
            break;
        }
        if (single_word) {
            st = bad(l, LOOM_ERR_UNSUPPORTED, "%s (\"%s\"): single_word = true is not supported",
                     where, show(content->s, content->slen, b1));
            break;
        }
        if (at->normalized && t->nfc) {
            loom_sb nfc;
            loom_sb_init(&nfc);
            loom_nfc_append(&nfc, content->s, content->slen);
            bool same = !nfc.failed && nfc.len == content->slen &&
                        !memcmp(nfc.buf, content->s, nfc.len);
            if (nfc.failed) st = oom(l);
            else if (!same)
                st = bad(l, LOOM_ERR_UNSUPPORTED,
                         "%s (\"%s\"): a normalized token whose content NFC changes is not "
                         "supported",
                         where, show(content->s, content->slen, b1));
            loom_sb_free(&nfc);
            if (st) break;
        }
        at->len = (uint32_t)content->slen;
        if (!pool_add(&pool, content->s, content->slen, &at->off)) {
            st = oom(l);
            break;
        }
        t->n_added = (int32_t)i + 1;
    }
    if (!st && !pool.buf) loom_sb_append(&pool, "", 0);
    if (!st && pool.failed) st = oom(l);
    t->pool = loom_sb_take(&pool);
    if (st) return st;
    if (!t->pool) return oom(l);

    /* the model's vocabulary by string */
    for (size_t i = 0; i < vocab->n; i++) {
        int32_t id = (int32_t)vocab->items[i]->i;
        hash_put(t, &t->vocab, false, t->pool + t->str_off[id], (size_t)t->str_len[id], id);
    }

    /* The ids Hugging Face gives added tokens: a token of the model keeps its
     * id; a new one gets the next id after the vocabulary (counted as HF does:
     * entries, not the largest id) or after the largest added id. HF versions
     * differ in when they count, so the file must agree with both ways. */
    int64_t max_added = -1, next_once = t->n_model;
    for (int32_t k = 0; k < t->n_added; k++) {
        loom_added_token *a = &t->added[k];
        const char *s = t->pool + a->off;
        int32_t mid = loom_tok_lookup(t, &t->vocab, false, s, a->len);
        int64_t want_each, want_once;
        if (mid >= 0) {
            want_each = want_once = mid;
        } else {
            want_each = max_added < 0                                   ? t->n_model
                        : (max_added >= t->n_model || t->n_model == 0) ? max_added + 1
                                                                        : t->n_model;
            want_once = next_once++;
        }
        if (a->id != want_each || a->id != want_once)
            return bad(l, LOOM_ERR_FORMAT,
                       "added_tokens[%d] (\"%s\") has id %" PRId32
                       ", but Hugging Face tokenizers gives it id %" PRId64
                       "%s and would renumber it: fix the file",
                       k, show(s, a->len, b1), a->id, a->id != want_each ? want_each : want_once,
                       mid >= 0 ? " (its id in model.vocab)" : "");
        if (mid < 0 && t->str_len[a->id] >= 0)
            return bad(l, LOOM_ERR_FORMAT,
                       "added_tokens[%d] (\"%s\") has id %" PRId32
                       ", which model.vocab gives another token",
                       k, show(s, a->len, b1), a->id);
        if (a->id > max_added) max_added = a->id;
        if (mid < 0) {
            t->str_off[a->id] = a->off;
            t->str_len[a->id] = (int32_t)a->len;
        }
    }
    /* content -> id of the added tokens; a content listed twice is refused */
    for (int32_t k = 0; k < t->n_added; k++) {
        loom_added_token *a = &t->added[k];
        if (hash_put(t, &t->added_hash, false, t->pool + a->off, a->len, a->id) >= 0)
            return bad(l, LOOM_ERR_FORMAT, "added_tokens[%d]: \"%s\" is listed twice", k,
                       show(t->pool + a->off, a->len, b1));
    }

    /* ---- decoded bytes of every id, and the byte-level index */
    uint32_t char_of[256];
    int16_t byte_of[324];
    byte_alphabet(char_of, byte_of);
    loom_sb dec;
    loom_sb_init(&dec);
    for (int64_t id = 0; id < t->n_ids; id++) {
        if (t->str_len[id] < 0) continue;
        bool all;
        t->dec_off[id] = (uint32_t)dec.len;
        decode_bytes(byte_of, t->pool + t->str_off[id], (size_t)t->str_len[id], &dec, &all);
        t->dec_len[id] = (uint32_t)(dec.len - t->dec_off[id]);
        t->is_bytes[id] = all && t->is_model[id] && t->str_len[id] > 0;
        if (dec.len > UINT32_MAX) {
            loom_sb_free(&dec);
            return bad(l, LOOM_ERR_UNSUPPORTED, "the vocabulary is too large");
        }
    }
    if (dec.failed) {
        loom_sb_free(&dec);
        return oom(l);
    }
    t->dec = dec.buf ? dec.buf : calloc(1, 1);
    if (!t->dec) return oom(l);
    for (int64_t id = 0; id < t->n_ids; id++)
        if (t->is_bytes[id])
            hash_put(t, &t->vocab_bytes, true, t->dec + t->dec_off[id], t->dec_len[id], (int32_t)id);
    for (int b = 0; b < 256; b++) {
        char u[4];
        size_t n = loom_utf8_put(char_of[b], u);
        t->byte_id[b] = loom_tok_lookup(t, &t->vocab, false, u, n);
    }
    t->unk_id = -1;
    if (unk) {
        t->unk_id = loom_tok_lookup(t, &t->vocab, false, unk, strlen(unk));
        if (t->unk_id < 0)
            return bad(l, LOOM_ERR_FORMAT, "model.unk_token \"%s\" is not in model.vocab",
                       show(unk, strlen(unk), b1));
    }

    /* ---- merges, matchers and the rest of the pipeline */
    if ((st = parse_merges(l, m))) return st;
    if (!trie_build(t, &t->trie_raw, false) || !trie_build(t, &t->trie_norm, true))
        return oom(l);
    if ((st = parse_pre_tokenizer(l, root))) return st;
    if ((st = parse_post_processor(l, root))) return st;
    return parse_decoder(l, root);
}

loom_status loom_tokenizer_parse(loom_ctx *ctx, const char *json, size_t len, const char *what,
                                 loom_tokenizer **out) {
    if (!out || (!json && len))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_tokenizer_parse: NULL argument");
    *out = NULL;
    if (!what) what = "tokenizer.json";
    loom_json *root = NULL;
    loom_status st = loom_json_parse(ctx, json ? json : "", len, what, &root);
    if (st) return st;
    ld l = {ctx, what, calloc(1, sizeof(loom_tokenizer))};
    if (!l.t) {
        loom_json_free(root);
        return loom_errf(ctx, LOOM_ERR_OOM, "%s: out of memory", what);
    }
    st = build(&l, root);
    loom_json_free(root);
    if (st) {
        loom_tokenizer_free(l.t);
        return st;
    }
    *out = l.t;
    return LOOM_OK;
}

loom_status loom_tokenizer_load(loom_ctx *ctx, const char *path, loom_tokenizer **out) {
    if (!path || !out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_tokenizer_load: NULL argument");
    *out = NULL;
    char *file = loom_dir_exists(path) ? loom_path_join(ctx, path, "tokenizer.json")
                                       : loom_strdup(ctx, path);
    if (!file) return LOOM_ERR_OOM;
    char *data = NULL;
    size_t len = 0;
    loom_status st = loom_read_file(ctx, file, 0, &data, &len);
    if (!st) st = loom_tokenizer_parse(ctx, data, len, file, out);
    free(data);
    free(file);
    return st;
}
