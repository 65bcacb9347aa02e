// Gated DeltaNet's q and k L2 normalisation, both directions (launched by
// ops_gdn_rule.cu's driver: l2_fwd, l2_bwd): y = sc x r with r = (|x|^2 +
// 1e-6)^-1/2 per (token, key head) row of dk, sc = dk^-1/2 for q and 1 for
// k; the backward sums the gradients of a key head's value heads first.
//
// tests/test_backend_gdn.c holds them to the CPU's (through the rule, on an
// H200); `make test-emu` runs them on the CPU in CI.
#include "ops_gdn_rule.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {

// A row's factor 1 / sqrt(|x|^2 + eps) from its sum of squares (the CPU's
// eps, cpu_gdn's L2 normalisation); q's is further divided by sqrt(dk).
__device__ __forceinline__ float inv_norm(float ss) { return 1.0f / sqrtf(ss + 1e-6f); }

// qn, kn of row r = (t, hk) (where w has them: the fp32 kernels), or the
// row's factors rq, rk (the tensor-core kernels': they multiply qkv's bf16
// value by it where they need the fp32 one, the same product; the fp32 rows
// had been half of the bytes this kernel moved), and the bf16 roundings qb,
// kb: a warp per row. NA > 0 (dk <= 32 NA): a lane's elements loaded once,
// all in flight together (a loop of loads, read twice, took 32 us a layer
// at Qwen3.5-0.8B on an H200); NA = 0: any dk. The same sums either way.
template <int NA>
__global__ void l2_fwd_kernel(const void *qkv, loom_dtype dt, geo z, gdn_ws w) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= z.T * z.Hk)
        return;
    const int64_t t = r / z.Hk, hk = r % z.Hk;
    const int64_t qo = t * z.C + hk * z.dk, ko = qo + z.Hk * z.dk;
    constexpr int M = NA > 0 ? NA : 1;
    float qv[M], kv[M];
    float sq = 0.0f, sk = 0.0f;
    if constexpr (NA > 0) {
#pragma unroll
        for (int i = 0; i < NA; i++) {
            const int64_t a = lane + 32 * i;
            qv[i] = a < z.dk ? ld(qkv, dt, qo + a) : 0.0f;
            kv[i] = a < z.dk ? ld(qkv, dt, ko + a) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < z.dk)
                sq += qv[i] * qv[i], sk += kv[i] * kv[i];
    } else {
        for (int64_t a = lane; a < z.dk; a += 32) {
            const float q = ld(qkv, dt, qo + a), k = ld(qkv, dt, ko + a);
            sq += q * q;
            sk += k * k;
        }
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float rq = inv_norm(sq) / sqrtf((float)z.dk), rk = inv_norm(sk);
    if (w.rq && lane == 0)
        w.rq[r] = rq, w.rk[r] = rk;
    const auto out = [&](int64_t a, float rawq, float rawk) {
        const float q = rawq * rq, k = rawk * rk;
        if (w.qn)
            w.qn[r * z.dk + a] = q, w.kn[r * z.dk + a] = k;
        w.qb[r * z.dk + a] = __float2bfloat16_rn(q), w.kb[r * z.dk + a] = __float2bfloat16_rn(k);
    };
    if constexpr (NA > 0) {
#pragma unroll
        for (int i = 0; i < NA; i++)
            if (lane + 32 * i < z.dk)
                out(lane + 32 * i, qv[i], kv[i]);
    } else {
        for (int64_t a = lane; a < z.dk; a += 32)
            out(a, ld(qkv, dt, qo + a), ld(qkv, dt, ko + a));
    }
}

// l2_fwd_kernel's sums for bf16 rows by half-warps where only the factors
// and the bf16 roundings are kept (no qn, kn; l2_fwd_half_ok): lane l of a
// half takes the columns 8 (l % 16).. of its row, one 16-byte access of q
// and of k, the sums by shuffles over the half (so they round otherwise than
// l2_fwd_kernel's); a block's 16 halves the rows r0 + u and r0 + u + 16,
// both in flight together. (l2_fwd_kernel's 2-byte accesses, 32 lanes a
// row: 100 us a layer at Qwen3.5-0.8B's 16384 tokens on an H200.)
__global__ void __launch_bounds__(NT) l2_fwd_h_kernel(const void *qkv, geo z, gdn_ws w) {
    constexpr int HV = NT / 16;
    const int64_t n = z.T * z.Hk, r0 = (int64_t)blockIdx.x * 2 * HV + (threadIdx.x >> 4);
    const int64_t j = 8 * (threadIdx.x & 15);
    const __nv_bfloat16 *x = (const __nv_bfloat16 *)qkv;
    uint4 qr[2], kr[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int64_t r = r0 + k * HV, t = r / z.Hk, hk = r % z.Hk;
        const bool on = r < n && j < z.dk;
        const int64_t qo = t * z.C + hk * z.dk + j, ko = qo + z.Hk * z.dk;
        qr[k] = ld16_or0(x + qo, on);
        kr[k] = ld16_or0(x + ko, on);
    }
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int64_t r = r0 + k * HV;
        float q[8], kv[8], sq = 0.0f, sk = 0.0f;
        cvt8<__nv_bfloat16>(qr[k], q);
        cvt8<__nv_bfloat16>(kr[k], kv);
#pragma unroll
        for (int i = 0; i < 8; i++)
            sq += q[i] * q[i], sk += kv[i] * kv[i];
        sq = half_sum(sq);
        sk = half_sum(sk);
        const float rq = inv_norm(sq) / sqrtf((float)z.dk), rk = inv_norm(sk);
        if (r >= n)
            continue;
        if (w.rq && j == 0)
            w.rq[r] = rq, w.rk[r] = rk;
        if (j < z.dk) {
#pragma unroll
            for (int i = 0; i < 8; i++)
                q[i] *= rq, kv[i] *= rk;
            st8(w.qb + r * z.dk + j, q);
            st8(w.kb + r * z.dk + j, kv);
        }
    }
}

// Whether l2_fwd_h_kernel takes the forward: bf16, dk <= 128 and dk, C
// multiples of 8, qkv and the roundings 16-byte aligned, no fp32 rows kept.
bool l2_fwd_half_ok(loom_dtype dt, const geo &z, const void *qkv, const gdn_ws &w) {
    return dt == LOOM_BF16 && !w.qn && z.dk <= 128 && z.dk % 8 == 0 && z.C % 8 == 0 &&
           aligned16(qkv) && aligned16(w.qb) && aligned16(w.kb);
}

// l2_bwd_kernel's sums (below) for bf16 rows by a half-warp: lane l of a
// half takes the columns 8 (l % 16).. of its row, one 16-byte access of x
// and two of each dy row (G, a bound on grp), the row's sums by shuffles
// over the half (so they round otherwise than l2_bwd_kernel's). l2_half_ok
// says where it applies. (l2_bwd_kernel's 2-byte x and 4-byte dy loads, 32
// lanes a row, moved 2.2 TB/s: 242 us a layer at Qwen3.5-0.8B's 16384
// tokens on an H200.)
template <int G> struct l2_bwd_half {
    uint4 xr[2];
    float4 yr[2][G][2];
    int64_t t, hk;
    bool on; // a row of this half, and the lane's columns in it
    __device__ __forceinline__ int64_t off(const geo &z, int which) const {
        return t * z.C + which * z.Hk * z.dk + hk * z.dk + 8 * (threadIdx.x & 15);
    }
    __device__ __forceinline__ void load(const void *qkv, const geo &z, int64_t t_, int64_t hk_,
                                         bool row, const float *dqh, const float *dkh) {
        const int64_t j = 8 * (threadIdx.x & 15);
        t = t_, hk = hk_, on = row && j < z.dk;
        const float4 f0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int which = 0; which < 2; which++) {
            const float *src = (which ? dkh : dqh) + (t * z.Hv + hk * z.grp) * z.dk + j;
            xr[which] = ld16_or0((const __nv_bfloat16 *)qkv + off(z, which), on);
#pragma unroll
            for (int h = 0; h < G; h++) {
                const bool in = on && h < z.grp;
                yr[which][h][0] = in ? *(const float4 *)(src + h * z.dk) : f0;
                yr[which][h][1] = in ? *(const float4 *)(src + h * z.dk + 4) : f0;
            }
        }
    }
    // every lane of the warp calls it (shuffles)
    __device__ __forceinline__ void out(const geo &z, void *dqkv) const {
#pragma unroll
        for (int which = 0; which < 2; which++) {
            const float sc = which ? 1.0f : 1.0f / sqrtf((float)z.dk);
            float x[8], dv[8], ss = 0.0f, xd = 0.0f;
            cvt8<__nv_bfloat16>(xr[which], x);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                dv[i] = 0.0f;
#pragma unroll
                for (int h = 0; h < G; h++) {
                    const float4 v = yr[which][h][i >> 2];
                    const float e = (i & 3) == 0 ? v.x : (i & 3) == 1 ? v.y : (i & 3) == 2 ? v.z : v.w;
                    if (h < z.grp)
                        dv[i] += e;
                }
                ss += x[i] * x[i], xd += x[i] * dv[i];
            }
            ss = half_sum(ss);
            xd = half_sum(xd);
            const float rr = inv_norm(ss), c = rr * rr * rr * xd;
            if (on) {
                float o[8];
#pragma unroll
                for (int i = 0; i < 8; i++)
                    o[i] = sc * (rr * dv[i] - c * x[i]);
                st8((__nv_bfloat16 *)dqkv + off(z, which), o);
            }
        }
    }
};

// Whether l2_bwd_half takes these rows: bf16, dk <= 128 and dk, C multiples
// of 8, qkv, dqkv, dqh and dkh 16-byte aligned, grp 1, 2 or 4.
inline bool l2_half_ok(loom_dtype dt, const geo &z, const void *qkv, const void *dqkv,
                       const void *dqh, const void *dkh) {
    return dt == LOOM_BF16 && z.dk <= 128 && z.dk % 8 == 0 && z.C % 8 == 0 && aligned16(qkv) &&
           aligned16(dqkv) && aligned16(dqh) && aligned16(dkh) &&
           (z.grp == 1 || z.grp == 2 || z.grp == 4);
}

// d of the normalised rows (the group's value heads summed in order) ->
// d of the raw ones: y = sc x r, r = (|x|^2 + 1e-6)^-1/2: dx = sc (r dy - r^3
// (x . dy) x). A warp per (t, hk); q (sc = dk^-1/2), then k (sc = 1).
// NA > 0 (dk <= 32 NA, grp <= L2_GRP): a lane's NA elements of x and of each
// of the group's dy rows, q's and k's, are loaded into registers before any
// is used, all of them in flight together (the group's rows summed in a loop
// of dependent loads took 163 us a layer at Qwen3.5-4B's shapes on an H200,
// about 1.2 TB/s); NA = 0: any dk and grp, in passes. The same sums in the
// same order either way.
constexpr int L2_GRP = 4;
template <int NA>
__global__ void l2_bwd_kernel(const void *qkv, loom_dtype dt, geo z, const float *dqh,
                              const float *dkh, void *dqkv) {
    const int lane = threadIdx.x & 31;
    const int64_t r = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (r >= z.T * z.Hk)
        return;
    const int64_t t = r / z.Hk, hk = r % z.Hk, h0 = hk * z.grp;
    auto off = [&](int which) { return t * z.C + which * z.Hk * z.dk + hk * z.dk; };
    auto src = [&](int which) { return (which ? dkh : dqh) + (t * z.Hv + h0) * z.dk; };
    if constexpr (NA > 0) {
        float xv[2][NA], yv[2][NA][L2_GRP];
#pragma unroll
        for (int which = 0; which < 2; which++)
#pragma unroll
            for (int i = 0; i < NA; i++) {
                const int64_t a = lane + 32 * i;
                xv[which][i] = a < z.dk ? ld(qkv, dt, off(which) + a) : 0.0f;
#pragma unroll
                for (int h = 0; h < L2_GRP; h++)
                    yv[which][i][h] = a < z.dk && h < z.grp ? src(which)[h * z.dk + a] : 0.0f;
            }
#pragma unroll
        for (int which = 0; which < 2; which++) {
            const float sc = which ? 1.0f : 1.0f / sqrtf((float)z.dk);
            float dv[NA], ss = 0.0f, xd = 0.0f;
#pragma unroll
            for (int i = 0; i < NA; i++) {
                dv[i] = 0.0f;
#pragma unroll
                for (int h = 0; h < L2_GRP; h++)
                    if (h < z.grp)
                        dv[i] += yv[which][i][h];
            }
#pragma unroll
            for (int i = 0; i < NA; i++)
                if (lane + 32 * i < z.dk)
                    ss += xv[which][i] * xv[which][i], xd += xv[which][i] * dv[i];
            ss = warp_sum(ss);
            xd = warp_sum(xd);
            const float rr = inv_norm(ss), c = rr * rr * rr * xd;
#pragma unroll
            for (int i = 0; i < NA; i++)
                if (lane + 32 * i < z.dk)
                    st(dqkv, dt, off(which) + lane + 32 * i,
                       sc * (rr * dv[i] - c * xv[which][i]));
        }
    } else {
#pragma unroll
        for (int which = 0; which < 2; which++) {
            const int64_t o = off(which);
            const float *y = src(which);
            const float sc = which ? 1.0f : 1.0f / sqrtf((float)z.dk);
            auto dyn = [&](int64_t a) {
                float s = 0.0f;
                for (int64_t h = 0; h < z.grp; h++)
                    s += y[h * z.dk + a];
                return s;
            };
            float ss = 0.0f, xd = 0.0f;
            for (int64_t a = lane; a < z.dk; a += 32) {
                const float x = ld(qkv, dt, o + a);
                ss += x * x;
                xd += x * dyn(a);
            }
            ss = warp_sum(ss);
            xd = warp_sum(xd);
            const float rr = inv_norm(ss), c = rr * rr * rr * xd;
            for (int64_t a = lane; a < z.dk; a += 32)
                st(dqkv, dt, o + a, sc * (rr * dyn(a) - c * ld(qkv, dt, o + a)));
        }
    }
}

// l2_bwd_kernel's bf16 twin by half-warps (l2_half_ok, G >= grp): a block's
// 16 halves take the rows r0 + u and r0 + u + 16, both in flight together.
template <int G>
__global__ void __launch_bounds__(NT) l2_bwd_h_kernel(const void *qkv, geo z, const float *dqh,
                                                      const float *dkh, void *dqkv) {
    constexpr int HV = NT / 16;
    const int64_t n = z.T * z.Hk, r0 = (int64_t)blockIdx.x * 2 * HV + (threadIdx.x >> 4);
    l2_bwd_half<G> a[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const int64_t r = r0 + k * HV;
        a[k].load(qkv, z, r / z.Hk, r % z.Hk, r < n, dqh, dkh);
    }
#pragma unroll
    for (int k = 0; k < 2; k++)
        a[k].out(z, dqkv);
}

} // namespace

namespace loom_gdn {

loom_status l2_fwd(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt, const geo &z,
                   const gdn_ws &w, cudaStream_t s) {
    if (l2_fwd_half_ok(dt, z, qkv, w)) {
        l2_fwd_h_kernel<<<(unsigned)((z.T * z.Hk + 2 * (NT / 16) - 1) / (2 * (NT / 16))), NT, 0,
                          s>>>(qkv, z, w);
        return check_launch(ctx, op);
    }
    auto l2f = z.dk <= 128 ? l2_fwd_kernel<4> : l2_fwd_kernel<0>;
    l2f<<<(unsigned)((z.T * z.Hk + WARPS - 1) / WARPS), NT, 0, s>>>(qkv, dt, z, w);
    return check_launch(ctx, op);
}

loom_status l2_bwd(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt, const geo &z,
                   const gdn_ws &w, void *dqkv, cudaStream_t s) {
    const int64_t rows = z.T * z.Hk;
    if (l2_half_ok(dt, z, qkv, dqkv, w.dqh, w.dkh)) {
        auto l2h = z.grp == 1   ? l2_bwd_h_kernel<1>
                   : z.grp == 2 ? l2_bwd_h_kernel<2>
                                : l2_bwd_h_kernel<4>;
        l2h<<<(unsigned)((rows + 2 * (NT / 16) - 1) / (2 * (NT / 16))), NT, 0, s>>>(qkv, z, w.dqh,
                                                                                 w.dkh, dqkv);
        return check_launch(ctx, op);
    }
    auto l2b = z.dk <= 128 && z.grp <= L2_GRP ? l2_bwd_kernel<4> : l2_bwd_kernel<0>;
    l2b<<<(unsigned)((rows + WARPS - 1) / WARPS), NT, 0, s>>>(qkv, dt, z, w.dqh, w.dkh, dqkv);
    return check_launch(ctx, op);
}

} // namespace loom_gdn
