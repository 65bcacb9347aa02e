/* The option table and its three uses: flags, JSON config files, and the
 * settings table printed at start. */
#include "options.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define OFF(field) offsetof(loom_settings, field)
#define CMD_MODEL (LOOM_CMD_INSPECT | LOOM_CMD_CONVERT | LOOM_CMD_TRAIN | LOOM_CMD_GOLDEN)
#define CMD_TRAIN LOOM_CMD_TRAIN

static const loom_option table[] = {
    {"config", LOOM_OPT_STRING, NULL,
     "JSON file of settings (keys are the option names with '_'); flags override it",
     OFF(config), NULL, LOOM_CMD_ALL, 0, 0},
    {"model", LOOM_OPT_STRING, NULL,
     "Hugging Face model directory (config.json + *.safetensors)", OFF(model), NULL, CMD_MODEL,
     0, 0},
    {"out", LOOM_OPT_STRING, NULL, "output directory (data: the .tokens file; golden: the .safetensors file; plot: the .svg or .html file)", OFF(out), NULL,
     LOOM_CMD_INIT | LOOM_CMD_CONVERT | LOOM_CMD_DATA | LOOM_CMD_GOLDEN | LOOM_CMD_PLOT, 0, 0},
    {"preset", LOOM_OPT_CHOICE, "tiny-qwen3", "built-in model shape", OFF(preset),
     "tiny-qwen3|tiny-qwen2|tiny-llama|tiny-qwen3-moe|tiny-qwen2-moe|tiny-qwen3.5|qwen3-0.6b|"
     "qwen3-4b|qwen3-8b|qwen3-30b-a3b|qwen3.5-0.8b|qwen3.5-4b",
     LOOM_CMD_INIT | LOOM_CMD_INSPECT, 0, 0},
    {"save_dtype", LOOM_OPT_CHOICE, "auto",
     "dtype of the weights written (auto: as read; float32 for init)", OFF(save_dtype),
     "auto|float32|bfloat16|float16", LOOM_CMD_INIT | LOOM_CMD_CONVERT | CMD_TRAIN, 0, 0},
    {"max_shard_size", LOOM_OPT_SIZE, "5GB",
     "largest safetensors shard written (e.g. 5GB, 500MB, 2GiB)", OFF(max_shard_size), NULL,
     LOOM_CMD_INIT | LOOM_CMD_CONVERT | CMD_TRAIN, 1, INT64_MAX},
    {"seed", LOOM_OPT_INT, "1234", "random seed (init: the weights; train: a fresh LoRA "
     "adapter's A and its dropout)", OFF(seed), NULL, LOOM_CMD_INIT | LOOM_CMD_TRAIN, 0,
     INT64_MAX},
    {"init_embedding_std", LOOM_OPT_FLOAT, "0",
     "init: the token embedding's standard deviation (0: the config's initializer_range, as "
     "transformers initialises it; about 1 keeps tokens apart through random layers, so that "
     "a mixture of experts routes them to many experts instead of all to the same few)",
     OFF(init_embedding_std), NULL, LOOM_CMD_INIT, 0, 0},
    {"format", LOOM_OPT_CHOICE, "text", "output format", OFF(format), "text|json",
     LOOM_CMD_INSPECT, 0, 0},
    {"log_level", LOOM_OPT_CHOICE, "info", "log verbosity", OFF(log_level),
     "error|warn|info|debug", LOOM_CMD_ALL, 0, 0},
    {"text", LOOM_OPT_STRING, NULL,
     "text file to encode byte by byte (documents end at blank lines)", OFF(text), NULL,
     LOOM_CMD_DATA, 0, 0},
    {"inspect", LOOM_OPT_STRING, NULL, ".tokens file to describe (or give it as an argument)",
     OFF(inspect), NULL, LOOM_CMD_DATA, 0, 0},
    {"data", LOOM_OPT_STRING, NULL,
     "data to train on: FILE.tokens (docs/token-file.md) or FILE.jsonl (a sample per line: "
     "{\"messages\": ...}, {\"text\": ...} or {\"prompt\": ..., \"completion\": ...})",
     OFF(data), NULL, CMD_TRAIN, 0, 0},
    {"batch", LOOM_OPT_STRING, NULL,
     "safetensors file with input_ids and targets [B, S] (optional cu_seqlens, position_ids)",
     OFF(batch), NULL, LOOM_CMD_GOLDEN, 0, 0},
    {"config_override", LOOM_OPT_STRING, NULL,
     "JSON object whose keys replace those of config.json, e.g. '{\"num_hidden_layers\": 2}'",
     OFF(config_override), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN | LOOM_CMD_INSPECT | LOOM_CMD_INIT, 0, 0},
    {"save_hf", LOOM_OPT_STRING, NULL, "after training, write the model here as an HF directory",
     OFF(save_hf), NULL, CMD_TRAIN, 0, 0},
    {"save", LOOM_OPT_STRING, NULL,
     "write training checkpoints here (DIR/iter_0000100/ and latest_checkpointed_iteration.txt, "
     "as Megatron): at --save-interval, at the end, and when SIGTERM or SIGINT stops the run",
     OFF(save), NULL, CMD_TRAIN, 0, 0},
    {"save_interval", LOOM_OPT_INT, "0", "a checkpoint every this many steps (0: at the end and "
     "on SIGTERM only)", OFF(save_interval), NULL, CMD_TRAIN, 0, INT64_MAX},
    {"save_keep", LOOM_OPT_INT, "0", "keep only the newest this many checkpoints (0: all)",
     OFF(save_keep), NULL, CMD_TRAIN, 0, INT64_MAX},
    {"load", LOOM_OPT_STRING, NULL,
     "resume from the newest complete checkpoint in DIR (or from DIR/iter_...), on any mesh: "
     "weights, optimizer, step, schedule, data position", OFF(load), NULL, CMD_TRAIN, 0, 0},
    {"finetune", LOOM_OPT_BOOL, "false", "--load takes the weights only: step 0, a fresh "
     "optimizer, the data from its start", OFF(finetune), NULL, CMD_TRAIN, 0, 0},
    {"train_steps", LOOM_OPT_INT, "100", "optimizer steps", OFF(train_steps), NULL, CMD_TRAIN, 1,
     INT64_MAX},
    {"seq_len", LOOM_OPT_INT, "256", "tokens per row", OFF(seq_len), NULL, CMD_TRAIN | LOOM_CMD_INSPECT, 2,
     1 << 24},
    {"micro_batch_size", LOOM_OPT_INT, "1", "rows per micro-batch", OFF(micro_batch_size), NULL,
     CMD_TRAIN | LOOM_CMD_INSPECT, 1, 1 << 20},
    {"global_batch_size", LOOM_OPT_INT, "8",
     "rows per optimizer step (a multiple of micro_batch_size)", OFF(global_batch_size), NULL,
     CMD_TRAIN | LOOM_CMD_INSPECT, 1, 1 << 24},
    {"lr", LOOM_OPT_FLOAT, "1e-4", "peak learning rate (after warmup)", OFF(lr), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN,
     0, 0},
    {"min_lr", LOOM_OPT_FLOAT, "0", "learning rate at the end of the decay", OFF(min_lr), NULL,
     CMD_TRAIN, 0, 0},
    {"lr_warmup_steps", LOOM_OPT_INT, "0", "linear warmup from 0 over this many steps",
     OFF(lr_warmup_steps), NULL, CMD_TRAIN, 0, INT64_MAX},
    {"lr_decay_steps", LOOM_OPT_INT, "0", "decay ends after this many steps (0: train_steps)",
     OFF(lr_decay_steps), NULL, CMD_TRAIN, 0, INT64_MAX},
    {"lr_decay_style", LOOM_OPT_CHOICE, "linear", "shape of the decay (Megatron's styles)",
     OFF(lr_decay_style), "constant|linear|cosine|inverse-square-root|WSD|wsd", CMD_TRAIN, 0, 0},
    {"weight_decay", LOOM_OPT_FLOAT, "0.01", "AdamW weight decay (not on 1-D parameters)",
     OFF(weight_decay), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"adam_beta1", LOOM_OPT_FLOAT, "0.9", "AdamW beta1", OFF(adam_beta1), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"adam_beta2", LOOM_OPT_FLOAT, "0.999", "AdamW beta2", OFF(adam_beta2), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0,
     0},
    {"adam_eps", LOOM_OPT_FLOAT, "1e-8", "AdamW epsilon", OFF(adam_eps), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"clip_grad", LOOM_OPT_FLOAT, "1.0", "clip the global gradient norm to this (0: off)",
     OFF(clip_grad), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"log_interval", LOOM_OPT_INT, "1", "print a line every this many steps", OFF(log_interval),
     NULL, CMD_TRAIN, 1, INT64_MAX},
    {"tp", LOOM_OPT_INT, "1", "tensor-parallel size", OFF(tp), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN,
     1, 1 << 16},
    {"cp", LOOM_OPT_INT, "1", "context-parallel size", OFF(cp), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN,
     1, 1 << 16},
    {"dp", LOOM_OPT_INT, "0", "data-parallel size (0: the processes left by tp*cp*pp)", OFF(dp),
     NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 1 << 20},
    {"pp", LOOM_OPT_INT, "1", "pipeline-parallel size", OFF(pp), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN,
     1, 1 << 16},
    {"ep", LOOM_OPT_INT, "1",
     "expert-parallel size (MoE models): each MoE layer's experts are split over ep ranks, "
     "tokens reach them by all-to-all",
     OFF(ep), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 1, 1 << 16},
    {"etp", LOOM_OPT_INT, "0",
     "expert-tensor-parallel size (MoE models; 0: tp): each expert's width split over etp "
     "ranks. Expert layers fold a stage's tp*cp*dp ranks into etp x ep x edp",
     OFF(etp), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 1 << 16},
    {"vpp", LOOM_OPT_INT, "1", "model chunks per pipeline rank (interleaved 1F1B when > 1)",
     OFF(vpp), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 1, 64},
    {"microbatch_group_size_per_virtual_pipeline_stage", LOOM_OPT_INT, "0",
     "interleaved pipeline: micro-batches each model chunk runs in a row (Megatron's; 0: pp). "
     "Allows micro-batch counts that are not a multiple of pp: the last group must be whole or "
     "at least pp long",
     OFF(microbatch_group), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 1 << 20},
    {"comm_timeout", LOOM_OPT_FLOAT, "300",
     "seconds a collective or pipeline message may wait before every rank stops with the rank, "
     "the operation and the peer named (0: wait forever; LOOM_COMM_TIMEOUT sets it when the flag "
     "is not given)",
     OFF(comm_timeout), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"sequence_parallel", LOOM_OPT_BOOL, "false",
     "split the norms' tokens over tp (all-gather / reduce-scatter around them)",
     OFF(sequence_parallel), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"moe_aux_loss", LOOM_OPT_CHOICE, "global",
     "mixture of experts: the load-balancing loss router_aux_loss_coef scales: global "
     "(transformers', over all MoE layers) or per-layer (Megatron's aux_loss, summed over layers)",
     OFF(moe_aux_loss), "global|per-layer", CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"moe_z_loss_coeff", LOOM_OPT_FLOAT, "0",
     "mixture of experts: the router z-loss's coefficient (Megatron's; 0: off, 1e-3 a start): "
     "each MoE layer's mean lse(router logits)^2, summed over layers, times it is added to the "
     "loss",
     OFF(moe_z_loss_coeff), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"moe_expert_capacity_factor", LOOM_OPT_FLOAT, "0",
     "mixture of experts: each expert keeps at most ceil(tokens k / experts x this) of the "
     "choices of the tokens a rank routes together, the others dropped (Megatron's; 0: "
     "dropless); the experts' buffers are sized by it",
     OFF(moe_expert_capacity_factor), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN | LOOM_CMD_INSPECT, 0, 0},
    {"moe_token_drop_policy", LOOM_OPT_CHOICE, "probs",
     "mixture of experts with a capacity: drop the choices of the lowest routing weight (probs) "
     "or of the latest tokens (position)",
     OFF(moe_token_drop_policy), "probs|position", CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"moe_router_force_load_balancing", LOOM_OPT_BOOL, "false",
     "mixture of experts, benchmarks only (Megatron's): random router logits, a fixed stream per "
     "layer and token, spread the tokens evenly over the experts as a trained model's router "
     "does (random weights send nearly all to a few); the router gets no gradient",
     OFF(moe_router_force_load_balancing), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"profile", LOOM_OPT_BOOL, "false",
     "time each part of every step on the device (attention, MoE dispatch and all-to-alls, "
     "experts, recomputation, gradient reduce, optimizer) and print the table per rank at the end; "
     "the step's time by kind (compute, exposed communication, pipeline bubble, idle) in each "
     "step's log line and the metrics file",
     OFF(profile), NULL, CMD_TRAIN, 0, 0},
    {"recompute", LOOM_OPT_CHOICE, "none",
     "activation recomputation, memory for compute (same results): mlp recomputes each layer's "
     "gate, up and SwiGLU outputs before its backward; full keeps only each layer's input and "
     "runs its forward again",
     OFF(recompute), "none|mlp|full", CMD_TRAIN | LOOM_CMD_GOLDEN | LOOM_CMD_INSPECT, 0, 0},
    {"num_micro_batches", LOOM_OPT_INT, "1",
     "micro-batches each data-parallel rank cuts its rows into", OFF(num_micro_batches), NULL,
     LOOM_CMD_GOLDEN, 1, 1 << 20},
    {"steps", LOOM_OPT_INT, "0",
     "AdamW steps on the batch after the gradients (writes final.<name>, adamw_losses)",
     OFF(steps), NULL, LOOM_CMD_GOLDEN, 0, 1 << 20},
    {"accumulation_steps", LOOM_OPT_INT, "1",
     "forward_backward calls per step (the batch's rows cut into this many parts)",
     OFF(accumulation_steps), NULL, LOOM_CMD_GOLDEN, 1, 1 << 20},
    {"adapter", LOOM_OPT_STRING, NULL,
     "PEFT LoRA adapter directory to load (train: continue training it)", OFF(adapter), NULL,
     CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 0},
    {"lora_r", LOOM_OPT_INT, "0", "train a fresh LoRA adapter of this rank (0: full fine-tuning)",
     OFF(lora_r), NULL, CMD_TRAIN | LOOM_CMD_INSPECT, 0, 1 << 16},
    {"lora_alpha", LOOM_OPT_FLOAT, "0", "LoRA alpha (0: equal to r)", OFF(lora_alpha), NULL,
     CMD_TRAIN, 0, 0},
    {"lora_target", LOOM_OPT_STRING, "all-linear",
     "LoRA target modules: all-linear (every linear but the MoE router) or a list such as "
     "q_proj,v_proj; the router by name: all-linear,gate", OFF(lora_target), NULL,
     CMD_TRAIN | LOOM_CMD_INSPECT, 0, 0},
    {"use_rslora", LOOM_OPT_BOOL, "false", "rank-stabilised LoRA scale alpha/sqrt(r)",
     OFF(use_rslora), NULL, CMD_TRAIN, 0, 0},
    {"save_adapter", LOOM_OPT_STRING, NULL, "after training, write the LoRA adapter here (PEFT)",
     OFF(save_adapter), NULL, CMD_TRAIN, 0, 0},
    {"merge_lora", LOOM_OPT_BOOL, "false",
     "--save-hf writes the base with the trained adapter merged in (convert --to hf: the "
     "checkpoint's adapter merged into its base)", OFF(merge_lora), NULL,
     CMD_TRAIN | LOOM_CMD_CONVERT, 0, 0},
    {"from_checkpoint", LOOM_OPT_STRING, NULL,
     "convert a training checkpoint (a --save root, an iter_ directory, or a saved state), "
     "saved on any mesh, to HF or PEFT files (--to); --model: the base (default: the one it "
     "trained)", OFF(from_checkpoint), NULL, LOOM_CMD_CONVERT, 0, 0},
    {"to", LOOM_OPT_CHOICE, "hf", "convert --from-checkpoint: an HF model directory or a PEFT "
     "adapter", OFF(to), "hf|peft", LOOM_CMD_CONVERT, 0, 0},
    {"tokenizer", LOOM_OPT_STRING, NULL,
     "directory with tokenizer.json (and tokenizer_config.json, a chat template)", OFF(tokenizer),
     NULL, LOOM_CMD_TOKENIZE, 0, 0},
    {"data_seed", LOOM_OPT_INT, "1234", "seed of the shuffle of JSONL samples (a new order per epoch)",
     OFF(data_seed), NULL, CMD_TRAIN, 0, INT64_MAX},
    {"truncation", LOOM_OPT_CHOICE, "error",
     "JSONL samples longer than seq_len: error, keep the last (left) or first (right) seq_len "
     "tokens, or drop them (counted)",
     OFF(truncation), "error|left|right|drop", CMD_TRAIN, 0, 0},
    {"bad_lines", LOOM_OPT_CHOICE, "stop",
     "a malformed JSONL line stops the run, or is skipped and counted", OFF(bad_lines),
     "stop|skip", CMD_TRAIN, 0, 0},
    {"append_eos", LOOM_OPT_BOOL, "true",
     "append the tokenizer's EOS to JSONL \"text\" and \"completion\" samples (as TRL's SFTTrainer)",
     OFF(append_eos), NULL, CMD_TRAIN, 0, 0},
    {"device", LOOM_OPT_CHOICE, "auto",
     "where to compute: cuda (GPUs), cpu, or auto (cuda when loom was built with CUDA and a GPU "
     "is visible)",
     OFF(device), "auto|cpu|cuda", CMD_TRAIN | LOOM_CMD_GOLDEN | LOOM_CMD_INSPECT, 0, 0},
    {"dtype", LOOM_OPT_CHOICE, "auto",
     "compute dtype: bf16, fp16 (dynamic loss scaling) or fp32; auto: bf16 on GPUs, fp32 on CPU",
     OFF(dtype), "auto|bf16|fp16|fp32", CMD_TRAIN | LOOM_CMD_GOLDEN | LOOM_CMD_INSPECT, 0, 0},
    {"mesh", LOOM_OPT_STRING, NULL,
     "predict device memory per rank on this mesh, e.g. tp=2,pp=2,dp=2,cp=1,vpp=1,sp (MoE "
     "models: ep=4,etp=1 too; with --seq-len, --micro-batch-size, --global-batch-size, "
     "--lora-r, --dtype)",
     OFF(mesh), NULL, LOOM_CMD_INSPECT, 0, 0},
    {"nproc_per_node", LOOM_OPT_INT, "0",
     "start this many worker processes on this host, one per GPU (torchrun-style; 0: run in "
     "this process)",
     OFF(nproc_per_node), NULL, CMD_TRAIN | LOOM_CMD_GOLDEN, 0, 1024},
    {"metrics_file", LOOM_OPT_STRING, NULL,
     "append one JSON object per logged step to this file (step, consumed samples and tokens, "
     "loss, grad norm, lr, tokens/s, MFU on GPUs, peak memory, skipped steps, elapsed s); "
     "`loom plot FILE` draws it",
     OFF(metrics_file), NULL, CMD_TRAIN, 0, 0},
    {"tensorboard_dir", LOOM_OPT_STRING, NULL,
     "write TensorBoard event files of the same scalars here (`tensorboard --logdir DIR`)",
     OFF(tensorboard_dir), NULL, CMD_TRAIN, 0, 0},
    {"progress", LOOM_OPT_BOOL, "true",
     "a live progress line with an ETA on stderr while it is a terminal (never in a pipe or a "
     "file; --no-progress: none)",
     OFF(progress), NULL, CMD_TRAIN, 0, 0},
};
#define N_OPTIONS (sizeof table / sizeof table[0])
_Static_assert(N_OPTIONS <= sizeof(((loom_settings *)0)->src) / sizeof(loom_opt_source),
               "grow loom_settings.src");

const loom_option *loom_options(size_t *count) {
    *count = N_OPTIONS;
    return table;
}

/* Flag names use '-', JSON keys '_'; compare ignoring the difference. */
static bool name_eq(const char *a, const char *b, size_t blen) {
    size_t i = 0;
    for (; a[i] && i < blen; i++) {
        char x = a[i] == '-' ? '_' : a[i], y = b[i] == '-' ? '_' : b[i];
        if (x != y) return false;
    }
    return a[i] == '\0' && i == blen;
}

static const loom_option *find_n(const char *name, size_t len) {
    for (size_t i = 0; i < N_OPTIONS; i++)
        if (name_eq(table[i].name, name, len)) return &table[i];
    return NULL;
}

const loom_option *loom_option_find(const char *name) { return find_n(name, strlen(name)); }

static size_t edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return 64;
    size_t d[64][64];
    for (size_t i = 0; i <= la; i++) d[i][0] = i;
    for (size_t j = 0; j <= lb; j++) d[0][j] = j;
    for (size_t i = 1; i <= la; i++)
        for (size_t j = 1; j <= lb; j++) {
            char x = a[i - 1] == '-' ? '_' : a[i - 1], y = b[j - 1] == '-' ? '_' : b[j - 1];
            size_t best = d[i - 1][j - 1] + (x != y);
            if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
            d[i][j] = best;
        }
    return d[la][lb];
}

/* " (did you mean --max-shard-size?)" or "" */
static void suggest(char *buf, size_t n, const char *name, bool as_flag) {
    const loom_option *best = NULL;
    size_t bd = 4;
    for (size_t i = 0; i < N_OPTIONS; i++) {
        size_t d = edit_distance(name, table[i].name);
        if (d < bd) {
            bd = d;
            best = &table[i];
        }
    }
    buf[0] = '\0';
    if (!best) return;
    char flag[64];
    snprintf(flag, sizeof flag, "%s", best->name);
    if (as_flag) {
        for (char *p = flag; *p; p++)
            if (*p == '_') *p = '-';
        snprintf(buf, n, " (did you mean --%s?)", flag);
    } else {
        snprintf(buf, n, " (did you mean '%s'?)", flag);
    }
}

bool loom_parse_size(const char *text, int64_t *out) {
    errno = 0;
    char *end;
    double v = strtod(text, &end);
    if (end == text || errno || !(v >= 0) || !isfinite(v)) return false;
    while (*end == ' ') end++;
    static const struct {
        const char *unit;
        double mult;
    } units[] = {{"", 1},        {"B", 1},        {"KB", 1e3},        {"MB", 1e6},
                 {"GB", 1e9},    {"TB", 1e12},    {"KiB", 1024.0},    {"MiB", 1048576.0},
                 {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}, {"K", 1e3}, {"M", 1e6},
                 {"G", 1e9}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcasecmp(end, units[i].unit) == 0) {
            double b = v * units[i].mult;
            if (b >= 9.2e18 || b != floor(b)) return false;
            *out = (int64_t)b;
            return true;
        }
    }
    return false;
}

static bool choice_ok(const char *choices, const char *v) {
    size_t n = strlen(v);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == n && strncmp(p, v, n) == 0) return true;
        if (!bar) break;
        p = bar + 1;
    }
    return false;
}

loom_status loom_settings_set(loom_ctx *ctx, loom_settings *s, const loom_option *opt,
                              const char *value, loom_opt_source src, const char *what) {
    char *field = (char *)s + opt->offset;
    switch (opt->type) {
    case LOOM_OPT_BOOL: {
        bool b;
        if (!strcmp(value, "true") || !strcmp(value, "1") || !strcmp(value, "yes"))
            b = true;
        else if (!strcmp(value, "false") || !strcmp(value, "0") || !strcmp(value, "no"))
            b = false;
        else
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' is not a boolean (true or false)",
                             what, value);
        memcpy(field, &b, sizeof b);
        break;
    }
    case LOOM_OPT_INT:
    case LOOM_OPT_SIZE: {
        int64_t v;
        if (opt->type == LOOM_OPT_INT) {
            errno = 0;
            char *end;
            long long x = strtoll(value, &end, 10);
            if (end == value || *end || errno)
                return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' is not an integer", what, value);
            v = x;
        } else if (!loom_parse_size(value, &v)) {
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "%s: '%s' is not a size (give bytes or a number with a unit: "
                             "500MB, 5GB, 2GiB)",
                             what, value);
        }
        if (opt->min < opt->max && (v < opt->min || v > opt->max))
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "%s: %s is out of range [%" PRId64 ", %" PRId64 "]", what, value,
                             opt->min, opt->max);
        memcpy(field, &v, sizeof v);
        break;
    }
    case LOOM_OPT_FLOAT: {
        errno = 0;
        char *end;
        double v = strtod(value, &end);
        if (end == value || *end || errno || !isfinite(v))
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' is not a finite number", what, value);
        memcpy(field, &v, sizeof v);
        break;
    }
    case LOOM_OPT_CHOICE:
        if (!choice_ok(opt->choices, value))
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: '%s' is not one of %s", what, value,
                             opt->choices);
        /* fallthrough */
    case LOOM_OPT_STRING: {
        char *copy = loom_strdup(ctx, value);
        if (!copy) return LOOM_ERR_OOM;
        char *old;
        memcpy(&old, field, sizeof old);
        free(old);
        memcpy(field, &copy, sizeof copy);
        break;
    }
    }
    s->src[opt - table] = src;
    return LOOM_OK;
}

loom_status loom_settings_init(loom_ctx *ctx, loom_settings *s) {
    memset(s, 0, sizeof *s);
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (!table[i].def) continue;
        loom_status st = loom_settings_set(ctx, s, &table[i], table[i].def, LOOM_SRC_DEFAULT,
                                           "default");
        if (st) return loom_err_prefix(ctx, "option table row '%s'", table[i].name);
    }
    return LOOM_OK;
}

void loom_settings_free(loom_settings *s) {
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (table[i].type != LOOM_OPT_STRING && table[i].type != LOOM_OPT_CHOICE) continue;
        char *p;
        memcpy(&p, (char *)s + table[i].offset, sizeof p);
        free(p);
    }
    memset(s, 0, sizeof *s);
}

loom_status loom_settings_apply_json(loom_ctx *ctx, loom_settings *s, const loom_json *obj,
                                     const char *what) {
    if (!obj || obj->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: settings must be a JSON object", what);
    for (size_t i = 0; i < obj->n; i++) {
        const char *key = obj->keys[i];
        const loom_json *v = obj->items[i];
        const loom_option *opt = loom_option_find(key);
        if (!opt || strchr(key, '-')) {
            char sug[96];
            suggest(sug, sizeof sug, key, false);
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: unknown setting '%s'%s", what, key, sug);
        }
        if (!strcmp(opt->name, "config"))
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s: 'config' cannot be set inside a config file",
                             what);
        char where[256];
        snprintf(where, sizeof where, "%s: '%s'", what, key);
        char text[64];
        const char *val = NULL;
        bool type_ok;
        switch (opt->type) {
        case LOOM_OPT_BOOL:
            type_ok = v->type == LOOM_JSON_BOOL;
            val = v->b ? "true" : "false";
            break;
        case LOOM_OPT_INT:
            type_ok = v->type == LOOM_JSON_NUMBER && v->is_int;
            snprintf(text, sizeof text, "%" PRId64, v->i);
            val = text;
            break;
        case LOOM_OPT_SIZE:
            type_ok = (v->type == LOOM_JSON_NUMBER && v->is_int) || v->type == LOOM_JSON_STRING;
            if (v->type == LOOM_JSON_NUMBER) {
                snprintf(text, sizeof text, "%" PRId64, v->i);
                val = text;
            } else {
                val = v->s;
            }
            break;
        case LOOM_OPT_FLOAT:
            type_ok = v->type == LOOM_JSON_NUMBER;
            snprintf(text, sizeof text, "%.17g", v->d);
            val = text;
            break;
        default:
            type_ok = v->type == LOOM_JSON_STRING;
            val = v->s;
            break;
        }
        if (!type_ok) {
            static const char *want[] = {"a boolean", "an integer", "a number", "a string",
                                         "a string", "a size (bytes or a string like \"5GB\")"};
            return loom_errf(ctx, LOOM_ERR_CONFIG, "%s must be %s, got %s", where,
                             want[opt->type], loom_json_type_name(v->type));
        }
        loom_status st = loom_settings_set(ctx, s, opt, val, LOOM_SRC_CONFIG, where);
        if (st) return st;
    }
    return LOOM_OK;
}

static loom_status apply_config_file(loom_ctx *ctx, loom_settings *s, const char *path) {
    loom_json *doc;
    loom_status st = loom_json_parse_file(ctx, path, &doc);
    if (st) return st;
    st = loom_settings_apply_json(ctx, s, doc, path);
    loom_json_free(doc);
    return st;
}

loom_status loom_settings_parse_args(loom_ctx *ctx, loom_settings *s, unsigned command, int argc,
                                     char **argv, const char **positional, int max_positional,
                                     int *n_positional) {
    *n_positional = 0;
    /* pass 1: --config, so that flags override the file wherever they stand */
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--config") || !strncmp(a, "--config=", 9)) {
            const char *path = a[8] == '=' ? a + 9 : (i + 1 < argc ? argv[i + 1] : NULL);
            if (!path || !*path)
                return loom_errf(ctx, LOOM_ERR_CONFIG, "--config needs a file name");
            loom_status st = apply_config_file(ctx, s, path);
            if (st) return st;
            st = loom_settings_set(ctx, s, loom_option_find("config"), path, LOOM_SRC_FLAG,
                                   "--config");
            if (st) return st;
        }
    }
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0 || !strcmp(a, "--")) {
            if (!strcmp(a, "--")) { /* everything after -- is positional */
                for (i++; i < argc; i++) {
                    if (*n_positional >= max_positional)
                        return loom_errf(ctx, LOOM_ERR_CONFIG, "unexpected argument '%s'", argv[i]);
                    positional[(*n_positional)++] = argv[i];
                }
                break;
            }
            if (*n_positional >= max_positional)
                return loom_errf(ctx, LOOM_ERR_CONFIG, "unexpected argument '%s'", a);
            positional[(*n_positional)++] = a;
            continue;
        }
        const char *name = a + 2;
        const char *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
        const loom_option *opt = find_n(name, nlen);
        bool negated = false;
        if (!opt && nlen > 3 && !strncmp(name, "no-", 3)) {
            const loom_option *o = find_n(name + 3, nlen - 3);
            if (o && o->type == LOOM_OPT_BOOL && !eq) {
                opt = o;
                negated = true;
            }
        }
        char flag[128];
        snprintf(flag, sizeof flag, "--%.*s", (int)(nlen < 100 ? nlen : 100), name);
        if (!opt || !(opt->commands & command)) {
            char sug[96], key[128];
            snprintf(key, sizeof key, "%.*s", (int)(nlen < 100 ? nlen : 100), name);
            suggest(sug, sizeof sug, key, true);
            return loom_errf(ctx, LOOM_ERR_CONFIG, "unknown option %s%s", flag,
                             opt ? " for this command" : sug);
        }
        const char *value;
        if (eq) {
            value = eq + 1;
        } else if (opt->type == LOOM_OPT_BOOL) {
            value = negated ? "false" : "true";
        } else {
            if (i + 1 >= argc) return loom_errf(ctx, LOOM_ERR_CONFIG, "%s needs a value", flag);
            value = argv[++i];
        }
        if (!strcmp(opt->name, "config")) continue; /* applied in pass 1 */
        loom_status st = loom_settings_set(ctx, s, opt, value, LOOM_SRC_FLAG, flag);
        if (st) return st;
    }
    return LOOM_OK;
}

static void format_value(char *buf, size_t n, const loom_settings *s, const loom_option *o) {
    const char *field = (const char *)s + o->offset;
    switch (o->type) {
    case LOOM_OPT_BOOL: {
        bool b;
        memcpy(&b, field, sizeof b);
        snprintf(buf, n, "%s", b ? "true" : "false");
        break;
    }
    case LOOM_OPT_INT: {
        int64_t v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%" PRId64, v);
        break;
    }
    case LOOM_OPT_SIZE: {
        int64_t v;
        memcpy(&v, field, sizeof v);
        char b[32];
        snprintf(buf, n, "%" PRId64 " (%s)", v, loom_fmt_bytes(b, (uint64_t)v));
        break;
    }
    case LOOM_OPT_FLOAT: {
        double v;
        memcpy(&v, field, sizeof v);
        snprintf(buf, n, "%g", v);
        break;
    }
    default: {
        const char *p;
        memcpy(&p, field, sizeof p);
        snprintf(buf, n, "%s", p ? p : "-");
        break;
    }
    }
}

void loom_settings_print(const loom_ctx *ctx, const loom_settings *s, unsigned command) {
    static const char *srcs[] = {"default", "config", "flag"};
    loom_log(ctx, LOOM_LOG_INFO, "settings:");
    for (size_t i = 0; i < N_OPTIONS; i++) {
        if (!(table[i].commands & command)) continue;
        char v[256];
        format_value(v, sizeof v, s, &table[i]);
        loom_log(ctx, LOOM_LOG_INFO, "  %-18s %-32s %s", table[i].name, v, srcs[s->src[i]]);
    }
}

void loom_options_help(FILE *f, unsigned command) {
    for (size_t i = 0; i < N_OPTIONS; i++) {
        const loom_option *o = &table[i];
        if (!(o->commands & command)) continue;
        char flag[64];
        snprintf(flag, sizeof flag, "--%s", o->name);
        for (char *p = flag; *p; p++)
            if (*p == '_') *p = '-';
        const char *arg = o->type == LOOM_OPT_BOOL     ? ""
                          : o->type == LOOM_OPT_INT    ? " N"
                          : o->type == LOOM_OPT_FLOAT  ? " X"
                          : o->type == LOOM_OPT_SIZE   ? " SIZE"
                          : o->type == LOOM_OPT_CHOICE ? " CHOICE"
                                                       : " TEXT";
        char left[96];
        snprintf(left, sizeof left, "%s%s", flag, arg);
        fprintf(f, "  %-26s %s", left, o->help);
        if (o->type == LOOM_OPT_CHOICE) fprintf(f, " [%s]", o->choices);
        if (o->def) fprintf(f, " (default %s)", o->def);
        fputc('\n', f);
    }
}
