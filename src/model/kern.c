/* kern.h: each op on the model's device, the CPU reference op or the CUDA
 * op. The CPU ops compute in fp32 (adt is F32 there). */
#include "kern.h"

#include <stdlib.h>
#include <string.h>

#include "../backend/cpu/cpu_glue.h"
#include "../backend/cpu/cpu_ops.h"
#include "model.h"
#ifdef LOOM_HAVE_CUDA
#include "../backend/cuda/cuda_backend.h"
#include "../backend/cuda/cuda_glue.h"
#include "../backend/cuda/cuda_ops.h"
#define GPU(m) ((m)->dev.cuda)
#else
#define GPU(m) false
#endif

#define F(p) ((float *)(p))
#define CF(p) ((const float *)(p))

loom_status loom_dev_init(loom_model *m) {
    loom_dev *d = &m->dev;
    d->esz = loom_dtype_size(d->adt);
    /* the attention kernels asked for (checked on every device: a typo is
     * not ignored on the CPU either) */
    const char *a = getenv("LOOM_ATTN");
    if (a && *a && strcmp(a, "cudnn") != 0 && strcmp(a, "loom") != 0)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "LOOM_ATTN=%s: the attention kernels are `cudnn` (the default) or `loom`", a);
    /* LoRA's forward and the input gradients' sums in loom's GEMM, LoRA's pass
     * over dy on loom's kernel, unless cuBLASLt is asked for (to compare) */
    const char *lk = getenv("LOOM_LORA_KERNELS");
    if (lk && *lk && strcmp(lk, "loom") != 0 && strcmp(lk, "cublas") != 0)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "LOOM_LORA_KERNELS=%s: LoRA's kernels are `loom` (the default) or `cublas`",
                         lk);
    d->lora_cublas = lk && strcmp(lk, "cublas") == 0;
    if (!(d->be = loom_backend_for(m->ctx, d->cuda))) return LOOM_ERR_UNSUPPORTED;
    return d->be->init(d, m->ctx);
}

void loom_dev_attn_note(const loom_model *m, char *buf, size_t n) {
    m->dev.be->attn_note(&m->dev, buf, n);
}

void loom_dev_release(loom_model *m) {
    if (m->dev.be) m->dev.be->release(&m->dev);
}

loom_status loom_dev_alloc(loom_model *m, void **p, size_t bytes, const char *what) {
    *p = NULL;
    return m->dev.be->alloc(&m->dev, m->ctx, p, bytes, what);
}

void loom_dev_free(loom_model *m, void *p) {
    if (p) m->dev.be->free(&m->dev, p);
}

loom_status loom_k_host_alloc(loom_model *m, void **p, size_t bytes, bool *pinned,
                              const char *what) {
    *p = NULL;
    *pinned = false;
    return m->dev.be->host_alloc(&m->dev, m->ctx, p, bytes, pinned, what);
}

void loom_k_host_free(void *p, bool pinned) { loom_backend_host_free(p, pinned); }

loom_status loom_k_copy(loom_model *m, void *dst, const void *src, size_t bytes) {
    if (dst == src || !bytes) return LOOM_OK;
    return m->dev.be->copy(&m->dev, m->ctx, dst, src, bytes);
}

loom_status loom_k_zero(loom_model *m, void *p, size_t bytes) {
    if (!bytes) return LOOM_OK;
    return m->dev.be->zero(&m->dev, m->ctx, p, bytes);
}

loom_status loom_k_download(loom_model *m, void *host, const void *dev, size_t bytes) {
    if (host == dev || !bytes) return LOOM_OK;
    return m->dev.be->download(&m->dev, m->ctx, host, dev, bytes);
}

loom_status loom_k_download_f32(loom_model *m, float *host, const void *dev, size_t n) {
    loom_status st = loom_k_download(m, host, dev, n * m->dev.esz);
    if (st || m->dev.adt == LOOM_F32) return st;
    /* element j (2 bytes at 2j) lands at 4j: from the back, nothing unread
     * is overwritten */
    const uint16_t *h = (const uint16_t *)host;
    for (size_t j = n; j-- > 0;)
        host[j] = m->dev.adt == LOOM_BF16 ? loom_bf16_to_f32(h[j]) : loom_f16_to_f32(h[j]);
    return LOOM_OK;
}

loom_status loom_k_upload(loom_model *m, void *dev, const void *host, size_t bytes) {
    if (host == dev || !bytes) return LOOM_OK;
    return m->dev.be->upload(&m->dev, m->ctx, dev, host, bytes);
}

loom_status loom_k_convert(loom_model *m, void *dst, loom_dtype d, const void *src, loom_dtype s,
                           size_t n) {
    return m->dev.be->convert(&m->dev, m->ctx, dst, d, src, s, n);
}

/* ---- GEMMs ---- */

static loom_status gemm(loom_model *m, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                        float alpha, const void *A, int64_t lda, const void *B, int64_t ldb,
                        float beta, void *C, loom_dtype cdt, int64_t ldc) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m))
        return loom_cuda_gemm(m->ctx, m->dev.gemm, ta, tb, M, N, K, alpha, A, m->dev.adt, lda, B,
                              m->dev.adt, ldb, beta, C, cdt, ldc, m->dev.stream);
#endif
    (void)cdt;
    loom_cpu_sgemm(ta, tb, M, N, K, alpha, CF(A), lda, CF(B), ldb, beta, F(C), ldc);
    return LOOM_OK;
}

loom_status loom_k_gemm_ld(loom_model *m, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                           float alpha, const void *A, int64_t lda, const void *B, int64_t ldb,
                           float beta, void *C, bool c_f32, int64_t ldc) {
    return gemm(m, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, c_f32 ? LOOM_F32 : m->dev.adt,
                ldc);
}

loom_status loom_k_lin_fwd(loom_model *m, const void *x, int64_t T, int64_t in, const void *W,
                           int64_t out, float alpha, float beta, void *y) {
    return gemm(m, false, true, T, out, in, alpha, x, in, W, in, beta, y, m->dev.adt, out);
}

loom_status loom_k_lin_dx(loom_model *m, const void *dy, int64_t T, int64_t out, const void *W,
                          int64_t in, float alpha, float beta, void *dx) {
    return gemm(m, false, false, T, in, out, alpha, dy, out, W, in, beta, dx, m->dev.adt, in);
}

loom_status loom_k_lin_dx_sum(loom_model *m, int64_t T, int64_t in, int n, const loom_dx_term *t,
                              float beta, void *dx) {
    int done = 0;
#ifdef LOOM_HAVE_CUDA
    if (GPU(m) && !m->dev.lora_cublas && beta == 0.0f && n > 1) {
        const void *a[4], *b[4];
        int64_t lda[4], K[4];
        const int k = n < 4 ? n : 4;
        for (int i = 0; i < k; i++) a[i] = t[i].dy, lda[i] = t[i].ld, K[i] = t[i].out, b[i] = t[i].W;
        if (loom_cuda_gemm_dx_ok(m->dev.adt, T, in, k, a, lda, K, b, dx) &&
            loom_cuda_gemm_wave_fill(T, in) >= 0.9) {
            CK(loom_cuda_gemm_dx(m->ctx, T, in, k, a, lda, K, b, dx, m->dev.stream));
            done = k;
            beta = 1.0f;
        }
    }
#endif
    for (int i = done; i < n; i++) {
        CK(gemm(m, false, false, T, in, t[i].out, 1.0f, t[i].dy, t[i].ld, t[i].W, in, beta, dx,
                m->dev.adt, in));
        beta = 1.0f;
    }
    return LOOM_OK;
}

loom_status loom_k_lin_dw(loom_model *m, const void *dy, const void *x, int64_t T, int64_t out,
                          int64_t in, float alpha, float *dW) {
    if (!dW) return LOOM_OK;
    float beta;
    CK(loom_grad_prepare(m, dW, (size_t)(out * in), &beta));
    return gemm(m, true, false, out, in, T, alpha, dy, out, x, in, beta, dW, LOOM_F32, in);
}

loom_status loom_k_sgemm(loom_model *m, int64_t M, int64_t N, int64_t K, float alpha,
                         const float *A, const float *B, float beta, float *C) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m))
        return loom_cuda_gemm(m->ctx, m->dev.gemm, false, false, M, N, K, alpha, A, LOOM_F32, K, B,
                              LOOM_F32, N, beta, C, LOOM_F32, N, m->dev.stream);
#endif
    loom_cpu_sgemm(false, false, M, N, K, alpha, A, K, B, N, beta, C, N);
    return LOOM_OK;
}

loom_status loom_k_gemm_c(loom_model *m, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                          const void *B, float beta, void *C) {
    return gemm(m, false, false, M, N, K, alpha, A, K, B, N, beta, C, m->dev.adt, N);
}

/* ---- LoRA's forward inside the base GEMM ---- */

loom_status loom_k_lin_lora_fwd(loom_model *m, const void *x, int64_t T, int64_t in, const void *W,
                                int64_t out, const void *u, int64_t ldu, const void *B, int64_t r,
                                float s, void *y, bool *done) {
    *done = false;
#ifdef LOOM_HAVE_CUDA
    if (GPU(m) && !m->dev.lora_cublas &&
        loom_cuda_gemm_lora_ok(m->dev.adt, T, out, in, x, W, u, ldu, B, r, y)) {
        *done = true;
        return loom_cuda_gemm_lora(m->ctx, T, out, in, x, W, u, ldu, B, r, s, y, m->dev.stream);
    }
#else
    (void)m, (void)x, (void)T, (void)in, (void)W, (void)out, (void)u, (void)ldu, (void)B, (void)r,
        (void)s, (void)y;
#endif
    return LOOM_OK;
}

/* ---- LoRA's backward over dy ---- */

loom_status loom_k_lora_dy_n(loom_model *m, int64_t T, int64_t r, float s, int n,
                             const loom_lora_dy_op *ops, int64_t ldu, int64_t lddu) {
#ifdef LOOM_HAVE_CUDA
    bool kernel = GPU(m) && !m->dev.lora_cublas && n >= 1 && n <= 3;
    loom_cuda_pass_op po[3];
    for (int i = 0; kernel && i < n; i++) {
        const loom_lora_dy_op *o = &ops[i];
        kernel = loom_cuda_lora_pass_ok(m->dev.adt, T, o->out, r, o->dy, o->out, o->B, false, r, o->du,
                                        lddu, o->u, ldu, false, r);
        po[i] = (loom_cuda_pass_op){T, o->out, r, o->dy, o->out, o->B, false, r, s,
                                    o->du, lddu, o->u, ldu, s, o->dB, false, r};
    }
    if (kernel) {
        const size_t need = loom_cuda_lora_pass_n_scratch_bytes(n, po);
        if (need > m->dev.lora_scratch_bytes) { /* grown at the first call of a larger shape */
            loom_cuda_free(m->dev.lora_scratch);
            m->dev.lora_scratch = NULL;
            m->dev.lora_scratch_bytes = 0;
            CK(loom_cuda_malloc(m->ctx, &m->dev.lora_scratch, need, "LoRA backward scratch"));
            m->dev.lora_scratch_bytes = need;
        }
        return loom_cuda_lora_pass_n(m->ctx, n, po, m->dev.adt, m->dev.lora_scratch,
                                     m->dev.lora_scratch_bytes, m->dev.stream);
    }
#endif
    for (int i = 0; i < n; i++) {
        const loom_lora_dy_op *o = &ops[i];
        CK(gemm(m, false, false, T, r, o->out, s, o->dy, o->out, o->B, r, 0.0f, o->du, m->dev.adt, lddu));
        CK(gemm(m, true, false, o->out, r, T, s, o->dy, o->out, o->u, ldu, 1.0f, o->dB, LOOM_F32, r));
    }
    return LOOM_OK;
}

loom_status loom_k_lora_dy(loom_model *m, int64_t T, int64_t out, int64_t r, float s, const void *dy,
                           const void *B, const void *u, int64_t ldu, void *du, int64_t lddu,
                           float *dB) {
    const loom_lora_dy_op o = {out, dy, B, u, du, dB};
    return loom_k_lora_dy_n(m, T, r, s, 1, &o, ldu, lddu);
}

/* ---- transformer ops ---- */

loom_status loom_k_rmsnorm_fwd(loom_model *m, const void *x, const void *w, int64_t N, int64_t H,
                               float eps, void *y, float *rstd) {
    return m->dev.be->rmsnorm_fwd(&m->dev, m->ctx, x, w, N, H, eps, y, rstd);
}

loom_status loom_k_dw_flush(loom_model *m) { return m->dev.be->dw_flush(&m->dev, m->ctx); }

void loom_k_dw_drop(loom_model *m) { m->dev.be->dw_drop(&m->dev); }

loom_status loom_k_rmsnorm_bwd(loom_model *m, const void *dy, const void *x, const void *w,
                               const float *rstd, int64_t N, int64_t H, void *dx, float *dw) {
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)H, NULL));
    return m->dev.be->rmsnorm_bwd(&m->dev, m->ctx, dy, x, w, rstd, N, H, dx, dw);
}

loom_status loom_k_add_rmsnorm_fwd(loom_model *m, void *x, const void *res, void *xsum,
                                   const void *w, int64_t N, int64_t H, float eps, void *y,
                                   float *rstd) {
    return m->dev.be->add_rmsnorm_fwd(&m->dev, m->ctx, x, res, xsum, w, N, H, eps, y, rstd);
}

loom_status loom_k_rmsnorm_bwd_add(loom_model *m, void *dy, const void *x, const void *w,
                                   const float *rstd, int64_t N, int64_t H, void *dx, float *dw) {
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)H, NULL));
    return m->dev.be->rmsnorm_bwd_add(&m->dev, m->ctx, dy, x, w, rstd, N, H, dx, dw);
}

#ifdef LOOM_HAVE_CUDA
static bool qk_fused(const loom_model *m, const loom_micro *mb) {
    return GPU(m) && mb->d_rope && loom_cuda_qknorm_rope_ok(m->dev.adt, m->D);
}
#endif

loom_status loom_k_qknorm_rope_fwd(loom_model *m, const loom_micro *mb, const void *x,
                                   const void *w, int64_t nh, float eps, void *y, float *rstd) {
#ifdef LOOM_HAVE_CUDA
    if (qk_fused(m, mb))
        return loom_cuda_qknorm_rope_fwd(m->ctx, x, m->dev.adt, w, m->dev.adt, m->Tc * nh, nh, m->D,
                                         eps, mb->d_rope, y, rstd, m->dev.stream);
#endif
    CK(loom_k_rmsnorm_fwd(m, x, w, m->Tc * nh, m->D, eps, y, rstd));
    return loom_k_rope(m, false, y, m->Tc, nh, mb->d_pos);
}

loom_status loom_k_qknorm_rope_bwd(loom_model *m, const loom_micro *mb, void *dy, const void *x,
                                   const void *w, const float *rstd, int64_t nh, float *dw) {
    const int64_t N = m->Tc * nh;
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)m->D, NULL));
#ifdef LOOM_HAVE_CUDA
    if (qk_fused(m, mb)) {
        void *scr;
        loom_cuda_dw_batch *b;
        CK(loom_cuda_dev_dw_scratch(&m->dev, m->ctx, N, m->D, dw, &scr, &b));
        return loom_cuda_qknorm_rope_bwd(m->ctx, dy, x, m->dev.adt, w, m->dev.adt, rstd, N, nh, m->D,
                                         mb->d_rope, dy, dw, scr, b, m->dev.stream);
    }
#endif
    CK(loom_k_rope(m, true, dy, m->Tc, nh, mb->d_pos));
    return loom_k_rmsnorm_bwd(m, dy, x, w, rstd, N, m->D, dy, dw);
}

loom_status loom_k_rope_table(loom_model *m, loom_micro *mb) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m) && mb->d_rope)
        return loom_cuda_rope_table(m->ctx, mb->d_pos, m->Tc, m->D, m->d_inv_freq, mb->d_rope,
                                    m->dev.stream);
#endif
    (void)m, (void)mb;
    return LOOM_OK;
}

loom_status loom_k_rope(loom_model *m, bool backward, void *x, int64_t T, int64_t nh,
                        const int32_t *pos) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m))
        return (backward ? loom_cuda_rope_bwd : loom_cuda_rope_fwd)(
            m->ctx, x, m->dev.adt, T, nh, m->D, pos, m->d_inv_freq, m->dev.stream);
#endif
    (backward ? loom_cpu_rope_bwd : loom_cpu_rope_fwd)(F(x), T, nh, m->D, pos, m->inv_freq);
    return LOOM_OK;
}

loom_status loom_k_attn_fwd(loom_model *m, const void *q, const int32_t *qidx, int64_t Tq,
                            const void *k, const void *v, int64_t T, int64_t Hq, int64_t Hkv,
                            const int32_t *cu, int64_t ndocs, int64_t seqlen, void *out, float *lse) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m)) {
        bool taken = false;
        m->dev.attn_calls[0]++;
        if (!qidx && m->dev.attn) {
            loom_status st = loom_cuda_attention_cudnn_fwd(m->ctx, m->dev.attn, q, k, v, m->dev.adt,
                                                           T, Hq, Hkv, m->D, cu, ndocs, seqlen,
                                                           m->attn_scale, out, lse, m->dev.stream,
                                                           &taken);
            if (st || taken) return st;
        }
        return loom_cuda_attention_fwd_q(m->ctx, q, qidx, Tq, k, v, m->dev.adt, T, Hq, Hkv, m->D,
                                         cu, ndocs, m->attn_scale, out, lse, m->dev.stream);
    }
#endif
    (void)seqlen;
    loom_cpu_attention_fwd_q(CF(q), qidx, Tq, CF(k), CF(v), T, Hq, Hkv, m->D, cu, ndocs,
                             m->attn_scale, F(out), lse);
    return LOOM_OK;
}

loom_status loom_k_attn_bwd(loom_model *m, const void *dout, const void *q, const int32_t *qidx,
                            int64_t Tq, const void *k, const void *v, const void *out,
                            const float *lse, int64_t T, int64_t Hq, int64_t Hkv,
                            const int32_t *cu, int64_t ndocs, int64_t seqlen, void *dq, void *dk,
                            void *dv) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m)) {
        bool taken = false;
        m->dev.attn_calls[1]++;
        if (!qidx && m->dev.attn) {
            loom_status st = loom_cuda_attention_cudnn_bwd(
                m->ctx, m->dev.attn, dout, q, k, v, out, lse, m->dev.adt, T, Hq, Hkv, m->D, cu, ndocs,
                seqlen, m->attn_scale, dq, dk, dv, m->dev.stream, &taken);
            if (st || taken) return st;
        }
        return loom_cuda_attention_bwd_q(m->ctx, dout, q, qidx, Tq, k, v, out, lse, m->dev.adt, T,
                                         Hq, Hkv, m->D, cu, ndocs, m->attn_scale, dq, dk, dv,
                                         m->dev.stream);
    }
#endif
    (void)seqlen;
    loom_cpu_attention_bwd_q(CF(dout), CF(q), qidx, Tq, CF(k), CF(v), CF(out), lse, T, Hq, Hkv,
                             m->D, cu, ndocs, m->attn_scale, F(dq), F(dk), F(dv));
    return LOOM_OK;
}

loom_status loom_k_swiglu_fwd(loom_model *m, const void *g, const void *u, int64_t n, void *h) {
    return m->dev.be->swiglu_fwd(&m->dev, m->ctx, g, u, n, h);
}

loom_status loom_k_swiglu_bwd(loom_model *m, const void *dh, const void *g, const void *u,
                              int64_t n, void *dg, void *du) {
    return m->dev.be->swiglu_bwd(&m->dev, m->ctx, dh, g, u, n, dg, du);
}

loom_status loom_k_add(loom_model *m, void *y, const void *x, int64_t n) {
    return m->dev.be->add(&m->dev, m->ctx, y, x, n);
}

loom_status loom_k_bias_fwd(loom_model *m, void *y, const void *b, int64_t T, int64_t N) {
    return m->dev.be->bias_fwd(&m->dev, m->ctx, y, b, T, N);
}

loom_status loom_k_bias_bwd(loom_model *m, const void *dy, int64_t T, int64_t N, float *db) {
    if (!db) return LOOM_OK;
    CK(loom_grad_prepare(m, db, (size_t)N, NULL));
    return m->dev.be->bias_bwd(&m->dev, m->ctx, dy, T, N, db);
}

/* ---- vocabulary-parallel embedding and loss ---- */

loom_status loom_k_embed_fwd(loom_model *m, const int32_t *ids, int64_t T, const void *W,
                             int64_t row0, int64_t rows, void *out) {
    return m->dev.be->embed_fwd(&m->dev, m->ctx, ids, T, W, row0, rows, m->H, out);
}

loom_status loom_k_embed_bwd(loom_model *m, const int32_t *ids, int64_t T, const void *dout,
                             int64_t row0, int64_t rows, float *dW) {
    if (!dW) return LOOM_OK;
    CK(loom_grad_prepare(m, dW, (size_t)(rows * m->H), NULL));
    return m->dev.be->embed_bwd(&m->dev, m->ctx, ids, T, dout, row0, rows, m->H, dW);
}

loom_status loom_k_ce_max(loom_model *m, const void *z, int64_t c, int64_t ld, int64_t nvalid,
                          double *mx) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m)) return loom_cuda_ce_vp_max(m->ctx, z, m->dev.adt, c, ld, nvalid, mx, m->dev.stream);
#endif
    loom_cpu_ce_vp_max(CF(z), c, ld, nvalid, mx);
    return LOOM_OK;
}

loom_status loom_k_ce_sums(loom_model *m, const void *z, int64_t c, int64_t ld, int64_t nvalid,
                           const int32_t *tgt, int64_t v0, const double *mx, double *ce) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m))
        return loom_cuda_ce_vp_sums(m->ctx, z, m->dev.adt, c, ld, nvalid, tgt, v0, mx, ce,
                                    m->dev.stream);
#endif
    loom_cpu_ce_vp_sums(CF(z), c, ld, nvalid, tgt, v0, mx, ce);
    return LOOM_OK;
}

loom_status loom_k_ce_grad(loom_model *m, void *z, int64_t c, int64_t ld, int64_t nvalid,
                           const int32_t *tgt, int64_t v0, const double *mx, const double *ce,
                           float scale) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m))
        return loom_cuda_ce_vp_grad(m->ctx, z, m->dev.adt, c, ld, nvalid, tgt, v0, mx, ce, scale,
                                    m->dev.stream);
#endif
    loom_cpu_ce_vp_grad(F(z), c, ld, nvalid, tgt, v0, mx, ce, scale);
    return LOOM_OK;
}

loom_status loom_k_ce_fused(loom_model *m, void *z, int64_t c, int64_t ld, int64_t nvalid,
                            const int32_t *tgt, int64_t v0, double *mx, double *ce, float scale,
                            bool grad) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m))
        return loom_cuda_ce_vp_fused(m->ctx, z, m->dev.adt, c, ld, nvalid, tgt, v0, mx, ce, scale,
                                     grad, m->dev.stream);
#endif
    CK(loom_k_ce_max(m, z, c, ld, nvalid, mx));
    CK(loom_k_ce_sums(m, z, c, ld, nvalid, tgt, v0, mx, ce));
    return grad ? loom_k_ce_grad(m, z, c, ld, nvalid, tgt, v0, mx, ce, scale) : LOOM_OK;
}

/* ---- permutations, dropout ---- */

loom_status loom_k_rows_gather(loom_model *m, void *dst, const void *src, const int32_t *idx,
                               int64_t n, int64_t w) {
    return m->dev.be->rows_gather(&m->dev, m->ctx, dst, src, idx, n, w);
}

loom_status loom_k_rows_scatter(loom_model *m, void *dst, const void *src, const int32_t *idx,
                                int64_t n, int64_t w) {
    return m->dev.be->rows_scatter(&m->dev, m->ctx, dst, src, idx, n, w);
}

loom_status loom_k_dropout(loom_model *m, void *out, const void *x, int64_t T, int64_t in,
                           int64_t full, int64_t col0, const int32_t *qidx, int64_t out0,
                           uint64_t seed, uint64_t key, double p) {
    return m->dev.be->dropout(&m->dev, m->ctx, out, x, T, in, full, col0, qidx, out0, seed, key, p);
}

/* ---- optimizer ---- */

/* ---- the optimizer over parts ---- */

#ifdef LOOM_HAVE_CUDA
/* Cuts the parts into chunks of at most LOOM_CUDA_CHUNK elements: all of
 * them for AdamW, then those in the norm; uploads both lists once. */
static loom_status build_chunks(loom_model *m, loom_arena *A, const loom_k_part *parts, int n) {
    int64_t na = 0, nn = 0;
    for (int i = 0; i < n; i++) {
        int64_t c = (int64_t)((parts[i].len + LOOM_CUDA_CHUNK - 1) / LOOM_CUDA_CHUNK);
        na += c;
        if (parts[i].norm) nn += c;
    }
    loom_cuda_chunk *h = malloc((size_t)(na + nn + 1) * sizeof *h);
    if (!h) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the optimizer's chunk list");
    int64_t k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++) {
            if (pass && !parts[i].norm) continue;
            for (size_t o = 0; o < parts[i].len; o += LOOM_CUDA_CHUNK) {
                size_t len = parts[i].len - o < LOOM_CUDA_CHUNK ? parts[i].len - o : LOOM_CUDA_CHUNK;
                h[k++] = (loom_cuda_chunk){.p_off = (int64_t)(parts[i].p_off + o),
                                           .s_off = (int64_t)(parts[i].s_off + o),
                                           .len = (int32_t)len, .decay = parts[i].decay};
            }
        }
    loom_status st = loom_dev_alloc(m, &A->d_chunks, (size_t)(na + nn + 1) * sizeof *h,
                                    "optimizer chunk list");
    if (!st) st = loom_k_upload(m, A->d_chunks, h, (size_t)(na + nn) * sizeof *h);
    if (!st) {
        loom_dev_free(m, A->d_norm);
        A->d_norm = NULL;
        st = loom_dev_alloc(m, (void **)&A->d_norm, (size_t)(nn + 1) * sizeof(double),
                            "grad-norm chunks");
    }
    free(h);
    if (st) return st;
    A->n_adam = na;
    A->n_norm = nn;
    return LOOM_OK;
}
#endif

loom_status loom_k_adamw_parts(loom_model *m, struct loom_arena *A, const loom_k_part *parts,
                               int n, const loom_adamw_hp *hp, int64_t t, const float gs[2],
                               bool wc_too, bool *wc_done) {
    *wc_done = false;
#ifdef LOOM_HAVE_CUDA
    if (GPU(m)) {
        loom_status st = A->d_chunks ? LOOM_OK : build_chunks(m, A, parts, n);
        if (st) return st;
        void *wc = wc_too && A->wc && A->wc != (void *)A->w ? A->wc : NULL;
        *wc_done = wc != NULL;
        return loom_cuda_adamw_chunks(m->ctx, A->w, A->gshard, A->adam_m, A->adam_v,
                                      (const loom_cuda_chunk *)A->d_chunks, A->n_adam, hp, t, gs,
                                      wc, m->dev.adt, m->dev.stream);
    }
#endif
    (void)wc_too;
    for (int i = 0; i < n; i++)
        loom_adamw_step_scaled(A->w + parts[i].p_off, A->gshard + parts[i].s_off,
                               A->adam_m + parts[i].s_off, A->adam_v + parts[i].s_off,
                               parts[i].len, hp, t, parts[i].decay, gs);
    return LOOM_OK;
}

loom_status loom_k_sumsq_parts(loom_model *m, struct loom_arena *A, const loom_k_part *parts,
                               int n, float s, double *sum) {
    *sum = 0.0;
#ifdef LOOM_HAVE_CUDA
    if (GPU(m)) {
        loom_status st = A->d_chunks ? LOOM_OK : build_chunks(m, A, parts, n);
        if (st) return st;
        const loom_cuda_chunk *norm = (const loom_cuda_chunk *)A->d_chunks + A->n_adam;
        if ((st = loom_cuda_sumsq_chunks(m->ctx, A->gshard, norm, A->n_norm, s, A->d_norm,
                                         m->dev.stream)))
            return st;
        double *h = malloc((size_t)(A->n_norm + 1) * sizeof *h);
        if (!h) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the grad-norm chunks");
        st = loom_k_download(m, h, A->d_norm, (size_t)A->n_norm * sizeof *h);
        for (int64_t i = 0; !st && i < A->n_norm; i++) *sum += h[i]; /* chunk order */
        free(h);
        return st;
    }
#endif
    for (int i = 0; i < n; i++)
        if (parts[i].norm) *sum += loom_sumsq_scaled(A->gshard + parts[i].s_off, parts[i].len, s);
    return LOOM_OK;
}

loom_status loom_k_zero_eager(loom_model *m, struct loom_arena *A) {
#ifdef LOOM_HAVE_CUDA
    if (GPU(m)) {
        if (!A->d_gzero) { /* the slots' chunks, once: the layout never changes */
            int64_t n = 0;
            for (int i = 0; i < A->nslots; i++)
                if (!A->gdefer[i] && !A->slots[i].frozen)
                    n += (int64_t)((A->slots[i].numel + LOOM_CUDA_CHUNK - 1) / LOOM_CUDA_CHUNK);
            loom_cuda_chunk *h = malloc((size_t)(n + 1) * sizeof *h);
            if (!h) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the gradients' chunk list");
            int64_t k = 0;
            for (int i = 0; i < A->nslots; i++)
                for (size_t o = 0; !A->gdefer[i] && !A->slots[i].frozen && o < A->slots[i].numel;
                     o += LOOM_CUDA_CHUNK) {
                    const size_t left = A->slots[i].numel - o;
                    h[k++] = (loom_cuda_chunk){.s_off = (int64_t)(A->slots[i].off + o),
                                               .len = (int32_t)(left < LOOM_CUDA_CHUNK ? left
                                                                                       : LOOM_CUDA_CHUNK)};
                }
            loom_status st = loom_dev_alloc(m, &A->d_gzero, (size_t)(n + 1) * sizeof *h,
                                            "gradient chunk list");
            if (!st) st = loom_k_upload(m, A->d_gzero, h, (size_t)n * sizeof *h);
            free(h);
            if (st) {
                loom_dev_free(m, A->d_gzero);
                A->d_gzero = NULL;
                return st;
            }
            A->n_gzero = n;
        }
        return loom_cuda_zero_chunks(m->ctx, A->g, (const loom_cuda_chunk *)A->d_gzero, A->n_gzero,
                                     m->dev.stream);
    }
#endif
    for (int i = 0; i < A->nslots; i++)
        if (!A->gdefer[i] && !A->slots[i].frozen)
            memset(A->g + A->slots[i].off, 0, A->slots[i].numel * sizeof(float));
    return LOOM_OK;
}
