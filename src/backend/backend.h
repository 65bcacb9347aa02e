/* The backend table (ggml's seam): the ops of one kind of device, chosen
 * once when a model is placed on its device (loom_backend_for). The CPU is
 * a backend like any other (src/backend/cpu/backend_cpu.c); CUDA is
 * src/backend/cuda/backend_cuda.c. Each op takes the device's state (loom_dev)
 * and the context its errors go to.
 *
 * In the table so far: the device's set-up and its memory (allocation,
 * copies, conversion), and the element-wise ops (SwiGLU, residual add,
 * bias, the vocabulary-parallel embedding, row permutations, LoRA's
 * dropout) and RMSNorm. The other compute ops are
 * still chosen op by op in src/model/kern.c; they move here family by
 * family (issue 36). */
#ifndef LOOM_BACKEND_H
#define LOOM_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "loom.h"

struct loom_cuda_gemm_handle;
struct loom_cuda_attn_handle;

typedef struct loom_dev {
    const struct loom_backend *be; /* the ops of this device (loom_backend_for) */
    bool cuda;
    int device;               /* CUDA device of this process, -1 on CPU */
    loom_dtype adt;           /* compute dtype */
    size_t esz;               /* its size in bytes */
    void *stream;             /* cudaStream_t (NULL: legacy default) */
    struct loom_cuda_gemm_handle *gemm;
    struct loom_cuda_attn_handle *attn; /* cuDNN's fused attention; NULL: loom's kernels only
                                           (LOOM_ATTN=loom or LOOM_ATTN_DETERMINISTIC=1) */
    long long attn_calls[2];  /* GPU attention forwards and backwards run */
    double *sumsq_scratch;    /* device: the grad-norm reduction's block partials */
    void *rms_scratch;        /* device: RMSNorm backward's dw partials */
    size_t rms_scratch_bytes;
    struct loom_cuda_dw_batch *dw_batch; /* the layers' norm weight gradients, added at
                                            loom_k_dw_flush (made at the first use) */
    void *lora_scratch;       /* device: the LoRA pass kernels' partial sums */
    size_t lora_scratch_bytes;
    bool lora_cublas;         /* LOOM_LORA_KERNELS=cublas: LoRA's forward and backward, and the
                                 input gradients' sums, on cuBLASLt (no GEMM of loom's own) */
    size_t used0;             /* GPU memory in use when the model was created */
    size_t peak;              /* most in use since, above used0 (sampled at each allocation) */
    size_t gpu_total;
} loom_dev;

typedef struct loom_backend {
    const char *name;
    /* Sets up d (d->adt, d->esz, d->device set): handles, scratch buffers,
     * the memory in use now; release frees them. */
    loom_status (*init)(loom_dev *d, loom_ctx *ctx);
    void (*release)(loom_dev *d);
    /* Which kernels ran the attention, in words. */
    void (*attn_note)(const loom_dev *d, char *buf, size_t n);
    /* Device memory, zeroed (the peak in use updated); free takes NULL. */
    loom_status (*alloc)(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes, const char *what);
    void (*free)(loom_dev *d, void *p);
    /* Host memory for copies to and from the device: page-locked where the
     * device has such (*pinned set), else malloc's. */
    loom_status (*host_alloc)(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes, bool *pinned,
                              const char *what);
    /* In stream order (copy, zero) or returning when the data is there
     * (download, upload); bytes > 0 and distinct pointers (the caller
     * checks). */
    loom_status (*copy)(loom_dev *d, loom_ctx *ctx, void *dst, const void *src, size_t bytes);
    loom_status (*zero)(loom_dev *d, loom_ctx *ctx, void *p, size_t bytes);
    loom_status (*download)(loom_dev *d, loom_ctx *ctx, void *host, const void *dev,
                            size_t bytes);
    loom_status (*upload)(loom_dev *d, loom_ctx *ctx, void *dev, const void *host, size_t bytes);
    /* dst[i] = src[i] between F32, BF16 and F16 (n elements, on the device). */
    loom_status (*convert)(loom_dev *d, loom_ctx *ctx, void *dst, loom_dtype dt, const void *src,
                           loom_dtype sdt, size_t n);

    /* ---- element-wise, on activations in d->adt (fp32 gradients of
     * parameters); the semantics are the CPU reference's (cpu_ops.h,
     * cpu_glue.h) ---- */
    /* h = silu(g) * u over n; its backward into dg, du */
    loom_status (*swiglu_fwd)(loom_dev *d, loom_ctx *ctx, const void *g, const void *u, int64_t n,
                              void *h);
    loom_status (*swiglu_bwd)(loom_dev *d, loom_ctx *ctx, const void *dh, const void *g,
                              const void *u, int64_t n, void *dg, void *du);
    /* y += x over n */
    loom_status (*add)(loom_dev *d, loom_ctx *ctx, void *y, const void *x, int64_t n);
    /* y (T, N) += b (N); db (N, fp32) += the column sums of dy (T, N) */
    loom_status (*bias_fwd)(loom_dev *d, loom_ctx *ctx, void *y, const void *b, int64_t T,
                            int64_t N);
    loom_status (*bias_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, int64_t T, int64_t N,
                            float *db);
    /* The vocabulary-parallel embedding: rows [row0, row0 + rows) of W (.., H)
     * (cpu_glue.h's loom_cpu_embedding_vp_fwd / _bwd; dW fp32) */
    loom_status (*embed_fwd)(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                             const void *W, int64_t row0, int64_t rows, int64_t H, void *out);
    loom_status (*embed_bwd)(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                             const void *dout, int64_t row0, int64_t rows, int64_t H, float *dW);
    /* Rows of width elements of d->esz bytes: dst[i] = src[idx[i]] (gather),
     * dst[idx[i]] = src[i] (scatter), i < n: context parallelism's orders */
    loom_status (*rows_gather)(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                               const int32_t *idx, int64_t n, int64_t width);
    loom_status (*rows_scatter)(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                const int32_t *idx, int64_t n, int64_t width);
    /* LoRA's dropout mask on x (cpu_glue.h's loom_cpu_lora_dropout) */
    loom_status (*dropout)(loom_dev *d, loom_ctx *ctx, void *out, const void *x, int64_t T,
                           int64_t in, int64_t full, int64_t col0, const int32_t *qidx,
                           int64_t out0, uint64_t seed, uint64_t key, double p);

    /* ---- RMSNorm over N rows of H (cpu_ops.h's loom_cpu_rmsnorm_*; rstd
     * and dw fp32, dw added to) ---- */
    loom_status (*rmsnorm_fwd)(loom_dev *d, loom_ctx *ctx, const void *x, const void *w, int64_t N,
                               int64_t H, float eps, void *y, float *rstd);
    loom_status (*rmsnorm_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                               const void *w, const float *rstd, int64_t N, int64_t H, void *dx,
                               float *dw);
    /* xsum = x + res (xsum may be x), then rmsnorm_fwd of xsum */
    loom_status (*add_rmsnorm_fwd)(loom_dev *d, loom_ctx *ctx, void *x, const void *res,
                                   void *xsum, const void *w, int64_t N, int64_t H, float eps,
                                   void *y, float *rstd);
    /* dx += rmsnorm_bwd's input gradient (dy may be used as scratch) */
    loom_status (*rmsnorm_bwd_add)(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                   const void *w, const float *rstd, int64_t N, int64_t H,
                                   void *dx, float *dw);
    /* dw of the norms may be added late (a GPU batches them): flush adds
     * them now, drop forgets them (the gradients were cleared) */
    loom_status (*dw_flush)(loom_dev *d, loom_ctx *ctx);
    void (*dw_drop)(loom_dev *d);
} loom_backend;

const loom_backend *loom_backend_cpu(void);
/* NULL when loom was built without CUDA. */
const loom_backend *loom_backend_cuda(void);
/* The backend of a device: CUDA or the CPU; NULL with an error in ctx when
 * that backend is not built in. */
const loom_backend *loom_backend_for(loom_ctx *ctx, bool cuda);
/* Frees what a host_alloc of any backend returned (no device needed: any
 * thread, after the model is gone). */
void loom_backend_host_free(void *p, bool pinned);

#endif /* LOOM_BACKEND_H */
