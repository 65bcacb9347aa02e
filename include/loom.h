/* loom: a distributed LLM training engine in C.
 *
 * This is the only published header. Every public function returns a
 * loom_status; on failure the context keeps a message that says what went
 * wrong and what to do (loom_last_error). The library never exits the
 * process and keeps no global state: everything lives in a loom_ctx.
 */
#ifndef LOOM_H
#define LOOM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOOM_VERSION_MAJOR 0
#define LOOM_VERSION_MINOR 1
#define LOOM_VERSION_PATCH 0

typedef enum loom_status {
    LOOM_OK = 0,
    LOOM_ERR_INVALID_ARG,  /* a caller passed something that cannot be used */
    LOOM_ERR_IO,           /* open/read/write/mmap of a file failed */
    LOOM_ERR_FORMAT,       /* a file's contents are malformed (JSON, safetensors, ...) */
    LOOM_ERR_CONFIG,       /* a configuration is missing a field or has a bad value */
    LOOM_ERR_UNSUPPORTED,  /* well-formed, but not something loom implements */
    LOOM_ERR_SHAPE,        /* tensor shapes or sizes do not agree */
    LOOM_ERR_NOT_FOUND,    /* a named tensor, file or key does not exist */
    LOOM_ERR_OOM,          /* an allocation failed */
    LOOM_ERR_DEVICE,       /* CUDA / cuBLASLt / cuDNN error */
    LOOM_ERR_COMM,         /* a collective failed or timed out */
    LOOM_ERR_INTERNAL,     /* a broken invariant inside loom: a bug */
    LOOM_STATUS_COUNT
} loom_status;

typedef enum loom_dtype {
    LOOM_F32 = 0,
    LOOM_BF16,
    LOOM_F16,
    LOOM_F64,
    LOOM_I64,
    LOOM_I32,
    LOOM_I16,
    LOOM_I8,
    LOOM_U8,
    LOOM_BOOL,
    LOOM_DTYPE_COUNT
} loom_dtype;

typedef enum loom_log_level {
    LOOM_LOG_ERROR = 0,
    LOOM_LOG_WARN,
    LOOM_LOG_INFO,
    LOOM_LOG_DEBUG
} loom_log_level;

typedef struct loom_ctx loom_ctx;

/* Context: last-error text, rank, logging. */
loom_status loom_ctx_create(loom_ctx **out);
void loom_ctx_free(loom_ctx *ctx);
const char *loom_last_error(const loom_ctx *ctx);
void loom_clear_error(loom_ctx *ctx);
/* Rank and world size, used to prefix log lines ("[rank 3/8]"). */
void loom_ctx_set_rank(loom_ctx *ctx, int rank, int world_size);
void loom_ctx_set_log_level(loom_ctx *ctx, loom_log_level level);
loom_log_level loom_ctx_log_level(const loom_ctx *ctx);

const char *loom_status_str(loom_status st);
const char *loom_version(void);

/* dtypes: names as safetensors spells them ("F32", "BF16", ...). */
const char *loom_dtype_name(loom_dtype dt);
size_t loom_dtype_size(loom_dtype dt);
/* Returns 0 and sets *out when the name is known, -1 otherwise. */
int loom_dtype_from_name(const char *name, loom_dtype *out);

#ifdef __cplusplus
}
#endif
#endif /* LOOM_H */
