/* Jinja templates: the evaluator (expressions, statements, scopes as jinja2
 * has them: a for loop's body gets a fresh scope each iteration, if does not
 * open one, a macro runs in a scope under the one it was defined in) and
 * loom_jinja_render. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "jinja_impl.h"

_Noreturn void jr_fail(jr *r, const jnode *at, loom_status st, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at)
        loom_errf(r->ctx, st, "%s:%d:%d: %s", r->t->what, at->line, at->col, msg);
    else
        loom_errf(r->ctx, st, "%s: %s", r->t->what, msg);
    longjmp(r->jb, 1);
}

static jframe *new_frame(jr *r, jframe *parent) {
    jframe *f = ja_alloc(&r->arena, sizeof *f);
    f->parent = parent;
    return f;
}

static jv lookup(jr *r, jframe *f, const char *name) {
    for (; f; f = f->parent) {
        const jv *v = jd_gets(&f->vars, name);
        if (v)
            return *v;
    }
    int fn;
    if (jlib_has_global(name, &fn))
        return (jv){.t = JV_FUNC, .fn = fn};
    size_t n = strlen(name) + 32;
    char *msg = ja_alloc(&r->arena, n);
    snprintf(msg, n, "'%s' is undefined", name);
    return jv_undef(msg);
}

static void set_var(jr *r, jframe *f, const char *name, jv v) {
    jd_set(r, &f->vars, jv_cstr(name), v);
}

_Noreturn static void fail_undef(jr *r, const jnode *at, jv u) {
    jr_fail(r, at, LOOM_ERR_FORMAT, "%s", u.name ? u.name : "value is undefined");
}

/* ---------------------------------------------------------------------- */
/* Arithmetic                                                              */
/* ---------------------------------------------------------------------- */

static bool numeric(jv v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double as_d(jv v) { return v.t == JV_FLOAT ? v.f : v.t == JV_INT ? (double)v.i : v.b; }
/* a float's as_i is never used (binop reads it only when both are ints or
 * bools), but reading the union's bool there would be undefined */
static int64_t as_i(jv v) { return v.t == JV_INT ? v.i : v.t == JV_BOOL ? (int64_t)v.b : 0; }

static const char *OPNAME[] = {"+", "-", "*", "/", "//", "%", "**", "~"};

static jv repeat(jr *r, const jnode *at, jv seq, int64_t k) {
    if (k < 0)
        k = 0;
    if (seq.t == JV_STR) {
        if (seq.s.n && (uint64_t)k > (1u << 26) / seq.s.n)
            jr_fail(r, at, LOOM_ERR_FORMAT, "string repetition too large");
        jbuf b = {0};
        for (int64_t i = 0; i < k; i++)
            jb_put(r, &b, seq.s.p, seq.s.n);
        return jv_str(b.p ? b.p : "", b.n);
    }
    if (seq.l->n && (uint64_t)k > (1u << 22) / seq.l->n)
        jr_fail(r, at, LOOM_ERR_FORMAT, "list repetition too large");
    jv l = jv_newlist(r);
    for (int64_t i = 0; i < k; i++)
        for (size_t j = 0; j < seq.l->n; j++)
            jl_push(r, l.l, seq.l->v[j]);
    return l;
}

static jv binop(jr *r, const jnode *at, int op, jv a, jv b) {
    if (op == OP_CAT) {
        jbuf s = {0};
        jv_write_str(r, &s, a, false);
        jv_write_str(r, &s, b, false);
        return jv_str(s.p ? s.p : "", s.n);
    }
    if (a.t == JV_UNDEF)
        fail_undef(r, at, a);
    if (b.t == JV_UNDEF)
        fail_undef(r, at, b);
    if (numeric(a) && numeric(b)) {
        bool ints = a.t != JV_FLOAT && b.t != JV_FLOAT;
        int64_t x = as_i(a), y = as_i(b), z;
        double p = as_d(a), q = as_d(b);
        switch (op) {
        case OP_ADD:
            if (ints && !__builtin_add_overflow(x, y, &z))
                return jv_int(z);
            if (ints)
                break;
            return jv_float(p + q);
        case OP_SUB:
            if (ints && !__builtin_sub_overflow(x, y, &z))
                return jv_int(z);
            if (ints)
                break;
            return jv_float(p - q);
        case OP_MUL:
            if (ints && !__builtin_mul_overflow(x, y, &z))
                return jv_int(z);
            if (ints)
                break;
            return jv_float(p * q);
        case OP_DIV:
            if (q == 0)
                jr_fail(r, at, LOOM_ERR_FORMAT, "division by zero");
            return jv_float(p / q);
        case OP_FDIV:
        case OP_MOD:
            if (q == 0)
                jr_fail(r, at, LOOM_ERR_FORMAT, "integer division or modulo by zero");
            if (ints) {
                if (x == INT64_MIN && y == -1)
                    break;
                int64_t d = x / y, m = x % y;
                if (m && ((m < 0) != (y < 0)))
                    d--, m += y;
                return jv_int(op == OP_FDIV ? d : m);
            } else {
                double d = floor(p / q), m = fmod(p, q);
                if (m && ((m < 0) != (q < 0)))
                    m += q;
                return jv_float(op == OP_FDIV ? d : m);
            }
        case OP_POW:
            if (ints && y >= 0) {
                int64_t acc = 1;
                for (int64_t k = 0; k < y; k++)
                    if (__builtin_mul_overflow(acc, x, &acc))
                        jr_fail(r, at, LOOM_ERR_FORMAT, "integer power too large");
                return jv_int(acc);
            }
            return jv_float(pow(p, q));
        }
        jr_fail(r, at, LOOM_ERR_FORMAT,
                "integer overflow in '%s' (loom's Jinja integers are 64-bit)", OPNAME[op]);
    }
    if (op == OP_ADD && a.t == JV_STR && b.t == JV_STR) {
        char *p = ja_alloc(&r->arena, a.s.n + b.s.n + 1);
        memcpy(p, a.s.p, a.s.n);
        memcpy(p + a.s.n, b.s.p, b.s.n);
        return jv_str(p, a.s.n + b.s.n);
    }
    if (op == OP_ADD && a.t == JV_LIST && b.t == JV_LIST && a.tuple == b.tuple) {
        jv l = jv_newlist(r);
        l.tuple = a.tuple;
        for (size_t i = 0; i < a.l->n; i++)
            jl_push(r, l.l, a.l->v[i]);
        for (size_t i = 0; i < b.l->n; i++)
            jl_push(r, l.l, b.l->v[i]);
        return l;
    }
    if (op == OP_MUL && (a.t == JV_STR || a.t == JV_LIST) && (b.t == JV_INT || b.t == JV_BOOL))
        return repeat(r, at, a, as_i(b));
    if (op == OP_MUL && (b.t == JV_STR || b.t == JV_LIST) && (a.t == JV_INT || a.t == JV_BOOL))
        return repeat(r, at, b, as_i(a));
    if (op == OP_MOD && a.t == JV_STR)
        jr_fail(r, at, LOOM_ERR_UNSUPPORTED,
                "unsupported construct: printf-style string formatting ('%%')");
    jr_fail(r, at, LOOM_ERR_FORMAT, "unsupported operand type(s) for %s: '%s' and '%s'", OPNAME[op],
            jv_typename(a), jv_typename(b));
}

static bool contains(jr *r, const jnode *at, jv item, jv seq) {
    switch (seq.t) {
    case JV_UNDEF:
        return false;
    case JV_STR:
        if (item.t != JV_STR)
            jr_fail(r, at, LOOM_ERR_FORMAT, "'in <string>' requires string as left operand, not %s",
                    jv_typename(item));
        if (!item.s.n)
            return true;
        for (size_t i = 0; i + item.s.n <= seq.s.n; i++)
            if (memcmp(seq.s.p + i, item.s.p, item.s.n) == 0)
                return true;
        return false;
    case JV_LIST:
        for (size_t i = 0; i < seq.l->n; i++)
            if (jv_eq(seq.l->v[i], item))
                return true;
        return false;
    case JV_DICT:
    case JV_NS:
        return jd_get(seq.d, item) != NULL;
    default:
        jr_fail(r, at, LOOM_ERR_FORMAT, "argument of type '%s' is not iterable", jv_typename(seq));
    }
}

static bool compare(jr *r, const jnode *at, int op, jv a, jv b) {
    switch (op) {
    case OP_EQ:
        return jv_eq(a, b);
    case OP_NE:
        return !jv_eq(a, b);
    case OP_IN:
        return contains(r, at, a, b);
    case OP_NOTIN:
        return !contains(r, at, a, b);
    case OP_LT:
        return jv_cmp(r, at, a, b) < 0;
    case OP_LE:
        return jv_cmp(r, at, a, b) <= 0;
    case OP_GT:
        return jv_cmp(r, at, a, b) > 0;
    default:
        return jv_cmp(r, at, a, b) >= 0;
    }
}

/* ---------------------------------------------------------------------- */
/* Expressions                                                             */
/* ---------------------------------------------------------------------- */

typedef struct args {
    jv *pos;
    int npos;
    const char **kwn;
    jv *kwv;
    int nkw;
} args;

static args eval_args(jr *r, jframe *f, const jnode *n) {
    args a = {0};
    a.npos = n->nkids, a.nkw = n->nkw, a.kwn = n->kwn;
    if (n->nkids)
        a.pos = ja_alloc(&r->arena, (size_t)n->nkids * sizeof *a.pos);
    if (n->nkw)
        a.kwv = ja_alloc(&r->arena, (size_t)n->nkw * sizeof *a.kwv);
    for (int i = 0; i < n->nkids; i++)
        a.pos[i] = jr_eval(r, f, n->kids[i]);
    for (int i = 0; i < n->nkw; i++)
        a.kwv[i] = jr_eval(r, f, n->kwv[i]);
    return a;
}

static jv eval_call(jr *r, jframe *f, const jnode *e) {
    const jnode *c = e->a;
    if (c->kind == K_ATTR) {
        jv obj = jr_eval(r, f, c->a);
        if (obj.t == JV_UNDEF)
            fail_undef(r, c, obj);
        if (obj.t == JV_STR || obj.t == JV_LIST || obj.t == JV_DICT) {
            args a = eval_args(r, f, e);
            return jlib_method(r, e, obj, c->name, a.pos, a.npos, a.kwn, a.kwv, a.nkw);
        }
    }
    jv fn = jr_eval(r, f, c);
    args a = eval_args(r, f, e);
    if (fn.t == JV_MACRO)
        return jr_call_macro(r, f, e, fn, a.pos, a.npos, a.kwn, a.kwv, a.nkw);
    if (fn.t == JV_FUNC)
        return jlib_global(r, e, fn.fn, a.pos, a.npos, a.kwn, a.kwv, a.nkw);
    if (fn.t == JV_UNDEF)
        fail_undef(r, c, fn);
    jr_fail(r, e, LOOM_ERR_FORMAT, "'%s' object is not callable", jv_typename(fn));
}

/* Bounds on one render: evaluation steps and memory (a template is an outside file). */
enum { MAX_STEPS = 50000000 };
#define MAX_ARENA ((size_t)1 << 30)

static void step(jr *r, const jnode *at) {
    if (++r->steps > MAX_STEPS)
        jr_fail(r, at, LOOM_ERR_FORMAT,
                "the template ran over %d evaluation steps (a runaway loop?)", MAX_STEPS);
}

jv jr_eval(jr *r, jframe *f, const jnode *e) {
    step(r, e);
    switch (e->kind) {
    case K_LIT:
        return e->lit;
    case K_NAME:
        return lookup(r, f, e->name);
    case K_LIST:
    case K_TUPLE: {
        jv l = jv_newlist(r);
        l.tuple = e->kind == K_TUPLE;
        for (int i = 0; i < e->nkids; i++)
            jl_push(r, l.l, jr_eval(r, f, e->kids[i]));
        return l;
    }
    case K_DICT: {
        jv d = jv_newdict(r, JV_DICT);
        for (int i = 0; i < e->nkids; i++)
            jd_set(r, d.d, jr_eval(r, f, e->kids[i]), jr_eval(r, f, e->kwv[i]));
        return d;
    }
    case K_ATTR: {
        jv obj = jr_eval(r, f, e->a);
        if (obj.t == JV_UNDEF)
            fail_undef(r, e, obj);
        return jlib_getattr(r, e, obj, e->name);
    }
    case K_ITEM: {
        jv obj = jr_eval(r, f, e->a);
        if (obj.t == JV_UNDEF)
            fail_undef(r, e, obj);
        return jlib_getitem(r, e, obj, jr_eval(r, f, e->b));
    }
    case K_SLICE: {
        jv obj = jr_eval(r, f, e->a);
        if (obj.t == JV_UNDEF)
            fail_undef(r, e, obj);
        jv s = e->b ? jr_eval(r, f, e->b) : jv_none(), t = e->c ? jr_eval(r, f, e->c) : jv_none(),
           st = e->d ? jr_eval(r, f, e->d) : jv_none();
        return jlib_slice(r, e, obj, s, t, st);
    }
    case K_CALL:
        return eval_call(r, f, e);
    case K_FILTER: {
        jv v = jr_eval(r, f, e->a);
        args a = eval_args(r, f, e);
        return jlib_filter(r, f, e, e->name, v, a.pos, a.npos, a.kwn, a.kwv, a.nkw);
    }
    case K_TEST: {
        jv v = jr_eval(r, f, e->a);
        args a = eval_args(r, f, e);
        return jv_bool(jlib_test(r, e, e->name, v, a.pos, a.npos) != (e->op != 0));
    }
    case K_BIN:
        return binop(r, e, e->op, jr_eval(r, f, e->a), jr_eval(r, f, e->b));
    case K_NEG:
    case K_POS: {
        jv v = jr_eval(r, f, e->a);
        if (v.t == JV_UNDEF)
            fail_undef(r, e, v);
        if (e->kind == K_POS && numeric(v))
            return v.t == JV_BOOL ? jv_int(v.b) : v;
        if (v.t == JV_FLOAT)
            return jv_float(-v.f);
        if ((v.t == JV_INT && v.i != INT64_MIN) || v.t == JV_BOOL)
            return jv_int(-as_i(v));
        jr_fail(r, e, LOOM_ERR_FORMAT, "bad operand type for unary %s: '%s'",
                e->kind == K_NEG ? "-" : "+", jv_typename(v));
    }
    case K_NOT:
        return jv_bool(!jv_truthy(jr_eval(r, f, e->a)));
    case K_AND: {
        jv a = jr_eval(r, f, e->a);
        return jv_truthy(a) ? jr_eval(r, f, e->b) : a;
    }
    case K_OR: {
        jv a = jr_eval(r, f, e->a);
        return jv_truthy(a) ? a : jr_eval(r, f, e->b);
    }
    case K_COND:
        if (jv_truthy(jr_eval(r, f, e->b)))
            return jr_eval(r, f, e->a);
        return e->c ? jr_eval(r, f, e->c)
                    : jv_undef("the inline if expression evaluated to false and no else section "
                               "was defined");
    case K_CMP: {
        jv a = jr_eval(r, f, e->kids[0]);
        for (int i = 1; i < e->nkids; i++) {
            jv b = jr_eval(r, f, e->kids[i]);
            if (!compare(r, e, e->ops[i - 1], a, b))
                return jv_bool(false);
            a = b;
        }
        return jv_bool(true);
    }
    default:
        jr_fail(r, e, LOOM_ERR_INTERNAL, "jinja: statement node in an expression");
    }
}

/* ---------------------------------------------------------------------- */
/* Statements                                                              */
/* ---------------------------------------------------------------------- */

static void exec_body(jr *r, jframe *f, const jnode *body);

jv jr_call_macro(jr *r, jframe *f, const jnode *at, jv m, jv *pos, int npos, const char **kwn,
                 jv *kwv, int nkw) {
    (void)f;
    const jnode *def = m.mac->def;
    if (npos > def->nnames)
        jr_fail(r, at, LOOM_ERR_FORMAT, "macro '%s' takes not more than %d argument(s)", def->name,
                def->nnames);
    if (++r->depth > 64)
        jr_fail(r, at, LOOM_ERR_FORMAT, "macro calls nested over 64 deep");
    jframe *mf = new_frame(r, m.mac->closure);
    for (int k = 0; k < def->nnames; k++) {
        jv v;
        bool have = false;
        if (k < npos)
            v = pos[k], have = true;
        for (int j = 0; j < nkw; j++)
            if (strcmp(kwn[j], def->names[k]) == 0) {
                if (have)
                    jr_fail(r, at, LOOM_ERR_FORMAT,
                            "macro '%s' got multiple values for argument '%s'", def->name, kwn[j]);
                v = kwv[j], have = true;
            }
        if (!have) {
            if (def->kwv[k])
                v = jr_eval(r, mf, def->kwv[k]);
            else {
                size_t n = strlen(def->names[k]) + 64;
                char *msg = ja_alloc(&r->arena, n);
                snprintf(msg, n, "parameter '%s' was not provided", def->names[k]);
                v = jv_undef(msg);
            }
        }
        set_var(r, mf, def->names[k], v);
    }
    for (int j = 0; j < nkw; j++) {
        bool known = false;
        for (int k = 0; k < def->nnames; k++)
            known |= strcmp(kwn[j], def->names[k]) == 0;
        if (!known)
            jr_fail(r, at, LOOM_ERR_FORMAT, "macro '%s' takes no keyword argument '%s'", def->name,
                    kwn[j]);
    }
    jbuf buf = {0}, *saved = r->out;
    r->out = &buf;
    exec_body(r, mf, def->b);
    r->out = saved;
    r->brk = 0;
    r->depth--;
    return jv_str(buf.p ? buf.p : "", buf.n);
}

static jv loop_object(jr *r, jlist *items, size_t i) {
    jv d = jv_newdict(r, JV_DICT);
    size_t n = items->n;
    jd_set(r, d.d, jv_cstr("index0"), jv_int((int64_t)i));
    jd_set(r, d.d, jv_cstr("index"), jv_int((int64_t)i + 1));
    jd_set(r, d.d, jv_cstr("revindex0"), jv_int((int64_t)(n - i - 1)));
    jd_set(r, d.d, jv_cstr("revindex"), jv_int((int64_t)(n - i)));
    jd_set(r, d.d, jv_cstr("first"), jv_bool(i == 0));
    jd_set(r, d.d, jv_cstr("last"), jv_bool(i + 1 == n));
    jd_set(r, d.d, jv_cstr("length"), jv_int((int64_t)n));
    jd_set(r, d.d, jv_cstr("depth"), jv_int(1));
    jd_set(r, d.d, jv_cstr("depth0"), jv_int(0));
    jd_set(r, d.d, jv_cstr("previtem"),
           i ? items->v[i - 1] : jv_undef("there is no previous item"));
    jd_set(r, d.d, jv_cstr("nextitem"),
           i + 1 < n ? items->v[i + 1] : jv_undef("there is no next item"));
    return d;
}

/* The items a for loop walks: list items, dict keys, string characters. */
static jlist *iter_items(jr *r, const jnode *at, jv v) {
    jlist *l = ja_alloc(&r->arena, sizeof *l);
    switch (v.t) {
    case JV_UNDEF:
        return l;
    case JV_LIST:
        return v.l;
    case JV_DICT:
        for (size_t i = 0; i < v.d->n; i++)
            jl_push(r, l, v.d->k[i]);
        return l;
    case JV_STR:
        for (size_t i = 0; i < v.s.n;) {
            size_t j = i + 1;
            while (j < v.s.n && ((unsigned char)v.s.p[j] & 0xC0) == 0x80)
                j++;
            jl_push(r, l, jv_str(v.s.p + i, j - i));
            i = j;
        }
        return l;
    default:
        jr_fail(r, at, LOOM_ERR_FORMAT, "'%s' object is not iterable", jv_typename(v));
    }
}

static void bind_targets(jr *r, jframe *f, const jnode *n, jv item) {
    if (n->nnames == 1)
        return set_var(r, f, n->names[0], item);
    if (item.t != JV_LIST || item.l->n != (size_t)n->nnames) {
        if (item.t == JV_LIST || item.t == JV_STR)
            jr_fail(r, n, LOOM_ERR_FORMAT, "cannot unpack %zu value(s) into %d loop variables",
                    item.t == JV_LIST ? item.l->n : utf8_count(item.s.p, item.s.n), n->nnames);
        jr_fail(r, n, LOOM_ERR_FORMAT, "cannot unpack non-iterable %s object", jv_typename(item));
    }
    for (int k = 0; k < n->nnames; k++)
        set_var(r, f, n->names[k], item.l->v[k]);
}

static void exec_for(jr *r, jframe *f, const jnode *n) {
    jlist *all = iter_items(r, n, jr_eval(r, f, n->a)), *items = all;
    if (n->d) {
        items = ja_alloc(&r->arena, sizeof *items);
        for (size_t i = 0; i < all->n; i++) {
            jframe *cf = new_frame(r, f);
            bind_targets(r, cf, n, all->v[i]);
            if (jv_truthy(jr_eval(r, cf, n->d)))
                jl_push(r, items, all->v[i]);
        }
    }
    if (!items->n) {
        if (n->c)
            exec_body(r, f, n->c);
        return;
    }
    for (size_t i = 0; i < items->n; i++) {
        jframe *it = new_frame(r, f);
        bind_targets(r, it, n, items->v[i]);
        set_var(r, it, "loop", loop_object(r, items, i));
        exec_body(r, it, n->b);
        int brk = r->brk;
        r->brk = 0;
        if (brk == 1)
            break;
    }
}

static void exec_stmt(jr *r, jframe *f, const jnode *n) {
    step(r, n);
    switch (n->kind) {
    case K_DATA:
        return jb_put(r, r->out, n->text, n->len);
    case K_OUT:
        return jv_write_str(r, r->out, jr_eval(r, f, n->a), false);
    case K_IF:
        for (; n && n->kind == K_IF; n = n->c) {
            if (jv_truthy(jr_eval(r, f, n->a)))
                return exec_body(r, f, n->b);
            if (n->c && n->c->kind == K_BODY)
                return exec_body(r, f, n->c);
        }
        return;
    case K_FOR:
        return exec_for(r, f, n);
    case K_SET: {
        jv v = jr_eval(r, f, n->a);
        if (!n->nnames)
            return set_var(r, f, n->name, v);
        jv ns = lookup(r, f, n->name);
        if (ns.t != JV_NS)
            jr_fail(r, n, LOOM_ERR_FORMAT,
                    "cannot assign attribute on non-namespace object ('%s' is %s)", n->name,
                    ns.t == JV_UNDEF ? "undefined" : jv_typename(ns));
        return jd_set(r, ns.d, jv_cstr(n->names[0]), v);
    }
    case K_SETBLOCK: {
        jbuf buf = {0}, *saved = r->out;
        r->out = &buf;
        exec_body(r, f, n->b);
        r->out = saved;
        return set_var(r, f, n->name, jv_str(buf.p ? buf.p : "", buf.n));
    }
    case K_MACRO: {
        jv m = {.t = JV_MACRO};
        m.mac = ja_alloc(&r->arena, sizeof *m.mac);
        m.mac->def = n, m.mac->closure = f;
        return set_var(r, f, n->name, m);
    }
    case K_GEN: {
        bool top = r->out == &r->main;
        size_t start = r->main.n;
        exec_body(r, f, n->b);
        if (!top)
            return;
        r->spans = ja_grow(&r->arena, r->spans, r->nspans, &r->capspans, sizeof *r->spans);
        r->spans[r->nspans++] = (loom_jinja_span){start, r->main.n};
        return;
    }
    case K_BREAK:
        r->brk = 1;
        return;
    case K_CONTINUE:
        r->brk = 2;
        return;
    case K_BODY:
        return exec_body(r, f, n);
    default:
        jr_fail(r, n, LOOM_ERR_INTERNAL, "jinja: expression node as a statement");
    }
}

static void exec_body(jr *r, jframe *f, const jnode *body) {
    if (++r->depth > 256)
        jr_fail(r, body, LOOM_ERR_FORMAT, "template nested over 256 deep");
    for (int i = 0; i < body->nkids && !r->brk; i++)
        exec_stmt(r, f, body->kids[i]);
    r->depth--;
}

loom_status loom_jinja_render(loom_ctx *ctx, const loom_jinja *t, const loom_json *vars,
                              char **text, size_t *len, loom_jinja_span **spans, size_t *nspans) {
    *text = NULL;
    if (len)
        *len = 0;
    if (spans)
        *spans = NULL;
    if (nspans)
        *nspans = 0;
    if (vars && vars->type != LOOM_JSON_OBJECT)
        return loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                         "%s: the variables must be a JSON object, got %s", t->what,
                         loom_json_type_name(vars->type));
    jr *r = calloc(1, sizeof *r);
    if (!r)
        return loom_errf(ctx, LOOM_ERR_OOM, "jinja: out of memory");
    r->ctx = ctx, r->t = t;
    r->arena.ctx = ctx, r->arena.jb = &r->jb, r->arena.limit = MAX_ARENA;
    r->out = &r->main;
    if (setjmp(r->jb)) {
        loom_status st = ctx && ctx->status != LOOM_OK ? ctx->status : LOOM_ERR_FORMAT;
        ja_free(&r->arena);
        free(r);
        return st;
    }
    jframe *root = new_frame(r, NULL);
    for (size_t i = 0; vars && i < vars->n; i++)
        set_var(r, root, vars->keys[i], jv_from_json(r, vars->items[i]));
    exec_body(r, root, t->root);
    char *out = malloc(r->main.n + 1);
    loom_jinja_span *sp = NULL;
    if (spans && r->nspans)
        sp = malloc(r->nspans * sizeof *sp);
    if (!out || (spans && r->nspans && !sp)) {
        free(out);
        free(sp);
        ja_free(&r->arena);
        free(r);
        return loom_errf(ctx, LOOM_ERR_OOM, "jinja: out of memory for the rendered text");
    }
    if (r->main.n)
        memcpy(out, r->main.p, r->main.n);
    out[r->main.n] = 0;
    if (sp)
        memcpy(sp, r->spans, r->nspans * sizeof *sp);
    *text = out;
    if (len)
        *len = r->main.n;
    if (spans)
        *spans = sp;
    if (nspans)
        *nspans = r->nspans;
    ja_free(&r->arena);
    free(r);
    return LOOM_OK;
}
