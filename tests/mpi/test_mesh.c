/* The mesh over MPI: for every way of writing the world size as
 * tp*cp*dp*pp, each rank's coordinates follow the formula and each group
 * holds exactly the ranks it should, in the order it should; and for every
 * fold of a stage's tp*cp*dp ranks into etp x ep x edp, the expert groups
 * too. */

#include <stdlib.h>

#include "../../src/parallel/mesh.h"
#include "mpi_harness.h"

/* Checks that group g holds, at position j, world rank member(j) for
 * j < n (gathering the world ranks inside the group), and that this rank
 * sits at position `pos`. */
typedef int (*member_fn)(const loom_mesh *m, int j);

static void check_group(const loom_mesh *m, loom_comm *g, const char *name, int n, int pos,
                        member_fn member) {
    CHECK_MSG(g != NULL, "group %s missing", name);
    if (!g) return;
    CHECK_STR(loom_comm_name(g), name);
    CHECK_MSG(loom_comm_size(g) == n, "%s: size %d, expected %d", name, loom_comm_size(g), n);
    CHECK_MSG(loom_comm_rank(g) == pos, "%s: rank %d, expected %d", name, loom_comm_rank(g),
              pos);
    if (loom_comm_size(g) != n) return; /* same on every member: no collective skipped alone */
    int32_t me = m->rank, *got = calloc((size_t)n, sizeof *got);
    CHECK_OK(mt_ctx(), loom_comm_allgather(g, &me, got, 1, LOOM_I32));
    for (int j = 0; j < n; j++)
        CHECK_MSG(got[j] == member(m, j), "%s of rank %d: position %d holds rank %d, expected %d",
                  name, m->rank, j, got[j], member(m, j));
    free(got);
}

static int tp_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, j, m->cp_rank, m->dp_rank, m->pp_rank);
}
static int cp_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, m->tp_rank, j, m->dp_rank, m->pp_rank);
}
static int dp_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, m->tp_rank, m->cp_rank, j, m->pp_rank);
}
static int pp_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, m->tp_rank, m->cp_rank, m->dp_rank, j);
}
static int dpcp_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, m->tp_rank, j % m->n.cp, j / m->n.cp, m->pp_rank);
}
static int tpcp_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, j % m->n.tp, j / m->n.tp, m->dp_rank, m->pp_rank);
}
static int embed_member(const loom_mesh *m, int j) {
    return loom_mesh_rank_of(&m->n, m->tp_rank, m->cp_rank, m->dp_rank,
                             j == 0 ? 0 : m->n.pp - 1);
}

static int etp_member(const loom_mesh *m, int j) {
    return loom_mesh_expert_rank_of(&m->n, j, m->ep_rank, m->edp_rank, m->pp_rank);
}
static int ep_member(const loom_mesh *m, int j) {
    return loom_mesh_expert_rank_of(&m->n, m->etp_rank, j, m->edp_rank, m->pp_rank);
}
static int edp_member(const loom_mesh *m, int j) {
    return loom_mesh_expert_rank_of(&m->n, m->etp_rank, m->ep_rank, j, m->pp_rank);
}
static int etpep_member(const loom_mesh *m, int j) {
    return loom_mesh_expert_rank_of(&m->n, j % m->n.etp, j / m->n.etp, m->edp_rank, m->pp_rank);
}

/* The expert layers' groups of a mesh (ep 1 and etp tp by default). */
static void check_expert_groups(const loom_mesh *m) {
    const int etp = m->n.etp, ep = m->n.ep, stage = m->n.tp * m->n.cp * m->n.dp;
    const int edp = stage / (etp * ep);
    CHECK_EQ_INT(m->edp_size, edp);
    /* s = tp_rank + tp*(cp_rank + cp*dp_rank) = etp_rank + etp*(ep_rank + ep*edp_rank) */
    CHECK_EQ_INT(m->tp_rank + m->n.tp * (m->cp_rank + m->n.cp * m->dp_rank),
                 m->etp_rank + etp * (m->ep_rank + ep * m->edp_rank));
    CHECK_EQ_INT(
        loom_mesh_expert_rank_of(&m->n, m->etp_rank, m->ep_rank, m->edp_rank, m->pp_rank),
        m->rank);
    check_group(m, m->etp, "etp", etp, m->etp_rank, etp_member);
    check_group(m, m->ep, "ep", ep, m->ep_rank, ep_member);
    check_group(m, m->edp, "edp", edp, m->edp_rank, edp_member);
    check_group(m, m->etpep, "etpep", etp * ep, m->etp_rank + etp * m->ep_rank, etpep_member);
}

static void check_mesh(int tp, int cp, int dp, int pp) {
    int rank = mt_rank(), size = mt_size();
    loom_mesh_sizes in = {.tp = tp, .cp = cp, .dp = dp, .pp = pp};
    loom_mesh *m = NULL;
    CHECK_OK(mt_ctx(), loom_mesh_create(mt_ctx(), mt_world(), &in, &m));
    if (!m) return;
    CHECK_EQ_INT(m->world, size);
    CHECK_EQ_INT(m->rank, rank);
    CHECK(m->world_comm == mt_world());
    CHECK(m->n.tp == tp && m->n.cp == cp && m->n.dp == dp && m->n.pp == pp);
    CHECK(m->n.vpp == 1 && m->n.ep == 1 && m->n.etp == tp); /* etp unset: tp */
    /* rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)) */
    CHECK_EQ_INT(m->tp_rank + tp * (m->cp_rank + cp * (m->dp_rank + dp * m->pp_rank)), rank);
    CHECK(m->tp_rank >= 0 && m->tp_rank < tp && m->cp_rank >= 0 && m->cp_rank < cp);
    CHECK(m->dp_rank >= 0 && m->dp_rank < dp && m->pp_rank >= 0 && m->pp_rank < pp);
    CHECK_EQ_INT(loom_mesh_rank_of(&m->n, m->tp_rank, m->cp_rank, m->dp_rank, m->pp_rank), rank);
    check_group(m, m->tp, "tp", tp, m->tp_rank, tp_member);
    check_group(m, m->cp, "cp", cp, m->cp_rank, cp_member);
    check_group(m, m->dp, "dp", dp, m->dp_rank, dp_member);
    check_group(m, m->pp, "pp", pp, m->pp_rank, pp_member);
    check_group(m, m->dpcp, "dpcp", dp * cp, m->cp_rank + cp * m->dp_rank, dpcp_member);
    check_group(m, m->tpcp, "tpcp", tp * cp, m->tp_rank + tp * m->cp_rank, tpcp_member);
    bool end = pp > 1 && (m->pp_rank == 0 || m->pp_rank == pp - 1);
    if (end)
        check_group(m, m->embed, "embed", 2, m->pp_rank == 0 ? 0 : 1, embed_member);
    else
        CHECK_MSG(m->embed == NULL, "rank %d (pp_rank %d of %d) has an embed group", rank,
                  m->pp_rank, pp);
    /* the groups reduce over the right ranks: sum of world ranks in dp */
    if (m->dp) {
        int64_t s = rank, e = 0;
        CHECK_OK(mt_ctx(), loom_comm_allreduce(m->dp, &s, 1, LOOM_I64, LOOM_RED_SUM));
        for (int j = 0; j < dp; j++) e += dp_member(m, j);
        CHECK_EQ_INT(s, e);
    }
    check_expert_groups(m);
    loom_mesh_free(m);
}

/* Every etp x ep that divides the stage but the default (check_mesh's):
 * the fold's groups. */
static int check_folds(int tp, int cp, int dp, int pp) {
    int stage = tp * cp * dp, count = 0;
    for (int etp = 1; etp <= stage; etp++)
        for (int ep = 1; etp * ep <= stage; ep++) {
            if (stage % (etp * ep) || (etp == tp && ep == 1)) continue;
            loom_mesh_sizes in = {.tp = tp, .cp = cp, .dp = dp, .pp = pp, .ep = ep, .etp = etp};
            loom_mesh *m = NULL;
            CHECK_OK(mt_ctx(), loom_mesh_create(mt_ctx(), mt_world(), &in, &m));
            if (!m) continue;
            CHECK(m->n.ep == ep && m->n.etp == etp);
            check_expert_groups(m);
            /* the dense groups do not move */
            CHECK_EQ_INT(loom_comm_size(m->dpcp), dp * cp);
            loom_mesh_free(m);
            count++;
        }
    return count;
}

TEST(mpi_mesh_every_factorisation) {
    int size = mt_size(), count = 0;
    for (int tp = 1; tp <= size; tp++)
        for (int cp = 1; tp * cp <= size; cp++)
            for (int pp = 1; tp * cp * pp <= size; pp++) {
                if (size % (tp * cp * pp)) continue;
                check_mesh(tp, cp, size / (tp * cp * pp), pp);
                count++;
            }
    /* 1 -> 1, 2 -> 4, 3 -> 4, 4 -> 10 ordered factorisations into 4 factors */
    const int want[] = {0, 1, 4, 4, 10};
    if (size <= 4) CHECK_EQ_INT(count, want[size]);
}

TEST(mpi_mesh_expert_folds) {
    int size = mt_size(), count = 0;
    for (int tp = 1; tp <= size; tp++)
        for (int cp = 1; tp * cp <= size; cp++)
            for (int pp = 1; tp * cp * pp <= size; pp++)
                if (size % (tp * cp * pp) == 0)
                    count += check_folds(tp, cp, size / (tp * cp * pp), pp);
    CHECK_EQ_INT(count > 0, size > 1); /* one rank has only the default fold */
    /* a fold that does not divide the stage is refused on every rank */
    loom_mesh *m = NULL;
    loom_mesh_sizes bad = {.ep = size + 1};
    CHECK_EQ_INT(loom_mesh_create(mt_ctx(), mt_world(), &bad, &m), LOOM_ERR_CONFIG);
    CHECK(m == NULL);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), "does not divide tp*cp*dp/etp");
}

TEST(mpi_mesh_errors) {
    int size = mt_size(), rank = mt_rank();
    loom_mesh *m = NULL;
    /* the product must be the world size */
    loom_mesh_sizes bad = {.tp = 2, .dp = size};
    CHECK_EQ_INT(loom_mesh_create(mt_ctx(), mt_world(), &bad, &m), LOOM_ERR_CONFIG);
    CHECK(m == NULL);
    char want[160];
    snprintf(want, sizeof want, "= %d ranks, but the job has %d (mpirun -np)", 2 * size, size);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), want);
    /* every rank must pass the same sizes */
    if (size >= 2) {
        loom_mesh_sizes mine = rank == 0 ? (loom_mesh_sizes){.tp = size}
                                         : (loom_mesh_sizes){.dp = size};
        CHECK_EQ_INT(loom_mesh_create(mt_ctx(), mt_world(), &mine, &m), LOOM_ERR_CONFIG);
        CHECK(m == NULL);
        CHECK_CONTAINS(loom_last_error(mt_ctx()), "ranks disagree on the sizes");
    }
    /* dp = 0 takes the rest, and the mesh still works after the failures */
    loom_mesh_sizes rest = {0};
    CHECK_OK(mt_ctx(), loom_mesh_create(mt_ctx(), mt_world(), &rest, &m));
    if (m) {
        CHECK_EQ_INT(m->n.dp, size);
        CHECK_EQ_INT(m->dp_rank, rank);
        CHECK(m->embed == NULL);
        loom_mesh_free(m);
    }
}
