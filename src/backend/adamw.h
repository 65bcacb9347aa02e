/* AdamW on fp32 master weights (torch.optim.AdamW semantics: decoupled
 * weight decay) and global gradient-norm clipping (Megatron / torch
 * clip_grad_norm_). CPU reference; a CUDA version must give the same
 * numbers up to rounding (src/backend/cuda/ops_optim.cu, beside this
 * one's src/backend/cpu/adamw.c). */
#ifndef LOOM_BACKEND_ADAMW_H
#define LOOM_BACKEND_ADAMW_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct loom_adamw_hp {
    double lr;           /* from the scheduler for this step */
    double beta1, beta2; /* e.g. 0.9, 0.999 (Megatron's defaults are 0.9, 0.999) */
    double eps;          /* added to sqrt(vhat), e.g. 1e-8 */
    double weight_decay; /* from the scheduler (wd); applied only when `decay` */
} loom_adamw_hp;

/* One AdamW step, t = 1, 2, ... (the number of steps taken including this
 * one), over n elements, in place. p: fp32 master weights; g: fp32
 * gradients (already unscaled and clipped); m, v: Adam moments (zero before
 * step 1). Same operations, in the same fp32 order, as torch's
 * single-tensor Adam with decoupled weight decay:
 *
 *     p = p * (1 - lr*wd)                       (only when decay && wd != 0)
 *     m = lerp(m, g, 1 - beta1)                 (= beta1*m + (1-beta1)*g)
 *     v = v*beta2 + (1-beta2)*g*g
 *     denom = sqrt(v) / sqrt(1 - beta2^t) + eps
 *     p = p + (-lr / (1 - beta1^t)) * m / denom
 *
 * The scalar coefficients are computed in double (as Python does) and
 * rounded to fp32 once. Parallel over elements with OpenMP; results do not
 * depend on the thread count. Callers must not step on a non-finite grad
 * norm (see loom_sumsq). */
void loom_adamw_step(float *p, const float *g, float *m, float *v, size_t n,
                     const loom_adamw_hp *hp, int64_t t, bool decay);
/* The same step on gradients not yet scaled: each g[i] is first multiplied
 * by gs[0], then by gs[1] (each product rounded to fp32, as two scaling
 * passes would leave it), so the trainer unscales and clips inside the step
 * instead of in two extra passes over the gradients. gs {1, 1} is
 * loom_adamw_step. */
void loom_adamw_step_scaled(float *p, const float *g, float *m, float *v, size_t n,
                            const loom_adamw_hp *hp, int64_t t, bool decay, const float gs[2]);

/* Megatron's rule: no weight decay on 1-D parameters (norm weights, biases). */
bool loom_adamw_decays(int ndim);

/* Sum of squares of g[0..n) accumulated in double. Deterministic: fixed
 * chunks of LOOM_SUMSQ_CHUNK elements are summed each on its own, then the
 * chunk sums are added in index order, so the result is bit-identical for
 * any OpenMP thread count. NaN/inf in g give a non-finite result: the
 * caller must check isfinite(sqrt(total)) and skip the step. */
#define LOOM_SUMSQ_CHUNK 4096
double loom_sumsq(const float *g, size_t n);
/* The same over g[i] * s (the product rounded to fp32 first). */
double loom_sumsq_scaled(const float *g, size_t n, float s);

/* Clipping coefficient (torch clip_grad_norm_ / Megatron clip_grads):
 * max_norm / (total_norm + 1e-6), computed in double and returned as float;
 * 1.0f when that is >= 1 (no clipping needed: do not scale), and also when
 * max_norm <= 0 (clipping off). total_norm = sqrt(sum of loom_sumsq over all
 * distinct parameters). A non-finite total_norm gives NaN (refuse the step:
 * the caller checks isfinite(total_norm) first). */
float loom_clip_coeff(double total_norm, double max_norm);

#endif /* LOOM_BACKEND_ADAMW_H */
