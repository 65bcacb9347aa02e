/* loom train's checkpoints: --save / --save-interval / --save-keep, --load /
 * --finetune, and the save a SIGTERM or SIGINT asks for. The state is the
 * library's (loom_model_save_state: whole tensors, any mesh loads them);
 * the directories are src/io/ckpt_dir.c's (written whole, crash-safe);
 * this file decides when, and puts the data loader's position in. */
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "../src/io/ckpt_dir.h"
#include "ckpt.h"

/* ---- the stop a signal asks for: the handler records, the loop acts ---- */
static volatile sig_atomic_t stop_signal;

static void on_stop(int sig) { stop_signal = sig; }

void loom_cli_ckpt_signals(bool on) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on ? on_stop : SIG_DFL;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (!on) stop_signal = 0;
}

/* Whether any rank received SIGTERM or SIGINT (the signal, else 0): every
 * rank asks after every step, so all stop after the same one. */
loom_status loom_cli_ckpt_stop_asked(loom_comm *world, int *sig) {
    int32_t v = (int32_t)stop_signal;
    if (world && loom_comm_size(world) > 1) {
        loom_status st = loom_comm_allreduce(world, &v, 1, LOOM_I32, LOOM_RED_MAX);
        if (st) return st;
    }
    *sig = (int)v;
    return LOOM_OK;
}

/* Rank 0's status is every rank's. */
static loom_status agree(loom_ctx *ctx, loom_comm *world, loom_status st, const char *what) {
    if (!world || loom_comm_size(world) == 1) return st;
    int32_t v = (int32_t)st;
    loom_status cs = loom_comm_broadcast(world, &v, 1, LOOM_I32, 0);
    if (cs) return cs;
    if (loom_comm_rank(world) != 0 && v)
        return loom_errf(ctx, (loom_status)v, "%s failed on rank 0 (its message says why)", what);
    return st;
}

static loom_status verify(loom_ctx *ctx, const char *dir, void *u) {
    (void)u;
    return loom_verify_state(ctx, dir);
}

loom_status loom_cli_ckpt_save(loom_ctx *ctx, loom_model *m, loom_comm *world,
                               const loom_settings *s, int64_t step,
                               const loom_train_progress *p) {
    const bool writer = !world || loom_comm_rank(world) == 0;
    loom_ckpt_tx tx;
    memset(&tx, 0, sizeof tx);
    loom_status st = writer ? loom_ckpt_begin(ctx, s->save, step, &tx) : LOOM_OK;
    if ((st = agree(ctx, world, st, "starting the checkpoint"))) {
        loom_ckpt_abort(&tx);
        return st;
    }
    const double t0 = loom_now_s();
    st = loom_model_save_state(m, writer ? tx.path : s->save, p, 1);
    if (writer) {
        if (st) loom_ckpt_abort(&tx);
        else st = loom_ckpt_commit(ctx, &tx);
        if (!st && s->save_keep > 0) st = loom_ckpt_prune(ctx, s->save, (int)s->save_keep);
    }
    if ((st = agree(ctx, world, st, "saving the checkpoint"))) return st;
    char name[32];
    loom_ckpt_iter_name(step, name);
    LOOM_LOG_I(ctx, "saved checkpoint %s/%s in %.2f s", s->save, name, loom_now_s() - t0);
    return LOOM_OK;
}

loom_status loom_cli_ckpt_load(loom_ctx *ctx, loom_model *m, const loom_settings *s,
                               loom_train_progress *p) {
    char dir[4096];
    int64_t it = 0;
    loom_status st = loom_ckpt_find(ctx, s->load, verify, NULL, dir, sizeof dir, &it);
    if (st) return st;
    if ((st = loom_model_load_state(m, dir, !s->finetune, p))) return st;
    if (s->finetune) {
        memset(p, 0, sizeof *p);
        LOOM_LOG_I(ctx, "loaded the weights of %s (--finetune: step 0, a fresh optimizer)", dir);
    } else {
        LOOM_LOG_I(ctx, "resumed from %s: step %lld, %lld samples and %lld tokens consumed", dir,
                   (long long)p->step, (long long)p->consumed_samples,
                   (long long)p->consumed_tokens);
    }
    return LOOM_OK;
}
