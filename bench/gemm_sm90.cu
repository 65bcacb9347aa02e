// A probe of loom's own Hopper GEMM (src/backend/cuda/gemm_sm90.cuh says how it works; the
// library runs its c2-t128 configuration for LoRA's forward): how close does each variant come
// to cuBLASLt on the 8B shapes? Every variant is checked against cuBLASLt (all elements, the
// output poisoned first) and against float64 on some rows, then timed against cuBLASLt
// interleaved (same clocks). Last, LoRA's term U (s B)^T as one more k block of the same GEMM,
// against cuBLASLt's pair (U (s B)^T written, the base GEMM adding it). Then the input gradients
// (B N-major), alone and as the sums of an 8B layer's projections with LoRA's du A; and the MLP's
// front (gate, up and SwiGLU) as one GEMM.
// Exits 1 when a check fails. Results: bench/RESULTS.md, tenth round.
//
//   make CUDA=1 BUILD=build-cuda build-cuda/gemm_sm90
//   build-cuda/gemm_sm90 [group_m] [one | dx | swiglu | swiglu1 | small | sustain | dxn8]   (one: a
//                                   single 4096^3 run of c2-t128, for a profiler; dx, swiglu, small:
//                                   that section alone; swiglu1: the SwiGLU pair and its reference
//                                   once each on 8B's LoRA shape, unchecked, for a profiler;
//                                   sustain: GEMM_SM90_SECONDS (30) of an 8B layer's forward;
//                                   dxn8: as long of its input-gradient sums with and without one
//                                   more m64n8k16 product per k16 step, LoRA's du = dy B's share)
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

// One k segment of D = sum A_s op(B_s): A_s (M, K; lda) K-major; B_s (N, K) K-major, or with BT
// (K, N) N-major
struct Seg { const __nv_bfloat16 *a; int lda, K; const __nv_bfloat16 *b; };

// The kernel's arguments, tensor maps encoded once per operand set (kept off the timed loop's host path);
// s: LoRA's scale, applied to the last segment's A tile in shared memory (1: none; the library
// passes alpha / r)
static const Args &args_for(bool bt, int CL, const std::vector<Seg> &segs, __nv_bfloat16 *D, int M, int N, int gm,
                            float s = 1.0f) {
    static std::map<std::vector<uintptr_t>, Args> cache;
    uint32_t sbits;
    memcpy(&sbits, &s, 4);
    std::vector<uintptr_t> key = {(uintptr_t)bt, (uintptr_t)CL, (uintptr_t)D, (uintptr_t)M, (uintptr_t)N, (uintptr_t)gm, sbits};
    for (const Seg &sg : segs) key.insert(key.end(), {(uintptr_t)sg.a, (uintptr_t)sg.lda, (uintptr_t)sg.K, (uintptr_t)sg.b});
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    Args p = {};
    bool ok = segs.size() <= MAXSEG && kmajor_map(&p.d, D, M, N, N, 64, 64);
    for (size_t i = 0; ok && i < segs.size(); i++) {
        const Seg &sg = segs[i];
        ok = kmajor_map(&p.a[i], sg.a, M, sg.K, sg.lda, BM) &&
             (bt ? kmajor_map(&p.b[i], sg.b, sg.K, N, N, BK, 64) : kmajor_map(&p.b[i], sg.b, N, sg.K, sg.K, BN / CL));
        p.nk[i] = k_blocks(sg.K);
        p.kl[i] = k_last(sg.K);
    }
    if (!ok) { fprintf(stderr, "cuTensorMapEncodeTiled failed (or the driver has none)\n"); exit(1); }
    p.nseg = (int)segs.size();
    p.s_last = s;
    p.D = D; p.M = M; p.N = N; p.ldd = N; p.gm = gm;
    return cache.emplace(key, p).first->second;
}

template <int STAGES, int CL, int EPI, bool STRONG, int EPC, bool BT, class Act = NoAct, int NEB = 1, bool SKIP = false, int XN = 0>
static void launch(const Args &p, int grid_cap) {
    // (XN: an 8 x 64 tile after the stages, 1024-aligned)
    const size_t smem = XN ? ((sizeof(Smem<STAGES, EPC, NEB>) + 1023) & ~(size_t)1023) + 2048 : sizeof(Smem<STAGES, EPC, NEB>) + 1024;
    auto kern = gemm_sm90<STAGES, CL, EPI, STRONG, EPC, BT, Act, NEB, SKIP, XN>;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(NTHREADS); cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = CL; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at; cfg.numAttrs = 1;
    static int slots = 0;  // clusters resident at once
    if (!slots) {
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        cfg.gridDim = dim3(g_sms / CL * CL);
        CK(cudaOccupancyMaxActiveClusters(&slots, kern, &cfg));
        if (slots < 1) { fprintf(stderr, "no cluster of %d fits\n", CL); exit(1); }
        if (slots * CL != g_sms) printf("(clusters of %d: %d resident, %d of %d SMs)\n", CL, slots, slots * CL, g_sms);
    }
    const int tn = EPI == 3 ? BN / 2 : BN;
    const int tiles = ((p.M + BM * CL - 1) / (BM * CL)) * ((p.N + tn - 1) / tn);
    const int cap = std::min(slots, (grid_cap > 0 ? grid_cap : g_sms) / CL);
    cfg.gridDim = dim3(std::min(tiles, cap) * CL);
    CK(cudaLaunchKernelEx(&cfg, kern, p));
}

template <int STAGES, int CL, int EPI = 1, bool STRONG = false, int EPC = 0, bool SKIP = false>
static void run_own(const __nv_bfloat16 *A, const __nv_bfloat16 *B, __nv_bfloat16 *D, int M, int N, int K, int gm, int grid_cap,
                    const __nv_bfloat16 *U = nullptr, const __nv_bfloat16 *SB = nullptr, int r = 0, float s = 1.0f) {
    std::vector<Seg> segs = {{A, K, K, B}};
    if (U) segs.push_back({U, r, r, SB});
    launch<STAGES, CL, EPI, STRONG, EPC, false, NoAct, 1, SKIP>(args_for(false, CL, segs, D, M, N, gm, s), grid_cap);
}

// the input-gradient form: D = sum A_s B_s, B_s N-major (the library's configuration; XN: the
// extra m64n8k16 product per k16 step that fusing LoRA's du = dy B in would add; SKIP as the
// library has it)
template <int XN = 0, bool SKIP = false>
static void run_dx(const std::vector<Seg> &segs, __nv_bfloat16 *D, int M, int N, int gm) {
    launch<4, 2, 2, false, 128, true, NoAct, 1, SKIP, XN>(args_for(true, 2, segs, D, M, N, gm), 0);
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
    // nn: row-major D = A[M,K] B[K,N] (B N-major), A with row stride lda (0: K)
    const Plan &plan(int M, int N, int K, bool nn = false, int lda = 0) {
        if (!lda) lda = K;
        auto it = plans.find({M, N, K, nn, lda});
        if (it != plans.end()) return it->second;
        Plan p;
        CKL(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = nn ? CUBLAS_OP_N : CUBLAS_OP_T, n_ = CUBLAS_OP_N;
        CKL(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
        CKL(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &n_, sizeof n_));
        if (nn) CKL(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, N, K, N));
        else CKL(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, K, N, K));
        CKL(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, K, M, lda));
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
        return plans.emplace(std::vector<int>{M, N, K, nn, lda}, p).first->second;
    }
    void run(const void *A, const void *B, void *D, int M, int N, int K, float beta = 0.f, bool nn = false, int lda = 0,
             float alpha = 1.f) {
        const Plan &p = plan(M, N, K, nn, lda);
        CKL(cublasLtMatmul(h, p.op, &alpha, B, p.la, A, p.lb, &beta, D, p.ld, D, p.ld, &p.algo, ws, wsz, 0));
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

// Mean ms of own() and ref(), interleaved (two passes of reps calls each, after a warm-up of
// three of each), so both see the same clocks
template <class F, class G>
static void time_pair(F own, G ref, int reps, cudaEvent_t e0, cudaEvent_t e1, float *t_own, float *t_ref) {
    *t_own = *t_ref = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int w = 0; w < 3; w++) { own(); ref(); }
        float ms;
        CK(cudaEventRecord(e0));
        for (int r = 0; r < reps; r++) own();
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
        *t_own += ms / reps / 2;
        CK(cudaEventRecord(e0));
        for (int r = 0; r < reps; r++) ref();
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
        *t_ref += ms / reps / 2;
    }
}

// float64 reference of D = sum A_s B_s (B_s N-major) on a few rows
static double cpu_check_dx(const std::vector<Seg> &segs, const __nv_bfloat16 *dD, int M, int N) {
    const int rows[] = {0, 1, 63, 64, 127, 128, M / 2 + 3, M - 1};
    std::vector<double> ref((size_t)8 * N, 0.0);
    for (const Seg &sg : segs) {
        std::vector<__nv_bfloat16> A((size_t)M * sg.lda), B((size_t)sg.K * N);
        CK(cudaMemcpy(A.data(), sg.a, A.size() * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(B.data(), sg.b, B.size() * 2, cudaMemcpyDeviceToHost));
        for (int i = 0; i < 8; i++) {
            if (rows[i] < 0 || rows[i] >= M) continue;
            for (int k = 0; k < sg.K; k++) {
                const double a = __bfloat162float(A[(size_t)rows[i] * sg.lda + k]);
                for (int c = 0; c < N; c++) ref[(size_t)i * N + c] += a * __bfloat162float(B[(size_t)k * N + c]);
            }
        }
    }
    std::vector<__nv_bfloat16> D((size_t)M * N);
    CK(cudaMemcpy(D.data(), dD, D.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int i = 0; i < 8; i++) {
        if (rows[i] < 0 || rows[i] >= M) continue;
        for (int c = 0; c < N; c++) {
            const double g = __bfloat162float(D[(size_t)rows[i] * N + c]), v = ref[(size_t)i * N + c];
            if (std::isnan(g)) return INFINITY;
            num += (g - v) * (g - v); den += v * v;
        }
    }
    return sqrt(num / den);
}

// The input gradients, D = sum A_s B_s with B_s N-major: alone against cuBLASLt's NN GEMM, and the
// sums an 8B layer takes (LoRA's du A among them) against cuBLASLt's sequence (the LoRA term
// written, then one GEMM a projection adding to it). Returns the number of failed checks.
static int dx_section(Lt &lt, int gm, cudaEvent_t e0, cudaEvent_t e1) {
    int failed = 0;
    const size_t big = (size_t)4096 * 12288;
    __nv_bfloat16 *buf[8], *D, *R;
    for (int i = 0; i < 8; i++) { CK(cudaMalloc(&buf[i], big * 2)); fill<<<1024, 256>>>(buf[i], big, 100u + i); }
    CK(cudaMalloc(&D, big * 2)); CK(cudaMalloc(&R, big * 2));
    struct Case { const char *what; int M, N; std::vector<Seg> segs; };
    const int T = 4096, H = 4096, KV = 1024, I = 12288;
    std::vector<Case> cases = {
        {"ragged", 200, 264, {{buf[0], 136, 136, buf[1]}}},
        {"q/o dx", T, H, {{buf[0], H, H, buf[1]}}},
        {"k/v dx", T, H, {{buf[0], KV, KV, buf[1]}}},
        {"gate/up dx", T, H, {{buf[0], I, I, buf[1]}}},
        {"down dx", T, I, {{buf[0], H, H, buf[1]}}},
        {"ragged sum", 333, 520, {{buf[0], 1000, 1000, buf[1]}, {buf[2], 72, 40, buf[3]}, {buf[4], 24, 24, buf[5]}}},
        {"q+k+v+lora", T, H, {{buf[6], 24, 24, buf[7]}, {buf[0], H, H, buf[1]}, {buf[2], KV, KV, buf[3]}, {buf[4], KV, KV, buf[5]}}},
        {"gate+up+lora", T, H, {{buf[6], 16, 16, buf[7]}, {buf[0], I, I, buf[1]}, {buf[2], I, I, buf[3]}}},
        {"o+lora", T, H, {{buf[6], 8, 8, buf[7]}, {buf[0], H, H, buf[1]}}},
        {"down+lora", T, I, {{buf[6], 8, 8, buf[7]}, {buf[0], H, H, buf[1]}}},
        // Qwen3-4B (H 2560, I 9728): 10 n tiles of 256, 2.4 waves of 66 clusters
        {"4B q+k+v+lora", T, 2560, {{buf[6], 24, 24, buf[7]}, {buf[0], H, H, buf[1]}, {buf[2], KV, KV, buf[3]}, {buf[4], KV, KV, buf[5]}}},
        {"4B gate+up+lora", T, 2560, {{buf[6], 16, 16, buf[7]}, {buf[0], 9728, 9728, buf[1]}, {buf[2], 9728, 9728, buf[3]}}},
        {"4B o+lora", T, 2560, {{buf[6], 8, 8, buf[7]}, {buf[0], H, H, buf[1]}}},
        {"4B down+lora", T, 9728, {{buf[6], 8, 8, buf[7]}, {buf[0], 2560, 2560, buf[1]}}},
    };
    const char *only = getenv("GEMM_SM90_ONLY");  // a prefix of the cases' names to run
    printf("\ninput gradients: own N-major GEMM (c2-t128) against cuBLASLt (one NN GEMM a segment, the later ones adding)\n");
    for (const Case &c : cases) {
        if (only && strncmp(c.what, only, strlen(only))) continue;
        const int M = c.M, N = c.N;
        auto own = [&] { run_dx(c.segs, D, M, N, gm); };
        auto seq = [&] {
            for (size_t i = 0; i < c.segs.size(); i++)
                lt.run(c.segs[i].a, c.segs[i].b, R, M, N, c.segs[i].K, i ? 1.f : 0.f, true, c.segs[i].lda);
        };
        poison<<<1024, 256>>>(D, (size_t)M * N);
        own(); seq();
        CK(cudaDeviceSynchronize());
        size_t nan = 0;
        const double e = relerr(D, R, (size_t)M * N, &nan), e64 = cpu_check_dx(c.segs, D, M, N), e64lt = cpu_check_dx(c.segs, R, M, N);
        float t_own, t_lt;
        time_pair(own, seq, 30, e0, e1, &t_own, &t_lt);
        double fl = 0;
        for (const Seg &sg : c.segs) fl += 2.0 * M * N * sg.K;
        if (nan || e > 1e-2 || e64 > 1e-2) { failed++; printf("FAIL: "); }
        printf("%-13s %5d %6d %d seg | own %.4f ms (%.0f TF), cuBLASLt %.4f ms, lt/own %.3f | err vs lt %.2e (%zu NaN), f64 own %.2e lt %.2e\n",
               c.what, M, N, (int)c.segs.size(), t_own, fl / t_own / 1e9, t_lt, t_lt / t_own, e, nan, e64, e64lt);
        fflush(stdout);
    }
    for (int i = 0; i < 8; i++) CK(cudaFree(buf[i]));
    CK(cudaFree(D)); CK(cudaFree(R));
    return failed;
}

// Qwen3-0.6B's products without LoRA (8192 tokens, two rows of 4096), as the library would run them
// on its own GEMM (c2-t128: the forward K-major, a single input gradient N-major) against cuBLASLt's
// heuristic choice (with the 4-byte memset some of its kernels launch first), and the output layer's
// (one 4096-row chunk of the 151936-column logits). Returns the number of failed checks.
static int small_section(Lt &lt, int gm, cudaEvent_t e0, cudaEvent_t e1) {
    int failed = 0;
    const size_t big = (size_t)4096 * 151936;
    __nv_bfloat16 *A, *B, *D, *R;
    CK(cudaMalloc(&A, big * 2)); CK(cudaMalloc(&B, big * 2)); CK(cudaMalloc(&D, big * 2)); CK(cudaMalloc(&R, big * 2));
    fill<<<1024, 256>>>(A, big, 5u);
    fill<<<1024, 256>>>(B, big, 6u);
    struct Case { const char *what; int M, N, K; bool dx; };
    const Case cases[] = {
        {"0.6B q fwd", 8192, 2048, 1024, false},     {"0.6B k/v fwd", 8192, 1024, 1024, false},
        {"0.6B o fwd", 8192, 1024, 2048, false},     {"0.6B gate/up fwd", 8192, 3072, 1024, false},
        {"0.6B down fwd", 8192, 1024, 3072, false},  {"0.6B o dx", 8192, 2048, 1024, true},
        {"0.6B down dx", 8192, 3072, 1024, true},    {"head fwd", 4096, 151936, 1024, false},
        {"head dx", 4096, 1024, 151936, true},
    };
    const char *only = getenv("GEMM_SM90_ONLY");
    printf("\nwithout LoRA: own GEMM (c2-t128) against cuBLASLt's heuristic choice\n");
    for (const Case &c : cases) {
        if (only && strncmp(c.what, only, strlen(only))) continue;
        const int M = c.M, N = c.N, K = c.K;
        const std::vector<Seg> segs = {{A, K, K, B}};
        auto own = [&] {
            if (c.dx) run_dx(segs, D, M, N, gm);
            else run_own<4, 2, 2, false, 128>(A, B, D, M, N, K, gm, 0);
        };
        auto ref = [&] { lt.run(A, B, R, M, N, K, 0.f, c.dx); };
        poison<<<1024, 256>>>(D, (size_t)M * N);
        own(); ref();
        CK(cudaDeviceSynchronize());
        size_t nan = 0;
        const double e = relerr(D, R, (size_t)M * N, &nan);
        float t_own, t_lt;
        time_pair(own, ref, (double)M * N * K > 1e11 ? 10 : 40, e0, e1, &t_own, &t_lt);
        if (nan || e > 1e-2) { failed++; printf("FAIL: "); }
        const double fl = 2.0 * M * N * K;
        printf("%-16s %5d %6d %6d | own %.4f ms (%.0f TF), cuBLASLt %.4f ms (%.0f TF), lt/own %.3f | err vs lt %.2e (%zu NaN)\n",
               c.what, M, N, K, t_own, fl / t_own / 1e9, t_lt, fl / t_lt / 1e9, t_lt / t_own, e, nan);
        fflush(stdout);
    }
    CK(cudaFree(A)); CK(cudaFree(B)); CK(cudaFree(D)); CK(cudaFree(R));
    return failed;
}

// SwiGLU as the library computes it (ops_common.cuh's swiglu1), from the bf16 values
__device__ __forceinline__ float silu_mul(float g, float u) {
    return __fmul_rn(__fmul_rn(g, __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-g)))), u);
}
struct Swiglu { __device__ static float f(float g, float u) { return silu_mul(g, u); } };
// the same with the fast exponential and reciprocal (differs in the last bits)
struct SwigluFast { __device__ static float f(float g, float u) { return g * __frcp_rn(1.0f + __expf(-g)) * u; } };
// no arithmetic: the third output's stores alone
struct Third { __device__ static float f(float g, float) { return g; } };
__global__ void swiglu_kernel(const __nv_bfloat16 *g, const __nv_bfloat16 *u, size_t n8, __nv_bfloat16 *h) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        uint4 a = reinterpret_cast<const uint4 *>(g)[i], b = reinterpret_cast<const uint4 *>(u)[i], o;
        const __nv_bfloat16 *x = reinterpret_cast<const __nv_bfloat16 *>(&a), *y = reinterpret_cast<const __nv_bfloat16 *>(&b);
        __nv_bfloat16 *z = reinterpret_cast<__nv_bfloat16 *>(&o);
#pragma unroll
        for (int k = 0; k < 8; k++) z[k] = __float2bfloat16(silu_mul(__bfloat162float(x[k]), __bfloat162float(y[k])));
        reinterpret_cast<uint4 *>(h)[i] = o;
    }
}

// The MLP's front: g, up and h = silu(g) up as one GEMM (the SwiGLU pair, EPI 3) against the
// library's path before it (two GEMMs, LoRA's term inside each, then the SwiGLU kernel).
static int swiglu_section(int gm, cudaEvent_t e0, cudaEvent_t e1, bool once = false) {
    int failed = 0;
    struct Case { const char *what; int T, K, I, r; } cases[] = {
        {"ragged", 333, 1000, 520, 8}, {"8B lora", 4096, 4096, 12288, 8}, {"8B", 4096, 4096, 12288, 0}, {"0.6B", 8192, 1024, 3072, 0}};
    printf("\nSwiGLU pair: own dual GEMM (gate, up, h) against two GEMMs + the SwiGLU kernel\n");
    for (const Case &c : cases) {
        if (once && strcmp(c.what, "8B lora")) continue;
        const int T = c.T, K = c.K, I = c.I, r = c.r;
        __nv_bfloat16 *x, *wg, *wu, *u, *bg, *bu, *o[6];
        CK(cudaMalloc(&x, (size_t)T * K * 2)); CK(cudaMalloc(&wg, (size_t)I * K * 2)); CK(cudaMalloc(&wu, (size_t)I * K * 2));
        CK(cudaMalloc(&u, (size_t)T * 64 * 2)); CK(cudaMalloc(&bg, (size_t)I * 64 * 2)); CK(cudaMalloc(&bu, (size_t)I * 64 * 2));
        for (int i = 0; i < 6; i++) { CK(cudaMalloc(&o[i], (size_t)T * I * 2)); poison<<<1024, 256>>>(o[i], (size_t)T * I); }
        fill<<<1024, 256>>>(x, (size_t)T * K, 1u); fill<<<1024, 256>>>(wg, (size_t)I * K, 2u); fill<<<1024, 256>>>(wu, (size_t)I * K, 3u);
        fill<<<256, 256>>>(u, (size_t)T * 64, 4u); fill<<<256, 256>>>(bg, (size_t)I * 64, 5u); fill<<<256, 256>>>(bu, (size_t)I * 64, 6u);
        Args p = {};
        bool ok = kmajor_map(&p.a[0], x, T, K, K, BM) && kmajor_map(&p.b[0], wg, I, K, K, BN / 2) && kmajor_map(&p.b2[0], wu, I, K, K, BN / 2) &&
                  kmajor_map(&p.d, o[0], T, I, I, 64, 64) && kmajor_map(&p.d2, o[1], T, I, I, 64, 64) && kmajor_map(&p.d3, o[2], T, I, I, 64, 64);
        p.nk[0] = (K + BK - 1) / BK; p.nseg = 1; p.s_last = 1.0f;
        if (r) {
            ok = ok && kmajor_map(&p.a[1], u, T, 2 * r, 2 * r, BM) && kmajor_map(&p.b[1], bg, I, r, r, BN / 2) && kmajor_map(&p.b2[1], bu, I, r, r, BN / 2);
            p.nk[1] = 1; p.kb2[1] = -r; p.nseg = 2;
        }
        if (!ok) { fprintf(stderr, "cuTensorMapEncodeTiled failed\n"); exit(1); }
        p.D = o[0]; p.M = T; p.N = I; p.ldd = I; p.gm = gm;
        auto own = [&] { launch<4, 2, 3, false, 128, false, Swiglu>(p, 0); };
        auto own3 = [&] { launch<3, 2, 3, false, 128, false, Swiglu, 2>(p, 0); };  // 3 stages, staging double-buffered
        std::vector<Seg> sg = {{x, K, K, wg}}, su = {{x, K, K, wu}};
        if (r) { sg.push_back({u, 2 * r, r, bg}); su.push_back({u + r, 2 * r, r, bu}); }
        auto ref = [&] {
            launch<4, 2, 2, false, 128, false>(args_for(false, 2, sg, o[3], T, I, gm), 0);
            launch<4, 2, 2, false, 128, false>(args_for(false, 2, su, o[4], T, I, gm), 0);
            swiglu_kernel<<<132 * 8, 256>>>(o[3], o[4], (size_t)T * I / 8, o[5]);
        };
        own(); ref();
        CK(cudaDeviceSynchronize());
        if (once) { printf("swiglu1: one of each\n"); return 0; }
        size_t n0 = 0, n1 = 0, n2 = 0;
        const size_t n = (size_t)T * I;
        const double eg = relerr(o[0], o[3], n, &n0), eu = relerr(o[1], o[4], n, &n1), eh = relerr(o[2], o[5], n, &n2);
        float t_own, t_ref, t_own3, t_ref3;
        time_pair(own, ref, 20, e0, e1, &t_own, &t_ref);
        for (int i = 0; i < 3; i++) poison<<<1024, 256>>>(o[i], n);
        own3();
        CK(cudaDeviceSynchronize());
        size_t m0 = 0, m1 = 0, m2 = 0;
        const double fg = relerr(o[0], o[3], n, &m0), fu = relerr(o[1], o[4], n, &m1), fh = relerr(o[2], o[5], n, &m2);
        time_pair(own3, ref, 20, e0, e1, &t_own3, &t_ref3);
        float t_fast, t_third, t_r;
        time_pair([&] { launch<4, 2, 3, false, 128, false, SwigluFast>(p, 0); }, ref, 20, e0, e1, &t_fast, &t_r);
        time_pair([&] { launch<4, 2, 3, false, 128, false, Third>(p, 0); }, ref, 20, e0, e1, &t_third, &t_r);
        printf("  fast exp and reciprocal %.4f ms, third output without arithmetic %.4f ms\n", t_fast, t_third);
        if (n0 || n1 || n2 || eg > 1e-6 || eu > 1e-6 || eh > 1e-6 || m0 || m1 || m2 || fg > 1e-6 || fu > 1e-6 || fh > 1e-6) {
            failed++;
            printf("FAIL: ");
        }
        printf("%-8s T %5d K %5d I %5d r %2d | own %.4f ms (3 stages, 2 buffers: %.4f), two GEMMs + SwiGLU %.4f ms (%.4f), saved %.4f ms | vs ref g %.1e u %.1e h %.1e (NaN %zu %zu %zu), 3-stage %.1e %.1e %.1e\n",
               c.what, T, K, I, r, t_own, t_own3, t_ref, t_ref3, t_ref - t_own, eg, eu, eh, n0, n1, n2, fg, fu, fh);
        fflush(stdout);
        for (void *q : {(void *)x, (void *)wg, (void *)wu, (void *)u, (void *)bg, (void *)bu}) CK(cudaFree(q));
        for (int i = 0; i < 6; i++) CK(cudaFree(o[i]));
    }
    return failed;
}

// Windows of n layers (~1 s) of each of nv variants in turn for `secs` seconds, TFLOP/s of `fl`
// FLOPs a layer printed per window; mean[i]: variant i's mean after the first round (the power's
// settling), 0 when it had no window after that.
template <class F>
static void sustain_turns(F layer, int nv, const char *const *names, double fl, double secs, cudaEvent_t e0, cudaEvent_t e1,
                          double *mean) {
    const int n = 400;  // ~1 s of layers at ~2.4 ms each
    std::vector<double> sum(nv, 0.0);
    std::vector<int> cnt(nv, 0);
    printf("%6s %12s %8s %9s %8s\n", "t s", "side", "layers", "ms/layer", "TFLOP/s");
    double t = 0;
    for (int win = 0; t < secs; win++) {
        const int i = win % nv;
        float ms;
        CK(cudaEventRecord(e0));
        for (int k = 0; k < n; k++) layer(i);
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&ms, e0, e1));
        t += ms / 1e3;
        const double tf = fl * n / (ms / 1e3) / 1e12;
        if (win >= nv) sum[i] += tf, cnt[i]++;
        printf("%6.1f %12s %8d %9.4f %8.1f\n", t, names[i], n, ms / n, tf);
        fflush(stdout);
    }
    for (int i = 0; i < nv; i++) mean[i] = cnt[i] ? sum[i] / cnt[i] : 0.0;
}

// Sustained: an 8B layer's forward products (q, k, v, o, gate, up, down) back to back for `secs`
// seconds in windows of about one second, each variant in turn, TFLOP/s per window (base FLOPs):
// what the power cap the training step runs under (700 W on the H100 SXM) does to the rates that
// the short interleaved timings above report. Run nvidia-smi beside it for the clocks. Each
// variant is checked against cuBLASLt first. secs 0: one layer of each variant, unchecked (for a
// profiler).
static int sustain_section(Lt &lt, int gm, double secs, cudaEvent_t e0, cudaEvent_t e1) {
    const int T = 4096, H = 4096, KV = 1024, I = 12288, r = 8;
    struct P { int N, K; } ps[] = {{H, H}, {KV, H}, {KV, H}, {H, H}, {I, H}, {I, H}, {H, I}};
    const size_t big = (size_t)T * I;
    __nv_bfloat16 *X, *W, *Y, *U, *SB;
    CK(cudaMalloc(&X, big * 2)); CK(cudaMalloc(&W, (size_t)I * H * 2)); CK(cudaMalloc(&Y, big * 2));
    CK(cudaMalloc(&U, (size_t)T * 64 * 2)); CK(cudaMalloc(&SB, (size_t)I * 64 * 2));
    fill<<<1024, 256>>>(X, big, 5u); fill<<<1024, 256>>>(W, (size_t)I * H, 6u);
    fill<<<256, 256>>>(U, (size_t)T * r, 7u); fill<<<256, 256>>>(SB, (size_t)I * r, 8u);
    double fl = 0;
    for (const P &q : ps) fl += 2.0 * T * q.N * q.K;
    // (also measured, bench/RESULTS.md fifteenth round, and not kept: a suspend-time hint on the
    // barrier waits, the operands' L2 promotion at 128 bytes or none, clusters of 2 x 2)
    struct Var { const char *name; bool lora, skip; float s; };
    const Var vars[] = {  // cuBLASLt last, the reference of the ratios
        {"lib", true, true, 2.0f},         // the library's: LoRA's block (its first k16 step alone), s = 2
        {"lib-s1", true, true, 1.0f},      // the same without the scaling pass over U's tile
        {"lib-noskip", true, false, 2.0f},  // LoRA's block whole (the library before the fifteenth round)
        {"own", false, false, 1.0f},       // the base GEMM alone
        {"lt", false, false, 1.0f},        // cuBLASLt, the base GEMM
    };
    const int nv = (int)(sizeof vars / sizeof vars[0]);
    auto one = [&](const Var &v, const P &q) {
        if (&v == &vars[nv - 1]) { lt.run(X, W, Y, T, q.N, q.K); return; }
        const __nv_bfloat16 *u = v.lora ? U : nullptr, *sb = v.lora ? SB : nullptr;
        if (v.skip) run_own<4, 2, 2, false, 128, true>(X, W, Y, T, q.N, q.K, gm, 0, u, sb, v.lora ? r : 0, v.s);
        else run_own<4, 2, 2, false, 128>(X, W, Y, T, q.N, q.K, gm, 0, u, sb, v.lora ? r : 0, v.s);
    };
    auto layer = [&](int i) { for (const P &q : ps) one(vars[i], q); };
    if (secs <= 0) {
        for (int i = 0; i < nv; i++) layer(i);
        CK(cudaDeviceSynchronize());
        return 0;
    }
    int failed = 0;
    __nv_bfloat16 *R;
    CK(cudaMalloc(&R, big * 2));
    for (const P &q : ps)  // each variant against cuBLASLt, output poisoned first
        for (int i = 0; i < nv - 1; i++) {
            poison<<<1024, 256>>>(Y, (size_t)T * q.N);
            one(vars[i], q);
            if (vars[i].lora) { lt.run(U, SB, R, T, q.N, r, 0.f, false, 0, vars[i].s); lt.run(X, W, R, T, q.N, q.K, 1.f); }
            else lt.run(X, W, R, T, q.N, q.K);
            CK(cudaDeviceSynchronize());
            size_t nan = 0;
            const double e = relerr(Y, R, (size_t)T * q.N, &nan);
            if (nan || e > 1e-2) { failed++; printf("FAIL: "); }
            printf("check %-8s %5d x %5d x %5d: %.2e from cuBLASLt (%zu NaN)\n", vars[i].name, T, q.N, q.K, e, nan);
        }
    CK(cudaFree(R));
    for (int w = 0; w < 2; w++) for (int i = 0; i < nv; i++) layer(i);
    CK(cudaDeviceSynchronize());
    printf("sustain: %.0f s of an 8B layer's forward products (%.3f TFLOP a layer), windows of ~1 s\n", secs, fl / 1e12);
    std::vector<const char *> names(nv);
    std::vector<double> mean(nv);
    for (int i = 0; i < nv; i++) names[i] = vars[i].name;
    sustain_turns(layer, nv, names.data(), fl, secs, e0, e1, mean.data());
    printf("means after the first round (TFLOP/s, ratio to cuBLASLt):");
    for (int i = 0; i < nv; i++) {
        if (!(mean[i] > 0)) continue;
        printf(" %s %.1f", vars[i].name, mean[i]);
        if (mean[nv - 1] > 0) printf(" (%.3f)", mean[i] / mean[nv - 1]);
    }
    printf("%s\n", mean[nv - 1] > 0 ? "" : " (no cuBLASLt window after the first round: give more seconds)");
    for (void *q : {(void *)X, (void *)W, (void *)Y, (void *)U, (void *)SB}) CK(cudaFree(q));
    return failed;
}

// What fusing LoRA's dy pass into the input-gradient sums would cost the GEMM: an 8B layer's four
// sums (q+k+v, o, gate+up, down, each with its LoRA segment) as the library runs them, against the
// same with one more m64n8k16 product per k16 step (XN: du = dy B's share of the work, on a fixed
// 8 x 64 tile), back to back in windows of ~1 s, alternating, for `secs` seconds (the power cap is
// what decides). The extra products must leave D bit for bit unchanged (checked first).
static int dxn8_section(int gm, double secs, cudaEvent_t e0, cudaEvent_t e1) {
    const int T = 4096, H = 4096, KV = 1024, I = 12288;
    const size_t big = (size_t)T * I;
    __nv_bfloat16 *buf[8], *D, *R;
    for (int i = 0; i < 8; i++) { CK(cudaMalloc(&buf[i], big * 2)); fill<<<1024, 256>>>(buf[i], big, 300u + i); }
    CK(cudaMalloc(&D, big * 2)); CK(cudaMalloc(&R, big * 2));
    struct Case { int N; std::vector<Seg> segs; };
    const std::vector<Case> cases = {
        {H, {{buf[6], 24, 24, buf[7]}, {buf[0], H, H, buf[1]}, {buf[2], KV, KV, buf[3]}, {buf[4], KV, KV, buf[5]}}},
        {H, {{buf[6], 8, 8, buf[7]}, {buf[0], H, H, buf[1]}}},
        {H, {{buf[6], 16, 16, buf[7]}, {buf[0], I, I, buf[1]}, {buf[2], I, I, buf[3]}}},
        {I, {{buf[6], 8, 8, buf[7]}, {buf[0], H, H, buf[1]}}},
    };
    double fl = 0;
    for (const Case &c : cases)
        for (const Seg &sg : c.segs) fl += 2.0 * T * c.N * sg.K;
    int failed = 0;
    std::vector<__nv_bfloat16> h0, h1;
    for (const Case &c : cases) {
        poison<<<1024, 256>>>(D, (size_t)T * c.N); poison<<<1024, 256>>>(R, (size_t)T * c.N);
        run_dx<0, true>(c.segs, D, T, c.N, gm);
        h0.resize((size_t)T * c.N); h1.resize((size_t)T * c.N);
        CK(cudaMemcpy(h0.data(), D, h0.size() * 2, cudaMemcpyDeviceToHost));
        for (int xn = 1; xn <= 2; xn++) {
            poison<<<1024, 256>>>(R, (size_t)T * c.N);
            if (xn == 1) run_dx<1, true>(c.segs, R, T, c.N, gm);
            else run_dx<2, true>(c.segs, R, T, c.N, gm);
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(h1.data(), R, h1.size() * 2, cudaMemcpyDeviceToHost));
            const bool same = !memcmp(h0.data(), h1.data(), h0.size() * 2);
            size_t nan = 0;
            const double e64 = cpu_check_dx(c.segs, R, T, c.N);
            for (size_t i = 0; i < h1.size(); i++) nan += std::isnan(__bfloat162float(h1[i]));
            if (!same || nan || e64 > 1e-2) { failed++; printf("FAIL: "); }
            printf("dxn8 check XN %d, N %d, %zu segments: %s, %zu NaN, f64 %.2e\n", xn, c.N, c.segs.size(),
                   same ? "the same bits" : "DIFFERENT bits", nan, e64);
        }
    }
    // 0: the library's sums; 1: one more wgmma m64n8k16 a k16 step on the consumers; 2: the same
    // products by mma.sync on the producer warpgroup's three idle warps
    auto layer = [&](int xn) {
        for (const Case &c : cases) {
            if (xn == 1) run_dx<1, true>(c.segs, D, T, c.N, gm);
            else if (xn == 2) run_dx<2, true>(c.segs, D, T, c.N, gm);
            else run_dx<0, true>(c.segs, D, T, c.N, gm);
        }
    };
    for (int w = 0; w < 3; w++) { layer(0); layer(1); layer(2); }
    CK(cudaDeviceSynchronize());
    printf("dxn8: %.0f s of an 8B layer's input-gradient sums (%.3f TFLOP), windows of ~1 s in turn\n", secs, fl / 1e12);
    const char *names[3] = {"base", "wgmma-n8", "mma-producer"};
    double mean[3];
    sustain_turns(layer, 3, names, fl, secs, e0, e1, mean);
    if (mean[0] > 0 && mean[1] > 0 && mean[2] > 0)
        printf("dxn8 means after the first round: base %.1f, wgmma n8 on the consumers %.1f (%.2f%% slower), mma.sync on "
               "the producer's warps %.1f TFLOP/s (%.2f%% slower)\n", mean[0], mean[1], 100.0 * (mean[0] / mean[1] - 1.0), mean[2],
               100.0 * (mean[0] / mean[2] - 1.0));
    for (int i = 0; i < 8; i++) CK(cudaFree(buf[i]));
    CK(cudaFree(D)); CK(cudaFree(R));
    return failed;
}

int main(int argc, char **argv) {
    int gm = 8, failed = 0;
    if (argc > 1) {
        char *end = nullptr;
        const long v = strtol(argv[1], &end, 10);
        if (end == argv[1] || *end || v < 1 || v > 64 || (argc > 2 && strcmp(argv[2], "one") && strcmp(argv[2], "dx") && strcmp(argv[2], "swiglu") && strcmp(argv[2], "swiglu1") && strcmp(argv[2], "small") && strcmp(argv[2], "sustain") && strcmp(argv[2], "dxn8")) || argc > 3) {
            fprintf(stderr, "usage: %s [group_m: 1..64, default 8] [one | dx | swiglu | swiglu1 | small | sustain | dxn8]\n", argv[0]);
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
    if (argc > 2 && !strcmp(argv[2], "swiglu1")) return swiglu_section(gm, e0, e1, true);
    if (argc > 2 && (!strcmp(argv[2], "dx") || !strcmp(argv[2], "swiglu") || !strcmp(argv[2], "small"))) {
        failed = !strcmp(argv[2], "dx")       ? dx_section(lt, gm, e0, e1)
                 : !strcmp(argv[2], "small") ? small_section(lt, gm, e0, e1)
                                             : swiglu_section(gm, e0, e1);
        if (failed) printf("%d check(s) failed\n", failed);
        return failed ? 1 : 0;
    }
    if (argc > 2 && (!strcmp(argv[2], "sustain") || !strcmp(argv[2], "dxn8"))) {
        const char *e = getenv("GEMM_SM90_SECONDS");
        char *end = nullptr;
        const double secs = e ? strtod(e, &end) : 30.0;
        if (e && (end == e || *end || !(secs >= 0 && secs <= 3600))) {
            fprintf(stderr, "GEMM_SM90_SECONDS=%s: give seconds from 0 to 3600 (0: one layer of each variant, for a profiler)\n", e);
            return 2;
        }
        if (!strcmp(argv[2], "dxn8")) {
            failed = dxn8_section(gm, secs, e0, e1);
            if (failed) printf("%d check(s) failed\n", failed);
            return failed ? 1 : 0;
        }
        return sustain_section(lt, gm, secs, e0, e1);
    }
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
                           const __nv_bfloat16 *, const __nv_bfloat16 *, int, float);
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
            v.f(A, B, D, M, N, K, gm, 0, nullptr, nullptr, 0, 1.0f);
            lt.run(A, B, R, M, N, K);
            CK(cudaDeviceSynchronize());
            size_t nan = 0;
            const bool noepi = strstr(v.name, "-ne") != nullptr;
            double e = noepi ? 0 : relerr(D, R, (size_t)M * N, &nan);
            const bool f64 = !noepi && K <= 4096 && (size_t)N * K <= 64ull << 20;
            double e64 = f64 ? cpu_check(A, B, D, M, N, K) : -1, e64lt = f64 ? cpu_check(A, B, R, M, N, K) : -1;
            float t_own, t_lt;
            const int reps = (double)M * N * K > 1e10 ? 20 : 50;
            time_pair([&] { v.f(A, B, D, M, N, K, gm, 0, nullptr, nullptr, 0, 1.0f); }, [&] { lt.run(A, B, R, M, N, K); }, reps, e0, e1,
                      &t_own, &t_lt);
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
        float t_own, t_lt;
        time_pair(own, pair, 30, e0, e1, &t_own, &t_lt);
        printf("%-12s %5d %6d %6d | own %.4f ms, cuBLASLt pair %.4f ms, saved %.4f ms | err vs pair %.2e (%zu NaN), f64 %.2e\n",
               sh.what, M, N, K, t_own, t_lt, t_lt - t_own, e, nan, e64);
        fflush(stdout);
    }
    failed += dx_section(lt, gm, e0, e1);
    failed += swiglu_section(gm, e0, e1);
    failed += small_section(lt, gm, e0, e1);
    if (failed) printf("%d check(s) failed\n", failed);
    return failed ? 1 : 0;
}
