/* Inside src/comm: the group object and the table each backend fills.
 * comm.c checks arguments (dtypes, ranks, tags, sizes, group nesting) once
 * for every backend, then calls the backend through its table. */
#ifndef LOOM_COMM_IMPL_H
#define LOOM_COMM_IMPL_H

#include "comm.h"

typedef struct loom_comm_vt {
    const char *name; /* "single", "mpi", "gloo", "nccl" */
    void (*free)(loom_comm *c);
    loom_status (*split)(loom_comm *parent, int color, int key, const char *name,
                         loom_comm **out);
    /* Collectives: req == NULL means complete before returning; otherwise
     * the backend may set *req to a request (or to NULL when done at once). */
    loom_status (*allreduce)(loom_comm *c, void *buf, size_t n, loom_dtype dt, loom_red_op op,
                             loom_comm_req **req);
    loom_status (*reduce_scatter)(loom_comm *c, const void *send, void *recv, size_t n,
                                  loom_dtype dt, loom_red_op op, loom_comm_req **req);
    loom_status (*allgather)(loom_comm *c, const void *send, void *recv, size_t n,
                             loom_dtype dt, loom_comm_req **req);
    loom_status (*broadcast)(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root);
    loom_status (*alltoall)(loom_comm *c, const void *send, void *recv, size_t n,
                            loom_dtype dt);
    /* c->group_depth > 0: post, complete in group_end. */
    loom_status (*send)(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer,
                        int tag);
    loom_status (*recv)(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer, int tag);
    /* Called when the outermost group ends: completes what was posted. */
    loom_status (*group_end)(loom_comm *c);
    loom_status (*barrier)(loom_comm *c);
    /* Waits for and frees a request of this backend. */
    loom_status (*wait)(loom_comm *c, loom_comm_req *req);
    void (*abort)(loom_comm *c, int code) __attribute__((noreturn));
    /* Optional (NULL: -1 / NULL): loom_comm_device, loom_comm_stream. */
    int (*device)(const loom_comm *c);
    void *(*stream)(const loom_comm *c);
    /* Optional (NULL: nothing is ever deferred): loom_comm_settle. */
    loom_status (*settle)(loom_comm *c);
    /* Optional (NULL: split with color = parent rank): loom_comm_split_self. */
    loom_status (*split_self)(loom_comm *parent, const char *name, loom_comm **out);
} loom_comm_vt;

struct loom_comm {
    const loom_comm_vt *vt;
    loom_ctx *ctx;        /* where errors go (the world's context) */
    char name[32];        /* "world", "tp", ... */
    int rank, size;
    int group_depth;      /* group_start() nesting */
    double timeout_s;     /* blocking waits give up after this; <= 0: never */
    bool broken;          /* an operation failed or timed out and left the group unusable */
    bool defer_next;      /* loom_comm_defer: the next alltoall(v) / allgather(v) /
                           * reduce_scatter may return
                           * once queued (the backend clears it when it completes a call) */
    void *impl;           /* the backend's state */
};

/* Every request starts with this (backends embed it as their first member). */
struct loom_comm_req {
    loom_comm *comm;
};

/* Allocates a group with the common fields set (vt, ctx, name, rank, size,
 * timeout from `like` when given). NULL (OOM error set) on failure. */
loom_comm *loom_comm_new(loom_ctx *ctx, const loom_comm_vt *vt, const char *name, int rank,
                         int size, const loom_comm *like);
/* "group 'dp' (rank 1 of 2)", for messages. */
const char *loom_comm_where(const loom_comm *c, char *buf, size_t cap);
/* LOOM_COMM_TIMEOUT (seconds, default 300, 0 = wait forever). */
loom_status loom_comm_env_timeout(loom_ctx *ctx, double *out);

/* Copies `bytes` from src to dst (the ranges may overlap) for operation
 * `what` of group c: the one place where src/comm copies buffers that may
 * be device memory. Without CUDA, or when no device memory can exist yet
 * (loom_comm_cuda_in_use), memmove, calling no CUDA function. Otherwise
 * each pointer is looked up with cudaPointerGetAttributes: two host
 * pointers are still memmove'd; when either is device (or managed) memory
 * the copy is a cudaMemcpy (cudaMemcpyDefault) on the legacy default
 * stream, finished before returning. Errors (LOOM_ERR_COMM, LOOM_ERR_OOM)
 * name the operation, the group and the rank. The MPI backend does not use
 * it: its buffers are host memory (comm.h). */
loom_status loom_comm_copy(loom_comm *c, const char *what, void *dst, const void *src,
                           size_t bytes);
/* Whether device memory can exist in this process: false in a build
 * without CUDA, and false while the CUDA driver (libcuda) is not loaded,
 * not initialised, or holds no context (none current on this thread, no
 * primary context active); with glibc before 2.34 (no dlopen in libc),
 * false only while libcuda is not loaded. Answered without initialising or
 * creating anything; once true, stays true. */
bool loom_comm_cuda_in_use(void);

#ifdef LOOM_HAVE_MPI
loom_status loom_comm_mpi_world(loom_ctx *ctx, loom_comm **out);
bool loom_comm_mpi_initialized(void);
#endif

#ifdef LOOM_HAVE_GLOO
/* comm_gloo.cc (C++, extern "C") */
loom_status loom_comm_gloo_world(loom_ctx *ctx, loom_comm **out);
#endif

#ifdef LOOM_HAVE_CUDA
loom_status loom_comm_nccl_world(loom_ctx *ctx, loom_comm **out);
#endif

/* ---- launcher variables and the TCP rendezvous (rendezvous.c) ---- */

/* Where this process stands in a job started without MPI, from the
 * launcher's environment (see "The NCCL backend" in comm.h). */
typedef struct loom_launch {
    int rank, size;
    int local_rank;          /* -1: not given */
    const char *rank_var;    /* "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", NULL (default) */
    const char *local_var;   /* the variable local_rank came from, or NULL */
    char addr[256];          /* MASTER_ADDR ("" when unset) */
    int port;                /* LOOM_MASTER_PORT, else MASTER_PORT (29500 when unset), plus
                              * one under torchrun (TORCHELASTIC_RUN_ID set), whose agent
                              * listens on MASTER_PORT itself */
} loom_launch;
loom_status loom_launch_from_env(loom_ctx *ctx, loom_launch *out);

/* Every rank of `size` calls this once: rank 0 listens on `port` (every
 * interface), the others connect to addr:port, retrying until timeout_s
 * (<= 0: forever). Each rank reports `ok` and, if not, `why`; rank 0 then
 * sends every rank its local rank (its position among the ranks with the
 * same host name), the number of ranks on its host and, when all were ok,
 * rank 0's `blob` (len bytes; the others receive it there). When a rank was
 * not ok every rank fails with LOOM_ERR_COMM naming it. Errors name the
 * address, the port and the variables they came from. */
loom_status loom_rendezvous(loom_ctx *ctx, const char *addr, int port, int rank, int size,
                            double timeout_s, bool ok, const char *why, void *blob, size_t len,
                            int *local_rank, int *local_size);

/* The same meeting, where every rank brings `len` bytes (`mine`, the same
 * len on every rank, at most 1 MiB and 64 MiB in all) and every rank
 * receives all of them in rank order in `all` (size * len bytes). The
 * Gloo backend exchanges its connection addresses with it. */
loom_status loom_rendezvous_allgather(loom_ctx *ctx, const char *addr, int port, int rank,
                                      int size, double timeout_s, bool ok, const char *why,
                                      const void *mine, size_t len, void *all, int *local_rank,
                                      int *local_size);

/* The numeric address of this host on the route to addr:port (the local
 * end of a UDP socket "connected" there; nothing is sent), or "" when it
 * cannot be told (addr empty or unresolvable). */
void loom_route_to(const char *addr, int port, char *out, size_t cap);

/* A polling wait's pause: the first `spin` calls return at once, the next
 * ones up to `yield` yield the core, later ones sleep `sleep_us`. */
void loom_comm_backoff(int *spins, int spin, int yield, long sleep_us);

#endif /* LOOM_COMM_IMPL_H */
