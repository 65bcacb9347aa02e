/* What train and golden share: the job's world group, model options from
 * the settings, and failing the whole job when one rank fails. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"

loom_status loom_cli_world(loom_ctx *ctx, loom_comm **out) {
    loom_status st = loom_comm_world(ctx, LOOM_COMM_AUTO, out);
    if (st) return st;
#ifdef _OPENMP
    /* several ranks on one host share its cores: unless OMP_NUM_THREADS says
     * otherwise, each takes its share instead of all of them */
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    if (!local) local = getenv("LOCAL_WORLD_SIZE");
    long nlocal = local ? strtol(local, NULL, 10) : 1;
    if (!getenv("OMP_NUM_THREADS") && nlocal > 1) {
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        omp_set_num_threads((int)(cores / nlocal > 1 ? cores / nlocal : 1));
    }
#endif
    /* rank 0 speaks for the job; the others only warn and fail */
    if (loom_comm_rank(*out) != 0 && loom_ctx_log_level(ctx) == LOOM_LOG_INFO)
        loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    return LOOM_OK;
}

int loom_cli_fail_job(loom_ctx *ctx, loom_comm *world) {
    if (world && loom_comm_size(world) > 1) loom_comm_abort(world, loom_last_error(ctx), 1);
    return loom_cli_fail(ctx);
}

void loom_cli_model_options(const loom_settings *s, loom_model_options *o) {
    loom_model_options_default(o);
    o->config_overrides = s->config_override;
    o->tp = (int)s->tp;
    o->cp = (int)s->cp;
    o->dp = (int)s->dp;
    o->pp = (int)s->pp;
    o->vpp = (int)s->vpp;
    o->sequence_parallel = s->sequence_parallel;
}
