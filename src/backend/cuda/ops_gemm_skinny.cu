// Grouped GEMMs with a skinny side (at most SK = 16): LoRA's products on the
// experts (rank r), per expert e on its rows (cpu gemm_grouped's semantics,
// row-major, C = alpha op(A) op(B) + beta C):
//
//   rowdot  (ta false, N <= 16)  u = x A_e^T, du = dy B_e: each row of C a few
//           dot products of length K, the row read once (its lanes read
//           different parts of it)
//   expand  (ta false, K <= 16)  y += u B_e^T, dx += du A_e: each element of C
//           a sum of K products, C read and written once
//   reduce  (ta true, M or N <= 16, tb false)  dB_e += dy_e^T u_e, dA_e +=
//           du_e^T x_e: sums over the group's rows, cut into chunks whose
//           partial sums (fp32, in the GEMM handle's workspace) a second kernel
//           adds in chunk order (the same bits every run; no atomics)
//
// cuBLAS's grouped GEMM runs these as its sm80 kernel with tiles mostly
// empty, and with fp32 C as a loop of split-K GEMMs inside the call: 200
// launches a Qwen3-30B-A3B layer. Here each is one launch (reduce: two), all
// groups in it, each block finding its group from the descriptors' first
// block (binary search). loom_cuda_gemm_skinny says *done false when a call
// is not of these shapes (or not aligned for the vector paths): the caller
// runs it as before.
#include <stdlib.h>

#include <type_traits>

#include "../backend.h"
#include "ops_common.cuh"

namespace {

using namespace loom_cuda;

constexpr int SK = 16;  // the widest skinny side
constexpr int NT = 256; // threads a block

struct Desc {
    const void *A, *B;
    void *C;
    int M, N, K;
    int blk0;      // the group's first block
    int nch;       // reduce: its row chunks
    long long p0;  // reduce: its first partial sum (floats)
};

static_assert(sizeof(Desc) <= LOOM_CUDA_SKINNY_DESC_BYTES, "a descriptor's room");


// 8 consecutive elements (16-byte aligned: two accesses for fp32)
template <typename T> __device__ __forceinline__ void load8(const T *p, float (&v)[8]) {
    if constexpr (sizeof(T) == 4) {
        const float4 a = ((const float4 *)p)[0], b = ((const float4 *)p)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
        v[7] = b.w;
    } else {
        const uint4 u = *(const uint4 *)p;
        const T *e = (const T *)&u;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = to_f(e[i]);
    }
}
template <typename T> __device__ __forceinline__ void store8(T *p, const float (&v)[8]) {
    if constexpr (sizeof(T) == 4) {
        ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
        ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        uint4 u;
        T *e = (T *)&u;
#pragma unroll
        for (int i = 0; i < 8; i++) e[i] = from_f<T>(v[i]);
        *(uint4 *)p = u;
    }
}

// the group of block b: the last whose first block is <= b (groups of no
// blocks share their successor's first block and are passed over)
__device__ __forceinline__ int group_of(const Desc *d, int G, int b) {
    int lo = 0, hi = G - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (d[mid].blk0 <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

// op(B)'s element (k, n): B is (K, N) row-major, or (N, K) when tb
template <typename T>
__device__ __forceinline__ float opb(const T *b, bool tb, int64_t ldb, int k, int n) {
    return to_f(tb ? b[(int64_t)n * ldb + k] : b[(int64_t)k * ldb + n]);
}

// rowdot: LN lanes a row, each summing its own 8-element slices of the row
// (lane l: k = 8l, 8l + 8 LN, ...; a row's lanes read 16 LN contiguous
// bytes together) into all NB columns, then added across the lanes (in a
// fixed order: the same bits every run); RR rows a thread, so a block's
// staged op(B) (KC of k at a time, column-major: one lane's 8 k of a
// column are two 16-byte reads) serves NT / LN * RR rows
constexpr int LN = 8, RR = 2, KC = 512;
template <typename T, typename TC, int NB>
__global__ void __launch_bounds__(NT)
    rowdot_kernel(const Desc *ds, int G, bool tb, int64_t lda, int64_t ldb, int64_t ldc,
                  float alpha, float beta) {
    constexpr int RPB = NT / LN * RR;
    __shared__ __align__(16) float sb[NB][KC];
    const Desc d = ds[group_of(ds, G, (int)blockIdx.x)];
    const int lane = (int)threadIdx.x % LN, rg = (int)threadIdx.x / LN;
    const int row0 = ((int)blockIdx.x - d.blk0) * RPB + rg * RR;
    const T *b = (const T *)d.B;
    float acc[RR][NB];
#pragma unroll
    for (int r = 0; r < RR; r++)
#pragma unroll
        for (int n = 0; n < NB; n++) acc[r][n] = 0.0f;
    for (int k0 = 0; k0 < d.K; k0 += KC) {
        const int kn = min(KC, d.K - k0);
        __syncthreads();
        for (int i = (int)threadIdx.x; i < kn * NB; i += NT) {
            const int nn = i / kn, kk = i % kn;
            sb[nn][kk] = nn < d.N ? opb(b, tb, ldb, k0 + kk, nn) : 0.0f;
        }
        __syncthreads();
        for (int kk = 8 * lane; kk < kn; kk += 8 * LN) { // K a multiple of 8
            float x[RR][8];
#pragma unroll
            for (int r = 0; r < RR; r++) {
                if (row0 + r < d.M)
                    load8((const T *)d.A + (int64_t)(row0 + r) * lda + k0 + kk, x[r]);
                else
#pragma unroll
                    for (int i = 0; i < 8; i++) x[r][i] = 0.0f;
            }
#pragma unroll
            for (int n = 0; n < NB; n++) {
                const float4 w0 = *(const float4 *)&sb[n][kk], w1 = *(const float4 *)&sb[n][kk + 4];
#pragma unroll
                for (int r = 0; r < RR; r++) {
                    float t = acc[r][n];
                    t = fmaf(x[r][0], w0.x, t), t = fmaf(x[r][1], w0.y, t);
                    t = fmaf(x[r][2], w0.z, t), t = fmaf(x[r][3], w0.w, t);
                    t = fmaf(x[r][4], w1.x, t), t = fmaf(x[r][5], w1.y, t);
                    t = fmaf(x[r][6], w1.z, t), t = fmaf(x[r][7], w1.w, t);
                    acc[r][n] = t;
                }
            }
        }
    }
    // the lanes' sums, butterfly over the LN lanes of a row (all lanes end
    // with the same value, added in the same order)
#pragma unroll
    for (int r = 0; r < RR; r++)
#pragma unroll
        for (int n = 0; n < NB; n++)
#pragma unroll
            for (int o = LN / 2; o > 0; o /= 2)
                acc[r][n] += __shfl_xor_sync(0xffffffffu, acc[r][n], o, LN);
#pragma unroll
    for (int r = 0; r < RR; r++) {
        if (row0 + r >= d.M) continue;
#pragma unroll
        for (int n = 0; n < NB; n++) {
            if (n % LN != lane || n >= d.N) continue;
            TC *c = (TC *)d.C + (int64_t)(row0 + r) * ldc + n;
            float v = alpha * acc[r][n];
            if (beta != 0.0f) v = fmaf(beta, to_f(*c), v);
            *c = from_f<TC>(v);
        }
    }
}

// rowdot on tensor cores (16-bit inputs, K a multiple of 32; the default,
// twice the FMA kernel's speed on an H200; LOOM_SKINNY_MMA=0 turns it off):
// a warp takes 16 rows, mma.sync m16n8k16 (fp32 sums) per 8 columns of C. Lane l (g = l / 4, q = l % 4) reads 16 bytes of rows g and
// g + 8 at k = k0 + 8q; a sum over k may take k in any order when A and B
// take the same one, so those 8 elements are the two MMAs' pairs (PTX's A
// fragment: a0 = (g, 2q..), a1 = (g + 8, 2q..), a2 = (g, 2q + 8..), a3 = (g
// + 8, 2q + 8..); B's b0 = (2q.., n g), b1 = (2q + 8.., n g)): elements 0-3
// the first MMA's k 2q, 2q + 1, 2q + 8, 2q + 9, elements 4-7 the second's,
// and op(B)'s column g read at the same 8 k. op(B) staged as T, its columns
// padded apart (no bank conflicts between a phase's two columns).
constexpr int MKC = 512, MPAD = 32, MROWS = 16 * (NT / 32);
template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same<T, __nv_bfloat16>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <typename T, typename TC, int NTL>
__global__ void __launch_bounds__(NT)
    rowdot_mma_kernel(const Desc *ds, int G, bool tb, int64_t lda, int64_t ldb, int64_t ldc,
                      float alpha, float beta) {
    __shared__ __align__(16) T sb[8 * NTL][MKC + MPAD];
    const Desc d = ds[group_of(ds, G, (int)blockIdx.x)];
    const int lane = (int)threadIdx.x % 32, g = lane / 4, q = lane % 4;
    const int r0 = ((int)blockIdx.x - d.blk0) * MROWS + (int)threadIdx.x / 32 * 16;
    const T *b = (const T *)d.B;
    const T *a0p = (const T *)d.A + (int64_t)(r0 + g) * lda, *a8p = a0p + 8 * lda;
    const bool l0 = r0 + g < d.M, l8 = r0 + g + 8 < d.M;
    float c[NTL][4];
#pragma unroll
    for (int t = 0; t < NTL; t++) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
    const T zero = from_f<T>(0.0f);
    for (int k0 = 0; k0 < d.K; k0 += MKC) {
        const int kn = min(MKC, d.K - k0);
        __syncthreads();
        for (int n = 0; n < 8 * NTL; n++)
            for (int kk = (int)threadIdx.x; kk < kn; kk += NT)
                sb[n][kk] = n < d.N ? b[tb ? (int64_t)n * ldb + k0 + kk : (int64_t)(k0 + kk) * ldb + n]
                                    : zero;
        __syncthreads();
#pragma unroll 4
        for (int kk = 0; kk < kn; kk += 32) { // K a multiple of 32
            const uint4 z = make_uint4(0, 0, 0, 0);
            const uint4 x0 = l0 ? *(const uint4 *)(a0p + k0 + kk + 8 * q) : z;
            const uint4 x8 = l8 ? *(const uint4 *)(a8p + k0 + kk + 8 * q) : z;
#pragma unroll
            for (int t = 0; t < NTL; t++) {
                const uint4 w = *(const uint4 *)&sb[8 * t + g][kk + 8 * q];
                mma16816<T>(c[t], x0.x, x8.x, x0.y, x8.y, w.x, w.y);
                mma16816<T>(c[t], x0.z, x8.z, x0.w, x8.w, w.z, w.w);
            }
        }
    }
    // C's fragment: c0, c1 at (g, 2q..), c2, c3 at (g + 8, 2q..)
#pragma unroll
    for (int t = 0; t < NTL; t++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int row = r0 + g + (i >= 2 ? 8 : 0), n = 8 * t + 2 * q + (i & 1);
            if (row >= d.M || n >= d.N) continue;
            TC *cp = (TC *)d.C + (int64_t)row * ldc + n;
            float v = alpha * c[t][i];
            if (beta != 0.0f) v = fmaf(beta, to_f(*cp), v);
            *cp = from_f<TC>(v);
        }
}

// 8 values of C as raw 16-byte words (two for fp32), and back to floats
template <typename T> struct Raw8 {
    uint4 w[sizeof(T) == 4 ? 2 : 1];
};
template <typename T> __device__ __forceinline__ void raw_load8(const T *p, Raw8<T> &r) {
#pragma unroll
    for (int i = 0; i < (int)(sizeof r.w / sizeof r.w[0]); i++) r.w[i] = ((const uint4 *)p)[i];
}
template <typename T> __device__ __forceinline__ void raw_to_f(const Raw8<T> &r, float (&v)[8]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            v[4 * i] = __uint_as_float(r.w[i].x), v[4 * i + 1] = __uint_as_float(r.w[i].y);
            v[4 * i + 2] = __uint_as_float(r.w[i].z), v[4 * i + 3] = __uint_as_float(r.w[i].w);
        }
    } else {
        const T *e = (const T *)&r.w[0];
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = to_f(e[i]);
    }
}

// expand: a block is RB rows x NTILE columns of C; op(B)'s K x NTILE and A's
// RB x K staged; thread: 8 consecutive columns of RT rows (a row lane's, RL
// apart), each k's 8 values of op(B) read once (two 16-byte reads) for all
// RT rows. C's old values are all requested first, before the staging, so
// that a thread has its RT reads in flight at once (read one row at a time,
// between stores the compiler may not move them across, they left the
// kernel at a third of the memory's bandwidth: too few bytes in flight)
constexpr int NTILE = 256, RB = 64;
template <typename T, typename TC>
__global__ void __launch_bounds__(NT)
    expand_kernel(const Desc *ds, int G, bool tb, int64_t lda, int64_t ldb, int64_t ldc,
                  float alpha, float beta) {
    __shared__ __align__(16) float sb[SK][NTILE];
    __shared__ float sa[RB][SK];
    const Desc d = ds[group_of(ds, G, (int)blockIdx.x)];
    const int r0 = ((int)blockIdx.x - d.blk0) * RB, n0 = (int)blockIdx.y * NTILE;
    if (n0 >= d.N) return; // the whole block
    const int cg = (int)threadIdx.x % (NTILE / 8), n = n0 + cg * 8;
    constexpr int RL = NT / (NTILE / 8), RT = RB / RL; // row lanes; rows a thread
    const int rl = (int)threadIdx.x / (NTILE / 8);
    Raw8<TC> old[RT];
    if (beta != 0.0f && n < d.N) // (N a multiple of 8)
#pragma unroll
        for (int q = 0; q < RT; q++)
            if (r0 + rl + q * RL < d.M)
                raw_load8((const TC *)d.C + (int64_t)(r0 + rl + q * RL) * ldc + n, old[q]);
    const T *a = (const T *)d.A, *b = (const T *)d.B;
    for (int i = (int)threadIdx.x; i < d.K * NTILE; i += NT) {
        const int kk = i / NTILE, nn = i % NTILE;
        sb[kk][nn] = n0 + nn < d.N ? opb(b, tb, ldb, kk, n0 + nn) : 0.0f;
    }
    for (int i = (int)threadIdx.x; i < RB * d.K; i += NT) {
        const int rr = i / d.K, kk = i % d.K;
        sa[rr][kk] = r0 + rr < d.M ? to_f(a[(int64_t)(r0 + rr) * lda + kk]) : 0.0f;
    }
    __syncthreads();
    if (n >= d.N) return;
    float v[RT][8];
#pragma unroll
    for (int q = 0; q < RT; q++)
#pragma unroll
        for (int i = 0; i < 8; i++) v[q][i] = 0.0f;
    for (int kk = 0; kk < d.K; kk++) {
        const float4 w0 = *(const float4 *)&sb[kk][cg * 8], w1 = *(const float4 *)&sb[kk][cg * 8 + 4];
        const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int q = 0; q < RT; q++) {
            const float s = sa[rl + q * RL][kk];
#pragma unroll
            for (int i = 0; i < 8; i++) v[q][i] = fmaf(s, w[i], v[q][i]);
        }
    }
#pragma unroll
    for (int q = 0; q < RT; q++) {
        const int rr = rl + q * RL;
        if (r0 + rr >= d.M) continue;
        TC *c = (TC *)d.C + (int64_t)(r0 + rr) * ldc + n;
        float o[8];
        if (beta != 0.0f) raw_to_f(old[q], o);
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[q][i] = beta != 0.0f ? fmaf(beta, o[i], alpha * v[q][i]) : alpha * v[q][i];
        store8(c, v[q]);
    }
}

// reduce, first pass: block = (row chunk, NT columns of the big side);
// partial[(i, j)] of chunk ch at p0 + ch M N + i N + j. BIGM: the big side is
// M (op(A)'s columns = A's), the skinny N (B's); else the reverse.
constexpr int RK = 64; // rows of the skinny side staged at a time
template <typename T, bool BIGM>
__global__ void __launch_bounds__(NT)
    reduce_part_kernel(const Desc *ds, int G, int64_t lda, int64_t ldb, int KC, float *part) {
    __shared__ float4 ss[RK][SK / 4];
    const Desc d = ds[group_of(ds, G, (int)blockIdx.x)];
    const int S = BIGM ? d.N : d.M, Bn = BIGM ? d.M : d.N;
    const int nbt = (Bn + NT - 1) / NT, local = (int)blockIdx.x - d.blk0;
    const int ch = local / nbt, bi = (local % nbt) * NT + (int)threadIdx.x;
    const T *big = (const T *)(BIGM ? d.A : d.B), *sk = (const T *)(BIGM ? d.B : d.A);
    const int64_t ldbig = BIGM ? lda : ldb, ldsk = BIGM ? ldb : lda;
    const int k0 = ch * KC, k1 = min(d.K, k0 + KC);
    float acc[SK];
#pragma unroll
    for (int s = 0; s < SK; s++) acc[s] = 0.0f;
    for (int kb = k0; kb < k1; kb += RK) {
        const int n = min(RK, k1 - kb);
        __syncthreads();
        for (int i = (int)threadIdx.x; i < RK * SK; i += NT) {
            const int rr = i / SK, s = i % SK;
            ((float *)ss[rr])[s] = rr < n && s < S ? to_f(sk[(int64_t)(kb + rr) * ldsk + s]) : 0.0f;
        }
        __syncthreads();
        if (bi < Bn)
            for (int rr = 0; rr < n; rr++) {
                const float v = to_f(big[(int64_t)(kb + rr) * ldbig + bi]);
#pragma unroll
                for (int q = 0; q < SK / 4; q++) {
                    const float4 w = ss[rr][q];
                    acc[4 * q] = fmaf(v, w.x, acc[4 * q]);
                    acc[4 * q + 1] = fmaf(v, w.y, acc[4 * q + 1]);
                    acc[4 * q + 2] = fmaf(v, w.z, acc[4 * q + 2]);
                    acc[4 * q + 3] = fmaf(v, w.w, acc[4 * q + 3]);
                }
            }
    }
    if (bi >= Bn) return;
    float *p = part + d.p0 + (int64_t)ch * d.M * d.N;
#pragma unroll // (a loop to S would index acc at run time: local memory)
    for (int s = 0; s < SK; s++)
        if (s < S) p[BIGM ? (int64_t)bi * d.N + s : (int64_t)s * d.N + bi] = acc[s];
}

// reduce, first pass, vector form (the big side's rows 16-byte aligned, its
// columns a multiple of RC): a warp is 4 column groups x 8 row lanes, a
// thread RC consecutive columns (one 16- or 8-byte read a row) of every 8th
// row of the chunk, for all NS skinny columns; the 8 row lanes' sums are
// then added by shuffles in a fixed order (the same bits every run). The
// scalar form above reads 2 bytes a thread a row: a fifth of the memory's
// bandwidth. A block covers 32 RC columns of the big side.
template <int NS> struct RedVec {
    static constexpr int RC = NS <= 8 ? 8 : 4; // columns a thread
    static constexpr int CB = NT / 8 * RC;      // columns a block
};

template <typename T, int RC> __device__ __forceinline__ void load_rc(const T *p, float (&v)[RC]) {
    if constexpr (RC == 8) {
        load8(p, v);
    } else if constexpr (sizeof(T) == 4) {
        const float4 a = *(const float4 *)p;
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    } else {
        const uint2 u = *(const uint2 *)p;
        const T *e = (const T *)&u;
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = to_f(e[i]);
    }
}

template <typename T, bool BIGM, int NS>
__global__ void __launch_bounds__(NT, 2)
    reduce_vec_kernel(const Desc *ds, int G, int64_t lda, int64_t ldb, int KC, float *part) {
    constexpr int RC = RedVec<NS>::RC, CB = RedVec<NS>::CB;
    __shared__ float4 ss[RK][NS / 4];
    const Desc d = ds[group_of(ds, G, (int)blockIdx.x)];
    const int S = BIGM ? d.N : d.M, Bn = BIGM ? d.M : d.N;
    const int nbt = (Bn + CB - 1) / CB, local = (int)blockIdx.x - d.blk0, ch = local / nbt;
    const int lane = (int)threadIdx.x % 32, rl = lane % 8;
    const int col = (local % nbt) * CB + ((int)threadIdx.x / 32 * 4 + lane / 8) * RC;
    const T *big = (const T *)(BIGM ? d.A : d.B), *sk = (const T *)(BIGM ? d.B : d.A);
    const int64_t ldbig = BIGM ? lda : ldb, ldsk = BIGM ? ldb : lda;
    const int k0 = ch * KC, k1 = min(d.K, k0 + KC);
    float acc[RC][NS];
#pragma unroll
    for (int c = 0; c < RC; c++)
#pragma unroll
        for (int q = 0; q < NS; q++) acc[c][q] = 0.0f;
    for (int kb = k0; kb < k1; kb += RK) {
        const int n = min(RK, k1 - kb);
        __syncthreads();
        for (int i = (int)threadIdx.x; i < RK * NS; i += NT) {
            const int rr = i / NS, q = i % NS;
            ((float *)ss[rr])[q] = rr < n && q < S ? to_f(sk[(int64_t)(kb + rr) * ldsk + q]) : 0.0f;
        }
        __syncthreads();
        if (col < Bn) {
#pragma unroll 4
            for (int rr = rl; rr < n; rr += 8) {
                float v[RC];
                load_rc<T, RC>(big + (int64_t)(kb + rr) * ldbig + col, v);
#pragma unroll
                for (int q4 = 0; q4 < NS / 4; q4++) {
                    const float4 w = ss[rr][q4];
#pragma unroll
                    for (int c = 0; c < RC; c++) {
                        acc[c][4 * q4] = fmaf(v[c], w.x, acc[c][4 * q4]);
                        acc[c][4 * q4 + 1] = fmaf(v[c], w.y, acc[c][4 * q4 + 1]);
                        acc[c][4 * q4 + 2] = fmaf(v[c], w.z, acc[c][4 * q4 + 2]);
                        acc[c][4 * q4 + 3] = fmaf(v[c], w.w, acc[c][4 * q4 + 3]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < RC; c++)
#pragma unroll
        for (int q = 0; q < NS; q++)
#pragma unroll
            for (int o = 1; o < 8; o *= 2) acc[c][q] += __shfl_xor_sync(0xffffffffu, acc[c][q], o);
    if (rl != 0 || col >= Bn) return;
    float *p = part + d.p0 + (int64_t)ch * d.M * d.N;
#pragma unroll
    for (int c = 0; c < RC; c++)
#pragma unroll
        for (int q = 0; q < NS; q++)
            if (q < S) p[BIGM ? (int64_t)(col + c) * d.N + q : (int64_t)q * d.N + col + c] = acc[c][q];
}

// reduce, second pass: C = alpha (the chunks' sum, in chunk order) + beta C
template <typename TC>
__global__ void __launch_bounds__(NT)
    reduce_final_kernel(const Desc *ds, const float *part, int64_t ldc, float alpha, float beta) {
    const Desc d = ds[blockIdx.y];
    const int64_t MN = (int64_t)d.M * d.N;
    for (int64_t e = (int64_t)blockIdx.x * NT + threadIdx.x; e < MN; e += (int64_t)gridDim.x * NT) {
        float s = 0.0f;
        for (int ch = 0; ch < d.nch; ch++) s += part[d.p0 + ch * MN + e];
        TC *c = (TC *)d.C + (e / d.N) * ldc + e % d.N;
        float v = alpha * s;
        if (beta != 0.0f) v = fmaf(beta, to_f(*c), v);
        *c = from_f<TC>(v);
    }
}

enum Mode { NONE, ROWDOT, ROWDOT_MMA, EXPAND, REDUCE, REDUCE_VEC };

template <typename T, typename TC>
void launch(Mode mode, int np, bool bigm, const Desc *dd, int G, int nblk, int ny, bool tb,
            int64_t lda, int64_t ldb, int64_t ldc, float alpha, float beta, int KC, float *part,
            cudaStream_t s) {
    switch (mode) {
    case ROWDOT: // np: the columns' bound (4, 8 or 16)
        if (np == 4)
            rowdot_kernel<T, TC, 4><<<nblk, NT, 0, s>>>(dd, G, tb, lda, ldb, ldc, alpha, beta);
        else if (np == 8)
            rowdot_kernel<T, TC, 8><<<nblk, NT, 0, s>>>(dd, G, tb, lda, ldb, ldc, alpha, beta);
        else
            rowdot_kernel<T, TC, 16><<<nblk, NT, 0, s>>>(dd, G, tb, lda, ldb, ldc, alpha, beta);
        break;
    case ROWDOT_MMA: // np: the columns' bound (8 or 16)
        if constexpr (sizeof(T) == 2) {
            if (np <= 8)
                rowdot_mma_kernel<T, TC, 1><<<nblk, NT, 0, s>>>(dd, G, tb, lda, ldb, ldc, alpha,
                                                                 beta);
            else
                rowdot_mma_kernel<T, TC, 2><<<nblk, NT, 0, s>>>(dd, G, tb, lda, ldb, ldc, alpha,
                                                                 beta);
        }
        break;
    case EXPAND:
        expand_kernel<T, TC><<<dim3(nblk, ny), NT, 0, s>>>(dd, G, tb, lda, ldb, ldc, alpha, beta);
        break;
    case REDUCE:
        if (nblk > 0) {
            if (bigm)
                reduce_part_kernel<T, true><<<nblk, NT, 0, s>>>(dd, G, lda, ldb, KC, part);
            else
                reduce_part_kernel<T, false><<<nblk, NT, 0, s>>>(dd, G, lda, ldb, KC, part);
        }
        reduce_final_kernel<TC><<<dim3(ny, G), NT, 0, s>>>(dd, part, ldc, alpha, beta);
        break;
    case REDUCE_VEC: // np: the skinny side's bound (8 or 16)
        if (nblk > 0) {
            if (bigm && np <= 8)
                reduce_vec_kernel<T, true, 8><<<nblk, NT, 0, s>>>(dd, G, lda, ldb, KC, part);
            else if (bigm)
                reduce_vec_kernel<T, true, 16><<<nblk, NT, 0, s>>>(dd, G, lda, ldb, KC, part);
            else if (np <= 8)
                reduce_vec_kernel<T, false, 8><<<nblk, NT, 0, s>>>(dd, G, lda, ldb, KC, part);
            else
                reduce_vec_kernel<T, false, 16><<<nblk, NT, 0, s>>>(dd, G, lda, ldb, KC, part);
        }
        reduce_final_kernel<TC><<<dim3(ny, G), NT, 0, s>>>(dd, part, ldc, alpha, beta);
        break;
    case NONE: break;
    }
}

bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }


} // namespace

extern "C" loom_status loom_cuda_gemm_skinny(loom_ctx *ctx, bool ta, bool tb, int G,
                                             const loom_gemm_group *g, float alpha, int64_t lda,
                                             int64_t ldb, loom_dtype ab, float beta,
                                             loom_dtype cdt, int64_t ldc, void *desc,
                                             size_t desc_cap, void *ws, size_t ws_bytes,
                                             unsigned flags, void *stream, bool *done) {
    *done = false;
    if (!(ab == LOOM_F32 || ab == LOOM_BF16 || ab == LOOM_F16) || !(cdt == ab || cdt == LOOM_F32))
        return LOOM_OK;
    // the groups taken: those with work (the caller sets C = beta C in the
    // groups of no K)
    int64_t maxM = 0, maxN = 0, maxK = 0, n = 0;
    bool vec_a = lda % 8 == 0, vec_c = ldc % 8 == 0;
    for (int i = 0; i < G; i++) {
        if (!g[i].M || !g[i].N || !g[i].K)
            continue;
        if (g[i].M > INT32_MAX / 2 || g[i].N > INT32_MAX / 2 || g[i].K > INT32_MAX / 2)
            return LOOM_OK;
        maxM = g[i].M > maxM ? g[i].M : maxM;
        maxN = g[i].N > maxN ? g[i].N : maxN;
        maxK = g[i].K > maxK ? g[i].K : maxK;
        vec_a = vec_a && al16(g[i].A) && g[i].K % 8 == 0;
        vec_c = vec_c && al16(g[i].C) && g[i].N % 8 == 0;
        n++;
    }
    Mode mode = NONE;
    bool bigm = false;
    if (ta) {
        if (!tb && (maxN <= SK || maxM <= SK))
            mode = REDUCE, bigm = maxN <= SK;
    } else if (maxN <= SK && vec_a) {
        mode = ROWDOT;
    } else if (maxK <= SK && vec_c) {
        mode = EXPAND;
    }
    if (mode == NONE || n == 0 || (size_t)n * sizeof(Desc) > desc_cap)
        return LOOM_OK;
    int np = maxN <= 4 ? 4 : maxN <= 8 ? 8 : 16;
    if (mode == REDUCE && !(flags & LOOM_CUDA_SKINNY_SCALAR_REDUCE)) {
        // the vector form: every group's big side 16-byte aligned rows,
        // its columns a multiple of the columns a thread reads
        const int64_t sk = bigm ? maxN : maxM;
        const int rc = sk <= 8 ? RedVec<8>::RC : RedVec<16>::RC;
        bool vec = (bigm ? lda : ldb) % 8 == 0;
        for (int i = 0; i < G && vec; i++)
            if (g[i].M && g[i].N && g[i].K)
                vec = al16(bigm ? g[i].A : g[i].B) && (bigm ? g[i].M : g[i].N) % rc == 0;
        if (vec)
            mode = REDUCE_VEC, np = sk <= 8 ? 8 : 16;
    }
    if (mode == ROWDOT && (flags & LOOM_CUDA_SKINNY_MMA) && ab != LOOM_F32) { // every group's K a multiple of 32
        bool k32 = true;
        for (int i = 0; i < G; i++)
            k32 = k32 && (!g[i].M || !g[i].N || g[i].K % 32 == 0);
        if (k32)
            mode = ROWDOT_MMA;
    }
    // reduce: rows a chunk, doubled until the partial sums fit the workspace
    int64_t KC = 128;
    for (;; KC *= 2) {
        int64_t need = 0;
        for (int i = 0; i < G && (mode == REDUCE || mode == REDUCE_VEC); i++)
            if (g[i].M && g[i].N && g[i].K)
                need += (g[i].K + KC - 1) / KC * g[i].M * g[i].N;
        if ((mode != REDUCE && mode != REDUCE_VEC) || (size_t)need * sizeof(float) <= ws_bytes)
            break;
        if (KC > maxK)
            return LOOM_OK; // one chunk a group does not fit: the caller's way
    }
    Desc *h = (Desc *)malloc((size_t)n * sizeof(Desc));
    if (!h)
        return loom_errf(ctx, LOOM_ERR_OOM, "cuda gemm_grouped: out of host memory");
    int64_t nblk = 0, p0 = 0, ny = 1;
    int w = 0;
    for (int i = 0; i < G; i++) {
        if (!g[i].M || !g[i].N || !g[i].K)
            continue;
        Desc d = {g[i].A, g[i].B, g[i].C, (int)g[i].M, (int)g[i].N, (int)g[i].K, (int)nblk, 0, 0};
        const int64_t big = bigm ? g[i].M : g[i].N;
        if (mode == ROWDOT || mode == ROWDOT_MMA) {
            const int64_t rpb = mode == ROWDOT ? NT / LN * RR : MROWS;
            nblk += (g[i].M + rpb - 1) / rpb;
        } else if (mode == EXPAND) {
            nblk += (g[i].M + RB - 1) / RB;
            const int64_t y = (g[i].N + NTILE - 1) / NTILE;
            ny = y > ny ? y : ny;
        } else {
            d.nch = (int)((g[i].K + KC - 1) / KC);
            d.p0 = p0;
            p0 += (int64_t)d.nch * g[i].M * g[i].N;
            const int64_t cb = mode == REDUCE ? NT : np <= 8 ? RedVec<8>::CB : RedVec<16>::CB;
            nblk += (int64_t)d.nch * ((big + cb - 1) / cb);
            const int64_t y = (g[i].M * g[i].N + NT - 1) / NT;
            ny = y > ny ? (y < 1024 ? y : 1024) : ny;
        }
        h[w++] = d;
    }
    if (nblk > INT32_MAX) {
        free(h);
        return LOOM_OK;
    }
    const cudaStream_t s = as_stream(stream);
    // pageable source: staged before the call returns (freed at once); the
    // kernels of an earlier call read the array before this copy, in stream order
    loom_status st = check(ctx, cudaMemcpyAsync(desc, h, (size_t)n * sizeof(Desc),
                                                cudaMemcpyHostToDevice, s),
                           "gemm_grouped (skinny descriptors)");
    free(h);
    if (st)
        return st;
    const Desc *dd = (const Desc *)desc;
    const int nb = (int)nblk, ng = (int)n, y = (int)ny;
    float *part = (float *)ws;
#define SKINNY_LAUNCH(T, TC)                                                                       \
    launch<T, TC>(mode, np, bigm, dd, ng, nb, y, tb, lda, ldb, ldc, alpha, beta, (int)KC, part, s)
    if (ab == LOOM_F32)
        SKINNY_LAUNCH(float, float);
    else if (ab == LOOM_BF16 && cdt == LOOM_F32)
        SKINNY_LAUNCH(__nv_bfloat16, float);
    else if (ab == LOOM_BF16)
        SKINNY_LAUNCH(__nv_bfloat16, __nv_bfloat16);
    else if (cdt == LOOM_F32)
        SKINNY_LAUNCH(__half, float);
    else
        SKINNY_LAUNCH(__half, __half);
#undef SKINNY_LAUNCH
    *done = true;
    return check_launch(ctx, "gemm_grouped (skinny)");
}
