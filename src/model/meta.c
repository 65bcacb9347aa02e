/* include/loom.h's loom_meta: a model described from its config alone. The
 * parameter plan gives names, shapes and layers; the memory predictor's
 * shadow model of each pipeline stage (model.c) gives what a rank of that
 * stage holds of each tensor and the memory it needs. */
#include <stdlib.h>
#include <string.h>

#include "model.h"
#include "params.h"

struct loom_meta {
    loom_model_config cfg;
    loom_param_plan plan;
    loom_mesh_sizes n;
    int64_t padded_vocab;
    int64_t (*local)[2];         /* (plan.n): held by a rank of the tensor's stage */
    loom_memory_estimate *mem;   /* (pp) */
};

typedef struct {
    loom_meta *mt;
} collect;

static void on_slot(void *u, const loom_slot *s) {
    loom_meta *mt = ((collect *)u)->mt;
    if (s->head_copy) return; /* the tied embedding's copy: the first stage's counts */
    for (size_t i = 0; i < mt->plan.n; i++)
        if (!strcmp(mt->plan.p[i].name, s->name)) {
            mt->local[i][0] = s->rows;
            mt->local[i][1] = s->cols;
            return;
        }
}

int loom_param_stage(const loom_param_spec *p, int64_t L, int pp, int vpp) {
    if (vpp < 1) vpp = 1;
    if (p->layer < 0) return p->comp == LOOM_COMP_EMBED ? 0 : pp - 1;
    return (int)(p->layer / (L / ((int64_t)pp * vpp)) % pp);
}

void loom_meta_free(loom_meta *mt) {
    if (!mt) return;
    loom_param_plan_free(&mt->plan);
    loom_config_free(&mt->cfg);
    free(mt->local);
    free(mt->mem);
    free(mt);
}

loom_status loom_meta_create(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                             const loom_meta_query *q, loom_meta **out) {
    if (!dir || !q || !out)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_meta_create: NULL argument");
    *out = NULL;
    loom_model_options d;
    if (!opts) {
        loom_model_options_default(&d);
        opts = &d;
    }
    if (q->world_size < 1 || q->micro_batch_size < 1 || q->seq_len < 1 ||
        q->num_micro_batches < 1 || q->lora_r < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "meta: world_size=%d, micro_batch_size=%lld, seq_len=%lld, "
                         "num_micro_batches=%lld must be >= 1 and lora_r=%d >= 0",
                         q->world_size, (long long)q->micro_batch_size, (long long)q->seq_len,
                         (long long)q->num_micro_batches, q->lora_r);
    loom_meta *mt = loom_calloc(ctx, 1, sizeof *mt, "meta model");
    if (!mt) return LOOM_ERR_OOM;
    loom_status st = loom_model_load_config(ctx, dir, opts->config_overrides, &mt->cfg);
    if (st) {
        free(mt);
        return st;
    }
    loom_mesh_sizes want = {.tp = opts->tp, .cp = opts->cp, .dp = opts->dp, .pp = opts->pp,
                            .vpp = opts->vpp, .ep = opts->ep, .etp = opts->etp,
                            .vpp_group = opts->microbatch_group,
                            .sequence_parallel = opts->sequence_parallel != 0};
    loom_mem_in in = {.cuda = opts->device == LOOM_DEVICE_CUDA, .adt = opts->dtype,
                      .lora_r = q->lora_r, .rows = q->micro_batch_size, .seq = q->seq_len,
                      .nmb = (int)q->num_micro_batches, .training = true,
                      .vocab_pad = opts->vocab_pad_multiple, .recompute = opts->recompute,
                      .on_slot = on_slot};
    collect c = {mt};
    in.u = &c;
    if ((st = loom_mesh_sizes_resolve(ctx, &want, q->world_size, &mt->n)) ||
        (st = loom_mesh_check_model(ctx, &mt->n, &mt->cfg)) ||
        (st = loom_mesh_check_batch(ctx, &mt->n, 0, q->seq_len, q->num_micro_batches)) ||
        (q->lora_r && (st = loom_lora_parse_targets(ctx, q->lora_target ? q->lora_target
                                                                          : "all-linear",
                                                    in.lora_target))) ||
        (st = loom_param_plan_build(ctx, &mt->cfg, &mt->plan)))
        goto fail;
    in.n = mt->n;
    mt->local = loom_calloc(ctx, mt->plan.n + 1, sizeof *mt->local, "meta shapes");
    mt->mem = loom_calloc(ctx, (size_t)mt->n.pp, sizeof *mt->mem, "meta memory");
    if (!mt->local || !mt->mem) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    for (int p = 0; p < mt->n.pp; p++) {
        loom_mem_report r;
        if ((st = loom_memory_predict_stage(ctx, &mt->cfg, &in, p, &r))) goto fail;
        mt->mem[p] = (loom_memory_estimate){.pp_rank = p, .in_flight = r.in_flight,
                                            .weights = r.weights, .grads = r.grads,
                                            .optimizer = r.optim, .activations = r.acts,
                                            .workspace = r.work, .total = r.total};
    }
    const int64_t mult = (opts->vocab_pad_multiple > 0 ? opts->vocab_pad_multiple : 128) * mt->n.tp;
    mt->padded_vocab = (mt->cfg.vocab_size + mult - 1) / mult * mult;
    *out = mt;
    return LOOM_OK;
fail:
    loom_meta_free(mt);
    return st;
}

void loom_meta_get_info(const loom_meta *mt, loom_model_info *info) {
    memset(info, 0, sizeof *info);
    const loom_model_config *c = &mt->cfg;
    info->model_type = c->model_type;
    info->vocab_size = c->vocab_size;
    info->padded_vocab_size = mt->padded_vocab;
    info->hidden_size = c->hidden_size;
    info->intermediate_size = c->intermediate_size;
    info->num_layers = c->num_layers;
    info->num_heads = c->num_heads;
    info->num_kv_heads = c->num_kv_heads;
    info->head_dim = c->head_dim;
    info->num_params = loom_param_plan_count(&mt->plan, NULL);
    info->num_tensors = (int64_t)mt->plan.n;
}

loom_status loom_meta_param_info(const loom_meta *mt, int64_t i, loom_param_info *out) {
    if (!out || i < 0 || i >= (int64_t)mt->plan.n) return LOOM_ERR_INVALID_ARG;
    const loom_param_spec *p = &mt->plan.p[i];
    memset(out, 0, sizeof *out);
    out->name = p->name;
    out->ndim = p->ndim;
    out->shape[0] = p->shape[0];
    out->shape[1] = p->ndim == 2 ? p->shape[1] : 1;
    out->local_shape[0] = mt->local[i][0];
    out->local_shape[1] = mt->local[i][1];
    out->layer = (int)p->layer;
    out->pp_stage = loom_param_stage(p, mt->cfg.num_layers, mt->n.pp, mt->n.vpp);
    out->trainable = 1;
    return LOOM_OK;
}

loom_status loom_meta_memory(const loom_meta *mt, int pp_rank, loom_memory_estimate *out) {
    if (!out || pp_rank < 0 || pp_rank >= mt->n.pp) return LOOM_ERR_INVALID_ARG;
    *out = mt->mem[pp_rank];
    return LOOM_OK;
}
