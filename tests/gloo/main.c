/* Runner of the Gloo tests (make test-gloo): tests/mpi's collective and
 * mesh tests, and tests/gloo's own, on the Gloo backend with no MPI
 * launcher (tests/mpi/mpi_harness.h says how the tests are written).
 *
 *   loom_gloo_tests [filter...]            one rank per process, placed by
 *                                          RANK/WORLD_SIZE/MASTER_ADDR/
 *                                          MASTER_PORT (torchrun, Slurm), or
 *                                          alone (one rank)
 *   loom_gloo_tests --spawn N [filter...]  starts N ranks of itself with
 *                                          those variables and waits
 *
 * After each test the ranks agree on the verdict through the world group
 * and rank 0 prints it. */
#include <stdlib.h>

#include "../mpi/mpi_harness.h"

static loom_comm *world;
static loom_ctx *ctx;

loom_comm *mt_world(void) { return world; }
loom_ctx *mt_ctx(void) { return ctx; }
int mt_rank(void) { return world ? loom_comm_rank(world) : 0; }
int mt_size(void) { return world ? loom_comm_size(world) : 1; }
const char *mt_backend(void) { return "gloo"; }

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "--spawn") == 0)
        return loom_test_spawn(atoi(argv[2]), argc - 3, argv + 3, "loom_gloo_tests",
                               "LOOM_GLOO_SPAWN_TIMEOUT");
    if (loom_ctx_create(&ctx) != LOOM_OK) return 2;
    loom_ranks_init(mt_rank, mt_size);
    if (loom_comm_world(ctx, LOOM_COMM_GLOO, &world) != LOOM_OK) {
        fprintf(stderr, "loom_gloo_tests: loom_comm_world(GLOO): %s\n", loom_last_error(ctx));
        loom_ctx_free(ctx);
        return 2;
    }
    int rank = mt_rank(), size = mt_size();
    int passed = 0, failed = 0, skipped = 0;
    int *flags = calloc((size_t)size * 2, sizeof *flags);
    if (!flags) return 2;
    for (int i = 0; i < loom_test_count(); i++) {
        const loom_test_entry *t = loom_test_at(i);
        if (!loom_test_selected(t->name, argc - 1, argv + 1)) continue;
        loom_clear_error(ctx);
        const double t0 = loom_test_now_ms();
        bool bad = false;
        int skip = loom_ranks_run(t, &bad);
        int mine[2] = {bad ? 1 : 0, skip};
        if (loom_comm_allgather(world, mine, flags, 2, LOOM_I32) != LOOM_OK) {
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
    free(flags);
    loom_comm_free(world);
    loom_ctx_free(ctx);
    return failed ? 1 : 0;
}
