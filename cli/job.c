/* What train and golden share: the job's world group, model options from
 * the settings, and failing the whole job when one rank fails. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cli.h"

/* --device auto: a GPU when loom was built with CUDA and one is visible. */
static loom_status resolve_device(loom_ctx *ctx, loom_settings *s) {
    const bool want_cuda = !strcmp(s->device, "cuda");
    if (!strcmp(s->device, "cpu")) return LOOM_OK;
#ifdef LOOM_HAVE_CUDA
    loom_cuda_info info;
    loom_ctx *quiet = NULL;
    bool have = false;
    if (loom_ctx_create(&quiet) == LOOM_OK) {
        have = loom_cuda_query(quiet, 0, &info) == LOOM_OK;
        if (!have && want_cuda)
            loom_errf(ctx, LOOM_ERR_DEVICE,
                      "--device cuda: %s; run on the CPU with --device cpu, or on a machine "
                      "with an NVIDIA GPU (check nvidia-smi and CUDA_VISIBLE_DEVICES)",
                      loom_last_error(quiet));
        loom_ctx_free(quiet);
    }
    if (!have && want_cuda) return LOOM_ERR_DEVICE;
    if (!have) LOOM_LOG_I(ctx, "no GPU visible: running on the CPU (--device cpu)");
#else
    const bool have = false;
    if (want_cuda)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "--device cuda: this loom was built without CUDA; rebuild with "
                         "`make CUDA=1`, or run on the CPU (--device cpu)");
#endif
    free(s->device);
    s->device = loom_strdup(ctx, have ? "cuda" : "cpu");
    return s->device ? LOOM_OK : LOOM_ERR_OOM;
}

loom_status loom_cli_world(loom_ctx *ctx, loom_settings *s, loom_comm **out) {
    loom_status st = resolve_device(ctx, s);
    if (st) return st;
    /* --comm-timeout reaches the communicators (and, through the
     * environment, the workers --nproc-per-node starts) as LOOM_COMM_TIMEOUT;
     * without the flag an exported LOOM_COMM_TIMEOUT wins over the default */
    const loom_option *opt = loom_option_find("comm_timeout");
    size_t nopt;
    const loom_option *table = loom_options(&nopt);
    const char *env = getenv("LOOM_COMM_TIMEOUT");
    if (!isfinite(s->comm_timeout) || s->comm_timeout < 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "--comm-timeout %g: give a number of seconds >= 0 (0 waits forever)",
                         s->comm_timeout);
    if (s->src[opt - table] != LOOM_SRC_DEFAULT || !env || !*env) {
        char v[64];
        snprintf(v, sizeof v, "%.17g", s->comm_timeout);
        setenv("LOOM_COMM_TIMEOUT", v, 1);
    }
    st = loom_comm_world(ctx, strcmp(s->device, "cuda") ? LOOM_COMM_AUTO : LOOM_COMM_NCCL, out);
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
    o->ep = (int)s->ep;
    o->etp = (int)s->etp;
    o->vpp = (int)s->vpp;
    o->microbatch_group = (int)s->microbatch_group;
    o->sequence_parallel = s->sequence_parallel;
    o->moe_aux = s->moe_aux_loss && !strcmp(s->moe_aux_loss, "per-layer") ? LOOM_MOE_AUX_PER_LAYER
                                                                          : LOOM_MOE_AUX_GLOBAL;
    o->moe_z_loss_coeff = s->moe_z_loss_coeff;
    o->moe_expert_capacity_factor = s->moe_expert_capacity_factor;
    o->moe_token_drop_policy =
        s->moe_token_drop_policy && !strcmp(s->moe_token_drop_policy, "position")
            ? LOOM_MOE_DROP_POSITION
            : LOOM_MOE_DROP_PROBS;
    o->moe_router_force_load_balancing = s->moe_router_force_load_balancing;
    o->profile = s->profile;
    o->recompute = !strcmp(s->recompute, "full")  ? LOOM_RECOMPUTE_FULL
                   : !strcmp(s->recompute, "mlp") ? LOOM_RECOMPUTE_MLP
                                                  : LOOM_RECOMPUTE_NONE;
    o->device = !strcmp(s->device, "cuda") ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU;
    if (!strcmp(s->dtype, "bf16"))
        o->dtype = LOOM_BF16;
    else if (!strcmp(s->dtype, "fp16"))
        o->dtype = LOOM_F16;
    else if (!strcmp(s->dtype, "fp32"))
        o->dtype = LOOM_F32;
    else /* auto */
        o->dtype = o->device == LOOM_DEVICE_CUDA ? LOOM_BF16 : LOOM_F32;
}

const char *loom_cli_mesh_describe(const loom_model *m, char *buf, size_t cap) {
    loom_mesh_info mi;
    loom_model_get_mesh(m, &mi);
    const loom_mesh_sizes n = {.tp = mi.tp, .cp = mi.cp, .dp = mi.dp, .pp = mi.pp, .ep = mi.ep,
                               .etp = mi.etp, .vpp = mi.vpp, .vpp_group = mi.microbatch_group,
                               .sequence_parallel = mi.sequence_parallel != 0};
    return loom_mesh_describe(&n, buf, cap);
}

loom_status loom_cli_predict_memory(loom_ctx *ctx, const loom_settings *s,
                                    const loom_model_config *cfg, const loom_mesh_sizes *n,
                                    bool cuda, int n_micro, loom_mem_report *r) {
    loom_mem_in in = {.n = *n, .cuda = cuda, .lora_r = (int)s->lora_r,
                      .micro_batch_size = s->micro_batch_size, .seq = s->seq_len, .n_micro = n_micro,
                      .training = true};
    loom_model_options o;
    loom_settings tmp = *s;
    tmp.device = (char *)(cuda ? "cuda" : "cpu");
    loom_cli_model_options(&tmp, &o);
    in.adt = o.dtype;
    in.recompute = o.recompute;
    in.moe_capacity_factor = o.moe_expert_capacity_factor;
    if (in.lora_r > 0) {
        loom_status st = loom_lora_parse_targets(ctx, s->lora_target, in.lora_target);
        if (st) return st;
    }
    return loom_memory_predict(ctx, cfg, &in, r);
}
