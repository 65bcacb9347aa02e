/* The loom command: shared helpers of the subcommands. Only cli/ exits. */
#ifndef LOOM_CLI_H
#define LOOM_CLI_H

#include "loom.h"
#include "../src/loom_cli.h" /* the library's interface for the CLI */

typedef struct loom_cli_cmd {
    const char *name;
    unsigned mask;     /* LOOM_CMD_* */
    const char *usage; /* "inspect [MODEL_DIR] [options]" */
    const char *about;
    int (*run)(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
    int max_positional;
} loom_cli_cmd;

/* Prints "loom: error: <last error>" and returns the exit code 1. */
int loom_cli_fail(loom_ctx *ctx);
/* Maps a save_dtype setting to a dtype; "auto" gives `fallback`. */
loom_dtype loom_cli_save_dtype(const loom_settings *s, loom_dtype fallback);

/* Resolves --device auto (to cuda when loom has CUDA and a GPU is visible,
 * else cpu; s->device is rewritten), then makes the job's world group: NCCL
 * for GPU ranks (bootstrapped by MPI under mpirun, else RANK/WORLD_SIZE and
 * a TCP rendezvous), MPI for CPU ranks under mpirun, else one process. Ranks
 * other than 0 log warnings and errors only. */
loom_status loom_cli_world(loom_ctx *ctx, loom_settings *s, loom_comm **out);
/* Ends the whole job with this rank's message (MPI_Abort) when there are
 * several ranks, else prints the error; returns the exit code 1. */
int loom_cli_fail_job(loom_ctx *ctx, loom_comm *world);
/* Model options (config overrides, mesh, device, dtype) from the settings
 * (after loom_cli_world resolved the device). */
void loom_cli_model_options(const loom_settings *s, loom_model_options *o);
/* The model's mesh (loom_model_get_mesh) in loom_mesh_describe's words. */
const char *loom_cli_mesh_describe(const loom_model *m, char *buf, size_t cap);

/* Device memory per rank for the run the settings describe (micro-batch
 * shape, dtype, LoRA) on mesh n with n_micro micro-batches per step. */
loom_status loom_cli_predict_memory(loom_ctx *ctx, const loom_settings *s,
                                    const loom_model_config *cfg, const loom_mesh_sizes *n,
                                    bool cuda, int n_micro, loom_mem_report *r);

/* --nproc-per-node N (cli/launch.c): this process starts N local workers
 * (GPU ranks over NCCL) and waits for them, torchrun-style. Called by train
 * and golden right after their settings are parsed. When there is nothing
 * to launch (nproc_per_node 0, or this process is a worker: LOOM_LAUNCHED
 * is set) sets *launched = false and returns 0: go on. Otherwise sets
 * *launched = true and returns the exit code of the command: the job's
 * status, or 1 after printing why the workers could not be started (inside
 * another launcher, --device cpu, no CUDA, too few GPUs). */
int loom_cli_maybe_launch(loom_ctx *ctx, const loom_settings *s, bool *launched);
/* Starts nproc copies of `exe` with `argv` (argv[0] included, NULL-ended),
 * each with RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = nproc,
 * GROUP_RANK=0, MASTER_ADDR (kept, else 127.0.0.1), MASTER_PORT (kept, else
 * a free port) and LOOM_LAUNCHED=1, sharing this process's stdout/stderr,
 * and waits for all. The first that exits non-zero or dies of a signal is
 * named on stderr, the others get SIGTERM, then SIGKILL 10 s later; SIGINT
 * and SIGTERM received meanwhile are passed on. Returns the first failure's
 * status (128 + signal for a death by a signal), 0 when all succeeded, or
 * -1 with the error in ctx when they could not be started (any started are
 * stopped and reaped first). */
int loom_launch_local(loom_ctx *ctx, int nproc, char *const argv[], const char *exe);

int loom_cmd_train(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
/* convert --from-checkpoint (cli/convert_ckpt.c) */
int loom_cmd_convert_checkpoint(loom_ctx *ctx, loom_settings *s);
int loom_cmd_golden(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_inspect(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_init(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_convert(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_data(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_tokenize(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_plot(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);

#endif
