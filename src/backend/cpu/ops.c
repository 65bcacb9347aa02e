/* CPU reference ops of one transformer layer (except attention, in
 * attention.c) and the loss: embedding, RMSNorm, RoPE, SwiGLU, residual add,
 * bias, cross-entropy. fp32 tensors; sums in double. */
#include <math.h>

#include "../../core/core.h"
#include "cpu_ops.h"

/* ---- embedding ---- */

void loom_cpu_embedding_fwd(const int32_t *ids, int64_t T, const float *W, int64_t H, float *out) {
    // ids: (T); W: (V, H); out: (T, H)
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *w = W + (int64_t)ids[t] * H;
        float *o = out + t * H;
        for (int64_t j = 0; j < H; j++) o[j] = w[j];
    }
}

void loom_cpu_embedding_bwd(const int32_t *ids, int64_t T, const float *dout, int64_t H,
                            float *dW) {
    // dout: (T, H); dW: (V, H), accumulated. Threads own column blocks, so
    // repeated ids never race and the summation order is fixed (token order).
    const int64_t blk = 64, nblk = (H + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (int64_t b = 0; b < nblk; b++) {
        int64_t j0 = b * blk, j1 = j0 + blk < H ? j0 + blk : H;
        for (int64_t t = 0; t < T; t++) {
            float *w = dW + (int64_t)ids[t] * H;
            const float *d = dout + t * H;
            for (int64_t j = j0; j < j1; j++) w[j] += d[j];
        }
    }
}

/* ---- RMSNorm ---- */

void loom_cpu_rmsnorm_fwd(const float *x, const float *w, float woff, int64_t N, int64_t H,
                          float eps, float *y, float *rstd) {
    // x, y: (N, H); w: (H); rstd: (N)
#pragma omp parallel for schedule(static) if (N * H > 65536)
    for (int64_t r = 0; r < N; r++) {
        const float *xr = x + r * H;
        float *yr = y + r * H;
        double ss = 0;
        for (int64_t j = 0; j < H; j++) ss += (double)xr[j] * xr[j];
        float rs = (float)(1.0 / sqrt(ss / (double)H + (double)eps));
        rstd[r] = rs;
        for (int64_t j = 0; j < H; j++) yr[j] = (woff + w[j]) * (xr[j] * rs);
    }
}

void loom_cpu_rmsnorm_bwd(const float *dy, const float *x, const float *w, float woff,
                          const float *rstd, int64_t N, int64_t H, float *dx, float *dw) {
    // dy, x, dx: (N, H); w, dw: (H); rstd: (N).
    // y_j = w_j x_j r with r = (mean(x^2) + eps)^-1/2, dr/dx_j = -r^3 x_j / H:
    // dx_j = r w_j dy_j - x_j r^3 / H * sum_k dy_k w_k x_k;  dw_j += sum_rows dy_j x_j r.
    // dw first: dx may alias dy. dw NULL: a frozen weight, no gradient.
#pragma omp parallel for schedule(static) if (N * H > 65536 && dw)
    for (int64_t j = 0; j < (dw ? H : 0); j++) {
        double acc = 0;
        for (int64_t r = 0; r < N; r++) acc += (double)dy[r * H + j] * x[r * H + j] * rstd[r];
        dw[j] += (float)acc;
    }
#pragma omp parallel for schedule(static) if (N * H > 65536)
    for (int64_t r = 0; r < N; r++) {
        const float *dyr = dy + r * H, *xr = x + r * H;
        float *dxr = dx + r * H;
        double rs = rstd[r], dot = 0;
        for (int64_t j = 0; j < H; j++) dot += (double)dyr[j] * (woff + w[j]) * xr[j];
        double c = dot * rs * rs * rs / (double)H;
        for (int64_t j = 0; j < H; j++)
            dxr[j] = (float)(rs * (woff + w[j]) * dyr[j] - c * xr[j]);
    }
}

/* ---- RoPE ---- */

void loom_rope_inv_freq(int rope_type, double theta, int64_t D, double factor,
                        double low_freq_factor, double high_freq_factor, int64_t original_max_pos,
                        float *inv_freq) {
    // inv_freq: (D/2). HF: 1.0 / (base ** (arange(0, D, 2).float() / D)) in fp32.
    const double pi = 3.141592653589793;
    for (int64_t i = 0; i < D / 2; i++) {
        float e = (float)(2 * i) / (float)D;
        float p = (float)pow(theta, (double)e);
        float f = 1.0f / p;
        if (rope_type == 1) {
            f = (float)(f / factor);
        } else if (rope_type == 2) {
            double old = (double)original_max_pos;
            double low_wl = old / low_freq_factor, high_wl = old / high_freq_factor;
            double wl = 2 * pi / (double)f;
            if (wl > low_wl) {
                f = (float)(f / factor);
            } else if (!(wl < high_wl)) { /* medium band: interpolate */
                double smooth = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                f = (float)((1 - smooth) * f / factor + smooth * f);
            }
        }
        inv_freq[i] = f;
    }
}

/* Rotates the first rd dimensions of each head of x: (T, nh, D) in place
 * by angle sign * pos * inv_freq. */
static void rope_apply(float *x, int64_t T, int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                       const float *inv_freq, int sign) {
    const int64_t half = rd / 2;
#pragma omp parallel for schedule(static) if (T * nh * D > 65536)
    for (int64_t t = 0; t < T; t++) {
        float p = (float)pos[t];
        for (int64_t i = 0; i < half; i++) {
            float ang = p * inv_freq[i]; /* fp32 product, as HF */
            float c = (float)cos((double)ang), s = (float)sin((double)ang);
            if (sign < 0) s = -s;
            for (int64_t h = 0; h < nh; h++) {
                float *xr = x + (t * nh + h) * D;
                float x1 = xr[i], x2 = xr[i + half];
                xr[i] = x1 * c - x2 * s;
                xr[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

void loom_cpu_rope_fwd(float *x, int64_t T, int64_t nh, int64_t D, int64_t rd, const int32_t *pos,
                       const float *inv_freq) {
    rope_apply(x, T, nh, D, rd, pos, inv_freq, 1);
}

void loom_cpu_rope_bwd(float *dx, int64_t T, int64_t nh, int64_t D, int64_t rd,
                       const int32_t *pos, const float *inv_freq) {
    /* the rotation is orthogonal: its transpose is the rotation by -angle */
    rope_apply(dx, T, nh, D, rd, pos, inv_freq, -1);
}

/* ---- SwiGLU, residual, bias ---- */

static inline float swiglu1(float g, float u) {
    float sg = 1.0f / (1.0f + expf(-g));
    return g * sg * u;
}
// d silu(g)/dg = sig * (1 + g * (1 - sig))
static inline void swiglu1_bwd(float d, float g, float u, float *dg, float *du) {
    float sg = 1.0f / (1.0f + expf(-g));
    *dg = d * u * sg * (1.0f + g * (1.0f - sg));
    *du = d * g * sg;
}

void loom_cpu_gate_fwd(const float *o, const float *g, int64_t n, float *y) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) y[i] = o[i] * (1.0f / (1.0f + expf(-g[i])));
}

void loom_cpu_gate_bwd(const float *dy, const float *o, const float *g, int64_t n, float *do_,
                       float *dg) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        const float s = 1.0f / (1.0f + expf(-g[i])), d = dy[i], oi = o[i];
        do_[i] = d * s; /* every read of element i is done: the outputs may alias */
        dg[i] = d * oi * s * (1.0f - s);
    }
}

void loom_cpu_swiglu_fwd(const float *g, const float *u, int64_t n, float *h) {
    // g, u, h: (n)
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) h[i] = swiglu1(g[i], u[i]);
}

void loom_cpu_swiglu_bwd(const float *dh, const float *g, const float *u, int64_t n, float *dg,
                         float *du) {
    // dh, g, u, dg, du: (n)
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        float a, b;
        swiglu1_bwd(dh[i], g[i], u[i], &a, &b);
        dg[i] = a;
        du[i] = b;
    }
}

void loom_cpu_residual_add(float *y, const float *x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

void loom_cpu_add_bias_fwd(float *y, const float *b, int64_t T, int64_t N) {
    // y: (T, N); b: (N)
#pragma omp parallel for schedule(static) if (T * N > 65536)
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < N; j++) y[t * N + j] += b[j];
}

void loom_cpu_add_bias_bwd(const float *dy, int64_t T, int64_t N, float *db) {
    // dy: (T, N); db: (N), accumulated; NULL: a frozen bias
    if (!db) return;
#pragma omp parallel for schedule(static) if (T * N > 65536)
    for (int64_t j = 0; j < N; j++) {
        double acc = 0;
        for (int64_t t = 0; t < T; t++) acc += dy[t * N + j];
        db[j] += (float)acc;
    }
}

/* ---- cross-entropy ---- */

double loom_cpu_cross_entropy_fwd(const float *logits, const int32_t *targets, int64_t T,
                                  int64_t V, int64_t Vp, float *token_logprob, float *entropy,
                                  float *lse) {
    // logits: (T, Vp), first V columns real; targets, token_logprob, entropy, lse: (T)
    LOOM_ASSERT(V >= 1 && V <= Vp);
#pragma omp parallel for schedule(static) if (T * V > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *z = logits + t * Vp;
        int32_t tg = targets[t];
        LOOM_ASSERT(tg == -100 || (tg >= 0 && tg < V));
        double m = z[0];
        for (int64_t c = 1; c < V; c++)
            if (z[c] > m) m = z[c];
        double s = 0, sz = 0; /* sum exp(z - m), sum exp(z - m) * (z - m) */
        for (int64_t c = 0; c < V; c++) {
            double d = (double)z[c] - m, e = exp(d);
            s += e;
            sz += e * d;
        }
        double ls = log(s); /* lse - m */
        /* entropy = lse - sum p z = log s - sz / s (with z shifted by m) */
        if (entropy) entropy[t] = (float)(ls - sz / s);
        if (lse) lse[t] = (float)(m + ls);
        if (token_logprob) token_logprob[t] = tg < 0 ? 0.0f : (float)((double)z[tg] - m - ls);
    }
    /* the sum in token order (independent of the thread count) */
    double loss = 0;
    for (int64_t t = 0; t < T; t++) {
        int32_t tg = targets[t];
        if (tg < 0) continue;
        const float *z = logits + t * Vp;
        double m = z[0];
        for (int64_t c = 1; c < V; c++)
            if (z[c] > m) m = z[c];
        double s = 0;
        for (int64_t c = 0; c < V; c++) s += exp((double)z[c] - m);
        loss -= (double)z[tg] - m - log(s);
    }
    return loss;
}

void loom_cpu_cross_entropy_bwd(const float *logits, const float *lse, const int32_t *targets,
                                int64_t T, int64_t V, int64_t Vp, float scale, float *dlogits) {
    // logits, dlogits: (T, Vp) (may be the same buffer); lse, targets: (T)
#pragma omp parallel for schedule(static) if (T * V > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *z = logits + t * Vp;
        float *dz = dlogits + t * Vp;
        int32_t tg = targets[t];
        if (tg < 0) {
            for (int64_t c = 0; c < Vp; c++) dz[c] = 0.0f;
            continue;
        }
        double l = lse[t];
        for (int64_t c = 0; c < V; c++) {
            double p = exp((double)z[c] - l);
            dz[c] = (float)(scale * (p - (c == tg ? 1.0 : 0.0)));
        }
        for (int64_t c = V; c < Vp; c++) dz[c] = 0.0f;
    }
}
