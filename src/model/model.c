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

static const struct {
    const char *leaf;
    size_t off;
    loom_shard shard;
} leaves[] = {
    {"input_layernorm.weight", offsetof(loom_layer_slots, ln1), LOOM_SHARD_NONE},
    {"post_attention_layernorm.weight", offsetof(loom_layer_slots, ln2), LOOM_SHARD_NONE},
    {"self_attn.q_proj.weight", offsetof(loom_layer_slots, wq), LOOM_SHARD_ROWS},
    {"self_attn.k_proj.weight", offsetof(loom_layer_slots, wk), LOOM_SHARD_ROWS},
    {"self_attn.v_proj.weight", offsetof(loom_layer_slots, wv), LOOM_SHARD_ROWS},
    {"self_attn.o_proj.weight", offsetof(loom_layer_slots, wo), LOOM_SHARD_COLS},
    {"self_attn.q_proj.bias", offsetof(loom_layer_slots, bq), LOOM_SHARD_ROWS},
    {"self_attn.k_proj.bias", offsetof(loom_layer_slots, bk), LOOM_SHARD_ROWS},
    {"self_attn.v_proj.bias", offsetof(loom_layer_slots, bv), LOOM_SHARD_ROWS},
    {"self_attn.o_proj.bias", offsetof(loom_layer_slots, bo), LOOM_SHARD_NONE},
    {"self_attn.q_norm.weight", offsetof(loom_layer_slots, qn), LOOM_SHARD_NONE},
    {"self_attn.k_norm.weight", offsetof(loom_layer_slots, kn), LOOM_SHARD_NONE},
    {"mlp.gate_proj.weight", offsetof(loom_layer_slots, wg), LOOM_SHARD_ROWS},
    {"mlp.up_proj.weight", offsetof(loom_layer_slots, wu), LOOM_SHARD_ROWS},
    {"mlp.down_proj.weight", offsetof(loom_layer_slots, wd), LOOM_SHARD_COLS},
    {"mlp.gate_proj.bias", offsetof(loom_layer_slots, bg), LOOM_SHARD_ROWS},
    {"mlp.up_proj.bias", offsetof(loom_layer_slots, bu), LOOM_SHARD_ROWS},
    {"mlp.down_proj.bias", offsetof(loom_layer_slots, bdn), LOOM_SHARD_NONE},
};
#define NLEAVES (sizeof leaves / sizeof leaves[0])

/* Does this rank hold global layer l? */
static bool holds_layer(const loom_model *m, int64_t l) {
    int64_t Lc = m->L / (m->pp * m->vpp), v = l / Lc;
    return v % m->pp == m->mesh->pp_rank;
}

/* Adds a slot to arena a (its slots array has room) for a tensor of full
 * shape rows x cols (1-D: cols 1; vocab: rows padded) with the given
 * tensor-parallel sharding. */
loom_slot *loom_slot_add(loom_model *m, loom_arena *a, const char *name, int64_t rows,
                         int64_t cols, int ndim, loom_shard shard, bool vocab) {
    loom_slot *sl = &a->slots[a->nslots++];
    sl->name = (char *)name;
    sl->ndim = ndim;
    sl->shape[0] = rows;
    sl->shape[1] = cols;
    sl->shard = shard;
    sl->decay = ndim >= 2;
    int64_t held = vocab ? m->Vp : rows;
    int tr = m->mesh->tp_rank;
    sl->rows = held;
    sl->cols = cols;
    if (shard == LOOM_SHARD_ROWS) {
        sl->rows = held / m->tp;
        sl->row0 = tr * sl->rows;
    } else if (shard == LOOM_SHARD_COLS) {
        sl->cols = cols / m->tp;
        sl->col0 = tr * sl->cols;
    }
    sl->numel = (size_t)(sl->rows * sl->cols);
    return sl;
}

static loom_slot *add_slot(loom_model *m, const loom_param_spec *p, loom_shard shard, bool vocab) {
    return loom_slot_add(m, &m->base, p->name, p->shape[0], p->ndim == 2 ? p->shape[1] : 1,
                         p->ndim, shard, vocab);
}

/* The slots this rank holds, laid out in buckets (each padded to a multiple
 * of the dp*cp group) in the flat buffers. */
static loom_status build_slots(loom_model *m) {
    loom_ctx *ctx = m->ctx;
    m->base.slots = loom_calloc(ctx, m->plan.n + 1, sizeof *m->base.slots, "parameter slots");
    m->layer = loom_calloc(ctx, (size_t)m->L, sizeof *m->layer, "layer table");
    if (!m->base.slots || !m->layer) return LOOM_ERR_OOM;
    memset(m->layer, 0xff, (size_t)m->L * sizeof *m->layer); /* every index -1 */
    m->embed = m->final_norm = m->head = -1;
    const bool first = m->mesh->pp_rank == 0, last = m->mesh->pp_rank == m->pp - 1;
    const bool tied = m->cfg.tie_word_embeddings;
    for (size_t i = 0; i < m->plan.n; i++) {
        const loom_param_spec *p = &m->plan.p[i];
        int64_t l = -1;
        const char *leaf = layer_leaf(p->name, &l);
        if (!strcmp(p->name, "model.embed_tokens.weight")) {
            if (first) {
                m->embed = m->base.nslots;
                add_slot(m, p, LOOM_SHARD_ROWS, true);
            }
            if (tied && last) {
                if (first) {
                    m->head = m->embed;
                } else { /* the last stage's copy of the tied embedding */
                    m->head = m->base.nslots;
                    add_slot(m, p, LOOM_SHARD_ROWS, true)->head_copy = true;
                }
            }
        } else if (!strcmp(p->name, "lm_head.weight")) {
            if (last) {
                m->head = m->base.nslots;
                add_slot(m, p, LOOM_SHARD_ROWS, true);
            }
        } else if (!strcmp(p->name, "model.norm.weight")) {
            if (last) {
                m->final_norm = m->base.nslots;
                add_slot(m, p, LOOM_SHARD_NONE, false)->tp_partial = m->sp;
            }
        } else if (leaf && l >= 0 && l < m->L) {
            size_t k = 0;
            while (k < NLEAVES && strcmp(leaves[k].leaf, leaf)) k++;
            if (k == NLEAVES)
                return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                                 "%s: this parameter of model_type %s has no place in loom's "
                                 "dense decoder layer",
                                 p->name, m->cfg.model_type);
            if (!holds_layer(m, l)) continue;
            *(int *)((char *)&m->layer[l] + leaves[k].off) = m->base.nslots;
            loom_slot *sl = add_slot(m, p, leaves[k].shard, false);
            bool qk = leaves[k].off == offsetof(loom_layer_slots, qn) ||
                      leaves[k].off == offsetof(loom_layer_slots, kn);
            /* replicated weights that see only this rank's heads (q/k norm) or,
             * under SP, only its tokens: their gradients are partial sums */
            sl->tp_partial = m->tp > 1 && sl->shard == LOOM_SHARD_NONE && (qk || m->sp);
        } else {
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan names unknown tensor %s",
                             p->name);
        }
    }
    if ((first && m->embed < 0) || (last && (m->final_norm < 0 || m->head < 0)))
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan lacks the embedding, final norm "
                         "or output layer");
    for (int64_t l = 0; l < m->L; l++) {
        const loom_layer_slots *ls = &m->layer[l];
        if (!holds_layer(m, l)) continue;
        if (ls->ln1 < 0 || ls->ln2 < 0 || ls->wq < 0 || ls->wk < 0 || ls->wv < 0 || ls->wo < 0 ||
            ls->wg < 0 || ls->wu < 0 || ls->wd < 0 || (m->cfg.qk_norm && (ls->qn < 0 || ls->kn < 0)))
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan lacks a tensor of layer %lld",
                             (long long)l);
    }
    return LOOM_OK;
}

/* Slots 64-byte aligned; buckets closed at slot boundaries once they hold
 * bucket_elems, each padded to a multiple of dp*cp. */
loom_status loom_arena_layout(loom_model *m, loom_arena *a, bool frozen) {
    loom_ctx *ctx = m->ctx;
    const size_t grp = (size_t)(m->dp * m->cp);
    a->bucket_off = loom_calloc(ctx, (size_t)a->nslots + 1, sizeof(size_t), "buckets");
    a->bucket_len = loom_calloc(ctx, (size_t)a->nslots + 1, sizeof(size_t), "buckets");
    if (!a->bucket_off || !a->bucket_len) return LOOM_ERR_OOM;
    size_t off = 0, b0 = 0;
    for (int i = 0; i < a->nslots; i++) {
        a->slots[i].off = off;
        off += (a->slots[i].numel + 15) & ~(size_t)15;
        if (off - b0 >= (size_t)m->bucket_elems || i == a->nslots - 1) {
            size_t len = (off - b0 + grp * 16 - 1) / (grp * 16) * (grp * 16);
            a->bucket_off[a->nbuckets] = b0;
            a->bucket_len[a->nbuckets++] = len;
            a->shard_numel += len / grp;
            off = b0 = b0 + len;
        }
    }
    a->nparams = off;
    a->w = loom_calloc(ctx, off ? off : 1, sizeof(float), "parameters");
    if (!frozen) a->g = loom_calloc(ctx, off ? off : 1, sizeof(float), "gradients");
    if (!a->w || (!frozen && !a->g)) return LOOM_ERR_OOM;
    return LOOM_OK;
}

void loom_arena_free(loom_arena *a) {
    free(a->slots);
    free(a->w);
    free(a->g);
    free(a->bucket_off);
    free(a->bucket_len);
    free(a->gshard);
    free(a->adam_m);
    free(a->adam_v);
    memset(a, 0, sizeof *a);
}

/* Reads this rank's block [row0, row0+rows) x [col0, col0+cols) of a
 * tensor's data (full shape sl->shape, dtype dt) as F32; rows past the
 * tensor's own are vocabulary padding, left as they are (zero). */
loom_status loom_slot_read(loom_ctx *ctx, const void *data, loom_dtype dt, const loom_slot *sl,
                           float *dst) {
    int64_t full_cols = sl->shape[1], esz = (int64_t)loom_dtype_size(dt);
    const char *base = data;
    for (int64_t r = 0; r < sl->rows; r++) {
        int64_t gr = sl->row0 + r;
        if (gr >= sl->shape[0]) break;
        loom_status st = loom_convert(ctx, dst + r * sl->cols, LOOM_F32,
                                      base + (gr * full_cols + sl->col0) * esz, dt,
                                      (size_t)sl->cols);
        if (st)
            return loom_err_prefix(ctx, "tensor '%s' (%s read as F32)", sl->name,
                                   loom_dtype_name(dt));
    }
    return LOOM_OK;
}

/* Reads this rank's blocks of every tensor; refuses missing tensors and
 * wrong shapes, reports the ones the model does not use. */
static loom_status load_weights(loom_model *m, const char *dir) {
    loom_ctx *ctx = m->ctx;
    loom_safetensors *st;
    loom_status s = loom_st_open_dir(ctx, dir, "model", &st);
    if (s) return s;
    m->file_dtype = LOOM_DTYPE_COUNT;
    /* every tensor the config implies must be there, whichever rank holds it */
    for (size_t i = 0; i < m->plan.n && !s; i++) {
        const loom_param_spec *p = &m->plan.p[i];
        const loom_st_tensor *t = loom_st_find(st, p->name);
        if (!t) {
            s = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                          "%s: the checkpoint has no tensor %s, which its config.json "
                          "(model_type %s, %lld layers) requires",
                          dir, p->name, m->cfg.model_type, (long long)m->L);
            break;
        }
        bool ok = t->ndim == p->ndim && t->shape[0] == p->shape[0] &&
                  (p->ndim == 1 || t->shape[1] == p->shape[1]);
        if (!ok) {
            char got[96] = "", want[64];
            for (int d = 0; d < t->ndim && d < 4; d++)
                snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "",
                         (long long)t->shape[d]);
            if (p->ndim == 2)
                snprintf(want, sizeof want, "%lld, %lld", (long long)p->shape[0],
                         (long long)p->shape[1]);
            else
                snprintf(want, sizeof want, "%lld", (long long)p->shape[0]);
            s = loom_errf(ctx, LOOM_ERR_SHAPE,
                          "%s: tensor %s has shape [%s], but config.json implies [%s]; "
                          "the checkpoint and its config.json do not belong together",
                          dir, p->name, got, want);
            break;
        }
        if (m->file_dtype == LOOM_DTYPE_COUNT) m->file_dtype = t->dtype;
    }
    for (int i = 0; i < m->base.nslots && !s; i++) {
        const loom_st_tensor *t = loom_st_find(st, m->base.slots[i].name);
        s = loom_slot_read(ctx, t->data, t->dtype, &m->base.slots[i],
                           m->base.w + m->base.slots[i].off);
    }
    if (!s && m->mesh->rank == 0) {
        size_t unused = 0;
        const char *first = NULL;
        for (size_t i = 0; i < loom_st_count(st); i++) {
            const char *name = loom_st_at(st, i)->name;
            size_t k = 0;
            while (k < m->plan.n && strcmp(m->plan.p[k].name, name)) k++;
            if (k < m->plan.n) continue;
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
    return loom_model_create_in(ctx, dir, opts, NULL, out);
}

/* world: the job's world group (borrowed), or NULL to make one. */
loom_status loom_model_create_in(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                                 loom_comm *world, loom_model **out) {
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
    loom_status st;
    if (world) {
        m->world = world;
    } else {
        if ((st = loom_comm_world(ctx, LOOM_COMM_AUTO, &m->world))) {
            free(m);
            return st;
        }
        m->own_world = true;
    }
    if ((st = load_config(ctx, dir, opts->config_overrides, &m->cfg))) goto fail;
    const loom_model_config *c = &m->cfg;
    if (c->num_experts > 0) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                       "%s: model_type %s (mixture of experts) cannot be trained by this version "
                       "of loom yet; dense qwen3, qwen2 and llama models can",
                       dir, c->model_type);
        goto fail;
    }
    loom_mesh_sizes want = {.tp = opts->tp, .cp = opts->cp, .dp = opts->dp, .pp = opts->pp,
                            .ep = opts->ep, .etp = opts->etp, .vpp = opts->vpp,
                            .sequence_parallel = opts->sequence_parallel != 0};
    loom_mesh_sizes n;
    if ((st = loom_mesh_sizes_resolve(ctx, &want, loom_comm_size(m->world), &n))) goto fail;
    if ((st = loom_mesh_check_model(ctx, &n, c))) goto fail;
    if ((st = loom_mesh_create(ctx, m->world, &n, &m->mesh))) goto fail;
    m->tp = n.tp;
    m->cp = n.cp;
    m->dp = n.dp;
    m->pp = n.pp;
    m->vpp = n.vpp;
    m->sp = n.sequence_parallel && n.tp > 1;
    m->bucket_elems = opts->bucket_elems > 0 ? opts->bucket_elems : 40000000;
    m->V = c->vocab_size;
    m->Vp = (c->vocab_size + pad * m->tp - 1) / (pad * m->tp) * (pad * m->tp);
    m->H = c->hidden_size;
    m->I = c->intermediate_size;
    m->L = c->num_layers;
    m->Hq = c->num_heads;
    m->Hkv = c->num_kv_heads;
    m->D = c->head_dim;
    m->Vl = m->Vp / m->tp;
    m->Il = m->I / m->tp;
    m->Hql = m->Hq / m->tp;
    m->Hkvl = m->Hkv / m->tp;
    if (m->D > LOOM_CPU_ATTN_MAX_D || m->D % 2) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: head_dim=%lld: loom needs an even head_dim "
                       "of at most %d", dir, (long long)m->D, LOOM_CPU_ATTN_MAX_D);
        goto fail;
    }
    m->attn_scale = (float)(1.0 / sqrt((double)m->D));
    if ((st = loom_param_plan_build(ctx, c, &m->plan))) goto fail;
    if ((st = build_slots(m))) goto fail;
    if ((st = loom_arena_layout(m, &m->base, false))) goto fail;
    m->inv_freq = loom_calloc(ctx, (size_t)(m->D / 2), sizeof(float), "rope frequencies");
    m->chunks = loom_calloc(ctx, (size_t)m->vpp, sizeof *m->chunks, "model chunks");
    if (!m->inv_freq || !m->chunks) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    int64_t Lc = m->L / (m->pp * m->vpp);
    for (int ci = 0; ci < m->vpp; ci++) {
        int64_t v = (int64_t)ci * m->pp + m->mesh->pp_rank;
        m->chunks[ci].l0 = v * Lc;
        m->chunks[ci].nl = Lc;
        m->chunks[ci].first = v == 0;
        m->chunks[ci].last = v == (int64_t)m->pp * m->vpp - 1;
    }
    loom_rope_inv_freq((int)c->rope_type, c->rope_theta, m->D, c->rope_factor,
                       c->rope_low_freq_factor, c->rope_high_freq_factor,
                       c->rope_original_max_pos, m->inv_freq);
    if ((st = load_weights(m, dir))) goto fail;
    m->opt = loom_optimizer_config_default();
    m->active = -1;
    *out = m;
    return LOOM_OK;
fail:
    loom_model_free(m);
    return st;
}

static void acts_free(loom_acts *a) {
    float **f[] = {&a->x,    &a->h1,   &a->h2,   &a->rstd1, &a->rstd2, &a->xmid,
                   &a->qpre, &a->kpre, &a->rstdq, &a->rstdk, &a->q,    &a->k,
                   &a->v,    &a->o,    &a->lse,  &a->gate,  &a->up,    &a->act,
                   &a->hf,   &a->rstdf, &a->dstash, &a->lora_u};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        free(*f[i]);
        *f[i] = NULL;
    }
}

static void buffers_free(loom_model *m) {
    for (int c = 0; m->chunks && c < m->vpp; c++) {
        for (int i = 0; i < m->chunks[c].npool; i++) acts_free(&m->chunks[c].pool[i]);
        free(m->chunks[c].pool);
        m->chunks[c].pool = NULL;
        m->chunks[c].npool = 0;
    }
    for (int i = 0; m->micro && i < m->cap_mb; i++) {
        free(m->micro[i].ids);
        free(m->micro[i].tgt);
        free(m->micro[i].pos);
        free(m->micro[i].cu);
    }
    free(m->micro);
    m->micro = NULL;
    m->cap_mb = 0;
    float **f[] = {&m->dx, &m->dtmp, &m->dfull, &m->dq, &m->dout, &m->dk,    &m->dv,
                   &m->dkl, &m->dvl, &m->kvblk, &m->dg, &m->du,   &m->logits, &m->lora_du, &m->lora_xd};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        free(*f[i]);
        *f[i] = NULL;
    }
    free(m->ce);
    free(m->perm);
    m->ce = NULL;
    m->perm = NULL;
    m->cap_T = 0;
    m->lora_r = 0;
}

static float *fbuf(loom_model *m, int64_t n, bool *fail) {
    if (n <= 0) return NULL;
    float *p = loom_malloc(m->ctx, (size_t)n * sizeof(float), "activations");
    if (!p) *fail = true;
    return p;
}

loom_status loom_model_reserve(loom_model *m, int64_t rows, int64_t seq, int nmb, int in_flight) {
    const int64_t T = rows * seq, Tc = T / m->cp, Tn = m->sp ? Tc / m->tp : Tc;
    const loom_adapter *ad = loom_model_lora(m);
    const int lr = ad ? ad->r : 0;
    bool same = T == m->cap_T && nmb <= m->cap_mb && m->chunks[0].npool >= in_flight &&
                lr == m->lora_r && (!ad || ad->dropout == 0 || m->lora_xd);
    m->T = T;
    m->Tc = Tc;
    m->Tn = Tn;
    if (same) return LOOM_OK;
    buffers_free(m);
    const int64_t H = m->H, Il = m->Il, QD = m->Hql * m->D, KD = m->Hkvl * m->D;
    bool fail = false, qkn = m->cfg.qk_norm;
    for (int c = 0; c < m->vpp; c++) {
        loom_chunk *ch = &m->chunks[c];
        const int64_t nl = ch->nl;
        ch->pool = loom_calloc(m->ctx, (size_t)in_flight, sizeof *ch->pool, "activations");
        if (!ch->pool) return LOOM_ERR_OOM;
        ch->npool = in_flight;
        for (int i = 0; i < in_flight; i++) {
            loom_acts *a = &ch->pool[i];
            a->mb = -1;
            a->x = fbuf(m, (nl + 1) * Tn * H, &fail);
            a->h1 = fbuf(m, nl * Tc * H, &fail);
            a->h2 = fbuf(m, nl * Tc * H, &fail);
            a->rstd1 = fbuf(m, nl * Tn, &fail);
            a->rstd2 = fbuf(m, nl * Tn, &fail);
            a->xmid = fbuf(m, nl * Tn * H, &fail);
            a->qpre = qkn ? fbuf(m, nl * Tc * QD, &fail) : NULL;
            a->kpre = qkn ? fbuf(m, nl * Tc * KD, &fail) : NULL;
            a->rstdq = qkn ? fbuf(m, nl * Tc * m->Hql, &fail) : NULL;
            a->rstdk = qkn ? fbuf(m, nl * Tc * m->Hkvl, &fail) : NULL;
            a->q = fbuf(m, nl * Tc * QD, &fail);
            a->k = fbuf(m, nl * T * KD, &fail);
            a->v = fbuf(m, nl * T * KD, &fail);
            a->o = fbuf(m, nl * Tc * QD, &fail);
            a->lse = fbuf(m, nl * Tc * m->Hql, &fail);
            a->gate = fbuf(m, nl * Tc * Il, &fail);
            a->up = fbuf(m, nl * Tc * Il, &fail);
            a->act = fbuf(m, nl * Tc * Il, &fail);
            a->lora_u = lr ? fbuf(m, nl * LOOM_LORA_NMOD * Tc * lr, &fail) : NULL;
            if (ch->last) {
                a->hf = fbuf(m, Tn * H, &fail);
                a->rstdf = fbuf(m, Tn, &fail);
                a->dstash = fbuf(m, Tn * H, &fail);
            }
        }
    }
    m->chunk_rows = (16 << 20) / m->Vl;
    if (m->chunk_rows < 1) m->chunk_rows = 1;
    if (m->chunk_rows > Tc) m->chunk_rows = Tc;
    m->dx = fbuf(m, Tc * H, &fail);
    m->dtmp = fbuf(m, Tc * H, &fail);
    m->dfull = fbuf(m, Tc * H, &fail);
    m->dq = fbuf(m, Tc * QD, &fail);
    m->dout = fbuf(m, Tc * QD, &fail);
    m->dk = fbuf(m, T * KD, &fail);
    m->dv = fbuf(m, T * KD, &fail);
    m->dkl = fbuf(m, Tc * KD, &fail);
    m->dvl = fbuf(m, Tc * KD, &fail);
    m->kvblk = fbuf(m, T * KD, &fail);
    m->dg = fbuf(m, Tc * Il, &fail);
    m->du = fbuf(m, Tc * Il, &fail);
    m->logits = fbuf(m, m->chunk_rows * m->Vl, &fail);
    m->lora_du = lr ? fbuf(m, Tc * lr, &fail) : NULL;
    int64_t maxin = H > m->Hql * m->D ? H : m->Hql * m->D;
    if (Il > maxin) maxin = Il;
    m->lora_xd = ad && ad->dropout > 0 ? fbuf(m, Tc * maxin, &fail) : NULL;
    m->ce = loom_malloc(m->ctx, (size_t)m->chunk_rows * 4 * sizeof(double), "loss buffers");
    m->perm = loom_malloc(m->ctx, (size_t)T * sizeof(int32_t), "token permutation");
    m->micro = loom_calloc(m->ctx, (size_t)nmb, sizeof *m->micro, "micro-batches");
    if (!m->ce || !m->perm || !m->micro) fail = true;
    for (int i = 0; !fail && i < nmb; i++) {
        loom_micro *u = &m->micro[i];
        u->ids = loom_malloc(m->ctx, (size_t)Tc * sizeof(int32_t), "micro-batch");
        u->tgt = loom_malloc(m->ctx, (size_t)Tc * sizeof(int32_t), "micro-batch");
        u->pos = loom_malloc(m->ctx, (size_t)Tc * sizeof(int32_t), "micro-batch");
        u->cu = loom_malloc(m->ctx, (size_t)(T + 1) * sizeof(int32_t), "micro-batch");
        if (!u->ids || !u->tgt || !u->pos || !u->cu) fail = true;
    }
    if (m->micro) m->cap_mb = nmb;
    if (fail) {
        buffers_free(m);
        return LOOM_ERR_OOM;
    }
    m->cap_T = T;
    m->lora_r = lr;
    return LOOM_OK;
}

void loom_model_free(loom_model *m) {
    if (!m) return;
    buffers_free(m);
    free(m->chunks);
    loom_adapters_free(m);
    loom_arena_free(&m->base);
    free(m->inv_freq);
    free(m->layer);
    loom_param_plan_free(&m->plan);
    loom_config_free(&m->cfg);
    loom_mesh_free(m->mesh);
    if (m->own_world) loom_comm_free(m->world);
    free(m);
}

int loom_model_rank(const loom_model *m) { return loom_comm_rank(m->world); }
int loom_model_world_size(const loom_model *m) { return loom_comm_size(m->world); }

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
    info->num_tensors = (int64_t)m->plan.n;
}

const char *loom_model_tensor_name(const loom_model *m, int64_t i, int *ndim, int64_t shape[2]) {
    if (i < 0 || i >= (int64_t)m->plan.n) return NULL;
    const loom_param_spec *p = &m->plan.p[i];
    if (ndim) *ndim = p->ndim;
    if (shape) {
        shape[0] = p->shape[0];
        shape[1] = p->ndim == 2 ? p->shape[1] : 0;
    }
    return p->name;
}

int loom_model_find_slot(const loom_model *m, const char *name) {
    for (int i = 0; i < m->base.nslots; i++)
        if (!m->base.slots[i].head_copy && !strcmp(m->base.slots[i].name, name)) return i;
    return -1;
}

/* The whole tensor `name` (rows x cols) on every rank: each rank that
 * should contributes its blocks of the arena (values, or gradients scaled)
 * to a zeroed buffer, summed over the world. Parameters are the same on
 * every dp*cp rank; gradients are summed over them. Replicated tensors count
 * once over tp unless their gradient is a partial sum; a tied embedding's
 * copy adds its gradient but not its value. */
loom_status loom_gather_full(loom_model *m, loom_arena *a, const char *name, int64_t rows,
                             int64_t cols, bool grads, float scale, float *dst) {
    const size_t n = (size_t)(rows * cols);
    memset(dst, 0, n * sizeof *dst);
    const loom_mesh *me = m->mesh;
    const float *base = grads ? a->g : a->w;
    for (int i = 0; base && i < a->nslots; i++) {
        const loom_slot *s = &a->slots[i];
        if (strcmp(s->name, name)) continue;
        if (!grads && (me->dp_rank || me->cp_rank || s->head_copy)) continue;
        if (s->shard == LOOM_SHARD_NONE && me->tp_rank && !(grads && s->tp_partial)) continue;
        const float *src = base + s->off;
        for (int64_t r = 0; r < s->rows && s->row0 + r < rows; r++)
            for (int64_t c = 0; c < s->cols; c++)
                dst[(s->row0 + r) * cols + s->col0 + c] += src[r * s->cols + c] * scale;
    }
    if (loom_comm_size(m->world) == 1) return LOOM_OK;
    return loom_comm_allreduce(m->world, dst, n, LOOM_F32, LOOM_RED_SUM);
}

/* Finds `name` among the base tensors or an adapter's; its arena and shape. */
loom_status loom_lora_find(loom_model *m, const char *name, loom_arena **a, char *key,
                           size_t cap, int64_t *rows, int64_t *cols);

static loom_status get_tensor(loom_model *m, const char *name, bool grads, float *dst,
                              int64_t n) {
    size_t pi = 0;
    while (pi < m->plan.n && strcmp(m->plan.p[pi].name, name)) pi++;
    loom_arena *a = &m->base;
    char key[512];
    const char *k = name;
    int64_t rows, cols;
    if (pi < m->plan.n) {
        rows = m->plan.p[pi].shape[0];
        cols = m->plan.p[pi].ndim == 2 ? m->plan.p[pi].shape[1] : 1;
    } else if (!strcmp(name, "lm_head.weight") && m->cfg.tie_word_embeddings) {
        return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND,
                         "lm_head.weight is tied to model.embed_tokens.weight in this model; "
                         "ask for that one");
    } else {
        loom_status st = loom_lora_find(m, name, &a, key, sizeof key, &rows, &cols);
        if (st) return st;
        k = key;
    }
    if (n != rows * cols)
        return loom_errf(m->ctx, LOOM_ERR_SHAPE, "%s holds %lld values, the buffer %lld", name,
                         (long long)(rows * cols), (long long)n);
    if (grads && !a->g)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "%s is frozen (the base model under LoRA): it has no gradient", name);
    if (grads && a != loom_model_trainable(m))
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "%s belongs to an adapter that is not active: it has no gradient", name);
    return loom_gather_full(m, a, k, rows, cols, grads,
                            grads ? (float)(1.0 / (double)m->acc_tokens) : 1.0f, dst);
}

loom_status loom_model_get_param(loom_model *m, const char *name, float *dst, int64_t n) {
    return get_tensor(m, name, false, dst, n);
}

loom_status loom_model_get_grad(loom_model *m, const char *name, float *dst, int64_t n) {
    if (m->acc_tokens <= 0)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "no gradient: no token with a target was run through forward_backward "
                         "since the last step");
    return get_tensor(m, name, true, dst, n);
}

loom_status loom_model_save_hf(loom_model *m, const char *dir, loom_dtype dtype,
                               uint64_t max_shard_bytes) {
    loom_ctx *ctx = m->ctx;
    const bool writer = m->mesh->rank == 0;
    if (dtype == LOOM_DTYPE_COUNT) dtype = m->file_dtype;
    if (dtype != LOOM_F32 && dtype != LOOM_BF16 && dtype != LOOM_F16)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "weights can be saved as F32, BF16 or F16, not %s", loom_dtype_name(dtype));
    if (!max_shard_bytes) max_shard_bytes = 5000000000ull;
    loom_status st = LOOM_OK;
    loom_st_writer *w = NULL;
    if (writer) {
        if ((st = loom_mkdirs(ctx, dir))) return st;
        loom_json *meta = loom_json_new_object(ctx);
        if (!meta) return LOOM_ERR_OOM;
        if (!(st = loom_json_set(ctx, meta, "format", loom_json_new_str(ctx, "pt"))))
            st = loom_st_writer_create(ctx, dir, "model", max_shard_bytes, meta, &w);
        loom_json_free(meta);
        for (size_t i = 0; i < m->plan.n && !st; i++)
            st = loom_st_writer_declare(ctx, w, m->plan.p[i].name, dtype, m->plan.p[i].ndim,
                                        m->plan.p[i].shape);
    }
    /* every rank takes part in each gather, whatever rank 0's state */
    float *buf = NULL;
    size_t cap = 0;
    for (size_t i = 0; i < m->plan.n; i++) {
        const loom_param_spec *p = &m->plan.p[i];
        size_t n = (size_t)(p->shape[0] * (p->ndim == 2 ? p->shape[1] : 1));
        if (n > cap) {
            float *nb = realloc(buf, n * sizeof *buf);
            if (!nb) {
                free(buf);
                loom_st_writer_free(w);
                return loom_errf(ctx, LOOM_ERR_OOM, "out of memory gathering %s", p->name);
            }
            buf = nb;
            cap = n;
        }
        loom_status gs = loom_model_get_param(m, p->name, buf, (int64_t)n);
        if (gs) {
            free(buf);
            loom_st_writer_free(w);
            return gs;
        }
        if (writer && !st) st = loom_st_writer_write(ctx, w, p->name, LOOM_F32, buf);
    }
    free(buf);
    if (writer) {
        if (!st) st = loom_st_writer_finish(ctx, w);
        loom_st_writer_free(w);
        if (!st) st = loom_config_save(ctx, &m->cfg, dir, dtype);
    }
    return st;
}
