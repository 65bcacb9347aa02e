/* libFuzzer target for config.json's semantic layer (src/io/hf_config.c):
 * whatever parses as JSON goes through loom_config_parse, as read and with
 * an override applied (which reaches a Qwen3.5 config's text_config); a
 * config that parses must have consistent sizes (layers, heads, the
 * Gated DeltaNet's and rotary sizes) and free cleanly. Errors must carry a
 * message. Leaks and overflows are caught by ASan/UBSan. */
#include <stdlib.h>
#include <string.h>

#include "../src/io/hf_config.h"

#define CHECK(c)                                                                      \
    do {                                                                              \
        if (!(c)) {                                                                   \
            fprintf(stderr, "fuzz_config: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                                  \
        }                                                                             \
    } while (0)

static void parse_one(loom_ctx *ctx, loom_json *doc, const char *override) {
    loom_model_config c;
    loom_status st = loom_config_override(ctx, doc, override);
    if (!st) st = loom_config_parse(ctx, doc, "config.json", &c);
    if (st) {
        CHECK(loom_last_error(ctx)[0] != '\0');
        return;
    }
    CHECK(c.num_layers > 0 && c.hidden_size > 0 && c.num_heads > 0 && c.head_dim > 0);
    CHECK(c.num_heads % c.num_kv_heads == 0);
    CHECK(c.rotary_dim >= 2 && c.rotary_dim <= c.head_dim && c.rotary_dim % 2 == 0);
    const int64_t lin = loom_config_linear_layers(&c);
    CHECK(lin >= 0 && lin <= c.num_layers);
    if (lin > 0) CHECK(c.lin_k_heads > 0 && c.lin_v_heads % c.lin_k_heads == 0);
    for (int64_t l = 0; l < c.num_layers; l++) (void)loom_config_layer_is_moe(&c, l);
    CHECK(strlen(loom_config_text_prefix(&c)) > 0);
    loom_config_free(&c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_json *doc = NULL;
    if (loom_json_parse(ctx, (const char *)data, size, "fuzz", &doc) == LOOM_OK) {
        loom_json *copy = loom_json_clone(ctx, doc);
        parse_one(ctx, doc, NULL);
        if (copy) parse_one(ctx, copy, "{\"num_hidden_layers\": 2, \"tie_word_embeddings\": true}");
        loom_json_free(copy);
        loom_json_free(doc);
    }
    loom_ctx_free(ctx);
    return 0;
}
