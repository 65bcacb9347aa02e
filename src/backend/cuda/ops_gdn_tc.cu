// The gated delta rule's tensor-core kernels for bf16 (dk <= 128): twins of
// ops_gdn_rule.cu's prep_kernel, out_kernel, dul_kernel, state_fwd_kernel,
// state_bwd_kernel and chunk_bwd_kernel with their products on mma.sync,
// launched by its driver (ops_gdn_rule.cuh's tc_*). Every product's operand
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
#include "ops_gdn_rule.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {

constexpr int TCW = WARPS; // warps of the tensor-core kernels: a 64 x 64 tile, 16 x 32 each
static_assert(TCW == 8, "the tensor-core kernels split 64 x 64 among 8 warps");

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

// A product's fragments from shared memory: element (i, k) of A at A[i ars
// + k acs], (k, n) of B at B[k brs + n bcs]. A bf16 operand stored with
// one of its strides 1 (rows 16-byte aligned) comes by ldmatrix, plain or
// .trans; any other (fp32) element by element, rounded to bf16 as it is
// packed. Either way the same bits.
using M16 = mma_type<__nv_bfloat16>;
template <typename T>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const T *A, int ars, int acs, int lane) {
    const int g = lane >> 2, t = lane & 3;
    const T *r0 = A + g * ars + 2 * t * acs, *r1 = r0 + 8 * ars;
    a[0] = M16::pack(to_f(r0[0]), to_f(r0[acs]));
    a[1] = M16::pack(to_f(r1[0]), to_f(r1[acs]));
    a[2] = M16::pack(to_f(r0[8 * acs]), to_f(r0[9 * acs]));
    a[3] = M16::pack(to_f(r1[8 * acs]), to_f(r1[9 * acs]));
}
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const __nv_bfloat16 *A, int ars, int acs,
                                       int lane) {
    if (acs == 1)
        ldsm_x4(a, a_addr(A, ars, 0, 0, lane));
    else
        ldsm_x4_t(a, at_addr(A, acs, 0, 0, lane));
}
template <typename T>
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const T *B, int brs, int bcs, int lane) {
    const T *c = B + 2 * (lane & 3) * brs + (lane >> 2) * bcs;
    b[0] = M16::pack(to_f(c[0]), to_f(c[brs]));
    b[1] = M16::pack(to_f(c[8 * brs]), to_f(c[9 * brs]));
}
__device__ __forceinline__ void frag_b(uint32_t (&b)[2], const __nv_bfloat16 *B, int brs, int bcs,
                                       int lane) {
    if (bcs == 1)
        ldsm_x2_t(b, bt1_addr(B, brs, 0, 0, lane));
    else
        ldsm_x2(b, b1_addr(B, bcs, 0, 0, lane));
}

// A warp's (16 MT) x (8 NN) tile of C += A B, K a multiple of 16 (A, B as
// frag_a's, fp32 or bf16 in shared memory). Accumulator (m, n, e) is C's
// row 16 m + g + 8 (e >> 1), column 8 n + 2 t + (e & 1), g = lane / 4, t =
// lane % 4 (mma.cuh's table).
template <int MT, int NN, typename TA, typename TB>
__device__ __forceinline__ void warp_mma(float (&acc)[MT][NN][4], const TA *A, int ars,
                                         int acs, const TB *B, int brs, int bcs, int K) {
    const int lane = threadIdx.x & 31;
    for (int k0 = 0; k0 < K; k0 += 16) {
        uint32_t a[MT][4];
        for (int m = 0; m < MT; m++)
            frag_a(a[m], A + 16 * m * ars + k0 * acs, ars, acs, lane);
        for (int n = 0; n < NN; n++) {
            uint32_t b[2];
            frag_b(b, B + k0 * brs + 8 * n * bcs, brs, bcs, lane);
            for (int m = 0; m < MT; m++) M16::mma(acc[m][n], a[m], b[0], b[1]);
        }
    }
}

// A warp's 16 x 32 tile of a 64 x 64 product (8 warps): rows r0 = 16 (warp /
// 2) on, columns c0 = 32 (warp % 2) on; fragment (n, e) of it is element
// (tile_i, tile_j).
struct tile {
    int r0, c0, g, t;
    __device__ tile() {
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        r0 = 16 * (warp >> 1), c0 = 32 * (warp & 1), g = lane >> 2, t = lane & 3;
    }
    __device__ int i(int e) const { return r0 + g + 8 * (e >> 1); }
    __device__ int j(int n, int e) const { return c0 + 8 * n + 2 * t + (e & 1); }
};

// A kernel's shared memory cut into arrays, each 16-byte aligned (cp.async's
// unit): the same sequence of take() gives the host the size (base 0) and
// the kernel its pointers.
struct carve {
    uintptr_t base;
    size_t off = 0;
    __host__ __device__ explicit carve(void *b) : base((uintptr_t)b) {}
    template <typename T> __host__ __device__ T *take(int64_t n) {
        T *r = (T *)(base + off);
        off += ((size_t)n * sizeof(T) + 15) / 16 * 16;
        return r;
    }
};

typedef __nv_bfloat16 bf16;
constexpr int LDH = BO + 8; // row stride of bf16 (CH, BO) and (CH, CH) blocks: no bank conflicts
__host__ __device__ inline int64_t ldk(int64_t dk) { return pad16(dk) + 8; } // bf16 (CH, dk16)

__device__ __forceinline__ bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// Rows [0, CH) x columns [0, W) (W a multiple of 16 bytes' elements) of dst
// (row stride ld) from src (row i at src + i rs), zero where i >= L or c >=
// n: by cp.async when vec (n, rs and src 16-byte multiples), else by plain
// loads. Neither committed nor waited for.
template <typename T>
__device__ __forceinline__ void stage_async(T *dst, int ld, const T *src, int64_t rs, int L,
                                            int64_t n, int W, bool vec) {
    constexpr int E = 16 / sizeof(T);
    const int q = W / E;
    for (int p = threadIdx.x; p < CH * q; p += NT) {
        const int i = p / q, c = (p % q) * E;
        T *d = dst + i * ld + c;
        const T *s = src + i * rs + c;
        if (vec)
            cp_async16(d, i < L && c < n ? s : src, i < L && c < n);
        else
            for (int e = 0; e < E; e++)
                put(d + e, i < L && c + e < n ? to_f(s[e]) : 0.0f);
    }
}
// Whether rows of n elements at src with row stride rs can go by cp.async.
template <typename T> __device__ __forceinline__ bool vec_ok(const T *src, int64_t n, int64_t rs) {
    constexpr int E = 16 / sizeof(T);
    return n % E == 0 && rs % E == 0 && al16(src);
}

// A chunk's q and k rows of key head hk (bf16, zero-padded to dk16) into Qs,
// Ks by cp.async (committed, not waited for).
__device__ __forceinline__ void stage_qk(const geo &z, const gdn_ws &w, int64_t t0, int L,
                                         int64_t hk, bf16 *Qs, bf16 *Ks) {
    const int64_t dk = z.dk, rs = z.Hk * dk, o = (t0 * z.Hk + hk) * dk;
    const bool vec = vec_ok(w.qb, dk, rs) && vec_ok(w.kb, dk, rs);
    if (Qs)
        stage_async(Qs, (int)ldk(dk), w.qb + o, rs, L, dk, (int)pad16(dk), vec);
    stage_async(Ks, (int)ldk(dk), w.kb + o, rs, L, dk, (int)pad16(dk), vec);
    cp_commit();
}

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

// T = (I + A)^-1 for the strictly lower A (CH x CH, row stride LDA) by
// blocks of 16: each diagonal block by forward substitution (a column a
// thread), then a block row at a time T_IJ = -T_II sum_J<=K<I A_IK T_KJ (an
// element a thread). Its longest chain is 16 + 3 (48 + 16) steps where a
// column a thread over the whole chunk takes 64 x 32. All threads; ends with
// a barrier.
__device__ void invert_unit_lower(const float *As, float *Ts) {
    static_assert(NT == 256 && CH == 64, "a 16 x 16 block an element a thread");
    const int tid = threadIdx.x;
    if (tid < CH) {
        const int b = 16 * (tid / 16), j = tid % 16;
        for (int i = 0; i < 16; i++) {
            float x = i == j ? 1.0f : 0.0f;
            for (int k = j; k < i; k++)
                x -= As[(b + i) * LDA + b + k] * Ts[(b + k) * LDA + b + j];
            Ts[(b + i) * LDA + b + j] = i < j ? 0.0f : x;
        }
    }
    for (int p = tid; p < CH * CH; p += NT) // zero above the diagonal blocks
        if ((p % CH) / 16 > (p / CH) / 16)
            Ts[(p / CH) * LDA + p % CH] = 0.0f;
    __syncthreads();
    const int r = tid / 16, c = tid % 16;
    for (int I = 1; I < 4; I++) {
        const int ri = 16 * I + r;
        for (int J = 0; J < I; J++) { // sum_K A_IK T_KJ into T_IJ's place
            float x = 0.0f;
            for (int k = 16 * J; k < 16 * I; k++)
                x += As[ri * LDA + k] * Ts[k * LDA + 16 * J + c];
            Ts[ri * LDA + 16 * J + c] = x;
        }
        __syncthreads();
        float y[3] = {0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int J = 0; J < 3; J++)
            if (J < I)
                for (int k = 0; k <= r; k++)
                    y[J] -= Ts[ri * LDA + 16 * I + k] * Ts[(16 * I + k) * LDA + 16 * J + c];
        __syncthreads();
#pragma unroll
        for (int J = 0; J < 3; J++)
            if (J < I)
                Ts[ri * LDA + 16 * J + c] = y[J];
        __syncthreads();
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

// chunk_bwd_kernel on tensor cores (bf16, dk <= 128), per (chunk, value
// head), the same sums (ops_gdn_rule.cu's comment) with every product of
// chunk by chunk or chunk by head size on mma.sync:
//   QK = Q K^T, KK = K K^T, dp = dO U^T        (DQ = dp M, lower)
//   dX = [dU | -dU S0^T], dB = T^T dX            (T = (I + A)^-1, as prep's)
//   DA = -dB X^T (X = [U0 | W]), then C = DA beta M
//   SD = e^G dO S0^T, TM = e^(G_L - G) U dS^T
//   dq = SD + DQ K, dk = beta e^G dBk + TM + DQ^T Q + (C + C^T) K
// a column block of 64 at a time. QK, KK, DQ, DA and dB stay in the warps'
// accumulators, where their row and column sums (dbeta's, dG's parts) are
// taken (row_sums, col_sums); shared memory holds C, the products' bf16
// operands and, before the blocks are used, the inversion's fp32 A and T
// in the blocks' space: 94 KB at dk 128, two blocks an SM (one block of
// 192 KB had been latency-bound at 12% occupancy on an H200).
constexpr int BWD_VECS = 18; // Gs Es Dj Bs SV SK RS CS DBE DGs, PG and PD (4 each)
struct bwd_smem {
    float *Cm, *V, *RP, *CP; // C (CH, LDA); the vectors; row partials (2, CH), columns' (4, CH)
    bf16 *Tb, *DQb, *S1, *S2, *S3, *S5, *Qs, *Ks;
    float *As, *Ts; // the inversion's (CH, LDA) arrays, over S1 .. S5
    size_t bytes;
    __host__ __device__ bwd_smem(void *base, int64_t dk) {
        carve c(base);
        Cm = c.take<float>(CH * LDA), V = c.take<float>(BWD_VECS * CH);
        RP = c.take<float>(2 * CH), CP = c.take<float>(4 * CH);
        Tb = c.take<bf16>(CH * LDH), DQb = c.take<bf16>(CH * LDH);
        S1 = c.take<bf16>(4 * CH * LDH), S2 = S1 + CH * LDH, S3 = S2 + CH * LDH;
        S5 = S3 + CH * LDH;
        As = (float *)S1, Ts = As + CH * LDA;
        Qs = c.take<bf16>(CH * LDH), Ks = c.take<bf16>(CH * LDH);
        bytes = c.off;
    }
};
static_assert(2 * CH * LDA * sizeof(float) <= 4 * CH * LDH * sizeof(bf16),
              "the inversion's A and T fit the blocks' space");

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

__global__ void __launch_bounds__(NT, 2)
    chunk_bwd_tc_kernel(const void *qkv, const void *dout, loom_dtype dt, const float *beta,
                        geo z, gdn_ws w, void *dqkv, float *dg, float *dbeta) {
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
    const float *S0 = w.S + (c * Hv + h) * dk * dv, *dS = w.dS + (c * Hv + h) * dk * dv;
    const int64_t qs = z.Hk * dk; // q's and k's row stride
    const float *qn = w.qn + (t0 * z.Hk + hk) * dk, *kn = w.kn + (t0 * z.Hk + hk) * dk;
    const float *Ag = w.A + (c * Hv + h) * CH * CH;
    auto row = [&](int i) { return (t0 + i) * Hv + h; }; // the row of (T, Hv, .) tensors
    auto vcol = [&](int i) { return (t0 + i) * z.C + 2 * z.Hk * dk + h * dv; }; // v_i in qkv
    // the keys [a0, a0 + BO) of q and k (bf16) into Qs, Ks by cp.async (committed)
    const int64_t qko = (t0 * z.Hk + hk) * dk;
    const bool qkvec = vec_ok(w.qb, dk, qs) && vec_ok(w.kb, dk, qs);
    auto stage_qk64 = [&](int64_t a0) {
        stage_async(m.Qs, LDH, w.qb + qko + a0, qs, L, dk - a0, BO, qkvec);
        stage_async(m.Ks, LDH, w.kb + qko + a0, qs, L, dk - a0, BO, qkvec);
        cp_commit();
    };
    // dO's and U's rows of columns [b0, b0 + BO) into S1, S2 by cp.async (committed)
    const int64_t vrs = Hv * dv;
    const bf16 *Oc = (const bf16 *)dout + row(0) * dv, *Uc = w.Uh + row(0) * dv;
    const bool ouv = vec_ok(Oc, dv, vrs) && vec_ok(Uc, dv, vrs);
    auto stage_ou = [&](int64_t b0) {
        stage_async(S1, LDH, Oc + b0, vrs, L, dv - b0, BO, ouv);
        stage_async(S2, LDH, Uc + b0, vrs, L, dv - b0, BO, ouv);
        cp_commit();
    };
    // whether accumulator (n, e) is strictly lower within the chunk, and M there
    auto lower = [&](int n, int e) { return f.i(e) < L && f.j(n, e) < f.i(e); };
    auto decay = [&](int n, int e) { return expf(Gs[f.i(e)] - Gs[f.j(n, e)]); };

    chunk_vectors(w.G, beta, t0, L, Hv, h, Gs, Es, Dj, Bs, SV, SK);
    stage_qk64(0);
    fill(m.As, LDA, CH, CH, [&](int i, int j) { return Ag[i * CH + j]; });
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
    invert_unit_lower(m.As, m.Ts);
    for (int p = tid; p < CH * CH; p += NT) // T's rounding, the products' operand
        Tb[(p / CH) * LDH + p % CH] = __float2bfloat16_rn(m.Ts[(p / CH) * LDA + p % CH]);
    float dq[1][4][4] = {}; // DQ = (dO U^T) M, lower
    for (int64_t b0 = 0; b0 < dv; b0 += BO) {
        __syncthreads(); // S1, S2 free (the inversion's arrays read)
        stage_ou(b0);
        cp_wait<0>();
        __syncthreads();
        warp_mma<1, 4>(dq, S1 + f.r0 * LDH, LDH, 1, S2 + f.c0 * LDH, 1, LDH, BO);
    }
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) {
            const int i = f.i(e), j = f.j(n, e);
            dq[0][n][e] = i < L && j <= i ? dq[0][n][e] * expf(Gs[i] - Gs[j]) : 0.0f;
            DQb[i * LDH + j] = __float2bfloat16_rn(dq[0][n][e]);
        }
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
        if (isv) { // dX = dU's block (S5) with X = U0's (S2) in one round trip
            const auto in = [&](int i, int b) { return i < L && b0 + b < dv; };
            const auto du = [&](int i, int b) {
                return in(i, b) ? w.dU[row(i) * dv + b0 + b] : 0.0f;
            };
            const auto u0 = [&](int i, int b) {
                return in(i, b) ? w.U0[row(i) * dv + b0 + b] : 0.0f;
            };
            fill2(S5, LDH, du, S2, LDH, u0, CH, BO);
        } else { // X = W's block by cp.async, under dX = -dU S0^T over this block's keys
            const bf16 *Wc = w.Wh + row(0) * dk + b0;
            stage_async(S2, LDH, Wc, Hv * dk, L, dk - b0, BO, vec_ok(Wc, dk, Hv * dk));
            cp_commit();
            float x[1][4][4] = {};
            for (int64_t e0 = 0; e0 < dv; e0 += BO) {
                __syncthreads(); // S1, S3 free
                const auto in = [&](int i, int b) { return i < L && e0 + b < dv; };
                const auto ain = [&](int a, int b) { return b0 + a < dk && e0 + b < dv; };
                const auto du = [&](int i, int b) {
                    return in(i, b) ? w.dU[row(i) * dv + e0 + b] : 0.0f;
                };
                const auto s0 = [&](int a, int b) {
                    return ain(a, b) ? S0[(b0 + a) * dv + e0 + b] : 0.0f;
                };
                fill2(S1, LDH, du, S3, LDH, s0, CH, BO);
                __syncthreads();
                warp_mma<1, 4>(x, S1 + f.r0 * LDH, LDH, 1, S3 + f.c0 * LDH, 1, LDH, BO);
            }
            for (int n = 0; n < 4; n++)
                for (int e = 0; e < 4; e++)
                    S5[f.i(e) * LDH + f.j(n, e)] = __float2bfloat16_rn(-x[0][n][e]);
        }
        __syncthreads(); // dX complete
        float db[1][4][4] = {};
        warp_mma<1, 4>(db, Tb + f.r0, 1, LDH, S5 + f.c0, LDH, 1, CH); // T^T dX
        __syncthreads(); // dX read
        // dB's rounding; dv or dk's B part and the rows' dots with v or k, from the accumulators
        float y[4][4];
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = f.i(e);
                const int64_t col = b0 + f.j(n, e);
                S5[i * LDH + f.j(n, e)] = __float2bfloat16_rn(db[0][n][e]);
                y[n][e] = !(i < L && col < ncol) ? 0.0f
                          : isv                  ? ld(qkv, dt, vcol(i) + col)
                                                 : kn[i * qs + col];
            }
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = f.i(e);
                const int64_t col = b0 + f.j(n, e);
                if (i >= L || col >= ncol)
                    continue;
                if (isv)
                    st(dqkv, dt, vcol(i) + col, Bs[i] * db[0][n][e]);
                else
                    w.dkh[row(i) * dk + col] = Bs[i] * Es[i] * db[0][n][e];
            }
        row_sums(f, m.RP, [&](int n, int e) { return y[n][e] * db[0][n][e]; },
                 [&](int i, float v) { (isv ? SV : SK)[i] += v; });
        cp_wait<0>();
        __syncthreads(); // X complete
        warp_mma<1, 4>(da, S5 + f.r0 * LDH, LDH, 1, S2 + f.c0 * LDH, 1, LDH, BO);
    }
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) da[0][n][e] = lower(n, e) ? -da[0][n][e] : 0.0f; // DA
    // dbeta (DA KK M's row sums); R's second part (DA A, A from the
    // workspace): its row and column sums
    row_sums(f, m.RP,
             [&](int n, int e) {
                 return lower(n, e) ? da[0][n][e] * kk[0][n][e] * decay(n, e) : 0.0f;
             },
             [&](int i, float v) { DBE[i] = SV[i] + Es[i] * SK[i] + v; });
    float av[4][4];
    for (int n = 0; n < 4; n++)
        for (int e = 0; e < 4; e++) av[n][e] = lower(n, e) ? Ag[f.i(e) * CH + f.j(n, e)] : 0.0f;
    const auto r2 = [&](int n, int e) { return da[0][n][e] * av[n][e]; };
    row_sums(f, m.RP, r2, [&](int i, float v) { RS[i] += v; });
    col_sums(f, m.CP, r2, [&](int j, float v) { CS[j] += v; });
    for (int n = 0; n < 4; n++) // C = DA beta_i M
        for (int e = 0; e < 4; e++)
            m.Cm[f.i(e) * LDA + f.j(n, e)] =
                lower(n, e) ? da[0][n][e] * Bs[f.i(e)] * decay(n, e) : 0.0f;
    __syncthreads();
    for (int p = tid; p < CH * CH; p += NT) { // Tb <- C + C^T
        const int i = p / CH, j = p % CH;
        Tb[i * LDH + j] = __float2bfloat16_rn(m.Cm[i * LDA + j] + m.Cm[j * LDA + i]);
    }

    // dq and dk, 64 keys at a time; SD's and TM's row dots with q and k as
    // partial sums (PG, PD: a slot per warp column and key block)
    double ss = 0.0;
    for (int64_t a0 = 0; a0 < dk; a0 += BO) {
        float sd[1][4][4] = {}, tm[1][4][4] = {};
        for (int64_t e0 = 0; e0 < dv; e0 += BO) {
            __syncthreads(); // the blocks free (and Tb complete)
            if (e0 == 0)
                stage_qk64(a0);
            stage_ou(e0);
            // S0's and dS's blocks (S3, S5), 8 elements a thread a round;
            // sum(S0 dS) from the fp32 values
            for (int p0 = 0; p0 < CH * BO; p0 += 8 * NT) {
                float s0[8], ds[8];
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int p = p0 + u * NT + tid, a = p / BO, b = p % BO;
                    const bool ok = p < CH * BO && a0 + a < dk && e0 + b < dv;
                    s0[u] = ok ? S0[(a0 + a) * dv + e0 + b] : 0.0f;
                    ds[u] = ok ? dS[(a0 + a) * dv + e0 + b] : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 8; u++) {
                    const int p = p0 + u * NT + tid, a = p / BO, b = p % BO;
                    if (p >= CH * BO)
                        continue;
                    S3[a * LDH + b] = __float2bfloat16_rn(s0[u]);
                    S5[a * LDH + b] = __float2bfloat16_rn(ds[u]);
                    ss += (double)s0[u] * (double)ds[u];
                }
            }
            cp_wait<0>();
            __syncthreads();
            warp_mma<1, 4>(sd, S1 + f.r0 * LDH, LDH, 1, S3 + f.c0 * LDH, 1, LDH, BO);
            warp_mma<1, 4>(tm, S2 + f.r0 * LDH, LDH, 1, S5 + f.c0 * LDH, 1, LDH, BO);
        }
        float pg[2] = {0.0f, 0.0f}, pd[2] = {0.0f, 0.0f};
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = f.i(e);
                const int64_t a = a0 + f.j(n, e);
                sd[0][n][e] *= Es[i];
                tm[0][n][e] *= Dj[i];
                if (i < L && a < dk) {
                    pg[e >> 1] += qn[i * qs + a] * sd[0][n][e];
                    pd[e >> 1] += kn[i * qs + a] * tm[0][n][e];
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
        const bf16 *Qb = m.Qs + f.c0, *Kb = m.Ks + f.c0;
        warp_mma<1, 4>(sd, DQb + f.r0 * LDH, LDH, 1, Kb, LDH, 1, CH); // + DQ K
        warp_mma<1, 4>(tm, DQb + f.r0, 1, LDH, Qb, LDH, 1, CH);       // + DQ^T Q
        warp_mma<1, 4>(tm, Tb + f.r0 * LDH, LDH, 1, Kb, LDH, 1, CH);  // + (C + C^T) K
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                const int i = f.i(e);
                const int64_t a = a0 + f.j(n, e);
                if (i < L && a < dk) {
                    w.dqh[row(i) * dk + a] = sd[0][n][e];
                    w.dkh[row(i) * dk + a] += tm[0][n][e];
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

loom_status tc_chunk_bwd(loom_ctx *ctx, const char *op, const void *qkv, const void *dout,
                         loom_dtype dt, const float *beta, const geo &z, const gdn_ws &w,
                         void *dqkv, float *dg, float *dbeta, cudaStream_t s) {
    return launch(ctx, op, chunk_bwd_tc_kernel, dim3((unsigned)z.NC, (unsigned)z.Hv),
                  bwd_smem(nullptr, z.dk).bytes, s, qkv, dout, dt, beta, z, w, dqkv, dg, dbeta);
}

loom_status tc_prep(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt,
                    const float *g, const float *beta, const geo &z, const gdn_ws &w,
                    cudaStream_t s) {
    return launch(ctx, op, prep_tc_kernel, dim3((unsigned)z.NC, (unsigned)z.Hv),
                  prep_smem(nullptr, z.dk).bytes, s, qkv, dt, g, beta, z, w);
}

} // namespace loom_gdn
