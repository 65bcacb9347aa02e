/* loom data: make a token file from text with a byte-level demo encoder
 * (--text FILE --out OUT.tokens), or describe a token file (FILE.tokens or
 * --inspect FILE.tokens). The format is in docs/token-file.md. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

/* The byte-level demo vocabulary: byte b is id b. */
#define BYTE_VOCAB 256

static bool blank_byte(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

/* Finds the next document at or after *pos: a run of non-blank lines, from
 * the first byte of its first line to the last byte of its last line (the
 * final newline excluded). A line is blank when it is empty or holds only
 * spaces, tabs and carriage returns. Returns false when no document is left. */
static bool next_doc(const char *t, size_t len, size_t *pos, size_t *begin, size_t *end) {
    bool in_doc = false;
    size_t i = *pos;
    while (i < len) {
        size_t ls = i, le = i;
        bool blank = true;
        while (le < len && t[le] != '\n') {
            if (!blank_byte(t[le])) blank = false;
            le++;
        }
        i = le < len ? le + 1 : le;
        if (!blank) {
            if (!in_doc) *begin = ls;
            in_doc = true;
            *end = le;
        } else if (in_doc) {
            break;
        }
    }
    *pos = i;
    return in_doc;
}

static int encode_text(loom_ctx *ctx, const loom_settings *s) {
    if (!s->out || !*s->out) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "loom data --text needs --out OUT.tokens (where the token file is written)");
        return loom_cli_fail(ctx);
    }
    loom_settings_print(ctx, s, LOOM_CMD_DATA);
    char *text = NULL;
    size_t len = 0;
    if (loom_read_file(ctx, s->text, 0, &text, &len)) return loom_cli_fail(ctx);
    size_t n_docs = 0, n_tokens = 0, pos = 0, b, e;
    while (next_doc(text, len, &pos, &b, &e)) {
        n_docs++;
        n_tokens += e - b;
    }
    if (n_docs == 0) {
        free(text);
        loom_errf(ctx, LOOM_ERR_FORMAT,
                  "%s holds no text (%zu bytes, all blank lines): nothing to write; give a file "
                  "with at least one non-blank line",
                  s->text, len);
        return loom_cli_fail(ctx);
    }
    uint32_t *ids = loom_malloc(ctx, n_tokens * sizeof *ids, "token ids");
    uint64_t *offsets = loom_malloc(ctx, (n_docs + 1) * sizeof *offsets, "document offsets");
    loom_status st = ids && offsets ? LOOM_OK : LOOM_ERR_OOM;
    if (!st) {
        size_t d = 0, t = 0;
        offsets[0] = 0;
        pos = 0;
        while (next_doc(text, len, &pos, &b, &e)) {
            for (size_t i = b; i < e; i++) ids[t++] = (unsigned char)text[i];
            offsets[++d] = t;
        }
        st = loom_tokfile_write(ctx, s->out, ids, (int64_t)n_tokens, offsets, (int64_t)n_docs,
                                NULL, BYTE_VOCAB);
    }
    free(ids);
    free(offsets);
    free(text);
    if (st) return loom_cli_fail(ctx);
    char a[32], c[32];
    LOOM_LOG_I(ctx, "wrote %s: %s tokens in %s documents (byte-level ids, vocab_size %d)", s->out,
               loom_fmt_int(a, (int64_t)n_tokens), loom_fmt_int(c, (int64_t)n_docs), BYTE_VOCAB);
    return 0;
}

static int inspect(loom_ctx *ctx, const char *path) {
    loom_tokfile *tf;
    if (loom_tokfile_open(ctx, path, &tf)) return loom_cli_fail(ctx);
    int64_t n = loom_tokfile_n_tokens(tf), nd = loom_tokfile_n_docs(tf);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    uint64_t mn = UINT64_MAX, mx = 0;
    for (int64_t d = 0; d < nd; d++) {
        uint64_t l = off[d + 1] - off[d];
        if (l < mn) mn = l;
        if (l > mx) mx = l;
    }
    char a[32];
    printf("%s: loom token file, version %u\n", path, LOOM_TOKFILE_VERSION);
    printf("  n_tokens     %s\n", loom_fmt_int(a, n));
    printf("  n_docs       %s\n", loom_fmt_int(a, nd));
    if (loom_tokfile_vocab_size(tf))
        printf("  vocab_size   %" PRIu64 "\n", loom_tokfile_vocab_size(tf));
    else
        printf("  vocab_size   not recorded\n");
    printf("  max id       %" PRIu32 "\n", loom_tokfile_max_id(tf));
    printf("  doc length   mean %.2f, min %" PRIu64 ", max %" PRIu64 "\n", (double)n / (double)nd,
           mn, mx);
    const uint8_t *mask = loom_tokfile_mask(tf);
    if (mask) {
        int64_t on = 0;
        for (int64_t i = 0; i < n; i++) on += mask[i];
        printf("  loss mask    yes (%s of the tokens are predicted)\n", loom_fmt_int(a, on));
    } else {
        printf("  loss mask    no\n");
    }
    loom_tokfile_free(tf);
    return 0;
}

int loom_cmd_data(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    const char *file = s->inspect;
    if (npos > 0) {
        if (file) {
            loom_errf(ctx, LOOM_ERR_CONFIG,
                      "give the token file to describe once: as an argument or with --inspect");
            return loom_cli_fail(ctx);
        }
        file = pos[0];
    }
    if (file && s->text) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "give either --text FILE --out OUT.tokens (to encode) or a .tokens file (to "
                  "describe), not both");
        return loom_cli_fail(ctx);
    }
    if (file) return inspect(ctx, file);
    if (s->text) return encode_text(ctx, s);
    loom_errf(ctx, LOOM_ERR_CONFIG,
              "loom data needs --text FILE --out OUT.tokens (to encode text) or a .tokens file "
              "(to describe it)");
    return loom_cli_fail(ctx);
}
