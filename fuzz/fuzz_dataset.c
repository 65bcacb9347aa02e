/* libFuzzer target for the JSONL sample parser and the dataset build, with
 * a byte-level encoder (no tokenizer needed), then the loader over what was
 * built.
 *
 * Every line of the input goes through loom_sample_parse: a refusal must
 * start with "fuzz.jsonl:LINE: " and leave no document; an accepted sample
 * must keep the promises of dataset.h (its kind's fields present, strings
 * valid UTF-8, text and completion non-empty, a non-empty conversation of
 * {role, content} objects with known roles). Then the whole input is built
 * with settings taken from its first byte (seq_len, truncation, bad-lines,
 * append_eos): on success every line is accounted for (blank + bad +
 * samples + dropped), documents are non-empty and no longer than seq_len,
 * the mask is 0/1; and a loader over the result packs batches whose
 * structure is checked. Leaks are caught by ASan. */
#include <stdlib.h>
#include <string.h>

#include "../src/data/dataset.h"

#define CHECK(c)                                                                      \
    do {                                                                              \
        if (!(c)) {                                                                   \
            fprintf(stderr, "fuzz_dataset: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                                  \
        }                                                                             \
    } while (0)

static loom_status fake_text(loom_ctx *ctx, void *self, const char *text, size_t len,
                             int32_t **ids, int64_t *n) {
    int32_t *p = malloc(sizeof *p * (len + 1));
    if (!p) return loom_errf(ctx, LOOM_ERR_OOM, "oom");
    for (size_t i = 0; i < len; i++) p[i] = (unsigned char)text[i];
    *ids = p;
    *n = (int64_t)len;
    return LOOM_OK;
}

static loom_status fake_chat(loom_ctx *ctx, void *self, const loom_json *messages,
                             const loom_json *tools, int32_t **ids, uint8_t **mask, int64_t *n) {
    size_t cap = 1;
    for (size_t i = 0; i < messages->n; i++)
        cap += loom_json_get(messages->items[i], "content")->slen + 2;
    int32_t *p = malloc(sizeof *p * cap);
    uint8_t *m = malloc(cap);
    if (!p || !m) {
        free(p);
        free(m);
        return loom_errf(ctx, LOOM_ERR_OOM, "oom");
    }
    int64_t k = 0;
    for (size_t i = 0; i < messages->n; i++) {
        const loom_json *role = loom_json_get(messages->items[i], "role");
        const loom_json *c = loom_json_get(messages->items[i], "content");
        bool a = !strcmp(role->s, "assistant");
        p[k] = 256 + (int32_t)(role->s[0] & 7);
        m[k++] = 0;
        for (size_t j = 0; j < c->slen; j++) {
            p[k] = (unsigned char)c->s[j];
            m[k++] = a;
        }
        p[k] = 300;
        m[k++] = a;
    }
    *ids = p;
    *mask = m;
    *n = k;
    return LOOM_OK;
}

static void check_sample(const loom_sample *s) {
    CHECK(s->doc && s->doc->type == LOOM_JSON_OBJECT);
    switch (s->kind) {
    case LOOM_SAMPLE_TEXT:
        CHECK(s->text && s->text_len > 0 && loom_utf8_valid(s->text, s->text_len));
        break;
    case LOOM_SAMPLE_PROMPT_COMPLETION:
        CHECK(s->prompt && loom_utf8_valid(s->prompt, s->prompt_len));
        CHECK(s->completion && s->completion_len > 0 &&
              loom_utf8_valid(s->completion, s->completion_len));
        break;
    case LOOM_SAMPLE_MESSAGES:
        CHECK(s->messages && s->messages->type == LOOM_JSON_ARRAY && s->messages->n > 0);
        for (size_t i = 0; i < s->messages->n; i++) {
            const loom_json *r = loom_json_get(s->messages->items[i], "role");
            const loom_json *c = loom_json_get(s->messages->items[i], "content");
            CHECK(r && r->type == LOOM_JSON_STRING && c && c->type == LOOM_JSON_STRING);
            CHECK(!strcmp(r->s, "system") || !strcmp(r->s, "user") ||
                  !strcmp(r->s, "assistant") || !strcmp(r->s, "tool"));
        }
        break;
    default: CHECK(!"unknown kind");
    }
}

static void check_loader(loom_ctx *ctx, const loom_token_data *td, int64_t S, uint8_t knob) {
    /* a file image of the built data (the layout of tokens.h) */
    size_t n = (size_t)td->n_tokens, nd = (size_t)td->n_docs;
    size_t len = 64 + 8 * (nd + 1) + 4 * n + (td->mask ? n : 0);
    unsigned char *b = calloc(1, len);
    if (!b) return;
    memcpy(b, "LOOMTOK1", 8);
    b[8] = 1;
    b[12] = td->mask ? 1 : 0;
    memcpy(b + 16, &n, 8);
    memcpy(b + 24, &nd, 8);
    memcpy(b + 64, td->offsets, 8 * (nd + 1));
    memcpy(b + 64 + 8 * (nd + 1), td->ids, 4 * n);
    if (td->mask) memcpy(b + 64 + 8 * (nd + 1) + 4 * n, td->mask, n);
    loom_tokfile *tf = NULL;
    CHECK(loom_tokfile_open_buffer(ctx, b, len, "built", &tf) == LOOM_OK);
    free(b);
    loom_loader_config c = {.seq_len = S, .micro_batch_size = 1 + (knob & 1),
                            .num_micro_batches = 1 + ((knob >> 1) & 1), .dp = 1 + ((knob >> 2) & 1),
                            .seed = knob};
    loom_loader *l = NULL;
    CHECK(loom_loader_create(ctx, tf, &c, &l) == LOOM_OK);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    for (int it = 0; it < 3; it++) {
        loom_loader_batch bt;
        CHECK(loom_loader_next(ctx, l, &bt) == LOOM_OK);
        const int32_t *cu = bt.b.cu_seqlens;
        CHECK(cu[0] == 0 && cu[bt.b.n_docs] == bt.b.rows * S);
        int64_t ntg = 0;
        for (int64_t s = 0; s < bt.b.n_docs; s++) {
            int64_t a = cu[s], e = cu[s + 1], d = bt.segment_doc[s];
            CHECK(a < e && a / S == (e - 1) / S);
            CHECK(d < 0 ? e % S == 0 : (uint64_t)(e - a) == off[d + 1] - off[d]);
            for (int64_t t = a; t < e; t++) {
                CHECK(bt.b.position_ids[t] == t - a);
                if (bt.b.targets[t] != LOOM_IGNORE_INDEX) {
                    CHECK(t + 1 < e && bt.b.targets[t] == bt.b.input_ids[t + 1]);
                    ntg++;
                }
            }
        }
        CHECK(ntg == bt.n_targets);
    }
    loom_loader_free(l);
    loom_tokfile_free(tf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    /* each line alone */
    size_t start = 0;
    int64_t lineno = 0;
    while (start < size) {
        const char *line = (const char *)data + start;
        const char *nl = memchr(line, '\n', size - start);
        size_t len = nl ? (size_t)(nl - line) : size - start;
        start += len + 1;
        lineno++;
        char where[64];
        snprintf(where, sizeof where, "fuzz.jsonl:%lld", (long long)lineno);
        loom_sample s;
        loom_status st = loom_sample_parse(ctx, line, len, where, &s);
        if (st) {
            CHECK(s.doc == NULL);
            size_t wl = strlen(where);
            CHECK(st == LOOM_ERR_OOM ||
                  (!strncmp(loom_last_error(ctx), where, wl) && !strncmp(loom_last_error(ctx) + wl, ": ", 2)));
        } else {
            check_sample(&s);
            loom_sample_free(&s);
        }
    }
    /* the whole input, built */
    if (size > 0) {
        uint8_t k = data[0];
        loom_dataset_encoder e = {.encode_text = fake_text, .encode_chat = fake_chat,
                                  .eos_id = 301, .eos_token = "\x01", .vocab_size = 512};
        loom_dataset_config cfg = {.seq_len = (k & 3) == 0 ? 0 : 2 + (k >> 3),
                                   .truncation = (loom_truncation)((k >> 2) & 3),
                                   .bad_lines = (loom_bad_lines)((k >> 4) & 1),
                                   .append_eos = (k >> 5) & 1};
        FILE *f = fmemopen((void *)data, size, "r");
        if (f) {
            loom_token_data td;
            loom_dataset_report rep;
            loom_status st = loom_dataset_build(ctx, f, "fuzz.jsonl", &e, &cfg, &td, &rep);
            fclose(f);
            if (st == LOOM_OK) {
                CHECK(rep.lines == rep.blank_lines + rep.bad_lines + rep.samples + rep.dropped);
                CHECK(rep.samples > 0 && td.n_docs == rep.samples && td.n_tokens == rep.tokens);
                CHECK(rep.samples == rep.text + rep.messages + rep.prompt_completion);
                CHECK(cfg.bad_lines == LOOM_BAD_LINES_SKIP || rep.bad_lines == 0);
                CHECK(cfg.truncation == LOOM_TRUNC_DROP || rep.dropped == 0);
                CHECK(td.offsets[0] == 0 && td.offsets[td.n_docs] == (uint64_t)td.n_tokens);
                for (int64_t d = 0; d < td.n_docs; d++) {
                    uint64_t l = td.offsets[d + 1] - td.offsets[d];
                    CHECK(l > 0 && (cfg.seq_len == 0 || l <= (uint64_t)cfg.seq_len));
                }
                for (int64_t i = 0; td.mask && i < td.n_tokens; i++) CHECK(td.mask[i] <= 1);
                for (int64_t i = 0; i < td.n_tokens; i++) CHECK(td.ids[i] < 512);
                int64_t S = cfg.seq_len ? cfg.seq_len : 2 + (k >> 3);
                bool fits = true;
                for (int64_t d = 0; d < td.n_docs; d++)
                    fits &= td.offsets[d + 1] - td.offsets[d] <= (uint64_t)S;
                if (fits) check_loader(ctx, &td, S, k);
                loom_token_data_free(&td);
            } else {
                CHECK(td.ids == NULL && td.offsets == NULL);
                CHECK(st == LOOM_ERR_OOM || strstr(loom_last_error(ctx), "fuzz.jsonl") != NULL);
            }
        }
    }
    loom_ctx_free(ctx);
    return 0;
}
