/* SHA-256 as FIPS 180-4 defines it (sections 4.1.2, 4.2.2, 5.1.1, 5.3.3, 6.2).
 * On x86-64 CPUs with the SHA extensions (Intel since Goldmont and Ice Lake,
 * AMD since Zen) the blocks go through their instructions (sha256rnds2 does
 * two rounds, sha256msg1/msg2 the message schedule), about 6x the portable
 * code; the portable code is the reference the tests hold it to. */
#include "sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* The first 32 bits of the fractional parts of the cube roots of the first
 * 64 primes (FIPS 180-4, 4.2.2). */
static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2,
};

static inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

/* Processes one 512-bit block (6.2.2). */
static void compress(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64];
    for (int t = 0; t < 16; t++)
        w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 |
               (uint32_t)p[4 * t + 2] << 8 | (uint32_t)p[4 * t + 3];
    for (int t = 16; t < 64; t++) {
        uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
        uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
        w[t] = s1 + w[t - 7] + s0 + w[t - 16];
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int t = 0; t < 64; t++) {
        uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        uint32_t ch = (e & f) ^ (~e & g);
        uint32_t t1 = hh + S1 + ch + K[t] + w[t];
        uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
        uint32_t t2 = S0 + maj;
        hh = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += hh;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI 1

/* n blocks with the SHA extensions. The state lives as two vectors, ABEF
 * and CDGH (the order sha256rnds2 takes); each vector of message words
 * feeds four rounds, two per sha256rnds2. */
__attribute__((target("sha,sse4.1"))) static void compress_ni(uint32_t h[8], const uint8_t *p,
                                                              size_t n) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i t = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1); /* CDAB */
    __m128i s1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B); /* EFGH */
    __m128i s0 = _mm_alignr_epi8(t, s1, 8);                                        /* ABEF */
    s1 = _mm_blend_epi16(s1, t, 0xF0);                                             /* CDGH */
    for (; n; n--, p += 64) {
        const __m128i abef = s0, cdgh = s1;
        __m128i x[4]; /* the last four vectors of message words, W[4i..4i+3] at x[i % 4] */
        for (int i = 0; i < 16; i++) {
            if (i < 4) {
                x[i] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), bswap);
            } else { /* W[t] = s1(W[t-2]) + W[t-7] + s0(W[t-15]) + W[t-16] */
                __m128i v = _mm_sha256msg1_epu32(x[i & 3], x[(i + 1) & 3]);
                v = _mm_add_epi32(v, _mm_alignr_epi8(x[(i + 3) & 3], x[(i + 2) & 3], 4));
                x[i & 3] = _mm_sha256msg2_epu32(v, x[(i + 3) & 3]);
            }
            __m128i m = _mm_add_epi32(x[i & 3], _mm_loadu_si128((const __m128i *)&K[4 * i]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, m);
            s0 = _mm_sha256rnds2_epu32(s0, s1, _mm_shuffle_epi32(m, 0x0E));
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    t = _mm_shuffle_epi32(s0, 0x1B);                       /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                      /* DCHG */
    _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(t, s1, 0xF0)); /* DCBA */
    _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(s1, t, 8));    /* HGFE */
}
#endif

bool loom_sha256_accelerated(void) {
#ifdef HAVE_SHA_NI
    /* CPUID leaf 7: EBX bit 29 is SHA; leaf 1: ECX bit 19 is SSE4.1 (asked
     * once per hash: in a VM each CPUID traps to the hypervisor) */
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 29))) return false;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 19));
#else
    return false;
#endif
}

/* n whole blocks, through the SHA extensions when the CPU has them. */
static void blocks(loom_sha256 *s, const uint8_t *p, size_t n) {
#ifdef HAVE_SHA_NI
    if (s->accel && !s->portable) {
        compress_ni(s->h, p, n);
        return;
    }
#endif
    for (; n; n--, p += 64) compress(s->h, p);
}

void loom_sha256_init(loom_sha256 *s) {
    /* the first 32 bits of the fractional parts of the square roots of the
     * first 8 primes (5.3.3) */
    static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, H0, sizeof H0);
    s->total = 0;
    s->fill = 0;
    s->portable = false;
    s->accel = loom_sha256_accelerated();
}

void loom_sha256_update(loom_sha256 *s, const void *data, size_t len) {
    const uint8_t *p = data;
    s->total += len;
    if (s->fill) {
        size_t take = 64 - s->fill < len ? 64 - s->fill : len;
        memcpy(s->block + s->fill, p, take);
        s->fill += take;
        p += take;
        len -= take;
        if (s->fill < 64) return;
        blocks(s, s->block, 1);
        s->fill = 0;
    }
    blocks(s, p, len / 64);
    p += len / 64 * 64;
    len %= 64;
    memcpy(s->block, p, len);
    s->fill = len;
}

void loom_sha256_final(loom_sha256 *s, uint8_t digest[32]) {
    /* padding (5.1.1): a 1 bit, zeros to 448 mod 512, the length in bits */
    uint64_t bits = s->total * 8;
    s->block[s->fill++] = 0x80;
    if (s->fill > 56) {
        memset(s->block + s->fill, 0, 64 - s->fill);
        blocks(s, s->block, 1);
        s->fill = 0;
    }
    memset(s->block + s->fill, 0, 56 - s->fill);
    for (int i = 0; i < 8; i++) s->block[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    blocks(s, s->block, 1);
    for (int i = 0; i < 8; i++) {
        digest[4 * i] = (uint8_t)(s->h[i] >> 24);
        digest[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        digest[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        digest[4 * i + 3] = (uint8_t)s->h[i];
    }
    s->fill = 0;
}

void loom_sha256_hex(const uint8_t digest[32], char hex[65]) {
    static const char xd[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        hex[2 * i] = xd[digest[i] >> 4];
        hex[2 * i + 1] = xd[digest[i] & 15];
    }
    hex[64] = 0;
}

loom_status loom_sha256_file(loom_ctx *ctx, const char *path, char hex[65]) {
    hex[0] = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot open to compute its SHA-256: %s", path,
                         strerror(errno));
    enum { CHUNK = 1 << 20 };
    uint8_t *buf = loom_malloc(ctx, CHUNK, "a read buffer");
    if (!buf) {
        close(fd);
        return LOOM_ERR_OOM;
    }
    loom_sha256 s;
    loom_sha256_init(&s);
    loom_status st = LOOM_OK;
    for (;;) {
        ssize_t r = read(fd, buf, CHUNK);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            st = loom_errf(ctx, LOOM_ERR_IO, "%s: read failed while computing its SHA-256: %s",
                           path, strerror(errno));
            break;
        }
        if (r == 0) break;
        loom_sha256_update(&s, buf, (size_t)r);
    }
    free(buf);
    close(fd);
    if (st) return st;
    uint8_t d[32];
    loom_sha256_final(&s, d);
    loom_sha256_hex(d, hex);
    return LOOM_OK;
}
