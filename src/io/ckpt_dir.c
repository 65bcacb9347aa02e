/* Training checkpoint directories, written whole (see ckpt_dir.h). */
#include "ckpt_dir.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

void loom_ckpt_iter_name(int64_t iteration, char name[32]) {
    snprintf(name, 32, "iter_%07" PRId64, iteration);
}

/* An iter_ name as loom_ckpt_iter_name writes it: *it its iteration. */
static bool parse_iter_name(const char *name, int64_t *it) {
    if (strncmp(name, "iter_", 5)) return false;
    const char *d = name + 5;
    size_t n = strlen(d);
    if (n < 7 || n > 18) return false;
    for (size_t i = 0; i < n; i++)
        if (!isdigit((unsigned char)d[i])) return false;
    *it = strtoll(d, NULL, 10);
    char canon[32];
    loom_ckpt_iter_name(*it, canon);
    return !strcmp(canon, name); /* iter_00000100 is not iter_0000100 */
}

static void test_kill(const char *step) {
    const char *k = getenv(LOOM_CKPT_KILL_ENV);
    if (!k || strcmp(k, step)) return;
    fprintf(stderr, "loom: test hook: killed at %s\n", step);
    fflush(stderr);
    raise(SIGKILL);
}

/* *out: the path without trailing slashes (a new string). */
static loom_status trimmed(loom_ctx *ctx, const char *what, const char *path, char **out) {
    if (!path || !*path) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: no path given", what);
    char *p = *out = loom_strdup(ctx, path);
    if (!p) return LOOM_ERR_OOM;
    for (size_t n = strlen(p); n > 1 && p[n - 1] == '/'; n--) p[n - 1] = 0;
    return LOOM_OK;
}

/* ---- reading a root ---- */

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

loom_status loom_ckpt_list(loom_ctx *ctx, const char *root, int64_t **iters, size_t *n) {
    *iters = NULL;
    *n = 0;
    DIR *d = opendir(root);
    if (!d)
        return loom_errf(ctx, LOOM_ERR_IO, "checkpoint directory %s: cannot read it: %s", root,
                         strerror(errno));
    size_t cap = 0;
    loom_status st = LOOM_OK;
    struct dirent *de;
    while (!st && (de = readdir(d))) {
        int64_t it;
        if (!parse_iter_name(de->d_name, &it)) continue;
        char *sub = loom_path_join(ctx, root, de->d_name);
        if (!sub) {
            st = LOOM_ERR_OOM;
            break;
        }
        bool dir = loom_dir_exists(sub);
        free(sub);
        if (!dir) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 16;
            int64_t *grown = loom_realloc(ctx, *iters, cap * sizeof **iters, "a checkpoint list");
            if (!grown) {
                st = LOOM_ERR_OOM;
                break;
            }
            *iters = grown;
        }
        (*iters)[(*n)++] = it;
    }
    closedir(d);
    if (st) {
        free(*iters);
        *iters = NULL;
        *n = 0;
        return st;
    }
    if (*n) qsort(*iters, *n, sizeof **iters, cmp_i64);
    return LOOM_OK;
}

loom_status loom_ckpt_tracker(loom_ctx *ctx, const char *root, int64_t *iteration) {
    *iteration = -1;
    char *path = loom_path_join(ctx, root, LOOM_CKPT_TRACKER);
    if (!path) return LOOM_ERR_OOM;
    struct stat s;
    if (lstat(path, &s) != 0 && errno == ENOENT) {
        free(path);
        return LOOM_OK;
    }
    char *text = NULL;
    size_t len = 0;
    loom_status st = loom_read_file(ctx, path, 4096, &text, &len);
    if (!st) {
        char *a = text, *b = text + len;
        while (a < b && isspace((unsigned char)*a)) a++;
        while (b > a && isspace((unsigned char)b[-1])) b--;
        *b = 0;
        bool digits = a < b && b - a <= 18;
        for (char *c = a; digits && c < b; c++) digits = isdigit((unsigned char)*c);
        if (digits)
            *iteration = strtoll(a, NULL, 10);
        else if (!strcmp(a, "release"))
            st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                           "%s says \"release\" (a Megatron release checkpoint, directory "
                           "release/): loom reads iter_ checkpoints only", path);
        else
            st = loom_errf(ctx, LOOM_ERR_FORMAT,
                           "%s holds \"%.40s%s\", not an iteration number: the file is damaged; "
                           "give the checkpoint to load explicitly (%s/iter_NNNNNNN), or remove "
                           "the file", path, a, strlen(a) > 40 ? "..." : "", root);
    }
    free(text);
    free(path);
    return st;
}

/* ", "-separated iter_ names of iters[0..n) into sb (the newest six). */
static void names_into(loom_sb *sb, const char *root, const int64_t *iters, size_t n) {
    size_t from = n > 6 ? n - 6 : 0;
    if (from) loom_sb_printf(sb, "%zu older ones, ", from);
    for (size_t i = from; i < n; i++) {
        char name[32];
        loom_ckpt_iter_name(iters[i], name);
        loom_sb_printf(sb, "%s%s/%s", i > from ? ", " : "", root, name);
    }
}

static loom_status put_dir(loom_ctx *ctx, char *out_dir, size_t cap, const char *dir) {
    if ((size_t)snprintf(out_dir, cap, "%s", dir) >= cap)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "checkpoint %s: the path is longer than the %zu bytes given for it",
                         dir, cap);
    return LOOM_OK;
}

/* The tracker's checkpoint failed verification (its message in ctx):
 * rewrites the error to name the newest older checkpoint that passes. */
static loom_status refuse_damaged(loom_ctx *ctx, loom_status bad, const char *root,
                                  const char *dir, const int64_t *iters, size_t n, int64_t newest,
                                  loom_ckpt_verify_fn verify, void *u) {
    char *why = loom_strdup(ctx, loom_last_error(ctx));
    if (!why) return LOOM_ERR_OOM;
    char *prev = NULL;
    size_t older = 0;
    for (size_t i = n; i-- > 0 && !prev;) {
        if (iters[i] >= newest) continue;
        older++;
        char name[32];
        loom_ckpt_iter_name(iters[i], name);
        char *p = loom_path_join(ctx, root, name);
        if (!p) break;
        if (verify(ctx, p, u) == LOOM_OK)
            prev = p;
        else
            free(p);
    }
    loom_status st;
    if (prev)
        st = loom_errf(ctx, bad,
                       "checkpoint %s, the newest (named by %s/%s), is damaged: %s. The "
                       "previous complete checkpoint is %s: to resume from it, pass it "
                       "explicitly (e.g. --load %s); loom does not fall back on its own",
                       dir, root, LOOM_CKPT_TRACKER, why, prev, prev);
    else
        st = loom_errf(ctx, bad,
                       "checkpoint %s, the newest (named by %s/%s), is damaged: %s. %s",
                       dir, root, LOOM_CKPT_TRACKER, why,
                       older ? "No older checkpoint there passes the check either"
                             : "There is no older checkpoint there");
    free(prev);
    free(why);
    return st;
}

static loom_status find_in_root(loom_ctx *ctx, const char *root, loom_ckpt_verify_fn verify,
                                void *u, char *out_dir, size_t cap, int64_t *iteration) {
    int64_t it, *iters = NULL;
    size_t n = 0;
    loom_status st = loom_ckpt_tracker(ctx, root, &it);
    if (!st) st = loom_ckpt_list(ctx, root, &iters, &n);
    if (st) return st;
    char name[32];
    loom_ckpt_iter_name(it, name);
    char *dir = it >= 0 ? loom_path_join(ctx, root, name) : NULL;
    loom_sb have;
    loom_sb_init(&have);
    names_into(&have, root, iters, n);
    if (it >= 0 && !dir) {
        st = LOOM_ERR_OOM;
    } else if (have.failed) {
        st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory for a message");
    } else if (it < 0 && !n) {
        st = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                       "checkpoint directory %s holds no checkpoint (no %s, no iter_ "
                       "directory); give the directory that --save wrote to", root,
                       LOOM_CKPT_TRACKER);
    } else if (it < 0) {
        st = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                       "checkpoint directory %s has no %s (a save was interrupted before it "
                       "was written) but holds complete checkpoints: %s; pass the one to "
                       "load explicitly", root, LOOM_CKPT_TRACKER, have.buf);
    } else if (!loom_dir_exists(dir)) {
        st = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                       "%s/%s names iteration %" PRId64 ", but %s does not exist (removed by "
                       "hand?); %s%s%s", root, LOOM_CKPT_TRACKER, it, dir,
                       n ? "the complete checkpoints there are: " : "there is no complete "
                       "checkpoint there", have.buf, n ? "; pass the one to load explicitly" : "");
    } else if (verify && (st = verify(ctx, dir, u))) {
        st = refuse_damaged(ctx, st, root, dir, iters, n, it, verify, u);
    } else {
        st = put_dir(ctx, out_dir, cap, dir);
        if (!st) *iteration = it;
    }
    loom_sb_free(&have);
    free(dir);
    free(iters);
    return st;
}

loom_status loom_ckpt_find(loom_ctx *ctx, const char *path, loom_ckpt_verify_fn verify, void *u,
                           char *out_dir, size_t cap, int64_t *iteration) {
    if (cap) out_dir[0] = 0;
    *iteration = -1;
    char *p;
    loom_status st = trimmed(ctx, "checkpoint to load", path, &p);
    if (st) return st;
    struct stat s;
    if (stat(p, &s) != 0) {
        int e = errno;
        st = e == ENOENT ? loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                                     "checkpoint %s: no such directory; give the directory that "
                                     "--save wrote to, or one of its iter_ directories", path)
                         : loom_errf(ctx, LOOM_ERR_IO, "checkpoint %s: %s", path, strerror(e));
        goto done;
    }
    if (!S_ISDIR(s.st_mode)) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "checkpoint %s: is a file; give a checkpoint directory (the one --save "
                       "wrote to, or one of its iter_ directories)", path);
        goto done;
    }
    char base[256];
    int64_t it;
    char *tracker = loom_path_join(ctx, p, LOOM_CKPT_TRACKER);
    if (!tracker) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    bool is_root = loom_file_exists(tracker);
    free(tracker);
    if (!is_root && parse_iter_name(loom_path_name(p, base, sizeof base), &it)) {
        if (verify && (st = verify(ctx, p, u))) {
            loom_err_prefix(ctx, "checkpoint %s is damaged", p);
            goto done;
        }
        if (!(st = put_dir(ctx, out_dir, cap, p))) *iteration = it;
    } else {
        st = find_in_root(ctx, p, verify, u, out_dir, cap, iteration);
    }
done:
    free(p);
    return st;
}

/* ---- writing ---- */

void loom_ckpt_abort(loom_ckpt_tx *tx) {
    if (!tx) return;
    loom_out_abort(&tx->out);
    free(tx->root);
    free(tx->dest);
    memset(tx, 0, sizeof *tx);
}

loom_status loom_ckpt_begin(loom_ctx *ctx, const char *root, int64_t iteration,
                            loom_ckpt_tx *tx) {
    memset(tx, 0, sizeof *tx);
    if (iteration < 0 || iteration > 999999999999999999LL)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "checkpoint: iteration %" PRId64 " is out of range (0 or more)",
                         iteration);
    loom_status st = trimmed(ctx, "checkpoint directory", root, &tx->root);
    if (st) return st;
    tx->iteration = iteration;
    struct stat s;
    if (stat(tx->root, &s) == 0 && !S_ISDIR(s.st_mode)) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "checkpoint directory %s: is a file, not a directory; give a directory "
                       "(checkpoints go into DIR/iter_NNNNNNN)", root);
        goto fail;
    }
    char name[32];
    loom_ckpt_iter_name(iteration, name);
    if (!(tx->dest = loom_path_join(ctx, tx->root, name))) {
        st = LOOM_ERR_OOM;
        goto fail;
    }
    if (loom_dir_exists(tx->root)) { /* the leftovers of dead savers, of any iteration */
        loom_out_remove_stale(ctx, tx->root, "iter_", true);
        loom_out_remove_stale(ctx, tx->root, LOOM_CKPT_TRACKER, false);
    }
    if ((st = loom_out_begin(ctx, "checkpoint", tx->dest, LOOM_OUT_TREE, &tx->out))) goto fail;
    char *tracker = loom_path_join(ctx, tx->root, LOOM_CKPT_TRACKER);
    st = tracker ? loom_out_check(ctx, "checkpoint tracker", tracker, LOOM_OUT_FILE, 0)
                 : LOOM_ERR_OOM; /* refused now, not after the files are written */
    free(tracker);
    if (st) goto fail;
    tx->path = tx->out.tmp;
    return LOOM_OK;
fail:
    loom_ckpt_abort(tx);
    return st;
}

/* Replaces root's tracker with `iteration`, atomically (outdir: a
 * temporary written and fsynced, renamed over the old, root fsynced). */
static loom_status write_tracker(loom_ctx *ctx, const char *root, int64_t iteration) {
    char *path = loom_path_join(ctx, root, LOOM_CKPT_TRACKER);
    if (!path) return LOOM_ERR_OOM;
    loom_out o;
    loom_status st = loom_out_begin(ctx, "checkpoint tracker", path, LOOM_OUT_FILE, &o);
    free(path);
    if (st) return st;
    char text[32]; /* as Megatron writes it: the number, no newline */
    int len = snprintf(text, sizeof text, "%" PRId64, iteration);
    if ((st = loom_write_file_atomic(ctx, o.file, text, (size_t)len))) {
        loom_out_abort(&o);
        return st;
    }
    loom_out_sync(ctx, &o);
    test_kill("after_tracker_tmp");
    return loom_out_commit(ctx, &o);
}

loom_status loom_ckpt_commit(loom_ctx *ctx, loom_ckpt_tx *tx) {
    if (!tx->path)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "checkpoint commit: no checkpoint is being written (begin failed, or "
                         "it was committed or aborted already)");
    loom_out_sync(ctx, &tx->out);
    test_kill("after_files");
    loom_status st = loom_out_commit(ctx, &tx->out); /* frees tx->out */
    tx->path = NULL;
    if (!st) {
        test_kill("after_rename");
        st = write_tracker(ctx, tx->root, tx->iteration);
        if (st)
            loom_err_prefix(ctx, "checkpoint %s is complete, but the tracker could not be "
                                 "updated", tx->dest);
        else
            test_kill("after_tracker");
    }
    loom_ckpt_abort(tx);
    return st;
}

loom_status loom_ckpt_prune(loom_ctx *ctx, const char *root, int keep) {
    if (keep <= 0) return LOOM_OK;
    int64_t tracked, *iters = NULL;
    size_t n = 0;
    loom_status st = loom_ckpt_tracker(ctx, root, &tracked);
    if (st) return loom_err_prefix(ctx, "not pruning old checkpoints");
    if ((st = loom_ckpt_list(ctx, root, &iters, &n))) return st;
    for (size_t i = 0; !st && i + (size_t)keep < n; i++) {
        if (iters[i] == tracked) continue;
        char name[32], *aside = NULL;
        loom_ckpt_iter_name(iters[i], name);
        char *dir = loom_path_join(ctx, root, name);
        if (!dir) {
            st = LOOM_ERR_OOM;
            break;
        }
        if (!(st = loom_out_move_aside(ctx, dir, &aside))) {
            test_kill("prune_after_rename");
            loom_out_rm_rf(aside);
            LOOM_LOG_D(ctx, "removed checkpoint %s (the newest %d are kept)", dir, keep);
        }
        free(aside);
        free(dir);
    }
    free(iters);
    return st;
}
