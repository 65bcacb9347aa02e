/* safetensors: a tensor written in parts and views of a file's tensors
 * under names of their own, the pieces transformers v5's fused experts are
 * read and written with (src/io/hf_experts.c, tests/test_hf_experts.c). */
#include <stdlib.h>

#include "../src/io/safetensors.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static const char *tmp(char *buf, size_t cap, const char *sub) {
    snprintf(buf, cap, "%s/%s", loom_test_tmpdir(), sub);
    return buf;
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

/* a tensor written in parts: the same file as written whole; misuse refused */
TEST(safetensors_writer_write_part) {
    loom_ctx *ctx = new_ctx();
    float v[24];
    for (int i = 0; i < 24; i++) v[i] = (float)i * 0.25f;
    const int64_t shape[2] = {4, 6};
    char whole[1024], parts[1024], *a = NULL, *b = NULL;
    size_t la, lb;
    loom_st_writer *w;
    REQUIRE_OK(ctx,
               loom_st_writer_create(ctx, tmp(whole, sizeof whole, "wp-whole"), "m", 0, NULL, &w));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "x", LOOM_BF16, 2, shape));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "y", LOOM_F32, 1, shape));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "x", LOOM_F32, v));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "y", LOOM_F32, v));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    REQUIRE_OK(ctx,
               loom_st_writer_create(ctx, tmp(parts, sizeof parts, "wp-parts"), "m", 0, NULL, &w));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "x", LOOM_BF16, 2, shape));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "y", LOOM_F32, 1, shape));
    REQUIRE_OK(ctx, loom_st_writer_write_part(ctx, w, "x", LOOM_F32, v, 10));
    CHECK(loom_st_writer_write(ctx, w, "y", LOOM_F32, v) == LOOM_ERR_INVALID_ARG); /* x first */
    CHECK(loom_st_writer_write(ctx, w, "x", LOOM_F32, v) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "10 of 24");
    CHECK(loom_st_writer_write_part(ctx, w, "x", LOOM_F32, v, 15) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "14 of its 24");
    REQUIRE_OK(ctx, loom_st_writer_write_part(ctx, w, "x", LOOM_F32, v + 10, 0));
    REQUIRE_OK(ctx, loom_st_writer_write_part(ctx, w, "x", LOOM_F32, v + 10, 14));
    REQUIRE_OK(ctx, loom_st_writer_write_part(ctx, w, "y", LOOM_F32, v, 4));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    REQUIRE_OK(ctx,
               loom_read_file(ctx, tmp(whole, sizeof whole, "wp-whole/m.safetensors"), 0, &a, &la));
    REQUIRE_OK(ctx,
               loom_read_file(ctx, tmp(parts, sizeof parts, "wp-parts/m.safetensors"), 0, &b, &lb));
    CHECK(la == lb && !memcmp(a, b, la));
    free(a);
    free(b);
    loom_ctx_free(ctx);
}

/* views: renamed slices of a file's tensors, found and read as entries */
TEST(safetensors_splice_views) {
    loom_ctx *ctx = new_ctx();
    char dir[1024];
    const spec s[] = {{"a", 2, {2, 3}}, {"b", 1, {4}}};
    REQUIRE_OK(ctx, write_specs(ctx, tmp(dir, sizeof dir, "splice"), s, 2));
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    const loom_st_tensor *a = loom_st_find(st, "a");
    REQUIRE(a);
    loom_st_tensor v[2] = {{.name = "z.second_row",
                            .dtype = LOOM_F32,
                            .ndim = 1,
                            .shape = {3},
                            .numel = 3,
                            .nbytes = 12,
                            .data = (const char *)a->data + 12,
                            .view = true},
                           {.name = "a.first_row",
                            .dtype = LOOM_F32,
                            .ndim = 1,
                            .shape = {3},
                            .numel = 3,
                            .nbytes = 12,
                            .data = a->data}}; /* whole rows, but says it is no view */
    const void *row1 = (const char *)a->data + 12;
    const char *drop[] = {"a"};
    REQUIRE_OK(ctx, loom_st_splice(ctx, st, drop, 1, v, 2));
    CHECK_EQ_INT(loom_st_count(st), 3);
    CHECK_STR(loom_st_at(st, 0)->name, "a.first_row"); /* sorted again */
    CHECK_STR(loom_st_at(st, 2)->name, "z.second_row");
    CHECK(!loom_st_find(st, "a") && loom_st_find(st, "b") && !loom_st_find(st, "b")->view);
    const loom_st_tensor *z = loom_st_find(st, "z.second_row");
    CHECK(z && z->view && z->data == row1 && z->file == 0);
    CHECK(!loom_st_find(st, "a.first_row")->view); /* as the entry said */
    CHECK_EQ_INT(loom_st_total_bytes(st), 24 + 16);
    /* a name twice, a view outside its file, a tensor that is not there */
    v[0].name = "b";
    CHECK(loom_st_splice(ctx, st, NULL, 0, v, 1) == LOOM_ERR_FORMAT);
    CHECK_CONTAINS(loom_last_error(ctx), "duplicate tensor name 'b'");
    loom_st_close(st);
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    v[0].data = (const char *)loom_st_find(st, "b")->data + 8;
    CHECK(loom_st_splice(ctx, st, NULL, 0, v, 1) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "outside its file");
    const char *nothing[] = {"c"};
    CHECK(loom_st_splice(ctx, st, nothing, 1, NULL, 0) == LOOM_ERR_INVALID_ARG);
    CHECK_CONTAINS(loom_last_error(ctx), "no tensor 'c'");
    loom_st_close(st);
    loom_ctx_free(ctx);
}
