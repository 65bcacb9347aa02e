// Causal grouped-query attention with document masking (cu_seqlens) and the
// query-subset variant of context parallelism, forward and backward.
//
// BF16/F16 with D = 64 or 128 run on tensor cores (ops_attention_mma.cu);
// everything else (F32, other head sizes, unaligned tensors) here.
//
// Flash-attention-style tiling on CUDA cores, fp32 throughout: tiles of
// queries and keys are converted to fp32 in shared memory, scores and
// products are fp32 FMAs, the softmax is online (running max and sum per
// query row). Query i sees key j iff both lie in one document and j <= i.
//
//   forward   one block per (tile of BQ queries, query head): loops over the
//             key tiles from the first row's document start to the last row.
//   backward  two kernels so that every output has one writer (deterministic,
//             no atomics): dq per (query tile, query head) looping over key
//             tiles; dk, dv per (key tile, kv head) looping over the group's
//             query heads and the query tiles that can see the keys.
//             D_i = dout_i . out_i is recomputed where needed.
//
// Thread layouts (NT = 128 threads): "A" for a BQ x BK score tile, 16 x 8
// threads each holding RA x CA scores (rows ra*RA+i, columns ca+8j); "B" for a
// (rows x DM) accumulator, 8 x 16 threads each holding rows rb*R+i and head
// columns cb+16k. Shared rows are padded by one float against bank conflicts.
#include "ops_attention.cuh"

using namespace loom_cuda;

namespace {

constexpr int NT = ATTN_NT; // threads per block
constexpr int BQ = 32;  // queries per tile

template <int DM>
struct tile {
    static constexpr int BK = DM >= 256 ? 16 : 32; // keys per tile
    static constexpr int LD = DM + 1;              // shared row stride of q/k/v/dout tiles
    static constexpr int LS = BK + 1;              // shared row stride of score tiles
    static constexpr int RA = BQ / 16, CA = BK / 8;
    static constexpr int CB = DM / 16;
};

} // namespace

// rows x DM tile of a (rows_total, H, D) tensor, rows r0.. (n valid), head h,
// into shared fp32 with stride LD; zeros past n rows and D columns.
template <int DM, int ROWS>
__device__ __forceinline__ void load_tile(float *dst, const void *src, loom_dtype dt, int64_t r0,
                                          int n, int64_t H, int64_t h, int D) {
    constexpr int LD = DM + 1;
    for (int idx = threadIdx.x; idx < ROWS * DM; idx += NT) {
        const int r = idx / DM, d = idx % DM;
        float val = 0.0f;
        if (r < n && d < D) val = ld(src, dt, ((r0 + r) * H + h) * (int64_t)D + d);
        dst[r * LD + d] = val;
    }
}

template <int DM>
__global__ void __launch_bounds__(NT) attn_fwd_kernel(attn_args a) {
    using C = tile<DM>;
    constexpr int BK = C::BK, LD = C::LD, LS = C::LS, RA = C::RA, CA = C::CA, CB = C::CB;
    constexpr int RB = BQ / 8;
    extern __shared__ float sm[];
    float *Qs = sm, *Ks = Qs + BQ * LD, *Vs = Ks + BK * LD, *Ss = Vs + BK * LD;
    float *m_s = Ss + BQ * LS, *l_s = m_s + BQ, *al_s = l_s + BQ;
    int *gi_s = (int *)(al_s + BQ), *ds_s = gi_s + BQ;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int64_t t0 = (int64_t)blockIdx.x * BQ;
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv), D = a.D;
    const int nq = (int)(a.Tq - t0 < BQ ? a.Tq - t0 : BQ);

    load_rows<false, BQ>(a, t0, nq, h, gi_s, ds_s, nullptr, nullptr);
    if (tid < BQ) {
        m_s[tid] = -INFINITY;
        l_s[tid] = 0.0f;
    }
    load_tile<DM, BQ>(Qs, a.q, a.dt, t0, nq, a.Hq, h, D);
    __syncthreads();

    // keys from the first row's document start to the last row (rows ascend)
    const int64_t kb = ds_s[0], ke = (int64_t)gi_s[nq - 1] + 1;
    const int ra = tid / 8, ca = tid % 8, rb = tid / 16, cb = tid % 16;
    float o[RB][CB];
#pragma unroll
    for (int i = 0; i < RB; i++)
#pragma unroll
        for (int kk = 0; kk < CB; kk++) o[i][kk] = 0.0f;

    for (int64_t k0 = kb; k0 < ke; k0 += BK) {
        const int nk = (int)(ke - k0 < BK ? ke - k0 : BK);
        load_tile<DM, BK>(Ks, a.k, a.dt, k0, nk, a.Hkv, hk, D);
        load_tile<DM, BK>(Vs, a.v, a.dt, k0, nk, a.Hkv, hk, D);
        __syncthreads();

        float s[RA][CA];
#pragma unroll
        for (int i = 0; i < RA; i++)
#pragma unroll
            for (int j = 0; j < CA; j++) s[i][j] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; d++) {
            float qv[RA], kv[CA];
#pragma unroll
            for (int i = 0; i < RA; i++) qv[i] = Qs[(ra * RA + i) * LD + d];
#pragma unroll
            for (int j = 0; j < CA; j++) kv[j] = Ks[(ca + 8 * j) * LD + d];
#pragma unroll
            for (int i = 0; i < RA; i++)
#pragma unroll
                for (int j = 0; j < CA; j++) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
        }
#pragma unroll
        for (int i = 0; i < RA; i++)
#pragma unroll
            for (int j = 0; j < CA; j++) {
                const int r = ra * RA + i, c = ca + 8 * j;
                const int64_t jg = k0 + c;
                const bool ok = jg >= ds_s[r] && jg <= gi_s[r];
                Ss[r * LS + c] = ok ? s[i][j] * a.scale : -INFINITY;
            }
        __syncthreads();

        // online softmax, a warp per row, a lane per key
        for (int r = warp; r < BQ; r += NT / 32) {
            const float sv = lane < BK ? Ss[r * LS + lane] : -INFINITY;
            const float mold = m_s[r], mnew = fmaxf(mold, warp_max(sv));
            const float p = mnew == -INFINITY ? 0.0f : expf(sv - mnew);
            const float sum = warp_sum(p);
            if (lane < BK) Ss[r * LS + lane] = p;
            __syncwarp(); // every lane has read m_s[r] before lane 0 replaces it
            if (lane == 0) {
                const float al = mold == -INFINITY ? 0.0f : expf(mold - mnew);
                m_s[r] = mnew;
                l_s[r] = l_s[r] * al + sum;
                al_s[r] = al;
            }
        }
        __syncthreads();

#pragma unroll
        for (int i = 0; i < RB; i++) {
            const float al = al_s[rb * RB + i];
#pragma unroll
            for (int kk = 0; kk < CB; kk++) o[i][kk] *= al;
        }
#pragma unroll 2
        for (int c = 0; c < BK; c++) {
            float pv[RB];
#pragma unroll
            for (int i = 0; i < RB; i++) pv[i] = Ss[(rb * RB + i) * LS + c];
#pragma unroll
            for (int kk = 0; kk < CB; kk++) {
                const float vv = Vs[c * LD + cb + 16 * kk];
#pragma unroll
                for (int i = 0; i < RB; i++) o[i][kk] = fmaf(pv[i], vv, o[i][kk]);
            }
        }
        __syncthreads(); // before the next tile overwrites Ks, Vs, Ss
    }

#pragma unroll
    for (int i = 0; i < RB; i++) {
        const int r = rb * RB + i;
        if (r >= nq) continue;
        const float l = l_s[r];
        const int64_t off = ((t0 + r) * a.Hq + h) * (int64_t)D;
#pragma unroll
        for (int kk = 0; kk < CB; kk++) {
            const int d = cb + 16 * kk;
            if (d < D) st(a.o, a.dt, off + d, o[i][kk] / l);
        }
    }
    if (tid < nq) a.lse[(t0 + tid) * a.Hq + h] = (float)((double)m_s[tid] + log((double)l_s[tid]));
}

// Scores and dout.v products of a BQ x BK tile in layout A:
// s[i][j] = q_r . k_c, dp[i][j] = dout_r . v_c.
template <int DM>
__device__ __forceinline__ void tile_s_dp(const float *Qs, const float *dOs, const float *Ks,
                                          const float *Vs, int D, int ra, int ca,
                                          float (&s)[tile<DM>::RA][tile<DM>::CA],
                                          float (&dp)[tile<DM>::RA][tile<DM>::CA]) {
    using C = tile<DM>;
    constexpr int LD = C::LD, RA = C::RA, CA = C::CA;
#pragma unroll
    for (int i = 0; i < RA; i++)
#pragma unroll
        for (int j = 0; j < CA; j++) s[i][j] = dp[i][j] = 0.0f;
#pragma unroll 2
    for (int d = 0; d < D; d++) {
        float qv[RA], dov[RA], kv[CA], vv[CA];
#pragma unroll
        for (int i = 0; i < RA; i++) {
            qv[i] = Qs[(ra * RA + i) * LD + d];
            dov[i] = dOs[(ra * RA + i) * LD + d];
        }
#pragma unroll
        for (int j = 0; j < CA; j++) {
            kv[j] = Ks[(ca + 8 * j) * LD + d];
            vv[j] = Vs[(ca + 8 * j) * LD + d];
        }
#pragma unroll
        for (int i = 0; i < RA; i++)
#pragma unroll
            for (int j = 0; j < CA; j++) {
                s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
                dp[i][j] = fmaf(dov[i], vv[j], dp[i][j]);
            }
    }
}

// dq_i = scale * sum_j P_ij (dP_ij - D_i) k_j, P_ij = exp(scale q_i.k_j - lse_i).
template <int DM>
__global__ void __launch_bounds__(NT) attn_bwd_dq_kernel(attn_args a) {
    using C = tile<DM>;
    constexpr int BK = C::BK, LD = C::LD, LS = C::LS, RA = C::RA, CA = C::CA, CB = C::CB;
    constexpr int RB = BQ / 8;
    extern __shared__ float sm[];
    float *Qs = sm, *dOs = Qs + BQ * LD, *Ks = dOs + BQ * LD, *Vs = Ks + BK * LD;
    float *Ss = Vs + BK * LD, *lse_s = Ss + BQ * LS, *di_s = lse_s + BQ;
    int *gi_s = (int *)(di_s + BQ), *ds_s = gi_s + BQ;

    const int tid = threadIdx.x;
    const int64_t t0 = (int64_t)blockIdx.x * BQ;
    const int h = blockIdx.y, hk = h / (a.Hq / a.Hkv), D = a.D;
    const int nq = (int)(a.Tq - t0 < BQ ? a.Tq - t0 : BQ);

    load_rows<true, BQ>(a, t0, nq, h, gi_s, ds_s, lse_s, di_s);
    load_tile<DM, BQ>(Qs, a.q, a.dt, t0, nq, a.Hq, h, D);
    load_tile<DM, BQ>(dOs, a.dout, a.dt, t0, nq, a.Hq, h, D);
    __syncthreads();

    const int64_t kb = ds_s[0], ke = (int64_t)gi_s[nq - 1] + 1;
    const int ra = tid / 8, ca = tid % 8, rb = tid / 16, cb = tid % 16;
    float acc[RB][CB];
#pragma unroll
    for (int i = 0; i < RB; i++)
#pragma unroll
        for (int kk = 0; kk < CB; kk++) acc[i][kk] = 0.0f;

    for (int64_t k0 = kb; k0 < ke; k0 += BK) {
        const int nk = (int)(ke - k0 < BK ? ke - k0 : BK);
        load_tile<DM, BK>(Ks, a.k, a.dt, k0, nk, a.Hkv, hk, D);
        load_tile<DM, BK>(Vs, a.v, a.dt, k0, nk, a.Hkv, hk, D);
        __syncthreads();
        float s[RA][CA], dp[RA][CA];
        tile_s_dp<DM>(Qs, dOs, Ks, Vs, D, ra, ca, s, dp);
#pragma unroll
        for (int i = 0; i < RA; i++)
#pragma unroll
            for (int j = 0; j < CA; j++) {
                const int r = ra * RA + i, c = ca + 8 * j;
                const int64_t jg = k0 + c;
                float ds = 0.0f;
                if (jg >= ds_s[r] && jg <= gi_s[r]) {
                    const float p = expf(s[i][j] * a.scale - lse_s[r]);
                    ds = p * (dp[i][j] - di_s[r]);
                }
                Ss[r * LS + c] = ds;
            }
        __syncthreads();
#pragma unroll 2
        for (int c = 0; c < BK; c++) {
            float dsv[RB];
#pragma unroll
            for (int i = 0; i < RB; i++) dsv[i] = Ss[(rb * RB + i) * LS + c];
#pragma unroll
            for (int kk = 0; kk < CB; kk++) {
                const float kv = Ks[c * LD + cb + 16 * kk];
#pragma unroll
                for (int i = 0; i < RB; i++) acc[i][kk] = fmaf(dsv[i], kv, acc[i][kk]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < RB; i++) {
        const int r = rb * RB + i;
        if (r >= nq) continue;
        const int64_t off = ((t0 + r) * a.Hq + h) * (int64_t)D;
#pragma unroll
        for (int kk = 0; kk < CB; kk++) {
            const int d = cb + 16 * kk;
            if (d < D) st(a.dq, a.dt, off + d, a.scale * acc[i][kk]);
        }
    }
}

// dk_j = scale * sum_i dS_ij q_i, dv_j = sum_i P_ij dout_i over the group's
// query heads and the local queries that see key j.
template <int DM>
__global__ void __launch_bounds__(NT) attn_bwd_dkdv_kernel(attn_args a) {
    using C = tile<DM>;
    constexpr int BK = C::BK, LD = C::LD, LS = C::LS, RA = C::RA, CA = C::CA, CB = C::CB;
    constexpr int RK = BK / 8; // keys per thread in layout B
    extern __shared__ float sm[];
    float *Ks = sm, *Vs = Ks + BK * LD, *Qs = Vs + BK * LD, *dOs = Qs + BQ * LD;
    float *Ps = dOs + BQ * LD, *dSs = Ps + BQ * LS, *lse_s = dSs + BQ * LS, *di_s = lse_s + BQ;
    int *gi_s = (int *)(di_s + BQ), *ds_s = gi_s + BQ, *range_s = ds_s + BQ;

    const int tid = threadIdx.x;
    const int64_t j0 = (int64_t)blockIdx.x * BK;
    const int hk = blockIdx.y, group = a.Hq / a.Hkv, D = a.D;
    const int nk = (int)(a.T - j0 < BK ? a.T - j0 : BK);

    load_tile<DM, BK>(Ks, a.k, a.dt, j0, nk, a.Hkv, hk, D);
    load_tile<DM, BK>(Vs, a.v, a.dt, j0, nk, a.Hkv, hk, D);
    if (tid == 0) { // local queries that can see a key of this tile
        int64_t s, e;
        doc_bounds(a.cu, a.ndocs, j0 + nk - 1, &s, &e);
        range_s[0] = (int)first_query_at(a.qidx, a.Tq, j0);
        range_s[1] = (int)first_query_at(a.qidx, a.Tq, e);
    }
    __syncthreads();
    const int64_t tq_begin = range_s[0], tq_end = range_s[1];

    const int ra = tid / 8, ca = tid % 8, rb = tid / 16, cb = tid % 16;
    float dk[RK][CB], dv[RK][CB];
#pragma unroll
    for (int i = 0; i < RK; i++)
#pragma unroll
        for (int kk = 0; kk < CB; kk++) dk[i][kk] = dv[i][kk] = 0.0f;

    for (int g = 0; g < group; g++) {
        const int h = hk * group + g;
        for (int64_t t0 = tq_begin; t0 < tq_end; t0 += BQ) {
            const int nq = (int)(tq_end - t0 < BQ ? tq_end - t0 : BQ);
            __syncthreads(); // the previous tile is no longer read
            load_rows<true, BQ>(a, t0, nq, h, gi_s, ds_s, lse_s, di_s);
            load_tile<DM, BQ>(Qs, a.q, a.dt, t0, nq, a.Hq, h, D);
            load_tile<DM, BQ>(dOs, a.dout, a.dt, t0, nq, a.Hq, h, D);
            __syncthreads();
            float s[RA][CA], dp[RA][CA];
            tile_s_dp<DM>(Qs, dOs, Ks, Vs, D, ra, ca, s, dp);
#pragma unroll
            for (int i = 0; i < RA; i++)
#pragma unroll
                for (int j = 0; j < CA; j++) {
                    const int r = ra * RA + i, c = ca + 8 * j;
                    const int64_t jg = j0 + c;
                    float p = 0.0f, ds = 0.0f;
                    if (c < nk && jg >= ds_s[r] && jg <= gi_s[r]) {
                        p = expf(s[i][j] * a.scale - lse_s[r]);
                        ds = p * (dp[i][j] - di_s[r]);
                    }
                    Ps[r * LS + c] = p;
                    dSs[r * LS + c] = ds;
                }
            __syncthreads();
#pragma unroll 2
            for (int r = 0; r < nq; r++) {
                float pv[RK], dsv[RK];
#pragma unroll
                for (int i = 0; i < RK; i++) {
                    pv[i] = Ps[r * LS + rb * RK + i];
                    dsv[i] = dSs[r * LS + rb * RK + i];
                }
#pragma unroll
                for (int kk = 0; kk < CB; kk++) {
                    const float dov = dOs[r * LD + cb + 16 * kk], qv = Qs[r * LD + cb + 16 * kk];
#pragma unroll
                    for (int i = 0; i < RK; i++) {
                        dv[i][kk] = fmaf(pv[i], dov, dv[i][kk]);
                        dk[i][kk] = fmaf(dsv[i], qv, dk[i][kk]);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < RK; i++) {
        const int c = rb * RK + i;
        if (c >= nk) continue;
        const int64_t off = ((j0 + c) * a.Hkv + hk) * (int64_t)D;
#pragma unroll
        for (int kk = 0; kk < CB; kk++) {
            const int d = cb + 16 * kk;
            if (d < D) {
                st(a.dk, a.dt, off + d, a.scale * dk[i][kk]);
                st(a.dv, a.dt, off + d, dv[i][kk]);
            }
        }
    }
}

// ---- host side ----

template <int DM>
static size_t fwd_smem() {
    using C = tile<DM>;
    return sizeof(float) * ((size_t)BQ * C::LD + 2 * C::BK * C::LD + BQ * C::LS + 3 * BQ) +
           sizeof(int) * 2 * BQ;
}
template <int DM>
static size_t dq_smem() {
    using C = tile<DM>;
    return sizeof(float) * ((size_t)2 * BQ * C::LD + 2 * C::BK * C::LD + BQ * C::LS + 2 * BQ) +
           sizeof(int) * 2 * BQ;
}
template <int DM>
static size_t dkdv_smem() {
    using C = tile<DM>;
    return sizeof(float) * ((size_t)2 * C::BK * C::LD + 2 * BQ * C::LD + 2 * BQ * C::LS + 2 * BQ) +
           sizeof(int) * (2 * BQ + 2);
}

template <typename K>
static loom_status launch(loom_ctx *ctx, const char *op, K kernel, dim3 grid, size_t smem,
                          cudaStream_t s, const attn_args &a) {
    loom_status st = check(ctx,
                           cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)smem),
                           op);
    if (st) return st;
    kernel<<<grid, NT, smem, s>>>(a);
    return check_launch(ctx, op);
}

template <int DM>
static loom_status run_fwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s) {
    dim3 grid((unsigned)((a.Tq + BQ - 1) / BQ), (unsigned)a.Hq);
    return launch(ctx, "attention_fwd", attn_fwd_kernel<DM>, grid, fwd_smem<DM>(), s, a);
}

template <int DM>
static loom_status run_bwd(loom_ctx *ctx, const attn_args &a, cudaStream_t s) {
    loom_status st;
    if (a.Tq > 0) {
        dim3 grid((unsigned)((a.Tq + BQ - 1) / BQ), (unsigned)a.Hq);
        if ((st = launch(ctx, "attention_bwd", attn_bwd_dq_kernel<DM>, grid, dq_smem<DM>(), s, a)))
            return st;
    }
    dim3 grid((unsigned)((a.T + tile<DM>::BK - 1) / tile<DM>::BK), (unsigned)a.Hkv);
    return launch(ctx, "attention_bwd", attn_bwd_dkdv_kernel<DM>, grid, dkdv_smem<DM>(), s, a);
}

static loom_status check_args(loom_ctx *ctx, const char *op, loom_dtype dt, int64_t Tq, int64_t T,
                              int64_t Hq, int64_t Hkv, int64_t D, int64_t ndocs, bool has_qidx) {
    loom_status st;
    if ((st = need_float(ctx, dt, op, "q, k, v"))) return st;
    if (Hkv <= 0 || Hq <= 0 || Hq % Hkv != 0 || Hq > 65535)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda %s: %lld query heads is not a multiple of %lld kv heads", op,
                         (long long)Hq, (long long)Hkv);
    if (D < 1 || D > LOOM_CUDA_ATTN_MAX_D)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda %s: head size %lld (1..%d supported)", op,
                         (long long)D, LOOM_CUDA_ATTN_MAX_D);
    if (ndocs < 1 || T < 0 || Tq < 0 || T >= 0x7fffffffLL || Tq > T || (!has_qidx && Tq != T))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda %s: bad sizes Tq=%lld T=%lld ndocs=%lld (qidx %s)", op, (long long)Tq,
                         (long long)T, (long long)ndocs, has_qidx ? "given" : "NULL");
    return LOOM_OK;
}

#define LOOM_ATTN_DISPATCH(fn, D, ...)                                                             \
    ((D) <= 32 ? fn<32>(__VA_ARGS__)                                                               \
               : (D) <= 64 ? fn<64>(__VA_ARGS__) : (D) <= 128 ? fn<128>(__VA_ARGS__) : fn<256>(__VA_ARGS__))

extern "C" loom_status loom_cuda_attention_fwd_q(loom_ctx *ctx, const void *q, const int32_t *qidx,
                                                 int64_t Tq, const void *k, const void *v,
                                                 loom_dtype dtype, int64_t T, int64_t Hq,
                                                 int64_t Hkv, int64_t D, const int32_t *cu_seqlens,
                                                 int64_t ndocs, float scale, void *out, float *lse,
                                                 void *stream) {
    loom_status st = check_args(ctx, "attention_fwd", dtype, Tq, T, Hq, Hkv, D, ndocs, qidx != NULL);
    if (st) return st;
    if (Tq == 0) return LOOM_OK;
    attn_args a = {};
    a.q = q, a.k = k, a.v = v, a.qidx = qidx, a.cu = cu_seqlens;
    a.Tq = Tq, a.T = T, a.ndocs = ndocs, a.Hq = (int)Hq, a.Hkv = (int)Hkv, a.D = (int)D;
    a.scale = scale, a.dt = dtype, a.o = out, a.lse = lse;
    if (attn_mma_fwd(ctx, a, as_stream(stream), &st)) return st;
    return LOOM_ATTN_DISPATCH(run_fwd, D, ctx, a, as_stream(stream));
}

extern "C" loom_status loom_cuda_attention_fwd(loom_ctx *ctx, const void *q, const void *k,
                                               const void *v, loom_dtype dtype, int64_t T,
                                               int64_t Hq, int64_t Hkv, int64_t D,
                                               const int32_t *cu_seqlens, int64_t ndocs,
                                               float scale, void *out, float *lse, void *stream) {
    return loom_cuda_attention_fwd_q(ctx, q, NULL, T, k, v, dtype, T, Hq, Hkv, D, cu_seqlens, ndocs,
                                     scale, out, lse, stream);
}

extern "C" loom_status loom_cuda_attention_bwd_q(loom_ctx *ctx, const void *dout, const void *q,
                                                 const int32_t *qidx, int64_t Tq, const void *k,
                                                 const void *v, const void *out, const float *lse,
                                                 loom_dtype dtype, int64_t T, int64_t Hq,
                                                 int64_t Hkv, int64_t D, const int32_t *cu_seqlens,
                                                 int64_t ndocs, float scale, void *dq, void *dk,
                                                 void *dv, void *stream) {
    loom_status st = check_args(ctx, "attention_bwd", dtype, Tq, T, Hq, Hkv, D, ndocs, qidx != NULL);
    if (st) return st;
    if (T == 0) return LOOM_OK;
    attn_args a = {};
    a.q = q, a.k = k, a.v = v, a.out = out, a.dout = dout, a.qidx = qidx, a.cu = cu_seqlens;
    a.Tq = Tq, a.T = T, a.ndocs = ndocs, a.Hq = (int)Hq, a.Hkv = (int)Hkv, a.D = (int)D;
    a.scale = scale, a.dt = dtype, a.lse_in = lse, a.dq = dq, a.dk = dk, a.dv = dv;
    if (attn_mma_bwd(ctx, a, as_stream(stream), &st)) return st;
    return LOOM_ATTN_DISPATCH(run_bwd, D, ctx, a, as_stream(stream));
}

extern "C" loom_status loom_cuda_attention_bwd(loom_ctx *ctx, const void *dout, const void *q,
                                               const void *k, const void *v, const void *out,
                                               const float *lse, loom_dtype dtype, int64_t T,
                                               int64_t Hq, int64_t Hkv, int64_t D,
                                               const int32_t *cu_seqlens, int64_t ndocs,
                                               float scale, void *dq, void *dk, void *dv,
                                               void *stream) {
    return loom_cuda_attention_bwd_q(ctx, dout, q, NULL, T, k, v, out, lse, dtype, T, Hq, Hkv, D,
                                     cu_seqlens, ndocs, scale, dq, dk, dv, stream);
}
