/* Qwen3.5 under loom's layouts on MPI ranks against one process (`loom
 * golden`: loss, log-probs, every gradient): the fixture's model, a model
 * of gated attention only, and a random hybrid of Gated DeltaNet and gated
 * attention under tensor (+sequence), pipeline (+interleaved), context and
 * data parallelism, with LoRA, and its checkpoints across meshes. */
#include <math.h>
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/core/json.h"
#include "../src/core/rng.h"
#include "common/golden.h"
#include "common/qwen35_models.h"
#include "harness.h"

/* tiny-qwen3_5 (Gated DeltaNet layers) under PP2, PP4, TP2 (+SP) and DP2
 * on MPI ranks against one process. The pipelines keep every micro-batch
 * whole and sum nothing in another order: within 1e-5. The fixture's model
 * is ill-conditioned: scaling its embedding by 1 + 6e-8 noise (fp32's
 * rounding) moves its logits by 1.7e-5 of the largest, and by 1.3e-5 at a
 * few tokens under TP2 (6e-7 at the others), whose row-parallel sums round
 * in another order; DP2 runs each rank's row alone. Their gradients move
 * by up to 8e-5 of a tensor's largest at the first layers: within 2e-4, as
 * against transformers. The random hybrid model below, better conditioned,
 * holds every layout to 1e-5. */
TEST(qwen35_parallel_layouts) {
    if (!loom_test_have_mpirun())
        SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    const char *dir = "tests/fixtures_qwen3_5/models/tiny-qwen3_5";
    const char *batch = "tests/fixtures_qwen3_5/golden/tiny-qwen3_5.safetensors";
    char one[1024], out[1024];
    snprintf(one, sizeof one, "%s/q35-one.safetensors", loom_test_tmpdir());
    snprintf(out, sizeof out, "%s/q35-layout.safetensors", loom_test_tmpdir());
    REQUIRE(loom_test_golden(0, dir, batch, one, NULL) == 0);
    static const struct {
        const char *flags[4];
        double tol;
    } layouts[] = {{{"--pp", "2", NULL}, 1e-5},
                   {{"--pp", "4", NULL}, 1e-5},
                   {{"--tp", "2", NULL}, 2e-4},
                   {{"--tp", "2", "--sequence-parallel"}, 2e-4},
                   {{"--dp", "2", NULL}, 2e-4}};
    for (size_t l = 0; l < sizeof layouts / sizeof layouts[0]; l++) {
        const char *const *f = layouts[l].flags;
        char label[64];
        snprintf(label, sizeof label, "%s %s%s", f[0], f[1], f[2] ? " +sp" : "");
        CHECK_MSG(loom_test_golden(atoi(f[1]), dir, batch, out, f) == 0, "%s failed", label);
        loom_test_compare_layout(ctx, out, one, label, layouts[l].tol, 55);
    }
    loom_ctx_free(ctx);
}

/* The start of the tests below: skipped without mpirun; a quiet context
 * with config's random model saved under the test directory's `name` (tmp;
 * the model's directory in dir). NULL on a failure (reported). */
static loom_ctx *q35_begin(const char *name, const char *config, char tmp[1024],
                           char dir[1100]) {
    if (!loom_test_have_mpirun())
        SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx)) {
        loom_test_fail(__FILE__, __LINE__, "no context");
        return NULL;
    }
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    snprintf(tmp, 1024, "%s/%s", loom_test_tmpdir(), name);
    if (!loom_q35_saved_model(ctx, tmp, config, dir, 1100)) {
        loom_test_fail(__FILE__, __LINE__, "%s: %s", name, loom_last_error(ctx));
        loom_ctx_free(ctx);
        return NULL;
    }
    return ctx;
}

/* Runs the layouts (np ranks each, flags NULL-terminated after `extra`)
 * against one process with `extra`, at 1e-5. */
typedef struct q35_layout {
    int np;
    const char *flags[10];
} q35_layout;

static void run_layouts(loom_ctx *ctx, const char *tmp, const char *dir, const char *batch,
                           const char *const *extra, const q35_layout *ls, size_t n) {
    char one[1200], out[1200];
    snprintf(one, sizeof one, "%s/one.safetensors", tmp);
    snprintf(out, sizeof out, "%s/layout.safetensors", tmp);
    REQUIRE(loom_test_golden(0, dir, batch, one, extra) == 0);
    for (size_t l = 0; l < n; l++) {
        const char *f[16];
        char label[200] = "";
        int k = 0;
        for (int i = 0; extra && extra[i]; i++) f[k++] = extra[i];
        for (int i = 0; ls[l].flags[i]; i++) {
            f[k++] = ls[l].flags[i];
            if (!strncmp(ls[l].flags[i], "--num", 5)) /* the label without micro-batches */
                f[k++] = ls[l].flags[++i];
            else
                snprintf(label + strlen(label), sizeof label - strlen(label), "%s%s",
                         *label ? " " : "", ls[l].flags[i]);
        }
        f[k] = NULL;
        CHECK_MSG(loom_test_golden(ls[l].np, dir, batch, out, f) == 0, "%s failed", label);
        loom_test_compare_layout(ctx, out, one, label, 1e-5, 0);
    }
}

/* The gated model under tensor (+ sequence), pipeline, context and data
 * parallelism on MPI ranks equals the one-process run: loss, log-probs and
 * every gradient (`loom golden`, 3 AdamW steps), within 1e-5. */
TEST(qwen35_gated_attention_parallel_layouts) {
    char tmp[1024], dir[1100], batch[1100];
    loom_ctx *ctx = q35_begin("qwen35-par", loom_q35_gated, tmp, dir);
    REQUIRE(ctx);
    REQUIRE_OK(ctx, loom_test_write_batch(ctx, tmp, "batch", 2, 24, 64, 31));
    snprintf(batch, sizeof batch, "%s/batch.safetensors", tmp);
    static const q35_layout layouts[] = {
        {2, {"--tp", "2", NULL}}, {2, {"--tp", "2", "--sequence-parallel", NULL}},
        {2, {"--pp", "2", NULL}}, {2, {"--cp", "2", NULL}},
        {2, {"--dp", "2", NULL}},
    };
    run_layouts(ctx, tmp, dir, batch, NULL, layouts, sizeof layouts / sizeof layouts[0]);
    loom_ctx_free(ctx);
}

/* The hybrid model (Gated DeltaNet and gated attention) under TP2, TP2+SP,
 * PP4 with two model chunks a rank (interleaved), TP2 x PP2, DP2, CP2,
 * CP2 x TP2+SP and CP2 x DP2 on MPI ranks equals the one-process run within
 * 1e-5: loss, log-probs and every gradient; with packed documents too. */
TEST(qwen35_hybrid_parallel_layouts) {
    char tmp[1024], dir[1100], batch[1100];
    loom_ctx *ctx = q35_begin("qwen35-hybrid", loom_q35_hybrid, tmp, dir);
    REQUIRE(ctx);
    REQUIRE_OK(ctx, loom_test_write_batch(ctx, tmp, "batch", 4, 32, 256, 7));
    snprintf(batch, sizeof batch, "%s/batch.safetensors", tmp);
    static const q35_layout layouts[] = {
        {2, {"--tp", "2", NULL}},
        {2, {"--tp", "2", "--sequence-parallel", NULL}},
        {4, {"--pp", "4", "--vpp", "2", "--num-micro-batches", "4", NULL}},
        {4, {"--tp", "2", "--pp", "2", "--sequence-parallel", "--num-micro-batches", "2", NULL}},
        {2, {"--dp", "2", NULL}},
        {2, {"--cp", "2", NULL}},
        {4, {"--cp", "2", "--tp", "2", "--sequence-parallel", NULL}},
        {4, {"--cp", "2", "--dp", "2", NULL}},
    };
    run_layouts(ctx, tmp, dir, batch, NULL, layouts, sizeof layouts / sizeof layouts[0]);
    /* packed documents (one shorter than the conv's kernel, one across the
     * cp ranks' chunks): the state and the convolution restart at each */
    static const int docs[] = {3, 30, 15, 48};
    REQUIRE_OK(ctx, loom_test_write_docs_batch(ctx, tmp, "docs", 2, 48, 256, 9, docs, 4));
    snprintf(batch, sizeof batch, "%s/docs.safetensors", tmp);
    static const q35_layout packed[] = {
        {2, {"--cp", "2", NULL}},
        {4, {"--cp", "2", "--tp", "2", "--sequence-parallel", NULL}},
        {2, {"--pp", "2", NULL}},
    };
    run_layouts(ctx, tmp, dir, batch, NULL, packed, sizeof packed / sizeof packed[0]);
    loom_ctx_free(ctx);
}

/* LoRA on every linear of both layer kinds (in_proj_a and in_proj_b
 * named): in_proj_qkv's B splits over tp as its base's q, k and v rows do.
 * An adapter trained 3 steps, then TP2, TP2+SP and TP2 x PP2 against one
 * process: every LoRA gradient within 1e-5. */
TEST(qwen35_hybrid_lora_tensor_parallel) {
    char tmp[1024], dir[1100], batch[1100], adir[1100];
    loom_ctx *ctx = q35_begin("qwen35-hybrid-lora", loom_q35_hybrid, tmp, dir);
    REQUIRE(ctx);
    REQUIRE_OK(ctx, loom_test_write_batch(ctx, tmp, "batch", 2, 32, 256, 11));
    snprintf(batch, sizeof batch, "%s/batch.safetensors", tmp);
    snprintf(adir, sizeof adir, "%s/adapter", tmp);
    loom_model *m = NULL;
    loom_lora_config c = {.r = 4, .lora_alpha = 8, .seed = 3,
                          .target_modules = "all-linear,in_proj_a,in_proj_b"};
    loom_optimizer_config oc = {.lr = 2e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
    int32_t ids[64], tgt[64];
    for (int i = 0; i < 64; i++) ids[i] = (int32_t)(loom_splitmix64(5 + (uint64_t)i) % 256);
    for (int i = 0; i < 64; i++) tgt[i] = i % 32 == 31 ? -100 : ids[i + 1];
    loom_batch b = {.rows = 2, .seq_len = 32, .input_ids = ids, .targets = tgt};
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, NULL, &m));
    REQUIRE_OK(ctx, loom_model_add_adapter(m, "a", &c));
    REQUIRE_OK(ctx, loom_model_set_optimizer(m, &oc));
    for (int s = 0; s < 3; s++) {
        loom_fb_result fr;
        loom_step_result sr;
        REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &fr));
        REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, 1, &sr));
    }
    REQUIRE_OK(ctx, loom_model_save_adapter(m, "a", adir, LOOM_F32));
    loom_model_free(m);
    static const q35_layout layouts[] = {
        {2, {"--tp", "2", NULL}},
        {2, {"--tp", "2", "--sequence-parallel", NULL}},
        {4, {"--tp", "2", "--pp", "2", "--sequence-parallel", NULL}},
    };
    const char *extra[] = {"--adapter", adir, NULL};
    run_layouts(ctx, tmp, dir, batch, extra, layouts, sizeof layouts / sizeof layouts[0]);
    loom_ctx_free(ctx);
}

/* byte-identical files */
static bool same_bytes(loom_ctx *ctx, const char *a, const char *b) {
    char *x = NULL, *y = NULL;
    size_t lx = 0, ly = 0;
    const bool same = !loom_read_file(ctx, a, 0, &x, &lx) && !loom_read_file(ctx, b, 0, &y, &ly) &&
                      lx == ly && !memcmp(x, y, lx);
    free(x);
    free(y);
    return same;
}

/* The losses of steps 3 and 4 of metrics file path into l[3], l[4]. */
static int losses_3_4(const char *path, double l[5]) {
    FILE *f = fopen(path, "r");
    char line[4096];
    int n = 0;
    while (f && fgets(line, sizeof line, f)) {
        loom_json *o = NULL;
        if (loom_json_parse(NULL, line, strlen(line), "metrics", &o)) continue;
        const loom_json *s = loom_json_get(o, "step"), *v = loom_json_get(o, "loss");
        if (s && v && (s->i == 3 || s->i == 4)) l[s->i] = v->d, n++;
        loom_json_free(o);
    }
    if (f) fclose(f);
    return n;
}

/* `loom train` of the hybrid model on tokens, 4 steps, metrics into
 * `metrics`, on np ranks (0: one process) with extra flags (NULL-ended). */
static int hybrid_train(int np, const char *dir, const char *tokens, const char *metrics,
                        const char *const *extra, char **log) {
    const char *argv[48];
    int n = 0;
    if (np) argv[n++] = "mpirun", argv[n++] = "-np", argv[n++] = "2";
    const char *fixed[] = {loom_test_bin(), "train", "--device", "cpu", "--model", dir, "--data",
                           tokens, "--seq-len", "32", "--global-batch-size", "2", "--lr", "3e-3",
                           "--train-steps", "4", "--metrics-file", metrics, "--no-progress",
                           "--log-level", "warn"};
    for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++) argv[n++] = fixed[k];
    for (int k = 0; extra && extra[k] && n < 47; k++) argv[n++] = extra[k];
    argv[n] = NULL;
    return loom_test_run(log, argv);
}

/* Checkpoints of the Gated DeltaNet's fused q, k, v rows, saved at TP2: each
 * rank's share of every part is a piece of its own. `loom convert` of the
 * state gives the run's own --save-hf (and --save-adapter) byte for byte,
 * and one process resumes it: steps 3 and 4 within 1e-5 of the TP2 run's.
 * Full fine-tuning, then LoRA. */
TEST(qwen35_tensor_parallel_checkpoints) {
    char tmp[1024], dir[1100], txt[1100], tokens[1100], *log = NULL;
    loom_ctx *ctx = q35_begin("qwen35-ckpt", loom_q35_hybrid, tmp, dir);
    REQUIRE(ctx);
    snprintf(txt, sizeof txt, "%s/d.txt", tmp);
    snprintf(tokens, sizeof tokens, "%s/d.tokens", tmp);
    char text[4096] = "";
    for (int i = 0; i < 40; i++)
        snprintf(text + strlen(text), sizeof text - strlen(text), "line %d of the %s\n", i,
                 i % 3 ? "gated delta rule" : "state passing between ranks");
    REQUIRE_OK(ctx, loom_write_file_atomic(ctx, txt, text, strlen(text)));
    const char *data[] = {loom_test_bin(), "data", "--text", txt, "--out", tokens, NULL};
    REQUIRE(loom_test_run(&log, data) == 0);
    free(log);
    for (int lora = 0; lora < 2; lora++) {
        char ck[1200], hf[1200], conv[1200], ma[1200], mb[1200], it2[1300], a[1300], b[1300];
        snprintf(ck, sizeof ck, "%s/ck%d", tmp, lora);
        snprintf(hf, sizeof hf, "%s/hf%d", tmp, lora);
        snprintf(conv, sizeof conv, "%s/conv%d", tmp, lora);
        snprintf(ma, sizeof ma, "%s/a%d.jsonl", tmp, lora);
        snprintf(mb, sizeof mb, "%s/b%d.jsonl", tmp, lora);
        snprintf(it2, sizeof it2, "%s/iter_0000002", ck);
        const char *run[] = {"--tp", "2", "--save", ck, "--save-interval", "2",
                             lora ? "--save-adapter" : "--save-hf", hf,
                             lora ? "--lora-r" : NULL, "4", NULL};
        CHECK_MSG(hybrid_train(2, dir, tokens, ma, run, &log) == 0, "%s", log);
        free(log);
        const char *cv[] = {loom_test_bin(), "convert", "--from-checkpoint", ck, "--to",
                            lora ? "peft" : "hf", "--out", conv, "--log-level", "warn", NULL};
        CHECK_MSG(loom_test_run(&log, cv) == 0, "%s", log);
        free(log);
        const char *file = lora ? "adapter_model.safetensors" : "model.safetensors";
        snprintf(a, sizeof a, "%s/%s", hf, file);
        snprintf(b, sizeof b, "%s/%s", conv, file);
        CHECK_MSG(same_bytes(ctx, a, b), "%s: the export of the tp2 state differs from the run's",
                  file);
        const char *resume[] = {"--load", it2, lora ? "--lora-r" : NULL, "4", NULL};
        CHECK_MSG(hybrid_train(0, dir, tokens, mb, resume, &log) == 0, "%s", log);
        free(log);
        double la[5] = {0}, lb[5] = {0};
        CHECK_EQ_INT(losses_3_4(ma, la), 2);
        CHECK_EQ_INT(losses_3_4(mb, lb), 2);
        for (int s = 3; s <= 4; s++)
            CHECK_MSG(fabs(la[s] - lb[s]) <= 1e-5 * fabs(la[s]),
                      "%s step %d: tp2 %.9g, resumed on one process %.9g", lora ? "LoRA" : "full",
                      s, la[s], lb[s]);
        printf("    %s: steps 3, 4 at tp2 %.7f %.7f, resumed on one process %.7f %.7f\n",
               lora ? "LoRA" : "full", la[3], la[4], lb[3], lb[4]);
    }
    loom_ctx_free(ctx);
}
