// The gated delta rule's tensor-core kernels for bf16 (dk <= 128): twins of
// ops_gdn_rule.cu's prep_kernel, out_kernel, dul_kernel, state_fwd_kernel,
// state_bwd_kernel and (in ops_gdn_tc_bwd.cu) chunk_bwd_kernel with their
// products on mma.sync, launched by its driver (ops_gdn_rule.cuh's tc_*);
// building blocks in ops_gdn_tc.cuh. Every product's operand
// sits in shared memory as bf16, rounded once where it is made (q and k from
// the workspace's bf16 copies, W and U kept as bf16 there, the states with
// a bf16 shadow beside their fp32), so fragments come by ldmatrix; fp32
// accumulators, fp32 states. Staging by cp.async where rows allow (the
// forward state pass a chunk ahead), else loads batched a thread; zero past
// the chunk's rows and past dk. Small shared memory gives two or three
// blocks an SM: these kernels are chains of small products, latency-bound
// at one (12% occupancy under ncu on an H200). prep_kernel's and
// chunk_bwd_kernel's twins invert I + A by 16 x 16 blocks
// (invert_unit_lower) and take X and dB as products with the inverse.
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

// out_kernel on tensor cores (bf16, dk <= 128): O = diag(e^G) Q S0 + P U
// over BO columns of dv.
__global__ void __launch_bounds__(NT) out_tc_kernel(geo z, gdn_ws w, loom_dtype dt, void *o) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = ldk(dk);
    const p_smem m(sm, dk);
    const int64_t c = blockIdx.x, h = blockIdx.y, b0 = (int64_t)blockIdx.z * BO;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int64_t urs = z.Hv * dv;
    const bf16 *Uc = w.Uh + (t0 * z.Hv + h) * dv + b0; // row i at Uc + i Hv dv
    stage_async(m.Us, LDH, Uc, urs, L, dv - b0 < BO ? dv - b0 : BO, BO, vec_ok(Uc, dv, urs));
    const float *S0 = w.S + (c * z.Hv + h) * dk * dv;
    fill(m.Bs, LDH, (int)d16, BO,
         [&](int a, int b) { return a < dk && b0 + b < dv ? S0[a * dv + b0 + b] : 0.0f; });
    chunk_p_tc(z, w, t0, L, h, m); // its barriers cover the staging above
    const tile f;
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

// dul_kernel on tensor cores: dU's local part P^T dO over BO columns (dO bf16).
__global__ void __launch_bounds__(NT)
    dul_tc_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dv = z.dv;
    const p_smem m(sm, z.dk);
    const int64_t c = blockIdx.x, h = blockIdx.y, b0 = (int64_t)blockIdx.z * BO;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int64_t ors = z.Hv * dv;
    const bf16 *Oc = (const bf16 *)dout + (t0 * z.Hv + h) * dv + b0;
    stage_async(m.Bs, LDH, Oc, ors, L, dv - b0 < BO ? dv - b0 : BO, BO, vec_ok(Oc, dv, ors));
    chunk_p_tc(z, w, t0, L, h, m);
    const tile f;
    float acc[1][4][4] = {};
    warp_mma<1, 4>(acc, m.Ps + f.r0, 1, LDH, m.Bs + f.c0, LDH, 1, CH); // A = P^T
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int j = f.i(e);
            const int64_t b = b0 + f.j(n, e);
            if (j < L && b < dv) w.dU[((t0 + j) * z.Hv + h) * dv + b] = acc[0][n][e];
        }
}

// prep_kernel on tensor cores: G, A = strictly lower (beta_i k_i.k_j M_ij)
// with K K^T by mma.sync, T = (I + A)^-1 by blocks (invert_unit_lower),
// then X = [U0 | W] = T [diag(beta) V | diag(beta e^G) K] by mma.sync, BO
// columns at a time (W kept as bf16). Shared: As, Ts (CH, LDA); Gs, Bs
// (CH); bf16 Ks, Tb (T's rounding), Xs (CH, BO).
struct prep_smem {
    float *As, *Ts, *Gs, *Bs;
    bf16 *Ks, *Tb, *Xs;
    size_t bytes;
    __host__ __device__ prep_smem(void *base, int64_t dk) {
        carve c(base);
        As = c.take<float>(CH * LDA), Ts = c.take<float>(CH * LDA);
        Gs = c.take<float>(CH), Bs = c.take<float>(CH);
        Ks = c.take<bf16>(CH * ldk(dk)), Tb = c.take<bf16>(CH * LDH);
        Xs = c.take<bf16>(CH * LDH);
        bytes = c.off;
    }
};

__global__ void __launch_bounds__(NT) prep_tc_kernel(const void *qkv, loom_dtype dt,
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
    for (int i = tid; i < CH; i += NT)
        Bs[i] = i < L ? beta[(t0 + i) * z.Hv + h] : 0.0f;
    chunk_g(g, t0, L, z.Hv, h, Gs, w.G);
    const float *kc = w.kn + (t0 * z.Hk + hk) * dk; // row i at kc + i Hk dk
    cp_wait<0>();
    __syncthreads();
    const int r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1);
    { // A by tensor cores
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, m.Ks + r0 * ldq, (int)ldq, 1, m.Ks + c0 * ldq, 1, (int)ldq, (int)d16);
        float *Ag = w.A + (c * z.Hv + h) * CH * CH;
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = r0 + gq + 8 * (e >> 1), j = c0 + 8 * n + 2 * t + (e & 1);
                const float a = i < L && j < i ? Bs[i] * acc[0][n][e] * expf(Gs[i] - Gs[j]) : 0.0f;
                As[i * LDA + j] = a;
                Ag[i * CH + j] = a;
            }
    }
    __syncthreads();
    invert_unit_lower(As, Ts);
    for (int p = tid; p < CH * CH; p += NT)
        m.Tb[(p / CH) * LDH + p % CH] = __float2bfloat16_rn(Ts[(p / CH) * LDA + p % CH]);
    for (int64_t b0 = 0; b0 < dv + dk; b0 += BO) { // X's columns, BO at a time
        __syncthreads(); // Tb complete; Xs free
        fill(m.Xs, LDH, CH, BO, [&](int i, int b) {
            const int64_t col = b0 + b;
            if (i < L && col < dv)
                return Bs[i] * ld(qkv, dt, (t0 + i) * z.C + 2 * z.Hk * dk + h * dv + col);
            if (i < L && col < dv + dk)
                return Bs[i] * expf(Gs[i]) * kc[i * z.Hk * dk + (col - dv)];
            return 0.0f;
        });
        __syncthreads();
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, m.Tb + r0 * LDH, LDH, 1, m.Xs + c0, LDH, 1, CH);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = r0 + gq + 8 * (e >> 1);
                const int64_t col = b0 + c0 + 8 * n + 2 * t + (e & 1), row = (t0 + i) * z.Hv + h;
                if (i >= L || col >= dv + dk)
                    continue;
                if (col < dv)
                    w.U0[row * dv + col] = acc[0][n][e];
                else
                    w.Wh[row * dk + (col - dv)] = __float2bfloat16_rn(acc[0][n][e]);
            }
    }
}

// The state passes, per (document, head, BVT columns): chains of chunks, so
// each chunk's step is latency: their operands come by cp.async (16-byte
// pieces, no conversion; plain loads where a row is not a multiple of 16
// bytes), the forward's a chunk ahead, with two blocks an SM (q, k and W in
// bf16: their shared memory fits twice); the decays scale the small (CH,
// BVT) side of each product instead of the staged (CH, dk) one. BVT
// columns a block: half the fp32 kernels' BV, for twice the blocks
// (Qwen3.5-0.8B has 16 value heads).
constexpr int BVT = 16, LDS = BVT + 4, LDSH = BVT + 8, NNU = BVT / 16, NNS = BVT / 8;

// Chunk c's decays for the state passes, loaded a chunk ahead: GL = G at
// its last token (every thread), gj = G at token threadIdx.x (< L).
struct chunk_decay {
    float GL = 0.0f, gj = 0.0f;
    __device__ void load(const geo &z, const gdn_ws &w, int c, int64_t h) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        GL = w.G[(t0 + L - 1) * z.Hv + h];
        gj = (int)threadIdx.x < L ? w.G[(t0 + threadIdx.x) * z.Hv + h] : 0.0f;
    }
};
static_assert(NT >= CH, "a thread per token of the chunk");

// The passes' state (Ss: d16 rows of LDS) and its bf16 rounding (Sh: rows of
// LDSH, the products' operand) zeroed, with a barrier.
__device__ __forceinline__ void zero_state(float *Ss, bf16 *Sh, int64_t d16) {
    for (int64_t p = threadIdx.x; p < d16 * LDS; p += NT)
        Ss[p] = 0.0f;
    for (int64_t p = threadIdx.x; p < d16 * LDSH; p += NT)
        Sh[p] = __float2bfloat16_rn(0.0f);
    __syncthreads();
}

// A warp's tile of the state (rows r0 on): S <- next(S, mm, e) for its
// accumulator (mm, e), in fp32 and its bf16 rounding.
template <typename F>
__device__ __forceinline__ void update_state(float *Ss, bf16 *Sh, int r0, F next) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int mm = 0; mm < NNS; mm++)
        for (int e = 0; e < 4; e++) {
            const int i = r0 + g + 8 * (e >> 1), b = 8 * mm + 2 * t + (e & 1);
            const float v = next(Ss[i * LDS + b], mm, e);
            Ss[i * LDS + b] = v;
            Sh[i * LDSH + b] = __float2bfloat16_rn(v);
        }
}

// Ss's first nb columns of dk rows to the (dk, dv) block at Sg.
__device__ __forceinline__ void store_state(float *Sg, const float *Ss, int64_t dk, int64_t dv,
                                            int nb) {
    for (int64_t p = threadIdx.x; p < dk * BVT; p += NT)
        if (p % BVT < nb)
            Sg[(p / BVT) * dv + p % BVT] = Ss[(p / BVT) * LDS + p % BVT];
}

// state_fwd_kernel on tensor cores (bf16, dk <= 128): U = U0 - W S0 (kept
// as bf16) and S <- e^G_L S + K^T (Ds U) (Ds_j = e^(G_L - G_j)) by
// mma.sync, the state in fp32 shared memory (Ss: dk16 rows, zero past dk);
// W, K (bf16) and U0 (CH, BVT + 4) double-buffered, chunk c + 1's copied
// while c runs.
struct state_fwd_smem {
    float *Ss, *Ob, *Ds;
    bf16 *Sh, *Us, *Wb, *Kb;
    size_t bytes;
    __host__ __device__ state_fwd_smem(void *base, int64_t dk) {
        carve c(base);
        Ss = c.take<float>(pad16(dk) * LDS), Ob = c.take<float>(2 * CH * LDS);
        Ds = c.take<float>(CH), Sh = c.take<bf16>(pad16(dk) * LDSH);
        Us = c.take<bf16>(CH * LDSH);
        Wb = c.take<bf16>(2 * CH * ldk(dk)), Kb = c.take<bf16>(2 * CH * ldk(dk));
        bytes = c.off;
    }
};

__global__ void __launch_bounds__(NT) state_fwd_tc_kernel(geo z, gdn_ws w) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = ldk(dk);
    const state_fwd_smem m(sm, dk);
    float *Ss = m.Ss, *Ds = m.Ds;
    bf16 *Sh = m.Sh, *Us = m.Us;
    const int64_t n = blockIdx.x, h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * BVT;
    const int nb = dv - b0 < BVT ? (int)(dv - b0) : BVT;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int64_t wrs = z.Hv * dk, krs = z.Hk * dk, ors = z.Hv * dv;
    const bool wv = vec_ok(w.Wh, dk, wrs), kv = vec_ok(w.kb, dk, krs);
    const bool ov = vec_ok(w.U0, dv, ors);
    zero_state(Ss, Sh, d16);
    const int c1 = w.cfirst[n], c2 = w.cfirst[n + 1];
    const auto prefetch = [&](int c, int buf) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        stage_async(m.Wb + buf * CH * ldq, (int)ldq, w.Wh + (t0 * z.Hv + h) * dk, wrs, L, dk,
                    (int)d16, wv);
        stage_async(m.Kb + buf * CH * ldq, (int)ldq, w.kb + (t0 * z.Hk + hk) * dk, krs, L, dk,
                    (int)d16, kv);
        stage_async(m.Ob + buf * CH * LDS, LDS, w.U0 + (t0 * z.Hv + h) * dv + b0, ors, L, nb,
                    BVT, ov);
        cp_commit();
    };
    chunk_decay cd, next;
    if (c1 < c2)
        prefetch(c1, 0), cd.load(z, w, c1, h);
    for (int c = c1; c < c2; c++) {
        const int buf = (c - c1) & 1;
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        if (c + 1 < c2) // into the buffers chunk c - 1 used (the last barrier freed them)
            prefetch(c + 1, buf ^ 1), next.load(z, w, c + 1, h);
        const float GL = cd.GL;
        if (tid < CH)
            Ds[tid] = tid < L ? expf(GL - cd.gj) : 0.0f;
        store_state(w.S + ((int64_t)c * z.Hv + h) * dk * dv + b0, Ss, dk, dv, nb);
        if (c + 1 < c2)
            cp_wait<1>();
        else
            cp_wait<0>();
        __syncthreads(); // chunk c's W, K, U0; Ds
        const bf16 *Ws = m.Wb + buf * CH * ldq, *Ks = m.Kb + buf * CH * ldq;
        const float *Os = m.Ob + buf * CH * LDS;
        { // U = U0 - W S: a 16 x 8 tile a warp
            const int r0 = 16 * (warp >> 1), q0 = (BVT / 2) * (warp & 1);
            float acc[1][NNU][4] = {};
            warp_mma<1, NNU>(acc, Ws + r0 * ldq, (int)ldq, 1, Sh + q0, LDSH, 1, (int)d16);
            for (int mm = 0; mm < NNU; mm++)
                for (int e = 0; e < 4; e++) {
                    const int i = r0 + g + 8 * (e >> 1), b = q0 + 8 * mm + 2 * t + (e & 1);
                    float u = 0.0f;
                    if (i < L && b < nb) {
                        u = Os[i * LDS + b] - acc[0][mm][e];
                        w.Uh[((t0 + i) * z.Hv + h) * dv + b0 + b] = __float2bfloat16_rn(u);
                    }
                    Us[i * LDSH + b] = __float2bfloat16_rn(Ds[i] * u);
                }
        }
        __syncthreads();
        const float eL = expf(GL);
        for (int r0 = 16 * warp; r0 < d16; r0 += 16 * TCW) { // S <- e^G_L S + K^T (Ds U)
            float acc[1][NNS][4] = {};
            warp_mma<1, NNS>(acc, Ks + r0, 1, (int)ldq, Us, LDSH, 1, CH);
            update_state(Ss, Sh, r0,
                         [&](float v, int mm, int e) { return eL * v + acc[0][mm][e]; });
        }
        __syncthreads(); // Ss complete; chunk c's buffers free
        cd = next;
    }
}

// state_bwd_kernel on tensor cores (bf16, dk <= 128): dU += Ds (K dS) and
// dS <- e^G_L dS + Q^T (Es dO) - W^T dU (Es_i = e^G_i) by mma.sync; dS fp32
// in shared memory (dk16 rows); K, Q, W, dO (bf16) and dU's block copied
// at once by cp.async at each chunk's start (one round trip), the decays a
// chunk ahead.
struct state_bwd_smem {
    float *Ss, *Vs, *Ds, *Es;
    bf16 *Sh, *Us, *Ob, *Oh, *Ks, *Qs, *Ws;
    size_t bytes;
    __host__ __device__ state_bwd_smem(void *base, int64_t dk) {
        carve c(base);
        Ss = c.take<float>(pad16(dk) * LDS), Sh = c.take<bf16>(pad16(dk) * LDSH);
        Us = c.take<bf16>(CH * LDSH), Ob = c.take<bf16>(CH * LDSH), Oh = c.take<bf16>(CH * LDSH);
        Vs = c.take<float>(CH * LDS);
        Ds = c.take<float>(CH), Es = c.take<float>(CH);
        Ks = c.take<bf16>(CH * ldk(dk)), Qs = c.take<bf16>(CH * ldk(dk));
        Ws = c.take<bf16>(CH * ldk(dk));
        bytes = c.off;
    }
};

__global__ void __launch_bounds__(NT)
    state_bwd_tc_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ __align__(16) float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = ldk(dk);
    const state_bwd_smem m(sm, dk);
    float *Ss = m.Ss, *Vs = m.Vs, *Ds = m.Ds, *Es = m.Es;
    bf16 *Sh = m.Sh, *Us = m.Us, *Oh = m.Oh;
    const int64_t n = blockIdx.x, h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * BVT;
    const int nb = dv - b0 < BVT ? (int)(dv - b0) : BVT;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int64_t wrs = z.Hv * dk, ors = z.Hv * dv;
    const bf16 *dO = (const bf16 *)dout; // bf16, as use_tc asks
    const bool wv = vec_ok(w.Wh, dk, wrs), uv = vec_ok(w.dU, dv, ors), ov = vec_ok(dO, dv, ors);
    zero_state(Ss, Sh, d16);
    const int c1 = w.cfirst[n], c2 = w.cfirst[n + 1];
    chunk_decay cd, next;
    if (c1 < c2)
        cd.load(z, w, c2 - 1, h);
    for (int c = c2 - 1; c >= c1; c--) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        stage_async(m.Ws, (int)ldq, w.Wh + (t0 * z.Hv + h) * dk, wrs, L, dk, (int)d16, wv);
        stage_async(Vs, LDS, w.dU + (t0 * z.Hv + h) * dv + b0, ors, L, nb, BVT, uv);
        stage_async(m.Ob, LDSH, dO + (t0 * z.Hv + h) * dv + b0, ors, L, nb, BVT, ov);
        stage_qk(z, w, t0, L, hk, m.Qs, m.Ks); // commits the group
        if (c > c1) // the next chunk's decays, a chunk ahead
            next.load(z, w, c - 1, h);
        const float GL = cd.GL;
        if (tid < CH) {
            Ds[tid] = tid < L ? expf(GL - cd.gj) : 0.0f;
            Es[tid] = tid < L ? expf(cd.gj) : 0.0f;
        }
        store_state(w.dS + ((int64_t)c * z.Hv + h) * dk * dv + b0, Ss, dk, dv, nb);
        cp_wait<0>();
        __syncthreads(); // the chunk's K, Q, W, dU, dO; Ds, Es
        { // dU += Ds (K dS) into Us; Es dO into Oh
            const int r0 = 16 * (warp >> 1), q0 = (BVT / 2) * (warp & 1);
            float acc[1][NNU][4] = {};
            warp_mma<1, NNU>(acc, m.Ks + r0 * ldq, (int)ldq, 1, Sh + q0, LDSH, 1, (int)d16);
            for (int mm = 0; mm < NNU; mm++)
                for (int e = 0; e < 4; e++) {
                    const int j = r0 + g + 8 * (e >> 1), b = q0 + 8 * mm + 2 * t + (e & 1);
                    float du = 0.0f;
                    if (j < L && b < nb) {
                        du = Ds[j] * acc[0][mm][e] + Vs[j * LDS + b];
                        w.dU[((t0 + j) * z.Hv + h) * dv + b0 + b] = du;
                    }
                    Us[j * LDSH + b] = __float2bfloat16_rn(du);
                    Oh[j * LDSH + b] = __float2bfloat16_rn(to_f(m.Ob[j * LDSH + b]) * Es[j]);
                }
        }
        __syncthreads();
        const float eL = expf(GL);
        // dS <- e^G_L dS + Q^T (Es dO) - W^T dU
        for (int r0 = 16 * warp; r0 < d16; r0 += 16 * TCW) {
            float aq[1][NNS][4] = {}, aw[1][NNS][4] = {};
            warp_mma<1, NNS>(aq, m.Qs + r0, 1, (int)ldq, Oh, LDSH, 1, CH);
            warp_mma<1, NNS>(aw, m.Ws + r0, 1, (int)ldq, Us, LDSH, 1, CH);
            update_state(Ss, Sh, r0, [&](float v, int mm, int e) {
                return eL * v + aq[0][mm][e] - aw[0][mm][e];
            });
        }
        __syncthreads(); // dS complete; the staging free
        cd = next;
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

// per (chunk, head, BO columns) and per (document, head, BVT columns)
dim3 chunk_grid(const geo &z) {
    return dim3((unsigned)z.NC, (unsigned)z.Hv, (unsigned)((z.dv + BO - 1) / BO));
}
dim3 doc_grid(const geo &z) {
    return dim3((unsigned)z.ndocs, (unsigned)z.Hv, (unsigned)((z.dv + BVT - 1) / BVT));
}
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

loom_status tc_state_fwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         cudaStream_t s) {
    const size_t b = state_fwd_smem(nullptr, z.dk).bytes;
    return launch(ctx, op, state_fwd_tc_kernel, doc_grid(z), b, s, z, w);
}

loom_status tc_state_bwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         const void *dout, loom_dtype dt, cudaStream_t s) {
    const size_t b = state_bwd_smem(nullptr, z.dk).bytes;
    return launch(ctx, op, state_bwd_tc_kernel, doc_grid(z), b, s, z, w, dout, dt);
}

loom_status tc_prep(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt,
                    const float *g, const float *beta, const geo &z, const gdn_ws &w,
                    cudaStream_t s) {
    return launch(ctx, op, prep_tc_kernel, dim3((unsigned)z.NC, (unsigned)z.Hv),
                  prep_smem(nullptr, z.dk).bytes, s, qkv, dt, g, beta, z, w);
}

} // namespace loom_gdn
