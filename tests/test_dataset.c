/* JSONL datasets (src/data/dataset.h): every bad line refused with
 * FILE:LINE and its own message, --bad-lines stop and skip (counted),
 * truncation policies, EOS and loss-mask conventions, the token cache
 * (reused when unchanged, rebuilt when the data or the settings change),
 * mostly with a byte-level encoder made here; then the fixture tokenizer and
 * chat template end to end, and `loom tokenize` / `loom train --data
 * x.jsonl` on the command line. */
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../src/core/json.h"
#include "../src/data/dataset.h"
#include "../src/data/tokenizer.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    loom_ctx_set_log_level(ctx, getenv("DBG") ? LOOM_LOG_DEBUG : LOOM_LOG_ERROR);
    return ctx;
}

static char *tmp_path(const char *name) {
    static char bufs[8][1024];
    static int next;
    char *p = bufs[next++ % 8];
    snprintf(p, sizeof bufs[0], "%s/%s", loom_test_tmpdir(), name);
    return p;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(text, 1, strlen(text), f) != strlen(text) || fclose(f)) abort();
}

/* ---- a byte-level encoder: byte b is id b, "</s>" is EOS (300); a chat
 * message is 400+role, its content bytes, then 301; the assistant mask
 * covers an assistant message's content and its 301. ---- */

enum { EOS = 300, END = 301 };

static loom_status fake_text(loom_ctx *ctx, void *self, const char *text, size_t len,
                             int32_t **ids, int64_t *n) {
    int32_t *p = malloc(sizeof *p * (len + 1));
    int64_t k = 0;
    for (size_t i = 0; i < len; i++) {
        if (len - i >= 4 && !memcmp(text + i, "</s>", 4)) {
            p[k++] = EOS;
            i += 3;
        } else {
            p[k++] = (unsigned char)text[i];
        }
    }
    *ids = p;
    *n = k;
    return LOOM_OK;
}

static loom_status fake_chat(loom_ctx *ctx, void *self, const loom_json *messages,
                             const loom_json *tools, int32_t **ids, uint8_t **mask, int64_t *n) {
    size_t cap = 16;
    for (size_t i = 0; i < messages->n; i++)
        cap += loom_json_get(messages->items[i], "content")->slen + 2;
    int32_t *p = malloc(sizeof *p * cap);
    uint8_t *m = malloc(cap);
    int64_t k = 0;
    static const char *const roles[] = {"system", "user", "assistant", "tool"};
    for (size_t i = 0; i < messages->n; i++) {
        const char *role = loom_json_get(messages->items[i], "role")->s;
        const loom_json *c = loom_json_get(messages->items[i], "content");
        int r = 0;
        while (r < 3 && strcmp(role, roles[r])) r++;
        if (r == 3) return loom_errf(ctx, LOOM_ERR_FORMAT, "messages[%zu]: this template has no tool role", i);
        bool a = r == 2;
        p[k] = 400 + r;
        m[k++] = 0;
        for (size_t j = 0; j < c->slen; j++) {
            p[k] = (unsigned char)c->s[j];
            m[k++] = a;
        }
        p[k] = END;
        m[k++] = a;
    }
    *ids = p;
    *mask = m;
    *n = k;
    return LOOM_OK;
}

static loom_dataset_encoder fake_encoder(void) {
    return (loom_dataset_encoder){.encode_text = fake_text, .encode_chat = fake_chat,
                                  .eos_id = EOS, .eos_token = "</s>", .vocab_size = 512,
                                  .fingerprint = 0x1234};
}

/* Builds the JSONL text in memory. */
static loom_status build(loom_ctx *ctx, const char *jsonl, const loom_dataset_encoder *e,
                         const loom_dataset_config *cfg, loom_token_data *td,
                         loom_dataset_report *rep) {
    FILE *f = fmemopen((void *)jsonl, strlen(jsonl), "r");
    if (!f) abort();
    loom_status st = loom_dataset_build(ctx, f, "x.jsonl", e, cfg, td, rep);
    fclose(f);
    return st;
}

static bool doc_is(const loom_token_data *td, int64_t d, const int32_t *want, int64_t n) {
    if (d >= td->n_docs || (int64_t)(td->offsets[d + 1] - td->offsets[d]) != n) return false;
    for (int64_t i = 0; i < n; i++)
        if ((int32_t)td->ids[td->offsets[d] + (uint64_t)i] != want[i]) return false;
    return true;
}

/* ---------------------------------------------------------------------- */

TEST(dataset_parses_the_three_shapes) {
    loom_ctx *ctx = new_ctx();
    loom_sample s;
    const char *t = "{\"text\": \"hello\", \"id\": 7}";
    REQUIRE_OK(ctx, loom_sample_parse(ctx, t, strlen(t), "f:1", &s));
    CHECK_EQ_INT(s.kind, LOOM_SAMPLE_TEXT);
    CHECK(s.text_len == 5 && !memcmp(s.text, "hello", 5));
    loom_sample_free(&s);
    const char *m = "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"}, "
                    "{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
                    "\"content\": \"yo\", \"reasoning_content\": \"x\"}], \"source\": \"web\"}";
    REQUIRE_OK(ctx, loom_sample_parse(ctx, m, strlen(m), "f:2", &s));
    CHECK_EQ_INT(s.kind, LOOM_SAMPLE_MESSAGES);
    CHECK_EQ_INT(s.messages->n, 3);
    loom_sample_free(&s);
    const char *pc = "{\"prompt\": \"\", \"completion\": \"a\\u0000b\"}";
    REQUIRE_OK(ctx, loom_sample_parse(ctx, pc, strlen(pc), "f:3", &s));
    CHECK_EQ_INT(s.kind, LOOM_SAMPLE_PROMPT_COMPLETION);
    CHECK_EQ_INT(s.prompt_len, 0);
    CHECK(s.completion_len == 3 && s.completion[1] == '\0');
    loom_sample_free(&s);
    CHECK(loom_line_blank(" \t\r", 3) && !loom_line_blank(" x", 2));
    /* tools beside messages: a list, the list JSON-encoded, or null (none) */
    const char *tl = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                     "\"tools\": [{\"name\": \"f\"}, {\"name\": \"g\"}]}";
    REQUIRE_OK(ctx, loom_sample_parse(ctx, tl, strlen(tl), "f:4", &s));
    CHECK(s.tools && s.tools->type == LOOM_JSON_ARRAY && s.tools->n == 2 && !s.tools_doc);
    loom_sample_free(&s);
    const char *ts = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                     "\"tools\": \"[{\\\"name\\\": \\\"f\\\"}]\"}";
    REQUIRE_OK(ctx, loom_sample_parse(ctx, ts, strlen(ts), "f:5", &s));
    CHECK(s.tools && s.tools == s.tools_doc && s.tools->n == 1);
    CHECK_STR(loom_json_get(s.tools->items[0], "name")->s, "f");
    loom_sample_free(&s);
    const char *tn[] = {"null", "\"null\""};
    for (int k = 0; k < 2; k++) {
        char row[200];
        snprintf(row, sizeof row,
                 "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": %s}",
                 tn[k]);
        REQUIRE_OK(ctx, loom_sample_parse(ctx, row, strlen(row), "f:6", &s));
        CHECK(s.tools == NULL);
        loom_sample_free(&s);
    }
    loom_ctx_free(ctx);
}

/* Every bad line: LOOM_ERR_FORMAT, "FILE:LINE: " first, its own message. */
TEST(dataset_bad_lines_each_have_a_clear_message) {
    static const struct {
        const char *line, *msg;
    } cases[] = {
        {"{\"text\": \"a\"", "malformed JSON at column 13: "},
        {"{\"text\": \"a\"} x", "malformed JSON at column 15"},
        {"{\"text\": \"\\ud800\"}", "malformed JSON at column"},
        {"{\"text\": \"caf\xe9\"}", "invalid UTF-8 at byte 13 of the line (0xe9)"},
        {"{\"text\": \"\xed\xa0\x80\"}", "invalid UTF-8 at byte 10"}, /* an encoded surrogate */
        {"{\"text\": \"\xc0\xaf\"}", "invalid UTF-8 at byte 10"},     /* overlong */
        {"[1, 2]", "expected a JSON object, got array"},
        {"\"just text\"", "expected a JSON object, got string"},
        {"{\"id\": 3, \"content\": \"x\"}",
         "no \"messages\", \"text\" or \"prompt\"/\"completion\" field (its keys: \"id\", \"content\")"},
        {"{}", "(the object is empty)"},
        {"{\"text\": \"a\", \"messages\": []}", "has \"messages\" and \"text\": give one of them"},
        {"{\"text\": \"a\", \"prompt\": \"b\", \"completion\": \"c\"}", "has \"text\" and \"prompt\""},
        {"{\"prompt\": \"a\"}", "\"prompt\" without \"completion\""},
        {"{\"completion\": \"a\"}", "\"completion\" without \"prompt\""},
        {"{\"text\": 5}", "\"text\" must be a string, got number"},
        {"{\"text\": null}", "\"text\" must be a string, got null"},
        {"{\"text\": \"\"}", "\"text\" is empty: there is nothing to train on"},
        {"{\"prompt\": \"q\", \"completion\": \"\"}", "\"completion\" is empty"},
        {"{\"prompt\": [{\"role\": \"user\", \"content\": \"q\"}], \"completion\": \"a\"}",
         "conversational prompt/completion is not supported"},
        {"{\"messages\": \"hi\"}", "\"messages\" must be an array of {\"role\", \"content\"} objects, got string"},
        {"{\"messages\": []}", "empty conversation"},
        {"{\"messages\": [5]}", "messages[0] must be an object"},
        {"{\"messages\": [{\"content\": \"x\"}]}", "messages[0] has no \"role\""},
        {"{\"messages\": [{\"role\": 1, \"content\": \"x\"}]}", "messages[0].role must be a string, got number"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"bot\", \"content\": \"a\"}]}",
         "messages[1] has unknown role \"bot\" (roles are system, user, assistant, tool)"},
        {"{\"messages\": [{\"role\": \"user\"}]}", "messages[0] (user) has no \"content\""},
        {"{\"messages\": [{\"role\": \"user\", \"content\": null}]}",
         "messages[0].content must be a string, got null"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]}",
         "messages[0].content must be a string, got array (content parts and tool calls are not supported)"},
    };
    loom_ctx *ctx = new_ctx();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_sample s;
        loom_status st = loom_sample_parse(ctx, cases[i].line, strlen(cases[i].line), "d.jsonl:7", &s);
        CHECK_MSG(st == LOOM_ERR_FORMAT, "case %zu (%s) -> %s", i, cases[i].line,
                  loom_status_str(st));
        CHECK_MSG(!strncmp(loom_last_error(ctx), "d.jsonl:7: ", 11), "case %zu: %s", i,
                  loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), cases[i].msg);
        CHECK(s.doc == NULL);
        if (!st) loom_sample_free(&s);
    }
    /* a long unknown role is cut in the message */
    char line[400];
    snprintf(line, sizeof line, "{\"messages\": [{\"role\": \"%0200d\", \"content\": \"a\"}]}", 0);
    loom_sample s;
    CHECK(loom_sample_parse(ctx, line, strlen(line), "d.jsonl:8", &s) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "0000\"... (roles are");
    loom_ctx_free(ctx);
}

/* Bad "tools" (not a list, not objects, a string that is not JSON, beside
 * a text or prompt): LOOM_ERR_FORMAT naming the row. */
TEST(dataset_bad_tools_name_the_row) {
    static const struct {
        const char *line, *msg, *msg2;
    } cases[] = {
#define Q "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": "
        {Q "{\"name\": \"f\"}}", "tools must be a JSON array of tool objects", "got object"},
        {Q "5}", "tools must be a JSON array of tool objects", "got number"},
        {Q "[{\"name\": \"f\"}, \"g\"]}", "tools[1] must be an object", "got string"},
        {Q "\"[{\\\"name\\\": \\\"f\\\"}, 2]\"}", "tools[1] must be an object",
         "got number (decoded from the JSON string \"tools\")"},
        {Q "\"{\\\"name\\\": 1}\"}", "tools must be a JSON array", "got object (decoded"},
        {Q "\"get_weather\"}", "\"tools\" is a string but not JSON", "tools: line 1, column 1"},
        {Q "\"\"}", "\"tools\" is a string but not JSON", ""},
#undef Q
        {"{\"text\": \"a\", \"tools\": []}", "has \"tools\" but no \"messages\"", "a text sample"},
        {"{\"prompt\": \"a\", \"completion\": \"b\", \"tools\": \"[]\"}",
         "has \"tools\" but no \"messages\"", "a prompt/completion sample"},
    };
    loom_ctx *ctx = new_ctx();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_sample s;
        loom_status st =
            loom_sample_parse(ctx, cases[i].line, strlen(cases[i].line), "d.jsonl:9", &s);
        CHECK_MSG(st == LOOM_ERR_FORMAT, "case %zu (%s) -> %s", i, cases[i].line,
                  loom_status_str(st));
        CHECK_MSG(!strncmp(loom_last_error(ctx), "d.jsonl:9: ", 11), "case %zu: %s", i,
                  loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), cases[i].msg);
        CHECK_CONTAINS(loom_last_error(ctx), cases[i].msg2);
        CHECK(s.doc == NULL && s.tools_doc == NULL && s.tools == NULL);
        if (!st)
            loom_sample_free(&s);
    }
    loom_ctx_free(ctx);
}

static const char *MIXED =
    "{\"text\": \"abc\"}\n"                                   /* 1 */
    "\n"                                                      /* 2: blank */
    "{\"text\": \"broken\"\n"                                 /* 3: bad */
    "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, "
    "{\"role\": \"assistant\", \"content\": \"ok\"}]}\r\n"   /* 4 (CRLF) */
    "{\"messages\": []}\n"                                    /* 5: bad */
    "   \t\n"                                                 /* 6: blank */
    "{\"prompt\": \"Q:\", \"completion\": \"A</s>\"}\n"       /* 7 */
    "{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}\n" /* 8: bad (the encoder refuses) */
    "{\"text\": \"end</s>\"}";                                /* 9, no final newline */

TEST(dataset_bad_lines_stop_or_skip_and_count) {
    loom_ctx *ctx = new_ctx();
    loom_dataset_encoder e = fake_encoder();
    loom_dataset_config cfg = loom_dataset_config_default();
    loom_token_data td;
    loom_dataset_report rep;
    /* stop: the first bad line is the error */
    CHECK(build(ctx, MIXED, &e, &cfg, &td, &rep) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "x.jsonl:3: malformed JSON at column 18");
    CHECK(td.ids == NULL);
    /* skip: the good lines, the bad ones counted, the first named */
    cfg.bad_lines = LOOM_BAD_LINES_SKIP;
    REQUIRE_OK(ctx, build(ctx, MIXED, &e, &cfg, &td, &rep));
    CHECK_EQ_INT(rep.lines, 9);
    CHECK_EQ_INT(rep.blank_lines, 2);
    CHECK_EQ_INT(rep.bad_lines, 3);
    CHECK_CONTAINS(rep.first_bad, "x.jsonl:3: malformed JSON");
    CHECK_EQ_INT(rep.samples, 4);
    CHECK_EQ_INT(rep.text, 2);
    CHECK_EQ_INT(rep.messages, 1);
    CHECK_EQ_INT(rep.prompt_completion, 1);
    REQUIRE(td.n_docs == 4);
    /* text + EOS; chat with its mask; prompt/completion with EOS not doubled; text with EOS */
    CHECK(doc_is(&td, 0, (int32_t[]){'a', 'b', 'c', EOS}, 4));
    CHECK(doc_is(&td, 1, (int32_t[]){401, 'q', END, 402, 'o', 'k', END}, 7));
    CHECK(doc_is(&td, 2, (int32_t[]){'Q', ':', 'A', EOS}, 4));
    CHECK(doc_is(&td, 3, (int32_t[]){'e', 'n', 'd', EOS}, 4));
    REQUIRE(td.mask);
    static const uint8_t mask[19] = {1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1};
    CHECK(td.n_tokens == 19 && !memcmp(td.mask, mask, 19));
    CHECK_EQ_INT(rep.tokens, 19);
    CHECK_EQ_INT(rep.loss_tokens, 3 + 3 + 2 + 3);
    CHECK_EQ_INT(rep.no_loss, 0);
    loom_token_data_free(&td);
    /* the tool message refused by the template names its line */
    const char *tool = "{\"text\": \"a\"}\n{\"messages\": [{\"role\": \"tool\", \"content\": \"x\"}]}\n";
    cfg.bad_lines = LOOM_BAD_LINES_STOP;
    CHECK(build(ctx, tool, &e, &cfg, &td, &rep) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "x.jsonl:2: messages[0]: this template has no tool role");
    /* nothing left */
    cfg.bad_lines = LOOM_BAD_LINES_SKIP;
    CHECK(build(ctx, "\n{\"text\": 1}\n", &e, &cfg, &td, &rep) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "x.jsonl: no sample to train on: 2 lines: 1 blank, 1 bad "
                                         "and skipped (the first: x.jsonl:2: \"text\" must be");
    loom_ctx_free(ctx);
}

TEST(dataset_truncation_policies) {
    loom_ctx *ctx = new_ctx();
    loom_dataset_encoder e = fake_encoder();
    loom_dataset_config cfg = loom_dataset_config_default();
    cfg.seq_len = 8;
    const char *data = "{\"text\": \"ab\"}\n"
                       "{\"text\": \"abcdefghij\"}\n" /* 11 tokens with EOS */
                       "{\"prompt\": \"0123456\", \"completion\": \"xyz\"}\n"; /* 11 */
    loom_token_data td;
    loom_dataset_report rep;
    CHECK(build(ctx, data, &e, &cfg, &td, &rep) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "x.jsonl:2: the sample has 11 tokens, more than seq_len = 8; "
                                         "give a larger --seq-len or --truncation left, right or drop");
    cfg.bad_lines = LOOM_BAD_LINES_SKIP; /* too long is not a bad line */
    CHECK(build(ctx, data, &e, &cfg, &td, &rep) == LOOM_ERR_INVALID_ARG);
    cfg.truncation = LOOM_TRUNC_LEFT;
    REQUIRE_OK(ctx, build(ctx, data, &e, &cfg, &td, &rep));
    CHECK_EQ_INT(rep.truncated, 2);
    CHECK(doc_is(&td, 1, (int32_t[]){'d', 'e', 'f', 'g', 'h', 'i', 'j', EOS}, 8));
    CHECK(doc_is(&td, 2, (int32_t[]){'3', '4', '5', '6', 'x', 'y', 'z', EOS}, 8));
    REQUIRE(td.mask);
    static const uint8_t lmask[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    CHECK(!memcmp(td.mask + td.offsets[2], lmask, 8));
    loom_token_data_free(&td);
    cfg.truncation = LOOM_TRUNC_RIGHT;
    REQUIRE_OK(ctx, build(ctx, data, &e, &cfg, &td, &rep));
    CHECK_EQ_INT(rep.truncated, 2);
    CHECK(doc_is(&td, 1, (int32_t[]){'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'}, 8));
    /* the completion was cut off entirely: no token to predict, counted */
    CHECK(doc_is(&td, 2, (int32_t[]){'0', '1', '2', '3', '4', '5', '6', 'x'}, 8));
    CHECK_EQ_INT(rep.no_loss, 0); /* 'x' is still predicted from '6' */
    loom_token_data_free(&td);
    cfg.seq_len = 7;
    REQUIRE_OK(ctx, build(ctx, data, &e, &cfg, &td, &rep));
    CHECK_EQ_INT(rep.no_loss, 1);
    loom_token_data_free(&td);
    cfg.seq_len = 8;
    cfg.truncation = LOOM_TRUNC_DROP;
    REQUIRE_OK(ctx, build(ctx, data, &e, &cfg, &td, &rep));
    CHECK_EQ_INT(rep.dropped, 2);
    CHECK_EQ_INT(rep.samples, 1);
    CHECK(td.n_docs == 1 && td.mask == NULL); /* only text: no mask stored */
    loom_token_data_free(&td);
    /* seq_len 0: no limit */
    cfg.seq_len = 0;
    cfg.truncation = LOOM_TRUNC_ERROR;
    REQUIRE_OK(ctx, build(ctx, data, &e, &cfg, &td, &rep));
    CHECK_EQ_INT(td.n_tokens, 3 + 11 + 11);
    loom_token_data_free(&td);
    loom_ctx_free(ctx);
}

TEST(dataset_eos_and_prompt_masks) {
    loom_ctx *ctx = new_ctx();
    loom_dataset_encoder e = fake_encoder();
    loom_dataset_config cfg = loom_dataset_config_default();
    loom_token_data td;
    loom_dataset_report rep;
    const char *data = "{\"text\": \"hi\"}\n{\"prompt\": \"Q\", \"completion\": \"A\"}\n";
    cfg.append_eos = false;
    REQUIRE_OK(ctx, build(ctx, data, &e, &cfg, &td, &rep));
    CHECK(doc_is(&td, 0, (int32_t[]){'h', 'i'}, 2));
    CHECK(doc_is(&td, 1, (int32_t[]){'Q', 'A'}, 2));
    CHECK(td.mask && td.mask[2] == 0 && td.mask[3] == 1);
    loom_token_data_free(&td);
    /* no EOS known: appending it is a configuration error, not a bad line */
    e.eos_id = -1;
    e.eos_token = NULL;
    cfg.append_eos = true;
    cfg.bad_lines = LOOM_BAD_LINES_SKIP;
    CHECK(build(ctx, data, &e, &cfg, &td, &rep) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "x.jsonl:1: appending the EOS token");
    CHECK_CONTAINS(loom_last_error(ctx), "--no-append-eos");
    /* no chat template: a messages line says why, and stops even under skip */
    e = fake_encoder();
    e.encode_chat = NULL;
    e.chat_error = "m: no chat template";
    CHECK(build(ctx, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}\n", &e, &cfg, &td,
                &rep) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "x.jsonl:1: a \"messages\" sample needs the model's chat "
                                         "template: m: no chat template");
    /* a prompt whose tokens are not a prefix of prompt + completion: counted */
    e = fake_encoder();
    REQUIRE_OK(ctx, build(ctx, "{\"prompt\": \"a</\", \"completion\": \"s>b\"}\n", &e, &cfg, &td,
                          &rep));
    CHECK_EQ_INT(rep.prompt_mismatch, 1);
    CHECK(doc_is(&td, 0, (int32_t[]){'a', EOS, 'b', EOS}, 4));
    loom_token_data_free(&td);
    loom_ctx_free(ctx);
}

static int64_t count_caches(const char *jsonl) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "ls %s.*.tokens 2>/dev/null | wc -l", jsonl);
    FILE *p = popen(cmd, "r");
    long n = -1;
    if (p && fscanf(p, "%ld", &n) != 1) n = -1;
    if (p) pclose(p);
    return n;
}

TEST(dataset_cache_reused_when_unchanged_rebuilt_when_changed) {
    loom_ctx *ctx = new_ctx();
    loom_dataset_encoder e = fake_encoder();
    loom_dataset_config cfg = loom_dataset_config_default();
    cfg.seq_len = 64;
    cfg.bad_lines = LOOM_BAD_LINES_SKIP;
    const char *path = tmp_path("data.jsonl");
    write_text(path, MIXED);
    loom_tokfile *tf;
    loom_dataset_report rep, rep2;
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &cfg, &tf, &rep));
    CHECK(!rep.reused);
    CHECK_EQ_INT(loom_tokfile_n_docs(tf), 4);
    CHECK_EQ_INT(loom_tokfile_vocab_size(tf), 512);
    CHECK(loom_tokfile_mask(tf) != NULL);
    loom_tokfile_free(tf);
    uint64_t key;
    REQUIRE_OK(ctx, loom_dataset_cache_key(ctx, path, &e, &cfg, &key));
    char want[1100];
    snprintf(want, sizeof want, "%s.%016llx.tokens", path, (unsigned long long)key);
    CHECK_STR(rep.cache, want);
    CHECK(loom_file_exists(want));
    snprintf(want, sizeof want, "%s.%016llx.report.json", path, (unsigned long long)key);
    CHECK(loom_file_exists(want));
    /* unchanged: reused, with the same report (the skipped lines are not forgotten) */
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &cfg, &tf, &rep2));
    CHECK(rep2.reused);
    CHECK_STR(rep2.cache, rep.cache);
    CHECK_EQ_INT(rep2.bad_lines, 3);
    CHECK_STR(rep2.first_bad, rep.first_bad);
    CHECK_EQ_INT(rep2.samples, 4);
    CHECK_EQ_INT(rep2.loss_tokens, rep.loss_tokens);
    loom_tokfile_free(tf);
    CHECK_EQ_INT(count_caches(path), 1);
    /* other settings: another key */
    loom_dataset_config c2 = cfg;
    c2.truncation = LOOM_TRUNC_DROP;
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &c2, &tf, &rep2));
    CHECK(!rep2.reused && strcmp(rep2.cache, rep.cache));
    loom_tokfile_free(tf);
    c2 = cfg;
    c2.append_eos = false;
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &c2, &tf, &rep2));
    CHECK(!rep2.reused);
    loom_tokfile_free(tf);
    loom_dataset_encoder e2 = e;
    e2.fingerprint ^= 1; /* another tokenizer or template */
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e2, &cfg, &tf, &rep2));
    CHECK(!rep2.reused);
    loom_tokfile_free(tf);
    CHECK_EQ_INT(count_caches(path), 4);
    /* the data changes: one more line */
    char more[2048];
    snprintf(more, sizeof more, "%s\n{\"text\": \"more\"}\n", MIXED);
    write_text(path, more);
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &cfg, &tf, &rep2));
    CHECK(!rep2.reused && strcmp(rep2.cache, rep.cache));
    CHECK_EQ_INT(loom_tokfile_n_docs(tf), 5);
    loom_tokfile_free(tf);
    /* same size, other contents and time: rebuilt */
    more[strlen(more) - 4] = 'X';
    write_text(path, more);
    struct timespec ts[2] = {{.tv_sec = 1000000000, .tv_nsec = 0}, {.tv_sec = 1000000000, .tv_nsec = 0}};
    REQUIRE(utimensat(AT_FDCWD, path, ts, 0) == 0);
    char before[1024];
    snprintf(before, sizeof before, "%s", rep2.cache);
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &cfg, &tf, &rep2));
    CHECK(!rep2.reused && strcmp(rep2.cache, before));
    loom_tokfile_free(tf);
    /* a damaged cache is built again */
    snprintf(before, sizeof before, "%s", rep2.cache);
    REQUIRE(truncate(before, 70) == 0);
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, &e, &cfg, &tf, &rep2));
    CHECK(!rep2.reused);
    CHECK_STR(rep2.cache, before);
    loom_tokfile_free(tf);
    /* reuse only (ranks other than 0) without a cache */
    c2 = cfg;
    c2.seq_len = 65;
    c2.reuse_only = true;
    CHECK(loom_dataset_open(ctx, path, &e, &c2, &tf, &rep2) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "no usable token cache");
    /* a missing file */
    CHECK(loom_dataset_open(ctx, tmp_path("none.jsonl"), &e, &cfg, &tf, &rep2) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "none.jsonl: cannot open");
    loom_ctx_free(ctx);
}

TEST(dataset_open_takes_token_files_as_they_are) {
    loom_ctx *ctx = new_ctx();
    const uint32_t ids[5] = {1, 2, 3, 4, 5};
    const uint64_t off[3] = {0, 2, 5};
    const char *path = tmp_path("t.tokens");
    REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, ids, 5, off, 2, NULL, 16));
    loom_tokfile *tf;
    loom_dataset_report rep;
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, NULL, NULL, &tf, &rep));
    CHECK_EQ_INT(rep.samples, 2);
    CHECK(rep.reused);
    loom_tokfile_free(tf);
    CHECK(loom_dataset_is_jsonl("a/b.jsonl") && !loom_dataset_is_jsonl("a.tokens") &&
          !loom_dataset_is_jsonl("jsonl"));
    CHECK(loom_dataset_open(ctx, tmp_path("x.jsonl"), NULL, NULL, &tf, &rep) ==
          LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "JSONL data needs a tokenizer");
    loom_ctx_free(ctx);
}

/* ---- with the fixture tokenizer and Qwen3 chat template ---- */

static char *fixture(const char *rel) {
    static char bufs[4][1024];
    static int next;
    char *p = bufs[next++ % 4];
    snprintf(p, sizeof bufs[0], "%s/%s", loom_test_fixtures(), rel);
    return p;
}

/* The chat and encode cases of the fixtures as JSONL samples: the built
 * token file holds HF's ids, the assistant mask as loss mask, and EOS
 * after each text. */
TEST(dataset_jsonl_end_to_end_fixture_tokenizer) {
    loom_ctx *ctx = new_ctx();
    loom_dataset_encoder *e = NULL;
    REQUIRE_OK(ctx, loom_dataset_encoder_load(ctx, fixture("tokenizer"), &e));
    REQUIRE(e->encode_chat != NULL);
    REQUIRE(e->eos_token && !strcmp(e->eos_token, "<|im_end|>") && e->eos_id >= 0);
    char *chat, *enc;
    size_t chat_len, enc_len;
    REQUIRE_OK(ctx, loom_read_file(ctx, fixture("tokenizer/chat_cases.jsonl"), 0, &chat, &chat_len));
    REQUIRE_OK(ctx, loom_read_file(ctx, fixture("tokenizer/encode_cases.jsonl"), 0, &enc, &enc_len));
    loom_sb jsonl;
    loom_sb_init(&jsonl);
    enum { MAXD = 128 };
    loom_json *want_ids[MAXD] = {0}, *want_mask[MAXD] = {0};
    bool add_eos[MAXD] = {0};
    int nd = 0;
    for (int pass = 0; pass < 2; pass++) {
        char *text = pass ? enc : chat, *save = NULL;
        for (char *line = strtok_r(text, "\n", &save); line && nd < MAXD;
             line = strtok_r(NULL, "\n", &save)) {
            loom_json *row;
            REQUIRE_OK(ctx, loom_json_parse(ctx, line, strlen(line), "case", &row));
            const loom_json *agp = loom_json_get(row, "add_generation_prompt");
            const loom_json *t = loom_json_get(row, "text");
            if ((agp && agp->b) || (pass && t->slen == 0)) { /* not training samples */
                loom_json_free(row);
                continue;
            }
            loom_json *sample = loom_json_new_object(ctx);
            if (pass == 0)
                loom_json_set(ctx, sample, "messages",
                              loom_json_clone(ctx, loom_json_get(row, "messages")));
            else
                loom_json_set(ctx, sample, "text", loom_json_clone(ctx, t));
            REQUIRE_OK(ctx, loom_json_write(ctx, sample, -1, &jsonl));
            loom_sb_putc(&jsonl, '\n');
            loom_json_free(sample);
            want_ids[nd] = loom_json_clone(ctx, loom_json_get(row, "ids"));
            want_mask[nd] = pass ? NULL : loom_json_clone(ctx, loom_json_get(row, "assistant_mask"));
            add_eos[nd] = pass && !(t->slen >= 10 && !strcmp(t->s + t->slen - 10, "<|im_end|>"));
            nd++;
            loom_json_free(row);
        }
    }
    REQUIRE(nd > 60 && !jsonl.failed);
    const char *path = tmp_path("fixture.jsonl");
    write_text(path, jsonl.buf);
    loom_dataset_config cfg = loom_dataset_config_default();
    loom_tokfile *tf;
    loom_dataset_report rep;
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, e, &cfg, &tf, &rep));
    REQUIRE(loom_tokfile_n_docs(tf) == nd);
    CHECK_EQ_INT(rep.messages, 5);
    CHECK_EQ_INT(loom_tokfile_vocab_size(tf), e->vocab_size);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    const uint32_t *ids = loom_tokfile_ids(tf);
    const uint8_t *mask = loom_tokfile_mask(tf);
    REQUIRE(mask);
    for (int d = 0; d < nd; d++) {
        int64_t n = (int64_t)want_ids[d]->n + add_eos[d];
        CHECK_MSG((int64_t)(off[d + 1] - off[d]) == n, "sample %d: %d tokens, want %d", d,
                  (int)(off[d + 1] - off[d]), (int)n);
        if ((int64_t)(off[d + 1] - off[d]) != n) continue;
        bool ok = true;
        for (size_t i = 0; i < want_ids[d]->n; i++) {
            ok &= (int64_t)ids[off[d] + i] == want_ids[d]->items[i]->i;
            ok &= mask[off[d] + i] == (want_mask[d] ? want_mask[d]->items[i]->i : 1);
        }
        if (add_eos[d]) ok &= ids[off[d + 1] - 1] == (uint32_t)e->eos_id && mask[off[d + 1] - 1];
        CHECK_MSG(ok, "sample %d: ids or mask differ from HF's", d);
    }
    loom_tokfile_free(tf);
    for (int d = 0; d < nd; d++) {
        loom_json_free(want_ids[d]);
        loom_json_free(want_mask[d]);
    }
    loom_sb_free(&jsonl);
    free(chat);
    free(enc);
    loom_dataset_encoder_free(e);
    loom_ctx_free(ctx);
}

/* ---- the command line ---- */

#define RUN(out, ...) loom_test_run(out, (const char *const[]){__VA_ARGS__, NULL})

TEST(dataset_cli_tokenize) {
    const char *in = tmp_path("in.jsonl");
    write_text(in, "{\"text\": \"Hello world\"}\n\n"
                   "{\"messages\": [{\"role\": \"user\", \"content\": \"What is 2+2?\"}, "
                   "{\"role\": \"assistant\", \"content\": \"It is 4.\"}]}\n"
                   "{\"prompt\": \"Hello\", \"completion\": \" world\"}\n");
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd, "%s tokenize --tokenizer %s < %s", loom_test_bin(),
             fixture("tokenizer"), in);
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 0);
    /* HF's ids (encode_cases / chat_cases), no EOS appended here */
    CHECK_CONTAINS(out, "{\"ids\":[39,415,299,329,263,75,67]}\n");
    CHECK_CONTAINS(out, "{\"ids\":[994,472,265,198,54,71,264,333,220,17,10,17,30,995,198,994,403,"
                        "626,552,198,996,281,997,281,40,83,333,220,19,13,995,198],"
                        "\"assistant_mask\":[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,1,1,1,1,1,"
                        "1,1,1,1,1,1,1]}\n");
    CHECK_CONTAINS(out, "{\"ids\":[39,415,299,329,263,75,67],\"completion_mask\":[0,0,0,1,1,1,1]}");
    free(out);
    /* a bad line: the lines before it are written, then stdin:LINE and exit 1 */
    write_text(in, "{\"text\": \"Hello world\"}\n{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}\n");
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 1);
    CHECK_CONTAINS(out, "{\"ids\":[39,415,299,329,263,75,67]}\n");
    CHECK_CONTAINS(out, "loom: error: stdin:2: messages[0] has unknown role \"robot\"");
    free(out);
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "tokenize"), 1);
    CHECK_CONTAINS(out, "needs --tokenizer DIR");
    free(out);
}

/* The ids of text and, per token, whether it overlaps one of jinja2's
 * {% generation %} spans (byte ranges): HF's assistant mask. A token that is
 * a piece of a character goes with the fewest next ones that decode to whole
 * characters (HF gives them all that character's offsets); false when the
 * tokens do not decode to the text. */
static bool jinja2_ids_and_mask(loom_ctx *ctx, const loom_tokenizer *t, const loom_json *text,
                                const loom_json *spans, int32_t **ids, uint8_t **mask, int64_t *n) {
    if (loom_tokenizer_encode(ctx, t, text->s, text->slen, ids, n) != LOOM_OK)
        return false;
    *mask = calloc((size_t)*n + 1, 1);
    size_t pos = 0;
    for (int64_t k = 0, m; k < *n; k = m) {
        size_t len = 0;
        bool fits = false;
        for (m = k + 1; m <= *n && !fits; m++) {
            char *piece = NULL;
            if (loom_tokenizer_decode(ctx, t, *ids + k, m - k, &piece) != LOOM_OK)
                return false;
            len = strlen(piece);
            fits = len <= text->slen - pos && !memcmp(text->s + pos, piece, len) &&
                   !strstr(piece, "\xef\xbf\xbd"); /* no U+FFFD of a cut character */
            free(piece);
        }
        m--;
        if (!fits)
            return false;
        uint8_t in = 0;
        for (size_t i = 0; i < spans->n; i++)
            in |= (int64_t)pos < spans->items[i]->items[1]->i &&
                  (int64_t)(pos + len) > spans->items[i]->items[0]->i;
        memset(*mask + k, in, (size_t)(m - k));
        pos += len;
    }
    return pos == text->slen;
}

/* Rows with "tools" beside "messages" (every other one as the list
 * JSON-encoded in a string) through the dataset path, a token file and
 * `loom tokenize`: the ids are those of the text jinja2 renders for the same
 * conversation and tools with Qwen3's template (the fixture tokenizer's,
 * tests/fixtures_chat_templates/cases.jsonl), the mask the tokens of its
 * {% generation %} spans. */
TEST(dataset_tools_rows_match_jinja2) {
    loom_ctx *ctx = new_ctx();
    loom_dataset_encoder *e = NULL;
    REQUIRE_OK(ctx, loom_dataset_encoder_load(ctx, fixture("tokenizer"), &e));
    REQUIRE(e->encode_chat && e->tokenizer);
    char *data = NULL, *save = NULL;
    size_t dlen = 0;
    REQUIRE_OK(ctx,
               loom_read_file(ctx, "tests/fixtures_chat_templates/cases.jsonl", 0, &data, &dlen));
    loom_sb jsonl, want;
    loom_sb_init(&jsonl);
    loom_sb_init(&want);
    enum { MAXR = 32 };
    loom_json *want_ids[MAXR] = {0};
    int rows = 0, masked = 0, skipped = 0;
    for (char *line = strtok_r(data, "\n", &save); line && rows < MAXR;
         line = strtok_r(NULL, "\n", &save)) {
        loom_json *cs = NULL;
        REQUIRE_OK(ctx, loom_json_parse(ctx, line, strlen(line), "cases.jsonl", &cs));
        const loom_json *vars = loom_json_get(cs, "vars"), *text = loom_json_get(cs, "text");
        const loom_json *tools = loom_json_get(vars, "tools");
        const char *name = loom_json_get(cs, "name")->s;
        /* training samples: no generation prompt, the template's default thinking */
        if (strcmp(loom_json_get(cs, "template")->s, "qwen3.jinja") || !text ||
            tools->type == LOOM_JSON_NULL || loom_json_get(vars, "add_generation_prompt")->b ||
            loom_json_get(vars, "enable_thinking")) {
            loom_json_free(cs);
            continue;
        }
        loom_json *row = loom_json_new_object(ctx);
        loom_json_set(ctx, row, "messages", loom_json_clone(ctx, loom_json_get(vars, "messages")));
        if (rows % 2) {
            loom_sb ts;
            loom_sb_init(&ts);
            REQUIRE_OK(ctx, loom_json_write(ctx, tools, -1, &ts));
            loom_json_set(ctx, row, "tools", loom_json_new_str(ctx, ts.buf));
            loom_sb_free(&ts);
        } else {
            loom_json_set(ctx, row, "tools", loom_json_clone(ctx, tools));
        }
        loom_sb rl;
        loom_sb_init(&rl);
        REQUIRE_OK(ctx, loom_json_write(ctx, row, -1, &rl));
        loom_json_free(row);
        loom_sample s;
        if (loom_sample_parse(ctx, rl.buf, rl.len, "row", &s) != LOOM_OK) {
            /* an unknown role, the ipython role: not dataset rows */
            CHECK_MSG(strstr(name, "/bad_role+") || strstr(name, "/builtin_call+"), "%s: %s", name,
                      loom_last_error(ctx));
            skipped++;
            loom_sb_free(&rl);
            loom_json_free(cs);
            continue;
        }
        int32_t *ids = NULL, *wids = NULL;
        uint8_t *mask = NULL, *wmask = NULL;
        int64_t n = 0, wn = 0;
        CHECK_OK(ctx, loom_dataset_encode(ctx, e, &s, false, &ids, &mask, &n, NULL));
        bool aligned = jinja2_ids_and_mask(ctx, e->tokenizer, text, loom_json_get(cs, "spans"),
                                           &wids, &wmask, &wn);
        CHECK_MSG(aligned, "%s: the expected ids do not split at the text's bytes", name);
        bool same = aligned && ids && mask && n == wn && !memcmp(ids, wids, (size_t)n * 4) &&
                    !memcmp(mask, wmask, (size_t)n);
        CHECK_MSG(same, "%s: ids or mask differ from jinja2's text (%lld tokens, want %lld)", name,
                  (long long)n, (long long)wn);
        bool any = false;
        for (int64_t k = 0; k < wn; k++)
            any |= wmask[k];
        masked += any;
        /* what `loom tokenize` prints for the row */
        loom_sb_puts(&want, "{\"ids\":[");
        for (int64_t k = 0; k < wn; k++)
            loom_sb_printf(&want, "%s%d", k ? "," : "", wids[k]);
        loom_sb_puts(&want, "],\"assistant_mask\":[");
        for (int64_t k = 0; k < wn; k++)
            loom_sb_printf(&want, "%s%d", k ? "," : "", wmask[k]);
        loom_sb_puts(&want, "]}\n");
        want_ids[rows++] = loom_json_clone(ctx, loom_json_get(cs, "text"));
        loom_sb_append(&jsonl, rl.buf, rl.len);
        loom_sb_putc(&jsonl, '\n');
        free(ids), free(mask), free(wids), free(wmask);
        loom_sample_free(&s);
        loom_sb_free(&rl);
        loom_json_free(cs);
    }
    /* the 12 of the generator's 13 conversations that jinja2 renders, 2 of them no dataset
     * rows */
    CHECK_EQ_INT(rows, 10);
    CHECK_EQ_INT(skipped, 2);
    CHECK(masked >= 5);
    const char *path = tmp_path("tools.jsonl");
    write_text(path, jsonl.buf);
    /* the token file `loom train` reads: the same ids, document by document */
    loom_dataset_config cfg = loom_dataset_config_default();
    loom_tokfile *tf = NULL;
    loom_dataset_report rep;
    REQUIRE_OK(ctx, loom_dataset_open(ctx, path, e, &cfg, &tf, &rep));
    CHECK_EQ_INT(loom_tokfile_n_docs(tf), rows);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    for (int d = 0; d < rows && d < loom_tokfile_n_docs(tf); d++) {
        char *dec = NULL;
        int32_t buf[4096];
        int64_t nd = (int64_t)(off[d + 1] - off[d]);
        REQUIRE(nd <= 4096);
        for (int64_t k = 0; k < nd; k++)
            buf[k] = (int32_t)loom_tokfile_ids(tf)[off[d] + (uint64_t)k];
        CHECK_OK(ctx, loom_tokenizer_decode(ctx, e->tokenizer, buf, nd, &dec));
        CHECK_MSG(dec && !strcmp(dec, want_ids[d]->s), "token file document %d differs", d);
        free(dec);
    }
    loom_tokfile_free(tf);
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s tokenize --tokenizer %s < %s", loom_test_bin(),
             fixture("tokenizer"), path);
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 0);
    size_t at = 0;
    while (out && out[at] && out[at] == want.buf[at])
        at++;
    CHECK_MSG(out && !out[at] && !want.buf[at], "loom tokenize differs at byte %zu: \"%.80s\"", at,
              out ? out + at : "(none)");
    free(out);
    /* a bad "tools" stops `loom tokenize` at its line */
    write_text(path,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": []}\n"
               "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": [\"f\"]}\n");
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 1);
    CHECK_CONTAINS(out, "loom: error: stdin:2: tools[0] must be an object");
    free(out);
    for (int d = 0; d < rows; d++)
        loom_json_free(want_ids[d]);
    loom_sb_free(&jsonl);
    loom_sb_free(&want);
    free(data);
    loom_dataset_encoder_free(e);
    loom_ctx_free(ctx);
}

static double loss_at(const char *out, const char *step) {
    const char *p = strstr(out, step);
    if (!p || !(p = strstr(p, "loss "))) return NAN;
    return atof(p + 5);
}

TEST(dataset_cli_train_jsonl) {
    const char *data = tmp_path("chat.jsonl");
    loom_sb sb;
    loom_sb_init(&sb);
    for (int i = 0; i < 24; i++) {
        if (i % 3 == 0)
            loom_sb_printf(&sb, "{\"text\": \"Sample %d says hello to the world.\"}\n", i);
        else if (i % 3 == 1)
            loom_sb_printf(&sb, "{\"messages\": [{\"role\": \"user\", \"content\": \"What is %d+%d?\"}, "
                                "{\"role\": \"assistant\", \"content\": \"It is %d.\"}]}\n",
                           i, i, 2 * i);
        else
            loom_sb_printf(&sb, "{\"prompt\": \"Q%d: \", \"completion\": \"A%d.\"}\n", i, i);
    }
    write_text(data, sb.buf);
    loom_sb_free(&sb);
    const char *model = fixture("models/tiny-qwen3");
    char *out;
    int rc = RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps",
                 "3", "--seq-len", "64", "--global-batch-size", "4", "--micro-batch-size", "2",
                 "--lr", "1e-3");
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, "24 samples (8 messages, 8 text, 8 prompt/completion)");
    CHECK_CONTAINS(out, "(built)");
    CHECK_CONTAINS(out, "step 3/3 | loss ");
    CHECK(isfinite(loss_at(out, "step 3/3")));
    free(out);
    /* again: the cache is reused; another seed still trains */
    rc = RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps", "3",
             "--seq-len", "64", "--global-batch-size", "4", "--data-seed", "9");
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, "(reused)");
    free(out);
    /* a bad line stops with FILE:LINE, or is skipped and counted */
    const char *bad = tmp_path("bad.jsonl");
    write_text(bad, "{\"text\": \"fine\"}\n{\"text\": \"oops\"\n{\"text\": \"fine too\"}\n");
    rc = RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", bad, "--train-steps", "1",
             "--seq-len", "32", "--global-batch-size", "1");
    CHECK_EQ_INT(rc, 1);
    CHECK_CONTAINS(out, "bad.jsonl:2: malformed JSON at column 16");
    free(out);
    rc = RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", bad, "--train-steps", "1",
             "--seq-len", "32", "--global-batch-size", "1", "--bad-lines", "skip");
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, "1 bad line skipped (--bad-lines skip); the first: ");
    free(out);
    /* too long for seq_len: error by default, dropped on request */
    rc = RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps", "1",
             "--seq-len", "16", "--global-batch-size", "1");
    CHECK_EQ_INT(rc, 1);
    CHECK_CONTAINS(out, "chat.jsonl:1: the sample has ");
    CHECK_CONTAINS(out, "more than seq_len = 16");
    free(out);
    rc = RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps", "1",
             "--seq-len", "16", "--global-batch-size", "1", "--truncation", "drop");
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, "longer than seq_len dropped (--truncation drop)");
    free(out);
}
