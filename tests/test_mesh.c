/* The mesh's size resolution and its checks against models and batches
 * (messages included), and the one-process communication backend. The
 * same interfaces over MPI are tested by `make test-mpi` (tests/mpi/). */

#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../src/comm/comm.h"
#include "../src/parallel/mesh.h"
#include "harness.h"

/* As loom_mesh_sizes_resolve leaves them: ep 1, etp tp. */
static loom_mesh_sizes resolved(int tp, int cp, int dp, int pp, int vpp) {
    return (loom_mesh_sizes){.tp = tp, .cp = cp, .dp = dp, .pp = pp, .vpp = vpp, .ep = 1,
                             .etp = tp};
}

TEST(mesh_sizes_resolve) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_mesh_sizes out;
    CHECK_OK(ctx, loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){0}, 8, &out));
    CHECK(out.tp == 1 && out.cp == 1 && out.pp == 1 && out.vpp == 1 && out.ep == 1 &&
          out.etp == 1);
    CHECK_EQ_INT(out.dp, 8);
    CHECK_OK(ctx, loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.tp = 2, .pp = 2, .vpp = 2},
                                          8, &out));
    CHECK(out.tp == 2 && out.dp == 2 && out.pp == 2 && out.vpp == 2);
    /* etp unset is tp (Megatron's default); given, it stays */
    CHECK_EQ_INT(out.etp, 2);
    CHECK_OK(ctx, loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.tp = 2, .ep = 4, .etp = 1},
                                          8, &out));
    CHECK(out.ep == 4 && out.etp == 1 && out.dp == 4);
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.etp = -1}, 4, &out),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "etp=-1 must be >= 1");

    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.tp = 2, .cp = 1, .dp = 2,
                                                                 .pp = 2},
                                         4, &out),
                 LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx),
              "mesh: tp=2 x cp=1 x dp=2 x pp=2 = 8 ranks, but the job has 4 (mpirun -np); "
              "change the sizes or the number of processes");
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.tp = 4}, 6, &out),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "world size 6 is not divisible by tp*cp*pp = 4");
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.tp = 2, .cp = 2, .pp = 2},
                                         4, &out),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "world size 4 is not divisible by tp*cp*pp = 8");
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.cp = -2}, 4, &out),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "cp=-2 must be >= 1");
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.vpp = 2}, 4, &out),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "vpp=2 needs pipeline parallelism");
    /* huge sizes do not overflow into a match */
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){.tp = 65536, .cp = 65536,
                                                                 .dp = 65536, .pp = 65536},
                                         1, &out),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "= 18446744073709551616 ranks");
    CHECK_EQ_INT(loom_mesh_sizes_resolve(ctx, &(loom_mesh_sizes){0}, 0, &out),
                 LOOM_ERR_INVALID_ARG);
    loom_ctx_free(ctx);
}

TEST(mesh_rank_of_and_describe) {
    loom_mesh_sizes n = resolved(2, 2, 3, 2, 1);
    /* rank = tp + tp_size*(cp + cp_size*(dp + dp_size*pp)) */
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 0, 0, 0, 0), 0);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 1, 0, 0, 0), 1);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 0, 1, 0, 0), 2);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 0, 0, 1, 0), 4);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 0, 0, 0, 1), 12);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 1, 1, 2, 1), 23);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 2, 0, 0, 0), -1);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 0, 0, 3, 0), -1);
    CHECK_EQ_INT(loom_mesh_rank_of(&n, 0, 0, 0, -1), -1);
    char buf[128];
    loom_mesh_sizes d = resolved(2, 1, 2, 2, 1);
    CHECK_STR(loom_mesh_describe(&d, buf, sizeof buf), "tp=2 cp=1 dp=2 pp=2 vpp=1 sp=off");
    d.sequence_parallel = true;
    d.vpp = 2;
    d.ep = 2;
    d.etp = 1;
    CHECK_STR(loom_mesh_describe(&d, buf, sizeof buf),
              "tp=2 cp=1 dp=2 pp=2 vpp=2 sp=on ep=2 etp=1 edp=2");
    d.ep = 1; /* etp other than tp: the fold is shown */
    CHECK_STR(loom_mesh_describe(&d, buf, sizeof buf),
              "tp=2 cp=1 dp=2 pp=2 vpp=2 sp=on ep=1 etp=1 edp=4");
    d.etp = 0; /* unset: tp, nothing to show */
    CHECK_STR(loom_mesh_describe(&d, buf, sizeof buf), "tp=2 cp=1 dp=2 pp=2 vpp=2 sp=on");
    d.ep = 4; /* a fold that does not divide: no edp */
    CHECK_STR(loom_mesh_describe(&d, buf, sizeof buf),
              "tp=2 cp=1 dp=2 pp=2 vpp=2 sp=on ep=4 etp=2");
    d.dp = 0; /* unresolved */
    d.ep = 2;
    CHECK_STR(loom_mesh_describe(&d, buf, sizeof buf),
              "tp=2 cp=1 dp=0 pp=2 vpp=2 sp=on ep=2 etp=2");
}

/* The fold's arithmetic: edp and the world rank of expert coordinates,
 * s = etp_rank + etp*(ep_rank + ep*edp_rank) inside each stage. */
TEST(mesh_expert_rank_of) {
    loom_mesh_sizes n = resolved(2, 1, 2, 2, 1); /* 8 ranks, 4 per stage */
    n.ep = 4;
    n.etp = 1;
    CHECK_EQ_INT(loom_mesh_edp(&n), 1);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 0, 3, 0, 0), 3);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 0, 1, 0, 1), 5);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 1, 0, 0, 0), -1);
    n.ep = 2;
    n.etp = 2;
    CHECK_EQ_INT(loom_mesh_edp(&n), 1);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 1, 1, 0, 1), 7);
    n.ep = 1;
    n.etp = 0; /* etp = tp: edp is dpcp */
    CHECK_EQ_INT(loom_mesh_edp(&n), 2);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 1, 0, 1, 0), 3);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 0, 0, 2, 0), -1);
    n.ep = 3;
    CHECK_EQ_INT(loom_mesh_edp(&n), 0);
    CHECK_EQ_INT(loom_mesh_expert_rank_of(&n, 0, 0, 0, 0), -1);
}

/* The world ranks of rank `rank`'s group `name` under sizes n (world
 * ranks, comma-separated in the group's order), as loom_mesh_create's
 * splits make it: the ranks of its color, ordered by key; "-" for none. */
static const char *members(const loom_mesh_sizes *n, int rank, const char *name) {
    static char buf[256];
    const int world = n->tp * n->cp * n->dp * n->pp;
    loom_mesh_split mine[LOOM_MESH_NGROUPS], other[LOOM_MESH_NGROUPS];
    loom_mesh_splits(n, rank, mine);
    int g = 0;
    while (g < LOOM_MESH_NGROUPS && strcmp(mine[g].name, name)) g++;
    if (g == LOOM_MESH_NGROUPS) return "no such group";
    if (mine[g].color < 0) return "-";
    int key_of[64], n_in = 0, at[64];
    for (int q = 0; q < world && q < 64; q++) {
        loom_mesh_splits(n, q, other);
        if (other[g].color == mine[g].color) {
            key_of[n_in] = other[g].key;
            at[n_in++] = q;
        }
    }
    size_t len = 0;
    buf[0] = '\0';
    for (int k = 0; k < n_in; k++) /* keys 0..n_in-1, each once */
        for (int i = 0; i < n_in; i++)
            if (key_of[i] == k)
                len += (size_t)snprintf(buf + len, sizeof buf - len, "%s%d", len ? "," : "", at[i]);
    return buf;
}

static loom_mesh_sizes fold(int tp, int cp, int dp, int pp, int ep, int etp) {
    loom_mesh_sizes n = resolved(tp, cp, dp, pp, 1);
    n.ep = ep;
    n.etp = etp;
    return n;
}

/* Each split's size is the number of ranks that share its color (what
 * loom_mesh_create relies on to make one-rank groups without NCCL), on
 * every rank of foldings with 1 to 16 ranks. */
TEST(mesh_split_sizes) {
    const int shapes[][6] = {{1, 1, 1, 1, 1, 1}, {2, 1, 1, 1, 1, 2}, {1, 1, 2, 1, 1, 1},
                             {1, 1, 1, 2, 1, 1}, {2, 2, 2, 2, 1, 2}, {2, 1, 2, 1, 2, 1},
                             {1, 2, 2, 2, 4, 1}, {2, 1, 4, 1, 4, 1}, {1, 1, 1, 4, 1, 1},
                             {2, 1, 2, 1, 2, 2}};
    int ones = 0;
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const int *z = shapes[k];
        loom_mesh_sizes n = fold(z[0], z[1], z[2], z[3], z[4], z[5]);
        const int world = z[0] * z[1] * z[2] * z[3];
        for (int r = 0; r < world; r++) {
            loom_mesh_split mine[LOOM_MESH_NGROUPS], other[LOOM_MESH_NGROUPS];
            loom_mesh_splits(&n, r, mine);
            for (int g = 0; g < LOOM_MESH_NGROUPS; g++) {
                if (mine[g].color < 0) continue;
                int count = 0;
                for (int q = 0; q < world; q++) {
                    loom_mesh_splits(&n, q, other);
                    count += other[g].color == mine[g].color;
                }
                if (mine[g].size != count)
                    fprintf(stderr, "  shape %zu rank %d group %s: size %d, %d members\n", k, r,
                            mine[g].name, mine[g].size, count);
                CHECK_EQ_INT(mine[g].size, count);
                ones += count == 1;
            }
        }
    }
    CHECK(ones > 0);
}

/* Megatron's MoE parallel folding, group by group, for foldings where ep
 * and etp cut across tp, cp and dp (the MPI test builds the same groups
 * over real ranks, up to 4). */
TEST(mesh_expert_groups) {
    /* tp2 dp2 ep2 etp1: the ep groups are the tp pairs, edp spans dp */
    loom_mesh_sizes n = fold(2, 1, 2, 1, 2, 1);
    CHECK_STR(members(&n, 3, "etp"), "3");
    CHECK_STR(members(&n, 3, "ep"), "2,3");
    CHECK_STR(members(&n, 3, "edp"), "1,3");
    CHECK_STR(members(&n, 3, "etpep"), "2,3");
    CHECK_STR(members(&n, 3, "dpcp"), "1,3"); /* the dense gradients' group, for contrast */
    /* tp2 ep2 etp2 (dp2): etp is tp, ep spans dp, edp is one rank */
    n = fold(2, 1, 2, 1, 2, 2);
    CHECK_STR(members(&n, 1, "etp"), "0,1");
    CHECK_STR(members(&n, 1, "ep"), "1,3");
    CHECK_STR(members(&n, 1, "edp"), "1");
    CHECK_STR(members(&n, 1, "etpep"), "0,1,2,3");
    /* tp1 cp2 dp2 pp2 ep4: ep spans cp and dp inside each stage */
    n = fold(1, 2, 2, 2, 4, 1);
    CHECK_STR(members(&n, 0, "ep"), "0,1,2,3");
    CHECK_STR(members(&n, 6, "ep"), "4,5,6,7");
    CHECK_STR(members(&n, 6, "edp"), "6");
    CHECK_STR(members(&n, 6, "etp"), "6");
    CHECK_STR(members(&n, 6, "pp"), "2,6");
    /* tp2 etp1 ep4 dp2: etp differs from tp; ep spans tp and dp */
    n = fold(2, 1, 2, 1, 4, 1);
    CHECK_STR(members(&n, 2, "etp"), "2");
    CHECK_STR(members(&n, 2, "ep"), "0,1,2,3");
    CHECK_STR(members(&n, 2, "edp"), "2");
    /* and on dp4: two ep groups, edp pairs them */
    n = fold(2, 1, 4, 1, 4, 1);
    CHECK_STR(members(&n, 5, "etp"), "5");
    CHECK_STR(members(&n, 5, "ep"), "4,5,6,7");
    CHECK_STR(members(&n, 5, "edp"), "1,5");
    CHECK_STR(members(&n, 5, "etpep"), "4,5,6,7");
    CHECK_STR(members(&n, 5, "tp"), "4,5");
    /* tp2 cp2 dp2 etp4 ep2: etp spans tp and cp */
    n = fold(2, 2, 2, 1, 2, 4);
    CHECK_STR(members(&n, 6, "etp"), "4,5,6,7");
    CHECK_STR(members(&n, 6, "ep"), "2,6");
    CHECK_STR(members(&n, 6, "edp"), "6");
    CHECK_STR(members(&n, 6, "etpep"), "0,1,2,3,4,5,6,7");
    /* the defaults (ep 1, etp tp): etp is tp and edp is dpcp, in dpcp's order */
    n = fold(2, 2, 2, 2, 1, 2);
    for (int r = 0; r < 16; r++) {
        char want[256];
        snprintf(want, sizeof want, "%s", members(&n, r, "tp"));
        CHECK_STR(members(&n, r, "etp"), want);
        snprintf(want, sizeof want, "%s", members(&n, r, "dpcp"));
        CHECK_STR(members(&n, r, "edp"), want);
        snprintf(want, sizeof want, "%d", r);
        CHECK_STR(members(&n, r, "ep"), want);
    }
    /* ep = etp = 1: edp is the whole stage, in world order */
    n = fold(2, 1, 2, 2, 1, 1);
    CHECK_STR(members(&n, 5, "edp"), "4,5,6,7");
    CHECK_STR(members(&n, 5, "etpep"), "5");
    CHECK_STR(members(&n, 5, "embed"), "1,5");
}

static bool load(loom_ctx *ctx, const char *model, loom_model_config *cfg) {
    char path[1024];
    snprintf(path, sizeof path, "%s/models/%s", loom_test_fixtures(), model);
    loom_status st = loom_config_load(ctx, path, cfg);
    if (st) loom_test_fail(__FILE__, __LINE__, "%s: %s", path, loom_last_error(ctx));
    return st == LOOM_OK;
}

TEST(mesh_check_model) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config cfg; /* tiny-qwen3: 4 heads, 2 kv heads, 4 layers, intermediate 128 */
    REQUIRE(load(ctx, "tiny-qwen3", &cfg));
    loom_mesh_sizes m = resolved(2, 2, 1, 2, 2);
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m = resolved(3, 1, 1, 1, 1);
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "num_attention_heads=4 is not divisible by "
                                         "tensor-parallel size tp=3");
    m = resolved(4, 1, 1, 1, 1);
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "num_key_value_heads=2 is not divisible by "
                                         "tensor-parallel size tp=4");
    m = resolved(2, 1, 1, 2, 3);
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx),
                   "num_hidden_layers=4 cannot be split into pp=2 x vpp=3 = 6 model chunks");
    m = resolved(1, 1, 1, 3, 1);
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "pp=3 x vpp=1 = 3 model chunks");
    m = resolved(2, 1, 2, 1, 1);
    m.ep = 2;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx),
              "ep=2, etp=2: expert parallelism needs a mixture-of-experts model, and this qwen3 "
              "model has no experts; leave ep and etp unset");
    m.ep = 1;
    m.etp = 4;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "ep=1, etp=4: expert parallelism needs");
    /* etp = tp (the default) or 1 says nothing without experts */
    m.etp = 1;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m.etp = 0;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    cfg.intermediate_size = 100; /* a shape the fixture lacks */
    m = resolved(2, 1, 1, 1, 1);
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    cfg.intermediate_size = 99;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "intermediate_size=99 is not divisible by "
                                         "tensor-parallel size tp=2");
    loom_config_free(&cfg);

    /* tiny-qwen3_5: 2 key and 4 value heads in its Gated DeltaNet layers */
    REQUIRE_OK(ctx, loom_config_load(ctx, "tests/fixtures_qwen3_5/models/tiny-qwen3_5", &cfg));
    m = resolved(2, 1, 1, 1, 1);
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    cfg.lin_k_heads = 3;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "linear_num_key_heads=3 and linear_num_value_heads=4 "
                                         "(the Gated DeltaNet layers' heads) must both be "
                                         "divisible by tensor-parallel size tp=2");
    loom_config_free(&cfg);

    /* tiny-qwen3-moe: 8 experts, moe_intermediate_size 32, every layer sparse */
    REQUIRE(load(ctx, "tiny-qwen3-moe", &cfg));
    m = resolved(2, 1, 2, 1, 1);
    m.sequence_parallel = true;
    m.ep = 4;
    m.etp = 1;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m.ep = 2;
    m.etp = 2;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m.etp = 0; /* tp */
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m.ep = 3;
    m.etp = 1;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "config.json: num_experts=8 is not divisible by "
                                    "expert-parallel size ep=3; use an ep dividing 8");
    m.ep = 8;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx),
              "ep=8 does not divide tp*cp*dp/etp = 4/1 = 4 (expert layers fold the tp x cp x dp "
              "ranks of a stage into etp x ep x edp); use an ep dividing 4, or a smaller etp");
    m.ep = 4;
    m.etp = 2;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "ep=4 does not divide tp*cp*dp/etp = 4/2 = 2");
    m.ep = 4;
    m.etp = 0; /* tp = 2 */
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "ep=4 does not divide tp*cp*dp/etp = 4/2 = 2");
    m.ep = 1;
    m.etp = 3;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "config.json: moe_intermediate_size=32 is not divisible by "
                                    "expert-tensor-parallel size etp=3; use an etp dividing 32");
    m = resolved(2, 1, 1, 1, 1);
    m.etp = 0; /* unset: the message names the default */
    cfg.moe_intermediate_size = 31;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "moe_intermediate_size=31 is not divisible by "
                                         "expert-tensor-parallel size etp=2 (etp defaults to tp)");
    cfg.moe_intermediate_size = 96;
    m = resolved(2, 1, 2, 1, 1);
    m.etp = 3;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx),
              "etp=3 does not divide tp*cp*dp = 4 (expert layers fold the tp x cp x dp ranks of "
              "a stage into etp x ep x edp); use an etp dividing 4");
    /* tp and ep together need sequence parallelism (Megatron's rule) */
    m = resolved(2, 1, 2, 1, 1);
    m.ep = 2;
    m.etp = 1;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx),
              "ep=2 with tp=2 needs sequence parallelism (each tensor-parallel rank sends its "
              "own tokens to their experts, as in Megatron); add --sequence-parallel (Python: "
              "sequence_parallel=True)");
    m.sequence_parallel = true;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    /* so does an etp other than tp: the edp group holds tp peers */
    m.ep = 1;
    m.sequence_parallel = false;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx),
              "etp=1 other than tp=2 needs sequence parallelism (each tensor-parallel rank sends "
              "its own tokens to the experts, as in Megatron); add --sequence-parallel (Python: "
              "sequence_parallel=True), or leave etp unset");
    m.etp = 4;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "etp=4 other than tp=2 needs sequence parallelism");
    m.sequence_parallel = true;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m = resolved(1, 2, 2, 1, 1); /* without tp, ep alone needs no SP: cp2 dp2 ep4 */
    m.ep = 4;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    m = resolved(2, 1, 1, 1, 1); /* tp without ep: the experts split as the dense MLP */
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    /* a shared expert (Qwen2-MoE) splits over tp like the dense MLP */
    cfg.shared_expert_intermediate_size = 45;
    CHECK_EQ_INT(loom_mesh_check_model(ctx, &m, &cfg), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "config.json: shared_expert_intermediate_size=45 is not "
                                    "divisible by tensor-parallel size tp=2; use a tp that "
                                    "divides it");
    cfg.shared_expert_intermediate_size = 48;
    CHECK_OK(ctx, loom_mesh_check_model(ctx, &m, &cfg));
    loom_config_free(&cfg);
    loom_ctx_free(ctx);
}

TEST(mesh_check_batch) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_mesh_sizes m = resolved(1, 2, 1, 1, 1);
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 8, 32, 2));
    CHECK_EQ_INT(loom_mesh_check_batch(ctx, &m, 8, 30, 2), LOOM_ERR_CONFIG);
    CHECK_STR(loom_last_error(ctx), "seq_len=30 must be divisible by 2*cp = 4 (load-balanced "
                                    "context parallel cuts each sequence into 2*cp chunks)");
    /* sequence parallel: tokens per cp rank split over tp */
    m = resolved(4, 2, 1, 1, 1);
    m.sequence_parallel = true;
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 0, 32, 0));
    CHECK_EQ_INT(loom_mesh_check_batch(ctx, &m, 0, 36, 0), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "seq_len=36 / cp=2 = 18 tokens per context-parallel "
                                         "rank is not divisible by tp=4");
    m.cp = 1;
    CHECK_EQ_INT(loom_mesh_check_batch(ctx, &m, 0, 30, 0), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "seq_len=30 is not divisible by tp=4");
    m.sequence_parallel = false;
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 0, 30, 0));
    /* rows over dp x micro-batches */
    m = resolved(1, 1, 2, 1, 1);
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 8, 0, 4));
    CHECK_EQ_INT(loom_mesh_check_batch(ctx, &m, 6, 0, 4), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "6 rows cannot be split over dp=2 x 4 micro-batches");
    CHECK_EQ_INT(loom_mesh_check_batch(ctx, &m, 3, 0, 0), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "3 rows cannot be split over dp=2");
    /* interleaved pipeline */
    m = resolved(1, 1, 1, 2, 2);
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 4, 0, 4));
    CHECK_EQ_INT(loom_mesh_check_batch(ctx, &m, 3, 0, 3), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "interleaved pipeline (vpp=2): 3 micro-batches in groups "
                                         "of 2 leave a last group of 1, fewer than pp=2");
    m.vpp_group = 3; /* Megatron's groups: 3 + a last group of 2 >= pp */
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 5, 0, 5));
    m.vpp_group = 0;
    m.vpp = 1;
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 3, 0, 3));
    /* non-positive values skip their checks */
    m = resolved(2, 4, 8, 2, 2);
    m.sequence_parallel = true;
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, 0, 0, 0));
    CHECK_OK(ctx, loom_mesh_check_batch(ctx, &m, -1, -1, -1));
    loom_ctx_free(ctx);
}

TEST(mesh_comm_single_collectives) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_comm *w = NULL;
    REQUIRE_OK(ctx, loom_comm_world(ctx, LOOM_COMM_SINGLE, &w));
    CHECK_STR(loom_comm_backend_name(w), "single");
    CHECK_STR(loom_comm_name(w), "world");
    CHECK_EQ_INT(loom_comm_rank(w), 0);
    CHECK_EQ_INT(loom_comm_size(w), 1);
    CHECK(loom_comm_ctx(w) == ctx);
    float a[4] = {1, 2, 3, 4};
    CHECK_OK(ctx, loom_comm_allreduce(w, a, 4, LOOM_F32, LOOM_RED_SUM));
    CHECK_OK(ctx, loom_comm_allreduce(w, a, 4, LOOM_F32, LOOM_RED_MAX));
    CHECK(a[0] == 1 && a[3] == 4);
    /* BF16 reduces on one process (a copy: GPU activations), U8 does not */
    uint16_t hb[2] = {0x3f80, 0x4000};
    CHECK_OK(ctx, loom_comm_allreduce(w, hb, 2, LOOM_BF16, LOOM_RED_SUM));
    CHECK(hb[0] == 0x3f80 && hb[1] == 0x4000);
    uint8_t u8[2] = {1, 2};
    CHECK_EQ_INT(loom_comm_allreduce(w, u8, 2, LOOM_U8, LOOM_RED_SUM), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "allreduce of U8 is not supported");
    CHECK_EQ_INT(loom_comm_allreduce(w, a, 4, LOOM_F32, (loom_red_op)7), LOOM_ERR_INVALID_ARG);
    int64_t s[3] = {5, 6, 7}, r[3] = {0, 0, 0};
    CHECK_OK(ctx, loom_comm_reduce_scatter(w, s, r, 3, LOOM_I64, LOOM_RED_SUM));
    CHECK(r[0] == 5 && r[1] == 6 && r[2] == 7);
    memset(r, 0, sizeof r);
    CHECK_OK(ctx, loom_comm_allgather(w, s, r, 3, LOOM_I64));
    CHECK(r[0] == 5 && r[2] == 7);
    CHECK_OK(ctx, loom_comm_allgather(w, r, r, 3, LOOM_I64)); /* in place */
    CHECK(r[0] == 5 && r[2] == 7);
    int32_t o[5] = {1, 2, 3, 4, 5};
    CHECK_OK(ctx, loom_comm_alltoall(w, o, o + 1, 4, LOOM_I32)); /* overlapping: memmove */
    CHECK(o[0] == 1 && o[1] == 1 && o[2] == 2 && o[4] == 4);
    CHECK_OK(ctx, loom_comm_broadcast(w, o, 5, LOOM_I32, 0));
    CHECK_EQ_INT(loom_comm_broadcast(w, o, 5, LOOM_I32, 1), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "root 1 is not a rank of the group");
    CHECK_EQ_INT(loom_comm_send(w, o, 1, LOOM_I32, 0, 0), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "send to self is not supported by the single backend");
    CHECK_EQ_INT(loom_comm_recv(w, o, 1, LOOM_I32, 0, 0), LOOM_ERR_UNSUPPORTED);
    CHECK_EQ_INT(loom_comm_send(w, o, 1, LOOM_I32, 1, 0), LOOM_ERR_INVALID_ARG);
    CHECK_EQ_INT(loom_comm_send(w, o, 1, LOOM_I32, 0, 40000), LOOM_ERR_INVALID_ARG);
    CHECK_EQ_INT(loom_comm_send(w, NULL, 1, LOOM_I32, 0, 0), LOOM_ERR_INVALID_ARG);
    CHECK_EQ_INT(loom_comm_allreduce(w, a, SIZE_MAX / 2, LOOM_F32, LOOM_RED_SUM),
                 LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "overflow");
    CHECK_OK(ctx, loom_comm_group_start(w));
    CHECK_OK(ctx, loom_comm_group_end(w));
    CHECK_EQ_INT(loom_comm_group_end(w), LOOM_ERR_INVALID_ARG);
    CHECK_OK(ctx, loom_comm_barrier(w));
    loom_comm_req *req = (loom_comm_req *)&req;
    CHECK_OK(ctx, loom_comm_allreduce_async(w, a, 4, LOOM_F32, LOOM_RED_SUM, &req));
    CHECK(req == NULL);
    CHECK_OK(ctx, loom_comm_wait(w, req));
    CHECK_OK(ctx, loom_comm_reduce_scatter_async(w, s, r, 3, LOOM_I64, LOOM_RED_SUM, &req));
    CHECK_OK(ctx, loom_comm_allgather_async(w, s, r, 3, LOOM_I64, &req));
    CHECK_OK(ctx, loom_comm_wait(w, req));
    /* split: a new one-rank group, or none for color < 0 */
    loom_comm *g = NULL;
    CHECK_OK(ctx, loom_comm_split(w, 3, 0, "tp", &g));
    REQUIRE(g != NULL);
    CHECK_STR(loom_comm_name(g), "tp");
    CHECK_EQ_INT(loom_comm_size(g), 1);
    CHECK(g != w);
    loom_comm *none = (loom_comm *)&none;
    CHECK_OK(ctx, loom_comm_split(w, -1, 0, "embed", &none));
    CHECK(none == NULL);
    loom_comm_free(g);
    loom_comm_free(NULL);
    loom_comm_free(w);
    loom_ctx_free(ctx);
}

TEST(mesh_comm_world_auto_and_timeout_env) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMI_SIZE");
    unsetenv("PMIX_RANK");
    loom_comm *w = NULL;
    CHECK_OK(ctx, loom_comm_world(ctx, LOOM_COMM_AUTO, &w));
    if (w) CHECK_STR(loom_comm_backend_name(w), "single");
    loom_comm_free(w);
    setenv("LOOM_COMM_TIMEOUT", "soon", 1);
    CHECK_EQ_INT(loom_comm_world(ctx, LOOM_COMM_SINGLE, &w), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "LOOM_COMM_TIMEOUT='soon' is not a number of seconds");
    CHECK(w == NULL);
    setenv("LOOM_COMM_TIMEOUT", "2.5", 1);
    CHECK_OK(ctx, loom_comm_world(ctx, LOOM_COMM_SINGLE, &w));
    loom_comm_free(w);
    unsetenv("LOOM_COMM_TIMEOUT");
    CHECK_EQ_INT(loom_comm_world(ctx, (loom_comm_backend)9, &w), LOOM_ERR_INVALID_ARG);
    loom_ctx_free(ctx);
}

TEST(mesh_comm_single_abort) {
    int fds[2];
    REQUIRE(pipe(fds) == 0);
    fflush(NULL);
    pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        dup2(fds[1], 2);
        loom_ctx *ctx;
        loom_comm *w;
        if (loom_ctx_create(&ctx) || loom_comm_world(ctx, LOOM_COMM_SINGLE, &w)) _exit(90);
        loom_comm_abort(w, "the loss is NaN", 3);
    }
    close(fds[1]);
    char buf[256] = "";
    ssize_t n = read(fds[0], buf, sizeof buf - 1);
    buf[n > 0 ? n : 0] = '\0';
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status));
    CHECK_EQ_INT(WEXITSTATUS(status), 3);
    CHECK_STR(buf, "loom: error on rank 0: the loss is NaN\n");
}

TEST(mesh_single_process) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_comm *w = NULL;
    REQUIRE_OK(ctx, loom_comm_world(ctx, LOOM_COMM_SINGLE, &w));
    loom_mesh *m = NULL;
    CHECK_OK(ctx, loom_mesh_create(ctx, w, &(loom_mesh_sizes){0}, &m));
    if (m) {
        CHECK(m->n.tp == 1 && m->n.cp == 1 && m->n.dp == 1 && m->n.pp == 1 && m->n.vpp == 1);
        CHECK(m->world == 1 && m->rank == 0 && m->world_comm == w);
        CHECK(m->tp_rank == 0 && m->cp_rank == 0 && m->dp_rank == 0 && m->pp_rank == 0);
        CHECK(m->n.ep == 1 && m->n.etp == 1 && m->edp_size == 1);
        CHECK(m->etp_rank == 0 && m->ep_rank == 0 && m->edp_rank == 0);
        loom_comm *g[] = {m->tp, m->cp, m->dp, m->pp, m->dpcp, m->tpcp, m->mp, m->etp, m->ep,
                          m->edp, m->etpep};
        const char *names[] = {"tp", "cp", "dp", "pp", "dpcp", "tpcp", "mp", "etp", "ep", "edp",
                               "etpep"};
        for (int i = 0; i < 11; i++) {
            CHECK(g[i] != NULL);
            if (g[i]) {
                CHECK_EQ_INT(loom_comm_size(g[i]), 1);
                CHECK_STR(loom_comm_name(g[i]), names[i]);
            }
        }
        CHECK(m->embed == NULL);
        loom_mesh_free(m);
    }
    m = NULL;
    CHECK_EQ_INT(loom_mesh_create(ctx, w, &(loom_mesh_sizes){.pp = 2, .dp = 1}, &m),
                 LOOM_ERR_CONFIG);
    CHECK(m == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "= 2 ranks, but the job has 1");
    /* the expert fold must divide the stage, model or not */
    CHECK_EQ_INT(loom_mesh_create(ctx, w, &(loom_mesh_sizes){.ep = 2}, &m), LOOM_ERR_CONFIG);
    CHECK(m == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "ep=2 does not divide tp*cp*dp/etp = 1/1 = 1");
    loom_comm_free(w);
    loom_ctx_free(ctx);
}
