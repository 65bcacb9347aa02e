/* What this build of loom has: include/loom.h's loom_features and
 * loom_gpu_count, for callers (the Python package) that choose a device. */
#include "core.h"

#ifdef LOOM_HAVE_CUDA
#include "../backend/cuda/cuda_backend.h"
#endif

const char *loom_features(void) {
    return "cpu"
#ifdef _OPENMP
           " openmp"
#endif
#ifdef LOOM_HAVE_BLAS
           " blas"
#endif
#ifdef LOOM_HAVE_MPI
           " mpi"
#endif
#ifdef LOOM_HAVE_GLOO
           " gloo"
#endif
#ifdef LOOM_HAVE_CUDA
           " cuda"
#endif
        ;
}

int loom_gpu_count(void) {
#ifdef LOOM_HAVE_CUDA
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_cuda_info info;
    int n = loom_cuda_query(ctx, 0, &info) == LOOM_OK ? info.device_count : 0;
    loom_ctx_free(ctx);
    return n;
#else
    return 0;
#endif
}
