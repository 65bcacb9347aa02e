/* Launcher variables and the TCP rendezvous that hands rank 0's NCCL id to
 * the other ranks, or gathers every rank's Gloo addresses, when the job was
 * not started by mpirun (torchrun-style: RANK, WORLD_SIZE, LOCAL_RANK,
 * MASTER_ADDR, MASTER_PORT). Plain POSIX sockets, built on every
 * configuration (the NCCL and Gloo backends use it; the tests of
 * tests/nccl/ and tests/gloo/ run it without a GPU).
 *
 * Protocol (one TCP connection per rank > 0, closed at the end):
 *   rank r > 0 -> rank 0: hello  {magic, version, rank, size, ok, len, host,
 *                                 why, mine[len]}
 *   rank 0 -> rank r:     reply  {magic, status, local_rank, local_size,
 *                                 bad_rank, why, len, blob[len]}
 * status 0: everyone was ok and blob is rank 0's (loom_rendezvous) or every
 * rank's `mine` in rank order (loom_rendezvous_allgather); otherwise
 * bad_rank/why name the first rank that was not. Integers travel in network
 * order. */

#include "comm_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define RDV_MAGIC "LOOMRDV1"
#define RDV_VERSION 2
#define RDV_HOST 64
#define RDV_WHY 200
#define RDV_MAX_BLOB 4096
#define RDV_MAX_EACH (1 << 20)  /* allgather: bytes per rank */
#define RDV_MAX_ALL (64 << 20)  /* allgather: bytes in all */

/* ---- launcher variables ---- */

static bool env_int(const char *name, long lo, long hi, long *out, bool *bad) {
    const char *v = getenv(name);
    if (!v || !*v) return false;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || x < lo || x > hi) {
        *bad = true;
        return true;
    }
    *out = x;
    return true;
}

loom_status loom_launch_from_env(loom_ctx *ctx, loom_launch *out) {
    memset(out, 0, sizeof *out);
    out->rank = 0;
    out->size = 1;
    out->local_rank = -1;
    out->port = 29500;
    static const char *const pairs[][2] = {
        {"RANK", "WORLD_SIZE"},
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"},
        {"SLURM_PROCID", "SLURM_NTASKS"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        long r = 0, s = 0;
        bool bad = false;
        bool hr = env_int(pairs[i][0], 0, INT_MAX, &r, &bad);
        bool hs = env_int(pairs[i][1], 1, INT_MAX, &s, &bad);
        if (!hr && !hs) continue;
        if (bad)
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "launcher variables %s='%s' %s='%s': not a rank and a world size",
                             pairs[i][0], getenv(pairs[i][0]) ? getenv(pairs[i][0]) : "",
                             pairs[i][1], getenv(pairs[i][1]) ? getenv(pairs[i][1]) : "");
        if (hr != hs)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s is set but %s is not: set both",
                             hr ? pairs[i][0] : pairs[i][1], hr ? pairs[i][1] : pairs[i][0]);
        if (r >= s)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s=%ld is not below %s=%ld", pairs[i][0], r,
                             pairs[i][1], s);
        out->rank = (int)r;
        out->size = (int)s;
        out->rank_var = pairs[i][0];
        break;
    }
    static const char *const locals[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "SLURM_LOCALID", "MPI_LOCALRANKID"};
    for (size_t i = 0; i < sizeof locals / sizeof locals[0]; i++) {
        long l = 0;
        bool bad = false;
        if (!env_int(locals[i], 0, INT_MAX, &l, &bad)) continue;
        if (bad)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s='%s' is not a local rank", locals[i],
                             getenv(locals[i]));
        out->local_rank = (int)l;
        out->local_var = locals[i];
        break;
    }
    const char *a = getenv("MASTER_ADDR");
    if (a && *a) {
        if (strlen(a) >= sizeof out->addr)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "MASTER_ADDR is longer than %zu characters",
                             sizeof out->addr - 1);
        snprintf(out->addr, sizeof out->addr, "%s", a);
    }
    long p = 0;
    bool bad = false;
    if (env_int("MASTER_PORT", 1, 65535, &p, &bad)) {
        if (bad)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "MASTER_PORT='%s' is not a port (1-65535)",
                             getenv("MASTER_PORT"));
        out->port = (int)p;
    }
    return LOOM_OK;
}

/* ---- sockets with deadlines ---- */


/* Milliseconds left before `deadline` (< 0: none), at most cap_ms. */
static int left_ms(double deadline, int cap_ms) {
    if (deadline < 0) return cap_ms;
    double l = (deadline - loom_now_s()) * 1e3;
    if (l <= 0) return 0;
    return l < cap_ms ? (int)l + 1 : cap_ms;
}

static bool expired(double deadline) { return deadline >= 0 && loom_now_s() >= deadline; }

/* Writes/reads exactly n bytes before the deadline. 0 on success, else an
 * errno value (ETIMEDOUT; ECONNRESET for end of stream). */
static int send_all(int fd, const void *buf, size_t n, double deadline) {
    const char *p = buf;
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (expired(deadline)) return ETIMEDOUT;
            struct pollfd pf = {fd, POLLOUT, 0};
            poll(&pf, 1, left_ms(deadline, 1000));
            continue;
        }
        return k < 0 ? errno : ECONNRESET;
    }
    return 0;
}

static int recv_all(int fd, void *buf, size_t n, double deadline) {
    char *p = buf;
    while (n) {
        ssize_t k = recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0) return ECONNRESET;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (expired(deadline)) return ETIMEDOUT;
            struct pollfd pf = {fd, POLLIN, 0};
            poll(&pf, 1, left_ms(deadline, 1000));
            continue;
        }
        return errno;
    }
    return 0;
}

static void set_nonblocking(int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static void put32(unsigned char *p, int32_t v) {
    uint32_t n = htonl((uint32_t)v);
    memcpy(p, &n, 4);
}

static int32_t get32(const unsigned char *p) {
    uint32_t n;
    memcpy(&n, p, 4);
    return (int32_t)ntohl(n);
}

/* hello: magic 8, version 4, rank 4, size 4, ok 4, len 4, host 64, why 200 */
enum { HELLO_BYTES = 8 + 5 * 4 + RDV_HOST + RDV_WHY, HELLO_HOST = 28 };
/* reply: magic 8, status 4, local_rank 4, local_size 4, bad_rank 4, why 200, len 4 */
enum { REPLY_BYTES = 8 + 4 * 4 + RDV_WHY + 4 };

typedef struct peer {
    int fd;
    int rank;
    bool ok;
    unsigned char *mine; /* allgather: the rank's bytes (owned) */
    char host[RDV_HOST];
    char why[RDV_WHY];
} peer;

static void my_host(char *host) {
    memset(host, 0, RDV_HOST);
    if (gethostname(host, RDV_HOST - 1) != 0) snprintf(host, RDV_HOST, "unknown");
}

/* What the ranks exchange: `mine` (each bytes, the same on every rank: the
 * hello carries it) and the reply's payload, `out` (out_len bytes): rank
 * 0's blob in loom_rendezvous (its `out` is sent, the others' filled), every
 * rank's `mine` in rank order in loom_rendezvous_allgather. */
typedef struct xchg {
    const void *mine;
    size_t each;
    void *out;
    size_t out_len;
    bool gather;
} xchg;

/* ---- rank 0 ---- */

static int listen_on(int port, int *err) {
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    int one = 1, zero = 0;
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
        struct sockaddr_in6 a6;
        memset(&a6, 0, sizeof a6);
        a6.sin6_family = AF_INET6;
        a6.sin6_addr = in6addr_any;
        a6.sin6_port = htons((uint16_t)port);
        if (bind(fd, (struct sockaddr *)&a6, sizeof a6) == 0 && listen(fd, 128) == 0) {
            set_nonblocking(fd);
            return fd;
        }
        *err = errno;
        close(fd);
        if (*err == EADDRINUSE) return -1;
    }
    /* no IPv6: IPv4 only */
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        *err = errno;
        return -1;
    }
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a4;
    memset(&a4, 0, sizeof a4);
    a4.sin_family = AF_INET;
    a4.sin_addr.s_addr = htonl(INADDR_ANY);
    a4.sin_port = htons((uint16_t)port);
    if (bind(fd, (struct sockaddr *)&a4, sizeof a4) != 0 || listen(fd, 128) != 0) {
        *err = errno;
        close(fd);
        return -1;
    }
    set_nonblocking(fd);
    return fd;
}

/* Reads one hello from a fresh connection. 1: a hello; 0: not a loom rank
 * (closed, ignored); -1: fatal (message in ctx). */
static int read_hello(loom_ctx *ctx, int fd, int size, int port, double deadline, peer *out,
                      peer *peers, const xchg *x) {
    unsigned char h[HELLO_BYTES];
    /* a connection that says nothing for 10 s is not one of ours */
    double d = loom_now_s() + 10.0;
    if (deadline >= 0 && deadline < d) d = deadline;
    if (recv_all(fd, h, sizeof h, d) != 0 || memcmp(h, RDV_MAGIC, 8) != 0) return 0;
    int version = get32(h + 8), rank = get32(h + 12), wsize = get32(h + 16), ok = get32(h + 20),
        len = get32(h + 24);
    if (version != RDV_VERSION) {
        loom_errf(ctx, LOOM_ERR_COMM,
                  "rendezvous on port %d: a rank speaks protocol version %d, rank 0 speaks %d "
                  "(mixed loom builds?)",
                  port, version, RDV_VERSION);
        return -1;
    }
    if (wsize != size) {
        loom_errf(ctx, LOOM_ERR_COMM,
                  "rendezvous on port %d: rank %d was started with a world size of %d, rank 0 "
                  "with %d: every rank needs the same WORLD_SIZE",
                  port, rank, wsize, size);
        return -1;
    }
    if (rank <= 0 || rank >= size) {
        loom_errf(ctx, LOOM_ERR_COMM,
                  "rendezvous on port %d: a process connected as rank %d, not a rank in "
                  "1..%d of a world of %d",
                  port, rank, size - 1, size);
        return -1;
    }
    if (peers[rank].fd >= 0) {
        loom_errf(ctx, LOOM_ERR_COMM,
                  "rendezvous on port %d: two processes connected as rank %d: check RANK on "
                  "every process",
                  port, rank);
        return -1;
    }
    if (len < 0 || (size_t)len != x->each) {
        loom_errf(ctx, LOOM_ERR_COMM,
                  "rendezvous on port %d: rank %d sent %d bytes, rank 0 expected %zu (mixed "
                  "loom builds, or another backend on the same MASTER_PORT?)",
                  port, rank, len, x->each);
        return -1;
    }
    out->mine = len ? loom_malloc(ctx, (size_t)len, "rendezvous data") : NULL;
    if (len && !out->mine) return -1;
    if (len && recv_all(fd, out->mine, (size_t)len, d) != 0) {
        free(out->mine);
        out->mine = NULL;
        return 0;
    }
    out->fd = fd;
    out->rank = rank;
    out->ok = ok != 0;
    memcpy(out->host, h + HELLO_HOST, RDV_HOST);
    out->host[RDV_HOST - 1] = 0;
    memcpy(out->why, h + HELLO_HOST + RDV_HOST, RDV_WHY);
    out->why[RDV_WHY - 1] = 0;
    return 1;
}

static loom_status serve(loom_ctx *ctx, int port, int size, double timeout_s, double deadline,
                         bool ok, const char *why, const xchg *x, int *local_rank,
                         int *local_size) {
    int err = 0;
    int lfd = listen_on(port, &err);
    if (lfd < 0)
        return loom_errf(ctx, LOOM_ERR_COMM,
                         "rendezvous: rank 0 cannot listen on port %d (MASTER_PORT): %s", port,
                         strerror(err));
    peer *peers = loom_calloc(ctx, (size_t)size, sizeof *peers, "rendezvous peers");
    if (!peers) {
        close(lfd);
        return LOOM_ERR_OOM;
    }
    for (int r = 0; r < size; r++) peers[r].fd = -1;
    peers[0].rank = 0;
    peers[0].ok = ok;
    my_host(peers[0].host);
    snprintf(peers[0].why, RDV_WHY, "%s", why ? why : "");
    loom_status st = LOOM_OK;
    int joined = 1;
    while (joined < size) {
        if (expired(deadline)) {
            char missing[160] = "";
            int len_m = 0, shown = 0;
            for (int r = 1; r < size && len_m < (int)sizeof missing - 16; r++) {
                if (peers[r].fd >= 0) continue;
                if (shown++ == 8) {
                    len_m += snprintf(missing + len_m, sizeof missing - (size_t)len_m, " ...");
                    break;
                }
                len_m += snprintf(missing + len_m, sizeof missing - (size_t)len_m, " %d", r);
            }
            st = loom_errf(ctx, LOOM_ERR_COMM,
                           "rendezvous: rank 0 listening on port %d (MASTER_PORT) heard from %d "
                           "of %d ranks within %g s; missing:%s (did they start, with "
                           "MASTER_ADDR pointing at this host?)",
                           port, joined, size, timeout_s, missing);
            goto done;
        }
        struct pollfd pf = {lfd, POLLIN, 0};
        if (poll(&pf, 1, left_ms(deadline, 200)) <= 0) continue;
        int fd = accept(lfd, NULL, NULL);
        if (fd < 0) continue;
        set_nonblocking(fd);
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        peer p;
        memset(&p, 0, sizeof p);
        int k = read_hello(ctx, fd, size, port, deadline, &p, peers, x);
        if (k <= 0) {
            close(fd);
            if (k < 0) {
                st = LOOM_ERR_COMM;
                goto done;
            }
            continue;
        }
        peers[p.rank] = p;
        joined++;
    }
    /* allgather: every rank's bytes in rank order */
    if (x->gather) {
        unsigned char *all = x->out;
        if (x->each) memcpy(all, x->mine, x->each);
        for (int r = 1; r < size; r++)
            if (x->each) memcpy(all + (size_t)r * x->each, peers[r].mine, x->each);
    }
    /* local ranks: position among the ranks with the same host name */
    int bad = -1;
    for (int r = 0; r < size; r++)
        if (!peers[r].ok) {
            bad = r;
            break;
        }
    for (int r = 0; r < size; r++) {
        int lr = 0, ls = 0;
        for (int q = 0; q < size; q++) {
            if (strcmp(peers[q].host, peers[r].host) != 0) continue;
            if (q < r) lr++;
            ls++;
        }
        if (r == 0) {
            *local_rank = lr;
            *local_size = ls;
            continue;
        }
        unsigned char h[REPLY_BYTES];
        memset(h, 0, sizeof h);
        memcpy(h, RDV_MAGIC, 8);
        put32(h + 8, bad < 0 ? 0 : 1);
        put32(h + 12, lr);
        put32(h + 16, ls);
        put32(h + 20, bad);
        if (bad >= 0) snprintf((char *)h + 24, RDV_WHY, "%s", peers[bad].why);
        put32(h + 24 + RDV_WHY, bad < 0 ? (int32_t)x->out_len : 0);
        int e = send_all(peers[r].fd, h, sizeof h, deadline);
        if (!e && bad < 0 && x->out_len) e = send_all(peers[r].fd, x->out, x->out_len, deadline);
        if (e) {
            st = loom_errf(ctx, LOOM_ERR_COMM,
                           "rendezvous: rank 0 could not answer rank %d on port %d: %s", r,
                           port, strerror(e));
            goto done;
        }
    }
    if (bad >= 0)
        st = loom_errf(ctx, LOOM_ERR_COMM, "rank %d cannot take part: %s", bad,
                       peers[bad].why[0] ? peers[bad].why : "(no reason given)");
done:
    for (int r = 1; r < size; r++) {
        if (peers[r].fd >= 0) close(peers[r].fd);
        free(peers[r].mine);
    }
    free(peers);
    close(lfd);
    return st;
}

/* ---- ranks > 0 ---- */

/* One attempt to connect to any address of ai before the deadline (at most
 * ~1 s). Returns the socket or -1 with *err. */
static int try_connect(struct addrinfo *ai, double deadline, int *err) {
    for (struct addrinfo *a = ai; a; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) {
            *err = errno;
            continue;
        }
        set_nonblocking(fd);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) return fd;
        if (errno != EINPROGRESS) {
            *err = errno;
            close(fd);
            continue;
        }
        struct pollfd pf = {fd, POLLOUT, 0};
        int k = poll(&pf, 1, left_ms(deadline, 1000));
        if (k > 0) {
            int so = 0;
            socklen_t sl = sizeof so;
            getsockopt(fd, SOL_SOCKET, SO_ERROR, &so, &sl);
            if (so == 0) return fd;
            *err = so;
        } else {
            *err = ETIMEDOUT;
        }
        close(fd);
    }
    return -1;
}

static loom_status join(loom_ctx *ctx, const char *addr, int port, int rank, int size,
                        double timeout_s, double deadline, bool ok, const char *why,
                        const xchg *x, int *local_rank, int *local_size) {
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int g = getaddrinfo(addr, ps, &hints, &ai);
    if (g != 0)
        return loom_errf(ctx, LOOM_ERR_COMM,
                         "rendezvous: rank %d cannot resolve MASTER_ADDR '%s': %s", rank, addr,
                         gai_strerror(g));
    int fd = -1, err = ECONNREFUSED;
    for (;;) {
        fd = try_connect(ai, deadline, &err);
        if (fd >= 0 || expired(deadline)) break;
        struct timespec ts = {0, 100 * 1000 * 1000}; /* rank 0 may not listen yet */
        nanosleep(&ts, NULL);
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return loom_errf(ctx, LOOM_ERR_COMM,
                         "rendezvous: rank %d could not connect to rank 0 at %s:%d "
                         "(MASTER_ADDR:MASTER_PORT) within %g s: %s",
                         rank, addr, port, timeout_s, strerror(err));
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    unsigned char h[HELLO_BYTES];
    memset(h, 0, sizeof h);
    memcpy(h, RDV_MAGIC, 8);
    put32(h + 8, RDV_VERSION);
    put32(h + 12, rank);
    put32(h + 16, size);
    put32(h + 20, ok ? 1 : 0);
    put32(h + 24, (int32_t)x->each);
    my_host((char *)h + HELLO_HOST);
    snprintf((char *)h + HELLO_HOST + RDV_HOST, RDV_WHY, "%s", why ? why : "");
    loom_status st = LOOM_OK;
    int e = send_all(fd, h, sizeof h, deadline);
    if (!e && x->each) e = send_all(fd, x->mine, x->each, deadline);
    if (e) {
        st = loom_errf(ctx, LOOM_ERR_COMM,
                       "rendezvous: rank %d could not write to rank 0 at %s:%d: %s", rank, addr,
                       port, strerror(e));
        goto done;
    }
    unsigned char r[REPLY_BYTES];
    e = recv_all(fd, r, sizeof r, deadline);
    if (e || memcmp(r, RDV_MAGIC, 8) != 0) {
        if (e == ETIMEDOUT)
            st = loom_errf(ctx, LOOM_ERR_COMM,
                           "rendezvous: rank %d reached rank 0 at %s:%d but had no answer "
                           "within %g s (rank 0 waits for all %d ranks: did every rank start, "
                           "with the same WORLD_SIZE?)",
                           rank, addr, port, timeout_s, size);
        else
            st = loom_errf(ctx, LOOM_ERR_COMM,
                           "rendezvous: rank %d lost its connection to rank 0 at %s:%d before "
                           "the answer (%s): see rank 0's error",
                           rank, addr, port, e ? strerror(e) : "not a loom rendezvous");
        goto done;
    }
    int status = get32(r + 8), bad = get32(r + 20), n = get32(r + 24 + RDV_WHY);
    *local_rank = get32(r + 12);
    *local_size = get32(r + 16);
    if (status != 0) {
        char w[RDV_WHY];
        memcpy(w, r + 24, RDV_WHY);
        w[RDV_WHY - 1] = 0;
        st = loom_errf(ctx, LOOM_ERR_COMM, "rank %d cannot take part: %s", bad,
                       w[0] ? w : "(no reason given)");
        goto done;
    }
    if (n < 0 || (size_t)n != x->out_len) {
        st = loom_errf(ctx, LOOM_ERR_COMM,
                       "rendezvous: rank 0 sent %d bytes, rank %d expected %zu (mixed loom "
                       "builds?)",
                       n, rank, x->out_len);
        goto done;
    }
    if (x->out_len && (e = recv_all(fd, x->out, x->out_len, deadline)) != 0)
        st = loom_errf(ctx, LOOM_ERR_COMM,
                       "rendezvous: rank %d lost its connection to rank 0 at %s:%d: %s", rank,
                       addr, port, strerror(e));
done:
    close(fd);
    return st;
}

static loom_status rendezvous(loom_ctx *ctx, const char *addr, int port, int rank, int size,
                              double timeout_s, bool ok, const char *why, const xchg *x,
                              int *local_rank, int *local_size) {
    *local_rank = 0;
    *local_size = 1;
    if (size == 1) {
        if (!ok)
            return loom_errf(ctx, LOOM_ERR_COMM, "rank 0 cannot take part: %s",
                             why && *why ? why : "(no reason given)");
        if (x->gather && x->each) memcpy(x->out, x->mine, x->each);
        return LOOM_OK;
    }
    double deadline = timeout_s > 0 ? loom_now_s() + timeout_s : -1;
    if (rank == 0)
        return serve(ctx, port, size, timeout_s, deadline, ok, why, x, local_rank, local_size);
    if (!addr || !*addr)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "rendezvous: rank %d of %d needs MASTER_ADDR (the host of rank 0) and "
                         "MASTER_PORT",
                         rank, size);
    return join(ctx, addr, port, rank, size, timeout_s, deadline, ok, why, x, local_rank,
                local_size);
}

static bool bad_place(int rank, int size, int port) {
    return size < 1 || rank < 0 || rank >= size || port < 1 || port > 65535;
}

loom_status loom_rendezvous(loom_ctx *ctx, const char *addr, int port, int rank, int size,
                            double timeout_s, bool ok, const char *why, void *blob, size_t len,
                            int *local_rank, int *local_size) {
    if (bad_place(rank, size, port) || len > RDV_MAX_BLOB || (len && !blob))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "rendezvous: bad arguments (rank %d of %d, port %d, %zu bytes)", rank,
                         size, port, len);
    xchg x = {.out = blob, .out_len = len};
    return rendezvous(ctx, addr, port, rank, size, timeout_s, ok, why, &x, local_rank,
                      local_size);
}

loom_status loom_rendezvous_allgather(loom_ctx *ctx, const char *addr, int port, int rank,
                                      int size, double timeout_s, bool ok, const char *why,
                                      const void *mine, size_t len, void *all, int *local_rank,
                                      int *local_size) {
    if (bad_place(rank, size, port) || len > RDV_MAX_EACH || (len && (!mine || !all)) ||
        len * (size_t)size > RDV_MAX_ALL)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "rendezvous: bad arguments (rank %d of %d, port %d, %zu bytes from "
                         "each rank: at most %d, and %d in all)",
                         rank, size, port, len, RDV_MAX_EACH, RDV_MAX_ALL);
    xchg x = {.mine = mine, .each = len, .out = all, .out_len = len * (size_t)size,
              .gather = true};
    return rendezvous(ctx, addr, port, rank, size, timeout_s, ok, why, &x, local_rank,
                      local_size);
}

void loom_route_to(const char *addr, int port, char *out, size_t cap) {
    out[0] = 0;
    if (!addr || !*addr) return;
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    if (getaddrinfo(addr, ps, &hints, &ai) != 0 || !ai) return;
    int fd = socket(ai->ai_family, SOCK_DGRAM, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 ||
            getnameinfo((struct sockaddr *)&ss, len, out, (socklen_t)cap, NULL, 0,
                        NI_NUMERICHOST) != 0)
            out[0] = 0;
    }
    if (fd >= 0) close(fd);
    freeaddrinfo(ai);
}
