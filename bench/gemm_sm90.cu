// A probe of loom's own Hopper GEMM (src/backend/cuda/gemm_sm90.cuh says how it works; the
// library runs its c2-t128 configuration for LoRA's forward): how close does each variant come
// to cuBLASLt on the 8B shapes? Every variant is checked against cuBLASLt (all elements, the
// output poisoned first) and against float64 on some rows, then timed against cuBLASLt
// interleaved (same clocks). Last, LoRA's term U (s B)^T as one more k block of the same GEMM,
// against cuBLASLt's pair (U (s B)^T written, the base GEMM adding it).
// Exits 1 when a check fails. Results: bench/RESULTS.md, tenth round.
//
//   make CUDA=1 BUILD=build-cuda build-cuda/gemm_sm90
//   build-cuda/gemm_sm90 [group_m] [one]   (one: a single 4096^3 run of c2-t128, for a profiler)
#include <cuda.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cmath>
#include <vector>
#include <algorithm>
#include <cstring>
#include <map>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); exit(1); } } while (0)
#define CKL(x) do { cublasStatus_t e_ = (x); if (e_ != CUBLAS_STATUS_SUCCESS) { fprintf(stderr, "%s:%d %s: %d\n", __FILE__, __LINE__, #x, (int)e_); exit(1); } } while (0)

#include "../src/backend/cuda/gemm_sm90.cuh"
using namespace loom_sm90;

static int g_sms;
template <int STAGES, int CL, int EPI = 1, bool STRONG = false, int EPC = 0>
static void run_own(const __nv_bfloat16 *A, const __nv_bfloat16 *B, __nv_bfloat16 *D, int M, int N, int K, int gm, int grid_cap,
                    const __nv_bfloat16 *U = nullptr, const __nv_bfloat16 *SB = nullptr, int r = 0) {
    // the five tensor maps, encoded once per operand set (kept off the timed loop's host path)
    struct Maps { CUtensorMap a, b, d, u, sb; };
    static std::map<std::vector<uintptr_t>, Maps> cache;
    const std::vector<uintptr_t> key = {(uintptr_t)A, (uintptr_t)B, (uintptr_t)D, (uintptr_t)U, (uintptr_t)SB,
                                        (uintptr_t)M, (uintptr_t)N, (uintptr_t)K, (uintptr_t)r};
    auto it = cache.find(key);
    if (it == cache.end()) {
        Maps mp;
        bool ok = kmajor_map(&mp.a, A, M, K, K, BM) && kmajor_map(&mp.b, B, N, K, K, BN / CL) &&
                  kmajor_map(&mp.d, D, M, N, N, 64, 64);
        if (ok && U) ok = kmajor_map(&mp.u, U, M, r, r, BM) && kmajor_map(&mp.sb, SB, N, r, r, BN / CL);
        if (!U) { mp.u = mp.a; mp.sb = mp.b; }
        if (!ok) { fprintf(stderr, "cuTensorMapEncodeTiled failed (or the driver has none)\n"); exit(1); }
        it = cache.emplace(key, mp).first;
    }
    const Maps &mp = it->second;
    const size_t smem = sizeof(Smem<STAGES, EPC>) + 1024;
    static bool set = false;
    if (!set) { CK(cudaFuncSetAttribute(gemm_tn<STAGES, CL, EPI, STRONG, EPC>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)); set = true; }
    const int tiles = ((M + BM * CL - 1) / (BM * CL)) * ((N + BN - 1) / BN);
    int grid = std::min(tiles, (grid_cap > 0 ? grid_cap : g_sms) / CL) * CL;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid); cfg.blockDim = dim3(NTHREADS); cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CL; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, gemm_tn<STAGES, CL, EPI, STRONG, EPC>, mp.a, mp.b, mp.d, mp.u, mp.sb, U ? 1 : 0, 1.0f, D, M, N, K, N, gm));
}

struct Lt {
    cublasLtHandle_t h;
    void *ws;
    size_t wsz = 64 << 20;
    Lt() { CKL(cublasLtCreate(&h)); CK(cudaMalloc(&ws, wsz)); }
    // row-major D[M,N] = A[M,K] B[N,K]^T is column-major D^T = B A^T: m = N, n = M, k = K,
    // B transposed. Descriptors and the heuristic's algorithm made once per shape, as loom does.
    struct Plan { cublasLtMatmulDesc_t op; cublasLtMatrixLayout_t la, lb, ld; cublasLtMatmulAlgo_t algo; };
    std::map<std::vector<int>, Plan> plans;
    const Plan &plan(int M, int N, int K) {
        auto it = plans.find({M, N, K});
        if (it != plans.end()) return it->second;
        Plan p;
        CKL(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
        CKL(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
        CKL(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
        CKL(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, K, N, K));
        CKL(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, K, M, K));
        CKL(cublasLtMatrixLayoutCreate(&p.ld, CUDA_R_16BF, N, M, N));
        cublasLtMatmulPreference_t pref;
        CKL(cublasLtMatmulPreferenceCreate(&pref));
        CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
        cublasLtMatmulHeuristicResult_t res;
        int nres = 0;
        CKL(cublasLtMatmulAlgoGetHeuristic(h, p.op, p.la, p.lb, p.ld, p.ld, pref, 1, &res, &nres));
        cublasLtMatmulPreferenceDestroy(pref);
        if (nres < 1) { fprintf(stderr, "cuBLASLt has no algorithm for %d x %d x %d\n", M, N, K); exit(1); }
        p.algo = res.algo;
        return plans.emplace(std::vector<int>{M, N, K}, p).first->second;
    }
    void run(const void *A, const void *B, void *D, int M, int N, int K, float beta = 0.f) {
        const Plan &p = plan(M, N, K);
        float one = 1.f;
        CKL(cublasLtMatmul(h, p.op, &one, B, p.la, A, p.lb, &beta, D, p.ld, D, p.ld, &p.algo, ws, wsz, 0));
    }
};

__global__ void fill(__nv_bfloat16 *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t x = (uint32_t)i * 2654435761u ^ seed;
        x ^= x >> 15; x *= 2246822519u; x ^= x >> 13; x *= 3266489917u; x ^= x >> 16;
        p[i] = __float2bfloat16(((x & 0xFFFF) / 65536.f - 0.5f));
    }
}
__global__ void poison(__nv_bfloat16 *p, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        p[i] = __float2bfloat16(NAN);
}

static double relerr(const __nv_bfloat16 *x, const __nv_bfloat16 *ref, size_t n, size_t *nan) {
    std::vector<__nv_bfloat16> a(n), b(n);
    CK(cudaMemcpy(a.data(), x, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), ref, n * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0; *nan = 0;
    for (size_t i = 0; i < n; i++) {
        double u = __bfloat162float(a[i]), v = __bfloat162float(b[i]);
        if (std::isnan(u)) { (*nan)++; continue; }
        num += (u - v) * (u - v); den += v * v;
    }
    return sqrt(num / (den > 0 ? den : 1));
}

// float64 reference on a few rows
static double cpu_check(const __nv_bfloat16 *dA, const __nv_bfloat16 *dB, const __nv_bfloat16 *dD, int M, int N, int K,
                        const __nv_bfloat16 *dU = nullptr, const __nv_bfloat16 *dSB = nullptr, int r = 0) {
    std::vector<__nv_bfloat16> A((size_t)M * K), B((size_t)N * K), D((size_t)M * N), U((size_t)M * r), SB((size_t)N * r);
    if (r) {
        CK(cudaMemcpy(U.data(), dU, U.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(SB.data(), dSB, SB.size() * 2, cudaMemcpyDeviceToHost));
    }
    CK(cudaMemcpy(A.data(), dA, A.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(B.data(), dB, B.size() * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(D.data(), dD, D.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    int rows[] = {0, 1, 7, 8, 63, 64, 65, 127, 128, M / 2, M - 2, M - 1};
    for (int rr : rows) {
        if (rr < 0 || rr >= M) continue;
        for (int c = 0; c < N; c++) {
            double acc = 0;
            for (int k = 0; k < K; k++) acc += (double)__bfloat162float(A[(size_t)rr * K + k]) * __bfloat162float(B[(size_t)c * K + k]);
            for (int k = 0; k < r; k++) acc += (double)__bfloat162float(U[(size_t)rr * r + k]) * __bfloat162float(SB[(size_t)c * r + k]);
            double g = __bfloat162float(D[(size_t)rr * N + c]);
            if (std::isnan(g)) return INFINITY;
            num += (g - acc) * (g - acc); den += acc * acc;
        }
    }
    return sqrt(num / den);
}

int main(int argc, char **argv) {
    int gm = 8, failed = 0;
    if (argc > 1) {
        char *end = nullptr;
        const long v = strtol(argv[1], &end, 10);
        if (end == argv[1] || *end || v < 1 || v > 64 || (argc > 2 && strcmp(argv[2], "one")) || argc > 3) {
            fprintf(stderr, "usage: %s [group_m: 1..64, default 8] [one]\n", argv[0]);
            return 2;
        }
        gm = (int)v;
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    if (p.major != 9 || p.minor != 0) {
        fprintf(stderr, "%s is compute capability %d.%d: this probe is built for sm_90a (H100, H200) only\n", p.name, p.major, p.minor);
        return 2;
    }
    g_sms = p.multiProcessorCount;
    printf("%s, %d SMs, smem optin %zu\n", p.name, g_sms, (size_t)p.sharedMemPerBlockOptin);
    Lt lt;
    struct Shape { int M, N, K; const char *what; } shapes[] = {
        {200, 264, 136, "ragged"},
        {4096, 4096, 4096, "q/o fwd"}, {4096, 1024, 4096, "k/v fwd"}, {4096, 12288, 4096, "gate/up fwd"},
        {4096, 4096, 12288, "down fwd"}, {4096, 6144, 4096, "qkv fused"}, {8192, 8192, 8192, "big"},
    };
    size_t maxe = (size_t)8192 * 12288;
    __nv_bfloat16 *A, *B, *D, *R;
    CK(cudaMalloc(&A, maxe * 2)); CK(cudaMalloc(&B, maxe * 2)); CK(cudaMalloc(&D, maxe * 2)); CK(cudaMalloc(&R, maxe * 2));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    if (argc > 2 && !strcmp(argv[2], "one")) {
        const int M = 4096, N = 4096, K = 4096;
        fill<<<1024, 256>>>(A, (size_t)M * K, 1u);
        fill<<<1024, 256>>>(B, (size_t)N * K, 2u);
        for (int r = 0; r < 3; r++) run_own<4, 2, 2, false, 128>(A, B, D, M, N, K, gm, 0);
        CK(cudaDeviceSynchronize());
        printf("one: done\n");
        return 0;
    }
    typedef void (*own_fn)(const __nv_bfloat16 *, const __nv_bfloat16 *, __nv_bfloat16 *, int, int, int, int, int,
                           const __nv_bfloat16 *, const __nv_bfloat16 *, int);
    struct V { own_fn f; const char *name; } vars[] = {
        {run_own<4, 2, 1, true>, "c2-rc"},         // stores from registers, .release.cluster arrives
        {run_own<4, 2>, "c2"},                     // stores from registers
        {run_own<4, 2, 0>, "c2-ne"},               // no epilogue: the main loop alone
        {run_own<4, 2, 2, false, 128>, "c2-t128"}, // TMA stores, 128 columns a round (the one to take)
        {run_own<4, 1, 2, false, 128>, "c1-t128"}, // the same without clusters
    };
    printf("%-12s %5s %6s %6s %5s | %9s %9s | %8s %8s %6s | %s\n", "shape", "M", "N", "K", "var", "own ms", "lt ms", "own TF", "lt TF", "lt/own", "err vs lt / f64 own, lt");
    for (const Shape &sh : shapes) {
        const int M = sh.M, N = sh.N, K = sh.K;
        for (const V &v : vars) {
            fill<<<1024, 256>>>(A, (size_t)M * K, 1234u + M + (uint32_t)(v.f == vars[1].f));
            fill<<<1024, 256>>>(B, (size_t)N * K, 777u + N * 3 + K);
            poison<<<1024, 256>>>(D, (size_t)M * N);
            CK(cudaGetLastError());
            v.f(A, B, D, M, N, K, gm, 0, nullptr, nullptr, 0);
            lt.run(A, B, R, M, N, K);
            CK(cudaDeviceSynchronize());
            size_t nan = 0;
            const bool noepi = strstr(v.name, "-ne") != nullptr;
            double e = noepi ? 0 : relerr(D, R, (size_t)M * N, &nan);
            const bool f64 = !noepi && K <= 4096 && (size_t)N * K <= 64ull << 20;
            double e64 = f64 ? cpu_check(A, B, D, M, N, K) : -1, e64lt = f64 ? cpu_check(A, B, R, M, N, K) : -1;
            float t_own = 0, t_lt = 0;
            const int reps = (double)M * N * K > 1e10 ? 20 : 50;
            for (int pass = 0; pass < 2; pass++) {  // interleaved, so both see the same clocks
                for (int w = 0; w < 3; w++) { v.f(A, B, D, M, N, K, gm, 0, nullptr, nullptr, 0); lt.run(A, B, R, M, N, K); }
                float ms;
                CK(cudaEventRecord(e0));
                for (int r = 0; r < reps; r++) v.f(A, B, D, M, N, K, gm, 0, nullptr, nullptr, 0);
                CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
                t_own += ms / reps / 2;
                CK(cudaEventRecord(e0));
                for (int r = 0; r < reps; r++) lt.run(A, B, R, M, N, K);
                CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
                t_lt += ms / reps / 2;
            }
            // the same tiles' sums in the same order as cuBLASLt's so far: the bits agree
            if (nan || e > 1e-2 || e64 > 1e-2) { failed++; printf("FAIL: "); }
            double fl = 2.0 * M * N * K;
            printf("%-12s %5d %6d %6d %5s | %9.4f %9.4f | %8.1f %8.1f %6.3f | %.2e (%zu NaN) / %.2e %.2e\n", sh.what, M, N, K, v.name, t_own, t_lt,
                   fl / t_own / 1e9, fl / t_lt / 1e9, t_lt / t_own, e, nan, e64, e64lt);
            fflush(stdout);
        }
    }
    // LoRA's term inside the GEMM: D = A B^T + U (s B_lora)^T as one more k block, against
    // cuBLASLt's pair (U (s B)^T written, then the base GEMM adding it as C)
    const int r = 8;
    __nv_bfloat16 *U, *SB;
    CK(cudaMalloc(&U, (size_t)8192 * 64 * 2)); CK(cudaMalloc(&SB, (size_t)16384 * 64 * 2));
    printf("\nLoRA r=%d: own GEMM with the extra k block against cuBLASLt's two GEMMs\n", r);
    for (const Shape &sh : shapes) {
        const int M = sh.M, N = sh.N, K = sh.K;
        if (M > 4096) continue;
        fill<<<1024, 256>>>(A, (size_t)M * K, 11u + M);
        fill<<<1024, 256>>>(B, (size_t)N * K, 12u + N);
        fill<<<256, 256>>>(U, (size_t)M * r, 13u);
        fill<<<256, 256>>>(SB, (size_t)N * r, 14u);
        poison<<<1024, 256>>>(D, (size_t)M * N);
        auto own = [&] { run_own<4, 2, 2, false, 128>(A, B, D, M, N, K, gm, 0, U, SB, r); };
        auto pair = [&] { lt.run(U, SB, R, M, N, r); lt.run(A, B, R, M, N, K, 1.f); };
        own(); pair();
        CK(cudaDeviceSynchronize());
        size_t nan = 0;
        double e = relerr(D, R, (size_t)M * N, &nan);
        double e64 = K <= 4096 ? cpu_check(A, B, D, M, N, K, U, SB, r) : 0;
        if (nan || e > 1e-2 || e64 > 1e-2) { failed++; printf("FAIL: "); }
        float t_own = 0, t_lt = 0;
        for (int pass = 0; pass < 2; pass++) {
            for (int w = 0; w < 3; w++) { own(); pair(); }
            float ms;
            CK(cudaEventRecord(e0));
            for (int i = 0; i < 30; i++) own();
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
            t_own += ms / 30 / 2;
            CK(cudaEventRecord(e0));
            for (int i = 0; i < 30; i++) pair();
            CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
            t_lt += ms / 30 / 2;
        }
        printf("%-12s %5d %6d %6d | own %.4f ms, cuBLASLt pair %.4f ms, saved %.4f ms | err vs pair %.2e (%zu NaN), f64 %.2e\n",
               sh.what, M, N, K, t_own, t_lt, t_lt - t_own, e, nan, e64);
        fflush(stdout);
    }
    if (failed) printf("%d check(s) failed\n", failed);
    return failed ? 1 : 0;
}
