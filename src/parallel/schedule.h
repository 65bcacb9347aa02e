/* Pipeline schedules: the ordered forward and backward steps each pipeline
 * rank runs, and the messages between them.
 *
 * vpp == 1: 1F1B (PipeDream-flush): pp - rank - 1 warm-up forwards, then
 * one forward one backward, then the remaining backwards.
 *
 * vpp > 1: Megatron's interleaved 1F1B. Rank r holds model chunks c = 0 ..
 * vpp-1, chunk c being virtual stage c*pp + r. Micro-batches go in groups
 * of `group` (Megatron's microbatch_group_size_per_vp_stage, default pp):
 * the forward order runs chunk 0 over a group's micro-batches, then chunk 1
 * over the same ones, ..., then the next group; the last group takes all
 * that remain. Backward steps run the same order with the chunks reversed.
 * Warm-up is (pp - r - 1)*2 + (vpp-1)*group forwards (all of them when that
 * is more). Megatron's rule for the sizes: pp <= group <= micro-batches, and
 * the last group is whole or at least pp long (micro-batches % group == 0
 * or >= pp); loom_pp_check says which part fails.
 *
 * Messages (loom_pp_plan): every rank computes every rank's steps and plays
 * them in rounds: in a round each rank runs its next step if the step's
 * input arrived in an earlier round, and after it posts one group with the
 * step's output (to the rank of the next virtual stage) and the receive of
 * every message sent to it in that round. Each send is matched by a receive
 * in the peer's group of the same round, so a round's groups complete
 * together whether sends wait for their receivers (NCCL, large MPI
 * messages) or not, and each pair of ranks posts its messages in one order
 * (NCCL matches them by order, not by tag). Received data waits in staging
 * slots until its step runs. */
#ifndef LOOM_SCHEDULE_H
#define LOOM_SCHEDULE_H

#include "../core/core.h"

typedef struct loom_pp_step {
    bool forward;
    int chunk; /* local model chunk, 0 .. vpp-1 */
    int mb;    /* micro-batch, 0 .. n_micro-1 */
} loom_pp_step;

typedef struct loom_pp_shape {
    int pp, vpp;
    int group; /* micro-batches per chunk in a row (interleaved only); 0: pp */
    int n_micro;   /* micro-batches */
} loom_pp_shape;

/* Megatron's rules for the shape (above), each refused with its numbers. */
loom_status loom_pp_check(loom_ctx *ctx, const loom_pp_shape *s);

/* The 2 * n_micro * vpp steps of pipeline rank `rank` (only the n_micro * vpp
 * forwards when !backward). *out is allocated (free()). */
loom_status loom_pp_schedule(loom_ctx *ctx, const loom_pp_shape *s, int rank, bool backward,
                             loom_pp_step **out, int *nsteps);
/* Most micro-batches whose forward has run and backward has not, on any one
 * chunk of the schedule: the activation buffers a chunk needs. */
int loom_pp_max_in_flight(const loom_pp_step *s, int nsteps);

/* One message of a round's group, as this rank posts it. */
typedef struct loom_pp_msg {
    bool send;     /* else receive */
    bool forward;  /* activations (else their gradients) */
    int peer;      /* pipeline rank */
    int chunk, mb; /* the receiving rank's chunk, and the micro-batch */
    int slot;      /* receive: the staging slot it lands in */
} loom_pp_msg;

/* A round of this rank: its step (or none), then its messages as one group. */
typedef struct loom_pp_round {
    int step;       /* index into steps, -1: none */
    int msg0, nmsg; /* msgs[msg0 .. msg0 + nmsg) */
} loom_pp_round;

typedef struct loom_pp_plan {
    loom_pp_step *steps;
    int nsteps;
    int *in_slot; /* (nsteps) the slot holding the step's input, -1: none */
    loom_pp_round *rounds;
    int nrounds;
    loom_pp_msg *msgs;
    int nmsgs;
    int nslots;    /* staging slots this rank needs */
    int in_flight; /* loom_pp_max_in_flight of steps (1 without backward) */
} loom_pp_plan;

/* Rank `rank`'s plan; LOOM_ERR_INTERNAL if the rounds stop making progress
 * (a schedule bug, never a user error). Free with loom_pp_plan_free. */
loom_status loom_pp_plan_build(loom_ctx *ctx, const loom_pp_shape *s, int rank, bool backward,
                               loom_pp_plan *out);
void loom_pp_plan_free(loom_pp_plan *p);

#endif /* LOOM_SCHEDULE_H */
