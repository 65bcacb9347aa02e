/* safetensors: reader (mmap, single file or sharded via
 * <base>.safetensors.index.json) and a streaming writer that splits at a
 * maximum shard size.
 *
 * File layout (https://github.com/huggingface/safetensors): 8-byte
 * little-endian header length N, N bytes of JSON header, then the data
 * buffer. The header maps tensor name -> {"dtype", "shape", "data_offsets":
 * [begin, end)} (offsets relative to the data buffer) plus an optional
 * "__metadata__" object of string -> string.
 *
 * The reader validates everything before exposing a tensor: header length
 * within the file, header is a JSON object, every entry has exactly dtype /
 * shape / data_offsets of the right types, the dtype is known, begin <= end
 * <= data size, end - begin == prod(shape) * dtype size (overflow-checked),
 * no two tensors overlap, no duplicate names (also across shards). Errors
 * name the file and the tensor.
 */
#ifndef LOOM_SAFETENSORS_H
#define LOOM_SAFETENSORS_H

#include "../core/core.h"
#include "../core/json.h"

#define LOOM_MAX_DIMS 8
/* Headers larger than this are refused (safetensors' own limit is 100 MB). */
#define LOOM_ST_MAX_HEADER (100u * 1024u * 1024u)

typedef struct loom_st_tensor {
    const char *name;
    loom_dtype dtype;
    int ndim;
    int64_t shape[LOOM_MAX_DIMS];
    uint64_t numel;
    uint64_t nbytes;
    const void *data;  /* into the mapping; may be unaligned: read with memcpy */
    int file;          /* index of the file that holds it */
    bool view;         /* part of a file's tensor, under a name of its own (loom_st_splice) */
} loom_st_tensor;

typedef struct loom_safetensors loom_safetensors;

/* Opens one .safetensors file. */
loom_status loom_st_open_file(loom_ctx *ctx, const char *path, loom_safetensors **out);
/* Opens a checkpoint in a directory: <dir>/<base>.safetensors.index.json if
 * present (every shard it names must exist and hold exactly the tensors the
 * index maps to it), else <dir>/<base>.safetensors. base is e.g. "model" or
 * "adapter_model". */
loom_status loom_st_open_dir(loom_ctx *ctx, const char *dir, const char *base,
                             loom_safetensors **out);
/* Parses an in-memory file image (not copied: buf must outlive the handle).
 * `what` names it in errors. Used by tests and the fuzzer. */
loom_status loom_st_open_buffer(loom_ctx *ctx, const void *buf, size_t len, const char *what,
                                loom_safetensors **out);
void loom_st_close(loom_safetensors *st);

/* Tensors sorted by name. */
size_t loom_st_count(const loom_safetensors *st);
const loom_st_tensor *loom_st_at(const loom_safetensors *st, size_t i);
const loom_st_tensor *loom_st_find(const loom_safetensors *st, const char *name);
size_t loom_st_file_count(const loom_safetensors *st);
const char *loom_st_file_path(const loom_safetensors *st, int file);
/* The "__metadata__" object of a file (NULL when absent). */
const loom_json *loom_st_metadata(const loom_safetensors *st, int file);
/* Sum of all tensors' bytes. */
uint64_t loom_st_total_bytes(const loom_safetensors *st);

/* Presents a checkpoint in another layout (hf_experts.c, export.c): drops
 * the ndrop tensors named in drop and adds the nadd entries of add (their
 * names are copied; data must lie in the mapping of file add[i].file; a
 * part of a file's tensor says so with .view), the list sorted again; a
 * name twice is refused as at open. On an error the handle may only be
 * closed. */
loom_status loom_st_splice(loom_ctx *ctx, loom_safetensors *st, const char *const *drop,
                           size_t ndrop, const loom_st_tensor *add, size_t nadd);

/* Copies tensor t into dst as dtype `dt` (converting when it differs, see
 * loom_convert). dst_numel must equal t->numel (else LOOM_ERR_SHAPE naming
 * the tensor). */
loom_status loom_st_read(loom_ctx *ctx, const loom_st_tensor *t, loom_dtype dt, void *dst,
                         uint64_t dst_numel);
/* Finds `name`, checks its shape equals shape[0..ndim) (LOOM_ERR_SHAPE with
 * both shapes named otherwise; LOOM_ERR_NOT_FOUND when absent), and reads it. */
loom_status loom_st_read_named(loom_ctx *ctx, const loom_safetensors *st, const char *name,
                               int ndim, const int64_t *shape, loom_dtype dt, void *dst);

/* Writer. Declare every tensor first (name, dtype, shape), then write their
 * data in declaration order; finish() completes the files. Tensors go into
 * shards in declaration order, a new shard starting when the next tensor
 * would take the current one past max_shard_bytes (0 = no limit; a tensor
 * larger than the limit gets a shard of its own). One shard is written as
 * <base>.safetensors; several as <base>-00001-of-0000N.safetensors plus
 * <base>.safetensors.index.json ({"metadata": {"total_size": ...},
 * "weight_map": {...}}). Within a file, tensors are laid out by element size
 * (largest first) then name, so every tensor is aligned to its element size;
 * the header is padded with spaces to a multiple of 8; "__metadata__" comes
 * first. Data is streamed: only one tensor is held at a time. Files are
 * written under temporary names and renamed into place by finish(). */
typedef struct loom_st_writer loom_st_writer;
/* metadata: NULL or an object of string values (copied). */
loom_status loom_st_writer_create(loom_ctx *ctx, const char *dir, const char *base,
                                  uint64_t max_shard_bytes, const loom_json *metadata,
                                  loom_st_writer **out);
loom_status loom_st_writer_declare(loom_ctx *ctx, loom_st_writer *w, const char *name,
                                   loom_dtype dt, int ndim, const int64_t *shape);
/* data holds numel elements of src_dt; converted to the declared dtype when
 * they differ. */
loom_status loom_st_writer_write(loom_ctx *ctx, loom_st_writer *w, const char *name,
                                 loom_dtype src_dt, const void *data);
/* The next numel elements of the tensor being written (the next one in
 * declaration order), in pieces: it is complete when all its elements are
 * written. A tensor begun in pieces cannot be written whole. */
loom_status loom_st_writer_write_part(loom_ctx *ctx, loom_st_writer *w, const char *name,
                                      loom_dtype src_dt, const void *data, uint64_t numel);
loom_status loom_st_writer_finish(loom_ctx *ctx, loom_st_writer *w);
/* Frees; if finish() was not reached, removes the temporary files. */
void loom_st_writer_free(loom_st_writer *w);

#endif /* LOOM_SAFETENSORS_H */
