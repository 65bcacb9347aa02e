/* What this build of loom has: include/loom.h's loom_features and
 * loom_gpu_count, for callers (the Python package) that choose a device. */
#include "core.h"

#ifdef LOOM_HAVE_CUDA
#include <cuda_runtime_api.h>
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
    int n = 0; /* the runtime alone: src/core links without the CUDA backend's kernels */
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
    return 0;
#endif
}
