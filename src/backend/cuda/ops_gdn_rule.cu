// Gated DeltaNet's chunked gated delta rule (cuda_ops.h's loom_cuda_gdn_fwd
// and _bwd). The CPU reference, src/backend/cpu/gdn.c, holds the chunk's
// algebra in its header comment; per chunk of L <= 64 tokens from a
// document's start, value head h, q and k L2-normalised (q also scaled by
// dk^-1/2), G_i the log decay since the chunk's start, M_ij = e^(G_i - G_j):
//   A = strictly lower (beta_i k_i.k_j M_ij),  X = [U0 | W] = (I + A)^-1
//   [diag(beta) V | diag(beta e^G) K],  U = U0 - W S0,
//   O = diag(e^G) Q S0 + P U  (P = lower (q_i.k_j M_ij)),
//   S_L = e^G_L S0 + sum_j e^(G_L - G_j) k_j U_j^T.
// The work is split as flash-linear-attention's chunked kernels (written
// anew here):
//   chunks_kernel     the chunk table from cu (each document's chunks)
//   l2_fwd_kernel     the normalised q and k, a warp per (token, key head)
//                     (ops_gdn_l2.cu, as the backward's)
//   prep_kernel       per (chunk, head): G, A, and X by forward substitution
//   state_fwd_kernel  per (document, head, 32 columns of dv): the chunks in
//                     order, storing each chunk's starting state and its U
//   out_kernel        per (chunk, head, 64 columns of dv): O
// and for the backward, after the forward's first two (and prep and the
// state pass again, unless the forward left their arrays in a keep buffer):
//   dul_kernel        per (chunk, head, 64 columns): P^T dO, dU's local part
//   state_bwd_kernel  per (document, head, 32 columns): the chunks in reverse,
//                     storing the gradient of each chunk's end state and dU
//   chunk_bwd_kernel  per (chunk, head): the gradients of q, k (per value
//                     head), v, g and beta (the triangular solve's by back
//                     substitution with A^T)
//   l2_bwd_kernel     the key heads' groups summed, the normalisation's backward
//                     (l2_bwd_h_kernel by half-warps for bf16 rows).
// Everything in fp32 (the CPU's in double); the states fp32. Each output
// element has one writer: no atomics, the same bits run to run. In bf16
// (dk <= 128) prep_kernel, out_kernel, dul_kernel, the two state passes and
// chunk_bwd_kernel run as their tensor-core twins (ops_gdn_tc.cu), which
// keep the operands of their products in bf16: W, U, the states (also in
// dG's sum(S0 dS)), T = (I + A)^-1 and U0's copy; those arrays and G can
// stay from the forward to the backward in the caller's keep buffer
// (gdn_ws.h), the same bits as recomputing them.
//
// tests/test_backend_gdn.c holds these kernels to the CPU's on a GPU (run on
// an H200, tests/gpu/qwen35.sh); `make test-emu` (tools/cuda_emu) runs them
// on the CPU in CI.
#include "ops_gdn_rule.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {
int64_t max_chunks(int64_t T, int64_t ndocs) { return loom_gdn_ws_chunks(T, ndocs); }

size_t al(size_t b) { return loom_gdn_ws_align(b); }

// The workspace's arrays in base and the kept ones in keep (keep_chunks > 0
// under tc: gdn_ws.h's kept arrays, laid out alike in the forward and the
// backward). The sizes are gdn_ws.h's, which loom_cuda_gdn_scratch_bytes and
// the memory predictor read too.
void ws_layout(const geo &z, bool bwd, bool tc, int64_t keep_chunks, char *base, char *keep,
               gdn_ws *w) {
    size_t sizes[LOOM_GDN_WS_ARRAYS], kept[LOOM_GDN_WS_ARRAYS];
    loom_gdn_ws_sizes(z.T, z.Hk, z.Hv, z.dk, z.dv, z.ndocs, bwd, tc, keep_chunks, sizes, kept);
    void *p[LOOM_GDN_WS_ARRAYS];
    size_t off = 0, koff = 0;
    for (int i = 0; i < LOOM_GDN_WS_ARRAYS; i++) {
        if (kept[i]) {
            p[i] = keep + koff;
            koff += al(kept[i]);
        } else {
            p[i] = sizes[i] ? base + off : nullptr;
            off += al(sizes[i]);
        }
    }
    typedef __nv_bfloat16 bf;
    *w = gdn_ws{};
    w->cfirst = (int32_t *)p[LOOM_GW_CFIRST], w->ct0 = (int32_t *)p[LOOM_GW_CT0];
    w->clen = (int32_t *)p[LOOM_GW_CLEN];
    w->G = (float *)p[LOOM_GW_G], w->A = (float *)p[LOOM_GW_A];
    w->U0 = (float *)p[LOOM_GW_U0];
    w->dU = (float *)p[LOOM_GW_DU];
    w->dqh = (float *)p[LOOM_GW_DQH], w->dkh = (float *)p[LOOM_GW_DKH];
    w->qb = (bf *)p[LOOM_GW_QB], w->kb = (bf *)p[LOOM_GW_KB];
    w->Tb = (bf *)p[LOOM_GW_TB], w->U0b = (bf *)p[LOOM_GW_U0B];
    if (tc) { // W, U, S and dS hold bf16; QN and KN the rows' factors
        w->Wh = (bf *)p[LOOM_GW_W], w->Uh = (bf *)p[LOOM_GW_U];
        w->Sb = (bf *)p[LOOM_GW_S], w->dSb = (bf *)p[LOOM_GW_DS];
        w->dUb = (bf *)p[LOOM_GW_DUB];
        w->rq = (float *)p[LOOM_GW_QN], w->rk = (float *)p[LOOM_GW_KN];
    } else {
        w->W = (float *)p[LOOM_GW_W], w->U = (float *)p[LOOM_GW_U];
        w->S = (float *)p[LOOM_GW_S], w->dS = (float *)p[LOOM_GW_DS];
        w->qn = (float *)p[LOOM_GW_QN], w->kn = (float *)p[LOOM_GW_KN];
    }
}

// ---- the chunk table ----

// One block: a document's first chunk (thread 0, in order), then each
// document's chunks (first token, length).
__global__ void chunks_kernel(const int32_t *cu, int64_t ndocs, int32_t *cfirst, int32_t *ct0,
                              int32_t *clen) {
    if (threadIdx.x == 0) {
        int32_t c = 0;
        for (int64_t n = 0; n < ndocs; n++) {
            cfirst[n] = c;
            c += (cu[n + 1] - cu[n] + CH - 1) / CH;
        }
        cfirst[ndocs] = c;
    }
    __syncthreads(); // thread 0's global writes are seen by the block after the barrier
    for (int64_t n = threadIdx.x; n < ndocs; n += blockDim.x) {
        const int32_t e = cu[n + 1];
        int32_t c = cfirst[n];
        for (int32_t t = cu[n]; t < e; t += CH, c++) {
            ct0[c] = t;
            clen[c] = e - t < CH ? e - t : CH;
        }
    }
}

// ---- the chunk-local forward ----


// G (written to w.G too), A (written to w.A) and X = (I + A)^-1 B by forward
// substitution, a column of X per thread (no barrier: a column's rows need
// only that column's earlier rows). Shared: As (CH, LDA), then a region of
// CH max(NT, dk + 1) floats (K staged for A, then X's columns), Gs, Bs (CH).
__global__ void __launch_bounds__(NT) prep_kernel(const void *qkv, loom_dtype dt, const float *g,
                                                  const float *beta, geo z, gdn_ws w) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, ldk = dk + 1;
    float *As = sm, *R = As + CH * LDA;
    float *Gs = R + CH * (NT > ldk ? NT : ldk), *Bs = Gs + CH;
    const int64_t c = blockIdx.x, h = blockIdx.y, hk = h / z.grp;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int tid = threadIdx.x;
    chunk_g(g, t0, L, z.Hv, h, Gs, w.G);
    for (int i = tid; i < L; i += NT)
        Bs[i] = beta[(t0 + i) * z.Hv + h];
    const float *kc = w.kn + (t0 * z.Hk + hk) * dk; // row i at kc + i Hk dk
    for (int64_t p = tid; p < L * dk; p += NT)
        R[(p / dk) * ldk + p % dk] = kc[(p / dk) * z.Hk * dk + p % dk];
    __syncthreads();
    float *Ag = w.A + (c * z.Hv + h) * CH * CH;
    for (int p = tid; p < CH * CH; p += NT) {
        const int i = p / CH, j = p % CH;
        float a = 0.0f;
        if (i < L && j < i) {
            float kk = 0.0f;
            for (int64_t e = 0; e < dk; e++)
                kk += R[i * ldk + e] * R[j * ldk + e];
            a = Bs[i] * kk * expf(Gs[i] - Gs[j]);
        }
        As[i * LDA + j] = a;
        Ag[p] = a;
    }
    __syncthreads(); // K's staging is overwritten below
    const int64_t ncol = dv + dk;
    for (int64_t c0 = 0; c0 < ncol; c0 += NT) {
        const int64_t col = c0 + tid;
        if (col >= ncol)
            continue;
        float *xs = R + tid; // row i at xs[i NT]
        for (int i = 0; i < L; i++) {
            const int64_t t = t0 + i;
            float x = col < dv ? Bs[i] * ld(qkv, dt, t * z.C + 2 * z.Hk * dk + h * dv + col)
                               : Bs[i] * expf(Gs[i]) * kc[i * z.Hk * dk + (col - dv)];
            for (int j = 0; j < i; j++)
                x -= As[i * LDA + j] * xs[j * NT];
            xs[i * NT] = x;
            if (col < dv)
                w.U0[(t * z.Hv + h) * dv + col] = x;
            else
                w.W[(t * z.Hv + h) * dk + (col - dv)] = x;
        }
    }
}

// Ps (CH, LDA) = P (0 outside j <= i < L), Gs and Es = e^G (CH), with q and
// k staged in Qs, Ks (CH, dk + 1). Ends with a barrier.
__device__ void chunk_p(const geo &z, const gdn_ws &w, int64_t t0, int L, int64_t h, float *Ps,
                        float *Qs, float *Ks, float *Gs, float *Es) {
    const int64_t dk = z.dk, ldk = dk + 1, hk = h / z.grp;
    for (int64_t p = threadIdx.x; p < L * dk; p += NT) {
        const int64_t i = p / dk, a = p % dk, src = ((t0 + i) * z.Hk + hk) * dk + a;
        Qs[i * ldk + a] = w.qn[src];
        Ks[i * ldk + a] = w.kn[src];
    }
    for (int i = threadIdx.x; i < L; i += NT) {
        Gs[i] = w.G[(t0 + i) * z.Hv + h];
        Es[i] = expf(Gs[i]);
    }
    __syncthreads();
    for (int p = threadIdx.x; p < CH * CH; p += NT) {
        const int i = p / CH, j = p % CH;
        float v = 0.0f;
        if (i < L && j <= i) {
            for (int64_t a = 0; a < dk; a++)
                v += Qs[i * ldk + a] * Ks[j * ldk + a];
            v *= expf(Gs[i] - Gs[j]);
        }
        Ps[i * LDA + j] = v;
    }
    __syncthreads();
}

// Shared floats of out_kernel and dul_kernel.
size_t p_smem(int64_t dk) {
    return (size_t)(CH * LDA + 2 * CH * (dk + 1) + 2 * CH) * sizeof(float);
}

// O_i = e^G_i S0^T q_i + sum_j<=i P_ij U_j over BO columns of dv (blockIdx.z)
__global__ void __launch_bounds__(NT) out_kernel(geo z, gdn_ws w, loom_dtype dt, void *o) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, ldk = dk + 1;
    float *Ps = sm, *Qs = Ps + CH * LDA, *Ks = Qs + CH * ldk, *Gs = Ks + CH * ldk, *Es = Gs + CH;
    const int64_t c = blockIdx.x, h = blockIdx.y, b0 = (int64_t)blockIdx.z * BO;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    chunk_p(z, w, t0, L, h, Ps, Qs, Ks, Gs, Es);
    const float *S0 = w.S + (c * z.Hv + h) * dk * dv;
    for (int p = threadIdx.x; p < L * BO; p += NT) {
        const int i = p / BO;
        const int64_t b = b0 + p % BO;
        if (b >= dv)
            continue;
        float acc = 0.0f;
        for (int64_t a = 0; a < dk; a++)
            acc += Qs[i * ldk + a] * S0[a * dv + b];
        acc *= Es[i];
        for (int j = 0; j <= i; j++)
            acc += Ps[i * LDA + j] * w.U[((t0 + j) * z.Hv + h) * dv + b];
        st(o, dt, ((t0 + i) * z.Hv + h) * dv + b, acc);
    }
}

// ---- the state passes: a document's chunks in order (reverse for the
// backward), the state's BV columns (blockIdx.z) in shared memory ----

size_t state_smem(int64_t dk) { return (size_t)(dk * BV + 2 * CH * BV + 2 * CH) * sizeof(float); }

// Stores each chunk's starting state, U = U0 - W S0 (w.U), then S <- e^G_L S
// + sum_j e^(G_L - G_j) k_j U_j^T.
__global__ void __launch_bounds__(NT) state_fwd_kernel(geo z, gdn_ws w) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv;
    float *Ss = sm, *Us = Ss + dk * BV, *Ds = Us + CH * BV;
    const int64_t n = blockIdx.x, h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * BV;
    const int nb = dv - b0 < BV ? (int)(dv - b0) : BV;
    const int tid = threadIdx.x;
    for (int64_t p = tid; p < dk * BV; p += NT)
        Ss[p] = 0.0f;
    const int c1 = w.cfirst[n], c2 = w.cfirst[n + 1];
    for (int c = c1; c < c2; c++) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        __syncthreads(); // Ss complete, Us and Ds free
        const float GL = w.G[(t0 + L - 1) * z.Hv + h];
        for (int j = tid; j < L; j += NT)
            Ds[j] = expf(GL - w.G[(t0 + j) * z.Hv + h]);
        float *Sg = w.S + ((int64_t)c * z.Hv + h) * dk * dv + b0;
        for (int64_t p = tid; p < dk * BV; p += NT)
            if (p % BV < nb)
                Sg[(p / BV) * dv + p % BV] = Ss[p];
        for (int p = tid; p < CH * BV; p += NT) {
            const int i = p / BV, b = p % BV;
            float u = 0.0f;
            if (i < L && b < nb) {
                const int64_t row = (t0 + i) * z.Hv + h;
                const float *wr = w.W + row * dk;
                u = w.U0[row * dv + b0 + b];
                for (int64_t a = 0; a < dk; a++)
                    u -= wr[a] * Ss[a * BV + b];
                w.U[row * dv + b0 + b] = u;
            }
            Us[p] = u;
        }
        __syncthreads();
        const float eL = expf(GL);
        for (int64_t p = tid; p < dk * BV; p += NT) {
            const int64_t a = p / BV;
            const int b = (int)(p % BV);
            float s = eL * Ss[p];
            for (int j = 0; j < L; j++)
                s += Ds[j] * w.kn[((t0 + j) * z.Hk + hk) * dk + a] * Us[j * BV + b];
            Ss[p] = s;
        }
    }
}

// dU_j = P^T dO's column j: sum_i>=j P_ij dO_i, over BO columns (the local
// part of dU; state_bwd_kernel adds the state's)
__global__ void __launch_bounds__(NT) dul_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv, ldk = dk + 1;
    float *Ps = sm, *Qs = Ps + CH * LDA, *Ks = Qs + CH * ldk, *Gs = Ks + CH * ldk, *Es = Gs + CH;
    const int64_t c = blockIdx.x, h = blockIdx.y, b0 = (int64_t)blockIdx.z * BO;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    chunk_p(z, w, t0, L, h, Ps, Qs, Ks, Gs, Es);
    for (int p = threadIdx.x; p < L * BO; p += NT) {
        const int j = p / BO;
        const int64_t b = b0 + p % BO;
        if (b >= dv)
            continue;
        float acc = 0.0f;
        for (int i = j; i < L; i++)
            acc += Ps[i * LDA + j] * ld(dout, dt, ((t0 + i) * z.Hv + h) * dv + b);
        w.dU[((t0 + j) * z.Hv + h) * dv + b] = acc;
    }
}

// The chunks in reverse from dS = 0 after the document: stores dS (the
// gradient of the chunk's end state), dU_j += e^(G_L - G_j) dS^T k_j (w.dU),
// then dS <- e^G_L dS + sum_i (e^G_i q_i dO_i^T - W_i dU_i^T), the gradient
// of the chunk's starting state.
__global__ void __launch_bounds__(NT)
    state_bwd_kernel(geo z, gdn_ws w, const void *dout, loom_dtype dt) {
    extern __shared__ float sm[];
    const int64_t dk = z.dk, dv = z.dv;
    float *Ss = sm, *Us = Ss + dk * BV, *Os = Us + CH * BV, *Ds = Os + CH * BV, *Es = Ds + CH;
    const int64_t n = blockIdx.x, h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * BV;
    const int nb = dv - b0 < BV ? (int)(dv - b0) : BV;
    const int tid = threadIdx.x;
    for (int64_t p = tid; p < dk * BV; p += NT)
        Ss[p] = 0.0f;
    const int c1 = w.cfirst[n], c2 = w.cfirst[n + 1];
    for (int c = c2 - 1; c >= c1; c--) {
        const int64_t t0 = w.ct0[c];
        const int L = w.clen[c];
        __syncthreads(); // Ss complete, Us, Os, Ds, Es free
        const float GL = w.G[(t0 + L - 1) * z.Hv + h];
        for (int j = tid; j < L; j += NT) {
            const float Gj = w.G[(t0 + j) * z.Hv + h];
            Ds[j] = expf(GL - Gj);
            Es[j] = expf(Gj);
        }
        float *Sg = w.dS + ((int64_t)c * z.Hv + h) * dk * dv + b0;
        for (int64_t p = tid; p < dk * BV; p += NT)
            if (p % BV < nb)
                Sg[(p / BV) * dv + p % BV] = Ss[p];
        __syncthreads(); // Ds
        for (int p = tid; p < CH * BV; p += NT) {
            const int j = p / BV, b = p % BV;
            float du = 0.0f, od = 0.0f;
            if (j < L && b < nb) {
                const int64_t row = (t0 + j) * z.Hv + h;
                const float *kr = w.kn + ((t0 + j) * z.Hk + hk) * dk;
                float acc = 0.0f;
                for (int64_t a = 0; a < dk; a++)
                    acc += kr[a] * Ss[a * BV + b];
                du = Ds[j] * acc + w.dU[row * dv + b0 + b];
                w.dU[row * dv + b0 + b] = du;
                od = ld(dout, dt, row * dv + b0 + b);
            }
            Us[p] = du;
            Os[p] = od;
        }
        __syncthreads();
        const float eL = expf(GL);
        for (int64_t p = tid; p < dk * BV; p += NT) {
            const int64_t a = p / BV;
            const int b = (int)(p % BV);
            float s = eL * Ss[p];
            for (int i = 0; i < L; i++) {
                const int64_t row = (t0 + i) * z.Hv + h;
                s += Es[i] * w.qn[((t0 + i) * z.Hk + hk) * dk + a] * Os[i * BV + b] -
                     w.W[row * dk + a] * Us[i * BV + b];
            }
            Ss[p] = s;
        }
    }
}

// ---- the chunk-local backward ----

// The region shared by Q and K's staging, X's columns and SD / TM (floats).
__host__ __device__ __forceinline__ int64_t bwd_region(int64_t dk) {
    return CH * NT > 2 * CH * (dk + 1) ? CH * NT : 2 * CH * (dk + 1);
}
size_t bwd_smem(int64_t dk) {
    return (size_t)(5 * CH * LDA + bwd_region(dk) + 10 * CH) * sizeof(float);
}

// One chunk and value head, from its starting state S0 (w.S), the gradient of
// its end state dS (w.dS) and the complete dU (w.dU): the cpu's chunk_bwd
// with its sums over pairs split so that every output has one writer.
//   DQ_ij = dp_ij M_ij, dp_ij = dO_i . U_j (j <= i)
//   R_ij  = dp_ij P_ij + dA_ij A_ij (j < i): dG_i += sum_j<i R_ij - sum_j>i R_ji
//   dX = [dU | -S0 dU], dB = (I + A)^-T dX (back substitution, a column a
//   thread), dA_ij = -dB_i . X_j (j < i), C_ij = dA_ij beta_i M_ij
//   SD_i = e^G_i S0 dO_i, TM_j = e^(G_L - G_j) dS U_j
//   dq_i = SD_i + sum_j<=i DQ_ij k_j
//   dk_j = beta_j e^G_j dBk_j + TM_j + sum_i>=j DQ_ij q_i + sum_i (C_ij + C_ji) k_i
//   dv_i = beta_i dBv_i, dbeta_i = sum_j<i dA_ij k_i.k_j M_ij + v_i.dBv_i + e^G_i k_i.dBk_i
//   dG_i = q_i.SD_i + (R's) - k_i.TM_i + beta_i e^G_i k_i.dBk_i
//          (+ e^G_L sum(S0 dS) + sum_j k_j.TM_j at i = L - 1), dg the
//   reverse cumulative sum of dG.
// dq, dk go per value head to w.dqh, w.dkh (l2_bwd_kernel sums the groups);
// dv to dqkv; dg, dbeta to theirs.
__global__ void __launch_bounds__(NT)
    chunk_bwd_kernel(const void *qkv, const void *dout, loom_dtype dt, const float *beta, geo z,
                     gdn_ws w, void *dqkv, float *dg, float *dbeta) {
    extern __shared__ float sm[];
    __shared__ double red[WARPS];
    const int64_t dk = z.dk, dv = z.dv, ldk = dk + 1, Hv = z.Hv;
    float *As = sm, *DQ = As + CH * LDA, *Rs = DQ + CH * LDA, *DA = Rs + CH * LDA;
    float *KK = DA + CH * LDA, *X = KK + CH * LDA, *Gs = X + bwd_region(dk);
    float *Es = Gs + CH, *Bs = Es + CH, *Dj = Bs + CH, *SV = Dj + CH, *SK = SV + CH;
    float *DGo = SK + CH, *DD = DGo + CH, *DBE = DD + CH, *DGs = DBE + CH;
    const int64_t c = blockIdx.x, h = blockIdx.y, hk = h / z.grp;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float *S0 = w.S + (c * Hv + h) * dk * dv, *dS = w.dS + (c * Hv + h) * dk * dv;
    const float *Ag = w.A + (c * Hv + h) * CH * CH;
    auto qrow = [&](int i) { return w.qn + ((t0 + i) * z.Hk + hk) * dk; };
    auto krow = [&](int i) { return w.kn + ((t0 + i) * z.Hk + hk) * dk; };
    auto row = [&](int i) { return (t0 + i) * Hv + h; }; // the row of (T, Hv, .) tensors
    auto vcol = [&](int i) { return (t0 + i) * z.C + 2 * z.Hk * dk + h * dv; }; // v_i in qkv

    // the chunk's vectors, A, and q, k staged for the pair products
    chunk_vectors(w.G, beta, t0, L, Hv, h, Gs, Es, Dj, Bs, SV, SK);
    for (int p = tid; p < CH * CH; p += NT) {
        As[(p / CH) * LDA + p % CH] = Ag[p];
        DA[(p / CH) * LDA + p % CH] = 0.0f;
    }
    float *Qs = X, *Ks = X + CH * ldk;
    for (int64_t p = tid; p < L * dk; p += NT) {
        const int i = (int)(p / dk);
        const int64_t a = p % dk;
        Qs[i * ldk + a] = qrow(i)[a];
        Ks[i * ldk + a] = krow(i)[a];
    }
    __syncthreads();

    // DQ, R's first part, KK
    for (int p = tid; p < CH * CH; p += NT) {
        const int i = p / CH, j = p % CH;
        float dq = 0.0f, r = 0.0f, kk = 0.0f;
        if (i < L && j <= i) {
            float dp = 0.0f, qk = 0.0f, kq = 0.0f;
            for (int64_t b = 0; b < dv; b++)
                dp += ld(dout, dt, row(i) * dv + b) * w.U[row(j) * dv + b];
            for (int64_t a = 0; a < dk; a++) {
                qk += Qs[i * ldk + a] * Ks[j * ldk + a];
                kq += Ks[i * ldk + a] * Ks[j * ldk + a];
            }
            dq = dp * expf(Gs[i] - Gs[j]);
            if (j < i)
                r = dq * qk, kk = kq;
        }
        DQ[i * LDA + j] = dq;
        Rs[i * LDA + j] = r;
        KK[i * LDA + j] = kk;
    }
    __syncthreads(); // Qs, Ks no longer needed

    // dB by columns of [dv | dk] (NT a pass), with dv, dk's B part, SV, SK, dA
    const int64_t ncol = dv + dk;
    for (int64_t c0 = 0; c0 < ncol; c0 += NT) {
        const int64_t col = c0 + tid;
        float *xs = X + tid; // row i at xs[i NT]
        if (col < ncol) {
            if (col < dv) {
                for (int i = 0; i < L; i++)
                    xs[i * NT] = w.dU[row(i) * dv + col];
            } else {
                const int64_t a = col - dv;
                for (int i = 0; i < L; i++)
                    xs[i * NT] = 0.0f;
                for (int64_t b = 0; b < dv; b++) {
                    const float s0 = S0[a * dv + b];
                    for (int i = 0; i < L; i++)
                        xs[i * NT] -= s0 * w.dU[row(i) * dv + b];
                }
            }
            for (int i = L - 1; i >= 0; i--) { // dB_i = dX_i - sum_j>i A_ji dB_j
                float x = xs[i * NT];
                for (int j = i + 1; j < L; j++)
                    x -= As[j * LDA + i] * xs[j * NT];
                xs[i * NT] = x;
            }
            for (int i = 0; i < L; i++) {
                if (col < dv)
                    st(dqkv, dt, vcol(i) + col, Bs[i] * xs[i * NT]);
                else
                    w.dkh[row(i) * dk + (col - dv)] = Bs[i] * Es[i] * xs[i * NT];
            }
        }
        __syncthreads();
        const int64_t nc = ncol - c0 < NT ? ncol - c0 : NT; // this pass's columns
        for (int i = warp; i < L; i += WARPS) {
            float sv = 0.0f, sk = 0.0f;
            for (int64_t cc = lane; cc < nc; cc += 32) {
                const int64_t cl = c0 + cc;
                const float x = X[i * NT + cc];
                if (cl < dv)
                    sv += ld(qkv, dt, vcol(i) + cl) * x;
                else
                    sk += krow(i)[cl - dv] * x;
            }
            sv = warp_sum(sv);
            sk = warp_sum(sk);
            if (lane == 0)
                SV[i] += sv, SK[i] += sk;
        }
        for (int p = tid; p < CH * CH; p += NT) {
            const int i = p / CH, j = p % CH;
            if (i >= L || j >= i)
                continue;
            float acc = 0.0f;
            for (int64_t cc = 0; cc < nc; cc++) {
                const int64_t cl = c0 + cc;
                const float xj = cl < dv ? w.U0[row(j) * dv + cl] : w.W[row(j) * dk + (cl - dv)];
                acc += X[i * NT + cc] * xj;
            }
            DA[i * LDA + j] -= acc;
        }
        __syncthreads();
    }

    // SD, TM (X's region, a key column a thread) and sum(S0 dS); dbeta, R's
    // second part and C (a row a thread)
    float *SD = X, *TM = X + CH * dk;
    double ss = 0.0;
    for (int64_t a = tid; a < dk; a += NT) {
        for (int i = 0; i < CH; i++)
            SD[i * dk + a] = TM[i * dk + a] = 0.0f;
        for (int64_t b = 0; b < dv; b++) {
            const float s0 = S0[a * dv + b], ds = dS[a * dv + b];
            ss += (double)s0 * (double)ds;
            for (int i = 0; i < L; i++) {
                SD[i * dk + a] += s0 * ld(dout, dt, row(i) * dv + b);
                TM[i * dk + a] += ds * w.U[row(i) * dv + b];
            }
        }
        for (int i = 0; i < L; i++)
            SD[i * dk + a] *= Es[i], TM[i * dk + a] *= Dj[i];
    }
    for (int i = tid; i < L; i += NT) {
        float dbe = SV[i] + Es[i] * SK[i];
        for (int j = 0; j < i; j++) {
            const float m = expf(Gs[i] - Gs[j]), da = DA[i * LDA + j];
            dbe += da * KK[i * LDA + j] * m;
            Rs[i * LDA + j] += da * As[i * LDA + j];
            DA[i * LDA + j] = da * Bs[i] * m; // C_ij from here
        }
        DBE[i] = dbe;
    }
    const double sds = block_sum<NT>(ss, red); // its barriers end the phase

    // dq (a warp per row i), then dk (a warp per row j)
    for (int i = warp; i < L; i += WARPS) {
        const float *qi = qrow(i);
        float dot = 0.0f;
        for (int64_t a = lane; a < dk; a += 32) {
            float acc = SD[i * dk + a];
            dot += qi[a] * acc;
            for (int j = 0; j <= i; j++)
                acc += DQ[i * LDA + j] * krow(j)[a];
            w.dqh[row(i) * dk + a] = acc;
        }
        dot = warp_sum(dot);
        if (lane == 0)
            DGo[i] = dot;
    }
    for (int j = warp; j < L; j += WARPS) {
        const float *kj = krow(j);
        float dot = 0.0f;
        for (int64_t a = lane; a < dk; a += 32) {
            float acc = TM[j * dk + a];
            dot += kj[a] * acc;
            for (int i = j; i < L; i++)
                acc += DQ[i * LDA + j] * qrow(i)[a];
            for (int i = 0; i < L; i++)
                acc += (DA[i * LDA + j] + DA[j * LDA + i]) * krow(i)[a];
            w.dkh[row(j) * dk + a] += acc;
        }
        dot = warp_sum(dot);
        if (lane == 0)
            DD[j] = dot;
    }
    __syncthreads();

    for (int i = tid; i < L; i += NT) {
        float dG = DGo[i] - DD[i] + Bs[i] * Es[i] * SK[i];
        for (int j = 0; j < i; j++)
            dG += Rs[i * LDA + j];
        for (int j = i + 1; j < L; j++)
            dG -= Rs[j * LDA + i];
        if (i == L - 1) {
            float sdd = 0.0f;
            for (int j = 0; j < L; j++)
                sdd += DD[j];
            dG += Es[L - 1] * (float)sds + sdd;
        }
        DGs[i] = dG;
    }
    __syncthreads();
    put_dg_dbeta(DGs, DBE, L, t0, Hv, h, dg, dbeta);
}

// ---- host side ----

geo make_geo(int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t ndocs) {
    return geo{T,
               Hk,
               Hv,
               dk,
               dv,
               2 * Hk * dk + Hv * dv,
               Hk > 0 ? Hv / Hk : 0,
               ndocs,
               max_chunks(T, ndocs)};
}

loom_status rule_args(loom_ctx *ctx, const char *op, loom_dtype dt, const geo &z,
                      const void *scratch, const void *keep, int64_t keep_chunks) {
    loom_status st = need_float(ctx, dt, op, "qkv");
    if (st)
        return st;
    if (z.Hk < 1 || z.Hv < 1 || z.Hv % z.Hk || z.dk < 1 || z.dk > MAX_DK || z.dv < 1 || z.ndocs < 1)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda %s: %lld value heads over %lld key heads, dk %lld, dv %lld, %lld "
                         "documents (needs Hv a multiple of Hk, dk <= %d)",
                         op, (long long)z.Hv, (long long)z.Hk, (long long)z.dk, (long long)z.dv,
                         (long long)z.ndocs, MAX_DK);
    if (z.T > 0 && !scratch)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda %s: needs loom_cuda_gdn_scratch_bytes of scratch", op);
    if (keep && use_tc(dt, z.dk) && z.NC > keep_chunks)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda %s: %lld documents of %lld tokens can make %lld chunks, the keep "
                         "buffer has room for %lld (pass none: the backward recomputes)",
                         op, (long long)z.ndocs, (long long)z.T, (long long)z.NC,
                         (long long)keep_chunks);
    return LOOM_OK;
}

// The chunks a keep buffer is laid out for: none where the shape does not
// keep (no buffer, or the fp32 kernels).
int64_t kept_chunks(loom_dtype dt, const geo &z, const void *keep, int64_t keep_chunks) {
    return keep && use_tc(dt, z.dk) ? keep_chunks : 0;
}

// The forward's first steps (both directions need them): the chunk table,
// then (passes: unless the backward reads them from a keep buffer) q and k
// normalised, each chunk's G, A or T, W, U0, and the states and U.
loom_status fwd_parts(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt, const float *g,
                      const float *beta, const int32_t *cu, const geo &z, const gdn_ws &w,
                      bool passes, cudaStream_t s) {
    loom_status st;
    chunks_kernel<<<1, NT, 0, s>>>(cu, z.ndocs, w.cfirst, w.ct0, w.clen);
    if ((st = check_launch(ctx, op)) || !passes) // (kept: the normalised q and k too)
        return st;
    if ((st = l2_fwd(ctx, op, qkv, dt, z, w, s)))
        return st;
    if (use_tc(dt, z.dk))
        return (st = tc_prep(ctx, op, qkv, dt, g, beta, z, w, s)) ? st
                                                                  : tc_state_fwd(ctx, op, z, w, s);
    const int64_t ldk = z.dk + 1;
    const size_t prep_b = (size_t)(CH * LDA + CH * (NT > ldk ? NT : ldk) + 2 * CH) * sizeof(float);
    if ((st = smem_for(ctx, op, prep_kernel, prep_b)))
        return st;
    prep_kernel<<<dim3((unsigned)z.NC, (unsigned)z.Hv), NT, prep_b, s>>>(qkv, dt, g, beta, z, w);
    if ((st = check_launch(ctx, op)))
        return st;
    const size_t state_b = state_smem(z.dk);
    if ((st = smem_for(ctx, op, state_fwd_kernel, state_b)))
        return st;
    state_fwd_kernel<<<dim3((unsigned)z.ndocs, (unsigned)z.Hv, (unsigned)((z.dv + BV - 1) / BV)),
                       NT, state_b, s>>>(z, w);
    return check_launch(ctx, op);
}
} // namespace

extern "C" size_t loom_cuda_gdn_scratch_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                                              int64_t dv, int64_t ndocs, bool bwd,
                                              loom_dtype dtype, int64_t keep_chunks) {
    return loom_gdn_ws_bytes(T, Hk, Hv, dk, dv, ndocs, bwd, use_tc(dtype, dk), keep_chunks);
}

extern "C" size_t loom_cuda_gdn_keep_bytes(int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                                           int64_t dv, loom_dtype dtype, int64_t keep_chunks) {
    return loom_gdn_keep_bytes(T, Hk, Hv, dk, dv, use_tc(dtype, dk), keep_chunks);
}

extern "C" loom_status loom_cuda_gdn_fwd(loom_ctx *ctx, const void *qkv, loom_dtype dtype,
                                         const float *g, const float *beta, int64_t T, int64_t Hk,
                                         int64_t Hv, int64_t dk, int64_t dv, const int32_t *cu,
                                         int64_t ndocs, void *o, void *scratch, void *keep,
                                         int64_t keep_chunks, void *stream) {
    const char *op = "gdn_fwd";
    const geo z = make_geo(T, Hk, Hv, dk, dv, ndocs);
    loom_status st = rule_args(ctx, op, dtype, z, scratch, keep, keep_chunks);
    if (st || T <= 0)
        return st;
    gdn_ws w;
    const int64_t kc = kept_chunks(dtype, z, keep, keep_chunks);
    ws_layout(z, false, use_tc(dtype, dk), kc, (char *)scratch, (char *)keep, &w);
    cudaStream_t s = as_stream(stream);
    if ((st = fwd_parts(ctx, op, qkv, dtype, g, beta, cu, z, w, true, s)))
        return st;
    if (use_tc(dtype, dk))
        return tc_out(ctx, op, z, w, dtype, o, s);
    const size_t pb = p_smem(dk);
    if ((st = smem_for(ctx, op, out_kernel, pb)))
        return st;
    out_kernel<<<dim3((unsigned)z.NC, (unsigned)Hv, (unsigned)((dv + BO - 1) / BO)), NT, pb, s>>>(
        z, w, dtype, o);
    return check_launch(ctx, op);
}

extern "C" loom_status loom_cuda_gdn_bwd(loom_ctx *ctx, const void *dout, const void *qkv,
                                         loom_dtype dtype, const float *g, const float *beta,
                                         int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                         const int32_t *cu, int64_t ndocs, void *dqkv, float *dg,
                                         float *dbeta, void *scratch, const void *keep,
                                         int64_t keep_chunks, void *stream) {
    const char *op = "gdn_bwd";
    const geo z = make_geo(T, Hk, Hv, dk, dv, ndocs);
    loom_status st = rule_args(ctx, op, dtype, z, scratch, keep, keep_chunks);
    if (st || T <= 0)
        return st;
    gdn_ws w;
    const int64_t kc = kept_chunks(dtype, z, keep, keep_chunks);
    ws_layout(z, true, use_tc(dtype, dk), kc, (char *)scratch, (char *)keep, &w);
    cudaStream_t s = as_stream(stream);
    if ((st = fwd_parts(ctx, op, qkv, dtype, g, beta, cu, z, w, kc == 0, s)))
        return st;
    const size_t pb = p_smem(dk), sb = state_smem(dk), bb = bwd_smem(dk);
    if (use_tc(dtype, dk)) {
        if ((st = tc_dul(ctx, op, z, w, dout, dtype, s)) ||
            (st = tc_state_bwd(ctx, op, z, w, dout, dtype, s)) ||
            (st = tc_chunk_bwd(ctx, op, qkv, dout, dtype, beta, z, w, dqkv, dg, dbeta, s)))
            return st;
    } else {
        if ((st = smem_for(ctx, op, dul_kernel, pb)) ||
            (st = smem_for(ctx, op, state_bwd_kernel, sb)) ||
            (st = smem_for(ctx, op, chunk_bwd_kernel, bb)))
            return st;
        dul_kernel<<<dim3((unsigned)z.NC, (unsigned)Hv, (unsigned)((dv + BO - 1) / BO)), NT, pb,
                     s>>>(z, w, dout, dtype);
        if ((st = check_launch(ctx, op)))
            return st;
        state_bwd_kernel<<<dim3((unsigned)ndocs, (unsigned)Hv, (unsigned)((dv + BV - 1) / BV)), NT,
                           sb, s>>>(z, w, dout, dtype);
        if ((st = check_launch(ctx, op)))
            return st;
        chunk_bwd_kernel<<<dim3((unsigned)z.NC, (unsigned)Hv), NT, bb, s>>>(
            qkv, dout, dtype, beta, z, w, dqkv, dg, dbeta);
        if ((st = check_launch(ctx, op)))
            return st;
    }
    return l2_bwd(ctx, op, qkv, dtype, z, w, dqkv, s);
}
