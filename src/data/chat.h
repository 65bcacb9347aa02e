/* Chat templates. A template loaded from a model directory (or given as
 * text) is rendered by loom's Jinja interpreter (jinja.h) as transformers'
 * apply_chat_template renders it; a template that uses a construct the
 * interpreter lacks is refused, naming it. The assistant mask is the
 * template's {% generation %} spans.
 *
 * loom also has built-in renderers for Qwen3 (ChatML with the <think> rules
 * of its template), Qwen2/Qwen2.5 ChatML and Llama 3, recognised from the
 * template text. They render when there is no template text
 * (loom_chat_create*); for a loaded template they check the messages (errors
 * naming the message index), give the mask where the template has no
 * {% generation %} marks (the hub's Qwen2/2.5, Llama 3 and Qwen3 templates
 * have none: the built-ins' rule below), and their text must equal the
 * interpreter's. A template loom does not recognise needs {% generation %}
 * marks (else it is refused, never guessed).
 *
 * The text is the model directory's chat_template.jinja (which wins, as in
 * transformers), else tokenizer_config.json's chat_template (a string, or
 * the list entry named "default"); the config's bos_token and eos_token are
 * passed to the template. Tools (HF's `tools=` argument: a list of JSON
 * schemas) are passed to the template as `tools`; the built-in Qwen3 and
 * Qwen2.5 renderers write them as those templates do, the Qwen2 and Llama 3
 * ones refuse them (Qwen2's template has no tools and would drop them; loom's
 * Llama 3 renderer does not do tool use). Tool calls and tool messages inside
 * the conversation are rendered. */
#ifndef LOOM_CHAT_H
#define LOOM_CHAT_H

#include "../core/json.h"
#include "tokenizer.h"

typedef enum loom_chat_kind {
    LOOM_CHAT_QWEN3 = 0,
    LOOM_CHAT_QWEN2, /* Qwen2 / Qwen2.5 ChatML (default system prompt rules of the template) */
    LOOM_CHAT_LLAMA3,
    LOOM_CHAT_TEMPLATE, /* any other template that marks the assistant's text with
                         * {% generation %}: the Jinja interpreter renders it */
} loom_chat_kind;

typedef struct loom_chat loom_chat;

/* Picks the renderer for a model directory (see above). */
loom_status loom_chat_load(loom_ctx *ctx, const char *model_dir, loom_chat **out);
loom_status loom_chat_create(loom_ctx *ctx, loom_chat_kind kind, loom_chat **out);
void loom_chat_free(loom_chat *c);
loom_chat_kind loom_chat_kind_of(const loom_chat *c);

/* Recognises a template text (the Jinja source); `what` names it in errors.
 * What loom_chat_load does once it has found the text. */
loom_status loom_chat_parse(loom_ctx *ctx, const char *template_text, const char *what,
                            loom_chat **out);
/* By name: "qwen3", "qwen2.5", "qwen2" (Qwen2 / Qwen1.5: default system
 * prompt "You are a helpful assistant."), "llama3.1", "llama3" (3.0: no
 * system block). loom_chat_create picks qwen3, qwen2.5 and llama3.1. */
loom_status loom_chat_create_named(loom_ctx *ctx, const char *name, loom_chat **out);
/* The renderer's name as above ("qwen2.5", ...). */
const char *loom_chat_name(const loom_chat *c);
/* Qwen3's enable_thinking (default true, as when HF is not given it): when
 * false, add_generation_prompt also writes the empty think block. */
void loom_chat_set_enable_thinking(loom_chat *c, bool enable);

/* tools= as loom takes it: NULL, a JSON null (no tools) or an array of
 * objects (each a tool's JSON schema, passed as it is). Anything else is
 * LOOM_ERR_INVALID_ARG naming what is wrong ("tools[1] must be an object
 * ..."). */
loom_status loom_chat_check_tools(loom_ctx *ctx, const loom_json *tools);

/* Renders a conversation (`messages`: a JSON array of {"role", "content"}
 * objects; roles system, user, assistant, and tool where the template has
 * it; `tools`: as loom_chat_check_tools takes, HF's tools=) to text, and a
 * per-byte mask of the text that is assistant output (the template's
 * {% generation %} spans: what HF's assistant-token mask covers).
 * add_generation_prompt as in HF. Unknown roles, a missing or non-string
 * content, an empty conversation: errors naming the message index. *text and
 * *mask (strlen(*text) bytes, 0/1) are malloc'd. */
loom_status loom_chat_render(loom_ctx *ctx, const loom_chat *c, const loom_json *messages,
                             const loom_json *tools, bool add_generation_prompt, char **text,
                             uint8_t **mask);

/* Renders (no generation prompt) and tokenizes with loom_tokenizer_encode
 * (no post-processor tokens: the template writes its own): ids and the
 * assistant mask per token, as HF's return_assistant_tokens_mask computes
 * it: every token from the one holding a span's first character to the one
 * holding its last (the tokens overlapping the span). mask may be NULL. */
loom_status loom_chat_encode(loom_ctx *ctx, const loom_chat *c, const loom_tokenizer *t,
                             const loom_json *messages, const loom_json *tools, int32_t **ids,
                             uint8_t **mask, int64_t *n);

#endif /* LOOM_CHAT_H */
