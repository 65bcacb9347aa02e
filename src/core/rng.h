/* Counter-based random numbers: value i of stream (seed, key) is a pure
 * function of its inputs, so a tensor initialised on one process or sharded
 * over many gets the same values. */
#ifndef LOOM_RNG_H
#define LOOM_RNG_H

#include <stddef.h>
#include <stdint.h>

/* The inline functions below are also compiled for the GPU (a CUDA kernel
 * must draw the same numbers as the host, e.g. LoRA dropout masks). */
#ifdef __CUDACC__
#define LOOM_HD __host__ __device__
#else
#define LOOM_HD
#endif

static inline LOOM_HD uint64_t loom_splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* FNV-1a of a string, to derive a stream key from a tensor name. */
static inline LOOM_HD uint64_t loom_hash_str(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

/* The stream (seed, key)'s base, and its value i given the base: uniform in
 * (0, 1), 53 random bits, never 0 (a loop over one stream hashes once). */
static inline LOOM_HD uint64_t loom_rng_base(uint64_t seed, uint64_t key) {
    return loom_splitmix64(seed ^ loom_splitmix64(key));
}
static inline LOOM_HD double loom_rng_uniform_at(uint64_t base, uint64_t i) {
    return ((double)(loom_splitmix64(base + i) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* Value i of stream base as a near-normal float (mean 0, variance 1, within
 * +-3.47): the sum of four 16-bit uniforms of one hash, centred and scaled.
 * Integer sums and one float product, so every device draws the same bits
 * (what a kernel and its CPU reference must agree on). */
static inline LOOM_HD float loom_rng_gauss4_at(uint64_t base, uint64_t i) {
    const uint64_t r = loom_splitmix64(base + i);
    const uint32_t s = (uint32_t)(r & 0xffff) + (uint32_t)((r >> 16) & 0xffff) +
                       (uint32_t)((r >> 32) & 0xffff) + (uint32_t)(r >> 48);
    return (float)((int32_t)s - 131070) * 2.6429120e-5f; /* sqrt(3) / 65536 */
}

/* Uniform in (0, 1): 53 random bits, never 0. */
static inline LOOM_HD double loom_rng_uniform(uint64_t seed, uint64_t key, uint64_t i) {
    return loom_rng_uniform_at(loom_rng_base(seed, key), i);
}

/* Standard normal (Box-Muller on elements 2i and 2i+1 of the stream). */
double loom_rng_normal(uint64_t seed, uint64_t key, uint64_t i);
/* out[j] = (float)(scale * loom_rng_normal(seed, key, i0 + j)) for j < n,
 * bit for bit, a pair's logarithm and hashes computed once (threads with
 * OpenMP): random checkpoints of 30B parameters in seconds per core. */
void loom_rng_normal_fill(uint64_t seed, uint64_t key, uint64_t i0, size_t n, double scale,
                          float *out);

#endif
