/* kern.h: each op on the model's device, the CPU reference op or the CUDA
 * op. The CPU ops compute in fp32 (adt is F32 there). */
#include "kern.h"

#include <stdlib.h>
#include <string.h>

#include "../backend/gdn_ws.h"
#include "../comm/comm.h"
#include "model.h"

loom_status loom_dev_init(loom_model *m) {
    loom_dev *d = &m->dev;
    d->esz = loom_dtype_size(d->adt);
    /* the attention kernels asked for (checked on every device: a typo is
     * not ignored on the CPU either) */
    const char *a = getenv("LOOM_ATTN");
    if (a && *a && strcmp(a, "cudnn") != 0 && strcmp(a, "loom") != 0)
        return loom_errf(m->ctx, LOOM_ERR_INVALID_ARG,
                         "LOOM_ATTN=%s: the attention kernels are `cudnn` (the default) or `loom`",
                         a);
    /* LoRA's forward and the input gradients' sums in loom's GEMM, LoRA's pass
     * over dy on loom's kernel, unless cuBLASLt is asked for (to compare) */
    const char *lk = getenv("LOOM_LORA_KERNELS");
    if (lk && *lk && strcmp(lk, "loom") != 0 && strcmp(lk, "cublas") != 0)
        return loom_errf(
            m->ctx, LOOM_ERR_INVALID_ARG,
            "LOOM_LORA_KERNELS=%s: LoRA's kernels are `loom` (the default) or `cublas`", lk);
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

loom_status loom_k_settle(loom_model *m) {
    if (!m->comm_deferred) return LOOM_OK;
    m->comm_deferred = false;
    loom_status st = loom_comm_settle(m->mesh->ep);
    return st ? st : loom_comm_settle(m->mesh->etp);
}

loom_status loom_k_download(loom_model *m, void *host, const void *dev, size_t bytes) {
    if (host == dev || !bytes) return LOOM_OK;
    loom_status st = loom_k_settle(m);
    return st ? st : m->dev.be->download(&m->dev, m->ctx, host, dev, bytes);
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
    loom_status st = loom_k_settle(m);
    return st ? st : m->dev.be->upload(&m->dev, m->ctx, dev, host, bytes);
}

loom_status loom_k_convert(loom_model *m, void *dst, loom_dtype d, const void *src, loom_dtype s,
                           size_t n) {
    return m->dev.be->convert(&m->dev, m->ctx, dst, d, src, s, n);
}

/* ---- GEMMs ---- */

static loom_status gemm(loom_model *m, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                        float alpha, const void *A, int64_t lda, const void *B, int64_t ldb,
                        float beta, void *C, loom_dtype cdt, int64_t ldc) {
    return m->dev.be->gemm(&m->dev, m->ctx, ta, tb, M, N, K, alpha, A, lda, B, ldb, m->dev.adt,
                           beta, C, cdt, ldc);
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
    return m->dev.be->dx_sum(&m->dev, m->ctx, T, in, n, t, beta, dx);
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
    return m->dev.be->gemm(&m->dev, m->ctx, false, false, M, N, K, alpha, A, K, B, N, LOOM_F32,
                           beta, C, LOOM_F32, N);
}

loom_status loom_k_gemm_c(loom_model *m, int64_t M, int64_t N, int64_t K, float alpha,
                          const void *A, const void *B, float beta, void *C) {
    return gemm(m, false, false, M, N, K, alpha, A, K, B, N, beta, C, m->dev.adt, N);
}

/* ---- LoRA's forward inside the base GEMM, its backward over dy ---- */

loom_status loom_k_lin_lora_fwd(loom_model *m, const void *x, int64_t T, int64_t in, const void *W,
                                int64_t out, const void *u, int64_t ldu, const void *B, int64_t r,
                                float s, void *y, bool *done) {
    return m->dev.be->lin_lora_fwd(&m->dev, m->ctx, x, T, in, W, out, u, ldu, B, r, s, y, done);
}

loom_status loom_k_lora_dy_n(loom_model *m, int64_t T, int64_t r, float s, int n,
                             const loom_lora_dy_op *ops, int64_t ldu, int64_t lddu) {
    return m->dev.be->lora_dy_n(&m->dev, m->ctx, T, r, s, n, ops, ldu, lddu);
}

loom_status loom_k_lora_dy(loom_model *m, int64_t T, int64_t out, int64_t r, float s,
                           const void *dy, const void *B, const void *u, int64_t ldu, void *du,
                           int64_t lddu, float *dB) {
    const loom_lora_dy_op o = {out, dy, B, u, du, dB};
    return loom_k_lora_dy_n(m, T, r, s, 1, &o, ldu, lddu);
}

/* ---- transformer ops ---- */

loom_status loom_k_rmsnorm_fwd(loom_model *m, const void *x, const void *w, int64_t N, int64_t H,
                               float eps, void *y, float *rstd) {
    return m->dev.be->rmsnorm_fwd(&m->dev, m->ctx, x, w, m->norm_off, N, H, eps, y, rstd);
}

loom_status loom_k_dw_flush(loom_model *m) { return m->dev.be->dw_flush(&m->dev, m->ctx); }

void loom_k_dw_drop(loom_model *m) { m->dev.be->dw_drop(&m->dev); }

loom_status loom_k_rmsnorm_bwd(loom_model *m, const void *dy, const void *x, const void *w,
                               const float *rstd, int64_t N, int64_t H, void *dx, float *dw) {
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)H, NULL));
    return m->dev.be->rmsnorm_bwd(&m->dev, m->ctx, dy, x, w, m->norm_off, rstd, N, H, dx, dw);
}

loom_status loom_k_add_rmsnorm_fwd(loom_model *m, void *x, const void *res, void *xsum,
                                   const void *w, int64_t N, int64_t H, float eps, void *y,
                                   float *rstd) {
    return m->dev.be->add_rmsnorm_fwd(&m->dev, m->ctx, x, res, xsum, w, m->norm_off, N, H, eps, y,
                                      rstd);
}

loom_status loom_k_rmsnorm_bwd_add(loom_model *m, void *dy, const void *x, const void *w,
                                   const float *rstd, int64_t N, int64_t H, void *dx, float *dw) {
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)H, NULL));
    return m->dev.be->rmsnorm_bwd_add(&m->dev, m->ctx, dy, x, w, m->norm_off, rstd, N, H, dx, dw);
}

loom_status loom_k_qknorm_rope_fwd(loom_model *m, const loom_micro *mb, const void *x,
                                   const void *w, int64_t nh, float eps, void *y, float *rstd) {
    return m->dev.be->qknorm_rope_fwd(&m->dev, m->ctx, x, w, m->norm_off, m->Tc, nh, m->D, m->rd, eps, mb->d_pos,
                                      m->d_inv_freq, mb->d_rope, y, rstd);
}

loom_status loom_k_qknorm_rope_bwd(loom_model *m, const loom_micro *mb, void *dy, const void *x,
                                   const void *w, const float *rstd, int64_t nh, float *dw) {
    if (dw)
        CK(loom_grad_prepare(m, dw, (size_t)m->D, NULL));
    return m->dev.be->qknorm_rope_bwd(&m->dev, m->ctx, dy, x, w, m->norm_off, rstd, m->Tc, nh, m->D, m->rd,
                                      mb->d_pos, m->d_inv_freq, mb->d_rope, dw);
}

loom_status loom_k_rope_table(loom_model *m, loom_micro *mb) {
    return m->dev.be->rope_table(&m->dev, m->ctx, mb->d_pos, m->Tc, m->D, m->d_inv_freq,
                                 mb->d_rope);
}

loom_status loom_k_rope(loom_model *m, bool backward, void *x, int64_t T, int64_t nh,
                        const int32_t *pos) {
    return m->dev.be->rope(&m->dev, m->ctx, backward, x, T, nh, m->D, m->rd, pos, m->d_inv_freq);
}

loom_status loom_k_attn_fwd(loom_model *m, const void *q, const int32_t *qidx, int64_t Tq,
                            const void *k, const void *v, int64_t T, int64_t Hq, int64_t Hkv,
                            const int32_t *cu, int64_t ndocs, int64_t seqlen, void *out,
                            float *lse) {
    return m->dev.be->attn_fwd(&m->dev, m->ctx, q, qidx, Tq, k, v, T, Hq, Hkv, m->D, cu, ndocs,
                               seqlen, m->attn_scale, out, lse);
}

loom_status loom_k_attn_bwd(loom_model *m, const void *dout, const void *q, const int32_t *qidx,
                            int64_t Tq, const void *k, const void *v, const void *out,
                            const float *lse, int64_t T, int64_t Hq, int64_t Hkv,
                            const int32_t *cu, int64_t ndocs, int64_t seqlen, void *dq, void *dk,
                            void *dv) {
    return m->dev.be->attn_bwd(&m->dev, m->ctx, dout, q, qidx, Tq, k, v, out, lse, T, Hq, Hkv,
                               m->D, cu, ndocs, seqlen, m->attn_scale, dq, dk, dv);
}

loom_status loom_k_gate_fwd(loom_model *m, const void *o, const void *g, int64_t n, void *y) {
    return m->dev.be->gate_fwd(&m->dev, m->ctx, o, g, n, y);
}

loom_status loom_k_gate_bwd(loom_model *m, const void *dy, const void *o, const void *g,
                            int64_t n, void *dout, void *dg) {
    return m->dev.be->gate_bwd(&m->dev, m->ctx, dy, o, g, n, dout, dg);
}

loom_status loom_k_copy2d(loom_model *m, void *dst, size_t ldd, const void *src, size_t lds,
                          size_t width, size_t rows) {
    if (!width || !rows) return LOOM_OK;
    return m->dev.be->copy2d(&m->dev, m->ctx, dst, ldd, src, lds, width, rows);
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
    return m->dev.be->ce_max(&m->dev, m->ctx, z, c, ld, nvalid, mx);
}

loom_status loom_k_ce_sums(loom_model *m, const void *z, int64_t c, int64_t ld, int64_t nvalid,
                           const int32_t *tgt, int64_t v0, const double *mx, double *ce) {
    return m->dev.be->ce_sums(&m->dev, m->ctx, z, c, ld, nvalid, tgt, v0, mx, ce);
}

loom_status loom_k_ce_grad(loom_model *m, void *z, int64_t c, int64_t ld, int64_t nvalid,
                           const int32_t *tgt, int64_t v0, const double *mx, const double *ce,
                           float scale) {
    return m->dev.be->ce_grad(&m->dev, m->ctx, z, c, ld, nvalid, tgt, v0, mx, ce, scale);
}

loom_status loom_k_rows_scale(loom_model *m, void *z, int64_t c, int64_t ld, const float *w) {
    return m->dev.be->rows_scale(&m->dev, m->ctx, z, c, ld, w);
}

loom_status loom_k_ce_fused(loom_model *m, void *z, int64_t c, int64_t ld, int64_t nvalid,
                            const int32_t *tgt, int64_t v0, double *mx, double *ce, float scale,
                            bool grad) {
    return m->dev.be->ce_fused(&m->dev, m->ctx, z, c, ld, nvalid, tgt, v0, mx, ce, scale, grad);
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

loom_status loom_k_fill_randn(loom_model *m, void *x, int64_t n, uint64_t base) {
    return m->dev.be->fill_randn(&m->dev, m->ctx, x, n, base);
}

/* ---- the optimizer over parts ---- */

loom_status loom_k_adamw_parts(loom_model *m, struct loom_arena *A, const loom_k_part *parts,
                               int n, const loom_adamw_hp *hp, int64_t t, const float gs[2],
                               bool wc_too, bool *wc_done) {
    void *wc = wc_too && A->wc && A->wc != (void *)A->w ? A->wc : NULL;
    return m->dev.be->adamw(&m->dev, m->ctx, A->w, A->gshard, A->adam_m, A->adam_v, parts, n, hp,
                            t, gs, wc, &A->lists, wc_done);
}

loom_status loom_k_sumsq_parts(loom_model *m, struct loom_arena *A, const loom_k_part *parts,
                               int n, float s, double *sum) {
    return m->dev.be->sumsq(&m->dev, m->ctx, A->gshard, parts, n, s, &A->lists, sum);
}

loom_status loom_k_zero_eager(loom_model *m, struct loom_arena *A) {
    if (!A->zparts) { /* the slots, once: the marks and the layout change only with a reset */
        loom_k_part *p = malloc((size_t)(A->nslots + 1) * sizeof *p);
        if (!p) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for the gradients' slot list");
        int n = 0;
        for (int i = 0; i < A->nslots; i++)
            if (!A->gdefer[i] && !A->slots[i].frozen)
                p[n++] = (loom_k_part){.p_off = A->slots[i].off, .s_off = A->slots[i].off,
                                       .len = A->slots[i].numel};
        A->zparts = p;
        A->nzparts = n;
    }
    return m->dev.be->zero_parts(&m->dev, m->ctx, A->g, A->zparts, A->nzparts, &A->zlists);
}

void loom_k_lists_free(loom_model *m, struct loom_arena *A, bool zero_list) {
    if (zero_list) {
        free(A->zparts);
        A->zparts = NULL;
        A->nzparts = 0;
    } else { /* the optimizer's parts go with their backend copy */
        free(A->parts);
        A->parts = NULL;
        A->nparts = 0;
    }
    if (m->dev.be) m->dev.be->lists_free(&m->dev, zero_list ? &A->zlists : &A->lists);
}

/* ---- mixture of experts ---- */

loom_status loom_k_moe_dest(loom_model *m, const int32_t *idx, int64_t N, int k, int64_t El, int P,
                            int32_t *dest) {
    return m->dev.be->moe_dest(&m->dev, m->ctx, idx, N, k, El, P, dest);
}

loom_status loom_k_moe_dedup_meta(loom_model *m, const int32_t *ord, int64_t U, const int32_t *idx,
                                  const float *w, int k, int64_t El, int P, int32_t *tok,
                                  int32_t *mid, float *mw) {
    return m->dev.be->moe_dedup_meta(&m->dev, m->ctx, ord, U, idx, w, k, El, P, tok, mid, mw);
}

loom_status loom_k_moe_mask(loom_model *m, const int32_t *key, int64_t N, int k, int32_t none,
                            int32_t *order, int32_t *pos) {
    return m->dev.be->moe_mask(&m->dev, m->ctx, key, N, k, none, order, pos);
}

loom_status loom_k_moe_dedup_dw(loom_model *m, const float *dwb, const int32_t *pos, int64_t N,
                                int P, int k, float *dw) {
    return m->dev.be->moe_dedup_dw(&m->dev, m->ctx, dwb, pos, N, P, k, dw);
}

loom_status loom_k_moe_regroup(loom_model *m, const int32_t *rc, int64_t S, int64_t El,
                               int64_t Rt, int32_t *ix) {
    return m->dev.be->moe_regroup(&m->dev, m->ctx, rc, S, El, Rt, ix);
}

loom_status loom_k_moe_router_fwd(loom_model *m, const void *z, int64_t N, int64_t E, int k,
                                  bool norm_topk, float *probs, int32_t *idx, float *w, float *psum,
                                  float *lse) {
    return m->dev.be->moe_router_fwd(&m->dev, m->ctx, z, N, E, k, norm_topk, probs, idx, w, psum,
                                     lse);
}

loom_status loom_k_moe_router_bwd(loom_model *m, const float *probs, const int32_t *idx,
                                  const float *dw, const float *ga, const float *lse,
                                  const float *zc, int64_t N, int64_t E, int k, bool norm_topk,
                                  void *dz) {
    return m->dev.be->moe_router_bwd(&m->dev, m->ctx, probs, idx, dw, ga, lse, zc, N, E, k,
                                     norm_topk, dz);
}

loom_status loom_k_moe_route(loom_model *m, const int32_t *idx, const float *w, int64_t N,
                             int64_t E, int k, int64_t cap, bool by_position, int32_t *counts,
                             int32_t *order, int32_t *pos) {
    return m->dev.be->moe_route(&m->dev, m->ctx, idx, w, N, E, k, cap, by_position, counts, order,
                                pos);
}

loom_status loom_k_moe_permute(loom_model *m, const void *x, const int32_t *order, int64_t N,
                               int k, int64_t H, void *xg) {
    return m->dev.be->moe_permute(&m->dev, m->ctx, x, order, N, k, H, xg);
}

loom_status loom_k_moe_combine(loom_model *m, const void *yg, const int32_t *pos, const float *w,
                               int64_t N, int k, int64_t H, void *y) {
    return m->dev.be->moe_combine(&m->dev, m->ctx, yg, pos, w, N, k, H, y);
}

loom_status loom_k_moe_combine_bwd(loom_model *m, const void *dy, const void *yg,
                                   const int32_t *order, const float *w, int64_t N, int k,
                                   int64_t H, void *dyg, float *dw) {
    return m->dev.be->moe_combine_bwd(&m->dev, m->ctx, dy, yg, order, w, N, k, H, dyg, dw);
}

loom_status loom_k_moe_permute_bwd(loom_model *m, const void *dxg, const int32_t *pos, int64_t N,
                                   int k, int64_t H, void *dx) {
    return m->dev.be->moe_permute_bwd(&m->dev, m->ctx, dxg, pos, N, k, H, dx);
}

loom_status loom_k_moe_gate_fwd(loom_model *m, const void *z, const void *s, int64_t N, int64_t H,
                                bool acc, float *g, void *y) {
    return m->dev.be->moe_gate_fwd(&m->dev, m->ctx, z, s, N, H, acc, g, y);
}

loom_status loom_k_moe_gate_bwd(loom_model *m, const void *da, const void *a, const float *g,
                                int64_t N, int64_t I, void *dz) {
    return m->dev.be->moe_gate_bwd(&m->dev, m->ctx, da, a, g, N, I, dz);
}

loom_status loom_k_gemm_grouped(loom_model *m, bool ta, bool tb, int G, const loom_gemm_group *g,
                                float alpha, int64_t lda, int64_t ldb, float beta, bool c_f32,
                                int64_t ldc) {
    return m->dev.be->gemm_grouped(&m->dev, m->ctx, ta, tb, G, g, alpha, lda, ldb, m->dev.adt, beta,
                                   c_f32 ? LOOM_F32 : m->dev.adt, ldc);
}

/* ---- Gated DeltaNet ---- */

/* The backend's op, or the error of a backend that has none yet. */
#define GDN_OP(m, op)                                                                              \
    do {                                                                                           \
        if (!(m)->dev.be->op)                                                                      \
            return loom_errf((m)->ctx, LOOM_ERR_UNSUPPORTED,                                       \
                             "Gated DeltaNet ops are not on the %s backend yet (%s)",              \
                             (m)->dev.cuda ? "CUDA" : (m)->dev.be->name, #op);                     \
    } while (0)

loom_status loom_k_gdn_conv_fwd(loom_model *m, const void *x, const void *w, int64_t T, int64_t C,
                                int64_t K, const int32_t *cu, int64_t ndocs, void *y) {
    GDN_OP(m, gdn_conv_fwd);
    return m->dev.be->gdn_conv_fwd(&m->dev, m->ctx, x, w, T, C, K, cu, ndocs, y);
}

loom_status loom_k_gdn_conv_bwd(loom_model *m, const void *dy, const void *x, const void *w,
                                int64_t T, int64_t C, int64_t K, const int32_t *cu, int64_t ndocs,
                                void *dx, float *dw) {
    GDN_OP(m, gdn_conv_bwd);
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)(C * K), NULL));
    return m->dev.be->gdn_conv_bwd(&m->dev, m->ctx, dy, x, w, T, C, K, cu, ndocs, dx, dw);
}

loom_status loom_k_gdn_gate_fwd(loom_model *m, const void *a, const void *b, const void *A_log,
                                const void *dt_bias, int64_t T, int64_t H, float *g, float *beta) {
    GDN_OP(m, gdn_gate_fwd);
    return m->dev.be->gdn_gate_fwd(&m->dev, m->ctx, a, b, A_log, dt_bias, T, H, g, beta);
}

loom_status loom_k_gdn_gate_bwd(loom_model *m, const float *dg, const float *dbeta, const void *a,
                                const void *b, const void *A_log, const void *dt_bias, int64_t T,
                                int64_t H, void *da, void *db, float *dA_log, float *ddt_bias) {
    GDN_OP(m, gdn_gate_bwd);
    if (dA_log) CK(loom_grad_prepare(m, dA_log, (size_t)H, NULL));
    if (ddt_bias) CK(loom_grad_prepare(m, ddt_bias, (size_t)H, NULL));
    return m->dev.be->gdn_gate_bwd(&m->dev, m->ctx, dg, dbeta, a, b, A_log, dt_bias, T, H, da, db,
                                   dA_log, ddt_bias);
}

/* The keep buffer where it has room for the documents' chunks, else none
 * (the backward recomputes). */
static void *gdn_keep(void *keep, int64_t keep_chunks, int64_t T, int64_t ndocs) {
    return loom_gdn_keep_fits(T, ndocs, keep_chunks) ? keep : NULL;
}

loom_status loom_k_gdn_fwd(loom_model *m, const void *qkv, const float *g, const float *beta,
                           int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                           const int32_t *cu, int64_t ndocs, void *o, void *keep,
                           int64_t keep_chunks) {
    GDN_OP(m, gdn_fwd);
    return m->dev.be->gdn_fwd(&m->dev, m->ctx, qkv, g, beta, T, Hk, Hv, dk, dv, cu, ndocs, o,
                              gdn_keep(keep, keep_chunks, T, ndocs), keep_chunks);
}

loom_status loom_k_gdn_bwd(loom_model *m, const void *dout, const void *qkv, const float *g,
                           const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                           int64_t dv, const int32_t *cu, int64_t ndocs, void *dqkv, float *dg,
                           float *dbeta, const void *keep, int64_t keep_chunks) {
    GDN_OP(m, gdn_bwd);
    return m->dev.be->gdn_bwd(&m->dev, m->ctx, dout, qkv, g, beta, T, Hk, Hv, dk, dv, cu, ndocs,
                              dqkv, dg, dbeta, gdn_keep((void *)keep, keep_chunks, T, ndocs),
                              keep_chunks);
}

loom_status loom_k_gdn_norm_fwd(loom_model *m, const void *x, const void *z, const void *w,
                                int64_t N, int64_t D, float eps, void *y, float *rstd) {
    GDN_OP(m, gdn_norm_fwd);
    return m->dev.be->gdn_norm_fwd(&m->dev, m->ctx, x, z, w, N, D, eps, y, rstd);
}

loom_status loom_k_gdn_norm_bwd(loom_model *m, const void *dy, const void *x, const void *z,
                                const void *w, const float *rstd, int64_t N, int64_t D, void *dx,
                                void *dz, float *dw) {
    GDN_OP(m, gdn_norm_bwd);
    if (dw) CK(loom_grad_prepare(m, dw, (size_t)D, NULL));
    return m->dev.be->gdn_norm_bwd(&m->dev, m->ctx, dy, x, z, w, rstd, N, D, dx, dz, dw);
}
