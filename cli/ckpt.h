/* loom train's checkpoints (cli/ckpt.c). */
#ifndef LOOM_CLI_CKPT_H
#define LOOM_CLI_CKPT_H

#include "cli.h"

/* Installs (on) or removes the SIGTERM/SIGINT handler that asks the run to
 * save and stop after the current step. */
void loom_cli_ckpt_signals(bool on);
/* Collective: the signal some rank received since the handler was set, or 0. */
loom_status loom_cli_ckpt_stop_asked(loom_comm *world, int *sig);
/* The background writer of rank 0's checkpoints. */
typedef struct loom_cli_saver loom_cli_saver;
loom_cli_saver *loom_cli_saver_new(void);
/* Collective: waits for the write in flight; its error is every rank's. */
loom_status loom_cli_saver_finish(loom_ctx *ctx, loom_comm *world, loom_cli_saver *w);
void loom_cli_saver_free(loom_cli_saver *w);
/* Collective: a checkpoint of `step` under s->save. The state is copied to
 * rank 0's host memory (the pause), then written whole in the background
 * (iter_ directory, tracker, --save-keep pruning) after the previous write
 * has finished. */
loom_status loom_cli_ckpt_save(loom_ctx *ctx, loom_model *m, loom_comm *world,
                               const loom_settings *s, loom_cli_saver *w, int64_t step,
                               const loom_train_progress *p);
/* Collective: the state of s->load's checkpoint (the newest complete one of
 * a root, or an iter_ directory); *p the progress to continue from (all
 * zero with --finetune). */
loom_status loom_cli_ckpt_load(loom_ctx *ctx, loom_model *m, const loom_settings *s,
                               loom_train_progress *p);

#endif /* LOOM_CLI_CKPT_H */
