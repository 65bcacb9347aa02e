/* Freezing base tensors in full fine-tuning (loom_model_set_trainable):
 * frozen tensors keep their values and get no gradient; the others take
 * exactly the step they would take with nothing frozen (no clipping, so the
 * norm over fewer tensors does not matter); the gradient buffer shrinks by
 * the frozen tensors; bad calls are refused. CPU, and CUDA in fp32 where a
 * GPU is visible. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../include/loom.h"
#include "../src/model/model.h"
#include "harness.h"

static const char *frozen_names[] = {"model.layers.0.mlp.up_proj.weight",
                                     "model.layers.1.self_attn.q_norm.weight",
                                     "model.embed_tokens.weight"};
enum { NFROZEN = 3 };

static bool is_frozen(const char *name) {
    for (int i = 0; i < NFROZEN; i++)
        if (!strcmp(name, frozen_names[i])) return true;
    return false;
}

static int64_t numel(const int64_t sh[2], int nd) { return nd == 2 ? sh[0] * sh[1] : sh[0]; }

/* dt: the compute dtype; bf16 (GPU only) keeps the base's fp32 master in
 * host memory until training starts, so its layout moves host and device
 * buffers apart. Its gradients and steps are compared loosely (the
 * attention backward's atomics differ run to run), frozen tensors exactly. */
static void check_freeze_in(loom_device dev, loom_dtype dt, const char *dir) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = dev;
    o.dtype = dt;
    const double gtol = dt == LOOM_F32 ? 1e-6 : 2e-2, wtol = dt == LOOM_F32 ? 1e-6 : 2.5e-2;
    enum { R = 2, S = 16 };
    int32_t ids[R * S], tgt[R * S];
    for (int i = 0; i < R * S; i++) ids[i] = (i * 37 + 11) % 1000;
    for (int i = 0; i < R * S; i++) tgt[i] = (i + 1) % S ? ids[i + 1] : -100;
    loom_batch b = {.rows = R, .seq_len = S, .input_ids = ids, .targets = tgt};
    loom_optimizer_config oc = loom_optimizer_config_default();
    oc.lr = 1e-2;
    loom_model *m[2];
    for (int k = 0; k < 2; k++) { /* 0: all trained, 1: some frozen */
        REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m[k]));
        REQUIRE_OK(ctx, loom_model_set_optimizer(m[k], &oc));
    }
    const size_t grads_before = m[1]->base.ngrad;
    for (int i = 0; i < NFROZEN; i++) REQUIRE_OK(ctx, loom_model_set_trainable(m[1], frozen_names[i], 0));
    /* unfreezing and freezing again lays the arena out twice: same result */
    REQUIRE_OK(ctx, loom_model_set_trainable(m[1], frozen_names[1], 1));
    REQUIRE_OK(ctx, loom_model_set_trainable(m[1], frozen_names[1], 0));
    CHECK(m[1]->base.ngrad < grads_before);
    CHECK_EQ_INT(m[1]->base.nparams >= grads_before, 1);
    loom_model_info info;
    loom_model_get_info(m[1], &info);
    for (int64_t i = 0; i < info.num_tensors; i++) {
        loom_param_info pi;
        REQUIRE_OK(ctx, loom_model_param_info(m[1], i, &pi));
        CHECK_EQ_INT(pi.trainable, !is_frozen(pi.name));
    }
    loom_step_result sr[2];
    for (int k = 0; k < 2; k++) {
        REQUIRE_OK(ctx, loom_model_forward_backward(m[k], &b, 1, NULL));
    }
    /* gradients: the frozen ones zero, the others as with nothing frozen */
    double sq = 0.0;
    float *w0 = NULL, *w1 = NULL, *g0 = NULL, *g1 = NULL, *init = NULL;
    for (int64_t i = 0; i < info.num_tensors; i++) {
        int nd;
        int64_t sh[2];
        const char *name = loom_model_tensor_name(m[0], i, &nd, sh);
        const int64_t n = numel(sh, nd);
        g0 = realloc(g0, (size_t)n * sizeof *g0);
        g1 = realloc(g1, (size_t)n * sizeof *g1);
        REQUIRE_OK(ctx, loom_model_get_grad(m[0], name, g0, n));
        REQUIRE_OK(ctx, loom_model_get_grad(m[1], name, g1, n));
        double d = 0.0, z = 0.0;
        for (int64_t j = 0; j < n; j++) {
            d = fmax(d, fabs((double)g0[j] - g1[j]));
            z = fmax(z, fabs((double)g1[j]));
            if (!is_frozen(name)) sq += (double)g0[j] * g0[j];
        }
        if (is_frozen(name)) CHECK_MSG(z == 0.0, "%s: frozen, gradient %g", name, z);
        else CHECK_MSG(d <= gtol, "%s: gradient differs by %g", name, d);
    }
    for (int k = 0; k < 2; k++) REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m[k], 0.0, 1, &sr[k]));
    CHECK_NEAR(sr[1].grad_norm, sqrt(sq), (dt == LOOM_F32 ? 1e-5 : 2e-2) * sqrt(sq));
    CHECK_NEAR(sr[1].loss, sr[0].loss, dt == LOOM_F32 ? 1e-9 : 1e-3);
    /* after the step: frozen tensors as loaded, the others as with nothing frozen */
    loom_model *fresh;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &fresh));
    for (int64_t i = 0; i < info.num_tensors; i++) {
        int nd;
        int64_t sh[2];
        const char *name = loom_model_tensor_name(m[0], i, &nd, sh);
        const int64_t n = numel(sh, nd);
        w0 = realloc(w0, (size_t)n * sizeof *w0);
        w1 = realloc(w1, (size_t)n * sizeof *w1);
        init = realloc(init, (size_t)n * sizeof *init);
        REQUIRE_OK(ctx, loom_model_get_param(m[0], name, w0, n));
        REQUIRE_OK(ctx, loom_model_get_param(m[1], name, w1, n));
        REQUIRE_OK(ctx, loom_model_get_param(fresh, name, init, n));
        const float *want = is_frozen(name) ? init : w0;
        double d = 0.0;
        for (int64_t j = 0; j < n; j++) d = fmax(d, fabs((double)want[j] - w1[j]));
        CHECK_MSG(d <= (is_frozen(name) ? 0.0 : wtol), "%s: differs by %g after the step", name, d);
    }
    /* a second step trains on (no stale gradient of a frozen slot) */
    REQUIRE_OK(ctx, loom_model_forward_backward(m[1], &b, 1, NULL));
    REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m[1], 1.0, 1, &sr[1]));
    CHECK(isfinite(sr[1].grad_norm) && sr[1].grad_norm > 0);
    /* refused: after training began, unknown names, with adapters */
    loom_status st = loom_model_set_trainable(m[1], frozen_names[0], 1);
    CHECK_EQ_INT(st, LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "before the first forward_backward");
    st = loom_model_set_trainable(fresh, "model.layers.9.mlp.up_proj.weight", 0);
    CHECK_EQ_INT(st, LOOM_ERR_NOT_FOUND);
    loom_lora_config lc = {.r = 2};
    REQUIRE_OK(ctx, loom_model_add_adapter(fresh, "a", &lc));
    st = loom_model_set_trainable(fresh, frozen_names[0], 0);
    CHECK_EQ_INT(st, LOOM_ERR_UNSUPPORTED);
    free(w0), free(w1), free(g0), free(g1), free(init);
    loom_model_free(fresh);
    for (int k = 0; k < 2; k++) loom_model_free(m[k]);
    loom_ctx_free(ctx);
}

static void check_freeze(loom_device dev, loom_dtype dt) {
    if (dev == LOOM_DEVICE_CUDA && !loom_test_have_gpu()) {
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return;
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3", loom_test_fixtures());
    check_freeze_in(dev, dt, dir);
}

/* tiny-qwen3 saved in bf16 (dir16), and those values widened to fp32 (dir32) */
static void save_bf16_copies(loom_ctx *ctx, char *dir16, char *dir32, size_t cap) {
    char src[1024];
    snprintf(src, sizeof src, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(dir16, cap, "%s/tiny-qwen3-bf16", loom_test_tmpdir());
    snprintf(dir32, cap, "%s/tiny-qwen3-bf16-widened", loom_test_tmpdir());
    loom_model_options o;
    loom_model_options_default(&o);
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, src, &o, &m));
    REQUIRE_OK(ctx, loom_model_save_hf(m, dir16, LOOM_BF16, 0));
    loom_model_free(m);
    REQUIRE_OK(ctx, loom_model_create(ctx, dir16, &o, &m));
    REQUIRE_OK(ctx, loom_model_save_hf(m, dir32, LOOM_F32, 0));
    loom_model_free(m);
}

/* Every parameter of x and y within tol (0: the same bits). */
static void check_same_params(loom_ctx *ctx, loom_model *x, loom_model *y, double tol,
                              const char *when) {
    loom_model_info info;
    loom_model_get_info(x, &info);
    float *a = NULL, *b = NULL;
    for (int64_t i = 0; i < info.num_tensors; i++) {
        int nd;
        int64_t sh[2];
        const char *name = loom_model_tensor_name(x, i, &nd, sh);
        const int64_t n = numel(sh, nd);
        a = realloc(a, (size_t)n * sizeof *a);
        b = realloc(b, (size_t)n * sizeof *b);
        REQUIRE_OK(ctx, loom_model_get_param(x, name, a, n));
        REQUIRE_OK(ctx, loom_model_get_param(y, name, b, n));
        double d = 0.0;
        for (int64_t j = 0; j < n; j++) d = fmax(d, fabs((double)a[j] - b[j]));
        if (tol == 0.0) CHECK_MSG(!memcmp(a, b, (size_t)n * sizeof *a), "%s: differs %s", name, when);
        else CHECK_MSG(d <= tol, "%s: differs by %g %s", name, d, when);
    }
    free(a), free(b);
}

/* A GPU model whose checkpoint is in its compute dtype loads straight into
 * the compute copy, with no fp32 master anywhere: the same values as the
 * host master's path (the widened file), the master widened exactly when
 * full fine-tuning starts, and none at all once LoRA freezes the base. */
TEST(cuda_base_loaded_in_compute_dtype) {
    if (!loom_test_have_gpu()) {
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return;
    }
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir16[1024], dir32[1024];
    save_bf16_copies(ctx, dir16, dir32, sizeof dir16);
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = LOOM_DEVICE_CUDA;
    o.dtype = LOOM_BF16;
    loom_model *m16, *m32, *lora;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir16, &o, &m16));
    REQUIRE_OK(ctx, loom_model_create(ctx, dir32, &o, &m32));
    REQUIRE_OK(ctx, loom_model_create(ctx, dir16, &o, &lora));
    CHECK(m16->base.w == NULL && m16->base.w_in_wc);
    CHECK(m32->base.w != NULL && !m32->base.w_on_dev && !m32->base.w_in_wc);
    check_same_params(ctx, m16, m32, 0.0, "as loaded"); /* bit for bit */
    enum { R = 2, S = 16 };
    int32_t ids[R * S], tgt[R * S];
    for (int i = 0; i < R * S; i++) ids[i] = (i * 29 + 5) % 1000;
    for (int i = 0; i < R * S; i++) tgt[i] = (i + 1) % S ? ids[i + 1] : -100;
    loom_batch bt = {.rows = R, .seq_len = S, .input_ids = ids, .targets = tgt};
    loom_optimizer_config oc = loom_optimizer_config_default();
    oc.lr = 1e-3;
    loom_step_result r16, r32;
    loom_model *ms[2] = {m16, m32};
    loom_step_result *rs[2] = {&r16, &r32};
    for (int k = 0; k < 2; k++) {
        REQUIRE_OK(ctx, loom_model_set_optimizer(ms[k], &oc));
        REQUIRE_OK(ctx, loom_model_forward_backward(ms[k], &bt, 1, NULL));
        REQUIRE_OK(ctx, loom_model_clip_grad_and_step(ms[k], 1.0, 1, rs[k]));
    }
    CHECK(m16->base.w != NULL && m16->base.w_on_dev && !m16->base.w_in_wc);
    CHECK_NEAR(r16.loss, r32.loss, 1e-6 * fabs(r32.loss));
    CHECK_NEAR(r16.grad_norm, r32.grad_norm, 1e-2 * r32.grad_norm);
    /* one AdamW step from the same master: an element moves by at most ~lr,
     * and gradients' run-to-run rounding (attention's atomics) can flip a
     * tiny one's direction, no more */
    check_same_params(ctx, m16, m32, 2.5 * oc.lr, "after one step");
    loom_lora_config lc = {.r = 2};
    REQUIRE_OK(ctx, loom_model_add_adapter(lora, "a", &lc));
    CHECK(lora->base.w == NULL && !lora->base.w_in_wc);
    REQUIRE_OK(ctx, loom_model_set_optimizer(lora, &oc));
    loom_step_result rl;
    REQUIRE_OK(ctx, loom_model_forward_backward(lora, &bt, 1, NULL));
    REQUIRE_OK(ctx, loom_model_clip_grad_and_step(lora, 1.0, 1, &rl));
    CHECK_NEAR(rl.loss, r32.loss, 1e-6 * fabs(r32.loss)); /* B = 0: the base's loss */
    CHECK(lora->base.w == NULL); /* no master for a frozen base */
    loom_model_free(lora);
    loom_model_free(m32);
    loom_model_free(m16);
    loom_ctx_free(ctx);
}

/* Freezing a base loaded straight into its bf16 compute copy: the layout
 * moves the compute copy only, and the master widened at the first step
 * holds the moved values. */
TEST(cuda_freeze_tensors_bf16_checkpoint) {
    if (!loom_test_have_gpu()) {
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return;
    }
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    char dir16[1024], dir32[1024];
    save_bf16_copies(ctx, dir16, dir32, sizeof dir16);
    loom_ctx_free(ctx);
    check_freeze_in(LOOM_DEVICE_CUDA, LOOM_BF16, dir16);
}

TEST(freeze_tensors_in_full_fine_tuning) { check_freeze(LOOM_DEVICE_CPU, LOOM_F32); }
TEST(cuda_freeze_tensors_in_full_fine_tuning) { check_freeze(LOOM_DEVICE_CUDA, LOOM_F32); }
TEST(cuda_freeze_tensors_in_full_fine_tuning_bf16) { check_freeze(LOOM_DEVICE_CUDA, LOOM_BF16); }
