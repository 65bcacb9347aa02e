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

// Element maps on BF16/F16, 8 elements per 16-byte access (n8 = n / 8),
// the vector kernels' bodies: y = f(a, b); and (o1, o2) = f(d, a, b), every
// element of the 8 read before any is written (the outputs may alias the inputs).
template <typename T, typename F>
__device__ __forceinline__ void map8(const T *a, const T *b, int64_t n8, T *y, F f) {
    grid_each(n8, [&](int64_t i) {
        float av[8], bv[8];
        ld8(a + 8 * i, av);
        ld8(b + 8 * i, bv);
#pragma unroll
        for (int k = 0; k < 8; k++) av[k] = f(av[k], bv[k]);
        st8(y + 8 * i, av);
    });
}
template <typename T, typename F>
__device__ __forceinline__ void map8_2(const T *d, const T *a, const T *b, int64_t n8, T *o1,
                                       T *o2, F f) {
    grid_each(n8, [&](int64_t i) {
        float av[8], bv[8], dv[8];
        ld8(a + 8 * i, av);
        ld8(b + 8 * i, bv);
        ld8(d + 8 * i, dv);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float x, y;
            f(dv[k], av[k], bv[k], x, y);
            av[k] = x;
            bv[k] = y;
        }
        st8(o1 + 8 * i, av);
        st8(o2 + 8 * i, bv);
    });
}

// The same three ops on BF16/F16 (SwiGLU's and the residual's by their own
// names: bench/kprof_table.py files the kernels by them).
template <typename T>
__global__ void swiglu_fwd_vec_kernel(const T *g, const T *u, int64_t n8, T *h) {
    map8(g, u, n8, h, [](float gi, float ui) { return swiglu1(gi, ui, true); });
}

template <typename T>
__global__ void swiglu_bwd_vec_kernel(const T *dh, const T *g, const T *u, int64_t n8, T *dg, T *du) {
    map8_2(dh, g, u, n8, dg, du, [](float d, float gi, float ui, float &dgi, float &dui) {
        swiglu1_bwd(d, gi, ui, dgi, dui, true);
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
        on_16bit(dtype, [&](auto t) {
            using T = decltype(t);
            swiglu_fwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const T *)g, (const T *)u, n / 8, (T *)h);
        });
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
        on_16bit(dtype, [&](auto t) {
            using T = decltype(t);
            swiglu_bwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const T *)dh, (const T *)g, (const T *)u, n / 8, (T *)dg, (T *)du);
        });
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

// The same on BF16/F16 (map8): the scalar kernels' loads and stores of 2
// bytes took twice the time of the bytes they move (Qwen3.5-0.8B, 16384
// tokens, on an H200: 123 and 189 us).
template <typename T>
__global__ void gate_fwd_vec_kernel(const T *o, const T *g, int64_t n8, T *y) {
    map8(o, g, n8, y, [](float oi, float gi) { return gate1(oi, gi); });
}

template <typename T>
__global__ void gate_bwd_vec_kernel(const T *dy, const T *o, const T *g, int64_t n8, T *dout, T *dg) {
    map8_2(dy, o, g, n8, dout, dg, [](float d, float oi, float gi, float &a, float &b) {
        gate1_bwd(d, oi, gi, a, b);
    });
}

extern "C" loom_status loom_cuda_gate_fwd(loom_ctx *ctx, const void *o, const void *g, int64_t n,
                                          void *y, loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "gate_fwd", "o, g, y"))) return st;
    if (n <= 0) return LOOM_OK;
    if (vec8_ok(dtype, n, o, g) && vec8_ok(dtype, n, y, y)) {
        on_16bit(dtype, [&](auto t) {
            using T = decltype(t);
            gate_fwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const T *)o, (const T *)g, n / 8, (T *)y);
        });
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
        on_16bit(dtype, [&](auto t) {
            using T = decltype(t);
            gate_bwd_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (const T *)dy, (const T *)o, (const T *)g, n / 8, (T *)dout, (T *)dg);
        });
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
        on_16bit(y_dtype, [&](auto t) {
            using T = decltype(t);
            residual_vec_kernel<<<grid_for(n / 8, 256), 256, 0, as_stream(stream)>>>(
                (T *)y, (const T *)x, n / 8);
        });
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
