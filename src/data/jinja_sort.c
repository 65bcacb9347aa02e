/* Jinja templates: sorting as Python's sorted() does it (stable, reverse
 * keeps equal items in order): the sort and dictsort filters and tojson's
 * sort_keys. */
#include <string.h>

#include "jinja_impl.h"

/* Sorts items[0..n) by keys[0..n) (moved along), stable merge sort. */
void jx_sort(jr *r, const jnode *at, jv *keys, jv *items, size_t n, bool reverse) {
    if (n < 2)
        return;
    jv *tkeys = ja_alloc(&r->arena, n * sizeof *tkeys), *ti = ja_alloc(&r->arena, n * sizeof *ti);
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n,
                   hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t a = lo, b = mid, o = lo;
            while (a < mid || b < hi) {
                bool left = b >= hi;
                if (!left && a < mid) {
                    int c = jv_cmp(r, at, keys[a], keys[b]);
                    left = reverse ? c >= 0 : c <= 0;
                }
                size_t from = left ? a++ : b++;
                tkeys[o] = keys[from], ti[o] = items[from];
                o++;
            }
        }
        memcpy(keys, tkeys, n * sizeof *keys);
        memcpy(items, ti, n * sizeof *items);
    }
}

/* The key of one item: lower-cased when a string and !case_sensitive. */
static jv sort_key(jr *r, const jnode *at, jv k, bool case_sensitive) {
    return k.t == JV_STR && !case_sensitive ? jv_case(r, at, k, 0) : k;
}

jv jx_sort_filter(jr *r, const jnode *at, jv seq, bool reverse, bool case_sensitive,
                  const char *attr) {
    jv out = jv_newlist(r);
    if (seq.t == JV_DICT) {
        for (size_t i = 0; i < seq.d->n; i++)
            jl_push(r, out.l, seq.d->k[i]);
    } else if (seq.t == JV_LIST) {
        for (size_t i = 0; i < seq.l->n; i++)
            jl_push(r, out.l, seq.l->v[i]);
    } else if (seq.t != JV_UNDEF) {
        jr_fail(r, at, LOOM_ERR_FORMAT, "sort: expected a list, got %s", jv_typename(seq));
    }
    size_t n = out.l->n;
    jv *keys = ja_alloc(&r->arena, (n ? n : 1) * sizeof *keys);
    for (size_t i = 0; i < n; i++)
        keys[i] = sort_key(r, at, attr ? jlib_getattr(r, at, out.l->v[i], attr) : out.l->v[i],
                           case_sensitive);
    jx_sort(r, at, keys, out.l->v, n, reverse);
    return out;
}

jv jx_dictsort(jr *r, const jnode *at, jv d, bool case_sensitive, bool by_value, bool reverse) {
    if (d.t != JV_DICT)
        jr_fail(r, at, LOOM_ERR_FORMAT, "dictsort: expected a mapping, got %s", jv_typename(d));
    jv out = jv_newlist(r);
    size_t n = d.d->n;
    jv *keys = ja_alloc(&r->arena, (n ? n : 1) * sizeof *keys);
    for (size_t i = 0; i < n; i++) {
        jv p = jv_newlist(r);
        p.tuple = true;
        jl_push(r, p.l, d.d->k[i]);
        jl_push(r, p.l, d.d->v[i]);
        jl_push(r, out.l, p);
        keys[i] = sort_key(r, at, by_value ? d.d->v[i] : d.d->k[i], case_sensitive);
    }
    jx_sort(r, at, keys, out.l->v, n, reverse);
    return out;
}
