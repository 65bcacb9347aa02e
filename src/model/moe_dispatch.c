/* The expert-parallel dispatch of the MoE block (block_moe.c; not local):
 * rows grouped by expert to the ranks holding them and back, once per
 * choice or (dedup_on) once per destination rank, with the count tables
 * they need. DESIGN.md, "folded". */
#include <string.h>

#include "../comm/comm.h"
#include "moe_impl.h"
#include "prof.h"

/* ---- the dispatch (not local): rows grouped by expert to the ranks
 * holding them and back ---- */

/* The count table: each ep rank's choices for this rank's experts, then
 * the etp group's tables (rc). */
loom_status loom_moe_exchange_counts(loom_model *m, const geo *q, const hs *h) {
    int32_t *mine = h->rc + (int64_t)m->mesh->etp_rank * q->P * q->El;
    LOOM_PROF_AROUND(m, "moe.a2a",
                     loom_comm_alltoall(m->mesh->ep, h->cnt, mine, (size_t)q->El, LOOM_I32));
    if (q->Q == 1) return LOOM_OK;
    /* etp rank q's table is block q */
    memcpy(h->tab, mine, (size_t)(q->P * q->El) * sizeof *h->tab);
    LOOM_PROF_AROUND(
        m, "moe.a2a",
        loom_comm_allgather(m->mesh->etp, h->tab, h->rc, (size_t)(q->P * q->El), LOOM_I32));
    return LOOM_OK;
}

/* The next collective on c returns once queued (loom_comm_defer): its
 * results are read by kernels only; loom_k_settle waits for it before the
 * host next waits on the GPU. */
static void defer(loom_model *m, loom_comm *c) {
    loom_comm_defer(c);
    m->comm_deferred = true;
}

/* The alltoallv's of v (n buffers, one group of messages) on c, queued
 * (defer) and timed as the all-to-alls' part of the profile. */
static loom_status a2av(loom_model *m, loom_comm *c, const loom_a2av *v, int n) {
    defer(m, c);
    LOOM_PROF_AROUND(m, "moe.a2a", loom_comm_alltoallv_n(c, v, n));
    return LOOM_OK;
}

static loom_status a2av1(loom_model *m, loom_comm *c, const void *send, const size_t *sc,
                         void *recv, const size_t *rc, loom_dtype dt) {
    const loom_a2av v = {send, sc, recv, rc, dt};
    return a2av(m, c, &v, 1);
}

/* The count table on the device (tables_on_device): each ep rank's counts
 * for this rank's experts into RC (etp rank q's block q, by way of the
 * PSUM scratch's table under etp), queued without a host wait. */
loom_status loom_moe_exchange_counts_dev(const loom_blk *b, const geo *q) {
    loom_model *m = b->m;
    int32_t *rc = b->act[RC], *tmp = (int32_t *)((char *)b->scratch[PSUM] + rc_at(q->E));
    defer(m, m->mesh->ep);
    LOOM_PROF_AROUND(
        m, "moe.a2a",
        loom_comm_alltoall(m->mesh->ep, b->act[CNT], q->Q > 1 ? tmp : rc, (size_t)q->El, LOOM_I32));
    if (q->Q == 1) return LOOM_OK;
    defer(m, m->mesh->etp);
    LOOM_PROF_AROUND(m, "moe.a2a",
                     loom_comm_allgather(m->mesh->etp, tmp, rc, (size_t)(q->P * q->El), LOOM_I32));
    return LOOM_OK;
}



/* The regrouping of the gathered rows, ordered (etp rank, ep rank, expert),
 * into (expert, etp rank, ep rank) and back (cpu_moe.h's
 * loom_cpu_moe_regroup) in the device's IX, from the table in RC (not for
 * the once-per-rank dispatch); ce the rows per expert. Returns the rows. */
loom_status loom_moe_regroup_orders(const loom_blk *b, const geo *q, const hs *h, int64_t *rows) {
    const int64_t QP = q->Q * q->P;
    int64_t Rt = 0;
    for (int64_t e = 0; e < q->El; e++) {
        h->ce[e] = 0;
        for (int64_t s = 0; s < QP; s++) h->ce[e] += h->rc[s * q->El + e];
        Rt += h->ce[e];
    }
    *rows = Rt;
    if (dedup_on(q)) return LOOM_OK; /* the experts' rank groups its rows itself */
    return loom_k_moe_regroup(b->m, b->act[RC], QP, q->El, Rt, b->scratch[IX]);
}

/* The element counts of the ep all-to-all: this rank's rows for each ep
 * rank's experts (sc), and each ep rank's rows for this rank's (rcv, from
 * its own table). */
static void ep_counts(const loom_model *m, const geo *q, const hs *h, size_t *sc, size_t *rcv) {
    const int32_t *t = h->rc + (int64_t)m->mesh->etp_rank * q->P * q->El;
    for (int64_t p = 0; p < q->P; p++) {
        size_t a = 0, c = 0;
        for (int64_t e = 0; e < q->El; e++) a += (size_t)h->cnt[p * q->El + e], c += (size_t)t[p * q->El + e];
        sc[p] = a * (size_t)q->H;
        rcv[p] = c * (size_t)q->H;
    }
}

/* src (R rows, grouped by expert) -> dst (the experts' rows, grouped by
 * local expert); src and tmp are clobbered. */
loom_status loom_moe_dispatch(const loom_blk *b, const geo *q, const hs *h, void *src, void *dst,
                              void *tmp, int64_t Rt) {
    loom_model *m = b->m;
    const loom_dtype dt = m->dev.adt;
    ep_counts(m, q, h, h->sc, h->rcv);
    CK(a2av1(m, m->mesh->ep, src, h->sc, tmp, h->rcv, dt));
    void *gathered = tmp;
    if (q->Q > 1) {
        size_t mine = 0;
        for (int64_t qq = 0; qq < q->Q; qq++) {
            h->sc[qq] = (size_t)table_rows(q, h->rc + qq * q->P * q->El) * (size_t)q->H;
            if (qq == m->mesh->etp_rank) mine = h->sc[qq];
        }
        defer(m, m->mesh->etp);
        LOOM_PROF_AROUND(m, "moe.a2a",
                         loom_comm_allgatherv(m->mesh->etp, tmp, mine, src, h->sc, dt));
        gathered = src;
    }
    return loom_k_moe_permute(m, gathered, b->scratch[IX], Rt, 1, q->H, dst);
}

/* src (the experts' rows, grouped by local expert; partial sums over etp)
 * -> dst (R rows grouped by expert, summed); src and tmp are clobbered. */
loom_status loom_moe_undispatch(const loom_blk *b, const geo *q, const hs *h, void *src, void *dst,
                                void *tmp, int64_t Rt) {
    loom_model *m = b->m;
    const loom_dtype dt = m->dev.adt;
    const size_t esz = m->dev.esz;
    CK(loom_k_moe_permute(m, src, (const int32_t *)b->scratch[IX] + Rt, Rt, 1, q->H, tmp));
    void *mine = tmp;
    if (q->Q > 1) { /* each etp rank's block to it, summed there */
        const int me = m->mesh->etp_rank;
        const size_t n = (size_t)table_rows(q, h->rc + me * q->P * q->El) * (size_t)q->H;
        for (int64_t qq = 0; qq < q->Q; qq++) {
            h->sc[qq] = (size_t)table_rows(q, h->rc + qq * q->P * q->El) * (size_t)q->H;
            h->rcv[qq] = n;
        }
        CK(a2av1(m, m->mesh->etp, tmp, h->sc, src, h->rcv, dt));
        for (int64_t qq = 1; qq < q->Q; qq++)
            CK(loom_k_add(m, src, (const char *)src + (size_t)qq * n * esz, (int64_t)n));
        mine = src;
    }
    ep_counts(m, q, h, h->sc, h->rcv);
    return a2av1(m, m->mesh->ep, mine, h->rcv, dst, h->sc, dt);
}

/* ---- the once-per-rank dispatch (dedup_on; cpu_moe.h's tables) ----
 * A token's row goes once to each ep rank holding some of its experts
 * (rows grouped by rank: ORD2, POS2 masked where it has none), with its
 * choices as that rank's local experts (El: elsewhere) and weights; the
 * experts' rank groups the received rows' choices by expert (RORD, RPOS),
 * sums each row's weighted outputs, and sends one row back, which the
 * token's rank sums over ranks. The backward goes the same way: dy once a
 * rank; the routing weights' gradients and the summed input gradients
 * back. The counts travel on the device with the table (moe_fwd). */

/* The rows sent to and received from each ep rank (the host table's tail). */
static const int32_t *dd_nu(const geo *q, const hs *h) { return h->rc + rc_len(q); }
static const int32_t *dd_nur(const geo *q, const hs *h) { return h->rc + rc_len(q) + q->P; }

static void dd_counts(const geo *q, const int32_t *a, const int32_t *b, int64_t w, size_t *sc,
                      size_t *rcv, int64_t *na, int64_t *nb) {
    *na = *nb = 0;
    for (int64_t p = 0; p < q->P; p++) {
        sc[p] = (size_t)(a[p] * w), rcv[p] = (size_t)(b[p] * w);
        *na += a[p], *nb += b[p];
    }
}

/* Before the forward's download: each token's ranks, grouped, and with the
 * count table (each ep rank's choices for this rank's experts, into RC) the
 * count of rows each rank sends here (the download's tail): one exchange
 * of both, queued. */
loom_status loom_moe_dd_plan(const loom_blk *b, const geo *q, const hs *h) {
    loom_model *m = b->m;
    void *const *a = b->act;
    const int P = (int)q->P;
    CK(loom_k_moe_dest(m, a[IDX], q->n, q->k, q->El, P, a[DEST]));
    CK(loom_k_moe_route(m, a[DEST], NULL, q->n, P + 1, P, -1, false, a[CNT2], a[ORD2], a[POS2]));
    CK(loom_k_moe_mask(m, a[DEST], q->n, P, P, a[ORD2], a[POS2]));
    int32_t *tail = (int32_t *)((char *)b->scratch[PSUM] + rc_at(q->E)) + rc_len(q);
    CK(loom_k_copy(m, tail, a[CNT2], (size_t)P * sizeof(int32_t)));
    for (int p = 0; p < P; p++) h->sc[p] = (size_t)q->El, h->sc[P + p] = 1;
    const loom_a2av v[2] = {{a[CNT], h->sc, a[RC], h->sc, LOOM_I32},
                            {a[CNT2], h->sc + P, tail + P, h->sc + P, LOOM_I32}};
    CK(a2av(m, m->mesh->ep, v, 2));
    return LOOM_OK;
}

/* rows (n of them, this rank's tokens) once to each rank their choices
 * need -> recv (the rows from each rank in turn); cs: send scratch */
static loom_status dd_send_rows(const loom_blk *b, const geo *q, const hs *h, const void *rows,
                                void *cs, void *recv) {
    loom_model *m = b->m;
    int64_t ns, nr;
    dd_counts(q, dd_nu(q, h), dd_nur(q, h), q->H, h->sc, h->rcv, &ns, &nr);
    CK(loom_k_rows_gather(m, cs, rows, b->act[TOK], ns, q->H));
    return a2av1(m, m->mesh->ep, cs, h->sc, recv, h->rcv, m->dev.adt);
}

/* recv's rows (one a received row, from each rank in turn) back to their
 * tokens' rank, summed there over ranks into out (this rank's n rows);
 * cs: scratch */
static loom_status dd_return_rows(const loom_blk *b, const geo *q, const hs *h, const void *rows,
                                  void *cs, void *out) {
    loom_model *m = b->m;
    int64_t ns, nr;
    dd_counts(q, dd_nur(q, h), dd_nu(q, h), q->H, h->sc, h->rcv, &nr, &ns);
    CK(a2av1(m, m->mesh->ep, rows, h->sc, cs, h->rcv, m->dev.adt));
    return loom_k_moe_permute_bwd(m, cs, b->act[POS2], q->n, (int)q->P, q->H, out);
}

/* The forward's rows: x (this rank's n token rows) -> the experts' rows
 * xe, grouped by local expert; the received rows' tables kept. cs, cr:
 * row scratch; meta: scratch for the sent rows' k ints and k floats. */
loom_status loom_moe_dd_dispatch(const loom_blk *b, const geo *q, const hs *h, const void *x,
                                 void *cs, void *cr, void *meta, void *xe) {
    loom_model *m = b->m;
    void *const *a = b->act;
    const int P = (int)q->P;
    int64_t ns, nr;
    /* the rows' choices (k a row: local experts, weights) and the rows, in
     * one exchange */
    dd_counts(q, dd_nu(q, h), dd_nur(q, h), q->k, h->sc, h->rcv, &ns, &nr);
    dd_counts(q, dd_nu(q, h), dd_nur(q, h), q->H, h->sc + P, h->rcv + P, &ns, &nr);
    int32_t *mid = meta;
    float *mw = (float *)(mid + ns * q->k);
    CK(loom_k_moe_dedup_meta(m, a[ORD2], ns, a[IDX], a[WT], q->k, q->El, P, a[TOK], mid, mw));
    CK(loom_k_rows_gather(m, cs, x, a[TOK], ns, q->H));
    const loom_a2av v[3] = {{mid, h->sc, a[RMID], h->rcv, LOOM_I32},
                            {mw, h->sc, a[RMW], h->rcv, LOOM_F32},
                            {cs, h->sc + P, cr, h->rcv + P, m->dev.adt}};
    CK(a2av(m, m->mesh->ep, v, 3));
    CK(loom_k_moe_route(m, a[RMID], NULL, nr, q->El + 1, q->k, -1, false, a[RCNT], a[RORD],
                        a[RPOS]));
    CK(loom_k_moe_mask(m, a[RMID], nr, q->k, (int32_t)q->El, a[RORD], a[RPOS]));
    return loom_k_moe_permute(m, cr, a[RORD], nr, q->k, q->H, xe);
}

/* The forward's outputs: ys (the experts' rows) weighted and summed a
 * received row, back, and summed over ranks into out (n rows). */
loom_status loom_moe_dd_combine(const loom_blk *b, const geo *q, const hs *h, const void *ys,
                                void *cs, void *cr, void *out) {
    int64_t ns, nr;
    dd_counts(q, dd_nu(q, h), dd_nur(q, h), 1, h->sc, h->rcv, &ns, &nr);
    CK(loom_k_moe_combine(b->m, ys, b->act[RPOS], b->act[RMW], nr, q->k, q->H, cr));
    return dd_return_rows(b, q, h, cr, cs, out);
}

/* The backward's: dy (n rows) once a rank -> dye (the experts' rows, times
 * their weights), and the routing weights' gradients at the experts' rank
 * (the DX scratch's first Rmax; loom_moe_dd_return_dx sends them back). */
loom_status loom_moe_dd_dispatch_bwd(const loom_blk *b, const geo *q, const hs *h, const void *dy,
                                     void *cs, void *cr, void *dye) {
    int64_t ns, nr;
    CK(dd_send_rows(b, q, h, dy, cs, cr));
    dd_counts(q, dd_nur(q, h), dd_nu(q, h), 1, h->sc, h->rcv, &nr, &ns);
    return loom_k_moe_combine_bwd(b->m, cr, b->act[YS], b->act[RORD], b->act[RMW], nr, q->k, q->H,
                                  dye, b->scratch[DX]);
}

/* Back to the tokens' rank in one exchange: the input gradients dxe (the
 * experts' rows; NULL when not wanted) summed a received row, then summed
 * over ranks into dx (n rows), and the routing weights' gradients, summed
 * over ranks into dw (n k). */
loom_status loom_moe_dd_return_dx(const loom_blk *b, const geo *q, const hs *h, const void *dxe,
                                  void *cs, void *cr, void *dx, float *dw) {
    loom_model *m = b->m;
    const int P = (int)q->P;
    int64_t ns, nr;
    dd_counts(q, dd_nur(q, h), dd_nu(q, h), q->k, h->sc, h->rcv, &nr, &ns);
    dd_counts(q, dd_nur(q, h), dd_nu(q, h), q->H, h->sc + P, h->rcv + P, &nr, &ns);
    float *dw_here = b->scratch[DX], *dw_back = dw_here + q->Rmax;
    loom_a2av v[2] = {{dw_here, h->sc, dw_back, h->rcv, LOOM_F32},
                      {cr, h->sc + P, cs, h->rcv + P, m->dev.adt}};
    if (dxe) CK(loom_k_moe_permute_bwd(m, dxe, b->act[RPOS], nr, q->k, q->H, cr));
    CK(a2av(m, m->mesh->ep, v, dxe ? 2 : 1));
    if (dxe) CK(loom_k_moe_permute_bwd(m, cs, b->act[POS2], q->n, P, q->H, dx));
    return loom_k_moe_dedup_dw(m, dw_back, b->act[POS2], q->n, P, q->k, dw);
}
