/* The built-in chat renderers of the templates loom recognises (chat.c),
 * written from the Jinja sources so that the text is what transformers'
 * apply_chat_template produces byte for byte (HF runs Jinja with
 * trim_blocks and lstrip_blocks; the whitespace rules below follow from
 * that), plus the per-byte assistant mask ({% generation %} spans; the
 * per-token mask HF derives from it is chat_encode.c's).
 *
 * Which bytes are "assistant output":
 *   Qwen3 (the template carries {% generation %}): after
 *     "<|im_start|>assistant\n", everything up to and including
 *     "<|im_end|>\n" (think block, content, tool calls).
 *   Qwen2 / Qwen2.5 (no generation marks in the hub templates): the same
 *     span, so the three ChatML renderers agree.
 *   Llama 3: the trimmed content and "<|eot_id|>" (the header
 *     "<|start_header_id|>assistant<|end_header_id|>\n\n" is prompt). */
#include "chat_impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------- */
/* Strings as Python sees them (slices of UTF-8)                           */
/* ---------------------------------------------------------------------- */

typedef struct str {
    const char *p;
    size_t n;
} str;

static str S(const char *s) { return (str){s, strlen(s)}; }

static bool starts_with(str s, const char *pre) {
    size_t k = strlen(pre);
    return s.n >= k && memcmp(s.p, pre, k) == 0;
}
static bool ends_with(str s, const char *suf) {
    size_t k = strlen(suf);
    return s.n >= k && memcmp(s.p + s.n - k, suf, k) == 0;
}
/* First / last occurrence of needle in s, or -1. */
static ptrdiff_t find_first(str s, const char *needle) {
    size_t k = strlen(needle);
    if (k > s.n) return -1;
    for (size_t i = 0; i + k <= s.n; i++)
        if (memcmp(s.p + i, needle, k) == 0) return (ptrdiff_t)i;
    return -1;
}
static ptrdiff_t find_last(str s, const char *needle) {
    size_t k = strlen(needle);
    if (k > s.n) return -1;
    for (size_t i = s.n - k + 1; i-- > 0;)
        if (memcmp(s.p + i, needle, k) == 0) return (ptrdiff_t)i;
    return -1;
}
static str lstrip_nl(str s) {
    while (s.n && s.p[0] == '\n') s.p++, s.n--;
    return s;
}
static str rstrip_nl(str s) {
    while (s.n && s.p[s.n - 1] == '\n') s.n--;
    return s;
}
static str strip_nl(str s) { return rstrip_nl(lstrip_nl(s)); }

/* Python's str.isspace() code points (what Jinja's trim strips). */
static bool py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}
/* Decodes the (valid) UTF-8 sequence at p; returns its length. */
static size_t utf8_at(const char *p, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)p;
    if (u[0] < 0x80) return *cp = u[0], 1;
    if (u[0] < 0xe0) return *cp = (uint32_t)(u[0] & 0x1f) << 6 | (u[1] & 0x3f), 2;
    if (u[0] < 0xf0)
        return *cp = (uint32_t)(u[0] & 0x0f) << 12 | (uint32_t)(u[1] & 0x3f) << 6 | (u[2] & 0x3f), 3;
    *cp = (uint32_t)(u[0] & 0x07) << 18 | (uint32_t)(u[1] & 0x3f) << 12 |
          (uint32_t)(u[2] & 0x3f) << 6 | (u[3] & 0x3f);
    return 4;
}
/* Jinja's |trim: Python's str.strip() (Unicode whitespace). s is valid UTF-8. */
static str py_trim(str s) {
    while (s.n) {
        uint32_t c;
        size_t k = utf8_at(s.p, &c);
        if (!py_space(c)) break;
        s.p += k, s.n -= k;
    }
    while (s.n) {
        size_t b = s.n - 1;
        while (b > 0 && ((unsigned char)s.p[b] & 0xc0) == 0x80) b--;
        uint32_t c;
        utf8_at(s.p + b, &c);
        if (!py_space(c)) break;
        s.n = b;
    }
    return s;
}

/* ---------------------------------------------------------------------- */
/* Output: text and its per-byte mask                                      */
/* ---------------------------------------------------------------------- */

typedef struct rout {
    loom_sb text, mask;
} rout;

static void emit(rout *o, str s, uint8_t m) {
    static const char ones[64] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                  1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                  1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const char zeros[64] = {0};
    loom_sb_append(&o->text, s.p, s.n);
    for (size_t i = 0; i < s.n; i += 64) {
        size_t k = s.n - i < 64 ? s.n - i : 64;
        loom_sb_append(&o->mask, m ? ones : zeros, k);
    }
}
static void emits(rout *o, const char *s, uint8_t m) { emit(o, S(s), m); }

/* ---------------------------------------------------------------------- */
/* Python's json.dumps (HF's tojson filter: ensure_ascii=False, separators  */
/* ", " and ": ", keys in their order)                                     */
/* ---------------------------------------------------------------------- */

static void py_json_string(loom_sb *sb, const char *s, size_t n) {
    loom_sb_putc(sb, '"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': loom_sb_puts(sb, "\\\""); break;
        case '\\': loom_sb_puts(sb, "\\\\"); break;
        case '\n': loom_sb_puts(sb, "\\n"); break;
        case '\r': loom_sb_puts(sb, "\\r"); break;
        case '\t': loom_sb_puts(sb, "\\t"); break;
        case '\b': loom_sb_puts(sb, "\\b"); break;
        case '\f': loom_sb_puts(sb, "\\f"); break;
        default:
            if (c < 0x20) loom_sb_printf(sb, "\\u%04x", c);
            else loom_sb_putc(sb, (char)c);
        }
    }
    loom_sb_putc(sb, '"');
}

/* float.__repr__: the shortest digits that read back, in fixed notation when
 * the decimal exponent is in [-4, 16), else d[.ddd]e+XX. */
static void py_float(loom_sb *sb, double d) {
    if (d == 0) {
        loom_sb_puts(sb, signbit(d) ? "-0.0" : "0.0");
        return;
    }
    char buf[48];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, d);
        if (strtod(buf, NULL) == d) break;
    }
    const char *p = buf;
    if (*p == '-') loom_sb_putc(sb, '-'), p++;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    int exp10 = atoi(p + 1), decpt = exp10 + 1;
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            loom_sb_puts(sb, "0.");
            for (int i = 0; i < -decpt; i++) loom_sb_putc(sb, '0');
            loom_sb_append(sb, digits, (size_t)nd);
        } else if (decpt >= nd) {
            loom_sb_append(sb, digits, (size_t)nd);
            for (int i = nd; i < decpt; i++) loom_sb_putc(sb, '0');
            loom_sb_puts(sb, ".0");
        } else {
            loom_sb_append(sb, digits, (size_t)decpt);
            loom_sb_putc(sb, '.');
            loom_sb_append(sb, digits + decpt, (size_t)(nd - decpt));
        }
    } else {
        loom_sb_putc(sb, digits[0]);
        if (nd > 1) {
            loom_sb_putc(sb, '.');
            loom_sb_append(sb, digits + 1, (size_t)(nd - 1));
        }
        loom_sb_printf(sb, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
}

static loom_status py_json(loom_ctx *ctx, loom_sb *sb, const loom_json *v, const char *what) {
    switch (v->type) {
    case LOOM_JSON_NULL: loom_sb_puts(sb, "null"); return LOOM_OK;
    case LOOM_JSON_BOOL: loom_sb_puts(sb, v->b ? "true" : "false"); return LOOM_OK;
    case LOOM_JSON_NUMBER:
        if (v->is_int) {
            loom_sb_printf(sb, "%lld", (long long)v->i);
        } else if (!isfinite(v->d) || (fabs(v->d) >= 9.2e18 && v->d == floor(v->d))) {
            /* An integer literal past int64 reads as a Python int (printed
             * exactly), a float literal as a float: the DOM cannot tell. */
            return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                             "%s: number %g is too large to write as Python's json.dumps would "
                             "(write it as a string)", what, v->d);
        } else {
            py_float(sb, v->d);
        }
        return LOOM_OK;
    case LOOM_JSON_STRING:
        if (!loom_utf8_valid(v->s, v->slen))
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: a string is not valid UTF-8", what);
        py_json_string(sb, v->s, v->slen);
        return LOOM_OK;
    case LOOM_JSON_ARRAY:
        loom_sb_putc(sb, '[');
        for (size_t i = 0; i < v->n; i++) {
            if (i) loom_sb_puts(sb, ", ");
            loom_status st = py_json(ctx, sb, v->items[i], what);
            if (st) return st;
        }
        loom_sb_putc(sb, ']');
        return LOOM_OK;
    case LOOM_JSON_OBJECT:
        loom_sb_putc(sb, '{');
        for (size_t i = 0; i < v->n; i++) {
            if (i) loom_sb_puts(sb, ", ");
            py_json_string(sb, v->keys[i], strlen(v->keys[i]));
            loom_sb_puts(sb, ": ");
            loom_status st = py_json(ctx, sb, v->items[i], what);
            if (st) return st;
        }
        loom_sb_putc(sb, '}');
        return LOOM_OK;
    }
    return loom_errf(ctx, LOOM_ERR_INTERNAL, "%s: bad JSON type", what);
}

/* ---------------------------------------------------------------------- */
/* Reading messages                                                        */
/* ---------------------------------------------------------------------- */

/* Jinja truthiness of a JSON value (absent = undefined = false). */
static bool truthy(const loom_json *v) {
    if (!v) return false;
    switch (v->type) {
    case LOOM_JSON_NULL: return false;
    case LOOM_JSON_BOOL: return v->b;
    case LOOM_JSON_NUMBER: return v->d != 0;
    case LOOM_JSON_STRING: return v->slen > 0;
    case LOOM_JSON_ARRAY:
    case LOOM_JSON_OBJECT: return v->n > 0;
    }
    return false;
}

/* A string field used as text: valid UTF-8 and no NUL (the text is a C string). */
static loom_status check_text(loom_ctx *ctx, const loom_json *v, size_t i, const char *key) {
    if (!loom_utf8_valid(v->s, v->slen))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "messages[%zu]: '%s' is not valid UTF-8", i,
                         key);
    if (strlen(v->s) != v->slen)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "messages[%zu]: '%s' holds a NUL character (U+0000), which loom's "
                         "rendered text cannot carry", i, key);
    return LOOM_OK;
}

/* msg[key] as text. Absent or null: *out = "" when optional, else an error.
 * Any other non-string: an error. */
static loom_status get_text(loom_ctx *ctx, const loom_json *msg, size_t i, const char *key,
                            bool optional, str *out) {
    const loom_json *v = loom_json_get(msg, key);
    *out = S("");
    if (!v || v->type == LOOM_JSON_NULL) {
        if (optional) return LOOM_OK;
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "messages[%zu] (role '%s'): no '%s'%s", i,
                         loom_json_get(msg, "role")->s, key,
                         strcmp(key, "content") == 0 ? " (every message needs a string content)"
                                                      : "");
    }
    if (v->type != LOOM_JSON_STRING)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "messages[%zu] (role '%s'): '%s' must be a string, got %s", i,
                         loom_json_get(msg, "role")->s, key, loom_json_type_name(v->type));
    loom_status st = check_text(ctx, v, i, key);
    if (st) return st;
    *out = (str){v->s, v->slen};
    return LOOM_OK;
}

/* The common checks: an array of objects with a string role among `roles`
 * (NULL-terminated). */
static loom_status check_messages(loom_ctx *ctx, const loom_chat *c, const loom_json *messages,
                                  const char *const *roles) {
    if (!messages || messages->type != LOOM_JSON_ARRAY)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "messages must be a JSON array of {\"role\", \"content\"} objects, got %s",
                         messages ? loom_json_type_name(messages->type) : "nothing");
    if (messages->n == 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "empty conversation: messages has no message to render");
    for (size_t i = 0; i < messages->n; i++) {
        const loom_json *m = messages->items[i];
        if (m->type != LOOM_JSON_OBJECT)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "messages[%zu] must be an object {\"role\", \"content\"}, got %s", i,
                             loom_json_type_name(m->type));
        const loom_json *r = loom_json_get(m, "role");
        if (!r || r->type != LOOM_JSON_STRING)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "messages[%zu]: %s", i,
                             r ? "'role' must be a string" : "no 'role'");
        bool known = false;
        for (const char *const *k = roles; *k; k++) known |= strcmp(r->s, *k) == 0;
        if (!known) {
            char list[128] = "";
            for (const char *const *k = roles; *k; k++) {
                if (k != roles) strncat(list, k[1] ? ", " : " and ", sizeof list - strlen(list) - 1);
                strncat(list, *k, sizeof list - strlen(list) - 1);
            }
            bool ok = loom_utf8_valid(r->s, r->slen) && strlen(r->s) == r->slen;
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "messages[%zu]: unknown role '%s': the %s template has roles %s", i,
                             ok ? r->s : "(not valid text)", loom_chat_name(c), list);
        }
    }
    return LOOM_OK;
}

static const char *role_of(const loom_json *messages, size_t i) {
    return loom_json_get(messages->items[i], "role")->s;
}
static bool role_is(const loom_json *messages, size_t i, const char *role) {
    return strcmp(role_of(messages, i), role) == 0;
}

/* One tool call of an assistant message, as the Qwen templates write it:
 * '<tool_call>\n{"name": "' name '", "arguments": ' args '}\n</tool_call>'.
 * function_if_truthy: Qwen3 takes tool_call.function when it is truthy,
 * Qwen2.5 when it is defined. args_raw_string: Qwen3 writes a string
 * arguments as is, Qwen2.5 always through tojson. */
static loom_status tool_call_text(loom_ctx *ctx, const loom_json *call, size_t i, size_t k,
                                  bool function_if_truthy, bool args_raw_string, loom_sb *sb) {
    char what[96];
    snprintf(what, sizeof what, "messages[%zu].tool_calls[%zu]", i, k);
    if (call->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s must be an object, got %s", what,
                         loom_json_type_name(call->type));
    const loom_json *fn = loom_json_get(call, "function");
    if (function_if_truthy ? truthy(fn) : fn != NULL) {
        if (fn->type != LOOM_JSON_OBJECT)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: 'function' must be an object, got %s",
                             what, loom_json_type_name(fn->type));
        call = fn;
        snprintf(what, sizeof what, "messages[%zu].tool_calls[%zu].function", i, k);
    }
    const loom_json *name = loom_json_get(call, "name"), *args = loom_json_get(call, "arguments");
    if (!name || name->type != LOOM_JSON_STRING)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: %s", what,
                         name ? "'name' must be a string" : "no 'name'");
    if (!loom_utf8_valid(name->s, name->slen) || strlen(name->s) != name->slen)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: 'name' is not valid text", what);
    if (!args) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: no 'arguments'", what);
    loom_sb_puts(sb, "<tool_call>\n{\"name\": \"");
    loom_sb_append(sb, name->s, name->slen);
    loom_sb_puts(sb, "\", \"arguments\": ");
    if (args_raw_string && args->type == LOOM_JSON_STRING) {
        if (!loom_utf8_valid(args->s, args->slen) || strlen(args->s) != args->slen)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: 'arguments' is not valid text", what);
        loom_sb_append(sb, args->s, args->slen);
    } else {
        loom_status st = py_json(ctx, sb, args, what);
        if (st) return st;
    }
    loom_sb_puts(sb, "}\n</tool_call>");
    return LOOM_OK;
}

/* tool_calls of message i: NULL when absent or null, else an array. */
static loom_status get_tool_calls(loom_ctx *ctx, const loom_json *m, size_t i,
                                  const loom_json **out) {
    const loom_json *tc = loom_json_get(m, "tool_calls");
    *out = NULL;
    if (!tc || tc->type == LOOM_JSON_NULL) return LOOM_OK;
    if (tc->type != LOOM_JSON_ARRAY)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "messages[%zu]: 'tool_calls' must be an array, got %s", i,
                         loom_json_type_name(tc->type));
    *out = tc;
    return LOOM_OK;
}

/* The tools of the Qwen3 and Qwen2.5 system message, from "# Tools" through
 * its "<|im_end|>\n": each tool through tojson on a line of its own. */
static loom_status emit_tools(loom_ctx *ctx, rout *o, const loom_json *tools) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_puts(&sb, "# Tools\n\nYou may call one or more functions to assist with the user "
                      "query.\n\nYou are provided with function signatures within "
                      "<tools></tools> XML tags:\n<tools>");
    loom_status st = LOOM_OK;
    for (size_t i = 0; i < tools->n && !st; i++) {
        char what[32];
        snprintf(what, sizeof what, "tools[%zu]", i);
        loom_sb_putc(&sb, '\n');
        st = py_json(ctx, &sb, tools->items[i], what);
    }
    loom_sb_puts(&sb, "\n</tools>\n\nFor each function call, return a json object with function "
                      "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                      "{\"name\": <function-name>, \"arguments\": "
                      "<args-json-object>}\n</tool_call><|im_end|>\n");
    if (!st)
        emit(o, (str){sb.buf, sb.len}, 0);
    loom_sb_free(&sb);
    return st;
}

/* ---------------------------------------------------------------------- */
/* Qwen3                                                                   */
/* ---------------------------------------------------------------------- */

static loom_status render_qwen3(loom_ctx *ctx, const loom_chat *c, const loom_json *msgs,
                                const loom_json *tools, bool add_generation_prompt, rout *o) {
    static const char *const roles[] = {"system", "user", "assistant", "tool", NULL};
    loom_status st = check_messages(ctx, c, msgs, roles);
    if (st) return st;
    size_t n = msgs->n;

    /* Every message's content first (so errors come before any work). */
    str *content = calloc(n, sizeof *content);
    if (!content) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory rendering a chat");
    for (size_t i = 0; i < n && !st; i++) {
        const loom_json *m = msgs->items[i], *tc = NULL;
        bool asst = role_is(msgs, i, "assistant");
        if (asst) st = get_tool_calls(ctx, m, i, &tc);
        /* The template renders a non-string content as ''; loom asks for a
         * string except where a tool call stands in for it. */
        if (!st) st = get_text(ctx, m, i, "content", asst && tc && tc->n > 0, &content[i]);
    }
    if (st) {
        free(content);
        return st;
    }

    /* The system message first, the tools in it when there are some. */
    if (tools && tools->n) {
        emits(o, "<|im_start|>system\n", 0);
        if (role_is(msgs, 0, "system")) {
            emit(o, content[0], 0);
            emits(o, "\n\n", 0);
        }
        if ((st = emit_tools(ctx, o, tools))) {
            free(content);
            return st;
        }
    } else if (role_is(msgs, 0, "system")) {
        emits(o, "<|im_start|>system\n", 0);
        emit(o, content[0], 0);
        emits(o, "<|im_end|>\n", 0);
    }
    /* The last user query: the last user message that is not a wrapped tool
     * response (multi-step tool logic); none: the last message. */
    size_t last_query = n - 1;
    for (size_t i = n; i-- > 0;) {
        if (role_is(msgs, i, "user") &&
            !(starts_with(content[i], "<tool_response>") && ends_with(content[i], "</tool_response>"))) {
            last_query = i;
            break;
        }
    }
    loom_sb gen;
    loom_sb_init(&gen);
    for (size_t i = 0; i < n && !st; i++) {
        const loom_json *m = msgs->items[i];
        const char *role = role_of(msgs, i);
        str text = content[i];
        if (strcmp(role, "user") == 0 || (strcmp(role, "system") == 0 && i > 0)) {
            emits(o, "<|im_start|>", 0);
            emits(o, role, 0);
            emits(o, "\n", 0);
            emit(o, text, 0);
            emits(o, "<|im_end|>\n", 0);
        } else if (strcmp(role, "assistant") == 0) {
            str reasoning = S("");
            const loom_json *rc = loom_json_get(m, "reasoning_content");
            if (rc && rc->type != LOOM_JSON_NULL) {
                if ((st = get_text(ctx, m, i, "reasoning_content", false, &reasoning))) break;
            } else if (find_first(text, "</think>") >= 0) {
                /* content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
                str before = {text.p, (size_t)find_first(text, "</think>")};
                before = rstrip_nl(before);
                ptrdiff_t open = find_last(before, "<think>");
                if (open >= 0) before = (str){before.p + open + 7, before.n - (size_t)open - 7};
                reasoning = lstrip_nl(before);
                /* content.split('</think>')[-1].lstrip('\n') */
                size_t after = (size_t)find_last(text, "</think>") + 8;
                text = lstrip_nl((str){text.p + after, text.n - after});
            }
            gen.len = 0;
            if (gen.buf) gen.buf[0] = '\0';
            if (i > last_query && (i == n - 1 || reasoning.n > 0)) {
                loom_sb_puts(&gen, "<think>\n");
                str r = strip_nl(reasoning);
                loom_sb_append(&gen, r.p, r.n);
                loom_sb_puts(&gen, "\n</think>\n\n");
                str t = lstrip_nl(text);
                loom_sb_append(&gen, t.p, t.n);
            } else {
                loom_sb_append(&gen, text.p, text.n);
            }
            const loom_json *tc = NULL;
            if ((st = get_tool_calls(ctx, m, i, &tc))) break;
            for (size_t k = 0; tc && k < tc->n && !st; k++) {
                if ((k == 0 && text.n > 0) || k > 0) loom_sb_putc(&gen, '\n');
                st = tool_call_text(ctx, tc->items[k], i, k, true, true, &gen);
            }
            if (st) break;
            loom_sb_puts(&gen, "<|im_end|>\n");
            emits(o, "<|im_start|>assistant\n", 0);
            emit(o, (str){gen.buf, gen.len}, 1);
        } else if (strcmp(role, "tool") == 0) {
            if (i == 0 || !role_is(msgs, i - 1, "tool")) emits(o, "<|im_start|>user", 0);
            emits(o, "\n<tool_response>\n", 0);
            emit(o, text, 0);
            emits(o, "\n</tool_response>", 0);
            if (i == n - 1 || !role_is(msgs, i + 1, "tool")) emits(o, "<|im_end|>\n", 0);
        }
    }
    loom_sb_free(&gen);
    free(content);
    if (st) return st;
    if (add_generation_prompt) {
        emits(o, "<|im_start|>assistant\n", 0);
        if (!c->enable_thinking) emits(o, "<think>\n\n</think>\n\n", 0);
    }
    return LOOM_OK;
}

/* ---------------------------------------------------------------------- */
/* Qwen2.5 and Qwen2 ChatML                                                */
/* ---------------------------------------------------------------------- */

/* Qwen2 (and Qwen1.5): every message '<|im_start|>' role '\n' content
 * '<|im_end|>\n', after a default system message when the first is not one. */
static loom_status render_qwen2(loom_ctx *ctx, const loom_chat *c, const loom_json *msgs,
                                const loom_json *tools, bool add_generation_prompt, rout *o) {
    static const char *const roles[] = {"system", "user", "assistant", "tool", NULL};
    if (tools && tools->n)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "tools: the qwen2 template has no tools (it would drop the %zu given); "
                         "put them in the system message's text instead",
                         tools->n);
    loom_status st = check_messages(ctx, c, msgs, roles);
    if (st) return st;
    for (size_t i = 0; i < msgs->n; i++) {
        str text;
        if ((st = get_text(ctx, msgs->items[i], i, "content", false, &text))) return st;
        if (loom_json_get(msgs->items[i], "tool_calls"))
            return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                             "messages[%zu]: the qwen2 template has no tool calls (it would drop "
                             "'tool_calls')", i);
    }
    if (!role_is(msgs, 0, "system")) {
        emits(o, "<|im_start|>system\n", 0);
        emits(o, LOOM_QWEN2_SYSTEM, 0);
        emits(o, "<|im_end|>\n", 0);
    }
    for (size_t i = 0; i < msgs->n; i++) {
        str text;
        get_text(ctx, msgs->items[i], i, "content", false, &text);
        const char *role = role_of(msgs, i);
        emits(o, "<|im_start|>", 0);
        emits(o, role, 0);
        emits(o, "\n", 0);
        uint8_t m = strcmp(role, "assistant") == 0;
        emit(o, text, m);
        emits(o, "<|im_end|>\n", m);
    }
    if (add_generation_prompt) emits(o, "<|im_start|>assistant\n", 0);
    return LOOM_OK;
}

static loom_status render_qwen25(loom_ctx *ctx, const loom_chat *c, const loom_json *msgs,
                                 const loom_json *tools, bool add_generation_prompt, rout *o) {
    static const char *const roles[] = {"system", "user", "assistant", "tool", NULL};
    loom_status st = check_messages(ctx, c, msgs, roles);
    if (st) return st;
    size_t n = msgs->n;
    /* Contents: required everywhere except an assistant message with tool
     * calls ({%- if message.content %}). */
    for (size_t i = 0; i < n; i++) {
        const loom_json *tc = NULL;
        str text;
        bool asst = role_is(msgs, i, "assistant");
        if (asst && (st = get_tool_calls(ctx, msgs->items[i], i, &tc))) return st;
        if ((st = get_text(ctx, msgs->items[i], i, "content", asst && tc && tc->n > 0, &text)))
            return st;
    }
    emits(o, "<|im_start|>system\n", 0);
    if (role_is(msgs, 0, "system")) {
        str text;
        get_text(ctx, msgs->items[0], 0, "content", false, &text);
        emit(o, text, 0);
    } else {
        emits(o, LOOM_QWEN25_SYSTEM, 0);
    }
    if (tools && tools->n) {
        emits(o, "\n\n", 0);
        if ((st = emit_tools(ctx, o, tools)))
            return st;
    } else {
        emits(o, "<|im_end|>\n", 0);
    }
    loom_sb calls;
    loom_sb_init(&calls);
    for (size_t i = 0; i < n && !st; i++) {
        const loom_json *m = msgs->items[i], *tc = NULL;
        const char *role = role_of(msgs, i);
        str text;
        get_text(ctx, m, i, "content", true, &text);
        bool asst = strcmp(role, "assistant") == 0;
        if (asst) get_tool_calls(ctx, m, i, &tc);
        bool with_calls = asst && tc && tc->n > 0;
        if (strcmp(role, "user") == 0 || (strcmp(role, "system") == 0 && i > 0) ||
            (asst && !with_calls)) {
            emits(o, "<|im_start|>", 0);
            emits(o, role, 0);
            emits(o, "\n", 0);
            emit(o, text, asst);
            emits(o, "<|im_end|>\n", asst);
        } else if (asst) {
            /* '<|im_start|>assistant' ['\n' content] ('\n<tool_call>...')* '<|im_end|>\n';
             * the first '\n' belongs to the prompt, as after the other roles. */
            emits(o, "<|im_start|>assistant\n", 0);
            calls.len = 0;
            if (calls.buf) calls.buf[0] = '\0';
            if (text.n) loom_sb_append(&calls, text.p, text.n);
            for (size_t k = 0; k < tc->n && !st; k++) {
                if (text.n || k > 0) loom_sb_putc(&calls, '\n');
                st = tool_call_text(ctx, tc->items[k], i, k, false, false, &calls);
            }
            if (st) break;
            loom_sb_puts(&calls, "<|im_end|>\n");
            emit(o, (str){calls.buf, calls.len}, 1);
        } else if (strcmp(role, "tool") == 0) {
            if (i == 0 || !role_is(msgs, i - 1, "tool")) emits(o, "<|im_start|>user", 0);
            emits(o, "\n<tool_response>\n", 0);
            emit(o, text, 0);
            emits(o, "\n</tool_response>", 0);
            if (i == n - 1 || !role_is(msgs, i + 1, "tool")) emits(o, "<|im_end|>\n", 0);
        }
    }
    loom_sb_free(&calls);
    if (st) return st;
    if (add_generation_prompt) emits(o, "<|im_start|>assistant\n", 0);
    return LOOM_OK;
}

/* ---------------------------------------------------------------------- */
/* Llama 3.1 and 3.0                                                       */
/* ---------------------------------------------------------------------- */

static loom_status render_llama3(loom_ctx *ctx, const loom_chat *c, const loom_json *msgs,
                                 const loom_json *tools, bool add_generation_prompt, rout *o) {
    static const char *const roles[] = {"system", "user", "assistant", NULL};
    /* even tools=[]: the 3.1 template writes "Environment: ipython" for any list */
    if (tools)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "tools: loom's %s renderer does not do tool use; give no tools (or "
                         "null), or render the conversations to text yourself and train on "
                         "plain text",
                         loom_chat_name(c));
    for (size_t i = 0; msgs && msgs->type == LOOM_JSON_ARRAY && i < msgs->n; i++) {
        const loom_json *m = msgs->items[i], *r = loom_json_get(m, "role");
        if (r && r->type == LOOM_JSON_STRING && (!strcmp(r->s, "tool") || !strcmp(r->s, "ipython")))
            return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                             "messages[%zu]: role '%s': loom's %s renderer does not do tool use",
                             i, r->s, loom_chat_name(c));
        if (m->type == LOOM_JSON_OBJECT && loom_json_get(m, "tool_calls"))
            return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                             "messages[%zu]: 'tool_calls': loom's %s renderer does not do tool "
                             "use", i, loom_chat_name(c));
    }
    loom_status st = check_messages(ctx, c, msgs, roles);
    if (st) return st;
    for (size_t i = 0; i < msgs->n; i++) {
        str text;
        if ((st = get_text(ctx, msgs->items[i], i, "content", false, &text))) return st;
    }
    emits(o, "<|begin_of_text|>", 0);
    size_t first = 0;
    if (c->variant == V_LLAMA31) {
        /* The system block always, the first system message (trimmed) in it. */
        emits(o, "<|start_header_id|>system<|end_header_id|>\n\n", 0);
        emits(o, "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n", 0);
        if (role_is(msgs, 0, "system")) {
            str text;
            get_text(ctx, msgs->items[0], 0, "content", false, &text);
            emit(o, py_trim(text), 0);
            first = 1;
        }
        emits(o, "<|eot_id|>", 0);
    }
    for (size_t i = first; i < msgs->n; i++) {
        str text;
        get_text(ctx, msgs->items[i], i, "content", false, &text);
        const char *role = role_of(msgs, i);
        uint8_t m = strcmp(role, "assistant") == 0;
        emits(o, "<|start_header_id|>", 0);
        emits(o, role, 0);
        emits(o, "<|end_header_id|>\n\n", 0);
        emit(o, py_trim(text), m);
        emits(o, "<|eot_id|>", m);
    }
    if (add_generation_prompt) emits(o, "<|start_header_id|>assistant<|end_header_id|>\n\n", 0);
    return LOOM_OK;
}

loom_status loom_chat_render_builtin(loom_ctx *ctx, const loom_chat *c, const loom_json *messages,
                                     const loom_json *tools, bool add_generation_prompt,
                                     char **text, uint8_t **mask) {
    rout o;
    loom_sb_init(&o.text);
    loom_sb_init(&o.mask);
    loom_status st;
    if (c->kind == LOOM_CHAT_QWEN3)
        st = render_qwen3(ctx, c, messages, tools, add_generation_prompt, &o);
    else if (c->kind == LOOM_CHAT_QWEN2 && c->variant == V_QWEN2)
        st = render_qwen2(ctx, c, messages, tools, add_generation_prompt, &o);
    else if (c->kind == LOOM_CHAT_QWEN2)
        st = render_qwen25(ctx, c, messages, tools, add_generation_prompt, &o);
    else
        st = render_llama3(ctx, c, messages, tools, add_generation_prompt, &o);
    if (!st && (o.text.failed || o.mask.failed))
        st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory rendering a chat");
    if (st) {
        loom_sb_free(&o.text);
        loom_sb_free(&o.mask);
        return st;
    }
    LOOM_ASSERT(o.text.len == o.mask.len);
    *text = loom_sb_take(&o.text);
    if (mask) {
        *mask = (uint8_t *)loom_sb_take(&o.mask);
    } else {
        loom_sb_free(&o.mask);
    }
    return LOOM_OK;
}
