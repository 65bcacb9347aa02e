// src/backend/cuda/mma.cuh as the emulator runs it: the same functions, the
// PTX instructions done on the CPU as the PTX ISA defines them.
//   mma.sync.m16n8k16.row.col.f32 (16-bit inputs, fp32 accumulators): the
//     warp's A (16 x 16), B (16 x 8) and C (16 x 8) from the lanes'
//     fragments (g = lane / 4, t = lane % 4: mma.cuh's table), D = A B + C
//     accumulated in fp32 in k order, back to the lanes;
//   ldmatrix .x4 / .x2 (.trans): lane l gives the address of row l % 8 of
//     matrix l / 8; lane l receives, of each matrix j, the pair (row l / 4,
//     columns 2 (l % 4) and + 1), or with .trans the transposed pair;
//   cp.async: the source read when issued, the destination written when
//     its group is waited for (a read before the wait sees the old bytes:
//     NaN in fresh shared memory), zeros when !valid;
//   a misaligned address aborts, as it faults on the GPU.
// pre.py points the kernels' `#include "mma.cuh"` here.
#ifndef LOOM_EMU_MMA_CUH
#define LOOM_EMU_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "src/backend/cuda/mma_addr.cuh"
#include "src/backend/cuda/ops_common.cuh"

void emu_warp_call(void *mine, void (*fn)(void *const *));
void emu_cp_async(void *dst, const void *src, int n, bool valid);
void emu_cp_commit();
void emu_cp_wait(int n);

namespace loom_cuda {

inline float emu_lo(uint32_t v, bool bf) {
    const uint16_t h = (uint16_t)(v & 0xffff);
    return bf ? __bfloat162float(__nv_bfloat16{h}) : __half2float(*(const __half *)&h);
}
inline float emu_hi(uint32_t v, bool bf) { return emu_lo(v >> 16, bf); }

struct emu_mma_lane {
    float *c;
    const uint32_t *a;
    uint32_t b0, b1;
    bool bf;
};

inline void emu_mma_warp(void *const *lanes) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; l++) {
        const emu_mma_lane *x = (const emu_mma_lane *)lanes[l];
        const int g = l / 4, t = l % 4;
        const bool bf = x->bf;
        A[g][2 * t] = emu_lo(x->a[0], bf), A[g][2 * t + 1] = emu_hi(x->a[0], bf);
        A[g + 8][2 * t] = emu_lo(x->a[1], bf), A[g + 8][2 * t + 1] = emu_hi(x->a[1], bf);
        A[g][2 * t + 8] = emu_lo(x->a[2], bf), A[g][2 * t + 9] = emu_hi(x->a[2], bf);
        A[g + 8][2 * t + 8] = emu_lo(x->a[3], bf), A[g + 8][2 * t + 9] = emu_hi(x->a[3], bf);
        B[2 * t][g] = emu_lo(x->b0, bf), B[2 * t + 1][g] = emu_hi(x->b0, bf);
        B[2 * t + 8][g] = emu_lo(x->b1, bf), B[2 * t + 9][g] = emu_hi(x->b1, bf);
        C[g][2 * t] = x->c[0], C[g][2 * t + 1] = x->c[1];
        C[g + 8][2 * t] = x->c[2], C[g + 8][2 * t + 1] = x->c[3];
    }
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 8; j++) {
            float s = C[i][j];
            for (int k = 0; k < 16; k++) s += A[i][k] * B[k][j];
            C[i][j] = s;
        }
    for (int l = 0; l < 32; l++) {
        const emu_mma_lane *x = (const emu_mma_lane *)lanes[l];
        const int g = l / 4, t = l % 4;
        x->c[0] = C[g][2 * t], x->c[1] = C[g][2 * t + 1];
        x->c[2] = C[g + 8][2 * t], x->c[3] = C[g + 8][2 * t + 1];
    }
}

template <typename T> struct mma_type;
template <> struct mma_type<__nv_bfloat16> {
    static uint32_t pack(float lo, float hi) {
        return (uint32_t)__float2bfloat16_rn(lo).x | (uint32_t)__float2bfloat16_rn(hi).x << 16;
    }
    static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        emu_mma_lane x = {c, a, b0, b1, true};
        emu_warp_call(&x, emu_mma_warp);
    }
};
template <> struct mma_type<__half> {
    static uint32_t pack(float lo, float hi) {
        const __half l = __float2half_rn(lo), h = __float2half_rn(hi);
        uint16_t a, b;
        memcpy(&a, &l, 2), memcpy(&b, &h, 2);
        return (uint32_t)a | (uint32_t)b << 16;
    }
    static void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
        emu_mma_lane x = {c, a, b0, b1, false};
        emu_warp_call(&x, emu_mma_warp);
    }
};

struct emu_ldsm_lane {
    uint32_t *r;
    const uint16_t *row;
    int n; // matrices: 4 or 2
    bool trans;
};

inline void emu_ldsm_warp(void *const *lanes) {
    const emu_ldsm_lane *x0 = (const emu_ldsm_lane *)lanes[0];
    const int n = x0->n;
    for (int l = 0; l < 8 * n; l++) // the rows' addresses: 16-byte aligned on the GPU
        if ((uintptr_t)((const emu_ldsm_lane *)lanes[l])->row & 15) {
            fprintf(stderr, "emu: ldmatrix row address of lane %d not 16-byte aligned\n", l);
            abort();
        }
    for (int l = 0; l < 32; l++)
        for (int j = 0; j < n; j++) {
            const int g = l / 4, t = l % 4;
            uint16_t e0, e1;
            if (!x0->trans) { // matrix j's row g, columns 2t, 2t + 1
                const uint16_t *row = ((const emu_ldsm_lane *)lanes[8 * j + g])->row;
                e0 = row[2 * t], e1 = row[2 * t + 1];
            } else { // column g of rows 2t, 2t + 1
                e0 = ((const emu_ldsm_lane *)lanes[8 * j + 2 * t])->row[g];
                e1 = ((const emu_ldsm_lane *)lanes[8 * j + 2 * t + 1])->row[g];
            }
            ((const emu_ldsm_lane *)lanes[l])->r[j] = (uint32_t)e0 | (uint32_t)e1 << 16;
        }
}

inline void emu_ldsm(uint32_t *r, const void *p, int n, bool trans) {
    emu_ldsm_lane x = {r, (const uint16_t *)p, n, trans};
    emu_warp_call(&x, emu_ldsm_warp);
}
inline void ldsm_x4(uint32_t (&r)[4], const void *p) { emu_ldsm(r, p, 4, false); }
inline void ldsm_x4_t(uint32_t (&r)[4], const void *p) { emu_ldsm(r, p, 4, true); }
inline void ldsm_x2(uint32_t (&r)[2], const void *p) { emu_ldsm(r, p, 2, false); }
inline void ldsm_x2_t(uint32_t (&r)[2], const void *p) { emu_ldsm(r, p, 2, true); }

inline void cp_async16(void *dst, const void *src, bool valid) {
    if (((uintptr_t)dst & 15) || (valid && ((uintptr_t)src & 15))) { // the GPU faults on these
        fprintf(stderr, "emu: cp.async of 16 bytes not 16-byte aligned (dst %p, src %p)\n", dst, src);
        abort();
    }
    emu_cp_async(dst, src, 16, valid);
}
inline void cp_async4(void *dst, const void *src, bool valid) {
    if (((uintptr_t)dst & 3) || (valid && ((uintptr_t)src & 3))) {
        fprintf(stderr, "emu: cp.async of 4 bytes not 4-byte aligned (dst %p, src %p)\n", dst, src);
        abort();
    }
    emu_cp_async(dst, src, 4, valid);
}
inline void cp_commit() { emu_cp_commit(); }
template <int N> inline void cp_wait() { emu_cp_wait(N); }

} // namespace loom_cuda

#endif
