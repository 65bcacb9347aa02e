/* Host tables of the expert-parallel dispatch that sends each token's row
 * once per destination rank (moe_dedup.c; used by block_moe.c). Orders are
 * the existing ones: a rank's choices grouped by expert (ORD: choice ids t k
 * + j, tokens ascending within an expert), the rows it receives gathered by
 * source rank, then regrouped by expert (ix). */
#ifndef LOOM_MODEL_MOE_DEDUP_H
#define LOOM_MODEL_MOE_DEDUP_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* Whether models dispatch once per rank: only with LOOM_MOE_DEDUP=1. Its
 * plan is made on the host, and the syncs that costs outweigh the bytes it
 * saves over NVLink (2 H200s, bench/RESULTS.md): once per choice is the
 * default. The model and the memory predictor ask alike. */
bool loom_moe_dedup_wanted(void);

/* The sender's side: ord's first seg[0] + ... + seg[P-1] entries go to ranks
 * 0..P-1 in turn. uord gets each block's distinct tokens in order of first
 * appearance (nu[p] of them), xidx[j] the place of choice row j's token in
 * its block's list. mark: n ints of scratch. */
void loom_moe_dedup_plan(const int32_t *ord, const int64_t *seg, int P, int k, int64_t n,
                         int32_t *mark, int32_t *uord, int64_t *nu, int32_t *xidx);
/* The receiver's side: meta (m ints a received choice row: its token's
 * place in the source's list, then with m = 2 its weight's bits) came as
 * rcv[s] rows from each source s, whose unique rows came as nur[s]; ix maps
 * each of the rows grouped by expert to its gathered row. fidx[g]: grouped
 * row g's place among all the received unique rows; fw[g] (when not NULL):
 * its weight. src_base: one int per gathered row of scratch. */
void loom_moe_dedup_compose(const int32_t *meta, int m, const int64_t *rcv, const int64_t *nur,
                            int P, const int32_t *ix, int64_t rows, int32_t *src_base,
                            int32_t *fidx, float *fw);
/* pos (nu x k) for summing, per received unique row u, the grouped rows g
 * with fidx[g] == u, in order of g (-1 past them); fill: nu ints of scratch. */
void loom_moe_dedup_sum_slots(const int32_t *fidx, int64_t rows, int64_t nu, int k, int32_t *pos,
                              int32_t *fill);
/* pos (n x P) for summing, per token, the rows that came back for it from
 * each rank (-1 where it sent none): the plan's uord and nu. */
void loom_moe_dedup_token_slots(const int32_t *uord, const int64_t *nu, int P, int64_t n,
                                int32_t *pos);

#endif
