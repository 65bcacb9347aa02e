// Row-major GEMM through cuBLASLt with loom_cpu_sgemm's semantics.
//
// Row-major C (M x N) is column-major C^T (N x M), and C^T = op(B)^T op(A)^T:
// so the column-major call is m = N, n = M, k = K with cuBLAS's "A" being our
// B (transposed when tb) and its "B" being our A (transposed when ta), all
// leading dimensions unchanged. Descriptors, layouts and the algorithm chosen
// by cublasLtMatmulAlgoGetHeuristic are cached per shape in the handle.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <stdlib.h>
#include <string.h>

#include "../backend.h"
#include "ops_common.cuh"

// cublasGemmGroupedBatchedEx: cuBLAS 12.5 and later.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
#define LOOM_GEMM_GROUPED_ONE_CALL 1
#endif

using namespace loom_cuda;

namespace {

struct gemm_key {
    int64_t M, N, K, lda, ldb, ldc;
    int32_t ta, tb, adt, cdt, beta0;
    uint32_t align_a, align_b, align_c; // bytes, of our A, B, C pointers
    int32_t any_rows; // planned for M rounded up to ROWS_STEP, run on any M up to it
};

// A plan made for M rows (rounded up to this) serves every M of its step:
// the layouts of A and C are set to the call's M before it runs.
enum { ROWS_STEP = 512 };

struct gemm_entry {
    bool used;
    gemm_key key;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc; // cuBLAS's A (our B), B (our A), C = D
    cublasLtMatmulAlgo_t algo;
};

enum { CACHE_SIZE = 1024 }; // a power of two; shapes past it are planned per call

} // namespace

struct loom_cuda_gemm_handle {
    cublasLtHandle_t lt;
    void *ws;
    size_t ws_bytes;
    gemm_entry *cache; // CACHE_SIZE entries, open addressing
    int cached;
    cublasHandle_t blas; // cuBLAS's, for the grouped GEMM (made at its first call)
    void **ptrs;         // device: the grouped call's A, B and C pointers (3 ptrs_cap)
    size_t ptrs_cap;
    void *skd;           // device: loom_cuda_gemm_skinny's group descriptors (skd_cap bytes)
    size_t skd_cap;
    bool grouped_loop; // LOOM_GEMM_GROUPED=loop: one cuBLASLt GEMM a group
    unsigned skinny;   // loom_cuda_gemm_skinny's flags (LOOM_SKINNY_MMA=0, LOOM_SKINNY_REDUCE=scalar)
};

static loom_status lt_check(loom_ctx *ctx, cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return LOOM_OK;
    return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm: %s: %s", what, cublasLtGetStatusString(s));
}

static cudaDataType_t cuda_type(loom_dtype t) {
    switch (t) {
    case LOOM_BF16: return CUDA_R_16BF;
    case LOOM_F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
    }
}

// Largest power of two (<= 256) dividing the address: what cuBLASLt may assume.
static uint32_t ptr_align(const void *p) {
    uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1))) al >>= 1;
    return al;
}

static uint64_t key_hash(const gemm_key *k) {
    const unsigned char *b = (const unsigned char *)k;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < sizeof *k; i++) h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

static void entry_destroy(gemm_entry *e) {
    if (e->lc) cublasLtMatrixLayoutDestroy(e->lc);
    if (e->lb) cublasLtMatrixLayoutDestroy(e->lb);
    if (e->la) cublasLtMatrixLayoutDestroy(e->la);
    if (e->op) cublasLtMatmulDescDestroy(e->op);
    memset(e, 0, sizeof *e);
}

extern "C" loom_status loom_cuda_gemm_create(loom_ctx *ctx, size_t workspace_bytes,
                                             loom_cuda_gemm_handle **out) {
    *out = NULL;
    loom_cuda_gemm_handle *h = (loom_cuda_gemm_handle *)calloc(1, sizeof *h);
    gemm_entry *cache = (gemm_entry *)calloc(CACHE_SIZE, sizeof(gemm_entry));
    if (!h || !cache) {
        free(h);
        free(cache);
        return loom_errf(ctx, LOOM_ERR_OOM, "cuda gemm: out of host memory for the handle");
    }
    h->cache = cache;
    h->ws_bytes = workspace_bytes ? workspace_bytes : LOOM_CUDA_GEMM_WORKSPACE_DEFAULT;
    const char *gg = getenv("LOOM_GEMM_GROUPED");
    h->grouped_loop = gg && strcmp(gg, "loop") == 0;
    const char *sm = getenv("LOOM_SKINNY_MMA"), *sr = getenv("LOOM_SKINNY_REDUCE");
    h->skinny = (sm && strcmp(sm, "0") == 0 ? 0u : LOOM_CUDA_SKINNY_MMA) |
                (sr && strcmp(sr, "scalar") == 0 ? LOOM_CUDA_SKINNY_SCALAR_REDUCE : 0u);
    loom_status st = lt_check(ctx, cublasLtCreate(&h->lt), "cublasLtCreate");
    if (st) {
        h->lt = NULL;
        loom_cuda_gemm_free(h);
        return st;
    }
    cudaError_t e = cudaMalloc(&h->ws, h->ws_bytes);
    if (e != cudaSuccess) {
        h->ws = NULL;
        loom_cuda_gemm_free(h);
        return loom_errf(ctx, e == cudaErrorMemoryAllocation ? LOOM_ERR_OOM : LOOM_ERR_DEVICE,
                         "cuda gemm: cudaMalloc of the %zu-byte workspace: %s", workspace_bytes,
                         cudaGetErrorString(e));
    }
    *out = h;
    return LOOM_OK;
}

extern "C" void loom_cuda_gemm_free(loom_cuda_gemm_handle *h) {
    if (!h) return;
    if (h->cache)
        for (int i = 0; i < CACHE_SIZE; i++)
            if (h->cache[i].used) entry_destroy(&h->cache[i]);
    free(h->cache);
    if (h->blas)
        cublasDestroy(h->blas);
    if (h->ptrs)
        cudaFree(h->ptrs);
    if (h->skd)
        cudaFree(h->skd);
    if (h->ws) cudaFree(h->ws);
    if (h->lt) cublasLtDestroy(h->lt);
    free(h);
}

extern "C" int loom_cuda_gemm_cached(const loom_cuda_gemm_handle *h) { return h ? h->cached : 0; }

// Descriptors, layouts and the heuristic's first algorithm for key k; with
// more (for loom_cuda_gemm_survey), up to `want` of its candidates there.
static loom_status plan(loom_ctx *ctx, loom_cuda_gemm_handle *h, const gemm_key *k, gemm_entry *e,
                        int want = 1, cublasLtMatmulHeuristicResult_t *more = nullptr,
                        int *nmore = nullptr) {
    memset(e, 0, sizeof *e);
    e->key = *k;
    const cublasOperation_t opa = k->tb ? CUBLAS_OP_T : CUBLAS_OP_N; // cuBLAS's A = our B
    const cublasOperation_t opb = k->ta ? CUBLAS_OP_T : CUBLAS_OP_N; // cuBLAS's B = our A
    const cudaDataType_t in = cuda_type((loom_dtype)k->adt), outt = cuda_type((loom_dtype)k->cdt);
    loom_status st;
    if ((st = lt_check(ctx, cublasLtMatmulDescCreate(&e->op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                       "cublasLtMatmulDescCreate")))
        goto fail;
    if ((st = lt_check(ctx,
                       cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa,
                                                      sizeof opa),
                       "set TRANSA")))
        goto fail;
    if ((st = lt_check(ctx,
                       cublasLtMatmulDescSetAttribute(e->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb,
                                                      sizeof opb),
                       "set TRANSB")))
        goto fail;
    // cuBLAS's A (our B) as stored: N x K col-major when !tb (row-major K x N), else K x N.
    if ((st = lt_check(ctx,
                       cublasLtMatrixLayoutCreate(&e->la, in, k->tb ? k->K : k->N,
                                                  k->tb ? k->N : k->K, k->ldb),
                       "layout of B")))
        goto fail;
    // cuBLAS's B (our A) as stored: K x M col-major when !ta (row-major M x K), else M x K.
    if ((st = lt_check(ctx,
                       cublasLtMatrixLayoutCreate(&e->lb, in, k->ta ? k->M : k->K,
                                                  k->ta ? k->K : k->M, k->lda),
                       "layout of A")))
        goto fail;
    if ((st = lt_check(ctx, cublasLtMatrixLayoutCreate(&e->lc, outt, k->N, k->M, k->ldc),
                       "layout of C")))
        goto fail;
    {
        cublasLtMatmulPreference_t pref = NULL;
        if ((st = lt_check(ctx, cublasLtMatmulPreferenceCreate(&pref), "preference")))
            goto fail;
        uint64_t ws = h->ws_bytes;
        uint32_t al_a = k->align_b, al_b = k->align_a, al_c = k->align_c;
        cublasStatus_t s = cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                     &al_a, sizeof al_a);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                     &al_b, sizeof al_b);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                     &al_c, sizeof al_c);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                     &al_c, sizeof al_c);
        cublasLtMatmulHeuristicResult_t one, *res = more ? more : &one;
        int nres = 0;
        memset(res, 0, sizeof *res * (size_t)want);
        if (s == CUBLAS_STATUS_SUCCESS)
            s = cublasLtMatmulAlgoGetHeuristic(h->lt, e->op, e->la, e->lb, e->lc, e->lc, pref, want,
                                               res, &nres);
        if (nmore) *nmore = nres;
        cublasLtMatmulPreferenceDestroy(pref);
        if ((st = lt_check(ctx, s, "cublasLtMatmulAlgoGetHeuristic"))) goto fail;
        if (nres < 1 || res[0].state != CUBLAS_STATUS_SUCCESS) {
            st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                           "cuda gemm: cuBLASLt has no algorithm for M=%lld N=%lld K=%lld "
                           "(ta=%d tb=%d lda=%lld ldb=%lld ldc=%lld, %s inputs, %s output)",
                           (long long)k->M, (long long)k->N, (long long)k->K, k->ta, k->tb,
                           (long long)k->lda, (long long)k->ldb, (long long)k->ldc,
                           loom_dtype_name((loom_dtype)k->adt), loom_dtype_name((loom_dtype)k->cdt));
            goto fail;
        }
        e->algo = res[0].algo;
    }
    e->used = true;
    return LOOM_OK;
fail:
    entry_destroy(e);
    return st;
}

// C = beta * C (K == 0: nothing to multiply). beta == 0 writes zeros.
__global__ void gemm_scale_c(void *C, loom_dtype dt, int64_t M, int64_t N, int64_t ldc, float beta) {
    const int64_t n = M * N, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        int64_t r = i / N, c = i % N, o = r * ldc + c;
        st(C, dt, o, beta == 0.0f ? 0.0f : beta * ld(C, dt, o));
    }
}

// The checks of loom_cuda_gemm and its cache key; *trivial when there is
// nothing to multiply (M or N zero, or K zero: C scaled instead).
static loom_status gemm_args(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb, int64_t M,
                             int64_t N, int64_t K, const void *A, loom_dtype a_dtype, int64_t lda,
                             const void *B, loom_dtype b_dtype, int64_t ldb, float beta, void *C,
                             loom_dtype c_dtype, int64_t ldc, gemm_key *k, bool *trivial) {
    loom_status st;
    *trivial = true;
    if (!h) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda gemm: no handle");
    if ((st = need_float(ctx, a_dtype, "gemm", "A")) || (st = need_float(ctx, b_dtype, "gemm", "B")) ||
        (st = need_float(ctx, c_dtype, "gemm", "C")))
        return st;
    if (a_dtype != b_dtype)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda gemm: A is %s but B is %s (must agree)",
                         loom_dtype_name(a_dtype), loom_dtype_name(b_dtype));
    if (c_dtype != LOOM_F32 && c_dtype != a_dtype)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "cuda gemm: C must be F32 or %s (got %s)",
                         loom_dtype_name(a_dtype), loom_dtype_name(c_dtype));
    if (M < 0 || N < 0 || K < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda gemm: negative size M=%lld N=%lld K=%lld",
                         (long long)M, (long long)N, (long long)K);
    if (M == 0 || N == 0) return LOOM_OK;
    if (ldc < N || (K > 0 && (lda < (ta ? M : K) || ldb < (tb ? K : N))))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "cuda gemm: row stride too small (M=%lld N=%lld K=%lld ta=%d tb=%d "
                         "lda=%lld ldb=%lld ldc=%lld)",
                         (long long)M, (long long)N, (long long)K, (int)ta, (int)tb, (long long)lda,
                         (long long)ldb, (long long)ldc);
    memset(k, 0, sizeof *k); // padding bytes take part in the hash and compare
    k->M = M, k->N = N, k->K = K, k->lda = lda, k->ldb = ldb, k->ldc = ldc;
    k->ta = ta, k->tb = tb, k->adt = a_dtype, k->cdt = c_dtype, k->beta0 = beta == 0.0f;
    k->align_a = ptr_align(A), k->align_b = ptr_align(B), k->align_c = ptr_align(C);
    *trivial = K == 0;
    return LOOM_OK;
}

// any_rows (our A not transposed): the plan of M rounded up to ROWS_STEP,
// its layouts set to this M (a hot expert's rows, a new count every step,
// without a plan a count: about a ms each)
static loom_status gemm_run(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb, int64_t M,
                            int64_t N, int64_t K, float alpha, const void *A, loom_dtype a_dtype,
                            int64_t lda, const void *B, loom_dtype b_dtype, int64_t ldb, float beta,
                            void *C, loom_dtype c_dtype, int64_t ldc, void *stream, bool any_rows) {
    loom_status st;
    gemm_key k;
    bool trivial;
    if ((st = gemm_args(ctx, h, ta, tb, M, N, K, A, a_dtype, lda, B, b_dtype, ldb, beta, C, c_dtype,
                        ldc, &k, &trivial)) ||
        M == 0 || N == 0)
        return st;
    if (trivial) { // K == 0
        gemm_scale_c<<<grid_for(M * N, 256), 256, 0, as_stream(stream)>>>(C, c_dtype, M, N, ldc, beta);
        return check_launch(ctx, "gemm");
    }
    any_rows = any_rows && !ta && M % ROWS_STEP;
    if (any_rows) {
        k.M = (M + ROWS_STEP - 1) / ROWS_STEP * ROWS_STEP;
        k.any_rows = 1;
    }
    gemm_entry tmp, *e = NULL;
    uint64_t hs = key_hash(&k);
    for (int probe = 0; probe < CACHE_SIZE; probe++) {
        gemm_entry *c = &h->cache[(hs + (uint64_t)probe) & (CACHE_SIZE - 1)];
        if (!c->used) { // not cached: plan into this free slot (or a temporary when full)
            if (h->cached >= CACHE_SIZE / 2) break;
            if ((st = plan(ctx, h, &k, c))) return st;
            h->cached++;
            e = c;
            break;
        }
        if (memcmp(&c->key, &k, sizeof k) == 0) {
            e = c;
            break;
        }
    }
    bool temporary = false;
    if (!e) {
        if ((st = plan(ctx, h, &k, &tmp))) return st;
        e = &tmp;
        temporary = true;
    }
    if (any_rows) { // our A is K x M col-major to cuBLAS (!ta), C N x M
        const uint64_t cols = (uint64_t)M;
        cublasStatus_t a = cublasLtMatrixLayoutSetAttribute(e->lb, CUBLASLT_MATRIX_LAYOUT_COLS,
                                                            &cols, sizeof cols);
        if (a == CUBLAS_STATUS_SUCCESS)
            a = cublasLtMatrixLayoutSetAttribute(e->lc, CUBLASLT_MATRIX_LAYOUT_COLS, &cols,
                                                 sizeof cols);
        if ((st = lt_check(ctx, a, "set the rows of a reused plan"))) {
            if (temporary) entry_destroy(&tmp);
            return st;
        }
    }
    cublasStatus_t s = cublasLtMatmul(h->lt, e->op, &alpha, B, e->la, A, e->lb, &beta, C, e->lc, C,
                                      e->lc, &e->algo, h->ws, h->ws_bytes, as_stream(stream));
    if (temporary) entry_destroy(&tmp);
    if (any_rows && s == CUBLAS_STATUS_NOT_SUPPORTED) // that algorithm not for these rows
        return gemm_run(ctx, h, ta, tb, M, N, K, alpha, A, a_dtype, lda, B, b_dtype, ldb, beta, C,
                        c_dtype, ldc, stream, false);
    if (s != CUBLAS_STATUS_SUCCESS)
        return loom_errf(ctx, LOOM_ERR_DEVICE,
                         "cuda gemm: cublasLtMatmul (M=%lld N=%lld K=%lld ta=%d tb=%d, %s): %s",
                         (long long)M, (long long)N, (long long)K, (int)ta, (int)tb,
                         loom_dtype_name(a_dtype), cublasLtGetStatusString(s));
    return check_launch(ctx, "gemm");
}

extern "C" loom_status loom_cuda_gemm(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb,
                                      int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                                      loom_dtype a_dtype, int64_t lda, const void *B,
                                      loom_dtype b_dtype, int64_t ldb, float beta, void *C,
                                      loom_dtype c_dtype, int64_t ldc, void *stream) {
    return gemm_run(ctx, h, ta, tb, M, N, K, alpha, A, a_dtype, lda, B, b_dtype, ldb, beta, C,
                    c_dtype, ldc, stream, false);
}

// How many memset nodes one call with algo puts in a stream capture (-1:
// the capture failed). The C it would write is not touched: nothing runs.
static int count_memsets(loom_cuda_gemm_handle *h, const gemm_entry *e, const cublasLtMatmulAlgo_t *algo,
                         const void *A, const void *B, float beta, void *C) {
    cudaStream_t s = nullptr;
    cudaGraph_t g = nullptr;
    const float alpha = 1.0f;
    int sets = -1;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return -1;
    if (cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
        cublasStatus_t r = cublasLtMatmul(h->lt, e->op, &alpha, B, e->la, A, e->lb, &beta, C, e->lc,
                                          C, e->lc, algo, h->ws, h->ws_bytes, s);
        if (cudaStreamEndCapture(s, &g) == cudaSuccess && g && r == CUBLAS_STATUS_SUCCESS) {
            size_t n = 0;
            cudaGraphGetNodes(g, nullptr, &n);
            cudaGraphNode_t *nodes = (cudaGraphNode_t *)calloc(n ? n : 1, sizeof *nodes);
            if (nodes && cudaGraphGetNodes(g, nodes, &n) == cudaSuccess) {
                sets = 0;
                for (size_t i = 0; i < n; i++) {
                    cudaGraphNodeType t;
                    if (cudaGraphNodeGetType(nodes[i], &t) == cudaSuccess && t == cudaGraphNodeTypeMemset)
                        sets++;
                }
            }
            free(nodes);
        }
        if (g) cudaGraphDestroy(g);
    }
    cudaGetLastError();
    cudaStreamDestroy(s);
    return sets;
}

extern "C" loom_status loom_cuda_gemm_survey(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta,
                                             bool tb, int64_t M, int64_t N, int64_t K, const void *A,
                                             loom_dtype a_dtype, int64_t lda, const void *B,
                                             int64_t ldb, float beta, void *C, loom_dtype c_dtype,
                                             int64_t ldc, int max_algos, int reps, float *ms,
                                             int *sets, int *n) {
    loom_status st;
    gemm_key k;
    bool trivial;
    *n = 0;
    if ((st = gemm_args(ctx, h, ta, tb, M, N, K, A, a_dtype, lda, B, a_dtype, ldb, beta, C, c_dtype,
                        ldc, &k, &trivial)))
        return st;
    if (trivial || max_algos < 1 || reps < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda gemm_survey: nothing to time");
    cublasLtMatmulHeuristicResult_t *res =
        (cublasLtMatmulHeuristicResult_t *)calloc((size_t)max_algos, sizeof *res);
    if (!res) return loom_errf(ctx, LOOM_ERR_OOM, "cuda gemm_survey: no memory");
    gemm_entry e;
    int nres = 0;
    cudaEvent_t a = nullptr, b = nullptr;
    const float alpha = 1.0f;
    if ((st = plan(ctx, h, &k, &e, max_algos, res, &nres))) {
        free(res);
        return st;
    }
    st = check(ctx, cudaEventCreate(&a), "gemm_survey");
    if (!st) st = check(ctx, cudaEventCreate(&b), "gemm_survey");
    for (int i = 0; i < nres && !st; i++) {
        ms[i] = -1.0f; // a candidate that fails to run
        if (sets) sets[i] = -1;
        if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
        bool ok = cublasLtMatmul(h->lt, e.op, &alpha, B, e.la, A, e.lb, &beta, C, e.lc, C, e.lc,
                                 &res[i].algo, h->ws, h->ws_bytes, 0) == CUBLAS_STATUS_SUCCESS;
        cudaEventRecord(a, 0);
        for (int r = 0; r < reps && ok; r++)
            ok = cublasLtMatmul(h->lt, e.op, &alpha, B, e.la, A, e.lb, &beta, C, e.lc, C, e.lc,
                                &res[i].algo, h->ws, h->ws_bytes, 0) == CUBLAS_STATUS_SUCCESS;
        cudaEventRecord(b, 0);
        float t = 0;
        if ((st = check(ctx, cudaEventSynchronize(b), "gemm_survey"))) break;
        cudaEventElapsedTime(&t, a, b);
        if (ok) ms[i] = t / (float)reps;
        if (sets && ok) sets[i] = count_memsets(h, &e, &res[i].algo, A, B, beta, C);
    }
    if (!st) *n = nres;
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
    entry_destroy(&e);
    free(res);
    return st;
}

// ---- grouped GEMMs ----

// The groups with work (M, N and K all > 0) as one cublasGemmGroupedBatchedEx
// call, each group its own cuBLAS group of one GEMM, in the row-major to
// column-major mapping of loom_cuda_gemm (cuBLAS's A is our B, its m our N).
// The sizes, leading dimensions, transposes, alpha and beta are host arrays;
// the A, B and C pointers are read by the device: they are copied (in stream
// order) into the handle's pointer array first. cuBLAS decides how many
// kernels that is. *done false, nothing computed, when cuBLAS says it does not
// support the call (the caller then loops).
static loom_status gemm_grouped_call(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta, bool tb,
                                     int G, const loom_gemm_group *g, int64_t work, float alpha,
                                     int64_t lda, int64_t ldb, loom_dtype ab, float beta,
                                     loom_dtype cdt, int64_t ldc, void *stream, bool *done) {
    *done = false;
#ifdef LOOM_GEMM_GROUPED_ONE_CALL
    cublasStatus_t r;
    if (!h->blas) {
        cublasHandle_t b = NULL;
        if ((r = cublasCreate(&b)) != CUBLAS_STATUS_SUCCESS)
            return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm_grouped: cublasCreate: %s",
                             cublasGetStatusString(r));
        h->blas = b;
        if ((r = cublasSetPointerMode(b, CUBLAS_POINTER_MODE_HOST)) != CUBLAS_STATUS_SUCCESS)
            return loom_errf(ctx, LOOM_ERR_DEVICE, "cuda gemm_grouped: cublasSetPointerMode: %s",
                             cublasGetStatusString(r));
    }
    const size_t n = (size_t)work;
    if (n > h->ptrs_cap) { // grown to whole 64s of groups
        if (h->ptrs)
            cudaFree(h->ptrs);
        h->ptrs = NULL;
        h->ptrs_cap = 0;
        const size_t cap = (n + 63) / 64 * 64;
        cudaError_t e = cudaMalloc((void **)&h->ptrs, 3 * cap * sizeof(void *));
        if (e != cudaSuccess) {
            h->ptrs = NULL;
            return loom_errf(ctx, e == cudaErrorMemoryAllocation ? LOOM_ERR_OOM : LOOM_ERR_DEVICE,
                             "cuda gemm_grouped: cudaMalloc of the pointer array: %s",
                             cudaGetErrorString(e));
        }
        h->ptrs_cap = cap;
    }
    // one host block: the 3n pointers (as the device array), 7n sizes, 2n
    // scales, 2n transposes
    char *mem = (char *)malloc(n * (3 * sizeof(void *) + 7 * sizeof(int64_t) + 2 * sizeof(float) +
                                    2 * sizeof(cublasOperation_t)));
    if (!mem)
        return loom_errf(ctx, LOOM_ERR_OOM, "cuda gemm_grouped: out of host memory");
    void **hp = (void **)mem;
    int64_t *m = (int64_t *)(hp + 3 * n), *nn = m + n, *kk = nn + n, *la = kk + n, *lb = la + n,
            *lc = lb + n, *gs = lc + n;
    float *al = (float *)(gs + n), *be = al + n;
    cublasOperation_t *opa = (cublasOperation_t *)(be + n), *opb = opa + n;
    size_t w = 0;
    for (int i = 0; i < G; i++) {
        if (!g[i].M || !g[i].N || !g[i].K)
            continue;
        hp[w] = (void *)g[i].B; // cuBLAS's A
        hp[n + w] = (void *)g[i].A;
        hp[2 * n + w] = g[i].C;
        m[w] = g[i].N, nn[w] = g[i].M, kk[w] = g[i].K;
        la[w] = ldb, lb[w] = lda, lc[w] = ldc, gs[w] = 1;
        al[w] = alpha, be[w] = beta;
        opa[w] = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
        opb[w] = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
        w++;
    }
    const cudaStream_t s = as_stream(stream);
    // pageable source: staged before the call returns, so freed below at once
    loom_status st =
        check(ctx, cudaMemcpyAsync(h->ptrs, hp, 3 * n * sizeof(void *), cudaMemcpyHostToDevice, s),
              "gemm_grouped (pointer upload)");
    const cudaDataType_t t = cuda_type(ab), tc = cuda_type(cdt);
    r = CUBLAS_STATUS_SUCCESS;
    if (!st)
        r = cublasSetStream(h->blas, s); // (resets the workspace: set after it)
    if (!st && r == CUBLAS_STATUS_SUCCESS)
        r = cublasSetWorkspace(h->blas, h->ws, h->ws_bytes);
    if (!st && r == CUBLAS_STATUS_SUCCESS)
        r = cublasGemmGroupedBatchedEx_64(
            h->blas, opa, opb, m, nn, kk, al, (const void *const *)h->ptrs, t, la,
            (const void *const *)(h->ptrs + n), t, lb, be, h->ptrs + 2 * n, tc, lc, (int64_t)n, gs,
            CUBLAS_COMPUTE_32F);
    free(mem);
    if (st || r == CUBLAS_STATUS_NOT_SUPPORTED)
        return st;
    if (r != CUBLAS_STATUS_SUCCESS)
        return loom_errf(ctx, LOOM_ERR_DEVICE,
                         "cuda gemm_grouped: cublasGemmGroupedBatchedEx (%lld groups, ta=%d "
                         "tb=%d, %s): %s",
                         (long long)n, (int)ta, (int)tb, loom_dtype_name(ab),
                         cublasGetStatusString(r));
    *done = true;
    return check_launch(ctx, "gemm_grouped");
#else
    (void)ctx, (void)h, (void)ta, (void)tb, (void)G, (void)g, (void)work, (void)alpha, (void)lda,
        (void)ldb, (void)ab, (void)beta, (void)cdt, (void)ldc, (void)stream;
    return LOOM_OK;
#endif
}

// Every group's arguments are checked first (as loom_cuda_gemm's). The
// groups with work go to one cuBLAS call where there are two or more and
// their pointers are 16-byte aligned (C in the inputs' dtype, or fp32: the
// experts' LoRA weight gradients, 2 x 128 GEMMs a projection of Qwen3-30B-A3B
// that a loop ran at 1/14 of the speed of the rest of the step on an H200);
// otherwise, and when cuBLAS refuses the types, one loom_cuda_gemm each. Groups with K 0 are loom_cuda_gemm's (C = beta C, zeros for beta 0;
// nothing for beta 1, as the CPU).
extern "C" loom_status loom_cuda_gemm_grouped(loom_ctx *ctx, loom_cuda_gemm_handle *h, bool ta,
                                              bool tb, int G, const loom_gemm_group *g, float alpha,
                                              int64_t lda, int64_t ldb, loom_dtype ab, float beta,
                                              loom_dtype cdt, int64_t ldc, void *stream) {
    if (!h)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda gemm_grouped: no handle");
    if (G < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "cuda gemm_grouped: %d groups", G);
    loom_status st;
    int64_t work = 0;
    bool aligned = true; // every pointer 16-byte aligned: what cuBLAS's grouped GEMM asks of
                         // 16-bit matrices (the loop's cuBLASLt plans take any alignment)
    for (int i = 0; i < G; i++) {
        gemm_key k;
        bool trivial;
        if ((st = gemm_args(ctx, h, ta, tb, g[i].M, g[i].N, g[i].K, g[i].A, ab, lda, g[i].B, ab,
                            ldb, beta, g[i].C, cdt, ldc, &k, &trivial)))
            return st;
        if (!g[i].M || !g[i].N || !g[i].K)
            continue;
        work++;
        aligned =
            aligned && (((uintptr_t)g[i].A | (uintptr_t)g[i].B | (uintptr_t)g[i].C) & 15) == 0;
    }
    // A group of LOOM_CUDA_GROUP_ALONE_ROWS rows or more (a hot expert: random
    // weights send a layer's tokens to 8 of 128) runs alone, all its rows:
    // cuBLASLt's sm90 kernels take them at about twice the rate of cuBLAS's
    // grouped sm80 kernel. Its plan is the one of its rows rounded up to
    // ROWS_STEP (gemm_run's any_rows), so that the plans cached stay few
    // (a plan made per call costs about a ms).
    bool alone = false;
    for (int i = 0; i < G && !ta; i++)
        alone = alone || (g[i].M >= LOOM_CUDA_GROUP_ALONE_ROWS && g[i].N >= 256 && g[i].K >= 256);
    if (alone) {
        loom_gemm_group *rest = (loom_gemm_group *)malloc((size_t)G * sizeof *rest);
        if (!rest)
            return loom_errf(ctx, LOOM_ERR_OOM, "cuda gemm_grouped: out of host memory");
        st = LOOM_OK;
        for (int i = 0; i < G && !st; i++) {
            rest[i] = g[i];
            if (!(g[i].M >= LOOM_CUDA_GROUP_ALONE_ROWS && g[i].N >= 256 && g[i].K >= 256))
                continue;
            st = gemm_run(ctx, h, ta, tb, g[i].M, g[i].N, g[i].K, alpha, g[i].A, ab, lda, g[i].B,
                          ab, ldb, beta, g[i].C, cdt, ldc, stream, true);
            rest[i].M = 0; /* done: the rest's call passes over it */
        }
        if (!st)
            st = loom_cuda_gemm_grouped(ctx, h, ta, tb, G, rest, alpha, lda, ldb, ab, beta, cdt,
                                        ldc, stream);
        free(rest);
        return st;
    }
    bool one = false;
    if (!h->grouped_loop && work > 0) { // LoRA's skinny shapes: one launch of loom's own
        const size_t need = (size_t)G * LOOM_CUDA_SKINNY_DESC_BYTES;
        if (need > h->skd_cap) {
            if (h->skd)
                cudaFree(h->skd);
            h->skd = NULL;
            h->skd_cap = 0;
            const size_t cap = (need + 4095) / 4096 * 4096;
            cudaError_t e = cudaMalloc(&h->skd, cap);
            if (e != cudaSuccess) {
                h->skd = NULL;
                return loom_errf(ctx, e == cudaErrorMemoryAllocation ? LOOM_ERR_OOM : LOOM_ERR_DEVICE,
                                 "cuda gemm_grouped: cudaMalloc of the descriptors: %s",
                                 cudaGetErrorString(e));
            }
            h->skd_cap = cap;
        }
        if ((st = loom_cuda_gemm_skinny(ctx, ta, tb, G, g, alpha, lda, ldb, ab, beta, cdt, ldc,
                                        h->skd, h->skd_cap, h->ws, h->ws_bytes, h->skinny,
                                        stream, &one)))
            return st;
    }
    if (!one && !h->grouped_loop && (cdt == ab || cdt == LOOM_F32) && work > 1 && aligned &&
        (st = gemm_grouped_call(ctx, h, ta, tb, G, g, work, alpha, lda, ldb, ab, beta, cdt, ldc,
                                stream, &one)))
        return st;
    for (int i = 0; i < G; i++) {
        if (!g[i].M || !g[i].N || (g[i].K ? one : beta == 1.0f))
            continue;
        if ((st = loom_cuda_gemm(ctx, h, ta, tb, g[i].M, g[i].N, g[i].K, alpha, g[i].A, ab, lda,
                                 g[i].B, ab, ldb, beta, g[i].C, cdt, ldc, stream)))
            return st;
    }
    return LOOM_OK;
}
