/* The backend table (ggml's seam): the ops of one kind of device, chosen
 * once when a model is placed on its device (loom_backend_for). The CPU is
 * a backend like any other (src/backend/cpu/backend_cpu.c); CUDA is
 * src/backend/cuda/backend_cuda.c. Each op takes the device's state (loom_dev)
 * and the context its errors go to; src/model/kern.c is the model's thin
 * layer over it (the gradient bookkeeping, then the table's op).
 *
 * Every op of the model is here: the device's set-up and its memory, the
 * GEMMs (with the fused LoRA and input-gradient paths a device may have),
 * the element-wise ops, RMSNorm, RoPE and attention, the vocabulary-parallel
 * loss's pieces and the optimizer's passes. Semantics are the CPU
 * reference's (cpu_ops.h, cpu_glue.h, adamw.h); tests/test_backend.c checks
 * every backend against it. */
#ifndef LOOM_BACKEND_H
#define LOOM_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "adamw.h"
#include "loom.h"

struct loom_cuda_gemm_handle;
struct loom_cuda_attn_handle;

typedef struct loom_dev {
    const struct loom_backend *be; /* the ops of this device (loom_backend_for) */
    bool cuda;
    int device;               /* CUDA device of this process, -1 on CPU */
    loom_dtype adt;           /* compute dtype */
    size_t esz;               /* its size in bytes */
    void *stream;             /* cudaStream_t (NULL: legacy default) */
    struct loom_cuda_gemm_handle *gemm;
    struct loom_cuda_attn_handle *attn; /* cuDNN's fused attention; NULL: loom's kernels only
                                           (LOOM_ATTN=loom or LOOM_ATTN_DETERMINISTIC=1) */
    long long attn_calls[2];  /* GPU attention forwards and backwards run */
    double *sumsq_scratch;    /* device: the grad-norm reduction's block partials */
    void *rms_scratch;        /* device: RMSNorm backward's dw partials */
    size_t rms_scratch_bytes;
    struct loom_cuda_dw_batch *dw_batch; /* the layers' norm weight gradients, added at
                                            loom_k_dw_flush (made at the first use) */
    void *lora_scratch;       /* device: the LoRA pass kernels' partial sums */
    size_t lora_scratch_bytes;
    void *moe_scratch; /* device: the MoE router's column sums, route's chunk counts */
    size_t moe_scratch_bytes;
    void *gdn_scratch; /* device: Gated DeltaNet's workspace (cuda_ops.h's *_scratch_bytes) */
    size_t gdn_scratch_bytes;
    bool lora_cublas;         /* LOOM_LORA_KERNELS=cublas: LoRA's forward and backward, and the
                                 input gradients' sums, on cuBLASLt (no GEMM of loom's own) */
    size_t used0;             /* GPU memory in use when the model was created */
    size_t peak;              /* most in use since, above used0 (sampled at each allocation) */
    size_t own, own_peak;     /* bytes of alloc's buffers (the model's) in use now, at most */
    struct loom_dev_buf *bufs; /* their sizes by address (free takes none); NULL on the CPU */
    int nbufs, cap_bufs;
    size_t gpu_total;
    void *marks; /* the timeline's marks (mark): CUDA events, or the host's times; NULL until
                    the first */
} loom_dev;

/* Marks a step's timeline holds before it is read out (loom_prof). */
#define LOOM_MARKS_MAX 4096

/* One term of an input gradient: dy (T, out; ld) times W (out, in). */
typedef struct loom_dx_term {
    const void *dy;
    int64_t ld, out;
    const void *W;
} loom_dx_term;

/* LoRA's backward over one projection's output gradient dy (T, out) (see
 * lora_dy_n). */
typedef struct loom_lora_dy_op {
    int64_t out;
    const void *dy, *B, *u;
    void *du;
    float *dB;
} loom_lora_dy_op;

/* One GEMM of a grouped call (gemm_grouped). */
typedef struct loom_gemm_group {
    const void *A, *B;
    void *C;
    int64_t M, N, K;
} loom_gemm_group;

/* One part of the optimizer's work: `len` parameters at w + p_off whose
 * gradient and moments are at shard offset s_off. */
typedef struct loom_k_part {
    size_t p_off, s_off, len;
    bool decay;   /* AdamW weight decay applies */
    bool norm;    /* counts in the gradient norm */
} loom_k_part;

/* What a backend keeps of a list of parts between calls (the layout never
 * changes): a GPU's chunk lists in device memory, made at the first use.
 * Zeroed at creation, released with lists_free; one per kind of call (the
 * optimizer's, zero_parts'). */
typedef struct loom_part_lists {
    void *chunks;            /* the parts' chunks (n), then those in the norm (n_norm) */
    int64_t n, n_norm;
    double *norm;            /* per-chunk sums of squares (n_norm) */
} loom_part_lists;

typedef struct loom_backend {
    const char *name;
    /* Sets up d (d->adt, d->esz, d->device set): handles, scratch buffers,
     * the memory in use now; release frees them. */
    loom_status (*init)(loom_dev *d, loom_ctx *ctx);
    void (*release)(loom_dev *d);
    /* Which kernels ran the attention, in words. */
    void (*attn_note)(const loom_dev *d, char *buf, size_t n);
    /* Device memory, zeroed (the peak in use updated); free takes NULL. */
    loom_status (*alloc)(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes, const char *what);
    void (*free)(loom_dev *d, void *p);
    /* Host memory for copies to and from the device: page-locked where the
     * device has such (*pinned set), else malloc's. */
    loom_status (*host_alloc)(loom_dev *d, loom_ctx *ctx, void **p, size_t bytes, bool *pinned,
                              const char *what);
    /* In stream order (copy, zero) or returning when the data is there
     * (download, upload); bytes > 0 and distinct pointers (the caller
     * checks). */
    loom_status (*copy)(loom_dev *d, loom_ctx *ctx, void *dst, const void *src, size_t bytes);
    /* rows of `width` bytes from src (a row every lds bytes) to dst (every
     * ldd bytes), in stream order; the ranges do not overlap (Qwen3.5's
     * q_proj output split into each head's query and gate, and back) */
    loom_status (*copy2d)(loom_dev *d, loom_ctx *ctx, void *dst, size_t ldd, const void *src,
                          size_t lds, size_t width, size_t rows);
    loom_status (*zero)(loom_dev *d, loom_ctx *ctx, void *p, size_t bytes);
    loom_status (*download)(loom_dev *d, loom_ctx *ctx, void *host, const void *dev,
                            size_t bytes);
    loom_status (*upload)(loom_dev *d, loom_ctx *ctx, void *dev, const void *host, size_t bytes);
    /* dst[i] = src[i] between F32, BF16 and F16 (n elements, on the device). */
    loom_status (*convert)(loom_dev *d, loom_ctx *ctx, void *dst, loom_dtype dt, const void *src,
                           loom_dtype sdt, size_t n);
    /* The step's timeline (--profile): mark i (0 <= i < LOOM_MARKS_MAX)
     * notes when the device reaches this point of its queue (the CPU: when
     * the host does, its ops being done by then); marks_ms waits for mark
     * n - 1 and gives ms[i] = the time from mark i to mark i + 1, i < n - 1. */
    loom_status (*mark)(loom_dev *d, loom_ctx *ctx, int i);
    loom_status (*marks_ms)(loom_dev *d, loom_ctx *ctx, int n, double *ms);

    /* ---- element-wise, on activations in d->adt (fp32 gradients of
     * parameters); the semantics are the CPU reference's (cpu_ops.h,
     * cpu_glue.h) ---- */
    /* h = silu(g) * u over n; its backward into dg, du */
    loom_status (*swiglu_fwd)(loom_dev *d, loom_ctx *ctx, const void *g, const void *u, int64_t n,
                              void *h);
    loom_status (*swiglu_bwd)(loom_dev *d, loom_ctx *ctx, const void *dh, const void *g,
                              const void *u, int64_t n, void *dg, void *du);
    /* y = o * sigmoid(g) over n (Qwen3.5's gated attention); its backward
     * into do_ (may alias dy) and dg (may alias g) */
    loom_status (*gate_fwd)(loom_dev *d, loom_ctx *ctx, const void *o, const void *g, int64_t n,
                            void *y);
    loom_status (*gate_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, const void *o,
                            const void *g, int64_t n, void *do_, void *dg);
    /* y += x over n */
    loom_status (*add)(loom_dev *d, loom_ctx *ctx, void *y, const void *x, int64_t n);
    /* y (T, N) += b (N); db (N, fp32) += the column sums of dy (T, N) */
    loom_status (*bias_fwd)(loom_dev *d, loom_ctx *ctx, void *y, const void *b, int64_t T,
                            int64_t N);
    loom_status (*bias_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, int64_t T, int64_t N,
                            float *db);
    /* The vocabulary-parallel embedding: rows [row0, row0 + rows) of W (.., H)
     * (cpu_glue.h's loom_cpu_embedding_vp_fwd / _bwd; dW fp32) */
    loom_status (*embed_fwd)(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                             const void *W, int64_t row0, int64_t rows, int64_t H, void *out);
    loom_status (*embed_bwd)(loom_dev *d, loom_ctx *ctx, const int32_t *ids, int64_t T,
                             const void *dout, int64_t row0, int64_t rows, int64_t H, float *dW);
    /* Rows of width elements of d->esz bytes: dst[i] = src[idx[i]] (gather),
     * dst[idx[i]] = src[i] (scatter), i < n: context parallelism's orders */
    loom_status (*rows_gather)(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                               const int32_t *idx, int64_t n, int64_t width);
    loom_status (*rows_scatter)(loom_dev *d, loom_ctx *ctx, void *dst, const void *src,
                                const int32_t *idx, int64_t n, int64_t width);
    /* LoRA's dropout mask on x (cpu_glue.h's loom_cpu_lora_dropout) */
    loom_status (*dropout)(loom_dev *d, loom_ctx *ctx, void *out, const void *x, int64_t T,
                           int64_t in, int64_t full, int64_t col0, const int32_t *qidx,
                           int64_t out0, uint64_t seed, uint64_t key, double p);
    /* x (n, adt) = loom_rng_gauss4_at(base, i) rounded to adt: bit for bit
     * the same on every backend (the MoE router's forced balance) */
    loom_status (*fill_randn)(loom_dev *d, loom_ctx *ctx, void *x, int64_t n, uint64_t base);

    /* ---- RMSNorm over N rows of H (cpu_ops.h's loom_cpu_rmsnorm_*; rstd
     * and dw fp32, dw added to); the weight is woff + w (woff 1: zero-centred
     * weights, Qwen3.5's; 0 otherwise), formed in fp32 ---- */
    loom_status (*rmsnorm_fwd)(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                               float woff, int64_t N, int64_t H, float eps, void *y, float *rstd);
    loom_status (*rmsnorm_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                               const void *w, float woff, const float *rstd, int64_t N, int64_t H,
                               void *dx, float *dw);
    /* xsum = x + res (xsum may be x), then rmsnorm_fwd of xsum */
    loom_status (*add_rmsnorm_fwd)(loom_dev *d, loom_ctx *ctx, void *x, const void *res,
                                   void *xsum, const void *w, float woff, int64_t N, int64_t H,
                                   float eps, void *y, float *rstd);
    /* dx += rmsnorm_bwd's input gradient (dy may be used as scratch) */
    loom_status (*rmsnorm_bwd_add)(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                   const void *w, float woff, const float *rstd, int64_t N,
                                   int64_t H, void *dx, float *dw);
    /* dw of the norms may be added late (a GPU batches them): flush adds
     * them now, drop forgets them (the gradients were cleared) */
    loom_status (*dw_flush)(loom_dev *d, loom_ctx *ctx);
    void (*dw_drop)(loom_dev *d);

    /* ---- GEMMs: C = alpha op(A) op(B) + beta C, row-major with leading
     * dimensions; A and B in dtype ab (d->adt, or F32), C in cdt (ab, or
     * F32 for accumulated gradients) ---- */
    loom_status (*gemm)(loom_dev *d, loom_ctx *ctx, bool ta, bool tb, int64_t M, int64_t N,
                        int64_t K, float alpha, const void *A, int64_t lda, const void *B,
                        int64_t ldb, loom_dtype ab, float beta, void *C, loom_dtype cdt,
                        int64_t ldc);
    /* dx (T, in) = the sum of the n terms' dy W + beta dx (a device may add
     * several terms in one GEMM) */
    loom_status (*dx_sum)(loom_dev *d, loom_ctx *ctx, int64_t T, int64_t in, int n,
                          const loom_dx_term *t, float beta, void *dx);
    /* y (T, out) = x W^T + s u B^T as one GEMM where the device has such a
     * kernel; *done false (nothing written) where not: the caller runs the
     * pair */
    loom_status (*lin_lora_fwd)(loom_dev *d, loom_ctx *ctx, const void *x, int64_t T, int64_t in,
                                const void *W, int64_t out, const void *u, int64_t ldu,
                                const void *B, int64_t r, float s, void *y, bool *done);
    /* per op: du (T, r; lddu) = s dy B, dB (out, r; fp32) += s dy^T u (u: T,
     * r; ldu), n <= 3 ops of T rows */
    loom_status (*lora_dy_n)(loom_dev *d, loom_ctx *ctx, int64_t T, int64_t r, float s, int n,
                             const loom_lora_dy_op *ops, int64_t ldu, int64_t lddu);

    /* ---- RoPE and attention; x (T, nh, D), positions pos (T), the first
     * rd dimensions of a head turned (rd < D: a partial rotary factor),
     * inv_freq (rd/2) ---- */
    loom_status (*rope)(loom_dev *d, loom_ctx *ctx, bool backward, void *x, int64_t T, int64_t nh,
                        int64_t D, int64_t rd, const int32_t *pos, const float *inv_freq);
    /* the (cos, sin) table (T, D/2 pairs) qknorm_rope may read; nothing when
     * table is NULL (a backend without the fused kernel allocates none) */
    loom_status (*rope_table)(loom_dev *d, loom_ctx *ctx, const int32_t *pos, int64_t T, int64_t D,
                              const float *inv_freq, float *table);
    /* y = rope(rmsnorm(x)) per head (Qwen3's q and k norms); the backward in
     * place on dy, dw (D, fp32) added to; table may be NULL (and is not
     * read when rd < D) */
    loom_status (*qknorm_rope_fwd)(loom_dev *d, loom_ctx *ctx, const void *x, const void *w,
                                   float woff, int64_t T, int64_t nh, int64_t D, int64_t rd,
                                   float eps, const int32_t *pos, const float *inv_freq,
                                   const float *table, void *y, float *rstd);
    loom_status (*qknorm_rope_bwd)(loom_dev *d, loom_ctx *ctx, void *dy, const void *x,
                                   const void *w, float woff, const float *rstd, int64_t T,
                                   int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                                   const float *inv_freq, const float *table, float *dw);
    /* causal GQA attention over documents cu (ndocs+1) of the T keys, for
     * the Tq queries at global positions qidx (NULL: all T); seqlen: every
     * document's length when all are equal, else 0 (cpu_ops.h) */
    loom_status (*attn_fwd)(loom_dev *d, loom_ctx *ctx, const void *q, const int32_t *qidx,
                            int64_t Tq, const void *k, const void *v, int64_t T, int64_t Hq,
                            int64_t Hkv, int64_t D, const int32_t *cu, int64_t ndocs,
                            int64_t seqlen, float scale, void *out, float *lse);
    loom_status (*attn_bwd)(loom_dev *d, loom_ctx *ctx, const void *dout, const void *q,
                            const int32_t *qidx, int64_t Tq, const void *k, const void *v,
                            const void *out, const float *lse, int64_t T, int64_t Hq, int64_t Hkv,
                            int64_t D, const int32_t *cu, int64_t ndocs, int64_t seqlen,
                            float scale, void *dq, void *dk, void *dv);
    /* the largest head_dim attn_fwd takes */
    int attn_max_d;

    /* ---- the vocabulary-parallel cross-entropy on c rows of logits z (ld
     * apart, nvalid real columns; cpu_glue.h's loom_cpu_ce_vp_*) ---- */
    loom_status (*ce_max)(loom_dev *d, loom_ctx *ctx, const void *z, int64_t c, int64_t ld,
                          int64_t nvalid, double *mx);
    loom_status (*ce_sums)(loom_dev *d, loom_ctx *ctx, const void *z, int64_t c, int64_t ld,
                           int64_t nvalid, const int32_t *tgt, int64_t v0, const double *mx,
                           double *ce);
    loom_status (*ce_grad)(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                           int64_t nvalid, const int32_t *tgt, int64_t v0, const double *mx,
                           const double *ce, float scale);
    /* z[r, j] *= w[r] over c rows of ld (w fp32): per-token loss weights */
    loom_status (*rows_scale)(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                              const float *w);
    /* the three in one pass where the row is the whole vocabulary */
    loom_status (*ce_fused)(loom_dev *d, loom_ctx *ctx, void *z, int64_t c, int64_t ld,
                            int64_t nvalid, const int32_t *tgt, int64_t v0, double *mx,
                            double *ce, float scale, bool grad);

    /* ---- mixture of experts (cpu_moe.h's semantics): N tokens, E experts,
     * the top k of each; activations in adt, routing state fp32 / int32 ---- */
    /* probs (N, E) = softmax(z), idx and w (N, k) the top k and their
     * weights; psum (E; NULL: not wanted) += the column sums of probs; lse
     * (N; NULL: not wanted) the rows' logsumexp (the z-loss's) */
    loom_status (*moe_router_fwd)(loom_dev *d, loom_ctx *ctx, const void *z, int64_t N, int64_t E,
                                  int k, bool norm_topk, float *probs, int32_t *idx, float *w,
                                  float *psum, float *lse);
    /* dz (N, E; adt) from dw (N, k; NULL: none), the load-balancing loss's
     * d/dprobs[n][e] = ga[e] (E; NULL: none) and the z-loss's d/dlse[n] =
     * zc[0] lse[n] (lse (N) NULL: none; zc one float on the device) */
    loom_status (*moe_router_bwd)(loom_dev *d, loom_ctx *ctx, const float *probs,
                                  const int32_t *idx, const float *dw, const float *ga,
                                  const float *lse, const float *zc, int64_t N, int64_t E, int k,
                                  bool norm_topk, void *dz);
    /* counts (E: every choice), order and pos (N k): the choices grouped by
     * expert, stable; cap >= 0 keeps at most cap an expert (by w, or
     * by_position the first tokens), the dropped after all kept ones (order
     * -1 - c, pos -1); cap < 0 dropless, w unread */
    loom_status (*moe_route)(loom_dev *d, loom_ctx *ctx, const int32_t *idx, const float *w,
                             int64_t N, int64_t E, int k, int64_t cap, bool by_position,
                             int32_t *counts, int32_t *order, int32_t *pos);
    /* the once-per-rank dispatch's tables (cpu_moe.h) */
    loom_status (*moe_dest)(loom_dev *d, loom_ctx *ctx, const int32_t *idx, int64_t N, int k,
                            int64_t El, int P, int32_t *dest);
    loom_status (*moe_dedup_meta)(loom_dev *d, loom_ctx *ctx, const int32_t *ord, int64_t U,
                                  const int32_t *idx, const float *w, int k, int64_t El, int P,
                                  int32_t *tok, int32_t *mid, float *mw);
    loom_status (*moe_mask)(loom_dev *d, loom_ctx *ctx, const int32_t *key, int64_t N, int k,
                            int32_t none, int32_t *order, int32_t *pos);
    loom_status (*moe_dedup_dw)(loom_dev *d, loom_ctx *ctx, const float *dwb, const int32_t *pos,
                                int64_t N, int P, int k, float *dw);
    /* ix (2 Rt) from rc (S, El): cpu_moe.h's loom_cpu_moe_regroup */
    loom_status (*moe_regroup)(loom_dev *d, loom_ctx *ctx, const int32_t *rc, int64_t S,
                               int64_t El, int64_t Rt, int32_t *ix);
    loom_status (*moe_permute)(loom_dev *d, loom_ctx *ctx, const void *x, const int32_t *order,
                               int64_t N, int k, int64_t H, void *xg);
    loom_status (*moe_combine)(loom_dev *d, loom_ctx *ctx, const void *yg, const int32_t *pos,
                               const float *w, int64_t N, int k, int64_t H, void *y);
    loom_status (*moe_combine_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, const void *yg,
                                   const int32_t *order, const float *w, int64_t N, int k,
                                   int64_t H, void *dyg, float *dw);
    loom_status (*moe_permute_bwd)(loom_dev *d, loom_ctx *ctx, const void *dxg,
                                   const int32_t *pos, int64_t N, int k, int64_t H, void *dx);
    /* the shared expert's gate: g (N, fp32) = sigmoid(z) (z NULL: given), y =
     * g s (+ y when acc; s NULL: g only); dz (N) = (1 - g) rowdot(da, a) */
    loom_status (*moe_gate_fwd)(loom_dev *d, loom_ctx *ctx, const void *z, const void *s,
                                int64_t N, int64_t H, bool acc, float *g, void *y);
    loom_status (*moe_gate_bwd)(loom_dev *d, loom_ctx *ctx, const void *da, const void *a,
                                const float *g, int64_t N, int64_t I, void *dz);
    /* G GEMMs C_g = alpha op(A_g) op(B_g) + beta C_g of one call's dtypes,
     * transposes and leading dimensions, each its own M, N, K (host array;
     * groups with M or N 0 are skipped, K 0 scales C_g by beta); one launch
     * where the device has a grouped GEMM: the experts' projections */
    loom_status (*gemm_grouped)(loom_dev *d, loom_ctx *ctx, bool ta, bool tb, int G,
                                const loom_gemm_group *g, float alpha, int64_t lda, int64_t ldb,
                                loom_dtype ab, float beta, loom_dtype cdt, int64_t ldc);

    /* ---- the optimizer over an arena's parts (fp32; adamw.h's rules):
     * w values, g the gradient shard, m and v the moments ---- */
    /* AdamW on the gradients times gs[0] gs[1]; wc (NULL: none) the compute
     * copy a device may refresh in the same pass (*wc_done then set) */
    loom_status (*adamw)(loom_dev *d, loom_ctx *ctx, float *w, const float *g, float *m, float *v,
                         const loom_k_part *parts, int n, const loom_adamw_hp *hp, int64_t t,
                         const float gs[2], void *wc, loom_part_lists *lists, bool *wc_done);
    /* *sum (host) = the sum of (g s)^2 over the parts that count in the norm */
    loom_status (*sumsq)(loom_dev *d, loom_ctx *ctx, const float *g, const loom_k_part *parts,
                         int n, float s, loom_part_lists *lists, double *sum);
    /* g[s_off, s_off + len) = 0 for each part (the same parts at every call) */
    loom_status (*zero_parts)(loom_dev *d, loom_ctx *ctx, float *g, const loom_k_part *parts,
                              int n, loom_part_lists *lists);
    void (*lists_free)(loom_dev *d, loom_part_lists *lists);

    /* ---- Gated DeltaNet, Qwen3.5's linear attention (cpu_gdn.h's
     * semantics): T tokens in documents cu (ndocs + 1), activations and
     * weights in adt, the decay g and beta fp32 (T, H), parameter gradients
     * fp32 added to (NULL: frozen). Every backend has them (CUDA's in
     * ops_gdn.cu, ops_gdn_rule.cu); kern.c's loom_k_gdn_* still fail for a
     * table without them ---- */
    /* y (T, C) = silu(causal depthwise conv of x (T, C) by w (C, K)); dx
     * (T, C), dw (C, K) */
    loom_status (*gdn_conv_fwd)(loom_dev *d, loom_ctx *ctx, const void *x, const void *w, int64_t T,
                                int64_t C, int64_t K, const int32_t *cu, int64_t ndocs, void *y);
    loom_status (*gdn_conv_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                const void *w, int64_t T, int64_t C, int64_t K, const int32_t *cu,
                                int64_t ndocs, void *dx, float *dw);
    /* g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); a, b, da, db
     * (T, H) */
    loom_status (*gdn_gate_fwd)(loom_dev *d, loom_ctx *ctx, const void *a, const void *b,
                                const void *A_log, const void *dt_bias, int64_t T, int64_t H,
                                float *g, float *beta);
    loom_status (*gdn_gate_bwd)(loom_dev *d, loom_ctx *ctx, const float *dg, const float *dbeta,
                                const void *a, const void *b, const void *A_log,
                                const void *dt_bias, int64_t T, int64_t H, void *da, void *db,
                                float *dA_log, float *ddt_bias);
    /* the gated delta rule, q and k L2-normalised inside: qkv (T, 2 Hk dk +
     * Hv dv) the convolution's output (q, k, v), o (T, Hv, dv); the
     * backward recomputes what it needs from the inputs: dqkv (qkv's
     * layout), dg, dbeta (T, Hv). keep (NULL: none): gdn_ws.h's
     * loom_gdn_keep_bytes for keep_chunks chunks where the backend keeps
     * (CUDA in bf16, dk <= 128; elsewhere 0 bytes, and keep is not read),
     * filled by the forward and read by the backward of the same inputs in
     * place of recomputing the forward's chunk passes; only for documents
     * whose chunk bound (loom_gdn_ws_chunks) is within keep_chunks */
    loom_status (*gdn_fwd)(loom_dev *d, loom_ctx *ctx, const void *qkv, const float *g,
                           const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                           int64_t dv, const int32_t *cu, int64_t ndocs, void *o, void *keep,
                           int64_t keep_chunks);
    loom_status (*gdn_bwd)(loom_dev *d, loom_ctx *ctx, const void *dout, const void *qkv,
                           const float *g, const float *beta, int64_t T, int64_t Hk, int64_t Hv,
                           int64_t dk, int64_t dv, const int32_t *cu, int64_t ndocs, void *dqkv,
                           float *dg, float *dbeta, const void *keep, int64_t keep_chunks);
    /* y = w rmsnorm(x) silu(z) over N rows of D; rstd (N) kept for the
     * backward: dx, dz (N, D), dw (D) */
    loom_status (*gdn_norm_fwd)(loom_dev *d, loom_ctx *ctx, const void *x, const void *z,
                                const void *w, int64_t N, int64_t D, float eps, void *y,
                                float *rstd);
    loom_status (*gdn_norm_bwd)(loom_dev *d, loom_ctx *ctx, const void *dy, const void *x,
                                const void *z, const void *w, const float *rstd, int64_t N,
                                int64_t D, void *dx, void *dz, float *dw);
} loom_backend;

const loom_backend *loom_backend_cpu(void);
/* NULL when loom was built without CUDA. */
const loom_backend *loom_backend_cuda(void);
/* The backend of a device: CUDA or the CPU; NULL with an error in ctx when
 * that backend is not built in. */
const loom_backend *loom_backend_for(loom_ctx *ctx, bool cuda);
/* Frees what a host_alloc of any backend returned (no device needed: any
 * thread, after the model is gone). */
void loom_backend_host_free(void *p, bool pinned);

#endif /* LOOM_BACKEND_H */
