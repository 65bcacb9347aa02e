/* safetensors writer (streaming, sharding, atomic): see safetensors.h. */
#include "safetensors.h"

#include "outdir.h" /* the test hooks */
#include "safetensors_paths.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- writer ---- */

/* Small writes are gathered in a buffer of this size; larger same-dtype
 * tensors go straight from the caller's memory, converted ones in chunks. */
#define WBUF_CAP ((size_t)4 << 20)

typedef struct wtensor {
    char *name;
    loom_dtype dt;
    int ndim;
    int64_t shape[LOOM_MAX_DIMS];
    uint64_t nbytes;
    int shard;
    uint64_t offset; /* within the shard's data */
    uint64_t done;   /* bytes written so far (loom_st_writer_write_part) */
    bool written;
} wtensor;

typedef struct wshard {
    size_t first, count; /* tensors [first, first + count) in declaration order */
    uint64_t data_start; /* 8 + header length */
    char *path, *tmp;
    bool created, complete;
} wshard;

struct loom_st_writer {
    char *dir, *base;
    uint64_t max_shard;
    loom_json *meta;
    wtensor *t;
    size_t n, cap;
    size_t *hash;       /* open addressing: index + 1, 0 = empty */
    size_t hash_cap;
    wshard *shards;
    size_t nshards;
    size_t next;        /* next tensor to write, in declaration order */
    bool planned, finished, failed;
    int fd, cur;        /* the open temporary file and its shard (-1: none) */
    unsigned char *buf; /* pend_len buffered bytes for file offset pend_off */
    size_t pend_len;
    uint64_t pend_off;
    uint64_t written;     /* bytes written so far (the test hook counts them) */
    int files_done;
    loom_out_hooks hooks; /* LOOM_TEST_SAVE_* (outdir.h) */
};

/* Hugging Face's order of dtypes (its Dtype enum, which grows with element
 * size): tensors are laid out by this rank, descending, then by name. That
 * aligns every tensor to its element size and reproduces HF's files. */
static int dtype_rank(loom_dtype dt) {
    static const int rank[LOOM_DTYPE_COUNT] = {
        [LOOM_BOOL] = 0, [LOOM_U8] = 1,   [LOOM_I8] = 2,   [LOOM_I16] = 5,  [LOOM_F16] = 7,
        [LOOM_BF16] = 8, [LOOM_I32] = 9,  [LOOM_F32] = 11, [LOOM_F64] = 12, [LOOM_I64] = 13};
    return rank[dt];
}

static size_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (size_t)h;
}

/* Index of a declared name, or -1. */
static long name_lookup(const loom_st_writer *w, const char *name) {
    if (!w->hash_cap) return -1;
    for (size_t i = hash_str(name) & (w->hash_cap - 1);; i = (i + 1) & (w->hash_cap - 1)) {
        if (!w->hash[i]) return -1;
        if (strcmp(w->t[w->hash[i] - 1].name, name) == 0) return (long)(w->hash[i] - 1);
    }
}

static void hash_insert(size_t *tab, size_t cap, const char *name, size_t idx) {
    size_t i = hash_str(name) & (cap - 1);
    while (tab[i]) i = (i + 1) & (cap - 1);
    tab[i] = idx + 1;
}

loom_status loom_st_writer_create(loom_ctx *ctx, const char *dir, const char *base,
                                  uint64_t max_shard_bytes, const loom_json *metadata,
                                  loom_st_writer **out) {
    *out = NULL;
    if (!dir || !*dir || !base || !*base || strchr(base, '/'))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "safetensors writer: need a directory and a base name without '/' "
                         "(got '%s', '%s')", dir ? dir : "(null)", base ? base : "(null)");
    if (metadata && metadata->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "safetensors writer: metadata must be an object of strings, got %s",
                         loom_json_type_name(metadata->type));
    for (size_t i = 0; metadata && i < metadata->n; i++) {
        const loom_json *v = metadata->items[i];
        if (v->type != LOOM_JSON_STRING || !loom_utf8_valid(v->s, v->slen) ||
            !loom_utf8_valid(metadata->keys[i], strlen(metadata->keys[i])))
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "safetensors writer: metadata['%s'] must be a UTF-8 string, got %s",
                             metadata->keys[i], loom_json_type_name(v->type));
    }
    loom_status s = loom_mkdirs(ctx, dir);
    if (s != LOOM_OK) return s;
    loom_st_writer *w = loom_calloc(ctx, 1, sizeof *w, "a safetensors writer");
    if (!w) return LOOM_ERR_OOM;
    w->max_shard = max_shard_bytes;
    w->fd = w->cur = -1;
    loom_out_hooks_read(&w->hooks);
    w->dir = loom_strdup(ctx, dir);
    w->base = loom_strdup(ctx, base);
    if (!w->dir || !w->base || (metadata && !(w->meta = loom_json_clone(ctx, metadata)))) {
        loom_st_writer_free(w);
        return LOOM_ERR_OOM;
    }
    *out = w;
    return LOOM_OK;
}

loom_status loom_st_writer_declare(loom_ctx *ctx, loom_st_writer *w, const char *name,
                                   loom_dtype dt, int ndim, const int64_t *shape) {
    const loom_status E = LOOM_ERR_INVALID_ARG;
    if (!name) return loom_errf(ctx, E, "safetensors writer: NULL tensor name");
    if (w->planned)
        return loom_errf(ctx, E, "safetensors writer: cannot declare '%s' after writing has "
                                 "started: declare every tensor first", name);
    if (strcmp(name, "__metadata__") == 0 || !loom_utf8_valid(name, strlen(name)))
        return loom_errf(ctx, E, "safetensors writer: '%s' cannot be a tensor name (reserved or "
                                 "not UTF-8)", name);
    if ((int)dt < 0 || dt >= LOOM_DTYPE_COUNT)
        return loom_errf(ctx, E, "safetensors writer: tensor '%s': bad dtype %d", name, (int)dt);
    if (ndim < 0 || ndim > LOOM_MAX_DIMS || (ndim > 0 && !shape))
        return loom_errf(ctx, E, "safetensors writer: tensor '%s': %d dimensions (0 to %d "
                                 "allowed)", name, ndim, LOOM_MAX_DIMS);
    uint64_t numel = 1, nbytes;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || __builtin_mul_overflow(numel, (uint64_t)shape[i], &numel))
            return loom_errf(ctx, E, "safetensors writer: tensor '%s': bad shape (dimension %d "
                                     "is %" PRId64 ", or the size overflows)", name, i, shape[i]);
    if (__builtin_mul_overflow(numel, (uint64_t)loom_dtype_size(dt), &nbytes) ||
        nbytes > (uint64_t)INT64_MAX || nbytes > (uint64_t)SIZE_MAX)
        return loom_errf(ctx, E, "safetensors writer: tensor '%s' is too large", name);
    if (name_lookup(w, name) >= 0)
        return loom_errf(ctx, E, "safetensors writer: tensor '%s' is declared twice", name);
    if (w->n == w->cap) {
        size_t cap = w->cap ? w->cap * 2 : 64;
        wtensor *p = loom_realloc(ctx, w->t, cap * sizeof *p, "safetensors writer tensors");
        if (!p) return LOOM_ERR_OOM;
        w->t = p;
        w->cap = cap;
    }
    if ((w->n + 1) * 2 > w->hash_cap) { /* keep the table at most half full */
        size_t cap = w->hash_cap ? w->hash_cap * 2 : 128;
        size_t *tab = loom_calloc(ctx, cap, sizeof *tab, "safetensors writer names");
        if (!tab) return LOOM_ERR_OOM;
        for (size_t i = 0; i < w->n; i++) hash_insert(tab, cap, w->t[i].name, i);
        free(w->hash);
        w->hash = tab;
        w->hash_cap = cap;
    }
    wtensor *t = memset(&w->t[w->n], 0, sizeof *w->t);
    if (!(t->name = loom_strdup(ctx, name))) return LOOM_ERR_OOM;
    t->dt = dt;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->nbytes = nbytes;
    hash_insert(w->hash, w->hash_cap, name, w->n++);
    return LOOM_OK;
}

static int layout_cmp(const wtensor *x, const wtensor *y) {
    int rx = dtype_rank(x->dt), ry = dtype_rank(y->dt);
    return rx != ry ? ry - rx : strcmp(x->name, y->name);
}

/* Merge sort of tensor indices into file order (tmp holds n entries). */
static void layout_sort(const wtensor *t, size_t *idx, size_t *tmp, size_t n) {
    if (n < 2) return;
    size_t h = n / 2, i = 0, j = h, k = 0;
    layout_sort(t, idx, tmp, h);
    layout_sort(t, idx + h, tmp, n - h);
    while (i < h && j < n) tmp[k++] = layout_cmp(&t[idx[i]], &t[idx[j]]) <= 0 ? idx[i++] : idx[j++];
    while (i < h) tmp[k++] = idx[i++];
    while (j < n) tmp[k++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *tmp);
}

/* Assigns shards (a new one when the next tensor would take the current past
 * max_shard) and file names; freezes the declarations. */
static loom_status plan(loom_ctx *ctx, loom_st_writer *w) {
    size_t ns = 0, cnt = 0;
    uint64_t cur = 0;
    for (size_t i = 0; i < w->n; i++) {
        uint64_t nb = w->t[i].nbytes;
        if (cnt > 0 && w->max_shard && (cur + nb < cur || cur + nb > w->max_shard))
            ns++, cur = 0, cnt = 0;
        w->t[i].shard = (int)ns;
        cur += nb;
        cnt++;
    }
    w->planned = true;
    w->nshards = ns + 1;
    if (!(w->shards = loom_calloc(ctx, w->nshards, sizeof *w->shards, "safetensors shards"))) {
        w->nshards = 0;
        return LOOM_ERR_OOM;
    }
    for (size_t i = 0; i < w->n; i++) {
        wshard *sh = &w->shards[w->t[i].shard];
        if (sh->count++ == 0) sh->first = i;
    }
    for (size_t i = 0; i < w->nshards; i++) {
        char leaf[64];
        snprintf(leaf, sizeof leaf, "-%05zu-of-%05zu.safetensors", i + 1, w->nshards);
        const char *suffix = w->nshards == 1 ? ".safetensors" : leaf;
        w->shards[i].path = loom_st_dir_file(ctx, w->dir, w->base, suffix);
        if (!w->shards[i].path) return LOOM_ERR_OOM;
        if (!(w->shards[i].tmp = loom_st_dir_file(ctx, NULL, w->shards[i].path, ".tmp")))
            return LOOM_ERR_OOM;
    }
    return LOOM_OK;
}

/* Shard si's header; sets its tensors' offsets and data_start. */
static loom_status build_header(loom_ctx *ctx, loom_st_writer *w, size_t si, loom_sb *sb) {
    wshard *sh = &w->shards[si];
    size_t *idx = loom_malloc(ctx, (2 * sh->count + 1) * sizeof *idx, "safetensors layout");
    if (!idx) return LOOM_ERR_OOM;
    for (size_t i = 0; i < sh->count; i++) idx[i] = sh->first + i;
    layout_sort(w->t, idx, idx + sh->count, sh->count);
    /* compact JSON like HF's writer: "__metadata__" first, then file order */
    loom_sb_putc(sb, '{');
    if (w->meta) {
        loom_sb_puts(sb, "\"__metadata__\":{");
        for (size_t i = 0; i < w->meta->n; i++) {
            if (i) loom_sb_putc(sb, ',');
            loom_json_write_string(sb, w->meta->keys[i], strlen(w->meta->keys[i]));
            loom_sb_putc(sb, ':');
            loom_json_write_string(sb, w->meta->items[i]->s, w->meta->items[i]->slen);
        }
        loom_sb_putc(sb, '}');
    }
    uint64_t off = 0;
    for (size_t k = 0; k < sh->count; k++) {
        wtensor *t = &w->t[idx[k]];
        if (k || w->meta) loom_sb_putc(sb, ',');
        loom_json_write_string(sb, t->name, strlen(t->name));
        loom_sb_printf(sb, ":{\"dtype\":\"%s\",\"shape\":[", loom_dtype_name(t->dt));
        for (int d = 0; d < t->ndim; d++)
            loom_sb_printf(sb, "%s%" PRId64, d ? "," : "", t->shape[d]);
        t->offset = off;
        off += t->nbytes;
        loom_sb_printf(sb, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", t->offset, off);
    }
    loom_sb_putc(sb, '}');
    while ((8 + sb->len) % 8) loom_sb_putc(sb, ' '); /* the data starts 8-byte aligned */
    free(idx);
    if (sb->failed) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory building a header");
    sh->data_start = 8 + (uint64_t)sb->len;
    return LOOM_OK;
}

/* Writes n bytes at offset off of the open temporary file. */
static loom_status write_at(loom_ctx *ctx, loom_st_writer *w, const void *p, size_t n,
                            uint64_t off) {
    for (const char *c = p; n;) {
        size_t k = n > ((size_t)1 << 30) ? (size_t)1 << 30 : n;
        const uint64_t lim = w->hooks.fail_after_bytes; /* a full disk, simulated: N + 1 */
        if (lim && w->written + k > lim - 1) k = (size_t)(lim - 1 - w->written);
        ssize_t r = k ? pwrite(w->fd, c, k, (off_t)off) : (errno = ENOSPC, -1);
        if (r < 0 && errno == EINTR) continue;
        if (r > 0) w->written += (uint64_t)r;
        if (r <= 0) {
            const bool full = r == 0 || errno == ENOSPC || errno == EDQUOT;
            return loom_errf(ctx, LOOM_ERR_IO, "%s: write failed: %s%s", w->shards[w->cur].tmp,
                             r < 0 ? strerror(errno) : "no progress",
                             full ? "; the disk is full: free some space or write elsewhere" : "");
        }
        c += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return LOOM_OK;
}

static loom_status flush_buf(loom_ctx *ctx, loom_st_writer *w) {
    loom_status s = w->pend_len ? write_at(ctx, w, w->buf, w->pend_len, w->pend_off) : LOOM_OK;
    w->pend_len = 0;
    return s;
}

/* Room for n (<= WBUF_CAP) bytes at file offset off; the caller fills it and
 * commits with w->pend_len += n. */
static loom_status reserve(loom_ctx *ctx, loom_st_writer *w, uint64_t off, size_t n,
                           unsigned char **out) {
    loom_status s = LOOM_OK;
    if (w->pend_len && (off != w->pend_off + w->pend_len || w->pend_len + n > WBUF_CAP))
        s = flush_buf(ctx, w);
    if (!w->pend_len) w->pend_off = off;
    *out = w->buf + w->pend_len;
    return s;
}

/* Writes bytes at a file offset: gathered when small, directly when large. */
static loom_status put(loom_ctx *ctx, loom_st_writer *w, uint64_t off, const void *p, size_t n) {
    unsigned char *dst;
    loom_status s;
    if (n >= WBUF_CAP / 2)
        return (s = flush_buf(ctx, w)) != LOOM_OK ? s : write_at(ctx, w, p, n, off);
    if ((s = reserve(ctx, w, off, n, &dst)) != LOOM_OK) return s;
    memcpy(dst, p, n);
    w->pend_len += n;
    return LOOM_OK;
}

/* Creates shard si's temporary file and writes its header. */
static loom_status start_shard(loom_ctx *ctx, loom_st_writer *w, size_t si) {
    wshard *sh = &w->shards[si];
    loom_sb hdr;
    loom_sb_init(&hdr);
    loom_status s = build_header(ctx, w, si, &hdr);
    if (s == LOOM_OK && (w->fd = open(sh->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)) < 0)
        s = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot create: %s", sh->tmp, strerror(errno));
    if (s == LOOM_OK) {
        sh->created = true;
        w->cur = (int)si;
        unsigned char len8[8];
        for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)hdr.len >> (8 * i));
        s = put(ctx, w, 0, len8, 8);
        if (s == LOOM_OK) s = put(ctx, w, 8, hdr.buf, hdr.len);
    }
    loom_sb_free(&hdr);
    return s;
}

/* Flushes, fsyncs and closes the open shard (still under its temporary name). */
static loom_status complete_shard(loom_ctx *ctx, loom_st_writer *w) {
    wshard *sh = &w->shards[w->cur];
    loom_status s = flush_buf(ctx, w);
    if (s == LOOM_OK && fsync(w->fd) != 0)
        s = loom_errf(ctx, LOOM_ERR_IO, "%s: fsync failed: %s", sh->tmp, strerror(errno));
    if (close(w->fd) != 0 && s == LOOM_OK)
        s = loom_errf(ctx, LOOM_ERR_IO, "%s: close failed: %s", sh->tmp, strerror(errno));
    w->fd = w->cur = -1;
    sh->complete = s == LOOM_OK;
    if (s == LOOM_OK && ++w->files_done == w->hooks.pause_after_file)
        loom_out_hook_pause(sh->tmp);
    return s;
}

/* Lays the declarations out and allocates the write buffer (first write or finish). */
static loom_status prepare(loom_ctx *ctx, loom_st_writer *w) {
    loom_status s = w->planned ? LOOM_OK : plan(ctx, w);
    if (s == LOOM_OK && !w->buf && !(w->buf = loom_malloc(ctx, WBUF_CAP, "a write buffer")))
        s = LOOM_ERR_OOM;
    return s;
}

/* numel elements of tensor `name` from data, after the `done` bytes already
 * written (whole: the tensor in one call). */
static loom_status write_elems(loom_ctx *ctx, loom_st_writer *w, const char *name,
                               loom_dtype src_dt, const void *data, uint64_t numel, bool whole) {
    const loom_status E = LOOM_ERR_INVALID_ARG;
    if (w->failed) return loom_errf(ctx, LOOM_ERR_IO, "safetensors writer: an earlier call failed");
    if (w->finished) return loom_errf(ctx, E, "safetensors writer: already finished");
    long ti = name ? name_lookup(w, name) : -1;
    if (ti < 0)
        return loom_errf(ctx, E, "safetensors writer: tensor '%s' was not declared",
                         name ? name : "(null)");
    if ((size_t)ti != w->next && w->t[ti].written)
        return loom_errf(ctx, E, "safetensors writer: tensor '%s' was already written", name);
    if ((size_t)ti != w->next)
        return loom_errf(ctx, E, "safetensors writer: tensor '%s' written out of order: the next "
                                 "one to write is '%s' (write in declaration order)", name,
                         w->t[w->next].name);
    wtensor *t = &w->t[ti];
    const size_t dsz = loom_dtype_size(t->dt);
    if (whole && t->done)
        return loom_errf(ctx, E,
                         "safetensors writer: tensor '%s' is being written in parts "
                         "(%" PRIu64 " of %" PRIu64 " elements): write the rest in parts",
                         name, t->done / dsz, t->nbytes / dsz);
    if (whole) numel = t->nbytes / dsz;
    if (numel > (t->nbytes - t->done) / dsz)
        return loom_errf(ctx, E,
                         "safetensors writer: tensor '%s': %" PRIu64 " more elements, "
                         "but %" PRIu64 " of its %" PRIu64 " are left to write",
                         name, numel, (t->nbytes - t->done) / dsz, t->nbytes / dsz);
    if ((int)src_dt < 0 || src_dt >= LOOM_DTYPE_COUNT || (numel && !data))
        return loom_errf(ctx, E, "safetensors writer: tensor '%s': bad source dtype %d or NULL "
                                 "data", name, (int)src_dt);
    const size_t ssz = loom_dtype_size(src_dt);
    loom_status s = prepare(ctx, w);
    if (s == LOOM_OK && !w->shards[t->shard].created) s = start_shard(ctx, w, (size_t)t->shard);
    if (s != LOOM_OK) goto fail;
    wshard *sh = &w->shards[t->shard];
    uint64_t off = sh->data_start + t->offset + t->done;
    if (src_dt == t->dt) {
        if ((s = put(ctx, w, off, data, (size_t)(numel * dsz))) != LOOM_OK) goto fail;
    } else { /* convert in chunks straight into the write buffer */
        size_t per = WBUF_CAP / dsz;
        for (size_t i = 0; i < numel; i += per) {
            size_t k = numel - i < per ? numel - i : per;
            unsigned char *dst;
            if ((s = reserve(ctx, w, off + (uint64_t)i * dsz, k * dsz, &dst)) != LOOM_OK) goto fail;
            if (loom_convert(ctx, dst, t->dt, (const char *)data + i * ssz, src_dt, k) != LOOM_OK) {
                /* not committed: the elements may be written again */
                if (i > 0) loom_err_prefix(ctx, "in the chunk from element %zu", i);
                return loom_err_prefix(ctx, "safetensors writer: tensor '%s' (%s to %s)", name,
                                       loom_dtype_name(src_dt), loom_dtype_name(t->dt));
            }
            w->pend_len += k * dsz;
        }
    }
    t->done += numel * dsz;
    if (t->done < t->nbytes) return LOOM_OK;
    t->written = true;
    if (++w->next == sh->first + sh->count && (s = complete_shard(ctx, w)) != LOOM_OK) goto fail;
    return LOOM_OK;
fail:
    w->failed = true;
    return s;
}

loom_status loom_st_writer_write(loom_ctx *ctx, loom_st_writer *w, const char *name,
                                 loom_dtype src_dt, const void *data) {
    return write_elems(ctx, w, name, src_dt, data, 0, true);
}

loom_status loom_st_writer_write_part(loom_ctx *ctx, loom_st_writer *w, const char *name,
                                      loom_dtype src_dt, const void *data, uint64_t numel) {
    return write_elems(ctx, w, name, src_dt, data, numel, false);
}

/* The index, like transformers writes it: {"metadata": {"total_size": N},
 * "weight_map": {name: shard file}}, names sorted, indent 2. */
static loom_status write_index(loom_ctx *ctx, loom_st_writer *w, const char *path) {
    uint64_t total = 0;
    for (size_t i = 0; i < w->n; i++) total += w->t[i].nbytes;
    loom_json *root = loom_json_new_object(ctx), *meta = loom_json_new_object(ctx),
              *wm = loom_json_new_object(ctx);
    char **names = loom_malloc(ctx, (w->n ? w->n : 1) * sizeof *names, "index names");
    loom_status s = root && meta && wm && names ? LOOM_OK : LOOM_ERR_OOM;
    if (s == LOOM_OK) {
        for (size_t i = 0; i < w->n; i++) names[i] = w->t[i].name;
        qsort(names, w->n, sizeof *names, loom_st_cmp_names);
        s = loom_json_set(ctx, meta, "total_size", loom_json_new_int(ctx, (int64_t)total));
    }
    for (size_t i = 0; i < w->n && s == LOOM_OK; i++) {
        const char *shard = w->shards[w->t[name_lookup(w, names[i])].shard].path;
        s = loom_json_set(ctx, wm, names[i], loom_json_new_str(ctx, loom_st_leaf(shard)));
    }
    if (s == LOOM_OK) s = loom_json_set(ctx, root, "metadata", meta);
    meta = NULL; /* owned by root now, or freed by loom_json_set */
    if (s == LOOM_OK) s = loom_json_set(ctx, root, "weight_map", wm);
    wm = NULL;
    loom_sb sb;
    loom_sb_init(&sb);
    if (s == LOOM_OK) s = loom_json_write(ctx, root, 2, &sb);
    if (s == LOOM_OK && sb.failed) s = loom_errf(ctx, LOOM_ERR_OOM, "out of memory for %s", path);
    if (s == LOOM_OK) s = loom_write_file_atomic(ctx, path, sb.buf, sb.len);
    loom_sb_free(&sb);
    loom_json_free(root);
    loom_json_free(meta);
    loom_json_free(wm);
    free(names);
    return s;
}

loom_status loom_st_writer_finish(loom_ctx *ctx, loom_st_writer *w) {
    if (w->failed) return loom_errf(ctx, LOOM_ERR_IO, "safetensors writer: an earlier call failed");
    if (w->finished) return LOOM_OK;
    if (w->next < w->n) {
        char list[512] = "";
        size_t left = w->n - w->next, o = 0;
        for (size_t i = w->next; i < w->n && i < w->next + 5 && o < sizeof list; i++)
            o += (size_t)snprintf(list + o, sizeof list - o, "%s'%s'", i > w->next ? ", " : "",
                                  w->t[i].name);
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "safetensors writer: finish() with %zu declared tensor%s not written: "
                         "%s%s", left, left == 1 ? "" : "s", list, left > 5 ? ", ..." : "");
    }
    loom_status s = prepare(ctx, w);
    /* a checkpoint without tensors still gets its (header-only) file */
    for (size_t i = 0; i < w->nshards && s == LOOM_OK; i++) {
        if (!w->shards[i].created) s = start_shard(ctx, w, i);
        if (s == LOOM_OK && !w->shards[i].complete) s = complete_shard(ctx, w);
    }
    for (size_t i = 0; i < w->nshards && s == LOOM_OK; i++) {
        if (rename(w->shards[i].tmp, w->shards[i].path) != 0)
            s = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot rename to %s: %s", w->shards[i].tmp,
                          w->shards[i].path, strerror(errno));
        else
            w->shards[i].created = false; /* nothing left to clean up */
    }
    /* the index (or its absence) decides how the directory is read: write it
     * last, and remove a stale one (or a stale single file) of an earlier save */
    char *index_path = s == LOOM_OK ? loom_st_dir_file(ctx, w->dir, w->base, ".safetensors.index.json")
                                    : NULL;
    char *single_path = index_path ? loom_st_dir_file(ctx, w->dir, w->base, ".safetensors") : NULL;
    if (s == LOOM_OK && !single_path) s = LOOM_ERR_OOM;
    if (s == LOOM_OK && w->nshards == 1 && loom_file_exists(index_path) && unlink(index_path) != 0)
        s = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot remove the stale index: %s", index_path,
                      strerror(errno));
    if (s == LOOM_OK && w->nshards > 1 && (s = write_index(ctx, w, index_path)) == LOOM_OK &&
        loom_file_exists(single_path))
        unlink(single_path);
    free(index_path);
    free(single_path);
    if (s != LOOM_OK) {
        w->failed = true;
        return s;
    }
    int dfd = open(w->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); /* make the renames durable */
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    w->finished = true;
    return LOOM_OK;
}

void loom_st_writer_free(loom_st_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    for (size_t i = 0; i < w->nshards; i++) {
        if (w->shards[i].created && !w->finished && w->shards[i].tmp) unlink(w->shards[i].tmp);
        free(w->shards[i].path);
        free(w->shards[i].tmp);
    }
    free(w->shards);
    for (size_t i = 0; i < w->n; i++) free(w->t[i].name);
    free(w->t);
    free(w->hash);
    free(w->buf);
    loom_json_free(w->meta);
    free(w->dir);
    free(w->base);
    free(w);
}
