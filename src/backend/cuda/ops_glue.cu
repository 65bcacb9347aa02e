// Glue ops of the model (cuda_glue.h): vocab-parallel embedding and
// cross-entropy pieces, context-parallel row permutations, LoRA dropout, and
// memset/memcpy on a stream. Each is the CPU op of src/backend/cpu/glue.c
// with the same arithmetic; the reductions run in a fixed order.
#include "../../core/rng.h"
#include "cuda_glue.h"
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {
constexpr int NT = 256; // threads per row of the per-row kernels
constexpr int EB = 16;  // tokens per batch of the embedding backward

// Blocks for a loop over n rows, one block per row while that fits.
unsigned rows_grid(int64_t n) { return grid_for(n, 1); }

loom_status bad_shape(loom_ctx *ctx, const char *op, const char *what, long long v) {
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda %s: bad %s %lld", op, what, v);
}
} // namespace

/* ---------------- vocab-parallel embedding ---------------- */

// One block per token (rows looped when T exceeds the grid): the in-range test
// is made once per row, and the row's columns are read and written coalesced.
__global__ void __launch_bounds__(NT)
    embedding_vp_fwd_kernel(const int32_t *ids, int64_t T, const void *W, loom_dtype wdt,
                            int64_t row0, int64_t rows, int64_t H, void *out, loom_dtype odt) {
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const int64_t r = (int64_t)ids[t] - row0;
        const bool here = r >= 0 && r < rows;
        for (int64_t j = threadIdx.x; j < H; j += NT)
            st(out, odt, t * H + j, here ? ld(W, wdt, r * H + j) : 0.0f);
    }
}

// One thread per column j adds dout[t, j] into dW[ids[t] - row0, j] for t in
// token order, as the CPU does; tokens of other ranks are skipped. The rows
// are split over gridDim.y groups (a power of 2; row r to group
// r & (groups - 1)), a block taking its group's tokens only: all tokens of a
// row stay with one thread per column, in token order, and there are
// gridDim.y times more threads (one per column alone was latency-bound: 2.5
// ms for 8192 tokens). The block's warp first lists its tokens of a tile in
// order (ballot compaction into shared memory: reading every id from global
// memory in every block was a hot spot). Then they go in batches of EB:
// their gradients are loaded together, the dW row of each distinct id of the
// batch is read (all reads before any write, so they are in flight
// together), gets its tokens' gradients added in token order, and is written
// back: the CPU's sums, bit for bit.
constexpr int EMB_TILE = 512; // tokens listed per pass (4 KiB of shared memory)
__global__ void __launch_bounds__(32)
    embedding_vp_bwd_kernel(const int32_t *ids, int64_t T, const void *dout, loom_dtype ddt,
                            int64_t row0, int64_t rows, int64_t H, float *dW) {
    __shared__ int32_t tok[EMB_TILE];
    __shared__ int32_t rid[EMB_TILE]; // row - row0: in [0, rows) and below an int32 id
    const int lane = threadIdx.x;
    const int64_t j = (int64_t)blockIdx.x * 32 + lane;
    const int64_t gmask = (int64_t)gridDim.y - 1, grp = blockIdx.y;
    const bool live = j < H;
    for (int64_t base = 0; base < T; base += EMB_TILE) {
        int n = 0;
        for (int k = 0; k < EMB_TILE; k += 32) {
            const int64_t t = base + k + lane;
            const int64_t r = t < T ? (int64_t)ids[t] - row0 : -1;
            const bool mine = r >= 0 && r < rows && (r & gmask) == grp;
            const unsigned bal = __ballot_sync(0xffffffffu, mine);
            if (mine) {
                const int at = n + __popc(bal & ((1u << lane) - 1u));
                tok[at] = (int32_t)(t - base), rid[at] = (int32_t)r;
            }
            n += __popc(bal);
        }
        __syncwarp();
        for (int i0 = 0; live && i0 < n; i0 += EB) {
            int64_t id[EB];
            float d[EB], w[EB];
            bool first[EB];
#pragma unroll
            for (int b = 0; b < EB; b++) {
                id[b] = i0 + b < n ? rid[i0 + b] : -1;
                d[b] = id[b] >= 0 ? ld(dout, ddt, (base + tok[i0 + b]) * H + j) : 0.0f;
            }
#pragma unroll
            for (int b = 0; b < EB; b++) {
                first[b] = id[b] >= 0;
#pragma unroll
                for (int c = 0; c < b; c++) first[b] = first[b] && id[c] != id[b];
                w[b] = first[b] ? dW[id[b] * H + j] : 0.0f;
            }
#pragma unroll
            for (int b = 0; b < EB; b++) {
                if (!first[b]) continue;
                float acc = w[b];
#pragma unroll
                for (int c = b; c < EB; c++)
                    if (id[c] == id[b]) acc += d[c];
                dW[id[b] * H + j] = acc;
            }
        }
        __syncwarp();
    }
}

extern "C" loom_status loom_cuda_embedding_vp_fwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                                  const void *W, loom_dtype w_dtype, int64_t row0,
                                                  int64_t rows, int64_t H, void *out,
                                                  loom_dtype out_dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, w_dtype, "embedding_vp_fwd", "W")) ||
        (st = need_float(ctx, out_dtype, "embedding_vp_fwd", "out")))
        return st;
    if (T <= 0 || H <= 0) return LOOM_OK;
    embedding_vp_fwd_kernel<<<rows_grid(T), NT, 0, as_stream(stream)>>>(ids, T, W, w_dtype, row0,
                                                                        rows, H, out, out_dtype);
    return check_launch(ctx, "embedding_vp_fwd");
}

extern "C" loom_status loom_cuda_embedding_vp_bwd(loom_ctx *ctx, const int32_t *ids, int64_t T,
                                                  const void *dout, loom_dtype dout_dtype,
                                                  int64_t row0, int64_t rows, int64_t H, float *dW,
                                                  void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dout_dtype, "embedding_vp_bwd", "dout"))) return st;
    if (T <= 0 || H <= 0 || rows <= 0 || !dW) return LOOM_OK;
    // One warp per block spreads the few columns over many multiprocessors,
    // and the row groups multiply them to about 4096 blocks.
    const int threads = 32;
    const int64_t cb = (H + threads - 1) / threads;
    int64_t groups = 1; // a power of 2, up to 128, about 4096 blocks, at most the rows
    while (groups < 128 && groups * 2 * cb <= 4096 && groups * 2 <= rows) groups *= 2;
    embedding_vp_bwd_kernel<<<dim3((unsigned)cb, (unsigned)groups), threads, 0, as_stream(stream)>>>(
        ids, T, dout, dout_dtype, row0, rows, H, dW);
    return check_launch(ctx, "embedding_vp_bwd");
}

/* ---------------- vocab-parallel cross-entropy ---------------- */

// One block per row. Thread i takes columns i, i + NT, ... in order (16-bit
// rows of a multiple of 8 columns: the 8-column chunks i, i + NT, ... by
// 16-byte accesses), then a fixed tree combines the threads: the same order
// on every GPU and run.

// f(j, z) for the columns j < n of row p that this thread takes.
template <typename T, bool VEC, typename F>
__device__ __forceinline__ void row_each(const void *p, loom_dtype dt, int64_t n, F f) {
    if constexpr (VEC) {
        const int64_t n8 = n / 8 * 8;
        for (int64_t j = threadIdx.x * 8; j < n8; j += NT * 8) {
            float v[8];
            ld8((const T *)p + j, v);
#pragma unroll
            for (int i = 0; i < 8; i++) f(j + i, v[i]);
        }
        for (int64_t j = n8 + threadIdx.x; j < n; j += NT) f(j, ld(p, dt, j));
    } else {
        for (int64_t j = threadIdx.x; j < n; j += NT) f(j, ld(p, dt, j));
    }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(NT)
    ce_vp_max_kernel(const void *logits, loom_dtype dt, int64_t ld_, int64_t nvalid, double *mx) {
    __shared__ float sh[NT / 32];
    const void *row = (const char *)logits + (size_t)blockIdx.x * ld_ * float_size(dt);
    // fmaxf skips NaNs as the CPU's `z > m` does; the max is exact in fp32
    float m = -INFINITY;
    row_each<T, VEC>(row, dt, nvalid, [&](int64_t, float z) { m = fmaxf(m, z); });
    m = block_max<NT>(m, sh);
    if (threadIdx.x == 0) mx[blockIdx.x] = (double)m;
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(NT)
    ce_vp_sums_kernel(const void *logits, loom_dtype dt, int64_t ld_, int64_t nvalid,
                      const int32_t *tgt, int64_t v0, const double *mx, double *ce) {
    __shared__ double sh[NT / 32];
    const int64_t r = blockIdx.x;
    const void *row = (const char *)logits + (size_t)r * ld_ * float_size(dt);
    const float m = (float)mx[r]; // the max over the ranks: an fp32 logit
    double s = 0, sz = 0;
    row_each<T, VEC>(row, dt, nvalid, [&](int64_t, float z) {
        const float e = __expf(z - m);
        s += e;
        sz += (double)e * z;
    });
    s = block_sum<NT>(s, sh);
    sz = block_sum<NT>(sz, sh);
    if (threadIdx.x == 0) {
        const int64_t t = (int64_t)tgt[r] - v0;
        const bool mine = tgt[r] != -100 && t >= 0 && t < nvalid;
        ce[3 * r + 0] = s;
        ce[3 * r + 1] = sz;
        ce[3 * r + 2] = mine ? (double)ld(row, dt, t) : 0.0;
    }
}

// The gradient of one row in place, from L = mx + log(ce[3r]): every element
// is read and then written by the same thread. REV walks the row's vectors
// from its end (the fused kernel's second read).
template <typename T, bool VEC, int NTR, bool REV>
__device__ __forceinline__ void ce_grad_row(void *row, loom_dtype dt, int64_t ld_, int64_t nvalid,
                                            int32_t tg, int64_t v0, double L, float scale) {
    const bool pad = tg == -100;
    const float l = (float)L;
    const int64_t t = (int64_t)tg - v0; // j == t only for a local target: j is in [0, nvalid)
    auto grad = [&](int64_t j, float z) {
        float v = 0.0f;
        if (!pad && j < nvalid) {
            v = scale * __expf(z - l);
            if (j == t) v -= scale;
        }
        return v;
    };
    const int64_t j0 = VEC ? ld_ / 8 * 8 : 0;
    for (int64_t j = j0 + threadIdx.x; j < ld_; j += NTR) st(row, dt, j, grad(j, ld(row, dt, j)));
    if constexpr (VEC) {
        // accesses per thread in flight: vector k + u * NTR (the fused kernel's
        // 1024 threads have 64 registers)
        constexpr int U = NTR >= 1024 ? 2 : 4;
        const int64_t nv = j0 / 8;
        for (int64_t k0 = threadIdx.x; k0 < nv; k0 += U * NTR) {
            float v[U][8];
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t k = k0 + u * NTR, j = (REV ? nv - 1 - k : k) * 8;
                if (k < nv) ld8((const T *)row + j, v[u]);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int64_t k = k0 + u * NTR, j = (REV ? nv - 1 - k : k) * 8;
                if (k >= nv) continue;
                if (!pad && j + 8 <= nvalid) { // the common vector: grad()'s operations, fewer tests
#pragma unroll
                    for (int i = 0; i < 8; i++) v[u][i] = scale * __expf(v[u][i] - l);
                    if (t >= j && t < j + 8) {
#pragma unroll
                        for (int i = 0; i < 8; i++)
                            if (j + i == t) v[u][i] -= scale;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 8; i++) v[u][i] = grad(j + i, v[u][i]);
                }
                st8((T *)row + j, v[u]);
            }
        }
    }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(NT)
    ce_vp_grad_kernel(void *logits, loom_dtype dt, int64_t ld_, int64_t nvalid,
                      const int32_t *tgt, int64_t v0, const double *mx, const double *ce,
                      float scale) {
    const int64_t r = blockIdx.x;
    ce_grad_row<T, VEC, NT, false>((char *)logits + (size_t)r * ld_ * float_size(dt), dt, ld_,
                                   nvalid, tgt[r], v0, mx[r] + log(ce[3 * r]), scale);
}

// Max, sums and (with grad) the gradient of each row for a tensor-parallel
// size of 1, where the row's max is its own. The max and the sums come from
// one read: each thread keeps a running max and rescales its sums (by exp in
// double) when it rises, and the threads' sums are rescaled to the row's max
// at the end; so the sums round differently from ce_vp_sums' (within the
// same few ulp of fp32 exp per term).
struct run_stats {
    float m = -INFINITY;
    double s = 0, sz = 0;
    __device__ __forceinline__ void rise(float vmax) { // fmaxf and `>` skip NaNs, as ce_vp_max
        if (vmax > m) {
            const double f = exp((double)m - (double)vmax);
            s *= f, sz *= f, m = vmax;
        }
    }
    __device__ __forceinline__ void add(float z) {
        const float e = __expf(z - m);
        s += e;
        sz += (double)e * z;
    }
    // the max rises once; the eight terms summed in fp32 first (two conversions
    // and two double adds a vector instead of three and two an element: the
    // double work bounded the kernel)
    __device__ __forceinline__ void add8(const float (&v)[8]) {
        float vm = v[0];
#pragma unroll
        for (int i = 1; i < 8; i++) vm = fmaxf(vm, v[i]);
        rise(vm);
        float es = 0.0f, ez = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float e = __expf(v[i] - m);
            es += e;
            ez = fmaf(e, v[i], ez);
        }
        s += es;
        sz += ez;
    }
    // the block's stats against its max M (returned to every thread)
    template <int NB> __device__ __forceinline__ float reduce(float *shf, double *shd) {
        const float M = block_max<NB>(m, shf);
        const double f = m == M ? 1.0 : exp((double)m - (double)M); // m = -inf: 0
        s = block_sum<NB>(s * f, shd);
        sz = block_sum<NB>(sz * f, shd);
        return M;
    }
};

// One row per block at a time and one block per SM: the stats read the row
// (16-bit rows 16 bytes at a time, two accesses in flight per thread), then
// the gradient reads it again from its end, which the first read left newest
// in L2 (132 rows of 300 KB in flight for Qwen's vocabulary on an H100), so
// much of the second read hits L2: Qwen3-0.6B's loss took 2.8 ms a step
// against 3.5 for ce_vp_max, _sums and _grad apart. (Rows held in shared
// memory over a cluster of two blocks, with the stats exchanged through
// distributed shared memory, crossed HBM once each way but took 1.55 ms per
// 4096 rows against 1.40: the load and store phases of a row did not
// overlap. A cluster of four with a copying warp, bulk copies three rows
// ahead and the gradient copied out by the bulk-copy engine, took 1.76 ms
// against 1.32 on an H200: the row's chain of barriers and the exchange
// between the blocks could not be hidden.) Nsight Compute put this kernel at
// 71% of the SMs' issue rate and 34% of DRAM's: the double arithmetic (a
// conversion and a double add or two an element) bounded it, hence add8's
// fp32 sums of eight and the gradient's whole-vector path: 1.16 ms per 4096
// rows of Qwen's vocabulary on the H200, from 1.32.
constexpr int NTF = 1024;
template <typename T, bool VEC>
__global__ void __launch_bounds__(NTF)
    ce_vp_fused_kernel(void *logits, loom_dtype dt, int64_t ld_, int64_t c, int64_t nvalid,
                       const int32_t *tgt, int64_t v0, double *mx, double *ce, float scale,
                       bool grad) {
    __shared__ float shf[NTF / 32];
    __shared__ double shd[NTF / 32];
    for (int64_t r = blockIdx.x; r < c; r += gridDim.x) {
        void *row = (char *)logits + (size_t)r * ld_ * float_size(dt);
        const int32_t tg = tgt[r];
        const int64_t t = (int64_t)tg - v0;
        const bool mine = tg != -100 && t >= 0 && t < nvalid;
        // read before any thread can pass the barriers below and overwrite it
        const float zt = threadIdx.x == 0 && mine ? ld(row, dt, t) : 0.0f;
        run_stats a;
        const int64_t n8 = VEC ? nvalid / 8 * 8 : 0;
        if constexpr (VEC) {
            constexpr int U = 2; // accesses in flight per thread: vector k + u * NTF
            const int64_t nv = n8 / 8;
            for (int64_t k0 = threadIdx.x; k0 < nv; k0 += U * NTF) {
                float v[U][8];
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (k0 + u * NTF < nv) ld8((const T *)row + (k0 + u * NTF) * 8, v[u]);
#pragma unroll
                for (int u = 0; u < U; u++)
                    if (k0 + u * NTF < nv) a.add8(v[u]);
            }
        }
        for (int64_t j = n8 + threadIdx.x; j < nvalid; j += NTF) {
            const float z = ld(row, dt, j);
            a.rise(z);
            a.add(z);
        }
        const float M = a.reduce<NTF>(shf, shd);
        if (threadIdx.x == 0) {
            mx[r] = (double)M;
            ce[3 * r + 0] = a.s;
            ce[3 * r + 1] = a.sz;
            ce[3 * r + 2] = (double)zt;
        }
        if (grad)
            ce_grad_row<T, VEC, NTF, true>(row, dt, ld_, nvalid, tg, v0, (double)M + log(a.s),
                                           scale);
    }
}

// The kernel K for the logits' dtype, `grid` blocks of `threads`: 16-byte
// accesses where rows allow.
#define CE_LAUNCH(K, grid, threads, logits, dt, ld_, ...)                                          \
    do {                                                                                           \
        const bool v_ = vec8_ok(dt, ld_, logits, logits);                                          \
        const cudaStream_t s_ = as_stream(stream);                                                 \
        if (v_ && dt == LOOM_BF16)                                                                 \
            K<__nv_bfloat16, true><<<(unsigned)(grid), threads, 0, s_>>>(logits, dt, ld_,          \
                                                                         __VA_ARGS__);             \
        else if (v_)                                                                               \
            K<__half, true><<<(unsigned)(grid), threads, 0, s_>>>(logits, dt, ld_, __VA_ARGS__);   \
        else                                                                                       \
            K<float, false><<<(unsigned)(grid), threads, 0, s_>>>(logits, dt, ld_, __VA_ARGS__);   \
    } while (0)

// Shared argument checks of the three; *nvalid clamped to [0, ld].
static loom_status ce_check(loom_ctx *ctx, const char *op, loom_dtype dt, int64_t c, int64_t ld_,
                            int64_t *nvalid) {
    loom_status st;
    if ((st = need_float(ctx, dt, op, "logits"))) return st;
    if (c < 0) return bad_shape(ctx, op, "row count c =", c);
    if (ld_ < 0) return bad_shape(ctx, op, "row stride ld =", ld_);
    if (c > 0x7fffffffLL)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda %s: c=%lld rows is too many for one call",
                         op, (long long)c);
    *nvalid = *nvalid < 0 ? 0 : *nvalid > ld_ ? ld_ : *nvalid;
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_ce_vp_max(loom_ctx *ctx, const void *logits, loom_dtype dtype,
                                           int64_t c, int64_t ld, int64_t nvalid, double *mx,
                                           void *stream) {
    loom_status st;
    if ((st = ce_check(ctx, "ce_vp_max", dtype, c, ld, &nvalid))) return st;
    if (c == 0) return LOOM_OK;
    CE_LAUNCH(ce_vp_max_kernel, c, NT, logits, dtype, ld, nvalid, mx);
    return check_launch(ctx, "ce_vp_max");
}

extern "C" loom_status loom_cuda_ce_vp_sums(loom_ctx *ctx, const void *logits, loom_dtype dtype,
                                            int64_t c, int64_t ld, int64_t nvalid,
                                            const int32_t *tgt, int64_t v0, const double *mx,
                                            double *ce, void *stream) {
    loom_status st;
    if ((st = ce_check(ctx, "ce_vp_sums", dtype, c, ld, &nvalid))) return st;
    if (c == 0) return LOOM_OK;
    CE_LAUNCH(ce_vp_sums_kernel, c, NT, logits, dtype, ld, nvalid, tgt, v0, mx, ce);
    return check_launch(ctx, "ce_vp_sums");
}

extern "C" loom_status loom_cuda_ce_vp_grad(loom_ctx *ctx, void *logits, loom_dtype dtype,
                                            int64_t c, int64_t ld, int64_t nvalid,
                                            const int32_t *tgt, int64_t v0, const double *mx,
                                            const double *ce, float scale, void *stream) {
    loom_status st;
    if ((st = ce_check(ctx, "ce_vp_grad", dtype, c, ld, &nvalid))) return st;
    if (c == 0 || ld == 0) return LOOM_OK;
    CE_LAUNCH(ce_vp_grad_kernel, c, NT, logits, dtype, ld, nvalid, tgt, v0, mx, ce, scale);
    return check_launch(ctx, "ce_vp_grad");
}

extern "C" loom_status loom_cuda_ce_vp_fused(loom_ctx *ctx, void *logits, loom_dtype dtype,
                                             int64_t c, int64_t ld, int64_t nvalid,
                                             const int32_t *tgt, int64_t v0, double *mx, double *ce,
                                             float scale, bool grad, void *stream) {
    loom_status st;
    if ((st = ce_check(ctx, "ce_vp_fused", dtype, c, ld, &nvalid))) return st;
    if (c == 0) return LOOM_OK;
    int dev = 0, sms = 0;
    if ((st = check(ctx, cudaGetDevice(&dev), "ce_vp_fused")) ||
        (st = check(ctx, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
                    "ce_vp_fused")))
        return st;
    CE_LAUNCH(ce_vp_fused_kernel, c < sms ? c : sms, NTF, logits, dtype, ld, c, nvalid, tgt, v0,
              mx, ce, scale, grad);
    return check_launch(ctx, "ce_vp_fused");
}

// One block per row: w read once, the row's columns coalesced.
__global__ void __launch_bounds__(NT)
    rows_scale_kernel(void *x, loom_dtype dt, int64_t c, int64_t width, const float *w) {
    for (int64_t r = blockIdx.x; r < c; r += gridDim.x) {
        const float s = w[r];
        for (int64_t j = threadIdx.x; j < width; j += NT) {
            const int64_t i = r * width + j;
            st(x, dt, i, __fmul_rn(ld(x, dt, i), s));
        }
    }
}

extern "C" loom_status loom_cuda_rows_scale(loom_ctx *ctx, void *x, loom_dtype dtype, int64_t c,
                                            int64_t ld, const float *w, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "rows_scale", "x"))) return st;
    if (c < 0) return bad_shape(ctx, "rows_scale", "row count", c);
    if (ld < 0) return bad_shape(ctx, "rows_scale", "row length", ld);
    if (c == 0 || ld == 0) return LOOM_OK;
    rows_scale_kernel<<<rows_grid(c), NT, 0, as_stream(stream)>>>(x, dtype, c, ld, w);
    return check_launch(ctx, "rows_scale");
}

/* ---------------- row permutations ---------------- */

// Rows of `per` units of U (the widest of 16, 8, 4, 2, 1 bytes that divides
// the row size and both pointers); one block per row, rows looped past the
// grid. SCATTER: dst row idx[j] = src row j, else dst row j = src row idx[j].
template <typename U, bool SCATTER>
__global__ void rows_perm_kernel(U *__restrict__ dst, const U *__restrict__ src,
                                 const int32_t *idx, int64_t n, int64_t per) {
    for (int64_t j = blockIdx.x; j < n; j += gridDim.x) {
        const int64_t r = idx[j];
        U *d = dst + (SCATTER ? r : j) * per;
        const U *s = src + (SCATTER ? j : r) * per;
        for (int64_t k = threadIdx.x; k < per; k += blockDim.x) d[k] = s[k];
    }
}

template <typename U>
static loom_status rows_perm_launch(loom_ctx *ctx, const char *op, bool scatter, void *dst,
                                    const void *src, const int32_t *idx, int64_t n, size_t row,
                                    cudaStream_t s) {
    const int64_t per = (int64_t)(row / sizeof(U));
    // A warp at least; short rows (a few heads' keys) do not leave most idle.
    const int threads = per >= NT ? NT : (int)((per + 31) / 32 * 32);
    if (scatter)
        rows_perm_kernel<U, true><<<rows_grid(n), threads, 0, s>>>((U *)dst, (const U *)src, idx,
                                                                   n, per);
    else
        rows_perm_kernel<U, false><<<rows_grid(n), threads, 0, s>>>((U *)dst, (const U *)src, idx,
                                                                    n, per);
    return check_launch(ctx, op);
}

static loom_status rows_perm(loom_ctx *ctx, const char *op, bool scatter, void *dst,
                             const void *src, const int32_t *idx, int64_t n, int64_t width,
                             size_t esz, void *stream) {
    if (n < 0) return bad_shape(ctx, op, "row count n =", n);
    if (width < 0) return bad_shape(ctx, op, "width", width);
    if (esz == 0) return bad_shape(ctx, op, "element size esz =", 0);
    const size_t row = (size_t)width * esz;
    if (n == 0 || row == 0) return LOOM_OK;
    const uintptr_t a = (uintptr_t)dst | (uintptr_t)src | (uintptr_t)row;
    cudaStream_t s = as_stream(stream);
    if (a % 16 == 0) return rows_perm_launch<uint4>(ctx, op, scatter, dst, src, idx, n, row, s);
    if (a % 8 == 0) return rows_perm_launch<uint2>(ctx, op, scatter, dst, src, idx, n, row, s);
    if (a % 4 == 0) return rows_perm_launch<uint32_t>(ctx, op, scatter, dst, src, idx, n, row, s);
    if (a % 2 == 0) return rows_perm_launch<uint16_t>(ctx, op, scatter, dst, src, idx, n, row, s);
    return rows_perm_launch<uint8_t>(ctx, op, scatter, dst, src, idx, n, row, s);
}

extern "C" loom_status loom_cuda_rows_gather(loom_ctx *ctx, void *dst, const void *src,
                                             const int32_t *idx, int64_t n, int64_t width,
                                             size_t esz, void *stream) {
    return rows_perm(ctx, "rows_gather", false, dst, src, idx, n, width, esz, stream);
}

extern "C" loom_status loom_cuda_rows_scatter(loom_ctx *ctx, void *dst, const void *src,
                                              const int32_t *idx, int64_t n, int64_t width,
                                              size_t esz, void *stream) {
    return rows_perm(ctx, "rows_scatter", true, dst, src, idx, n, width, esz, stream);
}

/* ---------------- LoRA dropout ---------------- */

// One block per token (rows looped past the grid): the token's global index
// is looked up once, the features go across the threads. The draw is
// rng.h's loom_rng_uniform, compiled for the device: the CPU's mask exactly.
__global__ void __launch_bounds__(NT)
    lora_dropout_kernel(void *out, const void *x, loom_dtype dt, int64_t T, int64_t in,
                        int64_t full, int64_t col0, const int32_t *qidx, int64_t out0,
                        uint64_t seed, uint64_t key, double p, float keep_scale) {
    const void *src = x ? x : out;
    for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
        const uint64_t g = (uint64_t)(out0 + (qidx ? (int64_t)qidx[t] : t));
        for (int64_t k = threadIdx.x; k < in; k += NT) {
            const uint64_t i = g * (uint64_t)full + (uint64_t)(col0 + k);
            const bool kept = loom_rng_uniform(seed, key, i) >= p;
            const float v = ld(src, dt, t * in + k);
            st(out, dt, t * in + k, kept ? v * keep_scale : 0.0f);
        }
    }
}

extern "C" loom_status loom_cuda_lora_dropout(loom_ctx *ctx, void *out, const void *x, int64_t T,
                                              int64_t in, int64_t full, int64_t col0,
                                              const int32_t *qidx, int64_t out0, uint64_t seed,
                                              uint64_t key, double p, loom_dtype dtype,
                                              void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "lora_dropout", "out"))) return st;
    if (T <= 0 || in <= 0) return LOOM_OK;
    // The scale rounded on the host, as the CPU rounds it: the same float.
    const float keep_scale = (float)(1.0 / (1.0 - p));
    lora_dropout_kernel<<<rows_grid(T), NT, 0, as_stream(stream)>>>(
        out, x, dtype, T, in, full, col0, qidx, out0, seed, key, p, keep_scale);
    return check_launch(ctx, "lora_dropout");
}

/* ---------------- memory on a stream ---------------- */

extern "C" loom_status loom_cuda_memset_async(loom_ctx *ctx, void *ptr, size_t bytes,
                                              void *stream) {
    if (bytes == 0) return LOOM_OK;
    return check(ctx, cudaMemsetAsync(ptr, 0, bytes, as_stream(stream)), "memset_async");
}

extern "C" loom_status loom_cuda_memcpy_async(loom_ctx *ctx, void *dst, const void *src,
                                              size_t bytes, void *stream) {
    if (bytes == 0) return LOOM_OK;
    return check(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)),
                 "memcpy_async");
}

// copy2d's rows by 16-byte pieces: a warp a row (its lanes across the row,
// looped past 32 pieces), eight rows a block, rows looped past the grid.
// Qwen3.5-0.8B's gated q_proj split at micro-batch 4 on an H200 (each half
// 33.5 MB each way, 512-byte rows 1 KB apart): 41.9 us a copy against about
// 46 for cudaMemcpy2DAsync (kprof).
constexpr int C2D_ROWS = 8;
__global__ void __launch_bounds__(32 * C2D_ROWS)
    copy2d16_kernel(uint4 *__restrict__ dst, size_t ldd, const uint4 *__restrict__ src,
                    size_t lds, int64_t per, int64_t rows) {
    const int64_t stride = (int64_t)gridDim.x * C2D_ROWS;
    for (int64_t r = (int64_t)blockIdx.x * C2D_ROWS + threadIdx.y; r < rows; r += stride) {
        uint4 *d = dst + r * ldd;
        const uint4 *s = src + r * lds;
        for (int64_t k = threadIdx.x; k < per; k += 32) d[k] = s[k];
    }
}

extern "C" loom_status loom_cuda_memcpy2d_async(loom_ctx *ctx, void *dst, size_t ldd,
                                                const void *src, size_t lds, size_t width,
                                                size_t rows, void *stream) {
    if (width == 0 || rows == 0) return LOOM_OK;
    if ((((uintptr_t)dst | (uintptr_t)src | ldd | lds | width) & 15) == 0) {
        const dim3 block(32, C2D_ROWS);
        copy2d16_kernel<<<grid_for((int64_t)rows, C2D_ROWS), block, 0, as_stream(stream)>>>(
            (uint4 *)dst, ldd / 16, (const uint4 *)src, lds / 16, (int64_t)(width / 16),
            (int64_t)rows);
        return check_launch(ctx, "copy2d");
    }
    return check(ctx,
                 cudaMemcpy2DAsync(dst, ldd, src, lds, width, rows, cudaMemcpyDefault,
                                   as_stream(stream)),
                 "memcpy2d_async");
}

extern "C" loom_status loom_cuda_events_create(loom_ctx *ctx, int n, void **ev) {
    *ev = NULL;
    cudaEvent_t *e = (cudaEvent_t *)calloc((size_t)n, sizeof *e);
    if (!e) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory for %d timing events", n);
    for (int i = 0; i < n; i++) {
        loom_status st = check(ctx, cudaEventCreate(&e[i]), "event_create");
        if (st) {
            loom_cuda_events_free(e, i);
            return st;
        }
    }
    *ev = e;
    return LOOM_OK;
}

extern "C" loom_status loom_cuda_event_record(loom_ctx *ctx, void *ev, int i, void *stream) {
    return check(ctx, cudaEventRecord(((cudaEvent_t *)ev)[i], as_stream(stream)), "event_record");
}

extern "C" loom_status loom_cuda_events_ms(loom_ctx *ctx, void *ev, int n, double *ms) {
    cudaEvent_t *e = (cudaEvent_t *)ev;
    loom_status st = check(ctx, cudaEventSynchronize(e[n - 1]), "event_synchronize");
    for (int i = 0; !st && i + 1 < n; i++) {
        float f = 0.0f;
        st = check(ctx, cudaEventElapsedTime(&f, e[i], e[i + 1]), "event_elapsed_time");
        ms[i] = f;
    }
    return st;
}

extern "C" void loom_cuda_events_free(void *ev, int n) {
    cudaEvent_t *e = (cudaEvent_t *)ev;
    if (!e) return;
    for (int i = 0; i < n; i++) cudaEventDestroy(e[i]);
    free(e);
}
