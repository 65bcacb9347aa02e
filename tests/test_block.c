/* The layer table (src/model/block.h): the block kinds' tensors, linears
 * and LoRA targets, and the table a model builds from them. */
#include <stdlib.h>
#include <string.h>

#include "../include/loom.h"
#include "../src/model/model.h"
#include "harness.h"

/* The LoRA targets are the kinds' linears by name, in kind order, each once
 * (the moe kind's experts and shared expert reuse the MLP's names; then its
 * shared expert's gate and the router, "gate", which all-linear leaves
 * out). */
TEST(block_lora_targets_from_kinds) {
    /* the kinds' linears in kind order; the router (gate) and the Gated
     * DeltaNet's in_proj_b and in_proj_a only when named */
    static const char *want[] = {"q_proj",      "k_proj",    "v_proj",    "o_proj",
                                 "gate_proj",   "up_proj",   "down_proj", "shared_expert_gate",
                                 "gate",        "in_proj_qkv", "in_proj_z", "in_proj_b",
                                 "in_proj_a",   "out_proj"};
    enum { NT = sizeof want / sizeof want[0] };
    const int n = loom_lora_ntargets();
    CHECK_EQ_INT(n, NT);
    REQUIRE(n <= LOOM_LORA_NMOD);
    for (int t = 0; t < n && t < NT; t++) {
        CHECK_STR(loom_lora_target_name(t), want[t]);
        CHECK_EQ_INT(loom_lora_target_find(want[t], strlen(want[t])), t);
        CHECK_EQ_INT(loom_lora_target_named(t), t == 8 || t == 11 || t == 12);
    }
    CHECK(loom_lora_target_name(n) == NULL);
    CHECK_EQ_INT(loom_lora_target_find("lm_head", 7), -1);
    CHECK_EQ_INT(loom_lora_target_find("q_projx", 6), 0); /* a name is p[0..n) */
    /* every kind's linear names a target, and its weight is one of its slots */
    for (int id = 0; id < LOOM_NKINDS; id++) {
        const loom_block_kind *k = loom_block_kinds[id];
        CHECK_EQ_INT(k->id, id);
        for (int i = 0; i < k->nlin; i++) {
            const char *name = k->lin[i].name;
            CHECK(loom_lora_target_find(name, strlen(name)) >= 0);
            CHECK(k->lin[i].w >= 0 && k->lin[i].w < k->nslots);
            CHECK(k->lin[i].group >= 0 && k->lin[i].group <= i);
        }
    }
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    bool tg[LOOM_LORA_NMOD];
    REQUIRE_OK(ctx, loom_lora_parse_targets(ctx, "all-linear", tg));
    for (int t = 0; t < LOOM_LORA_NMOD; t++)
        CHECK(tg[t] == (t < n && !loom_lora_target_named(t)));
    REQUIRE_OK(ctx, loom_lora_parse_targets(ctx, "gate, all-linear, in_proj_a,in_proj_b", tg));
    for (int t = 0; t < LOOM_LORA_NMOD; t++) CHECK(tg[t] == (t < n));
    REQUIRE_OK(ctx, loom_lora_parse_targets(ctx, " v_proj,down_proj ", tg));
    for (int t = 0; t < LOOM_LORA_NMOD; t++) CHECK(tg[t] == (t == 2 || t == 6));
    CHECK(loom_lora_parse_targets(ctx, "q_proj,lm_head", tg) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "use all-linear or a list of q_proj, k_proj, v_proj, "
                                         "o_proj, gate_proj, up_proj, down_proj, "
                                         "shared_expert_gate, gate, in_proj_qkv");
    loom_ctx_free(ctx);
}

/* Every layer tensor of the plan names its block and the kind's slot, whose
 * leaf it ends with; the layer table's slots are those tensors. */
static void check_layer_table(const loom_model *m) {
    for (size_t i = 0; i < m->plan.n; i++) {
        const loom_param_spec *p = &m->plan.p[i];
        if (p->layer < 0) {
            CHECK(p->block == -1 && p->slot == -1);
            continue;
        }
        const loom_block *b = &m->layer[p->layer].b[p->block];
        const char *leaf = p->slot == LOOM_SLOT_NORM ? b->kind->norm : b->kind->slots[p->slot].leaf;
        const size_t n = strlen(p->name), k = strlen(leaf);
        CHECK_MSG(n > k && !strcmp(p->name + n - k, leaf), "%s is not a %s", p->name, leaf);
        const int s = p->slot == LOOM_SLOT_NORM ? b->norm : b->w[p->slot];
        CHECK_MSG(s >= 0 && !strcmp(m->base.slots[s].name, p->name), "%s has slot %d", p->name, s);
    }
}

/* A context that logs errors only, and a fixture model's directory. */
static loom_ctx *quiet_ctx(char *dir, size_t cap, const char *model) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx)) return NULL;
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    snprintf(dir, cap, "%s/models/%s", loom_test_fixtures(), model);
    return ctx;
}

TEST(block_layer_table_of_a_model) {
    char dir[1024];
    loom_ctx *ctx = quiet_ctx(dir, sizeof dir, "tiny-qwen2");
    REQUIRE(ctx);
    loom_model *m = NULL;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, NULL, &m));
    const int64_t H = m->H, QD = m->Hq * m->D, KD = m->Hkv * m->D, I = m->I;
    const struct {
        int b, group, gn;
        int64_t in, out;
        bool row_par;
    } want[7] = {{0, 0, 3, H, QD, false}, {0, 0, 3, H, KD, false}, {0, 0, 3, H, KD, false},
                 {0, 3, 1, QD, H, true},  {1, 4, 2, H, I, false},  {1, 4, 2, H, I, false},
                 {1, 6, 1, I, H, true}};
    for (int64_t l = 0; l < m->L; l++) {
        const loom_layer *L = &m->layer[l];
        CHECK(L->held);
        REQUIRE(L->nb == 2 && L->nlin == 7);
        CHECK(L->b[0].kind == &loom_block_attn && L->b[1].kind == &loom_block_mlp);
        CHECK_EQ_INT(L->b[0].lin0, 0);
        CHECK_EQ_INT(L->b[1].lin0, 4);
        for (int j = 0; j < 7; j++) {
            const loom_layer_lin *x = &L->lin[j];
            CHECK_EQ_INT(x->target, j);
            CHECK_EQ_INT(x->b, want[j].b);
            CHECK_EQ_INT(x->group, want[j].group);
            CHECK_EQ_INT(x->gn, want[j].gn);
            CHECK_EQ_INT(x->in, want[j].in);
            CHECK_EQ_INT(x->out, want[j].out);
            CHECK(x->row_par == want[j].row_par);
        }
    }
    check_layer_table(m);
    /* a saved adapter's bytes: (in + out) r per targeted linear and layer, F32 */
    bool tg[LOOM_LORA_NMOD];
    REQUIRE_OK(ctx, loom_lora_parse_targets(ctx, "q_proj,down_proj", tg));
    CHECK_EQ_INT((int64_t)loom_lora_save_estimate(&m->cfg, 8, tg),
                 (H + QD + I + H) * 8 * m->L * 4);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

/* Qwen3-MoE's layers are [attention, moe]; the moe kind declares the
 * router and the experts; the model's slots of expert e lie 3 after expert
 * e-1's (the kind finds them from expert 0's). */
TEST(block_moe_kind_declares_its_tensors) {
    char dir[1024];
    loom_ctx *ctx = quiet_ctx(dir, sizeof dir, "tiny-qwen3-moe");
    REQUIRE(ctx);
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_model_load_config(ctx, dir, NULL, &cfg));
    const loom_block_kind *k[LOOM_LAYER_MAX_BLOCKS];
    CHECK_EQ_INT(loom_layer_kinds(&cfg, 0, k), 2);
    CHECK(k[0] == &loom_block_attn && k[1] == &loom_block_moe);
    loom_param_plan plan;
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &cfg, &plan));
    int routers = 0, experts = 0;
    for (size_t i = 0; i < plan.n; i++) {
        routers += plan.p[i].comp == LOOM_COMP_ROUTER;
        if (plan.p[i].comp == LOOM_COMP_EXPERTS) {
            experts++;
            CHECK(plan.p[i].expert >= 0 && plan.p[i].block == 1);
        }
    }
    CHECK_EQ_INT(routers, cfg.num_layers);
    CHECK_EQ_INT(experts, cfg.num_layers * cfg.num_experts * 3);
    loom_param_plan_free(&plan);
    loom_config_free(&cfg);
    loom_model *m = NULL;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, NULL, &m));
    for (int64_t l = 0; l < m->L; l++) {
        const loom_block *b = &m->layer[l].b[1];
        CHECK(b->kind == &loom_block_moe);
        for (int e = 0; e < 8; e++) {
            char name[128];
            snprintf(name, sizeof name, "model.layers.%lld.mlp.experts.%d.up_proj.weight",
                     (long long)l, e);
            CHECK_EQ_INT(loom_model_find_slot(m, name), b->w[2] + 3 * e);
        }
    }
    loom_model_free(m);
    loom_ctx_free(ctx);
}
