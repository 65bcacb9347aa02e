/* loom golden: one batch through the model; logits, token log-probs,
 * entropy, loss and the gradient of every trainable parameter written to a
 * safetensors file, so loom can be checked against any other implementation
 * (tests/golden_check.py compares it with transformers). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/io/safetensors.h"
#include "cli.h"

typedef struct golden_in {
    int64_t rows, seq;
    int32_t *ids, *tgt, *pos, *cu;
    int64_t ndocs;
} golden_in;

/* An integer tensor of `name` as int32 [rows, seq] (a 1-D tensor is one row). */
static loom_status read_ids(loom_ctx *ctx, const loom_safetensors *st, const char *file,
                            const char *name, bool required, golden_in *in, int32_t **out) {
    *out = NULL;
    const loom_st_tensor *t = loom_st_find(st, name);
    if (!t) {
        if (!required) return LOOM_OK;
        return loom_errf(ctx, LOOM_ERR_NOT_FOUND, "%s has no tensor '%s' (a [batch, seq_len] "
                         "integer tensor)", file, name);
    }
    if (t->ndim < 1 || t->ndim > 2 || t->numel == 0 || loom_dtype_is_float(t->dtype))
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "%s: '%s' must be a non-empty [batch, seq_len] integer tensor (I64 or "
                         "I32), got %d dimensions of %s",
                         file, name, t->ndim, loom_dtype_name(t->dtype));
    int64_t rows = t->ndim == 2 ? t->shape[0] : 1, seq = t->shape[t->ndim - 1];
    if (in->rows == 0) {
        in->rows = rows;
        in->seq = seq;
    } else if (rows != in->rows || seq != in->seq) {
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "%s: '%s' has shape [%" PRId64 ", %" PRId64 "] but input_ids has [%" PRId64
                         ", %" PRId64 "]",
                         file, name, rows, seq, in->rows, in->seq);
    }
    if (!(*out = loom_malloc(ctx, (size_t)t->numel * sizeof(int32_t), name))) return LOOM_ERR_OOM;
    return loom_st_read(ctx, t, LOOM_I32, *out, t->numel);
}

static loom_status read_batch(loom_ctx *ctx, const char *file, golden_in *in) {
    loom_safetensors *st;
    loom_status s = loom_st_open_file(ctx, file, &st);
    if (s) return s;
    if (!(s = read_ids(ctx, st, file, "input_ids", true, in, &in->ids)) &&
        !(s = read_ids(ctx, st, file, "targets", true, in, &in->tgt)))
        s = read_ids(ctx, st, file, "position_ids", false, in, &in->pos);
    const loom_st_tensor *t = loom_st_find(st, "cu_seqlens");
    if (!s && t) {
        if (t->ndim != 1 || t->numel < 2 || loom_dtype_is_float(t->dtype)) {
            s = loom_errf(ctx, LOOM_ERR_SHAPE,
                          "%s: 'cu_seqlens' must be a 1-D integer tensor of document starts "
                          "(0, ..., batch*seq_len)",
                          file);
        } else if (!(in->cu = loom_malloc(ctx, (size_t)t->numel * sizeof(int32_t), "cu_seqlens"))) {
            s = LOOM_ERR_OOM;
        } else {
            in->ndocs = (int64_t)t->numel - 1;
            s = loom_st_read(ctx, t, LOOM_I32, in->cu, t->numel);
        }
    }
    loom_st_close(st);
    return s;
}

static loom_status write_out(loom_ctx *ctx, loom_model *m, const char *out, const golden_in *in,
                             const float *logits, const float *tlp, const float *ent, double loss,
                             int64_t ntok) {
    loom_model_info info;
    loom_model_get_info(m, &info);
    /* The output file goes into the directory of `out`. */
    char *dir = loom_strdup(ctx, out);
    if (!dir) return LOOM_ERR_OOM;
    char *slash = strrchr(dir, '/');
    const char *base = slash ? slash + 1 : dir;
    if (slash) *slash = 0;
    size_t bl = strlen(base);
    loom_status s = LOOM_OK;
    if (bl < 13 || strcmp(base + bl - 12, ".safetensors"))
        s = loom_errf(ctx, LOOM_ERR_INVALID_ARG, "--out %s: give a file name ending in .safetensors",
                      out);
    char stem[512];
    if (!s) snprintf(stem, sizeof stem, "%.*s", (int)(bl - 12), base);
    loom_json *meta = s ? NULL : loom_json_new_object(ctx);
    char lbuf[64], nbuf[32];
    snprintf(lbuf, sizeof lbuf, "%.17g", loss);
    snprintf(nbuf, sizeof nbuf, "%" PRId64, ntok);
    if (!s && (!meta || loom_json_set(ctx, meta, "loss", loom_json_new_str(ctx, lbuf)) ||
               loom_json_set(ctx, meta, "n_valid_tokens", loom_json_new_str(ctx, nbuf))))
        s = LOOM_ERR_OOM;
    loom_st_writer *w = NULL;
    if (!s) s = loom_st_writer_create(ctx, slash ? dir : ".", stem, 0, meta, &w);
    loom_json_free(meta);
    int64_t sh3[3] = {in->rows, in->seq, info.vocab_size}, sh2[2] = {in->rows, in->seq};
    if (!s) s = loom_st_writer_declare(ctx, w, "logits", LOOM_F32, 3, sh3);
    if (!s) s = loom_st_writer_declare(ctx, w, "token_logprobs", LOOM_F32, 2, sh2);
    if (!s) s = loom_st_writer_declare(ctx, w, "entropy", LOOM_F32, 2, sh2);
    if (!s) s = loom_st_writer_declare(ctx, w, "loss", LOOM_F32, 0, NULL);
    char name[512];
    for (int64_t i = 0; i < info.num_tensors && !s; i++) {
        int nd;
        int64_t shape[2];
        snprintf(name, sizeof name, "grad.%s", loom_model_tensor_name(m, i, &nd, shape));
        s = loom_st_writer_declare(ctx, w, name, LOOM_F32, nd, shape);
    }
    float lossf = (float)loss;
    if (!s) s = loom_st_writer_write(ctx, w, "logits", LOOM_F32, logits);
    if (!s) s = loom_st_writer_write(ctx, w, "token_logprobs", LOOM_F32, tlp);
    if (!s) s = loom_st_writer_write(ctx, w, "entropy", LOOM_F32, ent);
    if (!s) s = loom_st_writer_write(ctx, w, "loss", LOOM_F32, &lossf);
    float *g = NULL;
    for (int64_t i = 0; i < info.num_tensors && !s; i++) {
        int nd;
        int64_t shape[2];
        const char *pn = loom_model_tensor_name(m, i, &nd, shape);
        int64_t n = nd == 2 ? shape[0] * shape[1] : shape[0];
        free(g);
        if (!(g = loom_malloc(ctx, (size_t)n * sizeof *g, "gradient"))) {
            s = LOOM_ERR_OOM;
            break;
        }
        snprintf(name, sizeof name, "grad.%s", pn);
        if (!(s = loom_model_get_grad(m, pn, g, n))) s = loom_st_writer_write(ctx, w, name, LOOM_F32, g);
    }
    free(g);
    if (!s) s = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    free(dir);
    return s;
}

int loom_cmd_golden(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (!s->model || !s->batch || !s->out) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "loom golden needs --model DIR, --batch IN.safetensors (input_ids, targets) "
                  "and --out OUT.safetensors");
        return loom_cli_fail(ctx);
    }
    loom_settings_print(ctx, s, LOOM_CMD_GOLDEN);
    golden_in in = {0};
    loom_model *m = NULL;
    float *logits = NULL, *tlp = NULL, *ent = NULL;
    int rc = 1;
    loom_status st = read_batch(ctx, s->batch, &in);
    if (st) goto done;
    loom_model_options mo;
    loom_model_options_default(&mo);
    mo.config_overrides = s->config_override;
    if ((st = loom_model_create(ctx, s->model, &mo, &m))) goto done;
    loom_model_info info;
    loom_model_get_info(m, &info);
    int64_t T = in.rows * in.seq;
    logits = loom_malloc(ctx, (size_t)(T * info.vocab_size) * sizeof(float), "logits");
    tlp = loom_malloc(ctx, (size_t)T * sizeof(float), "token log-probs");
    ent = loom_malloc(ctx, (size_t)T * sizeof(float), "entropy");
    if (!logits || !tlp || !ent) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    loom_batch b = {.rows = in.rows, .seq_len = in.seq, .input_ids = in.ids, .targets = in.tgt,
                    .cu_seqlens = in.cu, .n_docs = in.ndocs, .position_ids = in.pos};
    loom_fb_result fr;
    if ((st = loom_model_forward_only(m, &b, 1, tlp, ent, logits, &fr))) goto done;
    if ((st = loom_model_forward_backward(m, &b, 1, &fr))) goto done;
    if (fr.n_tokens == 0) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "%s: every target is -100, so there is no loss and no gradient", s->batch);
        goto done;
    }
    if ((st = write_out(ctx, m, s->out, &in, logits, tlp, ent, fr.loss, fr.n_tokens))) goto done;
    LOOM_LOG_I(ctx, "loss %.9g over %" PRId64 " tokens; wrote %s", fr.loss, fr.n_tokens, s->out);
    rc = 0;
done:
    if (rc) loom_cli_fail(ctx);
    loom_model_free(m);
    free(in.ids);
    free(in.tgt);
    free(in.pos);
    free(in.cu);
    free(logits);
    free(tlp);
    free(ent);
    return rc;
}
