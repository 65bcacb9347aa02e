/* loom: command-line entry point. */
#include <stdlib.h>
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

static const loom_cli_cmd commands[] = {
    {"inspect", LOOM_CMD_INSPECT, "inspect [MODEL_DIR] [options]",
     "describe a model: architecture, parameters per component, tensors found vs expected "
     "(with --preset instead of a directory: a built-in shape)",
     loom_cmd_inspect, 1},
    {"init", LOOM_CMD_INIT, "init --out DIR [options]",
     "write a Hugging Face model directory with random weights of a built-in shape",
     loom_cmd_init, 0},
    {"train", LOOM_CMD_TRAIN, "train --model DIR --data FILE.tokens|FILE.jsonl [options]",
     "train a model on a token file or JSONL samples; print step, loss, grad norm, lr, tokens/s; "
     "--save-hf DIR writes the result", loom_cmd_train, 0},
    {"golden", LOOM_CMD_GOLDEN, "golden --model DIR --batch IN.safetensors --out OUT.safetensors",
     "run one batch and write logits, token log-probs, entropy, loss and every gradient",
     loom_cmd_golden, 0},
    {"convert", LOOM_CMD_CONVERT, "convert --model DIR --out DIR [options] | convert --from-checkpoint CK --to hf|peft --out DIR",
     "rewrite a checkpoint: change the dtype, re-shard, check every tensor on the way; or export a "
     "training checkpoint (loom train --save) as HF or PEFT files",
     loom_cmd_convert, 0},
    {"data", LOOM_CMD_DATA, "data --text FILE --out OUT.tokens\n       loom data FILE.tokens",
     "make a token file from text (byte-level demo encoder), or describe a token file",
     loom_cmd_data, 1},
    {"tokenize", LOOM_CMD_TOKENIZE, "tokenize --tokenizer DIR < samples.jsonl",
     "tokenize JSONL samples from stdin ({\"text\"}, {\"messages\"} or {\"prompt\", "
     "\"completion\"}): one line of ids (and the loss mask) per sample on stdout",
     loom_cmd_tokenize, 0},
    {"plot", LOOM_CMD_PLOT, "plot FILE.jsonl [--out FILE.svg|FILE.html]",
     "draw a --metrics-file: loss, grad norm, learning rate and tokens/s against the step, in "
     "one self-contained SVG (default: FILE.svg beside the input) or an HTML page (--out X.html)",
     loom_cmd_plot, 1},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *f) {
    fprintf(f, "loom %s: train and fine-tune Hugging Face LLMs\n\nusage: loom COMMAND [options]\n\n"
               "commands:\n", loom_version());
    for (size_t i = 0; i < N_COMMANDS; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].about);
    fprintf(f, "  %-10s %s\n", "version", "print the version and build features");
    fprintf(f, "\n'loom help COMMAND' lists the options of a command.\n");
}

static void command_help(FILE *f, const loom_cli_cmd *c) {
    fprintf(f, "usage: loom %s\n\n%s\n\noptions:\n", c->usage, c->about);
    loom_options_help(f, c->mask);
}

static const loom_cli_cmd *find_command(const char *name) {
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!strcmp(commands[i].name, name)) return &commands[i];
    return NULL;
}

static void version(void) {
    printf("loom %s\nfeatures: %s\n", loom_version(), loom_features());
#ifdef LOOM_HAVE_CUDA
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) == LOOM_OK) {
        loom_cuda_info info;
        if (loom_cuda_query(ctx, 0, &info) == LOOM_OK)
            printf("gpu 0: %s (sm_%d%d, %d of %d visible)\n", info.name, info.cc_major,
                   info.cc_minor, 1, info.device_count);
        else
            printf("gpu: %s\n", loom_last_error(ctx));
        printf("cuda runtime %d, cuBLASLt %zu, cuDNN %zu, NCCL %d\n", info.runtime_version,
               info.cublaslt_version, info.cudnn_version, info.nccl_version);
        loom_ctx_free(ctx);
    }
#endif
}

#ifndef __SANITIZE_ADDRESS__ /* sanitizer builds keep the sanitizer's own report */
/* A crash (a bug in loom) prints where it happened before dying, so that
 * a report can name the function: raw frames, resolvable with addr2line on
 * the same binary. */
static void on_fatal(int sig) {
    static const char msg[] = "loom: fatal signal; this is a bug in loom, please report it with "
                              "these frames:\n";
    ssize_t w = write(2, msg, sizeof msg - 1);
    (void)w;
    void *frames[48];
    int n = backtrace(frames, 48);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}
#endif

int main(int argc, char **argv) {
#ifndef __SANITIZE_ADDRESS__
    signal(SIGSEGV, on_fatal);
    signal(SIGBUS, on_fatal);
    signal(SIGFPE, on_fatal);
    signal(SIGILL, on_fatal);
#endif
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *name = argv[1];
    if (!strcmp(name, "-h") || !strcmp(name, "--help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(name, "version") || !strcmp(name, "--version")) {
        version();
        return 0;
    }
    if (!strcmp(name, "help")) {
        const loom_cli_cmd *c = argc > 2 ? find_command(argv[2]) : NULL;
        if (c)
            command_help(stdout, c);
        else
            usage(stdout);
        return 0;
    }
    const loom_cli_cmd *cmd = find_command(name);
    if (!cmd) {
        fprintf(stderr, "loom: error: unknown command '%s'\n\n", name);
        usage(stderr);
        return 2;
    }
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            command_help(stdout, cmd);
            return 0;
        }

    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) {
        fprintf(stderr, "loom: error: out of memory\n");
        return 1;
    }
    loom_settings s;
    const char *pos[8];
    int npos = 0, rc;
    if (loom_settings_init(ctx, &s) ||
        loom_settings_parse_args(ctx, &s, cmd->mask, argc - 2, argv + 2, pos, cmd->max_positional,
                                 &npos)) {
        fprintf(stderr, "loom %s: error: %s\n(see 'loom help %s')\n", cmd->name,
                loom_last_error(ctx), cmd->name);
        rc = 2;
    } else {
        static const char *levels[] = {"error", "warn", "info", "debug"};
        for (int l = 0; l < 4; l++)
            if (!strcmp(s.log_level, levels[l])) loom_ctx_set_log_level(ctx, (loom_log_level)l);
        rc = cmd->run(ctx, &s, npos, pos);
    }
    loom_settings_free(&s);
    loom_ctx_free(ctx);
    return rc;
}

int loom_cli_fail(loom_ctx *ctx) {
    fprintf(stderr, "loom: error: %s\n", loom_last_error(ctx));
    return 1;
}

loom_dtype loom_cli_save_dtype(const loom_settings *s, loom_dtype fallback) {
    if (!strcmp(s->save_dtype, "float32")) return LOOM_F32;
    if (!strcmp(s->save_dtype, "bfloat16")) return LOOM_BF16;
    if (!strcmp(s->save_dtype, "float16")) return LOOM_F16;
    return fallback;
}
