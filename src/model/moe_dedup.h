/* The expert-parallel dispatch's choice between sending a token's row once
 * per destination rank (the default where the mesh allows it; block_moe.c's
 * dd_* functions: the plan made on the device, cpu_moe.h's dedup tables)
 * and once per choice. */
#ifndef LOOM_MODEL_MOE_DEDUP_H
#define LOOM_MODEL_MOE_DEDUP_H

#include <stdbool.h>

/* Whether models dispatch once per rank (where etp is 1 and routing
 * dropless): unless LOOM_MOE_DEDUP=0, which sends once per choice (to
 * compare; bench/RESULTS.md measured once per rank faster on 2 H200s at 12
 * and 48 layers). The model and the memory predictor ask alike. */
bool loom_moe_dedup_wanted(void);

#endif
