/* The device mesh: sizes, checks against model and batch, and the process
 * groups of one rank (DESIGN.md, "The device mesh"). */

#include "mesh.h"
#include "schedule.h"

#include <stdlib.h>
#include <string.h>

static int or1(int v) { return v == 0 ? 1 : v; }

static const char *fmt_u128(char buf[48], unsigned __int128 v) {
    char tmp[48];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + (int)(v % 10));
        v /= 10;
    } while (v);
    for (int i = 0; i < n; i++) buf[i] = tmp[n - 1 - i];
    buf[n] = '\0';
    return buf;
}

loom_status loom_mesh_sizes_resolve(loom_ctx *ctx, const loom_mesh_sizes *in, int world,
                                    loom_mesh_sizes *out) {
    if (!in || !out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "mesh: sizes are NULL");
    if (world < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "mesh: world size %d must be >= 1", world);
    struct {
        const char *name;
        int v;
    } all[] = {{"tp", in->tp}, {"cp", in->cp},   {"dp", in->dp},  {"pp", in->pp},
               {"ep", in->ep}, {"etp", in->etp}, {"vpp", in->vpp}};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i].v < 0)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "mesh: %s=%d must be >= 1 (0 means %s)",
                             all[i].name, all[i].v,
                             strcmp(all[i].name, "dp") ? "1" : "world / (tp*cp*pp)");
    loom_mesh_sizes r = *in;
    r.tp = or1(in->tp);
    r.cp = or1(in->cp);
    r.pp = or1(in->pp);
    r.ep = or1(in->ep);
    r.etp = in->etp == 0 ? r.tp : in->etp; /* Megatron's default: the experts split as tp */
    r.vpp = or1(in->vpp);
    /* each factor < 2^31: four of them fit in 124 bits */
    unsigned __int128 tcp = (unsigned __int128)r.tp * (unsigned)r.cp * (unsigned)r.pp;
    char num[48];
    if (in->dp == 0) {
        if (tcp > (unsigned)world || world % (int)tcp != 0)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "mesh: world size %d is not divisible by tp*cp*pp = %s "
                             "(tp=%d x cp=%d x pp=%d); change the sizes or the number of "
                             "processes",
                             world, fmt_u128(num, tcp), r.tp, r.cp, r.pp);
        r.dp = world / (int)tcp;
    } else {
        unsigned __int128 prod = tcp * (unsigned)in->dp;
        if (prod != (unsigned)world)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "mesh: tp=%d x cp=%d x dp=%d x pp=%d = %s ranks, but the job has "
                             "%d (mpirun -np); change the sizes or the number of processes",
                             r.tp, r.cp, in->dp, r.pp, fmt_u128(num, prod), world);
    }
    if (r.vpp > 1 && r.pp == 1)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "mesh: vpp=%d needs pipeline parallelism (pp > 1): the interleaved "
                         "schedule splits each pipeline rank's layers into vpp chunks",
                         r.vpp);
    if (r.vpp_group < 0 || (r.vpp_group > 0 && r.vpp == 1))
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "mesh: a micro-batch group of %d (--microbatch-group-size-per-virtual-pipeline-stage) "
                         "needs the interleaved pipeline (vpp > 1) and a size >= 1 (0 means pp)",
                         r.vpp_group);
    *out = r;
    return LOOM_OK;
}

/* etp (0: tp) of sizes resolved or not */
static int etp_of(const loom_mesh_sizes *m) { return m->etp == 0 ? or1(m->tp) : m->etp; }

/* The expert layers' fold of a stage's tp*cp*dp ranks into etp x ep x edp. */
static loom_status check_fold(loom_ctx *ctx, const loom_mesh_sizes *m) {
    int tp = or1(m->tp), cp = or1(m->cp), dp = or1(m->dp), ep = or1(m->ep), etp = etp_of(m);
    int64_t stage = (int64_t)tp * cp * dp;
    if (stage % etp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "etp=%d does not divide tp*cp*dp = %lld (expert layers fold the tp x "
                         "cp x dp ranks of a stage into etp x ep x edp); use an etp dividing "
                         "%lld",
                         etp, (long long)stage, (long long)stage);
    if ((stage / etp) % ep)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "ep=%d does not divide tp*cp*dp/etp = %lld/%d = %lld (expert layers "
                         "fold the tp x cp x dp ranks of a stage into etp x ep x edp); use an "
                         "ep dividing %lld, or a smaller etp",
                         ep, (long long)stage, etp, (long long)(stage / etp),
                         (long long)(stage / etp));
    return LOOM_OK;
}

loom_status loom_mesh_check_model(loom_ctx *ctx, const loom_mesh_sizes *m,
                                  const loom_model_config *cfg) {
    int tp = or1(m->tp), pp = or1(m->pp);
    int vpp = or1(m->vpp), ep = or1(m->ep), etp = etp_of(m);
    if (cfg->num_heads % tp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: num_attention_heads=%lld is not divisible by "
                         "tensor-parallel size tp=%d; use a tp that divides it",
                         (long long)cfg->num_heads, tp);
    if (cfg->num_kv_heads % tp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: num_key_value_heads=%lld is not divisible by "
                         "tensor-parallel size tp=%d; use a tp that divides it",
                         (long long)cfg->num_kv_heads, tp);
    if (loom_config_linear_layers(cfg) > 0 &&
        (cfg->lin_k_heads % tp || cfg->lin_v_heads % tp))
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: linear_num_key_heads=%lld and linear_num_value_heads=%lld "
                         "(the Gated DeltaNet layers' heads) must both be divisible by "
                         "tensor-parallel size tp=%d; use a tp that divides them",
                         (long long)cfg->lin_k_heads, (long long)cfg->lin_v_heads, tp);
    bool moe = cfg->num_experts > 0, dense_layer = !moe;
    for (int64_t l = 0; moe && l < cfg->num_layers; l++)
        if (!loom_config_layer_is_moe(cfg, l)) dense_layer = true;
    if (dense_layer && cfg->intermediate_size % tp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: intermediate_size=%lld is not divisible by "
                         "tensor-parallel size tp=%d; use a tp that divides it",
                         (long long)cfg->intermediate_size, tp);
    int64_t chunks = (int64_t)pp * vpp;
    if (cfg->num_layers % chunks)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "num_hidden_layers=%lld cannot be split into pp=%d x vpp=%d = %lld "
                         "model chunks; use pp*vpp dividing %lld",
                         (long long)cfg->num_layers, pp, vpp, (long long)chunks,
                         (long long)cfg->num_layers);
    if (!moe) {
        /* etp = tp is the default, and etp = 1 says the same for no experts */
        if (ep > 1 || (etp != 1 && etp != tp))
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "ep=%d, etp=%d: expert parallelism needs a mixture-of-experts "
                             "model, and this %s model has no experts; leave ep and etp unset",
                             ep, etp, cfg->model_type ? cfg->model_type : "dense");
        return LOOM_OK;
    }
    if (cfg->num_experts % ep)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: num_experts=%lld is not divisible by expert-parallel "
                         "size ep=%d; use an ep dividing %lld",
                         (long long)cfg->num_experts, ep, (long long)cfg->num_experts);
    if (cfg->moe_intermediate_size % etp)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: moe_intermediate_size=%lld is not divisible by "
                         "expert-tensor-parallel size etp=%d%s; use an etp dividing %lld",
                         (long long)cfg->moe_intermediate_size, etp,
                         m->etp == 0 ? " (etp defaults to tp)" : "",
                         (long long)cfg->moe_intermediate_size);
    if (cfg->shared_expert_intermediate_size % tp) /* split like the dense MLP */
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "config.json: shared_expert_intermediate_size=%lld is not divisible by "
                         "tensor-parallel size tp=%d; use a tp that divides it",
                         (long long)cfg->shared_expert_intermediate_size, tp);
    loom_status st = check_fold(ctx, m);
    if (st) return st;
    /* Unless the experts split exactly as tp (ep 1, etp tp: the dense
     * MLP's layout), the ep and edp groups hold tp peers, which must see
     * other tokens: each tensor-parallel rank dispatches its own sequence-
     * parallel share (Megatron warns for tp with ep, and its MoE layer
     * refuses to train with tp > 1 without sequence parallelism). */
    if (tp > 1 && (ep > 1 || etp != tp) && !m->sequence_parallel) {
        if (ep > 1)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "ep=%d with tp=%d needs sequence parallelism (each tensor-parallel "
                             "rank sends its own tokens to their experts, as in Megatron); add "
                             "--sequence-parallel (Python: sequence_parallel=True)",
                             ep, tp);
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "etp=%d other than tp=%d needs sequence parallelism (each "
                         "tensor-parallel rank sends its own tokens to the experts, as in "
                         "Megatron); add --sequence-parallel (Python: sequence_parallel=True), "
                         "or leave etp unset",
                         etp, tp);
    }
    return LOOM_OK;
}

loom_status loom_mesh_check_batch(loom_ctx *ctx, const loom_mesh_sizes *m, int64_t rows,
                                  int64_t seq_len, int64_t num_micro_batches) {
    int tp = or1(m->tp), cp = or1(m->cp), dp = or1(m->dp), pp = or1(m->pp), vpp = or1(m->vpp);
    if (seq_len > 0 && cp > 1 && seq_len % (2 * cp))
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "seq_len=%lld must be divisible by 2*cp = %d (load-balanced context "
                         "parallel cuts each sequence into 2*cp chunks)",
                         (long long)seq_len, 2 * cp);
    if (seq_len > 0 && m->sequence_parallel && tp > 1 && (seq_len / cp) % tp) {
        if (cp > 1)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "seq_len=%lld / cp=%d = %lld tokens per context-parallel rank is "
                             "not divisible by tp=%d (sequence parallel splits them over tp)",
                             (long long)seq_len, cp, (long long)(seq_len / cp), tp);
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "seq_len=%lld is not divisible by tp=%d (sequence parallel splits "
                         "each sequence over tp)",
                         (long long)seq_len, tp);
    }
    if (num_micro_batches > 0 && vpp > 1) {
        if (num_micro_batches > 1 << 20)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%lld micro-batches: at most %d",
                             (long long)num_micro_batches, 1 << 20);
        loom_pp_shape s = {.pp = pp, .vpp = vpp, .group = m->vpp_group,
                           .n_micro = (int)num_micro_batches};
        loom_status st = loom_pp_check(ctx, &s);
        if (st) return st;
    }
    if (rows > 0) {
        int64_t n_micro = num_micro_batches > 0 ? num_micro_batches : 1;
        int64_t parts = (int64_t)dp * n_micro;
        if (rows % parts) {
            if (num_micro_batches > 0)
                return loom_errf(ctx, LOOM_ERR_CONFIG,
                                 "a global batch of %lld rows cannot be split over dp=%d x %lld "
                                 "micro-batches = %lld equal parts; use a multiple of %lld rows "
                                 "or change dp or the number of micro-batches",
                                 (long long)rows, dp, (long long)n_micro, (long long)parts,
                                 (long long)parts);
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "a global batch of %lld rows cannot be split over dp=%d; use a "
                             "multiple of %d rows",
                             (long long)rows, dp, dp);
        }
    }
    return LOOM_OK;
}

int loom_mesh_rank_of(const loom_mesh_sizes *n, int tp, int cp, int dp, int pp) {
    int T = or1(n->tp), C = or1(n->cp), D = or1(n->dp), P = or1(n->pp);
    if (tp < 0 || tp >= T || cp < 0 || cp >= C || dp < 0 || dp >= D || pp < 0 || pp >= P)
        return -1;
    return tp + T * (cp + C * (dp + D * pp));
}

int loom_mesh_edp(const loom_mesh_sizes *n) {
    int64_t stage = (int64_t)or1(n->tp) * or1(n->cp) * n->dp,
            fold = (int64_t)or1(n->ep) * etp_of(n);
    return n->dp > 0 && fold > 0 && stage % fold == 0 ? (int)(stage / fold) : 0;
}

int loom_mesh_expert_rank_of(const loom_mesh_sizes *n, int etp, int ep, int edp, int pp) {
    int ET = etp_of(n), EP = or1(n->ep), ED = loom_mesh_edp(n), P = or1(n->pp);
    if (ED == 0 || etp < 0 || etp >= ET || ep < 0 || ep >= EP || edp < 0 || edp >= ED || pp < 0 ||
        pp >= P)
        return -1;
    return etp + ET * (ep + EP * (edp + ED * pp));
}

const char *loom_mesh_describe(const loom_mesh_sizes *n, char *buf, size_t cap) {
    int len = snprintf(buf, cap, "tp=%d cp=%d dp=%d pp=%d vpp=%d sp=%s", or1(n->tp),
                       or1(n->cp), n->dp, or1(n->pp), or1(n->vpp),
                       n->sequence_parallel ? "on" : "off");
    if ((or1(n->ep) > 1 || etp_of(n) != or1(n->tp)) && len >= 0 && (size_t)len < cap) {
        int more = snprintf(buf + len, cap - (size_t)len, " ep=%d etp=%d", or1(n->ep), etp_of(n));
        len = more < 0 ? -1 : len + more;
        if (loom_mesh_edp(n) && len >= 0 && (size_t)len < cap)
            snprintf(buf + len, cap - (size_t)len, " edp=%d", loom_mesh_edp(n));
    }
    return buf;
}

void loom_mesh_splits(const loom_mesh_sizes *n, int rank, loom_mesh_split *out) {
    const int T = n->tp, C = n->cp, D = n->dp, P = n->pp;
    const int t = rank % T, c = rank / T % C, d = rank / (T * C) % D, p = rank / (T * C * D);
    /* the expert layers' fold of the stage-local index */
    const int ET = n->etp, EP = n->ep, ED = T * C * D / (ET * EP), s = t + T * (c + C * d);
    const int et = s % ET, e = s / ET % EP, ed = s / (ET * EP);
    /* Colors number the other coordinates; keys order by the group's own
     * (fastest first, as in the world). */
    const loom_mesh_split g[LOOM_MESH_NGROUPS] = {
        {"tp", c + C * (d + D * p), t, T},
        {"cp", t + T * (d + D * p), c, C},
        {"dp", t + T * (c + C * p), d, D},
        {"pp", t + T * (c + C * d), p, P},
        {"dpcp", t + T * p, c + C * d, C * D},
        {"tpcp", d + D * p, t + T * c, T * C},
        {"mp", d, t + T * (c + C * p), T * C * P},
        {"embed", P > 1 && (p == 0 || p == P - 1) ? t + T * (c + C * d) : -1, p, 2},
        {"etp", e + EP * (ed + ED * p), et, ET},
        {"ep", et + ET * (ed + ED * p), e, EP},
        {"edp", et + ET * (e + EP * p), ed, ED},
        {"etpep", ed + ED * p, et + ET * e, ET * EP},
    };
    memcpy(out, g, sizeof g);
}

void loom_mesh_free(loom_mesh *m) {
    if (!m) return;
    loom_comm *g[] = {m->tp, m->cp,    m->dp,  m->pp, m->dpcp, m->tpcp,
                      m->mp, m->embed, m->etp, m->ep, m->edp,  m->etpep};
    for (size_t i = 0; i < sizeof g / sizeof g[0]; i++) loom_comm_free(g[i]);
    free(m);
}

/* The comm layer writes its messages to the world's context: bring them
 * to the caller's. */
static loom_status comm_error(loom_ctx *ctx, loom_comm *world, loom_status st) {
    loom_ctx *wc = loom_comm_ctx(world);
    if (wc && wc != ctx) loom_errf(ctx, st, "%s", loom_last_error(wc));
    return st;
}

/* Every rank must pass the same sizes: gather them and compare, so every
 * rank reaches the same verdict. */
static loom_status check_agree(loom_ctx *ctx, loom_comm *world, const loom_mesh_sizes *r) {
    enum { K = 9 };
    int32_t mine[K] = {r->tp, r->cp, r->dp, r->pp, r->vpp, r->ep, r->etp, r->sequence_parallel,
                       r->vpp_group};
    int w = loom_comm_size(world);
    int32_t *all = loom_malloc(ctx, (size_t)w * K * sizeof *all, "mesh sizes");
    if (!all) return LOOM_ERR_OOM;
    loom_status st = loom_comm_allgather(world, mine, all, K, LOOM_I32);
    if (st) {
        free(all);
        return comm_error(ctx, world, st);
    }
    for (int q = 0; q < w; q++) {
        if (memcmp(all + (size_t)q * K, all, K * sizeof *all)) {
            const int32_t *a = all, *b = all + (size_t)q * K;
            st = loom_errf(ctx, LOOM_ERR_CONFIG,
                           "mesh: ranks disagree on the sizes: rank 0 has tp=%d cp=%d dp=%d "
                           "pp=%d vpp=%d ep=%d etp=%d sp=%d group=%d, rank %d has tp=%d cp=%d "
                           "dp=%d pp=%d vpp=%d ep=%d etp=%d sp=%d group=%d; give every rank the "
                           "same options",
                           a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], q, b[0], b[1],
                           b[2], b[3], b[4], b[5], b[6], b[7], b[8]);
            break;
        }
    }
    free(all);
    return st;
}

loom_status loom_mesh_create(loom_ctx *ctx, loom_comm *world, const loom_mesh_sizes *sizes,
                             loom_mesh **out) {
    if (!world || !sizes || !out)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_mesh_create: NULL argument");
    *out = NULL;
    loom_mesh_sizes r;
    loom_status st = loom_mesh_sizes_resolve(ctx, sizes, loom_comm_size(world), &r);
    if (st) return st;
    st = check_agree(ctx, world, &r);
    if (st) return st;
    if ((st = check_fold(ctx, &r))) return st;
    loom_mesh *m = loom_calloc(ctx, 1, sizeof *m, "mesh");
    if (!m) return LOOM_ERR_OOM;
    m->n = r;
    m->world = loom_comm_size(world);
    m->rank = loom_comm_rank(world);
    m->world_comm = world;
    const int T = r.tp, C = r.cp, D = r.dp, rank = m->rank;
    m->tp_rank = rank % T;
    m->cp_rank = rank / T % C;
    m->dp_rank = rank / (T * C) % D;
    m->pp_rank = rank / (T * C * D);
    /* the expert layers' fold of the stage-local index */
    const int s = rank % (T * C * D);
    m->edp_size = T * C * D / (r.etp * r.ep);
    m->etp_rank = s % r.etp;
    m->ep_rank = s / r.etp % r.ep;
    m->edp_rank = s / (r.etp * r.ep);
    loom_mesh_split sp[LOOM_MESH_NGROUPS];
    loom_mesh_splits(&r, rank, sp);
    loom_comm **groups[LOOM_MESH_NGROUPS] = {&m->tp,   &m->cp,   &m->dp,  &m->pp,
                                             &m->dpcp, &m->tpcp, &m->mp,  &m->embed,
                                             &m->etp,  &m->ep,   &m->edp, &m->etpep};
    for (int i = 0; i < LOOM_MESH_NGROUPS; i++) {
        /* a group of one rank (tp=1: every tp group) costs no NCCL communicator */
        const loom_mesh_split *g = &sp[i];
        st = g->size == 1 ? loom_comm_split_self(world, g->name, groups[i])
                          : loom_comm_split(world, g->color, g->key, g->name, groups[i]);
        if (st) {
            loom_mesh_free(m);
            return comm_error(ctx, world, st);
        }
    }
    *out = m;
    return LOOM_OK;
}
