/* Datasets: JSONL lines parsed and validated into samples, encoded with a
 * tokenizer and chat template, truncated, and cached as a token file beside
 * the data. The rules are in dataset.h. */
#include "dataset.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../core/rng.h"
#include "chat.h"
#include "tokenizer.h"

static const char *const bad_lines_names[] = {"stop", "skip"};

loom_status loom_bad_lines_parse(loom_ctx *ctx, const char *name, loom_bad_lines *out) {
    for (int i = 0; i < 2; i++)
        if (name && !strcmp(name, bad_lines_names[i])) {
            *out = (loom_bad_lines)i;
            return LOOM_OK;
        }
    return loom_errf(ctx, LOOM_ERR_CONFIG, "bad-lines policy '%s' is not one of stop, skip",
                     name ? name : "");
}

loom_dataset_config loom_dataset_config_default(void) {
    return (loom_dataset_config){.seq_len = 0, .truncation = LOOM_TRUNC_ERROR,
                                 .bad_lines = LOOM_BAD_LINES_STOP, .append_eos = true};
}

/* ---------------------------------------------------------------------- */
/* One line                                                                */
/* ---------------------------------------------------------------------- */

bool loom_line_blank(const char *line, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (line[i] != ' ' && line[i] != '\t' && line[i] != '\r' && line[i] != '\n' &&
            line[i] != '\v' && line[i] != '\f')
            return false;
    return true;
}

/* Length of the UTF-8 sequence at s (strict: no overlong forms, no
 * surrogates, nothing past U+10FFFF), or 0 when it is not one. */
static size_t utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t k = c >= 0xC2 && c < 0xE0 ? 2 : c >= 0xE0 && c < 0xF0 ? 3 : c >= 0xF0 && c < 0xF5 ? 4 : 0;
    if (!k || n < k) return 0;
    for (size_t i = 1; i < k; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    if ((c == 0xE0 && s[1] < 0xA0) || (c == 0xED && s[1] >= 0xA0) || (c == 0xF0 && s[1] < 0x90) ||
        (c == 0xF4 && s[1] >= 0x90))
        return 0;
    return k;
}

size_t loom_utf8_find_invalid(const char *s, size_t len) {
    const unsigned char *u = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        size_t k = utf8_len(u + i, len - i);
        if (!k) return i;
        i += k;
    }
    return len;
}

/* A JSON string for a message: quoted, escaped, cut at about 40 bytes. */
static void quote(loom_sb *sb, const char *s, size_t len) {
    size_t n = len;
    if (n > 40) { /* cut at a character boundary */
        n = 40;
        while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80) n--;
    }
    loom_json_write_string(sb, s, n);
    if (n < len) loom_sb_puts(sb, "...");
}

#define SHAPES                                                                                 \
    "a sample is {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}, {\"text\": ...} or " \
    "{\"prompt\": ..., \"completion\": ...}"

static loom_status bad(loom_ctx *ctx, const char *where, const char *fmt, ...) LOOM_PRINTF(3, 4);
static loom_status bad(loom_ctx *ctx, const char *where, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: %s", where, msg);
}

static loom_status check_messages(loom_ctx *ctx, const char *where, const loom_json *m) {
    if (m->type != LOOM_JSON_ARRAY)
        return bad(ctx, where, "\"messages\" must be an array of {\"role\", \"content\"} objects, got %s",
                   loom_json_type_name(m->type));
    if (m->n == 0)
        return bad(ctx, where,
                   "empty conversation: \"messages\" is []; a sample needs at least one message");
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    for (size_t i = 0; i < m->n; i++) {
        const loom_json *msg = m->items[i];
        if (msg->type != LOOM_JSON_OBJECT)
            return bad(ctx, where, "messages[%zu] must be an object {\"role\", \"content\"}, got %s",
                       i, loom_json_type_name(msg->type));
        const loom_json *role = loom_json_get(msg, "role"), *content = loom_json_get(msg, "content");
        if (!role) return bad(ctx, where, "messages[%zu] has no \"role\"", i);
        if (role->type != LOOM_JSON_STRING)
            return bad(ctx, where, "messages[%zu].role must be a string, got %s", i,
                       loom_json_type_name(role->type));
        bool known = false;
        for (int r = 0; r < 4; r++)
            known |= role->slen == strlen(roles[r]) && !memcmp(role->s, roles[r], role->slen);
        if (!known) {
            loom_sb sb;
            loom_sb_init(&sb);
            quote(&sb, role->s, role->slen);
            loom_status st = bad(ctx, where,
                                 "messages[%zu] has unknown role %s (roles are system, user, "
                                 "assistant, tool)",
                                 i, sb.failed ? "?" : sb.buf);
            loom_sb_free(&sb);
            return st;
        }
        if (!content)
            return bad(ctx, where, "messages[%zu] (%s) has no \"content\"", i, role->s);
        if (content->type != LOOM_JSON_STRING)
            return bad(ctx, where,
                       "messages[%zu].content must be a string, got %s (content parts and tool "
                       "calls are not supported)",
                       i, loom_json_type_name(content->type));
    }
    return LOOM_OK;
}

/* The row's "tools" (transformers' tools=): a list of tool objects, or that
 * list JSON-encoded in a string (datasets store rows whose tools differ in
 * shape that way); null or absent: none. */
static loom_status parse_tools(loom_ctx *ctx, const char *where, const loom_json *t,
                               loom_sample *out) {
    if (!t || t->type == LOOM_JSON_NULL)
        return LOOM_OK;
    if (t->type == LOOM_JSON_STRING) {
        loom_status st = loom_json_parse(ctx, t->s, t->slen, "tools", &out->tools_doc);
        if (st == LOOM_ERR_OOM)
            return st;
        if (st)
            return bad(ctx, where,
                       "\"tools\" is a string but not JSON (it should be a list of tools, or "
                       "that list JSON-encoded): %s",
                       loom_last_error(ctx));
        t = out->tools_doc;
        if (t->type == LOOM_JSON_NULL)
            return LOOM_OK;
    }
    if (loom_chat_check_tools(ctx, t))
        return bad(ctx, where, "%s%s", loom_last_error(ctx),
                   t == out->tools_doc ? " (decoded from the JSON string \"tools\")" : "");
    out->tools = t;
    return LOOM_OK;
}

/* "FILE:LINE: line 1, column C: problem" from the JSON parser becomes
 * "FILE:LINE: malformed JSON at column C: problem". */
static loom_status json_error(loom_ctx *ctx, const char *where) {
    char msg[LOOM_ERR_MAX];
    snprintf(msg, sizeof msg, "%s", loom_last_error(ctx));
    size_t wl = strlen(where);
    const char *tail = msg;
    if (!strncmp(msg, where, wl) && !strncmp(msg + wl, ": ", 2)) tail = msg + wl + 2;
    if (!strncmp(tail, "line 1, column ", 15))
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: malformed JSON at column %s", where, tail + 15);
    return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: malformed JSON: %s", where, tail);
}

static loom_status need_string(loom_ctx *ctx, const char *where, const char *key,
                               const loom_json *v, bool nonempty) {
    if (v->type == LOOM_JSON_ARRAY && strcmp(key, "text"))
        return bad(ctx, where,
                   "\"%s\" is an array: conversational prompt/completion is not supported; put the "
                   "whole conversation in \"messages\"",
                   key);
    if (v->type != LOOM_JSON_STRING)
        return bad(ctx, where, "\"%s\" must be a string, got %s", key, loom_json_type_name(v->type));
    if (nonempty && v->slen == 0)
        return bad(ctx, where, "\"%s\" is empty: there is nothing to train on", key);
    return LOOM_OK;
}

loom_status loom_sample_parse(loom_ctx *ctx, const char *line, size_t len, const char *where,
                              loom_sample *out) {
    memset(out, 0, sizeof *out);
    size_t badb = loom_utf8_find_invalid(line, len);
    if (badb < len)
        return bad(ctx, where,
                   "invalid UTF-8 at byte %zu of the line (0x%02x); JSONL must be UTF-8 text", badb,
                   (unsigned char)line[badb]);
    loom_json *doc = NULL;
    loom_status st = loom_json_parse(ctx, line, len, where, &doc);
    if (st == LOOM_ERR_OOM) return st;
    if (st) return json_error(ctx, where);
    if (doc->type != LOOM_JSON_OBJECT) {
        st = bad(ctx, where, "expected a JSON object, got %s; " SHAPES,
                 loom_json_type_name(doc->type));
        loom_json_free(doc);
        return st;
    }
    const loom_json *m = loom_json_get(doc, "messages"), *t = loom_json_get(doc, "text"),
                    *p = loom_json_get(doc, "prompt"), *c = loom_json_get(doc, "completion");
    int shapes = (m != NULL) + (t != NULL) + (p || c);
    if (shapes > 1) {
        st = bad(ctx, where, "has %s and %s: give one of them; " SHAPES,
                 m ? "\"messages\"" : "\"text\"",
                 m && t ? "\"text\"" : (p ? "\"prompt\"" : "\"completion\""));
    } else if (shapes == 0) {
        loom_sb sb;
        loom_sb_init(&sb);
        for (size_t i = 0; i < doc->n && i < 6; i++) {
            if (i) loom_sb_puts(&sb, ", ");
            quote(&sb, doc->keys[i], strlen(doc->keys[i]));
        }
        if (doc->n > 6) loom_sb_puts(&sb, ", ...");
        st = bad(ctx, where, "no \"messages\", \"text\" or \"prompt\"/\"completion\" field (%s%s); " SHAPES,
                 doc->n ? "its keys: " : "the object is empty",
                 doc->n && !sb.failed ? sb.buf : "");
        loom_sb_free(&sb);
    } else if (m) {
        out->kind = LOOM_SAMPLE_MESSAGES;
        out->messages = m;
        st = check_messages(ctx, where, m);
        if (!st)
            st = parse_tools(ctx, where, loom_json_get(doc, "tools"), out);
    } else if (t) {
        out->kind = LOOM_SAMPLE_TEXT;
        st = need_string(ctx, where, "text", t, true);
        if (!st) {
            out->text = t->s;
            out->text_len = t->slen;
        }
    } else if (!p || !c) {
        st = bad(ctx, where, "\"%s\" without \"%s\"; " SHAPES, p ? "prompt" : "completion",
                 p ? "completion" : "prompt");
    } else {
        out->kind = LOOM_SAMPLE_PROMPT_COMPLETION;
        st = need_string(ctx, where, "prompt", p, false);
        if (!st) st = need_string(ctx, where, "completion", c, true);
        if (!st) {
            out->prompt = p->s;
            out->prompt_len = p->slen;
            out->completion = c->s;
            out->completion_len = c->slen;
        }
    }
    const loom_json *tools = loom_json_get(doc, "tools");
    if (!st && !m && tools && tools->type != LOOM_JSON_NULL)
        st = bad(ctx, where,
                 "has \"tools\" but no \"messages\": tools go to the chat template with a "
                 "conversation; a %s sample has no template",
                 t ? "text" : "prompt/completion");
    if (st) {
        loom_json_free(out->tools_doc);
        loom_json_free(doc);
        memset(out, 0, sizeof *out);
        return st;
    }
    out->doc = doc;
    return LOOM_OK;
}

void loom_sample_free(loom_sample *s) {
    if (!s) return;
    loom_json_free(s->tools_doc);
    loom_json_free(s->doc);
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------------- */
/* Encoders                                                                */
/* ---------------------------------------------------------------------- */

typedef struct loaded_encoder {
    loom_dataset_encoder e; /* first: the public part */
    loom_tokenizer *tok;
    loom_tokenizer_encoder *wenc; /* reusable workspace with a word cache (one thread) */
    loom_chat *chat;
    char *eos;
    char *chat_error;
} loaded_encoder;

static loom_status tok_encode_text(loom_ctx *ctx, void *self, const char *text, size_t len,
                                   int32_t **ids, int64_t *n) {
    /* the same ids as loom_tokenizer_encode, 3-4x faster over many texts */
    return loom_tokenizer_encoder_encode(ctx, ((loaded_encoder *)self)->wenc, text, len, false, ids,
                                         n);
}

static loom_status tok_encode_chat(loom_ctx *ctx, void *self, const loom_json *messages,
                                   const loom_json *tools, int32_t **ids, uint8_t **mask,
                                   int64_t *n) {
    loaded_encoder *le = self;
    return loom_chat_encode(ctx, le->chat, le->tok, messages, tools, ids, mask, n);
}

static uint64_t fnv1a(uint64_t h, const void *data, size_t len) {
    const unsigned char *p = data;
    for (size_t i = 0; i < len; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t fnv_u64(uint64_t h, uint64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(v >> (8 * i));
    return fnv1a(h, b, 8);
}

/* Adds a file's name and bytes (or its absence) to the hash. */
static loom_status hash_file(loom_ctx *ctx, uint64_t *h, const char *dir, const char *name) {
    char *path = loom_path_join(ctx, dir, name);
    if (!path) return LOOM_ERR_OOM;
    *h = fnv1a(*h, name, strlen(name) + 1);
    loom_status st = LOOM_OK;
    if (loom_file_exists(path)) {
        char *data;
        size_t len;
        st = loom_read_file(ctx, path, 0, &data, &len);
        if (!st) {
            *h = fnv_u64(fnv1a(*h, data, len), len);
            free(data);
        }
    } else {
        *h = fnv_u64(*h, UINT64_MAX);
    }
    free(path);
    return st;
}

void loom_dataset_encoder_free(loom_dataset_encoder *e) {
    if (!e) return;
    loaded_encoder *le = (loaded_encoder *)e;
    loom_tokenizer_encoder_free(le->wenc);
    loom_tokenizer_free(le->tok);
    loom_chat_free(le->chat);
    free(le->eos);
    free(le->chat_error);
    free(le);
}

loom_status loom_dataset_encoder_load(loom_ctx *ctx, const char *dir, loom_dataset_encoder **out) {
    *out = NULL;
    loaded_encoder *le = loom_calloc(ctx, 1, sizeof *le, "dataset encoder");
    if (!le) return LOOM_ERR_OOM;
    char *base = NULL, *cfg_path = NULL;
    loom_json *cfg = NULL;
    loom_status st = LOOM_OK;
    if (loom_dir_exists(dir)) {
        base = loom_strdup(ctx, dir);
    } else { /* a tokenizer.json path: its directory holds the rest */
        const char *slash = strrchr(dir, '/');
        base = slash ? loom_strndup(ctx, dir, (size_t)(slash - dir) + (slash == dir)) : loom_strdup(ctx, ".");
    }
    if (!base) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    if ((st = loom_tokenizer_load(ctx, dir, &le->tok))) goto fail;
    if ((st = loom_tokenizer_encoder_create(ctx, le->tok, &le->wenc))) goto fail;
    le->e.self = le;
    le->e.tokenizer = le->tok;
    le->e.encode_text = tok_encode_text;
    le->e.vocab_size = loom_tokenizer_vocab_size(le->tok);
    le->e.eos_id = -1;
    /* the chat template: optional until a "messages" sample needs it */
    if (loom_chat_load(ctx, base, &le->chat) == LOOM_OK) {
        le->e.encode_chat = tok_encode_chat;
    } else {
        if (!(le->chat_error = loom_strdup(ctx, loom_last_error(ctx)))) {
            st = LOOM_ERR_OOM;
            goto fail;
        }
        le->e.chat_error = le->chat_error;
        loom_clear_error(ctx);
    }
    /* the EOS token: tokenizer_config.json's eos_token (a string or {"content": ...}) */
    if (!(cfg_path = loom_path_join(ctx, base, "tokenizer_config.json"))) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    if (loom_file_exists(cfg_path)) {
        if ((st = loom_json_parse_file(ctx, cfg_path, &cfg))) goto fail;
        const loom_json *eos = loom_json_get(cfg, "eos_token");
        if (eos && eos->type == LOOM_JSON_OBJECT) eos = loom_json_get(eos, "content");
        if (eos && eos->type == LOOM_JSON_STRING && eos->slen) {
            int32_t id = loom_tokenizer_token_id(le->tok, eos->s);
            if (id < 0) {
                st = loom_errf(ctx, LOOM_ERR_FORMAT,
                               "%s: eos_token \"%s\" is not a token of the tokenizer", cfg_path,
                               eos->s);
                goto fail;
            }
            if (!(le->eos = loom_strdup(ctx, eos->s))) {
                st = LOOM_ERR_OOM;
                goto fail;
            }
            le->e.eos_id = id;
            le->e.eos_token = le->eos;
        } else if (eos && eos->type != LOOM_JSON_NULL) {
            st = loom_errf(ctx, LOOM_ERR_FORMAT,
                           "%s: eos_token must be a string or {\"content\": \"...\"}, got %s",
                           cfg_path, loom_json_type_name(eos->type));
            goto fail;
        }
    }
    /* the fingerprint: every file that decides ids, and the template kind */
    uint64_t h = 0xcbf29ce484222325ull;
    if (loom_dir_exists(dir)) {
        if ((st = hash_file(ctx, &h, dir, "tokenizer.json"))) goto fail;
    } else {
        char *data;
        size_t len;
        if ((st = loom_read_file(ctx, dir, 0, &data, &len))) goto fail;
        h = fnv_u64(fnv1a(h, data, len), len);
        free(data);
    }
    if ((st = hash_file(ctx, &h, base, "tokenizer_config.json"))) goto fail;
    if ((st = hash_file(ctx, &h, base, "chat_template.jinja"))) goto fail;
    h = fnv_u64(h, le->chat ? (uint64_t)loom_chat_kind_of(le->chat) : UINT64_MAX);
    le->e.fingerprint = loom_splitmix64(h);
    free(base);
    free(cfg_path);
    loom_json_free(cfg);
    *out = &le->e;
    return LOOM_OK;
fail:
    free(base);
    free(cfg_path);
    loom_json_free(cfg);
    loom_dataset_encoder_free(&le->e);
    return st;
}

static bool ends_with(const char *s, size_t len, const char *suffix) {
    size_t n = strlen(suffix);
    return len >= n && !memcmp(s + len - n, suffix, n);
}

/* Appends the EOS id to *ids (growing it) when the text does not end with
 * the EOS token already. */
static loom_status add_eos(loom_ctx *ctx, const loom_dataset_encoder *e, const char *text,
                           size_t len, int32_t **ids, int64_t *n) {
    if (e->eos_id < 0 || !e->eos_token)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "appending the EOS token to \"text\" and \"completion\" samples needs the "
                         "tokenizer's eos_token (tokenizer_config.json), and it has none; turn "
                         "append_eos off (--no-append-eos)");
    if (ends_with(text, len, e->eos_token)) return LOOM_OK;
    int32_t *p = loom_realloc(ctx, *ids, (size_t)(*n + 1) * sizeof *p, "token ids");
    if (!p) return LOOM_ERR_OOM;
    p[(*n)++] = e->eos_id;
    *ids = p;
    return LOOM_OK;
}

loom_status loom_dataset_encode(loom_ctx *ctx, const loom_dataset_encoder *e, const loom_sample *s,
                                bool append_eos, int32_t **ids, uint8_t **mask, int64_t *n,
                                bool *prompt_mismatch) {
    *ids = NULL;
    *mask = NULL;
    *n = 0;
    if (prompt_mismatch) *prompt_mismatch = false;
    loom_status st = LOOM_OK;
    switch (s->kind) {
    case LOOM_SAMPLE_TEXT:
        st = e->encode_text(ctx, e->self, s->text, s->text_len, ids, n);
        if (!st && append_eos) st = add_eos(ctx, e, s->text, s->text_len, ids, n);
        break;
    case LOOM_SAMPLE_MESSAGES:
        if (!e->encode_chat)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "a \"messages\" sample needs the model's chat template: %s",
                             e->chat_error ? e->chat_error : "this encoder has none");
        st = e->encode_chat(ctx, e->self, s->messages, s->tools, ids, mask, n);
        break;
    case LOOM_SAMPLE_PROMPT_COMPLETION: {
        size_t len = s->prompt_len + s->completion_len;
        char *full = loom_malloc(ctx, len + 1, "prompt + completion");
        if (!full) return LOOM_ERR_OOM;
        memcpy(full, s->prompt, s->prompt_len);
        memcpy(full + s->prompt_len, s->completion, s->completion_len);
        full[len] = '\0';
        int32_t *pids = NULL;
        int64_t np = 0;
        st = e->encode_text(ctx, e->self, full, len, ids, n);
        free(full);
        if (!st && s->prompt_len) st = e->encode_text(ctx, e->self, s->prompt, s->prompt_len, &pids, &np);
        if (!st && append_eos) st = add_eos(ctx, e, s->completion, s->completion_len, ids, n);
        if (!st) {
            bool mismatch = np > *n || (np && memcmp(pids, *ids, (size_t)np * sizeof *pids));
            if (prompt_mismatch) *prompt_mismatch = mismatch;
            if (!(*mask = loom_malloc(ctx, (size_t)(*n ? *n : 1), "loss mask"))) st = LOOM_ERR_OOM;
            for (int64_t i = 0; !st && i < *n; i++) (*mask)[i] = i >= np;
        }
        free(pids);
        break;
    }
    }
    if (st) {
        free(*ids);
        free(*mask);
        *ids = NULL;
        *mask = NULL;
        *n = 0;
    }
    return st;
}

/* ---------------------------------------------------------------------- */
/* Building                                                                */
/* ---------------------------------------------------------------------- */

void loom_token_data_free(loom_token_data *d) {
    if (!d) return;
    free(d->ids);
    free(d->offsets);
    free(d->mask);
    memset(d, 0, sizeof *d);
}

/* Errors about a line that --bad-lines skip may pass over; others (no
 * memory, unreadable files, a missing chat template or EOS) stop. */
static bool line_error(loom_status st) {
    return st == LOOM_ERR_FORMAT || st == LOOM_ERR_INVALID_ARG || st == LOOM_ERR_UNSUPPORTED ||
           st == LOOM_ERR_NOT_FOUND;
}

typedef struct growing {
    uint32_t *ids;
    uint8_t *mask;
    uint64_t *off;
    size_t n_tok, cap_tok, n_doc, cap_doc;
} growing;

static loom_status grow_append(loom_ctx *ctx, growing *g, const int32_t *ids, const uint8_t *mask,
                               int64_t n) {
    if (g->n_tok + (size_t)n > g->cap_tok) {
        size_t cap = g->cap_tok ? g->cap_tok : 4096;
        while (cap < g->n_tok + (size_t)n) cap *= 2;
        uint32_t *p = loom_realloc(ctx, g->ids, cap * sizeof *p, "token ids");
        if (!p) return LOOM_ERR_OOM;
        g->ids = p;
        if (g->mask) {
            uint8_t *q = loom_realloc(ctx, g->mask, cap, "loss mask");
            if (!q) return LOOM_ERR_OOM;
            g->mask = q;
        }
        g->cap_tok = cap;
    }
    if (g->n_doc + 2 > g->cap_doc) {
        size_t cap = g->cap_doc ? g->cap_doc * 2 : 1024;
        uint64_t *p = loom_realloc(ctx, g->off, cap * sizeof *p, "document offsets");
        if (!p) return LOOM_ERR_OOM;
        g->off = p;
        g->cap_doc = cap;
        if (g->n_doc == 0) g->off[0] = 0;
    }
    bool need_mask = false;
    for (int64_t i = 0; mask && i < n; i++) need_mask |= !mask[i];
    if (need_mask && !g->mask) { /* the first sample with a 0: every earlier token is 1 */
        if (!(g->mask = loom_malloc(ctx, g->cap_tok, "loss mask"))) return LOOM_ERR_OOM;
        memset(g->mask, 1, g->n_tok);
    }
    for (int64_t i = 0; i < n; i++) g->ids[g->n_tok + (size_t)i] = (uint32_t)ids[i];
    if (g->mask) {
        if (mask)
            memcpy(g->mask + g->n_tok, mask, (size_t)n);
        else
            memset(g->mask + g->n_tok, 1, (size_t)n);
    }
    g->n_tok += (size_t)n;
    g->off[++g->n_doc] = g->n_tok;
    return LOOM_OK;
}

loom_status loom_dataset_build(loom_ctx *ctx, FILE *f, const char *name,
                               const loom_dataset_encoder *e, const loom_dataset_config *cfg,
                               loom_token_data *out, loom_dataset_report *rep) {
    memset(out, 0, sizeof *out);
    memset(rep, 0, sizeof *rep);
    growing g = {0};
    char *line = NULL, where[1100];
    size_t cap = 0;
    ssize_t got;
    loom_status st = LOOM_OK;
    const int64_t S = cfg->seq_len;
    while ((got = getline(&line, &cap, f)) >= 0) {
        size_t len = (size_t)got;
        rep->lines++;
        if (len && line[len - 1] == '\n') len--;
        if (len && line[len - 1] == '\r') len--;
        if (loom_line_blank(line, len)) {
            rep->blank_lines++;
            continue;
        }
        snprintf(where, sizeof where, "%s:%" PRId64, name, rep->lines);
        loom_sample s;
        int32_t *ids = NULL;
        uint8_t *mask = NULL;
        int64_t n = 0;
        bool mismatch = false;
        st = loom_sample_parse(ctx, line, len, where, &s);
        if (!st) {
            st = loom_dataset_encode(ctx, e, &s, cfg->append_eos, &ids, &mask, &n, &mismatch);
            if (st) loom_err_prefix(ctx, "%s", where);
            else if (n == 0)
                st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: the sample encodes to no token", where);
        }
        loom_sample_kind kind = s.kind;
        loom_sample_free(&s);
        if (st) {
            free(ids);
            free(mask);
            if (!line_error(st) || cfg->bad_lines == LOOM_BAD_LINES_STOP) goto fail;
            if (rep->bad_lines++ == 0)
                snprintf(rep->first_bad, sizeof rep->first_bad, "%s", loom_last_error(ctx));
            loom_clear_error(ctx);
            st = LOOM_OK;
            continue;
        }
        if (S > 0 && n > S) {
            if (cfg->truncation == LOOM_TRUNC_ERROR) {
                st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                               "%s: the sample has %" PRId64 " tokens, more than seq_len = %" PRId64
                               "; give a larger --seq-len or --truncation left, right or drop",
                               where, n, S);
                free(ids);
                free(mask);
                goto fail;
            }
            if (cfg->truncation == LOOM_TRUNC_DROP) {
                rep->dropped++;
                free(ids);
                free(mask);
                continue;
            }
            if (cfg->truncation == LOOM_TRUNC_LEFT) {
                memmove(ids, ids + (n - S), (size_t)S * sizeof *ids);
                if (mask) memmove(mask, mask + (n - S), (size_t)S);
            }
            n = S;
            rep->truncated++;
        }
        int64_t loss = 0;
        for (int64_t i = 1; i < n; i++) loss += !mask || mask[i];
        st = grow_append(ctx, &g, ids, mask, n);
        free(ids);
        free(mask);
        if (st) goto fail;
        rep->samples++;
        rep->tokens += n;
        rep->loss_tokens += loss;
        rep->no_loss += loss == 0;
        rep->prompt_mismatch += mismatch;
        if (kind == LOOM_SAMPLE_TEXT) rep->text++;
        else if (kind == LOOM_SAMPLE_MESSAGES) rep->messages++;
        else rep->prompt_completion++;
    }
    if (ferror(f)) {
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: read failed after line %" PRId64 ": %s", name,
                       rep->lines, strerror(errno));
        goto fail;
    }
    if (rep->samples == 0) {
        char first[600] = "";
        if (rep->bad_lines) snprintf(first, sizeof first, " (the first: %s)", rep->first_bad);
        st = loom_errf(ctx, LOOM_ERR_FORMAT,
                       "%s: no sample to train on: %" PRId64 " lines: %" PRId64 " blank, %" PRId64
                       " bad and skipped%s, %" PRId64 " longer than seq_len and dropped",
                       name, rep->lines, rep->blank_lines, rep->bad_lines, first, rep->dropped);
        goto fail;
    }
    free(line);
    out->ids = g.ids;
    out->mask = g.mask;
    out->offsets = g.off;
    out->n_tokens = (int64_t)g.n_tok;
    out->n_docs = (int64_t)g.n_doc;
    return LOOM_OK;
fail:
    free(line);
    free(g.ids);
    free(g.mask);
    free(g.off);
    return st;
}

/* ---------------------------------------------------------------------- */
/* The cache                                                               */
/* ---------------------------------------------------------------------- */

bool loom_dataset_is_jsonl(const char *path) {
    return path && ends_with(path, strlen(path), ".jsonl");
}

loom_status loom_dataset_cache_key(loom_ctx *ctx, const char *jsonl_path,
                                   const loom_dataset_encoder *e, const loom_dataset_config *cfg,
                                   uint64_t *key) {
    struct stat sb;
    if (stat(jsonl_path, &sb) != 0)
        return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot open: %s", jsonl_path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        return loom_errf(ctx, LOOM_ERR_IO, "%s: not a regular file (expected JSONL)", jsonl_path);
    uint64_t h = 0xcbf29ce484222325ull;
    const uint64_t parts[] = {
        LOOM_DATASET_CACHE_VERSION,  LOOM_TOKFILE_VERSION,
        (uint64_t)sb.st_size,        (uint64_t)sb.st_mtim.tv_sec,
        (uint64_t)sb.st_mtim.tv_nsec, e->fingerprint,
        (uint64_t)(int64_t)e->eos_id, (uint64_t)e->vocab_size,
        cfg->append_eos,             (uint64_t)cfg->seq_len,
        (uint64_t)cfg->truncation,   (uint64_t)cfg->bad_lines,
    };
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) h = fnv_u64(h, parts[i]);
    *key = loom_splitmix64(h);
    return LOOM_OK;
}

#define REPORT_FIELDS(X)                                                                       \
    X(lines) X(blank_lines) X(bad_lines) X(samples) X(text) X(messages) X(prompt_completion)  \
    X(truncated) X(dropped) X(no_loss) X(prompt_mismatch) X(tokens) X(loss_tokens)

static loom_status write_report(loom_ctx *ctx, const char *path, const char *source,
                                const loom_dataset_config *cfg, const loom_dataset_report *rep) {
    loom_json *o = loom_json_new_object(ctx);
    if (!o) return LOOM_ERR_OOM;
    loom_status st = loom_json_set(ctx, o, "source", loom_json_new_str(ctx, source));
#define SET_FIELD(f) \
    if (!st) st = loom_json_set(ctx, o, #f, loom_json_new_int(ctx, rep->f));
    REPORT_FIELDS(SET_FIELD)
#undef SET_FIELD
    if (!st) st = loom_json_set(ctx, o, "first_bad", loom_json_new_str(ctx, rep->first_bad));
    if (!st) st = loom_json_set(ctx, o, "seq_len", loom_json_new_int(ctx, cfg->seq_len));
    if (!st)
        st = loom_json_set(ctx, o, "truncation",
                           loom_json_new_str(ctx, loom_truncation_name(cfg->truncation)));
    if (!st)
        st = loom_json_set(ctx, o, "bad_lines_policy",
                           loom_json_new_str(ctx, bad_lines_names[cfg->bad_lines & 1]));
    if (!st) st = loom_json_set(ctx, o, "append_eos", loom_json_new_bool(ctx, cfg->append_eos));
    loom_sb sb;
    loom_sb_init(&sb);
    if (!st) st = loom_json_write(ctx, o, 2, &sb);
    if (!st && sb.failed) st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory writing %s", path);
    if (!st) {
        loom_sb_putc(&sb, '\n');
        st = loom_write_file_atomic(ctx, path, sb.buf, sb.len);
    }
    loom_sb_free(&sb);
    loom_json_free(o);
    return st;
}

/* Reads a report written by write_report; false when it cannot be used. */
static bool read_report(loom_ctx *ctx, const char *path, loom_dataset_report *rep) {
    loom_json *o = NULL;
    if (loom_json_parse_file(ctx, path, &o)) {
        loom_clear_error(ctx);
        return false;
    }
    bool ok = true;
    const loom_json *v;
#define GET_FIELD(f)                                                         \
    v = loom_json_get(o, #f);                                                \
    if (v && v->type == LOOM_JSON_NUMBER && v->is_int) rep->f = v->i;        \
    else ok = false;
    REPORT_FIELDS(GET_FIELD)
#undef GET_FIELD
    v = loom_json_get(o, "first_bad");
    if (v && v->type == LOOM_JSON_STRING)
        snprintf(rep->first_bad, sizeof rep->first_bad, "%s", v->s);
    else
        ok = false;
    loom_json_free(o);
    return ok;
}

loom_status loom_dataset_open(loom_ctx *ctx, const char *path, const loom_dataset_encoder *e,
                              const loom_dataset_config *cfg, loom_tokfile **out,
                              loom_dataset_report *rep) {
    *out = NULL;
    loom_dataset_report tmp;
    if (!rep) rep = &tmp;
    memset(rep, 0, sizeof *rep);
    loom_dataset_config def = loom_dataset_config_default();
    if (!cfg) cfg = &def;
    if (!loom_dataset_is_jsonl(path)) { /* a token file as it is */
        loom_status st = loom_tokfile_open(ctx, path, out);
        if (st) return st;
        snprintf(rep->cache, sizeof rep->cache, "%s", path);
        rep->reused = true;
        rep->samples = loom_tokfile_n_docs(*out);
        rep->tokens = loom_tokfile_n_tokens(*out);
        return LOOM_OK;
    }
    if (!e)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "%s: JSONL data needs a tokenizer (a model directory with tokenizer.json)",
                         path);
    uint64_t key;
    loom_status st = loom_dataset_cache_key(ctx, path, e, cfg, &key);
    if (st) return st;
    char report_path[1100];
    int w1 = snprintf(rep->cache, sizeof rep->cache, "%s.%016" PRIx64 ".tokens", path, key);
    int w2 = snprintf(report_path, sizeof report_path, "%s.%016" PRIx64 ".report.json", path, key);
    if (w1 < 0 || (size_t)w1 >= sizeof rep->cache || w2 < 0 || (size_t)w2 >= sizeof report_path)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: path too long", path);
    if (loom_file_exists(rep->cache) && loom_file_exists(report_path)) {
        loom_dataset_report old = *rep;
        if (read_report(ctx, report_path, rep) && loom_tokfile_open(ctx, rep->cache, out) == LOOM_OK) {
            rep->reused = true;
            return LOOM_OK;
        }
        LOOM_LOG_W(ctx, "%s: the token cache %s cannot be used (%s); tokenizing again", path,
                   rep->cache, loom_last_error(ctx));
        loom_clear_error(ctx);
        *rep = old;
    }
    if (cfg->reuse_only)
        return loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                         "%s: no usable token cache %s (rank 0 of the job builds it: do the ranks "
                         "share a filesystem?)",
                         path, rep->cache);
    FILE *f = fopen(path, "rb");
    if (!f) return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    loom_token_data td;
    char cache[sizeof rep->cache];
    memcpy(cache, rep->cache, sizeof cache);
    st = loom_dataset_build(ctx, f, path, e, cfg, &td, rep);
    fclose(f);
    memcpy(rep->cache, cache, sizeof cache);
    if (st) return st;
    st = write_report(ctx, report_path, path, cfg, rep);
    if (!st)
        st = loom_tokfile_write(ctx, rep->cache, td.ids, td.n_tokens, td.offsets, td.n_docs, td.mask,
                                (uint64_t)(e->vocab_size > 0 ? e->vocab_size : 0));
    loom_token_data_free(&td);
    if (st)
        return loom_err_prefix(ctx,
                               "%s: cannot write its token cache beside it (the directory must be "
                               "writable)",
                               path);
    return loom_tokfile_open(ctx, rep->cache, out);
}

void loom_dataset_report_log(loom_ctx *ctx, const char *path, const loom_dataset_report *rep) {
    char a[32], b[32], c[32];
    LOOM_LOG_I(ctx,
               "data %s: %s samples (%" PRId64 " messages, %" PRId64 " text, %" PRId64
               " prompt/completion), %s tokens, %s with loss; token cache %s (%s)",
               path, loom_fmt_int(a, rep->samples), rep->messages, rep->text,
               rep->prompt_completion, loom_fmt_int(b, rep->tokens),
               loom_fmt_int(c, rep->loss_tokens), rep->cache, rep->reused ? "reused" : "built");
    if (rep->bad_lines)
        LOOM_LOG_W(ctx, "%s: %" PRId64 " bad line%s skipped (--bad-lines skip); the first: %s",
                   path, rep->bad_lines, rep->bad_lines == 1 ? "" : "s", rep->first_bad);
    if (rep->dropped)
        LOOM_LOG_W(ctx, "%s: %" PRId64 " sample%s longer than seq_len dropped (--truncation drop)",
                   path, rep->dropped, rep->dropped == 1 ? "" : "s");
    if (rep->truncated)
        LOOM_LOG_I(ctx, "%s: %" PRId64 " sample%s longer than seq_len truncated", path,
                   rep->truncated, rep->truncated == 1 ? "" : "s");
    if (rep->no_loss)
        LOOM_LOG_W(ctx,
                   "%s: %" PRId64 " sample%s have no token to predict (no assistant message, or "
                   "truncation cut it off); they train nothing",
                   path, rep->no_loss, rep->no_loss == 1 ? "" : "s");
    if (rep->prompt_mismatch)
        LOOM_LOG_W(ctx,
                   "%s: in %" PRId64 " prompt/completion sample%s the prompt's tokens are not a "
                   "prefix of the tokens of prompt + completion (a token spans the boundary); "
                   "the loss mask starts after len(tokenize(prompt)) tokens, as TRL's",
                   path, rep->prompt_mismatch, rep->prompt_mismatch == 1 ? "" : "s");
}
