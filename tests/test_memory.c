/* The memory prediction (loom_memory_predict, `loom inspect --mesh`, the
 * line every run prints) against what the model really allocates: the
 * parameter and gradient buffers, the optimizer's block and the one
 * activation allocation, on CPU and (skipped without one) on a GPU. */
#include <stdlib.h>

#include "../include/loom.h"
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
