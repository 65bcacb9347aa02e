/* Outputs checked before any work and written whole (src/io/outdir.h):
 * bad destinations refused with the flag, the path and what to do; a
 * re-save replaces the directory (no stale shards); a save killed by
 * SIGTERM, SIGINT or SIGKILL, or out of disk, leaves the destination absent
 * or the complete old version, and the next save leaves no temporaries. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../src/core/json.h"
#include "../src/io/outdir.h"
#include "harness.h"

#define RUN(out, ...) loom_test_run(out, (const char *const[]){loom_test_bin(), __VA_ARGS__, NULL})

static const char *tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", loom_test_tmpdir(), name);
    return buf;
}

static void put_file(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
}

/* Entries of dir, sorted, joined by ' ' ("" when absent or empty); hidden
 * names are listed too. */
static void listing(const char *dir, char *buf, size_t cap) {
    char *names[256];
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)) && n < 256)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) names[n++] = strdup(de->d_name);
    if (d) closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char *t = names[j];
            names[j] = names[j - 1];
            names[j - 1] = t;
        }
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", i ? " " : "", names[i]);
        free(names[i]);
    }
}

/* Entries of dir that are loom temporaries (".*.loom-tmp-*", ".*.loom-old-*"). */
static int temporaries(const char *dir) {
    int n = 0;
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (strstr(de->d_name, ".loom-tmp-") || strstr(de->d_name, ".loom-old-")) n++;
    if (d) closedir(d);
    return n;
}

/* Every file of dir, name and bytes, concatenated (a fingerprint of the
 * whole); *len its length. */
static char *snapshot(const char *dir, size_t *len) {
    char names[8192];
    listing(dir, names, sizeof names);
    size_t cap = 1 << 16;
    char *all = malloc(cap);
    *len = 0;
    for (char *save = NULL, *n = strtok_r(names, " ", &save); n; n = strtok_r(NULL, " ", &save)) {
        char p[2048], *data = NULL;
        size_t dl = 0;
        snprintf(p, sizeof p, "%s/%s", dir, n);
        if (loom_read_file(NULL, p, 0, &data, &dl) != LOOM_OK) dl = 0;
        while (*len + strlen(n) + dl + 2 > cap) all = realloc(all, cap *= 2);
        memcpy(all + *len, n, strlen(n) + 1);
        *len += strlen(n) + 1;
        if (dl) memcpy(all + *len, data, dl);
        *len += dl;
        free(data);
    }
    return all;
}

static bool same_dir(const char *dir, const char *snap, size_t snap_len) {
    size_t len;
    char *now = snapshot(dir, &len);
    bool same = len == snap_len && !memcmp(now, snap, len);
    free(now);
    return same;
}

/* ---- the check, in the library ---- */

TEST(outdir_check_refuses_bad_destinations) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char file[1024], under[1100], junk[1024], p[1100], model[1024], empty[1024], sub[1100];
    tmp_path(file, sizeof file, "od-file");
    put_file(file, "x");
    /* a file where a directory must be */
    CHECK(loom_out_check(ctx, "--save-hf", file, LOOM_OUT_DIR, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "--save-hf");
    CHECK_CONTAINS(loom_last_error(ctx), file);
    CHECK_CONTAINS(loom_last_error(ctx), "is a file");
    /* under a file: nothing can be written there, root or not */
    snprintf(under, sizeof under, "%s/sub/deeper", file);
    CHECK(loom_out_check(ctx, "--save-adapter", under, LOOM_OUT_DIR, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "--save-adapter");
    CHECK_CONTAINS(loom_last_error(ctx), "is a file, not a directory");
    /* a place no one can create entries in, root included */
    CHECK(loom_out_check(ctx, "--out", "/proc/loom-test-out", LOOM_OUT_DIR, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "cannot");
    /* a directory with a user's files: refused, the files named */
    tmp_path(junk, sizeof junk, "od-home");
    mkdir(junk, 0755);
    snprintf(p, sizeof p, "%s/notes.txt", junk);
    put_file(p, "mine");
    snprintf(p, sizeof p, "%s/config.json", junk);
    put_file(p, "{}");
    CHECK(loom_out_check(ctx, "--save-hf", junk, LOOM_OUT_DIR, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "notes.txt");
    CHECK_CONTAINS(loom_last_error(ctx), "new or empty directory");
    /* a subdirectory is not part of a model directory either */
    tmp_path(model, sizeof model, "od-model");
    mkdir(model, 0755);
    snprintf(p, sizeof p, "%s/config.json", model);
    put_file(p, "{}");
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", model);
    put_file(p, "x");
    snprintf(p, sizeof p, "%s/tokenizer.json", model);
    put_file(p, "{}");
    CHECK_OK(ctx, loom_out_check(ctx, "--save-hf", model, LOOM_OUT_DIR, 0));
    snprintf(sub, sizeof sub, "%s/checkpoints", model);
    mkdir(sub, 0755);
    CHECK(loom_out_check(ctx, "--save-hf", model, LOOM_OUT_DIR, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "checkpoints");
    rmdir(sub);
    /* empty, or new with missing parents: fine, and nothing is created */
    tmp_path(empty, sizeof empty, "od-empty");
    mkdir(empty, 0755);
    CHECK_OK(ctx, loom_out_check(ctx, "--save-hf", empty, LOOM_OUT_DIR, 0));
    tmp_path(p, sizeof p, "od-new/a/b");
    CHECK_OK(ctx, loom_out_check(ctx, "--save-hf", p, LOOM_OUT_DIR, 1000));
    tmp_path(p, sizeof p, "od-new");
    CHECK(!loom_dir_exists(p));
    /* a single file: a directory in the way is refused */
    CHECK(loom_out_check(ctx, "--out", empty, LOOM_OUT_FILE, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "is a directory");
    CHECK_OK(ctx, loom_out_check(ctx, "--out", file, LOOM_OUT_FILE, 0));
    /* no room: more than any disk has */
    CHECK(loom_out_check(ctx, "--save-hf", empty, LOOM_OUT_DIR, UINT64_MAX / 4) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "not enough free space");
    CHECK_OK(ctx, loom_out_check(ctx, "--save-hf", empty, LOOM_OUT_DIR, 4096));
    /* the library's save path refuses the user's directory too */
    loom_out o;
    CHECK(loom_out_begin(ctx, "save_hf", junk, LOOM_OUT_DIR, &o) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "notes.txt");
    loom_ctx_free(ctx);
}

/* Permission bits stop writes only for users other than root. */
TEST(outdir_check_refuses_read_only_directory) {
    if (geteuid() == 0) SKIP("running as root: permission bits do not stop root's writes");
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char ro[1024], p[1100];
    tmp_path(ro, sizeof ro, "od-ro");
    mkdir(ro, 0755);
    chmod(ro, 0555);
    snprintf(p, sizeof p, "%s/out", ro);
    CHECK(loom_out_check(ctx, "--save-hf", p, LOOM_OUT_DIR, 0) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "cannot write in");
    chmod(ro, 0755);
    loom_ctx_free(ctx);
}

/* ---- begin/commit, in the library ---- */

TEST(outdir_commit_replaces_whole) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char dest[1024], p[1100], names[4096];
    tmp_path(dest, sizeof dest, "oc/model");
    loom_out o;
    /* new: written into a temporary, moved into place */
    REQUIRE_OK(ctx, loom_out_begin(ctx, "save_hf", dest, LOOM_OUT_DIR, &o));
    CHECK(!loom_dir_exists(dest));
    for (int i = 1; i <= 5; i++) {
        snprintf(p, sizeof p, "%s/model-0000%d-of-00005.safetensors", o.tmp, i);
        put_file(p, "old");
    }
    REQUIRE_OK(ctx, loom_out_commit(ctx, &o));
    listing(dest, names, sizeof names);
    CHECK_CONTAINS(names, "model-00005-of-00005.safetensors");
    /* again with one file: the five are gone */
    REQUIRE_OK(ctx, loom_out_begin(ctx, "save_hf", dest, LOOM_OUT_DIR, &o));
    snprintf(p, sizeof p, "%s/model.safetensors", o.tmp);
    put_file(p, "new");
    REQUIRE_OK(ctx, loom_out_commit(ctx, &o));
    listing(dest, names, sizeof names);
    CHECK_STR(names, "model.safetensors");
    tmp_path(p, sizeof p, "oc");
    CHECK_EQ_INT(temporaries(p), 0);
    /* abandoned: the destination stays as it was, the temporary goes */
    REQUIRE_OK(ctx, loom_out_begin(ctx, "save_hf", dest, LOOM_OUT_DIR, &o));
    snprintf(p, sizeof p, "%s/config.json", o.tmp);
    put_file(p, "{}");
    loom_out_abort(&o);
    listing(dest, names, sizeof names);
    CHECK_STR(names, "model.safetensors");
    tmp_path(p, sizeof p, "oc");
    CHECK_EQ_INT(temporaries(p), 0);
    /* one file */
    tmp_path(dest, sizeof dest, "oc/golden.safetensors");
    put_file(dest, "old");
    REQUIRE_OK(ctx, loom_out_begin(ctx, "--out", dest, LOOM_OUT_FILE, &o));
    put_file(o.file, "new");
    REQUIRE_OK(ctx, loom_out_commit(ctx, &o));
    char *data;
    size_t len;
    REQUIRE_OK(ctx, loom_read_file(ctx, dest, 0, &data, &len));
    CHECK_STR(data, "new");
    free(data);
    tmp_path(p, sizeof p, "oc");
    listing(p, names, sizeof names);
    CHECK_STR(names, "golden.safetensors model");
    loom_ctx_free(ctx);
}

/* ---- the command line ---- */

/* A loom run with env (NAME=VALUE) set, stderr piped to *err_fd. */
static pid_t spawn(const char *env, int *err_fd, const char *const argv[]) {
    int fds[2];
    if (pipe(fds) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        char kv[256];
        snprintf(kv, sizeof kv, "%s", env);
        char *eq = strchr(kv, '=');
        if (eq) {
            *eq = 0;
            setenv(kv, eq + 1, 1);
        }
        int nul = open("/dev/null", O_RDWR);
        dup2(nul, 0);
        dup2(nul, 1);
        dup2(fds[1], 2);
        close(fds[0]);
        /* the signals the tests send at their default action: a shell's
         * background job inherits SIGINT and SIGQUIT ignored, and the paused
         * save would then outlive its SIGINT while the test waits for it */
        signal(SIGINT, SIG_DFL);
        signal(SIGTERM, SIG_DFL);
        signal(SIGQUIT, SIG_DFL);
        execvp(argv[0], (char *const *)argv);
        _exit(127);
    }
    close(fds[1]);
    *err_fd = fds[0];
    return pid;
}

/* Reads fd until `needle` shows up (true) or EOF / 60 s (false). */
static bool wait_for(int fd, const char *needle, char *buf, size_t cap) {
    size_t len = 0;
    buf[0] = 0;
    double t0 = loom_test_now_ms();
    while (loom_test_now_ms() - t0 < 60000) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 200) <= 0) continue;
        ssize_t r = read(fd, buf + len, cap - 1 - len);
        if (r <= 0) return false;
        len += (size_t)r;
        buf[len] = 0;
        if (strstr(buf, needle)) return true;
        if (len + 1 >= cap) len = 0;
    }
    return false;
}

/* init into dest paused at `where` (a LOOM_TEST_SAVE_PAUSE value), killed
 * by sig: returns true when the pause was reached and the process died of it. */
static bool init_killed(const char *dest, const char *where, int sig) {
    char env[128], buf[8192];
    snprintf(env, sizeof env, "LOOM_TEST_SAVE_PAUSE=%s", where);
    int fd;
    pid_t pid = spawn(env, &fd, (const char *const[]){loom_test_bin(), "init", "--out", dest,
                                                       "--max-shard-size", "100KB", "--seed", "2",
                                                       NULL});
    if (pid < 0) return false;
    bool paused = wait_for(fd, "test hook: save paused", buf, sizeof buf);
    kill(pid, paused ? sig : SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    close(fd);
    if (!paused) fprintf(stderr, "  the save did not pause: %s\n", buf);
    return paused && WIFSIGNALED(status) && WTERMSIG(status) == sig;
}

TEST(cli_interrupted_save_keeps_old_version) {
    char parent[1024], dest[1100], *out;
    tmp_path(parent, sizeof parent, "intr");
    mkdir(parent, 0755);
    snprintf(dest, sizeof dest, "%s/model", parent);
    const int sigs[] = {SIGTERM, SIGINT, SIGKILL};
    const char *sig_names[] = {"SIGTERM", "SIGINT", "SIGKILL"};
    /* a first save killed half-way: no model there, and none half-written */
    CHECK(init_killed(dest, "after_file:2", SIGKILL));
    CHECK_MSG(!loom_dir_exists(dest), "a killed first save left %s", dest);
    CHECK_EQ_INT(temporaries(parent), 1); /* the dead save's, removed by the next */
    REQUIRE(RUN(&out, "init", "--out", dest, "--max-shard-size", "300KB", "--seed", "1") == 0);
    free(out);
    CHECK_EQ_INT(temporaries(parent), 0);
    char names[4096], now[4096];
    listing(dest, names, sizeof names);
    CHECK_CONTAINS(names, "model-00001-of-");
    size_t old_len;
    char *old = snapshot(dest, &old_len);
    for (int k = 0; k < 3; k++)
        for (int at = 0; at < 2; at++) {
            const char *where = at ? "before_move" : "after_file:2";
            CHECK_MSG(init_killed(dest, where, sigs[k]), "%s at %s", sig_names[k], where);
            listing(dest, now, sizeof now);
            CHECK_MSG(!strcmp(now, names), "%s at %s: the directory holds %s, not %s",
                      sig_names[k], where, now, names);
            CHECK_MSG(same_dir(dest, old, old_len), "%s at %s: the old model changed",
                      sig_names[k], where);
            CHECK_EQ_INT(temporaries(parent), 1); /* each save removes the dead one's */
        }
    free(old);
    /* the next save removes what the dead ones left and replaces the model */
    REQUIRE(RUN(&out, "init", "--out", dest, "--seed", "3") == 0);
    CHECK_CONTAINS(out, "left by an interrupted save");
    free(out);
    CHECK_EQ_INT(temporaries(parent), 0);
    listing(dest, names, sizeof names);
    CHECK_STR(names, "config.json model.safetensors");
}

TEST(cli_full_disk_is_clear_and_clean) {
    char parent[1024], dest[1100], golden[1100], names[4096], *out;
    tmp_path(parent, sizeof parent, "full");
    mkdir(parent, 0755);
    snprintf(dest, sizeof dest, "%s/model", parent);
    REQUIRE(RUN(&out, "init", "--out", dest, "--max-shard-size", "300KB") == 0);
    free(out);
    listing(dest, names, sizeof names);
    CHECK_CONTAINS(names, "model-00001-of-");
    size_t old_len;
    char *old = snapshot(dest, &old_len);
    int fd;
    pid_t pid = spawn("LOOM_TEST_SAVE_FAIL=enospc_after_bytes:200000", &fd,
                      (const char *const[]){loom_test_bin(), "init", "--out", dest, "--seed",
                                            "9", NULL});
    REQUIRE(pid > 0);
    char err[8192];
    wait_for(fd, "\x01", err, sizeof err); /* everything, to EOF */
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    close(fd);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    CHECK_CONTAINS(err, "No space left on device");
    CHECK_CONTAINS(err, "free some space");
    char now[4096];
    listing(dest, now, sizeof now);
    CHECK_STR(now, names);
    CHECK(same_dir(dest, old, old_len));
    free(old);
    CHECK_EQ_INT(temporaries(parent), 0); /* a failed save cleans up after itself */
    /* golden --out, a single file: the same */
    char model[1024], batch[1024];
    snprintf(model, sizeof model, "%s/models/tiny-qwen2", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen2.safetensors", loom_test_fixtures());
    snprintf(golden, sizeof golden, "%s/golden.safetensors", parent);
    put_file(golden, "old");
    pid = spawn("LOOM_TEST_SAVE_FAIL=enospc_after_bytes:1000", &fd,
                (const char *const[]){loom_test_bin(), "golden", "--device", "cpu", "--model",
                                      model, "--batch", batch, "--out", golden, NULL});
    REQUIRE(pid > 0);
    wait_for(fd, "\x01", err, sizeof err);
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    close(fd);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 1);
    CHECK_CONTAINS(err, "No space left on device");
    char *data;
    size_t len;
    REQUIRE(loom_read_file(NULL, golden, 0, &data, &len) == LOOM_OK);
    CHECK_STR(data, "old");
    free(data);
    CHECK_EQ_INT(temporaries(parent), 0);
}

/* A re-save with fewer shards keeps none of the old ones, through each
 * command that writes a model directory; the adapter names its base by
 * the directory it came from. */
TEST(cli_resave_leaves_no_stale_shards) {
    char model[1024], slash[1100], conv[1024], text[1024], data[1024], hf[1024], ad[1024];
    char names[4096], p[1200], *out;
    tmp_path(model, sizeof model, "rs-base");
    tmp_path(conv, sizeof conv, "rs-conv");
    tmp_path(text, sizeof text, "rs.txt");
    tmp_path(data, sizeof data, "rs.tokens");
    tmp_path(hf, sizeof hf, "rs-hf");
    tmp_path(ad, sizeof ad, "rs-adapter");
    REQUIRE(RUN(&out, "init", "--out", model, "--max-shard-size", "200KB") == 0);
    free(out);
    listing(model, names, sizeof names);
    CHECK_CONTAINS(names, "model-00005-of-");
    REQUIRE(RUN(&out, "init", "--out", model) == 0);
    free(out);
    listing(model, names, sizeof names);
    CHECK_STR(names, "config.json model.safetensors");
    /* convert */
    REQUIRE(RUN(&out, "convert", "--model", model, "--out", conv, "--max-shard-size", "200KB") == 0);
    free(out);
    listing(conv, names, sizeof names);
    CHECK_CONTAINS(names, "model-00005-of-");
    REQUIRE(RUN(&out, "convert", "--model", model, "--out", conv) == 0);
    free(out);
    listing(conv, names, sizeof names);
    CHECK_STR(names, "config.json model.safetensors");
    /* train --save-hf over a sharded directory, --save-adapter beside it */
    put_file(text, "abc abc abc 1\n\nabc abc abc 2\n\n");
    REQUIRE(RUN(&out, "data", "--text", text, "--out", data) == 0);
    free(out);
    REQUIRE(RUN(&out, "convert", "--model", model, "--out", hf, "--max-shard-size", "200KB") == 0);
    free(out);
    snprintf(p, sizeof p, "%s/tokenizer.json", model);
    put_file(p, "{\"side\": 1}"); /* travels with --save-hf */
    snprintf(slash, sizeof slash, "%s/", model);
    int rc = RUN(&out, "train", "--device", "cpu", "--model", slash, "--data", data,
                 "--train-steps", "1", "--seq-len", "16", "--global-batch-size", "1",
                 "--lora-r", "2", "--merge-lora", "--save-hf", hf, "--save-adapter", ad);
    CHECK_MSG(rc == 0, "train: %s", out);
    free(out);
    listing(hf, names, sizeof names);
    CHECK_STR(names, "config.json model.safetensors tokenizer.json");
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_json *cfg;
    snprintf(p, sizeof p, "%s/adapter_config.json", ad);
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, p, &cfg));
    const loom_json *base = loom_json_get(cfg, "base_model_name_or_path");
    CHECK(base && base->type == LOOM_JSON_STRING);
    if (base && base->type == LOOM_JSON_STRING) CHECK_STR(base->s, "rs-base");
    loom_json_free(cfg);
    loom_ctx_free(ctx);
    CHECK_EQ_INT(temporaries(loom_test_tmpdir()), 0); /* the old directories went too */
}

/* Destinations that cannot be written are refused before any work: the
 * message names the flag and the path, and no step ran. */
TEST(cli_outputs_checked_before_work) {
    char model[1024], text[1024], data[1024], file[1024], under[1100], home[1024], p[1200], *out;
    tmp_path(model, sizeof model, "cb-model");
    tmp_path(text, sizeof text, "cb.txt");
    tmp_path(data, sizeof data, "cb.tokens");
    tmp_path(file, sizeof file, "cb-file");
    tmp_path(home, sizeof home, "cb-home");
    snprintf(under, sizeof under, "%s/sub", file);
    put_file(file, "x");
    mkdir(home, 0755);
    snprintf(p, sizeof p, "%s/.bashrc", home);
    put_file(p, "# mine");
    put_file(text, "abc abc abc\n\n");
    REQUIRE(RUN(&out, "init", "--out", model, "--log-level", "warn") == 0);
    free(out);
    REQUIRE(RUN(&out, "data", "--text", text, "--out", data) == 0);
    free(out);
    const char *flags[] = {"--save-hf", "--save-adapter", "--save-hf"};
    const char *dests[] = {file, under, home};
    const char *why[] = {"is a file", "is a file, not a directory", ".bashrc"};
    for (int i = 0; i < 3; i++) {
        int rc = RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data,
                     "--train-steps", "1", "--seq-len", "16", "--global-batch-size", "1",
                     "--lora-r", "2", flags[i], dests[i]);
        CHECK_EQ_INT(rc, 1);
        CHECK_CONTAINS(out, flags[i]);
        CHECK_CONTAINS(out, dests[i]);
        CHECK_CONTAINS(out, why[i]);
        CHECK_MSG(!strstr(out, "step 1/"), "%s %s: training ran before the check", flags[i],
                  dests[i]);
        free(out);
    }
    char same[1100];
    snprintf(same, sizeof same, "%s/both/", loom_test_tmpdir());
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data,
                     "--lora-r", "2", "--save-hf", same, "--save-adapter", same),
                 1);
    CHECK_CONTAINS(out, "name the same directory");
    CHECK_MSG(!strstr(out, "step 1/"), "training ran before the check");
    free(out);
    CHECK_EQ_INT(RUN(&out, "init", "--out", home), 1);
    CHECK_CONTAINS(out, ".bashrc");
    free(out);
    CHECK_EQ_INT(RUN(&out, "convert", "--model", model, "--out", file), 1);
    CHECK_CONTAINS(out, "--out");
    CHECK_CONTAINS(out, "is a file");
    free(out);
    /* golden: a directory where its file goes */
    char fmodel[1024], batch[1024];
    snprintf(fmodel, sizeof fmodel, "%s/models/tiny-qwen2", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen2.safetensors", loom_test_fixtures());
    snprintf(p, sizeof p, "%s/x.safetensors", home);
    mkdir(p, 0755);
    CHECK_EQ_INT(RUN(&out, "golden", "--device", "cpu", "--model", fmodel, "--batch", batch,
                     "--out", p),
                 1);
    CHECK_CONTAINS(out, "is a directory");
    CHECK_MSG(!strstr(out, ": loss "), "golden ran before the check: %s", out);
    free(out);
}

/* Under mpirun rank 0 checks and writes for the job: a refused destination
 * ends every rank before training; a tp=2 save replaces the sharded
 * directory whole. */
TEST(cli_outputs_under_mpirun) {
    if (!loom_test_have_mpirun())
        SKIP("mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)");
    loom_test_mpi_env();
    char *out = NULL;
    char model[1024], text[1024], data[1024], hf[1024], file[1024], names[4096], parent[1024];
    tmp_path(parent, sizeof parent, "mpi");
    mkdir(parent, 0755);
    tmp_path(model, sizeof model, "mpi/base");
    tmp_path(text, sizeof text, "mpi/t.txt");
    tmp_path(data, sizeof data, "mpi/t.tokens");
    tmp_path(hf, sizeof hf, "mpi/hf");
    tmp_path(file, sizeof file, "mpi/file");
    put_file(file, "x");
    put_file(text, "abc abc abc 1\n\nabc abc abc 2\n\n");
    REQUIRE(RUN(&out, "init", "--out", model, "--log-level", "warn") == 0);
    free(out);
    REQUIRE(RUN(&out, "data", "--text", text, "--out", data) == 0);
    free(out);
    REQUIRE(RUN(&out, "convert", "--model", model, "--out", hf, "--max-shard-size", "200KB") == 0);
    free(out);
#define MPI_TRAIN(o, dest)                                                                      \
    loom_test_run(o, (const char *const[]){"mpirun", "-np", "2", loom_test_bin(), "train",     \
                                           "--device", "cpu", "--tp", "2", "--model", model,   \
                                           "--data", data, "--train-steps", "1", "--seq-len",  \
                                           "16", "--global-batch-size", "1", "--save-hf",      \
                                           dest, NULL})
    CHECK(MPI_TRAIN(&out, file) != 0);
    CHECK_CONTAINS(out, "--save-hf");
    CHECK_CONTAINS(out, "is a file");
    CHECK_MSG(!strstr(out, "step 1/"), "trained before the check: %s", out);
    free(out);
    int rc = MPI_TRAIN(&out, hf);
    CHECK_MSG(rc == 0, "mpirun train: %s", out);
    free(out);
    listing(hf, names, sizeof names);
    CHECK_STR(names, "config.json model.safetensors");
    CHECK_EQ_INT(temporaries(parent), 0);
#undef MPI_TRAIN
}
