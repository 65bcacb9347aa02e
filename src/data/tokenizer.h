/* Hugging Face tokenizer.json, byte-level BPE as Qwen2, Qwen3, Llama 3 and
 * GPT-2 use it, with the ids Hugging Face `tokenizers` gives (checked id for
 * id against 0.23.3): NFC normalizer (or none), Split pre-tokenizers with
 * one of their regular expressions followed by ByteLevel (or a ByteLevel
 * pre-tokenizer with use_regex), BPE merges ("a b" strings or ["a", "b"]
 * pairs, ignore_merges, unk_token), added and special tokens matched before
 * everything else (lstrip, rstrip, normalized), a TemplateProcessing
 * post-processor, ByteLevel decoding. Unicode as HF has it: letter, number
 * and white-space classes of Unicode 16.0 (Oniguruma 6.9.10), NFC with the
 * Unicode 9.0 tables of the crate HF normalizes with (tools/gen_unicode.py).
 * Anything else (other models, normalizers, pre-tokenizers, regexes,
 * post-processors, byte_fallback, dropout, single_word tokens, truncation,
 * padding ...) is refused when loading, with the field named: loom never
 * approximates a tokenizer. */
#ifndef LOOM_TOKENIZER_H
#define LOOM_TOKENIZER_H

#include "../core/core.h"

typedef struct loom_tokenizer loom_tokenizer;

/* Reads <dir>/tokenizer.json (or the file itself when path is a file). */
loom_status loom_tokenizer_load(loom_ctx *ctx, const char *path, loom_tokenizer **out);
/* Parses an in-memory tokenizer.json; `what` names it in errors (fuzzing, tests). */
loom_status loom_tokenizer_parse(loom_ctx *ctx, const char *json, size_t len, const char *what,
                                 loom_tokenizer **out);
void loom_tokenizer_free(loom_tokenizer *t);

/* Encodes UTF-8 text (invalid UTF-8 is an error naming the byte offset).
 * Special and added tokens in the text are recognised (as HF does with
 * split_special_tokens=False). *ids is malloc'd (caller frees). */
loom_status loom_tokenizer_encode(loom_ctx *ctx, const loom_tokenizer *t, const char *text,
                                  size_t len, int32_t **ids, int64_t *n);
/* The same with the post-processor applied when add_special_tokens (HF's
 * encode(text, add_special_tokens=True), its default: e.g. Llama 3's
 * <|begin_of_text|>). loom_tokenizer_encode is add_special_tokens = false:
 * the tokens of the text itself, what chat templates (which write their own
 * special tokens) need. For Qwen2/Qwen3 tokenizers the two are the same. */
loom_status loom_tokenizer_encode_ex(loom_ctx *ctx, const loom_tokenizer *t, const char *text,
                                     size_t len, bool add_special_tokens, int32_t **ids,
                                     int64_t *n);
/* A reusable encoding workspace for one thread: it remembers the words it
 * has encoded (as HF's BPE cache does; up to about 130,000 words, some
 * 10 MB), so
 * that many short texts (documents, lines) encode several times faster than
 * with loom_tokenizer_encode, which makes a fresh one per call. The
 * tokenizer must outlive it. Results are identical either way. */
typedef struct loom_tokenizer_encoder loom_tokenizer_encoder;
loom_status loom_tokenizer_encoder_create(loom_ctx *ctx, const loom_tokenizer *t,
                                          loom_tokenizer_encoder **out);
void loom_tokenizer_encoder_free(loom_tokenizer_encoder *e);
loom_status loom_tokenizer_encoder_encode(loom_ctx *ctx, loom_tokenizer_encoder *e,
                                          const char *text, size_t len, bool add_special_tokens,
                                          int32_t **ids, int64_t *n);
/* Decodes ids back to UTF-8 text (malloc'd, NUL-terminated); special tokens
 * are kept (skip_special_tokens=False). Unknown ids are an error. Bytes that
 * do not form UTF-8 (a character cut between ids) become U+FFFD, as in HF. */
loom_status loom_tokenizer_decode(loom_ctx *ctx, const loom_tokenizer *t, const int32_t *ids,
                                  int64_t n, char **text);
/* The same, with the length (the text may hold NUL bytes); len may be NULL. */
loom_status loom_tokenizer_decode_n(loom_ctx *ctx, const loom_tokenizer *t, const int32_t *ids,
                                    int64_t n, char **text, size_t *len);

int64_t loom_tokenizer_vocab_size(const loom_tokenizer *t); /* largest id + 1 */
/* Id of a token string (vocabulary or added token), -1 when absent. */
int32_t loom_tokenizer_token_id(const loom_tokenizer *t, const char *token);
/* The string of an id as tokenizer.json spells it (byte-level characters for
 * vocabulary tokens, the content for added tokens; not NUL-terminated: *len
 * bytes), NULL for an id that names nothing. Valid while t lives. */
const char *loom_tokenizer_id_to_token(const loom_tokenizer *t, int32_t id, size_t *len);
/* Whether id is an added token marked special. */
bool loom_tokenizer_is_special(const loom_tokenizer *t, int32_t id);

#endif /* LOOM_TOKENIZER_H */
