// Embedding lookup and its deterministic backward (bit-identical to the CPU).
#include "ops_common.cuh"

using namespace loom_cuda;

__global__ void embedding_fwd_kernel(const int32_t *ids, int64_t T, const void *W, loom_dtype wdt,
                                     int64_t H, void *out, loom_dtype odt) {
    const int64_t n = T * H, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t t = i / H, j = i - t * H;
        st(out, odt, i, ld(W, wdt, (int64_t)ids[t] * H + j));
    }
}

// One thread per column j adds dout[t, j] into dW[ids[t], j] for t in token
// order, as the CPU does. Tokens go in batches of EB: their ids and gradients
// are loaded together, then the row of each distinct id of the batch is read
// (all reads before any write, so they are in flight together), gets its
// tokens' gradients added in token order, and is written back; so the sums
// are the CPU's, bit for bit.
enum { EB = 16 };
__global__ void embedding_bwd_kernel(const int32_t *ids, int64_t T, const void *dout,
                                     loom_dtype ddt, int64_t H, float *dW) {
    const int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= H) return;
    for (int64_t t0 = 0; t0 < T; t0 += EB) {
        int32_t id[EB];
        float d[EB], w[EB];
        bool first[EB];
#pragma unroll
        for (int b = 0; b < EB; b++) {
            const bool in = t0 + b < T;
            id[b] = in ? ids[t0 + b] : -1;
            d[b] = in ? ld(dout, ddt, (t0 + b) * H + j) : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < EB; b++) {
            first[b] = id[b] >= 0;
#pragma unroll
            for (int c = 0; c < b; c++) first[b] = first[b] && id[c] != id[b];
            w[b] = first[b] ? dW[(int64_t)id[b] * H + j] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < EB; b++) {
            if (!first[b]) continue;
            float acc = w[b];
#pragma unroll
            for (int c = b; c < EB; c++)
                if (id[c] == id[b]) acc += d[c];
            dW[(int64_t)id[b] * H + j] = acc;
        }
    }
}

extern "C" loom_status loom_cuda_embedding_fwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                               const void *W, loom_dtype w_dtype, int64_t H,
                                               void *out, loom_dtype out_dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, w_dtype, "embedding_fwd", "W")) ||
        (st = need_float(ctx, out_dtype, "embedding_fwd", "out")))
        return st;
    if (T <= 0 || H <= 0) return LOOM_OK;
    embedding_fwd_kernel<<<grid_for(T * H, 256), 256, 0, as_stream(stream)>>>(ids, T, W, w_dtype, H,
                                                                             out, out_dtype);
    return check_launch(ctx, "embedding_fwd");
}

extern "C" loom_status loom_cuda_embedding_bwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                               const void *dout, loom_dtype dout_dtype, int64_t H,
                                               float *dW, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dout_dtype, "embedding_bwd", "dout"))) return st;
    if (T <= 0 || H <= 0 || !dW) return LOOM_OK;
    // One warp per block spreads the few columns over many multiprocessors.
    const int threads = 32;
    embedding_bwd_kernel<<<(unsigned)((H + threads - 1) / threads), threads, 0,
                           as_stream(stream)>>>(ids, T, dout, dout_dtype, H, dW);
    return check_launch(ctx, "embedding_bwd");
}
