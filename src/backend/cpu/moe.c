/* CPU reference ops of a mixture-of-experts block (cpu_moe.h). */
#include "cpu_moe.h"

#include <math.h>
#include <string.h>

/* ---- router ---- */

void loom_cpu_router_fwd(const float *z, int64_t N, int64_t E, int k, bool norm_topk, float *probs,
                         int32_t *idx, float *w, float *psum, float *lse) {
#pragma omp parallel for schedule(static) if (N * E > 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *zr = z + n * E;
        float *p = probs + n * E, mx = -INFINITY, sum = 0.0f;
        for (int64_t e = 0; e < E; e++) mx = zr[e] > mx ? zr[e] : mx;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(zr[e] - mx);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        if (lse) lse[n] = mx + logf(sum);
        int32_t *ix = idx + n * k;
        float *wr = w + n * k, top = 0.0f;
        for (int j = 0; j < k; j++) { /* the j-th largest, ties to the lower index */
            int32_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                bool taken = false;
                for (int i = 0; i < j && !taken; i++) taken = ix[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = (int32_t)e;
            }
            ix[j] = best;
            top += wr[j] = p[best];
        }
        if (norm_topk)
            for (int j = 0; j < k; j++) wr[j] /= top;
    }
    if (psum) /* each column in row order, in double */
        for (int64_t e = 0; e < E; e++) {
            double s = 0.0;
            for (int64_t n = 0; n < N; n++) s += probs[n * E + e];
            psum[e] += (float)s;
        }
}

void loom_cpu_router_bwd(const float *probs, const int32_t *idx, const float *dw, const float *ga,
                         const float *lse, const float *zc, int64_t N, int64_t E, int k,
                         bool norm_topk, float *dz) {
#pragma omp parallel for schedule(static) if (N * E > 65536)
    for (int64_t n = 0; n < N; n++) {
        const float *p = probs + n * E;
        const int32_t *ix = idx + n * k;
        float *g = dz + n * E; /* first d/dp, then d/dz in place */
        for (int64_t e = 0; e < E; e++) g[e] = ga ? ga[e] : 0.0f;
        if (dw) {
            const float *d = dw + n * k;
            if (norm_topk) { /* w_j = p_j / S: dp_j = (dw_j - sum_i dw_i w_i) / S */
                double S = 0.0, dot = 0.0;
                for (int j = 0; j < k; j++) S += p[ix[j]];
                for (int j = 0; j < k; j++) dot += (double)d[j] * (p[ix[j]] / S);
                for (int j = 0; j < k; j++) g[ix[j]] += (float)((d[j] - dot) / S);
            } else {
                for (int j = 0; j < k; j++) g[ix[j]] += d[j];
            }
        }
        double s = 0.0; /* softmax: dz = p (dp - sum p dp) */
        for (int64_t e = 0; e < E; e++) s += (double)p[e] * g[e];
        /* the z-loss: d/dz = (d loss / d lse) p */
        const double zl = lse ? (double)zc[0] * lse[n] : 0.0;
        for (int64_t e = 0; e < E; e++) g[e] = (float)(p[e] * (g[e] - s + zl));
    }
}

double loom_cpu_moe_aux_loss(const float *probs, const int32_t *idx, int64_t N, int64_t E, int k,
                             float scale, double *scratch, float *ga) {
    double *f = scratch, *P = scratch + E;
    memset(scratch, 0, (size_t)(2 * E) * sizeof *scratch);
    for (int64_t n = 0; n < N; n++) {
        for (int j = 0; j < k; j++) f[idx[n * k + j]] += 1.0;
        for (int64_t e = 0; e < E; e++) P[e] += probs[n * E + e];
    }
    double aux = 0.0;
    for (int64_t e = 0; e < E; e++) {
        f[e] /= (double)N;
        aux += f[e] * (P[e] / (double)N);
    }
    aux *= (double)E;
    if (ga)
        for (int64_t e = 0; e < E; e++) ga[e] = (float)(scale * (double)E * f[e] / (double)N);
    return aux;
}

/* ---- tokens to experts and back ---- */

/* Where choice c of expert e ranks among e's choices for keeping: by
 * weight, the larger first and the earlier token on a tie ("probs"). */
static int64_t rank_by_weight(const int32_t *seg, int64_t n, const float *w, int32_t c) {
    int64_t r = 0;
    for (int64_t i = 0; i < n; i++) r += w[seg[i]] > w[c] || (w[seg[i]] == w[c] && seg[i] < c);
    return r;
}

void loom_cpu_moe_route(const int32_t *idx, const float *w, int64_t N, int64_t E, int k,
                        int64_t cap, bool by_position, int32_t *counts, int32_t *order,
                        int32_t *pos) {
    const int64_t C = N * k;
    if (cap < 0 || cap >= N) { /* no expert has more than N choices: dropless */
        memset(counts, 0, (size_t)E * sizeof *counts);
        int64_t p = 0;
        for (int64_t e = 0; e < E; e++) /* one pass an expert: stable, and no scratch */
            for (int64_t c = 0; c < C; c++)
                if (idx[c] == e) {
                    counts[e]++;
                    pos[c] = (int32_t)p;
                    order[p++] = (int32_t)c;
                }
        return;
    }
    /* pos[c] first holds c's rank among its expert's choices: in token
     * order, then (probs) by weight within the experts over capacity, their
     * choices grouped in order */
    memset(counts, 0, (size_t)E * sizeof *counts);
    for (int64_t c = 0; c < C; c++) pos[c] = counts[idx[c]]++;
    if (!by_position) {
        int64_t p = 0;
        for (int64_t e = 0; e < E; e++)
            for (int64_t c = 0; c < C && counts[e] > cap; c++)
                if (idx[c] == e) order[p++] = (int32_t)c;
        p = 0;
        for (int64_t e = 0; e < E; e++) {
            if (counts[e] <= cap) continue;
#pragma omp parallel for schedule(static) if (counts[e] > 256)
            for (int64_t i = 0; i < counts[e]; i++)
                pos[order[p + i]] = (int32_t)rank_by_weight(order + p, counts[e], w, order[p + i]);
            p += counts[e];
        }
    }
    int64_t kept = 0;
    for (int64_t e = 0; e < E; e++) kept += loom_moe_kept(counts[e], cap);
    int64_t pk = 0, pd = kept;
    for (int64_t e = 0; e < E; e++)
        for (int64_t c = 0; c < C; c++) {
            if (idx[c] != e) continue;
            if (pos[c] < cap) {
                pos[c] = (int32_t)pk;
                order[pk++] = (int32_t)c;
            } else {
                pos[c] = -1;
                order[pd++] = (int32_t)(-1 - c);
            }
        }
}

void loom_cpu_moe_permute(const float *x, const int32_t *order, int64_t N, int k, int64_t H,
                          float *xg) {
#pragma omp parallel for schedule(static) if (N * k * H > 65536)
    for (int64_t p = 0; p < N * k; p++)
        if (order[p] >= 0)
            memcpy(xg + p * H, x + (int64_t)(order[p] / k) * H, (size_t)H * sizeof *xg);
}

void loom_cpu_moe_combine(const float *yg, const int32_t *pos, const float *w, int64_t N, int k,
                          int64_t H, float *y) {
#pragma omp parallel for schedule(static) if (N * k * H > 65536)
    for (int64_t n = 0; n < N; n++) {
        float *yr = y + n * H;
        for (int64_t h = 0; h < H; h++) yr[h] = 0.0f;
        for (int j = 0; j < k; j++) {
            if (pos[n * k + j] < 0) continue; /* dropped */
            const float *g = yg + (int64_t)pos[n * k + j] * H, s = w[n * k + j];
            for (int64_t h = 0; h < H; h++) yr[h] += s * g[h];
        }
    }
}

void loom_cpu_moe_combine_bwd(const float *dy, const float *yg, const int32_t *order,
                              const float *w, int64_t N, int k, int64_t H, float *dyg, float *dw) {
#pragma omp parallel for schedule(static) if (N * k * H > 65536)
    for (int64_t p = 0; p < N * k; p++) {
        const int64_t c = order[p];
        if (c < 0) { /* dropped: the output does not depend on its weight */
            dw[-1 - c] = 0.0f;
            continue;
        }
        const float *d = dy + (c / k) * H, *g = yg + p * H;
        float *o = dyg + p * H;
        double dot = 0.0;
        for (int64_t h = 0; h < H; h++) {
            o[h] = w[c] * d[h];
            dot += (double)d[h] * g[h];
        }
        dw[c] = (float)dot;
    }
}

void loom_cpu_moe_permute_bwd(const float *dxg, const int32_t *pos, int64_t N, int k, int64_t H,
                              float *dx) {
#pragma omp parallel for schedule(static) if (N * k * H > 65536)
    for (int64_t n = 0; n < N; n++) {
        float *o = dx + n * H;
        for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
        for (int j = 0; j < k; j++) {
            if (pos[n * k + j] < 0) continue;
            const float *g = dxg + (int64_t)pos[n * k + j] * H;
            for (int64_t h = 0; h < H; h++) o[h] += g[h];
        }
    }
}

/* ---- the shared expert's gate ---- */

void loom_cpu_moe_gate_fwd(const float *z, const float *s, int64_t N, int64_t H, bool acc,
                           float *g, float *y) {
#pragma omp parallel for schedule(static) if (N * H > 65536)
    for (int64_t n = 0; n < N; n++) {
        if (z) g[n] = 1.0f / (1.0f + expf(-z[n]));
        if (!s) continue;
        const float *sr = s + n * H, w = g[n];
        float *yr = y + n * H;
        for (int64_t h = 0; h < H; h++) yr[h] = acc ? yr[h] + w * sr[h] : w * sr[h];
    }
}

void loom_cpu_moe_gate_bwd(const float *da, const float *a, const float *g, int64_t N, int64_t I,
                           float *dz) {
#pragma omp parallel for schedule(static) if (N * I > 65536)
    for (int64_t n = 0; n < N; n++) {
        double dot = 0.0;
        for (int64_t i = 0; i < I; i++) dot += (double)da[n * I + i] * a[n * I + i];
        dz[n] = (float)((1.0 - (double)g[n]) * dot);
    }
}

void loom_cpu_moe_regroup(const int32_t *rc, int64_t S, int64_t El, int64_t Rt, int32_t *ix) {
    int64_t j = 0;
    for (int64_t e = 0; e < El; e++) {
        int64_t src = 0; /* the first gathered row of block (s, f) */
        for (int64_t s = 0; s < S; s++)
            for (int64_t f = 0; f < El; f++) {
                const int32_t c = rc[s * El + f];
                for (int32_t r = 0; f == e && r < c; r++, j++) {
                    ix[j] = (int32_t)(src + r);
                    ix[Rt + src + r] = (int32_t)j;
                }
                src += c;
            }
    }
}

void loom_cpu_moe_dest(const int32_t *idx, int64_t N, int k, int64_t El, int P, int32_t *dest) {
    for (int64_t n = 0; n < N; n++) {
        for (int p = 0; p < P; p++) dest[n * P + p] = P;
        for (int j = 0; j < k; j++) {
            const int32_t p = (int32_t)(idx[n * k + j] / El);
            dest[n * P + p] = p;
        }
    }
}

void loom_cpu_moe_dedup_meta(const int32_t *ord, int64_t U, const int32_t *idx, const float *w,
                             int k, int64_t El, int P, int32_t *tok, int32_t *mid, float *mw) {
    for (int64_t i = 0; i < U; i++) {
        const int64_t t = ord[i] / P, p = ord[i] % P;
        tok[i] = (int32_t)t;
        for (int j = 0; j < k; j++) {
            const int64_t e = idx[t * k + j] - p * El;
            mid[i * k + j] = (int32_t)(e >= 0 && e < El ? e : El);
            mw[i * k + j] = w[t * k + j];
        }
    }
}

void loom_cpu_moe_mask(const int32_t *key, int64_t N, int k, int32_t none, int32_t *order,
                       int32_t *pos) {
    for (int64_t c = 0; c < N * k; c++)
        if (key[c] == none) {
            order[pos[c]] = (int32_t)(-1 - c);
            pos[c] = -1;
        }
}

void loom_cpu_moe_dedup_dw(const float *dwb, const int32_t *pos, int64_t N, int P, int k,
                           float *dw) {
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < k; j++) {
            float s = 0.0f;
            for (int p = 0; p < P; p++) {
                const int32_t u = pos[n * P + p];
                if (u >= 0) s += dwb[(int64_t)u * k + j];
            }
            dw[n * k + j] = s;
        }
}
