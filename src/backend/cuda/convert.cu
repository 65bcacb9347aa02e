// dtype conversion kernels (F32 <-> BF16 <-> F16), round to nearest even.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda_backend.h"

extern "C" loom_status loom_errf(loom_ctx *ctx, loom_status st, const char *fmt, ...);

__device__ __forceinline__ float load_as_f32(const void *p, loom_dtype dt, size_t i) {
    switch (dt) {
    case LOOM_BF16: return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    case LOOM_F16: return __half2float(((const __half *)p)[i]);
    default: return ((const float *)p)[i];
    }
}

__device__ __forceinline__ void store_f32(void *p, loom_dtype dt, size_t i, float v) {
    switch (dt) {
    case LOOM_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v); break;
    case LOOM_F16: ((__half *)p)[i] = __float2half_rn(v); break;
    default: ((float *)p)[i] = v; break;
    }
}

__global__ void convert_kernel(void *dst, loom_dtype d, const void *src, loom_dtype s, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        store_f32(dst, d, i, load_as_f32(src, s, i));
}

static bool supported(loom_dtype t) { return t == LOOM_F32 || t == LOOM_BF16 || t == LOOM_F16; }

extern "C" loom_status loom_cuda_convert(loom_ctx *ctx, void *dst, loom_dtype d, const void *src,
                                         loom_dtype s, size_t n, void *stream) {
    if (!supported(d) || !supported(s))
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "loom_cuda_convert: only F32, BF16 and F16 (got %d -> %d)", (int)s, (int)d);
    if (n == 0) return LOOM_OK;
    int threads = 256;
    size_t want = (n + threads - 1) / threads;
    int blocks = want > 65535 * 8 ? 65535 * 8 : (int)want;
    convert_kernel<<<blocks, threads, 0, (cudaStream_t)stream>>>(dst, d, src, s, n);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? LOOM_OK
                            : loom_errf(ctx, LOOM_ERR_DEVICE, "convert kernel: %s", cudaGetErrorString(e));
}
