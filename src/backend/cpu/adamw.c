/* AdamW step, deterministic sum of squares, gradient scaling. See adamw.h. */
#include "../adamw.h"

#include <math.h>
#include <stdlib.h>

#include "../../core/core.h"

void loom_adamw_step(float *p, const float *g, float *m, float *v, size_t n,
                     const loom_adamw_hp *hp, int64_t t, bool decay) {
    const float one[2] = {1.0f, 1.0f};
    loom_adamw_step_scaled(p, g, m, v, n, hp, t, decay, one);
}

void loom_adamw_step_scaled(float *p, const float *g, float *m, float *v, size_t n,
                            const loom_adamw_hp *hp, int64_t t, bool decay, const float gs[2]) {
    LOOM_ASSERT(t >= 1);
    /* Scalars as torch computes them: Python floats (double), each rounded to
     * fp32 where it meets an fp32 tensor. */
    const bool do_decay = decay && hp->weight_decay != 0.0;
    const float shrink = (float)(1.0 - hp->lr * hp->weight_decay);
    const double w1d = 1.0 - hp->beta1; /* lerp weight */
    const float w1 = (float)w1d, one_minus_w1 = (float)(1.0 - (double)w1);
    const bool lerp_low = w1 < 0.5f;
    const float b2 = (float)hp->beta2;
    const float c2 = (float)(1.0 - hp->beta2);
    const double bc1 = 1.0 - pow(hp->beta1, (double)t);
    const double bc2 = 1.0 - pow(hp->beta2, (double)t);
    const float neg_step = (float)(-(hp->lr / bc1));
    const float bc2_sqrt = (float)pow(bc2, 0.5);
    const float eps = (float)hp->eps;
    const float s0 = gs[0], s1 = gs[1];
    const ptrdiff_t N = (ptrdiff_t)n;

#pragma omp parallel for schedule(static)
    for (ptrdiff_t i = 0; i < N; i++) {
        float pi = p[i], gi = g[i] * s0, mi = m[i], vi = v[i];
        gi = gi * s1;
        if (do_decay) pi = pi * shrink;
        /* torch lerp: the two-sided form keeps it exact at either end. */
        mi = lerp_low ? mi + w1 * (gi - mi) : gi - (gi - mi) * one_minus_w1;
        vi = vi * b2;
        vi = vi + c2 * gi * gi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        pi = pi + neg_step * mi / denom;
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
    }
}

bool loom_adamw_decays(int ndim) { return ndim >= 2; }

double loom_sumsq(const float *g, size_t n) { return loom_sumsq_scaled(g, n, 1.0f); }

double loom_sumsq_scaled(const float *g, size_t n, float sc) {
    if (n == 0) return 0.0;
    const size_t nchunk = (n + LOOM_SUMSQ_CHUNK - 1) / LOOM_SUMSQ_CHUNK;
    const ptrdiff_t NC = (ptrdiff_t)nchunk;
    double total = 0.0;
    /* Each thread sums whole chunks; the per-chunk sums are combined in index
     * order. A small on-stack buffer handles the usual sizes; bigger inputs go
     * block by block so no allocation is needed (allocation-free step loop). */
    enum { BLOCK = 256 };
    double part[BLOCK];
    for (ptrdiff_t base = 0; base < NC; base += BLOCK) {
        ptrdiff_t nb = NC - base < BLOCK ? NC - base : BLOCK;
#pragma omp parallel for schedule(static) if (n > 65536)
        for (ptrdiff_t c = 0; c < nb; c++) {
            size_t lo = (size_t)(base + c) * LOOM_SUMSQ_CHUNK;
            size_t hi = lo + LOOM_SUMSQ_CHUNK < n ? lo + LOOM_SUMSQ_CHUNK : n;
            double s = 0.0;
            for (size_t i = lo; i < hi; i++) {
                const float x = g[i] * sc;
                s += (double)x * (double)x;
            }
            part[c] = s;
        }
        for (ptrdiff_t c = 0; c < nb; c++) total += part[c];
    }
    return total;
}

float loom_clip_coeff(double total_norm, double max_norm) {
    if (!isfinite(total_norm)) return NAN;
    if (!(max_norm > 0.0)) return 1.0f;
    double c = max_norm / (total_norm + 1e-6);
    return c < 1.0 ? (float)c : 1.0f;
}
