/* Collectives: argument checks shared by every backend, dispatch, and the
 * one-process "single" backend (MPI is in comm_mpi.c). */

#include "comm_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#define LOOM_COMM_TAG_LIMIT 32768

/* ---- common helpers ---- */

loom_comm *loom_comm_new(loom_ctx *ctx, const loom_comm_vt *vt, const char *name, int rank,
                         int size, const loom_comm *like) {
    loom_comm *c = loom_calloc(ctx, 1, sizeof *c, "communicator");
    if (!c) return NULL;
    c->vt = vt;
    c->ctx = ctx;
    snprintf(c->name, sizeof c->name, "%s", name && *name ? name : "group");
    c->rank = rank;
    c->size = size;
    c->timeout_s = like ? like->timeout_s : 600.0;
    return c;
}

const char *loom_comm_where(const loom_comm *c, char *buf, size_t cap) {
    snprintf(buf, cap, "group '%s' (rank %d of %d)", c->name, c->rank, c->size);
    return buf;
}

loom_status loom_comm_env_timeout(loom_ctx *ctx, double *out) {
    *out = 600.0;
    const char *e = getenv("LOOM_COMM_TIMEOUT");
    if (!e || !*e) return LOOM_OK;
    char *end;
    errno = 0;
    double v = strtod(e, &end);
    if (errno || end == e || *end || !isfinite(v) || v < 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "LOOM_COMM_TIMEOUT='%s' is not a number of seconds (0 waits forever)",
                         e);
    *out = v;
    return LOOM_OK;
}

static bool reducible(loom_dtype dt) {
    return dt == LOOM_F32 || dt == LOOM_F64 || dt == LOOM_I32 || dt == LOOM_I64;
}

/* Checks shared by every operation: a usable group, a known dtype, buffers
 * present when n > 0, and n * blocks elements of dt fitting in size_t. */
static loom_status check_common(loom_comm *c, const char *op, loom_dtype dt, size_t n,
                                size_t blocks, const void *a, const void *b) {
    char w[96];
    if (c->broken)
        return loom_errf(c->ctx, LOOM_ERR_COMM,
                         "%s on %s: the group cannot be used after an earlier operation on "
                         "it failed or timed out",
                         op, loom_comm_where(c, w, sizeof w));
    if ((int)dt < 0 || dt >= LOOM_DTYPE_COUNT)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "%s on %s: unknown dtype %d", op,
                         loom_comm_where(c, w, sizeof w), (int)dt);
    size_t bytes;
    if (!loom_mul_ok(n, loom_dtype_size(dt), &bytes) || !loom_mul_ok(bytes, blocks, &bytes))
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "%s on %s: %zu elements of %s overflow",
                         op, loom_comm_where(c, w, sizeof w), n, loom_dtype_name(dt));
    if (n > 0 && (!a || !b))
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "%s on %s: NULL buffer for %zu elements",
                         op, loom_comm_where(c, w, sizeof w), n);
    return LOOM_OK;
}

static loom_status check_reduce(loom_comm *c, const char *op, loom_dtype dt, loom_red_op rop) {
    if (rop != LOOM_RED_SUM && rop != LOOM_RED_MAX)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "%s: unknown reduction %d", op, (int)rop);
    if (!reducible(dt))
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s of %s is not supported (loom reduces F32, F64, I32 and I64; "
                         "reduce an F32 copy)",
                         op, loom_dtype_name(dt));
    return LOOM_OK;
}

static loom_status check_rank(loom_comm *c, const char *op, const char *what, int r) {
    char w[96];
    if (r < 0 || r >= c->size)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "%s on %s: %s %d is not a rank of the group",
                         op, loom_comm_where(c, w, sizeof w), what, r);
    return LOOM_OK;
}

/* ---- the public interface ---- */

#ifndef LOOM_HAVE_MPI
static const char *launcher_size(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return vars[i];
    }
    return NULL;
}
#endif

static loom_status single_world(loom_ctx *ctx, loom_comm **out);

loom_status loom_comm_world(loom_ctx *ctx, loom_comm_backend backend, loom_comm **out) {
    if (!out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_comm_world: out is NULL");
    *out = NULL;
    switch (backend) {
    case LOOM_COMM_SINGLE:
        return single_world(ctx, out);
    case LOOM_COMM_MPI:
#ifdef LOOM_HAVE_MPI
        return loom_comm_mpi_world(ctx, out);
#else
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "this loom was built without MPI; install libopenmpi-dev and rebuild");
#endif
    case LOOM_COMM_NCCL:
#ifdef LOOM_HAVE_CUDA
        return loom_comm_nccl_world(ctx, out);
#else
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "this loom was built without CUDA, so without the NCCL backend; "
                         "rebuild with make CUDA=1");
#endif
    case LOOM_COMM_AUTO: {
#ifdef LOOM_HAVE_MPI
        const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"};
        bool launched = loom_comm_mpi_initialized();
        for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
            const char *v = getenv(vars[i]);
            if (v && *v) launched = true;
        }
        if (launched) return loom_comm_mpi_world(ctx, out);
#else
        const char *var = launcher_size();
        const char *sz = getenv("OMPI_COMM_WORLD_SIZE");
        if (!sz) sz = getenv("PMI_SIZE");
        if (var && !(sz && strcmp(sz, "1") == 0))
            return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                             "started by an MPI launcher (%s is set), but this loom was built "
                             "without MPI; install libopenmpi-dev and rebuild",
                             var);
#endif
        return single_world(ctx, out);
    }
    }
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "unknown communication backend %d", (int)backend);
}

void loom_comm_free(loom_comm *c) {
    if (c) c->vt->free(c);
}

int loom_comm_rank(const loom_comm *c) { return c->rank; }
int loom_comm_size(const loom_comm *c) { return c->size; }
const char *loom_comm_backend_name(const loom_comm *c) { return c->vt->name; }
const char *loom_comm_name(const loom_comm *c) { return c->name; }
loom_ctx *loom_comm_ctx(const loom_comm *c) { return c->ctx; }
void loom_comm_set_timeout(loom_comm *c, double seconds) { c->timeout_s = seconds; }
int loom_comm_device(const loom_comm *c) { return c && c->vt->device ? c->vt->device(c) : -1; }
void *loom_comm_stream(const loom_comm *c) {
    return c && c->vt->stream ? c->vt->stream(c) : NULL;
}

loom_status loom_comm_split(loom_comm *parent, int color, int key, const char *name,
                            loom_comm **out) {
    if (!parent || !out) return LOOM_ERR_INVALID_ARG;
    *out = NULL;
    loom_status st = check_common(parent, "split", LOOM_U8, 0, 1, NULL, NULL);
    if (st) return st;
    if (parent->group_depth > 0)
        return loom_errf(parent->ctx, LOOM_ERR_INVALID_ARG,
                         "split of group '%s' inside group_start/group_end", parent->name);
    return parent->vt->split(parent, color, key, name, out);
}

static loom_status allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt, loom_red_op op,
                             loom_comm_req **req) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "allreduce", dt, n, 1, buf, buf);
    if (!st) st = check_reduce(c, "allreduce", dt, op);
    if (st) return st;
    return c->vt->allreduce(c, buf, n, dt, op, req);
}

loom_status loom_comm_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                loom_red_op op) {
    return allreduce(c, buf, n, dt, op, NULL);
}

static loom_status reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                  loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "reduce_scatter", dt, n, (size_t)c->size, send, recv);
    if (!st) st = check_reduce(c, "reduce_scatter", dt, op);
    if (st) return st;
    return c->vt->reduce_scatter(c, send, recv, n, dt, op, req);
}

loom_status loom_comm_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                     loom_dtype dt, loom_red_op op) {
    return reduce_scatter(c, send, recv, n, dt, op, NULL);
}

static loom_status allgather(loom_comm *c, const void *send, void *recv, size_t n,
                             loom_dtype dt, loom_comm_req **req) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "allgather", dt, n, (size_t)c->size, send, recv);
    if (st) return st;
    return c->vt->allgather(c, send, recv, n, dt, req);
}

loom_status loom_comm_allgather(loom_comm *c, const void *send, void *recv, size_t n,
                                loom_dtype dt) {
    return allgather(c, send, recv, n, dt, NULL);
}

loom_status loom_comm_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "broadcast", dt, n, 1, buf, buf);
    if (!st) st = check_rank(c, "broadcast", "root", root);
    if (st) return st;
    return c->vt->broadcast(c, buf, n, dt, root);
}

loom_status loom_comm_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                               loom_dtype dt) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "alltoall", dt, n, (size_t)c->size, send, recv);
    if (st) return st;
    return c->vt->alltoall(c, send, recv, n, dt);
}

static loom_status check_p2p(loom_comm *c, const char *op, const void *buf, size_t n,
                             loom_dtype dt, int peer, int tag) {
    loom_status st = check_common(c, op, dt, n, 1, buf, buf);
    if (!st) st = check_rank(c, op, "peer", peer);
    if (st) return st;
    if (tag < 0 || tag >= LOOM_COMM_TAG_LIMIT)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "%s on group '%s': tag %d is not in [0, %d)",
                         op, c->name, tag, LOOM_COMM_TAG_LIMIT);
    return LOOM_OK;
}

loom_status loom_comm_send(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer,
                           int tag) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_p2p(c, "send", buf, n, dt, peer, tag);
    if (st) return st;
    return c->vt->send(c, buf, n, dt, peer, tag);
}

loom_status loom_comm_recv(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer,
                           int tag) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_p2p(c, "recv", buf, n, dt, peer, tag);
    if (st) return st;
    return c->vt->recv(c, buf, n, dt, peer, tag);
}

loom_status loom_comm_group_start(loom_comm *c) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    c->group_depth++;
    return LOOM_OK;
}

loom_status loom_comm_group_end(loom_comm *c) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    if (c->group_depth <= 0)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG,
                         "group_end on group '%s' without group_start", c->name);
    if (--c->group_depth > 0) return LOOM_OK;
    return c->vt->group_end(c);
}

loom_status loom_comm_barrier(loom_comm *c) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "barrier", LOOM_U8, 0, 1, NULL, NULL);
    if (st) return st;
    return c->vt->barrier(c);
}

loom_status loom_comm_allreduce_async(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                      loom_red_op op, loom_comm_req **req) {
    if (!req) return c ? loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "allreduce_async: req is NULL")
                       : LOOM_ERR_INVALID_ARG;
    *req = NULL;
    return allreduce(c, buf, n, dt, op, req);
}

loom_status loom_comm_reduce_scatter_async(loom_comm *c, const void *send, void *recv, size_t n,
                                           loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    if (!req)
        return c ? loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "reduce_scatter_async: req is NULL")
                 : LOOM_ERR_INVALID_ARG;
    *req = NULL;
    return reduce_scatter(c, send, recv, n, dt, op, req);
}

loom_status loom_comm_allgather_async(loom_comm *c, const void *send, void *recv, size_t n,
                                      loom_dtype dt, loom_comm_req **req) {
    if (!req) return c ? loom_errf(c->ctx, LOOM_ERR_INVALID_ARG, "allgather_async: req is NULL")
                       : LOOM_ERR_INVALID_ARG;
    *req = NULL;
    return allgather(c, send, recv, n, dt, req);
}

loom_status loom_comm_wait(loom_comm *c, loom_comm_req *req) {
    if (!req) return LOOM_OK;
    if (!c) return LOOM_ERR_INVALID_ARG;
    if (req->comm != c)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG,
                         "wait on group '%s' for a request of group '%s'", c->name,
                         req->comm->name);
    return c->vt->wait(c, req);
}

/* This and cli/ are the only places that end the process (DESIGN.md,
 * "Conventions"): a rank that cannot go on must take the job down with it,
 * or its peers would wait on it until their timeout. */
void loom_comm_abort(loom_comm *c, const char *msg, int code) {
    fflush(stdout);
    if (c)
        fprintf(stderr, "loom: error on rank %d: %s\n", c->rank, msg ? msg : "");
    else
        fprintf(stderr, "loom: error: %s\n", msg ? msg : "");
    fflush(stderr);
    if (c) c->vt->abort(c, code);
    exit(code);
}

/* ---- the single backend: one rank, nothing to exchange ---- */

static const loom_comm_vt single_vt;

static loom_status single_world(loom_ctx *ctx, loom_comm **out) {
    loom_comm *c = loom_comm_new(ctx, &single_vt, "world", 0, 1, NULL);
    if (!c) return LOOM_ERR_OOM;
    loom_status st = loom_comm_env_timeout(ctx, &c->timeout_s);
    if (st) {
        free(c);
        return st;
    }
    if (ctx) loom_ctx_set_rank(ctx, 0, 1);
    *out = c;
    return LOOM_OK;
}

static void single_free(loom_comm *c) { free(c); }

static loom_status single_split(loom_comm *parent, int color, int key, const char *name,
                                loom_comm **out) {
    if (color < 0) return LOOM_OK;
    loom_comm *c = loom_comm_new(parent->ctx, &single_vt, name, 0, 1, parent);
    if (!c) return LOOM_ERR_OOM;
    *out = c;
    return LOOM_OK;
}

static void move(void *dst, const void *src, size_t n, loom_dtype dt) {
    if (n && dst != src) memmove(dst, src, n * loom_dtype_size(dt));
}

static loom_status single_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                    loom_red_op op, loom_comm_req **req) {
    return LOOM_OK;
}

static loom_status single_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                         loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    move(recv, send, n, dt);
    return LOOM_OK;
}

static loom_status single_allgather(loom_comm *c, const void *send, void *recv, size_t n,
                                    loom_dtype dt, loom_comm_req **req) {
    move(recv, send, n, dt);
    return LOOM_OK;
}

static loom_status single_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    return LOOM_OK;
}

static loom_status single_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                                   loom_dtype dt) {
    move(recv, send, n, dt);
    return LOOM_OK;
}

static loom_status single_p2p(loom_comm *c, const char *op) {
    return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                     "%s to self is not supported by the single backend (group '%s' has one "
                     "rank)",
                     op, c->name);
}

static loom_status single_send(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer,
                               int tag) {
    return single_p2p(c, "send");
}

static loom_status single_recv(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer,
                               int tag) {
    return single_p2p(c, "recv");
}

static loom_status single_nothing(loom_comm *c) { return LOOM_OK; }

static loom_status single_wait(loom_comm *c, loom_comm_req *req) { return LOOM_OK; }

__attribute__((noreturn)) static void single_abort(loom_comm *c, int code) {
    exit(code ? code : 1);
}

static const loom_comm_vt single_vt = {
    .name = "single",
    .free = single_free,
    .split = single_split,
    .allreduce = single_allreduce,
    .reduce_scatter = single_reduce_scatter,
    .allgather = single_allgather,
    .broadcast = single_broadcast,
    .alltoall = single_alltoall,
    .send = single_send,
    .recv = single_recv,
    .group_end = single_nothing,
    .barrier = single_nothing,
    .wait = single_wait,
    .abort = single_abort,
};

void loom_comm_backoff(int *spins, int spin, int yield, long sleep_us) {
    int s = (*spins)++;
    if (s < spin) return;
    if (s < yield) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, sleep_us * 1000};
    nanosleep(&ts, NULL);
}
