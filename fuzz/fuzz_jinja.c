/* libFuzzer target for the Jinja interpreter (src/data/jinja*.c): chat
 * templates come from model directories, so from outside.
 *
 * Input: a template; when it holds a NUL byte, what follows the first one is
 * the variables (a JSON object) and the template is what precedes it; else a
 * fixed conversation with tools. Parse errors must be FORMAT or UNSUPPORTED
 * with a message naming the template; a render succeeds (text NUL-terminated
 * at its length, generation spans inside it and in order, the same text the
 * second time) or fails with a message. Leaks and memory errors: ASan. */
#include <stdlib.h>
#include <string.h>

#include "../src/data/jinja.h"

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c)) {                                                                                \
            fprintf(stderr, "fuzz_jinja: check failed: %s (line %d)\n", #c, __LINE__);             \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

static const char VARS[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \" sys \"}, {\"role\": \"user\", "
    "\"content\": \"hi \\u00e9\"}, {\"role\": \"assistant\", \"content\": \"<think>\\nr\\n</think>"
    "\\n\\nok\", \"reasoning_content\": \"why\", \"tool_calls\": [{\"type\": \"function\", "
    "\"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1, \"b\": [true, null, 2.5]}}}]}, "
    "{\"role\": \"tool\", \"content\": \"{\\\"x\\\": 1}\"}, {\"role\": \"user\", \"content\": "
    "[{\"type\": \"text\", \"text\": \"t\"}, {\"type\": \"image\"}]}], \"tools\": [{\"type\": "
    "\"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}], "
    "\"add_generation_prompt\": true, \"enable_thinking\": false, \"bos_token\": \"<s>\"}";

static char *render(loom_ctx *ctx, const loom_jinja *t, const loom_json *vars, size_t *len) {
    char *text = NULL;
    loom_jinja_span *sp = NULL;
    size_t n = 0;
    loom_status st = loom_jinja_render(ctx, t, vars, &text, len, &sp, &n);
    if (st != LOOM_OK) {
        CHECK(!text && !sp && n == 0);
        CHECK(loom_last_error(ctx)[0] != 0);
        CHECK(st == LOOM_ERR_FORMAT || st == LOOM_ERR_UNSUPPORTED || st == LOOM_ERR_INVALID_ARG ||
              st == LOOM_ERR_OOM);
        return NULL;
    }
    CHECK(text && text[*len] == 0);
    for (size_t i = 0; i < n; i++) {
        CHECK(sp[i].start <= sp[i].end && sp[i].end <= *len);
        if (i)
            CHECK(sp[i - 1].end <= sp[i].end);
    }
    free(sp);
    return text;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK)
        return 0;
    const char *src = (const char *)data;
    const uint8_t *nul = memchr(data, 0, size);
    size_t tlen = nul ? (size_t)(nul - data) : size;
    loom_json *vars = NULL;
    if (nul) {
        const char *v = (const char *)nul + 1;
        size_t vlen = size - tlen - 1;
        if (loom_json_parse(ctx, v, vlen, "vars", &vars) != LOOM_OK ||
            vars->type != LOOM_JSON_OBJECT) {
            loom_json_free(vars);
            vars = NULL;
        }
    }
    if (!vars)
        CHECK(loom_json_parse(ctx, VARS, strlen(VARS), "vars", &vars) == LOOM_OK);

    loom_jinja *t = NULL;
    loom_status st = loom_jinja_parse(ctx, src, tlen, "fuzz", &t);
    if (st != LOOM_OK) {
        CHECK(!t);
        CHECK(st == LOOM_ERR_FORMAT || st == LOOM_ERR_UNSUPPORTED || st == LOOM_ERR_OOM);
        CHECK(strncmp(loom_last_error(ctx), "fuzz:", 5) == 0 || st == LOOM_ERR_OOM);
    } else {
        size_t l1 = 0, l2 = 0;
        char *a = render(ctx, t, vars, &l1);
        char *b = render(ctx, t, vars, &l2);
        /* the same text twice, unless the clock is read */
        if (a && b && !memmem(src, tlen, "strftime", 8))
            CHECK(l1 == l2 && !memcmp(a, b, l1));
        CHECK(!a == !b);
        free(a);
        free(b);
    }
    loom_jinja_free(t);
    loom_json_free(vars);
    loom_ctx_free(ctx);
    return 0;
}
