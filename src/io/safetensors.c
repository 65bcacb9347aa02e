/* safetensors reader (mmap, validated before use); the streaming, sharding
 * writer is safetensors_writer.c. See safetensors.h for the format and the
 * rules. */
#include "safetensors.h"
#include "safetensors_paths.h"

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

char *loom_st_dir_file(loom_ctx *ctx, const char *dir, const char *base, const char *suffix) {
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

const char *loom_st_leaf(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

int loom_st_cmp_names(const void *a, const void *b) {
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
    qsort(names, wm->n, sizeof *names, loom_st_cmp_names); /* distinct shards, in name order */
    for (size_t i = 0; i < wm->n && s == LOOM_OK; i++) {
        if (i > 0 && strcmp(names[i], names[i - 1]) == 0) continue;
        char *path = loom_st_dir_file(ctx, dir, names[i], "");
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
        else if (strcmp(loom_st_leaf(st->files[t->file].path), shard) != 0)
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
    char *index_path = loom_st_dir_file(ctx, dir, base, ".safetensors.index.json");
    char *single_path = loom_st_dir_file(ctx, dir, base, ".safetensors");
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
