/* The Gloo backend (CPU ranks without MPI): a C++ shim over Gloo (Debian's
 * libgloo-dev, the library of PyTorch's CPU collectives) behind
 * loom_comm_vt. Built only with LOOM_HAVE_GLOO (the Makefile defines it
 * when a program using Gloo links). No C++ exception leaves this file:
 * every entry point catches and turns them into loom_errf messages.
 *
 * Bootstrap: the launcher's variables give rank and size
 * (loom_launch_from_env); each rank opens Gloo's TCP device and one pair per
 * peer, and the pairs' addresses travel over loom's TCP rendezvous (rank 0
 * hosts it on MASTER_PORT; loom_rendezvous_allgather), so no Redis, file
 * store or MPI is needed. A split exchanges the new pairs' addresses over
 * the parent group.
 *
 * Each group of two or more ranks has two Gloo contexts (full meshes): one
 * for its data, one on which a thread of each rank answers "where are
 * you?" (what the rank waits for on this group), so a rank whose operation
 * failed or timed out can name the members that are not in it, like the
 * MPI backend's diagnosis. A group of one rank uses no Gloo at all (copies,
 * and messages to itself from a local queue).
 *
 * Gloo waits with a timeout, and a wait that times out closes every pair of
 * its context: the group is then broken, on this rank and (their pairs to
 * it closed) on its peers, whose next operation on the group fails at once.
 * Sends outside group_start/end are copied and posted; a thread of the
 * group (started by the first such send) waits for them in order and
 * releases the copies as they complete; loom_comm_free waits for the rest
 * (up to the timeout). Debian's Gloo headers lack gloo/common/memory.h, so
 * only the transport-neutral headers are used (no polling of a buffer:
 * threads wait instead). */

extern "C" {
#include "comm_impl.h"
}

#ifdef LOOM_HAVE_GLOO

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/context.h>
#include <gloo/math.h>
#include <gloo/transport/address.h>
#include <gloo/transport/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

namespace {

using std::chrono::milliseconds;
using UB = gloo::transport::UnboundBuffer;

/* "Forever": Gloo adds a wait's length to the clock, so not more than this. */
const milliseconds kNever = std::chrono::hours(100);
const uint8_t kP2PSlot = 0x40;  /* slot prefixes beside Gloo's own (0x01-0x08) */
const uint8_t kAskSlot = 0x41, kTellSlot = 0x42;
const size_t kAddr = gloo::transport::Address::kMaxByteSize;
const size_t kEntry = 4 + kAddr; /* length, then the address bytes */

enum Waiting : uint64_t { IDLE = 0, COLLECTIVE = 1, P2P = 2, GAVE_UP = 3 };

/* A gloo::Context over pairs that loom connected itself. */
class MeshContext : public gloo::Context {
  public:
    MeshContext(int me, int n, std::shared_ptr<gloo::transport::Device> dev,
                std::shared_ptr<gloo::transport::Context> tc)
        : gloo::Context(me, n) {
        device_ = std::move(dev);
        transportContext_ = std::move(tc);
    }
};

struct Msg { /* an owned buffer and the Gloo buffer over it (or over the caller's) */
    std::vector<char> mem;
    std::unique_ptr<UB> ub;
    char kind = 's';
    int peer = 0, tag = 0;
};

struct SelfRecv {
    void *buf;
    size_t bytes;
    int tag;
};

struct Tell {
    uint64_t seq, waiting;
};

struct Group {
    std::shared_ptr<gloo::transport::Device> dev; /* shared by every group of the world */
    std::shared_ptr<gloo::Context> g, diag;       /* null for a group of one */
    std::vector<int> world;                       /* world rank of each member */
    int world_size = 1;
    std::atomic<uint64_t> seq{0}, wait_seq{0}, waiting{IDLE};
    double stall_s = 0;
    /* sends outside a group, waited for by the reaper thread */
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Msg> sends;
    UB *reaping = nullptr;                        /* the send the reaper waits for */
    std::string send_error;                       /* a send that failed, for the next call */
    std::thread reaper;
    std::vector<Msg> posted;                      /* inside group_start/end */
    std::deque<Msg> self;                         /* sent to oneself, not yet received */
    std::vector<SelfRecv> self_recvs;             /* group: receives from oneself */
    std::vector<std::unique_ptr<Msg>> abandoned;  /* Gloo may still write them */
    /* the "where are you?" server */
    std::thread server;
    std::unique_ptr<UB> ask;
    uint64_t ask_mem[2] = {0, 0};
    std::vector<std::unique_ptr<UB>> tell;
    std::vector<Tell> tell_mem;
    std::atomic<bool> stop{false};
};

Group *S(loom_comm *c) { return static_cast<Group *>(c->impl); }

milliseconds ms_of(double s) {
    if (s <= 0 || s > 3.6e5) return kNever;
    return milliseconds(s * 1e3 < 1 ? 1 : (long long)(s * 1e3));
}

/* Gloo's messages start with "[file:line] ": the rest is the news. */
std::string clean(const char *what) {
    std::string m = what ? what : "unknown error";
    if (!m.empty() && m[0] == '[') {
        size_t k = m.find("] ");
        if (k != std::string::npos) m = m.substr(k + 2);
    }
    return m;
}

bool is_timeout(const std::string &m) { return m.find("Timed out") != std::string::npos; }

/* ---- "where are you?" ---- */

/* The thread of each rank that answers the group's members: one receive
 * from any peer, then the answer; a peer whose connection closed under the
 * answer is no longer served, and the thread ends when the diag context
 * fails or loom_comm_free aborts its waits. */
void serve(Group *s, int me, int n) {
    std::vector<int> others;
    for (int q = 0; q < n; q++)
        if (q != me) others.push_back(q);
    while (!s->stop.load() && !others.empty()) {
        int src = -1;
        try {
            s->ask->recv(others, gloo::Slot::build(kAskSlot, 0));
            if (!s->ask->waitRecv(&src, kNever) || s->stop.load()) return;
        } catch (...) {
            return;
        }
        if (src < 0 || src >= n || src == me) continue;
        try {
            const uint64_t w = s->waiting.load();
            s->tell_mem[src].waiting = w;
            s->tell_mem[src].seq = w == COLLECTIVE || w == GAVE_UP ? s->wait_seq.load()
                                                                   : s->seq.load();
            s->tell[src]->send(src, gloo::Slot::build(kTellSlot, 0));
            if (!s->tell[src]->waitSend(nullptr, kNever)) return;
        } catch (...) {
            others.erase(std::find(others.begin(), others.end(), src));
        }
    }
}

void start_server(Group *s, int me, int n) {
    s->ask = s->diag->createUnboundBuffer(s->ask_mem, sizeof s->ask_mem);
    s->tell_mem.assign(n, Tell{0, 0});
    for (int q = 0; q < n; q++)
        s->tell.push_back(s->diag->createUnboundBuffer(&s->tell_mem[q], sizeof(Tell)));
    s->server = std::thread(serve, s, me, n);
}

/* After operation `seq` of group c failed: asks every other member (for up
 * to 2 s) where it is and writes those not in this operation into out. */
std::string diagnose(loom_comm *c, uint64_t seq) {
    Group *s = S(c);
    const int n = c->size, me = c->rank;
    if (!s->diag) return "nobody (a group of one rank)";
    struct Q {
        Tell tell = {0, 0};
        uint64_t ask[2] = {1, 0};
        std::unique_ptr<UB> t, a;
        int got = 0; /* 1 answered, -1 connection closed */
    };
    std::vector<std::unique_ptr<Q>> qs(n);
    for (int q = 0; q < n; q++) {
        if (q == me) continue;
        qs[q].reset(new Q);
        Q &x = *qs[q];
        x.ask[1] = seq;
        try {
            x.t = s->diag->createUnboundBuffer(&x.tell, sizeof x.tell);
            x.a = s->diag->createUnboundBuffer(x.ask, sizeof x.ask);
            x.t->recv(q, gloo::Slot::build(kTellSlot, 0));
            x.a->send(q, gloo::Slot::build(kAskSlot, 0));
        } catch (...) {
            x.got = -1;
        }
    }
    /* live members answer at once (their server threads); a closed
     * connection fails at once; a wait that runs out closes the diag
     * context's pairs, which only a hung process can cause */
    const double t0 = loom_now_s(), grace = c->timeout_s > 0 && c->timeout_s < 2 ? c->timeout_s : 2;
    for (int q = 0; q < n; q++) {
        if (q == me || qs[q]->got) continue;
        double left = grace - (loom_now_s() - t0);
        try {
            qs[q]->got = qs[q]->t->waitRecv(nullptr, ms_of(left > 0.01 ? left : 0.01)) ? 1 : 0;
        } catch (const std::exception &e) {
            qs[q]->got = is_timeout(clean(e.what())) ? 0 : -1;
        }
    }
    std::string out;
    char line[320];
    int named = 0;
    for (int q = 0; q < n; q++) {
        if (q == me) continue;
        Q &x = *qs[q];
        const char *why = nullptr;
        char buf[200];
        if (x.got == 1) {
            const uint64_t w = x.tell.waiting, ws = x.tell.seq;
            if (w == COLLECTIVE && ws == seq) continue; /* waits here too */
            if (w == COLLECTIVE)
                snprintf(buf, sizeof buf, "waits in this group's operation #%llu, this one is "
                                          "#%llu (the ranks call the group's operations in "
                                          "another order)",
                         (unsigned long long)ws, (unsigned long long)seq);
            else if (w == GAVE_UP && ws == seq)
                snprintf(buf, sizeof buf, "gave up on this operation too (it failed or timed "
                                          "out there)");
            else if (w == GAVE_UP)
                snprintf(buf, sizeof buf, "gave up on this group's operation #%llu",
                         (unsigned long long)ws);
            else if (w == P2P)
                snprintf(buf, sizeof buf, "waits in a send or receive on this group, not in "
                                          "this operation");
            else
                snprintf(buf, sizeof buf, "is not waiting on this group (still computing, or "
                                          "in another group's operation; it has started %llu "
                                          "of its operations)",
                         (unsigned long long)ws);
            why = buf;
        } else if (x.got < 0) {
            why = "is gone (its connection is closed: the process ended or failed)";
        } else {
            why = "did not answer (it is gone or hung)";
        }
        if (x.got != 1) s->abandoned.emplace_back(new Msg{{}, std::move(x.t)});
        if (x.got != 1) s->abandoned.emplace_back(new Msg{{}, std::move(x.a)});
        snprintf(line, sizeof line, "%srank %d of the group (world rank %d), which %s",
                 named ? "; " : "", q, s->world[q], why);
        out += line;
        named++;
    }
    if (!named) out = "every member is in this operation (the transport itself failed)";
    return out;
}

/* An operation failed: the group is broken; the message names the members
 * not in it. */
loom_status failed(loom_comm *c, const char *what, uint64_t seq, const std::string &err) {
    Group *s = S(c);
    c->broken = true;
    s->wait_seq = seq;
    s->waiting = GAVE_UP;
    std::string who = diagnose(c, seq);
    char w[96];
    loom_comm_where(c, w, sizeof w);
    if (is_timeout(err))
        return loom_errf(c->ctx, LOOM_ERR_COMM,
                         "%s on %s timed out after %g s waiting for %s (--comm-timeout or "
                         "LOOM_COMM_TIMEOUT sets the limit)",
                         what, w, c->timeout_s, who.c_str());
    return loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s failed (%s); the members: %s", what, w,
                     err.c_str(), who.c_str());
}

/* The *_async variants complete at once, and hand back a request that is
 * already done (so a wait on another group's request is still refused). */
loom_status done_req(loom_comm *c, loom_status st, loom_comm_req **req) {
    if (st || !req) return st;
    *req = (loom_comm_req *)loom_calloc(c->ctx, 1, sizeof **req, "Gloo request");
    if (!*req) return LOOM_ERR_OOM;
    (*req)->comm = c;
    return LOOM_OK;
}

/* Runs one collective: the stall hook, the bookkeeping the diagnosis reads,
 * and every exception turned into an error. */
template <typename F>
loom_status collective(loom_comm *c, const char *what, F &&f) {
    Group *s = S(c);
    if (s->stall_s > 0) {
        const double t = s->stall_s;
        s->stall_s = 0;
        std::this_thread::sleep_for(milliseconds((long long)(t * 1e3)));
    }
    const uint64_t seq = ++s->seq;
    s->wait_seq = seq;
    s->waiting = COLLECTIVE;
    try {
        f();
        s->waiting = IDLE;
        return LOOM_OK;
    } catch (const std::bad_alloc &) {
        s->waiting = IDLE;
        return loom_errf(c->ctx, LOOM_ERR_OOM, "%s on group '%s': out of memory", what, c->name);
    } catch (const std::exception &e) {
        return failed(c, what, seq, clean(e.what()));
    } catch (...) {
        return failed(c, what, seq, "unknown exception");
    }
}

/* ---- building a group's meshes ---- */

/* Pairs to every peer in two transport contexts (data, diag); the
 * addresses this rank publishes, entry (k * n + q) for context k and peer
 * q, each kEntry bytes. */
struct Mesh {
    std::shared_ptr<gloo::transport::Context> tc[2];
    std::vector<char> mine;
};

void mesh_create(Mesh &m, const std::shared_ptr<gloo::transport::Device> &dev, int me, int n,
                 double timeout_s) {
    m.mine.assign(2 * (size_t)n * kEntry, 0);
    for (int k = 0; k < 2; k++) {
        m.tc[k] = dev->createContext(me, n);
        m.tc[k]->setTimeout(ms_of(timeout_s));
        for (int q = 0; q < n; q++) {
            if (q == me) continue;
            std::vector<char> a = m.tc[k]->createPair(q)->address().bytes();
            if (a.size() > kAddr) throw std::runtime_error("a Gloo address is too long");
            char *e = &m.mine[((size_t)k * n + q) * kEntry];
            uint32_t len = (uint32_t)a.size();
            memcpy(e, &len, 4);
            memcpy(e + 4, a.data(), a.size());
        }
    }
}

/* Connects every pair to what peer q published for this rank (all holds
 * every member's `mine`, stride bytes apart), in rank order as Gloo's own
 * full mesh does, and fills the group's contexts. */
void mesh_connect(Mesh &m, Group *s, const char *all, size_t stride, int me, int n) {
    for (int k = 0; k < 2; k++) {
        for (int q = 0; q < n; q++) {
            if (q == me) continue;
            const char *e = all + (size_t)q * stride + ((size_t)k * n + me) * kEntry;
            uint32_t len;
            memcpy(&len, e, 4);
            if (len == 0 || len > kAddr)
                throw std::runtime_error("rank " + std::to_string(q) + " sent no address");
            try {
                m.tc[k]->getPair(q)->connect(std::vector<char>(e + 4, e + 4 + len));
            } catch (const std::exception &x) {
                throw std::runtime_error("connecting to rank " + std::to_string(q) + ": " +
                                         clean(x.what()));
            }
        }
    }
    s->g = std::make_shared<MeshContext>(me, n, s->dev, m.tc[0]);
    s->diag = std::make_shared<MeshContext>(me, n, s->dev, m.tc[1]);
    s->g->setTimeout(m.tc[0]->getTimeout());
    s->diag->setTimeout(m.tc[1]->getTimeout());
}

extern const loom_comm_vt gloo_vt;

loom_comm *wrap(loom_ctx *ctx, const char *name, int rank, int size, const loom_comm *like,
                Group *s) {
    loom_comm *c = loom_comm_new(ctx, &gloo_vt, name, rank, size, like);
    if (!c) {
        delete s;
        return nullptr;
    }
    c->impl = s;
    try {
        if (s->diag) start_server(s, rank, size);
    } catch (const std::exception &e) {
        loom_log(ctx, LOOM_LOG_WARN, "group '%s': no diagnosis of failed operations (%s)",
                 name, clean(e.what()).c_str());
    }
    return c;
}

/* ---- the table ---- */

void g_free(loom_comm *c) {
    Group *s = S(c);
    {
        /* outstanding sends: their receivers have the timeout to take them */
        std::unique_lock<std::mutex> lk(s->mu);
        const double t0 = loom_now_s();
        while ((!s->sends.empty() || s->reaping) &&
               (c->timeout_s <= 0 || loom_now_s() - t0 < c->timeout_s))
            s->cv.wait_for(lk, milliseconds(20));
        if (!s->sends.empty() || s->reaping) {
            char w[96];
            loom_log(c->ctx, LOOM_LOG_WARN,
                     "freeing %s: %zu send(s) were never received (no matching recv within %g s)",
                     loom_comm_where(c, w, sizeof w), s->sends.size() + (s->reaping ? 1 : 0),
                     c->timeout_s);
        }
        s->stop = true;
        if (s->reaping) s->reaping->abortWaitSend();
        s->cv.notify_all();
    }
    if (s->reaper.joinable()) s->reaper.join();
    if (s->ask) s->ask->abortWaitRecv();
    for (auto &t : s->tell) t->abortWaitSend();
    if (s->server.joinable()) s->server.join();
    try {
        if (s->g) s->g->closeConnections();
        if (s->diag) s->diag->closeConnections();
    } catch (...) {
    }
    delete s;
    free(c);
}

loom_status g_split(loom_comm *parent, int color, int key, const char *name, loom_comm **out);

template <typename T>
void reduce_into(T *acc, const T *x, size_t n, loom_red_op op) {
    if (op == LOOM_RED_MAX)
        for (size_t i = 0; i < n; i++) acc[i] = x[i] > acc[i] ? x[i] : acc[i];
    else
        for (size_t i = 0; i < n; i++) acc[i] += x[i];
}

void reduce_any(void *acc, const void *x, size_t n, loom_dtype dt, loom_red_op op) {
    switch (dt) {
    case LOOM_F32: reduce_into((float *)acc, (const float *)x, n, op); break;
    case LOOM_F64: reduce_into((double *)acc, (const double *)x, n, op); break;
    case LOOM_I32: reduce_into((int32_t *)acc, (const int32_t *)x, n, op); break;
    default: reduce_into((int64_t *)acc, (const int64_t *)x, n, op); break;
    }
}

template <typename T>
void gloo_allreduce(Group *s, T *buf, size_t n, loom_red_op op, milliseconds t) {
    gloo::AllreduceOptions o(s->g);
    o.setOutput(buf, n);
    void (*fn)(void *, const void *, const void *, size_t);
    if (op == LOOM_RED_MAX) fn = &gloo::max<T>;
    else fn = &gloo::sum<T>;
    o.setReduceFunction(fn);
    o.setTimeout(t);
    gloo::allreduce(o);
}

loom_status g_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt, loom_red_op op,
                        loom_comm_req **req) {
    Group *s = S(c);
    if (!s->g || n == 0) return done_req(c, LOOM_OK, req);
    const milliseconds t = ms_of(c->timeout_s);
    return done_req(c, collective(c, "Gloo allreduce", [&] {
        switch (dt) {
        case LOOM_F32: gloo_allreduce(s, (float *)buf, n, op, t); break;
        case LOOM_F64: gloo_allreduce(s, (double *)buf, n, op, t); break;
        case LOOM_I32: gloo_allreduce(s, (int32_t *)buf, n, op, t); break;
        default: gloo_allreduce(s, (int64_t *)buf, n, op, t); break;
        }
    }), req);
}

void gloo_alltoall(Group *s, const void *send, void *recv, size_t total, milliseconds t) {
    gloo::AlltoallOptions o(s->g);
    o.setInput((uint8_t *)send, total);
    o.setOutput((uint8_t *)recv, total);
    o.setTimeout(t);
    gloo::alltoall(o);
}

/* Block r of every rank's send meets at rank r (an alltoall), where it is
 * reduced in rank order: the same sums on every layout of the ranks. */
loom_status g_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                             loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    Group *s = S(c);
    const size_t es = loom_dtype_size(dt), block = n * es;
    if (!s->g) return done_req(c, loom_comm_copy(c, "reduce_scatter", recv, send, block), req);
    if (n == 0) return done_req(c, LOOM_OK, req);
    const size_t total = block * (size_t)c->size;
    char *tmp = (char *)loom_malloc(c->ctx, total, "reduce_scatter buffer");
    if (!tmp) return LOOM_ERR_OOM;
    loom_status st = collective(c, "Gloo reduce_scatter (alltoall)",
                                [&] { gloo_alltoall(s, send, tmp, total, ms_of(c->timeout_s)); });
    if (!st) {
        for (int r = 1; r < c->size; r++) reduce_any(tmp, tmp + (size_t)r * block, n, dt, op);
        memmove(recv, tmp, block);
    }
    if (!c->broken) free(tmp); /* an abandoned operation may still write it */
    return done_req(c, st, req);
}

bool overlap(const void *a, size_t na, const void *b, size_t nb) {
    const char *pa = (const char *)a, *pb = (const char *)b;
    return na && nb && pa < pb + nb && pb < pa + na;
}

loom_status g_allgather(loom_comm *c, const void *send, void *recv, size_t n, loom_dtype dt,
                        loom_comm_req **req) {
    Group *s = S(c);
    const size_t block = n * loom_dtype_size(dt), total = block * (size_t)c->size;
    if (!s->g) return done_req(c, loom_comm_copy(c, "allgather", recv, send, block), req);
    if (n == 0) return done_req(c, LOOM_OK, req);
    char *tmp = nullptr;
    const bool in_place = send == (const char *)recv + (size_t)c->rank * block;
    if (!in_place && overlap(send, block, recv, total)) {
        tmp = (char *)loom_malloc(c->ctx, block, "allgather copy");
        if (!tmp) return LOOM_ERR_OOM;
        memcpy(tmp, send, block);
        send = tmp;
    }
    loom_status st = collective(c, "Gloo allgather", [&] {
        gloo::AllgatherOptions o(s->g);
        if (!in_place) o.setInput((uint8_t *)send, block);
        o.setOutput((uint8_t *)recv, total);
        o.setTimeout(ms_of(c->timeout_s));
        gloo::allgather(o);
    });
    free(tmp);
    return done_req(c, st, req);
}

loom_status g_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    Group *s = S(c);
    if (!s->g || n == 0) return LOOM_OK;
    return collective(c, "Gloo broadcast", [&] {
        gloo::BroadcastOptions o(s->g);
        o.setOutput((uint8_t *)buf, n * loom_dtype_size(dt));
        o.setRoot(root);
        o.setTimeout(ms_of(c->timeout_s));
        gloo::broadcast(o);
    });
}

loom_status g_alltoall(loom_comm *c, const void *send, void *recv, size_t n, loom_dtype dt) {
    Group *s = S(c);
    const size_t total = n * loom_dtype_size(dt) * (size_t)c->size;
    if (!s->g) return loom_comm_copy(c, "alltoall", recv, send, total);
    if (n == 0) return LOOM_OK;
    char *tmp = nullptr;
    if (overlap(send, total, recv, total)) {
        tmp = (char *)loom_malloc(c->ctx, total, "alltoall copy");
        if (!tmp) return LOOM_ERR_OOM;
        memcpy(tmp, send, total);
        send = tmp;
    }
    loom_status st = collective(c, "Gloo alltoall",
                                [&] { gloo_alltoall(s, send, recv, total, ms_of(c->timeout_s)); });
    if (!c->broken) free(tmp);
    return st;
}

loom_status g_barrier(loom_comm *c) {
    Group *s = S(c);
    if (!s->g) return LOOM_OK;
    return collective(c, "Gloo barrier", [&] {
        gloo::BarrierOptions o(s->g);
        o.setTimeout(ms_of(c->timeout_s));
        gloo::barrier(o);
    });
}

loom_status g_wait(loom_comm *c, loom_comm_req *req) {
    free(req);
    return LOOM_OK;
}

/* ---- point to point ---- */

loom_status p2p_failed(loom_comm *c, const char *what, int peer, int tag, const std::string &e) {
    Group *s = S(c);
    c->broken = true;
    s->waiting = IDLE;
    char w[96];
    loom_comm_where(c, w, sizeof w);
    if (is_timeout(e))
        return loom_errf(c->ctx, LOOM_ERR_COMM,
                         "%s rank %d (tag %d) on %s timed out after %g s (LOOM_COMM_TIMEOUT "
                         "sets the limit; the group cannot be used again)",
                         what, peer, tag, w, c->timeout_s);
    return loom_errf(c->ctx, LOOM_ERR_COMM, "%s rank %d (tag %d) on %s failed: %s", what, peer,
                     tag, w, e.c_str());
}

/* The reaper: waits for the sends posted outside a group, in order, and
 * drops their copies. */
void reap_loop(Group *s) {
    std::unique_lock<std::mutex> lk(s->mu);
    for (;;) {
        s->cv.wait(lk, [&] { return s->stop.load() || !s->sends.empty(); });
        if (s->stop.load()) return;
        Msg m = std::move(s->sends.front());
        s->sends.pop_front();
        s->reaping = m.ub.get();
        lk.unlock();
        std::string err;
        bool aborted = false;
        try {
            aborted = !m.ub->waitSend(nullptr, kNever);
        } catch (const std::exception &e) {
            err = "send to rank " + std::to_string(m.peer) + " (tag " + std::to_string(m.tag) +
                  ") failed: " + clean(e.what());
        }
        lk.lock();
        s->reaping = nullptr;
        if (!err.empty() && s->send_error.empty()) s->send_error = err;
        if (aborted) s->abandoned.emplace_back(new Msg(std::move(m)));
        s->cv.notify_all();
    }
}

/* A send the reaper saw fail breaks the group. */
loom_status reap(loom_comm *c) {
    Group *s = S(c);
    std::lock_guard<std::mutex> lk(s->mu);
    if (s->send_error.empty()) return LOOM_OK;
    c->broken = true;
    char w[96];
    return loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s", s->send_error.c_str(),
                     loom_comm_where(c, w, sizeof w));
}

/* Moves the oldest message to oneself with `tag` into buf. */
bool take_self(Group *s, void *buf, size_t bytes, int tag, bool *size_ok) {
    for (auto it = s->self.begin(); it != s->self.end(); ++it) {
        if (it->tag != tag) continue;
        *size_ok = it->mem.size() == (bytes ? bytes : 1);
        if (*size_ok && bytes) memcpy(buf, it->mem.data(), bytes);
        s->self.erase(it);
        return true;
    }
    return false;
}

loom_status self_missing(loom_comm *c, int tag, bool size_ok) {
    char w[96];
    loom_comm_where(c, w, sizeof w);
    if (!size_ok)
        return loom_errf(c->ctx, LOOM_ERR_COMM,
                         "recv from rank %d (tag %d) on %s: the message this rank sent itself "
                         "has another size",
                         c->rank, tag, w);
    return loom_errf(c->ctx, LOOM_ERR_COMM,
                     "recv from rank %d (tag %d) on %s: this rank is that peer and sent itself "
                     "no such message before (it would wait forever)",
                     c->rank, tag, w);
}

loom_status g_send(loom_comm *c, const void *buf, size_t n, loom_dtype dt, int peer, int tag) {
    Group *s = S(c);
    const size_t bytes = n * loom_dtype_size(dt);
    try {
        loom_status st = reap(c);
        if (st) return st;
        if (peer == c->rank) {
            Msg m;
            m.mem.assign((const char *)buf, (const char *)buf + bytes);
            if (!bytes) m.mem.resize(1);
            m.tag = tag;
            s->self.push_back(std::move(m));
            return LOOM_OK;
        }
        if (bytes == 0) return LOOM_OK;
        Msg m;
        m.peer = peer;
        m.tag = tag;
        if (c->group_depth == 0) {
            m.mem.assign((const char *)buf, (const char *)buf + bytes);
            m.ub = s->g->createUnboundBuffer(m.mem.data(), bytes);
        } else {
            m.ub = s->g->createUnboundBuffer(const_cast<void *>(buf), bytes);
        }
        if (c->group_depth) {
            /* reserve the place first, so a failed push leaves nothing in flight */
            s->posted.reserve(s->posted.size() + 1);
            m.ub->send(peer, gloo::Slot::build(kP2PSlot, (uint32_t)tag));
            s->posted.push_back(std::move(m));
            return LOOM_OK;
        }
        std::lock_guard<std::mutex> lk(s->mu);
        if (!s->reaper.joinable()) s->reaper = std::thread(reap_loop, s);
        m.ub->send(peer, gloo::Slot::build(kP2PSlot, (uint32_t)tag));
        s->sends.push_back(std::move(m));
        s->cv.notify_all();
        return LOOM_OK;
    } catch (const std::bad_alloc &) {
        return loom_errf(c->ctx, LOOM_ERR_OOM, "send on group '%s': out of memory", c->name);
    } catch (const std::exception &e) {
        return p2p_failed(c, "send to", peer, tag, clean(e.what()));
    }
}

loom_status g_recv(loom_comm *c, void *buf, size_t n, loom_dtype dt, int peer, int tag) {
    Group *s = S(c);
    const size_t bytes = n * loom_dtype_size(dt);
    try {
        loom_status st = reap(c);
        if (st) return st;
        if (peer == c->rank) {
            if (c->group_depth) {
                s->self_recvs.push_back({buf, bytes, tag});
                return LOOM_OK;
            }
            bool size_ok = true;
            if (take_self(s, buf, bytes, tag, &size_ok) && size_ok) return LOOM_OK;
            return self_missing(c, tag, size_ok);
        }
        if (bytes == 0) return LOOM_OK;
        Msg m;
        m.kind = 'r';
        m.peer = peer;
        m.tag = tag;
        m.ub = s->g->createUnboundBuffer(buf, bytes);
        if (c->group_depth) s->posted.reserve(s->posted.size() + 1);
        m.ub->recv(peer, gloo::Slot::build(kP2PSlot, (uint32_t)tag));
        if (c->group_depth) {
            s->posted.push_back(std::move(m));
            return LOOM_OK;
        }
        s->waiting = P2P;
        m.ub->waitRecv(nullptr, ms_of(c->timeout_s));
        s->waiting = IDLE;
        return LOOM_OK;
    } catch (const std::bad_alloc &) {
        return loom_errf(c->ctx, LOOM_ERR_OOM, "recv on group '%s': out of memory", c->name);
    } catch (const std::exception &e) {
        return p2p_failed(c, "recv from", peer, tag, clean(e.what()));
    }
}

loom_status g_group_end(loom_comm *c) {
    Group *s = S(c);
    std::vector<Msg> posted;
    posted.swap(s->posted);
    std::vector<SelfRecv> selfs;
    selfs.swap(s->self_recvs);
    const double t0 = loom_now_s();
    s->waiting = P2P;
    for (size_t i = 0; i < posted.size(); i++) {
        Msg &m = posted[i];
        try {
            double left = c->timeout_s > 0 ? c->timeout_s - (loom_now_s() - t0) : 0;
            milliseconds t = c->timeout_s > 0 ? ms_of(left > 1e-3 ? left : 1e-3) : kNever;
            if (m.kind == 's') m.ub->waitSend(nullptr, t);
            else m.ub->waitRecv(nullptr, t);
        } catch (const std::exception &e) {
            for (size_t j = i; j < posted.size(); j++)
                s->abandoned.emplace_back(new Msg(std::move(posted[j])));
            std::string err = clean(e.what());
            c->broken = true;
            s->waiting = IDLE;
            char w[96];
            loom_comm_where(c, w, sizeof w);
            return loom_errf(c->ctx, LOOM_ERR_COMM,
                             "group_end on %s %s waiting for the %s rank %d (tag %d)%s%s "
                             "(LOOM_COMM_TIMEOUT sets the limit; the group cannot be used "
                             "again)",
                             w, is_timeout(err) ? "timed out" : "failed",
                             m.kind == 's' ? "send to" : "recv from", m.peer, m.tag,
                             is_timeout(err) ? "" : ": ", is_timeout(err) ? "" : err.c_str());
        }
    }
    s->waiting = IDLE;
    for (auto &r : selfs) {
        bool size_ok = true;
        if (!take_self(s, r.buf, r.bytes, r.tag, &size_ok) || !size_ok)
            return self_missing(c, r.tag, size_ok);
    }
    return reap(c);
}

__attribute__((noreturn)) void g_abort(loom_comm *c, int code) {
    /* Gloo has no MPI_Abort: this process ends, which closes its
     * connections; its peers' next operation with it fails at once, and
     * one waiting on another rank fails within the timeout, naming it */
    _exit(code ? code : 1);
}

const loom_comm_vt gloo_vt = {
    "gloo",       g_free,     g_split,   g_allreduce, g_reduce_scatter, g_allgather,
    g_broadcast,  g_alltoall, g_send,    g_recv,      g_group_end,      g_barrier,
    g_wait,       g_abort,    nullptr,   nullptr,          nullptr,          nullptr,
};

/* ---- split ---- */

loom_status g_split(loom_comm *parent, int color, int key, const char *name, loom_comm **out) {
    Group *p = S(parent);
    const int n = parent->size, me = parent->rank;
    /* everyone's (color, key, world rank) */
    std::vector<int32_t> info(3 * (size_t)n);
    int32_t mine[3] = {color < 0 ? -1 : color, key, p->world[me]};
    loom_status st = g_allgather(parent, mine, info.data(), 3, LOOM_I32, nullptr);
    if (st) return st;
    std::vector<int> members; /* parent ranks of my new group, by (key, parent rank) */
    int biggest = 1;
    for (int q = 0; q < n; q++) {
        int cnt = 0;
        for (int r = 0; r < n; r++) cnt += info[3 * r] >= 0 && info[3 * r] == info[3 * q];
        biggest = cnt > biggest ? cnt : biggest;
        if (color >= 0 && info[3 * q] == color) members.push_back(q);
    }
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return info[3 * a + 1] < info[3 * b + 1]; });
    const int size = (int)members.size();
    int rank = 0;
    for (int j = 0; j < size; j++)
        if (members[j] == me) rank = j;
    Group *s = nullptr;
    if (color >= 0) {
        try {
            s = new Group;
            s->dev = p->dev;
            s->world_size = p->world_size;
            for (int q : members) s->world.push_back(info[3 * q + 2]);
        } catch (...) {
            delete s;
            s = nullptr;
        }
    }
    /* Pairs, their addresses over the parent, the connections. Now and then
     * (about 1 split of 3 ranks in 30 under the sanitizers) a connection
     * comes back reset and the pair cannot be used again; every rank then
     * learns it over the parent and the whole mesh is built again, with a
     * connect phase short enough (15 s at most) that the pair left waiting
     * on the other side gives up soon. */
    const double connect_s = parent->timeout_s > 0 && parent->timeout_s < 15 ? parent->timeout_s : 15;
    std::string why;
    for (int attempt = 0;; attempt++) {
        Mesh m;
        why.clear();
        if (color >= 0 && !s) why = "out of memory";
        try {
            if (s && size > 1) mesh_create(m, p->dev, rank, size, connect_s);
        } catch (const std::exception &e) {
            why = clean(e.what());
        }
        /* the addresses over the parent, each rank's slot sized for the biggest group */
        const size_t stride = 2 * (size_t)biggest * kEntry;
        std::vector<char> all, slot(stride, 0);
        try {
            all.assign(stride * (size_t)n, 0);
        } catch (...) {
            delete s;
            return loom_errf(parent->ctx, LOOM_ERR_OOM, "split of '%s': out of memory",
                             parent->name);
        }
        if (!m.mine.empty()) memcpy(slot.data(), m.mine.data(), m.mine.size());
        st = g_allgather(parent, slot.data(), all.data(), stride, LOOM_U8, nullptr);
        if (st) {
            delete s;
            return st;
        }
        if (!why.empty()) {
            delete s;
            return loom_errf(parent->ctx, LOOM_ERR_COMM, "split of %s into '%s': %s",
                             parent->name, name, why.c_str());
        }
        int32_t ok = 1;
        if (s && size > 1) {
            /* the members' slots, in the new group's order */
            std::vector<char> mem((size_t)size * stride);
            for (int j = 0; j < size; j++)
                memcpy(&mem[(size_t)j * stride], &all[(size_t)members[j] * stride], stride);
            try {
                mesh_connect(m, s, mem.data(), stride, rank, size);
                s->g->setTimeout(ms_of(parent->timeout_s));
                s->diag->setTimeout(ms_of(parent->timeout_s));
            } catch (const std::exception &e) {
                why = clean(e.what());
                ok = 0;
                s->g.reset();
                s->diag.reset();
            }
        }
        std::vector<int32_t> oks((size_t)n);
        if ((st = g_allgather(parent, &ok, oks.data(), 1, LOOM_I32, nullptr))) {
            delete s;
            return st;
        }
        bool all_ok = true;
        for (int q = 0; q < n; q++) all_ok = all_ok && oks[q];
        if (all_ok) break;
        if (attempt < 2)
            LOOM_LOG_W(parent->ctx, "split of '%s' into '%s': %s; connecting the group again "
                       "(attempt %d of 3)", parent->name, name,
                       ok ? "another rank's connection failed" : why.c_str(), attempt + 2);
        if (attempt == 2) {
            delete s;
            if (ok)
                return loom_errf(parent->ctx, LOOM_ERR_COMM, "split of '%s' into '%s': another "
                                 "rank could not connect its group three times (its message "
                                 "says why)", parent->name, name);
            return loom_errf(parent->ctx, LOOM_ERR_COMM, "split of '%s' into '%s' (rank %d of "
                             "%d): %s", parent->name, name, rank, size, why.c_str());
        }
    }
    if (color < 0) return LOOM_OK;
    loom_comm *c = wrap(parent->ctx, name, rank, size, parent, s);
    if (!c) return LOOM_ERR_OOM;
    *out = c;
    return LOOM_OK;
}

} // namespace

/* ---- the world ---- */

extern "C" loom_status loom_comm_gloo_world(loom_ctx *ctx, loom_comm **out) {
    double timeout;
    loom_status st = loom_comm_env_timeout(ctx, &timeout);
    if (st) return st;
    loom_launch env;
    st = loom_launch_from_env(ctx, &env);
    if (st) return st;
    const int rank = env.rank, size = env.size;
    /* Gloo's TCP pairs write with writev, which raises SIGPIPE when a peer
     * has gone: its default action ends this process without a word, where
     * the write's EPIPE would be reported naming the peer. A process that
     * left SIGPIPE at its default (Python ignores it already) ignores it. */
    struct sigaction pipe_sa;
    if (size > 1 && sigaction(SIGPIPE, NULL, &pipe_sa) == 0 && pipe_sa.sa_handler == SIG_DFL &&
        !(pipe_sa.sa_flags & SA_SIGINFO))
        signal(SIGPIPE, SIG_IGN);
    Group *s = nullptr;
    Mesh m;
    std::string why;
    try {
        s = new Group;
        s->world_size = size;
        for (int r = 0; r < size; r++) s->world.push_back(r);
        if (size > 1) {
            gloo::transport::tcp::attr attr;
            const char *ifname = getenv("GLOO_SOCKET_IFNAME");
            char route[64] = "";
            loom_route_to(env.addr, env.port, route, sizeof route);
            std::string host = route;
            if (ifname && *ifname) attr.iface = ifname;
            else if (!host.empty()) attr.hostname = host;
            else {
                char h[256] = "";
                gethostname(h, sizeof h - 1);
                attr.hostname = h;
            }
            try {
                s->dev = gloo::transport::tcp::CreateDevice(attr);
            } catch (const std::exception &e) {
                throw std::runtime_error(
                    "cannot open Gloo's TCP device on " +
                    (attr.iface.empty() ? "address " + attr.hostname
                                        : "interface " + attr.iface + " (GLOO_SOCKET_IFNAME)") +
                    ": " + clean(e.what()));
            }
            mesh_create(m, s->dev, rank, size, timeout);
        }
    } catch (const std::exception &e) {
        why = clean(e.what());
    }
    if (!s) return loom_errf(ctx, LOOM_ERR_OOM, "Gloo world: out of memory");
    if (size > 1) {
        const size_t each = 2 * (size_t)size * kEntry;
        std::vector<char> all;
        try {
            all.assign(each * (size_t)size, 0);
            if (m.mine.empty()) m.mine.assign(each, 0);
        } catch (...) {
            delete s;
            return loom_errf(ctx, LOOM_ERR_OOM, "Gloo world: out of memory");
        }
        int lr = 0, ls = 1;
        st = loom_rendezvous_allgather(ctx, env.addr, env.port, rank, size, timeout,
                                       why.empty(), why.c_str(), m.mine.data(), each, all.data(),
                                       &lr, &ls);
        if (st) {
            delete s;
            return loom_err_prefix(ctx, "Gloo world (rank %d of %d from %s)", rank, size,
                                   env.rank_var ? env.rank_var : "?");
        }
        try {
            mesh_connect(m, s, all.data(), each, rank, size);
        } catch (const std::exception &e) {
            delete s;
            return loom_errf(ctx, LOOM_ERR_COMM, "Gloo world (rank %d of %d): %s", rank, size,
                             clean(e.what()).c_str());
        }
    }
    const char *stall = getenv("LOOM_TEST_STALL");
    int stall_rank = -1;
    double stall_s = 0;
    if (stall && sscanf(stall, "%d:%lf", &stall_rank, &stall_s) == 2 && stall_rank == rank)
        s->stall_s = stall_s;
    loom_comm *c = wrap(ctx, "world", rank, size, nullptr, s);
    if (!c) return LOOM_ERR_OOM;
    c->timeout_s = timeout;
    if (ctx) loom_ctx_set_rank(ctx, rank, size);
    *out = c;
    return LOOM_OK;
}

#endif /* LOOM_HAVE_GLOO */
