// The lanes' shared-memory addresses for ldmatrix (mma.cuh's fragment
// loads): pure index arithmetic, apart from the instructions so that the
// CPU emulator's mma.cuh (tools/cuda_emu/fake) uses the same. Internal to
// the CUDA backend.
#ifndef LOOM_CUDA_MMA_ADDR_CUH
#define LOOM_CUDA_MMA_ADDR_CUH

namespace loom_cuda {

// Shared-memory addresses of one lane for ldmatrix.x4 over a row-major tile
// with row stride LDS (elements):
// A operand, rows r0..r0+15, columns c0..c0+15: regs = a0..a3.
template <int LDS, typename T>
__device__ __forceinline__ const T *a_addr(const T *tile, int r0, int c0, int lane) {
    return tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + c0 + (lane >> 4) * 8;
}
// B operand of two n-tiles from a tile stored [n][k] (n rows n0..n0+15, k
// columns k0..k0+15): regs = {b0, b1} of n-tile 0, {b0, b1} of n-tile 1.
template <int LDS, typename T>
__device__ __forceinline__ const T *b_addr(const T *tile, int n0, int k0, int lane) {
    return tile + (n0 + (lane & 7) + (lane >> 4) * 8) * LDS + k0 + ((lane >> 3) & 1) * 8;
}
// B operand of two n-tiles from a tile stored [k][n] (k rows k0..k0+15, n
// columns n0..n0+15), loaded with .trans: same register order.
template <int LDS, typename T>
__device__ __forceinline__ const T *bt_addr(const T *tile, int k0, int n0, int lane) {
    return tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDS + n0 + (lane >> 4) * 8;
}

// A operand (rows m0..m0+15, columns k0..k0+15) from a tile stored [k][m]
// (the transpose), loaded with .trans: regs = a0..a3.
template <int LDS, typename T>
__device__ __forceinline__ const T *at_addr(const T *tile, int m0, int k0, int lane) {
    return tile + (k0 + (lane & 7) + (lane >> 4) * 8) * LDS + m0 + ((lane >> 3) & 1) * 8;
}

// B operand {b0, b1} of one n-tile (k0..k0+15, n0..n0+7) for ldmatrix.x2:
// from a tile stored [n][k] (plain) or [k][n] (.trans).
template <typename T>
__device__ __forceinline__ const T *b1_addr(const T *tile, int lds, int n0, int k0, int lane) {
    return tile + (n0 + (lane & 7)) * lds + k0 + ((lane >> 3) & 1) * 8;
}
template <typename T>
__device__ __forceinline__ const T *bt1_addr(const T *tile, int lds, int k0, int n0, int lane) {
    return tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lds + n0;
}

// a_addr, at_addr, b_addr and bt_addr with the row stride an argument.
template <typename T>
__device__ __forceinline__ const T *a_addr(const T *tile, int lds, int r0, int c0, int lane) {
    return tile + (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lds + c0 + (lane >> 4) * 8;
}
template <typename T>
__device__ __forceinline__ const T *at_addr(const T *tile, int lds, int m0, int k0, int lane) {
    return tile + (k0 + (lane & 7) + (lane >> 4) * 8) * lds + m0 + ((lane >> 3) & 1) * 8;
}

template <typename T>
__device__ __forceinline__ const T *b_addr(const T *tile, int lds, int n0, int k0, int lane) {
    return tile + (n0 + (lane & 7) + (lane >> 4) * 8) * lds + k0 + ((lane >> 3) & 1) * 8;
}
template <typename T>
__device__ __forceinline__ const T *bt_addr(const T *tile, int lds, int k0, int n0, int lane) {
    return tile + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * lds + n0 + (lane >> 4) * 8;
}

} // namespace loom_cuda

#endif // LOOM_CUDA_MMA_ADDR_CUH
