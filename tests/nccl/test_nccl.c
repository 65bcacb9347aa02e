/* The NCCL backend on device buffers, on host buffers (pageable and
 * pinned, staged through device memory) and on a mix of both, for any
 * number of ranks (one GPU each): every result is compared with the value
 * worked out by hand from the ranks' inputs. Tests run in file order; the
 * timeout test is last. */

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <time.h>

#include "nccl_harness.h"

static const loom_dtype red_types[] = {LOOM_F32, LOOM_F64, LOOM_I32, LOOM_I64};
#define N_RED (sizeof red_types / sizeof red_types[0])

static void put(void *buf, loom_dtype dt, size_t i, double v) {
    switch (dt) {
    case LOOM_F32: ((float *)buf)[i] = (float)v; break;
    case LOOM_F64: ((double *)buf)[i] = v; break;
    case LOOM_I32: ((int32_t *)buf)[i] = (int32_t)v; break;
    case LOOM_I64: ((int64_t *)buf)[i] = (int64_t)v; break;
    case LOOM_BF16: ((uint16_t *)buf)[i] = loom_f32_to_bf16((float)v); break;
    case LOOM_F16: ((uint16_t *)buf)[i] = loom_f32_to_f16((float)v); break;
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
    case LOOM_F16: return loom_f16_to_f32(((const uint16_t *)buf)[i]);
    case LOOM_U8: return ((const uint8_t *)buf)[i];
    default: return 0;
    }
}

/* Input of rank r at index i: small integers (exact in every type), some
 * negative, the largest on a different rank for each i. */
static double val(int r, size_t i) { return (double)(((r + (int)(i % 5)) % 5) * 3 - 4) + r; }

static double expect(loom_red_op op, int size, size_t i) {
    double acc = val(0, i);
    for (int r = 1; r < size; r++)
        acc = op == LOOM_RED_SUM ? acc + val(r, i) : (val(r, i) > acc ? val(r, i) : acc);
    return acc;
}

/* ---- device memory ---- */

static void *dev(size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc(%zu) failed\n", bytes);
        abort();
    }
    return p;
}

static void *host(size_t bytes) {
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) abort();
    return p;
}

static void h2d(void *d, const void *h, size_t bytes) {
    if (cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice) != cudaSuccess) abort();
}

static void d2h(void *h, const void *d, size_t bytes) {
    if (cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) abort();
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- tests ---- */

TEST(nccl_world) {
    loom_comm *w = nt_world();
    CHECK_STR(loom_comm_backend_name(w), "nccl");
    CHECK_STR(loom_comm_name(w), "world");
    const char *env = getenv("OMPI_COMM_WORLD_SIZE");
    if (!env) env = getenv("WORLD_SIZE");
    if (env) CHECK_EQ_INT(loom_comm_size(w), atoi(env));
    CHECK_EQ_INT(nt_ctx()->rank, loom_comm_rank(w));
    CHECK_EQ_INT(nt_ctx()->world_size, loom_comm_size(w));
    int ndev = 0, cur = -1;
    cudaGetDeviceCount(&ndev);
    cudaGetDevice(&cur);
    CHECK_EQ_INT(loom_comm_device(w), cur);
    const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (!lr) lr = getenv("LOCAL_RANK");
    if (lr && ndev > 1) CHECK_EQ_INT(loom_comm_device(w), atoi(lr));
    CHECK(loom_comm_stream(w) != NULL);
    CHECK_STR(getenv("NCCL_NVLS_ENABLE"), "0");
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
}

static void allreduce_case(size_t n) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    for (size_t t = 0; t < N_RED; t++) {
        loom_dtype dt = red_types[t];
        size_t bytes = n * loom_dtype_size(dt);
        char *h = host(bytes), *d = dev(bytes);
        for (int o = 0; o < 2; o++) {
            loom_red_op op = o ? LOOM_RED_MAX : LOOM_RED_SUM;
            for (size_t i = 0; i < n; i++) put(h, dt, i, val(rank, i));
            h2d(d, h, bytes);
            CHECK_OK(nt_ctx(), loom_comm_allreduce(w, d, n, dt, op));
            memset(h, 0, bytes);
            d2h(h, d, bytes);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < n; i++)
                if (get(h, dt, i) != expect(op, size, i) && !bad++) first = i;
            CHECK_MSG(bad == 0, "%s %s n=%zu: %zu wrong, first [%zu] = %g, expected %g",
                      loom_dtype_name(dt), o ? "max" : "sum", n, bad, first,
                      get(h, dt, first), expect(op, size, first));
        }
        free(h);
        cudaFree(d);
    }
}

TEST(nccl_allreduce) {
    loom_comm *w = nt_world();
    int size = nt_size();
    allreduce_case(7);
    allreduce_case(262147); /* 1-2 MiB: past the small-message protocols */
    /* zero elements is fine; BF16 and F16 reduce (GPU activations), U8 does not */
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, NULL, 0, LOOM_F32, LOOM_RED_SUM));
    for (int k = 0; k < 2; k++) {
        loom_dtype dt = k ? LOOM_F16 : LOOM_BF16;
        uint16_t hv[3], *db = dev(sizeof hv);
        for (int i = 0; i < 3; i++) put(hv, dt, i, 0.5 * (i + 1) * (nt_rank() + 1));
        cudaMemcpy(db, hv, sizeof hv, cudaMemcpyHostToDevice);
        CHECK_OK(nt_ctx(), loom_comm_allreduce(w, db, 3, dt, LOOM_RED_SUM));
        cudaMemcpy(hv, db, sizeof hv, cudaMemcpyDeviceToHost);
        for (int i = 0; i < 3; i++) /* 0.5 (i+1) size (size+1) / 2: exact in 16 bits */
            CHECK_NEAR(get(hv, dt, i), 0.25 * (i + 1) * size * (size + 1), 1e-6);
        cudaFree(db);
    }
    uint8_t *hb = dev(4);
    CHECK_EQ_INT(loom_comm_allreduce(w, hb, 2, LOOM_U8, LOOM_RED_SUM), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "allreduce of U8 is not supported");
    cudaFree(hb);
    /* host memory is staged (nccl_host_* test it fully) */
    float x[2] = {1, 2};
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, x, 2, LOOM_F32, LOOM_RED_SUM));
    CHECK(x[0] == (float)size && x[1] == 2.f * (float)size);
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
}

TEST(nccl_reduce_scatter) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    const size_t ns[] = {3, 65537};
    for (size_t k = 0; k < 2; k++) {
        size_t N = ns[k];
        for (size_t t = 0; t < N_RED; t++) {
            for (int o = 0; o < 2; o++) {
                loom_red_op op = o ? LOOM_RED_MAX : LOOM_RED_SUM;
                loom_dtype dt = red_types[t];
                size_t es = loom_dtype_size(dt), total = N * (size_t)size;
                char *h = host(total * es), *out = host(N * es);
                char *send = dev(total * es), *recv = dev(N * es);
                /* element i of block b on rank r: val(r, b*N + i) */
                for (size_t j = 0; j < total; j++) put(h, dt, j, val(rank, j));
                h2d(send, h, total * es);
                CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(w, send, recv, N, dt, op));
                d2h(out, recv, N * es);
                size_t bad = 0;
                for (size_t i = 0; i < N; i++)
                    bad += get(out, dt, i) != expect(op, size, (size_t)rank * N + i);
                CHECK_MSG(bad == 0, "%s %s N=%zu out of place: %zu wrong", loom_dtype_name(dt),
                          o ? "max" : "sum", N, bad);
                /* in place: recv is this rank's block of send (NCCL's convention) */
                h2d(send, h, total * es);
                char *mine = send + (size_t)rank * N * es;
                CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(w, send, mine, N, dt, op));
                d2h(out, mine, N * es);
                bad = 0;
                for (size_t i = 0; i < N; i++)
                    bad += get(out, dt, i) != expect(op, size, (size_t)rank * N + i);
                CHECK_MSG(bad == 0, "%s %s N=%zu in place: %zu wrong", loom_dtype_name(dt),
                          o ? "max" : "sum", N, bad);
                /* recv == send (overlapping, not NCCL's in place): through a copy */
                h2d(send, h, total * es);
                CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(w, send, send, N, dt, op));
                d2h(out, send, N * es);
                bad = 0;
                for (size_t i = 0; i < N; i++)
                    bad += get(out, dt, i) != expect(op, size, (size_t)rank * N + i);
                CHECK_MSG(bad == 0, "%s %s N=%zu recv == send: %zu wrong", loom_dtype_name(dt),
                          o ? "max" : "sum", N, bad);
                free(h);
                free(out);
                cudaFree(send);
                cudaFree(recv);
            }
        }
    }
}

TEST(nccl_allgather) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    enum { N = 5 };
    const loom_dtype types[] = {LOOM_F32, LOOM_F64, LOOM_I32, LOOM_I64, LOOM_BF16, LOOM_U8};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        loom_dtype dt = types[t];
        size_t es = loom_dtype_size(dt), all = N * (size_t)size * es;
        char hs[N * 8], *h = host(all);
        char *send = dev(N * es), *recv = dev(all);
        for (size_t i = 0; i < N; i++) put(hs, dt, i, rank * 10 + (int)i);
        h2d(send, hs, N * es);
        CHECK_OK(nt_ctx(), loom_comm_allgather(w, send, recv, N, dt));
        d2h(h, recv, all);
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < N; i++)
                CHECK_MSG(get(h, dt, (size_t)r * N + i) == r * 10 + (int)i,
                          "%s block %d [%zu]: %g", loom_dtype_name(dt), r, i,
                          get(h, dt, (size_t)r * N + i));
        /* in place: send is this rank's block of recv */
        memset(h, 0xff, all);
        for (size_t i = 0; i < N; i++) put(h, dt, (size_t)rank * N + i, rank * 10 + (int)i + 1);
        h2d(recv, h, all);
        CHECK_OK(nt_ctx(), loom_comm_allgather(w, recv + (size_t)rank * N * es, recv, N, dt));
        d2h(h, recv, all);
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < N; i++)
                CHECK(get(h, dt, (size_t)r * N + i) == r * 10 + (int)i + 1);
        free(h);
        cudaFree(send);
        cudaFree(recv);
    }
    /* BF16 moved bit for bit (NaN payloads and -0 too), a larger block */
    enum { M = 100003 };
    uint16_t *hb = host(sizeof(uint16_t) * M * (size_t)size);
    uint16_t *db = dev(sizeof(uint16_t) * M * (size_t)size);
    for (size_t i = 0; i < M; i++) hb[i] = (uint16_t)(i * 2654435761u + (unsigned)rank * 97u);
    h2d(db + (size_t)rank * M, hb, sizeof(uint16_t) * M);
    CHECK_OK(nt_ctx(), loom_comm_allgather(w, db + (size_t)rank * M, db, M, LOOM_BF16));
    d2h(hb, db, sizeof(uint16_t) * M * (size_t)size);
    size_t bad = 0;
    for (int r = 0; r < size; r++)
        for (size_t i = 0; i < M; i++)
            bad += hb[(size_t)r * M + i] != (uint16_t)(i * 2654435761u + (unsigned)r * 97u);
    CHECK_EQ_INT(bad, 0);
    free(hb);
    cudaFree(db);
}

TEST(nccl_broadcast) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    int64_t *d64 = dev(4 * sizeof(int64_t));
    float *df = dev(sizeof(float));
    uint16_t *dh = dev(7 * sizeof(uint16_t));
    for (int root = 0; root < size; root++) {
        int64_t buf[4];
        for (int i = 0; i < 4; i++) buf[i] = rank == root ? root * 100 + i : -1;
        h2d(d64, buf, sizeof buf);
        CHECK_OK(nt_ctx(), loom_comm_broadcast(w, d64, 4, LOOM_I64, root));
        d2h(buf, d64, sizeof buf);
        for (int i = 0; i < 4; i++) CHECK_EQ_INT(buf[i], root * 100 + i);
        float f = rank == root ? 0.5f + (float)root : -1.f;
        h2d(df, &f, sizeof f);
        CHECK_OK(nt_ctx(), loom_comm_broadcast(w, df, 1, LOOM_F32, root));
        d2h(&f, df, sizeof f);
        CHECK(f == 0.5f + (float)root);
        /* BF16: data movement only */
        uint16_t hb[7];
        for (int i = 0; i < 7; i++)
            hb[i] = rank == root ? loom_f32_to_bf16(0.25f * (float)(i - 3) + (float)root) : 0xffff;
        h2d(dh, hb, sizeof hb);
        CHECK_OK(nt_ctx(), loom_comm_broadcast(w, dh, 7, LOOM_BF16, root));
        d2h(hb, dh, sizeof hb);
        for (int i = 0; i < 7; i++)
            CHECK(hb[i] == loom_f32_to_bf16(0.25f * (float)(i - 3) + (float)root));
    }
    CHECK_EQ_INT(loom_comm_broadcast(w, df, 1, LOOM_F32, size), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "root");
    cudaFree(d64);
    cudaFree(df);
    cudaFree(dh);
}

TEST(nccl_alltoall) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    enum { N = 3 };
    size_t bytes = sizeof(int32_t) * N * (size_t)size;
    int32_t *h = host(bytes), *send = dev(bytes), *recv = dev(bytes);
    /* block b of rank r's send goes to rank b */
    for (int b = 0; b < size; b++)
        for (int i = 0; i < N; i++) h[b * N + i] = rank * 100 + b * 10 + i;
    h2d(send, h, bytes);
    CHECK_OK(nt_ctx(), loom_comm_alltoall(w, send, recv, N, LOOM_I32));
    d2h(h, recv, bytes);
    for (int q = 0; q < size; q++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(h[q * N + i], q * 100 + rank * 10 + i);
    /* send == recv */
    for (int b = 0; b < size; b++)
        for (int i = 0; i < N; i++) h[b * N + i] = rank * 100 + b * 10 + i;
    h2d(send, h, bytes);
    CHECK_OK(nt_ctx(), loom_comm_alltoall(w, send, send, N, LOOM_I32));
    d2h(h, send, bytes);
    for (int q = 0; q < size; q++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(h[q * N + i], q * 100 + rank * 10 + i);
    free(h);
    cudaFree(send);
    cudaFree(recv);
    /* larger F32 blocks */
    enum { M = 50001 };
    size_t fb = sizeof(float) * M * (size_t)size;
    float *hf = host(fb), *sf = dev(fb), *rf = dev(fb);
    for (int b = 0; b < size; b++)
        for (int i = 0; i < M; i++) hf[(size_t)b * M + i] = (float)(rank * 1000000 + b * 1000 + i % 1000);
    h2d(sf, hf, fb);
    CHECK_OK(nt_ctx(), loom_comm_alltoall(w, sf, rf, M, LOOM_F32));
    d2h(hf, rf, fb);
    size_t bad = 0;
    for (int q = 0; q < size; q++)
        for (int i = 0; i < M; i++)
            bad += hf[(size_t)q * M + i] != (float)(q * 1000000 + rank * 1000 + i % 1000);
    CHECK_EQ_INT(bad, 0);
    free(hf);
    cudaFree(sf);
    cudaFree(rf);
}

TEST(nccl_ring_in_group) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    if (size < 2) SKIP("needs 2 ranks");
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    enum { N = 100000 };
    size_t bytes = sizeof(float) * N * 2;
    float *h = host(bytes), *out = dev(bytes), *in = dev(bytes);
    for (int i = 0; i < N; i++) h[i] = (float)(rank * 1000 + i % 1000);
    for (int i = 0; i < N; i++) h[N + i] = (float)(-rank - 1);
    h2d(out, h, bytes);
    cudaMemset(in, 0, bytes);
    CHECK_OK(nt_ctx(), loom_comm_group_start(w));
    /* a collective before the group's first send/recv runs at once */
    int32_t *one = dev(sizeof(int32_t));
    int32_t v = 1;
    h2d(one, &v, sizeof v);
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, one, 1, LOOM_I32, LOOM_RED_SUM));
    d2h(&v, one, sizeof v);
    CHECK_EQ_INT(v, size);
    CHECK_OK(nt_ctx(), loom_comm_send(w, out, N, LOOM_F32, right, 1));
    CHECK_OK(nt_ctx(), loom_comm_send(w, out + N, N, LOOM_F32, left, 2));
    CHECK_OK(nt_ctx(), loom_comm_group_start(w)); /* groups nest */
    CHECK_OK(nt_ctx(), loom_comm_recv(w, in, N, LOOM_F32, left, 1));
    CHECK_OK(nt_ctx(), loom_comm_recv(w, in + N, N, LOOM_F32, right, 2));
    /* after a send/recv of the group, collectives are refused */
    CHECK_EQ_INT(loom_comm_allreduce(w, one, 1, LOOM_I32, LOOM_RED_SUM), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "inside group_start/group_end after a send or recv");
    CHECK_OK(nt_ctx(), loom_comm_group_end(w));
    CHECK_OK(nt_ctx(), loom_comm_group_end(w));
    d2h(h, in, bytes);
    int bad = 0;
    for (int i = 0; i < N; i++) bad += h[i] != (float)(left * 1000 + i % 1000);
    for (int i = 0; i < N; i++) bad += h[N + i] != (float)(-right - 1);
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(loom_comm_group_end(w), LOOM_ERR_INVALID_ARG);
    /* an exchange of neighbours, repeated (the connections are reused) */
    for (int it = 0; it < 3; it++) {
        cudaMemset(in, 0, bytes);
        CHECK_OK(nt_ctx(), loom_comm_group_start(w));
        CHECK_OK(nt_ctx(), loom_comm_send(w, out, N, LOOM_F32, right, 0));
        CHECK_OK(nt_ctx(), loom_comm_recv(w, in, N, LOOM_F32, left, 0));
        CHECK_OK(nt_ctx(), loom_comm_group_end(w));
        d2h(h, in, sizeof(float) * N);
        bad = 0;
        for (int i = 0; i < N; i++) bad += h[i] != (float)(left * 1000 + i % 1000);
        CHECK_EQ_INT(bad, 0);
    }
    cudaFree(one);
    free(h);
    cudaFree(out);
    cudaFree(in);
}

/* Outside a group: a chain 0 -> 1 -> ... -> size-1 and back. A send is
 * queued and returns; its buffer may be rewritten by stream-ordered work
 * (cudaMemcpy) at once. Messages to a peer arrive in the order sent, tags
 * being ignored. */
TEST(nccl_sendrecv_outside_group) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    if (size < 2) SKIP("needs 2 ranks");
    enum { N = 200000 };
    size_t bytes = sizeof(int32_t) * N;
    int32_t *h = host(bytes), *buf = dev(bytes), *a = dev(bytes);
    /* forward */
    if (rank > 0) {
        CHECK_OK(nt_ctx(), loom_comm_recv(w, a, N, LOOM_I32, rank - 1, 10));
        d2h(h, a, bytes);
        int bad = 0;
        for (int i = 0; i < N; i++) bad += h[i] != (rank - 1) * 7 + i;
        CHECK_EQ_INT(bad, 0);
    }
    if (rank < size - 1) {
        for (int i = 0; i < N; i++) h[i] = rank * 7 + i;
        h2d(buf, h, bytes);
        CHECK_OK(nt_ctx(), loom_comm_send(w, buf, N, LOOM_I32, rank + 1, 10));
        for (int i = 0; i < N; i++) h[i] = -1;
        h2d(buf, h, bytes); /* reused at once: ordered after the send */
    }
    /* back, two messages in order (tags differ and are ignored) */
    int64_t *x = dev(2 * sizeof(int64_t));
    if (rank < size - 1) {
        int64_t gx = -1, gy = -1;
        CHECK_OK(nt_ctx(), loom_comm_recv(w, x, 1, LOOM_I64, rank + 1, 20));
        CHECK_OK(nt_ctx(), loom_comm_recv(w, x + 1, 1, LOOM_I64, rank + 1, 21));
        d2h(&gx, x, sizeof gx);
        d2h(&gy, x + 1, sizeof gy);
        CHECK_EQ_INT(gx, rank + 1);
        CHECK_EQ_INT(gy, rank + 101);
    }
    if (rank > 0) {
        int64_t hx[2] = {rank, rank + 100};
        h2d(x, hx, sizeof hx);
        CHECK_OK(nt_ctx(), loom_comm_send(w, x, 1, LOOM_I64, rank - 1, 21));
        CHECK_OK(nt_ctx(), loom_comm_send(w, x + 1, 1, LOOM_I64, rank - 1, 20));
    }
    /* bad arguments are refused before anything is posted */
    CHECK_EQ_INT(loom_comm_send(w, x, 1, LOOM_I64, size, 0), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "peer");
    CHECK_EQ_INT(loom_comm_send(w, x, 1, LOOM_I64, 0, 32768), LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "tag 32768");
    CHECK_EQ_INT(loom_comm_recv(w, x, 1, LOOM_I64, -1, 0), LOOM_ERR_INVALID_ARG);
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    free(h);
    cudaFree(buf);
    cudaFree(a);
    cudaFree(x);
}

TEST(nccl_async) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    enum { N = 4 };
    double har[N];
    float hrs[64 * N], hrr[N];
    int64_t hag[N], *hagr = host(sizeof(int64_t) * N * (size_t)size);
    for (int i = 0; i < N; i++) har[i] = val(rank, (size_t)i);
    for (int j = 0; j < N * size; j++) hrs[j] = (float)val(rank, (size_t)j);
    for (int i = 0; i < N; i++) hag[i] = rank * 1000 + i;
    double *ar = dev(sizeof har);
    float *rs = dev(sizeof(float) * N * (size_t)size), *rr = dev(sizeof hrr);
    int64_t *ag = dev(sizeof hag), *agr = dev(sizeof(int64_t) * N * (size_t)size);
    h2d(ar, har, sizeof har);
    h2d(rs, hrs, sizeof(float) * N * (size_t)size);
    h2d(ag, hag, sizeof hag);
    loom_comm_req *r1 = NULL, *r2 = NULL, *r3 = NULL;
    /* three in flight at once, waited in another order */
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(w, ar, N, LOOM_F64, LOOM_RED_SUM, &r1));
    CHECK_OK(nt_ctx(), loom_comm_reduce_scatter_async(w, rs, rr, N, LOOM_F32, LOOM_RED_MAX, &r2));
    CHECK_OK(nt_ctx(), loom_comm_allgather_async(w, ag, agr, N, LOOM_I64, &r3));
    CHECK(r1 && r2 && r3);
    CHECK_OK(nt_ctx(), loom_comm_wait(w, r3));
    CHECK_OK(nt_ctx(), loom_comm_wait(w, r1));
    CHECK_OK(nt_ctx(), loom_comm_wait(w, r2));
    CHECK_OK(nt_ctx(), loom_comm_wait(w, NULL));
    d2h(har, ar, sizeof har);
    d2h(hrr, rr, sizeof hrr);
    d2h(hagr, agr, sizeof(int64_t) * N * (size_t)size);
    for (int i = 0; i < N; i++) CHECK(har[i] == expect(LOOM_RED_SUM, size, (size_t)i));
    for (int i = 0; i < N; i++)
        CHECK(hrr[i] == (float)expect(LOOM_RED_MAX, size, (size_t)(rank * N + i)));
    for (int r = 0; r < size; r++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(hagr[r * N + i], r * 1000 + i);
    /* zero elements: no request */
    loom_comm_req *r0 = (loom_comm_req *)1;
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(w, NULL, 0, LOOM_F32, LOOM_RED_SUM, &r0));
    CHECK(r0 == NULL);
    /* a request waited on at once */
    loom_comm_req *r4 = NULL;
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(w, ar, N, LOOM_F64, LOOM_RED_MAX, &r4));
    CHECK_OK(nt_ctx(), loom_comm_wait(w, r4));
    free(hagr);
    cudaFree(ar);
    cudaFree(rs);
    cudaFree(rr);
    cudaFree(ag);
    cudaFree(agr);
}

TEST(nccl_split) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    /* colors by parity, keys reversing the order */
    loom_comm *g = NULL;
    CHECK_OK(nt_ctx(), loom_comm_split(w, rank % 2, -rank, "parity", &g));
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
    CHECK_STR(loom_comm_backend_name(g), "nccl");
    CHECK_EQ_INT(loom_comm_device(g), loom_comm_device(w));
    CHECK(loom_comm_stream(g) != loom_comm_stream(w));
    int32_t me = rank, *got = host(sizeof(int32_t) * (size_t)size);
    int32_t *dme = dev(sizeof me), *dgot = dev(sizeof(int32_t) * (size_t)size);
    h2d(dme, &me, sizeof me);
    CHECK_OK(nt_ctx(), loom_comm_allgather(g, dme, dgot, 1, LOOM_I32));
    d2h(got, dgot, sizeof(int32_t) * (size_t)members);
    for (int r = size - 1, k = 0; r >= 0; r--)
        if (r % 2 == rank % 2) CHECK_EQ_INT(got[k++], r);
    /* a group's reduction covers its members only */
    int64_t s = rank, *ds = dev(sizeof s);
    h2d(ds, &s, sizeof s);
    CHECK_OK(nt_ctx(), loom_comm_allreduce(g, ds, 1, LOOM_I64, LOOM_RED_SUM));
    d2h(&s, ds, sizeof s);
    int64_t e = 0;
    for (int r = rank % 2; r < size; r += 2) e += r;
    CHECK_EQ_INT(s, e);
    /* a request belongs to its group */
    loom_comm_req *req = NULL;
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(g, ds, 1, LOOM_I64, LOOM_RED_MAX, &req));
    CHECK_EQ_INT(loom_comm_wait(w, req), LOOM_ERR_INVALID_ARG);
    CHECK_OK(nt_ctx(), loom_comm_wait(g, req));
    loom_comm_free(g);

    /* pairs: ranks 2k and 2k+1 */
    loom_comm *p = NULL;
    CHECK_OK(nt_ctx(), loom_comm_split(w, rank / 2, rank, "pairs", &p));
    if (p) {
        int psize = rank / 2 * 2 + 2 <= size ? 2 : 1;
        CHECK_EQ_INT(loom_comm_size(p), psize);
        CHECK_EQ_INT(loom_comm_rank(p), rank % 2);
        /* BF16 broadcast from the pair's rank 1 (or 0 when alone) */
        uint16_t hb[3], *db = dev(sizeof hb);
        int root = psize - 1;
        for (int i = 0; i < 3; i++)
            hb[i] = loom_comm_rank(p) == root ? loom_f32_to_bf16((float)(rank / 2) + 0.5f * i)
                                               : 0;
        h2d(db, hb, sizeof hb);
        CHECK_OK(nt_ctx(), loom_comm_broadcast(p, db, 3, LOOM_BF16, root));
        d2h(hb, db, sizeof hb);
        for (int i = 0; i < 3; i++)
            CHECK(hb[i] == loom_f32_to_bf16((float)(rank / 2) + 0.5f * i));
        if (psize == 2) {
            /* a send/recv exchange inside a group of the pair */
            float hv = (float)rank, hr = -1;
            float *dv = dev(sizeof hv), *dr = dev(sizeof hr);
            h2d(dv, &hv, sizeof hv);
            int other = 1 - loom_comm_rank(p);
            CHECK_OK(nt_ctx(), loom_comm_group_start(p));
            CHECK_OK(nt_ctx(), loom_comm_send(p, dv, 1, LOOM_F32, other, 0));
            CHECK_OK(nt_ctx(), loom_comm_recv(p, dr, 1, LOOM_F32, other, 0));
            CHECK_OK(nt_ctx(), loom_comm_group_end(p));
            d2h(&hr, dr, sizeof hr);
            CHECK(hr == (float)(rank ^ 1));
            cudaFree(dv);
            cudaFree(dr);
        }
        cudaFree(db);
    }
    loom_comm_free(p);

    /* color < 0: not a member */
    loom_comm *h = (loom_comm *)1;
    CHECK_OK(nt_ctx(), loom_comm_split(w, rank == 0 ? -1 : 5, 0, "rest", &h));
    if (rank == 0) {
        CHECK(h == NULL);
    } else {
        CHECK(h != NULL);
        if (h) {
            CHECK_EQ_INT(loom_comm_size(h), size - 1);
            CHECK_EQ_INT(loom_comm_rank(h), rank - 1);
            CHECK_OK(nt_ctx(), loom_comm_barrier(h));
        }
    }
    loom_comm_free(h);
    /* a split of a split */
    loom_comm *a = NULL, *b = NULL;
    CHECK_OK(nt_ctx(), loom_comm_split(w, 0, 0, "all", &a));
    if (a) {
        CHECK_OK(nt_ctx(), loom_comm_split(a, rank / 2, rank, "pairs2", &b));
        if (b) {
            CHECK_EQ_INT(loom_comm_size(b), rank / 2 * 2 + 2 <= size ? 2 : 1);
            CHECK_EQ_INT(loom_comm_rank(b), rank % 2);
            CHECK_OK(nt_ctx(), loom_comm_barrier(b));
        }
        loom_comm_free(b);
        loom_comm_free(a);
    }
    free(got);
    cudaFree(dme);
    cudaFree(dgot);
    cudaFree(ds);
}

/* loom_comm_split_self, on any world size: a one-rank group without an
 * NCCL communicator. Twelve of them (a mesh's groups on one GPU) cost next
 * to no device memory, where one NCCL communicator costs hundreds of MiB;
 * its collectives are copies (or nothing) on its own stream, ordered after
 * the legacy stream's work; async, deferred and host-buffer calls work;
 * send/recv to itself is refused; a split of it is itself alone or
 * nothing. */
TEST(nccl_split_self) {
    loom_comm *w = nt_world();
    int rank = nt_rank();
    enum { G = 12, N = 5000 };
    size_t free0 = 0, free1 = 0, total = 0;
    cudaDeviceSynchronize();
    cudaMemGetInfo(&free0, &total);
    loom_comm *g[G] = {0};
    for (int i = 0; i < G; i++) {
        char name[16];
        snprintf(name, sizeof name, "self%d", i);
        CHECK_OK(nt_ctx(), loom_comm_split_self(w, name, &g[i]));
        REQUIRE(g[i]);
    }
    cudaDeviceSynchronize();
    cudaMemGetInfo(&free1, &total);
    const double grew = ((double)free0 - (double)free1) / (1 << 20);
    if (rank == 0) {
        printf("    %d one-rank groups: %.1f MiB of device memory\n", G, grew);
        fflush(stdout);
    }
    CHECK(grew < 64.0);
    loom_comm *s = g[3];
    CHECK_EQ_INT(loom_comm_size(s), 1);
    CHECK_EQ_INT(loom_comm_rank(s), 0);
    CHECK_STR(loom_comm_name(s), "self3");
    CHECK_STR(loom_comm_backend_name(s), "nccl");
    CHECK_EQ_INT(loom_comm_device(s), loom_comm_device(w));
    CHECK(loom_comm_stream(s) != NULL && loom_comm_stream(s) != loom_comm_stream(w));
    int32_t *h = host(sizeof(int32_t) * 2 * N), *got = host(sizeof(int32_t) * 2 * N);
    int32_t *a = dev(sizeof(int32_t) * 2 * N), *b = dev(sizeof(int32_t) * 2 * N);
    for (int i = 0; i < 2 * N; i++) h[i] = rank * 1000003 + 7 * i;
    h2d(a, h, sizeof(int32_t) * 2 * N);
    size_t bad = 0;
#define SAME_AS(buf, src, n)                                                                  \
    do {                                                                                      \
        d2h(got, buf, sizeof(int32_t) * (n));                                                 \
        for (int i_ = 0; i_ < (n); i_++) bad += got[i_] != (src)[i_];                         \
    } while (0)
    /* each copy follows a memset queued on the legacy stream just before */
    cudaMemsetAsync(b, 0xff, sizeof(int32_t) * N, 0);
    CHECK_OK(nt_ctx(), loom_comm_allgather(s, a, b, N, LOOM_I32));
    SAME_AS(b, h, N);
    cudaMemsetAsync(b, 0, sizeof(int32_t) * N, 0);
    CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(s, a, b, N, LOOM_I32, LOOM_RED_SUM));
    SAME_AS(b, h, N);
    cudaMemsetAsync(b, 0x7f, sizeof(int32_t) * N, 0);
    CHECK_OK(nt_ctx(), loom_comm_alltoall(s, a, b, N, LOOM_I32));
    SAME_AS(b, h, N);
    /* in place, reductions and broadcast leave the data as it is */
    CHECK_OK(nt_ctx(), loom_comm_allreduce(s, a, N, LOOM_I32, LOOM_RED_SUM));
    CHECK_OK(nt_ctx(), loom_comm_allgather(s, a, a, N, LOOM_I32));
    CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(s, a, a, N, LOOM_I32, LOOM_RED_MAX));
    CHECK_OK(nt_ctx(), loom_comm_broadcast(s, a, N, LOOM_I32, 0));
    SAME_AS(a, h, 2 * N);
    /* overlapping send and recv: the data moves as if copied first */
    h2d(b, h, sizeof(int32_t) * 2 * N);
    CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(s, b, b + 1, N, LOOM_I32, LOOM_RED_SUM));
    d2h(got, b, sizeof(int32_t) * (N + 1));
    bad += got[0] != h[0];
    for (int i = 0; i < N; i++) bad += got[i + 1] != h[i];
    /* async and deferred */
    loom_comm_req *req = NULL;
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(s, a, N, LOOM_I32, LOOM_RED_MAX, &req));
    CHECK_EQ_INT(loom_comm_wait(w, req), LOOM_ERR_INVALID_ARG);
    CHECK_OK(nt_ctx(), loom_comm_wait(s, req));
    cudaMemsetAsync(b, 0, sizeof(int32_t) * N, 0);
    loom_comm_defer(s);
    CHECK_OK(nt_ctx(), loom_comm_allgather(s, a + N, b, N, LOOM_I32));
    SAME_AS(b, h + N, N); /* the legacy stream's copy waits for it */
    CHECK_OK(nt_ctx(), loom_comm_settle(s));
    /* host buffers */
    for (int i = 0; i < N; i++) got[i] = -1;
    CHECK_OK(nt_ctx(), loom_comm_allgather(s, h, got, N, LOOM_I32));
    for (int i = 0; i < N; i++) bad += got[i] != h[i];
    CHECK_OK(nt_ctx(), loom_comm_barrier(s));
    CHECK_EQ_INT(bad, 0);
#undef SAME_AS
    /* no send/recv to itself */
    CHECK_EQ_INT(loom_comm_send(s, a, 1, LOOM_I32, 0, 0), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "send to self on group 'self3'");
    CHECK_EQ_INT(loom_comm_recv(s, a, 1, LOOM_I32, 0, 0), LOOM_ERR_UNSUPPORTED);
    /* its splits */
    loom_comm *t = NULL, *u = (loom_comm *)1;
    CHECK_OK(nt_ctx(), loom_comm_split(s, 7, 0, "again", &t));
    REQUIRE(t);
    CHECK_EQ_INT(loom_comm_size(t), 1);
    CHECK_OK(nt_ctx(), loom_comm_allgather(t, a, b, N, LOOM_I32));
    loom_comm_free(t);
    CHECK_OK(nt_ctx(), loom_comm_split(s, -1, 0, "none", &u));
    CHECK(u == NULL);
    for (int i = 0; i < G; i++) loom_comm_free(g[i]);
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    free(h);
    free(got);
    cudaFree(a);
    cudaFree(b);
}

/* ---- host buffers (staged through device memory) and mixed kinds ---- */

/* Where a test buffer lives. */
typedef enum mem_kind { MEM_HOST, MEM_PINNED, MEM_DEV } mem_kind;
static const char *const mem_names[] = {"host", "pinned", "device"};

/* (send, recv) kinds of the two-buffer collectives: host, pinned, mixed
 * both ways, and device as the control. */
static const mem_kind mem_pairs[][2] = {
    {MEM_HOST, MEM_HOST},  {MEM_PINNED, MEM_PINNED}, {MEM_HOST, MEM_DEV},
    {MEM_DEV, MEM_HOST},   {MEM_PINNED, MEM_DEV},    {MEM_DEV, MEM_PINNED},
    {MEM_HOST, MEM_PINNED}, {MEM_DEV, MEM_DEV},
};
#define N_PAIRS (sizeof mem_pairs / sizeof mem_pairs[0])

static void *mem_alloc(mem_kind k, size_t bytes) {
    if (k == MEM_DEV) return dev(bytes);
    if (k == MEM_HOST) return host(bytes);
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMallocHost(%zu) failed\n", bytes);
        abort();
    }
    memset(p, 0, bytes ? bytes : 1);
    return p;
}

static void mem_free(mem_kind k, void *p) {
    if (k == MEM_DEV)
        cudaFree(p);
    else if (k == MEM_PINNED)
        cudaFreeHost(p);
    else
        free(p);
}

/* host array h -> buffer p of kind k, and back */
static void mem_put(mem_kind k, void *p, const void *h, size_t bytes) {
    if (k == MEM_DEV)
        h2d(p, h, bytes);
    else
        memcpy(p, h, bytes);
}

static void mem_get(mem_kind k, void *h, const void *p, size_t bytes) {
    if (k == MEM_DEV)
        d2h(h, p, bytes);
    else
        memcpy(h, p, bytes);
}

TEST(nccl_host_allreduce) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    const size_t ns[] = {7, 65539};
    for (int k = MEM_HOST; k <= MEM_DEV; k++)
        for (size_t in = 0; in < 2; in++)
            for (size_t t = 0; t < N_RED; t++)
                for (int o = 0; o < 2; o++) {
                    size_t n = ns[in];
                    loom_dtype dt = red_types[t];
                    loom_red_op op = o ? LOOM_RED_MAX : LOOM_RED_SUM;
                    size_t bytes = n * loom_dtype_size(dt);
                    char *h = host(bytes);
                    void *b = mem_alloc((mem_kind)k, bytes);
                    for (size_t i = 0; i < n; i++) put(h, dt, i, val(rank, i));
                    mem_put((mem_kind)k, b, h, bytes);
                    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, b, n, dt, op));
                    memset(h, 0, bytes);
                    mem_get((mem_kind)k, h, b, bytes);
                    size_t bad = 0;
                    for (size_t i = 0; i < n; i++) bad += get(h, dt, i) != expect(op, size, i);
                    CHECK_MSG(bad == 0, "%s %s %s n=%zu: %zu wrong", mem_names[k],
                              loom_dtype_name(dt), o ? "max" : "sum", n, bad);
                    free(h);
                    mem_free((mem_kind)k, b);
                }
    /* a scalar on the stack, as the model's grad norm */
    double norm = rank + 0.5;
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, &norm, 1, LOOM_F64, LOOM_RED_SUM));
    CHECK(norm == (double)size * (size - 1) / 2 + 0.5 * size);
    /* zero elements: nothing to stage */
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, &norm, 0, LOOM_F64, LOOM_RED_SUM));
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
}

TEST(nccl_host_reduce_scatter) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    const size_t ns[] = {3, 4099};
    for (size_t p = 0; p < N_PAIRS; p++)
        for (size_t k = 0; k < 2; k++)
            for (size_t t = 0; t < N_RED; t++) {
                mem_kind sk = mem_pairs[p][0], rk = mem_pairs[p][1];
                size_t N = ns[k];
                loom_dtype dt = red_types[t];
                loom_red_op op = (t + k) % 2 ? LOOM_RED_MAX : LOOM_RED_SUM;
                size_t es = loom_dtype_size(dt), total = N * (size_t)size;
                char *h = host(total * es), *out = host(N * es);
                void *send = mem_alloc(sk, total * es), *recv = mem_alloc(rk, N * es);
                for (size_t j = 0; j < total; j++) put(h, dt, j, val(rank, j));
                mem_put(sk, send, h, total * es);
                CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(w, send, recv, N, dt, op));
                mem_get(rk, out, recv, N * es);
                size_t bad = 0;
                for (size_t i = 0; i < N; i++)
                    bad += get(out, dt, i) != expect(op, size, (size_t)rank * N + i);
                CHECK_MSG(bad == 0, "%s -> %s %s %s N=%zu: %zu wrong", mem_names[sk],
                          mem_names[rk], loom_dtype_name(dt), op ? "max" : "sum", N, bad);
                free(h);
                free(out);
                mem_free(sk, send);
                mem_free(rk, recv);
            }
    /* host, in place (recv is this rank's block of send) and recv == send */
    enum { M = 1001 };
    size_t total = (size_t)M * (size_t)size;
    float *h = host(sizeof(float) * total);
    for (int pass = 0; pass < 2; pass++) {
        for (size_t j = 0; j < total; j++) h[j] = (float)val(rank, j);
        float *recv = pass == 0 ? h + (size_t)rank * M : h;
        CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(w, h, recv, M, LOOM_F32, LOOM_RED_SUM));
        size_t bad = 0;
        for (size_t i = 0; i < M; i++)
            bad += recv[i] != (float)expect(LOOM_RED_SUM, size, (size_t)rank * M + i);
        CHECK_MSG(bad == 0, "host %s: %zu wrong", pass == 0 ? "in place" : "recv == send", bad);
    }
    free(h);
}

TEST(nccl_host_allgather) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    const loom_dtype types[] = {LOOM_F32, LOOM_I64, LOOM_BF16, LOOM_U8};
    const size_t ns[] = {5, 70001};
    for (size_t p = 0; p < N_PAIRS; p++)
        for (size_t k = 0; k < 2; k++)
            for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
                mem_kind sk = mem_pairs[p][0], rk = mem_pairs[p][1];
                loom_dtype dt = types[t];
                size_t N = ns[k], es = loom_dtype_size(dt), all = N * (size_t)size * es;
                char *hs = host(N * es), *h = host(all);
                void *send = mem_alloc(sk, N * es), *recv = mem_alloc(rk, all);
                for (size_t i = 0; i < N; i++) put(hs, dt, i, rank * 10 + (int)(i % 7));
                mem_put(sk, send, hs, N * es);
                CHECK_OK(nt_ctx(), loom_comm_allgather(w, send, recv, N, dt));
                mem_get(rk, h, recv, all);
                size_t bad = 0;
                for (int r = 0; r < size; r++)
                    for (size_t i = 0; i < N; i++)
                        bad += get(h, dt, (size_t)r * N + i) != r * 10 + (int)(i % 7);
                CHECK_MSG(bad == 0, "%s -> %s %s N=%zu: %zu wrong", mem_names[sk],
                          mem_names[rk], loom_dtype_name(dt), N, bad);
                free(hs);
                free(h);
                mem_free(sk, send);
                mem_free(rk, recv);
            }
    /* host, in place: send is this rank's block of recv */
    enum { M = 9 };
    int64_t *h = host(sizeof(int64_t) * M * (size_t)size);
    for (size_t j = 0; j < (size_t)M * (size_t)size; j++) h[j] = -1;
    for (int i = 0; i < M; i++) h[(size_t)rank * M + i] = rank * 100 + i;
    CHECK_OK(nt_ctx(), loom_comm_allgather(w, h + (size_t)rank * M, h, M, LOOM_I64));
    for (int r = 0; r < size; r++)
        for (int i = 0; i < M; i++) CHECK_EQ_INT(h[(size_t)r * M + i], r * 100 + i);
    free(h);
}

TEST(nccl_host_broadcast) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    for (int k = MEM_HOST; k <= MEM_DEV; k++) {
        int64_t *b64 = mem_alloc((mem_kind)k, 4 * sizeof(int64_t));
        uint16_t *bh = mem_alloc((mem_kind)k, 7 * sizeof(uint16_t));
        for (int root = 0; root < size; root++) {
            int64_t v[4];
            for (int i = 0; i < 4; i++) v[i] = rank == root ? root * 100 + i : -1;
            mem_put((mem_kind)k, b64, v, sizeof v);
            CHECK_OK(nt_ctx(), loom_comm_broadcast(w, b64, 4, LOOM_I64, root));
            mem_get((mem_kind)k, v, b64, sizeof v);
            for (int i = 0; i < 4; i++)
                CHECK_MSG(v[i] == root * 100 + i, "%s root %d [%d]: %lld", mem_names[k], root, i,
                          (long long)v[i]);
            uint16_t hb[7];
            for (int i = 0; i < 7; i++)
                hb[i] = rank == root ? loom_f32_to_bf16(0.25f * (float)(i - 3) + (float)root)
                                     : 0xffff;
            mem_put((mem_kind)k, bh, hb, sizeof hb);
            CHECK_OK(nt_ctx(), loom_comm_broadcast(w, bh, 7, LOOM_BF16, root));
            mem_get((mem_kind)k, hb, bh, sizeof hb);
            for (int i = 0; i < 7; i++)
                CHECK(hb[i] == loom_f32_to_bf16(0.25f * (float)(i - 3) + (float)root));
        }
        mem_free((mem_kind)k, b64);
        mem_free((mem_kind)k, bh);
    }
    /* a larger host buffer from the last rank */
    enum { M = 100003 };
    float *h = host(sizeof(float) * M);
    int root = size - 1;
    for (int i = 0; i < M; i++) h[i] = rank == root ? (float)(i % 1000) - 0.5f : -7.f;
    CHECK_OK(nt_ctx(), loom_comm_broadcast(w, h, M, LOOM_F32, root));
    size_t bad = 0;
    for (int i = 0; i < M; i++) bad += h[i] != (float)(i % 1000) - 0.5f;
    CHECK_EQ_INT(bad, 0);
    free(h);
}

TEST(nccl_host_alltoall) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    const size_t ns[] = {3, 20001};
    for (size_t p = 0; p < N_PAIRS; p++)
        for (size_t k = 0; k < 2; k++) {
            mem_kind sk = mem_pairs[p][0], rk = mem_pairs[p][1];
            size_t N = ns[k], bytes = sizeof(int32_t) * N * (size_t)size;
            int32_t *h = host(bytes);
            void *send = mem_alloc(sk, bytes), *recv = mem_alloc(rk, bytes);
            /* block b of rank r's send goes to rank b */
            for (int b = 0; b < size; b++)
                for (size_t i = 0; i < N; i++)
                    h[(size_t)b * N + i] = rank * 1000000 + b * 1000 + (int32_t)(i % 1000);
            mem_put(sk, send, h, bytes);
            CHECK_OK(nt_ctx(), loom_comm_alltoall(w, send, recv, N, LOOM_I32));
            mem_get(rk, h, recv, bytes);
            size_t bad = 0;
            for (int q = 0; q < size; q++)
                for (size_t i = 0; i < N; i++)
                    bad += h[(size_t)q * N + i] != q * 1000000 + rank * 1000 + (int32_t)(i % 1000);
            CHECK_MSG(bad == 0, "%s -> %s N=%zu: %zu wrong", mem_names[sk], mem_names[rk], N,
                      bad);
            free(h);
            mem_free(sk, send);
            mem_free(rk, recv);
        }
    /* host, send == recv */
    enum { M = 4 };
    int32_t *h = host(sizeof(int32_t) * M * (size_t)size);
    for (int b = 0; b < size; b++)
        for (int i = 0; i < M; i++) h[b * M + i] = rank * 100 + b * 10 + i;
    CHECK_OK(nt_ctx(), loom_comm_alltoall(w, h, h, M, LOOM_I32));
    for (int q = 0; q < size; q++)
        for (int i = 0; i < M; i++) CHECK_EQ_INT(h[q * M + i], q * 100 + rank * 10 + i);
    free(h);
}

/* Async variants with a host buffer complete at once (*req = NULL), also
 * while a device request of the same group is in flight. */
TEST(nccl_host_async) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    enum { N = 6 };
    double hd[N], hh[N];
    for (int i = 0; i < N; i++) hd[i] = hh[i] = val(rank, (size_t)i);
    double *d = dev(sizeof hd);
    h2d(d, hd, sizeof hd);
    loom_comm_req *rd = NULL, *r1 = (loom_comm_req *)1, *r2 = (loom_comm_req *)1,
                  *r3 = (loom_comm_req *)1;
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(w, d, N, LOOM_F64, LOOM_RED_SUM, &rd));
    CHECK(rd != NULL);
    CHECK_OK(nt_ctx(), loom_comm_allreduce_async(w, hh, N, LOOM_F64, LOOM_RED_MAX, &r1));
    CHECK(r1 == NULL);
    for (int i = 0; i < N; i++) CHECK(hh[i] == expect(LOOM_RED_MAX, size, (size_t)i));
    /* host send, device recv */
    float *hs = host(sizeof(float) * N * (size_t)size), hr[N];
    for (int j = 0; j < N * size; j++) hs[j] = (float)val(rank, (size_t)j);
    float *dr = dev(sizeof hr);
    CHECK_OK(nt_ctx(),
             loom_comm_reduce_scatter_async(w, hs, dr, N, LOOM_F32, LOOM_RED_SUM, &r2));
    CHECK(r2 == NULL);
    d2h(hr, dr, sizeof hr);
    for (int i = 0; i < N; i++)
        CHECK(hr[i] == (float)expect(LOOM_RED_SUM, size, (size_t)(rank * N + i)));
    /* device send, host recv */
    int64_t hg[N], *dg = dev(sizeof hg), *hgr = host(sizeof(int64_t) * N * (size_t)size);
    for (int i = 0; i < N; i++) hg[i] = rank * 1000 + i;
    h2d(dg, hg, sizeof hg);
    CHECK_OK(nt_ctx(), loom_comm_allgather_async(w, dg, hgr, N, LOOM_I64, &r3));
    CHECK(r3 == NULL);
    for (int r = 0; r < size; r++)
        for (int i = 0; i < N; i++) CHECK_EQ_INT(hgr[r * N + i], r * 1000 + i);
    CHECK_OK(nt_ctx(), loom_comm_wait(w, r1)); /* NULL: done */
    CHECK_OK(nt_ctx(), loom_comm_wait(w, rd));
    d2h(hd, d, sizeof hd);
    for (int i = 0; i < N; i++) CHECK(hd[i] == expect(LOOM_RED_SUM, size, (size_t)i));
    free(hs);
    free(hgr);
    cudaFree(d);
    cudaFree(dr);
    cudaFree(dg);
}

/* Outside a group, a chain 0 -> 1 -> ... -> size-1 for every pair of
 * (send, recv) kinds (host, pinned, device), then back. A host send
 * returns once its data is on the GPU: the buffer is rewritten at once. */
TEST(nccl_host_sendrecv_outside_group) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    if (size < 2) SKIP("needs 2 ranks");
    enum { N = 100003 };
    size_t bytes = sizeof(int32_t) * N;
    int32_t *h = host(bytes);
    for (size_t p = 0; p < N_PAIRS; p++) {
        mem_kind sk = mem_pairs[p][0], rk = mem_pairs[p][1];
        int32_t *sbuf = mem_alloc(sk, bytes), *rbuf = mem_alloc(rk, bytes);
        if (rank > 0) {
            CHECK_OK(nt_ctx(), loom_comm_recv(w, rbuf, N, LOOM_I32, rank - 1, 10));
            mem_get(rk, h, rbuf, bytes);
            size_t bad = 0;
            for (int i = 0; i < N; i++) bad += h[i] != (rank - 1) * 7 + (int)p + i;
            CHECK_MSG(bad == 0, "%s -> %s: %zu wrong", mem_names[sk], mem_names[rk], bad);
        }
        if (rank < size - 1) {
            for (int i = 0; i < N; i++) h[i] = rank * 7 + (int)p + i;
            mem_put(sk, sbuf, h, bytes);
            CHECK_OK(nt_ctx(), loom_comm_send(w, sbuf, N, LOOM_I32, rank + 1, 10));
            for (int i = 0; i < N; i++) h[i] = -1;
            mem_put(sk, sbuf, h, bytes); /* reused at once */
        }
        CHECK_OK(nt_ctx(), loom_comm_barrier(w)); /* the sends are done before the frees */
        mem_free(sk, sbuf);
        mem_free(rk, rbuf);
    }
    /* back, two messages in order: stack -> stack, pinned -> device */
    int64_t *pin = mem_alloc(MEM_PINNED, sizeof(int64_t)), *dx = dev(sizeof(int64_t));
    if (rank < size - 1) {
        int64_t gx = -1, gy = -1;
        CHECK_OK(nt_ctx(), loom_comm_recv(w, &gx, 1, LOOM_I64, rank + 1, 20));
        CHECK_OK(nt_ctx(), loom_comm_recv(w, dx, 1, LOOM_I64, rank + 1, 21));
        d2h(&gy, dx, sizeof gy);
        CHECK_EQ_INT(gx, rank + 1);
        CHECK_EQ_INT(gy, rank + 101);
    }
    if (rank > 0) {
        int64_t x = rank;
        *pin = rank + 100;
        CHECK_OK(nt_ctx(), loom_comm_send(w, &x, 1, LOOM_I64, rank - 1, 20));
        x = -1;
        CHECK_OK(nt_ctx(), loom_comm_send(w, pin, 1, LOOM_I64, rank - 1, 21));
        *pin = -1;
    }
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    free(h);
    mem_free(MEM_PINNED, pin);
    cudaFree(dx);
}

/* Inside a group: host send/recv with both neighbours (nested groups, a
 * host collective before the first send/recv, mixed kinds), then repeated
 * exchanges of host buffers. The received data is in the host buffers
 * when group_end returns. */
TEST(nccl_host_ring_in_group) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    if (size < 2) SKIP("needs 2 ranks");
    int right = (rank + 1) % size, left = (rank + size - 1) % size;
    enum { N = 50001 };
    size_t bytes = sizeof(float) * N;
    /* to the right from host memory, to the left from device memory;
     * from the left into device memory, from the right into host memory */
    float *out_h = host(bytes), *out_d = dev(bytes), *in_h = host(bytes), *in_d = dev(bytes);
    float *h = host(bytes);
    for (int i = 0; i < N; i++) out_h[i] = (float)(rank * 1000 + i % 1000);
    for (int i = 0; i < N; i++) h[i] = (float)(-rank - 1);
    h2d(out_d, h, bytes);
    cudaMemset(in_d, 0, bytes);
    CHECK_OK(nt_ctx(), loom_comm_group_start(w));
    int32_t v = 1; /* host collective before the first send/recv: runs at once */
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, &v, 1, LOOM_I32, LOOM_RED_SUM));
    CHECK_EQ_INT(v, size);
    CHECK_OK(nt_ctx(), loom_comm_send(w, out_h, N, LOOM_F32, right, 1));
    CHECK_OK(nt_ctx(), loom_comm_send(w, out_d, N, LOOM_F32, left, 2));
    CHECK_OK(nt_ctx(), loom_comm_group_start(w));
    CHECK_OK(nt_ctx(), loom_comm_recv(w, in_d, N, LOOM_F32, left, 1));
    CHECK_OK(nt_ctx(), loom_comm_recv(w, in_h, N, LOOM_F32, right, 2));
    CHECK_EQ_INT(loom_comm_allreduce(w, &v, 1, LOOM_I32, LOOM_RED_SUM), LOOM_ERR_UNSUPPORTED);
    CHECK_CONTAINS(loom_last_error(nt_ctx()), "inside group_start/group_end after a send or recv");
    CHECK_OK(nt_ctx(), loom_comm_group_end(w));
    CHECK_OK(nt_ctx(), loom_comm_group_end(w));
    size_t bad = 0;
    for (int i = 0; i < N; i++) bad += in_h[i] != (float)(-right - 1);
    CHECK_MSG(bad == 0, "device -> host: %zu wrong", bad);
    d2h(h, in_d, bytes);
    bad = 0;
    for (int i = 0; i < N; i++) bad += h[i] != (float)(left * 1000 + i % 1000);
    CHECK_MSG(bad == 0, "host -> device: %zu wrong", bad);
    /* exchanges of neighbours, host to host (pageable, then pinned) */
    float *pin_out = mem_alloc(MEM_PINNED, bytes), *pin_in = mem_alloc(MEM_PINNED, bytes);
    for (int it = 0; it < 4; it++) {
        bool pinned = it % 2;
        float *o = pinned ? pin_out : out_h, *in = pinned ? pin_in : in_h;
        for (int i = 0; i < N; i++) o[i] = (float)(rank * 1000 + it * 10 + i % 7);
        memset(in, 0, bytes);
        CHECK_OK(nt_ctx(), loom_comm_group_start(w));
        CHECK_OK(nt_ctx(), loom_comm_recv(w, in, N, LOOM_F32, left, 0));
        CHECK_OK(nt_ctx(), loom_comm_send(w, o, N, LOOM_F32, right, 0));
        CHECK_OK(nt_ctx(), loom_comm_group_end(w));
        bad = 0;
        for (int i = 0; i < N; i++) bad += in[i] != (float)(left * 1000 + it * 10 + i % 7);
        CHECK_MSG(bad == 0, "%s exchange %d: %zu wrong", pinned ? "pinned" : "host", it, bad);
    }
    /* a small host message to each neighbour, both directions, one group */
    int64_t to_l = rank * 10 + 1, to_r = rank * 10 + 2, from_l = -1, from_r = -1;
    CHECK_OK(nt_ctx(), loom_comm_group_start(w));
    CHECK_OK(nt_ctx(), loom_comm_send(w, &to_r, 1, LOOM_I64, right, 0));
    CHECK_OK(nt_ctx(), loom_comm_send(w, &to_l, 1, LOOM_I64, left, 0));
    CHECK_OK(nt_ctx(), loom_comm_recv(w, &from_l, 1, LOOM_I64, left, 0));
    CHECK_OK(nt_ctx(), loom_comm_recv(w, &from_r, 1, LOOM_I64, right, 0));
    CHECK_OK(nt_ctx(), loom_comm_group_end(w));
    if (size > 2) {
        CHECK_EQ_INT(from_l, left * 10 + 2);
        CHECK_EQ_INT(from_r, right * 10 + 1);
    } else {
        /* one neighbour: its two messages arrive in the order it sent them */
        CHECK_EQ_INT(from_l, left * 10 + 2);
        CHECK_EQ_INT(from_r, left * 10 + 1);
    }
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    free(out_h);
    free(in_h);
    free(h);
    cudaFree(out_d);
    cudaFree(in_d);
    mem_free(MEM_PINNED, pin_out);
    mem_free(MEM_PINNED, pin_in);
}

/* Bus bandwidth of a blocking allreduce (reported, not checked beyond the
 * values): nccl-tests' busbw = bytes * 2 (n-1) / n / time. */
TEST(nccl_allreduce_bandwidth) {
    loom_comm *w = nt_world();
    int size = nt_size();
    const size_t sizes[] = {1u << 20, 16u << 20, 256u << 20};
    for (size_t k = 0; k < 3; k++) {
        size_t bytes = sizes[k], n = bytes / sizeof(float);
        float *d = dev(bytes), *h = host(bytes);
        for (size_t i = 0; i < n; i++) h[i] = 1.f;
        h2d(d, h, bytes);
        enum { WARM = 2, ITERS = 10 };
        for (int i = 0; i < WARM; i++) CHECK_OK(nt_ctx(), loom_comm_allreduce(w, d, n, LOOM_F32, LOOM_RED_MAX));
        double t0 = now_s();
        for (int i = 0; i < ITERS; i++)
            CHECK_OK(nt_ctx(), loom_comm_allreduce(w, d, n, LOOM_F32, LOOM_RED_SUM));
        double dt = (now_s() - t0) / ITERS;
        d2h(h, d, bytes);
        double want = 1;
        for (int i = 0; i < ITERS; i++) want *= size;
        size_t bad = 0;
        for (size_t i = 0; i < n; i++) bad += h[i] != (float)want;
        CHECK_EQ_INT(bad, 0);
        if (nt_rank() == 0) {
            double algbw = (double)bytes / dt / 1e9;
            printf("    allreduce %4zu MiB F32 over %d GPU(s): %8.3f ms, algbw %6.1f GB/s, "
                   "busbw %6.1f GB/s\n",
                   bytes >> 20, size, dt * 1e3, algbw,
                   algbw * 2.0 * (size - 1) / (size > 1 ? size : 1));
            fflush(stdout);
        }
        free(h);
        cudaFree(d);
    }
}

/* Last: a collective that one rank makes alone ends, on that rank, with an
 * error naming it after the timeout; its group is aborted and refuses
 * further use; the world is untouched. */
TEST(nccl_timeout) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    if (size < 2) SKIP("needs 2 ranks");
    loom_comm *t = NULL;
    REQUIRE_OK(nt_ctx(), loom_comm_split(w, 0, rank, "slow", &t));
    float *d = dev(sizeof(float) * 1024);
    cudaMemset(d, 0, sizeof(float) * 1024);
    CHECK_OK(nt_ctx(), loom_comm_allreduce(t, d, 1024, LOOM_F32, LOOM_RED_SUM)); /* connect */
    if (rank == 0) {
        loom_comm_set_timeout(t, 1.0);
        double t0 = now_s();
        CHECK_EQ_INT(loom_comm_allreduce(t, d, 1024, LOOM_F32, LOOM_RED_SUM), LOOM_ERR_COMM);
        double took = now_s() - t0;
        char want[128];
        snprintf(want, sizeof want, "allreduce on group 'slow' (rank 0 of %d) timed out after 1 s",
                 size);
        CHECK_CONTAINS(loom_last_error(nt_ctx()), want);
        CHECK(took >= 0.9 && took < 20);
        printf("    rank 0 gave up after %.2f s: %s\n", took, loom_last_error(nt_ctx()));
        fflush(stdout);
        CHECK_EQ_INT(loom_comm_barrier(t), LOOM_ERR_COMM);
        CHECK_CONTAINS(loom_last_error(nt_ctx()), "cannot be used after an earlier operation");
    }
    /* the others never call it; everyone frees the group */
    loom_comm_set_timeout(t, 10);
    loom_comm_free(t);
    CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    int32_t v = 1, *dv = dev(sizeof v);
    h2d(dv, &v, sizeof v);
    CHECK_OK(nt_ctx(), loom_comm_allreduce(w, dv, 1, LOOM_I32, LOOM_RED_SUM));
    d2h(&v, dv, sizeof v);
    CHECK_EQ_INT(v, size);
    cudaFree(dv);
    cudaFree(d);
}

/* loom_comm_defer: the next alltoall / alltoallv of device buffers returns
 * once queued, stream-ordered with the legacy stream (a cudaMemcpy after it
 * reads its result), and loom_comm_settle waits for it; host buffers still
 * complete before the call returns; a deferred call that never completes
 * fails at settle within the deadline, naming it, instead of hanging. */
TEST(nccl_defer) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    enum { N = 4099 };
    size_t bytes = sizeof(int32_t) * N * (size_t)size;
    int32_t *h = host(bytes), *send = dev(bytes), *recv = dev(bytes);
    for (int b = 0; b < size; b++)
        for (int i = 0; i < N; i++) h[b * N + i] = rank * 100000 + b * 10000 + i % 10000;
    h2d(send, h, bytes);
    loom_comm_defer(w);
    CHECK_OK(nt_ctx(), loom_comm_alltoall(w, send, recv, N, LOOM_I32));
    /* alltoallv (send/recv in a group): the counts are this rank's block each way */
    size_t sc[64], rcn[64];
    REQUIRE(size <= 64);
    for (int r = 0; r < size; r++) sc[r] = rcn[r] = N;
    int32_t *back = dev(bytes);
    loom_comm_defer(w);
    CHECK_OK(nt_ctx(), loom_comm_alltoallv(w, recv, sc, back, rcn, LOOM_I32));
    d2h(h, back, bytes); /* the legacy stream waits for the group's stream */
    size_t bad = 0;
    for (int b = 0; b < size; b++)
        for (int i = 0; i < N; i++) bad += h[b * N + i] != rank * 100000 + b * 10000 + i % 10000;
    CHECK_EQ_INT(bad, 0);
    /* two alltoallv's in one group (the MoE dispatch's tables and rows):
     * the second is the first's blocks back again, as F32 */
    const loom_a2av v[2] = {{send, sc, recv, rcn, LOOM_I32}, {send, sc, back, rcn, LOOM_F32}};
    loom_comm_defer(w);
    CHECK_OK(nt_ctx(), loom_comm_alltoallv_n(w, v, 2));
    int32_t *h2 = host(bytes);
    d2h(h, recv, bytes);
    d2h(h2, back, bytes);
    bad = 0;
    for (int q = 0; q < size; q++)
        for (int i = 0; i < N; i++)
            bad += (h[q * N + i] != q * 100000 + rank * 10000 + i % 10000) +
                   (h2[q * N + i] != h[q * N + i]);
    CHECK_EQ_INT(bad, 0);
    free(h2);
    /* a deferred reduce-scatter (the optimizer's buckets): rank r's block b
     * of send summed over ranks lands in block rank of everyone's */
    int32_t *rs = dev(sizeof(int32_t) * N);
    loom_comm_defer(w);
    CHECK_OK(nt_ctx(), loom_comm_reduce_scatter(w, send, rs, N, LOOM_I32, LOOM_RED_SUM));
    d2h(h, rs, sizeof(int32_t) * N);
    bad = 0;
    for (int i = 0; i < N; i++) {
        int64_t want = 0;
        for (int q = 0; q < size; q++) want += q * 100000 + rank * 10000 + i % 10000;
        bad += h[i] != want;
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_OK(nt_ctx(), loom_comm_settle(w));
    cudaFree(rs);
    CHECK_OK(nt_ctx(), loom_comm_settle(w));
    CHECK_OK(nt_ctx(), loom_comm_settle(w)); /* nothing pending: a no-op */
    /* host buffers: complete on return, deferred or not */
    for (int b = 0; b < size; b++)
        for (int i = 0; i < N; i++) h[b * N + i] = rank * 100000 + b * 10000 + i % 10000;
    int32_t *hr = host(bytes);
    loom_comm_defer(w);
    CHECK_OK(nt_ctx(), loom_comm_alltoall(w, h, hr, N, LOOM_I32));
    bad = 0;
    for (int q = 0; q < size; q++)
        for (int i = 0; i < N; i++) bad += hr[q * N + i] != q * 100000 + rank * 10000 + i % 10000;
    CHECK_EQ_INT(bad, 0);
    free(hr);
    if (size >= 2) { /* rank 0 defers an exchange nobody joins: settle gives up */
        loom_comm *t = NULL;
        REQUIRE_OK(nt_ctx(), loom_comm_split(w, 0, rank, "lonely", &t));
        CHECK_OK(nt_ctx(), loom_comm_alltoall(t, send, recv, N, LOOM_I32)); /* connect */
        if (rank == 0) {
            loom_comm_set_timeout(t, 1.0);
            loom_comm_defer(t);
            double t0 = now_s();
            CHECK_OK(nt_ctx(), loom_comm_alltoall(t, send, recv, N, LOOM_I32));
            CHECK(now_s() - t0 < 0.5);
            CHECK_EQ_INT(loom_comm_settle(t), LOOM_ERR_COMM);
            CHECK_CONTAINS(loom_last_error(nt_ctx()), "timed out after 1 s");
            CHECK_CONTAINS(loom_last_error(nt_ctx()), "deferred");
        }
        loom_comm_set_timeout(t, 10);
        loom_comm_free(t);
        CHECK_OK(nt_ctx(), loom_comm_barrier(w));
    }
    free(h);
    cudaFree(send);
    cudaFree(recv);
    cudaFree(back);
}

/* Deferred operations of two groups in a row, the second reading what the
 * first wrote (the MoE dispatch: the ep all-to-all's rows, then their etp
 * all-gather): the second waits for the first on the GPU although each
 * group has its own stream. The first moves 32 MiB a rank, so a second
 * that started beside it would gather the sentinel it overwrites; both
 * ways in, a collective and a group of send/recv (alltoallv). */
TEST(nccl_defer_two_groups) {
    loom_comm *w = nt_world();
    int size = nt_size(), rank = nt_rank();
    loom_comm *a = NULL, *b = NULL;
    REQUIRE_OK(nt_ctx(), loom_comm_split(w, 0, rank, "first", &a));
    REQUIRE_OK(nt_ctx(), loom_comm_split(w, 0, rank, "second", &b));
    const size_t N = ((size_t)8 << 20) / (size_t)size, bytes = sizeof(int32_t) * N * (size_t)size;
    const size_t M = 1024; /* the second gathers the last M values of what the first received */
    int32_t *h = host(bytes), *send = dev(bytes), *tmp = dev(bytes),
            *out = dev(sizeof(int32_t) * M * (size_t)size);
    for (size_t i = 0; i < N * (size_t)size; i++)
        h[i] = (int32_t)(rank * 1000 + i / N);
    h2d(send, h, bytes);
    size_t sc[64], rcn[64];
    REQUIRE(size <= 64);
    for (int r = 0; r < size; r++)
        sc[r] = rcn[r] = M;
    int32_t *got = host(sizeof(int32_t) * M * (size_t)size);
    size_t bad = 0;
    for (int it = 0; it < 8; it++) {
        CHECK_EQ_INT(cudaMemset(tmp, 0xff, bytes), cudaSuccess); /* -1: the sentinel */
        loom_comm_defer(a);
        CHECK_OK(nt_ctx(), loom_comm_alltoall(a, send, tmp, N, LOOM_I32));
        /* the end of what came from rank size-1: (size-1) * 1000 + rank */
        const int32_t *end = tmp + N * (size_t)size;
        loom_comm_defer(b);
        if (it % 2 == 0) /* each rank's last M values to every rank */
            CHECK_OK(nt_ctx(), loom_comm_allgather(b, end - M, out, M, LOOM_I32));
        else /* block r of the last size * M values to rank r */
            CHECK_OK(nt_ctx(),
                     loom_comm_alltoallv(b, end - (size_t)size * M, sc, out, rcn, LOOM_I32));
        d2h(got, out, sizeof(int32_t) * M * (size_t)size);
        /* either way block q of out came from rank q */
        for (int q = 0; q < size; q++)
            for (size_t i = 0; i < M; i++)
                bad += got[(size_t)q * M + i] != (size - 1) * 1000 + q;
        CHECK_OK(nt_ctx(), loom_comm_settle(a));
        CHECK_OK(nt_ctx(), loom_comm_settle(b));
    }
    CHECK_EQ_INT(bad, 0);
    free(h);
    free(got);
    cudaFree(send);
    cudaFree(tmp);
    cudaFree(out);
    loom_comm_free(b);
    loom_comm_free(a);
}
