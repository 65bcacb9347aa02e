/* Collectives and point to point over the MPI backend (and the Gloo
 * backend: tests/gloo runs this file too), for any world size: every
 * result is compared with the value worked out from the ranks' inputs. */

#include <stdlib.h>

#include "mpi_harness.h"

static const loom_dtype red_types[] = {LOOM_F32, LOOM_F64, LOOM_I32, LOOM_I64};
#define N_RED (sizeof red_types / sizeof red_types[0])

static void put(void *buf, loom_dtype dt, size_t i, double v) {
    switch (dt) {
    case LOOM_F32: ((float *)buf)[i] = (float)v; break;
    case LOOM_F64: ((double *)buf)[i] = v; break;
    case LOOM_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case LOOM_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case LOOM_BF16: ((uint16_t *)buf)[i] = loom_f32_to_bf16((float)v); break;
    case LOOM_U8: ((uint8_t *)buf)[i] = (uint8_t)v; break;
    default: break;
    }
}

static double get(const void *buf, loom_dtype dt, size_t i) {
    switch (dt) {
    case LOOM_F32: return ((const float *)buf)[i];
    case LOOM_F64: return ((const double *)buf)[i];
    case LOOM_I32: return ((const int32_t *)buf)[i];
    case LOOM_I64: return (double)((const int64_t *)buf)[i];
    case LOOM_BF16: return loom_bf16_to_f32(((const uint16_t *)buf)[i]);
    case LOOM_U8: return ((const uint8_t *)buf)[i];
    default: return 0;
    }
}

/* Input of rank r at index i: small integers (exact in every type), some
 * negative, the largest on a different rank for each i. */
static double val(int r, size_t i) { return (double)(((r + (int)i) % 5) * 3 - 4) + (double)r; }

static double expect(loom_red_op op, int size, size_t i) {
    double acc = val(0, i);
    for (int r = 1; r < size; r++)
        acc = op == LOOM_RED_SUM ? acc + val(r, i) : (val(r, i) > acc ? val(r, i) : acc);
    return acc;
}

TEST(mpi_world) {
    loom_comm *w = mt_world();
    CHECK_STR(loom_comm_backend_name(w), mt_backend());
    CHECK_STR(loom_comm_name(w), "world");
    const char *env = getenv(strcmp(mt_backend(), "mpi") ? "WORLD_SIZE" : "OMPI_COMM_WORLD_SIZE");
    if (env) CHECK_EQ_INT(loom_comm_size(w), atoi(env));
    CHECK_EQ_INT(mt_ctx()->rank, loom_comm_rank(w));
    CHECK_EQ_INT(mt_ctx()->world_size, loom_comm_size(w));
    CHECK(loom_comm_ctx(w) == mt_ctx());
    CHECK_OK(mt_ctx(), loom_comm_barrier(w));
}

TEST(mpi_allreduce) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    enum { N = 7 };
    for (size_t t = 0; t < N_RED; t++) {
        for (int o = 0; o < 2; o++) {
            loom_red_op op = o ? LOOM_RED_MAX : LOOM_RED_SUM;
            double buf[N]; /* big enough for N of any type */
            for (size_t i = 0; i < N; i++) put(buf, red_types[t], i, val(rank, i));
            CHECK_OK(mt_ctx(), loom_comm_allreduce(w, buf, N, red_types[t], op));
            for (size_t i = 0; i < N; i++)
                CHECK_MSG(get(buf, red_types[t], i) == expect(op, size, i),
                          "%s %s [%zu]: %g, expected %g", loom_dtype_name(red_types[t]),
                          o ? "max" : "sum", i, get(buf, red_types[t], i), expect(op, size, i));
        }
    }
    /* zero elements is fine; BF16 reductions are refused on every rank */
    CHECK_OK(mt_ctx(), loom_comm_allreduce(w, NULL, 0, LOOM_F32, LOOM_RED_SUM));
    uint16_t h[2] = {0, 0};
    CHECK_EQ_INT(loom_comm_allreduce(w, h, 2, LOOM_BF16, LOOM_RED_SUM), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), "allreduce of BF16 is not supported");
}

TEST(mpi_reduce_scatter) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    enum { N = 3 };
    for (size_t t = 0; t < N_RED; t++) {
        for (int o = 0; o < 2; o++) {
            loom_red_op op = o ? LOOM_RED_MAX : LOOM_RED_SUM;
            loom_dtype dt = red_types[t];
            size_t es = loom_dtype_size(dt);
            char *send = malloc(N * (size_t)size * es), *recv = malloc(N * es);
            /* element i of block b on rank r: val(r, b*N + i) */
            for (size_t j = 0; j < N * (size_t)size; j++) put(send, dt, j, val(rank, j));
            CHECK_OK(mt_ctx(), loom_comm_reduce_scatter(w, send, recv, N, dt, op));
            for (size_t i = 0; i < N; i++) {
                double e = expect(op, size, (size_t)rank * N + i);
                CHECK_MSG(get(recv, dt, i) == e, "%s %s [%zu]: %g, expected %g",
                          loom_dtype_name(dt), o ? "max" : "sum", i, get(recv, dt, i), e);
            }
            /* in place: recv is this rank's block of send (NCCL's convention) */
            for (size_t j = 0; j < N * (size_t)size; j++) put(send, dt, j, val(rank, j));
            char *mine = send + (size_t)rank * N * es;
            CHECK_OK(mt_ctx(), loom_comm_reduce_scatter(w, send, mine, N, dt, op));
            for (size_t i = 0; i < N; i++)
                CHECK(get(mine, dt, i) == expect(op, size, (size_t)rank * N + i));
            free(send);
            free(recv);
        }
    }
}

TEST(mpi_allgather) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    enum { N = 5 };
    const loom_dtype types[] = {LOOM_F32, LOOM_F64, LOOM_I32, LOOM_I64, LOOM_BF16, LOOM_U8};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        loom_dtype dt = types[t];
        size_t es = loom_dtype_size(dt);
        char send[N * 8], *recv = malloc(N * (size_t)size * es);
        for (size_t i = 0; i < N; i++) put(send, dt, i, rank * 10 + (int)i);
        CHECK_OK(mt_ctx(), loom_comm_allgather(w, send, recv, N, dt));
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < N; i++)
                CHECK_MSG(get(recv, dt, (size_t)r * N + i) == r * 10 + (int)i,
                          "%s block %d [%zu]: %g", loom_dtype_name(dt), r, i,
                          get(recv, dt, (size_t)r * N + i));
        /* in place: send is this rank's block of recv */
        memset(recv, 0xff, N * (size_t)size * es);
        for (size_t i = 0; i < N; i++) put(recv, dt, (size_t)rank * N + i, rank * 10 + (int)i + 1);
        CHECK_OK(mt_ctx(), loom_comm_allgather(w, recv + (size_t)rank * N * es, recv, N, dt));
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < N; i++)
                CHECK(get(recv, dt, (size_t)r * N + i) == r * 10 + (int)i + 1);
        free(recv);
    }
}

TEST(mpi_broadcast) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    for (int root = 0; root < size; root++) {
        int64_t buf[4];
        for (int i = 0; i < 4; i++) buf[i] = rank == root ? root * 100 + i : -1;
        CHECK_OK(mt_ctx(), loom_comm_broadcast(w, buf, 4, LOOM_I64, root));
        for (int i = 0; i < 4; i++) CHECK_EQ_INT(buf[i], root * 100 + i);
        float f = rank == root ? 0.5f + (float)root : -1.f;
        CHECK_OK(mt_ctx(), loom_comm_broadcast(w, &f, 1, LOOM_F32, root));
        CHECK(f == 0.5f + (float)root);
    }
    int x = 0;
    CHECK_EQ_INT(loom_comm_broadcast(w, &x, 1, LOOM_I32, size), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), "root");
}

TEST(mpi_alltoall) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    enum { N = 3 };
    int32_t *send = malloc(sizeof(int32_t) * N * (size_t)size);
    int32_t *recv = malloc(sizeof(int32_t) * N * (size_t)size);
    /* block b of rank r's send goes to rank b */
    for (int b = 0; b < size; b++)
        for (int i = 0; i < N; i++) send[b * N + i] = rank * 100 + b * 10 + i;
    CHECK_OK(mt_ctx(), loom_comm_alltoall(w, send, recv, N, LOOM_I32));
    for (int q = 0; q < size; q++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(recv[q * N + i], q * 100 + rank * 10 + i);
    /* send == recv */
    CHECK_OK(mt_ctx(), loom_comm_alltoall(w, send, send, N, LOOM_I32));
    for (int q = 0; q < size; q++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(send[q * N + i], q * 100 + rank * 10 + i);
    free(send);
    free(recv);
}

/* Several alltoallv's in one group: uneven blocks (some empty), two dtypes,
 * each buffer's blocks in rank order; more buffers than allowed is refused. */
static size_t a2av_count(int i, int from, int to) {
    return i == 0 ? (size_t)((from + 2 * to) % 3) : (size_t)((from + to) % 2 + 1);
}

TEST(mpi_alltoallv_n) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    REQUIRE(size <= 64);
    size_t sc[2][64], rc[2][64], ns[2] = {0, 0}, nr[2] = {0, 0};
    for (int i = 0; i < 2; i++)
        for (int p = 0; p < size; p++) {
            ns[i] += sc[i][p] = a2av_count(i, rank, p);
            nr[i] += rc[i][p] = a2av_count(i, p, rank);
        }
    int32_t *s0 = malloc(sizeof(int32_t) * (ns[0] + 1)), *r0 = malloc(sizeof(int32_t) * (nr[0] + 1));
    double *s1 = malloc(sizeof(double) * ns[1]), *r1 = malloc(sizeof(double) * nr[1]);
    REQUIRE(s0 && r0 && s1 && r1);
    size_t o0 = 0, o1 = 0;
    for (int p = 0; p < size; p++) {
        for (size_t j = 0; j < sc[0][p]; j++) s0[o0++] = rank * 1000 + p * 100 + (int)j;
        for (size_t j = 0; j < sc[1][p]; j++) s1[o1++] = -(rank * 1000.0 + p * 100.0 + (double)j);
    }
    const loom_a2av v[2] = {{s0, sc[0], r0, rc[0], LOOM_I32}, {s1, sc[1], r1, rc[1], LOOM_F64}};
    CHECK_OK(mt_ctx(), loom_comm_alltoallv_n(w, v, 2));
    o0 = o1 = 0;
    size_t bad = 0;
    for (int q = 0; q < size; q++) {
        for (size_t j = 0; j < rc[0][q]; j++) bad += r0[o0++] != q * 1000 + rank * 100 + (int)j;
        for (size_t j = 0; j < rc[1][q]; j++)
            bad += r1[o1++] != -(q * 1000.0 + rank * 100.0 + (double)j);
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(loom_comm_alltoallv_n(w, v, LOOM_A2AV_MAX + 1), LOOM_ERR_INTERNAL);
    free(s0), free(r0), free(s1), free(r1);
}

TEST(mpi_ring_in_group) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    enum { N = 100000 }; /* past the eager limit: real rendezvous */
    float *out = malloc(sizeof(float) * N * 2), *in = malloc(sizeof(float) * N * 2);
    for (int i = 0; i < N; i++) out[i] = (float)(rank * 1000 + i % 1000);
    for (int i = 0; i < N; i++) out[N + i] = (float)(-rank - 1);
    memset(in, 0, sizeof(float) * N * 2);
    CHECK_OK(mt_ctx(), loom_comm_group_start(w));
    CHECK_OK(mt_ctx(), loom_comm_send(w, out, N, LOOM_F32, right, 1));
    CHECK_OK(mt_ctx(), loom_comm_send(w, out + N, N, LOOM_F32, left, 2));
    CHECK_OK(mt_ctx(), loom_comm_group_start(w)); /* groups nest */
    CHECK_OK(mt_ctx(), loom_comm_recv(w, in, N, LOOM_F32, left, 1));
    CHECK_OK(mt_ctx(), loom_comm_recv(w, in + N, N, LOOM_F32, right, 2));
    CHECK_OK(mt_ctx(), loom_comm_group_end(w));
    CHECK_OK(mt_ctx(), loom_comm_group_end(w));
    int bad = 0;
    for (int i = 0; i < N; i++) bad += in[i] != (float)(left * 1000 + i % 1000);
    for (int i = 0; i < N; i++) bad += in[N + i] != (float)(-right - 1);
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(loom_comm_group_end(w), LOOM_ERR_INVALID_ARG);
    free(out);
    free(in);
}

/* Outside a group both neighbours send first, then receive: sends do not
 * wait for the receiver, and the buffer may be reused at once. */
TEST(mpi_sendrecv_outside_group) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    enum { N = 200000 };
    int32_t *buf = malloc(sizeof(int32_t) * N), *a = malloc(sizeof(int32_t) * N),
            *b = malloc(sizeof(int32_t) * N);
    for (int i = 0; i < N; i++) buf[i] = rank * 7 + i;
    CHECK_OK(mt_ctx(), loom_comm_send(w, buf, N, LOOM_I32, right, 10));
    for (int i = 0; i < N; i++) buf[i] = -(rank * 7 + i); /* reused at once */
    CHECK_OK(mt_ctx(), loom_comm_send(w, buf, N, LOOM_I32, left, 11));
    memset(buf, 0, sizeof(int32_t) * N);
    CHECK_OK(mt_ctx(), loom_comm_recv(w, a, N, LOOM_I32, left, 10));
    CHECK_OK(mt_ctx(), loom_comm_recv(w, b, N, LOOM_I32, right, 11));
    int bad = 0;
    for (int i = 0; i < N; i++) bad += a[i] != left * 7 + i || b[i] != -(right * 7 + i);
    CHECK_EQ_INT(bad, 0);
    /* tags select: receive the later message first */
    int64_t x = rank, y = rank + 100, gx = -1, gy = -1;
    CHECK_OK(mt_ctx(), loom_comm_send(w, &x, 1, LOOM_I64, right, 20));
    CHECK_OK(mt_ctx(), loom_comm_send(w, &y, 1, LOOM_I64, right, 21));
    CHECK_OK(mt_ctx(), loom_comm_recv(w, &gy, 1, LOOM_I64, left, 21));
    CHECK_OK(mt_ctx(), loom_comm_recv(w, &gx, 1, LOOM_I64, left, 20));
    CHECK_EQ_INT(gx, left);
    CHECK_EQ_INT(gy, left + 100);
    /* bad arguments are refused before anything is posted */
    CHECK_EQ_INT(loom_comm_send(w, &x, 1, LOOM_I64, size, 0), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), "peer");
    CHECK_EQ_INT(loom_comm_send(w, &x, 1, LOOM_I64, 0, 32768), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(mt_ctx()), "tag 32768");
    CHECK_EQ_INT(loom_comm_recv(w, &x, 1, LOOM_I64, -1, 0), LOOM_ERR_INVALID_ARG);
    CHECK_OK(mt_ctx(), loom_comm_barrier(w));
    free(buf);
    free(a);
    free(b);
}

TEST(mpi_async) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    enum { N = 4 };
    double ar[N];
    float rs_send[64], rs_recv[N];
    int64_t ag_send[N], *ag_recv = malloc(sizeof(int64_t) * N * (size_t)size);
    for (int i = 0; i < N; i++) ar[i] = val(rank, (size_t)i);
    for (int j = 0; j < N * size; j++) rs_send[j] = (float)val(rank, (size_t)j);
    for (int i = 0; i < N; i++) ag_send[i] = rank * 1000 + i;
    loom_comm_req *r1 = NULL, *r2 = NULL, *r3 = NULL;
    /* three in flight at once, waited in another order */
    CHECK_OK(mt_ctx(), loom_comm_allreduce_async(w, ar, N, LOOM_F64, LOOM_RED_SUM, &r1));
    CHECK_OK(mt_ctx(), loom_comm_reduce_scatter_async(w, rs_send, rs_recv, N, LOOM_F32,
                                                      LOOM_RED_MAX, &r2));
    CHECK_OK(mt_ctx(), loom_comm_allgather_async(w, ag_send, ag_recv, N, LOOM_I64, &r3));
    CHECK(r1 && r2 && r3);
    CHECK_OK(mt_ctx(), loom_comm_wait(w, r3));
    CHECK_OK(mt_ctx(), loom_comm_wait(w, r1));
    CHECK_OK(mt_ctx(), loom_comm_wait(w, r2));
    CHECK_OK(mt_ctx(), loom_comm_wait(w, NULL));
    for (int i = 0; i < N; i++) CHECK(ar[i] == expect(LOOM_RED_SUM, size, (size_t)i));
    for (int i = 0; i < N; i++)
        CHECK(rs_recv[i] == (float)expect(LOOM_RED_MAX, size, (size_t)(rank * N + i)));
    for (int r = 0; r < size; r++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(ag_recv[r * N + i], r * 1000 + i);
    free(ag_recv);
}

TEST(mpi_split) {
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    /* colors by parity, keys reversing the order */
    loom_comm *g = NULL;
    CHECK_OK(mt_ctx(), loom_comm_split(w, rank % 2, -rank, "parity", &g));
    REQUIRE(g);
    int members = 0, pos = 0;
    for (int r = size - 1; r >= 0; r--) {
        if (r % 2 != rank % 2) continue;
        if (r == rank) pos = members;
        members++;
    }
    CHECK_EQ_INT(loom_comm_size(g), members);
    CHECK_EQ_INT(loom_comm_rank(g), pos);
    CHECK_STR(loom_comm_name(g), "parity");
    CHECK_STR(loom_comm_backend_name(g), mt_backend());
    int32_t me = rank, *got = calloc((size_t)size, sizeof *got);
    CHECK_OK(mt_ctx(), loom_comm_allgather(g, &me, got, 1, LOOM_I32));
    for (int r = size - 1, k = 0; r >= 0; r--)
        if (r % 2 == rank % 2) CHECK_EQ_INT(got[k++], r);
    /* a group's messages do not match another group's */
    int64_t s = rank;
    CHECK_OK(mt_ctx(), loom_comm_allreduce(g, &s, 1, LOOM_I64, LOOM_RED_SUM));
    int64_t e = 0;
    for (int r = rank % 2; r < size; r += 2) e += r;
    CHECK_EQ_INT(s, e);
    /* a request belongs to its group */
    loom_comm_req *req = NULL;
    CHECK_OK(mt_ctx(), loom_comm_allreduce_async(g, &s, 1, LOOM_I64, LOOM_RED_MAX, &req));
    CHECK_EQ_INT(loom_comm_wait(w, req), LOOM_ERR_INVALID_ARG);
    CHECK_OK(mt_ctx(), loom_comm_wait(g, req));
    loom_comm_free(g);
    free(got);

    /* color < 0: not a member */
    loom_comm *h = (loom_comm *)1;
    CHECK_OK(mt_ctx(), loom_comm_split(w, rank == 0 ? -1 : 5, 0, "rest", &h));
    if (rank == 0) {
        CHECK(h == NULL);
    } else {
        CHECK(h != NULL);
        if (h) {
            CHECK_EQ_INT(loom_comm_size(h), size - 1);
            CHECK_EQ_INT(loom_comm_rank(h), rank - 1);
            CHECK_OK(mt_ctx(), loom_comm_barrier(h));
        }
    }
    loom_comm_free(h);
    /* a split of a split */
    loom_comm *a = NULL, *b = NULL;
    CHECK_OK(mt_ctx(), loom_comm_split(w, 0, 0, "all", &a));
    if (a) {
        CHECK_OK(mt_ctx(), loom_comm_split(a, rank / 2, rank, "pairs", &b));
        if (b) {
            CHECK_EQ_INT(loom_comm_size(b), rank / 2 * 2 + 2 <= size ? 2 : 1);
            CHECK_EQ_INT(loom_comm_rank(b), rank % 2);
        }
        loom_comm_free(b);
        loom_comm_free(a);
    }
}

/* A receive nobody sends ends with an error naming it, not a hang; the
 * group stays usable (MPI cancels the receive; tests/gloo/test_gloo.c has
 * Gloo's version, where the group is broken). */
TEST(mpi_timeout) {
    if (strcmp(mt_backend(), "mpi")) SKIP("MPI only: a timed-out Gloo receive breaks the group");
    loom_comm *w = mt_world();
    int size = mt_size(), rank = mt_rank();
    loom_comm *t = NULL;
    REQUIRE_OK(mt_ctx(), loom_comm_split(w, 0, rank, "slow", &t));
    if (rank == 0) {
        /* the timeout is this process's: the others wait for rank 0 at the barrier */
        loom_comm_set_timeout(t, 0.2);
        int x = 0;
        CHECK_EQ_INT(loom_comm_recv(t, &x, 1, LOOM_I32, size - 1, 77), LOOM_ERR_COMM);
        char want[96];
        snprintf(want, sizeof want, "recv from rank %d (tag 77) on group 'slow' (rank 0 of %d) "
                 "timed out after 0.2 s", size - 1, size);
        CHECK_CONTAINS(loom_last_error(mt_ctx()), want);
        CHECK_OK(mt_ctx(), loom_comm_group_start(t));
        CHECK_OK(mt_ctx(), loom_comm_recv(t, &x, 1, LOOM_I32, size - 1, 78));
        CHECK_EQ_INT(loom_comm_group_end(t), LOOM_ERR_COMM);
        CHECK_CONTAINS(loom_last_error(mt_ctx()), "group_end on group 'slow'");
        CHECK_CONTAINS(loom_last_error(mt_ctx()), "recv from rank");
        loom_comm_set_timeout(t, 30);
    }
    CHECK_OK(mt_ctx(), loom_comm_barrier(t));
    /* still usable */
    int32_t v = 1;
    CHECK_OK(mt_ctx(), loom_comm_allreduce(t, &v, 1, LOOM_I32, LOOM_RED_SUM));
    CHECK_EQ_INT(v, size);
    loom_comm_free(t);
}
