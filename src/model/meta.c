/* The model described without its weights: include/loom.h's loom_meta (from
 * config.json alone: the parameter plan gives names, shapes and layers; the
 * memory predictor's shadow model of each pipeline stage gives what a rank
 * of that stage holds of each tensor and the memory it needs), the memory
 * predictor itself, and the mesh and parameter tables of a live model. */
#include <stdlib.h>
#include <string.h>

#include "block.h"
#include "model.h"
#include "moe_dedup.h"
#include "params.h"
#include "../backend/gdn_ws.h"
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
                      .moe_capacity_factor = opts->moe_expert_capacity_factor,
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
    info->num_experts = c->num_experts > 0 ? c->num_experts : 0;
    info->num_experts_per_tok = info->num_experts ? c->num_experts_per_tok : 0;
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

/* ---- MoE: the experts under the expert fold ----
 * The shadow holds ep rank 0's E/ep experts of each MoE layer of the
 * stage, split over etp (build_slots, as a model does), in buckets the
 * distributed optimizer shards over edp; the MoE blocks' activations are
 * their kind's (block_moe.c). on_slot sees every expert tensor, another ep
 * rank's with the block it would hold (loom_slot_add into a scratch arena). */
/* The MoE blocks' part of the activations (their kind's buffers: kept
 * per layer and micro-batch in flight, or once when recomputation drops
 * them; its scratch once), as the layout carves them less alignment. */
static uint64_t moe_share(const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, int in_flight) {
    int64_t layers = 0;
    for (int64_t l = 0; l < m->L; l++)
        layers += m->layer[l].held && loom_config_layer_is_moe(&m->cfg, l);
    if (!layers) return 0;
    loom_block_buf buf[LOOM_BLOCK_MAX_BUFS];
    size_t scr[LOOM_BLOCK_MAX_SCRATCH];
    const int nb = loom_block_moe.acts(m, T, Tc, Tn, buf), ns = loom_block_moe.scratch(m, T, Tc, scr);
    uint64_t total = 0;
    for (int k = 0; k < nb; k++) {
        const bool once = (m->recompute == LOOM_RECOMPUTE_FULL && !buf[k].route) ||
                          (m->recompute == LOOM_RECOMPUTE_MLP && buf[k].cheap);
        total += buf[k].bytes * (once ? 1 : (uint64_t)(layers * in_flight));
    }
    for (int k = 0; k < ns; k++) total += scr[k];
    return total;
}

/* The CUDA Gated DeltaNet rule's workspace (gdn_ws.h), once per rank when
 * the stage holds such a layer: its heads over tp, the whole sequence
 * under cp (each cp rank runs the rule over all of it), one document per
 * sequence (packed documents add up to one chunk each), and the arrays the
 * layers' keep buffers hold (block_gdn.c, counted with the activations)
 * left out of it where the model keeps them. */
static size_t gdn_work(const loom_model *m, const loom_mem_in *in, int64_t T) {
    const loom_model_config *c = &m->cfg;
    bool held = false;
    for (int64_t l = 0; l < m->L && c->linear_attn; l++)
        held |= m->layer[l].held && c->linear_attn[l];
    if (!in->cuda || !held) return 0;
    const int tc = loom_gdn_ws_tc(in->adt, c->lin_k_dim);
    const int64_t nd = in->micro_batch_size, kc = loom_gdn_keep_chunks(T);
    return loom_gdn_ws_bytes(T, c->lin_k_heads / m->tp, c->lin_v_heads / m->tp, c->lin_k_dim,
                             c->lin_v_dim, nd, in->training, tc,
                             tc ? loom_gdn_keep_fits(T, nd, kc) : 0);
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
    m->moe_cap_factor = in->moe_capacity_factor;
    m->moe_dedup = loom_moe_dedup_wanted();
    m->dev.cuda = in->cuda;
    m->dev.adt = in->adt;
    m->dev.esz = loom_dtype_size(in->adt);
    loom_pp_plan plan = {0};
    m->lora_r = in->lora_r;
    loom_status st = loom_param_plan_build(ctx, cfg, &m->plan);
    if (!st && (m->edp <= 0 || m->ep * m->etp * m->edp != m->tp * m->cp * m->dp))
        st = loom_errf(ctx, LOOM_ERR_CONFIG, "the expert fold (ep=%d, etp=%d) does not divide "
                       "tp*cp*dp = %d", m->ep, m->etp, m->tp * m->cp * m->dp);
    if (!st) st = loom_model_build_slots(m);
    if (!st) st = loom_arena_place(m, &m->base);
    if (st) goto done;
    for (int i = 0; in->on_slot && i < m->base.nslots; i++) in->on_slot(in->u, &m->base.slots[i]);
    const int64_t El = cfg->num_experts / (m->ep > 0 ? m->ep : 1);
    for (size_t i = 0; in->on_slot && i < m->plan.n; i++) { /* the other ep ranks' experts */
        const loom_param_spec *p = &m->plan.p[i];
        if (p->expert < El || p->layer < 0 || !m->layer[p->layer].held) continue;
        loom_slot one = {0};
        loom_arena scratch = {.slots = &one};
        const loom_shard split = m->layer[p->layer].b[p->block].kind->slots[p->slot].shard;
        in->on_slot(in->u, loom_slot_add(m, &scratch, p->name, p->shape[0],
                                         p->ndim == 2 ? p->shape[1] : 1, p->ndim, split, false, true));
    }
    /* the experts' share: their slots (padded as placed) and buckets */
    size_t X = 0, Xshard = 0;
    for (int i = 0; i < m->base.nslots; i++)
        if (m->base.slots[i].expert) X += (m->base.slots[i].numel + 15) & ~(size_t)15;
    for (int k = 0; k < m->base.nbuckets; k++)
        if (m->base.bucket_ex[k]) Xshard += m->base.bucket_len[k] / (size_t)m->edp;
    const size_t P = m->base.nparams - X, esz = m->dev.esz;
    const bool lora = in->lora_r > 0;
    r->pp_rank = pp_rank;
    r->cuda = in->cuda;
    /* the base: fp32 master (dropped for a frozen GPU base in bf16/fp16)
     * and the compute copy; gradients and AdamW state when trained */
    const bool master = !(lora && in->cuda && in->adt != LOOM_F32);
    r->expert_numel = X;
    r->expert_weights = (master ? X * 4 : 0) + (in->adt != LOOM_F32 ? X * esz : 0);
    r->weights = (master ? P * 4 : 0) + (in->adt != LOOM_F32 ? P * esz : 0) + r->expert_weights;
    size_t train_p = P, train_shard = m->base.shard_numel - Xshard;
    if (lora) { /* adapter blocks of the layers held: A (r, in), B (out, r), tp-split (an
                 * expert's: etp-split, for each of the rank's experts) */
        size_t ap = 0, ax = 0; /* the dense linears' and the experts' */
        for (int64_t l = 0; l < m->L; l++)
            for (int j = 0; m->layer[l].held && j < m->layer[l].nlin; j++) {
                const loom_layer_lin *x = &m->layer[l].lin[j];
                if (x->target < 0 || !in->lora_target[x->target]) continue;
                const bool ex = m->layer[l].b[x->b].kind->lin[x->k].experts;
                const int64_t split = ex ? m->etp : m->tp, copies = ex ? El : 1;
                int64_t a_in = x->row_par ? x->in / split : x->in;
                int64_t b_out = x->row_par || x->rep ? x->out : x->out / split;
                *(ex ? &ax : &ap) +=
                    (size_t)(copies * ((int64_t)in->lora_r * a_in + b_out * in->lora_r));
            }
        /* each kind's buckets shard over its own group: dp x cp, or edp */
        const size_t grp = (size_t)(m->dp * m->cp), egrp = (size_t)loom_mesh_edp(n);
        train_p = ap + ax;
        train_shard = (ap + grp - 1) / grp + (ax + egrp - 1) / egrp;
        ap += ax;
        r->weights += ap * 4 + (in->adt != LOOM_F32 ? ap * esz : 0);
    }
    r->grads = train_p * 4;
    /* the moments, and the gradient shard unless one rank holds it all (then
     * the gradients are the shard) */
    const bool one = m->dp * m->cp == 1 && (!lora || loom_mesh_edp(n) == 1);
    r->optim = in->training ? (one ? 2 : 3) * train_shard * 4 : 0;
    if (!lora) { /* the experts: the same over edp */
        r->expert_grads = X * 4;
        r->expert_optim = in->training ? (loom_mesh_edp(n) == 1 ? 2 : 3) * Xshard * 4 : 0;
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
        r->acts = c.used;
        r->moe_acts = moe_share(m, T, Tc, Tn, in_flight);
        /* cuBLASLt workspace, RMSNorm and grad-norm scratch */
        int64_t rows_max = Tc * (m->Hql > m->Hkvl ? m->Hql : m->Hkvl);
        if (Tn > rows_max) rows_max = Tn;
        r->work = in->cuda ? (32u << 20) + (size_t)rows_max * 8 + 1024 * 8 : 0;
        r->work += gdn_work(m, in, T);
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
    free(m->moe_load);
    loom_param_plan_free(&m->plan);
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
             r->cuda ? " (plus the CUDA context, NCCL buffers and the CUDA libraries' workspaces "
                       "and kernels)"
                     : "");
}
