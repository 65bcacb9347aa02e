// The forward projection with LoRA's term in one Hopper GEMM (gemm_sm90.cuh):
// y = x W^T + s u B^T, bf16. Against cuBLASLt's pair (u B^T written, then the
// base GEMM adding it as C) it saves one write and one read of y; the base
// part alone runs at cuBLASLt's speed (bench/gemm_sm90.cu, bench/RESULTS.md).
// And the input gradients' sums, dx = sum of dy_s W_s (the projections that
// share an input, and LoRA's du A) as one GEMM with W N-major.
// Built for sm_90a only: the _ok functions say no on other devices.
#include "gemm_sm90.cuh"
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {

constexpr int STAGES = 4, CL = 2, EPC = 128, GROUP_M = 8;
constexpr bool SKIP = true; /* a segment's last k block: only the k16 steps that hold data */
#define FWD_KERNEL loom_sm90::gemm_sm90<STAGES, CL, 2, false, EPC, false, loom_sm90::NoAct, 1, SKIP>
#define DX_KERNEL loom_sm90::gemm_sm90<STAGES, CL, 2, false, EPC, true, loom_sm90::NoAct, 1, SKIP>
constexpr size_t SMEM = sizeof(loom_sm90::Smem<STAGES, EPC>) + 1024;  // + alignment to 1024 bytes

// Per device ordinal: 0 unknown, 1 usable (sm_90, enough shared memory, the
// kernels' limit raised), -1 not. Device count bounded by the array.
int g_state[64];
int g_sms[64];

bool device_ready(int *dev) {
    if (cudaGetDevice(dev) != cudaSuccess || *dev < 0 || *dev >= 64) return false;
    int &st = g_state[*dev];
    if (st == 0) {
        cudaDeviceProp p;
        st = -1;
        if (cudaGetDeviceProperties(&p, *dev) == cudaSuccess && p.major == 9 && p.minor == 0 &&
            p.sharedMemPerBlockOptin >= SMEM && loom_sm90::tmap_encoder() &&
            cudaFuncSetAttribute(FWD_KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM) ==
                cudaSuccess &&
            cudaFuncSetAttribute(DX_KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM) ==
                cudaSuccess) {
            g_sms[*dev] = p.multiProcessorCount;
            st = 1;
        }
        cudaGetLastError(); /* a refusal above is not an error of the next launch */
    }
    return st == 1;
}

bool dim_ok(int64_t n) { return n > 0 && n < INT32_MAX; }

/* TMA: 16-byte aligned bases and row strides; one k block holds the rank */
bool operands_ok(loom_dtype dtype, int64_t T, int64_t N, int64_t K, const void *x, const void *W,
                 const void *u, int64_t ldu, const void *b, int64_t r, const void *y) {
    return dtype == LOOM_BF16 && dim_ok(T) && dim_ok(N) && dim_ok(K) && N % 8 == 0 && K % 8 == 0 &&
           r >= 8 && r <= loom_sm90::BK && r % 8 == 0 && ldu >= r && ldu % 8 == 0 && aligned16(x) &&
           aligned16(W) && aligned16(u) && aligned16(b) && aligned16(y);
}

bool dx_operands_ok(loom_dtype dtype, int64_t T, int64_t N, int nseg, const void *const *a,
                    const int64_t *lda, const int64_t *K, const void *const *b, const void *d) {
    if (dtype != LOOM_BF16 || !dim_ok(T) || !dim_ok(N) || N % 8 || nseg < 1 ||
        nseg > loom_sm90::MAXSEG || !aligned16(d))
        return false;
    for (int i = 0; i < nseg; i++)
        if (!dim_ok(K[i]) || lda[i] < K[i] || lda[i] % 8 || !aligned16(a[i]) || !aligned16(b[i])) return false;
    return true;
}

/* the output's tiles, a cluster's (BM * CL rows, BN columns) each */
int64_t cluster_tiles(int64_t M, int64_t N) {
    using loom_sm90::BM;
    using loom_sm90::BN;
    return ((M + BM * CL - 1) / (BM * CL)) * ((N + BN - 1) / BN);
}

loom_status launch(loom_ctx *ctx, int dev, bool bt, loom_sm90::Args &a, void *stream, const char *what) {
    a.gm = GROUP_M;
    const int64_t tiles = cluster_tiles(a.M, a.N);
    const int64_t grid = (tiles < g_sms[dev] / CL ? tiles : g_sms[dev] / CL) * CL;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)grid);
    cfg.blockDim = dim3(loom_sm90::NTHREADS);
    cfg.dynamicSmemBytes = SMEM;
    cfg.stream = as_stream(stream);
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CL;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return check(ctx, bt ? cudaLaunchKernelEx(&cfg, DX_KERNEL, a) : cudaLaunchKernelEx(&cfg, FWD_KERNEL, a),
                 what);
}

}  // namespace

extern "C" bool loom_cuda_gemm_lora_ok(loom_dtype dtype, int64_t T, int64_t N, int64_t K, const void *x,
                                       const void *W, const void *u, int64_t ldu, const void *b, int64_t r,
                                       const void *y) {
    int dev;
    return operands_ok(dtype, T, N, K, x, W, u, ldu, b, r, y) && device_ready(&dev);
}

extern "C" loom_status loom_cuda_gemm_lora(loom_ctx *ctx, int64_t T, int64_t N, int64_t K, const void *x,
                                           const void *W, const void *u, int64_t ldu, const void *b, int64_t r,
                                           float s, void *y, void *stream) {
    int dev;
    if (!operands_ok(LOOM_BF16, T, N, K, x, W, u, ldu, b, r, y) || !device_ready(&dev))
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda gemm_lora: %lld x %lld x %lld, rank %lld is not for this kernel "
                         "(loom_cuda_gemm_lora_ok says why it is not taken)",
                         (long long)T, (long long)N, (long long)K, (long long)r);
    using loom_sm90::BM;
    using loom_sm90::BN;
    loom_sm90::Args a = {};
    if (!loom_sm90::kmajor_map(&a.a[0], x, T, K, K, BM) || !loom_sm90::kmajor_map(&a.b[0], W, N, K, K, BN / CL) ||
        !loom_sm90::kmajor_map(&a.d, y, T, N, N, 64, 64) || !loom_sm90::kmajor_map(&a.a[1], u, T, r, ldu, BM) ||
        !loom_sm90::kmajor_map(&a.b[1], b, N, r, r, BN / CL))
        return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm_lora: the driver refused a tensor map");
    a.nk[0] = loom_sm90::k_blocks(K);
    a.kl[0] = loom_sm90::k_last(K);
    a.nk[1] = 1;
    a.kl[1] = loom_sm90::k_last(r);
    a.nseg = 2;
    a.s_last = s;
    a.D = (__nv_bfloat16 *)y;
    a.M = (int)T;
    a.N = a.ldd = (int)N;
    return launch(ctx, dev, false, a, stream, "gemm_lora");
}

extern "C" bool loom_cuda_gemm_dx_ok(loom_dtype dtype, int64_t T, int64_t N, int nseg, const void *const *a,
                                     const int64_t *lda, const int64_t *K, const void *const *b, const void *d) {
    int dev;
    return dx_operands_ok(dtype, T, N, nseg, a, lda, K, b, d) && device_ready(&dev);
}

extern "C" loom_status loom_cuda_gemm_dx(loom_ctx *ctx, int64_t T, int64_t N, int nseg, const void *const *a,
                                         const int64_t *lda, const int64_t *K, const void *const *b, void *d,
                                         void *stream) {
    int dev;
    if (!dx_operands_ok(LOOM_BF16, T, N, nseg, a, lda, K, b, d) || !device_ready(&dev))
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "cuda gemm_dx: %lld x %lld in %d segments is not for this kernel "
                         "(loom_cuda_gemm_dx_ok says why it is not taken)",
                         (long long)T, (long long)N, nseg);
    loom_sm90::Args p = {};
    for (int i = 0; i < nseg; i++) {
        if (!loom_sm90::kmajor_map(&p.a[i], a[i], T, K[i], lda[i], loom_sm90::BM) ||
            !loom_sm90::kmajor_map(&p.b[i], b[i], K[i], N, N, loom_sm90::BK, 64))
            return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm_dx: the driver refused a tensor map");
        p.nk[i] = loom_sm90::k_blocks(K[i]);
        p.kl[i] = loom_sm90::k_last(K[i]);
    }
    if (!loom_sm90::kmajor_map(&p.d, d, T, N, N, 64, 64))
        return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm_dx: the driver refused a tensor map");
    p.nseg = nseg;
    p.s_last = 1.0f;
    p.D = (__nv_bfloat16 *)d;
    p.M = (int)T;
    p.N = p.ldd = (int)N;
    return launch(ctx, dev, true, p, stream, "gemm_dx");
}

extern "C" double loom_cuda_gemm_wave_fill(int64_t T, int64_t N) {
    int dev;
    if (!device_ready(&dev) || T <= 0 || N <= 0) return 0.0;
    const int64_t tiles = cluster_tiles(T, N), slots = g_sms[dev] / CL;
    return (double)tiles / (double)(((tiles + slots - 1) / slots) * slots);
}
