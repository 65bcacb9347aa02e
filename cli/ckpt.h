/* loom train's checkpoints (cli/ckpt.c). */
#ifndef LOOM_CLI_CKPT_H
#define LOOM_CLI_CKPT_H

#include "cli.h"

/* Installs (on) or removes the SIGTERM/SIGINT handler that asks the run to
 * save and stop after the current step. */
void loom_cli_ckpt_signals(bool on);
/* The background writer of the checkpoints (a thread per rank). */
typedef struct loom_cli_saver loom_cli_saver;
loom_cli_saver *loom_cli_saver_new(void);
/* Collective, after every step: the signal some rank received since the
 * handler was set, or 0; and when every rank's write in flight has ended,
 * the checkpoint is committed (meta.json, the iter_ directory, the tracker,
 * --save-keep pruning). w may be NULL (no --save). */
loom_status loom_cli_ckpt_poll(loom_ctx *ctx, loom_model *m, loom_comm *world, loom_cli_saver *w,
                               int *sig);
/* Collective: waits for the write in flight and commits it; its error is
 * every rank's. */
loom_status loom_cli_saver_finish(loom_ctx *ctx, loom_model *m, loom_comm *world,
                                  loom_cli_saver *w);
/* Waits for a write in flight (not committed) and frees. */
void loom_cli_saver_free(loom_cli_saver *w);
/* Collective: a checkpoint of `step` under s->save. After the previous one
 * is committed, each rank copies its part of the state to host memory (the
 * pause) and writes it in the background; loom_cli_ckpt_poll commits. */
loom_status loom_cli_ckpt_save(loom_ctx *ctx, loom_model *m, loom_comm *world,
                               const loom_settings *s, loom_cli_saver *w, int64_t step,
                               const loom_train_progress *p);
/* Collective: the state of s->load's checkpoint (the newest complete one of
 * a root, or an iter_ directory); *p the progress to continue from (all
 * zero with --finetune). */
loom_status loom_cli_ckpt_load(loom_ctx *ctx, loom_model *m, const loom_settings *s,
                               loom_train_progress *p);

#endif /* LOOM_CLI_CKPT_H */
