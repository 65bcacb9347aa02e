/* The MoE routing tables' host copies (moe_tabs.h): per layer, a short list
 * of (key, ncnt, nrc, ints), one entry per activation set that layer has
 * had (the micro-batches a pipeline keeps in flight). */
#include "moe_tabs.h"

#include <stdlib.h>
#include <string.h>

typedef struct entry {
    const void *key;
    int64_t ncnt, nrc;
    int32_t *v; /* cnt, then rc */
} entry;

typedef struct layer_tabs {
    entry *e;
    int n, cap;
} layer_tabs;

struct loom_moe_tabs {
    int64_t L;
    layer_tabs *lay;
};

static entry *find(const loom_moe_tabs *t, int64_t l, const void *key) {
    if (!t || l < 0 || l >= t->L) return NULL;
    const layer_tabs *lt = &t->lay[l];
    for (int i = 0; i < lt->n; i++)
        if (lt->e[i].key == key) return &lt->e[i];
    return NULL;
}

loom_status loom_moe_tabs_put(loom_ctx *ctx, loom_moe_tabs **tp, int64_t L, int64_t l,
                              const void *key, const int32_t *cnt, int64_t ncnt,
                              const int32_t *rc, int64_t nrc) {
    if (!*tp) {
        loom_moe_tabs *t = loom_calloc(ctx, 1, sizeof *t, "MoE routing tables");
        if (!t) return LOOM_ERR_OOM;
        if (!(t->lay = loom_calloc(ctx, (size_t)(L > 0 ? L : 1), sizeof *t->lay,
                                   "MoE routing tables"))) {
            free(t);
            return LOOM_ERR_OOM;
        }
        t->L = L;
        *tp = t;
    }
    loom_moe_tabs *t = *tp;
    if (l < 0 || l >= t->L || ncnt < 0 || nrc < 0)
        return loom_errf(ctx, LOOM_ERR_INTERNAL, "MoE routing tables: layer %lld of %lld",
                         (long long)l, (long long)t->L);
    entry *e = find(t, l, key);
    if (!e) {
        layer_tabs *lt = &t->lay[l];
        if (lt->n == lt->cap) {
            const int cap = lt->cap ? 2 * lt->cap : 4;
            entry *p = realloc(lt->e, (size_t)cap * sizeof *p);
            if (!p) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory for MoE routing tables");
            lt->e = p, lt->cap = cap;
        }
        e = &lt->e[lt->n++];
        *e = (entry){key, 0, 0, NULL};
    }
    if (e->ncnt + e->nrc != ncnt + nrc) {
        int32_t *v = realloc(e->v, (size_t)(ncnt + nrc ? ncnt + nrc : 1) * sizeof *v);
        if (!v) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory for MoE routing tables");
        e->v = v;
    }
    e->ncnt = ncnt, e->nrc = nrc;
    memcpy(e->v, cnt, (size_t)ncnt * sizeof *cnt);
    if (nrc) memcpy(e->v + ncnt, rc, (size_t)nrc * sizeof *rc);
    return LOOM_OK;
}

bool loom_moe_tabs_get(const loom_moe_tabs *t, int64_t l, const void *key, int32_t *cnt,
                       int64_t ncnt, int32_t *rc, int64_t nrc) {
    const entry *e = find(t, l, key);
    if (!e || e->ncnt != ncnt || e->nrc != nrc) return false;
    memcpy(cnt, e->v, (size_t)ncnt * sizeof *cnt);
    if (nrc) memcpy(rc, e->v + ncnt, (size_t)nrc * sizeof *rc);
    return true;
}

void loom_moe_tabs_free(loom_moe_tabs *t) {
    if (!t) return;
    for (int64_t l = 0; l < t->L; l++) {
        for (int i = 0; i < t->lay[l].n; i++) free(t->lay[l].e[i].v);
        free(t->lay[l].e);
    }
    free(t->lay);
    free(t);
}
