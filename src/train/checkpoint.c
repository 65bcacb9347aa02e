/* Training state in and out (include/loom.h's loom_model_save_state /
 * loom_model_load_state): the trained tensors' fp32 master values and
 * AdamW moments as whole tensors under their HF (or PEFT) names, and a
 * meta.json with the step, the progress the caller keeps, the fp16 loss
 * scale and the dropout stream. Whole tensors make any mesh able to load
 * what any mesh saved: each rank takes its blocks, each data-parallel rank
 * its part of the distributed optimizer's shard (the same mapping,
 * loom_shard_part, as the step uses).
 *
 * Files (rank 0 writes; the caller gives the directory, ckpt_dir.c makes
 * it atomic): meta.json, model.safetensors, optimizer.safetensors
 * ("exp_avg.<name>", "exp_avg_sq.<name>"). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../core/json.h"
#include "../core/sha256.h"
#include "../io/safetensors.h"
#include "../model/model.h"

#define STATE_FORMAT "loom-training-state"
#define STATE_VERSION 1

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

/* Copies the flat range [f0, f0 + len) of slot s's block (row-major, s->cols
 * wide) from src into its place in the whole tensor dst (rows x cols), a row
 * at a time; rows past `rows` (vocabulary padding) are left out. */
static void place(const loom_slot *s, size_t f0, size_t len, const float *src, int64_t rows,
                  int64_t cols, float *dst) {
    const size_t sc = (size_t)s->cols;
    while (len) {
        const size_t r = f0 / sc, c = f0 % sc, n = len < sc - c ? len : sc - c;
        if (s->row0 + (int64_t)r < rows)
            memcpy(dst + (s->row0 + (int64_t)r) * cols + s->col0 + (int64_t)c, src,
                   n * sizeof *dst);
        src += n, f0 += n, len -= n;
    }
}

/* Whether this rank contributes slot s to a whole tensor: every element
 * once over the mesh (tp rank 0 for replicated tensors, never the tied
 * embedding's copy, values from dp x cp rank 0 only; a frozen tensor has
 * values but no moments). */
static bool contributes(const loom_model *m, const loom_slot *s, bool values) {
    if (s->head_copy || (s->frozen && !values)) return false; /* frozen: no moments */
    if (s->shard == LOOM_SHARD_NONE && m->mesh->tp_rank) return false;
    return !values || (!m->mesh->dp_rank && !m->mesh->cp_rank);
}

static loom_status sum_world(loom_model *m, float *dst, int64_t n) {
    if (loom_comm_size(m->world) == 1) return LOOM_OK;
    return loom_comm_allreduce(m->world, dst, (size_t)n, LOOM_F32, LOOM_RED_SUM);
}

/* The whole tensor `name` from a host copy of the arena's fp32 values. */
static loom_status gather_values(loom_model *m, loom_arena *A, const float *w, const char *name,
                                 int64_t rows, int64_t cols, float *dst) {
    memset(dst, 0, (size_t)(rows * cols) * sizeof *dst);
    for (int i = 0; i < A->nslots; i++) {
        const loom_slot *s = &A->slots[i];
        if (!strcmp(s->name, name) && contributes(m, s, true))
            place(s, 0, s->numel, w + s->off, rows, cols, dst);
    }
    return sum_world(m, dst, rows * cols);
}

/* The same from a shard buffer (the moments, on the host), through the
 * parts of this rank's shard (loom_shard_part). */
static loom_status gather_moment(loom_model *m, loom_arena *A, const float *shard,
                                 const char *name, int64_t rows, int64_t cols, float *dst) {
    memset(dst, 0, (size_t)(rows * cols) * sizeof *dst);
    for (int i = 0; i < A->nslots; i++) {
        const loom_slot *s = &A->slots[i];
        if (strcmp(s->name, name) || !contributes(m, s, false)) continue;
        for (int b = 0; b < A->nbuckets; b++) {
            size_t o0, len, so;
            if (loom_shard_part(m, A, b, i, &o0, &len, &so))
                place(s, o0 - s->off, len, shard + so, rows, cols, dst);
        }
    }
    return sum_world(m, dst, rows * cols);
}

/* A device (or host) shard buffer as host memory (*tmp when copied). */
static loom_status shard_host(loom_model *m, const float *buf, size_t n, float **tmp,
                              const float **out) {
    if (!m->dev.cuda) {
        *out = buf;
        return LOOM_OK;
    }
    if (!(*tmp = malloc((n ? n : 1) * sizeof **tmp)))
        return loom_errf(m->ctx, LOOM_ERR_OOM, "out of memory reading the optimizer state");
    *out = *tmp;
    return loom_k_download(m, *tmp, buf, n * sizeof **tmp);
}

static const char *const state_files[] = {"model.safetensors", "optimizer.safetensors"};

/* meta.json's contents but the files' checksums (added when written). */
static loom_status meta_build(loom_model *m, const loom_train_progress *p, bool optimizer,
                              int64_t step, loom_json **out) {
    loom_ctx *ctx = m->ctx;
    loom_json *o = loom_json_new_object(ctx);
    if (!o) return LOOM_ERR_OOM;
    loom_status st = LOOM_OK;
#define SET(k, v) \
    if (!st) st = loom_json_set(ctx, o, k, v)
    SET("format", loom_json_new_str(ctx, STATE_FORMAT));
    SET("version", loom_json_new_int(ctx, STATE_VERSION));
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
        char tg[128] = "";
        static const char *mods[] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                     "gate_proj", "up_proj", "down_proj"};
        for (int k = 0; k < LOOM_LORA_NMOD; k++)
            if (a->target[k]) snprintf(tg + strlen(tg), sizeof tg - strlen(tg), "%s%s",
                                       *tg ? "," : "", mods[k]);
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

/* ---- saving: a snapshot (collective: the whole state gathered into rank
 * 0's host memory; the only pause training takes), then its files (rank 0
 * alone, on any thread: loom train writes in the background) ---- */

typedef struct snap_tensor {
    char *name;
    int ndim;
    int64_t shape[2];
    float *data[3]; /* value, exp_avg, exp_avg_sq (NULL without the optimizer) */
} snap_tensor;

struct loom_state_snapshot {
    bool writer;       /* rank 0: holds the data and writes */
    bool optimizer;
    snap_tensor *t;
    size_t n;
    loom_json *meta;   /* without "files" */
};

void loom_state_snapshot_free(loom_state_snapshot *sn) {
    if (!sn) return;
    for (size_t i = 0; i < sn->n; i++) {
        free(sn->t[i].name);
        for (int k = 0; k < 3; k++) free(sn->t[i].data[k]);
    }
    free(sn->t);
    loom_json_free(sn->meta);
    free(sn);
}

loom_status loom_state_snapshot_take(loom_model *m, const loom_train_progress *p, int optimizer,
                                     loom_state_snapshot **out) {
    loom_ctx *ctx = m->ctx;
    loom_arena *A = loom_model_trainable(m);
    *out = NULL;
    if (m->active >= 0 && m->adapters[m->active].merged)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "save_state: the active adapter is merged; unmerge "
                         "it first");
    loom_state_snapshot *sn = loom_calloc(ctx, 1, sizeof *sn, "state snapshot");
    if (!sn) return LOOM_ERR_OOM;
    sn->writer = m->mesh->rank == 0;
    sn->optimizer = optimizer && A->adam_m;
    char name[320];
    int64_t rows, cols;
    size_t cap = 0;
    while (tensor_at(m, (int64_t)cap, name, sizeof name, &rows, &cols)) cap++;
    loom_status st = LOOM_OK;
    if (!(sn->t = loom_calloc(ctx, cap + 1, sizeof *sn->t, "state snapshot"))) st = LOOM_ERR_OOM;
    float *mh[2] = {NULL, NULL}, *tmp = NULL;
    const float *sh[2] = {NULL, NULL};
    for (int k = 0; sn->optimizer && k < 2 && !st; k++)
        st = shard_host(m, k ? A->adam_v : A->adam_m, A->shard_numel, &mh[k], &sh[k]);
    /* the fp32 values, once (a frozen base without its master: per tensor) */
    float *wh = NULL;
    const float *wv = NULL;
    if (!st && A->w) {
        if (!A->w_on_dev) {
            wv = A->w;
        } else if (!(wh = malloc((A->nparams ? A->nparams : 1) * sizeof *wh))) {
            st = loom_errf(ctx, LOOM_ERR_OOM, "out of host memory copying the weights");
        } else {
            st = loom_k_download(m, wh, A->w, A->nparams * sizeof *wh);
            wv = wh;
        }
    }
    /* every rank takes part in each gather; rank 0 keeps the results */
    for (size_t i = 0; !st && i < cap; i++) {
        tensor_at(m, (int64_t)i, name, sizeof name, &rows, &cols);
        snap_tensor *t = &sn->t[sn->n++];
        t->ndim = cols == 1 && m->active < 0 ? 1 : 2;
        t->shape[0] = rows, t->shape[1] = cols;
        if (!(t->name = loom_strdup(ctx, name))) {
            st = LOOM_ERR_OOM;
            break;
        }
        for (int k = 0; k < (sn->optimizer ? 3 : 1) && !st; k++) {
            float *d = sn->writer ? malloc(sizeof *d * (size_t)(rows * cols)) : NULL;
            if (!sn->writer) { /* a scratch buffer for the gathers */
                float *nt = realloc(tmp, sizeof *tmp * (size_t)(rows * cols));
                if (nt) tmp = nt;
                d = nt ? tmp : NULL;
            }
            if (!d) {
                st = loom_errf(ctx, LOOM_ERR_OOM, "out of host memory copying %s for a checkpoint",
                               name);
                break;
            }
            if (sn->writer) t->data[k] = d;
            st = k ? gather_moment(m, A, sh[k - 1], name, rows, cols, d)
                   : wv ? gather_values(m, A, wv, name, rows, cols, d)
                        : loom_gather_full(m, A, name, rows, cols, false, 1.0f, d);
        }
    }
    free(tmp);
    free(wh);
    free(mh[0]);
    free(mh[1]);
    if (!st && sn->writer) st = meta_build(m, p, sn->optimizer, A->step, &sn->meta);
    if (st) {
        loom_state_snapshot_free(sn);
        return st;
    }
    *out = sn;
    return LOOM_OK;
}

loom_status loom_state_snapshot_write(loom_ctx *ctx, const loom_state_snapshot *sn,
                                      const char *dir) {
    if (!sn->writer) return LOOM_OK;
    loom_st_writer *w[2] = {NULL, NULL};
    char key[352];
    loom_status st = loom_st_writer_create(ctx, dir, "model", 0, NULL, &w[0]);
    if (!st && sn->optimizer) st = loom_st_writer_create(ctx, dir, "optimizer", 0, NULL, &w[1]);
    for (size_t i = 0; !st && i < sn->n; i++) {
        const snap_tensor *t = &sn->t[i];
        st = loom_st_writer_declare(ctx, w[0], t->name, LOOM_F32, t->ndim, t->shape);
        for (int k = 0; !st && sn->optimizer && k < 2; k++) {
            snprintf(key, sizeof key, "%s.%s", k ? "exp_avg_sq" : "exp_avg", t->name);
            st = loom_st_writer_declare(ctx, w[1], key, LOOM_F32, t->ndim, t->shape);
        }
    }
    for (size_t i = 0; !st && i < sn->n; i++) {
        const snap_tensor *t = &sn->t[i];
        st = loom_st_writer_write(ctx, w[0], t->name, LOOM_F32, t->data[0]);
        for (int k = 0; !st && sn->optimizer && k < 2; k++) {
            snprintf(key, sizeof key, "%s.%s", k ? "exp_avg_sq" : "exp_avg", t->name);
            st = loom_st_writer_write(ctx, w[1], key, LOOM_F32, t->data[k + 1]);
        }
    }
    for (int k = 0; k < 2; k++) {
        if (!st && w[k]) st = loom_st_writer_finish(ctx, w[k]);
        loom_st_writer_free(w[k]);
    }
    /* meta.json last, with each file's SHA-256 */
    loom_json *meta = st ? NULL : loom_json_clone(ctx, sn->meta);
    loom_json *files = st ? NULL : loom_json_new_object(ctx);
    if (!st && (!meta || !files)) st = LOOM_ERR_OOM;
    for (int k = 0; !st && k < (sn->optimizer ? 2 : 1); k++) {
        char hex[65], *f = loom_path_join(ctx, dir, state_files[k]);
        st = f ? loom_sha256_file(ctx, f, hex) : LOOM_ERR_OOM;
        if (!st) st = loom_json_set(ctx, files, state_files[k], loom_json_new_str(ctx, hex));
        free(f);
    }
    if (!st) {
        st = loom_json_set(ctx, meta, "files", files);
        files = NULL;
    }
    loom_sb sb;
    loom_sb_init(&sb);
    if (!st) st = loom_json_write(ctx, meta, 1, &sb);
    char *path = st ? NULL : loom_path_join(ctx, dir, "meta.json");
    if (!st && !path) st = LOOM_ERR_OOM;
    if (!st) st = loom_write_file_atomic(ctx, path, sb.buf, sb.len);
    free(path);
    loom_sb_free(&sb);
    loom_json_free(files);
    loom_json_free(meta);
    return st;
}

loom_status loom_model_save_state(loom_model *m, const char *dir, const loom_train_progress *p,
                                  int optimizer) {
    loom_ctx *ctx = m->ctx;
    loom_state_snapshot *sn = NULL;
    loom_status st = loom_state_snapshot_take(m, p, optimizer, &sn);
    if (st) return st;
    st = loom_state_snapshot_write(ctx, sn, dir);
    const bool writer = sn->writer;
    loom_state_snapshot_free(sn);
    /* rank 0's verdict is everyone's */
    if (loom_comm_size(m->world) > 1) {
        int32_t v = (int32_t)st;
        loom_status cs = loom_comm_broadcast(m->world, &v, 1, LOOM_I32, 0);
        if (cs) return cs;
        if (!writer && v)
            return loom_errf(ctx, (loom_status)v, "save_state: rank 0 could not write %s (its "
                             "message says why)", dir);
    }
    return st;
}

/* ---- loading ---- */

static loom_status check_meta(loom_model *m, const loom_json *o, const char *path) {
    loom_ctx *ctx = m->ctx;
    const char *fmt = NULL;
    int64_t ver = 0, L = 0, H = 0, V = 0;
    loom_status st = loom_json_get_str(ctx, o, "format", path, &fmt);
    if (!st && strcmp(fmt, STATE_FORMAT))
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: format '%s' is not a loom training state",
                         path, fmt);
    if (!st) st = loom_json_get_int(ctx, o, "version", path, &ver);
    if (!st && ver != STATE_VERSION)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: version %lld; this loom reads version %d (a newer loom wrote it?)",
                         path, (long long)ver, STATE_VERSION);
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

loom_status loom_verify_state(loom_ctx *ctx, const char *dir) {
    char *path = loom_path_join(ctx, dir, "meta.json");
    if (!path) return LOOM_ERR_OOM;
    loom_json *meta = NULL;
    const char *fmt = NULL;
    int64_t ver = 0;
    loom_status st = loom_json_parse_file(ctx, path, &meta);
    if (!st) st = loom_json_get_str(ctx, meta, "format", path, &fmt);
    if (!st && strcmp(fmt, STATE_FORMAT))
        st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: format '%s' is not a loom training state",
                       path, fmt);
    if (!st) st = loom_json_get_int(ctx, meta, "version", path, &ver);
    if (!st && ver != STATE_VERSION)
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                       "%s: version %lld; this loom reads version %d (a newer loom wrote it?)",
                       path, (long long)ver, STATE_VERSION);
    const loom_json *files = st ? NULL : loom_json_get(meta, "files");
    if (!st && (!files || files->type != LOOM_JSON_OBJECT))
        st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: no \"files\" object of checksums", path);
    for (size_t i = 0; !st && i < files->n; i++) {
        const char *name = files->keys[i];
        const char *want = files->items[i]->type == LOOM_JSON_STRING ? files->items[i]->s : NULL;
        if (!want || strlen(want) != 64 || strchr(name, '/')) {
            st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: files.%s is not a checksum", path, name);
            break;
        }
        char hex[65], *f = loom_path_join(ctx, dir, name);
        if (!f) {
            st = LOOM_ERR_OOM;
            break;
        }
        if (!loom_file_exists(f))
            st = loom_errf(ctx, LOOM_ERR_NOT_FOUND, "%s is missing (meta.json lists it); the "
                           "checkpoint is incomplete: resume from another one", f);
        else if (!(st = loom_sha256_file(ctx, f, hex)) && strcmp(hex, want))
            st = loom_errf(ctx, LOOM_ERR_FORMAT,
                           "%s is damaged (truncated or altered): its SHA-256 is %.12s..., "
                           "meta.json says %.12s...; resume from another checkpoint", f, hex, want);
        free(f);
    }
    loom_json_free(meta);
    free(path);
    return st;
}

/* Slot i's block of the whole tensor `full` (rows x cols) into dst. */
static void take_block(const loom_slot *s, const float *full, int64_t rows, int64_t cols,
                       float *dst) {
    for (int64_t r = 0; r < s->rows; r++)
        for (int64_t c = 0; c < s->cols; c++)
            dst[r * s->cols + c] = s->row0 + r < rows ? full[(s->row0 + r) * cols + s->col0 + c] : 0;
}

loom_status loom_model_load_state(loom_model *m, const char *dir, int optimizer,
                                  loom_train_progress *p) {
    loom_ctx *ctx = m->ctx;
    loom_arena *A = loom_model_trainable(m);
    char *path = loom_path_join(ctx, dir, "meta.json");
    if (!path) return LOOM_ERR_OOM;
    loom_json *meta = NULL;
    loom_safetensors *sf[2] = {NULL, NULL};
    float *w = NULL, *full = NULL, *blk = NULL, *mom[2] = {NULL, NULL};
    loom_status st = loom_verify_state(ctx, dir);
    if (!st) st = loom_json_parse_file(ctx, path, &meta);
    if (!st) st = check_meta(m, meta, path);
    bool saved_moments = false;
    if (!st) st = loom_json_get_bool(ctx, meta, "optimizer", path, &saved_moments);
    if (!st && optimizer && !saved_moments)
        st = loom_errf(ctx, LOOM_ERR_CONFIG, "%s: saved without the optimizer state; load the "
                       "weights only (--finetune) or resume from another checkpoint", dir);
    const bool moments = optimizer && saved_moments;
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
    if (!st) {
        char *f = loom_path_join(ctx, dir, "model.safetensors");
        st = f ? loom_st_open_file(ctx, f, &sf[0]) : LOOM_ERR_OOM;
        free(f);
    }
    if (!st && moments) {
        char *f = loom_path_join(ctx, dir, "optimizer.safetensors");
        st = f ? loom_st_open_file(ctx, f, &sf[1]) : LOOM_ERR_OOM;
        free(f);
    }
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
    char key[352];
    for (int i = 0; !st && i < A->nslots; i++) {
        const loom_slot *s = &A->slots[i];
        const int64_t rows = s->shape[0], cols = s->shape[1];
        float *nf = realloc(full, sizeof *full * (size_t)(rows * cols));
        if (!nf) {
            st = LOOM_ERR_OOM;
            break;
        }
        full = nf;
        const int nd = s->ndim;
        const int64_t shp[2] = {rows, cols};
        if ((st = loom_st_read_named(ctx, sf[0], s->name, nd, shp, LOOM_F32, full))) break;
        take_block(s, full, rows, cols, w + s->off);
        for (int k = 0; moments && k < 2 && !s->frozen; k++) {
            snprintf(key, sizeof key, "%s.%s", k ? "exp_avg_sq" : "exp_avg", s->name);
            if ((st = loom_st_read_named(ctx, sf[1], key, nd, shp, LOOM_F32, full))) break;
            float *nb = realloc(blk, sizeof *blk * (size_t)(s->rows * s->cols));
            if (!nb) {
                st = LOOM_ERR_OOM;
                break;
            }
            blk = nb;
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
    free(path);
    free(w);
    free(full);
    free(blk);
    free(mom[0]);
    free(mom[1]);
    loom_st_close(sf[0]);
    loom_st_close(sf[1]);
    loom_json_free(meta);
    return st;
}
