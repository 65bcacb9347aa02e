// Cross-entropy over the first V of Vp logit columns: one block per token.
// Max in fp32 (exact); exp in fp32 (the CPU's is double: the difference is
// ~1e-7 relative, and double exp made these kernels compute-bound); sums of
// exp and the entropy in double, as the CPU.
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {
constexpr int NT = 256;     // threads per row
constexpr int NT_SUM = 1024; // threads of the loss sum
} // namespace

__global__ void __launch_bounds__(NT)
    xent_fwd_kernel(const void *logits, loom_dtype dt, const int32_t *targets, int64_t V,
                    int64_t Vp, float *token_logprob, float *entropy, float *lse,
                    double *token_loss) {
    __shared__ double shd[NT / 32];
    __shared__ float shf[NT / 32];
    const int64_t t = blockIdx.x, base = t * Vp;
    float mx = -INFINITY;
    for (int64_t c = threadIdx.x; c < V; c += NT) mx = fmaxf(mx, ld(logits, dt, base + c));
    const double m = (double)block_max<NT>(mx, shf);
    // sum exp(z - m), sum exp(z - m) * (z - m): z - m is exact in double; its
    // exp in fp32 (within 2 ulp, relative error ~1e-7 |z - m|), sums in double
    double s = 0, sz = 0;
    for (int64_t c = threadIdx.x; c < V; c += NT) {
        double d = (double)ld(logits, dt, base + c) - m, e = (double)expf((float)d);
        s += e;
        sz += e * d;
    }
    s = block_sum<NT>(s, shd);
    sz = block_sum<NT>(sz, shd);
    if (threadIdx.x == 0) {
        const int32_t tg = targets[t];
        const double ls = log(s); // lse - m
        if (entropy) entropy[t] = (float)(ls - sz / s);
        if (lse) lse[t] = (float)(m + ls);
        double lp = tg < 0 ? 0.0 : (double)ld(logits, dt, base + tg) - m - ls;
        if (token_logprob) token_logprob[t] = (float)lp;
        if (token_loss) token_loss[t] = -lp;
    }
}

// *loss = sum_t token_loss[t]: thread i sums t = i, i + NT_SUM, ... then a fixed tree.
__global__ void __launch_bounds__(NT_SUM) xent_sum_kernel(const double *token_loss, int64_t T,
                                                          double *loss) {
    __shared__ double sh[NT_SUM / 32];
    double acc = 0;
    for (int64_t t = threadIdx.x; t < T; t += NT_SUM) acc += token_loss[t];
    acc = block_sum<NT_SUM>(acc, sh);
    if (threadIdx.x == 0) *loss = acc;
}

__global__ void __launch_bounds__(NT)
    xent_bwd_kernel(const void *logits, loom_dtype dt, const float *lse, const int32_t *targets,
                    int64_t V, int64_t Vp, float scale, void *dlogits, loom_dtype ddt) {
    const int64_t t = blockIdx.x, base = t * Vp;
    const int32_t tg = targets[t];
    if (tg < 0) {
        for (int64_t c = threadIdx.x; c < Vp; c += NT) st(dlogits, ddt, base + c, 0.0f);
        return;
    }
    const double l = (double)lse[t];
    for (int64_t c = threadIdx.x; c < V; c += NT) { // each element read, then written, by one thread
        double p = (double)expf((float)((double)ld(logits, dt, base + c) - l));
        st(dlogits, ddt, base + c, (float)((double)scale * (p - (c == tg ? 1.0 : 0.0))));
    }
    for (int64_t c = V + threadIdx.x; c < Vp; c += NT) st(dlogits, ddt, base + c, 0.0f);
}

static loom_status check_shape(loom_ctx *ctx, const char *op, int64_t T, int64_t V, int64_t Vp) {
    if (T < 0 || V < 1 || V > Vp)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda %s: bad shape T=%lld V=%lld Vp=%lld", op,
                         (long long)T, (long long)V, (long long)Vp);
    if (T > 0x7fffffffLL)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda %s: T=%lld rows is too many for one call",
                         op, (long long)T);
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_cross_entropy_fwd(loom_ctx *ctx, const void *logits,
                                                   loom_dtype dtype, const int32_t *targets,
                                                   int64_t T, int64_t V, int64_t Vp,
                                                   float *token_logprob, float *entropy,
                                                   float *lse, double *token_loss, double *loss,
                                                   void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "cross_entropy_fwd", "logits")) ||
        (st = check_shape(ctx, "cross_entropy_fwd", T, V, Vp)))
        return st;
    if (loss && !token_loss)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda cross_entropy_fwd: the loss sum needs the token_loss buffer (T doubles)");
    cudaStream_t s = as_stream(stream);
    if (T > 0) {
        xent_fwd_kernel<<<(unsigned)T, NT, 0, s>>>(logits, dtype, targets, V, Vp, token_logprob,
                                                   entropy, lse, token_loss);
        if ((st = check_launch(ctx, "cross_entropy_fwd"))) return st;
    }
    if (loss) {
        xent_sum_kernel<<<1, NT_SUM, 0, s>>>(token_loss, T, loss);
        if ((st = check_launch(ctx, "cross_entropy_fwd"))) return st;
    }
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_cross_entropy_bwd(loom_ctx *ctx, const void *logits,
                                                   loom_dtype dtype, const float *lse,
                                                   const int32_t *targets, int64_t T, int64_t V,
                                                   int64_t Vp, float scale, void *dlogits,
                                                   loom_dtype dlogits_dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "cross_entropy_bwd", "logits")) ||
        (st = need_float(ctx, dlogits_dtype, "cross_entropy_bwd", "dlogits")) ||
        (st = check_shape(ctx, "cross_entropy_bwd", T, V, Vp)))
        return st;
    if (logits == dlogits && dtype != dlogits_dtype)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda cross_entropy_bwd: dlogits aliases logits with another dtype (%s vs %s)",
                         loom_dtype_name(dlogits_dtype), loom_dtype_name(dtype));
    if (T == 0) return LOOM_OK;
    xent_bwd_kernel<<<(unsigned)T, NT, 0, as_stream(stream)>>>(logits, dtype, lse, targets, V, Vp,
                                                               scale, dlogits, dlogits_dtype);
    return check_launch(ctx, "cross_entropy_bwd");
}
