// The once-per-rank expert-parallel dispatch's tables (cpu_moe.h's
// loom_cpu_moe_dest, _dedup_meta, _mask, _dedup_dw): one thread a token or
// a sent row, integer work and one fp32 sum in the CPU's order, so the
// tables are the CPU's bit for bit.
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {

__global__ void dest_kernel(const int32_t *__restrict__ idx, int64_t N, int k, int64_t El, int P,
                            int32_t *__restrict__ dest) {
    grid_each(N, [&](int64_t n) {
        for (int p = 0; p < P; p++)
            dest[n * P + p] = P;
        for (int j = 0; j < k; j++) {
            const int32_t p = (int32_t)(idx[n * k + j] / El);
            dest[n * P + p] = p;
        }
    });
}

__global__ void meta_kernel(const int32_t *__restrict__ ord, int64_t U, const int32_t *__restrict__ idx,
                            const float *__restrict__ w, int k, int64_t El, int P,
                            int32_t *__restrict__ tok, int32_t *__restrict__ mid,
                            float *__restrict__ mw) {
    grid_each(U, [&](int64_t i) {
        const int64_t t = ord[i] / P, p = ord[i] % P;
        tok[i] = (int32_t)t;
        for (int j = 0; j < k; j++) {
            const int64_t e = idx[t * k + j] - p * El;
            mid[i * k + j] = (int32_t)(e >= 0 && e < El ? e : El);
            mw[i * k + j] = w[t * k + j];
        }
    });
}

__global__ void mask_kernel(const int32_t *__restrict__ key, int64_t C, int32_t none,
                            int32_t *__restrict__ order, int32_t *__restrict__ pos) {
    grid_each(C, [&](int64_t c) {
        if (key[c] == none) {
            order[pos[c]] = (int32_t)(-1 - c);
            pos[c] = -1;
        }
    });
}

__global__ void dw_kernel(const float *__restrict__ dwb, const int32_t *__restrict__ pos, int64_t N,
                          int P, int k, float *__restrict__ dw) {
    grid_each(N * k, [&](int64_t c) {
        const int64_t n = c / k;
        const int j = (int)(c % k);
        float s = 0.0f;
        for (int p = 0; p < P; p++) {
            const int32_t u = pos[n * P + p];
            if (u >= 0)
                s += dwb[(int64_t)u * k + j];
        }
        dw[c] = s;
    });
}

} // namespace

extern "C" loom_status loom_cuda_moe_dest(loom_ctx *ctx, const int32_t *idx, int64_t N, int k,
                                          int64_t El, int P, int32_t *dest, void *stream) {
    if (N <= 0)
        return LOOM_OK;
    dest_kernel<<<grid_for(N, 256), 256, 0, as_stream(stream)>>>(idx, N, k, El, P, dest);
    return check_launch(ctx, "moe_dest");
}

extern "C" loom_status loom_cuda_moe_dedup_meta(loom_ctx *ctx, const int32_t *ord, int64_t U,
                                                const int32_t *idx, const float *w, int k,
                                                int64_t El, int P, int32_t *tok, int32_t *mid,
                                                float *mw, void *stream) {
    if (U <= 0)
        return LOOM_OK;
    meta_kernel<<<grid_for(U, 256), 256, 0, as_stream(stream)>>>(ord, U, idx, w, k, El, P, tok, mid,
                                                                 mw);
    return check_launch(ctx, "moe_dedup_meta");
}

extern "C" loom_status loom_cuda_moe_mask(loom_ctx *ctx, const int32_t *key, int64_t N, int k,
                                          int32_t none, int32_t *order, int32_t *pos, void *stream) {
    if (N <= 0)
        return LOOM_OK;
    mask_kernel<<<grid_for(N * k, 256), 256, 0, as_stream(stream)>>>(key, N * k, none, order, pos);
    return check_launch(ctx, "moe_mask");
}

extern "C" loom_status loom_cuda_moe_dedup_dw(loom_ctx *ctx, const float *dwb, const int32_t *pos,
                                              int64_t N, int P, int k, float *dw, void *stream) {
    if (N <= 0)
        return LOOM_OK;
    dw_kernel<<<grid_for(N * k, 256), 256, 0, as_stream(stream)>>>(dwb, pos, N, P, k, dw);
    return check_launch(ctx, "moe_dedup_dw");
}
