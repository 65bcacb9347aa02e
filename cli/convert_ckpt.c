/* loom convert --from-checkpoint CK --to hf|peft --out DIR: a training
 * checkpoint, saved on any mesh, as files transformers, PEFT and vLLM load.
 * One process: the base model (--model, else the directory the checkpoint
 * recorded) with the recorded config overrides, the adapter the checkpoint
 * trained (its settings from meta.json), the checkpoint's weights on top
 * (loom_model_load_state, weights only), then loom's own writers. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static loom_status verify(loom_ctx *ctx, const char *dir, void *u) {
    (void)u;
    return loom_verify_state(ctx, dir);
}

/* The directory holding the state's meta.json. */
static loom_status find_state(loom_ctx *ctx, const char *path, char *dir, size_t cap) {
    char p[4200];
    snprintf(p, sizeof p, "%s/meta.json", path);
    if (loom_file_exists(p)) {
        snprintf(dir, cap, "%s", path);
        return LOOM_OK;
    }
    snprintf(p, sizeof p, "%s/training_state/meta.json", path); /* Python's save(save_optimizer) */
    if (loom_file_exists(p)) {
        snprintf(dir, cap, "%s/training_state", path);
        return LOOM_OK;
    }
    int64_t it;
    return loom_ckpt_find(ctx, path, verify, NULL, dir, cap, &it);
}

int loom_cmd_convert_checkpoint(loom_ctx *ctx, loom_settings *s) {
    char dir[4096], *mpath = NULL;
    loom_json *meta = NULL;
    loom_model *m = NULL;
    loom_status st = find_state(ctx, s->from_checkpoint, dir, sizeof dir);
    if (!st && !(mpath = loom_path_join(ctx, dir, "meta.json"))) st = LOOM_ERR_OOM;
    if (!st) st = loom_verify_state(ctx, dir);
    if (!st) st = loom_json_parse_file(ctx, mpath, &meta);
    if (st) goto done;
    const loom_json *md = loom_json_get(meta, "model_dir"), *ov = loom_json_get(meta, "config_overrides"),
                    *ad = loom_json_get(meta, "adapter");
    const char *base = s->model ? s->model : md && md->type == LOOM_JSON_STRING ? md->s : NULL;
    if (!base || !loom_dir_exists(base)) {
        st = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                       "%s: the base model %s is not there; give it with --model DIR", mpath,
                       base ? base : "(not recorded)");
        goto done;
    }
    if (!strcmp(s->to, "peft") && !ad) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG, "%s trained the whole model, not a LoRA adapter: "
                       "use --to hf", s->from_checkpoint);
        goto done;
    }
    if (!strcmp(s->to, "hf") && ad && !s->merge_lora) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG, "%s trained a LoRA adapter: use --to peft, or --to hf "
                       "--merge-lora for the base with the adapter merged in", s->from_checkpoint);
        goto done;
    }
    loom_model_options o;
    loom_model_options_default(&o);
    o.config_overrides = ov && ov->type == LOOM_JSON_STRING ? ov->s : NULL;
    if ((st = loom_model_create(ctx, base, &o, &m))) goto done;
    const char *aname = "default";
    if (ad) {
        loom_lora_config lc = {0};
        const char *name = NULL, *targets = NULL;
        int64_t r = 0, seed = 0;
        bool rs = false;
        if ((st = loom_json_get_str(ctx, ad, "name", mpath, &name)) ||
            (st = loom_json_get_int(ctx, ad, "r", mpath, &r)) ||
            (st = loom_json_get_num(ctx, ad, "lora_alpha", mpath, &lc.lora_alpha)) ||
            (st = loom_json_get_num(ctx, ad, "lora_dropout", mpath, &lc.lora_dropout)) ||
            (st = loom_json_get_bool(ctx, ad, "use_rslora", mpath, &rs)) ||
            (st = loom_json_get_str(ctx, ad, "target_modules", mpath, &targets)) ||
            (st = loom_json_get_int(ctx, ad, "seed", mpath, &seed)))
            goto done;
        lc.r = (int)r, lc.use_rslora = rs, lc.target_modules = targets, lc.seed = (uint64_t)seed;
        aname = name;
        if ((st = loom_model_add_adapter(m, name, &lc))) goto done;
    }
    if ((st = loom_model_load_state(m, dir, 0, NULL))) goto done;
    if (!strcmp(s->to, "peft")) {
        st = loom_model_save_adapter(m, aname, s->out, loom_cli_save_dtype(s, LOOM_F32));
    } else {
        if (ad && (st = loom_model_merge_adapter(m, aname))) goto done;
        st = loom_model_save_hf(m, s->out, loom_cli_save_dtype(s, LOOM_DTYPE_COUNT),
                                (uint64_t)s->max_shard_size);
    }
    if (!st) LOOM_LOG_I(ctx, "wrote %s (%s) from %s", s->out, s->to, dir);
done:
    loom_model_free(m);
    loom_json_free(meta);
    free(mpath);
    return st ? loom_cli_fail(ctx) : 0;
}
