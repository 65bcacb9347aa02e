/* `loom golden` runs of a model on a batch, one process or ranks under
 * mpirun, and the comparison of a layout's output with one process's: what
 * the layout tests of the model families share (test_qwen35*.c). */
#ifndef LOOM_TEST_GOLDEN_H
#define LOOM_TEST_GOLDEN_H

#include <stdint.h>

#include "../../src/io/safetensors.h"
#include "../harness.h"

/* max |a - b| / max |b| over every tensor of ref whose name starts with
 * prefix, against got's of the same name; *n counts them (INFINITY: one
 * missing or unreadable in got). */
double loom_test_worst_rel(loom_ctx *ctx, loom_safetensors *got, loom_safetensors *ref,
                           const char *prefix, int *n);

/* `loom golden` of model dir on batch (3 AdamW steps at lr 1e-3, fp32 on
 * the CPU) into out: one process (np 0) or np ranks under mpirun, with the
 * layout's flags (NULL-terminated; NULL: none). Returns the exit code and
 * prints the log of a failed run. */
int loom_test_golden(int np, const char *dir, const char *batch, const char *out,
                     const char *const *layout);

/* A layout's golden file against one process's: the forward (loss,
 * log-probs) within 1e-5 and every gradient within tol, ngrads of them (0:
 * more than 20); prints both errors under label. */
void loom_test_compare_layout(loom_ctx *ctx, const char *out, const char *one, const char *label,
                              double tol, int ngrads);

/* A batch file dir/name.safetensors (input_ids, targets [rows, S]) of ids
 * < vocab from seed; targets the next id, -100 at each row's end. */
loom_status loom_test_write_batch(loom_ctx *ctx, const char *dir, const char *name, int64_t rows,
                                  int64_t S, int64_t vocab, uint64_t seed);
/* The same of packed documents: ndocs lengths laid row after row (each
 * row's add up to S), with cu_seqlens and position_ids, -100 at each
 * document's end. */
loom_status loom_test_write_docs_batch(loom_ctx *ctx, const char *dir, const char *name,
                                       int64_t rows, int64_t S, int64_t vocab, uint64_t seed,
                                       const int *len, int ndocs);

#endif
