// LoRA's backward pass over dy on tensor cores (BF16/F16, fp32 accumulators).
//
// An adapter's GEMMs have one small dimension k (the rank r, or a group's
// ranks side by side): they are memory-bound, and cuBLASLt runs each as its
// own kernel after a 4-byte memset. The backward's du = s dy B and
// dB += s dy^T u read the same dy: one kernel here reads it once, which on
// the H100 took 0.052 ms where cuBLASLt's two GEMMs took 0.080 (Qwen3-8B's
// gate, 4096 x 12288, r = 8). The other products (x A^T, u B^T, du A,
// du^T x) stay on cuBLASLt, which was as fast or faster for them
// (bench/RESULTS.md). The kernel is general:
//
//   pass   one read of x (T, K), two optional products:
//          s (T, k) = alpha_s x op(W)        (du = dy B; x A^T)
//          g += alpha_g x^T v, v (T, k)      (dB += dy^T u; dA += du^T x)
//          A block walks a range of rows x columns in 64 x 128 tiles of x,
//          three tiles deep in cp.async; warps 0-3 hold s for up to four row
//          tiles, every warp 16 columns of g for the current column tile.
//          Each block writes fp32 partial sums (s per column range, g per
//          row range) and a small second kernel adds them in a fixed order:
//          no atomics, the same bits on every run and every GPU (the split
//          depends on the shape only).
//
//   batch  up to three passes of one k (a LoRA group's q, k, v or gate, up)
//          in one launch of each kernel, every pass split as it would be
//          alone (so the same bits): two launches a group instead of two a
//          module (+0.35% on Qwen3-8B LoRA's step, bench/RESULTS.md).
#include "mma.cuh"

using namespace loom_cuda;

namespace {

constexpr int PT_R = 64, PT_C = 128, PT_THREADS = 256; // pass tile and block
constexpr int PT_STAGES = 3;
constexpr int PT_MAX_RT = 4;        // row tiles per block while s is kept
constexpr int64_t PT_TARGET = 264;  // blocks the pass aims at (fixed: the split
                                    // must not depend on the GPU)
constexpr int XLD = PT_C + 8;       // x tile row stride (elements): 272 bytes

// Row stride (elements) of a tile of rows n columns wide (n a multiple of 8)
// whose ldmatrix rows fall in distinct banks: an odd number of 16-byte units.
__host__ __device__ constexpr int odd_ld(int n) { return (n / 8) % 2 ? n : n + 8; }

// ---- pass ----

struct pass_args {
    const void *x, *w, *v;
    int64_t ldx, ldw, ldv;
    int64_t T, K;
    int k;
    int64_t tr, cr;       // rows and columns of a block's range
    float *s_part;        // (column ranges, T, k) or NULL
    float *g_part;        // (row ranges, K, k) or NULL
    int64_t ncs;          // column ranges: block b of this pass is (b % ncs, b / ncs)
};

// Up to PT_MAX_OPS passes of one k and one W layout in one launch: block b
// belongs to the pass i with b0[i] <= b < b0[i + 1]
constexpr int PT_MAX_OPS = 3;
struct pass_batch {
    pass_args op[PT_MAX_OPS];
    int64_t b0[PT_MAX_OPS + 1];
    int n;
};

// One stage: x tile [PT_R][XLD], v tile [PT_R][VLD], W tile ([k][XLD] for
// W (k, K), [PT_C][k'] for W (K, k)).
template <int NT, bool WKK> struct pass_layout {
    static constexpr int K = 8 * NT, VLD = odd_ld(K), WLD = WKK ? XLD : odd_ld(K);
    static constexpr int X = PT_R * XLD, V = PT_R * VLD, W = WKK ? K * XLD : PT_C * WLD;
    static constexpr int STAGE = X + V + W; // elements
};

template <typename T, int NT, bool WKK>
__global__ void __launch_bounds__(PT_THREADS)
lora_pass_kernel(const __grid_constant__ pass_batch pb) {
    using L = pass_layout<NT, WKK>;
    int oi = 0;
    while (oi + 1 < pb.n && (int64_t)blockIdx.x >= pb.b0[oi + 1]) oi++;
    const pass_args &a = pb.op[oi];
    const int64_t blk = (int64_t)blockIdx.x - pb.b0[oi], bx = blk % a.ncs, by = blk / a.ncs;
    extern __shared__ __align__(16) unsigned char psmem[];
    T *const sm = (T *)psmem;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g8 = lane >> 2, t4 = lane & 3;
    const T *x = (const T *)a.x, *w = (const T *)a.w, *v = (const T *)a.v;
    const bool has_s = a.s_part != nullptr, has_g = a.g_part != nullptr;
    const int k = a.k;
    const int64_t rb = by * a.tr, re = rb + a.tr < a.T ? rb + a.tr : a.T;
    const int64_t cb = bx * a.cr, ce = cb + a.cr < a.K ? cb + a.cr : a.K;
    const int nrt = (int)((re - rb + PT_R - 1) / PT_R), nct = (int)((ce - cb + PT_C - 1) / PT_C);
    const int nsteps = nrt * nct;

    // stage i: column tile i / nrt, row tile i % nrt
    auto load = [&](int i) {
        if (i >= nsteps) return;
        T *xs = sm + (i % PT_STAGES) * L::STAGE, *vs = xs + L::X, *ws = vs + L::V;
        const int64_t c0 = cb + (int64_t)(i / nrt) * PT_C, r0 = rb + (int64_t)(i % nrt) * PT_R;
        for (int j = tid; j < PT_R * (PT_C / 8); j += PT_THREADS) {
            const int r = j / (PT_C / 8), c = (j % (PT_C / 8)) * 8;
            const bool ok = r0 + r < re && c0 + c < ce;
            cp_async16(xs + r * XLD + c, ok ? x + (r0 + r) * a.ldx + c0 + c : x, ok);
        }
        if (has_g)
            for (int j = tid; j < PT_R * NT; j += PT_THREADS) {
                const int r = j / NT, c = (j % NT) * 8;
                const bool ok = r0 + r < re && c < k;
                cp_async16(vs + r * L::VLD + c, ok ? v + (r0 + r) * a.ldv + c : v, ok);
            }
        if (has_s && WKK) { // W (k, K): [kk][column]
            for (int j = tid; j < L::K * (PT_C / 8); j += PT_THREADS) {
                const int kk = j / (PT_C / 8), c = (j % (PT_C / 8)) * 8;
                const bool ok = kk < k && c0 + c < ce;
                cp_async16(ws + kk * XLD + c, ok ? w + kk * a.ldw + c0 + c : w, ok);
            }
        }
        if (has_s && !WKK) { // W (K, k): [column][kk]
            for (int j = tid; j < PT_C * NT; j += PT_THREADS) {
                const int c = j / NT, kk = (j % NT) * 8;
                const bool ok = c0 + c < ce && kk < k;
                cp_async16(ws + c * L::WLD + kk, ok ? w + (c0 + c) * a.ldw + kk : w, ok);
            }
        }
    };

    float sacc[PT_MAX_RT][NT][4], gacc[NT][4];
#pragma unroll
    for (int r = 0; r < PT_MAX_RT; r++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) sacc[r][n][e] = 0.0f;
#pragma unroll
    for (int n = 0; n < NT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) gacc[n][e] = 0.0f;

#pragma unroll
    for (int i = 0; i < PT_STAGES - 1; i++) {
        load(i);
        cp_commit();
    }
    int step = 0;
    for (int ct = 0; ct < nct; ct++) {
        for (int rt0 = 0; rt0 < nrt; rt0 += PT_MAX_RT) {
#pragma unroll
            for (int q = 0; q < PT_MAX_RT; q++) {
                if (rt0 + q >= nrt) break;
                cp_wait<PT_STAGES - 2>();
                __syncthreads();
                const T *xs = sm + (step % PT_STAGES) * L::STAGE, *vs = xs + L::X, *ws = vs + L::V;
                if (has_s && warp < 4) { // s rows 16 warp .. +16 of row tile q, this column tile
#pragma unroll
                    for (int ks = 0; ks < PT_C / 16; ks++) {
                        uint32_t af[4];
                        ldsm_x4(af, a_addr<XLD>(xs, 16 * warp, 16 * ks, lane));
#pragma unroll
                        for (int n = 0; n < NT; n++) {
                            uint32_t bf[2];
                            if constexpr (WKK) ldsm_x2(bf, b1_addr(ws, XLD, 8 * n, 16 * ks, lane));
                            else ldsm_x2_t(bf, bt1_addr(ws, L::WLD, 16 * ks, 8 * n, lane));
                            mma_type<T>::mma(sacc[q][n], af, bf[0], bf[1]);
                        }
                    }
                }
                if (has_g) { // g columns 16 warp .. +16 of this tile, over its 64 rows
#pragma unroll
                    for (int ks = 0; ks < PT_R / 16; ks++) {
                        uint32_t af[4];
                        ldsm_x4_t(af, at_addr<XLD>(xs, 16 * warp, 16 * ks, lane));
#pragma unroll
                        for (int n = 0; n < NT; n++) {
                            uint32_t bf[2];
                            ldsm_x2_t(bf, bt1_addr(vs, L::VLD, 16 * ks, 8 * n, lane));
                            mma_type<T>::mma(gacc[n], af, bf[0], bf[1]);
                        }
                    }
                }
                load(step + PT_STAGES - 1);
                cp_commit();
                step++;
            }
        }
        if (has_g) { // this column tile's partial g over the block's rows
            const int64_t c0 = cb + (int64_t)ct * PT_C;
            float *gp = a.g_part + by * a.K * k;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const int64_t col = c0 + 16 * warp + g8;
                const int kk = 8 * n + 2 * t4;
                if (col < ce) *(float2 *)(gp + col * k + kk) = make_float2(gacc[n][0], gacc[n][1]);
                if (col + 8 < ce) *(float2 *)(gp + (col + 8) * k + kk) = make_float2(gacc[n][2], gacc[n][3]);
#pragma unroll
                for (int e = 0; e < 4; e++) gacc[n][e] = 0.0f;
            }
        }
    }
    cp_wait<0>();
    if (has_s && warp < 4) { // the block's partial s over its columns
        float *sp = a.s_part + bx * a.T * k;
#pragma unroll
        for (int q = 0; q < PT_MAX_RT; q++) {
            if (q >= nrt) break;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const int64_t row = rb + (int64_t)q * PT_R + 16 * warp + g8;
                const int kk = 8 * n + 2 * t4;
                if (row < re) *(float2 *)(sp + row * k + kk) = make_float2(sacc[q][n][0], sacc[q][n][1]);
                if (row + 8 < re)
                    *(float2 *)(sp + (row + 8) * k + kk) = make_float2(sacc[q][n][2], sacc[q][n][3]);
            }
        }
    }
}

// s (T, k; lds) = alpha_s * the column ranges' partials, in order; g (K, k;
// ldg, or its transpose) += alpha_g * the row ranges' partials, in order. A
// batch: element i of the launch belongs to pass j with e0[j] <= i < e0[j + 1].
struct finish_args {
    const float *s_part, *g_part;
    int64_t ns, nrows, ng, K, lds, ldg;
    int k;
    float alpha_s, alpha_g;
    void *s;
    float *g;
    bool g_t;
};
struct finish_batch {
    finish_args op[PT_MAX_OPS];
    int64_t e0[PT_MAX_OPS + 1];
    int n;
};

template <typename T>
__global__ void lora_pass_finish_kernel(const __grid_constant__ finish_batch fb) {
    grid_each(fb.e0[fb.n], [&](int64_t i) {
        int j = 0;
        while (j + 1 < fb.n && i >= fb.e0[j + 1]) j++;
        const finish_args &f = fb.op[j];
        i -= fb.e0[j];
        const int k = f.k;
        const int64_t n_s = f.s_part ? f.nrows * k : 0, K = f.K;
        if (i < n_s) {
            const int64_t r = i / k, c = i % k;
            float sum = 0.0f;
            for (int64_t p = 0; p < f.ns; p++) sum += f.s_part[(p * f.nrows + r) * k + c];
            ((T *)f.s)[r * f.lds + c] = from_f<T>(f.alpha_s * sum);
            return;
        }
        i -= n_s;
        int64_t col, c;
        if (f.g_t) col = i % K, c = i / K; // consecutive threads: consecutive columns of g^T
        else col = i / k, c = i % k;
        float sum = 0.0f;
        for (int64_t p = 0; p < f.ng; p++) sum += f.g_part[(p * K + col) * k + c];
        float *dst = f.g_t ? f.g + c * f.ldg + col : f.g + col * f.ldg + c;
        *dst += f.alpha_g * sum;
    });
}

// How a pass is split: rows per block (tr) and columns per block (cr), from
// the shape alone. Blocks that keep s hold at most PT_MAX_RT row tiles; the
// other dimension is cut so that there are about PT_TARGET blocks.
struct pass_plan {
    int64_t tr, cr, nrs, ncs; // row ranges (g partials), column ranges (s partials)
};
pass_plan plan_pass(int64_t T, int64_t K, bool has_s) {
    auto up = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
    pass_plan p;
    const int64_t ctiles = up(K, PT_C), rtiles = up(T, PT_R);
    if (has_s) {
        p.tr = PT_R * (rtiles < PT_MAX_RT ? rtiles : PT_MAX_RT);
        p.nrs = up(T, p.tr);
        int64_t want = up(PT_TARGET, p.nrs); // column ranges
        if (want > ctiles) want = ctiles;
        p.cr = PT_C * up(ctiles, want);
    } else { // g only: one column tile a block, rows cut for the block count
        p.cr = PT_C;
        int64_t want = up(PT_TARGET, ctiles);
        if (want > rtiles) want = rtiles;
        p.tr = PT_R * up(rtiles, want);
        p.nrs = up(T, p.tr);
    }
    p.ncs = up(K, p.cr);
    return p;
}

size_t pass_scratch(const pass_plan &p, int64_t T, int64_t K, int64_t k, bool has_s, bool has_g) {
    size_t b = 0;
    if (has_s) b += (size_t)(p.ncs * T * k) * sizeof(float);
    if (has_g) b += (size_t)(p.nrs * K * k) * sizeof(float);
    return b;
}

bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }
// a row-major operand the kernels read in 16-byte pieces
bool rows_ok(const void *p, int64_t ld, int64_t cols) { return al16(p) && ld % 8 == 0 && ld >= cols; }

template <typename T, int NT, bool WKK>
loom_status launch_pass(loom_ctx *ctx, const pass_batch &b, cudaStream_t s) {
    using L = pass_layout<NT, WKK>;
    const size_t smem = (size_t)PT_STAGES * L::STAGE * sizeof(T);
    auto kern = lora_pass_kernel<T, NT, WKK>;
    loom_status st = check(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
                           "lora_pass");
    if (st) return st;
    kern<<<(unsigned)b.b0[b.n], PT_THREADS, smem, s>>>(b);
    return check_launch(ctx, "lora_pass");
}

template <typename T>
loom_status pass_dispatch(loom_ctx *ctx, int nt, bool wkk, const pass_batch &b, cudaStream_t s) {
#define LP(N) return wkk ? launch_pass<T, N, true>(ctx, b, s) : launch_pass<T, N, false>(ctx, b, s)
    switch (nt) {
    case 1: LP(1);
    case 2: LP(2);
    case 3: LP(3);
    default: LP(4);
    }
#undef LP
}

} // namespace

extern "C" bool loom_cuda_lora_ok(loom_dtype dtype, int64_t k) {
    return (dtype == LOOM_BF16 || dtype == LOOM_F16) && k > 0 && k % 8 == 0 && k <= LOOM_CUDA_LORA_MAX_K;
}

extern "C" bool loom_cuda_lora_pass_ok(loom_dtype dtype, int64_t T, int64_t K, int64_t k, const void *x,
                                       int64_t ldx, const void *w, bool w_kk, int64_t ldw, const void *s,
                                       int64_t lds, const void *v, int64_t ldv, bool g_t, int64_t ldg) {
    const bool hs = s != nullptr, hg = v != nullptr;
    return loom_cuda_lora_ok(dtype, k) && T >= 0 && K >= 0 && K % 8 == 0 && rows_ok(x, ldx, K) &&
           (!hs || (rows_ok(s, lds, k) && rows_ok(w, ldw, w_kk ? K : k))) &&
           (!hg || (rows_ok(v, ldv, k) && ldg >= (g_t ? K : k)));
}

// Scratch of one pass, rounded up so that the next of a batch starts aligned
static size_t pass_bytes(int64_t T, int64_t K, int64_t k, bool hs, bool hg) {
    if (T <= 0 || K <= 0 || k <= 0 || (!hs && !hg)) return 0;
    return (pass_scratch(plan_pass(T, K, hs), T, K, k, hs, hg) + 255) / 256 * 256;
}
static size_t op_scratch(const loom_cuda_pass_op &o) { return pass_bytes(o.T, o.K, o.k, o.s != nullptr, o.g != nullptr); }

extern "C" size_t loom_cuda_lora_pass_scratch_bytes(int64_t T, int64_t K, int64_t k, bool s, bool g) {
    return pass_bytes(T, K, k, s, g);
}

extern "C" size_t loom_cuda_lora_pass_n_scratch_bytes(int n, const loom_cuda_pass_op *ops) {
    size_t b = 0;
    for (int i = 0; i < n; i++) b += op_scratch(ops[i]);
    return b;
}

extern "C" loom_status loom_cuda_lora_pass_n(loom_ctx *ctx, int n, const loom_cuda_pass_op *ops, loom_dtype dtype,
                                             void *scratch, size_t scratch_bytes, void *stream) {
    if (n < 1 || n > PT_MAX_OPS)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda lora_pass: a batch holds 1 to %d passes (got %d)",
                         PT_MAX_OPS, n);
    for (int i = 0; i < n; i++) {
        const loom_cuda_pass_op &o = ops[i];
        if (!loom_cuda_lora_ok(dtype, o.k))
            return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                             "cuda lora_pass: needs BF16/F16 and k a multiple of 8 up to %d (got %s, k=%lld)",
                             LOOM_CUDA_LORA_MAX_K, loom_dtype_name(dtype), (long long)o.k);
        if (o.k != ops[0].k || o.w_kk != ops[0].w_kk)
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "cuda lora_pass: the passes of a batch share k and W's layout (pass %d: k=%lld "
                             "w_kk=%d, pass 0: k=%lld w_kk=%d)",
                             i, (long long)o.k, (int)o.w_kk, (long long)ops[0].k, (int)ops[0].w_kk);
        if (!loom_cuda_lora_pass_ok(dtype, o.T, o.K, o.k, o.x, o.ldx, o.w, o.w_kk, o.ldw, o.s, o.lds,
                                    o.g ? o.v : nullptr, o.ldv, o.g_t, o.ldg))
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                             "cuda lora_pass: K=%lld must be a multiple of 8 and every operand 16-byte "
                             "aligned with row strides of whole 16-byte units",
                             (long long)o.K);
    }
    const size_t need = loom_cuda_lora_pass_n_scratch_bytes(n, ops);
    if (need && (!scratch || scratch_bytes < need))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda lora_pass: needs %zu bytes of scratch (loom_cuda_lora_pass_n_scratch_bytes), got %zu",
                         need, scratch_bytes);
    pass_batch pb = {};
    finish_batch fb = {};
    char *scr = (char *)scratch;
    for (int i = 0; i < n; i++) {
        const loom_cuda_pass_op &o = ops[i];
        const bool hs = o.s != nullptr, hg = o.g != nullptr;
        if (!o.T || !o.K || (!hs && !hg)) continue; // nothing to do for this one
        const pass_plan p = plan_pass(o.T, o.K, hs);
        pass_args &a = pb.op[pb.n];
        a.x = o.x, a.w = o.w, a.v = o.v, a.ldx = o.ldx, a.ldw = o.ldw, a.ldv = o.ldv;
        a.T = o.T, a.K = o.K, a.k = (int)o.k, a.tr = p.tr, a.cr = p.cr, a.ncs = p.ncs;
        a.s_part = hs ? (float *)scr : nullptr;
        a.g_part = hg ? (float *)scr + (hs ? p.ncs * o.T * o.k : 0) : nullptr;
        scr += op_scratch(o);
        pb.b0[pb.n + 1] = pb.b0[pb.n] + p.ncs * p.nrs;
        finish_args &f = fb.op[fb.n];
        f.s_part = a.s_part, f.g_part = a.g_part, f.ns = p.ncs, f.nrows = o.T, f.ng = p.nrs, f.K = o.K;
        f.lds = o.lds, f.ldg = o.ldg, f.k = (int)o.k, f.alpha_s = o.alpha_s, f.alpha_g = o.alpha_g;
        f.s = o.s, f.g = o.g, f.g_t = o.g_t;
        fb.e0[fb.n + 1] = fb.e0[fb.n] + (hs ? o.T * o.k : 0) + (hg ? o.K * o.k : 0);
        pb.n++, fb.n++;
    }
    if (!pb.n) return LOOM_OK;
    cudaStream_t st = as_stream(stream);
    const int nt = (int)(ops[0].k / 8);
    loom_status rc = dtype == LOOM_BF16 ? pass_dispatch<__nv_bfloat16>(ctx, nt, ops[0].w_kk, pb, st)
                                        : pass_dispatch<__half>(ctx, nt, ops[0].w_kk, pb, st);
    if (rc) return rc;
    if (dtype == LOOM_BF16)
        lora_pass_finish_kernel<__nv_bfloat16><<<grid_for(fb.e0[fb.n], 256), 256, 0, st>>>(fb);
    else
        lora_pass_finish_kernel<__half><<<grid_for(fb.e0[fb.n], 256), 256, 0, st>>>(fb);
    return check_launch(ctx, "lora_pass");
}

extern "C" loom_status loom_cuda_lora_pass(loom_ctx *ctx, int64_t T, int64_t K, int64_t k, const void *x,
                                           int64_t ldx, const void *w, bool w_kk, int64_t ldw,
                                           float alpha_s, void *s, int64_t lds, const void *v,
                                           int64_t ldv, float alpha_g, float *g, bool g_t, int64_t ldg,
                                           loom_dtype dtype, void *scratch, size_t scratch_bytes,
                                           void *stream) {
    const loom_cuda_pass_op o = {T, K, k, x, ldx, w, w_kk, ldw, alpha_s, s, lds, v, ldv, alpha_g, g, g_t, ldg};
    return loom_cuda_lora_pass_n(ctx, 1, &o, dtype, scratch, scratch_bytes, stream);
}
