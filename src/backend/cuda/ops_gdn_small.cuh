// Shared by Gated DeltaNet's small ops (ops_gdn.cu: the convolution, the
// gates and the sums' last step; ops_gdn_norm.cu: the gated RMSNorm): block
// sizes, the fixed split of a parameter gradient's sum over rows into
// chunks, and the chunks' final sum. Internal to the CUDA backend.
#ifndef LOOM_CUDA_OPS_GDN_SMALL_CUH
#define LOOM_CUDA_OPS_GDN_SMALL_CUH

#include "ops_common.cuh"

namespace loom_gdn_small {

constexpr int NT = 256;        // threads per block
constexpr int WARPS = NT / 32; // rows per block of the norm's row kernels

// Rows per chunk of a reduction over n rows: 64, or more so that there are
// at most 1024 chunks. A function of n only: the sums' order is fixed.
inline int64_t red_rows(int64_t n) {
    int64_t r = 64;
    if ((n + r - 1) / r > 1024)
        r = (n + 1023) / 1024;
    return r;
}
inline int64_t red_chunks(int64_t n) { return n > 0 ? (n + red_rows(n) - 1) / red_rows(n) : 0; }

// sigmoid in fp32: IEEE division and expf
__device__ __forceinline__ float sigm(float x) { return 1.0f / (1.0f + expf(-x)); }
// the hardware's approximations (__expf, __fdividef: a few ulp), for 16-bit
// data, whose rounding is 2^-8 or 2^-11 of the value
__device__ __forceinline__ float sigm_fast(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// out0[col] += the sum over the nchunk chunks of partial[chunk][col] (ncols
// doubles a chunk) for col < n0, out1[col - n0] for the columns after; a
// NULL output's columns are skipped. In an order fixed by the shape.
loom_status col_final(loom_ctx *ctx, const char *op, const void *partial, int64_t nchunk,
                      int64_t ncols, int64_t n0, float *out0, float *out1, cudaStream_t s);

// The error for a parameter gradient asked for without the op's scratch.
loom_status no_scratch(loom_ctx *ctx, const char *op);

} // namespace loom_gdn_small

#endif
