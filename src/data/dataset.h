/* Datasets: JSONL samples tokenized once into a cached token file.
 *
 * A JSONL file holds one sample per line, a JSON object of one of the
 * shapes of TRL's dataset types (other keys are ignored):
 *
 *   {"messages": [{"role": "user", "content": "..."}, ...]}
 *       rendered with the model's chat template (chat.h) and tokenized; the
 *       loss mask is the template's assistant mask. Roles: system, user,
 *       assistant, tool; content must be a string. An optional "tools"
 *       beside "messages" goes to the template as apply_chat_template's
 *       tools=: a list of tool objects (JSON schemas), or that list
 *       JSON-encoded in a string (as datasets store it); null: none.
 *   {"text": "..."}
 *       tokenized; loss on every token. The tokenizer's EOS token is
 *       appended unless the text already ends with it (as TRL's SFTTrainer
 *       does for language-modeling data; append_eos = false turns it off).
 *   {"prompt": "...", "completion": "..."}
 *       prompt + completion tokenized as one text (EOS appended to the
 *       completion as for "text"); the loss mask is 0 on the first
 *       len(tokenize(prompt)) tokens and 1 after, as TRL computes its
 *       completion mask.
 *
 * Lines that are empty or hold only whitespace are skipped. Every problem
 * with a line is an error "FILE:LINE: ..." saying what is wrong: malformed
 * JSON (with the column), invalid UTF-8 (with the byte), not an object,
 * missing or conflicting fields, a field of the wrong type, an empty text or
 * conversation, an unknown role, a message without content, "tools" that
 * are not a list of objects (or beside "text" or "prompt"). With
 * LOOM_BAD_LINES_SKIP such lines are skipped and counted (the report has
 * the count and the first message); with LOOM_BAD_LINES_STOP the first one
 * stops the build.
 *
 * Samples longer than seq_len follow the truncation policy (loader.h):
 * error (the message names FILE:LINE and both lengths), left, right, drop.
 *
 * The token cache. FILE.jsonl is tokenized once into FILE.jsonl.<key>.tokens
 * (the format of tokens.h; the loss mask is stored when any sample has a 0
 * in it) and its build report FILE.jsonl.<key>.report.json. <key> is 16 hex
 * digits of a hash of: the JSONL file's size and modification time, the
 * encoder's fingerprint (the bytes of tokenizer.json, tokenizer_config.json
 * and chat_template.jinja, the chat template kind), the EOS id and
 * append_eos, seq_len and the truncation policy, the bad-lines policy, and
 * LOOM_DATASET_CACHE_VERSION. An unchanged file is read back without
 * tokenizing; any change makes a new key and a rebuild. Both files are
 * written atomically (the token file last), so a crash leaves no cache. */
#ifndef LOOM_DATA_DATASET_H
#define LOOM_DATA_DATASET_H

#include "../core/json.h"
#include "loader.h"
#include "tokens.h"

/* Bump when the way samples become tokens changes: old caches are rebuilt. */
#define LOOM_DATASET_CACHE_VERSION 2 /* 2: a row's "tools" is rendered (1 ignored it) */

typedef enum loom_bad_lines {
    LOOM_BAD_LINES_STOP = 0, /* the first bad line is an error */
    LOOM_BAD_LINES_SKIP,     /* bad lines are skipped and counted */
} loom_bad_lines;

/* "stop" | "skip" */
loom_status loom_bad_lines_parse(loom_ctx *ctx, const char *name, loom_bad_lines *out);

/* ---- one line ---- */

typedef enum loom_sample_kind {
    LOOM_SAMPLE_TEXT = 0,
    LOOM_SAMPLE_MESSAGES,
    LOOM_SAMPLE_PROMPT_COMPLETION,
} loom_sample_kind;

/* A parsed and validated line. The pointers point into `doc`. */
typedef struct loom_sample {
    loom_sample_kind kind;
    loom_json *doc;            /* the line's JSON object (owned) */
    const loom_json *messages; /* MESSAGES: a non-empty array of {role, content} */
    const loom_json *tools;    /* MESSAGES: NULL (none) or an array of objects */
    loom_json *tools_doc;      /* "tools" decoded from its JSON string (owned), or NULL */
    const char *text;          /* TEXT: non-empty */
    size_t text_len;
    const char *prompt;        /* PROMPT_COMPLETION: may be empty */
    size_t prompt_len;
    const char *completion;    /* PROMPT_COMPLETION: non-empty */
    size_t completion_len;
} loom_sample;

/* Parses and validates one line (without its newline). Errors are
 * LOOM_ERR_FORMAT and start with "<where>: " (where = "FILE:LINE").
 * On success free the sample with loom_sample_free. */
loom_status loom_sample_parse(loom_ctx *ctx, const char *line, size_t len, const char *where,
                              loom_sample *out);
void loom_sample_free(loom_sample *s);
/* Whether a line is empty or only whitespace (such lines are skipped). */
bool loom_line_blank(const char *line, size_t len);
/* Offset of the first byte that is not strict UTF-8, or len when all is. */
size_t loom_utf8_find_invalid(const char *s, size_t len);

/* ---- encoders ---- */

/* What turns samples into ids. The loaded one (loom_dataset_encoder_load)
 * wraps a tokenizer and chat template; tests build others. */
typedef struct loom_dataset_encoder {
    void *self;
    /* UTF-8 text to ids (*ids malloc'd). */
    loom_status (*encode_text)(loom_ctx *ctx, void *self, const char *text, size_t len,
                               int32_t **ids, int64_t *n);
    /* A conversation (and its tools, NULL: none) to ids and the assistant
     * mask per token (both malloc'd). NULL when there is no chat template;
     * chat_error says why. */
    loom_status (*encode_chat)(loom_ctx *ctx, void *self, const loom_json *messages,
                               const loom_json *tools, int32_t **ids, uint8_t **mask, int64_t *n);
    const char *chat_error;
    int32_t eos_id;        /* -1: the tokenizer has no EOS token */
    const char *eos_token; /* its text, NULL when none */
    int64_t vocab_size;    /* recorded in the token file (0: none) */
    uint64_t fingerprint;  /* changes whenever the ids of some sample may change */
    const struct loom_tokenizer *tokenizer; /* the loaded one's (decoding); NULL in tests */
} loom_dataset_encoder;

/* The encoder of a model or tokenizer directory (or a tokenizer.json path):
 * tokenizer.json; the chat template chosen by loom_chat_load (when none is
 * recognised, "messages" samples are refused with its reason); the EOS
 * token named by tokenizer_config.json's eos_token. */
loom_status loom_dataset_encoder_load(loom_ctx *ctx, const char *dir, loom_dataset_encoder **out);
void loom_dataset_encoder_free(loom_dataset_encoder *e);

/* One sample's ids and loss mask (1: the token is predicted), malloc'd.
 * *mask is NULL for TEXT (loss on every token). For PROMPT_COMPLETION,
 * *prompt_mismatch tells whether the prompt's own tokens were not a prefix
 * of the tokens of prompt + completion (TRL warns then too). */
loom_status loom_dataset_encode(loom_ctx *ctx, const loom_dataset_encoder *e, const loom_sample *s,
                                bool append_eos, int32_t **ids, uint8_t **mask, int64_t *n,
                                bool *prompt_mismatch);

/* ---- building ---- */

typedef struct loom_dataset_config {
    int64_t seq_len;            /* longest sample; 0: no limit */
    loom_truncation truncation; /* for samples longer than seq_len */
    loom_bad_lines bad_lines;
    bool append_eos;            /* to "text" and "completion" samples */
    /* Open the cache only, never build it (not part of the key): ranks other
     * than 0 of a job, once rank 0 has built it. */
    bool reuse_only;
} loom_dataset_config;

/* The defaults: seq_len 0, truncation error, bad lines stop, append_eos. */
loom_dataset_config loom_dataset_config_default(void);

typedef struct loom_dataset_report {
    int64_t lines;             /* lines read */
    int64_t blank_lines;       /* skipped: empty or whitespace */
    int64_t bad_lines;         /* skipped under LOOM_BAD_LINES_SKIP */
    int64_t samples;           /* kept */
    int64_t text, messages, prompt_completion; /* kept, by kind */
    int64_t truncated;         /* kept after truncation (left / right) */
    int64_t dropped;           /* longer than seq_len, dropped */
    int64_t no_loss;           /* kept, but no token is predicted */
    int64_t prompt_mismatch;   /* prompt tokens not a prefix of prompt + completion */
    int64_t tokens, loss_tokens;
    bool reused;               /* read from the cache */
    char first_bad[512];       /* message of the first skipped line, "" when none */
    char cache[1024];          /* the token file */
} loom_dataset_report;

/* Token arrays of a built dataset. */
typedef struct loom_token_data {
    uint32_t *ids;      /* (n_tokens) */
    uint64_t *offsets;  /* (n_docs + 1) */
    uint8_t *mask;      /* (n_tokens), NULL when every token is predicted */
    int64_t n_tokens, n_docs;
} loom_token_data;
void loom_token_data_free(loom_token_data *d);

/* Tokenizes the JSONL read from `f` (`name` names it in messages). Samples
 * are kept in file order. Refuses input with no sample left. */
loom_status loom_dataset_build(loom_ctx *ctx, FILE *f, const char *name,
                               const loom_dataset_encoder *e, const loom_dataset_config *cfg,
                               loom_token_data *out, loom_dataset_report *rep);

/* The cache key (see above) of a JSONL file. */
loom_status loom_dataset_cache_key(loom_ctx *ctx, const char *jsonl_path,
                                   const loom_dataset_encoder *e, const loom_dataset_config *cfg,
                                   uint64_t *key);

/* Opens the data of `path`: a .tokens file as it is; a JSONL file through
 * its cache (reused when its key matches, else built with `e`; e may be
 * NULL for .tokens). rep (may be NULL) says what was found or built. */
loom_status loom_dataset_open(loom_ctx *ctx, const char *path, const loom_dataset_encoder *e,
                              const loom_dataset_config *cfg, loom_tokfile **out,
                              loom_dataset_report *rep);
/* Whether a path names JSONL (ends in .jsonl). */
bool loom_dataset_is_jsonl(const char *path);

/* Logs the report: a line of counts (info), and warnings for skipped lines
 * (with the first message), dropped samples, samples without loss, prompt
 * mismatches. */
void loom_dataset_report_log(loom_ctx *ctx, const char *path, const loom_dataset_report *rep);

#endif /* LOOM_DATA_DATASET_H */
