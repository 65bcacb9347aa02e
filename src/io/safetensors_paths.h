/* Path and name helpers shared by the safetensors reader and writer
 * (safetensors.c, safetensors_writer.c); not part of the API. */
#ifndef LOOM_IO_SAFETENSORS_PATHS_H
#define LOOM_IO_SAFETENSORS_PATHS_H

#include "../core/core.h"

/* [dir/]<base><suffix> as a new string (NULL with an error set on OOM). */
char *loom_st_dir_file(loom_ctx *ctx, const char *dir, const char *base, const char *suffix);
/* The last component of a path. */
const char *loom_st_leaf(const char *path);
/* qsort comparison of two const char * (strcmp order). */
int loom_st_cmp_names(const void *a, const void *b);

#endif
