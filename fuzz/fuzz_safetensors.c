/* libFuzzer target for the safetensors reader.
 *
 * The input is a file image. When loom_st_open_buffer accepts it, every
 * promise of the API is checked: tensors sorted by name and found by
 * loom_st_find, each lying inside the input with nbytes = numel * element
 * size, no two overlapping, the total adding up; each tensor is read in its
 * own dtype (must equal its bytes) and widened (floats to F32, integers to
 * I64). When it refuses, the message must name the input. Then the same
 * through loom_hf_experts_unfuse (transformers' fused experts as per-expert
 * views). Leaks are caught by ASan. */
#include <stdlib.h>
#include <string.h>

#include "../src/io/hf_experts.h"
#include "../src/io/safetensors.h"

#define CHECK(c)                                                                        \
    do {                                                                                \
        if (!(c)) {                                                                     \
            fprintf(stderr, "fuzz_safetensors: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                                    \
        }                                                                               \
    } while (0)

typedef struct {
    uintptr_t begin, end;
} range;

static int cmp_range(const void *a, const void *b) {
    const range *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Every promise of the API about the open handle st of the input. */
static void check_handle(loom_ctx *ctx, loom_safetensors *st, const uint8_t *data, size_t size) {
    loom_status s;
    CHECK(st && loom_st_file_count(st) == 1);
    size_t n = loom_st_count(st);
    range *r = malloc((n ? n : 1) * sizeof *r);
    size_t nr = 0;
    uint64_t total = 0;
    uintptr_t lo = (uintptr_t)data, hi = (uintptr_t)data + size;
    for (size_t i = 0; i < n; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        CHECK(t && t->name && t->file == 0);
        CHECK(loom_st_find(st, t->name) == t);
        if (i) CHECK(strcmp(loom_st_at(st, i - 1)->name, t->name) < 0);
        CHECK(t->ndim >= 0 && t->ndim <= LOOM_MAX_DIMS);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            CHECK(t->shape[d] >= 0);
            numel *= (uint64_t)t->shape[d];
        }
        CHECK(numel == t->numel);
        CHECK(t->nbytes == t->numel * loom_dtype_size(t->dtype));
        uintptr_t b = (uintptr_t)t->data;
        CHECK(b >= lo + 8 && b <= hi && t->nbytes <= hi - b);
        if (t->nbytes) r[nr++] = (range){b, b + (uintptr_t)t->nbytes};
        total += t->nbytes;

        void *own = malloc(t->nbytes ? t->nbytes : 1);
        CHECK(loom_st_read(ctx, t, t->dtype, own, t->numel) == LOOM_OK);
        CHECK(memcmp(own, t->data, t->nbytes) == 0);
        free(own);
        /* and converted: floats to F32, integers to I64 (both always possible) */
        loom_dtype wide = loom_dtype_is_float(t->dtype) ? LOOM_F32 : LOOM_I64;
        void *conv = malloc(t->numel ? t->numel * loom_dtype_size(wide) : 1);
        s = loom_st_read(ctx, t, wide, conv, t->numel);
        CHECK(s == LOOM_OK);
        free(conv);
        /* and narrowed to F16: integers out of its range are refused, never UB */
        void *half = malloc(t->numel ? t->numel * 2 : 1);
        s = loom_st_read(ctx, t, LOOM_F16, half, t->numel);
        CHECK(s == LOOM_OK || (s == LOOM_ERR_FORMAT && !loom_dtype_is_float(t->dtype)));
        free(half);
        CHECK(loom_st_read(ctx, t, LOOM_F32, NULL, t->numel + 1) == LOOM_ERR_SHAPE);
    }
    CHECK(total == loom_st_total_bytes(st));
    CHECK(total <= size);
    qsort(r, nr, sizeof *r, cmp_range);
    for (size_t i = 1; i < nr; i++) CHECK(r[i].begin >= r[i - 1].end);
    free(r);
    const loom_json *md = loom_st_metadata(st, 0);
    if (md) {
        CHECK(md->type == LOOM_JSON_OBJECT);
        for (size_t i = 0; i < md->n; i++) CHECK(md->items[i]->type == LOOM_JSON_STRING);
    }
}

/* A fused tensor's name: "[<path>.]experts.<leaf>". */
static bool fused_name(const char *name, const char *leaf) {
    const size_t n = strlen(name), l = strlen(leaf) + 8;
    return n >= l && !strcmp(name + n - l + 8, leaf) && !strncmp(name + n - l, "experts.", 8) &&
           (n == l || name[n - l - 1] == '.');
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_safetensors *st = NULL;
    loom_status s = loom_st_open_buffer(ctx, data, size, "fuzz.safetensors", &st);
    if (s != LOOM_OK) {
        CHECK(st == NULL);
        CHECK(strstr(loom_last_error(ctx), "fuzz.safetensors") != NULL ||
              s == LOOM_ERR_OOM);
        loom_ctx_free(ctx);
        return 0;
    }
    check_handle(ctx, st, data, size);
    /* transformers' fused experts seen as the hub's per-expert tensors (the
     * path of loom_hf_dir_open): the same promises, views of the input */
    const size_t n0 = loom_st_count(st);
    const uint64_t total0 = loom_st_total_bytes(st);
    s = loom_hf_experts_unfuse(ctx, st);
    if (s == LOOM_OK) {
        check_handle(ctx, st, data, size);
        CHECK(loom_st_total_bytes(st) == total0);
        CHECK(loom_st_count(st) >= n0);
        for (size_t i = 0; i < loom_st_count(st); i++) {
            const loom_st_tensor *t = loom_st_at(st, i);
            CHECK(!fused_name(t->name, "gate_up_proj") && !fused_name(t->name, "down_proj"));
            CHECK(!t->view || (t->ndim == 2 && strstr(t->name, "experts.")));
        }
        CHECK(loom_hf_dir_experts_fused(st) == (loom_st_count(st) != n0));
    } else {
        CHECK(strstr(loom_last_error(ctx), "fuzz.safetensors") != NULL || s == LOOM_ERR_OOM);
    }
    loom_st_close(st);
    loom_ctx_free(ctx);
    return 0;
}
