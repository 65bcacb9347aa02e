/* LoRA against PEFT (tests/fixtures, tiny-qwen3-lora: r=4, alpha=8,
 * all-linear): logits, loss, every A and B gradient, 5 AdamW steps on the
 * adapter (weight decay 0.01) and the merged weights; PEFT files written and
 * read back; bad adapters refused. */
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/io/safetensors.h"
#include "../src/model/model.h"
#include "harness.h"

#define TOL 1e-4

static double rel(const float *a, const float *b, int64_t n) {
    double md = 0, mr = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md)) md = d;
        mr = fmax(mr, fabs((double)b[i]));
    }
    return md / (mr > 0 ? mr : 1);
}

static double rel_l2(const float *a, const float *b, int64_t n) {
    double dd = 0, rr = 0;
    for (int64_t i = 0; i < n; i++) {
        dd += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        rr += (double)b[i] * b[i];
    }
    return sqrt(dd / (rr > 0 ? rr : 1));
}

typedef struct fx {
    loom_ctx *ctx;
    loom_model *m;
    loom_safetensors *st;
    loom_json *meta;
    int32_t ids[48], tgt[48];
    char adir[1024];
} fx;

/* The fixture's model and adapter on a device in a compute dtype. */
static bool fx_open_on(fx *f, loom_device dev, loom_dtype dt) {
    memset(f, 0, sizeof *f);
    char p[1024];
    loom_ctx_create(&f->ctx);
    loom_ctx_set_log_level(f->ctx, LOOM_LOG_ERROR);
    snprintf(p, sizeof p, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(f->adir, sizeof f->adir, "%s/models/tiny-qwen3-lora", loom_test_fixtures());
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = dev;
    o.dtype = dt;
    if (loom_model_create(f->ctx, p, &o, &f->m)) goto fail;
    if (loom_model_load_adapter(f->m, "default", f->adir)) goto fail;
    snprintf(p, sizeof p, "%s/golden/tiny-qwen3-lora.safetensors", loom_test_fixtures());
    if (loom_st_open_file(f->ctx, p, &f->st)) goto fail;
    snprintf(p, sizeof p, "%s/golden/tiny-qwen3-lora.json", loom_test_fixtures());
    if (loom_json_parse_file(f->ctx, p, &f->meta)) goto fail;
    if (loom_st_read(f->ctx, loom_st_find(f->st, "input_ids"), LOOM_I32, f->ids, 48) ||
        loom_st_read(f->ctx, loom_st_find(f->st, "targets"), LOOM_I32, f->tgt, 48))
        goto fail;
    return true;
fail:
    loom_test_fail(__FILE__, __LINE__, "%s", loom_last_error(f->ctx));
    return false;
}

static bool fx_open(fx *f) { return fx_open_on(f, LOOM_DEVICE_CPU, LOOM_F32); }

static void fx_close(fx *f) {
    loom_model_free(f->m);
    loom_st_close(f->st);
    loom_json_free(f->meta);
    loom_ctx_free(f->ctx);
}

static float *ref(fx *f, const char *name, int64_t *n) {
    const loom_st_tensor *t = loom_st_find(f->st, name);
    if (!t) return NULL;
    float *b = malloc(t->numel * 4);
    loom_st_read(f->ctx, t, LOOM_F32, b, t->numel);
    *n = (int64_t)t->numel;
    return b;
}

/* Logits, token log-probs and loss against PEFT's within tol (max-abs
 * relative), every adapter gradient within gtol (max-abs relative on the
 * CPU, relative L2 on a GPU). */
static void check_peft(loom_device dev, loom_dtype dt, double tol, double gtol) {
    fx f;
    if (dev == LOOM_DEVICE_CUDA && !loom_test_have_gpu()) {
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return;
    }
    if (!fx_open_on(&f, dev, dt)) return;
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = f.ids, .targets = f.tgt};
    int64_t n;
    float *rl = ref(&f, "logits", &n), *rt = ref(&f, "token_logprobs", &n);
    float *logits = malloc(48 * 1024 * 4), tlp[48];
    loom_fb_result r;
    REQUIRE_OK(f.ctx, loom_model_forward_only(f.m, &b, 1, tlp, NULL, logits, &r));
    CHECK_MSG(rel(logits, rl, 48 * 1024) <= tol, "logits %.3g", rel(logits, rl, 48 * 1024));
    CHECK_MSG(rel(tlp, rt, 48) <= tol, "token_logprobs %.3g", rel(tlp, rt, 48));
    REQUIRE_OK(f.ctx, loom_model_forward_backward(f.m, &b, 2, &r));
    double want;
    loom_json_get_num(f.ctx, f.meta, "loss", "json", &want);
    CHECK_NEAR(r.loss, want, tol * want);
    int grads = 0;
    for (size_t i = 0; i < loom_st_count(f.st); i++) {
        const char *name = loom_st_at(f.st, i)->name;
        if (strncmp(name, "grad.", 5)) continue;
        float *g = ref(&f, name, &n), *got = malloc((size_t)n * 4);
        CHECK_OK(f.ctx, loom_model_get_grad(f.m, name + 5, got, n));
        double e = dev == LOOM_DEVICE_CPU ? rel(got, g, n) : rel_l2(got, g, n);
        CHECK_MSG(e <= gtol, "%s: %.3g", name, e);
        grads++;
        free(g);
        free(got);
    }
    CHECK_EQ_INT(grads, 4 * 7 * 2);
    /* the frozen base has no gradient */
    float tmp[64];
    CHECK(loom_model_get_grad(f.m, "model.norm.weight", tmp, 64) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(f.ctx), "frozen");
    free(rl);
    free(rt);
    free(logits);
    fx_close(&f);
}

TEST(lora_matches_peft_forward_and_gradients) { check_peft(LOOM_DEVICE_CPU, LOOM_F32, TOL, TOL); }
/* On a GPU: fp32 as tight as the CPU; bf16 (the fused norm and RoPE
 * kernels, grouped LoRA GEMMs) within bf16 rounding: on the H100 the
 * gradients' relative L2 errors were 0.03-0.056 (bf16 activations through
 * 4 layers), a wrong block or offset gives ~1. */
TEST(lora_cuda_matches_peft) { check_peft(LOOM_DEVICE_CUDA, LOOM_F32, TOL, TOL); }
TEST(lora_cuda_bf16_matches_peft) { check_peft(LOOM_DEVICE_CUDA, LOOM_BF16, 3e-2, 0.1); }

/* ---- LoRA on loom's GPU kernels: the backward's pass over dy
 * (src/backend/cuda/ops_lora.cu) and, on Hopper, the forward's term inside
 * the base GEMM (gemm_sm90.cu) ----
 * An adapter trained two AdamW steps on the CPU (so B is not zero), saved
 * and loaded on each side: the GPU in bf16 with loom's kernels against the
 * CPU in fp32 and against the same GPU run with cuBLASLt's GEMMs
 * (LOOM_LORA_KERNELS=cublas). Every module's du and dB (k = r) run on the
 * kernel (48 tokens: partial tiles everywhere), at r=8 and r=16; dropout and
 * a partial target list take the per-module path. */
typedef struct lora_run {
    float loss;
    float *logits; /* (48, 1024) */
    float *grads;  /* every adapter gradient, in adapter_tensor order */
    int64_t ngrad;
} lora_run;

static bool batch_of_fixture(loom_ctx *ctx, int32_t *ids, int32_t *tgt) {
    char p[1024];
    loom_safetensors *st = NULL;
    snprintf(p, sizeof p, "%s/golden/tiny-qwen3-lora.safetensors", loom_test_fixtures());
    bool ok = !loom_st_open_file(ctx, p, &st) &&
              !loom_st_read(ctx, loom_st_find(st, "input_ids"), LOOM_I32, ids, 48) &&
              !loom_st_read(ctx, loom_st_find(st, "targets"), LOOM_I32, tgt, 48);
    loom_st_close(st);
    return ok;
}

static bool make_adapter(const char *dir, int r, double dropout, const char *targets) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char base[1024];
    snprintf(base, sizeof base, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model *m = NULL;
    int32_t ids[48], tgt[48];
    loom_lora_config c = {.r = r, .lora_alpha = 2.0 * r, .lora_dropout = dropout,
                          .target_modules = targets, .seed = 7};
    loom_optimizer_config oc = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    bool ok = batch_of_fixture(ctx, ids, tgt) && !loom_model_create(ctx, base, NULL, &m) &&
              !loom_model_add_adapter(m, "a", &c) && !loom_model_set_optimizer(m, &oc);
    for (int s = 0; ok && s < 2; s++) {
        loom_fb_result fr;
        loom_step_result sr;
        ok = !loom_model_forward_backward(m, &b, 1, &fr) && !loom_model_clip_grad_and_step(m, 1.0, 1, &sr);
    }
    ok = ok && !loom_model_save_adapter(m, "a", dir, LOOM_F32);
    if (!ok) loom_test_fail(__FILE__, __LINE__, "making the adapter: %s", loom_last_error(ctx));
    loom_model_free(m);
    loom_ctx_free(ctx);
    return ok;
}

static bool lora_run_on(const char *dir, loom_device dev, loom_dtype dt, bool cublas, lora_run *out) {
    memset(out, 0, sizeof *out);
    if (cublas) setenv("LOOM_LORA_KERNELS", "cublas", 1);
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char base[1024];
    snprintf(base, sizeof base, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = dev;
    o.dtype = dt;
    loom_model *m = NULL;
    int32_t ids[48], tgt[48];
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    loom_fb_result fr;
    out->logits = malloc(48 * 1024 * sizeof(float));
    bool ok = batch_of_fixture(ctx, ids, tgt) && !loom_model_create(ctx, base, &o, &m) &&
              !loom_model_load_adapter(m, "a", dir) &&
              !loom_model_forward_only(m, &b, 1, NULL, NULL, out->logits, NULL) &&
              !loom_model_forward_backward(m, &b, 2, &fr);
    out->loss = (float)fr.loss;
    char name[256];
    int64_t shape[2], total = 0;
    for (int64_t i = 0; ok && loom_model_adapter_tensor(m, "a", i, name, sizeof name, shape); i++)
        total += shape[0] * shape[1];
    out->grads = malloc(sizeof(float) * (size_t)(total ? total : 1));
    for (int64_t i = 0; ok && loom_model_adapter_tensor(m, "a", i, name, sizeof name, shape); i++) {
        ok = !loom_model_get_grad(m, name, out->grads + out->ngrad, shape[0] * shape[1]);
        out->ngrad += shape[0] * shape[1];
    }
    if (!ok) loom_test_fail(__FILE__, __LINE__, "LoRA run: %s", loom_last_error(ctx));
    loom_model_free(m);
    loom_ctx_free(ctx);
    unsetenv("LOOM_LORA_KERNELS");
    return ok;
}

/* Every adapter tensor's gradient within tol (relative L2 per tensor). */
static void check_grads(const char *dir, const lora_run *got, const lora_run *want, double tol,
                        const char *what) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char base[1024], name[256];
    snprintf(base, sizeof base, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model *m = NULL;
    if (loom_model_create(ctx, base, NULL, &m) || loom_model_load_adapter(m, "a", dir)) {
        loom_test_fail(__FILE__, __LINE__, "%s", loom_last_error(ctx));
        loom_ctx_free(ctx);
        return;
    }
    int64_t shape[2], at = 0;
    double worst = 0;
    for (int64_t i = 0; loom_model_adapter_tensor(m, "a", i, name, sizeof name, shape); i++) {
        const int64_t n = shape[0] * shape[1];
        const double e = rel_l2(got->grads + at, want->grads + at, n);
        double nz = 0; /* B is not zero: no gradient is */
        for (int64_t j = 0; j < n; j++) nz += fabs((double)want->grads[at + j]);
        CHECK_MSG(nz > 0, "%s: %s has a zero gradient", what, name);
        CHECK_MSG(e <= tol, "%s: %s gradient rel L2 %.3g > %.3g", what, name, e, tol);
        worst = fmax(worst, e);
        at += n;
    }
    if (getenv("LOOM_CUDA_OPS_VERBOSE")) fprintf(stderr, "    %s: worst gradient rel L2 %.3g\n", what, worst);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

static void lora_kernels_case(int r, double dropout, const char *targets) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/adapter-r%d-%g-%s", loom_test_tmpdir(), r, dropout, targets);
    for (char *p = dir + strlen(loom_test_tmpdir()); *p; p++)
        if (*p == ',') *p = '_';
    if (!make_adapter(dir, r, dropout, targets)) return;
    lora_run cpu, gpu, cub;
    if (!lora_run_on(dir, LOOM_DEVICE_CPU, LOOM_F32, false, &cpu) ||
        !lora_run_on(dir, LOOM_DEVICE_CUDA, LOOM_BF16, false, &gpu) ||
        !lora_run_on(dir, LOOM_DEVICE_CUDA, LOOM_BF16, true, &cub))
        return;
    char what[128];
    snprintf(what, sizeof what, "r=%d dropout=%g %s", r, dropout, targets);
    /* Both GPU paths in bf16 against the fp32 CPU. Since loom's forward puts
     * LoRA's term inside the base GEMM (one bf16 rounding fewer than
     * cuBLASLt's pair), the two GPU paths differ by rounding, so each is held
     * to the CPU's bounds, and loom's logits must be no further from the CPU
     * than cuBLASLt's (L2, within 20%). */
    const double lg = rel_l2(gpu.logits, cpu.logits, 48 * 1024), lc = rel_l2(cub.logits, cpu.logits, 48 * 1024);
    if (getenv("LOOM_CUDA_OPS_VERBOSE"))
        fprintf(stderr, "    %s: logits vs CPU: kernels %.3g (L2 %.3g), cuBLASLt %.3g (L2 %.3g)\n", what,
                rel(gpu.logits, cpu.logits, 48 * 1024), lg, rel(cub.logits, cpu.logits, 48 * 1024), lc);
    CHECK_MSG(rel(gpu.logits, cpu.logits, 48 * 1024) <= 3e-2, "%s: logits vs CPU %.3g", what,
              rel(gpu.logits, cpu.logits, 48 * 1024));
    CHECK_MSG(rel(cub.logits, cpu.logits, 48 * 1024) <= 3e-2, "%s: cuBLASLt's logits vs CPU %.3g", what,
              rel(cub.logits, cpu.logits, 48 * 1024));
    CHECK_MSG(lg <= 1.2 * lc, "%s: logits vs CPU, L2 %.3g against cuBLASLt's %.3g", what, lg, lc);
    CHECK_MSG(rel(gpu.logits, cub.logits, 48 * 1024) <= 3e-2, "%s: logits vs cuBLASLt %.3g", what,
              rel(gpu.logits, cub.logits, 48 * 1024));
    CHECK_NEAR(gpu.loss, cpu.loss, 3e-2 * cpu.loss);
    CHECK_NEAR(cub.loss, cpu.loss, 3e-2 * cpu.loss);
    char w2[160];
    snprintf(w2, sizeof w2, "%s, kernels vs CPU", what);
    check_grads(dir, &gpu, &cpu, 0.1, w2);
    snprintf(w2, sizeof w2, "%s, cuBLASLt vs CPU", what);
    check_grads(dir, &cub, &cpu, 0.1, w2);
    snprintf(w2, sizeof w2, "%s, kernels vs cuBLASLt", what);
    check_grads(dir, &gpu, &cub, 0.1, w2);
    lora_run *runs[3] = {&cpu, &gpu, &cub};
    for (int i = 0; i < 3; i++) free(runs[i]->logits), free(runs[i]->grads);
}

TEST(lora_cuda_kernels_match_cpu_and_cublas) {
    if (!loom_test_have_gpu()) {
        loom_test_skip("no GPU visible (or loom built without CUDA)");
        return;
    }
    lora_kernels_case(8, 0.0, "all-linear");
    lora_kernels_case(16, 0.0, "all-linear");
    lora_kernels_case(8, 0.1, "all-linear");
    lora_kernels_case(8, 0.0, "q_proj,v_proj,down_proj");
}

/* 5 AdamW steps on the adapter only; then merge, and the base weights with
 * the adapter folded in are PEFT's merge_and_unload(). */
TEST(lora_adamw_trajectory_and_merge) {
    fx f;
    if (!fx_open(&f)) return;
    loom_optimizer_config oc = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8,
                                .weight_decay = 0.01};
    REQUIRE_OK(f.ctx, loom_model_set_optimizer(f.m, &oc));
    const loom_json *losses = loom_json_get(f.meta, "adamw_losses");
    const loom_json *norms = loom_json_get(f.meta, "adamw_grad_norms_before_clip");
    REQUIRE(losses && norms);
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = f.ids, .targets = f.tgt};
    float before[64 * 64];
    REQUIRE_OK(f.ctx, loom_model_get_param(f.m, "model.layers.1.self_attn.q_proj.weight", before,
                                           64 * 64));
    for (int s = 0; s < 5; s++) {
        loom_fb_result r;
        loom_step_result sr;
        REQUIRE_OK(f.ctx, loom_model_forward_backward(f.m, &b, 1, &r));
        REQUIRE_OK(f.ctx, loom_model_clip_grad_and_step(f.m, 1.0, 1, &sr));
        CHECK_NEAR(r.loss, losses->items[s]->d, TOL * losses->items[s]->d);
        CHECK_NEAR(sr.grad_norm, norms->items[s]->d, TOL * norms->items[s]->d);
    }
    /* the base did not move */
    float after[64 * 64];
    REQUIRE_OK(f.ctx, loom_model_get_param(f.m, "model.layers.1.self_attn.q_proj.weight", after,
                                           64 * 64));
    CHECK(!memcmp(before, after, sizeof before));
    float *l1 = malloc(48 * 1024 * 4), *l2 = malloc(48 * 1024 * 4);
    REQUIRE_OK(f.ctx, loom_model_forward_only(f.m, &b, 1, NULL, NULL, l1, NULL));
    REQUIRE_OK(f.ctx, loom_model_merge_adapter(f.m, "default"));
    int merged = 0;
    for (size_t i = 0; i < loom_st_count(f.st); i++) {
        const char *name = loom_st_at(f.st, i)->name;
        if (strncmp(name, "merged.", 7)) continue;
        int64_t n;
        float *w = ref(&f, name, &n), *got = malloc((size_t)n * 4);
        CHECK_OK(f.ctx, loom_model_get_param(f.m, name + 7, got, n));
        CHECK_MSG(rel_l2(got, w, n) <= TOL, "%s: %.3g", name, rel_l2(got, w, n));
        merged++;
        free(w);
        free(got);
    }
    CHECK_EQ_INT(merged, 46);
    /* merged: the same logits without the adapter path; unmerge restores */
    REQUIRE_OK(f.ctx, loom_model_forward_only(f.m, &b, 1, NULL, NULL, l2, NULL));
    CHECK_MSG(rel(l2, l1, 48 * 1024) <= 1e-5, "merged logits %.3g", rel(l2, l1, 48 * 1024));
    REQUIRE_OK(f.ctx, loom_model_unmerge_adapter(f.m, "default"));
    REQUIRE_OK(f.ctx, loom_model_get_param(f.m, "model.layers.1.self_attn.q_proj.weight", after,
                                           64 * 64));
    CHECK_MSG(rel(after, before, 64 * 64) <= 1e-6, "unmerge %.3g", rel(after, before, 64 * 64));
    CHECK(loom_model_unmerge_adapter(f.m, "default") == LOOM_ERR_INVALID_ARG);
    free(l1);
    free(l2);
    fx_close(&f);
}

/* Saved in PEFT's layout (names and shapes of the fixture's file), read
 * back bit-exactly. */
TEST(lora_save_and_reload) {
    fx f;
    if (!fx_open(&f)) return;
    char out[1024];
    snprintf(out, sizeof out, "%s/adapter", loom_test_tmpdir());
    REQUIRE_OK(f.ctx, loom_model_save_adapter(f.m, "default", out, LOOM_F32));
    loom_safetensors *mine, *peft;
    char p[1100];
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", out);
    REQUIRE_OK(f.ctx, loom_st_open_file(f.ctx, p, &mine));
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", f.adir);
    REQUIRE_OK(f.ctx, loom_st_open_file(f.ctx, p, &peft));
    CHECK_EQ_INT(loom_st_count(mine), loom_st_count(peft));
    for (size_t i = 0; i < loom_st_count(peft); i++) {
        const loom_st_tensor *a = loom_st_at(peft, i), *b = loom_st_find(mine, a->name);
        CHECK_MSG(b && b->ndim == 2 && b->shape[0] == a->shape[0] && b->shape[1] == a->shape[1],
                  "%s missing or misshapen", a->name);
    }
    loom_st_close(mine);
    loom_st_close(peft);
    loom_model_config dummy;
    (void)dummy;
    loom_json *cfg;
    snprintf(p, sizeof p, "%s/adapter_config.json", out);
    REQUIRE_OK(f.ctx, loom_json_parse_file(f.ctx, p, &cfg));
    int64_t r;
    double alpha;
    CHECK_OK(f.ctx, loom_json_get_int(f.ctx, cfg, "r", "cfg", &r));
    CHECK_OK(f.ctx, loom_json_get_num(f.ctx, cfg, "lora_alpha", "cfg", &alpha));
    CHECK_EQ_INT(r, 4);
    CHECK_NEAR(alpha, 8, 0);
    CHECK_EQ_INT(loom_json_get(cfg, "target_modules")->n, 7);
    /* the base model is named by its directory (models/tiny-qwen3), not its model_type */
    const loom_json *base = loom_json_get(cfg, "base_model_name_or_path");
    CHECK(base && base->type == LOOM_JSON_STRING);
    if (base && base->type == LOOM_JSON_STRING) CHECK_STR(base->s, "tiny-qwen3");
    loom_json_free(cfg);
    /* reload under another name: every tensor bit-identical */
    REQUIRE_OK(f.ctx, loom_model_load_adapter(f.m, "again", out));
    char name[256], name2[300];
    int64_t shape[2];
    int count = 0;
    for (int64_t i = 0; loom_model_adapter_tensor(f.m, "default", i, name, sizeof name, shape); i++) {
        int64_t n = shape[0] * shape[1];
        float *a = malloc((size_t)n * 4), *b = malloc((size_t)n * 4);
        snprintf(name2, sizeof name2, "%.*s.again.weight", (int)(strlen(name) - 7), name);
        CHECK_OK(f.ctx, loom_model_get_param(f.m, name2, b, n));
        snprintf(name2, sizeof name2, "%.*s.default.weight", (int)(strlen(name) - 7), name);
        CHECK_OK(f.ctx, loom_model_get_param(f.m, name2, a, n));
        CHECK(!memcmp(a, b, (size_t)n * 4));
        count++;
        free(a);
        free(b);
    }
    CHECK_EQ_INT(count, 56);
    fx_close(&f);
}

static void copy_file(const char *from, const char *to) {
    FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
    char buf[65536];
    size_t n;
    while (a && b && (n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
    if (a) fclose(a);
    if (b) fclose(b);
}

TEST(lora_bad_adapters_are_refused) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char base[1024];
    snprintf(base, sizeof base, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, base, NULL, &m));
    loom_lora_config c = {.r = 8, .lora_alpha = 16, .target_modules = "q_proj,foo_proj"};
    CHECK(loom_model_add_adapter(m, "a", &c) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "'foo_proj' is not one loom knows");
    c.target_modules = "all-linear";
    c.r = 0;
    CHECK(loom_model_add_adapter(m, "a", &c) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "r=0 must be >= 1");
    c.r = 8;
    c.lora_dropout = 1.0;
    CHECK(loom_model_add_adapter(m, "a", &c) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "lora_dropout=1 must lie in [0, 1)");
    /* an adapter whose shapes do not fit: the fixture's weights (r=4) under a
     * config that says r=8 */
    char dir[1024], p[1100], q[1100];
    snprintf(dir, sizeof dir, "%s/bad", loom_test_tmpdir());
    loom_mkdirs(ctx, dir);
    snprintf(p, sizeof p, "%s/models/tiny-qwen3-lora/adapter_model.safetensors",
             loom_test_fixtures());
    snprintf(q, sizeof q, "%s/adapter_model.safetensors", dir);
    copy_file(p, q);
    snprintf(q, sizeof q, "%s/adapter_config.json", dir);
    FILE *fc = fopen(q, "w");
    REQUIRE(fc);
    fputs("{\"peft_type\": \"LORA\", \"r\": 8, \"lora_alpha\": 16, \"target_modules\": "
          "\"all-linear\"}", fc);
    fclose(fc);
    CHECK(loom_model_load_adapter(m, "bad", dir) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "needs [8, 128]");
    CHECK_CONTAINS(loom_last_error(ctx), "made for another model");
    /* the same file on a 2-layer model: tensors of layers it does not have */
    loom_model *m2;
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = "{\"num_hidden_layers\": 2}";
    REQUIRE_OK(ctx, loom_model_create(ctx, base, &o, &m2));
    CHECK(loom_model_load_adapter(m2, "x", loom_test_fixtures()) == LOOM_ERR_NOT_FOUND);
    snprintf(p, sizeof p, "%s/models/tiny-qwen3-lora", loom_test_fixtures());
    CHECK(loom_model_load_adapter(m2, "x", p) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "2-layer model");
    /* a fresh adapter trains; B starts at zero so the loss is the base's */
    c.lora_dropout = 0;
    CHECK_OK(ctx, loom_model_add_adapter(m, "fresh", &c));
    loom_model_free(m);
    loom_model_free(m2);
    loom_ctx_free(ctx);
}

/* A fresh adapter leaves the model's output unchanged until it trains, and
 * training moves only the adapter. */
TEST(lora_fresh_adapter_starts_at_the_base) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char base[1024];
    snprintf(base, sizeof base, "%s/models/tiny-llama", loom_test_fixtures());
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, base, NULL, &m));
    int32_t ids[32], tgt[32];
    for (int i = 0; i < 32; i++) ids[i] = (i * 37 + 11) % 1000;
    for (int i = 0; i < 32; i++) tgt[i] = i + 1 < 32 ? ids[i + 1] : -100;
    loom_batch b = {.rows = 2, .seq_len = 16, .input_ids = ids, .targets = tgt};
    loom_fb_result r0, r1, r2;
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, &r0));
    loom_lora_config c = {.r = 8, .lora_alpha = 32, .target_modules = "q_proj, v_proj", .seed = 3};
    REQUIRE_OK(ctx, loom_model_add_adapter(m, "mine", &c));
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r1));
    CHECK_NEAR(r1.loss, r0.loss, 1e-6 * r0.loss);
    loom_optimizer_config oc = loom_optimizer_config_default();
    oc.lr = 1e-2;
    REQUIRE_OK(ctx, loom_model_set_optimizer(m, &oc));
    loom_step_result sr;
    REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 1, &sr));
    CHECK(sr.stepped && sr.grad_norm > 0);
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, &r2));
    CHECK(r2.loss < r1.loss);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

/* Dropout on the adapter input: off in forward_only, on in forward_backward
 * (a new mask each call), and the gradient is the gradient of the loss under
 * the mask (central finite differences on A and B elements, the mask held). */
TEST(lora_dropout_gradient) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char base[1024];
    snprintf(base, sizeof base, "%s/models/tiny-qwen2", loom_test_fixtures());
    loom_model *m;
    REQUIRE_OK(ctx, loom_model_create(ctx, base, NULL, &m));
    loom_lora_config c = {.r = 4, .lora_alpha = 8, .lora_dropout = 0.3, .seed = 5};
    REQUIRE_OK(ctx, loom_model_add_adapter(m, "d", &c));
    /* B starts at zero: give it values so that A matters */
    loom_adapter *ad = &m->adapters[0];
    for (int i = 0; i < ad->ar.nslots; i++)
        if (strstr(ad->ar.slots[i].name, "lora_B"))
            for (size_t k = 0; k < ad->ar.slots[i].numel; k++)
                ad->ar.w[ad->ar.slots[i].off + k] = 0.05f * (float)((k * 7919) % 13) - 0.3f;
    int32_t ids[24], tgt[24];
    for (int i = 0; i < 24; i++) ids[i] = (i * 53 + 7) % 1000;
    for (int i = 0; i < 24; i++) tgt[i] = i + 1 < 24 ? ids[i + 1] : -100;
    loom_batch b = {.rows = 2, .seq_len = 12, .input_ids = ids, .targets = tgt};
    loom_fb_result r0, r1, r2, e0;
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, &e0));
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r1));
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r2));
    CHECK_MSG(r1.loss != r2.loss, "two calls drew the same dropout mask");
    CHECK_MSG(r1.loss != e0.loss, "dropout changed nothing");
    REQUIRE_OK(ctx, loom_model_forward_only(m, &b, 1, NULL, NULL, NULL, &r0));
    CHECK(r0.loss == e0.loss); /* no dropout outside training */
    /* gradient at a fixed mask */
    loom_model_zero_grad(m);
    m->dropout_calls = 40; /* the call counts 41 */
    REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r1));
    const char *names[] = {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
                           "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
                           "base_model.model.model.layers.2.mlp.gate_proj.lora_B.weight"};
    for (int k = 0; k < 3; k++) {
        const loom_slot *sl = NULL;
        for (int i = 0; i < ad->ar.nslots; i++)
            if (!strcmp(ad->ar.slots[i].name, names[k])) sl = &ad->ar.slots[i];
        REQUIRE(sl);
        int64_t n = (int64_t)sl->numel;
        float *g = malloc((size_t)n * 4);
        REQUIRE_OK(ctx, loom_model_get_grad(m, names[k], g, n));
        for (int e = 0; e < 3; e++) {
            int64_t idx = (e * 37 + 5) % n;
            float *w = ad->ar.w + sl->off + idx, w0 = *w;
            const float h = 1e-2f;
            double lp, lm;
            loom_fb_result rr;
            *w = w0 + h;
            m->dropout_calls = 40; /* the call below counts 41 */
            REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &rr));
            lp = rr.loss;
            *w = w0 - h;
            m->dropout_calls = 40;
            REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &rr));
            lm = rr.loss;
            *w = w0;
            double fd = (lp - lm) / (2 * h);
            CHECK_MSG(fabs(fd - g[idx]) <= 2e-3 * fmax(fabs(fd), 1e-2),
                      "%s[%lld]: finite difference %.6g vs gradient %.6g", names[k],
                      (long long)idx, fd, g[idx]);
        }
        free(g);
    }
    loom_model_free(m);
    loom_ctx_free(ctx);
}
