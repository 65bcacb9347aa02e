// The gated delta rule's tensor-core kernels for bf16 (dk <= 128): twins of
// ops_gdn_rule.cu's prep_kernel, out_kernel, dul_kernel, state_fwd_kernel
// and state_bwd_kernel with their products on mma.sync, launched by its driver
// (ops_gdn_rule.cuh's tc_*). Operands are staged in fp32 shared memory as
// the fp32 kernels stage them, zero past the chunk's rows and past dk up to
// a multiple of 16; each element is rounded to bf16 as its fragment is
// built, with fp32 accumulators. S0 and U are rounded to bf16 for the
// products, as flash-linear-attention rounds them; the states themselves
// stay fp32. prep_kernel's twin inverts I + A by forward substitution (a
// column a thread) and takes X as a product with it. chunk_bwd_kernel's
// products are still the fp32 SIMT loops, the next to move.
//
// NOTE: compiled here and checked on the CPU emulator (make test-emu) against
// the CPU reference; not yet run on a GPU (tests/test_backend_gdn.c there).
#include "mma.cuh"
#include "ops_gdn_rule.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {

constexpr int TCW = WARPS; // warps of the tensor-core kernels: a 64 x 64 tile, 16 x 32 each
static_assert(TCW == 8, "the tensor-core kernels split 64 x 64 among 8 warps");

// A warp's (16 MT) x (8 NN) tile of C += A B, K a multiple of 16: element
// (i, k) of A at A[i ars + k acs], (k, n) of B at B[k brs + n bcs].
// Accumulator (m, n, e) is C's row 16 m + g + 8 (e >> 1), column 8 n + 2 t +
// (e & 1), g = lane / 4, t = lane % 4 (mma.cuh's table).
template <int MT, int NN>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NN][4], const float *A, int ars,
                                         int acs, const float *B, int brs, int bcs, int K) {
    using M = mma_type<__nv_bfloat16>;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k0 = 0; k0 < K; k0 += 16) {
        uint32_t a[MT][4];
        for (int m = 0; m < MT; m++) {
            const float *r0 = A + (16 * m + g) * ars + (k0 + 2 * t) * acs, *r1 = r0 + 8 * ars;
            a[m][0] = M::pack(r0[0], r0[acs]);
            a[m][1] = M::pack(r1[0], r1[acs]);
            a[m][2] = M::pack(r0[8 * acs], r0[9 * acs]);
            a[m][3] = M::pack(r1[8 * acs], r1[9 * acs]);
        }
        for (int n = 0; n < NN; n++) {
            const float *c = B + (k0 + 2 * t) * brs + (8 * n + g) * bcs;
            const uint32_t b0 = M::pack(c[0], c[brs]), b1 = M::pack(c[8 * brs], c[9 * brs]);
            for (int m = 0; m < MT; m++) M::mma(acc[m][n], a[m], b0, b1);
        }
    }
}


// The tensor-core kernels' shared floats: Ps (CH, LDA); Qs, Ks (CH, dk16 +
// 4); Gs, Es (CH); Bs (max(dk16, CH), BO + 4): S0's block, then dO's; Us
// (CH, BO + 4).
constexpr int LDB = BO + 4;
size_t p_tc_smem(int64_t dk) {
    const int64_t d16 = pad16(dk), ldq = d16 + 4, rb = d16 > CH ? d16 : CH;
    return (size_t)(CH * LDA + 2 * CH * ldq + 2 * CH + rb * LDB + CH * LDB) * sizeof(float);
}

// The chunk's q, k (zero-padded), G, e^G and P (as chunk_p) with Q K^T on
// tensor cores. Ends with a barrier.
__device__ void chunk_p_tc(const geo &z, const gdn_ws &w, int64_t t0, int L, int64_t h,
                           float *Ps, float *Qs, float *Ks, float *Gs, float *Es) {
    const int64_t dk = z.dk, d16 = pad16(dk), ldq = d16 + 4, hk = h / z.grp;
    for (int64_t p = threadIdx.x; p < CH * d16; p += NT) {
        const int64_t i = p / d16, a = p % d16, src = ((t0 + i) * z.Hk + hk) * dk + a;
        const bool in = i < L && a < dk;
        Qs[i * ldq + a] = in ? w.qn[src] : 0.0f;
        Ks[i * ldq + a] = in ? w.kn[src] : 0.0f;
    }
    for (int i = threadIdx.x; i < CH; i += NT) {
        Gs[i] = i < L ? w.G[(t0 + i) * z.Hv + h] : 0.0f;
        Es[i] = expf(Gs[i]);
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1);
    float acc[1][4][4] = {};
    warp_mma<1, 4>(acc, Qs + r0 * ldq, (int)ldq, 1, Ks + c0 * ldq, 1, (int)ldq, (int)d16);
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int i = r0 + g + 8 * (e >> 1), j = c0 + 8 * n + 2 * t + (e & 1);
            Ps[i * LDA + j] = i < L && j <= i ? acc[0][n][e] * expf(Gs[i] - Gs[j]) : 0.0f;
        }
    __syncthreads();
}

// out_kernel on tensor cores (bf16, dk <= 128): O = diag(e^G) Q S0 + P U
// over BO columns of dv.
__global__ void __launch_bounds__(NT) out_tc_kernel(geo z, gdn_ws w, loom_dtype dt, void *o) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = d16 + 4;
    const int64_t rb = d16 > CH ? d16 : CH;
    float *Ps = sm, *Qs = Ps + CH * LDA, *Ks = Qs + CH * ldq, *Gs = Ks + CH * ldq, *Es = Gs + CH;
    float *Bs = Es + CH, *Us = Bs + rb * LDB;
    const int64_t c = blockIdx.x, h = blockIdx.y, b0 = (int64_t)blockIdx.z * BO;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    chunk_p_tc(z, w, t0, L, h, Ps, Qs, Ks, Gs, Es);
    const float *S0 = w.S + (c * z.Hv + h) * dk * dv;
    for (int64_t p = threadIdx.x; p < d16 * BO; p += NT) {
        const int64_t a = p / BO, b = p % BO;
        Bs[a * LDB + b] = a < dk && b0 + b < dv ? S0[a * dv + b0 + b] : 0.0f;
    }
    for (int64_t p = threadIdx.x; p < CH * BO; p += NT) {
        const int64_t i = p / BO, b = p % BO;
        Us[i * LDB + b] = i < L && b0 + b < dv ? w.U[((t0 + i) * z.Hv + h) * dv + b0 + b] : 0.0f;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1);
    float acc[1][4][4] = {};
    warp_mma<1, 4>(acc, Qs + r0 * ldq, (int)ldq, 1, Bs + c0, LDB, 1, (int)d16);
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) acc[0][n][e] *= Es[r0 + g + 8 * (e >> 1)];
    warp_mma<1, 4>(acc, Ps + r0 * LDA, LDA, 1, Us + c0, LDB, 1, CH);
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int i = r0 + g + 8 * (e >> 1);
            const int64_t b = b0 + c0 + 8 * n + 2 * t + (e & 1);
            if (i < L && b < dv) st(o, dt, ((t0 + i) * z.Hv + h) * dv + b, acc[0][n][e]);
        }
}

// dul_kernel on tensor cores: dU's local part P^T dO over BO columns.
__global__ void __launch_bounds__(NT)
    dul_tc_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = d16 + 4;
    float *Ps = sm, *Qs = Ps + CH * LDA, *Ks = Qs + CH * ldq, *Gs = Ks + CH * ldq, *Es = Gs + CH;
    float *Bs = Es + CH;
    const int64_t c = blockIdx.x, h = blockIdx.y, b0 = (int64_t)blockIdx.z * BO;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    chunk_p_tc(z, w, t0, L, h, Ps, Qs, Ks, Gs, Es);
    for (int64_t p = threadIdx.x; p < CH * BO; p += NT) {
        const int64_t i = p / BO, b = p % BO;
        Bs[i * LDB + b] =
            i < L && b0 + b < dv ? ld(dout, dt, ((t0 + i) * z.Hv + h) * dv + b0 + b) : 0.0f;
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1);
    float acc[1][4][4] = {};
    warp_mma<1, 4>(acc, Ps + r0, 1, LDA, Bs + c0, LDB, 1, CH); // A = P^T
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int j = r0 + g + 8 * (e >> 1);
            const int64_t b = b0 + c0 + 8 * n + 2 * t + (e & 1);
            if (j < L && b < dv) w.dU[((t0 + j) * z.Hv + h) * dv + b] = acc[0][n][e];
        }
}

// prep_kernel on tensor cores: G, A = strictly lower (beta_i k_i.k_j M_ij)
// with K K^T by mma.sync, T = (I + A)^-1 by forward substitution (a column a
// thread), then X = [U0 | W] = T [diag(beta) V | diag(beta e^G) K] by
// mma.sync, BO columns at a time. Shared: As, Ts (CH, LDA); Ks (CH, dk16 +
// 4); Xs (CH, LDB); Gs, Bs (CH).
size_t prep_tc_smem(int64_t dk) {
    return (size_t)(2 * CH * LDA + CH * (pad16(dk) + 4) + CH * LDB + 2 * CH) * sizeof(float);
}

__global__ void __launch_bounds__(NT) prep_tc_kernel(const void *qkv, loom_dtype dt,
                                                     const float *g, const float *beta, geo z,
                                                     gdn_ws w) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = d16 + 4;
    float *As = sm, *Ts = As + CH * LDA, *Ks = Ts + CH * LDA, *Xs = Ks + CH * ldq;
    float *Gs = Xs + CH * LDB, *Bs = Gs + CH;
    const int64_t c = blockIdx.x, h = blockIdx.y, hk = h / z.grp;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, t = lane & 3;
    if (tid == 0) {
        float acc = 0.0f;
        for (int i = 0; i < CH; i++) {
            if (i < L) {
                acc += g[(t0 + i) * z.Hv + h];
                w.G[(t0 + i) * z.Hv + h] = acc;
            }
            Gs[i] = i < L ? acc : 0.0f;
        }
    }
    for (int i = tid; i < CH; i += NT)
        Bs[i] = i < L ? beta[(t0 + i) * z.Hv + h] : 0.0f;
    const float *kc = w.kn + (t0 * z.Hk + hk) * dk; // row i at kc + i Hk dk
    for (int64_t p = tid; p < CH * d16; p += NT) {
        const int64_t i = p / d16, a = p % d16;
        Ks[i * ldq + a] = i < L && a < dk ? kc[i * z.Hk * dk + a] : 0.0f;
    }
    __syncthreads();
    const int r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1);
    { // A by tensor cores
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, Ks + r0 * ldq, (int)ldq, 1, Ks + c0 * ldq, 1, (int)ldq, (int)d16);
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
    if (tid < CH) { // T's column j: T_ij = [i == j] - sum_j<=k<i A_ik T_kj
        const int j = tid;
        for (int i = 0; i < CH; i++) {
            float x = i == j ? 1.0f : 0.0f;
            for (int k = j; k < i; k++)
                x -= As[i * LDA + k] * Ts[k * LDA + j];
            Ts[i * LDA + j] = i < j ? 0.0f : x;
        }
    }
    for (int64_t b0 = 0; b0 < dv + dk; b0 += BO) { // X's columns, BO at a time
        __syncthreads(); // Ts complete; Xs free
        for (int64_t p = tid; p < CH * BO; p += NT) {
            const int i = (int)(p / BO);
            const int64_t col = b0 + p % BO;
            float x = 0.0f;
            if (i < L && col < dv)
                x = Bs[i] * ld(qkv, dt, (t0 + i) * z.C + 2 * z.Hk * dk + h * dv + col);
            else if (i < L && col < dv + dk)
                x = Bs[i] * expf(Gs[i]) * kc[i * z.Hk * dk + (col - dv)];
            Xs[i * LDB + p % BO] = x;
        }
        __syncthreads();
        float acc[1][4][4] = {};
        warp_mma<1, 4>(acc, Ts + r0 * LDA, LDA, 1, Xs + c0, LDB, 1, CH);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = r0 + gq + 8 * (e >> 1);
                const int64_t col = b0 + c0 + 8 * n + 2 * t + (e & 1), row = (t0 + i) * z.Hv + h;
                if (i >= L || col >= dv + dk)
                    continue;
                if (col < dv)
                    w.U0[row * dv + col] = acc[0][n][e];
                else
                    w.W[row * dk + (col - dv)] = acc[0][n][e];
            }
    }
}

// state_fwd_kernel on tensor cores (bf16, dk <= 128), per (document, head,
// BV columns): U = U0 - W S0 and S <- e^G_L S + Kd^T U (Kd_j = e^(G_L - G_j)
// k_j) by mma.sync, the state in fp32 shared memory (Ss: dk16 rows, zero
// past dk), W and Kd staged (CH, dk16 + 4), U (CH, BV + 4).
constexpr int LDS = BV + 4;
size_t state_tc_smem(int64_t dk) {
    const int64_t d16 = pad16(dk), ldq = d16 + 4;
    return (size_t)(d16 * LDS + 2 * CH * ldq + CH * LDS + CH) * sizeof(float);
}

__global__ void __launch_bounds__(NT) state_fwd_tc_kernel(geo z, gdn_ws w) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = d16 + 4;
    float *Ss = sm, *Ws = Ss + d16 * LDS, *Ks = Ws + CH * ldq, *Us = Ks + CH * ldq;
    float *Ds = Us + CH * LDS;
    const int64_t n = blockIdx.x, h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * BV;
    const int nb = dv - b0 < BV ? (int)(dv - b0) : BV;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    for (int64_t p = tid; p < d16 * LDS; p += NT)
        Ss[p] = 0.0f;
    const int c1 = w.cfirst[n], c2 = w.cfirst[n + 1];
    for (int c = c1; c < c2; c++) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        __syncthreads(); // Ss complete; Ws, Ks, Us, Ds free
        const float GL = w.G[(t0 + L - 1) * z.Hv + h];
        for (int j = tid; j < CH; j += NT)
            Ds[j] = j < L ? expf(GL - w.G[(t0 + j) * z.Hv + h]) : 0.0f;
        float *Sg = w.S + ((int64_t)c * z.Hv + h) * dk * dv + b0;
        for (int64_t p = tid; p < dk * BV; p += NT)
            if (p % BV < nb)
                Sg[(p / BV) * dv + p % BV] = Ss[(p / BV) * LDS + p % BV];
        __syncthreads(); // Ds
        for (int64_t p = tid; p < CH * d16; p += NT) {
            const int64_t j = p / d16, a = p % d16;
            const bool in = j < L && a < dk;
            Ws[j * ldq + a] = in ? w.W[((t0 + j) * z.Hv + h) * dk + a] : 0.0f;
            Ks[j * ldq + a] = in ? Ds[j] * w.kn[((t0 + j) * z.Hk + hk) * dk + a] : 0.0f;
        }
        __syncthreads();
        { // U = U0 - W S: a 16 x 16 tile a warp
            const int r0 = 16 * (warp >> 1), q0 = 16 * (warp & 1);
            float acc[1][2][4] = {};
            warp_mma<1, 2>(acc, Ws + r0 * ldq, (int)ldq, 1, Ss + q0, LDS, 1, (int)d16);
            for (int m = 0; m < 2; m++)
                for (int e = 0; e < 4; e++) {
                    const int i = r0 + g + 8 * (e >> 1), b = q0 + 8 * m + 2 * t + (e & 1);
                    float u = 0.0f;
                    if (i < L && b < nb) {
                        const int64_t at = ((t0 + i) * z.Hv + h) * dv + b0 + b;
                        u = w.U0[at] - acc[0][m][e];
                        w.U[at] = u;
                    }
                    Us[i * LDS + b] = u;
                }
        }
        __syncthreads();
        const float eL = expf(GL);
        for (int r0 = 16 * warp; r0 < d16; r0 += 16 * TCW) { // S <- e^G_L S + Kd^T U
            float acc[1][4][4] = {};
            warp_mma<1, 4>(acc, Ks + r0, 1, (int)ldq, Us, LDS, 1, CH);
            for (int m = 0; m < 4; m++)
                for (int e = 0; e < 4; e++) {
                    float *sp = Ss + (r0 + g + 8 * (e >> 1)) * LDS + 8 * m + 2 * t + (e & 1);
                    *sp = eL * *sp + acc[0][m][e];
                }
        }
    }
}

// state_bwd_kernel on tensor cores (bf16, dk <= 128): dU += Kd dS and dS <-
// e^G_L dS + Qe^T dO - W^T dU (Kd_j = e^(G_L - G_j) k_j, Qe_i = e^G_i q_i)
// by mma.sync; dS fp32 in shared memory (dk16 rows), Kd, Qe, W staged (CH,
// dk16 + 4), dU and dO (CH, BV + 4).
size_t state_bwd_tc_smem(int64_t dk) {
    const int64_t d16 = pad16(dk), ldq = d16 + 4;
    return (size_t)(d16 * LDS + 3 * CH * ldq + 2 * CH * LDS + 2 * CH) * sizeof(float);
}

__global__ void __launch_bounds__(NT)
    state_bwd_tc_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, d16 = pad16(dk), ldq = d16 + 4;
    float *Ss = sm, *Kd = Ss + d16 * LDS, *Qe = Kd + CH * ldq, *Ws = Qe + CH * ldq;
    float *Us = Ws + CH * ldq, *Os = Us + CH * LDS, *Ds = Os + CH * LDS, *Es = Ds + CH;
    const int64_t n = blockIdx.x, h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * BV;
    const int nb = dv - b0 < BV ? (int)(dv - b0) : BV;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    for (int64_t p = tid; p < d16 * LDS; p += NT)
        Ss[p] = 0.0f;
    const int c1 = w.cfirst[n], c2 = w.cfirst[n + 1];
    for (int c = c2 - 1; c >= c1; c--) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        __syncthreads(); // Ss complete; the staging free
        const float GL = w.G[(t0 + L - 1) * z.Hv + h];
        for (int j = tid; j < CH; j += NT) {
            const float Gj = j < L ? w.G[(t0 + j) * z.Hv + h] : 0.0f;
            Ds[j] = j < L ? expf(GL - Gj) : 0.0f;
            Es[j] = j < L ? expf(Gj) : 0.0f;
        }
        float *Sg = w.dS + ((int64_t)c * z.Hv + h) * dk * dv + b0;
        for (int64_t p = tid; p < dk * BV; p += NT)
            if (p % BV < nb)
                Sg[(p / BV) * dv + p % BV] = Ss[(p / BV) * LDS + p % BV];
        __syncthreads(); // Ds, Es
        for (int64_t p = tid; p < CH * d16; p += NT) {
            const int64_t j = p / d16, a = p % d16, src = ((t0 + j) * z.Hk + hk) * dk + a;
            const bool in = j < L && a < dk;
            Kd[j * ldq + a] = in ? Ds[j] * w.kn[src] : 0.0f;
            Qe[j * ldq + a] = in ? Es[j] * w.qn[src] : 0.0f;
            Ws[j * ldq + a] = in ? w.W[((t0 + j) * z.Hv + h) * dk + a] : 0.0f;
        }
        __syncthreads();
        { // dU += Kd dS; dO's block
            const int r0 = 16 * (warp >> 1), q0 = 16 * (warp & 1);
            float acc[1][2][4] = {};
            warp_mma<1, 2>(acc, Kd + r0 * ldq, (int)ldq, 1, Ss + q0, LDS, 1, (int)d16);
            for (int m = 0; m < 2; m++)
                for (int e = 0; e < 4; e++) {
                    const int j = r0 + g + 8 * (e >> 1), b = q0 + 8 * m + 2 * t + (e & 1);
                    float du = 0.0f, od = 0.0f;
                    if (j < L && b < nb) {
                        const int64_t at = ((t0 + j) * z.Hv + h) * dv + b0 + b;
                        du = acc[0][m][e] + w.dU[at];
                        w.dU[at] = du;
                        od = ld(dout, dt, at);
                    }
                    Us[j * LDS + b] = du;
                    Os[j * LDS + b] = od;
                }
        }
        __syncthreads();
        const float eL = expf(GL);
        for (int r0 = 16 * warp; r0 < d16; r0 += 16 * TCW) { // dS <- e^G_L dS + Qe^T dO - W^T dU
            float aq[1][4][4] = {}, aw[1][4][4] = {};
            warp_mma<1, 4>(aq, Qe + r0, 1, (int)ldq, Os, LDS, 1, CH);
            warp_mma<1, 4>(aw, Ws + r0, 1, (int)ldq, Us, LDS, 1, CH);
            for (int m = 0; m < 4; m++)
                for (int e = 0; e < 4; e++) {
                    float *sp = Ss + (r0 + g + 8 * (e >> 1)) * LDS + 8 * m + 2 * t + (e & 1);
                    *sp = eL * *sp + aq[0][m][e] - aw[0][m][e];
                }
        }
    }
}

} // namespace

namespace {
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

// per (chunk, head, BO columns) and per (document, head, BV columns)
dim3 chunk_grid(const geo &z) {
    return dim3((unsigned)z.NC, (unsigned)z.Hv, (unsigned)((z.dv + BO - 1) / BO));
}
dim3 doc_grid(const geo &z) {
    return dim3((unsigned)z.ndocs, (unsigned)z.Hv, (unsigned)((z.dv + BV - 1) / BV));
}
} // namespace

namespace loom_gdn {

loom_status tc_out(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w, loom_dtype dt,
                   void *o, cudaStream_t s) {
    return launch(ctx, op, out_tc_kernel, chunk_grid(z), p_tc_smem(z.dk), s, z, w, dt, o);
}

loom_status tc_dul(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                   const void *dout, loom_dtype dt, cudaStream_t s) {
    return launch(ctx, op, dul_tc_kernel, chunk_grid(z), p_tc_smem(z.dk), s, z, w, dout, dt);
}

loom_status tc_state_fwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         cudaStream_t s) {
    return launch(ctx, op, state_fwd_tc_kernel, doc_grid(z), state_tc_smem(z.dk), s, z, w);
}

loom_status tc_state_bwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         const void *dout, loom_dtype dt, cudaStream_t s) {
    return launch(ctx, op, state_bwd_tc_kernel, doc_grid(z), state_bwd_tc_smem(z.dk), s, z, w,
                  dout, dt);
}

loom_status tc_prep(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt,
                    const float *g, const float *beta, const geo &z, const gdn_ws &w,
                    cudaStream_t s) {
    return launch(ctx, op, prep_tc_kernel, dim3((unsigned)z.NC, (unsigned)z.Hv),
                  prep_tc_smem(z.dk), s, qkv, dt, g, beta, z, w);
}

} // namespace loom_gdn
