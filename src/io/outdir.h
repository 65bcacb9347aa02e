/* Outputs (model directories, adapter directories, single files) checked
 * before any work and written whole.
 *
 * Check first: loom_out_check says, before a model is loaded or a step is
 * run, whether a destination can take an output of about est_bytes: it is
 * refused when a file stands where a directory must be (or the reverse), a
 * parent is a file, the place cannot be written (permissions, a read-only
 * file system), the file system has too little free space (the estimate
 * plus 10% and 16 MiB), or an existing directory holds anything but the
 * files of a model or adapter directory (config.json, adapter_config.json,
 * *.safetensors, the index, the tokenizer files): saving replaces the whole
 * directory, so `--save-hf ~` is refused, naming the files. Missing parents
 * are fine: they are created (mkdir -p) when the output is written.
 *
 * Write whole: loom_out_begin makes a temporary directory beside the
 * destination (.<name>.loom-tmp-<pid>-<n>, same file system); everything is
 * written into it; loom_out_commit fsyncs every file and the directory,
 * then moves it into place (an existing directory is swapped out with
 * renameat2(RENAME_EXCHANGE), or renamed away first where that is not
 * supported, then removed; a single file is renamed over the old one) and
 * fsyncs the parent. So a destination is always absent, the complete old
 * output or the complete new one, and a re-save leaves no stale shards.
 * loom_out_begin also removes the temporaries of earlier saves to the same
 * destination whose process is gone (killed, out of disk): names of loom's
 * own pattern whose pid is not alive on this host. */
#ifndef LOOM_OUTDIR_H
#define LOOM_OUTDIR_H

#include "../core/core.h"

typedef enum loom_out_kind {
    LOOM_OUT_DIR = 0, /* a model or adapter directory */
    LOOM_OUT_FILE,    /* one file (loom golden --out) */
    LOOM_OUT_TREE,    /* a directory loom owns whole (a checkpoint's iter_ directory):
                       * an existing one is replaced without looking at its entries */
} loom_out_kind;

/* `what` names the destination in messages ("--save-hf"; NULL: "output").
 * est_bytes 0: no free-space check. Creates nothing. */
loom_status loom_out_check(loom_ctx *ctx, const char *what, const char *path, loom_out_kind kind,
                           uint64_t est_bytes);

typedef struct loom_out {
    loom_out_kind kind;
    char *dest;   /* the destination (a symbolic link resolved) */
    char *parent; /* its directory */
    char *tmp;    /* the temporary directory: write everything here */
    char *file;   /* LOOM_OUT_FILE: tmp/<name of dest>, the file to write */
    bool synced;  /* loom_out_sync ran: commit does not fsync again */
} loom_out;

/* Checks (as loom_out_check, no space check), creates the parents, removes
 * stale temporaries, makes the temporary directory. */
loom_status loom_out_begin(loom_ctx *ctx, const char *what, const char *path, loom_out_kind kind,
                           loom_out *o);
/* Moves the finished output into place (see above) and frees o. On failure
 * the temporary is removed and the destination is left as it was. */
loom_status loom_out_commit(loom_ctx *ctx, loom_out *o);
/* Removes the temporary and frees o (safe on a zeroed or freed o). */
void loom_out_abort(loom_out *o);
/* fsyncs every file under o->tmp (subdirectories included) and the
 * directories, as commit does first; for a caller that must know the data
 * is durable before the move (commit then skips it). */
void loom_out_sync(loom_ctx *ctx, loom_out *o);

/* Removes, in parent, the temporaries of earlier saves whose process is
 * gone: ".<name>.loom-tmp-<pid>-*" and ".<name>.loom-old-<pid>-*" for this
 * exact name, or (prefix) for every name starting with it. */
void loom_out_remove_stale(loom_ctx *ctx, const char *parent, const char *name, bool prefix);
/* Renames path to a hidden temporary beside it (.<name>.loom-old-<pid>-<n>,
 * which loom_out_remove_stale clears once this process is gone); *aside: that
 * name, to remove with loom_out_rm_rf. A crash leaves path whole, or the
 * temporary. */
loom_status loom_out_move_aside(loom_ctx *ctx, const char *path, char **aside);
/* rm -rf, links not followed; silent (what cannot be removed stays). */
void loom_out_rm_rf(const char *path);

/* Copies the tokenizer and other files that travel with the weights from
 * from_dir (those that exist) into to_dir. */
loom_status loom_out_copy_side_files(loom_ctx *ctx, const char *from_dir, const char *to_dir);
/* Total size of those files in dir (for estimates). */
uint64_t loom_out_side_files_size(const char *dir);

/* Test hooks, read from the environment by the safetensors writer and
 * loom_out_commit; only tests set them:
 *   LOOM_TEST_SAVE_FAIL=enospc_after_bytes:N  a writer's writes fail with
 *       ENOSPC once it has written N bytes (a full disk);
 *   LOOM_TEST_SAVE_PAUSE=after_file:N  after a writer completed its N-th
 *       file, print "loom: test hook: save paused" on stderr and wait to be
 *       killed; LOOM_TEST_SAVE_PAUSE=before_move: the same in
 *       loom_out_commit, everything written, nothing moved. */
typedef struct loom_out_hooks {
    uint64_t fail_after_bytes; /* 0: none */
    int pause_after_file;      /* 0: none */
    bool pause_before_move;
} loom_out_hooks;
void loom_out_hooks_read(loom_out_hooks *h);
/* Prints the pause line (naming `where`) and waits for a signal, forever. */
void loom_out_hook_pause(const char *where);

#endif /* LOOM_OUTDIR_H */
