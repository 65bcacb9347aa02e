/* The memory prediction (loom_memory_predict, `loom inspect --mesh`, the
 * line every run prints) against what the model really allocates: the
 * parameter and gradient buffers, the optimizer's block and the one
 * activation allocation, on CPU and (skipped without one) on a GPU. */
#include <stdlib.h>
#include <string.h>

#include "../include/loom.h"
#include "../src/backend/gdn_ws.h"
#include "../src/model/block.h"
#include "../src/model/model.h"
#include "harness.h"

/* A context (errors only), the tiny Qwen3 fixture's directory and default
 * model options; NULL when the context cannot be made. */
static loom_ctx *tiny_setup(char *dir, size_t n, loom_model_options *o) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx)) return NULL;
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    snprintf(dir, n, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model_options_default(o);
    return ctx;
}

static void check_predicted_rc(loom_device dev, loom_dtype adt, int lora_r, loom_recompute rc,
                               uint64_t *acts) {
    if (dev == LOOM_DEVICE_CUDA && !loom_test_have_gpu()) SKIP("no GPU visible");
    char dir[1024];
    loom_model_options o;
    loom_ctx *ctx = tiny_setup(dir, sizeof dir, &o);
    REQUIRE(ctx);
    o.device = dev;
    o.dtype = adt;
    o.recompute = rc;
    loom_model *m = NULL;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m));
    if (lora_r) {
        loom_lora_config lc = {.r = lora_r, .lora_alpha = 2.0 * lora_r,
                               .target_modules = "all-linear", .seed = 1};
        REQUIRE_OK(ctx, loom_model_add_adapter(m, "default", &lc));
    }
    const int64_t rows = 2, seq = 24;
    int32_t ids[48], tgt[48];
    for (int i = 0; i < 48; i++) {
        ids[i] = (i * 37) % 1000;
        tgt[i] = (i * 53 + 1) % 1000;
    }
    loom_batch b = {.rows = rows, .seq_len = seq, .input_ids = ids, .targets = tgt};
    loom_fb_result r;
    loom_step_result sr;
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 2, &r));
    REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 1, &sr));

    loom_mem_in in = {.n = m->mesh->n, .adt = adt, .cuda = dev == LOOM_DEVICE_CUDA,
                      .lora_r = lora_r, .micro_batch_size = rows / 2, .seq = seq, .n_micro = 2,
                      .training = true, .recompute = rc};
    for (int k = 0; k < LOOM_LORA_NMOD; k++) in.lora_target[k] = true;
    loom_mem_report p;
    REQUIRE_OK(ctx, loom_memory_predict(ctx, &m->cfg, &in, &p));
    /* activations: the one allocation, byte for byte */
    CHECK_EQ_INT((int64_t)p.acts, (int64_t)m->act_bytes);
    if (acts) *acts = p.acts;
    /* parameters, gradients and optimizer state of what is trained */
    const loom_arena *A = loom_model_trainable(m);
    size_t esz = loom_dtype_size(adt), P = m->base.nparams;
    uint64_t w = (m->base.w ? P * 4 : 0) + (adt != LOOM_F32 ? P * esz : 0);
    if (lora_r) w += A->nparams * 4 + (adt != LOOM_F32 ? A->nparams * esz : 0);
    /* the adapter's buckets are padded to 16 per slot in the arena, which the
     * prediction does not model: allow that much */
    double slack = lora_r ? (double)A->nslots * 16 * (4 + esz) : 0;
    CHECK_NEAR((double)p.weights, (double)w, slack);
    CHECK_NEAR((double)p.grads, (double)A->nparams * 4, lora_r ? A->nslots * 16 * 4 : 0);
    /* the moments, and the gradient shard unless the gradients are it (dp*cp = 1) */
    const double blocks = A->gshard_is_g ? 2.0 : 3.0;
    CHECK(A->gshard_is_g == (m->dp * m->cp == 1));
    CHECK_NEAR((double)p.optim, blocks * (double)A->shard_numel * 4,
               lora_r ? A->nslots * 16 * 4 * blocks : 0);
    CHECK(p.total >= p.weights + p.grads + p.optim + p.acts);
    /* on a GPU, the buffers loom holds at their most: the prediction's
     * parts, and no more than its total with the scratch it rounds over */
    if (dev == LOOM_DEVICE_CUDA) {
        const uint64_t own = loom_model_buffer_memory(m);
        CHECK_MSG(own >= p.weights + p.grads + p.optim + p.acts && own <= p.total + (4u << 20),
                  "loom's buffers %llu bytes, predicted %llu (parts %llu)",
                  (unsigned long long)own, (unsigned long long)p.total,
                  (unsigned long long)(p.weights + p.grads + p.optim + p.acts));
    }
    loom_model_free(m);
    loom_ctx_free(ctx);
}

static void check_predicted(loom_device dev, loom_dtype adt, int lora_r) {
    check_predicted_rc(dev, adt, lora_r, LOOM_RECOMPUTE_NONE, NULL);
}

TEST(memory_prediction_cpu_full) { check_predicted(LOOM_DEVICE_CPU, LOOM_F32, 0); }
TEST(memory_prediction_cpu_lora) { check_predicted(LOOM_DEVICE_CPU, LOOM_F32, 4); }
TEST(memory_prediction_cuda_bf16_full) { check_predicted(LOOM_DEVICE_CUDA, LOOM_BF16, 0); }
TEST(memory_prediction_cuda_bf16_lora) { check_predicted(LOOM_DEVICE_CUDA, LOOM_BF16, 4); }

/* Recomputation: the prediction still equals the allocation, and each
 * level keeps less (mlp: not the MLP's three wide tensors; full: only each
 * layer's input). */
TEST(memory_prediction_recompute) {
    for (int lr = 0; lr <= 4; lr += 4) {
        uint64_t a[3] = {0, 0, 0};
        check_predicted_rc(LOOM_DEVICE_CPU, LOOM_F32, lr, LOOM_RECOMPUTE_NONE, &a[0]);
        check_predicted_rc(LOOM_DEVICE_CPU, LOOM_F32, lr, LOOM_RECOMPUTE_MLP, &a[1]);
        check_predicted_rc(LOOM_DEVICE_CPU, LOOM_F32, lr, LOOM_RECOMPUTE_FULL, &a[2]);
        CHECK_MSG(a[0] > a[1] && a[1] > a[2], "activations none %llu, mlp %llu, full %llu (lora r=%d)",
                  (unsigned long long)a[0], (unsigned long long)a[1], (unsigned long long)a[2], lr);
    }
}

/* `loom inspect --mesh`: the table for an 8-GPU layout of a preset, and a
 * clear error for a mesh it cannot parse or that does not fit. */
TEST(memory_inspect_mesh_table) {
    char *out = NULL;
    const char *argv[] = {loom_test_bin(), "inspect", "--preset", "qwen3-8b", "--mesh",
                          "tp=2,pp=2,dp=2", "--seq-len", "4096", "--global-batch-size", "32",
                          "--lora-r", "8", NULL};
    CHECK_EQ_INT(loom_test_run(&out, argv), 0);
    CHECK_CONTAINS(out, "memory per GPU on mesh tp=2 cp=1 dp=2 pp=2");
    CHECK_CONTAINS(out, "activations");
    CHECK_CONTAINS(out, "2 micro-batches in flight");
    free(out);
    const char *bad[] = {loom_test_bin(), "inspect", "--preset", "qwen3-8b", "--mesh", "tq=2", NULL};
    CHECK_EQ_INT(loom_test_run(&out, bad), 1);
    CHECK_CONTAINS(out, "unknown size 'tq'");
    free(out);
    const char *zero[] = {loom_test_bin(), "inspect", "--preset", "qwen3-8b", "--mesh", "tp=0", NULL};
    CHECK_EQ_INT(loom_test_run(&out, zero), 1);
    CHECK_CONTAINS(out, "tp needs a size >= 1");
    free(out);
    const char *junk[] = {loom_test_bin(), "inspect", "--preset", "qwen3-8b", "--mesh", "tp=2x,pp=2",
                          NULL};
    CHECK_EQ_INT(loom_test_run(&out, junk), 1);
    CHECK_CONTAINS(out, "expected ',' after tp");
    free(out);
    const char *batch[] = {loom_test_bin(), "inspect", "--preset", "qwen3-8b", "--mesh", "dp=3",
                           "--global-batch-size", "8", NULL};
    CHECK_EQ_INT(loom_test_run(&out, batch), 1);
    CHECK_CONTAINS(out, "not a multiple of micro_batch_size=1 x dp=3");
    free(out);
    const char *nofit[] = {loom_test_bin(), "inspect", "--preset", "qwen3-8b", "--mesh", "tp=3", NULL};
    CHECK_EQ_INT(loom_test_run(&out, nofit), 1);
    CHECK_CONTAINS(out, "tp=3");
    free(out);
}

/* A recompute level that does not exist: the API refuses it and names the
 * levels; the command line lists the choices. */
TEST(memory_recompute_bad_values) {
    char dir[1024];
    loom_model_options o;
    loom_ctx *ctx = tiny_setup(dir, sizeof dir, &o);
    REQUIRE(ctx);
    o.recompute = (loom_recompute)7;
    loom_model *m = NULL;
    CHECK(loom_model_create(ctx, dir, &o, &m) == LOOM_ERR_INVALID_ARG);
    CHECK(m == NULL);
    CHECK_CONTAINS(loom_last_error(ctx), "LOOM_RECOMPUTE_NONE");
    loom_ctx_free(ctx);
    char *out = NULL;
    const char *argv[] = {loom_test_bin(), "inspect", "--preset", "qwen3-0.6b", "--mesh", "tp=1",
                          "--recompute", "some", NULL};
    CHECK_EQ_INT(loom_test_run(&out, argv), 2); /* a usage error */
    CHECK_CONTAINS(out, "none|mlp|full");
    free(out);
}

/* ---- MoE: the experts as the expert fold holds them ---- */

/* Expert parameters of the layers of pipeline stage p (of pp), whole. */
static int64_t stage_experts(const loom_param_plan *plan, int64_t L, int pp, int p) {
    int64_t n = 0;
    for (size_t i = 0; i < plan->n; i++)
        if (plan->p[i].comp == LOOM_COMP_EXPERTS && plan->p[i].layer / (L / pp) == p)
            n += loom_param_numel(&plan->p[i]);
    return n;
}

/* For each fold of tiny-qwen3-moe's experts over a mesh, the predicted
 * expert bytes per rank are the plan's stage experts / (ep*etp), exactly:
 * weights (fp32 master and bf16 copy), fp32 gradients, and the optimizer's
 * moments and gradient shard over edp (the gradients themselves when edp
 * is 1); and the rest of the prediction does not move with the fold. */
TEST(memory_prediction_moe_experts) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_load(ctx, dir, &cfg));
    loom_param_plan plan;
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &cfg, &plan));
    const struct {
        int tp, cp, dp, pp, ep, etp; /* etp 0: tp */
    } folds[] = {
        {2, 1, 2, 1, 1, 0}, {2, 1, 2, 1, 2, 1}, {2, 1, 2, 1, 2, 2}, {2, 1, 2, 1, 4, 1},
        {1, 2, 2, 1, 4, 1}, {1, 2, 2, 2, 2, 1}, {2, 1, 4, 2, 4, 1}, {1, 1, 1, 1, 1, 1},
    };
    const size_t esz = 2; /* bf16 */
    uint64_t dense_ref = 0;
    for (size_t f = 0; f < sizeof folds / sizeof folds[0]; f++) {
        loom_mesh_sizes want = {.tp = folds[f].tp, .cp = folds[f].cp, .dp = folds[f].dp,
                                .pp = folds[f].pp, .ep = folds[f].ep, .etp = folds[f].etp,
                                .sequence_parallel = folds[f].tp > 1},
                        n;
        const int world = want.tp * want.cp * want.dp * want.pp;
        REQUIRE_OK(ctx, loom_mesh_sizes_resolve(ctx, &want, world, &n));
        REQUIRE_OK(ctx, loom_mesh_check_model(ctx, &n, &cfg));
        const int edp = loom_mesh_edp(&n);
        loom_mem_in in = {.n = n, .adt = LOOM_BF16, .cuda = true, .micro_batch_size = 1,
                          .seq = 32, .n_micro = 2, .training = true};
        for (int p = 0; p < n.pp; p++) {
            loom_mem_report r;
            REQUIRE_OK(ctx, loom_memory_predict_stage(ctx, &cfg, &in, p, &r));
            const uint64_t X =
                (uint64_t)stage_experts(&plan, cfg.num_layers, n.pp, p) / (uint64_t)(n.ep * n.etp);
            CHECK_MSG(r.expert_numel == X, "fold %zu stage %d: %llu expert floats, want %llu", f, p,
                      (unsigned long long)r.expert_numel, (unsigned long long)X);
            CHECK_EQ_INT((int64_t)r.expert_weights, (int64_t)(X * (4 + esz)));
            CHECK_EQ_INT((int64_t)r.expert_grads, (int64_t)(X * 4));
            CHECK_EQ_INT((int64_t)r.expert_optim, (int64_t)((edp == 1 ? 2 : 3) * X / edp * 4));
            CHECK(r.moe_acts > 0 && r.acts > r.moe_acts);
            CHECK(r.weights > r.expert_weights && r.optim > r.expert_optim);
            /* the dense parameters (the router with them) are the fold's business
             * only through tp*cp*dp: the same for every fold of tp2 dp2 */
            if (n.tp == 2 && n.cp == 1 && n.dp == 2 && n.pp == 1) {
                const uint64_t dense = r.weights - r.expert_weights;
                if (!dense_ref) dense_ref = dense;
                CHECK_EQ_INT((int64_t)dense, (int64_t)dense_ref);
            }
        }
    }
    /* LoRA freezes the base: the experts keep their bf16 copy only */
    loom_mesh_sizes n = {.tp = 1, .cp = 1, .dp = 2, .pp = 1, .ep = 2, .etp = 1, .vpp = 1};
    loom_mem_in in = {.n = n, .adt = LOOM_BF16, .cuda = true, .lora_r = 4, .micro_batch_size = 1,
                      .seq = 32, .n_micro = 1, .training = true};
    for (int k = 0; k < LOOM_LORA_NMOD; k++) in.lora_target[k] = true;
    loom_mem_report r;
    REQUIRE_OK(ctx, loom_memory_predict_stage(ctx, &cfg, &in, 0, &r));
    const uint64_t X = (uint64_t)stage_experts(&plan, cfg.num_layers, 1, 0) / 2;
    CHECK_EQ_INT((int64_t)r.expert_weights, (int64_t)(X * esz));
    CHECK(r.expert_grads == 0 && r.expert_optim == 0);
    /* the experts' adapters (gate, up, down of each of this rank's E/2
     * experts, every layer sparse) shard over edp = 1, not over dp: the
     * moments and the gradient shard hold them whole, the dense adapters'
     * half */
    const uint64_t ax = (uint64_t)(cfg.num_layers * (cfg.num_experts / 2) * 3 * in.lora_r *
                                   (cfg.hidden_size + cfg.moe_intermediate_size));
    REQUIRE(r.grads > ax * 4);
    const uint64_t ad = r.grads / 4 - ax;
    CHECK_MSG(r.optim == 3 * 4 * ((ad + 1) / 2 + ax),
              "optimizer %llu bytes, want 3 x 4 x (%llu dense / 2 + %llu experts')",
              (unsigned long long)r.optim, (unsigned long long)ad, (unsigned long long)ax);
    loom_param_plan_free(&plan);
    loom_config_free(&cfg);
    loom_ctx_free(ctx);
}

/* loom_meta (MegatronModel.meta) of a MoE model: each tensor's block as a
 * rank of the fold holds it, and the memory of every stage. */
TEST(memory_meta_moe_local_shapes) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    loom_model_options o;
    loom_model_options_default(&o);
    o.tp = 2;
    o.ep = 2;
    o.etp = 2;
    o.pp = 2;
    o.sequence_parallel = 1;
    loom_meta_query q = {.world_size = 8, .micro_batch_size = 1, .seq_len = 32,
                         .num_micro_batches = 2};
    loom_meta *mt = NULL;
    REQUIRE_OK(ctx, loom_meta_create(ctx, dir, &o, &q, &mt));
    loom_model_info info;
    loom_meta_get_info(mt, &info);
    int seen = 0;
    for (int64_t i = 0; i < info.num_tensors; i++) {
        loom_param_info p;
        REQUIRE_OK(ctx, loom_meta_param_info(mt, i, &p));
        const int64_t *s = p.local_shape;
        if (!strcmp(p.name, "model.layers.3.mlp.experts.7.gate_proj.weight")) {
            CHECK(s[0] == 16 && s[1] == 64 && p.pp_stage == 1); /* rows / etp */
            seen++;
        } else if (!strcmp(p.name, "model.layers.0.mlp.experts.0.down_proj.weight")) {
            CHECK(s[0] == 64 && s[1] == 16 && p.pp_stage == 0); /* columns / etp */
            seen++;
        } else if (!strcmp(p.name, "model.layers.1.mlp.gate.weight")) {
            CHECK(s[0] == 8 && s[1] == 64); /* the router, replicated */
            seen++;
        } else if (!strcmp(p.name, "model.layers.1.self_attn.q_proj.weight")) {
            CHECK(s[0] == 32 && s[1] == 64); /* heads over tp */
            seen++;
        }
    }
    CHECK_EQ_INT(seen, 4);
    for (int p = 0; p < 2; p++) {
        loom_memory_estimate e;
        CHECK_OK(ctx, loom_meta_memory(mt, p, &e));
        CHECK(e.weights > 0 && e.total >= e.weights + e.grads + e.optimizer + e.activations);
    }
    loom_meta_free(mt);
    /* the checks come before anything is laid out */
    o.sequence_parallel = 0;
    CHECK_EQ_INT(loom_meta_create(ctx, dir, &o, &q, &mt), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "add --sequence-parallel");
    loom_ctx_free(ctx);
}

/* `loom inspect --mesh` of a MoE preset prints the fold and the experts'
 * share; a fold that does not fit is refused with its numbers. */
TEST(memory_inspect_mesh_moe) {
    char *out = NULL;
    const char *argv[] = {loom_test_bin(), "inspect", "--preset", "tiny-qwen3-moe", "--mesh",
                          "tp=2,dp=2,ep=2,etp=1,sp", NULL};
    CHECK_EQ_INT(loom_test_run(&out, argv), 0);
    CHECK_CONTAINS(out, "on mesh tp=2 cp=1 dp=2 pp=1 vpp=1 sp=on ep=2 etp=1 edp=2 (4 ranks)");
    CHECK_CONTAINS(out, "tp*cp*dp = 4 ranks folded as etp=1 x ep=2 x edp=2");
    CHECK_CONTAINS(out, "4 of 8 experts per MoE layer (ep=2), each of width 32 of 32 (etp=1)");
    /* 4 layers x 4 experts x 3 x 64 x 32 = 96 Ki floats: fp32 master and bf16 copy,
     * fp32 gradients, moments and gradient shard over edp 2 */
    CHECK_CONTAINS(out, "weights 576.00 KiB, gradients 384.00 KiB, optimizer 576.00 KiB "
                        "(sharded over edp=2)");
    free(out);
    const char *nosp[] = {loom_test_bin(), "inspect", "--preset", "tiny-qwen3-moe", "--mesh",
                          "tp=2,dp=2,ep=2", NULL};
    CHECK_EQ_INT(loom_test_run(&out, nosp), 1);
    CHECK_CONTAINS(out, "ep=2 with tp=2 needs sequence parallelism");
    free(out);
    const char *bad[] = {loom_test_bin(), "inspect", "--preset", "tiny-qwen3-moe", "--mesh",
                         "dp=2,ep=4", NULL};
    CHECK_EQ_INT(loom_test_run(&out, bad), 1);
    CHECK_CONTAINS(out, "ep=4 does not divide tp*cp*dp/etp = 2/1 = 2");
    free(out);
    const char *dense[] = {loom_test_bin(), "inspect", "--preset", "tiny-qwen3", "--mesh",
                           "dp=2,ep=2", NULL};
    CHECK_EQ_INT(loom_test_run(&out, dense), 1);
    CHECK_CONTAINS(out, "expert parallelism needs a mixture-of-experts model");
    free(out);
}

/* A capacity factor sizes the MoE buffers by the capacity (each expert's
 * kept choices) instead of the dropless worst case: the prediction still
 * equals the model's one allocation, and with a factor below 1 it is
 * smaller; on the expert fold (where dropless a rank's experts may get
 * every token of the ep group) a factor of 1 cuts it too. */
TEST(memory_prediction_moe_capacity) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    int32_t ids[48], tgt[48];
    for (int i = 0; i < 48; i++) ids[i] = (i * 37) % 1000, tgt[i] = (i * 53 + 1) % 1000;
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    uint64_t acts[2];
    for (int c = 0; c < 2; c++) {
        loom_model_options o;
        loom_model_options_default(&o);
        o.moe_expert_capacity_factor = c ? 0.5 : 0.0;
        loom_model *m = NULL;
        REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m));
        loom_fb_result r;
        REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 2, &r));
        loom_mem_in in = {.n = m->mesh->n, .adt = LOOM_F32, .micro_batch_size = 1, .seq = 24,
                          .n_micro = 2, .training = true, .moe_capacity_factor = c ? 0.5 : 0.0};
        loom_mem_report p;
        REQUIRE_OK(ctx, loom_memory_predict(ctx, &m->cfg, &in, &p));
        CHECK_EQ_INT((int64_t)p.acts, (int64_t)m->act_bytes);
        acts[c] = p.moe_acts;
        loom_model_free(m);
    }
    CHECK_MSG(acts[1] < acts[0], "MoE activations: dropless %llu, capacity 0.5 %llu",
              (unsigned long long)acts[0], (unsigned long long)acts[1]);
    /* ep 4 of tp 1 dp 4: each rank's experts can get 4 ranks' tokens dropless,
     * 4 x (2 experts x cap) with capacity */
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_load(ctx, dir, &cfg));
    loom_mesh_sizes want = {.tp = 1, .cp = 1, .dp = 4, .pp = 1, .ep = 4, .etp = 1}, n;
    REQUIRE_OK(ctx, loom_mesh_sizes_resolve(ctx, &want, 4, &n));
    uint64_t ep[2];
    for (int c = 0; c < 2; c++) {
        loom_mem_in in = {.n = n, .adt = LOOM_BF16, .cuda = true, .micro_batch_size = 1,
                          .seq = 4096, .n_micro = 1, .training = true,
                          .moe_capacity_factor = c ? 1.0 : 0.0};
        loom_mem_report r;
        REQUIRE_OK(ctx, loom_memory_predict_stage(ctx, &cfg, &in, 0, &r));
        ep[c] = r.moe_acts;
    }
    CHECK_MSG(ep[1] * 2 < ep[0], "ep4: MoE activations dropless %llu, capacity 1.0 %llu",
              (unsigned long long)ep[0], (unsigned long long)ep[1]);
    loom_config_free(&cfg);
    loom_ctx_free(ctx);
}

/* Qwen3.5's Gated DeltaNet layers on GPUs: the CUDA rule's workspace
 * (gdn_ws.h) is in the predicted workspace, once per rank, sized by the
 * heads a tp rank holds and the whole sequence (also under cp); nothing on
 * the CPU. The chunk bound the workspace is sized by holds for every split
 * of the tokens into documents. */
TEST(memory_prediction_gdn_workspace) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_load(ctx, "tests/fixtures_qwen3_5/models/tiny-qwen3_5", &cfg));
    REQUIRE(loom_config_linear_layers(&cfg) > 0);
    const int64_t mbs = 2, seq = 200, T = mbs * seq, NC = mbs * ((seq + 63) / 64);
    bool *lin = cfg.linear_attn;
    struct {
        int tp, cp;
        bool cuda, training;
    } cases[] = {{1, 1, true, true}, {2, 1, true, true}, {1, 2, true, true},
                 {1, 1, true, false}, {1, 1, false, true}};
    uint64_t delta[5];
    for (size_t i = 0; i < 5; i++) {
        loom_mesh_sizes want = {.tp = cases[i].tp, .cp = cases[i].cp, .dp = 1, .pp = 1},
                        n;
        REQUIRE_OK(ctx, loom_mesh_sizes_resolve(ctx, &want, cases[i].tp * cases[i].cp, &n));
        loom_mem_in in = {.n = n, .adt = LOOM_BF16, .cuda = cases[i].cuda, .micro_batch_size = mbs,
                          .seq = seq, .n_micro = 1, .training = cases[i].training};
        loom_mem_report with, without;
        cfg.linear_attn = lin;
        REQUIRE_OK(ctx, loom_memory_predict_stage(ctx, &cfg, &in, 0, &with));
        cfg.linear_attn = NULL; /* every layer full attention: the same rows otherwise */
        REQUIRE_OK(ctx, loom_memory_predict_stage(ctx, &cfg, &in, 0, &without));
        delta[i] = with.work - without.work;
        CHECK_EQ_INT((int64_t)(with.total - without.total - (with.acts - without.acts) -
                               (with.weights - without.weights) - (with.grads - without.grads) -
                               (with.optim - without.optim)),
                     (int64_t)delta[i]);
    }
    cfg.linear_attn = lin;
    const int64_t Hv = cfg.lin_v_heads, dk = cfg.lin_k_dim, dv = cfg.lin_v_dim;
    const uint64_t state = (uint64_t)(NC * Hv * dk * dv * 2);
    /* bf16 with tiny heads: the tensor-core kernels, the forward's arrays in
     * the layers' keep buffers (room for this batch's chunks), so the
     * workspace holds the states' gradients (bf16) but not the states;
     * a forward keeps no gradient; tp halves the heads; cp keeps the whole
     * sequence */
    const int64_t kc = loom_gdn_keep_chunks(T);
    REQUIRE(loom_gdn_ws_tc(LOOM_BF16, dk) && loom_gdn_ws_chunks(T, mbs) <= kc);
    CHECK_MSG(delta[0] >= state && delta[0] < state + (uint64_t)T * 1024 * 64,
              "GDN workspace %llu bytes, states %llu", (unsigned long long)delta[0],
              (unsigned long long)state);
    CHECK_EQ_INT((int64_t)delta[0], (int64_t)loom_gdn_ws_bytes(T, cfg.lin_k_heads, Hv, dk, dv,
                                                               mbs, 1, 1, kc));
    /* without the keep buffers the workspace would hold the bf16 states too */
    CHECK(delta[0] + state <= loom_gdn_ws_bytes(T, cfg.lin_k_heads, Hv, dk, dv, mbs, 1, 1, 0));
    CHECK(delta[1] < delta[0] && delta[1] * 2 >= delta[0] - 4096);
    CHECK_EQ_INT((int64_t)delta[2], (int64_t)delta[0]);
    CHECK(delta[3] < delta[0] - state + 4096);
    CHECK_EQ_INT((int64_t)delta[4], 0);
    /* the keep buffer: a linear-attention layer's activations on CUDA in
     * bf16 hold it (the states in bf16 and T = (I + A)^-1 for kc chunks at
     * least), on the CPU nothing */
    loom_model m;
    memset(&m, 0, sizeof m);
    m.cfg = cfg;
    m.tp = 1;
    m.dev.adt = LOOM_BF16;
    m.dev.esz = 2;
    size_t acts[2] = {0, 0};
    for (int cuda = 0; cuda < 2; cuda++) {
        loom_block_buf buf[LOOM_BLOCK_MAX_BUFS];
        memset(buf, 0, sizeof buf);
        m.dev.cuda = cuda;
        const int n = loom_block_gdn.acts(&m, T, T, T, buf);
        for (int k = 0; k < n; k++) acts[cuda] += buf[k].bytes;
    }
    const size_t keep = loom_gdn_keep_bytes(T, cfg.lin_k_heads, Hv, dk, dv, 1, kc);
    CHECK_EQ_INT((int64_t)(acts[1] - acts[0]), (int64_t)keep);
    CHECK(keep >= (size_t)(kc * Hv * (dk * dv + 64 * 64)) * 2);
    /* the chunk bound, against counted chunks of random document splits */
    uint32_t s = 7;
    for (int trial = 0; trial < 200; trial++) {
        const int64_t TT = 1 + trial * 7;
        int64_t t = 0, docs = 0, chunks = 0;
        while (t < TT) {
            s = s * 1664525u + 1013904223u;
            int64_t len = 1 + (int64_t)(s >> 8) % (trial % 3 == 0 ? 3 : 150);
            if (len > TT - t) len = TT - t;
            chunks += (len + 63) / 64, docs++, t += len;
        }
        CHECK_MSG(chunks <= loom_gdn_ws_chunks(TT, docs), "T %lld, %lld documents: %lld chunks > %lld",
                  (long long)TT, (long long)docs, (long long)chunks,
                  (long long)loom_gdn_ws_chunks(TT, docs));
    }
    loom_config_free(&cfg);
    loom_ctx_free(ctx);
}
