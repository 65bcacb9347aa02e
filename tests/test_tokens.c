/* Token files and the sequential packer: write/read round trips, every
 * malformed file refused with its own message, the writer refusing what the
 * reader would refuse, packed batches checked value by value against rows
 * worked out by hand (split documents, wrap-around, padding, loss mask),
 * structural invariants over many random batches, resume from a saved
 * state, and `loom data` end to end. */
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../src/data/tokens.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static char *tmp_path(const char *name) {
    static char bufs[8][1024];
    static int next;
    char *p = bufs[next++ % 8];
    snprintf(p, sizeof bufs[0], "%s/%s", loom_test_tmpdir(), name);
    return p;
}

static void put32(unsigned char *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}
static void put64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A file image built by hand (independently of the writer). */
static unsigned char *image(uint64_t n_tokens, uint64_t n_docs, uint64_t vocab,
                            const uint64_t *off, const uint32_t *ids, const uint8_t *mask,
                            size_t *len) {
    *len = 64 + 8 * (n_docs + 1) + 4 * n_tokens + (mask ? n_tokens : 0);
    unsigned char *b = calloc(1, *len);
    memcpy(b, "LOOMTOK1", 8);
    put32(b + 8, 1);
    put32(b + 12, mask ? 1 : 0);
    put64(b + 16, n_tokens);
    put64(b + 24, n_docs);
    put64(b + 32, vocab);
    unsigned char *p = b + 64;
    for (uint64_t d = 0; d <= n_docs; d++, p += 8) put64(p, off[d]);
    for (uint64_t i = 0; i < n_tokens; i++, p += 4) put32(p, ids[i]);
    if (mask) memcpy(p, mask, n_tokens);
    return b;
}

/* The small file of the hand-checked tests: documents A = 10 11 12,
 * B = 20 21 22 23 24, C = 30 31. */
static const uint32_t ABC_IDS[10] = {10, 11, 12, 20, 21, 22, 23, 24, 30, 31};
static const uint64_t ABC_OFF[4] = {0, 3, 8, 10};
static const uint8_t ABC_MASK[10] = {0, 1, 1, 0, 0, 1, 1, 1, 0, 1};

static loom_tokfile *open_abc(loom_ctx *ctx, bool with_mask) {
    size_t len;
    unsigned char *b = image(10, 3, 64, ABC_OFF, ABC_IDS, with_mask ? ABC_MASK : NULL, &len);
    loom_tokfile *tf = NULL;
    loom_status st = loom_tokfile_open_buffer(ctx, b, len, "abc.tokens", &tf);
    if (st) fprintf(stderr, "    open_abc: %s\n", loom_last_error(ctx));
    free(b);
    return tf;
}

/* ---------------------------------------------------------------------- */
/* Reading and writing                                                     */
/* ---------------------------------------------------------------------- */

TEST(tokens_round_trip) {
    loom_ctx *ctx = new_ctx();
    for (int m = 0; m < 2; m++) {
        const uint8_t *mask = m ? ABC_MASK : NULL;
        char *path = tmp_path(m ? "mask.tokens" : "plain.tokens");
        REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, ABC_IDS, 10, ABC_OFF, 3, mask, 64));
        CHECK(!loom_file_exists(tmp_path(m ? "mask.tokens.tmp" : "plain.tokens.tmp")));
        /* byte-identical to the image made by hand from the spec */
        size_t want_len, got_len;
        unsigned char *want = image(10, 3, 64, ABC_OFF, ABC_IDS, mask, &want_len);
        char *got = NULL;
        REQUIRE_OK(ctx, loom_read_file(ctx, path, 0, &got, &got_len));
        CHECK_EQ_INT(got_len, m ? 146 : 136);
        CHECK(got_len == want_len && memcmp(got, want, want_len) == 0);
        free(want);
        loom_tokfile *tf;
        REQUIRE_OK(ctx, loom_tokfile_open(ctx, path, &tf));
        CHECK_EQ_INT(loom_tokfile_n_tokens(tf), 10);
        CHECK_EQ_INT(loom_tokfile_n_docs(tf), 3);
        CHECK_EQ_INT(loom_tokfile_vocab_size(tf), 64);
        CHECK_EQ_INT(loom_tokfile_max_id(tf), 31);
        CHECK(memcmp(loom_tokfile_ids(tf), ABC_IDS, sizeof ABC_IDS) == 0);
        CHECK(memcmp(loom_tokfile_doc_offsets(tf), ABC_OFF, sizeof ABC_OFF) == 0);
        if (m)
            CHECK(loom_tokfile_mask(tf) && memcmp(loom_tokfile_mask(tf), ABC_MASK, 10) == 0);
        else
            CHECK(loom_tokfile_mask(tf) == NULL);
        loom_tokfile_free(tf);
        /* the same bytes through the buffer reader, at an odd address */
        char *odd = malloc(got_len + 1);
        memcpy(odd + 1, got, got_len);
        REQUIRE_OK(ctx, loom_tokfile_open_buffer(ctx, odd + 1, got_len, "odd", &tf));
        free(odd); /* copied: the handle does not borrow it */
        CHECK_EQ_INT(loom_tokfile_ids(tf)[9], 31);
        CHECK_EQ_INT(loom_tokfile_doc_offsets(tf)[3], 10);
        loom_tokfile_free(tf);
        free(got);
    }
    /* overwriting keeps the new file whole; no vocab recorded allows any id */
    uint32_t big[2] = {7, 4000000000u};
    uint64_t off[2] = {0, 2};
    char *path = tmp_path("plain.tokens");
    REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, big, 2, off, 1, NULL, 0));
    loom_tokfile *tf;
    REQUIRE_OK(ctx, loom_tokfile_open(ctx, path, &tf));
    CHECK_EQ_INT(loom_tokfile_vocab_size(tf), 0);
    CHECK_EQ_INT(loom_tokfile_max_id(tf), 4000000000u);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

typedef struct {
    const char *name;
    int field;      /* what to change: see mutate() */
    uint64_t value;
    loom_status st;
    const char *msg1, *msg2; /* the error must contain both */
} bad_case;

enum { F_BYTE, F_VERSION, F_FLAGS, F_NTOK, F_NDOCS, F_BOTH, F_LEN, F_OFF0, F_OFF2, F_OFF3, F_ID4,
       F_MASK7 };

/* Applies one change to the valid masked ABC image (146 bytes). */
static size_t mutate(unsigned char *b, size_t len, const bad_case *c) {
    unsigned char *ids = b + 64 + 32, *mask = ids + 40;
    switch (c->field) {
    case F_BYTE: b[c->value >> 8] = (unsigned char)(c->value & 0xff); break;
    case F_VERSION: put32(b + 8, (uint32_t)c->value); break;
    case F_FLAGS: put32(b + 12, (uint32_t)c->value); break;
    case F_NTOK: put64(b + 16, c->value); break;
    case F_NDOCS: put64(b + 24, c->value); break;
    case F_BOTH: put64(b + 16, c->value); put64(b + 24, c->value); break;
    case F_LEN: return (size_t)c->value;
    case F_OFF0: put64(b + 64, c->value); break;
    case F_OFF2: put64(b + 64 + 16, c->value); break;
    case F_OFF3: put64(b + 64 + 24, c->value); break;
    case F_ID4: put32(ids + 16, (uint32_t)c->value); break;
    case F_MASK7: mask[7] = (unsigned char)c->value; break;
    }
    return len;
}

TEST(tokens_reader_refuses_bad_files) {
    static const bad_case cases[] = {
        {"magic", F_BYTE, 'X', LOOM_ERR_FORMAT, "not a loom token file (magic is \"XOOMTOK1\"",
         "make one with `loom data`"},
        {"magic, binary", F_BYTE, (3 << 8) | 0x01, LOOM_ERR_FORMAT, "magic is \"LOO\\x01TOK1\"",
         "expected \"LOOMTOK1\""},
        {"version", F_VERSION, 2, LOOM_ERR_UNSUPPORTED, "version 2 is not supported",
         "reads version 1"},
        {"flags", F_FLAGS, 7, LOOM_ERR_UNSUPPORTED, "unknown flags 0x6", "only bit 0"},
        {"reserved", F_BYTE, (50 << 8) | 9, LOOM_ERR_FORMAT, "reserved header byte 50",
         "must be zero"},
        {"no tokens", F_NTOK, 0, LOOM_ERR_FORMAT, "empty: n_tokens = 0", "at least one"},
        {"no docs", F_NDOCS, 0, LOOM_ERR_FORMAT, "empty: n_tokens = 10, n_docs = 0",
         "at least one"},
        {"docs > tokens", F_NDOCS, 11, LOOM_ERR_FORMAT, "n_docs = 11 is more than n_tokens = 10",
         "cannot be empty"},
        {"overflow", F_BOTH, UINT64_MAX, LOOM_ERR_FORMAT, "header sizes overflow", "corrupt"},
        {"overflow ids", F_NTOK, 1ull << 62, LOOM_ERR_FORMAT, "header sizes overflow",
         "n_tokens = 4611686018427387904"},
        {"truncated", F_LEN, 145, LOOM_ERR_FORMAT, "truncated",
         "implies 146 bytes, the file has 145"},
        {"truncated header", F_LEN, 20, LOOM_ERR_FORMAT, "truncated: 20 bytes",
         "64-byte header"},
        {"empty", F_LEN, 0, LOOM_ERR_FORMAT, "empty file (0 bytes)", "loom data"},
        {"oversized", F_LEN, 147, LOOM_ERR_FORMAT, "oversized (trailing bytes)",
         "implies 146 bytes, the file has 147"},
        {"more tokens", F_NTOK, 11, LOOM_ERR_FORMAT, "truncated", "n_tokens = 11"},
        {"mask flag off", F_FLAGS, 0, LOOM_ERR_FORMAT, "oversized", "no loss mask"},
        {"offset 0", F_OFF0, 1, LOOM_ERR_FORMAT, "doc_offsets[0] is 1, must be 0", "abc"},
        {"empty doc", F_OFF2, 3, LOOM_ERR_FORMAT,
         "doc_offsets[2] = 3 is not greater than doc_offsets[1] = 3", "empty documents"},
        {"decreasing", F_OFF2, 2, LOOM_ERR_FORMAT, "doc_offsets[2] = 2 is not greater",
         "must increase strictly"},
        {"past end", F_OFF2, 11, LOOM_ERR_FORMAT, "doc_offsets[2] = 11 is past the end",
         "n_tokens = 10"},
        {"last offset", F_OFF3, 9, LOOM_ERR_FORMAT, "doc_offsets[3] = 9) must equal n_tokens = 10",
         "last doc offset"},
        {"id", F_ID4, 64, LOOM_ERR_FORMAT, "ids[4] = 64 is not below vocab_size 64",
         "vocab_size"},
        {"mask", F_MASK7, 2, LOOM_ERR_FORMAT, "loss_mask[7] = 2", "must be 0 or 1"},
    };
    loom_ctx *ctx = new_ctx();
    size_t len;
    unsigned char *good = image(10, 3, 64, ABC_OFF, ABC_IDS, ABC_MASK, &len);
    REQUIRE(len == 146);
    unsigned char *b = malloc(len + 8);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_case *c = &cases[i];
        memset(b, 0, len + 8);
        memcpy(b, good, len);
        size_t n = mutate(b, len, c);
        loom_tokfile *tf = (loom_tokfile *)1;
        loom_status st = loom_tokfile_open_buffer(ctx, b, n, "abc.tokens", &tf);
        CHECK_MSG(st == c->st, "case '%s': status %s, want %s (%s)", c->name,
                  loom_status_str(st), loom_status_str(c->st), loom_last_error(ctx));
        CHECK_MSG(tf == NULL, "case '%s': handle exposed", c->name);
        const char *e = loom_last_error(ctx);
        CHECK_MSG(strstr(e, "abc.tokens: ") == e, "case '%s': message does not name the file: %s",
                  c->name, e);
        CHECK_MSG(strstr(e, c->msg1) && strstr(e, c->msg2), "case '%s': \"%s\" lacks \"%s\" / \"%s\"",
                  c->name, e, c->msg1, c->msg2);
        if (tf && tf != (loom_tokfile *)1) loom_tokfile_free(tf);
    }
    /* the untouched image opens */
    loom_tokfile *tf;
    CHECK_OK(ctx, loom_tokfile_open_buffer(ctx, good, len, "abc.tokens", &tf));
    loom_tokfile_free(tf);
    /* through the file reader, the path is named */
    const char *p = loom_test_write("cut.tokens", good, 100);
    CHECK(loom_tokfile_open(ctx, p, &tf) == LOOM_ERR_FORMAT && tf == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "cut.tokens: truncated");
    CHECK_CONTAINS(loom_last_error(ctx), "implies 146 bytes, the file has 100");
    p = loom_test_write("zero.tokens", "", 0);
    CHECK(loom_tokfile_open(ctx, p, &tf) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "zero.tokens: empty file");
    CHECK(loom_tokfile_open(ctx, tmp_path("missing.tokens"), &tf) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "missing.tokens: cannot open");
    CHECK(loom_tokfile_open(ctx, loom_test_tmpdir(), &tf) == LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "is a directory");
    free(b);
    free(good);
    loom_ctx_free(ctx);
}

TEST(tokens_writer_refuses_what_the_reader_would) {
    loom_ctx *ctx = new_ctx();
    char *path = tmp_path("w.tokens");
    uint32_t ids[4] = {1, 2, 3, 4};
    uint8_t mask[4] = {1, 1, 3, 1};
    uint64_t off_eq[3] = {0, 2, 2}, off_last[3] = {0, 2, 3}, off_ok[3] = {0, 2, 4},
             off_first[3] = {1, 2, 4};
    static const char *msgs[] = {
        "empty: n_tokens = 0",
        "n_docs = 5 is more than n_tokens = 4",
        "doc_offsets[2] = 2 is not greater than doc_offsets[1] = 2",
        "must equal n_tokens = 4",
        "doc_offsets[0] is 1, must be 0",
        "ids[3] = 4 is not below vocab_size 4",
        "loss_mask[2] = 3",
    };
    for (int i = 0; i < 7; i++) {
        loom_status st;
        switch (i) {
        case 0: st = loom_tokfile_write(ctx, path, ids, 0, off_ok, 0, NULL, 0); break;
        case 1: st = loom_tokfile_write(ctx, path, ids, 4, off_ok, 5, NULL, 0); break;
        case 2: st = loom_tokfile_write(ctx, path, ids, 4, off_eq, 2, NULL, 0); break;
        case 3: st = loom_tokfile_write(ctx, path, ids, 4, off_last, 2, NULL, 0); break;
        case 4: st = loom_tokfile_write(ctx, path, ids, 4, off_first, 2, NULL, 0); break;
        case 5: st = loom_tokfile_write(ctx, path, ids, 4, off_ok, 2, NULL, 4); break;
        default: st = loom_tokfile_write(ctx, path, ids, 4, off_ok, 2, mask, 0); break;
        }
        CHECK_MSG(st != LOOM_OK, "case %d accepted", i);
        CHECK_CONTAINS(loom_last_error(ctx), msgs[i]);
        CHECK_CONTAINS(loom_last_error(ctx), "w.tokens: ");
        if (i >= 2) CHECK_CONTAINS(loom_last_error(ctx), "refusing to write: ");
    }
    CHECK(!loom_file_exists(path) && !loom_file_exists(tmp_path("w.tokens.tmp")));
    /* a directory that does not exist: an I/O error naming it */
    CHECK(loom_tokfile_write(ctx, tmp_path("no/such/dir.tokens"), ids, 4, off_ok, 2, NULL, 0) ==
          LOOM_ERR_IO);
    CHECK_CONTAINS(loom_last_error(ctx), "no/such/dir.tokens.tmp: cannot create");
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Packing, checked against rows worked out by hand                        */
/* ---------------------------------------------------------------------- */

#define X LOOM_IGNORE_INDEX

static void check_arr(const char *what, const int32_t *got, const int32_t *want, int n, int line) {
    for (int i = 0; i < n; i++)
        if (got[i] != want[i]) {
            loom_test_fail(__FILE__, line, "%s[%d] = %d, want %d", what, i, got[i], want[i]);
            return;
        }
}

static void check_batch(const loom_packed_batch *b, const int32_t *in, const int32_t *tg,
                        const int32_t *pos, const int32_t *cu, int nseg, int line) {
    int n = (int)(b->b.rows * b->b.seq_len);
    check_arr("input_ids", b->b.input_ids, in, n, line);
    check_arr("targets", b->b.targets, tg, n, line);
    check_arr("position_ids", b->b.position_ids, pos, n, line);
    if (b->b.n_docs != nseg)
        loom_test_fail(__FILE__, line, "n_segments = %lld, want %d", (long long)b->b.n_docs, nseg);
    else
        check_arr("cu_seqlens", b->b.cu_seqlens, cu, nseg + 1, line);
    int valid = 0;
    for (int i = 0; i < n; i++) valid += tg[i] != X;
    if (b->n_targets != valid)
        loom_test_fail(__FILE__, line, "n_targets = %lld, want %d", (long long)b->n_targets, valid);
}
#define CHECK_BATCH(b, in, tg, pos, cu, nseg)                                              \
    check_batch(b, (const int32_t[])in, (const int32_t[])tg, (const int32_t[])pos,         \
                (const int32_t[])cu, nseg, __LINE__)
#define A(...) {__VA_ARGS__}

static void check_pos(loom_packer_pos p, int64_t doc, int64_t off, int64_t epoch, int line) {
    if (p.doc != doc || p.offset != off || p.epoch != epoch)
        loom_test_fail(__FILE__, line, "packer position {%lld, %lld, %lld}, want {%lld, %lld, %lld}",
                       (long long)p.doc, (long long)p.offset, (long long)p.epoch, (long long)doc,
                       (long long)off, (long long)epoch);
}
#define CHECK_POS(p, d, o, e) check_pos(p, d, o, e, __LINE__)

/* A = 10 11 12, B = 20..24, C = 30 31; S = 4, B = 2.
 *   batch 1, row 0: A (3 tokens), 1 token of room left: padding
 *            row 1: B[0:4] (B is split; its last token goes to the next row)
 *   batch 2, row 0: B[4] | C | padding   (C ends the file: epoch 1 starts)
 *            row 1: A | padding */
TEST(tokens_packer_split_wrap_pad) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx, false);
    REQUIRE(tf);
    loom_packer *p;
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 4, 2, &p));
    loom_packed_batch b;
    CHECK_POS(loom_packer_state(p), 0, 0, 0);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_EQ_INT(b.b.rows, 2);
    CHECK_EQ_INT(b.b.seq_len, 4);
    CHECK_POS(b.start, 0, 0, 0);
    CHECK_BATCH(&b, A(10, 11, 12, 0, /**/ 20, 21, 22, 23),
                A(11, 12, X, X, /**/ 21, 22, 23, X),
                A(0, 1, 2, 0, /**/ 0, 1, 2, 3),
                A(0, 3, 4, 8), 3);
    CHECK_POS(loom_packer_state(p), 1, 4, 0);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_POS(b.start, 1, 4, 0);
    CHECK_BATCH(&b, A(24, 30, 31, 0, /**/ 10, 11, 12, 0),
                A(X, 31, X, X, /**/ 11, 12, X, X),
                A(0, 0, 1, 0, /**/ 0, 1, 2, 0),
                A(0, 1, 3, 4, 7, 8), 5);
    CHECK_POS(loom_packer_state(p), 1, 0, 1);
    loom_packer_free(p);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* The same file with a loss mask: A 0 1 1, B 0 0 1 1 1, C 0 1. A target is
 * kept only where the mask of the token it predicts is 1. */
TEST(tokens_packer_loss_mask) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx, true);
    REQUIRE(tf);
    loom_packer *p;
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 4, 2, &p));
    loom_packed_batch b;
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(10, 11, 12, 0, /**/ 20, 21, 22, 23),
                A(11, 12, X, X, /**/ X, 22, 23, X),
                A(0, 1, 2, 0, /**/ 0, 1, 2, 3),
                A(0, 3, 4, 8), 3);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(24, 30, 31, 0, /**/ 10, 11, 12, 0),
                A(X, 31, X, X, /**/ 11, 12, X, X),
                A(0, 0, 1, 0, /**/ 0, 1, 2, 0),
                A(0, 1, 3, 4, 7, 8), 5);
    loom_packer_free(p);
    loom_tokfile_free(tf);
    /* a mask with one hole: token 23 (index 6) is context only, never a target */
    uint8_t mask[10] = {1, 1, 1, 1, 1, 1, 0, 1, 1, 1};
    char *path = tmp_path("m.tokens");
    REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, ABC_IDS, 10, ABC_OFF, 3, mask, 0));
    REQUIRE_OK(ctx, loom_tokfile_open(ctx, path, &tf));
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 10, 1, &p));
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(10, 11, 12, 20, 21, 22, 23, 24, 30, 31),
                A(11, 12, X, 21, 22, X, 24, X, 31, X),
                A(0, 1, 2, 0, 1, 2, 3, 4, 0, 1),
                A(0, 3, 8, 10), 3);
    CHECK_POS(loom_packer_state(p), 0, 0, 1);
    loom_packer_free(p);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* One row longer than the file: it wraps into the next epoch inside a row. */
TEST(tokens_packer_wraps_inside_a_row) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx, false);
    REQUIRE(tf);
    loom_packer *p;
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 16, 1, &p));
    loom_packed_batch b;
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(10, 11, 12, 20, 21, 22, 23, 24, 30, 31, 10, 11, 12, 20, 21, 22),
                A(11, 12, X, 21, 22, 23, 24, X, 31, X, 11, 12, X, 21, 22, X),
                A(0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 0, 1, 2),
                A(0, 3, 8, 10, 13, 16), 5);
    CHECK_POS(b.start, 0, 0, 0);
    CHECK_POS(loom_packer_state(p), 1, 3, 1);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    /* B[3:5] | C | A | B | C | A[0:2]: two more wraps */
    CHECK_BATCH(&b, A(23, 24, 30, 31, 10, 11, 12, 20, 21, 22, 23, 24, 30, 31, 10, 11),
                A(24, X, 31, X, 11, 12, X, 21, 22, 23, 24, X, 31, X, 11, X),
                A(0, 1, 0, 1, 0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1),
                A(0, 2, 4, 7, 12, 14, 16), 6);
    CHECK_POS(b.start, 1, 3, 1);
    CHECK_POS(loom_packer_state(p), 0, 2, 3);
    loom_packer_free(p);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* One document of 10 tokens, rows of 3: it is cut into pieces of 3, and the
 * last piece (1 token) shares its row with the start of the next epoch. */
TEST(tokens_packer_long_document) {
    loom_ctx *ctx = new_ctx();
    uint32_t ids[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    uint64_t off[2] = {0, 10};
    char *path = tmp_path("long.tokens");
    REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, ids, 10, off, 1, NULL, 10));
    loom_tokfile *tf;
    REQUIRE_OK(ctx, loom_tokfile_open(ctx, path, &tf));
    loom_packer *p;
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 3, 2, &p));
    loom_packed_batch b;
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(0, 1, 2, /**/ 3, 4, 5), A(1, 2, X, /**/ 4, 5, X), A(0, 1, 2, /**/ 0, 1, 2),
                A(0, 3, 6), 2);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(6, 7, 8, /**/ 9, 0, 1), A(7, 8, X, /**/ X, 1, X), A(0, 1, 2, /**/ 0, 0, 1),
                A(0, 3, 4, 6), 3);
    CHECK_POS(loom_packer_state(p), 0, 2, 1);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(2, 3, 4, /**/ 5, 6, 7), A(3, 4, X, /**/ 6, 7, X), A(0, 1, 2, /**/ 0, 1, 2),
                A(0, 3, 6), 2);
    CHECK_EQ_INT(b.start.epoch, 1);
    loom_packer_free(p);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* Documents of one token, rows of 2: every row holds one document and one
 * padding token (a row never starts a document in its last slot). */
TEST(tokens_packer_padding_only_in_the_last_slot) {
    loom_ctx *ctx = new_ctx();
    uint32_t ids[3] = {5, 6, 7};
    uint64_t off[4] = {0, 1, 2, 3};
    size_t len;
    unsigned char *img = image(3, 3, 0, off, ids, NULL, &len);
    loom_tokfile *tf;
    REQUIRE_OK(ctx, loom_tokfile_open_buffer(ctx, img, len, "ones", &tf));
    free(img);
    loom_packer *p;
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 2, 2, &p));
    loom_packed_batch b;
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(5, 0, 6, 0), A(X, X, X, X), A(0, 0, 0, 0), A(0, 1, 2, 3, 4), 4);
    CHECK_EQ_INT(b.n_targets, 0);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK_BATCH(&b, A(7, 0, 5, 0), A(X, X, X, X), A(0, 0, 0, 0), A(0, 1, 2, 3, 4), 4);
    CHECK_POS(loom_packer_state(p), 1, 0, 1);
    loom_packer_free(p);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Invariants over many random batches                                     */
/* ---------------------------------------------------------------------- */

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t rnd(uint32_t n) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng % n);
}

/* Walks the batches with an independent cursor over the documents: every
 * non-padding segment must be the next piece of the stream, split only at
 * row ends; positions restart per segment; targets follow the rules. */
TEST(tokens_packer_invariants_random) {
    loom_ctx *ctx = new_ctx();
    enum { ND = 23 };
    uint64_t off[ND + 1] = {0};
    for (int d = 0; d < ND; d++) off[d + 1] = off[d] + 1 + rnd(d % 5 == 0 ? 40 : 9);
    int64_t n = (int64_t)off[ND];
    uint32_t *ids = malloc((size_t)n * sizeof *ids);
    uint8_t *mask = malloc((size_t)n);
    for (int64_t i = 0; i < n; i++) {
        ids[i] = rnd(1000);
        mask[i] = rnd(4) != 0;
    }
    char *path = tmp_path("rand.tokens");
    static const int64_t shapes[][2] = {{2, 1}, {2, 3}, {3, 2}, {5, 1}, {8, 4}, {17, 2}, {64, 3}};
    for (int use_mask = 0; use_mask < 2; use_mask++) {
        REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, ids, n, off, ND, use_mask ? mask : NULL, 1000));
        loom_tokfile *tf;
        REQUIRE_OK(ctx, loom_tokfile_open(ctx, path, &tf));
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
            int64_t S = shapes[k][0], B = shapes[k][1];
            loom_packer *p;
            REQUIRE_OK(ctx, loom_packer_create(ctx, tf, S, B, &p));
            int64_t doc = 0, o = 0, epoch = 0, bad = 0;
            bool split = false; /* the previous segment ended inside a document */
            for (int it = 0; it < 60 && !bad; it++) {
                loom_packed_batch b;
                REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
                bad += b.start.doc != doc || b.start.offset != o || b.start.epoch != epoch;
                const int32_t *cu = b.b.cu_seqlens;
                bad += cu[0] != 0 || cu[b.b.n_docs] != S * B;
                int64_t ntg = 0, row_ends = 0;
                for (int64_t s = 0; s < b.b.n_docs && !bad; s++) {
                    int64_t a = cu[s], e = cu[s + 1], len = e - a;
                    bad += len < 1 || a / S != (e - 1) / S; /* inside one row */
                    row_ends += e % S == 0;
                    for (int64_t t = a; t < e; t++) {
                        bad += b.b.position_ids[t] != t - a;
                        ntg += b.b.targets[t] != X;
                    }
                    bool pad = len == 1 && e % S == 0 && a % S != 0;
                    if (pad) {
                        bad += b.b.input_ids[a] != 0 || b.b.targets[a] != X;
                        continue;
                    }
                    bad += split && a % S != 0; /* a continued document starts a row */
                    int64_t d0 = (int64_t)off[doc] + o, left = (int64_t)off[doc + 1] - d0;
                    bad += len > left;
                    for (int64_t j = 0; j < len && !bad; j++) {
                        bad += b.b.input_ids[a + j] != (int32_t)ids[d0 + j];
                        int32_t want = X;
                        if (j + 1 < len && (!use_mask || mask[d0 + j + 1]))
                            want = (int32_t)ids[d0 + j + 1];
                        bad += b.b.targets[a + j] != want;
                    }
                    split = len < left;
                    bad += split && e % S != 0; /* documents are split only at row ends */
                    o += len;
                    if (o == (int64_t)(off[doc + 1] - off[doc])) {
                        o = 0;
                        if (++doc == ND) {
                            doc = 0;
                            epoch++;
                        }
                    }
                }
                bad += row_ends != B || ntg != b.n_targets;
                loom_packer_pos st = loom_packer_state(p);
                bad += st.doc != doc || st.offset != o || st.epoch != epoch;
            }
            CHECK_MSG(!bad, "S=%lld B=%lld mask=%d: batches break the packing rules", (long long)S,
                      (long long)B, use_mask);
            CHECK_MSG(epoch >= 1 || S * B * 60 < n, "S=%lld B=%lld: never wrapped", (long long)S,
                      (long long)B);
            loom_packer_free(p);
        }
        loom_tokfile_free(tf);
    }
    free(ids);
    free(mask);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Resume, and refused arguments                                           */
/* ---------------------------------------------------------------------- */

static bool same_batch(const loom_packed_batch *x, const loom_packed_batch *y) {
    size_t n = (size_t)(x->b.rows * x->b.seq_len) * sizeof(int32_t);
    return x->b.rows == y->b.rows && x->b.seq_len == y->b.seq_len && x->b.n_docs == y->b.n_docs &&
           x->n_targets == y->n_targets && memcmp(x->b.input_ids, y->b.input_ids, n) == 0 &&
           memcmp(x->b.targets, y->b.targets, n) == 0 &&
           memcmp(x->b.position_ids, y->b.position_ids, n) == 0 &&
           memcmp(x->b.cu_seqlens, y->b.cu_seqlens, (size_t)(x->b.n_docs + 1) * sizeof(int32_t)) == 0 &&
           x->start.doc == y->start.doc && x->start.offset == y->start.offset &&
           x->start.epoch == y->start.epoch;
}

TEST(tokens_packer_state_resume) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx, true);
    REQUIRE(tf);
    loom_packer *p, *q;
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 3, 2, &p));
    REQUIRE_OK(ctx, loom_packer_create(ctx, tf, 3, 2, &q));
    loom_packed_batch b, c;
    for (int i = 0; i < 7; i++) {
        loom_packer_pos saved = loom_packer_state(p);
        REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
        REQUIRE_OK(ctx, loom_packer_set_state(ctx, q, saved));
        REQUIRE_OK(ctx, loom_packer_next(ctx, q, &c));
        CHECK_MSG(same_batch(&b, &c), "batch %d differs after resume", i);
    }
    CHECK(loom_packer_state(p).epoch >= 2);
    /* the same state on a fresh packer, and a batch taken again gives the same rows */
    loom_packer_pos st = loom_packer_state(p);
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    int32_t first[6];
    memcpy(first, b.b.input_ids, sizeof first);
    REQUIRE_OK(ctx, loom_packer_set_state(ctx, p, st));
    REQUIRE_OK(ctx, loom_packer_next(ctx, p, &b));
    CHECK(memcmp(first, b.b.input_ids, sizeof first) == 0);
    /* positions outside the file are refused and leave the packer as it was */
    loom_packer_pos before = loom_packer_state(q);
    CHECK(loom_packer_set_state(ctx, q, (loom_packer_pos){3, 0, 0}) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "document 3 is not in the file (it has 3 documents)");
    CHECK(loom_packer_set_state(ctx, q, (loom_packer_pos){-1, 0, 0}) == LOOM_ERR_INVALID_ARG);
    CHECK(loom_packer_set_state(ctx, q, (loom_packer_pos){2, 2, 0}) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "offset 2 is not inside document 2 (2 tokens)");
    CHECK(loom_packer_set_state(ctx, q, (loom_packer_pos){1, -1, 0}) == LOOM_ERR_INVALID_ARG);
    CHECK(loom_packer_set_state(ctx, q, (loom_packer_pos){1, 4, -1}) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "epoch -1 is negative");
    CHECK_POS(loom_packer_state(q), before.doc, before.offset, before.epoch);
    CHECK_OK(ctx, loom_packer_set_state(ctx, q, (loom_packer_pos){1, 4, 9}));
    REQUIRE_OK(ctx, loom_packer_next(ctx, q, &c));
    CHECK_EQ_INT(c.b.input_ids[0], 24);
    CHECK_EQ_INT(c.start.epoch, 9);
    loom_packer_free(p);
    loom_packer_free(q);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

TEST(tokens_packer_refuses_bad_shapes) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx, false);
    REQUIRE(tf);
    loom_packer *p = (loom_packer *)1;
    CHECK(loom_packer_create(ctx, tf, 1, 4, &p) == LOOM_ERR_INVALID_ARG && p == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "seq_len = 1 is too short");
    CHECK(loom_packer_create(ctx, tf, 8, 0, &p) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "rows = 0");
    CHECK(loom_packer_create(ctx, tf, 1 << 20, 1 << 12, &p) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "int32 cu_seqlens");
    CHECK(loom_packer_create(ctx, NULL, 8, 1, &p) == LOOM_ERR_INVALID_ARG);
    loom_tokfile_free(tf);
    /* ids past int32 cannot be packed into int32 input_ids */
    uint32_t ids[2] = {1, 0x80000000u};
    uint64_t off[2] = {0, 2};
    size_t len;
    unsigned char *img = image(2, 1, 0, off, ids, NULL, &len);
    REQUIRE_OK(ctx, loom_tokfile_open_buffer(ctx, img, len, "big ids", &tf));
    free(img);
    CHECK(loom_packer_create(ctx, tf, 8, 1, &p) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "token id 2147483648 does not fit the int32 input_ids");
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* loom data                                                               */
/* ---------------------------------------------------------------------- */

static int loom(char **out, ...) {
    const char *argv[16] = {loom_test_bin()};
    va_list ap;
    va_start(ap, out);
    int n = 1;
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 15) argv[n++] = a;
    va_end(ap);
    argv[n] = NULL;
    return loom_test_run(out, argv);
}

TEST(cli_data_tokens) {
    loom_ctx *ctx = new_ctx();
    /* three documents: blank lines (also with spaces or \r) separate them,
     * leading and trailing blank lines are dropped, inner newlines kept */
    static const char text[] = "\n\nhello world\n\n\nsecond doc\nline two\n  \t\r\nthird\xc3\xa9\n\n";
    char in[1024], outp[1024];
    snprintf(in, sizeof in, "%s", loom_test_write("in.txt", text, sizeof text - 1));
    snprintf(outp, sizeof outp, "%s", tmp_path("out.tokens"));
    char *out;
    CHECK_EQ_INT(loom(&out, "data", "--text", in, "--out", outp, NULL), 0);
    CHECK_CONTAINS(out, "37 tokens in 3 documents");
    free(out);
    loom_tokfile *tf;
    REQUIRE_OK(ctx, loom_tokfile_open(ctx, outp, &tf));
    CHECK_EQ_INT(loom_tokfile_n_docs(tf), 3);
    CHECK_EQ_INT(loom_tokfile_vocab_size(tf), 256);
    CHECK(loom_tokfile_mask(tf) == NULL);
    static const char *docs[3] = {"hello world", "second doc\nline two", "third\xc3\xa9"};
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    const uint32_t *ids = loom_tokfile_ids(tf);
    for (int d = 0; d < 3; d++) {
        size_t l = strlen(docs[d]);
        CHECK_EQ_INT(off[d + 1] - off[d], l);
        for (size_t i = 0; i < l && off[d] + i < off[3]; i++)
            CHECK_EQ_INT(ids[off[d] + i], (unsigned char)docs[d][i]);
    }
    CHECK_EQ_INT(loom_tokfile_max_id(tf), 0xc3);
    loom_tokfile_free(tf);

    /* describe it, as an argument and with --inspect */
    CHECK_EQ_INT(loom(&out, "data", outp, NULL), 0);
    CHECK_CONTAINS(out, "loom token file, version 1");
    CHECK_CONTAINS(out, "n_tokens     37\n");
    CHECK_CONTAINS(out, "n_docs       3\n");
    CHECK_CONTAINS(out, "vocab_size   256\n");
    CHECK_CONTAINS(out, "doc length   mean 12.33, min 7, max 19\n");
    CHECK_CONTAINS(out, "loss mask    no\n");
    free(out);
    CHECK_EQ_INT(loom(&out, "data", "--inspect", outp, NULL), 0);
    CHECK_CONTAINS(out, "n_docs       3\n");
    free(out);
    /* a file with a mask says how many tokens are predicted */
    uint8_t mask[10] = {1, 1, 1, 0, 0, 1, 1, 1, 1, 1};
    REQUIRE_OK(ctx, loom_tokfile_write(ctx, tmp_path("m.tokens"), ABC_IDS, 10, ABC_OFF, 3, mask, 0));
    CHECK_EQ_INT(loom(&out, "data", tmp_path("m.tokens"), NULL), 0);
    CHECK_CONTAINS(out, "vocab_size   not recorded");
    CHECK_CONTAINS(out, "loss mask    yes (8 of the tokens are predicted)");
    free(out);

    /* mistakes: exit 1 or 2 with a message, never a crash */
    CHECK_EQ_INT(loom(&out, "data", "--text", in, NULL), 1);
    CHECK_CONTAINS(out, "needs --out OUT.tokens");
    free(out);
    CHECK_EQ_INT(loom(&out, "data", NULL), 1);
    CHECK_CONTAINS(out, "loom data needs --text FILE --out OUT.tokens");
    free(out);
    CHECK_EQ_INT(loom(&out, "data", in, NULL), 1);
    CHECK_CONTAINS(out, "in.txt: not a loom token file (magic is \"\\x0a\\x0ahello \"");
    free(out);
    CHECK_EQ_INT(loom(&out, "data", "--text", in, "--out", outp, outp, NULL), 1);
    CHECK_CONTAINS(out, "not both");
    free(out);
    CHECK_EQ_INT(loom(&out, "data", "--inspect", outp, outp, NULL), 1);
    CHECK_CONTAINS(out, "once");
    free(out);
    CHECK_EQ_INT(loom(&out, "data", outp, outp, NULL), 2);
    CHECK_CONTAINS(out, "unexpected argument");
    free(out);
    const char *blank = loom_test_write("blank.txt", "\n  \n\r\n", 6);
    CHECK_EQ_INT(loom(&out, "data", "--text", blank, "--out", tmp_path("b.tokens"), NULL), 1);
    CHECK_CONTAINS(out, "holds no text (6 bytes, all blank lines)");
    free(out);
    CHECK(!loom_file_exists(tmp_path("b.tokens")));
    CHECK_EQ_INT(loom(&out, "data", "--text", tmp_path("nope.txt"), "--out", outp, NULL), 1);
    CHECK_CONTAINS(out, "nope.txt: cannot open");
    free(out);
    CHECK_EQ_INT(loom(&out, "help", "data", NULL), 0);
    CHECK_CONTAINS(out, "--text TEXT");
    CHECK_CONTAINS(out, "--inspect TEXT");
    free(out);
    loom_ctx_free(ctx);
}
