// Tensor-core attention for BF16/F16 inputs with head size 64 or 128 (the
// semantics of ops_attention.cu; that file dispatches here).
//
// FlashAttention-2 structure on mma.sync.m16n8k16 (fp32 accumulators), tiles
// in shared memory (rows padded by 16 bytes: conflict-free ldmatrix), loaded
// with cp.async two tiles deep; 4 warps per block, each warp owning 16 rows
// (the forward at D = 128: 32) of the block's tile. Softmax in base 2 (scores times scale * log2 e, then
// ex2.approx), the log-sum-exp written in natural units.
//   forward  block = 64 (D = 128: 128) queries x 1 head; loop over 64-key tiles; online
//            softmax in registers; P (rounded to the input type) times V.
//   backward (default, fused) D_i = dO_i . O_i first; then per block of 64
//            keys x 1 query head, a loop over the query tiles (BQ2 rows) that
//            see the keys: S^T = K Q^T, dP^T = V dO^T, dS = P (dP - D_i),
//            dV += P^T dO, dK += dS^T Q, and dQ += dS K added into an fp32
//            buffer with vector atomics (so dQ's last bits vary by run).
//   backward (LOOM_ATTN_DETERMINISTIC=1) the same block loop without dQ, and
//            a dq kernel: block = 64 queries x 1 head, per key tile
//            S = QK^T, dP = dO V^T, dS = P (dP - D_i), dQ += dS K (S and dP
//            computed twice, every output with one writer: bitwise repeatable).
//   Both write dK, dV as fp32 partial sums per query head, added over each kv
//   head's group in a fixed order by a last small kernel (a block per query
//   head instead of per kv head: 4x the blocks under GQA, and no block holds a
//   group's whole causal work).
// Query-tile blocks run the latest (most keys, causal) tiles first.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mma.cuh"
#include "ops_attention.cuh"

namespace loom_cuda {
namespace {

constexpr int NT = ATTN_NT; // threads of a block (default of the loaders)
constexpr int BK = 64;      // keys per tile (forward, dq) and per block (dk, dv)
constexpr float LOG2E = 1.4426950408889634f;
constexpr double LN2 = 0.6931471805599453;

// 2^x (ex2.approx: 2 ulp; 2^-inf = 0).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// dst[0..1] += (x, y) in global memory, one vector reduction (sm_90).
__device__ __forceinline__ void red_add2(float *dst, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y) : "memory");
}

// ROWS x DH tile of a (rows, H, DH) tensor (rows r0.., n valid, head h) into
// shared memory with row stride DH + 8, in 16-byte cp.async pieces by NTH
// threads, zeros past n rows; complete after cp_commit, cp_wait and
// __syncthreads.
template <typename T, int DH, int ROWS, int NTH = NT>
__device__ __forceinline__ void load_tile_async(T *dst, const void *src, int64_t r0, int n, int64_t H,
                                                int64_t h) {
    constexpr int LDS = DH + 8, CH = DH / 8;
    const T *s = (const T *)src;
    for (int idx = threadIdx.x; idx < ROWS * CH; idx += NTH) {
        const int r = idx / CH, c = idx % CH;
        const bool valid = r < n;
        cp_async16(dst + r * LDS + c * 8, valid ? s + ((r0 + r) * H + h) * DH + c * 8 : s, valid);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Stores the pair (x, y) at element offset off (even) of a T tensor.
template <typename T>
__device__ __forceinline__ void store2(void *base, int64_t off, float x, float y) {
    *(uint32_t *)((T *)base + off) = mma_type<T>::pack(x, y);
}

} // namespace

// ---- forward ----
// K and V tiles are double-buffered: the next tile's cp.async runs while the
// current one is multiplied. Each warp owns MT m-tiles of 16 query rows: a K
// or V fragment read from shared memory serves all MT of them.
template <typename T, int DH, int NW, int MT>
__global__ void __launch_bounds__(32 * NW) attn_fwd_mma_kernel(attn_args a) {
    using M = mma_type<T>;
    constexpr int LDS = DH + 8, ND = DH / 8; // n-tiles of 8 head columns
    constexpr int NTH = 32 * NW, WR = 16 * MT, BQ = WR * NW;
    extern __shared__ __align__(16) unsigned char smem[];
    T *Qs = (T *)smem, *KV = Qs + BQ * LDS; // KV: 2 buffers of K then V tiles
    int *gi_s = (int *)(KV + 4 * BK * LDS), *ds_s = gi_s + BQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int64_t t0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * BQ; // latest tiles first
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int nq = (int)(a.Tq - t0 < BQ ? a.Tq - t0 : BQ);
    const float sl2 = a.scale * LOG2E;

    load_tile_async<T, DH, BQ, NTH>(Qs, a.q, t0, nq, a.Hq, h);
    cp_commit();
    load_rows<false, BQ, false, NTH>(a, t0, nq, h, gi_s, ds_s, nullptr, nullptr);
    __syncthreads();

    const int64_t kb = ds_s[0], ke = (int64_t)gi_s[nq - 1] + 1;
    const int ntiles = (int)((ke - kb + BK - 1) / BK);
    const int w0 = warp * WR, wlast = w0 + WR - 1 < nq - 1 ? w0 + WR - 1 : nq - 1;
    const bool wvalid = w0 < nq;
    // this warp's keys: [first row's doc start, last row]; all-visible test bounds
    const int64_t wlo = wvalid ? ds_s[w0] : 0, whi = wvalid ? gi_s[wlast] : -1;
    const int64_t ds_max = ds_s[w0 + WR - 1], gi_min = gi_s[w0];
    int gi[MT][2], ds[MT][2]; // this lane's rows w0 + 16 mt + g (+ 8)
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            gi[mt][c] = gi_s[w0 + 16 * mt + g + 8 * c];
            ds[mt][c] = ds_s[w0 + 16 * mt + g + 8 * c];
        }

    float of[MT][ND][4];
    float m[MT][2], l[MT][2]; // m: base-2 units
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int j = 0; j < ND; j++) of[mt][j][0] = of[mt][j][1] = of[mt][j][2] = of[mt][j][3] = 0.0f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.0f;
    }

    auto stage = [&](int it) {
        const int64_t k0 = kb + (int64_t)it * BK;
        const int nk = (int)(ke - k0 < BK ? ke - k0 : BK);
        T *Kb = KV + (it & 1) * 2 * BK * LDS;
        load_tile_async<T, DH, BK, NTH>(Kb, a.k, k0, nk, a.Hkv, hk);
        load_tile_async<T, DH, BK, NTH>(Kb + BK * LDS, a.v, k0, nk, a.Hkv, hk);
        cp_commit();
    };
    if (ntiles > 0) stage(0);
    for (int it = 0; it < ntiles; it++) {
        const int64_t k0 = kb + (int64_t)it * BK;
        if (it + 1 < ntiles) {
            stage(it + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T *Ks = KV + (it & 1) * 2 * BK * LDS, *Vs = Ks + BK * LDS;
        if (wvalid && k0 <= whi && k0 + BK - 1 >= wlo) { // some key visible to this warp
            float sf[MT][8][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int j = 0; j < 8; j++) sf[mt][j][0] = sf[mt][j][1] = sf[mt][j][2] = sf[mt][j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DH / 16; kk++) {
                uint32_t af[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) ldsm_x4(af[mt], a_addr<LDS>(Qs, w0 + 16 * mt, kk * 16, lane));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t bf[4];
                    ldsm_x4(bf, b_addr<LDS>(Ks, np * 16, kk * 16, lane));
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        M::mma(sf[mt][2 * np], af[mt], bf[0], bf[1]);
                        M::mma(sf[mt][2 * np + 1], af[mt], bf[2], bf[3]);
                    }
                }
            }
            const bool full = k0 >= ds_max && k0 + BK - 1 <= gi_min; // all keys visible to all rows
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float s = sf[mt][j][e]; // unscaled (scale > 0: the same maximum)
                        if (!full) {
                            const int64_t key = k0 + 8 * j + 2 * tig + (e & 1);
                            const int c = e >> 1;
                            if (!(key >= ds[mt][c] && key <= gi[mt][c])) s = -INFINITY;
                        }
                        sf[mt][j][e] = s;
                        if (e < 2)
                            mx0 = fmaxf(mx0, s);
                        else
                            mx1 = fmaxf(mx1, s);
                    }
                mx0 = quad_max(mx0) * sl2;
                mx1 = quad_max(mx1) * sl2;
                const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
                const float al0 = m[mt][0] == -INFINITY ? 0.0f : ex2(m[mt][0] - mn0);
                const float al1 = m[mt][1] == -INFINITY ? 0.0f : ex2(m[mt][1] - mn1);
                const float sub0 = mn0 == -INFINITY ? 0.0f : mn0, sub1 = mn1 == -INFINITY ? 0.0f : mn1;
                float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    sf[mt][j][0] = ex2(fmaf(sf[mt][j][0], sl2, -sub0));
                    sf[mt][j][1] = ex2(fmaf(sf[mt][j][1], sl2, -sub0));
                    sf[mt][j][2] = ex2(fmaf(sf[mt][j][2], sl2, -sub1));
                    sf[mt][j][3] = ex2(fmaf(sf[mt][j][3], sl2, -sub1));
                    ps0 += sf[mt][j][0] + sf[mt][j][1];
                    ps1 += sf[mt][j][2] + sf[mt][j][3];
                }
                l[mt][0] = l[mt][0] * al0 + ps0; // per-lane partial sums; the quad is added at the end
                l[mt][1] = l[mt][1] * al1 + ps1;
                m[mt][0] = mn0;
                m[mt][1] = mn1;
#pragma unroll
                for (int j = 0; j < ND; j++) {
                    of[mt][j][0] *= al0;
                    of[mt][j][1] *= al0;
                    of[mt][j][2] *= al1;
                    of[mt][j][3] *= al1;
                }
#pragma unroll
                for (int kk = 0; kk < BK / 16; kk++) { // O += P V (V fragments read per m-tile)
                    uint32_t pa[4];
                    pa[0] = M::pack(sf[mt][2 * kk][0], sf[mt][2 * kk][1]);
                    pa[1] = M::pack(sf[mt][2 * kk][2], sf[mt][2 * kk][3]);
                    pa[2] = M::pack(sf[mt][2 * kk + 1][0], sf[mt][2 * kk + 1][1]);
                    pa[3] = M::pack(sf[mt][2 * kk + 1][2], sf[mt][2 * kk + 1][3]);
#pragma unroll
                    for (int dp = 0; dp < DH / 16; dp++) {
                        uint32_t bf[4];
                        ldsm_x4_t(bf, bt_addr<LDS>(Vs, kk * 16, dp * 16, lane));
                        M::mma(of[mt][2 * dp], pa, bf[0], bf[1]);
                        M::mma(of[mt][2 * dp + 1], pa, bf[2], bf[3]);
                    }
                }
            }
        }
        __syncthreads(); // this buffer is refilled two tiles on
    }

#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int r0 = w0 + 16 * mt + g, r1 = r0 + 8;
        const float l0 = quad_sum(l[mt][0]), l1 = quad_sum(l[mt][1]);
        const float inv0 = r0 < nq ? 1.0f / l0 : 0.0f, inv1 = r1 < nq ? 1.0f / l1 : 0.0f;
#pragma unroll
        for (int j = 0; j < ND; j++) {
            const int d = j * 8 + 2 * tig;
            if (r0 < nq)
                store2<T>(a.o, ((t0 + r0) * a.Hq + h) * DH + d, of[mt][j][0] * inv0, of[mt][j][1] * inv0);
            if (r1 < nq)
                store2<T>(a.o, ((t0 + r1) * a.Hq + h) * DH + d, of[mt][j][2] * inv1, of[mt][j][3] * inv1);
        }
        if (tig == 0) {
            if (r0 < nq) a.lse[(t0 + r0) * a.Hq + h] = (float)((double)m[mt][0] * LN2 + log((double)l0));
            if (r1 < nq) a.lse[(t0 + r1) * a.Hq + h] = (float)((double)m[mt][1] * LN2 + log((double)l1));
        }
    }
}

// ---- backward: dq ----
template <typename T, int DH, int NW>
__global__ void __launch_bounds__(32 * NW) attn_bwd_dq_mma_kernel(attn_args a) {
    using M = mma_type<T>;
    constexpr int LDS = DH + 8, ND = DH / 8;
    constexpr int NTH = 32 * NW, BQ = 16 * NW;
    extern __shared__ __align__(16) unsigned char smem[];
    T *Qs = (T *)smem, *dOs = Qs + BQ * LDS, *KV = dOs + BQ * LDS; // KV: 2 x (K, V)
    int *gi_s = (int *)(KV + 4 * BK * LDS), *ds_s = gi_s + BQ;
    float *lse_s = (float *)(ds_s + BQ), *di_s = lse_s + BQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int64_t t0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * BQ; // latest tiles first
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int nq = (int)(a.Tq - t0 < BQ ? a.Tq - t0 : BQ);
    const float sl2 = a.scale * LOG2E;

    load_tile_async<T, DH, BQ, NTH>(Qs, a.q, t0, nq, a.Hq, h);
    load_tile_async<T, DH, BQ, NTH>(dOs, a.dout, t0, nq, a.Hq, h);
    cp_commit();
    load_rows<true, BQ, true, NTH>(a, t0, nq, h, gi_s, ds_s, lse_s, di_s);
    __syncthreads();
    // D_i for the dk/dv kernel, which reads it instead of the output tile
    for (int r = tid; r < nq; r += NTH) a.di[(t0 + r) * a.Hq + h] = di_s[r];

    const int64_t kb = ds_s[0], ke = (int64_t)gi_s[nq - 1] + 1;
    const int ntiles = (int)((ke - kb + BK - 1) / BK);
    const int w0 = warp * 16, wlast = w0 + 15 < nq - 1 ? w0 + 15 : nq - 1;
    const bool wvalid = w0 < nq;
    const int64_t wlo = wvalid ? ds_s[w0] : 0, whi = wvalid ? gi_s[wlast] : -1;
    const int64_t ds_max = ds_s[w0 + 15], gi_min = gi_s[w0];
    const int r0 = w0 + g, r1 = r0 + 8;
    const int gi0 = gi_s[r0], gi1 = gi_s[r1], ds0 = ds_s[r0], ds1 = ds_s[r1];
    const float lse0 = lse_s[r0] * LOG2E, lse1 = lse_s[r1] * LOG2E; // base 2
    const float di0 = di_s[r0], di1 = di_s[r1];

    float dqf[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) dqf[j][0] = dqf[j][1] = dqf[j][2] = dqf[j][3] = 0.0f;

    auto stage = [&](int it) {
        const int64_t k0 = kb + (int64_t)it * BK;
        const int nk = (int)(ke - k0 < BK ? ke - k0 : BK);
        T *Kb = KV + (it & 1) * 2 * BK * LDS;
        load_tile_async<T, DH, BK, NTH>(Kb, a.k, k0, nk, a.Hkv, hk);
        load_tile_async<T, DH, BK, NTH>(Kb + BK * LDS, a.v, k0, nk, a.Hkv, hk);
        cp_commit();
    };
    if (ntiles > 0) stage(0);
    for (int it = 0; it < ntiles; it++) {
        const int64_t k0 = kb + (int64_t)it * BK;
        if (it + 1 < ntiles) {
            stage(it + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T *Ks = KV + (it & 1) * 2 * BK * LDS, *Vs = Ks + BK * LDS;
        if (wvalid && k0 <= whi && k0 + BK - 1 >= wlo) {
            float sf[8][4], pf[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) sf[j][e] = pf[j][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DH / 16; kk++) {
                uint32_t aq[4], ao[4];
                ldsm_x4(aq, a_addr<LDS>(Qs, w0, kk * 16, lane));
                ldsm_x4(ao, a_addr<LDS>(dOs, w0, kk * 16, lane));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t bk[4], bv[4];
                    ldsm_x4(bk, b_addr<LDS>(Ks, np * 16, kk * 16, lane));
                    ldsm_x4(bv, b_addr<LDS>(Vs, np * 16, kk * 16, lane));
                    M::mma(sf[2 * np], aq, bk[0], bk[1]);
                    M::mma(sf[2 * np + 1], aq, bk[2], bk[3]);
                    M::mma(pf[2 * np], ao, bv[0], bv[1]);
                    M::mma(pf[2 * np + 1], ao, bv[2], bv[3]);
                }
            }
            const bool full = k0 >= ds_max && k0 + BK - 1 <= gi_min;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    bool ok = true;
                    if (!full) {
                        const int64_t key = k0 + 8 * j + 2 * tig + (e & 1);
                        ok = e < 2 ? key >= ds0 && key <= gi0 : key >= ds1 && key <= gi1;
                    }
                    const float p = ok ? ex2(fmaf(sf[j][e], sl2, -(e < 2 ? lse0 : lse1))) : 0.0f;
                    sf[j][e] = p * (pf[j][e] - (e < 2 ? di0 : di1)); // dS
                }
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                uint32_t da[4];
                da[0] = M::pack(sf[2 * kk][0], sf[2 * kk][1]);
                da[1] = M::pack(sf[2 * kk][2], sf[2 * kk][3]);
                da[2] = M::pack(sf[2 * kk + 1][0], sf[2 * kk + 1][1]);
                da[3] = M::pack(sf[2 * kk + 1][2], sf[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < DH / 16; dp++) {
                    uint32_t bf[4];
                    ldsm_x4_t(bf, bt_addr<LDS>(Ks, kk * 16, dp * 16, lane));
                    M::mma(dqf[2 * dp], da, bf[0], bf[1]);
                    M::mma(dqf[2 * dp + 1], da, bf[2], bf[3]);
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < ND; j++) {
        const int d = j * 8 + 2 * tig;
        if (r0 < nq)
            store2<T>(a.dq, ((t0 + r0) * a.Hq + h) * DH + d, a.scale * dqf[j][0], a.scale * dqf[j][1]);
        if (r1 < nq)
            store2<T>(a.dq, ((t0 + r1) * a.Hq + h) * DH + d, a.scale * dqf[j][2], a.scale * dqf[j][3]);
    }
}

// ---- backward: dk, dv (and with FUSED dq) ----
// One block per (64 keys, query head). Query tiles (Q, dO and the rows'
// metadata) are double-buffered with cp.async. Writes fp32 partial sums of
// this query head to a.dkv_part; attn_dkdv_sum_kernel adds each group.
// FUSED: also dQ += dS K for each query tile (dS^T through shared memory,
// 16 query rows x 64 head columns per warp), added into a.dq_acc (fp32) with
// vector atomics: one pass instead of the dq kernel's second computation of
// S and dP, but the order of the additions, so dQ's last bits, vary by run.
template <typename T, int DH, int BQ2, bool FUSED, int KW>
__global__ void __launch_bounds__(32 * KW) attn_bwd_dkdv_mma_kernel(attn_args a) {
    using M = mma_type<T>;
    constexpr int NTK = 32 * KW, BK = 16 * KW; // KW warps of 16 keys
    constexpr int LDS = DH + 8, ND = DH / 8, NQ = BQ2 / 8; // n-tiles of 8 queries
    constexpr int LDD = BQ2 + 8;                           // row stride of the dS^T tile
    extern __shared__ __align__(16) unsigned char smem[];
    T *Ks = (T *)smem, *Vs = Ks + BK * LDS, *QB = Vs + BK * LDS; // QB: 2 x (Q, dO)
    T *dSs = QB + 4 * BQ2 * LDS;                                 // FUSED: (64 keys, BQ2) dS^T
    int *meta = (int *)(dSs + (FUSED ? BK * LDD : 0));           // 2 x (gi, ds, lse, di)
    int *range_s = meta + 8 * BQ2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int64_t j0 = (int64_t)blockIdx.x * BK;
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int nk = (int)(a.T - j0 < BK ? a.T - j0 : BK);
    const float sl2 = a.scale * LOG2E;

    load_tile_async<T, DH, BK, NTK>(Ks, a.k, j0, nk, a.Hkv, hk);
    load_tile_async<T, DH, BK, NTK>(Vs, a.v, j0, nk, a.Hkv, hk);
    cp_commit();
    if (tid == 0) { // local queries that can see a key of this tile
        int64_t s, e;
        doc_bounds(a.cu, a.ndocs, j0 + nk - 1, &s, &e);
        range_s[0] = (int)first_query_at(a.qidx, a.Tq, j0);
        range_s[1] = (int)first_query_at(a.qidx, a.Tq, e);
    }
    __syncthreads();
    const int64_t tq_begin = range_s[0], tq_end = range_s[1];
    const int ntiles = (int)((tq_end - tq_begin + BQ2 - 1) / BQ2);

    const int w0 = warp * 16;
    const int64_t kj0 = j0 + w0 + g, kj1 = kj0 + 8, kend = j0 + nk; // this lane's keys
    const int64_t wfirst = j0 + w0, wlastk = wfirst + 15;           // the warp's keys

    float dkf[ND][4], dvf[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) dkf[j][e] = dvf[j][e] = 0.0f;

    auto stage = [&](int it) {
        const int64_t t0 = tq_begin + (int64_t)it * BQ2;
        const int nq = (int)(tq_end - t0 < BQ2 ? tq_end - t0 : BQ2);
        T *Qb = QB + (it & 1) * 2 * BQ2 * LDS;
        load_tile_async<T, DH, BQ2, NTK>(Qb, a.q, t0, nq, a.Hq, h);
        load_tile_async<T, DH, BQ2, NTK>(Qb + BQ2 * LDS, a.dout, t0, nq, a.Hq, h);
        cp_commit();
        int *mb = meta + (it & 1) * 4 * BQ2;
        load_rows<true, BQ2, false, NTK>(a, t0, nq, h, mb, mb + BQ2, (float *)(mb + 2 * BQ2), nullptr);
        for (int r = tid; r < BQ2; r += NTK) /* D_i */
            ((float *)(mb + 3 * BQ2))[r] = r < nq ? a.di[(t0 + r) * a.Hq + h] : 0.0f;
    };
    if (ntiles > 0) stage(0);
    for (int it = 0; it < ntiles; it++) {
        const int64_t t0 = tq_begin + (int64_t)it * BQ2;
        const int nq = (int)(tq_end - t0 < BQ2 ? tq_end - t0 : BQ2);
        if (it + 1 < ntiles) {
            stage(it + 1);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const T *Qs = QB + (it & 1) * 2 * BQ2 * LDS, *dOs = Qs + BQ2 * LDS;
        const int *gi_s = meta + (it & 1) * 4 * BQ2, *ds_s = gi_s + BQ2;
        const float *lse_s = (const float *)(gi_s + 2 * BQ2), *di_s = lse_s + BQ2;
        // causal: the tile's last query precedes every key of this warp
        if (w0 < nk && gi_s[nq - 1] >= wfirst) {
            // every query of the tile sees every key of the warp (rows ascend)
            const bool full = nq == BQ2 && wlastk < kend && gi_s[0] >= wlastk && ds_s[BQ2 - 1] <= wfirst;
            float ql[NQ][2], qd[NQ][2]; // this lane's queries: lse (base 2) and D_i
#pragma unroll
            for (int j = 0; j < NQ; j++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    ql[j][c] = lse_s[8 * j + 2 * tig + c] * LOG2E;
                    qd[j][c] = di_s[8 * j + 2 * tig + c];
                }
            float sf[NQ][4], pf[NQ][4];
#pragma unroll
            for (int j = 0; j < NQ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) sf[j][e] = pf[j][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DH / 16; kk++) {
                uint32_t ak[4], av[4];
                ldsm_x4(ak, a_addr<LDS>(Ks, w0, kk * 16, lane));
                ldsm_x4(av, a_addr<LDS>(Vs, w0, kk * 16, lane));
#pragma unroll
                for (int np = 0; np < BQ2 / 16; np++) {
                    uint32_t bq[4], bo[4];
                    ldsm_x4(bq, b_addr<LDS>(Qs, np * 16, kk * 16, lane));
                    ldsm_x4(bo, b_addr<LDS>(dOs, np * 16, kk * 16, lane));
                    M::mma(sf[2 * np], ak, bq[0], bq[1]);
                    M::mma(sf[2 * np + 1], ak, bq[2], bq[3]);
                    M::mma(pf[2 * np], av, bo[0], bo[1]);
                    M::mma(pf[2 * np + 1], av, bo[2], bo[3]);
                }
            }
            // rows are keys (kj0, kj1), columns queries q
#pragma unroll
            for (int j = 0; j < NQ; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = e & 1;
                    bool ok = true;
                    if (!full) {
                        const int q = 8 * j + 2 * tig + c;
                        const int64_t key = e < 2 ? kj0 : kj1;
                        ok = key < kend && key >= ds_s[q] && key <= gi_s[q];
                    }
                    const float p = ok ? ex2(fmaf(sf[j][e], sl2, -ql[j][c])) : 0.0f;
                    pf[j][e] = p * (pf[j][e] - qd[j][c]); // dS^T
                    sf[j][e] = p;                         // P^T
                }
            if constexpr (FUSED) { // dS^T rows of this warp's keys, rounded as for dK
#pragma unroll
                for (int j = 0; j < NQ; j++) {
                    const int q = 8 * j + 2 * tig;
                    *(uint32_t *)(dSs + (w0 + g) * LDD + q) = M::pack(pf[j][0], pf[j][1]);
                    *(uint32_t *)(dSs + (w0 + g + 8) * LDD + q) = M::pack(pf[j][2], pf[j][3]);
                }
            }
#pragma unroll
            for (int kk = 0; kk < BQ2 / 16; kk++) {
                uint32_t pa[4], da[4];
                pa[0] = M::pack(sf[2 * kk][0], sf[2 * kk][1]);
                pa[1] = M::pack(sf[2 * kk][2], sf[2 * kk][3]);
                pa[2] = M::pack(sf[2 * kk + 1][0], sf[2 * kk + 1][1]);
                pa[3] = M::pack(sf[2 * kk + 1][2], sf[2 * kk + 1][3]);
                da[0] = M::pack(pf[2 * kk][0], pf[2 * kk][1]);
                da[1] = M::pack(pf[2 * kk][2], pf[2 * kk][3]);
                da[2] = M::pack(pf[2 * kk + 1][0], pf[2 * kk + 1][1]);
                da[3] = M::pack(pf[2 * kk + 1][2], pf[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < DH / 16; dp++) {
                    uint32_t bo[4], bq[4];
                    ldsm_x4_t(bo, bt_addr<LDS>(dOs, kk * 16, dp * 16, lane));
                    ldsm_x4_t(bq, bt_addr<LDS>(Qs, kk * 16, dp * 16, lane));
                    M::mma(dvf[2 * dp], pa, bo[0], bo[1]);
                    M::mma(dvf[2 * dp + 1], pa, bo[2], bo[3]);
                    M::mma(dkf[2 * dp], da, bq[0], bq[1]);
                    M::mma(dkf[2 * dp + 1], da, bq[2], bq[3]);
                }
            }
        } else if constexpr (FUSED) { // this warp's keys see no query of the tile: dS = 0
            for (int i = lane; i < 16 * (BQ2 / 2); i += 32)
                *(uint32_t *)(dSs + (w0 + i / (BQ2 / 2)) * LDD + 2 * (i % (BQ2 / 2))) = 0u;
        }
        if constexpr (FUSED) {
            __syncthreads(); // the whole dS^T tile
            if (gi_s[nq - 1] >= j0) { // some key of the block is visible
                // warp: query rows qr..qr+15 of each 32, head columns dc..dc+WC-1
                constexpr int WC = DH / (KW / 2);
                const int dc = (warp >> 1) * WC;
#pragma unroll
                for (int mi = 0; mi < BQ2 / 32; mi++) {
                    const int qr = mi * 32 + (warp & 1) * 16;
                    float acc[WC / 8][4];
#pragma unroll
                    for (int n = 0; n < WC / 8; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
                    for (int kk = 0; kk < BK / 16; kk++) {
                        uint32_t da[4];
                        ldsm_x4_t(da, at_addr<LDD>(dSs, qr, kk * 16, lane));
#pragma unroll
                        for (int dp = 0; dp < WC / 16; dp++) {
                            uint32_t bk[4];
                            ldsm_x4_t(bk, bt_addr<LDS>(Ks, kk * 16, dc + dp * 16, lane));
                            M::mma(acc[2 * dp], da, bk[0], bk[1]);
                            M::mma(acc[2 * dp + 1], da, bk[2], bk[3]);
                        }
                    }
                    const int r0 = qr + g, r1 = r0 + 8;
                    float *row0 = a.dq_acc + ((t0 + r0) * a.Hq + h) * DH, *row1 = row0 + 8 * a.Hq * DH;
#pragma unroll
                    for (int n = 0; n < WC / 8; n++) {
                        const int d = dc + n * 8 + 2 * tig;
                        if (r0 < nq) red_add2(row0 + d, acc[n][0], acc[n][1]);
                        if (r1 < nq) red_add2(row1 + d, acc[n][2], acc[n][3]);
                    }
                }
            }
        }
        __syncthreads(); // this buffer is refilled two tiles on
    }
    // partial sums of this query head: (2, T, Hq, DH) fp32
    float *pk = a.dkv_part, *pv = pk + a.T * a.Hq * DH;
#pragma unroll
    for (int j = 0; j < ND; j++) {
        const int d = j * 8 + 2 * tig;
        if (kj0 < kend) {
            const int64_t off = (kj0 * a.Hq + h) * DH + d;
            *(float2 *)(pk + off) = make_float2(dkf[j][0], dkf[j][1]);
            *(float2 *)(pv + off) = make_float2(dvf[j][0], dvf[j][1]);
        }
        if (kj1 < kend) {
            const int64_t off = (kj1 * a.Hq + h) * DH + d;
            *(float2 *)(pk + off) = make_float2(dkf[j][2], dkf[j][3]);
            *(float2 *)(pv + off) = make_float2(dvf[j][2], dvf[j][3]);
        }
    }
}

// dK = scale * (sum of the group's partials), dV = sum, over the query heads
// of each kv head in order; a thread per pair of head columns.
template <typename T, int DH>
__global__ void attn_dkdv_sum_kernel(attn_args a) {
    const int group = a.Hq / a.Hkv;
    const int64_t n = a.T * a.Hkv * (DH / 2);
    const float *pk = a.dkv_part, *pv = pk + a.T * a.Hq * DH;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int d = (int)(i % (DH / 2)) * 2;
        const int64_t th = i / (DH / 2), key = th / a.Hkv; // th = key * Hkv + hk
        const int hk = (int)(th % a.Hkv);
        float k0 = 0.0f, k1 = 0.0f, v0 = 0.0f, v1 = 0.0f;
        for (int gq = 0; gq < group; gq++) {
            const int64_t off = (key * a.Hq + hk * group + gq) * DH + d;
            const float2 kk = *(const float2 *)(pk + off), vv = *(const float2 *)(pv + off);
            k0 += kk.x, k1 += kk.y, v0 += vv.x, v1 += vv.y;
        }
        store2<T>(a.dk, th * DH + d, a.scale * k0, a.scale * k1);
        store2<T>(a.dv, th * DH + d, v0, v1);
    }
}

// D_i = dout_i . out_i (fp32) for every (query, head), a warp per row (the
// fused backward's first step; the dq kernel computes it otherwise).
template <typename T, int DH>
__global__ void attn_di_kernel(attn_args a) {
    const int64_t rows = a.Tq * a.Hq;
    const int lane = threadIdx.x & 31;
    for (int64_t r = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows;
         r += ((int64_t)gridDim.x * blockDim.x) >> 5) {
        const T *o = (const T *)a.out + r * DH, *d = (const T *)a.dout + r * DH;
        float acc = 0.0f;
        for (int i = lane; i < DH; i += 32) acc += (float)o[i] * (float)d[i];
        acc = warp_sum(acc);
        if (lane == 0) a.di[r] = acc;
    }
}

// dq = scale * dq_acc, rounded to T.
template <typename T>
__global__ void attn_dq_store_kernel(attn_args a, int64_t n) {
    for (int64_t i = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * 2; i < n;
         i += (int64_t)gridDim.x * blockDim.x * 2) {
        const float2 v = *(const float2 *)(a.dq_acc + i);
        store2<T>(a.dq, i, a.scale * v.x, a.scale * v.y);
    }
}

// ---- host side ----

namespace {

template <typename K>
loom_status launch(loom_ctx *ctx, const char *op, K kernel, dim3 grid, int threads, size_t smem,
                   cudaStream_t s, const attn_args &a) {
    loom_status st = check(
        ctx, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), op);
    if (st) return st;
    kernel<<<grid, threads, smem, s>>>(a);
    return check_launch(ctx, op);
}

constexpr size_t tile_bytes(int rows, int DH) { return (size_t)rows * (DH + 8) * 2; }

// Warps per block of the forward and dq kernels (16 query rows each): 8
// (128-row tiles) measured 5-10% slower than 4 on the H100 (bench/RESULTS.md).
constexpr int QW = 4;

template <typename T, int DH, int MT>
loom_status fwd_mt(loom_ctx *ctx, const attn_args &a, cudaStream_t s) {
    constexpr int NW = QW, BQ = 16 * NW * MT;
    const size_t smem = tile_bytes(BQ + 4 * BK, DH) + 2 * BQ * sizeof(int);
    dim3 grid((unsigned)((a.Tq + BQ - 1) / BQ), (unsigned)a.Hq);
    return launch(ctx, "attention_fwd", attn_fwd_mma_kernel<T, DH, NW, MT>, grid, 32 * NW, smem, s, a);
}

// m-tiles per warp of the forward: 2 for D = 128 (0.80 -> 0.74 ms on the H100
// at T=4096, 32/8 heads; a little register spilling), 1 for D = 64 (2 was 2%
// slower there).
template <typename T, int DH>
loom_status fwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s) {
    return fwd_mt<T, DH, DH == 128 ? 2 : 1>(ctx, a, s);
}

template <typename T, int DH>
loom_status dq(loom_ctx *ctx, const attn_args &a, cudaStream_t s) {
    constexpr int NW = QW, BQ = 16 * NW;
    const size_t smem = tile_bytes(2 * BQ + 4 * BK, DH) + 4 * BQ * 4;
    dim3 grid((unsigned)((a.Tq + BQ - 1) / BQ), (unsigned)a.Hq);
    return launch(ctx, "attention_bwd", attn_bwd_dq_mma_kernel<T, DH, NW>, grid, 32 * NW, smem, s, a);
}

// The backward is fused (one pass, dQ added with atomics: its last bits vary
// by run) unless LOOM_ATTN_DETERMINISTIC=1 (the dq and dk/dv kernels, one
// writer per output: bitwise repeatable, the dq kernel recomputing S and dP).
bool deterministic() {
    const char *e = getenv("LOOM_ATTN_DETERMINISTIC");
    return e && *e && strcmp(e, "0") != 0;
}

// Warps (16 keys each) per block of the dk/dv kernel: 8 (128 keys, half the
// dQ atomics, one block per SM) measured 4-6% slower than 4 on the H100.
constexpr int KW = 4;

unsigned grid_for(int64_t n, int per_block) {
    const int64_t b = (n + per_block - 1) / per_block;
    return (unsigned)(b < 1 ? 1 : b < 65536 ? b : 65536);
}

template <typename T, int DH>
loom_status bwd(loom_ctx *ctx, const attn_args &args, cudaStream_t s) {
    attn_args a = args;
    const bool fused = !deterministic();
    /* one stream-ordered scratch, freed behind the kernels: the per-query-head
     * dK, dV partial sums (2, T, Hq, DH), with fused the fp32 dQ (Tq, Hq, DH),
     * and D_i (Tq, Hq), which the dk/dv kernel reads */
    const size_t part = (size_t)2 * a.T * a.Hq * DH, dqn = fused ? (size_t)a.Tq * a.Hq * DH : 0;
    const size_t bytes = (part + dqn + (size_t)a.Tq * a.Hq) * sizeof(float);
    void *scratch = nullptr;
    loom_status st = check(ctx, cudaMallocAsync(&scratch, bytes, s), "attention_bwd (scratch)");
    if (st) return st;
    a.dkv_part = (float *)scratch;
    a.dq_acc = fused ? a.dkv_part + part : nullptr;
    a.di = a.dkv_part + part + dqn;
    constexpr int BQ2 = DH > 64 ? 32 : 64; // query rows per step of the dk/dv kernel (registers)
    constexpr int BKK = 16 * KW;
    size_t smem = tile_bytes(2 * BKK + 4 * BQ2, DH) + 8 * BQ2 * 4 + 2 * sizeof(int);
    dim3 grid((unsigned)((a.T + BKK - 1) / BKK), (unsigned)a.Hq);
    if (fused) {
        if (a.Tq > 0) {
            st = check(ctx, cudaMemsetAsync(a.dq_acc, 0, dqn * sizeof(float), s), "attention_bwd");
            if (!st) {
                attn_di_kernel<T, DH><<<grid_for(a.Tq * a.Hq * 32, 256), 256, 0, s>>>(a);
                st = check_launch(ctx, "attention_bwd");
            }
        }
        smem += (size_t)BKK * (BQ2 + 8) * sizeof(T);
        if (!st)
            st = launch(ctx, "attention_bwd", attn_bwd_dkdv_mma_kernel<T, DH, BQ2, true, KW>, grid,
                        32 * KW, smem, s, a);
        if (!st && a.Tq > 0) {
            attn_dq_store_kernel<T><<<grid_for((int64_t)dqn / 2, 256), 256, 0, s>>>(a, (int64_t)dqn);
            st = check_launch(ctx, "attention_bwd");
        }
    } else {
        if (a.Tq > 0) st = dq<T, DH>(ctx, a, s);
        if (!st)
            st = launch(ctx, "attention_bwd", attn_bwd_dkdv_mma_kernel<T, DH, BQ2, false, KW>, grid,
                        32 * KW, smem, s, a);
    }
    if (!st) {
        attn_dkdv_sum_kernel<T, DH><<<grid_for(a.T * a.Hkv * (DH / 2), 256), 256, 0, s>>>(a);
        st = check_launch(ctx, "attention_bwd");
    }
    loom_status sf = check(ctx, cudaFreeAsync(scratch, s), "attention_bwd (scratch)");
    return st ? st : sf;
}

bool mine(const attn_args &a, bool backward) {
    if ((a.dt != LOOM_BF16 && a.dt != LOOM_F16) || (a.D != 64 && a.D != 128)) return false;
    if (!aligned16(a.q) || !aligned16(a.k) || !aligned16(a.v)) return false;
    if (!backward) return aligned16(a.o);
    return aligned16(a.dout) && aligned16(a.dq) && aligned16(a.dk) && aligned16(a.dv);
}

} // namespace

bool attn_mma_fwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s, loom_status *st) {
    if (!mine(a, false)) return false;
    if (a.dt == LOOM_BF16)
        *st = a.D == 64 ? fwd<__nv_bfloat16, 64>(ctx, a, s) : fwd<__nv_bfloat16, 128>(ctx, a, s);
    else
        *st = a.D == 64 ? fwd<__half, 64>(ctx, a, s) : fwd<__half, 128>(ctx, a, s);
    return true;
}

bool attn_mma_bwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s, loom_status *st) {
    if (!mine(a, true)) return false;
    if (a.dt == LOOM_BF16)
        *st = a.D == 64 ? bwd<__nv_bfloat16, 64>(ctx, a, s) : bwd<__nv_bfloat16, 128>(ctx, a, s);
    else
        *st = a.D == 64 ? bwd<__half, 64>(ctx, a, s) : bwd<__half, 128>(ctx, a, s);
    return true;
}

} // namespace loom_cuda
