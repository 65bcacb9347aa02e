/* Every parallel layout against the one-process run, on CPU ranks under
 * mpirun: `loom golden` with a mesh writes the full, unsharded loss,
 * gradients and (after 5 AdamW steps) weights. Loss, log-probs and every
 * gradient must equal the one-process result within 1e-5 (max |a-b| /
 * max |b|); the weights after the fixture's 5 steps must match the HF
 * fixture within 1e-4 (relative L2: see test_model.c) and the per-step
 * losses within 1e-4. */
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../src/io/safetensors.h"
#include "harness.h"

/* Runs argv as np ranks started the way torchrun starts them (RANK,
 * WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no mpirun, so loom's CPU ranks talk
 * over Gloo), all their output in *log. Once a rank fails, the others get
 * `grace_s` to end on their own, then are killed (as torchrun does); rank
 * kill_rank (>= 0) is killed after kill_after_s. Returns the first failing
 * rank's status (128 + signal when killed), 0 when all succeeded. */
static int run_ranks(int np, char **log, const char *const argv[], double grace_s, int kill_rank,
                     double kill_after_s, int codes[]) {
    char path[1024];
    snprintf(path, sizeof path, "%s/ranks-out-XXXXXX", loom_test_tmpdir());
    int held = -1, fd = mkstemp(path), port = loom_test_hold_port(&held), first = 0, left = np;
    pid_t pids[16];
    if (fd < 0 || np > 16) {
        if (held >= 0) close(held);
        return -1;
    }
    for (int r = 0; r < np; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            int nul = open("/dev/null", O_RDONLY);
            dup2(nul, 0);
            dup2(fd, 1);
            dup2(fd, 2);
            loom_test_rank_env(r, np, port);
            execvp(argv[0], (char *const *)argv);
            _exit(127);
        }
    }
    const double t0 = loom_now_s();
    double kill_at = -1;
    while (left > 0) {
        int status = 0;
        pid_t p = waitpid(-1, &status, WNOHANG);
        for (int r = 0; p > 0 && r < np; r++) {
            if (pids[r] != p) continue;
            int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
            pids[r] = 0;
            left--;
            if (codes) codes[r] = code;
            if (code && !first) {
                first = code;
                kill_at = loom_now_s() + grace_s;
            }
        }
        if (p > 0) continue;
        const double t = loom_now_s();
        if (kill_rank >= 0 && pids[kill_rank] > 0 && t - t0 > kill_after_s) {
            kill(pids[kill_rank], SIGKILL);
            kill_rank = -1;
        }
        if (kill_at >= 0 && t > kill_at)
            for (int r = 0; r < np; r++)
                if (pids[r] > 0) kill(pids[r], SIGKILL);
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    close(fd);
    if (held >= 0) close(held);
    size_t len;
    if (loom_read_file(NULL, path, 0, log, &len) != LOOM_OK) *log = NULL;
    unlink(path);
    return first;
}

/* golden() starts its np ranks under mpirun (MPI), or as run_ranks does
 * (Gloo) when this is set. */
static bool ranks_by_gloo;

/* Runs `[mpirun -np N] loom golden --model M --batch B --out O <layout>` with
 * the fixture's optimizer settings; np 0 runs one process without mpirun. */
static int golden(int np, const char *model, const char *batch, const char *out,
                  const char *layout, char **log) {
    const char *argv[48];
    int n = 0;
    char nps[16];
    snprintf(nps, sizeof nps, "%d", np);
    if (np && !ranks_by_gloo) {
        argv[n++] = "mpirun";
        argv[n++] = "-np";
        argv[n++] = nps;
    }
    argv[n++] = loom_test_bin();
    /* CPU ranks over MPI (a GPU machine would otherwise pick --device cuda) */
    const char *fixed[] = {"golden", "--device", "cpu", "--model", model, "--batch", batch, "--out", out,
                           "--steps", "5", "--lr", "1e-3", "--adam-beta2", "0.95",
                           "--weight-decay", "0.1", "--clip-grad", "1.0", "--log-level", "warn"};
    for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) argv[n++] = fixed[i];
    static char words[2048];
    snprintf(words, sizeof words, "%s", layout);
    for (char *tok = strtok(words, " "); tok && n < 46; tok = strtok(NULL, " ")) argv[n++] = tok;
    argv[n] = NULL;
    if (np && ranks_by_gloo) return run_ranks(np, log, argv, 5.0, -1, 0, NULL);
    return loom_test_run(log, argv);
}

typedef struct errs {
    double fwd, grad, final, losses;
    const char *fwd_name, *grad_name, *final_name;
} errs;

static double max_rel(const float *a, const float *b, uint64_t n) {
    double md = 0, mr = 0;
    for (uint64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (!(d <= md)) md = d;
        mr = fmax(mr, fabs((double)b[i]));
    }
    return md / (mr > 0 ? mr : 1);
}

static double l2_rel(const float *a, const float *b, uint64_t n) {
    double dd = 0, rr = 0;
    for (uint64_t i = 0; i < n; i++) {
        dd += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        rr += (double)b[i] * b[i];
    }
    return sqrt(dd / (rr > 0 ? rr : 1));
}

/* Compares tensors of `got` with `ref` whose names start with `prefix`
 * (or equal it); returns the worst error and its name. Every tensor of
 * `ref` must be in `got` with its size, and readable: a missing one fails
 * the comparison (INFINITY, named), except the output layer of a tied model
 * (HF's fixtures list lm_head beside the embedding it shares; loom writes
 * the embedding once). */
static double compare(loom_ctx *ctx, loom_safetensors *got, loom_safetensors *ref,
                      const char *prefix, bool exact_name, bool l2, const char **worst_name,
                      int *count) {
    double worst = 0;
    for (size_t i = 0; i < loom_st_count(ref); i++) {
        const loom_st_tensor *r = loom_st_at(ref, i);
        if (exact_name ? strcmp(r->name, prefix) : strncmp(r->name, prefix, strlen(prefix)))
            continue;
        const loom_st_tensor *g = loom_st_find(got, r->name);
        if (!g) {
            const char *lm = strstr(r->name, "lm_head.weight");
            char emb[512];
            snprintf(emb, sizeof emb, "%.*smodel.embed_tokens.weight",
                     lm ? (int)(lm - r->name) : 0, r->name);
            if (lm && !lm[strlen("lm_head.weight")] && loom_st_find(got, emb) &&
                loom_st_find(ref, emb))
                continue; /* tied: compared as the embedding */
            *worst_name = r->name;
            return INFINITY;
        }
        if (g->numel != r->numel) {
            *worst_name = r->name;
            return INFINITY;
        }
        float *a = malloc(g->numel * 4), *b = malloc(r->numel * 4);
        if (!a || !b || loom_st_read(ctx, g, LOOM_F32, a, g->numel) ||
            loom_st_read(ctx, r, LOOM_F32, b, r->numel)) {
            free(a);
            free(b);
            *worst_name = r->name;
            return INFINITY;
        }
        double e = l2 ? l2_rel(a, b, g->numel) : max_rel(a, b, g->numel);
        if (!(e <= worst)) {
            worst = e;
            *worst_name = r->name;
        }
        (*count)++;
        free(a);
        free(b);
    }
    return worst;
}

/* A named tensor of st into dst, or an error naming it when it is absent. */
static loom_status st_get(loom_ctx *ctx, loom_safetensors *st, const char *name, loom_dtype dt,
                          void *dst, uint64_t n) {
    const loom_st_tensor *t = loom_st_find(st, name);
    if (!t) return loom_errf(ctx, LOOM_ERR_NOT_FOUND, "no tensor '%s'", name);
    return loom_st_read(ctx, t, dt, dst, n);
}

/* Writes a batch of `rows` rows of `seq` random tokens (and their next
 * tokens as targets) to path. */
static bool write_random_batch(const char *dir, const char *stem, int rows, int seq,
                               unsigned seed) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(rows * seq));
    int32_t *tgt = malloc(sizeof(int32_t) * (size_t)(rows * seq));
    loom_status rc = ids && tgt ? LOOM_OK : LOOM_ERR_OOM;
    for (int i = 0; !rc && i < rows * seq; i++) {
        seed = seed * 1103515245u + 12345u;
        ids[i] = (int32_t)((seed >> 8) % 1000);
    }
    for (int i = 0; !rc && i < rows * seq; i++) tgt[i] = (i + 1) % seq ? ids[i + 1] : -100;
    loom_st_writer *w = NULL;
    int64_t sh[2] = {rows, seq};
    if (!rc) rc = loom_st_writer_create(ctx, dir, stem, 0, NULL, &w);
    if (!rc) rc = loom_st_writer_declare(ctx, w, "input_ids", LOOM_I64, 2, sh);
    if (!rc) rc = loom_st_writer_declare(ctx, w, "targets", LOOM_I64, 2, sh);
    if (!rc) rc = loom_st_writer_write(ctx, w, "input_ids", LOOM_I32, ids);
    if (!rc) rc = loom_st_writer_write(ctx, w, "targets", LOOM_I32, tgt);
    if (!rc) rc = loom_st_writer_finish(ctx, w);
    if (rc) loom_test_fail(__FILE__, __LINE__, "%s/%s: %s", dir, stem, loom_last_error(ctx));
    loom_st_writer_free(w);
    free(ids);
    free(tgt);
    loom_ctx_free(ctx);
    return rc == LOOM_OK;
}

static char *path_in_tmp(const char *name) {
    static char bufs[8][1024];
    static int k;
    char *b = bufs[k++ % 8];
    snprintf(b, 1024, "%s/%s", loom_test_tmpdir(), name);
    return b;
}

/* One layout of one model: the run against the one-process run of the same
 * batch, and (when fixture_final) its trajectory against the HF fixture. */
static void check_layout_fx(const char *model, const char *fixture, const char *batch,
                            const char *one, int np, const char *layout, bool fixture_final,
                            bool same_batch) {
    char mdir[1024], fix[1024], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/%s", loom_test_fixtures_of(model), model);
    snprintf(fix, sizeof fix, "%s/golden/%s.safetensors", loom_test_fixtures_of(fixture), fixture);
    const char *out = path_in_tmp("layout.safetensors");
    int rc = golden(np, mdir, batch, out, layout, &log);
    CHECK_MSG(rc == 0, "%s %s: exit %d\n%s", model, layout, rc, log ? log : "");
    free(log);
    if (rc) return;
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_safetensors *got = NULL, *ref = NULL, *hf = NULL;
    if (loom_st_open_file(ctx, out, &got) || loom_st_open_file(ctx, one, &ref) ||
        loom_st_open_file(ctx, fix, &hf)) {
        loom_test_fail(__FILE__, __LINE__, "%s", loom_last_error(ctx));
        goto done;
    }
    const char *wn = "";
    int n = 0;
    double e = 0;
    /* a tiled batch has the same loss and gradients, its own per-token outputs */
    const char *fwd[] = {"loss", "token_logprobs", "entropy", "logits"};
    const int nfwd = same_batch ? 4 : 1;
    for (int i = 0; i < nfwd; i++)
        e = fmax(e, compare(ctx, got, ref, fwd[i], true, false, &wn, &n));
    CHECK_MSG(e <= 1e-5 && n == nfwd, "%s %s: forward differs from one process by %.3g (%s)", model,
              layout, e, wn);
    n = 0;
    e = compare(ctx, got, ref, "grad.", false, false, &wn, &n);
    CHECK_MSG(e <= 1e-5 && n > 30, "%s %s: gradient %s differs from one process by %.3g", model,
              layout, wn, e);
    if (fixture_final) {
        n = 0;
        e = compare(ctx, got, hf, "final.", false, true, &wn, &n);
        bool has_final = false;
        for (size_t i = 0; i < loom_st_count(hf) && !has_final; i++)
            has_final = !strncmp(loom_st_at(hf, i)->name, "final.", 6);
        CHECK_MSG(e <= 1e-4 && (n > 30 || !has_final),
                  "%s %s: after 5 steps %s differs from HF by %.3g (L2)", model, layout, wn, e);
        /* per-step losses against the fixture's json */
        double losses[5];
        const loom_st_tensor *t = loom_st_find(got, "adamw_losses");
        char jp[1024];
        snprintf(jp, sizeof jp, "%s/golden/%s.json", loom_test_fixtures_of(fixture), fixture);
        loom_json *meta = NULL;
        if (t && !loom_st_read(ctx, t, LOOM_F64, losses, 5) &&
            !loom_json_parse_file(ctx, jp, &meta)) {
            const loom_json *l = loom_json_get(meta, "adamw_losses");
            for (int s = 0; l && s < 5; s++)
                CHECK_MSG(fabs(losses[s] - l->items[s]->d) <= 1e-4 * l->items[s]->d,
                          "%s %s: step %d loss %.9g vs HF %.9g", model, layout, s + 1, losses[s],
                          l->items[s]->d);
        } else {
            loom_test_fail(__FILE__, __LINE__, "no adamw_losses: %s", loom_last_error(ctx));
        }
        loom_json_free(meta);
    }
done:
    loom_st_close(got);
    loom_st_close(ref);
    loom_st_close(hf);
    loom_ctx_free(ctx);
}

static void check_layout(const char *model, const char *batch, const char *one, int np,
                         const char *layout, bool fixture_final, bool same_batch) {
    check_layout_fx(model, model, batch, one, np, layout, fixture_final, same_batch);
}

/* The fixture's batch (2 rows of 24) and the same rows tiled 4 times (the
 * mean loss and its gradient are unchanged, so the HF trajectory holds). */
static bool make_batches(const char *model, char *b2, char *b8) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    char fix[1024];
    snprintf(fix, sizeof fix, "%s/golden/%s.safetensors", loom_test_fixtures_of(model), model);
    snprintf(b2, 1024, "%s", fix);
    snprintf(b8, 1024, "%s", path_in_tmp("batch8.safetensors"));
    loom_safetensors *st = NULL;
    int32_t ids[48], tgt[48], ids8[192], tgt8[192];
    loom_status rc = loom_st_open_file(ctx, fix, &st);
    if (!rc) rc = st_get(ctx, st, "input_ids", LOOM_I32, ids, 48);
    if (!rc) rc = st_get(ctx, st, "targets", LOOM_I32, tgt, 48);
    loom_st_close(st);
    for (int r = 0; r < 4; r++) {
        memcpy(ids8 + 48 * r, ids, sizeof ids);
        memcpy(tgt8 + 48 * r, tgt, sizeof tgt);
    }
    loom_st_writer *w = NULL;
    int64_t sh[2] = {8, 24};
    if (!rc) rc = loom_st_writer_create(ctx, loom_test_tmpdir(), "batch8", 0, NULL, &w);
    if (!rc) rc = loom_st_writer_declare(ctx, w, "input_ids", LOOM_I64, 2, sh);
    if (!rc) rc = loom_st_writer_declare(ctx, w, "targets", LOOM_I64, 2, sh);
    if (!rc) rc = loom_st_writer_write(ctx, w, "input_ids", LOOM_I32, ids8);
    if (!rc) rc = loom_st_writer_write(ctx, w, "targets", LOOM_I32, tgt8);
    if (!rc) rc = loom_st_writer_finish(ctx, w);
    if (rc) loom_test_fail(__FILE__, __LINE__, "%s: %s", fix, loom_last_error(ctx));
    loom_st_writer_free(w);
    loom_ctx_free(ctx);
    return rc == LOOM_OK;
}

static void check_model(const char *model) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char b2[1024], b8[1024], mdir[1024], *log = NULL;
    if (!make_batches(model, b2, b8)) return;
    snprintf(mdir, sizeof mdir, "%s/models/%s", loom_test_fixtures(), model);
    const char *one = path_in_tmp("one.safetensors");
    int rc = golden(0, mdir, b2, one, "", &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return;
    static const struct {
        int np;
        const char *layout;
        bool big;
    } layouts[] = {
        {2, "--tp 2", false},
        {2, "--tp 2 --sequence-parallel", false},
        {2, "--pp 2", false},
        {2, "--pp 2 --vpp 2 --num-micro-batches 2", false},
        {2, "--cp 2", false},
        {2, "--dp 2 --num-micro-batches 4", true},
        {2, "--dp 2 --accumulation-steps 2", true},
        {8, "--tp 2 --pp 2 --dp 2", false},
        {8, "--tp 2 --cp 2 --pp 2 --sequence-parallel", false},
    };
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++)
        check_layout(model, layouts[i].big ? b8 : b2, one, layouts[i].np, layouts[i].layout, true,
                     !layouts[i].big);
}

TEST(parallel_layouts_qwen3) { check_model("tiny-qwen3"); }

typedef struct moe_layout {
    int np;
    const char *layout;
    bool big;
    int ref_micro;
} moe_layout;

static void check_moe_layouts(const char *model, const moe_layout *layouts, size_t nl);

/* One layout with options co against one process cut into the layout's
 * reference micro-batches (HF's trajectory too when hf); false when the
 * one-process run failed. */
static bool check_moe_layout(const char *model, const char *mdir, const char *b2, const char *b8,
                             const moe_layout *l, const char *co, bool hf) {
    char lay[512], *log = NULL;
    const char *one = path_in_tmp("one.safetensors");
    snprintf(lay, sizeof lay, "%s --num-micro-batches %d", co, l->ref_micro);
    int rc = golden(0, mdir, l->big ? b8 : b2, one, lay, &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return false;
    snprintf(lay, sizeof lay, "%s %s", co, l->layout);
    check_layout(model, l->big ? b8 : b2, one, l->np, lay, hf && !l->big, !l->big);
    return true;
}
/* Whether s is one of the '|'-separated items of list. */
static bool one_of(const char *list, const char *s) {
    const size_t n = strlen(s);
    for (const char *p = list; p; p = strchr(p, '|'), p = p ? p + 1 : NULL)
        if (!strncmp(p, s, n) && (p[n] == '|' || !p[n])) return true;
    return false;
}

/* Qwen3-MoE (experts split over tp like the dense MLP): without the
 * load-balancing loss against HF's trajectory, and with it (coefficient
 * 0.5, so it moves the weights) against one process cut into the same
 * micro-batches (ref_micro of them), since the loss is per micro-batch and
 * its sums travel through the pipeline's stages. */
TEST(parallel_layouts_qwen3_moe) {
    static const moe_layout layouts[] = {
        {2, "--tp 2", false, 1},
        {2, "--tp 2 --sequence-parallel", false, 1},
        {2, "--cp 2", false, 1},
        {2, "--pp 2", false, 1},
        {2, "--pp 2 --vpp 2 --num-micro-batches 2", false, 2},
        {2, "--dp 2 --num-micro-batches 2", true, 4},
        {8, "--tp 2 --cp 2 --dp 2 --sequence-parallel", true, 2},
        {8, "--tp 2 --pp 2 --dp 2 --num-micro-batches 2", true, 4},
        /* expert parallelism (Megatron's folding; sequence parallel under tp) */
        {2, "--ep 2", false, 2},
        {2, "--ep 2 --tp 2 --etp 1 --sequence-parallel", false, 1},
        {2, "--tp 2 --etp 1 --sequence-parallel", false, 1},
        {4, "--ep 2 --etp 2 --tp 2 --sequence-parallel", false, 2},
        {4, "--ep 2 --pp 2", false, 2},
        {4, "--ep 2 --dp 4", true, 4},
        {4, "--ep 4", true, 4},
        {8, "--ep 2 --etp 2 --tp 2 --cp 2 --sequence-parallel", true, 2},
    };
    check_moe_layouts("tiny-qwen3-moe", layouts, sizeof layouts / sizeof layouts[0]);
}

/* The ep dispatch once per choice (LOOM_MOE_DEDUP=0: more bytes than the
 * default once per rank, kept to compare) equals one process too. */
TEST(parallel_moe_dispatch_per_choice) {
    static const moe_layout layouts[] = {
        {2, "--ep 2", false, 2},
        {2, "--ep 2 --tp 2 --etp 1 --sequence-parallel", false, 1},
        {4, "--ep 2 --pp 2", false, 2},
        {4, "--ep 4", true, 4},
    };
    setenv("LOOM_MOE_DEDUP", "0", 1);
    check_moe_layouts("tiny-qwen3-moe", layouts, sizeof layouts / sizeof layouts[0]);
    unsetenv("LOOM_MOE_DEDUP");
}

/* Megatron's forced load balancing (benchmarks' routing, drawn by each
 * token's index in the global batch) routes the same under every mesh
 * without cp, so the folds equal one process with it too. */
TEST(parallel_moe_force_load_balancing) {
    static const moe_layout layouts[] = {
        {2, "--ep 2", false, 2},
        {2, "--ep 2 --tp 2 --etp 1 --sequence-parallel", false, 1},
        {4, "--ep 2 --pp 2", false, 2},
        {4, "--ep 2 --dp 4", true, 4},
    };
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char b2[1024], b8[1024], mdir[1024];
    if (!make_batches("tiny-qwen3-moe", b2, b8)) return;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3-moe", loom_test_fixtures_of("tiny-qwen3-moe"));
    const char *co = "--moe-router-force-load-balancing --config-override {\"router_aux_loss_coef\":0.5}";
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++)
        if (!check_moe_layout("tiny-qwen3-moe", mdir, b2, b8, &layouts[i], co, false)) return;
}

/* Qwen2-MoE (tests/fixtures_moe): its shared expert split over tp on the
 * local path and beside the folded one's dispatch, its gate's gradient
 * summed over tp */
TEST(parallel_layouts_qwen2_moe) {
    static const moe_layout layouts[] = {
        {2, "--tp 2", false, 1},
        {2, "--tp 2 --sequence-parallel", false, 1},
        {2, "--cp 2", false, 1},
        {2, "--pp 2", false, 1},
        {2, "--ep 2 --tp 2 --etp 1 --sequence-parallel", false, 1},
        {4, "--ep 2 --etp 2 --tp 2 --sequence-parallel", false, 2},
        {4, "--ep 2 --pp 2", false, 2},
    };
    check_moe_layouts("tiny-qwen2-moe", layouts, sizeof layouts / sizeof layouts[0]);
}

static void check_moe_layouts(const char *model, const moe_layout *layouts, size_t nl) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char b2[1024], b8[1024], mdir[1024];
    if (!make_batches(model, b2, b8)) return;
    snprintf(mdir, sizeof mdir, "%s/models/%s", loom_test_fixtures_of(model), model);
    /* aux 2: Megatron's per-layer form (its sums per layer through the
     * pipeline and over tp x cp), on a few layouts; 3: with the router
     * z-loss (its sums the same way; its gradient once on the local path's
     * tp ranks, on every folded rank for its own tokens); 4, 5: with an
     * expert capacity, by weight and by position, on the layouts whose
     * ranks route the one process's micro-batches (the capacity is per
     * router call: cp, and tp on the fold, split the tokens it sees, as in
     * Megatron) */
    for (int aux = 0; aux < 6; aux++) {
        const char *co = aux == 5   ? "--moe-expert-capacity-factor 0.75 --moe-token-drop-policy "
                                      "position --config-override {\"router_aux_loss_coef\":0.5}"
                         : aux == 4 ? "--moe-expert-capacity-factor 0.5 --config-override "
                                      "{\"router_aux_loss_coef\":0.5}"
                         : aux == 3 ? "--moe-z-loss-coeff 0.5 --moe-aux-loss per-layer "
                                      "--config-override {\"router_aux_loss_coef\":0.5}"
                         : aux == 2 ? "--moe-aux-loss per-layer --config-override "
                                      "{\"router_aux_loss_coef\":0.5}"
                         : aux == 1 ? "--config-override {\"router_aux_loss_coef\":0.5}"
                                    : "--config-override {\"router_aux_loss_coef\":0}";
        for (size_t i = 0; i < nl; i++) {
            if (aux == 2 && !strstr(" --cp 2| --pp 2 --vpp 2 --num-micro-batches 2| --ep 2 --tp 2 "
                                    "--etp 1 --sequence-parallel| --ep 2 --pp 2|",
                                    layouts[i].layout))
                continue;
            if (aux == 3 && !one_of("--tp 2|--cp 2|--pp 2 --vpp 2 --num-micro-batches 2|"
                                    "--ep 2 --tp 2 --etp 1 --sequence-parallel|--ep 2 --pp 2|"
                                    "--ep 2 --etp 2 --tp 2 --sequence-parallel",
                                    layouts[i].layout))
                continue;
            if (aux == 4 && !one_of("--tp 2|--tp 2 --sequence-parallel|--pp 2|"
                                    "--dp 2 --num-micro-batches 2|--ep 2|--ep 2 --pp 2|--ep 4",
                                    layouts[i].layout))
                continue;
            if (aux == 5 && !one_of("--tp 2|--ep 2|--ep 2 --dp 4", layouts[i].layout)) continue;
            if (!check_moe_layout(model, mdir, b2, b8, &layouts[i], co, !aux)) return;
        }
    }
}

static void check_lora_moe_layouts(const char *model, const moe_layout *layouts, size_t nl);

/* LoRA on the experts, the router and attention of Qwen3-MoE, the adapter
 * made by a few steps of training, under the expert folds against one
 * process. */
TEST(parallel_lora_moe_layouts) {
    static const moe_layout layouts[] = {
        {2, "--ep 2", false, 2},
        {2, "--tp 2 --sequence-parallel", false, 1},
        {2, "--ep 2 --tp 2 --etp 1 --sequence-parallel", false, 1},
        {4, "--ep 2 --etp 2 --tp 2 --sequence-parallel", false, 2},
        {4, "--ep 2 --pp 2", false, 2},
    };
    check_lora_moe_layouts("tiny-qwen3-moe", layouts, sizeof layouts / sizeof layouts[0]);
}

/* The same on Qwen2-MoE: LoRA on its shared expert too, and on the shared
 * expert's gate, replicated over tp (A and B gradients summed over it). */
TEST(parallel_lora_qwen2_moe_layouts) {
    static const moe_layout layouts[] = {
        {2, "--tp 2 --sequence-parallel", false, 1},
        {2, "--ep 2 --tp 2 --etp 1 --sequence-parallel", false, 1},
        {4, "--ep 2 --etp 2 --tp 2 --sequence-parallel", false, 2},
    };
    check_lora_moe_layouts("tiny-qwen2-moe", layouts, sizeof layouts / sizeof layouts[0]);
}

static void check_lora_moe_layouts(const char *model, const moe_layout *layouts, size_t nl) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char b2[1024], b8[1024], mdir[1024], adir[1024], *log = NULL, lay[1600];
    if (!make_batches(model, b2, b8)) return;
    snprintf(mdir, sizeof mdir, "%s/models/%s", loom_test_fixtures_of(model), model);
    snprintf(adir, sizeof adir, "%s/moe-lora", loom_test_tmpdir());
    /* the adapter: 3 steps of training through the library */
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    loom_model *m = NULL;
    loom_safetensors *st = NULL;
    int32_t ids[48], tgt[48];
    /* the router too (its A and B replicated, their gradients summed over
     * tp like its own) */
    loom_lora_config c = {.r = 4, .lora_alpha = 8, .target_modules = "all-linear,gate", .seed = 3};
    loom_optimizer_config oc = {.lr = 2e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8};
    loom_batch bt = {.rows = 2, .seq_len = 24, .input_ids = ids, .targets = tgt};
    bool ok = !loom_st_open_file(ctx, b2, &st) && !st_get(ctx, st, "input_ids", LOOM_I32, ids, 48) &&
              !st_get(ctx, st, "targets", LOOM_I32, tgt, 48) &&
              !loom_model_create(ctx, mdir, NULL, &m) && !loom_model_add_adapter(m, "a", &c) &&
              !loom_model_set_optimizer(m, &oc);
    for (int s = 0; ok && s < 3; s++) {
        loom_fb_result fr;
        loom_step_result sr;
        ok = !loom_model_forward_backward(m, &bt, 1, &fr) &&
             !loom_model_clip_grad_and_step(m, 1.0, 1, &sr);
    }
    ok = ok && !loom_model_save_adapter(m, "a", adir, LOOM_F32);
    if (!ok) loom_test_fail(__FILE__, __LINE__, "making the adapter: %s", loom_last_error(ctx));
    loom_model_free(m);
    loom_st_close(st);
    loom_ctx_free(ctx);
    if (!ok) return;
    for (size_t i = 0; i < nl; i++) {
        const char *one = path_in_tmp("one-lora-moe.safetensors");
        snprintf(lay, sizeof lay, "--adapter %s --weight-decay 0.01 --num-micro-batches %d", adir,
                 layouts[i].ref_micro);
        int rc = golden(0, mdir, b2, one, lay, &log);
        CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
        free(log);
        if (rc) return;
        snprintf(lay, sizeof lay, "--adapter %s --weight-decay 0.01 %s", adir, layouts[i].layout);
        check_layout(model, b2, one, layouts[i].np, lay, false, true);
    }
}

/* The interleaved pipeline against one process: every accepted number of
 * micro-batches from pp to 4 pp for pp 2, 3, 4 and vpp 2, 3 (a model of
 * pp*vpp layers, tied embeddings, random weights and tokens), and uneven
 * counts with Megatron's micro-batch groups: loss, log-probs, entropy,
 * logits and every gradient within 1e-5, the weights after the 5 AdamW
 * steps within 1e-4 (L2) and their losses within 1e-5. */
static void check_same_run(const char *label, const char *out, const char *one) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_safetensors *got = NULL, *ref = NULL;
    if (loom_st_open_file(ctx, out, &got) || loom_st_open_file(ctx, one, &ref)) {
        loom_test_fail(__FILE__, __LINE__, "%s: %s", label, loom_last_error(ctx));
        goto done;
    }
    const char *wn = "";
    int n = 0;
    double e = 0;
    const char *fwd[] = {"loss", "token_logprobs", "entropy", "logits"};
    for (int i = 0; i < 4; i++) e = fmax(e, compare(ctx, got, ref, fwd[i], true, false, &wn, &n));
    CHECK_MSG(e <= 1e-5 && n == 4, "%s: %s differs from one process by %.3g", label, wn, e);
    n = 0;
    e = compare(ctx, got, ref, "grad.", false, false, &wn, &n);
    CHECK_MSG(e <= 1e-5 && n > 8, "%s: %s differs from one process by %.3g (%d compared)", label,
              wn, e, n);
    n = 0;
    e = compare(ctx, got, ref, "final.", false, true, &wn, &n);
    CHECK_MSG(e <= 1e-4 && n > 8, "%s: %s differs from one process by %.3g (L2)", label, wn, e);
    n = 0;
    e = compare(ctx, got, ref, "adamw_losses", true, false, &wn, &n);
    CHECK_MSG(e <= 1e-5 && n == 1, "%s: the step losses differ from one process by %.3g", label, e);
done:
    loom_st_close(got);
    loom_st_close(ref);
    loom_ctx_free(ctx);
}

TEST(parallel_interleaved_pipeline_every_micro_batch_count) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    setenv("LOOM_COMM_TIMEOUT", "60", 1); /* a hang fails in a minute, naming the rank */
    for (int pp = 2; pp <= 4; pp++)
        for (int vpp = 2; vpp <= 3; vpp++) {
            char mdir[1100], over[64], stem[64], batch[1100], *log = NULL;
            snprintf(mdir, sizeof mdir, "%s/pp%d-vpp%d-model", loom_test_tmpdir(), pp, vpp);
            snprintf(over, sizeof over, "{\"num_hidden_layers\": %d}", pp * vpp);
            int rc = loom_test_run(&log, (const char *const[]){loom_test_bin(), "init", "--out",
                                                               mdir, "--config-override", over,
                                                               "--seed", "7", "--log-level",
                                                               "warn", NULL});
            CHECK_MSG(rc == 0, "init: %s", log ? log : "");
            free(log);
            if (rc) continue;
            /* 12 pp rows split into pp, 2pp, 3pp and 4pp micro-batches */
            snprintf(stem, sizeof stem, "pp%d-vpp%d-batch", pp, vpp);
            snprintf(batch, sizeof batch, "%s/%s.safetensors", loom_test_tmpdir(), stem);
            if (!write_random_batch(loom_test_tmpdir(), stem, 12 * pp, 8, 1000u + (unsigned)pp))
                continue;
            const char *one = path_in_tmp("vpp-one.safetensors");
            rc = golden(0, mdir, batch, one, "", &log);
            CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
            free(log);
            if (rc) continue;
            for (int k = 1; k <= 4; k++) {
                char lay[160], label[200];
                snprintf(lay, sizeof lay, "--pp %d --vpp %d --num-micro-batches %d", pp, vpp, k * pp);
                snprintf(label, sizeof label, "pp=%d vpp=%d %d micro-batches", pp, vpp, k * pp);
                const char *out = path_in_tmp("vpp.safetensors");
                rc = golden(pp, mdir, batch, out, lay, &log);
                CHECK_MSG(rc == 0, "%s: exit %d\n%s", label, rc, log ? log : "");
                free(log);
                if (!rc) check_same_run(label, out, one);
            }
            /* uneven: Megatron's groups (last group whole or >= pp) */
            static const int uneven[][3] = {{2, 3, 5}, {2, 4, 6}, {3, 4, 7}, {4, 6, 10}};
            for (size_t u = 0; u < sizeof uneven / sizeof uneven[0]; u++) {
                if (uneven[u][0] != pp || (12 * pp) % uneven[u][2]) continue;
                char lay[200], label[240];
                snprintf(lay, sizeof lay,
                         "--pp %d --vpp %d --num-micro-batches %d "
                         "--microbatch-group-size-per-virtual-pipeline-stage %d",
                         pp, vpp, uneven[u][2], uneven[u][1]);
                snprintf(label, sizeof label, "pp=%d vpp=%d %d micro-batches in groups of %d", pp,
                         vpp, uneven[u][2], uneven[u][1]);
                const char *out = path_in_tmp("vpp.safetensors");
                rc = golden(pp, mdir, batch, out, lay, &log);
                CHECK_MSG(rc == 0, "%s: exit %d\n%s", label, rc, log ? log : "");
                free(log);
                if (!rc) check_same_run(label, out, one);
            }
        }
}

/* LoRA (the PEFT fixture's adapter) under the interleaved pipeline with 4
 * and 8 micro-batches, and 6 in groups of 3 (tiny-qwen3: 4 layers, pp 2 x
 * vpp 2): adapter gradients equal the one-process run and the 5 AdamW steps
 * give PEFT's weights and losses. Untied embeddings with 8 micro-batches. */
TEST(parallel_interleaved_pipeline_lora_and_untied) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char mdir[1024], batch[1024], extra[1200], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s", path_in_tmp("lora-batch8.safetensors"));
    snprintf(extra, sizeof extra, "--adapter %s/models/tiny-qwen3-lora --weight-decay 0.01",
             loom_test_fixtures());
    {
        char b2[1024], b8[1024];
        if (!make_batches("tiny-qwen3-lora", b2, b8)) return;
        snprintf(batch, sizeof batch, "%s", b8);
    }
    const char *one = path_in_tmp("one-lora8.safetensors");
    int rc = golden(0, mdir, batch, one, extra, &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return;
    static const char *layouts[] = {
        "--pp 2 --vpp 2 --num-micro-batches 4", "--pp 2 --vpp 2 --num-micro-batches 8",
        "--pp 2 --vpp 2 --num-micro-batches 8 --microbatch-group-size-per-virtual-pipeline-stage 3"};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        char lay[1400];
        snprintf(lay, sizeof lay, "%s %s", extra, layouts[i]);
        check_layout_fx("tiny-qwen3", "tiny-qwen3-lora", batch, one, 2, lay, true, true);
    }
    char b2[1024], b8[1024];
    if (!make_batches("tiny-qwen3-untied", b2, b8)) return;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3-untied", loom_test_fixtures());
    const char *one_u = path_in_tmp("one-untied8.safetensors");
    rc = golden(0, mdir, b8, one_u, "", &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return;
    check_layout("tiny-qwen3-untied", b8, one_u, 2, "--pp 2 --vpp 2 --num-micro-batches 8", true,
                 true);
}

/* Context parallel on packed documents (the fixture's three documents in
 * one row): the log-probs of each document are its own, and loss and
 * gradients equal the one-process run. */
TEST(parallel_cp2_packed_documents) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    char fix[1024], mdir[1024], *log = NULL;
    snprintf(fix, sizeof fix, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, fix, &st));
    int32_t ids[28], pos[28], cu[4], tgt[28];
    float want[28];
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(st, "packed.input_ids"), LOOM_I32, ids, 28));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(st, "packed.position_ids"), LOOM_I32, pos, 28));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(st, "packed.cu_seqlens"), LOOM_I32, cu, 4));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(st, "packed.token_logprobs"), LOOM_F32, want, 28));
    loom_st_close(st);
    for (int d = 0; d < 3; d++)
        for (int t = cu[d]; t < cu[d + 1]; t++) tgt[t] = t + 1 < cu[d + 1] ? ids[t + 1] : -100;
    loom_st_writer *w;
    int64_t sh[2] = {1, 28}, shc[1] = {4};
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, loom_test_tmpdir(), "packed", 0, NULL, &w));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "input_ids", LOOM_I64, 2, sh));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "targets", LOOM_I64, 2, sh));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "position_ids", LOOM_I64, 2, sh));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "cu_seqlens", LOOM_I32, 1, shc));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "input_ids", LOOM_I32, ids));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "targets", LOOM_I32, tgt));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "position_ids", LOOM_I32, pos));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "cu_seqlens", LOOM_I32, cu));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    const char *batch = path_in_tmp("packed.safetensors"), *one = path_in_tmp("one.safetensors");
    REQUIRE(golden(0, mdir, batch, one, "", &log) == 0);
    free(log);
    check_layout("tiny-qwen3", batch, one, 2, "--cp 2", false, true);
    check_layout("tiny-qwen3", batch, one, 4, "--cp 2 --tp 2 --sequence-parallel", false, true);
    /* and the log-probs are the fixture's per-document ones */
    loom_safetensors *got;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, path_in_tmp("layout.safetensors"), &got));
    float tlp[28];
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(got, "token_logprobs"), LOOM_F32, tlp, 28));
    for (int t = 0; t < 28; t++) CHECK_NEAR(tlp[t], want[t], 1e-4 * fabs(want[t]) + 1e-6);
    loom_st_close(got);
    loom_ctx_free(ctx);
}

/* A mesh that does not fit fails before computing, naming the numbers. */
TEST(parallel_bad_mesh_fails_before_compute) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char mdir[1024], fix[1024], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(fix, sizeof fix, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    const char *out = path_in_tmp("bad.safetensors");
    static const struct {
        int np;
        const char *layout, *want;
    } cases[] = {
        {2, "--tp 4", "world size 2 is not divisible by tp*cp*pp = 4"},
        {4, "--tp 4", "num_key_value_heads"},
        {2, "--pp 2 --vpp 3", "cannot be split into pp=2 x vpp=3"},
        {2, "--cp 2 --num-micro-batches 3", "rows"},
        {2, "--pp 2 --vpp 2 --num-micro-batches 1", "needs at least 2 micro-batches"},
        {2, "--pp 2 --vpp 2 --num-micro-batches 3 --dp 1", "leave a last group of 1, fewer than pp=2"},
        {2, "--pp 2 --vpp 2 --num-micro-batches 2 --microbatch-group-size-per-virtual-pipeline-stage 3",
         "needs at least 3 micro-batches"},
        {2, "--pp 2 --microbatch-group-size-per-virtual-pipeline-stage 2",
         "needs the interleaved pipeline"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = golden(cases[i].np, mdir, fix, out, cases[i].layout, &log);
        CHECK_MSG(rc != 0 && rc < 128, "%s: exit %d", cases[i].layout, rc);
        CHECK_CONTAINS(log, cases[i].want);
        CHECK_MSG(access(out, F_OK) != 0, "%s: wrote an output", cases[i].layout);
        free(log);
    }
}

/* LoRA (the PEFT fixture's adapter on tiny-qwen3) under TP2, TP2 + SP, PP2,
 * DP2 and TP2 x PP2 x DP2: adapter gradients equal the one-process run, and
 * the 5 AdamW steps on the adapter give PEFT's losses. */
TEST(parallel_lora_layouts) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char mdir[1024], batch[1024], extra[1200], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen3-lora.safetensors", loom_test_fixtures());
    snprintf(extra, sizeof extra, "--adapter %s/models/tiny-qwen3-lora --weight-decay 0.01",
             loom_test_fixtures());
    const char *one = path_in_tmp("one-lora.safetensors");
    int rc = golden(0, mdir, batch, one, extra, &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return;
    static const struct {
        int np;
        const char *layout;
    } layouts[] = {{2, "--tp 2"}, {2, "--tp 2 --sequence-parallel"}, {2, "--pp 2"},
                   {2, "--dp 2"}, {8, "--tp 2 --pp 2 --dp 2"}};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        char lay[1400];
        snprintf(lay, sizeof lay, "%s %s", extra, layouts[i].layout);
        check_layout_fx("tiny-qwen3", "tiny-qwen3-lora", batch, one, layouts[i].np, lay, true,
                        true);
    }
}

/* A copy of the fixture's LoRA adapter with dropout 0.2, in adir. */
static bool make_dropout_adapter(char *adir, size_t cap) {
    char src[1100], dst[1100];
    snprintf(adir, cap, "%s/dropout-adapter", loom_test_tmpdir());
    mkdir(adir, 0755);
    snprintf(src, sizeof src, "%s/models/tiny-qwen3-lora/adapter_model.safetensors",
             loom_test_fixtures());
    snprintf(dst, sizeof dst, "%s/adapter_model.safetensors", adir);
    FILE *a = fopen(src, "rb"), *b = fopen(dst, "wb");
    if (!a || !b) {
        if (a) fclose(a);
        if (b) fclose(b);
        return false;
    }
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, a)) > 0) fwrite(buf, 1, n, b);
    fclose(a);
    fclose(b);
    snprintf(dst, sizeof dst, "%s/adapter_config.json", adir);
    b = fopen(dst, "w");
    if (!b) return false;
    fputs("{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"lora_dropout\": 0.2, "
          "\"target_modules\": \"all-linear\"}",
          b);
    fclose(b);
    return true;
}

/* LoRA dropout draws its mask from each element's place in the global
 * batch and the full input, so every layout drops the same elements: the
 * loss and gradients still equal the one-process run. */
TEST(parallel_lora_dropout_layouts) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char mdir[1024], batch[1024], adir[1024], extra[1200], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen3-lora.safetensors", loom_test_fixtures());
    REQUIRE(make_dropout_adapter(adir, sizeof adir));
    snprintf(extra, sizeof extra, "--adapter %s --weight-decay 0.01", adir);
    const char *one = path_in_tmp("one-dropout.safetensors");
    int rc = golden(0, mdir, batch, one, extra, &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return;
    static const char *layouts[] = {"--tp 2", "--tp 2 --sequence-parallel", "--dp 2", "--pp 2",
                                    "--cp 2"};
    for (size_t i = 0; i < sizeof layouts / sizeof layouts[0]; i++) {
        char lay[1400];
        snprintf(lay, sizeof lay, "%s %s", extra, layouts[i]);
        check_layout_fx("tiny-qwen3", "tiny-qwen3-lora", batch, one, 2, lay, false, true);
    }
}

/* The whole of a file, or NULL. */
static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *len = (size_t)n;
    return p;
}

/* Activation recomputation runs the same ops on the same inputs again, so
 * `--recompute mlp` and `--recompute full` give the golden file of the run
 * without it bit for bit (loss, log-probs, every gradient, the weights after
 * the steps): on one process, with LoRA dropout (the masks drawn again), and
 * under tensor, sequence, context, (interleaved) pipeline and expert
 * parallelism (full recomputation reuses the kept routing). */
TEST(parallel_recompute_same_results) {
    char mdir[1024], full_batch[1024], lora_batch[1024], adir[1024], lora[1200];
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(full_batch, sizeof full_batch, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    snprintf(lora_batch, sizeof lora_batch, "%s/golden/tiny-qwen3-lora.safetensors",
             loom_test_fixtures());
    REQUIRE(make_dropout_adapter(adir, sizeof adir));
    snprintf(lora, sizeof lora, "--adapter %s", adir);
    const bool mpi = loom_test_have_mpirun();
    if (mpi) loom_test_mpi_env();
    char moe[3][1024], moe_batch[3][1024]; /* [1] tiny-qwen3-moe, [2] tiny-qwen2-moe */
    for (int k = 1; k < 3; k++) {
        const char *name = k == 1 ? "tiny-qwen3-moe" : "tiny-qwen2-moe";
        snprintf(moe[k], sizeof moe[k], "%s/models/%s", loom_test_fixtures_of(name), name);
        snprintf(moe_batch[k], sizeof moe_batch[k], "%s/golden/%s.safetensors",
                 loom_test_fixtures_of(name), name);
    }
    static const struct {
        int np;
        bool lora;
        int moe;
        const char *layout;
    } cases[] = {
        {0, false, false, ""},
        {0, true, false, ""},
        {8, false, false, "--tp 2 --pp 2 --dp 2"},
        {8, true, false, "--tp 2 --cp 2 --pp 2 --sequence-parallel"},
        {2, false, false, "--pp 2 --vpp 2 --num-micro-batches 2"},
        {0, false, 1, "--config-override {\"router_aux_loss_coef\":0.5}"},
        {4, false, 1, "--tp 2 --pp 2 --sequence-parallel"},
        {2, false, 1, "--ep 2"},
        {0, false, 2, "--config-override {\"router_aux_loss_coef\":0.5}"},
        {4, false, 2, "--ep 2 --etp 2 --tp 2 --sequence-parallel"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (cases[i].np && !mpi) continue; /* parallel_layouts_* report the skip */
        char *ref = NULL;
        size_t nref = 0;
        for (int r = 0; r < 3; r++) {
            static const char *mode[3] = {"none", "mlp", "full"};
            char lay[1600], *log = NULL;
            snprintf(lay, sizeof lay, "%s %s --recompute %s", cases[i].lora ? lora : "",
                     cases[i].layout, mode[r]);
            const char *out = path_in_tmp(r ? "recompute.safetensors" : "recompute-ref.safetensors");
            const int k = cases[i].moe;
            int rc = golden(cases[i].np, k ? moe[k] : mdir,
                            k ? moe_batch[k] : cases[i].lora ? lora_batch : full_batch, out, lay,
                            &log);
            CHECK_MSG(rc == 0, "%s: exit %d\n%s", lay, rc, log ? log : "");
            free(log);
            if (rc) break;
            size_t n = 0;
            char *got = slurp(out, &n);
            CHECK_MSG(got != NULL, "%s: no output", lay);
            if (!r) {
                ref = got, nref = n;
            } else {
                CHECK_MSG(got && ref && n == nref && !memcmp(got, ref, n),
                          "%s: the golden file differs from --recompute none's", lay);
                free(got);
            }
        }
        free(ref);
    }
}

/* --comm-timeout: a negative value is refused before anything is loaded;
 * the flag is printed with its source; without it LOOM_COMM_TIMEOUT (when
 * exported) sets the limit, and a bad one is refused naming it. */
TEST(parallel_comm_timeout_option) {
    char mdir[1024], fix[1024], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(fix, sizeof fix, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    const char *out = path_in_tmp("timeout.safetensors");
    const char *base[] = {loom_test_bin(), "golden", "--device", "cpu", "--model", mdir,
                          "--batch", fix, "--out", out};
    const char *argv[16];
    size_t n = 0;
    for (; n < sizeof base / sizeof base[0]; n++) argv[n] = base[n];
    argv[n] = "--comm-timeout";
    argv[n + 1] = "-5";
    argv[n + 2] = NULL;
    int rc = loom_test_run(&log, argv);
    CHECK_MSG(rc != 0 && rc < 128, "exit %d", rc);
    CHECK_CONTAINS(log, "--comm-timeout -5: give a number of seconds >= 0");
    free(log);
    argv[n + 1] = "45";
    rc = loom_test_run(&log, argv);
    CHECK_MSG(rc == 0, "exit %d\n%s", rc, log ? log : "");
    CHECK_CONTAINS(log, "comm_timeout       45");
    free(log);
    const char *keep = getenv("LOOM_COMM_TIMEOUT");
    char saved[64];
    snprintf(saved, sizeof saved, "%s", keep ? keep : "");
    setenv("LOOM_COMM_TIMEOUT", "soon", 1);
    argv[n] = NULL;
    rc = loom_test_run(&log, argv);
    CHECK_MSG(rc != 0 && rc < 128, "exit %d", rc);
    CHECK_CONTAINS(log, "LOOM_COMM_TIMEOUT='soon' is not a number of seconds");
    free(log);
    if (keep) setenv("LOOM_COMM_TIMEOUT", saved, 1);
    else unsetenv("LOOM_COMM_TIMEOUT");
}

/* A rank that never reaches a collective: the others give up after
 * --comm-timeout, each naming itself, the operation and the missing rank,
 * and the whole job ends (not after the stalled rank's 60 s). */
TEST(parallel_timeout_names_the_missing_rank) {
    if (!loom_test_have_mpirun()) SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char mdir[1024], fix[1024], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(fix, sizeof fix, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    setenv("LOOM_TEST_STALL", "1:60", 1); /* world rank 1 sleeps before its first collective */
    const double t0 = loom_now_s();
    int rc = golden(3, mdir, fix, path_in_tmp("stall.safetensors"), "--comm-timeout 2", &log);
    const double took = loom_now_s() - t0;
    unsetenv("LOOM_TEST_STALL");
    CHECK_MSG(rc != 0, "exit 0");
    CHECK_MSG(took < 40, "the job took %.0f s: the stalled rank was waited for", took);
    CHECK_CONTAINS(log, "error on rank 0: MPI_Iallgather on group 'world' (rank 0 of 3) timed out "
                        "after 2 s waiting for rank 1 of the group (world rank 1), which did not "
                        "answer");
    free(log);
}

/* CPU ranks without MPI: `loom golden` started 4 times with torchrun's
 * variables runs on Gloo and matches the one-process run (tp2 x pp2, and
 * dp2 x cp2 with sequence parallelism). */
TEST(parallel_layouts_gloo) {
#ifndef LOOM_HAVE_GLOO
    SKIP("loom was built without Gloo (apt-get install libgloo-dev)");
#endif
    setenv("LOOM_COMM_TIMEOUT", "120", 1);
    char mdir[1024], batch[1024], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    const char *one = path_in_tmp("one-gloo.safetensors");
    int rc = golden(0, mdir, batch, one, "", &log);
    CHECK_MSG(rc == 0, "one process: %s", log ? log : "");
    free(log);
    if (rc) return;
    ranks_by_gloo = true;
    check_layout_fx("tiny-qwen3", "tiny-qwen3", batch, one, 4, "--tp 2 --pp 2", true, true);
    check_layout_fx("tiny-qwen3", "tiny-qwen3", batch, one, 4, "--dp 2 --tp 2 --sequence-parallel",
                    true, true);
    ranks_by_gloo = false;
}

/* A rank that stalls, or dies, under Gloo: the others fail naming it (its
 * thread says it is not waiting; a dead one's connections are closed) and
 * end, without waiting for it. */
TEST(parallel_gloo_missing_rank) {
#ifndef LOOM_HAVE_GLOO
    SKIP("loom was built without Gloo (apt-get install libgloo-dev)");
#endif
    char mdir[1024], fix[1024], *log = NULL;
    snprintf(mdir, sizeof mdir, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(fix, sizeof fix, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    const char *argv[] = {loom_test_bin(), "golden", "--device", "cpu", "--model", mdir,
                          "--batch", fix, "--out", path_in_tmp("stall.safetensors"),
                          "--comm-timeout", "2", NULL};
    setenv("LOOM_TEST_STALL", "1:60", 1); /* world rank 1 sleeps before its first collective */
    double t0 = loom_now_s();
    int rc = run_ranks(3, &log, argv, 3.0, -1, 0, NULL);
    double took = loom_now_s() - t0;
    CHECK_MSG(rc != 0, "exit 0");
    CHECK_MSG(took < 40, "the job took %.0f s: the stalled rank was waited for", took);
    CHECK_CONTAINS(log, "error on rank 0: Gloo allgather on group 'world' (rank 0 of 3) timed out "
                        "after 2 s waiting for rank 1 of the group (world rank 1), which is not "
                        "waiting on this group");
    free(log);
    /* killed while the others wait for it: they fail at once, naming it */
    argv[11] = "60";
    t0 = loom_now_s();
    int codes[3] = {0, 0, 0};
    rc = run_ranks(3, &log, argv, 10.0, 1, 3.0, codes);
    took = loom_now_s() - t0;
    unsetenv("LOOM_TEST_STALL");
    CHECK_MSG(rc != 0, "exit 0");
    CHECK_MSG(took < 30, "the job took %.0f s with --comm-timeout 60", took);
    CHECK_CONTAINS(log, "error on rank 0: Gloo allgather on group 'world' (rank 0 of 3) failed");
    CHECK_CONTAINS(log, "rank 1 of the group (world rank 1), which is gone");
    CHECK_CONTAINS(log, "error on rank 2:");
    /* the survivors end with loom's error, not a signal (a write to the dead
     * rank's socket raised SIGPIPE before the Gloo world ignored it) */
    CHECK_MSG(codes[0] == 1 && codes[2] == 1, "exit codes: rank 0 %d, rank 2 %d (1 expected)",
              codes[0], codes[2]);
    free(log);
}
