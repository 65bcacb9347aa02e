/* Jinja templates: filters, tests, global functions, attribute and item
 * access, and the string / dict methods chat templates call, with jinja2's
 * and Python's behaviour. jinja2's sandbox refuses methods that modify
 * (list.append, dict.update, ...); so does loom. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja_impl.h"

static const char *const FILTERS[] = {
    "abs",    "capitalize", "count",      "d",       "default", "dictsort", "first",  "float",
    "sort",   "int",        "items",      "join",    "last",    "length",   "list",   "lower",
    "map",    "reject",     "rejectattr", "replace", "reverse", "safe",     "select", "selectattr",
    "string", "title",      "tojson",     "trim",    "upper",   NULL};
static const char *const TESTS[] = {
    "defined", "undefined", "none",    "string",   "number",   "integer",  "float", "boolean",
    "true",    "false",     "mapping", "iterable", "sequence", "callable", "eq",    "equalto",
    "ne",      "lt",        "gt",      "le",       "ge",       "odd",      "even",  "divisibleby",
    "in",      "sameas",    "lower",   "upper",    NULL};
static const char *const METHODS[] = {
    "startswith", "endswith", "strip",      "lstrip",     "rstrip",  "split",   "rsplit",
    "lower",      "upper",    "title",      "capitalize", "replace", "find",    "rfind",
    "count",      "join",     "splitlines", "isdigit",    "isalpha", "isspace", "get",
    "items",      "keys",     "values",     "index",      NULL};
static const char *const GLOBALS[] = {"range",           "namespace",    "dict",
                                      "raise_exception", "strftime_now", NULL};

static int find_name(const char *const *tab, const char *name) {
    for (int k = 0; tab[k]; k++)
        if (strcmp(tab[k], name) == 0)
            return k;
    return -1;
}
bool jlib_has_filter(const char *name) { return find_name(FILTERS, name) >= 0; }
bool jlib_has_test(const char *name) { return find_name(TESTS, name) >= 0; }
bool jlib_has_method(const char *name) { return find_name(METHODS, name) >= 0; }
bool jlib_has_global(const char *name, int *fn) {
    int k = find_name(GLOBALS, name);
    if (k < 0)
        return false;
    static const int FN[] = {FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME};
    *fn = FN[k];
    return true;
}

/* ---------------------------------------------------------------------- */
/* Helpers                                                                 */
/* ---------------------------------------------------------------------- */

static const char *obj_desc(jv v) {
    switch (v.t) {
    case JV_DICT:
        return "dict object";
    case JV_LIST:
        return v.tuple ? "tuple object" : "list object";
    case JV_STR:
        return "str object";
    case JV_NS:
        return "jinja2.utils.Namespace object";
    case JV_NONE:
        return "None";
    default:
        return jv_typename(v);
    }
}

static jv no_attr(jr *r, jv obj, jv key) {
    jbuf b = {0};
    jb_puts(r, &b, "'");
    jb_puts(r, &b, obj_desc(obj));
    jb_puts(r, &b, "' has no attribute ");
    if (key.t == JV_STR) {
        jb_puts(r, &b, "'");
        jb_put(r, &b, key.s.p, key.s.n);
        jb_puts(r, &b, "'");
    } else {
        jv_write_str(r, &b, key, true);
    }
    return jv_undef(b.p);
}

static jv arg(jv *args, int nargs, const char **kwn, jv *kwv, int nkw, int pos, const char *name,
              jv dflt) {
    for (int i = 0; i < nkw; i++)
        if (strcmp(kwn[i], name) == 0)
            return kwv[i];
    return pos < nargs ? args[pos] : dflt;
}

static void max_args(jr *r, const jnode *at, const char *what, int nargs, int max) {
    if (nargs > max)
        jr_fail(r, at, LOOM_ERR_FORMAT, "%s takes at most %d argument(s), got %d", what, max,
                nargs);
}

static jv need_str(jr *r, const jnode *at, jv v, const char *what) {
    if (v.t != JV_STR)
        jr_fail(r, at, LOOM_ERR_FORMAT, "%s: expected a string, got %s", what,
                v.t == JV_UNDEF && v.name ? v.name : jv_typename(v));
    return v;
}

static int64_t need_int(jr *r, const jnode *at, jv v, const char *what) {
    if (v.t == JV_INT)
        return v.i;
    if (v.t == JV_BOOL)
        return v.b;
    jr_fail(r, at, LOOM_ERR_FORMAT, "%s: expected an integer, got %s", what, jv_typename(v));
}

/* code point length at p */
static size_t cp_len(const char *p, size_t n) {
    size_t j = 1;
    while (j < n && ((unsigned char)p[j] & 0xC0) == 0x80)
        j++;
    return j;
}

static bool in_chars(jv chars, const char *p, size_t k) {
    for (size_t i = 0; i < chars.s.n;) {
        size_t m = cp_len(chars.s.p + i, chars.s.n - i);
        if (m == k && memcmp(chars.s.p + i, p, k) == 0)
            return true;
        i += m;
    }
    return false;
}

/* str.strip / lstrip / rstrip; chars none: whitespace */
static jv strip(jv s, jv chars, bool left, bool right) {
    size_t b = 0, e = s.s.n, k;
    bool ws = chars.t != JV_STR;
    if (left)
        while (b < e) {
            k = cp_len(s.s.p + b, e - b);
            bool hit = ws ? jx_space_at(s.s.p + b, e - b, &k) : in_chars(chars, s.s.p + b, k);
            if (!hit)
                break;
            b += k;
        }
    if (right)
        while (e > b) {
            size_t st = e - 1;
            while (st > b && ((unsigned char)s.s.p[st] & 0xC0) == 0x80)
                st--;
            k = e - st;
            size_t kk;
            bool hit =
                ws ? jx_space_at(s.s.p + st, k, &kk) && kk == k : in_chars(chars, s.s.p + st, k);
            if (!hit)
                break;
            e = st;
        }
    return jv_str(s.s.p + b, e - b);
}

static ptrdiff_t find_sub(jv s, jv sub, size_t from) {
    if (sub.s.n > s.s.n)
        return -1;
    for (size_t i = from; i + sub.s.n <= s.s.n; i++)
        if (memcmp(s.s.p + i, sub.s.p, sub.s.n) == 0)
            return (ptrdiff_t)i;
    return -1;
}
static ptrdiff_t rfind_sub(jv s, jv sub, size_t end) {
    if (sub.s.n > end)
        return -1;
    for (size_t i = end - sub.s.n + 1; i-- > 0;)
        if (memcmp(s.s.p + i, sub.s.p, sub.s.n) == 0)
            return (ptrdiff_t)i;
    return -1;
}

static jv replace(jr *r, jv s, jv old, jv new_, int64_t count) {
    jbuf b = {0};
    size_t i = 0;
    int64_t done = 0;
    if (!old.s.n) {
        /* Python inserts `new` between every character (and at both ends) */
        for (size_t k = 0; k <= s.s.n && (count < 0 || done < count);) {
            jb_put(r, &b, new_.s.p, new_.s.n);
            done++;
            if (k == s.s.n) {
                k++;
                i = s.s.n;
                break;
            }
            size_t m = cp_len(s.s.p + k, s.s.n - k);
            jb_put(r, &b, s.s.p + k, m);
            k += m;
            i = k;
        }
        jb_put(r, &b, s.s.p + i, s.s.n - i);
        return jv_str(b.p ? b.p : "", b.n);
    }
    for (;;) {
        ptrdiff_t at = count >= 0 && done >= count ? -1 : find_sub(s, old, i);
        if (at < 0)
            break;
        jb_put(r, &b, s.s.p + i, (size_t)at - i);
        jb_put(r, &b, new_.s.p, new_.s.n);
        i = (size_t)at + old.s.n;
        done++;
    }
    jb_put(r, &b, s.s.p + i, s.s.n - i);
    return jv_str(b.p ? b.p : "", b.n);
}

/* str.split / rsplit */
static jv split(jr *r, const jnode *at, jv s, jv sep, int64_t maxsplit, bool from_right) {
    jv out = jv_newlist(r);
    if (sep.t == JV_NONE || sep.t == JV_UNDEF) {
        /* runs of whitespace; no empty strings */
        size_t n = s.s.n, k;
        jlist *tmp = ja_alloc(&r->arena, sizeof *tmp);
        if (!from_right) {
            size_t i = 0;
            int64_t done = 0;
            for (;;) {
                while (i < n && jx_space_at(s.s.p + i, n - i, &k))
                    i += k;
                if (i >= n)
                    break;
                if (maxsplit >= 0 && done >= maxsplit) {
                    jl_push(r, tmp, jv_str(s.s.p + i, n - i));
                    break;
                }
                size_t j = i;
                while (j < n && !jx_space_at(s.s.p + j, n - j, &k))
                    j += cp_len(s.s.p + j, n - j);
                jl_push(r, tmp, jv_str(s.s.p + i, j - i));
                done++;
                i = j;
            }
            out.l = tmp;
            return out;
        }
        /* from the right: split fully, then rejoin the head when limited */
        jv all = split(r, at, s, sep, -1, false);
        if (maxsplit < 0 || (int64_t)all.l->n <= maxsplit + 1)
            return all;
        size_t keep = (size_t)maxsplit;
        size_t head_items = all.l->n - keep;
        /* the head is the original text up to the end of item head_items-1 */
        const char *last = all.l->v[head_items - 1].s.p + all.l->v[head_items - 1].s.n;
        jv head = jv_str(s.s.p, (size_t)(last - s.s.p));
        jl_push(r, tmp, head);
        for (size_t i = head_items; i < all.l->n; i++)
            jl_push(r, tmp, all.l->v[i]);
        out.l = tmp;
        return out;
    }
    need_str(r, at, sep, "split separator");
    if (!sep.s.n)
        jr_fail(r, at, LOOM_ERR_FORMAT, "split: empty separator");
    if (!from_right) {
        size_t i = 0;
        int64_t done = 0;
        for (;;) {
            ptrdiff_t p = maxsplit >= 0 && done >= maxsplit ? -1 : find_sub(s, sep, i);
            if (p < 0)
                break;
            jl_push(r, out.l, jv_str(s.s.p + i, (size_t)p - i));
            i = (size_t)p + sep.s.n;
            done++;
        }
        jl_push(r, out.l, jv_str(s.s.p + i, s.s.n - i));
        return out;
    }
    jlist *rev = ja_alloc(&r->arena, sizeof *rev);
    size_t end = s.s.n;
    int64_t done = 0;
    for (;;) {
        ptrdiff_t p = maxsplit >= 0 && done >= maxsplit ? -1 : rfind_sub(s, sep, end);
        if (p < 0)
            break;
        jl_push(r, rev, jv_str(s.s.p + p + sep.s.n, end - (size_t)p - sep.s.n));
        end = (size_t)p;
        done++;
    }
    jl_push(r, out.l, jv_str(s.s.p, end));
    for (size_t i = rev->n; i-- > 0;)
        jl_push(r, out.l, rev->v[i]);
    return out;
}

static size_t length(jr *r, const jnode *at, jv v) {
    switch (v.t) {
    case JV_UNDEF:
        return 0;
    case JV_STR:
        return utf8_count(v.s.p, v.s.n);
    case JV_LIST:
        return v.l->n;
    case JV_DICT:
    case JV_NS:
        return v.d->n;
    default:
        jr_fail(r, at, LOOM_ERR_FORMAT, "object of type '%s' has no len()", jv_typename(v));
    }
}

/* list(v): items of a list, keys of a dict, characters of a string */
static jv to_list(jr *r, const jnode *at, jv v) {
    jv l = jv_newlist(r);
    switch (v.t) {
    case JV_UNDEF:
        return l;
    case JV_LIST:
        for (size_t i = 0; i < v.l->n; i++)
            jl_push(r, l.l, v.l->v[i]);
        return l;
    case JV_DICT:
        for (size_t i = 0; i < v.d->n; i++)
            jl_push(r, l.l, v.d->k[i]);
        return l;
    case JV_STR:
        for (size_t i = 0; i < v.s.n;) {
            size_t m = cp_len(v.s.p + i, v.s.n - i);
            jl_push(r, l.l, jv_str(v.s.p + i, m));
            i += m;
        }
        return l;
    default:
        jr_fail(r, at, LOOM_ERR_FORMAT, "'%s' object is not iterable", jv_typename(v));
    }
}

static jv items_of(jr *r, const jnode *at, jv d) {
    jv l = jv_newlist(r);
    if (d.t == JV_UNDEF)
        return l;
    if (d.t != JV_DICT)
        jr_fail(r, at, LOOM_ERR_FORMAT, "items: expected a mapping, got %s", jv_typename(d));
    for (size_t i = 0; i < d.d->n; i++) {
        jv p = jv_newlist(r);
        p.tuple = true;
        jl_push(r, p.l, d.d->k[i]);
        jl_push(r, p.l, d.d->v[i]);
        jl_push(r, l.l, p);
    }
    return l;
}

/* ---------------------------------------------------------------------- */
/* Attribute, item, slice                                                  */
/* ---------------------------------------------------------------------- */

jv jlib_getattr(jr *r, const jnode *at, jv obj, const char *name) {
    (void)at;
    if (obj.t == JV_DICT || obj.t == JV_NS) {
        const jv *v = jd_gets(obj.d, name);
        if (v)
            return *v;
    }
    return no_attr(r, obj, jv_cstr(name));
}

jv jlib_getitem(jr *r, const jnode *at, jv obj, jv key) {
    if (obj.t == JV_DICT) {
        const jv *v = jd_get(obj.d, key);
        return v ? *v : no_attr(r, obj, key);
    }
    if ((obj.t == JV_LIST || obj.t == JV_STR) && (key.t == JV_INT || key.t == JV_BOOL)) {
        int64_t i = key.t == JV_INT ? key.i : key.b;
        size_t n = obj.t == JV_LIST ? obj.l->n : utf8_count(obj.s.p, obj.s.n);
        if (i < 0)
            i += (int64_t)n;
        if (i < 0 || (uint64_t)i >= n)
            return no_attr(r, obj, key);
        if (obj.t == JV_LIST)
            return obj.l->v[i];
        size_t o = utf8_offset(obj.s.p, obj.s.n, (size_t)i);
        return jv_str(obj.s.p + o, cp_len(obj.s.p + o, obj.s.n - o));
    }
    if (key.t == JV_STR) {
        char *name = ja_strndup(&r->arena, key.s.p, key.s.n);
        return jlib_getattr(r, at, obj, name);
    }
    return no_attr(r, obj, key);
}

static int64_t slice_bound(jr *r, const jnode *at, jv v, int64_t n, int64_t step, bool is_start) {
    if (v.t == JV_NONE)
        return step > 0 ? (is_start ? 0 : n) : (is_start ? n - 1 : -1);
    int64_t i = need_int(r, at, v, "slice index");
    if (i < 0) {
        i += n;
        if (i < 0)
            i = step > 0 ? 0 : -1;
    } else if (i >= n) {
        i = step > 0 ? n : n - 1;
    }
    return i;
}

jv jlib_slice(jr *r, const jnode *at, jv obj, jv start, jv stop, jv step) {
    int64_t st = step.t == JV_NONE ? 1 : need_int(r, at, step, "slice step");
    if (st == 0)
        jr_fail(r, at, LOOM_ERR_FORMAT, "slice step cannot be zero");
    if (obj.t != JV_LIST && obj.t != JV_STR)
        jr_fail(r, at, LOOM_ERR_FORMAT, "'%s' object is not subscriptable with a slice",
                jv_typename(obj));
    int64_t n = (int64_t)(obj.t == JV_LIST ? obj.l->n : utf8_count(obj.s.p, obj.s.n));
    int64_t b = slice_bound(r, at, start, n, st, true), e = slice_bound(r, at, stop, n, st, false);
    if (obj.t == JV_LIST) {
        jv l = jv_newlist(r);
        l.tuple = obj.tuple;
        for (int64_t i = b; st > 0 ? i < e : i > e; i += st)
            jl_push(r, l.l, obj.l->v[i]);
        return l;
    }
    if (st == 1) {
        if (e <= b)
            return jv_str("", 0);
        size_t ob = utf8_offset(obj.s.p, obj.s.n, (size_t)b),
               oe = utf8_offset(obj.s.p, obj.s.n, (size_t)e);
        return jv_str(obj.s.p + ob, oe - ob);
    }
    jbuf out = {0};
    for (int64_t i = b; st > 0 ? i < e : i > e; i += st) {
        size_t o = utf8_offset(obj.s.p, obj.s.n, (size_t)i);
        jb_put(r, &out, obj.s.p + o, cp_len(obj.s.p + o, obj.s.n - o));
    }
    return jv_str(out.p ? out.p : "", out.n);
}

/* ---------------------------------------------------------------------- */
/* Tests                                                                   */
/* ---------------------------------------------------------------------- */

bool jlib_test(jr *r, const jnode *at, const char *name, jv v, jv *args, int nargs) {
    jv a0 = nargs ? args[0] : jv_undef("missing test argument");
    if (!strcmp(name, "defined"))
        return v.t != JV_UNDEF;
    if (!strcmp(name, "undefined"))
        return v.t == JV_UNDEF;
    if (!strcmp(name, "none"))
        return v.t == JV_NONE;
    if (!strcmp(name, "string"))
        return v.t == JV_STR;
    if (!strcmp(name, "number"))
        return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL;
    if (!strcmp(name, "integer"))
        return v.t == JV_INT;
    if (!strcmp(name, "float"))
        return v.t == JV_FLOAT;
    if (!strcmp(name, "boolean"))
        return v.t == JV_BOOL;
    if (!strcmp(name, "true"))
        return v.t == JV_BOOL && v.b;
    if (!strcmp(name, "false"))
        return v.t == JV_BOOL && !v.b;
    if (!strcmp(name, "mapping"))
        return v.t == JV_DICT;
    if (!strcmp(name, "iterable") || !strcmp(name, "sequence"))
        return v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    if (!strcmp(name, "callable"))
        return v.t == JV_MACRO || v.t == JV_FUNC;
    if (!strcmp(name, "eq") || !strcmp(name, "equalto") || !strcmp(name, "sameas"))
        return jv_eq(v, a0);
    if (!strcmp(name, "ne"))
        return !jv_eq(v, a0);
    if (!strcmp(name, "lt"))
        return jv_cmp(r, at, v, a0) < 0;
    if (!strcmp(name, "gt"))
        return jv_cmp(r, at, v, a0) > 0;
    if (!strcmp(name, "le"))
        return jv_cmp(r, at, v, a0) <= 0;
    if (!strcmp(name, "ge"))
        return jv_cmp(r, at, v, a0) >= 0;
    if (!strcmp(name, "odd") || !strcmp(name, "even")) {
        int64_t i = need_int(r, at, v, name);
        return (i % 2 != 0) == (name[0] == 'o');
    }
    if (!strcmp(name, "divisibleby")) {
        int64_t d = need_int(r, at, a0, name);
        if (!d)
            jr_fail(r, at, LOOM_ERR_FORMAT, "divisibleby 0");
        return need_int(r, at, v, name) % d == 0;
    }
    if (!strcmp(name, "in")) {
        if (a0.t == JV_STR) {
            need_str(r, at, v, "in");
            jv s = a0;
            return find_sub(s, v, 0) >= 0;
        }
        if (a0.t == JV_LIST) {
            for (size_t i = 0; i < a0.l->n; i++)
                if (jv_eq(a0.l->v[i], v))
                    return true;
            return false;
        }
        if (a0.t == JV_DICT)
            return jd_get(a0.d, v) != NULL;
        jr_fail(r, at, LOOM_ERR_FORMAT, "argument of type '%s' is not iterable", jv_typename(a0));
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (v.t != JV_STR)
            return false;
        bool cased = false;
        for (size_t i = 0; i < v.s.n; i++) {
            char c = v.s.p[i];
            if (c >= 'a' && c <= 'z') {
                if (name[0] == 'u')
                    return false;
                cased = true;
            } else if (c >= 'A' && c <= 'Z') {
                if (name[0] == 'l')
                    return false;
                cased = true;
            }
        }
        return cased;
    }
    jr_fail(r, at, LOOM_ERR_UNSUPPORTED, "unsupported test '%s'", name);
}

/* ---------------------------------------------------------------------- */
/* Filters                                                                 */
/* ---------------------------------------------------------------------- */

/* select / reject / selectattr / rejectattr / map */
static jv filter_seq(jr *r, jframe *f, const jnode *at, const char *name, jv v, jv *args, int nargs,
                     const char **kwn, jv *kwv, int nkw) {
    jv items = to_list(r, at, v), out = jv_newlist(r);
    bool attr = strstr(name, "attr") != NULL, select = name[0] == 's';
    if (!strcmp(name, "map")) {
        jv a = arg(NULL, 0, kwn, kwv, nkw, 0, "attribute", jv_undef(NULL));
        if (a.t == JV_STR) {
            jv dflt = arg(NULL, 0, kwn, kwv, nkw, 0, "default", jv_undef(NULL));
            char *an = ja_strndup(&r->arena, a.s.p, a.s.n);
            for (size_t i = 0; i < items.l->n; i++) {
                jv x = jlib_getattr(r, at, items.l->v[i], an);
                jl_push(r, out.l, x.t == JV_UNDEF && dflt.t != JV_UNDEF ? dflt : x);
            }
            return out;
        }
        if (!nargs || args[0].t != JV_STR)
            jr_fail(r, at, LOOM_ERR_FORMAT, "map: expected a filter name or attribute=");
        char *fname = ja_strndup(&r->arena, args[0].s.p, args[0].s.n);
        if (!jlib_has_filter(fname))
            jr_fail(r, at, LOOM_ERR_UNSUPPORTED, "unsupported filter '%s' in map", fname);
        for (size_t i = 0; i < items.l->n; i++)
            jl_push(
                r, out.l,
                jlib_filter(r, f, at, fname, items.l->v[i], args + 1, nargs - 1, kwn, kwv, nkw));
        return out;
    }
    int k = 0;
    char *an = NULL;
    if (attr) {
        if (!nargs || args[0].t != JV_STR)
            jr_fail(r, at, LOOM_ERR_FORMAT, "%s: expected an attribute name", name);
        an = ja_strndup(&r->arena, args[0].s.p, args[0].s.n);
        k = 1;
    }
    char *test = NULL;
    if (nargs > k) {
        if (args[k].t != JV_STR)
            jr_fail(r, at, LOOM_ERR_FORMAT, "%s: expected a test name", name);
        test = ja_strndup(&r->arena, args[k].s.p, args[k].s.n);
        if (!jlib_has_test(test))
            jr_fail(r, at, LOOM_ERR_UNSUPPORTED, "unsupported test '%s' in %s", test, name);
        k++;
    }
    for (size_t i = 0; i < items.l->n; i++) {
        jv x = items.l->v[i], y = an ? jlib_getattr(r, at, x, an) : x;
        bool t = test ? jlib_test(r, at, test, y, args + k, nargs - k) : jv_truthy(y);
        if (t == select)
            jl_push(r, out.l, x);
    }
    return out;
}

jv jlib_filter(jr *r, jframe *f, const jnode *at, const char *name, jv v, jv *args, int nargs,
               const char **kwn, jv *kwv, int nkw) {
    if (!strcmp(name, "tojson")) {
        jv ea = arg(args, nargs, kwn, kwv, nkw, 0, "ensure_ascii", jv_bool(false));
        jv ind = arg(args, nargs, kwn, kwv, nkw, 1, "indent", jv_none());
        jv sep = arg(args, nargs, kwn, kwv, nkw, 2, "separators", jv_none());
        jv sk = arg(args, nargs, kwn, kwv, nkw, 3, "sort_keys", jv_bool(false));
        jjson o = {-1, ", ", ": ", jv_truthy(ea), jv_truthy(sk)};
        if (ind.t != JV_NONE) {
            int64_t i = need_int(r, at, ind, "tojson indent");
            o.indent = i < 0 ? 0 : i > 64 ? 64 : (int)i;
            o.item_sep = ",";
        }
        if (sep.t != JV_NONE) {
            if (sep.t != JV_LIST || sep.l->n != 2 || sep.l->v[0].t != JV_STR ||
                sep.l->v[1].t != JV_STR)
                jr_fail(r, at, LOOM_ERR_FORMAT, "tojson: separators must be two strings");
            o.item_sep = ja_strndup(&r->arena, sep.l->v[0].s.p, sep.l->v[0].s.n);
            o.key_sep = ja_strndup(&r->arena, sep.l->v[1].s.p, sep.l->v[1].s.n);
        }
        jbuf b = {0};
        jv_write_json(r, &b, v, &o, 0);
        return jv_str(b.p, b.n);
    }
    if (!strcmp(name, "safe"))
        return v;
    if (!strcmp(name, "sort") || !strcmp(name, "dictsort")) {
        bool d = name[0] == 'd';
        jv rev = arg(args, nargs, kwn, kwv, nkw, d ? 2 : 0, "reverse", jv_bool(false));
        jv cs = arg(args, nargs, kwn, kwv, nkw, d ? 0 : 1, "case_sensitive", jv_bool(false));
        jv ex = arg(args, nargs, kwn, kwv, nkw, d ? 1 : 2, d ? "by" : "attribute", jv_none());
        if (d) {
            bool by_value = ex.t == JV_STR && ex.s.n == 5 && !memcmp(ex.s.p, "value", 5);
            if (ex.t != JV_NONE && !by_value &&
                !(ex.t == JV_STR && ex.s.n == 3 && !memcmp(ex.s.p, "key", 3)))
                jr_fail(r, at, LOOM_ERR_FORMAT, "dictsort: by must be 'key' or 'value'");
            return jx_dictsort(r, at, v, jv_truthy(cs), by_value, jv_truthy(rev));
        }
        if (ex.t != JV_NONE && ex.t != JV_STR)
            jr_fail(r, at, LOOM_ERR_FORMAT, "sort: attribute must be a string");
        const char *attr = ex.t == JV_STR ? ja_strndup(&r->arena, ex.s.p, ex.s.n) : NULL;
        return jx_sort_filter(r, at, v, jv_truthy(rev), jv_truthy(cs), attr);
    }
    if (!strcmp(name, "string"))
        return jv_to_str(r, v);
    if (!strcmp(name, "trim")) {
        max_args(r, at, "trim", nargs, 1);
        return strip(jv_to_str(r, v), arg(args, nargs, kwn, kwv, nkw, 0, "chars", jv_none()), true,
                     true);
    }
    if (!strcmp(name, "length") || !strcmp(name, "count"))
        return jv_int((int64_t)length(r, at, v));
    if (!strcmp(name, "items"))
        return items_of(r, at, v);
    if (!strcmp(name, "list"))
        return to_list(r, at, v);
    if (!strcmp(name, "upper") || !strcmp(name, "lower") || !strcmp(name, "capitalize") ||
        !strcmp(name, "title"))
        return jv_case(r, at, jv_to_str(r, v),
                       name[0] == 'l'   ? 0
                       : name[0] == 'u' ? 1
                       : name[0] == 'c' ? 2
                                        : 3);
    if (!strcmp(name, "default") || !strcmp(name, "d")) {
        jv dv = arg(args, nargs, kwn, kwv, nkw, 0, "default_value", jv_str("", 0));
        jv boolean = arg(args, nargs, kwn, kwv, nkw, 1, "boolean", jv_bool(false));
        if (v.t == JV_UNDEF || (jv_truthy(boolean) && !jv_truthy(v)))
            return dv;
        return v;
    }
    if (!strcmp(name, "join")) {
        jv sep = arg(args, nargs, kwn, kwv, nkw, 0, "d", jv_str("", 0));
        jv at_name = arg(args, nargs, kwn, kwv, nkw, 1, "attribute", jv_none());
        jv items = to_list(r, at, v);
        jbuf b = {0};
        char *an = at_name.t == JV_STR ? ja_strndup(&r->arena, at_name.s.p, at_name.s.n) : NULL;
        for (size_t i = 0; i < items.l->n; i++) {
            if (i)
                jv_write_str(r, &b, sep, false);
            jv x = an ? jlib_getattr(r, at, items.l->v[i], an) : items.l->v[i];
            jv_write_str(r, &b, x, false);
        }
        return jv_str(b.p ? b.p : "", b.n);
    }
    if (!strcmp(name, "first") || !strcmp(name, "last")) {
        jv items = to_list(r, at, v);
        if (!items.l->n)
            return jv_undef(name[0] == 'f' ? "no first item, sequence was empty"
                                           : "no last item, sequence was empty");
        return items.l->v[name[0] == 'f' ? 0 : items.l->n - 1];
    }
    if (!strcmp(name, "reverse")) {
        if (v.t == JV_STR)
            return jlib_slice(r, at, v, jv_none(), jv_none(), jv_int(-1));
        jv items = to_list(r, at, v), out = jv_newlist(r);
        for (size_t i = items.l->n; i-- > 0;)
            jl_push(r, out.l, items.l->v[i]);
        return out;
    }
    if (!strcmp(name, "replace")) {
        jv s = jv_to_str(r, v);
        jv old = jv_to_str(r, arg(args, nargs, kwn, kwv, nkw, 0, "old", jv_str("", 0)));
        jv nw = jv_to_str(r, arg(args, nargs, kwn, kwv, nkw, 1, "new", jv_str("", 0)));
        jv cnt = arg(args, nargs, kwn, kwv, nkw, 2, "count", jv_none());
        return replace(r, s, old, nw,
                       cnt.t == JV_NONE ? -1 : need_int(r, at, cnt, "replace count"));
    }
    if (!strcmp(name, "abs")) {
        if (v.t == JV_INT)
            return v.i == INT64_MIN ? v : jv_int(v.i < 0 ? -v.i : v.i);
        if (v.t == JV_FLOAT)
            return jv_float(v.f < 0 ? -v.f : v.f);
        if (v.t == JV_BOOL)
            return jv_int(v.b);
        jr_fail(r, at, LOOM_ERR_FORMAT, "bad operand type for abs(): '%s'", jv_typename(v));
    }
    if (!strcmp(name, "int") || !strcmp(name, "float")) {
        bool is_int = name[0] == 'i';
        jv dflt = arg(args, nargs, kwn, kwv, nkw, 0, "default", is_int ? jv_int(0) : jv_float(0));
        if (v.t == JV_INT || v.t == JV_BOOL)
            return is_int ? jv_int(v.t == JV_INT ? v.i : v.b)
                          : jv_float(v.t == JV_INT ? (double)v.i : v.b);
        if (v.t == JV_FLOAT)
            return is_int ? jv_int((int64_t)v.f) : v;
        if (v.t == JV_STR) {
            char *s = ja_strndup(&r->arena, v.s.p, v.s.n), *end;
            jv t = strip(jv_cstr(s), jv_none(), true, true);
            s = ja_strndup(&r->arena, t.s.p, t.s.n);
            double d = strtod(s, &end);
            if (end != s && *end == 0) {
                if (!is_int)
                    return jv_float(d);
                long long ll = strtoll(s, &end, 10);
                return *end == 0 ? jv_int(ll) : jv_int((int64_t)d);
            }
        }
        return dflt;
    }
    if (!strcmp(name, "select") || !strcmp(name, "reject") || !strcmp(name, "selectattr") ||
        !strcmp(name, "rejectattr") || !strcmp(name, "map"))
        return filter_seq(r, f, at, name, v, args, nargs, kwn, kwv, nkw);
    jr_fail(r, at, LOOM_ERR_UNSUPPORTED, "unsupported filter '%s'", name);
}

/* ---------------------------------------------------------------------- */
/* Methods                                                                 */
/* ---------------------------------------------------------------------- */

static bool affix(jr *r, const jnode *at, jv s, jv a, bool end) {
    if (a.t == JV_LIST && a.tuple) {
        for (size_t i = 0; i < a.l->n; i++)
            if (affix(r, at, s, a.l->v[i], end))
                return true;
        return false;
    }
    need_str(r, at, a, end ? "endswith" : "startswith");
    if (a.s.n > s.s.n)
        return false;
    return memcmp(s.s.p + (end ? s.s.n - a.s.n : 0), a.s.p, a.s.n) == 0;
}

static jv str_method(jr *r, const jnode *at, jv s, const char *name, jv *args, int nargs,
                     const char **kwn, jv *kwv, int nkw) {
    jv a0 = arg(args, nargs, kwn, kwv, nkw, 0, "", jv_none());
    if (!strcmp(name, "startswith") || !strcmp(name, "endswith")) {
        max_args(r, at, name, nargs, 1);
        return jv_bool(affix(r, at, s, a0, name[0] == 'e'));
    }
    if (!strcmp(name, "strip") || !strcmp(name, "lstrip") || !strcmp(name, "rstrip")) {
        max_args(r, at, name, nargs, 1);
        if (a0.t != JV_NONE)
            need_str(r, at, a0, name);
        return strip(s, a0, name[0] != 'r', name[0] != 'l');
    }
    if (!strcmp(name, "split") || !strcmp(name, "rsplit")) {
        jv sep = arg(args, nargs, kwn, kwv, nkw, 0, "sep", jv_none());
        jv mx = arg(args, nargs, kwn, kwv, nkw, 1, "maxsplit", jv_int(-1));
        return split(r, at, s, sep, need_int(r, at, mx, "maxsplit"), name[0] == 'r');
    }
    if (!strcmp(name, "lower") || !strcmp(name, "upper") || !strcmp(name, "capitalize") ||
        !strcmp(name, "title")) {
        max_args(r, at, name, nargs + nkw, 0);
        return jv_case(r, at, s, name[0] == 'l' ? 0 : name[0] == 'u' ? 1 : name[0] == 'c' ? 2 : 3);
    }
    if (!strcmp(name, "replace")) {
        jv old = need_str(r, at, a0, "replace"),
           nw = need_str(r, at, nargs > 1 ? args[1] : jv_none(), "replace");
        jv cnt = nargs > 2 ? args[2] : jv_int(-1);
        return replace(r, s, old, nw, need_int(r, at, cnt, "replace count"));
    }
    if (!strcmp(name, "find") || !strcmp(name, "rfind") || !strcmp(name, "count")) {
        max_args(r, at, name, nargs, 1);
        need_str(r, at, a0, name);
        if (name[0] == 'c') {
            if (!a0.s.n)
                return jv_int((int64_t)utf8_count(s.s.p, s.s.n) + 1);
            int64_t c = 0;
            for (ptrdiff_t p = find_sub(s, a0, 0); p >= 0; p = find_sub(s, a0, (size_t)p + a0.s.n))
                c++;
            return jv_int(c);
        }
        ptrdiff_t p = name[0] == 'f' ? find_sub(s, a0, 0) : rfind_sub(s, a0, s.s.n);
        return jv_int(p < 0 ? -1 : (int64_t)utf8_count(s.s.p, (size_t)p));
    }
    if (!strcmp(name, "join")) {
        jv items = to_list(r, at, a0);
        jbuf b = {0};
        for (size_t i = 0; i < items.l->n; i++) {
            if (i)
                jb_put(r, &b, s.s.p, s.s.n);
            jb_put(r, &b, need_str(r, at, items.l->v[i], "join").s.p, items.l->v[i].s.n);
        }
        return jv_str(b.p ? b.p : "", b.n);
    }
    if (!strcmp(name, "splitlines")) {
        jv out = jv_newlist(r);
        size_t i = 0;
        while (i < s.s.n) {
            size_t j = i;
            while (j < s.s.n && s.s.p[j] != '\n' && s.s.p[j] != '\r')
                j++;
            jl_push(r, out.l, jv_str(s.s.p + i, j - i));
            if (j < s.s.n && s.s.p[j] == '\r' && j + 1 < s.s.n && s.s.p[j + 1] == '\n')
                j++;
            i = j + 1;
        }
        return out;
    }
    if (!strcmp(name, "isdigit") || !strcmp(name, "isalpha") || !strcmp(name, "isspace")) {
        if (!s.s.n)
            return jv_bool(false);
        for (size_t i = 0; i < s.s.n; i++) {
            char c = s.s.p[i];
            bool ok = name[2] == 'd'   ? (c >= '0' && c <= '9')
                      : name[2] == 'a' ? ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
                                       : (c == ' ' || (c >= 9 && c <= 13));
            if (!ok)
                return jv_bool(false);
        }
        return jv_bool(true);
    }
    jr_fail(r, at, LOOM_ERR_UNSUPPORTED,
            "unsupported string method '%s' (loom's Jinja interpreter lacks it)", name);
}

jv jlib_method(jr *r, const jnode *at, jv obj, const char *name, jv *args, int nargs,
               const char **kwn, jv *kwv, int nkw) {
    if (obj.t == JV_STR)
        return str_method(r, at, obj, name, args, nargs, kwn, kwv, nkw);
    if (obj.t == JV_DICT) {
        if (!strcmp(name, "get")) {
            if (nargs < 1 || nargs > 2)
                jr_fail(r, at, LOOM_ERR_FORMAT, "get expected 1 or 2 arguments, got %d", nargs);
            const jv *v = jd_get(obj.d, args[0]);
            return v ? *v : nargs > 1 ? args[1] : jv_none();
        }
        if (!strcmp(name, "items"))
            return items_of(r, at, obj);
        if (!strcmp(name, "keys") || !strcmp(name, "values")) {
            jv l = jv_newlist(r);
            for (size_t i = 0; i < obj.d->n; i++)
                jl_push(r, l.l, name[0] == 'k' ? obj.d->k[i] : obj.d->v[i]);
            return l;
        }
        /* a dict entry holding a macro: obj.name(...) */
        const jv *v = jd_gets(obj.d, name);
        if (v && v->t == JV_MACRO)
            return jr_call_macro(r, NULL, at, *v, args, nargs, kwn, kwv, nkw);
    }
    if (obj.t == JV_LIST && (!strcmp(name, "index") || !strcmp(name, "count"))) {
        if (nargs != 1)
            jr_fail(r, at, LOOM_ERR_FORMAT, "%s expected 1 argument", name);
        int64_t c = 0;
        for (size_t i = 0; i < obj.l->n; i++)
            if (jv_eq(obj.l->v[i], args[0])) {
                if (name[0] == 'i')
                    return jv_int((int64_t)i);
                c++;
            }
        if (name[0] == 'i')
            jr_fail(r, at, LOOM_ERR_FORMAT, "list.index(x): x not in list");
        return jv_int(c);
    }
    static const char *const MUTATE[] = {"append",  "extend", "insert",  "pop",
                                         "remove",  "clear",  "update",  "setdefault",
                                         "popitem", "sort",   "reverse", NULL};
    if (find_name(MUTATE, name) >= 0)
        jr_fail(r, at, LOOM_ERR_UNSUPPORTED,
                "'%s.%s' modifies its object, which transformers' sandboxed Jinja refuses too",
                jv_typename(obj), name);
    jr_fail(r, at, LOOM_ERR_UNSUPPORTED,
            "unsupported method '%s' on %s (loom's Jinja interpreter lacks it)", name,
            jv_typename(obj));
}

/* ---------------------------------------------------------------------- */
/* Globals                                                                 */
/* ---------------------------------------------------------------------- */

jv jlib_global(jr *r, const jnode *at, int fn, jv *args, int nargs, const char **kwn, jv *kwv,
               int nkw) {
    switch (fn) {
    case FN_RANGE: {
        if (nargs < 1 || nargs > 3 || nkw)
            jr_fail(r, at, LOOM_ERR_FORMAT, "range expected 1 to 3 integer arguments");
        int64_t a = 0, b, s = 1;
        if (nargs == 1)
            b = need_int(r, at, args[0], "range");
        else
            a = need_int(r, at, args[0], "range"), b = need_int(r, at, args[1], "range");
        if (nargs == 3)
            s = need_int(r, at, args[2], "range");
        if (!s)
            jr_fail(r, at, LOOM_ERR_FORMAT, "range() arg 3 must not be zero");
        jv l = jv_newlist(r);
        for (int64_t i = a; s > 0 ? i < b : i > b; i += s) {
            if (l.l->n >= 100000)
                jr_fail(r, at, LOOM_ERR_FORMAT,
                        "range too big (over 100000 items, jinja2's sandbox limit)");
            jl_push(r, l.l, jv_int(i));
        }
        return l;
    }
    case FN_NAMESPACE:
    case FN_DICT: {
        jv d = jv_newdict(r, fn == FN_NAMESPACE ? JV_NS : JV_DICT);
        for (int i = 0; i < nargs; i++) {
            if (args[i].t != JV_DICT)
                jr_fail(r, at, LOOM_ERR_FORMAT, "%s: positional arguments must be mappings",
                        fn == FN_DICT ? "dict" : "namespace");
            for (size_t k = 0; k < args[i].d->n; k++)
                jd_set(r, d.d, args[i].d->k[k], args[i].d->v[k]);
        }
        for (int i = 0; i < nkw; i++)
            jd_set(r, d.d, jv_cstr(kwn[i]), kwv[i]);
        return d;
    }
    case FN_RAISE: {
        jv m = jv_to_str(r, nargs ? args[0] : jv_str("", 0));
        jr_fail(r, at, LOOM_ERR_INVALID_ARG, "the template refused the input: %.*s", (int)m.s.n,
                m.s.p);
    }
    case FN_STRFTIME: {
        if (nargs != 1 || args[0].t != JV_STR)
            jr_fail(r, at, LOOM_ERR_FORMAT, "strftime_now expects one format string");
        char *fmt = ja_strndup(&r->arena, args[0].s.p, args[0].s.n), buf[256];
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        size_t n = strftime(buf, sizeof buf, fmt, &tmv);
        return jv_str(ja_strndup(&r->arena, buf, n), n);
    }
    }
    jr_fail(r, at, LOOM_ERR_INTERNAL, "jinja: unknown global function");
}
