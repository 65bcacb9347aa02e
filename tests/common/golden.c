/* `loom golden` runs and their comparison (golden.h). */
#include "golden.h"

#include <math.h>
#include <stdlib.h>

#include "../../src/core/rng.h"
#include "../../src/io/safetensors.h"

/* max |a - b| / max |b| of every tensor of ref named `prefix`*, against
 * got's of the same name; *n counts them (INFINITY: one missing) */
double loom_test_worst_rel(loom_ctx *ctx, loom_safetensors *got, loom_safetensors *ref,
                           const char *prefix, int *n) {
    double worst = 0.0;
    for (size_t i = 0; i < loom_st_count(ref); i++) {
        const loom_st_tensor *r = loom_st_at(ref, i), *g = NULL;
        if (strncmp(r->name, prefix, strlen(prefix))) continue;
        if (!(g = loom_st_find(got, r->name)) || g->numel != r->numel) return INFINITY;
        float *a = malloc(r->numel * 4), *b = malloc(r->numel * 4);
        double md = 0.0, mr = 0.0;
        if (!loom_st_read(ctx, g, LOOM_F32, a, r->numel) &&
            !loom_st_read(ctx, r, LOOM_F32, b, r->numel))
            for (uint64_t k = 0; k < r->numel; k++) {
                md = fmax(md, fabs((double)a[k] - b[k]));
                mr = fmax(mr, fabs((double)b[k]));
            }
        else
            md = INFINITY;
        worst = fmax(worst, md / (mr > 0 ? mr : 1.0));
        (*n)++;
        free(a), free(b);
    }
    return worst;
}

/* `loom golden` of model dir on batch: one process (np 0) or np ranks
 * under mpirun with the layout's flags (NULL-terminated) into out */
int loom_test_golden(int np, const char *dir, const char *batch, const char *out,
                     const char *const *layout) {
    const char *argv[40];
    int n = 0;
    char nps[8];
    snprintf(nps, sizeof nps, "%d", np);
    if (np) argv[n++] = "mpirun", argv[n++] = "-np", argv[n++] = nps;
    const char *fixed[] = {loom_test_bin(), "golden", "--device", "cpu",  "--model",     dir,
                           "--batch",       batch,    "--out",    out,    "--steps",     "3",
                           "--lr",          "1e-3",   "--log-level", "error"};
    for (size_t k = 0; k < sizeof fixed / sizeof fixed[0]; k++) argv[n++] = fixed[k];
    for (int k = 0; layout && layout[k] && n < 39; k++) argv[n++] = layout[k];
    argv[n] = NULL;
    char *log = NULL;
    const int rc = loom_test_run(&log, argv);
    if (rc) printf("    %s\n", log ? log : "");
    free(log);
    return rc;
}

/* a layout's `loom golden` file against one process's: forward (loss,
 * log-probs) within 1e-5, every gradient within tol (ngrads of them; 0:
 * more than 20) */
void loom_test_compare_layout(loom_ctx *ctx, const char *out, const char *one, const char *label,
                              double tol, int ngrads) {
    loom_safetensors *got = NULL, *ref = NULL;
    if (!loom_st_open_file(ctx, out, &got) && !loom_st_open_file(ctx, one, &ref)) {
        int nf = 0, ng = 0;
        const double ef = fmax(loom_test_worst_rel(ctx, got, ref, "loss", &nf),
                               loom_test_worst_rel(ctx, got, ref, "token_logprobs", &nf));
        const double eg = loom_test_worst_rel(ctx, got, ref, "grad.", &ng);
        printf("    %s: forward %.3g, gradients %.3g of a tensor's largest\n", label, ef, eg);
        CHECK_MSG(ef <= 1e-5 && nf == 2, "%s: forward differs by %.3g", label, ef);
        CHECK_MSG(eg <= tol && (ngrads ? ng == ngrads : ng > 20),
                  "%s: gradients differ by %.3g (%d tensors)", label, eg, ng);
    } else {
        loom_test_fail(__FILE__, __LINE__, "%s", loom_last_error(ctx));
    }
    loom_st_close(got);
    loom_st_close(ref);
}

/* both: docs NULL (ndocs 0) for one document a row */
static loom_status write_batch(loom_ctx *ctx, const char *dir, const char *name, int64_t rows,
                               int64_t S, int64_t vocab, uint64_t seed, const int *len,
                               int ndocs) {
    const int64_t n = rows * S, sh[2] = {rows, S}, ncu = ndocs + 1;
    int32_t *ids = malloc((size_t)n * sizeof *ids), *tgt = malloc((size_t)n * sizeof *tgt);
    int32_t *pos = malloc((size_t)n * sizeof *pos), *cu = malloc((size_t)ncu * sizeof *cu);
    loom_status st = ids && tgt && pos && cu ? LOOM_OK : LOOM_ERR_OOM;
    for (int64_t i = 0; !st && i < n; i++)
        ids[i] = (int32_t)(loom_splitmix64(seed + (uint64_t)i) % (uint64_t)vocab);
    for (int64_t i = 0; !st && i < n; i++) tgt[i] = i % S == S - 1 ? -100 : ids[i + 1];
    int64_t at = 0;
    for (int d = 0; !st && d < ndocs; d++) {
        cu[d] = (int32_t)at;
        for (int j = 0; j < len[d]; j++) pos[at + j] = j;
        at += len[d];
        tgt[at - 1] = -100;
    }
    if (!st && ndocs) cu[ndocs] = (int32_t)at;
    if (!st && ndocs && at != n)
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG, "documents of %lld tokens for %lld",
                       (long long)at, (long long)n);
    loom_st_writer *w = NULL;
    if (!st) st = loom_st_writer_create(ctx, dir, name, 0, NULL, &w);
    if (!st) st = loom_st_writer_declare(ctx, w, "input_ids", LOOM_I64, 2, sh);
    if (!st) st = loom_st_writer_declare(ctx, w, "targets", LOOM_I64, 2, sh);
    if (!st && ndocs) st = loom_st_writer_declare(ctx, w, "position_ids", LOOM_I64, 2, sh);
    if (!st && ndocs) st = loom_st_writer_declare(ctx, w, "cu_seqlens", LOOM_I32, 1, &ncu);
    if (!st) st = loom_st_writer_write(ctx, w, "input_ids", LOOM_I32, ids);
    if (!st) st = loom_st_writer_write(ctx, w, "targets", LOOM_I32, tgt);
    if (!st && ndocs) st = loom_st_writer_write(ctx, w, "position_ids", LOOM_I32, pos);
    if (!st && ndocs) st = loom_st_writer_write(ctx, w, "cu_seqlens", LOOM_I32, cu);
    if (!st) st = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    free(ids), free(tgt), free(pos), free(cu);
    return st;
}

loom_status loom_test_write_batch(loom_ctx *ctx, const char *dir, const char *name, int64_t rows,
                                  int64_t S, int64_t vocab, uint64_t seed) {
    return write_batch(ctx, dir, name, rows, S, vocab, seed, NULL, 0);
}

loom_status loom_test_write_docs_batch(loom_ctx *ctx, const char *dir, const char *name,
                                       int64_t rows, int64_t S, int64_t vocab, uint64_t seed,
                                       const int *len, int ndocs) {
    return write_batch(ctx, dir, name, rows, S, vocab, seed, len, ndocs);
}
