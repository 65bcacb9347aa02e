/* Chat encode: a rendered conversation to ids, and the assistant mask per
 * token as HF's return_assistant_tokens_mask computes it: from the token
 * that holds a span's first character to the token that holds its last one
 * (char_to_token of both ends), i.e. every token overlapping the span. */
#include "chat.h"

#include <stdlib.h>
#include <string.h>

/* Byte ranges of the tokens in their decoded text d (length nd): start[k],
 * len[k]. A token decodes to its own bytes; where single tokens do not (a
 * piece of a multi-byte character that the decoder replaces by U+FFFD), the
 * smallest group of tokens that does gets its bytes on its first token (HF
 * gives every token of a split character that character's offsets, and
 * char_to_token answers the first). */
static loom_status token_ranges(loom_ctx *ctx, const loom_tokenizer *t, const int32_t *ids,
                                int64_t n, const char *d, size_t nd, size_t *start, size_t *len) {
    size_t pos = 0;
    for (int64_t k = 0; k < n;) {
        int64_t m = k + 1;
        char *s = NULL;
        loom_status st;
        for (;; m++) {
            if ((st = loom_tokenizer_decode(ctx, t, ids + k, m - k, &s))) return st;
            size_t ls = strlen(s);
            bool fits = ls <= nd - pos && memcmp(d + pos, s, ls) == 0;
            if (fits || m == n) {
                if (!fits) {
                    free(s);
                    return loom_errf(ctx, LOOM_ERR_INTERNAL,
                                     "chat encode: token %lld does not decode to its place in "
                                     "the text", (long long)k);
                }
                for (int64_t q = k; q < m; q++) {
                    start[q] = q == k ? pos : pos + ls;
                    len[q] = q == k ? ls : 0;
                }
                pos += ls;
                free(s);
                break;
            }
            free(s);
        }
        k = m;
    }
    if (pos != nd)
        return loom_errf(ctx, LOOM_ERR_INTERNAL,
                         "chat encode: tokens decode to %zu bytes, the whole to %zu", pos, nd);
    return LOOM_OK;
}

loom_status loom_chat_encode(loom_ctx *ctx, const loom_chat *c, const loom_tokenizer *t,
                             const loom_json *messages, const loom_json *tools, int32_t **ids,
                             uint8_t **mask, int64_t *n) {
    if (!c || !t || !ids || !n)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_chat_encode: NULL argument");
    *ids = NULL;
    *n = 0;
    if (mask) *mask = NULL;
    char *text = NULL, *dec = NULL;
    uint8_t *bmask = NULL, *dmask = NULL, *tmask = NULL;
    int32_t *tok = NULL;
    size_t *start = NULL, *len = NULL;
    int64_t nt = 0;
    loom_status st = loom_chat_render(ctx, c, messages, tools, false, &text, &bmask);
    if (!st) st = loom_tokenizer_encode(ctx, t, text, strlen(text), &tok, &nt);
    if (st || !mask) goto done;
    if ((st = loom_tokenizer_decode(ctx, t, tok, nt, &dec))) goto done;
    size_t nd = strlen(dec), nx = strlen(text);
    start = loom_calloc(ctx, (size_t)nt + 1, sizeof *start, "chat encode");
    len = loom_calloc(ctx, (size_t)nt + 1, sizeof *len, "chat encode");
    tmask = loom_calloc(ctx, (size_t)nt + 1, 1, "chat encode");
    if (!start || !len || !tmask) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    if ((st = token_ranges(ctx, t, tok, nt, dec, nd, start, len))) goto done;

    /* The mask over the decoded text. It is the rendered text unless the
     * normalizer (NFC) changed something; then each run of equal mask is
     * normalized on its own: the runs start and end next to template text
     * (a newline or a special token), where normalization cannot reach
     * across. */
    if (nd == nx && memcmp(dec, text, nd) == 0) {
        dmask = bmask;
        bmask = NULL;
    } else {
        if (!(dmask = loom_malloc(ctx, nd + 1, "chat encode"))) {
            st = LOOM_ERR_OOM;
            goto done;
        }
        size_t dpos = 0;
        for (size_t a = 0; a < nx && !st;) {
            size_t b = a;
            while (b < nx && bmask[b] == bmask[a]) b++;
            int32_t *sid = NULL;
            int64_t sn = 0;
            char *sd = NULL;
            if (!(st = loom_tokenizer_encode(ctx, t, text + a, b - a, &sid, &sn)) &&
                !(st = loom_tokenizer_decode(ctx, t, sid, sn, &sd))) {
                size_t ls = strlen(sd);
                if (ls > nd - dpos || memcmp(dec + dpos, sd, ls) != 0)
                    st = loom_errf(ctx, LOOM_ERR_INTERNAL,
                                   "chat encode: the normalized text does not split at the "
                                   "assistant spans (byte %zu)", a);
                else memset(dmask + dpos, bmask[a], ls), dpos += ls;
            }
            free(sid);
            free(sd);
            a = b;
        }
        if (!st && dpos != nd)
            st = loom_errf(ctx, LOOM_ERR_INTERNAL,
                           "chat encode: the normalized pieces make %zu bytes, the text %zu",
                           dpos, nd);
        if (st) goto done;
    }

    /* HF: for each span, tokens from char_to_token(first char) to
     * char_to_token(last char): the tokens whose bytes meet [first byte,
     * first byte of the last character]. */
    int64_t k = 0;
    for (size_t a = 0; a < nd;) {
        if (!dmask[a]) {
            a++;
            continue;
        }
        size_t b = a;
        while (b < nd && dmask[b]) b++;
        size_t last = b - 1;
        while (last > a && ((unsigned char)dec[last] & 0xc0) == 0x80) last--;
        while (k < nt && (len[k] == 0 || start[k] + len[k] <= a)) k++;
        int64_t first_tok = k, last_tok = -1;
        for (int64_t q = k; q < nt && start[q] <= last; q++)
            if (len[q]) last_tok = q;
        for (int64_t q = first_tok; q <= last_tok; q++) tmask[q] = 1;
        a = b;
    }
done:
    if (!st) {
        *ids = tok;
        *n = nt;
        if (mask) {
            *mask = tmask;
            tmask = NULL;
        }
        tok = NULL;
    }
    free(text);
    free(dec);
    free(bmask);
    free(dmask);
    free(tmask);
    free(tok);
    free(start);
    free(len);
    return st;
}
