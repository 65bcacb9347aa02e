/* Inside src/comm: the group object and the table each backend fills.
 * comm.c checks arguments (dtypes, ranks, tags, sizes, group nesting) once
 * for every backend, then calls the backend through its table. */
#ifndef LOOM_COMM_IMPL_H
#define LOOM_COMM_IMPL_H

#include "comm.h"

typedef struct loom_comm_vt {
    const char *name; /* "single", "mpi" */
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
} loom_comm_vt;

struct loom_comm {
    const loom_comm_vt *vt;
    loom_ctx *ctx;        /* where errors go (the world's context) */
    char name[32];        /* "world", "tp", ... */
    int rank, size;
    int group_depth;      /* group_start() nesting */
    double timeout_s;     /* blocking waits give up after this; <= 0: never */
    bool broken;          /* an operation failed or timed out and left the group unusable */
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
/* LOOM_COMM_TIMEOUT (seconds, default 600, 0 = wait forever). */
loom_status loom_comm_env_timeout(loom_ctx *ctx, double *out);

#ifdef LOOM_HAVE_MPI
loom_status loom_comm_mpi_world(loom_ctx *ctx, loom_comm **out);
bool loom_comm_mpi_initialized(void);
#endif

#endif /* LOOM_COMM_IMPL_H */
