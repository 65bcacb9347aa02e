/* The step profile (loom_model_profile, --profile): the parts a step runs
 * are all there, each in its phase, and they add up to the step's span on
 * the device, which the host's time per step bounds; the first step is
 * apart; an accumulation is one step; off, it says so. CPU and (skipped
 * without one) a GPU. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../include/loom.h"
#include "../src/core/json.h"
#include "harness.h"

/* The table's numbers: the host's and the parts' ms a step (header), the
 * rows' ms a step and shares summed. */
typedef struct {
    double host, parts, sum, share;
    int rows;
} table;

static bool parse(const char *rep, table *t) {
    memset(t, 0, sizeof *t);
    const char *h = strstr(rep, "ms a step on the host");
    const char *p = strstr(rep, "the parts on the device, ");
    if (!h || !p) return false;
    while (h > rep && h[-1] != ' ') h--; /* back to the number */
    while (h > rep && h[-1] == ' ') h--;
    while (h > rep && h[-1] != ' ' && h[-1] != ':') h--;
    t->host = strtod(h, NULL);
    t->parts = strtod(p + strlen("the parts on the device, "), NULL);
    const char *line = strstr(rep, "\n  phase");
    if (!line) return false;
    for (line = strchr(line + 1, '\n'); line && line[1]; line = strchr(line + 1, '\n')) {
        char phase[32], part[64];
        double ms, share, marks;
        /* a part's name may hold spaces: the numbers are the last three fields */
        const char *end = strchr(line + 1, '\n');
        size_t len = end ? (size_t)(end - line - 1) : strlen(line + 1);
        char row[256];
        if (len >= sizeof row) return false;
        memcpy(row, line + 1, len);
        row[len] = '\0';
        char *pct = strrchr(row, '%');
        if (!pct || sscanf(row, "%31s %63s", phase, part) != 2) continue;
        char *s = pct;
        while (s > row && s[-1] != ' ') s--;
        share = strtod(s, NULL);
        marks = strtod(pct + 1, NULL);
        while (s > row && s[-1] == ' ') s--;
        while (s > row && s[-1] != ' ') s--;
        ms = strtod(s, NULL);
        if (!(ms >= 0.0) || !(marks > 0.0)) return false;
        t->sum += ms, t->share += share, t->rows++;
    }
    return t->rows > 0;
}

static loom_ctx *quiet(void) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx)) return NULL;
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    return ctx;
}

/* steps steps of a tiny fixture (LoRA on every linear, recompute rc) with
 * the profile on, accumulating `acc` calls a step; its report into rep */
static void profiled_run(const char *fixture, loom_device dev, loom_recompute rc, int steps,
                         int acc, char *rep, size_t n) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/%s", loom_test_fixtures(), fixture);
    loom_ctx *ctx = quiet();
    REQUIRE(ctx);
    loom_model_options o;
    loom_model_options_default(&o);
    o.device = dev;
    o.dtype = dev == LOOM_DEVICE_CUDA ? LOOM_BF16 : LOOM_F32;
    o.recompute = rc;
    o.profile = 1;
    loom_model *m = NULL;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m));
    loom_lora_config lc = {.r = 4, .lora_alpha = 8.0, .target_modules = "all-linear", .seed = 1};
    REQUIRE_OK(ctx, loom_model_add_adapter(m, "default", &lc));
    loom_optimizer_config oc = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8};
    REQUIRE_OK(ctx, loom_model_set_optimizer(m, &oc));
    int32_t ids[48], tgt[48];
    for (int i = 0; i < 48; i++) ids[i] = (i * 37) % 200, tgt[i] = (i * 53 + 1) % 200;
    loom_batch b = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    char none[200];
    loom_model_profile(m, none, sizeof none);
    CHECK_CONTAINS(none, "no step was profiled");
    for (int s = 0; s < steps; s++)
        for (int k = 0; k < acc; k++) {
            loom_fb_result r;
            loom_step_result sr;
            REQUIRE_OK(ctx, loom_model_forward_backward(m, &b, 1, &r));
            REQUIRE_OK(ctx, loom_model_clip_grad_and_step(m, 1.0, acc, &sr));
        }
    loom_model_profile(m, rep, n);
    /* the time by kind since the model was made: every step; then none */
    loom_step_breakdown br, again;
    loom_model_profile_interval(m, &br);
    loom_model_profile_interval(m, &again);
    CHECK_EQ_INT(br.steps, steps);
    CHECK_MSG(br.compute_ms > 0.0 && br.comm_ms >= 0.0 && br.bubble_ms == 0.0 && br.idle_ms >= 0.0,
              "compute %g, comm %g, bubble %g, idle %g ms", br.compute_ms, br.comm_ms,
              br.bubble_ms, br.idle_ms);
    CHECK(again.steps == 0 && again.compute_ms == 0.0 && again.idle_ms == 0.0);
    loom_model_free(m);
    loom_ctx_free(ctx);
}

static void check_dense(loom_device dev) {
    if (dev == LOOM_DEVICE_CUDA && !loom_test_have_gpu()) SKIP("no GPU visible");
    char rep[16384];
    profiled_run("tiny-qwen3", dev, LOOM_RECOMPUTE_FULL, 3, 1, rep, sizeof rep);
    CHECK_CONTAINS(rep, "steps 2-3 (the first, warm-up, left out");
    static const char *want[] = {"forward    embedding", "forward    attention",
                                 "forward    mlp", "forward    output layer, loss",
                                 "recompute  attention", "recompute  mlp", "backward   mlp",
                                 "backward   attention", "step       gradient reduce",
                                 "step       gradient norm", "step       optimizer"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        CHECK_MSG(strstr(rep, want[i]) != NULL, "no '%s' in:\n%s", want[i], rep);
    table t;
    CHECK_MSG(parse(rep, &t), "cannot read the table:\n%s", rep);
    REQUIRE(t.rows > 0);
    /* the rows add up to the header (each printed to 0.001 ms), the shares
     * to 100%, and the host's time a step bounds the device's span */
    CHECK_MSG(t.parts > 0.0 && fabs(t.sum - t.parts) <= 0.001 * t.rows + 0.002,
              "rows %.4f ms, header %.4f:\n%s", t.sum, t.parts, rep);
    CHECK_MSG(fabs(t.share - 100.0) <= 0.1 * t.rows, "shares %.2f%%:\n%s", t.share, rep);
    CHECK_MSG(t.host >= t.parts - 0.01, "host %.3f ms a step < the parts' %.3f:\n%s", t.host,
              t.parts, rep);
    /* the breakdown line: its kinds add up to the parts (idle adds the time
     * between steps, which no part holds) */
    const char *bl = strstr(rep, "breakdown, ms a step: compute ");
    REQUIRE(bl);
    double c = 0, x = 0, bb = 0, id = 0;
    CHECK_MSG(sscanf(bl, "breakdown, ms a step: compute %lf, exposed communication %lf, pipeline "
                         "bubble %lf, idle %lf",
                     &c, &x, &bb, &id) == 4,
              "cannot read: %s", bl);
    /* the header's total is printed to 0.01 ms, the kinds to 0.001 */
    CHECK_MSG(c > 0.0 && c + x + bb <= t.parts + 0.008 && c + x + bb + id >= t.parts - 0.008,
              "compute %g + comm %g + bubble %g (+ idle %g) against the parts' %g ms", c, x, bb,
              id, t.parts);
}

TEST(profile_parts_add_up_cpu) { check_dense(LOOM_DEVICE_CPU); }
TEST(profile_parts_add_up_cuda) { check_dense(LOOM_DEVICE_CUDA); }

/* The MoE block's parts (one process: no all-to-all), an accumulation of
 * two calls as one step, and a model without the profile. */
TEST(profile_moe_accumulation_off) {
    char rep[16384];
    profiled_run("tiny-qwen3-moe", LOOM_DEVICE_CPU, LOOM_RECOMPUTE_NONE, 1, 2, rep, sizeof rep);
    CHECK_CONTAINS(rep, "step 1 only (warm-up included)");
    static const char *want[] = {"forward    moe.router", "forward    moe.counts (host wait)",
                                 "forward    moe.dispatch", "forward    moe.experts",
                                 "forward    moe.combine", "backward   moe.experts",
                                 "backward   moe.router", "step       expert stats"};
    for (size_t i = 0; i < sizeof want / sizeof *want; i++)
        CHECK_MSG(strstr(rep, want[i]) != NULL, "no '%s' in:\n%s", want[i], rep);
    CHECK_MSG(!strstr(rep, "moe.a2a"), "one process sent rows:\n%s", rep);
    table t;
    CHECK_MSG(parse(rep, &t), "cannot read the table:\n%s", rep);
    REQUIRE(t.rows > 0);
    /* two forward_backward calls in the one step: the embedding twice */
    const char *e = strstr(rep, "forward    embedding");
    REQUIRE(e);
    const char *nl = strchr(e, '\n');
    CHECK_MSG(nl && !strncmp(nl - 3, "2.0", 3), "%s", rep);

    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_ctx *ctx = quiet();
    REQUIRE(ctx);
    loom_model_options o;
    loom_model_options_default(&o);
    loom_model *m = NULL;
    REQUIRE_OK(ctx, loom_model_create(ctx, dir, &o, &m));
    loom_model_profile(m, rep, sizeof rep);
    CHECK_CONTAINS(rep, "profiling is off");
    loom_model_free(m);
    loom_ctx_free(ctx);
}

/* A small token file for the CLI runs below (data: its path); false on a
 * failure (reported). */
static bool prof_tokens(char data[1024]) {
    char text[1024], *out = NULL;
    snprintf(text, sizeof text, "%s/prof.txt", loom_test_tmpdir());
    snprintf(data, 1024, "%s/prof.tokens", loom_test_tmpdir());
    FILE *f = fopen(text, "w");
    if (!f) return false;
    for (int i = 0; i < 20; i++) fprintf(f, "experts route tokens %d ways.\n\n", i);
    fclose(f);
    const char *mk[] = {loom_test_bin(), "data", "--text", text, "--out", data, NULL};
    const int rc = loom_test_run(&out, mk);
    CHECK_MSG(rc == 0, "loom data: %s", out ? out : "");
    free(out);
    return rc == 0;
}

/* Expert parallelism on two CPU ranks (`loom train --profile`): each rank
 * prints its own table, with the all-to-alls as their own parts. */
TEST(profile_ep2_cli) {
    if (!loom_test_have_mpirun())
        SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char model[1024], data[1024], *out = NULL;
    snprintf(model, sizeof model, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    REQUIRE(prof_tokens(data));
    const char *argv[] = {"mpirun", "-np", "2", loom_test_bin(), "train", "--device", "cpu",
                          "--model", model, "--data", data, "--train-steps", "2", "--seq-len",
                          "32", "--global-batch-size", "2", "--ep", "2", "--profile", NULL};
    CHECK_EQ_INT(loom_test_run(&out, argv), 0);
    for (int r = 0; r < 2; r++) {
        char want[128];
        snprintf(want, sizeof want, "[rank %d/2] profile of rank %d (CPU: the host's clock): "
                 "steps 2-2", r, r);
        CHECK_MSG(out && strstr(out, want), "no '%s' in:\n%s", want, out ? out : "");
    }
    CHECK_CONTAINS(out, "forward    moe.a2a");
    CHECK_CONTAINS(out, "backward   moe.a2a");
    CHECK_CONTAINS(out, "step       gradient reduce");
    free(out);
}

/* The step's time by kind (`loom train --profile --metrics-file`) under PP2
 * and TP2 on CPU ranks: the log lines carry it, and rank 0's metrics file
 * has it on every line: the pipeline's exchanges as bubble under PP2 (none
 * in one process), tensor parallelism's collectives as exposed
 * communication under TP2. */
TEST(profile_breakdown_cli_layouts) {
    if (!loom_test_have_mpirun())
        SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    loom_ctx *ctx = quiet();
    REQUIRE(ctx);
    char model[1024], data[1024], mf[1100];
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    REQUIRE(prof_tokens(data));
    static const char *const layouts[3][2] = {{"--pp", "2"}, {"--tp", "2"}, {"--dp", "1"}};
    for (int l = 0; l < 3; l++) {
        const bool one = l == 2;
        snprintf(mf, sizeof mf, "%s/prof-%d.jsonl", loom_test_tmpdir(), l);
        remove(mf);
        char *out = NULL;
        const char *argv[] = {"mpirun", "-np", one ? "1" : "2", loom_test_bin(), "train",
                              "--device", "cpu", "--model", model, "--data", data,
                              "--train-steps", "3", "--seq-len", "32", "--global-batch-size", "4",
                              layouts[l][0], layouts[l][1], "--profile", "--metrics-file", mf,
                              NULL};
        CHECK_EQ_INT(loom_test_run(&out, argv), 0);
        CHECK_MSG(out && strstr(out, "| ms/step: compute ") && strstr(out, "breakdown, ms a step"),
                  "%s %s: no breakdown in:\n%s", layouts[l][0], layouts[l][1], out ? out : "");
        free(out);
        FILE *f = fopen(mf, "r");
        CHECK_MSG(f != NULL, "no metrics file %s", mf);
        char line[4096];
        int lines = 0;
        while (f && fgets(line, sizeof line, f)) {
            loom_json *doc = NULL;
            REQUIRE_OK(ctx, loom_json_parse(ctx, line, strlen(line), "metrics line", &doc));
            const loom_json *c = loom_json_get(doc, "compute_ms"),
                            *x = loom_json_get(doc, "exposed_comm_ms"),
                            *b = loom_json_get(doc, "bubble_ms"), *i = loom_json_get(doc, "idle_ms");
            CHECK_MSG(c && x && b && i, "%s %s: no breakdown in %s", layouts[l][0], layouts[l][1],
                      line);
            if (c && x && b && i) {
                CHECK(c->d > 0.0 && i->d >= 0.0);
                if (l == 0) CHECK_MSG(b->d > 0.0, "pp2: bubble %g ms", b->d);
                if (l == 1) CHECK_MSG(x->d > 0.0 && b->d == 0.0, "tp2: comm %g, bubble %g ms",
                                      x->d, b->d);
                if (one) CHECK_MSG(b->d == 0.0, "one process: bubble %g ms", b->d);
            }
            loom_json_free(doc);
            lines++;
        }
        if (f) fclose(f);
        CHECK_MSG(lines == 3, "%s %s: %d metrics lines, want 3", layouts[l][0], layouts[l][1],
                  lines);
    }
    loom_ctx_free(ctx);
}
