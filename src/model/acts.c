/* Activation buffers: every buffer of the micro-batches in flight, carved
 * from one allocation (act_mem) by a layout that runs twice, first to
 * measure (base NULL), then to assign; the memory predictor (meta.c)
 * measures with the same code, so it predicts what is allocated.
 *
 * A layer's buffers come in pieces, each carved for all the layers of a
 * chunk at once (layer i's part at i times the size when the layers are
 * alike): the walker's (each block's normed input and its rstd, the
 * residual stream between blocks), the block kinds' buffers kept under
 * selective recomputation, those kept under full recomputation too (a
 * router's choices), LoRA's stash, then the kinds' buffers it drops.
 * What recomputation does not keep is carved once, for the largest layer,
 * and every layer's table points there (block.h's loom_layer_acts). */
#include <string.h>

#include "block.h"
#include "model.h"

static void *cv(loom_carve *c, size_t bytes) {
    if (!bytes) return NULL;
    size_t off = (c->used + 255) & ~(size_t)255;
    c->used = off + bytes;
    return c->base ? c->base + off : NULL;
}

#define NB LOOM_LAYER_MAX_BLOCKS
#define NBUF LOOM_BLOCK_MAX_BUFS

/* The pieces in carve order: class, block, the kind's buffer. */
enum { P_H, P_RSTD, P_RES, P_KEPT, P_ROUTE, P_LORA, P_CHEAP };
enum { NPIECES = 3 * NB + 3 * NB * NBUF + 1 };
typedef struct piece {
    int cls, j, k;
} piece;

static piece piece_no(int n) {
    if (n < 3 * NB) return (piece){n / NB, n % NB, 0};
    n -= 3 * NB;
    if (n < NB * NBUF) return (piece){P_KEPT, n / NBUF, n % NBUF};
    n -= NB * NBUF;
    if (n < NB * NBUF) return (piece){P_ROUTE, n / NBUF, n % NBUF};
    n -= NB * NBUF;
    if (n == 0) return (piece){P_LORA, 0, 0};
    n--;
    return (piece){P_CHEAP, n / NBUF, n % NBUF};
}

static void piece_set(loom_layer_acts *t, piece p, void *at) {
    switch (p.cls) {
    case P_H: t->h[p.j] = at; break;
    case P_RSTD: t->rstd[p.j] = at; break;
    case P_RES: t->r[p.j] = at; break;
    case P_LORA: t->lora_u = at; break;
    default: t->act[p.j][p.k] = at; break;
    }
}

/* Not kept per micro-batch: recomputed before the layer's backward. */
static bool dropped(const loom_model *m, piece p) {
    if (m->recompute == LOOM_RECOMPUTE_FULL) return p.cls != P_ROUTE;
    return m->recompute == LOOM_RECOMPUTE_MLP && p.cls == P_CHEAP;
}

/* The shape being laid out, and every kind's buffers per layer for it. */
typedef struct shape {
    const loom_model *m;
    int64_t Tc, Tn;
    int lr;
    loom_block_buf buf[LOOM_NKINDS][NBUF];
} shape;

static void shape_init(shape *s, const loom_model *m, int64_t T, int64_t Tc, int64_t Tn, int lr) {
    memset(s, 0, sizeof *s);
    s->m = m;
    s->Tc = Tc;
    s->Tn = Tn;
    s->lr = lr;
    for (int id = 0; id < LOOM_NKINDS; id++)
        if (loom_block_kinds[id]->acts) loom_block_kinds[id]->acts(m, T, Tc, Tn, s->buf[id]);
}

/* Bytes of piece p of global layer l. */
static size_t piece_bytes(const shape *s, int64_t l, piece p) {
    const loom_model *m = s->m;
    const loom_layer *L = &m->layer[l];
    const int nb = L->nb;
    const size_t e = m->dev.esz;
    switch (p.cls) {
    case P_H: return p.j < nb ? (size_t)(s->Tc * m->H) * e : 0;
    case P_RSTD: return p.j < nb ? (size_t)s->Tn * sizeof(float) : 0;
    case P_RES: return p.j + 1 < nb ? (size_t)(s->Tn * m->H) * e : 0;
    case P_LORA: return s->lr ? (size_t)(L->nlin * s->Tc * s->lr) * e : 0;
    default: {
        if (p.j >= nb) return 0;
        const loom_block_buf *b = &s->buf[L->b[p.j].kind->id][p.k];
        const int cls = b->route ? P_ROUTE : b->cheap ? P_CHEAP : P_KEPT;
        return cls == p.cls ? b->bytes : 0;
    }
    }
}

/* Piece p of a chunk's nl layers from l0, one after the other; lay (NULL
 * when only measuring, else zeroed) gets each layer's place. A kind's buffer
 * is one piece when kept and another when dropped: only the one with bytes
 * sets it. */
static void carve_piece(loom_carve *c, const shape *s, int64_t l0, int64_t nl, piece p,
                        loom_layer_acts *lay) {
    size_t total = 0;
    for (int64_t i = 0; i < nl; i++) total += piece_bytes(s, l0 + i, p);
    char *at = cv(c, total);
    for (int64_t i = 0; lay && i < nl; i++) {
        const size_t n = piece_bytes(s, l0 + i, p);
        if (at && n) piece_set(&lay[i], p, at);
        if (at) at += n;
    }
}

/* Piece p recomputed: one region for the largest layer, shared by all. */
static void carve_shared(loom_model *m, loom_carve *c, const shape *s, int npool, piece p) {
    size_t most = 0;
    for (int ci = 0; ci < m->vpp; ci++)
        for (int64_t i = 0; i < m->chunks[ci].nl; i++) {
            const size_t n = piece_bytes(s, m->chunks[ci].l0 + i, p);
            if (n > most) most = n;
        }
    void *at = cv(c, most);
    for (int ci = 0; ci < m->vpp; ci++) {
        const loom_chunk *ch = &m->chunks[ci];
        for (int a = 0; a < npool; a++)
            for (int64_t i = 0; at && ch->pool[a].lay && i < ch->nl; i++)
                if (piece_bytes(s, ch->l0 + i, p)) piece_set(&ch->pool[a].lay[i], p, at);
    }
}

/* The scratch buffers of the kinds this rank's layers use (registry order). */
static void carve_scratch(loom_model *m, loom_carve *c, int64_t T, int64_t Tc) {
    bool used[LOOM_NKINDS] = {false};
    for (int64_t l = 0; l < m->L; l++)
        for (int j = 0; m->layer[l].held && j < m->layer[l].nb; j++)
            used[m->layer[l].b[j].kind->id] = true;
    memset(m->scratch, 0, sizeof m->scratch);
    for (int id = 0; id < LOOM_NKINDS; id++) {
        if (!used[id] || !loom_block_kinds[id]->scratch) continue;
        size_t bytes[LOOM_BLOCK_MAX_SCRATCH] = {0};
        const int n = loom_block_kinds[id]->scratch(m, T, Tc, bytes);
        for (int k = 0; k < n; k++) m->scratch[id][k] = cv(c, bytes[k]);
    }
}

/* One chunk's buffers for one micro-batch in flight. */
static void carve_acts(loom_model *m, loom_carve *c, const shape *s, const loom_chunk *ch,
                       loom_acts *a) {
    const int64_t H = m->H, Tn = s->Tn;
    const size_t e = m->dev.esz;
    loom_layer_acts *lay = a->lay;
    const int mb = a->mb;
    memset(a, 0, sizeof *a);
    a->mb = mb;
    a->lay = lay;
    if (lay) memset(lay, 0, (size_t)ch->nl * sizeof *lay);
    a->x = cv(c, (size_t)((ch->nl + 1) * Tn * H) * e);
    for (int n = 0; n < NPIECES; n++)
        if (!dropped(m, piece_no(n))) carve_piece(c, s, ch->l0, ch->nl, piece_no(n), lay);
    if (ch->last) {
        a->hf = cv(c, (size_t)(Tn * H) * e);
        a->rstdf = cv(c, (size_t)Tn * sizeof(float));
        a->dstash = cv(c, (size_t)(Tn * H) * e);
    }
}

/* LoRA's scratch: a group's du (Tc, n r) for the largest group, and the
 * dropped-out input (Tc, in) for the widest local input of a linear. */
static void carve_lora(loom_model *m, loom_carve *c, int64_t Tc, int lr, bool dropout) {
    int64_t gmax = 0, inmax = 0;
    for (int64_t l = 0; l < m->L; l++)
        for (int j = 0; m->layer[l].held && j < m->layer[l].nlin; j++) {
            const loom_layer_lin *x = &m->layer[l].lin[j];
            const int64_t in = x->row_par ? x->in / m->tp : x->in;
            if (x->gn > gmax) gmax = x->gn;
            if (in > inmax) inmax = in;
        }
    m->lora_du = lr ? cv(c, (size_t)(Tc * gmax * lr) * m->dev.esz) : NULL;
    m->lora_xd = dropout ? cv(c, (size_t)(Tc * inmax) * m->dev.esz) : NULL;
}

void loom_acts_layout(loom_model *m, loom_carve *c, int64_t T, int64_t Tc, int64_t Tn, int n_micro,
                      int in_flight, int lr, bool dropout) {
    const int64_t H = m->H;
    const size_t e = m->dev.esz;
    shape s;
    shape_init(&s, m, T, Tc, Tn, lr);
    for (int ci = 0; ci < m->vpp; ci++)
        for (int i = 0; i < in_flight; i++) carve_acts(m, c, &s, &m->chunks[ci], &m->chunks[ci].pool[i]);
    for (int n = 0; n < NPIECES; n++)
        if (dropped(m, piece_no(n))) carve_shared(m, c, &s, in_flight, piece_no(n));
    m->dx = cv(c, (size_t)(Tc * H) * e);
    m->dtmp = cv(c, (size_t)(Tc * H) * e);
    m->dfull = cv(c, (size_t)(Tc * H) * e);
    carve_scratch(m, c, T, Tc);
    m->logits = cv(c, (size_t)(m->chunk_rows * m->Vl) * e);
    carve_lora(m, c, Tc, lr, dropout);
    m->ce = cv(c, (size_t)Tc * 4 * sizeof(double));
    m->d_perm = cv(c, (size_t)T * sizeof(int32_t));
    for (int i = 0; i < n_micro; i++) {
        loom_micro *u = &m->micro[i];
        u->d_ids = cv(c, (size_t)Tc * sizeof(int32_t));
        u->d_tgt = cv(c, (size_t)Tc * sizeof(int32_t));
        u->d_pos = cv(c, (size_t)Tc * sizeof(int32_t));
        u->d_cu = cv(c, (size_t)(T + 1) * sizeof(int32_t));
        u->d_rope = m->dev.cuda ? cv(c, (size_t)(Tc * m->D) * sizeof(float)) : NULL;
        u->d_aux = m->dev.cuda && m->cfg.num_experts > 0
                       ? cv(c, loom_moe_aux_len(m) * sizeof(double))
                       : u->aux;
        u->d_aux_g = m->dev.cuda && m->cfg.num_experts > 0
                         ? cv(c, loom_moe_grad_len(m) * sizeof(float))
                         : u->aux_g;
    }
    /* a pipeline message: the activations, then the layers' auxiliary sums
     * (loom_pp_aux_at) */
    for (int i = 0; i < m->npp_stage; i++)
        m->pp_stage[i] = cv(c, loom_pp_aux_off(m, Tn) + loom_pp_aux_bytes(m));
}
