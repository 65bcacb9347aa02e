/* The CUDA backend's table (backend.h): device memory through the CUDA
 * runtime, copies queued on the model's stream, page-locked host buffers.
 * Built only with CUDA (an empty unit otherwise). */
#ifdef LOOM_HAVE_CUDA
#include <stdlib.h>
#include <string.h>

#include "../../core/core.h"
#include "../backend.h"
#include "cuda_backend.h"
#include "cuda_glue.h"
#include "cuda_ops.h"

static loom_status cuda_init(loom_dev *d, loom_ctx *ctx) {
    size_t free_b = 0, total_b = 0;
    if (loom_cuda_mem_info(ctx, &free_b, &total_b) == LOOM_OK) {
        d->used0 = total_b - free_b;
        d->gpu_total = total_b;
    }
    loom_status st = loom_cuda_gemm_create(ctx, 0, &d->gemm);
    if (st) return st;
    /* cuDNN's fused attention unless loom's own kernels are asked for (by
     * name, or for the bitwise-repeatable backward, which cuDNN's is not) */
    const char *a = getenv("LOOM_ATTN"), *det = getenv("LOOM_ATTN_DETERMINISTIC");
    if (!(a && strcmp(a, "loom") == 0) && !(det && *det && strcmp(det, "0") != 0) &&
        (st = loom_cuda_attn_create(ctx, &d->attn)))
        return st;
    return loom_cuda_malloc(ctx, (void **)&d->sumsq_scratch,
                            LOOM_CUDA_SUMSQ_BLOCKS * sizeof(double), "grad-norm scratch");
}

static void cuda_release(loom_dev *d) {
    if (d->gemm) loom_cuda_gemm_free(d->gemm);
    loom_cuda_attn_free(d->attn);
    d->attn = NULL;
    loom_cuda_free(d->sumsq_scratch);
    loom_cuda_free(d->rms_scratch);
    loom_cuda_dw_batch_free(d->dw_batch);
    d->dw_batch = NULL;
    loom_cuda_free(d->lora_scratch);
    d->lora_scratch = NULL;
    d->lora_scratch_bytes = 0;
    d->gemm = NULL;
    d->sumsq_scratch = NULL;
    d->rms_scratch = NULL;
    d->rms_scratch_bytes = 0;
}

static void cuda_attn_note(const loom_dev *d, char *buf, size_t n) {
    if (!d->attn) {
        snprintf(buf, n, "loom's attention kernels (LOOM_ATTN=loom or LOOM_ATTN_DETERMINISTIC=1)");
        return;
    }
    long long f = 0, b = 0;
    const char *why = "";
    loom_cuda_attn_counts(d->attn, &f, &b, &why);
    const bool all = f == d->attn_calls[0] && b == d->attn_calls[1];
    snprintf(buf, n, "cuDNN fused attention ran %lld/%lld forwards, %lld/%lld backwards%s%s%s", f,
             d->attn_calls[0], b, d->attn_calls[1], all ? "" : "; loom's kernels the rest (",
             all ? "" : why[0] ? why : "context parallel, or more than 512 documents",
             all ? "" : ")");
}

static loom_status cuda_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                              const char *what) {
    loom_status st = loom_cuda_malloc(ctx, p, bytes, what);
    if (st) return st;
    size_t free_b, total_b;
    if (loom_cuda_mem_info(ctx, &free_b, &total_b) == LOOM_OK && total_b - free_b > d->used0 &&
        total_b - free_b - d->used0 > d->peak)
        d->peak = total_b - free_b - d->used0;
    return loom_cuda_memset_async(ctx, *p, bytes, d->stream);
}

static void cuda_free(loom_dev *d, void *p) {
    (void)d;
    loom_cuda_free(p);
}

static loom_status cuda_host_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                                   bool *pinned, const char *what) {
    (void)d;
    *pinned = loom_cuda_host_alloc(ctx, p, bytes, what) == LOOM_OK;
    if (*pinned) return LOOM_OK;
    *p = loom_malloc(ctx, bytes ? bytes : 1, what); /* pageable: slower copies, still right */
    return *p ? LOOM_OK : LOOM_ERR_OOM;
}

static loom_status cuda_copy(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                             size_t bytes) {
    return loom_cuda_memcpy_async(ctx, dst, src, bytes, d->stream);
}

static loom_status cuda_zero(loom_dev *d, loom_ctx *ctx, void *p, size_t bytes) {
    return loom_cuda_memset_async(ctx, p, bytes, d->stream);
}

static loom_status cuda_download(loom_dev *d, loom_ctx *ctx, void *host, const void *dev,
                                 size_t bytes) {
    (void)d;
    return loom_cuda_memcpy_d2h(ctx, host, dev, bytes);
}

static loom_status cuda_upload(loom_dev *d, loom_ctx *ctx, void *dev, const void *host,
                               size_t bytes) {
    (void)d;
    return loom_cuda_memcpy_h2d(ctx, dev, host, bytes);
}

static loom_status cuda_convert(loom_dev *d, loom_ctx *ctx, void *dst, loom_dtype dt,
                                const void *src, loom_dtype sdt, size_t n) {
    return loom_cuda_convert(ctx, dst, dt, src, sdt, n, d->stream);
}

/* ---- element-wise, in the compute dtype, on the model's stream ---- */

static loom_status cuda_swiglu_fwd(loom_dev *d, loom_ctx *ctx, const void *g, const void *u,
                                   int64_t n, void *h) {
    return loom_cuda_swiglu_fwd(ctx, g, u, n, h, d->adt, d->stream);
}

static loom_status cuda_swiglu_bwd(loom_dev *d, loom_ctx *ctx, const void *dh, const void *g,
                                   const void *u, int64_t n, void *dg, void *du) {
    return loom_cuda_swiglu_bwd(ctx, dh, g, u, n, dg, du, d->adt, d->stream);
}

static loom_status cuda_add(loom_dev *d, loom_ctx *ctx, void *y, const void *x, int64_t n) {
    return loom_cuda_residual_add(ctx, y, d->adt, x, d->adt, n, d->stream);
}

static loom_status cuda_bias_fwd(loom_dev *d, loom_ctx *ctx, void *y, const void *b, int64_t T,
                                 int64_t N) {
    return loom_cuda_add_bias_fwd(ctx, y, d->adt, b, d->adt, T, N, d->stream);
}

static loom_status cuda_bias_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, int64_t T, int64_t N,
                                 float *db) {
    return loom_cuda_add_bias_bwd(ctx, dy, d->adt, T, N, db, d->stream);
}

static loom_status cuda_embed_fwd(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                                  const void *W, int64_t row0, int64_t rows, int64_t H,
                                  void *out) {
    return loom_cuda_embedding_vp_fwd(ctx, ids, T, W, d->adt, row0, rows, H, out, d->adt,
                                      d->stream);
}

static loom_status cuda_embed_bwd(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                                  const void *dout, int64_t row0, int64_t rows, int64_t H,
                                  float *dW) {
    return loom_cuda_embedding_vp_bwd(ctx, ids, T, dout, d->adt, row0, rows, H, dW, d->stream);
}

static loom_status cuda_rows_gather(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                    const int32_t *idx, int64_t n, int64_t width) {
    return loom_cuda_rows_gather(ctx, dst, src, idx, n, width, d->esz, d->stream);
}

static loom_status cuda_rows_scatter(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                     const int32_t *idx, int64_t n, int64_t width) {
    return loom_cuda_rows_scatter(ctx, dst, src, idx, n, width, d->esz, d->stream);
}

static loom_status cuda_dropout(loom_dev *d, loom_ctx *ctx, void *out, const void *x, int64_t T,
                                int64_t in, int64_t full, int64_t col0, const int32_t *qidx,
                                int64_t out0, uint64_t seed, uint64_t key, double p) {
    return loom_cuda_lora_dropout(ctx, out, x, T, in, full, col0, qidx, out0, seed, key, p,
                                  d->adt, d->stream);
}

/* ---- RMSNorm ---- */

loom_status loom_cuda_dev_rms_scratch(loom_dev *d, loom_ctx *ctx, int64_t N, int64_t H,
                                      const float *dw) {
    size_t need = dw ? loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) : 0;
    if (need <= d->rms_scratch_bytes) return LOOM_OK;
    loom_cuda_free(d->rms_scratch);
    d->rms_scratch = NULL;
    d->rms_scratch_bytes = 0;
    loom_status st = loom_cuda_malloc(ctx, &d->rms_scratch, need, "RMSNorm backward scratch");
    if (!st) d->rms_scratch_bytes = need;
    return st;
}

#define DW_BATCH_BYTES ((size_t)64 << 20)

loom_status loom_cuda_dev_dw_scratch(loom_dev *d, loom_ctx *ctx, int64_t N, int64_t H, float *dw,
                                     void **scratch, struct loom_cuda_dw_batch **batch) {
    *batch = NULL;
    *scratch = NULL;
    if (!dw) return LOOM_OK;
    loom_status st;
    if (!d->dw_batch) {
        const size_t one = loom_cuda_rmsnorm_bwd_scratch_bytes(N, H) + 256;
        if ((st = loom_cuda_dw_batch_create(ctx, one > DW_BATCH_BYTES ? one : DW_BATCH_BYTES,
                                            &d->dw_batch)))
            return st;
    }
    void *p = loom_cuda_dw_batch_scratch(d->dw_batch, N, H);
    if (!p) {
        if ((st = loom_cuda_dw_batch_flush(ctx, d->dw_batch, d->stream))) return st;
        p = loom_cuda_dw_batch_scratch(d->dw_batch, N, H);
    }
    if (p) {
        *scratch = p;
        *batch = d->dw_batch;
        return LOOM_OK;
    }
    if ((st = loom_cuda_dev_rms_scratch(d, ctx, N, H, dw))) return st;
    *scratch = d->rms_scratch;
    return LOOM_OK;
}

static loom_status cuda_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                    int64_t N, int64_t H, float eps, void *y, float *rstd) {
    const loom_dtype t = d->adt;
    return loom_cuda_rmsnorm_fwd(ctx, x, t, w, t, N, H, eps, y, t, rstd, d->stream);
}

static loom_status cuda_rmsnorm_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                    const void *w, const float *rstd, int64_t N, int64_t H,
                                    void *dx, float *dw) {
    const loom_dtype t = d->adt;
    loom_status st = loom_cuda_dev_rms_scratch(d, ctx, N, H, dw);
    if (st) return st;
    return loom_cuda_rmsnorm_bwd(ctx, dy, t, x, t, w, t, rstd, N, H, dx, t, dw, d->rms_scratch,
                                 d->stream);
}

static loom_status cuda_add_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, void *x, const void *res,
                                        void *xsum, const void *w, int64_t N, int64_t H, float eps,
                                        void *y, float *rstd) {
    if (loom_cuda_rmsnorm_fused_ok(d->adt, H))
        return loom_cuda_add_rmsnorm_fwd(ctx, x, res, xsum, d->adt, w, d->adt, N, H, eps, y, rstd,
                                         d->stream);
    loom_status st = xsum != x ? cuda_copy(d, ctx, xsum, x, (size_t)(N * H) * d->esz) : LOOM_OK;
    if (!st) st = cuda_add(d, ctx, xsum, res, N * H);
    return st ? st : cuda_rmsnorm_fwd(d, ctx, xsum, w, N, H, eps, y, rstd);
}

static loom_status cuda_rmsnorm_bwd_add(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                        const void *w, const float *rstd, int64_t N, int64_t H,
                                        void *dx, float *dw) {
    if (loom_cuda_rmsnorm_fused_ok(d->adt, H)) {
        void *scr;
        struct loom_cuda_dw_batch *b;
        loom_status st = loom_cuda_dev_dw_scratch(d, ctx, N, H, dw, &scr, &b);
        if (st) return st;
        return loom_cuda_rmsnorm_bwd_add(ctx, dy, x, d->adt, w, d->adt, rstd, N, H, dx, dw, scr, b,
                                         d->stream);
    }
    loom_status st = cuda_rmsnorm_bwd(d, ctx, dy, x, w, rstd, N, H, dy, dw);
    return st ? st : cuda_add(d, ctx, dx, dy, N * H);
}

static loom_status cuda_dw_flush(loom_dev *d, loom_ctx *ctx) {
    return d->dw_batch ? loom_cuda_dw_batch_flush(ctx, d->dw_batch, d->stream) : LOOM_OK;
}

static void cuda_dw_drop(loom_dev *d) { loom_cuda_dw_batch_drop(d->dw_batch); }

const loom_backend *loom_backend_cuda(void) {
    static const loom_backend be = {
        .name = "cuda",
        .init = cuda_init,
        .release = cuda_release,
        .attn_note = cuda_attn_note,
        .alloc = cuda_alloc,
        .free = cuda_free,
        .host_alloc = cuda_host_alloc,
        .copy = cuda_copy,
        .zero = cuda_zero,
        .download = cuda_download,
        .upload = cuda_upload,
        .convert = cuda_convert,
        .swiglu_fwd = cuda_swiglu_fwd,
        .swiglu_bwd = cuda_swiglu_bwd,
        .add = cuda_add,
        .bias_fwd = cuda_bias_fwd,
        .bias_bwd = cuda_bias_bwd,
        .embed_fwd = cuda_embed_fwd,
        .embed_bwd = cuda_embed_bwd,
        .rows_gather = cuda_rows_gather,
        .rows_scatter = cuda_rows_scatter,
        .dropout = cuda_dropout,
        .rmsnorm_fwd = cuda_rmsnorm_fwd,
        .rmsnorm_bwd = cuda_rmsnorm_bwd,
        .add_rmsnorm_fwd = cuda_add_rmsnorm_fwd,
        .rmsnorm_bwd_add = cuda_rmsnorm_bwd_add,
        .dw_flush = cuda_dw_flush,
        .dw_drop = cuda_dw_drop,
    };
    return &be;
}
#endif /* LOOM_HAVE_CUDA */
