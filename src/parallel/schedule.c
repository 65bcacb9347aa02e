/* Pipeline schedules (see schedule.h). */
#include <stdlib.h>

#include "schedule.h"

loom_status loom_pp_schedule(loom_ctx *ctx, int pp, int vpp, int rank, int nmb,
                             loom_pp_step **out, int *nsteps) {
    *out = NULL;
    *nsteps = 0;
    if (pp < 1 || vpp < 1 || vpp > 64 || rank < 0 || rank >= pp || nmb < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "pipeline schedule: pp=%d vpp=%d rank=%d micro-batches=%d", pp, vpp,
                         rank, nmb);
    if (vpp > 1 && nmb % pp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "interleaved pipeline (vpp=%d) needs the number of micro-batches (%d) "
                         "to be a multiple of pp=%d",
                         vpp, nmb, pp);
    const int total = nmb * vpp, group = pp * vpp;
    int warmup;
    if (vpp == 1)
        warmup = pp - rank - 1;
    else if (nmb == pp)
        warmup = total;
    else
        warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp;
    if (warmup > total) warmup = total;
    loom_pp_step *s = loom_malloc(ctx, sizeof *s * (size_t)(2 * total), "pipeline schedule");
    if (!s) return LOOM_ERR_OOM;
    int n = 0;
#define STEP(k, fwd)                                                                      \
    do {                                                                                  \
        int c_ = ((k) % group) / pp;                                                      \
        s[n].forward = (fwd);                                                             \
        s[n].chunk = (fwd) ? c_ : vpp - 1 - c_;                                           \
        s[n].mb = ((k) / group) * pp + (k) % pp;                                          \
        n++;                                                                              \
    } while (0)
    for (int k = 0; k < warmup; k++) STEP(k, true);
    for (int k = 0; k < total - warmup; k++) {
        STEP(k + warmup, true);
        STEP(k, false);
    }
    for (int k = total - warmup; k < total; k++) STEP(k, false);
#undef STEP
    *out = s;
    *nsteps = n;
    return LOOM_OK;
}

int loom_pp_max_in_flight(const loom_pp_step *s, int nsteps, int vpp) {
    int best = 0, live[64] = {0};
    for (int i = 0; i < nsteps; i++) {
        int c = s[i].chunk < 64 ? s[i].chunk : 63;
        live[c] += s[i].forward ? 1 : -1;
        if (live[c] > best) best = live[c];
    }
    (void)vpp;
    return best;
}
