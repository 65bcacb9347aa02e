/* The Gated DeltaNet ops in a whole model: the tiny Qwen3.5 fixture
 * (fixtures_qwen3_5, made by transformers 5.17 in float64 with its Gated
 * DeltaNet kernel in float32) run forward here from loom's CPU ops (three
 * linear-attention layers: projections, gdn_conv, gdn_gate, gdn_fwd,
 * gdn_norm; one gated full-attention layer with partial RoPE; zero-centred
 * RMSNorms; tied head), its logits and its packed documents' log-probs
 * held to transformers'. The model's own wiring is not this: this checks
 * the ops' semantics (channel order, head grouping, gates, norms, document
 * restarts) against the reference end to end. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../src/backend/cpu/cpu_gdn.h"
#include "../src/backend/cpu/cpu_ops.h"
#include "../src/io/safetensors.h"
#include "harness.h"

enum { HID = 64, VOC = 1024, NL = 4, FF = 128 };
enum { HK = 2, HV = 4, DK = 16, DV = 16, CONVK = 4, CQKV = 2 * HK * DK + HV * DV };
enum { HQ = 4, HKV = 2, HD = 16, ROT = 4 };
#define EPS 1e-6f
#define PFX "model.language_model."

typedef struct fx {
    loom_ctx *ctx;
    loom_safetensors *w;
    bool ok;
} fx;

/* the weight `name` (after PFX) as fp32 (numel n), 1 + w when plus1 */
static float *wt(fx *f, const char *name, int64_t n, bool plus1) {
    char full[256];
    snprintf(full, sizeof full, PFX "%s", name);
    const loom_st_tensor *t = loom_st_find(f->w, full);
    float *p = calloc((size_t)n, sizeof(float));
    if (!t || (int64_t)t->numel != n || loom_st_read(f->ctx, t, LOOM_F32, p, (uint64_t)n)) {
        loom_test_fail(__FILE__, __LINE__, "fixture weight %s missing or not %lld values", full,
                       (long long)n);
        f->ok = false;
        return p;
    }
    if (plus1)
        for (int64_t i = 0; i < n; i++) p[i] += 1.0f;
    return p;
}

static float *wtl(fx *f, int l, const char *name, int64_t n, bool plus1) {
    char s[200];
    snprintf(s, sizeof s, "layers.%d.%s", l, name);
    return wt(f, s, n, plus1);
}

/* y (T, out) = x (T, in) W^T */
static void lin(const float *x, int64_t T, int64_t in, const float *W, int64_t out, float *y) {
    loom_cpu_sgemm(false, true, T, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
}

static void gdn_layer(fx *f, int l, const float *xn, int64_t T, const int32_t *cu, int64_t nd,
                      float *out) {
    float *Wqkv = wtl(f, l, "linear_attn.in_proj_qkv.weight", CQKV * HID, false);
    float *Wz = wtl(f, l, "linear_attn.in_proj_z.weight", HV * DV * HID, false);
    float *Wb = wtl(f, l, "linear_attn.in_proj_b.weight", HV * HID, false);
    float *Wa = wtl(f, l, "linear_attn.in_proj_a.weight", HV * HID, false);
    float *cw = wtl(f, l, "linear_attn.conv1d.weight", CQKV * CONVK, false);
    float *Al = wtl(f, l, "linear_attn.A_log", HV, false);
    float *dt = wtl(f, l, "linear_attn.dt_bias", HV, false);
    float *nw = wtl(f, l, "linear_attn.norm.weight", DV, false);
    float *Wo = wtl(f, l, "linear_attn.out_proj.weight", HID * HV * DV, false);
    float *pre = calloc(T * CQKV, 4), *qkv = calloc(T * CQKV, 4), *z = calloc(T * HV * DV, 4);
    float *a = calloc(T * HV, 4), *b = calloc(T * HV, 4), *g = calloc(T * HV, 4);
    float *beta = calloc(T * HV, 4), *o = calloc(T * HV * DV, 4), *y = calloc(T * HV * DV, 4);
    float *rstd = calloc(T * HV, 4);
    lin(xn, T, HID, Wqkv, CQKV, pre);
    lin(xn, T, HID, Wz, HV * DV, z);
    lin(xn, T, HID, Wb, HV, b);
    lin(xn, T, HID, Wa, HV, a);
    CHECK_OK(f->ctx, loom_cpu_gdn_conv_fwd(f->ctx, pre, cw, T, CQKV, CONVK, cu, nd, qkv));
    CHECK_OK(f->ctx, loom_cpu_gdn_gate_fwd(f->ctx, a, b, Al, dt, T, HV, g, beta));
    CHECK_OK(f->ctx, loom_cpu_gdn_fwd(f->ctx, qkv, g, beta, T, HK, HV, DK, DV, cu, nd, o));
    CHECK_OK(f->ctx, loom_cpu_gdn_norm_fwd(f->ctx, o, z, nw, T * HV, DV, EPS, y, rstd));
    lin(y, T, HV * DV, Wo, HID, out);
    free(Wqkv), free(Wz), free(Wb), free(Wa), free(cw), free(Al), free(dt), free(nw), free(Wo);
    free(pre), free(qkv), free(z), free(a), free(b), free(g), free(beta), free(o), free(y);
    free(rstd);
}

/* RoPE on the first ROT dims of each of nh heads of x (T, nh, HD) */
static void rope_part(float *x, int64_t T, int64_t nh, const int32_t *pos) {
    float inv[ROT / 2];
    loom_rope_inv_freq(0, 1e7, ROT, 1, 1, 1, 0, inv);
    loom_cpu_rope_fwd(x, T, nh, HD, ROT, pos, inv); /* the first ROT of HD turn */
}

static void attn_layer(fx *f, int l, const float *xn, int64_t T, const int32_t *cu, int64_t nd,
                       const int32_t *pos, float *out) {
    float *Wq = wtl(f, l, "self_attn.q_proj.weight", 2 * HQ * HD * HID, false);
    float *Wk = wtl(f, l, "self_attn.k_proj.weight", HKV * HD * HID, false);
    float *Wv = wtl(f, l, "self_attn.v_proj.weight", HKV * HD * HID, false);
    float *Wo = wtl(f, l, "self_attn.o_proj.weight", HID * HQ * HD, false);
    float *qn = wtl(f, l, "self_attn.q_norm.weight", HD, false);
    float *kn = wtl(f, l, "self_attn.k_norm.weight", HD, false);
    float *qg = calloc(T * 2 * HQ * HD, 4), *q = calloc(T * HQ * HD, 4);
    float *gate = calloc(T * HQ * HD, 4), *k = calloc(T * HKV * HD, 4);
    float *v = calloc(T * HKV * HD, 4), *o = calloc(T * HQ * HD, 4), *lse = calloc(T * HQ, 4);
    float *rs = calloc(T * HQ, 4);
    lin(xn, T, HID, Wq, 2 * HQ * HD, qg);
    lin(xn, T, HID, Wk, HKV * HD, k);
    lin(xn, T, HID, Wv, HKV * HD, v);
    for (int64_t i = 0; i < T * HQ; i++) { /* per head: q, then its gate */
        memcpy(q + i * HD, qg + i * 2 * HD, HD * 4);
        memcpy(gate + i * HD, qg + i * 2 * HD + HD, HD * 4);
    }
    loom_cpu_rmsnorm_fwd(q, qn, 1.0f, T * HQ, HD, EPS, q, rs);
    loom_cpu_rmsnorm_fwd(k, kn, 1.0f, T * HKV, HD, EPS, k, rs);
    rope_part(q, T, HQ, pos);
    rope_part(k, T, HKV, pos);
    loom_cpu_attention_fwd(q, k, v, T, HQ, HKV, HD, cu, nd, 0.25f, o, lse);
    for (int64_t i = 0; i < T * HQ * HD; i++) o[i] *= 1.0f / (1.0f + expf(-gate[i]));
    lin(o, T, HQ * HD, Wo, HID, out);
    free(Wq), free(Wk), free(Wv), free(Wo), free(qn), free(kn), free(qg), free(q), free(gate);
    free(k), free(v), free(o), free(lse), free(rs);
}

/* logits (T, VOC) of ids in documents cu at positions pos */
static void forward(fx *f, const int32_t *ids, int64_t T, const int32_t *cu, int64_t nd,
                    const int32_t *pos, float *logits) {
    float *E = wt(f, "embed_tokens.weight", VOC * HID, false);
    float *h = calloc(T * HID, 4), *xn = calloc(T * HID, 4), *d = calloc(T * HID, 4);
    float *gu = calloc(2 * T * FF, 4), *act = calloc(T * FF, 4), *rs = calloc(T, 4);
    loom_cpu_embedding_fwd(ids, T, E, HID, h);
    for (int l = 0; l < NL && f->ok; l++) {
        float *win = wtl(f, l, "input_layernorm.weight", HID, false);
        float *wpost = wtl(f, l, "post_attention_layernorm.weight", HID, false);
        float *Wg = wtl(f, l, "mlp.gate_proj.weight", FF * HID, false);
        float *Wu = wtl(f, l, "mlp.up_proj.weight", FF * HID, false);
        float *Wd = wtl(f, l, "mlp.down_proj.weight", HID * FF, false);
        loom_cpu_rmsnorm_fwd(h, win, 1.0f, T, HID, EPS, xn, rs);
        if (l < 3)
            gdn_layer(f, l, xn, T, cu, nd, d);
        else
            attn_layer(f, l, xn, T, cu, nd, pos, d);
        loom_cpu_residual_add(h, d, T * HID);
        loom_cpu_rmsnorm_fwd(h, wpost, 1.0f, T, HID, EPS, xn, rs);
        lin(xn, T, HID, Wg, FF, gu);
        lin(xn, T, HID, Wu, FF, gu + T * FF);
        loom_cpu_swiglu_fwd(gu, gu + T * FF, T * FF, act);
        lin(act, T, FF, Wd, HID, d);
        loom_cpu_residual_add(h, d, T * HID);
        free(win), free(wpost), free(Wg), free(Wu), free(Wd);
    }
    float *wn = wt(f, "norm.weight", HID, false);
    loom_cpu_rmsnorm_fwd(h, wn, 1.0f, T, HID, EPS, xn, rs);
    lin(xn, T, HID, E, VOC, logits);
    free(E), free(h), free(xn), free(d), free(gu), free(act), free(rs), free(wn);
}

/* n int32 from an integer tensor (I64 or I32) of the golden file */
static bool ints(fx *f, loom_safetensors *gd, const char *name, int32_t *dst, int64_t n) {
    const loom_st_tensor *t = loom_st_find(gd, name);
    if (!t || (int64_t)t->numel != n) return false;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = 0;
        if (t->dtype == LOOM_I64) {
            memcpy(&v, (const char *)t->data + 8 * i, 8);
        } else {
            int32_t w;
            memcpy(&w, (const char *)t->data + 4 * i, 4);
            v = w;
        }
        dst[i] = (int32_t)v;
    }
    (void)f;
    return true;
}

TEST(gdn_ops_reproduce_qwen3_5_fixture) {
    const char *dir = loom_dir_exists("tests/fixtures_qwen3_5") ? "tests/fixtures_qwen3_5"
                                                                : "../shared/fixtures_qwen3_5";
    if (!loom_dir_exists(dir))
        SKIP("no fixtures_qwen3_5 (tests/ or ../shared beside the checkout)");
    fx f = {.ok = true};
    REQUIRE(loom_ctx_create(&f.ctx) == LOOM_OK);
    char p[512];
    loom_safetensors *gd = NULL;
    snprintf(p, sizeof p, "%s/models/tiny-qwen3_5/model.safetensors", dir);
    REQUIRE(loom_st_open_file(f.ctx, p, &f.w) == LOOM_OK);
    snprintf(p, sizeof p, "%s/golden/tiny-qwen3_5.safetensors", dir);
    REQUIRE(loom_st_open_file(f.ctx, p, &gd) == LOOM_OK);

    /* two rows of 80 tokens as two documents: the logits */
    enum { B = 2, T = 80 };
    int32_t ids[B * T], pos[B * T], cu[B + 1] = {0, T, 2 * T};
    REQUIRE(ints(&f, gd, "input_ids", ids, B * T));
    for (int i = 0; i < B * T; i++) pos[i] = i % T;
    float *lg = calloc(B * T * VOC, 4), *ref = calloc(B * T * VOC, 4);
    forward(&f, ids, B * T, cu, B, pos, lg);
    REQUIRE(f.ok);
    REQUIRE(loom_st_read(f.ctx, loom_st_find(gd, "logits"), LOOM_F32, ref, B * T * VOC) == LOOM_OK);
    double e = 0, m = 0;
    for (int64_t i = 0; i < B * T * VOC; i++) {
        e = fmax(e, fabs((double)lg[i] - ref[i]));
        m = fmax(m, fabs((double)ref[i]));
    }
    printf("  logits (2 x 80): max error %.2e (max |logit| %.2f)\n", e, m);
    CHECK_MSG(e < 1e-4 * m, "logits off transformers' by %.3g", e);

    /* the packed documents of 7, 70 and 21 tokens: each token's log-prob of the next */
    enum { TP = 98 };
    int32_t pid[TP], ppos[TP], pcu[4];
    REQUIRE(ints(&f, gd, "packed.input_ids", pid, TP) &&
            ints(&f, gd, "packed.position_ids", ppos, TP) &&
            ints(&f, gd, "packed.cu_seqlens", pcu, 4));
    float *plg = calloc(TP * VOC, 4), plp[TP];
    forward(&f, pid, TP, pcu, 3, ppos, plg);
    REQUIRE(loom_st_read(f.ctx, loom_st_find(gd, "packed.token_logprobs"), LOOM_F32, plp, TP) ==
            LOOM_OK);
    double ep = 0;
    for (int d = 0; d < 3; d++)
        for (int t = pcu[d]; t + 1 < pcu[d + 1]; t++) {
            const float *z = plg + (int64_t)t * VOC;
            double mx = -INFINITY, s = 0;
            for (int v = 0; v < VOC; v++) mx = fmax(mx, z[v]);
            for (int v = 0; v < VOC; v++) s += exp(z[v] - mx);
            ep = fmax(ep, fabs(z[pid[t + 1]] - mx - log(s) - plp[t]));
        }
    printf("  packed documents 7, 70, 21: log-probs max error %.2e\n", ep);
    CHECK_MSG(ep < 1e-4, "packed log-probs off transformers' by %.3g", ep);
    free(lg), free(ref), free(plg);
    loom_st_close(gd);
    loom_st_close(f.w);
    loom_ctx_free(f.ctx);
}
