/* CUDA backend: device queries and element-wise kernels. C interface; the
 * implementations are in *.cu files built with `make CUDA=1`. */
#ifndef LOOM_CUDA_BACKEND_H
#define LOOM_CUDA_BACKEND_H

#include <stddef.h>

#include "loom.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct loom_cuda_info {
    int device_count;
    char name[256];          /* of the queried device */
    int cc_major, cc_minor;  /* compute capability */
    size_t total_mem;        /* bytes */
    int sm_count;
    int runtime_version;     /* e.g. 13000 */
    int driver_version;
    size_t cublaslt_version;
    size_t cudnn_version;
    int nccl_version;
} loom_cuda_info;

/* Fills info for `device`; with no GPU visible returns LOOM_ERR_DEVICE and a
 * message saying so (info->device_count is then 0, library versions set). */
loom_status loom_cuda_query(loom_ctx *ctx, int device, loom_cuda_info *info);

/* Device memory helpers (errors name what was being allocated). */
loom_status loom_cuda_malloc(loom_ctx *ctx, void **ptr, size_t bytes, const char *what);
void loom_cuda_free(void *ptr);
loom_status loom_cuda_memcpy_h2d(loom_ctx *ctx, void *dst, const void *src, size_t bytes);
loom_status loom_cuda_memcpy_d2h(loom_ctx *ctx, void *dst, const void *src, size_t bytes);
/* Page-locked host memory (copies to and from it run at the link's speed);
 * *ptr NULL and LOOM_ERR_OOM when the system will not lock that much. */
loom_status loom_cuda_host_alloc(loom_ctx *ctx, void **ptr, size_t bytes, const char *what);
void loom_cuda_host_free(void *ptr);

/* The CUDA backend's scratch for the RMSNorm backwards (backend_cuda.c):
 * the device's own buffer grown to one op of N rows of H, or a slot of the
 * norm weights' dw batch (*batch set; the model's buffer when no slot
 * fits). Used by the table's norms and by the fused qk-norm + RoPE. */
struct loom_dev;
struct loom_cuda_dw_batch;
loom_status loom_cuda_dev_rms_scratch(struct loom_dev *d, loom_ctx *ctx, int64_t N, int64_t H,
                                      const float *dw);
loom_status loom_cuda_dev_dw_scratch(struct loom_dev *d, loom_ctx *ctx, int64_t N, int64_t H,
                                     float *dw, void **scratch, struct loom_cuda_dw_batch **batch);

/* dst[i] = convert(src[i]) between F32, BF16 and F16 on the device, with the
 * CPU loom_convert's rounding (round to nearest even). stream: a
 * cudaStream_t or NULL for the default stream. */
loom_status loom_cuda_convert(loom_ctx *ctx, void *dst, loom_dtype d, const void *src, loom_dtype s,
                              size_t n, void *stream);
loom_status loom_cuda_sync(loom_ctx *ctx);
/* Makes `device` this thread's current GPU. */
loom_status loom_cuda_set_device(loom_ctx *ctx, int device);
/* Free and total memory of the current GPU (bytes). */
loom_status loom_cuda_mem_info(loom_ctx *ctx, size_t *free_bytes, size_t *total_bytes);

#ifdef __cplusplus
}
#endif
#endif
