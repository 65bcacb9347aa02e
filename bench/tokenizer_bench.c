/* Tokenizer throughput on one thread: encodes a text file N times with
 * loom's tokenizer and prints MB/s (10^6 bytes of input per second).
 *
 *   tokenizer_bench TOKENIZER TEXT [--repeat N] [--lines] [--add-special]
 *                   [--fresh] [--ids-out FILE]
 *
 * TOKENIZER is a tokenizer.json or a directory holding one. --lines encodes
 * every line of the file (split at '\n', the newline dropped) as its own
 * text, as a data pipeline encodes documents; otherwise the whole file is one
 * text. --add-special applies the post-processor (HF's add_special_tokens).
 * Texts are encoded with one loom_tokenizer_encoder (its word cache lives
 * across texts, as HF's does); --fresh uses loom_tokenizer_encode_ex, a new
 * workspace per text, instead. --ids-out writes the ids of the first pass, one line of space-separated
 * ids per text, for bench/tokenizer_bench.py to compare with Hugging Face.
 * The last line of output is machine-readable:
 *   loom_mb_per_s=<float> tokens=<n> bytes=<n> seconds=<float> */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../src/data/tokenizer.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int usage(void) {
    fprintf(stderr, "usage: tokenizer_bench TOKENIZER TEXT [--repeat N] [--lines] [--add-special] "
                    "[--fresh] [--ids-out FILE]\n");
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 3) return usage();
    const char *tok_path = argv[1], *text_path = argv[2], *ids_out = NULL;
    int repeat = 5;
    bool lines = false, add_special = false, fresh = false;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--lines")) lines = true;
        else if (!strcmp(argv[i], "--add-special")) add_special = true;
        else if (!strcmp(argv[i], "--fresh")) fresh = true;
        else if (!strcmp(argv[i], "--ids-out") && i + 1 < argc) ids_out = argv[++i];
        else return usage();
    }
    if (repeat < 1) repeat = 1;
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 1;
    double t0 = now();
    loom_tokenizer *tok;
    if (loom_tokenizer_load(ctx, tok_path, &tok) != LOOM_OK) {
        fprintf(stderr, "tokenizer_bench: %s\n", loom_last_error(ctx));
        return 1;
    }
    double t_load = now() - t0;
    char *text;
    size_t len;
    if (loom_read_file(ctx, text_path, 0, &text, &len) != LOOM_OK) {
        fprintf(stderr, "tokenizer_bench: %s\n", loom_last_error(ctx));
        return 1;
    }
    /* the texts: the whole file, or its lines */
    size_t n_docs = 1, cap = 1;
    size_t *start = malloc(sizeof *start), *dlen = malloc(sizeof *dlen);
    start[0] = 0;
    dlen[0] = len;
    if (lines) {
        n_docs = 0;
        for (size_t a = 0; a <= len;) {
            const char *nl = memchr(text + a, '\n', len - a);
            size_t e = nl ? (size_t)(nl - text) : len;
            if (n_docs == cap) {
                cap *= 2;
                start = realloc(start, cap * sizeof *start);
                dlen = realloc(dlen, cap * sizeof *dlen);
            }
            start[n_docs] = a;
            dlen[n_docs++] = e - a;
            a = e + 1;
        }
    }
    FILE *out = NULL;
    if (ids_out && !(out = fopen(ids_out, "w"))) {
        fprintf(stderr, "tokenizer_bench: cannot write %s\n", ids_out);
        return 1;
    }
    loom_tokenizer_encoder *enc;
    if (loom_tokenizer_encoder_create(ctx, tok, &enc) != LOOM_OK) {
        fprintf(stderr, "tokenizer_bench: %s\n", loom_last_error(ctx));
        return 1;
    }
    int64_t tokens = 0;
    double best = 1e300, total = 0, first = 0;
    for (int r = 0; r < repeat; r++) {
        double t1 = now();
        for (size_t d = 0; d < n_docs; d++) {
            int32_t *ids;
            int64_t n;
            loom_status st =
                fresh ? loom_tokenizer_encode_ex(ctx, tok, text + start[d], dlen[d], add_special,
                                                 &ids, &n)
                      : loom_tokenizer_encoder_encode(ctx, enc, text + start[d], dlen[d],
                                                      add_special, &ids, &n);
            if (st != LOOM_OK) {
                fprintf(stderr, "tokenizer_bench: text %zu: %s\n", d, loom_last_error(ctx));
                return 1;
            }
            if (r == 0) {
                tokens += n;
                if (out) {
                    for (int64_t i = 0; i < n; i++) fprintf(out, i ? " %d" : "%d", ids[i]);
                    fputc('\n', out);
                }
            }
            free(ids);
        }
        double dt = now() - t1;
        total += dt;
        if (dt < best) best = dt;
        if (r == 0) first = dt;
    }
    if (out) fclose(out);
    double mbs = (double)len / 1e6 / best;
    printf("tokenizer: %s (%lld ids, loaded in %.3f s)\n", tok_path,
           (long long)loom_tokenizer_vocab_size(tok), t_load);
    printf("text: %s: %zu bytes, %zu text(s), %lld tokens (%.2f bytes/token)\n", text_path, len,
           n_docs, (long long)tokens, tokens ? (double)len / (double)tokens : 0.0);
    printf("encode (%s), one thread, best of %d: %.3f s = %.2f MB/s (mean %.3f s; first pass "
           "%.3f s = %.2f MB/s)\n",
           fresh ? "a fresh workspace per text" : "one encoder", repeat, best, mbs, total / repeat,
           first, (double)len / 1e6 / first);
    printf("loom_mb_per_s=%.4f tokens=%lld bytes=%zu seconds=%.6f\n", mbs, (long long)tokens, len,
           best);
    loom_tokenizer_encoder_free(enc);
    free(start);
    free(dlen);
    free(text);
    loom_tokenizer_free(tok);
    loom_ctx_free(ctx);
    return 0;
}
