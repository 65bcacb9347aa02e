/* libFuzzer target for the token-file reader and the packer.
 *
 * The input is a file image. When loom_tokfile_open_buffer refuses it, the
 * message must name the input and no handle may exist. When it accepts it,
 * every promise of the format is checked again from the accessors (sizes,
 * offsets strictly increasing from 0 to n_tokens, ids below vocab_size, the
 * largest id, mask values 0/1, ids equal to the input's bytes); and a
 * packer with a shape taken from the input runs a few batches whose
 * structure is checked (segments inside rows, positions restarting, targets
 * equal to the next input or -100, n_targets) and which a second packer
 * resumed from the saved state reproduces. Leaks are caught by ASan. */
#include <stdlib.h>
#include <string.h>

#include "../src/data/tokens.h"

#define CHECK(c)                                                                     \
    do {                                                                             \
        if (!(c)) {                                                                  \
            fprintf(stderr, "fuzz_tokens: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                                 \
        }                                                                            \
    } while (0)

static void check_batch(const loom_packed_batch *b, const loom_tokfile *tf) {
    int64_t S = b->b.seq_len, n = b->b.rows * S, ntg = 0;
    const int32_t *cu = b->b.cu_seqlens;
    CHECK(b->b.n_docs >= b->b.rows && b->b.n_docs <= n);
    CHECK(cu[0] == 0 && cu[b->b.n_docs] == n);
    int64_t row_ends = 0;
    for (int64_t s = 0; s < b->b.n_docs; s++) {
        int64_t a = cu[s], e = cu[s + 1];
        CHECK(a < e && a / S == (e - 1) / S);
        row_ends += e % S == 0;
        for (int64_t t = a; t < e; t++) {
            CHECK(b->b.position_ids[t] == t - a);
            CHECK(b->b.input_ids[t] >= 0 && (uint32_t)b->b.input_ids[t] <= loom_tokfile_max_id(tf));
            if (b->b.targets[t] != LOOM_IGNORE_INDEX) {
                CHECK(t + 1 < e && b->b.targets[t] == b->b.input_ids[t + 1]);
                ntg++;
            }
        }
        CHECK(b->b.targets[e - 1] == LOOM_IGNORE_INDEX);
    }
    CHECK(row_ends == b->b.rows && ntg == b->n_targets);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_tokfile *tf = NULL;
    loom_status s = loom_tokfile_open_buffer(ctx, data, size, "fuzz.tokens", &tf);
    if (s != LOOM_OK) {
        CHECK(tf == NULL);
        CHECK(strstr(loom_last_error(ctx), "fuzz.tokens") != NULL || s == LOOM_ERR_OOM);
        loom_ctx_free(ctx);
        return 0;
    }
    int64_t n = loom_tokfile_n_tokens(tf), nd = loom_tokfile_n_docs(tf);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    const uint32_t *ids = loom_tokfile_ids(tf);
    const uint8_t *mask = loom_tokfile_mask(tf);
    uint64_t vocab = loom_tokfile_vocab_size(tf);
    CHECK(n > 0 && nd > 0 && nd <= n);
    CHECK((uint64_t)size == 64 + 8 * ((uint64_t)nd + 1) + (uint64_t)n * (mask ? 5 : 4));
    CHECK(off[0] == 0 && off[nd] == (uint64_t)n);
    for (int64_t d = 0; d < nd; d++) CHECK(off[d] < off[d + 1]);
    uint32_t mx = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] > mx) mx = ids[i];
        CHECK(!vocab || ids[i] < vocab);
        CHECK(!mask || mask[i] <= 1);
    }
    CHECK(mx == loom_tokfile_max_id(tf));
    CHECK(memcmp(ids, data + 64 + 8 * (nd + 1), (size_t)n * 4) == 0);

    /* a shape from the first bytes of the ids: S in [2, 33], B in [1, 4] */
    int64_t S = 2 + (int64_t)(ids[0] % 32), B = 1 + (int64_t)((ids[0] >> 5) % 4);
    loom_packer *p = NULL;
    s = loom_packer_create(ctx, tf, S, B, &p);
    if (mx > INT32_MAX) {
        CHECK(s == LOOM_ERR_UNSUPPORTED && p == NULL);
    } else {
        CHECK(s == LOOM_OK && p);
        loom_packer *q = NULL;
        CHECK(loom_packer_create(ctx, tf, S, B, &q) == LOOM_OK);
        for (int it = 0; it < 3; it++) {
            loom_packer_pos pos = loom_packer_state(p);
            loom_packed_batch b, c;
            CHECK(loom_packer_next(ctx, p, &b) == LOOM_OK);
            check_batch(&b, tf);
            CHECK(loom_packer_set_state(ctx, q, pos) == LOOM_OK);
            CHECK(loom_packer_next(ctx, q, &c) == LOOM_OK);
            size_t bytes = (size_t)(S * B) * sizeof(int32_t);
            CHECK(memcmp(b.b.input_ids, c.b.input_ids, bytes) == 0);
            CHECK(memcmp(b.b.targets, c.b.targets, bytes) == 0);
            CHECK(b.b.n_docs == c.b.n_docs);
        }
        loom_packer_free(q);
        loom_packer_free(p);
    }
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
    return 0;
}
