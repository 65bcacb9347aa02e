/* Token files (".tokens"): a documented binary format for tokenized corpora,
 * its validating reader and atomic writer, and a sequential packer that turns
 * a file into fixed-shape training rows. docs/token-file.md has the same
 * description with examples.
 *
 * File layout (all integers little-endian):
 *
 *   offset  size  field
 *        0     8  magic "LOOMTOK1"
 *        8     4  u32 version = 1
 *       12     4  u32 flags: bit 0 = a loss-mask section follows the ids;
 *                 every other bit must be 0
 *       16     8  u64 n_tokens   (> 0)
 *       24     8  u64 n_docs     (> 0)
 *       32     8  u64 vocab_size (0 = not recorded; otherwise every id < it)
 *       40    24  reserved, must be zero
 *       64        u64 doc_offsets[n_docs + 1]: offsets[0] = 0, strictly
 *                 increasing (no empty documents), offsets[n_docs] = n_tokens;
 *                 document d is ids[offsets[d] .. offsets[d+1])
 *                 u32 ids[n_tokens]
 *                 u8 loss_mask[n_tokens] (only with flag bit 0): 0 or 1;
 *                 1 marks a token that should be predicted
 *
 * The file size must equal exactly 64 + 8 (n_docs + 1) + 4 n_tokens
 * (+ n_tokens with the mask). Every section starts at a multiple of its
 * element size, so a mapped file is read in place.
 *
 * The reader validates everything (magic, version, flags, reserved bytes,
 * sizes without overflow, exact file size, offsets, ids below vocab_size,
 * mask values) before a handle exists; every error names the file and says
 * what is wrong. The writer checks the same invariants and writes to
 * PATH.tmp, fsyncs and renames, so a crash never leaves half a file at PATH.
 *
 * Packing (loom_packer): documents are read in file order and wrap around to
 * the first document after the last (each wrap adds one to `epoch`). A batch
 * is B rows of S tokens, flattened to B*S. A row is filled with segments:
 *   - each document, or the piece of it that fits, is one segment; a
 *     document longer than the room left in the row is split: the part that
 *     fits ends this row, the rest continues at the start of the next row (or
 *     batch) as a new segment;
 *   - position_ids restart at 0 at the start of every segment;
 *   - targets[t] = the next token of the same document when that token is in
 *     the same segment, else -100 (the last token of every segment carries
 *     no loss); with a loss mask, targets[t] is also -100 where
 *     mask[next token] == 0;
 *   - when fewer than 2 tokens are left in a row, they are padding, as a
 *     segment of their own: input id 0, target -100, positions 0, 1, ...
 * cu_seqlens holds the n_segments + 1 segment boundaries over the flattened
 * B*S tokens (0 first, B*S last); segments never cross rows, so every
 * multiple of S is a boundary. The packer's position {doc, offset, epoch}
 * (loom_packer_state / loom_packer_set_state) resumes it exactly.
 */
#ifndef LOOM_DATA_TOKENS_H
#define LOOM_DATA_TOKENS_H

#include "../core/core.h"

#define LOOM_TOKFILE_MAGIC "LOOMTOK1"
#define LOOM_TOKFILE_VERSION 1u
#define LOOM_TOKFILE_HEADER_BYTES 64
#define LOOM_TOKFILE_FLAG_MASK 1u /* a loss-mask section follows the ids */
/* Target of a token that carries no loss. */
#define LOOM_IGNORE_INDEX (-100)

/* ---- reading ---- */

typedef struct loom_tokfile loom_tokfile;

/* Opens and validates a token file (mapped read-only; nothing is exposed
 * before every check has passed). Errors name the path. */
loom_status loom_tokfile_open(loom_ctx *ctx, const char *path, loom_tokfile **out);
/* The same over an in-memory file image. The bytes are copied (into an
 * aligned buffer), so `data` need not outlive the handle nor be aligned.
 * `what` names the image in errors. Used by tests and the fuzzer. */
loom_status loom_tokfile_open_buffer(loom_ctx *ctx, const void *data, size_t len,
                                     const char *what, loom_tokfile **out);
void loom_tokfile_free(loom_tokfile *tf);

int64_t loom_tokfile_n_tokens(const loom_tokfile *tf);
int64_t loom_tokfile_n_docs(const loom_tokfile *tf);
uint64_t loom_tokfile_vocab_size(const loom_tokfile *tf); /* 0: not recorded */
const uint64_t *loom_tokfile_doc_offsets(const loom_tokfile *tf); /* (n_docs + 1) */
const uint32_t *loom_tokfile_ids(const loom_tokfile *tf);         /* (n_tokens) */
const uint8_t *loom_tokfile_mask(const loom_tokfile *tf); /* (n_tokens), NULL when absent */
uint32_t loom_tokfile_max_id(const loom_tokfile *tf);     /* largest id in the file */

/* ---- writing ---- */

/* Writes a token file atomically. doc_offsets has n_docs + 1 entries;
 * mask (n_tokens values, 0 or 1) may be NULL; vocab_size 0 records none.
 * Every invariant of the format is checked first: nothing is written when
 * one fails, and the message names the path and the offending index. */
loom_status loom_tokfile_write(loom_ctx *ctx, const char *path, const uint32_t *ids,
                               int64_t n_tokens, const uint64_t *doc_offsets, int64_t n_docs,
                               const uint8_t *mask, uint64_t vocab_size);

/* ---- packing ---- */

/* Where the packer reads next: document index, token offset inside that
 * document, and how many times the whole file has been read. */
typedef struct loom_packer_pos {
    int64_t doc;
    int64_t offset;
    int64_t epoch;
} loom_packer_pos;

/* One batch. The arrays belong to the packer and stay valid until the next
 * loom_packer_next or loom_packer_free. */
typedef struct loom_packed_batch {
    /* What the model consumes (loom_model_forward_backward takes &b): B
     * rows of S tokens, targets (LOOM_IGNORE_INDEX where no loss),
     * position_ids (0 at the start of every segment), cu_seqlens (n_docs + 1
     * segment starts over the flattened B*S tokens). */
    loom_batch b;
    int64_t n_targets;      /* tokens whose target is not LOOM_IGNORE_INDEX */
    loom_packer_pos start;  /* where this batch began (start.epoch: its epoch) */
} loom_packed_batch;

typedef struct loom_packer loom_packer;

/* A packer of `rows` rows of `seq_len` tokens over tf, starting at the first
 * document, epoch 0. tf is borrowed and must outlive the packer. Needs
 * seq_len >= 2, rows >= 1, rows * seq_len <= INT32_MAX and every id of tf
 * <= INT32_MAX (input_ids are int32). All memory is allocated here. */
loom_status loom_packer_create(loom_ctx *ctx, const loom_tokfile *tf, int64_t seq_len,
                               int64_t rows, loom_packer **out);
void loom_packer_free(loom_packer *p);
/* Fills the next batch (never fails on a packer that was created). */
loom_status loom_packer_next(loom_ctx *ctx, loom_packer *p, loom_packed_batch *out);
/* Where the next batch will start; saving it and passing it to
 * loom_packer_set_state later (on a packer of the same file and shape)
 * reproduces the same batches. */
loom_packer_pos loom_packer_state(const loom_packer *p);
/* Refuses a position outside the file (doc not in [0, n_docs), offset not
 * inside that document, epoch < 0). */
loom_status loom_packer_set_state(loom_ctx *ctx, loom_packer *p, loom_packer_pos pos);

#endif /* LOOM_DATA_TOKENS_H */
