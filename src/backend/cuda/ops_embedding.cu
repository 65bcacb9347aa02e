// Embedding lookup and its deterministic backward (bit-identical to the CPU):
// the vocab-parallel kernels of ops_glue.cu with the whole table on this rank.
#include <stdint.h>

#include "cuda_glue.h"
#include "ops_common.cuh"

using namespace loom_cuda;

// The dtypes are checked here so that those errors name this op; ids are
// trusted to lie in [0, V), so no token falls outside the "rank's" rows.
extern "C" loom_status loom_cuda_embedding_fwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                               const void *W, loom_dtype w_dtype, int64_t H,
                                               void *out, loom_dtype out_dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, w_dtype, "embedding_fwd", "W")) ||
        (st = need_float(ctx, out_dtype, "embedding_fwd", "out")))
        return st;
    return loom_cuda_embedding_vp_fwd(ctx, ids, T, W, w_dtype, 0, INT64_MAX, H, out, out_dtype,
                                      stream);
}

extern "C" loom_status loom_cuda_embedding_bwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                               const void *dout, loom_dtype dout_dtype, int64_t H,
                                               float *dW, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dout_dtype, "embedding_bwd", "dout"))) return st;
    return loom_cuda_embedding_vp_bwd(ctx, ids, T, dout, dout_dtype, 0, INT64_MAX, H, dW, stream);
}
