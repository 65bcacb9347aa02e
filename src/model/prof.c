/* prof.h: the step's timeline, summed by part. */
#include "prof.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/core.h"
#include "model.h"

#define PROF_PARTS 128 /* distinct (phase, what) pairs */

typedef struct {
    const char *phase, *what;
    double ms[2];      /* the first step's, the later steps' */
    int64_t marks[2];
    int cls;           /* its class (prof_class) */
} part;

/* What a part's time is (loom.h's loom_step_breakdown): the collectives
 * loom waits on (exposed: nothing overlaps them yet), the pipeline's
 * exchanges (a stage waiting for its neighbours, the transfers with it),
 * the host waits inside a step, and everything else, compute. */
enum { CL_COMPUTE, CL_COMM, CL_BUBBLE, CL_IDLE, NCL };
static const struct {
    const char *what;
    int cls;
} classes[] = {
    {"tp comm", CL_COMM},           {"cp comm", CL_COMM},       {"moe.a2a", CL_COMM},
    {"gradient reduce", CL_COMM},   {"parameter gather", CL_COMM},
    {"loss sums", CL_COMM},         {"pipeline send/recv", CL_BUBBLE},
    {"moe.counts (host wait)", CL_IDLE},
};

static int prof_class(const char *what) {
    for (size_t i = 0; i < sizeof classes / sizeof classes[0]; i++)
        if (!strcmp(classes[i].what, what)) return classes[i].cls;
    return CL_COMPUTE;
}

struct loom_prof {
    const char *phase, *what; /* now */
    int n;                    /* marks queued since the last read */
    short at[LOOM_MARKS_MAX]; /* each mark's part (-1: an end) */
    double ms[LOOM_MARKS_MAX];
    part parts[PROF_PARTS];
    int nparts;
    bool full; /* more pairs than PROF_PARTS: the rest in "other" */
    int64_t steps;
    double t0, t_end;   /* host clock: the step's first mark, the last step's end */
    double wall[2];     /* host time from a step's first mark to its end */
    double between;     /* host time from a step's end to the next one's first mark */
    int64_t reads;      /* marks read out mid-step (the queue was full) */
    double cls_ms[2][NCL]; /* the parts' times by class: first step, later steps */
    double ival[NCL];      /* since the last loom_model_profile_interval: by class, */
    int64_t ival_steps;    /* the steps ended, */
    double ival_between;   /* and the host's time between them (ms) */
};

loom_status loom_prof_new(loom_model *m) {
    if (m->prof) return LOOM_OK;
    loom_prof *p = loom_calloc(m->ctx, 1, sizeof *p, "the step profile");
    if (!p) return LOOM_ERR_OOM;
    p->phase = "step";
    m->prof = p;
    return LOOM_OK;
}

void loom_prof_free(loom_prof *p) { free(p); }

void loom_prof_phase(loom_model *m, const char *phase) {
    if (m->prof) m->prof->phase = phase;
}

const char *loom_prof_what(const loom_model *m) { return m->prof ? m->prof->what : NULL; }

static int part_of(loom_prof *p, const char *phase, const char *what) {
    for (int i = p->nparts - 1; i >= 0; i--) /* the recent ones first */
        if ((p->parts[i].phase == phase || !strcmp(p->parts[i].phase, phase)) &&
            (p->parts[i].what == what || !strcmp(p->parts[i].what, what)))
            return i;
    if (p->nparts == PROF_PARTS - 1) { /* the last slot holds the rest */
        p->full = true;
        p->parts[PROF_PARTS - 1].phase = "", p->parts[PROF_PARTS - 1].what = "other";
        return PROF_PARTS - 1;
    }
    p->parts[p->nparts] = (part){.phase = phase, .what = what, .cls = prof_class(what)};
    return p->nparts++;
}

/* The queued marks' times into their parts (the last mark ends the read). */
static loom_status read_marks(loom_model *m) {
    loom_prof *p = m->prof;
    CK(m->dev.be->marks_ms(&m->dev, m->ctx, p->n, p->ms));
    const int b = p->steps > 0;
    for (int i = 0; i + 1 < p->n; i++) {
        if (p->at[i] < 0) continue;
        part *q = &p->parts[p->at[i]];
        q->ms[b] += p->ms[i];
        q->marks[b]++;
        p->cls_ms[b][q->cls] += p->ms[i];
        p->ival[q->cls] += p->ms[i];
    }
    p->n = 0;
    return LOOM_OK;
}

static loom_status put(loom_model *m, int at) {
    loom_prof *p = m->prof;
    CK(m->dev.be->mark(&m->dev, m->ctx, p->n));
    p->at[p->n++] = (short)at;
    return LOOM_OK;
}

loom_status loom_prof_mark(loom_model *m, const char *what) {
    loom_prof *p = m->prof;
    if (!p) return LOOM_OK;
    if (p->n == 0) { /* the step's first mark, or the first after a read */
        const double now = loom_now_s();
        if (p->t0 <= 0.0) {
            p->t0 = now;
            if (p->steps > 0) {
                p->between += now - p->t_end;
                p->ival_between += 1e3 * (now - p->t_end);
            }
        }
    } else if (p->n == LOOM_MARKS_MAX - 1) { /* full: read them, the part goes on */
        CK(put(m, -1));
        CK(read_marks(m));
        p->reads++;
    }
    p->what = what;
    return put(m, part_of(p, p->phase, what));
}

loom_status loom_prof_step_end(loom_model *m) {
    loom_prof *p = m->prof;
    if (!p || (p->n == 0 && p->t0 <= 0.0)) return LOOM_OK;
    if (p->n > 0) {
        CK(put(m, -1));
        CK(read_marks(m));
    }
    const double now = loom_now_s();
    p->wall[p->steps > 0] += now - p->t0;
    p->t0 = 0.0;
    p->t_end = now;
    p->steps++;
    p->ival_steps++;
    p->what = NULL;
    p->phase = "step";
    return LOOM_OK;
}

void loom_prof_report(const loom_prof *p, char *buf, size_t n) {
    if (!n) return;
    buf[0] = '\0';
    if (!p || p->steps == 0) {
        snprintf(buf, n, "no step was profiled");
        return;
    }
    const int b = p->steps > 1; /* the later steps when there are some */
    const int64_t k = b ? p->steps - 1 : 1;
    double total = 0.0;
    for (int i = 0; i < PROF_PARTS; i++) total += p->parts[i].ms[b];
    size_t o = 0;
#define OUT(...)                                                        \
    do {                                                                \
        int w_ = snprintf(buf + o, n - o, __VA_ARGS__);                 \
        if (w_ < 0 || (size_t)w_ >= n - o) return; /* cut: ends there */ \
        o += (size_t)w_;                                                \
    } while (0)
    if (b)
        OUT("steps 2-%lld (the first, warm-up, left out: %.1f ms on the host)",
            (long long)p->steps, 1e3 * p->wall[0]);
    else
        OUT("step 1 only (warm-up included)");
    OUT(": %.2f ms a step on the host", 1e3 * p->wall[b] / (double)k);
    if (b) OUT(", %.2f ms between steps", 1e3 * p->between / (double)k);
    OUT("; the parts on the device, %.2f ms a step, in the order they first ran "
        "(each part's time is its span on the device, idle time within it included)%s:\n",
        total / (double)k,
        p->reads ? " (the marks were read mid-step, which waits for the device)" : "");
    OUT("  %-10s %-26s %10s %7s %8s\n", "phase", "part", "ms/step", "share", "marks");
    for (int i = 0; i < PROF_PARTS; i++) {
        const part *q = &p->parts[i];
        if (!q->marks[b]) continue;
        OUT("  %-10s %-26s %10.3f %6.1f%% %8.1f\n", q->phase, q->what, q->ms[b] / (double)k,
            total > 0.0 ? 100.0 * q->ms[b] / total : 0.0, (double)q->marks[b] / (double)k);
    }
    if (p->full) OUT("  (more parts than %d: the rest counted as other)\n", PROF_PARTS - 1);
    const double *c = p->cls_ms[b], kk = (double)k;
    const double idle = c[CL_IDLE] + (b ? 1e3 * p->between : 0.0);
    OUT("  breakdown, ms a step: compute %.3f, exposed communication %.3f, pipeline bubble %.3f, "
        "idle %.3f (host waits in the step%s)\n",
        c[CL_COMPUTE] / kk, c[CL_COMM] / kk, c[CL_BUBBLE] / kk, idle / kk,
        b ? " and between steps" : "");
#undef OUT
}

void loom_model_profile(const loom_model *m, char *buf, size_t n) {
    if (!m || !buf || !n) return;
    if (!m->prof) {
        snprintf(buf, n, "profiling is off (loom_model_options.profile, --profile)");
        return;
    }
    loom_prof_report(m->prof, buf, n);
}

void loom_model_profile_interval(loom_model *m, loom_step_breakdown *out) {
    memset(out, 0, sizeof *out);
    loom_prof *p = m ? m->prof : NULL;
    if (!p || p->ival_steps == 0) return;
    const double k = (double)p->ival_steps;
    out->steps = p->ival_steps;
    out->compute_ms = p->ival[CL_COMPUTE] / k;
    out->comm_ms = p->ival[CL_COMM] / k;
    out->bubble_ms = p->ival[CL_BUBBLE] / k;
    out->idle_ms = (p->ival[CL_IDLE] + p->ival_between) / k;
    memset(p->ival, 0, sizeof p->ival);
    p->ival_steps = 0;
    p->ival_between = 0.0;
}
