/* loom_model: creation from an HF directory (config overrides, weight
 * loading with every tensor checked), activation buffers, HF export. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend/cpu/cpu_ops.h"
#include "../io/safetensors.h"
#include "model.h"

void loom_model_options_default(loom_model_options *o) {
    memset(o, 0, sizeof *o);
    o->dtype = LOOM_F32;
    o->vocab_pad_multiple = 128;
}

/* config.json with the overrides' keys replacing its own. */
static loom_status load_config(loom_ctx *ctx, const char *dir, const char *overrides,
                               loom_model_config *cfg) {
    if (!overrides || !*overrides) return loom_config_load(ctx, dir, cfg);
    char *file = loom_path_join(ctx, dir, "config.json");
    if (!file) return LOOM_ERR_OOM;
    loom_json *doc = NULL, *ov = NULL;
    loom_status st;
    if (!loom_file_exists(file)) {
        st = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                       "%s: not found (a model directory holds config.json and *.safetensors "
                       "files)",
                       file);
        goto done;
    }
    if ((st = loom_json_parse_file(ctx, file, &doc))) goto done;
    if ((st = loom_json_parse(ctx, overrides, strlen(overrides), "config overrides", &ov)))
        goto done;
    if (ov->type != LOOM_JSON_OBJECT || doc->type != LOOM_JSON_OBJECT) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG,
                       "config overrides must be a JSON object such as {\"num_hidden_layers\": 2}");
        goto done;
    }
    for (size_t i = 0; i < ov->n && !st; i++) {
        loom_json *item = loom_json_clone(ctx, ov->items[i]);
        st = item ? loom_json_set(ctx, doc, ov->keys[i], item) : LOOM_ERR_OOM;
    }
    if (!st) {
        memset(cfg, 0, sizeof *cfg);
        st = loom_config_parse(ctx, doc, file, cfg);
        if (st) loom_config_free(cfg);
    }
done:
    loom_json_free(doc);
    loom_json_free(ov);
    free(file);
    return st;
}

/* Layer index and the name after "model.layers.N." (NULL outside layers). */
static const char *layer_leaf(const char *name, int64_t *layer) {
    static const char pre[] = "model.layers.";
    if (strncmp(name, pre, sizeof pre - 1)) return NULL;
    char *end;
    long long l = strtoll(name + sizeof pre - 1, &end, 10);
    if (*end != '.') return NULL;
    *layer = l;
    return end + 1;
}

static loom_status build_slots(loom_model *m) {
    loom_ctx *ctx = m->ctx;
    m->slots = loom_calloc(ctx, m->plan.n, sizeof *m->slots, "parameter slots");
    m->layer = loom_calloc(ctx, (size_t)m->L, sizeof *m->layer, "layer table");
    if (!m->slots || !m->layer) return LOOM_ERR_OOM;
    memset(m->layer, 0xff, (size_t)m->L * sizeof *m->layer); /* every index -1 */
    m->embed = m->final_norm = m->head = -1;
    static const struct {
        const char *leaf;
        size_t off;
    } leaves[] = {
        {"input_layernorm.weight", offsetof(loom_layer_slots, ln1)},
        {"post_attention_layernorm.weight", offsetof(loom_layer_slots, ln2)},
        {"self_attn.q_proj.weight", offsetof(loom_layer_slots, wq)},
        {"self_attn.k_proj.weight", offsetof(loom_layer_slots, wk)},
        {"self_attn.v_proj.weight", offsetof(loom_layer_slots, wv)},
        {"self_attn.o_proj.weight", offsetof(loom_layer_slots, wo)},
        {"self_attn.q_proj.bias", offsetof(loom_layer_slots, bq)},
        {"self_attn.k_proj.bias", offsetof(loom_layer_slots, bk)},
        {"self_attn.v_proj.bias", offsetof(loom_layer_slots, bv)},
        {"self_attn.o_proj.bias", offsetof(loom_layer_slots, bo)},
        {"self_attn.q_norm.weight", offsetof(loom_layer_slots, qn)},
        {"self_attn.k_norm.weight", offsetof(loom_layer_slots, kn)},
        {"mlp.gate_proj.weight", offsetof(loom_layer_slots, wg)},
        {"mlp.up_proj.weight", offsetof(loom_layer_slots, wu)},
        {"mlp.down_proj.weight", offsetof(loom_layer_slots, wd)},
        {"mlp.gate_proj.bias", offsetof(loom_layer_slots, bg)},
        {"mlp.up_proj.bias", offsetof(loom_layer_slots, bu)},
        {"mlp.down_proj.bias", offsetof(loom_layer_slots, bdn)},
    };
    size_t off = 0;
    for (size_t i = 0; i < m->plan.n; i++) {
        const loom_param_spec *p = &m->plan.p[i];
        int s = m->nslots++;
        loom_slot *sl = &m->slots[s];
        sl->name = p->name;
        sl->ndim = p->ndim;
        sl->shape[0] = p->shape[0];
        sl->shape[1] = p->ndim == 2 ? p->shape[1] : 1;
        sl->rows = p->shape[0];
        sl->decay = p->ndim >= 2;
        int64_t l = -1;
        const char *leaf = layer_leaf(p->name, &l);
        if (!strcmp(p->name, "model.embed_tokens.weight")) {
            m->embed = s;
            sl->rows = m->Vp;
        } else if (!strcmp(p->name, "lm_head.weight")) {
            m->head = s;
            sl->rows = m->Vp;
        } else if (!strcmp(p->name, "model.norm.weight")) {
            m->final_norm = s;
        } else if (leaf && l >= 0 && l < m->L) {
            size_t k = 0;
            while (k < sizeof leaves / sizeof leaves[0] && strcmp(leaves[k].leaf, leaf)) k++;
            if (k == sizeof leaves / sizeof leaves[0])
                return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                                 "%s: this parameter of model_type %s has no place in loom's "
                                 "dense decoder layer",
                                 p->name, m->cfg.model_type);
            *(int *)((char *)&m->layer[l] + leaves[k].off) = s;
        } else {
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan names unknown tensor %s",
                             p->name);
        }
        sl->numel = (size_t)(sl->rows * sl->shape[1]);
        sl->off = off;
        off += (sl->numel + 15) & ~(size_t)15; /* 64-byte aligned slots */
    }
    m->nparams = off;
    if (m->embed < 0 || m->final_norm < 0)
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan lacks the embedding or final norm");
    if (m->head < 0) m->head = m->embed; /* tied */
    for (int64_t l = 0; l < m->L; l++) {
        const loom_layer_slots *ls = &m->layer[l];
        if (ls->ln1 < 0 || ls->ln2 < 0 || ls->wq < 0 || ls->wk < 0 || ls->wv < 0 || ls->wo < 0 ||
            ls->wg < 0 || ls->wu < 0 || ls->wd < 0 || (m->cfg.qk_norm && (ls->qn < 0 || ls->kn < 0)))
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan lacks a tensor of layer %lld",
                             (long long)l);
    }
    return LOOM_OK;
}

/* Reads every tensor of the plan; refuses missing tensors and wrong shapes,
 * reports the ones the model does not use. */
static loom_status load_weights(loom_model *m, const char *dir) {
    loom_ctx *ctx = m->ctx;
    loom_safetensors *st;
    loom_status s = loom_st_open_dir(ctx, dir, "model", &st);
    if (s) return s;
    m->file_dtype = LOOM_DTYPE_COUNT;
    for (int i = 0; i < m->nslots && !s; i++) {
        const loom_slot *sl = &m->slots[i];
        const loom_st_tensor *t = loom_st_find(st, sl->name);
        if (!t) {
            s = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                          "%s: the checkpoint has no tensor %s, which its config.json "
                          "(model_type %s, %lld layers) requires",
                          dir, sl->name, m->cfg.model_type, (long long)m->L);
            break;
        }
        bool ok = t->ndim == sl->ndim && t->shape[0] == sl->shape[0] &&
                  (sl->ndim == 1 || t->shape[1] == sl->shape[1]);
        if (!ok) {
            char got[96] = "", want[64];
            for (int d = 0; d < t->ndim && d < 4; d++)
                snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "",
                         (long long)t->shape[d]);
            if (sl->ndim == 2)
                snprintf(want, sizeof want, "%lld, %lld", (long long)sl->shape[0],
                         (long long)sl->shape[1]);
            else
                snprintf(want, sizeof want, "%lld", (long long)sl->shape[0]);
            s = loom_errf(ctx, LOOM_ERR_SHAPE,
                          "%s: tensor %s has shape [%s], but config.json implies [%s]; "
                          "the checkpoint and its config.json do not belong together",
                          dir, sl->name, got, want);
            break;
        }
        if (m->file_dtype == LOOM_DTYPE_COUNT) m->file_dtype = t->dtype;
        s = loom_st_read(ctx, t, LOOM_F32, m->w + sl->off, t->numel);
    }
    if (!s) {
        size_t unused = 0;
        const char *first = NULL;
        for (size_t i = 0; i < loom_st_count(st); i++) {
            const char *name = loom_st_at(st, i)->name;
            int k = 0;
            while (k < m->nslots && strcmp(m->slots[k].name, name)) k++;
            if (k < m->nslots) continue;
            if (!strcmp(name, "lm_head.weight") && m->cfg.tie_word_embeddings) {
                LOOM_LOG_W(ctx,
                           "%s: lm_head.weight is ignored: config.json ties it to the embedding "
                           "(tie_word_embeddings), as transformers does",
                           dir);
                continue;
            }
            if (!unused++) first = name;
        }
        if (unused)
            LOOM_LOG_W(ctx, "%s: %zu tensor%s of the checkpoint %s not used by the model (%s%s)",
                       dir, unused, unused == 1 ? "" : "s", unused == 1 ? "is" : "are", first,
                       unused > 1 ? ", ..." : "");
    }
    loom_st_close(st);
    return s;
}

loom_status loom_model_create(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                              loom_model **out) {
    *out = NULL;
    loom_model_options def;
    if (!opts) {
        loom_model_options_default(&def);
        opts = &def;
    }
    if (!dir || !*dir)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "no model directory given (--model DIR)");
    if (opts->dtype != LOOM_F32)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "compute dtype %s: the CPU backend computes in F32; bf16 and fp16 "
                         "run on the CUDA backend",
                         loom_dtype_name(opts->dtype));
    int64_t pad = opts->vocab_pad_multiple ? opts->vocab_pad_multiple : 128;
    if (pad < 1 || pad > (1 << 20))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "vocab_pad_multiple=%lld: use a positive multiple such as 128",
                         (long long)pad);
    loom_model *m = loom_calloc(ctx, 1, sizeof *m, "model");
    if (!m) return LOOM_ERR_OOM;
    m->ctx = ctx;
    loom_status st = load_config(ctx, dir, opts->config_overrides, &m->cfg);
    if (st) {
        free(m);
        return st;
    }
    const loom_model_config *c = &m->cfg;
    if (c->num_experts > 0) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                       "%s: model_type %s (mixture of experts) cannot be trained by this version "
                       "of loom yet; dense qwen3, qwen2 and llama models can",
                       dir, c->model_type);
        goto fail;
    }
    m->V = c->vocab_size;
    m->Vp = (c->vocab_size + pad - 1) / pad * pad;
    m->H = c->hidden_size;
    m->I = c->intermediate_size;
    m->L = c->num_layers;
    m->Hq = c->num_heads;
    m->Hkv = c->num_kv_heads;
    m->D = c->head_dim;
    if (m->D > LOOM_CPU_ATTN_MAX_D || m->D % 2) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: head_dim=%lld: loom needs an even head_dim "
                       "of at most %d", dir, (long long)m->D, LOOM_CPU_ATTN_MAX_D);
        goto fail;
    }
    m->attn_scale = (float)(1.0 / sqrt((double)m->D));
    if ((st = loom_param_plan_build(ctx, c, &m->plan))) goto fail;
    if ((st = build_slots(m))) goto fail;
    m->w = loom_calloc(ctx, m->nparams, sizeof(float), "parameters");
    m->g = loom_calloc(ctx, m->nparams, sizeof(float), "gradients");
    m->inv_freq = loom_calloc(ctx, (size_t)(m->D / 2), sizeof(float), "rope frequencies");
    if (!m->w || !m->g || !m->inv_freq) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    loom_rope_inv_freq((int)c->rope_type, c->rope_theta, m->D, c->rope_factor,
                       c->rope_low_freq_factor, c->rope_high_freq_factor,
                       c->rope_original_max_pos, m->inv_freq);
    if ((st = load_weights(m, dir))) goto fail;
    m->opt = loom_optimizer_config_default();
    *out = m;
    return LOOM_OK;
fail:
    loom_model_free(m);
    return st;
}

static void acts_free(loom_acts *a) {
    float **f[] = {&a->x,    &a->h1,   &a->h2,    &a->rstd1, &a->rstd2, &a->xmid, &a->qpre,
                   &a->kpre, &a->rstdq, &a->rstdk, &a->q,    &a->k,     &a->v,    &a->o,
                   &a->lse,  &a->gate, &a->up,    &a->act,   &a->hf,    &a->rstdf, &a->dx,
                   &a->dtmp, &a->dq,   &a->dk,    &a->dv,    &a->dout,  &a->dg,   &a->du,
                   &a->logits, &a->celse};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        free(*f[i]);
        *f[i] = NULL;
    }
    free(a->pos);
    free(a->cu);
    a->pos = a->cu = NULL;
    a->cap = 0;
}

loom_status loom_model_reserve(loom_model *m, int64_t T) {
    loom_acts *a = &m->a;
    if (T <= a->cap) return LOOM_OK;
    acts_free(a);
    const int64_t H = m->H, I = m->I, L = m->L, QD = m->Hq * m->D, KD = m->Hkv * m->D;
    bool qkn = m->cfg.qk_norm;
    a->chunk = (16 << 20) / m->Vp;
    if (a->chunk < 1) a->chunk = 1;
    if (a->chunk > T) a->chunk = T;
    struct {
        float **p;
        int64_t n;
    } req[] = {
        {&a->x, (L + 1) * T * H}, {&a->h1, L * T * H},   {&a->h2, L * T * H},
        {&a->rstd1, L * T},       {&a->rstd2, L * T},    {&a->xmid, L * T * H},
        {&a->qpre, qkn ? L * T * QD : 0}, {&a->kpre, qkn ? L * T * KD : 0},
        {&a->rstdq, qkn ? L * T * m->Hq : 0}, {&a->rstdk, qkn ? L * T * m->Hkv : 0},
        {&a->q, L * T * QD},      {&a->k, L * T * KD},   {&a->v, L * T * KD},
        {&a->o, L * T * QD},      {&a->lse, L * T * m->Hq},
        {&a->gate, L * T * I},    {&a->up, L * T * I},   {&a->act, L * T * I},
        {&a->hf, T * H},          {&a->rstdf, T},        {&a->dx, T * H},
        {&a->dtmp, T * H},        {&a->dq, T * QD},      {&a->dk, T * KD},
        {&a->dv, T * KD},         {&a->dout, T * QD},    {&a->dg, T * I},
        {&a->du, T * I},          {&a->logits, a->chunk * m->Vp}, {&a->celse, a->chunk},
    };
    for (size_t i = 0; i < sizeof req / sizeof req[0]; i++) {
        if (!req[i].n) continue;
        *req[i].p = loom_malloc(m->ctx, (size_t)req[i].n * sizeof(float), "activations");
        if (!*req[i].p) {
            acts_free(a);
            return LOOM_ERR_OOM;
        }
    }
    a->pos = loom_malloc(m->ctx, (size_t)T * sizeof(int32_t), "positions");
    a->cu = loom_malloc(m->ctx, (size_t)(T + 1) * sizeof(int32_t), "document offsets");
    if (!a->pos || !a->cu) {
        acts_free(a);
        return LOOM_ERR_OOM;
    }
    a->cap = T;
    return LOOM_OK;
}

void loom_model_free(loom_model *m) {
    if (!m) return;
    acts_free(&m->a);
    free(m->w);
    free(m->g);
    free(m->adam_m);
    free(m->adam_v);
    free(m->inv_freq);
    free(m->slots);
    free(m->layer);
    loom_param_plan_free(&m->plan);
    loom_config_free(&m->cfg);
    free(m);
}

void loom_model_get_info(const loom_model *m, loom_model_info *info) {
    memset(info, 0, sizeof *info);
    info->model_type = m->cfg.model_type;
    info->vocab_size = m->V;
    info->padded_vocab_size = m->Vp;
    info->hidden_size = m->H;
    info->intermediate_size = m->I;
    info->num_layers = m->L;
    info->num_heads = m->Hq;
    info->num_kv_heads = m->Hkv;
    info->head_dim = m->D;
    info->num_params = loom_param_plan_count(&m->plan, NULL);
    info->num_tensors = m->nslots;
}

const char *loom_model_tensor_name(const loom_model *m, int64_t i, int *ndim, int64_t shape[2]) {
    if (i < 0 || i >= m->nslots) return NULL;
    const loom_slot *s = &m->slots[i];
    if (ndim) *ndim = s->ndim;
    if (shape) {
        shape[0] = s->shape[0];
        shape[1] = s->ndim == 2 ? s->shape[1] : 0;
    }
    return s->name;
}

int loom_model_find_slot(const loom_model *m, const char *name) {
    for (int i = 0; i < m->nslots; i++)
        if (!strcmp(m->slots[i].name, name)) return i;
    return -1;
}

static loom_status copy_out(loom_model *m, const char *name, const float *base, float scale,
                            float *dst, int64_t n) {
    int s = loom_model_find_slot(m, name);
    if (s < 0) {
        if (!strcmp(name, "lm_head.weight") && m->cfg.tie_word_embeddings)
            return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND,
                             "lm_head.weight is tied to model.embed_tokens.weight in this model; "
                             "ask for that one");
        return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND, "the model has no parameter named %s", name);
    }
    const loom_slot *sl = &m->slots[s];
    int64_t want = sl->shape[0] * sl->shape[1];
    if (n != want)
        return loom_errf(m->ctx, LOOM_ERR_SHAPE, "%s holds %lld values, the buffer %lld", name,
                         (long long)want, (long long)n);
    const float *src = base + sl->off;
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] * scale;
    return LOOM_OK;
}

loom_status loom_model_get_param(loom_model *m, const char *name, float *dst, int64_t n) {
    return copy_out(m, name, m->w, 1.0f, dst, n);
}

loom_status loom_model_get_grad(loom_model *m, const char *name, float *dst, int64_t n) {
    if (m->acc_tokens <= 0)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "no gradient: no token with a target was run through forward_backward "
                         "since the last step");
    return copy_out(m, name, m->g, (float)(1.0 / (double)m->acc_tokens), dst, n);
}

loom_status loom_model_save_hf(loom_model *m, const char *dir, loom_dtype dtype,
                               uint64_t max_shard_bytes) {
    loom_ctx *ctx = m->ctx;
    if (dtype == LOOM_DTYPE_COUNT) dtype = m->file_dtype;
    if (dtype != LOOM_F32 && dtype != LOOM_BF16 && dtype != LOOM_F16)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "weights can be saved as F32, BF16 or F16, not %s", loom_dtype_name(dtype));
    if (!max_shard_bytes) max_shard_bytes = 5000000000ull;
    loom_status st = loom_mkdirs(ctx, dir);
    if (st) return st;
    loom_json *meta = loom_json_new_object(ctx);
    if (!meta) return LOOM_ERR_OOM;
    if ((st = loom_json_set(ctx, meta, "format", loom_json_new_str(ctx, "pt")))) {
        loom_json_free(meta);
        return st;
    }
    loom_st_writer *w = NULL;
    st = loom_st_writer_create(ctx, dir, "model", max_shard_bytes, meta, &w);
    loom_json_free(meta);
    for (int i = 0; i < m->nslots && !st; i++)
        st = loom_st_writer_declare(ctx, w, m->slots[i].name, dtype, m->slots[i].ndim,
                                    m->slots[i].shape);
    /* Row-major: the first V rows of a padded slot are the unpadded tensor. */
    for (int i = 0; i < m->nslots && !st; i++)
        st = loom_st_writer_write(ctx, w, m->slots[i].name, LOOM_F32, m->w + m->slots[i].off);
    if (!st) st = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    if (!st) st = loom_config_save(ctx, &m->cfg, dir, dtype);
    return st;
}
