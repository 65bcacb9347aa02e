/* A small interpreter of the Jinja subset that chat templates use, with the
 * semantics transformers' apply_chat_template gives them: jinja2's sandboxed
 * environment with trim_blocks and lstrip_blocks, the loopcontrols extension
 * (break, continue), the {% generation %} ... {% endgeneration %} block
 * (its output's byte ranges come back with the text), and the globals
 * raise_exception(msg), strftime_now(format) and the tojson filter as
 * transformers defines them (json.dumps: ensure_ascii=False, keys in
 * insertion order, and its indent, separators, sort_keys, ensure_ascii).
 *
 * Values follow Python where jinja2 hands the work to Python: truthiness,
 * str() of numbers, lists and dicts, string slicing by code point, negative
 * indices, and jinja2's default Undefined (renders empty, is falsy, errors
 * on attribute access and arithmetic).
 *
 * A construct the interpreter does not implement (a statement such as
 * {% include %}, a filter, test, function or method it lacks) is refused
 * when the template is parsed, with the construct, line and column named. */
#ifndef LOOM_JINJA_H
#define LOOM_JINJA_H

#include "../core/json.h"

typedef struct loom_jinja loom_jinja;

/* One {% generation %} block's output: text[start, end) in bytes. */
typedef struct loom_jinja_span {
    size_t start, end;
} loom_jinja_span;

/* Parses src[0..len); `what` names the template in errors ("<what>:<line>:<col>: ..."). */
loom_status loom_jinja_parse(loom_ctx *ctx, const char *src, size_t len, const char *what,
                             loom_jinja **out);
void loom_jinja_free(loom_jinja *t);

/* Renders with the context variables `vars` (a JSON object: messages, tools,
 * add_generation_prompt, bos_token, ... as transformers passes them; NULL for
 * none). *text (NUL-terminated, *len bytes) and *spans (*nspans entries, in
 * order; NULL when none) are malloc'd. spans may be NULL when not wanted. */
loom_status loom_jinja_render(loom_ctx *ctx, const loom_jinja *t, const loom_json *vars,
                              char **text, size_t *len, loom_jinja_span **spans, size_t *nspans);

#endif /* LOOM_JINJA_H */
