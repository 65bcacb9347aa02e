/* Freezing base tensors in full fine-tuning (include/loom.h's
 * loom_model_set_trainable): a frozen tensor gets no gradient, no optimizer
 * state, no update. The base arena is laid out again with the frozen slots
 * last, past the buckets (loom_arena_place), so the gradient buffer and the
 * distributed optimizer's shards cover the trainable part only; loom_g
 * gives NULL for a frozen slot, which every backward op takes as "no
 * weight gradient". Allowed until the first forward_backward: the layout
 * moves the weights, and nothing that holds gradients or moments exists yet. */
#include <stdlib.h>
#include <string.h>

#include "model.h"

/* Copies each slot's block of `src` (laid out by old_off) to its new place
 * in a fresh buffer of n elements of esz bytes: host memory, or device
 * memory when dev. */
static loom_status move_blocks(loom_model *m, const loom_arena *a, const size_t *old_off,
                               void **buf, size_t esz, bool dev, size_t n) {
    void *dst = NULL;
    loom_status st = LOOM_OK;
    if (dev) {
        if ((st = loom_dev_alloc(m, &dst, n * esz, "parameters"))) return st;
        if ((st = loom_k_zero(m, dst, n * esz))) goto fail;
    } else if (!(dst = loom_calloc(m->ctx, n ? n : 1, esz, "parameters"))) {
        return LOOM_ERR_OOM;
    }
    for (int i = 0; i < a->nslots && !st; i++) {
        char *d = (char *)dst + a->slots[i].off * esz;
        const char *s = (const char *)*buf + old_off[i] * esz;
        if (dev) st = loom_k_copy(m, d, s, a->slots[i].numel * esz);
        else memcpy(d, s, a->slots[i].numel * esz);
    }
    if (st) goto fail;
    if (dev) loom_dev_free(m, *buf);
    else free(*buf);
    *buf = dst;
    return LOOM_OK;
fail:
    if (dev) loom_dev_free(m, dst);
    else free(dst);
    return st;
}

/* Sorts the frozen slots last (stable), renumbers the model's references to
 * base slots, places the arena again and moves the weights. */
static loom_status relayout(loom_model *m) {
    loom_arena *a = &m->base;
    const int n = a->nslots;
    loom_slot *slots = loom_calloc(m->ctx, (size_t)n + 1, sizeof *slots, "parameter slots");
    int *to = loom_calloc(m->ctx, (size_t)n + 1, sizeof *to, "slot map");
    size_t *old_off = loom_calloc(m->ctx, (size_t)n + 1, sizeof *old_off, "slot offsets");
    loom_status st = LOOM_OK;
    if (!slots || !to || !old_off) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    int k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < n; i++)
            if (a->slots[i].frozen == (pass == 1)) {
                to[i] = k;
                old_off[k] = a->slots[i].off;
                slots[k++] = a->slots[i];
            }
    free(a->slots);
    a->slots = slots;
    slots = NULL;
    for (int64_t l = 0; l < m->L; l++)
        for (int j = 0; j < m->layer[l].nb; j++) {
            loom_block *b = &m->layer[l].b[j];
            if (b->norm >= 0) b->norm = to[b->norm];
            for (int s = 0; s < LOOM_BLOCK_MAX_SLOTS; s++)
                if (b->w[s] >= 0) b->w[s] = to[b->w[s]];
        }
    int *refs[] = {&m->embed, &m->head, &m->final_norm};
    for (size_t j = 0; j < sizeof refs / sizeof refs[0]; j++)
        if (*refs[j] >= 0) *refs[j] = to[*refs[j]];
    loom_grad_defer_reset(m, a); /* per-slot marks and chunk lists: rebuilt when needed */
    if ((st = loom_arena_place(m, a))) goto done;
    const bool shared = a->wc == (void *)a->w;
    if (a->w && (st = move_blocks(m, a, old_off, (void **)&a->w, sizeof(float), a->w_on_dev,
                                  a->nparams)))
        goto done;
    if (shared) a->wc = a->w;
    else if (a->wc)
        st = move_blocks(m, a, old_off, &a->wc, m->dev.esz, m->dev.cuda, a->nparams);
done:
    free(slots);
    free(to);
    free(old_off);
    return st;
}

loom_status loom_model_set_trainable(loom_model *m, const char *name, int trainable) {
    loom_ctx *ctx = m->ctx;
    loom_arena *a = &m->base;
    if (!name) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "set_trainable: name is NULL");
    size_t p = 0;
    while (p < m->plan.n && strcmp(m->plan.p[p].name, name)) p++;
    if (p == m->plan.n)
        return loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                         "set_trainable: %s is not a tensor of this %s model (loom inspect lists "
                         "them)", name, m->cfg.model_type);
    if (m->nadapters)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "set_trainable(%s): this model has LoRA adapters, which freeze the whole "
                         "base model", name);
    if (a->g || a->adam_m || a->step)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "set_trainable(%s): freeze or unfreeze tensors before the first "
                         "forward_backward (the gradients and optimizer state are laid out then)",
                         name);
    if (!m->pfrozen && !(m->pfrozen = loom_calloc(ctx, m->plan.n + 1, 1, "frozen tensors")))
        return LOOM_ERR_OOM;
    m->pfrozen[p] = !trainable;
    bool change = false;
    for (int i = 0; i < a->nslots; i++)
        if (!strcmp(a->slots[i].name, name) && a->slots[i].frozen != !trainable) {
            a->slots[i].frozen = !trainable;
            change = true;
        }
    /* another pipeline stage may hold the tensor: nothing to move here */
    return change ? relayout(m) : LOOM_OK;
}
