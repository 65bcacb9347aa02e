/* Jinja templates: the parser from tokens (jinja_lex.c) to the AST of
 * jinja_impl.h, with jinja2's grammar and operator precedence; constructs the
 * interpreter lacks are refused here, with their line and column. */
#include <stdlib.h>
#include <string.h>

#include "jinja_impl.h"

/* ---------------------------------------------------------------------- */
/* Parser                                                                  */
/* ---------------------------------------------------------------------- */

static tok *peek(jp *P) { return &P->toks[P->pos]; }
static tok *peek2(jp *P) { return &P->toks[P->pos + (P->toks[P->pos].kind != T_EOF)]; }
static tok *next(jp *P) {
    tok *t = &P->toks[P->pos];
    if (t->kind != T_EOF)
        P->pos++;
    return t;
}
static bool is_op(const tok *t, const char *op) {
    return t->kind == T_OP && t->n == strlen(op) && memcmp(t->p, op, t->n) == 0;
}
static bool is_name(const tok *t, const char *name) {
    return t->kind == T_NAME && t->n == strlen(name) && memcmp(t->p, name, t->n) == 0;
}
static bool accept_op(jp *P, const char *op) {
    if (!is_op(peek(P), op))
        return false;
    next(P);
    return true;
}
static bool accept_name(jp *P, const char *name) {
    if (!is_name(peek(P), name))
        return false;
    next(P);
    return true;
}

static const char *tok_desc(jp *P, const tok *t) {
    switch (t->kind) {
    case T_EOF:
        return "end of template";
    case T_END:
        return "end of tag";
    case T_DATA:
        return "template text";
    case T_VAR:
        return "'{{'";
    case T_BLOCK:
        return "'{%'";
    case T_STR:
        return "string literal";
    case T_INT:
    case T_FLOAT:
        return "number";
    default: {
        char *s = ja_alloc(P->a, t->n + 3);
        s[0] = '\'';
        memcpy(s + 1, t->p, t->n);
        s[t->n + 1] = '\'';
        return s;
    }
    }
}

_Noreturn static void perr_tok(jp *P, const tok *t, const char *expected) {
    jx_perr_at(P, t->line, t->col, LOOM_ERR_FORMAT, "expected %s, got %s", expected,
               tok_desc(P, t));
}

static void expect_op(jp *P, const char *op) {
    if (!accept_op(P, op)) {
        char e[16];
        snprintf(e, sizeof e, "'%s'", op);
        perr_tok(P, peek(P), e);
    }
}
static const char *expect_ident(jp *P) {
    tok *t = peek(P);
    if (t->kind != T_NAME)
        perr_tok(P, t, "a name");
    next(P);
    return ja_strndup(P->a, t->p, t->n);
}
static void expect_end(jp *P) {
    if (peek(P)->kind != T_END)
        perr_tok(P, peek(P), "end of tag ('%}' or '}}')");
    next(P);
}

static jnode *mk(jp *P, jk kind, const tok *at) {
    jnode *n = ja_alloc(P->a, sizeof *n);
    n->kind = kind;
    n->line = at->line, n->col = at->col;
    return n;
}

typedef struct nvec {
    jnode **v;
    size_t n, cap;
} nvec;
static void nv_push(jp *P, nvec *v, jnode *x) {
    v->v = ja_grow(P->a, v->v, v->n, &v->cap, sizeof *v->v);
    v->v[v->n++] = x;
}

static jnode *p_expr(jp *P);
static jnode *p_or(jp *P);
static jnode *p_unary(jp *P, bool with_filter);

static void enter(jp *P, const tok *t) {
    if (++P->depth > 200)
        jx_perr_at(P, t->line, t->col, LOOM_ERR_FORMAT,
                   "expression nested too deeply (over 200 levels)");
}

/* (args) of a call, filter or test: positional then keyword arguments. */
static void p_args(jp *P, jnode *n) {
    nvec pos = {0}, kv = {0};
    const char **names = NULL;
    size_t ncap = 0;
    while (!is_op(peek(P), ")")) {
        if (pos.n + kv.n && !accept_op(P, ","))
            perr_tok(P, peek(P), "',' or ')'");
        if (is_op(peek(P), ")"))
            break;
        if (is_op(peek(P), "*") || is_op(peek(P), "**"))
            jx_perr_at(P, peek(P)->line, peek(P)->col, LOOM_ERR_UNSUPPORTED,
                       "unsupported construct '*args' / '**kwargs' in a call");
        if (peek(P)->kind == T_NAME && is_op(peek2(P), "=")) {
            const char *k = expect_ident(P);
            next(P);
            names = ja_grow(P->a, (void *)names, kv.n, &ncap, sizeof *names);
            names[kv.n] = k;
            nv_push(P, &kv, p_expr(P));
        } else {
            if (kv.n)
                perr_tok(P, peek(P), "a keyword argument (positional after keyword)");
            nv_push(P, &pos, p_expr(P));
        }
    }
    next(P);
    n->kids = pos.v, n->nkids = pos.n;
    n->kwv = kv.v, n->kwn = names, n->nkw = kv.n;
}

/* In a comma-separated list closed by `close` (n items so far): whether
 * another item follows; the closing token is consumed when not. A trailing
 * comma is allowed. */
static bool more_items(jp *P, size_t n, const char *close) {
    if (n && !is_op(peek(P), close) && !accept_op(P, ",")) {
        char want[16];
        snprintf(want, sizeof want, "',' or '%s'", close);
        perr_tok(P, peek(P), want);
    }
    if (accept_op(P, close))
        return false;
    return true;
}

static jnode *p_primary(jp *P) {
    tok *t = peek(P);
    enter(P, t);
    jnode *n;
    if (t->kind == T_NAME) {
        next(P);
        n = mk(P, K_LIT, t);
        if (is_name(t, "true") || is_name(t, "True"))
            n->lit = jv_bool(true);
        else if (is_name(t, "false") || is_name(t, "False"))
            n->lit = jv_bool(false);
        else if (is_name(t, "none") || is_name(t, "None"))
            n->lit = jv_none();
        else {
            n->kind = K_NAME;
            n->name = ja_strndup(P->a, t->p, t->n);
        }
    } else if (t->kind == T_STR) {
        next(P);
        /* adjacent literals concatenate */
        size_t total = t->n;
        size_t first = P->pos - 1;
        while (peek(P)->kind == T_STR)
            total += next(P)->n;
        char *s = ja_alloc(P->a, total + 1);
        size_t o = 0;
        for (size_t k = first; k < P->pos; k++)
            memcpy(s + o, P->toks[k].p, P->toks[k].n), o += P->toks[k].n;
        n = mk(P, K_LIT, t);
        n->lit = jv_str(s, total);
    } else if (t->kind == T_INT || t->kind == T_FLOAT) {
        next(P);
        n = mk(P, K_LIT, t);
        n->lit = t->kind == T_INT ? jv_int(t->i) : jv_float(t->f);
    } else if (is_op(t, "(")) {
        next(P);
        if (accept_op(P, ")")) {
            n = mk(P, K_TUPLE, t);
        } else {
            jnode *e = p_expr(P);
            if (is_op(peek(P), ",")) {
                nvec v = {0};
                nv_push(P, &v, e);
                while (accept_op(P, ",") && !is_op(peek(P), ")"))
                    nv_push(P, &v, p_expr(P));
                n = mk(P, K_TUPLE, t);
                n->kids = v.v, n->nkids = v.n;
            } else {
                n = e;
            }
            expect_op(P, ")");
        }
    } else if (is_op(t, "[")) {
        next(P);
        nvec v = {0};
        while (more_items(P, v.n, "]"))
            nv_push(P, &v, p_expr(P));
        n = mk(P, K_LIST, t);
        n->kids = v.v, n->nkids = v.n;
    } else if (is_op(t, "{")) {
        next(P);
        nvec k = {0}, v = {0};
        while (more_items(P, k.n, "}")) {
            nv_push(P, &k, p_expr(P));
            expect_op(P, ":");
            nv_push(P, &v, p_expr(P));
        }
        n = mk(P, K_DICT, t);
        n->kids = k.v, n->nkids = k.n, n->kwv = v.v, n->nkw = v.n;
    } else {
        perr_tok(P, t, "an expression");
    }
    /* postfix: .attr, [item], [slice], (call) */
    for (;;) {
        tok *o = peek(P);
        if (is_op(o, ".")) {
            next(P);
            tok *nt = peek(P);
            jnode *x = mk(P, K_ATTR, o);
            if (nt->kind == T_INT) {
                next(P);
                x->kind = K_ITEM;
                x->b = mk(P, K_LIT, nt);
                x->b->lit = jv_int(nt->i);
            } else {
                x->name = expect_ident(P);
            }
            x->a = n;
            n = x;
        } else if (is_op(o, "[")) {
            next(P);
            jnode *parts[3] = {NULL, NULL, NULL};
            int np = 0;
            bool slice = false;
            for (;;) {
                if (is_op(peek(P), ":")) {
                    next(P);
                    slice = true;
                    if (++np > 2)
                        perr_tok(P, peek(P), "']'");
                    continue;
                }
                if (is_op(peek(P), "]"))
                    break;
                if (parts[np])
                    perr_tok(P, peek(P), "':' or ']'");
                parts[np] = p_expr(P);
            }
            next(P);
            jnode *x = mk(P, slice ? K_SLICE : K_ITEM, o);
            x->a = n;
            if (slice)
                x->b = parts[0], x->c = parts[1], x->d = parts[2];
            else {
                if (!parts[0])
                    perr_tok(P, o, "a subscript");
                x->b = parts[0];
            }
            n = x;
        } else if (is_op(o, "(")) {
            next(P);
            jnode *x = mk(P, K_CALL, o);
            x->line = n->line, x->col = n->col;
            x->a = n;
            p_args(P, x);
            n = x;
        } else {
            break;
        }
    }
    P->depth--;
    return n;
}

/* filters and tests after a unary expression */
static jnode *p_filters(jp *P, jnode *n) {
    for (;;) {
        tok *t = peek(P);
        if (is_op(t, "|")) {
            next(P);
            tok *nt = peek(P);
            jnode *x = mk(P, K_FILTER, nt);
            x->name = expect_ident(P);
            while (accept_op(P, ".")) {
                const char *more = expect_ident(P);
                (void)more;
                jx_perr_at(P, nt->line, nt->col, LOOM_ERR_UNSUPPORTED,
                           "unsupported dotted filter name");
            }
            if (!jlib_has_filter(x->name))
                jx_perr_at(P, nt->line, nt->col, LOOM_ERR_UNSUPPORTED,
                           "unsupported filter '%s' (loom's Jinja interpreter lacks it)", x->name);
            x->a = n;
            if (accept_op(P, "("))
                p_args(P, x);
            n = x;
        } else if (is_name(t, "is")) {
            next(P);
            bool neg = accept_name(P, "not");
            tok *nt = peek(P);
            jnode *x = mk(P, K_TEST, nt);
            if (nt->kind == T_NAME)
                x->name = expect_ident(P);
            else if (is_name(nt, "none"))
                x->name = "none";
            else
                perr_tok(P, nt, "a test name");
            if (!jlib_has_test(x->name))
                jx_perr_at(P, nt->line, nt->col, LOOM_ERR_UNSUPPORTED,
                           "unsupported test '%s' (loom's Jinja interpreter lacks it)", x->name);
            x->a = n;
            x->op = neg;
            if (accept_op(P, "("))
                p_args(P, x);
            else {
                tok *a = peek(P);
                /* one argument without parentheses: `is divisibleby 3`, `is sameas none` */
                if (a->kind == T_STR || a->kind == T_INT || a->kind == T_FLOAT ||
                    (a->kind == T_NAME && !is_name(a, "and") && !is_name(a, "or") &&
                     !is_name(a, "else") && !is_name(a, "if") && !is_name(a, "in") &&
                     !is_name(a, "is") && !is_name(a, "not") && !is_name(a, "recursive"))) {
                    jnode *arg = p_unary(P, false);
                    x->kids = ja_alloc(P->a, sizeof *x->kids);
                    x->kids[0] = arg, x->nkids = 1;
                }
            }
            n = x;
        } else {
            return n;
        }
    }
}

static jnode *p_unary(jp *P, bool with_filter) {
    tok *t = peek(P);
    enter(P, t);
    jnode *n;
    if (is_op(t, "-") || is_op(t, "+")) {
        next(P);
        n = mk(P, is_op(t, "-") ? K_NEG : K_POS, t);
        n->a = p_unary(P, false);
    } else {
        n = p_primary(P);
    }
    if (with_filter)
        n = p_filters(P, n);
    P->depth--;
    return n;
}

/* The binary operators by level, loosest first: jinja2's parse_math1,
 * parse_concat, parse_math2 and parse_pow (all left-associative). */
static const struct {
    const char *tok;
    int op, level;
} BINOPS[] = {{"+", OP_ADD, 0}, {"-", OP_SUB, 0},   {"~", OP_CAT, 1}, {"*", OP_MUL, 2},
              {"/", OP_DIV, 2}, {"//", OP_FDIV, 2}, {"%", OP_MOD, 2}, {"**", OP_POW, 3}};

static jnode *p_binary(jp *P, int level) {
    if (level > 3)
        return p_unary(P, true);
    jnode *n = p_binary(P, level + 1);
    for (;;) {
        tok *t = peek(P);
        int op = -1;
        for (size_t k = 0; k < sizeof BINOPS / sizeof *BINOPS; k++)
            if (BINOPS[k].level == level && is_op(t, BINOPS[k].tok))
                op = BINOPS[k].op;
        if (op < 0)
            return n;
        next(P);
        jnode *x = mk(P, K_BIN, t);
        x->op = op, x->a = n, x->b = p_binary(P, level + 1);
        n = x;
    }
}
static jnode *p_math1(jp *P) { return p_binary(P, 0); }
static jnode *p_compare(jp *P) {
    tok *t0 = peek(P);
    jnode *first = p_math1(P);
    nvec v = {0};
    int ops[64], nops = 0;
    for (;;) {
        tok *t = peek(P);
        int op = is_op(t, "==")     ? OP_EQ
                 : is_op(t, "!=")   ? OP_NE
                 : is_op(t, "<")    ? OP_LT
                 : is_op(t, "<=")   ? OP_LE
                 : is_op(t, ">")    ? OP_GT
                 : is_op(t, ">=")   ? OP_GE
                 : is_name(t, "in") ? OP_IN
                                    : -1;
        if (op < 0 && is_name(t, "not") && is_name(peek2(P), "in")) {
            next(P);
            op = OP_NOTIN;
        }
        if (op < 0)
            break;
        next(P);
        if (nops == 63)
            perr_tok(P, t, "fewer chained comparisons");
        if (!v.n)
            nv_push(P, &v, first);
        ops[nops++] = op;
        nv_push(P, &v, p_math1(P));
    }
    if (!nops)
        return first;
    jnode *n = mk(P, K_CMP, t0);
    n->kids = v.v, n->nkids = v.n;
    n->ops = ja_alloc(P->a, (size_t)nops * sizeof *n->ops);
    memcpy(n->ops, ops, (size_t)nops * sizeof *ops);
    return n;
}
static jnode *p_not(jp *P) {
    tok *t = peek(P);
    if (is_name(t, "not")) {
        next(P);
        enter(P, t);
        jnode *n = mk(P, K_NOT, t);
        n->a = p_not(P);
        P->depth--;
        return n;
    }
    return p_compare(P);
}
/* `a and b` binds tighter than `a or b` */
static jnode *p_logic(jp *P, bool is_or) {
    jnode *n = is_or ? p_logic(P, false) : p_not(P);
    while (is_name(peek(P), is_or ? "or" : "and")) {
        tok *t = next(P);
        jnode *x = mk(P, is_or ? K_OR : K_AND, t);
        x->a = n, x->b = is_or ? p_logic(P, false) : p_not(P);
        n = x;
    }
    return n;
}
static jnode *p_or(jp *P) { return p_logic(P, true); }
/* condexpr: `a if cond else b` (else optional: undefined) */
static jnode *p_expr_nocond(jp *P) { return p_or(P); }
static jnode *p_expr(jp *P) {
    tok *t0 = peek(P);
    enter(P, t0);
    jnode *n = p_or(P);
    while (is_name(peek(P), "if")) {
        tok *t = next(P);
        jnode *x = mk(P, K_COND, t);
        x->a = n;
        x->b = p_or(P);
        if (accept_name(P, "else"))
            x->c = p_expr(P);
        n = x;
    }
    P->depth--;
    return n;
}
/* a tuple without parentheses where statements allow one ({% set a = 1, 2 %}) */
static jnode *p_tuple_expr(jp *P) {
    tok *t = peek(P);
    jnode *e = p_expr(P);
    if (!is_op(peek(P), ","))
        return e;
    nvec v = {0};
    nv_push(P, &v, e);
    while (accept_op(P, ",") && peek(P)->kind != T_END)
        nv_push(P, &v, p_expr(P));
    jnode *n = mk(P, K_TUPLE, t);
    n->kids = v.v, n->nkids = v.n;
    return n;
}

/* ---- statements ---- */

static jnode *p_body(jp *P, const char *const *ends, const char **which);

static const char *const END_IF[] = {"elif", "else", "endif", NULL};
static const char *const END_FOR[] = {"else", "endfor", NULL};

static void check_block_name(jp *P, const char *const *ends, const char *got, const tok *at) {
    if (ends)
        for (int k = 0; ends[k]; k++)
            if (strcmp(ends[k], got) == 0)
                return;
    jx_perr_at(P, at->line, at->col, LOOM_ERR_FORMAT, "unexpected '%s'%s%s", got,
               ends ? " (expected '" : "", ends ? ends[0] : "");
}

static jnode *p_if(jp *P, const tok *at) {
    jnode *n = mk(P, K_IF, at);
    n->a = p_or(P); /* jinja2: no `x if c else y` here without parentheses */
    expect_end(P);
    const char *which;
    n->b = p_body(P, END_IF, &which);
    if (strcmp(which, "elif") == 0) {
        n->c = p_if(P, at);
    } else if (strcmp(which, "else") == 0) {
        expect_end(P);
        static const char *const END_ONLY[] = {"endif", NULL};
        n->c = p_body(P, END_ONLY, &which);
        expect_end(P);
    } else {
        expect_end(P);
    }
    return n;
}

static jnode *p_for(jp *P, const tok *at) {
    jnode *n = mk(P, K_FOR, at);
    const char *names[8];
    int nn = 0;
    bool paren = accept_op(P, "(");
    do {
        if (nn == 8)
            perr_tok(P, peek(P), "at most 8 loop targets");
        names[nn++] = expect_ident(P);
    } while (accept_op(P, ","));
    if (paren)
        expect_op(P, ")");
    n->names = ja_alloc(P->a, (size_t)nn * sizeof *n->names);
    memcpy(n->names, names, (size_t)nn * sizeof *names);
    n->nnames = nn;
    if (!accept_name(P, "in"))
        perr_tok(P, peek(P), "'in'");
    n->a = p_expr_nocond(P);
    n->a = p_filters(P, n->a);
    if (accept_name(P, "if"))
        n->d = p_expr_nocond(P);
    if (is_name(peek(P), "recursive"))
        jx_perr_at(P, peek(P)->line, peek(P)->col, LOOM_ERR_UNSUPPORTED,
                   "unsupported construct 'for ... recursive' (loom's Jinja interpreter lacks it)");
    expect_end(P);
    const char *which;
    n->b = p_body(P, END_FOR, &which);
    expect_end(P);
    if (strcmp(which, "else") == 0) {
        static const char *const END_ONLY[] = {"endfor", NULL};
        n->c = p_body(P, END_ONLY, &which);
        expect_end(P);
    }
    return n;
}

static jnode *p_set(jp *P, const tok *at) {
    jnode *n = mk(P, K_SET, at);
    n->name = expect_ident(P);
    if (accept_op(P, ".")) {
        n->names = ja_alloc(P->a, sizeof *n->names);
        n->names[0] = expect_ident(P);
        n->nnames = 1;
    } else if (is_op(peek(P), ",")) {
        jx_perr_at(P, at->line, at->col, LOOM_ERR_UNSUPPORTED,
                   "unsupported construct 'set a, b = ...' (tuple assignment)");
    }
    if (peek(P)->kind == T_END && !n->nnames) {
        /* {% set x %}...{% endset %} */
        next(P);
        n->kind = K_SETBLOCK;
        static const char *const END_SET[] = {"endset", NULL};
        const char *which;
        n->b = p_body(P, END_SET, &which);
        expect_end(P);
        return n;
    }
    if (is_op(peek(P), "|"))
        jx_perr_at(P, at->line, at->col, LOOM_ERR_UNSUPPORTED,
                   "unsupported construct 'set x | filter' block");
    expect_op(P, "=");
    n->a = p_tuple_expr(P);
    expect_end(P);
    return n;
}

static jnode *p_macro(jp *P, const tok *at) {
    jnode *n = mk(P, K_MACRO, at);
    n->name = expect_ident(P);
    expect_op(P, "(");
    const char *names[32];
    jnode *defs[32];
    int np = 0;
    while (!is_op(peek(P), ")")) {
        if (np && !accept_op(P, ","))
            perr_tok(P, peek(P), "',' or ')'");
        if (is_op(peek(P), ")"))
            break;
        if (np == 32)
            perr_tok(P, peek(P), "at most 32 macro parameters");
        names[np] = expect_ident(P);
        defs[np] = accept_op(P, "=") ? p_expr(P) : NULL;
        if (!defs[np] && np && defs[np - 1])
            perr_tok(P, peek(P), "a default value (non-default parameter after default one)");
        np++;
    }
    next(P);
    expect_end(P);
    n->names = ja_alloc(P->a, (size_t)(np ? np : 1) * sizeof *n->names);
    n->kwv = ja_alloc(P->a, (size_t)(np ? np : 1) * sizeof *n->kwv);
    memcpy(n->names, names, (size_t)np * sizeof *names);
    memcpy(n->kwv, defs, (size_t)np * sizeof *defs);
    n->nnames = np;
    static const char *const END_MACRO[] = {"endmacro", NULL};
    const char *which;
    n->b = p_body(P, END_MACRO, &which);
    if (peek(P)->kind == T_NAME)
        next(P); /* {% endmacro name %} */
    expect_end(P);
    return n;
}

/* A statement after '{%' and its name token. */
static jnode *p_stmt(jp *P, const tok *at) {
    tok *nt = peek(P);
    if (nt->kind != T_NAME)
        perr_tok(P, nt, "a statement name");
    next(P);
    if (is_name(nt, "if"))
        return p_if(P, nt);
    if (is_name(nt, "for"))
        return p_for(P, nt);
    if (is_name(nt, "set"))
        return p_set(P, nt);
    if (is_name(nt, "macro"))
        return p_macro(P, nt);
    if (is_name(nt, "break") || is_name(nt, "continue")) {
        jnode *n = mk(P, is_name(nt, "break") ? K_BREAK : K_CONTINUE, nt);
        expect_end(P);
        return n;
    }
    if (is_name(nt, "generation")) {
        jnode *n = mk(P, K_GEN, nt);
        expect_end(P);
        static const char *const END_GEN[] = {"endgeneration", NULL};
        const char *which;
        n->b = p_body(P, END_GEN, &which);
        expect_end(P);
        return n;
    }
    (void)at;
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)(nt->n < 60 ? nt->n : 60), nt->p);
    static const char *const KNOWN[] = {"include", "import", "from", "extends",    "block",
                                        "call",    "filter", "with", "autoescape", "do",
                                        "trans",   "raw",    NULL};
    for (int k = 0; KNOWN[k]; k++)
        if (strcmp(KNOWN[k], name) == 0)
            jx_perr_at(P, nt->line, nt->col, LOOM_ERR_UNSUPPORTED,
                       "unsupported statement '%s' (loom's Jinja interpreter lacks it)", name);
    jx_perr_at(P, nt->line, nt->col, LOOM_ERR_FORMAT, "unknown statement '%s'", name);
}

static const char *last_of(const char *const *ends) {
    int k = 0;
    while (ends[k + 1])
        k++;
    return ends[k];
}

/* Statements up to one whose name is in `ends` (NULL: end of template); that
 * name is consumed (its tag's end is not) and returned in *which. */
static jnode *p_body(jp *P, const char *const *ends, const char **which) {
    tok *t0 = peek(P);
    enter(P, t0);
    jnode *body = mk(P, K_BODY, t0);
    nvec v = {0};
    for (;;) {
        tok *t = next(P);
        if (t->kind == T_EOF) {
            if (ends)
                jx_perr_at(P, t0->line, t0->col, LOOM_ERR_FORMAT,
                           "unexpected end of template: '{%% %s %%}' missing", last_of(ends));
            break;
        }
        if (t->kind == T_DATA) {
            jnode *n = mk(P, K_DATA, t);
            n->text = t->p, n->len = t->n;
            nv_push(P, &v, n);
        } else if (t->kind == T_VAR) {
            jnode *n = mk(P, K_OUT, t);
            n->a = p_expr(P);
            expect_end(P);
            nv_push(P, &v, n);
        } else if (t->kind == T_BLOCK) {
            tok *nt = peek(P);
            if (nt->kind == T_NAME) {
                bool is_end = false;
                if (ends)
                    for (int k = 0; ends[k]; k++)
                        if (is_name(nt, ends[k])) {
                            next(P);
                            *which = ends[k];
                            is_end = true;
                        }
                if (is_end)
                    break;
                static const char *const CLOSERS[] = {
                    "elif",          "else",    "endif",     "endfor",   "endset", "endmacro",
                    "endgeneration", "endcall", "endfilter", "endblock", NULL};
                for (int k = 0; CLOSERS[k]; k++)
                    if (is_name(nt, CLOSERS[k])) {
                        char got[32];
                        snprintf(got, sizeof got, "%s", CLOSERS[k]);
                        check_block_name(P, ends, got, nt);
                    }
            }
            nv_push(P, &v, p_stmt(P, t));
        } else {
            perr_tok(P, t, "template text or a tag");
        }
    }
    body->kids = v.v, body->nkids = v.n;
    P->depth--;
    return body;
}

/* ---- load-time checks of calls ---- */

typedef struct names {
    const char **v;
    size_t n, cap;
} names;

/* The macro and variable names a template defines (a call may target them). */
static void collect_defs(jp *P, const jnode *n, names *out) {
    if (!n)
        return;
    if ((n->kind == K_MACRO || n->kind == K_SET || n->kind == K_SETBLOCK) && n->name) {
        out->v = ja_grow(P->a, (void *)out->v, out->n, &out->cap, sizeof *out->v);
        out->v[out->n++] = n->name;
    }
    collect_defs(P, n->a, out), collect_defs(P, n->b, out);
    collect_defs(P, n->c, out), collect_defs(P, n->d, out);
    for (int i = 0; i < n->nkids; i++)
        collect_defs(P, n->kids[i], out);
    for (int i = 0; i < n->nkw; i++)
        collect_defs(P, n->kwv[i], out);
}

static bool defined_here(const names *d, const char *name) {
    for (size_t i = 0; i < d->n; i++)
        if (strcmp(d->v[i], name) == 0)
            return true;
    return false;
}

/* Refuses a call to a function or method the interpreter lacks, naming it. */
static void check_calls(jp *P, const jnode *n, const names *d) {
    if (!n)
        return;
    if (n->kind == K_CALL) {
        const jnode *c = n->a;
        int fn;
        if (c->kind == K_NAME && !jlib_has_global(c->name, &fn) && !defined_here(d, c->name))
            jx_perr_at(P, c->line, c->col, LOOM_ERR_UNSUPPORTED,
                       "unsupported function '%s' (not a macro of the template nor a global "
                       "loom's Jinja interpreter has: range, namespace, dict, raise_exception, "
                       "strftime_now)",
                       c->name);
        if (c->kind == K_ATTR && !jlib_has_method(c->name) && !defined_here(d, c->name))
            jx_perr_at(P, c->line, c->col, LOOM_ERR_UNSUPPORTED,
                       "unsupported method '%s' (loom's Jinja interpreter lacks it)", c->name);
    }
    check_calls(P, n->a, d), check_calls(P, n->b, d);
    check_calls(P, n->c, d), check_calls(P, n->d, d);
    for (int i = 0; i < n->nkids; i++)
        check_calls(P, n->kids[i], d);
    for (int i = 0; i < n->nkw; i++)
        check_calls(P, n->kwv[i], d);
}

/* Normalizes newlines (\r\n and \r to \n) and drops one trailing newline, as jinja2 does. */
static char *normalize(ja *a, const char *src, size_t len, size_t *out_len) {
    char *s = ja_alloc(a, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n')
        n--;
    s[n] = 0;
    *out_len = n;
    return s;
}

loom_status loom_jinja_parse(loom_ctx *ctx, const char *src, size_t len, const char *what,
                             loom_jinja **out) {
    *out = NULL;
    loom_jinja *t = calloc(1, sizeof *t);
    if (!t)
        return loom_errf(ctx, LOOM_ERR_OOM, "jinja: out of memory");
    jp P;
    memset(&P, 0, sizeof P);
    P.ctx = ctx;
    P.a = &t->arena;
    t->arena.ctx = ctx;
    t->arena.jb = &P.jb;
    if (setjmp(P.jb)) {
        loom_status st = ctx && ctx->status != LOOM_OK ? ctx->status : LOOM_ERR_FORMAT;
        ja_free(&t->arena);
        free(t);
        return st;
    }
    t->what = ja_strndup(&t->arena, what ? what : "template", strlen(what ? what : "template"));
    P.what = t->what;
    P.src = normalize(&t->arena, src, len, &P.len);
    jx_lex(&P);
    t->root = p_body(&P, NULL, NULL);
    names defs = {0};
    collect_defs(&P, t->root, &defs);
    check_calls(&P, t->root, &defs);
    t->arena.jb = NULL;
    *out = t;
    return LOOM_OK;
}

void loom_jinja_free(loom_jinja *t) {
    if (!t)
        return;
    ja_free(&t->arena);
    free(t);
}
