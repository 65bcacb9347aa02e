/* The MPI backend (CPU ranks). Built only with LOOM_HAVE_MPI (the Makefile
 * defines it when `mpicc --showme` works).
 *
 * Every operation is posted non-blocking (MPI_Iallreduce, MPI_Irecv, ...)
 * and completed by polling MPI_Testall, so that a wait gives up after the
 * group's timeout with a message naming the operation, the group and the
 * rank, instead of hanging on a peer that has gone. Sends outside a
 * group_start/group_end are copied and posted (MPI_Isend); the copies are
 * released as they complete (checked at every call on the group) and at
 * loom_comm_free. Communicators are duplicates of MPI_COMM_WORLD with
 * MPI_ERRORS_RETURN, so loom's traffic never matches the program's own.
 *
 * Buffers are host memory, in a CUDA build too: the copies below are
 * memcpy and MPI is not assumed to be CUDA-aware, so device pointers are
 * not supported (nor checked: that would start CUDA in CPU runs). GPU
 * ranks use the NCCL backend, which takes host and device buffers. */

#include "comm_impl.h"

#ifdef LOOM_HAVE_MPI

#include <limits.h>
#include <mpi.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* MPI itself is per process: whether loom initialised it (and so must
 * finalise it) and how many loom MPI groups are alive. World creation is
 * not thread-safe (nor is MPI_Init). */
static bool mpi_inited_by_loom;
static int mpi_live_groups;
static bool mpi_any_broken; /* a collective was abandoned: MPI_Finalize could hang */

typedef struct p2p_post {
    MPI_Request r;
    void *copy;    /* send outside a group: our copy of the data (owned) */
    char kind;     /* 's' or 'r' */
    int peer, tag;
} p2p_post;

typedef struct mpi_state {
    MPI_Comm comm;
    /* A duplicate for the diagnosis of a timed-out collective: a rank that
     * waits on this group answers "where are you?" on it (serve_diag), so the
     * rank that gives up can name the members that are not in its
     * collective. */
    MPI_Comm diag;
    uint64_t seq;      /* collectives posted on this group */
    uint64_t wait_seq; /* the collective being waited for (waiting == 1) */
    int waiting;       /* 0: not waiting, 1: a collective, 2: a send or receive */
    double stall_s;    /* test hook (LOOM_TEST_STALL): sleep before the first collective */
    p2p_post *sends;   /* outstanding sends posted outside a group */
    int n_sends, cap_sends;
    p2p_post *group;   /* sends and receives posted inside group_start/end */
    int n_group, cap_group;
} mpi_state;

enum { TAG_ASK = 1, TAG_TELL = 2 };

typedef struct mpi_req {
    loom_comm_req base; /* first: loom_comm_req * <-> mpi_req * */
    MPI_Request r;
    uint64_t seq;       /* the group's collective number */
    const char *what;
    void *tmp;          /* copy of an aliased send buffer, freed at completion */
} mpi_req;

static const loom_comm_vt mpi_vt;

static mpi_state *S(loom_comm *c) { return (mpi_state *)c->impl; }

bool loom_comm_mpi_initialized(void) {
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    return inited && !fin;
}

/* ---- errors and waiting ---- */

static loom_status mpi_fail(loom_comm *c, int err, const char *fn) {
    char es[MPI_MAX_ERROR_STRING + 1] = "";
    int len = 0;
    if (MPI_Error_string(err, es, &len) != MPI_SUCCESS) snprintf(es, sizeof es, "error %d", err);
    char w[96];
    return loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s failed: %s", fn,
                     loom_comm_where(c, w, sizeof w), es);
}

/* Answers the "where are you?" of members whose collective timed out: this
 * rank's state on the group (what it waits for, and which collective). */
static void serve_diag(loom_comm *c) {
    mpi_state *s = S(c);
    for (int k = 0; s->diag != MPI_COMM_NULL && k < 64; k++) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ASK, s->diag, &flag, &st) != MPI_SUCCESS || !flag)
            return;
        uint64_t ask = 0, tell[2] = {s->waiting == 1 ? s->wait_seq : s->seq, (uint64_t)s->waiting};
        MPI_Recv(&ask, 1, MPI_UINT64_T, st.MPI_SOURCE, TAG_ASK, s->diag, MPI_STATUS_IGNORE);
        /* the asker posted its receive before asking: this completes */
        MPI_Send(tell, 2, MPI_UINT64_T, st.MPI_SOURCE, TAG_TELL, s->diag);
    }
}

/* Polls until every request completes (true) or the group's timeout passes
 * (false, requests left as they are). *err is set on an MPI error. */
static bool poll_all(loom_comm *c, int n, MPI_Request *reqs, int *err) {
    double t0 = loom_now_s();
    int spins = 0;
    *err = MPI_SUCCESS;
    for (;;) {
        int flag = 0;
        *err = MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE);
        if (*err != MPI_SUCCESS || flag) return true;
        serve_diag(c);
        if (c->timeout_s > 0 && loom_now_s() - t0 > c->timeout_s) return false;
        /* ranks often outnumber cores on CPU: yield, then sleep */
        loom_comm_backoff(&spins, 64, 4096, 50);
    }
}

static int world_rank_of(loom_comm *c, int q) {
    MPI_Group g, wg;
    int w = -1;
    if (MPI_Comm_group(S(c)->comm, &g) != MPI_SUCCESS) return -1;
    if (MPI_Comm_group(MPI_COMM_WORLD, &wg) == MPI_SUCCESS) {
        MPI_Group_translate_ranks(g, 1, &q, wg, &w);
        MPI_Group_free(&wg);
    }
    MPI_Group_free(&g);
    return w;
}

/* After collective `seq` timed out: asks every other member where it is
 * (for up to 2 s, answering their questions meanwhile) and writes which
 * members are not in this collective, and why, into out. */
static void diagnose(loom_comm *c, uint64_t seq, char *out, size_t cap) {
    mpi_state *s = S(c);
    const int n = c->size;
    MPI_Request *rr = malloc(sizeof *rr * (size_t)n), *rs = malloc(sizeof *rs * (size_t)n);
    uint64_t(*tell)[2] = malloc(sizeof *tell * (size_t)n);
    uint64_t ask = seq;
    size_t len = 0;
    out[0] = 0;
    if (!rr || !rs || !tell || s->diag == MPI_COMM_NULL) {
        snprintf(out, cap, "a member of the group (no memory to ask which)");
        goto done;
    }
    for (int q = 0; q < n; q++) {
        rr[q] = rs[q] = MPI_REQUEST_NULL;
        if (q == c->rank) continue;
        MPI_Irecv(tell[q], 2, MPI_UINT64_T, q, TAG_TELL, s->diag, &rr[q]);
        MPI_Isend(&ask, 1, MPI_UINT64_T, q, TAG_ASK, s->diag, &rs[q]);
    }
    const double t0 = loom_now_s(), grace = c->timeout_s < 2.0 ? c->timeout_s : 2.0;
    int spins = 0, all = 0;
    while (!all && loom_now_s() - t0 < grace) {
        MPI_Testall(n, rr, &all, MPI_STATUSES_IGNORE);
        serve_diag(c);
        loom_comm_backoff(&spins, 64, 4096, 50);
    }
    int named = 0;
    for (int q = 0; q < n; q++) {
        if (q == c->rank) continue;
        int got = 0;
        if (rr[q] != MPI_REQUEST_NULL) MPI_Test(&rr[q], &got, MPI_STATUS_IGNORE);
        else got = 1;
        if (got && tell[q][1] == 1 && tell[q][0] == seq) continue; /* waits here too */
        char why[160];
        if (!got)
            snprintf(why, sizeof why, "did not answer (it is not waiting on this group: still "
                                      "computing, in another group's operation, or gone)");
        else if (tell[q][1] == 1)
            snprintf(why, sizeof why, "waits in this group's collective #%llu, this one is #%llu "
                                      "(the ranks call the group's collectives in another order)",
                     (unsigned long long)tell[q][0], (unsigned long long)seq);
        else
            snprintf(why, sizeof why, "waits in a send or receive on this group, not in this "
                                      "collective");
        int w = world_rank_of(c, q);
        int k = snprintf(out + len, cap - len, "%srank %d of the group (world rank %d), which %s",
                         named ? "; " : "", q, w, why);
        if (k > 0 && (size_t)k < cap - len) len += (size_t)k;
        named++;
    }
    if (!named)
        snprintf(out, cap, "every member answered from this collective (the transport itself "
                           "stalled)");
    for (int q = 0; q < n; q++) {
        if (rr[q] != MPI_REQUEST_NULL) {
            MPI_Cancel(&rr[q]);
            MPI_Wait(&rr[q], MPI_STATUS_IGNORE);
        }
        if (rs[q] != MPI_REQUEST_NULL) MPI_Request_free(&rs[q]);
    }
done:
    free(rr);
    free(rs);
    free(tell);
}

/* Waits for collective `seq`, posted as request r; on timeout the group is
 * unusable (MPI cannot cancel a collective) and the message names the
 * members that are not in it. */
static loom_status wait_collective(loom_comm *c, MPI_Request *r, const char *what, uint64_t seq) {
    mpi_state *s = S(c);
    int err;
    s->waiting = 1;
    s->wait_seq = seq;
    bool done = poll_all(c, 1, r, &err);
    if (done) {
        s->waiting = 0;
        if (err != MPI_SUCCESS) {
            c->broken = true;
            return mpi_fail(c, err, what);
        }
        return LOOM_OK;
    }
    char who[1024];
    diagnose(c, seq, who, sizeof who); /* still "waiting" for the others' questions */
    s->waiting = 0;
    c->broken = true;
    mpi_any_broken = true;
    char w[96];
    return loom_errf(c->ctx, LOOM_ERR_COMM,
                     "%s on %s timed out after %g s waiting for %s (--comm-timeout or "
                     "LOOM_COMM_TIMEOUT sets the limit)",
                     what, loom_comm_where(c, w, sizeof w), c->timeout_s, who);
}

/* Gives up on posted point-to-point requests: receives are cancelled (the
 * group stays usable); a send in flight cannot be taken back, so the group
 * is marked unusable when one is abandoned. */
static void abandon(loom_comm *c, p2p_post *p, int n) {
    for (int i = 0; i < n; i++) {
        if (p[i].r == MPI_REQUEST_NULL) continue;
        if (p[i].kind == 'r') {
            MPI_Cancel(&p[i].r);
            MPI_Wait(&p[i].r, MPI_STATUS_IGNORE);
        } else {
            MPI_Request_free(&p[i].r);
            c->broken = true;
            mpi_any_broken = true;
            /* the copy (if any) may still be read by MPI: leak it */
            p[i].copy = NULL;
        }
    }
}

/* ---- outstanding sends ---- */

static loom_status push(loom_comm *c, p2p_post **arr, int *n, int *cap, p2p_post p) {
    if (*n == *cap) {
        int nc = *cap ? *cap * 2 : 8;
        p2p_post *np = loom_realloc(c->ctx, *arr, (size_t)nc * sizeof *np, "pending messages");
        if (!np) return LOOM_ERR_OOM;
        *arr = np;
        *cap = nc;
    }
    (*arr)[(*n)++] = p;
    return LOOM_OK;
}

/* Releases the copies of sends that have completed. */
static loom_status reap_sends(loom_comm *c) {
    mpi_state *s = S(c);
    for (int i = 0; i < s->n_sends;) {
        int flag = 0;
        int err = MPI_Test(&s->sends[i].r, &flag, MPI_STATUS_IGNORE);
        if (err != MPI_SUCCESS) return mpi_fail(c, err, "MPI_Isend");
        if (flag) {
            free(s->sends[i].copy);
            s->sends[i] = s->sends[--s->n_sends];
        } else {
            i++;
        }
    }
    return LOOM_OK;
}

/* Waits for every outstanding send (loom_comm_free). */
static void drain_sends(loom_comm *c) {
    mpi_state *s = S(c);
    if (!s->n_sends) return;
    MPI_Request *r = malloc((size_t)s->n_sends * sizeof *r);
    bool done = false;
    int err = MPI_SUCCESS;
    if (r) {
        for (int i = 0; i < s->n_sends; i++) r[i] = s->sends[i].r;
        done = poll_all(c, s->n_sends, r, &err);
        for (int i = 0; i < s->n_sends; i++) s->sends[i].r = r[i];
        free(r);
    }
    if (!done || err != MPI_SUCCESS) {
        char w[96];
        loom_log(c->ctx, LOOM_LOG_WARN,
                 "freeing %s: %d send(s) were never received (no matching recv within %g s)",
                 loom_comm_where(c, w, sizeof w), s->n_sends, c->timeout_s);
        abandon(c, s->sends, s->n_sends);
    }
    for (int i = 0; i < s->n_sends; i++) free(s->sends[i].copy);
    s->n_sends = 0;
}

/* ---- types ---- */

static MPI_Datatype mpi_type(loom_dtype dt) {
    switch (dt) {
    case LOOM_F32: return MPI_FLOAT;
    case LOOM_F64: return MPI_DOUBLE;
    case LOOM_I32: return MPI_INT32_T;
    case LOOM_I64: return MPI_INT64_T;
    case LOOM_I16: return MPI_INT16_T;
    case LOOM_BF16:
    case LOOM_F16: return MPI_UINT16_T; /* moved, never reduced */
    case LOOM_I8: return MPI_INT8_T;
    case LOOM_U8:
    case LOOM_BOOL:
    default: return MPI_UINT8_T;
    }
}

static MPI_Op mpi_op(loom_red_op op) { return op == LOOM_RED_MAX ? MPI_MAX : MPI_SUM; }

/* MPI counts are ints: n elements in each of `blocks` blocks must fit. */
static loom_status check_count(loom_comm *c, const char *op, size_t n, size_t blocks) {
    if (n > (size_t)INT_MAX / (blocks ? blocks : 1)) {
        char w[96];
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s of %zu x %zu elements on %s exceeds MPI's limit of %d elements "
                         "per call; split the buffer",
                         op, blocks, n, loom_comm_where(c, w, sizeof w), INT_MAX);
    }
    return LOOM_OK;
}

static bool overlap(const void *a, size_t na, const void *b, size_t nb) {
    const char *pa = a, *pb = b;
    return na && nb && pa < pb + nb && pb < pa + na;
}

/* ---- world, split, free ---- */

static loom_comm *wrap(loom_ctx *ctx, MPI_Comm mc, const char *name, const loom_comm *like) {
    int rank = 0, size = 1;
    MPI_Comm_rank(mc, &rank);
    MPI_Comm_size(mc, &size);
    loom_comm *c = loom_comm_new(ctx, &mpi_vt, name, rank, size, like);
    mpi_state *s = c ? loom_calloc(ctx, 1, sizeof *s, "MPI group") : NULL;
    if (!s) {
        free(c);
        MPI_Comm_free(&mc);
        return NULL;
    }
    s->comm = mc;
    if (MPI_Comm_dup(mc, &s->diag) != MPI_SUCCESS) s->diag = MPI_COMM_NULL;
    else MPI_Comm_set_errhandler(s->diag, MPI_ERRORS_RETURN);
    c->impl = s;
    mpi_live_groups++;
    return c;
}

loom_status loom_comm_mpi_world(loom_ctx *ctx, loom_comm **out) {
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (fin)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "MPI was already finalised in this process (it cannot start twice); "
                         "create the world group once and free it last");
    double timeout;
    loom_status st = loom_comm_env_timeout(ctx, &timeout);
    if (st) return st;
    if (!inited) {
        int provided = 0;
        int err = MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided);
        if (err != MPI_SUCCESS)
            return loom_errf(ctx, LOOM_ERR_COMM, "MPI_Init_thread failed (MPI error %d)", err);
        mpi_inited_by_loom = true;
        if (provided < MPI_THREAD_FUNNELED)
            loom_log(ctx, LOOM_LOG_WARN,
                     "MPI gives thread level %d, below MPI_THREAD_FUNNELED: OpenMP threads "
                     "inside ranks may not be safe with this MPI",
                     provided);
    }
    MPI_Comm mc;
    int err = MPI_Comm_dup(MPI_COMM_WORLD, &mc);
    if (err != MPI_SUCCESS) return loom_errf(ctx, LOOM_ERR_COMM, "MPI_Comm_dup failed (%d)", err);
    MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN);
    loom_comm *c = wrap(ctx, mc, "world", NULL);
    if (!c) return LOOM_ERR_OOM;
    c->timeout_s = timeout;
    const char *stall = getenv("LOOM_TEST_STALL");
    int stall_rank = -1;
    double stall_s = 0;
    if (stall && sscanf(stall, "%d:%lf", &stall_rank, &stall_s) == 2 && stall_rank == c->rank)
        S(c)->stall_s = stall_s;
    if (ctx) loom_ctx_set_rank(ctx, c->rank, c->size);
    *out = c;
    return LOOM_OK;
}

static void mpi_free(loom_comm *c) {
    mpi_state *s = S(c);
    drain_sends(c);
    if (s->n_group) abandon(c, s->group, s->n_group); /* freed inside a group */
    free(s->sends);
    free(s->group);
    if (s->diag != MPI_COMM_NULL) MPI_Comm_free(&s->diag);
    MPI_Comm_free(&s->comm);
    free(s);
    free(c);
    if (--mpi_live_groups == 0 && mpi_inited_by_loom && !mpi_any_broken) {
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin) MPI_Finalize();
    }
}

static loom_status mpi_barrier(loom_comm *c);

static loom_status mpi_split(loom_comm *parent, int color, int key, const char *name,
                             loom_comm **out) {
    /* MPI_Comm_split blocks with no timeout: first make sure every rank is
     * here, with a barrier that has one. */
    loom_status st = mpi_barrier(parent);
    if (st) return st;
    MPI_Comm mc = MPI_COMM_NULL;
    int err = MPI_Comm_split(S(parent)->comm, color < 0 ? MPI_UNDEFINED : color, key, &mc);
    if (err != MPI_SUCCESS) return mpi_fail(parent, err, "MPI_Comm_split");
    if (mc == MPI_COMM_NULL) return LOOM_OK;
    MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN);
    loom_comm *c = wrap(parent->ctx, mc, name, parent);
    if (!c) return LOOM_ERR_OOM;
    *out = c;
    return LOOM_OK;
}

/* ---- collectives ---- */

/* Completes a posted collective now (q == NULL, blocking call) or hands it
 * to the caller as a request. */
static loom_status post_done(loom_comm *c, int err, const char *fn, mpi_req *q, MPI_Request r,
                             void *tmp, loom_comm_req **req) {
    if (err != MPI_SUCCESS) {
        free(tmp);
        free(q);
        return mpi_fail(c, err, fn);
    }
    const uint64_t seq = ++S(c)->seq;
    if (q) {
        q->base.comm = c;
        q->r = r;
        q->seq = seq;
        q->what = fn;
        q->tmp = tmp;
        *req = &q->base;
        return LOOM_OK;
    }
    loom_status st = wait_collective(c, &r, fn, seq);
    if (!c->broken) free(tmp); /* an abandoned collective may still read it */
    return st;
}

/* Test hook: LOOM_TEST_STALL="RANK:SECONDS" makes world rank RANK sleep
 * that long before its first collective on the world group, so tests can
 * watch the others time out and name it. */
static void stall_hook(loom_comm *c) {
    mpi_state *s = S(c);
    if (s->stall_s <= 0) return;
    const double t0 = loom_now_s(), until = s->stall_s;
    s->stall_s = 0;
    int spins = 0;
    while (loom_now_s() - t0 < until) loom_comm_backoff(&spins, 0, 0, 20000);
}

/* Allocates the request first, so nothing is in flight if that fails. */
static loom_status prepare(loom_comm *c, loom_comm_req **req, mpi_req **q) {
    *q = NULL;
    stall_hook(c);
    loom_status st = reap_sends(c);
    if (st) return st;
    if (req) {
        *q = loom_calloc(c->ctx, 1, sizeof **q, "MPI request");
        if (!*q) return LOOM_ERR_OOM;
    }
    return LOOM_OK;
}

static loom_status mpi_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                 loom_red_op op, loom_comm_req **req) {
    mpi_req *q;
    loom_status st = check_count(c, "allreduce", n, 1);
    if (!st) st = prepare(c, req, &q);
    if (st) return st;
    MPI_Request r;
    int err = MPI_Iallreduce(MPI_IN_PLACE, buf, (int)n, mpi_type(dt), mpi_op(op),
                             S(c)->comm, &r);
    return post_done(c, err, "MPI_Iallreduce", q, r, NULL, req);
}

static loom_status mpi_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                      loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    mpi_req *q;
    loom_status st = check_count(c, "reduce_scatter", n, (size_t)c->size);
    if (!st) st = prepare(c, req, &q);
    if (st) return st;
    size_t es = loom_dtype_size(dt), total = n * (size_t)c->size * es;
    void *tmp = NULL;
    if (overlap(send, total, recv, n * es)) {
        tmp = loom_malloc(c->ctx, total, "reduce_scatter copy");
        if (!tmp) {
            free(q);
            return LOOM_ERR_OOM;
        }
        memcpy(tmp, send, total);
        send = tmp;
    }
    MPI_Request r;
    int err = MPI_Ireduce_scatter_block(send, recv, (int)n, mpi_type(dt), mpi_op(op),
                                        S(c)->comm, &r);
    return post_done(c, err, "MPI_Ireduce_scatter_block", q, r, tmp, req);
}

static loom_status mpi_allgather(loom_comm *c, const void *send, void *recv, size_t n,
                                 loom_dtype dt, loom_comm_req **req) {
    mpi_req *q;
    loom_status st = check_count(c, "allgather", n, (size_t)c->size);
    if (!st) st = prepare(c, req, &q);
    if (st) return st;
    size_t es = loom_dtype_size(dt), block = n * es;
    void *tmp = NULL;
    if (n && send == (const char *)recv + (size_t)c->rank * block) {
        send = MPI_IN_PLACE;
    } else if (overlap(send, block, recv, block * (size_t)c->size)) {
        tmp = loom_malloc(c->ctx, block, "allgather copy");
        if (!tmp) {
            free(q);
            return LOOM_ERR_OOM;
        }
        memcpy(tmp, send, block);
        send = tmp;
    }
    MPI_Request r;
    int err = MPI_Iallgather(send, (int)n, mpi_type(dt), recv, (int)n, mpi_type(dt),
                             S(c)->comm, &r);
    return post_done(c, err, "MPI_Iallgather", q, r, tmp, req);
}

static loom_status mpi_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    mpi_req *q;
    loom_status st = check_count(c, "broadcast", n, 1);
    if (!st) st = prepare(c, NULL, &q);
    if (st) return st;
    MPI_Request r;
    int err = MPI_Ibcast(buf, (int)n, mpi_type(dt), root, S(c)->comm, &r);
    return post_done(c, err, "MPI_Ibcast", NULL, r, NULL, NULL);
}

static loom_status mpi_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                                loom_dtype dt) {
    mpi_req *q;
    loom_status st = check_count(c, "alltoall", n, (size_t)c->size);
    if (!st) st = prepare(c, NULL, &q);
    if (st) return st;
    size_t total = n * (size_t)c->size * loom_dtype_size(dt);
    void *tmp = NULL;
    if (overlap(send, total, recv, total)) {
        tmp = loom_malloc(c->ctx, total, "alltoall copy");
        if (!tmp) return LOOM_ERR_OOM;
        memcpy(tmp, send, total);
        send = tmp;
    }
    MPI_Request r;
    int err = MPI_Ialltoall(send, (int)n, mpi_type(dt), recv, (int)n, mpi_type(dt), S(c)->comm,
                            &r);
    return post_done(c, err, "MPI_Ialltoall", NULL, r, tmp, NULL);
}

static loom_status mpi_barrier(loom_comm *c) {
    stall_hook(c);
    loom_status st = reap_sends(c);
    if (st) return st;
    MPI_Request r;
    int err = MPI_Ibarrier(S(c)->comm, &r);
    return post_done(c, err, "MPI_Ibarrier", NULL, r, NULL, NULL);
}

static loom_status mpi_wait(loom_comm *c, loom_comm_req *req) {
    mpi_req *q = (mpi_req *)req;
    loom_status st = wait_collective(c, &q->r, q->what, q->seq);
    if (!c->broken) free(q->tmp); /* an abandoned collective may still read it */
    free(q);
    return st;
}

/* ---- point to point ---- */

static loom_status mpi_send(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer,
                            int tag) {
    mpi_state *s = S(c);
    loom_status st = check_count(c, "send", n, 1);
    if (!st) st = reap_sends(c);
    if (st) return st;
    p2p_post p = {.r = MPI_REQUEST_NULL, .kind = 's', .peer = peer, .tag = tag};
    const void *from = buf;
    if (c->group_depth == 0) {
        size_t bytes = n * loom_dtype_size(dt);
        p.copy = loom_malloc(c->ctx, bytes ? bytes : 1, "send copy");
        if (!p.copy) return LOOM_ERR_OOM;
        if (bytes) memcpy(p.copy, buf, bytes);
        from = p.copy;
    }
    /* reserve the slot before posting, so a failed push leaves nothing in flight */
    p2p_post **arr = c->group_depth ? &s->group : &s->sends;
    int *cnt = c->group_depth ? &s->n_group : &s->n_sends;
    int *cap = c->group_depth ? &s->cap_group : &s->cap_sends;
    st = push(c, arr, cnt, cap, p);
    if (st) {
        free(p.copy);
        return st;
    }
    p2p_post *slot = &(*arr)[*cnt - 1];
    int err = MPI_Isend(from, (int)n, mpi_type(dt), peer, tag, s->comm, &slot->r);
    if (err != MPI_SUCCESS) {
        free(slot->copy);
        (*cnt)--;
        return mpi_fail(c, err, "MPI_Isend");
    }
    return LOOM_OK;
}

static loom_status mpi_recv(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer,
                            int tag) {
    mpi_state *s = S(c);
    loom_status st = check_count(c, "recv", n, 1);
    if (!st) st = reap_sends(c);
    if (st) return st;
    p2p_post p = {.r = MPI_REQUEST_NULL, .kind = 'r', .peer = peer, .tag = tag};
    if (c->group_depth) {
        st = push(c, &s->group, &s->n_group, &s->cap_group, p);
        if (st) return st;
        p2p_post *slot = &s->group[s->n_group - 1];
        int err = MPI_Irecv(buf, (int)n, mpi_type(dt), peer, tag, s->comm, &slot->r);
        if (err != MPI_SUCCESS) {
            s->n_group--;
            return mpi_fail(c, err, "MPI_Irecv");
        }
        return LOOM_OK;
    }
    int err = MPI_Irecv(buf, (int)n, mpi_type(dt), peer, tag, s->comm, &p.r);
    if (err != MPI_SUCCESS) return mpi_fail(c, err, "MPI_Irecv");
    if (poll_all(c, 1, &p.r, &err))
        return err == MPI_SUCCESS ? LOOM_OK : mpi_fail(c, err, "MPI_Irecv");
    MPI_Status status;
    int cancelled = 0;
    MPI_Cancel(&p.r);
    MPI_Wait(&p.r, &status);
    MPI_Test_cancelled(&status, &cancelled);
    if (!cancelled) return LOOM_OK; /* it arrived as we gave up */
    char w[96];
    return loom_errf(c->ctx, LOOM_ERR_COMM,
                     "recv from rank %d (tag %d) on %s timed out after %g s (LOOM_COMM_TIMEOUT "
                     "sets the limit)",
                     peer, tag, loom_comm_where(c, w, sizeof w), c->timeout_s);
}

static loom_status mpi_group_end(loom_comm *c) {
    mpi_state *s = S(c);
    int n = s->n_group;
    if (!n) return LOOM_OK;
    MPI_Request *r = loom_malloc(c->ctx, (size_t)n * sizeof *r, "group requests");
    if (!r) {
        abandon(c, s->group, n);
        s->n_group = 0;
        return LOOM_ERR_OOM;
    }
    for (int i = 0; i < n; i++) r[i] = s->group[i].r;
    int err;
    bool done = poll_all(c, n, r, &err);
    loom_status st = LOOM_OK;
    if (done && err != MPI_SUCCESS) {
        st = mpi_fail(c, err, "MPI_Testall (group_end)");
    } else if (!done) {
        /* name the first message that did not arrive */
        int first = -1;
        for (int i = 0; i < n; i++) {
            int flag = 0;
            MPI_Test(&r[i], &flag, MPI_STATUS_IGNORE);
            s->group[i].r = r[i];
            if (!flag && first < 0) first = i;
        }
        char w[96];
        const p2p_post *p = &s->group[first < 0 ? 0 : first];
        st = loom_errf(c->ctx, LOOM_ERR_COMM,
                       "group_end on %s timed out after %g s waiting for the %s rank %d (tag "
                       "%d) (LOOM_COMM_TIMEOUT sets the limit)",
                       loom_comm_where(c, w, sizeof w), c->timeout_s,
                       p->kind == 's' ? "send to" : "recv from", p->peer, p->tag);
        abandon(c, s->group, n);
    }
    free(r);
    s->n_group = 0;
    if (!st) st = reap_sends(c);
    return st;
}

__attribute__((noreturn)) static void mpi_abort(loom_comm *c, int code) {
    MPI_Abort(S(c)->comm, code ? code : 1);
    exit(code);
}

static const loom_comm_vt mpi_vt = {
    .name = "mpi",
    .free = mpi_free,
    .split = mpi_split,
    .allreduce = mpi_allreduce,
    .reduce_scatter = mpi_reduce_scatter,
    .allgather = mpi_allgather,
    .broadcast = mpi_broadcast,
    .alltoall = mpi_alltoall,
    .send = mpi_send,
    .recv = mpi_recv,
    .group_end = mpi_group_end,
    .barrier = mpi_barrier,
    .wait = mpi_wait,
    .abort = mpi_abort,
};

#else  /* !LOOM_HAVE_MPI: comm.c answers LOOM_COMM_MPI with what to install */
typedef int loom_comm_mpi_not_built; /* a translation unit may not be empty */
#endif
