/* loom_model: creation from an HF directory (config overrides, weight
 * loading with every tensor checked), activation buffers, HF export. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../backend/cpu/cpu_ops.h"
#include "../io/export.h"
#include "../io/safetensors.h"
#include "../parallel/schedule.h"
#include "loss.h"
#include "model.h"
#include "moe_dedup.h"
#include "moe_tabs.h"
#include "prof.h"

void loom_model_options_default(loom_model_options *o) {
    memset(o, 0, sizeof *o);
    o->dtype = LOOM_F32;
    o->vocab_pad_multiple = 128;
}

/* Does this rank hold global layer l? */
static bool holds_layer(const loom_model *m, int64_t l) {
    int64_t Lc = m->L / (m->pp * m->vpp), v = l / Lc;
    return v % m->pp == m->mesh->pp_rank;
}

/* Adds a slot to arena a (its slots array has room) for a tensor of full
 * shape rows x cols (1-D: cols 1; vocab: rows padded) with the given
 * sharding: over tp, or an expert's over etp. */
loom_slot *loom_slot_add(loom_model *m, loom_arena *a, const char *name, int64_t rows,
                         int64_t cols, int ndim, loom_shard shard, bool vocab, bool expert) {
    loom_slot *sl = &a->slots[a->nslots++];
    sl->name = (char *)name;
    sl->ndim = ndim;
    sl->shape[0] = rows;
    sl->shape[1] = cols;
    sl->shard = shard;
    sl->decay = ndim >= 2;
    sl->expert = expert;
    int64_t held = vocab ? m->Vp : rows;
    const int parts = expert ? m->etp : m->tp, r = expert ? m->mesh->etp_rank : m->mesh->tp_rank;
    sl->rows = held;
    sl->cols = cols;
    if (shard == LOOM_SHARD_ROWS) {
        sl->rows = held / parts;
        sl->row0 = r * sl->rows;
    } else if (shard == LOOM_SHARD_COLS) {
        sl->cols = cols / parts;
        sl->col0 = r * sl->cols;
    }
    sl->numel = (size_t)(sl->rows * sl->cols);
    sl->nruns = 1;
    sl->run0[0] = sl->row0;
    sl->runn[0] = sl->rows;
    return sl;
}

void loom_slot_row_parts(loom_model *m, loom_slot *sl, int nparts, const int64_t *part) {
    if (sl->shard != LOOM_SHARD_ROWS || nparts < 2) return;
    const int parts = sl->expert ? m->etp : m->tp;
    const int r = sl->expert ? m->mesh->etp_rank : m->mesh->tp_rank;
    int64_t at = 0;
    sl->rows = 0;
    for (int k = 0; k < nparts; k++) {
        sl->runn[k] = part[k] / parts;
        sl->run0[k] = at + r * sl->runn[k];
        sl->rows += sl->runn[k];
        at += part[k];
    }
    sl->nruns = nparts;
    sl->row0 = sl->run0[0];
    sl->numel = (size_t)(sl->rows * sl->cols);
}

static loom_slot *add_slot(loom_model *m, const loom_param_spec *p, loom_shard shard, bool vocab) {
    loom_slot *sl = loom_slot_add(m, &m->base, p->name, p->shape[0],
                                  p->ndim == 2 ? p->shape[1] : 1, p->ndim, shard, vocab,
                                  p->expert >= 0);
    loom_slot_row_parts(m, sl, p->nparts, p->part);
    return sl;
}

/* A layer tensor's slot (its block's input norm, or one of the kind's
 * tensors) when this rank holds the layer. */
static loom_status layer_slot(loom_model *m, const loom_param_spec *p) {
    loom_layer *L = &m->layer[p->layer];
    loom_block *b = &L->b[p->block];
    const loom_block_kind *k = b->kind;
    if (!L->held) return LOOM_OK;
    /* an expert: only this ep rank's E/ep, split over etp */
    const int64_t El = m->cfg.num_experts / m->ep, e0 = (int64_t)m->mesh->ep_rank * El;
    if (p->expert >= 0 && (p->expert < e0 || p->expert >= e0 + El)) return LOOM_OK;
    const loom_block_slot none = {NULL, LOOM_COMP_NORM, LOOM_SHARD_NONE, false, LOOM_INIT_SHAPE};
    const loom_block_slot *ks = p->slot == LOOM_SLOT_NORM ? &none : &k->slots[p->slot];
    int *at = p->slot == LOOM_SLOT_NORM ? &b->norm : &b->w[p->slot];
    if (*at < 0) *at = m->base.nslots; /* an expert's: the first local expert's, the rest follow */
    loom_slot *sl = add_slot(m, p, ks->shard, false); /* an expert's: split over etp */
    if (sl->expert) return LOOM_OK;
    /* replicated weights that see only this rank's heads (q/k norm) or,
     * under SP, only its tokens: their gradients are partial sums */
    sl->tp_partial = m->tp > 1 && sl->shard == LOOM_SHARD_NONE && (ks->headwise || m->sp);
    return LOOM_OK;
}

/* Every held layer has its blocks' norms and linears. */
static loom_status layers_check(const loom_model *m) {
    for (int64_t l = 0; l < m->L; l++) {
        const loom_layer *L = &m->layer[l];
        bool ok = true;
        for (int j = 0; L->held && j < L->nb; j++) ok = ok && L->b[j].norm >= 0;
        for (int n = 0; L->held && n < L->nlin; n++) {
            const loom_block *b = &L->b[L->lin[n].b];
            ok = ok && (!L->lin[n].out || b->w[b->kind->lin[L->lin[n].k].w] >= 0); /* or absent */
        }
        if (!ok)
            return loom_errf(m->ctx, LOOM_ERR_INTERNAL,
                             "parameter plan lacks a tensor of layer %lld", (long long)l);
    }
    return LOOM_OK;
}

/* The layer table and the slots this rank holds, laid out in buckets (each
 * padded to a multiple of the dp*cp group) in the flat buffers. */
loom_status loom_model_build_slots(loom_model *m) {
    loom_ctx *ctx = m->ctx;
    m->base.slots = loom_calloc(ctx, m->plan.n + 1, sizeof *m->base.slots, "parameter slots");
    m->layer = loom_calloc(ctx, (size_t)m->L, sizeof *m->layer, "layer table");
    if (!m->base.slots || !m->layer) return LOOM_ERR_OOM;
    if (m->cfg.num_experts > 0 && !m->moe_load &&
        !(m->moe_load = loom_calloc(ctx, (size_t)(2 * m->L * m->cfg.num_experts), sizeof(double),
                                    "expert load")))
        return LOOM_ERR_OOM;
    CK(loom_layers_build(ctx, &m->cfg, &m->plan, m->layer));
    for (int64_t l = 0; l < m->L; l++) m->layer[l].held = holds_layer(m, l);
    m->embed = m->final_norm = m->head = -1;
    const bool first = m->mesh->pp_rank == 0, last = m->mesh->pp_rank == m->pp - 1;
    const bool tied = m->cfg.tie_word_embeddings;
    for (size_t i = 0; i < m->plan.n; i++) {
        const loom_param_spec *p = &m->plan.p[i];
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
        } else if (p->block >= 0 && p->layer >= 0 && p->layer < m->L) {
            CK(layer_slot(m, p));
        } else {
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan names unknown tensor %s",
                             p->name);
        }
    }
    if ((first && m->embed < 0) || (last && (m->final_norm < 0 || m->head < 0)))
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "parameter plan lacks the embedding, final norm "
                         "or output layer");
    return layers_check(m);
}

/* Reads this rank's block [row0, row0+rows) x [col0, col0+cols) of a
 * tensor's data (full shape sl->shape, dtype dt) as F32; rows past the
 * tensor's own are vocabulary padding, left as they are (zero). */
loom_status loom_slot_read(loom_ctx *ctx, const void *data, loom_dtype dt, const loom_slot *sl,
                           float *dst) {
    int64_t full_cols = sl->shape[1], esz = (int64_t)loom_dtype_size(dt);
    const char *base = data;
    for (int64_t r = 0; r < sl->rows; r++) {
        int64_t gr = loom_slot_grow(sl, r);
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

/* This rank's block of a slot, copied as it is (the checkpoint's dtype is
 * the compute dtype) into the device at dev: straight from the mapping when
 * the block is whole consecutive rows, else through host rows. */
static loom_status slot_upload(loom_model *m, const loom_st_tensor *t, const loom_slot *sl,
                               void *dev, char **rows, size_t *rows_cap) {
    const size_t esz = m->dev.esz, full_cols = (size_t)sl->shape[1];
    const int64_t nr = sl->row0 >= sl->shape[0] ? 0
                       : sl->rows < sl->shape[0] - sl->row0 ? sl->rows
                                                            : sl->shape[0] - sl->row0;
    const char *src = (const char *)t->data + (size_t)sl->row0 * full_cols * esz;
    const size_t bytes = (size_t)nr * (size_t)sl->cols * esz; /* rows past: padding, zero */
    if ((size_t)sl->cols == full_cols && sl->nruns == 1) return loom_k_upload(m, dev, src, bytes);
    if (*rows_cap < bytes) {
        char *r = realloc(*rows, bytes);
        if (!r) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the rows of %s", sl->name);
        *rows = r;
        *rows_cap = bytes;
    }
    for (int64_t r = 0; r < nr; r++)
        memcpy(*rows + (size_t)r * sl->cols * esz,
               (const char *)t->data +
                   ((size_t)loom_slot_grow(sl, r) * full_cols + sl->col0) * esz,
               (size_t)sl->cols * esz);
    return loom_k_upload(m, dev, *rows, bytes);
}

/* The base arena's values from the checkpoint. A GPU model whose every
 * tensor is stored in its compute dtype gets them straight into its compute
 * copy (no fp32 copy anywhere: a frozen 30B base never needs 122 GB of host
 * memory); the fp32 master is widened from it, exactly, if the base is ever
 * trained (w_in_wc). Otherwise an fp32 master in host memory, committed by
 * the caller. */
static loom_status fill_base(loom_model *m, const loom_safetensors *st) {
    loom_arena *a = &m->base;
    bool direct = m->dev.cuda && m->dev.adt != LOOM_F32;
    for (int i = 0; i < a->nslots && direct; i++)
        direct = loom_st_find(st, a->slots[i].name)->dtype == m->dev.adt;
    const size_t n = a->nparams ? a->nparams : 1;
    loom_status s;
    if (!direct) {
        if (!(a->w = loom_calloc(m->ctx, n, sizeof(float), "parameters"))) return LOOM_ERR_OOM;
        for (int i = 0; i < a->nslots; i++) {
            const loom_st_tensor *t = loom_st_find(st, a->slots[i].name);
            if ((s = loom_slot_read(m->ctx, t->data, t->dtype, &a->slots[i], a->w + a->slots[i].off)))
                return s;
        }
        return LOOM_OK;
    }
    if ((s = loom_dev_alloc(m, &a->wc, n * m->dev.esz, "parameters (compute copy)"))) return s;
    a->w_in_wc = true;
    char *rows = NULL;
    size_t cap = 0;
    for (int i = 0; i < a->nslots && !s; i++)
        s = slot_upload(m, loom_st_find(st, a->slots[i].name), &a->slots[i],
                        (char *)a->wc + a->slots[i].off * m->dev.esz, &rows, &cap);
    free(rows);
    return s;
}

/* Reads this rank's blocks of every tensor; refuses missing tensors and
 * wrong shapes, reports the ones the model does not use. */
static loom_status load_weights(loom_model *m, const char *dir) {
    loom_ctx *ctx = m->ctx;
    loom_safetensors *st;
    loom_status s = loom_hf_dir_open(ctx, dir, &st);
    if (s) return s;
    m->experts_fused = loom_hf_dir_experts_fused(st); /* saved in the layout read */
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
    if (!s) s = fill_base(m, st);
    if (!s && m->mesh->rank == 0) {
        size_t unused = 0, carried = 0;
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
            /* a vision-language checkpoint's vision tower and mtp head: not
             * trained, written back as read (save_hf) */
            if (m->cfg.nested_text && (!strncmp(name, "model.visual.", 13) ||
                                       !strncmp(name, "mtp.", 4))) {
                carried++;
                continue;
            }
            if (!unused++) first = name;
        }
        if (carried)
            LOOM_LOG_I(ctx, "%s: %zu tensors of the vision tower and the mtp head are not trained; "
                       "save_hf writes them back as read", dir, carried);
        if (unused)
            LOOM_LOG_W(ctx, "%s: %zu tensor%s of the checkpoint %s not used by the model (%s%s)",
                       dir, unused, unused == 1 ? "" : "s", unused == 1 ? "is" : "are", first,
                       unused > 1 ? ", ..." : "");
    }
    loom_st_close(st);
    return s;
}

/* The mesh sizes and the model's shapes, whole and per tensor-parallel rank
 * (the vocabulary padded to a multiple of pad * tp). */
void loom_model_set_sizes(loom_model *m, const loom_mesh_sizes *n, const loom_model_config *c,
                      int64_t pad) {
    m->tp = n->tp;
    m->cp = n->cp;
    m->dp = n->dp;
    m->pp = n->pp;
    m->vpp = n->vpp;
    m->ep = n->ep > 0 ? n->ep : 1;
    m->etp = n->etp > 0 ? n->etp : n->tp;
    m->edp = n->tp * n->cp * n->dp / (m->ep * m->etp);
    m->sp = n->sequence_parallel && n->tp > 1;
    m->V = c->vocab_size;
    m->Vp = (c->vocab_size + pad * m->tp - 1) / (pad * m->tp) * (pad * m->tp);
    m->H = c->hidden_size;
    m->I = c->intermediate_size;
    m->L = c->num_layers;
    m->Hq = c->num_heads;
    m->Hkv = c->num_kv_heads;
    m->D = c->head_dim;
    m->rd = c->rotary_dim > 0 ? c->rotary_dim : c->head_dim;
    m->norm_off = c->norm_offset ? 1.0f : 0.0f;
    m->Vl = m->Vp / m->tp;
    m->Il = m->I / m->tp;
    m->Hql = m->Hq / m->tp;
    m->Hkvl = m->Hkv / m->tp;
}

/* A GPU model's world: NCCL when it has several ranks. */
static loom_status check_gpu_world(loom_model *m) {
    const char *be = loom_comm_backend_name(m->world);
    if (loom_comm_size(m->world) > 1 && strcmp(be, "nccl"))
        return loom_errf(m->ctx, LOOM_ERR_UNSUPPORTED,
                         "GPU ranks talk over NCCL, but this job's %d ranks were set up with %s "
                         "(create the world with LOOM_COMM_NCCL; `loom train --device cuda` does)",
                         loom_comm_size(m->world), be);
    return LOOM_OK;
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
    const bool cuda = opts->device == LOOM_DEVICE_CUDA;
    if (!cuda && opts->dtype != LOOM_F32)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "compute dtype %s: the CPU backend computes in F32; bf16 and fp16 "
                         "run on GPUs (--device cuda)",
                         loom_dtype_name(opts->dtype));
    if (cuda && opts->dtype != LOOM_F32 && opts->dtype != LOOM_BF16 && opts->dtype != LOOM_F16)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "compute dtype %s: use bf16 (the default on GPUs), fp16 or fp32",
                         loom_dtype_name(opts->dtype));
    if (!loom_backend_for(ctx, cuda)) return LOOM_ERR_UNSUPPORTED;
    int64_t pad = opts->vocab_pad_multiple ? opts->vocab_pad_multiple : 128;
    if (pad < 1 || pad > (1 << 20))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "vocab_pad_multiple=%lld: use a positive multiple such as 128",
                         (long long)pad);
    loom_model *m = loom_calloc(ctx, 1, sizeof *m, "model");
    if (!m) return LOOM_ERR_OOM;
    m->ctx = ctx;
    loom_path_name(dir, m->dir_name, sizeof m->dir_name);
    loom_status st;
    if (world) {
        m->world = world;
    } else {
        if ((st = loom_comm_world(ctx, cuda ? LOOM_COMM_NCCL : LOOM_COMM_AUTO, &m->world))) {
            free(m);
            return st;
        }
        m->own_world = true;
    }
    m->dev.cuda = cuda;
    m->dev.adt = opts->dtype;
    m->dev.device = loom_comm_device(m->world); /* the world's GPU for this rank, -1: any */
    if (cuda && (st = check_gpu_world(m))) goto fail;
    if ((st = loom_dev_init(m))) goto fail;
    if (!(m->src_dir = loom_strdup(ctx, dir))) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    if ((st = loom_config_load_with(ctx, dir, opts->config_overrides, &m->cfg))) goto fail;
    if (opts->config_overrides && *opts->config_overrides &&
        !(m->overrides = loom_strdup(ctx, opts->config_overrides))) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    const loom_model_config *c = &m->cfg;
    if (c->num_experts > LOOM_MOE_MAX_EXPERTS) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: %lld experts; loom takes at most %d", dir,
                       (long long)c->num_experts, LOOM_MOE_MAX_EXPERTS);
        goto fail;
    }
    loom_mesh_sizes want = {.tp = opts->tp, .cp = opts->cp, .dp = opts->dp, .pp = opts->pp,
                            .ep = opts->ep, .etp = opts->etp, .vpp = opts->vpp,
                            .vpp_group = opts->microbatch_group,
                            .sequence_parallel = opts->sequence_parallel != 0};
    loom_mesh_sizes n;
    if ((st = loom_mesh_sizes_resolve(ctx, &want, loom_comm_size(m->world), &n))) goto fail;
    if ((st = loom_mesh_check_model(ctx, &n, c))) goto fail;
    if ((st = loom_mesh_create(ctx, m->world, &n, &m->mesh))) goto fail;
    loom_model_set_sizes(m, &n, c, pad);
    m->bucket_elems = opts->bucket_elems > 0 ? opts->bucket_elems : 40000000;
    if (opts->recompute < LOOM_RECOMPUTE_NONE || opts->recompute > LOOM_RECOMPUTE_FULL) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "recompute = %d: use LOOM_RECOMPUTE_NONE, _MLP or _FULL", (int)opts->recompute);
        goto fail;
    }
    m->recompute = opts->recompute;
    if (opts->moe_aux != LOOM_MOE_AUX_GLOBAL && opts->moe_aux != LOOM_MOE_AUX_PER_LAYER) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "moe_aux = %d: use LOOM_MOE_AUX_GLOBAL or LOOM_MOE_AUX_PER_LAYER",
                       opts->moe_aux);
        goto fail;
    }
    m->moe_aux = (loom_moe_aux)opts->moe_aux;
    if (!(opts->moe_z_loss_coeff >= 0.0) || !isfinite(opts->moe_z_loss_coeff)) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "moe_z_loss_coeff = %g: the router z-loss's coefficient is a finite number "
                       ">= 0 (0: off; Megatron suggests 1e-3)",
                       opts->moe_z_loss_coeff);
        goto fail;
    }
    m->moe_z_coef = opts->moe_z_loss_coeff;
    if (!(opts->moe_expert_capacity_factor >= 0.0) || !isfinite(opts->moe_expert_capacity_factor)) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "moe_expert_capacity_factor = %g: the experts' capacity factor is a finite "
                       "number > 0 (1.0: each expert keeps up to its even share of a router "
                       "call's choices), or 0 for dropless routing",
                       opts->moe_expert_capacity_factor);
        goto fail;
    }
    m->moe_cap_factor = opts->moe_expert_capacity_factor;
    if (opts->moe_token_drop_policy != LOOM_MOE_DROP_PROBS &&
        opts->moe_token_drop_policy != LOOM_MOE_DROP_POSITION) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "moe_token_drop_policy = %d: use LOOM_MOE_DROP_PROBS (drop the choices of "
                       "the lowest weight) or LOOM_MOE_DROP_POSITION (of the latest tokens)",
                       opts->moe_token_drop_policy);
        goto fail;
    }
    m->moe_drop = (loom_moe_drop)opts->moe_token_drop_policy;
    m->moe_force_balance = opts->moe_router_force_load_balancing != 0;
    m->moe_dedup = loom_moe_dedup_wanted();
    if (opts->profile && (st = loom_prof_new(m))) goto fail;
    const char *dd = getenv("LOOM_MOE_DEDUP");
    if (m->cfg.num_experts > 0 && dd && strcmp(dd, "0") && strcmp(dd, "1"))
        LOOM_LOG_W(ctx, "LOOM_MOE_DEDUP=%s: use 1 (the expert dispatch sends a row once per rank, "
                        "the default) or 0 (once per choice); sending once per rank", dd);
    else if (dd && !strcmp(dd, "1") && m->cfg.num_experts > 0 && !(m->ep == 1 && m->etp == m->tp) &&
             (m->etp > 1 || m->moe_cap_factor > 0.0))
        LOOM_LOG_I(ctx, "LOOM_MOE_DEDUP=1: the expert dispatch sends rows once per choice here "
                        "(once per rank needs etp 1 and dropless routing; this mesh has etp %d%s)",
                   m->etp, m->moe_cap_factor > 0.0 ? " and a capacity factor" : "");
    if (m->D > LOOM_CPU_ATTN_MAX_D || m->D % 2) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: head_dim=%lld: loom needs an even head_dim "
                       "of at most %d", dir, (long long)m->D, LOOM_CPU_ATTN_MAX_D);
        goto fail;
    }
    if (m->D > m->dev.be->attn_max_d) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: head_dim=%lld: the %s attention takes "
                       "head_dim up to %d", dir, (long long)m->D, cuda ? "GPU" : "CPU",
                       m->dev.be->attn_max_d);
        goto fail;
    }
    m->attn_scale = (float)(1.0 / sqrt((double)m->D));
    m->loss = loom_loss_cross_entropy();
    if ((st = loom_param_plan_build(ctx, c, &m->plan))) goto fail;
    if ((st = loom_model_build_slots(m))) goto fail;
    /* the base's gradients come with its first forward_backward (a LoRA run
     * never allocates them) */
    if ((st = loom_arena_place(m, &m->base))) goto fail;
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
    loom_rope_inv_freq((int)c->rope_type, c->rope_theta, m->rd, c->rope_factor,
                       c->rope_low_freq_factor, c->rope_high_freq_factor,
                       c->rope_original_max_pos, m->inv_freq);
    if ((st = load_weights(m, dir))) goto fail;
    if (m->base.w && (st = loom_arena_commit_ex(m, &m->base, true))) goto fail;
    m->d_inv_freq = m->inv_freq;
    if (cuda) {
        size_t b = (size_t)(m->D / 2) * sizeof(float);
        if ((st = loom_dev_alloc(m, (void **)&m->d_inv_freq, b, "rope frequencies")) ||
            (st = loom_k_upload(m, m->d_inv_freq, m->inv_freq, b)))
            goto fail;
    }
    m->opt = loom_optimizer_config_default();
    m->active = -1;
    /* fp16: dynamic loss scaling, halved on overflow, doubled after 2000
     * good steps (torch's GradScaler rule). The backward here starts from
     * the gradient of the SUM of token losses (each logit's gradient up to
     * the scale itself), where torch's starts from the mean over N tokens,
     * so the start is 2^10 rather than torch's 2^16: a logit gradient of
     * 65536 would already overflow fp16. */
    m->loss_scale = m->dev.adt == LOOM_F16 ? 1024.0 : 1.0;
    *out = m;
    return LOOM_OK;
fail:
    loom_model_free(m);
    return st;
}

/* Rows of the output layer's logits computed at a time (of Tc): 16M
 * elements on CPU; on a GPU 640M (1.2 GiB of bf16 at most), so that the
 * output layer's GEMMs are few and tall (the weight gradient's fp32 output
 * is read and written once per block: two blocks of 4096 tokens made Qwen3-
 * 0.6B's step 1.9% faster than five of 1766). Blocks of equal size. */
int64_t loom_loss_block_rows(bool cuda, int64_t Vl, int64_t Tc) {
    int64_t r = ((int64_t)(cuda ? 640 : 16) << 20) / Vl;
    if (r < 1) r = 1;
    if (r >= Tc) return Tc;
    const int64_t n = (Tc + r - 1) / r;
    return (Tc + n - 1) / n;
}

static void buffers_free(loom_model *m) {
    for (int c = 0; m->chunks && c < m->vpp; c++) {
        for (int i = 0; i < m->chunks[c].npool; i++) free(m->chunks[c].pool[i].lay);
        free(m->chunks[c].pool);
        m->chunks[c].pool = NULL;
        m->chunks[c].npool = 0;
    }
    for (int i = 0; m->micro && i < m->cap_micro; i++) {
        free(m->micro[i].ids);
        free(m->micro[i].tgt);
        free(m->micro[i].pos);
        free(m->micro[i].cu);
        free(m->micro[i].wt_buf);
        free(m->micro[i].aux);
        free(m->micro[i].aux_g);
    }
    free(m->micro);
    m->micro = NULL;
    m->cap_micro = 0;
    for (int id = 0; id < LOOM_NKINDS; id++) {
        free(m->host_scratch[id]);
        m->host_scratch[id] = NULL;
    }
    loom_dev_free(m, m->act_mem);
    m->act_mem = NULL;
    m->act_bytes = 0;
    if (m->ce_h != m->ce) free(m->ce_h);
    m->ce = m->ce_h = NULL;
    free(m->logits_h);
    m->logits_h = NULL;
    if (m->dev.cuda) loom_dev_free(m, m->d_wt);
    m->d_wt = NULL;
    free(m->perm);
    m->perm = m->d_perm = NULL;
    free(m->pp_stage);
    m->pp_stage = NULL;
    m->npp_stage = 0;
    m->cap_T = 0;
    m->lora_r = 0;
}

loom_status loom_model_reserve(loom_model *m, int64_t micro_batch_size, int64_t seq, int n_micro,
                               int in_flight, int pp_slots) {
    const int64_t T = micro_batch_size * seq, Tc = T / m->cp, Tn = m->sp ? Tc / m->tp : Tc;
    const loom_adapter *ad = loom_model_lora(m);
    const int lr = ad ? ad->r : 0;
    const bool dropout = ad && ad->dropout > 0;
    if (m->pp > 1 && pp_slots < 1) pp_slots = 1; /* pp_connect's one element */
    if (m->pp == 1) pp_slots = 0;
    if (m->cfg.num_experts > 0 && !(m->ep == 1 && m->etp == m->tp) && Tc % m->tp)
        return loom_errf(m->ctx, LOOM_ERR_CONFIG,
                         "a micro-batch of %lld tokens (%lld per cp rank) does not split over "
                         "tp=%d: with ep=%d, etp=%d each tp rank routes its share of the tokens; "
                         "use a seq_len or micro_batch_size that makes it divide",
                         (long long)T, (long long)Tc, m->tp, m->ep, m->etp);
    bool same = T == m->cap_T && n_micro <= m->cap_micro && m->chunks[0].npool >= in_flight &&
                m->npp_stage >= pp_slots &&
                lr == m->lora_r && (!dropout || m->lora_xd);
    m->T = T;
    m->Tc = Tc;
    m->Tn = Tn;
    if (same) return LOOM_OK;
    buffers_free(m);
    loom_ctx *ctx = m->ctx;
    m->chunk_rows = loom_loss_block_rows(m->dev.cuda, m->Vl, Tc);
    bool fail = false;
    for (int c = 0; c < m->vpp; c++) {
        loom_chunk *ch = &m->chunks[c];
        ch->pool = loom_calloc(ctx, (size_t)in_flight, sizeof *ch->pool, "activations");
        if (!ch->pool) fail = true;
        ch->npool = ch->pool ? in_flight : 0;
        for (int i = 0; i < ch->npool; i++) {
            ch->pool[i].mb = -1;
            ch->pool[i].lay = loom_calloc(ctx, (size_t)ch->nl, sizeof *ch->pool[i].lay, "activations");
            if (!ch->pool[i].lay) fail = true;
        }
    }
    m->micro = loom_calloc(ctx, (size_t)n_micro, sizeof *m->micro, "micro-batches");
    if (m->micro) m->cap_micro = n_micro;
    m->npp_stage = pp_slots;
    if (m->npp_stage) {
        m->pp_stage = loom_calloc(ctx, (size_t)m->npp_stage, sizeof *m->pp_stage, "pipeline");
        if (!m->pp_stage) fail = true;
    }
    m->perm = loom_malloc(ctx, (size_t)T * sizeof(int32_t), "token permutation");
    if (!m->micro || !m->perm) fail = true;
    for (int i = 0; !fail && i < n_micro; i++) {
        loom_micro *u = &m->micro[i];
        u->ids = loom_malloc(ctx, (size_t)Tc * sizeof(int32_t), "micro-batch");
        u->tgt = loom_malloc(ctx, (size_t)Tc * sizeof(int32_t), "micro-batch");
        u->pos = loom_malloc(ctx, (size_t)Tc * sizeof(int32_t), "micro-batch");
        u->cu = loom_malloc(ctx, (size_t)(T + 1) * sizeof(int32_t), "micro-batch");
        if (!u->ids || !u->tgt || !u->pos || !u->cu) fail = true;
        const size_t naux = loom_moe_aux_len(m);
        if (naux && !(u->aux = loom_calloc(ctx, naux, sizeof(double), "micro-batch")))
            fail = true;
        if (naux && !(u->aux_g = loom_calloc(ctx, loom_moe_grad_len(m), sizeof(float),
                                             "micro-batch")))
            fail = true;
    }
    for (int id = 0; !fail && id < LOOM_NKINDS; id++) {
        const loom_block_kind *k = loom_block_kinds[id];
        const size_t hb = k->host ? k->host(m) : 0;
        if (hb && !(m->host_scratch[id] = loom_malloc(ctx, hb, "host scratch"))) fail = true;
    }
    if (fail) {
        buffers_free(m);
        return LOOM_ERR_OOM;
    }
    m->lora_r = lr; /* the kinds size their LoRA buffers by it */
    loom_carve c = {0};
    loom_acts_layout(m, &c, T, Tc, Tn, n_micro, in_flight, lr, dropout);
    loom_status st = loom_dev_alloc(m, &m->act_mem, c.used, "activations");
    if (st) {
        char b[32];
        buffers_free(m);
        return loom_err_prefix(ctx, "activations of %lld x %lld-token micro-batches (%s)",
                               (long long)micro_batch_size, (long long)seq,
                               loom_fmt_bytes(b, c.used));
    }
    m->act_bytes = c.used;
    c = (loom_carve){.base = m->act_mem};
    loom_acts_layout(m, &c, T, Tc, Tn, n_micro, in_flight, lr, dropout);
    if (m->dev.cuda) {
        m->ce_h = loom_malloc(ctx, (size_t)Tc * 4 * sizeof(double), "loss buffers");
        if (!m->ce_h) {
            buffers_free(m);
            return LOOM_ERR_OOM;
        }
    } else {
        m->ce_h = m->ce;
        m->d_perm = m->perm;
        for (int i = 0; i < n_micro; i++) {
            loom_micro *u = &m->micro[i];
            u->d_ids = u->ids;
            u->d_tgt = u->tgt;
            u->d_pos = u->pos;
            u->d_cu = u->cu;
            u->d_aux_g = u->aux_g;
            u->d_aux = u->aux;
        }
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
    loom_arena_free(m, &m->base);
    if (m->d_inv_freq != m->inv_freq) loom_dev_free(m, m->d_inv_freq);
    free(m->inv_freq);
    loom_dev_release(m);
    free(m->layer);
    free(m->pfrozen);
    free(m->moe_load);
    loom_moe_tabs_free(m->moe_tabs);
    loom_param_plan_free(&m->plan);
    loom_config_free(&m->cfg);
    free(m->src_dir);
    free(m->overrides);
    loom_mesh_free(m->mesh);
    if (m->own_world) loom_comm_free(m->world);
    loom_prof_free(m->prof);
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
    info->max_position_embeddings = m->cfg.max_position_embeddings;
    info->num_experts = m->cfg.num_experts > 0 ? m->cfg.num_experts : 0;
    info->num_experts_per_tok = info->num_experts ? m->cfg.num_experts_per_tok : 0;
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
 * every dp*cp rank (an expert's on every edp rank); gradients are summed
 * over them. Replicated tensors count
 * once over tp unless their gradient is a partial sum; a tied embedding's
 * copy adds its gradient but not its value. */
loom_status loom_gather_full(loom_model *m, loom_arena *a, const char *name, int64_t rows,
                             int64_t cols, bool grads, float scale, float *dst) {
    const size_t n = (size_t)(rows * cols);
    memset(dst, 0, n * sizeof *dst);
    const loom_mesh *me = m->mesh;
    if (grads) {
        loom_status st = loom_grad_settle(m);
        if (st) return st;
    }
    float *tmp = NULL;
    size_t cap = 0;
    for (int i = 0; (grads ? (void *)a->g : a->wc) && i < a->nslots; i++) {
        const loom_slot *s = &a->slots[i];
        if (strcmp(s->name, name)) continue;
        if (grads && s->frozen) continue; /* no gradient: zero */
        /* values from one replica: over edp for an expert's, else dp x cp */
        const bool replica = s->expert ? me->edp_rank != 0 : (me->dp_rank || me->cp_rank);
        if (!grads && (replica || s->head_copy)) continue;
        /* replicated over tp (an expert's over etp): once, unless a partial sum */
        const int trank = s->expert ? me->etp_rank : me->tp_rank;
        const bool partial = s->expert ? s->etp_partial : s->tp_partial;
        if (s->shard == LOOM_SHARD_NONE && trank && !(grads && partial)) continue;
        const float *src;
        loom_status st = loom_arena_host(m, a, i, grads, &tmp, &cap, &src);
        if (st) {
            free(tmp);
            return st;
        }
        for (int64_t r = 0; r < s->rows && loom_slot_grow(s, r) < rows; r++)
            for (int64_t c = 0; c < s->cols; c++)
                dst[loom_slot_grow(s, r) * cols + s->col0 + c] += src[r * s->cols + c] * scale;
    }
    free(tmp);
    if (loom_comm_size(m->world) == 1) return LOOM_OK;
    return loom_comm_allreduce(m->world, dst, n, LOOM_F32, LOOM_RED_SUM);
}


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
                            grads ? (float)(1.0 / ((double)m->acc_tokens * m->loss_scale)) : 1.0f,
                            dst);
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

/* The base model's tensors for io/'s writer: HF names and shapes, each
 * gathered from the ranks that hold it. */
static void hf_info(void *u, size_t i, char *name, size_t cap, int *ndim, int64_t shape[2]) {
    const loom_param_spec *p = &((loom_model *)u)->plan.p[i];
    snprintf(name, cap, "%s", p->name);
    *ndim = p->ndim;
    shape[0] = p->shape[0];
    shape[1] = p->ndim == 2 ? p->shape[1] : 1;
}

static loom_status hf_fetch(void *u, size_t i, float *dst) {
    loom_model *m = u;
    const loom_param_spec *p = &m->plan.p[i];
    return loom_model_get_param(m, p->name, dst,
                                p->shape[0] * (p->ndim == 2 ? p->shape[1] : 1));
}

loom_status loom_model_save_hf(loom_model *m, const char *dir, loom_dtype dtype,
                               uint64_t max_shard_bytes) {
    const loom_tensor_source src = {m, m->plan.n, hf_info, hf_fetch};
    return loom_hf_dir_write(m->ctx, "save_hf", dir, m->mesh->rank == 0, &src,
                             dtype == LOOM_DTYPE_COUNT ? m->file_dtype : dtype, max_shard_bytes,
                             &m->cfg, m->src_dir, m->experts_fused);
}

loom_status loom_model_load_config(loom_ctx *ctx, const char *dir, const char *overrides,
                                   loom_model_config *cfg) {
    return loom_config_load_with(ctx, dir, overrides, cfg);
}
