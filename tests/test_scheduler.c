/* Learning-rate / weight-decay schedules (Megatron OptimizerParamScheduler).
 * Expected values are worked out by hand from Megatron's formulas for
 * max_lr 1e-3, min_lr 1e-5 (delta 9.9e-4), warmup 10, decay 100 (decay span
 * 90), wsd_decay 20 (anneal from step 80). */
#include "harness.h"

#include "../src/train/scheduler.h"

/* Relative check (absolute near zero). */
#define CHECK_REL(a, b) CHECK_NEAR((a), (b), 1e-12 * fabs((double)(b)) + 1e-18)

static const int64_t STEPS[9] = {0, 5, 10, 11, 50, 80, 90, 100, 150};

static loom_sched_config base(loom_lr_decay_style style) {
    loom_sched_config c = loom_sched_config_default();
    c.init_lr = 0.0;
    c.max_lr = 1e-3;
    c.min_lr = 1e-5;
    c.lr_warmup_steps = 10;
    c.lr_decay_steps = 100;
    c.lr_decay_style = style;
    c.wsd_decay_steps = 20;
    return c;
}

static void check_schedule(const loom_sched_config *c, const double want[9]) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    CHECK_OK(ctx, loom_sched_validate(ctx, c));
    for (int i = 0; i < 9; i++) {
        double got = loom_sched_lr(c, STEPS[i]);
        if (!(fabs(got - want[i]) <= 1e-12 * fabs(want[i]) + 1e-18))
            CHECK_MSG(0, "%s/%s step %lld: lr %.15g, want %.15g",
                      loom_lr_decay_style_name(c->lr_decay_style),
                      loom_wsd_style_name(c->lr_wsd_decay_style), (long long)STEPS[i], got,
                      want[i]);
    }
    loom_ctx_free(ctx);
}

/* Steps 0, 5, 10 are warmup for every style: 0, 5e-4, 1e-3 (max_lr). */
TEST(sched_linear) {
    loom_sched_config c = base(LOOM_LR_LINEAR);
    /* coeff = 1 - (s-10)/90: 11 -> 89/90, 50 -> 5/9, 80 -> 2/9, 90 -> 1/9 */
    const double want[9] = {0, 5e-4, 1e-3, 9.89e-4, 5.6e-4, 2.3e-4, 1.2e-4, 1e-5, 1e-5};
    check_schedule(&c, want);
}

TEST(sched_cosine) {
    loom_sched_config c = base(LOOM_LR_COSINE);
    /* coeff = (cos(pi*(s-10)/90) + 1)/2: 11 -> cos 2deg, 50 -> cos 80deg, 80 -> cos 140deg,
     * 90 -> cos 160deg */
    const double want[9] = {0,
                            5e-4,
                            1e-3,
                            1e-5 + 9.9e-4 * 0.5 * (0.999390827019096 + 1),
                            1e-5 + 9.9e-4 * 0.5 * (0.173648177666930 + 1),
                            1e-5 + 9.9e-4 * 0.5 * (-0.766044443118978 + 1),
                            1e-5 + 9.9e-4 * 0.5 * (-0.939692620785908 + 1),
                            1e-5,
                            1e-5};
    check_schedule(&c, want);
    CHECK_NEAR(loom_sched_lr(&c, 50), 5.90955847945130e-4, 1e-15);
}

TEST(sched_constant) {
    loom_sched_config c = base(LOOM_LR_CONSTANT);
    /* max_lr after warmup, even past lr_decay_steps (Megatron never goes to min_lr here) */
    const double want[9] = {0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3};
    check_schedule(&c, want);
}

TEST(sched_inverse_sqrt) {
    loom_sched_config c = base(LOOM_LR_INVERSE_SQRT);
    /* max_lr * sqrt(10/s), floored at min_lr; min_lr past decay */
    const double want[9] = {0,
                            5e-4,
                            1e-3,
                            1e-3 * 0.953462589245592,
                            1e-3 * 0.447213595499958,
                            1e-3 * 0.353553390593274,
                            1e-3 / 3,
                            1e-3 * 0.316227766016838,
                            1e-5};
    c.min_lr = 1e-5;
    check_schedule(&c, want);
    /* the floor: min_lr 4e-4 lifts step 80 (3.54e-4) and 100 (3.16e-4) */
    c.min_lr = 4e-4;
    CHECK_REL(loom_sched_lr(&c, 80), 4e-4);
    CHECK_REL(loom_sched_lr(&c, 50), 1e-3 * 0.447213595499958);
    /* no warmup: warmup and step count both taken as at least 1 */
    c.min_lr = 1e-5;
    c.lr_warmup_steps = 0;
    CHECK_REL(loom_sched_lr(&c, 0), 1e-3);
    CHECK_REL(loom_sched_lr(&c, 1), 1e-3);
    CHECK_REL(loom_sched_lr(&c, 4), 5e-4);
    CHECK_REL(loom_sched_lr(&c, 100), 1e-4);
    CHECK_REL(loom_sched_lr(&c, 101), 1e-5);
}

TEST(sched_wsd_styles) {
    loom_sched_config c = base(LOOM_LR_WSD);
    /* stable at max_lr up to step 80; r = (s-80)/20: 90 -> 0.5; 100 -> 1 (coeff 0 for all) */
    c.lr_wsd_decay_style = LOOM_WSD_LINEAR;
    const double lin[9] = {0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 5.05e-4, 1e-5, 1e-5};
    check_schedule(&c, lin);
    CHECK_REL(loom_sched_lr(&c, 85), 7.525e-4);

    c.lr_wsd_decay_style = LOOM_WSD_COSINE;
    const double cosv[9] = {0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 5.05e-4, 1e-5, 1e-5};
    check_schedule(&c, cosv);
    CHECK_REL(loom_sched_lr(&c, 85), 1e-5 + 9.9e-4 * 0.853553390593274); /* (cos 45deg+1)/2 */

    c.lr_wsd_decay_style = LOOM_WSD_EXPONENTIAL; /* coeff 2*0.5^r - 1 */
    const double ex[9] = {0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-5 + 9.9e-4 * 0.414213562373095,
                          1e-5, 1e-5};
    check_schedule(&c, ex);
    CHECK_REL(loom_sched_lr(&c, 85), 1e-5 + 9.9e-4 * 0.681792830507429);

    c.lr_wsd_decay_style = LOOM_WSD_MINUS_SQRT; /* coeff 1 - sqrt(r) */
    const double ms[9] = {0, 5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-5 + 9.9e-4 * 0.292893218813452,
                          1e-5, 1e-5};
    check_schedule(&c, ms);
    CHECK_REL(loom_sched_lr(&c, 85), 5.05e-4);

    /* wsd_decay_steps 0: stable up to decay_steps, then min_lr */
    c.wsd_decay_steps = 0;
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    CHECK_REL(loom_sched_lr(&c, 100), 1e-3);
    CHECK_REL(loom_sched_lr(&c, 101), 1e-5);
}

TEST(sched_edges) {
    /* no warmup: step 0 is already in the decay (linear at ratio 0 -> max_lr) */
    loom_sched_config c = base(LOOM_LR_LINEAR);
    c.lr_warmup_steps = 0;
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    CHECK_REL(loom_sched_lr(&c, 0), 1e-3);
    CHECK_REL(loom_sched_lr(&c, 50), 5.05e-4);
    CHECK_REL(loom_sched_lr(&c, 100), 1e-5);
    CHECK_REL(loom_sched_lr(&c, 101), 1e-5);
    CHECK_REL(loom_sched_lr(&c, INT64_C(1) << 40), 1e-5);
    /* warmup from a non-zero init_lr */
    c = base(LOOM_LR_COSINE);
    c.init_lr = 1e-4;
    CHECK_REL(loom_sched_lr(&c, 0), 1e-4);
    CHECK_REL(loom_sched_lr(&c, 5), 5.5e-4);
    CHECK_REL(loom_sched_lr(&c, 10), 1e-3);
    /* warmup = decay - 1: the decay is one step long */
    c = base(LOOM_LR_LINEAR);
    c.lr_warmup_steps = 99;
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    CHECK_REL(loom_sched_lr(&c, 99), 1e-3);
    CHECK_REL(loom_sched_lr(&c, 100), 1e-5);
}

/* Megatron's loop: lr set by step(0) at construction; each iteration runs the
 * optimizer step with the current lr, then step(1). So optimizer step k uses
 * lr(k-1). */
TEST(sched_step_convention) {
    loom_sched_config c = base(LOOM_LR_LINEAR);
    c.init_lr = 1e-4;
    int64_t num_steps = 0; /* scheduler state; step(0) at construction */
    double used[12];
    for (int k = 1; k <= 11; k++) {
        used[k] = loom_sched_lr(&c, num_steps); /* optimizer.step() with the current lr */
        num_steps += 1;                         /* scheduler.step(1) */
    }
    CHECK_REL(used[1], 1e-4);  /* first step at init_lr */
    CHECK_REL(used[6], 5.5e-4);
    CHECK_REL(used[11], 1e-3); /* step warmup+1 at max_lr */
    /* resume: restoring num_steps alone reproduces the schedule */
    int64_t saved = num_steps;
    CHECK_REL(loom_sched_lr(&c, saved), loom_sched_lr(&c, 11));
}

TEST(sched_wd_styles) {
    loom_sched_config c = base(LOOM_LR_LINEAR);
    c.start_wd = 0.0;
    c.end_wd = 0.1;
    c.wd_incr_steps = 100;
    c.wd_incr_style = LOOM_WD_LINEAR;
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    CHECK_REL(loom_sched_wd(&c, 0), 0.0);
    CHECK_REL(loom_sched_wd(&c, 25), 0.025);
    CHECK_REL(loom_sched_wd(&c, 100), 0.1);
    CHECK_REL(loom_sched_wd(&c, 150), 0.1);
    c.wd_incr_style = LOOM_WD_COSINE; /* (cos(pi*(1-r)) + 1)/2 */
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    CHECK_NEAR(loom_sched_wd(&c, 0), 0.0, 1e-18);
    CHECK_REL(loom_sched_wd(&c, 25), 0.1 * 0.5 * (1 - 0.707106781186548));
    CHECK_REL(loom_sched_wd(&c, 50), 0.05);
    CHECK_REL(loom_sched_wd(&c, 100), 0.1);
    CHECK_REL(loom_sched_wd(&c, 101), 0.1);
    c.wd_incr_style = LOOM_WD_CONSTANT;
    c.start_wd = c.end_wd = 0.05;
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    CHECK_REL(loom_sched_wd(&c, 0), 0.05);
    CHECK_REL(loom_sched_wd(&c, 50), 0.05);
    CHECK_REL(loom_sched_wd(&c, 500), 0.05);
}

/* validate must fail with LOOM_ERR_CONFIG and a message containing `frag`. */
static void expect_invalid(const loom_sched_config *c, const char *frag) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    CHECK_EQ_INT(loom_sched_validate(ctx, c), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), frag);
    loom_ctx_free(ctx);
}

TEST(sched_validate_errors) {
    loom_sched_config c = base(LOOM_LR_COSINE);
    CHECK(loom_sched_validate(NULL, &c) == LOOM_OK);
    c.min_lr = 2e-3;
    expect_invalid(&c, "min_lr=0.002 is larger than max_lr=0.001");
    c = base(LOOM_LR_COSINE);
    c.min_lr = -1e-5;
    expect_invalid(&c, "min_lr=-1e-05 is negative");
    c = base(LOOM_LR_COSINE);
    c.init_lr = 2e-3;
    expect_invalid(&c, "init_lr=0.002");
    c = base(LOOM_LR_COSINE);
    c.lr_decay_steps = 0;
    expect_invalid(&c, "lr_decay_steps=0 must be > 0");
    c = base(LOOM_LR_COSINE);
    c.lr_warmup_steps = 100;
    expect_invalid(&c, "lr_warmup_steps=100 must be smaller than lr_decay_steps=100");
    c = base(LOOM_LR_WSD);
    c.wsd_decay_steps = -1;
    expect_invalid(&c, "WSD needs wsd_decay_steps");
    c = base(LOOM_LR_COSINE);
    c.wd_incr_style = LOOM_WD_CONSTANT;
    c.start_wd = 0.0;
    c.end_wd = 0.1;
    expect_invalid(&c, "constant needs start_wd == end_wd");
    c.wd_incr_style = LOOM_WD_LINEAR;
    c.start_wd = 0.2;
    expect_invalid(&c, "end_wd=0.1 is smaller than start_wd=0.2");
    c.start_wd = -0.1;
    expect_invalid(&c, "start_wd=-0.1 is negative");
    c.start_wd = 0.0;
    c.wd_incr_steps = 0;
    expect_invalid(&c, "needs wd_incr_steps > 0");
    c = base(LOOM_LR_COSINE);
    c.max_lr = NAN;
    expect_invalid(&c, "finite");
    c = base((loom_lr_decay_style)42);
    expect_invalid(&c, "not a known style");
}

TEST(sched_style_names) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    loom_lr_decay_style s;
    for (int i = 0; i < LOOM_LR_STYLE_COUNT; i++) {
        CHECK_OK(ctx, loom_lr_decay_style_parse(ctx, loom_lr_decay_style_name(i), &s));
        CHECK_EQ_INT(s, i);
    }
    CHECK_OK(ctx, loom_lr_decay_style_parse(ctx, "wsd", &s));
    CHECK_EQ_INT(s, LOOM_LR_WSD);
    CHECK_OK(ctx, loom_lr_decay_style_parse(ctx, "inverse-square-root", &s));
    CHECK_EQ_INT(s, LOOM_LR_INVERSE_SQRT);
    CHECK_EQ_INT(loom_lr_decay_style_parse(ctx, "cosin", &s), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "\"cosin\" is not known; use one of constant");
    loom_wsd_style w;
    for (int i = 0; i < LOOM_WSD_STYLE_COUNT; i++) {
        CHECK_OK(ctx, loom_wsd_style_parse(ctx, loom_wsd_style_name(i), &w));
        CHECK_EQ_INT(w, i);
    }
    CHECK_EQ_INT(loom_wsd_style_parse(ctx, "minus-sqrt", &w), LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "minus_sqrt");
    loom_wd_incr_style d;
    for (int i = 0; i < LOOM_WD_STYLE_COUNT; i++) {
        CHECK_OK(ctx, loom_wd_incr_style_parse(ctx, loom_wd_incr_style_name(i), &d));
        CHECK_EQ_INT(d, i);
    }
    CHECK_EQ_INT(loom_wd_incr_style_parse(ctx, NULL, &d), LOOM_ERR_CONFIG);
    CHECK_STR(loom_lr_decay_style_name((loom_lr_decay_style)99), "?");
    loom_ctx_free(ctx);
}
