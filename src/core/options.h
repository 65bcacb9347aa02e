/* The option table: one row per setting (name, type, default, help, where it
 * is stored). It drives the `loom` flags (--max-shard-size 2GB), the JSON
 * config file (--config FILE: {"max_shard_size": "2GB"}; flags override it)
 * and the settings table printed at start. Adding a setting is adding a
 * field to loom_settings and a row to the table in options.c. */
#ifndef LOOM_OPTIONS_H
#define LOOM_OPTIONS_H

#include "core.h"
#include "json.h"

/* Commands, as bits: a row lists the commands that take it as a flag. */
enum {
    LOOM_CMD_INSPECT = 1u << 0,
    LOOM_CMD_INIT = 1u << 1,
    LOOM_CMD_CONVERT = 1u << 2,
    LOOM_CMD_TRAIN = 1u << 3,
    LOOM_CMD_GOLDEN = 1u << 4,
    LOOM_CMD_DATA = 1u << 5,
    LOOM_CMD_TOKENIZE = 1u << 6,
    LOOM_CMD_PLOT = 1u << 7,
    LOOM_CMD_ALL = 0xffffffffu,
};

typedef enum loom_opt_type {
    LOOM_OPT_BOOL,
    LOOM_OPT_INT,    /* int64 */
    LOOM_OPT_FLOAT,  /* double */
    LOOM_OPT_STRING, /* char *, owned */
    LOOM_OPT_CHOICE, /* char *, one of `choices` ("a|b|c") */
    LOOM_OPT_SIZE,   /* int64 bytes; "5GB" = 5e9, "2GiB" = 2^31, plain bytes */
} loom_opt_type;

typedef enum loom_opt_source { LOOM_SRC_DEFAULT = 0, LOOM_SRC_CONFIG, LOOM_SRC_FLAG } loom_opt_source;

typedef struct loom_option {
    const char *name;    /* JSON key; the flag is --name with '_' -> '-' */
    loom_opt_type type;
    const char *def;     /* default, as flag text; NULL: unset */
    const char *help;
    size_t offset;       /* offsetof(loom_settings, field) */
    const char *choices; /* CHOICE only */
    unsigned commands;   /* LOOM_CMD_* bits */
    int64_t min, max;    /* INT / SIZE range (inclusive), when min < max */
} loom_option;

typedef struct loom_settings {
    char *config;          /* --config: JSON file of settings */
    char *model;           /* model directory */
    char *out;             /* output directory */
    char *preset;          /* built-in model shape for `init` / `inspect` */
    char *save_dtype;      /* dtype of written weights */
    int64_t max_shard_size;/* bytes per safetensors shard */
    int64_t seed;          /* random seed */
    double init_embedding_std; /* init: the token embedding's std (0: initializer_range) */
    char *format;          /* output format of inspect: text | json */
    char *log_level;       /* error | warn | info | debug */
    char *text;            /* data: UTF-8 text file to encode */
    char *inspect;         /* data: .tokens file to describe */
    /* train / golden */
    char *data;            /* .tokens file to train on */
    char *batch;           /* golden: safetensors file with input_ids and targets */
    char *config_override; /* JSON object replacing keys of config.json */
    char *save_hf;         /* train: write the trained model here */
    /* training checkpoints (train) */
    char *save;            /* checkpoints go here: DIR/iter_0000100/, latest_checkpointed_iteration.txt */
    int64_t save_interval; /* a checkpoint every this many steps (0: only at the end and on SIGTERM) */
    int64_t save_keep;     /* keep the newest this many (0: all) */
    char *load;            /* resume from DIR's newest complete checkpoint, or DIR/iter_... */
    bool finetune;         /* --load takes the weights only (step 0, a fresh optimizer) */
    char *from_checkpoint; /* convert: a training checkpoint (root, iter_ dir or saved state) */
    char *to;              /* convert --from-checkpoint: hf | peft */
    int64_t train_steps;
    int64_t seq_len;
    int64_t micro_batch_size;
    int64_t global_batch_size;
    double lr, min_lr;
    int64_t lr_warmup_steps, lr_decay_steps;
    char *lr_decay_style;
    double weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad;
    int64_t log_interval;
    /* parallel layout (train, golden) */
    int64_t tp, cp, dp, pp, vpp;
    int64_t ep, etp;            /* expert parallel (MoE); etp 0: tp */
    int64_t microbatch_group;   /* interleaved pipeline: Megatron's microbatch_group_size_per_vp_stage */
    double comm_timeout;        /* seconds a collective may wait (0: forever) */
    bool sequence_parallel;
    /* golden */
    int64_t num_micro_batches, steps, accumulation_steps;
    /* LoRA */
    char *adapter;         /* PEFT adapter directory to load (train: continue it) */
    int64_t lora_r;        /* train: add a fresh adapter of this rank (0: full fine-tuning) */
    double lora_alpha;
    char *lora_target;
    bool use_rslora;
    char *save_adapter;    /* train: write the adapter here (PEFT) */
    bool merge_lora;       /* train: --save-hf writes the base with the adapter merged */
    /* JSONL data (train) and `loom tokenize` */
    char *tokenizer;       /* tokenize: directory with tokenizer.json (and a chat template) */
    int64_t data_seed;     /* train: seed of the per-epoch shuffle of JSONL samples */
    char *truncation;      /* train: samples longer than seq_len: error | left | right | drop */
    char *bad_lines;       /* train: malformed JSONL lines: stop | skip (counted) */
    bool append_eos;       /* train: append EOS to "text" and "completion" samples */
    /* device (train, golden) */
    char *device;          /* auto | cpu | cuda */
    char *dtype;           /* compute dtype: auto (bf16 on GPUs, fp32 on CPU) | bf16 | fp16 | fp32 */
    char *recompute;       /* activation recomputation: none | mlp | full */
    char *moe_aux_loss;    /* MoE load-balancing loss: global | per-layer */
    double moe_z_loss_coeff; /* MoE router z-loss coefficient (0: off) */
    double moe_expert_capacity_factor; /* MoE experts' capacity factor (0: dropless) */
    char *moe_token_drop_policy; /* MoE choices over capacity dropped: probs | position */
    bool moe_router_force_load_balancing; /* MoE, benchmarks: random router logits */
    bool profile;                         /* time each part of every step */
    int64_t nproc_per_node;/* train/golden: start this many local GPU workers (0: this process) */
    char *mesh;            /* inspect: predict per-rank memory on this mesh ("tp=2,pp=2,dp=2,sp") */
    /* watching a run (train) */
    char *metrics_file;    /* train: JSONL, one object per logged step (appended to) */
    char *tensorboard_dir; /* train: TensorBoard event files go here */
    bool progress;         /* train: a live progress line when stderr is a terminal */
    loom_opt_source src[96]; /* where each row's value came from, by row index */
} loom_settings;

const loom_option *loom_options(size_t *count);
const loom_option *loom_option_find(const char *name); /* by JSON key or flag name */

/* Sets every row to its default. */
loom_status loom_settings_init(loom_ctx *ctx, loom_settings *s);
void loom_settings_free(loom_settings *s);

/* Applies one value given as text (flag syntax) to the named row. `what`
 * names the origin in errors ("--seed", "run.json"). */
loom_status loom_settings_set(loom_ctx *ctx, loom_settings *s, const loom_option *opt,
                              const char *value, loom_opt_source src, const char *what);
/* Applies a JSON object of settings ({"seed": 3, "max_shard_size": "2GB"}).
 * Unknown keys are refused with a suggestion; values must have the row's
 * type (numbers for INT/FLOAT, booleans for BOOL, strings otherwise; SIZE
 * takes a number of bytes or a string with a unit). */
loom_status loom_settings_apply_json(loom_ctx *ctx, loom_settings *s, const loom_json *obj,
                                     const char *what);

/* Parses the arguments of a command (argv[0] is the first argument after the
 * command name). --config FILE is applied first wherever it appears, then the
 * flags in order, so flags override the file. Accepts --name VALUE,
 * --name=VALUE, and for BOOL --name / --no-name. Arguments that do not start
 * with "--" are returned in positional (at most max_positional; the array
 * points into argv). A flag that is not in the table, or not taken by this
 * command, is refused with the closest known name suggested. */
loom_status loom_settings_parse_args(loom_ctx *ctx, loom_settings *s, unsigned command, int argc,
                                     char **argv, const char **positional, int max_positional,
                                     int *n_positional);

/* Prints the settings a command uses: name, value, and where it came from. */
void loom_settings_print(const loom_ctx *ctx, const loom_settings *s, unsigned command);
/* Prints the flags of a command with their defaults and help. */
void loom_options_help(FILE *f, unsigned command);

/* Parses a size with an optional unit (B, KB, MB, GB, TB = powers of 1000;
 * KiB, MiB, GiB, TiB = powers of 1024). Returns false on bad text. */
bool loom_parse_size(const char *text, int64_t *out);

#endif /* LOOM_OPTIONS_H */
