/* Qwen3.5's full-attention layers on the CPU: the gated attention (each
 * head's query and output gate from q_proj, o * sigmoid(gate) before
 * o_proj), RoPE on the first quarter of a head, zero-centred RMSNorm
 * weights (1 + w) everywhere. A random text-only model whose layers are all
 * full attention (the Gated DeltaNet layers are not built yet) trains, and
 * every gradient matches central differences of its loss. */
#include <math.h>
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/core/rng.h"
#include "../src/io/hf_config.h"
#include "../src/model/model.h"
#include "../src/model/params.h"
#include "harness.h"

static const char CONFIG[] =
    "{\"model_type\": \"qwen3_5_text\", \"vocab_size\": 64, \"hidden_size\": 32, "
    "\"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, "
    "\"num_key_value_heads\": 1, \"head_dim\": 16, \"layer_types\": [\"full_attention\", "
    "\"full_attention\"], \"rope_parameters\": {\"rope_theta\": 10000.0, "
    "\"partial_rotary_factor\": 0.25, \"rope_type\": \"default\"}, \"rms_norm_eps\": 1e-6, "
    "\"tie_word_embeddings\": false, \"initializer_range\": 0.2}";

/* A model directory of CONFIG with random weights; the norms' weights
 * (0 from init) set to small random values so (1 + w) is not 1. */
static loom_model *gated_model(loom_ctx *ctx, const char *dir) {
    loom_model_config cfg;
    char path[1100];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (loom_mkdirs(ctx, dir) || loom_write_file_atomic(ctx, path, CONFIG, sizeof CONFIG - 1) ||
        loom_config_load(ctx, dir, &cfg))
        return NULL;
    loom_status st = loom_write_random_model(ctx, &cfg, dir, 5, 0, LOOM_F32, 0);
    loom_config_free(&cfg);
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = LOOM_DEVICE_CPU;
    loom_model *m = NULL;
    if (st || loom_model_create(ctx, dir, &o, &m)) return NULL;
    for (int s = 0; s < m->base.nslots; s++) {
        const loom_slot *sl = &m->base.slots[s];
        if (!strstr(sl->name, "norm")) continue;
        float *w = loom_w(m, s);
        for (size_t i = 0; i < sl->numel; i++) {
            CHECK(w[i] == 0.0f); /* zero-centred: initialised to 0 */
            w[i] = 0.3f * (float)loom_rng_normal(77, loom_hash_str(sl->name), i);
        }
    }
    return m;
}

TEST(qwen35_gated_attention_gradients_match_differences) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/qwen35-gated", loom_test_tmpdir());
    loom_model *m = gated_model(ctx, dir);
    if (!m) printf("    %s\n", loom_last_error(ctx));
    REQUIRE(m != NULL);
    CHECK_EQ_INT(m->rd, 4);
    CHECK(m->norm_off == 1.0f);
    enum { ROWS = 2, S = 12 };
    int32_t ids[ROWS * S], tgt[ROWS * S];
    for (int i = 0; i < ROWS * S; i++) ids[i] = (int32_t)(loom_splitmix64(9 + (uint64_t)i) % 64);
    for (int i = 0; i < ROWS * S; i++) tgt[i] = i % S == S - 1 ? -100 : ids[i + 1];
    loom_batch b = {.rows = ROWS, .seq_len = S, .input_ids = ids, .targets = tgt};
    loom_fb_result r;
    loom_model_zero_grad(m);
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r));
    CHECK(isfinite(r.loss) && r.loss > 1.0);
    /* q_proj's query rows (0..15 of head 0) and gate rows (16..31), every
     * other tensor of the full-attention block, the norms (1 + w) and the MLP */
    const char *names[] = {"model.layers.0.self_attn.q_proj.weight",
                           "model.layers.1.self_attn.k_proj.weight",
                           "model.layers.0.self_attn.v_proj.weight",
                           "model.layers.1.self_attn.o_proj.weight",
                           "model.layers.0.self_attn.q_norm.weight",
                           "model.layers.1.self_attn.k_norm.weight",
                           "model.layers.0.input_layernorm.weight",
                           "model.layers.1.post_attention_layernorm.weight",
                           "model.norm.weight",
                           "model.layers.0.mlp.down_proj.weight",
                           "model.embed_tokens.weight"};
    double worst = 0.0;
    for (size_t t = 0; t < sizeof names / sizeof names[0]; t++) {
        const int s = loom_model_find_slot(m, names[t]);
        CHECK_MSG(s >= 0, "no tensor %s", names[t]);
        if (s < 0) continue;
        const loom_slot *sl = &m->base.slots[s]; /* its HF shape (the embedding's rows padded) */
        const int64_t n = sl->shape[0] * (sl->ndim == 2 ? sl->shape[1] : 1);
        float *grad = malloc(sizeof(float) * (size_t)n), *w = loom_w(m, s);
        REQUIRE_OK(ctx, loom_model_get_grad(m, names[t], grad, n));
        float gmax = 0.0f;
        for (int64_t i = 0; i < n; i++) gmax = fmaxf(gmax, fabsf(grad[i]));
        CHECK_MSG(gmax > 0.0f, "%s: no gradient", names[t]);
        double err = 0.0;
        for (int64_t i = 0; i < n; i += n / 17 + 1) {
            const float w0 = w[i], h = 1e-2f;
            double f[2];
            for (int sgn = 0; sgn < 2; sgn++) {
                w[i] = w0 + (sgn ? -h : h);
                REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, &r));
                f[sgn] = r.loss;
            }
            w[i] = w0;
            err = fmax(err, fabs((f[0] - f[1]) / (2.0 * h) - grad[i]) / gmax);
        }
        CHECK_MSG(err < 2e-3, "%s: gradient off by %.3g of the tensor's largest", names[t], err);
        worst = fmax(worst, err);
        free(grad);
    }
    printf("    gradients vs central differences: worst %.3g of a tensor's largest\n", worst);
    loom_model_free(m);
    loom_ctx_free(ctx);
}
