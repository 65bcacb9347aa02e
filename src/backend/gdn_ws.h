/* The CUDA Gated DeltaNet rule's workspace (ops_gdn_rule.cu) and what its
 * forward keeps for its backward, sized here so that the memory predictor
 * (src/model/meta.c) and the model (block_gdn.c) count what the kernels
 * will ask for, in any build. Twenty arrays, each 256-byte aligned, fp32
 * unless said; NC the most chunks ndocs documents of T tokens can make:
 *   chunk table   cfirst (ndocs + 1), ct0 (NC), clen (NC)          int32
 *   qn, kn        (T, Hk, dk)   the normalised q and k; under tc rq, rk
 *                 (T, Hk) in their place: each row's factor (q = qkv's q by it)
 *   G             (T, Hv)       the log decay since the chunk's start
 *   A             (NC, Hv, 64, 64)  fp32 kernels only
 *   W             (T, Hv, dk);  U0, U (T, Hv, dv)
 *   S             (NC, Hv, dk, dv)  each chunk's starting state
 * and for the backward only
 *   dS            (NC, Hv, dk, dv), bf16 under tc; dU (T, Hv, dv); dqh, dkh
 *                 (T, Hv, dk)
 * then qb, kb (T, Hk, dk) bf16: qn and kn rounded, the tensor-core
 * kernels' operands; and for those kernels (bf16, dk <= 128: "tc") only
 * Tb (NC, Hv, 64, 64) bf16: (I + A)^-1 rounded, as prep made it for its
 * products, for the backward's; U0b (T, Hv, dv) bf16: U0 rounded; and for
 * the backward dUb (T, Hv, dv) bf16: the complete dU rounded (dU then holds
 * its local part only). Under tc W, U, S and dS are bf16 (operands of
 * products only, and the sum of S0 dS over the state for dG; the
 * backward's A is remade from its own K K^T, the same bits), so A is not
 * there.
 *
 * Kept (tc only): the arrays the backward reads from the forward's chunk
 * passes and normalisation (G, W, U, S, Tb, U0b; rq, rk, qb, kb) can live
 * in a caller's buffer of loom_gdn_keep_bytes, sized for keep_chunks
 * chunks, that the forward fills and the backward of the same inputs reads
 * instead of running the L2 norm, prep and the state pass again; then the workspace leaves them out (and U0 from the
 * backward's). Room for loom_gdn_keep_chunks(T) chunks: documents of 128
 * tokens on average; a batch whose bound (loom_gdn_ws_chunks) is past it
 * goes without.
 * The states dominate: NC Hv dk dv elements each of S and dS. */
#ifndef LOOM_GDN_WS_H
#define LOOM_GDN_WS_H

#include <stddef.h>
#include <stdint.h>

#include "loom.h"

enum {
    LOOM_GW_CFIRST, LOOM_GW_CT0, LOOM_GW_CLEN, LOOM_GW_QN, LOOM_GW_KN, LOOM_GW_G, LOOM_GW_A,
    LOOM_GW_W, LOOM_GW_U0, LOOM_GW_U, LOOM_GW_S, LOOM_GW_DS, LOOM_GW_DU, LOOM_GW_DQH,
    LOOM_GW_DKH, LOOM_GW_QB, LOOM_GW_KB, LOOM_GW_TB, LOOM_GW_U0B, LOOM_GW_DUB, LOOM_GDN_WS_ARRAYS
};

/* The arrays a forward keeps for its backward (a bit each): the chunk
 * passes' and the normalised q and k (their bf16 roundings and the rows'
 * factors), so that the backward does not normalise them again. */
#define LOOM_GDN_KEPT                                                                            \
    ((1u << LOOM_GW_G) | (1u << LOOM_GW_W) | (1u << LOOM_GW_U) | (1u << LOOM_GW_S) |            \
     (1u << LOOM_GW_TB) | (1u << LOOM_GW_U0B) | (1u << LOOM_GW_QN) | (1u << LOOM_GW_KN) |       \
     (1u << LOOM_GW_QB) | (1u << LOOM_GW_KB))

/* Whether the rule runs its bf16 tensor-core kernels (their shared memory
 * holds key heads up to 128). */
static inline int loom_gdn_ws_tc(loom_dtype dt, int64_t dk) { return dt == LOOM_BF16 && dk <= 128; }

/* The most chunks of 64 tokens ndocs documents of T tokens in all can make:
 * sum of ceil(len / 64) <= (T + 63 ndocs) / 64, and never more than T. */
static inline int64_t loom_gdn_ws_chunks(int64_t T, int64_t ndocs) {
    const int64_t n = (T + 63 * ndocs) / 64;
    return n < T ? n : T;
}

/* The chunks a keep buffer for micro-batches of T tokens has room for. */
static inline int64_t loom_gdn_keep_chunks(int64_t T) { return (T + 63) / 64 + T / 128; }

/* The keep buffer's chunks where a micro-batch's documents fit in them (its
 * chunk bound within keep_chunks), else 0: the forward and the backward of a
 * batch, and the memory predictor, decide by this alike. */
static inline int64_t loom_gdn_keep_fits(int64_t T, int64_t ndocs, int64_t keep_chunks) {
    return loom_gdn_ws_chunks(T, ndocs) <= keep_chunks ? keep_chunks : 0;
}

static inline size_t loom_gdn_ws_align(size_t b) { return (b + 255) / 256 * 256; }

/* The arrays' bytes (unaligned) in the order above: in the workspace
 * (sizes) and, where keep_chunks > 0 (tc only), in the keep buffer (kept;
 * NULL when keep_chunks is 0), each array in one of them. */
static inline void loom_gdn_ws_sizes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                     int64_t ndocs, int bwd, int tc, int64_t keep_chunks,
                                     size_t sizes[LOOM_GDN_WS_ARRAYS],
                                     size_t kept[LOOM_GDN_WS_ARRAYS]) {
    const int64_t NC = loom_gdn_ws_chunks(T, ndocs), KC = keep_chunks;
    const int keep = tc && KC > 0;
    const size_t f = sizeof(float), o = tc ? 2 : f; /* an operand: bf16 under tc */
    const size_t st = (size_t)(NC * Hv * dk * dv) * o;
    const size_t tv = (size_t)(T * Hv * dv), tk = (size_t)(T * Hv * dk);
    const size_t s[LOOM_GDN_WS_ARRAYS] = {
        (size_t)(ndocs + 1) * 4,
        (size_t)NC * 4,
        (size_t)NC * 4,
        (size_t)(T * Hk * (tc ? 1 : dk)) * f,
        (size_t)(T * Hk * (tc ? 1 : dk)) * f,
        (size_t)(T * Hv) * f,
        tc ? 0 : (size_t)(NC * Hv * 64 * 64) * f,
        tk * o,
        bwd && keep ? 0 : tv * f,
        tv * o,
        (size_t)((keep ? KC : NC) * Hv * dk * dv) * o,
        bwd ? st : 0,
        bwd ? tv * f : 0,
        bwd ? tk * f : 0,
        bwd ? tk * f : 0,
        (size_t)(T * Hk * dk) * 2,
        (size_t)(T * Hk * dk) * 2,
        tc ? (size_t)((keep ? KC : NC) * Hv * 64 * 64) * 2 : 0,
        tc ? tv * 2 : 0,
        tc && bwd ? tv * 2 : 0,
    };
    for (int i = 0; i < LOOM_GDN_WS_ARRAYS; i++) {
        const int in_keep = keep && (LOOM_GDN_KEPT >> i & 1u);
        sizes[i] = in_keep ? 0 : s[i];
        if (kept) kept[i] = in_keep ? s[i] : 0;
    }
}

/* The whole workspace (aligned), as loom_cuda_gdn_scratch_bytes. */
static inline size_t loom_gdn_ws_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                       int64_t ndocs, int bwd, int tc, int64_t keep_chunks) {
    size_t s[LOOM_GDN_WS_ARRAYS], n = 0;
    loom_gdn_ws_sizes(T, Hk, Hv, dk, dv, ndocs, bwd, tc, keep_chunks, s, NULL);
    for (int i = 0; i < LOOM_GDN_WS_ARRAYS; i++) n += loom_gdn_ws_align(s[i]);
    return n;
}

/* The keep buffer for keep_chunks chunks (aligned; 0 without tc). */
static inline size_t loom_gdn_keep_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                                         int64_t dv, int tc, int64_t keep_chunks) {
    size_t s[LOOM_GDN_WS_ARRAYS], k[LOOM_GDN_WS_ARRAYS], n = 0;
    if (!tc || keep_chunks <= 0) return 0;
    loom_gdn_ws_sizes(T, Hk, Hv, dk, dv, 1, 1, tc, keep_chunks, s, k);
    for (int i = 0; i < LOOM_GDN_WS_ARRAYS; i++) n += loom_gdn_ws_align(k[i]);
    return n;
}

#endif
