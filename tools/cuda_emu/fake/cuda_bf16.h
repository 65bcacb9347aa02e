#pragma once
#include <cstdint>
#include <cstring>
struct __nv_bfloat16 {
    uint16_t x;
    explicit operator float() const {
        uint32_t u = (uint32_t)x << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
};
inline float __bfloat162float(__nv_bfloat16 h) { uint32_t u = (uint32_t)h.x << 16; float f; memcpy(&f, &u, 4); return f; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return __nv_bfloat16{(uint16_t)((u >> 16) | 0x40)};
    u += 0x7fff + ((u >> 16) & 1);
    return __nv_bfloat16{(uint16_t)(u >> 16)};
}
