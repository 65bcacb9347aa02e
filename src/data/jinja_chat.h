/* The Jinja interpreter as chat.c uses it (jinja_chat.c). */
#ifndef LOOM_JINJA_CHAT_H
#define LOOM_JINJA_CHAT_H

#include "jinja.h"

/* Whether the template has a {% generation %} block (then its spans are the
 * assistant mask). */
bool loom_jinja_has_generation(const loom_jinja *t);

typedef struct loom_jinja_chat_opts {
    bool add_generation_prompt;
    int enable_thinking;               /* -1: not passed (transformers' default), else 0/1 */
    const char *bos_token, *eos_token; /* NULL: not passed */
    const loom_json *tools;            /* tools=: NULL passes None */
} loom_jinja_chat_opts;

/* Renders a conversation with the variables apply_chat_template passes
 * (messages, tools (None when o->tools is NULL), documents=None,
 * add_generation_prompt, the special tokens, enable_thinking when set).
 * *mask: 1 on the bytes inside {% generation %} blocks (may be NULL). *text
 * and *mask are malloc'd. */
loom_status loom_jinja_chat_render(loom_ctx *ctx, const loom_jinja *t, const loom_json *messages,
                                   const loom_jinja_chat_opts *o, char **text, uint8_t **mask);

/* bos_token and eos_token of model_dir/tokenizer_config.json (NULL when
 * absent; no file: both NULL). */
loom_status loom_jinja_chat_tokens(loom_ctx *ctx, const char *model_dir, char **bos, char **eos);

#endif /* LOOM_JINJA_CHAT_H */
