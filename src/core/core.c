/* Context, errors, logging, allocation, string buffers, file helpers. */

#include "core.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static const char *status_names[LOOM_STATUS_COUNT] = {
    [LOOM_OK] = "ok",
    [LOOM_ERR_INVALID_ARG] = "invalid argument",
    [LOOM_ERR_IO] = "I/O error",
    [LOOM_ERR_FORMAT] = "malformed file",
    [LOOM_ERR_CONFIG] = "bad configuration",
    [LOOM_ERR_UNSUPPORTED] = "unsupported",
    [LOOM_ERR_SHAPE] = "shape mismatch",
    [LOOM_ERR_NOT_FOUND] = "not found",
    [LOOM_ERR_OOM] = "out of memory",
    [LOOM_ERR_DEVICE] = "device error",
    [LOOM_ERR_COMM] = "communication error",
    [LOOM_ERR_INTERNAL] = "internal error",
};

const char *loom_status_str(loom_status st) {
    if ((int)st < 0 || st >= LOOM_STATUS_COUNT) return "unknown status";
    return status_names[st];
}

const char *loom_version(void) {
#define LOOM_STR2(x) #x
#define LOOM_STR(x) LOOM_STR2(x)
    return LOOM_STR(LOOM_VERSION_MAJOR) "." LOOM_STR(LOOM_VERSION_MINOR) "." LOOM_STR(
        LOOM_VERSION_PATCH);
}

loom_status loom_ctx_create(loom_ctx **out) {
    loom_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return LOOM_ERR_OOM;
    ctx->rank = 0;
    ctx->world_size = 1;
    ctx->log_level = LOOM_LOG_INFO;
    ctx->log_stream = stderr;
    *out = ctx;
    return LOOM_OK;
}

void loom_ctx_free(loom_ctx *ctx) { free(ctx); }

const char *loom_last_error(const loom_ctx *ctx) {
    if (!ctx) return "no context";
    return ctx->status == LOOM_OK ? "" : ctx->err;
}

void loom_clear_error(loom_ctx *ctx) {
    if (!ctx) return;
    ctx->status = LOOM_OK;
    ctx->err[0] = '\0';
}

void loom_ctx_set_rank(loom_ctx *ctx, int rank, int world_size) {
    ctx->rank = rank;
    ctx->world_size = world_size > 0 ? world_size : 1;
}

void loom_ctx_set_log_level(loom_ctx *ctx, loom_log_level level) { ctx->log_level = level; }
loom_log_level loom_ctx_log_level(const loom_ctx *ctx) { return ctx->log_level; }
void loom_ctx_set_line_open(loom_ctx *ctx, bool open) { ctx->line_open = open; }
bool loom_ctx_line_open(const loom_ctx *ctx) { return ctx->line_open; }

loom_status loom_errf(loom_ctx *ctx, loom_status st, const char *fmt, ...) {
    if (!ctx) return st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err, sizeof ctx->err, fmt, ap);
    va_end(ap);
    ctx->status = st;
    return st;
}

loom_status loom_err_prefix(loom_ctx *ctx, const char *fmt, ...) {
    if (!ctx) return LOOM_ERR_INTERNAL;
    char prefix[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* shift the old message right and put "prefix: " in front (truncating) */
    size_t pl = strlen(prefix), ol = strnlen(ctx->err, sizeof ctx->err - 1);
    if (pl + 2 >= sizeof ctx->err) pl = sizeof ctx->err - 3;
    size_t keep = ol;
    if (pl + 2 + keep >= sizeof ctx->err) keep = sizeof ctx->err - 1 - pl - 2;
    memmove(ctx->err + pl + 2, ctx->err, keep);
    memcpy(ctx->err, prefix, pl);
    ctx->err[pl] = ':';
    ctx->err[pl + 1] = ' ';
    ctx->err[pl + 2 + keep] = '\0';
    if (ctx->status == LOOM_OK) ctx->status = LOOM_ERR_INTERNAL;
    return ctx->status;
}

void loom_log(const loom_ctx *ctx, loom_log_level level, const char *fmt, ...) {
    loom_log_level max = ctx ? ctx->log_level : LOOM_LOG_INFO;
    if (level > max) return;
    FILE *f = ctx && ctx->log_stream ? ctx->log_stream : stderr;
    static const char *tags[] = {"error", "warning", "info", "debug"};
    char line[4096];
    int n = 0;
    if (ctx && ctx->line_open) n = snprintf(line, sizeof line, "\r\033[K"); /* erase it */
    if (ctx && ctx->world_size > 1)
        n += snprintf(line + n, sizeof line - (size_t)n, "[rank %d/%d] ", ctx->rank,
                      ctx->world_size);
    if (level != LOOM_LOG_INFO)
        n += snprintf(line + n, sizeof line - (size_t)n, "%s: ", tags[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* one write per line so lines of different ranks do not interleave */
    size_t len = strlen(line);
    if (len == 0 || line[len - 1] != '\n') {
        if (len + 1 < sizeof line) {
            line[len++] = '\n';
            line[len] = '\0';
        } else {
            line[len - 1] = '\n';
        }
    }
    fputs(line, f);
    fflush(f);
}

void loom_assert_fail(const char *cond, const char *file, int line) {
    fprintf(stderr, "loom: internal error: assertion '%s' failed at %s:%d\n", cond, file, line);
    abort();
}

void *loom_malloc(loom_ctx *ctx, size_t n, const char *what) {
    void *p = malloc(n ? n : 1);
    if (!p) loom_errf(ctx, LOOM_ERR_OOM, "out of memory allocating %zu bytes for %s", n, what);
    return p;
}

void *loom_calloc(loom_ctx *ctx, size_t count, size_t size, const char *what) {
    size_t n;
    if (!loom_mul_ok(count, size, &n)) {
        loom_errf(ctx, LOOM_ERR_OOM, "allocation size overflow (%zu x %zu) for %s", count, size,
                  what);
        return NULL;
    }
    void *p = calloc(count ? count : 1, size ? size : 1);
    if (!p) loom_errf(ctx, LOOM_ERR_OOM, "out of memory allocating %zu bytes for %s", n, what);
    return p;
}

void *loom_realloc(loom_ctx *ctx, void *p, size_t n, const char *what) {
    void *q = realloc(p, n ? n : 1);
    if (!q) loom_errf(ctx, LOOM_ERR_OOM, "out of memory allocating %zu bytes for %s", n, what);
    return q;
}

char *loom_strndup(loom_ctx *ctx, const char *s, size_t n) {
    char *p = loom_malloc(ctx, n + 1, "a string");
    if (!p) return NULL;
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

char *loom_strdup(loom_ctx *ctx, const char *s) { return loom_strndup(ctx, s, strlen(s)); }

/* ---- string buffer ---- */

void loom_sb_init(loom_sb *sb) { memset(sb, 0, sizeof *sb); }

void loom_sb_free(loom_sb *sb) {
    free(sb->buf);
    loom_sb_init(sb);
}

static bool sb_reserve(loom_sb *sb, size_t extra) {
    if (sb->failed) return false;
    size_t need;
    if (!loom_add_ok(sb->len, extra, &need) || !loom_add_ok(need, 1, &need)) {
        sb->failed = true;
        return false;
    }
    if (need <= sb->cap) return true;
    size_t cap = sb->cap ? sb->cap : 64;
    while (cap < need) {
        if (cap > SIZE_MAX / 2) {
            cap = need;
            break;
        }
        cap *= 2;
    }
    char *p = realloc(sb->buf, cap);
    if (!p) {
        sb->failed = true;
        return false;
    }
    sb->buf = p;
    sb->cap = cap;
    return true;
}

void loom_sb_append(loom_sb *sb, const char *s, size_t n) {
    if (!sb_reserve(sb, n)) return;
    memcpy(sb->buf + sb->len, s, n);
    sb->len += n;
    sb->buf[sb->len] = '\0';
}

void loom_sb_puts(loom_sb *sb, const char *s) { loom_sb_append(sb, s, strlen(s)); }
void loom_sb_putc(loom_sb *sb, char c) { loom_sb_append(sb, &c, 1); }

void loom_sb_printf(loom_sb *sb, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || !sb_reserve(sb, (size_t)n)) {
        sb->failed = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(sb->buf + sb->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb->len += (size_t)n;
}

char *loom_sb_take(loom_sb *sb) {
    char *p = sb->buf;
    if (!p) p = calloc(1, 1);
    loom_sb_init(sb);
    return p;
}

/* ---- files ---- */

loom_status loom_read_file(loom_ctx *ctx, const char *path, size_t max_bytes, char **data,
                           size_t *len) {
    *data = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sbuf;
    if (fstat(fd, &sbuf) != 0) {
        int e = errno;
        close(fd);
        return loom_errf(ctx, LOOM_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
    }
    if (S_ISDIR(sbuf.st_mode)) {
        close(fd);
        return loom_errf(ctx, LOOM_ERR_IO, "%s: is a directory, expected a file", path);
    }
    size_t size = (size_t)sbuf.st_size;
    if (max_bytes && size > max_bytes) {
        close(fd);
        return loom_errf(ctx, LOOM_ERR_FORMAT, "%s: file is %zu bytes, more than the %zu allowed",
                         path, size, max_bytes);
    }
    char *buf = loom_malloc(ctx, size + 1, path);
    if (!buf) {
        close(fd);
        return LOOM_ERR_OOM;
    }
    size_t got = 0;
    while (got < size) {
        ssize_t r = read(fd, buf + got, size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            int e = errno;
            free(buf);
            close(fd);
            return loom_errf(ctx, LOOM_ERR_IO, "%s: read failed: %s", path, strerror(e));
        }
        if (r == 0) break; /* file shrank while reading */
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    *data = buf;
    *len = got;
    return LOOM_OK;
}

loom_status loom_write_file_atomic(loom_ctx *ctx, const char *path, const void *data,
                                   size_t len) {
    size_t plen = strlen(path);
    char *tmp = loom_malloc(ctx, plen + 8, "a path");
    if (!tmp) return LOOM_ERR_OOM;
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        loom_status st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
        free(tmp);
        return st;
    }
    const char *p = data;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, p + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) {
            loom_status st =
                loom_errf(ctx, LOOM_ERR_IO, "%s: write failed: %s", tmp, strerror(errno));
            close(fd);
            unlink(tmp);
            free(tmp);
            return st;
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0 || close(fd) != 0) {
        loom_status st = loom_errf(ctx, LOOM_ERR_IO, "%s: fsync/close failed: %s", tmp,
                                   strerror(errno));
        unlink(tmp);
        free(tmp);
        return st;
    }
    if (rename(tmp, path) != 0) {
        loom_status st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot rename to %s: %s", tmp, path,
                                   strerror(errno));
        unlink(tmp);
        free(tmp);
        return st;
    }
    free(tmp);
    return LOOM_OK;
}

char *loom_path_join(loom_ctx *ctx, const char *dir, const char *name) {
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_puts(&sb, dir);
    if (sb.len && sb.buf[sb.len - 1] != '/') loom_sb_putc(&sb, '/');
    loom_sb_puts(&sb, name);
    if (sb.failed) {
        loom_sb_free(&sb);
        loom_errf(ctx, LOOM_ERR_OOM, "out of memory joining a path");
        return NULL;
    }
    return loom_sb_take(&sb);
}

static void last_component(const char *p, char *buf, size_t n) {
    size_t e = strlen(p);
    while (e > 1 && p[e - 1] == '/') e--;
    size_t b = e;
    while (b > 0 && p[b - 1] != '/') b--;
    if (b == e && e) b = e - 1; /* "/" */
    snprintf(buf, n, "%.*s", (int)(e - b), p + b);
}

const char *loom_path_name(const char *path, char *buf, size_t n) {
    last_component(path, buf, n);
    if (!strcmp(buf, ".") || !strcmp(buf, "..")) { /* not links: a snapshot's hash is no name */
        char *real = realpath(path, NULL);
        if (real) last_component(real, buf, n);
        free(real);
    }
    return buf;
}

bool loom_file_exists(const char *path) {
    struct stat s;
    return stat(path, &s) == 0 && S_ISREG(s.st_mode);
}

bool loom_dir_exists(const char *path) {
    struct stat s;
    return stat(path, &s) == 0 && S_ISDIR(s.st_mode);
}

loom_status loom_mkdirs(loom_ctx *ctx, const char *path) {
    char *p = loom_strdup(ctx, path);
    if (!p) return LOOM_ERR_OOM;
    for (char *s = p + 1;; s++) {
        if (*s == '/' || *s == '\0') {
            char c = *s;
            *s = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                loom_status st =
                    loom_errf(ctx, LOOM_ERR_IO, "%s: cannot create directory: %s", p,
                              strerror(errno));
                free(p);
                return st;
            }
            if (!loom_dir_exists(p)) {
                loom_status st = loom_errf(ctx, LOOM_ERR_IO, "%s: exists and is not a directory", p);
                free(p);
                return st;
            }
            *s = c;
            if (c == '\0') break;
        }
    }
    free(p);
    return LOOM_OK;
}

const char *loom_fmt_int(char buf[32], int64_t v) {
    char tmp[32];
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    int n = snprintf(tmp, sizeof tmp, "%" PRIu64, u);
    int o = 0;
    if (v < 0) buf[o++] = '-';
    for (int i = 0; i < n; i++) {
        if (i > 0 && (n - i) % 3 == 0) buf[o++] = ',';
        buf[o++] = tmp[i];
    }
    buf[o] = '\0';
    return buf;
}

const char *loom_fmt_bytes(char buf[32], uint64_t v) {
    static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double x = (double)v;
    int u = 0;
    while (x >= 1024.0 && u < 5) {
        x /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, 32, "%" PRIu64 " B", v);
    else
        snprintf(buf, 32, "%.2f %s", x, units[u]);
    return buf;
}

double loom_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
