/* prof.h: where a training step's time goes (--profile).
 *
 * The model's code marks the start of each part of the step, named by a
 * phase (forward, recompute, backward, step) and what runs (attn, moe.a2a,
 * gradient reduce, ...). Each mark is a point on the device's queue (a CUDA
 * event on the model's stream; the host's clock on the CPU, whose ops are
 * done when they return), so a part's time is the device's time from its
 * mark to the next: the kernels it queued, the collectives it waited on,
 * and the device's idle time while the host was in that part (a host
 * synchronisation, launch gaps). The parts of a step add up to its span on
 * the device. At the step's end the marks are read and summed by name; the
 * first step (warm-up) is reported apart from the rest.
 *
 * With profiling off every call returns at once (m->prof NULL). */
#ifndef LOOM_PROF_H
#define LOOM_PROF_H

#include <stddef.h>

#include "loom.h"

struct loom_model;
typedef struct loom_prof loom_prof;

loom_status loom_prof_new(struct loom_model *m);
void loom_prof_free(loom_prof *p);
/* The phase the next marks belong to: a string that lives as long as the
 * model (a literal). */
void loom_prof_phase(struct loom_model *m, const char *phase);
/* A part named `what` (a literal) starts here, in the current phase. */
loom_status loom_prof_mark(struct loom_model *m, const char *what);
/* The part running now (NULL off): to mark it again after a nested one. */
const char *loom_prof_what(const struct loom_model *m);
/* The step is over (after its optimizer step): its marks are read and
 * added to the totals. */
loom_status loom_prof_step_end(struct loom_model *m);
/* The report (see loom_model_profile in loom.h). */
void loom_prof_report(const loom_prof *p, char *buf, size_t n);

/* A nested part around one call: `what` while expr runs, then the part
 * that was running. */
#define LOOM_PROF_AROUND(m, what, expr)                        \
    do {                                                       \
        const char *was_ = loom_prof_what(m);                  \
        CK(loom_prof_mark((m), (what)));                       \
        CK(expr);                                              \
        if (was_) CK(loom_prof_mark((m), was_));               \
    } while (0)

#endif /* LOOM_PROF_H */
