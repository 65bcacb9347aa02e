/* LoRA on a mixture of experts (tiny-qwen3-moe): an adapter on every
 * expert's gate/up/down (PEFT's mlp.experts.<e>.<module> names) and on the
 * router (mlp.gate, only when named) saved and read back, its forward equal
 * to the merged model's, and its gradients against central differences of
 * the loss. */
#include <stdlib.h>
#include <string.h>

#include "../include/loom.h"
#include "../src/io/safetensors.h"
#include "../src/model/model.h"
#include "harness.h"

static bool fixture_batch(loom_ctx *ctx, int32_t *ids, int32_t *tgt) {
    char p[1024];
    snprintf(p, sizeof p, "%s/golden/tiny-qwen3-moe.safetensors", loom_test_fixtures());
    loom_safetensors *st = NULL;
    bool ok = !loom_st_open_file(ctx, p, &st) &&
              !loom_st_read(ctx, loom_st_find(st, "input_ids"), LOOM_I32, ids, 48) &&
              !loom_st_read(ctx, loom_st_find(st, "targets"), LOOM_I32, tgt, 48);
    loom_st_close(st);
    return ok;
}

static loom_model *moe_model(loom_ctx *ctx, double aux_coef) {
    char dir[1024], ov[128];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    snprintf(ov, sizeof ov, "{\"router_aux_loss_coef\": %g}", aux_coef);
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = ov;
    loom_model *m = NULL;
    if (loom_model_create(ctx, dir, &o, &m)) return NULL;
    return m;
}

/* An all-linear adapter with the router (r 4) trained 3 steps (so B is not
 * zero), saved. */
static bool make_moe_adapter(loom_ctx *ctx, const char *dir, float *logits) {
    int32_t ids[48], tgt[48];
    loom_model *m = moe_model(ctx, 0.01);
    loom_lora_config c = {.r = 4, .lora_alpha = 8, .target_modules = "all-linear,gate", .seed = 7};
    loom_optimizer_config oc = {.lr = 2e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    bool ok = m && fixture_batch(ctx, ids, tgt) && !loom_model_add_adapter(m, "a", &c) &&
              !loom_model_set_optimizer(m, &oc);
    for (int s = 0; ok && s < 3; s++) {
        loom_fb_result fr;
        loom_step_result sr;
        ok = !loom_model_forward_backward(m, &b, 1, &fr) &&
             !loom_model_clip_grad_and_step(m, 1.0, 1, &sr);
    }
    ok = ok && !loom_model_forward_only(m, &b, 1, NULL, NULL, logits, NULL) &&
         !loom_model_save_adapter(m, "a", dir, LOOM_F32);
    loom_model_free(m);
    return ok;
}

/* The largest |value| of a (small) tensor of the file; 0 when absent. */
static double max_abs(loom_ctx *ctx, const loom_st_tensor *t) {
    float v[256];
    double mx = 0.0;
    if (!t || t->numel > 256 || loom_st_read(ctx, t, LOOM_F32, v, t->numel)) return 0.0;
    for (uint64_t i = 0; i < t->numel; i++) mx = fmax(mx, fabs(v[i]));
    return mx;
}

TEST(lora_moe_experts_save_reload_and_merge) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/moe-adapter", loom_test_tmpdir());
    float *want = malloc(48 * 1024 * sizeof *want), *got = malloc(48 * 1024 * sizeof *got);
    if (!make_moe_adapter(ctx, dir, want)) {
        loom_test_fail(__FILE__, __LINE__, "making the adapter: %s", loom_last_error(ctx));
        return;
    }
    /* PEFT's names: per expert; 4 layers x (4 attention + 8 experts x 3 +
     * the router) x 2 */
    char p[1100];
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    loom_safetensors *st = NULL;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, p, &st));
    CHECK_EQ_INT(loom_st_count(st), 4 * (4 + 8 * 3 + 1) * 2);
    const loom_st_tensor *rt =
        loom_st_find(st, "base_model.model.model.layers.3.mlp.gate.lora_B.weight");
    CHECK(rt && rt->ndim == 2 && rt->shape[0] == 8 && rt->shape[1] == 4);
    const double rmax = max_abs(ctx, rt);
    CHECK_MSG(rmax > 1e-4, "the router's B did not train (max %g)", rmax);
    const loom_st_tensor *t =
        loom_st_find(st, "base_model.model.model.layers.2.mlp.experts.5.down_proj.lora_A.weight");
    CHECK(t && t->ndim == 2 && t->shape[0] == 4 && t->shape[1] == 32);
    t = loom_st_find(st, "base_model.model.model.layers.2.mlp.experts.5.gate_proj.lora_B.weight");
    CHECK(t && t->shape[0] == 32 && t->shape[1] == 4);
    const double bmax = max_abs(ctx, t);
    CHECK_MSG(bmax > 1e-4, "the experts' B did not train (max %g)", bmax);
    loom_st_close(st);
    /* read back onto a fresh model: the same logits; merged: the same again */
    int32_t ids[48], tgt[48];
    REQUIRE(fixture_batch(ctx, ids, tgt));
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    loom_model *m = moe_model(ctx, 0.01);
    REQUIRE(m);
    REQUIRE_OK(ctx, loom_model_load_adapter(m, "a", dir));
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, got, NULL));
    double e = 0.0, mx = 0.0;
    for (int i = 0; i < 48 * 1024; i++) e = fmax(e, fabs(got[i] - want[i])), mx = fmax(mx, fabs(want[i]));
    CHECK_MSG(e <= 1e-6 * mx, "reloaded adapter: logits differ by %.3g", e / mx);
    REQUIRE_OK(ctx, loom_model_merge_adapter(m, "a"));
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, got, NULL));
    e = 0.0;
    for (int i = 0; i < 48 * 1024; i++) e = fmax(e, fabs(got[i] - want[i]));
    CHECK_MSG(e <= 1e-5 * mx, "merged adapter: logits differ by %.3g", e / mx);
    loom_model_free(m);
    free(want), free(got);
    loom_ctx_free(ctx);
}

/* The experts' A and B gradients against central differences of the loss
 * (the aux loss on too: it reaches them through the later layers' routing);
 * elements whose step changes some token's experts are skipped. */
TEST(lora_moe_experts_gradient_matches_differences) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/moe-adapter-fd", loom_test_tmpdir());
    float *scratch = malloc(48 * 1024 * sizeof *scratch);
    if (!make_moe_adapter(ctx, dir, scratch)) {
        loom_test_fail(__FILE__, __LINE__, "making the adapter: %s", loom_last_error(ctx));
        return;
    }
    free(scratch);
    int32_t ids[48], tgt[48];
    REQUIRE(fixture_batch(ctx, ids, tgt));
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    loom_model *m = moe_model(ctx, 0.5);
    REQUIRE(m);
    REQUIRE_OK(ctx, loom_model_load_adapter(m, "a", dir));
    loom_fb_result r;
    loom_model_zero_grad(m);
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r));
    const int64_t L = m->L, R = 48 * m->cfg.num_experts_per_tok;
    const loom_acts *a = &m->chunks[0].pool[0];
    int32_t *idx0 = malloc((size_t)(L * R) * 4), *idx = malloc((size_t)(L * R) * 4);
    for (int64_t l = 0; l < L; l++) memcpy(idx0 + l * R, a->lay[l].act[1][1], (size_t)R * 4);
    const char *names[] = {
        "base_model.model.model.layers.1.mlp.experts.2.gate_proj.lora_A.weight",
        "base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_B.weight",
        "base_model.model.model.layers.3.mlp.experts.6.down_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.experts.4.down_proj.lora_B.weight",
        "base_model.model.model.layers.2.mlp.gate.lora_A.weight",
        "base_model.model.model.layers.1.mlp.gate.lora_B.weight"};
    int checked = 0, tried = 0;
    double worst = 0.0;
    for (int k = 0; k < 6; k++) {
        loom_arena *ar;
        char key[256];
        int64_t rows, cols;
        REQUIRE_OK(ctx, loom_lora_find(m, names[k], &ar, key, sizeof key, &rows, &cols));
        int s = -1;
        for (int i = 0; i < ar->nslots; i++)
            if (!strcmp(ar->slots[i].name, key)) s = i;
        REQUIRE(s >= 0);
        const int64_t n = rows * cols;
        float *grad = malloc(sizeof(float) * (size_t)n), *w = ar->w + ar->slots[s].off;
        REQUIRE_OK(ctx, loom_model_get_grad(m, names[k], grad, n));
        float gmax = 0.0f;
        for (int64_t i = 0; i < n; i++) gmax = fmaxf(gmax, fabsf(grad[i]));
        CHECK_MSG(gmax > 0.0f, "%s: no gradient", names[k]);
        for (int64_t i = 0; i < n; i += n / 10 + 1) {
            /* the router's: a smaller step, most of a larger one's moves
             * some token to another expert */
            const float w0 = w[i], h = strstr(names[k], ".mlp.gate.") ? 3e-3f : 1e-2f;
            double f[2];
            bool flip = false;
            for (int sg = 0; sg < 2; sg++) {
                w[i] = w0 + (sg ? -h : h);
                REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, &r));
                f[sg] = r.loss;
                for (int64_t l = 0; l < L; l++) memcpy(idx + l * R, a->lay[l].act[1][1], (size_t)R * 4);
                flip |= memcmp(idx, idx0, (size_t)(L * R) * 4) != 0;
            }
            w[i] = w0;
            tried++;
            if (flip) continue;
            checked++;
            worst = fmax(worst, fabs((f[0] - f[1]) / (2.0 * h) - grad[i]) / gmax);
        }
        free(grad);
    }
    CHECK_MSG(checked >= tried / 2, "only %d of %d elements away from a change of experts",
              checked, tried);
    CHECK_MSG(worst < 3e-3, "expert LoRA gradient off by %.3g of the tensor's largest", worst);
    free(idx0), free(idx);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

/* The experts' LoRA on a GPU (fp32) against the CPU: loss and every
 * adapter gradient. */
TEST(lora_moe_cuda_matches_cpu) {
    if (!loom_test_have_gpu()) SKIP("no GPU visible (or loom built without CUDA)");
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024], mdir[1024];
    snprintf(dir, sizeof dir, "%s/moe-adapter-cuda", loom_test_tmpdir());
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    float *scratch = malloc(48 * 1024 * sizeof *scratch);
    bool made = make_moe_adapter(ctx, dir, scratch);
    free(scratch);
    if (!made) {
        loom_test_fail(__FILE__, __LINE__, "making the adapter: %s", loom_last_error(ctx));
        return;
    }
    int32_t ids[48], tgt[48];
    REQUIRE(fixture_batch(ctx, ids, tgt));
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    loom_model *m[2] = {NULL, NULL};
    loom_fb_result r[2];
    for (int d = 0; d < 2; d++) {
        loom_model_options o;
        loom_model_options_default(&o);
        o.device = d ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU;
        o.config_overrides = "{\"router_aux_loss_coef\": 0.5}";
        REQUIRE_OK(ctx, loom_model_create(ctx, mdir, &o, &m[d]));
        REQUIRE_OK(ctx, loom_model_load_adapter(m[d], "a", dir));
        loom_model_zero_grad(m[d]);
        REQUIRE_OK(ctx, loom_model_forward_backward(m[d], &b, 1, &r[d]));
    }
    CHECK_MSG(fabs(r[1].loss - r[0].loss) <= 1e-5 * r[0].loss, "loss %.9g (GPU) vs %.9g (CPU)",
              r[1].loss, r[0].loss);
    char name[256];
    int64_t shape[2];
    double worst = 0.0;
    int n = 0;
    for (int64_t i = 0; loom_model_adapter_tensor(m[0], "a", i, name, sizeof name, shape); i++, n++) {
        const int64_t k = shape[0] * shape[1];
        float *g0 = malloc(sizeof(float) * (size_t)k), *g1 = malloc(sizeof(float) * (size_t)k);
        REQUIRE_OK(ctx, loom_model_get_grad(m[0], name, g0, k));
        REQUIRE_OK(ctx, loom_model_get_grad(m[1], name, g1, k));
        double d = 0.0, mx = 0.0;
        for (int64_t j = 0; j < k; j++) d = fmax(d, fabs(g1[j] - g0[j])), mx = fmax(mx, fabs(g0[j]));
        if (mx > 0) worst = fmax(worst, d / mx);
        free(g0), free(g1);
    }
    CHECK_EQ_INT(n, 4 * (4 + 8 * 3 + 1) * 2);
    CHECK_MSG(worst <= 1e-4, "an adapter gradient differs by %.3g of its largest", worst);
    for (int d = 0; d < 2; d++) loom_model_free(m[d]);
    loom_ctx_free(ctx);
}

/* Refused with the reason: dropout on the experts' LoRA; an adapter file
 * naming an expert the model does not have; a load-balancing form loom
 * does not know. */
TEST(lora_moe_bad_inputs_are_refused) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    loom_model *m = moe_model(ctx, 0.01);
    REQUIRE(m);
    loom_lora_config c = {.r = 4, .lora_alpha = 8, .lora_dropout = 0.1,
                          .target_modules = "all-linear", .seed = 7};
    CHECK(loom_model_add_adapter(m, "d", &c) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "lora_dropout=0.1 on the experts is not supported");
    c.target_modules = "q_proj,v_proj"; /* without the experts: dropout is fine */
    CHECK_OK(ctx, loom_model_add_adapter(m, "d", &c));
    /* the router only when named: all-linear leaves it out */
    c.lora_dropout = 0.0;
    c.target_modules = "all-linear";
    CHECK_OK(ctx, loom_model_add_adapter(m, "all", &c));
    char tn[256];
    int64_t tsh[2];
    int nall = 0, ngate = 0;
    for (int64_t i = 0; loom_model_adapter_tensor(m, "all", i, tn, sizeof tn, tsh); i++, nall++)
        ngate += strstr(tn, ".mlp.gate.") != NULL;
    CHECK_EQ_INT(nall, 4 * (4 + 8 * 3) * 2);
    CHECK_EQ_INT(ngate, 0);
    c.target_modules = "gate";
    CHECK_OK(ctx, loom_model_add_adapter(m, "router", &c));
    nall = 0;
    for (int64_t i = 0; loom_model_adapter_tensor(m, "router", i, tn, sizeof tn, tsh); i++, nall++)
        CHECK_CONTAINS(tn, ".mlp.gate.lora_");
    CHECK_EQ_INT(nall, 4 * 2);
    c.target_modules = "gate,all-linear,nonsense";
    CHECK(loom_model_add_adapter(m, "x", &c) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "'nonsense' is not one loom knows");
    /* an adapter with an expert index past the model's 8 */
    char dir[1024], p[1100];
    snprintf(dir, sizeof dir, "%s/moe-bad-adapter", loom_test_tmpdir());
    float *scratch = malloc(48 * 1024 * sizeof *scratch);
    bool made = make_moe_adapter(ctx, dir, scratch);
    free(scratch);
    REQUIRE(made);
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    loom_st_writer *w = NULL;
    float a[4 * 64] = {0};
    int64_t sh[2] = {4, 64};
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "adapter_model", 0, NULL, &w));
    const char *bad = "base_model.model.model.layers.0.mlp.experts.99.gate_proj.lora_A.weight";
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, bad, LOOM_F32, 2, sh));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, bad, LOOM_F32, a));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    CHECK(loom_model_load_adapter(m, "bad", dir) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "experts.99.gate_proj.lora_A.weight is not a LoRA weight");
    loom_model_free(m);
    /* loom_model_options.moe_aux out of range */
    char mdir[1024];
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    loom_model_options o;
    loom_model_options_default(&o);
    o.moe_aux = 7;
    CHECK(loom_model_create(ctx, mdir, &o, &m) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "moe_aux = 7: use LOOM_MOE_AUX_GLOBAL");
    loom_ctx_free(ctx);
}
