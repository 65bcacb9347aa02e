/* The backends built into this loom (backend.h). */
#include "backend.h"

#include <stdlib.h>

#include "../core/core.h"
#ifdef LOOM_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

#ifndef LOOM_HAVE_CUDA
const loom_backend *loom_backend_cuda(void) { return NULL; }
#endif

const loom_backend *loom_backend_for(loom_ctx *ctx, bool cuda) {
    const loom_backend *be = cuda ? loom_backend_cuda() : loom_backend_cpu();
    if (!be)
        loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                  "this loom was built without CUDA, so it cannot run on GPUs; rebuild with "
                  "`make CUDA=1`, or run on the CPU (--device cpu)");
    return be;
}

void loom_backend_host_free(void *p, bool pinned) {
#ifdef LOOM_HAVE_CUDA
    if (pinned) {
        loom_cuda_host_free(p);
        return;
    }
#endif
    (void)pinned;
    free(p);
}
