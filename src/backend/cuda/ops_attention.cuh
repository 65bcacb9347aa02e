// Internal to the attention kernels (ops_attention.cu: CUDA-core path and the
// dispatch; ops_attention_mma.cu: tensor-core path for BF16/F16).
#ifndef LOOM_CUDA_OPS_ATTENTION_CUH
#define LOOM_CUDA_OPS_ATTENTION_CUH

#include "ops_common.cuh"

namespace loom_cuda {

constexpr int ATTN_NT = 128; // threads per block of every attention kernel

// What every attention kernel reads and writes.
struct attn_args {
    const void *q, *k, *v, *out, *dout;
    const int32_t *qidx, *cu;
    int64_t Tq, T, ndocs;
    int Hq, Hkv, D;
    float scale;
    loom_dtype dt;
    const float *lse_in; // backward input
    void *o;             // forward output
    float *lse;          // forward output
    void *dq, *dk, *dv;  // backward outputs
    float *di;           // backward scratch (Tq, Hq): D_i = dout_i . out_i, from the dq
                         // kernel to the dk/dv kernel (tensor-core path)
    float *dkv_part;     // backward scratch (2, T, Hq, D): dK, dV of each query head
                         // (tensor-core path), added over the groups at the end
    float *dq_acc;       // fused backward scratch (Tq, Hq, D): dQ / scale in fp32
};

// Start and end of the document holding token t (cu[lo] <= t < cu[lo + 1]).
__device__ __forceinline__ void doc_bounds(const int32_t *cu, int64_t ndocs, int64_t t, int64_t *s,
                                           int64_t *e) {
    int64_t lo = 0, hi = ndocs;
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    *s = cu[lo];
    *e = cu[hi];
}

// First local query whose global index is >= g (qidx ascending; NULL: identity).
__device__ __forceinline__ int64_t first_query_at(const int32_t *qidx, int64_t Tq, int64_t g) {
    if (!qidx) return g < Tq ? g : Tq;
    int64_t lo = 0, hi = Tq;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (qidx[mid] < g)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

// Query row metadata of a tile of ROWS queries starting at local query t0
// with n valid rows: global index (-1 past n), document start (INT_MAX past
// n), and with BWD lse and (DI) D_i = dout_i . out_i (double, a warp per
// row), by NTH threads. Needs a __syncthreads() before use.
template <bool BWD, int ROWS, bool DI = BWD, int NTH = ATTN_NT>
__device__ __forceinline__ void load_rows(const attn_args &a, int64_t t0, int n, int h, int *gi_s,
                                          int *ds_s, float *lse_s, float *di_s) {
    const int tid = threadIdx.x;
    for (int r = tid; r < ROWS; r += NTH) {
        int gi = -1, ds = 0x7fffffff;
        float l = 0.0f;
        if (r < n) {
            int64_t g = a.qidx ? a.qidx[t0 + r] : t0 + r, s, e;
            doc_bounds(a.cu, a.ndocs, g, &s, &e);
            gi = (int)g;
            ds = (int)s;
            if constexpr (BWD) l = a.lse_in[(t0 + r) * a.Hq + h];
        }
        gi_s[r] = gi;
        ds_s[r] = ds;
        if constexpr (BWD) lse_s[r] = l;
    }
    if constexpr (DI) {
        const int lane = tid & 31;
        for (int r = tid >> 5; r < ROWS; r += NTH / 32) {
            double acc = 0;
            if (r < n) {
                const int64_t off = ((t0 + r) * a.Hq + h) * (int64_t)a.D;
                for (int d = lane; d < a.D; d += 32)
                    acc += (double)ld(a.dout, a.dt, off + d) * (double)ld(a.out, a.dt, off + d);
            }
            acc = warp_sum(acc);
            if (lane == 0) di_s[r] = (float)acc;
        }
    }
}

// The tensor-core path (ops_attention_mma.cu): BF16/F16, D of 64 or 128, every
// tensor 16-byte aligned. Returns false, launching nothing, when a case is not
// its own; else launches and sets *st.
bool attn_mma_fwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s, loom_status *st);
bool attn_mma_bwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s, loom_status *st);

} // namespace loom_cuda

#endif
