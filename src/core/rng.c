#include "rng.h"

#include <math.h>

/* Both values of pair p (elements 2p, 2p+1) of the stream whose
 * loom_rng_uniform base is `base`. */
static void normal_pair(uint64_t base, uint64_t p, double *c, double *s) {
    double u1 = loom_rng_uniform_at(base, 2 * p), u2 = loom_rng_uniform_at(base, 2 * p + 1);
    double r = sqrt(-2.0 * log(u1));
    double t = 6.283185307179586 * u2;
    *c = r * cos(t);
    *s = r * sin(t);
}

double loom_rng_normal(uint64_t seed, uint64_t key, uint64_t i) {
    double c, s;
    normal_pair(loom_rng_base(seed, key), i >> 1, &c, &s);
    return (i & 1) ? s : c;
}

void loom_rng_normal_fill(uint64_t seed, uint64_t key, uint64_t i0, size_t n, double scale,
                          float *out) {
    const uint64_t base = loom_rng_base(seed, key);
    const uint64_t p0 = i0 >> 1, p1 = (i0 + n + 1) >> 1; /* the pairs that hold [i0, i0+n) */
#pragma omp parallel for schedule(static) if (n >= ((size_t)1 << 16))
    for (uint64_t p = p0; p < p1; p++) {
        double v[2];
        normal_pair(base, p, &v[0], &v[1]);
        for (int k = 0; k < 2; k++) {
            const uint64_t i = 2 * p + (uint64_t)k;
            if (i >= i0 && i < i0 + n) out[i - i0] = (float)(scale * v[k]);
        }
    }
}
