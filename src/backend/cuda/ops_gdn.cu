// Gated DeltaNet's small ops (cuda_ops.h; the CPU reference is
// src/backend/cpu/gdn.c): the causal depthwise convolution with SiLU and the
// gates g and beta (the gated RMSNorm is ops_gdn_norm.cu's, the chunked rule
// ops_gdn_rule.cu's). Arithmetic in fp32; a parameter gradient's sum over
// tokens or rows is taken as per-chunk partials in double (the
// convolution's summed in fp32 over the chunk's rows, red_rows of them),
// then the chunks added by col_final in an order fixed by the shape: no
// atomics.
//
// tests/test_backend_gdn.c holds them to the CPU's (run on an H200);
// `make test-emu` runs them on the CPU in CI.
#include "mma.cuh"
#include "ops_gdn_small.cuh"

using namespace loom_cuda;
using namespace loom_gdn_small;

namespace {
constexpr int CONV_MAX_K = 16; // the convolution's widest kernel here (Qwen3.5's is 4)

// The document n of token t: cu[n] <= t < cu[n + 1] (cu ascending from 0 to T).
__device__ __forceinline__ int64_t doc_of(const int32_t *cu, int64_t ndocs, int64_t t) {
    int64_t lo = 0, hi = ndocs; // cu[lo] <= t < cu[hi]
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

// out0[col] += the sum over the nchunk chunks of partial[chunk][col] for
// col < n0, out1[col - n0] for the columns after; a NULL output's columns are
// skipped. A block takes 32 columns (a lane each, a warp's loads one 256-byte
// run) with blockDim.y warps, warp w summing the chunks w, w + G, ... (FB
// loads in flight), then warp 0 the warps' sums in warp order: a fixed order
// for the shape. One thread a column over all the chunks in turn had taken 30
// us for the gated norm's 1024 chunks of 128 columns on an H200 (latency:
// four blocks of serial loads); G is 32 where the columns make few blocks.
constexpr int FB = 8;
constexpr int CF_WARPS = 32; // the most warps a col_final block has
__global__ void col_final_kernel(const double *partial, int64_t nchunk, int64_t ncols, int64_t n0,
                                 float *out0, float *out1) {
    __shared__ double sums[CF_WARPS][32];
    const int lane = threadIdx.x, wp = threadIdx.y, G = blockDim.y;
    const int64_t col = (int64_t)blockIdx.x * 32 + lane;
    double acc = 0;
    if (col < ncols) {
        int64_t c = wp;
        for (; c + (FB - 1) * G < nchunk; c += FB * G) {
            double v[FB];
#pragma unroll
            for (int i = 0; i < FB; i++)
                v[i] = partial[(c + i * G) * ncols + col];
#pragma unroll
            for (int i = 0; i < FB; i++)
                acc += v[i];
        }
        for (; c < nchunk; c += G)
            acc += partial[c * ncols + col];
    }
    sums[wp][lane] = acc;
    __syncthreads();
    if (wp != 0 || col >= ncols)
        return;
    float *out = col < n0 ? out0 : out1;
    if (!out)
        return;
    acc = 0;
    for (int i = 0; i < G; i++)
        acc += sums[i][lane];
    out[col < n0 ? col : col - n0] += (float)acc;
}

} // namespace

namespace loom_gdn_small {
loom_status col_final(loom_ctx *ctx, const char *op, const void *partial, int64_t nchunk,
                      int64_t ncols, int64_t n0, float *out0, float *out1, cudaStream_t s) {
    const int64_t blocks = (ncols + 31) / 32;
    const dim3 block(32, blocks >= 128 ? 8 : CF_WARPS);
    col_final_kernel<<<(unsigned)blocks, block, 0, s>>>((const double *)partial, nchunk, ncols,
                                                        n0, out0, out1);
    return check_launch(ctx, op);
}

loom_status no_scratch(loom_ctx *ctx, const char *op) {
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                     "cuda %s: a parameter gradient needs the op's scratch (cuda_ops.h)", op);
}
} // namespace loom_gdn_small

namespace {

// ---- the causal depthwise convolution, SiLU fused ----

// Both directions run a thread over a run of rows of V channels, the window
// of the K latest inputs in registers and the document followed from the
// run's first token (a thread per output with a search for its document and
// K loads made the forward compute-bound on an H200). KM, a compile-time
// bound on K, sizes the windows: 4 (Qwen3.5's kernel) keeps them in few
// registers; the wider case spilled none but ran one block an SM.
//
// The rows are read CONV_BATCH at a time, every load of a batch issued before
// the first is used: a thread that loaded one row ahead had one or two loads
// in flight, and the backward moved 0.65 TB/s on an H200 (296 us at
// Qwen3.5-4B's 4096 tokens and 8192 channels; the forward, with its rows
// staged in shared memory, 133 us); with the batches, pairs of channels,
// unchecked runs inside a document (IN) and the fast sigmoid (pair_rows)
// they take 141 and 49 us there. V is 2 (pair_rows: one 4-byte access a
// row) for 16-bit data with an even C, 4-byte aligned tensors and K = 4,
// else 1 (glob_rows, any float dtype). Each channel's sums run in the CPU's
// order either way.
constexpr int CONV_FWD_ROWS = 64; // the forward's rows per thread
constexpr int CONV_BATCH = 8;     // rows loaded ahead of their use

// Row u of a thread's V channels from c, as floats (get) or stored from them
// (put, rounded to nearest even); sg(x), the SiLU's sigmoid: IEEE division
// and expf in fp32, the hardware's approximations (__expf, __fdividef: a few
// ulp) for 16-bit data, whose rounding is 2^-8 or 2^-11 of the value (on an
// H200 at Qwen3.5-4B's shapes the backward 161 -> 141 us, the forward 66 ->
// 49 us: the forward issued an instruction 3 cycles in 4).
struct glob_rows {
    static constexpr int V = 1;
    __device__ static float sg(float x) { return sigm(x); }
    void *p;
    loom_dtype dt;
    int64_t C, c;
    __device__ __forceinline__ void get(int64_t u, float (&f)[1]) const {
        f[0] = ld(p, dt, u * C + c);
    }
    __device__ __forceinline__ void put(int64_t u, const float (&f)[1]) const {
        st(p, dt, u * C + c, f[0]);
    }
};
template <typename E> struct pair_rows {
    static constexpr int V = 2;
    __device__ static float sg(float x) { return sigm_fast(x); }
    void *p;
    loom_dtype dt; // E's
    int64_t C, c;  // c even
    __device__ __forceinline__ uint32_t *at(int64_t u) const {
        return (uint32_t *)p + (u * (C / 2) + c / 2);
    }
    __device__ __forceinline__ void get(int64_t u, float (&f)[2]) const {
        const uint32_t w = *at(u);
        const E *e = (const E *)&w;
        f[0] = to_f(e[0]), f[1] = to_f(e[1]);
    }
    __device__ __forceinline__ void put(int64_t u, const float (&f)[2]) const {
        uint32_t w;
        E *e = (E *)&w;
        e[0] = from_f<E>(f[0]), e[1] = from_f<E>(f[1]);
        *at(u) = w;
    }
};

// Token t (its document from s, its input xt) into the window xw (xw[j] =
// x[t - K + 1 + j]); its pre-activation, the sum in j's order as the CPU's.
template <bool IN, int KM>
__device__ __forceinline__ float conv_step(float (&xw)[KM], const float (&wk)[KM], float xt,
                                           int64_t K, int64_t t, int64_t s) {
#pragma unroll
    for (int j = 0; j < KM - 1; j++)
        xw[j] = xw[j + 1];
#pragma unroll
    for (int j = 0; j < KM; j++)
        if (j == K - 1)
            xw[j] = xt;
    float p = 0.0f;
#pragma unroll
    for (int j = 0; j < KM; j++)
        if (j < K && (IN || t - K + 1 + j >= s))
            p = fmaf(wk[j], xw[j], p);
    return p;
}

// Whether the tokens [r0 - K + 1, r1) lie in one document: then no tap of
// the rows [r0, r1) reaches before its document's start, nor, in the
// backward (r1 past its rows by K - 1), a dx sum past its end.
__device__ __forceinline__ bool conv_inner(const int32_t *cu, int64_t ndocs, int64_t K, int64_t r0,
                                           int64_t r1) {
    const int64_t n = doc_of(cu, ndocs, r0);
    return r0 - K + 1 >= cu[n] && r1 <= cu[n + 1];
}

// The taps of channels x.c.. and their window at t = r0 - 1.
template <int KM, class R>
__device__ __forceinline__ void conv_init(const R &x, const void *w, loom_dtype dt, int64_t K,
                                          int64_t r0, float (&wk)[R::V][KM],
                                          float (&xw)[R::V][KM]) {
#pragma unroll
    for (int j = 0; j < KM; j++) {
        const int64_t u = r0 - K + j;
        float f[R::V] = {};
        if (j < K && u >= 0)
            x.get(u, f);
#pragma unroll
        for (int v = 0; v < R::V; v++) {
            wk[v][j] = j < K ? ld(w, dt, (x.c + v) * K + j) : 0.0f;
            xw[v][j] = f[v];
        }
    }
}

// The rows [r0, r1) of y's channels x.c.. (y.c the same). IN: the rows and
// their windows lie in one document (conv_inner), so no token's taps cross a
// start: the same sums without the checks.
template <bool IN, int KM, class R>
__device__ __forceinline__ void conv_fwd_rows(const R &x, const R &y, const void *w,
                                              loom_dtype dt, int64_t K, int64_t r0, int64_t r1,
                                              const int32_t *cu, int64_t ndocs) {
    constexpr int V = R::V;
    float wk[V][KM], xw[V][KM]; // xw[v][j] = x[t - K + 1 + j] at token t
    conv_init<KM>(x, w, dt, K, r0, wk, xw);
    int64_t n = IN ? 0 : doc_of(cu, ndocs, r0), s = IN ? 0 : cu[n], e = IN ? 0 : cu[n + 1];
    for (int64_t tb = r0; tb < r1; tb += CONV_BATCH) {
        float xb[CONV_BATCH][V] = {};
#pragma unroll
        for (int i = 0; i < CONV_BATCH; i++)
            if (tb + i < r1)
                x.get(tb + i, xb[i]);
#pragma unroll
        for (int i = 0; i < CONV_BATCH; i++) {
            const int64_t t = tb + i;
            if (t < r1) {
                while (!IN && t >= e)
                    s = e, e = cu[++n + 1];
                float out[V];
#pragma unroll
                for (int v = 0; v < V; v++) {
                    const float p = conv_step<IN>(xw[v], wk[v], xb[i][v], K, t, s);
                    out[v] = p * R::sg(p);
                }
                y.put(t, out);
            }
        }
    }
}

template <int KM, class R>
__global__ void __launch_bounds__(NT, KM == 4 ? 4 : 1)
    conv_fwd_kernel(R x, R y, const void *w, loom_dtype dt, int64_t T, int64_t C, int64_t K,
                    const int32_t *cu, int64_t ndocs) {
    const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * R::V;
    if (c >= C)
        return;
    x.c = y.c = c;
    if constexpr (R::V > 1)
        K = KM; // conv_pairs: exactly KM taps, a constant here
    const int64_t r0 = (int64_t)blockIdx.y * CONV_FWD_ROWS;
    const int64_t r1 = r0 + CONV_FWD_ROWS < T ? r0 + CONV_FWD_ROWS : T;
    if (conv_inner(cu, ndocs, K, r0, r1))
        conv_fwd_rows<true, KM>(x, y, w, dt, K, r0, r1, cu, ndocs);
    else
        conv_fwd_rows<false, KM>(x, y, w, dt, K, r0, r1, cu, ndocs);
}

// Where conv_bwd_rows reads its rows of x and dy. direct_src: each thread
// loads its own (R's get), a batch at a time. ring_src: the block's rows come
// through shared memory, CONV_STAGES batches of CONV_BATCH rows in a ring
// filled by cp.async (16-byte pieces of the block's 2 CONV_BT channels, 16-bit
// data), CONV_STAGES - 1 batches in flight while one is used: a thread's own
// 4-byte loads had at most a batch in flight, and the backward waited on
// memory (ncu on an H200 at Qwen3.5-0.8B's shapes: 127 registers, 25%
// occupancy, long_sb 63% of the stalls, 159 us where its bytes take ~40).
struct direct_src {
    static constexpr bool LAZY = false; // get a batch's rows before using them
    __device__ void start(int64_t) {}
    __device__ void batch(int64_t) {}
    template <class R>
    __device__ __forceinline__ void get(const R &r, int, int64_t tb, int i,
                                        float (&f)[R::V]) const {
        r.get(tb + i, f);
    }
};
constexpr int CONV_BT = 128;   // threads of the staged backward's blocks
constexpr int CONV_STAGES = 4; // its ring's batches
template <typename E> struct ring_src {
    static constexpr bool LAZY = true; // get a row as it is used
    static constexpr int Q = 2 * CONV_BT * 2 / 16; // 16-byte pieces of a row's span
    static_assert((CONV_STAGES & (CONV_STAGES - 1)) == 0, "slots by a mask");
    uint32_t *ring;   // [CONV_STAGES][2 (x, dy)][CONV_BATCH][CONV_BT] channel pairs
    const E *x, *dy;  // the tensors (C channels a row)
    int64_t C, cb, n; // the block's first channel; rows past n read as zeros
    int used = 0;     // batches begun (batch's); the current one's slot is (used - 1) % S
    __device__ void issue(int64_t tb, int sl) { // the batch at row tb into slot sl, committed
        for (int p = threadIdx.x; tb < n && p < 2 * CONV_BATCH * Q; p += CONV_BT) {
            const int q = p % Q, i = (p / Q) % CONV_BATCH, which = p / (Q * CONV_BATCH);
            const int64_t u = tb + i, c = cb + 8 * q;
            const E *src = which ? dy : x;
            const bool ok = u < n && c < C;
            cp_async16(ring + ((sl * 2 + which) * CONV_BATCH + i) * CONV_BT + 4 * q,
                       ok ? src + u * C + c : src, ok);
        }
        cp_commit();
    }
    __device__ void start(int64_t tb) {
        for (int k = 0; k < CONV_STAGES - 1; k++)
            issue(tb + k * CONV_BATCH, k);
    }
    // the batch at tb (the next in turn) landed for every thread; the slot the
    // batch before used refilled
    __device__ void batch(int64_t tb) {
        cp_wait<CONV_STAGES - 2>();
        __syncthreads();
        issue(tb + (CONV_STAGES - 1) * CONV_BATCH, (used + CONV_STAGES - 1) & (CONV_STAGES - 1));
        used++;
    }
    template <class R>
    __device__ __forceinline__ void get(const R &, int which, int64_t, int i,
                                        float (&f)[2]) const {
        const int sl = (used - 1) & (CONV_STAGES - 1);
        const uint32_t w = ring[((sl * 2 + which) * CONV_BATCH + i) * CONV_BT + threadIdx.x];
        const E *e = (const E *)&w;
        f[0] = to_f(e[0]), f[1] = to_f(e[1]);
    }
};

// dx and dw's partial sums in one pass, a thread over the rows [r0, r1) of
// dw's chunk ch: each token's dL/dpre = dy silu'(pre) is formed once and kept
// for the K tokens whose dx needs it (a kernel per output had formed it K
// times, each from K taps):
//   dx[u, c] = sum_j w[c, j] dpre[u + K - 1 - j, c] over the tokens of u's document
//   partial[ch][c K + j] = sum over the chunk's t of dpre[t, c] x[t - K + 1 + j, c]
//                          (that token in t's document).
// Sums in j's and t's order, as the CPU's. DW false: dx only (partial
// unused). IN: as the forward's, the rows [r0 - K + 1, r1 + K - 1) in one
// document. The rows come from src (direct_src or ring_src); act false: a
// thread past C that only helps ring_src's staging (no stores).
template <bool IN, bool DW, int KM, class R, class SRC>
__device__ __forceinline__ void conv_bwd_rows(const R &x, const R &dy, const R &dx,
                                              const void *w, loom_dtype dt, int64_t T, int64_t C,
                                              int64_t K, int64_t ch, int64_t r0, int64_t r1,
                                              const int32_t *cu, int64_t ndocs, double *partial,
                                              SRC &src, bool act) {
    constexpr int V = R::V;
    // at token t: xw[v][j] = x[t - K + 1 + j]; dp[v][j] = dpre[t - j], of document dd[j]
    float wk[V][KM], xw[V][KM], dp[V][KM] = {};
    int dd[KM]; // documents as offsets from r0's (-1: none)
    float acc[DW ? V : 1][DW ? KM : 1] = {}; // the run's dw terms (fp32: red_rows of them)
    conv_init<KM>(x, w, dt, K, r0, wk, xw);
#pragma unroll
    for (int j = 0; j < KM; j++)
        dd[j] = -1;
    const int64_t n0 = IN ? 0 : doc_of(cu, ndocs, r0);
    int64_t n = n0, s = IN ? 0 : cu[n], e = IN ? 0 : cu[n + 1];
    const int64_t tend = r1 + K - 1, lend = tend < T ? tend : T;
    src.start(r0);
    for (int64_t tb = r0; tb < tend; tb += CONV_BATCH) {
        float xb[CONV_BATCH][V] = {}, yb[CONV_BATCH][V] = {};
        src.batch(tb);
#pragma unroll
        for (int i = 0; i < CONV_BATCH; i++) // global rows: all in flight before any is used
            if (!SRC::LAZY && tb + i < lend)
                src.get(x, 0, tb, i, xb[i]), src.get(dy, 1, tb, i, yb[i]);
#pragma unroll
        for (int i = 0; i < CONV_BATCH; i++) {
            const int64_t t = tb + i;
            if (t >= tend)
                break;
            if (SRC::LAZY && t < lend) // shared memory's: a row when used (fewer registers)
                src.get(x, 0, tb, i, xb[i]), src.get(dy, 1, tb, i, yb[i]);
            float dpt[V] = {};
            int dt_doc = -1;
            if (IN || t < T) {
                while (!IN && t >= e)
                    s = e, e = cu[++n + 1];
#pragma unroll
                for (int v = 0; v < V; v++) {
                    const float pre = conv_step<IN>(xw[v], wk[v], xb[i][v], K, t, s);
                    const float sg = R::sg(pre);
                    dpt[v] = yb[i][v] * sg * (1.0f + pre * (1.0f - sg));
                }
                dt_doc = (int)(n - n0);
                if (DW && t < r1) {
#pragma unroll
                    for (int v = 0; v < V; v++)
#pragma unroll
                        for (int j = 0; j < KM; j++)
                            if (j < K && (IN || t - K + 1 + j >= s))
                                acc[DW ? v : 0][DW ? j : 0] =
                                    fmaf(dpt[v], xw[v][j], acc[DW ? v : 0][DW ? j : 0]);
                }
            }
#pragma unroll
            for (int j = KM - 1; j > 0; j--) {
                dd[j] = dd[j - 1];
#pragma unroll
                for (int v = 0; v < V; v++)
                    dp[v][j] = dp[v][j - 1];
            }
            dd[0] = dt_doc;
#pragma unroll
            for (int v = 0; v < V; v++)
                dp[v][0] = dpt[v];
            const int64_t u = t - K + 1; // dp[v][K - 1] is dpre[u]
            if (u >= r0 && u < r1) {
                int du = -1;
#pragma unroll
                for (int j = 0; j < KM; j++)
                    if (j == K - 1)
                        du = dd[j];
                float a[V];
#pragma unroll
                for (int v = 0; v < V; v++) {
                    a[v] = 0.0f;
#pragma unroll
                    for (int j = 0; j < KM; j++)
                        if (j < K && (IN || dd[j] == du))
                            a[v] = fmaf(wk[v][j], dp[v][j], a[v]);
                }
                if (act)
                    dx.put(u, a);
            }
        }
    }
    if (DW && act) {
#pragma unroll
        for (int v = 0; v < V; v++)
#pragma unroll
            for (int j = 0; j < KM; j++)
                if (j < K)
                    partial[ch * C * K + (x.c + v) * K + j] = acc[DW ? v : 0][DW ? j : 0];
    }
}

template <int KM, bool DW, class R>
__global__ void __launch_bounds__(NT, KM == 4 ? (DW ? 2 : 3) : 1)
    conv_bwd_kernel(R dy, R x, R dx, const void *w, loom_dtype dt, int64_t T, int64_t C,
                    int64_t K, const int32_t *cu, int64_t ndocs, int64_t rows, double *partial) {
    const int64_t c = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) * R::V, ch = blockIdx.y;
    if (c >= C)
        return;
    x.c = dy.c = dx.c = c;
    if constexpr (R::V > 1)
        K = KM;
    const int64_t r0 = ch * rows, r1 = r0 + rows < T ? r0 + rows : T;
    direct_src src;
    if (conv_inner(cu, ndocs, K, r0, r1 + K - 1))
        conv_bwd_rows<true, DW, KM>(x, dy, dx, w, dt, T, C, K, ch, r0, r1, cu, ndocs, partial, src,
                                    true);
    else
        conv_bwd_rows<false, DW, KM>(x, dy, dx, w, dt, T, C, K, ch, r0, r1, cu, ndocs, partial, src,
                                     true);
}

// conv_bwd_kernel with the rows staged (ring_src): pairs of 16-bit channels,
// K = 4, C a multiple of 8 and x, dy 16-byte aligned (conv_staged). Every
// thread of a block runs the rows' loop for the ring's barriers; those past C
// read channel 0's taps and store nothing.
template <bool DW, typename E>
__global__ void __launch_bounds__(CONV_BT, 4)
    conv_bwd_staged_kernel(pair_rows<E> dy, pair_rows<E> x, pair_rows<E> dx, const void *w,
                           loom_dtype dt, int64_t T, int64_t C, const int32_t *cu, int64_t ndocs,
                           int64_t rows, double *partial) {
    __shared__ uint4 ring[CONV_STAGES * 2 * CONV_BATCH * CONV_BT / 4]; // 16-byte aligned
    constexpr int64_t K = 4;
    const int64_t cb = (int64_t)blockIdx.x * 2 * CONV_BT, c = cb + 2 * threadIdx.x;
    const int64_t ch = blockIdx.y, r0 = ch * rows, r1 = r0 + rows < T ? r0 + rows : T;
    const bool act = c < C;
    x.c = dy.c = dx.c = act ? c : 0;
    const int64_t tend = r1 + K - 1;
    ring_src<E> src{(uint32_t *)ring, (const E *)x.p, (const E *)dy.p, C, cb, tend < T ? tend : T};
    if (conv_inner(cu, ndocs, K, r0, r1 + K - 1))
        conv_bwd_rows<true, DW, 4>(x, dy, dx, w, dt, T, C, K, ch, r0, r1, cu, ndocs, partial, src,
                                   act);
    else
        conv_bwd_rows<false, DW, 4>(x, dy, dx, w, dt, T, C, K, ch, r0, r1, cu, ndocs, partial, src,
                                    act);
}

// Whether a thread takes a pair of channels (pair_rows): 16-bit data, an even
// C, 4-byte aligned tensors, K = 4 (Qwen3.5's).
inline bool conv_pairs(loom_dtype dt, int64_t C, int64_t K, const void *a, const void *b,
                       const void *c) {
    const uintptr_t al = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c;
    return (dt == LOOM_BF16 || dt == LOOM_F16) && C % 2 == 0 && K == 4 && (al & 3) == 0;
}
template <class R> R conv_rows(const void *p, loom_dtype dt, int64_t C) {
    return R{const_cast<void *>(p), dt, C, 0};
}
// f(R()) with R the rows' type for tensors a, b, c: pair_rows of the 16-bit
// type where conv_pairs takes them, else glob_rows.
template <class F>
loom_status conv_rows_for(loom_dtype dt, int64_t C, int64_t K, const void *a, const void *b,
                          const void *c, F f) {
    if (!conv_pairs(dt, C, K, a, b, c))
        return f(glob_rows());
    return dt == LOOM_BF16 ? f(pair_rows<__nv_bfloat16>()) : f(pair_rows<__half>());
}

// ---- the gates ----

// torch's softplus (beta 1, threshold 20)
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__global__ void gate_fwd_kernel(const void *a, const void *b, const void *A_log,
                                const void *dt_bias, loom_dtype dt, int64_t T, int64_t H, float *g,
                                float *beta) {
    grid_each(T * H, [&](int64_t i) {
        const int64_t h = i % H;
        const float x = ld(a, dt, i) + ld(dt_bias, dt, h);
        g[i] = -expf(ld(A_log, dt, h)) * softplus(x);
        beta[i] = sigm(ld(b, dt, i));
    });
}

// da = dg * -exp(A_log) sigmoid(a + dt_bias) (softplus' past 20: 1), db = dbeta beta (1 - beta)
__global__ void gate_bwd_kernel(const float *dg, const float *dbeta, const void *a, const void *b,
                                const void *A_log, const void *dt_bias, loom_dtype dt, int64_t T,
                                int64_t H, void *da, void *db) {
    grid_each(T * H, [&](int64_t i) {
        const int64_t h = i % H;
        const float x = ld(a, dt, i) + ld(dt_bias, dt, h), sb = sigm(ld(b, dt, i));
        st(da, dt, i, dg[i] * -expf(ld(A_log, dt, h)) * (x > 20.0f ? 1.0f : sigm(x)));
        st(db, dt, i, dbeta[i] * sb * (1.0f - sb));
    });
}

// partial[chunk][h] = sum of dg g / ... over the chunk's tokens: dA_log's
// terms (dg * -exp(A_log) softplus) at h, ddt_bias's (dg * -exp(A_log)
// sigmoid) at H + h. The block's threads split the chunk's rows S ways (S =
// NT / H where H < NT): thread (s, h) sums rows s, s + S, ... in order, then
// thread h the S sums in order. A thread a head over all the rows had left
// 240 of the 256 threads idle at Qwen3.5's 16 heads (30 us a layer, H200).
__global__ void gate_partial_kernel(const float *dg, const void *a, const void *A_log,
                                    const void *dt_bias, loom_dtype dt, int64_t T, int64_t H,
                                    int64_t rows, double *partial) {
    __shared__ double ps[2][NT];
    const int64_t ch = blockIdx.x, r0 = ch * rows, r1 = r0 + rows < T ? r0 + rows : T;
    const int S = H < NT ? NT / (int)H : 1, P = NT / S; // row groups; heads a pass
    const int sg = threadIdx.x / P, hp = threadIdx.x % P;
    for (int64_t h0 = 0; h0 < H; h0 += P) {
        const int64_t h = h0 + hp;
        double sa = 0, sd = 0;
        if (sg < S && h < H) {
            const float eA = expf(ld(A_log, dt, h)), bias = ld(dt_bias, dt, h);
            for (int64_t t = r0 + sg; t < r1; t += S) {
                const float x = ld(a, dt, t * H + h), d = dg[t * H + h];
                const float xx = x + bias;
                sa += (double)(d * -eA * softplus(xx));
                sd += (double)(d * -eA * (xx > 20.0f ? 1.0f : sigm(xx)));
            }
        }
        ps[0][threadIdx.x] = sa, ps[1][threadIdx.x] = sd;
        __syncthreads();
        if (threadIdx.x < P && h < H) {
            sa = sd = 0;
            for (int g = 0; g < S; g++)
                sa += ps[0][g * P + hp], sd += ps[1][g * P + hp];
            partial[ch * 2 * H + h] = sa;
            partial[ch * 2 * H + H + h] = sd;
        }
        __syncthreads();
    }
}

} // namespace

extern "C" size_t loom_cuda_gdn_conv_scratch_bytes(int64_t T, int64_t C, int64_t K) {
    return (size_t)(red_chunks(T) * C * K) * sizeof(double);
}

extern "C" size_t loom_cuda_gdn_gate_scratch_bytes(int64_t T, int64_t H) {
    return (size_t)(red_chunks(T) * 2 * H) * sizeof(double);
}

static loom_status conv_args(loom_ctx *ctx, const char *op, loom_dtype dt, int64_t C, int64_t K,
                             int64_t ndocs) {
    loom_status st = need_float(ctx, dt, op, "x");
    if (st)
        return st;
    if (K < 1 || K > CONV_MAX_K || C < 1 || ndocs < 1)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda %s: kernel %lld over %lld channels, %lld documents (kernels of 1 to "
                         "%d taps)",
                         op, (long long)K, (long long)C, (long long)ndocs, CONV_MAX_K);
    return LOOM_OK;
}

template <class R>
static loom_status conv_fwd_launch(loom_ctx *ctx, const void *x, const void *w, loom_dtype dt,
                                   int64_t T, int64_t C, int64_t K, const int32_t *cu,
                                   int64_t ndocs, void *y, cudaStream_t s) {
    constexpr int KW = R::V > 1 ? 4 : CONV_MAX_K; // pairs: K = 4 (conv_pairs)
    const int64_t per = NT * R::V;
    const dim3 grid((unsigned)((C + per - 1) / per),
                    (unsigned)((T + CONV_FWD_ROWS - 1) / CONV_FWD_ROWS));
    auto kern = K <= 4 ? conv_fwd_kernel<4, R> : conv_fwd_kernel<KW, R>;
    kern<<<grid, NT, 0, s>>>(conv_rows<R>(x, dt, C), conv_rows<R>(y, dt, C), w, dt, T, C, K, cu,
                             ndocs);
    return check_launch(ctx, "gdn_conv_fwd");
}

template <class R>
static loom_status conv_bwd_launch(loom_ctx *ctx, const void *dy, const void *x, const void *w,
                                   loom_dtype dt, int64_t T, int64_t C, int64_t K,
                                   const int32_t *cu, int64_t ndocs, void *dx, double *partial,
                                   cudaStream_t s) {
    constexpr int KW = R::V > 1 ? 4 : CONV_MAX_K; // pairs: K = 4 (conv_pairs)
    const int64_t per = NT * R::V;
    const dim3 grid((unsigned)((C + per - 1) / per), (unsigned)red_chunks(T));
    auto kern = K <= 4 ? (partial ? conv_bwd_kernel<4, true, R> : conv_bwd_kernel<4, false, R>)
                       : (partial ? conv_bwd_kernel<KW, true, R> : conv_bwd_kernel<KW, false, R>);
    kern<<<grid, NT, 0, s>>>(conv_rows<R>(dy, dt, C), conv_rows<R>(x, dt, C),
                             conv_rows<R>(dx, dt, C), w, dt, T, C, K, cu, ndocs, red_rows(T),
                             partial);
    return check_launch(ctx, "gdn_conv_bwd");
}

// Whether the backward stages its rows (conv_bwd_staged_kernel): channel
// pairs (conv_pairs) whose rows are whole 16-byte pieces at 16-byte aligned x and dy.
static bool conv_staged(loom_dtype dt, int64_t C, int64_t K, const void *dy, const void *x,
                        const void *dx) {
    return conv_pairs(dt, C, K, dy, x, dx) && C % 8 == 0 &&
           (((uintptr_t)dy | (uintptr_t)x) & 15) == 0;
}

template <typename E>
static loom_status conv_bwd_staged_launch(loom_ctx *ctx, const void *dy, const void *x,
                                          const void *w, loom_dtype dt, int64_t T, int64_t C,
                                          const int32_t *cu, int64_t ndocs, void *dx,
                                          double *partial, cudaStream_t s) {
    const dim3 grid((unsigned)((C + 2 * CONV_BT - 1) / (2 * CONV_BT)), (unsigned)red_chunks(T));
    auto kern = partial ? conv_bwd_staged_kernel<true, E> : conv_bwd_staged_kernel<false, E>;
    const auto rows = [&](const void *p) { return conv_rows<pair_rows<E>>(p, dt, C); };
    kern<<<grid, CONV_BT, 0, s>>>(rows(dy), rows(x), rows(dx), w, dt, T, C, cu, ndocs,
                                  red_rows(T), partial);
    return check_launch(ctx, "gdn_conv_bwd");
}

extern "C" loom_status loom_cuda_gdn_conv_fwd(loom_ctx *ctx, const void *x, const void *w,
                                              loom_dtype dtype, int64_t T, int64_t C, int64_t K,
                                              const int32_t *cu, int64_t ndocs, void *y,
                                              void *stream) {
    loom_status st = conv_args(ctx, "gdn_conv_fwd", dtype, C, K, ndocs);
    if (st || T <= 0)
        return st;
    cudaStream_t s = as_stream(stream);
    return conv_rows_for(dtype, C, K, x, y, y, [&](auto r) {
        return conv_fwd_launch<decltype(r)>(ctx, x, w, dtype, T, C, K, cu, ndocs, y, s);
    });
}

extern "C" loom_status loom_cuda_gdn_conv_bwd(loom_ctx *ctx, const void *dy, const void *x,
                                              const void *w, loom_dtype dtype, int64_t T, int64_t C,
                                              int64_t K, const int32_t *cu, int64_t ndocs, void *dx,
                                              float *dw, void *scratch, void *stream) {
    loom_status st = conv_args(ctx, "gdn_conv_bwd", dtype, C, K, ndocs);
    if (st || T <= 0)
        return st;
    if (dw && !scratch)
        return no_scratch(ctx, "gdn_conv_bwd");
    cudaStream_t s = as_stream(stream);
    double *part = dw ? (double *)scratch : nullptr;
    if (conv_staged(dtype, C, K, dy, x, dx))
        st = dtype == LOOM_BF16
                 ? conv_bwd_staged_launch<__nv_bfloat16>(ctx, dy, x, w, dtype, T, C, cu, ndocs,
                                                         dx, part, s)
                 : conv_bwd_staged_launch<__half>(ctx, dy, x, w, dtype, T, C, cu, ndocs, dx, part,
                                                  s);
    else
        st = conv_rows_for(dtype, C, K, dy, x, dx, [&](auto r) {
            return conv_bwd_launch<decltype(r)>(ctx, dy, x, w, dtype, T, C, K, cu, ndocs, dx, part,
                                                s);
        });
    if (st || !dw)
        return st;
    return col_final(ctx, "gdn_conv_bwd", scratch, red_chunks(T), C * K, C * K, dw, nullptr, s);
}

extern "C" loom_status loom_cuda_gdn_gate_fwd(loom_ctx *ctx, const void *a, const void *b,
                                              const void *A_log, const void *dt_bias,
                                              loom_dtype dtype, int64_t T, int64_t H, float *g,
                                              float *beta, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_gate_fwd", "a");
    if (st || T <= 0 || H <= 0)
        return st;
    gate_fwd_kernel<<<grid_for(T * H, NT), NT, 0, as_stream(stream)>>>(a, b, A_log, dt_bias, dtype,
                                                                       T, H, g, beta);
    return check_launch(ctx, "gdn_gate_fwd");
}

extern "C" loom_status loom_cuda_gdn_gate_bwd(loom_ctx *ctx, const float *dg, const float *dbeta,
                                              const void *a, const void *b, const void *A_log,
                                              const void *dt_bias, loom_dtype dtype, int64_t T,
                                              int64_t H, void *da, void *db, float *dA_log,
                                              float *ddt_bias, void *scratch, void *stream) {
    loom_status st = need_float(ctx, dtype, "gdn_gate_bwd", "a");
    if (st || T <= 0 || H <= 0)
        return st;
    if ((dA_log || ddt_bias) && !scratch)
        return no_scratch(ctx, "gdn_gate_bwd");
    cudaStream_t s = as_stream(stream);
    gate_bwd_kernel<<<grid_for(T * H, NT), NT, 0, s>>>(dg, dbeta, a, b, A_log, dt_bias, dtype, T, H,
                                                       da, db);
    if ((st = check_launch(ctx, "gdn_gate_bwd")) || (!dA_log && !ddt_bias))
        return st;
    const int64_t rows = red_rows(T), nch = red_chunks(T);
    gate_partial_kernel<<<(unsigned)nch, NT, 0, s>>>(dg, a, A_log, dt_bias, dtype, T, H, rows,
                                                     (double *)scratch);
    if ((st = check_launch(ctx, "gdn_gate_bwd")))
        return st;
    return col_final(ctx, "gdn_gate_bwd", scratch, nch, 2 * H, H, dA_log, ddt_bias, s);
}
