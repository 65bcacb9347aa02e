/* The mixture-of-experts block's internals shared by block_moe.c (the
 * block: routing, experts, shared expert, the load-balancing loss) and
 * moe_dispatch.c (the expert-parallel dispatch): its buffers, its
 * geometry, its host tables. Only those two files include this. */
#ifndef LOOM_MODEL_MOE_IMPL_H
#define LOOM_MODEL_MOE_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "block.h"
#include "model.h"

/* activation buffers per layer: the routing (kept: probabilities, choices,
 * weights, counts per expert, the order and its inverse, the dispatch's
 * count table), the experts' (dropped under selective recomputation; LoRA's
 * x A^T of the three projections among them), the experts' outputs in the
 * grouped order (kept), and the router rows' logsumexp (kept; the z-loss's);
 * the shared expert's g, u, act (dropped) and its gate's sigmoid (kept,
 * fp32) */
enum {
    PROBS, IDX, WT, CNT, ORD, POS, RC, XE, G, U, ACT, LST, YS, LSE, SHG, SHU, SHACT, SHSIG,
    /* the once-per-rank dispatch's tables (dedup_on): each token's ranks,
     * their grouping (the rows sent), the rows' tokens; the received rows'
     * local experts and weights, and their grouping by expert */
    DEST, CNT2, ORD2, POS2, TOK, RMID, RMW, RCNT, RORD, RPOS, NBUF
};
_Static_assert((int)NBUF <= (int)LOOM_BLOCK_MAX_BUFS,
               "block.h: LOOM_BLOCK_MAX_BUFS is too small for MoE");
/* scratch: logits and their gradient, probability sums, the choices'
 * weight gradients, three row buffers of the dispatch, the experts'
 * gradients, the regrouping's row orders, LoRA's du; the shared expert's
 * gate logits (and their gradient), its output (and the gated output's
 * gradient), its dg and du */
enum { Z, PSUM, DW, S1, S2, S3, DG, DU, IX, DLU, SZ, SY, SDG, SDU, DX, NSCRATCH };

/* The block's geometry on this rank. Without expert parallelism and with
 * etp = tp every tp rank routes all Tc tokens and its experts' share of the
 * intermediate gives a partial sum, like the dense MLP (local). Otherwise
 * (Megatron's folding) each tp rank routes its own n = Tc/tp tokens (its
 * sequence-parallel slice of the gathered input), sends them over ep to the
 * ranks holding their experts, gathers the etp group's tokens for its
 * experts' shard, and the outputs come back the same way; its output is its
 * slice's rows, zeros elsewhere, which the walker's tp reduce sums. */
typedef struct geo {
    int64_t n, o0;      /* the tokens it routes: rows [o0, o0 + n) of h */
    int64_t E, El, e0;  /* experts; this rank's El from e0 */
    int64_t P, Q;       /* ep, etp */
    int64_t Ie, H, R;   /* an expert's width here; hidden; the n k choices */
    int64_t cap;        /* choices an expert keeps of this rank's n tokens (-1: dropless) */
    int64_t Rk;         /* rows this rank's tokens send: R, with a capacity min(R, E cap) */
    int64_t Rmax;       /* rows the experts can get: Q P R (dropless), Q P min(R, El cap) */
    int k;
    bool local;
    bool dedup; /* the model's moe_dedup */
} geo;

/* The ep all-to-alls of token rows send each row once per destination rank
 * (moe_dedup.h) where the rows go over ep alone (etp 1). */
static inline bool dedup_on(const geo *q) {
    return !q->local && q->Q == 1 && q->cap < 0 && q->dedup;
}
/* Whether the count table is exchanged on the device (no host round trip
 * before the download that brings the counts): dropless, once per choice.
 * A capacity trims the counts on the host first. */
static inline bool tables_on_device(const geo *q) { return !q->local && q->cap < 0; }

/* The dispatch's count table (Q, P, El), and with it on the host (and in
 * moe_tabs) once per rank the rows sent to and received from each ep rank */
static inline int64_t rc_len(const geo *q) { return q->local ? 0 : q->Q * q->P * q->El; }
static inline int64_t table_len(const geo *q) { return rc_len(q) + (dedup_on(q) ? 2 * q->P : 0); }

/* The PSUM scratch holds a copy of the counts, then (here) the router's
 * probability sums: laid out as the host's cnt and psum (hs_carve), so one
 * download fills both. */
static inline size_t psum_at(int64_t E) { return ((size_t)E * sizeof(int32_t) + 15) & ~(size_t)15; }
/* ... and after them the dispatch's count table (tables_on_device) */
static inline size_t rc_at(int64_t E) {
    return (psum_at(E) + (size_t)E * sizeof(float) + 15) & ~(size_t)15;
}

/* The host scratch (one set for all layers; carved by hs_carve). */
typedef struct hs {
    int32_t *cnt;      /* (E) choices per expert of this rank's tokens */
    float *psum;       /* (E) */
    int32_t *rc;       /* (Q, P, El): rows expert e of this rank gets from ep rank p, for
                        * each etp rank q (the dispatch's table); once per rank, then the
                        * rows sent to each ep rank (nu, P) and received from each (nur) */
    int32_t *ce;       /* (El) rows each local expert gets (its GEMMs' sizes) */
    int32_t *ix;       /* (2 Rmax) the regrouping's row orders */
    int32_t *tab;      /* (P, El) this rank's table, sent to the etp group */
    size_t *sc, *rcv;  /* (2 max(P, Q)) element counts of an alltoallv (of two) */
    float *lse;        /* (n) the router rows' logsumexp (the z-loss) */
} hs;

static inline int64_t table_rows(const geo *q, const int32_t *t) {
    int64_t r = 0;
    for (int64_t i = 0; i < q->P * q->El; i++) r += t[i];
    return r;
}

/* Each expert's choices of this rank's tokens (route's counts, every
 * choice: the load-balancing loss's) -> the kept ones, min(count, cap). */
static inline void keep_counts(const geo *q, int32_t *cnt) {
    for (int64_t e = 0; q->cap >= 0 && e < q->E; e++)
        if (cnt[e] > q->cap) cnt[e] = (int32_t)q->cap;
}

/* ---- the dispatch (moe_dispatch.c; not local) ---- */
loom_status loom_moe_exchange_counts(loom_model *m, const geo *q, const hs *h);
loom_status loom_moe_exchange_counts_dev(const loom_blk *b, const geo *q);
loom_status loom_moe_regroup_orders(const loom_blk *b, const geo *q, const hs *h, int64_t *rows);
loom_status loom_moe_dispatch(const loom_blk *b, const geo *q, const hs *h, void *src, void *dst,
                              void *tmp, int64_t Rt);
loom_status loom_moe_undispatch(const loom_blk *b, const geo *q, const hs *h, void *src, void *dst,
                                void *tmp, int64_t Rt);
loom_status loom_moe_dd_plan(const loom_blk *b, const geo *q, const hs *h);
loom_status loom_moe_dd_dispatch(const loom_blk *b, const geo *q, const hs *h, const void *x,
                                 void *cs, void *cr, void *meta, void *xe);
loom_status loom_moe_dd_combine(const loom_blk *b, const geo *q, const hs *h, const void *ys,
                                void *cs, void *cr, void *out);
loom_status loom_moe_dd_dispatch_bwd(const loom_blk *b, const geo *q, const hs *h, const void *dy,
                                     void *cs, void *cr, void *dye);
loom_status loom_moe_dd_return_dx(const loom_blk *b, const geo *q, const hs *h, const void *dxe,
                                  void *cs, void *cr, void *dx, float *dw);

#endif
