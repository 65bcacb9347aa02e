// A CPU emulator of CUDA kernels for checking their logic where no GPU is
// (tests/emu): one block at a time, its threads as ucontext fibers run one
// at a time between barriers, in the order emu_order picks (ascending,
// descending or random, blocks too), so a kernel whose result depends on
// the order has a race. __syncthreads waits for the block; __shfl_xor_sync
// for the warp's live lanes (a lane that exited or waits at a barrier
// meanwhile is reported). Dynamic shared memory is filled with NaN first:
// a read before a write shows. Launch limits are checked as a GPU would
// (threads, grid, the shared memory opt-in). tools/cuda_emu/pre.py turns a
// .cu into the C++ this runs.
#include <cuda_runtime.h>
#include <map>
#include <vector>
#include <deque>
#include <algorithm>
#include <random>
#include <ucontext.h>
#include <sanitizer/asan_interface.h>

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
int emu_order = 0; // 0 ascending, 1 descending, 2 random (threads and blocks)
static std::mt19937 rng(1234);
static int last_err = 0;
static std::map<const void *, int> attrs;
static const int OPTIN = 232448;
cudaError_t cudaGetLastError() { int e = last_err; last_err = 0; return e; }
const char *cudaGetErrorString(cudaError_t e) { return e ? "emulated launch error" : "no error"; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return 0; }
// A device of EMU_SMS multiprocessors (small, so that the choices made by
// the grid's size take both ways in the tests' small cases).
static const int EMU_SMS = 16;
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int) {
    *v = a == cudaDevAttrMultiProcessorCount ? EMU_SMS : OPTIN;
    return 0;
}
cudaError_t emu_set_attr(const void *f, int v) {
    if (v > OPTIN) return cudaErrorInvalidValue;
    attrs[f] = v; return 0;
}
void emu_poison(void *p, size_t n) { ASAN_POISON_MEMORY_REGION(p, n); }

enum { RUN, BAR, WARP, WCALL, DONE };
// A cp.async of n bytes: src read when it is issued, dst written when its
// group is waited for (so a read of dst before its wait sees the old bytes).
struct cp_pending { char *dst; char bytes[16]; int n; };
struct fib {
    ucontext_t ctx; int state; double val, res; int xo; char *stack; uint3 idx;
    void *mine; void (*fn)(void *const *); // WCALL: this lane's data, the warp's operation
    std::vector<cp_pending> open;                // issued, not yet committed
    std::deque<std::vector<cp_pending>> groups;  // committed, not yet waited for
};
static std::vector<fib> F;
static ucontext_t mainctx;
static int cur;
static std::function<void()> *body;
static void *dsmem;
static const size_t STK = 1 << 18;
static const char *kname;

void *emu_dyn_smem() { return dsmem; }
static void yield(int st) { F[cur].state = st; swapcontext(&F[cur].ctx, &mainctx); }
void __syncthreads() { yield(BAR); }
double emu_shfl_xor(double v, int o) {
    F[cur].val = v; F[cur].xo = o; int me = cur;
    yield(WARP);
    return F[me].res; // set when the warp is released
}
// A warp-wide operation (mma, ldmatrix): every lane of the warp arrives with
// its data; fn then runs once on the 32 lanes' pointers (in lane order).
void emu_warp_call(void *mine, void (*fn)(void *const *)) {
    F[cur].mine = mine; F[cur].fn = fn;
    yield(WCALL);
}
void emu_cp_async(void *dst, const void *src, int n, bool valid) {
    cp_pending c{(char *)dst, {}, n};
    if (valid) memcpy(c.bytes, src, n);
    F[cur].open.push_back(c);
}
void emu_cp_commit() { F[cur].groups.push_back(std::move(F[cur].open)); F[cur].open.clear(); }
void emu_cp_wait(int n) {
    auto &q = F[cur].groups;
    while ((int)q.size() > n) {
        for (auto &c : q.front()) memcpy(c.dst, c.bytes, c.n);
        q.pop_front();
    }
}
static void entry() { (*body)(); F[cur].state = DONE; swapcontext(&F[cur].ctx, &mainctx); }

static void die(const char *m) { fprintf(stderr, "EMU ERROR in %s block (%u,%u,%u): %s\n", kname, blockIdx.x, blockIdx.y, blockIdx.z, m); abort(); }

static void run_block(int n) {
    if ((int)F.size() < n) { size_t o = F.size(); F.resize(n); for (int i = o; i < n; i++) F[i].stack = (char *)malloc(STK); }
    std::vector<int> perm(n);
    for (int i = 0; i < n; i++) perm[i] = emu_order == 1 ? n - 1 - i : i;
    for (int i = 0; i < n; i++) {
        F[i].state = RUN;
        F[i].open.clear(), F[i].groups.clear();
        getcontext(&F[i].ctx);
        F[i].ctx.uc_stack.ss_sp = F[i].stack; F[i].ctx.uc_stack.ss_size = STK; F[i].ctx.uc_link = nullptr;
        makecontext(&F[i].ctx, entry, 0);
        F[i].idx = uint3{(unsigned)(i % blockDim.x), (unsigned)(i / blockDim.x % blockDim.y), (unsigned)(i / (blockDim.x * blockDim.y))};
    }
    for (;;) {
        bool ran = false;
        if (emu_order == 2) std::shuffle(perm.begin(), perm.end(), rng);
        for (int k = 0; k < n; k++) {
            int t = perm[k];
            if (F[t].state != RUN) continue;
            cur = t; threadIdx = F[t].idx;
            swapcontext(&mainctx, &F[t].ctx);
            ran = true;
        }
        if (ran) continue;
        // resolve: warps whose live lanes are all at a shuffle
        bool rel = false; int ndone = 0, nbar = 0, nwarp = 0;
        for (int w0 = 0; w0 < n; w0 += 32) {
            int at = 0, dn = 0, bar = 0, wc = 0;
            for (int l = w0; l < w0 + 32 && l < n; l++) {
                at += F[l].state == WARP; dn += F[l].state == DONE; bar += F[l].state == BAR;
                wc += F[l].state == WCALL;
            }
            if (wc) {
                if (wc != 32) die("a warp-wide operation without all 32 lanes of the warp");
                void *lanes[32];
                for (int l = 0; l < 32; l++) {
                    if (F[w0 + l].fn != F[w0].fn) die("lanes in different warp-wide operations");
                    lanes[l] = F[w0 + l].mine;
                }
                F[w0].fn(lanes);
                for (int l = w0; l < w0 + 32; l++) F[l].state = RUN;
                rel = true;
                continue;
            }
            if (at && (dn || bar)) die("shuffle with lanes exited or at a barrier");
            if (at) {
                for (int l = w0; l < w0 + 32; l++) if (F[l].xo != F[w0].xo) die("lanes shuffle with different offsets");
                for (int l = w0; l < w0 + 32; l++) F[l].res = F[w0 + ((l - w0) ^ F[l].xo)].val;
                for (int l = w0; l < w0 + 32; l++) F[l].state = RUN;
                rel = true;
            }
            ndone += dn; nbar += bar; nwarp += at;
        }
        if (rel) continue;
        if (ndone == n) break;
        if (nbar) {
            if (ndone) die("__syncthreads with some threads exited");
            for (int i = 0; i < n; i++) F[i].state = RUN;
            continue;
        }
        die("deadlock");
    }
}

void emu_launch(const void *f, const char *name, dim3 g, dim3 b, size_t smem, std::function<void()> bd) {
    kname = name;
    unsigned nt = b.x * b.y * b.z;
    if (nt == 0 || nt > 1024 || g.y > 65535 || g.z > 65535 || g.x == 0 || g.y == 0 || g.z == 0) {
        fprintf(stderr, "EMU: bad launch config of %s\n", name); last_err = cudaErrorInvalidConfiguration; return;
    }
    if (smem > 49152) {
        auto it = attrs.find(f);
        if (it == attrs.end() || (size_t)it->second < smem) {
            fprintf(stderr, "EMU: %s: %zu bytes of dynamic smem without the attribute\n", name, smem);
            last_err = cudaErrorInvalidConfiguration; return;
        }
    }
    gridDim = g; blockDim = b; body = &bd;
    std::vector<dim3> blocks;
    for (unsigned z = 0; z < g.z; z++) for (unsigned y = 0; y < g.y; y++) for (unsigned x = 0; x < g.x; x++) blocks.push_back(dim3(x, y, z));
    if (emu_order == 1) std::reverse(blocks.begin(), blocks.end());
    if (emu_order == 2) std::shuffle(blocks.begin(), blocks.end(), rng);
    for (auto &bb : blocks) {
        blockIdx = uint3{bb.x, bb.y, bb.z};
        dsmem = smem ? malloc(smem) : nullptr;
        if (smem) memset(dsmem, 0xff, smem); // NaN: uninitialised reads show
        run_block(nt);
        free(dsmem);
    }
}
