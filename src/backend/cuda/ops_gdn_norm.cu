// Gated DeltaNet's gated RMSNorm (cuda_ops.h's loom_cuda_gdn_norm_fwd and
// _bwd; the CPU reference is src/backend/cpu/gdn.c): y = w norm(x) silu(z)
// over rows of D, the rows' sums of squares and dots in double, as the
// CPU's; dw's sum over rows as per-chunk partials in double (red_rows rows
// a chunk) added by col_final in an order fixed by the shape: no atomics.
// 16-bit rows of D <= 128 take the half-warp kernels (norm_h_ok), any other
// the warp-per-row ones.
//
// tests/test_backend_gdn.c holds them to the CPU's (run on an H200);
// `make test-emu` runs them on the CPU in CI.
#include <initializer_list>

#include "ops_gdn_small.cuh"

using namespace loom_cuda;
using namespace loom_gdn_small;

namespace {

// ---- any float dtype, any D: a warp a row ----

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

// dn = dy w silu(z), dx = rstd dn - rstd^3 / D (dn . x) x, dz = dy w (x rstd) silu'(z).
// A row's terms of dn . x:
__device__ __forceinline__ double norm_dterm(float gw, float xx, float zz) {
    return (double)(gw * zz * sigm(zz)) * (double)xx;
}
// dx and dz of row r's column j from dn's factors and c = rstd^3 / D (dn . x)
__device__ __forceinline__ void norm_bwd_out(void *dx, void *dz, loom_dtype dt, int64_t r,
                                             int64_t D, int64_t j, float rs, float c, float gw,
                                             float xx, float zz) {
    const float sg = sigm(zz);
    st(dx, dt, r * D + j, rs * (gw * zz * sg) - c * xx);
    st(dz, dt, r * D + j, gw * (xx * rs) * sg * (1.0f + zz * (1.0f - sg)));
}

// Any D: a warp a row, each pass over the row reading it again.
__device__ __forceinline__ void norm_bwd_row(const void *dy, const void *x, const void *z,
                                             const void *w, loom_dtype dt, const float *rstd,
                                             int64_t r, int64_t D, void *dx, void *dz) {
    const int lane = threadIdx.x & 31;
    const int64_t base = r * D;
    double dot = 0;
    for (int64_t j = lane; j < D; j += 32)
        dot += norm_dterm(ld(dy, dt, base + j) * ld(w, dt, j), ld(x, dt, base + j),
                          ld(z, dt, base + j));
    dot = warp_sum(dot);
    const float rs = rstd[r];
    const float c = (float)(dot * (double)rs * (double)rs * (double)rs / (double)D);
    for (int64_t j = lane; j < D; j += 32)
        norm_bwd_out(dx, dz, dt, r, D, j, rs, c, ld(dy, dt, base + j) * ld(w, dt, j),
                     ld(x, dt, base + j), ld(z, dt, base + j));
}

// D <= 32 NA: a lane's elements j = lane + 32 i of row r in registers, each
// read once (load), all in flight together; bwd: dx, dz, and with DW dw's
// terms dy (x rstd) silu(z) added to dwa, as norm_dw_partial_kernel's.
template <int NA> struct norm_row {
    float d[NA], x[NA], z[NA], rs; // dy, x, z, rstd
    __device__ __forceinline__ void load(const void *dy, const void *xp, const void *zp,
                                         loom_dtype dt, const float *rstd, int64_t r, int64_t D) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < NA; i++) {
            const int64_t j = lane + 32 * i;
            const bool in = j < D;
            z[i] = in ? ld(zp, dt, r * D + j) : 0.0f;
            d[i] = in ? ld(dy, dt, r * D + j) : 0.0f;
            x[i] = in ? ld(xp, dt, r * D + j) : 0.0f;
        }
        rs = rstd[r];
    }
    template <bool DW>
    __device__ __forceinline__ void bwd(const void *w, loom_dtype dt, int64_t r, int64_t D,
                                        void *dx, void *dz, double (&dwa)[NA]) const {
        const int lane = threadIdx.x & 31;
        float gv[NA]; // dy w
        double dot = 0;
#pragma unroll
        for (int i = 0; i < NA; i++) {
            const bool in = lane + 32 * i < D;
            gv[i] = d[i] * (in ? ld(w, dt, lane + 32 * i) : 0.0f);
            if (in)
                dot += norm_dterm(gv[i], x[i], z[i]);
        }
        dot = warp_sum(dot);
        const float c = (float)(dot * (double)rs * (double)rs * (double)rs / (double)D);
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < D) {
                if (DW)
                    dwa[i] += (double)d[i] * (double)(x[i] * rs) * (double)(z[i] * sigm(z[i]));
                norm_bwd_out(dx, dz, dt, r, D, lane + 32 * i, rs, c, gv[i], x[i], z[i]);
            }
    }
};

// A warp a row, WARPS rows a block (NA > 0: norm_row, else norm_bwd_row).
template <int NA>
__global__ void norm_bwd_kernel(const void *dy, const void *x, const void *z, const void *w,
                                loom_dtype dt, const float *rstd, int64_t N, int64_t D, void *dx,
                                void *dz) {
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N)
        return;
    if constexpr (NA > 0) {
        norm_row<NA> v;
        double none[NA];
        v.load(dy, x, z, dt, rstd, r, D);
        v.template bwd<false>(w, dt, r, D, dx, dz, none);
    } else {
        norm_bwd_row(dy, x, z, w, dt, rstd, r, D, dx, dz);
    }
}

// norm_bwd_kernel with dw's partial sums fused (D <= 32 NA): a block a chunk
// of rows [ch rows, ..) (red_rows), warp u over its rows u, u + WARPS, ...,
// then partial[ch][j] = the warps' sums in warp order. The rows' dy, x and z
// are read once for dx, dz and dw, where a kernel of its own for dw's partials
// read them again (at Qwen3.5-0.8B's shapes on an H200, 35 + 37 us a layer ->
// 54 at 64 registers, four blocks an SM; loading a warp's next row while
// working on one took 62 at 78 registers).
template <int NA>
__global__ void __launch_bounds__(NT, 4)
    norm_bwd_dw_kernel(const void *dy, const void *x, const void *z, const void *w, loom_dtype dt,
                       const float *rstd, int64_t N, int64_t D, int64_t rows, void *dx, void *dz,
                       double *partial) {
    static_assert(NA > 0, "a lane's columns in registers");
    __shared__ double sums[WARPS][32 * NA];
    const int lane = threadIdx.x & 31, u = threadIdx.x >> 5;
    const int64_t ch = blockIdx.x, r0 = ch * rows, r1 = r0 + rows < N ? r0 + rows : N;
    double dwa[NA] = {};
    for (int64_t r = r0 + u; r < r1; r += WARPS) {
        norm_row<NA> v;
        v.load(dy, x, z, dt, rstd, r, D);
        v.template bwd<true>(w, dt, r, D, dx, dz, dwa);
    }
#pragma unroll
    for (int i = 0; i < NA; i++)
        sums[u][lane + 32 * i] = dwa[i];
    __syncthreads();
    for (int64_t j = threadIdx.x; j < D; j += NT) {
        double acc = 0;
        for (int k = 0; k < WARPS; k++)
            acc += sums[k][j];
        partial[ch * D + j] = acc;
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

// ---- 16-bit rows, D <= 128, a multiple of 8: a half-warp a row ----
//
// Lane l of a half takes the columns 8 (l % 16).. of its row, one 16-byte
// access a tensor (w's once a thread); a warp's halves take adjacent rows
// (512 contiguous bytes a tensor at D = 128) and each half HR rows at a
// time, every load of them issued before the first is used. The rows' sums
// over the half's lanes by shuffles, in double; the SiLU's sigmoid is
// sigm_fast's. (A warp a row with a lane's columns 32 apart, a 2-byte access
// each, IEEE sigmoids and a row's loads waited for before the next row's
// took 105 and 212 us a layer at Qwen3.5-0.8B's 16384 tokens on an H200,
// where the forward's bytes take about 50 and the backward's 84.)
constexpr int HR = 2;            // rows of a half in flight
constexpr int HALVES = NT / 16;  // halves a block

// HALVES * HR rows a block: half u's rows u, u + HALVES, ...
template <typename T>
__global__ void __launch_bounds__(NT) norm_fwd_h_kernel(const T *x, const T *z, const T *w,
                                                        int64_t N, int64_t D, float eps, T *y,
                                                        float *rstd) {
    const int64_t j = 8 * (threadIdx.x & 15);
    const int64_t b0 = (int64_t)blockIdx.x * HALVES * HR + (threadIdx.x >> 4);
    const bool act = j < D;
    float wv[8] = {};
    if (act)
        ld8(w + j, wv);
    uint4 xr[HR], zr[HR];
#pragma unroll
    for (int k = 0; k < HR; k++) {
        const int64_t r = b0 + k * HALVES;
        const bool in = act && r < N;
        xr[k] = ld16_or0(x + r * D + j, in);
        zr[k] = ld16_or0(z + r * D + j, in);
    }
#pragma unroll
    for (int k = 0; k < HR; k++) {
        const int64_t r = b0 + k * HALVES;
        float xv[8], zv[8];
        cvt8<T>(xr[k], xv);
        cvt8<T>(zr[k], zv);
        double ss = 0;
#pragma unroll
        for (int i = 0; i < 8; i++)
            ss += (double)xv[i] * (double)xv[i];
        ss = half_sum(ss);
        const float rs = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
        if (r < N) {
            if (j == 0)
                rstd[r] = rs;
            if (act) {
                float o[8];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[i] = wv[i] * (xv[i] * rs) * (zv[i] * sigm_fast(zv[i]));
                st8(y + r * D + j, o);
            }
        }
    }
}

// dx, dz (norm_row's sums) and with DW dw's partial sums: a block a chunk of
// rows [ch rows, ..) (red_rows), half u over its rows u, u + HALVES, ..., HR
// at a time; then partial[ch][j] = the halves' sums in half order.
template <typename T, bool DW>
__global__ void __launch_bounds__(NT) norm_bwd_h_kernel(const T *dy, const T *x, const T *z,
                                                        const T *w, const float *rstd, int64_t N,
                                                        int64_t D, int64_t rows, T *dx, T *dz,
                                                        double *partial) {
    __shared__ double sums[DW ? HALVES : 1][DW ? 128 : 1];
    const int hf = threadIdx.x >> 4;
    const int64_t j = 8 * (threadIdx.x & 15);
    const bool act = j < D;
    float wv[8] = {};
    if (act)
        ld8(w + j, wv);
    const int64_t r0 = (int64_t)blockIdx.x * rows, r1 = r0 + rows < N ? r0 + rows : N;
    double dwa[8] = {};
    for (int64_t b = r0 + hf; b - hf < r1; b += HALVES * HR) { // the same trips for every thread
        uint4 dr[HR], xr[HR], zr[HR];
        float rs[HR];
#pragma unroll
        for (int k = 0; k < HR; k++) {
            const int64_t r = b + k * HALVES;
            const bool in = act && r < r1;
            dr[k] = ld16_or0(dy + r * D + j, in);
            xr[k] = ld16_or0(x + r * D + j, in);
            zr[k] = ld16_or0(z + r * D + j, in);
            rs[k] = r < r1 ? rstd[r] : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < HR; k++) {
            const int64_t r = b + k * HALVES;
            float d[8], xv[8], zv[8], sg[8], gv[8];
            cvt8<T>(dr[k], d);
            cvt8<T>(xr[k], xv);
            cvt8<T>(zr[k], zv);
            double dot = 0;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                sg[i] = sigm_fast(zv[i]);
                gv[i] = d[i] * wv[i]; // dy w
                dot += (double)(gv[i] * zv[i] * sg[i]) * (double)xv[i];
            }
            dot = half_sum(dot);
            const float s = rs[k];
            const float c = (float)(dot * (double)s * (double)s * (double)s / (double)D);
            if (act && r < r1) {
                float ox[8], oz[8];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    if (DW)
                        dwa[i] += (double)d[i] * (double)(xv[i] * s) * (double)(zv[i] * sg[i]);
                    ox[i] = s * (gv[i] * zv[i] * sg[i]) - c * xv[i];
                    oz[i] = gv[i] * (xv[i] * s) * sg[i] * (1.0f + zv[i] * (1.0f - sg[i]));
                }
                st8(dx + r * D + j, ox);
                st8(dz + r * D + j, oz);
            }
        }
    }
    if constexpr (DW) {
        if (act)
#pragma unroll
            for (int i = 0; i < 8; i++)
                sums[hf][j + i] = dwa[i];
        __syncthreads();
        for (int64_t c = threadIdx.x; c < D; c += NT) {
            double acc = 0;
            for (int k = 0; k < HALVES; k++)
                acc += sums[k][c];
            partial[blockIdx.x * D + c] = acc;
        }
    }
}

// Whether the half-warp kernels take these tensors: 16-bit, D <= 128 and a
// multiple of 8, every one 16-byte aligned.
bool norm_h_ok(loom_dtype dt, int64_t D, std::initializer_list<const void *> ps) {
    if ((dt != LOOM_BF16 && dt != LOOM_F16) || D % 8 != 0 || D > 128)
        return false;
    for (const void *p : ps)
        if (!aligned16(p))
            return false;
    return true;
}
} // namespace

extern "C" size_t loom_cuda_gdn_norm_scratch_bytes(int64_t N, int64_t D) {
    return (size_t)(red_chunks(N) * D) * sizeof(double);
}

extern "C" loom_status loom_cuda_gdn_norm_fwd(loom_ctx *ctx, const void *x, const void *z,
                                              const void *w, loom_dtype dtype, int64_t N, int64_t D,
                                              float eps, void *y, float *rstd, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_norm_fwd", "x");
    if (st || N <= 0 || D <= 0)
        return st;
    const cudaStream_t s = as_stream(stream);
    if (norm_h_ok(dtype, D, {x, z, w, y})) {
        const unsigned grid = (unsigned)((N + HALVES * HR - 1) / (HALVES * HR));
        on_16bit(dtype, [&](auto t) {
            using T = decltype(t);
            norm_fwd_h_kernel<T><<<grid, NT, 0, s>>>((const T *)x, (const T *)z, (const T *)w, N,
                                                     D, eps, (T *)y, rstd);
        });
        return check_launch(ctx, "gdn_norm_fwd");
    }
    auto kern = D <= 128 ? norm_fwd_kernel<4> : norm_fwd_kernel<0>;
    kern<<<(unsigned)((N + WARPS - 1) / WARPS), NT, 0, s>>>(x, z, w, dtype, N, D, eps, y, rstd);
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
    if (norm_h_ok(dtype, D, {dy, x, z, w, dx, dz})) { // dx, dz and dw's partials in one pass
        const int64_t rows = red_rows(N), nch = red_chunks(N);
        on_16bit(dtype, [&](auto t) {
            using T = decltype(t);
            auto k = dw ? norm_bwd_h_kernel<T, true> : norm_bwd_h_kernel<T, false>;
            k<<<(unsigned)nch, NT, 0, s>>>((const T *)dy, (const T *)x, (const T *)z, (const T *)w,
                                           rstd, N, D, rows, (T *)dx, (T *)dz,
                                           dw ? (double *)scratch : nullptr);
        });
        if ((st = check_launch(ctx, "gdn_norm_bwd")) || !dw)
            return st;
        return col_final(ctx, "gdn_norm_bwd", scratch, nch, D, D, dw, nullptr, s);
    }
    if (dw && D <= 128) { // dx, dz and dw's partials in one pass
        const int64_t rows = red_rows(N), nch = red_chunks(N);
        norm_bwd_dw_kernel<4><<<(unsigned)nch, NT, 0, s>>>(dy, x, z, w, dtype, rstd, N, D, rows,
                                                            dx, dz, (double *)scratch);
        if ((st = check_launch(ctx, "gdn_norm_bwd")))
            return st;
        return col_final(ctx, "gdn_norm_bwd", scratch, nch, D, D, dw, nullptr, s);
    }
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
