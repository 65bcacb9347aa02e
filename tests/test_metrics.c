/* Watching a run: CRC32C and the TensorBoard event encoding, the metrics
 * JSONL line, MFU's FLOPs, the progress line; `loom train --metrics-file
 * --tensorboard-dir` read back by TensorBoard (tests/tb_check.py), and
 * `loom plot`. */
#include <stdlib.h>
#include <dirent.h>

#include "../src/core/json.h"
#include "../src/io/hf_config.h"
#include "../src/io/tfevents.h"
#include "../src/model/params.h"
#include "../src/train/metrics.h"
#include "harness.h"

#define RUN(out, ...) loom_test_run(out, (const char *const[]){__VA_ARGS__, NULL})

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static const char *tmp(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", loom_test_tmpdir(), name);
    return buf;
}

static bool bytes_eq(const loom_sb *sb, const uint8_t *want, size_t n) {
    return sb->len == n && !memcmp(sb->buf, want, n);
}

TEST(metrics_crc32c_vectors) {
    CHECK_EQ_INT(loom_crc32c(0, "123456789", 9), 0xE3069283u);
    CHECK_EQ_INT(loom_crc32c(0, "", 0), 0);
    uint8_t z[32] = {0}, f[32];
    memset(f, 0xff, sizeof f);
    CHECK_EQ_INT(loom_crc32c(0, z, 32), 0x8A9136AAu); /* RFC 3720 B.4 */
    CHECK_EQ_INT(loom_crc32c(0, f, 32), 0x62A8AB43u);
    /* continuing over a split gives the whole */
    CHECK_EQ_INT(loom_crc32c(loom_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
}

TEST(metrics_tfevents_encoding) {
    loom_sb sb;
    loom_sb_init(&sb);
    /* Event{wall_time 1.5, step 3, summary{value{tag "a", simple_value 2}}} */
    loom_tb_scalar v = {"a", 2.0};
    loom_tfevents_encode(&sb, 1.5, 3, NULL, &v, 1);
    const uint8_t ev[] = {0x09, 0, 0, 0, 0, 0, 0, 0xF8, 0x3F, 0x10, 0x03, 0x2A, 0x0A, 0x0A, 0x08,
                          0x0A, 0x01, 'a', 0x15, 0, 0, 0, 0x40};
    CHECK_MSG(bytes_eq(&sb, ev, sizeof ev), "scalar event: %zu bytes, not the expected", sb.len);
    /* the version event; a negative step is a 10-byte varint */
    sb.len = 0;
    loom_tfevents_encode(&sb, 2.0, 0, "brain.Event:2", NULL, 0);
    const uint8_t ver[] = {0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x10, 0x00, 0x1A, 13,
                           'b', 'r', 'a', 'i', 'n', '.', 'E', 'v', 'e', 'n', 't', ':', '2'};
    CHECK(bytes_eq(&sb, ver, sizeof ver));
    sb.len = 0;
    loom_tfevents_encode(&sb, 0, -1, "x", NULL, 0);
    CHECK_EQ_INT(sb.len, 9 + 1 + 10 + 3);
    /* framing: length, masked CRC of it, data, masked CRC of the data
     * (the CRCs from tests/tb_check.py's own CRC32C) */
    sb.len = 0;
    loom_tfrecord_frame(&sb, "abc", 3);
    const uint8_t rec[] = {3, 0, 0, 0, 0, 0, 0, 0, 0xb0, 0x99, 0x49, 0x0e,
                           'a', 'b', 'c', 0x6e, 0x57, 0xf1, 0x21};
    CHECK_MSG(bytes_eq(&sb, rec, sizeof rec), "record of \"abc\" differs");
    CHECK_EQ_INT(loom_crc32c_mask(0), 0xa282ead8u);
    CHECK(!sb.failed);
    loom_sb_free(&sb);
}

TEST(metrics_jsonl_line) {
    loom_ctx *ctx = new_ctx();
    loom_metrics_record r = {.step = 7, .consumed_samples = 28, .consumed_tokens = 896,
                             .loss = 2.5, .grad_norm = NAN, .lr = 3e-4, .tokens_per_s = INFINITY,
                             .mfu = NAN, .peak_mem_bytes = -1, .skipped_steps = 2,
                             .elapsed_s = 1.25};
    loom_sb sb;
    loom_sb_init(&sb);
    loom_metrics_jsonl(&sb, &r);
    CHECK_STR(sb.buf, "{\"step\": 7, \"consumed_samples\": 28, \"consumed_tokens\": 896, "
                      "\"loss\": 2.5, \"grad_norm\": null, \"lr\": 0.0003, \"tokens_per_s\": null, "
                      "\"skipped_steps\": 2, \"elapsed_s\": 1.25}\n");
    /* with mfu and peak memory: both present, and the line is JSON */
    r.mfu = 0.4125;
    r.peak_mem_bytes = 123456789012;
    r.grad_norm = 0.1;
    sb.len = 0;
    loom_metrics_jsonl(&sb, &r);
    loom_json *doc = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, sb.buf, sb.len, "line", &doc));
    CHECK_NEAR(loom_json_get(doc, "mfu")->d, 0.4125, 0);
    CHECK_EQ_INT(loom_json_get(doc, "peak_mem_bytes")->i, 123456789012);
    CHECK_NEAR(loom_json_get(doc, "grad_norm")->d, 0.1, 0);
    CHECK(loom_json_get(doc, "tokens_per_s")->type == LOOM_JSON_NULL);
    CHECK(!loom_json_get(doc, "aux_loss")); /* a dense model has no MoE keys */
    loom_json_free(doc);
    /* a mixture of experts: its five keys, last */
    r.moe = true;
    r.aux_loss = 2.25, r.expert_tokens_min = 3, r.expert_tokens_mean = 12;
    r.expert_tokens_max = 30, r.expert_imbalance = 2.5;
    sb.len = 0;
    loom_metrics_jsonl(&sb, &r);
    CHECK(strstr(sb.buf, "\"elapsed_s\": 1.25, \"aux_loss\": 2.25, \"expert_tokens_min\": 3, "
                         "\"expert_tokens_mean\": 12, \"expert_tokens_max\": 30, "
                         "\"expert_imbalance\": 2.5}\n") != NULL);
    /* with the router z-loss on: z_loss after them */
    r.z = true, r.z_loss = 21.5;
    sb.len = 0;
    loom_metrics_jsonl(&sb, &r);
    CHECK(strstr(sb.buf, "\"expert_imbalance\": 2.5, \"z_loss\": 21.5}\n") != NULL);
    /* per layer: 3 layers of 4 experts, the middle one dense (no tokens) */
    const double cnt[12] = {1, 2, 3, 6, 0, 0, 0, 0, 4, 4, 4, 4};
    r.expert_tokens = cnt, r.layers = 3, r.experts = 4;
    sb.len = 0;
    loom_metrics_jsonl(&sb, &r);
    CHECK(strstr(sb.buf, "\"z_loss\": 21.5, \"moe_layers\": [0, 2], "
                         "\"expert_tokens_min_by_layer\": [1, 4], "
                         "\"expert_tokens_mean_by_layer\": [3, 4], "
                         "\"expert_tokens_max_by_layer\": [6, 4], "
                         "\"expert_imbalance_by_layer\": [2, 1]}\n") != NULL);
    REQUIRE_OK(ctx, loom_json_parse(ctx, sb.buf, sb.len, "line", &doc));
    CHECK(loom_json_get(doc, "expert_imbalance_by_layer") != NULL);
    loom_json_free(doc);
    /* --profile: the step's time by kind, last */
    r.prof = (loom_step_breakdown){.steps = 2, .compute_ms = 12.5, .comm_ms = 2.25,
                                   .bubble_ms = 0.5, .idle_ms = 0.125};
    sb.len = 0;
    loom_metrics_jsonl(&sb, &r);
    CHECK(strstr(sb.buf, "\"expert_imbalance_by_layer\": [2, 1], \"compute_ms\": 12.5, "
                         "\"exposed_comm_ms\": 2.25, \"bubble_ms\": 0.5, \"idle_ms\": 0.125}\n") !=
          NULL);
    CHECK_STR(loom_metrics_tb_tag("bubble_ms"), "time/bubble_ms");
    loom_expert_layer_stats ls;
    loom_expert_layer_stats_of(cnt + 4, 4, &ls);
    CHECK(ls.min == 0 && ls.max == 0 && ls.mean == 0 && ls.imbalance == 0);
    CHECK_STR(loom_metrics_tb_tag("z_loss"), "z_loss");
    CHECK_STR(loom_metrics_tb_tag("expert_imbalance"), "moe/expert_imbalance");
    CHECK_STR(loom_metrics_tb_tag("loss"), "lm loss");
    CHECK_STR(loom_metrics_tb_tag("lr"), "learning-rate");
    CHECK(loom_metrics_tb_tag("step") == NULL);
    loom_sb_free(&sb);
    loom_ctx_free(ctx);
}

TEST(metrics_flops_and_peaks) {
    loom_ctx *ctx = new_ctx();
    /* Qwen3-0.6B at S=4096: bench/README.md's 4.99 GFLOP/token (N = 596,049,920;
     * attention 6 L S Hq D = 1,409,286,144) */
    loom_json *doc = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, loom_preset_config("qwen3-0.6b"),
                                    strlen(loom_preset_config("qwen3-0.6b")), "preset", &doc));
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_parse(ctx, doc, "qwen3-0.6b", &cfg));
    CHECK_NEAR(loom_flops_per_token(&cfg, 4096, false), 6.0 * 596049920 + 1409286144.0, 0);
    CHECK_NEAR(loom_flops_per_token(&cfg, 4096, true), 4.0 * 596049920 + 1409286144.0, 0);
    loom_config_free(&cfg);
    loom_json_free(doc);
    CHECK_NEAR(loom_gpu_peak_flops("NVIDIA H100 80GB HBM3"), 989e12, 0);
    CHECK_NEAR(loom_gpu_peak_flops("NVIDIA H200"), 989e12, 0);
    CHECK_NEAR(loom_gpu_peak_flops("NVIDIA H100 PCIe"), 756e12, 0);
    CHECK_NEAR(loom_gpu_peak_flops("NVIDIA GeForce RTX 4090"), 0, 0);
    CHECK(loom_max_rss_bytes() > 1000000);
    loom_ctx_free(ctx);
}

TEST(metrics_progress_line_and_eta) {
    char b[32];
    CHECK_STR(loom_fmt_duration(b, 45.2), "45s");
    CHECK_STR(loom_fmt_duration(b, 723), "12m03s");
    CHECK_STR(loom_fmt_duration(b, 3 * 3600 + 7 * 60 + 10), "3h07m");
    CHECK_STR(loom_fmt_duration(b, 2 * 86400 + 5 * 3600), "2d05h");
    CHECK_STR(loom_fmt_duration(b, NAN), "--");
    CHECK_STR(loom_fmt_duration(b, -1), "--");
    /* step 1 ended at t=10 (its start-up cost left out); 10 more steps took 5 s */
    CHECK(isnan(loom_eta_s(1, 100, 10.0, 10.0)));
    CHECK_NEAR(loom_eta_s(11, 100, 10.0, 15.0), 0.5 * 89, 1e-9);
    CHECK_NEAR(loom_eta_s(100, 100, 10.0, 60.0), 0, 0);
    char line[256];
    loom_progress_line(line, sizeof line, 120, 1000, 2.31, 1234.4, 723, 0);
    CHECK_STR(line, "step 120/1000 [==>                 ]  12%  loss 2.3100  1,234 tok/s  "
                    "ETA 12m03s");
    CHECK(!strchr(line, '\r') && !strchr(line, '\n'));
    loom_progress_line(line, sizeof line, 1000, 1000, NAN, 5, 0, 0);
    CHECK_CONTAINS(line, "[====================] 100%  loss nan  5 tok/s  ETA 0s");
    loom_progress_line(line, sizeof line, 5, 10, 1, 1, NAN, 30); /* cut to the terminal */
    CHECK_EQ_INT(strlen(line), 30);
}

static int count_lines(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    fclose(f);
    return n;
}

/* The single event file in dir (path into buf), how many there are. */
static int event_files(const char *dir, char *buf, size_t n) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int k = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "events.out.tfevents.", 20)) {
            snprintf(buf, n, "%s/%s", dir, e->d_name);
            k++;
        }
    closedir(d);
    return k;
}

static int train(char **out, const char *metrics, const char *tb, const char *steps) {
    char model[1024], data[1024];
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    tmp(data, sizeof data, "c.tokens");
    if (!loom_file_exists(data)) {
        char text[1024];
        FILE *f = fopen(tmp(text, sizeof text, "c.txt"), "w");
        if (!f) return -1;
        for (int i = 0; i < 40; i++) fprintf(f, "the quick brown fox %d.\n%s", i, i % 4 ? "" : "\n");
        fclose(f);
        char *o = NULL;
        int rc = RUN(&o, loom_test_bin(), "data", "--text", text, "--out", data);
        free(o);
        if (rc) return rc;
    }
    return RUN(out, loom_test_bin(), "train", "--device", "cpu", "--model", model, "--data", data,
               "--train-steps", steps, "--seq-len", "16", "--global-batch-size", "2",
               "--log-interval", "2", "--lr", "3e-3", "--metrics-file", metrics,
               "--tensorboard-dir", tb);
}

TEST(metrics_train_writes_jsonl_and_tensorboard) {
    loom_ctx *ctx = new_ctx();
    char metrics[1024], tb[1024], ev[1200], *out = NULL;
    tmp(metrics, sizeof metrics, "run.jsonl");
    tmp(tb, sizeof tb, "tb/sub");
    REQUIRE(train(&out, metrics, tb, "5") == 0);
    CHECK_CONTAINS(out, "metrics: appending to");
    CHECK_MSG(!strchr(out, '\r'), "a \\r in piped output: the progress line must stay off");
    CHECK(!strstr(out, "ETA"));
    free(out);
    /* steps 1, 2, 4 (the interval) and 5 (the last) */
    CHECK_EQ_INT(count_lines(metrics), 4);
    char *text = NULL;
    size_t len;
    REQUIRE_OK(ctx, loom_read_file(ctx, metrics, 0, &text, &len));
    char *last = strrchr(text, '{');
    loom_json *doc = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, last, strlen(last), "last line", &doc));
    static const char *keys[] = {"step", "consumed_samples", "consumed_tokens", "loss",
                                 "grad_norm", "lr", "tokens_per_s", "peak_mem_bytes",
                                 "skipped_steps", "elapsed_s"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        const loom_json *v = loom_json_get(doc, keys[i]);
        CHECK_MSG(v && v->type == LOOM_JSON_NUMBER, "key %s missing or not a number", keys[i]);
    }
    CHECK(!loom_json_get(doc, "mfu")); /* CPU: no MFU */
    CHECK_EQ_INT(loom_json_get(doc, "step")->i, 5);
    CHECK_EQ_INT(loom_json_get(doc, "consumed_samples")->i, 10);
    CHECK_EQ_INT(loom_json_get(doc, "consumed_tokens")->i, 160);
    CHECK(loom_json_get(doc, "peak_mem_bytes")->i > 1000000);
    loom_json_free(doc);
    free(text);
    REQUIRE(event_files(tb, ev, sizeof ev) == 1);

    const char *probe[] = {"python3", "-c", "import tensorboard", NULL};
    if (loom_test_run(NULL, probe) != 0) {
        loom_ctx_free(ctx);
        SKIP("python3 package tensorboard not installed (pip install tensorboard): the event "
             "files were not read back");
    }
    CHECK_EQ_INT(RUN(&out, "python3", "tests/tb_check.py", tb, metrics), 0);
    CHECK_CONTAINS(out, "ok: 9 tags, 4 steps");
    free(out);
    /* a second run appends to the JSONL and adds its own event file */
    REQUIRE(train(&out, metrics, tb, "3") == 0);
    free(out);
    CHECK_EQ_INT(count_lines(metrics), 4 + 3);
    CHECK_EQ_INT(event_files(tb, ev, sizeof ev), 2);
    CHECK_EQ_INT(RUN(&out, "python3", "tests/tb_check.py", tb, metrics), 0);
    free(out);
    /* a broken CRC is caught */
    REQUIRE_OK(ctx, loom_read_file(ctx, ev, 0, &text, &len));
    text[len - 1] ^= 0x5a;
    REQUIRE_OK(ctx, loom_write_file_atomic(ctx, ev, text, len));
    free(text);
    CHECK_EQ_INT(RUN(&out, "python3", "tests/tb_check.py", tb, metrics), 1);
    CHECK_CONTAINS(out, "bad data CRC");
    free(out);
    loom_ctx_free(ctx);
}

TEST(metrics_train_refuses_bad_outputs) {
    char metrics[1024], tb[1024], *out = NULL;
    /* a metrics file in a directory that does not exist: refused before the model loads */
    tmp(metrics, sizeof metrics, "no/such/dir/run.jsonl");
    tmp(tb, sizeof tb, "tb2");
    CHECK_EQ_INT(train(&out, metrics, tb, "2"), 1);
    CHECK_CONTAINS(out, "--metrics-file");
    CHECK_CONTAINS(out, "no/such/dir/run.jsonl: cannot open for appending");
    CHECK(!strstr(out, "layers, hidden")); /* the model was not loaded */
    free(out);
    /* a tensorboard dir that is a file */
    tmp(metrics, sizeof metrics, "ok.jsonl");
    loom_test_write("afile", "x", 1);
    tmp(tb, sizeof tb, "afile");
    CHECK_EQ_INT(train(&out, metrics, tb, "2"), 1);
    CHECK_CONTAINS(out, "--tensorboard-dir");
    CHECK_CONTAINS(out, "not a directory");
    free(out);
}

/* Runs `loom train` under script(1): stderr is then a terminal. */
TEST(metrics_progress_line_on_a_terminal) {
    const char *probe[] = {"script", "--version", NULL};
    if (loom_test_run(NULL, probe) != 0) SKIP("script (util-linux) not installed: no pty to test on");
    char model[1024], data[1024], metrics[1024], cmd[4096], *out = NULL;
    snprintf(model, sizeof model, "%s/models/tiny-qwen3", loom_test_fixtures());
    tmp(metrics, sizeof metrics, "tty.jsonl");
    REQUIRE(train(&out, metrics, tmp(data, sizeof data, "tb3"), "2") == 0); /* makes c.tokens */
    free(out);
    tmp(data, sizeof data, "c.tokens");
    snprintf(cmd, sizeof cmd,
             "%s train --device cpu --model %s --data %s --train-steps 4 --seq-len 16 "
             "--global-batch-size 2 --log-interval 3",
             loom_test_bin(), model, data);
    CHECK_EQ_INT(RUN(&out, "script", "-qec", cmd, "/dev/null"), 0);
    CHECK_CONTAINS(out, "\r\033[Kstep 1/4 [=====>");
    CHECK_CONTAINS(out, "ETA");
    CHECK_CONTAINS(out, "\r\033[Kstep 3/4 | loss"); /* the log line erased the progress line */
    CHECK_CONTAINS(out, "\r\033[Ktrained 4 steps");
    free(out);
    snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " --no-progress");
    CHECK_EQ_INT(RUN(&out, "script", "-qec", cmd, "/dev/null"), 0);
    CHECK(!strstr(out, "ETA"));
    free(out);
}
