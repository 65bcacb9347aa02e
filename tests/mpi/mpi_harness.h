/* The MPI test program (make test-mpi): the TEST/CHECK macros of
 * tests/harness.h, run by every rank of `mpirun -np N`, in-process and in
 * the same order on every rank (MPI processes cannot fork per test). The
 * Gloo test program (tests/gloo, make test-gloo) runs test_comm.c and
 * test_mesh.c too, on ranks started without MPI. A
 * failure prints with its rank; after each test the ranks agree on the
 * verdict, and rank 0 prints it and the closing line "N passed, M failed".
 *
 * A test must make the same collective calls on every rank: prefer CHECK
 * to REQUIRE before a collective (a rank that returns early leaves the
 * others waiting until LOOM_COMM_TIMEOUT). */
#ifndef LOOM_MPI_HARNESS_H
#define LOOM_MPI_HARNESS_H

#include "../harness.h"
#include "../../src/comm/comm.h"

/* The world group (backend "mpi" under mpirun, "gloo" in tests/gloo) and
 * its context; the backend the program tests. */
loom_comm *mt_world(void);
const char *mt_backend(void);
loom_ctx *mt_ctx(void);
int mt_rank(void);
int mt_size(void);

#endif
