// chunk_bwd_kernel's tensor-core twin for bf16 (dk <= 128): the gated delta
// rule's chunk-local backward, launched by ops_gdn_rule.cu's driver
// (tc_chunk_bwd); its building blocks and conventions are ops_gdn_tc.cu's
// (ops_gdn_tc.cuh).
//
// Checked against the CPU reference on the CPU emulator (make test-emu) and,
// on an H200, by tests/test_backend_gdn.c and the Qwen3.5 model tests
// (tests/gpu/qwen35.sh).
#include "mma.cuh"
#include "ops_gdn_tc.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {

// chunk_bwd_kernel on tensor cores (bf16, dk <= 128), per (chunk, value
// head), the same sums (ops_gdn_rule.cu's comment) with every product of
// chunk by chunk or chunk by head size on mma.sync:
//   QK = Q K^T, KK = K K^T, dp = dO U^T        (DQ = dp M, lower)
//   dX = [dU | -dU S0^T], dB = T^T dX            (T = (I + A)^-1: prep's, w.Tb)
//   DA = -dB X^T (X = [U0 | W]), then C = DA beta M  (A = beta KK M, prep's bits)
//   SD = e^G dO S0^T, TM = e^(G_L - G) U dS^T
//   dq = SD + DQ K, dk = beta e^G dBk + TM + DQ^T Q + (C + C^T) K
// a column block of 64 at a time. QK, KK, DQ, DA and dB stay in the warps'
// accumulators, where their row and column sums (dbeta's, dG's parts) are
// taken (row_sums, col_sums); shared memory holds C and the products' bf16
// operands: 94 KB at dk 128, two blocks an SM (one block of 192 KB had been
// latency-bound at 12% occupancy on an H200). The forward's bf16 arrays (T,
// U0, W, S0, U: from a keep buffer, in DRAM) and state_bwd's bf16 dS and dU
// come by cp.async (an H200, 4B shapes: 1017 us a layer where the forward's
// came by synchronous loads took 1180); v, k, q and dkh by column pairs at
// the accumulators' places, issued before the products that hide them; and
// FULL (dk and dv multiples of BO, pairs aligned) drops the column tests
// (dU and dS had come as fp32 by float4 into fixed places of a thread and
// element-wise fills before that, whose index arithmetic had been two
// thirds of the instructions (ncu): 1019 -> 526 us).
// (Ending the block with the q/k normalisation's backward of its rows, dq
// and dk read back from L2 instead of by l2_bwd_kernel from DRAM, made the
// kernel slower than the two kernels apart at Qwen3.5-0.8B's shapes on an
// H200: 1234 and 1293 us a layer for a warp a row and for half-warps, where
// chunk_bwd took 1056 and l2_bwd_h 125; its code grew from 7,472 SASS
// instructions to 8,040 and 8,824, an inlined epilogue the compiler copied
// three times, and a non-inlined one spilled the caller's registers.)
constexpr int BWD_VECS = 18; // Gs Es Dj Bs SV SK RS CS DBE DGs, PG and PD (4 each)
struct bwd_smem {
    float *Cm, *V, *RP, *CP; // C (CH, LDA); the vectors; row partials (2, CH), columns' (4, CH)
    bf16 *Tb, *DQb, *S1, *S2, *S3, *S5, *Qs, *Ks;
    size_t bytes;
    __host__ __device__ bwd_smem(void *base, int64_t dk) {
        carve c(base);
        Cm = c.take<float>(CH * LDA), V = c.take<float>(BWD_VECS * CH);
        RP = c.take<float>(2 * CH), CP = c.take<float>(4 * CH);
        Tb = c.take<bf16>(CH * LDH), DQb = c.take<bf16>(CH * LDH);
        S1 = c.take<bf16>(4 * CH * LDH), S2 = S1 + CH * LDH, S3 = S2 + CH * LDH;
        S5 = S3 + CH * LDH;
        Qs = c.take<bf16>(CH * LDH), Ks = c.take<bf16>(CH * LDH);
        bytes = c.off;
    }
};

// Row sums over a (CH, CH) product held as the warps' tiles (tile f): v(n,
// e) the value at accumulator (n, e) (zero where not summed); the lanes of
// a row by shuffles, then a row block's two warps in order through RP;
// out(i, sum) by thread i < CH. All threads; barriers before and after out.
template <typename F, typename O>
__device__ __forceinline__ void row_sums(const tile &f, float *RP, F v, O out) {
    float p[2] = {0.0f, 0.0f};
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) p[e >> 1] += v(n, e);
    for (int k = 0; k < 2; k++)
        for (int o = 1; o < 4; o <<= 1) p[k] += __shfl_xor_sync(0xffffffffu, p[k], o);
    const int half = (threadIdx.x >> 5) & 1;
    if (f.t == 0)
        RP[half * CH + f.r0 + f.g] = p[0], RP[half * CH + f.r0 + f.g + 8] = p[1];
    __syncthreads();
    if (threadIdx.x < CH)
        out((int)threadIdx.x, RP[threadIdx.x] + RP[CH + threadIdx.x]);
    __syncthreads();
}
// Column sums likewise: a lane's two rows, the lanes of a column by
// shuffles, then the four row blocks' warps in order through CP.
template <typename F, typename O>
__device__ __forceinline__ void col_sums(const tile &f, float *CP, F v, O out) {
    float q[4][2];
    for (int n = 0; n < 4; n++)
        for (int b = 0; b < 2; b++) {
            q[n][b] = v(n, b) + v(n, b + 2);
            for (int o = 4; o < 32; o <<= 1) q[n][b] += __shfl_xor_sync(0xffffffffu, q[n][b], o);
        }
    const int blk = (threadIdx.x >> 5) >> 1;
    if (f.g == 0)
        for (int n = 0; n < 4; n++)
            for (int b = 0; b < 2; b++) CP[blk * CH + f.c0 + 8 * n + 2 * f.t + b] = q[n][b];
    __syncthreads();
    if (threadIdx.x < CH) {
        const int j = threadIdx.x;
        out(j, ((CP[j] + CP[CH + j]) + CP[2 * CH + j]) + CP[3 * CH + j]);
    }
    __syncthreads();
}

template <bool FULL>
__global__ void __launch_bounds__(NT, 2)
    chunk_bwd_tc_kernel(const void *qkv, const void *dout, const float *beta, geo z, gdn_ws w,
                        void *dqkv, float *dg, float *dbeta) {
    extern __shared__ __align__(16) float sm[];
    __shared__ double red[WARPS];
    const int64_t dk = z.dk, dv = z.dv, Hv = z.Hv;
    const bwd_smem m(sm, dk);
    float *Gs = m.V, *Es = Gs + CH, *Dj = Es + CH, *Bs = Dj + CH;
    float *SV = Bs + CH, *SK = SV + CH, *RS = SK + CH, *CS = RS + CH, *DBE = CS + CH;
    float *DGs = DBE + CH, *PG = DGs + CH, *PD = PG + 4 * CH;
    bf16 *Tb = m.Tb, *DQb = m.DQb, *S1 = m.S1, *S2 = m.S2, *S3 = m.S3, *S5 = m.S5;
    const int64_t c = blockIdx.x, h = blockIdx.y, hk = h / z.grp;
    int64_t t0;
    int L;
    if (!chunk_of(z, w, c, &t0, &L))
        return;
    const int tid = threadIdx.x, warp = tid >> 5;
    const tile f;
    const bf16 *S0 = w.Sb + (c * Hv + h) * dk * dv; // the forward's state, rounded
    const bf16 *dS = w.dSb + (c * Hv + h) * dk * dv; // state_bwd's, rounded
    // q and k normalised as l2_fwd made them: the raw bf16 row i of qkv (at qr,
    // kr + i C) by its factor (rq, rk[i Hk]), the same product, the same bits
    const bf16 *qr = (const bf16 *)qkv + t0 * z.C + hk * dk, *kr = qr + z.Hk * dk;
    const float *rq = w.rq + t0 * z.Hk + hk, *rk = w.rk + t0 * z.Hk + hk;
    auto row = [&](int i) { return (t0 + i) * Hv + h; }; // the row of (T, Hv, .) tensors
    auto vcol = [&](int i) { return (t0 + i) * z.C + 2 * z.Hk * dk + h * dv; }; // v_i in qkv
    // the keys [a0, a0 + BO) of q and k into Qs, Ks by cp.async (committed)
    auto stage_qk64 = [&](int64_t a0) { stage_qk(z, w, t0, L, hk, m.Qs, m.Ks, LDH, a0, BO); };
    // dO's and U's rows of columns [b0, b0 + BO) into S1, S2 by cp.async (committed)
    const int64_t vrs = Hv * dv;
    // put2's pairs aligned: dk even (dqh, dkh); dv, C and the base even (dqkv's v)
    // FULL (the launcher's full_tiles): dk and dv multiples of BO, every pair aligned
    const bool keven = FULL || dk % 2 == 0;
    const bool veven = FULL || (dv % 2 == 0 && z.C % 2 == 0 && ((uintptr_t)dqkv & 3) == 0);
    const bool qeven = FULL || (dv % 2 == 0 && z.C % 2 == 0 && ((uintptr_t)qkv & 3) == 0);
    const bool qkeven = FULL || (dk % 2 == 0 && z.C % 2 == 0 && ((uintptr_t)qkv & 3) == 0);
    const auto qk2 = [&](const bf16 *raw, const float *r, int i, int64_t a, bool two) {
        const float2 x = ld2(raw + i * z.C + a, qkeven, two);
        const float f = r[i * z.Hk];
        return make_float2(x.x * f, x.y * f);
    };
    // whether column col of a row of n is in range (FULL: every column is)
    const auto cin = [&](int64_t col, int64_t n) { return FULL || col < n; };
    // dU's (complete, state_bwd's, rounded) and dS's blocks by cp.async
    const bf16 *dUc = w.dUb + row(0) * dv;
    const bool duv = vec_ok(dUc, dv, vrs), dsv = vec_ok(dS, dv, dv);
    const bf16 *Oc = (const bf16 *)dout + row(0) * dv, *Uc = w.Uh + row(0) * dv;
    const bool ouv = vec_ok(Oc, dv, vrs) && vec_ok(Uc, dv, vrs);
    auto stage_ou = [&](int64_t b0) {
        stage_async(S1, LDH, Oc + b0, vrs, L, dv - b0, BO, ouv);
        stage_async(S2, LDH, Uc + b0, vrs, L, dv - b0, BO, ouv);
        cp_commit();
    };
    // whether accumulator (n, e) is strictly lower within the chunk
    auto lower = [&](int n, int e) { return f.i(e) < L && f.j(n, e) < f.i(e); };

    chunk_vectors(w.G, beta, t0, L, Hv, h, Gs, Es, Dj, Bs, SV, SK);
    stage_async(Tb, LDH, w.Tb + (c * Hv + h) * CH * CH, CH, CH, CH, CH, true); // prep's T
    stage_qk64(0); // commits T's copy with its group
    float qk[1][4][4] = {}, kk[1][4][4] = {}; // QK, KK over the keys, 64 at a time
    for (int64_t a0 = 0; a0 < dk; a0 += BO) {
        cp_wait<0>();
        __syncthreads();
        warp_mma<1, 4>(qk, m.Qs + f.r0 * LDH, LDH, 1, m.Ks + f.c0 * LDH, 1, LDH, BO);
        warp_mma<1, 4>(kk, m.Ks + f.r0 * LDH, LDH, 1, m.Ks + f.c0 * LDH, 1, LDH, BO);
        __syncthreads();
        if (a0 + BO < dk)
            stage_qk64(a0 + BO);
    }
    float dq[1][4][4] = {}; // DQ = (dO U^T) M, lower
    for (int64_t b0 = 0; b0 < dv; b0 += BO) {
        __syncthreads(); // S1, S2 free
        stage_ou(b0);
        cp_wait<0>();
        __syncthreads();
        warp_mma<1, 4>(dq, S1 + f.r0 * LDH, LDH, 1, S2 + f.c0 * LDH, 1, LDH, BO);
    }
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int i = f.i(e), j = f.j(n, e);
            dq[0][n][e] = i < L && j <= i ? dq[0][n][e] * expf(Gs[i] - Gs[j]) : 0.0f;
        }
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e += 2)
            sts2(DQb + f.i(e) * LDH + f.j(n, e), dq[0][n][e], dq[0][n][e + 1]);
    // R's first part (DQ QK, strictly lower): its row sums and column sums
    const auto r1 = [&](int n, int e) { return lower(n, e) ? dq[0][n][e] * qk[0][n][e] : 0.0f; };
    row_sums(f, m.RP, r1, [&](int i, float v) { RS[i] = v; });
    col_sums(f, m.CP, r1, [&](int j, float v) { CS[j] = v; });

    // dB a column block of [dv | dk] at a time (dX, then dB's rounding, in
    // S5), with dv, dk's B part, SV, SK; DA accumulates -dB X^T
    float da[1][4][4] = {};
    const int64_t nbv = (dv + BO - 1) / BO, nbk = (dk + BO - 1) / BO;
    for (int64_t cb = 0; cb < nbv + nbk; cb++) {
        const bool isv = cb < nbv;
        const int64_t b0 = (isv ? cb : cb - nbv) * BO, ncol = isv ? dv : dk;
        __syncthreads(); // S2, S5 free
        if (isv) { // dX = dU's block (S5), then X = U0's (S2), by cp.async
            stage_async(S5, LDH, dUc + b0, vrs, L, dv - b0, BO, duv);
            cp_commit();
            const bf16 *Xc = w.U0b + row(0) * dv + b0;
            stage_async(S2, LDH, Xc, vrs, L, dv - b0, BO, vec_ok(Xc, dv, vrs));
            cp_commit();
        } else { // X = W's block by cp.async, under dX = -dU S0^T over this block's keys
            const bf16 *Wc = w.Wh + row(0) * dk + b0;
            stage_async(S2, LDH, Wc, Hv * dk, L, dk - b0, BO, vec_ok(Wc, dk, Hv * dk));
            cp_commit();
            float x[1][4][4] = {};
            for (int64_t e0 = 0; e0 < dv; e0 += BO) {
                __syncthreads(); // S1, S3 free
                const bf16 *Sc = S0 + b0 * dv + e0; // S0's keys b0.., and dU's block, by cp.async
                stage_async(S3, LDH, Sc, dv, (int)(dk - b0), dv - e0, BO, vec_ok(Sc, dv, dv));
                stage_async(S1, LDH, dUc + e0, vrs, L, dv - e0, BO, duv);
                cp_commit();
                cp_wait<0>();
                __syncthreads();
                warp_mma<1, 4>(x, S1 + f.r0 * LDH, LDH, 1, S3 + f.c0 * LDH, 1, LDH, BO);
            }
            for (int n = 0; n < 4; n++)
                for (int e = 0; e < 4; e += 2)
                    sts2(S5 + f.i(e) * LDH + f.j(n, e), -x[0][n][e], -x[0][n][e + 1]);
        }
        // v's or k's elements at the accumulators' places (bf16 v: use_tc), in
        // flight during the product
        float2 y[4][2];
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2) {
                const int i = f.i(e);
                const int64_t col = b0 + f.j(n, e);
                const bool in = i < L && cin(col, ncol), two = cin(col + 1, ncol);
                y[n][e >> 1] = !in ? make_float2(0.0f, 0.0f)
                               : isv ? ld2((const bf16 *)qkv + vcol(i) + col, qeven, two)
                                     : qk2(kr, rk, i, col, two);
            }
        if (isv)
            cp_wait<1>(); // dX's group (X's may be in flight)
        __syncthreads(); // dX complete
        float db[1][4][4] = {};
        warp_mma<1, 4>(db, Tb + f.r0, 1, LDH, S5 + f.c0, LDH, 1, CH); // T^T dX
        __syncthreads(); // dX read
        // dB's rounding; dv or dk's B part and the rows' dots with v or k, from the accumulators
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2)
                sts2(S5 + f.i(e) * LDH + f.j(n, e), db[0][n][e], db[0][n][e + 1]);
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2) { // pairs of columns (put2)
                const int i = f.i(e);
                const int64_t col = b0 + f.j(n, e);
                if (i >= L || !cin(col, ncol))
                    continue;
                const bool two = cin(col + 1, ncol);
                if (isv)
                    put2((bf16 *)dqkv + vcol(i) + col, veven, two, Bs[i] * db[0][n][e],
                         Bs[i] * db[0][n][e + 1]);
                else
                    put2(w.dkh + row(i) * dk + col, keven, two, Bs[i] * Es[i] * db[0][n][e],
                         Bs[i] * Es[i] * db[0][n][e + 1]);
            }
        row_sums(f, m.RP,
                 [&](int n, int e) {
                     const float2 v = y[n][e >> 1];
                     return (e & 1 ? v.y : v.x) * db[0][n][e];
                 },
                 [&](int i, float v) { (isv ? SV : SK)[i] += v; });
        cp_wait<0>();
        __syncthreads(); // X complete
        warp_mma<1, 4>(da, S5 + f.r0 * LDH, LDH, 1, S2 + f.c0 * LDH, 1, LDH, BO);
    }
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) da[0][n][e] = lower(n, e) ? -da[0][n][e] : 0.0f; // DA
    // dbeta (DA KK M's row sums); R's second part (DA A, A = beta KK M as
    // prep makes it): its row and column sums
    float dec[4][4]; // M's decays, zero where not strictly lower
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++)
            dec[n][e] = lower(n, e) ? expf(Gs[f.i(e)] - Gs[f.j(n, e)]) : 0.0f;
    row_sums(f, m.RP,
             [&](int n, int e) {
                 return lower(n, e) ? da[0][n][e] * kk[0][n][e] * dec[n][e] : 0.0f;
             },
             [&](int i, float v) { DBE[i] = SV[i] + Es[i] * SK[i] + v; });
    float av[4][4]; // A, as the forward's prep made it (the same product, the same bits)
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++)
            av[n][e] = lower(n, e) ? Bs[f.i(e)] * kk[0][n][e] * dec[n][e] : 0.0f;
    const auto r2 = [&](int n, int e) { return da[0][n][e] * av[n][e]; };
    row_sums(f, m.RP, r2, [&](int i, float v) { RS[i] += v; });
    col_sums(f, m.CP, r2, [&](int j, float v) { CS[j] += v; });
    for (int n = 0; n < 4; n++) // C = DA beta_i M
        for (int e = 0; e < 4; e++)
            m.Cm[f.i(e) * LDA + f.j(n, e)] =
                lower(n, e) ? da[0][n][e] * Bs[f.i(e)] * dec[n][e] : 0.0f;
    __syncthreads();
    for (int p = 2 * tid; p < CH * CH; p += 2 * NT) { // Tb <- C + C^T, a pair at a time
        const int i = p / CH, j = p % CH;
        sts2(Tb + i * LDH + j, m.Cm[i * LDA + j] + m.Cm[j * LDA + i],
             m.Cm[i * LDA + j + 1] + m.Cm[(j + 1) * LDA + i]);
    }

    // dq and dk, 64 keys at a time; SD's and TM's row dots with q and k as
    // partial sums (PG, PD: a slot per warp column and key block)
    double ss = 0.0;
    for (int64_t a0 = 0; a0 < dk; a0 += BO) {
        // q's and k's elements at the accumulators' places, in flight during the products
        float2 qv[4][2], kv[4][2];
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2) {
                const int i = f.i(e);
                const int64_t a = a0 + f.j(n, e);
                const bool in = i < L && cin(a, dk), two = cin(a + 1, dk);
                qv[n][e >> 1] = in ? qk2(qr, rq, i, a, two) : make_float2(0.0f, 0.0f);
                kv[n][e >> 1] = in ? qk2(kr, rk, i, a, two) : make_float2(0.0f, 0.0f);
            }
        float sd[1][4][4] = {}, tm[1][4][4] = {};
        for (int64_t e0 = 0; e0 < dv; e0 += BO) {
            __syncthreads(); // the blocks free (and Tb complete)
            if (e0 == 0)
                stage_qk64(a0);
            const bf16 *Sc = S0 + a0 * dv + e0; // S0's block (S3) and dS's (S5) by cp.async
            stage_async(S3, LDH, Sc, dv, (int)(dk - a0), dv - e0, BO, vec_ok(Sc, dv, dv));
            stage_async(S5, LDH, dS + a0 * dv + e0, dv, (int)(dk - a0), dv - e0, BO, dsv);
            stage_ou(e0); // commits S3's and S5's copies with its group
            cp_wait<0>();
            __syncthreads();
            // sum(S0 dS): the rounded state's elements (the forward's) by dS's,
            // both zero outside the state; four at a time, a thread's own
            for (int u = 0; u < CH * BO / (4 * NT); u++) {
                const int o = ((int)threadIdx.x / (BO / 4) + u * (4 * NT / BO)) * LDH +
                              4 * ((int)threadIdx.x % (BO / 4));
                const uint2 p = *reinterpret_cast<const uint2 *>(S3 + o);
                const uint2 d = *reinterpret_cast<const uint2 *>(S5 + o);
                ss += (double)lo_of(p.x) * (double)lo_of(d.x);
                ss += (double)hi_of(p.x) * (double)hi_of(d.x);
                ss += (double)lo_of(p.y) * (double)lo_of(d.y);
                ss += (double)hi_of(p.y) * (double)hi_of(d.y);
            }
            warp_mma<1, 4>(sd, S1 + f.r0 * LDH, LDH, 1, S3 + f.c0 * LDH, 1, LDH, BO);
            warp_mma<1, 4>(tm, S2 + f.r0 * LDH, LDH, 1, S5 + f.c0 * LDH, 1, LDH, BO);
        }
        float pg[2] = {0.0f, 0.0f}, pd[2] = {0.0f, 0.0f};
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2) {
                const int i = f.i(e);
                const int64_t a = a0 + f.j(n, e);
                for (int b = 0; b < 2; b++)
                    sd[0][n][e + b] *= Es[i], tm[0][n][e + b] *= Dj[i];
                if (i < L && cin(a, dk)) {
                    const float2 q = qv[n][e >> 1], k = kv[n][e >> 1];
                    pg[e >> 1] += q.x * sd[0][n][e];
                    pd[e >> 1] += k.x * tm[0][n][e];
                    if (cin(a + 1, dk)) {
                        pg[e >> 1] += q.y * sd[0][n][e + 1];
                        pd[e >> 1] += k.y * tm[0][n][e + 1];
                    }
                }
            }
        for (int k = 0; k < 2; k++)
            for (int o = 1; o < 4; o <<= 1) {
                pg[k] += __shfl_xor_sync(0xffffffffu, pg[k], o);
                pd[k] += __shfl_xor_sync(0xffffffffu, pd[k], o);
            }
        if (f.t == 0) {
            const int slot = (warp & 1) + 2 * (int)(a0 / BO);
            PG[(f.r0 + f.g) * 4 + slot] = pg[0], PG[(f.r0 + f.g + 8) * 4 + slot] = pg[1];
            PD[(f.r0 + f.g) * 4 + slot] = pd[0], PD[(f.r0 + f.g + 8) * 4 + slot] = pd[1];
        }
        // dk's B part (the dB loop's, this thread's places), in flight during the products
        float2 kb[4][2];
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2) {
                const int i = f.i(e);
                const int64_t a = a0 + f.j(n, e);
                kb[n][e >> 1] = i < L && cin(a, dk)
                                    ? ld2(w.dkh + row(i) * dk + a, keven, cin(a + 1, dk))
                                    : make_float2(0.0f, 0.0f);
            }
        const bf16 *Qb = m.Qs + f.c0, *Kb = m.Ks + f.c0;
        warp_mma<1, 4>(sd, DQb + f.r0 * LDH, LDH, 1, Kb, LDH, 1, CH); // + DQ K
        warp_mma<1, 4>(tm, DQb + f.r0, 1, LDH, Qb, LDH, 1, CH);       // + DQ^T Q
        warp_mma<1, 4>(tm, Tb + f.r0 * LDH, LDH, 1, Kb, LDH, 1, CH);  // + (C + C^T) K
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e += 2) {
                const int i = f.i(e);
                const int64_t a = a0 + f.j(n, e);
                if (i < L && cin(a, dk)) {
                    const bool two = cin(a + 1, dk);
                    put2(w.dqh + row(i) * dk + a, keven, two, sd[0][n][e], sd[0][n][e + 1]);
                    const float2 b = kb[n][e >> 1];
                    put2(w.dkh + row(i) * dk + a, keven, two, b.x + tm[0][n][e],
                         b.y + tm[0][n][e + 1]);
                }
            }
    }
    const double sds = block_sum<NT>(ss, red); // its barriers end the phase
    const int nslot = 2 * (int)((dk + BO - 1) / BO);
    for (int i = tid; i < CH; i += NT) {
        float a = 0.0f, b = 0.0f;
        for (int k = 0; k < nslot; k++)
            a += PG[i * 4 + k], b += PD[i * 4 + k];
        PG[i * 4] = a, PD[i * 4] = b;
    }
    __syncthreads();
    for (int i = tid; i < L; i += NT) {
        float dG = PG[i * 4] - PD[i * 4] + Bs[i] * Es[i] * SK[i] + RS[i] - CS[i];
        if (i == L - 1) {
            float sdd = 0.0f;
            for (int j = 0; j < L; j++)
                sdd += PD[j * 4];
            dG += Es[L - 1] * (float)sds + sdd;
        }
        DGs[i] = dG;
    }
    __syncthreads();
    put_dg_dbeta(DGs, DBE, L, t0, Hv, h, dg, dbeta);
}

} // namespace

namespace loom_gdn {

loom_status tc_chunk_bwd(loom_ctx *ctx, const char *op, const void *qkv, const void *dout,
                         loom_dtype dt, const float *beta, const geo &z, const gdn_ws &w,
                         void *dqkv, float *dg, float *dbeta, cudaStream_t s) {
    (void)dt; // bf16: use_tc's
    const size_t b = bwd_smem(nullptr, z.dk).bytes;
    // full tiles: no column of a block past dk or dv, every pair aligned (put2, ld2)
    const bool full = z.dk % BO == 0 && z.dv % BO == 0 && z.C % 2 == 0 &&
                      ((uintptr_t)qkv & 3) == 0 && ((uintptr_t)dqkv & 3) == 0;
    const auto kern = full ? chunk_bwd_tc_kernel<true> : chunk_bwd_tc_kernel<false>;
    const loom_status st = smem_for(ctx, op, kern, b);
    if (st)
        return st;
    kern<<<dim3((unsigned)z.NC, (unsigned)z.Hv), NT, b, s>>>(qkv, dout, beta, z, w, dqkv, dg,
                                                             dbeta);
    return check_launch(ctx, op);
}

} // namespace loom_gdn
