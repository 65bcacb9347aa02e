/* loom golden: one batch through the model; logits, token log-probs,
 * entropy, loss and the gradient of every trainable parameter written to a
 * safetensors file, so loom can be checked against any other implementation
 * (tests/golden_check.py compares it with transformers). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Rank 0 writes, into a temporary file beside --out that is moved into
 * place when complete; every rank takes part in the collective gathers. */
typedef struct golden_out {
    loom_out out;      /* rank 0 only */
    loom_st_writer *w; /* rank 0 only */
    float *buf;
    size_t cap;
} golden_out;

/* --out must name a .safetensors file. */
static loom_status out_name_ok(loom_ctx *ctx, const char *out) {
    const char *slash = strrchr(out, '/');
    const char *base = slash ? slash + 1 : out;
    size_t bl = strlen(base);
    if (bl < 13 || strcmp(base + bl - 12, ".safetensors"))
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "--out %s: give a file name ending in .safetensors", out);
    return LOOM_OK;
}

/* --out checked before the model is loaded: the name, the place, and room
 * for the logits (T x vocab) and, without an adapter, every parameter's
 * gradient (and final value after AdamW steps), all F32. */
static loom_status out_check(loom_ctx *ctx, const loom_settings *s, int64_t T) {
    loom_status st = out_name_ok(ctx, s->out);
    loom_model_config cfg;
    if (st || (st = loom_model_load_config(ctx, s->model, s->config_override, &cfg))) return st;
    uint64_t est = (uint64_t)T * (uint64_t)(cfg.vocab_size + 2) * 4, params = 0;
    if (!s->adapter && !loom_hf_save_estimate(ctx, &cfg, NULL, LOOM_F32, &params))
        est += params * (s->steps ? 2 : 1);
    loom_config_free(&cfg);
    return loom_out_check(ctx, "--out", s->out, LOOM_OUT_FILE, est);
}

static loom_status out_open(loom_ctx *ctx, const char *out, golden_out *o) {
    loom_status s = loom_out_begin(ctx, "--out", out, LOOM_OUT_FILE, &o->out);
    if (s) return s;
    const char *base = strrchr(o->out.file, '/') + 1;
    char stem[512];
    snprintf(stem, sizeof stem, "%.*s", (int)(strlen(base) - 12), base);
    return loom_st_writer_create(ctx, o->out.tmp, stem, 0, NULL, &o->w);
}

static float *out_buf(golden_out *o, size_t n) {
    if (n > o->cap) {
        float *nb = realloc(o->buf, n * sizeof *nb);
        if (!nb) return NULL;
        o->buf = nb;
        o->cap = n;
    }
    return o->buf;
}

/* The i-th trainable tensor: the base model's, or with an adapter loaded
 * ("default"), the adapter's under PEFT's parameter names
 * (...lora_A.default.weight). NULL past the end. */
static const char *trainable_tensor(loom_model *m, bool lora, int64_t i, char *buf, size_t cap,
                                    int *nd, int64_t shape[2]) {
    if (!lora) {
        const char *n = loom_model_tensor_name(m, i, nd, shape);
        if (n) snprintf(buf, cap, "%s", n);
        return n ? buf : NULL;
    }
    char tmp[512];
    if (!loom_model_adapter_tensor(m, "default", i, tmp, sizeof tmp, shape)) return NULL;
    *nd = 2;
    snprintf(buf, cap, "%.*s.default.weight", (int)(strlen(tmp) - 7), tmp);
    return buf;
}

/* Gathers every parameter's gradient (grads) or value and writes it as
 * prefix<name>. */
static loom_status write_tensors(loom_ctx *ctx, loom_model *m, golden_out *o, const char *prefix,
                                 bool grads, bool lora) {
    char name[600], pbuf[512];
    int nd;
    int64_t shape[2];
    const char *pn;
    for (int64_t i = 0; (pn = trainable_tensor(m, lora, i, pbuf, sizeof pbuf, &nd, shape)); i++) {
        int64_t n = nd == 2 ? shape[0] * shape[1] : shape[0];
        float *g = out_buf(o, (size_t)n);
        if (!g) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory gathering %s", pn);
        loom_status s = grads ? loom_model_get_grad(m, pn, g, n) : loom_model_get_param(m, pn, g, n);
        if (s) return s;
        snprintf(name, sizeof name, "%s%s", prefix, pn);
        if (o->w && (s = loom_st_writer_write(ctx, o->w, name, LOOM_F32, g))) return s;
    }
    return LOOM_OK;
}

static loom_status declare_all(loom_ctx *ctx, loom_model *m, golden_out *o, const golden_in *in,
                               int64_t steps, bool lora) {
    loom_model_info info;
    loom_model_get_info(m, &info);
    int64_t sh3[3] = {in->rows, in->seq, info.vocab_size}, sh2[2] = {in->rows, in->seq};
    int64_t shs[1] = {steps};
    loom_status s = loom_st_writer_declare(ctx, o->w, "logits", LOOM_F32, 3, sh3);
    if (!s) s = loom_st_writer_declare(ctx, o->w, "token_logprobs", LOOM_F32, 2, sh2);
    if (!s) s = loom_st_writer_declare(ctx, o->w, "entropy", LOOM_F32, 2, sh2);
    if (!s) s = loom_st_writer_declare(ctx, o->w, "loss", LOOM_F32, 0, NULL);
    char name[600], pbuf[512];
    for (int pass = 0; pass < (steps ? 2 : 1) && !s; pass++) {
        if (pass) {
            s = loom_st_writer_declare(ctx, o->w, "adamw_losses", LOOM_F64, 1, shs);
            if (!s) s = loom_st_writer_declare(ctx, o->w, "adamw_grad_norms", LOOM_F64, 1, shs);
        }
        int nd;
        int64_t shape[2];
        const char *pn;
        for (int64_t i = 0; !s && (pn = trainable_tensor(m, lora, i, pbuf, sizeof pbuf, &nd, shape));
             i++) {
            snprintf(name, sizeof name, "%s%s", pass ? "final." : "grad.", pn);
            s = loom_st_writer_declare(ctx, o->w, name, LOOM_F32, nd, shape);
        }
    }
    return s;
}

/* One optimizer step's worth of calls: the batch's rows cut into `accum`
 * consecutive parts, each through forward_backward, clip_grad_and_step after
 * each (it steps at the last). */
static loom_status accumulate(loom_model *m, const golden_in *in, int64_t accum, int64_t n_micro,
                              bool step, double clip, loom_fb_result *fr, loom_step_result *sr) {
    const int64_t rows = in->rows / accum;
    double sum = 0;
    int64_t ntok = 0;
    for (int64_t k = 0; k < accum; k++) {
        const int64_t t0 = k * rows * in->seq;
        loom_batch b = {.rows = rows, .seq_len = in->seq, .input_ids = in->ids + t0,
                        .targets = in->tgt + t0, .position_ids = in->pos ? in->pos + t0 : NULL};
        /* packed documents: the part's own cu_seqlens */
        int32_t *cu = NULL;
        if (in->cu) {
            cu = malloc(sizeof *cu * (size_t)(in->ndocs + 1));
            if (!cu) return LOOM_ERR_OOM;
            int64_t nd = 0;
            cu[0] = 0;
            for (int64_t d = 1; d <= in->ndocs; d++)
                if (in->cu[d] > t0 && in->cu[d] <= t0 + rows * in->seq)
                    cu[++nd] = (int32_t)(in->cu[d] - t0);
            b.cu_seqlens = cu;
            b.n_docs = nd;
        }
        loom_fb_result r;
        loom_status s = loom_model_forward_backward(m, &b, n_micro, &r);
        free(cu);
        if (s) return s;
        sum += r.loss_sum;
        ntok += r.n_tokens;
        if (step && (s = loom_model_clip_grad_and_step(m, clip, accum, sr))) return s;
    }
    fr->loss_sum = sum;
    fr->n_tokens = ntok;
    fr->loss = ntok ? sum / (double)ntok : 0.0;
    return LOOM_OK;
}

int loom_cmd_golden(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (!s->model || !s->batch || !s->out) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "loom golden needs --model DIR, --batch IN.safetensors (input_ids, targets) "
                  "and --out OUT.safetensors");
        return loom_cli_fail(ctx);
    }
    bool launched; /* --nproc-per-node: this process starts the workers and waits */
    int launch_rc = loom_cli_maybe_launch(ctx, s, &launched);
    if (launched) return launch_rc;
    loom_comm *world = NULL;
    if (loom_cli_world(ctx, s, &world)) return loom_cli_fail(ctx);
    loom_settings_print(ctx, s, LOOM_CMD_GOLDEN);
    golden_in in = {0};
    golden_out o = {0};
    loom_model *m = NULL;
    float *logits = NULL, *tlp = NULL, *ent = NULL;
    double *losses = NULL, *norms = NULL;
    int rc = 1;
    loom_status st = read_batch(ctx, s->batch, &in);
    if (st) goto done;
    if (in.rows % s->accumulation_steps) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG,
                       "the batch's %lld rows cannot be cut into accumulation_steps=%lld calls",
                       (long long)in.rows, (long long)s->accumulation_steps);
        goto done;
    }
    if (loom_comm_rank(world) == 0 && (st = out_check(ctx, s, in.rows * in.seq))) goto done;
    loom_model_options mo;
    loom_cli_model_options(s, &mo);
    if ((st = loom_model_create_in(ctx, s->model, &mo, world, &m))) goto done;
    const bool lora = s->adapter != NULL;
    if (lora && (st = loom_model_load_adapter(m, "default", s->adapter))) goto done;
    loom_optimizer_config oc = {.lr = s->lr, .beta1 = s->adam_beta1, .beta2 = s->adam_beta2,
                                .eps = s->adam_eps, .weight_decay = s->weight_decay};
    if ((st = loom_model_set_optimizer(m, &oc))) goto done;
    loom_model_info info;
    loom_model_get_info(m, &info);
    int64_t T = in.rows * in.seq;
    logits = loom_malloc(ctx, (size_t)(T * info.vocab_size) * sizeof(float), "logits");
    tlp = loom_malloc(ctx, (size_t)T * sizeof(float), "token log-probs");
    ent = loom_malloc(ctx, (size_t)T * sizeof(float), "entropy");
    losses = loom_calloc(ctx, (size_t)s->steps + 1, sizeof *losses, "losses");
    norms = loom_calloc(ctx, (size_t)s->steps + 1, sizeof *norms, "grad norms");
    if (!logits || !tlp || !ent || !losses || !norms) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    loom_batch b = {.rows = in.rows, .seq_len = in.seq, .input_ids = in.ids, .targets = in.tgt,
                    .cu_seqlens = in.cu, .n_docs = in.ndocs, .position_ids = in.pos};
    loom_fb_result fr;
    loom_step_result sr;
    if ((st = loom_model_forward_only(m, &b, s->num_micro_batches, tlp, ent, logits, &fr)))
        goto done;
    if ((st = accumulate(m, &in, s->accumulation_steps, s->num_micro_batches, false, 0, &fr, &sr)))
        goto done;
    if (fr.n_tokens == 0) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "%s: every target is -100, so there is no loss and no gradient", s->batch);
        goto done;
    }
    const double loss = fr.loss;
    if (loom_model_rank(m) == 0) {
        if ((st = out_open(ctx, s->out, &o))) goto done;
        if ((st = declare_all(ctx, m, &o, &in, s->steps, lora))) goto done;
        float lossf = (float)loss;
        if ((st = loom_st_writer_write(ctx, o.w, "logits", LOOM_F32, logits)) ||
            (st = loom_st_writer_write(ctx, o.w, "token_logprobs", LOOM_F32, tlp)) ||
            (st = loom_st_writer_write(ctx, o.w, "entropy", LOOM_F32, ent)) ||
            (st = loom_st_writer_write(ctx, o.w, "loss", LOOM_F32, &lossf)))
            goto done;
    }
    if ((st = write_tensors(ctx, m, &o, "grad.", true, lora))) goto done;
    /* AdamW steps on the same batch: the gradients above are the first step's */
    for (int64_t k = 0; k < s->steps; k++) {
        if (k && (st = accumulate(m, &in, s->accumulation_steps, s->num_micro_batches, false, 0,
                                  &fr, &sr)))
            goto done;
        losses[k] = fr.loss;
        /* the calls above accumulated; count them toward the step */
        for (int64_t c = 0; c < s->accumulation_steps; c++)
            if ((st = loom_model_clip_grad_and_step(m, s->clip_grad, s->accumulation_steps, &sr)))
                goto done;
        if (!sr.stepped) {
            st = loom_errf(ctx, LOOM_ERR_INTERNAL, "step %lld was not taken", (long long)k + 1);
            goto done;
        }
        norms[k] = sr.grad_norm;
        LOOM_LOG_I(ctx, "step %lld: loss %.9g, grad norm %.9g", (long long)k + 1, losses[k],
                   norms[k]);
    }
    if (s->steps) {
        if (o.w && ((st = loom_st_writer_write(ctx, o.w, "adamw_losses", LOOM_F64, losses)) ||
                    (st = loom_st_writer_write(ctx, o.w, "adamw_grad_norms", LOOM_F64, norms))))
            goto done;
        if ((st = write_tensors(ctx, m, &o, "final.", false, lora))) goto done;
    }
    if (o.w && (st = loom_st_writer_finish(ctx, o.w))) goto done;
    if (o.w && (st = loom_out_commit(ctx, &o.out))) goto done;
    char mesh[128];
    LOOM_LOG_I(ctx, "loss %.9g over %lld tokens (mesh %s); wrote %s", loss, (long long)fr.n_tokens,
               loom_cli_mesh_describe(m, mesh, sizeof mesh), s->out);
    rc = 0;
done:
    if (rc) loom_cli_fail_job(ctx, world);
    loom_st_writer_free(o.w);
    loom_out_abort(&o.out);
    free(o.buf);
    loom_model_free(m);
    loom_comm_free(world);
    free(in.ids);
    free(in.tgt);
    free(in.pos);
    free(in.cu);
    free(logits);
    free(tlp);
    free(ent);
    free(losses);
    free(norms);
    return rc;
}
