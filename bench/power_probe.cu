// Power probes under the H100's board limit (bench/RESULTS.md, seventeenth
// round). Not part of the library or its tests; build and run on the GPU
// machine beside an instant-power log, then read it with bench/energy.py:
//
//   make CUDA=1 BUILD=build-cuda build-cuda/power_probe
//   nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant \
//       --format=csv,noheader,nounits -lms 100 > power.csv &
//   build-cuda/power_probe sms 6 > parts.txt      # or: limiter 6
//   python3 bench/energy.py power.csv --parts parts.txt
//
// sms:     a bf16 stream c = a + b over 512 MiB arrays (constant bits), first
//          with an ordinary grid, then one 1024-thread block per SM (forced
//          by shared memory) on 132, 100, 66 and 33 SMs: what idle SMs save.
// limiter: cuBLAS's Qwen3-8B gate product (4096 x 12288 x 4096, random bf16)
//          alone, then each followed by a one-thread spin of 150, 300 or 600
//          us: how much of an idle gap the power limiter gives back.
// Each part runs back to back for S seconds (default 6) after one untimed
// call and prints "sustain <part> <t0> <t1> <calls> <work>" (TB or TFLOP)
// on stdout, the time per call on stderr, with 3 s idle between parts.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include <functional>

static double now(void) {
    struct timeval tv;
    gettimeofday(&tv, 0);
    return tv.tv_sec + tv.tv_usec * 1e-6;
}

static void die(const char *what, cudaError_t e) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "power_probe: %s: %s\n", what, cudaGetErrorString(e));
    exit(1);
}

__device__ __forceinline__ uint4 add8(uint4 x, uint4 y) {
    uint4 r;
    const __nv_bfloat162 *a = (const __nv_bfloat162 *)&x, *b = (const __nv_bfloat162 *)&y;
    __nv_bfloat162 *o = (__nv_bfloat162 *)&r;
    for (int k = 0; k < 4; k++) o[k] = __hadd2(a[k], b[k]);
    return r;
}

// c = a + b over n 16-byte vectors, four per thread in flight
__global__ void stream_add(const uint4 *__restrict__ a, const uint4 *__restrict__ b, uint4 *__restrict__ c,
                           size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {
        uint4 x[4], y[4];
        for (int u = 0; u < 4; u++) x[u] = __ldcs(a + i + u * stride), y[u] = __ldcs(b + i + u * stride);
        for (int u = 0; u < 4; u++) __stcs(c + i + u * stride, add8(x[u], y[u]));
    }
    for (; i < n; i += stride) c[i] = add8(a[i], b[i]);
}

__global__ void fill_random(__nv_bfloat16 *p, size_t n, unsigned seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.2f);
    }
}

// one thread waits ns nanoseconds on the global timer
__global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

// Runs f back to back for secs (after one untimed call) and prints the part.
static void part(const char *name, double secs, double work_per_call, const std::function<void()> &f) {
    cudaEvent_t e0, e1;
    die("event", cudaEventCreate(&e0));
    die("event", cudaEventCreate(&e1));
    f();
    die(name, cudaDeviceSynchronize());
    sleep(3);
    const double t0 = now();
    long calls = 0;
    die("event", cudaEventRecord(e0));
    while (now() - t0 < secs) {
        for (int r = 0; r < 20; r++) f();
        calls += 20;
        die("event", cudaEventRecord(e1));
        die(name, cudaEventSynchronize(e1));
    }
    const double t1 = now();
    float ms = 0;
    die("event", cudaEventElapsedTime(&ms, e0, e1));
    printf("sustain %s %.3f %.3f %ld %.4f\n", name, t0, t1, calls, work_per_call * calls);
    fflush(stdout);
    fprintf(stderr, "%s: %.1f us a call\n", name, ms * 1e3 / calls);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
}

static void probe_sms(double secs) {
    const size_t bytes = (size_t)512 << 20, n = bytes / 16;
    uint4 *a, *b, *c;
    die("malloc", cudaMalloc(&a, bytes)), die("malloc", cudaMalloc(&b, bytes)), die("malloc", cudaMalloc(&c, bytes));
    die("memset", cudaMemset(a, 0x3c, bytes)), die("memset", cudaMemset(b, 0x3d, bytes));
    int sms = 0;
    die("attribute", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int big = 150 * 1024; // one block an SM
    die("attribute", cudaFuncSetAttribute(stream_add, cudaFuncAttributeMaxDynamicSharedMemorySize, big));
    const double tb = 3.0 * bytes * 1e-12;
    part("grid", secs, tb, [&] { stream_add<<<(unsigned)(n / 256), 256>>>(a, b, c, n); });
    const int counts[] = {sms, 100, 66, 33};
    for (int k : counts) {
        if (k > sms) continue;
        char name[32];
        snprintf(name, sizeof name, "sm%d", k);
        part(name, secs, tb, [&] { stream_add<<<k, 1024, big>>>(a, b, c, n); });
    }
    cudaFree(a), cudaFree(b), cudaFree(c);
}

static void probe_limiter(double secs) {
    const int M = 4096, N = 12288, K = 4096;
    __nv_bfloat16 *A, *B, *C;
    die("malloc", cudaMalloc(&A, (size_t)M * K * 2)), die("malloc", cudaMalloc(&B, (size_t)N * K * 2));
    die("malloc", cudaMalloc(&C, (size_t)M * N * 2));
    fill_random<<<1024, 256>>>(A, (size_t)M * K, 1);
    fill_random<<<1024, 256>>>(B, (size_t)N * K, 2);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "power_probe: cublasCreate failed\n");
        exit(1);
    }
    const float one = 1, zero = 0;
    auto gemm = [&] {
        if (cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K, &zero, C,
                         CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "power_probe: cublasGemmEx failed\n");
            exit(1);
        }
    };
    const double tf = 2.0 * M * N * K * 1e-12;
    part("gemm", secs, tf, gemm);
    const int gaps[] = {150, 300, 600};
    for (int g : gaps) {
        char name[32];
        snprintf(name, sizeof name, "gemm+gap%d", g);
        part(name, secs, tf, [&] {
            gemm();
            spin<<<1, 1>>>((unsigned long long)g * 1000);
        });
    }
    cublasDestroy(h);
    cudaFree(A), cudaFree(B), cudaFree(C);
}

int main(int argc, char **argv) {
    // the arguments first: a mistake is told before any device work
    const char *mode = argc > 1 ? argv[1] : "";
    if (argc < 2 || argc > 3 || (strcmp(mode, "sms") && strcmp(mode, "limiter"))) {
        fprintf(stderr, "usage: power_probe sms|limiter [seconds a part, 1-600; default 6]\n");
        return 2;
    }
    double secs = 6;
    if (argc > 2) {
        char *end = nullptr;
        secs = strtod(argv[2], &end);
        if (end == argv[2] || *end || !(secs >= 1 && secs <= 600)) {
            fprintf(stderr, "power_probe: seconds a part must be a number from 1 to 600 (got '%s')\n", argv[2]);
            return 2;
        }
    }
    if (!strcmp(mode, "sms")) probe_sms(secs);
    else probe_limiter(secs);
    die("the probe", cudaGetLastError());
    return 0;
}
