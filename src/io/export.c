/* Hugging Face and PEFT directories out, adapter_config.json in (export.h). */
#include "export.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/json.h"
#include "hf_experts.h"
#include "outdir.h"
#include "safetensors.h"

/* The names and shapes a checkpoint holds for loom's (present_text's
 * inverse): under model.language_model. for a vision-language config, a
 * Gated DeltaNet conv1d weight (C, K) as [C, 1, K]. */
static loom_status hub_names(loom_ctx *ctx, loom_hf_layout *lay, bool nested) {
    static const char conv[] = ".linear_attn.conv1d.weight";
    for (size_t k = 0; k < lay->n; k++) {
        loom_hf_out *t = &lay->t[k];
        const size_t n = strlen(t->name), nc = sizeof conv - 1;
        if (t->ndim == 2 && n > nc && !strcmp(t->name + n - nc, conv)) {
            t->ndim = 3;
            t->shape[2] = t->shape[1];
            t->shape[1] = 1;
        }
        if (!nested || strncmp(t->name, "model.", 6)) continue;
        char *r = loom_malloc(ctx, n + sizeof "language_model.", "tensor names");
        if (!r) return LOOM_ERR_OOM;
        sprintf(r, "model.language_model.%s", t->name + 6);
        free(t->name);
        t->name = r;
    }
    return LOOM_OK;
}

/* A vision-language checkpoint's tensors outside the text model (the
 * vision tower, the mtp head): carried as read. */
static bool carried(const char *name) {
    return strncmp(name, "model.language_model.", 21) && strcmp(name, "lm_head.weight");
}

bool loom_hf_carried(const loom_model_config *cfg, const char *name) {
    /* as loom_hf_dir_open presents them: the text model's under model. */
    return cfg->nested_text && strncmp(name, "model.layers.", 13) &&
           strcmp(name, "model.embed_tokens.weight") && strcmp(name, "model.norm.weight") &&
           carried(name);
}

/* <base>.safetensors (sharded past max_shard; 0: one file) from src into
 * dir on the writer, {"format": "pt"} as its metadata, as transformers
 * writes; src's experts fused with `fused`, named as the hub names them
 * (hub_names; nested: a vision-language config), then `carry`'s tensors
 * outside the text model byte for byte (NULL: none). Every rank fetches
 * every tensor of src, whatever the writer's state. */
static loom_status write_tensors(loom_ctx *ctx, const char *dir, const char *base,
                                 uint64_t max_shard, loom_dtype dtype, bool writer,
                                 const loom_tensor_source *src, bool fused, bool nested,
                                 const loom_safetensors *carry, loom_status st) {
    loom_hf_layout lay;
    loom_status ls = loom_hf_layout_build(ctx, src, fused, &lay); /* alike on every rank */
    if (!ls) ls = hub_names(ctx, &lay, nested);
    if (ls) {
        loom_hf_layout_free(&lay);
        return st ? st : ls;
    }
    loom_st_writer *w = NULL;
    if (writer && !st) {
        loom_json *meta = loom_json_new_object(ctx);
        st = meta ? loom_json_set(ctx, meta, "format", loom_json_new_str(ctx, "pt")) : LOOM_ERR_OOM;
        if (!st) st = loom_st_writer_create(ctx, dir, base, max_shard, meta, &w);
        loom_json_free(meta);
        for (size_t k = 0; k < lay.n && !st; k++)
            st =
                loom_st_writer_declare(ctx, w, lay.t[k].name, dtype, lay.t[k].ndim, lay.t[k].shape);
        for (size_t i = 0; carry && i < loom_st_count(carry) && !st; i++) {
            const loom_st_tensor *t = loom_st_at(carry, i);
            if (carried(t->name))
                st = loom_st_writer_declare(ctx, w, t->name, t->dtype, t->ndim, t->shape);
        }
    }
    float *buf = NULL;
    size_t cap = 0;
    char name[320];
    int ndim;
    int64_t shape[2];
    for (size_t k = 0; k < lay.n; k++) {
        loom_status gs = LOOM_OK;
        for (size_t j = lay.t[k].first; j < lay.t[k].first + lay.t[k].n && !gs; j++) {
            const size_t i = lay.idx[j];
            src->info(src->u, i, name, sizeof name, &ndim, shape);
            const size_t n = (size_t)(shape[0] * (ndim == 2 ? shape[1] : 1));
            if (n > cap) {
                float *nb = realloc(buf, n * sizeof *buf);
                if (!nb) gs = loom_errf(ctx, LOOM_ERR_OOM, "out of memory gathering %s", name);
                buf = nb ? nb : buf;
                cap = nb ? n : cap;
            }
            if (!gs) gs = src->fetch(src->u, i, buf);
            if (!gs && writer && !st)
                st = loom_st_writer_write_part(ctx, w, lay.t[k].name, LOOM_F32, buf, n);
        }
        if (gs) { /* a failed gather fails every rank alike: stop here */
            st = gs;
            break;
        }
    }
    free(buf);
    loom_hf_layout_free(&lay);
    for (size_t i = 0; writer && carry && i < loom_st_count(carry) && !st; i++) {
        const loom_st_tensor *t = loom_st_at(carry, i);
        if (carried(t->name)) st = loom_st_writer_write(ctx, w, t->name, t->dtype, t->data);
    }
    if (writer && !st) st = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    return st;
}

loom_status loom_hf_dir_write(loom_ctx *ctx, const char *what, const char *dir, bool writer,
                              const loom_tensor_source *src, loom_dtype dtype,
                              uint64_t max_shard_bytes, const loom_model_config *cfg,
                              const char *side_dir, bool fused_experts) {
    if (dtype != LOOM_F32 && dtype != LOOM_BF16 && dtype != LOOM_F16)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "weights can be saved as F32, BF16 or F16, not %s", loom_dtype_name(dtype));
    if (!max_shard_bytes) max_shard_bytes = 5000000000ull; /* transformers' default */
    loom_out out = {0}; /* the writer writes into a temporary directory, moved into place whole */
    loom_status st = writer ? loom_out_begin(ctx, what, dir, LOOM_OUT_DIR, &out) : LOOM_OK;
    /* a vision-language checkpoint read from side_dir: what loom does not
     * train goes out as it came in */
    loom_safetensors *carry = NULL;
    if (writer && !st && cfg->nested_text && side_dir)
        st = loom_st_open_dir(ctx, side_dir, "model", &carry);
    st = write_tensors(ctx, out.tmp, "model", max_shard_bytes, dtype, writer, src, fused_experts,
                       cfg->nested_text, carry, st);
    loom_st_close(carry);
    if (writer && !st) st = loom_config_save(ctx, cfg, out.tmp, dtype);
    if (writer && !st && side_dir) st = loom_out_copy_side_files(ctx, side_dir, out.tmp);
    if (writer && !st) return loom_out_commit(ctx, &out);
    loom_out_abort(&out);
    return st;
}

/* ---- PEFT ---- */

void loom_peft_weight_name(char *buf, size_t cap, const char *text_prefix, int64_t layer,
                           const char *block, const char *module, char ab) {
    snprintf(buf, cap, "base_model.model.%slayers.%lld.%s.%s.lora_%c.weight", text_prefix,
             (long long)layer, block, module, ab);
}

/* n characters of [a-z_] (dots too, not at the ends: a block's path) */
static bool name_chars(const char *p, size_t n, bool dots) {
    if (!n) return false;
    for (size_t i = 0; i < n; i++)
        if (!((p[i] >= 'a' && p[i] <= 'z') || p[i] == '_' || (dots && p[i] == '.')))
            return false;
    return p[0] != '.' && p[n - 1] != '.';
}

bool loom_peft_weight_parse(const char *name, int64_t *layer, int64_t *expert, char block[64],
                            char module[32], char *ab, bool *nested) {
    static const char pre[] = "base_model.model.model.", lm[] = "language_model.",
                      layers[] = "layers.", suf[] = ".weight";
    *expert = -1;
    if (strncmp(name, pre, sizeof pre - 1)) return false;
    const char *p = name + sizeof pre - 1;
    const bool vl = !strncmp(p, lm, sizeof lm - 1);
    if (vl)
        p += sizeof lm - 1;
    if (strncmp(p, layers, sizeof layers - 1))
        return false;
    p += sizeof layers - 1;
    if (nested)
        *nested = vl;
    const char *q = p;
    long long l = 0;
    while (*q >= '0' && *q <= '9' && q - p < 9) l = l * 10 + (*q++ - '0');
    if (q == p || *q != '.' || (q - p > 1 && *p == '0')) return false;
    /* "<block>.<module>.lora_<A|B>.weight" */
    const char *rest = q + 1, *end = rest + strlen(rest);
    const size_t tail = strlen(".lora_A") + sizeof suf - 1;
    if ((size_t)(end - rest) <= tail) return false;
    const char *mend = end - tail, *dot = mend; /* mend: ".lora_<A|B>.weight" */
    if (strncmp(mend, ".lora_", 6) || (mend[6] != 'A' && mend[6] != 'B') || strcmp(mend + 7, suf))
        return false;
    *ab = mend[6];
    while (dot > rest && dot[-1] != '.') dot--;
    if (dot == rest || (size_t)(mend - dot) >= 32 || !name_chars(dot, (size_t)(mend - dot), false))
        return false;
    size_t bl = (size_t)(dot - 1 - rest);
    /* an expert's: mlp.experts.<e> */
    static const char ex[] = "mlp.experts.";
    if (bl > sizeof ex - 1 && !strncmp(rest, ex, sizeof ex - 1)) {
        const char *e = rest + sizeof ex - 1;
        long long v = 0;
        int nd = 0;
        for (; e < dot - 1 && *e >= '0' && *e <= '9' && nd < 9; e++, nd++) v = v * 10 + (*e - '0');
        if (e != dot - 1 || (nd > 1 && rest[sizeof ex - 1] == '0')) return false;
        *expert = v;
        bl = sizeof ex - 2;
    } else if (bl >= 64 || !name_chars(rest, bl, true)) {
        return false;
    }
    memcpy(block, rest, bl);
    block[bl] = 0;
    memcpy(module, dot, (size_t)(mend - dot));
    module[mend - dot] = 0;
    *layer = l;
    return true;
}

/* adapter_config.json as PEFT writes it; base_model_name_or_path is c's. */
static loom_status write_config(loom_ctx *ctx, const char *dir, const loom_peft_config *c,
                                const char *const *targets, int ntargets) {
    loom_json *o = loom_json_new_object(ctx), *tm = loom_json_new_array(ctx);
    if (!o || !tm) {
        loom_json_free(o);
        loom_json_free(tm);
        return LOOM_ERR_OOM;
    }
    for (int k = 0; k < ntargets; k++) loom_json_push(ctx, tm, loom_json_new_str(ctx, targets[k]));
    struct {
        const char *k;
        loom_json *v;
    } kv[] = {
        {"peft_type", loom_json_new_str(ctx, "LORA")},
        {"task_type", loom_json_new_str(ctx, "CAUSAL_LM")},
        {"base_model_name_or_path", loom_json_new_str(ctx, c->base_model)},
        {"r", loom_json_new_int(ctx, c->r)},
        {"lora_alpha", loom_json_new_num(ctx, c->lora_alpha)},
        {"lora_dropout", loom_json_new_num(ctx, c->lora_dropout)},
        {"target_modules", tm},
        {"use_rslora", loom_json_new_bool(ctx, c->use_rslora)},
        {"use_dora", loom_json_new_bool(ctx, false)},
        {"bias", loom_json_new_str(ctx, "none")},
        {"fan_in_fan_out", loom_json_new_bool(ctx, false)},
        {"inference_mode", loom_json_new_bool(ctx, true)},
        {"init_lora_weights", loom_json_new_bool(ctx, true)},
        {"modules_to_save", loom_json_new_null(ctx)},
    };
    loom_status st = LOOM_OK;
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
        if (!st)
            st = kv[i].v ? loom_json_set(ctx, o, kv[i].k, kv[i].v) : LOOM_ERR_OOM;
        else
            loom_json_free(kv[i].v);
    loom_sb sb;
    loom_sb_init(&sb);
    if (!st) st = loom_json_write(ctx, o, 2, &sb);
    loom_json_free(o);
    char *text = loom_sb_take(&sb);
    char *path = loom_path_join(ctx, dir, "adapter_config.json");
    if (!st && (!text || !path)) st = LOOM_ERR_OOM;
    if (!st) st = loom_write_file_atomic(ctx, path, text, strlen(text));
    free(text);
    free(path);
    return st;
}

loom_status loom_peft_dir_write(loom_ctx *ctx, const char *dir, bool writer,
                                const loom_tensor_source *src, loom_dtype dtype,
                                const loom_peft_config *c, const char *const *targets,
                                int ntargets) {
    if (dtype != LOOM_F32 && dtype != LOOM_BF16 && dtype != LOOM_F16 && dtype != LOOM_F64)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "adapters are saved as F32, BF16, F16 or F64");
    loom_out out = {0}; /* the writer writes into a temporary directory, moved into place whole */
    loom_status st =
        writer ? loom_out_begin(ctx, "save_adapter", dir, LOOM_OUT_DIR, &out) : LOOM_OK;
    st =
        write_tensors(ctx, out.tmp, "adapter_model", 0, dtype, writer, src, false, false, NULL, st);
    if (writer && !st)
        st = write_config(ctx, out.tmp, c, targets, ntargets);
    if (writer && !st)
        return loom_out_commit(ctx, &out);
    loom_out_abort(&out);
    return st;
}

loom_status loom_peft_config_read(loom_ctx *ctx, const char *dir, loom_peft_config *out) {
    memset(out, 0, sizeof *out);
    char *cfgp = loom_path_join(ctx, dir, "adapter_config.json");
    if (!cfgp) return LOOM_ERR_OOM;
    loom_json *doc = NULL;
    loom_status s;
    if (!loom_file_exists(cfgp)) {
        s = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                      "%s: not found (a PEFT adapter directory holds adapter_config.json and "
                      "adapter_model.safetensors)",
                      cfgp);
        goto done;
    }
    if ((s = loom_json_parse_file(ctx, cfgp, &doc))) goto done;
    const char *ptype = NULL;
    if ((s = loom_json_get_str_opt(ctx, doc, "peft_type", cfgp, &ptype))) goto done;
    if (ptype && strcmp(ptype, "LORA")) {
        s = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: peft_type %s: loom reads LoRA adapters only",
                      cfgp, ptype);
        goto done;
    }
    const loom_json *b = loom_json_get(doc, "base_model_name_or_path");
    if (b && b->type == LOOM_JSON_STRING) snprintf(out->base_model, sizeof out->base_model, "%s", b->s);
    bool dora = false, fifo = false;
    if ((s = loom_json_get_int(ctx, doc, "r", cfgp, &out->r))) goto done;
    out->lora_alpha = (double)out->r;
    if ((s = loom_json_get_num_opt(ctx, doc, "lora_alpha", cfgp, &out->lora_alpha)) ||
        (s = loom_json_get_num_opt(ctx, doc, "lora_dropout", cfgp, &out->lora_dropout)) ||
        (s = loom_json_get_bool_opt(ctx, doc, "use_rslora", cfgp, &out->use_rslora)) ||
        (s = loom_json_get_bool_opt(ctx, doc, "use_dora", cfgp, &dora)) ||
        (s = loom_json_get_bool_opt(ctx, doc, "fan_in_fan_out", cfgp, &fifo)))
        goto done;
    const char *unsupported = dora ? "use_dora" : fifo ? "fan_in_fan_out" : NULL;
    static const char *const must_be_empty[] = {"rank_pattern", "alpha_pattern", "modules_to_save",
                                                "layers_to_transform", "target_parameters"};
    for (size_t i = 0; !unsupported && i < sizeof must_be_empty / sizeof must_be_empty[0]; i++) {
        const loom_json *v = loom_json_get(doc, must_be_empty[i]);
        if (v && v->type != LOOM_JSON_NULL && !((v->type == LOOM_JSON_OBJECT ||
                                                 v->type == LOOM_JSON_ARRAY) && v->n == 0))
            unsupported = must_be_empty[i];
    }
    const char *bias = NULL;
    if ((s = loom_json_get_str_opt(ctx, doc, "bias", cfgp, &bias))) goto done;
    if (!unsupported && bias && strcmp(bias, "none")) unsupported = "bias";
    if (unsupported) {
        s = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                      "%s: %s is set; loom reads plain LoRA adapters (no DoRA, per-module ranks, "
                      "extra trained modules or biases)",
                      cfgp, unsupported);
        goto done;
    }
    /* target_modules: a list of names or "all-linear" */
    const loom_json *tm = loom_json_get(doc, "target_modules");
    char *targets = out->target_modules;
    const size_t tcap = sizeof out->target_modules;
    if (tm && tm->type == LOOM_JSON_STRING) {
        snprintf(targets, tcap, "%s", tm->s);
    } else if (tm && tm->type == LOOM_JSON_ARRAY) {
        for (size_t i = 0; i < tm->n; i++) {
            if (tm->items[i]->type != LOOM_JSON_STRING) {
                s = loom_errf(ctx, LOOM_ERR_CONFIG, "%s: target_modules must hold strings", cfgp);
                goto done;
            }
            snprintf(targets + strlen(targets), tcap - strlen(targets), "%s%s", i ? "," : "",
                     tm->items[i]->s);
        }
    } else {
        s = loom_errf(ctx, LOOM_ERR_CONFIG,
                      "%s: target_modules must be a list of module names or \"all-linear\"",
                      cfgp);
        goto done;
    }
    if (out->r > 1 << 20) /* r <= 0 is the adapter's check */
        s = loom_errf(ctx, LOOM_ERR_CONFIG, "%s: r=%lld is too large", cfgp, (long long)out->r);
done:
    loom_json_free(doc);
    free(cfgp);
    return s;
}

/* ---- reading ---- */

/* The text model's tensors as loom names them: a vision-language
 * checkpoint (Qwen3.5's hub layout) holds them under model.language_model.,
 * presented under model.* (model.visual.* and mtp.* keep their names); a
 * depthwise conv1d weight [C, 1, K] (Qwen3.5's Gated DeltaNet) is (C, K). */
static bool conv_3d(const loom_st_tensor *t) {
    static const char suf[] = ".conv1d.weight";
    const size_t n = strlen(t->name), ns = sizeof suf - 1;
    return t->ndim == 3 && t->shape[1] == 1 && n > ns && !strcmp(t->name + n - ns, suf);
}

static loom_status present_text(loom_ctx *ctx, loom_safetensors *st) {
    static const char pre[] = "model.language_model.";
    const size_t n = loom_st_count(st), np = sizeof pre - 1;
    size_t k = 0, bytes = 0;
    for (size_t i = 0; i < n; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        if (!strncmp(t->name, pre, np) || conv_3d(t)) k++, bytes += strlen(t->name) + 1;
    }
    if (!k) return LOOM_OK;
    const char **drop = loom_calloc(ctx, k, sizeof *drop, "tensor names");
    loom_st_tensor *add = loom_calloc(ctx, k, sizeof *add, "tensor names");
    char *names = loom_malloc(ctx, bytes, "tensor names");
    loom_status s = drop && add && names ? LOOM_OK : LOOM_ERR_OOM;
    char *p = names;
    for (size_t i = 0, j = 0; i < n && !s; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        const bool renamed = !strncmp(t->name, pre, np);
        if (!renamed && !conv_3d(t)) continue;
        drop[j] = t->name;
        add[j] = *t;
        add[j].name = p;
        p += (renamed ? sprintf(p, "model.%s", t->name + np) : sprintf(p, "%s", t->name)) + 1;
        if (conv_3d(t)) {
            add[j].ndim = 2;
            add[j].shape[1] = t->shape[2];
        }
        j++;
    }
    if (!s) s = loom_st_splice(ctx, st, drop, k, add, k);
    free(drop);
    free(add);
    free(names);
    return s;
}

loom_status loom_hf_dir_open(loom_ctx *ctx, const char *dir, loom_safetensors **out) {
    loom_status s = loom_st_open_dir(ctx, dir, "model", out);
    if (s) return s;
    if ((s = present_text(ctx, *out)) || (s = loom_hf_experts_unfuse(ctx, *out))) {
        loom_st_close(*out);
        *out = NULL;
    }
    return s;
}

struct loom_peft_dir {
    char *dir, *cfg_path;
    loom_peft_config cfg;
    loom_safetensors *st;
};

loom_status loom_peft_dir_open(loom_ctx *ctx, const char *dir, loom_peft_dir **out) {
    *out = NULL;
    loom_peft_dir *d = loom_calloc(ctx, 1, sizeof *d, "adapter");
    if (!d) return LOOM_ERR_OOM;
    loom_status s = LOOM_OK;
    if (!(d->dir = loom_strdup(ctx, dir)) ||
        !(d->cfg_path = loom_path_join(ctx, dir, "adapter_config.json")))
        s = LOOM_ERR_OOM;
    if (!s) s = loom_peft_config_read(ctx, dir, &d->cfg);
    if (!s) s = loom_st_open_dir(ctx, dir, "adapter_model", &d->st);
    if (s) {
        loom_peft_dir_close(d);
        return s;
    }
    *out = d;
    return LOOM_OK;
}

void loom_peft_dir_close(loom_peft_dir *d) {
    if (!d) return;
    loom_st_close(d->st);
    free(d->dir);
    free(d->cfg_path);
    free(d);
}

const loom_peft_config *loom_peft_dir_config(const loom_peft_dir *d) { return &d->cfg; }

const char *loom_peft_dir_config_path(const loom_peft_dir *d) { return d->cfg_path; }

size_t loom_peft_dir_count(const loom_peft_dir *d) { return loom_st_count(d->st); }

loom_status loom_peft_dir_tensor(loom_ctx *ctx, const loom_peft_dir *d, size_t i,
                                 loom_peft_tensor *t) {
    const loom_st_tensor *x = loom_st_at(d->st, i);
    memset(t, 0, sizeof *t);
    t->name = x->name;
    t->lora = loom_peft_weight_parse(x->name, &t->layer, &t->expert, t->block, t->module, &t->ab,
                                     &t->nested);
    t->ndim = x->ndim;
    t->shape[0] = x->ndim > 0 ? x->shape[0] : 0;
    t->shape[1] = x->ndim > 1 ? x->shape[1] : 0;
    t->dtype = x->dtype;
    t->data = x->data;
    if (x->dtype != LOOM_F32 && x->dtype != LOOM_BF16 && x->dtype != LOOM_F64 &&
        x->dtype != LOOM_F16)
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: %s is %s; LoRA weights must be floats", d->dir,
                         x->name, loom_dtype_name(x->dtype));
    return LOOM_OK;
}

bool loom_peft_base_model_type(const char *base, char *out, size_t cap) {
    out[0] = '\0';
    loom_ctx *q = NULL; /* what fails here is nobody's error: the answer is "" */
    if (!base || !*base || loom_ctx_create(&q)) return false;
    char *cj = loom_path_join(q, base, "config.json");
    const bool local = cj && loom_file_exists(cj);
    loom_json *bc = NULL;
    const char *mt = NULL;
    if (local && !loom_json_parse_file(q, cj, &bc) &&
        !loom_json_get_str_opt(q, bc, "model_type", cj, &mt) && mt)
        snprintf(out, cap, "%s", mt);
    loom_json_free(bc);
    free(cj);
    loom_ctx_free(q);
    return local;
}
