// Optimizer ops over flat fp32 buffers: AdamW (bit-identical to
// loom_adamw_step_scaled) and the deterministic sum of squares.
#include <math.h>

#include "ops_common.cuh"

using namespace loom_cuda;

namespace {
struct adamw_coef {
    float shrink, w1, one_minus_w1, b2, c2, neg_step, bc2_sqrt, eps;
    float gs0, gs1; // the gradient is multiplied by these first (loom_adamw_step_scaled)
    int do_decay, lerp_low;
};
constexpr int SUMSQ_THREADS = 256;
} // namespace

// The CPU loop body, each fp32 operation rounded on its own (no contraction).
__device__ __forceinline__ void adamw_val(float &p, float g, float &m, float &v, const adamw_coef &k,
                                          int do_decay) {
    float pi = p, gi = __fmul_rn(__fmul_rn(g, k.gs0), k.gs1), mi = m, vi = v;
    if (do_decay) pi = __fmul_rn(pi, k.shrink);
    mi = k.lerp_low ? __fadd_rn(mi, __fmul_rn(k.w1, __fsub_rn(gi, mi)))
                    : __fsub_rn(gi, __fmul_rn(__fsub_rn(gi, mi), k.one_minus_w1));
    vi = __fmul_rn(vi, k.b2);
    vi = __fadd_rn(vi, __fmul_rn(__fmul_rn(k.c2, gi), gi));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
    p = __fadd_rn(pi, __fdiv_rn(__fmul_rn(k.neg_step, mi), denom));
    m = mi;
    v = vi;
}
__device__ __forceinline__ void adamw_elem(float *p, const float *g, float *m, float *v,
                                           const adamw_coef &k, int do_decay) {
    adamw_val(*p, *g, *m, *v, k, do_decay);
}

__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, adamw_coef k) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        adamw_elem(p + i, g + i, m + i, v + i, k, k.do_decay);
}

// One block per chunk of a part list: the same element operations as
// adamw_kernel, so the results are bit-identical to the CPU's per part.
// With wc, the new parameter also goes to the compute copy. Chunks whose
// offsets are multiples of 4 (all but odd-sized parts' neighbours) go four
// elements to a thread in 16-byte accesses; the rest, and the ends, one.
__global__ void adamw_chunks_kernel(float *__restrict__ p, const float *__restrict__ g,
                                    float *__restrict__ m, float *__restrict__ v,
                                    const loom_cuda_chunk *c, adamw_coef k, void *wc,
                                    loom_dtype wdt) {
    const loom_cuda_chunk ch = c[blockIdx.x];
    const int do_decay = k.do_decay && ch.decay;
    float *pp = p + ch.p_off, *mm = m + ch.s_off, *vv = v + ch.s_off;
    const float *gg = g + ch.s_off;
    int64_t i0 = 0;
    if ((((uintptr_t)pp | (uintptr_t)gg | (uintptr_t)mm | (uintptr_t)vv) & 15) == 0 &&
        (!wc || ((ch.p_off & 3) == 0 && ((uintptr_t)wc & 15) == 0))) {
        const int64_t n4 = ch.len / 4;
        for (int64_t q = threadIdx.x; q < n4; q += blockDim.x) {
            float4 P = ((float4 *)pp)[q], M = ((float4 *)mm)[q], V = ((float4 *)vv)[q];
            const float4 G = ((const float4 *)gg)[q];
            adamw_val(P.x, G.x, M.x, V.x, k, do_decay);
            adamw_val(P.y, G.y, M.y, V.y, k, do_decay);
            adamw_val(P.z, G.z, M.z, V.z, k, do_decay);
            adamw_val(P.w, G.w, M.w, V.w, k, do_decay);
            ((float4 *)pp)[q] = P, ((float4 *)mm)[q] = M, ((float4 *)vv)[q] = V;
            if (wc) {
                const int64_t o = ch.p_off + 4 * q;
                if (wdt == LOOM_F32) {
                    ((float4 *)wc)[o / 4] = P;
                } else if (wdt == LOOM_BF16) {
                    __nv_bfloat162 *d = (__nv_bfloat162 *)((__nv_bfloat16 *)wc + o);
                    d[0] = __floats2bfloat162_rn(P.x, P.y), d[1] = __floats2bfloat162_rn(P.z, P.w);
                } else {
                    __half2 *d = (__half2 *)((__half *)wc + o);
                    d[0] = __floats2half2_rn(P.x, P.y), d[1] = __floats2half2_rn(P.z, P.w);
                }
            }
        }
        i0 = n4 * 4;
    }
    for (int64_t i = i0 + threadIdx.x; i < ch.len; i += blockDim.x) {
        adamw_elem(pp + i, gg + i, mm + i, vv + i, k, do_decay);
        if (wc) st(wc, wdt, ch.p_off + i, pp[i]);
    }
}

__global__ void zero_chunks_kernel(float *g, const loom_cuda_chunk *c) {
    const loom_cuda_chunk ch = c[blockIdx.x];
    for (int i = threadIdx.x; i < ch.len; i += blockDim.x) g[ch.s_off + i] = 0.0f;
}

// One block per chunk: out[chunk] = sum of (g s)^2 over it (double, fixed order).
__global__ void __launch_bounds__(SUMSQ_THREADS)
    sumsq_chunks_kernel(const float *g, const loom_cuda_chunk *c, float s, double *out) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    const loom_cuda_chunk ch = c[blockIdx.x];
    double acc = 0;
    for (int i = threadIdx.x; i < ch.len; i += SUMSQ_THREADS) {
        double x = (double)__fmul_rn(g[ch.s_off + i], s);
        acc += x * x;
    }
    acc = block_sum<SUMSQ_THREADS>(acc, sh);
    if (threadIdx.x == 0) out[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(SUMSQ_THREADS)
    sumsq_partial_kernel(const float *g, int64_t n, double *partial) {
    __shared__ double sh[SUMSQ_THREADS / 32];
    const int64_t stride = (int64_t)LOOM_CUDA_SUMSQ_BLOCKS * SUMSQ_THREADS;
    double acc = 0;
    for (int64_t i = (int64_t)blockIdx.x * SUMSQ_THREADS + threadIdx.x; i < n; i += stride) {
        double x = (double)g[i];
        acc += x * x;
    }
    acc = block_sum<SUMSQ_THREADS>(acc, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(LOOM_CUDA_SUMSQ_BLOCKS)
    sumsq_final_kernel(const double *partial, double *result) {
    __shared__ double sh[LOOM_CUDA_SUMSQ_BLOCKS / 32];
    double acc = block_sum<LOOM_CUDA_SUMSQ_BLOCKS>(partial[threadIdx.x], sh);
    if (threadIdx.x == 0) *result = acc;
}

// The scalars exactly as loom_adamw_step computes them (double, rounded once).
static adamw_coef coef_of(const loom_adamw_hp *hp, int64_t t, bool decay) {
    adamw_coef k;
    k.do_decay = decay && hp->weight_decay != 0.0;
    k.shrink = (float)(1.0 - hp->lr * hp->weight_decay);
    const double w1d = 1.0 - hp->beta1;
    k.w1 = (float)w1d;
    k.one_minus_w1 = (float)(1.0 - (double)k.w1);
    k.lerp_low = k.w1 < 0.5f;
    k.b2 = (float)hp->beta2;
    k.c2 = (float)(1.0 - hp->beta2);
    const double bc1 = 1.0 - pow(hp->beta1, (double)t);
    const double bc2 = 1.0 - pow(hp->beta2, (double)t);
    k.neg_step = (float)(-(hp->lr / bc1));
    k.bc2_sqrt = (float)pow(bc2, 0.5);
    k.eps = (float)hp->eps;
    k.gs0 = k.gs1 = 1.0f;
    return k;
}

extern "C" loom_status loom_cuda_adamw_step(loom_ctx *ctx, float *p, const float *g, float *m,
                                            float *v, size_t n, const loom_adamw_hp *hp, int64_t t,
                                            bool decay, void *stream) {
    if (t < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda adamw_step: step %lld (must be >= 1)",
                         (long long)t);
    if (n == 0) return LOOM_OK;
    adamw_coef k = coef_of(hp, t, decay);
    adamw_kernel<<<grid_for((int64_t)n, 256), 256, 0, as_stream(stream)>>>(p, g, m, v, (int64_t)n, k);
    return check_launch(ctx, "adamw_step");
}

extern "C" loom_status loom_cuda_adamw_chunks(loom_ctx *ctx, float *p, const float *g, float *m,
                                              float *v, const loom_cuda_chunk *chunks,
                                              int64_t nchunks, const loom_adamw_hp *hp, int64_t t,
                                              const float gs[2], void *wc, loom_dtype wc_dtype,
                                              void *stream) {
    loom_status st;
    if (wc && (st = need_float(ctx, wc_dtype, "adamw_chunks", "wc"))) return st;
    if (t < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda adamw_chunks: step %lld (must be >= 1)",
                         (long long)t);
    if (nchunks <= 0) return LOOM_OK;
    if (nchunks > 0x7fffffff)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda adamw_chunks: %lld chunks",
                         (long long)nchunks);
    adamw_coef k = coef_of(hp, t, true);
    k.gs0 = gs[0], k.gs1 = gs[1];
    adamw_chunks_kernel<<<(unsigned)nchunks, 256, 0, as_stream(stream)>>>(p, g, m, v, chunks, k, wc,
                                                                          wc_dtype);
    return check_launch(ctx, "adamw_chunks");
}

extern "C" loom_status loom_cuda_sumsq_chunks(loom_ctx *ctx, const float *g,
                                              const loom_cuda_chunk *chunks, int64_t nchunks,
                                              float s, double *out, void *stream) {
    if (nchunks <= 0) return LOOM_OK;
    if (nchunks > 0x7fffffff)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda sumsq_chunks: %lld chunks",
                         (long long)nchunks);
    sumsq_chunks_kernel<<<(unsigned)nchunks, SUMSQ_THREADS, 0, as_stream(stream)>>>(g, chunks, s,
                                                                                      out);
    return check_launch(ctx, "sumsq_chunks");
}

extern "C" loom_status loom_cuda_sumsq(loom_ctx *ctx, const float *g, size_t n, double *result,
                                       double *scratch, void *stream) {
    if (!result || !scratch)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda sumsq: needs a result and a scratch of LOOM_CUDA_SUMSQ_BLOCKS doubles");
    cudaStream_t s = as_stream(stream);
    sumsq_partial_kernel<<<LOOM_CUDA_SUMSQ_BLOCKS, SUMSQ_THREADS, 0, s>>>(g, (int64_t)n, scratch);
    loom_status st = check_launch(ctx, "sumsq");
    if (st) return st;
    sumsq_final_kernel<<<1, LOOM_CUDA_SUMSQ_BLOCKS, 0, s>>>(scratch, result);
    return check_launch(ctx, "sumsq");
}

extern "C" loom_status loom_cuda_zero_chunks(loom_ctx *ctx, float *g, const loom_cuda_chunk *chunks,
                                             int64_t nchunks, void *stream) {
    if (nchunks <= 0) return LOOM_OK;
    if (nchunks > 0x7fffffff)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda zero_chunks: %lld chunks",
                         (long long)nchunks);
    zero_chunks_kernel<<<(unsigned)nchunks, 256, 0, as_stream(stream)>>>(g, chunks);
    return check_launch(ctx, "zero_chunks");
}
