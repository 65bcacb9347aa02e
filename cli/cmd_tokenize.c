/* loom tokenize --tokenizer DIR: JSONL samples on stdin, one JSON line of
 * token ids per sample on stdout.
 *
 *   {"text": "..."}                      -> {"ids": [...]}
 *   {"messages": [...]}                  -> {"ids": [...], "assistant_mask": [...]}
 *   {"prompt": "...", "completion": "..."} -> {"ids": [...], "completion_mask": [...]}
 *
 * ids are the tokenizer's encoding (HF's tokenizer(text)["input_ids"]: no
 * EOS is appended here), the chat template's rendering for messages (HF's
 * apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)).
 * {"text": ""} gives {"ids": []}, as HF's tokenizer("") does (training
 * refuses such a sample: loom_sample_parse). Blank lines are skipped; the first bad line ends the command with
 * "stdin:LINE: ..." (exit 1), after the lines before it were written. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static loom_json *int_array(loom_ctx *ctx, const int32_t *ids, const uint8_t *mask, int64_t n) {
    loom_json *a = loom_json_new_array(ctx);
    for (int64_t i = 0; a && i < n; i++)
        if (loom_json_push(ctx, a, loom_json_new_int(ctx, ids ? ids[i] : mask[i]))) {
            loom_json_free(a);
            return NULL;
        }
    return a;
}

/* Whether a line loom_sample_parse refused is {"text": ""} (no other
 * sample field): the one refusal tokenize does not share with training. */
static bool empty_text(loom_ctx *ctx, const char *line, size_t len) {
    char saved[LOOM_ERR_MAX];
    snprintf(saved, sizeof saved, "%s", loom_last_error(ctx));
    loom_json *doc = NULL;
    bool yes = false;
    if (loom_json_parse(ctx, line, len, "stdin", &doc) == LOOM_OK && doc->type == LOOM_JSON_OBJECT) {
        const loom_json *t = loom_json_get(doc, "text");
        yes = t && t->type == LOOM_JSON_STRING && t->slen == 0 && !loom_json_get(doc, "messages") &&
              !loom_json_get(doc, "prompt") && !loom_json_get(doc, "completion");
    }
    loom_json_free(doc);
    loom_errf(ctx, LOOM_ERR_FORMAT, "%s", saved); /* the refusal's message stays the last error */
    return yes;
}

/* One sample's output line (without the newline) into sb. */
static loom_status tokenize_line(loom_ctx *ctx, const loom_dataset_encoder *enc, const char *line,
                                 size_t len, const char *where, loom_sb *sb) {
    loom_sample s;
    loom_status st = loom_sample_parse(ctx, line, len, where, &s);
    if (st == LOOM_ERR_FORMAT && empty_text(ctx, line, len)) {
        s = (loom_sample){.kind = LOOM_SAMPLE_TEXT, .text = "", .text_len = 0};
        st = LOOM_OK;
    }
    if (st) return st;
    int32_t *ids = NULL;
    uint8_t *mask = NULL;
    int64_t n = 0;
    st = loom_dataset_encode(ctx, enc, &s, false, &ids, &mask, &n, NULL);
    if (st) {
        loom_err_prefix(ctx, "%s", where);
        loom_sample_free(&s);
        return st;
    }
    loom_json *o = loom_json_new_object(ctx);
    st = o ? loom_json_set(ctx, o, "ids", int_array(ctx, ids, NULL, n)) : LOOM_ERR_OOM;
    if (!st && mask)
        st = loom_json_set(ctx, o,
                           s.kind == LOOM_SAMPLE_MESSAGES ? "assistant_mask" : "completion_mask",
                           int_array(ctx, NULL, mask, n));
    if (!st) st = loom_json_write(ctx, o, -1, sb);
    loom_json_free(o);
    free(ids);
    free(mask);
    loom_sample_free(&s);
    return st;
}

int loom_cmd_tokenize(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (!s->tokenizer) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "loom tokenize needs --tokenizer DIR (a directory with tokenizer.json, e.g. a "
                  "model directory); it reads JSONL samples from stdin");
        return loom_cli_fail(ctx);
    }
    loom_dataset_encoder *enc = NULL;
    if (loom_dataset_encoder_load(ctx, s->tokenizer, &enc)) return loom_cli_fail(ctx);
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    int64_t lineno = 0;
    int rc = 0;
    loom_sb sb;
    loom_sb_init(&sb);
    while ((got = getline(&line, &cap, stdin)) >= 0) {
        size_t len = (size_t)got;
        lineno++;
        if (len && line[len - 1] == '\n') len--;
        if (len && line[len - 1] == '\r') len--;
        if (loom_line_blank(line, len)) continue;
        char where[64];
        snprintf(where, sizeof where, "stdin:%" PRId64, lineno);
        sb.len = 0;
        if (sb.buf) sb.buf[0] = '\0';
        if (tokenize_line(ctx, enc, line, len, where, &sb) || sb.failed) {
            if (sb.failed) loom_errf(ctx, LOOM_ERR_OOM, "%s: out of memory", where);
            rc = 1;
            break;
        }
        loom_sb_putc(&sb, '\n');
        if (fwrite(sb.buf, 1, sb.len, stdout) != sb.len) {
            loom_errf(ctx, LOOM_ERR_IO, "writing to stdout failed");
            rc = 1;
            break;
        }
    }
    if (!rc && ferror(stdin)) {
        loom_errf(ctx, LOOM_ERR_IO, "reading stdin failed after line %" PRId64, lineno);
        rc = 1;
    }
    if (fflush(stdout) != 0 && !rc) {
        loom_errf(ctx, LOOM_ERR_IO, "writing to stdout failed");
        rc = 1;
    }
    free(line);
    loom_sb_free(&sb);
    loom_dataset_encoder_free(enc);
    return rc ? loom_cli_fail(ctx) : 0;
}
