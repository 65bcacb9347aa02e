/* Training metrics people can watch and plot: a JSONL file (one object per
 * logged step), TensorBoard event files (src/io/tfevents.h), the model-FLOPs
 * estimate behind MFU, and the live progress line of `loom train`.
 *
 * The JSONL line, in this key order (numbers are JSON numbers; a value that
 * is not finite is written as null; mfu is absent when unknown: CPU runs and
 * GPUs whose peak loom does not know):
 *   {"step": 120, "consumed_samples": 960, "consumed_tokens": 245760,
 *    "loss": 2.31, "grad_norm": 0.84, "lr": 0.0003, "tokens_per_s": 51234.5,
 *    "mfu": 0.412, "peak_mem_bytes": 12345678, "skipped_steps": 0,
 *    "elapsed_s": 61.2}
 * and for a mixture of experts, last: "aux_loss", "expert_tokens_min",
 * "expert_tokens_mean", "expert_tokens_max", "expert_imbalance" (the step's
 * load-balancing loss and tokens per expert, loom_step_result's), then with
 * the router z-loss on "z_loss", then with per-layer counts "moe_layers" (the
 * MoE layers' indices) and "expert_tokens_min_by_layer",
 * "expert_tokens_mean_by_layer", "expert_tokens_max_by_layer",
 * "expert_imbalance_by_layer" (arrays in that order). TensorBoard gets each
 * layer's imbalance as moe/expert_imbalance/layer_<i>. With --profile, last:
 * "compute_ms", "exposed_comm_ms", "bubble_ms", "idle_ms" (this rank's step
 * time by kind, ms per step since the previous logged step: loom.h's
 * loom_step_breakdown).
 * consumed_samples counts rows (sequences of seq_len tokens), as Megatron
 * does; consumed_tokens counts every position of those rows. */
#ifndef LOOM_METRICS_H
#define LOOM_METRICS_H

#include "../core/core.h"
#include "../io/hf_config.h"

typedef struct loom_metrics_record {
    int64_t step, consumed_samples, consumed_tokens;
    double loss, grad_norm, lr;
    double tokens_per_s;    /* over the steps since the previous logged step */
    double mfu;             /* model FLOPs utilisation in [0, 1]; NAN: unknown (omitted) */
    int64_t peak_mem_bytes; /* GPU: loom's peak device bytes; CPU: the process's max RSS; <0: unknown */
    int64_t skipped_steps;  /* fp16 loss-scaler skips so far */
    double elapsed_s;       /* since the first step began */
    /* mixture of experts (written only when moe): loom_step_result's */
    bool moe;
    double aux_loss, expert_tokens_min, expert_tokens_mean, expert_tokens_max, expert_imbalance;
    bool z; /* the router z-loss is on: z_loss written */
    double z_loss;
    /* per layer (NULL: not written): (layers, experts) tokens per expert
     * (loom_model_expert_tokens); rows of no tokens (dense layers) are left
     * out */
    const double *expert_tokens;
    int64_t layers, experts;
    /* --profile (written when prof.steps > 0): the step's time by kind,
     * per step since the previous logged step (loom_model_profile_interval) */
    loom_step_breakdown prof;
} loom_metrics_record;

/* One MoE layer's tokens per expert (E counts): min, mean and max over its
 * experts, and max/mean (0 when no token was sent). */
typedef struct loom_expert_layer_stats {
    double min, mean, max, imbalance;
} loom_expert_layer_stats;
void loom_expert_layer_stats_of(const double *cnt, int64_t E, loom_expert_layer_stats *out);

/* The record as one JSON line (with '\n'), appended to sb. */
void loom_metrics_jsonl(loom_sb *sb, const loom_metrics_record *r);

/* The TensorBoard tag of each JSONL key written as a scalar (Megatron's
 * names where it has one), NULL for keys that are not scalars (step). */
const char *loom_metrics_tb_tag(const char *jsonl_key);

typedef struct loom_metrics loom_metrics;

/* Opens the JSONL file (appended to: an existing file keeps its lines, so a
 * run continued into the same file adds to it) and/or a new event file in
 * tb_dir; either may be NULL. Errors name the file or directory. */
loom_status loom_metrics_open(loom_ctx *ctx, const char *jsonl_path, const char *tb_dir,
                              loom_metrics **out);
/* Writes the record to both and flushes them. */
loom_status loom_metrics_write(loom_ctx *ctx, loom_metrics *m, const loom_metrics_record *r);
/* The event file's path (NULL without tb_dir). */
const char *loom_metrics_tb_path(const loom_metrics *m);
/* Closes both (NULL is fine). */
loom_status loom_metrics_close(loom_ctx *ctx, loom_metrics *m);

/* Model FLOPs of training on one token (forward and backward), as
 * bench/README.md counts them: 6N for full fine-tuning, 4N for LoRA (frozen
 * weights: no weight gradients), N the parameters of the matrices a token
 * goes through (attention, the MLP or its top-k experts and router, norms,
 * the output layer; not the input embedding), plus causal attention
 * 6 * L * S * Hq * D (forward QK^T and PV over the causal half, backward
 * twice that). Megatron's formula counts attention as 12 * L * S * H, the
 * full square; loom counts what causal attention computes. */
double loom_flops_per_token(const loom_model_config *cfg, int64_t seq_len, bool lora);
/* Dense bf16 peak FLOP/s of a GPU from its name ("NVIDIA H100 80GB HBM3":
 * 989e12), 0 when loom does not know it. */
double loom_gpu_peak_flops(const char *device_name);
/* The process's peak resident set size in bytes (getrusage), -1 if unknown. */
int64_t loom_max_rss_bytes(void);

/* "45s", "12m03s", "3h07m", "2d05h"; "--" for a negative or non-finite s. */
const char *loom_fmt_duration(char buf[32], double s);
/* Seconds left after `step` of `total` steps: the mean time of the steps
 * after the first (the first carries start-up costs) times the steps left;
 * `first_step_end_s` and `now_s` on one clock. NAN while unknown. */
double loom_eta_s(int64_t step, int64_t total, double first_step_end_s, double now_s);
/* The progress line (no '\r', no newline), cut to `width` columns:
 *   step 120/1000 [===>        ] 12%  loss 2.3100  1,234 tok/s  ETA 12m03s */
void loom_progress_line(char *buf, size_t n, int64_t step, int64_t total, double loss,
                        double tokens_per_s, double eta_s, int width);

#endif /* LOOM_METRICS_H */
