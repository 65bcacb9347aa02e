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

/* The GPU of this process: d->device (the NCCL world's, its local rank's),
 * else the current one. */
static loom_status pick_device(loom_dev *d, loom_ctx *ctx) {
    loom_cuda_info info;
    loom_status st = loom_cuda_query(ctx, d->device < 0 ? 0 : d->device, &info);
    if (st)
        return loom_err_prefix(ctx, "--device cuda: cannot use a GPU; run on the CPU with "
                                    "--device cpu, or on a machine with an NVIDIA GPU");
    if (d->device < 0) d->device = 0;
    return loom_cuda_set_device(ctx, d->device);
}

/* At --log-level debug: the device's memory in use after `what` (where the
 * memory that loom does not allocate itself goes). */
static void log_in_use(const loom_dev *d, loom_ctx *ctx, const char *what) {
    size_t free_b = 0, total_b = 0;
    if (loom_cuda_mem_info(ctx, &free_b, &total_b) == LOOM_OK)
        LOOM_LOG_D(ctx, "GPU %d: %.2f GiB in use after %s", d->device,
                   (double)(total_b - free_b) / (1 << 30), what);
}

static loom_status cuda_init(loom_dev *d, loom_ctx *ctx) {
    loom_status st = pick_device(d, ctx);
    if (st) return st;
    size_t free_b = 0, total_b = 0;
    if (loom_cuda_mem_info(ctx, &free_b, &total_b) == LOOM_OK) {
        d->used0 = total_b - free_b;
        d->gpu_total = total_b;
    }
    log_in_use(d, ctx, "the CUDA context");
    if ((st = loom_cuda_gemm_create(ctx, 0, &d->gemm))) return st;
    log_in_use(d, ctx, "cuBLASLt's handle and workspace");
    /* cuDNN's fused attention unless loom's own kernels are asked for (by
     * name, or for the bitwise-repeatable backward, which cuDNN's is not) */
    const char *a = getenv("LOOM_ATTN"), *det = getenv("LOOM_ATTN_DETERMINISTIC");
    if (!(a && strcmp(a, "loom") == 0) && !(det && *det && strcmp(det, "0") != 0) &&
        (st = loom_cuda_attn_create(ctx, &d->attn)))
        return st;
    log_in_use(d, ctx, "cuDNN's handle");
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
    loom_cuda_free(d->moe_scratch);
    d->moe_scratch = NULL;
    d->moe_scratch_bytes = 0;
    loom_cuda_free(d->gdn_scratch);
    d->gdn_scratch = NULL;
    d->gdn_scratch_bytes = 0;
    loom_cuda_events_free(d->marks, LOOM_MARKS_MAX);
    d->marks = NULL;
    free(d->bufs);
    d->bufs = NULL;
    d->nbufs = d->cap_bufs = 0;
    d->gemm = NULL;
    d->sumsq_scratch = NULL;
    d->rms_scratch = NULL;
    d->rms_scratch_bytes = 0;
}

/* The timeline's marks: events on the model's stream, made at the first. */
static loom_status cuda_mark(loom_dev *d, loom_ctx *ctx, int i) {
    if (i < 0 || i >= LOOM_MARKS_MAX)
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "timeline mark %d out of range", i);
    loom_status st;
    if (!d->marks && (st = loom_cuda_events_create(ctx, LOOM_MARKS_MAX, &d->marks))) return st;
    return loom_cuda_event_record(ctx, d->marks, i, d->stream);
}

static loom_status cuda_marks_ms(loom_dev *d, loom_ctx *ctx, int n, double *ms) {
    if (n < 1 || n > LOOM_MARKS_MAX || !d->marks)
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "timeline read of %d marks", n);
    return loom_cuda_events_ms(ctx, d->marks, n, ms);
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
             all ? "" : why[0] ? why : "context parallel, more than 512 documents, or a head size over 256",
             all ? "" : ")");
}

/* The model's buffers by address and size: what it holds of the device's
 * memory, apart from the libraries' (loom_model_buffer_memory). */
struct loom_dev_buf {
    void *p;
    size_t bytes;
};

static loom_status note_buf(loom_dev *d, loom_ctx *ctx, void *p, size_t bytes) {
    if (d->nbufs == d->cap_bufs) {
        const int cap = d->cap_bufs ? 2 * d->cap_bufs : 64;
        struct loom_dev_buf *b = loom_realloc(ctx, d->bufs, (size_t)cap * sizeof *b,
                                              "the device's buffer table");
        if (!b) return LOOM_ERR_OOM;
        d->bufs = b, d->cap_bufs = cap;
    }
    d->bufs[d->nbufs++] = (struct loom_dev_buf){p, bytes};
    d->own += bytes;
    if (d->own > d->own_peak) d->own_peak = d->own;
    return LOOM_OK;
}

static loom_status cuda_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                              const char *what) {
    loom_status st = loom_cuda_malloc(ctx, p, bytes, what);
    if (st) return st;
    if ((st = note_buf(d, ctx, *p, bytes))) {
        loom_cuda_free(*p);
        *p = NULL;
        return st;
    }
    size_t free_b, total_b;
    if (loom_cuda_mem_info(ctx, &free_b, &total_b) == LOOM_OK && total_b - free_b > d->used0) {
        const size_t used = total_b - free_b - d->used0;
        if (used > d->peak) d->peak = used;
        if (bytes >= ((size_t)16 << 20)) /* where the memory goes, at --log-level debug */
            LOOM_LOG_D(ctx, "GPU memory: %.1f MiB for %s (%.2f GiB in use)",
                       (double)bytes / (1 << 20), what, (double)used / (1 << 30));
    }
    return loom_cuda_memset_async(ctx, *p, bytes, d->stream);
}

static void cuda_free(loom_dev *d, void *p) {
    for (int i = d->nbufs - 1; p && i >= 0; i--)
        if (d->bufs[i].p == p) {
            d->own -= d->bufs[i].bytes;
            d->bufs[i] = d->bufs[--d->nbufs];
            break;
        }
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

static loom_status cuda_copy2d(loom_dev *d, loom_ctx *ctx, void *dst, size_t ldd,
                               const void *src, size_t lds, size_t width, size_t rows) {
    return loom_cuda_memcpy2d_async(ctx, dst, ldd, src, lds, width, rows, d->stream);
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

static loom_status cuda_gate_fwd(loom_dev *d, loom_ctx *ctx, const void *o, const void *g,
                                 int64_t n, void *y) {
    return loom_cuda_gate_fwd(ctx, o, g, n, y, d->adt, d->stream);
}

static loom_status cuda_gate_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *o,
                                 const void *g, int64_t n, void *do_, void *dg) {
    return loom_cuda_gate_bwd(ctx, dy, o, g, n, do_, dg, d->adt, d->stream);
}

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

static loom_status cuda_fill_randn(loom_dev *d, loom_ctx *ctx, void *x, int64_t n,
                                   uint64_t base) {
    return loom_cuda_fill_randn(ctx, x, d->adt, n, base, d->stream);
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

/* The norms' weight is woff + w (woff 1: Qwen3.5's zero-centred weights),
 * formed in fp32 inside the kernels (ops_rmsnorm.cu). */
static loom_status cuda_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                    float woff, int64_t N, int64_t H, float eps, void *y,
                                    float *rstd) {
    const loom_dtype t = d->adt;
    return loom_cuda_rmsnorm_fwd(ctx, x, t, w, t, woff, N, H, eps, y, t, rstd, d->stream);
}

static loom_status cuda_rmsnorm_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                    const void *w, float woff, const float *rstd, int64_t N,
                                    int64_t H, void *dx, float *dw) {
    const loom_dtype t = d->adt;
    loom_status st = loom_cuda_dev_rms_scratch(d, ctx, N, H, dw);
    if (st) return st;
    return loom_cuda_rmsnorm_bwd(ctx, dy, t, x, t, w, t, woff, rstd, N, H, dx, t, dw, d->rms_scratch,
                                 d->stream);
}

static loom_status cuda_add_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, void *x, const void *res,
                                        void *xsum, const void *w, float woff, int64_t N,
                                        int64_t H, float eps, void *y, float *rstd) {
    if (loom_cuda_rmsnorm_fused_ok(d->adt, H))
        return loom_cuda_add_rmsnorm_fwd(ctx, x, res, xsum, d->adt, w, d->adt, woff, N, H, eps, y,
                                         rstd, d->stream);
    loom_status st = xsum != x ? cuda_copy(d, ctx, xsum, x, (size_t)(N * H) * d->esz) : LOOM_OK;
    if (!st) st = cuda_add(d, ctx, xsum, res, N * H);
    return st ? st : cuda_rmsnorm_fwd(d, ctx, xsum, w, woff, N, H, eps, y, rstd);
}

static loom_status cuda_rmsnorm_bwd_add(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                        const void *w, float woff, const float *rstd, int64_t N,
                                        int64_t H, void *dx, float *dw) {
    if (loom_cuda_rmsnorm_fused_ok(d->adt, H)) {
        void *scr;
        struct loom_cuda_dw_batch *b;
        loom_status st = loom_cuda_dev_dw_scratch(d, ctx, N, H, dw, &scr, &b);
        if (st) return st;
        return loom_cuda_rmsnorm_bwd_add(ctx, dy, x, d->adt, w, d->adt, woff, rstd, N, H, dx, dw,
                                         scr, b, d->stream);
    }
    loom_status st = cuda_rmsnorm_bwd(d, ctx, dy, x, w, woff, rstd, N, H, dy, dw);
    return st ? st : cuda_add(d, ctx, dx, dy, N * H);
}

static loom_status cuda_dw_flush(loom_dev *d, loom_ctx *ctx) {
    return d->dw_batch ? loom_cuda_dw_batch_flush(ctx, d->dw_batch, d->stream) : LOOM_OK;
}

static void cuda_dw_drop(loom_dev *d) { loom_cuda_dw_batch_drop(d->dw_batch); }

/* ---- GEMMs: cuBLASLt, with loom's fused kernels where they apply ---- */

static loom_status cuda_gemm(loom_dev *d, loom_ctx *ctx, bool ta, bool tb, int64_t M, int64_t N,
                             int64_t K, float alpha, const void *A, int64_t lda, const void *B,
                             int64_t ldb, loom_dtype ab, float beta, void *C, loom_dtype cdt,
                             int64_t ldc) {
    return loom_cuda_gemm(ctx, d->gemm, ta, tb, M, N, K, alpha, A, ab, lda, B, ab, ldb, beta, C,
                          cdt, ldc, d->stream);
}

/* Up to four terms in one GEMM with one fp32 accumulator where loom's kernel
 * takes them (Hopper, BF16, beta 0) and its tiles fill the GPU's waves
 * (loom_cuda_gemm_wave_fill at least 0.9: Qwen3-4B's 2560 columns are 0.81,
 * and cuBLASLt's sequence runs them faster); one GEMM a term otherwise */
static loom_status cuda_dx_sum(loom_dev *d, loom_ctx *ctx, int64_t T, int64_t in, int n,
                               const loom_dx_term *t, float beta, void *dx) {
    int done = 0;
    if (!d->lora_cublas && beta == 0.0f && n > 1) {
        const void *a[4], *b[4];
        int64_t lda[4], K[4];
        const int k = n < 4 ? n : 4;
        for (int i = 0; i < k; i++)
            a[i] = t[i].dy, lda[i] = t[i].ld, K[i] = t[i].out, b[i] = t[i].W;
        if (loom_cuda_gemm_dx_ok(d->adt, T, in, k, a, lda, K, b, dx) &&
            loom_cuda_gemm_wave_fill(T, in) >= 0.9) {
            loom_status st = loom_cuda_gemm_dx(ctx, T, in, k, a, lda, K, b, dx, d->stream);
            if (st)
                return st;
            done = k;
            beta = 1.0f;
        }
    }
    for (int i = done; i < n; i++, beta = 1.0f) {
        loom_status st = cuda_gemm(d, ctx, false, false, T, in, t[i].out, 1.0f, t[i].dy, t[i].ld,
                                   t[i].W, in, d->adt, beta, dx, d->adt, in);
        if (st) return st;
    }
    return LOOM_OK;
}

static loom_status cuda_lin_lora_fwd(loom_dev *d, loom_ctx *ctx, const void *x, int64_t T,
                                     int64_t in, const void *W, int64_t out, const void *u,
                                     int64_t ldu, const void *B, int64_t r, float s, void *y,
                                     bool *done) {
    *done = !d->lora_cublas && loom_cuda_gemm_lora_ok(d->adt, T, out, in, x, W, u, ldu, B, r, y);
    return *done ? loom_cuda_gemm_lora(ctx, T, out, in, x, W, u, ldu, B, r, s, y, d->stream)
                 : LOOM_OK;
}

/* One read of each dy in loom's kernel (BF16/F16, r a multiple of 8 up to
 * 32, 16-byte rows) unless LOOM_LORA_KERNELS=cublas; the GEMM pair else */
static loom_status cuda_lora_dy_n(loom_dev *d, loom_ctx *ctx, int64_t T, int64_t r, float s, int n,
                                  const loom_lora_dy_op *ops, int64_t ldu, int64_t lddu) {
    bool kernel = !d->lora_cublas && n >= 1 && n <= 3;
    loom_cuda_pass_op po[3];
    for (int i = 0; kernel && i < n; i++) {
        const loom_lora_dy_op *o = &ops[i];
        kernel = loom_cuda_lora_pass_ok(d->adt, T, o->out, r, o->dy, o->out, o->B, false, r, o->du,
                                        lddu, o->u, ldu, false, r);
        po[i] = (loom_cuda_pass_op){T, o->out, r, o->dy, o->out, o->B, false, r, s,
                                    o->du, lddu, o->u, ldu, s, o->dB, false, r};
    }
    loom_status st;
    if (kernel) {
        const size_t need = loom_cuda_lora_pass_n_scratch_bytes(n, po);
        if (need > d->lora_scratch_bytes) { /* grown at the first call of a larger shape */
            loom_cuda_free(d->lora_scratch);
            d->lora_scratch = NULL;
            d->lora_scratch_bytes = 0;
            if ((st = loom_cuda_malloc(ctx, &d->lora_scratch, need, "LoRA backward scratch")))
                return st;
            d->lora_scratch_bytes = need;
        }
        return loom_cuda_lora_pass_n(ctx, n, po, d->adt, d->lora_scratch, d->lora_scratch_bytes,
                                     d->stream);
    }
    for (int i = 0; i < n; i++) {
        const loom_lora_dy_op *o = &ops[i];
        if ((st = cuda_gemm(d, ctx, false, false, T, r, o->out, s, o->dy, o->out, o->B, r, d->adt,
                            0.0f, o->du, d->adt, lddu)) ||
            (st = cuda_gemm(d, ctx, true, false, o->out, r, T, s, o->dy, o->out, o->u, ldu, d->adt,
                            1.0f, o->dB, LOOM_F32, r)))
            return st;
    }
    return LOOM_OK;
}

/* ---- RoPE and attention ---- */

static loom_status cuda_rope(loom_dev *d, loom_ctx *ctx, bool backward, void *x, int64_t T,
                             int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                             const float *inv_freq) {
    return (backward ? loom_cuda_rope_bwd : loom_cuda_rope_fwd)(ctx, x, d->adt, T, nh, D, rd, pos,
                                                                inv_freq, d->stream);
}

static loom_status cuda_rope_table(loom_dev *d, loom_ctx *ctx, const int32_t *pos, int64_t T,
                                   int64_t D, const float *inv_freq, float *table) {
    return table ? loom_cuda_rope_table(ctx, pos, T, D, inv_freq, table, d->stream) : LOOM_OK;
}

static loom_status cuda_qknorm_rope_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                        float woff, int64_t T, int64_t nh, int64_t D, int64_t rd,
                                        float eps, const int32_t *pos, const float *inv_freq,
                                        const float *table, void *y, float *rstd) {
    if (table && rd == D && loom_cuda_qknorm_rope_ok(d->adt, D))
        return loom_cuda_qknorm_rope_fwd(ctx, x, d->adt, w, d->adt, woff, T * nh, nh, D, eps,
                                         table, y, rstd, d->stream);
    loom_status st = cuda_rmsnorm_fwd(d, ctx, x, w, woff, T * nh, D, eps, y, rstd);
    return st ? st : cuda_rope(d, ctx, false, y, T, nh, D, rd, pos, inv_freq);
}

static loom_status cuda_qknorm_rope_bwd(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                        const void *w, float woff, const float *rstd, int64_t T,
                                        int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                                        const float *inv_freq, const float *table, float *dw) {
    const int64_t N = T * nh;
    loom_status st;
    if (table && rd == D && loom_cuda_qknorm_rope_ok(d->adt, D)) {
        void *scr;
        struct loom_cuda_dw_batch *b;
        if ((st = loom_cuda_dev_dw_scratch(d, ctx, N, D, dw, &scr, &b))) return st;
        return loom_cuda_qknorm_rope_bwd(ctx, dy, x, d->adt, w, d->adt, woff, rstd, N, nh, D,
                                         table, dy, dw, scr, b, d->stream);
    }
    if ((st = cuda_rope(d, ctx, true, dy, T, nh, D, rd, pos, inv_freq))) return st;
    return cuda_rmsnorm_bwd(d, ctx, dy, x, w, woff, rstd, N, D, dy, dw);
}

/* cuDNN's fused attention first when every query is here (no context
 * parallelism), loom's kernels where it declines */
static loom_status cuda_attn_fwd(loom_dev *d, loom_ctx *ctx, const void *q, const int32_t *qidx,
                                 int64_t Tq, const void *k, const void *v, int64_t T, int64_t Hq,
                                 int64_t Hkv, int64_t D, const int32_t *cu, int64_t ndocs,
                                 int64_t seqlen, float scale, void *out, float *lse) {
    d->attn_calls[0]++;
    if (!qidx && d->attn) {
        bool taken = false;
        loom_status st = loom_cuda_attention_cudnn_fwd(ctx, d->attn, q, k, v, d->adt, T, Hq, Hkv, D,
                                                       cu, ndocs, seqlen, scale, out, lse,
                                                       d->stream, &taken);
        if (st || taken) return st;
    }
    return loom_cuda_attention_fwd_q(ctx, q, qidx, Tq, k, v, d->adt, T, Hq, Hkv, D, cu, ndocs,
                                     scale, out, lse, d->stream);
}

static loom_status cuda_attn_bwd(loom_dev *d, loom_ctx *ctx, const void *dout, const void *q,
                                 const int32_t *qidx, int64_t Tq, const void *k, const void *v,
                                 const void *out, const float *lse, int64_t T, int64_t Hq,
                                 int64_t Hkv, int64_t D, const int32_t *cu, int64_t ndocs,
                                 int64_t seqlen, float scale, void *dq, void *dk, void *dv) {
    d->attn_calls[1]++;
    if (!qidx && d->attn) {
        bool taken = false;
        loom_status st = loom_cuda_attention_cudnn_bwd(ctx, d->attn, dout, q, k, v, out, lse,
                                                       d->adt, T, Hq, Hkv, D, cu, ndocs, seqlen,
                                                       scale, dq, dk, dv, d->stream, &taken);
        if (st || taken) return st;
    }
    return loom_cuda_attention_bwd_q(ctx, dout, q, qidx, Tq, k, v, out, lse, d->adt, T, Hq, Hkv, D,
                                     cu, ndocs, scale, dq, dk, dv, d->stream);
}

/* ---- the vocabulary-parallel cross-entropy ---- */

static loom_status cuda_ce_max(loom_dev *d, loom_ctx *ctx, const void *z, int64_t c, int64_t ld,
                               int64_t nvalid, double *mx) {
    return loom_cuda_ce_vp_max(ctx, z, d->adt, c, ld, nvalid, mx, d->stream);
}

static loom_status cuda_ce_sums(loom_dev *d, loom_ctx *ctx, const void *z, int64_t c, int64_t ld,
                                int64_t nvalid, const int32_t *tgt, int64_t v0, const double *mx,
                                double *ce) {
    return loom_cuda_ce_vp_sums(ctx, z, d->adt, c, ld, nvalid, tgt, v0, mx, ce, d->stream);
}

static loom_status cuda_ce_grad(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                                int64_t nvalid, const int32_t *tgt, int64_t v0, const double *mx,
                                const double *ce, float scale) {
    return loom_cuda_ce_vp_grad(ctx, z, d->adt, c, ld, nvalid, tgt, v0, mx, ce, scale, d->stream);
}

static loom_status cuda_rows_scale(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                                   const float *w) {
    return loom_cuda_rows_scale(ctx, z, d->adt, c, ld, w, d->stream);
}

static loom_status cuda_ce_fused(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                                 int64_t nvalid, const int32_t *tgt, int64_t v0, double *mx,
                                 double *ce, float scale, bool grad) {
    return loom_cuda_ce_vp_fused(ctx, z, d->adt, c, ld, nvalid, tgt, v0, mx, ce, scale, grad,
                                 d->stream);
}

/* ---- mixture of experts (ops_moe.cu), on the model's stream ---- */

/* d->moe_scratch grown to `need` bytes (at the first call of a larger shape) */
static loom_status moe_scratch(loom_dev *d, loom_ctx *ctx, size_t need) {
    if (need <= d->moe_scratch_bytes)
        return LOOM_OK;
    loom_cuda_free(d->moe_scratch);
    d->moe_scratch = NULL;
    d->moe_scratch_bytes = 0;
    loom_status st = loom_cuda_malloc(ctx, &d->moe_scratch, need, "MoE scratch");
    if (!st)
        d->moe_scratch_bytes = need;
    return st;
}

static loom_status cuda_moe_dest(loom_dev *d, loom_ctx *ctx, const int32_t *idx, int64_t N, int k,
                                 int64_t El, int P, int32_t *dest) {
    return loom_cuda_moe_dest(ctx, idx, N, k, El, P, dest, d->stream);
}

static loom_status cuda_moe_dedup_meta(loom_dev *d, loom_ctx *ctx, const int32_t *ord, int64_t U,
                                       const int32_t *idx, const float *w, int k, int64_t El,
                                       int P, int32_t *tok, int32_t *mid, float *mw) {
    return loom_cuda_moe_dedup_meta(ctx, ord, U, idx, w, k, El, P, tok, mid, mw, d->stream);
}

static loom_status cuda_moe_mask(loom_dev *d, loom_ctx *ctx, const int32_t *key, int64_t N, int k,
                                 int32_t none, int32_t *order, int32_t *pos) {
    return loom_cuda_moe_mask(ctx, key, N, k, none, order, pos, d->stream);
}

static loom_status cuda_moe_dedup_dw(loom_dev *d, loom_ctx *ctx, const float *dwb,
                                     const int32_t *pos, int64_t N, int P, int k, float *dw) {
    return loom_cuda_moe_dedup_dw(ctx, dwb, pos, N, P, k, dw, d->stream);
}

static loom_status cuda_moe_regroup(loom_dev *d, loom_ctx *ctx, const int32_t *rc, int64_t S,
                                    int64_t El, int64_t Rt, int32_t *ix) {
    return loom_cuda_moe_regroup(ctx, rc, S, El, Rt, ix, d->stream);
}

static loom_status cuda_moe_router_fwd(loom_dev *d, loom_ctx *ctx, const void *z, int64_t N,
                                       int64_t E, int k, bool norm_topk, float *probs, int32_t *idx,
                                       float *w, float *psum, float *lse) {
    loom_status st = moe_scratch(d, ctx, loom_cuda_moe_router_scratch_bytes(N, E, psum != NULL));
    if (st)
        return st;
    return loom_cuda_moe_router_fwd(ctx, z, d->adt, N, E, k, norm_topk, probs, idx, w, psum, lse,
                                    d->moe_scratch, d->moe_scratch_bytes, d->stream);
}

static loom_status cuda_moe_router_bwd(loom_dev *d, loom_ctx *ctx, const float *probs,
                                       const int32_t *idx, const float *dw, const float *ga,
                                       const float *lse, const float *zc, int64_t N, int64_t E,
                                       int k, bool norm_topk, void *dz) {
    return loom_cuda_moe_router_bwd(ctx, probs, idx, dw, ga, lse, zc, N, E, k, norm_topk, dz,
                                    d->adt, d->stream);
}

static loom_status cuda_moe_route(loom_dev *d, loom_ctx *ctx, const int32_t *idx, const float *w,
                                  int64_t N, int64_t E, int k, int64_t cap, bool by_position,
                                  int32_t *counts, int32_t *order, int32_t *pos) {
    const bool drop = cap >= 0 && cap < N;
    loom_status st = moe_scratch(d, ctx, loom_cuda_moe_route_scratch_bytes(N, E, k, drop));
    if (st)
        return st;
    return loom_cuda_moe_route(ctx, idx, w, N, E, k, cap, by_position, counts, order, pos,
                               d->moe_scratch, d->moe_scratch_bytes, d->stream);
}

static loom_status cuda_moe_permute(loom_dev *d, loom_ctx *ctx, const void *x, const int32_t *order,
                                    int64_t N, int k, int64_t H, void *xg) {
    return loom_cuda_moe_permute(ctx, x, order, N, k, H, xg, d->adt, d->stream);
}

static loom_status cuda_moe_combine(loom_dev *d, loom_ctx *ctx, const void *yg, const int32_t *pos,
                                    const float *w, int64_t N, int k, int64_t H, void *y) {
    return loom_cuda_moe_combine(ctx, yg, pos, w, N, k, H, y, d->adt, d->stream);
}

static loom_status cuda_moe_combine_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *yg,
                                        const int32_t *order, const float *w, int64_t N, int k,
                                        int64_t H, void *dyg, float *dw) {
    return loom_cuda_moe_combine_bwd(ctx, dy, yg, order, w, N, k, H, dyg, dw, d->adt, d->stream);
}

static loom_status cuda_moe_permute_bwd(loom_dev *d, loom_ctx *ctx, const void *dxg,
                                        const int32_t *pos, int64_t N, int k, int64_t H, void *dx) {
    return loom_cuda_moe_permute_bwd(ctx, dxg, pos, N, k, H, dx, d->adt, d->stream);
}

static loom_status cuda_moe_gate_fwd(loom_dev *d, loom_ctx *ctx, const void *z, const void *s,
                                     int64_t N, int64_t H, bool acc, float *g, void *y) {
    return loom_cuda_moe_gate_fwd(ctx, z, s, N, H, acc, g, y, d->adt, d->stream);
}

static loom_status cuda_moe_gate_bwd(loom_dev *d, loom_ctx *ctx, const void *da, const void *a,
                                     const float *g, int64_t N, int64_t I, void *dz) {
    return loom_cuda_moe_gate_bwd(ctx, da, a, g, N, I, dz, d->adt, d->stream);
}

/* one cuBLAS grouped call where it takes the dtypes, one cuBLASLt GEMM a
 * group else (loom_cuda_gemm_grouped) */
static loom_status cuda_gemm_grouped(loom_dev *d, loom_ctx *ctx, bool ta, bool tb, int G,
                                     const loom_gemm_group *g, float alpha, int64_t lda,
                                     int64_t ldb, loom_dtype ab, float beta, loom_dtype cdt,
                                     int64_t ldc) {
    return loom_cuda_gemm_grouped(ctx, d->gemm, ta, tb, G, g, alpha, lda, ldb, ab, beta, cdt, ldc,
                                  d->stream);
}

/* ---- Gated DeltaNet (ops_gdn.cu, ops_gdn_rule.cu; tests/test_backend_gdn.c),
 * on the model's stream, the workspace in d->gdn_scratch ---- */

/* d->gdn_scratch grown to `need` bytes (at the first call of a larger shape:
 * the rule's backward at a model's first step) */
static loom_status gdn_scratch(loom_dev *d, loom_ctx *ctx, size_t need) {
    if (need <= d->gdn_scratch_bytes)
        return LOOM_OK;
    loom_cuda_free(d->gdn_scratch);
    d->gdn_scratch = NULL;
    d->gdn_scratch_bytes = 0;
    loom_status st = loom_cuda_malloc(ctx, &d->gdn_scratch, need, "Gated DeltaNet workspace");
    if (!st)
        d->gdn_scratch_bytes = need;
    return st;
}

static loom_status cuda_gdn_conv_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                     int64_t T, int64_t C, int64_t K, const int32_t *cu,
                                     int64_t ndocs, void *y) {
    return loom_cuda_gdn_conv_fwd(ctx, x, w, d->adt, T, C, K, cu, ndocs, y, d->stream);
}

static loom_status cuda_gdn_conv_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                     const void *w, int64_t T, int64_t C, int64_t K,
                                     const int32_t *cu, int64_t ndocs, void *dx, float *dw) {
    loom_status st = dw ? gdn_scratch(d, ctx, loom_cuda_gdn_conv_scratch_bytes(T, C, K)) : LOOM_OK;
    return st ? st
              : loom_cuda_gdn_conv_bwd(ctx, dy, x, w, d->adt, T, C, K, cu, ndocs, dx, dw,
                                       d->gdn_scratch, d->stream);
}

static loom_status cuda_gdn_gate_fwd(loom_dev *d, loom_ctx *ctx, const void *a, const void *b,
                                     const void *A_log, const void *dt_bias, int64_t T, int64_t H,
                                     float *g, float *beta) {
    return loom_cuda_gdn_gate_fwd(ctx, a, b, A_log, dt_bias, d->adt, T, H, g, beta, d->stream);
}

static loom_status cuda_gdn_gate_bwd(loom_dev *d, loom_ctx *ctx, const float *dg,
                                     const float *dbeta, const void *a, const void *b,
                                     const void *A_log, const void *dt_bias, int64_t T, int64_t H,
                                     void *da, void *db, float *dA_log, float *ddt_bias) {
    loom_status st =
        dA_log || ddt_bias ? gdn_scratch(d, ctx, loom_cuda_gdn_gate_scratch_bytes(T, H)) : LOOM_OK;
    return st ? st
              : loom_cuda_gdn_gate_bwd(ctx, dg, dbeta, a, b, A_log, dt_bias, d->adt, T, H, da, db,
                                       dA_log, ddt_bias, d->gdn_scratch, d->stream);
}

static loom_status cuda_gdn_fwd(loom_dev *d, loom_ctx *ctx, const void *qkv, const float *g,
                                const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                                int64_t dv, const int32_t *cu, int64_t ndocs, void *o, void *keep,
                                int64_t keep_chunks) {
    const int64_t kc = keep ? keep_chunks : 0;
    loom_status st = gdn_scratch(
        d, ctx, loom_cuda_gdn_scratch_bytes(T, Hk, Hv, dk, dv, ndocs, false, d->adt, kc));
    return st ? st
              : loom_cuda_gdn_fwd(ctx, qkv, d->adt, g, beta, T, Hk, Hv, dk, dv, cu, ndocs, o,
                                  d->gdn_scratch, keep, kc, d->stream);
}

static loom_status cuda_gdn_bwd(loom_dev *d, loom_ctx *ctx, const void *dout, const void *qkv,
                                const float *g, const float *beta, int64_t T, int64_t Hk,
                                int64_t Hv, int64_t dk, int64_t dv, const int32_t *cu,
                                int64_t ndocs, void *dqkv, float *dg, float *dbeta,
                                const void *keep, int64_t keep_chunks) {
    const int64_t kc = keep ? keep_chunks : 0;
    loom_status st = gdn_scratch(
        d, ctx, loom_cuda_gdn_scratch_bytes(T, Hk, Hv, dk, dv, ndocs, true, d->adt, kc));
    return st ? st
              : loom_cuda_gdn_bwd(ctx, dout, qkv, d->adt, g, beta, T, Hk, Hv, dk, dv, cu, ndocs,
                                  dqkv, dg, dbeta, d->gdn_scratch, keep, kc, d->stream);
}

static loom_status cuda_gdn_norm_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *z,
                                     const void *w, int64_t N, int64_t D, float eps, void *y,
                                     float *rstd) {
    return loom_cuda_gdn_norm_fwd(ctx, x, z, w, d->adt, N, D, eps, y, rstd, d->stream);
}

static loom_status cuda_gdn_norm_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                     const void *z, const void *w, const float *rstd, int64_t N,
                                     int64_t D, void *dx, void *dz, float *dw) {
    loom_status st = dw ? gdn_scratch(d, ctx, loom_cuda_gdn_norm_scratch_bytes(N, D)) : LOOM_OK;
    return st ? st
              : loom_cuda_gdn_norm_bwd(ctx, dy, x, z, w, d->adt, rstd, N, D, dx, dz, dw,
                                       d->gdn_scratch, d->stream);
}

/* ---- the optimizer: the parts cut into chunks of at most LOOM_CUDA_CHUNK
 * elements once (the layout never changes), kept on the device ---- */

static int64_t n_chunks(const loom_k_part *p) {
    return (int64_t)((p->len + LOOM_CUDA_CHUNK - 1) / LOOM_CUDA_CHUNK);
}

/* h[*k..] = part p's chunks */
static void put_chunks(const loom_k_part *p, loom_cuda_chunk *h, int64_t *k) {
    for (size_t o = 0; o < p->len; o += LOOM_CUDA_CHUNK) {
        size_t len = p->len - o < LOOM_CUDA_CHUNK ? p->len - o : LOOM_CUDA_CHUNK;
        h[(*k)++] = (loom_cuda_chunk){.p_off = (int64_t)(p->p_off + o),
                                      .s_off = (int64_t)(p->s_off + o), .len = (int32_t)len,
                                      .decay = p->decay};
    }
}

/* *dst = a device copy of the n chunks at h (h freed) */
static loom_status upload_chunks(loom_dev *d, loom_ctx *ctx, loom_cuda_chunk *h, int64_t n,
                                 void **dst, const char *what) {
    loom_status st = cuda_alloc(d, ctx, dst, (size_t)(n + 1) * sizeof *h, what);
    if (!st) st = cuda_upload(d, ctx, *dst, h, (size_t)n * sizeof *h);
    free(h);
    if (st) {
        loom_cuda_free(*dst);
        *dst = NULL;
    }
    return st;
}

/* AdamW's chunks over all the parts, then the norm's over those in it */
static loom_status build_chunks(loom_dev *d, loom_ctx *ctx, const loom_k_part *parts, int n,
                                loom_part_lists *L) {
    int64_t na = 0, nn = 0, k = 0;
    for (int i = 0; i < n; i++) {
        na += n_chunks(&parts[i]);
        if (parts[i].norm) nn += n_chunks(&parts[i]);
    }
    loom_cuda_chunk *h = malloc((size_t)(na + nn + 1) * sizeof *h);
    if (!h) return loom_errf(ctx, LOOM_ERR_OOM, "no memory for the optimizer's chunk list");
    for (int i = 0; i < n; i++) put_chunks(&parts[i], h, &k);
    for (int i = 0; i < n; i++)
        if (parts[i].norm) put_chunks(&parts[i], h, &k);
    loom_status st = upload_chunks(d, ctx, h, na + nn, &L->chunks, "optimizer chunk list");
    if (!st) {
        loom_cuda_free(L->norm);
        L->norm = NULL;
        st = cuda_alloc(d, ctx, (void **)&L->norm, (size_t)(nn + 1) * sizeof(double),
                        "grad-norm chunks");
    }
    if (st) return st;
    L->n = na;
    L->n_norm = nn;
    return LOOM_OK;
}

static loom_status cuda_adamw(loom_dev *d, loom_ctx *ctx, float *w, const float *g, float *m,
                              float *v, const loom_k_part *parts, int n, const loom_adamw_hp *hp,
                              int64_t t, const float gs[2], void *wc, loom_part_lists *lists,
                              bool *wc_done) {
    *wc_done = false;
    loom_status st = lists->chunks ? LOOM_OK : build_chunks(d, ctx, parts, n, lists);
    if (st) return st;
    *wc_done = wc != NULL;
    return loom_cuda_adamw_chunks(ctx, w, g, m, v, (const loom_cuda_chunk *)lists->chunks,
                                  lists->n, hp, t, gs, wc, d->adt, d->stream);
}

static loom_status cuda_sumsq(loom_dev *d, loom_ctx *ctx, const float *g, const loom_k_part *parts,
                              int n, float s, loom_part_lists *lists, double *sum) {
    *sum = 0.0;
    loom_status st = lists->chunks ? LOOM_OK : build_chunks(d, ctx, parts, n, lists);
    if (st) return st;
    const loom_cuda_chunk *norm = (const loom_cuda_chunk *)lists->chunks + lists->n;
    if ((st = loom_cuda_sumsq_chunks(ctx, g, norm, lists->n_norm, s, lists->norm, d->stream)))
        return st;
    double *h = malloc((size_t)(lists->n_norm + 1) * sizeof *h);
    if (!h) return loom_errf(ctx, LOOM_ERR_OOM, "no memory for the grad-norm chunks");
    st = cuda_download(d, ctx, h, lists->norm, (size_t)lists->n_norm * sizeof *h);
    for (int64_t i = 0; !st && i < lists->n_norm; i++) *sum += h[i]; /* chunk order */
    free(h);
    return st;
}

static loom_status cuda_zero_parts(loom_dev *d, loom_ctx *ctx, float *g, const loom_k_part *parts,
                                   int n, loom_part_lists *lists) {
    if (!lists->chunks) { /* one launch over a list made at the first call */
        int64_t nc = 0, k = 0;
        for (int i = 0; i < n; i++) nc += n_chunks(&parts[i]);
        loom_cuda_chunk *h = malloc((size_t)(nc + 1) * sizeof *h);
        if (!h) return loom_errf(ctx, LOOM_ERR_OOM, "no memory for the gradients' chunk list");
        for (int i = 0; i < n; i++) put_chunks(&parts[i], h, &k);
        loom_status st = upload_chunks(d, ctx, h, nc, &lists->chunks, "gradient chunk list");
        if (st) return st;
        lists->n = nc;
    }
    return loom_cuda_zero_chunks(ctx, g, (const loom_cuda_chunk *)lists->chunks, lists->n,
                                 d->stream);
}

static void cuda_lists_free(loom_dev *d, loom_part_lists *lists) {
    (void)d;
    loom_cuda_free(lists->chunks);
    loom_cuda_free(lists->norm);
    memset(lists, 0, sizeof *lists);
}

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
        .copy2d = cuda_copy2d,
        .zero = cuda_zero,
        .download = cuda_download,
        .upload = cuda_upload,
        .convert = cuda_convert,
        .mark = cuda_mark,
        .marks_ms = cuda_marks_ms,
        .gate_fwd = cuda_gate_fwd,
        .gate_bwd = cuda_gate_bwd,
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
        .fill_randn = cuda_fill_randn,
        .rmsnorm_fwd = cuda_rmsnorm_fwd,
        .rmsnorm_bwd = cuda_rmsnorm_bwd,
        .add_rmsnorm_fwd = cuda_add_rmsnorm_fwd,
        .rmsnorm_bwd_add = cuda_rmsnorm_bwd_add,
        .dw_flush = cuda_dw_flush,
        .dw_drop = cuda_dw_drop,
        .gemm = cuda_gemm,
        .dx_sum = cuda_dx_sum,
        .lin_lora_fwd = cuda_lin_lora_fwd,
        .lora_dy_n = cuda_lora_dy_n,
        .rope = cuda_rope,
        .rope_table = cuda_rope_table,
        .qknorm_rope_fwd = cuda_qknorm_rope_fwd,
        .qknorm_rope_bwd = cuda_qknorm_rope_bwd,
        .attn_fwd = cuda_attn_fwd,
        .attn_bwd = cuda_attn_bwd,
        .attn_max_d = LOOM_CUDA_ATTN_MAX_D,
        .ce_max = cuda_ce_max,
        .ce_sums = cuda_ce_sums,
        .ce_grad = cuda_ce_grad,
        .rows_scale = cuda_rows_scale,
        .ce_fused = cuda_ce_fused,
        .moe_router_fwd = cuda_moe_router_fwd,
        .moe_router_bwd = cuda_moe_router_bwd,
        .moe_regroup = cuda_moe_regroup,
        .moe_dest = cuda_moe_dest,
        .moe_dedup_meta = cuda_moe_dedup_meta,
        .moe_mask = cuda_moe_mask,
        .moe_dedup_dw = cuda_moe_dedup_dw,
        .moe_route = cuda_moe_route,
        .moe_permute = cuda_moe_permute,
        .moe_combine = cuda_moe_combine,
        .moe_combine_bwd = cuda_moe_combine_bwd,
        .moe_permute_bwd = cuda_moe_permute_bwd,
        .moe_gate_fwd = cuda_moe_gate_fwd,
        .moe_gate_bwd = cuda_moe_gate_bwd,
        .gemm_grouped = cuda_gemm_grouped,
        .adamw = cuda_adamw,
        .sumsq = cuda_sumsq,
        .zero_parts = cuda_zero_parts,
        .lists_free = cuda_lists_free,
        .gdn_conv_fwd = cuda_gdn_conv_fwd,
        .gdn_conv_bwd = cuda_gdn_conv_bwd,
        .gdn_gate_fwd = cuda_gdn_gate_fwd,
        .gdn_gate_bwd = cuda_gdn_gate_bwd,
        .gdn_fwd = cuda_gdn_fwd,
        .gdn_bwd = cuda_gdn_bwd,
        .gdn_norm_fwd = cuda_gdn_norm_fwd,
        .gdn_norm_bwd = cuda_gdn_norm_bwd,
    };
    return &be;
}
#endif /* LOOM_HAVE_CUDA */
