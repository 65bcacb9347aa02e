/* include/loom.h's loom_encoder: one sample (a JSON object, as `loom train`
 * reads JSONL) to ids and a loss mask, with a model's tokenizer and chat
 * template. A thin public face of the dataset encoder (dataset.h), so a
 * caller (the Python package) tokenizes exactly as `loom train` does. */
#include "dataset.h"
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

struct loom_encoder {
    loom_dataset_encoder *e;
};

loom_status loom_encoder_create(loom_ctx *ctx, const char *dir, loom_encoder **out) {
    if (!dir || !out)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_encoder_create: NULL argument");
    *out = NULL;
    loom_encoder *enc = loom_calloc(ctx, 1, sizeof *enc, "encoder");
    if (!enc) return LOOM_ERR_OOM;
    loom_status st = loom_dataset_encoder_load(ctx, dir, &enc->e);
    if (st) {
        free(enc);
        return st;
    }
    *out = enc;
    return LOOM_OK;
}

void loom_encoder_free(loom_encoder *enc) {
    if (!enc) return;
    loom_dataset_encoder_free(enc->e);
    free(enc);
}

loom_status loom_encoder_encode(loom_ctx *ctx, const loom_encoder *enc, const char *json,
                                size_t len, int append_eos, int32_t **ids, uint8_t **mask,
                                int64_t *n) {
    if (!enc || !json || !ids || !mask || !n)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_encoder_encode: NULL argument");
    *ids = NULL, *mask = NULL, *n = 0;
    loom_sample s;
    loom_status st = loom_sample_parse(ctx, json, len, "sample", &s);
    if (st) return st;
    bool mismatch = false;
    int32_t *out_ids = NULL;
    uint8_t *out_mask = NULL;
    int64_t cnt = 0;
    st = loom_dataset_encode(ctx, enc->e, &s, append_eos != 0, &out_ids, &out_mask, &cnt,
                             &mismatch);
    loom_sample_free(&s);
    if (st) return st;
    if (!out_mask) { /* text: every token is predicted */
        out_mask = loom_malloc(ctx, cnt > 0 ? (size_t)cnt : 1, "loss mask");
        if (!out_mask) {
            free(out_ids);
            return LOOM_ERR_OOM;
        }
        memset(out_mask, 1, (size_t)cnt);
    }
    *ids = out_ids, *mask = out_mask, *n = cnt;
    return LOOM_OK;
}

loom_status loom_encoder_decode(loom_ctx *ctx, const loom_encoder *enc, const int32_t *ids,
                                int64_t n, char **text) {
    if (!enc || (!ids && n) || n < 0 || !text)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loom_encoder_decode: bad argument");
    if (!enc->e->tokenizer)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED, "loom_encoder_decode: no tokenizer loaded");
    return loom_tokenizer_decode(ctx, enc->e->tokenizer, ids, n, text);
}

int64_t loom_encoder_vocab_size(const loom_encoder *enc) { return enc->e->vocab_size; }
int32_t loom_encoder_eos_id(const loom_encoder *enc) { return enc->e->eos_id; }
const char *loom_encoder_chat_error(const loom_encoder *enc) {
    return enc->e->encode_chat ? NULL : enc->e->chat_error;
}

void loom_free(void *p) { free(p); }
