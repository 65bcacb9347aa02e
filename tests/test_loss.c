/* The loss hook's per-token weights (loom_batch.loss_weights, the
 * cross-entropy of src/model/loss_ce.c), through the public API on the CPU:
 * weights of 1 change nothing (bit for bit), weights of 2 double the loss
 * and every gradient exactly (a power of two scales every rounding alike),
 * weights of 0 and 1 are the targets masked with -100 (the count of tokens
 * aside), any weights give the loss from forward_only's log-probs, and
 * non-finite weights are refused before any compute. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../include/loom.h"
#include "harness.h"

enum { ROWS = 2, SEQ = 20, T = ROWS * SEQ };

typedef struct fx {
    loom_ctx *ctx;
    loom_model *m;
    int32_t ids[T], tgt[T];
    int64_t ntensors;
} fx;

static bool fx_open(fx *f) {
    memset(f, 0, sizeof *f);
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3", loom_test_fixtures());
    if (loom_ctx_create(&f->ctx)) return false;
    if (loom_model_create(f->ctx, dir, NULL, &f->m)) return false;
    loom_model_info info;
    loom_model_get_info(f->m, &info);
    f->ntensors = info.num_tensors;
    for (int t = 0; t < T; t++) {
        f->ids[t] = (int32_t)((t * 37 + 11) % info.vocab_size);
        f->tgt[t] = t % SEQ == SEQ - 1 ? -100 : (int32_t)((t * 53 + 5) % info.vocab_size);
    }
    return true;
}

static void fx_close(fx *f) {
    loom_model_free(f->m);
    loom_ctx_free(f->ctx);
}

static int64_t grad_count(fx *f) {
    int64_t total = 0;
    for (int64_t i = 0; i < f->ntensors; i++) {
        int nd;
        int64_t sh[2];
        loom_model_tensor_name(f->m, i, &nd, sh);
        total += nd == 1 ? sh[0] : sh[0] * sh[1];
    }
    return total;
}

/* Every gradient, concatenated, after one forward_backward with weights w
 * (NULL: none) and targets tgt; *res the call's result. NULL on failure. */
static float *grads_of(fx *f, const int32_t *tgt, const float *w, loom_fb_result *res) {
    loom_model_zero_grad(f->m);
    loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = f->ids, .targets = tgt,
                    .loss_weights = w};
    if (loom_model_forward_backward(f->m, &b, 2, res)) {
        fprintf(stderr, "    forward_backward: %s\n", loom_last_error(f->ctx));
        return NULL;
    }
    float *g = malloc((size_t)grad_count(f) * sizeof *g), *p = g;
    for (int64_t i = 0; g && i < f->ntensors; i++) {
        int nd;
        int64_t sh[2];
        const char *name = loom_model_tensor_name(f->m, i, &nd, sh);
        const int64_t n = nd == 1 ? sh[0] : sh[0] * sh[1];
        if (loom_model_get_grad(f->m, name, p, n)) {
            fprintf(stderr, "    get_grad(%s): %s\n", name, loom_last_error(f->ctx));
            free(g);
            return NULL;
        }
        p += n;
    }
    return g;
}

TEST(loss_weights_of_one_and_two) {
    fx f;
    REQUIRE(fx_open(&f));
    const int64_t n = grad_count(&f);
    float ones[T], twos[T];
    for (int t = 0; t < T; t++) ones[t] = 1.0f, twos[t] = 2.0f;
    loom_fb_result r0, r1, r2;
    float *g0 = grads_of(&f, f.tgt, NULL, &r0), *g1 = grads_of(&f, f.tgt, ones, &r1),
          *g2 = grads_of(&f, f.tgt, twos, &r2);
    REQUIRE(g0 && g1 && g2);
    CHECK(r0.n_tokens == r1.n_tokens && r0.n_tokens == r2.n_tokens && r0.n_tokens == T - ROWS);
    CHECK_MSG(r1.loss_sum == r0.loss_sum, "weights of 1: loss sum %.17g, unweighted %.17g",
              r1.loss_sum, r0.loss_sum);
    CHECK_MSG(!memcmp(g1, g0, (size_t)n * sizeof *g0), "weights of 1 changed a gradient");
    CHECK_NEAR(r2.loss_sum, 2.0 * r0.loss_sum, 1e-12 * fabs(r0.loss_sum));
    int64_t off = 0;
    for (int64_t i = 0; i < n; i++) off += g2[i] != 2.0f * g0[i];
    CHECK_MSG(off == 0, "weights of 2: %lld of %lld gradient values are not exactly doubled",
              (long long)off, (long long)n);
    free(g0), free(g1), free(g2);
    fx_close(&f);
}

TEST(loss_weights_of_zero_mask_tokens) {
    fx f;
    REQUIRE(fx_open(&f));
    const int64_t n = grad_count(&f);
    float w[T];
    int32_t masked[T];
    for (int t = 0; t < T; t++) {
        const bool keep = (t * 7) % 5 < 3;
        w[t] = keep ? 1.0f : 0.0f;
        masked[t] = keep ? f.tgt[t] : -100;
    }
    loom_fb_result rw, rm;
    float *gw = grads_of(&f, f.tgt, w, &rw), *gm = grads_of(&f, masked, NULL, &rm);
    REQUIRE(gw && gm);
    CHECK_NEAR(rw.loss_sum, rm.loss_sum, 1e-12 * fabs(rm.loss_sum));
    /* the same summed gradient; get_grad divides by each call's own count */
    const double k = (double)rm.n_tokens / (double)rw.n_tokens;
    double worst = 0.0, big = 0.0;
    for (int64_t i = 0; i < n; i++) {
        worst = fmax(worst, fabs(gw[i] - k * gm[i]));
        big = fmax(big, fabs((double)gm[i]));
    }
    CHECK_MSG(worst <= 1e-6 * big, "weights of 0 vs targets of -100: gradients differ by %.3g "
              "(largest %.3g)", worst, big);
    free(gw), free(gm);
    fx_close(&f);
}

TEST(loss_weights_give_the_weighted_sum_of_log_probs) {
    fx f;
    REQUIRE(fx_open(&f));
    float w[T], lp[T];
    for (int t = 0; t < T; t++) w[t] = (float)((t * 29) % 17) / 8.0f - 1.0f; /* some negative */
    loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = f.ids, .targets = f.tgt};
    loom_fb_result ro, rw;
    REQUIRE_OK(f.ctx, loom_model_forward_only(f.m, &b, 1, lp, NULL, NULL, &ro));
    free(grads_of(&f, f.tgt, w, &rw));
    double want = 0.0;
    for (int t = 0; t < T; t++)
        if (f.tgt[t] != -100) want -= (double)w[t] * lp[t];
    CHECK_NEAR(rw.loss_sum, want, 1e-5 * (1.0 + fabs(want)));
    CHECK_EQ_INT(rw.n_tokens, T - ROWS);
    fx_close(&f);
}

TEST(loss_weights_must_be_finite) {
    fx f;
    REQUIRE(fx_open(&f));
    float w[T];
    for (int t = 0; t < T; t++) w[t] = 1.0f;
    w[SEQ + 3] = NAN;
    loom_batch b = {.rows = ROWS, .seq_len = SEQ, .input_ids = f.ids, .targets = f.tgt,
                    .loss_weights = w};
    loom_fb_result r;
    CHECK(loom_model_forward_backward(f.m, &b, 1, &r) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(f.ctx), "loss_weights[1, 3]");
    CHECK_CONTAINS(loom_last_error(f.ctx), "not a finite number");
    fx_close(&f);
}
