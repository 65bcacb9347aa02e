// The emulator drivers' helpers (tests/emu/*_emu.cpp, one program each):
// random inputs (rounded to bf16 when BF and they are activations), "device"
// copies (host memory of the exact size), and the comparison that counts
// failures.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <vector>

extern int emu_order;
static uint64_t sd = 88172645463325252ull;
static float urand(float lo, float hi) { sd ^= sd << 13; sd ^= sd >> 7; sd ^= sd << 17; return lo + (hi - lo) * (float)((sd >> 11) * (1.0 / 9007199254740992.0)); }
static bool BF = false;
static float rb(float v) { return BF ? __bfloat162float(__float2bfloat16_rn(v)) : v; }
static std::vector<float> rnd(size_t n, float lo, float hi, bool act) { std::vector<float> v(n); for (auto &x : v) x = act ? rb(urand(lo, hi)) : urand(lo, hi); return v; }
// a device copy of an activation (bf16 or f32), exact size (ASan catches overruns)
static void *dev(const std::vector<float> &v, bool act) {
    if (act && BF) { __nv_bfloat16 *p = (__nv_bfloat16 *)malloc(v.size() * 2 + !v.size()); for (size_t i = 0; i < v.size(); i++) p[i] = __float2bfloat16_rn(v[i]); return p; }
    float *p = (float *)malloc(v.size() * 4 + !v.size()); memcpy(p, v.data(), v.size() * 4); return p;
}
static void *outb(size_t n, bool act) { size_t b = n * (act && BF ? 2 : 4); void *p = malloc(b); memset(p, 0xff, b); return p; }
static std::vector<float> back(void *p, size_t n, bool act) { std::vector<float> v(n); for (size_t i = 0; i < n; i++) v[i] = act && BF ? __bfloat162float(((__nv_bfloat16 *)p)[i]) : ((float *)p)[i]; return v; }
static int fails = 0;
static double cmp(const char *what, const std::vector<float> &a, const std::vector<float> &b, double tol) {
    double w = 0, m = 0; size_t wi = 0;
    for (size_t i = 0; i < a.size(); i++) { double d = fabs((double)a[i] - b[i]); if (!(d <= w)) { w = std::isnan(d) ? INFINITY : d; wi = i; } m = fmax(m, fabs((double)b[i])); }
    double e = w / (m > 0 ? m : 1);
    bool bad = !(e <= tol);
    if (bad) fails++;
    printf("  %-28s rel %.3g%s (worst at %zu: %g vs %g)\n", what, e, bad ? "  <<<<< FAIL" : "", wi, a[wi], b[wi]);
    return e;
}
