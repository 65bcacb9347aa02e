/* Collectives over process groups. One interface, four backends: a
 * one-process backend (every group has one rank; collectives copy or do
 * nothing), MPI (CPU ranks under mpirun), Gloo (CPU ranks without MPI:
 * torchrun, Slurm, Ray; see "The Gloo backend" below) and NCCL (GPU ranks,
 * on CUDA streams; built with `make CUDA=1`, see "The NCCL backend").
 *
 * Semantics follow NCCL so that the NCCL backend fits without changing
 * callers:
 *  - buffers are plain pointers. MPI: host memory only (a loom built with
 *    CUDA does not make MPI CUDA-aware; pair MPI with host buffers). NCCL:
 *    device memory of the rank's GPU (or managed memory), or host memory
 *    (pageable or pinned), staged through device memory; send and recv
 *    buffers may be of either kind (see "The NCCL backend"). Single: host
 *    or device memory; in a CUDA build its copies (send != recv) go
 *    through cudaMemcpy when either buffer is device memory and are
 *    complete on return; a process that never started CUDA copies with
 *    memmove without calling CUDA.
 *    Gloo: host memory. Counts are in elements of `dt` (MPI: at most
 *    INT_MAX elements per call, counting every rank's block);
 *  - a collective is called by every rank of the group, in the same order;
 *  - reductions (allreduce, reduce_scatter) take F32, F64, I32 and I64 on
 *    every backend, and BF16 and F16 on NCCL and the one-process backend
 *    (GPU activations); MPI and Gloo refuse those with LOOM_ERR_UNSUPPORTED
 *    (reduce an F32 copy). Data movement (allgather,
 *    broadcast, alltoall, send/recv) takes every dtype;
 *  - send/recv between group_start() and group_end() are posted together
 *    and all complete at group_end() (NCCL's ncclGroupStart/End), so a rank
 *    may send to and receive from its neighbours in one group without
 *    deadlock. Inside a group neither buffer may be touched until
 *    group_end() returns. Collectives called inside a group run at once;
 *  - outside a group, send returns once the data is copied (the buffer may
 *    be reused at once) and does not wait for the receiver, so two ranks may
 *    send to each other and then receive; recv blocks until the data is in;
 *  - messages are matched by (peer, tag), tags in [0, 32768). The NCCL
 *    backend will match in order instead (it has no tags): keep the order
 *    of sends to and receives from each peer the same on both sides;
 *  - the *_async variants return a request to wait on; the buffers must not
 *    be touched until loom_comm_wait returns. *req may be NULL when the
 *    operation completed at once (the single backend; NCCL when a buffer
 *    is host memory); loom_comm_wait(c, NULL) returns LOOM_OK.
 *
 * A failed or timed-out operation returns LOOM_ERR_COMM with a message that
 * names the operation, the group and the rank. Blocking waits give up after
 * LOOM_COMM_TIMEOUT seconds (environment, read when the world is created;
 * default 300, 0 = never) or loom_comm_set_timeout; a group whose collective
 * timed out cannot be used again. loom_comm_abort ends every process of the
 * job (the CLI calls it when a rank fails, so no rank waits forever on a
 * peer that has gone). */
#ifndef LOOM_COMM_H
#define LOOM_COMM_H

#include "../core/core.h"

typedef struct loom_comm loom_comm;
typedef struct loom_comm_req loom_comm_req;

typedef enum loom_comm_backend {
    LOOM_COMM_AUTO = 0, /* MPI when started by an MPI launcher (OMPI_COMM_WORLD_SIZE,
                         * PMI_SIZE or PMIX_RANK set) or MPI is already initialised, in a
                         * build with MPI; else Gloo when the launcher's variables ask for
                         * several ranks (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE,
                         * SLURM_PROCID/SLURM_NTASKS); else single. The environment variable
                         * LOOM_COMM_BACKEND=mpi|gloo|single|auto overrides the choice. */
    LOOM_COMM_SINGLE,
    LOOM_COMM_MPI,
    LOOM_COMM_NCCL, /* GPU ranks (make CUDA=1); never chosen by AUTO */
    LOOM_COMM_GLOO, /* CPU ranks without MPI (a build with libgloo-dev) */
} loom_comm_backend;

typedef enum loom_red_op { LOOM_RED_SUM = 0, LOOM_RED_MAX } loom_red_op;

/* The world group. With MPI: initialises MPI (MPI_THREAD_FUNNELED, once per
 * process, unless the program already did), sets the context's rank for
 * log prefixes (loom_ctx_set_rank). Errors go to `ctx` for the life of the
 * group and of every group split from it. Backends not built in give
 * LOOM_ERR_UNSUPPORTED with what to rebuild; AUTO started by an MPI
 * launcher in a loom built without MPI (and without RANK/WORLD_SIZE), or
 * asked for several ranks in a loom without Gloo, is refused the same way
 * (rather than running N copies that each believe they are rank 0). */
loom_status loom_comm_world(loom_ctx *ctx, loom_comm_backend backend, loom_comm **out);
/* Frees a group (NULL is a no-op); waits for this group's outstanding sends
 * first. Freeing the world group finalises MPI when loom initialised it,
 * once every group split from it is freed too. */
void loom_comm_free(loom_comm *c);
int loom_comm_rank(const loom_comm *c);
int loom_comm_size(const loom_comm *c);
const char *loom_comm_backend_name(const loom_comm *c); /* "single", "mpi", "gloo", "nccl" */
const char *loom_comm_name(const loom_comm *c);         /* "world", "tp", ... */
loom_ctx *loom_comm_ctx(const loom_comm *c);            /* where its errors go */
/* Seconds a blocking wait on this group may take before it fails
 * (<= 0: forever). Groups split later inherit it. */
void loom_comm_set_timeout(loom_comm *c, double seconds);
/* The next alltoall, alltoallv, allgather, allgatherv or reduce_scatter on c
 * returns once its work is queued, when every buffer is device memory
 * (NCCL): the group's stream orders it with the legacy default stream both ways, so
 * kernels after it read its results, and the host does not wait for a
 * transfer no host code reads. An operation of another group after it
 * waits for it on the GPU (it may read what the deferred one wrote).
 * loom_comm_settle waits for it (with the group's deadline); call it
 * before anything that waits on the GPU without one (cudaMemcpy). Other
 * backends complete the call as usual. */
void loom_comm_defer(loom_comm *c);
/* Waits for c's deferred operations (a no-op when none are pending). */
loom_status loom_comm_settle(loom_comm *c);
/* NCCL groups: the CUDA device of this rank (set current by loom_comm_world)
 * and the cudaStream_t the group's operations run on. -1 and NULL on the
 * other backends. */
int loom_comm_device(const loom_comm *c);
void *loom_comm_stream(const loom_comm *c);

/* Partition of `parent`: ranks with the same color (>= 0) form a group,
 * ordered by key (then parent rank). A rank passing color < 0 joins no
 * group and gets *out = NULL. Called by every rank of the parent. `name`
 * labels the group in messages ("tp", "dp", ...). */
loom_status loom_comm_split(loom_comm *parent, int color, int key, const char *name,
                            loom_comm **out);
/* A group of this rank alone: what loom_comm_split with a color of each
 * rank's own returns, made as cheaply as the backend can. Called by every
 * rank of the parent, as split is (a backend without a cheaper way splits).
 * On NCCL it is no communicator at all: no collective to make it and none of
 * the device memory an NCCL communicator holds (hundreds of MiB each, even
 * for one rank); its collectives are copies on its stream, and send/recv to
 * itself is refused, as on the single backend. */
loom_status loom_comm_split_self(loom_comm *parent, const char *name, loom_comm **out);

/* In place: buf (n) = op over ranks of buf. */
loom_status loom_comm_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt, loom_red_op op);
/* send (n * size) -> recv (n): rank r receives op over ranks of send[r*n, (r+1)*n).
 * recv may equal send + rank*n. */
loom_status loom_comm_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                     loom_dtype dt, loom_red_op op);
/* send (n) -> recv (n * size), rank r's block at r*n. send may equal recv + rank*n. */
loom_status loom_comm_allgather(loom_comm *c, const void *send, void *recv, size_t n,
                                loom_dtype dt);
loom_status loom_comm_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root);
/* Collective verdicts on a step every rank took (c may be NULL: one process).
 * agree_all: each rank's status st; a rank that failed keeps its own error,
 * the others fail with the first failing rank's code and "<what> failed on
 * rank q (its message says why)". agree_root: root's status is every
 * rank's (the others' message says the same of root). A failed collective
 * is returned as it is. */
loom_status loom_comm_agree_all(loom_ctx *ctx, loom_comm *c, loom_status st, const char *what);
loom_status loom_comm_agree_root(loom_ctx *ctx, loom_comm *c, loom_status st, int root,
                                 const char *what);
/* send (n * size) -> recv (n * size): block r of send goes to rank r. */
loom_status loom_comm_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                               loom_dtype dt);
/* Blocks of varying size: send holds scount[r] elements for each rank r in
 * rank order, recv receives rcount[r] from each rank r in rank order (the
 * counts must agree pairwise: the caller exchanged them). One group of
 * point-to-point messages (empty blocks are not sent); the MoE dispatch. */
loom_status loom_comm_alltoallv(loom_comm *c, const void *send, const size_t *scount, void *recv,
                                const size_t *rcount, loom_dtype dt);
/* Several alltoallv's (n <= LOOM_A2AV_MAX, each its own buffers, counts and
 * dtype) in one group of point-to-point messages: on NCCL one launch and
 * one wait instead of n (the MoE dispatch's tables with its rows). */
#define LOOM_A2AV_MAX 8
typedef struct loom_a2av {
    const void *send;
    const size_t *scount;
    void *recv;
    const size_t *rcount;
    loom_dtype dt;
} loom_a2av;
loom_status loom_comm_alltoallv_n(loom_comm *c, const loom_a2av *v, int n);
/* Every rank's block of varying size to every rank: send (n elements) to
 * all, recv gets rcount[r] from each rank r in rank order (the counts
 * agree: rcount[self] == n). One group of point-to-point messages. */
loom_status loom_comm_allgatherv(loom_comm *c, const void *send, size_t n, void *recv,
                                 const size_t *rcount, loom_dtype dt);
/* Point to point, peer = rank in c, 0 <= tag < 32768 (see the top of this
 * file for when buffers may be reused). Sending to oneself is an error on
 * the single backend. */
loom_status loom_comm_send(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer,
                           int tag);
loom_status loom_comm_recv(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer,
                           int tag);
/* Per group c; they nest, and what was posted on c completes at the
 * outermost group_end. Splitting c inside a group is refused. */
loom_status loom_comm_group_start(loom_comm *c);
loom_status loom_comm_group_end(loom_comm *c);
/* Every rank of c has arrived. Does not wait for outstanding sends (their
 * receives may come after it). */
loom_status loom_comm_barrier(loom_comm *c);

loom_status loom_comm_allreduce_async(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                      loom_red_op op, loom_comm_req **req);
loom_status loom_comm_reduce_scatter_async(loom_comm *c, const void *send, void *recv, size_t n,
                                           loom_dtype dt, loom_red_op op, loom_comm_req **req);
loom_status loom_comm_allgather_async(loom_comm *c, const void *send, void *recv, size_t n,
                                      loom_dtype dt, loom_comm_req **req);
/* Waits for and frees the request (NULL is a no-op). */
loom_status loom_comm_wait(loom_comm *c, loom_comm_req *req);

/* Ends every process of the job after printing "loom: error on rank R:
 * <msg>" to stderr (MPI_Abort; single and Gloo: _exit/exit(code), see "The
 * Gloo backend"). Never returns. Only
 * cli/ calls it; with cli/ it is the only code that ends the process. c may
 * be NULL (then this process exits alone). */
void loom_comm_abort(loom_comm *c, const char *msg, int code) __attribute__((noreturn));

/* The NCCL backend (LOOM_COMM_NCCL; src/comm/comm_nccl.c).
 *
 * Start: one process per GPU. Under mpirun (a loom built with MPI) the MPI
 * world bootstraps it: rank 0's ncclUniqueId is broadcast over MPI, which
 * stays initialised until the last NCCL group is freed. Otherwise the
 * launcher's variables give the ranks (RANK/WORLD_SIZE, else
 * OMPI_COMM_WORLD_RANK/SIZE, else SLURM_PROCID/SLURM_NTASKS; none: one
 * rank) and rank 0 hands the id to the others over TCP: it listens on
 * MASTER_PORT (default 29500; under torchrun, which holds that port for its
 * own store, MASTER_PORT + 1; LOOM_MASTER_PORT overrides both) and the
 * others connect to MASTER_ADDR at that port, retrying until
 * LOOM_COMM_TIMEOUT. Each rank uses the GPU of
 * its local rank (LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
 * else its position among the ranks on its host; GPU 0 when only one is
 * visible). NCCL_NVLS_ENABLE=0 is set unless the environment sets it.
 *
 * Buffers are device memory of that GPU (or managed memory), used as they
 * are, or host memory (pageable, or pinned with cudaMallocHost /
 * cudaHostRegister), which is staged: copied into a device buffer on the
 * group's stream when the operation reads it (allreduce; the send buffer
 * of reduce_scatter, allgather, alltoall and send; broadcast at the root),
 * then copied back when it writes it (allreduce; the recv buffer of
 * reduce_scatter, allgather, alltoall and recv; broadcast except at the
 * root). Send and recv buffers may be of different kinds. Device memory
 * of another GPU is refused. An operation with a host buffer:
 *  - first waits, within the timeout, for the group's earlier operations
 *    when it copies a host buffer in;
 *  - is complete when it returns, results written to host memory
 *    included; so are the async variants (they give *req = NULL);
 *  - except send outside a group: it returns once the data is on the GPU
 *    (the host buffer may be reused at once) and stays queued like a
 *    device send;
 *  - inside group_start/group_end, send/recv of host buffers are posted
 *    like device ones; the received data reaches the host buffers at
 *    group_end, which returns when it has.
 * Staging costs a copy each way and a wait, so it suits small buffers
 * (losses, norms, per-token outputs); large tensors belong in device
 * memory.
 * Operations run on the group's stream (loom_comm_stream), which is a
 * blocking stream: work on the legacy default stream (stream 0, cudaMemcpy)
 * is ordered with it both ways; order work on other streams with events.
 * Blocking calls and loom_comm_wait return when the operation is complete
 * on the GPU; they poll the stream and ncclCommGetAsyncError and give up
 * after the timeout, aborting the NCCL communicator (the group cannot be
 * used again; its error names the operation, the group and the rank).
 *
 * Differences from MPI, which callers must respect to run on both:
 *  - point to point is matched in the order posted to each peer, not by
 *    tag (the tag is checked for range, then ignored): keep the order of
 *    sends to and receives from each peer the same on both sides;
 *  - outside a group, send is queued on the stream and returns without
 *    waiting (stream-ordered reuse of the buffer is safe), but it completes
 *    only when the peer receives, and recv waits for it: two ranks that
 *    exchange data must post both directions in one group_start/group_end;
 *    a send followed by a blocking recv from a rank that also sends first
 *    times out;
 *  - inside a group, point to point is posted into an NCCL group (process
 *    wide: don't interleave the groups of two loom groups), and a
 *    collective called after a send or recv of the same group is refused;
 *    group_end waits for completion;
 *  - a timed-out recv leaves the group unusable (NCCL cannot cancel);
 *  - zero-element operations return at once without calling NCCL. */

/* The Gloo backend (LOOM_COMM_GLOO; src/comm/comm_gloo.cc, a C++ shim over
 * Debian's libgloo-dev, built when the Makefile finds it: GLOO=auto|0).
 *
 * Start: one process per rank, told its place by the launcher's variables
 * as for NCCL above (RANK/WORLD_SIZE, OMPI_COMM_WORLD_RANK/SIZE,
 * SLURM_PROCID/SLURM_NTASKS; MASTER_ADDR, MASTER_PORT default 29500): no
 * MPI. Each rank opens Gloo's TCP transport on the address that routes to
 * MASTER_ADDR (GLOO_SOCKET_IFNAME names an interface instead) and the
 * ranks exchange their connection addresses over loom's TCP rendezvous
 * (rank 0 listens on MASTER_PORT; a rank that cannot start fails every
 * rank, naming it). Splits exchange theirs over the parent group.
 *
 * Semantics are the MPI backend's: host buffers, matching by (peer, tag),
 * sends outside a group copied (the copies are released as they complete,
 * by a thread of the group), send/recv inside a group posted together and
 * completed at group_end, the *_async variants complete before they
 * return (their request is already done), reduce_scatter is an alltoall
 * then a reduction in rank order.
 * Differences:
 *  - a timed-out wait (collective, recv or group_end) leaves the group
 *    unusable: Gloo closes every connection of the group when a wait times
 *    out (MPI cancels a timed-out receive), so the peers' next operation on
 *    it fails at once too;
 *  - a failed or timed-out collective names the members not in it: a thread
 *    of every rank answers "where are you?" on a second connection mesh of
 *    the group, like the MPI backend's diagnosis;
 *  - loom_comm_abort ends this process only (Gloo has no MPI_Abort): its
 *    connections close, so a peer waiting on it fails at once, and one
 *    waiting on another rank within the timeout, naming the missing rank. */

#endif /* LOOM_COMM_H */
