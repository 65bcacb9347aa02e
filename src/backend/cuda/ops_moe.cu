// Mixture-of-experts ops with cpu_moe.h's semantics: the router (fp32
// softmax over the E experts, the top k with ties to the lower expert,
// norm_topk's renormalisation, the probabilities' column sums, the rows'
// logsumexp for the z-loss) and its backward, the choices grouped by expert
// (stable; with a capacity, the dropped ones after all kept), the rows
// gathered into the groups and combined back, and their backwards.
//
// Most kernels take one warp per row (a token's E logits, a token's or a
// grouped row's H features), rows looped past the grid. The router keeps a
// row in shared memory (E floats a warp); 16-bit rows of a multiple of 8
// features (F32: of 4) with 16-byte aligned tensors go by 16-byte accesses.
// Every sum runs in an order fixed by the shapes alone (no floating-point
// atomics): the results are the same bits run to run.
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {

enum { WARPS = 8, NT = WARPS * 32, SCAN_NT = 1024 };
constexpr unsigned FULL = 0xffffffffu;

// element access (T float, __nv_bfloat16 or __half): ops_common.cuh's to_f,
// from_f, ld_vec and st_vec

// Whether a's candidate beats b's for the next top-k slot: the larger
// probability, the lower expert on a tie (or when either is NaN); -1: none.
__device__ __forceinline__ bool beats(float av, int ai, float bv, int bi) {
    if (ai < 0)
        return false;
    if (bi < 0 || av > bv)
        return true;
    if (av < bv)
        return false;
    return ai < bi;
}

// ---- router forward ----

// One warp per token: z's row to fp32 in shared memory, its max and the sum
// of the exps (warp trees), probs = exp / sum (IEEE division), then k rounds
// of a warp argmax; a chosen expert is marked -1 in shared memory (a
// probability is never negative). w's sum for norm_topk adds the k weights
// in slot order, as the CPU does.
template <typename T>
__global__ void __launch_bounds__(NT)
    router_fwd_kernel(const T *__restrict__ z, int64_t N, int E, int k, bool norm,
                      float *__restrict__ probs, int32_t *__restrict__ idx, float *__restrict__ w,
                      float *__restrict__ lse) {
    extern __shared__ float sh_router[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    float *p = sh_router + (size_t)warp * E;
    const int64_t stride = (int64_t)gridDim.x * wpb;
    for (int64_t n = (int64_t)blockIdx.x * wpb + warp; n < N; n += stride) {
        const T *zr = z + n * E;
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) {
            const float v = to_f(zr[e]);
            p[e] = v;
            mx = fmaxf(mx, v);
        }
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < E; e += 32) {
            const float x = expf(p[e] - mx);
            p[e] = x;
            sum += x;
        }
        sum = warp_sum(sum);
        if (lse && lane == 0)
            lse[n] = mx + logf(sum);
        float *pr = probs + n * E;
        for (int e = lane; e < E; e += 32) {
            const float v = p[e] / sum;
            p[e] = v;
            pr[e] = v;
        }
        __syncwarp();
        int32_t *ix = idx + n * k;
        float *wr = w + n * k, top = 0.0f;
        for (int j = 0; j < k; j++) {
            float bv = 0.0f;
            int bi = -1;
            for (int e = lane; e < E; e += 32) { // ascending: a tie keeps the lower
                const float v = p[e];
                if (!(v < 0.0f) && (bi < 0 || v > bv))
                    bv = v, bi = e;
            }
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(FULL, bv, o);
                const int oi = __shfl_xor_sync(FULL, bi, o);
                if (beats(ov, oi, bv, bi))
                    bv = ov, bi = oi;
            }
            bv = __shfl_sync(FULL, bv, 0); // lane 0's answer for all (NaN-proof)
            bi = __shfl_sync(FULL, bi, 0);
            top += bv;
            if (lane == 0) {
                ix[j] = bi;
                wr[j] = bv;
                p[bi] = -1.0f;
            }
            __syncwarp();
        }
        if (norm && lane == 0)
            for (int j = 0; j < k; j++)
                wr[j] /= top;
        __syncwarp(); // p is the next row's
    }
}

// psum's first stage: part[c * E + e] = the sum over the rows of chunk c
// (rows [c R, c R + R)) of probs[., e] in double. A block takes 32 columns of
// one chunk; its 8 row lanes take every 8th row, then are added in lane order.
__global__ void __launch_bounds__(256)
    colsum_part_kernel(const float *__restrict__ probs, int64_t N, int E, int64_t R,
                       double *__restrict__ part) {
    __shared__ double sh[8][33];
    const int e = blockIdx.x * 32 + threadIdx.x;
    const int64_t c = blockIdx.y, r0 = c * R, r1 = r0 + R < N ? r0 + R : N;
    double acc = 0.0;
    if (e < E)
        for (int64_t r = r0 + threadIdx.y; r < r1; r += 8)
            acc += (double)probs[r * E + e];
    sh[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && e < E) {
        double s = 0.0;
        for (int i = 0; i < 8; i++)
            s += sh[i][threadIdx.x];
        part[c * E + e] = s;
    }
}

// psum's second stage: psum[e] += the chunks' sums in chunk order.
__global__ void colsum_final_kernel(const double *__restrict__ part, int64_t nc, int E,
                                    float *__restrict__ psum) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E)
        return;
    double s = 0.0;
    for (int64_t c = 0; c < nc; c++)
        s += part[c * E + e];
    psum[e] += (float)s;
}

// The column sums' chunks: about 64 rows each, at most 256 of them.
int64_t psum_chunks(int64_t N) {
    const int64_t c = (N + 63) / 64;
    return c < 1 ? 1 : c > 256 ? 256 : c;
}

// ---- router backward ----

// One warp per token, g = d/dprobs in shared memory: ga, plus (lane 0, in
// slot order, in double as the CPU) the routing weights' gradient through
// norm_topk's renormalisation; then dz = p (g - sum p g + zc lse), the sum
// in double (the last term the z-loss's, with lse).
template <typename T>
__global__ void __launch_bounds__(NT)
    router_bwd_kernel(const float *__restrict__ probs, const int32_t *__restrict__ idx,
                      const float *__restrict__ dw, const float *__restrict__ ga,
                      const float *__restrict__ lse, const float *__restrict__ zc, int64_t N, int E,
                      int k, bool norm, T *__restrict__ dz) {
    extern __shared__ float sh_router[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    float *g = sh_router + (size_t)warp * E;
    const int64_t stride = (int64_t)gridDim.x * wpb;
    for (int64_t n = (int64_t)blockIdx.x * wpb + warp; n < N; n += stride) {
        const float *p = probs + n * E;
        for (int e = lane; e < E; e += 32)
            g[e] = ga ? ga[e] : 0.0f;
        __syncwarp();
        if (dw && lane == 0) {
            const int32_t *ix = idx + n * k;
            const float *d = dw + n * k;
            if (norm) { // w_j = p_j / S: dp_j = (dw_j - sum_i dw_i w_i) / S
                double S = 0.0, dot = 0.0;
                for (int j = 0; j < k; j++)
                    S += p[ix[j]];
                for (int j = 0; j < k; j++)
                    dot += (double)d[j] * (p[ix[j]] / S);
                for (int j = 0; j < k; j++)
                    g[ix[j]] += (float)((d[j] - dot) / S);
            } else {
                for (int j = 0; j < k; j++)
                    g[ix[j]] += d[j];
            }
        }
        __syncwarp();
        double s = 0.0;
        for (int e = lane; e < E; e += 32)
            s += (double)p[e] * g[e];
        s = warp_sum(s);
        const double zl = lse ? (double)zc[0] * lse[n] : 0.0;
        T *o = dz + n * E;
        for (int e = lane; e < E; e += 32)
            o[e] = from_f<T>((float)(p[e] * ((double)g[e] - s + zl)));
        __syncwarp(); // g is the next row's
    }
}

// Warps a block of the router's kernels: E floats of shared memory each,
// 48 KiB at most.
int router_warps(int E) {
    const int w = 12288 / (E > 0 ? E : 1);
    return w < 1 ? 1 : w > WARPS ? WARPS : w;
}

// ---- route: the flat choices c = n k + j grouped by expert, stable ----
//
// The C = N k choices are cut into chunks of CH (a multiple of 32), one warp
// a chunk. hist: each chunk's count per expert (shared-memory counters; ints,
// so their order does not matter). scan (one block): per expert, the chunks'
// counts become their exclusive prefix over the chunks; counts = the totals;
// then each expert's offset (the exclusive prefix over the experts) is added:
// base[ch][e] = where chunk ch's first choice of e goes. scatter: each chunk
// again, 32 choices at a time in order: a choice's rank among the same
// expert's choices of the 32 (__match_any_sync) plus the chunk's running
// count of that expert is its place.

// Choices a chunk: about C / 512 (at most 512 chunks), at least 256.
int64_t route_chunk(int64_t C) {
    int64_t ch = (C + 511) / 512;
    ch = (ch + 31) / 32 * 32;
    return ch < 256 ? 256 : ch;
}

__global__ void __launch_bounds__(NT)
    route_hist_kernel(const int32_t *__restrict__ idx, int64_t C, int E, int64_t CH, int64_t nch,
                      int32_t *__restrict__ cnt) {
    extern __shared__ int32_t sh_route[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    int32_t *h = sh_route + (size_t)warp * E;
    for (int64_t ch = (int64_t)blockIdx.x * wpb + warp; ch < nch; ch += (int64_t)gridDim.x * wpb) {
        for (int e = lane; e < E; e += 32)
            h[e] = 0;
        __syncwarp();
        const int64_t c0 = ch * CH, c1 = c0 + CH < C ? c0 + CH : C;
        for (int64_t c = c0 + lane; c < c1; c += 32)
            atomicAdd(&h[idx[c]], 1);
        __syncwarp();
        for (int e = lane; e < E; e += 32)
            cnt[ch * E + e] = h[e];
        __syncwarp();
    }
}

// The exclusive prefix sums of a[0..n) in shared memory, in place, by a
// block of SCAN_NT threads: each thread's run of ceil(n / SCAN_NT), the
// runs' totals scanned over warps, then each run again. Every thread calls.
__device__ void block_scan_excl(int32_t *a, int n, int32_t *wsum) {
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, S = (n + SCAN_NT - 1) / SCAN_NT;
    int32_t mine = 0;
    for (int i = 0; i < S; i++)
        if (t * S + i < n)
            mine += a[t * S + i];
    int32_t inc = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const int32_t u = __shfl_up_sync(FULL, inc, o);
        if (lane >= o)
            inc += u;
    }
    if (lane == 31)
        wsum[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int32_t v = wsum[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int32_t u = __shfl_up_sync(FULL, v, o);
            if (lane >= o)
                v += u;
        }
        wsum[lane] = v;
    }
    __syncthreads();
    int32_t run = inc - mine + (warp ? wsum[warp - 1] : 0);
    for (int i = 0; i < S; i++)
        if (t * S + i < n) {
            const int32_t v = a[t * S + i];
            a[t * S + i] = run;
            run += v;
        }
    __syncthreads();
}

// One block of SCAN_NT threads (E <= 2 LOOM_CUDA_MOE_MAX_E: a capacity's
// second pass has a kept and a dropped group an expert).
__global__ void __launch_bounds__(SCAN_NT)
    route_scan_kernel(int32_t *__restrict__ cnt, int64_t nch, int E, int32_t *__restrict__ counts) {
    __shared__ int32_t tot[2 * LOOM_CUDA_MOE_MAX_E];
    __shared__ int32_t wsum[SCAN_NT / 32];
    const int t = threadIdx.x;
    for (int e = t; e < E; e += SCAN_NT) { // the chunks of expert e, in chunk order
        int32_t run = 0;
        for (int64_t ch = 0; ch < nch; ch++) {
            int32_t *q = cnt + ch * E + e;
            const int32_t v = *q;
            *q = run;
            run += v;
        }
        tot[e] = run;
        counts[e] = run;
    }
    __syncthreads();
    block_scan_excl(tot, E, wsum); // the experts' exclusive prefix
    for (int e = t; e < E; e += SCAN_NT) {
        const int32_t off = tot[e];
        for (int64_t ch = 0; ch < nch; ch++)
            cnt[ch * E + e] += off;
    }
}

__global__ void __launch_bounds__(NT)
    route_scatter_kernel(const int32_t *__restrict__ idx, int64_t C, int E, int64_t CH, int64_t nch,
                         const int32_t *__restrict__ base, int32_t *__restrict__ order,
                         int32_t *__restrict__ pos) {
    extern __shared__ int32_t sh_route[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    int32_t *next = sh_route + (size_t)warp * E;
    for (int64_t ch = (int64_t)blockIdx.x * wpb + warp; ch < nch; ch += (int64_t)gridDim.x * wpb) {
        for (int e = lane; e < E; e += 32)
            next[e] = base[ch * E + e];
        __syncwarp();
        const int64_t c0 = ch * CH, c1 = c0 + CH < C ? c0 + CH : C;
        for (int64_t cb = c0; cb < c1; cb += 32) { // the whole warp, every round
            const int64_t c = cb + lane;
            const bool on = c < c1;
            const int e = on ? idx[c] : -1; // -1: no expert, matches only the other idle lanes
            const unsigned peers = __match_any_sync(FULL, e);
            const int rank = __popc(peers & below);
            if (on) {
                const int32_t p = next[e] + rank;
                pos[c] = p;
                order[p] = (int32_t)c;
            }
            __syncwarp();
            if (on && rank == 0)
                next[e] += __popc(peers); // the lowest lane of its expert
            __syncwarp();
        }
    }
}

// ---- capacity: which choices an expert keeps ----
//
// After a dropless pass (counts, order, pos, and the chunk table whose row 0
// is each expert's offset), each choice c of expert e gets the group key e
// when kept and E + e when dropped; a second pass over the 2E keys puts the
// kept of every expert first, the dropped after, both grouped and stable.

// "position": the first cap of an expert's choices in token order, one
// thread a choice.
__global__ void route_keep_position_kernel(const int32_t *__restrict__ idx, int64_t C, int E,
                                           int64_t cap, const int32_t *__restrict__ off,
                                           const int32_t *__restrict__ pos,
                                           int32_t *__restrict__ key) {
    grid_each(C, [&](int64_t c) {
        const int e = idx[c];
        key[c] = pos[c] - off[e] < cap ? e : E + e;
    });
}

// "probs": choice c's rank among its expert's choices by weight (the larger
// first, the earlier token on a tie), counted over the expert's group in
// order[] by one warp a choice; kept when below cap.
__global__ void __launch_bounds__(NT)
    route_keep_probs_kernel(const int32_t *__restrict__ idx, const float *__restrict__ w, int64_t C,
                            int E, int64_t cap, const int32_t *__restrict__ off,
                            const int32_t *__restrict__ counts, const int32_t *__restrict__ order,
                            int32_t *__restrict__ key) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t c = (int64_t)blockIdx.x * WARPS + warp; c < C; c += (int64_t)gridDim.x * WARPS) {
        const int e = idx[c];
        const int64_t n = counts[e];
        int64_t r = 0;
        if (n > cap) {
            const int32_t *seg = order + off[e];
            const float wc = w[c];
            for (int64_t i = lane; i < n; i += 32) {
                const int32_t j = seg[i];
                const float wj = w[j];
                r += wj > wc || (wj == wc && j < c);
            }
            for (int o = 16; o > 0; o >>= 1)
                r += __shfl_xor_sync(FULL, r, o);
        }
        if (lane == 0)
            key[c] = r < cap ? e : E + e;
    }
}

// The dropped choices (key >= E) out of their groups: order -1 - c, pos -1.
__global__ void route_mark_dropped_kernel(const int32_t *__restrict__ key, int64_t C, int E,
                                          int32_t *__restrict__ order, int32_t *__restrict__ pos) {
    grid_each(C, [&](int64_t c) {
        if (key[c] >= E) {
            order[pos[c]] = (int32_t)(-1 - c);
            pos[c] = -1;
        }
    });
}

// ---- permute, combine and their backwards: one warp per row ----

// xg row p = x row order[p] / k, as units U of the row's bytes (none for a
// dropped choice, order[p] < 0).
template <typename U>
__global__ void __launch_bounds__(NT)
    permute_kernel(const U *__restrict__ x, const int32_t *__restrict__ order, int64_t rows, int k,
                   int64_t per, U *__restrict__ xg) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t p = (int64_t)blockIdx.x * WARPS + warp; p < rows;
         p += (int64_t)gridDim.x * WARPS) {
        if (order[p] < 0)
            continue;
        const U *s = x + (int64_t)(order[p] / k) * per;
        U *d = xg + p * per;
        for (int64_t i = lane; i < per; i += 32)
            d[i] = s[i];
    }
}

// y row n = the sum over its slots j = 0..k-1 of w[n k + j] (WEIGHTED; else
// 1) times src row pos[n k + j]: combine (src = yg) and permute's backward
// (src = dxg), fp32 sums in slot order without fused multiply-adds (the
// CPU's operations: F32 gives its bits); a dropped slot (pos -1) adds none.
template <typename T, int V, bool WEIGHTED>
__global__ void __launch_bounds__(NT)
    gather_sum_kernel(const T *__restrict__ src, const int32_t *__restrict__ pos,
                      const float *__restrict__ w, int64_t N, int k, int64_t H, T *__restrict__ y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t n = (int64_t)blockIdx.x * WARPS + warp; n < N; n += (int64_t)gridDim.x * WARPS) {
        const int32_t *pn = pos + n * k;
        for (int64_t h = (int64_t)lane * V; h < H; h += 32 * V) {
            float acc[V];
#pragma unroll
            for (int i = 0; i < V; i++)
                acc[i] = 0.0f;
            for (int j = 0; j < k; j++) {
                if (pn[j] < 0)
                    continue;
                float v[V];
                ld_vec<T, V>(src + (int64_t)pn[j] * H + h, v);
                if constexpr (WEIGHTED) {
                    const float s = w[n * k + j];
#pragma unroll
                    for (int i = 0; i < V; i++)
                        acc[i] = __fadd_rn(acc[i], __fmul_rn(s, v[i]));
                } else {
#pragma unroll
                    for (int i = 0; i < V; i++)
                        acc[i] = __fadd_rn(acc[i], v[i]);
                }
            }
            st_vec<T, V>(y + n * H + h, acc);
        }
    }
}

// combine's backward, one warp per grouped row p of choice c = order[p]:
// dyg row p = w[c] dy row c / k; dw[c] = dot(dy row c / k, yg row p) in fp32
// (each lane's terms in order, then a warp tree); a dropped choice (order
// -1 - c) gets dw 0 and no row.
template <typename T, int V>
__global__ void __launch_bounds__(NT)
    combine_bwd_kernel(const T *__restrict__ dy, const T *__restrict__ yg,
                       const int32_t *__restrict__ order, const float *__restrict__ w, int64_t rows,
                       int k, int64_t H, T *__restrict__ dyg, float *__restrict__ dw) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t p = (int64_t)blockIdx.x * WARPS + warp; p < rows;
         p += (int64_t)gridDim.x * WARPS) {
        const int32_t c = order[p];
        if (c < 0) {
            if (lane == 0)
                dw[-1 - c] = 0.0f;
            continue;
        }
        const float s = w[c];
        const T *d = dy + (int64_t)(c / k) * H, *g = yg + p * H;
        T *o = dyg + p * H;
        float dot = 0.0f;
        for (int64_t h = (int64_t)lane * V; h < H; h += 32 * V) {
            float dv[V], gv[V], ov[V];
            ld_vec<T, V>(d + h, dv);
            ld_vec<T, V>(g + h, gv);
#pragma unroll
            for (int i = 0; i < V; i++) {
                ov[i] = __fmul_rn(s, dv[i]);
                dot = __fmaf_rn(dv[i], gv[i], dot);
            }
            st_vec<T, V>(o + h, ov);
        }
        dot = warp_sum(dot);
        if (lane == 0)
            dw[c] = dot;
    }
}

// ---- host side ----

loom_status bad(loom_ctx *ctx, const char *op, const char *what, long long v) {
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda %s: bad %s %lld", op, what, v);
}

// N tokens of E experts, top k: the shapes the router and route take.
loom_status check_nek(loom_ctx *ctx, const char *op, int64_t N, int64_t E, int k) {
    if (N < 0)
        return bad(ctx, op, "token count", N);
    if (E < 1 || E > LOOM_CUDA_MOE_MAX_E)
        return loom_errf(ctx, E < 1 ? LOOM_ERR_INVALID_ARG : LOOM_ERR_UNSUPPORTED,
                         "cuda %s: %lld experts (1 to %d)", op, (long long)E, LOOM_CUDA_MOE_MAX_E);
    if (k < 0 || k > E)
        return bad(ctx, op, "top-k", k);
    if (N * k > INT32_MAX) // order and pos are int32
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda %s: %lld choices (N k) exceed int32", op,
                         (long long)(N * k));
    return LOOM_OK;
}

// The rows of permute and combine: N k < 2^31, H >= 0.
loom_status check_nkh(loom_ctx *ctx, const char *op, int64_t N, int k, int64_t H) {
    if (N < 0)
        return bad(ctx, op, "token count", N);
    if (k < 0)
        return bad(ctx, op, "top-k", k);
    if (H < 0)
        return bad(ctx, op, "row width", H);
    if (N * k > INT32_MAX)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda %s: %lld choices (N k) exceed int32", op,
                         (long long)(N * k));
    return LOOM_OK;
}

// Blocks of WARPS rows for `rows` rows (looped past the cap).
unsigned row_blocks(int64_t rows) { return grid_for(rows, WARPS); }

// Rows of H elements of T at every pointer go by 16-byte accesses: H a
// multiple of 16 / sizeof(T), every pointer 16-byte aligned.
template <typename T> bool vec_rows(int64_t H, const void *a, const void *b, const void *c) {
    return H % (int64_t)(16 / sizeof(T)) == 0 && ((uintptr_t)a & 15) == 0 &&
           ((uintptr_t)b & 15) == 0 && ((uintptr_t)c & 15) == 0;
}

template <typename T, bool WEIGHTED>
void launch_gather_sum(const void *src, const int32_t *pos, const float *w, int64_t N, int k,
                       int64_t H, void *y, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (vec_rows<T>(H, src, y, y))
        gather_sum_kernel<T, V, WEIGHTED>
            <<<row_blocks(N), NT, 0, s>>>((const T *)src, pos, w, N, k, H, (T *)y);
    else
        gather_sum_kernel<T, 1, WEIGHTED>
            <<<row_blocks(N), NT, 0, s>>>((const T *)src, pos, w, N, k, H, (T *)y);
}

template <typename T>
void launch_combine_bwd(const void *dy, const void *yg, const int32_t *order, const float *w,
                        int64_t rows, int k, int64_t H, void *dyg, float *dw, cudaStream_t s) {
    constexpr int V = 16 / sizeof(T);
    if (vec_rows<T>(H, dy, yg, dyg))
        combine_bwd_kernel<T, V><<<row_blocks(rows), NT, 0, s>>>(
            (const T *)dy, (const T *)yg, order, w, rows, k, H, (T *)dyg, dw);
    else
        combine_bwd_kernel<T, 1><<<row_blocks(rows), NT, 0, s>>>(
            (const T *)dy, (const T *)yg, order, w, rows, k, H, (T *)dyg, dw);
}

template <typename U>
void launch_permute(const void *x, const int32_t *order, int64_t rows, int k, int64_t bytes,
                    void *xg, cudaStream_t s) {
    permute_kernel<U><<<row_blocks(rows), NT, 0, s>>>((const U *)x, order, rows, k,
                                                      bytes / (int64_t)sizeof(U), (U *)xg);
}


// One block: each block (s, f) of the table gets its first gathered row
// (a scan in (s, f) order) and its first grouped place (the experts'
// totals scanned, plus the earlier sources' rows of its expert); then a
// warp a block writes its rows both ways.
__global__ void __launch_bounds__(SCAN_NT)
    regroup_kernel(const int32_t *__restrict__ rc, int S, int El, int64_t Rt, int32_t *__restrict__ ix) {
    extern __shared__ int32_t sm[];
    __shared__ int32_t wsum[SCAN_NT / 32];
    const int n = S * El, t = threadIdx.x;
    int32_t *goff = sm, *gpos = sm + n, *col = sm + 2 * n;
    for (int i = t; i < n; i += SCAN_NT)
        goff[i] = rc[i];
    for (int f = t; f < El; f += SCAN_NT) {
        int32_t run = 0;
        for (int s = 0; s < S; s++) {
            gpos[s * El + f] = run;
            run += rc[s * El + f];
        }
        col[f] = run;
    }
    __syncthreads();
    block_scan_excl(goff, n, wsum);
    block_scan_excl(col, El, wsum);
    for (int i = t; i < n; i += SCAN_NT)
        gpos[i] += col[i % El];
    __syncthreads();
    const int lane = t & 31;
    for (int b = t >> 5; b < n; b += SCAN_NT / 32) {
        const int32_t c = rc[b], g0 = goff[b], j0 = gpos[b];
        for (int32_t r = lane; r < c; r += 32) {
            ix[j0 + r] = g0 + r;
            ix[Rt + g0 + r] = j0 + r;
        }
    }
}

} // namespace

extern "C" size_t loom_cuda_moe_router_scratch_bytes(int64_t N, int64_t E, bool psum) {
    return psum && N > 0 && E > 0 ? (size_t)(psum_chunks(N) * E) * sizeof(double) : 0;
}

extern "C" loom_status loom_cuda_moe_router_fwd(loom_ctx *ctx, const void *z, loom_dtype dtype,
                                                int64_t N, int64_t E, int k, bool norm_topk,
                                                float *probs, int32_t *idx, float *w, float *psum,
                                                float *lse, void *scratch, size_t scratch_bytes,
                                                void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_router_fwd", "z")) ||
        (st = check_nek(ctx, "moe_router_fwd", N, E, k)))
        return st;
    if (N == 0)
        return LOOM_OK;
    const size_t need = loom_cuda_moe_router_scratch_bytes(N, E, psum != NULL);
    if (scratch_bytes < need || (need && !scratch))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda moe_router_fwd: scratch of %zu bytes, %zu needed", scratch_bytes,
                         need);
    const cudaStream_t s = as_stream(stream);
    const int wpb = router_warps((int)E);
    const size_t shm = (size_t)wpb * (size_t)E * sizeof(float);
    LOOM_CUDA_TYPED(dtype, router_fwd_kernel<T><<<grid_for(N, wpb), 32 * wpb, shm, s>>>(
                         (const T *)z, N, (int)E, k, norm_topk, probs, idx, w, lse));
    if ((st = check_launch(ctx, "moe_router_fwd")) || !psum)
        return st;
    const int64_t nc = psum_chunks(N), R = (N + nc - 1) / nc;
    colsum_part_kernel<<<dim3((unsigned)((E + 31) / 32), (unsigned)nc), dim3(32, 8), 0, s>>>(
        probs, N, (int)E, R, (double *)scratch);
    colsum_final_kernel<<<(unsigned)((E + 255) / 256), 256, 0, s>>>((const double *)scratch, nc,
                                                                    (int)E, psum);
    return check_launch(ctx, "moe_router_fwd (psum)");
}

extern "C" loom_status loom_cuda_moe_router_bwd(loom_ctx *ctx, const float *probs,
                                                const int32_t *idx, const float *dw,
                                                const float *ga, const float *lse, const float *zc,
                                                int64_t N, int64_t E, int k, bool norm_topk,
                                                void *dz, loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_router_bwd", "dz")) ||
        (st = check_nek(ctx, "moe_router_bwd", N, E, k)))
        return st;
    if (N == 0)
        return LOOM_OK;
    const int wpb = router_warps((int)E);
    const size_t shm = (size_t)wpb * (size_t)E * sizeof(float);
    LOOM_CUDA_TYPED(dtype, router_bwd_kernel<T><<<grid_for(N, wpb), 32 * wpb, shm, as_stream(stream)>>>(
                         probs, idx, dw, ga, lse, zc, N, (int)E, k, norm_topk, (T *)dz));
    return check_launch(ctx, "moe_router_bwd");
}

extern "C" size_t loom_cuda_moe_route_scratch_bytes(int64_t N, int64_t E, int k, bool cap) {
    const int64_t C = N * k;
    if (C <= 0 || E <= 0)
        return 0;
    const int64_t CH = route_chunk(C), nch = (C + CH - 1) / CH;
    // the chunk table (a second pass: of 2E groups), then the keys and the
    // second pass's counts
    return (size_t)(cap ? nch * 2 * E + C + 2 * E : nch * E) * sizeof(int32_t);
}

namespace {

// One grouping pass over C keys in [0, G): hist, scan, scatter.
void route_pass(const int32_t *key, int64_t C, int G, int32_t *cnt, int32_t *counts, int32_t *order,
                int32_t *pos, cudaStream_t s) {
    const int64_t CH = route_chunk(C), nch = (C + CH - 1) / CH;
    const int wpb = router_warps(G);
    const size_t shm = (size_t)wpb * (size_t)G * sizeof(int32_t);
    route_hist_kernel<<<grid_for(nch, wpb), 32 * wpb, shm, s>>>(key, C, G, CH, nch, cnt);
    route_scan_kernel<<<1, SCAN_NT, 0, s>>>(cnt, nch, G, counts);
    route_scatter_kernel<<<grid_for(nch, wpb), 32 * wpb, shm, s>>>(key, C, G, CH, nch, cnt, order,
                                                                   pos);
}

} // namespace

extern "C" loom_status loom_cuda_moe_route(loom_ctx *ctx, const int32_t *idx, const float *w,
                                           int64_t N, int64_t E, int k, int64_t cap,
                                           bool by_position, int32_t *counts, int32_t *order,
                                           int32_t *pos, void *scratch, size_t scratch_bytes,
                                           void *stream) {
    loom_status st;
    if ((st = check_nek(ctx, "moe_route", N, E, k)))
        return st;
    const cudaStream_t s = as_stream(stream);
    const int64_t C = N * k;
    if (C == 0) // no choices: every count 0
        return check(ctx, cudaMemsetAsync(counts, 0, (size_t)E * sizeof(int32_t), s), "moe_route");
    const bool drop = cap >= 0 && cap < N; // no expert has more than N choices
    if (drop && !by_position && !w)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda moe_route: dropping by weight without the weights");
    const size_t need = loom_cuda_moe_route_scratch_bytes(N, E, k, drop);
    if (scratch_bytes < need || !scratch)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda moe_route: scratch of %zu bytes, %zu needed", scratch_bytes, need);
    int32_t *cnt = (int32_t *)scratch;
    route_pass(idx, C, (int)E, cnt, counts, order, pos, s);
    if (!drop)
        return check_launch(ctx, "moe_route");
    const int64_t CH = route_chunk(C), nch = (C + CH - 1) / CH;
    int32_t *key = cnt + nch * 2 * E, *counts2 = key + C;
    if (by_position)
        route_keep_position_kernel<<<grid_for(C, 256), 256, 0, s>>>(idx, C, (int)E, cap, cnt, pos,
                                                                    key);
    else
        route_keep_probs_kernel<<<row_blocks(C), NT, 0, s>>>(idx, w, C, (int)E, cap, cnt, counts,
                                                             order, key);
    route_pass(key, C, (int)(2 * E), cnt, counts2, order, pos, s);
    route_mark_dropped_kernel<<<grid_for(C, 256), 256, 0, s>>>(key, C, (int)E, order, pos);
    return check_launch(ctx, "moe_route");
}

extern "C" loom_status loom_cuda_moe_permute(loom_ctx *ctx, const void *x, const int32_t *order,
                                             int64_t N, int k, int64_t H, void *xg,
                                             loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_permute", "x")) ||
        (st = check_nkh(ctx, "moe_permute", N, k, H)))
        return st;
    const int64_t rows = N * k, bytes = H * (int64_t)float_size(dtype);
    if (rows == 0 || H == 0)
        return LOOM_OK;
    const cudaStream_t s = as_stream(stream);
    const uintptr_t al = (uintptr_t)x | (uintptr_t)xg | (uintptr_t)bytes;
    if (al % 16 == 0)
        launch_permute<uint4>(x, order, rows, k, bytes, xg, s);
    else if (al % 8 == 0)
        launch_permute<uint2>(x, order, rows, k, bytes, xg, s);
    else if (al % 4 == 0)
        launch_permute<uint32_t>(x, order, rows, k, bytes, xg, s);
    else
        launch_permute<uint16_t>(x, order, rows, k, bytes, xg, s);
    return check_launch(ctx, "moe_permute");
}

extern "C" loom_status loom_cuda_moe_combine(loom_ctx *ctx, const void *yg, const int32_t *pos,
                                             const float *w, int64_t N, int k, int64_t H, void *y,
                                             loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_combine", "yg, y")) ||
        (st = check_nkh(ctx, "moe_combine", N, k, H)))
        return st;
    if (N == 0 || H == 0)
        return LOOM_OK;
    LOOM_CUDA_TYPED(dtype, launch_gather_sum<T, true>(yg, pos, w, N, k, H, y, as_stream(stream)));
    return check_launch(ctx, "moe_combine");
}

extern "C" loom_status loom_cuda_moe_combine_bwd(loom_ctx *ctx, const void *dy, const void *yg,
                                                 const int32_t *order, const float *w, int64_t N,
                                                 int k, int64_t H, void *dyg, float *dw,
                                                 loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_combine_bwd", "dy, yg, dyg")) ||
        (st = check_nkh(ctx, "moe_combine_bwd", N, k, H)))
        return st;
    if (N * k == 0)
        return LOOM_OK;
    LOOM_CUDA_TYPED(dtype,
              launch_combine_bwd<T>(dy, yg, order, w, N * k, k, H, dyg, dw, as_stream(stream)));
    return check_launch(ctx, "moe_combine_bwd");
}

extern "C" loom_status loom_cuda_moe_permute_bwd(loom_ctx *ctx, const void *dxg, const int32_t *pos,
                                                 int64_t N, int k, int64_t H, void *dx,
                                                 loom_dtype dtype, void *stream) {
    loom_status st;
    if ((st = need_float(ctx, dtype, "moe_permute_bwd", "dxg, dx")) ||
        (st = check_nkh(ctx, "moe_permute_bwd", N, k, H)))
        return st;
    if (N == 0 || H == 0)
        return LOOM_OK;
    LOOM_CUDA_TYPED(dtype,
              launch_gather_sum<T, false>(dxg, pos, nullptr, N, k, H, dx, as_stream(stream)));
    return check_launch(ctx, "moe_permute_bwd");
}

extern "C" loom_status loom_cuda_moe_regroup(loom_ctx *ctx, const int32_t *rc, int64_t S,
                                             int64_t El, int64_t Rt, int32_t *ix, void *stream) {
    if (S < 1 || El < 1 || S * El > LOOM_CUDA_MOE_REGROUP_MAX)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda moe_regroup: a table of %lld x %lld (sources x experts a rank); at "
                         "most %d entries",
                         (long long)S, (long long)El, LOOM_CUDA_MOE_REGROUP_MAX);
    if (Rt <= 0)
        return LOOM_OK;
    const size_t shm = (size_t)(2 * S * El + El) * sizeof(int32_t);
    regroup_kernel<<<1, SCAN_NT, shm, as_stream(stream)>>>(rc, (int)S, (int)El, Rt, ix);
    return check_launch(ctx, "moe_regroup");
}
