/* Pipeline schedules: the ordered forward and backward steps each pipeline
 * rank runs. vpp == 1: 1F1B (PipeDream-flush): pp - rank - 1 warm-up
 * forwards, then one forward one backward, then the remaining backwards.
 * vpp > 1: Megatron's interleaved 1F1B: rank r holds model chunks c = 0 ..
 * vpp-1, chunk c being virtual stage c*pp + r; forward step k runs chunk
 * (k mod pp*vpp) / pp on micro-batch (k / (pp*vpp))*pp + k mod pp; backward
 * steps run the chunks in reverse; warm-up is (pp - r - 1)*2 + (vpp-1)*pp
 * forwards (all of them when there are only pp micro-batches). */
#ifndef LOOM_SCHEDULE_H
#define LOOM_SCHEDULE_H

#include "../core/core.h"

typedef struct loom_pp_step {
    bool forward;
    int chunk; /* local model chunk, 0 .. vpp-1 */
    int mb;    /* micro-batch, 0 .. nmb-1 */
} loom_pp_step;

/* The 2 * nmb * vpp steps of pipeline rank `rank`. *out is allocated (free()).
 * Refuses nmb % pp != 0 when vpp > 1, with the numbers. */
loom_status loom_pp_schedule(loom_ctx *ctx, int pp, int vpp, int rank, int nmb,
                             loom_pp_step **out, int *nsteps);
/* Most micro-batches whose forward has run and backward has not, on any one
 * chunk of the schedule: the activation buffers a chunk needs. */
int loom_pp_max_in_flight(const loom_pp_step *s, int nsteps, int vpp);

#endif /* LOOM_SCHEDULE_H */
