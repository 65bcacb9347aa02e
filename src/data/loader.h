/* The data loader: samples (the documents of a token file) in a shuffled
 * order, packed padding-free into fixed-shape global batches, with a small
 * position that resumes it exactly.
 *
 * Samples. Document d of the token file is sample d. A document longer than
 * seq_len is handled by the truncation policy when the loader is created
 * (error: refused, naming the document and both lengths; left: its last
 * seq_len tokens; right: its first seq_len tokens; drop: left out and
 * counted). Token caches made from JSONL (dataset.h) are truncated already.
 *
 * Order. Epoch e visits every sample once, in the order of a Fisher-Yates
 * shuffle drawn from the counter-based RNG: for i = n-1 .. 1, j =
 * floor(loom_rng_uniform(seed, LOOM_DATA_SHUFFLE_KEY + e, i) * (i + 1)),
 * swap(order[i], order[j]) starting from the identity (loom_data_shuffle).
 * The order depends on (seed, epoch, n) only.
 *
 * Packing. A global batch is rows = micro_batch_size x num_micro_batches x
 * dp rows of seq_len tokens, filled row by row, greedily in the shuffled
 * order: the next sample goes into the current row when it fits in the room
 * left, else the row is closed and the sample starts the next row (or the
 * next batch). A sample is never split. After the last sample of an epoch
 * the first of the next epoch follows (a batch may hold both). Each sample
 * is one segment: position_ids restart at 0, targets[t] = the sample's next
 * token, or -100 for its last token, or where the loss mask of the next
 * token is 0. The room left at the end of a row is padding, a segment of its
 * own: input id 0, target -100, positions 0, 1, .... cu_seqlens (int32) are
 * the segment boundaries over the flattened rows*seq_len tokens: 0 first,
 * rows*seq_len last, every multiple of seq_len among them.
 *
 * Data parallelism. Data-parallel rank r trains on rows [r*R, (r+1)*R) of
 * each global batch, R = micro_batch_size x num_micro_batches
 * (loom_loader_slice). loom's trainer takes the whole global batch on every
 * rank and slices it itself: give it loom_loader_next's batch (its b, the
 * model's loom_batch, marked global); a slice's b is marked local (this
 * rank's rows), so the model takes that as well.
 *
 * Resuming. loom_loader_state is {epoch, index}: the next batch starts with
 * sample order_epoch[index]. Batches never carry anything over (a row ends
 * where the batch ends), so a loader given that position with
 * loom_loader_set_state (same token file, seed, seq_len and batch shape)
 * produces exactly the batches an uninterrupted run would have. */
#ifndef LOOM_DATA_LOADER_H
#define LOOM_DATA_LOADER_H

#include "tokens.h"

/* The stream key of the shuffle of epoch e is LOOM_DATA_SHUFFLE_KEY + e. */
#define LOOM_DATA_SHUFFLE_KEY 0x6c6f6f6d2d646174ull /* "loom-dat" */

/* What to do with a sample longer than seq_len. */
typedef enum loom_truncation {
    LOOM_TRUNC_ERROR = 0, /* refuse it, naming where it is and both lengths */
    LOOM_TRUNC_LEFT,      /* keep its last seq_len tokens */
    LOOM_TRUNC_RIGHT,     /* keep its first seq_len tokens */
    LOOM_TRUNC_DROP,      /* leave it out and count it */
} loom_truncation;

/* "error" | "left" | "right" | "drop" */
loom_status loom_truncation_parse(loom_ctx *ctx, const char *name, loom_truncation *out);
const char *loom_truncation_name(loom_truncation t);

/* order[0..n) = the shuffled order of epoch `epoch` (see above). */
void loom_data_shuffle(uint64_t seed, int64_t epoch, int64_t n, int64_t *order);

typedef struct loom_loader_config {
    int64_t seq_len;           /* tokens per row, >= 2 */
    int64_t micro_batch_size;  /* rows per micro-batch, >= 1 */
    int64_t num_micro_batches; /* micro-batches per data-parallel rank per step, >= 1 */
    int64_t dp;                /* data-parallel ranks, >= 1 */
    uint64_t seed;             /* shuffle seed */
    bool no_shuffle;           /* file order in every epoch */
    loom_truncation truncation;
} loom_loader_config;

/* Where the next batch starts: sample order_epoch[index] of epoch `epoch`. */
typedef struct loom_loader_pos {
    int64_t epoch;
    int64_t index;
} loom_loader_pos;

/* A batch. Arrays belong to the loader and stay valid until the next
 * loom_loader_next (a slice: until the next loom_loader_slice or next). */
typedef struct loom_loader_batch {
    /* What the model consumes (loom_model_forward_backward takes &b):
     * rows, seq_len, input_ids, targets (LOOM_IGNORE_INDEX where no loss),
     * position_ids (0 at the start of every segment), cu_seqlens (n_docs + 1
     * segment starts over the flattened rows*seq_len tokens). */
    loom_batch b;
    const int64_t *segment_doc;  /* (b.n_docs) document of the token file; -1: padding */
    int64_t n_samples;           /* segments that are samples */
    int64_t n_tokens;            /* tokens that are not padding */
    int64_t n_targets;           /* targets that are not LOOM_IGNORE_INDEX */
    loom_loader_pos start;       /* where the (global) batch began */
} loom_loader_batch;

typedef struct loom_loader_info {
    int64_t n_samples;   /* samples per epoch (after drop) */
    int64_t n_tokens;    /* their tokens (after truncation) */
    int64_t n_truncated; /* documents truncated (left / right) */
    int64_t n_dropped;   /* documents dropped */
    int64_t rows;        /* rows of a global batch */
} loom_loader_info;

typedef struct loom_loader loom_loader;

/* A loader over tf (borrowed: it must outlive the loader), at epoch 0,
 * index 0. Refuses a shape that cannot work (seq_len < 2, rows*seq_len past
 * INT32_MAX, ids past INT32_MAX), documents longer than seq_len under
 * LOOM_TRUNC_ERROR (naming the first), and a file with no sample left. */
loom_status loom_loader_create(loom_ctx *ctx, const loom_tokfile *tf, const loom_loader_config *cfg,
                               loom_loader **out);
void loom_loader_free(loom_loader *l);
void loom_loader_get_info(const loom_loader *l, loom_loader_info *info);

/* Packs the next global batch (every row of every data-parallel rank). */
loom_status loom_loader_next(loom_ctx *ctx, loom_loader *l, loom_loader_batch *out);
/* Rows [r*R, (r+1)*R) of the last global batch, for data-parallel rank r:
 * the same arrays from that row on, cu_seqlens rebased to 0. */
loom_status loom_loader_slice(loom_ctx *ctx, loom_loader *l, int64_t dp_rank,
                              loom_loader_batch *out);

loom_loader_pos loom_loader_state(const loom_loader *l);
/* Refuses a position outside the data (index not in [0, n_samples), epoch < 0). */
loom_status loom_loader_set_state(loom_ctx *ctx, loom_loader *l, loom_loader_pos pos);

#endif /* LOOM_DATA_LOADER_H */
