// Shared helpers of the CUDA ops (ops_*.cu): error reporting, dtype loads and
// stores, launch sizes, warp reductions. Internal to the CUDA backend.
#ifndef LOOM_CUDA_OPS_COMMON_CUH
#define LOOM_CUDA_OPS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_ops.h"

extern "C" loom_status loom_errf(loom_ctx *ctx, loom_status st, const char *fmt, ...);

namespace loom_cuda {

// "cuda <op>: <CUDA's message>" for a failed CUDA call or launch.
static inline loom_status check(loom_ctx *ctx, cudaError_t e, const char *op) {
    if (e == cudaSuccess) return LOOM_OK;
    return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda %s: %s", op, cudaGetErrorString(e));
}
static inline loom_status check_launch(loom_ctx *ctx, const char *op) {
    return check(ctx, cudaGetLastError(), op);
}

static inline bool float_dtype(loom_dtype t) {
    return t == LOOM_F32 || t == LOOM_BF16 || t == LOOM_F16;
}
// Refuses a dtype other than F32/BF16/F16 for tensor `what` of op `op`.
static inline loom_status need_float(loom_ctx *ctx, loom_dtype t, const char *op, const char *what) {
    if (float_dtype(t)) return LOOM_OK;
    return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda %s: %s must be F32, BF16 or F16 (got %s)", op,
                     what, loom_dtype_name(t));
}

static inline cudaStream_t as_stream(void *s) { return (cudaStream_t)s; }

// Blocks for a grid-stride loop over n items with `threads` per block.
static inline unsigned grid_for(int64_t n, int threads, int64_t cap = 65535LL * 16) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    if (b > cap) b = cap;
    return (unsigned)b;
}

// f(i) for every i < n, over the grid (a grid-stride loop).
template <typename F> __device__ __forceinline__ void grid_each(int64_t n, F f) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}
// Element i of a tensor of dtype dt as fp32 / stored from fp32 (round to
// nearest even). dt is uniform across a launch, so the switch does not diverge.
__device__ __forceinline__ float ld(const void *p, loom_dtype dt, int64_t i) {
    switch (dt) {
    case LOOM_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case LOOM_F16: return __half2float(((const __half *)p)[i]);
    default: return ((const float *)p)[i];
    }
}
__device__ __forceinline__ void st(void *p, loom_dtype dt, int64_t i, float v) {
    switch (dt) {
    case LOOM_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    case LOOM_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

// 8 BF16/F16 elements per 16-byte access (the vector paths of the
// memory-bound ops): widened to fp32 / rounded from fp32 (nearest even).
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
// (the same names for fp32, for kernels templated over all three)
__device__ __forceinline__ float to_f(float v) { return v; }
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }

// Runs __VA_ARGS__ with T the C++ type of the float dtype dt (BF16, F16, else
// F32): the kernel templates instantiated for a compute dtype.
#define LOOM_CUDA_TYPED(dt, ...)                                                                   \
    do {                                                                                           \
        if ((dt) == LOOM_BF16) {                                                                   \
            typedef __nv_bfloat16 T;                                                               \
            __VA_ARGS__;                                                                           \
        } else if ((dt) == LOOM_F16) {                                                             \
            typedef __half T;                                                                      \
            __VA_ARGS__;                                                                           \
        } else {                                                                                   \
            typedef float T;                                                                       \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

// V consecutive elements at p as floats / stored from floats: one 16-byte
// access when V > 1 (V = 16 / sizeof(T), p 16-byte aligned), else one element.
template <typename T, int V> __device__ __forceinline__ void ld_vec(const T *p, float (&f)[V]) {
    if constexpr (V == 1) {
        f[0] = to_f(p[0]);
    } else {
        static_assert(V * sizeof(T) == 16, "one 16-byte access");
        const uint4 u = *(const uint4 *)p;
        const T *e = (const T *)&u;
#pragma unroll
        for (int i = 0; i < V; i++)
            f[i] = to_f(e[i]);
    }
}
template <typename T, int V> __device__ __forceinline__ void st_vec(T *p, const float (&f)[V]) {
    if constexpr (V == 1) {
        p[0] = from_f<T>(f[0]);
    } else {
        uint4 u;
        T *e = (T *)&u;
#pragma unroll
        for (int i = 0; i < V; i++)
            e[i] = from_f<T>(f[i]);
        *(uint4 *)p = u;
    }
}

// The 16 bytes at p (16-byte aligned), or zeros where !in
template <typename T> __device__ __forceinline__ uint4 ld16_or0(const T *p, bool in) {
    return in ? *(const uint4 *)p : make_uint4(0, 0, 0, 0);
}

// 8 16-bit values of one 16-byte access, as floats
template <typename T>
__device__ __forceinline__ void cvt8(const uint4 &u, float (&v)[8]) {
    const T *e = (const T *)&u;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = to_f(e[i]);
}
template <typename T>
__device__ __forceinline__ void ld8(const T *p, float (&v)[8]) {
    cvt8<T>(*(const uint4 *)p, v);
}
// 8 floats rounded to T, as one 16-byte access
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
    uint4 u;
    T *e = (T *)&u;
#pragma unroll
    for (int i = 0; i < 8; i++) e[i] = from_f<T>(v[i]);
    return u;
}
template <typename T>
__device__ __forceinline__ void st8(T *p, const float (&v)[8]) {
    *(uint4 *)p = pack8<T>(v);
}

// f(T{}) with T the 16-bit type of dt (BF16, else F16: the vector paths'
// dtypes), for their kernels' launches.
template <typename F> static inline void on_16bit(loom_dtype dt, F f) {
    if (dt == LOOM_BF16)
        f(__nv_bfloat16{});
    else
        f(__half{});
}

// Bytes of an element of a float dtype (F32, BF16, F16).
__host__ __device__ __forceinline__ size_t float_size(loom_dtype dt) { return dt == LOOM_F32 ? 4 : 2; }
// v rounded to T and widened back: what a store to T and a load give.
template <typename T> __device__ __forceinline__ float round_to(float v) { return to_f(from_f<T>(v)); }
// Whether p is 16-byte aligned (vector loads, cp.async, TMA).
__host__ __device__ __forceinline__ bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }
// A BF16/F16 tensor of n elements that the vector paths take: n a multiple of
// 8 and every pointer 16-byte aligned.
static inline bool vec8_ok(loom_dtype t, int64_t n, const void *a, const void *b) {
    return (t == LOOM_BF16 || t == LOOM_F16) && n % 8 == 0 && aligned16(a) && aligned16(b);
}

// SwiGLU of one element, h = silu(g) u, and its gradients (d silu(g)/dg =
// sig (1 + g (1 - sig))), each operation rounded on its own (the same bits
// in every kernel that uses them). hw: the sigmoid on the hardware's exp2 and
// reciprocal (__expf, __fdividef: a few fp32 ulp, far below a BF16/F16
// rounding) instead of IEEE expf and division, whose instruction sequences
// show in a memory-bound pass's power: at 8B's shape the IEEE forward draws
// ~90 W more at the same bandwidth. Every BF16/F16 path takes hw, F32 keeps
// IEEE.
__device__ __forceinline__ float sigmoid1(float g, bool hw) {
    return hw ? __fdividef(1.0f, __fadd_rn(1.0f, __expf(-g))) : __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)));
}
__device__ __forceinline__ float swiglu1(float g, float u, bool hw) {
    return __fmul_rn(__fmul_rn(g, sigmoid1(g, hw)), u);
}
__device__ __forceinline__ void swiglu1_bwd(float d, float g, float u, float &dg, float &du, bool hw) {
    const float sg = sigmoid1(g, hw);
    const float dsil = __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg)));
    dg = __fmul_rn(__fmul_rn(__fmul_rn(d, u), sg), dsil);
    du = __fmul_rn(__fmul_rn(d, g), sg);
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// The sum over each aligned group of W lanes (W a power of two up to 32;
// every lane of the warp calls it), by shuffles W/2 lanes apart down to 1
template <int W, typename T> __device__ __forceinline__ T lanes_sum(T v) {
    for (int o = W / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_sum(float v) { return lanes_sum<32>(v); }
__device__ __forceinline__ double warp_sum(double v) { return lanes_sum<32>(v); }
// over the 16 lanes of each half of the warp
template <typename T> __device__ __forceinline__ T half_sum(T v) { return lanes_sum<16>(v); }

// Fixed-order tree sum of one double per thread over a block of NT threads
// (NT a power of two, >= 32); sh: NT/32 doubles of shared memory. The
// result is returned to every thread.
template <int NT>
__device__ __forceinline__ double block_sum(double v, double *sh) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); // sh may still be read from a previous call
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    double r = 0;
    if (warp == 0) {
        r = lane < NT / 32 ? sh[lane] : 0.0;
        r = warp_sum(r);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    return sh[0];
}

template <int NT>
__device__ __forceinline__ float block_max(float v, float *sh) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float r = lane < NT / 32 ? sh[lane] : -INFINITY;
        r = warp_max(r);
        if (lane == 0) sh[0] = r;
    }
    __syncthreads();
    return sh[0];
}

} // namespace loom_cuda

#endif
