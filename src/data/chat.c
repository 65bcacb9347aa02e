/* Chat templates: picking the renderer of a template (recognising the
 * templates loom has built-in renderers for, chat_builtin.c), loading it
 * from a model directory, and rendering through the Jinja interpreter
 * (jinja_chat.c) with the built-in renderer's checks and mask beside it. */
#include "chat.h"

#include "chat_impl.h"
#include "jinja_chat.h"

#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------- */
/* Public: create, recognise, load, render                                 */
/* ---------------------------------------------------------------------- */

static const struct {
    const char *name;
    loom_chat_kind kind;
    int variant;
} NAMES[] = {
    {"qwen3", LOOM_CHAT_QWEN3, 0},          {"qwen2.5", LOOM_CHAT_QWEN2, V_QWEN25},
    {"qwen2", LOOM_CHAT_QWEN2, V_QWEN2},    {"llama3.1", LOOM_CHAT_LLAMA3, V_LLAMA31},
    {"llama3", LOOM_CHAT_LLAMA3, V_LLAMA30},
};

static loom_status chat_new(loom_ctx *ctx, loom_chat_kind kind, int variant, loom_chat **out) {
    *out = NULL;
    loom_chat *c = loom_calloc(ctx, 1, sizeof *c, "chat template");
    if (!c) return LOOM_ERR_OOM;
    c->kind = kind;
    c->variant = variant;
    c->enable_thinking = true;
    *out = c;
    return LOOM_OK;
}

loom_status loom_chat_create(loom_ctx *ctx, loom_chat_kind kind, loom_chat **out) {
    if (!out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_create: out is NULL");
    *out = NULL;
    if (kind != LOOM_CHAT_QWEN3 && kind != LOOM_CHAT_QWEN2 && kind != LOOM_CHAT_LLAMA3)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_create: unknown kind %d", (int)kind);
    return chat_new(ctx, kind, 0, out);
}

loom_status loom_chat_create_named(loom_ctx *ctx, const char *name, loom_chat **out) {
    if (!out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_create_named: out is NULL");
    *out = NULL;
    for (size_t i = 0; name && i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (strcmp(name, NAMES[i].name) == 0)
            return chat_new(ctx, NAMES[i].kind, NAMES[i].variant, out);
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                     "unknown chat template '%s' (loom renders qwen3, qwen2.5, qwen2, llama3.1, "
                     "llama3)", name ? name : "(null)");
}

void loom_chat_free(loom_chat *c) {
    if (!c)
        return;
    loom_jinja_free(c->tpl);
    free(c->bos);
    free(c->eos);
    free(c);
}
loom_chat_kind loom_chat_kind_of(const loom_chat *c) { return c->kind; }
void loom_chat_set_enable_thinking(loom_chat *c, bool enable) {
    c->enable_thinking = enable;
    c->thinking_set = true;
}

const char *loom_chat_name(const loom_chat *c) {
    if (c->kind == LOOM_CHAT_TEMPLATE)
        return "template";
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        if (NAMES[i].kind == c->kind && NAMES[i].variant == c->variant) return NAMES[i].name;
    return "?";
}

static bool has(const char *t, const char *s) { return strstr(t, s) != NULL; }

/* Each renderer is picked only when the text carries the pieces whose
 * behaviour it implements; templates of relatives (QwQ, Qwen3-2507, Qwen2.5-Math,
 * Llama 3.2 with today's date) miss one and are refused. */
static loom_status recognise(loom_ctx *ctx, const char *t, const char *what, loom_chat **out) {
    const char *why = "it matches none of them";
    if (has(t, "<|im_start|>") && has(t, "<think>") && has(t, "reasoning_content")) {
        if (has(t, "last_query_index") && has(t, "enable_thinking is false") &&
            has(t, "<think>\\n\\n</think>\\n\\n") && has(t, "rstrip('\\n').split('<think>')[-1]") &&
            has(t, "<tool_response>"))
            return chat_new(ctx, LOOM_CHAT_QWEN3, 0, out);
        why = "it looks like a Qwen3 relative (QwQ, Qwen3-2507 ...) whose <think> rules differ "
              "from Qwen3's";
    } else if (has(t, "<|im_start|>") && has(t, LOOM_QWEN25_SYSTEM)) {
        if (has(t, "message.tool_calls") && has(t, "<tool_response>") && !has(t, "<think>"))
            return chat_new(ctx, LOOM_CHAT_QWEN2, V_QWEN25, out);
        why = "it has Qwen2.5's system prompt but not its structure";
    } else if (has(t, "<|im_start|>") && has(t, LOOM_QWEN2_SYSTEM)) {
        if (has(t, "loop.first and messages[0]['role'] != 'system'") &&
            has(t, "'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
                   "'\\n'") &&
            !has(t, "tool") && !has(t, "<think>"))
            return chat_new(ctx, LOOM_CHAT_QWEN2, V_QWEN2, out);
        why = "it is a ChatML template with \"You are a helpful assistant.\" but not Qwen2's";
    } else if (has(t, "<|start_header_id|>") && has(t, "<|eot_id|>")) {
        const char *msg = "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
                          "message['content'] | trim + '<|eot_id|>'";
        if (has(t, "strftime_now"))
            why = "it looks like Llama 3.2's, which writes today's date into the system block";
        else if (has(t, "Cutting Knowledge Date: December 2023") && has(t, "26 Jul 2024") &&
                 has(t, msg) && has(t, "messages[0]['content']|trim"))
            return chat_new(ctx, LOOM_CHAT_LLAMA3, V_LLAMA31, out);
        else if (!has(t, "Cutting Knowledge Date") && has(t, msg) && has(t, "bos_token + content"))
            return chat_new(ctx, LOOM_CHAT_LLAMA3, V_LLAMA30, out);
        else
            why = "it uses Llama 3's header tokens but is neither the Llama 3.0 nor the 3.1 template";
    }
    return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                     "chat template of %s is not one loom renders (Qwen3, Qwen2/2.5 ChatML, "
                     "Llama 3): %s, and it has no {%% generation %%} marks to say which text is "
                     "the assistant's; add them around the assistant's turns, or render the "
                     "conversations to text yourself and train on plain text",
                     what, why);
}

/* Compiles the template (a construct the interpreter lacks is refused), then
 * recognises it; a template not recognised is taken when it has
 * {% generation %} marks. */
loom_status loom_chat_parse(loom_ctx *ctx, const char *t, const char *what, loom_chat **out) {
    if (!out)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_parse: out is NULL");
    *out = NULL;
    if (!t)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_parse: no template text");
    loom_jinja *tpl = NULL;
    loom_status st = loom_jinja_parse(ctx, t, strlen(t), what, &tpl);
    if (st)
        return loom_err_prefix(ctx, "chat template");
    bool marks = loom_jinja_has_generation(tpl);
    st = recognise(ctx, t, what, out);
    if (st == LOOM_ERR_UNSUPPORTED && marks)
        st = chat_new(ctx, LOOM_CHAT_TEMPLATE, 0, out);
    if (st) {
        loom_jinja_free(tpl);
        return st;
    }
    (*out)->tpl = tpl;
    (*out)->tpl_marks = marks;
    return LOOM_OK;
}

loom_status loom_chat_load(loom_ctx *ctx, const char *model_dir, loom_chat **out) {
    if (!out || !model_dir)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_load: NULL argument");
    *out = NULL;
    loom_status st = LOOM_OK;
    char *text = NULL;
    /* transformers: chat_template.jinja, when present, clobbers the config's. */
    char *jinja = loom_path_join(ctx, model_dir, "chat_template.jinja");
    if (!jinja) return LOOM_ERR_OOM;
    if (loom_file_exists(jinja)) {
        size_t len;
        st = loom_read_file(ctx, jinja, 0, &text, &len);
        if (!st && (strlen(text) != len || !loom_utf8_valid(text, len)))
            st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: not UTF-8 text", jinja);
    }
    free(jinja);
    if (st) {
        free(text);
        return st;
    }
    if (!text) {
        char *cfg = loom_path_join(ctx, model_dir, "tokenizer_config.json");
        if (!cfg) return LOOM_ERR_OOM;
        if (loom_file_exists(cfg)) {
            loom_json *j = NULL;
            if ((st = loom_json_parse_file(ctx, cfg, &j))) {
                free(cfg);
                return st;
            }
            const loom_json *tpl = loom_json_get(j, "chat_template");
            if (tpl && tpl->type == LOOM_JSON_ARRAY) {
                const loom_json *def = NULL;
                for (size_t i = 0; i < tpl->n; i++) {
                    const loom_json *nm = loom_json_get(tpl->items[i], "name");
                    if (nm && nm->type == LOOM_JSON_STRING && strcmp(nm->s, "default") == 0)
                        def = loom_json_get(tpl->items[i], "template");
                }
                if (!def)
                    st = loom_errf(ctx, LOOM_ERR_FORMAT,
                                   "%s: 'chat_template' is a list without a template named "
                                   "'default'", cfg);
                tpl = def;
            }
            if (!st && tpl && tpl->type != LOOM_JSON_NULL) {
                if (tpl->type != LOOM_JSON_STRING || strlen(tpl->s) != tpl->slen)
                    st = loom_errf(ctx, LOOM_ERR_FORMAT,
                                   "%s: 'chat_template' must be a string or a list of "
                                   "{\"name\", \"template\"}", cfg);
                else if (!(text = loom_strdup(ctx, tpl->s)))
                    st = LOOM_ERR_OOM;
            }
            loom_json_free(j);
        }
        free(cfg);
        if (st) return st;
    }
    if (!text)
        return loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                         "%s has no chat template (neither chat_template.jinja nor a "
                         "'chat_template' in tokenizer_config.json): it is a base model's "
                         "tokenizer, or the template lives elsewhere", model_dir);
    st = loom_chat_parse(ctx, text, model_dir, out);
    free(text);
    if (!st && (st = loom_jinja_chat_tokens(ctx, model_dir, &(*out)->bos, &(*out)->eos))) {
        loom_chat_free(*out);
        *out = NULL;
    }
    return st;
}

loom_status loom_chat_check_tools(loom_ctx *ctx, const loom_json *tools) {
    if (!tools || tools->type == LOOM_JSON_NULL)
        return LOOM_OK;
    if (tools->type != LOOM_JSON_ARRAY)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "tools must be a JSON array of tool objects (JSON schemas, as "
                         "transformers' apply_chat_template(tools=...) takes), got %s",
                         loom_json_type_name(tools->type));
    for (size_t i = 0; i < tools->n; i++)
        if (tools->items[i]->type != LOOM_JSON_OBJECT)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "tools[%zu] must be an object (a tool's JSON schema, such as "
                             "{\"type\": \"function\", \"function\": {...}}), got %s",
                             i, loom_json_type_name(tools->items[i]->type));
    return LOOM_OK;
}

/* The template's own text through the interpreter; a recognised template
 * goes through its built-in renderer too (the messages' checks, and the mask
 * when the template has no {% generation %} marks), whose text must agree. */
loom_status loom_chat_render(loom_ctx *ctx, const loom_chat *c, const loom_json *messages,
                             const loom_json *tools, bool add_generation_prompt, char **text,
                             uint8_t **mask) {
    if (!c || !text)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_render: NULL argument");
    *text = NULL;
    if (mask)
        *mask = NULL;
    loom_status st = loom_chat_check_tools(ctx, tools);
    if (st)
        return st;
    if (tools && tools->type == LOOM_JSON_NULL)
        tools = NULL; /* None, as without tools= */
    if (!c->tpl)
        return loom_chat_render_builtin(ctx, c, messages, tools, add_generation_prompt, text, mask);
    char *btext = NULL;
    uint8_t *bmask = NULL;
    if (c->kind != LOOM_CHAT_TEMPLATE) {
        st = loom_chat_render_builtin(ctx, c, messages, tools, add_generation_prompt, &btext,
                                      &bmask);
        if (st)
            return st;
    } else if (!messages || messages->type != LOOM_JSON_ARRAY || !messages->n) {
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "messages must be a non-empty JSON array of {\"role\", \"content\"} "
                         "objects");
    }
    const char *bos = c->bos ? c->bos : c->kind == LOOM_CHAT_LLAMA3 ? "<|begin_of_text|>" : NULL;
    loom_jinja_chat_opts o = {add_generation_prompt, c->thinking_set ? c->enable_thinking : -1, bos,
                              c->eos, tools};
    uint8_t *jmask = NULL;
    st = loom_jinja_chat_render(ctx, c->tpl, messages, &o, text, &jmask);
    if (!st && btext && strcmp(btext, *text) != 0) {
        size_t d = 0;
        while (btext[d] && btext[d] == (*text)[d])
            d++;
        st = loom_errf(ctx, LOOM_ERR_INTERNAL,
                       "the %s template's text from the Jinja interpreter differs from loom's "
                       "built-in renderer at byte %zu: a bug, please report it",
                       loom_chat_name(c), d);
    }
    if (!st && mask) {
        bool marks = c->tpl_marks || !bmask;
        *mask = marks ? jmask : bmask;
        if (marks)
            jmask = NULL;
        else
            bmask = NULL;
    }
    if (st) {
        free(*text);
        *text = NULL;
    }
    free(btext);
    free(bmask);
    free(jmask);
    return st;
}
