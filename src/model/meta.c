/* The model described without its weights: include/loom.h's loom_meta (from
 * config.json alone: the parameter plan gives names, shapes and layers; the
 * memory predictor's shadow model of each pipeline stage gives what a rank
 * of that stage holds of each tensor and the memory it needs), the memory
 * predictor itself, and the mesh and parameter tables of a live model. */
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "model.h"
#include "params.h"
#include "../parallel/schedule.h"

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
                      .lora_r = q->lora_r, .micro_batch_size = q->micro_batch_size, .seq = q->seq_len,
                      .n_micro = (int)q->num_micro_batches, .training = true,
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
    info->max_position_embeddings = c->max_position_embeddings;
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

void loom_model_get_mesh(const loom_model *m, loom_mesh_info *out) {
    const loom_mesh *me = m->mesh;
    const loom_mesh_sizes *n = &me->n;
    memset(out, 0, sizeof *out);
    out->world_size = me->world;
    out->rank = me->rank;
    out->tp = n->tp, out->cp = n->cp, out->dp = n->dp, out->pp = n->pp;
    out->vpp = n->vpp > 0 ? n->vpp : 1;
    out->ep = n->ep, out->etp = n->etp;
    out->sequence_parallel = n->sequence_parallel;
    out->microbatch_group = n->vpp_group > 0 ? n->vpp_group : n->pp;
    out->tp_rank = me->tp_rank, out->cp_rank = me->cp_rank;
    out->dp_rank = me->dp_rank, out->pp_rank = me->pp_rank;
    out->is_output_rank = me->pp_rank == n->pp - 1 && me->tp_rank == 0 && me->cp_rank == 0;
    out->edp = me->edp_size;
    out->etp_rank = me->etp_rank, out->ep_rank = me->ep_rank, out->edp_rank = me->edp_rank;
}

loom_status loom_model_param_info(const loom_model *m, int64_t i, loom_param_info *out) {
    if (!out) return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG, "loom_model_param_info: out is NULL");
    if (i < 0 || i >= (int64_t)m->plan.n)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "loom_model_param_info: tensor %lld of %zu does not exist", (long long)i,
                         m->plan.n);
    const loom_param_spec *p = &m->plan.p[i];
    memset(out, 0, sizeof *out);
    out->name = p->name;
    out->ndim = p->ndim;
    out->shape[0] = p->shape[0];
    out->shape[1] = p->ndim == 2 ? p->shape[1] : 1;
    out->layer = (int)p->layer;
    out->pp_stage = loom_param_stage(p, m->L, m->mesh->n.pp, m->vpp);
    const int s = loom_model_find_slot(m, p->name);
    if (s >= 0) {
        out->local_shape[0] = m->base.slots[s].rows;
        out->local_shape[1] = m->base.slots[s].cols;
    }
    out->trainable = m->nadapters == 0 && !(m->pfrozen && m->pfrozen[i]);
    return LOOM_OK;
}

/* ---- memory prediction ----
 * A shadow model per pipeline stage (sizes and slots only, nothing
 * allocated but small tables) measured with the same layout code the model
 * allocates with: arena_place for the parameters, acts_layout for the
 * activations. */

/* ---- MoE: the router and the experts ----
 * The shadow lays a MoE model out without them (plan_dense: model.c places
 * only the kinds that run), and moe_slots adds them as Megatron holds them
 * under the expert fold (mesh.h): the router, replicated, with the dense
 * parameters (buckets over dp*cp); of each MoE layer of the stage E/ep
 * experts per rank, each split over etp, in an arena of their own whose
 * buckets the distributed optimizer shards over edp. */
static bool moe_param(const loom_param_spec *p) {
    return p->comp == LOOM_COMP_ROUTER || p->comp == LOOM_COMP_EXPERTS;
}

/* The plan less the router and the experts: specs copied, names shared
 * with `full` (free only out->p). */
static loom_status plan_dense(loom_ctx *ctx, const loom_param_plan *full, loom_param_plan *out) {
    out->n = 0;
    out->p = loom_calloc(ctx, full->n + 1, sizeof *out->p, "parameter plan");
    if (!out->p) return LOOM_ERR_OOM;
    for (size_t i = 0; i < full->n; i++)
        if (!moe_param(&full->p[i])) out->p[out->n++] = full->p[i];
    return LOOM_OK;
}

/* An expert tensor's block on one rank of its etp group: the dimension
 * made of moe_intermediate_size split (gate/up rows and biases, down
 * columns), the rest whole (the down projection's bias). */
static void expert_local(const loom_model_config *c, int etp, const loom_param_spec *p,
                         int64_t *rows, int64_t *cols) {
    const int64_t I = c->moe_intermediate_size;
    const bool down = strstr(p->name, "down_proj") != NULL;
    *rows = p->shape[0];
    *cols = p->ndim == 2 ? p->shape[1] : 1;
    if (p->ndim == 2 && down && *cols % I == 0)
        *cols /= etp;
    else if (!down && *rows % I == 0)
        *rows /= etp;
}

/* The router of each MoE layer of the stage into the base arena (whose
 * slots build_slots made), and ep rank 0's experts into `ex` (every ep
 * rank holds as many); every expert's block goes to on_slot. */
static loom_status moe_slots(loom_model *m, const loom_param_plan *full, const loom_mem_in *in,
                             loom_arena *ex) {
    const loom_model_config *c = &m->cfg;
    const int ep = in->n.ep > 0 ? in->n.ep : 1, etp = in->n.etp > 0 ? in->n.etp : m->tp;
    const int64_t per_rank = c->num_experts / ep;
    size_t nr = 0, nx = 0;
    for (size_t i = 0; i < full->n; i++) {
        const loom_param_spec *p = &full->p[i];
        if (!moe_param(p) || p->layer < 0 || !m->layer[p->layer].held) continue;
        if (p->comp == LOOM_COMP_ROUTER) nr++;
        else if (p->expert >= 0 && p->expert < per_rank) nx++;
    }
    loom_slot *grown = realloc(m->base.slots, (size_t)(m->base.nslots + nr + 1) * sizeof *grown);
    ex->slots = loom_calloc(m->ctx, nx + 1, sizeof *ex->slots, "expert slots");
    if (grown) {
        m->base.slots = grown;
        memset(grown + m->base.nslots, 0, (nr + 1) * sizeof *grown);
    }
    if (!grown || !ex->slots) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the plan");
    for (size_t i = 0; i < full->n; i++) {
        const loom_param_spec *p = &full->p[i];
        if (!moe_param(p) || p->layer < 0 || !m->layer[p->layer].held) continue;
        const int64_t cols = p->ndim == 2 ? p->shape[1] : 1;
        if (p->comp == LOOM_COMP_ROUTER) {
            loom_slot_add(m, &m->base, p->name, p->shape[0], cols, p->ndim, LOOM_SHARD_NONE, false);
            continue;
        }
        loom_slot local = {.name = p->name, .ndim = p->ndim, .shape = {p->shape[0], cols}};
        expert_local(c, etp, p, &local.rows, &local.cols);
        if (in->on_slot) in->on_slot(in->u, &local);
        if (p->expert < 0 || p->expert >= per_rank) continue;
        loom_slot *sl =
            loom_slot_add(m, ex, p->name, local.rows, local.cols, p->ndim, LOOM_SHARD_NONE, false);
        sl->shape[0] = local.shape[0];
        sl->shape[1] = local.shape[1];
    }
    /* the experts' buckets are padded to a multiple of edp, as their shards */
    const int dp = m->dp, cp = m->cp;
    m->dp = loom_mesh_edp(&in->n);
    m->cp = 1;
    loom_status st = m->dp > 0 ? loom_arena_place(m, ex)
                               : loom_errf(m->ctx, LOOM_ERR_CONFIG,
                                           "the expert fold does not divide tp*cp*dp");
    m->dp = dp;
    m->cp = cp;
    return st;
}

/* The MoE blocks' activations, estimated while block_moe.c declares no
 * buffers (its kind's `acts`; the shadow's layout counts them once it
 * does), for balanced routing: this rank dispatches N tokens (Tn under
 * sequence parallel, else Tc) to k experts each, and R = N*k rows reach its
 * experts (N*k*etp under sequence parallel: the etp group gathers its
 * members' rows). Kept per MoE layer and micro-batch in flight: the
 * router's fp32 probabilities (N x E), the top-k ids and weights (N x k,
 * 4 bytes each), the permuted input and the experts' output (R x H each)
 * and gate, up and SwiGLU (R x I/etp each; recomputed under recompute mlp,
 * so one layer's); under full recomputation one layer's of everything.
 * Once: the all-to-all's send and receive buffers (N*k x H, R x H) when
 * ep > 1. */
static uint64_t moe_acts(const loom_model *m, const loom_mem_in *in, int in_flight, int64_t Tc,
                         int64_t Tn) {
    const loom_model_config *c = &m->cfg;
    if (loom_block_moe.acts || c->num_experts <= 0) return 0;
    int64_t layers = 0;
    for (int64_t l = 0; l < m->L; l++)
        layers += m->layer[l].held && loom_config_layer_is_moe(c, l);
    if (!layers) return 0;
    const int ep = in->n.ep > 0 ? in->n.ep : 1, etp = in->n.etp > 0 ? in->n.etp : m->tp;
    const uint64_t esz = m->dev.esz, k = (uint64_t)c->num_experts_per_tok;
    const uint64_t N = (uint64_t)(m->sp ? Tn : Tc), R = N * k * (uint64_t)(m->sp ? etp : 1);
    const uint64_t H = (uint64_t)m->H, I = (uint64_t)(c->moe_intermediate_size / etp);
    const uint64_t small = N * (uint64_t)c->num_experts * 4 + N * k * 8 + 2 * R * H * esz;
    const uint64_t wide = 3 * R * I * esz;
    const uint64_t n = (uint64_t)layers * (uint64_t)in_flight;
    uint64_t kept = m->recompute == LOOM_RECOMPUTE_FULL  ? small + wide
                    : m->recompute == LOOM_RECOMPUTE_MLP ? n * small + wide
                                                         : n * (small + wide);
    if (ep > 1) kept += N * k * H * esz + R * H * esz;
    return kept;
}
static loom_status predict_stage(loom_ctx *ctx, const loom_model_config *cfg,
                                 const loom_mem_in *in, int pp_rank, loom_mem_report *r) {
    loom_model sh;
    loom_mesh mesh;
    memset(&sh, 0, sizeof sh);
    memset(&mesh, 0, sizeof mesh);
    memset(r, 0, sizeof *r);
    loom_model *m = &sh;
    const loom_mesh_sizes *n = &in->n;
    mesh.n = *n;
    mesh.pp_rank = pp_rank;
    m->ctx = ctx;
    m->cfg = *cfg; /* shallow: only read */
    m->mesh = &mesh;
    loom_model_set_sizes(m, n, cfg, in->vocab_pad > 0 ? in->vocab_pad : 128);
    m->bucket_elems = 40000000;
    m->recompute = in->recompute;
    m->dev.cuda = in->cuda;
    m->dev.adt = in->adt;
    m->dev.esz = loom_dtype_size(in->adt);
    loom_pp_plan plan = {0};
    loom_param_plan full = {0};
    loom_arena ex = {0}; /* the experts */
    loom_status st = loom_param_plan_build(ctx, cfg, &full);
    if (!st) st = plan_dense(ctx, &full, &m->plan);
    if (!st) st = loom_model_build_slots(m);
    if (!st) st = moe_slots(m, &full, in, &ex);
    if (!st) st = loom_arena_place(m, &m->base);
    if (st) goto done;
    for (int i = 0; in->on_slot && i < m->base.nslots; i++) in->on_slot(in->u, &m->base.slots[i]);
    const size_t P = m->base.nparams, X = ex.nparams, esz = m->dev.esz;
    const bool lora = in->lora_r > 0;
    r->pp_rank = pp_rank;
    r->cuda = in->cuda;
    /* the base: fp32 master (dropped for a frozen GPU base in bf16/fp16)
     * and the compute copy; gradients and AdamW state when trained */
    const bool master = !(lora && in->cuda && in->adt != LOOM_F32);
    r->expert_numel = X;
    r->expert_weights = (master ? X * 4 : 0) + (in->adt != LOOM_F32 ? X * esz : 0);
    r->weights = (master ? P * 4 : 0) + (in->adt != LOOM_F32 ? P * esz : 0) + r->expert_weights;
    size_t train_p = P, train_shard = m->base.shard_numel;
    if (lora) { /* adapter blocks of the layers held: A (r, in), B (out, r), tp-split */
        size_t ap = 0;
        for (int64_t l = 0; l < m->L; l++)
            for (int j = 0; m->layer[l].held && j < m->layer[l].nlin; j++) {
                const loom_layer_lin *x = &m->layer[l].lin[j];
                if (x->target < 0 || !in->lora_target[x->target]) continue;
                int64_t a_in = x->row_par ? x->in / m->tp : x->in;
                int64_t b_out = x->row_par ? x->out : x->out / m->tp;
                ap += (size_t)((int64_t)in->lora_r * a_in + b_out * in->lora_r);
            }
        size_t grp = (size_t)(m->dp * m->cp);
        train_p = ap;
        train_shard = (ap + grp - 1) / grp;
        r->weights += ap * 4 + (in->adt != LOOM_F32 ? ap * esz : 0);
    }
    r->grads = train_p * 4;
    /* the moments, and the gradient shard unless one rank holds it all (then
     * the gradients are the shard) */
    r->optim = in->training ? (m->dp * m->cp == 1 ? 2 : 3) * train_shard * 4 : 0;
    if (!lora) { /* the experts: the same over edp */
        r->expert_grads = X * 4;
        r->expert_optim = in->training ? (loom_mesh_edp(n) == 1 ? 2 : 3) * ex.shard_numel * 4 : 0;
        r->grads += r->expert_grads;
        r->optim += r->expert_optim;
    }
    /* activations: the pipeline's micro-batches in flight on this stage */
    const loom_pp_shape shape = {.pp = m->pp, .vpp = m->vpp, .group = in->n.vpp_group,
                                 .n_micro = in->n_micro};
    if ((st = loom_pp_plan_build(ctx, &shape, pp_rank, in->training, &plan))) goto done;
    const int in_flight = plan.in_flight;
    r->in_flight = in_flight;
    int64_t Lc = m->L / (m->pp * m->vpp);
    loom_chunk chunks[64];
    if (m->vpp > 64) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG, "vpp=%d: at most 64 chunks per rank", m->vpp);
        goto done;
    }
    m->chunks = chunks;
    for (int ci = 0; ci < m->vpp; ci++) {
        int64_t v = (int64_t)ci * m->pp + pp_rank;
        chunks[ci] = (loom_chunk){.l0 = v * Lc, .nl = Lc, .first = v == 0,
                                  .last = v == (int64_t)m->pp * m->vpp - 1, .npool = in_flight};
        chunks[ci].pool = loom_calloc(ctx, (size_t)in_flight, sizeof(loom_acts), "plan");
        if (!chunks[ci].pool) st = LOOM_ERR_OOM;
    }
    m->micro = loom_calloc(ctx, (size_t)in->n_micro, sizeof *m->micro, "plan");
    m->npp_stage = m->pp > 1 ? (plan.nslots > 1 ? plan.nslots : 1) : 0;
    m->pp_stage = m->npp_stage ? loom_calloc(ctx, (size_t)m->npp_stage, sizeof(void *), "plan") : NULL;
    if (!m->micro || (m->npp_stage && !m->pp_stage)) st = LOOM_ERR_OOM;
    if (!st) {
        const int64_t T = in->micro_batch_size * in->seq, Tc = T / m->cp, Tn = m->sp ? Tc / m->tp : Tc;
        m->chunk_rows = loom_loss_block_rows(in->cuda, m->Vl, Tc);
        loom_carve c = {0};
        loom_acts_layout(m, &c, T, Tc, Tn, in->n_micro, in_flight, in->lora_r, false);
        r->moe_acts = moe_acts(m, in, in_flight, Tc, Tn);
        r->acts = c.used + r->moe_acts;
        /* cuBLASLt workspace, RMSNorm and grad-norm scratch */
        int64_t rows_max = Tc * (m->Hql > m->Hkvl ? m->Hql : m->Hkvl);
        if (Tn > rows_max) rows_max = Tn;
        r->work = in->cuda ? (32u << 20) + (size_t)rows_max * 8 + 1024 * 8 : 0;
    }
    for (int ci = 0; ci < m->vpp; ci++) free(chunks[ci].pool);
    free(m->micro);
    free(m->pp_stage);
    r->total = r->weights + r->grads + r->optim + r->acts + r->work;
done:
    loom_pp_plan_free(&plan);
    free(m->base.slots);
    free(m->base.bucket_off);
    free(m->base.bucket_len);
    free(m->base.bucket_ex);
    free(m->layer);
    free(m->pfrozen);
    free(m->plan.p); /* its names are full's */
    free(ex.slots);
    free(ex.bucket_off);
    free(ex.bucket_len);
    loom_param_plan_free(&full);
    return st;
}

loom_status loom_memory_predict_stage(loom_ctx *ctx, const loom_model_config *cfg,
                                      const loom_mem_in *in, int pp_rank, loom_mem_report *out) {
    return predict_stage(ctx, cfg, in, pp_rank, out);
}

loom_status loom_memory_predict(loom_ctx *ctx, const loom_model_config *cfg, const loom_mem_in *in,
                                loom_mem_report *out) {
    loom_status st = loom_mesh_check_model(ctx, &in->n, cfg);
    if (st) return st;
    memset(out, 0, sizeof *out);
    for (int p = 0; p < in->n.pp; p++) {
        loom_mem_report r;
        if ((st = predict_stage(ctx, cfg, in, p, &r))) return st;
        if (r.total > out->total) *out = r;
    }
    return LOOM_OK;
}

void loom_memory_print(loom_ctx *ctx, const loom_mem_report *r, loom_log_level level) {
    char a[32], b[32], c[32], d[32], e[32], t[32];
    loom_log(ctx, level,
             "memory per %s (predicted, pipeline stage %d): weights %s, gradients %s, "
             "optimizer %s, activations %s (%d micro-batch%s in flight), workspace %s; "
             "total %s%s",
             r->cuda ? "GPU" : "process", r->pp_rank, loom_fmt_bytes(a, r->weights),
             loom_fmt_bytes(b, r->grads), loom_fmt_bytes(c, r->optim), loom_fmt_bytes(d, r->acts),
             r->in_flight, r->in_flight == 1 ? "" : "es", loom_fmt_bytes(e, r->work),
             loom_fmt_bytes(t, r->total),
             r->cuda ? " (plus the CUDA context and NCCL buffers)" : "");
}
