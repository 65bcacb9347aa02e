// The CUDA Gated DeltaNet ops (src/backend/cuda/ops_gdn.cu, ops_gdn_rule.cu)
// run on the CPU by the emulator (tools/cuda_emu: every thread of a block a
// fiber, barriers and warp shuffles kept, blocks and threads in ascending,
// descending and random order) against the CPU reference (cpu_gdn.h, in
// double) on fresh random inputs, fp32 and bf16; the three orders must give
// the same bits (a race would not). `make test-emu`; with an argument, the
// larger cases too. Runs where no GPU is, as CI: the kernels' logic, bounds
// (under SAN=1: AddressSanitizer on the buffers and the workspace's padding)
// and synchronisation, not their speed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "src/backend/cuda/cuda_ops.h"
#include "src/backend/gdn_ws.h"
extern "C" {
#include "src/backend/cpu/cpu_gdn.h"
}
#include "tests/emu/emu_util.h"

static loom_ctx *ctx;
static void *scr(size_t b) { void *p = malloc(b + 1); memset(p, 0xff, b + 1); return p; }
struct res { std::vector<float> o, dq, dg, db; };
// keep: the forward's arrays in a keep buffer (gdn_ws.h) for the backward, with room for the
// documents' chunk bound; its bytes start as NaN
static res rule_gpu(const std::vector<float> &qkv, const std::vector<float> &g, const std::vector<float> &be, const std::vector<float> &dout,
                    int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, const std::vector<int32_t> &cu, bool keep = false) {
    int64_t nd = cu.size() - 1, C = 2 * Hk * dk + Hv * dv;
    loom_dtype dt = BF ? LOOM_BF16 : LOOM_F32;
    int32_t *CU = (int32_t *)malloc(cu.size() * 4); memcpy(CU, cu.data(), cu.size() * 4);
    void *Q = dev(qkv, true), *G = dev(g, false), *B = dev(be, false), *DO = dev(dout, true);
    void *O = outb(T * Hv * dv, true), *DQ = outb(T * C, true), *DG = outb(T * Hv, false), *DB = outb(T * Hv, false);
    const int64_t kc = keep ? loom_gdn_ws_chunks(T, nd) : 0;
    const size_t kb = keep ? loom_cuda_gdn_keep_bytes(T, Hk, Hv, dk, dv, dt, kc) : 0;
    void *K = kb ? scr(kb) : nullptr;
    size_t sb = loom_cuda_gdn_scratch_bytes(T, Hk, Hv, dk, dv, nd, false, dt, K ? kc : 0);
    void *S = scr(sb);
    loom_status st = loom_cuda_gdn_fwd(ctx, Q, dt, (float *)G, (float *)B, T, Hk, Hv, dk, dv, CU, nd, O, S, K, kc, nullptr);
    if (st) { printf("fwd: %s\n", loom_last_error(ctx)); exit(1); }
    free(S);
    sb = loom_cuda_gdn_scratch_bytes(T, Hk, Hv, dk, dv, nd, true, dt, K ? kc : 0);
    S = scr(sb);
    st = loom_cuda_gdn_bwd(ctx, DO, Q, dt, (float *)G, (float *)B, T, Hk, Hv, dk, dv, CU, nd, DQ, (float *)DG, (float *)DB, S, K, kc, nullptr);
    if (st) { printf("bwd: %s\n", loom_last_error(ctx)); exit(1); }
    free(S);
    free(K);
    res r{back(O, T * Hv * dv, true), back(DQ, T * C, true), back(DG, T * Hv, false), back(DB, T * Hv, false)};
    free(CU); free(Q); free(G); free(B); free(DO); free(O); free(DQ); free(DG); free(DB);
    return r;
}
static bool same_bits(const res &a, const res &b) {
    return !memcmp(a.o.data(), b.o.data(), a.o.size() * 4) && !memcmp(a.dq.data(), b.dq.data(), a.dq.size() * 4) &&
           !memcmp(a.dg.data(), b.dg.data(), a.dg.size() * 4) && !memcmp(a.db.data(), b.db.data(), a.db.size() * 4);
}
static void rule_case(int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, std::vector<int32_t> cu, float glo = -0.6f, float ghi = -0.01f) {
    int64_t T = cu.back(), nd = cu.size() - 1, C = 2 * Hk * dk + Hv * dv;
    printf("rule %s T %lld Hk %lld Hv %lld dk %lld dv %lld docs %lld\n", BF ? "bf16" : "f32", (long long)T, (long long)Hk, (long long)Hv, (long long)dk, (long long)dv, (long long)nd);
    auto qkv = rnd(T * C, -1, 1, true), dout = rnd(T * Hv * dv, -1, 1, true);
    auto g = rnd(T * Hv, glo, ghi, false), be = rnd(T * Hv, 0.05f, 0.95f, false);
    std::vector<float> o(T * Hv * dv), dq(T * C), dg(T * Hv), db(T * Hv);
    loom_cpu_gdn_fwd(ctx, qkv.data(), g.data(), be.data(), T, Hk, Hv, dk, dv, cu.data(), nd, o.data());
    loom_cpu_gdn_bwd(ctx, dout.data(), qkv.data(), g.data(), be.data(), T, Hk, Hv, dk, dv, cu.data(), nd, dq.data(), dg.data(), db.data());
    res r[3];
    for (int ord = 0; ord < 3; ord++) { emu_order = ord; r[ord] = rule_gpu(qkv, g, be, dout, T, Hk, Hv, dk, dv, cu); }
    double tol = BF ? 3e-2 : 1e-3;
    cmp("o", r[0].o, o, tol); cmp("dqkv", r[0].dq, dq, tol); cmp("dg", r[0].dg, dg, tol); cmp("dbeta", r[0].db, db, tol);
    for (int ord = 1; ord < 3; ord++) if (!same_bits(r[0], r[ord])) { printf("  ORDER %d differs from ascending: a race <<<<< FAIL\n", ord); fails++; }
    if (loom_cuda_gdn_keep_bytes(T, Hk, Hv, dk, dv, BF ? LOOM_BF16 : LOOM_F32, 1)) { // the keep buffer: the same bits
        emu_order = 2;
        const res k = rule_gpu(qkv, g, be, dout, T, Hk, Hv, dk, dv, cu, true);
        printf("  with a keep buffer: %s\n", same_bits(r[0], k) ? "the same bits" : "DIFFERENT <<<<< FAIL");
        fails += !same_bits(r[0], k);
    }
}
void small_ops(int64_t D);
// two outputs bit for bit
static void same(const char *what, const std::vector<float> &a, const std::vector<float> &b) {
    const bool ok = a.size() == b.size() && !memcmp(a.data(), b.data(), a.size() * 4);
    printf("  %-28s %s\n", what, ok ? "the same bits" : "DIFFERENT <<<<< FAIL");
    fails += !ok;
}
static void conv_case(int64_t K, int64_t T = 150, int64_t C = 40,
                      std::vector<int32_t> cu = {0, 2, 3, 70, 101, 150});
int main(int argc, char **argv) {
    loom_ctx_create(&ctx);
    for (int b = 0; b < 2; b++) {
        BF = b;
        /* the norm's rows: bf16 at D 48 and 128 by half-warps, f32 in registers
         * (D <= 128); D 160 in passes */
        for (int64_t D : {48, 128, 160})
            small_ops(D);
        for (int64_t K : {4, 3, 6})
            conv_case(K);
        conv_case(4, 300, 48, {0, 260, 300}); /* rows [64, 256) in one document: unchecked */
        conv_case(4, 300, 41, {0, 5, 70, 300}); /* an odd C: no channel pairs */
        rule_case(2, 4, 32, 48, {0, 3, 70, 150});
        rule_case(1, 1, 16, 16, {0, 128});
        rule_case(1, 2, 128, 160, {0, 130, 197});
        rule_case(2, 2, 64, 64, {0, 1, 65, 100});
        rule_case(1, 2, 20, 18, {0, 70, 90}); /* sizes not a multiple of 4: the staging's plain loads */
        rule_case(1, 1, 136, 24, {0, 40, 70}); /* dk > 128: no tensor cores, l2_bwd in passes */
        rule_case(1, 2, 17, 15, {0, 70, 90}); /* odd dk and dv: chunk_bwd's column pairs split */
        rule_case(1, 2, 32, 128, {0, 70, 90}); /* dv a multiple of 64: prep's raw blocks a block ahead */
        if (argc > 1) {
            rule_case(1, 2, 128, 144, {0, 64, 65, 129, 200});
            rule_case(1, 2, 128, 128, {0, 250});
            rule_case(2, 4, 40, 24, {0, 5, 6, 130, 131});
        }
    }
    /* the state passes' units of eight warps: one a block (one head), at Qwen3.5's dk = dv =
       128 (FULL: constant dimensions) and around it; four units of four warps a block (FULL:
       blocks of two would be 24, more than the emulator's 16 multiprocessors); two a block
       (FULL: 8 blocks of two). After the cases above, whose inputs stay those they had before
       these (one random stream). */
    for (int b = 0; b < 2; b++) {
        BF = b;
        rule_case(1, 1, 128, 128, {0, 150});
        rule_case(1, 1, 64, 48, {0, 10, 140});
        rule_case(1, 2, 128, 128, {0, 64, 65, 150});
        rule_case(1, 1, 128, 128, {0, 70, 150});
    }
    /* the backward's staged rows (conv_bwd_staged_kernel: 256 channels a block) over two
       blocks, the second with 8 channels and threads past C */
    for (int b = 0; b < 2; b++) {
        BF = b;
        conv_case(4, 200, 264, {0, 3, 130, 200});
    }
    printf("%d failures\n", fails);
    return fails != 0;
}
// the convolution with kernel K (4: Qwen3.5's, its own kernels; 3: K below
// that bound; 6: the wider kernels) over documents shorter and longer than K
static void conv_case(int64_t K, int64_t T, int64_t C, std::vector<int32_t> cu) {
    const int64_t nd = (int64_t)cu.size() - 1;
    loom_dtype dt = BF ? LOOM_BF16 : LOOM_F32;
    double tol = BF ? 3e-2 : 1e-4;
    printf("conv K %lld T %lld C %lld %s\n", (long long)K, (long long)T, (long long)C,
           BF ? "bf16" : "f32");
    auto x = rnd(T * C, -1, 1, true), w = rnd(C * K, -1, 1, true), dy = rnd(T * C, -1, 1, true), dw0 = rnd(C * K, -1, 1, false);
    std::vector<float> y(T * C), dx(T * C), dw = dw0;
    loom_cpu_gdn_conv_fwd(ctx, x.data(), w.data(), T, C, K, cu.data(), nd, y.data());
    loom_cpu_gdn_conv_bwd(ctx, dy.data(), x.data(), w.data(), T, C, K, cu.data(), nd, dx.data(), dw.data());
    int32_t *CU = (int32_t *)malloc(cu.size() * 4); memcpy(CU, cu.data(), cu.size() * 4);
    for (int ord = 0; ord < 3; ord += 2) {
        emu_order = ord;
        void *X = dev(x, true), *W = dev(w, true), *DY = dev(dy, true), *Y = outb(T * C, true), *DX = outb(T * C, true), *DW = dev(dw0, false);
        void *S = scr(loom_cuda_gdn_conv_scratch_bytes(T, C, K));
        if (loom_cuda_gdn_conv_fwd(ctx, X, W, dt, T, C, K, CU, nd, Y, nullptr) ||
            loom_cuda_gdn_conv_bwd(ctx, DY, X, W, dt, T, C, K, CU, nd, DX, (float *)DW, S, nullptr)) { printf("%s\n", loom_last_error(ctx)); exit(1); }
        cmp("conv y", back(Y, T * C, true), y, tol); cmp("conv dx", back(DX, T * C, true), dx, tol); cmp("conv dw", back(DW, C * K, false), dw, tol);
        for (void *p : {X, W, DY, Y, DX, DW, S}) free(p);
    }
    free(CU);
}
void small_ops(int64_t D) {
    const int64_t T = 150, H = 6, N = T * H;
    loom_dtype dt = BF ? LOOM_BF16 : LOOM_F32;
    double tol = BF ? 3e-2 : 1e-4;
    printf("small ops D %lld %s\n", (long long)D, BF ? "bf16" : "f32");
    auto a = rnd(T * H, -4, 4, true), b = rnd(T * H, -4, 4, true), al = rnd(H, -1, 1, true), dtb = rnd(H, -1, 1, true);
    a[0] = 25, a[1] = 21;
    auto dg = rnd(T * H, -1, 1, false), dbe = rnd(T * H, -1, 1, false), dal0 = rnd(H, -1, 1, false), ddt0 = rnd(H, -1, 1, false);
    auto nx = rnd(N * D, -2, 2, true), nz = rnd(N * D, -3, 3, true), nw = rnd(D, -1, 1, true), ndy = rnd(N * D, -1, 1, true), ndw0 = rnd(D, -1, 1, false);
    // cpu
    std::vector<float> g(T * H), be(T * H), da(T * H), db(T * H), dal = dal0, ddt = ddt0;
    std::vector<float> ny(N * D), rs(N), ndx(N * D), ndz(N * D), ndw = ndw0;
    loom_cpu_gdn_gate_fwd(ctx, a.data(), b.data(), al.data(), dtb.data(), T, H, g.data(), be.data());
    loom_cpu_gdn_gate_bwd(ctx, dg.data(), dbe.data(), a.data(), b.data(), al.data(), dtb.data(), T, H, da.data(), db.data(), dal.data(), ddt.data());
    loom_cpu_gdn_norm_fwd(ctx, nx.data(), nz.data(), nw.data(), N, D, 1e-6f, ny.data(), rs.data());
    loom_cpu_gdn_norm_bwd(ctx, ndy.data(), nx.data(), nz.data(), nw.data(), rs.data(), N, D, ndx.data(), ndz.data(), ndw.data());
    for (int ord = 0; ord < 3; ord += 2) {
        emu_order = ord;
        void *A = dev(a, true), *B = dev(b, true), *AL = dev(al, true), *DT = dev(dtb, true), *G = outb(T * H, false), *BE = outb(T * H, false);
        void *DG = dev(dg, false), *DBE = dev(dbe, false), *DA = outb(T * H, true), *DB = outb(T * H, true), *DAL = dev(dal0, false), *DDT = dev(ddt0, false);
        void *S = scr(loom_cuda_gdn_gate_scratch_bytes(T, H));
        if (loom_cuda_gdn_gate_fwd(ctx, A, B, AL, DT, dt, T, H, (float *)G, (float *)BE, nullptr) ||
            loom_cuda_gdn_gate_bwd(ctx, (float *)DG, (float *)DBE, A, B, AL, DT, dt, T, H, DA, DB, (float *)DAL, (float *)DDT, S, nullptr)) { printf("%s\n", loom_last_error(ctx)); exit(1); }
        cmp("gate g", back(G, T * H, false), g, tol); cmp("gate beta", back(BE, T * H, false), be, tol);
        cmp("gate da", back(DA, T * H, true), da, tol); cmp("gate db", back(DB, T * H, true), db, tol);
        cmp("gate dA_log", back(DAL, H, false), dal, tol); cmp("gate ddt_bias", back(DDT, H, false), ddt, tol);
        free(S);
        void *NX = dev(nx, true), *NZ = dev(nz, true), *NW = dev(nw, true), *NDY = dev(ndy, true), *NY = outb(N * D, true), *RS = outb(N, false);
        void *NDX = outb(N * D, true), *NDZ = outb(N * D, true), *NDW = dev(ndw0, false);
        S = scr(loom_cuda_gdn_norm_scratch_bytes(N, D));
        if (loom_cuda_gdn_norm_fwd(ctx, NX, NZ, NW, dt, N, D, 1e-6f, NY, (float *)RS, nullptr) ||
            loom_cuda_gdn_norm_bwd(ctx, NDY, NX, NZ, NW, dt, (float *)RS, N, D, NDX, NDZ, (float *)NDW, S, nullptr)) { printf("%s\n", loom_last_error(ctx)); exit(1); }
        cmp("norm y", back(NY, N * D, true), ny, tol); cmp("norm rstd", back(RS, N, false), rs, tol);
        cmp("norm dx", back(NDX, N * D, true), ndx, tol); cmp("norm dz", back(NDZ, N * D, true), ndz, tol); cmp("norm dw", back(NDW, D, false), ndw, tol);
        /* without dw (a frozen norm weight): the same dx and dz */
        void *NDX2 = outb(N * D, true), *NDZ2 = outb(N * D, true);
        if (loom_cuda_gdn_norm_bwd(ctx, NDY, NX, NZ, NW, dt, (float *)RS, N, D, NDX2, NDZ2, nullptr, nullptr, nullptr)) { printf("%s\n", loom_last_error(ctx)); exit(1); }
        same("norm dx without dw", back(NDX2, N * D, true), back(NDX, N * D, true));
        same("norm dz without dw", back(NDZ2, N * D, true), back(NDZ, N * D, true));
        free(NDX2), free(NDZ2);
        free(S);
        for (void *p : {A, B, AL, DT, G, BE, DG, DBE, DA, DB, DAL, DDT, NX, NZ, NW, NDY, NY, RS, NDX, NDZ, NDW}) free(p);
    }
}
