/* CPU reference attention: causal, grouped-query, masked to documents given
 * by cu_seqlens (packed sequences). No T x T buffers: each query (or key)
 * row recomputes its scores; dot products and softmax sums are in double. */
#include <math.h>

#include "../../core/core.h"
#include "cpu_ops.h"

/* The document [*s, *e) holding token t: binary search of cu_seqlens (ndocs+1). */
static void doc_bounds(const int32_t *cu, int64_t ndocs, int64_t t, int64_t *s, int64_t *e) {
    int64_t lo = 0, hi = ndocs; /* cu[lo] <= t < cu[hi] */
    while (hi - lo > 1) {
        int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    *s = cu[lo];
    *e = cu[hi];
}

static double dot(const float *a, const float *b, int64_t D) {
    double acc = 0;
    for (int64_t d = 0; d < D; d++) acc += (double)a[d] * b[d];
    return acc;
}

void loom_cpu_attention_fwd(const float *q, const float *k, const float *v, int64_t T,
                            int64_t Hq, int64_t Hkv, int64_t D, const int32_t *cu_seqlens,
                            int64_t ndocs, float scale, float *out, float *lse) {
    loom_cpu_attention_fwd_q(q, NULL, T, k, v, T, Hq, Hkv, D, cu_seqlens, ndocs, scale, out, lse);
}

void loom_cpu_attention_fwd_q(const float *q, const int32_t *qidx, int64_t Tq, const float *k,
                              const float *v, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                              const int32_t *cu_seqlens, int64_t ndocs, float scale, float *out,
                              float *lse) {
    // q, out: (Tq, Hq, D); k, v: (T, Hkv, D); cu_seqlens: (ndocs+1); lse: (Tq, Hq)
    LOOM_ASSERT(Hkv > 0 && Hq % Hkv == 0 && D <= LOOM_CPU_ATTN_MAX_D);
    LOOM_ASSERT(ndocs >= 1 && cu_seqlens[0] == 0 && cu_seqlens[ndocs] == T);
    const int64_t group = Hq / Hkv;
#pragma omp parallel for schedule(dynamic, 16) if (Tq * Hq > 64)
    for (int64_t row = 0; row < Tq * Hq; row++) {
        int64_t i = qidx ? qidx[row / Hq] : row / Hq, h = row % Hq, hk = h / group, s, e;
        doc_bounds(cu_seqlens, ndocs, i, &s, &e);
        const float *qi = q + row * D;
        /* one pass, online softmax: rescale the running sums when the max grows */
        double m = -INFINITY, acc[LOOM_CPU_ATTN_MAX_D], l = 0;
        for (int64_t d = 0; d < D; d++) acc[d] = 0;
        for (int64_t j = s; j <= i; j++) {
            double sc = scale * dot(qi, k + (j * Hkv + hk) * D, D);
            if (sc > m) {
                double c = exp(m - sc); /* 0 on the first key */
                l *= c;
                for (int64_t d = 0; d < D; d++) acc[d] *= c;
                m = sc;
            }
            double p = exp(sc - m);
            const float *vj = v + (j * Hkv + hk) * D;
            l += p;
            for (int64_t d = 0; d < D; d++) acc[d] += p * vj[d];
        }
        float *o = out + row * D;
        for (int64_t d = 0; d < D; d++) o[d] = (float)(acc[d] / l);
        lse[row] = (float)(m + log(l));
    }
}

void loom_cpu_attention_bwd(const float *dout, const float *q, const float *k, const float *v,
                            const float *out, const float *lse, int64_t T, int64_t Hq,
                            int64_t Hkv, int64_t D, const int32_t *cu_seqlens, int64_t ndocs,
                            float scale, float *dq, float *dk, float *dv) {
    loom_cpu_attention_bwd_q(dout, q, NULL, T, k, v, out, lse, T, Hq, Hkv, D, cu_seqlens, ndocs,
                             scale, dq, dk, dv);
}

/* First local query whose global index is >= g (qidx ascending). */
static int64_t first_query_at(const int32_t *qidx, int64_t Tq, int64_t g) {
    if (!qidx) return g;
    int64_t lo = 0, hi = Tq;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (qidx[mid] < g)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

void loom_cpu_attention_bwd_q(const float *dout, const float *q, const int32_t *qidx, int64_t Tq,
                              const float *k, const float *v, const float *out, const float *lse,
                              int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                              const int32_t *cu_seqlens, int64_t ndocs, float scale, float *dq,
                              float *dk, float *dv) {
    // dout, q, out, dq: (T, Hq, D); k, v, dk, dv: (T, Hkv, D); lse: (T, Hq).
    // P_ij = exp(s_ij - lse_i), dP_ij = dout_i . v_j, D_i = dout_i . out_i,
    // dS_ij = P_ij (dP_ij - D_i); dq_i = scale sum_j dS_ij k_j,
    // dk_j = scale sum_i dS_ij q_i, dv_j = sum_i P_ij dout_i (i over the group's heads).
    // Two passes (query rows, then key rows) so that no two threads write one row.
    LOOM_ASSERT(Hkv > 0 && Hq % Hkv == 0 && D <= LOOM_CPU_ATTN_MAX_D);
    LOOM_ASSERT(ndocs >= 1 && cu_seqlens[0] == 0 && cu_seqlens[ndocs] == T);
    const int64_t group = Hq / Hkv;
#pragma omp parallel for schedule(dynamic, 16) if (Tq * Hq > 64)
    for (int64_t row = 0; row < Tq * Hq; row++) {
        int64_t i = qidx ? qidx[row / Hq] : row / Hq, h = row % Hq, hk = h / group, s, e;
        doc_bounds(cu_seqlens, ndocs, i, &s, &e);
        const float *qi = q + row * D, *doi = dout + row * D;
        double Di = dot(doi, out + row * D, D), li = lse[row];
        double acc[LOOM_CPU_ATTN_MAX_D];
        for (int64_t d = 0; d < D; d++) acc[d] = 0;
        for (int64_t j = s; j <= i; j++) {
            const float *kj = k + (j * Hkv + hk) * D, *vj = v + (j * Hkv + hk) * D;
            double p = exp(scale * dot(qi, kj, D) - li);
            double ds = p * (dot(doi, vj, D) - Di);
            for (int64_t d = 0; d < D; d++) acc[d] += ds * kj[d];
        }
        float *dqi = dq + row * D;
        for (int64_t d = 0; d < D; d++) dqi[d] = (float)(scale * acc[d]);
    }
#pragma omp parallel for schedule(dynamic, 16) if (T * Hkv > 64)
    for (int64_t row = 0; row < T * Hkv; row++) {
        int64_t j = row / Hkv, hk = row % Hkv, s, e;
        doc_bounds(cu_seqlens, ndocs, j, &s, &e);
        const float *kj = k + row * D, *vj = v + row * D;
        double ak[LOOM_CPU_ATTN_MAX_D], av[LOOM_CPU_ATTN_MAX_D];
        for (int64_t d = 0; d < D; d++) ak[d] = av[d] = 0;
        int64_t i1 = first_query_at(qidx, Tq, e);
        for (int64_t i = first_query_at(qidx, Tq, j); i < i1; i++)
            for (int64_t h = hk * group; h < (hk + 1) * group; h++) {
                int64_t qrow = i * Hq + h;
                const float *qi = q + qrow * D, *doi = dout + qrow * D;
                double p = exp(scale * dot(qi, kj, D) - lse[qrow]);
                double ds = p * (dot(doi, vj, D) - dot(doi, out + qrow * D, D));
                for (int64_t d = 0; d < D; d++) {
                    ak[d] += ds * qi[d];
                    av[d] += p * doi[d];
                }
            }
        float *dkj = dk + row * D, *dvj = dv + row * D;
        for (int64_t d = 0; d < D; d++) {
            dkj[d] = (float)(scale * ak[d]);
            dvj[d] = (float)av[d];
        }
    }
}
