/* Token files: validating reader (mmap), atomic writer, sequential packer.
 * The format and the packing rules are described in tokens.h and
 * docs/token-file.md. */
#include "tokens.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token files are little-endian and read in place: this loader needs a little-endian host"
#endif

struct loom_tokfile {
    void *base;      /* the whole file image */
    size_t len;
    bool mapped;     /* base is an mmap of len bytes, else malloc'd */
    uint64_t n_tokens, n_docs, vocab_size;
    uint32_t max_id;
    const uint64_t *offsets; /* (n_docs + 1), into base */
    const uint32_t *ids;     /* (n_tokens), into base */
    const uint8_t *mask;     /* (n_tokens) or NULL, into base */
};

static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p) {
    return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32;
}
static void wr32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void wr64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* Bytes a file with this header must have; false on overflow. */
static bool expected_size(uint64_t n_tokens, uint64_t n_docs, bool mask, uint64_t *out) {
    uint64_t offs, ids, total;
    if (__builtin_add_overflow(n_docs, 1, &offs) || __builtin_mul_overflow(offs, 8, &offs))
        return false;
    if (__builtin_mul_overflow(n_tokens, mask ? 5 : 4, &ids)) return false;
    if (__builtin_add_overflow(offs, ids, &total) ||
        __builtin_add_overflow(total, (uint64_t)LOOM_TOKFILE_HEADER_BYTES, &total))
        return false;
    *out = total;
    return true;
}

/* The checks shared by reader and writer, on the sections themselves
 * (counts already known to be > 0 and consistent with the size). */
static loom_status check_body(loom_ctx *ctx, const char *what, uint64_t n_tokens, uint64_t n_docs,
                              uint64_t vocab_size, const uint64_t *off, const uint32_t *ids,
                              const uint8_t *mask, uint32_t *max_id) {
    if (off[0] != 0)
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: doc_offsets[0] is %" PRIu64 ", must be 0", what,
                         off[0]);
    for (uint64_t d = 0; d < n_docs; d++) {
        if (off[d + 1] <= off[d])
            return loom_errf(ctx, LOOM_ERR_FORMAT,
                             "%s: doc_offsets[%" PRIu64 "] = %" PRIu64
                             " is not greater than doc_offsets[%" PRIu64 "] = %" PRIu64
                             ": offsets must increase strictly (document %" PRIu64
                             " would be empty or negative; drop empty documents)",
                             what, d + 1, off[d + 1], d, off[d], d);
        if (off[d + 1] > n_tokens && d + 1 < n_docs)
            return loom_errf(ctx, LOOM_ERR_FORMAT,
                             "%s: doc_offsets[%" PRIu64 "] = %" PRIu64
                             " is past the end of the ids (n_tokens = %" PRIu64 ")",
                             what, d + 1, off[d + 1], n_tokens);
    }
    if (off[n_docs] != n_tokens)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: the last doc offset (doc_offsets[%" PRIu64 "] = %" PRIu64
                         ") must equal n_tokens = %" PRIu64,
                         what, n_docs, off[n_docs], n_tokens);
    uint32_t mx = 0;
    for (uint64_t i = 0; i < n_tokens; i++)
        if (ids[i] > mx) mx = ids[i];
    if (vocab_size && mx >= vocab_size) {
        uint64_t i = 0;
        while (ids[i] < vocab_size) i++;
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: ids[%" PRIu64 "] = %" PRIu32 " is not below vocab_size %" PRIu64
                         " (record the right vocab_size, or 0 for none)",
                         what, i, ids[i], vocab_size);
    }
    if (mask)
        for (uint64_t i = 0; i < n_tokens; i++)
            if (mask[i] > 1)
                return loom_errf(ctx, LOOM_ERR_FORMAT,
                                 "%s: loss_mask[%" PRIu64 "] = %u; mask values must be 0 or 1",
                                 what, i, (unsigned)mask[i]);
    *max_id = mx;
    return LOOM_OK;
}

/* Shows up to 8 bytes as text, escaping what is not printable ASCII. */
static void show_magic(char out[40], const unsigned char *p, size_t n) {
    size_t o = 0;
    for (size_t i = 0; i < n && i < 8; i++) {
        if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\')
            out[o++] = (char)p[i];
        else
            o += (size_t)snprintf(out + o, 5, "\\x%02x", p[i]);
    }
    out[o] = '\0';
}

/* Validates the image in tf->base / tf->len (8-byte aligned) and fills the
 * rest of tf. */
static loom_status empty_file(loom_ctx *ctx, const char *what) {
    return loom_errf(ctx, LOOM_ERR_FORMAT,
                     "%s: empty file (0 bytes), not a loom token file; make one with `loom data`",
                     what);
}

static loom_status parse(loom_ctx *ctx, loom_tokfile *tf, const char *what) {
    const unsigned char *b = tf->base;
    size_t len = tf->len;
    if (len == 0) return empty_file(ctx, what);
    size_t nm = len < 8 ? len : 8;
    if (len < LOOM_TOKFILE_HEADER_BYTES && memcmp(b, LOOM_TOKFILE_MAGIC, nm) == 0)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: truncated: %zu bytes, shorter than the %d-byte header of a token "
                         "file; write it again",
                         what, len, LOOM_TOKFILE_HEADER_BYTES);
    if (len < 8 || memcmp(b, LOOM_TOKFILE_MAGIC, 8) != 0) {
        char m[40];
        show_magic(m, b, nm);
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: not a loom token file (magic is \"%s\", expected \"%s\"); make one "
                         "with `loom data`",
                         what, m, LOOM_TOKFILE_MAGIC);
    }
    uint32_t version = rd32(b + 8), flags = rd32(b + 12);
    uint64_t n_tokens = rd64(b + 16), n_docs = rd64(b + 24), vocab = rd64(b + 32);
    if (version != LOOM_TOKFILE_VERSION)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: token file version %" PRIu32 " is not supported (this loom reads "
                         "version %u); write it again with this loom's `loom data`",
                         what, version, LOOM_TOKFILE_VERSION);
    if (flags & ~LOOM_TOKFILE_FLAG_MASK)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "%s: unknown flags 0x%" PRIx32 " in the header (only bit 0, the loss "
                         "mask, is defined in version 1)",
                         what, flags & ~LOOM_TOKFILE_FLAG_MASK);
    for (int i = 40; i < LOOM_TOKFILE_HEADER_BYTES; i++)
        if (b[i])
            return loom_errf(ctx, LOOM_ERR_FORMAT,
                             "%s: reserved header byte %d is 0x%02x, must be zero", what, i, b[i]);
    bool has_mask = flags & LOOM_TOKFILE_FLAG_MASK;
    if (n_tokens == 0 || n_docs == 0)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: empty: n_tokens = %" PRIu64 ", n_docs = %" PRIu64
                         "; a token file holds at least one document of at least one token",
                         what, n_tokens, n_docs);
    if (n_docs > n_tokens)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: n_docs = %" PRIu64 " is more than n_tokens = %" PRIu64
                         ": documents cannot be empty",
                         what, n_docs, n_tokens);
    uint64_t want;
    if (!expected_size(n_tokens, n_docs, has_mask, &want))
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: header sizes overflow (n_tokens = %" PRIu64 ", n_docs = %" PRIu64
                         " imply more than 2^64 bytes): the header is corrupt",
                         what, n_tokens, n_docs);
    if (want != (uint64_t)len)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: %s: the header (n_tokens = %" PRIu64 ", n_docs = %" PRIu64
                         ", %s) implies %" PRIu64 " bytes, the file has %zu",
                         what, want > (uint64_t)len ? "truncated" : "oversized (trailing bytes)",
                         n_tokens, n_docs, has_mask ? "with loss mask" : "no loss mask", want,
                         len);
    tf->n_tokens = n_tokens;
    tf->n_docs = n_docs;
    tf->vocab_size = vocab;
    tf->offsets = (const uint64_t *)(b + LOOM_TOKFILE_HEADER_BYTES);
    tf->ids = (const uint32_t *)(tf->offsets + n_docs + 1);
    tf->mask = has_mask ? (const uint8_t *)(tf->ids + n_tokens) : NULL;
    return check_body(ctx, what, n_tokens, n_docs, vocab, tf->offsets, tf->ids, tf->mask,
                      &tf->max_id);
}

void loom_tokfile_free(loom_tokfile *tf) {
    if (!tf) return;
    if (tf->mapped)
        munmap(tf->base, tf->len);
    else
        free(tf->base);
    free(tf);
}

loom_status loom_tokfile_open_buffer(loom_ctx *ctx, const void *data, size_t len,
                                     const char *what, loom_tokfile **out) {
    *out = NULL;
    if (!data && len) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: no data", what);
    loom_tokfile *tf = loom_calloc(ctx, 1, sizeof *tf, what);
    if (!tf) return LOOM_ERR_OOM;
    tf->base = loom_malloc(ctx, len ? len : 1, what); /* malloc: aligned for u64 */
    if (!tf->base) {
        free(tf);
        return LOOM_ERR_OOM;
    }
    if (len) memcpy(tf->base, data, len);
    tf->len = len;
    loom_status st = parse(ctx, tf, what);
    if (st) {
        loom_tokfile_free(tf);
        return st;
    }
    *out = tf;
    return LOOM_OK;
}

loom_status loom_tokfile_open(loom_ctx *ctx, const char *path, loom_tokfile **out) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (S_ISDIR(sb.st_mode)) {
        close(fd);
        return loom_errf(ctx, LOOM_ERR_IO, "%s: is a directory, expected a .tokens file", path);
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return loom_errf(ctx, LOOM_ERR_IO, "%s: too large to map", path);
    }
    loom_tokfile *tf = loom_calloc(ctx, 1, sizeof *tf, path);
    if (!tf) {
        close(fd);
        return LOOM_ERR_OOM;
    }
    tf->len = (size_t)sb.st_size;
    if (tf->len == 0) { /* mmap cannot map nothing */
        close(fd);
        free(tf);
        return empty_file(ctx, path);
    }
    void *p = mmap(NULL, tf->len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        close(fd);
        free(tf);
        return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot map: %s", path, strerror(e));
    }
    close(fd);
    tf->base = p;
    tf->mapped = true;
    loom_status st = parse(ctx, tf, path);
    if (st) {
        loom_tokfile_free(tf);
        return st;
    }
    *out = tf;
    return LOOM_OK;
}

int64_t loom_tokfile_n_tokens(const loom_tokfile *tf) { return (int64_t)tf->n_tokens; }
int64_t loom_tokfile_n_docs(const loom_tokfile *tf) { return (int64_t)tf->n_docs; }
uint64_t loom_tokfile_vocab_size(const loom_tokfile *tf) { return tf->vocab_size; }
const uint64_t *loom_tokfile_doc_offsets(const loom_tokfile *tf) { return tf->offsets; }
const uint32_t *loom_tokfile_ids(const loom_tokfile *tf) { return tf->ids; }
const uint8_t *loom_tokfile_mask(const loom_tokfile *tf) { return tf->mask; }
uint32_t loom_tokfile_max_id(const loom_tokfile *tf) { return tf->max_id; }

/* ---- writer ---- */

static loom_status write_all(loom_ctx *ctx, int fd, const char *tmp, const void *data,
                             size_t len) {
    const char *p = data;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return loom_errf(ctx, LOOM_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
        p += w;
        len -= (size_t)w;
    }
    return LOOM_OK;
}

loom_status loom_tokfile_write(loom_ctx *ctx, const char *path, const uint32_t *ids,
                               int64_t n_tokens, const uint64_t *doc_offsets, int64_t n_docs,
                               const uint8_t *mask, uint64_t vocab_size) {
    if (n_tokens <= 0 || n_docs <= 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "%s: empty: n_tokens = %" PRId64 ", n_docs = %" PRId64
                         "; a token file holds at least one document of at least one token",
                         path, n_tokens, n_docs);
    if (!ids || !doc_offsets)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: no ids or no doc_offsets given", path);
    if (n_docs > n_tokens)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "%s: n_docs = %" PRId64 " is more than n_tokens = %" PRId64
                         ": documents cannot be empty",
                         path, n_docs, n_tokens);
    uint64_t total;
    if (!expected_size((uint64_t)n_tokens, (uint64_t)n_docs, mask != NULL, &total) ||
        total > SIZE_MAX)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: n_tokens = %" PRId64 " is too large",
                         path, n_tokens);
    uint32_t max_id;
    loom_status st = check_body(ctx, path, (uint64_t)n_tokens, (uint64_t)n_docs, vocab_size,
                                doc_offsets, ids, mask, &max_id);
    if (st) return loom_err_prefix(ctx, "refusing to write");
    unsigned char h[LOOM_TOKFILE_HEADER_BYTES] = {0};
    memcpy(h, LOOM_TOKFILE_MAGIC, 8);
    wr32(h + 8, LOOM_TOKFILE_VERSION);
    wr32(h + 12, mask ? LOOM_TOKFILE_FLAG_MASK : 0);
    wr64(h + 16, (uint64_t)n_tokens);
    wr64(h + 24, (uint64_t)n_docs);
    wr64(h + 32, vocab_size);

    size_t plen = strlen(path);
    char *tmp = loom_malloc(ctx, plen + 5, "a path");
    if (!tmp) return LOOM_ERR_OOM;
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        free(tmp);
        return st;
    }
    st = write_all(ctx, fd, tmp, h, sizeof h);
    if (!st)
        st = write_all(ctx, fd, tmp, doc_offsets, ((size_t)n_docs + 1) * sizeof *doc_offsets);
    if (!st) st = write_all(ctx, fd, tmp, ids, (size_t)n_tokens * sizeof *ids);
    if (!st && mask) st = write_all(ctx, fd, tmp, mask, (size_t)n_tokens);
    if (!st && fsync(fd) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && !st)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: close failed: %s", tmp, strerror(errno));
    if (!st && rename(tmp, path) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot rename to %s: %s", tmp, path,
                       strerror(errno));
    if (st) unlink(tmp);
    free(tmp);
    return st;
}

/* ---- packer ---- */

struct loom_packer {
    const loom_tokfile *tf;
    int64_t S, B;
    loom_packer_pos pos;
    int32_t *input_ids;    /* (B*S) */
    int32_t *targets;      /* (B*S) */
    int32_t *position_ids; /* (B*S) */
    int32_t *cu_seqlens;   /* (B*S + 1): at most one segment per token */
};

loom_status loom_packer_create(loom_ctx *ctx, const loom_tokfile *tf, int64_t seq_len,
                               int64_t rows, loom_packer **out) {
    *out = NULL;
    if (!tf) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "packer: no token file given");
    if (seq_len < 2)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "packer: seq_len = %" PRId64 " is too short; rows need at least 2 tokens "
                         "(one input and the token it predicts)",
                         seq_len);
    if (rows < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "packer: rows = %" PRId64 "; a batch needs at least one row", rows);
    if (seq_len > INT32_MAX / rows)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "packer: rows * seq_len = %" PRId64 " x %" PRId64
                         " is more than the %d tokens int32 cu_seqlens can address; use "
                         "smaller batches",
                         rows, seq_len, INT32_MAX);
    if (tf->max_id > INT32_MAX)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "packer: token id %" PRIu32 " does not fit the int32 input_ids",
                         tf->max_id);
    size_t n = (size_t)(rows * seq_len);
    loom_packer *p = loom_calloc(ctx, 1, sizeof *p, "packer");
    if (!p) return LOOM_ERR_OOM;
    p->tf = tf;
    p->S = seq_len;
    p->B = rows;
    p->input_ids = loom_malloc(ctx, n * sizeof(int32_t), "packer input_ids");
    p->targets = loom_malloc(ctx, n * sizeof(int32_t), "packer targets");
    p->position_ids = loom_malloc(ctx, n * sizeof(int32_t), "packer position_ids");
    p->cu_seqlens = loom_malloc(ctx, (n + 1) * sizeof(int32_t), "packer cu_seqlens");
    if (!p->input_ids || !p->targets || !p->position_ids || !p->cu_seqlens) {
        loom_packer_free(p);
        return LOOM_ERR_OOM;
    }
    *out = p;
    return LOOM_OK;
}

void loom_packer_free(loom_packer *p) {
    if (!p) return;
    free(p->input_ids);
    free(p->targets);
    free(p->position_ids);
    free(p->cu_seqlens);
    free(p);
}

loom_status loom_packer_next(loom_ctx *ctx, loom_packer *p, loom_packed_batch *out) {
    if (!p || !out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "packer: no packer or batch given");
    const loom_tokfile *tf = p->tf;
    const uint64_t *offs = tf->offsets;
    const uint32_t *ids = tf->ids;
    const uint8_t *mask = tf->mask;
    int32_t *in = p->input_ids, *tg = p->targets, *ps = p->position_ids, *cu = p->cu_seqlens;
    uint64_t doc = (uint64_t)p->pos.doc, off = (uint64_t)p->pos.offset;
    int64_t epoch = p->pos.epoch, nseg = 0, ntg = 0;
    memset(out, 0, sizeof *out); /* b.local 0: the global batch */
    out->start = p->pos;
    cu[0] = 0;
    for (int64_t r = 0; r < p->B; r++) {
        int64_t base = r * p->S, used = 0;
        while (used < p->S) {
            int64_t room = p->S - used, t0 = base + used;
            if (room < 2) { /* too short to predict anything: padding */
                for (int64_t j = 0; j < room; j++) {
                    in[t0 + j] = 0;
                    tg[t0 + j] = LOOM_IGNORE_INDEX;
                    ps[t0 + j] = (int32_t)j;
                }
                used += room;
                cu[++nseg] = (int32_t)(base + used);
                break;
            }
            uint64_t d0 = offs[doc] + off, left = offs[doc + 1] - d0;
            int64_t take = left < (uint64_t)room ? (int64_t)left : room;
            for (int64_t j = 0; j < take; j++) {
                in[t0 + j] = (int32_t)ids[d0 + (uint64_t)j];
                ps[t0 + j] = (int32_t)j;
                int32_t t = LOOM_IGNORE_INDEX;
                if (j + 1 < take) {
                    uint64_t nx = d0 + (uint64_t)j + 1;
                    if (!mask || mask[nx]) t = (int32_t)ids[nx];
                }
                tg[t0 + j] = t;
                ntg += t != LOOM_IGNORE_INDEX;
            }
            used += take;
            cu[++nseg] = (int32_t)(base + used);
            off += (uint64_t)take;
            if (off == offs[doc + 1] - offs[doc]) {
                off = 0;
                if (++doc == tf->n_docs) {
                    doc = 0;
                    epoch++;
                }
            }
        }
    }
    p->pos = (loom_packer_pos){(int64_t)doc, (int64_t)off, epoch};
    out->b.rows = p->B;
    out->b.seq_len = p->S;
    out->b.input_ids = in;
    out->b.targets = tg;
    out->b.position_ids = ps;
    out->b.cu_seqlens = cu;
    out->b.n_docs = nseg;
    out->n_targets = ntg;
    return LOOM_OK;
}

loom_packer_pos loom_packer_state(const loom_packer *p) { return p->pos; }

loom_status loom_packer_set_state(loom_ctx *ctx, loom_packer *p, loom_packer_pos pos) {
    const loom_tokfile *tf = p->tf;
    if (pos.doc < 0 || (uint64_t)pos.doc >= tf->n_docs)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "packer state: document %" PRId64 " is not in the file (it has %" PRIu64
                         " documents); was the state saved for another token file?",
                         pos.doc, tf->n_docs);
    uint64_t len = tf->offsets[pos.doc + 1] - tf->offsets[pos.doc];
    if (pos.offset < 0 || (uint64_t)pos.offset >= len)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "packer state: offset %" PRId64 " is not inside document %" PRId64
                         " (%" PRIu64 " tokens); was the state saved for another token file?",
                         pos.offset, pos.doc, len);
    if (pos.epoch < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "packer state: epoch %" PRId64 " is negative",
                         pos.epoch);
    p->pos = pos;
    return LOOM_OK;
}
