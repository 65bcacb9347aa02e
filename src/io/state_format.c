/* The training state's files (state_format.h). */
#include "state_format.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../core/sha256.h"
#include "safetensors.h"

#define PIECE_WORDS 8 /* tensor .. moments */
#define SHA_WORDS 8   /* 64 hex digits in int64 words */

static const char *const kind_prefix[3] = {"", "exp_avg.", "exp_avg_sq."};

/* A piece's key in its rank's file: "<prefix><name>@<f0>", and ".r<row0>"
 * after it for a block of a tensor the rank holds several of (row0 >= 0). */
static void piece_key(char *key, size_t cap, const char *prefix, const char *name, int64_t f0,
                      int64_t row0) {
    int n = snprintf(key, cap, "%s%s@%lld", prefix, name, (long long)f0);
    if (row0 >= 0 && n > 0 && (size_t)n < cap)
        snprintf(key + n, cap - (size_t)n, ".r%lld", (long long)row0);
}

void loom_state_file_name(int rank, char name[40]) {
    snprintf(name, 40, "rank_%05d.safetensors", rank);
}

/* Copies the flat range [f0, f0 + len) of a block (row-major, bcols wide,
 * starting at row0, col0 of the vocabulary-padded whole tensor) from src
 * into the whole tensor dst (rows x cols), a row at a time; rows past
 * `rows` (vocabulary padding) are left out. Returns the elements placed. */
static int64_t place(int64_t row0, int64_t col0, int64_t bcols, int64_t f0, int64_t len,
                     const float *src, int64_t rows, int64_t cols, float *dst) {
    int64_t placed = 0;
    while (len > 0) {
        const int64_t r = f0 / bcols, c = f0 % bcols, n = len < bcols - c ? len : bcols - c;
        if (row0 + r < rows) {
            memcpy(dst + (row0 + r) * cols + col0 + c, src, (size_t)n * sizeof *dst);
            placed += n;
        }
        src += n, f0 += n, len -= n;
    }
    return placed;
}

loom_status loom_state_file_write(loom_ctx *ctx, const char *dir, int rank,
                                  const loom_state_tensors *t, const loom_state_piece *p,
                                  const size_t *at, size_t np, float *const data[3], bool moments,
                                  char sha[65]) {
    loom_st_writer *w = NULL;
    char key[400], base[40], file[40];
    snprintf(base, sizeof base, "rank_%05d", rank);
    loom_status st = loom_st_writer_create(ctx, dir, base, 0, NULL, &w);
    for (int pass = 0; pass < 2 && !st; pass++)
        for (size_t i = 0; i < np && !st; i++) {
            const loom_state_piece *q = &p[i];
            for (int k = 0; k < (q->moments && moments ? 3 : 1) && !st; k++) {
                piece_key(key, sizeof key, kind_prefix[k], t->names[q->tensor], q->f0,
                          q->split ? q->row0 : -1);
                st = pass ? loom_st_writer_write(ctx, w, key, LOOM_F32, data[k] + at[i])
                          : loom_st_writer_declare(ctx, w, key, LOOM_F32, 1, &q->len);
            }
        }
    if (!st) st = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    loom_state_file_name(rank, file);
    char *path = st ? NULL : loom_path_join(ctx, dir, file);
    if (!st && !path) st = LOOM_ERR_OOM;
    if (!st) st = loom_sha256_file(ctx, path, sha);
    free(path);
    return st;
}

size_t loom_state_words(size_t max_pieces) { return 1 + SHA_WORDS + max_pieces * PIECE_WORDS; }

void loom_state_pack(int64_t *words, const char sha[65], const loom_state_piece *p, size_t np) {
    words[0] = (int64_t)np;
    memcpy(words + 1, sha, 64);
    for (size_t i = 0; i < np; i++) {
        const loom_state_piece *q = &p[i];
        const int64_t x[PIECE_WORDS] = {q->tensor, q->row0, q->col0, q->rows,
                                        q->cols,   q->f0,   q->len,  q->moments};
        memcpy(words + 1 + SHA_WORDS + i * PIECE_WORDS, x, sizeof x);
    }
}

loom_status loom_state_meta_write(loom_ctx *ctx, const char *dir, const loom_json *base,
                                  const loom_state_tensors *t, int world, const int64_t *all,
                                  size_t words) {
    loom_json *meta = loom_json_clone(ctx, base), *files = loom_json_new_object(ctx),
              *tensors = loom_json_new_object(ctx);
    loom_json **lists = calloc(t->n + 1, sizeof *lists);
    loom_status st = meta && files && tensors && lists ? LOOM_OK : LOOM_ERR_OOM;
    for (size_t i = 0; i < t->n && !st; i++) {
        loom_json *e = loom_json_new_object(ctx), *shape = loom_json_new_array(ctx);
        lists[i] = loom_json_new_array(ctx);
        for (int d = 0; d < t->ndim[i] && shape; d++)
            st = loom_json_push(ctx, shape, loom_json_new_int(ctx, t->shape[i][d]));
        if (!st) st = e && shape && lists[i] ? loom_json_set(ctx, e, "shape", shape) : LOOM_ERR_OOM;
        if (!st) st = loom_json_set(ctx, e, "dtype", loom_json_new_str(ctx, "F32"));
        if (!st) st = loom_json_set(ctx, e, "pieces", lists[i]);
        if (!st) st = loom_json_set(ctx, tensors, t->names[i], e);
    }
    for (int r = 0; r < world && !st; r++) {
        const int64_t *w = all + (size_t)r * words;
        char hex[65], file[40];
        memcpy(hex, w + 1, 64);
        hex[64] = 0;
        loom_state_file_name(r, file);
        st = loom_json_set(ctx, files, file, loom_json_new_str(ctx, hex));
        for (int64_t i = 0; i < w[0] && !st; i++) {
            const int64_t *q = w + 1 + SHA_WORDS + i * PIECE_WORDS;
            loom_json *a = loom_json_new_array(ctx);
            st = a ? loom_json_push(ctx, a, loom_json_new_int(ctx, r)) : LOOM_ERR_OOM;
            for (int k = 1; k < PIECE_WORDS && !st; k++)
                st = loom_json_push(ctx, a, loom_json_new_int(ctx, q[k]));
            if (!st && (q[0] < 0 || (size_t)q[0] >= t->n))
                st = loom_errf(ctx, LOOM_ERR_INTERNAL, "checkpoint: rank %d sent tensor %lld of %zu",
                               r, (long long)q[0], t->n);
            if (!st) st = loom_json_push(ctx, lists[q[0]], a);
        }
    }
    free(lists);
    if (!st) st = loom_json_set(ctx, meta, "world_size", loom_json_new_int(ctx, world));
    if (!st) st = loom_json_set(ctx, meta, "files", files);
    files = NULL;
    if (!st) st = loom_json_set(ctx, meta, "tensors", tensors);
    tensors = NULL;
    loom_sb sb;
    loom_sb_init(&sb);
    if (!st) st = loom_json_write(ctx, meta, 1, &sb);
    char *path = st ? NULL : loom_path_join(ctx, dir, "meta.json");
    if (!st && !path) st = LOOM_ERR_OOM;
    if (!st) st = loom_write_file_atomic(ctx, path, sb.buf, sb.len);
    free(path);
    loom_sb_free(&sb);
    /* files of ranks past this world (an earlier save into the same
     * directory by more ranks) would only mislead */
    for (int r = world; !st; r++) {
        char file[40], *f;
        loom_state_file_name(r, file);
        if (!(f = loom_path_join(ctx, dir, file))) break;
        const bool there = unlink(f) == 0;
        free(f);
        if (!there) break;
    }
    loom_json_free(files);
    loom_json_free(tensors);
    loom_json_free(meta);
    return st;
}

loom_status loom_verify_state(loom_ctx *ctx, const char *dir) {
    char *path = loom_path_join(ctx, dir, "meta.json");
    if (!path) return LOOM_ERR_OOM;
    loom_json *meta = NULL;
    const char *fmt = NULL;
    int64_t ver = 0;
    loom_status st = loom_json_parse_file(ctx, path, &meta);
    if (!st) st = loom_json_get_str(ctx, meta, "format", path, &fmt);
    if (!st && strcmp(fmt, LOOM_STATE_FORMAT))
        st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: format '%s' is not a loom training state",
                       path, fmt);
    if (!st) st = loom_json_get_int(ctx, meta, "version", path, &ver);
    if (!st && ver != LOOM_STATE_VERSION)
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                       "%s: version %lld; this loom reads version %d (a newer loom wrote it?)",
                       path, (long long)ver, LOOM_STATE_VERSION);
    const loom_json *files = st ? NULL : loom_json_get(meta, "files");
    if (!st && (!files || files->type != LOOM_JSON_OBJECT))
        st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: no \"files\" object of checksums", path);
    /* every rank's file is listed (so checked below): a piece never names
     * an unchecked file */
    int64_t world = 0;
    if (!st) st = loom_json_get_int(ctx, meta, "world_size", path, &world);
    if (!st && (world < 1 || world > (1 << 20)))
        st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: world_size %lld is not a number of ranks", path,
                       (long long)world);
    for (int r = 0; !st && r < (int)world; r++) {
        char file[40];
        loom_state_file_name(r, file);
        if (!loom_json_get(files, file))
            st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: \"files\" does not list %s (rank %d of "
                           "world_size %lld); the checkpoint is damaged: resume from another one",
                           path, file, r, (long long)world);
    }
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
        int r = -1, end = 0;
        if (!loom_file_exists(f) && sscanf(name, "rank_%d.safetensors%n", &r, &end) == 1 &&
            !name[end])
            st = loom_errf(ctx, LOOM_ERR_NOT_FOUND, "%s is missing: rank %d of the %zu ranks that "
                           "saved wrote it (meta.json lists it); the checkpoint is incomplete: "
                           "resume from another one", f, r, files->n);
        else if (!loom_file_exists(f))
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

/* What loading reads: meta.json's tensors, and the ranks' files, each
 * opened when a piece of it is first needed. */
struct loom_state_reader {
    loom_ctx *ctx;
    const char *dir;        /* borrowed: outlives the reader */
    char *path;             /* meta.json, for messages */
    const loom_json *tensors;
    int world;
    loom_safetensors **sf;
    float *scratch;
    size_t cap;
    loom_json *meta;
};

static loom_status damaged(loom_state_reader *R, const char *name, const char *what) {
    return loom_errf(R->ctx, LOOM_ERR_FORMAT, "%s: tensor %s: %s; the checkpoint is damaged: "
                     "resume from another one", R->path, name, what);
}

loom_status loom_state_read(loom_state_reader *R, const char *name, int ndim, int64_t rows,
                            int64_t cols, int k, float *full) {
    loom_ctx *ctx = R->ctx;
    const loom_json *e = loom_json_get(R->tensors, name);
    if (!e)
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s has no tensor %s: it was saved from another "
                         "model or with other settings", R->path, name);
    const loom_json *sh = loom_json_get(e, "shape"), *ps = loom_json_get(e, "pieces");
    if (!sh || sh->type != LOOM_JSON_ARRAY || !ps || ps->type != LOOM_JSON_ARRAY)
        return damaged(R, name, "no \"shape\" or \"pieces\" array");
    const int64_t want[2] = {rows, cols};
    bool same = (int)sh->n == ndim;
    for (int d = 0; same && d < ndim; d++)
        same = sh->items[d]->type == LOOM_JSON_NUMBER && sh->items[d]->is_int &&
               sh->items[d]->i == want[d];
    if (!same)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: tensor %s has another shape than this model's "
                         "[%lld, %lld]: it was saved from another model", R->path, name,
                         (long long)rows, (long long)cols);
    memset(full, 0, sizeof *full * (size_t)(rows * cols));
    int64_t covered = 0;
    char key[400];
    for (size_t i = 0; i < ps->n; i++) {
        const loom_json *a = ps->items[i];
        int64_t x[PIECE_WORDS];
        bool ok = a->type == LOOM_JSON_ARRAY && a->n == PIECE_WORDS;
        for (int j = 0; ok && j < PIECE_WORDS; j++) {
            ok = a->items[j]->type == LOOM_JSON_NUMBER && a->items[j]->is_int;
            x[j] = ok ? a->items[j]->i : 0;
        }
        /* rank, row0, col0, block rows, block cols, f0, len, moments */
        /* every sum below stays far from overflow: each term is checked
         * against the tensor's size (< 2^40 elements) first */
        const int64_t lim = (int64_t)1 << 40;
        ok = ok && x[0] >= 0 && x[0] < R->world && x[1] >= 0 && x[1] <= rows && x[2] >= 0 &&
             x[2] <= cols && x[3] > 0 && x[3] <= lim && x[4] > 0 && x[4] <= cols - x[2] &&
             x[3] <= lim / x[4] && x[5] >= 0 && x[5] <= x[3] * x[4] && x[6] > 0 &&
             x[6] <= x[3] * x[4] - x[5];
        if (!ok) return damaged(R, name, "a piece is not [rank, row0, col0, rows, cols, f0, len, "
                                         "moments] within the tensor");
        if (k && !x[7]) return damaged(R, name, "a piece has no moments (was it frozen?)");
        const int r = (int)x[0];
        if (!R->sf[r]) {
            char file[40], *f;
            loom_state_file_name(r, file);
            if (!(f = loom_path_join(ctx, R->dir, file))) return LOOM_ERR_OOM;
            loom_status st = loom_st_open_file(ctx, f, &R->sf[r]);
            free(f);
            if (st) return st;
        }
        if ((size_t)x[6] > R->cap) {
            float *t = realloc(R->scratch, (size_t)x[6] * sizeof *t);
            if (!t) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory reading %s", name);
            R->scratch = t, R->cap = (size_t)x[6];
        }
        piece_key(key, sizeof key, kind_prefix[k], name, x[5], x[1]); /* a split block's */
        if (!loom_st_find(R->sf[r], key))
            piece_key(key, sizeof key, kind_prefix[k], name, x[5], -1);
        loom_status st = loom_st_read_named(ctx, R->sf[r], key, 1, &x[6], LOOM_F32, R->scratch);
        if (st) return st;
        covered += place(x[1], x[2], x[4], x[5], x[6], R->scratch, rows, cols, full);
    }
    if (covered != rows * cols) {
        char why[160];
        snprintf(why, sizeof why, "its pieces hold %lld of its %lld elements", (long long)covered,
                 (long long)(rows * cols));
        return damaged(R, name, why);
    }
    return LOOM_OK;
}


loom_status loom_state_open(loom_ctx *ctx, const char *dir, loom_state_reader **out) {
    *out = NULL;
    loom_state_reader *R = loom_calloc(ctx, 1, sizeof *R, "a checkpoint reader");
    if (!R) return LOOM_ERR_OOM;
    R->ctx = ctx;
    R->dir = dir;
    int64_t world = 0;
    loom_status st = (R->path = loom_path_join(ctx, dir, "meta.json")) ? LOOM_OK : LOOM_ERR_OOM;
    if (!st) st = loom_verify_state(ctx, dir);
    if (!st) st = loom_json_parse_file(ctx, R->path, &R->meta);
    if (!st) st = loom_json_get_int(ctx, R->meta, "world_size", R->path, &world);
    R->world = (int)world; /* checked by loom_verify_state */
    if (!st && (!(R->tensors = loom_json_get(R->meta, "tensors")) ||
                R->tensors->type != LOOM_JSON_OBJECT))
        st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: no \"tensors\" object", R->path);
    if (!st && !(R->sf = calloc((size_t)world, sizeof *R->sf))) st = LOOM_ERR_OOM;
    if (st) {
        loom_state_close(R);
        return st;
    }
    *out = R;
    return LOOM_OK;
}

const loom_json *loom_state_meta(const loom_state_reader *r) { return r->meta; }
const char *loom_state_meta_path(const loom_state_reader *r) { return r->path; }

void loom_state_close(loom_state_reader *R) {
    if (!R) return;
    for (int r = 0; R->sf && r < R->world; r++) loom_st_close(R->sf[r]);
    free(R->sf);
    free(R->scratch);
    loom_json_free(R->meta);
    free(R->path);
    free(R);
}
