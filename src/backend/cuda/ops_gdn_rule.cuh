// Shared by the gated delta rule's kernels (ops_gdn_rule.cu, fp32 SIMT and
// the driver) and their tensor-core twins for bf16 (ops_gdn_tc.cu): the
// chunk's sizes, the shapes, the workspace's arrays, a block's chunk, and the
// launchers of the tensor-core kernels. Internal to the CUDA backend.
#ifndef LOOM_CUDA_OPS_GDN_RULE_CUH
#define LOOM_CUDA_OPS_GDN_RULE_CUH

#include "../cpu/cpu_gdn.h"
#include "../gdn_ws.h"
#include "ops_common.cuh"

namespace loom_gdn {
using namespace loom_cuda;

constexpr int CH = LOOM_GDN_CHUNK; // tokens per chunk
static_assert(CH == 64, "the chunk kernels' shared arrays are laid out for 64-token chunks");
static_assert(LOOM_GDN_WS_ARRAYS == 20, "ws_layout assigns 20 arrays");
constexpr int NT = 256; // threads per block
constexpr int WARPS = NT / 32;
constexpr int LDA = CH + 1; // row stride of the (CH, CH) shared matrices (no bank conflicts)
constexpr int BV = 32;      // dv columns per block of the state passes
constexpr int BO = 64;      // dv columns per block of out_kernel and dul_kernel
constexpr int MAX_DK = 256; // the widest key head (shared memory)

// Shapes. C = 2 Hk dk + Hv dv is qkv's row; grp = Hv / Hk value heads per key head;
// NC = the most chunks the documents can make (the grids' x).
struct geo {
    int64_t T, Hk, Hv, dk, dv, C, grp, ndocs, NC;
};

// The workspace (loom_cuda_gdn_scratch_bytes; gdn_ws.h's arrays), fp32
// unless said, some of it in the caller's keep buffer. Rows of (T, H, d)
// tensors are token-major, as o.
struct gdn_ws {
    int32_t *cfirst;  // (ndocs + 1): a document's first chunk; cfirst[ndocs] the chunks
    int32_t *ct0;     // (NC): a chunk's first token
    int32_t *clen;    // (NC): its length
    float *qn, *kn;   // (T, Hk, dk): q / |q| / sqrt(dk), k / |k| (fp32 kernels)
    float *rq, *rk;   // (T, Hk): those rows' factors 1 / |q| / sqrt(dk), 1 / |k| (tc:
                      // qn = qkv's bf16 q by rq, l2_fwd's product, where a kernel needs it)
    float *G;         // (T, Hv): the log decay since the chunk's start (inclusive)
    float *A;         // (NC, Hv, CH, CH): strictly lower beta_i k_i.k_j M_ij (fp32 kernels)
    float *W;         // (T, Hv, dk): X's right part
    float *U0, *U;    // (T, Hv, dv): X's left part; U0 - W S0
    float *S;         // (NC, Hv, dk, dv): each chunk's starting state
    float *dS;        // (NC, Hv, dk, dv): the gradient of each chunk's end state (bwd)
    float *dU;        // (T, Hv, dv): the gradient of U (bwd; tc: its local part, dul's)
    float *dqh, *dkh; // (T, Hv, dk): the normalised q's and k's gradients per value head (bwd)
    // The tensor-core kernels' bf16 operands: qn and kn rounded (T, Hk, dk);
    // W, U and S, which those kernels keep as bf16 in their arrays (Wh, Uh,
    // Sb: only ever operands of products, which round them to bf16 anyway);
    // Tb (NC, Hv, CH, CH): T = (I + A)^-1 rounded, prep's for chunk_bwd's;
    // U0b: U0 rounded, chunk_bwd's operand; and the backward's dS and
    // complete dU rounded (dSb in dS's array, dUb), state_bwd's for chunk_bwd,
    // which rounds both to bf16 where it uses them (dS's sum with S0 too).
    __nv_bfloat16 *qb, *kb, *Wh, *Uh, *Sb, *Tb, *U0b, *dSb, *dUb;
};
// The chunk of block x (false for the grid's spare blocks: NC is a bound).
__device__ __forceinline__ bool chunk_of(const geo &z, const gdn_ws &w, int64_t c, int64_t *t0,
                                         int *L) {
    if (c >= w.cfirst[z.ndocs])
        return false;
    *t0 = w.ct0[c];
    *L = w.clen[c];
    return true;
}

__host__ __device__ inline int64_t pad16(int64_t d) { return (d + 15) / 16 * 16; }

// Fills shared dst (rows [0, R) of ld elements, columns [0, W)) with get(i,
// c), each thread issuing its loads 16 at a time before storing any: a
// staging loop with one load in flight a thread is latency-bound (these
// kernels run a block or two an SM). A thread's (i, c) advance by NT
// elements with one division at the start: a division an element made the
// staging most of the state passes' instructions (ncu on an H200). Ends
// without a barrier.
__device__ __forceinline__ void put(float *p, float v) { *p = v; }
__device__ __forceinline__ void put(__nv_bfloat16 *p, float v) { *p = __float2bfloat16_rn(v); }
template <typename T, typename F>
__device__ __forceinline__ void fill(T *dst, int ld, int R, int W, F get) {
    constexpr int B = 16;
    const int di = NT / W, dc = NT % W;
    int i = (int)threadIdx.x / W, c = (int)threadIdx.x % W;
    while (i < R) {
        float v[B];
        int at[B];
#pragma unroll
        for (int u = 0; u < B; u++) {
            at[u] = i < R ? i * ld + c : -1;
            v[u] = i < R ? get(i, c) : 0.0f;
            i += di, c += dc;
            if (c >= W)
                c -= W, i++;
        }
#pragma unroll
        for (int u = 0; u < B; u++)
            if (at[u] >= 0)
                put(dst + at[u], v[u]);
    }
}

// A chunk's G (g's cumulative sum from its start, row i of (T, Hv) at (t0 +
// i) Hv + h) into shared Gs (zero past L) and the workspace's G: g loaded by
// all threads, summed in order by thread 0 (a loop of global loads and
// stores in one thread is a chain of round trips: no load moves past a
// store to G). All threads; ends with a barrier before G's stores.
__device__ __forceinline__ void chunk_g(const float *g, int64_t t0, int L, int64_t Hv, int64_t h,
                                        float *Gs, float *G) {
    for (int i = threadIdx.x; i < CH; i += NT)
        Gs[i] = i < L ? g[(t0 + i) * Hv + h] : 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
        float acc = 0.0f;
        for (int i = 0; i < L; i++)
            Gs[i] = acc += Gs[i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < L; i += NT)
        G[(t0 + i) * Hv + h] = Gs[i];
}

// A chunk's vectors for chunk_bwd_kernel and its twin, zero past L: G, e^G,
// e^(G_L - G), beta (row i of (T, Hv) at (t0 + i) Hv + h), and SV, SK zeroed.
__device__ __forceinline__ void chunk_vectors(const float *G, const float *beta, int64_t t0,
                                              int L, int64_t Hv, int64_t h, float *Gs,
                                              float *Es, float *Dj, float *Bs, float *SV,
                                              float *SK) {
    const float GL = G[(t0 + L - 1) * Hv + h];
    for (int i = threadIdx.x; i < CH; i += NT) {
        const float Gi = i < L ? G[(t0 + i) * Hv + h] : 0.0f;
        Gs[i] = Gi;
        Es[i] = i < L ? expf(Gi) : 0.0f;
        Dj[i] = i < L ? expf(GL - Gi) : 0.0f;
        Bs[i] = i < L ? beta[(t0 + i) * Hv + h] : 0.0f;
        SV[i] = SK[i] = 0.0f;
    }
}

// The chunk's dg (dG's reverse cumulative sum, as G_i = g_0 + ... + g_i)
// and dbeta from shared DGs, DBE, by thread 0 (chunk_bwd_kernel and its twin).
__device__ __forceinline__ void put_dg_dbeta(const float *DGs, const float *DBE, int L,
                                             int64_t t0, int64_t Hv, int64_t h, float *dg,
                                             float *dbeta) {
    if (threadIdx.x != 0)
        return;
    float acc = 0.0f;
    for (int i = L - 1; i >= 0; i--) {
        acc += DGs[i];
        dg[(t0 + i) * Hv + h] = acc;
        dbeta[(t0 + i) * Hv + h] = DBE[i];
    }
}

// Whether the bf16 path's tensor-core kernels take this shape (their shared
// memory holds dk up to 128).
inline bool use_tc(loom_dtype dt, int64_t dk) { return loom_gdn_ws_tc(dt, dk); }

// The dynamic shared memory a kernel is launched with (refused past the device's opt-in).
template <typename K>
inline loom_status smem_for(loom_ctx *ctx, const char *op, K *kern, size_t bytes) {
    int dev = 0, optin = 0;
    loom_status st = check(ctx, cudaGetDevice(&dev), op);
    if (!st)
        st = check(
            ctx, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), op);
    if (st)
        return st;
    if (bytes + 1024 > (size_t)optin)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda %s: a block needs %zu bytes of shared memory, the device gives %d",
                         op, bytes, optin);
    return check(
        ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
        op);
}

// The q and k normalisation (ops_gdn_l2.cu), launched on s: the forward's
// rq, rk, qb, kb (and qn, kn where w has them), the backward's d of the raw
// q and k from w.dqh, w.dkh into dqkv.
loom_status l2_fwd(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt, const geo &z,
                   const gdn_ws &w, cudaStream_t s);
loom_status l2_bwd(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt, const geo &z,
                   const gdn_ws &w, void *dqkv, cudaStream_t s);

// The tensor-core kernels (ops_gdn_tc.cu), launched on s: prep_kernel's,
// out_kernel's, dul_kernel's, the two state passes' and chunk_bwd_kernel's twins.
loom_status tc_prep(loom_ctx *ctx, const char *op, const void *qkv, loom_dtype dt,
                    const float *g, const float *beta, const geo &z, const gdn_ws &w,
                    cudaStream_t s);
loom_status tc_out(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w, loom_dtype dt,
                   void *o, cudaStream_t s);
loom_status tc_dul(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                   const void *dout, loom_dtype dt, cudaStream_t s);
loom_status tc_state_fwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         cudaStream_t s);
loom_status tc_state_bwd(loom_ctx *ctx, const char *op, const geo &z, const gdn_ws &w,
                         const void *dout, loom_dtype dt, cudaStream_t s);
loom_status tc_chunk_bwd(loom_ctx *ctx, const char *op, const void *qkv, const void *dout,
                         loom_dtype dt, const float *beta, const geo &z, const gdn_ws &w,
                         void *dqkv, float *dg, float *dbeta, cudaStream_t s);

} // namespace loom_gdn

#endif // LOOM_CUDA_OPS_GDN_RULE_CUH
