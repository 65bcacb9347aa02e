/* loom init (random model of a built-in shape) and loom convert (rewrite a
 * checkpoint in another dtype or shard size). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static bool need_out(loom_ctx *ctx, const loom_settings *s, const char *cmd) {
    if (s->out && *s->out) return true;
    loom_errf(ctx, LOOM_ERR_CONFIG, "loom %s needs --out DIR (where the model is written)", cmd);
    return false;
}

int loom_cmd_init(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (!need_out(ctx, s, "init")) return loom_cli_fail(ctx);
    loom_settings_print(ctx, s, LOOM_CMD_INIT);
    const char *text = loom_preset_config(s->preset);
    loom_json *doc = NULL;
    loom_model_config cfg;
    loom_status st = loom_json_parse(ctx, text, strlen(text), s->preset, &doc);
    if (!st) st = loom_config_override(ctx, doc, s->config_override);
    if (!st) st = loom_config_parse(ctx, doc, s->preset, &cfg);
    loom_json_free(doc);
    if (st) return loom_cli_fail(ctx);
    loom_dtype dt = loom_cli_save_dtype(s, LOOM_F32);
    uint64_t est = 0;
    st = loom_hf_save_estimate(ctx, &cfg, NULL, dt, &est);
    if (!st) st = loom_out_check(ctx, "--out", s->out, LOOM_OUT_DIR, est);
    if (!st)
        st = loom_write_random_model(ctx, &cfg, s->out, (uint64_t)s->seed, s->init_embedding_std,
                                     dt, (uint64_t)s->max_shard_size);
    loom_config_free(&cfg);
    if (st) return loom_cli_fail(ctx);
    LOOM_LOG_I(ctx, "wrote %s (%s, random weights, %s, seed %" PRId64 ")", s->out, s->preset,
               loom_dtype_name(dt), s->seed);
    return 0;
}

int loom_cmd_convert(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (s->from_checkpoint) {
        if (!need_out(ctx, s, "convert")) return loom_cli_fail(ctx);
        loom_settings_print(ctx, s, LOOM_CMD_CONVERT);
        return loom_cmd_convert_checkpoint(ctx, s);
    }
    if (!s->model) {
        loom_errf(ctx, LOOM_ERR_CONFIG, "loom convert needs --model DIR (the checkpoint to read)");
        return loom_cli_fail(ctx);
    }
    if (!need_out(ctx, s, "convert")) return loom_cli_fail(ctx);
    loom_settings_print(ctx, s, LOOM_CMD_CONVERT);
    loom_model_config cfg;
    loom_param_plan plan = {0};
    loom_safetensors *in = NULL;
    loom_st_writer *w = NULL;
    loom_out out = {0}; /* written into a temporary directory, moved into place whole */
    void *buf = NULL;
    loom_status st = loom_config_load(ctx, s->model, &cfg);
    if (st) return loom_cli_fail(ctx);
    if ((st = loom_param_plan_build(ctx, &cfg, &plan))) goto done;
    if ((st = loom_hf_dir_open(ctx, s->model, &in))) goto done;
    /* every expected tensor must be there with its shape; the dtype of the
     * output defaults to that of the first tensor read */
    loom_dtype out_dt = LOOM_F32;
    for (size_t i = 0; i < plan.n; i++) {
        const loom_st_tensor *t = loom_st_find(in, plan.p[i].name);
        if (!t) {
            st = loom_errf(ctx, LOOM_ERR_NOT_FOUND, "%s: tensor '%s' is missing from the checkpoint",
                           s->model, plan.p[i].name);
            goto done;
        }
        if (i == 0) out_dt = t->dtype;
    }
    out_dt = loom_cli_save_dtype(s, out_dt);
    if (!loom_dtype_is_float(out_dt)) {
        st = loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "%s: weights are %s; give --save-dtype",
                       s->model, loom_dtype_name(out_dt));
        goto done;
    }
    uint64_t est = 0;
    if ((st = loom_hf_save_estimate(ctx, &cfg, s->model, out_dt, &est))) goto done;
    if ((st = loom_out_check(ctx, "--out", s->out, LOOM_OUT_DIR, est))) goto done;
    if ((st = loom_out_begin(ctx, "--out", s->out, LOOM_OUT_DIR, &out))) goto done;
    loom_json *meta = loom_json_new_object(ctx);
    if (!meta || loom_json_set(ctx, meta, "format", loom_json_new_str(ctx, "pt"))) {
        loom_json_free(meta);
        st = LOOM_ERR_OOM;
        goto done;
    }
    st = loom_st_writer_create(ctx, out.tmp, "model", (uint64_t)s->max_shard_size, meta, &w);
    loom_json_free(meta);
    if (st) goto done;
    for (size_t i = 0; i < plan.n && !st; i++)
        st = loom_st_writer_declare(ctx, w, plan.p[i].name, out_dt, plan.p[i].ndim, plan.p[i].shape);
    size_t cap = 0;
    for (size_t i = 0; i < plan.n && !st; i++) {
        const loom_param_spec *p = &plan.p[i];
        size_t bytes = (size_t)loom_param_numel(p) * loom_dtype_size(out_dt);
        if (bytes > cap) {
            void *nb = loom_realloc(ctx, buf, bytes, p->name);
            if (!nb) {
                st = LOOM_ERR_OOM;
                break;
            }
            buf = nb;
            cap = bytes;
        }
        st = loom_st_read_named(ctx, in, p->name, p->ndim, p->shape, out_dt, buf);
        if (!st) st = loom_st_writer_write(ctx, w, p->name, out_dt, buf);
    }
    if (!st) st = loom_st_writer_finish(ctx, w);
    if (!st) st = loom_config_save(ctx, &cfg, out.tmp, out_dt);
    if (!st) st = loom_out_copy_side_files(ctx, s->model, out.tmp);
    if (!st) st = loom_out_commit(ctx, &out);
    if (!st) {
        size_t extra = loom_st_count(in) > plan.n ? loom_st_count(in) - plan.n : 0;
        if (extra)
            LOOM_LOG_W(ctx, "%zu tensors of %s are not part of the %s architecture and were not "
                            "written (see 'loom inspect %s')",
                       extra, s->model, cfg.model_type, s->model);
        LOOM_LOG_I(ctx, "wrote %s: %zu tensors as %s", s->out, plan.n, loom_dtype_name(out_dt));
    }
done:
    free(buf);
    loom_st_writer_free(w);
    loom_out_abort(&out);
    loom_st_close(in);
    loom_param_plan_free(&plan);
    loom_config_free(&cfg);
    return st ? loom_cli_fail(ctx) : 0;
}
