/* The BPE model of Hugging Face tokenizers (models/bpe: merge_word and
 * Word::merge_all), ported step by step so that ids agree in every case:
 * a min-heap of candidate merges ordered by (rank, position), entries
 * checked when popped (a merge is applied only if the pair at that position
 * still makes the same token), new candidates pushed on both sides of each
 * merge. A character outside the vocabulary becomes unk_token (fused into
 * one when fuse_unk) or, without unk_token, is dropped, as HF does.
 *
 * Words already encoded in this call are remembered (HF keeps a cache too;
 * it only saves time). */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_impl.h"

uint64_t loom_tok_hash_bytes(const void *p, size_t n) {
    const unsigned char *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xC2B2AE3D27D4EB4Full);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ (v * 0x87C37B91114253D5ull)) * 0x4CF5AD432745937Full;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v |= (uint64_t)s[i] << (8 * i);
    h = (h ^ (v * 0x87C37B91114253D5ull)) * 0x4CF5AD432745937Full;
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
}

int32_t loom_tok_lookup(const loom_tokenizer *t, const loom_tok_hash *h, bool dec, const void *s,
                        size_t n) {
    if (!h->slot) return -1;
    uint32_t i = (uint32_t)loom_tok_hash_bytes(s, n) & h->mask;
    for (;; i = (i + 1) & h->mask) {
        int32_t v = h->slot[i];
        if (!v) return -1;
        int32_t id = v - 1;
        const char *p;
        size_t len;
        if (dec) {
            p = t->dec + t->dec_off[id];
            len = t->dec_len[id];
        } else {
            p = t->pool + t->str_off[id];
            len = (size_t)t->str_len[id];
        }
        if (len == n && memcmp(p, s, n) == 0) return id;
    }
}

void loom_ids_push(loom_ids *a, int32_t id) {
    if (a->failed) return;
    if (a->n == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 256;
        int32_t *v = realloc(a->v, cap * sizeof *v);
        if (!v) {
            a->failed = true;
            return;
        }
        a->v = v;
        a->cap = cap;
    }
    a->v[a->n++] = id;
}

/* ---------------------------------------------------------------------- */
/* Merges                                                                  */
/* ---------------------------------------------------------------------- */

/* The merge of (a, b), or NULL. */
static inline const loom_merge *merge_find(const loom_tokenizer *t, int32_t a, int32_t b) {
    if (!t->merges) return NULL;
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    for (uint32_t i = loom_merge_slot(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const loom_merge *m = &t->merges[i];
        if (m->key == key) return m;
        if (m->key == UINT64_MAX) return NULL;
    }
}

/* ---------------------------------------------------------------------- */
/* Scratch space and the word cache                                        */
/* ---------------------------------------------------------------------- */

#define CACHE_MIN 64        /* slots at first; doubled when half full */
#define CACHE_MAX (1u << 18) /* slots at most; then words are no longer added */
#define CACHE_MAX_WORD 48

typedef struct cache_entry {
    uint64_t hash;
    uint32_t off;       /* key bytes then ids (int32) in the arena */
    uint16_t len, n_ids;
} cache_entry;

/* A candidate merge: key = rank << 32 | position (the min-heap order of HF's
 * Merge: rank first, then position), and the token it makes. */
typedef struct heap_entry {
    uint64_t key;
    int32_t new_id;
} heap_entry;

struct loom_bpe_work {
    int32_t *c, *prev, *next;
    uint8_t *alive;
    size_t cap;
    heap_entry *heap;
    size_t heap_n, heap_cap;
    bool failed;
    cache_entry *cache; /* (cache_cap), off = 0 means empty (the arena starts with a pad) */
    uint32_t cache_n, cache_cap;
    unsigned char *arena;
    size_t arena_n, arena_cap;
};

loom_bpe_work *loom_bpe_work_new(void) {
    loom_bpe_work *w = calloc(1, sizeof *w);
    return w;
}

void loom_bpe_work_reset(loom_bpe_work *w) {
    free(w->cache);
    w->cache = NULL;
    w->cache_n = w->cache_cap = 0;
    w->arena_n = 0;
    w->failed = false;
}

void loom_bpe_work_free(loom_bpe_work *w) {
    if (!w) return;
    free(w->c);
    free(w->prev);
    free(w->next);
    free(w->alive);
    free(w->heap);
    free(w->cache);
    free(w->arena);
    free(w);
}

static bool work_reserve(loom_bpe_work *w, size_t n) {
    if (n <= w->cap) return true;
    size_t cap = w->cap ? w->cap : 64;
    while (cap < n) cap *= 2;
    int32_t *c = realloc(w->c, cap * sizeof *c);
    if (c) w->c = c;
    int32_t *p = realloc(w->prev, cap * sizeof *p);
    if (p) w->prev = p;
    int32_t *x = realloc(w->next, cap * sizeof *x);
    if (x) w->next = x;
    uint8_t *a = realloc(w->alive, cap);
    if (a) w->alive = a;
    if (!c || !p || !x || !a) return false;
    w->cap = cap;
    return true;
}

static bool heap_push(loom_bpe_work *w, const loom_merge *m, int32_t pos) {
    if (w->heap_n == w->heap_cap) {
        size_t cap = w->heap_cap ? 2 * w->heap_cap : 64;
        heap_entry *h = realloc(w->heap, cap * sizeof *h);
        if (!h) return false;
        w->heap = h;
        w->heap_cap = cap;
    }
    heap_entry v = {(uint64_t)m->rank << 32 | (uint32_t)pos, m->new_id};
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (w->heap[p].key <= v.key) break;
        w->heap[i] = w->heap[p];
        i = p;
    }
    w->heap[i] = v;
    return true;
}

static heap_entry heap_pop(loom_bpe_work *w) {
    heap_entry top = w->heap[0], v = w->heap[--w->heap_n];
    size_t n = w->heap_n, i = 0;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = l + 1 < n && w->heap[l + 1].key < w->heap[l].key ? l + 1 : l;
        if (w->heap[m].key >= v.key) break;
        w->heap[i] = w->heap[m];
        i = m;
    }
    if (n) w->heap[i] = v;
    return top;
}

static const cache_entry *cache_get(const loom_bpe_work *w, uint64_t h, const unsigned char *s,
                                    size_t n) {
    if (!w->cache) return NULL;
    uint32_t mask = w->cache_cap - 1;
    for (uint32_t i = (uint32_t)h & mask;; i = (i + 1) & mask) {
        const cache_entry *e = &w->cache[i];
        if (!e->off) return NULL;
        if (e->hash == h && e->len == n && memcmp(w->arena + e->off, s, n) == 0) return e;
    }
}

/* Doubles the table (or makes the first one). */
static bool cache_grow(loom_bpe_work *w) {
    uint32_t cap = w->cache_cap ? 2 * w->cache_cap : CACHE_MIN, mask = cap - 1;
    cache_entry *c = calloc(cap, sizeof *c);
    if (!c) return false;
    for (uint32_t k = 0; k < w->cache_cap; k++) {
        if (!w->cache[k].off) continue;
        uint32_t i = (uint32_t)w->cache[k].hash & mask;
        while (c[i].off) i = (i + 1) & mask;
        c[i] = w->cache[k];
    }
    free(w->cache);
    w->cache = c;
    w->cache_cap = cap;
    return true;
}

static void cache_put(loom_bpe_work *w, uint64_t h, const unsigned char *s, size_t n,
                      const int32_t *ids, size_t n_ids) {
    if (n_ids > UINT16_MAX) return;
    if (w->cache_n >= w->cache_cap / 2) {
        if (w->cache_cap >= CACHE_MAX || !cache_grow(w)) return;
    }
    size_t need = w->arena_n + n + 3 + 4 * n_ids + (w->arena_n ? 0 : 4);
    if (need > UINT32_MAX) return;
    if (need > w->arena_cap) {
        size_t cap = w->arena_cap ? 2 * w->arena_cap : 4096;
        while (cap < need) cap *= 2;
        unsigned char *a = realloc(w->arena, cap);
        if (!a) return;
        w->arena = a;
        w->arena_cap = cap;
    }
    if (!w->arena_n) w->arena_n = 4; /* offset 0 marks an empty slot */
    size_t off = w->arena_n;
    memcpy(w->arena + off, s, n);
    size_t ids_at = (off + n + 3) & ~(size_t)3;
    if (n_ids) memcpy(w->arena + ids_at, ids, 4 * n_ids);
    w->arena_n = ids_at + 4 * n_ids;
    uint32_t mask = w->cache_cap - 1, i = (uint32_t)h & mask;
    while (w->cache[i].off) i = (i + 1) & mask;
    w->cache[i] = (cache_entry){h, (uint32_t)off, (uint16_t)n, (uint16_t)n_ids};
    w->cache_n++;
}

/* ---------------------------------------------------------------------- */
/* One word                                                                */
/* ---------------------------------------------------------------------- */

void loom_bpe_encode(const loom_tokenizer *t, loom_bpe_work *w, const unsigned char *s, size_t n,
                     loom_ids *out) {
    if (!n) return;
    if (w->failed) {
        out->failed = true;
        return;
    }
    if (t->ignore_merges) {
        int32_t id = loom_tok_lookup(t, &t->vocab_bytes, true, s, n);
        if (id >= 0) {
            loom_ids_push(out, id);
            return;
        }
    }
    uint64_t h = 0;
    if (n <= CACHE_MAX_WORD) {
        h = loom_tok_hash_bytes(s, n);
        const cache_entry *e = cache_get(w, h, s, n);
        if (e) {
            const unsigned char *p = w->arena + ((e->off + e->len + 3) & ~(uint32_t)3);
            for (uint32_t k = 0; k < e->n_ids; k++) {
                int32_t id;
                memcpy(&id, p + 4 * k, 4);
                loom_ids_push(out, id);
            }
            return;
        }
    }
    if (!work_reserve(w, n)) {
        w->failed = out->failed = true;
        return;
    }
    /* merge_word: one symbol per character of the byte-level string */
    int32_t m = 0;
    bool unk = false;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[s[i]];
        if (id >= 0) {
            if (unk) w->c[m++] = t->unk_id;
            unk = false;
            w->c[m++] = id;
        } else if (t->unk_id >= 0) {
            if (unk && !t->fuse_unk) w->c[m++] = t->unk_id;
            unk = true;
        }
    }
    if (unk) w->c[m++] = t->unk_id;
    for (int32_t i = 0; i < m; i++) {
        w->prev[i] = i - 1;
        w->next[i] = i + 1 < m ? i + 1 : -1;
        w->alive[i] = 1;
    }
    /* merge_all */
    w->heap_n = 0;
    bool ok = true;
    for (int32_t i = 0; i + 1 < m && ok; i++) {
        const loom_merge *mg = merge_find(t, w->c[i], w->c[i + 1]);
        if (mg) ok = heap_push(w, mg, i);
    }
    while (ok && w->heap_n) {
        heap_entry top = heap_pop(w);
        int32_t pos = (int32_t)(uint32_t)top.key;
        if (!w->alive[pos] || w->next[pos] < 0) continue;
        int32_t np = w->next[pos];
        const loom_merge *cur = merge_find(t, w->c[pos], w->c[np]);
        if (!cur || cur->new_id != top.new_id) continue; /* an expired entry */
        int32_t new_id = top.new_id;
        w->c[pos] = new_id;
        w->next[pos] = w->next[np];
        w->alive[np] = 0;
        if (w->next[np] >= 0) w->prev[w->next[np]] = pos;
        if (w->prev[pos] >= 0) {
            int32_t pp = w->prev[pos];
            const loom_merge *mg = merge_find(t, w->c[pp], new_id);
            if (mg) ok = heap_push(w, mg, pp);
        }
        if (ok && w->next[pos] >= 0) {
            const loom_merge *mg = merge_find(t, new_id, w->c[w->next[pos]]);
            if (mg) ok = heap_push(w, mg, pos);
        }
    }
    if (!ok) {
        w->failed = out->failed = true;
        return;
    }
    size_t first = out->n;
    for (int32_t i = 0; i < m; i++)
        if (w->alive[i]) loom_ids_push(out, w->c[i]);
    if (n <= CACHE_MAX_WORD && !out->failed)
        cache_put(w, h, s, n, out->v ? out->v + first : NULL, out->n - first);
}
