/* CPU reference versions of the model's glue between the layers (glue.c):
 * the vocab-parallel embedding and cross-entropy pieces, the row
 * permutations of context parallelism and the LoRA dropout mask. The CUDA
 * versions (src/backend/cuda/cuda_glue.h) have the same semantics; these are
 * their oracle, and they compute exactly what src/model/forward.c and
 * src/model/lora.c compute on the host. fp32 activations, row-major. */
#ifndef LOOM_CPU_GLUE_H
#define LOOM_CPU_GLUE_H

#include <stddef.h>
#include <stdint.h>

/* ---- vocab-parallel embedding ----
 * This rank holds rows [row0, row0 + rows) of the embedding: W (rows, H).
 * fwd: out[t, :] = W[ids[t] - row0, :] for the tokens whose id falls in that
 * range, zeros for the others (the tensor-parallel sum fills them in).
 * bwd: dW (rows, H) += dout[t, :] for the in-range tokens, in token order for
 * every element (deterministic; the CUDA version is bit-identical). */
void loom_cpu_embedding_vp_fwd(const int32_t *ids, int64_t T, const float *W, int64_t row0,
                               int64_t rows, int64_t H, float *out);
void loom_cpu_embedding_vp_bwd(const int32_t *ids, int64_t T, const float *dout, int64_t row0,
                               int64_t rows, int64_t H, float *dW);

/* ---- vocab-parallel cross-entropy, the per-rank pieces ----
 * logits: c rows of this rank's columns, row stride ld; the first nvalid
 * columns are real vocabulary (nvalid is clamped to [0, ld]: a rank of pure
 * padding may pass V - v0 < 0), the rest padding. v0: global id of local
 * column 0. tgt: (c) global target ids, or -100 (ignored).
 * max: mx[r] = max_{j < nvalid} z[r, j] (exact, as double); -INFINITY when
 *   nvalid == 0. The caller all-reduces mx with MAX over tensor parallel.
 * sums: with mx the global row maxima, ce[3r + 0] = sum_j exp(z - mx[r]),
 *   ce[3r + 1] = sum_j exp(z - mx[r]) * z (exp of (double)z - mx and sums in
 *   double, in column order), ce[3r + 2] = z[r, tgt[r] - v0] when that column
 *   is one of this rank's nvalid, else 0. The caller all-reduces ce with SUM;
 *   then lse = mx + log(ce[3r]), log p(target) = ce[3r + 2] - lse and the
 *   entropy = lse - ce[3r + 1] / ce[3r].
 * grad: in place, from mx and ce as all-reduced, with L[r] = mx[r] +
 *   log(ce[3r]) the global log-sum-exp of row r: an ignored row
 *   (tgt == -100) becomes 0 over all ld columns; else z[j] = (float)(scale *
 *   exp((double)z[j] - L[r])) for j < nvalid, 0 for the padding, and then
 *   scale is subtracted (in fp32) at the target's column when it is local.
 *   That is scale * d(sum of token losses)/d(logits). */
void loom_cpu_ce_vp_max(const float *logits, int64_t c, int64_t ld, int64_t nvalid, double *mx);
void loom_cpu_ce_vp_sums(const float *logits, int64_t c, int64_t ld, int64_t nvalid,
                         const int32_t *tgt, int64_t v0, const double *mx, double *ce);
void loom_cpu_ce_vp_grad(float *logits, int64_t c, int64_t ld, int64_t nvalid, const int32_t *tgt,
                         int64_t v0, const double *mx, const double *ce, float scale);
/* x[r ld + j] *= w[r] (fp32 products) for r < c, j < ld: a loss's per-token
 * weights on its gradient rows */
void loom_cpu_rows_scale(float *x, int64_t c, int64_t ld, const float *w);

/* ---- row permutations (context parallel) ----
 * Rows of `width` elements of esz bytes each (any esz > 0).
 * gather: dst row j = src row idx[j], j < n.
 * scatter: dst row idx[j] = src row j, j < n (idx without repeats).
 * dst and src must not overlap. */
void loom_cpu_rows_gather(void *dst, const void *src, const int32_t *idx, int64_t n,
                          int64_t width, size_t esz);
void loom_cpu_rows_scatter(void *dst, const void *src, const int32_t *idx, int64_t n,
                           int64_t width, size_t esz);

/* ---- LoRA dropout ----
 * out (T, in) = x * mask / (1 - p), or with x NULL the mask applied to out in
 * place. Element (t, k) is token g = out0 + (qidx ? qidx[t] : t) of the
 * global batch and feature col0 + k of the full input of width `full`; it is
 * kept when loom_rng_uniform(seed, key, g * full + col0 + k) >= p (as uint64
 * arithmetic), and then scaled by (float)(1 / (1 - p)). So every mesh, and
 * the CUDA version, drops the same elements. */
void loom_cpu_lora_dropout(float *out, const float *x, int64_t T, int64_t in, int64_t full,
                           int64_t col0, const int32_t *qidx, int64_t out0, uint64_t seed,
                           uint64_t key, double p);

#endif
