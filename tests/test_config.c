/* HF config.json parsing (both layouts), parameter plans and presets. */
#include <stdlib.h>

#include "../src/io/hf_config.h"
#include "../src/model/params.h"
#include "harness.h"

static loom_status parse_text(loom_ctx *ctx, const char *text, loom_model_config *cfg) {
    loom_json *doc;
    loom_status st = loom_json_parse(ctx, text, strlen(text), "config.json", &doc);
    if (st) return st;
    st = loom_config_parse(ctx, doc, "config.json", cfg);
    loom_json_free(doc);
    return st;
}

static loom_status load_fixture(loom_ctx *ctx, const char *model, loom_model_config *cfg) {
    char path[1024];
    snprintf(path, sizeof path, "%s/models/%s", loom_test_fixtures(), model);
    return loom_config_load(ctx, path, cfg);
}

TEST(config_fixtures_v5_layout) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config c;
    REQUIRE_OK(ctx, load_fixture(ctx, "tiny-qwen3", &c));
    CHECK(c.arch == LOOM_ARCH_QWEN3);
    CHECK(c.v5_layout);
    CHECK_EQ_INT(c.hidden_size, 64);
    CHECK_EQ_INT(c.num_layers, 4);
    CHECK_EQ_INT(c.num_heads, 4);
    CHECK_EQ_INT(c.num_kv_heads, 2);
    CHECK_EQ_INT(c.head_dim, 16);
    CHECK_EQ_INT(c.vocab_size, 1024);
    CHECK(c.rope_theta == 1000000.0);
    CHECK(c.rms_norm_eps == 1e-6);
    CHECK(c.tie_word_embeddings && c.qk_norm && !c.qkv_bias);
    loom_config_free(&c);

    REQUIRE_OK(ctx, load_fixture(ctx, "tiny-qwen3-untied", &c));
    CHECK(!c.tie_word_embeddings);
    loom_config_free(&c);

    REQUIRE_OK(ctx, load_fixture(ctx, "tiny-qwen2", &c));
    CHECK(c.arch == LOOM_ARCH_QWEN2 && c.qkv_bias && !c.o_bias && !c.qk_norm);
    CHECK(!c.head_dim_given || c.head_dim == 16);
    loom_config_free(&c);

    REQUIRE_OK(ctx, load_fixture(ctx, "tiny-llama", &c));
    CHECK(c.arch == LOOM_ARCH_LLAMA && !c.qkv_bias && !c.mlp_bias);
    CHECK(c.rope_theta == 500000.0);
    loom_config_free(&c);

    REQUIRE_OK(ctx, load_fixture(ctx, "tiny-qwen3-moe", &c));
    CHECK(c.arch == LOOM_ARCH_QWEN3_MOE && c.v5_layout);
    CHECK_EQ_INT(c.num_experts, 8);
    CHECK_EQ_INT(c.num_experts_per_tok, 2);
    CHECK_EQ_INT(c.moe_intermediate_size, 32);
    CHECK(c.norm_topk_prob);
    CHECK(c.router_aux_loss_coef == 0.01);
    for (int l = 0; l < 4; l++) CHECK(loom_config_layer_is_moe(&c, l));
    loom_config_free(&c);
    loom_ctx_free(ctx);
}

/* The classic hub layout of the same model gives the same numbers. */
TEST(config_classic_layout) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config c;
    REQUIRE_OK(ctx, parse_text(ctx,
                               "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 1024, "
                               "\"hidden_size\": 64, \"intermediate_size\": 128, "
                               "\"num_hidden_layers\": 4, \"num_attention_heads\": 4, "
                               "\"num_key_value_heads\": 2, \"head_dim\": 16, "
                               "\"rope_theta\": 1000000.0, \"rope_scaling\": null, "
                               "\"num_experts\": 8, \"num_experts_per_tok\": 2, "
                               "\"moe_intermediate_size\": 32, \"decoder_sparse_step\": 2, "
                               "\"mlp_only_layers\": [3], \"torch_dtype\": \"bfloat16\"}",
                               &c));
    CHECK(!c.v5_layout);
    CHECK_EQ_INT(c.num_experts, 8);
    CHECK(c.rope_theta == 1000000.0);
    CHECK_STR(c.dtype, "bfloat16");
    /* sparse step 2: layers 1 and 3 are MoE, but 3 is listed as dense */
    CHECK(!loom_config_layer_is_moe(&c, 0));
    CHECK(loom_config_layer_is_moe(&c, 1));
    CHECK(!loom_config_layer_is_moe(&c, 2));
    CHECK(!loom_config_layer_is_moe(&c, 3));
    loom_param_plan plan;
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &c, &plan));
    int64_t counts[LOOM_COMP_COUNT];
    loom_param_plan_count(&plan, counts);
    CHECK_EQ_INT(counts[LOOM_COMP_EXPERTS], 8 * 3 * 32 * 64);     /* one MoE layer */
    CHECK_EQ_INT(counts[LOOM_COMP_MLP], 3 * 3 * 128 * 64);        /* three dense layers */
    CHECK_EQ_INT(counts[LOOM_COMP_ROUTER], 8 * 64);
    loom_param_plan_free(&plan);
    loom_config_free(&c);

    /* llama: head_dim derived, llama3 rope scaling in rope_scaling */
    REQUIRE_OK(ctx, parse_text(ctx,
                               "{\"model_type\": \"llama\", \"vocab_size\": 128256, "
                               "\"hidden_size\": 4096, \"intermediate_size\": 14336, "
                               "\"num_hidden_layers\": 32, \"num_attention_heads\": 32, "
                               "\"num_key_value_heads\": 8, \"rope_theta\": 500000.0, "
                               "\"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, "
                               "\"high_freq_factor\": 4.0, "
                               "\"original_max_position_embeddings\": 8192, "
                               "\"rope_type\": \"llama3\"}, \"tie_word_embeddings\": false}",
                               &c));
    CHECK_EQ_INT(c.head_dim, 128);
    CHECK(!c.head_dim_given);
    CHECK(c.rope_type == LOOM_ROPE_LLAMA3 && c.rope_factor == 8.0);
    CHECK_EQ_INT(c.rope_original_max_pos, 8192);
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &c, &plan));
    CHECK_EQ_INT(loom_param_plan_count(&plan, NULL), 8030261248LL); /* Llama-3.1-8B */
    loom_param_plan_free(&plan);
    loom_config_free(&c);

    /* qwen2_moe: Qwen1.5-MoE-A2.7B's config.json (14.3B parameters: a shared
     * expert and its gate in every layer, q/k/v biases, no q/k norm) */
    REQUIRE_OK(ctx, parse_text(ctx,
                               "{\"architectures\": [\"Qwen2MoeForCausalLM\"], "
                               "\"model_type\": \"qwen2_moe\", \"hidden_act\": \"silu\", "
                               "\"hidden_size\": 2048, \"intermediate_size\": 5632, "
                               "\"max_position_embeddings\": 8192, \"max_window_layers\": 21, "
                               "\"num_attention_heads\": 16, \"num_hidden_layers\": 24, "
                               "\"num_key_value_heads\": 16, \"rms_norm_eps\": 1e-06, "
                               "\"rope_theta\": 1000000.0, \"sliding_window\": 32768, "
                               "\"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\", "
                               "\"use_sliding_window\": false, \"vocab_size\": 151936, "
                               "\"decoder_sparse_step\": 1, \"moe_intermediate_size\": 1408, "
                               "\"shared_expert_intermediate_size\": 5632, "
                               "\"num_experts_per_tok\": 4, \"num_experts\": 60, "
                               "\"norm_topk_prob\": false, \"router_aux_loss_coef\": 0.001}",
                               &c));
    CHECK(c.arch == LOOM_ARCH_QWEN2_MOE && !c.v5_layout);
    CHECK(c.qkv_bias && !c.o_bias && !c.qk_norm && !c.norm_topk_prob);
    CHECK_EQ_INT(c.shared_expert_intermediate_size, 5632);
    CHECK(loom_config_layer_is_moe(&c, 0) && loom_config_layer_is_moe(&c, 23));
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &c, &plan));
    {
        const int64_t H = 2048, L = 24;
        CHECK_EQ_INT(loom_param_plan_count(&plan, counts), 14315784192LL);
        CHECK_EQ_INT(counts[LOOM_COMP_MLP], L * 3 * H * 5632); /* the shared experts */
        CHECK_EQ_INT(counts[LOOM_COMP_ROUTER], L * (60 + 1) * H); /* routers and gates */
        CHECK_EQ_INT(counts[LOOM_COMP_EXPERTS], L * 60 * 3 * H * 1408);
        const char *names[] = {"model.layers.5.mlp.shared_expert.gate_proj.weight",
                               "model.layers.5.mlp.shared_expert.up_proj.weight",
                               "model.layers.5.mlp.shared_expert.down_proj.weight",
                               "model.layers.5.mlp.shared_expert_gate.weight"};
        const int64_t shapes[4][2] = {{5632, H}, {5632, H}, {H, 5632}, {1, H}};
        int seen = 0;
        for (size_t i = 0; i < plan.n; i++)
            for (int k = 0; k < 4; k++)
                if (!strcmp(plan.p[i].name, names[k])) {
                    seen++;
                    CHECK(plan.p[i].shape[0] == shapes[k][0] && plan.p[i].shape[1] == shapes[k][1]);
                    CHECK(plan.p[i].expert == -1); /* not an expert's: split over tp */
                }
        CHECK_EQ_INT(seen, 4);
    }
    loom_param_plan_free(&plan);
    loom_config_free(&c);
    /* qkv_bias false, and transformers' shared width when the key is absent */
    REQUIRE_OK(ctx, parse_text(ctx,
                               "{\"model_type\": \"qwen2_moe\", \"vocab_size\": 100, "
                               "\"hidden_size\": 32, \"num_hidden_layers\": 1, "
                               "\"num_attention_heads\": 2, \"num_experts\": 4, "
                               "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 8, "
                               "\"qkv_bias\": false}",
                               &c));
    CHECK(!c.qkv_bias && c.shared_expert_intermediate_size == 5632);
    loom_config_free(&c);

    /* v5 rope_parameters with linear scaling */
    REQUIRE_OK(ctx, parse_text(ctx,
                               "{\"model_type\": \"qwen2\", \"vocab_size\": 100, "
                               "\"hidden_size\": 32, \"intermediate_size\": 64, "
                               "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                               "\"rope_parameters\": {\"rope_type\": \"linear\", \"factor\": 2.0, "
                               "\"rope_theta\": 10000.0}}",
                               &c));
    CHECK(c.v5_layout && c.rope_type == LOOM_ROPE_LINEAR && c.rope_factor == 2.0);
    CHECK_EQ_INT(c.num_kv_heads, 2); /* defaults to the query heads */
    loom_config_free(&c);
    loom_ctx_free(ctx);
}

TEST(config_bad_input) {
    static const struct {
        const char *json, *fragment;
        loom_status st;
    } cases[] = {
        {"{\"vocab_size\": 10}", "missing required field 'model_type'", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"mistral\", \"vocab_size\": 10}", "model_type 'mistral' is not supported",
         LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": 3}", "'model_type' must be a string", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_attention_heads\": 2}",
         "missing required field 'num_hidden_layers'", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": \"8\", "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2}",
         "'hidden_size' must be an integer, got string", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8.5, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2}",
         "'hidden_size' must be an integer", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 0, \"num_attention_heads\": 2}",
         "'num_hidden_layers' must be a positive integer", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 377777777777777, "
         "\"num_attention_heads\": 2}",
         "num_hidden_layers=377777777777777 is more than the 65536 layers", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, "
         "\"num_key_value_heads\": 3}",
         "not a multiple of num_key_value_heads=3", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 10, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 4}",
         "no head_dim given", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
         "\"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}}",
         "rope scaling type 'yarn' is not implemented", LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
         "\"rope_parameters\": {\"rope_type\": \"dynamic\", \"factor\": 2.0}}",
         "rope scaling type 'dynamic' is not implemented", LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
         "\"hidden_act\": \"gelu\"}",
         "hidden_act 'gelu' is not supported", LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
         "\"tie_word_embeddings\": \"yes\"}",
         "'tie_word_embeddings' must be a boolean", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 8, \"moe_intermediate_size\": 4}",
         "num_experts_per_tok=8 is larger than the number of experts (4)", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_moe\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_experts_per_tok\": 2, "
         "\"moe_intermediate_size\": 4}",
         "missing required field 'num_experts'", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"intermediate_size\": 8, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
         "\"use_sliding_window\": true}",
         "use_sliding_window=true is not supported", LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": \"qwen2_moe\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 4, "
         "\"use_sliding_window\": true}",
         "use_sliding_window=true is not supported", LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": \"qwen2_moe\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 4, "
         "\"shared_expert_intermediate_size\": 0}",
         "'shared_expert_intermediate_size' must be a positive integer", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen2_moe\", \"vocab_size\": 10, \"hidden_size\": 8, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_experts\": 4, "
         "\"num_experts_per_tok\": 2, \"moe_intermediate_size\": 4, "
         "\"layer_types\": [\"sliding_attention\"]}",
         "layer_types[0] is not 'full_attention'", LOOM_ERR_UNSUPPORTED},
        {"[1, 2]", "must be a JSON object", LOOM_ERR_CONFIG},
    };
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_model_config c;
        loom_status st = parse_text(ctx, cases[i].json, &c);
        CHECK_MSG(st == cases[i].st, "case %zu: status %s, want %s (%s)", i, loom_status_str(st),
                  loom_status_str(cases[i].st), loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), cases[i].fragment);
        CHECK_CONTAINS(loom_last_error(ctx), "config.json");
        loom_config_free(&c);
    }
    loom_ctx_free(ctx);
}

TEST(config_file_errors_name_the_file) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config c;
    CHECK(loom_config_load(ctx, "/nonexistent/dir", &c) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "/nonexistent/dir");
    const char *p = loom_test_write("config.json", "{\"model_type\": \"qwen3\",", 24);
    CHECK(loom_config_load(ctx, p, &c) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), p);
    loom_ctx_free(ctx);
}

/* Parameter counts of the built-in shapes, against the published model sizes
 * worked out by hand from their configs. Qwen3.5-0.8B's text model: the
 * embedding 248320 x 1024; a Gated DeltaNet layer in_proj_qkv 6144 x 1024,
 * z 2048 x 1024, b and a 16 x 1024, conv 6144 x 4, A_log and dt_bias 16, its
 * norm 128, out_proj 1024 x 2048, the MLP 3 x 1024 x 3584, two norms 1024
 * (21,555,360, 18 of them); a gated attention layer q 4096 x 1024, k and v
 * 512 x 1024, o 1024 x 2048, q/k norms 256, MLP and norms (18,352,640, 6 of
 * them); the final norm. Qwen3.5-4B likewise at 2560 (in_proj_qkv 8192 rows,
 * 32 value heads): 112,923,840 x 24 + 107,484,672 x 8. */
TEST(presets_parameter_counts) {
    static const struct {
        const char *name;
        int64_t total;
    } want[] = {
        {"qwen3-0.6b", 596049920LL},  {"qwen3-4b", 4022468096LL},
        {"qwen3-8b", 8190735360LL},   {"qwen3-30b-a3b", 30532122624LL},
        {"qwen3.5-0.8b", 752393024LL}, {"qwen3.5-4b", 4205751296LL},
        {"tiny-qwen3", 65536 + 4 * (64 * 64 * 2 + 32 * 64 * 2 + 32 + 3 * 128 * 64 + 128) + 64},
    };
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        loom_model_config c;
        const char *text = loom_preset_config(want[i].name);
        REQUIRE(text);
        REQUIRE_OK(ctx, parse_text(ctx, text, &c));
        loom_param_plan plan;
        REQUIRE_OK(ctx, loom_param_plan_build(ctx, &c, &plan));
        int64_t total = loom_param_plan_count(&plan, NULL);
        CHECK_MSG(total == want[i].total, "%s: %lld parameters, want %lld", want[i].name,
                  (long long)total, (long long)want[i].total);
        loom_param_plan_free(&plan);
        loom_config_free(&c);
    }
    CHECK(loom_preset_config("gpt2") == NULL);
    loom_ctx_free(ctx);
}

/* Qwen3.5's configs (tests/fixtures_qwen3_5): the vision-language layout
 * with the text model under text_config, its hybrid layer types, the
 * Gated DeltaNet's sizes, the gated attention's partial rotary factor;
 * MoE with its shared expert; an override reaches the text model. */
TEST(config_qwen3_5) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config c;
    REQUIRE_OK(ctx, loom_config_load(ctx, "tests/fixtures_qwen3_5/models/tiny-qwen3_5", &c));
    CHECK_STR(c.model_type, "qwen3_5");
    CHECK(c.nested_text);
    CHECK_STR(loom_config_text_prefix(&c), "model.language_model.");
    CHECK_EQ_INT(c.hidden_size, 64);
    CHECK_EQ_INT(c.num_layers, 4);
    CHECK_EQ_INT(c.num_heads, 4);
    CHECK_EQ_INT(c.num_kv_heads, 2);
    CHECK_EQ_INT(c.head_dim, 16);
    CHECK_EQ_INT(c.rotary_dim, 4); /* 16 x 0.25 */
    CHECK(c.rope_theta == 10000000.0);
    CHECK(c.qk_norm && c.attn_gate && c.norm_offset && !c.qkv_bias && !c.o_bias);
    CHECK(c.tie_word_embeddings);
    CHECK_EQ_INT(c.lin_conv_kernel, 4);
    CHECK_EQ_INT(c.lin_k_heads, 2);
    CHECK_EQ_INT(c.lin_v_heads, 4);
    CHECK_EQ_INT(c.lin_k_dim, 16);
    CHECK_EQ_INT(c.lin_v_dim, 16);
    CHECK_EQ_INT(loom_config_linear_layers(&c), 3);
    CHECK(c.linear_attn[0] && c.linear_attn[1] && c.linear_attn[2] && !c.linear_attn[3]);
    CHECK_EQ_INT(c.num_experts, 0);
    /* the plan declares every tensor (3 x (2 norms + 9 linear attention + 3
     * mlp) + (2 + 6 gated attention + 3) + embedding, final norm); the
     * layers are not built yet, which every path that would run them asks */
    loom_param_plan plan;
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &c, &plan));
    CHECK_EQ_INT(plan.n, 3 * 14 + 11 + 2);
    for (size_t i = 0; i < plan.n; i++)
        if (!strcmp(plan.p[i].name, "model.layers.3.self_attn.q_proj.weight"))
            CHECK_EQ_INT(plan.p[i].shape[0], 2 * 4 * 16); /* query and gate per head */
        else if (!strcmp(plan.p[i].name, "model.layers.0.linear_attn.conv1d.weight"))
            CHECK(plan.p[i].ndim == 2 && plan.p[i].shape[0] == 128 && plan.p[i].shape[1] == 4);
    loom_param_plan_free(&plan);
    loom_config_free(&c);

    REQUIRE_OK(ctx, loom_config_load(ctx, "tests/fixtures_qwen3_5/models/tiny-qwen3_5-moe", &c));
    CHECK_STR(c.model_type, "qwen3_5_moe");
    CHECK(!c.tie_word_embeddings);
    CHECK_EQ_INT(c.num_experts, 8);
    CHECK_EQ_INT(c.num_experts_per_tok, 2);
    CHECK_EQ_INT(c.moe_intermediate_size, 32);
    CHECK_EQ_INT(c.shared_expert_intermediate_size, 48);
    CHECK(c.norm_topk_prob); /* always, for Qwen3.5-MoE */
    for (int l = 0; l < 4; l++) CHECK(loom_config_layer_is_moe(&c, l));
    loom_config_free(&c);

    /* an override of a text key goes into text_config; one the top level
     * holds too (tie_word_embeddings) goes to both */
    REQUIRE_OK(ctx, loom_config_load_with(ctx, "tests/fixtures_qwen3_5/models/tiny-qwen3_5",
                                          "{\"num_hidden_layers\": 2, \"layer_types\": "
                                          "[\"linear_attention\", \"full_attention\"], "
                                          "\"tie_word_embeddings\": false}",
                                          &c));
    CHECK_EQ_INT(c.num_layers, 2);
    CHECK(c.linear_attn[0] && !c.linear_attn[1]);
    CHECK(!c.tie_word_embeddings);
    const loom_json *tc = loom_json_get(c.raw, "text_config");
    REQUIRE(tc != NULL);
    CHECK(loom_json_get(c.raw, "num_hidden_layers") == NULL);
    CHECK(loom_json_get(tc, "num_hidden_layers") != NULL);
    loom_config_free(&c);
    /* 8 layers but 4 layer_types: refused, saying what to override */
    CHECK_EQ_INT(loom_config_load_with(ctx, "tests/fixtures_qwen3_5/models/tiny-qwen3_5",
                                       "{\"num_hidden_layers\": 8}", &c),
                 LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "needs one of layer_types too");
    loom_ctx_free(ctx);
}

/* The text-only layout (qwen3_5_text: tensors under model.), layer types
 * from full_attention_interval as transformers derives them, and bad
 * Qwen3.5 configs. */
TEST(config_qwen3_5_text_only_and_errors) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_model_config c;
    REQUIRE_OK(ctx, parse_text(ctx,
                               "{\"model_type\": \"qwen3_5_text\", \"vocab_size\": 100, "
                               "\"hidden_size\": 32, \"intermediate_size\": 64, "
                               "\"num_hidden_layers\": 6, \"num_attention_heads\": 2, "
                               "\"num_key_value_heads\": 1, \"head_dim\": 16, "
                               "\"full_attention_interval\": 3, \"rope_parameters\": "
                               "{\"rope_theta\": 1e6, \"partial_rotary_factor\": 0.5}}",
                               &c));
    CHECK_STR(c.model_type, "qwen3_5");
    CHECK(!c.nested_text);
    CHECK_STR(loom_config_text_prefix(&c), "model.");
    CHECK_EQ_INT(c.rotary_dim, 8);
    CHECK_EQ_INT(c.lin_k_dim, 128); /* transformers' defaults */
    CHECK_EQ_INT(c.lin_v_heads, 32);
    for (int l = 0; l < 6; l++) CHECK_MSG(c.linear_attn[l] == ((l + 1) % 3 != 0), "layer %d", l);
    loom_config_free(&c);
    /* every other family keeps rotary_dim = head_dim and no linear layers */
    REQUIRE_OK(ctx, load_fixture(ctx, "tiny-qwen3", &c));
    CHECK_EQ_INT(c.rotary_dim, c.head_dim);
    CHECK_EQ_INT(loom_config_linear_layers(&c), 0);
    CHECK(!c.attn_gate && !c.norm_offset && !c.nested_text);
    loom_config_free(&c);
#define Q35 "\"vocab_size\": 10, \"hidden_size\": 8, \"intermediate_size\": 8, " \
            "\"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"head_dim\": 8"
    static const struct {
        const char *json, *fragment;
        loom_status st;
    } cases[] = {
        {"{\"model_type\": \"qwen3_5\", " Q35 "}", "'text_config', which is missing",
         LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_5\", \"text_config\": {\"model_type\": \"qwen3_5_moe_text\", " Q35
         "}}",
         "text_config.model_type 'qwen3_5_moe_text' does not match", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_5\", \"text_config\": 3}", "'text_config' must be an object",
         LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_5_text\", " Q35 ", \"layer_types\": [\"full_attention\"]}",
         "'layer_types' must be a list of num_hidden_layers=2", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_5_text\", " Q35
         ", \"layer_types\": [\"full_attention\", \"sliding_attention\"]}",
         "layer_types[1] must be 'linear_attention' or 'full_attention'", LOOM_ERR_UNSUPPORTED},
        {"{\"model_type\": \"qwen3_5_text\", " Q35 ", \"partial_rotary_factor\": 0.125}",
         "partial_rotary_factor=0.125 gives 1 rotary dimensions", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_5_text\", " Q35 ", \"partial_rotary_factor\": 9.6e25}",
         "partial_rotary_factor=9.6e+25 gives 0 rotary dimensions", LOOM_ERR_CONFIG},
        {"{\"model_type\": \"qwen3_5_text\", " Q35
         ", \"linear_num_key_heads\": 3, \"linear_num_value_heads\": 4}",
         "linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3", LOOM_ERR_CONFIG},
    };
#undef Q35
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        loom_status st = parse_text(ctx, cases[i].json, &c);
        CHECK_MSG(st == cases[i].st, "case %zu: status %s, want %s (%s)", i, loom_status_str(st),
                  loom_status_str(cases[i].st), loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), cases[i].fragment);
        loom_config_free(&c);
    }
    loom_ctx_free(ctx);
}
