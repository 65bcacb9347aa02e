/* The command line's smaller promises: `loom tokenize` on an empty text,
 * the warnings for --seq-len past max_position_embeddings and for an
 * adapter trained on another base, and `loom version`'s features line. */
#include <stdlib.h>
#include <unistd.h>

#include "../src/core/core.h"
#include "harness.h"

#define RUN(out, ...) loom_test_run(out, (const char *const[]){__VA_ARGS__, NULL})

static const char *fx(const char *rel) {
    static char bufs[4][1200];
    static int next;
    char *p = bufs[next++ % 4];
    snprintf(p, sizeof bufs[0], "%s/%s", loom_test_fixtures(), rel);
    return p;
}

static const char *tmp(const char *name) {
    static char bufs[4][1200];
    static int next;
    char *p = bufs[next++ % 4];
    snprintf(p, sizeof bufs[0], "%s/%s", loom_test_tmpdir(), name);
    return p;
}

/* {"text": ""} tokenizes to {"ids": []} (HF: tokenizer("")["input_ids"] is
 * []); the lines around it are unchanged, other refusals still refuse, and
 * training still refuses the empty sample with its file and line. */
TEST(cli_tokenize_empty_text) {
    const char *in = tmp("in.jsonl");
    const char *text = "{\"text\": \"Hello world\"}\n{\"text\": \"\"}\n{\"text\": \"\", \"x\": 1}\n";
    REQUIRE(loom_test_write("in.jsonl", text, strlen(text)));
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd, "%s tokenize --tokenizer %s < %s", loom_test_bin(), fx("tokenizer"), in);
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 0);
    CHECK_STR(out, "{\"ids\":[39,415,299,329,263,75,67]}\n{\"ids\":[]}\n{\"ids\":[]}\n");
    free(out);
    /* with another sample field it is still two shapes in one line */
    const char *two = "{\"text\": \"\", \"prompt\": \"a\", \"completion\": \"b\"}\n";
    REQUIRE(loom_test_write("in.jsonl", two, strlen(two)));
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 1);
    CHECK_CONTAINS(out, "stdin:1: has \"text\" and \"prompt\": give one of them");
    free(out);
    /* a non-string text keeps its own message */
    const char *num = "{\"text\": 5}\n";
    REQUIRE(loom_test_write("in.jsonl", num, strlen(num)));
    CHECK_EQ_INT(RUN(&out, "sh", "-c", cmd), 1);
    CHECK_CONTAINS(out, "stdin:1: \"text\" must be a string, got number");
    free(out);

    const char *empty = "{\"text\": \"fine\"}\n{\"text\": \"\"}\n";
    REQUIRE(loom_test_write("empty.jsonl", empty, strlen(empty)));
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model",
                     fx("models/tiny-qwen3"), "--data", tmp("empty.jsonl"), "--train-steps", "1",
                     "--seq-len", "32", "--global-batch-size", "1"),
                 1);
    CHECK_CONTAINS(out, "empty.jsonl:2: \"text\" is empty: there is nothing to train on");
    free(out);
}

/* --seq-len past config.json's max_position_embeddings (512 in the
 * fixtures) trains, with a warning naming both numbers; up to it, none. */
TEST(cli_seq_len_past_max_position_warns) {
    char *out;
    const char *data = "{\"text\": \"Hello world, hello loom.\"}\n";
    REQUIRE(loom_test_write("d.jsonl", data, strlen(data)));
    const char *model = fx("models/tiny-qwen3");
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data",
                     tmp("d.jsonl"), "--train-steps", "1", "--seq-len", "520",
                     "--global-batch-size", "1"),
                 0);
    CHECK_CONTAINS(out, "warning: --seq-len 520 exceeds the model's max_position_embeddings 512 (");
    CHECK_CONTAINS(out, "tiny-qwen3/config.json)");
    CHECK_CONTAINS(out, "step 1/1 | loss ");
    free(out);
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data",
                     tmp("d.jsonl"), "--train-steps", "1", "--seq-len", "512",
                     "--global-batch-size", "1"),
                 0);
    CHECK_MSG(!strstr(out, "max_position_embeddings"), "warned at seq_len 512: %s", out);
    free(out);
}

/* Copies the fixture adapter with base_model_name_or_path set to base. */
static const char *adapter_for(const char *name, const char *base) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx)) return NULL;
    char *cfg = NULL, *w = NULL;
    size_t len = 0, wlen = 0;
    const char *dir = tmp(name);
    char path[1400];
    bool ok = !loom_mkdirs(ctx, dir) &&
              !loom_read_file(ctx, fx("models/tiny-qwen3-lora/adapter_config.json"), 0, &cfg, &len) &&
              !loom_read_file(ctx, fx("models/tiny-qwen3-lora/adapter_model.safetensors"), 0, &w, &wlen);
    const char *key = "\"base_model_name_or_path\": \"tiny-qwen3\"";
    char *at = ok ? strstr(cfg, key) : NULL;
    if (at) {
        loom_sb sb;
        loom_sb_init(&sb);
        loom_sb_append(&sb, cfg, (size_t)(at - cfg));
        loom_sb_printf(&sb, "\"base_model_name_or_path\": \"%s\"", base);
        loom_sb_puts(&sb, at + strlen(key));
        snprintf(path, sizeof path, "%s/adapter_config.json", dir);
        ok = !sb.failed && !loom_write_file_atomic(ctx, path, sb.buf, sb.len);
        snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
        ok = ok && !loom_write_file_atomic(ctx, path, w, wlen);
        loom_sb_free(&sb);
    }
    free(cfg);
    free(w);
    loom_ctx_free(ctx);
    return at && ok ? dir : NULL;
}

static int golden(char **out, const char *model, const char *adapter) {
    return RUN(out, loom_test_bin(), "golden", "--device", "cpu", "--model", fx(model), "--batch",
               fx("golden/tiny-qwen3-lora.safetensors"), "--adapter", adapter, "--steps", "1",
               "--out", tmp("g.safetensors"));
}

/* An adapter whose base_model_name_or_path names another model than the one
 * it is loaded onto loads, with a warning: a hub id or path by its last
 * component, a local directory by its config.json's model_type. */
TEST(cli_adapter_other_base_warns) {
    char *out;
    /* the fixture says "tiny-qwen3": no warning on tiny-qwen3 */
    CHECK_EQ_INT(golden(&out, "models/tiny-qwen3", fx("models/tiny-qwen3-lora")), 0);
    CHECK_MSG(!strstr(out, "trained on"), "warned on its own base: %s", out);
    free(out);
    /* same shapes, another directory name */
    CHECK_EQ_INT(golden(&out, "models/tiny-qwen3-untied", fx("models/tiny-qwen3-lora")), 0);
    CHECK_CONTAINS(out, "adapter_config.json: the adapter was trained on tiny-qwen3, loading onto "
                        "tiny-qwen3-untied");
    free(out);
    /* a hub id: its last component, case aside */
    const char *hub = adapter_for("hub", "someone/Tiny-Qwen3");
    REQUIRE(hub);
    CHECK_EQ_INT(golden(&out, "models/tiny-qwen3", hub), 0);
    CHECK_MSG(!strstr(out, "trained on"), "warned for someone/Tiny-Qwen3: %s", out);
    free(out);
    const char *other = adapter_for("other", "Qwen/Qwen3-0.6B");
    REQUIRE(other);
    CHECK_EQ_INT(golden(&out, "models/tiny-qwen3/", other), 0);
    CHECK_CONTAINS(out, "the adapter was trained on Qwen/Qwen3-0.6B, loading onto tiny-qwen3;");
    free(out);
    /* a local directory: the model_type of its config.json (llama here) */
    char llama[1200];
    snprintf(llama, sizeof llama, "%s", fx("models/tiny-llama"));
    const char *local = adapter_for("local", llama);
    REQUIRE(local);
    CHECK_EQ_INT(golden(&out, "models/tiny-qwen3", local), 0);
    CHECK_CONTAINS(out, "(model_type llama), loading onto tiny-qwen3 (model_type qwen3)");
    free(out);
    /* and the same local directory as the base: nothing to say */
    char qwen[1200];
    snprintf(qwen, sizeof qwen, "%s", fx("models/tiny-qwen3-untied"));
    const char *same = adapter_for("same", qwen);
    REQUIRE(same);
    CHECK_EQ_INT(golden(&out, "models/tiny-qwen3", same), 0);
    CHECK_MSG(!strstr(out, "trained on"), "warned for a qwen3 directory: %s", out);
    free(out);
}

/* The features line names mpi exactly when the build has MPI (the tests are
 * compiled with the same flags as loom). */
TEST(cli_version_lists_mpi) {
    char *out;
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "version"), 0);
    const char *f = strstr(out, "features: cpu");
    REQUIRE(f);
    char line[256];
    snprintf(line, sizeof line, "%.*s", (int)strcspn(f, "\n"), f);
    strcat(line, " ");
#ifdef LOOM_HAVE_MPI
    CHECK_MSG(strstr(line, " mpi "), "no mpi in \"%s\" of an MPI build", line);
#else
    CHECK_MSG(!strstr(line, " mpi "), "mpi in \"%s\" of a build without MPI", line);
#endif
    free(out);
}

/* The directory names the adapter warning compares. */
TEST(cli_path_name) {
    char b[256], cwd[4096];
    CHECK_STR(loom_path_name("a/b/", b, sizeof b), "b");
    CHECK_STR(loom_path_name("Qwen/Qwen3-0.6B", b, sizeof b), "Qwen3-0.6B");
    CHECK_STR(loom_path_name("tiny", b, sizeof b), "tiny");
    CHECK_STR(loom_path_name("/", b, sizeof b), "/");
    REQUIRE(getcwd(cwd, sizeof cwd));
    const char *slash = strrchr(cwd, '/');
    CHECK_STR(loom_path_name(".", b, sizeof b), slash + 1);
    CHECK_STR(loom_path_name("tests/..", b, sizeof b), slash + 1);
}
