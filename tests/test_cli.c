/* The loom command end to end: inspect on every fixture, init/convert round
 * trips, the option table (flags, --config, the settings table), and bad
 * input: each case must exit non-zero with a message naming the file, never
 * by a signal. */
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>

#include "../src/core/json.h"
#include "../src/io/safetensors.h"
#include "harness.h"

/* Runs loom with the NULL-terminated arguments; returns the exit code and
 * puts stdout+stderr in *out. */
static int loom(char **out, ...) {
    const char *argv[24] = {loom_test_bin()};
    va_list ap;
    va_start(ap, out);
    int n = 1;
    const char *a;
    while ((a = va_arg(ap, const char *)) && n < 23) argv[n++] = a;
    va_end(ap);
    argv[n] = NULL;
    return loom_test_run(out, argv);
}
#define LOOM1(o, a) loom(o, a, NULL)
#define LOOM2(o, a, b) loom(o, a, b, NULL)
#define LOOM3(o, a, b, c) loom(o, a, b, c, NULL)
#define LOOM4(o, a, b, c, d) loom(o, a, b, c, d, NULL)

static void fixture_dir(char *buf, size_t n, const char *model) {
    snprintf(buf, n, "%s/models/%s", loom_test_fixtures_of(model), model);
}

TEST(cli_help_and_version) {
    char *out;
    CHECK_EQ_INT(LOOM1(&out, "--help"), 0);
    CHECK_CONTAINS(out, "inspect");
    free(out);
    CHECK_EQ_INT(LOOM2(&out, "help", "init"), 0);
    CHECK_CONTAINS(out, "--max-shard-size SIZE");
    free(out);
    CHECK_EQ_INT(LOOM1(&out, "version"), 0);
    CHECK_CONTAINS(out, "features: cpu");
    free(out);
    CHECK_EQ_INT(LOOM1(&out, "frobnicate"), 2);
    CHECK_CONTAINS(out, "unknown command 'frobnicate'");
    free(out);
}

/* Every fixture model loads; the plan matches the checkpoint exactly and the
 * parameter total equals the sum of the tensor sizes. */
TEST(cli_inspect_fixtures) {
    static const struct {
        const char *model;
        int tensors;
    } models[] = {{"tiny-qwen3", 46},
                  {"tiny-qwen3-untied", 47},
                  {"tiny-qwen2", 51},
                  {"tiny-llama", 39},
                  {"tiny-qwen3-moe", 4 * (1 + 4 + 2 + 1 + 1 + 8 * 3) + 3},
                  /* 3 MoE layers with q/k/v biases and a shared expert and its gate,
                   * and a dense one */
                  {"tiny-qwen2-moe", 3 * (1 + 7 + 1 + 1 + 8 * 3 + 4) + (1 + 7 + 1 + 3) + 3}};
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        char dir[1024], *out;
        fixture_dir(dir, sizeof dir, models[i].model);
        int rc = LOOM4(&out, "inspect", dir, "--format", "json");
        CHECK_MSG(rc == 0, "%s: exit %d: %s", models[i].model, rc, out);
        loom_json *doc = NULL;
        loom_status st = loom_json_parse(ctx, out, strlen(out), "inspect output", &doc);
        CHECK_MSG(st == LOOM_OK, "%s: %s", models[i].model, loom_last_error(ctx));
        if (doc) {
            const loom_json *params = loom_json_get(doc, "parameters");
            const loom_json *ck = loom_json_get(doc, "checkpoint");
            int64_t total = 0, ckpt = -1, tensors = -1, found = -1;
            loom_json_get_int(ctx, params, "total", "p", &total);
            loom_json_get_int(ctx, ck, "parameters", "c", &ckpt);
            loom_json_get_int(ctx, ck, "tensors", "c", &tensors);
            loom_json_get_int(ctx, doc, "found", "d", &found);
            CHECK_MSG(total == ckpt && total > 0, "%s: plan %lld vs checkpoint %lld",
                      models[i].model, (long long)total, (long long)ckpt);
            CHECK_EQ_INT(tensors, models[i].tensors);
            CHECK_EQ_INT(found, models[i].tensors);
            CHECK_EQ_INT(loom_json_get(doc, "missing")->n, 0);
            CHECK_EQ_INT(loom_json_get(doc, "unexpected")->n, 0);
            CHECK_EQ_INT(loom_json_get(doc, "shape_mismatches")->n, 0);
        }
        loom_json_free(doc);
        free(out);
        /* the text form */
        CHECK_EQ_INT(LOOM2(&out, "inspect", dir), 0);
        CHECK_CONTAINS(out, "missing");
        CHECK_CONTAINS(out, "total");
        free(out);
    }
    char dir[1024], *out;
    fixture_dir(dir, sizeof dir, "tiny-qwen3-moe");
    CHECK_EQ_INT(LOOM2(&out, "inspect", dir), 0);
    CHECK_CONTAINS(out, "8 experts, top-2");
    free(out);
    fixture_dir(dir, sizeof dir, "tiny-qwen3-untied");
    CHECK_EQ_INT(LOOM2(&out, "inspect", dir), 0);
    CHECK_CONTAINS(out, "checkpoint: 2 files, 47 tensors");
    free(out);
    loom_ctx_free(ctx);
}

/* Qwen3.5's hub checkpoints (tests/fixtures_qwen3_5): the text model under
 * model.language_model. and the Gated DeltaNet's conv1d [C, 1, K] are read
 * as loom names them, the fused experts of the MoE one too, so every tensor
 * the config implies is found with its shape; the vision tower and the mtp
 * head are the only others, listed as carried (nothing unexpected). */
TEST(cli_inspect_qwen3_5) {
    static const struct {
        const char *model;
        int64_t expected; /* embedding, final norm, (lm_head); 3 linear + 1 full layers */
    } models[] = {{"tiny-qwen3_5", 2 + 3 * (2 + 9 + 3) + (2 + 6 + 3)},
                  {"tiny-qwen3_5-moe", 3 + 3 * (2 + 9 + 5 + 8 * 3) + (2 + 6 + 5 + 8 * 3)}};
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        char dir[1024], *out;
        snprintf(dir, sizeof dir, "tests/fixtures_qwen3_5/models/%s", models[i].model);
        int rc = LOOM4(&out, "inspect", dir, "--format", "json");
        CHECK_MSG(rc == 0, "%s: exit %d: %s", models[i].model, rc, out);
        loom_json *doc = NULL;
        CHECK_OK(ctx, loom_json_parse(ctx, out, strlen(out), "inspect output", &doc));
        if (doc) {
            int64_t found = -1;
            loom_json_get_int(ctx, doc, "found", "d", &found);
            CHECK_EQ_INT(found, models[i].expected);
            CHECK_EQ_INT(loom_json_get(doc, "missing")->n, 0);
            CHECK_EQ_INT(loom_json_get(doc, "shape_mismatches")->n, 0);
            CHECK_EQ_INT(loom_json_get(doc, "unexpected")->n, 0);
            const loom_json *un = loom_json_get(doc, "carried");
            CHECK_EQ_INT(un->n, 26); /* 21 of the vision tower, 5 of the mtp head */
            for (size_t k = 0; k < un->n; k++)
                CHECK_MSG(!strncmp(un->items[k]->s, "model.visual.", 13) ||
                              !strncmp(un->items[k]->s, "mtp.", 4),
                          "%s: %s", models[i].model, un->items[k]->s);
        }
        loom_json_free(doc);
        free(out);
        CHECK_EQ_INT(LOOM2(&out, "inspect", dir), 0);
        CHECK_CONTAINS(out, "3 Gated DeltaNet (key heads 2 of 16, value heads 4 of 16, conv 4), "
                            "1 full attention (output gate, 4 of 16 dimensions rotated)");
        CHECK_CONTAINS(out, "0 unexpected\n  and 26 outside the text model (the vision tower, "
                            "the mtp head), carried through every export as read");
        free(out);
    }
    loom_ctx_free(ctx);
}

TEST(cli_inspect_preset) {
    char *out;
    CHECK_EQ_INT(LOOM3(&out, "inspect", "--preset", "qwen3-8b"), 0);
    CHECK_CONTAINS(out, "8,190,735,360");
    free(out);
    CHECK_EQ_INT(LOOM3(&out, "inspect", "--preset", "qwen3-30b-a3b"), 0);
    CHECK_CONTAINS(out, "30,532,122,624");
    CHECK_CONTAINS(out, "active");
    free(out);
    CHECK_EQ_INT(LOOM3(&out, "inspect", "--preset", "gpt-5"), 2);
    CHECK_CONTAINS(out, "'gpt-5' is not one of");
    free(out);
}

/* init writes a sharded random model; inspect accepts it; convert to bf16
 * and back keeps every value at bf16 precision; tensors are deterministic. */
TEST(cli_init_convert_roundtrip) {
    char a[1024], b[1024], c[1024], *out;
    snprintf(a, sizeof a, "%s/a", loom_test_tmpdir());
    snprintf(b, sizeof b, "%s/b", loom_test_tmpdir());
    snprintf(c, sizeof c, "%s/c", loom_test_tmpdir());
    int rc = loom(&out, "init", "--out", a, "--max-shard-size", "300KB", "--seed", "7", NULL);
    CHECK_MSG(rc == 0, "init: %s", out);
    CHECK_CONTAINS(out, "max_shard_size");  /* the settings table */
    free(out);
    rc = LOOM2(&out, "inspect", a);
    CHECK_MSG(rc == 0, "inspect: %s", out);
    CHECK_CONTAINS(out, "46 expected, 46 found, 0 missing");
    free(out);
    rc = loom(&out, "convert", "--model", a, "--out", b, "--save-dtype", "bfloat16", NULL);
    CHECK_MSG(rc == 0, "convert: %s", out);
    free(out);
    rc = loom(&out, "convert", "--model", b, "--out", c, "--save-dtype", "float32", NULL);
    CHECK_MSG(rc == 0, "convert back: %s", out);
    free(out);
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_safetensors *sa, *sb, *sc;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, a, "model", &sa));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, b, "model", &sb));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, c, "model", &sc));
    CHECK(loom_st_file_count(sa) > 1);
    CHECK_EQ_INT(loom_st_count(sa), 46);
    CHECK_EQ_INT(loom_st_count(sc), 46);
    size_t bad = 0;
    for (size_t i = 0; i < loom_st_count(sa); i++) {
        const loom_st_tensor *ta = loom_st_at(sa, i);
        const loom_st_tensor *tb = loom_st_find(sb, ta->name), *tc = loom_st_find(sc, ta->name);
        REQUIRE(tb && tc);
        CHECK(ta->dtype == LOOM_F32 && tb->dtype == LOOM_BF16 && tc->dtype == LOOM_F32);
        float *x = malloc(ta->numel * 4), *z = malloc(ta->numel * 4);
        REQUIRE_OK(ctx, loom_st_read(ctx, ta, LOOM_F32, x, ta->numel));
        REQUIRE_OK(ctx, loom_st_read(ctx, tc, LOOM_F32, z, tc->numel));
        for (uint64_t j = 0; j < ta->numel; j++)
            if (z[j] != loom_bf16_to_f32(loom_f32_to_bf16(x[j]))) bad++;
        free(x);
        free(z);
    }
    CHECK_EQ_INT(bad, 0);
    /* norms are 1, matrices have the init std of the preset (0.02) */
    const loom_st_tensor *norm = loom_st_find(sa, "model.norm.weight");
    const loom_st_tensor *q = loom_st_find(sa, "model.layers.0.self_attn.q_proj.weight");
    REQUIRE(norm && q);
    float nv[64], *qv = malloc(q->numel * 4);
    REQUIRE_OK(ctx, loom_st_read(ctx, norm, LOOM_F32, nv, 64));
    REQUIRE_OK(ctx, loom_st_read(ctx, q, LOOM_F32, qv, q->numel));
    CHECK(nv[0] == 1.0f && nv[63] == 1.0f);
    double s2 = 0;
    for (uint64_t j = 0; j < q->numel; j++) s2 += (double)qv[j] * qv[j];
    CHECK_NEAR(sqrt(s2 / (double)q->numel), 0.02, 0.001);
    free(qv);
    loom_st_close(sa);
    loom_st_close(sb);
    loom_st_close(sc);
    /* the config keeps its layout and records the new dtype */
    loom_json *cfg;
    char path[1100];
    snprintf(path, sizeof path, "%s/config.json", b);
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, path, &cfg));
    CHECK_STR(loom_json_get(cfg, "torch_dtype")->s, "bfloat16");
    CHECK(loom_json_get(cfg, "rope_theta") != NULL);
    loom_json_free(cfg);
    /* same seed, same weights: byte-identical files */
    char d[1024];
    snprintf(d, sizeof d, "%s/d", loom_test_tmpdir());
    rc = loom(&out, "init", "--out", d, "--max-shard-size", "300KB", "--seed", "7", NULL);
    free(out);
    loom_safetensors *sd;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, d, "model", &sd));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, a, "model", &sa));
    CHECK_EQ_INT(loom_st_file_count(sd), loom_st_file_count(sa));
    char *x1, *x2;
    size_t l1, l2;
    REQUIRE_OK(ctx, loom_read_file(ctx, loom_st_file_path(sa, 0), 0, &x1, &l1));
    REQUIRE_OK(ctx, loom_read_file(ctx, loom_st_file_path(sd, 0), 0, &x2, &l2));
    loom_st_close(sa);
    loom_st_close(sd);
    CHECK(l1 == l2 && memcmp(x1, x2, l1) == 0);
    free(x1);
    free(x2);
    loom_ctx_free(ctx);
}

/* --init-embedding-std gives the token embedding its own std; every other
 * tensor is the default init's, value for value; a negative one is refused
 * before anything is written. */
TEST(cli_init_embedding_std) {
    char a[1024], b[1024], bad[1024], *out;
    snprintf(a, sizeof a, "%s/emb-a", loom_test_tmpdir());
    snprintf(b, sizeof b, "%s/emb-b", loom_test_tmpdir());
    snprintf(bad, sizeof bad, "%s/emb-bad", loom_test_tmpdir());
    int rc = loom(&out, "init", "--preset", "tiny-qwen3-moe", "--out", a, NULL);
    CHECK_MSG(rc == 0, "init: %s", out);
    free(out);
    rc = loom(&out, "init", "--preset", "tiny-qwen3-moe", "--out", b, "--init-embedding-std", "1",
              NULL);
    CHECK_MSG(rc == 0, "init: %s", out);
    CHECK_CONTAINS(out, "init_embedding_std");
    free(out);
    rc = loom(&out, "init", "--out", bad, "--init-embedding-std", "-1", NULL);
    CHECK(rc != 0);
    CHECK_CONTAINS(out, "init_embedding_std = -1");
    free(out);
    CHECK(!loom_file_exists(bad));
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_safetensors *sa, *sb;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, a, "model", &sa));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, b, "model", &sb));
    int same = 0, embeds = 0;
    for (size_t i = 0; i < loom_st_count(sa); i++) {
        const loom_st_tensor *ta = loom_st_at(sa, i), *tb = loom_st_find(sb, ta->name);
        REQUIRE(tb && tb->numel == ta->numel);
        float *x = malloc(ta->numel * 4), *y = malloc(ta->numel * 4);
        REQUIRE(x && y);
        REQUIRE_OK(ctx, loom_st_read(ctx, ta, LOOM_F32, x, ta->numel));
        REQUIRE_OK(ctx, loom_st_read(ctx, tb, LOOM_F32, y, tb->numel));
        if (!strcmp(ta->name, "model.embed_tokens.weight")) {
            double s2 = 0.0;
            for (uint64_t j = 0; j < tb->numel; j++) s2 += (double)y[j] * y[j];
            CHECK_NEAR(sqrt(s2 / (double)tb->numel), 1.0, 0.02);
            /* the same draws, scaled: 1 / 0.02 */
            CHECK_NEAR(y[17] / x[17], 50.0, 1e-3);
            embeds++;
        } else {
            same += memcmp(x, y, ta->numel * 4) == 0;
        }
        free(x);
        free(y);
    }
    CHECK_EQ_INT(embeds, 1);
    CHECK_EQ_INT(same, (int)loom_st_count(sa) - 1);
    loom_st_close(sa);
    loom_st_close(sb);
    loom_ctx_free(ctx);
}

TEST(cli_options_config_file_and_flags) {
    char *out, dir[1024];
    snprintf(dir, sizeof dir, "%s/m", loom_test_tmpdir());
    const char *cfg = "{\"seed\": 99, \"max_shard_size\": \"1MB\", \"save_dtype\": \"float16\"}";
    char cfgpath[1024];
    snprintf(cfgpath, sizeof cfgpath, "%s", loom_test_write("run.json", cfg, strlen(cfg)));
    /* the flag after the file overrides it; the one before does too */
    int rc = loom(&out, "init", "--seed", "5", "--config", cfgpath, "--out", dir, NULL);
    CHECK_MSG(rc == 0, "%s", out);
    CHECK_CONTAINS(out, "seed               5");
    CHECK_CONTAINS(out, "flag");
    CHECK_CONTAINS(out, "max_shard_size     1000000 (976.56 KiB)");
    CHECK_CONTAINS(out, "config");
    CHECK_CONTAINS(out, "float16");
    free(out);
    CHECK_EQ_INT(LOOM3(&out, "init", "--max-shrad-size", "1GB"), 2);
    CHECK_CONTAINS(out, "unknown option --max-shrad-size (did you mean --max-shard-size?)");
    free(out);
    CHECK_EQ_INT(LOOM3(&out, "init", "--seed", "x"), 2);
    CHECK_CONTAINS(out, "--seed: 'x' is not an integer");
    free(out);
    CHECK_EQ_INT(LOOM3(&out, "init", "--max-shard-size", "12 parsecs"), 2);
    CHECK_CONTAINS(out, "is not a size");
    free(out);
    CHECK_EQ_INT(LOOM2(&out, "init", "--seed"), 2);
    CHECK_CONTAINS(out, "--seed needs a value");
    free(out);
    CHECK_EQ_INT(LOOM3(&out, "inspect", "--seed", "3"), 2);
    CHECK_CONTAINS(out, "unknown option --seed for this command");
    free(out);
    CHECK_EQ_INT(LOOM1(&out, "init"), 1);
    CHECK_CONTAINS(out, "needs --out DIR");
    free(out);
    const char *bad = "{\"sead\": 1}";
    snprintf(cfgpath, sizeof cfgpath, "%s", loom_test_write("bad.json", bad, strlen(bad)));
    CHECK_EQ_INT(LOOM3(&out, "init", "--config", cfgpath), 2);
    CHECK_CONTAINS(out, "unknown setting 'sead' (did you mean 'seed'?)");
    CHECK_CONTAINS(out, "bad.json");
    free(out);
    const char *bad2 = "{\"seed\": \"1\"}";
    snprintf(cfgpath, sizeof cfgpath, "%s", loom_test_write("bad2.json", bad2, strlen(bad2)));
    CHECK_EQ_INT(LOOM3(&out, "init", "--config", cfgpath), 2);
    CHECK_CONTAINS(out, "'seed' must be an integer, got string");
    free(out);
    const char *bad3 = "{\"seed\": 1,}";
    snprintf(cfgpath, sizeof cfgpath, "%s", loom_test_write("bad3.json", bad3, strlen(bad3)));
    CHECK_EQ_INT(LOOM3(&out, "init", "--config", cfgpath), 2);
    CHECK_CONTAINS(out, "bad3.json: line 1");
    free(out);
}

/* ---- bad input through the command line ---- */

/* A model directory: the fixture's config.json (or `config`) and one
 * model.safetensors holding `st` (len bytes). Returns the directory. */
static const char *make_model(const char *name, const char *config, const void *st, size_t len) {
    static char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", loom_test_tmpdir(), name);
    mkdir(dir, 0755);
    char path[1100];
    char *text = NULL;
    size_t tlen;
    if (!config) {
        char src[1024];
        snprintf(src, sizeof src, "%s/models/tiny-qwen3/config.json", loom_test_fixtures());
        if (loom_read_file(NULL, src, 0, &text, &tlen) != LOOM_OK) return dir;
        config = text;
    }
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "wb");
    fwrite(config, 1, strlen(config), f);
    fclose(f);
    free(text);
    if (st) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        f = fopen(path, "wb");
        fwrite(st, 1, len, f);
        fclose(f);
    }
    return dir;
}

/* header JSON + data bytes -> a safetensors image */
static size_t st_image(char *buf, const char *header, size_t data_len) {
    uint64_t n = strlen(header);
    memcpy(buf, &n, 8);
    memcpy(buf + 8, header, n);
    memset(buf + 8 + n, 0, data_len);
    return 8 + n + data_len;
}

static void expect_fail(const char *dir, const char *file_fragment, const char *fragment) {
    char *out;
    int rc = LOOM2(&out, "inspect", dir);
    CHECK_MSG(rc == 1, "%s: exit %d (want 1): %s", fragment, rc, out ? out : "");
    CHECK_CONTAINS(out, file_fragment);
    CHECK_CONTAINS(out, fragment);
    free(out);
}

TEST(cli_bad_safetensors) {
    char buf[4096];
    size_t n;
    const char *d;
    d = make_model("trunc", NULL, "\x10\x00\x00", 3);
    expect_fail(d, "model.safetensors", "truncated");
    uint64_t big = 1u << 20;
    memcpy(buf, &big, 8);
    memcpy(buf + 8, "{}", 2);
    d = make_model("hdrlen", NULL, buf, 10);
    expect_fail(d, "model.safetensors", "header length");
    n = st_image(buf, "not json at all", 0);
    d = make_model("notjson", NULL, buf, n);
    expect_fail(d, "model.safetensors", "JSON");
    n = st_image(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,80]}}", 8);
    d = make_model("range", NULL, buf, n);
    expect_fail(d, "model.safetensors", "'a'");
    n = st_image(buf,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                 12);
    d = make_model("overlap", NULL, buf, n);
    expect_fail(d, "model.safetensors", "overlap");
    n = st_image(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8);
    d = make_model("shape", NULL, buf, n);
    expect_fail(d, "model.safetensors", "'a'");
    n = st_image(buf, "{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[8],\"data_offsets\":[0,8]}}", 8);
    d = make_model("dtype", NULL, buf, n);
    expect_fail(d, "model.safetensors", "F8_E4M3");
    n = st_image(buf,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                 8);
    d = make_model("dup", NULL, buf, n);
    expect_fail(d, "model.safetensors", "duplicate");
    /* a valid file whose tensors do not match the config */
    n = st_image(buf, "{\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8);
    d = make_model("mismatch", NULL, buf, n);
    expect_fail(d, "mismatch", "does not match config.json");
    /* no weights at all */
    d = make_model("noweights", NULL, NULL, 0);
    expect_fail(d, "noweights", "model.safetensors");
}

TEST(cli_bad_index_and_config) {
    char dir[1024], path[1100];
    snprintf(dir, sizeof dir, "%s/idx", loom_test_tmpdir());
    mkdir(dir, 0755);
    char *cfgtext;
    size_t len;
    char src[1024];
    snprintf(src, sizeof src, "%s/models/tiny-qwen3/config.json", loom_test_fixtures());
    REQUIRE(loom_read_file(NULL, src, 0, &cfgtext, &len) == LOOM_OK);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "wb");
    fwrite(cfgtext, 1, len, f);
    fclose(f);
    free(cfgtext);
    const char *index =
        "{\"metadata\": {\"total_size\": 8}, \"weight_map\": "
        "{\"model.norm.weight\": \"model-00002-of-00002.safetensors\"}}";
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    f = fopen(path, "wb");
    fwrite(index, 1, strlen(index), f);
    fclose(f);
    expect_fail(dir, "model.safetensors.index.json", "model-00002-of-00002.safetensors");

    expect_fail(make_model("cfg1", "{\"model_type\": \"qwen3\"}", NULL, 0), "config.json",
                "missing required field 'vocab_size'");
    expect_fail(make_model("cfg2",
                           "{\"model_type\": \"qwen3\", \"vocab_size\": \"many\", "
                           "\"hidden_size\": 64}",
                           NULL, 0),
                "config.json", "'vocab_size' must be an integer, got string");
    expect_fail(make_model("cfg3", "{\"model_type\": \"gpt2\"}", NULL, 0), "config.json",
                "model_type 'gpt2' is not supported");
    expect_fail(make_model("cfg4", "{\"model_type\": \"qwen3\",", NULL, 0), "config.json",
                "line 1");
    char *out;
    CHECK_EQ_INT(LOOM2(&out, "inspect", "/nonexistent-loom-dir"), 1);
    CHECK_CONTAINS(out, "/nonexistent-loom-dir");
    free(out);
}
