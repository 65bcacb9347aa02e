// The gated delta rule's tensor-core kernels' building blocks (ops_gdn_tc.cu,
// ops_gdn_tc_bwd.cu): fragments from shared memory and the warp's product,
// the 64 x 64 tile's split among 8 warps, shared memory carved into 16-byte
// aligned arrays, cp.async staging and the unit lower triangle's inverse.
// Included after mma.cuh (which the CPU emulator swaps for
// its own). Internal to the CUDA backend.
#ifndef LOOM_CUDA_OPS_GDN_TC_CUH
#define LOOM_CUDA_OPS_GDN_TC_CUH

#include "ops_gdn_rule.cuh"

namespace loom_gdn {

constexpr int TCW = WARPS; // warps of the tensor-core kernels: a 64 x 64 tile, 16 x 32 each
static_assert(TCW == 8, "the tensor-core kernels split 64 x 64 among 8 warps");


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
// unit): the same sequence of take() gives the host the size (base NULL)
// and the kernel its pointers. The pointers are the base's plus offsets (a
// char pointer, not an integer) so that the compiler still knows them
// shared: through an integer they become generic, and every access a
// generic load.
struct carve {
    char *base;
    size_t off = 0;
    __host__ __device__ explicit carve(void *b) : base((char *)b) {}
    template <typename T> __host__ __device__ T *take(int64_t n) {
        T *r = (T *)(base + off);
        off += ((size_t)n * sizeof(T) + 15) / 16 * 16;
        return r;
    }
};

typedef __nv_bfloat16 bf16;
constexpr int LDH = BO + 8; // row stride of bf16 (CH, BO) and (CH, CH) blocks: no bank conflicts
__host__ __device__ inline int64_t ldk(int64_t dk) { return pad16(dk) + 8; } // bf16 (CH, dk16)


// An accumulator pair (e, e + 1: one row, columns j and j + 1) to global
// memory as one 8-byte (fp32) or 4-byte (bf16) access where both columns
// are in range (two) and the pair is aligned (even: the caller's rows have
// even lengths and offsets): a lane's pair and its quad's fill a 32-byte
// sector in one instruction, where two 4-byte stores each left the sector
// half written (ncu on an H200: 61% more L2 sectors than the ideal).
__device__ __forceinline__ void put2(float *p, bool even, bool two, float a, float b) {
    if (even && two) {
        *reinterpret_cast<float2 *>(p) = make_float2(a, b);
    } else {
        p[0] = a;
        if (two)
            p[1] = b;
    }
}
__device__ __forceinline__ void put2(bf16 *p, bool even, bool two, float a, float b) {
    if (even && two) {
        *reinterpret_cast<uint32_t *>(p) = M16::pack(a, b);
    } else {
        p[0] = __float2bfloat16_rn(a);
        if (two)
            p[1] = __float2bfloat16_rn(b);
    }
}

// A pair of columns (j, j + 1) of one row, both in range (two) and aligned
// (even), as one 8-byte (fp32) or 4-byte (bf16) load, as put2; the second
// zero where not two.
__device__ __forceinline__ float2 ld2(const float *p, bool even, bool two) {
    if (even && two)
        return *reinterpret_cast<const float2 *>(p);
    return make_float2(p[0], two ? p[1] : 0.0f);
}
__device__ __forceinline__ float2 ld2(const bf16 *p, bool even, bool two) {
    if (even && two) {
        const uint32_t u = *reinterpret_cast<const uint32_t *>(p);
        const bf16 *e = reinterpret_cast<const bf16 *>(&u);
        return make_float2(__bfloat162float(e[0]), __bfloat162float(e[1]));
    }
    return make_float2(__bfloat162float(p[0]), two ? __bfloat162float(p[1]) : 0.0f);
}
// An accumulator pair rounded to bf16 into shared memory as one 4-byte store
// (the pair's column even, the rows' stride even).
__device__ __forceinline__ void sts2(bf16 *p, float a, float b) {
    *reinterpret_cast<uint32_t *>(p) = M16::pack(a, b);
}

// The two bf16 of a 4-byte pair (a fragment's register), widened (exact):
// the first (low half) and the second.
__device__ __forceinline__ float lo_of(uint32_t r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float hi_of(uint32_t r) { return __uint_as_float(r & 0xffff0000u); }

// Rows [0, R) (a chunk's by default) x columns [0, W) (W a multiple of 16
// bytes' elements) of dst (row stride ld) from src (row i at src + i rs),
// zero where i >= L or c >= n: by cp.async when vec (n, rs and src 16-byte
// multiples), else by plain loads, by the block's NTH threads. Neither
// committed nor waited for.
template <typename T, int NTH = NT>
__device__ __forceinline__ void stage_async(T *dst, int ld, const T *src, int64_t rs, int L,
                                            int64_t n, int W, bool vec, int R = CH) {
    constexpr int E = 16 / sizeof(T);
    const int q = W / E;
    for (int p = threadIdx.x; p < R * q; p += NTH) {
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
    return n % E == 0 && rs % E == 0 && aligned16(src);
}

// A chunk's q and k rows of key head hk, keys [a0, a0 + W) (bf16, zero past
// dk), into Qs, Ks (row stride ld; Qs NULL: k only) by cp.async (committed,
// not waited for).
__device__ __forceinline__ void stage_qk(const geo &z, const gdn_ws &w, int64_t t0, int L,
                                         int64_t hk, bf16 *Qs, bf16 *Ks, int ld, int64_t a0,
                                         int W) {
    const int64_t dk = z.dk, rs = z.Hk * dk, o = (t0 * z.Hk + hk) * dk + a0;
    const bool vec = vec_ok(w.qb, dk, rs) && vec_ok(w.kb, dk, rs);
    if (Qs)
        stage_async(Qs, ld, w.qb + o, rs, L, dk - a0, W, vec);
    stage_async(Ks, ld, w.kb + o, rs, L, dk - a0, W, vec);
    cp_commit();
}
// All of a chunk's keys (dk16 columns) at the row stride ldk(dk).
__device__ __forceinline__ void stage_qk(const geo &z, const gdn_ws &w, int64_t t0, int L,
                                         int64_t hk, bf16 *Qs, bf16 *Ks) {
    stage_qk(z, w, t0, L, hk, Qs, Ks, (int)ldk(z.dk), 0, (int)pad16(z.dk));
}

// A (CH, BO) block's elements of a thread, BO CH / NT of them (u at row
// tid / BO + u NT / BO, column tid % BO): load(raw) issues their loads into
// registers, store(dst, ld, f) puts f(i, b, raw) to shared memory later, so
// the loads are in flight while other work runs (and any arithmetic on them
// waits for the store, not the load).
struct block_regs {
    static constexpr int N = CH * BO / NT;
    float v[N];
    __device__ static int row(int u) { return (int)threadIdx.x / BO + u * (NT / BO); }
    __device__ static int col() { return (int)threadIdx.x % BO; }
    template <typename F> __device__ __forceinline__ void load(F raw) {
#pragma unroll
        for (int u = 0; u < N; u++)
            v[u] = raw(row(u), col());
    }
    template <typename T, typename F>
    __device__ __forceinline__ void store(T *dst, int ld, F f) const {
#pragma unroll
        for (int u = 0; u < N; u++)
            put(dst + row(u) * ld + col(), f(row(u), col(), v[u]));
    }
};
static_assert(CH * BO % NT == 0 && NT % BO == 0, "block_regs' split");

// T = (I + A)^-1 for the strictly lower A (CH x CH, row stride LDA) by
// blocks of 16: each diagonal block by forward substitution (a column a
// thread, kept in registers), then a block row at a time T_IJ = -T_II
// sum_J<=K<I A_IK T_KJ (an element a thread). Its longest chain is 16 + 3
// (48 + 16) steps where a column a thread over the whole chunk takes 64 x
// 32. All threads; ends with a barrier. Every loop runs a count fixed at
// compile time: a sum that began at a thread's own index (k from j, k up to
// r) runs from 0 or to 15 instead, the terms added being products with the
// zeros above T's diagonal (the same sums, bit for bit), so the loops unroll
// and a product is two shared loads and an FMA (the loops' index and bound
// arithmetic had been most of prep's instructions: ncu on an H200, IMAD and
// ISETP 25% of them, LDS 12%, FFMA 7%).
__device__ inline void invert_unit_lower(const float *As, float *Ts) {
    static_assert(NT == 256 && CH == 64, "a 16 x 16 block an element a thread");
    const int tid = threadIdx.x;
    if (tid < CH) {
        const int b = 16 * (tid / 16), j = tid % 16;
        float col[16]; // T's column j of the diagonal block, zero above the diagonal
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const float *a = As + (b + i) * LDA + b;
            float x = i == j ? 1.0f : 0.0f;
#pragma unroll
            for (int k = 0; k < i; k++)
                x -= a[k] * col[k];
            col[i] = i < j ? 0.0f : x;
            Ts[(b + i) * LDA + b + j] = col[i];
        }
    }
    for (int p = tid; p < CH * CH; p += NT) // zero above the diagonal blocks
        if ((p % CH) / 16 > (p / CH) / 16)
            Ts[(p / CH) * LDA + p % CH] = 0.0f;
    __syncthreads();
    const int r = tid / 16, c = tid % 16;
#pragma unroll
    for (int I = 1; I < 4; I++) {
        const int ri = 16 * I + r;
#pragma unroll
        for (int J = 0; J < I; J++) { // sum_K A_IK T_KJ into T_IJ's place
            float x = 0.0f;
#pragma unroll
            for (int k = 16 * J; k < 16 * I; k++)
                x += As[ri * LDA + k] * Ts[k * LDA + 16 * J + c];
            Ts[ri * LDA + 16 * J + c] = x;
        }
        __syncthreads();
        float y[3] = {0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int J = 0; J < 3; J++)
            if (J < I)
#pragma unroll
                for (int k = 0; k < 16; k++) // T_II's row r: zero past k = r
                    y[J] -= Ts[ri * LDA + 16 * I + k] * Ts[(16 * I + k) * LDA + 16 * J + c];
        __syncthreads();
#pragma unroll
        for (int J = 0; J < 3; J++)
            if (J < I)
                Ts[ri * LDA + 16 * J + c] = y[J];
        __syncthreads();
    }
}

} // namespace loom_gdn

#endif // LOOM_CUDA_OPS_GDN_TC_CUH
