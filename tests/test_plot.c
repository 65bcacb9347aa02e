/* `loom plot`: a metrics JSONL in, a well-formed SVG (or HTML page) out
 * with the four panels and one polyline point per logged step; bad input
 * refused naming the file and line. */
#include <stdlib.h>

#include "harness.h"

#define RUN(out, ...) loom_test_run(out, (const char *const[]){__VA_ARGS__, NULL})

static const char *tmp(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "%s/%s", loom_test_tmpdir(), name);
    return buf;
}

/* n lines of steps first, first+2, ...; loss null at null_at (0: none). */
static void write_metrics(const char *path, const char *mode, int n, int first, int null_at) {
    FILE *f = fopen(path, mode);
    if (!f) return;
    for (int i = 0; i < n; i++) {
        int step = first + 2 * i;
        char loss[32];
        if (i + 1 == null_at)
            snprintf(loss, sizeof loss, "null");
        else
            snprintf(loss, sizeof loss, "%.4f", 7.0 * exp(-0.05 * step) + 1.0);
        fprintf(f,
                "{\"step\": %d, \"consumed_samples\": %d, \"consumed_tokens\": %d, \"loss\": %s, "
                "\"grad_norm\": %.3f, \"lr\": %.6g, \"tokens_per_s\": %.1f, \"skipped_steps\": 0, "
                "\"elapsed_s\": %.2f}\n",
                step, 8 * step, 2048 * step, loss, 2.0 / (1 + 0.1 * step),
                3e-4 * (step < 10 ? step / 10.0 : 1.0), 12000.0 + 37 * (step % 7), 0.5 * step);
    }
    fclose(f);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) n = 0;
    if (b) b[n] = '\0';
    fclose(f);
    return b;
}

static int count(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle)) n++;
    return n;
}

/* The number of x,y pairs in each polyline, in order (at most max). */
static int polyline_points(const char *svg, int *pts, int max) {
    int k = 0;
    for (const char *p = svg; (p = strstr(p, "<polyline")) && k < max; p++) {
        const char *q = strstr(p, "points=\"");
        if (!q) break;
        q += 8;
        const char *e = strchr(q, '"');
        int n = 0;
        for (const char *c = q; c < e; c++) n += *c == ',';
        pts[k++] = n;
    }
    return k;
}

/* Elements open and close in order (a stack of names); no "nan"/"inf" numbers. */
static bool well_formed(const char *s) {
    char stack[64][32];
    int depth = 0;
    for (const char *p = s; (p = strchr(p, '<')); p++) {
        if (p[1] == '!' || p[1] == '?') continue;
        bool close = p[1] == '/';
        const char *nm = p + 1 + close;
        size_t len = strcspn(nm, " />\n");
        const char *gt = strchr(p, '>');
        if (!gt || len == 0 || len >= 32) return false;
        if (close) {
            if (!depth || strncmp(stack[depth - 1], nm, len) || stack[depth - 1][len]) return false;
            depth--;
        } else if (gt[-1] != '/') {
            if (depth == 64) return false;
            snprintf(stack[depth++], 32, "%.*s", (int)len, nm);
        }
    }
    return depth == 0 && !strstr(s, "nan") && !strstr(s, "inf\"");
}

TEST(plot_draws_four_panels) {
    char in[1024], svg[1024], html[1024], *out = NULL;
    tmp(in, sizeof in, "run.jsonl");
    write_metrics(in, "w", 25, 1, 0);
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", in), 0);
    CHECK_CONTAINS(out, "run.svg"); /* default: beside the input */
    free(out);
    char *s = slurp(tmp(svg, sizeof svg, "run.svg"));
    REQUIRE(s);
    CHECK(!strncmp(s, "<svg xmlns=\"http://www.w3.org/2000/svg\"", 39));
    CHECK(well_formed(s));
    CHECK_CONTAINS(s, ">run.jsonl</text>");
    static const char *titles[] = {">loss<", ">grad norm<", ">learning rate<",
                                   ">throughput (tokens/s)<"};
    for (int i = 0; i < 4; i++) CHECK_CONTAINS(s, titles[i]);
    CHECK_EQ_INT(count(s, "class=\"panel\""), 4);
    int pts[16];
    CHECK_EQ_INT(polyline_points(s, pts, 16), 4);
    for (int i = 0; i < 4; i++) CHECK_EQ_INT(pts[i], 25);
    CHECK_CONTAINS(s, ">last 1.604<"); /* loss at step 49: 7 e^-2.45 + 1 */
    CHECK_CONTAINS(s, ">3e-4<");       /* an lr tick */
    free(s);
    /* an XML parser reads it */
    const char *py[] = {"python3", "-c",
                        "import sys, xml.etree.ElementTree as E\n"
                        "r = E.parse(sys.argv[1]).getroot()\n"
                        "ns = '{http://www.w3.org/2000/svg}'\n"
                        "p = r.findall('.//' + ns + 'polyline')\n"
                        "assert len(p) == 4 and all(len(x.get('points').split()) == 25 for x in p)\n"
                        "print('ok')",
                        svg, NULL};
    CHECK_EQ_INT(loom_test_run(&out, py), 0);
    CHECK_CONTAINS(out, "ok");
    free(out);
    /* --out X.html: a page with the same SVG in it */
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", in, "--out", tmp(html, sizeof html, "p.html")),
                 0);
    free(out);
    REQUIRE((s = slurp(html)));
    CHECK(!strncmp(s, "<!DOCTYPE html>", 15));
    CHECK_CONTAINS(s, "<title>loom: run.jsonl</title>");
    CHECK_EQ_INT(count(s, "<polyline"), 4);
    CHECK(well_formed(s));
    free(s);
}

TEST(plot_gaps_and_appended_runs) {
    char in[1024], svg[1024], *out = NULL;
    tmp(in, sizeof in, "two.jsonl");
    write_metrics(in, "w", 10, 1, 4); /* loss null at the 4th line: a gap */
    write_metrics(in, "a", 6, 1, 0);  /* a second run appended: steps restart */
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", in, "--out", tmp(svg, sizeof svg, "t.svg")),
                 0);
    free(out);
    char *s = slurp(svg);
    REQUIRE(s);
    CHECK(well_formed(s));
    int pts[16];
    /* loss: 3 + 6 points of run 1, 6 of run 2; the others 10 and 6 */
    REQUIRE(polyline_points(s, pts, 16) == 9);
    static const int want[9] = {3, 6, 6, 10, 6, 10, 6, 10, 6};
    for (int i = 0; i < 9; i++) CHECK_EQ_INT(pts[i], want[i]);
    CHECK_CONTAINS(s, ">run 2<");
    free(s);
}

static void put(const char *name, const char *text) { loom_test_write(name, text, strlen(text)); }

TEST(plot_refuses_bad_input) {
    char in[1024], *out = NULL;
    tmp(in, sizeof in, "empty.jsonl");
    put("empty.jsonl", "\n\n");
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", in), 1);
    CHECK_CONTAINS(out, "empty.jsonl: no metrics lines");
    free(out);
    put("bad.jsonl", "{\"step\": 1, \"loss\": 2}\n\nstep 2 loss 1.9\n");
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", tmp(in, sizeof in, "bad.jsonl")), 1);
    CHECK_CONTAINS(out, "bad.jsonl: line 3, column 1:");
    CHECK_CONTAINS(out, "not JSON");
    free(out);
    put("nostep.jsonl", "{\"loss\": 2}\n");
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", tmp(in, sizeof in, "nostep.jsonl")), 1);
    CHECK_CONTAINS(out, "nostep.jsonl: line 1: a JSON object with an integer \"step\"");
    free(out);
    put("nonum.jsonl", "{\"step\": 1, \"x\": 2}\n{\"step\": 2, \"loss\": null}\n");
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", tmp(in, sizeof in, "nonum.jsonl")), 1);
    CHECK_CONTAINS(out, "nonum.jsonl: 2 lines but no number");
    free(out);
    put("str.jsonl", "{\"step\": 1, \"loss\": \"2.5\"}\n");
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", tmp(in, sizeof in, "str.jsonl")), 1);
    CHECK_CONTAINS(out, "str.jsonl: line 1: \"loss\" must be a number, got string");
    free(out);
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot", in, "--out", "x.png"), 1);
    CHECK_CONTAINS(out, "--out x.png: give a file ending in .svg");
    free(out);
    CHECK_EQ_INT(RUN(&out, loom_test_bin(), "plot"), 1);
    CHECK_CONTAINS(out, "loom plot needs one metrics file");
    free(out);
}
