/* Random Qwen3.5 models for the Qwen3.5 tests (test_qwen35*.c). */
#ifndef LOOM_TEST_QWEN35_MODELS_H
#define LOOM_TEST_QWEN35_MODELS_H

#include <stdbool.h>
#include <stddef.h>

#include "../../include/loom.h"
#include "../harness.h"

/* A text-only config whose layers are all gated full attention (2 layers,
 * partial rotary 0.25, initializer_range 0.2). */
extern const char loom_q35_gated[];
/* A random text-only hybrid: twice three Gated DeltaNet layers and one
 * full-attention layer, byte-sized vocabulary (token files of `loom data
 * --text`), 2 key and 4 value heads in the linear layers (tp 2 splits
 * them), transformers' initializer_range 0.02. Better conditioned than the
 * fixture's model: layouts agree within 1e-5 on it. (At 0.2, fp32-sized
 * noise on the embedding alone moves the Gated DeltaNet's decay gradients
 * by 1.6e-3 of their largest, and the layouts by as much.) */
extern const char loom_q35_hybrid[];

/* A model directory dir of config with random weights, opened on the CPU;
 * the zero-centred norms' weights (0 from init) set to small random values
 * so (1 + w) is not 1. NULL on failure (the error in ctx). */
loom_model *loom_q35_random_model(loom_ctx *ctx, const char *dir, const char *config);
/* The same saved with its norms set, as tmp/model (its path into dir). */
bool loom_q35_saved_model(loom_ctx *ctx, const char *tmp, const char *config, char *dir,
                          size_t cap);

#endif
