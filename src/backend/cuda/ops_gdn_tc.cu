// The gated delta rule's tensor-core kernels for bf16 (dk <= 128): twins of
// ops_gdn_rule.cu's prep_kernel, out_kernel and dul_kernel (chunk_bwd_kernel's
// is in ops_gdn_tc_bwd.cu, the state passes' in ops_gdn_state.cu) with their
// products on mma.sync, launched by its driver (ops_gdn_rule.cuh's tc_*);
// building blocks in ops_gdn_tc.cuh. Every product's operand sits in shared
// memory as bf16, rounded once where it is made (q and k from the
// workspace's bf16 copies, W and U kept as bf16 there), so fragments come by
// ldmatrix; fp32 accumulators. Staging by cp.async where rows allow, else
// loads batched a thread; zero past the chunk's rows and past dk. Small
// shared memory gives two or three blocks an SM: these kernels are chains of
// small products, latency-bound at one (12% occupancy under ncu on an
// H200). prep_kernel's twin inverts I + A by 16 x 16 blocks
// (invert_unit_lower) and keeps the inverse's rounding (w.Tb) for
// chunk_bwd_kernel's; X and dB are products with it.
//
// Checked against the CPU reference on the CPU emulator (make test-emu) and,
// on an H200, by tests/test_backend_gdn.c and the Qwen3.5 model tests
// (tests/gpu/qwen35.sh).
#include "mma.cuh"
#include "ops_gdn_tc.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {

// out_kernel's and dul_kernel's twins: G, e^G (CH); P (CH, CH); q, k (CH,
// dk16); B: S0's block (dk16, BO) or dO's (CH, BO); U's block (CH, BO).
// Everything but G and e^G only an operand of products: bf16.
struct p_smem {
    float *Gs, *Es;
    bf16 *Ps, *Qs, *Ks, *Bs, *Us;
    size_t bytes;
    __host__ __device__ p_smem(void *base, int64_t dk) {
        carve c(base);
        const int64_t d16 = pad16(dk), rb = d16 > CH ? d16 : CH;
        Gs = c.take<float>(CH), Es = c.take<float>(CH);
        Ps = c.take<bf16>(CH * LDH), Qs = c.take<bf16>(CH * ldk(dk));
        Ks = c.take<bf16>(CH * ldk(dk)), Bs = c.take<bf16>(rb * LDH), Us = c.take<bf16>(CH * LDH);
        bytes = c.off;
    }
};

// The chunk's G, e^G and P (as chunk_p) with Q K^T on tensor cores, q and k
// from qb, kb. Ends with a barrier (every cp.async group of the block waited for).
__device__ void chunk_p_tc(const geo &z, const gdn_ws &w, int64_t t0, int L, int64_t h,
                           const p_smem &m) {
    const int64_t ldq = ldk(z.dk);
    stage_qk(z, w, t0, L, h / z.grp, m.Qs, m.Ks);
    for (int i = threadIdx.x; i < CH; i += NT) {
        m.Gs[i] = i < L ? w.G[(t0 + i) * z.Hv + h] : 0.0f;
        m.Es[i] = expf(m.Gs[i]);
    }
    cp_wait<0>();
    __syncthreads();
    const tile f;
    float acc[1][4][4] = {};
    warp_mma<1, 4>(acc, m.Qs + f.r0 * ldq, (int)ldq, 1, m.Ks + f.c0 * ldq, 1, (int)ldq,
                   (int)pad16(z.dk));
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int i = f.i(e), j = f.j(n, e);
            put(m.Ps + i * LDH + j,
                i < L && j <= i ? acc[0][n][e] * expf(m.Gs[i] - m.Gs[j]) : 0.0f);
        }
    __syncthreads();
}

// out_kernel on tensor cores (bf16, dk <= 128): O = diag(e^G) Q S0 + P U,
// a block per (chunk, head) over dv BO columns at a time, P made once (a
// block per column block had made it twice at Qwen3.5's dv = 128, and
// staged q and k twice).
__global__ void __launch_bounds__(NT) out_tc_kernel(geo z, gdn_ws w, loom_dtype dt, void *o) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = ldk(dk);
    const p_smem m(sm, dk);
    const int64_t c = blockIdx.x, h = blockIdx.y;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int64_t urs = z.Hv * dv;
    const bf16 *Uc = w.Uh + (t0 * z.Hv + h) * dv; // row i at Uc + i Hv dv
    const bf16 *S0 = w.Sb + (c * z.Hv + h) * dk * dv; // key a's row at S0 + a dv
    const bool uv = vec_ok(Uc, dv, urs), sv = vec_ok(S0, dv, dv);
    auto stage = [&](int64_t b0) { // U's and S0's blocks of columns [b0, b0 + BO)
        stage_async(m.Us, LDH, Uc + b0, urs, L, dv - b0 < BO ? dv - b0 : BO, BO, uv);
        stage_async(m.Bs, LDH, S0 + b0, dv, (int)dk, dv - b0, BO, sv, (int)d16);
    };
    stage(0);
    chunk_p_tc(z, w, t0, L, h, m); // its barriers and wait cover the staging above
    const tile f;
    for (int64_t b0 = 0; b0 < dv; b0 += BO) {
        if (b0) {
            __syncthreads(); // Us, Bs read
            stage(b0);
            cp_commit();
            cp_wait<0>();
            __syncthreads();
        }
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, m.Qs + f.r0 * ldq, (int)ldq, 1, m.Bs + f.c0, LDH, 1, (int)d16);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) acc[0][n][e] *= m.Es[f.i(e)];
        warp_mma<1, 4>(acc, m.Ps + f.r0 * LDH, LDH, 1, m.Us + f.c0, LDH, 1, CH);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = f.i(e);
                const int64_t b = b0 + f.j(n, e);
                if (i < L && b < dv) st(o, dt, ((t0 + i) * z.Hv + h) * dv + b, acc[0][n][e]);
            }
    }
}

// dul_kernel on tensor cores: dU's local part P^T dO (dO bf16), a block per
// (chunk, head) over dv BO columns at a time, P made once.
__global__ void __launch_bounds__(NT)
    dul_tc_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dv = z.dv;
    const p_smem m(sm, z.dk);
    const int64_t c = blockIdx.x, h = blockIdx.y;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int64_t ors = z.Hv * dv;
    const bf16 *Oc = (const bf16 *)dout + (t0 * z.Hv + h) * dv;
    const bool ov = vec_ok(Oc, dv, ors);
    auto stage = [&](int64_t b0) { // dO's block of columns [b0, b0 + BO)
        stage_async(m.Bs, LDH, Oc + b0, ors, L, dv - b0 < BO ? dv - b0 : BO, BO, ov);
    };
    stage(0);
    chunk_p_tc(z, w, t0, L, h, m);
    const tile f;
    for (int64_t b0 = 0; b0 < dv; b0 += BO) {
        if (b0) {
            __syncthreads(); // Bs read
            stage(b0);
            cp_commit();
            cp_wait<0>();
            __syncthreads();
        }
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, m.Ps + f.r0, 1, LDH, m.Bs + f.c0, LDH, 1, CH); // A = P^T
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int j = f.i(e);
                const int64_t b = b0 + f.j(n, e);
                if (j < L && b < dv) w.dU[((t0 + j) * z.Hv + h) * dv + b] = acc[0][n][e];
            }
    }
}

// prep_kernel on tensor cores: G, A = strictly lower (beta_i k_i.k_j M_ij)
// with K K^T by mma.sync, T = (I + A)^-1 by blocks (invert_unit_lower; its
// rounding kept in w.Tb for chunk_bwd), then X = [U0 | W] = T [diag(beta)
// V | diag(beta e^G) K] by mma.sync, BO columns at a time (W kept as bf16),
// the first block's inputs loaded into registers during A and the
// inversion, each later block's raw bf16 rows of qkv (k's times its row's
// factor from l2_fwd when used, Rs) by cp.async
// into As (free after the inversion) under the block before's product
// (loading them into registers so took 124 registers or spilled; loading
// them when needed left prep waiting on memory for 40% of its time, ncu on
// an H200). Four blocks an SM (64 registers, 84 bytes spilled; T's fp32
// block over K's rows, which A's product is done with before the inversion
// writes it): 503 us a layer at 0.8B's micro-batch 4 on an H200 against
// 521 at three (80 registers); at the 4B shapes two blocks (128 registers,
// none spilled) had taken 383 us a layer, three 346, the synchronous loads
// 403. Shared: As (CH, LDA); Gs, Bs, Rs (CH); bf16 Ks (CH, dk16) and over
// them Ts (CH, LDA, fp32); bf16 Tb (T's rounding), Xs (CH, BO).
struct prep_smem {
    float *As, *Ts, *Gs, *Bs, *Rs;
    bf16 *Ks, *Tb, *Xs;
    size_t bytes;
    __host__ __device__ prep_smem(void *base, int64_t dk) {
        carve c(base);
        As = c.take<float>(CH * LDA);
        Gs = c.take<float>(CH), Bs = c.take<float>(CH), Rs = c.take<float>(CH);
        const int64_t kt = CH * ldk(dk) * 2 > CH * LDA * 4 ? CH * ldk(dk) : CH * LDA * 2;
        Ks = c.take<bf16>(kt), Ts = (float *)Ks, Tb = c.take<bf16>(CH * LDH);
        Xs = c.take<bf16>(CH * LDH);
        bytes = c.off;
    }
};

__global__ void __launch_bounds__(NT, 4) prep_tc_kernel(const void *qkv, loom_dtype dt,
                                                     const float *g, const float *beta, geo z,
                                                     gdn_ws w) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = ldk(dk);
    const prep_smem m(sm, dk);
    float *As = m.As, *Ts = m.Ts, *Gs = m.Gs, *Bs = m.Bs;
    const int64_t c = blockIdx.x, h = blockIdx.y, hk = h / z.grp;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t = lane & 3;
    stage_qk(z, w, t0, L, hk, nullptr, m.Ks);
    for (int i = tid; i < CH; i += NT) {
        Bs[i] = i < L ? beta[(t0 + i) * z.Hv + h] : 0.0f;
        m.Rs[i] = i < L ? w.rk[(t0 + i) * z.Hk + hk] : 0.0f;
    }
    chunk_g(g, t0, L, z.Hv, h, Gs, w.G);
    // X's inputs of columns [b0, b0 + BO) of [v | k] (raw: beta and e^G at the store);
    // bf16 (use_tc's) rows of qkv, row i at vc, kc + i C; k normalised as l2_fwd
    // made it, the raw value by the row's factor (rk[i Hk]): the same product
    const bf16 *vc = (const bf16 *)qkv + t0 * z.C + 2 * z.Hk * dk + h * dv;
    const bf16 *kc = (const bf16 *)qkv + t0 * z.C + z.Hk * dk + hk * dk;
    const float *rk = w.rk + t0 * z.Hk + hk;
    block_regs xr;
    const auto load_x = [&](int64_t b0) { // a thread's column is v's or k's for all its rows
        const int64_t col = b0 + block_regs::col();
        if (col < dv) {
            const bf16 *p = vc + col;
            xr.load([&](int i, int) { return i < L ? __bfloat162float(p[i * z.C]) : 0.0f; });
        } else if (col < dv + dk) {
            const bf16 *p = kc + (col - dv);
            xr.load([&](int i, int) {
                return i < L ? __bfloat162float(p[i * z.C]) * rk[i * z.Hk] : 0.0f;
            });
        } else {
            xr.load([](int, int) { return 0.0f; });
        }
    };
    load_x(0); // in flight during A and the inversion
    // the raw rows of X's block b0 > 0 into As (row stride BO) by cp.async,
    // committed, where a block is all v or all k (dv a multiple of BO) and
    // the rows go by cp.async (else fill loads them when needed)
    const bool pure = dv % BO == 0 && vec_ok(vc, dv, z.C) && vec_ok(kc, dk, z.C);
    const auto stage_raw = [&](int64_t b0) {
        if (b0 < dv)
            stage_async((bf16 *)As, BO, vc + b0, z.C, L, dv - b0, BO, true);
        else
            stage_async((bf16 *)As, BO, kc + (b0 - dv), z.C, L, dk - (b0 - dv), BO, true);
        cp_commit();
    };
    cp_wait<0>();
    __syncthreads();
    const int r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1);
    { // A by tensor cores (chunk_bwd's twin makes it again from its own K K^T: the same bits)
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, m.Ks + r0 * ldq, (int)ldq, 1, m.Ks + c0 * ldq, 1, (int)ldq, (int)d16);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = r0 + gq + 8 * (e >> 1), j = c0 + 8 * n + 2 * t + (e & 1);
                As[i * LDA + j] =
                    i < L && j < i ? Bs[i] * acc[0][n][e] * expf(Gs[i] - Gs[j]) : 0.0f;
            }
    }
    __syncthreads();
    invert_unit_lower(As, Ts); // ends with a barrier: As free
    if (pure && BO < dv + dk)
        stage_raw(BO);
    bf16 *Tg = w.Tb + (c * z.Hv + h) * CH * CH; // T's rounding, kept for chunk_bwd's products
    for (int p = tid; p < CH * CH; p += NT) {
        const bf16 v = __float2bfloat16_rn(Ts[(p / CH) * LDA + p % CH]);
        m.Tb[(p / CH) * LDH + p % CH] = v;
        Tg[p] = v;
    }
    for (int64_t b0 = 0; b0 < dv + dk; b0 += BO) { // X's columns, BO at a time
        __syncthreads(); // Tb complete; Xs free
        const auto x = [&](int i, int64_t col, float raw) { // X's input from its raw value
            if (i < L && col < dv)
                return Bs[i] * raw;
            return i < L && col < dv + dk ? Bs[i] * expf(Gs[i]) * raw : 0.0f;
        };
        if (b0 == 0) {
            xr.store(m.Xs, LDH, [&](int i, int b, float raw) { return x(i, b, raw); });
        } else if (pure) {
            cp_wait<0>();
            __syncthreads(); // the raw rows in
            const bf16 *rv = (const bf16 *)As;
            xr.load([&](int i, int b) {
                return b0 < dv ? to_f(rv[i * BO + b]) : to_f(rv[i * BO + b]) * m.Rs[i];
            });
            xr.store(m.Xs, LDH, [&](int i, int b, float raw) { return x(i, b0 + b, raw); });
        } else {
            fill(m.Xs, LDH, CH, BO, [&](int i, int b) {
                const int64_t col = b0 + b;
                if (i >= L || col >= dv + dk)
                    return 0.0f;
                const float raw = col < dv ? __bfloat162float(vc[i * z.C + col])
                                           : __bfloat162float(kc[i * z.C + (col - dv)]) * m.Rs[i];
                return x(i, col, raw);
            });
        }
        __syncthreads(); // Xs complete; the raw rows read
        if (pure && b0 > 0 && b0 + BO < dv + dk)
            stage_raw(b0 + BO); // under this block's product
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, m.Tb + r0 * LDH, LDH, 1, m.Xs + c0, LDH, 1, CH);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = r0 + gq + 8 * (e >> 1);
                const int64_t col = b0 + c0 + 8 * n + 2 * t + (e & 1), row = (t0 + i) * z.Hv + h;
                if (i >= L || col >= dv + dk)
                    continue;
                if (col < dv) {
                    w.U0[row * dv + col] = acc[0][n][e];
                    w.U0b[row * dv + col] = __float2bfloat16_rn(acc[0][n][e]);
                } else
                    w.Wh[row * dk + (col - dv)] = __float2bfloat16_rn(acc[0][n][e]);
            }
    }
}

// A kernel given its shared memory, launched on s with NT threads a block.
template <typename... P, typename... A>
loom_status launch(loom_ctx *ctx, const char *op, void (*kern)(P...), dim3 grid, size_t bytes,
                   cudaStream_t s, A... args) {
    const loom_status st = smem_for(ctx, op, kern, bytes);
    if (st)
        return st;
    kern<<<grid, NT, bytes, s>>>(args...);
    return check_launch(ctx, op);
}

// per (chunk, head): the blocks loop over dv's column blocks
dim3 chunk_grid(const geo &z) { return dim3((unsigned)z.NC, (unsigned)z.Hv); }
} // namespace

namespace loom_gdn {

loom_status tc_out(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w, loom_dtype dt,
                   void *o, cudaStream_t s) {
    const size_t b = p_smem(nullptr, z.dk).bytes;
    return launch(ctx, op, out_tc_kernel, chunk_grid(z), b, s, z, w, dt, o);
}

loom_status tc_dul(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                   const void *dout, loom_dtype dt, cudaStream_t s) {
    const size_t b = p_smem(nullptr, z.dk).bytes;
    return launch(ctx, op, dul_tc_kernel, chunk_grid(z), b, s, z, w, dout, dt);
}

loom_status tc_prep(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt,
                    const float *g, const float *beta, const geo &z, const gdn_ws &w,
                    cudaStream_t s) {
    return launch(ctx, op, prep_tc_kernel, dim3((unsigned)z.NC, (unsigned)z.Hv),
                  prep_smem(nullptr, z.dk).bytes, s, qkv, dt, g, beta, z, w);
}

} // namespace loom_gdn
