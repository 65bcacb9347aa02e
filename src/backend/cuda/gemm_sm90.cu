// The forward projection with LoRA's term in one Hopper GEMM (gemm_sm90.cuh):
// y = x W^T + s u B^T, bf16. Against cuBLASLt's pair (u B^T written, then the
// base GEMM adding it as C) it saves one write and one read of y; the base
// part alone runs at cuBLASLt's speed (bench/gemm_sm90.cu, bench/RESULTS.md).
// Built for sm_90a only: loom_cuda_gemm_lora_ok says no on other devices.
#include "gemm_sm90.cuh"
#include "ops_common.cuh"

using namespace loom_cuda;

namespace {

constexpr int STAGES = 4, CL = 2, EPC = 128, GROUP_M = 8;
#define LORA_KERNEL loom_sm90::gemm_tn<STAGES, CL, 2, false, EPC>
constexpr size_t SMEM = sizeof(loom_sm90::Smem<STAGES, EPC>) + 1024;  // + alignment to 1024 bytes

// Per device ordinal: 0 unknown, 1 usable (sm_90, enough shared memory, the
// kernel's limit raised), -1 not. Device count bounded by the array.
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
            cudaFuncSetAttribute(LORA_KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM) ==
                cudaSuccess) {
            g_sms[*dev] = p.multiProcessorCount;
            st = 1;
        }
        cudaGetLastError(); /* a refusal above is not an error of the next launch */
    }
    return st == 1;
}

bool a16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* TMA: 16-byte aligned bases and row strides; one k block holds the rank */
bool operands_ok(loom_dtype dtype, int64_t T, int64_t N, int64_t K, const void *x, const void *W,
                 const void *u, int64_t ldu, const void *b, int64_t r, const void *y) {
    return dtype == LOOM_BF16 && T > 0 && N > 0 && K > 0 && T < INT32_MAX && N < INT32_MAX &&
           K < INT32_MAX && N % 8 == 0 && K % 8 == 0 && r >= 8 && r <= loom_sm90::BK && r % 8 == 0 &&
           ldu >= r && ldu % 8 == 0 && a16(x) && a16(W) && a16(u) && a16(b) && a16(y);
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
    CUtensorMap tx, tw, ty, tu, tb;
    if (!loom_sm90::kmajor_map(&tx, x, T, K, K, BM) || !loom_sm90::kmajor_map(&tw, W, N, K, K, BN / CL) ||
        !loom_sm90::kmajor_map(&ty, y, T, N, N, 64, 64) || !loom_sm90::kmajor_map(&tu, u, T, r, ldu, BM) ||
        !loom_sm90::kmajor_map(&tb, b, N, r, r, BN / CL))
        return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm_lora: the driver refused a tensor map");
    const int64_t tiles = ((T + BM * CL - 1) / (BM * CL)) * ((N + BN - 1) / BN);
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
    return check(ctx,
                 cudaLaunchKernelEx(&cfg, LORA_KERNEL, tx, tw, ty, tu, tb, 1, s, (__nv_bfloat16 *)y, (int)T,
                                    (int)N, (int)K, (int)N, GROUP_M),
                 "gemm_lora");
}
