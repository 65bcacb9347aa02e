// Tensor-core building blocks shared by the mma.sync kernels (attention,
// LoRA): the m16n8k16 product with fp32 accumulators, ldmatrix fragment
// loads (their lanes' addresses: mma_addr.cuh), and cp.async. Internal to the CUDA backend.
//
// Fragments (PTX ISA, mma.m16n8k16 with 16-bit inputs), g = lane / 4,
// t = lane % 4: A (16 x 16, row) a0 = (g, 2t..2t+1), a1 = (g + 8, ..),
// a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..); B (16 x 8, col) b0 = (k 2t..2t+1,
// n g), b1 = (k 2t + 8.., n g); C (16 x 8, fp32) c0, c1 = (g, 2t..2t+1),
// c2, c3 = (g + 8, 2t..2t+1).
#ifndef LOOM_CUDA_MMA_CUH
#define LOOM_CUDA_MMA_CUH

#include "mma_addr.cuh"
#include "ops_common.cuh"

namespace loom_cuda {

template <typename T> struct mma_type;
// One specialisation per 16-bit type: the PTX type name must be a literal.
#define LOOM_MMA_TYPE(T, T2, TO2, PTX)                                                             \
    template <> struct mma_type<T> {                                                               \
        static __device__ __forceinline__ uint32_t pack(float lo, float hi) {                     \
            T2 v = TO2(lo, hi);                                                                    \
            return *reinterpret_cast<uint32_t *>(&v);                                              \
        }                                                                                          \
        static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4],         \
                                                   uint32_t b0, uint32_t b1) {                     \
            asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 {%0,%1,%2,%3}, " \
                         "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                \
                         : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                          \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));          \
        }                                                                                          \
    };
LOOM_MMA_TYPE(__nv_bfloat16, __nv_bfloat162, __floats2bfloat162_rn, "bf16")
LOOM_MMA_TYPE(__half, __half2, __floats2half2_rn, "f16")
#undef LOOM_MMA_TYPE

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// cp.async of 16 bytes (zeros when !valid: nothing is read from src then).
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
// cp.async of 4 bytes (through L1: .cg takes only 16).
__device__ __forceinline__ void cp_async4(void *dst, const void *src, bool valid) {
    const uint32_t d = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src),
                 "r"(valid ? 4 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ldmatrix of two 8 x 8 matrices (lanes 0-15 give the row addresses).
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x2_t(uint32_t (&r)[2], const void *p) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(a));
}
} // namespace loom_cuda

#endif // LOOM_CUDA_MMA_CUH
