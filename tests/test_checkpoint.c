/* Training state out and in (loom_model_save_state / load_state): a run
 * saved after step k and resumed in a fresh model continues bitwise as the
 * uninterrupted run (CPU fp32), full fine-tuning and LoRA with dropout;
 * weights only starts at step 0; another model's or another LoRA's state is
 * refused with the file named. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../include/loom.h"
#include "harness.h"

static char *tmpdir(const char *tag) {
    char *d = malloc(256);
    snprintf(d, 256, "/tmp/loom-ckpt-%s-%d", tag, (int)getpid());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", d, d);
    if (system(cmd)) return NULL;
    return d;
}

static void batch(int k, int32_t *ids, int32_t *tgt) {
    for (int i = 0; i < 2 * 16; i++) ids[i] = (i * 37 + 11 * k + 5) % 1000;
    for (int i = 0; i < 2 * 16; i++) tgt[i] = (i + 1) % 16 ? ids[i + 1] : -100;
}

/* lora 2: full fine-tuning with two tensors frozen */
static loom_model *make(loom_ctx *ctx, int lora) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/models/tiny-qwen3", loom_test_fixtures());
    loom_model *m = NULL;
    if (loom_model_create(ctx, dir, NULL, &m)) return NULL;
    loom_optimizer_config oc = loom_optimizer_config_default();
    oc.lr = 1e-2;
    loom_model_set_optimizer(m, &oc);
    loom_sched_config sc = loom_sched_config_default();
    sc.max_lr = 1e-2, sc.lr_warmup_steps = 2, sc.lr_decay_steps = 10;
    sc.lr_decay_style = LOOM_LR_COSINE;
    loom_model_set_lr_scheduler(m, &sc);
    if (lora == 2) {
        loom_model_set_trainable(m, "model.layers.0.mlp.up_proj.weight", 0);
        loom_model_set_trainable(m, "model.norm.weight", 0);
    } else if (lora) {
        loom_lora_config lc = {.r = 4, .lora_alpha = 8, .lora_dropout = 0.1, .seed = 3};
        if (loom_model_add_adapter(m, "a", &lc)) {
            loom_model_free(m);
            return NULL;
        }
    }
    return m;
}

static double step(loom_model *m, int k) {
    int32_t ids[32], tgt[32];
    batch(k, ids, tgt);
    loom_batch b = {.rows = 2, .seq_len = 16, .input_ids = ids, .targets = tgt};
    loom_step_result r;
    if (loom_model_forward_backward(m, &b, 1, NULL) || loom_model_clip_grad_and_step(m, 1.0, 1, &r))
        return -1;
    return r.loss;
}

static bool same_tensors(loom_ctx *ctx, loom_model *a, loom_model *b, int lora) {
    float *x = NULL, *y = NULL;
    bool same = true;
    char buf[512];
    for (int64_t i = 0;; i++) {
        int nd = 2;
        int64_t sh[2];
        const char *name = lora == 1 ? loom_model_adapter_tensor(a, "a", i, buf, sizeof buf, sh)
                                : loom_model_tensor_name(a, i, &nd, sh);
        if (!name) break;
        char key[600];
        snprintf(key, sizeof key, "%s", name);
        const int64_t n = nd == 2 ? sh[0] * sh[1] : sh[0];
        x = realloc(x, (size_t)n * 4);
        y = realloc(y, (size_t)n * 4);
        if (loom_model_get_param(a, key, x, n) || loom_model_get_param(b, key, y, n)) {
            loom_test_fail(__FILE__, __LINE__, "get_param %s: %s", key, loom_last_error(ctx));
            same = false;
            break;
        }
        if (memcmp(x, y, (size_t)n * 4)) {
            loom_test_fail(__FILE__, __LINE__, "%s differs after the resume", key);
            same = false;
        }
    }
    free(x);
    free(y);
    return same;
}

static void resume_is_bitwise(int lora) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char *dir = tmpdir(lora == 1 ? "lora" : lora ? "frozen" : "full");
    REQUIRE(dir);
    /* frozen: the resumed model is made without freezing; the state says which */
    loom_model *a = make(ctx, lora), *b = make(ctx, lora == 2 ? 0 : lora);
    REQUIRE(a && b);
    double la[5], lb[5];
    for (int k = 0; k < 3; k++) la[k] = step(a, k);
    loom_train_progress p = {.consumed_samples = 6, .consumed_tokens = 96, .data_epoch = 1,
                             .data_index = 2};
    REQUIRE_OK(ctx, loom_model_save_state(a, dir, &p, 1));
    for (int k = 3; k < 5; k++) la[k] = step(a, k);
    loom_train_progress q;
    REQUIRE_OK(ctx, loom_model_load_state(b, dir, 1, &q));
    CHECK_EQ_INT(q.step, 3);
    CHECK_EQ_INT(q.consumed_samples, 6);
    CHECK_EQ_INT(q.consumed_tokens, 96);
    CHECK_EQ_INT(q.data_epoch, 1);
    CHECK_EQ_INT(q.data_index, 2);
    for (int k = 3; k < 5; k++) lb[k] = step(b, k);
    for (int k = 3; k < 5; k++) CHECK_MSG(la[k] == lb[k], "step %d: loss %.17g, resumed %.17g", k + 1, la[k], lb[k]);
    same_tensors(ctx, a, b, lora);
    /* weights only: step 0, fresh moments (so the next step differs) */
    loom_model *c = make(ctx, lora);
    REQUIRE(c);
    REQUIRE_OK(ctx, loom_model_load_state(c, dir, 0, &q));
    {
        int32_t ids[32], tgt[32];
        batch(3, ids, tgt);
        loom_batch bb = {.rows = 2, .seq_len = 16, .input_ids = ids, .targets = tgt};
        loom_step_result r;
        REQUIRE_OK(ctx, loom_model_forward_backward(c, &bb, 1, NULL));
        REQUIRE_OK(ctx, loom_model_clip_grad_and_step(c, 1.0, 1, &r));
        CHECK_EQ_INT(r.step, 1);              /* the optimizer starts again */
        CHECK(r.loss == la[3] || lora == 1);  /* from the saved weights (LoRA: its dropout draw differs) */
    }
    loom_model_free(c);
    /* another LoRA rank or the whole model: refused, the file named */
    loom_model *d = make(ctx, lora != 1);
    REQUIRE(d);
    loom_status st = loom_model_load_state(d, dir, 1, &q);
    CHECK_EQ_INT(st, LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "meta.json");
    loom_model_free(d);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    free(dir);
    loom_model_free(a);
    loom_model_free(b);
    loom_ctx_free(ctx);
}

/* A damaged state is refused before anything is read, the file named. */
TEST(checkpoint_damage_is_named) {
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    loom_ctx_set_log_level(ctx, LOOM_LOG_ERROR);
    char *dir = tmpdir("damage");
    REQUIRE(dir);
    loom_model *a = make(ctx, 0);
    REQUIRE(a);
    step(a, 0);
    REQUIRE_OK(ctx, loom_model_save_state(a, dir, NULL, 1));
    REQUIRE_OK(ctx, loom_verify_state(ctx, dir));
    /* a write that fails is an error, not a half-made state */
    char gone[512];
    snprintf(gone, sizeof gone, "%s/meta.json/sub", dir); /* under a file */
    CHECK(loom_model_save_state(a, gone, NULL, 1) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "meta.json: exists and is not a directory");
    char cmd[600];
    struct {
        const char *damage, *expect;
        loom_status st;
        bool table; /* in the piece table, which verify does not read (load does) */
    } cases[] = {
        {"truncate -s -8 %s/rank_00000.safetensors", "rank_00000.safetensors is damaged", LOOM_ERR_FORMAT, false},
        {"printf x >> %s/rank_00000.safetensors", "rank_00000.safetensors is damaged", LOOM_ERR_FORMAT, false},
        {"rm %s/rank_00000.safetensors", "rank_00000.safetensors is missing: rank 0 of the 1 ranks", LOOM_ERR_NOT_FOUND, false},
        {"sed -i 's/\"version\": 2/\"version\": 7/' %s/meta.json", "version 7", LOOM_ERR_UNSUPPORTED, false},
        {"rm %s/meta.json", "meta.json", LOOM_ERR_IO, false},
        /* meta.json holds no checksum of its own: its table is checked */
        {"sed -i 's/\"rank_00000.safetensors\": \"[0-9a-f]*\"//' %s/meta.json",
         "\"files\" does not list rank_00000.safetensors", LOOM_ERR_FORMAT, false},
        {"python3 -c \"import json, sys; p = sys.argv[1] + '/meta.json'; m = json.load(open(p)); "
         "next(iter(m['tensors'].values()))['pieces'] = []; json.dump(m, open(p, 'w'))\" %s",
         "its pieces hold 0 of its", LOOM_ERR_FORMAT, true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        REQUIRE_OK(ctx, loom_model_save_state(a, dir, NULL, 1)); /* whole again */
        snprintf(cmd, sizeof cmd, cases[i].damage, dir);
        CHECK(system(cmd) == 0);
        loom_model *b = make(ctx, 0);
        REQUIRE(b);
        loom_status st = loom_model_load_state(b, dir, 1, NULL);
        CHECK_MSG(st == cases[i].st, "%s: status %d (%s)", cases[i].damage, st, loom_last_error(ctx));
        CHECK_CONTAINS(loom_last_error(ctx), cases[i].expect);
        CHECK((loom_verify_state(ctx, dir) != LOOM_OK) == !cases[i].table);
        loom_model_free(b);
    }
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
    free(dir);
    loom_model_free(a);
    loom_ctx_free(ctx);
}

TEST(checkpoint_resume_is_bitwise_full) { resume_is_bitwise(0); }
TEST(checkpoint_resume_is_bitwise_lora) { resume_is_bitwise(1); }
TEST(checkpoint_resume_is_bitwise_frozen) { resume_is_bitwise(2); }
