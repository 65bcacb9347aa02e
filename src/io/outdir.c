/* Outputs checked before any work and written whole (see outdir.h). */
#include "outdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define TMP_TAG ".loom-tmp-"
#define OLD_TAG ".loom-old-"

/* Files of a model directory that travel unchanged with the weights. */
static const char *const side_files[] = {
    "tokenizer.json",      "tokenizer_config.json",  "special_tokens_map.json",
    "chat_template.jinja", "generation_config.json", "vocab.json",
    "merges.txt",          "added_tokens.json",      "tokenizer.model",
};
#define N_SIDE (sizeof side_files / sizeof side_files[0])

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* A name an output directory of loom (or of HF/PEFT) holds. */
static bool model_file_name(const char *name) {
    char stem[NAME_MAX + 1];
    snprintf(stem, sizeof stem, "%s", name);
    if (ends_with(stem, ".tmp")) stem[strlen(stem) - 4] = 0; /* an older loom's leftovers */
    if (!strcmp(stem, "config.json") || !strcmp(stem, "adapter_config.json") ||
        ends_with(stem, ".safetensors") || ends_with(stem, ".safetensors.index.json"))
        return true;
    for (size_t i = 0; i < N_SIDE; i++)
        if (!strcmp(stem, side_files[i])) return true;
    return false;
}

static const char *label(const char *what) { return what && *what ? what : "output"; }

/* The path without trailing slashes (a new string). */
static char *trimmed(loom_ctx *ctx, const char *path) {
    char *p = loom_strdup(ctx, path);
    if (!p) return NULL;
    for (size_t n = strlen(p); n > 1 && p[n - 1] == '/'; n--) p[n - 1] = 0;
    return p;
}

/* dirname of p (a new string): "." when p has no '/'. */
static char *parent_of(loom_ctx *ctx, const char *p) {
    const char *slash = strrchr(p, '/');
    if (!slash) return loom_strdup(ctx, ".");
    if (slash == p) return loom_strdup(ctx, "/");
    char *d = loom_strdup(ctx, p);
    if (d) d[slash - p] = 0;
    return d;
}

static const char *leaf(const char *p) {
    const char *slash = strrchr(p, '/');
    return slash ? slash + 1 : p;
}

/* An existing directory's entries that are not part of a model directory:
 * refused with up to four of them named. */
static loom_status check_contents(loom_ctx *ctx, const char *what, const char *dir) {
    DIR *d = opendir(dir);
    if (!d)
        return loom_errf(ctx, LOOM_ERR_IO, "%s %s: cannot read the directory: %s", label(what),
                         dir, strerror(errno));
    char names[400] = "";
    size_t o = 0;
    int bad = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char *sub = loom_path_join(ctx, dir, de->d_name);
        struct stat s;
        bool ok = sub && lstat(sub, &s) == 0 && S_ISREG(s.st_mode) && model_file_name(de->d_name);
        free(sub);
        if (ok) continue;
        if (bad++ < 4 && o < sizeof names)
            o += (size_t)snprintf(names + o, sizeof names - o, "%s%s", bad > 1 ? ", " : "",
                                  de->d_name);
    }
    closedir(d);
    if (!bad) return LOOM_OK;
    return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                     "%s %s: the directory exists and holds %d entr%s that %s not part of a "
                     "model or adapter directory (%s%s); saving replaces the whole directory, "
                     "so give a new or empty directory, or remove %s first",
                     label(what), dir, bad, bad == 1 ? "y" : "ies", bad == 1 ? "is" : "are",
                     names, bad > 4 ? ", ..." : "", bad == 1 ? "it" : "them");
}

/* The nearest existing ancestor of p (p itself excluded) must be a
 * directory this process can create entries in. *anc_out: that ancestor. */
static loom_status check_parent(loom_ctx *ctx, const char *what, const char *p, char **anc_out) {
    char *anc = parent_of(ctx, p);
    if (!anc) return LOOM_ERR_OOM;
    struct stat s;
    for (;;) {
        if (lstat(anc, &s) == 0) break;
        if (errno != ENOENT && errno != ENOTDIR) {
            loom_status st = loom_errf(ctx, LOOM_ERR_IO, "%s %s: cannot look at %s: %s",
                                       label(what), p, anc, strerror(errno));
            free(anc);
            return st;
        }
        char *up = parent_of(ctx, anc);
        free(anc);
        if (!(anc = up)) return LOOM_ERR_OOM;
    }
    if (S_ISLNK(s.st_mode)) stat(anc, &s);
    loom_status st = LOOM_OK;
    if (!S_ISDIR(s.st_mode))
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "%s %s: %s is a file, not a directory, so nothing can be created under "
                       "it; give another path", label(what), p, anc);
    else if (access(anc, W_OK | X_OK) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO,
                       "%s %s: cannot write in %s: %s; give a path where you can write, or "
                       "fix the permissions", label(what), p, anc, strerror(errno));
    if (!st) { /* permissions can lie (root, some file systems): try it */
        char probe[64];
        snprintf(probe, sizeof probe, ".loom-probe-%ld", (long)getpid());
        char *pp = loom_path_join(ctx, anc, probe);
        if (!pp) {
            st = LOOM_ERR_OOM;
        } else if (mkdir(pp, 0700) != 0 && errno != EEXIST) {
            st = loom_errf(ctx, LOOM_ERR_IO,
                           "%s %s: cannot create anything in %s: %s; give a path where you can "
                           "write", label(what), p, anc, strerror(errno));
        } else {
            rmdir(pp);
        }
        free(pp);
    }
    if (st || !anc_out)
        free(anc);
    else
        *anc_out = anc;
    return st;
}

/* Everything but the space check; *resolved: the destination to write
 * (symbolic link followed), *anc: the nearest existing ancestor. */
static loom_status inspect(loom_ctx *ctx, const char *what, const char *path, loom_out_kind kind,
                           char **resolved, char **anc) {
    *resolved = *anc = NULL;
    if (!path || !*path)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "%s: no path given", label(what));
    char *p = trimmed(ctx, path);
    if (!p) return LOOM_ERR_OOM;
    loom_status st = LOOM_OK;
    struct stat s;
    if (lstat(p, &s) == 0 && S_ISLNK(s.st_mode)) {
        char *real = realpath(p, NULL);
        if (real) {
            free(p);
            p = real;
        } /* a dangling link: written over like a missing path */
    }
    const char *lf = leaf(p);
    if (!strcmp(p, "/") || !strcmp(lf, ".") || !strcmp(lf, "..")) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "%s %s: give the output a name of its own (the directory it names is "
                       "replaced whole)", label(what), path);
        goto done;
    }
    if (stat(p, &s) == 0) {
        if (kind != LOOM_OUT_FILE && !S_ISDIR(s.st_mode))
            st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                           "%s %s: is a file, but a directory is written here; remove the file "
                           "or give another path", label(what), path);
        else if (kind == LOOM_OUT_FILE && S_ISDIR(s.st_mode))
            st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                           "%s %s: is a directory, but a file is written here; give a file "
                           "name", label(what), path);
        else if (kind == LOOM_OUT_FILE && !S_ISREG(s.st_mode))
            st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                           "%s %s: exists and is not a regular file; give another path",
                           label(what), path);
        else if (kind == LOOM_OUT_DIR)
            st = check_contents(ctx, what, p);
    } else if (errno != ENOENT && errno != ENOTDIR) {
        st = loom_errf(ctx, LOOM_ERR_IO, "%s %s: %s", label(what), path, strerror(errno));
    }
    if (!st) st = check_parent(ctx, what, p, anc);
done:
    if (st)
        free(p);
    else
        *resolved = p;
    return st;
}

loom_status loom_out_check(loom_ctx *ctx, const char *what, const char *path, loom_out_kind kind,
                           uint64_t est_bytes) {
    char *p, *anc;
    loom_status st = inspect(ctx, what, path, kind, &p, &anc);
    if (st) return st;
    struct statvfs v;
    if (est_bytes && statvfs(anc, &v) == 0) {
        uint64_t avail = (uint64_t)v.f_bavail * (uint64_t)v.f_frsize;
        uint64_t need = est_bytes + est_bytes / 10 + ((uint64_t)16 << 20);
        if (need < est_bytes) need = UINT64_MAX;
        if (avail < need) {
            char a[32], b[32], c[32];
            st = loom_errf(ctx, LOOM_ERR_IO,
                           "%s %s: not enough free space: about %s is written (%s estimated, "
                           "plus 10%% and 16 MiB of margin) and the file system of %s has %s "
                           "free; free some space or write elsewhere",
                           label(what), path, loom_fmt_bytes(a, need), loom_fmt_bytes(b, est_bytes),
                           anc, loom_fmt_bytes(c, avail));
        }
    }
    free(p);
    free(anc);
    return st;
}

/* ---- writing whole ---- */

void loom_out_rm_rf(const char *path) {
    struct stat s;
    if (lstat(path, &s) != 0) return;
    if (S_ISDIR(s.st_mode)) {
        DIR *d = opendir(path);
        struct dirent *de;
        while (d && (de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            size_t n = strlen(path) + strlen(de->d_name) + 2;
            char *sub = malloc(n);
            if (!sub) continue;
            snprintf(sub, n, "%s/%s", path, de->d_name);
            loom_out_rm_rf(sub);
            free(sub);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static void fsync_path(const char *path, bool dir) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
    if (fd < 0) return;
    (void)fsync(fd);
    close(fd);
}

void loom_out_remove_stale(loom_ctx *ctx, const char *parent, const char *name, bool prefix) {
    DIR *d = opendir(parent);
    if (!d) return;
    size_t nl = strlen(name), tl = strlen(TMP_TAG); /* OLD_TAG is as long */
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *e = de->d_name;
        if (e[0] != '.' || strncmp(e + 1, name, nl)) continue;
        const char *tag = prefix ? strstr(e + 1 + nl, ".loom-") : e + 1 + nl;
        if (!tag || (strncmp(tag, TMP_TAG, tl) && strncmp(tag, OLD_TAG, tl))) continue;
        char *end;
        long pid = strtol(tag + tl, &end, 10);
        if (end == tag + tl || *end != '-' || pid <= 0) continue;
        if (pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;
        char *sub = loom_path_join(ctx, parent, e);
        if (!sub) continue;
        LOOM_LOG_I(ctx, "removing %s, left by an interrupted save (process %ld is gone)", sub,
                   pid);
        loom_out_rm_rf(sub);
        free(sub);
    }
    closedir(d);
}

/* parent/.<name><tag><pid>-<n>, a name that does not exist yet. */
static char *temp_name(loom_ctx *ctx, const char *parent, const char *name, const char *tag,
                       unsigned n) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_printf(&sb, "%s/.%s%s%ld-%u", parent, name, tag, (long)getpid(), n);
    if (sb.failed) {
        loom_sb_free(&sb);
        loom_errf(ctx, LOOM_ERR_OOM, "out of memory for a path");
        return NULL;
    }
    return loom_sb_take(&sb);
}

static unsigned fresh_number(const void *salt) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (unsigned)(t.tv_nsec ^ (t.tv_sec << 20) ^ (uintptr_t)salt) & 0x7fffffffu;
}

void loom_out_abort(loom_out *o) {
    if (!o) return;
    if (o->tmp) loom_out_rm_rf(o->tmp);
    free(o->dest);
    free(o->parent);
    free(o->tmp);
    free(o->file);
    memset(o, 0, sizeof *o);
}

loom_status loom_out_begin(loom_ctx *ctx, const char *what, const char *path, loom_out_kind kind,
                           loom_out *o) {
    memset(o, 0, sizeof *o);
    o->kind = kind;
    char *anc = NULL;
    loom_status st = inspect(ctx, what, path, kind, &o->dest, &anc);
    free(anc);
    if (st) return st;
    if (!(o->parent = parent_of(ctx, o->dest))) goto oom;
    if ((st = loom_mkdirs(ctx, o->parent))) {
        loom_err_prefix(ctx, "%s %s", label(what), path);
        goto fail;
    }
    const char *name = leaf(o->dest);
    loom_out_remove_stale(ctx, o->parent, name, false);
    for (unsigned n = fresh_number(o), tries = 0;; n = n * 1103515245u + 12345u, tries++) {
        if (!(o->tmp = temp_name(ctx, o->parent, name, TMP_TAG, n & 0x7fffffffu))) goto oom;
        if (mkdir(o->tmp, 0755) == 0) break;
        int e = errno;
        free(o->tmp);
        o->tmp = NULL;
        if (e != EEXIST || tries > 100) {
            st = loom_errf(ctx, LOOM_ERR_IO, "%s %s: cannot create a temporary directory in %s: "
                                             "%s", label(what), path, o->parent, strerror(e));
            goto fail;
        }
    }
    if (kind == LOOM_OUT_FILE && !(o->file = loom_path_join(ctx, o->tmp, name))) goto oom;
    return LOOM_OK;
oom:
    st = LOOM_ERR_OOM;
fail:
    loom_out_abort(o);
    return st;
}

/* fsync every file under dir (depth levels of subdirectories), then dir. */
static void fsync_tree(loom_ctx *ctx, const char *dir, int depth) {
    DIR *d = opendir(dir);
    struct dirent *de;
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.' && (!de->d_name[1] || !strcmp(de->d_name, ".."))) continue;
        char *sub = loom_path_join(ctx, dir, de->d_name);
        struct stat s;
        if (sub && lstat(sub, &s) == 0) {
            if (S_ISDIR(s.st_mode) && depth > 0)
                fsync_tree(ctx, sub, depth - 1);
            else if (S_ISREG(s.st_mode))
                fsync_path(sub, false);
        }
        free(sub);
    }
    if (d) closedir(d);
    fsync_path(dir, true);
}

void loom_out_sync(loom_ctx *ctx, loom_out *o) {
    if (!o->tmp) return;
    fsync_tree(ctx, o->tmp, 8);
    o->synced = true;
}

loom_status loom_out_move_aside(loom_ctx *ctx, const char *path, char **aside) {
    *aside = NULL;
    char *p = trimmed(ctx, path), *parent = p ? parent_of(ctx, p) : NULL;
    loom_status st = p && parent ? LOOM_OK : LOOM_ERR_OOM;
    char *t = st ? NULL : temp_name(ctx, parent, leaf(p), OLD_TAG, fresh_number(p));
    if (!st && !t) st = LOOM_ERR_OOM;
    if (!st && rename(p, t) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot rename it to %s (to remove it): %s", path,
                       t, strerror(errno));
    if (!st) {
        fsync_path(parent, true);
        *aside = t;
    } else {
        free(t);
    }
    free(p);
    free(parent);
    return st;
}

/* Swaps the finished directory o->tmp and the existing o->dest. */
static loom_status swap_in(loom_ctx *ctx, loom_out *o) {
#ifdef RENAME_EXCHANGE
    if (renameat2(AT_FDCWD, o->tmp, AT_FDCWD, o->dest, RENAME_EXCHANGE) == 0)
        return LOOM_OK; /* o->tmp holds the old output now */
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP && errno != EPERM)
        return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot swap in %s: %s", o->dest, o->tmp,
                         strerror(errno));
#endif
    /* no atomic exchange here: the old one moves aside, then the new one in */
    char *old = temp_name(ctx, o->parent, leaf(o->dest), OLD_TAG, fresh_number(o));
    if (!old) return LOOM_ERR_OOM;
    loom_status st = LOOM_OK;
    if (rename(o->dest, old) != 0) {
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot move the old output aside to %s: %s",
                       o->dest, old, strerror(errno));
    } else if (rename(o->tmp, o->dest) != 0) {
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot move %s into place: %s", o->dest, o->tmp,
                       strerror(errno));
        if (rename(old, o->dest) != 0) /* put the old one back */
            loom_err_prefix(ctx, "the old output is left at %s", old);
    } else { /* the old one is removed with the temporary's name */
        free(o->tmp);
        o->tmp = old;
        old = NULL;
    }
    free(old);
    return st;
}

loom_status loom_out_commit(loom_ctx *ctx, loom_out *o) {
    loom_out_hooks h;
    loom_out_hooks_read(&h);
    if (!o->synced) loom_out_sync(ctx, o);
    if (h.pause_before_move) loom_out_hook_pause(o->dest);
    loom_status st = LOOM_OK;
    struct stat s;
    if (o->kind == LOOM_OUT_FILE) {
        if (rename(o->file, o->dest) != 0)
            st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot move %s into place: %s", o->dest,
                           o->file, strerror(errno));
    } else if (lstat(o->dest, &s) != 0 && errno == ENOENT) {
        if (rename(o->tmp, o->dest) != 0)
            st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot move %s into place: %s", o->dest,
                           o->tmp, strerror(errno));
        else {
            free(o->tmp);
            o->tmp = NULL;
        }
    } else {
        st = swap_in(ctx, o);
    }
    if (!st) fsync_path(o->parent, true);
    loom_out_abort(o); /* removes what is left: the old output, or the failed new one */
    return st;
}

/* ---- side files ---- */

loom_status loom_out_copy_side_files(loom_ctx *ctx, const char *from_dir, const char *to_dir) {
    loom_status st = LOOM_OK;
    for (size_t i = 0; i < N_SIDE && !st; i++) {
        char *src = loom_path_join(ctx, from_dir, side_files[i]);
        char *dst = loom_path_join(ctx, to_dir, side_files[i]);
        st = (!src || !dst) ? LOOM_ERR_OOM : LOOM_OK;
        if (!st && loom_file_exists(src)) {
            char *data;
            size_t len;
            st = loom_read_file(ctx, src, 0, &data, &len);
            if (!st) st = loom_write_file_atomic(ctx, dst, data, len);
            if (!st) free(data);
        }
        free(src);
        free(dst);
    }
    return st;
}

uint64_t loom_out_side_files_size(const char *dir) {
    uint64_t total = 0;
    for (size_t i = 0; i < N_SIDE; i++) {
        char p[PATH_MAX];
        struct stat s;
        snprintf(p, sizeof p, "%s/%s", dir, side_files[i]);
        if (stat(p, &s) == 0 && S_ISREG(s.st_mode)) total += (uint64_t)s.st_size;
    }
    return total;
}

/* ---- test hooks ---- */

void loom_out_hooks_read(loom_out_hooks *h) {
    memset(h, 0, sizeof *h);
    const char *f = getenv("LOOM_TEST_SAVE_FAIL"), *p = getenv("LOOM_TEST_SAVE_PAUSE");
    if (f && !strncmp(f, "enospc_after_bytes:", 19))
        h->fail_after_bytes = strtoull(f + 19, NULL, 10) + 1; /* +1: 0 bytes is a real setting */
    if (p && !strncmp(p, "after_file:", 11)) h->pause_after_file = atoi(p + 11);
    if (p && !strcmp(p, "before_move")) h->pause_before_move = true;
}

void loom_out_hook_pause(const char *where) {
    fprintf(stderr, "loom: test hook: save paused (%s)\n", where);
    fflush(stderr);
    for (;;) pause();
}
