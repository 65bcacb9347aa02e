/* Runner of the NCCL tests (see nccl_harness.h). */

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdlib.h>

#include "nccl_harness.h"

static loom_comm *world;
static loom_ctx *ctx;

loom_comm *nt_world(void) { return world; }
loom_ctx *nt_ctx(void) { return ctx; }
int nt_rank(void) { return world ? loom_comm_rank(world) : 0; }
int nt_size(void) { return world ? loom_comm_size(world) : 1; }

static bool is_cpu(const char *name) { return strncmp(name, "cpu_", 4) == 0; }

/* ---- --cpu: tests without a world ---- */

static int run_cpu(int argc, char **argv) {
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < loom_test_count(); i++) {
        const loom_test_entry *t = loom_test_at(i);
        if (!is_cpu(t->name) || !loom_test_selected(t->name, argc, argv)) continue;
        loom_clear_error(ctx);
        const double t0 = loom_test_now_ms();
        bool bad = false;
        int skip = loom_ranks_run(t, &bad);
        if (bad)
            failed++;
        else if (skip)
            skipped++;
        else
            passed++;
        printf("%s %-44s %8.1f ms  (%s)\n", bad ? "FAIL" : skip ? "skip" : "ok  ", t->name,
               loom_test_now_ms() - t0, t->file);
        fflush(stdout);
    }
    loom_test_summary(passed, failed, skipped);
    return failed ? 1 : 0;
}

/* ---- with a world ---- */

/* Every rank's (failed, skipped) through the world group. */
static bool agree(int mine_fail, int mine_skip, int *flags, int *dev) {
    int size = nt_size();
    int h[2] = {mine_fail, mine_skip};
    if (cudaMemcpy(dev, h, sizeof h, cudaMemcpyHostToDevice) != cudaSuccess) return false;
    if (loom_comm_allgather(world, dev, dev + 2, 2, LOOM_I32) != LOOM_OK) return false;
    return cudaMemcpy(flags, dev + 2, sizeof(int) * 2 * (size_t)size, cudaMemcpyDeviceToHost) ==
           cudaSuccess;
}

static int run_world(int argc, char **argv) {
    loom_status st = loom_comm_world(ctx, LOOM_COMM_NCCL, &world);
    if (st != LOOM_OK) {
        fprintf(stderr, "loom_nccl_tests: loom_comm_world(NCCL): %s: %s\n", loom_status_str(st),
                loom_last_error(ctx));
        return 2;
    }
    int rank = nt_rank(), size = nt_size();
    if (rank == 0) {
        int v = 0;
        char name[256] = "?";
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, loom_comm_device(world)) == cudaSuccess)
            snprintf(name, sizeof name, "%s", prop.name);
        cudaRuntimeGetVersion(&v);
        int nv = 0;
        ncclGetVersion(&nv);
        printf("world: %d rank(s), backend %s, NCCL %d (headers %d), CUDA runtime %d, rank 0 on "
               "GPU %d (%s), NCCL_NVLS_ENABLE=%s, started by %s\n",
               size, loom_comm_backend_name(world), nv, NCCL_VERSION_CODE, v,
               loom_comm_device(world), name,
               getenv("NCCL_NVLS_ENABLE") ? getenv("NCCL_NVLS_ENABLE") : "(unset)",
               getenv("OMPI_COMM_WORLD_SIZE") ? "mpirun" : getenv("RANK") ? "RANK/WORLD_SIZE"
                                                                          : "nothing (one rank)");
        fflush(stdout);
    }
    int *flags = calloc((size_t)size * 2, sizeof *flags), *dev = NULL;
    if (!flags || cudaMalloc((void **)&dev, sizeof(int) * (2 + 2 * (size_t)size)) != cudaSuccess) {
        fprintf(stderr, "loom_nccl_tests: out of memory\n");
        return 2;
    }
    int passed = 0, failed = 0, skipped = 0;
    for (int i = 0; i < loom_test_count(); i++) {
        const loom_test_entry *t = loom_test_at(i);
        if (is_cpu(t->name) || !loom_test_selected(t->name, argc, argv)) continue;
        loom_clear_error(ctx);
        const double t0 = loom_test_now_ms();
        bool bad = false;
        int skip = loom_ranks_run(t, &bad);
        if (!agree(bad ? 1 : 0, skip, flags, dev)) {
            fprintf(stderr, "[rank %d] %s: the ranks could not agree on the verdict: %s\n", rank,
                    t->name, loom_last_error(ctx));
            loom_comm_abort(world, "verdict exchange failed", 3);
        }
        int n_bad = 0, any_skip = 0;
        for (int r = 0; r < size; r++) {
            n_bad += flags[2 * r] != 0;
            any_skip |= flags[2 * r + 1];
        }
        if (n_bad)
            failed++;
        else if (any_skip)
            skipped++;
        else
            passed++;
        if (rank == 0) loom_ranks_verdict(t, t0, n_bad, any_skip, flags, 2);
    }
    if (rank == 0) loom_test_summary(passed, failed, skipped);
    cudaFree(dev);
    free(flags);
    loom_comm_free(world); /* finalises MPI when it bootstrapped the world */
    return failed ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "--spawn") == 0)
        return loom_test_spawn(atoi(argv[2]), argc - 3, argv + 3, "loom_nccl_tests",
                               "LOOM_NCCL_SPAWN_TIMEOUT");
    if (loom_ctx_create(&ctx) != LOOM_OK) return 2;
    loom_ranks_init(nt_rank, nt_size);
    int rc;
    if (argc >= 2 && strcmp(argv[1], "--cpu") == 0)
        rc = run_cpu(argc - 2, argv + 2);
    else
        rc = run_world(argc - 1, argv + 1);
    loom_ctx_free(ctx);
    return rc;
}
