/* The expert-parallel dispatch's choice between sending a token's row once
 * per choice (the default) and once per destination rank (block_moe.c's
 * dd_* functions: the plan made on the device, cpu_moe.h's dedup tables). */
#ifndef LOOM_MODEL_MOE_DEDUP_H
#define LOOM_MODEL_MOE_DEDUP_H

#include <stdbool.h>

/* Whether models dispatch once per rank: only with LOOM_MOE_DEDUP=1 (etp 1,
 * dropless), until it is measured faster over NVLink (bench/RESULTS.md).
 * The model and the memory predictor ask alike. */
bool loom_moe_dedup_wanted(void);

#endif
