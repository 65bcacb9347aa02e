/* The Jinja interpreter (src/data/jinja*.c): the constructs one by one
 * (expected strings are jinja2's, as transformers configures it), the
 * errors, and the real chat templates of tests/fixtures_chat_templates/
 * against what jinja2 renders for them (cases.jsonl, written by
 * make_cases.py there): text and {% generation %} byte ranges. */
#include <stdlib.h>

#include "../src/data/chat.h"
#include "../src/data/jinja.h"
#include "harness.h"

static char *tpl_path(const char *name) {
    static char buf[4][1024];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "tests/fixtures_chat_templates/%s", name);
    return p;
}

/* The next line of a JSON-lines file (NULL at its end; a line that does not
 * parse fails the test). */
static loom_json *next_case(loom_ctx *ctx, char **line, const char *what) {
    char *end = strchr(*line, '\n');
    size_t l = end ? (size_t)(end - *line) : strlen(*line);
    loom_json *cs = NULL;
    if (!l)
        return NULL;
    if (loom_json_parse(ctx, *line, l, what, &cs) != LOOM_OK)
        CHECK_MSG(false, "%s: %s", what, loom_last_error(ctx));
    *line += l + (end ? 1 : 0);
    return cs;
}

/* Renders src with vars (JSON text, NULL for none); returns the text (caller
 * frees) or NULL with the error in ctx. */
static char *render(loom_ctx *ctx, const char *src, const char *vars) {
    loom_jinja *t = NULL;
    if (loom_jinja_parse(ctx, src, strlen(src), "t", &t) != LOOM_OK)
        return NULL;
    loom_json *v = NULL;
    if (vars && loom_json_parse(ctx, vars, strlen(vars), "vars", &v) != LOOM_OK) {
        loom_jinja_free(t);
        return NULL;
    }
    char *text = NULL;
    size_t len;
    loom_status st = loom_jinja_render(ctx, t, v, &text, &len, NULL, NULL);
    loom_json_free(v);
    loom_jinja_free(t);
    return st == LOOM_OK ? text : NULL;
}

#define EXPECT(src, vars, want)                                                                    \
    do {                                                                                           \
        char *_got = render(ctx, (src), (vars));                                                   \
        CHECK_MSG(_got &&strcmp(_got, (want)) == 0, "%s: got \"%s\" (%s), want \"%s\"", (src),     \
                  _got ? _got : "(error)", _got ? "" : loom_last_error(ctx), (want));              \
        free(_got);                                                                                \
    } while (0)

#define EXPECT_ERR(src, vars, msg)                                                                 \
    do {                                                                                           \
        char *_got = render(ctx, (src), (vars));                                                   \
        CHECK_MSG(!_got, "%s: rendered \"%s\", want an error", (src), _got ? _got : "");           \
        if (!_got)                                                                                 \
            CHECK_CONTAINS(loom_last_error(ctx), (msg));                                           \
        free(_got);                                                                                \
    } while (0)

TEST(jinja_whitespace) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    /* trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before one */
    EXPECT("{% if true %}\nA\n{% endif %}\nB", NULL, "A\nB");
    EXPECT("  {% if true %}\n  x\n  {% endif %}\n", NULL, "  x\n");
    EXPECT("a  {% if true %}b{% endif %}", NULL, "a  b");
    EXPECT("a\n  {{ 1 }}\n", NULL, "a\n  1");
    EXPECT("a \n {{- 1 -}} \n b", NULL, "a1b");
    EXPECT("a {%- if true -%} \n b {%- endif %}", NULL, "ab");
    EXPECT("x{# c #}\ny\n  {# c2 #}\nz", NULL, "xy\nz");
    EXPECT("a {%+ if true %}b{% endif +%}\nc", NULL, "a b\nc");
    EXPECT("line\n", NULL, "line");
    EXPECT("line\n\n", NULL, "line\n");
    EXPECT("a\r\nb", NULL, "a\nb");
    EXPECT("{{ '{{' }}{{ {'a': {'b': 1}} }}", NULL, "{{{'a': {'b': 1}}");
    loom_ctx_free(ctx);
}

TEST(jinja_expressions) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    EXPECT("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }}",
           NULL, "7 3 -4 2 3.5 1024");
    EXPECT("{{ 'a' ~ 1 ~ none ~ true ~ 1.5 }}", NULL, "a1NoneTrue1.5");
    EXPECT("{{ 1.0 }} {{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e-5 }} {{ 0.0001 }} {{ 3.0 * 2 }}", NULL,
           "1.0 0.30000000000000004 1e+16 1e-05 0.0001 6.0");
    EXPECT("{{ [1, 'a', none, true, [2.5]] }} {{ {'k': 'it\\'s', 2: (1,)} }}", NULL,
           "[1, 'a', None, True, [2.5]] {'k': \"it's\", 2: (1,)}");
    EXPECT("{{ 'x' if false }}|{{ 'y' if 1 > 0 else 'n' }}|{{ none or 'd' }}|{{ 0 and 1 }}", NULL,
           "|y|d|0");
    EXPECT("{{ 1 < 2 < 3 }} {{ 'b' > 'a' }} {{ 1 == 1.0 }} {{ [1,2] == [1,2] }} {{ 'a' != 'a' }}",
           NULL, "True True True True False");
    EXPECT("{{ 'ell' in 'hello' }} {{ 2 in [1,2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}", NULL,
           "True True True True");
    EXPECT("{{ not none }} {{ not [] }} {{ not 'x' }}", NULL, "True True False");
    EXPECT("{{ 'héllo'[1] }}{{ 'héllo'[-1] }} {{ 'héllo'[1:3] }} {{ 'abc'[::-1] }} {{ "
           "[1,2,3][::-1] }}",
           NULL, "éo él cba [3, 2, 1]");
    EXPECT("{{ [1,2,3,4][1:] }} {{ [1,2,3,4][:-1] }} {{ [1,2,3,4][::2] }} {{ 'abcdef'[-3:] }}",
           NULL, "[2, 3, 4] [1, 2, 3] [1, 3] def");
    EXPECT("{{ m.a }}{{ m['b'] }}{{ m.c is defined }}{{ m.c }}{{ l[5] is defined }}",
           "{\"m\": {\"a\": 1, \"b\": 2}, \"l\": [1]}", "12FalseFalse");
    EXPECT("{{ 'ab' * 2 }}{{ [0] * 2 }}{{ 'a' + 'b' }}{{ [1] + [2] }}", NULL, "abab[0, 0]ab[1, 2]");
    loom_ctx_free(ctx);
}

TEST(jinja_statements) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    EXPECT("{% for x in [1,2,3] %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}"
           "{{ loop.length }};{% endfor %}",
           NULL, "01TrueFalse3;12FalseFalse3;23FalseTrue3;");
    EXPECT("{% for x in [1,2,3] %}{{ loop.previtem is defined }}{{ loop.nextitem | default('-') "
           "}}{% endfor %}",
           NULL, "False2True3True-");
    EXPECT("{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}{% for k, v in d | items %}{{ k "
           "}}{% endfor %}",
           "{\"d\": {\"z\": 1, \"a\": 2}}", "z=1,a=2,za");
    EXPECT("{% for x in [] %}x{% else %}empty{% endfor %}", NULL, "empty");
    EXPECT("{% for x in range(10) if x is odd %}{{ x }}{% endfor %}", NULL, "13579");
    EXPECT(
        "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}"
        "{% endif %}{{ x }}{% endfor %}",
        NULL, "013");
    EXPECT(
        "{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for k in {'a':1,'b':2} %}{{ k }}{% endfor %}",
        NULL, "[h][é]ab");
    /* scopes: a loop's sets stay in the loop; namespaces carry out */
    EXPECT("{% set x = 1 %}{% for i in range(3) %}{{ x }}{% set x = 5 %}{% endfor %}{{ x }}", NULL,
           "1111");
    EXPECT("{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor "
           "%}{{ ns.n }}",
           NULL, "3");
    EXPECT("{% if false %}a{% elif 0 %}b{% elif 'x' %}c{% else %}d{% endif %}", NULL, "c");
    EXPECT("{% set s %}in {{ 1 }}{% endset %}[{{ s }}]", NULL, "[in 1]");
    EXPECT("{% macro m(a, b='B') %}{{ a }}-{{ b }}{% endmacro %}{{ m(1) }} {{ m(2, b=3) }} {{ "
           "m('x') | trim }}",
           NULL, "1-B 2-3 x-B");
    loom_ctx_free(ctx);
}

TEST(jinja_filters_tests_methods) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    EXPECT("{{ '  a b \\n' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ [1,2] | length }}|{{ 'é' | "
           "length }}",
           NULL, "a b|a|2|1");
    EXPECT("{{ d | tojson }}",
           "{\"d\": {\"b\": [1, 2.5, null, true, \"é\\\"\\n<>&'\"], \"a\": {}}}",
           "{\"b\": [1, 2.5, null, true, \"é\\\"\\n<>&'\"], \"a\": {}}");
    EXPECT("{{ d | tojson(indent=2) }}", "{\"d\": {\"a\": [1, {}], \"b\": []}}",
           "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": []\n}");
    EXPECT(
        "{{ [1, 'a'] | join(', ') }} {{ 'ab' | upper }} {{ 'AB' | lower }} {{ x | default('d') }} "
        "{{ '' | default('e', true) }}",
        NULL, "1, a AB ab d e");
    EXPECT("{{ [3, 4] | first }}{{ [3, 4] | last }}{{ 'abc' | list }}{{ 5 | string }}{{ 'a-b' | "
           "replace('-', '+') }}",
           NULL, "34['a', 'b', 'c']5a+b");
    EXPECT("{{ ['a','b','c'] | reject('equalto', 'b') | join }}{{ [1,0,2] | select | list }}", NULL,
           "ac[1, 2]");
    EXPECT("{{ l | map(attribute='n') | join(',') }}{{ l | selectattr('n', 'gt', 1) | list | "
           "length }}",
           "{\"l\": [{\"n\": 1}, {\"n\": 2}]}", "1,21");
    EXPECT("{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ 1 is number }}{{ true is "
           "number }}"
           "{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}{{ 1 is iterable }}{{ x is "
           "iterable }}",
           NULL, "FalseTrueTrueTrueTrueTrueTrueTrueFalseTrue");
    EXPECT("{{ true is true }}{{ 1 is true }}{{ false is false }}{{ 3 is divisibleby 3 }}{{ 2 is "
           "even }}"
           "{{ 1 is integer }}{{ 1.5 is float }}{{ 1 is not none }}",
           NULL, "TrueFalseTrueTrueTrueTrueTrueTrue");
    EXPECT("{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}{{ '  a  '.strip() }}|"
           "{{ 'xxaxx'.lstrip('x') }}|{{ '\\n\\na\\n'.rstrip('\\n') }}|",
           NULL, "TrueTruea|axx|\n\na|");
    EXPECT("{{ ' a b c '.split(None, 1) }}{{ ' a b c '.rsplit(None, 1) }}{{ ' a '.rsplit() }}",
           NULL, "['a', 'b c '][' a b', 'c']['a']");
    EXPECT("{{ 'a,b,,c'.split(',') }}{{ ' a  b '.split() }}{{ 'a,b,c'.split(',', 1) }}{{ "
           "'a,b,c'.rsplit(',', 1) }}",
           NULL, "['a', 'b', '', 'c']['a', 'b']['a', 'b,c']['a,b', 'c']");
    EXPECT("{{ 'a</think>b</think>c'.split('</think>')[-1] }}{{ 'Ab'.upper() }}{{ "
           "'aXa'.replace('a', 'b') }}",
           NULL, "cABbXb");
    EXPECT("{{ 'Grüße ÿ ß ı' | upper }} {{ 'ÀÉÎ Σ'[:3] | lower }} {{ 'ПРИВЕТ мир' | lower }} "
           "{{ 'élan vital' | capitalize }} {{ 'hello wörld'.title() }}",
           NULL, "GRÜSSE Ÿ SS I àéî привет мир Élan vital Hello Wörld");
    EXPECT_ERR("{{ 'ΑΣ' | lower }}", NULL, "lower of U+03A3");
    EXPECT("{{ d | dictsort }}{{ d | dictsort(reverse=true) | first }}{{ d | dictsort(by='value') "
           "| last }}"
           "{{ ['b', 'A', 'a', 'C'] | sort }}{{ [3, 1, 2] | sort(reverse=true) }}"
           "{{ l | sort(attribute='n') | map(attribute='k') | join }}",
           "{\"d\": {\"b\": 2, \"A\": 3, \"c\": 1}, \"l\": [{\"n\": 2, \"k\": \"x\"}, "
           "{\"n\": 1, \"k\": \"y\"}, {\"n\": 1, \"k\": \"z\"}]}",
           "[('A', 3), ('b', 2), ('c', 1)]('c', 1)('A', 3)['A', 'a', 'b', 'C'][3, 2, 1]yzx");
    EXPECT("{{ d | tojson(sort_keys=true) }}{{ d | tojson(separators=(',', ':')) }}{{ 'é😀' | "
           "tojson(ensure_ascii=true) }}",
           "{\"d\": {\"b\": 1, \"a\": [1, 2]}}",
           "{\"a\": [1, 2], \"b\": 1}{\"b\":1,\"a\":[1,2]}\"\\u00e9\\ud83d\\ude00\"");
    EXPECT("{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 0) }}{{ d.keys() | list }}{{ d.values() "
           "| list }}",
           "{\"d\": {\"a\": 1}}", "1None0['a'][1]");
    EXPECT("{{ range(3) | list }}{{ range(1, 7, 2) | list }}{{ dict(a=1) }}", NULL,
           "[0, 1, 2][1, 3, 5]{'a': 1}");
    loom_ctx_free(ctx);
}

TEST(jinja_generation_spans) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    const char *src =
        "{% for m in messages %}<{{ m }}>{% generation %}é{{ m }}{% endgeneration %}|{% endfor %}";
    loom_jinja *t;
    REQUIRE_OK(ctx, loom_jinja_parse(ctx, src, strlen(src), "t", &t));
    loom_json *v;
    const char *vars = "{\"messages\": [\"a\", \"bc\"]}";
    REQUIRE_OK(ctx, loom_json_parse(ctx, vars, strlen(vars), "v", &v));
    char *text;
    size_t len, n;
    loom_jinja_span *sp;
    REQUIRE_OK(ctx, loom_jinja_render(ctx, t, v, &text, &len, &sp, &n));
    CHECK_STR(text, "<a>éa|<bc>ébc|");
    REQUIRE(n == 2);
    CHECK_EQ_INT(sp[0].start, 3);
    CHECK_EQ_INT(sp[0].end, 6);
    CHECK_EQ_INT(sp[1].start, 11);
    CHECK_EQ_INT(sp[1].end, 15);
    free(text);
    free(sp);
    loom_json_free(v);
    loom_jinja_free(t);
    loom_ctx_free(ctx);
}

static void expect_parse_err(loom_ctx *ctx, const char *src, loom_status st, const char *msg) {
    loom_jinja *t = NULL;
    loom_status got = loom_jinja_parse(ctx, src, strlen(src), "tpl", &t);
    CHECK_MSG(got == st, "%s: status %s, want %s (%s)", src, loom_status_str(got),
              loom_status_str(st), got ? loom_last_error(ctx) : "");
    if (got)
        CHECK_CONTAINS(loom_last_error(ctx), msg);
    loom_jinja_free(t);
}

TEST(jinja_errors) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    expect_parse_err(ctx, "a\n{% include 'x' %}", LOOM_ERR_UNSUPPORTED,
                     "tpl:2:4: unsupported statement 'include'");
    expect_parse_err(ctx, "{{ x | wordwrap }}", LOOM_ERR_UNSUPPORTED,
                     "tpl:1:8: unsupported filter 'wordwrap'");
    expect_parse_err(ctx, "{{ x is escaped }}", LOOM_ERR_UNSUPPORTED, "unsupported test 'escaped'");
    expect_parse_err(ctx, "{% raw %}x{% endraw %}", LOOM_ERR_UNSUPPORTED,
                     "unsupported statement 'raw'");
    expect_parse_err(ctx, "{% for x in y recursive %}{% endfor %}", LOOM_ERR_UNSUPPORTED,
                     "recursive");
    expect_parse_err(ctx, "{% if x %}", LOOM_ERR_FORMAT, "'{% endif %}' missing");
    expect_parse_err(ctx, "{{ x ", LOOM_ERR_FORMAT, "tpl:1:1: unclosed '{{'");
    expect_parse_err(ctx, "{% endfor %}", LOOM_ERR_FORMAT, "unexpected 'endfor'");
    expect_parse_err(ctx, "{{ 'abc }}", LOOM_ERR_FORMAT, "unterminated string");
    expect_parse_err(ctx, "{{ (1 }}", LOOM_ERR_FORMAT, "");
    expect_parse_err(ctx, "{{ cycler(1) }}", LOOM_ERR_UNSUPPORTED,
                     "tpl:1:4: unsupported function 'cycler'");
    expect_parse_err(ctx, "{{ 'a'.format(1) }}", LOOM_ERR_UNSUPPORTED,
                     "unsupported method 'format'");
    expect_parse_err(ctx, "{% for x in y %}{{ loop.cycle(1, 2) }}{% endfor %}",
                     LOOM_ERR_UNSUPPORTED, "unsupported method 'cycle'");
    EXPECT_ERR("{{ raise_exception('no tools here') }}", NULL,
               "t:1:4: the template refused the input: no tools here");
    EXPECT_ERR("{{ x.y }}", NULL, "'x' is undefined");
    EXPECT_ERR("{{ x + 1 }}", NULL, "'x' is undefined");
    EXPECT_ERR("{{ 'a' + 1 }}", NULL, "unsupported operand type(s) for +: 'str' and 'int'");
    EXPECT_ERR("{{ 'a'.title(1) }}", NULL, "title takes at most 0 argument(s)");
    expect_parse_err(ctx, "{{ [1].append(2) }}", LOOM_ERR_UNSUPPORTED,
                     "unsupported method 'append'");
    EXPECT_ERR("{{ 1 / 0 }}", NULL, "division by zero");
    EXPECT_ERR("{% set x = 1 %}{% set x.a = 1 %}", NULL,
               "cannot assign attribute on non-namespace object");
    EXPECT_ERR("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", NULL, "nested over 64 deep");
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* The real templates against jinja2                                       */
/* ---------------------------------------------------------------------- */

TEST(jinja_real_templates) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    REQUIRE_FIXTURE(tpl_path("cases.jsonl"));
    char *data = NULL;
    size_t dlen = 0;
    REQUIRE_OK(ctx, loom_read_file(ctx, tpl_path("cases.jsonl"), 0, &data, &dlen));
    char *names[8] = {0};
    loom_jinja *tpls[8] = {0};
    int ntpl = 0, cases = 0, errors = 0, spans = 0, failed = 0;
    loom_json *cs;
    for (char *line = data; (cs = next_case(ctx, &line, "cases.jsonl"));) {
        const char *tname = loom_json_get(cs, "template")->s, *cname = loom_json_get(cs, "name")->s;
        int k = 0;
        for (; k < ntpl && strcmp(names[k], tname) != 0; k++) {
        }
        if (k == ntpl && ntpl < 8) {
            char *src = NULL;
            size_t n = 0;
            REQUIRE_OK(ctx, loom_read_file(ctx, tpl_path(tname), 0, &src, &n));
            loom_status st = loom_jinja_parse(ctx, src, n, tname, &tpls[k]);
            free(src);
            CHECK_MSG(st == LOOM_OK, "%s: %s", tname, loom_last_error(ctx));
            names[ntpl++] = strdup(tname);
        }
        if (!tpls[k]) {
            loom_json_free(cs);
            continue;
        }
        char *text = NULL;
        size_t len = 0, nsp = 0;
        loom_jinja_span *sp = NULL;
        loom_status st =
            loom_jinja_render(ctx, tpls[k], loom_json_get(cs, "vars"), &text, &len, &sp, &nsp);
        const loom_json *want = loom_json_get(cs, "text"), *err = loom_json_get(cs, "error");
        bool ok;
        cases++;
        if (err) {
            errors++;
            ok = st != LOOM_OK && strstr(loom_last_error(ctx), err->s);
            CHECK_MSG(ok, "%s: want error \"%s\", got %s", cname, err->s,
                      st ? loom_last_error(ctx) : "text");
        } else {
            ok = st == LOOM_OK && len == want->slen && memcmp(text, want->s, len) == 0;
            if (!ok && st == LOOM_OK) {
                size_t d = 0;
                while (d < len && d < want->slen && text[d] == want->s[d])
                    d++;
                CHECK_MSG(false, "%s: differs at byte %zu: got \"%.60s\", want \"%.60s\"", cname, d,
                          text + d, want->s + d);
            } else if (!ok) {
                CHECK_MSG(false, "%s: %s", cname, loom_last_error(ctx));
            }
            const loom_json *ws = loom_json_get(cs, "spans");
            bool sp_ok = ws && ws->n == nsp;
            for (size_t i = 0; sp_ok && i < nsp; i++)
                sp_ok = (int64_t)sp[i].start == ws->items[i]->items[0]->i &&
                        (int64_t)sp[i].end == ws->items[i]->items[1]->i;
            CHECK_MSG(sp_ok, "%s: generation spans differ (%zu, want %zu)", cname, nsp,
                      ws ? ws->n : 0);
            spans += nsp > 0;
            ok = ok && sp_ok;
        }
        failed += !ok;
        free(text);
        free(sp);
        loom_json_free(cs);
    }
    printf("  jinja_real_templates: %d cases (%d expected errors, %d with generation spans), %d "
           "differ\n",
           cases, errors, spans, failed);
    CHECK(cases >= 300);
    for (int k = 0; k < ntpl; k++)
        loom_jinja_free(tpls[k]), free(names[k]);
    free(data);
    loom_ctx_free(ctx);
}

/* The Qwen3 fixture of test_chat.c (HF's text) through the interpreter. */
TEST(jinja_chat_fixture_cases) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char path[1024], *src = NULL, *data = NULL;
    size_t n = 0, dlen = 0;
    snprintf(path, sizeof path, "%s/tokenizer/chat_template.jinja", loom_test_fixtures());
    REQUIRE_OK(ctx, loom_read_file(ctx, path, 0, &src, &n));
    loom_jinja *t;
    REQUIRE_OK(ctx, loom_jinja_parse(ctx, src, n, "chat_template.jinja", &t));
    snprintf(path, sizeof path, "%s/tokenizer/chat_cases.jsonl", loom_test_fixtures());
    REQUIRE_OK(ctx, loom_read_file(ctx, path, 0, &data, &dlen));
    int cases = 0;
    loom_json *cs;
    for (char *line = data; (cs = next_case(ctx, &line, "chat_cases.jsonl"));) {
        loom_sb sb;
        loom_sb_init(&sb);
        const loom_json *g = loom_json_get(cs, "add_generation_prompt");
        loom_sb_puts(&sb, "{\"add_generation_prompt\": ");
        loom_sb_puts(&sb, g && g->b ? "true" : "false");
        loom_sb_puts(&sb, ", \"tools\": null, \"messages\": ");
        CHECK_OK(ctx, loom_json_write(ctx, loom_json_get(cs, "messages"), -1, &sb));
        loom_sb_puts(&sb, "}");
        loom_json *vars = NULL;
        CHECK_OK(ctx, loom_json_parse(ctx, sb.buf, sb.len, "vars", &vars));
        char *text = NULL;
        size_t len = 0;
        CHECK_OK(ctx, loom_jinja_render(ctx, t, vars, &text, &len, NULL, NULL));
        CHECK_STR(text, loom_json_get(cs, "text")->s);
        cases++;
        free(text);
        loom_json_free(vars);
        loom_sb_free(&sb);
        loom_json_free(cs);
    }
    CHECK(cases >= 6);
    free(data);
    free(src);
    loom_jinja_free(t);
    loom_ctx_free(ctx);
}

/* The built-in renderers (chat_builtin.c) agree with the interpreter on the cases
 * they take (tools= included: Qwen3 and Qwen2.5 render them, Llama 3.1
 * refuses them): text, and for Qwen3 (whose template has {% generation %})
 * the per-byte assistant mask. */
TEST(jinja_matches_builtin_renderers) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char *data = NULL;
    size_t dlen = 0;
    REQUIRE_OK(ctx, loom_read_file(ctx, tpl_path("cases.jsonl"), 0, &data, &dlen));
    int compared = 0, refused = 0, with_tools = 0, llama_tools = 0, llama_tools_refused = 0;
    loom_json *cs;
    for (char *line = data; (cs = next_case(ctx, &line, "cases.jsonl"));) {
        const char *tname = loom_json_get(cs, "template")->s;
        const loom_json *vars = loom_json_get(cs, "vars"), *want = loom_json_get(cs, "text");
        const char *name = !strcmp(tname, "qwen3.jinja")      ? "qwen3"
                           : !strcmp(tname, "qwen2.5.jinja")  ? "qwen2.5"
                           : !strcmp(tname, "llama3.1.jinja") ? "llama3.1"
                                                              : NULL;
        /* the built-ins take none of the templates' own keyword arguments */
        const loom_json *tools = loom_json_get(vars, "tools");
        bool plain = true;
        static const char *const STD[] = {"messages",       "tools",     "documents",
                                          "bos_token",      "eos_token", "add_generation_prompt",
                                          "enable_thinking"};
        for (size_t i = 0; plain && i < vars->n; i++) {
            bool std = false;
            for (size_t k = 0; k < sizeof STD / sizeof *STD; k++)
                std |= strcmp(vars->keys[i], STD[k]) == 0;
            plain = std;
        }
        if (!name || !want || !plain) {
            loom_json_free(cs);
            continue;
        }
        loom_chat *c = NULL;
        REQUIRE_OK(ctx, loom_chat_create_named(ctx, name, &c));
        const loom_json *think = loom_json_get(vars, "enable_thinking");
        if (think)
            loom_chat_set_enable_thinking(c, think->b);
        char *text = NULL;
        uint8_t *mask = NULL;
        bool agp = loom_json_get(vars, "add_generation_prompt")->b;
        bool tooled = tools->type != LOOM_JSON_NULL;
        llama_tools += tooled && !strcmp(name, "llama3.1");
        if (loom_chat_render(ctx, c, loom_json_get(vars, "messages"), tools, agp, &text, &mask) !=
            LOOM_OK) {
            refused++;
            bool said = strstr(loom_last_error(ctx), "does not do tool use") != NULL;
            llama_tools_refused += tooled && !strcmp(name, "llama3.1") && said;
        } else {
            compared++;
            with_tools += tooled;
            CHECK_MSG(strcmp(text, want->s) == 0,
                      "%s: built-in renderer differs:\n%s\nvs jinja\n%s",
                      loom_json_get(cs, "name")->s, text, want->s);
            const loom_json *sp = loom_json_get(cs, "spans");
            if (!strcmp(name, "qwen3") && strcmp(text, want->s) == 0) {
                size_t k = 0;
                bool same = true;
                for (size_t i = 0; i < want->slen; i++) {
                    while (k < sp->n && (size_t)sp->items[k]->items[1]->i <= i)
                        k++;
                    bool in = k < sp->n && (size_t)sp->items[k]->items[0]->i <= i;
                    same &= in == (mask[i] != 0);
                }
                CHECK_MSG(same, "%s: assistant mask differs from the generation spans",
                          loom_json_get(cs, "name")->s);
            }
        }
        free(text);
        free(mask);
        loom_chat_free(c);
        loom_json_free(cs);
    }
    printf("  jinja_matches_builtin_renderers: %d cases compared (%d with tools), %d refused by "
           "the built-ins\n",
           compared, with_tools, refused);
    CHECK(compared >= 100);
    /* Qwen3's and Qwen2.5's tools cases: 10 conversations each render */
    CHECK(with_tools >= 40);
    /* Llama 3.1's refusal says why (every tools case of it) */
    CHECK(llama_tools > 0 && llama_tools_refused == llama_tools);
    free(data);
    loom_ctx_free(ctx);
}
