/* What chat.c (loading, recognising, rendering through the interpreter) and
 * chat_builtin.c (the built-in renderers) share: the chat object itself. */
#ifndef LOOM_CHAT_IMPL_H
#define LOOM_CHAT_IMPL_H

#include "chat.h"
#include "jinja.h"

struct loom_chat {
    loom_chat_kind kind;
    int variant; /* QWEN2: 0 Qwen2.5, 1 Qwen2; LLAMA3: 0 Llama 3.1, 1 Llama 3.0 */
    bool enable_thinking, thinking_set;
    loom_jinja *tpl; /* the template's text, compiled (NULL: built-in only) */
    bool tpl_marks;  /* it has {% generation %}: its spans are the mask */
    char *bos, *eos; /* tokenizer_config.json's special tokens (NULL: none) */
};

enum { V_QWEN25 = 0, V_QWEN2 = 1, V_LLAMA31 = 0, V_LLAMA30 = 1 };

/* The default system prompts of the Qwen2.5 and Qwen2 templates (written by
 * the renderers, looked for when recognising a template). */
#define LOOM_QWEN25_SYSTEM "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
#define LOOM_QWEN2_SYSTEM "You are a helpful assistant."

/* The built-in renderer of c's kind and variant (chat_builtin.c): the
 * messages' checks (errors naming the message index), the text and its
 * per-byte assistant mask (may be NULL), both malloc'd. tools: NULL, or an
 * array of objects (loom_chat_check_tools has passed it). */
loom_status loom_chat_render_builtin(loom_ctx *ctx, const loom_chat *c, const loom_json *messages,
                                     const loom_json *tools, bool add_generation_prompt,
                                     char **text, uint8_t **mask);

#endif /* LOOM_CHAT_IMPL_H */
