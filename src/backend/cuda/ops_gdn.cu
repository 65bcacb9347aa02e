// Gated DeltaNet's small ops (cuda_ops.h; the CPU reference is
// src/backend/cpu/gdn.c): the causal depthwise convolution with SiLU, the
// gates g and beta, and the gated RMSNorm. The chunked rule is in
// ops_gdn_rule.cu. Arithmetic in fp32 (the norms' sums of squares and dots
// in double, as the CPU); a parameter gradient's sum over tokens or rows is
// taken as per-chunk partials in double, then the chunks added in order by
// one thread per column: a fixed order, no atomics.
//
// tests/test_backend_gdn.c holds them to the CPU's (run on an H200);
// `make test-emu` runs them on the CPU in CI.
#include "mma.cuh"
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {
constexpr int NT = 256;        // threads per block
constexpr int WARPS = NT / 32; // rows per block of the norm's row kernels
constexpr int CONV_MAX_K = 16; // the convolution's widest kernel here (Qwen3.5's is 4)

// Rows per chunk of a reduction over n rows: 64, or more so that there are
// at most 1024 chunks. A function of n only: the sums' order is fixed.
int64_t red_rows(int64_t n) {
    int64_t r = 64;
    if ((n + r - 1) / r > 1024)
        r = (n + 1023) / 1024;
    return r;
}
int64_t red_chunks(int64_t n) { return n > 0 ? (n + red_rows(n) - 1) / red_rows(n) : 0; }

__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }

// The document n of token t: cu[n] <= t < cu[n + 1] (cu ascending from 0 to T).
__device__ __forceinline__ int64_t doc_of(const int32_t *cu, int64_t ndocs, int64_t t) {
    int64_t lo = 0, hi = ndocs; // cu[lo] <= t < cu[hi]
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// out0[col] += the sum over the nchunk chunks of partial[chunk][col] (in
// chunk order) for col < n0, out1[col - n0] for the columns after; a NULL
// output's columns are skipped. Loads go out FB at a time: one at a time a
// thread waited on each (39 us for the gated norm's 1024 chunks of 128
// columns on the H200).
constexpr int FB = 16;
__global__ void col_final_kernel(const double *partial, int64_t nchunk, int64_t ncols, int64_t n0,
                                 float *out0, float *out1) {
    const int64_t col = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= ncols)
        return;
    float *out = col < n0 ? out0 : out1;
    if (!out)
        return;
    double acc = 0;
    int64_t c = 0;
    for (; c + FB <= nchunk; c += FB) {
        double v[FB];
#pragma unroll
        for (int i = 0; i < FB; i++)
            v[i] = partial[(c + i) * ncols + col];
#pragma unroll
        for (int i = 0; i < FB; i++)
            acc += v[i];
    }
    for (; c < nchunk; c++)
        acc += partial[c * ncols + col];
    out[col < n0 ? col : col - n0] += (float)acc;
}

loom_status col_final(loom_ctx *ctx, const char *op, const void *partial, int64_t nchunk,
                      int64_t ncols, int64_t n0, float *out0, float *out1, cudaStream_t s) {
    col_final_kernel<<<(unsigned)((ncols + NT - 1) / NT), NT, 0, s>>>(
        (const double *)partial, nchunk, ncols, n0, out0, out1);
    return check_launch(ctx, op);
}

// ---- the causal depthwise convolution, SiLU fused ----

// Both directions run a thread per channel over a run of rows, the window of
// the K latest inputs in registers and the document followed from the run's
// first token (a thread per output with a search for its document and K
// loads made the forward compute-bound on an H200). KM, a compile-time
// bound on K, sizes the windows: 4 (Qwen3.5's kernel) keeps them in few
// registers; the wider case spilled none but ran one block an SM.
//
// A thread reads its channel's rows through X: from global memory (glob_rows),
// or in the forward, for 16-bit data with whole 16-byte groups of channels and
// K <= 4, from a tile of the block's rows staged in shared memory by cp.async
// first (tile_rows): a row at a time from global memory a thread had one 2-byte
// load in flight. On the H200 at Qwen3.5-4B's shapes (4096 tokens, 8192
// channels) the tile took the forward 157 -> 133 us; the backward's (both
// inputs, 70 KB a block, 3 blocks an SM) was slower, 296 -> 319 us, and is not
// used. The arithmetic is the same either way.
constexpr int CONV_FWD_ROWS = 32; // the forward's rows per thread (global rows)
constexpr int CONV_TILE_C = NT;   // channels a tile block
constexpr int CONV_TILE_ROWS = 64; // the tiled forward's rows a block

struct glob_rows {
    const void *p;
    loom_dtype dt;
    int64_t C, c;
    __device__ __forceinline__ float operator()(int64_t u) const { return ld(p, dt, u * C + c); }
};
template <typename E> struct tile_rows {
    const E *s; // row u0 of the tile, at this thread's channel
    int64_t u0;
    __device__ __forceinline__ float operator()(int64_t u) const {
        return to_f(s[(u - u0) * CONV_TILE_C]);
    }
};

// Rows [u0, u0 + n) of the CONV_TILE_C channels from c0 into s (rows outside
// [0, T) and channels past C zero); every thread of the block takes part.
template <typename E>
__device__ __forceinline__ void stage_tile(E *s, const void *g, int64_t T, int64_t C, int64_t c0,
                                           int64_t u0, int n) {
    constexpr int PER = CONV_TILE_C * (int)sizeof(E) / 16; // 16-byte copies a row
    constexpr int EPC = 16 / (int)sizeof(E);
    for (int i = threadIdx.x; i < n * PER; i += blockDim.x) {
        const int r = i / PER, k = i % PER;
        const int64_t u = u0 + r, c = c0 + (int64_t)EPC * k;
        const bool ok = u >= 0 && u < T && c < C;
        cp_async16(s + r * CONV_TILE_C + EPC * k, ok ? (const E *)g + u * C + c : g, ok);
    }
}

// Whether the forward's tile takes x: 16-bit data in whole 16-byte groups of
// channels, 16-byte aligned, K <= 4.
inline bool conv_tiled(loom_dtype dt, int64_t C, int64_t K, const void *x) {
    return (dt == LOOM_BF16 || dt == LOOM_F16) && C % 8 == 0 && K <= 4 && aligned16(x);
}

// Token t (its document from s, its input xt) into the window xw (xw[j] =
// x[t - K + 1 + j]); its pre-activation, the sum in j's order as the CPU's.
template <int KM>
__device__ __forceinline__ float conv_step(float (&xw)[KM], const float (&wk)[KM], float xt,
                                           int64_t K, int64_t t, int64_t s) {
#pragma unroll
    for (int j = 0; j < KM - 1; j++)
        xw[j] = xw[j + 1];
#pragma unroll
    for (int j = 0; j < KM; j++)
        if (j == K - 1)
            xw[j] = xt;
    float p = 0.0f;
#pragma unroll
    for (int j = 0; j < KM; j++)
        if (j < K && t - K + 1 + j >= s)
            p = fmaf(wk[j], xw[j], p);
    return p;
}

// The rows [r0, r1) of channel c of y.
template <int KM, class X>
__device__ __forceinline__ void conv_fwd_rows(X x, const void *w, loom_dtype dt, int64_t C,
                                              int64_t K, int64_t c, int64_t r0, int64_t r1,
                                              const int32_t *cu, int64_t ndocs, void *y) {
    float wk[KM], xw[KM]; // xw[j] = x[t - K + 1 + j] at token t
#pragma unroll
    for (int j = 0; j < KM; j++) {
        const int64_t u = r0 - K + j; // the window at t = r0 - 1
        wk[j] = j < K ? ld(w, dt, c * K + j) : 0.0f;
        xw[j] = j < K && u >= 0 ? x(u) : 0.0f;
    }
    int64_t n = doc_of(cu, ndocs, r0), s = cu[n], e = cu[n + 1];
    float xnext = r0 < r1 ? x(r0) : 0.0f; // loaded a row ahead
    for (int64_t t = r0; t < r1; t++) {
        const float xt = xnext;
        if (t + 1 < r1)
            xnext = x(t + 1);
        while (t >= e)
            s = e, e = cu[++n + 1];
        const float p = conv_step(xw, wk, xt, K, t, s);
        st(y, dt, t * C + c, p * sigm(p));
    }
}

template <int KM>
__global__ void conv_fwd_kernel(const void *x, const void *w, loom_dtype dt, int64_t T, int64_t C,
                                int64_t K, const int32_t *cu, int64_t ndocs, void *y) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    const int64_t r0 = (int64_t)blockIdx.y * CONV_FWD_ROWS;
    const int64_t r1 = r0 + CONV_FWD_ROWS < T ? r0 + CONV_FWD_ROWS : T;
    conv_fwd_rows<KM>(glob_rows{x, dt, C, c}, w, dt, C, K, c, r0, r1, cu, ndocs, y);
}

// Shared memory: rows [r0 - K, r1) of the block's channels.
template <typename E>
__global__ void __launch_bounds__(CONV_TILE_C)
    conv_fwd_tile_kernel(const void *x, const void *w, loom_dtype dt, int64_t T, int64_t C,
                         int64_t K, const int32_t *cu, int64_t ndocs, void *y) {
    extern __shared__ __align__(16) unsigned char conv_sm[];
    E *xs = (E *)conv_sm;
    const int64_t c0 = (int64_t)blockIdx.x * CONV_TILE_C, c = c0 + threadIdx.x;
    const int64_t r0 = (int64_t)blockIdx.y * CONV_TILE_ROWS;
    const int64_t r1 = r0 + CONV_TILE_ROWS < T ? r0 + CONV_TILE_ROWS : T;
    stage_tile(xs, x, T, C, c0, r0 - K, (int)(r1 - r0 + K));
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    if (c < C)
        conv_fwd_rows<4>(tile_rows<E>{xs + threadIdx.x, r0 - K}, w, dt, C, K, c, r0, r1, cu,
                         ndocs, y);
}

// dx and dw's partial sums in one pass, a thread per channel over the rows
// [r0, r1) of dw's chunk ch: each token's dL/dpre = dy silu'(pre) is formed
// once and kept for the K tokens whose dx needs it (a kernel per output had
// formed it K times, each from K taps):
//   dx[u, c] = sum_j w[c, j] dpre[u + K - 1 - j, c] over the tokens of u's document
//   partial[ch][c K + j] = sum over the chunk's t of dpre[t, c] x[t - K + 1 + j, c]
//                          (that token in t's document).
// Sums in j's and t's order, as the CPU's. partial NULL: dx only.
template <int KM>
__device__ __forceinline__ void conv_bwd_rows(glob_rows x, glob_rows dy, const void *w,
                                              loom_dtype dt, int64_t T, int64_t C, int64_t K,
                                              int64_t c, int64_t ch, int64_t r0, int64_t r1,
                                              const int32_t *cu, int64_t ndocs, void *dx,
                                              double *partial) {
    // at token t: xw[j] = x[t - K + 1 + j]; dp[j] = dpre[t - j], of document dd[j]
    float wk[KM], xw[KM], dp[KM];
    int dd[KM]; // documents as offsets from r0's (-1: none)
    double acc[KM];
#pragma unroll
    for (int j = 0; j < KM; j++) {
        const int64_t u = r0 - K + j; // xw at t = r0 - 1
        wk[j] = j < K ? ld(w, dt, c * K + j) : 0.0f;
        xw[j] = j < K && u >= 0 ? x(u) : 0.0f;
        dp[j] = 0.0f, dd[j] = -1, acc[j] = 0.0;
    }
    const int64_t n0 = doc_of(cu, ndocs, r0);
    int64_t n = n0, s = cu[n], e = cu[n + 1];
    float xnext = 0.0f, dynext = 0.0f; // x and dy loaded a row ahead
    if (r0 < T)
        xnext = x(r0), dynext = dy(r0);
    for (int64_t t = r0; t < r1 + K - 1; t++) {
        float dpt = 0.0f;
        int dt_doc = -1;
        if (t < T) {
            const float xt = xnext, dyt = dynext;
            if (t + 1 < T && t + 1 < r1 + K - 1)
                xnext = x(t + 1), dynext = dy(t + 1);
            while (t >= e)
                s = e, e = cu[++n + 1];
            const float pre = conv_step(xw, wk, xt, K, t, s);
            const float sg = sigm(pre);
            dpt = dyt * sg * (1.0f + pre * (1.0f - sg));
            dt_doc = (int)(n - n0);
            if (partial && t < r1) {
#pragma unroll
                for (int j = 0; j < KM; j++)
                    if (j < K && t - K + 1 + j >= s)
                        acc[j] += (double)dpt * (double)xw[j];
            }
        }
#pragma unroll
        for (int j = KM - 1; j > 0; j--)
            dp[j] = dp[j - 1], dd[j] = dd[j - 1];
        dp[0] = dpt, dd[0] = dt_doc;
        const int64_t u = t - K + 1; // dp[K - 1] is dpre[u]
        if (u >= r0 && u < r1) {
            int du = -1;
#pragma unroll
            for (int j = 0; j < KM; j++)
                if (j == K - 1)
                    du = dd[j];
            float a = 0.0f;
#pragma unroll
            for (int j = 0; j < KM; j++)
                if (j < K && dd[j] == du)
                    a = fmaf(wk[j], dp[j], a);
            st(dx, dt, u * C + c, a);
        }
    }
    if (partial) {
#pragma unroll
        for (int j = 0; j < KM; j++)
            if (j < K)
                partial[ch * C * K + c * K + j] = acc[j];
    }
}

template <int KM>
__global__ void conv_bwd_kernel(const void *dy, const void *x, const void *w, loom_dtype dt,
                                int64_t T, int64_t C, int64_t K, const int32_t *cu, int64_t ndocs,
                                int64_t rows, void *dx, double *partial) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, ch = blockIdx.y;
    if (c >= C)
        return;
    const int64_t r0 = ch * rows, r1 = r0 + rows < T ? r0 + rows : T;
    conv_bwd_rows<KM>(glob_rows{x, dt, C, c}, glob_rows{dy, dt, C, c}, w, dt, T, C, K, c, ch, r0,
                      r1, cu, ndocs, dx, partial);
}

// ---- the gates ----

// torch's softplus (beta 1, threshold 20)
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__global__ void gate_fwd_kernel(const void *a, const void *b, const void *A_log,
                                const void *dt_bias, loom_dtype dt, int64_t T, int64_t H, float *g,
                                float *beta) {
    grid_each(T * H, [&](int64_t i) {
        const int64_t h = i % H;
        const float x = ld(a, dt, i) + ld(dt_bias, dt, h);
        g[i] = -expf(ld(A_log, dt, h)) * softplus(x);
        beta[i] = sigm(ld(b, dt, i));
    });
}

// da = dg * -exp(A_log) sigmoid(a + dt_bias) (softplus' past 20: 1), db = dbeta beta (1 - beta)
__global__ void gate_bwd_kernel(const float *dg, const float *dbeta, const void *a, const void *b,
                                const void *A_log, const void *dt_bias, loom_dtype dt, int64_t T,
                                int64_t H, void *da, void *db) {
    grid_each(T * H, [&](int64_t i) {
        const int64_t h = i % H;
        const float x = ld(a, dt, i) + ld(dt_bias, dt, h), sb = sigm(ld(b, dt, i));
        st(da, dt, i, dg[i] * -expf(ld(A_log, dt, h)) * (x > 20.0f ? 1.0f : sigm(x)));
        st(db, dt, i, dbeta[i] * sb * (1.0f - sb));
    });
}

// partial[chunk][h] = sum of dg g / ... over the chunk's tokens: dA_log's
// terms (dg * -exp(A_log) softplus) at h, ddt_bias's (dg * -exp(A_log)
// sigmoid) at H + h
__global__ void gate_partial_kernel(const float *dg, const void *a, const void *A_log,
                                    const void *dt_bias, loom_dtype dt, int64_t T, int64_t H,
                                    int64_t rows, double *partial) {
    const int64_t ch = blockIdx.x, r0 = ch * rows, r1 = r0 + rows < T ? r0 + rows : T;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
        const float eA = expf(ld(A_log, dt, h)), bias = ld(dt_bias, dt, h);
        double sa = 0, sd = 0;
        for (int64_t t = r0; t < r1; t++) {
            const float x = ld(a, dt, t * H + h), d = dg[t * H + h];
            const float xx = x + bias;
            sa += (double)(d * -eA * softplus(xx));
            sd += (double)(d * -eA * (xx > 20.0f ? 1.0f : sigm(xx)));
        }
        partial[ch * 2 * H + h] = sa;
        partial[ch * 2 * H + H + h] = sd;
    }
}

// ---- the gated RMSNorm: a warp per row ----

// A lane's elements j = lane + 32 i of a row: with NA > 0 (D <= 32 NA) in
// registers, each read once, all in flight together; NA = 0: any D, each
// pass over the row reading it again. The same sums in the same order.
template <int NA>
__global__ void norm_fwd_kernel(const void *x, const void *z, const void *w, loom_dtype dt,
                                int64_t N, int64_t D, float eps, void *y, float *rstd) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N)
        return;
    const int64_t base = r * D;
    double ss = 0;
    float xv[NA > 0 ? NA : 1], zv[NA > 0 ? NA : 1];
    if constexpr (NA > 0) {
#pragma unroll
        for (int i = 0; i < NA; i++) {
            const int64_t j = lane + 32 * i;
            xv[i] = j < D ? ld(x, dt, base + j) : 0.0f;
            zv[i] = j < D ? ld(z, dt, base + j) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < D)
                ss += (double)xv[i] * (double)xv[i];
    } else {
        for (int64_t j = lane; j < D; j += 32) {
            const double v = ld(x, dt, base + j);
            ss += v * v;
        }
    }
    ss = warp_sum(ss);
    const float rs = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
    if (lane == 0)
        rstd[r] = rs;
    auto out = [&](int64_t j, float xx, float zz) { // nx rounded as HF's
        st(y, dt, base + j, ld(w, dt, j) * (xx * rs) * (zz * sigm(zz)));
    };
    if constexpr (NA > 0) {
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < D)
                out(lane + 32 * i, xv[i], zv[i]);
    } else {
        for (int64_t j = lane; j < D; j += 32)
            out(j, ld(x, dt, base + j), ld(z, dt, base + j));
    }
}

// dn = dy w silu(z), dx = rstd dn - rstd^3 / D (dn . x) x, dz = dy w (x rstd) silu'(z)
template <int NA>
__global__ void norm_bwd_kernel(const void *dy, const void *x, const void *z, const void *w,
                                loom_dtype dt, const float *rstd, int64_t N, int64_t D, void *dx,
                                void *dz) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N)
        return;
    const int64_t base = r * D;
    constexpr int M = NA > 0 ? NA : 1;
    float gv[M], xv[M], zv[M]; // dy w, x, z
    auto dterm = [&](float gw, float xx, float zz) {
        return (double)(gw * zz * sigm(zz)) * (double)xx;
    };
    double dot = 0;
    if constexpr (NA > 0) {
#pragma unroll
        for (int i = 0; i < NA; i++) {
            const int64_t j = lane + 32 * i;
            const bool in = j < D;
            zv[i] = in ? ld(z, dt, base + j) : 0.0f;
            gv[i] = in ? ld(dy, dt, base + j) * ld(w, dt, j) : 0.0f;
            xv[i] = in ? ld(x, dt, base + j) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < D)
                dot += dterm(gv[i], xv[i], zv[i]);
    } else {
        for (int64_t j = lane; j < D; j += 32)
            dot += dterm(ld(dy, dt, base + j) * ld(w, dt, j), ld(x, dt, base + j),
                         ld(z, dt, base + j));
    }
    dot = warp_sum(dot);
    const float rs = rstd[r];
    const float c = (float)(dot * (double)rs * (double)rs * (double)rs / (double)D);
    auto out = [&](int64_t j, float gw, float xx, float zz) {
        const float sg = sigm(zz);
        st(dx, dt, base + j, rs * (gw * zz * sg) - c * xx);
        st(dz, dt, base + j, gw * (xx * rs) * sg * (1.0f + zz * (1.0f - sg)));
    };
    if constexpr (NA > 0) {
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < D)
                out(lane + 32 * i, gv[i], xv[i], zv[i]);
    } else {
        for (int64_t j = lane; j < D; j += 32)
            out(j, ld(dy, dt, base + j) * ld(w, dt, j), ld(x, dt, base + j), ld(z, dt, base + j));
    }
}

// partial[chunk][j] = sum over the chunk's rows of dy (x rstd) silu(z) at column j
__global__ void norm_dw_partial_kernel(const void *dy, const void *x, const void *z, loom_dtype dt,
                                       const float *rstd, int64_t N, int64_t D, int64_t rows,
                                       double *partial) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, ch = blockIdx.y;
    if (j >= D)
        return;
    const int64_t r0 = ch * rows, r1 = r0 + rows < N ? r0 + rows : N;
    auto term = [&](float d, float xx, float rs, float zz) {
        return (double)d * (double)(xx * rs) * (double)(zz * sigm(zz));
    };
    double acc = 0;
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) { // the loads of 4 rows in flight together, summed in order
        float d[4], xx[4], rs[4], zz[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int64_t o = (r + i) * D + j;
            d[i] = ld(dy, dt, o), xx[i] = ld(x, dt, o), rs[i] = rstd[r + i], zz[i] = ld(z, dt, o);
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
            acc += term(d[i], xx[i], rs[i], zz[i]);
    }
    for (; r < r1; r++)
        acc += term(ld(dy, dt, r * D + j), ld(x, dt, r * D + j), rstd[r], ld(z, dt, r * D + j));
    partial[ch * D + j] = acc;
}

loom_status no_scratch(loom_ctx *ctx, const char *op) {
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                     "cuda %s: a parameter gradient needs the op's scratch (cuda_ops.h)", op);
}
} // namespace

extern "C" size_t loom_cuda_gdn_conv_scratch_bytes(int64_t T, int64_t C, int64_t K) {
    return (size_t)(red_chunks(T) * C * K) * sizeof(double);
}

extern "C" size_t loom_cuda_gdn_gate_scratch_bytes(int64_t T, int64_t H) {
    return (size_t)(red_chunks(T) * 2 * H) * sizeof(double);
}

extern "C" size_t loom_cuda_gdn_norm_scratch_bytes(int64_t N, int64_t D) {
    return (size_t)(red_chunks(N) * D) * sizeof(double);
}

static loom_status conv_args(loom_ctx *ctx, const char *op, loom_dtype dt, int64_t C, int64_t K,
                             int64_t ndocs) {
    loom_status st = need_float(ctx, dt, op, "x");
    if (st)
        return st;
    if (K < 1 || K > CONV_MAX_K || C < 1 || ndocs < 1)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda %s: kernel %lld over %lld channels, %lld documents (kernels of 1 to "
                         "%d taps)",
                         op, (long long)K, (long long)C, (long long)ndocs, CONV_MAX_K);
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_gdn_conv_fwd(loom_ctx *ctx, const void *x, const void *w,
                                              loom_dtype dtype, int64_t T, int64_t C, int64_t K,
                                              const int32_t *cu, int64_t ndocs, void *y,
                                              void *stream) {
    loom_status st = conv_args(ctx, "gdn_conv_fwd", dtype, C, K, ndocs);
    if (st || T <= 0)
        return st;
    if (conv_tiled(dtype, C, K, x)) {
        const dim3 grid((unsigned)((C + CONV_TILE_C - 1) / CONV_TILE_C),
                        (unsigned)((T + CONV_TILE_ROWS - 1) / CONV_TILE_ROWS));
        const size_t bytes = (size_t)(CONV_TILE_ROWS + K) * CONV_TILE_C * 2;
        auto kern = dtype == LOOM_BF16 ? conv_fwd_tile_kernel<__nv_bfloat16>
                                       : conv_fwd_tile_kernel<__half>;
        kern<<<grid, CONV_TILE_C, bytes, as_stream(stream)>>>(x, w, dtype, T, C, K, cu, ndocs, y);
        return check_launch(ctx, "gdn_conv_fwd");
    }
    const dim3 grid((unsigned)((C + NT - 1) / NT),
                    (unsigned)((T + CONV_FWD_ROWS - 1) / CONV_FWD_ROWS));
    auto kern = K <= 4 ? conv_fwd_kernel<4> : conv_fwd_kernel<CONV_MAX_K>;
    kern<<<grid, NT, 0, as_stream(stream)>>>(x, w, dtype, T, C, K, cu, ndocs, y);
    return check_launch(ctx, "gdn_conv_fwd");
}

extern "C" loom_status loom_cuda_gdn_conv_bwd(loom_ctx *ctx, const void *dy, const void *x,
                                              const void *w, loom_dtype dtype, int64_t T, int64_t C,
                                              int64_t K, const int32_t *cu, int64_t ndocs, void *dx,
                                              float *dw, void *scratch, void *stream) {
    loom_status st = conv_args(ctx, "gdn_conv_bwd", dtype, C, K, ndocs);
    if (st || T <= 0)
        return st;
    if (dw && !scratch)
        return no_scratch(ctx, "gdn_conv_bwd");
    cudaStream_t s = as_stream(stream);
    const int64_t rows = red_rows(T), nch = red_chunks(T);
    dim3 grid((unsigned)((C + NT - 1) / NT), (unsigned)nch);
    auto kern = K <= 4 ? conv_bwd_kernel<4> : conv_bwd_kernel<CONV_MAX_K>;
    kern<<<grid, NT, 0, s>>>(dy, x, w, dtype, T, C, K, cu, ndocs, rows, dx,
                             dw ? (double *)scratch : nullptr);
    if ((st = check_launch(ctx, "gdn_conv_bwd")) || !dw)
        return st;
    return col_final(ctx, "gdn_conv_bwd", scratch, nch, C * K, C * K, dw, nullptr, s);
}

extern "C" loom_status loom_cuda_gdn_gate_fwd(loom_ctx *ctx, const void *a, const void *b,
                                              const void *A_log, const void *dt_bias,
                                              loom_dtype dtype, int64_t T, int64_t H, float *g,
                                              float *beta, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_gate_fwd", "a");
    if (st || T <= 0 || H <= 0)
        return st;
    gate_fwd_kernel<<<grid_for(T * H, NT), NT, 0, as_stream(stream)>>>(a, b, A_log, dt_bias, dtype,
                                                                       T, H, g, beta);
    return check_launch(ctx, "gdn_gate_fwd");
}

extern "C" loom_status loom_cuda_gdn_gate_bwd(loom_ctx *ctx, const float *dg, const float *dbeta,
                                              const void *a, const void *b, const void *A_log,
                                              const void *dt_bias, loom_dtype dtype, int64_t T,
                                              int64_t H, void *da, void *db, float *dA_log,
                                              float *ddt_bias, void *scratch, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_gate_bwd", "a");
    if (st || T <= 0 || H <= 0)
        return st;
    if ((dA_log || ddt_bias) && !scratch)
        return no_scratch(ctx, "gdn_gate_bwd");
    cudaStream_t s = as_stream(stream);
    gate_bwd_kernel<<<grid_for(T * H, NT), NT, 0, s>>>(dg, dbeta, a, b, A_log, dt_bias, dtype, T, H,
                                                       da, db);
    if ((st = check_launch(ctx, "gdn_gate_bwd")) || (!dA_log && !ddt_bias))
        return st;
    const int64_t rows = red_rows(T), nch = red_chunks(T);
    gate_partial_kernel<<<(unsigned)nch, NT, 0, s>>>(dg, a, A_log, dt_bias, dtype, T, H, rows,
                                                     (double *)scratch);
    if ((st = check_launch(ctx, "gdn_gate_bwd")))
        return st;
    return col_final(ctx, "gdn_gate_bwd", scratch, nch, 2 * H, H, dA_log, ddt_bias, s);
}

extern "C" loom_status loom_cuda_gdn_norm_fwd(loom_ctx *ctx, const void *x, const void *z,
                                              const void *w, loom_dtype dtype, int64_t N, int64_t D,
                                              float eps, void *y, float *rstd, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_norm_fwd", "x");
    if (st || N <= 0 || D <= 0)
        return st;
    auto kern = D <= 128 ? norm_fwd_kernel<4> : norm_fwd_kernel<0>;
    kern<<<(unsigned)((N + WARPS - 1) / WARPS), NT, 0, as_stream(stream)>>>(x, z, w, dtype, N, D,
                                                                           eps, y, rstd);
    return check_launch(ctx, "gdn_norm_fwd");
}

extern "C" loom_status loom_cuda_gdn_norm_bwd(loom_ctx *ctx, const void *dy, const void *x,
                                              const void *z, const void *w, loom_dtype dtype,
                                              const float *rstd, int64_t N, int64_t D, void *dx,
                                              void *dz, float *dw, void *scratch, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_norm_bwd", "x");
    if (st || N <= 0 || D <= 0)
        return st;
    if (dx == dy || dz == dy)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda gdn_norm_bwd: dx and dz must not alias dy");
    if (dw && !scratch)
        return no_scratch(ctx, "gdn_norm_bwd");
    cudaStream_t s = as_stream(stream);
    if (dw) { // the partials first (they read dy), though dx and dz never alias it
        const int64_t rows = red_rows(N), nch = red_chunks(N);
        dim3 grid((unsigned)((D + NT - 1) / NT), (unsigned)nch);
        norm_dw_partial_kernel<<<grid, NT, 0, s>>>(dy, x, z, dtype, rstd, N, D, rows,
                                                   (double *)scratch);
        if ((st = check_launch(ctx, "gdn_norm_bwd")) ||
            (st = col_final(ctx, "gdn_norm_bwd", scratch, nch, D, D, dw, nullptr, s)))
            return st;
    }
    auto kern = D <= 128 ? norm_bwd_kernel<4> : norm_bwd_kernel<0>;
    kern<<<(unsigned)((N + WARPS - 1) / WARPS), NT, 0, s>>>(dy, x, z, w, dtype, rstd, N, D, dx, dz);
    return check_launch(ctx, "gdn_norm_bwd");
}
