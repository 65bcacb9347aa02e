/* The CUDA Gated DeltaNet rule's workspace (ops_gdn_rule.cu), sized here so
 * that the memory predictor (src/model/meta.c) counts what the kernels will
 * ask for, in any build. Eighteen arrays, each 256-byte aligned, fp32 unless
 * said; NC the most chunks ndocs documents of T tokens can make:
 *   chunk table   cfirst (ndocs + 1), ct0 (NC), clen (NC)          int32
 *   qn, kn        (T, Hk, dk)   the normalised q and k
 *   G             (T, Hv)       the log decay since the chunk's start
 *   A             (NC, Hv, 64, 64)
 *   W             (T, Hv, dk);  U0, U (T, Hv, dv)
 *   S             (NC, Hv, dk, dv)  each chunk's starting state
 * and for the backward only
 *   dS            (NC, Hv, dk, dv); dU (T, Hv, dv); dqh, dkh (T, Hv, dk)
 * and last qb, kb (T, Hk, dk) bf16: qn and kn rounded, the tensor-core
 * kernels' operands (which also keep W and U as bf16 in their arrays), and
 * Tb (NC, Hv, 64, 64) bf16: (I + A)^-1 rounded, as the tensor-core prep
 * made it for its products, for the backward's.
 * The states dominate: NC Hv dk dv 4 bytes each of S and dS. */
#ifndef LOOM_GDN_WS_H
#define LOOM_GDN_WS_H

#include <stddef.h>
#include <stdint.h>

#define LOOM_GDN_WS_ARRAYS 18

/* The most chunks of 64 tokens ndocs documents of T tokens in all can make:
 * sum of ceil(len / 64) <= (T + 63 ndocs) / 64, and never more than T. */
static inline int64_t loom_gdn_ws_chunks(int64_t T, int64_t ndocs) {
    const int64_t n = (T + 63 * ndocs) / 64;
    return n < T ? n : T;
}

static inline size_t loom_gdn_ws_align(size_t b) { return (b + 255) / 256 * 256; }

/* The arrays' bytes (unaligned) in the order above. */
static inline void loom_gdn_ws_sizes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                     int64_t ndocs, int bwd, size_t sizes[LOOM_GDN_WS_ARRAYS]) {
    const int64_t NC = loom_gdn_ws_chunks(T, ndocs);
    const size_t f = sizeof(float), st = (size_t)(NC * Hv * dk * dv) * f;
    const size_t s[LOOM_GDN_WS_ARRAYS] = {
        (size_t)(ndocs + 1) * 4,         (size_t)NC * 4,
        (size_t)NC * 4,                  (size_t)(T * Hk * dk) * f,
        (size_t)(T * Hk * dk) * f,       (size_t)(T * Hv) * f,
        (size_t)(NC * Hv * 64 * 64) * f, (size_t)(T * Hv * dk) * f,
        (size_t)(T * Hv * dv) * f,       (size_t)(T * Hv * dv) * f,
        st,                              bwd ? st : 0,
        bwd ? (size_t)(T * Hv * dv) * f : 0,
        bwd ? (size_t)(T * Hv * dk) * f : 0,
        bwd ? (size_t)(T * Hv * dk) * f : 0,
        (size_t)(T * Hk * dk) * 2,       (size_t)(T * Hk * dk) * 2,
        (size_t)(NC * Hv * 64 * 64) * 2,
    };
    for (int i = 0; i < LOOM_GDN_WS_ARRAYS; i++) sizes[i] = s[i];
}

/* The whole workspace (aligned), as loom_cuda_gdn_scratch_bytes. */
static inline size_t loom_gdn_ws_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                       int64_t ndocs, int bwd) {
    size_t s[LOOM_GDN_WS_ARRAYS], n = 0;
    loom_gdn_ws_sizes(T, Hk, Hv, dk, dv, ndocs, bwd, s);
    for (int i = 0; i < LOOM_GDN_WS_ARRAYS; i++) n += loom_gdn_ws_align(s[i]);
    return n;
}

#endif
