/* CUDA glue ops (ops_glue.cu): the GPU versions of src/backend/cpu/cpu_glue.h,
 * with the same semantics, and async memset/memcpy on a stream. The
 * conventions of cuda_ops.h hold: device pointers (ids, targets, idx, qidx
 * too), host scalars, `stream` a cudaStream_t or NULL, kernels queued without
 * waiting, launch errors as LOOM_ERR_DEVICE naming the op ("cuda
 * ce_vp_sums: ..."), activations F32/BF16/F16 given by a loom_dtype,
 * arithmetic in fp32 or double as stated, fixed-order reductions without
 * floating-point atomics (bit-reproducible run to run), indices trusted. */
#ifndef LOOM_CUDA_GLUE_H
#define LOOM_CUDA_GLUE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "loom.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- vocab-parallel embedding ----
 * W: (rows, H) in w_dtype, rows [row0, row0 + rows) of the full embedding.
 * fwd: out (T, H) in out_dtype; out[t, :] = W[ids[t] - row0, :] when that row
 * is here, else zeros. bwd: dW (rows, H) fp32 += dout[t, :] (dout_dtype) for
 * the in-range tokens: each thread owns a column of a group of rows and adds
 * their tokens in token order, so an fp32 dW is bit-identical to
 * loom_cpu_embedding_vp_bwd. */
loom_status loom_cuda_embedding_vp_fwd(loom_ctx *ctx, const int32_t *ids, int64_t T, const void *W,
                                       loom_dtype w_dtype, int64_t row0, int64_t rows, int64_t H,
                                       void *out, loom_dtype out_dtype, void *stream);
loom_status loom_cuda_embedding_vp_bwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                       const void *dout, loom_dtype dout_dtype, int64_t row0,
                                       int64_t rows, int64_t H, float *dW, void *stream);

/* ---- vocab-parallel cross-entropy pieces ----
 * As loom_cpu_ce_vp_max / _sums / _grad: logits (c rows, stride ld) in dtype,
 * nvalid clamped to [0, ld], v0 the global id of local column 0, tgt (c)
 * global ids or -100; mx (c) and ce (3c) are device doubles. One block
 * per row; its columns are split over the threads in a fixed pattern and
 * reduced by a fixed tree, so the results are reproducible and equal the
 * CPU's up to rounding (exp in fp32 on the special-function unit, a few ulp;
 * sums in double). The max is exact. grad works in place: scale * exp(z - L), L = mx + log(ce[3r]),
 * in fp32, scale subtracted at the target, then one rounding to dtype. The
 * exponentials in double made these kernels compute-bound at 3-4x their
 * memory time. */
loom_status loom_cuda_ce_vp_max(loom_ctx *ctx, const void *logits, loom_dtype dtype, int64_t c,
                                int64_t ld, int64_t nvalid, double *mx, void *stream);
loom_status loom_cuda_ce_vp_sums(loom_ctx *ctx, const void *logits, loom_dtype dtype, int64_t c,
                                 int64_t ld, int64_t nvalid, const int32_t *tgt, int64_t v0,
                                 const double *mx, double *ce, void *stream);
loom_status loom_cuda_ce_vp_grad(loom_ctx *ctx, void *logits, loom_dtype dtype, int64_t c,
                                 int64_t ld, int64_t nvalid, const int32_t *tgt, int64_t v0,
                                 const double *mx, const double *ce, float scale, void *stream);
/* The three in one pass for a tensor-parallel size of 1 (mx a row's own
 * max): mx and ce as ce_vp_max and ce_vp_sums give them (the sums from a
 * running max, so rounded differently within the same tolerance), and with
 * grad the logits replaced by ce_vp_grad's gradient (the same bits for the
 * same mx and ce). Rows go one per block over a grid of one block per SM. */
loom_status loom_cuda_ce_vp_fused(loom_ctx *ctx, void *logits, loom_dtype dtype, int64_t c,
                                  int64_t ld, int64_t nvalid, const int32_t *tgt, int64_t v0,
                                  double *mx, double *ce, float scale, bool grad, void *stream);
/* As loom_cpu_rows_scale: x (c rows of ld, dtype) times w (c, fp32, device),
 * each product in fp32 rounded once to dtype. */
loom_status loom_cuda_rows_scale(loom_ctx *ctx, void *x, loom_dtype dtype, int64_t c, int64_t ld,
                                 const float *w, void *stream);

/* ---- row permutations (context parallel) ----
 * Rows of `width` elements of esz bytes (any esz > 0; 2 and 4 are the dtypes).
 * gather: dst row j = src row idx[j]; scatter: dst row idx[j] = src row j;
 * j < n, idx (n) on the device, without repeats for scatter; dst and src do
 * not overlap. Copies 16, 8, 4 or 2 bytes at a time when the row size and
 * both pointers allow. */
loom_status loom_cuda_rows_gather(loom_ctx *ctx, void *dst, const void *src, const int32_t *idx,
                                  int64_t n, int64_t width, size_t esz, void *stream);
loom_status loom_cuda_rows_scatter(loom_ctx *ctx, void *dst, const void *src, const int32_t *idx,
                                   int64_t n, int64_t width, size_t esz, void *stream);

/* ---- LoRA dropout ----
 * As loom_cpu_lora_dropout, on (T, in) tensors in dtype: x NULL applies the
 * mask to out in place; qidx (T, device) or NULL. The mask is the CPU's bit
 * for bit (the same loom_rng_uniform in device code); a kept element is
 * v * (float)(1 / (1 - p)) in fp32, rounded once to dtype. */
loom_status loom_cuda_lora_dropout(loom_ctx *ctx, void *out, const void *x, int64_t T, int64_t in,
                                   int64_t full, int64_t col0, const int32_t *qidx, int64_t out0,
                                   uint64_t seed, uint64_t key, double p, loom_dtype dtype,
                                   void *stream);

/* ---- memory on a stream ----
 * memset_async: bytes of ptr (device) set to zero. memcpy_async: bytes from
 * src to dst with cudaMemcpyDefault (unified addressing tells host from
 * device, so host<->device and device<->device both work; a copy from
 * pageable host memory may return only once the data is staged). bytes 0
 * does nothing. */
loom_status loom_cuda_memset_async(loom_ctx *ctx, void *ptr, size_t bytes, void *stream);
loom_status loom_cuda_memcpy_async(loom_ctx *ctx, void *dst, const void *src, size_t bytes,
                                   void *stream);
/* rows of width bytes, src rows lds bytes apart, dst rows ldd apart, both
 * on the device (a kernel of 16-byte pieces where the pointers, strides and
 * width are multiples of 16, else cudaMemcpy2DAsync); nothing when width or
 * rows is 0 */
loom_status loom_cuda_memcpy2d_async(loom_ctx *ctx, void *dst, size_t ldd, const void *src,
                                     size_t lds, size_t width, size_t rows, void *stream);


/* ---- timing events ----
 * events_create: n timing events into *ev (an opaque array); event_record:
 * event i recorded on stream; events_ms: waits for event n - 1, then ms[i] =
 * the time from event i to event i + 1 (i < n - 1); events_free takes NULL. */
loom_status loom_cuda_events_create(loom_ctx *ctx, int n, void **ev);
loom_status loom_cuda_event_record(loom_ctx *ctx, void *ev, int i, void *stream);
loom_status loom_cuda_events_ms(loom_ctx *ctx, void *ev, int n, double *ms);
void loom_cuda_events_free(void *ev, int n);

#ifdef __cplusplus
}
#endif
#endif
