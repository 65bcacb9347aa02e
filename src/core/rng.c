#include "rng.h"

#include <math.h>

double loom_rng_normal(uint64_t seed, uint64_t key, uint64_t i) {
    double u1 = loom_rng_uniform(seed, key, 2 * (i >> 1));
    double u2 = loom_rng_uniform(seed, key, 2 * (i >> 1) + 1);
    double r = sqrt(-2.0 * log(u1));
    double t = 6.283185307179586 * u2;
    return (i & 1) ? r * sin(t) : r * cos(t);
}
