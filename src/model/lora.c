/* LoRA adapters (PEFT's LoRA): y = x W^T + scale * (x A^T) B^T on the
 * targeted projections of every decoder layer, the base frozen.
 *
 * Tensor parallelism, without extra collectives. A column-parallel base
 * (q, k, v, gate, up: output rows split over tp) gets A replicated and B
 * split by rows: u = x A^T is the same on every tp rank, each adds its rows
 * of u B^T. A row-parallel base (o, down: input columns split) gets A split
 * by columns and B replicated: each rank's partial u_r = x_r A_r^T goes
 * through B into the partial output that the layer already reduces over tp,
 * and since B is linear, sum_r u_r B^T = (sum_r u_r) B^T, the same as
 * reducing u first. The replicated halves (A of column-parallel, B of
 * row-parallel) get partial gradients on each tp rank, summed before the
 * step (tp_partial). A replicated base (the shared expert's gate: every tp
 * rank computes its whole output, and gets a partial sum of its output's
 * gradient) gets both replicated, both partial. Names are PEFT's: base_model.model.<hub name of the
 * module>.lora_A.weight (adapter_model.safetensors has no adapter name). */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "../core/rng.h"
#include "../io/export.h"
#include "model.h"

/* Layer l's linear `mod` and its kind's description (PEFT's module). */
static const loom_layer_lin *lin_of(const loom_model *m, int64_t l, int mod,
                                    const loom_block_linear **k) {
    const loom_layer_lin *x = &m->layer[l].lin[mod];
    *k = &m->layer[l].b[x->b].kind->lin[x->k];
    return x;
}

/* Does adapter a cover layer linear x? */
static bool targeted(const loom_adapter *a, const loom_layer_lin *x) {
    return x->target >= 0 && a->target[x->target];
}

/* Layer l's linear j is one per expert (block.h's `experts`). */
static bool experts_lin(const loom_model *m, int64_t l, int j) {
    const loom_block_linear *k;
    lin_of(m, l, j, &k);
    return k->experts;
}

/* The modules of layer l's linear j over the model (an expert linear's: E). */
static int64_t instances(const loom_model *m, int64_t l, int j) {
    return experts_lin(m, l, j) ? m->cfg.num_experts : 1;
}

/* How many modules of layer l adapter a covers (each expert's counted). */
static int64_t layer_targets(const loom_model *m, const loom_adapter *a, int64_t l) {
    int64_t n = 0;
    for (int j = 0; j < m->layer[l].nlin; j++)
        if (targeted(a, &m->layer[l].lin[j])) n += instances(m, l, j);
    return n;
}

/* Layer l's linear `mod` of PEFT's module path `block` that adapter a
 * covers, an expert's when expert >= 0 (then one this model has), -1 when
 * none. */
static int linear_named(const loom_model *m, const loom_adapter *a, int64_t l, int64_t expert,
                        const char *block, const char *mod) {
    if (expert >= m->cfg.num_experts) return -1;
    for (int j = 0; j < m->layer[l].nlin; j++) {
        const loom_block_linear *k;
        if (targeted(a, lin_of(m, l, j, &k)) && k->experts == (expert >= 0) &&
            !strcmp(k->path, block) && !strcmp(k->name, mod))
            return j;
    }
    return -1;
}

/* PEFT's name of the A or B of module (l, j), expert e's (-1: none). */
static void weight_name(const loom_model *m, char *buf, size_t cap, int64_t l, int j, int64_t e,
                        int ab) {
    const loom_block_linear *k;
    lin_of(m, l, j, &k);
    char path[64];
    if (e >= 0)
        snprintf(path, sizeof path, "%s.%lld", k->path, (long long)e);
    else
        snprintf(path, sizeof path, "%s", k->path);
    loom_peft_weight_name(buf, cap, loom_config_text_prefix(&m->cfg), l, path, k->name,
                          ab ? 'B' : 'A');
}

static loom_adapter *find(loom_model *m, const char *name) {
    for (int i = 0; i < m->nadapters; i++)
        if (!strcmp(m->adapters[i].name, name)) return &m->adapters[i];
    return NULL;
}

loom_adapter *loom_model_lora(loom_model *m) {
    if (m->active < 0) return NULL;
    loom_adapter *a = &m->adapters[m->active];
    return a->merged ? NULL : a;
}

loom_arena *loom_model_trainable(loom_model *m) {
    return m->active >= 0 ? &m->adapters[m->active].ar : &m->base;
}

static void adapter_free(loom_model *m, loom_adapter *a) {
    for (int i = 0; a->names && i < a->ar.nslots; i++) free(a->names[i]);
    free(a->names);
    free(a->slot);
    free(a->name);
    loom_arena_free(m, &a->ar);
}

void loom_adapters_free(loom_model *m) {
    for (int i = 0; i < m->nadapters; i++) adapter_free(m, &m->adapters[i]);
    free(m->adapters);
    m->adapters = NULL;
    m->nadapters = 0;
    m->active = -1;
}

/* "all-linear" or a comma-separated list of module names ("all-linear" in
 * it: every linear but those taken only when named, e.g. "all-linear,gate"
 * adds the MoE router). */
loom_status loom_lora_parse_targets(loom_ctx *ctx, const char *spec, bool target[LOOM_LORA_NMOD]) {
    memset(target, 0, sizeof(bool) * LOOM_LORA_NMOD);
    const int nt = loom_lora_ntargets();
    if (!spec || !strcmp(spec, "all-linear")) {
        for (int k = 0; k < nt; k++) target[k] = !loom_lora_target_named(k);
        return LOOM_OK;
    }
    const char *p = spec;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        while (n && (*p == ' ')) p++, n--;
        while (n && p[n - 1] == ' ') n--;
        if (n == strlen("all-linear") && !strncmp(p, "all-linear", n)) { /* "all-linear,gate" */
            for (int k = 0; k < nt; k++) target[k] |= !loom_lora_target_named(k);
            p = e ? e + 1 : p + strlen(p);
            continue;
        }
        const int k = loom_lora_target_find(p, n);
        if (k < 0) {
            char known[512] = "";
            for (int t = 0; t < nt; t++)
                snprintf(known + strlen(known), sizeof known - strlen(known), "%s%s", t ? ", " : "",
                         loom_lora_target_name(t));
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "LoRA target module '%.*s' is not one loom knows; use all-linear or "
                             "a list of %s",
                             (int)n, p, known);
        }
        target[k] = true;
        p = e ? e + 1 : p + strlen(p);
    }
    for (int k = 0; k < nt; k++)
        if (target[k]) return LOOM_OK;
    return loom_errf(ctx, LOOM_ERR_CONFIG, "LoRA target_modules is empty");
}

/* The targets some layer of the model has, of those asked for; an error
 * when none. */
static loom_status model_targets(loom_model *m, const bool want[LOOM_LORA_NMOD],
                                 bool out[LOOM_LORA_NMOD]) {
    bool any = false;
    memset(out, 0, sizeof(bool) * LOOM_LORA_NMOD);
    for (int64_t l = 0; l < m->L; l++)
        for (int j = 0; j < m->layer[l].nlin; j++) {
            const int t = m->layer[l].lin[j].target;
            if (t >= 0 && want[t]) out[t] = any = true;
        }
    if (any) return LOOM_OK;
    return loom_errf(m->ctx, LOOM_ERR_CONFIG,
                     "LoRA target_modules: none of them is a linear of this %s model",
                     m->cfg.model_type);
}

/* A and B of layer l's linear j (lin_of) in the adapter's arena: A (r, in)
 * column-split for a row-parallel base, B (out, r) row-split for a
 * column-parallel one; both replicated for a replicated base (the shared
 * expert's gate, whose output gradient is a partial sum over tp: so are
 * theirs). */
static loom_status add_ab(loom_model *m, loom_adapter *a, int64_t l, int j, int64_t e, int ab) {
    const loom_layer_lin *x = &m->layer[l].lin[j];
    char buf[256];
    weight_name(m, buf, sizeof buf, l, j, e, ab);
    const int s = a->ar.nslots;
    if (!(a->names[s] = loom_strdup(m->ctx, buf))) return LOOM_ERR_OOM;
    loom_shard sh = ab == 0 ? (x->row_par ? LOOM_SHARD_COLS : LOOM_SHARD_NONE)
                            : (x->row_par || x->rep ? LOOM_SHARD_NONE : LOOM_SHARD_ROWS);
    /* an expert's: split over etp like its base, its buckets over edp */
    loom_slot *sl = loom_slot_add(m, &a->ar, a->names[s], ab ? x->out : a->r, ab ? a->r : x->in,
                                  2, sh, false, e >= 0);
    if (ab) loom_slot_row_parts(m, sl, x->nparts, x->part); /* B: as its base's rows */
    if (e >= 0)
        sl->etp_partial = m->etp > 1 && sh == LOOM_SHARD_NONE;
    else
        sl->tp_partial = m->tp > 1 && sh == LOOM_SHARD_NONE;
    if (a->slot[l][j][ab] < 0) a->slot[l][j][ab] = s; /* experts: the first local one's */
    return LOOM_OK;
}

/* A new adapter with this rank's A and B blocks laid out (values zero). */
static loom_status adapter_new(loom_model *m, const char *name, int r, double alpha,
                               double dropout, bool rslora, const bool target[LOOM_LORA_NMOD],
                               loom_adapter **out) {
    loom_ctx *ctx = m->ctx;
    if (!name || !*name) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "an adapter needs a name");
    if (find(m, name))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "the model already has an adapter named '%s'",
                         name);
    if (r <= 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "LoRA rank r=%d must be >= 1 (8 or 16 are usual)",
                         r);
    if (!(dropout >= 0.0 && dropout < 1.0))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "lora_dropout=%g must lie in [0, 1)", dropout);
    if (!(alpha > 0.0) || !isfinite(alpha))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "lora_alpha=%g must be a positive number", alpha);
    loom_adapter *na = realloc(m->adapters, sizeof *na * (size_t)(m->nadapters + 1));
    if (!na) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory adding adapter %s", name);
    m->adapters = na;
    loom_adapter *a = &m->adapters[m->nadapters];
    memset(a, 0, sizeof *a);
    a->name = loom_strdup(ctx, name);
    a->r = r;
    a->alpha = alpha;
    a->dropout = dropout;
    a->rslora = rslora;
    a->scale = (float)(rslora ? alpha / sqrt((double)r) : alpha / r);
    loom_status st = model_targets(m, target, a->target);
    const int64_t El = m->cfg.num_experts / m->ep;
    size_t maxs = 0;
    bool experts = false;
    for (int64_t l = 0; l < m->L; l++)
        for (int j = 0; j < m->layer[l].nlin; j++) {
            maxs += 2 * (size_t)(experts_lin(m, l, j) ? El : 1);
            experts |= experts_lin(m, l, j) && targeted(a, &m->layer[l].lin[j]);
        }
    if (!st && experts && dropout > 0.0)
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                       "lora_dropout=%g on the experts is not supported yet; use lora_dropout 0, "
                       "or leave the experts' gate_proj/up_proj/down_proj out of target_modules",
                       dropout);
    a->ar.slots = loom_calloc(ctx, maxs + 1, sizeof *a->ar.slots, "adapter slots");
    a->names = loom_calloc(ctx, maxs + 1, sizeof *a->names, "adapter names");
    a->slot = loom_calloc(ctx, (size_t)m->L, sizeof *a->slot, "adapter table");
    if (!st && (!a->name || !a->ar.slots || !a->names || !a->slot)) st = LOOM_ERR_OOM;
    if (!st) memset(a->slot, 0xff, (size_t)m->L * sizeof *a->slot);
    /* every layer's dense blocks, then every layer's experts' (each kind's
     * buckets reduce over its own group: apart, a model of L layers has 2
     * buckets, each a collective, where interleaved it had 2L) */
    for (int ex = 0; ex < 2 && !st; ex++)
        for (int64_t l = 0; l < m->L && !st; l++) {
            const loom_layer *L = &m->layer[l];
            if (!L->held) continue; /* another pipeline stage's layer */
            /* the layer's A blocks first, in linear order: those of linears
             * that share an input lie back to back (one GEMM for the group) */
            const int64_t e0 = (int64_t)m->mesh->ep_rank * El;
            for (int ab = 0; ab < 2 && !st; ab++)
                for (int j = 0; j < L->nlin && !st; j++) {
                    if (!targeted(a, &L->lin[j]) || experts_lin(m, l, j) != (ex == 1)) continue;
                    if (!ex) {
                        st = add_ab(m, a, l, j, -1, ab);
                        continue;
                    }
                    for (int64_t e = e0; e < e0 + El && !st; e++) st = add_ab(m, a, l, j, e, ab);
                }
        }
    if (!st) st = loom_arena_layout(m, &a->ar, false);
    if (st) {
        adapter_free(m, a);
        return st;
    }
    m->nadapters++;
    *out = a;
    return LOOM_OK;
}

/* The base is frozen once an adapter exists: its gradients and optimizer
 * state go. */
static void freeze_base(loom_model *m, loom_adapter *a) {
    loom_grad_defer_reset(m, &m->base);
    loom_dev_free(m, m->base.g);
    loom_dev_free(m, m->base.gshard_is_g ? m->base.adam_m : m->base.gshard); /* the moments' block */
    loom_k_lists_free(m, &m->base, false);
    m->base.g = m->base.gshard = m->base.adam_m = m->base.adam_v = NULL;
    m->base.gshard_is_g = false;
    loom_arena_drop_master(m, &m->base);
    m->active = (int)(a - m->adapters);
    loom_model_zero_grad(m);
}

loom_status loom_model_add_adapter(loom_model *m, const char *name, const loom_lora_config *c) {
    bool target[LOOM_LORA_NMOD];
    loom_status st = loom_lora_parse_targets(m->ctx, c->target_modules, target);
    if (st) return st;
    loom_adapter *a;
    double alpha = c->lora_alpha > 0 ? c->lora_alpha : c->r;
    if ((st = adapter_new(m, name, c->r, alpha, c->lora_dropout, c->use_rslora, target, &a)))
        return st;
    a->seed = c->seed;
    /* PEFT's start: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform with
     * a = sqrt(5)), B = 0; element values from (seed, name, index) only */
    for (int i = 0; i < a->ar.nslots; i++) {
        const loom_slot *sl = &a->ar.slots[i];
        if (strstr(sl->name, ".lora_B.")) continue;
        double bound = 1.0 / sqrt((double)sl->shape[1]);
        uint64_t key = loom_hash_str(sl->name);
        float *w = a->ar.w + sl->off;
        for (int64_t r = 0; r < sl->rows; r++)
            for (int64_t k = 0; k < sl->cols; k++) {
                uint64_t idx = (uint64_t)(loom_slot_grow(sl, r) * sl->shape[1] + sl->col0 + k);
                w[r * sl->cols + k] = (float)(bound * (2.0 * loom_rng_uniform(c->seed, key, idx) - 1.0));
            }
    }
    if ((st = loom_arena_commit(m, &a->ar))) {
        adapter_free(m, &m->adapters[--m->nadapters]);
        return st;
    }
    freeze_base(m, a);
    return LOOM_OK;
}

loom_status loom_model_set_adapter(loom_model *m, const char *name) {
    if (!name) {
        m->active = -1;
        if (m->nadapters) m->active = -1; /* the base stays frozen */
        loom_model_zero_grad(m);
        return LOOM_OK;
    }
    loom_adapter *a = find(m, name);
    if (!a) return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND, "the model has no adapter named '%s'", name);
    m->active = (int)(a - m->adapters);
    loom_model_zero_grad(m);
    return LOOM_OK;
}

/* ---- PEFT files ---- */

/* A warning when adapter_config.json's base_model_name_or_path names another
 * base than the model it is loaded onto: a local directory by its
 * config.json's model_type, a hub id or a path elsewhere by its last
 * component against the base directory's name. (Other hidden sizes or layer
 * counts are errors of the tensor checks.) */
static void check_base(loom_model *m, const char *base, const char *cfgp) {
    if (!*base || loom_model_rank(m) != 0) return;
    const char *mine = m->cfg.model_type;
    char theirs[64];
    if (loom_peft_base_model_type(base, theirs, sizeof theirs)) {
        if (*theirs && strcmp(theirs, mine))
            LOOM_LOG_W(m->ctx, "%s: the adapter was trained on %s (model_type %s), loading onto %s "
                       "(model_type %s)", cfgp, base, theirs, m->dir_name, mine);
        return;
    }
    char name[256];
    loom_path_name(base, name, sizeof name);
    /* adapters loom saved before named the model_type there */
    if (strcasecmp(name, m->dir_name) && strcmp(base, mine))
        LOOM_LOG_W(m->ctx, "%s: the adapter was trained on %s, loading onto %s; use the base it "
                   "was trained on, unless %s is that model under another name",
                   cfgp, base, m->dir_name, m->dir_name);
}

loom_status loom_model_load_adapter(loom_model *m, const char *name, const char *dir) {
    loom_ctx *ctx = m->ctx;
    loom_peft_dir *pd = NULL;
    loom_status s = loom_peft_dir_open(ctx, dir, &pd);
    if (s) return s;
    const loom_peft_config *pc = loom_peft_dir_config(pd);
    const char *cfgp = loom_peft_dir_config_path(pd);
    check_base(m, pc->base_model, cfgp);
    const int64_t r = pc->r;
    bool target[LOOM_LORA_NMOD];
    if ((s = loom_lora_parse_targets(ctx, pc->target_modules, target))) {
        loom_err_prefix(ctx, "%s", cfgp);
        goto done;
    }
    /* every tensor of the file must be one the config implies, and the
     * other way round, with the shapes the base model gives */
    loom_adapter *a;
    if ((s = adapter_new(m, name, (int)r, pc->lora_alpha, pc->lora_dropout, pc->use_rslora,
                         target, &a)))
        goto done;
    int found = 0;
    bool warned = false;
    for (size_t i = 0; i < loom_peft_dir_count(pd) && !s; i++) {
        loom_peft_tensor t;
        if ((s = loom_peft_dir_tensor(ctx, pd, i, &t))) break;
        /* the expected global shape, from the name */
        const int j =
            t.lora && t.layer < m->L ? linear_named(m, a, t.layer, t.expert, t.block, t.module)
                                     : -1;
        if (j < 0) {
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: tensor %s is not a LoRA weight of the modules adapter_config.json "
                          "targets on this %lld-layer model",
                          dir, t.name, (long long)m->L);
            break;
        }
        const loom_layer_lin *x = &m->layer[t.layer].lin[j];
        int64_t want0 = t.ab == 'A' ? r : x->out, want1 = t.ab == 'A' ? x->in : r;
        if (t.ndim != 2 || t.shape[0] != want0 || t.shape[1] != want1) {
            s = loom_errf(ctx, LOOM_ERR_SHAPE,
                          "%s: %s has shape [%lld, %lld], but r=%lld on this base model needs "
                          "[%lld, %lld]; the adapter was made for another model",
                          dir, t.name, (long long)t.shape[0], (long long)t.shape[1], (long long)r,
                          (long long)want0, (long long)want1);
            break;
        }
        found++;
        /* the other layout's names (text-only vs vision-language) are the same
         * text-model weights: read by layer and module, under this model's name */
        if (t.nested != m->cfg.nested_text && !warned) {
            LOOM_LOG_W(ctx,
                       "%s: the adapter's names are %s's (base_model.model.%slayers...), this "
                       "checkpoint is %s (base_model.model.%slayers...); loom reads them by "
                       "layer and module, PEFT would not place them on this model: save the "
                       "adapter again from loom to get this model's names",
                       dir, t.nested ? "a vision-language checkpoint" : "a text-only checkpoint",
                       t.nested ? "model.language_model." : "model.",
                       m->cfg.nested_text ? "vision-language" : "text-only",
                       loom_config_text_prefix(&m->cfg));
            warned = true;
        }
        char own[256];
        weight_name(m, own, sizeof own, t.layer, j, t.expert, t.ab == 'B');
        for (int n = 0; n < a->ar.nslots && !s; n++)
            if (!strcmp(a->ar.slots[n].name, own))
                s = loom_slot_read(ctx, t.data, t.dtype, &a->ar.slots[n],
                                   a->ar.w + a->ar.slots[n].off);
    }
    int64_t want = 0;
    for (int64_t l = 0; l < m->L; l++) want += 2 * layer_targets(m, a, l);
    if (!s && found != want)
        s = loom_errf(ctx, LOOM_ERR_FORMAT,
                      "%s: adapter_model.safetensors holds %d LoRA weights, but its config "
                      "targets %lld on this %lld-layer model",
                      dir, found, (long long)want, (long long)m->L);
    if (!s) s = loom_arena_commit(m, &a->ar);
    if (s) {
        adapter_free(m, &m->adapters[--m->nadapters]);
        goto done;
    }
    freeze_base(m, a);
done:
    loom_peft_dir_close(pd);
    return s;
}

/* The i-th tensor of adapter a over the whole model: layers in order, their
 * linears in order, A then B. */
static bool global_tensor(const loom_model *m, const loom_adapter *a, int64_t i, char *buf,
                          size_t cap, int64_t shape[2]) {
    int64_t l = 0;
    for (; i >= 0 && l < m->L && i >= 2 * layer_targets(m, a, l); l++) i -= 2 * layer_targets(m, a, l);
    if (i < 0 || l == m->L) return false;
    const int ab = (int)(i % 2);
    int64_t n = i / 2; /* the module among the layer's covered ones (experts each) */
    int j = 0;
    for (;; j++) {
        if (!targeted(a, &m->layer[l].lin[j])) continue;
        if (n < instances(m, l, j)) break;
        n -= instances(m, l, j);
    }
    const loom_layer_lin *x = &m->layer[l].lin[j];
    weight_name(m, buf, cap, l, j, experts_lin(m, l, j) ? n : -1, ab);
    shape[0] = ab ? x->out : a->r;
    shape[1] = ab ? a->r : x->in;
    return true;
}

const char *loom_model_adapter_tensor(loom_model *m, const char *name, int64_t i, char *buf,
                                      size_t cap, int64_t shape[2]) {
    loom_adapter *a = name ? find(m, name) : (m->active >= 0 ? &m->adapters[m->active] : NULL);
    if (!a || !global_tensor(m, a, i, buf, cap, shape)) return NULL;
    return buf;
}

/* An adapter tensor's arena, name in the arena and shape, from its PEFT
 * name with or without ".<adapter>" before ".weight". */
loom_status loom_lora_find(loom_model *m, const char *name, loom_arena **ar, char *key,
                           size_t cap, int64_t *rows, int64_t *cols) {
    const char *lw = strstr(name, ".lora_");
    loom_adapter *a = m->active >= 0 ? &m->adapters[m->active] : NULL;
    snprintf(key, cap, "%s", name);
    if (lw && strlen(lw) > 14 && lw[7] == '.') { /* ".lora_A.<adapter>.weight" */
        const char *an = lw + 8, *end = strstr(an, ".weight");
        if (end && end[7] == 0 && end > an) {
            char aname[128];
            snprintf(aname, sizeof aname, "%.*s", (int)(end - an), an);
            a = find(m, aname);
            snprintf(key, cap, "%.*s.weight", (int)(an - 1 - name), name);
        }
    }
    if (!a) return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND, "the model has no parameter named %s", name);
    char buf[256];
    int64_t shape[2];
    for (int64_t i = 0; global_tensor(m, a, i, buf, sizeof buf, shape); i++)
        if (!strcmp(buf, key)) {
            *ar = &a->ar;
            *rows = shape[0];
            *cols = shape[1];
            return LOOM_OK;
        }
    return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND, "adapter '%s' has no tensor %s", a->name, key);
}

/* The adapter's tensors for io/'s writers: PEFT's names and shapes over
 * the whole model, each gathered from the ranks that hold it. */
typedef struct adapter_src {
    loom_model *m;
    loom_adapter *a;
} adapter_src;

static void adapter_info(void *u, size_t i, char *name, size_t cap, int *ndim, int64_t shape[2]) {
    adapter_src *x = u;
    global_tensor(x->m, x->a, (int64_t)i, name, cap, shape);
    *ndim = 2;
}

static loom_status adapter_fetch(void *u, size_t i, float *dst) {
    adapter_src *x = u;
    char name[256];
    int64_t shape[2];
    global_tensor(x->m, x->a, (int64_t)i, name, sizeof name, shape);
    return loom_gather_full(x->m, &x->a->ar, name, shape[0], shape[1], false, 1.0f, dst);
}

loom_status loom_model_save_adapter(loom_model *m, const char *name, const char *dir,
                                    loom_dtype dtype) {
    loom_adapter *a = find(m, name);
    if (!a) return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND, "the model has no adapter named '%s'", name);
    if (dtype == LOOM_DTYPE_COUNT) dtype = LOOM_F32;
    adapter_src x = {m, a};
    char buf[256];
    int64_t shape[2];
    size_t n = 0;
    while (global_tensor(m, a, (int64_t)n, buf, sizeof buf, shape)) n++;
    const loom_tensor_source src = {&x, n, adapter_info, adapter_fetch};
    /* base_model_name_or_path: the model directory's own name
     * (loom_path_name: "models/Qwen3-0.6B/" and "." name the directory) */
    loom_peft_config pc = {.r = a->r, .lora_alpha = a->alpha, .lora_dropout = a->dropout,
                           .use_rslora = a->rslora};
    snprintf(pc.base_model, sizeof pc.base_model, "%s",
             m->dir_name[0] ? m->dir_name : m->cfg.model_type);
    const char *targets[LOOM_LORA_NMOD];
    int nt = 0;
    for (int k = 0; k < loom_lora_ntargets(); k++)
        if (a->target[k]) targets[nt++] = loom_lora_target_name(k);
    return loom_peft_dir_write(m->ctx, dir, m->mesh->rank == 0, &src, dtype, &pc, targets, nt);
}

/* Bytes of a saved adapter of rank r on the targeted modules (F32, PEFT
 * layout) of a model of config cfg, headers not counted; 0 when the config
 * gives no layer table. */
uint64_t loom_lora_save_estimate(const loom_model_config *cfg, int r,
                                 const bool target[LOOM_LORA_NMOD]) {
    loom_ctx *q = NULL; /* what fails here is the run's to report, later */
    if (loom_ctx_create(&q)) return 0;
    loom_param_plan plan = {0};
    loom_layer *layers = calloc((size_t)cfg->num_layers + 1, sizeof *layers);
    uint64_t io = 0;
    if (layers && !loom_param_plan_build(q, cfg, &plan) &&
        !loom_layers_build(q, cfg, &plan, layers))
        for (int64_t l = 0; l < cfg->num_layers; l++)
            for (int j = 0; j < layers[l].nlin; j++) {
                const loom_layer_lin *x = &layers[l].lin[j];
                if (x->target >= 0 && target[x->target])
                    io += (uint64_t)(x->in + x->out) *
                          (uint64_t)(layers[l].b[x->b].kind->lin[x->k].experts ? cfg->num_experts
                                                                                 : 1);
            }
    free(layers);
    loom_param_plan_free(&plan);
    loom_ctx_free(q);
    return io * (uint64_t)r * 4;
}

/* ---- merge ---- */

static loom_status merge(loom_model *m, const char *name, float sign) {
    loom_adapter *a = find(m, name);
    if (!a) return loom_errf(m->ctx, LOOM_ERR_NOT_FOUND, "the model has no adapter named '%s'", name);
    if (a->merged == (sign > 0))
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG, "adapter '%s' is %s merged", name,
                         a->merged ? "already" : "not");
    /* the fp32 master of a base not trained yet is on the host: merge there on the GPU */
    loom_status sm = loom_arena_master_to_device(m, &m->base);
    if (sm) return sm;
    /* every rank's base block and its A, B blocks fit: W_l += s B_l A_l */
    for (int64_t l = 0; l < m->L; l++) {
        const loom_layer *L = &m->layer[l];
        for (int k = 0; k < L->nlin; k++) {
          const int64_t ne = experts_lin(m, l, k) ? m->cfg.num_experts / m->ep : 1;
          for (int64_t e = 0; e < ne && a->slot[l][k][0] >= 0; e++) {
            const loom_slot *A = &a->ar.slots[a->slot[l][k][0] + e],
                            *B = &a->ar.slots[a->slot[l][k][1] + e];
            const loom_block *b = &L->b[L->lin[k].b];
            const int stride = experts_lin(m, l, k) ? LOOM_MOE_EXPERT_SLOTS : 0;
            const loom_slot *W =
                &m->base.slots[b->w[b->kind->lin[L->lin[k].k].w] + (int)e * stride];
            LOOM_ASSERT(W->rows == B->rows && W->cols == A->cols);
            /* into the fp32 master, or (a frozen GPU base without one) the
             * compute copy, rounding once per element as PEFT does */
            loom_status st =
                m->base.w ? loom_k_sgemm(m, W->rows, W->cols, a->r, sign * a->scale,
                                         a->ar.w + B->off, a->ar.w + A->off, 1.0f,
                                         m->base.w + W->off)
                          : loom_k_gemm_c(m, W->rows, W->cols, a->r, sign * a->scale,
                                          (const char *)a->ar.wc + B->off * m->dev.esz,
                                          (const char *)a->ar.wc + A->off * m->dev.esz, 1.0f,
                                          (char *)m->base.wc + W->off * m->dev.esz);
            if (st) return st;
          }
        }
    }
    a->merged = sign > 0;
    return loom_arena_sync(m, &m->base);
}

loom_status loom_model_merge_adapter(loom_model *m, const char *name) { return merge(m, name, 1.0f); }
loom_status loom_model_unmerge_adapter(loom_model *m, const char *name) {
    return merge(m, name, -1.0f);
}

/* ---- the experts' LoRA, run by their kind (block_moe.c) ---- */

bool loom_lora_expert(loom_model *m, int64_t l, int mod, int64_t *r, float *scale) {
    loom_adapter *a = loom_model_lora(m);
    if (!a || a->slot[l][mod][0] < 0) return false;
    *r = a->r;
    *scale = a->scale;
    return true;
}

void loom_lora_expert_at(loom_model *m, int64_t l, int mod, int64_t e, const void **A,
                         const void **B, float **dA, float **dB) {
    loom_adapter *a = loom_model_lora(m);
    const loom_slot *sa = &a->ar.slots[a->slot[l][mod][0] + e],
                    *sb = &a->ar.slots[a->slot[l][mod][1] + e];
    *A = (const char *)a->ar.wc + sa->off * m->dev.esz;
    *B = (const char *)a->ar.wc + sb->off * m->dev.esz;
    *dA = a->ar.g ? a->ar.g + sa->off : NULL;
    *dB = a->ar.g ? a->ar.g + sb->off : NULL;
}

/* ---- forward and backward ---- */

static bool lora_on(loom_model *m, int64_t l, int mod, loom_adapter **ad, const loom_slot **A,
                    const loom_slot **B) {
    loom_adapter *a = loom_model_lora(m);
    if (!a || a->slot[l][mod][0] < 0) return false;
    *ad = a;
    *A = &a->ar.slots[a->slot[l][mod][0]];
    *B = &a->ar.slots[a->slot[l][mod][1]];
    return true;
}

/* Dropout on the adapter's input, as PEFT applies it (training only):
 * element (token, feature) is kept with probability 1-p and scaled by
 * 1/(1-p). The mask is a function of (seed, call, layer, module, the
 * token's index in the global batch, the feature's index in the full
 * input), so every mesh drops the same elements. out (T, in) = x * mask,
 * or with `apply_to` the mask applied to out in place. */
static bool dropout_on(const loom_model *m, const loom_adapter *a) {
    return m->training && a->dropout > 0.0;
}

static loom_status dropout_mask(loom_model *m, const loom_adapter *a, int64_t l, int mod,
                                const loom_slot *A, const void *x, int64_t T, void *out) {
    const uint64_t key = loom_splitmix64(((uint64_t)l << 8) ^ (uint64_t)mod ^ 0x10a4ULL);
    const uint64_t seed = a->seed ^ loom_splitmix64(m->dropout_calls);
    const int32_t *qidx = m->cp == 1 ? NULL : m->d_perm + (int64_t)m->mesh->cp_rank * m->Tc;
    return loom_k_dropout(m, out, x, T, A->cols, A->shape[1], A->col0, qidx, m->cur_mb->key0, seed,
                          key, a->dropout);
}

/* The adapter's compute copies of A and B, and x A^T of `mod` in a layer's
 * stash u. */
#define WC(a, sl) ((const char *)(a)->ar.wc + (sl)->off * m->dev.esz)
static void *lora_u(loom_model *m, void *u, int mod, int64_t r) {
    return (char *)u + (size_t)mod * (size_t)(m->Tc * r) * m->dev.esz;
}

bool loom_lora_covers(loom_model *m, int64_t l, int mod) {
    loom_adapter *a;
    const loom_slot *A, *B;
    return lora_on(m, l, mod, &a, &A, &B);
}

/* Linears that read the same input, a group of a block kind's (block.h:
 * q, k, v and gate, up). Their A projections run as one GEMM (the input read once; the input gradient one
 * GEMM instead of one per module and its accumulation) when the adapter
 * covers the whole group without dropout and the group's A blocks lie back
 * to back (adapter_new lays them out so; a bucket boundary can still fall
 * between them). Then x A^T of the group is one (T, n r) block of the stash
 * from the first module's place on. */
typedef struct lgroup {
    int first, n;
} lgroup;

static bool grouped(loom_model *m, const loom_adapter *a, int64_t l, int mod, lgroup *g) {
    const loom_layer_lin *x = &m->layer[l].lin[mod];
    *g = (lgroup){x->group, x->gn};
    if (g->n == 1 || dropout_on(m, a)) return false;
    const loom_slot *prev = NULL;
    for (int k = g->first; k < g->first + g->n; k++) {
        if (a->slot[l][k][0] < 0) return false;
        const loom_slot *A = &a->ar.slots[a->slot[l][k][0]];
        if (prev && (A->off != prev->off + prev->numel || A->cols != prev->cols)) return false;
        prev = A;
    }
    return true;
}

loom_status loom_lora_fwd(loom_model *m, void *stash, int64_t l, int mod,
                          const void *x, int64_t T, void *y, float beta, const void *W,
                          bool *with_base) {
    loom_adapter *a;
    const loom_slot *A, *B;
    if (with_base) *with_base = false;
    if (!lora_on(m, l, mod, &a, &A, &B)) return LOOM_OK;
    const int64_t r = a->r, in = A->cols, out = B->rows;
    const void *x_base = x;
    const char *u;
    int64_t ldu = r;
    lgroup g;
    if (grouped(m, a, l, mod, &g)) {
        ldu = g.n * r;
        char *u0 = lora_u(m, stash, g.first, r);
        if (mod == g.first) CK(loom_k_gemm_ld(m, false, true, T, ldu, in, 1.0f, x, in, WC(a, A), in,
                                              0.0f, u0, false, ldu));
        u = u0 + (size_t)((mod - g.first) * r) * m->dev.esz;
    } else {
        u = lora_u(m, stash, mod, r);
        if (dropout_on(m, a)) {
            CK(dropout_mask(m, a, l, mod, A, x, T, m->lora_xd));
            x = m->lora_xd;
        }
        CK(loom_k_lin_fwd(m, x, T, in, WC(a, A), r, 1.0f, 0.0f, (void *)u));
    }
    /* y = x W^T + s u B^T in one GEMM where the device has one */
    if (W && with_base && beta == 0.0f)
        CK(loom_k_lin_lora_fwd(m, x_base, T, in, W, out, u, ldu, WC(a, B), r, a->scale, y, with_base));
    if (with_base && *with_base) return LOOM_OK;
    return loom_k_gemm_ld(m, false, true, T, out, r, a->scale, u, ldu, WC(a, B), r, beta, y, false,
                          out);
}

loom_status loom_lora_bwd(loom_model *m, void *stash, int64_t l, int mod,
                          const void *x, int64_t T, const void *dy, void *dx, float beta,
                          bool *wrote, loom_dx_term *defer) {
    loom_adapter *a;
    const loom_slot *A, *B;
    *wrote = false;
    if (defer) defer->dy = NULL;
    if (!lora_on(m, l, mod, &a, &A, &B)) return LOOM_OK;
    const int64_t r = a->r, in = A->cols, out = B->rows;
    lgroup g;
    if (grouped(m, a, l, mod, &g)) {
        /* one read of each dy: the module's columns of the group's du = s dy B
         * and dB += s dy^T u, all the group's modules in one pass at the last
         * (the callers run a group's modules in order, their dy kept); then
         * the group's dA += du^T x, dx = du A + beta dx */
        const int64_t ld = g.n * r;
        const size_t c = (size_t)((mod - g.first) * r) * m->dev.esz;
        const char *u = (const char *)lora_u(m, stash, g.first, r) + c;
        if (mod == g.first) m->lora_npend = 0, m->lora_pend_l = l;
        if (m->lora_npend != mod - g.first || m->lora_pend_l != l)
            return loom_errf(m->ctx, LOOM_ERR_INTERNAL,
                             "LoRA backward: layer %lld's grouped modules came out of order (module %d after %d "
                             "of layer %lld)",
                             (long long)l, mod, g.first + m->lora_npend - 1, (long long)m->lora_pend_l);
        m->lora_pend[m->lora_npend++] =
            (loom_lora_dy_op){out, dy, WC(a, B), u, (char *)m->lora_du + c, a->ar.g + B->off};
        if (mod != g.first + g.n - 1) return LOOM_OK;
        CK(loom_k_lora_dy_n(m, T, r, a->scale, g.n, m->lora_pend, ld, ld));
        const loom_slot *A0 = &a->ar.slots[a->slot[l][g.first][0]];
        CK(loom_k_gemm_ld(m, true, false, ld, in, T, 1.0f, m->lora_du, ld, x, in, 1.0f,
                          a->ar.g + A0->off, true, in));
        if (!dx) return LOOM_OK;
        if (defer) {
            *defer = (loom_dx_term){m->lora_du, ld, ld, WC(a, A0)};
            return LOOM_OK;
        }
        *wrote = true;
        return loom_k_gemm_ld(m, false, false, T, in, ld, 1.0f, m->lora_du, ld, WC(a, A0), in, beta,
                              dx, false, in);
    }
    const void *u = lora_u(m, stash, mod, r);
    void *du = m->lora_du;
    /* dB += s dy^T u and du = s dy B (one read of dy); dA += du^T x';
     * dx = d/dx (du A) + beta dx, x' the dropped-out input (recomputed from
     * the mask) */
    CK(loom_k_lora_dy(m, T, out, r, a->scale, dy, WC(a, B), u, r, du, r, a->ar.g + B->off));
    if (!dropout_on(m, a)) {
        CK(loom_k_lin_dw(m, du, x, T, r, in, 1.0f, a->ar.g + A->off));
        if (!dx) return LOOM_OK;
        if (defer) {
            *defer = (loom_dx_term){du, r, r, WC(a, A)};
            return LOOM_OK;
        }
        *wrote = true;
        return loom_k_lin_dx(m, du, T, r, WC(a, A), in, 1.0f, beta, dx);
    }
    *wrote = dx != NULL;
    void *xd = m->lora_xd;
    CK(dropout_mask(m, a, l, mod, A, x, T, xd));
    CK(loom_k_lin_dw(m, du, xd, T, r, in, 1.0f, a->ar.g + A->off));
    if (!dx) return LOOM_OK;
    CK(loom_k_lin_dx(m, du, T, r, WC(a, A), in, 1.0f, 0.0f, xd));
    CK(dropout_mask(m, a, l, mod, A, NULL, T, xd));
    if (beta == 0.0f) return loom_k_copy(m, dx, xd, (size_t)(T * in) * m->dev.esz);
    return loom_k_add(m, dx, xd, T * in);
}
