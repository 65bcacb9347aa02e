/* Checkpoint directories (src/io/ckpt_dir.h): commit, replace, prune and
 * find; a saver killed (SIGKILL) at every step of a commit or a prune
 * leaves the tracker absent or naming a complete checkpoint, and the next
 * begin clears what it left; a tracker naming a missing directory, a
 * damaged newest checkpoint (the previous good one named, not taken) and
 * bad roots are refused with clear messages. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../src/io/ckpt_dir.h"
#include "harness.h"

static const char *tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", loom_test_tmpdir(), name);
    return buf;
}

static void put(const char *dir, const char *name, const char *text) {
    char p[2048];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* The contents of dir/name ("" when absent), in buf. */
static const char *get(const char *dir, const char *name, char *buf, size_t cap) {
    char p[2048];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    buf[0] = 0;
    FILE *f = fopen(p, "r");
    if (f) {
        size_t n = fread(buf, 1, cap - 1, f);
        buf[n] = 0;
        fclose(f);
    }
    return buf;
}

/* Entries of root that are loom temporaries. */
static int temporaries(const char *root) {
    int n = 0;
    DIR *d = opendir(root);
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (strstr(de->d_name, ".loom-tmp-") || strstr(de->d_name, ".loom-old-")) n++;
    if (d) closedir(d);
    return n;
}

/* The complete iterations of root as "100 200" ("" when none). */
static const char *iters_of(loom_ctx *ctx, const char *root, char *buf, size_t cap) {
    int64_t *it = NULL;
    size_t n = 0;
    buf[0] = 0;
    if (loom_ckpt_list(ctx, root, &it, &n)) return "(error)";
    for (size_t i = 0; i < n; i++)
        snprintf(buf + strlen(buf), cap - strlen(buf), "%s%lld", i ? " " : "", (long long)it[i]);
    free(it);
    return buf;
}

/* A checkpoint of `iteration` whose files say `tag` ("a" and "b"; "old"
 * too when `extra`). */
static loom_status save(loom_ctx *ctx, const char *root, int64_t iteration, const char *tag,
                        bool extra) {
    loom_ckpt_tx tx;
    loom_status st = loom_ckpt_begin(ctx, root, iteration, &tx);
    if (st) return st;
    put(tx.path, "a", tag);
    put(tx.path, "b", tag);
    if (extra) put(tx.path, "old", tag);
    return loom_ckpt_commit(ctx, &tx);
}

TEST(ckpt_commit_replace_find) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char root[1024], dir[1100], buf[256], found[2048];
    char name[32];
    loom_ckpt_iter_name(100, name);
    CHECK_STR(name, "iter_0000100");
    loom_ckpt_iter_name(12345678, name);
    CHECK_STR(name, "iter_12345678");
    tmp_path(root, sizeof root, "ck1/runs/a"); /* missing parents are made */
    REQUIRE_OK(ctx, save(ctx, root, 100, "v100", true));
    snprintf(dir, sizeof dir, "%s/iter_0000100", root);
    CHECK_STR(get(dir, "a", buf, sizeof buf), "v100");
    CHECK_STR(get(dir, "old", buf, sizeof buf), "v100");
    CHECK_STR(get(root, LOOM_CKPT_TRACKER, buf, sizeof buf), "100"); /* as Megatron writes it */
    CHECK_EQ_INT(temporaries(root), 0);
    int64_t it = -5;
    CHECK_OK(ctx, loom_ckpt_tracker(ctx, root, &it));
    CHECK_EQ_INT(it, 100);
    REQUIRE_OK(ctx, save(ctx, root, 200, "v200", false));
    CHECK_STR(get(root, LOOM_CKPT_TRACKER, buf, sizeof buf), "200");
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100 200");
    /* find: the tracker's, from the root (a trailing slash is fine) */
    char slash[1100];
    snprintf(slash, sizeof slash, "%s/", root);
    CHECK_OK(ctx, loom_ckpt_find(ctx, slash, NULL, NULL, found, sizeof found, &it));
    CHECK_EQ_INT(it, 200);
    snprintf(dir, sizeof dir, "%s/iter_0000200", root);
    CHECK_STR(found, dir);
    /* find: an iter_ directory, that one */
    snprintf(dir, sizeof dir, "%s/iter_0000100", root);
    CHECK_OK(ctx, loom_ckpt_find(ctx, dir, NULL, NULL, found, sizeof found, &it));
    CHECK_EQ_INT(it, 100);
    CHECK_STR(found, dir);
    /* a re-save of 100 replaces it whole (no stale file) and moves the tracker */
    REQUIRE_OK(ctx, save(ctx, root, 100, "w100", false));
    CHECK_STR(get(dir, "a", buf, sizeof buf), "w100");
    CHECK(!loom_file_exists(strcat(strcpy(found, dir), "/old")));
    CHECK_STR(get(root, LOOM_CKPT_TRACKER, buf, sizeof buf), "100");
    CHECK_EQ_INT(temporaries(root), 0);
    /* abort leaves nothing; commit after it is refused */
    loom_ckpt_tx tx;
    REQUIRE_OK(ctx, loom_ckpt_begin(ctx, root, 300, &tx));
    CHECK(strstr(tx.path, "/.iter_0000300.loom-tmp-") != NULL);
    put(tx.path, "a", "x");
    loom_ckpt_abort(&tx);
    CHECK_EQ_INT(temporaries(root), 0);
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100 200");
    CHECK(loom_ckpt_commit(ctx, &tx) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "no checkpoint is being written");
    loom_ckpt_abort(&tx); /* twice is fine */
    /* names that are not loom's complete checkpoints are not listed */
    snprintf(dir, sizeof dir, "%s/iter_00000300", root); /* not canonical */
    mkdir(dir, 0755);
    snprintf(dir, sizeof dir, "%s/iter_12x4567", root);
    mkdir(dir, 0755);
    put(root, "iter_0000400", "a file");
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100 200");
    CHECK(loom_ckpt_begin(ctx, root, -1, &tx) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "out of range");
    /* a directory where the tracker goes: refused before anything is written */
    snprintf(dir, sizeof dir, "%s/x/%s", root, LOOM_CKPT_TRACKER);
    REQUIRE_OK(ctx, loom_mkdirs(ctx, dir));
    dir[strlen(dir) - strlen(LOOM_CKPT_TRACKER) - 1] = 0;
    CHECK(loom_ckpt_begin(ctx, dir, 1, &tx) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "checkpoint tracker");
    CHECK_CONTAINS(loom_last_error(ctx), "is a directory");
    CHECK_EQ_INT(temporaries(dir), 0);
    /* an iter_ file where the directory goes */
    CHECK(loom_ckpt_begin(ctx, root, 400, &tx) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "iter_0000400: is a file");
    loom_ctx_free(ctx);
}

TEST(ckpt_prune) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char root[1024], buf[256];
    tmp_path(root, sizeof root, "ck-prune");
    for (int i = 1; i <= 5; i++) REQUIRE_OK(ctx, save(ctx, root, 100 * i, "x", false));
    CHECK_OK(ctx, loom_ckpt_prune(ctx, root, 0)); /* keep all */
    CHECK_OK(ctx, loom_ckpt_prune(ctx, root, -3));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100 200 300 400 500");
    CHECK_OK(ctx, loom_ckpt_prune(ctx, root, 2));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "400 500");
    CHECK_EQ_INT(temporaries(root), 0);
    CHECK_OK(ctx, loom_ckpt_prune(ctx, root, 7));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "400 500");
    /* the tracker's iteration is kept even when older than the newest `keep` */
    REQUIRE_OK(ctx, save(ctx, root, 100, "again", false));
    CHECK_OK(ctx, loom_ckpt_prune(ctx, root, 1));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100 500");
    /* a damaged tracker: nothing is pruned */
    put(root, LOOM_CKPT_TRACKER, "garbage");
    CHECK(loom_ckpt_prune(ctx, root, 1) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "not pruning");
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100 500");
    loom_ctx_free(ctx);
}

TEST(ckpt_find_refusals) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char root[1024], p[1100], found[2048];
    int64_t it;
    tmp_path(root, sizeof root, "ck-find");
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), root);
    CHECK(loom_ckpt_find(ctx, "", NULL, NULL, found, sizeof found, &it) == LOOM_ERR_INVALID_ARG);
    mkdir(root, 0755);
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "holds no checkpoint");
    put(root, "notes", "x");
    snprintf(p, sizeof p, "%s/notes", root);
    CHECK(loom_ckpt_find(ctx, p, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "is a file");
    REQUIRE_OK(ctx, save(ctx, root, 100, "x", false));
    REQUIRE_OK(ctx, save(ctx, root, 200, "x", false));
    /* the tracker names a directory that is gone */
    snprintf(p, sizeof p, "%s/iter_0000200", root);
    char *aside;
    REQUIRE_OK(ctx, loom_out_move_aside(ctx, p, &aside));
    loom_out_rm_rf(aside);
    free(aside);
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "names iteration 200");
    CHECK_CONTAINS(loom_last_error(ctx), "iter_0000200 does not exist");
    snprintf(p, sizeof p, "the complete checkpoints there are: %s/iter_0000100", root);
    CHECK_CONTAINS(loom_last_error(ctx), p);
    CHECK_STR(found, "");
    CHECK_EQ_INT(it, -1);
    /* no tracker, complete checkpoints: named, none taken */
    snprintf(p, sizeof p, "%s/%s", root, LOOM_CKPT_TRACKER);
    unlink(p);
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "has no " LOOM_CKPT_TRACKER);
    CHECK_CONTAINS(loom_last_error(ctx), "iter_0000100");
    /* a damaged tracker, and Megatron's "release" */
    put(root, LOOM_CKPT_TRACKER, "12abc\n");
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "holds \"12abc\", not an iteration number");
    put(root, LOOM_CKPT_TRACKER, "release");
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) ==
          LOOM_ERR_UNSUPPORTED);
    /* Megatron's own tracker (a newline is fine too); too small a buffer */
    put(root, LOOM_CKPT_TRACKER, "100\n");
    CHECK_OK(ctx, loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it));
    CHECK_EQ_INT(it, 100);
    char small[8];
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, small, sizeof small, &it) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "longer than the 8 bytes");
    loom_ctx_free(ctx);
}

/* Fails for a checkpoint holding a file "bad"; counts its calls. */
static loom_status verify_no_bad(loom_ctx *ctx, const char *dir, void *u) {
    ++*(int *)u;
    char p[2048];
    snprintf(p, sizeof p, "%s/bad", dir);
    if (loom_file_exists(p))
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s/a: SHA-256 does not match meta.json", dir);
    return LOOM_OK;
}

TEST(ckpt_find_damaged_names_previous) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char root[1024], d[4][1100], found[2048], want[2400];
    int64_t it;
    int calls = 0;
    tmp_path(root, sizeof root, "ck-verify");
    for (int i = 1; i <= 3; i++) {
        REQUIRE_OK(ctx, save(ctx, root, 100 * i, "x", false));
        snprintf(d[i], sizeof d[i], "%s/iter_%07d", root, 100 * i);
    }
    CHECK_OK(ctx, loom_ckpt_find(ctx, root, verify_no_bad, &calls, found, sizeof found, &it));
    CHECK_EQ_INT(it, 300);
    CHECK_EQ_INT(calls, 1);
    /* the newest is damaged: refused, the problem and iter_0000200 named */
    put(d[3], "bad", "");
    CHECK(loom_ckpt_find(ctx, root, verify_no_bad, &calls, found, sizeof found, &it) ==
          LOOM_ERR_FORMAT);
    const char *e = loom_last_error(ctx);
    snprintf(want, sizeof want, "%s/a: SHA-256 does not match meta.json", d[3]);
    CHECK_CONTAINS(e, want);
    snprintf(want, sizeof want, "The previous complete checkpoint is %s", d[2]);
    CHECK_CONTAINS(e, want);
    snprintf(want, sizeof want, "--load %s", d[2]);
    CHECK_CONTAINS(e, want);
    CHECK_CONTAINS(e, "does not fall back on its own");
    CHECK_STR(found, ""); /* nothing taken */
    CHECK_EQ_INT(it, -1);
    /* two damaged: the newest older one that passes */
    put(d[2], "bad", "");
    CHECK(loom_ckpt_find(ctx, root, verify_no_bad, &calls, found, sizeof found, &it) != LOOM_OK);
    snprintf(want, sizeof want, "The previous complete checkpoint is %s", d[1]);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    /* all damaged */
    put(d[1], "bad", "");
    CHECK(loom_ckpt_find(ctx, root, verify_no_bad, &calls, found, sizeof found, &it) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "No older checkpoint there passes the check either");
    /* an explicit iter_ directory: checked too */
    CHECK(loom_ckpt_find(ctx, d[1], verify_no_bad, &calls, found, sizeof found, &it) != LOOM_OK);
    snprintf(want, sizeof want, "checkpoint %s is damaged", d[1]);
    CHECK_CONTAINS(loom_last_error(ctx), want);
    snprintf(want, sizeof want, "%s/bad", d[1]);
    unlink(want);
    CHECK_OK(ctx, loom_ckpt_find(ctx, d[1], verify_no_bad, &calls, found, sizeof found, &it));
    CHECK_EQ_INT(it, 100);
    CHECK_STR(found, d[1]);
    loom_ctx_free(ctx);
}

/* A child that saves iteration `iteration` (files a and b saying `tag`)
 * with LOOM_TEST_CKPT_KILL=step ("mid_write": it kills itself after the
 * first file; "prune": it prunes to 1 with prune_after_rename). True when
 * it died of SIGKILL. */
static bool killed_saver(const char *root, int64_t iteration, const char *tag, const char *step) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        loom_ctx *c;
        if (loom_ctx_create(&c)) _exit(2);
        loom_ctx_set_log_level(c, LOOM_LOG_ERROR);
        if (!strcmp(step, "prune")) {
            setenv(LOOM_CKPT_KILL_ENV, "prune_after_rename", 1);
            loom_ckpt_prune(c, root, 1);
            _exit(3);
        }
        setenv(LOOM_CKPT_KILL_ENV, step, 1);
        loom_ckpt_tx tx;
        if (loom_ckpt_begin(c, root, iteration, &tx)) _exit(4);
        put(tx.path, "a", tag);
        if (!strcmp(step, "mid_write")) raise(SIGKILL);
        put(tx.path, "b", tag);
        loom_ckpt_commit(c, &tx);
        _exit(5); /* the hook did not fire */
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
}

/* The invariant: the tracker names `want`, and that directory holds files
 * a and b of one save (equal, non-empty). */
static void check_intact(loom_ctx *ctx, const char *root, int64_t want, const char *what) {
    char found[2048], a[64], b[64];
    int64_t it;
    loom_status st = loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it);
    CHECK_MSG(st == LOOM_OK, "%s: %s", what, loom_last_error(ctx));
    if (st) return;
    CHECK_MSG(it == want, "%s: the tracker names %lld, not %lld", what, (long long)it,
              (long long)want);
    get(found, "a", a, sizeof a);
    get(found, "b", b, sizeof b);
    CHECK_MSG(*a && !strcmp(a, b), "%s: %s is half written (a=\"%s\" b=\"%s\")", what, found, a,
              b);
}

TEST(ckpt_killed_at_every_step) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_ctx_set_log_level(ctx, LOOM_LOG_WARN);
    static const struct {
        const char *step;
        int tracker_new; /* whether the tracker names the new save */
        int temps;       /* the temporaries the killed save leaves */
    } steps[] = {
        {"mid_write", 0, 1},         {"after_files", 0, 1}, {"after_rename", 0, 0},
        {"after_tracker_tmp", 0, 1}, {"after_tracker", 1, 0},
    };
    char root[1024], buf[256], what[128];
    for (int replace = 0; replace < 2; replace++)
        for (size_t k = 0; k < sizeof steps / sizeof steps[0]; k++) {
            snprintf(root, sizeof root, "%s/ck-kill-%d-%zu", loom_test_tmpdir(), replace, k);
            REQUIRE_OK(ctx, save(ctx, root, 100, "old", false));
            /* a new iteration, or a re-save of the tracker's own */
            int64_t iteration = replace ? 100 : 200;
            snprintf(what, sizeof what, "%s of %lld killed at %s", replace ? "re-save" : "save",
                     (long long)iteration, steps[k].step);
            CHECK_MSG(killed_saver(root, iteration, "new", steps[k].step), "%s: not killed",
                      what);
            check_intact(ctx, root, steps[k].tracker_new ? iteration : 100, what);
            CHECK_MSG(temporaries(root) == steps[k].temps, "%s: %d temporaries, not %d", what,
                      temporaries(root), steps[k].temps);
            if (!replace) {
                bool moved = k >= 2; /* after the rename: iter_0000200 complete */
                CHECK_STR(iters_of(ctx, root, buf, sizeof buf), moved ? "100 200" : "100");
            }
            /* the next save clears the dead one's leftovers, and completes */
            REQUIRE_OK(ctx, save(ctx, root, 300, "next", false));
            CHECK_MSG(temporaries(root) == 0, "%s: the next save left %d temporaries", what,
                      temporaries(root));
            check_intact(ctx, root, 300, what);
        }
    /* the first save ever, killed: no tracker, or one naming it whole */
    tmp_path(root, sizeof root, "ck-kill-first");
    CHECK(killed_saver(root, 100, "v", "after_files"));
    CHECK(!loom_file_exists(strcat(strcpy(buf, root), "/" LOOM_CKPT_TRACKER)));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "");
    CHECK(killed_saver(root, 100, "v", "after_rename"));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "100");
    char found[2048];
    int64_t it;
    CHECK(loom_ckpt_find(ctx, root, NULL, NULL, found, sizeof found, &it) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "iter_0000100");
    /* a prune killed between the rename and the delete */
    tmp_path(root, sizeof root, "ck-kill-prune");
    REQUIRE_OK(ctx, save(ctx, root, 100, "x", false));
    REQUIRE_OK(ctx, save(ctx, root, 200, "y", false));
    CHECK(killed_saver(root, 0, "", "prune"));
    CHECK_STR(iters_of(ctx, root, buf, sizeof buf), "200");
    CHECK_EQ_INT(temporaries(root), 1); /* .iter_0000100.loom-old-<pid>-<n> */
    check_intact(ctx, root, 200, "prune killed");
    loom_ckpt_tx tx;
    REQUIRE_OK(ctx, loom_ckpt_begin(ctx, root, 300, &tx));
    CHECK_EQ_INT(temporaries(root), 1); /* its own */
    loom_ckpt_abort(&tx);
    CHECK_EQ_INT(temporaries(root), 0);
    loom_ctx_free(ctx);
}

TEST(ckpt_bad_roots) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char file[1024], p[1100];
    loom_ckpt_tx tx;
    tmp_path(file, sizeof file, "ck-a-file");
    put(loom_test_tmpdir(), "ck-a-file", "x");
    CHECK(loom_ckpt_begin(ctx, file, 1, &tx) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), file);
    CHECK_CONTAINS(loom_last_error(ctx), "is a file, not a directory");
    snprintf(p, sizeof p, "%s/sub/ck", file);
    CHECK(loom_ckpt_begin(ctx, p, 1, &tx) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "is a file, not a directory");
    CHECK(loom_ckpt_begin(ctx, "", 1, &tx) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "no path given");
    CHECK(loom_ckpt_begin(ctx, NULL, 1, &tx) == LOOM_ERR_INVALID_ARG);
    /* a place no one can create in, root included */
    CHECK(loom_ckpt_begin(ctx, "/proc/loom-ckpt-test", 1, &tx) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "/proc/loom-ckpt-test");
    CHECK_CONTAINS(loom_last_error(ctx), "cannot");
    CHECK(tx.path == NULL);
    /* no permission: a user who cannot write in / (root drops to nobody) */
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(2);
        loom_ctx *c;
        if (loom_ctx_create(&c)) _exit(2);
        loom_status st = loom_ckpt_begin(c, "/loom-ckpt-test-noperm/run", 1, &tx);
        bool ok = st == LOOM_ERR_IO && strstr(loom_last_error(c), "cannot write in /") &&
                  strstr(loom_last_error(c), "Permission denied");
        if (!ok) fprintf(stderr, "    no-permission case said: %s\n", loom_last_error(c));
        _exit(ok ? 0 : 1);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "a root without write permission was not refused clearly (status %d)", status);
    loom_ctx_free(ctx);
}
