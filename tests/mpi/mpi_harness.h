/* The MPI test program (make test-mpi): the TEST/CHECK macros of
 * tests/harness.h, run by every rank of `mpirun -np N`, in-process and in
 * the same order on every rank (MPI processes cannot fork per test). A
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

/* The world group (backend "mpi" under mpirun) and its context. */
loom_comm *mt_world(void);
loom_ctx *mt_ctx(void);
int mt_rank(void);
int mt_size(void);

#endif
