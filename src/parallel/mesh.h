/* The device mesh (DESIGN.md, "The device mesh"): sizes tp, cp, dp, pp with
 * tp varying fastest,
 *
 *     rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),
 *
 * Megatron's tp-cp-ep-dp-pp order. Expert layers (MoE models) fold the
 * tp*cp*dp ranks of each pipeline stage into etp x ep x edp, etp fastest
 * (Megatron's MoE parallel folding, its expert RankGenerator):
 *
 *     s = tp_rank + tp * (cp_rank + cp * dp_rank)        (the stage-local index)
 *       = etp_rank + etp * (ep_rank + ep * edp_rank),    edp = tp*cp*dp / (etp*ep),
 *
 * so etp and ep need not divide tp or cp (tp=2 ep=4 etp=1 dp=2 puts an ep
 * group across tp and dp ranks). Sequence parallel is a flag on TP; vpp
 * virtual stages per pipeline rank give the interleaved schedule. The knobs
 * are those of Megatron's DeviceMesh.from_sizes. */
#ifndef LOOM_MESH_H
#define LOOM_MESH_H

#include "../comm/comm.h"
#include "../io/hf_config.h"

typedef struct loom_mesh_sizes {
    int tp, cp, dp, pp;  /* each >= 1; 0 means 1, except dp: 0 = world / (tp*cp*pp) */
    /* expert layers, MoE models only: ep expert-parallel ranks (0 means 1),
     * etp expert-tensor-parallel (0 means tp, Megatron's and Twinkle's
     * default); resolved, etp is never 0 */
    int ep, etp;
    int vpp;             /* virtual pipeline chunks per pp rank (0 means 1) */
    /* interleaved pipeline: micro-batches each chunk runs in a row
     * (Megatron's microbatch_group_size_per_vp_stage; 0 means pp) */
    int vpp_group;
    bool sequence_parallel;
} loom_mesh_sizes;

typedef struct loom_mesh {
    loom_mesh_sizes n;           /* resolved sizes (no zeros) */
    int world, rank;
    int tp_rank, cp_rank, dp_rank, pp_rank;
    loom_comm *world_comm;       /* borrowed */
    loom_comm *tp, *cp, *dp, *pp;/* the groups this rank belongs to */
    /* dp x cp (same tp, pp): where gradients are reduced; ordered as the
     * world ranks are, cp fastest: rank in dpcp = cp_rank + cp * dp_rank */
    loom_comm *dpcp;
    /* tp x cp (same dp, pp): rank in tpcp = tp_rank + tp * cp_rank */
    loom_comm *tpcp;
    /* tp x cp x pp (same dp): one data-parallel replica of the model, where
     * a data-parallel rank's per-token outputs are gathered; rank in mp =
     * tp_rank + tp * (cp_rank + cp * pp_rank) */
    loom_comm *mp;
    /* first and last pipeline stage with this rank's tp/cp/dp coordinates:
     * tied embedding gradients are summed here (rank 0 = first stage). NULL
     * when pp == 1 or this rank is on neither end. */
    loom_comm *embed;

    /* The expert layers' view of this rank's stage (the fold above). Every
     * mesh has them, dense ones too: with ep = 1 and etp = tp (the
     * defaults) edp is dpcp's ranks in dpcp's order; with ep = etp = 1 it
     * is the whole stage (tpcp x dp) in world order. */
    int edp_size;                /* tp*cp*dp / (etp*ep) */
    int etp_rank, ep_rank, edp_rank;
    /* etp (same ep, edp, pp): the experts' tensor parallel. Each expert's
     * gate/up rows and down columns are split over it (moe_intermediate_size
     * / etp per rank), its down projection's partial output is reduced here,
     * and dispatched tokens are all-gathered over it. rank = etp_rank */
    loom_comm *etp;
    /* ep (same etp, edp, pp): the all-to-all of tokens to their experts.
     * Rank r holds experts [r*E/ep, (r+1)*E/ep) of every MoE layer of its
     * stage (Megatron's contiguous local experts). rank = ep_rank */
    loom_comm *ep;
    /* edp (same etp, ep, pp): the expert layers' data parallel: ranks that
     * hold the same expert shards but see other tokens. Expert gradients
     * are reduced here and the distributed optimizer shards the expert
     * parameters over it (dense ones: over dpcp). rank = edp_rank, which
     * orders the group as the world ranks are */
    loom_comm *edp;
    /* etp x ep (same edp, pp): every holder of one layer's experts,
     * Megatron's tp-ep group: with etp > 1, where a dispatcher can move
     * tokens in one exchange instead of the all-to-all over ep and the
     * all-gather over etp. rank = etp_rank + etp * ep_rank */
    loom_comm *etpep;
} loom_mesh;
/* Groups are named "tp", "cp", "dp", "pp", "dpcp", "tpcp", "mp", "embed",
 * "etp", "ep", "edp", "etpep" in messages; each holds the ranks that differ
 * only in its coordinates, ordered by those coordinates
 * (loom_comm_rank(m->tp) == m->tp_rank, loom_comm_rank(m->ep) ==
 * m->ep_rank, ...). */

/* Resolves and checks the sizes against the world size alone (products,
 * positivity; vpp > 1 needs pp > 1), with messages naming the numbers. */
loom_status loom_mesh_sizes_resolve(loom_ctx *ctx, const loom_mesh_sizes *in, int world,
                                    loom_mesh_sizes *out);

/* Checks a resolved mesh against a model and a batch shape, before any
 * compute: heads, kv heads and intermediate size divisible by tp; layers by
 * pp*vpp; a dense model refuses ep > 1 and an etp other than 1 or tp; a MoE
 * model needs num_experts divisible by ep, moe_intermediate_size by etp,
 * a shared expert's width (shared_expert_intermediate_size) by tp,
 * tp*cp*dp by etp*ep, and sequence parallelism when tp > 1 and the experts
 * are not split as tp (ep > 1 or etp != tp; Megatron's MoE layer wants it
 * whenever tp > 1); seq_len by 2*cp (and by tp under sequence parallel, per cp chunk);
 * micro-batches divisible by pp when vpp > 1; rows of a global batch
 * divisible by dp * num_micro_batches. seq_len / rows / num_micro_batches
 * <= 0 skip their checks. Every message names the numbers and what to change. */
loom_status loom_mesh_check_model(loom_ctx *ctx, const loom_mesh_sizes *m,
                                  const loom_model_config *cfg);
loom_status loom_mesh_check_batch(loom_ctx *ctx, const loom_mesh_sizes *m, int64_t rows,
                                  int64_t seq_len, int64_t num_micro_batches);

/* Builds the groups (every rank of `world` calls it, with the same sizes:
 * this is checked). Resolves `sizes` itself and refuses a tp*cp*dp that
 * etp*ep does not divide; the model and batch checks are the caller's.
 * `world` must outlive the mesh. */
loom_status loom_mesh_create(loom_ctx *ctx, loom_comm *world, const loom_mesh_sizes *sizes,
                             loom_mesh **out);
void loom_mesh_free(loom_mesh *m);
/* Rank of the given coordinates (resolved sizes; -1 when one is out of range). */
int loom_mesh_rank_of(const loom_mesh_sizes *n, int tp, int cp, int dp, int pp);
/* How loom_mesh_create splits the world, for rank `rank` of resolved sizes
 * that fold: each group's name, color (ranks of one color make one group;
 * -1: none) and key (its order), in loom_mesh's order: tp, cp, dp, pp,
 * dpcp, tpcp, mp, embed, etp, ep, edp, etpep. */
enum { LOOM_MESH_NGROUPS = 12 };
typedef struct loom_mesh_split {
    const char *name;
    int color, key;
    int size; /* the group's ranks (a member's; embed: 2 when it exists) */
} loom_mesh_split;
void loom_mesh_splits(const loom_mesh_sizes *n, int rank, loom_mesh_split *out);
/* edp of resolved sizes, tp*cp*dp / (etp*ep); 0 when that does not divide. */
int loom_mesh_edp(const loom_mesh_sizes *n);
/* World rank of expert coordinates (resolved sizes that fold; -1 when one
 * is out of range). */
int loom_mesh_expert_rank_of(const loom_mesh_sizes *n, int etp, int ep, int edp, int pp);
/* "tp=2 cp=1 dp=2 pp=2 vpp=1 sp=off", then " ep=E etp=T edp=D" when ep > 1
 * or etp != tp (edp left out while dp is unresolved or the fold does not
 * divide) */
const char *loom_mesh_describe(const loom_mesh_sizes *n, char *buf, size_t cap);

#endif /* LOOM_MESH_H */
