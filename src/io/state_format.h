/* The files of a training state (a loom_model_save_state directory), laid
 * out as Megatron's distributed checkpoints are: a safetensors file per
 * rank, rank_NNNNN.safetensors, with the slices of the tensors that rank
 * owns, and meta.json (format "loom-training-state", version 2) listing for
 * every tensor its shape, dtype and pieces, with each file's SHA-256.
 * train/checkpoint.c decides which pieces a rank owns and what else
 * meta.json says; this file knows where they go and reads them back.
 *
 * In a rank's file a piece is 1-D F32 under "<name>@<f0>" (values),
 * "exp_avg.<name>@<f0>" and "exp_avg_sq.<name>@<f0>" (moments); a tensor a
 * rank holds as several blocks (fused q, k and v rows, each split over tp)
 * names its pieces "<name>@<f0>.r<row0>", as f0 counts from the block's
 * start. In meta.json a piece is [rank, row0, col0, rows, cols, f0, len,
 * moments]. */
#ifndef LOOM_IO_STATE_FORMAT_H
#define LOOM_IO_STATE_FORMAT_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/core.h"
#include "../core/json.h"

#define LOOM_STATE_FORMAT "loom-training-state"
#define LOOM_STATE_VERSION 2

/* A slice: the flat range [f0, f0 + len) of a block (row0, col0, rows x
 * cols) of the vocabulary-padded whole tensor `tensor` (an index into the
 * tensor list), with the AdamW moments (moments 1) or values only. */
typedef struct loom_state_piece {
    int64_t tensor, row0, col0, rows, cols, f0, len, moments;
    bool split; /* one of the rank's several blocks of the tensor (its key names row0; not in
                 * meta.json: a reader looks for that key first) */
} loom_state_piece;

/* The trained tensors, over the whole model: names, shapes (cols 1 for
 * 1-D), dimensions. */
typedef struct loom_state_tensors {
    char **names;
    int64_t (*shape)[2];
    int *ndim;
    size_t n;
} loom_state_tensors;

/* "rank_NNNNN.safetensors" */
void loom_state_file_name(int rank, char name[40]);

/* Rank `rank`'s file in dir: each piece p[i]'s values from data[0] + at[i],
 * with moments (and p[i].moments) its moments from data[1] and data[2] at
 * the same offset. Its SHA-256 into sha. Any thread. */
loom_status loom_state_file_write(loom_ctx *ctx, const char *dir, int rank,
                                  const loom_state_tensors *t, const loom_state_piece *p,
                                  const size_t *at, size_t np, float *const data[3], bool moments,
                                  char sha[65]);

/* A rank's part of meta.json, as int64 words to gather: count, checksum
 * (8 words), then the pieces (8 words each). words: the size of each rank's
 * block for at most max_pieces pieces. */
size_t loom_state_words(size_t max_pieces);
void loom_state_pack(int64_t *words, const char sha[65], const loom_state_piece *p, size_t np);

/* meta.json in dir (written atomically): base's keys, then world_size,
 * "files" (each rank's file and checksum) and "tensors" from the world's
 * blocks (all: world blocks of `words`). Files of ranks past world (an
 * earlier save into this directory by more ranks) are removed. */
loom_status loom_state_meta_write(loom_ctx *ctx, const char *dir, const loom_json *base,
                                  const loom_state_tensors *t, int world, const int64_t *all,
                                  size_t words);

/* Reading: open verifies the directory (loom_verify_state: meta.json of
 * this format and version, every file present with its checksum) and
 * checks world_size and "tensors"; read assembles a whole tensor. */
typedef struct loom_state_reader loom_state_reader;
loom_status loom_state_open(loom_ctx *ctx, const char *dir, loom_state_reader **out);
const loom_json *loom_state_meta(const loom_state_reader *r);
const char *loom_state_meta_path(const loom_state_reader *r);
/* The whole tensor `name` (rows x cols as this model has it; cols 1 for
 * 1-D, ndim its dimensions) of kind k (0 values, 1 exp_avg, 2 exp_avg_sq)
 * into full, from its pieces in any rank's file. Refused, named: a tensor
 * missing or of another shape (another model), a piece out of range or
 * without moments, pieces that do not cover the tensor once. */
loom_status loom_state_read(loom_state_reader *r, const char *name, int ndim, int64_t rows,
                            int64_t cols, int k, float *full);
void loom_state_close(loom_state_reader *r);

#endif /* LOOM_IO_STATE_FORMAT_H */
