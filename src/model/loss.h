/* The loss hook: forward.c's output layer computes the logits a block of
 * rows at a time, vocabulary-parallel (this rank's Vl columns of the padded
 * vocabulary, from column v0 of the whole), and hands each block to the
 * model's loss, so the full logits never exist. A loss kind keeps what it
 * needs of each block (per-row sums, on the device), turns the block into
 * its own gradient when asked, and at the end of the micro-batch gives the
 * per-token results and the micro-batch's loss on the host.
 *
 * Today's kind is the cross-entropy (loss_ce.c), with each token's loss and
 * gradient times its weight from the batch (loom_batch.loss_weights:
 * advantages of a policy-gradient loss, soft masks). A new loss (DPO, a
 * clipped policy ratio against old log-probs) is one more kind: the batch
 * carries its per-token inputs the way it carries the weights. */
#ifndef LOOM_MODEL_LOSS_H
#define LOOM_MODEL_LOSS_H

#include "kern.h"

/* One block of rows [r0, r0 + c) of the micro-batch's local tokens: the
 * logits z (c, Vl) in the compute dtype on the device, this rank's
 * columns starting at vocabulary id v0. */
typedef struct loom_loss_block {
    void *z;
    int64_t r0, c;
    int64_t Vl, v0, nvalid; /* nvalid: columns inside the real vocabulary */
} loom_loss_block;

typedef struct loom_loss_kind {
    const char *name;
    /* Per-row statistics of the block (all-reduced over tp where the
     * vocabulary is split); with grad, z then becomes loss_scale times the
     * gradient of the micro-batch's summed loss (rows without a loss: 0). */
    loom_status (*block)(loom_model *m, const loom_micro *mb, const loom_loss_block *b,
                         bool grad);
    /* After the micro-batch's blocks: each token's log-prob and entropy at
     * its global index (written by tp rank 0; NULL: not wanted), the summed
     * loss and the count of tokens with a target. */
    loom_status (*finish)(loom_model *m, const loom_micro *mb, float *token_logprob,
                          float *entropy, double *loss_sum, int64_t *n_tokens);
} loom_loss_kind;

/* The cross-entropy of the next token (with per-token weights). */
const loom_loss_kind *loom_loss_cross_entropy(void);

#endif /* LOOM_MODEL_LOSS_H */
