/* loom train's checkpoints: --save / --save-interval / --save-keep, --load /
 * --finetune, and the save a SIGTERM or SIGINT asks for. The state is the
 * library's (loom_model_save_state: whole tensors, any mesh loads them);
 * the directories are src/io/ckpt_dir.c's (written whole, crash-safe);
 * this file decides when, and puts the data loader's position in. */
#include <pthread.h>
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

/* ---- the background writer (Megatron's async save): rank 0 writes the
 * snapshot's files, commits the iter_ directory and prunes on a thread of
 * its own while training goes on; a second save waits for the first ---- */
struct loom_cli_saver {
    pthread_t th;
    bool running;
    loom_ctx *ctx;              /* the thread's own */
    loom_state_snapshot *sn;
    loom_ckpt_tx tx;
    const loom_settings *s;
    int64_t step;
    double t0, took;
    loom_status st;
};

static void *writer_main(void *arg) {
    loom_cli_saver *w = arg;
    loom_status st = loom_state_snapshot_write(w->ctx, w->sn, w->tx.path);
    if (st) loom_ckpt_abort(&w->tx);
    else st = loom_ckpt_commit(w->ctx, &w->tx);
    if (!st && w->s->save_keep > 0) st = loom_ckpt_prune(w->ctx, w->s->save, (int)w->s->save_keep);
    loom_state_snapshot_free(w->sn);
    w->sn = NULL;
    w->took = loom_now_s() - w->t0;
    w->st = st;
    return NULL;
}

loom_cli_saver *loom_cli_saver_new(void) { return calloc(1, sizeof(loom_cli_saver)); }

/* Waits for the write in flight (rank 0), logging it; its error, if any,
 * becomes this context's. */
static loom_status saver_join(loom_ctx *ctx, loom_cli_saver *w) {
    if (!w || !w->running) return LOOM_OK;
    pthread_join(w->th, NULL);
    w->running = false;
    char name[32];
    loom_ckpt_iter_name(w->step, name);
    if (w->st) {
        loom_errf(ctx, w->st, "writing checkpoint %s/%s: %s", w->s->save, name,
                  loom_last_error(w->ctx));
    } else {
        LOOM_LOG_I(ctx, "checkpoint %s/%s written (%.2f s in the background)", w->s->save, name,
                   w->took);
    }
    loom_ctx_free(w->ctx);
    w->ctx = NULL;
    return w->st;
}

loom_status loom_cli_saver_finish(loom_ctx *ctx, loom_comm *world, loom_cli_saver *w) {
    loom_status st = saver_join(ctx, w);
    return agree(ctx, world, st, "writing the last checkpoint");
}

void loom_cli_saver_free(loom_cli_saver *w) {
    if (!w) return;
    if (w->running) pthread_join(w->th, NULL);
    loom_state_snapshot_free(w->sn);
    loom_ckpt_abort(&w->tx);
    loom_ctx_free(w->ctx);
    free(w);
}

loom_status loom_cli_ckpt_save(loom_ctx *ctx, loom_model *m, loom_comm *world,
                               const loom_settings *s, loom_cli_saver *w, int64_t step,
                               const loom_train_progress *p) {
    const bool writer = !world || loom_comm_rank(world) == 0;
    /* the previous write first (a second save waits for the first) */
    loom_status st = writer ? saver_join(ctx, w) : LOOM_OK;
    memset(&w->tx, 0, sizeof w->tx);
    if (!st && writer) st = loom_ckpt_begin(ctx, s->save, step, &w->tx);
    if ((st = agree(ctx, world, st, "starting the checkpoint"))) {
        loom_ckpt_abort(&w->tx);
        return st;
    }
    const double t0 = loom_now_s();
    loom_state_snapshot *sn = NULL;
    st = loom_state_snapshot_take(m, p, 1, &sn);
    const double paused = loom_now_s() - t0;
    if (writer && !st) {
        w->sn = sn, w->s = s, w->step = step, w->t0 = loom_now_s(), w->st = LOOM_OK;
        if (loom_ctx_create(&w->ctx) || pthread_create(&w->th, NULL, writer_main, w)) {
            st = loom_errf(ctx, LOOM_ERR_OOM, "cannot start the checkpoint writer thread");
            loom_ctx_free(w->ctx);
            w->ctx = NULL;
        } else {
            w->running = true;
            sn = NULL;
        }
    }
    loom_state_snapshot_free(sn); /* other ranks hold nothing */
    if (writer && st) loom_ckpt_abort(&w->tx);
    if ((st = agree(ctx, world, st, "copying the state for the checkpoint"))) return st;
    char name[32];
    loom_ckpt_iter_name(step, name);
    LOOM_LOG_I(ctx, "checkpoint %s/%s: state copied in %.2f s (the step's pause); writing in the "
               "background", s->save, name, paused);
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
