/* loom train's checkpoints end to end: --save / --save-interval / --load
 * resume bitwise (a token file and shuffled JSONL, whose loader position
 * comes back too), SIGTERM saves and exits 0, kill -9 at random moments of
 * training and saving always leaves a tracker naming a loadable checkpoint
 * that resumes bitwise, a state saved at tp2 pp2 resumes in one process,
 * --finetune, and the refusals. */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../include/loom.h"
#include "../src/core/json.h"
#include "harness.h"

typedef struct {
    char dir[256], model[512], tokens[320], jsonl[320];
} fx;

static bool fx_make(fx *f) {
    snprintf(f->dir, sizeof f->dir, "/tmp/loom-ckcli-%d", (int)getpid());
    snprintf(f->model, sizeof f->model, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(f->tokens, sizeof f->tokens, "%s/d.tokens", f->dir);
    snprintf(f->jsonl, sizeof f->jsonl, "%s/d.jsonl", f->dir);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", f->dir, f->dir);
    if (system(cmd)) return false;
    /* text for the token file (byte ids) and 24 JSONL samples of varied length */
    char txt[400];
    snprintf(txt, sizeof txt, "%s/d.txt", f->dir);
    FILE *t = fopen(txt, "w"), *j = fopen(f->jsonl, "w");
    if (!t || !j) return false;
    for (int i = 0; i < 60; i++)
        fprintf(t, "document %d says %.*s\n\n", i, 20 + i % 30,
                "the quick brown fox jumps over the lazy dog again and again");
    for (int i = 0; i < 24; i++)
        fprintf(j, "{\"text\": \"sample %d: %.*s\"}\n", i, 5 + (i * 7) % 20,
                "a b c d e f g h i j k l m n o p q r s t u v w x y z one two");
    fclose(t);
    fclose(j);
    char *out = NULL;
    const char *argv[] = {loom_test_bin(), "data", "--text", txt, "--out", f->tokens, NULL};
    int rc = loom_test_run(&out, argv);
    free(out);
    return rc == 0;
}

static void fx_free(fx *f) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", f->dir);
    if (system(cmd)) loom_test_fail(__FILE__, __LINE__, "could not remove %s", f->dir);
}

/* Losses of a metrics file by step (steps 1..cap; NAN where absent). */
static int read_losses(const char *path, double *loss, int cap) {
    for (int i = 0; i <= cap; i++) loss[i] = NAN;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        loom_json *o = NULL;
        if (loom_json_parse(NULL, line, strlen(line), "metrics", &o)) continue;
        const loom_json *s = loom_json_get(o, "step"), *l = loom_json_get(o, "loss");
        if (s && l && s->i >= 1 && s->i <= cap) {
            loss[s->i] = l->d;
            n++;
        }
        loom_json_free(o);
    }
    fclose(f);
    return n;
}

/* loom train with the common settings plus `extra` (NULL-ended). */
static int train(const fx *f, bool jsonl, int steps, const char *metrics, const char *const *extra,
                 char **out) {
    char st[16];
    snprintf(st, sizeof st, "%d", steps);
    const char *argv[64] = {loom_test_bin(), "train", "--device", "cpu", "--model", f->model,
                            "--data", jsonl ? f->jsonl : f->tokens, "--seq-len", "32",
                            "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-steps", "2",
                            "--train-steps", st, "--metrics-file", metrics, "--no-progress",
                            "--log-level", "warn"};
    int n = 0;
    while (argv[n]) n++;
    for (int i = 0; extra && extra[i]; i++) argv[n++] = extra[i];
    argv[n] = NULL;
    char *o = NULL;
    int rc = loom_test_run(&o, argv);
    if (out) *out = o;
    else free(o);
    return rc;
}

static void resume_case(bool jsonl) {
    fx f;
    REQUIRE(fx_make(&f));
    char ref[400], a[400], b[400], save[400], iter3[420];
    snprintf(ref, sizeof ref, "%s/ref.jsonl", f.dir);
    snprintf(a, sizeof a, "%s/a.jsonl", f.dir);
    snprintf(b, sizeof b, "%s/b.jsonl", f.dir);
    snprintf(save, sizeof save, "%s/ck", f.dir);
    snprintf(iter3, sizeof iter3, "%s/iter_0000003", save);
    char *out = NULL;
    CHECK_EQ_INT(train(&f, jsonl, 8, ref, NULL, &out), 0);
    free(out);
    const char *sv[] = {"--save", save, "--save-interval", "3", "--save-keep", "2", NULL};
    CHECK_EQ_INT(train(&f, jsonl, 8, a, sv, &out), 0);
    free(out);
    struct stat sb;
    char iter6[420], iter8[420];
    snprintf(iter6, sizeof iter6, "%s/iter_0000006", save);
    snprintf(iter8, sizeof iter8, "%s/iter_0000008", save);
    /* saved at 3, 6 and 8 (the end); --save-keep 2 left the newest two */
    CHECK(stat(iter3, &sb) != 0 && stat(iter6, &sb) == 0 && stat(iter8, &sb) == 0);
    const char *ld[] = {"--load", iter6, NULL};
    CHECK_EQ_INT(train(&f, jsonl, 8, b, ld, &out), 0);
    CHECK_MSG(!strstr(out, "resuming with"), "same settings, yet: %s", out);
    free(out);
    if (!jsonl) { /* another schedule is named, and applies */
        const char *ld3[] = {"--load", iter6, "--min-lr", "1e-4", "--adam-beta2", "0.95", NULL};
        unlink(b);
        CHECK_EQ_INT(train(&f, jsonl, 8, b, ld3, &out), 0);
        CHECK_CONTAINS(out, "resuming with min_lr 0.0001 where");
        CHECK_CONTAINS(out, "has 0 (the new value applies)");
        CHECK_CONTAINS(out, "resuming with adam_beta2 0.95 where");
        free(out);
        unlink(b);
        CHECK_EQ_INT(train(&f, jsonl, 8, b, ld, &out), 0);
        free(out);
    }
    double r[9], x[9];
    read_losses(ref, r, 8);
    CHECK_EQ_INT(read_losses(b, x, 8), 2);
    for (int s = 7; s <= 8; s++)
        CHECK_MSG(x[s] == r[s], "step %d: resumed %.17g, uninterrupted %.17g", s, x[s], r[s]);
    /* the root's newest is step 8: nothing left to train at --train-steps 8 */
    const char *ld2[] = {"--load", save, NULL};
    CHECK_EQ_INT(train(&f, jsonl, 8, b, ld2, &out), 1);
    CHECK_CONTAINS(out, "at step 8 already");
    free(out);
    fx_free(&f);
}

TEST(ckpt_cli_resume_is_bitwise_tokens) { resume_case(false); }
TEST(ckpt_cli_resume_is_bitwise_jsonl) { resume_case(true); }

static pid_t spawn(const char *const argv[], const char *log) {
    pid_t pid = fork();
    if (pid == 0) {
        FILE *o = freopen(log, "w", stdout);
        (void)o;
        dup2(1, 2);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return pid;
}

/* Metrics lines written so far. */
static int lines(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    fclose(f);
    return n;
}

static int tracker(const char *root) {
    char p[512];
    snprintf(p, sizeof p, "%s/latest_checkpointed_iteration.txt", root);
    FILE *f = fopen(p, "r");
    if (!f) return -1;
    int it = -1;
    if (fscanf(f, "%d", &it) != 1) it = -2;
    fclose(f);
    return it;
}

/* A long run stopped by a signal at a moment; the tracker's checkpoint then
 * resumes one step bitwise against the uninterrupted reference. */
static void stop_and_resume(fx *f, const double *ref, int sig, int trial, double delay_s) {
    char save[400], m[400], log[400], b[400];
    snprintf(save, sizeof save, "%s/k%d", f->dir, trial);
    snprintf(m, sizeof m, "%s/k%d.jsonl", f->dir, trial);
    snprintf(log, sizeof log, "%s/k%d.log", f->dir, trial);
    snprintf(b, sizeof b, "%s/k%d-b.jsonl", f->dir, trial);
    const char *argv[] = {loom_test_bin(), "train", "--device", "cpu", "--model", f->model,
                          "--data", f->tokens, "--seq-len", "32", "--global-batch-size", "4",
                          "--lr", "3e-3", "--lr-warmup-steps", "2", "--train-steps", "40",
                          "--metrics-file", m, "--no-progress", "--log-level", "warn", "--save",
                          save, "--save-interval", "1", "--save-keep", "2", NULL};
    pid_t pid = spawn(argv, log);
    REQUIRE(pid > 0);
    if (sig == SIGTERM) { /* after a few steps */
        for (int i = 0; i < 2000 && lines(m) < 3; i++) usleep(5000);
    } else {
        usleep((useconds_t)(delay_s * 1e6));
    }
    kill(pid, sig);
    int ws = 0;
    waitpid(pid, &ws, 0);
    if (sig == SIGTERM)
        CHECK_MSG(WIFEXITED(ws) && WEXITSTATUS(ws) == 0, "SIGTERM: exit status %d", ws);
    const int it = tracker(save);
    if (it == -1) { /* killed before its first tracker: a first checkpoint is whole or absent */
        char p[420];
        struct stat sb;
        snprintf(p, sizeof p, "%s/iter_0000001", save);
        if (stat(p, &sb) == 0) { /* killed between its rename and the tracker's (ckpt_dir.c) */
            loom_ctx *ctx = NULL;
            CHECK_MSG(loom_ctx_create(&ctx) == LOOM_OK && loom_verify_state(ctx, p) == LOOM_OK,
                      "trial %d: iter_0000001 without a tracker is not whole", trial);
            loom_ctx_free(ctx);
        }
        return;
    }
    CHECK_MSG(it >= 1 && it <= 40, "trial %d: tracker %d", trial, it);
    if (it == 40) { /* the run finished before the kill: its last checkpoint is whole */
        char p[420];
        snprintf(p, sizeof p, "%s/iter_0000040", save);
        loom_ctx *ctx = NULL;
        CHECK(loom_ctx_create(&ctx) == LOOM_OK && loom_verify_state(ctx, p) == LOOM_OK);
        loom_ctx_free(ctx);
        return;
    }
    if (it < 1) return;
    char steps[16];
    snprintf(steps, sizeof steps, "%d", it + 1);
    const char *rv[] = {loom_test_bin(), "train", "--device", "cpu", "--model", f->model, "--data",
                        f->tokens, "--seq-len", "32", "--global-batch-size", "4", "--lr", "3e-3",
                        "--lr-warmup-steps", "2", "--train-steps", steps, "--metrics-file", b,
                        "--no-progress", "--log-level", "warn", "--load", save, NULL};
    char *out = NULL;
    CHECK_MSG(loom_test_run(&out, rv) == 0, "trial %d: resume from %d failed: %s", trial, it, out);
    free(out);
    double x[41];
    read_losses(b, x, 40);
    CHECK_MSG(x[it + 1] == ref[it + 1], "trial %d (kill at %.3f s, tracker %d): step %d "
              "resumed %.17g, uninterrupted %.17g", trial, delay_s, it, it + 1, x[it + 1],
              ref[it + 1]);
}

TEST(ckpt_cli_sigterm_saves_and_exits_0_and_kill9_never_breaks_latest) {
    fx f;
    REQUIRE(fx_make(&f));
    char ref[400];
    snprintf(ref, sizeof ref, "%s/ref.jsonl", f.dir);
    char *out = NULL;
    REQUIRE(train(&f, false, 40, ref, NULL, &out) == 0);
    free(out);
    double r[41];
    CHECK_EQ_INT(read_losses(ref, r, 40), 40);
    stop_and_resume(&f, r, SIGTERM, 0, 0);
    /* how long a run takes here, to spread the kills over it */
    double t0 = (loom_test_now_ms() / 1e3);
    char m[400];
    snprintf(m, sizeof m, "%s/timing.jsonl", f.dir);
    const char *sv[] = {"--save", m, "--save-interval", "1", NULL};
    char save_t[400];
    snprintf(save_t, sizeof save_t, "%s/timing", f.dir);
    sv[1] = save_t;
    train(&f, false, 40, m, sv, &out);
    free(out);
    const double span = (loom_test_now_ms() / 1e3) - t0;
    srand((unsigned)time(NULL));
    for (int trial = 1; trial <= 20; trial++)
        stop_and_resume(&f, r, SIGKILL, trial, span * (0.05 + 0.9 * rand() / (double)RAND_MAX));
    fx_free(&f);
}

/* Saved at tp2 pp2 under mpirun, resumed in one process (and LoRA the other
 * way round); --finetune starts from the weights alone; the refusals. */
TEST(ckpt_cli_resume_on_another_mesh_and_finetune) {
    fx f;
    REQUIRE(fx_make(&f));
    char ref[400], b[400], save[400], lsave[400], lref[400];
    snprintf(ref, sizeof ref, "%s/ref.jsonl", f.dir);
    snprintf(lref, sizeof lref, "%s/lref.jsonl", f.dir);
    snprintf(b, sizeof b, "%s/b.jsonl", f.dir);
    snprintf(save, sizeof save, "%s/ck", f.dir);
    snprintf(lsave, sizeof lsave, "%s/lck", f.dir);
    char *out = NULL;
    double r[7], x[7];
    CHECK_EQ_INT(train(&f, false, 6, ref, NULL, &out), 0);
    free(out);
    read_losses(ref, r, 6);
    if (loom_test_have_mpirun()) {
        loom_test_mpi_env();
        char m[400];
        snprintf(m, sizeof m, "%s/m.jsonl", f.dir);
        const char *argv[] = {"mpirun", "-np", "4", loom_test_bin(), "train", "--device", "cpu",
                              "--model", f.model, "--data", f.tokens, "--seq-len", "32",
                              "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-steps", "2",
                              "--train-steps", "6", "--metrics-file", m, "--no-progress",
                              "--log-level", "warn", "--tp", "2", "--pp", "2", "--save", save,
                              "--save-interval", "3", NULL};
        CHECK_MSG(loom_test_run(&out, argv) == 0, "%s", out);
        free(out);
        char it3[420];
        snprintf(it3, sizeof it3, "%s/iter_0000003", save);
        const char *ld[] = {"--load", it3, NULL};
        CHECK_EQ_INT(train(&f, false, 6, b, ld, &out), 0);
        free(out);
        CHECK_EQ_INT(read_losses(b, x, 6), 3);
        for (int s = 4; s <= 6; s++)
            CHECK_MSG(fabs(x[s] - r[s]) <= 1e-5 * fabs(r[s]), "step %d: resumed on one process "
                      "%.9g, uninterrupted %.9g", s, x[s], r[s]);
        /* a file per rank; one of them missing is named */
        char cmd[2000];
        snprintf(cmd, sizeof cmd, "mkdir %s/gone && cp -r %s %s/gone/ && "
                 "rm %s/gone/iter_0000003/rank_00002.safetensors && "
                 "test -f %s/rank_00003.safetensors", f.dir, it3, f.dir, f.dir, it3);
        CHECK(system(cmd) == 0);
        char gone[440];
        snprintf(gone, sizeof gone, "%s/gone/iter_0000003", f.dir);
        const char *lg[] = {"--load", gone, NULL};
        unlink(b);
        CHECK_EQ_INT(train(&f, false, 6, b, lg, &out), 1);
        CHECK_CONTAINS(out, "rank_00002.safetensors is missing: rank 2 of the 4 ranks that saved");
        free(out);
        /* LoRA: saved by one process, resumed at dp2 x tp2 */
        const char *lo[] = {"--lora-r", "4", "--save", lsave, "--save-interval", "3", NULL};
        CHECK_EQ_INT(train(&f, false, 6, lref, lo, &out), 0);
        free(out);
        read_losses(lref, r, 6);
        snprintf(it3, sizeof it3, "%s/iter_0000003", lsave);
        const char *argv2[] = {"mpirun", "-np", "4", loom_test_bin(), "train", "--device", "cpu",
                               "--model", f.model, "--data", f.tokens, "--seq-len", "32",
                               "--global-batch-size", "4", "--lr", "3e-3", "--lr-warmup-steps", "2",
                               "--train-steps", "6", "--metrics-file", b, "--no-progress",
                               "--log-level", "warn", "--tp", "2", "--lora-r", "4", "--load", it3,
                               NULL};
        unlink(b);
        CHECK_MSG(loom_test_run(&out, argv2) == 0, "%s", out);
        free(out);
        CHECK_EQ_INT(read_losses(b, x, 6), 3);
        for (int s = 4; s <= 6; s++)
            CHECK_MSG(fabs(x[s] - r[s]) <= 1e-5 * fabs(r[s]), "LoRA step %d: resumed at dp2 tp2 "
                      "%.9g, uninterrupted %.9g", s, x[s], r[s]);
    } else {
        loom_test_skip("no mpirun: the other-mesh part");
    }
    /* the refusals: a LoRA state into full fine-tuning; a root without tracker */
    const char *sv[] = {"--lora-r", "4", "--save", lsave, "--save-interval", "3", NULL};
    CHECK_EQ_INT(train(&f, false, 3, lref, sv, &out), 0);
    free(out);
    const char *bad[] = {"--load", lsave, NULL};
    unlink(b);
    CHECK_EQ_INT(train(&f, false, 6, b, bad, &out), 1);
    CHECK_CONTAINS(out, "holds a LoRA adapter's state, this model trains the whole model");
    free(out);
    const char *none[] = {"--load", f.dir, NULL};
    CHECK_EQ_INT(train(&f, false, 6, b, none, &out), 1);
    CHECK_CONTAINS(out, "latest_checkpointed_iteration.txt");
    free(out);
    /* --finetune: the weights of step 3, then steps 1.. with a fresh optimizer */
    char full[400];
    snprintf(full, sizeof full, "%s/fck", f.dir);
    const char *fs[] = {"--save", full, "--save-interval", "3", NULL};
    CHECK_EQ_INT(train(&f, false, 3, ref, fs, &out), 0);
    free(out);
    const char *ft[] = {"--load", full, "--finetune", NULL};
    unlink(b);
    CHECK_EQ_INT(train(&f, false, 2, b, ft, &out), 0);
    free(out);
    CHECK_EQ_INT(read_losses(b, x, 6), 2);
    CHECK(!isnan(x[1]) && !isnan(x[2]));
    fx_free(&f);
}

/* Qwen3-MoE: full fine-tuning saved under ep2 (mpirun), resumed in one
 * process; LoRA on the experts saved in one process, resumed at ep2 tp2
 * etp1 + SP (the experts' state resharded both ways). Micro-batches of 2
 * rows everywhere: the load-balancing loss is per micro-batch. */
TEST(ckpt_cli_moe_resumes_across_expert_folds) {
    fx f;
    REQUIRE(fx_make(&f));
    if (!loom_test_have_mpirun()) {
        fx_free(&f);
        SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    }
    loom_test_mpi_env();
    snprintf(f.model, sizeof f.model, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    char ref[400], b[400], save[400], it3[420], m[400];
    snprintf(ref, sizeof ref, "%s/mref.jsonl", f.dir);
    snprintf(b, sizeof b, "%s/mb.jsonl", f.dir);
    char *out = NULL;
    double r[7], x[7];
    for (int lora = 0; lora < 2; lora++) {
        snprintf(save, sizeof save, "%s/mck%d", f.dir, lora);
        snprintf(it3, sizeof it3, "%s/iter_0000003", save);
        snprintf(m, sizeof m, "%s/mm%d.jsonl", f.dir, lora);
        /* LoRA: the router's too (all-linear,gate) */
        const char *one[] = {"--micro-batch-size", "2", lora ? "--lora-r" : NULL, "4",
                             "--lora-target", "all-linear,gate", NULL};
        unlink(ref);
        CHECK_EQ_INT(train(&f, false, 6, ref, one, &out), 0);
        free(out);
        read_losses(ref, r, 6);
        const char *mesh[] = {"--ep", "2", "--tp", "2", "--etp", "1", "--sequence-parallel"};
        const char *argv[48] = {"mpirun", "-np", lora ? "4" : "2", loom_test_bin(), "train",
                                "--device", "cpu", "--model", f.model, "--data", f.tokens,
                                "--seq-len", "32", "--global-batch-size", "4", "--lr", "3e-3",
                                "--lr-warmup-steps", "2", "--train-steps", "6", "--metrics-file", m,
                                "--no-progress", "--log-level", "warn", "--micro-batch-size", "2"};
        int n = 0;
        while (argv[n]) n++;
        for (int i = 0; i < (lora ? 7 : 2); i++) argv[n++] = mesh[i];
        if (lora) {
            argv[n++] = "--lora-r", argv[n++] = "4", argv[n++] = "--load", argv[n++] = it3;
            argv[n++] = "--lora-target", argv[n++] = "all-linear,gate";
            const char *sv[] = {"--micro-batch-size", "2", "--lora-r", "4", "--lora-target",
                                "all-linear,gate", "--save", save, "--save-interval", "3", NULL};
            CHECK_EQ_INT(train(&f, false, 3, b, sv, &out), 0); /* saved by one process */
            free(out);
        } else {
            argv[n++] = "--save", argv[n++] = save, argv[n++] = "--save-interval", argv[n++] = "3";
        }
        argv[n] = NULL;
        unlink(m);
        CHECK_MSG(loom_test_run(&out, argv) == 0, "%s", out);
        free(out);
        if (!lora) { /* resumed in one process */
            const char *ld[] = {"--micro-batch-size", "2", "--load", it3, NULL};
            unlink(m);
            CHECK_EQ_INT(train(&f, false, 6, m, ld, &out), 0);
            free(out);
        }
        CHECK_EQ_INT(read_losses(m, x, 6), 3);
        for (int s = 4; s <= 6; s++)
            CHECK_MSG(fabs(x[s] - r[s]) <= 1e-5 * fabs(r[s]), "%s step %d: resumed %.9g, "
                      "uninterrupted %.9g", lora ? "LoRA at ep2 tp2 etp1" : "one process after ep2",
                      s, x[s], r[s]);
    }
    fx_free(&f);
}

static bool same_file(const char *a, const char *b) {
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "cmp -s %.590s %.590s", a, b);
    return system(cmd) == 0;
}

/* convert --from-checkpoint: PEFT and HF files equal to what the run itself
 * wrote at its end (--save-adapter, --save-hf), also from a state saved at
 * tp2 pp2; --merge-lora; the refusals. */
TEST(ckpt_cli_convert_from_checkpoint) {
    fx f;
    REQUIRE(fx_make(&f));
    char m[400], ck[400], lck[400], hf[400], peft[400], o1[400], o2[400], a[500], b[500];
    snprintf(m, sizeof m, "%s/m.jsonl", f.dir);
    snprintf(ck, sizeof ck, "%s/ck", f.dir);
    snprintf(lck, sizeof lck, "%s/lck", f.dir);
    snprintf(hf, sizeof hf, "%s/hf", f.dir);
    snprintf(peft, sizeof peft, "%s/peft", f.dir);
    snprintf(o1, sizeof o1, "%s/o1", f.dir);
    snprintf(o2, sizeof o2, "%s/o2", f.dir);
    char *out = NULL;
    const char *lo[] = {"--lora-r", "4", "--save", lck, "--save-adapter", peft, NULL};
    CHECK_EQ_INT(train(&f, false, 3, m, lo, &out), 0);
    free(out);
    const char *c1[] = {loom_test_bin(), "convert", "--from-checkpoint", lck, "--to", "peft",
                        "--out", o1, "--log-level", "warn", NULL};
    CHECK_MSG(loom_test_run(&out, c1) == 0, "%s", out);
    free(out);
    snprintf(a, sizeof a, "%s/adapter_model.safetensors", peft);
    snprintf(b, sizeof b, "%s/adapter_model.safetensors", o1);
    CHECK_MSG(same_file(a, b), "the PEFT export differs from --save-adapter");
    const char *c2[] = {loom_test_bin(), "convert", "--from-checkpoint", lck, "--to", "hf",
                        "--out", o2, "--log-level", "warn", NULL};
    CHECK_EQ_INT(loom_test_run(&out, c2), 1);
    CHECK_CONTAINS(out, "--merge-lora");
    free(out);
    const char *c3[] = {loom_test_bin(), "convert", "--from-checkpoint", lck, "--to", "hf",
                        "--merge-lora", "--out", o2, "--log-level", "warn", NULL};
    CHECK_MSG(loom_test_run(&out, c3) == 0, "%s", out);
    free(out);
    snprintf(a, sizeof a, "%s/model.safetensors", o2);
    CHECK(loom_file_exists(a));
    /* full fine-tuning saved at tp2 pp2: the export equals that run's --save-hf */
    if (loom_test_have_mpirun()) {
        loom_test_mpi_env();
        const char *argv[] = {"mpirun", "-np", "4", loom_test_bin(), "train", "--device", "cpu",
                              "--model", f.model, "--data", f.tokens, "--seq-len", "32",
                              "--global-batch-size", "4", "--lr", "3e-3", "--train-steps", "3",
                              "--no-progress", "--log-level", "warn", "--tp", "2", "--pp", "2",
                              "--save", ck, "--save-hf", hf, NULL};
        CHECK_MSG(loom_test_run(&out, argv) == 0, "%s", out);
        free(out);
        snprintf(o1, sizeof o1, "%s/o3", f.dir);
        const char *c4[] = {loom_test_bin(), "convert", "--from-checkpoint", ck, "--out", o1,
                            "--log-level", "warn", NULL};
        CHECK_MSG(loom_test_run(&out, c4) == 0, "%s", out);
        free(out);
        snprintf(a, sizeof a, "%s/model.safetensors", hf);
        snprintf(b, sizeof b, "%s/model.safetensors", o1);
        CHECK_MSG(same_file(a, b), "the HF export of a tp2 pp2 checkpoint differs from --save-hf");
        const char *c5[] = {loom_test_bin(), "convert", "--from-checkpoint", ck, "--to", "peft",
                            "--out", o2, "--log-level", "warn", NULL};
        CHECK_EQ_INT(loom_test_run(&out, c5), 1);
        CHECK_CONTAINS(out, "use --to hf");
        free(out);
    } else {
        loom_test_skip("no mpirun: the tp2 pp2 part");
    }
    fx_free(&f);
}
