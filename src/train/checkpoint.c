/* Training state in and out (include/loom.h's loom_model_save_state /
 * loom_model_load_state), laid out as Megatron's distributed checkpoints
 * are: every rank writes the part of the state it owns into a file of its
 * own, and meta.json says, for every tensor, its whole shape and which file
 * holds which slice, so any mesh can load what any mesh saved.
 *
 * What a rank owns is what its distributed optimizer owns: for each bucket,
 * its shard (loom_shard_range; a slot's part of it is a "piece": the slot's
 * block of the whole tensor and a flat range of that block), holding the
 * fp32 master values and both AdamW moments. Replicated tensors are owned
 * by tp rank 0, a tied embedding by its first stage; a frozen tensor (no
 * moments) is one piece, its whole block, from dp x cp rank 0 (an expert's
 * from edp rank 0). Every element
 * of the model is in exactly one piece.
 *
 * Saving is three steps so the write can go on while training does
 * (Megatron's async save): take (copies of this rank's shards into host
 * buffers, page-locked on a GPU and reused by the next take: the only
 * pause), write (this rank's file rank_NNNNN.safetensors and its SHA-256,
 * on any thread), commit (collective: every rank's verdict, checksum and
 * pieces to rank 0, which writes meta.json). The files' layout is
 * src/io/state_format.h's.
 *
 * Loading assembles each tensor this rank holds from the pieces (any files),
 * then takes its block and its shard's parts, as the step lays them out. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/json.h"
#include "../io/state_format.h"
#include "../model/kern.h"
#include "../model/model.h"
#include "scheduler.h"
#include "trainer.h"

/* The i-th tensor of the trained arena, over the whole model: name, rows, cols. */
static bool tensor_at(loom_model *m, int64_t i, char *buf, size_t cap, int64_t *rows,
                      int64_t *cols) {
    if (m->active >= 0) {
        int64_t sh[2];
        if (!loom_model_adapter_tensor(m, NULL, i, buf, cap, sh)) return false;
        *rows = sh[0], *cols = sh[1];
        return true;
    }
    if (i >= (int64_t)m->plan.n) return false;
    const loom_param_spec *p = &m->plan.p[i];
    snprintf(buf, cap, "%s", p->name);
    *rows = p->shape[0];
    *cols = p->ndim == 2 ? p->shape[1] : 1;
    return true;
}

/* The optimizer's and the schedule's settings by name (a style by its
 * name): saved in meta.json, compared on resume. */
typedef struct setting {
    const char *name, *s; /* s: a style's name, else NULL and v */
    double v;
} setting;

static int settings_of(const loom_model *m, setting out[20]) {
    int n = 0;
    const loom_optimizer_config *o = &m->opt;
    out[n++] = (setting){"lr", NULL, o->lr};
    out[n++] = (setting){"adam_beta1", NULL, o->beta1};
    out[n++] = (setting){"adam_beta2", NULL, o->beta2};
    out[n++] = (setting){"adam_eps", NULL, o->eps};
    out[n++] = (setting){"weight_decay", NULL, o->weight_decay};
    if (!m->has_sched) return n;
    const loom_sched_config *c = &m->sched;
    out[n++] = (setting){"init_lr", NULL, c->init_lr};
    out[n++] = (setting){"max_lr", NULL, c->max_lr};
    out[n++] = (setting){"min_lr", NULL, c->min_lr};
    out[n++] = (setting){"lr_warmup_steps", NULL, (double)c->lr_warmup_steps};
    out[n++] = (setting){"lr_decay_steps", NULL, (double)c->lr_decay_steps};
    out[n++] = (setting){"lr_decay_style", loom_lr_decay_style_name(c->lr_decay_style), 0};
    out[n++] = (setting){"wsd_decay_steps", NULL, (double)c->wsd_decay_steps};
    out[n++] = (setting){"lr_wsd_decay_style", loom_wsd_style_name(c->lr_wsd_decay_style), 0};
    out[n++] = (setting){"start_wd", NULL, c->start_wd};
    out[n++] = (setting){"end_wd", NULL, c->end_wd};
    out[n++] = (setting){"wd_incr_steps", NULL, (double)c->wd_incr_steps};
    out[n++] = (setting){"wd_incr_style", loom_wd_incr_style_name(c->wd_incr_style), 0};
    return n;
}

/* Resuming with the optimizer set already (loom train sets it first):
 * each setting that differs from the checkpoint's is named (the new value
 * applies, as under Megatron's --override-opt_param-scheduler). */
static void compare_settings(loom_model *m, const loom_json *meta, const char *path) {
    const loom_json *saved = loom_json_get(meta, "settings");
    if (!saved || saved->type != LOOM_JSON_OBJECT) return;
    setting cur[20];
    const int n = settings_of(m, cur);
    for (int i = 0; i < n; i++) {
        const loom_json *v = loom_json_get(saved, cur[i].name);
        char was[64], now[64];
        if (cur[i].s) snprintf(now, sizeof now, "%s", cur[i].s);
        else snprintf(now, sizeof now, "%.9g", cur[i].v);
        if (!v) snprintf(was, sizeof was, "none (no schedule)");
        else if (v->type == LOOM_JSON_STRING) snprintf(was, sizeof was, "%s", v->s);
        else if (v->type == LOOM_JSON_NUMBER) snprintf(was, sizeof was, "%.9g", v->d);
        else snprintf(was, sizeof was, "?");
        if (strcmp(was, now))
            LOOM_LOG_W(m->ctx, "resuming with %s %s where %s has %s (the new value applies)",
                       cur[i].name, now, path, was);
    }
}

/* meta.json's contents but the files' checksums (added when written). */
static loom_status meta_build(loom_model *m, const loom_train_progress *p, bool optimizer,
                              int64_t step, loom_json **out) {
    loom_ctx *ctx = m->ctx;
    loom_json *o = loom_json_new_object(ctx);
    if (!o) return LOOM_ERR_OOM;
    loom_status st = LOOM_OK;
#define SET(k, v) \
    if (!st) st = loom_json_set(ctx, o, k, v)
    SET("format", loom_json_new_str(ctx, LOOM_STATE_FORMAT));
    SET("version", loom_json_new_int(ctx, LOOM_STATE_VERSION));
    SET("model_type", loom_json_new_str(ctx, m->cfg.model_type));
    SET("num_layers", loom_json_new_int(ctx, m->L));
    SET("hidden_size", loom_json_new_int(ctx, m->H));
    SET("vocab_size", loom_json_new_int(ctx, m->V));
    SET("num_params", loom_json_new_int(ctx, loom_param_plan_count(&m->plan, NULL)));
    char *abs = m->src_dir ? realpath(m->src_dir, NULL) : NULL; /* for loom convert */
    SET("model_dir", abs ? loom_json_new_str(ctx, abs)
                         : m->src_dir ? loom_json_new_str(ctx, m->src_dir) : loom_json_new_null(ctx));
    free(abs);
    SET("config_overrides", m->overrides ? loom_json_new_str(ctx, m->overrides)
                                         : loom_json_new_null(ctx));
    SET("step", loom_json_new_int(ctx, step));
    SET("consumed_samples", loom_json_new_int(ctx, p ? p->consumed_samples : 0));
    SET("consumed_tokens", loom_json_new_int(ctx, p ? p->consumed_tokens : 0));
    SET("data_epoch", loom_json_new_int(ctx, p ? p->data_epoch : 0));
    SET("data_index", loom_json_new_int(ctx, p ? p->data_index : 0));
    SET("data_offset", loom_json_new_int(ctx, p ? p->data_offset : 0));
    SET("loss_scale", loom_json_new_num(ctx, m->loss_scale));
    SET("good_steps", loom_json_new_int(ctx, m->good_steps));
    SET("dropout_calls", loom_json_new_int(ctx, (int64_t)m->dropout_calls));
    SET("optimizer", loom_json_new_bool(ctx, optimizer));
    setting sv[20];
    const int ns = settings_of(m, sv);
    loom_json *so = loom_json_new_object(ctx);
    for (int i = 0; so && !st && i < ns; i++)
        st = loom_json_set(ctx, so, sv[i].name,
                           sv[i].s ? loom_json_new_str(ctx, sv[i].s)
                           : strstr(sv[i].name, "_steps") ? loom_json_new_int(ctx, (int64_t)sv[i].v)
                                                          : loom_json_new_num(ctx, sv[i].v));
    SET("settings", so ? so : loom_json_new_null(ctx));
    loom_json *fz = loom_json_new_array(ctx); /* tensors set not trainable */
    for (size_t i = 0; fz && !st && m->pfrozen && i < m->plan.n; i++)
        if (m->pfrozen[i]) st = loom_json_push(ctx, fz, loom_json_new_str(ctx, m->plan.p[i].name));
    SET("frozen", fz ? fz : loom_json_new_null(ctx));
    char mesh[128];
    SET("mesh", loom_json_new_str(ctx, loom_mesh_describe(&m->mesh->n, mesh, sizeof mesh)));
    if (m->active >= 0) {
        const loom_adapter *a = &m->adapters[m->active];
        loom_json *ad = loom_json_new_object(ctx);
        if (!ad) st = LOOM_ERR_OOM;
        char tg[512] = "";
        for (int k = 0; k < loom_lora_ntargets(); k++)
            if (a->target[k]) snprintf(tg + strlen(tg), sizeof tg - strlen(tg), "%s%s",
                                       *tg ? "," : "", loom_lora_target_name(k));
        if (!st) st = loom_json_set(ctx, ad, "name", loom_json_new_str(ctx, a->name));
        if (!st) st = loom_json_set(ctx, ad, "r", loom_json_new_int(ctx, a->r));
        if (!st) st = loom_json_set(ctx, ad, "lora_alpha", loom_json_new_num(ctx, a->alpha));
        if (!st) st = loom_json_set(ctx, ad, "lora_dropout", loom_json_new_num(ctx, a->dropout));
        if (!st) st = loom_json_set(ctx, ad, "use_rslora", loom_json_new_bool(ctx, a->rslora));
        if (!st) st = loom_json_set(ctx, ad, "target_modules", loom_json_new_str(ctx, tg));
        if (!st) st = loom_json_set(ctx, ad, "seed", loom_json_new_int(ctx, (int64_t)a->seed));
        SET("adapter", ad);
    }
#undef SET
    if (st) {
        loom_json_free(o);
        return st;
    }
    *out = o;
    return LOOM_OK;
}

/* ---- saving ---- */

struct loom_state_snapshot {
    int rank, world;
    bool optimizer;     /* the moments are held */
    float *buf[3];      /* values, exp_avg, exp_avg_sq (host; page-locked on a GPU) */
    size_t cap[3];
    bool pinned[3];
    loom_state_piece *p; /* the slices this rank owns */
    size_t *at;          /* (np) where each one's data lies in buf */
    int *slot;           /* (np) its slot in the arena */
    size_t np, pcap;
    loom_state_tensors t; /* the trained tensors, over the whole model */
    loom_json *meta;     /* rank 0: meta.json but "files" and "tensors" */
    char sha[65];        /* this rank's file, once written */
    loom_status written;
};

static void drop_tensors(loom_state_snapshot *sn) {
    for (size_t i = 0; i < sn->t.n; i++) free(sn->t.names[i]);
    free(sn->t.names);
    free(sn->t.shape);
    free(sn->t.ndim);
    memset(&sn->t, 0, sizeof sn->t);
}

void loom_state_snapshot_free(loom_state_snapshot *sn) {
    if (!sn) return;
    for (int k = 0; k < 3; k++) loom_k_host_free(sn->buf[k], sn->pinned[k]);
    drop_tensors(sn);
    free(sn->p);
    free(sn->at);
    free(sn->slot);
    loom_json_free(sn->meta);
    free(sn);
}

/* Buffer k holds at least n floats (reused when it does already). */
static loom_status host_buf(loom_model *m, loom_state_snapshot *sn, int k, size_t n) {
    if (sn->buf[k] && sn->cap[k] >= n) return LOOM_OK;
    loom_k_host_free(sn->buf[k], sn->pinned[k]);
    sn->buf[k] = NULL, sn->cap[k] = 0;
    loom_status st = loom_k_host_alloc(m, (void **)&sn->buf[k], (n ? n : 1) * sizeof(float),
                                       &sn->pinned[k], "the checkpoint's host copy");
    if (!st) sn->cap[k] = n;
    return st;
}

static loom_status add_piece(loom_ctx *ctx, loom_state_snapshot *sn, const loom_state_piece *p,
                             size_t at, int slot) {
    if (sn->np == sn->pcap) {
        size_t cap = sn->pcap ? 2 * sn->pcap : 64;
        loom_state_piece *np = realloc(sn->p, cap * sizeof *np);
        if (np) sn->p = np;
        size_t *na = np ? realloc(sn->at, cap * sizeof *na) : NULL;
        if (na) sn->at = na;
        int *ns = na ? realloc(sn->slot, cap * sizeof *ns) : NULL;
        if (ns) sn->slot = ns;
        if (!ns) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory listing the checkpoint's pieces");
        sn->pcap = cap;
    }
    sn->p[sn->np] = *p;
    sn->at[sn->np] = at;
    sn->slot[sn->np++] = slot;
    return LOOM_OK;
}

/* The trained tensors' names and shapes (every rank: the files' keys). */
static loom_status list_tensors(loom_model *m, loom_state_snapshot *sn) {
    char name[320];
    int64_t rows, cols;
    size_t n = 0;
    drop_tensors(sn);
    while (tensor_at(m, (int64_t)n, name, sizeof name, &rows, &cols)) n++;
    loom_state_tensors *t = &sn->t;
    t->names = calloc(n + 1, sizeof *t->names);
    t->shape = calloc(n + 1, sizeof *t->shape);
    t->ndim = calloc(n + 1, sizeof *t->ndim);
    if (!t->names || !t->shape || !t->ndim)
        return loom_errf(m->ctx, LOOM_ERR_OOM, "out of memory listing the trained tensors");
    for (; t->n < n; t->n++) {
        tensor_at(m, (int64_t)t->n, name, sizeof name, &rows, &cols);
        if (!(t->names[t->n] = loom_strdup(m->ctx, name))) return LOOM_ERR_OOM;
        t->shape[t->n][0] = rows, t->shape[t->n][1] = cols;
        t->ndim[t->n] = cols == 1 && m->active < 0 ? 1 : 2;
    }
    return LOOM_OK;
}

/* The index of slot s's tensor (slots come in about the tensors' order:
 * the search starts after the last one found). */
static int64_t tensor_of(const loom_state_snapshot *sn, const loom_slot *s, size_t *hint) {
    for (size_t k = 0; k < sn->t.n; k++) {
        size_t j = (*hint + k) % sn->t.n;
        if (!strcmp(sn->t.names[j], s->name)) {
            *hint = j + 1;
            return (int64_t)j;
        }
    }
    return -1;
}

/* The pieces of the flat range [f0, f0 + len) of slot s's held block, kept
 * at `at` on: one, or one per run of rows it meets for a slot of fused
 * parts split over tp (loom_slot_row_parts), each a block of its own. */
static loom_status add_runs(loom_ctx *ctx, loom_state_snapshot *sn, loom_state_piece p,
                            const loom_slot *s, int64_t f0, int64_t len, size_t at, int slot) {
    int64_t lo = 0;
    for (int k = 0; k < s->nruns; k++) {
        const int64_t hi = lo + s->runn[k] * s->cols;
        const int64_t a = f0 > lo ? f0 : lo, b = f0 + len < hi ? f0 + len : hi;
        if (a < b) {
            p.row0 = s->run0[k], p.rows = s->runn[k], p.split = s->nruns > 1;
            p.f0 = a - lo, p.len = b - a;
            loom_status st = add_piece(ctx, sn, &p, at + (size_t)(a - f0), slot);
            if (st) return st;
        }
        lo = hi;
    }
    return LOOM_OK;
}

/* This rank's pieces: each slot's parts of its shards, and the whole block
 * of a frozen slot it owns (laid after the shards in the values buffer). */
static loom_status find_pieces(loom_model *m, loom_arena *A, loom_state_snapshot *sn,
                               size_t *frozen_numel) {
    const loom_mesh *me = m->mesh;
    size_t hint = 0, fz = 0;
    sn->np = 0;
    for (int i = 0; i < A->nslots; i++) {
        const loom_slot *s = &A->slots[i];
        const int trank = s->expert ? me->etp_rank : me->tp_rank;
        if (s->head_copy || (s->shard == LOOM_SHARD_NONE && trank)) continue;
        if (s->frozen && (s->expert ? me->edp_rank != 0 : (me->dp_rank || me->cp_rank))) continue;
        loom_state_piece p = {.tensor = tensor_of(sn, s, &hint), .row0 = s->row0,
                              .col0 = s->col0, .rows = s->rows, .cols = s->cols,
                              .moments = !s->frozen};
        if (p.tensor < 0)
            return loom_errf(m->ctx, LOOM_ERR_INTERNAL, "checkpoint: slot %s is no trained tensor",
                             s->name);
        loom_status st = LOOM_OK;
        if (s->frozen) {
            st = add_runs(m->ctx, sn, p, s, 0, (int64_t)s->numel, A->shard_numel + fz, i);
            fz += s->numel;
        }
        for (int b = 0; !s->frozen && b < A->nbuckets && !st; b++) {
            size_t o0, len, so;
            if (!loom_shard_part(m, A, b, i, &o0, &len, &so)) continue;
            st = add_runs(m->ctx, sn, p, s, (int64_t)(o0 - s->off), (int64_t)len, so, i);
        }
        if (st) return st;
    }
    *frozen_numel = fz;
    return LOOM_OK;
}

loom_status loom_state_snapshot_take(loom_model *m, const loom_train_progress *p, int optimizer,
                                     loom_state_snapshot **out) {
    loom_ctx *ctx = m->ctx;
    loom_arena *A = loom_model_trainable(m);
    if (m->active >= 0 && m->adapters[m->active].merged)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "save_state: the active adapter is merged; unmerge "
                         "it first");
    loom_state_snapshot *sn = *out; /* an earlier snapshot's buffers are reused */
    if (!sn && !(sn = loom_calloc(ctx, 1, sizeof *sn, "state snapshot"))) return LOOM_ERR_OOM;
    *out = sn;
    loom_json_free(sn->meta);
    sn->meta = NULL;
    sn->rank = m->mesh->rank;
    sn->world = loom_comm_size(m->world);
    sn->optimizer = optimizer && A->adam_m;
    sn->written = LOOM_ERR_INVALID_ARG; /* until write ran */
    sn->sha[0] = 0;
    size_t fz = 0;
    loom_status st = list_tensors(m, sn);
    if (!st) st = find_pieces(m, A, sn, &fz);
    if (!st) st = host_buf(m, sn, 0, A->shard_numel + fz);
    for (int k = 1; k < 3 && sn->optimizer && !st; k++) st = host_buf(m, sn, k, A->shard_numel);
    /* the values of the shards, a bucket at a time (a frozen base's from
     * its compute copy), then the frozen blocks */
    for (int b = 0; b < A->nbuckets && !st; b++) {
        size_t s0, per, base;
        loom_shard_range(m, A, b, &s0, &per, &base);
        st = A->w ? loom_k_download(m, sn->buf[0] + base, A->w + s0, per * sizeof(float))
                  : loom_k_download_f32(m, sn->buf[0] + base,
                                        (const char *)A->wc + s0 * m->dev.esz, per);
    }
    for (size_t i = 0; i < sn->np && !st; i++) { /* a frozen slot's whole block, once */
        if (sn->p[i].moments || (i && sn->slot[i - 1] == sn->slot[i])) continue;
        const loom_slot *s = &A->slots[sn->slot[i]];
        float *dst = sn->buf[0] + sn->at[i];
        st = A->w ? loom_k_download(m, dst, A->w + s->off, s->numel * sizeof(float))
                  : loom_k_download_f32(m, dst, (const char *)A->wc + s->off * m->dev.esz,
                                        s->numel);
    }
    for (int k = 1; k < 3 && sn->optimizer && !st; k++)
        st = loom_k_download(m, sn->buf[k], k == 1 ? A->adam_m : A->adam_v,
                             A->shard_numel * sizeof(float));
    if (!st && sn->rank == 0) st = meta_build(m, p, sn->optimizer, A->step, &sn->meta);
    return st;
}

loom_status loom_state_snapshot_write(loom_ctx *ctx, loom_state_snapshot *sn, const char *dir) {
    sn->written = loom_state_file_write(ctx, dir, sn->rank, &sn->t, sn->p, sn->at, sn->np,
                                        sn->buf, sn->optimizer, sn->sha);
    return sn->written;
}

loom_status loom_state_snapshot_commit(loom_model *m, loom_state_snapshot *sn, const char *dir) {
    loom_ctx *ctx = m->ctx;
    loom_comm *w = m->world;
    const bool many = loom_comm_size(w) > 1;
    /* every rank's write, and the widest list of pieces */
    int32_t v[2] = {sn->written ? sn->rank + 1 : 0, (int32_t)sn->np};
    loom_status st = many ? loom_comm_allreduce(w, v, 2, LOOM_I32, LOOM_RED_MAX) : LOOM_OK;
    if (st) return st;
    if (v[0] && sn->written) return sn->written; /* its own message */
    if (v[0])
        return loom_errf(ctx, LOOM_ERR_IO, "checkpoint %s: rank %d could not write its file (its "
                         "message says why)", dir, v[0] - 1);
    const size_t words = loom_state_words((size_t)v[1]);
    int64_t *mine = calloc(words, sizeof *mine),
            *all = calloc(words * (size_t)sn->world, sizeof *all);
    if (!mine || !all) st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory gathering the checkpoint's "
                                      "pieces");
    /* a rank without the buffers is not left out of the gather (the others would wait) */
    if ((st = loom_comm_agree_all(ctx, many ? w : NULL, st, "gathering the checkpoint's pieces"))) {
        free(mine);
        free(all);
        return st;
    }
    {
        loom_state_pack(mine, sn->sha, sn->p, sn->np);
        st = many ? loom_comm_allgather(w, mine, all, words, LOOM_I64)
                  : (memcpy(all, mine, words * sizeof *all), LOOM_OK);
    }
    /* a failed gather is every rank's; the rest is rank 0's, and its
     * verdict everyone's */
    if (!st && sn->rank == 0)
        st = loom_state_meta_write(ctx, dir, sn->meta, &sn->t, sn->world, all, words);
    free(mine);
    free(all);
    return st == LOOM_ERR_COMM ? st : loom_comm_agree_root(ctx, w, st, 0, "writing meta.json");
}

loom_status loom_model_save_state(loom_model *m, const char *dir, const loom_train_progress *p,
                                  int optimizer) {
    loom_state_snapshot *sn = NULL;
    loom_status st = loom_state_snapshot_take(m, p, optimizer, &sn);
    /* a rank that failed to copy still takes part in commit, so none hangs */
    if (sn) {
        if (!st) loom_state_snapshot_write(m->ctx, sn, dir);
        else sn->written = st;
        loom_status cs = loom_state_snapshot_commit(m, sn, dir);
        if (!st) st = cs;
    }
    loom_state_snapshot_free(sn);
    return st;
}

/* ---- loading ---- */

static loom_status check_meta(loom_model *m, const loom_json *o, const char *path) {
    loom_ctx *ctx = m->ctx;
    const char *fmt = NULL;
    int64_t ver = 0, L = 0, H = 0, V = 0;
    loom_status st = loom_json_get_str(ctx, o, "format", path, &fmt);
    if (!st && strcmp(fmt, LOOM_STATE_FORMAT))
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: format '%s' is not a loom training state",
                         path, fmt);
    if (!st) st = loom_json_get_int(ctx, o, "version", path, &ver);
    if (!st && ver != LOOM_STATE_VERSION)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: version %lld; this loom reads version %d (a newer loom wrote it?)",
                         path, (long long)ver, LOOM_STATE_VERSION);
    if (!st) st = loom_json_get_int(ctx, o, "num_layers", path, &L);
    if (!st) st = loom_json_get_int(ctx, o, "hidden_size", path, &H);
    if (!st) st = loom_json_get_int(ctx, o, "vocab_size", path, &V);
    if (st) return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: %s", path, loom_last_error(ctx));
    if (L != m->L || H != m->H || V != m->V)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "%s was saved from another model (%lld layers, hidden %lld, vocab %lld; "
                         "this one has %lld, %lld, %lld); load it into the model it trained",
                         path, (long long)L, (long long)H, (long long)V, (long long)m->L,
                         (long long)m->H, (long long)m->V);
    const loom_json *ad = loom_json_get(o, "adapter");
    if (!ad != (m->active < 0))
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s holds %s, this model trains %s", path,
                         ad ? "a LoRA adapter's state" : "the whole model's state",
                         m->active >= 0 ? "a LoRA adapter" : "the whole model");
    if (ad) {
        int64_t r = 0;
        if ((st = loom_json_get_int(ctx, ad, "r", path, &r))) return st;
        if (r != m->adapters[m->active].r)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: its adapter has r=%lld, this one r=%d; "
                             "give the same LoRA settings", path, (long long)r,
                             m->adapters[m->active].r);
    }
    return LOOM_OK;
}

/* Slot s's block of the whole tensor `full` (rows x cols) into dst. */
static void take_block(const loom_slot *s, const float *full, int64_t rows, int64_t cols,
                       float *dst) {
    for (int64_t r = 0; r < s->rows; r++)
        for (int64_t c = 0; c < s->cols; c++)
            dst[r * s->cols + c] = loom_slot_grow(s, r) < rows
                                       ? full[loom_slot_grow(s, r) * cols + s->col0 + c]
                                       : 0;
}

loom_status loom_model_load_state(loom_model *m, const char *dir, int optimizer,
                                  loom_train_progress *p) {
    loom_ctx *ctx = m->ctx;
    loom_arena *A = loom_model_trainable(m);
    loom_state_reader *R = NULL;
    float *w = NULL, *full = NULL, *blk = NULL, *mom[2] = {NULL, NULL};
    loom_status st = loom_state_open(ctx, dir, &R);
    const loom_json *meta = st ? NULL : loom_state_meta(R);
    const char *path = st ? NULL : loom_state_meta_path(R);
    if (!st) st = check_meta(m, meta, path);
    bool saved_moments = false;
    if (!st) st = loom_json_get_bool(ctx, meta, "optimizer", path, &saved_moments);
    if (!st && optimizer && !saved_moments)
        st = loom_errf(ctx, LOOM_ERR_CONFIG, "%s: saved without the optimizer state; load the "
                       "weights only (--finetune) or resume from another checkpoint", dir);
    const bool moments = optimizer && saved_moments;
    if (!st && moments && m->opt_set && m->mesh->rank == 0) compare_settings(m, meta, path);
    /* the frozen set of the run that saved (before anything is laid out) */
    const loom_json *fz = st ? NULL : loom_json_get(meta, "frozen");
    for (size_t i = 0; !st && optimizer && m->active < 0 && i < m->plan.n; i++) {
        bool want = false;
        for (size_t j = 0; fz && fz->type == LOOM_JSON_ARRAY && j < fz->n; j++)
            want |= fz->items[j]->type == LOOM_JSON_STRING && !strcmp(fz->items[j]->s,
                                                                     m->plan.p[i].name);
        if (want != (m->pfrozen && m->pfrozen[i]))
            st = loom_model_set_trainable(m, m->plan.p[i].name, !want);
    }
    A = loom_model_trainable(m);
    /* the master values: the whole arena on the host, each slot's block set */
    if (!st) st = loom_arena_master_to_device(m, A);
    const size_t n = A->nparams;
    if (!st && !(w = malloc((n ? n : 1) * sizeof *w))) st = LOOM_ERR_OOM;
    if (!st) st = A->w_on_dev ? loom_k_download(m, w, A->w, n * sizeof *w)
                              : (memcpy(w, A->w, n * sizeof *w), LOOM_OK);
    if (!st && moments) st = loom_optim_alloc(m, A);
    for (int k = 0; !st && moments && k < 2; k++) {
        if (!(mom[k] = calloc(A->shard_numel ? A->shard_numel : 1, sizeof *mom[k])))
            st = LOOM_ERR_OOM;
    }
    for (int i = 0; !st && i < A->nslots; i++) {
        const loom_slot *s = &A->slots[i];
        const int64_t rows = s->shape[0], cols = s->shape[1];
        float *nf = realloc(full, sizeof *full * (size_t)(rows * cols));
        float *nb = nf ? realloc(blk, sizeof *blk * (size_t)(s->rows * s->cols)) : NULL;
        if (nf) full = nf;
        if (nb) blk = nb;
        if (!nf || !nb) {
            st = LOOM_ERR_OOM;
            break;
        }
        if ((st = loom_state_read(R, s->name, s->ndim, rows, cols, 0, full))) break;
        take_block(s, full, rows, cols, w + s->off);
        for (int k = 0; moments && k < 2 && !s->frozen && !st; k++) {
            if ((st = loom_state_read(R, s->name, s->ndim, rows, cols, k + 1, full))) break;
            take_block(s, full, rows, cols, blk);
            for (int b = 0; b < A->nbuckets; b++) {
                size_t o0, len, so;
                if (loom_shard_part(m, A, b, i, &o0, &len, &so))
                    memcpy(mom[k] + so, blk + (o0 - s->off), len * sizeof *blk);
            }
        }
    }
    if (!st) st = A->w_on_dev ? loom_k_upload(m, A->w, w, n * sizeof *w)
                              : (memcpy(A->w, w, n * sizeof *w), LOOM_OK);
    if (!st && A->wc != (void *)A->w) st = loom_arena_sync(m, A);
    for (int k = 0; !st && moments && k < 2; k++) {
        float *dst = k ? A->adam_v : A->adam_m;
        st = m->dev.cuda ? loom_k_upload(m, dst, mom[k], A->shard_numel * sizeof(float))
                         : (memcpy(dst, mom[k], A->shard_numel * sizeof(float)), LOOM_OK);
    }
    int64_t step = 0, dc = 0, good = 0;
    double scale = 1.0;
    loom_train_progress pr = {0};
    if (!st) st = loom_json_get_int(ctx, meta, "step", path, &step);
    if (!st) st = loom_json_get_int(ctx, meta, "dropout_calls", path, &dc);
    if (!st) st = loom_json_get_int(ctx, meta, "good_steps", path, &good);
    if (!st) st = loom_json_get_num(ctx, meta, "loss_scale", path, &scale);
    if (!st) st = loom_json_get_int(ctx, meta, "consumed_samples", path, &pr.consumed_samples);
    if (!st) st = loom_json_get_int(ctx, meta, "consumed_tokens", path, &pr.consumed_tokens);
    if (!st) st = loom_json_get_int(ctx, meta, "data_epoch", path, &pr.data_epoch);
    if (!st) st = loom_json_get_int(ctx, meta, "data_index", path, &pr.data_index);
    if (!st) st = loom_json_get_int(ctx, meta, "data_offset", path, &pr.data_offset);
    if (!st) {
        A->step = moments ? step : 0;
        pr.step = step;
        if (moments) {
            m->dropout_calls = (uint64_t)dc;
            m->loss_scale = scale;
            m->good_steps = good;
        }
        loom_model_zero_grad(m);
        if (p) *p = pr;
    }
    free(w);
    free(full);
    free(blk);
    free(mom[0]);
    free(mom[1]);
    loom_state_close(R);
    return st;
}
