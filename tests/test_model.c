/* The CPU trainer against Hugging Face transformers (tests/fixtures, and
 * tests/fixtures_moe for tiny-qwen2-moe): logits, token log-probs, entropy,
 * loss, every gradient, packed documents, and the 5-step AdamW trajectory,
 * for every tiny model; the MoE models' router and load-balancing loss.
 * Relative error of a tensor = max |loom - ref| / max |ref|. */
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/io/safetensors.h"
#include "../src/model/model.h"
#include "harness.h"

#define TOL 1e-4

typedef struct golden {
    loom_ctx *ctx;
    loom_model *m;
    loom_safetensors *st;
    loom_json *meta;
    char dir[1024];
    int32_t ids[2 * 24], tgt[2 * 24];
} golden;

/* a file of model b's fixture set */
static const char *path_of(char *buf, size_t n, const char *a, const char *b, const char *c) {
    snprintf(buf, n, "%s/%s%s%s", loom_test_fixtures_of(b), a, b, c);
    return buf;
}

/* Reads a golden tensor as float (or int32 for I64/I32) into a new buffer. */
static void *read_tensor(golden *g, const char *name, loom_dtype dt, int64_t *numel) {
    const loom_st_tensor *t = loom_st_find(g->st, name);
    if (!t) return NULL;
    void *buf = malloc((size_t)t->numel * 4);
    if (loom_st_read(g->ctx, t, dt, buf, t->numel)) {
        free(buf);
        return NULL;
    }
    if (numel) *numel = (int64_t)t->numel;
    return buf;
}

static double rel_err(const float *got, const float *ref, int64_t n) {
    double md = 0.0, mr = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (!(d <= md)) md = d; /* NaN propagates */
        if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
    }
    return mr > 0 ? md / mr : md;
}

/* ||loom - ref||_2 / ||ref||_2 */
static double rel_err_l2(const float *got, const float *ref, int64_t n) {
    double dd = 0.0, rr = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - ref[i];
        dd += d * d;
        rr += (double)ref[i] * ref[i];
    }
    return rr > 0 ? sqrt(dd / rr) : sqrt(dd);
}

/* LOOM_TEST_VERBOSE=1 prints every error measured. */
static void note_err(const char *name, double e) {
    if (getenv("LOOM_TEST_VERBOSE")) printf("    %-60s %.3g\n", name, e);
}

#define CHECK_REL(name, got, ref, n)                                                   \
    do {                                                                               \
        double _e = rel_err(got, ref, n);                                              \
        note_err(name, _e);                                                            \
        CHECK_MSG(_e <= TOL, "%s: relative error %.3g > %g", name, _e, TOL);           \
    } while (0)

/* The model on `dev` in fp32 (a GPU test is skipped where there is none). */
static bool golden_open(golden *g, const char *model, loom_device dev) {
    memset(g, 0, sizeof *g);
    char p[1024];
    if (loom_ctx_create(&g->ctx)) return false;
    loom_ctx_set_log_level(g->ctx, LOOM_LOG_ERROR);
    path_of(g->dir, sizeof g->dir, "models/", model, "");
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = dev;
    /* the MoE fixture's gradients and trajectory are of the LM loss alone */
    if (strstr(model, "moe")) o.config_overrides = "{\"router_aux_loss_coef\": 0}";
    if (dev == LOOM_DEVICE_CUDA && !loom_test_have_gpu()) {
        loom_ctx_free(g->ctx);
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return false;
    }
    if (loom_model_create(g->ctx, g->dir, &o, &g->m)) goto fail;
    if (loom_st_open_file(g->ctx, path_of(p, sizeof p, "golden/", model, ".safetensors"), &g->st))
        goto fail;
    if (loom_json_parse_file(g->ctx, path_of(p, sizeof p, "golden/", model, ".json"), &g->meta))
        goto fail;
    if (loom_st_read_named(g->ctx, g->st, "input_ids", 2, (int64_t[]){2, 24}, LOOM_I32, g->ids) ||
        loom_st_read_named(g->ctx, g->st, "targets", 2, (int64_t[]){2, 24}, LOOM_I32, g->tgt))
        goto fail;
    return true;
fail:
    loom_test_fail(__FILE__, __LINE__, "%s: %s", model, loom_last_error(g->ctx));
    return false;
}

static void golden_close(golden *g) {
    loom_model_free(g->m);
    loom_st_close(g->st);
    loom_json_free(g->meta);
    loom_ctx_free(g->ctx);
}

static loom_batch batch_of(golden *g) {
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = g->ids, .targets = g->tgt};
    return b;
}

static double meta_num(golden *g, const char *key) {
    double v = NAN;
    loom_json_get_num(g->ctx, g->meta, key, "golden json", &v);
    return v;
}

/* Forward outputs, loss and every gradient, as one batch and as two
 * micro-batches; as_docs: the batch's two rows packed as two documents of
 * one row (cu_seqlens {0, 24, 48}, positions derived from it), which must
 * give HF's outputs of the two rows, token by token, and its gradients. */
static void check_forward_backward(const char *model, loom_device dev, bool as_docs) {
    golden g;
    if (!golden_open(&g, model, dev)) return;
    loom_batch b = batch_of(&g);
    const int32_t cu[3] = {0, 24, 48};
    if (as_docs) {
        b.rows = 1;
        b.seq_len = 48;
        b.cu_seqlens = cu;
        b.n_docs = 2;
    }
    int64_t n;
    float *ref_logits = read_tensor(&g, "logits", LOOM_F32, &n);
    float *ref_tlp = read_tensor(&g, "token_logprobs", LOOM_F32, NULL);
    float *ref_ent = read_tensor(&g, "entropy", LOOM_F32, NULL); /* fixtures_moe: none */
    REQUIRE(ref_logits && ref_tlp && n == 48 * 1024);
    float *logits = malloc(sizeof(float) * (size_t)n), tlp[48], ent[48];
    loom_fb_result r;
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, tlp, ent, logits, &r));
    CHECK_REL("logits", logits, ref_logits, n);
    CHECK_REL("token_logprobs", tlp, ref_tlp, 48);
    if (ref_ent) CHECK_REL("entropy", ent, ref_ent, 48);
    double ref_loss = meta_num(&g, "loss");
    CHECK_MSG(fabs(r.loss - ref_loss) <= TOL * ref_loss, "loss %.9g vs %.9g", r.loss, ref_loss);
    CHECK_EQ_INT(r.n_tokens, 41);

    for (int n_micro = 1; n_micro <= (as_docs ? 1 : 2); n_micro++) {
        loom_model_zero_grad(g.m);
        REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, n_micro, &r));
        CHECK_MSG(fabs(r.loss - ref_loss) <= TOL * ref_loss, "loss %.9g vs %.9g", r.loss, ref_loss);
        int ngrads = 0;
        for (size_t i = 0; i < loom_st_count(g.st); i++) {
            const loom_st_tensor *t = loom_st_at(g.st, i);
            if (strncmp(t->name, "grad.", 5)) continue;
            ngrads++;
            float *ref = read_tensor(&g, t->name, LOOM_F32, &n);
            float *got = malloc(sizeof(float) * (size_t)n);
            CHECK_OK(g.ctx, loom_model_get_grad(g.m, t->name + 5, got, n));
            CHECK_REL(t->name, got, ref, n);
            free(ref);
            free(got);
        }
        loom_model_info info;
        loom_model_get_info(g.m, &info);
        CHECK_EQ_INT(ngrads, info.num_tensors); /* every trainable tensor has a reference */
    }
    free(logits);
    free(ref_logits);
    free(ref_tlp);
    free(ref_ent);
    golden_close(&g);
}

static int64_t tensor_numel(golden *g, int64_t i) {
    int nd;
    int64_t sh[2];
    loom_model_tensor_name(g->m, i, &nd, sh);
    return nd == 2 ? sh[0] * sh[1] : sh[0];
}

/* Every trainable tensor's gradient (get_grad: of the mean loss of the
 * calls since the last zero_grad), concatenated in tensor order. */
static float *all_grads(golden *g, int64_t *total) {
    loom_model_info info;
    loom_model_get_info(g->m, &info);
    int64_t n = 0;
    for (int64_t i = 0; i < info.num_tensors; i++) n += tensor_numel(g, i);
    float *all = malloc(sizeof(float) * (size_t)n), *p = all;
    for (int64_t i = 0; i < info.num_tensors; i++) {
        const char *name = loom_model_tensor_name(g->m, i, NULL, NULL);
        if (loom_model_get_grad(g->m, name, p, tensor_numel(g, i))) {
            loom_test_fail(__FILE__, __LINE__, "%s: %s", name, loom_last_error(g->ctx));
            free(all);
            return NULL;
        }
        p += tensor_numel(g, i);
    }
    *total = n;
    return all;
}

/* The tolerance of loom against loom (the same kernels on a packed row and
 * on its documents alone): only the order of fp32 sums differs. */
#define PACK_TOL 1e-5

#define CHECK_SAME(name, got, ref, n)                                                  \
    do {                                                                               \
        double _e = rel_err(got, ref, n);                                              \
        note_err(name, _e);                                                            \
        CHECK_MSG(_e <= PACK_TOL, "%s: packed vs alone, relative error %.3g > %g", name, _e, \
                  PACK_TOL);                                                           \
    } while (0)

/* Three documents packed in one row (the fixture's): log-probs and the loss
 * against HF; and, loom against loom, the row equals its documents run
 * alone: token log-probs, entropy, loss, and every gradient equal to the
 * documents' gradients weighted by their token counts over the total (the
 * loss is the sum of token losses over the batch's token count). */
static void check_packed(const char *model, loom_device dev) {
    golden g;
    if (!golden_open(&g, model, dev)) return;
    int32_t *ids = read_tensor(&g, "packed.input_ids", LOOM_I32, NULL);
    int32_t *pos = read_tensor(&g, "packed.position_ids", LOOM_I32, NULL);
    int32_t *cu = read_tensor(&g, "packed.cu_seqlens", LOOM_I32, NULL);
    float *ref = read_tensor(&g, "packed.token_logprobs", LOOM_F32, NULL);
    REQUIRE(ids && pos && cu && ref);
    int32_t tgt[28];
    int64_t nvalid = 0;
    double ref_sum = 0;
    for (int d = 0; d < 3; d++)
        for (int t = cu[d]; t < cu[d + 1]; t++) {
            tgt[t] = t + 1 < cu[d + 1] ? ids[t + 1] : -100;
            if (tgt[t] != -100) nvalid++, ref_sum -= ref[t];
        }
    float tlp[28], ent[28];
    loom_fb_result r;
    loom_batch b = {.rows = 1, .seq_len = 28, .input_ids = ids, .targets = tgt,
                    .cu_seqlens = cu, .n_docs = 3, .position_ids = pos};
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, tlp, ent, NULL, &r));
    /* On the CPU loom is within 3e-7 of HF here (fp32 rounding), so 1e-5:
     * a tenfold RMSNorm epsilon moves these log-probs by 8e-5, inside TOL. */
    double tol = dev == LOOM_DEVICE_CPU ? 1e-5 : TOL;
    double e = rel_err(tlp, ref, 28);
    note_err("packed.token_logprobs", e);
    CHECK_MSG(e <= tol, "packed.token_logprobs: relative error %.3g > %g", e, tol);
    CHECK_EQ_INT(r.n_tokens, nvalid);
    double ref_loss = ref_sum / (double)nvalid; /* HF's, from its token log-probs */
    note_err("packed.loss", fabs(r.loss - ref_loss) / ref_loss);
    CHECK_MSG(fabs(r.loss - ref_loss) <= tol * ref_loss, "packed loss %.9g vs HF %.9g", r.loss,
              ref_loss);
    /* positions derived from cu_seqlens when not given */
    b.position_ids = NULL;
    float tlp2[28];
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, tlp2, NULL, NULL, NULL));
    CHECK(!memcmp(tlp, tlp2, sizeof tlp));
    b.position_ids = pos;

    /* The packed row's gradient and loss. */
    int64_t ng = 0, ng1 = 0;
    loom_model_zero_grad(g.m);
    REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 1, &r));
    CHECK_EQ_INT(r.n_tokens, nvalid);
    float *packed_grad = all_grads(&g, &ng);
    REQUIRE(packed_grad);
    double *want_grad = calloc((size_t)ng, sizeof(double));
    float alone_tlp[28], alone_ent[28];
    double alone_sum = 0;
    int64_t alone_n = 0;
    for (int d = 0; d < 3; d++) {
        int64_t a = cu[d], len = cu[d + 1] - cu[d];
        loom_batch one = {.rows = 1, .seq_len = len, .input_ids = ids + a, .targets = tgt + a};
        REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &one, 1, alone_tlp + a, alone_ent + a,
                                                  NULL, NULL));
        loom_fb_result rd;
        loom_model_zero_grad(g.m);
        REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &one, 1, &rd));
        alone_sum += rd.loss_sum;
        alone_n += rd.n_tokens;
        float *gd = all_grads(&g, &ng1);
        REQUIRE(gd && ng1 == ng);
        double w = (double)rd.n_tokens / (double)nvalid;
        for (int64_t i = 0; i < ng; i++) want_grad[i] += w * gd[i];
        free(gd);
    }
    loom_model_zero_grad(g.m);
    CHECK_SAME("packed vs alone: token_logprobs", tlp, alone_tlp, 28);
    CHECK_SAME("packed vs alone: entropy", ent, alone_ent, 28);
    CHECK_EQ_INT(alone_n, nvalid);
    double alone_loss = alone_sum / (double)alone_n;
    note_err("packed vs alone: loss", fabs(r.loss - alone_loss) / alone_loss);
    CHECK_MSG(fabs(r.loss - alone_loss) <= PACK_TOL * alone_loss,
              "packed loss %.9g vs %.9g of the documents alone", r.loss, alone_loss);
    float *want = malloc(sizeof(float) * (size_t)ng);
    for (int64_t i = 0; i < ng; i++) want[i] = (float)want_grad[i];
    loom_model_info info;
    loom_model_get_info(g.m, &info);
    for (int64_t i = 0, off = 0; i < info.num_tensors; off += tensor_numel(&g, i), i++) {
        char name[160];
        snprintf(name, sizeof name, "packed vs alone: grad.%s", loom_model_tensor_name(g.m, i, NULL, NULL));
        CHECK_SAME(name, packed_grad + off, want + off, tensor_numel(&g, i));
    }
    free(want);
    free(want_grad);
    free(packed_grad);
    free(ids);
    free(pos);
    free(cu);
    free(ref);
    golden_close(&g);
}

/* Mixture of experts: each layer's router probabilities against softmax of
 * HF's router logits (router_logits.<l>, [B*T, E]), and the load-balancing
 * loss over all layers against load_balancing_loss_func's. */
static void check_router(const char *model, loom_device dev) {
    golden g;
    if (!golden_open(&g, model, dev)) return;
    loom_batch b = batch_of(&g);
    loom_fb_result r;
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r));
    const int64_t E = g.m->cfg.num_experts, L = g.m->L, N = 48;
    const loom_acts *a = &g.m->chunks[0].pool[0]; /* the one micro-batch's, kept until the next */
    /* router_logits.<i>: the i-th MoE layer's (the dense layers have none) */
    int64_t moe_of[64], nmoe = 0;
    for (int64_t l = 0; l < L && l < 64; l++)
        if (loom_config_layer_is_moe(&g.m->cfg, l)) moe_of[nmoe++] = l;
    for (int64_t i = 0; i < nmoe; i++) {
        const int64_t l = moe_of[i];
        char name[64];
        snprintf(name, sizeof name, "router_logits.%lld", (long long)i);
        int64_t n;
        float *z = read_tensor(&g, name, LOOM_F32, &n);
        REQUIRE(z && n == N * E);
        float *want = malloc(sizeof(float) * (size_t)n), *got = malloc(sizeof(float) * (size_t)n);
        for (int64_t t = 0; t < N; t++) {
            double mx = -INFINITY, sum = 0.0;
            for (int64_t e = 0; e < E; e++) mx = fmax(mx, z[t * E + e]);
            for (int64_t e = 0; e < E; e++) sum += exp(z[t * E + e] - mx);
            for (int64_t e = 0; e < E; e++) want[t * E + e] = (float)(exp(z[t * E + e] - mx) / sum);
        }
        REQUIRE_OK(g.ctx, loom_k_download(g.m, got, a->lay[l].act[1][0], (size_t)n * sizeof(float)));
        snprintf(name, sizeof name, "router probabilities, layer %lld", (long long)l);
        CHECK_REL(name, got, want, n);
        free(z), free(want), free(got);
    }
    const double hf = meta_num(&g, "hf_aux_loss_unscaled");
    note_err("aux loss", fabs(r.aux_loss - hf) / hf);
    CHECK_MSG(fabs(r.aux_loss - hf) <= 1e-5 * hf, "aux loss %.9g vs HF %.9g", r.aux_loss, hf);
    /* the step's statistics: tokens per expert from HF's top-2 of each layer */
    double lo = INFINITY, hi = 0.0, imb = 0.0;
    double *want_cnt = calloc((size_t)(L * E), sizeof(double));
    int64_t worst = -1;
    REQUIRE(want_cnt);
    for (int64_t i = 0; i < nmoe; i++) {
        char name[64];
        snprintf(name, sizeof name, "router_logits.%lld", (long long)i);
        float *z = read_tensor(&g, name, LOOM_F32, NULL);
        REQUIRE(z);
        double cnt[8] = {0}, lmax = 0.0;
        REQUIRE(E == 8 && g.m->cfg.num_experts_per_tok == 2);
        for (int64_t t = 0; t < N; t++) {
            int top = 0, b2 = -1;
            for (int e = 1; e < E; e++) top = z[t * E + e] > z[t * E + top] ? e : top;
            for (int e = 0; e < E; e++)
                if (e != top && (b2 < 0 || z[t * E + e] > z[t * E + b2])) b2 = e;
            cnt[top]++, cnt[b2]++;
        }
        for (int e = 0; e < E; e++) lo = fmin(lo, cnt[e]), hi = fmax(hi, cnt[e]), lmax = fmax(lmax, cnt[e]);
        for (int e = 0; e < E; e++) want_cnt[moe_of[i] * E + e] = cnt[e];
        if (worst < 0 || lmax / (2.0 * N / (double)E) > imb)
            imb = lmax / (2.0 * N / (double)E), worst = moe_of[i];
        free(z);
    }
    loom_step_result sr;
    loom_model_zero_grad(g.m);
    REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 2, &r));
    REQUIRE_OK(g.ctx, loom_model_clip_grad_and_step(g.m, 1.0, 1, &sr));
    CHECK_MSG(fabs(sr.aux_loss - hf) > 1e-3, "two micro-batches: the loss is each one's, %.9g", sr.aux_loss);
    CHECK(fabs(sr.aux_loss - r.aux_loss) < 1e-12);
    CHECK(sr.expert_tokens_mean == 2.0 * N / (double)E && sr.expert_tokens_min == lo &&
          sr.expert_tokens_max == hi && fabs(sr.expert_imbalance - imb) < 1e-12);
    CHECK_EQ_INT(sr.expert_imbalance_layer, worst);
    /* each layer's counts (loom_model_expert_tokens), dense layers' 0 */
    double *got_cnt = malloc((size_t)(L * E) * sizeof(double));
    REQUIRE(got_cnt);
    CHECK(loom_model_expert_tokens(g.m, got_cnt, L * E - 1) == LOOM_ERR_INVALID_ARG);
    CHECK(strstr(loom_last_error(g.ctx), "experts") != NULL);
    REQUIRE_OK(g.ctx, loom_model_expert_tokens(g.m, got_cnt, L * E));
    for (int64_t i = 0; i < L * E; i++)
        CHECK_MSG(got_cnt[i] == want_cnt[i], "tokens of layer %lld expert %lld: %g, HF's top-2 %g",
                  (long long)(i / E), (long long)(i % E), got_cnt[i], want_cnt[i]);
    free(got_cnt);
    free(want_cnt);
    golden_close(&g);
}

/* The load-balancing loss's gradient (router_aux_loss_coef aux_coef, 1 so
 * it is a good part of the loss) and the router z-loss's (coefficient
 * z_coef) against central differences of the loss through the whole model:
 * router weights, and attention and expert weights of the first layer
 * (whose effect reaches the later layers' routing); with a capacity factor
 * cap_factor > 0 (drop policy drop), through the dropping. Elements whose
 * step changes some token's choice of experts, or which are dropped, are
 * skipped. */
static void check_router_gradient(loom_moe_aux form, double aux_coef, double z_coef,
                                  double cap_factor, loom_moe_drop drop) {
    golden g;
    memset(&g, 0, sizeof g);
    REQUIRE(!loom_ctx_create(&g.ctx));
    loom_ctx_set_log_level(g.ctx, LOOM_LOG_ERROR);
    path_of(g.dir, sizeof g.dir, "models/", "tiny-qwen3-moe", "");
    char p[1024];
    loom_model_options o;
    loom_model_options_default(&o);
    char ov[64];
    snprintf(ov, sizeof ov, "{\"router_aux_loss_coef\": %g}", aux_coef);
    o.config_overrides = ov;
    o.moe_aux = form;
    o.moe_z_loss_coeff = z_coef;
    o.moe_expert_capacity_factor = cap_factor;
    o.moe_token_drop_policy = drop;
    REQUIRE_OK(g.ctx, loom_model_create(g.ctx, g.dir, &o, &g.m));
    REQUIRE_OK(g.ctx, loom_st_open_file(g.ctx, path_of(p, sizeof p, "golden/", "tiny-qwen3-moe",
                                                       ".safetensors"), &g.st));
    REQUIRE_OK(g.ctx, loom_st_read_named(g.ctx, g.st, "input_ids", 2, (int64_t[]){2, 24}, LOOM_I32,
                                         g.ids));
    REQUIRE_OK(g.ctx, loom_st_read_named(g.ctx, g.st, "targets", 2, (int64_t[]){2, 24}, LOOM_I32,
                                         g.tgt));
    loom_batch b = batch_of(&g);
    loom_fb_result r;
    loom_model_zero_grad(g.m);
    REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 1, &r));
    CHECK(r.aux_loss > 1.0 && fabs(r.loss - r.loss_sum / 41.0) < 1e-12);
    CHECK(z_coef > 0 ? r.z_loss > 1.0 : r.z_loss == 0.0);
    int dropped = 0;
    for (int64_t l = 0; l < g.m->L; l++)
        for (int64_t c = 0; c < 48 * g.m->cfg.num_experts_per_tok; c++)
            dropped += ((const int32_t *)g.m->chunks[0].pool[0].lay[l].act[1][5])[c] < 0;
    CHECK_MSG(cap_factor > 0 ? dropped > 0 : dropped == 0, "%d choices dropped", dropped);
    const int64_t L = g.m->L, R = 48 * g.m->cfg.num_experts_per_tok;
    const loom_acts *a = &g.m->chunks[0].pool[0];
    /* each layer's choices (IDX) and where they went (POS: -1 dropped) */
    int32_t *idx0 = malloc((size_t)(2 * L * R) * sizeof *idx0), *idx = malloc((size_t)(2 * L * R) * 4);
    for (int64_t l = 0; l < L; l++)
        for (int k = 0; k < 2; k++) memcpy(idx0 + (2 * l + k) * R, a->lay[l].act[1][1 + 4 * k], (size_t)R * 4);
    const char *names[] = {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight",
                           "model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.mlp.experts.3.up_proj.weight"};
    int checked = 0, tried = 0;
    double worst = 0.0;
    for (int t = 0; t < 4; t++) {
        const int s = loom_model_find_slot(g.m, names[t]);
        REQUIRE(s >= 0);
        const int64_t n = (int64_t)g.m->base.slots[s].numel;
        float *grad = malloc(sizeof(float) * (size_t)n), *w = loom_w(g.m, s);
        REQUIRE_OK(g.ctx, loom_model_get_grad(g.m, names[t], grad, n));
        float gmax = 0.0f;
        for (int64_t i = 0; i < n; i++) gmax = fmaxf(gmax, fabsf(grad[i]));
        for (int64_t i = 0; i < n; i += n / 12 + 1) {
            const float w0 = w[i], h = 1e-2f;
            double f[2];
            bool flip = false;
            for (int sgn = 0; sgn < 2; sgn++) {
                w[i] = w0 + (sgn ? -h : h);
                REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r));
                f[sgn] = r.loss;
                for (int64_t l = 0; l < L; l++)
                    for (int k = 0; k < 2; k++)
                        memcpy(idx + (2 * l + k) * R, a->lay[l].act[1][1 + 4 * k], (size_t)R * 4);
                flip |= memcmp(idx, idx0, (size_t)(2 * L * R) * 4) != 0;
            }
            w[i] = w0;
            tried++;
            if (flip) continue;
            checked++;
            worst = fmax(worst, fabs((f[0] - f[1]) / (2.0 * h) - grad[i]) / gmax);
        }
        free(grad);
    }
    CHECK_MSG(checked >= tried / 2, "only %d of %d elements away from a change of experts",
              checked, tried);
    note_err("aux gradient vs differences (of the tensor's largest)", worst);
    CHECK_MSG(worst < 2e-3, "gradient off by %.3g of the tensor's largest", worst);
    free(idx0), free(idx);
    golden_close(&g);
}

static void check_aux_gradient(loom_moe_aux form, double aux_coef, double z_coef) {
    check_router_gradient(form, aux_coef, z_coef, 0.0, LOOM_MOE_DROP_PROBS);
}

TEST(model_qwen3_moe_aux_loss_gradient_matches_differences) {
    check_aux_gradient(LOOM_MOE_AUX_GLOBAL, 1.0, 0.0);
}

/* Megatron's per-layer form: its value from HF's router logits (fp64
 * softmax, top-2 of each layer: sum_l E / (k N^2) sum_e C_le P_le), and its
 * gradient against central differences. */
TEST(model_qwen3_moe_per_layer_aux_loss) {
    golden g;
    REQUIRE(golden_open(&g, "tiny-qwen3-moe", LOOM_DEVICE_CPU));
    loom_model_free(g.m);
    loom_model_options o;
    loom_model_options_default(&o);
    o.moe_aux = LOOM_MOE_AUX_PER_LAYER;
    REQUIRE_OK(g.ctx, loom_model_create(g.ctx, g.dir, &o, &g.m));
    loom_batch b = batch_of(&g);
    loom_fb_result r;
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r));
    const int64_t E = 8, K = 2, N = 48;
    double want = 0.0;
    for (int64_t l = 0; l < g.m->L; l++) {
        char name[64];
        snprintf(name, sizeof name, "router_logits.%lld", (long long)l);
        float *z = read_tensor(&g, name, LOOM_F32, NULL);
        REQUIRE(z);
        double C[8] = {0}, Ps[8] = {0};
        for (int64_t t = 0; t < N; t++) {
            double mx = -INFINITY, sum = 0.0, p[8];
            for (int64_t e = 0; e < E; e++) mx = fmax(mx, z[t * E + e]);
            for (int64_t e = 0; e < E; e++) sum += p[e] = exp(z[t * E + e] - mx);
            int top = 0, b2 = -1;
            for (int64_t e = 0; e < E; e++) Ps[e] += p[e] / sum;
            for (int e = 1; e < E; e++) top = p[e] > p[top] ? e : top;
            for (int e = 0; e < E; e++)
                if (e != top && (b2 < 0 || p[e] > p[b2])) b2 = e;
            C[top]++, C[b2]++;
        }
        for (int64_t e = 0; e < E; e++) want += (double)E / ((double)K * N * N) * C[e] * Ps[e];
        free(z);
    }
    note_err("per-layer aux loss", fabs(r.aux_loss - want) / want);
    CHECK_MSG(fabs(r.aux_loss - want) <= 1e-5 * want, "per-layer aux loss %.9g, want %.9g",
              r.aux_loss, want);
    golden_close(&g);
    check_aux_gradient(LOOM_MOE_AUX_PER_LAYER, 1.0, 0.0);
}

/* The router z-loss (Megatron's z_loss_func per MoE layer, summed): its
 * value from HF's router logits (logsumexp in double), what it adds to the
 * loss, the mean over micro-batches, bad coefficients refused; and its
 * gradient against central differences, alone and with the per-layer
 * load-balancing loss. */
TEST(model_qwen3_moe_router_z_loss) {
    golden g;
    REQUIRE(golden_open(&g, "tiny-qwen3-moe", LOOM_DEVICE_CPU));
    loom_batch b = batch_of(&g);
    loom_fb_result r0, r;
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r0));
    CHECK(r0.z_loss == 0.0); /* off by default */
    const double zc = 0.25;
    loom_model *m0 = g.m;
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = "{\"router_aux_loss_coef\": 0}"; /* golden_open's */
    o.moe_z_loss_coeff = zc;
    REQUIRE_OK(g.ctx, loom_model_create(g.ctx, g.dir, &o, &g.m));
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r));
    const int64_t E = 8, N = 48;
    double want = 0.0;
    for (int64_t l = 0; l < g.m->L; l++) {
        char name[64];
        snprintf(name, sizeof name, "router_logits.%lld", (long long)l);
        float *z = read_tensor(&g, name, LOOM_F32, NULL);
        REQUIRE(z);
        for (int64_t t = 0; t < N; t++) {
            double mx = -INFINITY, sum = 0.0;
            for (int64_t e = 0; e < E; e++) mx = fmax(mx, z[t * E + e]);
            for (int64_t e = 0; e < E; e++) sum += exp(z[t * E + e] - mx);
            want += (mx + log(sum)) * (mx + log(sum)) / (double)N;
        }
        free(z);
    }
    note_err("router z-loss", fabs(r.z_loss - want) / want);
    CHECK_MSG(fabs(r.z_loss - want) <= 1e-5 * want, "z-loss %.9g, want %.9g", r.z_loss, want);
    CHECK_MSG(fabs(r.loss - r0.loss - zc * r.z_loss) < 1e-6, "the loss gains %.9g, not %g x %.9g",
              r.loss - r0.loss, zc, r.z_loss);
    /* two micro-batches of 24 rows: each one's z-loss, and their mean (of
     * equal halves: the whole's) reported */
    loom_step_result sr;
    loom_fb_result r2;
    loom_model_zero_grad(g.m);
    REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 2, &r2));
    REQUIRE_OK(g.ctx, loom_model_clip_grad_and_step(g.m, 1.0, 1, &sr));
    CHECK_MSG(fabs(r2.z_loss - want) <= 1e-5 * want, "two micro-batches: %.9g, want %.9g",
              r2.z_loss, want);
    CHECK(fabs(sr.z_loss - r2.z_loss) < 1e-12);
    loom_model_free(g.m);
    g.m = m0;
    /* refused before any compute */
    const double bad[] = {-1e-3, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        loom_model *x = NULL;
        o.moe_z_loss_coeff = bad[i];
        CHECK(loom_model_create(g.ctx, g.dir, &o, &x) == LOOM_ERR_INVALID_ARG && !x);
        CHECK_MSG(strstr(loom_last_error(g.ctx), "moe_z_loss_coeff"), "%s", loom_last_error(g.ctx));
    }
    golden_close(&g);
    check_aux_gradient(LOOM_MOE_AUX_GLOBAL, 0.0, 0.5);
    check_aux_gradient(LOOM_MOE_AUX_PER_LAYER, 1.0, 0.5);
}

/* 5 AdamW steps on the same batch: per-step losses, grad norms before
 * clipping, and the final weights. */
static void check_adamw(const char *model, loom_device dev) {
    golden g;
    if (!golden_open(&g, model, dev)) return;
    loom_optimizer_config oc = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                .weight_decay = 0.1};
    REQUIRE_OK(g.ctx, loom_model_set_optimizer(g.m, &oc));
    const loom_json *losses = loom_json_get(g.meta, "adamw_losses");
    const loom_json *norms = loom_json_get(g.meta, "adamw_grad_norms_before_clip");
    REQUIRE(losses && norms && losses->n == 5 && norms->n == 5);
    loom_batch b = batch_of(&g);
    for (int s = 0; s < 5; s++) {
        loom_fb_result r;
        loom_step_result sr;
        REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 1, &r));
        REQUIRE_OK(g.ctx, loom_model_clip_grad_and_step(g.m, 1.0, 1, &sr));
        CHECK(sr.stepped);
        CHECK_EQ_INT(sr.step, s + 1);
        double rl = losses->items[s]->d, rn = norms->items[s]->d;
        CHECK_MSG(fabs(r.loss - rl) <= TOL * rl, "step %d loss %.9g vs %.9g", s + 1, r.loss, rl);
        CHECK_MSG(fabs(sr.grad_norm - rn) <= TOL * rn, "step %d grad norm %.9g vs %.9g", s + 1,
                  sr.grad_norm, rn);
    }
    int nfinal = 0;
    for (size_t i = 0; i < loom_st_count(g.st); i++) {
        const loom_st_tensor *t = loom_st_at(g.st, i);
        if (strncmp(t->name, "final.", 6)) continue;
        if (!strcmp(t->name, "final.lm_head.weight") && loom_model_find_slot(g.m, "lm_head.weight") < 0)
            continue; /* tied: the embedding's reference covers it */
        nfinal++;
        int64_t n;
        float *ref = read_tensor(&g, t->name, LOOM_F32, &n);
        float *got = malloc(sizeof(float) * (size_t)n);
        CHECK_OK(g.ctx, loom_model_get_param(g.m, t->name + 6, got, n));
        /* The reference ran in float64. AdamW divides by sqrt(v): for the
         * few elements whose gradient is ~1e-7 of the tensor's largest, fp32
         * rounding of that gradient changes their update by up to ~lr, so the
         * weights are compared in the L2 norm, which such outliers cannot
         * dominate, while a wrong update rule (weight decay, bias correction,
         * clipping) still moves it well past the tolerance. */
        double e = rel_err_l2(got, ref, n), tol = TOL;
        /* The keys' bias has a gradient of zero in exact arithmetic (a
         * constant added to every key of a query leaves its softmax as it
         * is), so what it gets is rounding, which AdamW can scale up to lr
         * an element a step: the GPU's summation order gives it ~1e-8,
         * enough to move it by a fraction of lr, the float64 reference's
         * nothing. Its bound adds at most lr a step and element (a wrong
         * update rule moves every other tensor past TOL still). */
        const char *kb = ".self_attn.k_proj.bias";
        const size_t ln = strlen(t->name), lk = strlen(kb);
        if (ln > lk && !strcmp(t->name + ln - lk, kb)) {
            double rr = 0.0;
            for (int64_t j = 0; j < n; j++) rr += (double)ref[j] * ref[j];
            tol += rr > 0 ? 5 * oc.lr * sqrt((double)n / rr) : 0.0;
        }
        note_err(t->name, e);
        CHECK_MSG(e <= tol, "%s: relative L2 error %.3g > %g", t->name, e, tol);
        free(ref);
        free(got);
    }
    loom_model_info info;
    loom_model_get_info(g.m, &info);
    CHECK_EQ_INT(nfinal, info.num_tensors);
    golden_close(&g);
}

TEST(model_qwen3_matches_hf) { check_forward_backward("tiny-qwen3", LOOM_DEVICE_CPU, false); }
TEST(model_qwen3_untied_sharded_matches_hf) { check_forward_backward("tiny-qwen3-untied", LOOM_DEVICE_CPU, false); }
TEST(model_qwen2_matches_hf) { check_forward_backward("tiny-qwen2", LOOM_DEVICE_CPU, false); }
TEST(model_llama_matches_hf) { check_forward_backward("tiny-llama", LOOM_DEVICE_CPU, false); }
TEST(model_packed_documents_qwen3) { check_packed("tiny-qwen3", LOOM_DEVICE_CPU); }
TEST(model_packed_documents_untied) { check_packed("tiny-qwen3-untied", LOOM_DEVICE_CPU); }
TEST(model_packed_documents_qwen2) { check_packed("tiny-qwen2", LOOM_DEVICE_CPU); }
TEST(model_packed_documents_llama) { check_packed("tiny-llama", LOOM_DEVICE_CPU); }
TEST(model_rows_as_documents_qwen3) { check_forward_backward("tiny-qwen3", LOOM_DEVICE_CPU, true); }
TEST(model_rows_as_documents_untied) { check_forward_backward("tiny-qwen3-untied", LOOM_DEVICE_CPU, true); }
TEST(model_rows_as_documents_qwen2) { check_forward_backward("tiny-qwen2", LOOM_DEVICE_CPU, true); }
TEST(model_rows_as_documents_llama) { check_forward_backward("tiny-llama", LOOM_DEVICE_CPU, true); }
TEST(model_adamw_trajectory_qwen3) { check_adamw("tiny-qwen3", LOOM_DEVICE_CPU); }
TEST(model_adamw_trajectory_untied) { check_adamw("tiny-qwen3-untied", LOOM_DEVICE_CPU); }
TEST(model_adamw_trajectory_qwen2) { check_adamw("tiny-qwen2", LOOM_DEVICE_CPU); }
TEST(model_adamw_trajectory_llama) { check_adamw("tiny-llama", LOOM_DEVICE_CPU); }
TEST(model_qwen3_moe_matches_hf) { check_forward_backward("tiny-qwen3-moe", LOOM_DEVICE_CPU, false); }
TEST(model_rows_as_documents_qwen3_moe) { check_forward_backward("tiny-qwen3-moe", LOOM_DEVICE_CPU, true); }
TEST(model_packed_documents_qwen3_moe) { check_packed("tiny-qwen3-moe", LOOM_DEVICE_CPU); }
TEST(model_adamw_trajectory_qwen3_moe) { check_adamw("tiny-qwen3-moe", LOOM_DEVICE_CPU); }
TEST(model_qwen3_moe_router_and_aux_loss_match_hf) { check_router("tiny-qwen3-moe", LOOM_DEVICE_CPU); }
/* Qwen2-MoE: the gated shared expert, q/k/v biases, top-2 not renormalised,
 * layer 2 dense (tools/make_fixtures_moe.py) */
TEST(model_qwen2_moe_matches_hf) { check_forward_backward("tiny-qwen2-moe", LOOM_DEVICE_CPU, false); }
TEST(model_rows_as_documents_qwen2_moe) { check_forward_backward("tiny-qwen2-moe", LOOM_DEVICE_CPU, true); }
TEST(model_adamw_trajectory_qwen2_moe) { check_adamw("tiny-qwen2-moe", LOOM_DEVICE_CPU); }
TEST(model_qwen2_moe_router_and_aux_loss_match_hf) { check_router("tiny-qwen2-moe", LOOM_DEVICE_CPU); }

/* The same on one GPU in fp32: the CUDA path must match HF like the CPU's. */
TEST(model_cuda_qwen3_matches_hf) { check_forward_backward("tiny-qwen3", LOOM_DEVICE_CUDA, false); }
TEST(model_cuda_qwen3_untied_matches_hf) { check_forward_backward("tiny-qwen3-untied", LOOM_DEVICE_CUDA, false); }
TEST(model_cuda_qwen2_matches_hf) { check_forward_backward("tiny-qwen2", LOOM_DEVICE_CUDA, false); }
TEST(model_cuda_llama_matches_hf) { check_forward_backward("tiny-llama", LOOM_DEVICE_CUDA, false); }
TEST(model_cuda_packed_documents_qwen3) { check_packed("tiny-qwen3", LOOM_DEVICE_CUDA); }
TEST(model_cuda_packed_documents_qwen2) { check_packed("tiny-qwen2", LOOM_DEVICE_CUDA); }
TEST(model_cuda_rows_as_documents_qwen3) { check_forward_backward("tiny-qwen3", LOOM_DEVICE_CUDA, true); }
TEST(model_cuda_rows_as_documents_llama) { check_forward_backward("tiny-llama", LOOM_DEVICE_CUDA, true); }
TEST(model_cuda_adamw_trajectory_qwen3) { check_adamw("tiny-qwen3", LOOM_DEVICE_CUDA); }
TEST(model_cuda_adamw_trajectory_untied) { check_adamw("tiny-qwen3-untied", LOOM_DEVICE_CUDA); }
TEST(model_cuda_adamw_trajectory_llama) { check_adamw("tiny-llama", LOOM_DEVICE_CUDA); }
TEST(model_cuda_adamw_trajectory_qwen2) { check_adamw("tiny-qwen2", LOOM_DEVICE_CUDA); }
TEST(model_cuda_qwen3_moe_matches_hf) { check_forward_backward("tiny-qwen3-moe", LOOM_DEVICE_CUDA, false); }
TEST(model_cuda_adamw_trajectory_qwen3_moe) { check_adamw("tiny-qwen3-moe", LOOM_DEVICE_CUDA); }
TEST(model_cuda_qwen3_moe_router_and_aux_loss_match_hf) { check_router("tiny-qwen3-moe", LOOM_DEVICE_CUDA); }
TEST(model_cuda_qwen2_moe_matches_hf) { check_forward_backward("tiny-qwen2-moe", LOOM_DEVICE_CUDA, false); }
TEST(model_cuda_adamw_trajectory_qwen2_moe) { check_adamw("tiny-qwen2-moe", LOOM_DEVICE_CUDA); }

/* fp16 on a GPU: the loss is seeded with the dynamic loss scale (2^10) and
 * unscaled at the step; five AdamW steps stay finite and track the fp32
 * trajectory of the HF fixture. */
TEST(model_cuda_fp16_loss_scaling) {
    if (!loom_test_have_gpu()) SKIP("no GPU visible (or loom built without CUDA)");
    golden g;
    memset(&g, 0, sizeof g);
    REQUIRE(!loom_ctx_create(&g.ctx));
    loom_ctx_set_log_level(g.ctx, LOOM_LOG_ERROR);
    char p[1024];
    path_of(g.dir, sizeof g.dir, "models/", "tiny-qwen3", "");
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = LOOM_DEVICE_CUDA;
    o.dtype = LOOM_F16;
    REQUIRE_OK(g.ctx, loom_model_create(g.ctx, g.dir, &o, &g.m));
    REQUIRE_OK(g.ctx, loom_st_open_file(g.ctx, path_of(p, sizeof p, "golden/", "tiny-qwen3",
                                                       ".safetensors"), &g.st));
    REQUIRE_OK(g.ctx, loom_json_parse_file(g.ctx, path_of(p, sizeof p, "golden/", "tiny-qwen3",
                                                          ".json"), &g.meta));
    REQUIRE_OK(g.ctx, loom_st_read_named(g.ctx, g.st, "input_ids", 2, (int64_t[]){2, 24}, LOOM_I32,
                                         g.ids));
    REQUIRE_OK(g.ctx, loom_st_read_named(g.ctx, g.st, "targets", 2, (int64_t[]){2, 24}, LOOM_I32,
                                         g.tgt));
    loom_optimizer_config oc = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                .weight_decay = 0.1};
    REQUIRE_OK(g.ctx, loom_model_set_optimizer(g.m, &oc));
    const loom_json *losses = loom_json_get(g.meta, "adamw_losses");
    REQUIRE(losses && losses->n == 5);
    loom_batch b = batch_of(&g);
    int stepped = 0;
    for (int s = 0; s < 5; s++) {
        loom_fb_result r;
        loom_step_result sr;
        REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 1, &r));
        REQUIRE_OK(g.ctx, loom_model_clip_grad_and_step(g.m, 1.0, 1, &sr));
        CHECK(isfinite(r.loss));
        CHECK(sr.loss_scale >= 1.0 && sr.loss_scale <= 1024.0);
        if (s == 0) {
            CHECK_MSG(sr.stepped && sr.loss_scale == 1024.0, "step 1: stepped %d, scale %g",
                      sr.stepped, sr.loss_scale);
            double rn = loom_json_get(g.meta, "adamw_grad_norms_before_clip")->items[0]->d;
            CHECK_NEAR(sr.grad_norm, rn, 2e-2 * rn);
        }
        /* fp16 activations: the fixture's fp32 losses within 1% while no
         * step was skipped */
        if (stepped == s) CHECK_NEAR(r.loss, losses->items[s]->d, 1e-2 * losses->items[s]->d);
        stepped += sr.stepped;
    }
    CHECK_MSG(stepped >= 4, "%d of 5 steps taken", stepped);
    golden_close(&g);
}

/* LOOM_ATTN names the attention kernels, LOOM_LORA_KERNELS those of LoRA's
 * backward: var=bad is refused when the model is created, on any device,
 * naming var and its two values; each good value creates it (on the CPU
 * they change nothing). */
static void env_choice_case(const char *var, const char *bad, const char *values,
                            const char *const good[2]) {
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char dir[1024], want[128];
    path_of(dir, sizeof dir, "models/", "tiny-qwen3", "");
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = LOOM_DEVICE_CPU;
    const char *old = getenv(var);
    char *saved = old ? strdup(old) : NULL;
    loom_model *m = NULL;
    setenv(var, bad, 1);
    CHECK(loom_model_create(ctx, dir, &o, &m) == LOOM_ERR_INVALID_ARG);
    CHECK(m == NULL);
    snprintf(want, sizeof want, "%s=%s", var, bad);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    CHECK_CONTAINS(loom_last_error(ctx), values);
    for (int i = 0; i < 2; i++) {
        setenv(var, good[i], 1);
        REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m));
        loom_model_free(m);
        m = NULL;
    }
    if (saved)
        setenv(var, saved, 1);
    else
        unsetenv(var);
    free(saved);
    loom_ctx_free(ctx);
}

TEST(model_attention_kernels_env) {
    const char *const good[2] = {"loom", "cudnn"};
    env_choice_case("LOOM_ATTN", "flash", "`cudnn` (the default) or `loom`", good);
}

TEST(model_lora_kernels_env) {
    const char *const good[2] = {"loom", "cublas"};
    env_choice_case("LOOM_LORA_KERNELS", "cuda", "`loom` (the default) or `cublas`", good);
}

/* Expert capacity (Megatron's token dropping): a factor large enough to
 * keep every choice gives the dropless run's bits; a small one (cap =
 * ceil(48 x 2 / 8 x 0.5) = 6 choices an expert a layer) keeps, in each
 * layer, the choices a sort of that layer's choices per expert keeps (by
 * weight, or the first tokens), counts every choice in the load-balancing
 * loss and only the kept in the tokens per expert; bad values are refused;
 * the gradient through the dropping against central differences. */
static int by_weight_desc(const void *a, const void *b, void *u) {
    const float *w = u;
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (w[x] != w[y]) return w[x] > w[y] ? -1 : 1;
    return x < y ? -1 : x > y;
}

TEST(model_qwen3_moe_expert_capacity) {
    golden g;
    REQUIRE(golden_open(&g, "tiny-qwen3-moe", LOOM_DEVICE_CPU));
    loom_batch b = batch_of(&g);
    loom_fb_result r0, r;
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r0));
    loom_model *m0 = g.m;
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = "{\"router_aux_loss_coef\": 0}"; /* golden_open's */
    o.moe_expert_capacity_factor = 4.0;                  /* cap 48: every choice kept */
    REQUIRE_OK(g.ctx, loom_model_create(g.ctx, g.dir, &o, &g.m));
    REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r));
    CHECK_MSG(r.loss == r0.loss && r.aux_loss == r0.aux_loss, "capacity of all: %.9g vs %.9g",
              r.loss, r0.loss);
    loom_model_free(g.m);
    enum { N = 48, E = 8, K = 2, CAP = 6 };
    for (int drop = 0; drop < 2; drop++) {
        o.moe_expert_capacity_factor = 0.5;
        o.moe_token_drop_policy = drop;
        REQUIRE_OK(g.ctx, loom_model_create(g.ctx, g.dir, &o, &g.m));
        REQUIRE_OK(g.ctx, loom_model_forward_only(g.m, &b, 1, NULL, NULL, NULL, &r));
        CHECK_MSG(fabs(r.loss - r0.loss) > 1e-4, "dropping changes nothing: %.9g", r.loss);
        const loom_acts *a = &g.m->chunks[0].pool[0];
        int dropped = 0;
        for (int64_t l = 0; l < g.m->L; l++) {
            int32_t idx[N * K], pos[N * K];
            float w[N * K];
            memcpy(idx, a->lay[l].act[1][1], sizeof idx);
            memcpy(w, a->lay[l].act[1][2], sizeof w);
            memcpy(pos, a->lay[l].act[1][5], sizeof pos);
            const int32_t *cnt = a->lay[l].act[1][3]; /* every choice: the aux loss's */
            for (int e = 0; e < E; e++) {
                int32_t mine[N * K];
                int n = 0;
                for (int c = 0; c < N * K; c++)
                    if (idx[c] == e) mine[n++] = c;
                CHECK_EQ_INT(cnt[e], n);
                if (!drop) qsort_r(mine, (size_t)n, sizeof *mine, by_weight_desc, w);
                for (int i = 0; i < n; i++) {
                    CHECK_MSG((pos[mine[i]] >= 0) == (i < CAP), "layer %lld expert %d: choice %d "
                              "(rank %d) %s", (long long)l, e, mine[i], i,
                              pos[mine[i]] >= 0 ? "kept" : "dropped");
                    dropped += i >= CAP;
                }
            }
        }
        CHECK_MSG(dropped > 8, "only %d choices dropped", dropped);
        loom_step_result sr;
        loom_model_zero_grad(g.m);
        REQUIRE_OK(g.ctx, loom_model_forward_backward(g.m, &b, 1, &r));
        REQUIRE_OK(g.ctx, loom_model_clip_grad_and_step(g.m, 1.0, 1, &sr));
        CHECK(sr.expert_tokens_max == CAP && sr.expert_tokens_mean < 2.0 * N / E);
        loom_model_free(g.m);
    }
    /* refused before any compute */
    const double bad[] = {-1.0, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        loom_model *x = NULL;
        o.moe_expert_capacity_factor = bad[i];
        o.moe_token_drop_policy = LOOM_MOE_DROP_PROBS;
        CHECK(loom_model_create(g.ctx, g.dir, &o, &x) == LOOM_ERR_INVALID_ARG && !x);
        CHECK_MSG(strstr(loom_last_error(g.ctx), "moe_expert_capacity_factor"), "%s",
                  loom_last_error(g.ctx));
    }
    loom_model *x = NULL;
    o.moe_expert_capacity_factor = 1.0;
    o.moe_token_drop_policy = 2;
    CHECK(loom_model_create(g.ctx, g.dir, &o, &x) == LOOM_ERR_INVALID_ARG && !x);
    CHECK_MSG(strstr(loom_last_error(g.ctx), "moe_token_drop_policy = 2"), "%s",
              loom_last_error(g.ctx));
    g.m = m0;
    golden_close(&g);
    check_router_gradient(LOOM_MOE_AUX_GLOBAL, 1.0, 0.0, 1.0, LOOM_MOE_DROP_PROBS);
    check_router_gradient(LOOM_MOE_AUX_PER_LAYER, 1.0, 0.5, 0.75, LOOM_MOE_DROP_POSITION);
}

/* The router z-loss and a capacity (both policies) on one GPU in fp32
 * against the CPU: the losses, the same choices kept, every gradient. */
TEST(model_cuda_qwen3_moe_router_options_match_cpu) {
    golden g[2];
    for (int d = 0; d < 2; d++)
        if (!golden_open(&g[d], "tiny-qwen3-moe", d ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU)) {
            if (d) golden_close(&g[0]);
            return;
        }
    for (int drop = 0; drop < 2; drop++) {
        loom_fb_result r[2];
        float *gr[2];
        int64_t n[2];
        int32_t pos[2][4][96];
        for (int d = 0; d < 2; d++) {
            loom_model_options o;
            loom_model_options_default(&o);
            o.device = d ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU;
            o.config_overrides = "{\"router_aux_loss_coef\": 0.5}";
            o.moe_z_loss_coeff = 0.5;
            o.moe_expert_capacity_factor = 0.75;
            o.moe_token_drop_policy = drop;
            loom_model_free(g[d].m);
            REQUIRE_OK(g[d].ctx, loom_model_create(g[d].ctx, g[d].dir, &o, &g[d].m));
            loom_batch b = batch_of(&g[d]);
            loom_model_zero_grad(g[d].m);
            REQUIRE_OK(g[d].ctx, loom_model_forward_backward(g[d].m, &b, 1, &r[d]));
            const loom_acts *a = &g[d].m->chunks[0].pool[0];
            for (int l = 0; l < 4; l++)
                REQUIRE_OK(g[d].ctx, loom_k_download(g[d].m, pos[d][l], a->lay[l].act[1][5],
                                                     sizeof pos[d][l]));
            gr[d] = all_grads(&g[d], &n[d]);
            REQUIRE(gr[d]);
        }
        CHECK_MSG(memcmp(pos[0], pos[1], sizeof pos[0]) == 0, "%s: other choices kept",
                  drop ? "position" : "probs");
        CHECK_MSG(fabs(r[1].loss - r[0].loss) <= 1e-5 * r[0].loss &&
                      fabs(r[1].z_loss - r[0].z_loss) <= 1e-5 * r[0].z_loss &&
                      fabs(r[1].aux_loss - r[0].aux_loss) <= 1e-5 * r[0].aux_loss,
                  "GPU loss %.9g z %.9g aux %.9g vs CPU %.9g %.9g %.9g", r[1].loss, r[1].z_loss,
                  r[1].aux_loss, r[0].loss, r[0].z_loss, r[0].aux_loss);
        REQUIRE(n[0] == n[1]);
        const double e = rel_err(gr[1], gr[0], n[0]);
        note_err("router options: GPU gradients vs CPU", e);
        CHECK_MSG(e <= TOL, "%s: gradients differ by %.3g", drop ? "position" : "probs", e);
        free(gr[0]), free(gr[1]);
    }
    golden_close(&g[0]);
    golden_close(&g[1]);
}
