/* Collectives: argument checks shared by every backend, dispatch, the copy
 * of buffers that may be device memory (loom_comm_copy), and the
 * one-process "single" backend (MPI is in comm_mpi.c). */

#include "comm_impl.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#ifdef LOOM_HAVE_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <link.h>
#include <stdatomic.h>
/* dlopen is in libc from glibc 2.34 (before, in libdl, which loom does not link) */
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
#include <dlfcn.h>
#define LOOM_COMM_DLOPEN 1
#endif
#endif

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
    c->timeout_s = like ? like->timeout_s : 300.0;
    return c;
}

const char *loom_comm_where(const loom_comm *c, char *buf, size_t cap) {
    snprintf(buf, cap, "group '%s' (rank %d of %d)", c->name, c->rank, c->size);
    return buf;
}

loom_status loom_comm_env_timeout(loom_ctx *ctx, double *out) {
    *out = 300.0;
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

/* ---- copies of buffers that may be device memory ---- */

#ifdef LOOM_HAVE_CUDA
static int is_libcuda(struct dl_phdr_info *info, size_t size, void *data) {
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    const char *base = strrchr(name, '/');
    base = base ? base + 1 : name;
    return strncmp(base, "libcuda.so", 10) == 0;
}
#endif

#if defined(LOOM_HAVE_CUDA) && defined(LOOM_COMM_DLOPEN)
typedef CUresult (*cu_ctx_get_current_fn)(CUcontext *);
typedef CUresult (*cu_device_get_count_fn)(int *);
typedef CUresult (*cu_device_get_fn)(CUdevice *, int);
typedef CUresult (*cu_primary_state_fn)(CUdevice, unsigned int *, int *);

/* Whether the loaded driver holds a context that device memory could
 * belong to: one current on this thread, or a primary context (the
 * runtime's) active on some device. Queries that initialise and create
 * nothing; "true" when it cannot tell. */
static bool driver_has_context(void *lib) {
    cu_ctx_get_current_fn get_current = (cu_ctx_get_current_fn)dlsym(lib, "cuCtxGetCurrent");
    cu_device_get_count_fn get_count = (cu_device_get_count_fn)dlsym(lib, "cuDeviceGetCount");
    cu_device_get_fn get_device = (cu_device_get_fn)dlsym(lib, "cuDeviceGet");
    cu_primary_state_fn get_state =
        (cu_primary_state_fn)dlsym(lib, "cuDevicePrimaryCtxGetState");
    if (!get_current || !get_count || !get_device || !get_state) return true;
    CUcontext cur = NULL;
    CUresult r = get_current(&cur);
    if (r == CUDA_ERROR_NOT_INITIALIZED || r == CUDA_ERROR_DEINITIALIZED) return false;
    if (r != CUDA_SUCCESS || cur) return true;
    int n = 0;
    if (get_count(&n) != CUDA_SUCCESS) return true;
    for (int i = 0; i < n; i++) {
        CUdevice d;
        unsigned int flags = 0;
        int active = 0;
        if (get_device(&d, i) != CUDA_SUCCESS || get_state(d, &flags, &active) != CUDA_SUCCESS)
            return true;
        if (active) return true;
    }
    return false;
}
#endif

/* A CPU-only run of a CUDA build must not start the driver (cuInit, a
 * context on GPU 0) just to learn that its buffers are host memory, and
 * device memory needs a driver that is loaded, initialised and holds a
 * context. So: libcuda not among the loaded objects (no CUDA call was ever
 * made), or driver_has_context false, means every pointer is host memory.
 * (cuBLASLt loads libcuda when the program starts, and probing the devices
 * initialises it, so neither alone says device memory exists.) Without
 * dlopen in libc, a loaded libcuda counts as in use. */
bool loom_comm_cuda_in_use(void) {
#ifdef LOOM_HAVE_CUDA
    static atomic_bool in_use;
    if (atomic_load(&in_use)) return true;
    if (!dl_iterate_phdr(is_libcuda, NULL)) return false;
#ifdef LOOM_COMM_DLOPEN
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    if (lib) {
        bool has = driver_has_context(lib);
        dlclose(lib);
        if (!has) return false;
    }
#endif
    atomic_store(&in_use, true);
    return true;
#else
    return false;
#endif
}

#ifdef LOOM_HAVE_CUDA
/* Whether p is device (or managed) memory; host memory, pinned or not, is
 * not. */
static loom_status is_device(loom_comm *c, const char *what, const void *p, bool *dev) {
    struct cudaPointerAttributes a;
    memset(&a, 0, sizeof a);
    *dev = false;
    cudaError_t e = cudaPointerGetAttributes(&a, p);
    if (e == cudaErrorInvalidValue) { /* runtimes before CUDA 11: unregistered host memory */
        cudaGetLastError();
        return LOOM_OK;
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        /* a driver that cannot run (no GPU, a stub or too old a driver)
         * holds no device memory */
        int n = 0;
        cudaError_t g = cudaGetDeviceCount(&n);
        cudaGetLastError();
        if (g != cudaSuccess || n == 0) return LOOM_OK;
        char w[96];
        return loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s: cannot tell whether %p is device "
                         "memory: CUDA error: %s",
                         what, loom_comm_where(c, w, sizeof w), p, cudaGetErrorString(e));
    }
    *dev = a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
    return LOOM_OK;
}

/* cudaMemcpy's ranges may not overlap: an overlapping copy goes through a
 * temporary device buffer. A device-to-device cudaMemcpy may return before
 * the copy is done; the legacy stream is synchronised so that the
 * operation is complete on return, as on the other backends. */
static loom_status device_copy(loom_comm *c, const char *what, void *dst, const void *src,
                               size_t bytes) {
    char w[96];
    void *tmp = NULL;
    const char *d = dst, *s = src;
    cudaError_t e = cudaSuccess;
    if (d < s + bytes && s < d + bytes) {
        e = cudaMalloc(&tmp, bytes);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return loom_errf(c->ctx, LOOM_ERR_OOM,
                             "%s on %s: no GPU memory for a %zu-byte copy of an overlapping "
                             "buffer (%s)",
                             what, loom_comm_where(c, w, sizeof w), bytes, cudaGetErrorString(e));
        }
        e = cudaMemcpy(tmp, src, bytes, cudaMemcpyDefault);
        src = tmp;
    }
    if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamLegacy);
    if (tmp) {
        cudaError_t f = cudaFree(tmp);
        if (e == cudaSuccess) e = f;
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        return loom_errf(c->ctx, LOOM_ERR_COMM, "%s on %s: copying %zu bytes: CUDA error: %s",
                         what, loom_comm_where(c, w, sizeof w), bytes, cudaGetErrorString(e));
    }
    return LOOM_OK;
}
#endif

loom_status loom_comm_copy(loom_comm *c, const char *what, void *dst, const void *src,
                           size_t bytes) {
    if (bytes == 0 || dst == src) return LOOM_OK;
#ifdef LOOM_HAVE_CUDA
    if (loom_comm_cuda_in_use()) {
        bool dd, sd;
        loom_status st = is_device(c, what, dst, &dd);
        if (!st) st = is_device(c, what, src, &sd);
        if (st) return st;
        if (dd || sd) return device_copy(c, what, dst, src, bytes);
    }
#endif
    memmove(dst, src, bytes);
    return LOOM_OK;
}

/* F32, F64, I32 and I64 everywhere; BF16 and F16 (GPU activations) on NCCL,
 * and on one process, where a reduction is a copy. MPI has no 16-bit
 * floating-point types. */
static bool reducible(const loom_comm *c, loom_dtype dt) {
    if (dt == LOOM_F32 || dt == LOOM_F64 || dt == LOOM_I32 || dt == LOOM_I64) return true;
    const char *b = loom_comm_backend_name(c);
    return (dt == LOOM_BF16 || dt == LOOM_F16) && strcmp(b, "mpi") && strcmp(b, "gloo");
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
    if (!reducible(c, dt))
        return loom_errf(c->ctx, LOOM_ERR_UNSUPPORTED,
                         "%s of %s is not supported here (loom reduces F32, F64, I32 and I64, "
                         "and BF16 and F16 on NCCL; reduce an F32 copy)",
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

/* The MPI launcher variable that is set, or NULL. */
static const char *mpi_launcher(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return vars[i];
    }
    return NULL;
}

static loom_status single_world(loom_ctx *ctx, loom_comm **out);

static loom_status gloo_world(loom_ctx *ctx, loom_comm **out, const char *why) {
#ifdef LOOM_HAVE_GLOO
    return loom_comm_gloo_world(ctx, out);
#else
    return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                     "%s, but this loom was built without Gloo (the CPU collectives without "
                     "MPI): install Debian's libgloo-dev (apt-get install libgloo-dev) and "
                     "rebuild, or start the ranks under mpirun",
                     why);
#endif
}

/* AUTO: MPI under an MPI launcher (in a build with MPI), else Gloo when the
 * launcher's variables ask for several ranks, else one process. */
static loom_status auto_world(loom_ctx *ctx, loom_comm **out) {
    const char *mpi_var = mpi_launcher();
#ifdef LOOM_HAVE_MPI
    if (mpi_var || loom_comm_mpi_initialized()) return loom_comm_mpi_world(ctx, out);
#endif
    loom_launch l;
    loom_status st = loom_launch_from_env(ctx, &l);
    if (st) return st;
    if (l.size > 1) {
        char why[200];
        const char *size_var = !strcmp(l.rank_var, "RANK")                   ? "WORLD_SIZE"
                               : !strcmp(l.rank_var, "OMPI_COMM_WORLD_RANK") ? "OMPI_COMM_WORLD_SIZE"
                                                                             : "SLURM_NTASKS";
        snprintf(why, sizeof why, "%s=%d and %s=%d ask for %d ranks", l.rank_var, l.rank,
                 size_var, l.size, l.size);
        return gloo_world(ctx, out, why);
    }
#ifndef LOOM_HAVE_MPI
    const char *sz = getenv("OMPI_COMM_WORLD_SIZE");
    if (!sz) sz = getenv("PMI_SIZE");
    if (mpi_var && !(sz && strcmp(sz, "1") == 0))
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "started by an MPI launcher (%s is set), but this loom was built "
                         "without MPI; install libopenmpi-dev and rebuild",
                         mpi_var);
#endif
    return single_world(ctx, out);
}

loom_status loom_comm_world(loom_ctx *ctx, loom_comm_backend backend, loom_comm **out) {
    if (!out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_comm_world: out is NULL");
    *out = NULL;
    const char *pick = getenv("LOOM_COMM_BACKEND");
    if (backend == LOOM_COMM_AUTO && pick && *pick) {
        if (!strcmp(pick, "mpi"))
            backend = LOOM_COMM_MPI;
        else if (!strcmp(pick, "gloo"))
            backend = LOOM_COMM_GLOO;
        else if (!strcmp(pick, "single"))
            backend = LOOM_COMM_SINGLE;
        else if (strcmp(pick, "auto"))
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "LOOM_COMM_BACKEND='%s': give mpi, gloo, single or auto (CPU "
                             "ranks; GPU ranks use NCCL)",
                             pick);
    }
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
    case LOOM_COMM_GLOO:
        return gloo_world(ctx, out, "the Gloo backend was asked for");
    case LOOM_COMM_NCCL:
#ifdef LOOM_HAVE_CUDA
        return loom_comm_nccl_world(ctx, out);
#else
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "this loom was built without CUDA, so without the NCCL backend; "
                         "rebuild with make CUDA=1");
#endif
    case LOOM_COMM_AUTO:
        return auto_world(ctx, out);
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

void loom_comm_defer(loom_comm *c) {
    if (c) c->defer_next = true;
}

loom_status loom_comm_settle(loom_comm *c) {
    return c && c->vt->settle ? c->vt->settle(c) : LOOM_OK;
}
int loom_comm_device(const loom_comm *c) { return c && c->vt->device ? c->vt->device(c) : -1; }
void *loom_comm_stream(const loom_comm *c) {
    return c && c->vt->stream ? c->vt->stream(c) : NULL;
}

static loom_status split_args(loom_comm *parent, loom_comm **out) {
    if (!parent || !out) return LOOM_ERR_INVALID_ARG;
    *out = NULL;
    loom_status st = check_common(parent, "split", LOOM_U8, 0, 1, NULL, NULL);
    if (st) return st;
    if (parent->group_depth > 0)
        return loom_errf(parent->ctx, LOOM_ERR_INVALID_ARG,
                         "split of group '%s' inside group_start/group_end", parent->name);
    return LOOM_OK;
}

loom_status loom_comm_split(loom_comm *parent, int color, int key, const char *name,
                            loom_comm **out) {
    loom_status st = split_args(parent, out);
    return st ? st : parent->vt->split(parent, color, key, name, out);
}

loom_status loom_comm_split_self(loom_comm *parent, const char *name, loom_comm **out) {
    loom_status st = split_args(parent, out);
    if (st) return st;
    if (parent->vt->split_self) return parent->vt->split_self(parent, name, out);
    return parent->vt->split(parent, parent->rank, 0, name, out);
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
    loom_status st = reduce_scatter(c, send, recv, n, dt, op, NULL);
    if (c) c->defer_next = false;
    return st;
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
    loom_status st = allgather(c, send, recv, n, dt, NULL);
    if (c) c->defer_next = false;
    return st;
}

loom_status loom_comm_agree_all(loom_ctx *ctx, loom_comm *c, loom_status st, const char *what) {
    const int n = c ? loom_comm_size(c) : 1;
    if (n == 1) return st;
    int32_t *all = malloc((size_t)n * sizeof *all), me = (int32_t)st;
    if (!all) return st ? st : loom_errf(ctx, LOOM_ERR_OOM, "%s: out of memory", what);
    loom_status cs = loom_comm_allgather(c, &me, all, 1, LOOM_I32);
    for (int q = 0; !cs && !st && q < n; q++)
        if (all[q]) {
            cs = loom_errf(ctx, (loom_status)all[q], "%s failed on rank %d (%s; its message says "
                           "why)", what, q, loom_status_str((loom_status)all[q]));
            break;
        }
    free(all);
    return st ? st : cs;
}

loom_status loom_comm_agree_root(loom_ctx *ctx, loom_comm *c, loom_status st, int root,
                                 const char *what) {
    if (!c || loom_comm_size(c) == 1) return st;
    int32_t v = (int32_t)st;
    loom_status cs = loom_comm_broadcast(c, &v, 1, LOOM_I32, root);
    if (cs) return cs;
    if (loom_comm_rank(c) != root && v)
        return loom_errf(ctx, (loom_status)v, "%s failed on rank %d (its message says why)", what,
                         root);
    return st;
}

loom_status loom_comm_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "broadcast", dt, n, 1, buf, buf);
    if (!st) st = check_rank(c, "broadcast", "root", root);
    if (st) return st;
    return c->vt->broadcast(c, buf, n, dt, root);
}

#define TAG_ALLTOALLV 32700 /* + 2 + i: buffer i of alltoallv_n */
loom_status loom_comm_alltoallv_n(loom_comm *c, const loom_a2av *v, int n) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    if (n < 1 || n > LOOM_A2AV_MAX)
        return loom_errf(c->ctx, LOOM_ERR_INTERNAL, "alltoallv on %s: %d buffers (1 to %d)",
                         c->name, n, LOOM_A2AV_MAX);
    loom_status st = LOOM_OK;
    if (c->size == 1) { /* the single backend sends nothing to itself: a move */
        const bool defer = c->defer_next;
        for (int i = 0; i < n && !st; i++) {
            c->defer_next = defer; /* each move as asked */
            if (v[i].scount[0] != v[i].rcount[0])
                st = loom_errf(c->ctx, LOOM_ERR_INTERNAL, "alltoallv on %s: sends %zu, "
                               "receives %zu", c->name, v[i].scount[0], v[i].rcount[0]);
            else if (v[i].scount[0])
                st = loom_comm_alltoall(c, v[i].send, v[i].recv, v[i].scount[0], v[i].dt);
        }
        c->defer_next = false;
        return st;
    }
    st = loom_comm_group_start(c);
    for (int i = 0; i < n && !st; i++) {
        const size_t esz = loom_dtype_size(v[i].dt);
        const int tag = n == 1 ? TAG_ALLTOALLV : TAG_ALLTOALLV + 2 + i;
        size_t so = 0, ro = 0;
        for (int r = 0; r < c->size && !st; r++) {
            if (v[i].scount[r])
                st = loom_comm_send(c, (const char *)v[i].send + so * esz, v[i].scount[r],
                                    v[i].dt, r, tag);
            if (!st && v[i].rcount[r])
                st = loom_comm_recv(c, (char *)v[i].recv + ro * esz, v[i].rcount[r], v[i].dt, r,
                                    tag);
            so += v[i].scount[r];
            ro += v[i].rcount[r];
        }
    }
    loom_status st2 = loom_comm_group_end(c);
    c->defer_next = false;
    return st ? st : st2;
}

loom_status loom_comm_alltoallv(loom_comm *c, const void *send, const size_t *scount, void *recv,
                                const size_t *rcount, loom_dtype dt) {
    const loom_a2av v = {send, scount, recv, rcount, dt};
    return loom_comm_alltoallv_n(c, &v, 1);
}

loom_status loom_comm_allgatherv(loom_comm *c, const void *send, size_t n, void *recv,
                                 const size_t *rcount, loom_dtype dt) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    if (rcount[c->rank] != n)
        return loom_errf(c->ctx, LOOM_ERR_INTERNAL, "allgatherv on %s: sends %zu, expects %zu",
                         c->name, n, rcount[c->rank]);
    if (c->size == 1) return n ? loom_comm_alltoall(c, send, recv, n, dt) : LOOM_OK;
    const size_t esz = loom_dtype_size(dt);
    loom_status st = loom_comm_group_start(c), st2;
    size_t ro = 0;
    for (int r = 0; r < c->size && !st; r++) {
        if (n) st = loom_comm_send(c, send, n, dt, r, TAG_ALLTOALLV + 1);
        if (!st && rcount[r])
            st = loom_comm_recv(c, (char *)recv + ro * esz, rcount[r], dt, r, TAG_ALLTOALLV + 1);
        ro += rcount[r];
    }
    st2 = loom_comm_group_end(c);
    c->defer_next = false;
    return st ? st : st2;
}

loom_status loom_comm_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                               loom_dtype dt) {
    if (!c) return LOOM_ERR_INVALID_ARG;
    loom_status st = check_common(c, "alltoall", dt, n, (size_t)c->size, send, recv);
    if (!st) st = c->vt->alltoall(c, send, recv, n, dt);
    c->defer_next = false;
    return st;
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

/* In a CUDA build the buffers may be device memory (loom_comm_copy). */
static loom_status move(loom_comm *c, const char *what, void *dst, const void *src, size_t n,
                        loom_dtype dt) {
    return loom_comm_copy(c, what, dst, src, n * loom_dtype_size(dt));
}

static loom_status single_allreduce(loom_comm *c, void *buf, size_t n, loom_dtype dt,
                                    loom_red_op op, loom_comm_req **req) {
    return LOOM_OK;
}

static loom_status single_reduce_scatter(loom_comm *c, const void *send, void *recv, size_t n,
                                         loom_dtype dt, loom_red_op op, loom_comm_req **req) {
    return move(c, "reduce_scatter", recv, send, n, dt);
}

static loom_status single_allgather(loom_comm *c, const void *send, void *recv, size_t n,
                                    loom_dtype dt, loom_comm_req **req) {
    return move(c, "allgather", recv, send, n, dt);
}

static loom_status single_broadcast(loom_comm *c, void *buf, size_t n, loom_dtype dt, int root) {
    return LOOM_OK;
}

static loom_status single_alltoall(loom_comm *c, const void *send, void *recv, size_t n,
                                   loom_dtype dt) {
    return move(c, "alltoall", recv, send, n, dt);
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
