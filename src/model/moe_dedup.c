/* The expert-parallel dispatch can send a token's row once to each rank
 * that holds some of its experts, not once per choice (block_moe.c; top-8
 * of 128 experts over 2 ranks sends about 4 copies of a row to the other
 * rank). These are the host tables that compress and expand around the
 * all-to-alls (moe_dedup.h). */
#include "moe_dedup.h"

#include <stdlib.h>

bool loom_moe_dedup_wanted(void) {
    const char *v = getenv("LOOM_MOE_DEDUP");
    return v && !strcmp(v, "1");
}

void loom_moe_dedup_plan(const int32_t *ord, const int64_t *seg, int P, int k, int64_t n,
                         int32_t *mark, int32_t *uord, int64_t *nu, int32_t *xidx) {
    int64_t j = 0, u = 0;
    for (int64_t t = 0; t < n; t++) mark[t] = -1;
    for (int p = 0; p < P; p++) {
        const int64_t u0 = u;
        for (int64_t i = 0; i < seg[p]; i++, j++) {
            const int32_t t = ord[j] / k;
            if (mark[t] < 0) {
                mark[t] = (int32_t)(u - u0);
                uord[u++] = t;
            }
            xidx[j] = mark[t];
        }
        nu[p] = u - u0;
        for (int64_t v = u0; v < u; v++) mark[uord[v]] = -1; /* reset for the next rank */
    }
}

void loom_moe_dedup_compose(const int32_t *meta, int m, const int64_t *rcv, const int64_t *nur,
                            int P, const int32_t *ix, int64_t rows, int32_t *src_base,
                            int32_t *fidx, float *fw) {
    /* each gathered row's place among the received unique rows: its source
     * block's first unique row plus the index the source sent */
    int64_t i = 0, c = 0;
    for (int s = 0; s < P; s++) {
        for (int64_t r = 0; r < rcv[s]; r++, i++) src_base[i] = (int32_t)c;
        c += nur[s];
    }
    for (int64_t g = 0; g < rows; g++) {
        const int32_t o = ix[g];
        fidx[g] = src_base[o] + meta[(int64_t)o * m];
        if (fw) {
            float w;
            const int32_t bits = meta[(int64_t)o * m + 1];
            memcpy(&w, &bits, sizeof w);
            fw[g] = w;
        }
    }
}

void loom_moe_dedup_sum_slots(const int32_t *fidx, int64_t rows, int64_t nu, int k, int32_t *pos,
                              int32_t *fill) {
    for (int64_t u = 0; u < nu * k; u++) pos[u] = -1;
    for (int64_t u = 0; u < nu; u++) fill[u] = 0;
    for (int64_t g = 0; g < rows; g++) {
        const int32_t u = fidx[g];
        pos[(int64_t)u * k + fill[u]++] = (int32_t)g; /* a token has at most k choices */
    }
}

void loom_moe_dedup_token_slots(const int32_t *uord, const int64_t *nu, int P, int64_t n,
                                int32_t *pos) {
    for (int64_t i = 0; i < n * P; i++) pos[i] = -1;
    int64_t u = 0;
    for (int p = 0; p < P; p++)
        for (int64_t v = 0; v < nu[p]; v++, u++) pos[(int64_t)uord[u] * P + p] = (int32_t)u;
}
