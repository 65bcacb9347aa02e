/* The chat side of the Jinja interpreter (chat.c renders every template it
 * loads through here): the variables transformers' apply_chat_template
 * passes, the per-byte assistant mask from the {% generation %} spans, and
 * the special tokens of tokenizer_config.json. */
#include "jinja_chat.h"

#include <stdlib.h>
#include <string.h>

#include "jinja_impl.h"

static bool has_gen(const jnode *n) {
    if (!n)
        return false;
    if (n->kind == K_GEN)
        return true;
    if (has_gen(n->a) || has_gen(n->b) || has_gen(n->c) || has_gen(n->d))
        return true;
    for (int i = 0; i < n->nkids; i++)
        if (has_gen(n->kids[i]))
            return true;
    return false;
}

bool loom_jinja_has_generation(const loom_jinja *t) { return has_gen(t->root); }

/* obj[key] = item, item freed when it cannot be set; false on failure */
static bool put(loom_ctx *ctx, loom_json *obj, const char *key, loom_json *item) {
    if (!item)
        return false;
    if (loom_json_set(ctx, obj, key, item) != LOOM_OK) {
        loom_json_free(item);
        return false;
    }
    return true;
}

loom_status loom_jinja_chat_render(loom_ctx *ctx, const loom_jinja *t, const loom_json *messages,
                                   const loom_jinja_chat_opts *o, char **text, uint8_t **mask) {
    *text = NULL;
    if (mask)
        *mask = NULL;
    loom_json *vars = loom_json_new_object(ctx);
    if (!vars)
        return LOOM_ERR_OOM;
    /* as transformers: messages, tools (None without tools=), documents, add_generation_prompt,
     * the tokenizer's special tokens, then the caller's keyword arguments */
    bool ok =
        put(ctx, vars, "messages", loom_json_clone(ctx, messages)) &&
        put(ctx, vars, "tools",
            o->tools ? loom_json_clone(ctx, o->tools) : loom_json_new_null(ctx)) &&
        put(ctx, vars, "documents", loom_json_new_null(ctx)) &&
        put(ctx, vars, "add_generation_prompt", loom_json_new_bool(ctx, o->add_generation_prompt));
    if (ok && o->bos_token)
        ok = put(ctx, vars, "bos_token", loom_json_new_str(ctx, o->bos_token));
    if (ok && o->eos_token)
        ok = put(ctx, vars, "eos_token", loom_json_new_str(ctx, o->eos_token));
    if (ok && o->enable_thinking >= 0)
        ok = put(ctx, vars, "enable_thinking", loom_json_new_bool(ctx, o->enable_thinking != 0));
    if (!ok) {
        loom_json_free(vars);
        return ctx && ctx->status ? ctx->status : LOOM_ERR_OOM;
    }
    size_t len = 0, n = 0;
    loom_jinja_span *sp = NULL;
    loom_status st = loom_jinja_render(ctx, t, vars, text, &len, &sp, &n);
    loom_json_free(vars);
    if (st)
        return st;
    if (mask) {
        *mask = calloc(len + 1, 1);
        if (!*mask) {
            free(*text), free(sp);
            *text = NULL;
            return loom_errf(ctx, LOOM_ERR_OOM, "out of memory for the assistant mask");
        }
        for (size_t k = 0; k < n; k++)
            memset(*mask + sp[k].start, 1, sp[k].end - sp[k].start);
    }
    free(sp);
    return LOOM_OK;
}

/* A special token of tokenizer_config.json: a string, or an AddedToken
 * object's "content". */
static loom_status token_of(loom_ctx *ctx, const loom_json *cfg, const char *key, char **out) {
    const loom_json *v = loom_json_get(cfg, key);
    if (v && v->type == LOOM_JSON_OBJECT)
        v = loom_json_get(v, "content");
    if (!v || v->type != LOOM_JSON_STRING)
        return LOOM_OK;
    *out = loom_strdup(ctx, v->s);
    return *out ? LOOM_OK : LOOM_ERR_OOM;
}

loom_status loom_jinja_chat_tokens(loom_ctx *ctx, const char *model_dir, char **bos, char **eos) {
    *bos = *eos = NULL;
    char *path = loom_path_join(ctx, model_dir, "tokenizer_config.json");
    if (!path)
        return LOOM_ERR_OOM;
    loom_status st = LOOM_OK;
    if (loom_file_exists(path)) {
        loom_json *cfg = NULL;
        st = loom_json_parse_file(ctx, path, &cfg);
        if (!st)
            st = token_of(ctx, cfg, "bos_token", bos);
        if (!st)
            st = token_of(ctx, cfg, "eos_token", eos);
        loom_json_free(cfg);
    }
    free(path);
    if (st) {
        free(*bos), free(*eos);
        *bos = *eos = NULL;
    }
    return st;
}
