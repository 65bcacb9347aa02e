/* transformers v5's fused experts read as the hub's per-expert tensors, and
 * written from them (hf_experts.h). */
#include "hf_experts.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

enum { GATE, UP, DOWN, NKIND };
static const char *const kind_leaf[NKIND] = {"gate_proj", "up_proj", "down_proj"};
static const char GU[] = "experts.gate_up_proj", DN[] = "experts.down_proj";

/* "[2, 3]" into buf. */
static const char *shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

/* A hub per-expert tensor "<P>experts.<e>.<gate_proj|up_proj|down_proj>.<weight|bias>":
 * the length of P (empty or ending in '.'), e, the kind and whether a bias. */
static bool hub_name(const char *name, size_t *plen, int64_t *e, int *kind, bool *bias) {
    for (const char *p = strstr(name, "experts."); p; p = strstr(p + 1, "experts.")) {
        if (p != name && p[-1] != '.') continue;
        const char *q = p + 8;
        int64_t v = 0;
        int nd = 0;
        while (*q >= '0' && *q <= '9' && nd < 12) v = v * 10 + (*q++ - '0'), nd++;
        if (!nd || *q != '.' || (nd > 1 && p[8] == '0')) continue;
        for (int k = 0; k < NKIND; k++) {
            const size_t n = strlen(kind_leaf[k]);
            if (strncmp(q + 1, kind_leaf[k], n) || q[1 + n] != '.') continue;
            const char *leaf = q + 2 + n;
            if (strcmp(leaf, "weight") && strcmp(leaf, "bias")) break;
            *plen = (size_t)(p - name);
            *e = v;
            *kind = k;
            *bias = leaf[0] == 'b';
            return true;
        }
    }
    return false;
}

/* The length of P when name is "<P><suffix>" (P empty or ending in '.'), else -1. */
static long fused_at(const char *name, const char *suffix) {
    const size_t n = strlen(name), s = strlen(suffix);
    if (n < s || strcmp(name + n - s, suffix) || (n > s && name[n - s - 1] != '.')) return -1;
    return (long)(n - s);
}

/* st's tensor "<name[0..plen)><suffix>", or NULL. */
static const loom_st_tensor *find_with(const loom_safetensors *st, loom_sb *key, const char *name,
                                       size_t plen, const char *suffix) {
    key->len = 0;
    loom_sb_append(key, name, plen);
    loom_sb_puts(key, suffix);
    return key->failed ? NULL : loom_st_find(st, key->buf);
}

/* Checks the pair gate_up_proj gu, down_proj dn of one layer. */
static loom_status check_pair(loom_ctx *ctx, const loom_safetensors *st, const loom_st_tensor *gu,
                              const loom_st_tensor *dn) {
    const char *fg = loom_st_file_path(st, gu->file), *fd = loom_st_file_path(st, dn->file);
    char a[160], b[160];
    const loom_st_tensor *bad = gu->ndim != 3 ? gu : dn->ndim != 3 ? dn : NULL;
    if (bad)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "%s: tensor '%s' has shape %s; transformers' fused experts are 3-D: "
                         "gate_up_proj [experts, 2 * moe_intermediate_size, hidden_size] and "
                         "down_proj [experts, hidden_size, moe_intermediate_size]",
                         bad == gu ? fg : fd, bad->name,
                         shape_str(a, sizeof a, bad->ndim, bad->shape));
    for (int d = 0; d < 3 && !bad; d++) bad = !gu->shape[d] ? gu : !dn->shape[d] ? dn : NULL;
    if (bad)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "%s: tensor '%s' has shape %s: fused experts have no dimension of 0",
                         bad == gu ? fg : fd, bad->name,
                         shape_str(a, sizeof a, bad->ndim, bad->shape));
    if (gu->shape[1] % 2)
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "%s: tensor '%s' has shape %s, but its second dimension must be even: "
                         "[experts, 2 * moe_intermediate_size, hidden_size], each expert's gate "
                         "rows then its up rows",
                         fg, gu->name, shape_str(a, sizeof a, 3, gu->shape));
    const int64_t want[3] = {gu->shape[0], gu->shape[2], gu->shape[1] / 2};
    if (dn->shape[0] != want[0] || dn->shape[1] != want[1] || dn->shape[2] != want[2])
        return loom_errf(ctx, LOOM_ERR_SHAPE,
                         "%s: tensor '%s' has shape %s, but %s [experts, 2 * I, hidden_size] = "
                         "%s%s%s implies down_proj [experts, hidden_size, I] = %s: the fused "
                         "experts of this layer disagree",
                         fd, dn->name, shape_str(a, sizeof a, 3, dn->shape), gu->name,
                         shape_str(b, sizeof b, 3, gu->shape), fg == fd ? "" : " in ",
                         fg == fd ? "" : fg, shape_str((char[160]){0}, 160, 3, want));
    return LOOM_OK;
}

/* One pair's views, appended to add (names into names, NUL-separated). */
static void add_views(const loom_st_tensor *gu, const loom_st_tensor *dn, size_t plen,
                      loom_st_tensor *add, size_t *nadd, loom_sb *names) {
    const int64_t E = gu->shape[0], I = gu->shape[1] / 2, H = gu->shape[2];
    for (int64_t e = 0; e < E; e++)
        for (int k = 0; k < NKIND; k++) {
            const loom_st_tensor *f = k == DOWN ? dn : gu;
            const size_t esz = loom_dtype_size(f->dtype);
            loom_st_tensor *v = memset(&add[(*nadd)++], 0, sizeof *add);
            v->dtype = f->dtype;
            v->ndim = 2;
            v->shape[0] = k == DOWN ? H : I;
            v->shape[1] = k == DOWN ? I : H;
            v->numel = (uint64_t)(I * H);
            v->nbytes = v->numel * esz;
            v->data =
                (const char *)f->data + (size_t)(e * (k == DOWN ? 1 : 2) + (k == UP)) * v->nbytes;
            v->file = f->file;
            v->view = true;
            loom_sb_append(names, gu->name, plen);
            loom_sb_printf(names, "experts.%" PRId64 ".%s.weight", e, kind_leaf[k]);
            loom_sb_putc(names, '\0');
        }
}

loom_status loom_hf_experts_unfuse(loom_ctx *ctx, loom_safetensors *st) {
    const size_t n = loom_st_count(st);
    loom_sb key, names;
    loom_sb_init(&key);
    loom_sb_init(&names);
    const char **drop = NULL;
    loom_st_tensor *add = NULL;
    size_t ndrop = 0, nadd = 0, nview = 0;
    loom_status s = LOOM_OK;
    /* the pairs, checked; and no layer in both layouts */
    for (size_t i = 0; i < n && !s; i++) {
        const loom_st_tensor *t = loom_st_at(st, i), *other = NULL;
        const char *path = loom_st_file_path(st, t->file);
        const long pg = fused_at(t->name, GU), pd = fused_at(t->name, DN);
        size_t plen;
        int64_t e;
        int kind;
        bool bias;
        if (pg >= 0 || pd >= 0) {
            other = pg >= 0 ? find_with(st, &key, t->name, (size_t)pg, DN)
                            : find_with(st, &key, t->name, (size_t)pd, GU);
            if (!other && !key.failed)
                s = loom_errf(ctx, LOOM_ERR_NOT_FOUND,
                              "%s: tensor '%s' (transformers' fused experts) has no '%s' beside "
                              "it: a fused checkpoint holds gate_up_proj and down_proj for each "
                              "layer",
                              path, t->name, key.buf);
            else if (other && pg >= 0 && !(s = check_pair(ctx, st, t, other)))
                nview += 3 * (size_t)t->shape[0], ndrop += 2;
        } else if (hub_name(t->name, &plen, &e, &kind, &bias) &&
                   (find_with(st, &key, t->name, plen, GU) ||
                    find_with(st, &key, t->name, plen, DN))) {
            s = loom_errf(ctx, LOOM_ERR_FORMAT,
                          "%s: tensor '%s' is in the hub's per-expert layout, but its layer also "
                          "has transformers' fused experts ('%s'): a checkpoint keeps one layout "
                          "per layer (re-save it from the model that wrote it)",
                          path, t->name, key.buf);
        }
        if (!s && key.failed) s = loom_errf(ctx, LOOM_ERR_OOM, "out of memory for tensor names");
    }
    if (s || !ndrop) goto done;
    drop = loom_malloc(ctx, ndrop * sizeof *drop, "fused experts");
    add = loom_malloc(ctx, nview * sizeof *add, "fused experts");
    if (!drop || !add) {
        s = LOOM_ERR_OOM;
        goto done;
    }
    ndrop = 0;
    for (size_t i = 0; i < n; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        const long pg = fused_at(t->name, GU);
        if (pg < 0) continue;
        const loom_st_tensor *dn = find_with(st, &key, t->name, (size_t)pg, DN);
        if (!dn) break; /* out of memory: key.failed */
        drop[ndrop++] = t->name;
        drop[ndrop++] = dn->name;
        add_views(t, dn, (size_t)pg, add, &nadd, &names);
    }
    if (key.failed || names.failed) {
        s = loom_errf(ctx, LOOM_ERR_OOM, "out of memory for tensor names");
        goto done;
    }
    const char *p = names.buf;
    for (size_t i = 0; i < nadd; i++, p += strlen(p) + 1) add[i].name = p;
    s = loom_st_splice(ctx, st, drop, ndrop, add, nadd);
done:
    free(drop);
    free(add);
    loom_sb_free(&key);
    loom_sb_free(&names);
    return s;
}

bool loom_hf_dir_experts_fused(const loom_safetensors *st) {
    for (size_t i = 0; i < loom_st_count(st); i++)
        if (loom_st_at(st, i)->view && strstr(loom_st_at(st, i)->name, "experts.")) return true;
    return false;
}

/* ---- writing ---- */

/* One layer's experts in the source: the index of each expert's tensors. */
typedef struct group {
    char *prefix; /* P */
    size_t plen;
    int64_t E;          /* 1 + the largest expert number seen */
    int64_t I, H;       /* expert 0's gate_proj [I, H] */
    size_t *idx[NKIND]; /* (cap) SIZE_MAX: not seen */
    size_t cap;
    bool placed; /* its fused tensors are in the layout */
} group;

typedef struct groups {
    group *g;
    size_t n, cap;
} groups;

static void groups_free(groups *gs) {
    for (size_t i = 0; i < gs->n; i++) {
        free(gs->g[i].prefix);
        for (int k = 0; k < NKIND; k++) free(gs->g[i].idx[k]);
    }
    free(gs->g);
}

/* The group of P = name[0..plen), made when new (NULL: out of memory). */
static group *group_of(loom_ctx *ctx, groups *gs, const char *name, size_t plen) {
    for (size_t i = gs->n; i-- > 0;) /* a layer's experts come together: the last one first */
        if (gs->g[i].plen == plen && !strncmp(gs->g[i].prefix, name, plen)) return &gs->g[i];
    if (gs->n == gs->cap) {
        size_t cap = gs->cap ? 2 * gs->cap : 16;
        group *p = loom_realloc(ctx, gs->g, cap * sizeof *p, "experts");
        if (!p) return NULL;
        gs->g = p;
        gs->cap = cap;
    }
    group *g = memset(&gs->g[gs->n], 0, sizeof *g);
    if (!(g->prefix = loom_malloc(ctx, plen + 1, "experts"))) return NULL;
    memcpy(g->prefix, name, plen);
    g->prefix[plen] = '\0';
    g->plen = plen;
    gs->n++;
    return g;
}

static loom_status group_add(loom_ctx *ctx, group *g, int64_t e, int kind, size_t i,
                             const char *name) {
    if ((uint64_t)e >= g->cap) {
        size_t cap = g->cap ? g->cap : 16;
        while (cap <= (uint64_t)e) cap *= 2;
        for (int k = 0; k < NKIND; k++) {
            size_t *p = loom_realloc(ctx, g->idx[k], cap * sizeof *p, "experts");
            if (!p) return LOOM_ERR_OOM;
            for (size_t j = g->cap; j < cap; j++) p[j] = SIZE_MAX;
            g->idx[k] = p;
        }
        g->cap = cap;
    }
    if (g->idx[kind][e] != SIZE_MAX)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "saving fused experts: %s comes twice", name);
    g->idx[kind][e] = i;
    g->E = e + 1 > g->E ? e + 1 : g->E;
    return LOOM_OK;
}

/* Every expert of g has its three tensors, of expert 0's shapes. */
static loom_status group_check(loom_ctx *ctx, const loom_tensor_source *src, group *g) {
    char name[320];
    int ndim;
    int64_t shape[2], want[2] = {0, 0};
    for (int64_t e = 0; e < g->E; e++)
        for (int k = 0; k < NKIND; k++) {
            if (g->idx[k][e] == SIZE_MAX)
                return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                                 "saving fused experts: %sexperts.%" PRId64 ".%s.weight is "
                                 "missing (each of the %" PRId64 " experts needs gate, up and "
                                 "down)",
                                 g->prefix, e, kind_leaf[k], g->E);
            src->info(src->u, g->idx[k][e], name, sizeof name, &ndim, shape);
            if (!e && k == GATE) {
                g->I = want[0] = shape[0];
                g->H = want[1] = shape[1];
            }
            const int64_t w0 = k == DOWN ? want[1] : want[0], w1 = k == DOWN ? want[0] : want[1];
            if (ndim != 2 || shape[0] != w0 || shape[1] != w1 || !w0 || !w1)
                return loom_errf(ctx, LOOM_ERR_SHAPE,
                                 "saving fused experts: %s has shape [%" PRId64 ", %" PRId64
                                 "]%s, but expert 0's gate_proj [I, H] = [%" PRId64 ", %" PRId64
                                 "] implies [%" PRId64 ", %" PRId64 "] (none of them 0)",
                                 name, shape[0], ndim == 2 ? shape[1] : 0,
                                 ndim == 2 ? "" : " (1-D)", want[0], want[1], w0, w1);
        }
    return LOOM_OK;
}

/* Appends tensor name (P + leaf) of parts [first, first + nparts) to l. */
static loom_status put_out(loom_ctx *ctx, loom_hf_layout *l, const char *p, size_t plen,
                           const char *leaf, int ndim, const int64_t *shape, size_t first,
                           size_t nparts) {
    loom_hf_out *o = &l->t[l->n];
    loom_sb sb;
    loom_sb_init(&sb);
    loom_sb_append(&sb, p, plen);
    loom_sb_puts(&sb, leaf);
    if (sb.failed) return loom_errf(ctx, LOOM_ERR_OOM, "out of memory for tensor names");
    o->name = loom_sb_take(&sb);
    o->ndim = ndim;
    for (int d = 0; d < 3; d++) o->shape[d] = d < ndim ? shape[d] : 0;
    o->first = first;
    o->n = nparts;
    l->n++;
    return LOOM_OK;
}

loom_status loom_hf_layout_build(loom_ctx *ctx, const loom_tensor_source *src, bool fused,
                                 loom_hf_layout *out) {
    memset(out, 0, sizeof *out);
    const size_t n = src->n;
    out->t = loom_calloc(ctx, n ? n : 1, sizeof *out->t, "tensor layout");
    out->idx = loom_malloc(ctx, (n ? n : 1) * sizeof *out->idx, "tensor layout");
    if (!out->t || !out->idx) {
        loom_hf_layout_free(out);
        return LOOM_ERR_OOM;
    }
    groups gs = {0};
    char name[320];
    int ndim, kind;
    int64_t shape[2], e;
    size_t plen, k = 0;
    bool bias;
    loom_status s = LOOM_OK;
    for (size_t i = 0; i < n && !s && fused; i++) {
        src->info(src->u, i, name, sizeof name, &ndim, shape);
        if (!hub_name(name, &plen, &e, &kind, &bias)) continue;
        group *g = bias ? NULL : group_of(ctx, &gs, name, plen);
        if (bias)
            s = loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                          "saving fused experts: %s: transformers' fused experts (gate_up_proj, "
                          "down_proj) have no per-expert biases; save in the per-expert layout",
                          name);
        else
            s = g ? group_add(ctx, g, e, kind, i, name) : LOOM_ERR_OOM;
    }
    for (size_t j = 0; j < gs.n && !s; j++) s = group_check(ctx, src, &gs.g[j]);
    for (size_t i = 0; i < n && !s; i++) {
        src->info(src->u, i, name, sizeof name, &ndim, shape);
        if (!fused || !hub_name(name, &plen, &e, &kind, &bias)) {
            out->idx[k] = i;
            s = put_out(ctx, out, name, strlen(name), "", ndim, shape, k++, 1);
            continue;
        }
        group *g = group_of(ctx, &gs, name, plen);
        if (g->placed) continue;
        g->placed = true;
        const int64_t gu[3] = {g->E, 2 * g->I, g->H}, dn[3] = {g->E, g->H, g->I};
        s = put_out(ctx, out, g->prefix, plen, GU, 3, gu, k, 2 * (size_t)g->E);
        for (int64_t x = 0; x < g->E; x++) {
            out->idx[k++] = g->idx[GATE][x];
            out->idx[k++] = g->idx[UP][x];
        }
        if (!s) s = put_out(ctx, out, g->prefix, plen, DN, 3, dn, k, (size_t)g->E);
        for (int64_t x = 0; x < g->E; x++) out->idx[k++] = g->idx[DOWN][x];
    }
    groups_free(&gs);
    if (s) loom_hf_layout_free(out);
    return s;
}

void loom_hf_layout_free(loom_hf_layout *l) {
    for (size_t i = 0; i < l->n; i++) free(l->t[i].name);
    free(l->t);
    free(l->idx);
    memset(l, 0, sizeof *l);
}
