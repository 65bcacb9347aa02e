/* Internals of the Jinja interpreter (jinja_lex.c, jinja_parse.c,
 * jinja_value.c, jinja_eval.c, jinja_lib.c, jinja_sort.c; jinja_chat.c is
 * chat.c's side). Everything a parse or a render allocates
 * lives in an arena freed at its end; errors set the loom_ctx message and
 * leave through longjmp to the entry point, so no partial state needs
 * unwinding. */
#ifndef LOOM_JINJA_IMPL_H
#define LOOM_JINJA_IMPL_H

#include <setjmp.h>

#include "jinja.h"

/* ---- arena ---- */
typedef struct ja_block ja_block;
typedef struct ja {
    ja_block *head;
    loom_ctx *ctx;
    jmp_buf *jb;         /* where an allocation failure goes */
    size_t total, limit; /* bytes taken from malloc; 0: no limit */
} ja;
void *ja_alloc(ja *a, size_t n); /* zeroed; longjmps on failure */
char *ja_strndup(ja *a, const char *s, size_t n);
/* Room for one more item in an arena array v of n items (*cap of them
 * allocated): v itself or a larger copy. */
void *ja_grow(ja *a, void *v, size_t n, size_t *cap, size_t elem);
void ja_free(ja *a);

/* Python's str.isspace() for the code point at s; *len gets its byte length (jinja_parse.c) */
bool jx_space_at(const char *s, size_t n, size_t *len);

/* ---- AST ---- */
typedef enum jk {
    /* expressions */
    K_LIT,
    K_NAME,
    K_LIST,
    K_TUPLE,
    K_DICT,
    K_ATTR,
    K_ITEM,
    K_SLICE,
    K_CALL,
    K_FILTER,
    K_TEST,
    K_BIN,
    K_NEG,
    K_POS,
    K_NOT,
    K_AND,
    K_OR,
    K_COND,
    K_CMP,
    /* statements */
    K_BODY,
    K_DATA,
    K_OUT,
    K_IF,
    K_FOR,
    K_SET,
    K_SETBLOCK,
    K_MACRO,
    K_GEN,
    K_BREAK,
    K_CONTINUE,
    K_CALLBLOCK_UNUSED
} jk;

/* operators of K_BIN and K_CMP */
enum {
    OP_ADD,
    OP_SUB,
    OP_MUL,
    OP_DIV,
    OP_FDIV,
    OP_MOD,
    OP_POW,
    OP_CAT,
    OP_EQ,
    OP_NE,
    OP_LT,
    OP_LE,
    OP_GT,
    OP_GE,
    OP_IN,
    OP_NOTIN
};

typedef struct jv jv;
typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct jnode jnode;

typedef enum jt {
    JV_UNDEF,
    JV_NONE,
    JV_BOOL,
    JV_INT,
    JV_FLOAT,
    JV_STR,
    JV_LIST,
    JV_DICT,
    JV_NS,
    JV_MACRO,
    JV_FUNC
} jt;

/* Built-in global functions */
enum { FN_RANGE, FN_NAMESPACE, FN_DICT, FN_RAISE, FN_STRFTIME };

struct jv {
    jt t;
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *p;
            size_t n;
        } s;
        jlist *l;
        jdict *d;
        struct jmacro *mac;
        int fn;
    };
    const char *name; /* UNDEF: what was undefined (for messages), or NULL */
    bool tuple;       /* LIST: a tuple (repr with parentheses) */
};

struct jframe;
struct jmacro {
    const jnode *def;
    struct jframe *closure;
};

/* depth: how deeply lists and dicts nest inside (bounded, so that the
 * recursive ==, < and str() cannot overflow the stack) */
struct jlist {
    jv *v;
    size_t n, cap;
    int depth;
};
struct jdict {
    jv *k, *v;
    size_t n, cap;
    int depth;
};

struct jnode {
    jk kind;
    int op;
    int line, col;
    jnode *a, *b, *c, *d;
    jnode **kids; /* list items, call args, statement bodies */
    int nkids;
    jnode **kwv; /* keyword args / dict values / macro defaults */
    const char **kwn;
    int nkw;
    const char *name;   /* NAME, ATTR, FILTER, TEST, SET target, MACRO */
    const char **names; /* FOR targets, SET ns attribute ("ns", "attr") */
    int nnames;
    const char *text; /* DATA */
    size_t len;
    jv lit;
    int *ops; /* CMP: ops[nkids - 1] */
};

struct loom_jinja {
    ja arena;
    jnode *root;
    char *what;
};

/* ---- lexer (jinja_lex.c), used by the parser ---- */
typedef enum tk { T_DATA, T_VAR, T_BLOCK, T_END, T_NAME, T_STR, T_INT, T_FLOAT, T_OP, T_EOF } tk;

typedef struct tok {
    tk kind;
    int line, col;
    const char *p; /* DATA, NAME, STR (decoded), OP text */
    size_t n;
    int64_t i;
    double f;
} tok;

typedef struct jp {
    loom_ctx *ctx;
    const char *what;
    const char *src;
    size_t len;
    ja *a;
    jmp_buf jb;
    tok *toks;
    size_t ntok, cap, pos;
    int depth;
} jp;

void jx_line_col(const jp *P, size_t off, int *line, int *col);
_Noreturn void jx_perr_at(jp *P, int line, int col, loom_status st, const char *fmt, ...)
    LOOM_PRINTF(5, 6);
/* Tokenizes P->src into P->toks (ending with T_EOF). */
void jx_lex(jp *P);

/* ---- values (jinja_value.c) ---- */
typedef struct jr jr; /* a render */

jv jv_undef(const char *name);
jv jv_none(void);
jv jv_bool(bool b);
jv jv_int(int64_t i);
jv jv_float(double f);
jv jv_str(const char *p, size_t n);
jv jv_cstr(const char *p);
jv jv_newlist(jr *r);
jv jv_newdict(jr *r, jt t);
void jl_push(jr *r, jlist *l, jv v);
void jd_set(jr *r, jdict *d, jv k, jv v);
const jv *jd_get(const jdict *d, jv k);
const jv *jd_gets(const jdict *d, const char *k);
jv jv_from_json(jr *r, const loom_json *j);

bool jv_truthy(jv v);
bool jv_eq(jv a, jv b);
const char *jv_typename(jv v);
/* Python's str() (repr when `repr`) appended to the buffer */
typedef struct jbuf {
    char *p;
    size_t n, cap;
} jbuf;
void jb_put(jr *r, jbuf *b, const char *s, size_t n);
void jb_puts(jr *r, jbuf *b, const char *s);
void jv_write_str(jr *r, jbuf *b, jv v, bool repr);
jv jv_to_str(jr *r, jv v);
/* Python's str.lower (mode 0), upper (1), capitalize (2), title (3) for
 * ASCII, Latin-1, Latin Extended-A, basic Greek and Cyrillic; other cased
 * letters are refused (loom has no full Unicode case tables). */
jv jv_case(jr *r, const jnode *at, jv s, int mode);
/* json.dumps' options: indent < 0 for none; separators; ensure_ascii; sort_keys */
typedef struct jjson {
    int indent;
    const char *item_sep, *key_sep;
    bool ascii, sort_keys;
} jjson;
void jv_write_json(jr *r, jbuf *b, jv v, const jjson *o, int level);
size_t utf8_count(const char *p, size_t n);
size_t utf8_offset(const char *p, size_t n, size_t cp); /* byte offset of code point cp */
int jv_cmp(jr *r, const jnode *at, jv a, jv b);         /* ordering: -1, 0, 1 */

/* ---- render (jinja_eval.c) ---- */
typedef struct jframe jframe;
struct jframe {
    jframe *parent;
    jdict vars;
};

struct jr {
    loom_ctx *ctx;
    const loom_jinja *t;
    ja arena;
    jmp_buf jb;
    jbuf *out; /* where output goes now */
    jbuf main; /* the template's output */
    loom_jinja_span *spans;
    size_t nspans, capspans;
    int depth;      /* macro call / expression nesting */
    int brk;        /* 1 break, 2 continue pending */
    uint64_t steps; /* statements and expressions evaluated (a runaway template stops) */
};

/* Raises a render error at node `at` (line/column named); never returns. */
_Noreturn void jr_fail(jr *r, const jnode *at, loom_status st, const char *fmt, ...)
    LOOM_PRINTF(4, 5);
jv jr_eval(jr *r, jframe *f, const jnode *e);
jv jr_call_macro(jr *r, jframe *f, const jnode *at, jv m, jv *args, int nargs, const char **kwn,
                 jv *kwv, int nkw);

/* ---- sorting (jinja_sort.c) ---- */
void jx_sort(jr *r, const jnode *at, jv *keys, jv *items, size_t n, bool reverse);
jv jx_sort_filter(jr *r, const jnode *at, jv seq, bool reverse, bool case_sensitive,
                  const char *attr);
jv jx_dictsort(jr *r, const jnode *at, jv d, bool case_sensitive, bool by_value, bool reverse);

/* ---- library (jinja_lib.c) ---- */
bool jlib_has_filter(const char *name);
bool jlib_has_test(const char *name);
bool jlib_has_global(const char *name, int *fn);
bool jlib_has_method(const char *name);
jv jlib_filter(jr *r, jframe *f, const jnode *at, const char *name, jv v, jv *args, int nargs,
               const char **kwn, jv *kwv, int nkw);
bool jlib_test(jr *r, const jnode *at, const char *name, jv v, jv *args, int nargs);
jv jlib_global(jr *r, const jnode *at, int fn, jv *args, int nargs, const char **kwn, jv *kwv,
               int nkw);
/* obj.name(args): string, dict and list methods */
jv jlib_method(jr *r, const jnode *at, jv obj, const char *name, jv *args, int nargs,
               const char **kwn, jv *kwv, int nkw);
/* getattr(obj, name) then obj[name], jinja2's order for `obj.name`; found false when neither */
jv jlib_getattr(jr *r, const jnode *at, jv obj, const char *name);
jv jlib_getitem(jr *r, const jnode *at, jv obj, jv key);
jv jlib_slice(jr *r, const jnode *at, jv obj, jv start, jv stop, jv step);

#endif /* LOOM_JINJA_IMPL_H */
