/* Training metrics: the JSONL writer, TensorBoard scalars, the FLOPs
 * estimate behind MFU and the progress line (metrics.h). */
#include "metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "../io/tfevents.h"

struct loom_metrics {
    FILE *jsonl;
    char *jsonl_path;
    loom_tfevents *tb;
};

static void put_num(loom_sb *sb, const char *key, double v, bool first) {
    loom_sb_printf(sb, "%s\"%s\": ", first ? "" : ", ", key);
    if (isfinite(v))
        loom_sb_printf(sb, "%.9g", v);
    else
        loom_sb_puts(sb, "null"); /* JSON has no NaN or Infinity */
}

static void put_int(loom_sb *sb, const char *key, int64_t v) {
    loom_sb_printf(sb, ", \"%s\": %" PRId64, key, v);
}

void loom_expert_layer_stats_of(const double *cnt, int64_t E, loom_expert_layer_stats *out) {
    double lo = E > 0 ? INFINITY : 0.0, hi = 0.0, sum = 0.0;
    for (int64_t e = 0; e < E; e++) lo = fmin(lo, cnt[e]), hi = fmax(hi, cnt[e]), sum += cnt[e];
    out->min = lo, out->max = hi;
    out->mean = E > 0 ? sum / (double)E : 0.0;
    out->imbalance = sum > 0 ? hi / out->mean : 0.0;
}

/* the layers of r->expert_tokens with tokens (MoE layers) */
static bool layer_has_tokens(const loom_metrics_record *r, int64_t l) {
    for (int64_t e = 0; e < r->experts; e++)
        if (r->expert_tokens[l * r->experts + e] > 0) return true;
    return false;
}

/* "key": [the layers' values], field f of their stats (-1: the index) */
static void put_layers(loom_sb *sb, const loom_metrics_record *r, const char *key, int f) {
    loom_sb_printf(sb, ", \"%s\": [", key);
    bool first = true;
    for (int64_t l = 0; l < r->layers; l++) {
        if (!layer_has_tokens(r, l)) continue;
        loom_sb_puts(sb, first ? "" : ", ");
        first = false;
        if (f < 0) {
            loom_sb_printf(sb, "%" PRId64, l);
            continue;
        }
        loom_expert_layer_stats ls;
        loom_expert_layer_stats_of(r->expert_tokens + l * r->experts, r->experts, &ls);
        const double v[4] = {ls.min, ls.mean, ls.max, ls.imbalance};
        loom_sb_printf(sb, "%.9g", v[f]);
    }
    loom_sb_puts(sb, "]");
}

void loom_metrics_jsonl(loom_sb *sb, const loom_metrics_record *r) {
    loom_sb_printf(sb, "{\"step\": %" PRId64, r->step);
    put_int(sb, "consumed_samples", r->consumed_samples);
    put_int(sb, "consumed_tokens", r->consumed_tokens);
    put_num(sb, "loss", r->loss, false);
    put_num(sb, "grad_norm", r->grad_norm, false);
    put_num(sb, "lr", r->lr, false);
    put_num(sb, "tokens_per_s", r->tokens_per_s, false);
    if (!isnan(r->mfu)) put_num(sb, "mfu", r->mfu, false);
    if (r->peak_mem_bytes >= 0) put_int(sb, "peak_mem_bytes", r->peak_mem_bytes);
    put_int(sb, "skipped_steps", r->skipped_steps);
    put_num(sb, "elapsed_s", r->elapsed_s, false);
    if (r->moe) {
        put_num(sb, "aux_loss", r->aux_loss, false);
        put_num(sb, "expert_tokens_min", r->expert_tokens_min, false);
        put_num(sb, "expert_tokens_mean", r->expert_tokens_mean, false);
        put_num(sb, "expert_tokens_max", r->expert_tokens_max, false);
        put_num(sb, "expert_imbalance", r->expert_imbalance, false);
        if (r->z) put_num(sb, "z_loss", r->z_loss, false);
        if (r->expert_tokens) {
            put_layers(sb, r, "moe_layers", -1);
            put_layers(sb, r, "expert_tokens_min_by_layer", 0);
            put_layers(sb, r, "expert_tokens_mean_by_layer", 1);
            put_layers(sb, r, "expert_tokens_max_by_layer", 2);
            put_layers(sb, r, "expert_imbalance_by_layer", 3);
        }
    }
    if (r->prof.steps > 0) {
        put_num(sb, "compute_ms", r->prof.compute_ms, false);
        put_num(sb, "exposed_comm_ms", r->prof.comm_ms, false);
        put_num(sb, "bubble_ms", r->prof.bubble_ms, false);
        put_num(sb, "idle_ms", r->prof.idle_ms, false);
    }
    loom_sb_puts(sb, "}\n");
}

static const struct {
    const char *key, *tag;
} tb_tags[] = {
    {"consumed_samples", "consumed-samples"},
    {"consumed_tokens", "consumed-tokens"},
    {"loss", "lm loss"},
    {"grad_norm", "grad-norm"},
    {"lr", "learning-rate"},
    {"tokens_per_s", "throughput/tokens_per_s"},
    {"mfu", "mfu"},
    {"peak_mem_bytes", "mem/peak_gib"},
    {"skipped_steps", "skipped-iterations"},
    {"elapsed_s", "elapsed-time-s"},
    {"aux_loss", "load_balancing_loss"},
    {"expert_tokens_max", "moe/expert_tokens_max"},
    {"expert_imbalance", "moe/expert_imbalance"},
    {"z_loss", "z_loss"},
    {"compute_ms", "time/compute_ms"},
    {"exposed_comm_ms", "time/exposed_comm_ms"},
    {"bubble_ms", "time/bubble_ms"},
    {"idle_ms", "time/idle_ms"},
};
#define N_TAGS (sizeof tb_tags / sizeof tb_tags[0])

const char *loom_metrics_tb_tag(const char *key) {
    for (size_t i = 0; i < N_TAGS; i++)
        if (!strcmp(tb_tags[i].key, key)) return tb_tags[i].tag;
    return NULL;
}

loom_status loom_metrics_open(loom_ctx *ctx, const char *jsonl_path, const char *tb_dir,
                              loom_metrics **out) {
    *out = NULL;
    loom_metrics *m = loom_calloc(ctx, 1, sizeof *m, "metrics writer");
    if (!m) return LOOM_ERR_OOM;
    loom_status st = LOOM_OK;
    if (jsonl_path) {
        if (!*jsonl_path) {
            st = loom_errf(ctx, LOOM_ERR_INVALID_ARG, "--metrics-file is empty: give a file name");
        } else if (!(m->jsonl_path = loom_strdup(ctx, jsonl_path))) {
            st = LOOM_ERR_OOM;
        } else if (!(m->jsonl = fopen(jsonl_path, "a"))) {
            st = loom_errf(ctx, LOOM_ERR_IO, "--metrics-file %s: cannot open for appending: %s",
                           jsonl_path, strerror(errno));
        }
    }
    if (!st && tb_dir) st = loom_tfevents_open(ctx, tb_dir, &m->tb);
    if (st) {
        loom_metrics_close(NULL, m);
        return st;
    }
    *out = m;
    return LOOM_OK;
}

loom_status loom_metrics_write(loom_ctx *ctx, loom_metrics *m, const loom_metrics_record *r) {
    if (m->jsonl) {
        loom_sb sb;
        loom_sb_init(&sb);
        loom_metrics_jsonl(&sb, r);
        loom_status st = LOOM_OK;
        if (sb.failed)
            st = loom_errf(ctx, LOOM_ERR_OOM, "%s: out of memory", m->jsonl_path);
        else if (fwrite(sb.buf, 1, sb.len, m->jsonl) != sb.len || fflush(m->jsonl) != 0)
            st = loom_errf(ctx, LOOM_ERR_IO, "%s: write failed: %s", m->jsonl_path,
                           strerror(errno));
        loom_sb_free(&sb);
        if (st) return st;
    }
    if (m->tb) {
        /* the fixed tags, then a layer's imbalance each (its tag in names) */
        const int64_t nl = r->moe && r->expert_tokens ? r->layers : 0;
        loom_tb_scalar *v = loom_calloc(ctx, N_TAGS + (size_t)nl, sizeof *v, "TensorBoard scalars");
        char *names = nl ? loom_calloc(ctx, (size_t)nl, 48, "TensorBoard tags") : NULL;
        if (!v || (nl && !names)) {
            free(v);
            return LOOM_ERR_OOM;
        }
        size_t n = 0;
#define TB(k, x) v[n++] = (loom_tb_scalar){loom_metrics_tb_tag(k), (x)}
        TB("consumed_samples", (double)r->consumed_samples);
        TB("consumed_tokens", (double)r->consumed_tokens);
        /* a non-finite value is left out of the event (as of the JSONL: null) */
        if (isfinite(r->loss)) TB("loss", r->loss);
        if (isfinite(r->grad_norm)) TB("grad_norm", r->grad_norm);
        if (isfinite(r->lr)) TB("lr", r->lr);
        if (isfinite(r->tokens_per_s)) TB("tokens_per_s", r->tokens_per_s);
        if (isfinite(r->mfu)) TB("mfu", r->mfu);
        if (r->peak_mem_bytes >= 0) TB("peak_mem_bytes", (double)r->peak_mem_bytes / (1u << 30));
        TB("skipped_steps", (double)r->skipped_steps);
        if (isfinite(r->elapsed_s)) TB("elapsed_s", r->elapsed_s);
        if (r->moe) {
            TB("aux_loss", r->aux_loss);
            TB("expert_tokens_max", r->expert_tokens_max);
            TB("expert_imbalance", r->expert_imbalance);
            if (r->z) TB("z_loss", r->z_loss);
        }
        if (r->prof.steps > 0) {
            TB("compute_ms", r->prof.compute_ms);
            TB("exposed_comm_ms", r->prof.comm_ms);
            TB("bubble_ms", r->prof.bubble_ms);
            TB("idle_ms", r->prof.idle_ms);
        }
#undef TB
        for (int64_t l = 0; l < nl; l++) {
            if (!layer_has_tokens(r, l)) continue;
            loom_expert_layer_stats ls;
            loom_expert_layer_stats_of(r->expert_tokens + l * r->experts, r->experts, &ls);
            char *tag = names + l * 48;
            snprintf(tag, 48, "moe/expert_imbalance/layer_%" PRId64, l);
            v[n++] = (loom_tb_scalar){tag, ls.imbalance};
        }
        loom_status st = loom_tfevents_write(ctx, m->tb, r->step, v, n);
        free(v);
        free(names);
        if (st) return st;
    }
    return LOOM_OK;
}

const char *loom_metrics_tb_path(const loom_metrics *m) {
    return m->tb ? loom_tfevents_path(m->tb) : NULL;
}

loom_status loom_metrics_close(loom_ctx *ctx, loom_metrics *m) {
    if (!m) return LOOM_OK;
    loom_status st = LOOM_OK;
    if (m->jsonl && fclose(m->jsonl) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: close failed: %s", m->jsonl_path, strerror(errno));
    loom_status st2 = loom_tfevents_close(ctx, m->tb);
    free(m->jsonl_path);
    free(m);
    return st ? st : st2;
}

/* ---- FLOPs and peaks ---- */

double loom_flops_per_token(const loom_model_config *c, int64_t seq_len, bool lora) {
    const double H = (double)c->hidden_size, Hq = (double)c->num_heads, D = (double)c->head_dim;
    const double Hkv = (double)(c->num_kv_heads ? c->num_kv_heads : c->num_heads);
    double attn = H * Hq * D + 2 * H * Hkv * D + Hq * D * H;
    if (c->qkv_bias) attn += Hq * D + 2 * Hkv * D;
    if (c->o_bias) attn += H;
    if (c->qk_norm) attn += 2 * D;
    double n = 0;
    for (int64_t l = 0; l < c->num_layers; l++) {
        double mlp;
        if (loom_config_layer_is_moe(c, l)) /* the router and the top-k experts a token visits */
            mlp = H * (double)c->num_experts +
                  (double)c->num_experts_per_tok * 3 * H * (double)c->moe_intermediate_size +
                  (c->shared_expert_intermediate_size /* and the shared expert, its gate */
                       ? 3 * H * (double)c->shared_expert_intermediate_size + H
                       : 0);
        else
            mlp = 3 * H * (double)c->intermediate_size + (c->mlp_bias ? 2 * (double)c->intermediate_size + H : 0);
        n += attn + mlp + 2 * H; /* two RMSNorms */
    }
    n += H + (double)c->vocab_size * H; /* final norm, output layer */
    const double attn_core = 6.0 * (double)c->num_layers * (double)seq_len * Hq * D;
    return (lora ? 4.0 : 6.0) * n + attn_core;
}

double loom_gpu_peak_flops(const char *name) {
    if (!name) return 0;
    /* most specific first: the H100 PCIe and NVL boards run lower clocks */
    static const struct {
        const char *has;
        double tflops;
    } gpus[] = {{"H100 PCIe", 756}, {"H100 NVL", 835}, {"H100", 989}, {"H200", 989},
                {"GH200", 989},     {"H800", 989},     {"A100", 312}};
    for (size_t i = 0; i < sizeof gpus / sizeof gpus[0]; i++)
        if (strstr(name, gpus[i].has)) return gpus[i].tflops * 1e12;
    return 0;
}

int64_t loom_max_rss_bytes(void) {
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return -1;
    return (int64_t)ru.ru_maxrss * 1024; /* Linux: kilobytes */
}

/* ---- progress line ---- */

const char *loom_fmt_duration(char buf[32], double s) {
    if (!isfinite(s) || s < 0) {
        snprintf(buf, 32, "--");
        return buf;
    }
    if (s >= 1e9) s = 1e9;
    long long t = llround(s);
    if (t < 60)
        snprintf(buf, 32, "%llds", t);
    else if (t < 3600)
        snprintf(buf, 32, "%lldm%02llds", t / 60, t % 60);
    else if (t < 86400)
        snprintf(buf, 32, "%lldh%02lldm", t / 3600, t % 3600 / 60);
    else
        snprintf(buf, 32, "%lldd%02lldh", t / 86400, t % 86400 / 3600);
    return buf;
}

double loom_eta_s(int64_t step, int64_t total, double first_step_end_s, double now_s) {
    if (step <= 1 || total < step) return NAN;
    double per_step = (now_s - first_step_end_s) / (double)(step - 1);
    if (!(per_step >= 0)) return NAN;
    return per_step * (double)(total - step);
}

void loom_progress_line(char *buf, size_t n, int64_t step, int64_t total, double loss,
                        double tokens_per_s, double eta_s, int width) {
    if (n == 0) return;
    char eta[32], tps[32], ls[32];
    loom_fmt_duration(eta, eta_s);
    loom_fmt_int(tps, isfinite(tokens_per_s) && tokens_per_s >= 0 ? (int64_t)llround(tokens_per_s) : 0);
    if (isfinite(loss))
        snprintf(ls, sizeof ls, "%.4f", loss);
    else
        snprintf(ls, sizeof ls, "%s", isnan(loss) ? "nan" : "inf");
    double frac = total > 0 ? (double)step / (double)total : 0;
    if (frac < 0) frac = 0;
    if (frac > 1) frac = 1;
    enum { BAR = 20 };
    char bar[BAR + 1];
    int filled = (int)(frac * BAR);
    for (int i = 0; i < BAR; i++) bar[i] = i < filled ? '=' : i == filled ? '>' : ' ';
    bar[BAR] = '\0';
    snprintf(buf, n, "step %" PRId64 "/%" PRId64 " [%s] %3d%%  loss %s  %s tok/s  ETA %s", step,
             total, bar, (int)(frac * 100), ls, tps, eta);
    if (width > 0 && (size_t)width < n) buf[width] = '\0';
}
