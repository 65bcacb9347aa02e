/* The layer table (block.h): which kinds make each layer, and the LoRA
 * hooks the kinds call around their linears. */
#include "block.h"

#include <string.h>

#include "model.h"
#include "prof.h"

const loom_block_kind *const loom_block_kinds[LOOM_NKINDS] = {
    [LOOM_KIND_ATTN] = &loom_block_attn,
    [LOOM_KIND_MLP] = &loom_block_mlp,
    [LOOM_KIND_MOE] = &loom_block_moe,
    [LOOM_KIND_GDN] = &loom_block_gdn,
};

int loom_layer_kinds(const loom_model_config *c, int64_t l, const loom_block_kind **k) {
    k[0] = c->linear_attn && c->linear_attn[l] ? &loom_block_gdn : &loom_block_attn;
    k[1] = loom_config_layer_is_moe(c, l) ? &loom_block_moe : &loom_block_mlp;
    return 2;
}

/* Layer l's blocks and linears, its slots -1. */
static loom_status layer_init(loom_ctx *ctx, const loom_model_config *c, int64_t l,
                              loom_layer *L) {
    const loom_block_kind *k[LOOM_LAYER_MAX_BLOCKS];
    memset(L, 0, sizeof *L);
    L->nb = loom_layer_kinds(c, l, k);
    for (int j = 0; j < L->nb; j++) {
        loom_block *b = &L->b[j];
        b->kind = k[j];
        b->norm = -1;
        for (int i = 0; i < LOOM_BLOCK_MAX_SLOTS; i++) b->w[i] = -1;
        b->lin0 = L->nlin;
        if (k[j]->nslots > LOOM_BLOCK_MAX_SLOTS || k[j]->nlin > LOOM_BLOCK_MAX_LINEARS ||
            L->nlin + k[j]->nlin > LOOM_LAYER_MAX_LINEARS)
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "layer %lld: block kind %s has more tensors "
                             "or linears than block.h's limits", (long long)l, k[j]->name);
        for (int i = 0; i < k[j]->nlin; i++) {
            const char *name = k[j]->lin[i].name;
            L->lin[L->nlin++] = (loom_layer_lin){.b = j, .k = i,
                                                 .target = loom_lora_target_find(name, strlen(name)),
                                                 .group = b->lin0 + k[j]->lin[i].group};
        }
    }
    for (int i = 0; i < L->nlin; i++) {
        for (int n = 0; n < L->nlin; n++) L->lin[i].gn += L->lin[n].group == L->lin[i].group;
        /* a group's LoRA backward is one loom_k_lora_dy_n: 3 projections at most */
        if (L->lin[i].gn > 3 || L->lin[i].target >= LOOM_LORA_NMOD)
            return loom_errf(ctx, LOOM_ERR_INTERNAL, "layer %lld: a LoRA group of more than 3 "
                             "linears, or more target names than LOOM_LORA_NMOD", (long long)l);
    }
    return LOOM_OK;
}

loom_status loom_layers_build(loom_ctx *ctx, const loom_model_config *c,
                              const loom_param_plan *plan, loom_layer *layers) {
    for (int64_t l = 0; l < c->num_layers; l++) CK(layer_init(ctx, c, l, &layers[l]));
    /* each linear's features from its weight's shape (out, in) */
    for (size_t i = 0; i < plan->n; i++) {
        const loom_param_spec *p = &plan->p[i];
        if (p->block < 0 || p->slot < 0) continue;
        loom_layer *L = &layers[p->layer];
        const loom_block_kind *k = L->b[p->block].kind;
        for (int n = 0; n < L->nlin; n++) {
            loom_layer_lin *x = &L->lin[n];
            if (x->b != p->block || k->lin[x->k].w != p->slot) continue;
            x->out = p->shape[0];
            x->in = p->shape[1];
            x->row_par = k->slots[p->slot].shard == LOOM_SHARD_COLS;
            x->rep = k->slots[p->slot].shard == LOOM_SHARD_NONE;
            x->nparts = p->nparts;
            memcpy(x->part, p->part, sizeof x->part);
        }
    }
    /* a linear whose weight the kind did not declare for the layer is absent:
     * no LoRA target */
    for (int64_t l = 0; l < c->num_layers; l++)
        for (int n = 0; n < layers[l].nlin; n++)
            if (!layers[l].lin[n].out) layers[l].lin[n].target = -1;
    return LOOM_OK;
}

/* ---- LoRA targets ---- */

/* Is linear i of kind id's name that of an earlier kind's or linear's? */
static bool name_seen(int id, int i, const char *name) {
    for (int d = 0; d <= id; d++) {
        const loom_block_kind *k = loom_block_kinds[d];
        for (int n = 0; n < (d < id ? k->nlin : i); n++)
            if (!strcmp(k->lin[n].name, name)) return true;
    }
    return false;
}

/* Walks the distinct names: stops at number t or at the name p[0..n) (p
 * NULL: by number), *at set to its linear; returns its number, or the count
 * when neither comes. */
static int targets(int t, const char *p, size_t n, const loom_block_linear **at) {
    int count = 0;
    for (int id = 0; id < LOOM_NKINDS; id++) {
        const loom_block_kind *k = loom_block_kinds[id];
        for (int i = 0; i < k->nlin; i++) {
            const char *name = k->lin[i].name;
            if (name_seen(id, i, name)) continue;
            if (p ? strlen(name) == n && !strncmp(name, p, n) : count == t) {
                *at = &k->lin[i];
                return count;
            }
            count++;
        }
    }
    return count;
}

int loom_lora_ntargets(void) {
    const loom_block_linear *at = NULL;
    return targets(-1, NULL, 0, &at);
}

const char *loom_lora_target_name(int t) {
    const loom_block_linear *at = NULL;
    targets(t, NULL, 0, &at);
    return at ? at->name : NULL;
}

bool loom_lora_target_named(int t) {
    const loom_block_linear *at = NULL;
    targets(t, NULL, 0, &at);
    return at && at->named;
}

int loom_lora_target_find(const char *p, size_t n) {
    const loom_block_linear *at = NULL;
    const int t = targets(-1, p, n, &at);
    return at ? t : -1;
}

/* ---- the kinds' LoRA hooks ---- */

loom_status loom_blk_lin(const loom_blk *b, int k, const void *x, int64_t T, int64_t in,
                         const void *W, int64_t out, void *y) {
    loom_model *m = b->m;
    const int mod = b->lin0 + k;
    const bool lo = loom_lora_covers(m, b->l, mod);
    bool both = false;
    if (lo) CK(loom_lora_fwd(m, b->lora_u, b->l, mod, x, T, y, 0.0f, W, &both));
    if (both) return LOOM_OK;
    return loom_k_lin_fwd(m, x, T, in, W, out, 1.0f, lo ? 1.0f : 0.0f, y);
}

loom_status loom_blk_lora_fwd(const loom_blk *b, int k, const void *x, int64_t T, void *y) {
    return loom_lora_fwd(b->m, b->lora_u, b->l, b->lin0 + k, x, T, y, 0.0f, NULL, NULL);
}

loom_status loom_blk_lora_bwd(const loom_blk *b, int k, const void *x, int64_t T,
                              const void *dy, void *dx, bool *acc, loom_dx_term *t, int *n) {
    bool wrote = false;
    CK(loom_lora_bwd(b->m, b->lora_u, b->l, b->lin0 + k, x, T, dy, dx, *acc ? 1.0f : 0.0f, &wrote,
                     t ? &t[*n] : NULL));
    if (wrote) *acc = true;
    if (t && t[*n].dy) (*n)++;
    return LOOM_OK;
}

/* ---- context parallelism: the whole micro-batch's rows ---- */

/* w columns of dt in the model's elements (the row ops copy bits) */
static int64_t as_adt(const loom_model *m, int64_t w, loom_dtype dt) {
    return w * (int64_t)loom_dtype_size(dt) / (int64_t)m->dev.esz;
}

loom_status loom_cp_gather(loom_model *m, const void *loc, int64_t w, loom_dtype dt, void *full,
                           void *blk) {
    const size_t n = (size_t)(m->Tc * w);
    if (m->cp == 1) return loom_k_copy(m, full, loc, n * loom_dtype_size(dt));
    LOOM_PROF_AROUND(m, "cp comm", loom_comm_allgather(m->mesh->cp, loc, blk, n, dt));
    return loom_k_rows_scatter(m, full, blk, m->d_perm, m->T, as_adt(m, w, dt));
}

loom_status loom_cp_reduce(loom_model *m, const void *full, int64_t w, loom_dtype dt, void *loc,
                           void *blk) {
    const size_t n = (size_t)(m->Tc * w);
    if (m->cp == 1) return loom_k_copy(m, loc, full, n * loom_dtype_size(dt));
    CK(loom_k_rows_gather(m, blk, full, m->d_perm, m->T, as_adt(m, w, dt)));
    LOOM_PROF_AROUND(m, "cp comm",
                     loom_comm_reduce_scatter(m->mesh->cp, blk, loc, n, dt, LOOM_RED_SUM));
    return LOOM_OK;
}

loom_status loom_cp_take(loom_model *m, const void *full, int64_t w, void *loc) {
    const int32_t *mine = m->d_perm + (int64_t)m->mesh->cp_rank * m->Tc;
    return loom_k_rows_gather(m, loc, full, mine, m->Tc, w);
}

loom_status loom_cp_place(loom_model *m, const void *loc, int64_t w, void *full) {
    const int32_t *mine = m->d_perm + (int64_t)m->mesh->cp_rank * m->Tc;
    CK(loom_k_zero(m, full, (size_t)(m->T * w) * m->dev.esz));
    return loom_k_rows_scatter(m, full, loc, mine, m->Tc, w);
}
