// RMSNorm forward and backward. One warp per row; sums of squares and dot
// products in double (as the CPU; the 16-bit kernels add fp32 sums of 8 in
// double, see sumsq8), the output rounded as HF: w * (x * rstd).
// The weight gradient is reduced in two fixed-order stages through scratch.
// BF16/F16 rows whose length is a multiple of 8 (16-byte aligned) take the
// vector kernels: 8 elements per 16-byte load, same math. The weight is
// (woff + w) in fp32 wherever it is read (woff 1: Qwen3.5's zero-centred
// weights), as the CPU's.
#include <stdlib.h>

#include "cuda_backend.h"
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {
constexpr int WARPS = 8; // rows per block of the row kernels

// Rows per chunk of the weight-gradient reduction: 64, or more so that there
// are at most 1024 chunks. A function of N only, so results are reproducible.
int64_t dw_rows_per_chunk(int64_t N) {
    int64_t r = 64;
    if ((N + r - 1) / r > 1024) r = (N + 1023) / 1024;
    return r;
}
// Rows per block of the wide backward. With dw about 128 blocks (each block's
// partial sums are one chunk of dw's reduction: a function of N only). Without
// dw, about 1024 blocks: several share an SM and hide each row's two barriers
// (128 blocks of 32 rows each ran the 8B layer's norm at ~1.7 TB/s). A row's
// bits do not depend on its block.
int64_t wide_rows(int64_t N, bool dw) {
    const int64_t blocks = dw ? 128 : 1024;
    return N > blocks ? (N + blocks - 1) / blocks : 1;
}
bool wide_ok(int64_t H) { return H > 1024 && H % 256 == 0 && H / 8 <= 1024; }
} // namespace

// The 16-bit kernels' per-access math (the vector and the fused kernels share
// it, so fused ops give the bits of the ops apart): products and the sum over
// an access's 8 elements in fp32 (each operation rounded on its own), those
// sums added in double across the row. fp32 here instead of the CPU's
// double: converting every element to double made these kernels bound by
// the FP64 units, for a difference far below the 16-bit output's rounding.
__device__ __forceinline__ float sumsq8(const float (&v)[8]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __fadd_rn(s, __fmul_rn(v[i], v[i]));
    return s;
}
__device__ __forceinline__ float dot8(const float (&g)[8], const float (&w)[8], const float (&x)[8]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) s = __fadd_rn(s, __fmul_rn(__fmul_rn(g[i], w[i]), x[i]));
    return s;
}
// dx_i = rstd w_i dy_i - c x_i, c = rstd^3 / H * the row's dot (from double)
__device__ __forceinline__ float dx1(float rs, float w, float g, float c, float x) {
    return __fsub_rn(__fmul_rn(__fmul_rn(rs, w), g), __fmul_rn(c, x));
}
__device__ __forceinline__ float dx_coef(double dot, float rstd, int64_t H) {
    const double rs = (double)rstd;
    return (float)(dot * rs * rs * rs / (double)H);
}
// The weight used: woff + w formed in fp32 (woff 1: Qwen3.5's zero-centred
// weights; 0: w itself, as the CPU's (woff + w[j]))
__device__ __forceinline__ float wo(float woff, float w) { return __fadd_rn(woff, w); }
// (woff + w)[j .. j + 8) as floats, j a multiple of 8: 16-byte loads where w
// is 16-byte aligned, else one element at a time
__device__ __forceinline__ void w8(const void *w, loom_dtype wdt, float woff, int64_t j,
                                   float (&o)[8]) {
    if (((uintptr_t)w & 15) == 0) {
        if (wdt == LOOM_F32) {
            const float4 a = ((const float4 *)w)[j / 4], b = ((const float4 *)w)[j / 4 + 1];
            o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = b.x, o[5] = b.y, o[6] = b.z, o[7] = b.w;
        } else {
            const uint4 u = ((const uint4 *)w)[j / 8];
            if (wdt == LOOM_BF16) cvt8<__nv_bfloat16>(u, o);
            else cvt8<__half>(u, o);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = ld(w, wdt, j + i);
    }
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = wo(woff, o[i]);
}

__global__ void rmsnorm_fwd_kernel(const void *x, loom_dtype xdt, const void *w, loom_dtype wdt,
                                   float woff, int64_t N, int64_t H, float eps, void *y, loom_dtype ydt,
                                   float *rstd) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int64_t base = r * H;
    double ss = 0;
    for (int64_t j = lane; j < H; j += 32) {
        double v = (double)ld(x, xdt, base + j);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float rs = (float)(1.0 / sqrt(ss / (double)H + (double)eps));
    if (lane == 0) rstd[r] = rs;
    for (int64_t j = lane; j < H; j += 32)
        st(y, ydt, base + j, __fmul_rn(wo(woff, ld(w, wdt, j)), __fmul_rn(ld(x, xdt, base + j), rs)));
}

// partial[c, j] = sum over the rows of chunk c of dy[r, j] * x[r, j] * rstd[r] (double).
__global__ void rmsnorm_dw_partial_kernel(const void *dy, loom_dtype dydt, const void *x,
                                          loom_dtype xdt, const float *rstd, int64_t N, int64_t H,
                                          int64_t rows, double *partial) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int64_t c = blockIdx.y;
    if (j >= H) return;
    const int64_t r0 = c * rows, r1 = r0 + rows < N ? r0 + rows : N;
    double acc = 0;
    for (int64_t r = r0; r < r1; r++)
        acc += (double)ld(dy, dydt, r * H + j) * (double)ld(x, xdt, r * H + j) * (double)rstd[r];
    partial[c * H + j] = acc;
}

// dw[j] += sum over chunks: a warp per column, lane l adding chunks l, l + 32,
// ... in order, then the warp's fixed shuffle tree. (One thread per column
// walking all the chunks was latency-bound: 30 us for a 128-wide q/k norm.)
constexpr int DW_COLS = 8; // columns (warps) per block of the final stage
__device__ __forceinline__ void dw_column(const double *partial, int64_t nchunk, int64_t H,
                                          float *dw) {
    const int lane = threadIdx.x & 31;
    const int64_t j = (int64_t)blockIdx.x * DW_COLS + (threadIdx.x >> 5);
    if (j >= H) return;
    double acc = 0;
    for (int64_t c = lane; c < nchunk; c += 32) acc += partial[c * H + j];
    acc = warp_sum(acc);
    if (lane == 0) dw[j] += (float)acc;
}
__global__ void rmsnorm_dw_final_kernel(const double *partial, int64_t nchunk, int64_t H, float *dw) {
    dw_column(partial, nchunk, H, dw);
}

// The batch's ops (blockIdx.y), each column as rmsnorm_dw_final_kernel's.
struct dw_entry {
    const double *partial;
    float *dw;
    int64_t nchunk, H;
};
constexpr int DW_BATCH = 96; // ops a flush takes (the arguments stay under 4 KB)
struct dw_batch_args {
    dw_entry e[DW_BATCH];
};
__global__ void rmsnorm_dw_batch_kernel(const __grid_constant__ dw_batch_args a) {
    const dw_entry &e = a.e[blockIdx.y];
    dw_column(e.partial, e.nchunk, e.H, e.dw);
}

// dx_j = rstd w_j dy_j - x_j rstd^3 / H * sum_k dy_k w_k x_k (double, rounded once).
__global__ void rmsnorm_dx_kernel(const void *dy, loom_dtype dydt, const void *x, loom_dtype xdt,
                                  const void *w, loom_dtype wdt, float woff, const float *rstd, int64_t N,
                                  int64_t H, void *dx, loom_dtype dxdt) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int64_t base = r * H;
    double dot = 0;
    for (int64_t j = lane; j < H; j += 32)
        dot += (double)ld(dy, dydt, base + j) * (double)wo(woff, ld(w, wdt, j)) * (double)ld(x, xdt, base + j);
    dot = warp_sum(dot);
    const double rs = (double)rstd[r];
    const double c = dot * rs * rs * rs / (double)H;
    // every lane has read its dy elements above; each writes only its own: dx may alias dy
    for (int64_t j = lane; j < H; j += 32) {
        double g = rs * (double)wo(woff, ld(w, wdt, j)) * (double)ld(dy, dydt, base + j);
        st(dx, dxdt, base + j, (float)(g - c * (double)ld(x, xdt, base + j)));
    }
}

// ---- 16-byte vector path (x, y, dy, dx all BF16 or all F16) ----
// With res: the row is first x + res, rounded to T (as loom_cuda_residual_add)
// and written to xsum (may alias x); the norm is of that sum.
template <typename T>
__global__ void rmsnorm_fwd_vec_kernel(const T *x, const T *res, T *xsum, const void *w,
                                       loom_dtype wdt, float woff, int64_t N, int64_t H, float eps, T *y,
                                       float *rstd) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const T *xr = x + r * H;
    double ss = 0;
#pragma unroll 4 // loads of several chunks in flight
    for (int64_t j = lane * 8; j < H; j += 256) {
        float v[8];
        ld8(xr + j, v);
        if (res) {
            float a[8];
            ld8(res + r * H + j, a);
#pragma unroll
            for (int i = 0; i < 8; i++) v[i] = round_to<T>(__fadd_rn(v[i], a[i]));
            st8(xsum + r * H + j, v);
        }
        ss += (double)sumsq8(v);
    }
    ss = warp_sum(ss);
    const float rs = (float)(1.0 / sqrt(ss / (double)H + (double)eps));
    if (lane == 0) rstd[r] = rs;
    if (res) xr = xsum + r * H; // this thread's own writes
#pragma unroll 4 // loads of several chunks in flight
    for (int64_t j = lane * 8; j < H; j += 256) {
        float v[8], wv[8];
        ld8(xr + j, v);
        w8(w, wdt, woff, j, wv);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(wv[i], __fmul_rn(v[i], rs));
        st8(y + r * H + j, v);
    }
}

// The add + norm for H = 256 NV with the row held in registers: a lane's NV
// accesses (columns 8 lane + 256 i, as the loop above) all loaded before any
// arithmetic, and the normalising pass reads no memory but w. The same
// arithmetic in the same order, so the same bits (cuda_ops_fused_norms
// checks them against residual_add then rmsnorm_fwd, which keeps the loop).
// The loop keeps a few loads in flight and reads the row twice: 2.1 TB/s at
// 8B's 4096 x 4096 on the H100.
template <typename T, int NV>
__global__ void __launch_bounds__(WARPS * 32)
add_rmsnorm_fwd_reg_kernel(const T *x, const T *res, T *xsum, const void *w, loom_dtype wdt, float woff,
                           int64_t N, float eps, T *y, float *rstd) {
    constexpr int64_t H = 256 * NV;
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int64_t o = r * H + lane * 8;
    uint4 a[NV], b[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) a[i] = *(const uint4 *)(x + o + 256 * i);
#pragma unroll
    for (int i = 0; i < NV; i++) b[i] = *(const uint4 *)(res + o + 256 * i);
    double ss = 0;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        float v[8], q[8];
        cvt8<T>(a[i], v);
        cvt8<T>(b[i], q);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = round_to<T>(__fadd_rn(v[k], q[k]));
        a[i] = pack8<T>(v);
        *(uint4 *)(xsum + o + 256 * i) = a[i];
        ss += (double)sumsq8(v);
    }
    ss = warp_sum(ss);
    const float rs = (float)(1.0 / sqrt(ss / (double)H + (double)eps));
    if (lane == 0) rstd[r] = rs;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        float v[8], wv[8];
        cvt8<T>(a[i], v);
        w8(w, wdt, woff, lane * 8 + 256 * i, wv);
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = __fmul_rn(wv[k], __fmul_rn(v[k], rs));
        st8(y + o + 256 * i, v);
    }
}

// The 16-bit add + norm: the register kernel where it has H's width, else
// the loop.
template <typename T>
void add_fwd_vec(const T *x, const T *res, T *xsum, const void *w, loom_dtype wdt, float woff, int64_t N,
                 int64_t H, float eps, T *y, float *rstd, cudaStream_t s) {
    const unsigned blocks = (unsigned)((N + WARPS - 1) / WARPS);
#define REG(NV)                                                                                         \
    return add_rmsnorm_fwd_reg_kernel<T, NV><<<blocks, WARPS * 32, 0, s>>>(x, res, xsum, w, wdt, woff, N, eps, y, \
                                                                           rstd)
    if (H % 256 == 0) switch (H / 256) {
        case 4: REG(4);
        case 8: REG(8);
        case 10: REG(10);
        case 12: REG(12);
        case 16: REG(16);
        default: break;
        }
#undef REG
    rmsnorm_fwd_vec_kernel<<<blocks, WARPS * 32, 0, s>>>(x, res, xsum, w, wdt, woff, N, H, eps, y, rstd);
}

// With res: dx = res + (the gradient rounded to T), as loom_cuda_residual_add
// after the norm's backward (res may alias dx).
template <typename T>
__global__ void rmsnorm_dx_vec_kernel(const T *dy, const T *x, const void *w, loom_dtype wdt,
                                      float woff, const float *rstd, int64_t N, int64_t H, const T *res, T *dx) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int64_t base = r * H;
    // the row is read twice (dot, then dx) rather than held in registers
    auto load = [&](int64_t j, float (&g)[8], float (&v)[8], float (&wv)[8]) {
        ld8(dy + base + j, g);
        ld8(x + base + j, v);
        w8(w, wdt, woff, j, wv);
    };
    double dot = 0;
#pragma unroll 4 // loads of several chunks in flight
    for (int64_t j = lane * 8; j < H; j += 256) {
        float g[8], v[8], wv[8];
        load(j, g, v, wv);
        dot += (double)dot8(g, wv, v);
    }
    dot = warp_sum(dot);
    const float rs = rstd[r], c = dx_coef(dot, rs, H);
    // each lane rewrites only the elements it read: dx may alias dy
#pragma unroll 4
    for (int64_t j = lane * 8; j < H; j += 256) {
        float g[8], v[8], wv[8];
        load(j, g, v, wv);
#pragma unroll
        for (int i = 0; i < 8; i++) g[i] = dx1(rs, wv[i], g[i], c, v[i]);
        if (res) {
            float a[8];
            ld8(res + base + j, a);
#pragma unroll
            for (int i = 0; i < 8; i++) g[i] = __fadd_rn(a[i], round_to<T>(g[i]));
        }
        st8(dx + base + j, g);
    }
}

// ---- fused rows: the backward with its weight gradient in one pass, and
// Qwen3's per-head q/k norm with RoPE ----
// A row of H = 8 * TPR * NV elements is held by a group of TPR lanes (8
// elements per 16-byte access, NV accesses per lane: element (v * TPR + l) * 8
// + i), so the sums are the vector kernels' (same lanes, same order). With
// ROPE (NV 2) the row is one head: element j's RoPE partner j + H/2 is in
// the same lane; cs holds (cos, sin) per (token, frequency), the row's
// token is row / nh. Groups that run out of rows keep shuffling (on a
// clamped row) and store nothing.
constexpr unsigned FULL = 0xffffffffu;
constexpr int FUSED_THREADS = 256;

template <int TPR> __device__ __forceinline__ double group_sum(double v) {
#pragma unroll
    for (int o = TPR / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// Rows of one head (D = 16 * TPR) for RoPE: lane l of a row's group holds
// elements l * 8 + i (access 0) and their RoPE partners D / 2 + l * 8 + i
// (access 1), so the rotation stays in the lane. The row's sums add the two
// accesses in the lane, then across the group: as the vector kernels' lanes
// l and l + TPR and their shuffle tree, the same bits.
// lo, hi rotated as rope_kernel with sign (+1 forward, -1 backward) by the
// (cos, sin) of token t, frequencies l * 8 + i.
template <int TPR>
__device__ __forceinline__ void rope_pair(float (&lo)[8], float (&hi)[8], const float2 *cs, int64_t t,
                                          int l, float sign) {
    const float4 *p = (const float4 *)(cs + t * (8 * TPR) + l * 8);
    float c[8], sn[8];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const float4 q = p[k];
        c[2 * k] = q.x, sn[2 * k] = q.y, c[2 * k + 1] = q.z, sn[2 * k + 1] = q.w;
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float s = sign * sn[i], a = lo[i], b = hi[i];
        lo[i] = __fsub_rn(__fmul_rn(a, c[i]), __fmul_rn(b, s));
        hi[i] = __fadd_rn(__fmul_rn(b, c[i]), __fmul_rn(a, s));
    }
}

// y = rope(norm(x) * w), the norm's output rounded to T first (rmsnorm_fwd
// then rope_fwd apart). A group of TPR lanes per row.
template <typename T, int TPR>
__global__ void __launch_bounds__(FUSED_THREADS)
qknorm_rope_fwd_kernel(const T *x, const void *w, loom_dtype wdt, float woff, int64_t N, int64_t nh, float eps,
                       const float2 *cs, T *y, float *rstd) {
    constexpr int D = 16 * TPR, GPB = FUSED_THREADS / TPR;
    const int l = threadIdx.x % TPR;
    const int64_t r = (int64_t)blockIdx.x * GPB + threadIdx.x / TPR;
    const bool live = r < N;
    const int64_t rr = live ? r : N - 1;
    float v[2][8];
    ld8(x + rr * D + l * 8, v[0]);
    ld8(x + rr * D + D / 2 + l * 8, v[1]);
    double ss = (double)sumsq8(v[0]);
    ss += (double)sumsq8(v[1]);
    ss = group_sum<TPR>(ss);
    const float rs = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
    if (live && l == 0) rstd[r] = rs;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float wv[8];
        w8(w, wdt, woff, h * (D / 2) + l * 8, wv);
#pragma unroll
        for (int i = 0; i < 8; i++) v[h][i] = round_to<T>(__fmul_rn(wv[i], __fmul_rn(v[h][i], rs)));
    }
    rope_pair<TPR>(v[0], v[1], cs, rr / nh, l, 1.0f);
    if (live) st8(y + r * D + l * 8, v[0]), st8(y + r * D + D / 2 + l * 8, v[1]);
}

// The backward of rows [b * rows, (b + 1) * rows) for block b, group g taking
// rows g, g + GPB, ...: with ROPE (NV 2, the layout above), dy is first
// rotated back (and rounded, as rope_bwd's output); dx = the norm's input
// gradient (+ res, rounded as loom_cuda_residual_add, with ADD); with DW,
// the block's sum of dy * x * rstd per column (each group's rows in order,
// then the groups in order) goes to partial[b]. Each group loads its next
// row (dy, x, res and rstd, as stored) while it computes the current one;
// a group's row is read before it is written, so dx may alias dy.
template <int NV, bool ADD> struct norm_row {
    uint4 g[NV], x[NV], r[ADD ? NV : 1];
    float rs;
};

template <typename T, int TPR, int NV, bool ROPE, bool DW, bool ADD>
__global__ void __launch_bounds__(FUSED_THREADS, NV <= 2 ? 2 : 1)
norm_bwd_fused_kernel(const T *dy, const T *x, const void *w, loom_dtype wdt, float woff, const float *rstd,
                      int64_t N, int64_t rows, int64_t nh, const float2 *cs, const T *res, T *dx,
                      double *partial) {
    static_assert(!ROPE || NV == 2, "RoPE rows are two accesses a lane");
    constexpr int H = 8 * TPR * NV, GPB = FUSED_THREADS / TPR;
    const int l = threadIdx.x % TPR, g = threadIdx.x / TPR;
    const int64_t r0 = (int64_t)blockIdx.x * rows, r1 = r0 + rows < N ? r0 + rows : N;
    float acc[NV][8]; // this group's rows (a few) in fp32; the groups and blocks in double
    float wr[NV][8];
#pragma unroll
    for (int v = 0; v < NV; v++) {
        w8(w, wdt, woff, (v * TPR + l) * 8, wr[v]);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[v][i] = 0.0f;
    }
    using row_t = norm_row<NV, ADD>;
    // row base + g, or r0 for a group past the block's rows (computed, not stored)
    auto load = [&](int64_t base, row_t &o) {
        const int64_t r = base + g, rr = r < r1 ? r : r0;
#pragma unroll
        for (int v = 0; v < NV; v++) {
            const int64_t at = rr * H + (v * TPR + l) * 8;
            o.g[v] = *(const uint4 *)(dy + at);
            o.x[v] = *(const uint4 *)(x + at);
            if constexpr (ADD) o.r[v] = *(const uint4 *)(res + at);
        }
        o.rs = rstd[rr];
    };
    row_t cur, nxt;
    load(r0, nxt);
    for (int64_t base = r0; base < r1; base += GPB) {
        cur = nxt;
        if (base + GPB < r1) load(base + GPB, nxt);
        const int64_t r = base + g;
        const bool live = r < r1;
        float gv[NV][8], xv[NV][8];
#pragma unroll
        for (int v = 0; v < NV; v++) cvt8<T>(cur.g[v], gv[v]), cvt8<T>(cur.x[v], xv[v]);
        if constexpr (ROPE) {
            rope_pair<TPR>(gv[0], gv[NV - 1], cs, (live ? r : r0) / nh, l, -1.0f);
#pragma unroll
            for (int v = 0; v < NV; v++)
#pragma unroll
                for (int i = 0; i < 8; i++) gv[v][i] = round_to<T>(gv[v][i]);
        }
        double dot = 0;
#pragma unroll
        for (int v = 0; v < NV; v++) dot += (double)dot8(gv[v], wr[v], xv[v]);
        dot = group_sum<TPR>(dot);
        const float rsf = cur.rs, c = dx_coef(dot, rsf, H);
        if (!live) continue; // no shuffles below
#pragma unroll
        for (int v = 0; v < NV; v++) {
            float o[8];
#pragma unroll
            for (int i = 0; i < 8; i++) {
                o[i] = dx1(rsf, wr[v][i], gv[v][i], c, xv[v][i]);
                if (DW) acc[v][i] = __fadd_rn(acc[v][i], __fmul_rn(__fmul_rn(gv[v][i], xv[v][i]), rsf));
            }
            if constexpr (ADD) {
                float a[8];
                cvt8<T>(cur.r[v], a);
#pragma unroll
                for (int i = 0; i < 8; i++) o[i] = __fadd_rn(a[i], round_to<T>(o[i]));
            }
            st8(dx + r * H + (v * TPR + l) * 8, o);
        }
    }
    if constexpr (DW) { // the groups' sums in order, a column per thread (one barrier)
        __shared__ float sh[GPB][H];
#pragma unroll
        for (int v = 0; v < NV; v++)
#pragma unroll
            for (int i = 0; i < 8; i++) sh[g][(v * TPR + l) * 8 + i] = acc[v][i];
        __syncthreads();
        for (int j = threadIdx.x; j < H; j += FUSED_THREADS) {
            double sum = 0.0;
            for (int k = 0; k < GPB; k++) sum += (double)sh[k][j];
            partial[(int64_t)blockIdx.x * H + j] = sum;
        }
    }
}

// Wide rows (H a multiple of 256 above 1024, up to 8192): a block per range
// of rows, thread e holding elements 8e..8e+7 of the row (one 16-byte access)
// and its dw columns in registers. The row's dot is the vector kernel's:
// thread e is that kernel's lane e % 32 at its access e / 32, so each lane's
// accesses are added in order (in double, through shared memory) and then the
// lanes by the same shuffle tree: the same bits. The next row (dy, x, res,
// rstd) is loaded while the current one is computed. Without DW (a frozen
// norm) only dx.
template <typename T, bool ADD, bool DW>
__global__ void __launch_bounds__(1024)
norm_bwd_wide_kernel(const T *dy, const T *x, const void *w, loom_dtype wdt, float woff, const float *rstd, int64_t N,
                     int64_t H, int64_t rows, const T *res, T *dx, double *partial) {
    __shared__ float dots[1024]; // [access][lane]
    __shared__ double rowdot;
    const int e = threadIdx.x, lane = e & 31, nacc = blockDim.x >> 5;
    const int64_t r0 = (int64_t)blockIdx.x * rows, r1 = r0 + rows < N ? r0 + rows : N;
    const int64_t col = (int64_t)e * 8;
    float wr[8], acc[8];
    w8(w, wdt, woff, col, wr);
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    uint4 ng = make_uint4(0, 0, 0, 0), nx = ng, nr = ng;
    float nrs = 0.0f;
    auto load = [&](int64_t r) {
        ng = *(const uint4 *)(dy + r * H + col);
        nx = *(const uint4 *)(x + r * H + col);
        if constexpr (ADD) nr = *(const uint4 *)(res + r * H + col);
        nrs = rstd[r];
    };
    if (r0 < r1) load(r0);
    for (int64_t r = r0; r < r1; r++) {
        const uint4 cg = ng, cx = nx, cr = nr;
        const float rs = nrs;
        if (r + 1 < r1) load(r + 1);
        float gv[8], xv[8];
        cvt8<T>(cg, gv);
        cvt8<T>(cx, xv);
        dots[(e >> 5) * 32 + lane] = dot8(gv, wr, xv);
        __syncthreads();
        if (e < 32) {
            double d = 0.0;
            for (int k = 0; k < nacc; k++) d += (double)dots[k * 32 + lane];
            d = warp_sum(d);
            if (lane == 0) rowdot = d;
        }
        __syncthreads();
        const float c = dx_coef(rowdot, rs, H);
        float o[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            o[i] = dx1(rs, wr[i], gv[i], c, xv[i]);
            if constexpr (DW) acc[i] = __fadd_rn(acc[i], __fmul_rn(__fmul_rn(gv[i], xv[i]), rs));
        }
        if constexpr (ADD) {
            float a[8];
            cvt8<T>(cr, a);
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = __fadd_rn(a[i], round_to<T>(o[i]));
        }
        st8(dx + r * H + col, o);
    }
    if constexpr (DW) {
#pragma unroll
        for (int i = 0; i < 8; i++) partial[(int64_t)blockIdx.x * H + col + i] = (double)acc[i];
    }
}

namespace {
// The fused backward's shapes: a group of TPR lanes per row, NV accesses per
// lane; 0 when the row length has none (TPR a power of two <= 32).
struct fused_shape {
    int tpr, nv;
};
fused_shape fused_rows(int64_t H, bool rope) {
    if (H % 8) return {0, 0};
    const int64_t v8 = H / 8;
    if (rope) return (v8 == 8 || v8 == 16 || v8 == 32) ? fused_shape{(int)v8 / 2, 2} : fused_shape{0, 0};
    if (v8 % 32 == 0 && (v8 / 32 == 1 || v8 / 32 == 2 || v8 / 32 == 4)) return {32, (int)(v8 / 32)};
    return {0, 0};
}

// Rows per block (and dw chunk) of the fused backward: dw_rows_per_chunk's,
// but at least 8 a group, so that the loads run ahead of more rows than a
// block's first (a function of N and the row shape only).
int64_t fused_chunk_rows(int64_t N, fused_shape f) {
    const int64_t r = dw_rows_per_chunk(N), least = 8 * (FUSED_THREADS / f.tpr);
    return r > least ? r : least;
}

template <typename T, int TPR, int NV, bool ROPE, bool DW, bool ADD>
void launch_bwd_fused(const void *dy, const void *x, const void *w, loom_dtype wdt, float woff, const float *rstd,
                      int64_t N, int64_t rows, int64_t nh, const float *cs, const void *res, void *dx,
                      void *scratch, cudaStream_t s) {
    const unsigned blocks = (unsigned)((N + rows - 1) / rows);
    norm_bwd_fused_kernel<T, TPR, NV, ROPE, DW, ADD><<<blocks, FUSED_THREADS, 0, s>>>(
        (const T *)dy, (const T *)x, w, wdt, woff, rstd, N, rows, nh, (const float2 *)cs, (const T *)res,
        (T *)dx, (double *)scratch);
}

// The instantiations: rope heads of 64/128/256 (dw or not); plain rows of
// 256/512/1024 with dw (add or not).
template <typename T>
bool bwd_fused(fused_shape f, bool rope, bool dw, bool add, const void *dy, const void *x,
               const void *w, loom_dtype wdt, float woff, const float *rstd, int64_t N, int64_t rows,
               int64_t nh, const float *cs, const void *res, void *dx, void *scratch, cudaStream_t s) {
#define LB(TPR, NV, R, D, A)                                                                        \
    launch_bwd_fused<T, TPR, NV, R, D, A>(dy, x, w, wdt, woff, rstd, N, rows, nh, cs, res, dx, scratch, s)
#define LB_DW(TPR) (dw ? LB(TPR, 2, true, true, false) : LB(TPR, 2, true, false, false))
#define LB_ADD(NV) (add ? LB(32, NV, false, true, true) : LB(32, NV, false, true, false))
    if (rope && !add) {
        switch (f.tpr) {
        case 4: LB_DW(4); return true;
        case 8: LB_DW(8); return true;
        case 16: LB_DW(16); return true;
        }
        return false;
    }
    if (rope || !dw || f.tpr != 32) return false;
    switch (f.nv) {
    case 1: LB_ADD(1); return true;
    case 2: LB_ADD(2); return true;
    case 4: LB_ADD(4); return true;
    }
    return false;
#undef LB_ADD
#undef LB_DW
#undef LB
}
} // namespace

extern "C" loom_status loom_cuda_rmsnorm_fwd(loom_ctx *ctx, const void *x, loom_dtype x_dtype,
                                             const void *w, loom_dtype w_dtype, float woff, int64_t N,
                                             int64_t H, float eps, void *y, loom_dtype y_dtype,
                                             float *rstd, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, x_dtype, "rmsnorm_fwd", "x")) ||
        (st = need_float(ctx, w_dtype, "rmsnorm_fwd", "w")) ||
        (st = need_float(ctx, y_dtype, "rmsnorm_fwd", "y")))
        return st;
    if (x == y && x_dtype != y_dtype)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda rmsnorm_fwd: y aliases x with another dtype (%s vs %s)",
                         loom_dtype_name(y_dtype), loom_dtype_name(x_dtype));
    if (N <= 0 || H <= 0) return LOOM_OK;
    const unsigned blocks = (unsigned)((N + WARPS - 1) / WARPS);
    if (x_dtype == y_dtype && vec8_ok(x_dtype, H, x, y)) {
        if (x_dtype == LOOM_BF16)
            rmsnorm_fwd_vec_kernel<<<blocks, WARPS * 32, 0, as_stream(stream)>>>(
                (const __nv_bfloat16 *)x, (const __nv_bfloat16 *)nullptr, (__nv_bfloat16 *)nullptr, w,
                w_dtype, woff, N, H, eps,
                (__nv_bfloat16 *)y, rstd);
        else
            rmsnorm_fwd_vec_kernel<<<blocks, WARPS * 32, 0, as_stream(stream)>>>(
                (const __half *)x, (const __half *)nullptr, (__half *)nullptr, w, w_dtype, woff, N, H, eps,
                (__half *)y, rstd);
        return check_launch(ctx, "rmsnorm_fwd");
    }
    rmsnorm_fwd_kernel<<<blocks, WARPS * 32, 0, as_stream(stream)>>>(x, x_dtype, w, w_dtype, woff, N, H, eps,
                                                                      y, y_dtype, rstd);
    return check_launch(ctx, "rmsnorm_fwd");
}

extern "C" bool loom_cuda_rmsnorm_fused_ok(loom_dtype dtype, int64_t H) {
    return (dtype == LOOM_BF16 || dtype == LOOM_F16) && H > 0 && H % 8 == 0;
}

extern "C" bool loom_cuda_qknorm_rope_ok(loom_dtype dtype, int64_t D) {
    return (dtype == LOOM_BF16 || dtype == LOOM_F16) && fused_rows(D, true).tpr > 0;
}

// The fused entry points take what loom_cuda_*_ok accepts, on 16-byte aligned rows.
static loom_status fused_args(loom_ctx *ctx, const char *op, bool ok, const void *a, const void *b,
                              const void *c, const void *d) {
    if (!ok)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda %s: needs BF16/F16 rows whose length the fused kernels take", op);
    if (!aligned16(a) || !aligned16(b) || !aligned16(c) || !aligned16(d))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda %s: tensors must be 16-byte aligned", op);
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_add_rmsnorm_fwd(loom_ctx *ctx, const void *x, const void *res,
                                                 void *xsum, loom_dtype dtype, const void *w,
                                                 loom_dtype w_dtype, float woff, int64_t N, int64_t H, float eps,
                                                 void *y, float *rstd, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, w_dtype, "add_rmsnorm_fwd", "w")) ||
        (st = fused_args(ctx, "add_rmsnorm_fwd", loom_cuda_rmsnorm_fused_ok(dtype, H), x, res, xsum, y)))
        return st;
    if (N <= 0) return LOOM_OK;
    if (dtype == LOOM_BF16)
        add_fwd_vec<__nv_bfloat16>((const __nv_bfloat16 *)x, (const __nv_bfloat16 *)res,
                                   (__nv_bfloat16 *)xsum, w, w_dtype, woff, N, H, eps, (__nv_bfloat16 *)y, rstd,
                                   as_stream(stream));
    else
        add_fwd_vec<__half>((const __half *)x, (const __half *)res, (__half *)xsum, w, w_dtype, woff, N, H, eps,
                            (__half *)y, rstd, as_stream(stream));
    return check_launch(ctx, "add_rmsnorm_fwd");
}

extern "C" size_t loom_cuda_rmsnorm_bwd_scratch_bytes(int64_t N, int64_t H) {
    if (N <= 0 || H <= 0) return 0;
    const int64_t rows = dw_rows_per_chunk(N), wr = wide_rows(N, true);
    int64_t chunks = (N + rows - 1) / rows;
    if ((N + wr - 1) / wr > chunks) chunks = (N + wr - 1) / wr; /* the wide kernel's */
    return (size_t)chunks * (size_t)H * sizeof(double);
}

struct loom_cuda_dw_batch {
    char *scratch;
    size_t cap, used;
    int n;
    int64_t maxH;
    dw_batch_args a;
};

extern "C" loom_status loom_cuda_dw_batch_create(loom_ctx *ctx, size_t scratch_bytes,
                                                 loom_cuda_dw_batch **out) {
    *out = NULL;
    loom_cuda_dw_batch *b = (loom_cuda_dw_batch *)calloc(1, sizeof *b);
    if (!b) return loom_errf(ctx, LOOM_ERR_OOM, "cuda dw batch: out of host memory");
    loom_status st = loom_cuda_malloc(ctx, (void **)&b->scratch, scratch_bytes ? scratch_bytes : 1,
                                      "RMSNorm weight-gradient batch");
    if (st) {
        free(b);
        return st;
    }
    b->cap = scratch_bytes;
    *out = b;
    return LOOM_OK;
}

extern "C" void loom_cuda_dw_batch_free(loom_cuda_dw_batch *b) {
    if (!b) return;
    loom_cuda_free(b->scratch);
    free(b);
}

extern "C" void *loom_cuda_dw_batch_scratch(loom_cuda_dw_batch *b, int64_t N, int64_t H) {
    const size_t need = (loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) + 255) / 256 * 256;
    if (!b || b->n >= DW_BATCH || need > b->cap - b->used) return NULL;
    void *p = b->scratch + b->used;
    b->used += need;
    return p;
}

extern "C" void loom_cuda_dw_batch_drop(loom_cuda_dw_batch *b) {
    if (b) b->n = 0, b->used = 0, b->maxH = 0;
}

extern "C" loom_status loom_cuda_dw_batch_flush(loom_ctx *ctx, loom_cuda_dw_batch *b, void *stream) {
    if (!b || b->n == 0) return LOOM_OK;
    dim3 grid((unsigned)((b->maxH + DW_COLS - 1) / DW_COLS), (unsigned)b->n);
    rmsnorm_dw_batch_kernel<<<grid, DW_COLS * 32, 0, as_stream(stream)>>>(b->a);
    loom_cuda_dw_batch_drop(b);
    return check_launch(ctx, "dw_batch_flush");
}

// The chunks' partial weight gradients (scratch) added into dw: now, or with
// a batch recorded for its flush. The scratch came from the batch
// (loom_cuda_dw_batch_scratch), which leaves room for the record; flushing
// here would free that scratch while this op's partials are still in it.
static loom_status dw_final(loom_ctx *ctx, const char *op, const void *scratch, int64_t N, int64_t H,
                            int64_t rows, float *dw, cudaStream_t s, loom_cuda_dw_batch *batch) {
    const int64_t nchunk = (N + rows - 1) / rows;
    if (batch) {
        if (batch->n >= DW_BATCH)
            return loom_errf(ctx, LOOM_ERR_INTERNAL,
                             "cuda %s: the dw batch is full; its scratch must come from "
                             "loom_cuda_dw_batch_scratch",
                             op);
        batch->a.e[batch->n++] = dw_entry{(const double *)scratch, dw, nchunk, H};
        if (H > batch->maxH) batch->maxH = H;
        return LOOM_OK;
    }
    rmsnorm_dw_final_kernel<<<(unsigned)((H + DW_COLS - 1) / DW_COLS), DW_COLS * 32, 0, s>>>(
        (const double *)scratch, nchunk, H, dw);
    return check_launch(ctx, op);
}

// rmsnorm_bwd, with res: dx = res + the gradient (the 16-bit vector paths only).
static loom_status bwd(loom_ctx *ctx, const char *op, const void *dy, loom_dtype dy_dtype,
                       const void *x, loom_dtype x_dtype, const void *w, loom_dtype w_dtype, float woff,
                       const float *rstd, int64_t N, int64_t H, const void *res, void *dx,
                       loom_dtype dx_dtype, float *dw, void *scratch, cudaStream_t s,
                       loom_cuda_dw_batch *batch) {
    loom_status st;
    const bool vec = dy_dtype == x_dtype && dx_dtype == x_dtype && vec8_ok(x_dtype, H, dy, x) &&
                     vec8_ok(x_dtype, H, dx, dx);
    const fused_shape f = fused_rows(H, false);
    if (vec && dw && f.tpr) { // one pass for dx and the chunks' dw
        const int64_t rows = fused_chunk_rows(N, f);
        const bool bf = x_dtype == LOOM_BF16;
        if ((bf ? bwd_fused<__nv_bfloat16> : bwd_fused<__half>)(f, false, true, res != nullptr, dy, x,
                                                                 w, w_dtype, woff, rstd, N, rows, 1,
                                                                 nullptr, res, dx, scratch, s)) {
            if ((st = check_launch(ctx, op))) return st;
            return dw_final(ctx, op, scratch, N, H, rows, dw, s, batch);
        }
    }
    // wide rows with dw or the residual add (the fused op; the plain backward
    // without dw keeps the vector kernel, whose bits the tests compare with):
    // one pass, a block per range of rows
    if (vec && (dw || res) && wide_ok(H)) {
        const int64_t rows = wide_rows(N, dw != nullptr);
        const unsigned blocks = (unsigned)((N + rows - 1) / rows), threads = (unsigned)(H / 8);
#define WIDE(T, A, D)                                                                               \
    norm_bwd_wide_kernel<T, A, D><<<blocks, threads, 0, s>>>((const T *)dy, (const T *)x, w, w_dtype, woff, rstd, \
                                                             N, H, rows, (const T *)res, (T *)dx,   \
                                                             (double *)scratch)
#define WIDE_T(T) (res ? (dw ? WIDE(T, true, true) : WIDE(T, true, false)) : WIDE(T, false, true))
        if (x_dtype == LOOM_BF16) WIDE_T(__nv_bfloat16);
        else WIDE_T(__half);
#undef WIDE_T
#undef WIDE
        if ((st = check_launch(ctx, op)) || !dw) return st;
        return dw_final(ctx, op, scratch, N, H, rows, dw, s, batch);
    }
    if (dw) { // before dx: dx may overwrite dy
        const int64_t rows = dw_rows_per_chunk(N), nchunk = (N + rows - 1) / rows;
        const int threads = 128;
        dim3 grid((unsigned)((H + threads - 1) / threads), (unsigned)nchunk);
        rmsnorm_dw_partial_kernel<<<grid, threads, 0, s>>>(dy, dy_dtype, x, x_dtype, rstd, N, H,
                                                            rows, (double *)scratch);
        if ((st = check_launch(ctx, op))) return st;
        if ((st = dw_final(ctx, op, scratch, N, H, rows, dw, s, batch))) return st;
    }
    const unsigned blocks = (unsigned)((N + WARPS - 1) / WARPS);
    if (vec) {
        if (x_dtype == LOOM_BF16)
            rmsnorm_dx_vec_kernel<<<blocks, WARPS * 32, 0, s>>>(
                (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)x, w, w_dtype, woff, rstd, N, H,
                (const __nv_bfloat16 *)res, (__nv_bfloat16 *)dx);
        else
            rmsnorm_dx_vec_kernel<<<blocks, WARPS * 32, 0, s>>>((const __half *)dy, (const __half *)x, w,
                                                                w_dtype, woff, rstd, N, H, (const __half *)res,
                                                                (__half *)dx);
        return check_launch(ctx, op);
    }
    rmsnorm_dx_kernel<<<blocks, WARPS * 32, 0, s>>>(dy, dy_dtype, x, x_dtype, w, w_dtype, woff, rstd, N, H, dx,
                                                    dx_dtype);
    return check_launch(ctx, op);
}

static loom_status bwd_checks(loom_ctx *ctx, const char *op, loom_dtype dy_dtype, loom_dtype x_dtype,
                              loom_dtype w_dtype, loom_dtype dx_dtype, bool alias, const float *dw,
                              const void *scratch) {
    loom_status st;
    if ((st = need_float(ctx, dy_dtype, op, "dy")) || (st = need_float(ctx, x_dtype, op, "x")) ||
        (st = need_float(ctx, w_dtype, op, "w")) || (st = need_float(ctx, dx_dtype, op, "dx")))
        return st;
    if (alias && dx_dtype != dy_dtype)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda %s: dx aliases dy with another dtype (%s vs %s)",
                         op, loom_dtype_name(dx_dtype), loom_dtype_name(dy_dtype));
    if (dw && !scratch)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda %s: dw needs scratch of loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) bytes",
                         op);
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_rmsnorm_bwd(loom_ctx *ctx, const void *dy, loom_dtype dy_dtype,
                                             const void *x, loom_dtype x_dtype, const void *w,
                                             loom_dtype w_dtype, float woff, const float *rstd, int64_t N,
                                             int64_t H, void *dx, loom_dtype dx_dtype, float *dw,
                                             void *scratch, void *stream) {
    loom_status st;
    if ((st = bwd_checks(ctx, "rmsnorm_bwd", dy_dtype, x_dtype, w_dtype, dx_dtype, dx == dy, dw,
                         scratch)))
        return st;
    if (N <= 0 || H <= 0) return LOOM_OK;
    return bwd(ctx, "rmsnorm_bwd", dy, dy_dtype, x, x_dtype, w, w_dtype, woff, rstd, N, H, nullptr, dx,
               dx_dtype, dw, scratch, as_stream(stream), nullptr);
}

extern "C" loom_status loom_cuda_rmsnorm_bwd_add(loom_ctx *ctx, const void *dy, const void *x,
                                                 loom_dtype dtype, const void *w, loom_dtype w_dtype,
                                                 float woff, const float *rstd, int64_t N, int64_t H, void *dx,
                                                 float *dw, void *scratch, loom_cuda_dw_batch *batch,
                                                 void *stream) {
    loom_status st;
    if ((st = bwd_checks(ctx, "rmsnorm_bwd_add", dtype, dtype, w_dtype, dtype, false, dw, scratch)) ||
        (st = fused_args(ctx, "rmsnorm_bwd_add", loom_cuda_rmsnorm_fused_ok(dtype, H), dy, x, dx, dx)))
        return st;
    if (dx == dy)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda rmsnorm_bwd_add: dx must not alias dy");
    if (N <= 0) return LOOM_OK;
    return bwd(ctx, "rmsnorm_bwd_add", dy, dtype, x, dtype, w, w_dtype, woff, rstd, N, H, dx, dx, dtype, dw,
               scratch, as_stream(stream), batch);
}

extern "C" loom_status loom_cuda_qknorm_rope_fwd(loom_ctx *ctx, const void *x, loom_dtype dtype,
                                                 const void *w, loom_dtype w_dtype, float woff, int64_t N,
                                                 int64_t nh, int64_t D, float eps, const float *cs,
                                                 void *y, float *rstd, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, w_dtype, "qknorm_rope_fwd", "w")) ||
        (st = fused_args(ctx, "qknorm_rope_fwd", loom_cuda_qknorm_rope_ok(dtype, D), x, y, cs, cs)))
        return st;
    if (N <= 0) return LOOM_OK;
    if (nh <= 0 || N % nh)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda qknorm_rope_fwd: %lld rows are not tokens of %lld heads",
                         (long long)N, (long long)nh);
    const int tpr = (int)(D / 16); // lanes per row (rope_pair's layout)
    const unsigned blocks = (unsigned)((N * tpr + FUSED_THREADS - 1) / FUSED_THREADS);
    cudaStream_t s = as_stream(stream);
#define QF(T, TPR)                                                                                  \
    qknorm_rope_fwd_kernel<T, TPR><<<blocks, FUSED_THREADS, 0, s>>>(                                \
        (const T *)x, w, w_dtype, woff, N, nh, eps, (const float2 *)cs, (T *)y, rstd)
    if (dtype == LOOM_BF16) {
        if (tpr == 4) QF(__nv_bfloat16, 4);
        else if (tpr == 8) QF(__nv_bfloat16, 8);
        else QF(__nv_bfloat16, 16);
    } else {
        if (tpr == 4) QF(__half, 4);
        else if (tpr == 8) QF(__half, 8);
        else QF(__half, 16);
    }
#undef QF
    return check_launch(ctx, "qknorm_rope_fwd");
}

extern "C" loom_status loom_cuda_qknorm_rope_bwd(loom_ctx *ctx, const void *dy, const void *x,
                                                 loom_dtype dtype, const void *w, loom_dtype w_dtype,
                                                 float woff, const float *rstd, int64_t N, int64_t nh, int64_t D,
                                                 const float *cs, void *dx, float *dw, void *scratch,
                                                 loom_cuda_dw_batch *batch, void *stream) {
    loom_status st;
    if ((st = bwd_checks(ctx, "qknorm_rope_bwd", dtype, dtype, w_dtype, dtype, false, dw, scratch)) ||
        (st = fused_args(ctx, "qknorm_rope_bwd", loom_cuda_qknorm_rope_ok(dtype, D), dy, x, dx, cs)))
        return st;
    if (N <= 0) return LOOM_OK;
    if (nh <= 0 || N % nh)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda qknorm_rope_bwd: %lld rows are not tokens of %lld heads",
                         (long long)N, (long long)nh);
    cudaStream_t s = as_stream(stream);
    const fused_shape f = fused_rows(D, true);
    const int64_t rows = fused_chunk_rows(N, f);
    (dtype == LOOM_BF16 ? bwd_fused<__nv_bfloat16> : bwd_fused<__half>)(
        f, true, dw != nullptr, false, dy, x, w, w_dtype, woff, rstd, N, rows, nh, cs, nullptr, dx, scratch, s);
    if ((st = check_launch(ctx, "qknorm_rope_bwd")) || !dw) return st;
    return dw_final(ctx, "qknorm_rope_bwd", scratch, N, D, rows, dw, s, batch);
}
