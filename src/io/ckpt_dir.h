/* Training checkpoint directories as Megatron lays them out, written whole
 * and safe against a crash at any moment.
 *
 * A checkpoint root DIR holds one directory per saved iteration,
 * DIR/iter_0000100 (iter_%07d), and DIR/latest_checkpointed_iteration.txt,
 * Megatron's tracker file, holding the newest complete iteration as text.
 * An iter_ directory is complete by construction: it is written under a
 * temporary name (DIR/.iter_0000100.loom-tmp-<pid>-<n>, src/io/outdir.h),
 * every file and the directory fsynced, then renamed into place (an
 * existing directory of the same iteration swapped out atomically) and DIR
 * fsynced; only then is the tracker replaced (a temporary written and
 * fsynced, renamed over it, DIR fsynced). So after a kill -9 anywhere the
 * tracker is absent or names a complete checkpoint, and the next begin
 * removes the temporaries that dead processes left (of any iteration).
 * Pruning moves a directory to a temporary name before deleting it, so a
 * half-deleted checkpoint never carries an iter_ name either.
 *
 * Limits: where renameat2(RENAME_EXCHANGE) is missing (outdir falls back to
 * rename aside, then in), a re-save of the very iteration the tracker names
 * has an instant in which that directory is absent; a kill then leaves it
 * under .iter_N.loom-old-* and loom_ckpt_find says the directory is missing.
 * Dead savers are recognised by pid on this host: one process (rank 0)
 * begins, commits and prunes; ranks that write files into tx->path should
 * fsync their own files before rank 0 commits when they are on other hosts. */
#ifndef LOOM_CKPT_DIR_H
#define LOOM_CKPT_DIR_H

#include "outdir.h"

#define LOOM_CKPT_TRACKER "latest_checkpointed_iteration.txt"

/* "iter_0000100" for 100 (iter_%07d; more digits past 9,999,999). */
void loom_ckpt_iter_name(int64_t iteration, char name[32]);

typedef struct loom_ckpt_tx {
    int64_t iteration;
    char *root;   /* the checkpoint root */
    char *dest;   /* root/iter_NNNNNNN, where commit puts it */
    char *path;   /* the temporary directory: write the checkpoint's files here */
    loom_out out; /* the write in progress (outdir) */
} loom_ckpt_tx;

/* Starts the checkpoint of `iteration` (>= 0) under root: creates root
 * (mkdir -p) if missing, removes the temporaries of dead savers, makes the
 * temporary directory tx->path. A root that is a file, lies under a file or
 * cannot be written is refused, named. */
loom_status loom_ckpt_begin(loom_ctx *ctx, const char *root, int64_t iteration,
                            loom_ckpt_tx *tx);
/* fsyncs everything under tx->path, moves it to root/iter_NNNNNNN
 * (replacing one of the same iteration), then points the tracker at it.
 * Frees tx, also on failure (then the temporary is removed; whatever was
 * in place stays). */
loom_status loom_ckpt_commit(loom_ctx *ctx, loom_ckpt_tx *tx);
/* Removes the temporary and frees tx (safe on a zeroed or freed tx). */
void loom_ckpt_abort(loom_ckpt_tx *tx);

/* The complete iterations under root (iter_ directories), ascending, in a
 * new array (*iters NULL when there are none). */
loom_status loom_ckpt_list(loom_ctx *ctx, const char *root, int64_t **iters, size_t *n);
/* The tracker's iteration; -1 when root has no tracker. A tracker that does
 * not hold an iteration number is an error naming its contents. */
loom_status loom_ckpt_tracker(loom_ctx *ctx, const char *root, int64_t *iteration);

/* Keeps the newest `keep` complete iterations under root (keep <= 0: all)
 * and the one the tracker names, removes the older ones. */
loom_status loom_ckpt_prune(loom_ctx *ctx, const char *root, int keep);

/* Checks a complete checkpoint's contents (checksums, meta.json): LOOM_OK,
 * or an error in ctx saying what is wrong. */
typedef loom_status (*loom_ckpt_verify_fn)(loom_ctx *ctx, const char *iter_dir, void *u);

/* The checkpoint to load from `path`: a root (the one its tracker names) or
 * an iter_ directory (that one). Writes its directory to out_dir (cap
 * bytes) and its iteration. Refused, with the complete ones that exist
 * named: a root without tracker, a tracker naming a missing directory. With
 * verify (may be NULL), a checkpoint that fails it is refused with the
 * problem and, for a root, the newest older checkpoint that passes, which
 * the user may pass explicitly: it is never taken silently. */
loom_status loom_ckpt_find(loom_ctx *ctx, const char *path, loom_ckpt_verify_fn verify, void *u,
                           char *out_dir, size_t cap, int64_t *iteration);

/* Test hook, read by commit and prune; only tests set it:
 *   LOOM_TEST_CKPT_KILL=<step>  the process kills itself (SIGKILL, as
 *       kill -9) at that step, after printing "loom: test hook: killed at
 *       <step>" on stderr. Steps: after_files (all fsynced, nothing moved),
 *       after_rename (the iter_ directory in place, tracker untouched),
 *       after_tracker_tmp (the new tracker written and fsynced beside the
 *       old), after_tracker (all done), prune_after_rename (a pruned
 *       directory moved aside, not yet deleted). */
#define LOOM_CKPT_KILL_ENV "LOOM_TEST_CKPT_KILL"

#endif /* LOOM_CKPT_DIR_H */
