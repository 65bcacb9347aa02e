#pragma once
struct __half {
    _Float16 x;
    explicit operator float() const { return (float)x; }
};
inline float __half2float(__half h) { return (float)h.x; }
inline __half __float2half_rn(float f) { return __half{(_Float16)f}; }
