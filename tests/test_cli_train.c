/* `loom train` and `loom golden` end to end. */
#include <stdlib.h>
#include <string.h>

#include "../src/io/safetensors.h"
#include "harness.h"

#define RUN(out, ...) loom_test_run(out, (const char *const[]){loom_test_bin(), __VA_ARGS__, NULL})

static const char *tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", loom_test_tmpdir(), name);
    return buf;
}

/* Loss printed on the line of `step k/`. */
static double loss_at(const char *out, const char *step) {
    const char *p = strstr(out, step);
    if (!p || !(p = strstr(p, "loss "))) return NAN;
    return atof(p + 5);
}

TEST(cli_train_loss_falls_and_saves_hf) {
    char model[1024], text[1024], data[1024], saved[1024], *out;
    tmp_path(model, sizeof model, "tiny");
    tmp_path(text, sizeof text, "corpus.txt");
    tmp_path(data, sizeof data, "corpus.tokens");
    tmp_path(saved, sizeof saved, "trained");
    FILE *f = fopen(text, "w");
    REQUIRE(f);
    for (int i = 0; i < 40; i++)
        fprintf(f, "the quick brown fox jumps over the lazy dog %d times.\n%s", i,
                i % 5 == 4 ? "\n" : "");
    fclose(f);
    REQUIRE(RUN(&out, "init", "--out", model, "--log-level", "warn") == 0);
    free(out);
    REQUIRE(RUN(&out, "data", "--text", text, "--out", data) == 0);
    free(out);
    int rc = RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps", "15",
                 "--seq-len", "64", "--global-batch-size", "4", "--micro-batch-size", "2",
                 "--lr", "3e-3", "--lr-warmup-steps", "2", "--save-hf", saved, "--save-dtype",
                 "bfloat16");
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, "step 15/15 | loss ");
    CHECK_CONTAINS(out, "tokens/s");
    CHECK_CONTAINS(out, "grad norm");
    double first = loss_at(out, "step 1/15"), last = loss_at(out, "step 15/15");
    CHECK_MSG(first > 6.5 && last < first - 1.0, "loss %g -> %g does not fall", first, last);
    free(out);
    /* the saved model is an HF directory in bf16 that loom reads back */
    CHECK_EQ_INT(RUN(&out, "inspect", saved), 0);
    CHECK_CONTAINS(out, "BF16");
    free(out);
}

TEST(cli_train_refuses_bad_input) {
    char data[1024], model[1024], *out;
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model), 1);
    CHECK_CONTAINS(out, "needs --model DIR");
    free(out);
    /* a file that is not a token file */
    tmp_path(data, sizeof data, "bad.tokens");
    FILE *f = fopen(data, "w");
    REQUIRE(f);
    fputs("hello", f);
    fclose(f);
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data), 1);
    CHECK_CONTAINS(out, "bad.tokens");
    free(out);
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--global-batch-size", "3",
                     "--micro-batch-size", "2"),
                 1);
    CHECK_CONTAINS(out, "not a multiple of micro_batch_size=2");
    free(out);
}

/* --ep and --etp reach the mesh from flags and config files, and are
 * checked against the model before anything is loaded. */
TEST(cli_train_expert_parallel_options) {
    char model[1024], data[1024], cfgpath[1024], *out;
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    tmp_path(data, sizeof data, "never-read.tokens");
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--ep",
                     "2"),
                 1);
    CHECK_CONTAINS(out, "ep                 2");
    CHECK_CONTAINS(out, "etp                0");
    CHECK_CONTAINS(out, "ep=2, etp=1: expert parallelism needs a mixture-of-experts model, and "
                        "this qwen3 model has no experts");
    free(out);
    const char *cfg = "{\"etp\": 2}";
    snprintf(cfgpath, sizeof cfgpath, "%s", loom_test_write("ep.json", cfg, strlen(cfg)));
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data,
                     "--config", cfgpath),
                 1);
    CHECK_CONTAINS(out, "etp                2");
    CHECK_CONTAINS(out, "config");
    CHECK_CONTAINS(out, "ep=1, etp=2: expert parallelism needs");
    free(out);
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--etp",
                     "-1"),
                 2);
    CHECK_CONTAINS(out, "--etp: -1 is out of range");
    free(out);
    CHECK_EQ_INT(RUN(&out, "golden", "--ep", "0"), 2);
    CHECK_CONTAINS(out, "--ep: 0 is out of range");
    free(out);
}

/* The MoE router's options (Megatron's names): the z-loss and a capacity
 * reach training from flags (the settings table, the log line, the metrics
 * file's z_loss), and bad values stop the run before any compute. */
TEST(cli_train_moe_router_options) {
    char model[1024], text[1024], data[1024], metrics[1024], *out;
    snprintf(model, sizeof model, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    tmp_path(text, sizeof text, "moe.txt");
    tmp_path(data, sizeof data, "moe.tokens");
    tmp_path(metrics, sizeof metrics, "moe-metrics.jsonl");
    FILE *f = fopen(text, "w");
    REQUIRE(f);
    for (int i = 0; i < 20; i++) fprintf(f, "experts route tokens %d ways.\n\n", i);
    fclose(f);
    REQUIRE(RUN(&out, "data", "--text", text, "--out", data) == 0);
    free(out);
    char tb[1024];
    tmp_path(tb, sizeof tb, "moe-tb");
    int rc = RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data,
                 "--train-steps", "2", "--seq-len", "32", "--global-batch-size", "2",
                 "--moe-z-loss-coeff", "1e-3", "--moe-expert-capacity-factor", "1.0",
                 "--moe-token-drop-policy", "position", "--metrics-file", metrics,
                 "--tensorboard-dir", tb);
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, " (imbalance "); /* with the layer that has it */
    CHECK_CONTAINS(out, ", layer ");
    CHECK_CONTAINS(out, "moe_z_loss_coeff");
    CHECK_CONTAINS(out, "moe_expert_capacity_factor");
    CHECK_CONTAINS(out, "position");
    CHECK_CONTAINS(out, "| z-loss ");
    free(out);
    /* a dispatch switch that is neither 0 nor 1 is named, and the run goes on */
    setenv("LOOM_MOE_DEDUP", "yes", 1);
    rc = RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps",
             "1", "--seq-len", "32", "--global-batch-size", "2");
    unsetenv("LOOM_MOE_DEDUP");
    CHECK_EQ_INT(rc, 0);
    CHECK_CONTAINS(out, "LOOM_MOE_DEDUP=yes: use 1 (the expert dispatch sends a row once per rank, "
                        "the default) or 0");
    free(out);
    char *json = NULL;
    size_t len = 0;
    loom_ctx *ctx;
    REQUIRE_OK(NULL, loom_ctx_create(&ctx));
    REQUIRE_OK(ctx, loom_read_file(ctx, metrics, 1 << 20, &json, &len));
    CHECK_MSG(strstr(json, "\"z_loss\": ") != NULL, "%s", json);
    /* per layer: every layer of tiny-qwen3-moe is sparse */
    CHECK_MSG(strstr(json, "\"moe_layers\": [0, 1, 2, 3], \"expert_tokens_min_by_layer\": [") != NULL,
              "%s", json);
    CHECK_CONTAINS(json, "\"expert_imbalance_by_layer\": [");
    free(json);
    const char *probe[] = {"python3", "-c", "import tensorboard", NULL};
    if (loom_test_run(NULL, probe) == 0) { /* the per-layer tags too */
        const char *chk[] = {"python3", "tests/tb_check.py", tb, metrics, NULL};
        char *o = NULL;
        CHECK_EQ_INT(loom_test_run(&o, chk), 0);
        CHECK_MSG(o && strstr(o, "ok: 17 tags"), "%s", o ? o : "");
        free(o);
    }
    loom_ctx_free(ctx);
    const char *bad[][3] = {
        {"--moe-z-loss-coeff", "-1", "moe_z_loss_coeff = -1"},
        {"--moe-expert-capacity-factor", "-0.5", "moe_expert_capacity_factor = -0.5"},
        {"--moe-token-drop-policy", "last", "is not one of probs|position"}};
    for (int i = 0; i < 3; i++) {
        rc = RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, bad[i][0],
                 bad[i][1]);
        CHECK_MSG(rc != 0 && out && strstr(out, bad[i][2]) && !strstr(out, "step 1/"), "%s: %s",
                  bad[i][0], out ? out : "");
        free(out);
    }
}

/* golden on the fixture batch reproduces the HF fixture. */
TEST(cli_golden_matches_fixture) {
    char model[1024], batch[1024], outf[1024], *out;
    snprintf(model, sizeof model, "%s/models/tiny-qwen2", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen2.safetensors", loom_test_fixtures());
    tmp_path(outf, sizeof outf, "golden.safetensors");
    CHECK_EQ_INT(RUN(&out, "golden", "--device", "cpu", "--model", model, "--batch", batch, "--out", outf), 0);
    CHECK_CONTAINS(out, "over 41 tokens");
    free(out);
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_safetensors *got, *ref;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, outf, &got));
    REQUIRE_OK(ctx, loom_st_open_file(ctx, batch, &ref));
    int compared = 0;
    for (size_t i = 0; i < loom_st_count(got); i++) {
        const loom_st_tensor *t = loom_st_at(got, i);
        const loom_st_tensor *r = loom_st_find(ref, t->name);
        if (!strcmp(t->name, "loss")) {
            float l;
            CHECK_EQ_INT(t->ndim, 0);
            CHECK_OK(ctx, loom_st_read(ctx, t, LOOM_F32, &l, 1));
            CHECK_NEAR(l, 7.0, 1.0);
            continue;
        }
        REQUIRE(r);
        CHECK_EQ_INT(t->numel, r->numel);
        float *a = malloc(t->numel * 4), *b = malloc(t->numel * 4);
        CHECK_OK(ctx, loom_st_read(ctx, t, LOOM_F32, a, t->numel));
        CHECK_OK(ctx, loom_st_read(ctx, r, LOOM_F32, b, r->numel));
        double md = 0, mr = 0;
        for (uint64_t k = 0; k < t->numel; k++) {
            md = fmax(md, fabs((double)a[k] - b[k]));
            mr = fmax(mr, fabs((double)b[k]));
        }
        CHECK_MSG(md <= 1e-4 * mr, "%s: relative error %.3g", t->name, md / mr);
        compared++;
        free(a);
        free(b);
    }
    CHECK_EQ_INT(compared, 3 + 51); /* logits, token_logprobs, entropy, 51 gradients */
    loom_st_close(got);
    loom_st_close(ref);
    loom_ctx_free(ctx);
}

/* Packed documents through golden: cu_seqlens and position_ids are read. */
TEST(cli_golden_packed_batch) {
    char model[1024], ref_path[1024], batch[1024], outf[1024], *out;
    snprintf(model, sizeof model, "%s/models/tiny-llama", loom_test_fixtures());
    snprintf(ref_path, sizeof ref_path, "%s/golden/tiny-llama.safetensors", loom_test_fixtures());
    tmp_path(batch, sizeof batch, "packed.safetensors");
    tmp_path(outf, sizeof outf, "out.safetensors");
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    loom_safetensors *ref;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, ref_path, &ref));
    int32_t ids[28], pos[28], cu[4], tgt[28];
    float want[28], tlp[28];
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(ref, "packed.input_ids"), LOOM_I32, ids, 28));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(ref, "packed.position_ids"), LOOM_I32, pos, 28));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(ref, "packed.cu_seqlens"), LOOM_I32, cu, 4));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(ref, "packed.token_logprobs"), LOOM_F32, want, 28));
    for (int d = 0; d < 3; d++)
        for (int t = cu[d]; t < cu[d + 1]; t++) tgt[t] = t + 1 < cu[d + 1] ? ids[t + 1] : -100;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", loom_test_tmpdir());
    loom_st_writer *w;
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "packed", 0, NULL, &w));
    int64_t sh[2] = {1, 28}, shc[1] = {4};
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "input_ids", LOOM_I64, 2, sh));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "targets", LOOM_I64, 2, sh));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "position_ids", LOOM_I64, 2, sh));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "cu_seqlens", LOOM_I32, 1, shc));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "input_ids", LOOM_I32, ids));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "targets", LOOM_I32, tgt));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "position_ids", LOOM_I32, pos));
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "cu_seqlens", LOOM_I32, cu));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    CHECK_EQ_INT(RUN(&out, "golden", "--device", "cpu", "--model", model, "--batch", batch, "--out", outf), 0);
    free(out);
    loom_safetensors *got;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, outf, &got));
    REQUIRE_OK(ctx, loom_st_read(ctx, loom_st_find(got, "token_logprobs"), LOOM_F32, tlp, 28));
    for (int t = 0; t < 28; t++) CHECK_NEAR(tlp[t], want[t], 1e-4 * fabs(want[t]) + 1e-6);
    loom_st_close(got);
    loom_st_close(ref);
    loom_ctx_free(ctx);
}

TEST(cli_golden_refuses_bad_batches) {
    char model[1024], batch[1024], outf[1024], *out;
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    tmp_path(batch, sizeof batch, "b.safetensors");
    tmp_path(outf, sizeof outf, "o.safetensors");
    loom_ctx *ctx;
    REQUIRE(!loom_ctx_create(&ctx));
    /* targets missing; then targets of another shape; then an id past the vocabulary */
    for (int c = 0; c < 3; c++) {
        loom_st_writer *w;
        REQUIRE_OK(ctx, loom_st_writer_create(ctx, loom_test_tmpdir(), "b", 0, NULL, &w));
        int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, c == 2 ? 4000 : 8}, tgt[8] = {2, 3, 4, 5, 6, 7, 8, -100};
        int64_t sh[2] = {1, 8}, sh2[2] = {2, 4};
        CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "input_ids", LOOM_I32, 2, sh));
        if (c) CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "targets", LOOM_I32, 2, c == 1 ? sh2 : sh));
        CHECK_OK(ctx, loom_st_writer_write(ctx, w, "input_ids", LOOM_I32, ids));
        if (c) CHECK_OK(ctx, loom_st_writer_write(ctx, w, "targets", LOOM_I32, tgt));
        REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
        loom_st_writer_free(w);
        CHECK_EQ_INT(RUN(&out, "golden", "--device", "cpu", "--model", model, "--batch", batch, "--out", outf), 1);
        CHECK_CONTAINS(out, c == 0 ? "has no tensor 'targets'"
                            : c == 1 ? "'targets' has shape [2, 4] but input_ids has [1, 8]"
                                     : "input_ids[0, 7] = 4000 is outside the vocabulary");
        free(out);
    }
    loom_ctx_free(ctx);
}

/* LoRA from the command line: a fresh adapter trains (the loss falls), is
 * saved as PEFT files, continues from them, and merges into an HF export. */
TEST(cli_train_lora) {
    char model[1024], text[1024], data[1024], adapter[1024], merged[1024], *out;
    tmp_path(model, sizeof model, "tiny");
    tmp_path(text, sizeof text, "corpus.txt");
    tmp_path(data, sizeof data, "corpus.tokens");
    tmp_path(adapter, sizeof adapter, "adapter");
    tmp_path(merged, sizeof merged, "merged");
    FILE *f = fopen(text, "w");
    REQUIRE(f);
    for (int i = 0; i < 30; i++) fprintf(f, "abc abc abc %d\n\n", i % 3);
    fclose(f);
    REQUIRE(RUN(&out, "init", "--out", model, "--log-level", "warn") == 0);
    free(out);
    REQUIRE(RUN(&out, "data", "--text", text, "--out", data) == 0);
    free(out);
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps", "12",
                     "--seq-len", "32", "--global-batch-size", "4", "--lr", "1e-2", "--lora-r",
                     "8", "--lora-alpha", "16", "--save-adapter", adapter),
                 0);
    CHECK_CONTAINS(out, "LoRA r=8 alpha=16 on all-linear");
    double first = loss_at(out, "step 1/12"), last = loss_at(out, "step 12/12");
    CHECK_MSG(last < first - 0.5, "LoRA loss %g -> %g does not fall", first, last);
    free(out);
    char p[1100];
    snprintf(p, sizeof p, "%s/adapter_config.json", adapter);
    CHECK(loom_file_exists(p));
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--train-steps", "2",
                     "--seq-len", "32", "--global-batch-size", "4", "--adapter", adapter,
                     "--merge-lora", "--save-hf", merged),
                 0);
    CHECK_CONTAINS(out, "loaded; the base model is frozen");
    free(out);
    CHECK_EQ_INT(RUN(&out, "inspect", merged), 0);
    free(out);
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cpu", "--model", model, "--data", data, "--lora-r", "4",
                     "--lora-target", "q_proj,bogus"),
                 1);
    CHECK_CONTAINS(out, "'bogus' is not one loom knows");
    free(out);
}

/* --device cuda where no GPU can be used: a clear error, nothing run. */
TEST(cli_train_device_cuda_without_gpu) {
    if (loom_test_have_gpu()) SKIP("a GPU is visible");
    char *out = NULL;
    CHECK_EQ_INT(RUN(&out, "train", "--device", "cuda", "--model", "/nonexistent-model", "--data",
                     "/nonexistent.tokens"),
                 1);
    CHECK_MSG(out && (strstr(out, "built without CUDA") || strstr(out, "--device cuda")), "%s",
              out ? out : "");
    CHECK_CONTAINS(out, "--device cpu");
    free(out);
    /* and bf16 on the CPU is refused with the reason */
    char model[1024], batch[1024], outf[1100];
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    snprintf(batch, sizeof batch, "%s/golden/tiny-qwen3.safetensors", loom_test_fixtures());
    snprintf(outf, sizeof outf, "%s/o.safetensors", loom_test_tmpdir());
    CHECK_EQ_INT(RUN(&out, "golden", "--device", "cpu", "--dtype", "bf16", "--model", model,
                     "--batch", batch, "--out", outf),
                 1);
    CHECK_CONTAINS(out, "the CPU backend computes in F32");
    free(out);
}
