/* Megatron-LM's OptimizerParamScheduler in C: see scheduler.h for the step
 * convention. Written from the Python source's formulas; every expression
 * keeps Megatron's order of double operations so results agree bit for bit
 * (libm cos/pow/sqrt permitting). */
#include "scheduler.h"

#include <math.h>
#include <string.h>

loom_sched_config loom_sched_config_default(void) {
    loom_sched_config c;
    memset(&c, 0, sizeof c);
    c.init_lr = 0.0;
    c.max_lr = 1e-4;
    c.min_lr = 0.0;
    c.lr_warmup_steps = 0;
    c.lr_decay_steps = 1;
    c.lr_decay_style = LOOM_LR_CONSTANT;
    c.wsd_decay_steps = -1;
    c.lr_wsd_decay_style = LOOM_WSD_EXPONENTIAL;
    c.start_wd = 0.01;
    c.end_wd = 0.01;
    c.wd_incr_steps = 1;
    c.wd_incr_style = LOOM_WD_CONSTANT;
    return c;
}

static const char *const lr_names[LOOM_LR_STYLE_COUNT] = {
    "constant", "linear", "cosine", "inverse-square-root", "WSD"};
static const char *const wsd_names[LOOM_WSD_STYLE_COUNT] = {
    "linear", "cosine", "exponential", "minus_sqrt"};
static const char *const wd_names[LOOM_WD_STYLE_COUNT] = {"constant", "linear", "cosine"};

const char *loom_lr_decay_style_name(loom_lr_decay_style s) {
    return (unsigned)s < LOOM_LR_STYLE_COUNT ? lr_names[s] : "?";
}
const char *loom_wsd_style_name(loom_wsd_style s) {
    return (unsigned)s < LOOM_WSD_STYLE_COUNT ? wsd_names[s] : "?";
}
const char *loom_wd_incr_style_name(loom_wd_incr_style s) {
    return (unsigned)s < LOOM_WD_STYLE_COUNT ? wd_names[s] : "?";
}

/* Index of s in names[0..n), or -1. */
static int find_name(const char *s, const char *const *names, int n) {
    if (!s) return -1;
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

loom_status loom_lr_decay_style_parse(loom_ctx *ctx, const char *s, loom_lr_decay_style *out) {
    int i = find_name(s, lr_names, LOOM_LR_STYLE_COUNT);
    if (i < 0 && s && strcmp(s, "wsd") == 0) i = LOOM_LR_WSD;
    if (i < 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "lr_decay_style \"%s\" is not known; use one of constant, linear, "
                         "cosine, inverse-square-root, WSD",
                         s ? s : "(null)");
    *out = (loom_lr_decay_style)i;
    return LOOM_OK;
}

loom_status loom_wsd_style_parse(loom_ctx *ctx, const char *s, loom_wsd_style *out) {
    int i = find_name(s, wsd_names, LOOM_WSD_STYLE_COUNT);
    if (i < 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "lr_wsd_decay_style \"%s\" is not known; use one of linear, cosine, "
                         "exponential, minus_sqrt",
                         s ? s : "(null)");
    *out = (loom_wsd_style)i;
    return LOOM_OK;
}

loom_status loom_wd_incr_style_parse(loom_ctx *ctx, const char *s, loom_wd_incr_style *out) {
    int i = find_name(s, wd_names, LOOM_WD_STYLE_COUNT);
    if (i < 0)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "wd_incr_style \"%s\" is not known; use one of constant, linear, cosine",
                         s ? s : "(null)");
    *out = (loom_wd_incr_style)i;
    return LOOM_OK;
}

loom_status loom_sched_validate(loom_ctx *ctx, const loom_sched_config *c) {
    const loom_status E = LOOM_ERR_CONFIG;
    if (!isfinite(c->init_lr) || !isfinite(c->max_lr) || !isfinite(c->min_lr))
        return loom_errf(ctx, E, "learning rates must be finite numbers (init_lr=%g, max_lr=%g, "
                         "min_lr=%g)", c->init_lr, c->max_lr, c->min_lr);
    if (!isfinite(c->start_wd) || !isfinite(c->end_wd))
        return loom_errf(ctx, E, "weight decays must be finite numbers (start_wd=%g, end_wd=%g)",
                         c->start_wd, c->end_wd);
    if (c->min_lr < 0.0)
        return loom_errf(ctx, E, "min_lr=%g is negative; set min_lr >= 0", c->min_lr);
    if (c->max_lr < c->min_lr)
        return loom_errf(ctx, E, "min_lr=%g is larger than max_lr=%g; set min_lr <= max_lr",
                         c->min_lr, c->max_lr);
    if (c->init_lr > c->max_lr)
        return loom_errf(ctx, E, "init_lr=%g (the warmup start) is larger than max_lr=%g; "
                         "set init_lr <= max_lr", c->init_lr, c->max_lr);
    if (c->init_lr < 0.0)
        return loom_errf(ctx, E, "init_lr=%g is negative; set init_lr >= 0", c->init_lr);
    if ((unsigned)c->lr_decay_style >= LOOM_LR_STYLE_COUNT)
        return loom_errf(ctx, E, "lr_decay_style %d is not a known style", (int)c->lr_decay_style);
    if ((unsigned)c->lr_wsd_decay_style >= LOOM_WSD_STYLE_COUNT)
        return loom_errf(ctx, E, "lr_wsd_decay_style %d is not a known style",
                         (int)c->lr_wsd_decay_style);
    if ((unsigned)c->wd_incr_style >= LOOM_WD_STYLE_COUNT)
        return loom_errf(ctx, E, "wd_incr_style %d is not a known style", (int)c->wd_incr_style);
    if (c->lr_decay_steps <= 0)
        return loom_errf(ctx, E, "lr_decay_steps=%lld must be > 0 (the step at which lr reaches "
                         "min_lr; usually the number of training steps)",
                         (long long)c->lr_decay_steps);
    if (c->lr_warmup_steps < 0)
        return loom_errf(ctx, E, "lr_warmup_steps=%lld is negative; use 0 for no warmup",
                         (long long)c->lr_warmup_steps);
    if (c->lr_warmup_steps >= c->lr_decay_steps)
        return loom_errf(ctx, E, "lr_warmup_steps=%lld must be smaller than lr_decay_steps=%lld; "
                         "shorten the warmup or lengthen the decay",
                         (long long)c->lr_warmup_steps, (long long)c->lr_decay_steps);
    if (c->lr_decay_style == LOOM_LR_WSD && c->wsd_decay_steps < 0)
        return loom_errf(ctx, E, "lr_decay_style WSD needs wsd_decay_steps (the length of the "
                         "final anneal, >= 0); it is %s",
                         c->wsd_decay_steps == -1 ? "not set" : "negative");
    if (c->start_wd < 0.0)
        return loom_errf(ctx, E, "start_wd=%g is negative; set start_wd >= 0", c->start_wd);
    if (c->end_wd < c->start_wd)
        return loom_errf(ctx, E, "end_wd=%g is smaller than start_wd=%g; weight decay can only "
                         "increase: set end_wd >= start_wd", c->end_wd, c->start_wd);
    if (c->wd_incr_steps < 0)
        return loom_errf(ctx, E, "wd_incr_steps=%lld is negative", (long long)c->wd_incr_steps);
    if (c->wd_incr_style == LOOM_WD_CONSTANT && c->start_wd != c->end_wd)
        return loom_errf(ctx, E, "wd_incr_style constant needs start_wd == end_wd (got %g and "
                         "%g); set them equal or use wd_incr_style linear or cosine",
                         c->start_wd, c->end_wd);
    if (c->wd_incr_style != LOOM_WD_CONSTANT && c->wd_incr_steps == 0)
        return loom_errf(ctx, E, "wd_incr_style %s needs wd_incr_steps > 0 (usually the number "
                         "of training steps)", wd_names[c->wd_incr_style]);
    return LOOM_OK;
}

/* Megatron get_lr(). */
double loom_sched_lr(const loom_sched_config *c, int64_t num_steps) {
    const double max_lr = c->max_lr, min_lr = c->min_lr;
    const int64_t warmup = c->lr_warmup_steps, decay = c->lr_decay_steps;

    /* Linear warmup from init_lr, including num_steps == warmup (-> max_lr). */
    if (warmup > 0 && num_steps <= warmup)
        return c->init_lr + (max_lr - c->init_lr) * (double)num_steps / (double)warmup;

    /* Constant: max_lr for ever (never min_lr, even past decay_steps). */
    if (c->lr_decay_style == LOOM_LR_CONSTANT) return max_lr;

    if (num_steps > decay) return min_lr;

    if (c->lr_decay_style == LOOM_LR_INVERSE_SQRT) {
        /* max_lr * sqrt(warmup) / sqrt(step), both at least 1; Python's x**0.5 is pow. */
        double w = (double)(warmup > 1 ? warmup : 1);
        double n = (double)(num_steps > 1 ? num_steps : 1);
        double lr = max_lr * pow(w, 0.5) / pow(n, 0.5);
        return lr > min_lr ? lr : min_lr; /* max(min_lr, lr) */
    }

    double decay_ratio = (double)(num_steps - warmup) / (double)(decay - warmup);
    double delta_lr = max_lr - min_lr;
    double coeff = 1.0;
    switch (c->lr_decay_style) {
    case LOOM_LR_LINEAR: coeff = 1.0 - decay_ratio; break;
    case LOOM_LR_COSINE: coeff = 0.5 * (cos(M_PI * decay_ratio) + 1.0); break;
    case LOOM_LR_WSD: {
        int64_t anneal_start = decay - c->wsd_decay_steps;
        if (num_steps <= anneal_start) {
            coeff = 1.0;
        } else {
            /* wsd_decay_steps > 0 here: num_steps <= decay and > decay - wsd_decay_steps. */
            double r = (double)(num_steps - anneal_start) / (double)c->wsd_decay_steps;
            switch (c->lr_wsd_decay_style) {
            case LOOM_WSD_LINEAR: coeff = 1.0 - r; break;
            case LOOM_WSD_COSINE: coeff = 0.5 * (cos(M_PI * r) + 1.0); break;
            case LOOM_WSD_EXPONENTIAL: coeff = 2.0 * pow(0.5, r) - 1.0; break;
            case LOOM_WSD_MINUS_SQRT: coeff = 1.0 - sqrt(r); break;
            default: LOOM_ASSERT(!"validated wsd style");
            }
        }
        break;
    }
    default: LOOM_ASSERT(!"validated lr style");
    }
    return min_lr + coeff * delta_lr;
}

/* Megatron get_wd(). */
double loom_sched_wd(const loom_sched_config *c, int64_t num_steps) {
    if (num_steps > c->wd_incr_steps) return c->end_wd;
    if (c->wd_incr_style == LOOM_WD_CONSTANT) return c->end_wd;
    double ratio = (double)num_steps / (double)c->wd_incr_steps;
    double coeff = c->wd_incr_style == LOOM_WD_LINEAR ? ratio
                                                      : 0.5 * (cos(M_PI * (1 - ratio)) + 1.0);
    return c->start_wd + coeff * (c->end_wd - c->start_wd);
}
