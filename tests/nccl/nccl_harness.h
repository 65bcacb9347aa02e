/* The NCCL test program (make CUDA=1 test-nccl): the TEST/CHECK macros of
 * tests/harness.h, in-process, in the same order on every rank.
 *
 *   loom_nccl_tests [filter...]           one rank per process: under mpirun,
 *                                         or with RANK/WORLD_SIZE/MASTER_ADDR
 *                                         set, or alone (one rank)
 *   loom_nccl_tests --spawn N [filter...] starts N ranks of itself with
 *                                         RANK/WORLD_SIZE/LOCAL_RANK/
 *                                         MASTER_ADDR=127.0.0.1/MASTER_PORT
 *                                         (the TCP rendezvous) and waits
 *   loom_nccl_tests --cpu [filter...]     the tests named cpu_* (launcher
 *                                         variables, the rendezvous): no GPU
 *
 * With a world, tests whose name does not start with cpu_ run; after each,
 * the ranks agree on the verdict through the world group and rank 0 prints
 * it. A test must make the same collective calls on every rank: prefer
 * CHECK to REQUIRE before a collective. */
#ifndef LOOM_NCCL_HARNESS_H
#define LOOM_NCCL_HARNESS_H

#include "../harness.h"
#include "../../src/comm/comm_impl.h"

/* The world group (backend "nccl") and its context; NULL in --cpu mode. */
loom_comm *nt_world(void);
loom_ctx *nt_ctx(void);
int nt_rank(void);
int nt_size(void);

#endif
