/* The device mesh (DESIGN.md, "The device mesh"): sizes tp, cp, dp, pp with
 * tp varying fastest,
 *
 *     rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)),
 *
 * Megatron's tp-cp-ep-dp-pp order; expert layers later fold the tp*cp*dp
 * ranks of a stage into etp x ep x edp. Sequence parallel is a flag on TP;
 * vpp virtual stages per pipeline rank give the interleaved schedule.
 * The knobs are those of Megatron's DeviceMesh.from_sizes. */
#ifndef LOOM_MESH_H
#define LOOM_MESH_H

#include "../comm/comm.h"
#include "../io/hf_config.h"

typedef struct loom_mesh_sizes {
    int tp, cp, dp, pp;  /* each >= 1; 0 means 1, except dp: 0 = world / (tp*cp*pp) */
    int ep, etp;         /* expert parallel (0 means 1); only with MoE models */
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
} loom_mesh;
/* Groups are named "tp", "cp", "dp", "pp", "dpcp", "tpcp", "mp", "embed" in
 * messages; each holds the ranks that differ only in its coordinates,
 * ordered by those coordinates (loom_comm_rank(m->tp) == m->tp_rank, ...). */

/* Resolves and checks the sizes against the world size alone (products,
 * positivity; vpp > 1 needs pp > 1), with messages naming the numbers. */
loom_status loom_mesh_sizes_resolve(loom_ctx *ctx, const loom_mesh_sizes *in, int world,
                                    loom_mesh_sizes *out);

/* Checks a resolved mesh against a model and a batch shape, before any
 * compute: heads, kv heads and intermediate size divisible by tp; layers by
 * pp*vpp; seq_len by 2*cp (and by tp under sequence parallel, per cp chunk);
 * micro-batches divisible by pp when vpp > 1; rows of a global batch
 * divisible by dp * num_micro_batches. seq_len / rows / num_micro_batches
 * <= 0 skip their checks. Every message names the numbers and what to change. */
loom_status loom_mesh_check_model(loom_ctx *ctx, const loom_mesh_sizes *m,
                                  const loom_model_config *cfg);
loom_status loom_mesh_check_batch(loom_ctx *ctx, const loom_mesh_sizes *m, int64_t rows,
                                  int64_t seq_len, int64_t num_micro_batches);

/* Builds the groups (every rank of `world` calls it, with the same sizes:
 * this is checked). Resolves `sizes` itself; the model and batch checks are
 * the caller's. `world` must outlive the mesh. */
loom_status loom_mesh_create(loom_ctx *ctx, loom_comm *world, const loom_mesh_sizes *sizes,
                             loom_mesh **out);
void loom_mesh_free(loom_mesh *m);
/* Rank of the given coordinates (resolved sizes; -1 when one is out of range). */
int loom_mesh_rank_of(const loom_mesh_sizes *n, int tp, int cp, int dp, int pp);
/* "tp=2 cp=1 dp=2 pp=2 vpp=1 sp=off" (then " ep=E etp=T" when either is > 1) */
const char *loom_mesh_describe(const loom_mesh_sizes *n, char *buf, size_t cap);

#endif /* LOOM_MESH_H */
