// Tensor-core attention for BF16/F16 inputs with head size 64 or 128 (the
// semantics of ops_attention.cu; that file dispatches here).
//
// FlashAttention-2 structure on mma.sync.m16n8k16 (fp32 accumulators), tiles
// in shared memory (rows padded by 16 bytes: conflict-free ldmatrix), loaded
// with cp.async two tiles deep; 4 warps per block, each warp owning 16 rows
// of the block's tile:
//   forward  block = 64 queries x 1 head; loop over 64-key tiles; online
//            softmax in registers; P (rounded to the input type) times V.
//   dq       block = 64 queries x 1 head; per key tile S = QK^T, dP = dO V^T,
//            dS = P (dP - D_i) (rounded to the input type), dQ += dS K.
//   dk, dv   block = 64 keys x 1 kv head; loop over the group's query heads
//            and the query tiles (BQ2 rows) that see the keys:
//            S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, with
//            D_i = dO_i . O_i as the dq kernel computed it (not the O tile).
// Every output has one writer and a fixed summation order: deterministic.
#include <stdint.h>

#include "ops_attention.cuh"

namespace loom_cuda {
namespace {

constexpr int NT = ATTN_NT;
constexpr int BQ = 64; // queries per block (forward, dq)
constexpr int BK = 64; // keys per tile (forward, dq) and per block (dk, dv)

template <typename T> struct mma_type;
template <> struct mma_type<__nv_bfloat16> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct mma_type<__half> {
    static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&v);
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Shared-memory addresses of one lane for ldmatrix.x4 over a row-major tile
// with row stride LDS (elements):
// A operand, rows r0..r0+15, columns c0..c0+15: regs = a0..a3.
template <int LDS, typename T>
__device__ __forceinline__ const T *a_addr(const T *tile, int r0, int c0, int lane) {
    return tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + c0 + (lane >> 4) * 8;
}
// B operand of two n-tiles from a tile stored [n][k] (n rows n0..n0+15, k
// columns k0..k0+15): regs = {b0, b1} of n-tile 0, {b0, b1} of n-tile 1.
template <int LDS, typename T>
__device__ __forceinline__ const T *b_addr(const T *tile, int n0, int k0, int lane) {
    return tile + (n0 + (lane & 7) + (lane >> 4) * 8) * LDS + k0 + ((lane >> 3) & 1) * 8;
}
// B operand of two n-tiles from a tile stored [k][n] (k rows k0..k0+15, n
// columns n0..n0+15), loaded with .trans: same register order.
template <int LDS, typename T>
__device__ __forceinline__ const T *bt_addr(const T *tile, int k0, int n0, int lane) {
    return tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + n0 + (lane >> 4) * 8;
}

// cp.async of 16 bytes (zeros when !valid: nothing is read from src then).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ROWS x DH tile of a (rows, H, DH) tensor (rows r0.., n valid, head h) into
// shared memory with row stride DH + 8, in 16-byte cp.async pieces, zeros
// past n rows; complete after cp_commit, cp_wait and __syncthreads.
template <typename T, int DH, int ROWS>
__device__ __forceinline__ void load_tile_async(T *dst, const void *src, int64_t r0, int n, int64_t H,
                                                int64_t h) {
    constexpr int LDS = DH + 8, CH = DH / 8;
    const T *s = (const T *)src;
    for (int idx = threadIdx.x; idx < ROWS * CH; idx += NT) {
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
// current one is multiplied.
template <typename T, int DH>
__global__ void __launch_bounds__(NT) attn_fwd_mma_kernel(attn_args a) {
    using M = mma_type<T>;
    constexpr int LDS = DH + 8, ND = DH / 8; // n-tiles of 8 head columns
    extern __shared__ __align__(16) unsigned char smem[];
    T *Qs = (T *)smem, *KV = Qs + BQ * LDS; // KV: 2 buffers of K then V tiles
    int *gi_s = (int *)(KV + 4 * BK * LDS), *ds_s = gi_s + BQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int64_t t0 = (int64_t)blockIdx.x * BQ;
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int nq = (int)(a.Tq - t0 < BQ ? a.Tq - t0 : BQ);

    load_tile_async<T, DH, BQ>(Qs, a.q, t0, nq, a.Hq, h);
    cp_commit();
    load_rows<false, BQ>(a, t0, nq, h, gi_s, ds_s, nullptr, nullptr);
    __syncthreads();

    const int64_t kb = ds_s[0], ke = (int64_t)gi_s[nq - 1] + 1;
    const int ntiles = (int)((ke - kb + BK - 1) / BK);
    const int w0 = warp * 16, wlast = w0 + 15 < nq - 1 ? w0 + 15 : nq - 1;
    const bool wvalid = w0 < nq;
    // this warp's keys: [first row's doc start, last row]; all-visible test bounds
    const int64_t wlo = wvalid ? ds_s[w0] : 0, whi = wvalid ? gi_s[wlast] : -1;
    const int64_t ds_max = ds_s[w0 + 15], gi_min = gi_s[w0];
    const int r0 = w0 + g, r1 = r0 + 8;
    const int gi0 = gi_s[r0], gi1 = gi_s[r1], ds0 = ds_s[r0], ds1 = ds_s[r1];

    float of[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) of[j][0] = of[j][1] = of[j][2] = of[j][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    auto stage = [&](int it) {
        const int64_t k0 = kb + (int64_t)it * BK;
        const int nk = (int)(ke - k0 < BK ? ke - k0 : BK);
        T *Kb = KV + (it & 1) * 2 * BK * LDS;
        load_tile_async<T, DH, BK>(Kb, a.k, k0, nk, a.Hkv, hk);
        load_tile_async<T, DH, BK>(Kb + BK * LDS, a.v, k0, nk, a.Hkv, hk);
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
            float sf[8][4];
#pragma unroll
            for (int j = 0; j < 8; j++) sf[j][0] = sf[j][1] = sf[j][2] = sf[j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < DH / 16; kk++) {
                uint32_t af[4];
                ldsm_x4(af, a_addr<LDS>(Qs, w0, kk * 16, lane));
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    uint32_t bf[4];
                    ldsm_x4(bf, b_addr<LDS>(Ks, np * 16, kk * 16, lane));
                    M::mma(sf[2 * np], af, bf[0], bf[1]);
                    M::mma(sf[2 * np + 1], af, bf[2], bf[3]);
                }
            }
            const bool full = k0 >= ds_max && k0 + BK - 1 <= gi_min; // all keys visible to all rows
            float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
            for (int j = 0; j < 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float s = sf[j][e] * a.scale;
                    if (!full) {
                        const int64_t key = k0 + 8 * j + 2 * tig + (e & 1);
                        const bool ok = e < 2 ? key >= ds0 && key <= gi0 : key >= ds1 && key <= gi1;
                        if (!ok) s = -INFINITY;
                    }
                    sf[j][e] = s;
                    if (e < 2)
                        mx0 = fmaxf(mx0, s);
                    else
                        mx1 = fmaxf(mx1, s);
                }
            mx0 = quad_max(mx0);
            mx1 = quad_max(mx1);
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float al0 = m0 == -INFINITY ? 0.0f : expf(m0 - mn0);
            const float al1 = m1 == -INFINITY ? 0.0f : expf(m1 - mn1);
            const float sub0 = mn0 == -INFINITY ? 0.0f : mn0, sub1 = mn1 == -INFINITY ? 0.0f : mn1;
            float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                sf[j][0] = expf(sf[j][0] - sub0);
                sf[j][1] = expf(sf[j][1] - sub0);
                sf[j][2] = expf(sf[j][2] - sub1);
                sf[j][3] = expf(sf[j][3] - sub1);
                ps0 += sf[j][0] + sf[j][1];
                ps1 += sf[j][2] + sf[j][3];
            }
            l0 = l0 * al0 + ps0; // per-lane partial sums; the quad is added at the end
            l1 = l1 * al1 + ps1;
            m0 = mn0;
            m1 = mn1;
#pragma unroll
            for (int j = 0; j < ND; j++) {
                of[j][0] *= al0;
                of[j][1] *= al0;
                of[j][2] *= al1;
                of[j][3] *= al1;
            }
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++) {
                uint32_t pa[4];
                pa[0] = M::pack(sf[2 * kk][0], sf[2 * kk][1]);
                pa[1] = M::pack(sf[2 * kk][2], sf[2 * kk][3]);
                pa[2] = M::pack(sf[2 * kk + 1][0], sf[2 * kk + 1][1]);
                pa[3] = M::pack(sf[2 * kk + 1][2], sf[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < DH / 16; dp++) {
                    uint32_t bf[4];
                    ldsm_x4_t(bf, bt_addr<LDS>(Vs, kk * 16, dp * 16, lane));
                    M::mma(of[2 * dp], pa, bf[0], bf[1]);
                    M::mma(of[2 * dp + 1], pa, bf[2], bf[3]);
                }
            }
        }
        __syncthreads(); // this buffer is refilled two tiles on
    }

    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const float inv0 = r0 < nq ? 1.0f / l0 : 0.0f, inv1 = r1 < nq ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int j = 0; j < ND; j++) {
        const int d = j * 8 + 2 * tig;
        if (r0 < nq) store2<T>(a.o, ((t0 + r0) * a.Hq + h) * DH + d, of[j][0] * inv0, of[j][1] * inv0);
        if (r1 < nq) store2<T>(a.o, ((t0 + r1) * a.Hq + h) * DH + d, of[j][2] * inv1, of[j][3] * inv1);
    }
    if (tig == 0) {
        if (r0 < nq) a.lse[(t0 + r0) * a.Hq + h] = (float)((double)m0 + log((double)l0));
        if (r1 < nq) a.lse[(t0 + r1) * a.Hq + h] = (float)((double)m1 + log((double)l1));
    }
}

// ---- backward: dq ----
template <typename T, int DH>
__global__ void __launch_bounds__(NT) attn_bwd_dq_mma_kernel(attn_args a) {
    using M = mma_type<T>;
    constexpr int LDS = DH + 8, ND = DH / 8;
    extern __shared__ __align__(16) unsigned char smem[];
    T *Qs = (T *)smem, *dOs = Qs + BQ * LDS, *KV = dOs + BQ * LDS; // KV: 2 x (K, V)
    int *gi_s = (int *)(KV + 4 * BK * LDS), *ds_s = gi_s + BQ;
    float *lse_s = (float *)(ds_s + BQ), *di_s = lse_s + BQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int64_t t0 = (int64_t)blockIdx.x * BQ;
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv);
    const int nq = (int)(a.Tq - t0 < BQ ? a.Tq - t0 : BQ);

    load_tile_async<T, DH, BQ>(Qs, a.q, t0, nq, a.Hq, h);
    load_tile_async<T, DH, BQ>(dOs, a.dout, t0, nq, a.Hq, h);
    cp_commit();
    load_rows<true, BQ>(a, t0, nq, h, gi_s, ds_s, lse_s, di_s);
    __syncthreads();
    // D_i for the dk/dv kernel, which reads it instead of the output tile
    for (int r = tid; r < nq; r += NT) a.di[(t0 + r) * a.Hq + h] = di_s[r];

    const int64_t kb = ds_s[0], ke = (int64_t)gi_s[nq - 1] + 1;
    const int ntiles = (int)((ke - kb + BK - 1) / BK);
    const int w0 = warp * 16, wlast = w0 + 15 < nq - 1 ? w0 + 15 : nq - 1;
    const bool wvalid = w0 < nq;
    const int64_t wlo = wvalid ? ds_s[w0] : 0, whi = wvalid ? gi_s[wlast] : -1;
    const int64_t ds_max = ds_s[w0 + 15], gi_min = gi_s[w0];
    const int r0 = w0 + g, r1 = r0 + 8;
    const int gi0 = gi_s[r0], gi1 = gi_s[r1], ds0 = ds_s[r0], ds1 = ds_s[r1];
    const float lse0 = lse_s[r0], lse1 = lse_s[r1], di0 = di_s[r0], di1 = di_s[r1];

    float dqf[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++) dqf[j][0] = dqf[j][1] = dqf[j][2] = dqf[j][3] = 0.0f;

    auto stage = [&](int it) {
        const int64_t k0 = kb + (int64_t)it * BK;
        const int nk = (int)(ke - k0 < BK ? ke - k0 : BK);
        T *Kb = KV + (it & 1) * 2 * BK * LDS;
        load_tile_async<T, DH, BK>(Kb, a.k, k0, nk, a.Hkv, hk);
        load_tile_async<T, DH, BK>(Kb + BK * LDS, a.v, k0, nk, a.Hkv, hk);
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
                    const float p = ok ? expf(sf[j][e] * a.scale - (e < 2 ? lse0 : lse1)) : 0.0f;
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

// ---- backward: dk, dv ----
// Query tiles (Q, dO and O, for D_i) are double-buffered with cp.async.
template <typename T, int DH, int BQ2>
__global__ void __launch_bounds__(NT) attn_bwd_dkdv_mma_kernel(attn_args a) {
    using M = mma_type<T>;
    constexpr int LDS = DH + 8, ND = DH / 8, NQ = BQ2 / 8; // n-tiles of 8 queries
    extern __shared__ __align__(16) unsigned char smem[];
    T *Ks = (T *)smem, *Vs = Ks + BK * LDS, *QB = Vs + BK * LDS; // QB: 2 x (Q, dO)
    int *meta = (int *)(QB + 4 * BQ2 * LDS);                     // 2 x (gi, ds, lse, di)
    int *range_s = meta + 8 * BQ2;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int64_t j0 = (int64_t)blockIdx.x * BK;
    const int hk = blockIdx.y, group = a.Hq / a.Hkv;
    const int nk = (int)(a.T - j0 < BK ? a.T - j0 : BK);

    load_tile_async<T, DH, BK>(Ks, a.k, j0, nk, a.Hkv, hk);
    load_tile_async<T, DH, BK>(Vs, a.v, j0, nk, a.Hkv, hk);
    cp_commit();
    if (tid == 0) { // local queries that can see a key of this tile
        int64_t s, e;
        doc_bounds(a.cu, a.ndocs, j0 + nk - 1, &s, &e);
        range_s[0] = (int)first_query_at(a.qidx, a.Tq, j0);
        range_s[1] = (int)first_query_at(a.qidx, a.Tq, e);
    }
    __syncthreads();
    const int64_t tq_begin = range_s[0], tq_end = range_s[1];
    const int per_head = (int)((tq_end - tq_begin + BQ2 - 1) / BQ2), ntiles = per_head * group;

    const int w0 = warp * 16;
    const int64_t kj0 = j0 + w0 + g, kj1 = kj0 + 8, kend = j0 + nk; // this lane's keys
    const int64_t wfirst = j0 + w0;                                  // the warp's first key

    float dkf[ND][4], dvf[ND][4];
#pragma unroll
    for (int j = 0; j < ND; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) dkf[j][e] = dvf[j][e] = 0.0f;

    auto stage = [&](int it) {
        const int h = hk * group + it / per_head;
        const int64_t t0 = tq_begin + (int64_t)(it % per_head) * BQ2;
        const int nq = (int)(tq_end - t0 < BQ2 ? tq_end - t0 : BQ2);
        T *Qb = QB + (it & 1) * 2 * BQ2 * LDS;
        load_tile_async<T, DH, BQ2>(Qb, a.q, t0, nq, a.Hq, h);
        load_tile_async<T, DH, BQ2>(Qb + BQ2 * LDS, a.dout, t0, nq, a.Hq, h);
        cp_commit();
        int *mb = meta + (it & 1) * 4 * BQ2;
        load_rows<true, BQ2, false>(a, t0, nq, h, mb, mb + BQ2, (float *)(mb + 2 * BQ2), nullptr);
        for (int r = tid; r < BQ2; r += NT) /* D_i from the dq kernel */
            ((float *)(mb + 3 * BQ2))[r] = r < nq ? a.di[(t0 + r) * a.Hq + h] : 0.0f;
    };
    if (ntiles > 0) stage(0);
    for (int it = 0; it < ntiles; it++) {
        const int64_t t0 = tq_begin + (int64_t)(it % per_head) * BQ2;
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
        const float *lse_s = (const float *)(gi_s + 2 * BQ2);
        const float *di_s = (const float *)(meta + (it & 1) * 4 * BQ2 + 3 * BQ2);
        __syncthreads();
        // causal: the tile's last query precedes every key of this warp
        if (w0 < nk && gi_s[nq - 1] >= wfirst) {
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
                    const int q = 8 * j + 2 * tig + (e & 1);
                    const int64_t key = e < 2 ? kj0 : kj1;
                    const bool ok = key < kend && key >= ds_s[q] && key <= gi_s[q];
                    const float p = ok ? expf(sf[j][e] * a.scale - lse_s[q]) : 0.0f;
                    pf[j][e] = p * (pf[j][e] - di_s[q]); // dS^T
                    sf[j][e] = p;                        // P^T
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
        }
        __syncthreads(); // this buffer is refilled two tiles on
    }
#pragma unroll
    for (int j = 0; j < ND; j++) {
        const int d = j * 8 + 2 * tig;
        if (kj0 < kend) {
            const int64_t off = (kj0 * a.Hkv + hk) * DH + d;
            store2<T>(a.dk, off, a.scale * dkf[j][0], a.scale * dkf[j][1]);
            store2<T>(a.dv, off, dvf[j][0], dvf[j][1]);
        }
        if (kj1 < kend) {
            const int64_t off = (kj1 * a.Hkv + hk) * DH + d;
            store2<T>(a.dk, off, a.scale * dkf[j][2], a.scale * dkf[j][3]);
            store2<T>(a.dv, off, dvf[j][2], dvf[j][3]);
        }
    }
}

// ---- host side ----

namespace {

template <typename K>
loom_status launch(loom_ctx *ctx, const char *op, K kernel, dim3 grid, size_t smem, cudaStream_t s,
                   const attn_args &a) {
    loom_status st = check(
        ctx, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), op);
    if (st) return st;
    kernel<<<grid, NT, smem, s>>>(a);
    return check_launch(ctx, op);
}

constexpr size_t tile_bytes(int rows, int DH) { return (size_t)rows * (DH + 8) * 2; }

template <typename T, int DH>
loom_status fwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s) {
    const size_t smem = tile_bytes(BQ + 4 * BK, DH) + 2 * BQ * sizeof(int);
    dim3 grid((unsigned)((a.Tq + BQ - 1) / BQ), (unsigned)a.Hq);
    return launch(ctx, "attention_fwd", attn_fwd_mma_kernel<T, DH>, grid, smem, s, a);
}

template <typename T, int DH>
loom_status bwd(loom_ctx *ctx, const attn_args &args, cudaStream_t s) {
    attn_args a = args;
    a.di = nullptr;
    loom_status st = LOOM_OK;
    if (a.Tq > 0) {
        /* D_i, computed once by the dq kernel (in double) and read by the
         * dk/dv kernel: a stream-ordered allocation, freed behind it */
        st = check(ctx, cudaMallocAsync((void **)&a.di, (size_t)a.Tq * a.Hq * sizeof(float), s),
                   "attention_bwd (D_i scratch)");
        if (st) return st;
        const size_t smem = tile_bytes(2 * BQ + 4 * BK, DH) + 4 * BQ * 4;
        dim3 grid((unsigned)((a.Tq + BQ - 1) / BQ), (unsigned)a.Hq);
        st = launch(ctx, "attention_bwd", attn_bwd_dq_mma_kernel<T, DH>, grid, smem, s, a);
    }
    if (!st) {
        constexpr int BQ2 = DH > 64 ? 32 : 64; // query rows per step of the dk/dv kernel (registers)
        const size_t smem = tile_bytes(2 * BK + 4 * BQ2, DH) + 8 * BQ2 * 4 + 2 * sizeof(int);
        dim3 grid((unsigned)((a.T + BK - 1) / BK), (unsigned)a.Hkv);
        st = launch(ctx, "attention_bwd", attn_bwd_dkdv_mma_kernel<T, DH, BQ2>, grid, smem, s, a);
    }
    if (a.di) {
        loom_status sf = check(ctx, cudaFreeAsync(a.di, s), "attention_bwd (D_i scratch)");
        if (!st) st = sf;
    }
    return st;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

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
