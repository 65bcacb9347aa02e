/* The NCCL backend (GPU ranks). Built only with LOOM_HAVE_CUDA (make
 * CUDA=1); comm.h ("The NCCL backend") describes what callers see.
 *
 * Communicators are NCCL "nonblocking" ones (config.blocking = 0): every
 * NCCL call returns at once, ncclInProgress while NCCL still connects in
 * the background, and ncclCommGetAsyncError is polled until it settles.
 * So initialisation, split, the first use of a connection and every wait
 * on the GPU run against a deadline (the group's timeout), and a peer that
 * never comes ends with an error naming the operation, the group and the
 * rank instead of a hang. On timeout the communicator is aborted
 * (ncclCommAbort makes the stuck kernels return) and the group marked
 * unusable.
 *
 * Each group has its own blocking CUDA stream (ordered with the legacy
 * default stream), an event for blocking waits and 8 bytes of device
 * scratch for the barrier. Temporary device copies (overlapping buffers)
 * are stream-ordered allocations freed on the same stream.
 *
 * Host buffers (pageable, or pinned: cudaMemoryTypeHost) are staged
 * through device memory; device buffers take the direct path, unchanged.
 * The staging copy of each host buffer is a stream-ordered allocation on
 * the group's stream (cudaMallocAsync, as for overlapping copies), filled
 * from the host when the operation reads the buffer, copied back when it
 * writes it, and freed on the stream after its last use. Not one growing
 * buffer per group: send/recv posted inside group_start/group_end each
 * need their own staging copy alive until group_end (a buffer grown in
 * between would move under what was already posted), and freeing a
 * cudaMalloc'd buffer to grow it synchronises the whole device, which would
 * wait with no deadline on the NCCL kernels of other groups; stream-ordered
 * allocation and free never synchronise the device, and the allocator's
 * pool serves the small host buffers the model passes (losses, norms).
 * An operation on host buffers:
 *  - when it copies in, first waits (with the group's deadline) for the
 *    work already on the group's stream: a copy from pageable memory may
 *    block the host until the stream reaches it, which would be a wait
 *    without a deadline (the stream runs the group's operations in order
 *    anyway, so this changes no result and no matching);
 *  - completes before returning, results in host memory: the *_async
 *    variants return a NULL request, as the single backend does;
 *  - except a send outside a group, which returns once the data is on the
 *    device (the caller may reuse its buffer) and stays queued on the
 *    stream like a device send;
 *  - inside a group, posts the staged send/recv into the NCCL group;
 *    group_end copies the received data out to the host buffers once the
 *    group has completed, then frees the staging copies. */

#include "comm_impl.h"

#ifdef LOOM_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "loom's NCCL backend needs NCCL 2.18 or later (ncclCommSplit, nonblocking communicators)"
#endif

/* ---- process state ---- */

typedef struct nccl_state nccl_state;

/* The MPI world that bootstrapped NCCL (NULL: TCP rendezvous or one rank);
 * freed, finalising MPI, with the last NCCL group. */
static loom_comm *boot_mpi;
static int live_groups;
static nccl_state *live_list;  /* every live group, for abort */
static loom_comm *group_owner; /* the group whose NCCL group is open (NCCL's is per thread) */

#define N_NOTE 4

/* A device copy of a host buffer for one operation. */
typedef struct staged {
    void *dev;    /* stream-ordered allocation; NULL: nothing staged */
    void *host;   /* where the result goes back; NULL: nothing to copy out */
    size_t bytes;
} staged;

struct nccl_state {
    ncclComm_t comm;     /* NULL once aborted, or for a solo group */
    bool solo;           /* one rank and no NCCL communicator (loom_comm_split_self, a world
                          * of one): collectives are copies on the stream; false once aborted */
    cudaStream_t stream;
    cudaEvent_t done;    /* recorded after each blocking operation */
    int *scratch;        /* device int[2]: the barrier's allreduce */
    int device;
    bool in_group;       /* ncclGroupStart called for p2p posted inside group_start/end */
    int n_posted;        /* p2p posted in this group */
    struct { char kind; int peer; } notes[N_NOTE]; /* the first ones, for messages */
    staged *pending;     /* host send/recv posted in this group, staged until group_end */
    int n_pending, cap_pending;
    bool unsettled;      /* a deferred operation (loom_comm_defer) may still run: settle waits */
    const char *deferred; /* its name, for a timeout's message */
    nccl_state *next;
    loom_comm *self;
};

typedef struct nccl_req {
    loom_comm_req base; /* first: loom_comm_req * <-> nccl_req * */
    cudaEvent_t ev;
    const char *what;
} nccl_req;

static const loom_comm_vt nccl_vt;

static nccl_state *S(const loom_comm *c) { return (nccl_state *)c->impl; }
static bool live(const nccl_state *s) { return s->comm || s->solo; }

/* Frees (stream-ordered, after what was queued) the staging copies of the
 * host send/recv posted in the current group, without copying out. */
static void drop_pending(loom_comm *c) {
    nccl_state *s = S(c);
    for (int i = 0; i < s->n_pending; i++)
        if (s->pending[i].dev) cudaFreeAsync(s->pending[i].dev, s->stream);
    if (s->n_pending) cudaGetLastError();
    s->n_pending = 0;
}

/* ---- errors ---- */

static const char *last_nccl(void) {
    const char *m = ncclGetLastError(NULL);
    return m && *m ? m : "no detail (run with NCCL_DEBUG=WARN)";
}

/* Aborts the communicator (unsticks its kernels, frees it) and marks the
 * group unusable. */
static void kill_comm(loom_comm *c) {
    nccl_state *s = S(c);
    c->broken = true;
    if (group_owner == c) {
        /* close NCCL's (per thread) group: left open it would swallow the
         * next operation of any group */
        ncclGroupEnd();
        group_owner = NULL;
        s->in_group = false;
    }
    if (s->comm) {
        ncclCommAbort(s->comm);
        s->comm = NULL;
    }
    s->solo = false;
    drop_pending(c);
}

static loom_status nccl_fail(loom_comm *c, const char *what, ncclResult_t r) {
    char w[96];
    loom_status st = loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s failed: %s (%s)", what,
                               loom_comm_where(c, w, sizeof w), ncclGetErrorString(r),
                               last_nccl());
    kill_comm(c);
    return st;
}

static loom_status cuda_fail(loom_comm *c, const char *what, cudaError_t e) {
    char w[96];
    return loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s: CUDA error: %s", what,
                     loom_comm_where(c, w, sizeof w), cudaGetErrorString(e));
}

static loom_status timed_out(loom_comm *c, const char *what, const char *extra) {
    char w[96];
    loom_status st =
        loom_errf(c->ctx, LOOM_ERR_COMM,
                  "%s on %s timed out after %g s: a rank of the group did not take part%s "
                  "(LOOM_COMM_TIMEOUT sets the limit; the group is aborted)",
                  what, loom_comm_where(c, w, sizeof w), c->timeout_s, extra ? extra : "");
    kill_comm(c);
    return st;
}

/* Polls the communicator until NCCL's background work settles. */
static loom_status settle_comm(loom_comm *c, ncclComm_t comm, const char *what) {
    double t0 = loom_now_s();
    int spins = 0;
    for (;;) {
        ncclResult_t a = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(comm, &a);
        if (r != ncclSuccess) return nccl_fail(c, what, r);
        if (a == ncclSuccess) return LOOM_OK;
        if (a != ncclInProgress) return nccl_fail(c, what, a);
        if (c->timeout_s > 0 && loom_now_s() - t0 > c->timeout_s) return timed_out(c, what, NULL);
        loom_comm_backoff(&spins, 256, 2048, 20);
    }
}

/* After an NCCL call on the group's communicator. */
static loom_status after(loom_comm *c, ncclResult_t r, const char *what) {
    if (r == ncclSuccess || r == ncclInProgress) return settle_comm(c, S(c)->comm, what);
    return nccl_fail(c, what, r);
}

/* Waits (host) for `ev` with the group's deadline, watching NCCL's errors. */
static loom_status wait_event(loom_comm *c, cudaEvent_t ev, const char *what,
                              const char *extra) {
    nccl_state *s = S(c);
    double t0 = loom_now_s();
    int spins = 0;
    for (;;) {
        cudaError_t q = cudaEventQuery(ev);
        if (q == cudaSuccess) return LOOM_OK;
        if (q != cudaErrorNotReady) {
            loom_status st = cuda_fail(c, what, q);
            kill_comm(c);
            return st;
        }
        if (s->comm && (spins & 63) == 0) {
            ncclResult_t a = ncclSuccess;
            ncclCommGetAsyncError(s->comm, &a);
            if (a != ncclSuccess && a != ncclInProgress) return nccl_fail(c, what, a);
        }
        if (c->timeout_s > 0 && loom_now_s() - t0 > c->timeout_s) return timed_out(c, what, extra);
        loom_comm_backoff(&spins, 256, 2048, 20);
    }
}

/* A request for an async call, made before anything is enqueued (so a
 * failure leaves nothing in flight). q = NULL for a blocking call. */
static loom_status new_req(loom_comm *c, loom_comm_req **req, nccl_req **q) {
    *q = NULL;
    if (!req) return LOOM_OK;
    *q = loom_calloc(c->ctx, 1, sizeof **q, "NCCL request");
    if (!*q) return LOOM_ERR_OOM;
    cudaError_t e = cudaEventCreateWithFlags(&(*q)->ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        free(*q);
        *q = NULL;
        return cuda_fail(c, "async request", e);
    }
    return LOOM_OK;
}

static void drop_req(nccl_req *q) {
    if (!q) return;
    cudaEventDestroy(q->ev);
    free(q);
}

/* A blocking call whose done event is recorded returns now (loom_comm_defer);
 * loom_comm_settle waits for it. */
static loom_status defer(loom_comm *c, const char *what) {
    nccl_state *s = S(c);
    c->defer_next = false;
    s->unsettled = true;
    s->deferred = what;
    return LOOM_OK;
}

static loom_status nccl_settle(loom_comm *c) {
    nccl_state *s = S(c);
    if (!s->unsettled) return LOOM_OK;
    s->unsettled = false;
    return wait_event(c, s->done, s->deferred, " (deferred: loom_comm_defer)");
}

/* Completes what was just enqueued: a blocking call waits (q NULL), an
 * async one records its event and hands the request over. */
static loom_status finish(loom_comm *c, const char *what, nccl_req *q, loom_comm_req **req) {
    nccl_state *s = S(c);
    cudaError_t e = cudaEventRecord(q ? q->ev : s->done, s->stream);
    if (e != cudaSuccess) {
        drop_req(q);
        loom_status st = cuda_fail(c, what, e);
        kill_comm(c);
        return st;
    }
    if (q) {
        q->base.comm = c;
        q->what = what;
        *req = &q->base;
        return LOOM_OK;
    }
    if (c->defer_next) return defer(c, what);
    return wait_event(c, s->done, what, NULL);
}

/* ---- arguments ---- */

static ncclDataType_t red_type(loom_dtype dt) {
    switch (dt) {
    case LOOM_F64: return ncclFloat64;
    case LOOM_I32: return ncclInt32;
    case LOOM_I64: return ncclInt64;
    case LOOM_BF16: return ncclBfloat16;
    case LOOM_F16: return ncclFloat16;
    case LOOM_F32:
    default: return ncclFloat32;
    }
}

static ncclRedOp_t red_op(loom_red_op op) { return op == LOOM_RED_MAX ? ncclMax : ncclSum; }

/* Where a buffer is: *host when it is host memory (pageable, or pinned:
 * cudaMemoryTypeHost), to be staged; otherwise device memory of this
 * rank's GPU or managed memory, handed to NCCL as it is. Device memory of
 * another GPU is refused: NCCL would fault inside a kernel, far from the
 * call that passed it. */
static loom_status check_buf(loom_comm *c, const char *what, const void *p, bool *host) {
    struct cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    *host = false;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    char w[96];
    if (e == cudaErrorInvalidValue) { /* runtimes before CUDA 11: unregistered host memory */
        cudaGetLastError();
        *host = true;
        return LOOM_OK;
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG,
                         "%s on %s: cannot tell whether %p is host or device memory (%s)", what,
                         loom_comm_where(c, w, sizeof w), p, cudaGetErrorString(e));
    }
    if (a.type == cudaMemoryTypeHost || a.type == cudaMemoryTypeUnregistered) {
        *host = true;
        return LOOM_OK;
    }
    if (a.type == cudaMemoryTypeDevice && a.device != S(c)->device)
        return loom_errf(c->ctx, LOOM_ERR_INVALID_ARG,
                         "%s on %s: the buffer is on GPU %d, this rank uses GPU %d", what,
                         loom_comm_where(c, w, sizeof w), a.device, S(c)->device);
    return LOOM_OK;
}

/* Orders what is enqueued next on c's stream after every other group's
 * deferred operation (loom_comm_defer). The groups' streams are ordered
 * with the legacy default stream, not with each other: without this, a
 * deferred exchange on one group and a collective on another that reads
 * its result (the MoE dispatch's ep all-to-all, then the etp all-gather of
 * what it received) would run side by side, the second reading stale
 * rows. */
static loom_status follow_deferred(loom_comm *c) {
    nccl_state *me = S(c);
    for (nccl_state *s = live_list; s; s = s->next) {
        if (s == me || !s->unsettled || !live(s))
            continue;
        cudaError_t e = cudaStreamWaitEvent(me->stream, s->done, 0);
        if (e != cudaSuccess)
            return cuda_fail(c, "ordering after another group's deferred work", e);
    }
    return LOOM_OK;
}

/* Collectives cannot join an NCCL group that holds this group's p2p: they
 * would only start at group_end, after this call waited for them. Then
 * orders the call after other groups' deferred work (follow_deferred). */
static loom_status check_no_group(loom_comm *c, const char *what) {
    char w[96];
    if (S(c)->in_group)
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s on %s inside group_start/group_end after a send or recv: the NCCL "
                         "backend runs collectives outside groups (or before the group's first "
                         "send/recv)",
                         what, loom_comm_where(c, w, sizeof w));
    if (group_owner && group_owner != c)
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s on %s while group '%s' has point-to-point posted in an open group: "
                         "NCCL's group is per thread; end that group first",
                         what, loom_comm_where(c, w, sizeof w), group_owner->name);
    return follow_deferred(c);
}

/* Checks before a collective; *ha, *hb: whether a, b are host memory (b
 * may be NULL). */
static loom_status prologue(loom_comm *c, const char *what, const void *a, bool *ha,
                            const void *b, bool *hb) {
    loom_status st = check_no_group(c, what);
    if (!st) st = check_buf(c, what, a, ha);
    if (st || !b) return st;
    if (b == a) {
        *hb = *ha;
        return LOOM_OK;
    }
    return check_buf(c, what, b, hb);
}

static bool overlap(const void *a, size_t na, const void *b, size_t nb) {
    const char *pa = a, *pb = b;
    return na && nb && pa < pb + nb && pb < pa + na;
}

/* A stream-ordered device copy of `bytes` at src (freed with tmp_free). */
static loom_status tmp_copy(loom_comm *c, const char *what, const void *src, size_t bytes,
                            void **out) {
    nccl_state *s = S(c);
    *out = NULL;
    cudaError_t e = cudaMallocAsync(out, bytes, s->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        char w[96];
        return loom_errf(c->ctx, LOOM_ERR_OOM, "%s on %s: no GPU memory for a %zu-byte copy of "
                         "an overlapping buffer (%s)",
                         what, loom_comm_where(c, w, sizeof w), bytes, cudaGetErrorString(e));
    }
    e = cudaMemcpyAsync(*out, src, bytes, cudaMemcpyDeviceToDevice, s->stream);
    if (e != cudaSuccess) {
        cudaFreeAsync(*out, s->stream);
        *out = NULL;
        return cuda_fail(c, what, e);
    }
    return LOOM_OK;
}

static void tmp_free(loom_comm *c, void *p) {
    if (p) cudaFreeAsync(p, S(c)->stream);
}

/* ---- staging of host buffers (see the top of this file) ---- */

/* Waits, with the group's deadline, for the work already on the stream. */
static loom_status drain(loom_comm *c, const char *what) {
    nccl_state *s = S(c);
    cudaError_t e = cudaEventRecord(s->done, s->stream);
    if (e != cudaSuccess) return cuda_fail(c, what, e);
    return wait_event(c, s->done, what,
                      " (it was waiting for the group's earlier operations before copying a "
                      "host buffer to the GPU)");
}

/* A device copy of `bytes` at host `src` (copied in when copy_in) whose
 * result goes back to `out` (NULL: nothing to copy out). */
static loom_status stage(loom_comm *c, const char *what, const void *src, size_t bytes,
                         bool copy_in, void *out, staged *sg) {
    nccl_state *s = S(c);
    sg->dev = NULL;
    sg->host = out;
    sg->bytes = bytes;
    if (copy_in) {
        loom_status st = drain(c, what);
        if (st) return st;
    }
    cudaError_t e = cudaMallocAsync(&sg->dev, bytes, s->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        sg->dev = NULL;
        char w[96];
        return loom_errf(c->ctx, LOOM_ERR_OOM, "%s on %s: no GPU memory for a %zu-byte device "
                         "copy of a host buffer (%s)",
                         what, loom_comm_where(c, w, sizeof w), bytes, cudaGetErrorString(e));
    }
    if (copy_in) {
        e = cudaMemcpyAsync(sg->dev, src, bytes, cudaMemcpyHostToDevice, s->stream);
        if (e != cudaSuccess) {
            cudaFreeAsync(sg->dev, s->stream);
            sg->dev = NULL;
            return cuda_fail(c, what, e);
        }
    }
    return LOOM_OK;
}

/* After the operation on the staging copies completed (st == LOOM_OK):
 * copies the results out to host memory and waits for them; in every case
 * frees the staging copies (stream-ordered). Returns st or the copy's
 * error. */
static loom_status unstage(loom_comm *c, const char *what, loom_status st, staged *sg, int k) {
    nccl_state *s = S(c);
    cudaError_t e = cudaSuccess;
    bool out = false;
    for (int i = 0; i < k && !st && e == cudaSuccess; i++) {
        if (!sg[i].dev || !sg[i].host) continue;
        e = cudaMemcpyAsync(sg[i].host, sg[i].dev, sg[i].bytes, cudaMemcpyDeviceToHost,
                            s->stream);
        out = true;
    }
    if (!st && e == cudaSuccess && out) e = cudaEventRecord(s->done, s->stream);
    for (int i = 0; i < k; i++) {
        if (!sg[i].dev) continue;
        cudaError_t f = cudaFreeAsync(sg[i].dev, s->stream);
        if (e == cudaSuccess) e = f;
        sg[i].dev = NULL;
    }
    if (st) {
        cudaGetLastError();
        return st;
    }
    if (e != cudaSuccess) return cuda_fail(c, what, e);
    return out ? wait_event(c, s->done, what, NULL) : LOOM_OK;
}

/* ---- world, split, free ---- */

static loom_comm *wrap(loom_ctx *ctx, ncclComm_t comm, int device, const char *name,
                       const loom_comm *like, loom_status *st) {
    int rank = 0, size = 1;
    *st = LOOM_OK;
    if (comm) {
        ncclCommUserRank(comm, &rank);
        ncclCommCount(comm, &size);
    }
    loom_comm *c = loom_comm_new(ctx, &nccl_vt, name, rank, size, like);
    nccl_state *s = c ? loom_calloc(ctx, 1, sizeof *s, "NCCL group") : NULL;
    if (!s) {
        free(c);
        if (comm) ncclCommAbort(comm);
        *st = LOOM_ERR_OOM;
        return NULL;
    }
    s->comm = comm;
    s->solo = !comm;
    s->device = device;
    s->self = c;
    c->impl = s;
    cudaError_t e = cudaStreamCreateWithFlags(&s->stream, cudaStreamDefault);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaMalloc((void **)&s->scratch, 2 * sizeof(int));
    if (e != cudaSuccess) {
        *st = loom_errf(ctx, LOOM_ERR_DEVICE, "NCCL group '%s': cannot create its stream, event "
                        "or scratch on GPU %d: %s",
                        c->name, device, cudaGetErrorString(e));
        if (comm) ncclCommAbort(comm);
        if (s->scratch) cudaFree(s->scratch);
        if (s->done) cudaEventDestroy(s->done);
        if (s->stream) cudaStreamDestroy(s->stream);
        free(s);
        free(c);
        return NULL;
    }
    s->next = live_list;
    live_list = s;
    live_groups++;
    return c;
}

static void unlink_state(nccl_state *s) {
    for (nccl_state **p = &live_list; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            return;
        }
}

static void release_boot(void) {
    if (live_groups == 0 && boot_mpi) {
        loom_comm *b = boot_mpi;
        boot_mpi = NULL;
        loom_comm_free(b); /* finalises MPI when loom initialised it */
    }
}

static void nccl_free(loom_comm *c) {
    nccl_state *s = S(c);
    if (s->in_group || group_owner == c) kill_comm(c); /* freed inside a group */
    drop_pending(c);
    if (s->comm) {
        /* flush, then destroy; a communicator that does not quiesce in time is aborted */
        ncclResult_t r = ncclCommFinalize(s->comm);
        loom_status st = LOOM_OK;
        if (r == ncclSuccess || r == ncclInProgress)
            st = settle_comm(c, s->comm, "free (ncclCommFinalize)");
        else
            st = nccl_fail(c, "free (ncclCommFinalize)", r);
        if (st) {
            char w[96];
            loom_log(c->ctx, LOOM_LOG_WARN, "freeing %s: %s", loom_comm_where(c, w, sizeof w),
                     loom_last_error(c->ctx));
        }
        if (s->comm) ncclCommDestroy(s->comm);
        s->comm = NULL;
    }
    /* drain the stream (an aborted kernel returns; don't hang if it does not) */
    for (double t0 = loom_now_s(); cudaStreamQuery(s->stream) == cudaErrorNotReady;) {
        if (loom_now_s() - t0 > 10.0) {
            char w[96];
            loom_log(c->ctx, LOOM_LOG_WARN, "freeing %s: its stream is still busy after 10 s",
                     loom_comm_where(c, w, sizeof w));
            break;
        }
        struct timespec ts = {0, 100 * 1000};
        nanosleep(&ts, NULL);
    }
    cudaGetLastError();
    free(s->pending);
    cudaFree(s->scratch);
    cudaEventDestroy(s->done);
    cudaStreamDestroy(s->stream);
    unlink_state(s);
    free(s);
    free(c);
    live_groups--;
    release_boot();
}

static ncclConfig_t make_config(void) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    return cfg;
}

/* One rank's view before the id exchange. */
typedef struct join_info {
    char host[64];
    int ok;
    char why[192];
} join_info;

/* Picks this rank's GPU: the only one visible, else the local rank's. */
static bool pick_device(int local_rank, const char *local_var, int *device, char *why,
                        size_t cap) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n <= 0) {
        cudaGetLastError();
        snprintf(why, cap, "no CUDA device is visible (%s); the NCCL backend needs one GPU per rank",
                 e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return false;
    }
    if (n == 1 || local_rank < 0) {
        *device = n == 1 ? 0 : -1;
        return true;
    }
    if (local_rank >= n) {
        snprintf(why, cap, "local rank %d (%s) has no GPU: %d visible", local_rank,
                 local_var ? local_var : "position on its host", n);
        return false;
    }
    *device = local_rank;
    return true;
}

static void set_nvls_default(void) {
    /* NVLink multicast (NVLS) can take a shared host's GPUs out of service;
     * a user who wants it sets NCCL_NVLS_ENABLE=1. Before NCCL reads it. */
    setenv("NCCL_NVLS_ENABLE", "0", 0);
}

#ifdef LOOM_HAVE_MPI
/* Started by mpirun: the MPI world agrees on the ranks, the local ranks
 * (host names, unless a launcher variable gives it) and rank 0's id. */
static loom_status mpi_exchange(loom_ctx *ctx, loom_comm *boot, const loom_launch *env,
                                ncclUniqueId *id, int *local_rank, int *local_size, int *device) {
    int rank = boot->rank, size = boot->size;
    join_info me, *all = loom_calloc(ctx, (size_t)size, sizeof *all, "NCCL rendezvous");
    if (!all) return LOOM_ERR_OOM;
    memset(&me, 0, sizeof me);
    if (gethostname(me.host, sizeof me.host - 1) != 0) snprintf(me.host, sizeof me.host, "?");
    *device = -1;
    me.ok = pick_device(env->local_rank, env->local_var, device, me.why, sizeof me.why);
    if (me.ok && rank == 0) {
        ncclResult_t r = ncclGetUniqueId(id);
        if (r != ncclSuccess) {
            me.ok = 0;
            snprintf(me.why, sizeof me.why, "ncclGetUniqueId failed: %s (%s)",
                     ncclGetErrorString(r), last_nccl());
        }
    }
    loom_status st = loom_comm_allgather(boot, &me, all, sizeof me, LOOM_U8);
    if (st) {
        free(all);
        return st;
    }
    for (int r = 0; r < size; r++)
        if (!all[r].ok) {
            st = loom_errf(ctx, LOOM_ERR_COMM, "rank %d cannot take part: %s", r, all[r].why);
            free(all);
            return st;
        }
    int lr = 0, ls = 0;
    for (int r = 0; r < size; r++) {
        all[r].host[sizeof all[r].host - 1] = 0;
        if (strcmp(all[r].host, me.host) != 0) continue;
        if (r < rank) lr++;
        ls++;
    }
    free(all);
    *local_rank = env->local_rank >= 0 ? env->local_rank : lr;
    *local_size = ls;
    return loom_comm_broadcast(boot, id, sizeof *id, LOOM_U8, 0);
}
#endif

/* The world's communicator, settled against the deadline. */
static loom_status init_world(loom_ctx *ctx, ncclUniqueId id, int rank, int size,
                              double timeout, ncclComm_t *out) {
    ncclConfig_t cfg = make_config();
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &cfg);
    /* a provisional group for messages */
    loom_comm probe;
    nccl_state ps;
    memset(&probe, 0, sizeof probe);
    memset(&ps, 0, sizeof ps);
    probe.ctx = ctx;
    snprintf(probe.name, sizeof probe.name, "world");
    probe.rank = rank;
    probe.size = size;
    probe.timeout_s = timeout;
    probe.impl = &ps;
    ps.comm = comm;
    loom_status st = r != ncclSuccess && r != ncclInProgress
                         ? nccl_fail(&probe, "ncclCommInitRank", r)
                         : settle_comm(&probe, comm, "ncclCommInitRank");
    *out = st ? NULL : comm;
    return st;
}

loom_status loom_comm_nccl_world(loom_ctx *ctx, loom_comm **out) {
    set_nvls_default();
    double timeout;
    loom_status st = loom_comm_env_timeout(ctx, &timeout);
    if (st) return st;
    loom_launch env;
    st = loom_launch_from_env(ctx, &env);
    if (st) return st;

    bool by_mpi = false;
#ifdef LOOM_HAVE_MPI
    {
        const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"};
        by_mpi = loom_comm_mpi_initialized();
        for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
            const char *v = getenv(vars[i]);
            if (v && *v) by_mpi = true;
        }
    }
#endif
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    int rank = env.rank, size = env.size, local_rank = -1, local_size = 1, device = -1;
    loom_comm *boot = NULL;
    if (by_mpi) {
#ifdef LOOM_HAVE_MPI
        st = loom_comm_mpi_world(ctx, &boot);
        if (st) return loom_err_prefix(ctx, "NCCL world (bootstrap over MPI)");
        boot->timeout_s = timeout;
        rank = boot->rank;
        size = boot->size;
        st = mpi_exchange(ctx, boot, &env, &id, &local_rank, &local_size, &device);
        if (st) {
            loom_err_prefix(ctx, "NCCL world (bootstrap over MPI, rank %d of %d)", rank, size);
            loom_comm_free(boot); /* finalises MPI unless other loom MPI groups live */
            return st;
        }
#endif
    } else {
        if (size > 1 && !env.addr[0])
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "NCCL world: %s says this is rank %d of %d, but MASTER_ADDR is not "
                             "set: the ranks meet at MASTER_ADDR:MASTER_PORT (rank 0's host; "
                             "port default 29500)%s",
                             env.rank_var, rank, size,
#ifdef LOOM_HAVE_MPI
                             ""
#else
                             getenv("OMPI_COMM_WORLD_SIZE")
                                 ? "; or rebuild loom with MPI to bootstrap through mpirun"
                                 : ""
#endif
            );
        char why[192] = "";
        bool ok = pick_device(env.local_rank, env.local_var, &device, why, sizeof why);
        if (ok && rank == 0 && size > 1) { /* a world of one needs no communicator */
            ncclResult_t r = ncclGetUniqueId(&id);
            if (r != ncclSuccess) {
                ok = false;
                snprintf(why, sizeof why, "ncclGetUniqueId failed: %s (%s)",
                         ncclGetErrorString(r), last_nccl());
            }
        }
        if (!ok && size == 1) return loom_errf(ctx, LOOM_ERR_DEVICE, "NCCL world: %s", why);
        st = loom_rendezvous(ctx, env.addr, env.port, rank, size, timeout, ok, why, &id,
                             sizeof id, &local_rank, &local_size);
        if (st) return loom_err_prefix(ctx, "NCCL world (rank %d of %d)", rank, size);
        if (env.local_rank >= 0) local_rank = env.local_rank;
    }
    /* the GPU, now that the local rank is known */
    if (device < 0) {
        char why[192];
        if (!pick_device(local_rank, env.local_var, &device, why, sizeof why)) {
            st = loom_errf(ctx, LOOM_ERR_DEVICE, "NCCL world: rank %d: %s", rank, why);
            goto fail_boot;
        }
    }
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
        st = loom_errf(ctx, LOOM_ERR_DEVICE, "NCCL world: rank %d: cudaSetDevice(%d): %s", rank,
                       device, cudaGetErrorString(e));
        goto fail_boot;
    }
    ncclComm_t comm = NULL; /* a world of one is solo: no communicator */
    if (size > 1 && (st = init_world(ctx, id, rank, size, timeout, &comm))) goto fail_boot;
    if (boot) {
        if (boot_mpi)
            loom_comm_free(boot); /* a second NCCL world: the first one's MPI world stays */
        else
            boot_mpi = boot;
        boot = NULL;
    }
    loom_comm *c = wrap(ctx, comm, device, "world", NULL, &st);
    if (!c) {
        release_boot();
        return st;
    }
    c->timeout_s = timeout;
    if (ctx) loom_ctx_set_rank(ctx, c->rank, c->size);
    *out = c;
    return LOOM_OK;
fail_boot:
    if (boot) loom_comm_free(boot);
    return st;
}

static loom_status nccl_split(loom_comm *parent, int color, int key, const char *name,
                              loom_comm **out) {
    nccl_state *ps = S(parent);
    loom_status st = check_no_group(parent, "split");
    if (st) return st;
    if (ps->solo) { /* a split of one rank: that rank alone, or nothing */
        loom_comm *c = color < 0 ? NULL : wrap(parent->ctx, NULL, ps->device, name, parent, &st);
        *out = c;
        return st;
    }
    ncclConfig_t cfg = make_config();
    ncclComm_t child = NULL;
    ncclResult_t r =
        ncclCommSplit(ps->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, &cfg);
    st = after(parent, r, "split (ncclCommSplit)");
    if (st) return st;
    if (color < 0) return LOOM_OK;
    if (!child) {
        char w[96];
        return loom_errf(parent->ctx, LOOM_ERR_INTERNAL,
                         "split of %s: NCCL returned no communicator for color %d",
                         loom_comm_where(parent, w, sizeof w), color);
    }
    st = settle_comm(parent, child, "split (new communicator)");
    if (st) {
        ncclCommAbort(child);
        return st;
    }
    loom_comm *c = wrap(parent->ctx, child, ps->device, name, parent, &st);
    if (!c) return st;
    *out = c;
    return LOOM_OK;
}

static loom_status nccl_split_self(loom_comm *parent, const char *name, loom_comm **out) {
    loom_status st = check_no_group(parent, "split");
    if (st) return st;
    *out = wrap(parent->ctx, NULL, S(parent)->device, name, parent, &st);
    return st;
}

/* ---- collectives ---- */

/* A solo group's data movement: its one block, dst = src, on its stream. */
static loom_status solo_copy(loom_comm *c, const char *what, void *dst, const void *src,
                             size_t bytes) {
    if (dst == src || bytes == 0) return LOOM_OK;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S(c)->stream);
    return e == cudaSuccess ? LOOM_OK : cuda_fail(c, what, e);
}

/* Each collective: the device path (buffers of this GPU; the caller ran
 * prologue), then the entry point, which stages host buffers around a
 * blocking call of the device path. */

static loom_status allreduce_dev(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                 loom_red_op op, loom_comm_req **req) {
    nccl_req *q;
    loom_status st = new_req(c, req, &q);
    if (st) return st;
    if (!S(c)->solo)
        st = after(c, ncclAllReduce(buf, buf, n, red_type(dt), red_op(op), S(c)->comm,
                                    S(c)->stream),
                   "allreduce");
    if (st) {
        drop_req(q);
        return st;
    }
    return finish(c, "allreduce", q, req);
}

static loom_status nccl_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                  loom_red_op op, loom_comm_req **req) {
    if (n == 0) return LOOM_OK;
    bool host;
    loom_status st = prologue(c, "allreduce", buf, &host, NULL, NULL);
    if (st) return st;
    if (!host) return allreduce_dev(c, buf, n, dt, op, req);
    staged sg;
    st = stage(c, "allreduce", buf, n * loom_dtype_size(dt), true, buf, &sg);
    if (!st) st = allreduce_dev(c, sg.dev, n, dt, op, NULL);
    return unstage(c, "allreduce", st, &sg, 1);
}

static loom_status reduce_scatter_dev(loom_comm *c, const void *send, void *recv, size_t n,
                                      loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    nccl_req *q;
    loom_status st = new_req(c, req, &q);
    if (st) return st;
    size_t es = loom_dtype_size(dt), total = n * (size_t)c->size * es;
    void *tmp = NULL;
    /* NCCL's in place is recv == send + rank*n; other overlaps go through a copy */
    if (recv != (const char *)send + (size_t)c->rank * n * es &&
        overlap(send, total, recv, n * es)) {
        st = tmp_copy(c, "reduce_scatter", send, total, &tmp);
        if (st) {
            drop_req(q);
            return st;
        }
        send = tmp;
    }
    st = S(c)->solo ? solo_copy(c, "reduce_scatter", recv, send, n * es)
                    : after(c, ncclReduceScatter(send, recv, n, red_type(dt), red_op(op),
                                                 S(c)->comm, S(c)->stream),
                            "reduce_scatter");
    tmp_free(c, tmp);
    if (st) {
        drop_req(q);
        return st;
    }
    return finish(c, "reduce_scatter", q, req);
}

static loom_status nccl_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                       loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    if (n == 0) return LOOM_OK;
    bool hs, hr;
    loom_status st = prologue(c, "reduce_scatter", send, &hs, recv, &hr);
    if (st) return st;
    if (!hs && !hr) return reduce_scatter_dev(c, send, recv, n, dt, op, req);
    /* staged send and recv are separate copies, so any overlap is gone */
    size_t block = n * loom_dtype_size(dt);
    staged sg[2] = {{0}};
    if (hs) st = stage(c, "reduce_scatter", send, block * (size_t)c->size, true, NULL, &sg[0]);
    if (!st && hr) st = stage(c, "reduce_scatter", NULL, block, false, recv, &sg[1]);
    if (!st)
        st = reduce_scatter_dev(c, hs ? sg[0].dev : send, hr ? sg[1].dev : recv, n, dt, op,
                                NULL);
    return unstage(c, "reduce_scatter", st, sg, 2);
}

static loom_status allgather_dev(loom_comm *c, const void *send, void *recv, size_t n,
                                 loom_dtype dt, loom_comm_req **req) {
    nccl_req *q;
    loom_status st = new_req(c, req, &q);
    if (st) return st;
    size_t block = n * loom_dtype_size(dt);
    void *tmp = NULL;
    if (send != (const char *)recv + (size_t)c->rank * block &&
        overlap(send, block, recv, block * (size_t)c->size)) {
        st = tmp_copy(c, "allgather", send, block, &tmp);
        if (st) {
            drop_req(q);
            return st;
        }
        send = tmp;
    }
    /* data movement: bytes, whatever the dtype */
    st = S(c)->solo ? solo_copy(c, "allgather", recv, send, block)
                    : after(c, ncclAllGather(send, recv, block, ncclUint8, S(c)->comm,
                                             S(c)->stream),
                            "allgather");
    tmp_free(c, tmp);
    if (st) {
        drop_req(q);
        return st;
    }
    return finish(c, "allgather", q, req);
}

static loom_status nccl_allgather(loom_comm *c, const void *send, void *recv, size_t n,
                                  loom_dtype dt, loom_comm_req **req) {
    if (n == 0) return LOOM_OK;
    bool hs, hr;
    loom_status st = prologue(c, "allgather", send, &hs, recv, &hr);
    if (st) return st;
    if (!hs && !hr) return allgather_dev(c, send, recv, n, dt, req);
    size_t block = n * loom_dtype_size(dt);
    staged sg[2] = {{0}};
    if (hs) st = stage(c, "allgather", send, block, true, NULL, &sg[0]);
    if (!st && hr) st = stage(c, "allgather", NULL, block * (size_t)c->size, false, recv, &sg[1]);
    if (!st) st = allgather_dev(c, hs ? sg[0].dev : send, hr ? sg[1].dev : recv, n, dt, NULL);
    return unstage(c, "allgather", st, sg, 2);
}

static loom_status broadcast_dev(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    loom_status st = LOOM_OK;
    if (!S(c)->solo)
        st = after(c, ncclBroadcast(buf, buf, n * loom_dtype_size(dt), ncclUint8, root,
                                    S(c)->comm, S(c)->stream),
                   "broadcast");
    return st ? st : finish(c, "broadcast", NULL, NULL);
}

static loom_status nccl_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    if (n == 0) return LOOM_OK;
    bool host;
    loom_status st = prologue(c, "broadcast", buf, &host, NULL, NULL);
    if (st) return st;
    if (!host) return broadcast_dev(c, buf, n, dt, root);
    /* the root's data is read, the others' buffers are written */
    bool is_root = c->rank == root;
    staged sg;
    st = stage(c, "broadcast", buf, n * loom_dtype_size(dt), is_root, is_root ? NULL : buf, &sg);
    if (!st) st = broadcast_dev(c, sg.dev, n, dt, root);
    return unstage(c, "broadcast", st, &sg, 1);
}

/* Grouped send/recv with every peer; this rank's own block is a copy. */
static loom_status alltoall_dev(loom_comm *c, const void *send, void *recv, size_t n,
                                loom_dtype dt) {
    loom_status st = LOOM_OK;
    nccl_state *s = S(c);
    size_t block = n * loom_dtype_size(dt), total = block * (size_t)c->size;
    void *tmp = NULL;
    if (overlap(send, total, recv, total)) {
        st = tmp_copy(c, "alltoall", send, total, &tmp);
        if (st) return st;
        send = tmp;
    }
    const char *sp = send;
    char *rp = recv;
    cudaError_t e = cudaMemcpyAsync(rp + (size_t)c->rank * block, sp + (size_t)c->rank * block,
                                    block, cudaMemcpyDeviceToDevice, s->stream);
    if (e != cudaSuccess) {
        tmp_free(c, tmp);
        return cuda_fail(c, "alltoall", e);
    }
    if (s->solo) { /* its own block was all */
        tmp_free(c, tmp);
        return finish(c, "alltoall", NULL, NULL);
    }
    ncclResult_t r = ncclGroupStart();
    for (int p = 0; p < c->size && r == ncclSuccess; p++) {
        if (p == c->rank) continue;
        r = ncclSend(sp + (size_t)p * block, block, ncclUint8, p, s->comm, s->stream);
        if (r == ncclSuccess)
            r = ncclRecv(rp + (size_t)p * block, block, ncclUint8, p, s->comm, s->stream);
    }
    ncclResult_t r2 = ncclGroupEnd();
    if (r == ncclSuccess) r = r2;
    st = after(c, r, "alltoall");
    tmp_free(c, tmp);
    return st ? st : finish(c, "alltoall", NULL, NULL);
}

static loom_status nccl_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                                 loom_dtype dt) {
    if (n == 0) return LOOM_OK;
    bool hs, hr;
    loom_status st = prologue(c, "alltoall", send, &hs, recv, &hr);
    if (st) return st;
    if (!hs && !hr) return alltoall_dev(c, send, recv, n, dt);
    size_t total = n * loom_dtype_size(dt) * (size_t)c->size;
    staged sg[2] = {{0}};
    if (hs) st = stage(c, "alltoall", send, total, true, NULL, &sg[0]);
    if (!st && hr) st = stage(c, "alltoall", NULL, total, false, recv, &sg[1]);
    if (!st) st = alltoall_dev(c, hs ? sg[0].dev : send, hr ? sg[1].dev : recv, n, dt);
    return unstage(c, "alltoall", st, sg, 2);
}

static loom_status nccl_barrier(loom_comm *c) {
    loom_status st = check_no_group(c, "barrier");
    if (st) return st;
    nccl_state *s = S(c);
    if (!s->solo)
        st = after(c, ncclAllReduce(s->scratch, s->scratch, 1, ncclInt32, ncclSum, s->comm,
                                    s->stream),
                   "barrier");
    return st ? st : finish(c, "barrier", NULL, NULL);
}

static loom_status nccl_wait(loom_comm *c, loom_comm_req *req) {
    nccl_req *q = (nccl_req *)req;
    loom_status st = LOOM_OK;
    if (c->broken && !live(S(c))) {
        char w[96];
        st = loom_errf(c->ctx, LOOM_ERR_COMM,
                       "wait for %s on %s: the group was aborted after an earlier operation "
                       "failed or timed out",
                       q->what, loom_comm_where(c, w, sizeof w));
    } else {
        st = wait_event(c, q->ev, q->what, NULL);
    }
    cudaEventDestroy(q->ev);
    free(q);
    return st;
}

/* ---- point to point ---- */

static void note(nccl_state *s, char kind, int peer) {
    if (s->n_posted < N_NOTE) {
        s->notes[s->n_posted].kind = kind;
        s->notes[s->n_posted].peer = peer;
    }
    s->n_posted++;
}

/* Inside a loom group: open the NCCL group at the first send/recv. */
static loom_status open_group(loom_comm *c, const char *what) {
    nccl_state *s = S(c);
    if (s->in_group) return LOOM_OK;
    if (group_owner && group_owner != c) {
        char w[96];
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s on %s while group '%s' has point-to-point posted in an open group: "
                         "NCCL's group is per thread; end that group first",
                         what, loom_comm_where(c, w, sizeof w), group_owner->name);
    }
    loom_status st = follow_deferred(c);
    if (st) return st;
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return nccl_fail(c, what, r);
    s->in_group = true;
    s->n_posted = 0;
    group_owner = c;
    return LOOM_OK;
}

/* Point to point on a buffer of this GPU. */
static loom_status p2p_dev(loom_comm *c, bool is_send, void *buf, size_t n, loom_dtype dt,
                           int peer, int tag) {
    const char *what = is_send ? "send" : "recv";
    nccl_state *s = S(c);
    loom_status st;
    size_t bytes = n * loom_dtype_size(dt);
    if (c->group_depth > 0) {
        st = open_group(c, what);
        if (st) return st;
        ncclResult_t r = is_send ? ncclSend(buf, bytes, ncclUint8, peer, s->comm, s->stream)
                                 : ncclRecv(buf, bytes, ncclUint8, peer, s->comm, s->stream);
        if (r != ncclSuccess && r != ncclInProgress) return nccl_fail(c, what, r);
        note(s, is_send ? 's' : 'r', peer);
        return LOOM_OK;
    }
    st = check_no_group(c, what);
    if (st) return st;
    char msg[96];
    snprintf(msg, sizeof msg, "%s %s rank %d (tag %d)", what, is_send ? "to" : "from", peer, tag);
    ncclResult_t r = is_send ? ncclSend(buf, bytes, ncclUint8, peer, s->comm, s->stream)
                             : ncclRecv(buf, bytes, ncclUint8, peer, s->comm, s->stream);
    st = after(c, r, what);
    if (st || is_send) return st; /* a send is queued; the stream orders later use */
    cudaError_t e = cudaEventRecord(s->done, s->stream);
    if (e != cudaSuccess) return cuda_fail(c, what, e);
    return wait_event(c, s->done, msg,
                      "; NCCL matches point to point in the order posted to each peer, not by "
                      "tag: check both sides post in the same order, and that two ranks "
                      "exchanging data do it inside one group");
}

/* Room for one more staged send/recv in the current group. */
static loom_status reserve_pending(loom_comm *c) {
    nccl_state *s = S(c);
    if (s->n_pending < s->cap_pending) return LOOM_OK;
    int cap = s->cap_pending ? 2 * s->cap_pending : 8;
    staged *p = loom_realloc(c->ctx, s->pending, (size_t)cap * sizeof *p,
                             "the group's staged host buffers");
    if (!p) return LOOM_ERR_OOM;
    s->pending = p;
    s->cap_pending = cap;
    return LOOM_OK;
}

/* Point to point on a host buffer, through a staging copy (see the top of
 * this file). */
static loom_status p2p_host(loom_comm *c, bool is_send, void *buf, size_t n, loom_dtype dt,
                            int peer, int tag) {
    const char *what = is_send ? "send" : "recv";
    nccl_state *s = S(c);
    size_t bytes = n * loom_dtype_size(dt);
    staged sg;
    loom_status st;
    if (c->group_depth > 0) {
        /* posted into the NCCL group; group_end copies a recv's data out
         * and frees the staging copy */
        st = open_group(c, what);
        if (!st) st = reserve_pending(c);
        if (!st) st = stage(c, what, buf, bytes, is_send, is_send ? NULL : buf, &sg);
        if (st) return st;
        st = p2p_dev(c, is_send, sg.dev, n, dt, peer, tag);
        if (st) {
            sg.host = NULL;
            return unstage(c, what, st, &sg, 1);
        }
        s->pending[s->n_pending++] = sg;
        return LOOM_OK;
    }
    st = check_no_group(c, what);
    if (!st) st = stage(c, what, buf, bytes, is_send, is_send ? NULL : buf, &sg);
    if (st) return st;
    if (is_send) {
        /* the caller may reuse its buffer once the data is on the GPU (a
         * pinned buffer's copy is asynchronous); the send itself stays
         * queued, as a device send does, and frees the copy after it */
        cudaError_t e = cudaEventRecord(s->done, s->stream);
        st = e != cudaSuccess ? cuda_fail(c, what, e)
                              : wait_event(c, s->done, "send (copying a host buffer to the GPU)",
                                           NULL);
        if (!st) st = p2p_dev(c, true, sg.dev, n, dt, peer, tag);
        return unstage(c, what, st, &sg, 1);
    }
    st = p2p_dev(c, false, sg.dev, n, dt, peer, tag);
    return unstage(c, what, st, &sg, 1);
}

static loom_status p2p(loom_comm *c, bool is_send, void *buf, size_t n, loom_dtype dt, int peer,
                       int tag) {
    if (n == 0) return LOOM_OK;
    if (S(c)->solo)
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s to self on group '%s': it has one rank and no NCCL communicator "
                         "(loom_comm_split_self)",
                         is_send ? "send" : "recv", c->name);
    bool host;
    loom_status st = check_buf(c, is_send ? "send" : "recv", buf, &host);
    if (st) return st;
    return host ? p2p_host(c, is_send, buf, n, dt, peer, tag)
                : p2p_dev(c, is_send, buf, n, dt, peer, tag);
}

static loom_status nccl_send(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer,
                             int tag) {
    return p2p(c, true, (void *)buf, n, dt, peer, tag);
}

static loom_status nccl_recv(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer,
                             int tag) {
    return p2p(c, false, buf, n, dt, peer, tag);
}

/* The end of a group: host buffers received get their data, and every
 * staging copy of the group is freed (also when the group failed). */
static loom_status end_pending(loom_comm *c, loom_status st) {
    nccl_state *s = S(c);
    st = unstage(c, "group_end", st, s->pending, s->n_pending);
    s->n_pending = 0;
    return st;
}

static loom_status nccl_group_end(loom_comm *c) {
    nccl_state *s = S(c);
    if (!s->in_group) return end_pending(c, LOOM_OK); /* nothing posted (or dropped) */
    s->in_group = false;
    group_owner = NULL;
    char what[160];
    int len = snprintf(what, sizeof what, "group_end (");
    for (int i = 0; i < s->n_posted && i < N_NOTE && len < (int)sizeof what - 32; i++)
        len += snprintf(what + len, sizeof what - (size_t)len, "%s%s rank %d", i ? ", " : "",
                        s->notes[i].kind == 's' ? "send to" : "recv from", s->notes[i].peer);
    snprintf(what + len, sizeof what - (size_t)len, "%s)", s->n_posted > N_NOTE ? ", ..." : "");
    ncclResult_t r = ncclGroupEnd();
    loom_status st = after(c, r, "group_end");
    if (st) return end_pending(c, st);
    cudaError_t e = cudaEventRecord(s->done, s->stream);
    if (e != cudaSuccess) return end_pending(c, cuda_fail(c, "group_end", e));
    if (c->defer_next && s->n_pending == 0) return defer(c, "group_end (deferred send/recv)");
    st = wait_event(c, s->done, what,
                    "; NCCL matches point to point in the order posted to each peer, not by "
                    "tag");
    return end_pending(c, st);
}

/* ---- abort, accessors ---- */

__attribute__((noreturn)) static void nccl_abort(loom_comm *c, int code) {
    for (nccl_state *s = live_list; s; s = s->next)
        if (s->comm) {
            ncclCommAbort(s->comm);
            s->comm = NULL;
        }
    if (boot_mpi) boot_mpi->vt->abort(boot_mpi, code); /* MPI_Abort: the whole job */
    exit(code ? code : 1);
}

static int nccl_device(const loom_comm *c) { return S(c)->device; }
static void *nccl_stream(const loom_comm *c) { return (void *)S(c)->stream; }

static const loom_comm_vt nccl_vt = {
    .name = "nccl",
    .free = nccl_free,
    .split = nccl_split,
    .split_self = nccl_split_self,
    .allreduce = nccl_allreduce,
    .reduce_scatter = nccl_reduce_scatter,
    .allgather = nccl_allgather,
    .broadcast = nccl_broadcast,
    .alltoall = nccl_alltoall,
    .send = nccl_send,
    .recv = nccl_recv,
    .group_end = nccl_group_end,
    .barrier = nccl_barrier,
    .wait = nccl_wait,
    .abort = nccl_abort,
    .device = nccl_device,
    .stream = nccl_stream,
    .settle = nccl_settle,
};

#else  /* !LOOM_HAVE_CUDA: comm.c answers LOOM_COMM_NCCL with what to rebuild */
typedef int loom_comm_nccl_not_built; /* a translation unit may not be empty */
#endif
