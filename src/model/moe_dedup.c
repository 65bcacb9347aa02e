/* Whether the expert-parallel dispatch sends a token's row once to each
 * rank that holds some of its experts instead of once per choice
 * (block_moe.c's dd_* functions; top-8 of 128 experts over 2 ranks sends
 * about 4 copies of a row to the other rank). */
#include "moe_dedup.h"

#include <stdlib.h>
#include <string.h>

bool loom_moe_dedup_wanted(void) {
    const char *v = getenv("LOOM_MOE_DEDUP");
    return !(v && !strcmp(v, "0"));
}
