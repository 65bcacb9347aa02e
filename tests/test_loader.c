/* The data loader (src/data/loader.h) on token files made here: the shuffle
 * (same seed, same order; a new order per epoch), packing checked value by
 * value (whole samples, greedy rows, padding, targets with the loss mask,
 * cu_seqlens against sample boundaries), data-parallel slices that are
 * disjoint and cover an epoch, exact resume mid-epoch, truncation policies,
 * and, through the tiny Qwen3 model, packed log-probs equal to each sample
 * run alone. */
#include <stdlib.h>

#include "../src/core/rng.h"
#include "../src/data/loader.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    return ctx;
}

/* A token file of n documents, lengths in [1, max_len], ids in [1, 1000),
 * with a random loss mask when `mask`. Written, then opened. */
static loom_tokfile *make_file(loom_ctx *ctx, const char *name, int64_t n, int64_t max_len,
                               uint64_t seed, bool mask) {
    uint64_t *off = malloc(sizeof *off * (size_t)(n + 1));
    off[0] = 0;
    for (int64_t d = 0; d < n; d++)
        off[d + 1] = off[d] + 1 + (uint64_t)(loom_rng_uniform(seed, 1, (uint64_t)d) * (double)max_len);
    int64_t nt = (int64_t)off[n];
    uint32_t *ids = malloc(sizeof *ids * (size_t)nt);
    uint8_t *m = mask ? malloc((size_t)nt) : NULL;
    for (int64_t i = 0; i < nt; i++) {
        ids[i] = 1 + (uint32_t)(loom_rng_uniform(seed, 2, (uint64_t)i) * 999);
        if (m) m[i] = loom_rng_uniform(seed, 3, (uint64_t)i) < 0.7;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", loom_test_tmpdir(), name);
    loom_tokfile *tf = NULL;
    if (loom_tokfile_write(ctx, path, ids, nt, off, n, m, 1024) ||
        loom_tokfile_open(ctx, path, &tf))
        fprintf(stderr, "    make_file: %s\n", loom_last_error(ctx));
    free(off);
    free(ids);
    free(m);
    return tf;
}

static loom_tokfile *open_abc(loom_ctx *ctx) {
    /* A = 10 11 12, B = 20 21 22 23 24, C = 30 31; mask on B's last three */
    static const uint32_t ids[10] = {10, 11, 12, 20, 21, 22, 23, 24, 30, 31};
    static const uint64_t off[4] = {0, 3, 8, 10};
    static const uint8_t mask[10] = {1, 1, 1, 0, 0, 1, 1, 1, 1, 1};
    char path[1024];
    snprintf(path, sizeof path, "%s/abc.tokens", loom_test_tmpdir());
    loom_tokfile *tf = NULL;
    if (loom_tokfile_write(ctx, path, ids, 10, off, 3, mask, 64) ||
        loom_tokfile_open(ctx, path, &tf))
        fprintf(stderr, "    open_abc: %s\n", loom_last_error(ctx));
    return tf;
}

static loom_loader_config cfg_of(int64_t S, int64_t mbs, int64_t n_micro, int64_t dp,
                                 uint64_t seed) {
    return (loom_loader_config){.seq_len = S,
                                .micro_batch_size = mbs,
                                .num_micro_batches = n_micro,
                                .dp = dp,
                                .seed = seed};
}

/* Every rule of loader.h checked on one batch against the file. Returns the
 * number of failures. */
static int check_batch(const loom_loader_batch *b, const loom_tokfile *tf) {
    int fails = 0;
#define BCHECK(c)                                                                    \
    do {                                                                             \
        if (!(c)) {                                                                  \
            if (fails++ < 5) loom_test_fail(__FILE__, __LINE__, "batch: %s", #c);    \
        }                                                                            \
    } while (0)
    const int64_t S = b->b.seq_len, n = b->b.rows * S;
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    const uint32_t *ids = loom_tokfile_ids(tf);
    const uint8_t *mask = loom_tokfile_mask(tf);
    const int32_t *cu = b->b.cu_seqlens;
    BCHECK(cu[0] == 0 && cu[b->b.n_docs] == n);
    int64_t row_ends = 0, ntg = 0, nsamp = 0, ntok = 0;
    for (int64_t s = 0; s < b->b.n_docs; s++) {
        int64_t a = cu[s], e = cu[s + 1], d = b->segment_doc[s];
        BCHECK(a < e && a / S == (e - 1) / S); /* inside one row */
        row_ends += e % S == 0;
        for (int64_t t = a; t < e; t++) BCHECK(b->b.position_ids[t] == t - a);
        if (d < 0) { /* padding: only at the end of a row */
            BCHECK(e % S == 0);
            for (int64_t t = a; t < e; t++)
                BCHECK(b->b.input_ids[t] == 0 && b->b.targets[t] == LOOM_IGNORE_INDEX);
            continue;
        }
        nsamp++;
        ntok += e - a;
        /* a whole document (these files need no truncation) */
        BCHECK((uint64_t)(e - a) == off[d + 1] - off[d]);
        for (int64_t t = a; t < e; t++) {
            uint64_t i = off[d] + (uint64_t)(t - a);
            BCHECK(b->b.input_ids[t] == (int32_t)ids[i]);
            int32_t want = t + 1 < e && (!mask || mask[i + 1]) ? (int32_t)ids[i + 1]
                                                               : LOOM_IGNORE_INDEX;
            BCHECK(b->b.targets[t] == want);
            ntg += want != LOOM_IGNORE_INDEX;
        }
    }
    BCHECK(row_ends == b->b.rows);
    BCHECK(ntg == b->n_targets && nsamp == b->n_samples && ntok == b->n_tokens);
    return fails;
#undef BCHECK
}

TEST(loader_shuffle_is_a_function_of_seed_and_epoch) {
    enum { N = 1000 };
    int64_t *a = malloc(sizeof *a * N), *b = malloc(sizeof *b * N), *c = malloc(sizeof *c * N);
    loom_data_shuffle(7, 0, N, a);
    loom_data_shuffle(7, 0, N, b);
    CHECK(!memcmp(a, b, sizeof *a * N));
    char seen[N] = {0};
    for (int i = 0; i < N; i++) {
        REQUIRE(a[i] >= 0 && a[i] < N && !seen[a[i]]);
        seen[a[i]] = 1;
    }
    loom_data_shuffle(7, 1, N, c); /* another epoch */
    int same = 0;
    for (int i = 0; i < N; i++) same += a[i] == c[i];
    CHECK_MSG(same < 20, "epochs 0 and 1 agree on %d of %d places", same, N);
    loom_data_shuffle(8, 0, N, c); /* another seed */
    same = 0;
    for (int i = 0; i < N; i++) same += a[i] == c[i];
    CHECK_MSG(same < 20, "seeds 7 and 8 agree on %d of %d places", same, N);
    /* tiny cases */
    int64_t one = 5;
    loom_data_shuffle(1, 0, 1, &one);
    CHECK_EQ_INT(one, 0);
    loom_data_shuffle(1, 0, 0, NULL);
    free(a);
    free(b);
    free(c);
}

/* The hand-worked example: A(3) B(5) C(2), S = 6, 2 rows, file order. */
TEST(loader_packs_whole_samples_greedily) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx);
    REQUIRE(tf);
    loom_loader_config c = cfg_of(6, 2, 1, 1, 0);
    c.no_shuffle = true;
    loom_loader *l;
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &l));
    loom_loader_batch b;
    REQUIRE_OK(ctx, loom_loader_next(ctx, l, &b));
    /* row 0: A, padding 3 (B does not fit); row 1: B, padding 1 (C does not fit) */
    static const int32_t in1[12] = {10, 11, 12, 0, 0, 0, 20, 21, 22, 23, 24, 0};
    static const int32_t tg1[12] = {11, 12, -100, -100, -100, -100, -100, 22, 23, 24, -100, -100};
    static const int32_t ps1[12] = {0, 1, 2, 0, 1, 2, 0, 1, 2, 3, 4, 0};
    static const int32_t cu1[5] = {0, 3, 6, 11, 12};
    static const int64_t sd1[4] = {0, -1, 1, -1};
    CHECK(!memcmp(b.b.input_ids, in1, sizeof in1));
    CHECK(!memcmp(b.b.targets, tg1, sizeof tg1));
    CHECK(!memcmp(b.b.position_ids, ps1, sizeof ps1));
    CHECK_EQ_INT(b.b.n_docs, 4);
    CHECK(!memcmp(b.b.cu_seqlens, cu1, sizeof cu1));
    CHECK(!memcmp(b.segment_doc, sd1, sizeof sd1));
    CHECK_EQ_INT(b.n_samples, 2);
    CHECK_EQ_INT(b.n_tokens, 8);
    CHECK_EQ_INT(b.n_targets, 5);
    CHECK_EQ_INT(loom_loader_state(l).epoch, 0);
    CHECK_EQ_INT(loom_loader_state(l).index, 2);
    /* row 0: C then A of epoch 1, padding 1; row 1: B, padding 1 */
    REQUIRE_OK(ctx, loom_loader_next(ctx, l, &b));
    static const int32_t in2[12] = {30, 31, 10, 11, 12, 0, 20, 21, 22, 23, 24, 0};
    static const int32_t cu2[6] = {0, 2, 5, 6, 11, 12};
    static const int64_t sd2[5] = {2, 0, -1, 1, -1};
    CHECK(!memcmp(b.b.input_ids, in2, sizeof in2));
    CHECK(!memcmp(b.b.cu_seqlens, cu2, sizeof cu2));
    CHECK(!memcmp(b.segment_doc, sd2, sizeof sd2));
    CHECK_EQ_INT(b.start.epoch, 0);
    CHECK_EQ_INT(b.start.index, 2);
    CHECK_EQ_INT(loom_loader_state(l).epoch, 1);
    CHECK_EQ_INT(loom_loader_state(l).index, 2);
    CHECK_EQ_INT(check_batch(&b, tf), 0);
    loom_loader_free(l);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* Many batches of random files: every rule, greedy filling, and each epoch
 * visiting every sample once in the order loom_data_shuffle gives. */
TEST(loader_invariants_and_epoch_orders) {
    loom_ctx *ctx = new_ctx();
    for (int trial = 0; trial < 6; trial++) {
        int64_t n = 5 + trial * 17, S = 8 + trial * 5, maxlen = S;
        loom_tokfile *tf = make_file(ctx, "r.tokens", n, maxlen, 100 + (uint64_t)trial, trial & 1);
        REQUIRE(tf);
        loom_loader_config c = cfg_of(S, 1 + trial % 2, 2, 1 + trial % 3, 42);
        loom_loader *l;
        REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &l));
        int64_t want = 3 * n, got = 0, *seq = malloc(sizeof *seq * (size_t)(want + 4096));
        int64_t prev_pad = -1;
        while (got < want) {
            loom_loader_batch b;
            REQUIRE_OK(ctx, loom_loader_next(ctx, l, &b));
            REQUIRE(check_batch(&b, tf) == 0);
            for (int64_t s = 0; s < b.b.n_docs; s++) {
                int64_t d = b.segment_doc[s];
                int64_t len = b.b.cu_seqlens[s + 1] - b.b.cu_seqlens[s];
                if (d < 0) {
                    prev_pad = len;
                    continue;
                }
                /* greedy: a sample that starts a row did not fit in the padding before it */
                if (b.b.cu_seqlens[s] % S == 0 && prev_pad >= 0) CHECK(len > prev_pad);
                prev_pad = -1;
                seq[got++] = d;
            }
        }
        int64_t *order = malloc(sizeof *order * (size_t)n);
        for (int64_t e = 0; e < 3; e++) {
            loom_data_shuffle(42, e, n, order);
            CHECK_MSG(!memcmp(seq + e * n, order, sizeof *order * (size_t)n),
                      "trial %d: epoch %d is not the shuffled order", trial, (int)e);
        }
        if (n > 20) CHECK(memcmp(seq, seq + n, sizeof *seq * (size_t)n) != 0);
        free(order);
        free(seq);
        loom_loader_free(l);
        loom_tokfile_free(tf);
    }
    loom_ctx_free(ctx);
}

TEST(loader_same_seed_same_batches_other_seed_other) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = make_file(ctx, "s.tokens", 64, 12, 5, true);
    REQUIRE(tf);
    loom_loader_config c1 = cfg_of(16, 2, 2, 1, 3), c2 = c1;
    c2.seed = 4;
    loom_loader *a, *b, *o;
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c1, &a));
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c1, &b));
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c2, &o));
    int differ = 0;
    for (int it = 0; it < 10; it++) {
        loom_loader_batch x, y, z;
        REQUIRE_OK(ctx, loom_loader_next(ctx, a, &x));
        REQUIRE_OK(ctx, loom_loader_next(ctx, b, &y));
        REQUIRE_OK(ctx, loom_loader_next(ctx, o, &z));
        size_t bytes = (size_t)(x.b.rows * x.b.seq_len) * sizeof(int32_t);
        CHECK(!memcmp(x.b.input_ids, y.b.input_ids, bytes) && !memcmp(x.b.targets, y.b.targets, bytes));
        CHECK(x.b.n_docs == y.b.n_docs &&
              !memcmp(x.b.cu_seqlens, y.b.cu_seqlens, sizeof(int32_t) * (size_t)(x.b.n_docs + 1)));
        differ += memcmp(x.b.input_ids, z.b.input_ids, bytes) != 0;
    }
    CHECK(differ >= 9);
    loom_loader_free(a);
    loom_loader_free(b);
    loom_loader_free(o);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* dp = 3: rank r's slice is rows [r*R, (r+1)*R) with cu_seqlens rebased;
 * over the batches of an epoch every sample lands in exactly one slice. */
TEST(loader_dp_slices_disjoint_and_complete) {
    loom_ctx *ctx = new_ctx();
    const int64_t n = 101, S = 24, dp = 3, mbs = 2, n_micro = 2, R = mbs * n_micro;
    loom_tokfile *tf = make_file(ctx, "dp.tokens", n, 20, 9, false);
    REQUIRE(tf);
    loom_loader_config c = cfg_of(S, mbs, n_micro, dp, 11);
    loom_loader *l;
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &l));
    loom_loader_info info;
    loom_loader_get_info(l, &info);
    CHECK_EQ_INT(info.rows, R * dp);
    CHECK_EQ_INT(info.n_samples, n);
    loom_loader_batch b;
    CHECK(loom_loader_slice(ctx, l, 0, &b) != LOOM_OK); /* nothing to slice yet */
    int *count = calloc((size_t)n, sizeof *count);
    int64_t seen = 0;
    while (seen < n) {
        loom_loader_batch g;
        REQUIRE_OK(ctx, loom_loader_next(ctx, l, &g));
        int64_t gseg = 0, gtg = 0;
        for (int64_t r = 0; r < dp; r++) {
            loom_loader_batch sl;
            REQUIRE_OK(ctx, loom_loader_slice(ctx, l, r, &sl));
            CHECK_EQ_INT(sl.b.rows, R);
            CHECK(sl.b.input_ids == g.b.input_ids + r * R * S);
            CHECK(sl.b.targets == g.b.targets + r * R * S);
            CHECK(sl.b.cu_seqlens[0] == 0 && sl.b.cu_seqlens[sl.b.n_docs] == R * S);
            for (int64_t s = 0; s < sl.b.n_docs; s++) {
                /* the same segment as in the global batch, shifted */
                CHECK(sl.b.cu_seqlens[s + 1] + r * R * S == g.b.cu_seqlens[gseg + s + 1]);
                int64_t d = sl.segment_doc[s];
                /* count epoch-0 samples only: the first n samples met */
                if (d >= 0 && seen < n) {
                    count[d]++;
                    seen++;
                }
            }
            gseg += sl.b.n_docs;
            gtg += sl.n_targets;
        }
        CHECK_EQ_INT(gseg, g.b.n_docs);
        CHECK_EQ_INT(gtg, g.n_targets);
    }
    for (int64_t d = 0; d < n; d++) CHECK_MSG(count[d] == 1, "sample %d seen %d times", (int)d, count[d]);
    CHECK(loom_loader_slice(ctx, l, dp, &b) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "rank 3 is not in [0, 3)");
    free(count);
    loom_loader_free(l);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* A loader given a saved position reproduces every later batch, from any
 * step, mid-epoch and across epoch boundaries. */
TEST(loader_resume_reproduces_the_run) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = make_file(ctx, "res.tokens", 37, 15, 21, true);
    REQUIRE(tf);
    loom_loader_config c = cfg_of(16, 2, 1, 2, 77);
    enum { STEPS = 30 };
    loom_loader *a;
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &a));
    const size_t n = 4 * 16;
    int32_t(*in)[64] = malloc(sizeof *in * STEPS), (*tg)[64] = malloc(sizeof *tg * STEPS);
    loom_loader_pos pos[STEPS];
    for (int s = 0; s < STEPS; s++) {
        pos[s] = loom_loader_state(a);
        loom_loader_batch b;
        REQUIRE_OK(ctx, loom_loader_next(ctx, a, &b));
        CHECK(b.start.epoch == pos[s].epoch && b.start.index == pos[s].index);
        memcpy(in[s], b.b.input_ids, n * 4);
        memcpy(tg[s], b.b.targets, n * 4);
    }
    CHECK(loom_loader_state(a).epoch >= 2); /* the run crossed epochs */
    for (int from = 0; from < STEPS; from += 3) {
        loom_loader *r;
        REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &r));
        REQUIRE_OK(ctx, loom_loader_set_state(ctx, r, pos[from]));
        for (int s = from; s < STEPS; s++) {
            loom_loader_batch b;
            REQUIRE_OK(ctx, loom_loader_next(ctx, r, &b));
            CHECK_MSG(!memcmp(b.b.input_ids, in[s], n * 4) && !memcmp(b.b.targets, tg[s], n * 4),
                      "resumed at step %d: step %d differs", from, s);
        }
        loom_loader_free(r);
    }
    /* positions that cannot be */
    CHECK(loom_loader_set_state(ctx, a, (loom_loader_pos){0, 37}) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "index 37 is not in [0, 37)");
    CHECK(loom_loader_set_state(ctx, a, (loom_loader_pos){-1, 0}) == LOOM_ERR_INVALID_ARG);
    free(in);
    free(tg);
    loom_loader_free(a);
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* Documents longer than seq_len in a .tokens file: each policy. */
TEST(loader_truncation_policies) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx); /* B has 5 tokens */
    REQUIRE(tf);
    loom_loader_config c = cfg_of(4, 1, 1, 1, 0);
    c.no_shuffle = true;
    loom_loader *l = NULL;
    CHECK(loom_loader_create(ctx, tf, &c, &l) == LOOM_ERR_INVALID_ARG && !l);
    CHECK_CONTAINS(loom_last_error(ctx), "document 1 has 5 tokens, more than seq_len = 4");
    loom_truncation t;
    CHECK_OK(ctx, loom_truncation_parse(ctx, "right", &t));
    CHECK_EQ_INT(t, LOOM_TRUNC_RIGHT);
    CHECK(loom_truncation_parse(ctx, "middle", &t) == LOOM_ERR_CONFIG);
    static const struct {
        loom_truncation t;
        int32_t row1[4];
        int64_t samples, truncated, dropped;
    } cases[] = {
        {LOOM_TRUNC_RIGHT, {20, 21, 22, 23}, 3, 1, 0},
        {LOOM_TRUNC_LEFT, {21, 22, 23, 24}, 3, 1, 0},
        {LOOM_TRUNC_DROP, {30, 31, 0, 0}, 2, 0, 1},
    };
    for (int k = 0; k < 3; k++) {
        c.truncation = cases[k].t;
        REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &l));
        loom_loader_info info;
        loom_loader_get_info(l, &info);
        CHECK_EQ_INT(info.n_samples, cases[k].samples);
        CHECK_EQ_INT(info.n_truncated, cases[k].truncated);
        CHECK_EQ_INT(info.n_dropped, cases[k].dropped);
        loom_loader_batch b;
        REQUIRE_OK(ctx, loom_loader_next(ctx, l, &b)); /* A */
        REQUIRE_OK(ctx, loom_loader_next(ctx, l, &b)); /* B truncated, or C */
        CHECK_MSG(!memcmp(b.b.input_ids, cases[k].row1, sizeof cases[k].row1), "policy %s",
                  loom_truncation_name(cases[k].t));
        if (cases[k].t == LOOM_TRUNC_LEFT) { /* the mask moves with the tokens: 21 -> 22 masked */
            static const int32_t tg[4] = {22, 23, 24, -100};
            CHECK(!memcmp(b.b.targets, tg, sizeof tg));
        }
        loom_loader_free(l);
    }
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

TEST(loader_refuses_bad_shapes) {
    loom_ctx *ctx = new_ctx();
    loom_tokfile *tf = open_abc(ctx);
    REQUIRE(tf);
    loom_loader *l = NULL;
    loom_loader_config c = cfg_of(1, 1, 1, 1, 0);
    CHECK(loom_loader_create(ctx, tf, &c, &l) == LOOM_ERR_INVALID_ARG && !l);
    CHECK_CONTAINS(loom_last_error(ctx), "seq_len = 1 is too short");
    c = cfg_of(8, 1, 0, 1, 0);
    CHECK(loom_loader_create(ctx, tf, &c, &l) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "num_micro_batches = 0");
    c = cfg_of(1 << 20, 1 << 10, 1 << 10, 1, 0);
    CHECK(loom_loader_create(ctx, tf, &c, &l) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "int32 cu_seqlens");
    loom_tokfile_free(tf);
    /* every document too long and dropped */
    static const uint32_t ids[7] = {1, 2, 3, 4, 5, 6, 7};
    static const uint64_t off[3] = {0, 3, 7};
    char path[1024];
    snprintf(path, sizeof path, "%s/long.tokens", loom_test_tmpdir());
    REQUIRE_OK(ctx, loom_tokfile_write(ctx, path, ids, 7, off, 2, NULL, 0));
    REQUIRE_OK(ctx, loom_tokfile_open(ctx, path, &tf));
    c = cfg_of(2, 1, 1, 1, 0);
    c.truncation = LOOM_TRUNC_DROP;
    CHECK(loom_loader_create(ctx, tf, &c, &l) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "no sample is left: all 2 documents are longer than "
                                         "seq_len = 2 and were dropped");
    loom_tokfile_free(tf);
    loom_ctx_free(ctx);
}

/* Through the model: the log-probs of a packed batch equal, token by token,
 * those of each sample run alone (attention never crosses a sample,
 * positions restart, the loss mask gives the same targets). */
TEST(loader_packed_logprobs_equal_separate_runs) {
    loom_ctx *ctx = new_ctx();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model *m = NULL;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, NULL, &m));
    loom_tokfile *tf = make_file(ctx, "model.tokens", 9, 14, 33, true);
    REQUIRE(tf);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    const uint32_t *ids = loom_tokfile_ids(tf);
    const uint8_t *mask = loom_tokfile_mask(tf);
    loom_loader_config c = cfg_of(24, 2, 1, 1, 5);
    loom_loader *l;
    REQUIRE_OK(ctx, loom_loader_create(ctx, tf, &c, &l));
    for (int it = 0; it < 3; it++) {
        loom_loader_batch b;
        REQUIRE_OK(ctx, loom_loader_next(ctx, l, &b));
        REQUIRE(check_batch(&b, tf) == 0);
        loom_batch mb = {.rows = b.b.rows, .seq_len = b.b.seq_len, .input_ids = b.b.input_ids,
                         .targets = b.b.targets, .cu_seqlens = b.b.cu_seqlens,
                         .n_docs = b.b.n_docs, .position_ids = b.b.position_ids};
        float packed[48];
        REQUIRE_OK(ctx, loom_model_forward_only(m, &mb, 1, packed, NULL, NULL, NULL));
        double worst = 0, scale = 0;
        for (int64_t s = 0; s < b.b.n_docs; s++) {
            int64_t d = b.segment_doc[s], a = b.b.cu_seqlens[s], len = b.b.cu_seqlens[s + 1] - a;
            if (d < 0) {
                for (int64_t t = a; t < a + len; t++) CHECK(packed[t] == 0.0f);
                continue;
            }
            int32_t sid[24], stg[24];
            for (int64_t j = 0; j < len; j++) {
                uint64_t i = off[d] + (uint64_t)j;
                sid[j] = (int32_t)ids[i];
                stg[j] = j + 1 < len && mask[i + 1] ? (int32_t)ids[i + 1] : LOOM_IGNORE_INDEX;
            }
            loom_batch one = {.rows = 1, .seq_len = len, .input_ids = sid, .targets = stg};
            float alone[24];
            REQUIRE_OK(ctx, loom_model_forward_only(m, &one, 1, alone, NULL, NULL, NULL));
            for (int64_t j = 0; j < len; j++) {
                CHECK(b.b.targets[a + j] == stg[j]);
                double e = fabs((double)alone[j] - packed[a + j]);
                if (e > worst) worst = e;
                if (fabs(alone[j]) > scale) scale = fabs(alone[j]);
            }
        }
        CHECK_MSG(worst <= 1e-5 * (scale > 1 ? scale : 1), "batch %d: max |packed - alone| = %g",
                  it, worst);
    }
    loom_loader_free(l);
    loom_tokfile_free(tf);
    loom_model_free(m);
    loom_ctx_free(ctx);
}
