/* transformers v5's fused experts (src/io/hf_experts.h): a fused copy of the
 * tiny-qwen3-moe fixture (hub layout) reads as the fixture bit for bit; the
 * malformed ones are refused with messages that name the file, the tensor
 * and what was expected; the writer's fused layout holds the fixture's
 * experts and reads back to them; a model saves in the layout it read;
 * `loom inspect` and `loom convert` read fused checkpoints. */
#include <stdarg.h>
#include <stdlib.h>

#include "../include/loom.h"
#include "../src/core/json.h"
#include "../src/io/export.h"
#include "../src/io/hf_config.h"
#include "../src/io/safetensors.h"
#include "../src/model/params.h"
#include "harness.h"

/* the fixture: 4 layers of 8 experts, moe_intermediate_size 32, hidden 64, F32 */
enum { NL = 4, NE = 8, NI = 32, NH = 64 };

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static const char *hub_dir(void) {
    static char buf[1024];
    snprintf(buf, sizeof buf, "%s/models/tiny-qwen3-moe", loom_test_fixtures());
    return buf;
}

static const char *tmp(char *buf, size_t cap, const char *sub) {
    snprintf(buf, cap, "%s/%s", loom_test_tmpdir(), sub);
    return buf;
}

static const loom_st_tensor *expert(const loom_safetensors *st, int l, int e, const char *leaf) {
    char name[160];
    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s.weight", l, e, leaf);
    return loom_st_find(st, name);
}

/* A fused copy of the hub fixture in dir (max_shard 0: one file), with its
 * config.json: every other tensor as it is, declared first, then each
 * layer's gate_up_proj and down_proj. */
static loom_status write_fused_copy(loom_ctx *ctx, const char *dir, uint64_t max_shard) {
    loom_safetensors *in = NULL;
    loom_st_writer *w = NULL;
    float *gu = malloc(sizeof(float) * NE * 2 * NI * NH),
          *dn = malloc(sizeof(float) * NE * NH * NI);
    char name[160], *text = NULL, path[1100];
    size_t len;
    loom_status s = loom_st_open_dir(ctx, hub_dir(), "model", &in);
    if (!s) s = loom_st_writer_create(ctx, dir, "model", max_shard, NULL, &w);
    for (size_t i = 0; !s && i < loom_st_count(in); i++) {
        const loom_st_tensor *t = loom_st_at(in, i);
        if (!strstr(t->name, ".mlp.experts."))
            s = loom_st_writer_declare(ctx, w, t->name, t->dtype, t->ndim, t->shape);
    }
    for (int l = 0; !s && l < NL; l++) {
        const int64_t sgu[3] = {NE, 2 * NI, NH}, sdn[3] = {NE, NH, NI};
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        s = loom_st_writer_declare(ctx, w, name, LOOM_F32, 3, sgu);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        if (!s) s = loom_st_writer_declare(ctx, w, name, LOOM_F32, 3, sdn);
    }
    for (size_t i = 0; !s && i < loom_st_count(in); i++) {
        const loom_st_tensor *t = loom_st_at(in, i);
        if (!strstr(t->name, ".mlp.experts."))
            s = loom_st_writer_write(ctx, w, t->name, t->dtype, t->data);
    }
    const size_t IH = (size_t)NI * NH;
    for (int l = 0; !s && l < NL; l++) {
        for (int e = 0; e < NE; e++) {
            memcpy(gu + e * 2 * IH, expert(in, l, e, "gate_proj")->data, IH * sizeof(float));
            memcpy(gu + e * 2 * IH + IH, expert(in, l, e, "up_proj")->data, IH * sizeof(float));
            memcpy(dn + e * IH, expert(in, l, e, "down_proj")->data, IH * sizeof(float));
        }
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        s = loom_st_writer_write(ctx, w, name, LOOM_F32, gu);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        if (!s) s = loom_st_writer_write(ctx, w, name, LOOM_F32, dn);
    }
    if (!s) s = loom_st_writer_finish(ctx, w);
    snprintf(path, sizeof path, "%s/config.json", hub_dir());
    if (!s) s = loom_read_file(ctx, path, 0, &text, &len);
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (!s) s = loom_write_file_atomic(ctx, path, text, len);
    free(text);
    loom_st_writer_free(w);
    loom_st_close(in);
    free(gu);
    free(dn);
    return s;
}

/* b holds exactly a's tensors, of the same dtype, shape and bytes; the
 * experts are views when b_fused. */
static void check_same(const loom_safetensors *a, const loom_safetensors *b, bool b_fused) {
    CHECK_EQ_INT(loom_st_count(b), loom_st_count(a));
    for (size_t i = 0; i < loom_st_count(a); i++) {
        const loom_st_tensor *x = loom_st_at(a, i), *y = loom_st_find(b, x->name);
        CHECK_MSG(y, "%s is missing", x->name);
        if (!y) continue;
        bool same = x->dtype == y->dtype && x->ndim == y->ndim && x->numel == y->numel &&
                    x->nbytes == y->nbytes && !memcmp(x->data, y->data, x->nbytes);
        for (int d = 0; d < x->ndim; d++) same = same && x->shape[d] == y->shape[d];
        CHECK_MSG(same, "%s differs", x->name);
        CHECK_EQ_INT(y->view, b_fused && strstr(x->name, ".mlp.experts."));
    }
}

typedef struct spec {
    const char *name;
    int ndim;
    int64_t shape[4];
} spec;

/* dir/model.safetensors with the tensors of s, F32. */
static loom_status write_specs(loom_ctx *ctx, const char *dir, const spec *s, int n) {
    loom_st_writer *w = NULL;
    float *buf = calloc(4096, sizeof(float));
    loom_status st = loom_st_writer_create(ctx, dir, "model", 0, NULL, &w);
    for (int i = 0; !st && i < n; i++)
        st = loom_st_writer_declare(ctx, w, s[i].name, LOOM_F32, s[i].ndim, s[i].shape);
    for (int i = 0; !st && i < n; i++) st = loom_st_writer_write(ctx, w, s[i].name, LOOM_F32, buf);
    if (!st) st = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    free(buf);
    return st;
}

/* ---- reading ---- */

/* the hub fixture through loom_hf_dir_open and a fused copy of it */
TEST(hf_experts_fused_copy_reads_as_hub) {
    REQUIRE_FIXTURE(hub_dir());
    loom_ctx *ctx = new_ctx();
    char one[1024], sharded[1024];
    REQUIRE_OK(ctx, write_fused_copy(ctx, tmp(one, sizeof one, "fused"), 0));
    /* each fused tensor in a shard of its own: a view's file is its fused tensor's */
    REQUIRE_OK(ctx, write_fused_copy(ctx, tmp(sharded, sizeof sharded, "fused-sharded"), 150000));
    loom_safetensors *hub, *f1, *f2, *raw;
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, hub_dir(), &hub));
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, one, &f1));
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, sharded, &f2));
    CHECK(!loom_hf_dir_experts_fused(hub));
    CHECK(loom_hf_dir_experts_fused(f1) && loom_hf_dir_experts_fused(f2));
    check_same(hub, f1, true);
    check_same(hub, f2, true);
    /* the fused names are gone; the files hold them */
    CHECK(!loom_st_find(f1, "model.layers.0.mlp.experts.gate_up_proj"));
    CHECK(!loom_st_find(f1, "model.layers.3.mlp.experts.down_proj"));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, one, "model", &raw));
    CHECK_EQ_INT(loom_st_count(raw), loom_st_count(hub) - NL * NE * 3 + NL * 2);
    CHECK(loom_st_find(raw, "model.layers.3.mlp.experts.down_proj") != NULL);
    CHECK_EQ_INT(loom_st_total_bytes(f1), loom_st_total_bytes(raw));
    loom_st_close(raw);
    CHECK(loom_st_file_count(f2) > 2);
    const loom_st_tensor *g = expert(f2, 2, 5, "gate_proj"), *d = expert(f2, 2, 5, "down_proj");
    REQUIRE(g && d);
    CHECK(g->file != d->file);
    CHECK_CONTAINS(loom_st_file_path(f2, g->file), "fused-sharded/model-0000");
    /* a view reads as an entry does */
    float *v = malloc(sizeof(float) * NI * NH), *ref = malloc(sizeof(float) * NI * NH);
    const int64_t shape[2] = {NI, NH};
    CHECK_OK(ctx, loom_st_read_named(ctx, f2, "model.layers.1.mlp.experts.7.up_proj.weight", 2,
                                     shape, LOOM_F32, v));
    CHECK_OK(ctx, loom_st_read_named(ctx, hub, "model.layers.1.mlp.experts.7.up_proj.weight", 2,
                                     shape, LOOM_F32, ref));
    CHECK(!memcmp(v, ref, sizeof(float) * NI * NH));
    CHECK(loom_st_read_named(ctx, f2, "model.layers.1.mlp.experts.7.down_proj.weight", 2, shape,
                             LOOM_F32, v) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "[64, 32]");
    free(v);
    free(ref);
    loom_st_close(hub);
    loom_st_close(f1);
    loom_st_close(f2);
    loom_ctx_free(ctx);
}

/* `loom inspect` and `loom convert` read a fused checkpoint by the hub's names */
TEST(hf_experts_cli_inspect_and_convert) {
    REQUIRE_FIXTURE(hub_dir());
    loom_ctx *ctx = new_ctx();
    char dir[1024], out[1024], *text = NULL;
    REQUIRE_OK(ctx, write_fused_copy(ctx, tmp(dir, sizeof dir, "cli-fused"), 0));
    const char *inspect[] = {loom_test_bin(), "inspect", dir, "--format", "json", NULL};
    CHECK_EQ_INT(loom_test_run(&text, inspect), 0);
    loom_json *doc = NULL;
    CHECK_OK(ctx, loom_json_parse(ctx, text, strlen(text), "inspect output", &doc));
    free(text);
    REQUIRE(doc);
    int64_t found = -1;
    CHECK_OK(ctx, loom_json_get_int(ctx, doc, "found", "inspect", &found));
    CHECK_EQ_INT(found, NL * (1 + 4 + 2 + 1 + 1 + NE * 3) + 3);
    CHECK_EQ_INT(loom_json_get(doc, "missing")->n, 0);
    CHECK_EQ_INT(loom_json_get(doc, "unexpected")->n, 0);
    loom_json_free(doc);
    const char *convert[] = {
        loom_test_bin(), "convert", "--model", dir, "--out", tmp(out, sizeof out, "cli-hub"), NULL};
    CHECK_EQ_INT(loom_test_run(&text, convert), 0);
    free(text);
    loom_safetensors *hub, *conv;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, hub_dir(), "model", &hub));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, out, "model", &conv));
    check_same(hub, conv, false); /* convert writes the hub layout */
    loom_st_close(hub);
    loom_st_close(conv);
    loom_ctx_free(ctx);
}

/* ---- refusals ---- */

#define GU0 "model.layers.0.mlp.experts.gate_up_proj"
#define DN0 "model.layers.0.mlp.experts.down_proj"

/* loom_hf_dir_open refuses s (in tmp/sub) with a message naming the file and
 * holding each of the NULL-terminated needles. */
static void refused(loom_ctx *ctx, const char *sub, const spec *s, int n, ...) {
    char dir[1024];
    loom_status ws = write_specs(ctx, tmp(dir, sizeof dir, sub), s, n);
    CHECK_MSG(!ws, "%s: %s", sub, loom_last_error(ctx));
    if (ws) return;
    loom_safetensors *st = (loom_safetensors *)1;
    loom_status rs = loom_hf_dir_open(ctx, dir, &st);
    CHECK_MSG(rs != LOOM_OK && st == NULL, "%s: accepted", sub);
    if (rs == LOOM_OK) {
        loom_st_close(st);
        return;
    }
    const char *msg = loom_last_error(ctx);
    CHECK_CONTAINS(msg, sub);
    CHECK_CONTAINS(msg, "model.safetensors");
    va_list ap;
    va_start(ap, n);
    for (const char *needle; (needle = va_arg(ap, const char *));) CHECK_CONTAINS(msg, needle);
    va_end(ap);
}

TEST(hf_experts_refusals) {
    loom_ctx *ctx = new_ctx();
    const spec two_d[] = {{GU0, 2, {8, 3}}, {DN0, 3, {2, 3, 2}}};
    refused(ctx, "two-d", two_d, 2, GU0, "[8, 3]", "3-D", NULL);
    const spec four_d[] = {{GU0, 3, {2, 4, 3}}, {DN0, 4, {2, 3, 2, 1}}};
    refused(ctx, "four-d", four_d, 2, DN0, "[2, 3, 2, 1]", "3-D", NULL);
    const spec odd[] = {{GU0, 3, {2, 5, 3}}, {DN0, 3, {2, 3, 2}}};
    refused(ctx, "odd", odd, 2, GU0, "[2, 5, 3]", "even", NULL);
    const spec experts[] = {{GU0, 3, {2, 4, 3}}, {DN0, 3, {3, 3, 2}}};
    refused(ctx, "experts", experts, 2, DN0, "[3, 3, 2]", "[2, 4, 3]", "implies", "[2, 3, 2]",
            NULL);
    const spec hidden[] = {{GU0, 3, {2, 4, 3}}, {DN0, 3, {2, 5, 2}}};
    refused(ctx, "hidden", hidden, 2, DN0, "[2, 5, 2]", "[2, 3, 2]", NULL);
    const spec inter[] = {{GU0, 3, {2, 4, 3}}, {DN0, 3, {2, 3, 4}}};
    refused(ctx, "inter", inter, 2, DN0, "[2, 3, 4]", "[2, 3, 2]", NULL);
    const spec zero[] = {{GU0, 3, {0, 4, 3}}, {DN0, 3, {0, 3, 2}}};
    refused(ctx, "zero", zero, 2, GU0, "[0, 4, 3]", "0", NULL);
    const spec lone_gu[] = {{GU0, 3, {2, 4, 3}}};
    refused(ctx, "lone-gu", lone_gu, 1, GU0, "no '" DN0 "'", NULL);
    const spec lone_dn[] = {{DN0, 3, {2, 3, 2}}};
    refused(ctx, "lone-dn", lone_dn, 1, DN0, "no '" GU0 "'", NULL);
    const spec both[] = {{GU0, 3, {2, 4, 3}},
                         {DN0, 3, {2, 3, 2}},
                         {"model.layers.0.mlp.experts.1.up_proj.weight", 2, {2, 3}}};
    refused(ctx, "both", both, 3, "model.layers.0.mlp.experts.1.up_proj.weight", GU0,
            "one layout per layer", NULL);
    const spec bias[] = {{GU0, 3, {2, 4, 3}},
                         {DN0, 3, {2, 3, 2}},
                         {"model.layers.0.mlp.experts.0.down_proj.bias", 1, {3}}};
    refused(ctx, "bias", bias, 3, "experts.0.down_proj.bias", "one layout per layer", NULL);
    /* one layer fused, another per expert, a dense layer beside: read */
    const spec mixed[] = {{GU0, 3, {2, 4, 3}},
                          {DN0, 3, {2, 3, 2}},
                          {"model.layers.1.mlp.experts.0.gate_proj.weight", 2, {2, 3}},
                          {"model.layers.2.mlp.down_proj.weight", 2, {3, 2}}};
    char dir[1024];
    REQUIRE_OK(ctx, write_specs(ctx, tmp(dir, sizeof dir, "mixed"), mixed, 4));
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, dir, &st));
    CHECK_EQ_INT(loom_st_count(st), 2 * 3 + 2);
    const loom_st_tensor *t = loom_st_find(st, "model.layers.0.mlp.experts.1.down_proj.weight");
    CHECK(t && t->view && t->ndim == 2 && t->shape[0] == 3 && t->shape[1] == 2);
    t = loom_st_find(st, "model.layers.1.mlp.experts.0.gate_proj.weight");
    CHECK(t && !t->view);
    loom_st_close(st);
    loom_ctx_free(ctx);
}

/* ---- writing ---- */

/* The fixture's tensors in its parameter plan's order (the model's),
 * fetched from the hub file; the fetches are recorded. */
typedef struct plan_src {
    loom_ctx *ctx;
    const loom_param_plan *plan;
    const loom_safetensors *st;
    size_t *order, nfetch;
} plan_src;

static void plan_info(void *u, size_t i, char *name, size_t cap, int *ndim, int64_t shape[2]) {
    const loom_param_spec *p = &((plan_src *)u)->plan->p[i];
    snprintf(name, cap, "%s", p->name);
    *ndim = p->ndim;
    shape[0] = p->shape[0];
    shape[1] = p->ndim == 2 ? p->shape[1] : 1;
}

static loom_status plan_fetch(void *u, size_t i, float *dst) {
    plan_src *s = u;
    const loom_st_tensor *t = loom_st_find(s->st, s->plan->p[i].name);
    if (!t) return loom_errf(s->ctx, LOOM_ERR_NOT_FOUND, "no %s", s->plan->p[i].name);
    s->order[s->nfetch++] = i;
    return loom_st_read(s->ctx, t, LOOM_F32, dst, t->numel);
}

TEST(hf_experts_writer_fused_round_trip) {
    REQUIRE_FIXTURE(hub_dir());
    loom_ctx *ctx = new_ctx();
    loom_model_config cfg;
    loom_param_plan plan;
    loom_safetensors *hub, *raw, *back, *b16, *f16;
    REQUIRE_OK(ctx, loom_config_load(ctx, hub_dir(), &cfg));
    REQUIRE_OK(ctx, loom_param_plan_build(ctx, &cfg, &plan));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, hub_dir(), "model", &hub));
    REQUIRE(plan.n == loom_st_count(hub));
    plan_src ps = {ctx, &plan, hub, calloc(plan.n, sizeof(size_t)), 0};
    const loom_tensor_source src = {&ps, plan.n, plan_info, plan_fetch};
    char out[1024], hub16[1024], fused16[1024], name[160];
    REQUIRE_OK(ctx, loom_hf_dir_write(ctx, "out", tmp(out, sizeof out, "w-fused"), true, &src,
                                      LOOM_F32, 0, &cfg, hub_dir(), true));
    /* every tensor fetched once; a layer's experts in the fused tensors' order */
    CHECK_EQ_INT(ps.nfetch, plan.n);
    size_t k = 0;
    while (k < ps.nfetch && !strstr(plan.p[ps.order[k]].name, ".experts.")) k++;
    for (int e = 0; e < NE && k + 2 * NE + NE <= ps.nfetch; e++) {
        snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.gate_proj.weight", e);
        CHECK_STR(plan.p[ps.order[k + 2 * e]].name, name);
        snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.up_proj.weight", e);
        CHECK_STR(plan.p[ps.order[k + 2 * e + 1]].name, name);
        snprintf(name, sizeof name, "model.layers.0.mlp.experts.%d.down_proj.weight", e);
        CHECK_STR(plan.p[ps.order[k + 2 * NE + e]].name, name);
    }
    /* the file: the fused tensors with the fixture's bytes, nothing per expert */
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, out, "model", &raw));
    CHECK_EQ_INT(loom_st_count(raw), loom_st_count(hub) - NL * NE * 3 + NL * 2);
    const size_t IH = (size_t)NI * NH * sizeof(float);
    for (int l = 0; l < NL; l++) {
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.gate_up_proj", l);
        const loom_st_tensor *gu = loom_st_find(raw, name);
        snprintf(name, sizeof name, "model.layers.%d.mlp.experts.down_proj", l);
        const loom_st_tensor *dn = loom_st_find(raw, name);
        REQUIRE(gu && dn && gu->ndim == 3 && dn->ndim == 3);
        CHECK(gu->shape[0] == NE && gu->shape[1] == 2 * NI && gu->shape[2] == NH);
        CHECK(dn->shape[0] == NE && dn->shape[1] == NH && dn->shape[2] == NI);
        CHECK(gu->dtype == LOOM_F32 && dn->dtype == LOOM_F32);
        const char *g = gu->data, *d = dn->data;
        for (int e = 0; e < NE; e++) {
            CHECK(!memcmp(g + 2 * e * IH, expert(hub, l, e, "gate_proj")->data, IH));
            CHECK(!memcmp(g + (2 * e + 1) * IH, expert(hub, l, e, "up_proj")->data, IH));
            CHECK(!memcmp(d + e * IH, expert(hub, l, e, "down_proj")->data, IH));
        }
    }
    for (size_t i = 0; i < loom_st_count(raw); i++)
        CHECK_MSG(!strstr(loom_st_at(raw, i)->name, ".experts.0."), "%s in the fused file",
                  loom_st_at(raw, i)->name);
    loom_st_close(raw);
    CHECK(loom_file_exists(tmp(name, sizeof name, "w-fused/config.json")));
    CHECK(loom_file_exists(tmp(name, sizeof name, "w-fused/tokenizer.json")));
    /* read back: the fixture again */
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, out, &back));
    CHECK(loom_hf_dir_experts_fused(back));
    check_same(hub, back, true);
    loom_st_close(back);
    /* BF16 in shards (written in parts, converted): the hub layout's values */
    ps.nfetch = 0;
    REQUIRE_OK(ctx, loom_hf_dir_write(ctx, "out", tmp(fused16, sizeof fused16, "w-fused16"), true,
                                      &src, LOOM_BF16, 100000, &cfg, NULL, true));
    ps.nfetch = 0;
    REQUIRE_OK(ctx, loom_hf_dir_write(ctx, "out", tmp(hub16, sizeof hub16, "w-hub16"), true, &src,
                                      LOOM_BF16, 100000, &cfg, NULL, false));
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, fused16, &f16));
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, hub16, &b16));
    CHECK(loom_st_file_count(f16) > 1);
    CHECK(!loom_hf_dir_experts_fused(b16));
    check_same(b16, f16, true);
    loom_st_close(f16);
    loom_st_close(b16);
    free(ps.order);
    loom_st_close(hub);
    loom_param_plan_free(&plan);
    loom_config_free(&cfg);
    loom_ctx_free(ctx);
}

/* a synthetic source: names and shapes, zeros */
typedef struct name_src {
    const spec *s;
} name_src;

static void names_info(void *u, size_t i, char *name, size_t cap, int *ndim, int64_t shape[2]) {
    const spec *s = &((name_src *)u)->s[i];
    snprintf(name, cap, "%s", s->name);
    *ndim = s->ndim;
    shape[0] = s->shape[0];
    shape[1] = s->ndim == 2 ? s->shape[1] : 1;
}

static loom_status names_fetch(void *u, size_t i, float *dst) {
    const spec *s = &((name_src *)u)->s[i];
    memset(dst, 0, sizeof(float) * (size_t)(s->shape[0] * (s->ndim == 2 ? s->shape[1] : 1)));
    return LOOM_OK;
}

/* loom_hf_dir_write refuses s in the fused layout, and writes nothing */
static void write_refused(loom_ctx *ctx, const loom_model_config *cfg, const char *sub,
                          const spec *s, size_t n, const char *needle) {
    name_src ns = {s};
    const loom_tensor_source src = {&ns, n, names_info, names_fetch};
    char dir[1024];
    loom_status st = loom_hf_dir_write(ctx, "out", tmp(dir, sizeof dir, sub), true, &src, LOOM_F32,
                                       0, cfg, NULL, true);
    CHECK_MSG(st != LOOM_OK, "%s: written", sub);
    CHECK_CONTAINS(loom_last_error(ctx), needle);
    CHECK(!loom_dir_exists(dir));
    /* the hub layout takes it */
    CHECK_OK(ctx, loom_hf_dir_write(ctx, "out", dir, true, &src, LOOM_F32, 0, cfg, NULL, false));
}

#define EX(e, leaf) "model.layers.0.mlp.experts." #e "." leaf

TEST(hf_experts_writer_refusals) {
    REQUIRE_FIXTURE(hub_dir());
    loom_ctx *ctx = new_ctx();
    loom_model_config cfg;
    REQUIRE_OK(ctx, loom_config_load(ctx, hub_dir(), &cfg));
    const spec bias[] = {{EX(0, "gate_proj.weight"), 2, {2, 3}},
                         {EX(0, "up_proj.weight"), 2, {2, 3}},
                         {EX(0, "down_proj.weight"), 2, {3, 2}},
                         {EX(0, "gate_proj.bias"), 1, {2}}};
    write_refused(ctx, &cfg, "wr-bias", bias, 4, EX(0, "gate_proj.bias") ": transformers' fused");
    const spec gap[] = {
        {EX(0, "gate_proj.weight"), 2, {2, 3}}, {EX(0, "up_proj.weight"), 2, {2, 3}},
        {EX(0, "down_proj.weight"), 2, {3, 2}}, {EX(2, "gate_proj.weight"), 2, {2, 3}},
        {EX(2, "up_proj.weight"), 2, {2, 3}},   {EX(2, "down_proj.weight"), 2, {3, 2}}};
    write_refused(ctx, &cfg, "wr-gap", gap, 6, EX(1, "gate_proj.weight is missing"));
    const spec shape[] = {{EX(0, "gate_proj.weight"), 2, {2, 3}},
                          {EX(0, "up_proj.weight"), 2, {2, 3}},
                          {EX(0, "down_proj.weight"), 2, {2, 3}}};
    write_refused(ctx, &cfg, "wr-shape", shape, 3, "implies [3, 2]");
    loom_config_free(&cfg);
    loom_ctx_free(ctx);
}

/* A model saves its experts in the layout it read. Needs loom_model_create
 * to take a mixture-of-experts model: skipped while it refuses them. */
TEST(hf_experts_model_saves_in_layout_read) {
    REQUIRE_FIXTURE(hub_dir());
    loom_ctx *ctx = new_ctx();
    loom_model *m = NULL;
    loom_status s = loom_model_create(ctx, hub_dir(), NULL, &m);
    if (s == LOOM_ERR_UNSUPPORTED && strstr(loom_last_error(ctx), "mixture of experts"))
        SKIP("loom_model_create refuses mixture-of-experts models in this version");
    REQUIRE_OK(ctx, s);
    char fused[1024], a[1024], b[1024];
    REQUIRE_OK(ctx, write_fused_copy(ctx, tmp(fused, sizeof fused, "m-fused"), 0));
    REQUIRE_OK(ctx, loom_model_save_hf(m, tmp(a, sizeof a, "m-saved-hub"), LOOM_DTYPE_COUNT, 0));
    loom_model_free(m);
    REQUIRE_OK(ctx, loom_model_create(ctx, fused, NULL, &m));
    REQUIRE_OK(ctx, loom_model_save_hf(m, tmp(b, sizeof b, "m-saved-fused"), LOOM_DTYPE_COUNT, 0));
    loom_model_free(m);
    loom_safetensors *hub, *sa, *sb, *raw;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, hub_dir(), "model", &hub));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, a, "model", &sa));
    check_same(hub, sa, false); /* read per expert, saved per expert */
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, b, "model", &raw));
    CHECK(loom_st_find(raw, GU0) && loom_st_find(raw, DN0));
    CHECK(!loom_st_find(raw, "model.layers.0.mlp.experts.0.gate_proj.weight"));
    REQUIRE_OK(ctx, loom_hf_dir_open(ctx, b, &sb));
    check_same(hub, sb, true); /* read fused, saved fused */
    loom_st_close(hub);
    loom_st_close(sa);
    loom_st_close(sb);
    loom_st_close(raw);
    loom_ctx_free(ctx);
}
