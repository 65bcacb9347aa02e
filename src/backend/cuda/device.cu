// Device queries and memory helpers of the CUDA backend.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#include <nccl.h>
#include <stdio.h>
#include <string.h>

#include "cuda_backend.h"

extern "C" loom_status loom_errf(loom_ctx *ctx, loom_status st, const char *fmt, ...);

extern "C" loom_status loom_cuda_query(loom_ctx *ctx, int device, loom_cuda_info *info) {
    memset(info, 0, sizeof *info);
    cudaRuntimeGetVersion(&info->runtime_version);
    cudaDriverGetVersion(&info->driver_version);
    info->cublaslt_version = cublasLtGetVersion();
    info->cudnn_version = cudnnGetVersion();
    ncclGetVersion(&info->nccl_version);
    cudaError_t e = cudaGetDeviceCount(&info->device_count);
    if (e != cudaSuccess || info->device_count == 0) {
        info->device_count = 0;
        return loom_errf(ctx, LOOM_ERR_DEVICE, "no CUDA device is visible (%s)",
                         e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
    }
    if (device < 0 || device >= info->device_count)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "CUDA device %d does not exist (%d visible)",
                         device, info->device_count);
    cudaDeviceProp p;
    e = cudaGetDeviceProperties(&p, device);
    if (e != cudaSuccess)
        return loom_errf(ctx, LOOM_ERR_DEVICE, "cudaGetDeviceProperties(%d): %s", device,
                         cudaGetErrorString(e));
    snprintf(info->name, sizeof info->name, "%s", p.name);
    info->cc_major = p.major;
    info->cc_minor = p.minor;
    info->total_mem = p.totalGlobalMem;
    info->sm_count = p.multiProcessorCount;
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_malloc(loom_ctx *ctx, void **ptr, size_t bytes, const char *what) {
    cudaError_t e = cudaMalloc(ptr, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *ptr = NULL;
        return loom_errf(ctx, e == cudaErrorMemoryAllocation ? LOOM_ERR_OOM : LOOM_ERR_DEVICE,
                         "cudaMalloc of %zu bytes for %s: %s", bytes, what, cudaGetErrorString(e));
    }
    return LOOM_OK;
}

extern "C" void loom_cuda_free(void *ptr) {
    if (ptr) cudaFree(ptr);
}

extern "C" loom_status loom_cuda_host_alloc(loom_ctx *ctx, void **ptr, size_t bytes,
                                            const char *what) {
    cudaError_t e = cudaMallocHost(ptr, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        *ptr = NULL;
        (void)cudaGetLastError(); /* not sticky: clear it */
        return loom_errf(ctx, LOOM_ERR_OOM, "cudaMallocHost of %zu bytes for %s: %s", bytes, what,
                         cudaGetErrorString(e));
    }
    return LOOM_OK;
}

extern "C" void loom_cuda_host_free(void *ptr) {
    if (ptr) cudaFreeHost(ptr);
}

extern "C" loom_status loom_cuda_memcpy_h2d(loom_ctx *ctx, void *dst, const void *src, size_t bytes) {
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
    return e == cudaSuccess ? LOOM_OK
                            : loom_errf(ctx, LOOM_ERR_DEVICE, "copy to device: %s", cudaGetErrorString(e));
}

extern "C" loom_status loom_cuda_memcpy_d2h(loom_ctx *ctx, void *dst, const void *src, size_t bytes) {
    cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
    return e == cudaSuccess ? LOOM_OK
                            : loom_errf(ctx, LOOM_ERR_DEVICE, "copy to host: %s", cudaGetErrorString(e));
}

extern "C" loom_status loom_cuda_sync(loom_ctx *ctx) {
    cudaError_t e = cudaDeviceSynchronize();
    return e == cudaSuccess ? LOOM_OK
                            : loom_errf(ctx, LOOM_ERR_DEVICE, "CUDA error: %s", cudaGetErrorString(e));
}

extern "C" loom_status loom_cuda_set_device(loom_ctx *ctx, int device) {
    cudaError_t e = cudaSetDevice(device);
    return e == cudaSuccess ? LOOM_OK
                            : loom_errf(ctx, LOOM_ERR_DEVICE, "cudaSetDevice(%d): %s", device,
                                        cudaGetErrorString(e));
}

extern "C" loom_status loom_cuda_mem_info(loom_ctx *ctx, size_t *free_bytes, size_t *total_bytes) {
    cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes);
    return e == cudaSuccess ? LOOM_OK
                            : loom_errf(ctx, LOOM_ERR_DEVICE, "cudaMemGetInfo: %s",
                                        cudaGetErrorString(e));
}
