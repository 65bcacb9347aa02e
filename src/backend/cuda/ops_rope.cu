// RoPE (HF rotate_half) in place, with the CPU's exact angle rule: the angle
// is the fp32 product pos * inv_freq[i]; its cos and sin are computed in
// double and rounded to fp32; the rotation is plain fp32 (no FMA contraction).
#include "ops_common.cuh"

using namespace loom_cuda;

// One thread per (token, frequency): the angle once, then every head.
__global__ void rope_kernel(void *x, loom_dtype dt, int64_t T, int64_t nh, int64_t D, int64_t rd,
                            const int32_t *pos, const float *inv_freq, float sign) {
    const int64_t half = rd / 2, n = T * half, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += stride) {
        const int64_t t = idx / half, i = idx - t * half;
        const float ang = __fmul_rn((float)pos[t], inv_freq[i]);
        double sd, cd;
        sincos((double)ang, &sd, &cd);
        const float c = (float)cd, s = sign * (float)sd;
        for (int64_t h = 0; h < nh; h++) {
            const int64_t o = (t * nh + h) * D + i;
            const float x1 = ld(x, dt, o), x2 = ld(x, dt, o + half);
            st(x, dt, o, __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
            st(x, dt, o + half, __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
        }
    }
}

// cs[t * D/2 + i] = (cos, sin) of token t's angle for frequency i, the rule above.
__global__ void rope_table_kernel(const int32_t *pos, const float *inv_freq, int64_t T, int64_t half,
                                  float2 *cs) {
    grid_each(T * half, [&](int64_t idx) {
        const int64_t t = idx / half, i = idx - t * half;
        const float ang = __fmul_rn((float)pos[t], inv_freq[i]);
        double sd, cd;
        sincos((double)ang, &sd, &cd);
        cs[idx] = make_float2((float)cd, (float)sd);
    });
}

extern "C" loom_status loom_cuda_rope_table(loom_ctx *ctx, const int32_t *pos, int64_t T, int64_t D,
                                            const float *inv_freq, float *cs, void *stream) {
    if (D % 2)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda rope_table: head size %lld is odd", (long long)D);
    if (T <= 0 || D <= 0) return LOOM_OK;
    rope_table_kernel<<<grid_for(T * (D / 2), 256), 256, 0, as_stream(stream)>>>(pos, inv_freq, T, D / 2,
                                                                                (float2 *)cs);
    return check_launch(ctx, "rope_table");
}

static loom_status rope(loom_ctx *ctx, const char *op, void *x, loom_dtype dtype, int64_t T,
                        int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                        const float *inv_freq, float sign, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, op, "x"))) return st;
    if (rd % 2 || rd > D || rd < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda %s: %lld rotary dimensions of a head of %lld (even, at most the head)",
                         op, (long long)rd, (long long)D);
    if (T <= 0 || nh <= 0 || rd <= 0) return LOOM_OK;
    rope_kernel<<<grid_for(T * (rd / 2), 256), 256, 0, as_stream(stream)>>>(x, dtype, T, nh, D, rd,
                                                                           pos, inv_freq, sign);
    return check_launch(ctx, op);
}

extern "C" loom_status loom_cuda_rope_fwd(loom_ctx *ctx, void *x, loom_dtype dtype, int64_t T,
                                          int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                                          const float *inv_freq, void *stream) {
    return rope(ctx, "rope_fwd", x, dtype, T, nh, D, rd, pos, inv_freq, 1.0f, stream);
}

extern "C" loom_status loom_cuda_rope_bwd(loom_ctx *ctx, void *dx, loom_dtype dtype, int64_t T,
                                          int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                                          const float *inv_freq, void *stream) {
    // the rotation is orthogonal: its transpose is the rotation by -angle
    return rope(ctx, "rope_bwd", dx, dtype, T, nh, D, rd, pos, inv_freq, -1.0f, stream);
}
