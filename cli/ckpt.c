/* loom train's checkpoints: --save / --save-interval / --save-keep, --load /
 * --finetune, and the save a SIGTERM or SIGINT asks for. The state is the
 * library's (loom_state_snapshot_*: a file per rank, any mesh loads them);
 * the directories are src/io/ckpt_dir.c's (written whole, crash-safe);
 * this file decides when, and puts the data loader's position in. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

static loom_status verify(loom_ctx *ctx, const char *dir, void *u) {
    (void)u;
    return loom_verify_state(ctx, dir);
}

/* ---- the background writer (Megatron's async save): each rank writes its
 * file on a thread of its own while training goes on; once every rank's
 * write has ended (asked after each step), meta.json, the iter_ directory
 * and the tracker are committed; a second save waits for the first ---- */
struct loom_cli_saver {
    pthread_t th;
    bool running;               /* a write in flight, not yet committed */
    atomic_int ended;           /* the thread returned */
    loom_ctx *tctx;             /* the thread's own */
    loom_state_snapshot *sn;    /* kept: the next take reuses its buffers */
    loom_ckpt_tx tx;            /* rank 0 */
    char *path;                 /* the temporary directory (every rank) */
    const loom_settings *s;
    int64_t step;
    double t0, took;
    loom_status wst;            /* the write's */
};

static void *writer_main(void *arg) {
    loom_cli_saver *w = arg;
    w->wst = loom_state_snapshot_write(w->tctx, w->sn, w->path);
    w->took = loom_now_s() - w->t0;
    atomic_store(&w->ended, 1);
    return NULL;
}

loom_cli_saver *loom_cli_saver_new(void) { return calloc(1, sizeof(loom_cli_saver)); }

/* Collective: waits for this rank's write, then commits: every rank's
 * verdict and checksum to rank 0, which writes meta.json, moves the
 * directory into place, points the tracker at it and prunes. */
static loom_status saver_commit(loom_ctx *ctx, loom_model *m, loom_comm *world,
                                loom_cli_saver *w) {
    if (!w || !w->running) return LOOM_OK;
    pthread_join(w->th, NULL);
    w->running = false;
    const bool rank0 = !world || loom_comm_rank(world) == 0;
    char name[32];
    loom_ckpt_iter_name(w->step, name);
    loom_status st = w->wst;
    if (st) loom_errf(ctx, st, "writing checkpoint %s/%s: %s", w->s->save, name,
                      loom_last_error(w->tctx));
    st = loom_state_snapshot_commit(m, w->sn, w->path);
    if (rank0) {
        if (st) loom_ckpt_abort(&w->tx);
        else st = loom_ckpt_commit(ctx, &w->tx);
        if (!st && w->s->save_keep > 0)
            st = loom_ckpt_prune(ctx, w->s->save, (int)w->s->save_keep);
    }
    free(w->path);
    w->path = NULL;
    loom_ctx_free(w->tctx);
    w->tctx = NULL;
    if ((st = loom_comm_agree_root(ctx, world, st, 0, "committing the checkpoint"))) return st;
    LOOM_LOG_I(ctx, "checkpoint %s/%s written (%.2f s in the background)", w->s->save, name,
               w->took);
    return LOOM_OK;
}

loom_status loom_cli_ckpt_poll(loom_ctx *ctx, loom_model *m, loom_comm *world, loom_cli_saver *w,
                               int *sig) {
    int32_t v[2] = {(int32_t)stop_signal, w && w->running && !atomic_load(&w->ended)};
    if (world && loom_comm_size(world) > 1) {
        loom_status st = loom_comm_allreduce(world, v, 2, LOOM_I32, LOOM_RED_MAX);
        if (st) return st;
    }
    *sig = (int)v[0];
    return w && w->running && !v[1] ? saver_commit(ctx, m, world, w) : LOOM_OK;
}

loom_status loom_cli_saver_finish(loom_ctx *ctx, loom_model *m, loom_comm *world,
                                  loom_cli_saver *w) {
    return saver_commit(ctx, m, world, w);
}

void loom_cli_saver_free(loom_cli_saver *w) {
    if (!w) return;
    if (w->running) pthread_join(w->th, NULL);
    loom_state_snapshot_free(w->sn);
    loom_ckpt_abort(&w->tx);
    loom_ctx_free(w->tctx);
    free(w->path);
    free(w);
}

/* Rank 0's temporary directory, on every rank. */
static loom_status share_path(loom_comm *world, const char *mine, char **out) {
    int64_t n = mine ? (int64_t)strlen(mine) : 0;
    const bool many = world && loom_comm_size(world) > 1;
    loom_status st = many ? loom_comm_broadcast(world, &n, 1, LOOM_I64, 0) : LOOM_OK;
    if (!st && !(*out = calloc((size_t)n + 1, 1))) st = LOOM_ERR_OOM;
    if (!st && mine) memcpy(*out, mine, (size_t)n);
    if (!st && many) st = loom_comm_broadcast(world, *out, (size_t)n, LOOM_U8, 0);
    return st;
}

loom_status loom_cli_ckpt_save(loom_ctx *ctx, loom_model *m, loom_comm *world,
                               const loom_settings *s, loom_cli_saver *w, int64_t step,
                               const loom_train_progress *p) {
    const bool rank0 = !world || loom_comm_rank(world) == 0;
    /* the previous write first (a second save waits for the first) */
    loom_status st = saver_commit(ctx, m, world, w);
    if (st) return st;
    memset(&w->tx, 0, sizeof w->tx);
    if (rank0) st = loom_ckpt_begin(ctx, s->save, step, &w->tx);
    if (!(st = loom_comm_agree_root(ctx, world, st, 0, "starting the checkpoint")))
        st = share_path(world, rank0 ? w->tx.path : NULL, &w->path);
    if (st) {
        loom_ckpt_abort(&w->tx);
        return st;
    }
    const double t0 = loom_now_s();
    st = loom_state_snapshot_take(m, p, 1, &w->sn);
    const double paused = loom_now_s() - t0;
    w->s = s, w->step = step, w->t0 = loom_now_s();
    atomic_store(&w->ended, 0);
    if (!st && (loom_ctx_create(&w->tctx) || pthread_create(&w->th, NULL, writer_main, w))) {
        st = loom_errf(ctx, LOOM_ERR_OOM, "cannot start the checkpoint writer thread");
        loom_ctx_free(w->tctx);
        w->tctx = NULL;
    }
    w->running = !st;
    if ((st = loom_comm_agree_all(ctx, world, st, "copying the state for the checkpoint")))
        return st;
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
