/* The distributed optimizer's layout, for the train verbs (trainer.c) and
 * the training state (checkpoint.c). */
#ifndef LOOM_TRAIN_TRAINER_H
#define LOOM_TRAIN_TRAINER_H

#include "../model/model.h"

/* The part of slot i in this rank's shard of bucket b (flat
 * offset, length, offset in the shard buffers); the distributed optimizer's
 * state (moments, gradient shard), allocated zeroed once. */
bool loom_shard_part(const loom_model *m, const loom_arena *A, int b, int i, size_t *o0,
                     size_t *len, size_t *so);
/* This rank's shard of bucket b: flat offset s0 and length per in the
 * arena, and where it starts in the shard buffers. */
/* The group bucket b of A is sharded over: edp for the experts' buckets,
 * dp x cp for the rest. */
struct loom_comm *loom_bucket_comm(const loom_model *m, const loom_arena *A, int b);
void loom_shard_range(const loom_model *m, const loom_arena *A, int b, size_t *s0, size_t *per,
                      size_t *base);
loom_status loom_optim_alloc(loom_model *m, loom_arena *A);

#endif /* LOOM_TRAIN_TRAINER_H */
