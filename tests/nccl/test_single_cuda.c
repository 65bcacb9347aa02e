/* The one-process (single) backend of a CUDA build: host-only collectives
 * never start CUDA, and on device buffers its copies (send != recv) go
 * through cudaMemcpy. Runs without a world (loom_nccl_tests --cpu). As in
 * test_rendezvous.c, CUDA is used only in a forked child, so the test
 * process itself never starts CUDA; the device part skips when no GPU is
 * visible. */

#include <cuda_runtime_api.h>
#include <link.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nccl_harness.h"

#define NO_GPU 77

/* The child cannot report through CHECK (its counts stay in the child):
 * it prints each failure and exits with their number. */
static int child_fails;

static void child_fail(int line, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "    [child] %s:%d: %s\n", __FILE__, line, msg);
    child_fails++;
}

#define EXPECT(cond, ...)                                                       \
    do {                                                                        \
        if (!(cond)) child_fail(__LINE__, __VA_ARGS__);                         \
    } while (0)
#define EXPECT_OK(expr)                                                         \
    do {                                                                        \
        loom_status st_ = (expr);                                               \
        EXPECT(st_ == LOOM_OK, "%s: %s: %s", #expr, loom_status_str(st_),       \
               loom_last_error(nt_ctx()));                                      \
    } while (0)

static int is_libcuda(struct dl_phdr_info *info, size_t size, void *data) {
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    const char *base = strrchr(name, '/');
    return strncmp(base ? base + 1 : name, "libcuda.so", 10) == 0;
}

static void *dmalloc(size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc(%zu) failed\n", bytes);
        _exit(100);
    }
    return p;
}

static void up(void *d, const void *h, size_t bytes) {
    if (cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) != cudaSuccess) _exit(101);
}

static void down(void *h, const void *d, size_t bytes) {
    if (cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) _exit(102);
}

/* Elements of got[0..n) that differ from want[0..n). */
static size_t n_diff(const float *got, const float *want, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += got[i] != want[i];
    return bad;
}

/* In the child: the single backend on device, pinned and managed memory. */
static int device_part(void) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1) return NO_GPU;
    loom_ctx *ctx = nt_ctx();
    loom_comm *w = NULL;
    if (loom_comm_world(ctx, LOOM_COMM_SINGLE, &w) != LOOM_OK) return 103;

    enum { N = 300007 };
    size_t bytes = sizeof(float) * N, bad;
    float *h = malloc(bytes), *g = malloc(bytes);
    if (!h || !g) return 104;
    for (int i = 0; i < N; i++) h[i] = 0.5f * (float)(i % 4099) - 3.f;
    float *d1 = dmalloc(bytes), *d2 = dmalloc(bytes);
    up(d1, h, bytes);
    EXPECT(loom_comm_cuda_in_use(), "device memory exists but loom_comm_cuda_in_use() is false");

    /* device -> device, device -> host, host -> device */
    cudaMemset(d2, 0, bytes);
    EXPECT_OK(loom_comm_allgather(w, d1, d2, N, LOOM_F32));
    down(g, d2, bytes);
    EXPECT((bad = n_diff(g, h, N)) == 0, "allgather device -> device: %zu wrong", bad);
    memset(g, 0, bytes);
    EXPECT_OK(loom_comm_reduce_scatter(w, d1, g, N, LOOM_F32, LOOM_RED_SUM));
    EXPECT((bad = n_diff(g, h, N)) == 0, "reduce_scatter device -> host: %zu wrong", bad);
    cudaMemset(d2, 0, bytes);
    EXPECT_OK(loom_comm_alltoall(w, h, d2, N, LOOM_F32));
    down(g, d2, bytes);
    EXPECT((bad = n_diff(g, h, N)) == 0, "alltoall host -> device: %zu wrong", bad);
    /* in place, and the one-rank no-ops, leave the data as it is */
    EXPECT_OK(loom_comm_allgather(w, d1, d1, N, LOOM_F32));
    EXPECT_OK(loom_comm_reduce_scatter(w, d1, d1, N, LOOM_F32, LOOM_RED_MAX));
    EXPECT_OK(loom_comm_allreduce(w, d1, N, LOOM_F32, LOOM_RED_SUM));
    EXPECT_OK(loom_comm_broadcast(w, d1, N, LOOM_F32, 0));
    down(g, d1, bytes);
    EXPECT((bad = n_diff(g, h, N)) == 0, "in place on device: %zu wrong", bad);
    /* async: done at once */
    loom_comm_req *req = (loom_comm_req *)1;
    cudaMemset(d2, 0, bytes);
    EXPECT_OK(loom_comm_allgather_async(w, d1, d2, N, LOOM_F32, &req));
    EXPECT(req == NULL, "allgather_async gave a request");
    EXPECT_OK(loom_comm_wait(w, req));
    down(g, d2, bytes);
    EXPECT((bad = n_diff(g, h, N)) == 0, "allgather_async device -> device: %zu wrong", bad);
    /* overlapping device buffers: d1[1..N) = old d1[0..N-1) */
    EXPECT_OK(loom_comm_alltoall(w, d1, d1 + 1, N - 1, LOOM_F32));
    down(g, d1, bytes);
    bad = (g[0] != h[0]) + n_diff(g + 1, h, N - 1);
    EXPECT(bad == 0, "overlapping alltoall on device: %zu wrong", bad);
    /* bytes of any dtype: BF16 bit patterns (NaNs too), an odd U8 count */
    uint16_t hb[7], gb[7];
    for (int i = 0; i < 7; i++) hb[i] = (uint16_t)(0x7fc1 + 977 * i);
    uint16_t *db = dmalloc(sizeof hb);
    EXPECT_OK(loom_comm_allgather(w, hb, db, 7, LOOM_BF16));
    down(gb, db, sizeof gb);
    EXPECT(memcmp(gb, hb, sizeof hb) == 0, "BF16 host -> device changed the bits");
    uint8_t hu[13], gu[13];
    for (int i = 0; i < 13; i++) hu[i] = (uint8_t)(i * 19);
    uint8_t *du = dmalloc(sizeof hu);
    EXPECT_OK(loom_comm_alltoall(w, hu, du, 13, LOOM_U8));
    EXPECT_OK(loom_comm_allgather(w, du, gu, 13, LOOM_U8));
    EXPECT(memcmp(gu, hu, sizeof hu) == 0, "U8 host -> device -> host changed the bytes");
    /* pinned host and managed memory (d1 + 1 holds h[0..N-1) now) */
    float *pin = NULL, *man = NULL;
    if (cudaMallocHost((void **)&pin, bytes) != cudaSuccess) return 105;
    if (cudaMallocManaged((void **)&man, bytes, cudaMemAttachGlobal) != cudaSuccess) return 106;
    EXPECT_OK(loom_comm_allgather(w, d1 + 1, pin, N - 1, LOOM_F32));
    EXPECT((bad = n_diff(pin, h, N - 1)) == 0, "allgather device -> pinned: %zu wrong", bad);
    EXPECT_OK(loom_comm_alltoall(w, pin, man, N - 1, LOOM_F32));
    EXPECT(cudaDeviceSynchronize() == cudaSuccess, "cudaDeviceSynchronize failed");
    EXPECT((bad = n_diff(man, h, N - 1)) == 0, "alltoall pinned -> managed: %zu wrong", bad);
    EXPECT_OK(loom_comm_allgather(w, man, d2, N - 1, LOOM_F32));
    down(g, d2, bytes);
    EXPECT((bad = n_diff(g, h, N - 1)) == 0, "allgather managed -> device: %zu wrong", bad);
    cudaFreeHost(pin);
    cudaFree(man);
    cudaFree(db);
    cudaFree(du);
    cudaFree(d1);
    cudaFree(d2);
    free(h);
    free(g);
    loom_comm_free(w);
    return child_fails > 50 ? 50 : child_fails;
}

TEST(cpu_single_backend_device_buffers) {
    loom_ctx *ctx = nt_ctx();
    loom_comm *w = NULL;
    REQUIRE_OK(ctx, loom_comm_world(ctx, LOOM_COMM_SINGLE, &w));
    CHECK_STR(loom_comm_backend_name(w), "single");

    /* host buffers: memmove, touching no CUDA (when nothing loaded the
     * driver before, it stays unloaded) */
    bool in_use = loom_comm_cuda_in_use();
    bool loaded = dl_iterate_phdr(is_libcuda, NULL) != 0;
    int64_t hs[4] = {1, 2, 3, 4}, hr[4] = {0, 0, 0, 0};
    CHECK_OK(ctx, loom_comm_allgather(w, hs, hr, 4, LOOM_I64));
    for (int i = 0; i < 4; i++) CHECK_EQ_INT(hr[i], i + 1);
    CHECK_OK(ctx, loom_comm_reduce_scatter(w, hs, hr + 1, 3, LOOM_I64, LOOM_RED_SUM));
    CHECK_EQ_INT(hr[0], 1);
    for (int i = 1; i < 4; i++) CHECK_EQ_INT(hr[i], i);
    int32_t o[5] = {1, 2, 3, 4, 5};
    CHECK_OK(ctx, loom_comm_alltoall(w, o, o + 1, 4, LOOM_I32)); /* overlapping */
    for (int i = 0; i < 5; i++) CHECK_EQ_INT(o[i], i == 0 ? 1 : i);
    if (!loaded)
        CHECK_MSG(!dl_iterate_phdr(is_libcuda, NULL),
                  "host-only collectives of the single backend loaded the CUDA driver");
    if (!in_use) CHECK(!loom_comm_cuda_in_use());
    loom_comm_free(w);
    if (in_use) SKIP("this process used CUDA before the test: no forked child can use it");

    /* device buffers, in a child */
    fflush(stdout);
    fflush(stderr);
    pid_t c = fork();
    REQUIRE(c >= 0);
    if (c == 0) _exit(device_part());
    int status = 0, rc = -1;
    if (waitpid(c, &status, 0) == c)
        rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (rc == NO_GPU) SKIP("no CUDA device is visible");
    CHECK_MSG(rc == 0, "the device part exited with %d (failures are printed above; 100-106: "
              "a CUDA allocation, copy or the world failed)", rc);
}
