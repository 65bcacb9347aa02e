// The gated delta rule's state passes on tensor cores (bf16, dk <= 128):
// the twins of ops_gdn_rule.cu's state_fwd_kernel and state_bwd_kernel,
// launched by its driver (ops_gdn_rule.cuh's tc_state_fwd, tc_state_bwd).
// Per (document, value head, 16 columns of dv: a unit), the document's
// chunks in order (in reverse for the backward): each chunk's step waits
// for the last, so a step's latency is the pass's time, and the work of a
// step is spread over a unit's KS warps (eight, or four: slices<KS>).
//
// The state is kept transposed (S^T: 16 columns x dk16 keys) in the warps'
// mma accumulators, warp ks holding keys [KW ks, KW ks + KW) (KW = 128 /
// KS), and rounded to bf16 into shared memory (Sh) for the product over all
// keys. Warp ks also owns the chunk's tokens [TW ks, TW ks + TW) (TW = 64 /
// KS) in that product:
//   forward   U^T = U0^T - S^T W^T over its tokens (A: Sh, B: W's rows),
//             then its keys of S^T <- e^G_L S^T + (Ds U)^T K
//   backward  dU^T = Ds (dS^T K^T) + (dU's local part)^T over its tokens,
//             then its keys of dS^T <- e^G_L dS^T + (Es dO)^T Q - dU^T W
// (Ds_j = e^(G_L - G_j), Es_i = e^G_i), Ds U (or dU) rounded to bf16 into
// shared memory (Us) between the two. Two barriers a chunk: one for the
// staged operands and Sh, one for Us. The same products and roundings as
// the fp32 kernels' operands take: the state rounded as an operand, U and
// dU rounded after their decay; each sum over keys in one accumulator in
// key order. A block holds NU units (1, 2 or 4: the 16-column blocks of a
// head side by side) sharing a chunk's operands (W, K, Q as bf16 rows; U0
// or dU's local part, dO; the decays), copied by cp.async ST - 1 chunks
// ahead into a ring of ST stages. A document's chunks are its 64-token runs from its
// first token, so their rows follow from its bounds, with no table loads in
// the chain.
//
// Checked against the CPU reference on the CPU emulator (make test-emu,
// every NU) and, on an H200, by tests/test_backend_gdn.c and the Qwen3.5
// model tests (tests/gpu/qwen35.sh).
#include <type_traits>

#include "mma.cuh"
#include "ops_gdn_tc.cuh"

using namespace loom_cuda;
using namespace loom_gdn;

namespace {
constexpr int SW = 16;       // dv columns a unit (the products' m)
constexpr int MK = 8;        // k-steps of 16 over dk16 at most (dk <= 128)
constexpr int DKM = 16 * MK; // the largest dk (and FULL's dk and dv)
constexpr int LDU = CH + 8;  // row stride of a unit's Us (bf16, 16 x CH)

// The sizes of a block of NU units.
template <int NU> struct shape {
    static constexpr int BW = SW * NU; // dv columns
    static constexpr int LDV = BW + 4; // row stride of the fp32 (CH, BW) block
    static constexpr int LDO = BW + 8; // row stride of the bf16 (CH, BW) block
};

// A unit's KS warps: warp ks owns keys [KW ks, KW ks + KW) of the state
// (KN n-tiles of 8, KJ blocks of 16) and tokens [TW ks, TW ks + TW) of a
// chunk (TN n-tiles). Eight warps (16 keys, 8 tokens each), so that a
// chunk's step, the chain's link, is spread over as many; four (32 keys,
// 16 tokens) for four units a block (FULL: 124 and 128 registers, no
// spills), and for two units without FULL's constant dimensions, whose
// registers (140-180) sixteen warps a block could not hold.
template <int KS> struct slices {
    static_assert(KS == 4 || KS == 8, "four or eight warps a unit");
    static constexpr int KW = DKM / KS, KN = KW / 8, KJ = KW / 16;
    static constexpr int TW = CH / KS, TN = TW / 8;
};
// a block's threads
template <int NU, int KS> __host__ __device__ constexpr int threads() { return 32 * KS * NU; }
// Stages of the ring: three (two chunks staged ahead of the one in use);
// two for the backward's blocks of four units, whose three would pass the
// 227 KB of shared memory a block can have.
template <int NU, bool BWD> __host__ __device__ constexpr int stages() {
    return NU == 4 && BWD ? 2 : 3;
}

// A stage: the bf16 (CH, dk16) row blocks X (W, K; and Q for the
// backward), the fp32 (CH, BW) block V (U0, or dU's local part), the bf16
// (CH, BW) block O (dO, backward only) and the chunk's decays D = e^(G_L -
// G) and E = e^G (backward only). The ring's stages lie one after another,
// `bytes` apart (a stage's pointers are computed: a runtime index into an
// array of them goes to local memory); after them each unit's Sh (16 x
// dk16) and Us (16 x CH), bf16.
template <int NU> struct stage_ptrs {
    bf16 *X[3];
    float *V, *D, *E;
    bf16 *O;
    size_t bytes;
    __host__ __device__ stage_ptrs(void *base, int64_t dk, bool bwd) {
        carve c(base);
        for (int q = 0; q < 3; q++)
            X[q] = q < 2 || bwd ? c.take<bf16>(CH * ldk(dk)) : nullptr;
        V = c.take<float>(CH * shape<NU>::LDV);
        O = bwd ? c.take<bf16>(CH * shape<NU>::LDO) : nullptr;
        D = c.take<float>(CH);
        E = bwd ? c.take<float>(CH) : nullptr;
        bytes = c.off;
    }
};
__host__ __device__ inline size_t unit_bytes(int64_t dk) {
    return (size_t)(SW * ldk(dk) + SW * LDU) * sizeof(bf16);
}
template <int NU, bool BWD> __host__ __device__ inline size_t ring_bytes(int64_t dk) {
    return stages<NU, BWD>() * stage_ptrs<NU>(nullptr, dk, BWD).bytes + NU * unit_bytes(dk);
}

// Document n's chunks c1 <= c < c2: first token t0(c), length len(c).
struct doc_chunks {
    int c1, c2;
    int64_t T0, E;
    __device__ doc_chunks(const gdn_ws &w, int64_t n) : c1(w.cfirst[n]), c2(w.cfirst[n + 1]) {
        T0 = c1 < c2 ? w.ct0[c1] : 0;
        E = c1 < c2 ? w.ct0[c2 - 1] + w.clen[c2 - 1] : 0;
    }
    __device__ int64_t t0(int c) const { return T0 + (int64_t)(c - c1) * CH; }
    __device__ int len(int c) const {
        const int64_t r = E - t0(c);
        return r < CH ? (int)r : CH;
    }
};

// A thread's place: value head h (key head hk), the block's dv columns b0
// on (nb valid), its unit u (columns v0 = 16 u on of the block's), key and
// token slice ks, lane's g and t; its unit's Sh and Us.
template <int NU, int KS> struct pass_at {
    using SL = slices<KS>;
    int64_t h, hk, b0;
    int nb, u, ks, lane, g, t, v0, ldq;
    bf16 *Sh, *Us;
    __device__ pass_at(const geo &z, char *units) {
        const int warp = (int)threadIdx.x >> 5;
        h = blockIdx.y, hk = h / z.grp, b0 = (int64_t)blockIdx.z * shape<NU>::BW;
        nb = z.dv - b0 < shape<NU>::BW ? (int)(z.dv - b0) : shape<NU>::BW;
        u = warp / KS, ks = warp % KS, lane = (int)threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        v0 = SW * u, ldq = (int)ldk(z.dk);
        Sh = (bf16 *)(units + u * unit_bytes(z.dk));
        Us = Sh + SW * ldq;
    }
    // accumulator e of a 16 x 8 tile: the block's dv column, a key (n-tile
    // nn of the warp's KN) or a token (n-tile nt of its TN)
    __device__ int col(int e) const { return v0 + g + 8 * (e >> 1); }
    __device__ int key(int nn, int e) const { return SL::KW * ks + 8 * nn + 2 * t + (e & 1); }
    __device__ int tok(int nt, int e) const { return SL::TW * ks + 8 * nt + 2 * t + (e & 1); }
};

// A chunk's G at its last token and at this thread's token (threads < CH),
// loaded a chunk ahead (plain loads: their latency is hidden by the step
// before).
struct decay_ahead {
    float GL = 0.0f, gj = 0.0f;
    int L = 0;
    __device__ void load(const geo &z, const gdn_ws &w, const doc_chunks &dc, int c, int64_t h) {
        const int64_t t0 = dc.t0(c);
        L = dc.len(c);
        GL = w.G[(t0 + L - 1) * z.Hv + h];
        gj = (int)threadIdx.x < L ? w.G[(t0 + threadIdx.x) * z.Hv + h] : 0.0f;
    }
    // D (and E) of the stage: this thread's token's
    __device__ void put(float *D, float *E) const {
        if ((int)threadIdx.x >= CH)
            return;
        const bool in = (int)threadIdx.x < L;
        D[threadIdx.x] = in ? expf(GL - gj) : 0.0f;
        if (E)
            E[threadIdx.x] = in ? expf(gj) : 0.0f;
    }
};

// stage_async for the block's NTH threads where a row's 16-byte pieces
// divide NTH (a power of two): each thread keeps one piece column, its
// rows NTH / pieces apart, with no division a piece. (Taking this path in
// stage_async itself, for every kernel, made chunk_bwd spill at its 128
// registers and run 846 -> 959 us on an H200: kept here.)
template <int NTH, typename T>
__device__ __forceinline__ void stage_rows(T *dst, int ld, const T *src, int64_t rs, int L,
                                           int64_t n, int W, bool vec) {
    constexpr int E = 16 / sizeof(T);
    const int q = W / E;
    if (!vec || NTH % q) {
        stage_async<T, NTH>(dst, ld, src, rs, L, n, W, vec);
        return;
    }
    const int sh = __ffs(q) - 1, dr = NTH >> sh, c = ((int)threadIdx.x & (q - 1)) * E;
    int i = (int)threadIdx.x >> sh;
    T *d = dst + i * ld + c;
    const T *s = src + i * rs + c;
    const bool cv = c < n;
    for (; i < CH; i += dr, d += dr * ld, s += dr * rs)
        cp_async16(d, i < L && cv ? s : src, i < L && cv);
}

// A lane's two accumulators a = (row 2t, column g) and b = (row 2t + 1,
// column g) of a 16 x 8 tile's column pair, to bf16 rows (stride rs) at base
// = (row 2t, column g): lanes g and g ^ 1 swap a value so that each stores
// two adjacent columns of one row in one 4-byte store (even g row 2t, odd g
// row 2t + 1), instead of two 2-byte stores to two rows. Every lane of the
// warp takes part (the shuffle); base's column pair 4-byte aligned for even g.
__device__ __forceinline__ void put_pair(bf16 *base, int rs, float a, float b, int g) {
    const bool odd = g & 1;
    const float got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 4); // lane g ^ 1's
    *reinterpret_cast<uint32_t *>(odd ? base + rs - 1 : base) =
        odd ? M16::pack(got, b) : M16::pack(a, got);
}

// The warp's keys of the state (S^T's, as accumulators) to the chunk's (dk,
// dv) block Sg (fp32, or bf16 rounded: the forward's states, the backward's
// gradients; the block's columns on) and, rounded, to its unit's Sh: keys <
// dk and columns < nb to Sg, keys < dk16 to Sh (FULL: dk = 128 and every
// column). PAIRS (bf16, the kernels' FULL: dv = 128, pairs aligned): Sg by
// put_pair.
template <bool FULL, bool PAIRS, int NU, int KS, typename T>
__device__ __forceinline__ void put_state(T *Sg, const float (&S)[slices<KS>::KN][4],
                                          const pass_at<NU, KS> &p, int dk, int dv) {
    const int d16 = (int)pad16(dk);
    T *base = Sg + p.key(0, 0) * dv + p.col(0); // offsets in int: a block's fit
#pragma unroll
    for (int nn = 0; nn < slices<KS>::KN; nn++) {
        if constexpr (PAIRS && FULL && std::is_same<T, bf16>::value) {
#pragma unroll
            for (int r = 0; r < 2; r++)
                put_pair(base + 8 * nn * dv + 8 * r, dv, S[nn][2 * r], S[nn][2 * r + 1], p.g);
        } else {
#pragma unroll
            for (int e = 0; e < 4; e++)
                if (FULL || (p.key(nn, e) < dk && p.col(e) < p.nb))
                    put(base + (8 * nn + (e & 1)) * dv + 8 * (e >> 1), S[nn][e]);
        }
        if (FULL || p.key(nn, 0) < d16)
#pragma unroll
            for (int r = 0; r < 2; r++) // keys 2t, 2t + 1 of rows g and g + 8
                *(uint32_t *)(p.Sh + (p.g + 8 * r) * p.ldq + p.key(nn, 0)) =
                    M16::pack(S[nn][2 * r], S[nn][2 * r + 1]);
    }
}

// The warp's TW tokens of a (CH, BW) bf16 block Ug (at the rows' and the
// lane's column: row stride rs) from y (tokens 2t, 2t + 1 of n-tile nt,
// columns g and g + 8): PAIRS (the kernels' FULL, a whole chunk) by
// put_pair, else element by element where token i < L and column < nb.
template <bool PAIRS, int NU, int KS>
__device__ __forceinline__ void put_tokens(bf16 *Ug, int rs, const float (&y)[slices<KS>::TN][4],
                                           const pass_at<NU, KS> &p, int L) {
#pragma unroll
    for (int nt = 0; nt < slices<KS>::TN; nt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if constexpr (PAIRS) {
                put_pair(Ug + p.tok(nt, 0) * rs + 8 * r, rs, y[nt][2 * r], y[nt][2 * r + 1], p.g);
            } else {
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    const int e = 2 * r + b, i = p.tok(nt, e);
                    if (i < L && p.col(e) < p.nb)
                        Ug[i * rs + 8 * r] = __float2bfloat16_rn(y[nt][e]);
                }
            }
        }
}

// The warp's TW tokens of Y^T (16 x CH) = Sh R^T: the unit's Sh (16 x
// dk16, nk k-steps) and the chunk's rows R (CH, dk16) in shared memory.
template <int NU, int KS>
__device__ __forceinline__ void state_times_rows(float (&y)[slices<KS>::TN][4],
                                                 const pass_at<NU, KS> &p, const bf16 *R, int nk) {
    constexpr int TW = slices<KS>::TW;
#pragma unroll
    for (int kk = 0; kk < MK; kk++)
        if (kk < nk) {
            uint32_t a[4];
            ldsm_x4(a, a_addr(p.Sh, p.ldq, 0, 16 * kk, p.lane));
            if constexpr (TW == 16) {
                uint32_t b[4];
                ldsm_x4(b, b_addr(R, p.ldq, TW * p.ks, 16 * kk, p.lane));
                M16::mma(y[0], a, b[0], b[1]);
                M16::mma(y[1], a, b[2], b[3]);
            } else {
                uint32_t b[2];
                ldsm_x2(b, b1_addr(R, p.ldq, TW * p.ks, 16 * kk, p.lane));
                M16::mma(y[0], a, b[0], b[1]);
            }
        }
}

// The warp's TW tokens of Y^T (as accumulators, rounded) to its unit's Us.
template <int NU, int KS>
__device__ __forceinline__ void put_us(const float (&y)[slices<KS>::TN][4],
                                       const pass_at<NU, KS> &p) {
#pragma unroll
    for (int nt = 0; nt < slices<KS>::TN; nt++)
#pragma unroll
        for (int r = 0; r < 2; r++)
            *(uint32_t *)(p.Us + (p.g + 8 * r) * LDU + p.tok(nt, 0)) =
                M16::pack(y[nt][2 * r], y[nt][2 * r + 1]);
}

// keys [16 kk, 16 kk + 16) of Y^T (16 x dk16) = A^T R for A^T (16 x CH, as
// 4 k-steps' fragments) and the chunk's rows R.
__device__ __forceinline__ void times_rows(float (&y)[2][4], const uint32_t (&a)[4][4],
                                           const bf16 *R, int ld, int kk, int lane) {
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
        uint32_t b[4];
        ldsm_x4_t(b, bt_addr(R, ld, 16 * kt, 16 * kk, lane));
        M16::mma(y[0], a[kt], b[0], b[1]);
        M16::mma(y[1], a[kt], b[2], b[3]);
    }
}

// The ring's prologue (stages 0 .. ST - 2) and its step: chunk number s's
// stage waited for and seen by the block (and the units' Sh), then number
// s + ST - 1 staged in the slot number s - 1 used. A group is committed
// for every number, staged or not, so that the wait's count holds at the end.
template <int ST, typename F> __device__ __forceinline__ void ring_start(int nc, F stage) {
    for (int s = 0; s < ST - 1; s++) {
        if (s < nc)
            stage(s, s % ST);
        cp_commit();
    }
}
template <int ST, typename F>
__device__ __forceinline__ void ring_step(int s, int nc, F stage) {
    cp_wait<ST - 2>();
    __syncthreads();
    if (s + ST - 1 < nc)
        stage(s + ST - 1, (s + ST - 1) % ST);
    cp_commit();
}

// A compile-time flag: full (a whole chunk, all the block's columns and dk
// = 128, every key a warp owns: no bounds to check) or not.
template <bool B> struct flag {
    static constexpr bool v = B;
};

// What both passes set up: the shapes, the ring's slots (`bytes` apart
// from the shared memory's start, the units' Sh and Us after them), the
// thread's place, the document's chunks, the rows' strides, and whether
// the block's tiles are full (dk = 128, every column: no bounds to check).
template <int NU, int KS, bool BWD> struct pass_base {
    static constexpr int ST = stages<NU, BWD>();
    int64_t dk, dv, d16, wrs, krs, ors;
    int nk, ldq;
    size_t bytes;
    char *sm;
    pass_at<NU, KS> p;
    doc_chunks dc;
    int nc;
    bool keys;
    __device__ pass_base(const geo &z, const gdn_ws &w, char *smem)
        : dk(z.dk), dv(z.dv), d16(pad16(z.dk)), wrs(z.Hv * z.dk), krs(z.Hk * z.dk),
          ors(z.Hv * z.dv), nk((int)(pad16(z.dk) / 16)), ldq((int)ldk(z.dk)),
          bytes(stage_ptrs<NU>(nullptr, z.dk, BWD).bytes), sm(smem),
          p(z, smem + ST * bytes), dc(w, blockIdx.x), nc(dc.c2 - dc.c1),
          keys(z.dk == DKM && p.nb == shape<NU>::BW) {}
    __device__ stage_ptrs<NU> slot(int s) const {
        return stage_ptrs<NU>(sm + s * bytes, dk, BWD);
    }
};

// FULL (the launchers' full_dims_ok: dk = dv = 128, Qwen3.5's heads): the
// kernel's copy of the dimensions made the constants they are, so that
// every stride, bound and k-step count below folds at compile time (the
// state passes were issue-bound on their integer work: ncu on an H200 had
// 26% of state_fwd's instructions IMAD, 12% ISETP, 4% HMMA); the blocks'
// columns are then all in range (128 is a multiple of BW) and every key a
// warp owns is one.
template <bool FULL> __device__ __forceinline__ void full_dims(geo &z) {
    if constexpr (FULL) {
        z.dk = DKM;
        z.dv = DKM;
    }
}
inline bool full_dims_ok(const geo &z) { return z.dk == DKM && z.dv == DKM; }

// The forward pass: stores each chunk's starting state (w.Sb, bf16) and U =
// U0 - W S0 (w.Uh, bf16).
template <int NU, int KS, bool FULL>
__global__ void __launch_bounds__(threads<NU, KS>(), 1) state_fwd_tc_kernel(geo z, gdn_ws w) {
    using SH = shape<NU>;
    using SL = slices<KS>;
    constexpr int NTH = threads<NU, KS>();
    extern __shared__ __align__(16) float sm[];
    full_dims<FULL>(z);
    constexpr int ST = stages<NU, false>();
    const pass_base<NU, KS, false> b(z, w, (char *)sm);
    const pass_at<NU, KS> &p = b.p;
    const doc_chunks &dc = b.dc;
    const int64_t dk = b.dk, dv = b.dv, d16 = b.d16, wrs = b.wrs, krs = b.krs, ors = b.ors;
    const int nk = b.nk, nc = b.nc, ldq = b.ldq;
    const bool wv = vec_ok(w.Wh, dk, wrs), kv = vec_ok(w.kb, dk, krs);
    const bool ov = vec_ok(w.U0 + p.b0, dv, ors), keys = FULL || b.keys;
    const auto stage = [&](int s, int slot) {
        const int c = dc.c1 + s, L = dc.len(c);
        const int64_t t0 = dc.t0(c);
        const stage_ptrs<NU> q = b.slot(slot);
        const bf16 *Wc = w.Wh + (t0 * z.Hv + p.h) * dk, *Kc = w.kb + (t0 * z.Hk + p.hk) * dk;
        stage_rows<NTH>(q.X[0], ldq, Wc, wrs, L, dk, (int)d16, wv);
        stage_rows<NTH>(q.X[1], ldq, Kc, krs, L, dk, (int)d16, kv);
        stage_rows<NTH>(q.V, SH::LDV, w.U0 + (t0 * z.Hv + p.h) * dv + p.b0, ors, L, p.nb,
                        SH::BW, ov);
    };
    float S[SL::KN][4] = {};
    decay_ahead cur, nxt;
    if (nc > 0)
        cur.load(z, w, dc, dc.c1, p.h);
    ring_start<ST>(nc, stage);
    for (int s = 0; s < nc; s++) {
        const int c = dc.c1 + s, L = cur.L;
        const int64_t t0 = dc.t0(c);
        const stage_ptrs<NU> q = b.slot(s % ST);
        bf16 *Sg = w.Sb + ((int64_t)c * z.Hv + p.h) * dk * dv + p.b0;
        if (keys)
            put_state<true, FULL>(Sg, S, p, (int)dk, (int)dv);
        else
            put_state<false, false>(Sg, S, p, (int)dk, (int)dv);
        cur.put(q.D, nullptr);
        const float eL = expf(cur.GL);
        if (s + 1 < nc)
            nxt.load(z, w, dc, c + 1, p.h);
        ring_step<ST>(s, nc, stage); // the stage, D and Sh seen
        float u[SL::TN][4] = {};
        state_times_rows(u, p, q.X[0], nk); // (W S)^T, the warp's tokens
        bf16 *Ug = w.Uh + (t0 * z.Hv + p.h) * dv + p.b0 + p.col(0);
        const int urs = (int)ors; // a row of U (int: a chunk's rows fit)
        const auto epilogue = [&](auto full) { // U = U0 - W S to Uh; u <- Ds U
#pragma unroll
            for (int nt = 0; nt < SL::TN; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int i = p.tok(nt, e), v = p.col(e);
                    u[nt][e] = full.v || (i < L && v < p.nb) ? q.V[i * SH::LDV + v] - u[nt][e]
                                                             : 0.0f;
                }
            put_tokens<FULL && decltype(full)::v>(Ug, urs, u, p, L);
#pragma unroll
            for (int nt = 0; nt < SL::TN; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    u[nt][e] *= q.D[p.tok(nt, e)];
        };
        if (keys && L == CH)
            epilogue(flag<true>{});
        else
            epilogue(flag<false>{});
        put_us(u, p);
        __syncthreads(); // Us
        uint32_t ua[4][4];
#pragma unroll
        for (int kt = 0; kt < 4; kt++)
            ldsm_x4(ua[kt], a_addr(p.Us, LDU, 0, 16 * kt, p.lane));
#pragma unroll
        for (int j = 0; j < SL::KJ; j++) // its keys: S^T <- e^G_L S^T + (Ds U)^T K
            if (SL::KJ * p.ks + j < nk) {
                float y[2][4] = {};
                times_rows(y, ua, q.X[1], ldq, SL::KJ * p.ks + j, p.lane);
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        S[2 * j + r][e] = eL * S[2 * j + r][e] + y[r][e];
            }
        cur = nxt;
    }
}

// The backward pass: from dS = 0 after the document, stores each chunk's
// end state's gradient (w.dSb) and the complete dU (w.dUb; w.dU holds its
// local part), both bf16 (chunk_bwd's operands: it rounds them as it uses
// them), half the bytes of fp32 to write here and read there.
template <int NU, int KS, bool FULL>
__global__ void __launch_bounds__(threads<NU, KS>(), 1)
    state_bwd_tc_kernel(geo z, gdn_ws w, const void *dout) {
    using SH = shape<NU>;
    using SL = slices<KS>;
    constexpr int NTH = threads<NU, KS>();
    extern __shared__ __align__(16) float sm[];
    full_dims<FULL>(z);
    constexpr int ST = stages<NU, true>();
    const pass_base<NU, KS, true> b(z, w, (char *)sm);
    const pass_at<NU, KS> &p = b.p;
    const doc_chunks &dc = b.dc;
    const int64_t dk = b.dk, dv = b.dv, d16 = b.d16, wrs = b.wrs, krs = b.krs, ors = b.ors;
    const int nk = b.nk, nc = b.nc, ldq = b.ldq;
    const bf16 *dO = (const bf16 *)dout; // bf16, as use_tc asks
    const bool wv = vec_ok(w.Wh, dk, wrs), kv = vec_ok(w.kb, dk, krs) && vec_ok(w.qb, dk, krs);
    const bool uv = vec_ok(w.dU + p.b0, dv, ors), ov = vec_ok(dO + p.b0, dv, ors);
    const bool keys = FULL || b.keys;
    const auto stage = [&](int s, int slot) { // chunk number s from the document's end
        const int c = dc.c2 - 1 - s, L = dc.len(c);
        const int64_t t0 = dc.t0(c), o = (t0 * z.Hv + p.h) * dv + p.b0;
        const int64_t ko = (t0 * z.Hk + p.hk) * dk;
        const stage_ptrs<NU> q = b.slot(slot);
        const bf16 *Wc = w.Wh + (t0 * z.Hv + p.h) * dk;
        stage_rows<NTH>(q.X[0], ldq, Wc, wrs, L, dk, (int)d16, wv);
        stage_rows<NTH>(q.X[1], ldq, w.kb + ko, krs, L, dk, (int)d16, kv);
        stage_rows<NTH>(q.X[2], ldq, w.qb + ko, krs, L, dk, (int)d16, kv);
        stage_rows<NTH>(q.V, SH::LDV, w.dU + o, ors, L, p.nb, SH::BW, uv);
        stage_rows<NTH>(q.O, SH::LDO, dO + o, ors, L, p.nb, SH::BW, ov);
    };
    float dS[SL::KN][4] = {};
    decay_ahead cur, nxt;
    if (nc > 0)
        cur.load(z, w, dc, dc.c2 - 1, p.h);
    ring_start<ST>(nc, stage);
    for (int s = 0; s < nc; s++) {
        const int c = dc.c2 - 1 - s, L = cur.L;
        const int64_t t0 = dc.t0(c);
        const stage_ptrs<NU> q = b.slot(s % ST);
        bf16 *Sg = w.dSb + ((int64_t)c * z.Hv + p.h) * dk * dv + p.b0;
        if (keys)
            put_state<true, FULL>(Sg, dS, p, (int)dk, (int)dv);
        else
            put_state<false, false>(Sg, dS, p, (int)dk, (int)dv);
        cur.put(q.D, q.E);
        const float eL = expf(cur.GL);
        if (s + 1 < nc)
            nxt.load(z, w, dc, c - 1, p.h);
        ring_step<ST>(s, nc, stage); // the stage, D, E and Sh seen
        float x[SL::TN][4] = {};
        state_times_rows(x, p, q.X[1], nk); // (K dS)^T, the warp's tokens
        bf16 *Ug = w.dUb + (t0 * z.Hv + p.h) * dv + p.b0 + p.col(0);
        const int urs = (int)ors; // a row of dU (int: a chunk's rows fit)
        const auto epilogue = [&](auto full) { // dU = Ds (K dS) + its local part, to w.dUb
#pragma unroll
            for (int nt = 0; nt < SL::TN; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = p.tok(nt, e), v = p.col(e);
                    x[nt][e] = full.v || (j < L && v < p.nb)
                                   ? q.D[j] * x[nt][e] + q.V[j * SH::LDV + v]
                                   : 0.0f;
                }
            put_tokens<FULL && decltype(full)::v>(Ug, urs, x, p, L);
        };
        if (keys && L == CH)
            epilogue(flag<true>{});
        else
            epilogue(flag<false>{});
        put_us(x, p);
        __syncthreads(); // Us
        uint32_t da[4][4], oa[4][4];
#pragma unroll
        for (int kt = 0; kt < 4; kt++) {
            ldsm_x4(da[kt], a_addr(p.Us, LDU, 0, 16 * kt, p.lane));
            // (Es dO)^T's fragment: dO's block by .trans, a token's pair scaled by its e^G
            ldsm_x4_t(oa[kt], at_addr(q.O, SH::LDO, p.v0, 16 * kt, p.lane));
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int i = 16 * kt + 2 * p.t + 8 * (r >> 1);
                oa[kt][r] = M16::pack(lo_of(oa[kt][r]) * q.E[i], hi_of(oa[kt][r]) * q.E[i + 1]);
            }
        }
#pragma unroll
        for (int j = 0; j < SL::KJ; j++) // its keys: dS^T <- e^G_L dS^T + (Es dO)^T Q - dU^T W
            if (SL::KJ * p.ks + j < nk) {
                float aq[2][4] = {}, aw[2][4] = {};
                times_rows(aq, oa, q.X[2], ldq, SL::KJ * p.ks + j, p.lane);
                times_rows(aw, da, q.X[0], ldq, SL::KJ * p.ks + j, p.lane);
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        dS[2 * j + r][e] = eL * dS[2 * j + r][e] + aq[r][e] - aw[r][e];
            }
        cur = nxt;
    }
}

// The kernels' offsets within a chunk's rows are int.
loom_status pass_fits(loom_ctx *ctx, const char *op, const geo &z) {
    if ((int64_t)CH * z.Hv * (z.dv > z.dk ? z.dv : z.dk) < INT32_MAX)
        return LOOM_OK;
    return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                     "cuda %s: %lld value heads of %lld columns are past the bf16 state "
                     "passes' 32-bit offsets (use fp32)",
                     op, (long long)z.Hv, (long long)z.dv);
}

// Units a block (a block a multiprocessor: the ring's shared memory). Two
// (sharing the chunk's staged rows) where that still gives half the
// multiprocessors a block, else one: twice the blocks for few heads and
// documents. Four (FULL) where blocks of two would take more than one wave:
// a chunk's step takes about 1.4x as long with four units of four warps as
// with two of eight (an H200, 0.8B's layers: 3.8 against 2.8 us forward,
// 5.3 against 3.6 backward), half as many steps in a row.
loom_status pick_nu(loom_ctx *ctx, const char *op, const geo &z, int *nu) {
    int dev = 0, sms = 0;
    loom_status st = check(ctx, cudaGetDevice(&dev), op);
    if (!st)
        st = check(ctx, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), op);
    if (!st)
        st = pass_fits(ctx, op, z);
    const auto blocks = [&](int u) { return z.ndocs * z.Hv * ((z.dv + SW * u - 1) / (SW * u)); };
    *nu = full_dims_ok(z) && blocks(2) > sms ? 4 : 2 * blocks(2) >= sms ? 2 : 1;
    return st;
}

template <int NU> dim3 pass_grid(const geo &z) {
    return dim3((unsigned)z.ndocs, (unsigned)z.Hv,
                (unsigned)((z.dv + shape<NU>::BW - 1) / shape<NU>::BW));
}

template <int NU, int KS, bool FULL>
loom_status launch_fwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                       cudaStream_t s) {
    const size_t b = ring_bytes<NU, false>(z.dk);
    const auto kern = state_fwd_tc_kernel<NU, KS, FULL>;
    const loom_status st = smem_for(ctx, op, kern, b);
    if (st)
        return st;
    kern<<<pass_grid<NU>(z), threads<NU, KS>(), b, s>>>(z, w);
    return check_launch(ctx, op);
}

template <int NU, int KS, bool FULL>
loom_status launch_bwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                       const void *dout, cudaStream_t s) {
    const size_t b = ring_bytes<NU, true>(z.dk);
    const auto kern = state_bwd_tc_kernel<NU, KS, FULL>;
    const loom_status st = smem_for(ctx, op, kern, b);
    if (st)
        return st;
    kern<<<pass_grid<NU>(z), threads<NU, KS>(), b, s>>>(z, w, dout);
    return check_launch(ctx, op);
}

// A block of the passes: NU units of KS warps, FULL (constant dimensions).
template <int NU_, int KS_, bool FULL_> struct layout {
    static constexpr int NU = NU_, KS = KS_;
    static constexpr bool FULL = FULL_;
};
// f(layout) for z, the one choice both passes make: four units a block, two
// or one (pick_nu); eight warps a unit, but four for four units (512
// threads, 128 registers at most) and for two units of the general kernels
// (their registers).
template <class F>
loom_status with_layout(loom_ctx *ctx, const char *op, const geo &z, F f) {
    int nu = 1;
    const loom_status st = pick_nu(ctx, op, z, &nu);
    if (st)
        return st;
    if (full_dims_ok(z))
        return nu == 4   ? f(layout<4, 4, true>())
               : nu == 2 ? f(layout<2, 8, true>())
                         : f(layout<1, 8, true>());
    return nu == 2 ? f(layout<2, 4, false>()) : f(layout<1, 8, false>());
}
} // namespace

namespace loom_gdn {

loom_status tc_state_fwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         cudaStream_t s) {
    return with_layout(ctx, op, z, [&](auto l) {
        using L = decltype(l);
        return launch_fwd<L::NU, L::KS, L::FULL>(ctx, op, z, w, s);
    });
}

loom_status tc_state_bwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         const void *dout, loom_dtype dt, cudaStream_t s) {
    (void)dt; // bf16: use_tc's
    return with_layout(ctx, op, z, [&](auto l) {
        using L = decltype(l);
        return launch_bwd<L::NU, L::KS, L::FULL>(ctx, op, z, w, dout, s);
    });
}

} // namespace loom_gdn
