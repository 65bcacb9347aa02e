/* Learning-rate and weight-decay schedules, the same numbers as Megatron-LM's
 * OptimizerParamScheduler (megatron/core/optimizer_param_scheduler.py).
 *
 * Step convention (exactly Megatron's): num_steps counts the optimizer steps
 * taken so far. Megatron builds the scheduler with num_steps = 0 and calls
 * step(0) to set the first lr; each training iteration then runs
 * optimizer.step() with the lr currently set and afterwards
 * scheduler.step(increment). So
 *
 *     the k-th optimizer step (k = 1, 2, ...) uses lr(num_steps = k - 1)
 *     and wd(num_steps = k - 1);
 *
 * the first step runs at init_lr when there is warmup, and the step after
 * the last warmup step (k = warmup + 1) runs at max_lr.
 *
 * Units: Megatron's pretraining loop increments by the global batch size in
 * samples and scales warmup/decay/wd steps by it; loom counts optimizer
 * steps (increment 1). With a constant batch size the ratios are the same
 * numbers, so lr/wd agree (inverse-square-root may differ in the last bit).
 *
 * State to save and restore for resume: only num_steps (the config is
 * rebuilt from the options; Megatron's state_dict holds the config to
 * compare, but the only evolving value is num_steps).
 *
 * All arithmetic is in double in the same order as the Python source. */
#ifndef LOOM_TRAIN_SCHEDULER_H
#define LOOM_TRAIN_SCHEDULER_H

#include "../core/core.h"

/* loom_sched_config and its enums are public: include/loom.h. */

/* Defaults: constant lr 1e-4 (init 0, min 0), no warmup, decay_steps 1,
 * WSD unset (exponential), constant wd 0.01. Fill in, then validate. */
loom_sched_config loom_sched_config_default(void);

/* Refuses what Megatron asserts (min_lr >= 0, max_lr >= min_lr,
 * init_lr <= max_lr, decay_steps > 0, warmup_steps < decay_steps, WSD has
 * wsd_decay_steps, start_wd >= 0, end_wd >= start_wd, constant wd style has
 * start_wd == end_wd) and what would divide by zero (non-constant wd style
 * with wd_incr_steps <= 0), plus negative step counts, non-finite values and
 * out-of-range enums. LOOM_ERR_CONFIG with the offending numbers and the
 * option to change. lr/wd below assume a validated config. */
loom_status loom_sched_validate(loom_ctx *ctx, const loom_sched_config *c);

/* The lr / weight decay Megatron's get_lr()/get_wd() return when
 * num_steps == num_steps (see the step convention above). num_steps >= 0. */
double loom_sched_lr(const loom_sched_config *c, int64_t num_steps);
double loom_sched_wd(const loom_sched_config *c, int64_t num_steps);

/* Style names (the option table's values). Parsers return LOOM_ERR_CONFIG
 * listing the accepted names. "WSD" and "wsd" both name WSD. */
loom_status loom_lr_decay_style_parse(loom_ctx *ctx, const char *s, loom_lr_decay_style *out);
loom_status loom_wsd_style_parse(loom_ctx *ctx, const char *s, loom_wsd_style *out);
loom_status loom_wd_incr_style_parse(loom_ctx *ctx, const char *s, loom_wd_incr_style *out);
const char *loom_lr_decay_style_name(loom_lr_decay_style s); /* "?" when out of range */
const char *loom_wsd_style_name(loom_wsd_style s);
const char *loom_wd_incr_style_name(loom_wd_incr_style s);

/* Choices strings for the option table ("constant|linear|..."). */
#define LOOM_LR_DECAY_STYLE_CHOICES "constant|linear|cosine|inverse-square-root|WSD|wsd"
#define LOOM_WSD_STYLE_CHOICES "linear|cosine|exponential|minus_sqrt"
#define LOOM_WD_INCR_STYLE_CHOICES "constant|linear|cosine"

#endif /* LOOM_TRAIN_SCHEDULER_H */
