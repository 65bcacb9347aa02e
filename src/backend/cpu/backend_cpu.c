/* The CPU backend's table (backend.h): host memory is the device's. */
#include <stdlib.h>
#include <string.h>

#include "../../core/core.h"
#include "../../core/rng.h"
#include "../backend.h"
#include "cpu_gdn.h"
#include "cpu_glue.h"
#include "cpu_moe.h"
#include "cpu_ops.h"

#define F(p) ((float *)(p))
#define CF(p) ((const float *)(p))

static loom_status cpu_init(loom_dev *d, loom_ctx *ctx) {
    (void)ctx;
    d->device = -1;
    return LOOM_OK;
}

static void cpu_release(loom_dev *d) {
    free(d->marks);
    d->marks = NULL;
}

/* The timeline's marks: the host's clock (the CPU's ops are done when they
 * return). */
static loom_status cpu_mark(loom_dev *d, loom_ctx *ctx, int i) {
    if (i < 0 || i >= LOOM_MARKS_MAX)
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "timeline mark %d out of range", i);
    if (!d->marks && !(d->marks = loom_calloc(ctx, LOOM_MARKS_MAX, sizeof(double), "timeline")))
        return LOOM_ERR_OOM;
    ((double *)d->marks)[i] = loom_now_s();
    return LOOM_OK;
}

static loom_status cpu_marks_ms(loom_dev *d, loom_ctx *ctx, int n, double *ms) {
    if (n < 1 || n > LOOM_MARKS_MAX || !d->marks)
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "timeline read of %d marks", n);
    const double *t = d->marks;
    for (int i = 0; i + 1 < n; i++) ms[i] = 1e3 * (t[i + 1] - t[i]);
    return LOOM_OK;
}

static void cpu_attn_note(const loom_dev *d, char *buf, size_t n) {
    (void)d;
    snprintf(buf, n, "loom's attention kernels");
}

static loom_status cpu_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                             const char *what) {
    (void)d;
    *p = loom_calloc(ctx, bytes ? bytes : 1, 1, what);
    return *p ? LOOM_OK : LOOM_ERR_OOM;
}

static void cpu_free(loom_dev *d, void *p) {
    (void)d;
    free(p);
}

static loom_status cpu_host_alloc(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes,
                                  bool *pinned, const char *what) {
    (void)d;
    *pinned = false;
    *p = loom_malloc(ctx, bytes ? bytes : 1, what);
    return *p ? LOOM_OK : LOOM_ERR_OOM;
}

static loom_status cpu_copy(loom_dev *d, loom_ctx *ctx, void *dst, const void *src, size_t bytes) {
    (void)d, (void)ctx;
    memmove(dst, src, bytes);
    return LOOM_OK;
}

static loom_status cpu_copy2d(loom_dev *d, loom_ctx *ctx, void *dst, size_t ldd, const void *src,
                              size_t lds, size_t width, size_t rows) {
    (void)d, (void)ctx;
    for (size_t r = 0; r < rows; r++)
        memcpy((char *)dst + r * ldd, (const char *)src + r * lds, width);
    return LOOM_OK;
}

static loom_status cpu_zero(loom_dev *d, loom_ctx *ctx, void *p, size_t bytes) {
    (void)d, (void)ctx;
    memset(p, 0, bytes);
    return LOOM_OK;
}

static loom_status cpu_convert(loom_dev *d, loom_ctx *ctx, void *dst, loom_dtype dt,
                               const void *src, loom_dtype sdt, size_t n) {
    (void)d;
    if (dst == src && dt == sdt) return LOOM_OK;
    return loom_convert(ctx, dst, dt, src, sdt, n);
}

/* ---- element-wise: the CPU computes in fp32 ---- */

static loom_status cpu_gate_fwd(loom_dev *d, loom_ctx *ctx, const void *o, const void *g,
                                int64_t n, void *y) {
    (void)d, (void)ctx;
    loom_cpu_gate_fwd(CF(o), CF(g), n, F(y));
    return LOOM_OK;
}

static loom_status cpu_gate_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *o,
                                const void *g, int64_t n, void *do_, void *dg) {
    (void)d, (void)ctx;
    loom_cpu_gate_bwd(CF(dy), CF(o), CF(g), n, F(do_), F(dg));
    return LOOM_OK;
}

static loom_status cpu_swiglu_fwd(loom_dev *d, loom_ctx *ctx, const void *g, const void *u,
                                  int64_t n, void *h) {
    (void)d, (void)ctx;
    loom_cpu_swiglu_fwd(CF(g), CF(u), n, F(h));
    return LOOM_OK;
}

static loom_status cpu_swiglu_bwd(loom_dev *d, loom_ctx *ctx, const void *dh, const void *g,
                                  const void *u, int64_t n, void *dg, void *du) {
    (void)d, (void)ctx;
    loom_cpu_swiglu_bwd(CF(dh), CF(g), CF(u), n, F(dg), F(du));
    return LOOM_OK;
}

static loom_status cpu_add(loom_dev *d, loom_ctx *ctx, void *y, const void *x, int64_t n) {
    (void)d, (void)ctx;
    loom_cpu_residual_add(F(y), CF(x), n);
    return LOOM_OK;
}

static loom_status cpu_bias_fwd(loom_dev *d, loom_ctx *ctx, void *y, const void *b, int64_t T,
                                int64_t N) {
    (void)d, (void)ctx;
    loom_cpu_add_bias_fwd(F(y), CF(b), T, N);
    return LOOM_OK;
}

static loom_status cpu_bias_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, int64_t T, int64_t N,
                                float *db) {
    (void)d, (void)ctx;
    loom_cpu_add_bias_bwd(CF(dy), T, N, db);
    return LOOM_OK;
}

static loom_status cpu_embed_fwd(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                                 const void *W, int64_t row0, int64_t rows, int64_t H, void *out) {
    (void)d, (void)ctx;
    loom_cpu_embedding_vp_fwd(ids, T, CF(W), row0, rows, H, F(out));
    return LOOM_OK;
}

static loom_status cpu_embed_bwd(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                                 const void *dout, int64_t row0, int64_t rows, int64_t H,
                                 float *dW) {
    (void)d, (void)ctx;
    loom_cpu_embedding_vp_bwd(ids, T, CF(dout), row0, rows, H, dW);
    return LOOM_OK;
}

static loom_status cpu_rows_gather(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                   const int32_t *idx, int64_t n, int64_t width) {
    (void)ctx;
    loom_cpu_rows_gather(dst, src, idx, n, width, d->esz);
    return LOOM_OK;
}

static loom_status cpu_rows_scatter(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                    const int32_t *idx, int64_t n, int64_t width) {
    (void)ctx;
    loom_cpu_rows_scatter(dst, src, idx, n, width, d->esz);
    return LOOM_OK;
}

static loom_status cpu_dropout(loom_dev *d, loom_ctx *ctx, void *out, const void *x, int64_t T,
                               int64_t in, int64_t full, int64_t col0, const int32_t *qidx,
                               int64_t out0, uint64_t seed, uint64_t key, double p) {
    (void)d, (void)ctx;
    loom_cpu_lora_dropout(F(out), CF(x), T, in, full, col0, qidx, out0, seed, key, p);
    return LOOM_OK;
}

static loom_status cpu_fill_randn(loom_dev *d, loom_ctx *ctx, void *x, int64_t n,
                                  uint64_t base) {
    (void)d, (void)ctx;
    for (int64_t i = 0; i < n; i++) F(x)[i] = loom_rng_gauss4_at(base, (uint64_t)i);
    return LOOM_OK;
}

/* ---- RMSNorm ---- */

static loom_status cpu_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                   float woff, int64_t N, int64_t H, float eps, void *y,
                                   float *rstd) {
    (void)d, (void)ctx;
    loom_cpu_rmsnorm_fwd(CF(x), CF(w), woff, N, H, eps, F(y), rstd);
    return LOOM_OK;
}

static loom_status cpu_rmsnorm_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                   const void *w, float woff, const float *rstd, int64_t N,
                                   int64_t H, void *dx, float *dw) {
    (void)d, (void)ctx;
    loom_cpu_rmsnorm_bwd(CF(dy), CF(x), CF(w), woff, rstd, N, H, F(dx), dw);
    return LOOM_OK;
}

static loom_status cpu_add_rmsnorm_fwd(loom_dev *d, loom_ctx *ctx, void *x, const void *res,
                                       void *xsum, const void *w, float woff, int64_t N, int64_t H,
                                       float eps, void *y, float *rstd) {
    if (xsum != x) memmove(xsum, x, (size_t)(N * H) * sizeof(float));
    loom_cpu_residual_add(F(xsum), CF(res), N * H);
    return cpu_rmsnorm_fwd(d, ctx, xsum, w, woff, N, H, eps, y, rstd);
}

static loom_status cpu_rmsnorm_bwd_add(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                       const void *w, float woff, const float *rstd, int64_t N,
                                       int64_t H, void *dx, float *dw) {
    loom_status st = cpu_rmsnorm_bwd(d, ctx, dy, x, w, woff, rstd, N, H, dy, dw);
    if (!st) loom_cpu_residual_add(F(dx), CF(dy), N * H);
    return st;
}

static loom_status cpu_dw_flush(loom_dev *d, loom_ctx *ctx) {
    (void)d, (void)ctx;
    return LOOM_OK;
}

static void cpu_dw_drop(loom_dev *d) { (void)d; }

/* ---- GEMMs: fp32 only (the CPU's compute dtype) ---- */

static loom_status cpu_gemm(loom_dev *d, loom_ctx *ctx, bool ta, bool tb, int64_t M, int64_t N,
                            int64_t K, float alpha, const void *A, int64_t lda, const void *B,
                            int64_t ldb, loom_dtype ab, float beta, void *C, loom_dtype cdt,
                            int64_t ldc) {
    (void)d, (void)ctx, (void)ab, (void)cdt;
    loom_cpu_sgemm(ta, tb, M, N, K, alpha, CF(A), lda, CF(B), ldb, beta, F(C), ldc);
    return LOOM_OK;
}

static loom_status cpu_dx_sum(loom_dev *d, loom_ctx *ctx, int64_t T, int64_t in, int n,
                              const loom_dx_term *t, float beta, void *dx) {
    for (int i = 0; i < n; i++, beta = 1.0f)
        cpu_gemm(d, ctx, false, false, T, in, t[i].out, 1.0f, t[i].dy, t[i].ld, t[i].W, in,
                 LOOM_F32, beta, dx, LOOM_F32, in);
    return LOOM_OK;
}

static loom_status cpu_lin_lora_fwd(loom_dev *d, loom_ctx *ctx, const void *x, int64_t T,
                                    int64_t in, const void *W, int64_t out, const void *u,
                                    int64_t ldu, const void *B, int64_t r, float s, void *y,
                                    bool *done) {
    (void)d, (void)ctx, (void)x, (void)T, (void)in, (void)W, (void)out, (void)u, (void)ldu,
        (void)B, (void)r, (void)s, (void)y;
    *done = false; /* no fused kernel: the caller runs the two GEMMs */
    return LOOM_OK;
}

static loom_status cpu_lora_dy_n(loom_dev *d, loom_ctx *ctx, int64_t T, int64_t r, float s, int n,
                                 const loom_lora_dy_op *ops, int64_t ldu, int64_t lddu) {
    for (int i = 0; i < n; i++) {
        const loom_lora_dy_op *o = &ops[i];
        cpu_gemm(d, ctx, false, false, T, r, o->out, s, o->dy, o->out, o->B, r, LOOM_F32, 0.0f,
                 o->du, LOOM_F32, lddu);
        cpu_gemm(d, ctx, true, false, o->out, r, T, s, o->dy, o->out, o->u, ldu, LOOM_F32, 1.0f,
                 o->dB, LOOM_F32, r);
    }
    return LOOM_OK;
}

/* ---- RoPE and attention ---- */

static loom_status cpu_rope(loom_dev *d, loom_ctx *ctx, bool backward, void *x, int64_t T,
                            int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                            const float *inv_freq) {
    (void)d, (void)ctx;
    (backward ? loom_cpu_rope_bwd : loom_cpu_rope_fwd)(F(x), T, nh, D, rd, pos, inv_freq);
    return LOOM_OK;
}

static loom_status cpu_rope_table(loom_dev *d, loom_ctx *ctx, const int32_t *pos, int64_t T,
                                  int64_t D, const float *inv_freq, float *table) {
    (void)d, (void)ctx, (void)pos, (void)T, (void)D, (void)inv_freq, (void)table;
    return LOOM_OK; /* the CPU's RoPE computes its angles itself */
}

static loom_status cpu_qknorm_rope_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                       float woff, int64_t T, int64_t nh, int64_t D, int64_t rd,
                                       float eps, const int32_t *pos, const float *inv_freq,
                                       const float *table, void *y, float *rstd) {
    (void)table;
    cpu_rmsnorm_fwd(d, ctx, x, w, woff, T * nh, D, eps, y, rstd);
    return cpu_rope(d, ctx, false, y, T, nh, D, rd, pos, inv_freq);
}

static loom_status cpu_qknorm_rope_bwd(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                       const void *w, float woff, const float *rstd, int64_t T,
                                       int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                                       const float *inv_freq, const float *table, float *dw) {
    (void)table;
    cpu_rope(d, ctx, true, dy, T, nh, D, rd, pos, inv_freq);
    return cpu_rmsnorm_bwd(d, ctx, dy, x, w, woff, rstd, T * nh, D, dy, dw);
}

static loom_status cpu_attn_fwd(loom_dev *d, loom_ctx *ctx, const void *q, const int32_t *qidx,
                                int64_t Tq, const void *k, const void *v, int64_t T, int64_t Hq,
                                int64_t Hkv, int64_t D, const int32_t *cu, int64_t ndocs,
                                int64_t seqlen, float scale, void *out, float *lse) {
    (void)d, (void)ctx, (void)seqlen;
    loom_cpu_attention_fwd_q(CF(q), qidx, Tq, CF(k), CF(v), T, Hq, Hkv, D, cu, ndocs, scale,
                             F(out), lse);
    return LOOM_OK;
}

static loom_status cpu_attn_bwd(loom_dev *d, loom_ctx *ctx, const void *dout, const void *q,
                                const int32_t *qidx, int64_t Tq, const void *k, const void *v,
                                const void *out, const float *lse, int64_t T, int64_t Hq,
                                int64_t Hkv, int64_t D, const int32_t *cu, int64_t ndocs,
                                int64_t seqlen, float scale, void *dq, void *dk, void *dv) {
    (void)d, (void)ctx, (void)seqlen;
    loom_cpu_attention_bwd_q(CF(dout), CF(q), qidx, Tq, CF(k), CF(v), CF(out), lse, T, Hq, Hkv,
                             D, cu, ndocs, scale, F(dq), F(dk), F(dv));
    return LOOM_OK;
}

/* ---- the vocabulary-parallel cross-entropy ---- */

static loom_status cpu_ce_max(loom_dev *d, loom_ctx *ctx, const void *z, int64_t c, int64_t ld,
                              int64_t nvalid, double *mx) {
    (void)d, (void)ctx;
    loom_cpu_ce_vp_max(CF(z), c, ld, nvalid, mx);
    return LOOM_OK;
}

static loom_status cpu_ce_sums(loom_dev *d, loom_ctx *ctx, const void *z, int64_t c, int64_t ld,
                               int64_t nvalid, const int32_t *tgt, int64_t v0, const double *mx,
                               double *ce) {
    (void)d, (void)ctx;
    loom_cpu_ce_vp_sums(CF(z), c, ld, nvalid, tgt, v0, mx, ce);
    return LOOM_OK;
}

static loom_status cpu_ce_grad(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                               int64_t nvalid, const int32_t *tgt, int64_t v0, const double *mx,
                               const double *ce, float scale) {
    (void)d, (void)ctx;
    loom_cpu_ce_vp_grad(F(z), c, ld, nvalid, tgt, v0, mx, ce, scale);
    return LOOM_OK;
}

static loom_status cpu_rows_scale(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                                  const float *w) {
    (void)d, (void)ctx;
    loom_cpu_rows_scale(F(z), c, ld, w);
    return LOOM_OK;
}

static loom_status cpu_ce_fused(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                                int64_t nvalid, const int32_t *tgt, int64_t v0, double *mx,
                                double *ce, float scale, bool grad) {
    cpu_ce_max(d, ctx, z, c, ld, nvalid, mx);
    cpu_ce_sums(d, ctx, z, c, ld, nvalid, tgt, v0, mx, ce);
    return grad ? cpu_ce_grad(d, ctx, z, c, ld, nvalid, tgt, v0, mx, ce, scale) : LOOM_OK;
}

/* ---- the optimizer: part by part (adamw.h) ---- */

static loom_status cpu_adamw(loom_dev *d, loom_ctx *ctx, float *w, const float *g, float *m,
                             float *v, const loom_k_part *parts, int n, const loom_adamw_hp *hp,
                             int64_t t, const float gs[2], void *wc, loom_part_lists *lists,
                             bool *wc_done) {
    (void)d, (void)ctx, (void)wc, (void)lists;
    *wc_done = false;
    for (int i = 0; i < n; i++)
        loom_adamw_step_scaled(w + parts[i].p_off, g + parts[i].s_off, m + parts[i].s_off,
                               v + parts[i].s_off, parts[i].len, hp, t, parts[i].decay, gs);
    return LOOM_OK;
}

static loom_status cpu_sumsq(loom_dev *d, loom_ctx *ctx, const float *g, const loom_k_part *parts,
                             int n, float s, loom_part_lists *lists, double *sum) {
    (void)d, (void)ctx, (void)lists;
    *sum = 0.0;
    for (int i = 0; i < n; i++)
        if (parts[i].norm) *sum += loom_sumsq_scaled(g + parts[i].s_off, parts[i].len, s);
    return LOOM_OK;
}

static loom_status cpu_zero_parts(loom_dev *d, loom_ctx *ctx, float *g, const loom_k_part *parts,
                                  int n, loom_part_lists *lists) {
    (void)d, (void)ctx, (void)lists;
    for (int i = 0; i < n; i++) memset(g + parts[i].s_off, 0, parts[i].len * sizeof(float));
    return LOOM_OK;
}

/* ---- mixture of experts (cpu_moe.h) ---- */

static loom_status cpu_moe_router_fwd(loom_dev *d, loom_ctx *ctx, const void *z, int64_t N,
                                      int64_t E, int k, bool norm_topk, float *probs, int32_t *idx,
                                      float *w, float *psum, float *lse) {
    (void)d, (void)ctx;
    loom_cpu_router_fwd(CF(z), N, E, k, norm_topk, probs, idx, w, psum, lse);
    return LOOM_OK;
}

static loom_status cpu_moe_router_bwd(loom_dev *d, loom_ctx *ctx, const float *probs,
                                      const int32_t *idx, const float *dw, const float *ga,
                                      const float *lse, const float *zc, int64_t N, int64_t E,
                                      int k, bool norm_topk, void *dz) {
    (void)d, (void)ctx;
    loom_cpu_router_bwd(probs, idx, dw, ga, lse, zc, N, E, k, norm_topk, F(dz));
    return LOOM_OK;
}

static loom_status cpu_moe_dest(loom_dev *d, loom_ctx *ctx, const int32_t *idx, int64_t N, int k,
                                int64_t El, int P, int32_t *dest) {
    (void)d, (void)ctx;
    loom_cpu_moe_dest(idx, N, k, El, P, dest);
    return LOOM_OK;
}

static loom_status cpu_moe_dedup_meta(loom_dev *d, loom_ctx *ctx, const int32_t *ord, int64_t U,
                                      const int32_t *idx, const float *w, int k, int64_t El,
                                      int P, int32_t *tok, int32_t *mid, float *mw) {
    (void)d, (void)ctx;
    loom_cpu_moe_dedup_meta(ord, U, idx, w, k, El, P, tok, mid, mw);
    return LOOM_OK;
}

static loom_status cpu_moe_mask(loom_dev *d, loom_ctx *ctx, const int32_t *key, int64_t N, int k,
                                int32_t none, int32_t *order, int32_t *pos) {
    (void)d, (void)ctx;
    loom_cpu_moe_mask(key, N, k, none, order, pos);
    return LOOM_OK;
}

static loom_status cpu_moe_dedup_dw(loom_dev *d, loom_ctx *ctx, const float *dwb,
                                    const int32_t *pos, int64_t N, int P, int k, float *dw) {
    (void)d, (void)ctx;
    loom_cpu_moe_dedup_dw(dwb, pos, N, P, k, dw);
    return LOOM_OK;
}

static loom_status cpu_moe_regroup(loom_dev *d, loom_ctx *ctx, const int32_t *rc, int64_t S,
                                   int64_t El, int64_t Rt, int32_t *ix) {
    (void)d, (void)ctx;
    loom_cpu_moe_regroup(rc, S, El, Rt, ix);
    return LOOM_OK;
}

static loom_status cpu_moe_route(loom_dev *d, loom_ctx *ctx, const int32_t *idx, const float *w,
                                 int64_t N, int64_t E, int k, int64_t cap, bool by_position,
                                 int32_t *counts, int32_t *order, int32_t *pos) {
    (void)d, (void)ctx;
    loom_cpu_moe_route(idx, w, N, E, k, cap, by_position, counts, order, pos);
    return LOOM_OK;
}

static loom_status cpu_moe_permute(loom_dev *d, loom_ctx *ctx, const void *x,
                                   const int32_t *order, int64_t N, int k, int64_t H, void *xg) {
    (void)d, (void)ctx;
    loom_cpu_moe_permute(CF(x), order, N, k, H, F(xg));
    return LOOM_OK;
}

static loom_status cpu_moe_combine(loom_dev *d, loom_ctx *ctx, const void *yg, const int32_t *pos,
                                   const float *w, int64_t N, int k, int64_t H, void *y) {
    (void)d, (void)ctx;
    loom_cpu_moe_combine(CF(yg), pos, w, N, k, H, F(y));
    return LOOM_OK;
}

static loom_status cpu_moe_combine_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *yg,
                                       const int32_t *order, const float *w, int64_t N, int k,
                                       int64_t H, void *dyg, float *dw) {
    (void)d, (void)ctx;
    loom_cpu_moe_combine_bwd(CF(dy), CF(yg), order, w, N, k, H, F(dyg), dw);
    return LOOM_OK;
}

static loom_status cpu_moe_permute_bwd(loom_dev *d, loom_ctx *ctx, const void *dxg,
                                       const int32_t *pos, int64_t N, int k, int64_t H,
                                       void *dx) {
    (void)d, (void)ctx;
    loom_cpu_moe_permute_bwd(CF(dxg), pos, N, k, H, F(dx));
    return LOOM_OK;
}

static loom_status cpu_moe_gate_fwd(loom_dev *d, loom_ctx *ctx, const void *z, const void *s,
                                    int64_t N, int64_t H, bool acc, float *g, void *y) {
    (void)d, (void)ctx;
    loom_cpu_moe_gate_fwd(CF(z), CF(s), N, H, acc, g, F(y));
    return LOOM_OK;
}

static loom_status cpu_moe_gate_bwd(loom_dev *d, loom_ctx *ctx, const void *da, const void *a,
                                    const float *g, int64_t N, int64_t I, void *dz) {
    (void)d, (void)ctx;
    loom_cpu_moe_gate_bwd(CF(da), CF(a), g, N, I, F(dz));
    return LOOM_OK;
}

static loom_status cpu_gemm_grouped(loom_dev *d, loom_ctx *ctx, bool ta, bool tb, int G,
                                    const loom_gemm_group *g, float alpha, int64_t lda,
                                    int64_t ldb, loom_dtype ab, float beta, loom_dtype cdt,
                                    int64_t ldc) {
    for (int i = 0; i < G; i++) {
        if (!g[i].M || !g[i].N) continue;
        if (!g[i].K) {
            if (beta != 1.0f)
                for (int64_t r = 0; r < g[i].M; r++)
                    for (int64_t c = 0; c < g[i].N; c++) {
                        float *o = F(g[i].C) + r * ldc + c;
                        *o = beta == 0.0f ? 0.0f : beta * *o;
                    }
            continue;
        }
        cpu_gemm(d, ctx, ta, tb, g[i].M, g[i].N, g[i].K, alpha, g[i].A, lda, g[i].B, ldb, ab,
                 beta, g[i].C, cdt, ldc);
    }
    return LOOM_OK;
}

static void cpu_lists_free(loom_dev *d, loom_part_lists *lists) {
    (void)d;
    memset(lists, 0, sizeof *lists);
}

/* ---- Gated DeltaNet (gdn.c) ---- */

static loom_status cpu_gdn_conv_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                    int64_t T, int64_t C, int64_t K, const int32_t *cu,
                                    int64_t ndocs, void *y) {
    (void)d;
    return loom_cpu_gdn_conv_fwd(ctx, CF(x), CF(w), T, C, K, cu, ndocs, F(y));
}

static loom_status cpu_gdn_conv_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                    const void *w, int64_t T, int64_t C, int64_t K,
                                    const int32_t *cu, int64_t ndocs, void *dx, float *dw) {
    (void)d;
    return loom_cpu_gdn_conv_bwd(ctx, CF(dy), CF(x), CF(w), T, C, K, cu, ndocs, F(dx), dw);
}

static loom_status cpu_gdn_gate_fwd(loom_dev *d, loom_ctx *ctx, const void *a, const void *b,
                                    const void *A_log, const void *dt_bias, int64_t T, int64_t H,
                                    float *g, float *beta) {
    (void)d;
    return loom_cpu_gdn_gate_fwd(ctx, CF(a), CF(b), CF(A_log), CF(dt_bias), T, H, g, beta);
}

static loom_status cpu_gdn_gate_bwd(loom_dev *d, loom_ctx *ctx, const float *dg, const float *dbeta,
                                    const void *a, const void *b, const void *A_log,
                                    const void *dt_bias, int64_t T, int64_t H, void *da, void *db,
                                    float *dA_log, float *ddt_bias) {
    (void)d;
    return loom_cpu_gdn_gate_bwd(ctx, dg, dbeta, CF(a), CF(b), CF(A_log), CF(dt_bias), T, H, F(da),
                                 F(db), dA_log, ddt_bias);
}

static loom_status cpu_gdn_fwd(loom_dev *d, loom_ctx *ctx, const void *qkv, const float *g,
                               const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                               int64_t dv, const int32_t *cu, int64_t ndocs, void *o, void *keep,
                               int64_t keep_chunks) {
    (void)d, (void)keep, (void)keep_chunks; /* keeps nothing: the backward recomputes */
    return loom_cpu_gdn_fwd(ctx, CF(qkv), g, beta, T, Hk, Hv, dk, dv, cu, ndocs, F(o));
}

static loom_status cpu_gdn_bwd(loom_dev *d, loom_ctx *ctx, const void *dout, const void *qkv,
                               const float *g, const float *beta, int64_t T, int64_t Hk, int64_t Hv,
                               int64_t dk, int64_t dv, const int32_t *cu, int64_t ndocs, void *dqkv,
                               float *dg, float *dbeta, const void *keep, int64_t keep_chunks) {
    (void)d, (void)keep, (void)keep_chunks;
    return loom_cpu_gdn_bwd(ctx, CF(dout), CF(qkv), g, beta, T, Hk, Hv, dk, dv, cu, ndocs, F(dqkv),
                            dg, dbeta);
}

static loom_status cpu_gdn_norm_fwd(loom_dev *d, loom_ctx *ctx, const void *x, const void *z,
                                    const void *w, int64_t N, int64_t D, float eps, void *y,
                                    float *rstd) {
    (void)d;
    return loom_cpu_gdn_norm_fwd(ctx, CF(x), CF(z), CF(w), N, D, eps, F(y), rstd);
}

static loom_status cpu_gdn_norm_bwd(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                    const void *z, const void *w, const float *rstd, int64_t N,
                                    int64_t D, void *dx, void *dz, float *dw) {
    (void)d;
    return loom_cpu_gdn_norm_bwd(ctx, CF(dy), CF(x), CF(z), CF(w), rstd, N, D, F(dx), F(dz), dw);
}

const loom_backend *loom_backend_cpu(void) {
    static const loom_backend be = {
        .name = "cpu",
        .init = cpu_init,
        .release = cpu_release,
        .attn_note = cpu_attn_note,
        .alloc = cpu_alloc,
        .free = cpu_free,
        .host_alloc = cpu_host_alloc,
        .copy = cpu_copy,
        .copy2d = cpu_copy2d,
        .zero = cpu_zero,
        .download = cpu_copy, /* host and device memory are one */
        .upload = cpu_copy,
        .convert = cpu_convert,
        .mark = cpu_mark,
        .marks_ms = cpu_marks_ms,
        .gate_fwd = cpu_gate_fwd,
        .gate_bwd = cpu_gate_bwd,
        .swiglu_fwd = cpu_swiglu_fwd,
        .swiglu_bwd = cpu_swiglu_bwd,
        .add = cpu_add,
        .bias_fwd = cpu_bias_fwd,
        .bias_bwd = cpu_bias_bwd,
        .embed_fwd = cpu_embed_fwd,
        .embed_bwd = cpu_embed_bwd,
        .rows_gather = cpu_rows_gather,
        .rows_scatter = cpu_rows_scatter,
        .dropout = cpu_dropout,
        .fill_randn = cpu_fill_randn,
        .rmsnorm_fwd = cpu_rmsnorm_fwd,
        .rmsnorm_bwd = cpu_rmsnorm_bwd,
        .add_rmsnorm_fwd = cpu_add_rmsnorm_fwd,
        .rmsnorm_bwd_add = cpu_rmsnorm_bwd_add,
        .dw_flush = cpu_dw_flush,
        .dw_drop = cpu_dw_drop,
        .gemm = cpu_gemm,
        .dx_sum = cpu_dx_sum,
        .lin_lora_fwd = cpu_lin_lora_fwd,
        .lora_dy_n = cpu_lora_dy_n,
        .rope = cpu_rope,
        .rope_table = cpu_rope_table,
        .qknorm_rope_fwd = cpu_qknorm_rope_fwd,
        .qknorm_rope_bwd = cpu_qknorm_rope_bwd,
        .attn_fwd = cpu_attn_fwd,
        .attn_bwd = cpu_attn_bwd,
        .attn_max_d = LOOM_CPU_ATTN_MAX_D,
        .ce_max = cpu_ce_max,
        .ce_sums = cpu_ce_sums,
        .ce_grad = cpu_ce_grad,
        .rows_scale = cpu_rows_scale,
        .ce_fused = cpu_ce_fused,
        .moe_router_fwd = cpu_moe_router_fwd,
        .moe_router_bwd = cpu_moe_router_bwd,
        .moe_route = cpu_moe_route,
        .moe_regroup = cpu_moe_regroup,
        .moe_dest = cpu_moe_dest,
        .moe_dedup_meta = cpu_moe_dedup_meta,
        .moe_mask = cpu_moe_mask,
        .moe_dedup_dw = cpu_moe_dedup_dw,
        .moe_permute = cpu_moe_permute,
        .moe_combine = cpu_moe_combine,
        .moe_combine_bwd = cpu_moe_combine_bwd,
        .moe_permute_bwd = cpu_moe_permute_bwd,
        .moe_gate_fwd = cpu_moe_gate_fwd,
        .moe_gate_bwd = cpu_moe_gate_bwd,
        .gemm_grouped = cpu_gemm_grouped,
        .adamw = cpu_adamw,
        .sumsq = cpu_sumsq,
        .zero_parts = cpu_zero_parts,
        .lists_free = cpu_lists_free,
        .gdn_conv_fwd = cpu_gdn_conv_fwd,
        .gdn_conv_bwd = cpu_gdn_conv_bwd,
        .gdn_gate_fwd = cpu_gdn_gate_fwd,
        .gdn_gate_bwd = cpu_gdn_gate_bwd,
        .gdn_fwd = cpu_gdn_fwd,
        .gdn_bwd = cpu_gdn_bwd,
        .gdn_norm_fwd = cpu_gdn_norm_fwd,
        .gdn_norm_bwd = cpu_gdn_norm_bwd,
    };
    return &be;
}
