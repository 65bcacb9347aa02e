// The CUDA runtime as the emulator (tools/cuda_emu/emu.cpp) provides it:
// what ops_gdn*.cu use, on the CPU.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <functional>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
extern uint3 threadIdx, blockIdx;
extern dim3 blockDim, gridDim;
typedef void *cudaStream_t;
typedef int cudaError_t;
enum { cudaSuccess = 0, cudaErrorInvalidConfiguration = 9, cudaErrorInvalidValue = 1 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
cudaError_t cudaGetLastError();
const char *cudaGetErrorString(cudaError_t);
cudaError_t cudaGetDevice(int *);
cudaError_t cudaDeviceGetAttribute(int *, cudaDeviceAttr, int);
cudaError_t emu_set_attr(const void *f, int v);
template <typename T> cudaError_t cudaFuncSetAttribute(T *f, cudaFuncAttribute, int v) {
    return emu_set_attr((const void *)f, v);
}
void emu_launch(const void *f, const char *name, dim3 g, dim3 b, size_t smem,
                std::function<void()> body);
inline void emu_launch(const void *f, const char *name, dim3 g, dim3 b) {
    std::abort();
}
void *emu_dyn_smem();
void emu_poison(void *p, size_t n);
void __syncthreads();
void emu_warp_call(void *mine, void (*fn)(void *const *));
inline void emu_nothing(void *const *) {}
/* every lane of the warp gets here before any goes on */
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu_warp_call(nullptr, emu_nothing); }
template <typename T> inline cudaError_t cudaMallocAsync(T **p, size_t n, cudaStream_t) {
    *p = (T *)malloc(n ? n : 1);
    return *p ? 0 : 2;
}
inline cudaError_t cudaFreeAsync(void *p, cudaStream_t) {
    free(p);
    return 0;
}
inline cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
    memset(p, v, n);
    return 0;
}
double emu_shfl_xor(double v, int o);
inline float __shfl_xor_sync(unsigned m, float v, int o) { return (float)emu_shfl_xor(v, o); }
inline double __shfl_xor_sync(unsigned m, double v, int o) { return emu_shfl_xor(v, o); }
inline int __shfl_xor_sync(unsigned m, int v, int o) { return (int)emu_shfl_xor(v, o); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
