/* dtype names, sizes and conversions. */
#include <math.h>
#include <string.h>

#include "core.h"

static const struct {
    const char *name;
    size_t size;
    bool is_float;
} dtypes[LOOM_DTYPE_COUNT] = {
    [LOOM_F32] = {"F32", 4, true},  [LOOM_BF16] = {"BF16", 2, true}, [LOOM_F16] = {"F16", 2, true},
    [LOOM_F64] = {"F64", 8, true},  [LOOM_I64] = {"I64", 8, false},  [LOOM_I32] = {"I32", 4, false},
    [LOOM_I16] = {"I16", 2, false}, [LOOM_I8] = {"I8", 1, false},    [LOOM_U8] = {"U8", 1, false},
    [LOOM_BOOL] = {"BOOL", 1, false},
};

const char *loom_dtype_name(loom_dtype dt) {
    if ((int)dt < 0 || dt >= LOOM_DTYPE_COUNT) return "?";
    return dtypes[dt].name;
}

size_t loom_dtype_size(loom_dtype dt) {
    if ((int)dt < 0 || dt >= LOOM_DTYPE_COUNT) return 0;
    return dtypes[dt].size;
}

bool loom_dtype_is_float(loom_dtype dt) {
    return (int)dt >= 0 && dt < LOOM_DTYPE_COUNT && dtypes[dt].is_float;
}

int loom_dtype_from_name(const char *name, loom_dtype *out) {
    for (int i = 0; i < LOOM_DTYPE_COUNT; i++) {
        if (strcmp(name, dtypes[i].name) == 0) {
            *out = (loom_dtype)i;
            return 0;
        }
    }
    return -1;
}

float loom_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t loom_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

float loom_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t loom_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return sign | 0x7e00u;   /* NaN */
    if (absu >= 0x47800000u) return sign | 0x7c00u;  /* >= 65536: inf */
    if (absu < 0x38800000u) { /* below the smallest normal half (2^-14): subnormal or zero */
        if (absu < 0x33000000u) return sign; /* < 2^-25 rounds to zero */
        uint32_t e = absu >> 23;
        uint32_t man = (absu & 0x7fffffu) | 0x800000u;
        /* value = man * 2^(e-150) and the half subnormal unit is 2^-24, so
         * the half mantissa is man * 2^(e-126) = man >> (126 - e) */
        uint32_t shift = 126 - e;
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return sign | (uint16_t)q;
    }
    uint32_t r = absu + 0x0fffu + ((absu >> 13) & 1u); /* round to nearest even */
    r -= 0x38000000u; /* rebias 127 -> 15 */
    if (r >= 0x0f800000u) return sign | 0x7c00u; /* rounded up to inf */
    return sign | (uint16_t)(r >> 13);
}

/* Load element i of a float dtype as double. */
static double load_f(const void *p, loom_dtype dt, size_t i) {
    switch (dt) {
    case LOOM_F32: { float v; memcpy(&v, (const char *)p + 4 * i, 4); return v; }
    case LOOM_F64: { double v; memcpy(&v, (const char *)p + 8 * i, 8); return v; }
    case LOOM_BF16: { uint16_t v; memcpy(&v, (const char *)p + 2 * i, 2); return loom_bf16_to_f32(v); }
    case LOOM_F16: { uint16_t v; memcpy(&v, (const char *)p + 2 * i, 2); return loom_f16_to_f32(v); }
    default: return 0;
    }
}

static int64_t load_i(const void *p, loom_dtype dt, size_t i) {
    const char *c = p;
    switch (dt) {
    case LOOM_I64: { int64_t v; memcpy(&v, c + 8 * i, 8); return v; }
    case LOOM_I32: { int32_t v; memcpy(&v, c + 4 * i, 4); return v; }
    case LOOM_I16: { int16_t v; memcpy(&v, c + 2 * i, 2); return v; }
    case LOOM_I8: return (int8_t)c[i];
    case LOOM_U8: return (uint8_t)c[i];
    case LOOM_BOOL: return c[i] != 0;
    default: return 0;
    }
}

static void store_f(void *p, loom_dtype dt, size_t i, double v) {
    char *c = p;
    switch (dt) {
    case LOOM_F32: { float f = (float)v; memcpy(c + 4 * i, &f, 4); break; }
    case LOOM_F64: memcpy(c + 8 * i, &v, 8); break;
    case LOOM_BF16: { uint16_t h = loom_f32_to_bf16((float)v); memcpy(c + 2 * i, &h, 2); break; }
    case LOOM_F16: { uint16_t h = loom_f32_to_f16((float)v); memcpy(c + 2 * i, &h, 2); break; }
    default: break;
    }
}

static bool int_fits(loom_dtype dt, int64_t v) {
    switch (dt) {
    case LOOM_I64: return true;
    case LOOM_I32: return v >= INT32_MIN && v <= INT32_MAX;
    case LOOM_I16: return v >= INT16_MIN && v <= INT16_MAX;
    case LOOM_I8: return v >= INT8_MIN && v <= INT8_MAX;
    case LOOM_U8: return v >= 0 && v <= UINT8_MAX;
    case LOOM_BOOL: return v == 0 || v == 1;
    default: return false;
    }
}

static void store_i(void *p, loom_dtype dt, size_t i, int64_t v) {
    char *c = p;
    switch (dt) {
    case LOOM_I64: memcpy(c + 8 * i, &v, 8); break;
    case LOOM_I32: { int32_t x = (int32_t)v; memcpy(c + 4 * i, &x, 4); break; }
    case LOOM_I16: { int16_t x = (int16_t)v; memcpy(c + 2 * i, &x, 2); break; }
    case LOOM_I8: c[i] = (char)(int8_t)v; break;
    case LOOM_U8: case LOOM_BOOL: c[i] = (char)(uint8_t)v; break;
    default: break;
    }
}

loom_status loom_convert(loom_ctx *ctx, void *dst, loom_dtype d, const void *src, loom_dtype s,
                         size_t n) {
    if ((int)d < 0 || d >= LOOM_DTYPE_COUNT || (int)s < 0 || s >= LOOM_DTYPE_COUNT)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_convert: bad dtype");
    if (d == s) {
        memmove(dst, src, n * loom_dtype_size(d));
        return LOOM_OK;
    }
    bool sf = loom_dtype_is_float(s), df = loom_dtype_is_float(d);
    if (sf && df) {
        /* threads for long runs of separate buffers (a checkpoint's
         * tensors saved); overlapping ones (a narrowing in place) in order */
        const size_t sb = n * loom_dtype_size(s), db = n * loom_dtype_size(d);
        const char *sp = src, *dp = dst;
        const bool par = n >= ((size_t)1 << 18) && (sp + sb <= dp || dp + db <= sp);
        (void)par;
        if (s == LOOM_BF16 && d == LOOM_F32) { /* hot path: checkpoint load */
            const uint16_t *in = src;
            float *out = dst;
#pragma omp parallel for schedule(static) if (par)
            for (size_t i = 0; i < n; i++) {
                uint16_t h;
                memcpy(&h, in + i, 2);
                out[i] = loom_bf16_to_f32(h);
            }
            return LOOM_OK;
        }
#pragma omp parallel for schedule(static) if (par)
        for (size_t i = 0; i < n; i++) store_f(dst, d, i, load_f(src, s, i));
        return LOOM_OK;
    }
    if (!sf && !df) {
        for (size_t i = 0; i < n; i++) {
            int64_t v = load_i(src, s, i);
            if (!int_fits(d, v))
                return loom_errf(ctx, LOOM_ERR_FORMAT,
                                 "element %zu: value %lld does not fit in %s", i, (long long)v,
                                 loom_dtype_name(d));
            store_i(dst, d, i, v);
        }
        return LOOM_OK;
    }
    if (!sf && df) { /* ints to floats: only values the float holds exactly */
        for (size_t i = 0; i < n; i++) {
            int64_t v = load_i(src, s, i);
            bool exact = v >= -9007199254740992LL && v <= 9007199254740992LL; /* |v| <= 2^53 */
            if (exact) {
                store_f(dst, d, i, (double)v);
                double back = load_f(dst, d, i); /* finite and within 2^53 unless inf */
                exact = back == (double)v;
            }
            if (!exact)
                return loom_errf(ctx, LOOM_ERR_FORMAT,
                                 "element %zu: integer %lld is not exactly representable in %s", i,
                                 (long long)v, loom_dtype_name(d));
        }
        return LOOM_OK;
    }
    /* floats to ints: only exact integral values */
    for (size_t i = 0; i < n; i++) {
        double v = load_f(src, s, i);
        if (!(v == v) || v != floor(v) || v < -9.2233720368547758e18 || v >= 9.2233720368547758e18 ||
            !int_fits(d, (int64_t)v))
            return loom_errf(ctx, LOOM_ERR_FORMAT, "element %zu: value %g is not an integer that fits in %s",
                             i, v, loom_dtype_name(d));
        store_i(dst, d, i, (int64_t)v);
    }
    return LOOM_OK;
}
