/* The data loader: shuffled sample order, greedy padding-free packing into
 * global batches, data-parallel slices, exact resume. The rules are in
 * loader.h. */
#include "loader.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "../core/rng.h"

static const char *const trunc_names[] = {"error", "left", "right", "drop"};

loom_status loom_truncation_parse(loom_ctx *ctx, const char *name, loom_truncation *out) {
    for (int i = 0; i < 4; i++)
        if (name && !strcmp(name, trunc_names[i])) {
            *out = (loom_truncation)i;
            return LOOM_OK;
        }
    return loom_errf(ctx, LOOM_ERR_CONFIG,
                     "truncation '%s' is not one of error, left, right, drop", name ? name : "");
}

const char *loom_truncation_name(loom_truncation t) {
    return (unsigned)t < 4 ? trunc_names[t] : "?";
}

void loom_data_shuffle(uint64_t seed, int64_t epoch, int64_t n, int64_t *order) {
    for (int64_t i = 0; i < n; i++) order[i] = i;
    uint64_t key = LOOM_DATA_SHUFFLE_KEY + (uint64_t)epoch;
    for (int64_t i = n - 1; i > 0; i--) {
        double u = loom_rng_uniform(seed, key, (uint64_t)i);
        int64_t j = (int64_t)(u * (double)(i + 1));
        if (j > i) j = i; /* u < 1, but the product may round up for huge i */
        int64_t t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

struct loom_loader {
    const uint32_t *ids;   /* the token file's */
    const uint8_t *mask;   /* the token file's, or NULL */
    loom_loader_config cfg;
    int64_t rows, rows_per_rank, n;
    uint64_t *start;       /* (n) first token of sample i in ids (after truncation) */
    int32_t *len;          /* (n) its length, 1 .. seq_len */
    int64_t *doc;          /* (n) its document index in the token file */
    int64_t *order;        /* (n) order of epoch order_epoch; -1: not computed */
    int64_t order_epoch;
    loom_loader_pos pos;
    loom_loader_info info;
    int32_t *input_ids, *targets, *position_ids; /* (rows*seq_len) */
    int32_t *cu_seqlens;   /* (rows*seq_len + 1) */
    int64_t *segment_doc;  /* (rows*seq_len) */
    int32_t *slice_cu;     /* (rows*seq_len + 1): a slice's rebased cu_seqlens */
    loom_loader_batch last;
    bool have_last;
};

void loom_loader_free(loom_loader *l) {
    if (!l) return;
    free(l->start);
    free(l->len);
    free(l->doc);
    free(l->order);
    free(l->input_ids);
    free(l->targets);
    free(l->position_ids);
    free(l->cu_seqlens);
    free(l->segment_doc);
    free(l->slice_cu);
    free(l);
}

loom_status loom_loader_create(loom_ctx *ctx, const loom_tokfile *tf, const loom_loader_config *cfg,
                               loom_loader **out) {
    *out = NULL;
    if (!tf || !cfg) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loader: no token file or config");
    const loom_loader_config c = *cfg;
    if (c.seq_len < 2)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loader: seq_len = %" PRId64 " is too short; rows need at least 2 tokens "
                         "(one input and the token it predicts)",
                         c.seq_len);
    if (c.micro_batch_size < 1 || c.num_micro_batches < 1 || c.dp < 1)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loader: micro_batch_size = %" PRId64 ", num_micro_batches = %" PRId64
                         ", dp = %" PRId64 "; each must be at least 1",
                         c.micro_batch_size, c.num_micro_batches, c.dp);
    if ((unsigned)c.truncation > LOOM_TRUNC_DROP)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loader: unknown truncation policy %d",
                         (int)c.truncation);
    int64_t rpr, rows, tokens;
    if (__builtin_mul_overflow(c.micro_batch_size, c.num_micro_batches, &rpr) ||
        __builtin_mul_overflow(rpr, c.dp, &rows) ||
        __builtin_mul_overflow(rows, c.seq_len, &tokens) || tokens > INT32_MAX)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loader: a global batch of %" PRId64 " x %" PRId64 " x %" PRId64
                         " rows of %" PRId64 " tokens is more than the %d tokens int32 "
                         "cu_seqlens can address; use smaller batches",
                         c.micro_batch_size, c.num_micro_batches, c.dp, c.seq_len, INT32_MAX);
    if (loom_tokfile_max_id(tf) > INT32_MAX)
        return loom_errf(ctx, LOOM_ERR_UNSUPPORTED,
                         "loader: token id %" PRIu32 " does not fit the int32 input_ids",
                         loom_tokfile_max_id(tf));
    int64_t nd = loom_tokfile_n_docs(tf);
    const uint64_t *off = loom_tokfile_doc_offsets(tf);
    loom_loader *l = loom_calloc(ctx, 1, sizeof *l, "data loader");
    if (!l) return LOOM_ERR_OOM;
    l->ids = loom_tokfile_ids(tf);
    l->mask = loom_tokfile_mask(tf);
    l->cfg = c;
    l->rows = rows;
    l->rows_per_rank = rpr;
    l->order_epoch = -1;
    size_t nt = (size_t)tokens;
    l->start = loom_malloc(ctx, (size_t)nd * sizeof *l->start, "loader samples");
    l->len = loom_malloc(ctx, (size_t)nd * sizeof *l->len, "loader samples");
    l->doc = loom_malloc(ctx, (size_t)nd * sizeof *l->doc, "loader samples");
    l->order = loom_malloc(ctx, (size_t)nd * sizeof *l->order, "loader order");
    l->input_ids = loom_malloc(ctx, nt * sizeof(int32_t), "loader input_ids");
    l->targets = loom_malloc(ctx, nt * sizeof(int32_t), "loader targets");
    l->position_ids = loom_malloc(ctx, nt * sizeof(int32_t), "loader position_ids");
    l->cu_seqlens = loom_malloc(ctx, (nt + 1) * sizeof(int32_t), "loader cu_seqlens");
    l->segment_doc = loom_malloc(ctx, nt * sizeof(int64_t), "loader segments");
    l->slice_cu = loom_malloc(ctx, (nt + 1) * sizeof(int32_t), "loader cu_seqlens");
    if (!l->start || !l->len || !l->doc || !l->order || !l->input_ids || !l->targets ||
        !l->position_ids || !l->cu_seqlens || !l->segment_doc || !l->slice_cu) {
        loom_loader_free(l);
        return LOOM_ERR_OOM;
    }
    int64_t n = 0;
    for (int64_t d = 0; d < nd; d++) {
        uint64_t s = off[d], len = off[d + 1] - off[d];
        if (len > (uint64_t)c.seq_len) {
            if (c.truncation == LOOM_TRUNC_ERROR) {
                loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                          "document %" PRId64 " has %" PRIu64 " tokens, more than seq_len = %" PRId64
                          "; give a larger seq_len or a truncation policy (left, right, drop)",
                          d, len, c.seq_len);
                loom_loader_free(l);
                return LOOM_ERR_INVALID_ARG;
            }
            if (c.truncation == LOOM_TRUNC_DROP) {
                l->info.n_dropped++;
                continue;
            }
            if (c.truncation == LOOM_TRUNC_LEFT) s += len - (uint64_t)c.seq_len;
            len = (uint64_t)c.seq_len;
            l->info.n_truncated++;
        }
        l->start[n] = s;
        l->len[n] = (int32_t)len;
        l->doc[n] = d;
        l->info.n_tokens += (int64_t)len;
        n++;
    }
    if (n == 0) {
        loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                  "no sample is left: all %" PRId64 " documents are longer than seq_len = %" PRId64
                  " and were dropped",
                  nd, c.seq_len);
        loom_loader_free(l);
        return LOOM_ERR_INVALID_ARG;
    }
    l->n = n;
    l->info.n_samples = n;
    l->info.rows = rows;
    *out = l;
    return LOOM_OK;
}

void loom_loader_get_info(const loom_loader *l, loom_loader_info *info) { *info = l->info; }

/* The order of the epoch the position is in. */
static const int64_t *order_of(loom_loader *l, int64_t epoch) {
    if (l->order_epoch != epoch) {
        if (l->cfg.no_shuffle)
            for (int64_t i = 0; i < l->n; i++) l->order[i] = i;
        else
            loom_data_shuffle(l->cfg.seed, epoch, l->n, l->order);
        l->order_epoch = epoch;
    }
    return l->order;
}

loom_status loom_loader_next(loom_ctx *ctx, loom_loader *l, loom_loader_batch *out) {
    if (!l || !out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loader: no loader or batch given");
    const int64_t S = l->cfg.seq_len;
    int32_t *in = l->input_ids, *tg = l->targets, *ps = l->position_ids, *cu = l->cu_seqlens;
    int64_t *sd = l->segment_doc;
    loom_loader_pos pos = l->pos;
    const int64_t *order = order_of(l, pos.epoch);
    int64_t nseg = 0, nsamp = 0, ntok = 0, ntg = 0;
    memset(out, 0, sizeof *out); /* b.local 0: the global batch */
    out->start = pos;
    cu[0] = 0;
    for (int64_t r = 0; r < l->rows; r++) {
        int64_t base = r * S, used = 0;
        for (;;) { /* whole samples while they fit */
            int64_t i = order[pos.index], len = l->len[i];
            if (len > S - used) break;
            const uint32_t *ids = l->ids + l->start[i];
            const uint8_t *mask = l->mask ? l->mask + l->start[i] : NULL;
            int64_t t0 = base + used;
            for (int64_t j = 0; j < len; j++) {
                in[t0 + j] = (int32_t)ids[j];
                ps[t0 + j] = (int32_t)j;
                int32_t t = LOOM_IGNORE_INDEX;
                if (j + 1 < len && (!mask || mask[j + 1])) t = (int32_t)ids[j + 1];
                tg[t0 + j] = t;
                ntg += t != LOOM_IGNORE_INDEX;
            }
            used += len;
            ntok += len;
            sd[nseg] = l->doc[i];
            cu[++nseg] = (int32_t)(base + used);
            nsamp++;
            if (++pos.index == l->n) {
                pos.index = 0;
                pos.epoch++;
                order = order_of(l, pos.epoch);
            }
            if (used == S) break;
        }
        if (used < S) { /* the room left: padding, a segment of its own */
            for (int64_t j = 0; used + j < S; j++) {
                in[base + used + j] = 0;
                tg[base + used + j] = LOOM_IGNORE_INDEX;
                ps[base + used + j] = (int32_t)j;
            }
            sd[nseg] = -1;
            cu[++nseg] = (int32_t)(base + S);
        }
    }
    l->pos = pos;
    out->b.rows = l->rows;
    out->b.seq_len = S;
    out->b.input_ids = in;
    out->b.targets = tg;
    out->b.position_ids = ps;
    out->b.cu_seqlens = cu;
    out->b.n_docs = nseg;
    out->segment_doc = sd;
    out->n_samples = nsamp;
    out->n_tokens = ntok;
    out->n_targets = ntg;
    l->last = *out;
    l->have_last = true;
    return LOOM_OK;
}

loom_status loom_loader_slice(loom_ctx *ctx, loom_loader *l, int64_t dp_rank,
                              loom_loader_batch *out) {
    if (!l || !out) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loader: no loader or batch given");
    if (!l->have_last)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loader: no global batch to slice yet (call loom_loader_next first)");
    if (dp_rank < 0 || dp_rank >= l->cfg.dp)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loader: data-parallel rank %" PRId64 " is not in [0, %" PRId64 ")",
                         dp_rank, l->cfg.dp);
    const loom_loader_batch *g = &l->last;
    const int64_t S = g->b.seq_len, R = l->rows_per_rank;
    const int32_t t0 = (int32_t)(dp_rank * R * S), t1 = (int32_t)((dp_rank + 1) * R * S);
    int64_t s0 = 0;
    while (g->b.cu_seqlens[s0] < t0) s0++; /* row starts are boundaries */
    int64_t s1 = s0;
    while (g->b.cu_seqlens[s1] < t1) s1++;
    int64_t ntok = 0, ntg = 0, nsamp = 0;
    for (int64_t s = s0; s <= s1; s++) l->slice_cu[s - s0] = g->b.cu_seqlens[s] - t0;
    for (int64_t s = s0; s < s1; s++)
        if (g->segment_doc[s] >= 0) {
            nsamp++;
            ntok += g->b.cu_seqlens[s + 1] - g->b.cu_seqlens[s];
        }
    for (int32_t t = t0; t < t1; t++) ntg += g->b.targets[t] != LOOM_IGNORE_INDEX;
    *out = *g;
    out->b.rows = R;
    out->b.input_ids = g->b.input_ids + t0;
    out->b.targets = g->b.targets + t0;
    out->b.position_ids = g->b.position_ids + t0;
    out->b.cu_seqlens = l->slice_cu;
    out->b.n_docs = s1 - s0;
    out->b.local = 1; /* this data-parallel rank's rows */
    out->segment_doc = g->segment_doc + s0;
    out->n_samples = nsamp;
    out->n_tokens = ntok;
    out->n_targets = ntg;
    return LOOM_OK;
}

loom_loader_pos loom_loader_state(const loom_loader *l) { return l->pos; }

loom_status loom_loader_set_state(loom_ctx *ctx, loom_loader *l, loom_loader_pos pos) {
    if (pos.epoch < 0)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "loader state: epoch %" PRId64 " is negative",
                         pos.epoch);
    if (pos.index < 0 || pos.index >= l->n)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "loader state: index %" PRId64 " is not in [0, %" PRId64
                         ") (the samples of an epoch); was it saved for other data or another "
                         "truncation policy?",
                         pos.index, l->n);
    l->pos = pos;
    return LOOM_OK;
}
