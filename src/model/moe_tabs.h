/* Host copies of an MoE layer's routing tables as its forward made them:
 * the kept tokens per expert and, with expert parallelism, the ep x etp
 * table of counts. The recomputation and the backward of the same
 * micro-batch read them here instead of downloading them again (each
 * download was a host sync, two a layer). Kept per (layer, activation set),
 * keyed by the device address of the layer's counts in that set, which the
 * forward writes before any backward of the set reads them. */
#ifndef LOOM_MODEL_MOE_TABS_H
#define LOOM_MODEL_MOE_TABS_H

#include <stdbool.h>
#include <stdint.h>

#include "../core/core.h"

typedef struct loom_moe_tabs loom_moe_tabs;

/* Stores cnt (ncnt ints) and rc (nrc ints, may be 0) of layer l (of L)
 * under key, replacing what the key held; *t is made on first use. */
loom_status loom_moe_tabs_put(loom_ctx *ctx, loom_moe_tabs **t, int64_t L, int64_t l,
                              const void *key, const int32_t *cnt, int64_t ncnt,
                              const int32_t *rc, int64_t nrc);
/* Copies layer l's tables under key into cnt and rc; false (nothing
 * copied) when there are none of these sizes. */
bool loom_moe_tabs_get(const loom_moe_tabs *t, int64_t l, const void *key, int32_t *cnt,
                       int64_t ncnt, int32_t *rc, int64_t nrc);
void loom_moe_tabs_free(loom_moe_tabs *t);

#endif
