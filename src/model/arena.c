/* A model's arenas (model.h's loom_arena): the slots' places and buckets
 * (the distributed optimizer's shards), their memory on the device (values,
 * compute copy, gradients, optimizer state), the fp32 master's trips between
 * host and device, and their release. */
#include <stdlib.h>
#include <string.h>

#include "model.h"

/* Slots 64-byte aligned; buckets closed at slot boundaries once they hold
 * bucket_elems, each padded to a multiple of dp*cp. Memory: one block per
 * class and arena (values, compute copy, gradients, optimizer state). */
loom_status loom_arena_place(loom_model *m, loom_arena *a) {
    loom_ctx *ctx = m->ctx;
    const size_t dgrp = (size_t)(m->dp * m->cp), egrp = (size_t)(m->edp > 0 ? m->edp : m->dp * m->cp);
    a->bucket_off = loom_calloc(ctx, (size_t)a->nslots + 1, sizeof(size_t), "buckets");
    a->bucket_len = loom_calloc(ctx, (size_t)a->nslots + 1, sizeof(size_t), "buckets");
    a->bucket_ex = loom_calloc(ctx, (size_t)a->nslots + 1, 1, "buckets");
    if (!a->bucket_off || !a->bucket_len || !a->bucket_ex) return LOOM_ERR_OOM;
    /* frozen slots (loom_model_set_trainable sorts them last) take no part
     * in the buckets: they follow the gradient part, ngrad */
    int ntrain = a->nslots;
    while (ntrain > 0 && a->slots[ntrain - 1].frozen) ntrain--;
    size_t off = 0, b0 = 0;
    a->nbuckets = 0;
    a->shard_numel = 0;
    for (int i = 0; i < a->nslots; i++) {
        a->slots[i].off = off;
        off += (a->slots[i].numel + 15) & ~(size_t)15;
        /* a bucket holds experts' tensors or others', never both */
        const bool ex = a->slots[i].expert, turn = i + 1 < ntrain && a->slots[i + 1].expert != ex;
        if (i < ntrain && (off - b0 >= (size_t)m->bucket_elems || i == ntrain - 1 || turn)) {
            const size_t grp = ex ? egrp : dgrp;
            size_t len = (off - b0 + grp * 16 - 1) / (grp * 16) * (grp * 16);
            a->bucket_off[a->nbuckets] = b0;
            a->bucket_ex[a->nbuckets] = ex;
            a->bucket_len[a->nbuckets++] = len;
            a->shard_numel += len / grp;
            off = b0 = b0 + len;
        }
    }
    a->ngrad = a->nbuckets ? a->bucket_off[a->nbuckets - 1] + a->bucket_len[a->nbuckets - 1] : 0;
    a->nparams = off;
    return LOOM_OK;
}

loom_status loom_arena_layout(loom_model *m, loom_arena *a, bool frozen) {
    loom_status st = loom_arena_place(m, a);
    if (st) return st;
    const size_t off = a->nparams;
    a->w = loom_calloc(m->ctx, off ? off : 1, sizeof(float), "parameters");
    if (!a->w) return LOOM_ERR_OOM;
    if (!frozen) return loom_dev_alloc(m, (void **)&a->g, a->ngrad * sizeof(float), "gradients");
    return LOOM_OK;
}

loom_status loom_arena_commit_ex(loom_model *m, loom_arena *a, bool defer_master) {
    loom_status st;
    const size_t n = a->nparams;
    if (m->dev.cuda && defer_master && m->dev.adt != LOOM_F32) {
        /* the compute copy only, converted on the GPU through a bounded fp32
         * staging buffer; the master stays in host memory until the arena is
         * trained (loom_arena_master_to_device) or frozen (dropped), so a
         * base that LoRA freezes never holds its fp32 copy on the GPU */
        if ((st = loom_dev_alloc(m, &a->wc, n * m->dev.esz, "parameters (compute copy)"))) return st;
        const size_t chunk = n < ((size_t)32 << 20) ? n : ((size_t)32 << 20);
        float *stage = NULL;
        if ((st = loom_dev_alloc(m, (void **)&stage, (chunk ? chunk : 1) * sizeof(float),
                                 "parameters (staging)")))
            return st;
        for (size_t off = 0; off < n && !st; off += chunk) {
            const size_t len = n - off < chunk ? n - off : chunk;
            st = loom_k_upload(m, stage, a->w + off, len * sizeof(float));
            if (!st) st = loom_k_convert(m, (char *)a->wc + off * m->dev.esz, m->dev.adt, stage,
                                         LOOM_F32, len);
        }
        loom_dev_free(m, stage);
        return st;
    }
    if (m->dev.cuda) {
        float *d = NULL;
        if ((st = loom_dev_alloc(m, (void **)&d, n * sizeof(float), "parameters"))) return st;
        if ((st = loom_k_upload(m, d, a->w, n * sizeof(float)))) {
            loom_dev_free(m, d);
            return st;
        }
        free(a->w);
        a->w = d;
        a->w_on_dev = true;
    }
    if (m->dev.adt == LOOM_F32) {
        a->wc = a->w;
        return LOOM_OK;
    }
    if ((st = loom_dev_alloc(m, &a->wc, n * m->dev.esz, "parameters (compute copy)"))) return st;
    return loom_arena_sync(m, a);
}

loom_status loom_arena_commit(loom_model *m, loom_arena *a) {
    return loom_arena_commit_ex(m, a, false);
}

loom_status loom_arena_master_to_device(loom_model *m, loom_arena *a) {
    if (!m->dev.cuda || a->w_on_dev || (!a->w && !a->w_in_wc)) return LOOM_OK;
    float *d = NULL;
    loom_status st = loom_dev_alloc(m, (void **)&d, a->nparams * sizeof(float), "parameters");
    if (!st)
        st = a->w ? loom_k_upload(m, d, a->w, a->nparams * sizeof(float))
                  : loom_k_convert(m, d, LOOM_F32, a->wc, m->dev.adt, a->nparams);
    if (st) {
        loom_dev_free(m, d);
        return st;
    }
    free(a->w);
    a->w = d;
    a->w_on_dev = true;
    a->w_in_wc = false;
    return LOOM_OK;
}

loom_status loom_arena_sync(loom_model *m, loom_arena *a) {
    if (!a->wc || !a->w || a->wc == (void *)a->w) return LOOM_OK;
    return loom_k_convert(m, a->wc, m->dev.adt, a->w, LOOM_F32, a->nparams);
}

loom_status loom_arena_host(loom_model *m, const loom_arena *a, int i, bool grads, float **tmp,
                            size_t *tmp_cap, const float **out) {
    const loom_slot *s = &a->slots[i];
    if (!m->dev.cuda || (!grads && a->w && !a->w_on_dev)) { /* CPU, or a master still on the host */
        *out = (grads ? a->g : a->w) + s->off;
        return LOOM_OK;
    }
    /* room for the fp32 values, and for the compute copy's before widening */
    if (*tmp_cap < s->numel) {
        float *t = realloc(*tmp, (s->numel ? s->numel : 1) * sizeof(float));
        if (!t) return loom_errf(m->ctx, LOOM_ERR_OOM, "no memory for a copy of %s", s->name);
        *tmp = t;
        *tmp_cap = s->numel;
    }
    *out = *tmp;
    if (grads || a->w)
        return loom_k_download(m, *tmp, (grads ? a->g : a->w) + s->off, s->numel * sizeof(float));
    /* a frozen base kept only in the compute dtype */
    return loom_k_download_f32(m, *tmp, (const char *)a->wc + s->off * m->dev.esz, s->numel);
}

void loom_arena_drop_master(loom_model *m, loom_arena *a) {
    a->w_in_wc = false; /* frozen: kept in the compute dtype for good */
    if (!m->dev.cuda || !a->w || a->wc == (void *)a->w) return;
    if (!a->w_on_dev) { /* never moved to the GPU */
        free(a->w);
        a->w = NULL;
        return;
    }
    loom_dev_free(m, a->w);
    a->w = NULL;
    a->w_on_dev = false;
}

void loom_arena_free(loom_model *m, loom_arena *a) {
    free(a->slots);
    if (a->wc != (void *)a->w) loom_dev_free(m, a->wc);
    if (a->w_on_dev)
        loom_dev_free(m, a->w);
    else
        free(a->w);
    loom_dev_free(m, a->g);
    loom_dev_free(m, a->gshard_is_g ? a->adam_m : a->gshard); /* the block of the moments */
    loom_k_lists_free(m, a, false);
    loom_grad_defer_reset(m, a);
    free(a->bucket_off);
    free(a->bucket_len);
    free(a->bucket_ex);
    memset(a, 0, sizeof *a);
}
