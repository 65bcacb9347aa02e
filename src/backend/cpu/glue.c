/* CPU reference glue ops (cpu_glue.h): vocab-parallel embedding and
 * cross-entropy pieces, context-parallel row permutations, LoRA dropout.
 * The loops are those of src/model/forward.c and src/model/lora.c with their
 * arguments made explicit, so the numbers are the same bit for bit. */
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "../../core/rng.h"
#include "cpu_glue.h"

/* ---- vocab-parallel embedding ---- */

void loom_cpu_embedding_vp_fwd(const int32_t *ids, int64_t T, const float *W, int64_t row0,
                               int64_t rows, int64_t H, float *out) {
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (int64_t t = 0; t < T; t++) {
        const int64_t r = (int64_t)ids[t] - row0;
        float *o = out + t * H;
        if (r >= 0 && r < rows)
            memcpy(o, W + r * H, (size_t)H * sizeof *o);
        else
            memset(o, 0, (size_t)H * sizeof *o);
    }
}

void loom_cpu_embedding_vp_bwd(const int32_t *ids, int64_t T, const float *dout, int64_t row0,
                               int64_t rows, int64_t H, float *dW) {
    // Threads own column blocks, so repeated ids never race and every element
    // sums its tokens in token order, whatever the thread count.
    const int64_t blk = 64, nblk = (H + blk - 1) / blk;
#pragma omp parallel for schedule(static) if (T * H > 65536)
    for (int64_t b = 0; b < nblk; b++) {
        const int64_t j0 = b * blk, j1 = j0 + blk < H ? j0 + blk : H;
        for (int64_t t = 0; t < T; t++) {
            const int64_t r = (int64_t)ids[t] - row0;
            if (r < 0 || r >= rows) continue;
            float *w = dW + r * H;
            const float *d = dout + t * H;
            for (int64_t j = j0; j < j1; j++) w[j] += d[j];
        }
    }
}

/* ---- vocab-parallel cross-entropy ---- */

static int64_t clamp_valid(int64_t nvalid, int64_t ld) {
    return nvalid < 0 ? 0 : nvalid > ld ? ld : nvalid;
}

void loom_cpu_ce_vp_max(const float *logits, int64_t c, int64_t ld, int64_t nvalid, double *mx) {
    nvalid = clamp_valid(nvalid, ld);
#pragma omp parallel for schedule(static) if (c * nvalid > 65536)
    for (int64_t r = 0; r < c; r++) {
        const float *z = logits + r * ld;
        double m = -INFINITY;
        for (int64_t j = 0; j < nvalid; j++)
            if (z[j] > m) m = z[j];
        mx[r] = m;
    }
}

void loom_cpu_ce_vp_sums(const float *logits, int64_t c, int64_t ld, int64_t nvalid,
                         const int32_t *tgt, int64_t v0, const double *mx, double *ce) {
    nvalid = clamp_valid(nvalid, ld);
#pragma omp parallel for schedule(static) if (c * nvalid > 65536)
    for (int64_t r = 0; r < c; r++) {
        const float *z = logits + r * ld;
        double se = 0, sez = 0, zt = 0;
        const double m = mx[r];
        for (int64_t j = 0; j < nvalid; j++) {
            double e = exp((double)z[j] - m);
            se += e;
            sez += e * z[j];
        }
        const int64_t t = (int64_t)tgt[r] - v0;
        if (tgt[r] != -100 && t >= 0 && t < nvalid) zt = z[t];
        ce[r * 3 + 0] = se;
        ce[r * 3 + 1] = sez;
        ce[r * 3 + 2] = zt;
    }
}

void loom_cpu_ce_vp_grad(float *logits, int64_t c, int64_t ld, int64_t nvalid, const int32_t *tgt,
                         int64_t v0, const double *mx, const double *ce, float scale) {
    nvalid = clamp_valid(nvalid, ld);
#pragma omp parallel for schedule(static) if (c * ld > 65536)
    for (int64_t r = 0; r < c; r++) {
        float *z = logits + r * ld;
        if (tgt[r] == -100) {
            memset(z, 0, (size_t)ld * sizeof *z);
            continue;
        }
        const double l = mx[r] + log(ce[3 * r]), s = (double)scale;
        for (int64_t j = 0; j < ld; j++)
            z[j] = j < nvalid ? (float)(s * exp((double)z[j] - l)) : 0.0f;
        const int64_t t = (int64_t)tgt[r] - v0;
        if (t >= 0 && t < nvalid) z[t] -= scale;
    }
}

void loom_cpu_rows_scale(float *x, int64_t c, int64_t ld, const float *w) {
#pragma omp parallel for schedule(static) if (c * ld > 65536)
    for (int64_t r = 0; r < c; r++)
        for (int64_t j = 0; j < ld; j++) x[r * ld + j] *= w[r];
}

/* ---- row permutations ---- */

void loom_cpu_rows_gather(void *dst, const void *src, const int32_t *idx, int64_t n,
                          int64_t width, size_t esz) {
    const size_t row = (size_t)width * esz;
#pragma omp parallel for schedule(static) if ((size_t)n * row > ((size_t)1 << 20))
    for (int64_t j = 0; j < n; j++)
        memcpy((char *)dst + (size_t)j * row, (const char *)src + (size_t)idx[j] * row, row);
}

void loom_cpu_rows_scatter(void *dst, const void *src, const int32_t *idx, int64_t n,
                           int64_t width, size_t esz) {
    const size_t row = (size_t)width * esz;
#pragma omp parallel for schedule(static) if ((size_t)n * row > ((size_t)1 << 20))
    for (int64_t j = 0; j < n; j++)
        memcpy((char *)dst + (size_t)idx[j] * row, (const char *)src + (size_t)j * row, row);
}

/* ---- LoRA dropout ---- */

void loom_cpu_lora_dropout(float *out, const float *x, int64_t T, int64_t in, int64_t full,
                           int64_t col0, const int32_t *qidx, int64_t out0, uint64_t seed,
                           uint64_t key, double p) {
    const float keep_scale = (float)(1.0 / (1.0 - p));
#pragma omp parallel for schedule(static) if (T * in > 65536)
    for (int64_t t = 0; t < T; t++) {
        const uint64_t g = (uint64_t)(out0 + (qidx ? qidx[t] : t));
        for (int64_t k = 0; k < in; k++) {
            const uint64_t idx = g * (uint64_t)full + (uint64_t)(col0 + k);
            const bool kept = loom_rng_uniform(seed, key, idx) >= p;
            const float v = x ? x[t * in + k] : out[t * in + k];
            out[t * in + k] = kept ? v * keep_scale : 0.0f;
        }
    }
}
