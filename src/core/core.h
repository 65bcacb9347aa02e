/* Internal core helpers shared by every layer: errors, logging, allocation,
 * checked arithmetic, a growable string buffer and whole-file reads. */
#ifndef LOOM_CORE_H
#define LOOM_CORE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "loom.h"

#define LOOM_ERR_MAX 2048

struct loom_ctx {
    loom_status status;      /* status of the last error, LOOM_OK when clear */
    char err[LOOM_ERR_MAX];  /* message of the last error */
    int rank, world_size;
    loom_log_level log_level;
    FILE *log_stream;        /* where log lines go (stderr by default) */
    bool line_open;          /* a progress line (\r-refreshed, on a terminal) is on
                              * log_stream: each log line erases it first */
};

#if defined(__GNUC__)
#define LOOM_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define LOOM_UNUSED __attribute__((unused))
#else
#define LOOM_PRINTF(f, a)
#define LOOM_UNUSED
#endif

/* Sets the context's error message and returns st (so: `return loom_errf(...)`).
 * ctx may be NULL (the message is then dropped). */
loom_status loom_errf(loom_ctx *ctx, loom_status st, const char *fmt, ...) LOOM_PRINTF(3, 4);
/* Prepends "<prefix>: " to the current error message, keeps its status and
 * returns it. Used to add context ("model.safetensors: ") as an error rises. */
loom_status loom_err_prefix(loom_ctx *ctx, const char *fmt, ...) LOOM_PRINTF(2, 3);

/* Log a line prefixed by rank (when world_size > 1) and level. */
void loom_log(const loom_ctx *ctx, loom_log_level level, const char *fmt, ...) LOOM_PRINTF(3, 4);
#define LOOM_LOG_E(ctx, ...) loom_log((ctx), LOOM_LOG_ERROR, __VA_ARGS__)
#define LOOM_LOG_W(ctx, ...) loom_log((ctx), LOOM_LOG_WARN, __VA_ARGS__)
#define LOOM_LOG_I(ctx, ...) loom_log((ctx), LOOM_LOG_INFO, __VA_ARGS__)
#define LOOM_LOG_D(ctx, ...) loom_log((ctx), LOOM_LOG_DEBUG, __VA_ARGS__)
/* Whether a progress line is on the log stream (loom train --progress draws
 * it; loom_log erases it before each line). */
void loom_ctx_set_line_open(loom_ctx *ctx, bool open);
bool loom_ctx_line_open(const loom_ctx *ctx);

/* Broken internal invariants only (never for bad input): prints and aborts. */
#define LOOM_ASSERT(cond)                                                        \
    do {                                                                         \
        if (!(cond)) loom_assert_fail(#cond, __FILE__, __LINE__);                \
    } while (0)
void loom_assert_fail(const char *cond, const char *file, int line);

/* Allocation: on failure sets an LOOM_ERR_OOM error naming `what` and
 * returns NULL. Sizes are overflow-checked. */
void *loom_malloc(loom_ctx *ctx, size_t n, const char *what);
void *loom_calloc(loom_ctx *ctx, size_t count, size_t size, const char *what);
void *loom_realloc(loom_ctx *ctx, void *p, size_t n, const char *what);
char *loom_strdup(loom_ctx *ctx, const char *s);
char *loom_strndup(loom_ctx *ctx, const char *s, size_t n);

/* Checked arithmetic: return false on overflow. */
static inline bool loom_mul_ok(size_t a, size_t b, size_t *out) {
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool loom_add_ok(size_t a, size_t b, size_t *out) {
    return !__builtin_add_overflow(a, b, out);
}

/* Growable NUL-terminated string buffer. On allocation failure `failed` is
 * set and later appends do nothing; check it once at the end. */
typedef struct loom_sb {
    char *buf;
    size_t len, cap;
    bool failed;
} loom_sb;
void loom_sb_init(loom_sb *sb);
void loom_sb_free(loom_sb *sb);
void loom_sb_append(loom_sb *sb, const char *s, size_t n);
void loom_sb_puts(loom_sb *sb, const char *s);
void loom_sb_putc(loom_sb *sb, char c);
void loom_sb_printf(loom_sb *sb, const char *fmt, ...) LOOM_PRINTF(2, 3);
/* Takes ownership of the buffer (caller frees); the sb is reset. */
char *loom_sb_take(loom_sb *sb);

/* Reads a whole file into a NUL-terminated buffer (caller frees). Errors name
 * the path. max_bytes = 0 means no limit. */
loom_status loom_read_file(loom_ctx *ctx, const char *path, size_t max_bytes,
                           char **data, size_t *len);
/* Writes a whole file (to path.tmp, fsync, rename), so a crash leaves the old
 * file whole. */
loom_status loom_write_file_atomic(loom_ctx *ctx, const char *path, const void *data,
                                   size_t len);
/* Joins a directory and a file name into a new string (caller frees). */
char *loom_path_join(loom_ctx *ctx, const char *dir, const char *name);
/* The last component of a path into buf ("a/b/" -> "b"; "." and ".." ->
 * the name of the directory they are, links not followed); returns buf. */
const char *loom_path_name(const char *path, char *buf, size_t n);
bool loom_file_exists(const char *path);
bool loom_dir_exists(const char *path);
/* mkdir -p */
loom_status loom_mkdirs(loom_ctx *ctx, const char *path);

/* Formats an exact integer with thousands separators ("1,234,567"). */
const char *loom_fmt_int(char buf[32], int64_t v);
/* Seconds on the monotonic clock (for timeouts and rates). */
double loom_now_s(void);
/* Formats a byte count in binary units ("3.25 MiB"). */
const char *loom_fmt_bytes(char buf[32], uint64_t v);

/* dtype conversions (round-to-nearest-even for the narrowing ones). */
float loom_bf16_to_f32(uint16_t h);
uint16_t loom_f32_to_bf16(float f);
float loom_f16_to_f32(uint16_t h);
uint16_t loom_f32_to_f16(float f);
/* Converts n elements from src (dtype s) to dst (dtype d). Float<->float and
 * int<->int conversions are supported, and float<->int where the value is
 * exactly representable. Returns LOOM_ERR_UNSUPPORTED for a pair that makes
 * no sense and LOOM_ERR_FORMAT when a value cannot be represented exactly
 * (e.g. 3.5 to I64, or 300 to U8), naming the element index. */
loom_status loom_convert(loom_ctx *ctx, void *dst, loom_dtype d, const void *src,
                         loom_dtype s, size_t n);
bool loom_dtype_is_float(loom_dtype dt);

#endif /* LOOM_CORE_H */
