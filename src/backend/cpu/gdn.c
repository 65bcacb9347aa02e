/* CPU reference ops of Gated DeltaNet (cpu_gdn.h): the convolution, the
 * gates, the chunked gated delta rule and the gated RMSNorm. The chunked
 * rule, for a chunk of L tokens starting from state S0 (dk, dv), with
 * G_i = g_0 + ... + g_i (the log decay since the chunk's start), M_ij =
 * exp(G_i - G_j) (j <= i), q and k normalised:
 *   A = strictly lower (beta_i k_i.k_j M_ij),   T = (I + A)^-1,
 *   X = [U0 | W] = T [diag(beta) V | diag(beta e^G) K],
 *   U = U0 - W S0                      (what each token writes),
 *   P = lower (q_i.k_j M_ij),
 *   O = diag(e^G) Q S0 + P U,
 *   S_L = e^G_L S0 + sum_j e^(G_L - G_j) k_j U_j^T.
 * The backward runs the chunks in reverse from recomputed starting states,
 * with dA = -(T^T dX) X^T for the triangular solve. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../core/core.h"
#include "cpu_gdn.h"

#define CH LOOM_GDN_CHUNK

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

static double dotd(const double *a, const double *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static loom_status check_docs(loom_ctx *ctx, const char *op, const int32_t *cu, int64_t ndocs,
                              int64_t T) {
    if (ndocs < 1 || cu[0] != 0 || cu[ndocs] != T)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "%s: the documents (%lld) do not cover the %lld tokens", op,
                         (long long)ndocs, (long long)T);
    for (int64_t n = 0; n < ndocs; n++)
        if (cu[n + 1] <= cu[n])
            return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: document %lld is empty", op,
                             (long long)n);
    return LOOM_OK;
}

/* ---- the causal depthwise convolution, SiLU fused ---- */

#define CONV_MAX_K 64

/* The pre-activation at token t (document from s) of channel c. */
static double conv_pre(const float *x, const float *w, int64_t C, int64_t K, int64_t s, int64_t t,
                       int64_t c) {
    double acc = 0;
    for (int64_t j = 0; j < K; j++) {
        int64_t u = t - K + 1 + j;
        if (u >= s) acc += (double)w[c * K + j] * x[u * C + c];
    }
    return acc;
}

/* dL/dpre at (t, c): dy silu'(pre). */
static double conv_dpre(const float *dy, const float *x, const float *w, int64_t C, int64_t K,
                        int64_t s, int64_t t, int64_t c) {
    double p = conv_pre(x, w, C, K, s, t, c), sg = sigm(p);
    return dy[t * C + c] * sg * (1 + p * (1 - sg));
}

static loom_status conv_check(loom_ctx *ctx, const char *op, int64_t T, int64_t C, int64_t K,
                              const int32_t *cu, int64_t ndocs) {
    if (K < 1 || K > CONV_MAX_K || C < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: kernel %lld over %lld channels", op,
                         (long long)K, (long long)C);
    return check_docs(ctx, op, cu, ndocs, T);
}

loom_status loom_cpu_gdn_conv_fwd(loom_ctx *ctx, const float *x, const float *w, int64_t T,
                                  int64_t C, int64_t K, const int32_t *cu, int64_t ndocs,
                                  float *y) {
    loom_status st = conv_check(ctx, "gdn_conv_fwd", T, C, K, cu, ndocs);
    if (st) return st;
    for (int64_t n = 0; n < ndocs; n++) {
        const int64_t s = cu[n], e = cu[n + 1];
#pragma omp parallel for schedule(static) if ((e - s) * C * K > 65536)
        for (int64_t t = s; t < e; t++)
            for (int64_t c = 0; c < C; c++) {
                double p = conv_pre(x, w, C, K, s, t, c);
                y[t * C + c] = (float)(p * sigm(p));
            }
    }
    return LOOM_OK;
}

loom_status loom_cpu_gdn_conv_bwd(loom_ctx *ctx, const float *dy, const float *x, const float *w,
                                  int64_t T, int64_t C, int64_t K, const int32_t *cu, int64_t ndocs,
                                  float *dx, float *dw) {
    loom_status st = conv_check(ctx, "gdn_conv_bwd", T, C, K, cu, ndocs);
    if (st) return st;
    /* dx[u, c] = sum_j w[c, j] dpre[u + K - 1 - j, c] over the tokens of u's document */
    for (int64_t n = 0; n < ndocs; n++) {
        const int64_t s = cu[n], e = cu[n + 1];
#pragma omp parallel for schedule(static) if ((e - s) * C * K * K > 65536)
        for (int64_t u = s; u < e; u++)
            for (int64_t c = 0; c < C; c++) {
                double acc = 0;
                for (int64_t j = 0; j < K; j++) {
                    int64_t t = u + K - 1 - j;
                    if (t < e) acc += (double)w[c * K + j] * conv_dpre(dy, x, w, C, K, s, t, c);
                }
                dx[u * C + c] = (float)acc;
            }
    }
    /* dw[c, j] += sum_t dpre[t, c] x[t - K + 1 + j, c]: a channel a thread */
    if (!dw) return LOOM_OK;
#pragma omp parallel for schedule(static) if (T * C * K > 65536)
    for (int64_t c = 0; c < C; c++) {
        double acc[CONV_MAX_K] = {0};
        for (int64_t n = 0; n < ndocs; n++)
            for (int64_t t = cu[n]; t < cu[n + 1]; t++) {
                double dp = conv_dpre(dy, x, w, C, K, cu[n], t, c);
                for (int64_t j = 0; j < K; j++) {
                    int64_t u = t - K + 1 + j;
                    if (u >= cu[n]) acc[j] += dp * x[u * C + c];
                }
            }
        for (int64_t j = 0; j < K; j++) dw[c * K + j] += (float)acc[j];
    }
    return LOOM_OK;
}

/* ---- the gates: the decay g and the write strength beta ---- */

/* torch's softplus (beta 1, threshold 20) */
static double softplus(double x) { return x > 20 ? x : log1p(exp(x)); }

loom_status loom_cpu_gdn_gate_fwd(loom_ctx *ctx, const float *a, const float *b, const float *A_log,
                                  const float *dt_bias, int64_t T, int64_t H, float *g,
                                  float *beta) {
    (void)ctx;
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (int64_t i = 0; i < T * H; i++) {
        int64_t h = i % H;
        g[i] = (float)(-exp((double)A_log[h]) * softplus((double)a[i] + dt_bias[h]));
        beta[i] = (float)sigm(b[i]);
    }
    return LOOM_OK;
}

loom_status loom_cpu_gdn_gate_bwd(loom_ctx *ctx, const float *dg, const float *dbeta,
                                  const float *a, const float *b, const float *A_log,
                                  const float *dt_bias, int64_t T, int64_t H, float *da, float *db,
                                  float *dA_log, float *ddt_bias) {
    (void)ctx;
    /* dg/da = dg/ddt_bias = -exp(A_log) sigmoid(a + dt_bias) (softplus' past 20: 1);
     * dg/dA_log = g; dbeta/db = beta (1 - beta) */
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (int64_t i = 0; i < T * H; i++) {
        int64_t h = i % H;
        double x = (double)a[i] + dt_bias[h], sb = sigm(b[i]);
        da[i] = (float)(dg[i] * -exp((double)A_log[h]) * (x > 20 ? 1.0 : sigm(x)));
        db[i] = (float)(dbeta[i] * sb * (1 - sb));
    }
    if (!dA_log && !ddt_bias) return LOOM_OK;
    for (int64_t h = 0; h < H; h++) {
        double sa = 0, sd = 0, eA = exp((double)A_log[h]);
        for (int64_t t = 0; t < T; t++) {
            double x = (double)a[t * H + h] + dt_bias[h], d = dg[t * H + h];
            sa += d * -eA * softplus(x);
            sd += d * -eA * (x > 20 ? 1.0 : sigm(x));
        }
        if (dA_log) dA_log[h] += (float)sa;
        if (ddt_bias) ddt_bias[h] += (float)sd;
    }
    return LOOM_OK;
}

/* ---- the gated RMSNorm ---- */

loom_status loom_cpu_gdn_norm_fwd(loom_ctx *ctx, const float *x, const float *z, const float *w,
                                  int64_t N, int64_t D, float eps, float *y, float *rstd) {
    (void)ctx;
#pragma omp parallel for schedule(static) if (N * D > 65536)
    for (int64_t r = 0; r < N; r++) {
        const float *xr = x + r * D, *zr = z + r * D;
        double ss = 0;
        for (int64_t j = 0; j < D; j++) ss += (double)xr[j] * xr[j];
        float rs = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
        rstd[r] = rs;
        for (int64_t j = 0; j < D; j++) {
            float nx = xr[j] * rs; /* rounded as transformers' */
            y[r * D + j] = (float)((double)w[j] * nx * zr[j] * sigm(zr[j]));
        }
    }
    return LOOM_OK;
}

loom_status loom_cpu_gdn_norm_bwd(loom_ctx *ctx, const float *dy, const float *x, const float *z,
                                  const float *w, const float *rstd, int64_t N, int64_t D,
                                  float *dx, float *dz, float *dw) {
    (void)ctx;
    /* y_j = w_j n_j s_j, n = x r, s = silu(z): dn_j = dy_j w_j s_j,
     * dx = r dn - r^3 / D (dn . x) x, dz_j = dy_j w_j n_j silu'(z_j),
     * dw_j += sum_rows dy_j n_j s_j */
#pragma omp parallel for schedule(static) if (N * D > 65536 && dw)
    for (int64_t j = 0; j < (dw ? D : 0); j++) {
        double acc = 0;
        for (int64_t r = 0; r < N; r++) {
            double zz = z[r * D + j];
            acc += (double)dy[r * D + j] * (x[r * D + j] * rstd[r]) * zz * sigm(zz);
        }
        dw[j] += (float)acc;
    }
#pragma omp parallel for schedule(static) if (N * D > 65536)
    for (int64_t r = 0; r < N; r++) {
        const float *dyr = dy + r * D, *xr = x + r * D, *zr = z + r * D;
        double rs = rstd[r], dot = 0;
        for (int64_t j = 0; j < D; j++) {
            double sg = sigm(zr[j]);
            dot += (double)dyr[j] * w[j] * zr[j] * sg * xr[j];
        }
        double c = dot * rs * rs * rs / (double)D;
        for (int64_t j = 0; j < D; j++) {
            double sg = sigm(zr[j]), zz = zr[j];
            double dn = (double)dyr[j] * w[j] * zz * sg;
            dx[r * D + j] = (float)(rs * dn - c * xr[j]);
            dz[r * D + j] =
                (float)((double)dyr[j] * w[j] * (xr[j] * rs) * sg * (1 + zz * (1 - sg)));
        }
    }
    return LOOM_OK;
}

/* ---- the gated delta rule, by chunks ---- */

typedef struct gdn_geo {
    int64_t Hk, Hv, dk, dv, C; /* C = 2 Hk dk + Hv dv: qkv's row */
} gdn_geo;

/* The rule's tensors (cpu_gdn.h); the backward's NULL in the forward. */
typedef struct gdn_io {
    const float *qkv, *g, *beta, *dout;
    float *o, *dqkv, *dg, *dbeta;
} gdn_io;

/* One task's scratch (a document and a key head), doubles: the normalised q
 * and k of the document, the state, one chunk's matrices; for the backward
 * the chunks' starting states and the gradients. */
typedef struct gdn_ws {
    int64_t len, nch, W;    /* tokens, chunks, X's row (dv + dk) */
    double *qn, *kn;        /* (len, dk): q / |q| / sqrt(dk), k / |k| */
    double *S;              /* (dk, dv) */
    double *M, *KM, *A, *P; /* (CH, CH): M_ij, k_i.k_j M_ij, A, P (j <= i) */
    double *X, *U;          /* (CH, W), (CH, dv) */
    double G[CH], eG[CH], be[CH];
    double *states;    /* (nch, dk, dv) the chunks' starting states */
    double *dS, *dS0;  /* (dk, dv) */
    double *dX, *dU;   /* (CH, W), (CH, dv) */
    double *dqn, *dkn; /* (len, dk) */
    double *tmp;       /* dk + dv */
    double dG[CH], dbe[CH];
} gdn_ws;

static double *ws_take(double **p, int64_t n) {
    double *r = *p;
    *p += n;
    return r;
}

/* NULL when there is no memory. */
static double *ws_init(gdn_ws *w, const gdn_geo *z, int64_t len, bool bwd) {
    const int64_t dk = z->dk, dv = z->dv;
    memset(w, 0, sizeof *w);
    w->len = len;
    w->nch = (len + CH - 1) / CH;
    w->W = dv + dk;
    int64_t n = 2 * len * dk + dk * dv + 4 * CH * CH + CH * w->W + CH * dv + dk + dv;
    if (bwd) n += w->nch * dk * dv + 2 * dk * dv + CH * w->W + CH * dv + 2 * len * dk;
    double *base = calloc((size_t)n, sizeof(double)), *p = base;
    if (!base) return NULL;
    w->qn = ws_take(&p, len * dk), w->kn = ws_take(&p, len * dk), w->S = ws_take(&p, dk * dv);
    w->M = ws_take(&p, CH * CH), w->KM = ws_take(&p, CH * CH), w->A = ws_take(&p, CH * CH);
    w->P = ws_take(&p, CH * CH), w->X = ws_take(&p, CH * w->W), w->U = ws_take(&p, CH * dv);
    w->tmp = ws_take(&p, dk + dv);
    if (bwd) {
        w->states = ws_take(&p, w->nch * dk * dv);
        w->dS = ws_take(&p, dk * dv), w->dS0 = ws_take(&p, dk * dv);
        w->dX = ws_take(&p, CH * w->W), w->dU = ws_take(&p, CH * dv);
        w->dqn = ws_take(&p, len * dk), w->dkn = ws_take(&p, len * dk);
    }
    return base;
}

/* 1 / sqrt(|x|^2 + 1e-6) of n floats (transformers' l2norm) */
static double l2_inv(const float *x, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return 1.0 / sqrt(s + 1e-6);
}

/* The normalised q and k of key head hk over the document's tokens from s. */
static void load_qk(gdn_ws *w, const gdn_geo *z, const float *qkv, int64_t s, int64_t hk) {
    const int64_t dk = z->dk;
    const double sc = 1.0 / sqrt((double)dk);
    for (int64_t t = 0; t < w->len; t++) {
        const float *q = qkv + (s + t) * z->C + hk * dk, *k = q + z->Hk * dk;
        double rq = l2_inv(q, dk) * sc, rk = l2_inv(k, dk);
        for (int64_t a = 0; a < dk; a++) {
            w->qn[t * dk + a] = q[a] * rq;
            w->kn[t * dk + a] = k[a] * rk;
        }
    }
}

/* The chunk of L tokens at c0 of the document (from token s) for value head
 * h, starting from S0: G, e^G, beta, M, KM, A, P, X = [U0 | W] and U. */
static void chunk_prep(gdn_ws *w, const gdn_geo *z, const float *qkv, const float *g,
                       const float *beta, int64_t s, int64_t c0, int64_t L, int64_t h,
                       const double *S0) {
    const int64_t dk = z->dk, dv = z->dv, W = w->W;
    const double *qn = w->qn + c0 * dk, *kn = w->kn + c0 * dk;
    for (int64_t i = 0; i < L; i++) {
        const int64_t t = s + c0 + i;
        w->G[i] = (i ? w->G[i - 1] : 0.0) + g[t * z->Hv + h];
        w->eG[i] = exp(w->G[i]);
        w->be[i] = beta[t * z->Hv + h];
    }
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j <= i; j++) {
            double m = exp(w->G[i] - w->G[j]), kk = dotd(kn + i * dk, kn + j * dk, dk);
            w->M[i * CH + j] = m;
            w->KM[i * CH + j] = kk * m;
            w->A[i * CH + j] = j < i ? w->be[i] * kk * m : 0.0;
            w->P[i * CH + j] = dotd(qn + i * dk, kn + j * dk, dk) * m;
        }
    /* X = (I + A)^-1 [diag(beta) V | diag(beta e^G) K] by forward substitution */
    for (int64_t i = 0; i < L; i++) {
        double *x = w->X + i * W;
        const float *v = qkv + (s + c0 + i) * z->C + 2 * z->Hk * dk + h * dv;
        for (int64_t b = 0; b < dv; b++) x[b] = w->be[i] * v[b];
        for (int64_t a = 0; a < dk; a++) x[dv + a] = w->be[i] * w->eG[i] * kn[i * dk + a];
        for (int64_t j = 0; j < i; j++) {
            const double aij = w->A[i * CH + j], *xj = w->X + j * W;
            for (int64_t c = 0; c < W; c++) x[c] -= aij * xj[c];
        }
        /* U_i = U0_i - S0^T W_i */
        double *u = w->U + i * dv;
        for (int64_t b = 0; b < dv; b++) u[b] = x[b];
        for (int64_t a = 0; a < dk; a++) {
            const double wa = x[dv + a], *sr = S0 + a * dv;
            for (int64_t b = 0; b < dv; b++) u[b] -= wa * sr[b];
        }
    }
}

/* S (the chunk's S0 on entry) <- the state after the chunk's L tokens. */
static void chunk_state(gdn_ws *w, const gdn_geo *z, int64_t c0, int64_t L, double *S) {
    const int64_t dk = z->dk, dv = z->dv;
    const double eL = w->eG[L - 1];
    for (int64_t i = 0; i < dk * dv; i++) S[i] *= eL;
    for (int64_t j = 0; j < L; j++) {
        const double dj = exp(w->G[L - 1] - w->G[j]), *kn = w->kn + (c0 + j) * dk;
        const double *u = w->U + j * dv;
        for (int64_t a = 0; a < dk; a++) {
            double ka = dj * kn[a];
            for (int64_t b = 0; b < dv; b++) S[a * dv + b] += ka * u[b];
        }
    }
}

/* Value head h over the document (from token s), q and k loaded: o (when
 * io->o) and the chunks' starting states (when w->states, the backward's). */
static void head_fwd(gdn_ws *w, const gdn_geo *z, const gdn_io *io, int64_t s, int64_t h) {
    const int64_t dk = z->dk, dv = z->dv;
    memset(w->S, 0, (size_t)(dk * dv) * sizeof(double));
    for (int64_t c0 = 0; c0 < w->len; c0 += CH) {
        const int64_t L = w->len - c0 < CH ? w->len - c0 : CH;
        if (w->states) {
            memcpy(w->states + c0 / CH * dk * dv, w->S, (size_t)(dk * dv) * sizeof(double));
            if (c0 + CH >= w->len) return; /* the last chunk's end state is not needed */
        }
        chunk_prep(w, z, io->qkv, io->g, io->beta, s, c0, L, h, w->S);
        /* O_i = e^G_i S0^T q_i + sum_j<=i P_ij U_j */
        for (int64_t i = 0; io->o && i < L; i++) {
            const double *qi = w->qn + (c0 + i) * dk;
            double *acc = w->tmp;
            for (int64_t b = 0; b < dv; b++) acc[b] = 0;
            for (int64_t a = 0; a < dk; a++) {
                const double qa = w->eG[i] * qi[a], *sr = w->S + a * dv;
                for (int64_t b = 0; b < dv; b++) acc[b] += qa * sr[b];
            }
            for (int64_t j = 0; j <= i; j++) {
                const double p = w->P[i * CH + j], *u = w->U + j * dv;
                for (int64_t b = 0; b < dv; b++) acc[b] += p * u[b];
            }
            float *oi = io->o + ((s + c0 + i) * z->Hv + h) * dv;
            for (int64_t b = 0; b < dv; b++) oi[b] = (float)acc[b];
        }
        chunk_state(w, z, c0, L, w->S);
    }
}

static loom_status gdn_check(loom_ctx *ctx, const char *op, int64_t T, const gdn_geo *z,
                             const int32_t *cu, int64_t ndocs) {
    if (z->Hk < 1 || z->Hv % z->Hk || z->dk < 1 || z->dv < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "%s: %lld value heads over %lld key heads (dk %lld, dv %lld)", op,
                         (long long)z->Hv, (long long)z->Hk, (long long)z->dk, (long long)z->dv);
    return check_docs(ctx, op, cu, ndocs, T);
}

static int64_t max_doc(const int32_t *cu, int64_t ndocs) {
    int64_t m = 0;
    for (int64_t n = 0; n < ndocs; n++)
        if (cu[n + 1] - cu[n] > m) m = cu[n + 1] - cu[n];
    return m;
}

/* The backward of one chunk (value head h) from S0 and dS (the gradient of
 * the state after it); dS becomes that of S0. Adds to dqn, dkn; writes the
 * chunk's dv (into dqkv), dg and dbeta. */
static void chunk_bwd(gdn_ws *w, const gdn_geo *z, const float *dout, const float *qkv, int64_t s,
                      int64_t c0, int64_t L, int64_t h, const double *S0, float *dqkv, float *dg,
                      float *dbeta) {
    const int64_t dk = z->dk, dv = z->dv, W = w->W;
    const double *qn = w->qn + c0 * dk, *kn = w->kn + c0 * dk;
    double *dqn = w->dqn + c0 * dk, *dkn = w->dkn + c0 * dk, *dS = w->dS, *dS0 = w->dS0;
    double *dG = w->dG, *dbe = w->dbe, *tmp = w->tmp;
    const double eL = w->eG[L - 1];
    for (int64_t i = 0; i < L; i++) dG[i] = dbe[i] = 0;
    /* S_L = e^G_L S0 + sum_j d_j k_j U_j^T, d_j = e^(G_L - G_j) */
    for (int64_t i = 0; i < dk * dv; i++) {
        dS0[i] = eL * dS[i];
        dG[L - 1] += eL * S0[i] * dS[i];
    }
    for (int64_t j = 0; j < L; j++) {
        const double dj = exp(w->G[L - 1] - w->G[j]), *u = w->U + j * dv;
        double *du = w->dU + j * dv;
        for (int64_t b = 0; b < dv; b++) du[b] = 0;
        for (int64_t a = 0; a < dk; a++) {
            const double *r = dS + a * dv, ka = dj * kn[j * dk + a];
            double t = 0;
            for (int64_t b = 0; b < dv; b++) {
                du[b] += ka * r[b];
                t += r[b] * u[b];
            }
            tmp[a] = t;
        }
        double dd = dj * dotd(kn + j * dk, tmp, dk);
        for (int64_t a = 0; a < dk; a++) dkn[j * dk + a] += dj * tmp[a];
        dG[L - 1] += dd;
        dG[j] -= dd;
    }
    /* O = diag(e^G) Q S0 + P U */
    for (int64_t i = 0; i < L; i++) {
        const float *doi = dout + ((s + c0 + i) * z->Hv + h) * dv;
        const double ei = w->eG[i], *qi = qn + i * dk;
        for (int64_t a = 0; a < dk; a++) {
            const double *sr = S0 + a * dv;
            double sd = 0;
            for (int64_t b = 0; b < dv; b++) {
                sd += sr[b] * doi[b];
                dS0[a * dv + b] += ei * qi[a] * doi[b];
            }
            dqn[i * dk + a] += ei * sd;
            dG[i] += ei * qi[a] * sd;
        }
        for (int64_t j = 0; j <= i; j++) {
            const double *u = w->U + j * dv, pij = w->P[i * CH + j];
            double *du = w->dU + j * dv, dp = 0;
            for (int64_t b = 0; b < dv; b++) {
                dp += doi[b] * u[b];
                du[b] += pij * doi[b];
            }
            const double dqk = dp * w->M[i * CH + j];
            for (int64_t a = 0; a < dk; a++) {
                dqn[i * dk + a] += dqk * kn[j * dk + a];
                dkn[j * dk + a] += dqk * qi[a];
            }
            dG[i] += dp * pij;
            dG[j] -= dp * pij;
        }
    }
    /* U = U0 - W S0: dX = [dU | -S0 dU], dS0 -= W^T dU */
    for (int64_t i = 0; i < L; i++) {
        double *dx = w->dX + i * W;
        const double *du = w->dU + i * dv, *x = w->X + i * W;
        for (int64_t b = 0; b < dv; b++) dx[b] = du[b];
        for (int64_t a = 0; a < dk; a++) {
            double *sr = dS0 + a * dv;
            const double *s0 = S0 + a * dv;
            double t = 0;
            for (int64_t b = 0; b < dv; b++) {
                t += s0[b] * du[b];
                sr[b] -= x[dv + a] * du[b];
            }
            dx[dv + a] = -t;
        }
    }
    /* dB = (I + A)^-T dX, in place by back substitution */
    for (int64_t i = L - 1; i >= 0; i--) {
        double *db = w->dX + i * W;
        for (int64_t j = i + 1; j < L; j++) {
            const double aji = w->A[j * CH + i], *dbj = w->dX + j * W;
            for (int64_t c = 0; c < W; c++) db[c] -= aji * dbj[c];
        }
    }
    /* dA_ij = -dB_i . X_j, A_ij = beta_i k_i.k_j M_ij (i > j) */
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < i; j++) {
            const double da = -dotd(w->dX + i * W, w->X + j * W, W);
            const double c = da * w->be[i] * w->M[i * CH + j], ad = da * w->A[i * CH + j];
            dbe[i] += da * w->KM[i * CH + j];
            for (int64_t a = 0; a < dk; a++) {
                dkn[i * dk + a] += c * kn[j * dk + a];
                dkn[j * dk + a] += c * kn[i * dk + a];
            }
            dG[i] += ad;
            dG[j] -= ad;
        }
    /* B = [diag(beta) V | diag(beta e^G) K] */
    for (int64_t i = 0; i < L; i++) {
        const double *db = w->dX + i * W, *ki = kn + i * dk, bi = w->be[i], ei = w->eG[i];
        const float *v = qkv + (s + c0 + i) * z->C + 2 * z->Hk * dk + h * dv;
        float *dvo = dqkv + (s + c0 + i) * z->C + 2 * z->Hk * dk + h * dv;
        double sv = 0;
        for (int64_t b = 0; b < dv; b++) {
            sv += v[b] * db[b];
            dvo[b] = (float)(bi * db[b]);
        }
        double sk = dotd(ki, db + dv, dk);
        for (int64_t a = 0; a < dk; a++) dkn[i * dk + a] += bi * ei * db[dv + a];
        dbe[i] += sv + ei * sk;
        dG[i] += bi * ei * sk;
    }
    /* G_i = g_0 + ... + g_i */
    double acc = 0;
    for (int64_t i = L - 1; i >= 0; i--) {
        const int64_t t = s + c0 + i;
        acc += dG[i];
        dg[t * z->Hv + h] = (float)acc;
        dbeta[t * z->Hv + h] = (float)dbe[i];
    }
    memcpy(dS, dS0, (size_t)(dk * dv) * sizeof(double));
}

/* d of the normalised rows -> d of the raw ones: y = x sc / sqrt(|x|^2 +
 * eps): dx = sc (r dy - r^3 (x . dy) x), r = 1 / sqrt(|x|^2 + eps). */
static void l2_bwd(const float *x, const double *dy, int64_t n, double sc, float *dx) {
    const double r = l2_inv(x, n);
    double xd = 0;
    for (int64_t i = 0; i < n; i++) xd += x[i] * dy[i];
    for (int64_t i = 0; i < n; i++) dx[i] = (float)(sc * (r * dy[i] - r * r * r * xd * x[i]));
}

/* The document (from token s) for key head hk and its group's value heads. */
static void doc_task(gdn_ws *w, const gdn_geo *z, const gdn_io *io, int64_t s, int64_t hk) {
    const int64_t dk = z->dk, dv = z->dv, grp = z->Hv / z->Hk;
    load_qk(w, z, io->qkv, s, hk);
    for (int64_t h = hk * grp; h < (hk + 1) * grp; h++) {
        head_fwd(w, z, io, s, h);
        if (!io->dqkv) continue;
        memset(w->dS, 0, (size_t)(dk * dv) * sizeof(double));
        for (int64_t c = w->nch - 1; c >= 0; c--) {
            const int64_t c0 = c * CH, L = w->len - c0 < CH ? w->len - c0 : CH;
            const double *S0 = w->states + c * dk * dv;
            chunk_prep(w, z, io->qkv, io->g, io->beta, s, c0, L, h, S0);
            chunk_bwd(w, z, io->dout, io->qkv, s, c0, L, h, S0, io->dqkv, io->dg, io->dbeta);
        }
    }
    if (!io->dqkv) return;
    const double sc = 1.0 / sqrt((double)dk);
    for (int64_t t = 0; t < w->len; t++) {
        const int64_t off = (s + t) * z->C + hk * dk, koff = off + z->Hk * dk;
        l2_bwd(io->qkv + off, w->dqn + t * dk, dk, sc, io->dqkv + off);
        l2_bwd(io->qkv + koff, w->dkn + t * dk, dk, 1.0, io->dqkv + koff);
    }
}

/* Every (document, key head) a task, each with scratch of its own. */
static loom_status gdn_run(loom_ctx *ctx, const char *op, const gdn_io *io, int64_t T,
                           const gdn_geo *z, const int32_t *cu, int64_t ndocs) {
    loom_status st = gdn_check(ctx, op, T, z, cu, ndocs);
    if (st) return st;
    bool oom = false;
    const bool bwd = io->dqkv != NULL;
    const int64_t Hk = z->Hk;
#pragma omp parallel for schedule(dynamic, 1) if (ndocs * Hk > 1)
    for (int64_t task = 0; task < ndocs * Hk; task++) {
        const int64_t n = task / Hk, hk = task % Hk;
        gdn_ws w;
        double *mem = ws_init(&w, z, cu[n + 1] - cu[n], bwd);
        if (!mem) {
#pragma omp atomic write
            oom = true;
            continue;
        }
        doc_task(&w, z, io, cu[n], hk);
        free(mem);
    }
    if (oom)
        return loom_errf(ctx, LOOM_ERR_OOM, "%s: no memory for a document's scratch (%lld tokens)",
                         op, (long long)max_doc(cu, ndocs));
    return LOOM_OK;
}

loom_status loom_cpu_gdn_fwd(loom_ctx *ctx, const float *qkv, const float *g, const float *beta,
                             int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                             const int32_t *cu, int64_t ndocs, float *o) {
    const gdn_geo z = {Hk, Hv, dk, dv, 2 * Hk * dk + Hv * dv};
    const gdn_io io = {.qkv = qkv, .g = g, .beta = beta, .o = o};
    return gdn_run(ctx, "gdn_fwd", &io, T, &z, cu, ndocs);
}

loom_status loom_cpu_gdn_bwd(loom_ctx *ctx, const float *dout, const float *qkv, const float *g,
                             const float *beta, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
                             int64_t dv, const int32_t *cu, int64_t ndocs, float *dqkv, float *dg,
                             float *dbeta) {
    const gdn_geo z = {Hk, Hv, dk, dv, 2 * Hk * dk + Hv * dv};
    const gdn_io io = {
        .qkv = qkv, .g = g, .beta = beta, .dout = dout, .dqkv = dqkv, .dg = dg, .dbeta = dbeta};
    return gdn_run(ctx, "gdn_bwd", &io, T, &z, cu, ndocs);
}
