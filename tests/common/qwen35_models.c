/* Random Qwen3.5 models the Qwen3.5 tests share (qwen35_models.h). */
#include "qwen35_models.h"

#include <string.h>

#include "../../src/core/rng.h"
#include "../../src/model/model.h"
#include "../../src/model/params.h"

const char loom_q35_gated[] =
    "{\"model_type\": \"qwen3_5_text\", \"vocab_size\": 64, \"hidden_size\": 32, "
    "\"intermediate_size\": 48, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
    "\"num_key_value_heads\": 2, \"head_dim\": 16, \"layer_types\": [\"full_attention\", "
    "\"full_attention\"], \"rope_parameters\": {\"rope_theta\": 10000.0, "
    "\"partial_rotary_factor\": 0.25, \"rope_type\": \"default\"}, \"rms_norm_eps\": 1e-6, "
    "\"tie_word_embeddings\": false, \"initializer_range\": 0.2}";

const char loom_q35_hybrid[] =
    "{\"model_type\": \"qwen3_5_text\", \"vocab_size\": 256, \"hidden_size\": 32, "
    "\"intermediate_size\": 48, \"num_hidden_layers\": 8, \"num_attention_heads\": 4, "
    "\"num_key_value_heads\": 2, \"head_dim\": 16, \"layer_types\": [\"linear_attention\", "
    "\"linear_attention\", \"linear_attention\", \"full_attention\", \"linear_attention\", "
    "\"linear_attention\", \"linear_attention\", \"full_attention\"], "
    "\"linear_num_key_heads\": 2, \"linear_num_value_heads\": 4, \"linear_key_head_dim\": 8, "
    "\"linear_value_head_dim\": 8, \"linear_conv_kernel_dim\": 4, \"rope_parameters\": "
    "{\"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.25, \"rope_type\": \"default\"}, "
    "\"rms_norm_eps\": 1e-6, \"tie_word_embeddings\": false, \"initializer_range\": 0.02}";

loom_model *loom_q35_random_model(loom_ctx *ctx, const char *dir, const char *config) {
    loom_model_config cfg;
    char path[1100];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (loom_mkdirs(ctx, dir) || loom_write_file_atomic(ctx, path, config, strlen(config)) ||
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
        if (!strstr(sl->name, "norm") || strstr(sl->name, "linear_attn.norm")) continue;
        float *w = loom_w(m, s);
        for (size_t i = 0; i < sl->numel; i++) {
            CHECK(w[i] == 0.0f); /* zero-centred: initialised to 0 */
            w[i] = 0.3f * (float)loom_rng_normal(77, loom_hash_str(sl->name), i);
        }
    }
    return m;
}

bool loom_q35_saved_model(loom_ctx *ctx, const char *tmp, const char *config, char *dir,
                          size_t cap) {
    loom_model *m = loom_q35_random_model(ctx, tmp, config);
    snprintf(dir, cap, "%s/model", tmp);
    const bool ok = m && !loom_model_save_hf(m, dir, LOOM_F32, 0);
    if (!ok) loom_test_fail(__FILE__, __LINE__, "random model: %s", loom_last_error(ctx));
    loom_model_free(m);
    return ok;
}
