// Element-wise ops of a layer: SwiGLU, residual add, bias forward and backward.
// fp32 arithmetic in the CPU's operation order without FMA contraction; only
// the sigmoid differs from the CPU's (IEEE expf within 2 ulp for F32, the
// hardware's exp2 and reciprocal for BF16/F16: see sigmoid1).
#include "../../core/rng.h"
#include "ops_common.cuh"

using namespace loom_cuda;

__global__ void swiglu_fwd_kernel(const void *g, const void *u, int64_t n, void *h, loom_dtype dt) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        st(h, dt, i, swiglu1(ld(g, dt, i), ld(u, dt, i), dt != LOOM_F32));
    }
}

__global__ void swiglu_bwd_kernel(const void *dh, const void *g, const void *u, int64_t n, void *dg,
                                  void *du, loom_dtype dt) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float dgi, dui;
        swiglu1_bwd(ld(dh, dt, i), ld(g, dt, i), ld(u, dt, i), dgi, dui, dt != LOOM_F32);
        st(dg, dt, i, dgi); // all reads of element i are done: dg/du may alias g/u/dh
        st(du, dt, i, dui);
    }
}

// The same three ops on BF16/F16, 8 elements per 16-byte access (n8 = n / 8).
template <typename T>
__global__ void swiglu_fwd_vec_kernel(const T *g, const T *u, int64_t n8, T *h) {
    grid_each(n8, [&](int64_t i) {
        float gv[8], uv[8];
        ld8(g + 8 * i, gv);
        ld8(u + 8 * i, uv);
#pragma unroll
        for (int k = 0; k < 8; k++) gv[k] = swiglu1(gv[k], uv[k], true);
        st8(h + 8 * i, gv);
    });
}

template <typename T>
__global__ void swiglu_bwd_vec_kernel(const T *dh, const T *g, const T *u, int64_t n8, T *dg, T *du) {
    grid_each(n8, [&](int64_t i) {
        float gv[8], uv[8], dv[8];
        ld8(g + 8 * i, gv);
        ld8(u + 8 * i, uv);
        ld8(dh + 8 * i, dv);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float dgi, dui;
            swiglu1_bwd(dv[k], gv[k], uv[k], dgi, dui, true);
            gv[k] = dgi;
            uv[k] = dui;
        }
        st8(dg + 8 * i, gv); // all 8 elements were read: dg/du may alias g/u/dh
        st8(du + 8 * i, uv);
    });
}

template <typename T>
__global__ void residual_vec_kernel(T *y, const T *x, int64_t n8) {
    grid_each(n8, [&](int64_t i) {
        float yv[8], xv[8];
        ld8(y + 8 * i, yv);
        ld8(x + 8 * i, xv);
#pragma unroll
        for (int k = 0; k < 8; k++) yv[k] = __fadd_rn(yv[k], xv[k]);
        st8(y + 8 * i, yv);
    });
}

__global__ void residual_kernel(void *y, loom_dtype ydt, const void *x, loom_dtype xdt, int64_t n) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        st(y, ydt, i, __fadd_rn(ld(y, ydt, i), ld(x, xdt, i)));
}

__global__ void bias_fwd_kernel(void *y, loom_dtype ydt, const void *b, loom_dtype bdt, int64_t T,
                                int64_t N) {
    const int64_t n = T * N, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        st(y, ydt, i, __fadd_rn(ld(y, ydt, i), ld(b, bdt, i % N)));
}

// db[j] += sum_t dy[t, j]: a block owns 32 columns; its BR row lanes sum rows
// t = lane, lane + BR, ... in double, then the lanes are added in lane order.
enum { BC = 32, BR = 16 };
__global__ void bias_bwd_kernel(const void *dy, loom_dtype dt, int64_t T, int64_t N, float *db) {
    __shared__ double part[BR][BC];
    const int64_t j = (int64_t)blockIdx.x * BC + threadIdx.x;
    double acc = 0;
    if (j < N)
        for (int64_t t = threadIdx.y; t < T; t += BR) acc += (double)ld(dy, dt, t * N + j);
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < N) {
        double s = 0;
        for (int r = 0; r < BR; r++) s += part[r][threadIdx.x];
        db[j] += (float)s;
    }
}

extern "C" loom_status loom_cuda_swiglu_fwd(loom_ctx *ctx, const void *g, const void *u, int64_t n,
                                            void *h, loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "swiglu_fwd", "g, u, h"))) return st;
    if (n <= 0) return LOOM_OK;
    if (vec8_ok(dtype, n, g, u) && vec8_ok(dtype, n, h, h)) {
        if (dtype == LOOM_BF16)
            swiglu_fwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __nv_bfloat16 *)g, (const __nv_bfloat16 *)u, n / 8, (__nv_bfloat16 *)h);
        else
            swiglu_fwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __half *)g, (const __half *)u, n / 8, (__half *)h);
        return check_launch(ctx, "swiglu_fwd");
    }
    swiglu_fwd_kernel<<<grid_for(n, 256), 256, 0, as_stream(stream)>>>(g, u, n, h, dtype);
    return check_launch(ctx, "swiglu_fwd");
}

extern "C" loom_status loom_cuda_swiglu_bwd(loom_ctx *ctx, const void *dh, const void *g,
                                            const void *u, int64_t n, void *dg, void *du,
                                            loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "swiglu_bwd", "dh, g, u, dg, du"))) return st;
    if (n <= 0) return LOOM_OK;
    if (vec8_ok(dtype, n, dh, g) && vec8_ok(dtype, n, u, dg) && vec8_ok(dtype, n, du, du)) {
        if (dtype == LOOM_BF16)
            swiglu_bwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __nv_bfloat16 *)dh, (const __nv_bfloat16 *)g, (const __nv_bfloat16 *)u, n / 8,
                (__nv_bfloat16 *)dg, (__nv_bfloat16 *)du);
        else
            swiglu_bwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __half *)dh, (const __half *)g, (const __half *)u, n / 8, (__half *)dg,
                (__half *)du);
        return check_launch(ctx, "swiglu_bwd");
    }
    swiglu_bwd_kernel<<<grid_for(n, 256), 256, 0, as_stream(stream)>>>(dh, g, u, n, dg, du, dtype);
    return check_launch(ctx, "swiglu_bwd");
}

// The gated attention's output gate, y = o sigmoid(g), and its backward, one
// element's arithmetic for both the scalar and the 16-bit vector kernels (the
// same bits).
__device__ __forceinline__ float gate1(float o, float g) { return __fmul_rn(o, sigmoid1(g, false)); }
__device__ __forceinline__ void gate1_bwd(float d, float o, float g, float &dout, float &dg) {
    const float s = sigmoid1(g, false);
    dout = __fmul_rn(d, s);
    dg = __fmul_rn(__fmul_rn(__fmul_rn(d, o), s), __fsub_rn(1.0f, s));
}

__global__ void gate_fwd_kernel(const void *o, const void *g, int64_t n, void *y, loom_dtype dt) {
    grid_each(n, [&](int64_t i) { st(y, dt, i, gate1(ld(o, dt, i), ld(g, dt, i))); });
}

__global__ void gate_bwd_kernel(const void *dy, const void *o, const void *g, int64_t n, void *dout,
                                void *dg, loom_dtype dt) {
    grid_each(n, [&](int64_t i) {
        float a, b;
        gate1_bwd(ld(dy, dt, i), ld(o, dt, i), ld(g, dt, i), a, b);
        // every read of element i is done: dout may alias dy, dg may alias g
        st(dout, dt, i, a);
        st(dg, dt, i, b);
    });
}

// The same on BF16/F16, 8 elements per 16-byte access (n8 = n / 8): the
// scalar kernels' loads and stores of 2 bytes took twice the time of the
// bytes they move (Qwen3.5-0.8B, 16384 tokens, on an H200: 123 and 189 us).
template <typename T>
__global__ void gate_fwd_vec_kernel(const T *o, const T *g, int64_t n8, T *y) {
    grid_each(n8, [&](int64_t i) {
        float ov[8], gv[8];
        ld8(o + 8 * i, ov);
        ld8(g + 8 * i, gv);
#pragma unroll
        for (int k = 0; k < 8; k++) ov[k] = gate1(ov[k], gv[k]);
        st8(y + 8 * i, ov);
    });
}

template <typename T>
__global__ void gate_bwd_vec_kernel(const T *dy, const T *o, const T *g, int64_t n8, T *dout, T *dg) {
    grid_each(n8, [&](int64_t i) {
        float dv[8], ov[8], gv[8];
        ld8(dy + 8 * i, dv);
        ld8(o + 8 * i, ov);
        ld8(g + 8 * i, gv);
#pragma unroll
        for (int k = 0; k < 8; k++) gate1_bwd(dv[k], ov[k], gv[k], dv[k], gv[k]);
        st8(dout + 8 * i, dv); // all 8 elements were read: dout may alias dy, dg g
        st8(dg + 8 * i, gv);
    });
}

extern "C" loom_status loom_cuda_gate_fwd(loom_ctx *ctx, const void *o, const void *g, int64_t n,
                                          void *y, loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "gate_fwd", "o, g, y"))) return st;
    if (n <= 0) return LOOM_OK;
    if (vec8_ok(dtype, n, o, g) && vec8_ok(dtype, n, y, y)) {
        if (dtype == LOOM_BF16)
            gate_fwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __nv_bfloat16 *)o, (const __nv_bfloat16 *)g, n / 8, (__nv_bfloat16 *)y);
        else
            gate_fwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __half *)o, (const __half *)g, n / 8, (__half *)y);
        return check_launch(ctx, "gate_fwd");
    }
    gate_fwd_kernel<<<grid_for(n, 256), 256, 0, as_stream(stream)>>>(o, g, n, y, dtype);
    return check_launch(ctx, "gate_fwd");
}

extern "C" loom_status loom_cuda_gate_bwd(loom_ctx *ctx, const void *dy, const void *o,
                                          const void *g, int64_t n, void *dout, void *dg,
                                          loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "gate_bwd", "dy, o, g, do, dg"))) return st;
    if (n <= 0) return LOOM_OK;
    if (vec8_ok(dtype, n, dy, o) && vec8_ok(dtype, n, g, dout) && vec8_ok(dtype, n, dg, dg)) {
        if (dtype == LOOM_BF16)
            gate_bwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __nv_bfloat16 *)dy, (const __nv_bfloat16 *)o, (const __nv_bfloat16 *)g,
                n / 8, (__nv_bfloat16 *)dout, (__nv_bfloat16 *)dg);
        else
            gate_bwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const __half *)dy, (const __half *)o, (const __half *)g, n / 8, (__half *)dout,
                (__half *)dg);
        return check_launch(ctx, "gate_bwd");
    }
    gate_bwd_kernel<<<grid_for(n, 256), 256, 0, as_stream(stream)>>>(dy, o, g, n, dout, dg, dtype);
    return check_launch(ctx, "gate_bwd");
}

extern "C" loom_status loom_cuda_residual_add(loom_ctx *ctx, void *y, loom_dtype y_dtype,
                                              const void *x, loom_dtype x_dtype, int64_t n,
                                              void *stream) {
    loom_status st;
    if ((st = need_float(ctx, y_dtype, "residual_add", "y")) ||
        (st = need_float(ctx, x_dtype, "residual_add", "x")))
        return st;
    if (n <= 0) return LOOM_OK;
    if (x_dtype == y_dtype && vec8_ok(y_dtype, n, y, x)) {
        if (y_dtype == LOOM_BF16)
            residual_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (__nv_bfloat16 *)y, (const __nv_bfloat16 *)x, n / 8);
        else
            residual_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (__half *)y, (const __half *)x, n / 8);
        return check_launch(ctx, "residual_add");
    }
    residual_kernel<<<grid_for(n, 256), 256, 0, as_stream(stream)>>>(y, y_dtype, x, x_dtype, n);
    return check_launch(ctx, "residual_add");
}

extern "C" loom_status loom_cuda_add_bias_fwd(loom_ctx *ctx, void *y, loom_dtype y_dtype,
                                              const void *b, loom_dtype b_dtype, int64_t T,
                                              int64_t N, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, y_dtype, "add_bias_fwd", "y")) ||
        (st = need_float(ctx, b_dtype, "add_bias_fwd", "b")))
        return st;
    if (T <= 0 || N <= 0) return LOOM_OK;
    bias_fwd_kernel<<<grid_for(T * N, 256), 256, 0, as_stream(stream)>>>(y, y_dtype, b, b_dtype, T, N);
    return check_launch(ctx, "add_bias_fwd");
}

extern "C" loom_status loom_cuda_add_bias_bwd(loom_ctx *ctx, const void *dy, loom_dtype dy_dtype,
                                              int64_t T, int64_t N, float *db, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dy_dtype, "add_bias_bwd", "dy"))) return st;
    if (!db || T <= 0 || N <= 0) return LOOM_OK;
    bias_bwd_kernel<<<(unsigned)((N + BC - 1) / BC), dim3(BC, BR), 0, as_stream(stream)>>>(
        dy, dy_dtype, T, N, db);
    return check_launch(ctx, "add_bias_bwd");
}

__global__ void fill_randn_kernel(void *x, loom_dtype dt, int64_t n, uint64_t base) {
    grid_each(n, [&](int64_t i) { st(x, dt, i, loom_rng_gauss4_at(base, (uint64_t)i)); });
}

extern "C" loom_status loom_cuda_fill_randn(loom_ctx *ctx, void *x, loom_dtype dtype, int64_t n,
                                            uint64_t base, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "fill_randn", "x"))) return st;
    if (n <= 0) return LOOM_OK;
    fill_randn_kernel<<<grid_for(n, 256), 256, 0, as_stream(stream)>>>(x, dtype, n, base);
    return check_launch(ctx, "fill_randn");
}
