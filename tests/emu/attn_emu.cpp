// The CUDA attention (src/backend/cuda/ops_attention.cu, and its tensor-core
// kernels ops_attention_mma.cu: bf16 with D 64 or 128) run on the CPU by the
// emulator against the CPU reference (cpu_ops.h), forward and backward, with
// packed documents, grouped heads and queries of a context-parallel subset.
// The tensor-core kernels have run on H100 and H200 GPUs against the same
// reference (tests/test_backend_ops.c), so this checks the emulator's
// mma.sync and ldmatrix (tools/cuda_emu/fake/mma.cuh) as much as the
// kernels: what new tensor-core kernels are checked with where no GPU is (a
// fragment of A or a transposed ldmatrix mapped wrongly fails 12-15 checks).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "src/backend/cuda/cuda_ops.h"
extern "C" {
#include "src/backend/cpu/cpu_ops.h"
}
#include "tests/emu/emu_util.h"

static loom_ctx *ctx;

static void attn_case(int64_t Hq, int64_t Hkv, int64_t D, std::vector<int32_t> cu, bool subset) {
    const int64_t T = cu.back(), nd = (int64_t)cu.size() - 1;
    std::vector<int32_t> qidx;
    for (int32_t t = 0; t < T; t++)
        if (!subset || t % 3 != 1) qidx.push_back(t);
    const int64_t Tq = (int64_t)qidx.size();
    printf("attention %s T %lld Tq %lld Hq %lld Hkv %lld D %lld docs %lld\n", BF ? "bf16" : "f32",
           (long long)T, (long long)Tq, (long long)Hq, (long long)Hkv, (long long)D, (long long)nd);
    const float scale = 1.0f / sqrtf((float)D);
    auto q = rnd(Tq * Hq * D, -1, 1, true), k = rnd(T * Hkv * D, -1, 1, true);
    auto v = rnd(T * Hkv * D, -1, 1, true), dout = rnd(Tq * Hq * D, -1, 1, true);
    std::vector<float> o(Tq * Hq * D), lse(Tq * Hq), dq(Tq * Hq * D), dk(T * Hkv * D),
        dv(T * Hkv * D);
    const int32_t *qi = subset ? qidx.data() : nullptr;
    loom_cpu_attention_fwd_q(q.data(), qi, Tq, k.data(), v.data(), T, Hq, Hkv, D, cu.data(), nd,
                             scale, o.data(), lse.data());
    // the backward from the device's own forward output, rounded as it is
    const loom_dtype dt = BF ? LOOM_BF16 : LOOM_F32;
    int32_t *CU = (int32_t *)malloc(cu.size() * 4), *QI = (int32_t *)malloc(qidx.size() * 4);
    memcpy(CU, cu.data(), cu.size() * 4), memcpy(QI, qidx.data(), qidx.size() * 4);
    std::vector<float> got[5];
    for (int ord = 0; ord < 3; ord++) {
        emu_order = ord;
        void *Q = dev(q, true), *K = dev(k, true), *V = dev(v, true), *DO = dev(dout, true);
        void *O = outb(Tq * Hq * D, true), *L = outb(Tq * Hq, false);
        void *DQ = outb(Tq * Hq * D, true), *DK = outb(T * Hkv * D, true),
             *DV = outb(T * Hkv * D, true);
        if (loom_cuda_attention_fwd_q(ctx, Q, subset ? QI : nullptr, Tq, K, V, dt, T, Hq, Hkv, D,
                                      CU, nd, scale, O, (float *)L, nullptr) ||
            loom_cuda_attention_bwd_q(ctx, DO, Q, subset ? QI : nullptr, Tq, K, V, O,
                                      (float *)L, dt, T, Hq, Hkv, D, CU, nd, scale, DQ, DK, DV,
                                      nullptr)) {
            printf("  %s\n", loom_last_error(ctx));
            exit(1);
        }
        std::vector<float> r[5] = {back(O, Tq * Hq * D, true), back(L, Tq * Hq, false),
                                   back(DQ, Tq * Hq * D, true), back(DK, T * Hkv * D, true),
                                   back(DV, T * Hkv * D, true)};
        if (ord == 0) {
            for (int i = 0; i < 5; i++) got[i] = r[i];
            loom_cpu_attention_bwd_q(dout.data(), q.data(), qi, Tq, k.data(), v.data(),
                                     got[0].data(), got[1].data(), T, Hq, Hkv, D, cu.data(), nd,
                                     scale, dq.data(), dk.data(), dv.data());
        } else {
            for (int i = 0; i < 5; i++)
                if (memcmp(r[i].data(), got[i].data(), r[i].size() * 4)) {
                    printf("  ORDER %d differs from ascending (output %d): a race <<<<< FAIL\n",
                           ord, i);
                    fails++;
                }
        }
        for (void *p : {Q, K, V, DO, O, L, DQ, DK, DV}) free(p);
    }
    const double tol = BF ? 3e-2 : 1e-4;
    cmp("out", got[0], o, tol);
    cmp("lse", got[1], lse, BF ? 1e-2 : 1e-5);
    cmp("dq", got[2], dq, tol);
    cmp("dk", got[3], dk, tol);
    cmp("dv", got[4], dv, tol);
    free(CU), free(QI);
}

int main(int argc, char **argv) {
    loom_ctx_create(&ctx);
    for (int b = 0; b < 2; b++) {
        BF = b; // bf16 with D 64 or 128: the tensor-core kernels
        attn_case(4, 2, 64, {0, 37, 150}, false);
        attn_case(2, 1, 128, {0, 70, 71, 130}, false);
        attn_case(4, 2, 64, {0, 90, 160}, true);
        // the bitwise-repeatable backward (a dq kernel of its own, no atomics)
        setenv("LOOM_ATTN_DETERMINISTIC", "1", 1);
        attn_case(4, 2, 64, {0, 37, 150}, false);
        attn_case(2, 1, 128, {0, 90, 160}, true);
        unsetenv("LOOM_ATTN_DETERMINISTIC");
        if (argc > 1) {
            attn_case(8, 2, 128, {0, 300}, false);
            attn_case(2, 2, 32, {0, 40, 100}, false); // not a tensor-core D: CUDA cores
        }
    }
    printf("%d failures\n", fails);
    return fails != 0;
}
