/* Chat templates: every case of tests/fixtures/tokenizer/chat_cases.jsonl
 * (transformers' apply_chat_template with Qwen3's template: text, ids and
 * the assistant-token mask) rendered and encoded byte for byte; Qwen2.5,
 * Qwen2 and Llama 3.0/3.1 against strings written out by hand from their
 * templates; Qwen3's <think> rules and multi-step tool logic; the per-byte
 * mask; recognising templates (and refusing relatives); every error. */
#include <stdlib.h>

#include "../src/data/chat.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static loom_json *J(loom_ctx *ctx, const char *text) {
    loom_json *j = NULL;
    if (loom_json_parse(ctx, text, strlen(text), "test json", &j) != LOOM_OK) {
        fprintf(stderr, "    bad test JSON: %s\n", loom_last_error(ctx));
        abort();
    }
    return j;
}

static loom_chat *named(loom_ctx *ctx, const char *name) {
    loom_chat *c = NULL;
    if (loom_chat_create_named(ctx, name, &c) != LOOM_OK) abort();
    return c;
}

/* Renders messages with tools (JSON texts; tools NULL: none); NULL on error
 * (message in ctx). With mask: *masked gets the masked bytes, runs separated
 * by '|'. */
static char *render_tools(loom_ctx *ctx, const loom_chat *c, const char *msgs, const char *tools,
                          bool gen, char **masked) {
    loom_json *j = J(ctx, msgs), *tj = tools ? J(ctx, tools) : NULL;
    char *text = NULL;
    uint8_t *mask = NULL;
    loom_status st = loom_chat_render(ctx, c, j, tj, gen, &text, &mask);
    loom_json_free(j);
    loom_json_free(tj);
    if (st) return NULL;
    if (masked) {
        size_t n = strlen(text);
        loom_sb sb;
        loom_sb_init(&sb);
        for (size_t i = 0; i < n; i++) {
            if (mask[i] && i > 0 && !mask[i - 1] && sb.len) loom_sb_putc(&sb, '|');
            if (mask[i]) loom_sb_putc(&sb, text[i]);
        }
        *masked = loom_sb_take(&sb);
    }
    free(mask);
    return text;
}

static char *render(loom_ctx *ctx, const loom_chat *c, const char *msgs, bool gen, char **masked) {
    return render_tools(ctx, c, msgs, NULL, gen, masked);
}

/* Renders and checks the text (and the masked bytes when want_masked). */
#define CHECK_RENDER(ctx, c, msgs, gen, want, want_masked)                                    \
    do {                                                                                      \
        char *_m = NULL;                                                                      \
        char *_t = render((ctx), (c), (msgs), (gen), &_m);                                    \
        if (!_t) loom_test_fail(__FILE__, __LINE__, "render: %s", loom_last_error(ctx));      \
        else {                                                                                \
            CHECK_STR(_t, (want));                                                            \
            if (want_masked) CHECK_STR(_m, (const char *)(want_masked));                      \
        }                                                                                     \
        free(_t);                                                                             \
        free(_m);                                                                             \
    } while (0)

/* Renders and expects an error of status st whose message holds m1 and m2. */
#define CHECK_RENDER_ERR(ctx, c, msgs, st_want, m1, m2)                                       \
    do {                                                                                      \
        char *_t = render((ctx), (c), (msgs), false, NULL);                                   \
        CHECK_MSG(_t == NULL, "rendered where an error was expected: %s", _t);               \
        free(_t);                                                                             \
        CHECK_EQ_INT((ctx)->status, (st_want));                                       \
        CHECK_CONTAINS(loom_last_error(ctx), (m1));                                           \
        CHECK_CONTAINS(loom_last_error(ctx), (m2));                                           \
    } while (0)

static char *fixture_path(const char *name) {
    static char buf[4][1024];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "%s/tokenizer/%s", loom_test_fixtures(), name);
    return p;
}

/* The fixture cases, one JSON object per line. */
static size_t read_cases(loom_ctx *ctx, loom_json **cases, size_t max) {
    char *data = NULL;
    size_t len = 0, n = 0;
    if (loom_read_file(ctx, fixture_path("chat_cases.jsonl"), 0, &data, &len) != LOOM_OK) return 0;
    for (char *line = data; *line && n < max;) {
        char *end = strchr(line, '\n');
        size_t l = end ? (size_t)(end - line) : strlen(line);
        if (l && loom_json_parse(ctx, line, l, "chat_cases.jsonl", &cases[n]) == LOOM_OK) n++;
        line += l + (end ? 1 : 0);
    }
    free(data);
    return n;
}

static bool case_gen(const loom_json *cs) {
    const loom_json *g = loom_json_get(cs, "add_generation_prompt");
    return g && g->type == LOOM_JSON_BOOL && g->b;
}

/* ---------------------------------------------------------------------- */
/* The fixture: HF's Qwen3 template                                        */
/* ---------------------------------------------------------------------- */

TEST(chat_fixture_text) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = NULL;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/tokenizer", loom_test_fixtures());
    REQUIRE_OK(ctx, loom_chat_load(ctx, dir, &c));
    CHECK_EQ_INT(loom_chat_kind_of(c), LOOM_CHAT_QWEN3);
    CHECK_STR(loom_chat_name(c), "qwen3");
    loom_json *cases[32];
    size_t n = read_cases(ctx, cases, 32);
    CHECK_EQ_INT(n, 6);
    for (size_t i = 0; i < n; i++) {
        char *text = NULL;
        uint8_t *mask = NULL;
        CHECK_OK(ctx, loom_chat_render(ctx, c, loom_json_get(cases[i], "messages"), NULL,
                                       case_gen(cases[i]), &text, &mask));
        const loom_json *want = loom_json_get(cases[i], "text");
        CHECK_MSG(text && strcmp(text, want->s) == 0, "case %zu: text\n%s\nwant\n%s", i,
                  text ? text : "(null)", want->s);
        free(text);
        free(mask);
        loom_json_free(cases[i]);
    }
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

TEST(chat_fixture_ids_and_mask) {
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_load(ctx, fixture_path("tokenizer.json"), &t));
    loom_chat *c = named(ctx, "qwen3");
    loom_json *cases[32];
    size_t n = read_cases(ctx, cases, 32);
    CHECK_EQ_INT(n, 6);
    for (size_t i = 0; i < n; i++) {
        const loom_json *want_ids = loom_json_get(cases[i], "ids");
        const loom_json *want_mask = loom_json_get(cases[i], "assistant_mask");
        int32_t *ids = NULL;
        uint8_t *mask = NULL;
        int64_t nt = 0;
        if (case_gen(cases[i])) {
            /* add_generation_prompt: the text's tokens (no mask in the fixture) */
            const loom_json *text = loom_json_get(cases[i], "text");
            CHECK_OK(ctx, loom_tokenizer_encode(ctx, t, text->s, text->slen, &ids, &nt));
        } else {
            CHECK_OK(ctx, loom_chat_encode(ctx, c, t, loom_json_get(cases[i], "messages"), NULL,
                                           &ids, &mask, &nt));
        }
        CHECK_MSG(nt == (int64_t)want_ids->n, "case %zu: %lld tokens, want %zu", i, (long long)nt,
                  want_ids->n);
        for (int64_t k = 0; k < nt && k < (int64_t)want_ids->n; k++) {
            CHECK_MSG(ids[k] == want_ids->items[k]->i, "case %zu: ids[%lld] = %d, want %lld", i,
                      (long long)k, ids[k], (long long)want_ids->items[k]->i);
            if (mask && want_mask)
                CHECK_MSG(mask[k] == want_mask->items[k]->i, "case %zu: mask[%lld] = %d, want %lld",
                          i, (long long)k, mask[k], (long long)want_mask->items[k]->i);
        }
        free(ids);
        free(mask);
        loom_json_free(cases[i]);
    }
    loom_chat_free(c);
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

/* NFC changes the text inside an assistant turn (e + combining acute): the
 * mask still starts at the content and ends at the final newline; text
 * cut across several tokens of one character (🙂) likewise. */
TEST(chat_encode_normalized_text) {
    loom_ctx *ctx = new_ctx();
    loom_tokenizer *t = NULL;
    REQUIRE_OK(ctx, loom_tokenizer_load(ctx, fixture_path("tokenizer.json"), &t));
    loom_chat *c = named(ctx, "qwen3");
    const char *msgs = "[{\"role\": \"user\", \"content\": \"Say it\"},"
                       " {\"role\": \"assistant\", \"content\": \"cafe\\u0301 \\ud83d\\ude42\"},"
                       " {\"role\": \"user\", \"content\": \"again\"},"
                       " {\"role\": \"assistant\", \"content\": \"\\ud83d\\ude42e\\u0301\"}]";
    const char *pieces[] = {
        "<|im_start|>user\nSay it<|im_end|>\n<|im_start|>assistant\n",
        "cafe\xcc\x81 \xf0\x9f\x99\x82<|im_end|>\n",
        "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n",
        "<think>\n\n</think>\n\n\xf0\x9f\x99\x82" "e\xcc\x81<|im_end|>\n",
    };
    loom_json *j = J(ctx, msgs);
    int32_t *ids = NULL;
    uint8_t *mask = NULL;
    int64_t n = 0;
    REQUIRE_OK(ctx, loom_chat_encode(ctx, c, t, j, NULL, &ids, &mask, &n));
    /* the pieces tokenize on their own (they meet at special tokens and newlines) */
    int64_t at = 0;
    for (int p = 0; p < 4; p++) {
        int32_t *pid = NULL;
        int64_t pn = 0;
        REQUIRE_OK(ctx, loom_tokenizer_encode(ctx, t, pieces[p], strlen(pieces[p]), &pid, &pn));
        for (int64_t k = 0; k < pn; k++, at++) {
            CHECK_MSG(at < n && ids[at] == pid[k], "piece %d token %lld", p, (long long)k);
            CHECK_MSG(at < n && mask[at] == (p % 2), "piece %d token %lld: mask %d", p,
                      (long long)k, at < n ? mask[at] : -1);
        }
        free(pid);
    }
    CHECK_EQ_INT(at, n);
    free(ids);
    free(mask);
    loom_json_free(j);
    loom_chat_free(c);
    loom_tokenizer_free(t);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Qwen3's rules                                                           */
/* ---------------------------------------------------------------------- */

TEST(chat_qwen3_mask_and_generation_prompt) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = named(ctx, "qwen3");
    const char *conv = "[{\"role\": \"system\", \"content\": \"You are terse.\"},"
                       " {\"role\": \"user\", \"content\": \"Name a colour.\"},"
                       " {\"role\": \"assistant\", \"content\": \"Blue.\"},"
                       " {\"role\": \"user\", \"content\": \"Another?\"},"
                       " {\"role\": \"assistant\", \"content\": \"Red.\"}]";
    CHECK_RENDER(ctx, c, conv, false,
                 "<|im_start|>system\nYou are terse.<|im_end|>\n"
                 "<|im_start|>user\nName a colour.<|im_end|>\n"
                 "<|im_start|>assistant\nBlue.<|im_end|>\n"
                 "<|im_start|>user\nAnother?<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\nRed.<|im_end|>\n",
                 "Blue.<|im_end|>\n|<think>\n\n</think>\n\nRed.<|im_end|>\n");
    /* the generation prompt is prompt, not assistant output */
    const char *q = "[{\"role\": \"user\", \"content\": \"Hi\"}]";
    CHECK_RENDER(ctx, c, q, true, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "");
    CHECK_RENDER(ctx, c, q, false, "<|im_start|>user\nHi<|im_end|>\n", "");
    loom_chat_set_enable_thinking(c, false);
    CHECK_RENDER(ctx, c, q, true,
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", "");
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

/* Reasoning of turns before the last user query is dropped; the last turn
 * keeps its reasoning (from reasoning_content or from <think> in content). */
TEST(chat_qwen3_think_rules) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = named(ctx, "qwen3");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q1\"},"
                 " {\"role\": \"assistant\", \"content\": \"<think>\\nr1\\n</think>\\n\\nA1\"},"
                 " {\"role\": \"user\", \"content\": \"Q2\"},"
                 " {\"role\": \"assistant\", \"content\": \"A2\", \"reasoning_content\": \"\\nr2\\n\"}]",
                 false,
                 "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                 "<|im_start|>user\nQ2<|im_end|>\n"
                 "<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n",
                 "A1<|im_end|>\n|<think>\nr2\n</think>\n\nA2<|im_end|>\n");
    /* earlier reasoning_content is dropped as well; the last turn's <think>
     * in content is re-written (newlines around it normalised); with the
     * generation prompt after it */
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q1\"},"
                 " {\"role\": \"assistant\", \"content\": \"A1\", \"reasoning_content\": \"r1\"},"
                 " {\"role\": \"user\", \"content\": \"Q2\"},"
                 " {\"role\": \"assistant\", \"content\": \"x<think>\\n\\nr2</think>A2\"},"
                 " {\"role\": \"user\", \"content\": \"Q3\"}]",
                 true,
                 "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
                 "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\nA2<|im_end|>\n"
                 "<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n",
                 "A1<|im_end|>\n|A2<|im_end|>\n");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"},"
                 " {\"role\": \"assistant\", \"content\": \"pre<think>\\n\\nr</think>\\n\\n\\nA\"}]",
                 false,
                 "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nA<|im_end|>\n",
                 NULL);
    /* reasoning_content given: content is not split; a "<think>" without
     * "</think>" stays as it is */
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"},"
                 " {\"role\": \"assistant\", \"content\": \"<think>a</think>B\", \"reasoning_content\": \"\"}]",
                 false,
                 "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<think>a</think>B<|im_end|>\n",
                 NULL);
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"assistant\", \"content\": \"<think>open\"}, {\"role\": \"user\", \"content\": \"Q\"}]",
                 false,
                 "<|im_start|>assistant\n<think>open<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n",
                 "<think>open<|im_end|>\n");
    /* no user message at all: the last message counts as the query */
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"assistant\", \"content\": \"A\", \"reasoning_content\": \"r\"}]",
                 false,
                 "<|im_start|>system\nS<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n", NULL);
    /* a system message later in the conversation is rendered in place */
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"system\", \"content\": \"S\"}]",
                 false, "<|im_start|>user\nQ<|im_end|>\n<|im_start|>system\nS<|im_end|>\n", NULL);
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

/* Tool calls and tool responses; the last query is the last user message
 * that is not a wrapped <tool_response>, so the assistant turns after it
 * keep their reasoning. Arguments are written as Python's json.dumps. */
TEST(chat_qwen3_tools) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = named(ctx, "qwen3");
    CHECK_RENDER(
        ctx, c,
        "[{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Q\"},"
        " {\"role\": \"assistant\", \"content\": \"<think>\\nplan\\n</think>\\n\\nLet me look.\","
        "  \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"get\", \"arguments\":"
        "   {\"city\": \"Paris\", \"n\": 1.5, \"k\": -3, \"small\": 0.0001, \"tiny\": 1e-05,"
        "    \"ok\": true, \"no\": null, \"tags\": [\"a\", \"\\u00e9\", []], \"q\": \"x\\\"y\\n\\u0001\\\\\", \"o\": {}}}},"
        "   {\"name\": \"put\", \"arguments\": \"{\\\"raw\\\": 1}\"}]},"
        " {\"role\": \"tool\", \"content\": \"sunny\"}, {\"role\": \"tool\", \"content\": \"22C\"},"
        " {\"role\": \"assistant\", \"content\": \"It is sunny.\"}]",
        false,
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nplan\n</think>\n\nLet me look.\n<tool_call>\n"
        "{\"name\": \"get\", \"arguments\": {\"city\": \"Paris\", \"n\": 1.5, \"k\": -3, "
        "\"small\": 0.0001, \"tiny\": 1e-05, \"ok\": true, \"no\": null, "
        "\"tags\": [\"a\", \"\xc3\xa9\", []], \"q\": \"x\\\"y\\n\\u0001\\\\\", \"o\": {}}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"put\", \"arguments\": {\"raw\": 1}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n22C\n"
        "</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nIt is sunny.<|im_end|>\n",
        NULL);
    /* a tool response wrapped in a user message does not count as the query */
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"},"
                 " {\"role\": \"assistant\", \"content\": \"A\", \"reasoning_content\": \"r\"},"
                 " {\"role\": \"user\", \"content\": \"<tool_response>\\nx\\n</tool_response>\"},"
                 " {\"role\": \"assistant\", \"content\": \"B\"}]",
                 false,
                 "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nA<|im_end|>\n"
                 "<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n"
                 "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n",
                 "<think>\nr\n</think>\n\nA<|im_end|>\n|<think>\n\n</think>\n\nB<|im_end|>\n");
    /* tool calls without content (content null), then no newline before the first */
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"content\": null,"
                 "  \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": {\"a\": 2.0}}}]},"
                 " {\"role\": \"tool\", \"content\": \"ok\"}]",
                 false,
                 "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
                 "{\"name\": \"f\", \"arguments\": {\"a\": 2.0}}\n</tool_call><|im_end|>\n"
                 "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n",
                 "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 2.0}}\n</tool_call><|im_end|>\n");
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

/* tools= (HF's list of JSON schemas): Qwen3 and Qwen2.5 write them into the
 * system message (prompt, never in the mask); Qwen2 and Llama 3 refuse
 * them; a marked template gets them as `tools`; bad tools are refused. */
TEST(chat_tools) {
    loom_ctx *ctx = new_ctx();
    const char *msgs = "[{\"role\": \"system\", \"content\": \"S\"}, "
                       "{\"role\": \"user\", \"content\": \"Q\"}, "
                       "{\"role\": \"assistant\", \"content\": \"A\"}]";
    const char *tools =
        "[{\"type\": \"function\", \"function\": {\"name\": \"f\", "
        "\"parameters\": {\"x\": 1.5, \"s\": \"\\u00e9\\\"\"}}}, {\"name\": \"g\"}]";
#define TOOLS_HEAD                                                                                 \
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "     \
    "provided with function signatures within <tools></tools> XML tags:\n<tools>\n"                \
    "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"x\": 1.5, "       \
    "\"s\": \"\xc3\xa9\\\"\"}}}\n{\"name\": \"g\"}\n</tools>\n\nFor each function call, return a " \
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n"      \
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"                \
    "</tool_call><|im_end|>\n"
    struct {
        const char *name, *want;
    } ok[] = {
        {"qwen3", "<|im_start|>system\nS\n\n" TOOLS_HEAD "<|im_start|>user\nQ<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"},
        {"qwen2.5", "<|im_start|>system\nS\n\n" TOOLS_HEAD "<|im_start|>user\nQ<|im_end|>\n"
                    "<|im_start|>assistant\nA<|im_end|>\n"},
    };
    for (size_t k = 0; k < 2; k++) {
        loom_chat *c = named(ctx, ok[k].name);
        char *m = NULL, *t = render_tools(ctx, c, msgs, tools, false, &m);
        CHECK_MSG(t, "%s: %s", ok[k].name, loom_last_error(ctx));
        if (t) {
            CHECK_STR(t, ok[k].want);
            /* the tools are prompt: only the assistant's turn is masked */
            CHECK_STR(m, strstr(ok[k].want, "<|im_start|>assistant\n") + 22);
        }
        free(t), free(m);
        /* no system message: Qwen3 opens one for the tools alone, Qwen2.5 with its default */
        t = render_tools(ctx, c, "[{\"role\": \"user\", \"content\": \"Q\"}]",
                         "[{\"name\": \"g\"}]", false, NULL);
        const char *pre = k ? "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You "
                              "are a helpful assistant.\n\n# Tools\n\n"
                            : "<|im_start|>system\n# Tools\n\n";
        CHECK_MSG(t && !strncmp(t, pre, strlen(pre)), "%s: %s", ok[k].name,
                  t ? t : loom_last_error(ctx));
        free(t);
        /* [] and null are no tools (jinja2: an empty list is false) */
        char *plain = render(ctx, c, msgs, false, NULL);
        t = render_tools(ctx, c, msgs, "[]", false, NULL);
        CHECK(plain && t && !strcmp(plain, t));
        free(t);
        t = render_tools(ctx, c, msgs, "null", false, NULL);
        CHECK(plain && t && !strcmp(plain, t));
        free(t), free(plain);
        loom_chat_free(c);
    }
    /* Qwen2's template has no tools: refused when there are some, [] renders. Llama 3:
     * even [] (the 3.1 template's tool preamble shows for any list), null renders. */
    static const struct {
        const char *name, *refused, *why, *renders;
    } refusing[] = {
        {"qwen2", NULL, "the qwen2 template has no tools (it would drop the 2", "[]"},
        {"llama3.1", "[]", "llama3.1 renderer does not do tool use", "null"},
        {"llama3", "[]", "llama3 renderer does not do tool use", "null"},
    };
    loom_chat *c;
    char *t;
    for (size_t k = 0; k < 3; k++) {
        c = named(ctx, refusing[k].name);
        t = render_tools(ctx, c, msgs, refusing[k].refused ? refusing[k].refused : tools, false,
                         NULL);
        CHECK(!t);
        CHECK_EQ_INT(ctx->status, LOOM_ERR_UNSUPPORTED);
        CHECK_CONTAINS(loom_last_error(ctx), refusing[k].why);
        free(t);
        t = render_tools(ctx, c, msgs, refusing[k].renders, false, NULL);
        CHECK_MSG(t, "%s: %s", refusing[k].name, loom_last_error(ctx));
        free(t);
        loom_chat_free(c);
    }
    /* bad tools, for every renderer */
    const char *names[] = {"qwen3", "qwen2.5", "qwen2", "llama3.1", "llama3"};
    for (size_t k = 0; k < 5; k++) {
        c = named(ctx, names[k]);
        const char *bad[][3] = {
            {"{\"name\": \"f\"}", "tools must be a JSON array of tool objects", "got object"},
            {"\"[]\"", "tools must be a JSON array", "got string"},
            {"[{\"name\": \"f\"}, 3]", "tools[1] must be an object", "got number"},
        };
        for (size_t b = 0; b < 3; b++) {
            t = render_tools(ctx, c, msgs, bad[b][0], false, NULL);
            CHECK_MSG(!t, "%s: rendered with tools %s", names[k], bad[b][0]);
            free(t);
            CHECK_EQ_INT(ctx->status, LOOM_ERR_INVALID_ARG);
            CHECK_CONTAINS(loom_last_error(ctx), bad[b][1]);
            CHECK_CONTAINS(loom_last_error(ctx), bad[b][2]);
        }
        loom_chat_free(c);
    }
    c = named(ctx, "qwen3");
    t = render_tools(ctx, c, msgs, "[{\"n\": 1e30}]", false, NULL);
    CHECK(!t);
    CHECK_CONTAINS(loom_last_error(ctx), "tools[0]: number 1e+30 is too large");
    free(t);
    loom_chat_free(c);
    /* a template loom does not recognise gets them as `tools` */
    REQUIRE_OK(ctx, loom_chat_parse(ctx,
                                    "{% for t in tools %}{{ t.name }};{% endfor %}{% for m in "
                                    "messages %}{% generation %}{{ m.content }}{% endgeneration "
                                    "%}{% endfor %}",
                                    "x", &c));
    t = render_tools(ctx, c, "[{\"role\": \"user\", \"content\": \"Q\"}]",
                     "[{\"name\": \"f\"}, {\"name\": \"g\"}]", false, NULL);
    CHECK_STR(t ? t : loom_last_error(ctx), "f;g;Q");
    free(t);
    loom_chat_free(c);
    loom_ctx_free(ctx);
#undef TOOLS_HEAD
}

/* ---------------------------------------------------------------------- */
/* Qwen2.5, Qwen2, Llama 3 (strings written from the templates by hand)    */
/* ---------------------------------------------------------------------- */

TEST(chat_qwen25) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = NULL;
    REQUIRE_OK(ctx, loom_chat_create(ctx, LOOM_CHAT_QWEN2, &c));
    CHECK_STR(loom_chat_name(c), "qwen2.5");
    const char *sys = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
                      "helpful assistant.<|im_end|>\n";
    char want[1024];
    snprintf(want, sizeof want, "%s%s", sys,
             "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}]",
                 false, want, "Hello!<|im_end|>\n");
    snprintf(want, sizeof want, "%s%s", sys, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    CHECK_RENDER(ctx, c, "[{\"role\": \"user\", \"content\": \"Hi\"}]", true, want, "");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Hi\"},"
                 " {\"role\": \"assistant\", \"content\": \"<think>kept</think>Yo\"}, {\"role\": \"system\", \"content\": \"S2\"}]",
                 false,
                 "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\n<think>kept</think>Yo<|im_end|>\n<|im_start|>system\nS2<|im_end|>\n",
                 "<think>kept</think>Yo<|im_end|>\n");
    /* tool calls: arguments always through tojson (a string gets quoted) */
    snprintf(want, sizeof want, "%s%s", sys,
             "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
             "{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>\n<tool_call>\n"
             "{\"name\": \"g\", \"arguments\": {\"b\": [1, 2]}}\n</tool_call><|im_end|>\n"
             "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
             "</tool_response><|im_end|>\n<|im_start|>assistant\nDone<|im_end|>\n");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\","
                 "  \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}},"
                 "                   {\"type\": \"function\", \"function\": {\"name\": \"g\", \"arguments\": {\"b\": [1, 2]}}}]},"
                 " {\"role\": \"tool\", \"content\": \"r1\"}, {\"role\": \"tool\", \"content\": \"r2\"},"
                 " {\"role\": \"assistant\", \"content\": \"Done\"}]",
                 false, want,
                 "<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>\n"
                 "<tool_call>\n{\"name\": \"g\", \"arguments\": {\"b\": [1, 2]}}\n</tool_call><|im_end|>\n"
                 "|Done<|im_end|>\n");
    /* content and a tool call */
    snprintf(want, sizeof want, "%s%s", sys,
             "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nLooking.\n<tool_call>\n"
             "{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|im_end|>\n");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", \"content\": \"Looking.\","
                 "  \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": {}}}]}]",
                 false, want, NULL);
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

TEST(chat_qwen2) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = named(ctx, "qwen2");
    CHECK_EQ_INT(loom_chat_kind_of(c), LOOM_CHAT_QWEN2);
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}]",
                 true,
                 "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n",
                 "Hello!<|im_end|>\n");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"Hi\"}]",
                 false, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n", "");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": []}]",
                     LOOM_ERR_UNSUPPORTED, "messages[0]", "tool calls");
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

TEST(chat_llama3) {
    loom_ctx *ctx = new_ctx();
    loom_chat *c = NULL;
    REQUIRE_OK(ctx, loom_chat_create(ctx, LOOM_CHAT_LLAMA3, &c));
    CHECK_STR(loom_chat_name(c), "llama3.1");
    const char *head = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                       "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
    char want[1024];
    /* system trimmed into the system block; contents trimmed (Python's
     * str.strip: U+3000 is whitespace too) */
    snprintf(want, sizeof want, "%s%s", head,
             "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"system\", \"content\": \"  Be brief.\\n\"}, {\"role\": \"user\", \"content\": \"\\u3000Hi \\t\"},"
                 " {\"role\": \"assistant\", \"content\": \"Hello!\\n\\n\"}]",
                 false, want, "Hello!<|eot_id|>");
    snprintf(want, sizeof want, "%s%s", head,
             "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\n");
    CHECK_RENDER(ctx, c, "[{\"role\": \"user\", \"content\": \"Hi\"}]", true, want, "");
    /* a later system message is a turn of its own */
    snprintf(want, sizeof want, "%s%s", head,
             "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
             "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"system\", \"content\": \"S\"}]",
                 false, want, "");
    CHECK_RENDER_ERR(ctx, c, "[{\"role\": \"tool\", \"content\": \"x\"}]", LOOM_ERR_UNSUPPORTED,
                     "messages[0]", "tool use");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"assistant\", \"content\": \"x\", \"tool_calls\": null}]",
                     LOOM_ERR_UNSUPPORTED, "messages[0]", "tool_calls");
    loom_chat_free(c);

    c = named(ctx, "llama3");
    CHECK_RENDER(ctx, c,
                 "[{\"role\": \"system\", \"content\": \" S \"}, {\"role\": \"user\", \"content\": \"Hi\"},"
                 " {\"role\": \"assistant\", \"content\": \" Yo\"}]",
                 true,
                 "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
                 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n",
                 "Yo<|eot_id|>");
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Recognising templates                                                   */
/* ---------------------------------------------------------------------- */

static const char QWEN25_TEMPLATE[] =
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

static const char QWEN2_TEMPLATE[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

static const char LLAMA30_TEMPLATE[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

static const char LLAMA31_TEMPLATE[] =
    "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n"
    "{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n"
    "{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if builtin_tools is defined or tools is not none %}\n    {{- \"Environment: ipython\\n\" }}\n{%- endif %}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n\n{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n";

static void expect_parse(loom_ctx *ctx, const char *tpl, const char *name) {
    loom_chat *c = NULL;
    loom_status st = loom_chat_parse(ctx, tpl, "test", &c);
    CHECK_MSG(st == LOOM_OK, "%s not recognised: %s", name, loom_last_error(ctx));
    if (c) CHECK_STR(loom_chat_name(c), name);
    loom_chat_free(c);
}

TEST(chat_recognise_templates) {
    loom_ctx *ctx = new_ctx();
    char *qwen3 = NULL;
    size_t len;
    REQUIRE_OK(ctx, loom_read_file(ctx, fixture_path("chat_template.jinja"), 0, &qwen3, &len));
    expect_parse(ctx, qwen3, "qwen3");
    expect_parse(ctx, QWEN25_TEMPLATE, "qwen2.5");
    expect_parse(ctx, QWEN2_TEMPLATE, "qwen2");
    expect_parse(ctx, LLAMA31_TEMPLATE, "llama3.1");
    expect_parse(ctx, LLAMA30_TEMPLATE, "llama3");

    /* relatives and strangers are refused, saying what loom renders */
    struct {
        const char *tpl, *why;
    } bad[] = {
        {"{% for m in messages %}{{ m.content }}{% endfor %}", "matches none"},
        {"<|im_start|>{{ '<think>\\n' }}{{ m.reasoning_content }}", "Qwen3 relative"},
        {"<|start_header_id|><|eot_id|>{{ strftime_now('%d %b %Y') }}", "Llama 3.2"},
        {"<|im_start|>You are a helpful assistant.{% if tools %}{% endif %}", "not Qwen2's"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        loom_chat *c = NULL;
        CHECK_EQ_INT(loom_chat_parse(ctx, bad[i].tpl, "dir/x", &c), LOOM_ERR_UNSUPPORTED);
        CHECK(c == NULL);
        CHECK_CONTAINS(loom_last_error(ctx), "chat template of dir/x is not one loom renders "
                                             "(Qwen3, Qwen2/2.5 ChatML, Llama 3)");
        CHECK_CONTAINS(loom_last_error(ctx), bad[i].why);
    }
    /* a template the interpreter cannot run is refused, naming the construct */
    loom_chat *c = NULL;
    CHECK_EQ_INT(loom_chat_parse(ctx, "{% include 'x.jinja' %}", "dir/x", &c),
                 LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "dir/x:1:4: unsupported statement 'include'");
    CHECK_EQ_INT(loom_chat_parse(ctx,
                                 "{% for m in messages %}{% generation %}{{ m.content | "
                                 "wordcount }}{% endgeneration %}{% endfor %}",
                                 "dir/x", &c),
                 LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "unsupported filter 'wordcount'");
    CHECK(c == NULL);
    /* Qwen3's template with the generation marks removed (the hub's) is Qwen3 too */
    loom_sb sb;
    loom_sb_init(&sb);
    for (const char *p = qwen3; *p;) {
        const char *g = strstr(p, "{% generation %}"), *e = strstr(p, "{% endgeneration %}");
        const char *nx = g && (!e || g < e) ? g : e;
        if (!nx) {
            loom_sb_puts(&sb, p);
            break;
        }
        loom_sb_append(&sb, p, (size_t)(nx - p));
        p = nx + (nx == g ? strlen("{% generation %}") : strlen("{% endgeneration %}"));
    }
    CHECK(!strstr(sb.buf, "generation %}"));
    expect_parse(ctx, sb.buf, "qwen3");
    loom_sb_free(&sb);
    free(qwen3);
    loom_ctx_free(ctx);
}

/* A template loom does not recognise, with {% generation %} marks: the
 * interpreter renders it and the marks are the mask. */
TEST(chat_any_template_with_generation_marks) {
    loom_ctx *ctx = new_ctx();
    const char *tpl = "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] "
                      "{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}</s>"
                      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
                      "{% if add_generation_prompt %}[ASSISTANT] {% endif %}";
    loom_chat *c = NULL;
    REQUIRE_OK(ctx, loom_chat_parse(ctx, tpl, "dir/x", &c));
    CHECK_EQ_INT(loom_chat_kind_of(c), LOOM_CHAT_TEMPLATE);
    CHECK_STR(loom_chat_name(c), "template");
    const char *msgs = "[{\"role\": \"user\", \"content\": \"hi\"}, "
                       "{\"role\": \"assistant\", \"content\": \" yo \"}]";
    loom_json *m = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, msgs, strlen(msgs), "m", &m));
    char *text = NULL;
    uint8_t *mask = NULL;
    REQUIRE_OK(ctx, loom_chat_render(ctx, c, m, NULL, true, &text, &mask));
    /* as jinja2: trim_blocks takes the newline after {% endif %}; no bos_token without a
     * tokenizer_config.json */
    CHECK_STR(text, "[USER] hi[ASSISTANT] yo</s>[ASSISTANT] ");
    const char *want = "000000000000000000000111111000000000000";
    for (size_t i = 0; text && i < strlen(text); i++)
        CHECK_MSG(mask[i] == (uint8_t)(want[i] - '0'), "mask[%zu] = %d", i, mask[i]);
    free(text);
    free(mask);
    CHECK_EQ_INT(loom_chat_render(ctx, c, NULL, NULL, false, &text, &mask), LOOM_ERR_INVALID_ARG);
    loom_json_free(m);
    loom_chat_free(c);
    loom_ctx_free(ctx);
}

static const char *write_in(const char *dir, const char *name, const char *text) {
    static char path[4200];
    if (snprintf(path, sizeof path, "%s/%s", dir, name) >= (int)sizeof path) abort();
    FILE *f = fopen(path, "w");
    if (!f) abort();
    fputs(text, f);
    fclose(f);
    return path;
}

TEST(chat_load_model_dir) {
    loom_ctx *ctx = new_ctx();
    const char *tmp = loom_test_tmpdir();
    char dir[1024];
    loom_chat *c = NULL;

    /* no template at all */
    snprintf(dir, sizeof dir, "%s/base", tmp);
    REQUIRE_OK(ctx, loom_mkdirs(ctx, dir));
    write_in(dir, "tokenizer_config.json", "{\"eos_token\": \"<|endoftext|>\"}");
    CHECK_EQ_INT(loom_chat_load(ctx, dir, &c), LOOM_ERR_NOT_FOUND);
    CHECK(c == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "has no chat template");
    CHECK_CONTAINS(loom_last_error(ctx), dir);

    /* a string in tokenizer_config.json */
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_puts(&sb, "{\"chat_template\": ");
    loom_json_write_string(&sb, QWEN25_TEMPLATE, strlen(QWEN25_TEMPLATE));
    loom_sb_puts(&sb, "}");
    snprintf(dir, sizeof dir, "%s/q25", tmp);
    REQUIRE_OK(ctx, loom_mkdirs(ctx, dir));
    write_in(dir, "tokenizer_config.json", sb.buf);
    REQUIRE_OK(ctx, loom_chat_load(ctx, dir, &c));
    CHECK_STR(loom_chat_name(c), "qwen2.5");
    loom_chat_free(c);
    /* chat_template.jinja wins over the config (as in transformers) */
    write_in(dir, "chat_template.jinja", LLAMA31_TEMPLATE);
    REQUIRE_OK(ctx, loom_chat_load(ctx, dir, &c));
    CHECK_STR(loom_chat_name(c), "llama3.1");
    loom_chat_free(c);
    loom_sb_free(&sb);

    /* a list of named templates: "default" */
    loom_sb_init(&sb);
    loom_sb_puts(&sb, "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"x\"}, "
                      "{\"name\": \"default\", \"template\": ");
    loom_json_write_string(&sb, QWEN2_TEMPLATE, strlen(QWEN2_TEMPLATE));
    loom_sb_puts(&sb, "}]}");
    snprintf(dir, sizeof dir, "%s/list", tmp);
    REQUIRE_OK(ctx, loom_mkdirs(ctx, dir));
    write_in(dir, "tokenizer_config.json", sb.buf);
    REQUIRE_OK(ctx, loom_chat_load(ctx, dir, &c));
    CHECK_STR(loom_chat_name(c), "qwen2");
    loom_chat_free(c);
    loom_sb_free(&sb);
    write_in(dir, "tokenizer_config.json",
             "{\"chat_template\": [{\"name\": \"tool_use\", \"template\": \"x\"}]}");
    CHECK_EQ_INT(loom_chat_load(ctx, dir, &c), LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "'default'");

    /* an unknown template */
    snprintf(dir, sizeof dir, "%s/other", tmp);
    REQUIRE_OK(ctx, loom_mkdirs(ctx, dir));
    write_in(dir, "chat_template.jinja", "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}");
    CHECK_EQ_INT(loom_chat_load(ctx, dir, &c), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "is not one loom renders (Qwen3, Qwen2/2.5 ChatML, Llama 3)");
    CHECK_CONTAINS(loom_last_error(ctx), dir);

    /* by name */
    CHECK_EQ_INT(loom_chat_create_named(ctx, "mistral", &c), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "'mistral'");
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Errors                                                                  */
/* ---------------------------------------------------------------------- */

TEST(chat_errors) {
    loom_ctx *ctx = new_ctx();
    const char *names[] = {"qwen3", "qwen2.5", "qwen2", "llama3.1", "llama3"};
    for (size_t k = 0; k < 5; k++) {
        loom_chat *c = named(ctx, names[k]);
        CHECK_RENDER_ERR(ctx, c, "[]", LOOM_ERR_INVALID_ARG, "empty conversation", "");
        CHECK_RENDER_ERR(ctx, c, "{\"role\": \"user\", \"content\": \"x\"}", LOOM_ERR_INVALID_ARG,
                         "messages must be a JSON array", "got object");
        CHECK_RENDER_ERR(ctx, c, "[\"hi\"]", LOOM_ERR_INVALID_ARG, "messages[0] must be an object",
                         "got string");
        CHECK_RENDER_ERR(ctx, c,
                         "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"narrator\", \"content\": \"y\"}]",
                         LOOM_ERR_INVALID_ARG, "messages[1]: unknown role 'narrator'", "system, user");
        CHECK_RENDER_ERR(ctx, c, "[{\"content\": \"y\"}]", LOOM_ERR_INVALID_ARG, "messages[0]",
                         "no 'role'");
        CHECK_RENDER_ERR(ctx, c,
                         "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\"}]",
                         LOOM_ERR_INVALID_ARG, "messages[1] (role 'assistant'): no 'content'", "");
        CHECK_RENDER_ERR(ctx, c,
                         "[{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": null}]",
                         LOOM_ERR_INVALID_ARG, "messages[1] (role 'user'): no 'content'", "");
        CHECK_RENDER_ERR(ctx, c,
                         "[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"x\"}]}]",
                         LOOM_ERR_INVALID_ARG, "messages[0] (role 'user'): 'content' must be a string",
                         "got array");
        CHECK_RENDER_ERR(ctx, c, "[{\"role\": \"user\", \"content\": \"a\\u0000b\"}]",
                         LOOM_ERR_INVALID_ARG, "messages[0]", "NUL");

        /* invalid UTF-8 (a DOM built in memory, not parsed) */
        loom_json *j = J(ctx, "[{\"role\": \"user\", \"content\": \"ok\"}, {\"role\": \"assistant\", \"content\": \"abc\"}]");
        loom_json *content = (loom_json *)loom_json_get(j->items[1], "content");
        content->s[1] = (char)0xff;
        char *text = NULL;
        uint8_t *mask = NULL;
        CHECK_EQ_INT(loom_chat_render(ctx, c, j, NULL, false, &text, &mask), LOOM_ERR_INVALID_ARG);
        CHECK(text == NULL && mask == NULL);
        CHECK_CONTAINS(loom_last_error(ctx), "messages[1]: 'content' is not valid UTF-8");
        loom_json_free(j);
        loom_chat_free(c);
    }
    loom_chat *c = named(ctx, "qwen3");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": \"y\", \"reasoning_content\": 3}]",
                     LOOM_ERR_INVALID_ARG, "messages[1]", "'reasoning_content' must be a string");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": {\"name\": \"f\"}}]",
                     LOOM_ERR_INVALID_ARG, "messages[0]", "'tool_calls' must be an array");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"arguments\": {}}}]}]",
                     LOOM_ERR_INVALID_ARG, "messages[0].tool_calls[0].function", "no 'name'");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\"}}]}]",
                     LOOM_ERR_INVALID_ARG, "messages[0].tool_calls[0].function", "no 'arguments'");
    CHECK_RENDER_ERR(ctx, c,
                     "[{\"role\": \"assistant\", \"tool_calls\": [{\"name\": \"f\", \"arguments\": {\"n\": 1e30}}]}]",
                     LOOM_ERR_UNSUPPORTED, "messages[0].tool_calls[0]", "too large");
    /* no content and no tool calls */
    CHECK_RENDER_ERR(ctx, c, "[{\"role\": \"assistant\", \"tool_calls\": []}]",
                     LOOM_ERR_INVALID_ARG, "messages[0] (role 'assistant'): no 'content'", "");
    loom_chat_free(c);

    /* encode reports the renderer's errors and leaves nothing behind */
    loom_tokenizer *t = NULL;
    if (loom_tokenizer_load(ctx, fixture_path("tokenizer.json"), &t) == LOOM_OK) {
        c = named(ctx, "qwen3");
        loom_json *j = J(ctx, "[{\"role\": \"robot\", \"content\": \"x\"}]");
        int32_t *ids = (int32_t *)1;
        uint8_t *mask = (uint8_t *)1;
        int64_t n = 5;
        CHECK_EQ_INT(loom_chat_encode(ctx, c, t, j, NULL, &ids, &mask, &n), LOOM_ERR_INVALID_ARG);
        CHECK(ids == NULL && mask == NULL && n == 0);
        CHECK_CONTAINS(loom_last_error(ctx), "messages[0]: unknown role 'robot'");
        loom_json_free(j);
        loom_chat_free(c);
        loom_tokenizer_free(t);
    } else {
        CHECK_MSG(false, "fixture tokenizer: %s", loom_last_error(ctx));
    }
    loom_ctx_free(ctx);
}
