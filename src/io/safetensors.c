/* safetensors reader (mmap, validated before use) and streaming, sharding writer.
 * See safetensors.h for the format and the rules. */
#include "safetensors.h"

#include "outdir.h" /* the test hooks */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- shared helpers ---- */

/* "[2, 3]" into buf. */
static const char *fmt_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* [dir/]<base><suffix> as a new string (NULL with an error set on OOM). */
static char *dir_file(loom_ctx *ctx, const char *dir, const char *base, const char *suffix) {
    loom_sb sb;
    loom_sb_init(&sb);
    if (dir) {
        loom_sb_puts(&sb, dir);
        if (sb.len && sb.buf[sb.len - 1] != '/') loom_sb_putc(&sb, '/');
    }
    loom_sb_puts(&sb, base);
    loom_sb_puts(&sb, suffix);
    if (!sb.failed) return loom_sb_take(&sb);
    loom_sb_free(&sb);
    loom_errf(ctx, LOOM_ERR_OOM, "out of memory building a path for %s", base);
    return NULL;
}

static const char *leaf_of(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* ---- reader ---- */

typedef struct st_file {
    char *path;                /* path, or the `what` of a buffer */
    const unsigned char *base; /* file image */
    size_t len;
    bool mapped;               /* base is an mmap of len bytes */
    loom_json *header;         /* parsed header; tensor names point into it */
} st_file;

struct loom_safetensors {
    st_file *files;
    size_t nfiles;
    loom_st_tensor *t;
    size_t n, cap;
    uint64_t total;
    char **views; /* (nviews) the name blocks of loom_st_splice's entries */
    size_t nviews;
};

void loom_st_close(loom_safetensors *st) {
    if (!st) return;
    for (size_t i = 0; i < st->nfiles; i++) {
        if (st->files[i].mapped) munmap((void *)st->files[i].base, st->files[i].len);
        loom_json_free(st->files[i].header);
        free(st->files[i].path);
    }
    for (size_t i = 0; i < st->nviews; i++) free(st->views[i]);
    free(st->views);
    free(st->files);
    free(st->t);
    free(st);
}

/* Appends an empty file entry named `path`. */
static st_file *add_file(loom_ctx *ctx, loom_safetensors *st, const char *path) {
    st_file *f = loom_realloc(ctx, st->files, (st->nfiles + 1) * sizeof *f, "safetensors files");
    if (!f) return NULL;
    st->files = f;
    f = memset(&st->files[st->nfiles], 0, sizeof *f);
    if (!(f->path = loom_strdup(ctx, path))) return NULL;
    st->nfiles++;
    return f;
}

/* "<what>: tensor '<name>': <message>" */
static loom_status entry_err(loom_ctx *ctx, loom_status s, const char *what, const char *name,
                             const char *fmt, ...) LOOM_PRINTF(5, 6);
static loom_status entry_err(loom_ctx *ctx, loom_status s, const char *what, const char *name,
                             const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return loom_errf(ctx, s, "%s: tensor '%s': %s", what, name, msg);
}

static bool json_uint(const loom_json *v, int64_t *out) {
    if (!v || v->type != LOOM_JSON_NUMBER || !v->is_int || v->i < 0) return false;
    *out = v->i;
    return true;
}

/* Validates one header entry into *t (all but data and file) and *begin. */
static loom_status parse_entry(loom_ctx *ctx, const char *what, const char *name,
                               const loom_json *e, uint64_t data_size, loom_st_tensor *t,
                               uint64_t *begin) {
    const loom_status F = LOOM_ERR_FORMAT;
    if (e->type != LOOM_JSON_OBJECT)
        return entry_err(ctx, F, what, name,
                         "entry must be an object with dtype, shape and data_offsets, got %s",
                         loom_json_type_name(e->type));
    static const char *fields[3] = {"dtype", "shape", "data_offsets"};
    for (size_t i = 0; i < e->n; i++)
        if (strcmp(e->keys[i], fields[0]) && strcmp(e->keys[i], fields[1]) &&
            strcmp(e->keys[i], fields[2]))
            return entry_err(ctx, F, what, name,
                             "unexpected field '%s' (an entry has exactly dtype, shape and "
                             "data_offsets)", e->keys[i]);
    for (int i = 0; i < 3; i++)
        if (!loom_json_get(e, fields[i]))
            return entry_err(ctx, F, what, name, "missing field '%s'", fields[i]);
    memset(t, 0, sizeof *t);
    t->name = name;

    const loom_json *dt = loom_json_get(e, "dtype");
    if (dt->type != LOOM_JSON_STRING)
        return entry_err(ctx, F, what, name, "'dtype' must be a string, got %s",
                         loom_json_type_name(dt->type));
    if (strlen(dt->s) != dt->slen || loom_dtype_from_name(dt->s, &t->dtype) != 0)
        return entry_err(ctx, LOOM_ERR_UNSUPPORTED, what, name,
                         "unknown dtype '%s' (loom reads F64, F32, F16, BF16, I64, I32, I16, I8, "
                         "U8, BOOL)", dt->s);

    const loom_json *sh = loom_json_get(e, "shape");
    if (sh->type != LOOM_JSON_ARRAY)
        return entry_err(ctx, F, what, name, "'shape' must be an array of integers, got %s",
                         loom_json_type_name(sh->type));
    if (sh->n > LOOM_MAX_DIMS)
        return entry_err(ctx, LOOM_ERR_UNSUPPORTED, what, name,
                         "shape has %zu dimensions, more than loom's limit of %d", sh->n,
                         LOOM_MAX_DIMS);
    t->ndim = (int)sh->n;
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t i = 0; i < sh->n; i++) {
        const loom_json *d = sh->items[i];
        if (d->type == LOOM_JSON_NUMBER && d->is_int && d->i < 0)
            return entry_err(ctx, F, what, name,
                             "shape[%zu] is %" PRId64 ": dimensions must be non-negative", i, d->i);
        if (d->type != LOOM_JSON_NUMBER || !d->is_int)
            return entry_err(ctx, F, what, name,
                             "shape[%zu] must be a non-negative integer, got %s", i,
                             d->type == LOOM_JSON_NUMBER ? "a non-integer or out-of-range number"
                                                         : loom_json_type_name(d->type));
        t->shape[i] = d->i;
        overflow |= __builtin_mul_overflow(numel, (uint64_t)d->i, &numel);
    }
    char sb[256];
    overflow |= __builtin_mul_overflow(numel, (uint64_t)loom_dtype_size(t->dtype), &t->nbytes);
    if (overflow || t->nbytes > (uint64_t)SIZE_MAX || t->nbytes > (uint64_t)INT64_MAX)
        return entry_err(ctx, F, what, name, "shape %s of %s is too large (its size overflows)",
                         fmt_shape(sb, sizeof sb, t->ndim, t->shape), loom_dtype_name(t->dtype));
    t->numel = numel;

    const loom_json *off = loom_json_get(e, "data_offsets");
    int64_t b, en;
    if (off->type != LOOM_JSON_ARRAY || off->n != 2 || !json_uint(off->items[0], &b) ||
        !json_uint(off->items[1], &en))
        return entry_err(ctx, F, what, name,
                         "'data_offsets' must be an array of two non-negative integers [begin, "
                         "end]");
    if (b > en)
        return entry_err(ctx, F, what, name,
                         "data_offsets [%" PRId64 ", %" PRId64 "]: begin is past end", b, en);
    if ((uint64_t)en > data_size)
        return entry_err(ctx, F, what, name,
                         "data_offsets [%" PRId64 ", %" PRId64 "] run past the end of the data "
                         "(%" PRIu64 " bytes): the file is truncated or corrupt", b, en, data_size);
    if ((uint64_t)(en - b) != t->nbytes)
        return entry_err(ctx, F, what, name,
                         "data_offsets [%" PRId64 ", %" PRId64 "] hold %" PRId64 " bytes, but "
                         "shape %s of %s needs %" PRIu64, b, en, en - b,
                         fmt_shape(sb, sizeof sb, t->ndim, t->shape), loom_dtype_name(t->dtype),
                         t->nbytes);
    *begin = (uint64_t)b;
    return LOOM_OK;
}

typedef struct span {
    uint64_t begin, end;
    const char *name;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Rewrites a JSON parser error ("<what>: line L, column C: problem") as a
 * safetensors header error. */
static loom_status header_json_error(loom_ctx *ctx, loom_status st, const char *what) {
    if (!ctx || st == LOOM_ERR_OOM) return st;
    char msg[LOOM_ERR_MAX];
    snprintf(msg, sizeof msg, "%s", ctx->err);
    const char *rest = msg;
    size_t wl = strlen(what);
    if (strncmp(rest, what, wl) == 0 && strncmp(rest + wl, ": ", 2) == 0) rest += wl + 2;
    return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: %s: %s", what,
                     strstr(rest, "duplicate") ? "duplicate tensor name in the header"
                                               : "header is not valid JSON", rest);
}

static loom_status check_metadata(loom_ctx *ctx, const char *what, const loom_json *m) {
    if (m->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: __metadata__ must be an object of string values, got %s", what,
                         loom_json_type_name(m->type));
    for (size_t k = 0; k < m->n; k++)
        if (m->items[k]->type != LOOM_JSON_STRING)
            return loom_errf(ctx, LOOM_ERR_FORMAT,
                             "%s: __metadata__ must be an object of string values, but '%s' is %s",
                             what, m->keys[k], loom_json_type_name(m->items[k]->type));
    return LOOM_OK;
}

/* Parses and validates the image of file `fi` and appends its tensors. */
static loom_status parse_image(loom_ctx *ctx, loom_safetensors *st, int fi) {
    st_file *f = &st->files[fi];
    const char *what = f->path;
    if (f->len < 8)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: truncated: file is %zu bytes, but a safetensors file starts with "
                         "an 8-byte header length", what, f->len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | f->base[i];
    if (hlen > LOOM_ST_MAX_HEADER)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: header length %" PRIu64 " is over the limit of %u bytes: the file "
                         "is corrupt or not safetensors", what, hlen, LOOM_ST_MAX_HEADER);
    if (hlen > f->len - 8)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: header length %" PRIu64 " runs past the end of the file (%zu "
                         "bytes): the file is truncated or not safetensors", what, hlen, f->len);
    loom_status s = loom_json_parse(ctx, (const char *)f->base + 8, (size_t)hlen, what, &f->header);
    if (s != LOOM_OK) {
        f->header = NULL;
        return header_json_error(ctx, s, what);
    }
    const loom_json *h = f->header;
    if (h->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: header is not a JSON object (got %s)", what,
                         loom_json_type_name(h->type));
    const unsigned char *data = f->base + 8 + hlen;
    uint64_t data_size = (uint64_t)(f->len - 8 - (size_t)hlen);

    span *spans = loom_malloc(ctx, (h->n ? h->n : 1) * sizeof *spans, "safetensors spans");
    if (!spans) return LOOM_ERR_OOM;
    size_t nspans = 0;
    for (size_t i = 0; i < h->n && s == LOOM_OK; i++) {
        if (strcmp(h->keys[i], "__metadata__") == 0) {
            s = check_metadata(ctx, what, h->items[i]);
            continue;
        }
        loom_st_tensor t;
        uint64_t begin = 0;
        s = parse_entry(ctx, what, h->keys[i], h->items[i], data_size, &t, &begin);
        if (s != LOOM_OK) break;
        t.data = data + begin;
        t.file = fi;
        if (st->n == st->cap) {
            size_t cap = st->cap ? st->cap * 2 : 64;
            loom_st_tensor *p = loom_realloc(ctx, st->t, cap * sizeof *p, "safetensors tensors");
            if (!p) {
                s = LOOM_ERR_OOM;
                break;
            }
            st->t = p;
            st->cap = cap;
        }
        st->t[st->n++] = t;
        if (t.nbytes) spans[nspans++] = (span){begin, begin + t.nbytes, h->keys[i]};
    }
    /* overlap: sorted by begin, each must start at or after the furthest end so
     * far (zero-byte tensors occupy nothing and are not in the list) */
    if (s == LOOM_OK && nspans > 1) qsort(spans, nspans, sizeof *spans, cmp_span);
    for (size_t i = 1, far = 0; s == LOOM_OK && i < nspans; i++) {
        if (spans[i].begin < spans[far].end)
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: tensors '%s' and '%s' overlap (bytes [%" PRIu64 ", %" PRIu64
                          ") and [%" PRIu64 ", %" PRIu64 "))", what, spans[far].name,
                          spans[i].name, spans[far].begin, spans[far].end, spans[i].begin,
                          spans[i].end);
        if (spans[i].end > spans[far].end) far = i;
    }
    free(spans);
    return s;
}

static int cmp_tensor(const void *a, const void *b) {
    const loom_st_tensor *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    return c ? c : x->file - y->file;
}

/* Sorts by name, refuses duplicates, sums bytes. */
static loom_status finalize(loom_ctx *ctx, loom_safetensors *st) {
    if (st->n > 1) qsort(st->t, st->n, sizeof *st->t, cmp_tensor);
    st->total = 0;
    for (size_t i = 0; i < st->n; i++) {
        if (i > 0 && strcmp(st->t[i - 1].name, st->t[i].name) == 0) {
            const char *a = st->files[st->t[i - 1].file].path, *b = st->files[st->t[i].file].path;
            if (st->t[i - 1].file == st->t[i].file)
                return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: duplicate tensor name '%s'", a,
                                 st->t[i].name);
            return loom_errf(ctx, LOOM_ERR_FORMAT,
                             "duplicate tensor name '%s': it is in both %s and %s", st->t[i].name,
                             a, b);
        }
        st->total += st->t[i].nbytes;
    }
    return LOOM_OK;
}

/* Hands a new handle to *out, or closes it when s is an error. */
static loom_status finish_open(loom_ctx *ctx, loom_safetensors *st, loom_status s,
                               loom_safetensors **out) {
    if (s == LOOM_OK) s = finalize(ctx, st);
    if (s != LOOM_OK) {
        loom_st_close(st);
        return s;
    }
    *out = st;
    return LOOM_OK;
}

loom_status loom_st_open_buffer(loom_ctx *ctx, const void *buf, size_t len, const char *what,
                                loom_safetensors **out) {
    *out = NULL;
    loom_safetensors *st = loom_calloc(ctx, 1, sizeof *st, "a safetensors handle");
    if (!st) return LOOM_ERR_OOM;
    st_file *f = add_file(ctx, st, what ? what : "(buffer)");
    if (!f) return finish_open(ctx, st, LOOM_ERR_OOM, out);
    f->base = buf && len ? buf : (const unsigned char *)"";
    f->len = buf ? len : 0;
    return finish_open(ctx, st, parse_image(ctx, st, 0), out);
}

/* Maps `path` read-only into a new file entry and parses it. */
static loom_status map_and_parse(loom_ctx *ctx, loom_safetensors *st, const char *path) {
    st_file *f = add_file(ctx, st, path);
    if (!f) return LOOM_ERR_OOM;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return loom_errf(ctx, e == ENOENT ? LOOM_ERR_NOT_FOUND : LOOM_ERR_IO,
                         "%s: cannot open: %s", path, strerror(e));
    }
    struct stat sb;
    const char *problem = NULL;
    if (fstat(fd, &sb) != 0)
        problem = strerror(errno);
    else if (!S_ISREG(sb.st_mode))
        problem = "not a regular file";
    else if ((uint64_t)sb.st_size > (uint64_t)SIZE_MAX)
        problem = "too large to map";
    f->base = (const unsigned char *)"";
    if (!problem && sb.st_size > 0) {
        void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            problem = strerror(errno);
        } else {
            f->base = p;
            f->len = (size_t)sb.st_size;
            f->mapped = true;
        }
    }
    close(fd);
    if (problem) return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot map: %s", path, problem);
    return parse_image(ctx, st, (int)(st->nfiles - 1));
}

loom_status loom_st_open_file(loom_ctx *ctx, const char *path, loom_safetensors **out) {
    *out = NULL;
    loom_safetensors *st = loom_calloc(ctx, 1, sizeof *st, "a safetensors handle");
    if (!st) return LOOM_ERR_OOM;
    return finish_open(ctx, st, map_and_parse(ctx, st, path), out);
}

/* A shard name from an index must be a plain file name in the directory. */
static bool shard_name_ok(const loom_json *v) {
    return v->type == LOOM_JSON_STRING && v->slen > 0 && strlen(v->s) == v->slen &&
           !strchr(v->s, '/') && !strchr(v->s, '\\') && !strstr(v->s, "..") &&
           strcmp(v->s, ".") != 0;
}

/* Opens the shards an index names. Tensors a shard holds but the index does
 * not list are refused, like tensors it lists elsewhere: the shards must hold
 * exactly what the index maps to them. */
static loom_status open_index(loom_ctx *ctx, loom_safetensors *st, const char *dir,
                              const char *base, const char *index_path) {
    loom_json *idx = NULL;
    const char **names = NULL;
    loom_status s = loom_json_parse_file(ctx, index_path, &idx);
    if (s != LOOM_OK) return s;
    const loom_json *wm = loom_json_get(idx, "weight_map"), *meta = loom_json_get(idx, "metadata");
    if (!wm || wm->type != LOOM_JSON_OBJECT) {
        s = loom_errf(ctx, LOOM_ERR_FORMAT,
                      "%s: an index must be an object with a \"weight_map\" object (tensor name "
                      "-> shard file)", index_path);
        goto done;
    }
    if (meta && meta->type != LOOM_JSON_OBJECT && meta->type != LOOM_JSON_NULL) {
        s = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: \"metadata\" must be an object, got %s",
                      index_path, loom_json_type_name(meta->type));
        goto done;
    }
    if (!(names = loom_malloc(ctx, (wm->n ? wm->n : 1) * sizeof *names, "shard names"))) {
        s = LOOM_ERR_OOM;
        goto done;
    }
    for (size_t i = 0; i < wm->n; i++) {
        if (!shard_name_ok(wm->items[i])) {
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: weight_map['%s'] must be the file name of a shard in the same "
                          "directory (a non-empty string without '/' or '..')", index_path,
                          wm->keys[i]);
            goto done;
        }
        names[i] = wm->items[i]->s;
    }
    qsort(names, wm->n, sizeof *names, cmp_cstr); /* distinct shards, in name order */
    for (size_t i = 0; i < wm->n && s == LOOM_OK; i++) {
        if (i > 0 && strcmp(names[i], names[i - 1]) == 0) continue;
        char *path = dir_file(ctx, dir, names[i], "");
        if (!path)
            s = LOOM_ERR_OOM;
        else if (!loom_file_exists(path))
            s = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                          "%s.safetensors.index.json names shard '%s', which does not exist in %s",
                          base, names[i], dir);
        else
            s = map_and_parse(ctx, st, path);
        free(path);
    }
    if (s == LOOM_OK) s = finalize(ctx, st);
    /* every mapped tensor is in its shard, and no shard holds anything else */
    for (size_t i = 0; i < wm->n && s == LOOM_OK; i++) {
        const loom_st_tensor *t = loom_st_find(st, wm->keys[i]);
        const char *shard = wm->items[i]->s;
        if (!t)
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: maps tensor '%s' to shard '%s', which does not contain it",
                          index_path, wm->keys[i], shard);
        else if (strcmp(leaf_of(st->files[t->file].path), shard) != 0)
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: maps tensor '%s' to shard '%s', but it is in %s", index_path,
                          wm->keys[i], shard, st->files[t->file].path);
    }
    for (size_t i = 0; i < st->n && s == LOOM_OK; i++)
        if (!loom_json_get(wm, st->t[i].name))
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: holds tensor '%s', which the weight_map of %s does not list: the "
                          "index does not match its shards (re-save the checkpoint)",
                          st->files[st->t[i].file].path, st->t[i].name, index_path);
done:
    free(names);
    loom_json_free(idx);
    return s;
}

loom_status loom_st_open_dir(loom_ctx *ctx, const char *dir, const char *base,
                             loom_safetensors **out) {
    *out = NULL;
    char *index_path = dir_file(ctx, dir, base, ".safetensors.index.json");
    char *single_path = dir_file(ctx, dir, base, ".safetensors");
    loom_safetensors *st = loom_calloc(ctx, 1, sizeof *st, "a safetensors handle");
    loom_status s = LOOM_ERR_OOM;
    if (index_path && single_path && st) {
        if (loom_file_exists(index_path))
            s = open_index(ctx, st, dir, base, index_path);
        else if (loom_file_exists(single_path))
            s = map_and_parse(ctx, st, single_path);
        else
            s = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                          "no %s.safetensors or %s.safetensors.index.json in %s", base, base, dir);
    }
    free(index_path);
    free(single_path);
    if (!st) return s;
    return finish_open(ctx, st, s, out); /* finalize() again after open_index is harmless */
}

loom_status loom_st_splice(loom_ctx *ctx, loom_safetensors *st, const char *const *drop,
                           size_t ndrop, const loom_st_tensor *add, size_t nadd) {
    size_t bytes = 1, *at = loom_malloc(ctx, (ndrop ? ndrop : 1) * sizeof *at, "dropped tensors");
    if (!at) return LOOM_ERR_OOM;
    loom_status s = LOOM_OK;
    for (size_t i = 0; i < ndrop && !s; i++) {
        const loom_st_tensor *t = loom_st_find(st, drop[i]);
        if (t)
            at[i] = (size_t)(t - st->t);
        else
            s = loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_st_splice: no tensor '%s'", drop[i]);
    }
    for (size_t i = 0; i < nadd && !s; i++) { /* a view lies in its file's mapping */
        const bool fok = add[i].file >= 0 && (size_t)add[i].file < st->nfiles;
        const uintptr_t b = fok ? (uintptr_t)st->files[add[i].file].base : 0,
                        e = fok ? b + st->files[add[i].file].len : 0, d = (uintptr_t)add[i].data;
        if (!fok || d < b || d > e || add[i].nbytes > e - d)
            s = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                          "loom_st_splice: view '%s' lies outside its file", add[i].name);
        bytes += strlen(add[i].name) + 1;
    }
    const size_t need = st->n + nadd; /* at most */
    char **v = s ? NULL : loom_realloc(ctx, st->views, (st->nviews + 1) * sizeof *v, "views");
    char *names = v ? loom_malloc(ctx, bytes, "view names") : NULL;
    loom_st_tensor *t = names && need > st->cap
                            ? loom_realloc(ctx, st->t, need * sizeof *t, "safetensors tensors")
                            : st->t;
    if (!s && (!v || !names || (!t && need))) s = LOOM_ERR_OOM;
    st->views = v ? v : st->views;
    if (s) {
        free(names);
        free(at);
        return s;
    }
    st->views[st->nviews++] = names;
    st->cap = need > st->cap ? need : st->cap;
    st->t = t;
    for (size_t i = 0; i < ndrop; i++) st->t[at[i]].name = NULL;
    free(at);
    size_t n = 0;
    for (size_t i = 0; i < st->n; i++)
        if (st->t[i].name) st->t[n++] = st->t[i];
    for (size_t i = 0; i < nadd; i++, n++) {
        st->t[n] = add[i];
        st->t[n].name = strcpy(names, add[i].name);
        st->t[n].view = true;
        names += strlen(names) + 1;
    }
    st->n = n;
    return finalize(ctx, st);
}

size_t loom_st_count(const loom_safetensors *st) { return st->n; }

const loom_st_tensor *loom_st_at(const loom_safetensors *st, size_t i) {
    return i < st->n ? &st->t[i] : NULL;
}

const loom_st_tensor *loom_st_find(const loom_safetensors *st, const char *name) {
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(st->t[mid].name, name);
        if (c == 0) return &st->t[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

size_t loom_st_file_count(const loom_safetensors *st) { return st->nfiles; }

const char *loom_st_file_path(const loom_safetensors *st, int file) {
    return file >= 0 && (size_t)file < st->nfiles ? st->files[file].path : NULL;
}

const loom_json *loom_st_metadata(const loom_safetensors *st, int file) {
    if (file < 0 || (size_t)file >= st->nfiles) return NULL;
    return loom_json_get(st->files[file].header, "__metadata__");
}

uint64_t loom_st_total_bytes(const loom_safetensors *st) { return st->total; }

loom_status loom_st_read(loom_ctx *ctx, const loom_st_tensor *t, loom_dtype dt, void *dst,
                         uint64_t dst_numel) {
    if (dst_numel != t->numel)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "tensor '%s' has %" PRIu64 " elements, but the destination holds %" PRIu64,
                         t->name, t->numel, dst_numel);
    if ((int)dt < 0 || dt >= LOOM_DTYPE_COUNT)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "tensor '%s': bad destination dtype %d",
                         t->name, (int)dt);
    if (t->numel == 0) return LOOM_OK;
    if (!dst) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "tensor '%s': NULL destination", t->name);
    if (loom_convert(ctx, dst, dt, t->data, t->dtype, (size_t)t->numel) != LOOM_OK)
        return loom_err_prefix(ctx, "tensor '%s' (%s read as %s)", t->name,
                               loom_dtype_name(t->dtype), loom_dtype_name(dt));
    return LOOM_OK;
}

loom_status loom_st_read_named(loom_ctx *ctx, const loom_safetensors *st, const char *name,
                               int ndim, const int64_t *shape, loom_dtype dt, void *dst) {
    const loom_st_tensor *t = loom_st_find(st, name);
    if (!t && st->nfiles == 1)
        return loom_errf(ctx, LOOM_ERR_NOT_FOUND, "%s: no tensor '%s'", st->files[0].path, name);
    if (!t)
        return loom_errf(ctx, LOOM_ERR_NOT_FOUND, "no tensor '%s' in the %zu files of %s", name,
                         st->nfiles, st->nfiles ? st->files[0].path : "(empty checkpoint)");
    bool same = ndim == t->ndim;
    for (int i = 0; same && i < ndim; i++) same = shape[i] == t->shape[i];
    if (!same) {
        char a[256], b[256];
        int en = ndim < 0 ? 0 : ndim > LOOM_MAX_DIMS ? LOOM_MAX_DIMS : ndim;
        return loom_errf(ctx, LOOM_ERR_SHAPE, "%s: tensor '%s' has shape %s, but %s%s was expected",
                         st->files[t->file].path, name, fmt_shape(a, sizeof a, t->ndim, t->shape),
                         fmt_shape(b, sizeof b, en, shape), en != ndim ? " (truncated)" : "");
    }
    if (loom_st_read(ctx, t, dt, dst, t->numel) != LOOM_OK)
        return loom_err_prefix(ctx, "%s", st->files[t->file].path);
    return LOOM_OK;
}

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
        w->shards[i].path = dir_file(ctx, w->dir, w->base, suffix);
        if (!w->shards[i].path) return LOOM_ERR_OOM;
        if (!(w->shards[i].tmp = dir_file(ctx, NULL, w->shards[i].path, ".tmp")))
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
        qsort(names, w->n, sizeof *names, cmp_cstr);
        s = loom_json_set(ctx, meta, "total_size", loom_json_new_int(ctx, (int64_t)total));
    }
    for (size_t i = 0; i < w->n && s == LOOM_OK; i++) {
        const char *shard = w->shards[w->t[name_lookup(w, names[i])].shard].path;
        s = loom_json_set(ctx, wm, names[i], loom_json_new_str(ctx, leaf_of(shard)));
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
    char *index_path = s == LOOM_OK ? dir_file(ctx, w->dir, w->base, ".safetensors.index.json")
                                    : NULL;
    char *single_path = index_path ? dir_file(ctx, w->dir, w->base, ".safetensors") : NULL;
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
