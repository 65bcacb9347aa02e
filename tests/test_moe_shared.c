/* Qwen2-MoE's shared expert (src/model/block_moe.c) on a random model of
 * the tiny-qwen2-moe preset's shape (weights of std 0.1, q/k/v biases,
 * layer 2 dense), without a reference: the gradients of the shared expert,
 * its gate and what feeds them against central differences of the loss;
 * selective and full recomputation giving the same gradients as none; and
 * LoRA on the shared expert (PEFT's mlp.shared_expert.<module> and
 * mlp.shared_expert_gate names: all-linear covers them, as PEFT's
 * all-linear covers every nn.Linear but the output layer) saved, read back
 * and merged, its gradients against differences. test_model.c holds the
 * model against transformers (tests/fixtures_moe). */
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/core/json.h"
#include "../src/core/rng.h"
#include "../src/io/export.h"
#include "../src/io/safetensors.h"
#include "../src/model/model.h"
#include "../src/model/params.h"
#include "harness.h"

enum { ROWS = 2, SEQ = 24, N = ROWS * SEQ };

/* The preset's shape with weights of std 0.1, written once per test into
 * tmpdir/name; its batch: random tokens and their next ones as targets. */
static bool make_model(loom_ctx *ctx, char *dir, size_t cap, int32_t *ids, int32_t *tgt) {
    snprintf(dir, cap, "%s/tiny-qwen2-moe", loom_test_tmpdir());
    const char *text = loom_preset_config("tiny-qwen2-moe");
    loom_json *doc = NULL;
    loom_model_config cfg;
    bool ok = text && !loom_json_parse(ctx, text, strlen(text), "preset", &doc) &&
              !loom_config_override(ctx, doc, "{\"initializer_range\": 0.1}") &&
              !loom_config_parse(ctx, doc, "preset", &cfg);
    loom_json_free(doc);
    if (ok) {
        ok = !loom_write_random_model(ctx, &cfg, dir, 11, 0.0, LOOM_F32, 0);
        loom_config_free(&cfg);
    }
    uint32_t s = 12345;
    for (int i = 0; i < N; i++) {
        s = s * 1103515245u + 12345u;
        ids[i] = (int32_t)((s >> 8) % 1000);
    }
    for (int i = 0; i < N; i++) tgt[i] = (i + 1) % SEQ ? ids[i + 1] : -100;
    if (!ok) loom_test_fail(__FILE__, __LINE__, "making the model: %s", loom_last_error(ctx));
    return ok;
}

static loom_model *open_model(loom_ctx *ctx, const char *dir, double aux, loom_recompute rc) {
    char ov[96];
    snprintf(ov, sizeof ov, "{\"router_aux_loss_coef\": %g}", aux);
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = ov;
    o.recompute = rc;
    loom_model *m = NULL;
    if (loom_model_create(ctx, dir, &o, &m)) {
        loom_test_fail(__FILE__, __LINE__, "%s: %s", dir, loom_last_error(ctx));
        return NULL;
    }
    return m;
}

/* The routing of every MoE layer (their kept choices) into idx. */
static void choices(const loom_model *m, int32_t *idx) {
    const int64_t R = N * m->cfg.num_experts_per_tok;
    const loom_acts *a = &m->chunks[0].pool[0];
    for (int64_t l = 0; l < m->L; l++)
        if (loom_config_layer_is_moe(&m->cfg, l))
            memcpy(idx + l * R, a->lay[l].act[1][1], (size_t)R * 4);
        else
            memset(idx + l * R, 0, (size_t)R * 4);
}

/* Central differences of the loss against the gradient of each named
 * tensor (w: its values in the base or the adapter), a dozen elements of
 * each; elements whose step changes some token's experts are skipped.
 * Returns the worst error over the tensor's largest gradient. */
static double check_differences(loom_ctx *ctx, loom_model *m, const loom_batch *b,
                                const char *const *names, int n, bool lora) {
    loom_fb_result r;
    loom_model_zero_grad(m);
    if (loom_model_forward_backward(m, b, 1, &r)) {
        loom_test_fail(__FILE__, __LINE__, "%s", loom_last_error(ctx));
        return INFINITY;
    }
    const int64_t LR = m->L * N * m->cfg.num_experts_per_tok;
    int32_t *idx0 = malloc((size_t)LR * 4), *idx = malloc((size_t)LR * 4);
    choices(m, idx0);
    int checked = 0, tried = 0;
    double worst = 0.0;
    for (int t = 0; t < n; t++) {
        float *w;
        int64_t numel;
        if (lora) {
            loom_arena *ar;
            char key[256];
            int64_t rows, cols;
            if (loom_lora_find(m, names[t], &ar, key, sizeof key, &rows, &cols)) {
                loom_test_fail(__FILE__, __LINE__, "%s", loom_last_error(ctx));
                continue;
            }
            int s = -1;
            for (int i = 0; i < ar->nslots; i++)
                if (!strcmp(ar->slots[i].name, key)) s = i;
            if (s < 0) continue;
            w = ar->w + ar->slots[s].off;
            numel = rows * cols;
        } else {
            const int s = loom_model_find_slot(m, names[t]);
            CHECK_MSG(s >= 0, "no tensor %s", names[t]);
            if (s < 0) continue;
            w = loom_w(m, s);
            numel = (int64_t)m->base.slots[s].numel;
        }
        float *grad = malloc(sizeof(float) * (size_t)numel);
        CHECK_OK(ctx, loom_model_get_grad(m, names[t], grad, numel));
        float gmax = 0.0f;
        for (int64_t i = 0; i < numel; i++) gmax = fmaxf(gmax, fabsf(grad[i]));
        CHECK_MSG(gmax > 0.0f, "%s: no gradient", names[t]);
        double tw = 0.0;
        for (int64_t i = 0; i < numel; i += numel / 12 + 1) {
            const float w0 = w[i], h = 1e-2f;
            double f[2];
            bool flip = false;
            for (int sg = 0; sg < 2; sg++) {
                w[i] = w0 + (sg ? -h : h);
                CHECK_OK(ctx, loom_model_forward_only(m, b, 1, NULL, NULL, NULL, &r));
                f[sg] = r.loss;
                choices(m, idx);
                flip |= memcmp(idx, idx0, (size_t)LR * 4) != 0;
            }
            w[i] = w0;
            tried++;
            if (flip) continue;
            checked++;
            tw = fmax(tw, fabs((f[0] - f[1]) / (2.0 * h) - grad[i]) / gmax);
        }
        if (getenv("LOOM_TEST_VERBOSE")) printf("    %-70s %.3g\n", names[t], tw);
        worst = fmax(worst, tw);
        free(grad);
    }
    CHECK_MSG(checked >= tried / 2, "only %d of %d elements away from a change of experts",
              checked, tried);
    free(idx0), free(idx);
    return worst;
}

/* The shared expert's and its gate's gradients, and those that reach the
 * input through them (attention's, the router's, the layer below's), with
 * the load-balancing loss on. */
TEST(moe_shared_expert_gradient_matches_differences) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    int32_t ids[N], tgt[N];
    REQUIRE(make_model(ctx, dir, sizeof dir, ids, tgt));
    loom_model *m = open_model(ctx, dir, 0.1, LOOM_RECOMPUTE_NONE);
    REQUIRE(m);
    const loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = ids, .targets = tgt};
    const char *names[] = {"model.layers.3.mlp.shared_expert.gate_proj.weight",
                           "model.layers.3.mlp.shared_expert.up_proj.weight",
                           "model.layers.1.mlp.shared_expert.down_proj.weight",
                           "model.layers.1.mlp.shared_expert_gate.weight",
                           "model.layers.3.mlp.shared_expert_gate.weight",
                           "model.layers.0.mlp.gate.weight",
                           "model.layers.0.self_attn.q_proj.bias",
                           "model.layers.0.post_attention_layernorm.weight"};
    const double worst = check_differences(ctx, m, &b, names, 8, false);
    CHECK_MSG(worst < 2e-3, "gradient off by %.3g of the tensor's largest", worst);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

/* Selective (the shared expert's g, u and act dropped and made again) and
 * full recomputation: the same gradients as keeping everything. */
TEST(moe_shared_expert_recompute_same_gradients) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    int32_t ids[N], tgt[N];
    REQUIRE(make_model(ctx, dir, sizeof dir, ids, tgt));
    const loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = ids, .targets = tgt};
    float *g[3] = {NULL, NULL, NULL};
    int64_t total = 0;
    double loss[3];
    for (int rc = 0; rc < 3; rc++) {
        loom_model *m = open_model(ctx, dir, 0.1, (loom_recompute)rc);
        REQUIRE(m);
        loom_fb_result r;
        loom_model_zero_grad(m);
        REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 2, &r));
        loss[rc] = r.loss;
        loom_model_info info;
        loom_model_get_info(m, &info);
        total = 0;
        for (int64_t i = 0; i < info.num_tensors; i++) {
            int nd;
            int64_t sh[2];
            loom_model_tensor_name(m, i, &nd, sh);
            total += nd == 2 ? sh[0] * sh[1] : sh[0];
        }
        g[rc] = malloc(sizeof(float) * (size_t)total);
        float *p = g[rc];
        for (int64_t i = 0; i < info.num_tensors; i++) {
            int nd;
            int64_t sh[2];
            const char *name = loom_model_tensor_name(m, i, &nd, sh);
            const int64_t n = nd == 2 ? sh[0] * sh[1] : sh[0];
            CHECK_OK(ctx, loom_model_get_grad(m, name, p, n));
            p += n;
        }
        loom_model_free(m);
    }
    for (int rc = 1; rc < 3; rc++) {
        CHECK(loss[rc] == loss[0]);
        CHECK_MSG(!memcmp(g[rc], g[0], sizeof(float) * (size_t)total),
                  "recompute mode %d: the gradients differ from keeping everything", rc);
    }
    for (int rc = 0; rc < 3; rc++) free(g[rc]);
    loom_ctx_free(ctx);
}

/* An all-linear adapter (r 4) trained 3 steps (so B is not zero), saved;
 * logits: the trained model's. */
static bool make_adapter(loom_ctx *ctx, const char *mdir, const loom_batch *b, const char *adir,
                         float *logits) {
    loom_model *m = open_model(ctx, mdir, 0.01, LOOM_RECOMPUTE_NONE);
    loom_lora_config c = {.r = 4, .lora_alpha = 8, .target_modules = "all-linear", .seed = 7};
    loom_optimizer_config oc = {.lr = 2e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
    bool ok = m && !loom_model_add_adapter(m, "a", &c) && !loom_model_set_optimizer(m, &oc);
    for (int s = 0; ok && s < 3; s++) {
        loom_fb_result fr;
        loom_step_result sr;
        ok = !loom_model_forward_backward(m, b, 1, &fr) &&
             !loom_model_clip_grad_and_step(m, 1.0, 1, &sr);
    }
    ok = ok && !loom_model_forward_only(m, b, 1, NULL, NULL, logits, NULL) &&
         !loom_model_save_adapter(m, "a", adir, LOOM_F32);
    loom_model_free(m);
    if (!ok) loom_test_fail(__FILE__, __LINE__, "making the adapter: %s", loom_last_error(ctx));
    return ok;
}

/* PEFT's names and shapes in the saved file and adapter_config.json's
 * targets; read back onto a fresh model: the same logits; merged: the
 * same again; then the shared expert's A and B gradients against central
 * differences. */
TEST(moe_shared_expert_lora) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024], adir[1024], p[1100];
    int32_t ids[N], tgt[N];
    REQUIRE(make_model(ctx, dir, sizeof dir, ids, tgt));
    snprintf(adir, sizeof adir, "%s/adapter", loom_test_tmpdir());
    const loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = ids, .targets = tgt};
    float *want = malloc(N * 1024 * sizeof *want), *got = malloc(N * 1024 * sizeof *got);
    REQUIRE(make_adapter(ctx, dir, &b, adir, want));
    /* 3 MoE layers x (4 attention + 8 experts x 3 + 3 shared + its gate) and
     * the dense layer's 4 + 3, A and B each */
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", adir);
    loom_safetensors *st = NULL;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, p, &st));
    CHECK_EQ_INT(loom_st_count(st), (3 * (4 + 8 * 3 + 3 + 1) + 7) * 2);
    static const struct {
        const char *name;
        int64_t d0, d1;
    } want_t[] = {
        {"base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_A.weight", 4, 64},
        {"base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_B.weight", 48, 4},
        {"base_model.model.model.layers.3.mlp.shared_expert.down_proj.lora_A.weight", 4, 48},
        {"base_model.model.model.layers.0.mlp.shared_expert_gate.lora_A.weight", 4, 64},
        {"base_model.model.model.layers.0.mlp.shared_expert_gate.lora_B.weight", 1, 4},
        {"base_model.model.model.layers.2.mlp.gate_proj.lora_A.weight", 4, 64},
    };
    for (size_t i = 0; i < sizeof want_t / sizeof *want_t; i++) {
        const loom_st_tensor *t = loom_st_find(st, want_t[i].name);
        CHECK_MSG(t && t->ndim == 2 && t->shape[0] == want_t[i].d0 && t->shape[1] == want_t[i].d1,
                  "%s: missing or of another shape", want_t[i].name);
    }
    const loom_st_tensor *t =
        loom_st_find(st, "base_model.model.model.layers.0.mlp.shared_expert_gate.lora_B.weight");
    float v[4] = {0};
    if (t) REQUIRE_OK(ctx, loom_st_read(ctx, t, LOOM_F32, v, 4));
    CHECK_MSG(fabs(v[0]) + fabs(v[1]) + fabs(v[2]) + fabs(v[3]) > 1e-5,
              "the shared expert's gate's B did not train");
    loom_st_close(st);
    char *cfg = NULL;
    size_t len = 0;
    snprintf(p, sizeof p, "%s/adapter_config.json", adir);
    REQUIRE_OK(ctx, loom_read_file(ctx, p, 1 << 20, &cfg, &len));
    CHECK_CONTAINS(cfg, "\"shared_expert_gate\"");
    free(cfg);
    /* read back, then merged */
    loom_model *m = open_model(ctx, dir, 0.01, LOOM_RECOMPUTE_NONE);
    REQUIRE(m);
    REQUIRE_OK(ctx, loom_model_load_adapter(m, "a", adir));
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, got, NULL));
    double e = 0.0, mx = 0.0;
    for (int i = 0; i < N * 1024; i++)
        e = fmax(e, fabs(got[i] - want[i])), mx = fmax(mx, fabs(want[i]));
    CHECK_MSG(e <= 1e-6 * mx, "reloaded adapter: logits differ by %.3g", e / mx);
    REQUIRE_OK(ctx, loom_model_merge_adapter(m, "a"));
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, got, NULL));
    e = 0.0;
    for (int i = 0; i < N * 1024; i++) e = fmax(e, fabs(got[i] - want[i]));
    CHECK_MSG(e <= 1e-5 * mx, "merged adapter: logits differ by %.3g", e / mx);
    loom_model_free(m);
    /* the gradients, the load-balancing loss on */
    m = open_model(ctx, dir, 0.5, LOOM_RECOMPUTE_NONE);
    REQUIRE(m);
    REQUIRE_OK(ctx, loom_model_load_adapter(m, "a", adir));
    const char *names[] = {
        "base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_A.weight",
        "base_model.model.model.layers.1.mlp.shared_expert.up_proj.lora_B.weight",
        "base_model.model.model.layers.3.mlp.shared_expert.down_proj.lora_A.weight",
        "base_model.model.model.layers.3.mlp.shared_expert.down_proj.lora_B.weight",
        "base_model.model.model.layers.0.mlp.shared_expert_gate.lora_A.weight",
        "base_model.model.model.layers.1.mlp.shared_expert_gate.lora_B.weight"};
    const double worst = check_differences(ctx, m, &b, names, 6, true);
    CHECK_MSG(worst < 3e-3, "shared expert LoRA gradient off by %.3g of the tensor's largest",
              worst);
    loom_model_free(m);
    free(want), free(got);
    loom_ctx_free(ctx);
}

/* The memory predictor counts the shared expert: its activations (kept and
 * recomputed) byte for byte against the one allocation, with and without
 * LoRA on it, its weights with the rest; and loom_meta gives its blocks as
 * a tp rank holds them (gate and up by rows, down by columns, the gate's
 * weight whole). */
TEST(moe_shared_expert_memory_predicted) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    int32_t ids[N], tgt[N];
    REQUIRE(make_model(ctx, dir, sizeof dir, ids, tgt));
    const loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = ids, .targets = tgt};
    for (int lr = 0; lr <= 4; lr += 4)
        for (int rc = 0; rc < 3; rc++) {
            loom_model *m = open_model(ctx, dir, 0.01, (loom_recompute)rc);
            REQUIRE(m);
            if (lr) {
                loom_lora_config c = {.r = lr, .lora_alpha = 8, .target_modules = "all-linear",
                                      .seed = 1};
                REQUIRE_OK(ctx, loom_model_add_adapter(m, "a", &c));
            }
            loom_fb_result r;
            REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 2, &r));
            loom_mem_in in = {.n = m->mesh->n, .adt = LOOM_F32, .lora_r = lr,
                              .micro_batch_size = ROWS / 2, .seq = SEQ, .n_micro = 2,
                              .training = true, .recompute = (loom_recompute)rc};
            for (int k = 0; k < LOOM_LORA_NMOD; k++) in.lora_target[k] = true;
            loom_mem_report p;
            REQUIRE_OK(ctx, loom_memory_predict(ctx, &m->cfg, &in, &p));
            CHECK_MSG(p.acts == m->act_bytes, "lora r %d, recompute %d: activations %llu "
                      "predicted, %llu allocated", lr, rc, (unsigned long long)p.acts,
                      (unsigned long long)m->act_bytes);
            const loom_arena *A = loom_model_trainable(m);
            const double w = (double)m->base.nparams * 4 + (lr ? (double)A->nparams * 4 : 0.0);
            CHECK_NEAR((double)p.weights, w, lr ? (double)A->nslots * 16 * 4 : 0.0);
            loom_model_free(m);
        }
    loom_model_options o;
    loom_model_options_default(&o);
    o.tp = 2;
    o.sequence_parallel = 1;
    loom_meta_query q = {.world_size = 2, .micro_batch_size = 1, .seq_len = 32,
                         .num_micro_batches = 1};
    loom_meta *mt = NULL;
    REQUIRE_OK(ctx, loom_meta_create(ctx, dir, &o, &q, &mt));
    loom_model_info info;
    loom_meta_get_info(mt, &info);
    int seen = 0;
    for (int64_t i = 0; i < info.num_tensors; i++) {
        loom_param_info pi;
        REQUIRE_OK(ctx, loom_meta_param_info(mt, i, &pi));
        const int64_t *s = pi.local_shape;
        int64_t want[2] = {0, 0};
        if (!strcmp(pi.name, "model.layers.1.mlp.shared_expert.up_proj.weight"))
            want[0] = 24, want[1] = 64;
        else if (!strcmp(pi.name, "model.layers.1.mlp.shared_expert.down_proj.weight"))
            want[0] = 64, want[1] = 24;
        else if (!strcmp(pi.name, "model.layers.1.mlp.shared_expert_gate.weight"))
            want[0] = 1, want[1] = 64;
        else if (strstr(pi.name, "layers.2.mlp.shared_expert"))
            seen += 100; /* the dense layer has none */
        if (!want[0]) continue;
        seen++;
        CHECK_MSG(s[0] == want[0] && s[1] == want[1], "%s: local [%lld, %lld]", pi.name,
                  (long long)s[0], (long long)s[1]);
    }
    CHECK_EQ_INT(seen, 3);
    loom_meta_free(mt);
    loom_ctx_free(ctx);
}

/* PEFT's names parsed into layer, expert, the module's path and name:
 * paths of two parts (the shared expert's), an expert's, and names that
 * are not a layer's LoRA weight. */
TEST(moe_shared_expert_peft_names_parse) {
    static const struct {
        const char *name;
        bool ok;
        int64_t layer, expert;
        const char *block, *module;
        char ab;
    } cases[] = {
        {"base_model.model.model.layers.3.mlp.shared_expert.down_proj.lora_A.weight", true, 3, -1,
         "mlp.shared_expert", "down_proj", 'A'},
        {"base_model.model.model.layers.0.mlp.shared_expert_gate.lora_B.weight", true, 0, -1, "mlp",
         "shared_expert_gate", 'B'},
        {"base_model.model.model.layers.12.mlp.experts.7.up_proj.lora_A.weight", true, 12, 7,
         "mlp.experts", "up_proj", 'A'},
        {"base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight", true, 1, -1,
         "self_attn", "q_proj", 'B'},
        {"base_model.model.model.layers.1.q_proj.lora_A.weight", false, 0, 0, "", "", 0},
        {"base_model.model.model.layers.1.mlp.gate_proj.lora_C.weight", false, 0, 0, "", "", 0},
        {"base_model.model.model.layers.1.mlp.gate_proj.lora_A.bias", false, 0, 0, "", "", 0},
        {"base_model.model.model.layers.01.mlp.gate_proj.lora_A.weight", false, 0, 0, "", "", 0},
        {"base_model.model.model.layers.1.mlp..gate_proj.lora_A.weight", false, 0, 0, "", "", 0},
        {"base_model.model.model.layers.1.mlp.experts.x.up_proj.lora_A.weight", false, 0, 0, "", "",
         0},
        {"base_model.model.model.layers.1.MLP.up_proj.lora_A.weight", false, 0, 0, "", "", 0},
        {"base_model.model.lm_head.lora_A.weight", false, 0, 0, "", "", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int64_t l = -7, e = -7;
        char block[64] = "", module[32] = "", ab = 0;
        const bool ok = loom_peft_weight_parse(cases[i].name, &l, &e, block, module, &ab, NULL);
        CHECK_MSG(ok == cases[i].ok, "%s: parsed %d", cases[i].name, ok);
        if (!ok || !cases[i].ok) continue;
        CHECK(l == cases[i].layer && e == cases[i].expert && ab == cases[i].ab);
        CHECK_STR(block, cases[i].block);
        CHECK_STR(module, cases[i].module);
    }
    /* a vision-language checkpoint's layout (model.language_model.), said by nested */
    int64_t l = -1, e = -1;
    char block[64] = "", module[32] = "", ab = 0;
    bool nested = false;
    CHECK(loom_peft_weight_parse(
        "base_model.model.model.language_model.layers.2.linear_attn.out_proj.lora_B.weight", &l, &e,
        block, module, &ab, &nested));
    CHECK(nested && l == 2 && e == -1 && ab == 'B');
    CHECK_STR(block, "linear_attn");
    CHECK_STR(module, "out_proj");
    CHECK(loom_peft_weight_parse("base_model.model.model.layers.2.mlp.up_proj.lora_A.weight", &l,
                                 &e, block, module, &ab, &nested));
    CHECK(!nested);
    CHECK(
        !loom_peft_weight_parse("base_model.model.model.language_model.2.mlp.up_proj.lora_A.weight",
                                &l, &e, block, module, &ab, &nested));
    CHECK(!loom_peft_weight_parse("base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight",
                                  &l, &e, block, module, &ab, &nested));
}

/* On a GPU (fp32) against the CPU: the loss and every gradient, of the
 * model and of an all-linear adapter (the shared expert's and its gate's
 * LoRA among them), recomputing the MLP part on the GPU. */
TEST(moe_shared_expert_cuda_matches_cpu) {
    if (!loom_test_have_gpu()) SKIP("no GPU visible (or loom built without CUDA)");
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024], adir[1024];
    int32_t ids[N], tgt[N];
    REQUIRE(make_model(ctx, dir, sizeof dir, ids, tgt));
    snprintf(adir, sizeof adir, "%s/adapter-cuda", loom_test_tmpdir());
    const loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = ids, .targets = tgt};
    float *scratch = malloc(N * 1024 * sizeof *scratch);
    const bool made = make_adapter(ctx, dir, &b, adir, scratch);
    free(scratch);
    REQUIRE(made);
    for (int lora = 0; lora < 2; lora++) {
        loom_model *m[2] = {NULL, NULL};
        loom_fb_result r[2];
        for (int d = 0; d < 2; d++) {
            loom_model_options o;
            loom_model_options_default(&o);
            o.device = d ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU;
            o.recompute = d ? LOOM_RECOMPUTE_MLP : LOOM_RECOMPUTE_NONE;
            o.config_overrides = "{\"router_aux_loss_coef\": 0.5}";
            REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m[d]));
            if (lora) REQUIRE_OK(ctx, loom_model_load_adapter(m[d], "a", adir));
            loom_model_zero_grad(m[d]);
            REQUIRE_OK(ctx, loom_model_forward_backward(m[d], &b, 1, &r[d]));
        }
        CHECK_MSG(fabs(r[1].loss - r[0].loss) <= 1e-5 * r[0].loss, "loss %.9g (GPU) vs %.9g (CPU)",
                  r[1].loss, r[0].loss);
        char name[256];
        int64_t shape[2];
        double worst = 0.0;
        const char *wn = "";
        int n = 0;
        loom_model_info info;
        loom_model_get_info(m[0], &info);
        for (int64_t i = 0;; i++) {
            const char *nm;
            if (lora) {
                nm = loom_model_adapter_tensor(m[0], "a", i, name, sizeof name, shape);
            } else {
                int nd;
                nm = i < info.num_tensors ? loom_model_tensor_name(m[0], i, &nd, shape) : NULL;
                if (nm && nd == 1) shape[1] = 1;
            }
            if (!nm) break;
            n++;
            const int64_t k = shape[0] * shape[1];
            float *g0 = malloc(sizeof(float) * (size_t)k), *g1 = malloc(sizeof(float) * (size_t)k);
            CHECK_OK(ctx, loom_model_get_grad(m[0], nm, g0, k));
            CHECK_OK(ctx, loom_model_get_grad(m[1], nm, g1, k));
            double e = 0.0, mx = 0.0;
            for (int64_t j = 0; j < k; j++)
                e = fmax(e, fabs(g1[j] - g0[j])), mx = fmax(mx, fabs(g0[j]));
            if (mx > 0 && e / mx > worst) worst = e / mx, wn = nm;
            free(g0), free(g1);
        }
        CHECK_EQ_INT(n, lora ? (3 * (4 + 8 * 3 + 4) + 7) * 2 : info.num_tensors);
        CHECK_MSG(worst <= 1e-4, "%s: %s's gradient differs by %.3g of its largest",
                  lora ? "LoRA" : "full", wn, worst);
        for (int d = 0; d < 2; d++) loom_model_free(m[d]);
    }
    loom_ctx_free(ctx);
}

/* Megatron's forced load balancing (a benchmark's routing): each MoE
 * layer's choices are the top k of its drawn logits (rng.h's stream per
 * layer, value token * E + expert), not of the router's; the router gets
 * no gradient while the rest of the model does. */
TEST(moe_router_force_load_balancing) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    int32_t ids[N], tgt[N];
    REQUIRE(make_model(ctx, dir, sizeof dir, ids, tgt));
    const loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = ids, .targets = tgt};
    int32_t *idx[2] = {NULL, NULL};
    int64_t L = 0, E = 0, k = 0;
    bool moe[16] = {false};
    for (int force = 0; force < 2; force++) {
        loom_model_options o;
        loom_model_options_default(&o);
        o.config_overrides = "{\"router_aux_loss_coef\": 0.1}";
        o.moe_router_force_load_balancing = force;
        loom_model *m = NULL;
        REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m));
        L = m->L, E = m->cfg.num_experts, k = m->cfg.num_experts_per_tok;
        REQUIRE(L <= 16);
        for (int64_t l = 0; l < L; l++) moe[l] = loom_config_layer_is_moe(&m->cfg, l);
        loom_fb_result r;
        loom_model_zero_grad(m);
        REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r));
        idx[force] = malloc((size_t)(L * N * k) * sizeof(int32_t));
        REQUIRE(idx[force]);
        choices(m, idx[force]);
        float *g = malloc((size_t)(E * m->H) * sizeof *g);
        REQUIRE(g);
        double router = 0.0, gate = 0.0;
        CHECK_OK(ctx, loom_model_get_grad(m, "model.layers.0.mlp.gate.weight", g, E * m->H));
        for (int64_t i = 0; i < E * m->H; i++) router = fmax(router, fabs(g[i]));
        CHECK_OK(ctx, loom_model_get_grad(m, "model.layers.0.mlp.shared_expert_gate.weight", g, m->H));
        for (int64_t i = 0; i < m->H; i++) gate = fmax(gate, fabs(g[i]));
        CHECK_MSG(force ? router == 0.0 : router > 0.0, "force %d: router gradient up to %g", force,
                  router);
        CHECK(gate > 0.0);
        free(g);
        loom_model_free(m);
    }
    int64_t differ = 0, layers = 0;
    for (int64_t l = 0; l < L; l++) {
        if (!moe[l]) continue;
        layers++;
        const uint64_t base = loom_rng_base(0x6d6f652d72616e64ull, (uint64_t)l << 8);
        for (int64_t t = 0; t < N; t++) {
            for (int64_t j = 0; j < k; j++) { /* the j-th largest draw */
                int32_t best = -1;
                for (int32_t e = 0; e < E; e++) {
                    bool taken = false;
                    for (int64_t i = 0; i < j; i++) {
                        const int32_t p = idx[1][(l * N + t) * k + i];
                        taken |= p == e;
                    }
                    if (!taken && (best < 0 || loom_rng_gauss4_at(base, (uint64_t)(t * E + e)) >
                                                   loom_rng_gauss4_at(base, (uint64_t)(t * E + best))))
                        best = e;
                }
                CHECK_MSG(idx[1][(l * N + t) * k + j] == best,
                          "layer %lld token %lld choice %lld: expert %d, the draws' %d",
                          (long long)l, (long long)t, (long long)j, idx[1][(l * N + t) * k + j],
                          best);
                differ += idx[1][(l * N + t) * k + j] != idx[0][(l * N + t) * k + j];
            }
        }
    }
    CHECK(layers >= 2);
    CHECK_MSG(differ > N / 2, "forced routing changed only %lld choices", (long long)differ);
    free(idx[0]), free(idx[1]);
    loom_ctx_free(ctx);
}
