// A Hopper GEMM (sm_90a) in bf16 with fp32 accumulation: D[M,N] = sum over up to MAXSEG k
// segments of A_s B_s^T (B_s[N,K_s] K-major, the forward projections' layout; LoRA's term
// (su U) B_l^T is one more segment of one k block, columns past r read as zero) or of A_s B_s
// (B_s[K_s,N] N-major: the input gradients dy W, LoRA's du A among them). A_s is K-major.
//
// TMA loads under the 128-byte swizzle complete on mbarriers (STAGES deep); one producer
// warpgroup issues them, two consumer warpgroups run wgmma m64n256k16 on 64 x 256 halves of a
// 128 x 256 tile; the grid is persistent (tiles in groups of gm m tiles); clusters of CL CTAs
// along M share the B tile by multicast. Epilogue (EPI): 2 = the tile staged in shared memory
// (128-byte swizzle, 64 x 64 boxes, EPC columns a round) and written by TMA stores that finish
// while the next tile runs; 1 = stores from registers; 0 = none (a diagnostic). STRONG: release
// stages with .release.cluster arrives (slower: a MEMBAR.ALL.GPU each; kept for the probe).
//
// SKIP: a segment whose K ends inside a k block runs only that block's k16 steps that hold data
// (LoRA's rank 8: one of four).
//
// XN (the probe's dxn8 mode alone; 0 everywhere else, where it compiles to nothing): the share of
// the work that forming LoRA's du = dy B inside the input-gradient sums would add, one more n = 8
// product per k16 step of the A tile and a fixed tile. 1: wgmma m64n8k16 on the consumers (a tile
// after the stages); 2: mma.sync m16n8k16 on the producer warpgroup's idle warps 1-3, which also
// release each stage. Sustained on an 8B layer's sums: 9.3-9.7% and 44% slower (bench/RESULTS.md,
// twentieth round).
//
// Used by the library (gemm_sm90.cu: <4, 2, 2, false, 128>, SKIP, with B K-major for the forward,
// N-major for the input gradients) and by the probe bench/gemm_sm90.cu (every variant, and EPI 3, the
// SwiGLU pair: measured no faster than its two GEMMs and the SwiGLU kernel, so not in the
// library). Device code needs -gencode arch=compute_90a,code=sm_90a.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>

namespace loom_sm90 {

// wgmma m64n256k16, bf16 -> f32, A and B from shared-memory descriptors; d += A B^T (d = when
// scale_d is 0); TB: B is N-major (transposed) in shared memory
template <int TB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, %131;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TB));
}

// wgmma m64n8k16, bf16 -> f32, both operands K-major in shared memory (the probe's XN)
__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[4], uint64_t da, uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
}

constexpr int BM = 128, BN = 256, BK = 64;
constexpr int NCONS = 2;
constexpr int NTHREADS = 128 * (NCONS + 1);

// EPC: output columns a consumer stages in shared memory per TMA store round (0: no staging)
// NEB: staging buffers per consumer (EPI 3: 2 lets a round's stores run while the next is staged)
template <int STAGES, int EPC, int NEB = 1> struct Smem {
    __nv_bfloat16 A[STAGES][BM * BK];
    __nv_bfloat16 B[STAGES][BN * BK];
    __nv_bfloat16 E[EPC ? NCONS * NEB : 1][EPC ? 64 * EPC : 8];
    uint64_t full[STAGES], empty[STAGES];
};

__device__ __forceinline__ uint32_t su32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t *b, uint32_t n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(su32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t *b, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t *b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(su32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity) {
    uint32_t ok;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(ok) : "r"(su32(b)), "r"(parity) : "memory");
    } while (!ok);
}
__device__ __forceinline__ void tma_2d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
                 ::"r"(su32(dst)), "l"((uint64_t)map), "r"(su32(bar)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void tma_2d_mc(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1, uint16_t mask) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;"
                 ::"r"(su32(dst)), "l"((uint64_t)map), "r"(su32(bar)), "r"(c0), "r"(c1), "h"(mask) : "memory");
}
// Arrive on CTA cta's copy of barrier b. The default semantics (release at CTA scope) suffice:
// what is released is this warpgroup's reads of the stage, done by wgmma (waited for) before.
// A .release.cluster arrive compiles to MEMBAR.ALL.GPU before each arrive (seen in the SASS).
template <bool STRONG>
__device__ __forceinline__ void mbar_arrive_cta(uint64_t *b, uint32_t cta) {
    if (STRONG)
        asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\nmbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n"
                     ::"r"(su32(b)), "r"(cta) : "memory");
    else
        asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\nmbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n"
                     ::"r"(su32(b)), "r"(cta) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() { uint32_t r; asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r)); return r; }
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, const void *src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"((uint64_t)map), "r"(su32(src)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void named_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t v) { asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory"); }
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
    __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t *>(&v);
}
// K-major operand, rows of 128 bytes under the 128-byte swizzle; 8-row groups 1024 bytes apart
__device__ __forceinline__ uint64_t desc_k(const void *p) {
    return (uint64_t)((su32(p) & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// N-major operand (BT): BK x 64 boxes of 128-byte rows under the 128-byte swizzle, 8192 bytes
// apart along N (the leading offset), 8-row groups along K 1024 bytes apart (the stride offset)
__device__ __forceinline__ uint64_t desc_n(const void *p) {
    return (uint64_t)((su32(p) & 0x3FFFF) >> 4) | ((uint64_t)(64 * BK * 2 >> 4) << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
__device__ __forceinline__ void fence_acc(float (&d)[128]) {
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// tile t -> (m tile, n tile): groups of GM m tiles, m fastest within a group
__device__ __forceinline__ void tile_mn(int t, int mt, int nt, int gm, int &m, int &n) {
    const int per = gm * nt, g = t / per, r = t % per;
    const int m0 = g * gm, rows = min(gm, mt - m0);
    m = m0 + r % rows;
    n = r / rows;
}

// D[M, N] = sum over segments s of A_s B_s^T (BT false: B_s is (N, K_s), K-major) or A_s B_s (BT
// true: B_s is (K_s, N), N-major), each A_s (M, K_s) K-major: the segments are one k loop, so one
// fp32 accumulator sums them all. The last segment's A tile is scaled by s_last in shared memory
// when that is not 1 (LoRA's forward: x W^T + (s U) B_l^T, B_l's columns past r read as zero).
//
// EPI 3 (SwiGLU; B K-major): two projections of the same input side by side, gate = sum A_s B_s^T
// and up = sum A_s B2_s^T. A tile's B holds BN / 2 rows of each (the gate's then the up's, from
// b and b2 at k offsets kb and kb2: LoRA's group u = [u_gate | u_up] meets B_gate at its columns
// 0..r-1 and B_up, read from k = -r, at r..2r-1), and the epilogue writes gate (d), up (d2) and
// Act::f(gate, up) (d3) of BN / 2 columns, each from its bf16 rounding.
constexpr int MAXSEG = 4;
// A segment of K columns: its k blocks (Args::nk), and the k16 steps of its last block that hold
// data (Args::kl; the rest is zero fill)
constexpr int k_blocks(long long K) { return (int)((K + BK - 1) / BK); }
constexpr int k_last(long long K) { return (int)((K - 1) % BK / 16 + 1); }
struct Args {
    CUtensorMap a[MAXSEG], b[MAXSEG], b2[MAXSEG], d, d2, d3;
    int nk[MAXSEG];  // k blocks of each segment
    int kl[MAXSEG];  // SKIP: k16 steps of the segment's last k block that hold data (1..BK / 16,
                     // 0 as BK / 16; the rest is TMA's zero fill: LoRA's rank-8 block holds 1 of 4)
    int kb[MAXSEG], kb2[MAXSEG];  // EPI 3: the B halves' k offsets
    int nseg;
    float s_last;
    __nv_bfloat16 *D;
    int M, N, ldd, gm;  // EPI 3: N is each output's width
};
struct NoAct {
    __device__ static float f(float g, float) { return g; }
};

// K-major B: the (BN / CL) x BK part this CTA loads; N-major B: BK x 64 boxes, BN / 64 a stage,
// this CTA's BN / 64 / CL of them; both multicast to the cluster
template <int CL, bool BT>
__device__ __forceinline__ void load_b(__nv_bfloat16 *dst, const CUtensorMap *map, uint64_t *bar, int k0, int n0, uint32_t rank) {
    if constexpr (BT) {
#pragma unroll
        for (int j = rank * (BN / 64 / CL); j < (int)(rank + 1) * (BN / 64 / CL); j++) {
            if constexpr (CL == 1) tma_2d(dst + j * 64 * BK, map, bar, n0 + j * 64, k0);
            else tma_2d_mc(dst + j * 64 * BK, map, bar, n0 + j * 64, k0, (uint16_t)((1u << CL) - 1));
        }
    } else if constexpr (CL == 1) {
        tma_2d(dst, map, bar, k0, n0);
    } else {
        tma_2d_mc(dst + rank * (BN / CL) * BK, map, bar, k0, n0 + rank * (BN / CL), (uint16_t)((1u << CL) - 1));
    }
}

// EPI 3: the gate's BN / 2 rows of W from b, the up's from b2; CL 2: one half each
template <int CL>
__device__ __forceinline__ void load_b2(__nv_bfloat16 *dst, const Args &p, int sg, uint64_t *bar, int k0, int n0, uint32_t rank) {
    static_assert(CL <= 2, "the halves are the cluster's parts");
    if constexpr (CL == 1) {
        tma_2d(dst, &p.b[sg], bar, k0 + p.kb[sg], n0);
        tma_2d(dst + (BN / 2) * BK, &p.b2[sg], bar, k0 + p.kb2[sg], n0);
    } else {
        tma_2d_mc(dst + rank * (BN / 2) * BK, rank ? &p.b2[sg] : &p.b[sg], bar, k0 + (rank ? p.kb2[sg] : p.kb[sg]), n0, 3);
    }
}

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// EPI: 0 none (the main loop alone, a diagnostic), 1 stores from registers, 2 staged in shared
// memory (128-byte swizzle, 64 x 64 boxes) and written by TMA stores, EPC columns a round; 3 the
// SwiGLU pair (above), staged as 2 with EPC = BN / 2
// SKIP: a segment's last k block runs only the k16 steps that hold data (Args::kl), outside the
// loop over the full blocks
template <int STAGES, int CL, int EPI, bool STRONG, int EPC, bool BT = false, class Act = NoAct, int NEB = 1, bool SKIP = false,
          int XN = 0>
__global__ void __launch_bounds__(NTHREADS, 1) gemm_sm90(const __grid_constant__ Args p) {
    static_assert(NEB == 1 || EPI == 3, "double-buffered staging: the SwiGLU pair's");
    static_assert(EPI != 3 || (!BT && EPC == BN / 2), "the SwiGLU pair: B K-major, one half a round");
    constexpr int TN = EPI == 3 ? BN / 2 : BN;  // output columns of a tile
    extern __shared__ uint8_t raw[];
    Smem<STAGES, EPC, NEB> &s = *reinterpret_cast<Smem<STAGES, EPC, NEB> *>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~(uintptr_t)1023);
    const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
    // a cluster of CL CTAs takes CL consecutive m tiles of one n tile; B is loaded in CL parts, each multicast to all
    const int M = p.M, N = p.N, mt = (M + BM - 1) / BM, nt = (N + TN - 1) / TN, mtc = (mt + CL - 1) / CL, tiles = mtc * nt;
    const int nseg = p.nseg;
    const uint32_t rank = CL > 1 ? cluster_rank() : 0;
    const int cid = blockIdx.x / CL, ncl = gridDim.x / CL;
    if (threadIdx.x == 0) {
        for (int i = 0; i < STAGES; i++) {
            mbar_init(&s.full[i], 1);
            mbar_init(&s.empty[i], NCONS * CL + (XN == 2 ? 3 : 0));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    if constexpr (CL > 1) cluster_sync(); else __syncthreads();
    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (tid == 0) {
            int stage = 0;
            uint32_t phase = 0;
            for (int t = cid; t < tiles; t += ncl) {
                int m, n;
                tile_mn(t, mtc, nt, p.gm, m, n);
                m = m * CL + rank;
                for (int sg = 0; sg < nseg; sg++) {
                    for (int kb = 0; kb < p.nk[sg]; kb++) {
                        mbar_wait(&s.empty[stage], phase ^ 1);
                        mbar_expect_tx(&s.full[stage], (BM + BN) * BK * 2);
                        tma_2d(s.A[stage], &p.a[sg], &s.full[stage], kb * BK, m * BM);
                        if constexpr (EPI == 3) load_b2<CL>(s.B[stage], p, sg, &s.full[stage], kb * BK, n * TN, rank);
                        else load_b<CL, BT>(s.B[stage], &p.b[sg], &s.full[stage], kb * BK, n * BN, rank);
                        if (++stage == STAGES) { stage = 0; phase ^= 1; }
                    }
                }
            }
        } else if constexpr (XN == 2) {
            if (tid >= 32) {
                // XN 2: the producer warpgroup's idle warps 1-3 run du = A b (n = 8, a fixed b) with
                // mma.sync from each stage's A tile (ldmatrix under the 128-byte swizzle), then release
                // the stage on this CTA's barrier
                const int w = tid / 32 - 1, lane = tid % 32;
                int stage = 0;
                uint32_t phase = 0;
                float xa[3][4] = {};
                const uint32_t b0 = 0x3c003c00u ^ (uint32_t)lane, b1 = 0xbc003c00u ^ (uint32_t)lane;
                for (int t = cid; t < tiles; t += ncl) {
                    for (int sg = 0; sg < nseg; sg++) {
                        for (int kb = 0; kb < p.nk[sg]; kb++) {
                            mbar_wait(&s.full[stage], phase);
                            const uint32_t base = su32(s.A[stage]);
#pragma unroll
                            for (int j = 0; j < 3; j++) {
                                const int mb = w + 3 * j;
                                if (mb >= BM / 16) break;
                                const int row = mb * 16 + (lane % 16);
#pragma unroll
                                for (int kk = 0; kk < BK / 16; kk++) {
                                    const int ch = kk * 2 + lane / 16;
                                    uint32_t a0, a1, a2, a3;
                                    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                                                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3)
                                                 : "r"(base + row * 128 + ((ch ^ (row % 8)) * 16)));
                                    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                                                 : "+f"(xa[j][0]), "+f"(xa[j][1]), "+f"(xa[j][2]), "+f"(xa[j][3])
                                                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
                                }
                            }
                            __syncwarp();
                            if (lane == 0) mbar_arrive(&s.empty[stage]);
                            if (++stage == STAGES) { stage = 0; phase ^= 1; }
                        }
                    }
                }
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < 3; j++) sum += xa[j][0] + xa[j][1] + xa[j][2] + xa[j][3];
                if (sum == 1234.5f) p.D[0] = __float2bfloat16(sum);
            }
        }
    } else {
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
        const int c = wg - 1, warp = tid / 32, lane = tid % 32;
        int stage = 0, eb = 0;
        uint32_t phase = 0;
        float d[128];
        // XN (a probe of what fusing LoRA's du = dy B into this GEMM would cost): one more
        // m64n8k16 product per k16 step, on an 8 x 64 tile placed after the stages
        __nv_bfloat16 *const xb = XN == 1 ? reinterpret_cast<__nv_bfloat16 *>(reinterpret_cast<uint8_t *>(&s) + ((sizeof(s) + 1023) & ~(size_t)1023)) : nullptr;
        float xd[XN == 1 ? 4 : 1] = {};
        if constexpr (XN == 1) {
            for (int i = threadIdx.x - 128; i < 8 * BK; i += 128 * NCONS) xb[i] = __float2bfloat16(0.01f * (i % 13) - 0.05f);
            fence_async_smem();
            named_sync(3, 128 * NCONS);
        }
        for (int t = cid; t < tiles; t += ncl) {
            int m, n;
            tile_mn(t, mtc, nt, p.gm, m, n);
            m = m * CL + rank;
            int prev = -1, first = 1;
            // one k block of KK k16 steps: wait for its stage, LoRA's scaling, the products, release
            auto block = [&](auto kk_const, bool scale) {
                constexpr int KK = decltype(kk_const)::value;
                mbar_wait(&s.full[stage], phase);
                if (scale) {  // LoRA's block: this warpgroup's rows of U times s
                    uint4 *q = reinterpret_cast<uint4 *>(s.A[stage] + c * 64 * BK);
                    const __nv_bfloat162 f = __float2bfloat162_rn(p.s_last);
                    for (int i = tid; i < 64 * BK / 8; i += 128) {
                        uint4 v = q[i];
                        __nv_bfloat162 *h = reinterpret_cast<__nv_bfloat162 *>(&v);
#pragma unroll
                        for (int e = 0; e < 4; e++) h[e] = __hmul2(h[e], f);
                        q[i] = v;
                    }
                    fence_async_smem();  // generic stores, read next by wgmma (the async proxy)
                    named_sync(1 + c, 128);
                }
                wg_fence();
                const __nv_bfloat16 *a = s.A[stage] + c * 64 * BK, *b = s.B[stage];
#pragma unroll
                for (int kk = 0; kk < KK; kk++)
                {
                    wgmma_m64n256k16<BT>(d, desc_k(a + kk * 16), BT ? desc_n(b + kk * 16 * 64) : desc_k(b + kk * 16),
                                         !(first && kk == 0));
                    if constexpr (XN == 1) wgmma_m64n8k16(xd, desc_k(a + kk * 16), desc_k(xb + kk * 16));
                }
                first = 0;
                wg_commit();
                wg_wait<1>();
                if (prev >= 0 && tid < CL) mbar_arrive_cta<STRONG>(&s.empty[prev], tid);
                prev = stage;
                if (++stage == STAGES) { stage = 0; phase ^= 1; }
            };
            for (int sg = 0; sg < nseg; sg++) {
                const bool scale = sg == nseg - 1 && p.s_last != 1.0f;
                const int kl = SKIP && p.kl[sg] > 0 ? p.kl[sg] : BK / 16, nfull = p.nk[sg] - (kl < BK / 16);
                for (int kb = 0; kb < nfull; kb++) block(std::integral_constant<int, BK / 16>(), scale);
                if constexpr (SKIP) {
                    if (kl == 1) block(std::integral_constant<int, 1>(), scale);
                    else if (kl == 2) block(std::integral_constant<int, 2>(), scale);
                    else if (kl == 3) block(std::integral_constant<int, 3>(), scale);
                }
            }
            wg_wait<0>();
            fence_acc(d);
            if constexpr (XN == 1) {  // keep the extra products alive
                if (xd[0] + xd[1] + xd[2] + xd[3] == 1234.5f) p.D[0] = __float2bfloat16(xd[0]);
                xd[0] = xd[1] = xd[2] = xd[3] = 0.f;
            }
            if (tid < CL) mbar_arrive_cta<STRONG>(&s.empty[prev], tid);
            if constexpr (EPI == 3) {  // gate, up, Act(gate, up): a round each of the tile's 64 x 128 (per consumer)
                const int rl = warp * 16 + lane / 4;
#pragma unroll
                for (int o = 0; o < 3; o++) {
                    __nv_bfloat16 *buf = s.E[c * NEB + (NEB > 1 ? eb++ % NEB : 0)];
                    const uint32_t E = su32(buf);
                    if (tid == 0) bulk_wait_read<NEB - 1>();  // the round that last used buf has read it
                    named_sync(1 + c, 128);
#pragma unroll
                    for (int jj = 0; jj < 16; jj++) {
                        float v[4];
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            v[e] = o < 2 ? d[4 * (jj + 16 * o) + e] : Act::f(bf16_round(d[4 * jj + e]), bf16_round(d[4 * (jj + 16) + e]));
                        const uint32_t at = E + (jj / 8) * 8192 + rl * 128 + (((jj % 8) ^ (lane / 4)) * 16) + (lane % 4) * 4;
                        st_shared(at, pack_bf16(v[0], v[1]));
                        st_shared(at + 8 * 128, pack_bf16(v[2], v[3]));
                    }
                    fence_async_smem();
                    named_sync(1 + c, 128);
                    if (tid == 0) {
                        const CUtensorMap *map = o == 0 ? &p.d : o == 1 ? &p.d2 : &p.d3;
#pragma unroll
                        for (int box = 0; box < 2; box++) tma_store_2d(map, buf + box * 4096, n * TN + box * 64, m * BM + c * 64);
                        bulk_commit();
                    }
                }
                continue;
            }
            if (EPI == 2) {
                const uint32_t E = su32(s.E[EPC ? c : 0]);
                const int rl = warp * 16 + lane / 4;  // rl & 7 == lane / 4
#pragma unroll
                for (int h = 0; h < (EPC ? BN / EPC : 1); h++) {
                    if (tid == 0) bulk_wait_read<0>();  // the last round's stores have read the staging
                    named_sync(1 + c, 128);
#pragma unroll
                    for (int jj = 0; jj < EPC / 8; jj++) {
                        const int j = h * (EPC / 8) + jj;
                        const uint32_t at = E + (jj / 8) * 8192 + rl * 128 + (((jj % 8) ^ (lane / 4)) * 16) + (lane % 4) * 4;
                        st_shared(at, pack_bf16(d[4 * j], d[4 * j + 1]));
                        st_shared(at + 8 * 128, pack_bf16(d[4 * j + 2], d[4 * j + 3]));
                    }
                    fence_async_smem();
                    named_sync(1 + c, 128);
                    if (tid == 0) {
#pragma unroll
                        for (int box = 0; box < EPC / 64; box++)
                            tma_store_2d(&p.d, s.E[EPC ? c : 0] + box * 4096, n * BN + h * EPC + box * 64, m * BM + c * 64);
                        bulk_commit();
                    }
                }
                continue;
            }
            if (EPI == 0) {  // diagnostic: the main loop alone (one store keeps the work alive)
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j < 128; j++) acc += d[j];
                if (acc == 1234.5f) p.D[0] = __float2bfloat16(acc);
                continue;
            }
            const int r0 = m * BM + c * 64 + warp * 16 + lane / 4;
            const int cb = n * BN + (lane % 4) * 2;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                const int col = cb + j * 8;
                if (col < N) {
                    if (r0 < M)
                        *reinterpret_cast<__nv_bfloat162 *>(p.D + (size_t)r0 * p.ldd + col) = __floats2bfloat162_rn(d[4 * j], d[4 * j + 1]);
                    if (r0 + 8 < M)
                        *reinterpret_cast<__nv_bfloat162 *>(p.D + (size_t)(r0 + 8) * p.ldd + col) = __floats2bfloat162_rn(d[4 * j + 2], d[4 * j + 3]);
                }
            }
        }
    }
    if (EPI >= 2 && wg > 0 && tid == 0) bulk_wait<0>();
    if constexpr (CL > 1) cluster_sync();
}

// ---- host ----
typedef CUresult (*encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                              const cuuint64_t *, const cuuint32_t *, const cuuint32_t *, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// The driver's tensor-map encoder through the runtime (no link to libcuda); NULL when absent.
static inline encode_fn tmap_encoder() {
    static encode_fn fn = [] {
        void *f = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess)
            f = nullptr;
        return (encode_fn)f;
    }();
    return fn;
}
// A bf16 row-major (rows, cols; ld) tensor read or written in boxes of box_rows x box_cols
// (box_cols * 2 = 128 bytes) under the 128-byte swizzle; out-of-range elements read as zero.
static inline bool kmajor_map(CUtensorMap *m, const void *p, int64_t rows, int64_t cols, int64_t ld, int box_rows,
                              int box_cols = BK) {
    encode_fn enc = tmap_encoder();
    if (!enc) return false;
    cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)ld * 2};
    cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows}, es[2] = {1, 1};
    return enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(p), dims, strides, box, es,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}


}  // namespace loom_sm90
