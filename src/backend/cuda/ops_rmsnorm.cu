// RMSNorm forward and backward. One warp per row; sums of squares and dot
// products in double (as the CPU), the output rounded as HF: w * (x * rstd).
// The weight gradient is reduced in two fixed-order stages through scratch.
// BF16/F16 rows whose length is a multiple of 8 (16-byte aligned) take the
// vector kernels: 8 elements per 16-byte load, same math.
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
} // namespace

__global__ void rmsnorm_fwd_kernel(const void *x, loom_dtype xdt, const void *w, loom_dtype wdt,
                                   int64_t N, int64_t H, float eps, void *y, loom_dtype ydt,
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
        st(y, ydt, base + j, __fmul_rn(ld(w, wdt, j), __fmul_rn(ld(x, xdt, base + j), rs)));
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
__global__ void rmsnorm_dw_final_kernel(const double *partial, int64_t nchunk, int64_t H, float *dw) {
    const int lane = threadIdx.x & 31;
    const int64_t j = (int64_t)blockIdx.x * DW_COLS + (threadIdx.x >> 5);
    if (j >= H) return;
    double acc = 0;
    for (int64_t c = lane; c < nchunk; c += 32) acc += partial[c * H + j];
    acc = warp_sum(acc);
    if (lane == 0) dw[j] += (float)acc;
}

// dx_j = rstd w_j dy_j - x_j rstd^3 / H * sum_k dy_k w_k x_k (double, rounded once).
__global__ void rmsnorm_dx_kernel(const void *dy, loom_dtype dydt, const void *x, loom_dtype xdt,
                                  const void *w, loom_dtype wdt, const float *rstd, int64_t N,
                                  int64_t H, void *dx, loom_dtype dxdt) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int64_t base = r * H;
    double dot = 0;
    for (int64_t j = lane; j < H; j += 32)
        dot += (double)ld(dy, dydt, base + j) * (double)ld(w, wdt, j) * (double)ld(x, xdt, base + j);
    dot = warp_sum(dot);
    const double rs = (double)rstd[r];
    const double c = dot * rs * rs * rs / (double)H;
    // every lane has read its dy elements above; each writes only its own: dx may alias dy
    for (int64_t j = lane; j < H; j += 32) {
        double g = rs * (double)ld(w, wdt, j) * (double)ld(dy, dydt, base + j);
        st(dx, dxdt, base + j, (float)(g - c * (double)ld(x, xdt, base + j)));
    }
}

// ---- 16-byte vector path (x, y, dy, dx all BF16 or all F16) ----
template <typename T>
__global__ void rmsnorm_fwd_vec_kernel(const T *x, const void *w, loom_dtype wdt, int64_t N, int64_t H,
                                       float eps, T *y, float *rstd) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const T *xr = x + r * H;
    double ss = 0;
    for (int64_t j = lane * 8; j < H; j += 256) {
        float v[8];
        ld8(xr + j, v);
#pragma unroll
        for (int i = 0; i < 8; i++) ss += (double)v[i] * (double)v[i];
    }
    ss = warp_sum(ss);
    const float rs = (float)(1.0 / sqrt(ss / (double)H + (double)eps));
    if (lane == 0) rstd[r] = rs;
    for (int64_t j = lane * 8; j < H; j += 256) {
        float v[8];
        ld8(xr + j, v);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = __fmul_rn(ld(w, wdt, j + i), __fmul_rn(v[i], rs));
        st8(y + r * H + j, v);
    }
}

template <typename T>
__global__ void rmsnorm_dx_vec_kernel(const T *dy, const T *x, const void *w, loom_dtype wdt,
                                      const float *rstd, int64_t N, int64_t H, T *dx) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= N) return;
    const int64_t base = r * H;
    double dot = 0;
    for (int64_t j = lane * 8; j < H; j += 256) {
        float g[8], v[8];
        ld8(dy + base + j, g);
        ld8(x + base + j, v);
#pragma unroll
        for (int i = 0; i < 8; i++) dot += (double)g[i] * (double)ld(w, wdt, j + i) * (double)v[i];
    }
    dot = warp_sum(dot);
    const double rs = (double)rstd[r];
    const double c = dot * rs * rs * rs / (double)H;
    // each lane rewrites only the elements it read: dx may alias dy
    for (int64_t j = lane * 8; j < H; j += 256) {
        float g[8], v[8];
        ld8(dy + base + j, g);
        ld8(x + base + j, v);
#pragma unroll
        for (int i = 0; i < 8; i++)
            g[i] = (float)(rs * (double)ld(w, wdt, j + i) * (double)g[i] - c * (double)v[i]);
        st8(dx + base + j, g);
    }
}

extern "C" loom_status loom_cuda_rmsnorm_fwd(loom_ctx *ctx, const void *x, loom_dtype x_dtype,
                                             const void *w, loom_dtype w_dtype, int64_t N,
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
                (const __nv_bfloat16 *)x, w, w_dtype, N, H, eps, (__nv_bfloat16 *)y, rstd);
        else
            rmsnorm_fwd_vec_kernel<<<blocks, WARPS * 32, 0, as_stream(stream)>>>(
                (const __half *)x, w, w_dtype, N, H, eps, (__half *)y, rstd);
        return check_launch(ctx, "rmsnorm_fwd");
    }
    rmsnorm_fwd_kernel<<<blocks, WARPS * 32, 0, as_stream(stream)>>>(x, x_dtype, w, w_dtype, N, H, eps,
                                                                      y, y_dtype, rstd);
    return check_launch(ctx, "rmsnorm_fwd");
}

extern "C" size_t loom_cuda_rmsnorm_bwd_scratch_bytes(int64_t N, int64_t H) {
    if (N <= 0 || H <= 0) return 0;
    int64_t rows = dw_rows_per_chunk(N);
    return (size_t)((N + rows - 1) / rows) * (size_t)H * sizeof(double);
}

extern "C" loom_status loom_cuda_rmsnorm_bwd(loom_ctx *ctx, const void *dy, loom_dtype dy_dtype,
                                             const void *x, loom_dtype x_dtype, const void *w,
                                             loom_dtype w_dtype, const float *rstd, int64_t N,
                                             int64_t H, void *dx, loom_dtype dx_dtype, float *dw,
                                             void *scratch, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dy_dtype, "rmsnorm_bwd", "dy")) ||
        (st = need_float(ctx, x_dtype, "rmsnorm_bwd", "x")) ||
        (st = need_float(ctx, w_dtype, "rmsnorm_bwd", "w")) ||
        (st = need_float(ctx, dx_dtype, "rmsnorm_bwd", "dx")))
        return st;
    if (dx == dy && dx_dtype != dy_dtype)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda rmsnorm_bwd: dx aliases dy with another dtype (%s vs %s)",
                         loom_dtype_name(dx_dtype), loom_dtype_name(dy_dtype));
    if (dw && !scratch)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda rmsnorm_bwd: dw needs scratch of "
                         "loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) bytes");
    if (N <= 0 || H <= 0) return LOOM_OK;
    cudaStream_t s = as_stream(stream);
    if (dw) { // before dx: dx may overwrite dy
        const int64_t rows = dw_rows_per_chunk(N), nchunk = (N + rows - 1) / rows;
        const int threads = 128;
        dim3 grid((unsigned)((H + threads - 1) / threads), (unsigned)nchunk);
        rmsnorm_dw_partial_kernel<<<grid, threads, 0, s>>>(dy, dy_dtype, x, x_dtype, rstd, N, H,
                                                            rows, (double *)scratch);
        if ((st = check_launch(ctx, "rmsnorm_bwd"))) return st;
        rmsnorm_dw_final_kernel<<<(unsigned)((H + DW_COLS - 1) / DW_COLS), DW_COLS * 32, 0, s>>>(
            (const double *)scratch, nchunk, H, dw);
        if ((st = check_launch(ctx, "rmsnorm_bwd"))) return st;
    }
    const unsigned blocks = (unsigned)((N + WARPS - 1) / WARPS);
    if (dy_dtype == x_dtype && dx_dtype == x_dtype && vec8_ok(x_dtype, H, dy, x) &&
        vec8_ok(x_dtype, H, dx, dx)) {
        if (x_dtype == LOOM_BF16)
            rmsnorm_dx_vec_kernel<<<blocks, WARPS * 32, 0, s>>>(
                (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)x, w, w_dtype, rstd, N, H,
                (__nv_bfloat16 *)dx);
        else
            rmsnorm_dx_vec_kernel<<<blocks, WARPS * 32, 0, s>>>((const __half *)dy, (const __half *)x, w,
                                                                w_dtype, rstd, N, H, (__half *)dx);
        return check_launch(ctx, "rmsnorm_bwd");
    }
    rmsnorm_dx_kernel<<<blocks, WARPS * 32, 0, s>>>(dy, dy_dtype, x, x_dtype, w, w_dtype, rstd, N, H, dx,
                                                    dx_dtype);
    return check_launch(ctx, "rmsnorm_bwd");
}
