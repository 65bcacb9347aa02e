// The shared expert's gate of a mixture-of-experts block (Qwen2-MoE), with
// cpu_moe.h's semantics: g = sigmoid(z) per token (fp32), the shared
// expert's output scaled by g into the block's (y = g s, + y when
// accumulating), and the gate's gradient dz = (1 - g) dot(da, a) from the
// down projection's input a and its gradient da.
//
// One warp per row (a token's H or I features), rows looped past the grid;
// 16-bit rows of a multiple of 8 features (F32: of 4) with 16-byte aligned
// tensors go by 16-byte accesses. Products and sums are rounded one by one
// (no fused multiply-adds) in the forward, the CPU's operations; the dot
// sums each lane's terms in order, then a warp tree: the same bits run to run.
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {

enum { WARPS = 8, NT = WARPS * 32 };

// g[n] = sigmoid(z[n]) (z null: g read), and with s: y row n = g[n] s row n
// (+ y row n when acc).
template <typename T, int V>
__global__ void __launch_bounds__(NT)
    gate_fwd_kernel(const T *__restrict__ z, const T *__restrict__ s, int64_t N, int64_t H,
                    bool acc, float *__restrict__ g, T *__restrict__ y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t n = (int64_t)blockIdx.x * WARPS + warp; n < N; n += (int64_t)gridDim.x * WARPS) {
        float w;
        if (z) {
            w = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-to_f(z[n]))));
            if (lane == 0)
                g[n] = w;
        } else {
            w = g[n];
        }
        if (!s)
            continue;
        for (int64_t h = (int64_t)lane * V; h < H; h += 32 * V) {
            float sv[V], yv[V];
            ld_vec<T, V>(s + n * H + h, sv);
            if (acc)
                ld_vec<T, V>(y + n * H + h, yv);
#pragma unroll
            for (int i = 0; i < V; i++)
                yv[i] = acc ? __fadd_rn(yv[i], __fmul_rn(w, sv[i])) : __fmul_rn(w, sv[i]);
            st_vec<T, V>(y + n * H + h, yv);
        }
    }
}

// dz[n] = (1 - g[n]) dot(da row n, a row n), the dot in fp32.
template <typename T, int V>
__global__ void __launch_bounds__(NT)
    gate_bwd_kernel(const T *__restrict__ da, const T *__restrict__ a, const float *__restrict__ g,
                    int64_t N, int64_t I, T *__restrict__ dz) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t n = (int64_t)blockIdx.x * WARPS + warp; n < N; n += (int64_t)gridDim.x * WARPS) {
        float dot = 0.0f;
        for (int64_t i = (int64_t)lane * V; i < I; i += 32 * V) {
            float dv[V], av[V];
            ld_vec<T, V>(da + n * I + i, dv);
            ld_vec<T, V>(a + n * I + i, av);
#pragma unroll
            for (int j = 0; j < V; j++)
                dot = __fmaf_rn(dv[j], av[j], dot);
        }
        dot = warp_sum(dot);
        if (lane == 0)
            dz[n] = from_f<T>(__fmul_rn(__fsub_rn(1.0f, g[n]), dot));
    }
}

// Rows of W elements of T at every pointer go by 16-byte accesses: W a
// multiple of 16 / sizeof(T), every pointer (null: none) 16-byte aligned.
template <typename T> bool vec_rows(int64_t W, const void *a, const void *b) {
    return W % (int64_t)(16 / sizeof(T)) == 0 && ((uintptr_t)a & 15) == 0 &&
           ((uintptr_t)b & 15) == 0;
}

template <typename T>
void launch_fwd(const void *z, const void *s, int64_t N, int64_t H, bool acc, float *g, void *y,
                cudaStream_t st) {
    constexpr int V = 16 / sizeof(T);
    const unsigned blocks = grid_for(N, WARPS);
    if (s && vec_rows<T>(H, s, y))
        gate_fwd_kernel<T, V>
            <<<blocks, NT, 0, st>>>((const T *)z, (const T *)s, N, H, acc, g, (T *)y);
    else
        gate_fwd_kernel<T, 1>
            <<<blocks, NT, 0, st>>>((const T *)z, (const T *)s, N, H, acc, g, (T *)y);
}

template <typename T>
void launch_bwd(const void *da, const void *a, const float *g, int64_t N, int64_t I, void *dz,
                cudaStream_t st) {
    constexpr int V = 16 / sizeof(T);
    const unsigned blocks = grid_for(N, WARPS);
    if (vec_rows<T>(I, da, a))
        gate_bwd_kernel<T, V><<<blocks, NT, 0, st>>>((const T *)da, (const T *)a, g, N, I, (T *)dz);
    else
        gate_bwd_kernel<T, 1><<<blocks, NT, 0, st>>>((const T *)da, (const T *)a, g, N, I, (T *)dz);
}

loom_status bad(loom_ctx *ctx, const char *op, const char *what, long long v) {
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda %s: bad %s %lld", op, what, v);
}

} // namespace

extern "C" loom_status loom_cuda_moe_gate_fwd(loom_ctx *ctx, const void *z, const void *s,
                                              int64_t N, int64_t H, bool acc, float *g, void *y,
                                              loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_gate_fwd", "z, s, y")))
        return st;
    if (N < 0)
        return bad(ctx, "moe_gate_fwd", "token count", N);
    if (H < 0)
        return bad(ctx, "moe_gate_fwd", "row width", H);
    if (N == 0 || (!z && !s))
        return LOOM_OK;
    LOOM_CUDA_TYPED(dtype, launch_fwd<T>(z, s, N, H, acc, g, y, as_stream(stream)));
    return check_launch(ctx, "moe_gate_fwd");
}

extern "C" loom_status loom_cuda_moe_gate_bwd(loom_ctx *ctx, const void *da, const void *a,
                                              const float *g, int64_t N, int64_t I, void *dz,
                                              loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_gate_bwd", "da, a, dz")))
        return st;
    if (N < 0)
        return bad(ctx, "moe_gate_bwd", "token count", N);
    if (I < 0)
        return bad(ctx, "moe_gate_bwd", "row width", I);
    if (N == 0)
        return LOOM_OK;
    LOOM_CUDA_TYPED(dtype, launch_bwd<T>(da, a, g, N, I, dz, as_stream(stream)));
    return check_launch(ctx, "moe_gate_bwd");
}
