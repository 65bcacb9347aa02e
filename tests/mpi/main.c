/* Runner of the MPI tests (see mpi_harness.h). Arguments are substrings:
 * only tests whose name contains one of them run. The verdicts are agreed
 * with plain MPI on MPI_COMM_WORLD, independent of the code under test. */

#include <mpi.h>
#include <stdlib.h>

#include "mpi_harness.h"

static loom_comm *world;
static loom_ctx *ctx;

loom_comm *mt_world(void) { return world; }
loom_ctx *mt_ctx(void) { return ctx; }
int mt_rank(void) { return loom_comm_rank(world); }
int mt_size(void) { return loom_comm_size(world); }
const char *mt_backend(void) { return "mpi"; }

int main(int argc, char **argv) {
    if (loom_ctx_create(&ctx) != LOOM_OK) return 2;
    if (loom_comm_world(ctx, LOOM_COMM_AUTO, &world) != LOOM_OK) {
        fprintf(stderr, "loom_comm_world: %s\n", loom_last_error(ctx));
        return 2;
    }
    if (strcmp(loom_comm_backend_name(world), "mpi") != 0) {
        fprintf(stderr, "loom_mpi_tests: the world backend is '%s', not mpi: run under mpirun\n",
                loom_comm_backend_name(world));
        loom_comm_free(world);
        loom_ctx_free(ctx);
        return 2;
    }
    loom_ranks_init(mt_rank, mt_size);
    int rank = mt_rank(), size = mt_size();
    int passed = 0, failed = 0, skipped = 0;
    int *flags = calloc((size_t)size, sizeof *flags);
    for (int i = 0; i < loom_test_count(); i++) {
        const loom_test_entry *t = loom_test_at(i);
        if (!loom_test_selected(t->name, argc - 1, argv + 1)) continue;
        loom_clear_error(ctx);
        const double t0 = loom_test_now_ms();
        bool bad = false;
        int skip = loom_ranks_run(t, &bad);
        int mine = bad ? 1 : 0, any_skip = 0;
        MPI_Gather(&mine, 1, MPI_INT, flags, 1, MPI_INT, 0, MPI_COMM_WORLD);
        MPI_Allreduce(&skip, &any_skip, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        int n_bad = 0;
        MPI_Allreduce(&mine, &n_bad, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        if (n_bad)
            failed++;
        else if (any_skip)
            skipped++;
        else
            passed++;
        if (rank == 0) loom_ranks_verdict(t, t0, n_bad, any_skip, flags, 1);
    }
    free(flags);
    if (rank == 0) loom_test_summary(passed, failed, skipped);
    loom_comm_free(world); /* finalises MPI: loom initialised it */
    loom_ctx_free(ctx);
    return failed ? 1 : 0;
}
