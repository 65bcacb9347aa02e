/* loom plot: a --metrics-file JSONL in, one self-contained SVG out (or an
 * HTML page embedding it): loss, grad norm, learning rate and throughput
 * against the step, in four panels. No Python, no plotting library.
 *
 * A file that several runs appended to holds several step sequences: each
 * place where the step does not increase starts a new run, drawn in its own
 * colour (with a legend). Values that are null (not finite in the run) or
 * absent leave a gap. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

enum { N_PANELS = 4, MAX_RUNS_DRAWN = 8 };
static const char *const panel_key[N_PANELS] = {"loss", "grad_norm", "lr", "tokens_per_s"};
static const char *const panel_title[N_PANELS] = {"loss", "grad norm", "learning rate",
                                                  "throughput (tokens/s)"};
static const char *const run_colour[MAX_RUNS_DRAWN] = {
    "#1f5fbf", "#d9480f", "#2b8a3e", "#862e9c", "#c2255c", "#0b7285", "#5c940d", "#495057"};

typedef struct series {
    int64_t n, cap;
    int64_t *step;
    int *run;           /* run index of each point */
    double *v[N_PANELS]; /* NAN: no value */
    int n_runs;
} series;

static void series_free(series *s) {
    free(s->step);
    free(s->run);
    for (int p = 0; p < N_PANELS; p++) free(s->v[p]);
}

static loom_status series_push(loom_ctx *ctx, series *s) {
    if (s->n < s->cap) return LOOM_OK;
    int64_t cap = s->cap ? 2 * s->cap : 256;
    void *a = loom_realloc(ctx, s->step, (size_t)cap * sizeof *s->step, "plot points");
    if (!a) return LOOM_ERR_OOM;
    s->step = a;
    if (!(a = loom_realloc(ctx, s->run, (size_t)cap * sizeof *s->run, "plot points")))
        return LOOM_ERR_OOM;
    s->run = a;
    for (int p = 0; p < N_PANELS; p++) {
        if (!(a = loom_realloc(ctx, s->v[p], (size_t)cap * sizeof(double), "plot points")))
            return LOOM_ERR_OOM;
        s->v[p] = a;
    }
    s->cap = cap;
    return LOOM_OK;
}

/* Parses the JSONL; errors name the file and line. */
static loom_status read_metrics(loom_ctx *ctx, const char *path, series *s) {
    char *text;
    size_t len;
    loom_status st = loom_read_file(ctx, path, 0, &text, &len);
    if (st) return st;
    int64_t numeric = 0, line_no = 0;
    for (char *p = text; p < text + len && !st;) {
        char *nl = memchr(p, '\n', (size_t)(text + len - p));
        char *end = nl ? nl : text + len;
        line_no++;
        char *q = p;
        while (q < end && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
        if (q == end) { /* blank line */
            p = end + 1;
            continue;
        }
        char what[1100];
        snprintf(what, sizeof what, "%s: line %" PRId64, path, line_no);
        loom_json *obj = NULL;
        if (loom_json_parse(ctx, p, (size_t)(end - p), "", &obj)) {
            /* ": line 1, column C: problem" -> "FILE: line N, column C: problem" */
            char why[1024];
            const char *e = loom_last_error(ctx), *c = strstr(e, "column ");
            snprintf(why, sizeof why, "%s", c ? c : e);
            st = loom_errf(ctx, LOOM_ERR_FORMAT,
                           "%s, %s (not JSON: a metrics file holds one JSON object per line, "
                           "as `loom train --metrics-file` writes)",
                           what, why);
            break;
        }
        const loom_json *stp = loom_json_get(obj, "step");
        if (obj->type != LOOM_JSON_OBJECT || !stp || stp->type != LOOM_JSON_NUMBER ||
            !stp->is_int) {
            st = loom_errf(ctx, LOOM_ERR_FORMAT,
                           "%s: a JSON object with an integer \"step\" is expected (as `loom "
                           "train --metrics-file` writes), got %s",
                           what, obj->type == LOOM_JSON_OBJECT ? "an object without one"
                                                               : loom_json_type_name(obj->type));
        } else if (!(st = series_push(ctx, s))) {
            int64_t i = s->n++;
            s->step[i] = stp->i;
            if (i == 0 || stp->i <= s->step[i - 1]) s->n_runs++; /* a new run starts */
            s->run[i] = s->n_runs - 1;
            for (int k = 0; k < N_PANELS; k++) {
                const loom_json *v = loom_json_get(obj, panel_key[k]);
                s->v[k][i] = NAN;
                if (v && v->type == LOOM_JSON_NUMBER && isfinite(v->d)) {
                    s->v[k][i] = v->d;
                    numeric++;
                } else if (v && v->type != LOOM_JSON_NULL && v->type != LOOM_JSON_NUMBER) {
                    st = loom_errf(ctx, LOOM_ERR_FORMAT, "%s: \"%s\" must be a number, got %s",
                                   what, panel_key[k], loom_json_type_name(v->type));
                }
            }
        }
        loom_json_free(obj);
        p = end + 1;
    }
    free(text);
    if (st) return st;
    if (s->n == 0)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: no metrics lines (the file is empty; `loom train --metrics-file "
                         "%s` writes one per logged step)", path, path);
    if (numeric == 0)
        return loom_errf(ctx, LOOM_ERR_FORMAT,
                         "%s: %" PRId64 " line%s but no number in \"loss\", \"grad_norm\", \"lr\" "
                         "or \"tokens_per_s\": nothing to plot", path, line_no, line_no == 1 ? "" : "s");
    return LOOM_OK;
}

/* ---- axes ---- */

/* A 1-2-5 number near x (rounded, or the next one up). */
static double nice_num(double x, bool round_it) {
    double e = floor(log10(x)), f = x / pow(10, e), nf;
    if (round_it)
        nf = f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10;
    else
        nf = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
    return nf * pow(10, e);
}

typedef struct axis {
    double lo, hi, step;
} axis;

static axis nice_axis(double mn, double mx, int nticks, bool integer) {
    if (!(mx > mn)) { /* one value: a band around it */
        double d = mn != 0 ? fabs(mn) * 0.1 : 1;
        mn -= d;
        mx += d;
    }
    double step = nice_num(nice_num(mx - mn, false) / (nticks - 1), true);
    if (integer && step < 1) step = 1;
    axis a = {floor(mn / step) * step, ceil(mx / step) * step, step};
    return a;
}

/* A tick label, in one style for the whole axis (scale: its largest |value|):
 * 15k, 2.5k, 1.5M, 3e-4, 0.25, 7. */
static void tick_label(char *buf, size_t n, double v, double step, double scale) {
    if (fabs(v) < step * 1e-9) {
        snprintf(buf, n, "0");
    } else if (scale >= 1e6) {
        snprintf(buf, n, "%.*fM", fmod(step, 1e6) == 0 ? 0 : step >= 1e5 ? 1 : 2, v / 1e6);
    } else if (scale >= 1e4) {
        snprintf(buf, n, "%.*fk", fmod(step, 1e3) == 0 ? 0 : step >= 100 ? 1 : 2, v / 1e3);
    } else if (step < 1e-3) {
        char t[32], mant[16];
        snprintf(t, sizeof t, "%.1e", v); /* 3.0e-04 -> 3e-4 */
        char *e = strchr(t, 'e');
        snprintf(mant, sizeof mant, "%.*s", (int)(e - t), t);
        size_t ml = strlen(mant);
        if (ml > 2 && !strcmp(mant + ml - 2, ".0")) mant[ml - 2] = '\0';
        snprintf(buf, n, "%se%d", mant, atoi(e + 1));
    } else {
        int dec = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
        snprintf(buf, n, "%.*f", dec, v);
    }
}

static void xml_escape(loom_sb *sb, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': loom_sb_puts(sb, "&amp;"); break;
        case '<': loom_sb_puts(sb, "&lt;"); break;
        case '>': loom_sb_puts(sb, "&gt;"); break;
        case '"': loom_sb_puts(sb, "&quot;"); break;
        default:
            if ((unsigned char)*s >= 0x20 || *s == '\t') loom_sb_putc(sb, *s);
        }
    }
}

/* value formatted for a caption: 4 significant digits, k/M for big ones */
static void value_text(char *buf, size_t n, double v) {
    if (fabs(v) >= 1e6)
        snprintf(buf, n, "%.3gM", v / 1e6);
    else if (fabs(v) >= 1e4)
        snprintf(buf, n, "%.4gk", v / 1e3);
    else
        snprintf(buf, n, "%.4g", v);
}

#define FONT "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\""

/* One panel at (x0, y0) of size w x h. */
static void panel(loom_sb *sb, const series *s, int k, double x0, double y0, double w, double h,
                  axis ax) {
    const double ml = 62, mr = 22, mt = 30, mb = 34; /* margins inside the panel */
    const double px = x0 + ml, py = y0 + mt, pw = w - ml - mr, ph = h - mt - mb;
    double mn = INFINITY, mx = -INFINITY, last = NAN;
    for (int64_t i = 0; i < s->n; i++)
        if (!isnan(s->v[k][i])) {
            mn = fmin(mn, s->v[k][i]);
            mx = fmax(mx, s->v[k][i]);
            last = s->v[k][i];
        }
    loom_sb_printf(sb, "<g class=\"panel\" id=\"panel-%s\">\n", panel_key[k]);
    loom_sb_printf(sb,
                   "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" rx=\"6\" "
                   "fill=\"#ffffff\" stroke=\"#dee2e6\"/>\n",
                   x0, y0, w, h);
    char lt[32] = "";
    if (!isnan(last)) value_text(lt, sizeof lt, last);
    loom_sb_printf(sb,
                   "<text x=\"%.1f\" y=\"%.1f\" " FONT " font-size=\"15\" font-weight=\"bold\" "
                   "fill=\"#212529\">%s</text>\n",
                   px, y0 + 20, panel_title[k]);
    if (*lt)
        loom_sb_printf(sb,
                       "<text x=\"%.1f\" y=\"%.1f\" " FONT " font-size=\"12\" fill=\"#495057\" "
                       "text-anchor=\"end\">last %s</text>\n",
                       px + pw, y0 + 20, lt);
    if (isinf(mn)) {
        loom_sb_printf(sb,
                       "<text x=\"%.1f\" y=\"%.1f\" " FONT " font-size=\"13\" fill=\"#868e96\" "
                       "text-anchor=\"middle\">no data</text>\n</g>\n",
                       px + pw / 2, py + ph / 2);
        return;
    }
    axis ay = nice_axis(k == 3 ? fmin(0, mn) : mn, mx, 6, false);
#define SX(x) (px + ((x) - ax.lo) / (ax.hi - ax.lo) * pw)
#define SY(y) (py + ph - ((y) - ay.lo) / (ay.hi - ay.lo) * ph)
    /* grid, ticks and their labels */
    loom_sb_printf(sb, "<g " FONT " font-size=\"11\" fill=\"#495057\">\n");
    for (double t = ay.lo; t <= ay.hi + ay.step * 1e-6; t += ay.step) {
        char lb[32];
        tick_label(lb, sizeof lb, t, ay.step, fmax(fabs(ay.lo), fabs(ay.hi)));
        loom_sb_printf(sb,
                       "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e9ecef\"/>"
                       "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                       px, SY(t), px + pw, SY(t), px - 6, SY(t) + 4, lb);
    }
    for (double t = ax.lo; t <= ax.hi + ax.step * 1e-6; t += ax.step) {
        char lb[32];
        tick_label(lb, sizeof lb, t, ax.step, fmax(fabs(ax.lo), fabs(ax.hi)));
        loom_sb_printf(sb,
                       "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e9ecef\"/>"
                       "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                       SX(t), py, SX(t), py + ph, SX(t), py + ph + 16, lb);
    }
    loom_sb_printf(sb,
                   "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#868e96\">step"
                   "</text>\n</g>\n",
                   px + pw / 2, py + ph + 30);
    loom_sb_printf(sb,
                   "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" "
                   "stroke=\"#adb5bd\"/>\n",
                   px, py, pw, ph);
    /* one polyline per run and unbroken stretch of values */
    for (int64_t i = 0; i < s->n;) {
        if (isnan(s->v[k][i])) {
            i++;
            continue;
        }
        int64_t j = i;
        while (j < s->n && s->run[j] == s->run[i] && !isnan(s->v[k][j])) j++;
        const char *col = run_colour[s->run[i] % MAX_RUNS_DRAWN];
        if (j - i == 1) {
            loom_sb_printf(sb, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>\n",
                           SX((double)s->step[i]), SY(s->v[k][i]), col);
        } else {
            loom_sb_printf(sb,
                           "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.8\" "
                           "stroke-linejoin=\"round\" points=\"",
                           col);
            for (int64_t q = i; q < j; q++)
                loom_sb_printf(sb, "%s%.2f,%.2f", q > i ? " " : "", SX((double)s->step[q]),
                               SY(s->v[k][q]));
            loom_sb_puts(sb, "\"/>\n");
        }
        i = j;
    }
#undef SX
#undef SY
    loom_sb_puts(sb, "</g>\n");
}

static void render_svg(loom_sb *sb, const series *s, const char *path) {
    const double W = 1100, H = 780, top = 64, gap = 16, side = 16;
    const double pw = (W - 2 * side - gap) / 2, ph = (H - top - side - gap) / 2;
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    int64_t smin = INT64_MAX, smax = INT64_MIN;
    for (int64_t i = 0; i < s->n; i++) {
        if (s->step[i] < smin) smin = s->step[i];
        if (s->step[i] > smax) smax = s->step[i];
    }
    axis ax = nice_axis((double)smin, (double)smax, 8, true);
    loom_sb_printf(sb,
                   "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                   "viewBox=\"0 0 %.0f %.0f\">\n",
                   W, H, W, H);
    loom_sb_puts(sb, "<title>loom training metrics: ");
    xml_escape(sb, base);
    loom_sb_puts(sb, "</title>\n");
    loom_sb_printf(sb, "<rect width=\"%.0f\" height=\"%.0f\" fill=\"#f8f9fa\"/>\n", W, H);
    loom_sb_printf(sb, "<text x=\"%.0f\" y=\"30\" " FONT " font-size=\"20\" font-weight=\"bold\" "
                       "fill=\"#212529\">", side);
    xml_escape(sb, base);
    loom_sb_puts(sb, "</text>\n");
    loom_sb_printf(sb,
                   "<text x=\"%.0f\" y=\"50\" " FONT " font-size=\"12\" fill=\"#495057\">"
                   "loom training metrics: %" PRId64 " logged step%s, steps %" PRId64 "&#8211;%" PRId64
                   "%s%s</text>\n",
                   side, s->n, s->n == 1 ? "" : "s", smin, smax,
                   s->n_runs > 1 ? "; runs appended to the file: " : "",
                   s->n_runs > 1 ? "one colour each" : "");
    if (s->n_runs > 1) { /* legend, top right */
        int shown = s->n_runs < MAX_RUNS_DRAWN ? s->n_runs : MAX_RUNS_DRAWN;
        for (int r = 0; r < shown; r++) {
            double x = W - side - (shown - r) * 70;
            loom_sb_printf(sb,
                           "<line x1=\"%.0f\" y1=\"40\" x2=\"%.0f\" y2=\"40\" stroke=\"%s\" "
                           "stroke-width=\"3\"/><text x=\"%.0f\" y=\"44\" " FONT
                           " font-size=\"12\" fill=\"#495057\">run %d%s</text>\n",
                           x, x + 18, run_colour[r], x + 23, r + 1,
                           r == shown - 1 && s->n_runs > shown ? "+" : "");
        }
    }
    for (int k = 0; k < N_PANELS; k++)
        panel(sb, s, k, side + (k % 2) * (pw + gap), top + (k / 2) * (ph + gap), pw, ph, ax);
    loom_sb_puts(sb, "</svg>\n");
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcasecmp(s + a - b, suf);
}

int loom_cmd_plot(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (npos != 1) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "loom plot needs one metrics file: loom plot FILE.jsonl [--out FILE.svg|.html] "
                  "(`loom train --metrics-file FILE.jsonl` writes it)");
        return loom_cli_fail(ctx);
    }
    const char *in = pos[0];
    char *out = NULL;
    if (s->out) {
        out = loom_strdup(ctx, s->out);
    } else { /* beside the input: run.jsonl -> run.svg */
        size_t n = strlen(in);
        if (ends_with(in, ".jsonl")) n -= 6;
        else if (ends_with(in, ".json")) n -= 5;
        if ((out = loom_malloc(ctx, n + 5, "output name"))) snprintf(out, n + 5, "%.*s.svg", (int)n, in);
    }
    if (!out) return loom_cli_fail(ctx);
    const bool html = ends_with(out, ".html") || ends_with(out, ".htm");
    if (!html && !ends_with(out, ".svg")) {
        loom_errf(ctx, LOOM_ERR_CONFIG, "--out %s: give a file ending in .svg (the plot) or "
                                        ".html (a page embedding it)", out);
        free(out);
        return loom_cli_fail(ctx);
    }
    series sr = {0};
    loom_sb sb;
    loom_sb_init(&sb);
    loom_status st = read_metrics(ctx, in, &sr);
    if (!st) {
        if (html) {
            const char *base = strrchr(in, '/') ? strrchr(in, '/') + 1 : in;
            loom_sb_puts(&sb, "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
                              "<title>loom: ");
            xml_escape(&sb, base);
            loom_sb_puts(&sb, "</title>\n</head>\n<body style=\"margin:0;background:#f8f9fa\">\n");
        }
        render_svg(&sb, &sr, in);
        if (html) loom_sb_puts(&sb, "</body>\n</html>\n");
        if (sb.failed)
            st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory drawing %s", in);
        else
            st = loom_write_file_atomic(ctx, out, sb.buf, sb.len);
    }
    if (!st)
        LOOM_LOG_I(ctx, "wrote %s: %" PRId64 " logged steps of %s%s", out, sr.n, in,
                   sr.n_runs > 1 ? " (several runs)" : "");
    loom_sb_free(&sb);
    series_free(&sr);
    free(out);
    return st ? loom_cli_fail(ctx) : 0;
}
