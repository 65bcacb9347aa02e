/* The training API beyond the HF comparison (test_model.c): accumulation
 * and micro-batching invariance, the schedule inside the trainer, HF export
 * and reload, config overrides, and every bad input the issue names. */
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/model/model.h"
#include "../src/model/params.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx)) return NULL;
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    return ctx;
}

static const char *fixture_model(const char *name) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/models/%s", loom_test_fixtures(), name);
    return buf;
}

/* A deterministic batch of `rows` x `seq` tokens below `vocab`. */
static void make_batch(int64_t rows, int64_t seq, int64_t vocab, uint32_t seed, int32_t *ids,
                       int32_t *tgt) {
    uint32_t x = seed * 2654435761u + 1;
    for (int64_t i = 0; i < rows * seq; i++) {
        x = x * 1664525u + 1013904223u;
        ids[i] = (int32_t)((x >> 8) % (uint32_t)vocab);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = 0; t < seq; t++)
            tgt[r * seq + t] = t + 1 < seq ? ids[r * seq + t + 1] : -100;
    tgt[1] = -100; /* an ignored target inside a row */
}

static double max_rel(const float *a, const float *b, int64_t n) {
    double md = 0, mr = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md)) md = d;
        if (fabs(b[i]) > mr) mr = fabs(b[i]);
    }
    return md / (mr > 0 ? mr : 1);
}

/* Every gradient (mean-loss) or parameter of the model, concatenated. */
static float *all_tensors(loom_model *m, bool grads, int64_t *total) {
    loom_model_info info;
    loom_model_get_info(m, &info);
    int64_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        float *buf = pass ? malloc((size_t)n * sizeof *buf) : NULL, *p = buf;
        for (int64_t i = 0; i < info.num_tensors; i++) {
            int nd;
            int64_t sh[2];
            const char *name = loom_model_tensor_name(m, i, &nd, sh);
            int64_t k = nd == 2 ? sh[0] * sh[1] : sh[0];
            if (pass) {
                if (grads) loom_model_get_grad(m, name, p, k);
                else loom_model_get_param(m, name, p, k);
                p += k;
            } else {
                n += k;
            }
        }
        if (pass) {
            *total = n;
            return buf;
        }
    }
    return NULL;
}
static float *all_grads(loom_model *m, int64_t *total) { return all_tensors(m, true, total); }
static float *all_params(loom_model *m, int64_t *total) { return all_tensors(m, false, total); }

/* One call with 4 rows, the same as 4 micro-batches, the same as 2 calls of
 * 2 rows accumulated over 2 clip_grad_and_step calls: same loss, same
 * gradients, one step each. (Weights after the step are not compared: a
 * first AdamW step moves every weight by about lr * sign(g), so a gradient
 * that is zero up to rounding may move either way.) */
TEST(train_accumulation_equals_one_batch) {
    loom_ctx *ctx = new_ctx();
    int32_t ids[4 * 16], tgt[4 * 16];
    make_batch(4, 16, 1000, 7, ids, tgt);
    loom_optimizer_config oc = loom_optimizer_config_default();
    oc.lr = 1e-3;
    float *w[3];
    int64_t n = 0;
    double loss[3];
    for (int mode = 0; mode < 3; mode++) {
        loom_model *m;
        REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen3"), NULL, &m));
        REQUIRE_OK(ctx, loom_model_set_optimizer(m, &oc));
        loom_step_result sr;
        if (mode < 2) {
            loom_batch b = {.rows = 4, .seq_len = 16, .input_ids = ids, .targets = tgt};
            REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, mode == 0 ? 1 : 4, NULL));
            w[mode] = all_grads(m, &n);
            REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 1, &sr));
        } else {
            for (int c = 0; c < 2; c++) {
                loom_batch b = {.rows = 2, .seq_len = 16, .input_ids = ids + 32 * c,
                                .targets = tgt + 32 * c};
                REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, NULL));
                if (c == 1) w[mode] = all_grads(m, &n);
                REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 2, &sr));
                CHECK_EQ_INT(sr.stepped, c == 1);
            }
        }
        CHECK(sr.stepped);
        CHECK_EQ_INT(sr.step, 1);
        CHECK_EQ_INT(sr.n_tokens, 4 * 15 - 1);
        loss[mode] = sr.loss;
        loom_model_free(m);
    }
    for (int mode = 1; mode < 3; mode++) {
        CHECK_NEAR(loss[mode], loss[0], 1e-6 * loss[0]);
        CHECK_MSG(max_rel(w[mode], w[0], n) < 1e-5, "mode %d gradients differ by %.3g", mode,
                  max_rel(w[mode], w[0], n));
        free(w[mode]);
    }
    free(w[0]);
    loom_ctx_free(ctx);
}

/* zero_grad leaves the linear weights' gradients stale and their first GEMM
 * of the step overwrites them (beta 0); norms, biases and the embedding are
 * cleared at once. Over three steps, each of two forward_backward calls
 * (one of two micro-batches) accumulated into one step, the losses,
 * gradients and weights equal those of clearing everything at zero_grad: bit
 * for bit on the CPU; on a GPU (bf16) within rounding, as cuBLASLt may pick
 * another kernel for beta 0, where a step's gradients leaking into the
 * next would differ by their own size. A tied embedding (head and
 * scatter), an untied one, and biases (qwen2). */
static void check_deferred_zeroing(loom_device dev) {
    static const char *const models[] = {"tiny-qwen3", "tiny-qwen3-untied", "tiny-qwen2"};
    if (dev == LOOM_DEVICE_CUDA && !loom_test_have_gpu()) {
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return;
    }
    const double tol = dev == LOOM_DEVICE_CPU ? 0.0 : 2e-2;
    loom_ctx *ctx = new_ctx();
    int32_t ids[3][4 * 16], tgt[3][4 * 16];
    for (int k = 0; k < 3; k++) make_batch(4, 16, 1000, 11 + (uint32_t)k, ids[k], tgt[k]);
    loom_optimizer_config oc = loom_optimizer_config_default();
    oc.lr = 1e-2;
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = dev;
    for (size_t mi = 0; mi < sizeof models / sizeof *models; mi++) {
        float *g[2][3] = {{NULL}}, *w[2] = {NULL};
        int64_t n = 0, nw = 0;
        double loss[2][3];
        for (int mode = 0; mode < 2; mode++) {
            loom_model *m;
            REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model(models[mi]), &o, &m));
            REQUIRE_OK(ctx, loom_model_set_optimizer(m, &oc));
            m->grad_memset = mode == 1;
            for (int k = 0; k < 3; k++) {
                loom_step_result sr;
                for (int c = 0; c < 2; c++) {
                    loom_batch b = {.rows = 2, .seq_len = 16, .input_ids = ids[k] + 32 * c,
                                    .targets = tgt[k] + 32 * c};
                    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, c + 1, NULL));
                    if (c == 1) g[mode][k] = all_grads(m, &n);
                    REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 2, &sr));
                }
                CHECK(sr.stepped);
                loss[mode][k] = sr.loss;
            }
            CHECK_MSG(m->base.gpending == (mode == 0), "%s: zero_grad %s", models[mi],
                      mode ? "deferred though told not to" : "did not defer");
            w[mode] = all_params(m, &nw);
            loom_model_free(m);
        }
        for (int k = 0; k < 3; k++) {
            CHECK_MSG(fabs(loss[0][k] - loss[1][k]) <= tol * loss[1][k],
                      "%s step %d: loss %.17g against %.17g", models[mi], k + 1, loss[0][k],
                      loss[1][k]);
            const double e = max_rel(g[0][k], g[1][k], n);
            CHECK_MSG(tol ? e <= tol : !memcmp(g[0][k], g[1][k], (size_t)n * sizeof(float)),
                      "%s step %d: the gradients differ (largest relative %.3g)", models[mi], k + 1,
                      e);
            free(g[0][k]);
            free(g[1][k]);
        }
        CHECK_MSG(tol ? max_rel(w[0], w[1], nw) <= tol : !memcmp(w[0], w[1], (size_t)nw * sizeof(float)),
                  "%s: the weights differ (largest relative %.3g)", models[mi], max_rel(w[0], w[1], nw));
        free(w[0]);
        free(w[1]);
    }
    loom_ctx_free(ctx);
}
TEST(train_deferred_grad_zeroing_equals_clearing) { check_deferred_zeroing(LOOM_DEVICE_CPU); }
TEST(train_cuda_deferred_grad_zeroing_equals_clearing) { check_deferred_zeroing(LOOM_DEVICE_CUDA); }

/* The trainer takes the scheduler's lr for step k from lr(k-1). */
TEST(train_uses_scheduler_per_step) {
    loom_ctx *ctx = new_ctx();
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-llama"), NULL, &m));
    loom_sched_config sc = loom_sched_config_default();
    sc.init_lr = 0.0;
    sc.max_lr = 1e-3;
    sc.min_lr = 1e-5;
    sc.lr_warmup_steps = 2;
    sc.lr_decay_steps = 6;
    sc.lr_decay_style = LOOM_LR_COSINE;
    sc.start_wd = 0.0;
    sc.end_wd = 0.1;
    sc.wd_incr_steps = 6;
    sc.wd_incr_style = LOOM_WD_LINEAR;
    REQUIRE_OK(ctx, loom_model_set_lr_scheduler(m, &sc));
    int32_t ids[16], tgt[16];
    make_batch(1, 16, 1000, 3, ids, tgt);
    loom_batch b = {.rows = 1, .seq_len = 16, .input_ids = ids, .targets = tgt};
    /* Megatron's formulas at step k-1: warmup init + (max-init)*s/warmup,
     * then cosine min + (max-min)/2*(1+cos(pi*(s-w)/(decay-w))); wd linear. */
    const double pi = 3.14159265358979323846;
    for (int k = 1; k <= 7; k++) {
        loom_step_result sr;
        REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, NULL));
        REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 0.0, 1, &sr));
        int s = k - 1;
        double lr = s <= 2 ? 1e-3 * s / 2.0
                   : s > 6 ? 1e-5
                           : 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + cos(pi * (s - 2) / 4.0));
        double wd = s > 6 ? 0.1 : 0.1 * s / 6.0;
        CHECK_NEAR(sr.lr, lr, 1e-15);
        CHECK_NEAR(sr.weight_decay, wd, 1e-15);
    }
    loom_model_free(m);
    loom_ctx_free(ctx);
}

/* A model whose vocabulary (1000) is not a multiple of 128: padded inside,
 * saved unpadded; the saved model reloads to bit-identical logits. */
TEST(train_save_hf_reload_bit_identical) {
    loom_ctx *ctx = new_ctx();
    const char *preset = loom_preset_config("tiny-qwen3");
    loom_json *doc;
    REQUIRE_OK(ctx, loom_json_parse(ctx, preset, strlen(preset), "preset", &doc));
    REQUIRE_OK(ctx, loom_json_set(ctx, doc, "vocab_size", loom_json_new_int(ctx, 1000)));
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_parse(ctx, doc, "preset", &cfg));
    loom_json_free(doc);
    char src[1024], dst[1024];
    snprintf(src, sizeof src, "%s/src", loom_test_tmpdir());
    snprintf(dst, sizeof dst, "%s/dst", loom_test_tmpdir());
    REQUIRE_OK(ctx, loom_write_random_model(ctx, &cfg, src, 5, 0.0, LOOM_F32, 0));
    loom_config_free(&cfg);

    loom_model *m, *m2;
    REQUIRE_OK(ctx, loom_model_create(ctx, src, NULL, &m));
    loom_model_info info;
    loom_model_get_info(m, &info);
    CHECK_EQ_INT(info.vocab_size, 1000);
    CHECK_EQ_INT(info.padded_vocab_size, 1024);
    int32_t ids[2 * 12], tgt[2 * 12];
    make_batch(2, 12, 1000, 11, ids, tgt);
    loom_batch b = {.rows = 2, .seq_len = 12, .input_ids = ids, .targets = tgt};
    for (int s = 0; s < 2; s++) {
        REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, NULL));
        REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 1, NULL));
    }
    float *l1 = malloc(24 * 1000 * sizeof(float)), *l2 = malloc(24 * 1000 * sizeof(float));
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, l1, NULL));
    REQUIRE_OK(ctx, loom_model_save_hf(m, dst, LOOM_DTYPE_COUNT, 0));
    REQUIRE_OK(ctx, loom_model_create(ctx, dst, NULL, &m2));
    REQUIRE_OK(ctx, loom_model_forward_only(m2, &b, 1, NULL, NULL, l2, NULL));
    CHECK(!memcmp(l1, l2, 24 * 1000 * sizeof(float)));
    /* the file holds 1000 rows and the config says 1000 */
    loom_model_config c2;
    REQUIRE_OK(ctx, loom_config_load(ctx, dst, &c2));
    CHECK_EQ_INT(c2.vocab_size, 1000);
    loom_config_free(&c2);
    int64_t shape[2];
    int nd;
    CHECK_STR(loom_model_tensor_name(m2, 0, &nd, shape), "model.embed_tokens.weight");
    CHECK_EQ_INT(shape[0], 1000);
    free(l1);
    free(l2);
    loom_model_free(m);
    loom_model_free(m2);
    loom_ctx_free(ctx);
}

TEST(train_config_override_fewer_layers) {
    loom_ctx *ctx = new_ctx();
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = "{\"num_hidden_layers\": 2}";
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen2"), &o, &m));
    loom_model_info info;
    loom_model_get_info(m, &info);
    CHECK_EQ_INT(info.num_layers, 2);
    int32_t ids[16], tgt[16];
    make_batch(1, 16, 1000, 5, ids, tgt);
    loom_batch b = {.rows = 1, .seq_len = 16, .input_ids = ids, .targets = tgt};
    loom_fb_result r;
    CHECK_OK(ctx, loom_model_forward_backward(m, &b, 1, &r));
    CHECK(r.loss > 0 && isfinite(r.loss));
    loom_model_free(m);
    o.config_overrides = "[1]";
    CHECK(loom_model_create(ctx, fixture_model("tiny-qwen2"), &o, &m) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "JSON object");
    loom_ctx_free(ctx);
}

/* What loom.h tells of a live model beyond its shapes: config.json's
 * max_position_embeddings, the device and, on a GPU, the peak memory. */
TEST(train_model_info_device_and_peak_memory) {
    loom_ctx *ctx = new_ctx();
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen2"), NULL, &m));
    loom_model_info info;
    loom_model_get_info(m, &info);
    CHECK_EQ_INT(info.max_position_embeddings, 512);
    int gpu = 7;
    CHECK(loom_model_device(m, &gpu) == LOOM_DEVICE_CPU);
    CHECK_EQ_INT(gpu, -1);
    CHECK(loom_model_device(m, NULL) == LOOM_DEVICE_CPU);
    CHECK(loom_model_peak_memory(m) == 0);
    CHECK(loom_model_buffer_memory(m) == 0);
    CHECK(loom_model_device_memory(m) == 0);
    loom_model_free(m);
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = "{\"max_position_embeddings\": 64}";
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen2"), &o, &m));
    loom_model_get_info(m, &info);
    CHECK_EQ_INT(info.max_position_embeddings, 64);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

TEST(train_cuda_model_device_and_peak_memory) {
    if (!loom_test_have_gpu()) loom_test_skip("no GPU visible (or loom built without CUDA)");
    loom_ctx *ctx = new_ctx();
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = LOOM_DEVICE_CUDA;
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen2"), &o, &m));
    int gpu = -1;
    CHECK(loom_model_device(m, &gpu) == LOOM_DEVICE_CUDA);
    CHECK(gpu >= 0 && gpu < loom_gpu_count());
    int32_t ids[16], tgt[16];
    make_batch(1, 16, 1000, 5, ids, tgt);
    loom_batch b = {.rows = 1, .seq_len = 16, .input_ids = ids, .targets = tgt};
    loom_fb_result r;
    CHECK_OK(ctx, loom_model_forward_backward(m, &b, 1, &r));
    CHECK(loom_model_peak_memory(m) > 0); /* the weights at least */
    /* loom's own buffers: within the peak, the weights at least */
    CHECK(loom_model_buffer_memory(m) > 0 &&
          loom_model_buffer_memory(m) <= loom_model_peak_memory(m));
    /* the device's count adds the CUDA context (hundreds of MiB) at least */
    CHECK(loom_model_device_memory(m) > loom_model_peak_memory(m) + ((uint64_t)64 << 20));
    loom_model_free(m);
    loom_ctx_free(ctx);
}

TEST(train_bad_batches_are_refused) {
    loom_ctx *ctx = new_ctx();
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen3"), NULL, &m));
    int32_t ids[2 * 8], tgt[2 * 8];
    make_batch(2, 8, 1000, 9, ids, tgt);
    loom_batch b = {.rows = 2, .seq_len = 8, .input_ids = ids, .targets = tgt};

    ids[9] = 1024; /* vocab is 1024 */
    CHECK(loom_model_forward_backward(m, &b, 1, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "input_ids[1, 1] = 1024 is outside the vocabulary");
    ids[9] = -3;
    CHECK(loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, NULL) == LOOM_ERR_INVALID_ARG);
    ids[9] = 5;
    tgt[3] = 5000;
    CHECK(loom_model_forward_backward(m, &b, 1, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "targets[0, 3] = 5000");
    tgt[3] = 7;
    CHECK(loom_model_forward_backward(m, &b, 3, NULL) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "2 rows cannot be split into 3 micro-batches");
    int32_t cu[3] = {0, 11, 16};
    b.cu_seqlens = cu;
    b.n_docs = 2;
    CHECK(loom_model_forward_backward(m, &b, 1, NULL) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "crosses the start of row 1");
    int32_t cu2[3] = {0, 8, 15};
    b.cu_seqlens = cu2;
    CHECK(loom_model_forward_backward(m, &b, 1, NULL) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "end at rows*seq_len = 16");
    b.cu_seqlens = NULL;
    b.rows = 0;
    CHECK(loom_model_forward_backward(m, &b, 1, NULL) == LOOM_ERR_SHAPE);
    /* nothing was accumulated by the refused calls */
    CHECK(loom_model_get_grad(m, "model.norm.weight", (float[64]){0}, 64) == LOOM_ERR_INVALID_ARG);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

TEST(train_non_finite_loss_is_an_error) {
    loom_ctx *ctx = new_ctx();
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, fixture_model("tiny-qwen3"), NULL, &m));
    int32_t ids[16], tgt[16];
    make_batch(1, 16, 1000, 9, ids, tgt);
    loom_batch b = {.rows = 1, .seq_len = 16, .input_ids = ids, .targets = tgt};
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, NULL)); /* some accumulated grads */
    loom_w(m, m->final_norm)[3] = INFINITY;
    CHECK(loom_model_forward_backward(m, &b, 1, NULL) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "loss is nan (over 1 micro-batch)");
    CHECK_CONTAINS(loom_last_error(ctx), "discarded");
    loom_step_result sr;
    REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 1, &sr));
    CHECK(!sr.stepped); /* nothing left to step on */
    loom_model_free(m);
    loom_ctx_free(ctx);
}

static void write_file(const char *dir, const char *name, const char *text) {
    char p[2100];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* Checkpoints that do not fit their config, and models loom cannot train. */
TEST(train_bad_checkpoints_are_refused) {
    loom_ctx *ctx = new_ctx();
    const char *tmp = loom_test_tmpdir();
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/m", tmp);
    /* the tiny-qwen3 weights under a config with a wider MLP */
    const char *preset = loom_preset_config("tiny-qwen3");
    loom_json *doc;
    REQUIRE_OK(ctx, loom_json_parse(ctx, preset, strlen(preset), "preset", &doc));
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_parse(ctx, doc, "preset", &cfg));
    REQUIRE_OK(ctx, loom_write_random_model(ctx, &cfg, dir, 1, 0.0, LOOM_F32, 0));
    loom_config_free(&cfg);
    loom_json_set(ctx, doc, "intermediate_size", loom_json_new_int(ctx, 96));
    loom_sb sb;
    loom_sb_init(&sb);
    REQUIRE_OK(ctx, loom_json_write(ctx, doc, 2, &sb));
    char *text = loom_sb_take(&sb);
    loom_json_free(doc);
    REQUIRE(text);
    write_file(dir, "config.json", text);
    free(text);
    loom_model *m = NULL;
    CHECK(loom_model_create(ctx, dir, NULL, &m) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "has shape [128, 64], but config.json implies [96, 64]");
    CHECK(!m);
    /* more layers than the checkpoint has */
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = "{\"num_hidden_layers\": 6, \"intermediate_size\": 128}";
    CHECK(loom_model_create(ctx, dir, &o, &m) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "has no tensor model.layers.4.");
    /* MoE: more experts than loom takes is refused with the reason */
    o.config_overrides = "{\"num_local_experts\": 1024}";
    CHECK(loom_model_create(ctx, fixture_model("tiny-qwen3-moe"), &o, &m) == LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(ctx), "1024 experts; loom takes at most 512");
    CHECK(!m);
    loom_ctx_free(ctx);
}
