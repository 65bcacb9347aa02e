/* The loom command: shared helpers of the subcommands. Only cli/ exits. */
#ifndef LOOM_CLI_H
#define LOOM_CLI_H

#include "../src/core/core.h"
#include "../src/core/options.h"
#include "../src/comm/comm.h"
#include "../src/model/model.h"

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

/* The job's world group (MPI under mpirun, else one process); ranks other
 * than 0 log warnings and errors only. */
loom_status loom_cli_world(loom_ctx *ctx, loom_comm **out);
/* Ends the whole job with this rank's message (MPI_Abort) when there are
 * several ranks, else prints the error; returns the exit code 1. */
int loom_cli_fail_job(loom_ctx *ctx, loom_comm *world);
/* Model options (config overrides, mesh) from the settings. */
void loom_cli_model_options(const loom_settings *s, loom_model_options *o);

/* Copies the tokenizer and other files that travel with the weights. */
loom_status loom_cli_copy_side_files(loom_ctx *ctx, const char *from_dir, const char *to_dir);

int loom_cmd_train(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_golden(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_inspect(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_init(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_convert(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_data(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);
int loom_cmd_tokenize(loom_ctx *ctx, loom_settings *s, int npos, const char **pos);

#endif
