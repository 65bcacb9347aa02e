/* safetensors: reading the fixtures, refusing bad files (with messages that
 * name the file), the writer's round trips, layout and sharding, byte
 * identity with files written by Hugging Face's safetensors, and interop with
 * Python's safetensors (tests/st_interop.py). */
#include <dirent.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../src/io/safetensors.h"
#include "harness.h"

static loom_ctx *new_ctx(void) {
    loom_ctx *ctx = NULL;
    if (loom_ctx_create(&ctx) != LOOM_OK) abort();
    return ctx;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}

/* "a/b" in one of 16 rotating static buffers (no free needed). */
static char *path2(const char *a, const char *b) {
    static char bufs[16][1024];
    static int next;
    char *p = bufs[next++ % 16];
    size_t la = strlen(a), lb = strlen(b);
    if (la + lb + 2 > sizeof bufs[0]) abort(); /* test paths are short */
    memmove(p, a, la); /* a may be an earlier buffer */
    p[la] = '/';
    memmove(p + la + 1, b, lb + 1);
    return p;
}
#define FIX(sub) path2(loom_test_fixtures(), sub)
#define TMP(sub) path2(loom_test_tmpdir(), sub)
/* a path that must outlive the rotation */
#define KEEP(var, expr) \
    char var[1024];     \
    snprintf(var, sizeof var, "%s", (expr))

/* A safetensors image: 8-byte little-endian length, header, then data_len
 * bytes of a counting pattern. */
static unsigned char *mk(const char *header, size_t data_len, size_t *len) {
    size_t hl = strlen(header);
    *len = 8 + hl + data_len;
    unsigned char *b = malloc(*len ? *len : 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    for (size_t i = 0; i < data_len; i++) b[8 + hl + i] = (unsigned char)(i * 31 + 7);
    return b;
}

static unsigned char *read_all(loom_ctx *ctx, const char *path, size_t *len) {
    char *d = NULL;
    if (loom_read_file(ctx, path, 0, &d, len) != LOOM_OK) return NULL;
    return (unsigned char *)d;
}

static uint64_t header_len(const unsigned char *b) {
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
    return n;
}

static bool files_equal(loom_ctx *ctx, const char *a, const char *b) {
    size_t la, lb;
    unsigned char *x = read_all(ctx, a, &la), *y = read_all(ctx, b, &lb);
    bool eq = x && y && la == lb && memcmp(x, y, la) == 0;
    if (x && y && !eq) {
        size_t i = 0;
        while (i < la && i < lb && x[i] == y[i]) i++;
        fprintf(stderr, "    %s (%zu bytes) and %s (%zu bytes) differ at byte %zu\n", a, la, b,
                lb, i);
    }
    free(x);
    free(y);
    return eq;
}

/* ---------------------------------------------------------------------- */
/* Reading the fixtures                                                    */
/* ---------------------------------------------------------------------- */

/* t exists with dtype dt and shape (d0, d1) (d1 < 0: one dimension) */
static bool is_2d(const loom_st_tensor *t, loom_dtype dt, int64_t d0, int64_t d1) {
    return t && t->dtype == dt && t->ndim == (d1 < 0 ? 1 : 2) && t->shape[0] == d0 &&
           (d1 < 0 || t->shape[1] == d1);
}

/* Checks one opened file against its raw bytes: every tensor lies in the data
 * region, bytes add up, and reading in its own dtype gives the file's bytes. */
static void check_against_raw(loom_ctx *ctx, const loom_safetensors *st, int file) {
    const char *path = loom_st_file_path(st, file);
    size_t len;
    unsigned char *raw = read_all(ctx, path, &len);
    REQUIRE(raw && len >= 8);
    uint64_t n = header_len(raw);
    loom_json *h = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, (const char *)raw + 8, (size_t)n, path, &h));
    uint64_t sum = 0;
    for (size_t i = 0; i < loom_st_count(st); i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        if (i > 0) CHECK(strcmp(loom_st_at(st, i - 1)->name, t->name) < 0);
        CHECK(loom_st_find(st, t->name) == t);
        if (t->file != file) continue;
        sum += t->nbytes;
        CHECK_EQ_INT(t->nbytes, t->numel * loom_dtype_size(t->dtype));
        unsigned char *buf = malloc(t->nbytes ? t->nbytes : 1);
        CHECK_OK(ctx, loom_st_read(ctx, t, t->dtype, buf, t->numel));
        /* the bytes the file holds where its own header says */
        const loom_json *o = loom_json_get(loom_json_get(h, t->name), "data_offsets");
        REQUIRE(o);
        CHECK(memcmp(buf, raw + 8 + n + loom_json_at(o, 0)->i, t->nbytes) == 0);
        CHECK(memcmp(buf, t->data, t->nbytes) == 0);
        if (loom_dtype_is_float(t->dtype) && t->numel) {
            float *f = malloc(t->numel * sizeof *f);
            CHECK_OK(ctx, loom_st_read(ctx, t, LOOM_F32, f, t->numel));
            if (t->dtype == LOOM_F32) CHECK(memcmp(f, buf, t->nbytes) == 0);
            if (t->dtype == LOOM_F64) {
                double d0;
                memcpy(&d0, buf, 8);
                CHECK(f[0] == (float)d0);
            }
            free(f);
        }
        free(buf);
    }
    CHECK_EQ_INT(sum, len - 8 - n);
    if (loom_st_file_count(st) == 1) CHECK_EQ_INT(loom_st_total_bytes(st), sum);
    loom_json_free(h);
    free(raw);
}

/* Opens every *.safetensors under dir (recursively) and checks it. */
static int check_tree(loom_ctx *ctx, const char *where) {
    KEEP(dir, where);
    DIR *d = opendir(dir);
    if (!d) return 0;
    int files = 0;
    for (struct dirent *de; (de = readdir(d));) {
        size_t l = strlen(de->d_name);
        if (de->d_name[0] == '.') continue;
        KEEP(p, path2(dir, de->d_name));
        loom_safetensors *st;
        if (loom_dir_exists(p)) {
            files += check_tree(ctx, p);
        } else if (l > 12 && strcmp(de->d_name + l - 12, ".safetensors") == 0) {
            CHECK_OK(ctx, loom_st_open_file(ctx, p, &st));
            if (st) {
                files++;
                CHECK(loom_st_count(st) > 0 && loom_st_file_count(st) == 1);
                CHECK_STR(loom_st_file_path(st, 0), p);
                check_against_raw(ctx, st, 0);
                loom_st_close(st);
            }
        }
    }
    closedir(d);
    return files;
}

TEST(safetensors_fixtures_every_file) {
    loom_ctx *ctx = new_ctx();
    CHECK_EQ_INT(check_tree(ctx, FIX("models")), 7); /* tiny-qwen3-untied has 2 shards */
    CHECK_EQ_INT(check_tree(ctx, FIX("golden")), 6);
    loom_ctx_free(ctx);
}

TEST(safetensors_fixtures_known_contents) {
    loom_ctx *ctx = new_ctx();
    char *p = FIX("models/tiny-qwen3/model.safetensors");
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, p, &st));
    CHECK_EQ_INT(loom_st_count(st), 46);
    const loom_json *md = loom_st_metadata(st, 0);
    REQUIRE(md && md->type == LOOM_JSON_OBJECT && md->n == 1);
    CHECK_STR(loom_json_get(md, "format")->s, "pt");
    const loom_st_tensor *e = loom_st_find(st, "model.embed_tokens.weight");
    REQUIRE(is_2d(e, LOOM_F32, 1024, 64));
    CHECK(loom_st_find(st, "lm_head.weight") == NULL); /* tied */
    CHECK(is_2d(loom_st_find(st, "model.norm.weight"), LOOM_F32, 64, -1));
    CHECK(loom_st_find(st, "zzz") == NULL && loom_st_find(st, "") == NULL);
    /* read_named: right shape reads, wrong shape names both shapes */
    float *w = malloc(1024 * 64 * sizeof *w);
    CHECK_OK(ctx, loom_st_read_named(ctx, st, "model.embed_tokens.weight", 2,
                                     (int64_t[]){1024, 64}, LOOM_F32, w));
    CHECK(memcmp(w, e->data, 4) == 0);
    CHECK(loom_st_read_named(ctx, st, "model.embed_tokens.weight", 2, (int64_t[]){64, 1024},
                             LOOM_F32, w) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "tensor 'model.embed_tokens.weight' has shape [1024, 64], "
                                         "but [64, 1024] was expected");
    CHECK(loom_st_read_named(ctx, st, "nope", 1, (int64_t[]){1}, LOOM_F32, w) ==
          LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx), "'nope'");
    CHECK(loom_st_read(ctx, e, LOOM_F32, w, 5) == LOOM_ERR_SHAPE);
    CHECK_CONTAINS(loom_last_error(ctx), "65536");
    /* float weights cannot be read as integers */
    CHECK(loom_st_read(ctx, e, LOOM_I64, w, e->numel) != LOOM_OK);
    CHECK_CONTAINS(loom_last_error(ctx), "model.embed_tokens.weight");
    free(w);
    loom_st_close(st);

    /* the same through open_dir */
    p = FIX("models/tiny-qwen3");
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, p, "model", &st));
    CHECK_EQ_INT(loom_st_count(st), 46);
    loom_st_close(st);
    CHECK(loom_st_open_dir(ctx, p, "adapter_model", &st) == LOOM_ERR_NOT_FOUND);
    CHECK_CONTAINS(loom_last_error(ctx),
                   "no adapter_model.safetensors or adapter_model.safetensors.index.json in");
    CHECK_CONTAINS(loom_last_error(ctx), p);

    /* LoRA adapter: F64 */
    p = FIX("models/tiny-qwen3-lora");
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, p, "adapter_model", &st));
    CHECK_EQ_INT(loom_st_count(st), 56);
    for (size_t i = 0; i < loom_st_count(st); i++) CHECK_EQ_INT(loom_st_at(st, i)->dtype, LOOM_F64);
    CHECK(is_2d(loom_st_find(st, "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"),
                LOOM_F64, 4, 128));
    loom_st_close(st);

    /* golden: I64 input_ids, I32 cu_seqlens */
    p = FIX("golden/tiny-qwen3.safetensors");
    REQUIRE_OK(ctx, loom_st_open_file(ctx, p, &st));
    CHECK(loom_st_metadata(st, 0) == NULL);
    const loom_st_tensor *ids = loom_st_find(st, "input_ids");
    REQUIRE(is_2d(ids, LOOM_I64, 2, 24));
    int64_t v64[48];
    int32_t v32[48];
    CHECK_OK(ctx, loom_st_read(ctx, ids, LOOM_I64, v64, 48));
    CHECK_OK(ctx, loom_st_read(ctx, ids, LOOM_I32, v32, 48));
    for (int i = 0; i < 48; i++) CHECK(v64[i] == v32[i] && v64[i] >= 0 && v64[i] < 1024);
    const loom_st_tensor *cu = loom_st_find(st, "packed.cu_seqlens");
    CHECK(cu && cu->dtype == LOOM_I32);
    loom_st_close(st);
    loom_ctx_free(ctx);
}

TEST(safetensors_fixtures_sharded_index) {
    loom_ctx *ctx = new_ctx();
    char *dir = FIX("models/tiny-qwen3-untied");
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    CHECK_EQ_INT(loom_st_file_count(st), 2);
    CHECK_EQ_INT(loom_st_count(st), 47);
    CHECK_EQ_INT(loom_st_total_bytes(st), 1116928); /* the index's total_size */
    CHECK_CONTAINS(loom_st_file_path(st, 0), "model-00001-of-00002.safetensors");
    CHECK_CONTAINS(loom_st_file_path(st, 1), "model-00002-of-00002.safetensors");
    const loom_st_tensor *lm = loom_st_find(st, "lm_head.weight");
    const loom_st_tensor *nw = loom_st_find(st, "model.norm.weight");
    REQUIRE(is_2d(lm, LOOM_F32, 1024, 64) && is_2d(nw, LOOM_F32, 64, -1));
    CHECK(lm->file == 0 && nw->file == 1);
    for (int f = 0; f < 2; f++) {
        CHECK_STR(loom_json_get(loom_st_metadata(st, f), "format")->s, "pt");
        check_against_raw(ctx, st, f);
    }
    CHECK(loom_st_metadata(st, 2) == NULL && loom_st_file_path(st, -1) == NULL);
    loom_st_close(st);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Bad input                                                               */
/* ---------------------------------------------------------------------- */

#define T8 "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}"

/* Opens an image from memory (as "bad.safetensors") or from a file; expects
 * the status, a message fragment, and the name of the file in the message. */
static void bad_image(int line, bool from_file, const unsigned char *b, size_t len,
                      loom_status want, const char *frag) {
    loom_ctx *ctx = new_ctx();
    char name[1024] = "bad.safetensors";
    loom_safetensors *st = NULL;
    loom_status s;
    if (from_file) {
        snprintf(name, sizeof name, "%s", loom_test_write("model.safetensors", b, len));
        s = loom_st_open_file(ctx, name, &st);
    } else {
        s = loom_st_open_buffer(ctx, b, len, name, &st);
    }
    const char *msg = loom_last_error(ctx);
    if (s != want)
        loom_test_fail(__FILE__, line, "status %s, expected %s (%s)", loom_status_str(s),
                       loom_status_str(want), msg);
    if (!strstr(msg, frag)) loom_test_fail(__FILE__, line, "\"%s\" lacks \"%s\"", msg, frag);
    if (!strstr(msg, name)) loom_test_fail(__FILE__, line, "\"%s\" does not name %s", msg, name);
    loom_st_close(st);
    loom_ctx_free(ctx);
}

/* header + data_len bytes, from memory and (both = true) from a file too */
static void bad_header(int line, bool both, const char *header, size_t data_len,
                       loom_status want, const char *frag) {
    size_t len;
    unsigned char *b = mk(header, data_len, &len);
    bad_image(line, false, b, len, want, frag);
    if (both) bad_image(line, true, b, len, want, frag);
    free(b);
}
#define BAD(h, n, st, frag) bad_header(__LINE__, false, h, n, st, frag)
#define BAD2(h, n, st, frag) bad_header(__LINE__, true, h, n, st, frag)
#define FMT LOOM_ERR_FORMAT

TEST(safetensors_bad_length_and_json) {
    /* too short for the length: buffer and files (0 and 5 bytes) */
    loom_ctx *ctx = new_ctx();
    loom_safetensors *st = NULL;
    CHECK(loom_st_open_buffer(ctx, "abcde", 5, "model.safetensors", &st) == FMT);
    CHECK_STR(loom_last_error(ctx), "model.safetensors: truncated: file is 5 bytes, but a "
                                    "safetensors file starts with an 8-byte header length");
    CHECK(loom_st_open_buffer(ctx, NULL, 0, "x", &st) == FMT && st == NULL);
    loom_ctx_free(ctx);
    bad_image(__LINE__, true, (const unsigned char *)"", 0, FMT, "truncated: file is 0 bytes");
    bad_image(__LINE__, true, (const unsigned char *)"abcde", 5, FMT, "truncated: file is 5 bytes");

    /* header length past the end of the file, or over the limit */
    unsigned char b[2000] = {0};
    b[0] = 0x40, b[1] = 0xe2, b[2] = 0x01; /* 123456 */
    bad_image(__LINE__, true, b, sizeof b, FMT,
             "header length 123456 runs past the end of the file (2000 bytes): the file is "
             "truncated or not safetensors");
    memset(b, 0xff, 8);
    bad_image(__LINE__, true, b, 16, FMT, "is over the limit of 104857600 bytes");
    uint64_t big = (uint64_t)LOOM_ST_MAX_HEADER + 1;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(big >> (8 * i));
    bad_image(__LINE__, true, b, 16, FMT, "header length 104857601 is over the limit");

    /* not JSON / not an object / duplicates */
    BAD2("{\"a\":{\"dtype\":\"F32\",}}", 0, FMT, "header is not valid JSON: line 1, column");
    BAD("", 0, FMT, "header is not valid JSON");
    BAD("{\"a\":1", 0, FMT, "header is not valid JSON");
    BAD("{\"a\":\"\xff\"}", 0, FMT, "header is not valid JSON");
    BAD2("[1,2]", 0, FMT, "header is not a JSON object (got array)");
    BAD("\"x\"", 0, FMT, "not a JSON object");
    BAD2("{\"a\":" T8 ",\"a\":" T8 "}", 8, FMT, "duplicate tensor name");
    BAD("{\"a\":" T8 ",\"a\":" T8 "}", 8, FMT, "\"a\"");
}

/* {"<name>": {"dtype": ..., "shape": ..., "data_offsets": ...}} */
#define E1(name, dt, shape, offs) \
    "{\"" name "\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":" offs "}}"

TEST(safetensors_bad_entries) {
    const loom_status U = LOOM_ERR_UNSUPPORTED;
    /* entry structure */
    BAD2("{\"a\":[1]}", 0, FMT, "tensor 'a': entry must be an object");
    BAD("{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, FMT,
        "tensor 'a': missing field 'dtype'");
    BAD("{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, FMT, "missing field 'shape'");
    BAD2("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, FMT, "missing field 'data_offsets'");
    BAD2("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8, FMT,
         "tensor 'a': unexpected field 'x'");
    BAD("{\"a\":{\"dtype\":1,\"shape\":[2],\"data_offsets\":[0,8]}}", 8, FMT,
        "tensor 'a': 'dtype' must be a string, got number");
    BAD2(E1("x", "F8_E4M3", "[2]", "[0,2]"), 2, U,
         "tensor 'x': unknown dtype 'F8_E4M3' (loom reads F64, F32, F16, BF16, I64, I32, I16, "
         "I8, U8, BOOL)");
    BAD(E1("x", "f32", "[2]", "[0,8]"), 8, U, "unknown dtype 'f32'");
    /* shapes */
    BAD(E1("a", "F32", "\"2\"", "[0,8]"), 8, FMT, "tensor 'a': 'shape' must be an array");
    BAD2(E1("a", "F32", "[2,-3]", "[0,8]"), 8, FMT, "tensor 'a': shape[1] is -3");
    BAD(E1("a", "F32", "[2.5]", "[0,8]"), 8, FMT, "shape[0] must be a non-negative integer");
    BAD(E1("a", "F32", "[\"2\"]", "[0,8]"), 8, FMT,
        "shape[0] must be a non-negative integer, got string");
    BAD(E1("a", "F32", "[99999999999999999999]", "[0,8]"), 8, FMT, "shape[0] must be a non-");
    BAD2(E1("a", "F32", "[1,1,1,1,1,1,1,1,2]", "[0,8]"), 8, U,
         "tensor 'a': shape has 9 dimensions, more than loom's limit of 8");
    BAD2(E1("a", "F32", "[4294967296,4294967296]", "[0,8]"), 8, FMT,
         "tensor 'a': shape [4294967296, 4294967296] of F32 is too large");
    BAD(E1("a", "F64", "[2305843009213693952]", "[0,8]"), 8, FMT, "is too large");
    /* offsets */
    BAD(E1("a", "F32", "[2]", "[0]"), 8, FMT,
        "tensor 'a': 'data_offsets' must be an array of two non-negative integers");
    BAD(E1("a", "F32", "[2]", "[0,8,9]"), 8, FMT, "'data_offsets' must be");
    BAD(E1("a", "F32", "[2]", "[-8,0]"), 8, FMT, "'data_offsets' must be");
    BAD(E1("a", "F32", "[2]", "{\"0\":8}"), 8, FMT, "'data_offsets' must be");
    BAD2(E1("a", "F32", "[0]", "[10,5]"), 16, FMT,
         "tensor 'a': data_offsets [10, 5]: begin is past end");
    BAD2(E1("b", "U8", "[100]", "[100,200]"), 150, FMT,
         "tensor 'b': data_offsets [100, 200] run past the end of the data (150 bytes)");
    BAD2(E1("a.weight", "F32", "[2,3]", "[0,10]"), 24, FMT,
         "tensor 'a.weight': data_offsets [0, 10] hold 10 bytes, but shape [2, 3] of F32 needs 24");
    BAD2("{\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[16,40]}}",
         40, FMT, "tensors 'a' and 'b' overlap (bytes [0, 24) and [16, 40))");
    /* overlap hidden behind a long tensor */
    BAD("{\"long\":{\"dtype\":\"U8\",\"shape\":[100],\"data_offsets\":[0,100]},"
        "\"x\":{\"dtype\":\"U8\",\"shape\":[10],\"data_offsets\":[10,20]},"
        "\"y\":{\"dtype\":\"U8\",\"shape\":[10],\"data_offsets\":[50,60]}}",
        100, FMT, "tensors 'long' and 'x' overlap");
    /* metadata */
    BAD2("{\"__metadata__\":[\"pt\"]}", 0, FMT, "__metadata__ must be an object of string values");
    BAD("{\"__metadata__\":{\"format\":1}}", 0, FMT, "'format' is number");
    BAD("{\"__metadata__\":\"pt\"}", 0, FMT, "got string");
}

TEST(safetensors_edge_cases_accepted) {
    loom_ctx *ctx = new_ctx();
    /* holes between tensors, unsorted offsets, trailing bytes, an empty and a
     * scalar tensor, zero-byte tensors sharing an offset with others */
    const char *h = "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[16,24]},"
                    "\"a\":{\"dtype\":\"I16\",\"shape\":[3],\"data_offsets\":[2,8]},"
                    "\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[24,32]},"
                    "\"e\":{\"dtype\":\"BF16\",\"shape\":[0,5],\"data_offsets\":[4,4]},"
                    "\"z\":{\"dtype\":\"BOOL\",\"shape\":[0],\"data_offsets\":[40,40]},"
                    "\"__metadata__\":{}}  ";
    size_t len;
    unsigned char *b = mk(h, 40, &len);
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_buffer(ctx, b, len, "ok.safetensors", &st));
    CHECK_EQ_INT(loom_st_count(st), 5);
    CHECK_STR(loom_st_at(st, 0)->name, "a");
    CHECK_STR(loom_st_at(st, 4)->name, "z");
    CHECK_EQ_INT(loom_st_total_bytes(st), 8 + 6 + 8);
    const loom_st_tensor *s = loom_st_find(st, "s");
    CHECK_EQ_INT(s->ndim, 0);
    CHECK_EQ_INT(s->numel, 1);
    double d;
    CHECK_OK(ctx, loom_st_read(ctx, s, LOOM_F64, &d, 1));
    CHECK(memcmp(&d, b + 8 + strlen(h) + 24, 8) == 0);
    const loom_st_tensor *e = loom_st_find(st, "e");
    CHECK_EQ_INT(e->numel, 0);
    CHECK_OK(ctx, loom_st_read(ctx, e, LOOM_F32, NULL, 0));
    CHECK_OK(ctx, loom_st_read_named(ctx, st, "e", 2, (int64_t[]){0, 5}, LOOM_F32, NULL));
    CHECK(loom_st_metadata(st, 0) && loom_st_metadata(st, 0)->n == 0);
    loom_st_close(st);
    free(b);
    /* an empty header object and nothing else */
    b = mk("{}", 0, &len);
    REQUIRE_OK(ctx, loom_st_open_buffer(ctx, b, len, "empty", &st));
    CHECK_EQ_INT(loom_st_count(st), 0);
    CHECK(loom_st_find(st, "a") == NULL);
    loom_st_close(st);
    free(b);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Writer                                                                  */
/* ---------------------------------------------------------------------- */

static loom_json *meta_pt(loom_ctx *ctx, const char *key, const char *val) {
    loom_json *m = loom_json_new_object(ctx);
    if (loom_json_set(ctx, m, key, loom_json_new_str(ctx, val)) != LOOM_OK) abort();
    return m;
}

typedef struct spec {
    const char *name;
    loom_dtype dt;
    int ndim;
    int64_t shape[4];
} spec;

static size_t spec_bytes(const spec *s) {
    size_t n = loom_dtype_size(s->dt);
    for (int i = 0; i < s->ndim; i++) n *= (size_t)s->shape[i];
    return n;
}

static unsigned char *random_data(const spec *s) {
    size_t n = spec_bytes(s);
    unsigned char *p = malloc(n ? n : 1);
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)rnd();
    if (s->dt == LOOM_BOOL)
        for (size_t i = 0; i < n; i++) p[i] &= 1;
    return p;
}

/* HF's dtype order (see safetensors.c): larger elements first. */
static int rank_of(loom_dtype dt) {
    static const int r[LOOM_DTYPE_COUNT] = {[LOOM_F32] = 11, [LOOM_BF16] = 8, [LOOM_F16] = 7,
                                            [LOOM_F64] = 12, [LOOM_I64] = 13, [LOOM_I32] = 9,
                                            [LOOM_I16] = 5,  [LOOM_I8] = 2,   [LOOM_U8] = 1,
                                            [LOOM_BOOL] = 0};
    return r[dt];
}

/* Checks the layout rules on a written file's bytes. */
static void check_layout(loom_ctx *ctx, const char *path, bool want_meta) {
    size_t len;
    unsigned char *raw = read_all(ctx, path, &len);
    REQUIRE(raw && len >= 8);
    uint64_t n = header_len(raw);
    REQUIRE(8 + n <= len);
    CHECK_EQ_INT((8 + n) % 8, 0);
    /* compact JSON, then only spaces */
    size_t end = (size_t)n;
    while (end > 0 && raw[8 + end - 1] == ' ') end--;
    CHECK(end > 0 && raw[8 + end - 1] == '}');
    CHECK(n - end < 8);
    CHECK(memchr(raw + 8, '\n', end) == NULL);
    CHECK(memmem(raw + 8, end, "\": ", 3) == NULL && memmem(raw + 8, end, ", ", 2) == NULL);
    loom_json *h = NULL;
    REQUIRE_OK(ctx, loom_json_parse(ctx, (const char *)raw + 8, (size_t)n, path, &h));
    size_t first = 0;
    if (want_meta) {
        REQUIRE(h->n > 0);
        CHECK_STR(h->keys[0], "__metadata__");
        first = 1;
    } else {
        CHECK(loom_json_get(h, "__metadata__") == NULL);
    }
    uint64_t off = 0;
    int prev_rank = 100;
    const char *prev_name = NULL;
    for (size_t i = first; i < h->n; i++) {
        const loom_json *e = h->items[i];
        loom_dtype dt;
        REQUIRE(loom_dtype_from_name(loom_json_get(e, "dtype")->s, &dt) == 0);
        const loom_json *o = loom_json_get(e, "data_offsets");
        int64_t b = loom_json_at(o, 0)->i, en = loom_json_at(o, 1)->i;
        CHECK_EQ_INT(b, off);
        CHECK_EQ_INT(b % (int64_t)loom_dtype_size(dt), 0);
        CHECK_EQ_INT((8 + n + (uint64_t)b) % loom_dtype_size(dt), 0);
        /* dtype rank descending, then names ascending */
        int r = rank_of(dt);
        CHECK(r <= prev_rank);
        if (r == prev_rank) CHECK(strcmp(prev_name, h->keys[i]) < 0);
        prev_rank = r;
        prev_name = h->keys[i];
        off = (uint64_t)en;
    }
    CHECK_EQ_INT(8 + n + off, len);
    loom_json_free(h);
    free(raw);
}

/* Every byte of every spec'd tensor, read back from st. */
static void check_contents(loom_ctx *ctx, const loom_safetensors *st, const spec *sp, size_t n,
                           void **data) {
    CHECK_EQ_INT(loom_st_count(st), n);
    for (size_t i = 0; i < n; i++) {
        const loom_st_tensor *t = loom_st_find(st, sp[i].name);
        if (!t) {
            CHECK_MSG(0, "tensor %s missing", sp[i].name);
            continue;
        }
        CHECK_EQ_INT(t->dtype, sp[i].dt);
        CHECK_EQ_INT(t->ndim, sp[i].ndim);
        for (int d = 0; d < t->ndim; d++) CHECK_EQ_INT(t->shape[d], sp[i].shape[d]);
        size_t nb = spec_bytes(&sp[i]);
        CHECK_EQ_INT(t->nbytes, nb);
        unsigned char *buf = malloc(nb ? nb : 1);
        CHECK_OK(ctx, loom_st_read(ctx, t, t->dtype, buf, t->numel));
        CHECK_MSG(memcmp(buf, data[i], nb) == 0, "tensor %s differs", sp[i].name);
        /* and it is aligned to its element size within the mapping */
        CHECK_EQ_INT((uintptr_t)t->data % loom_dtype_size(t->dtype), 0);
        free(buf);
    }
}

static const spec rt_specs[] = {
    {"w.bf16", LOOM_BF16, 2, {3, 5}},  {"a.f16", LOOM_F16, 1, {7}},
    {"ids", LOOM_I64, 2, {2, 3}},      {"mask", LOOM_BOOL, 1, {5}},
    {"f32", LOOM_F32, 2, {4, 4}},      {"f64", LOOM_F64, 1, {3}},
    {"i32", LOOM_I32, 2, {2, 2}},      {"i16", LOOM_I16, 1, {3}},
    {"i8", LOOM_I8, 1, {5}},           {"u8", LOOM_U8, 2, {3, 1}},
    {"empty", LOOM_F32, 2, {0, 3}},    {"scalar", LOOM_F32, 0, {0}},
    {"scalar.i64", LOOM_I64, 0, {0}},  {"z.last", LOOM_BF16, 4, {1, 2, 1, 3}},
    {"\xc3\xa9t\xc3\xa9 \"q\"\\", LOOM_F32, 1, {1}},
};
#define N_RT (sizeof rt_specs / sizeof rt_specs[0])

/* Declares and writes specs[] (data[i] in the declared dtype), then finishes. */
static loom_status write_specs(loom_ctx *ctx, const char *dir, uint64_t max_shard,
                               const loom_json *meta, const spec *sp, size_t n, void **data) {
    loom_st_writer *w;
    loom_status s = loom_st_writer_create(ctx, dir, "model", max_shard, meta, &w);
    for (size_t i = 0; i < n && s == LOOM_OK; i++)
        s = loom_st_writer_declare(ctx, w, sp[i].name, sp[i].dt, sp[i].ndim, sp[i].shape);
    for (size_t i = 0; i < n && s == LOOM_OK; i++)
        s = loom_st_writer_write(ctx, w, sp[i].name, sp[i].dt, data[i]);
    if (s == LOOM_OK) s = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    return s;
}

static int count_files(const char *dir, const char *suffix) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *de; d && (de = readdir(d));) {
        size_t l = strlen(de->d_name), sl = strlen(suffix);
        n += de->d_name[0] != '.' && l >= sl && strcmp(de->d_name + l - sl, suffix) == 0;
    }
    if (d) closedir(d);
    return d ? n : -1;
}

TEST(safetensors_writer_roundtrip_single) {
    loom_ctx *ctx = new_ctx();
    char *dir = TMP("rt/sub");
    loom_json *meta = meta_pt(ctx, "format", "pt");
    REQUIRE_OK(ctx, loom_json_set(ctx, meta, "note", loom_json_new_str(ctx, "x\ty")));
    void *data[N_RT];
    for (size_t i = 0; i < N_RT; i++) data[i] = random_data(&rt_specs[i]);
    REQUIRE_OK(ctx, write_specs(ctx, dir, 0, meta, rt_specs, N_RT, data));
    loom_json_free(meta); /* the writer kept a copy */
    CHECK_EQ_INT(count_files(dir, ""), 1); /* no index, no temporary file */
    check_layout(ctx, path2(dir, "model.safetensors"), true);
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    check_contents(ctx, st, rt_specs, N_RT, data);
    const loom_json *m = loom_st_metadata(st, 0);
    REQUIRE(m && m->n == 2);
    CHECK_STR(m->keys[0], "format");
    CHECK_STR(loom_json_get(m, "note")->s, "x\ty");
    loom_st_close(st);
    for (size_t i = 0; i < N_RT; i++) free(data[i]);
    loom_ctx_free(ctx);
}

TEST(safetensors_writer_sharded) {
    loom_ctx *ctx = new_ctx();
    KEEP(dir, TMP("sharded"));
    /* 30 tensors: mostly 400 bytes, one of 5000 (over the 1000-byte limit), some empty */
    enum { N = 30 };
    spec sp[N];
    char names[N][32];
    void *data[N];
    loom_dtype dts[] = {LOOM_F32, LOOM_BF16, LOOM_I64, LOOM_U8, LOOM_F16};
    int shard_of[N], ns = 0;
    size_t cur = 0, cnt = 0;
    uint64_t total = 0;
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "layer.%02d.%c", (i * 7) % N, 'a' + i % 3);
        size_t nb = i == 11 ? 5000 : i % 9 == 4 ? 0 : 400;
        sp[i] = (spec){names[i], dts[i % 5], 1, {(int64_t)(nb / loom_dtype_size(dts[i % 5]))}};
        data[i] = random_data(&sp[i]);
        /* expected: declaration order, a new shard when the next tensor would pass 1000 bytes */
        if (cnt && cur + nb > 1000) ns++, cur = 0, cnt = 0;
        shard_of[i] = ns;
        cur += nb, cnt++, total += nb;
    }
    ns++;
    loom_json *meta = meta_pt(ctx, "format", "pt");
    REQUIRE_OK(ctx, write_specs(ctx, dir, 1000, meta, sp, N, data));
    CHECK(ns > 5);
    CHECK_EQ_INT(count_files(dir, ".safetensors"), ns);
    CHECK_EQ_INT(count_files(dir, ""), ns + 1); /* and the index; no temporary files */
    char leaf[N][64];
    for (int s = 0; s < ns; s++) {
        snprintf(leaf[s], sizeof leaf[s], "model-%05d-of-%05d.safetensors", s + 1, ns);
        check_layout(ctx, path2(dir, leaf[s]), true);
    }
    /* the index */
    KEEP(ip, path2(dir, "model.safetensors.index.json"));
    loom_json *idx = NULL;
    REQUIRE_OK(ctx, loom_json_parse_file(ctx, ip, &idx));
    CHECK_EQ_INT(loom_json_get(loom_json_get(idx, "metadata"), "total_size")->i, total);
    const loom_json *wm = loom_json_get(idx, "weight_map");
    REQUIRE(wm && wm->n == N);
    for (size_t i = 1; i < wm->n; i++) CHECK(strcmp(wm->keys[i - 1], wm->keys[i]) < 0);
    for (int i = 0; i < N; i++) CHECK_STR(loom_json_get(wm, sp[i].name)->s, leaf[shard_of[i]]);
    loom_json_free(idx);
    size_t ilen;
    char *itext = (char *)read_all(ctx, ip, &ilen);
    CHECK(itext && strncmp(itext, "{\n  \"metadata\": {\n    \"total_size\": ", 35) == 0);
    free(itext);
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    CHECK_EQ_INT(loom_st_file_count(st), ns);
    check_contents(ctx, st, sp, N, data);
    CHECK_EQ_INT(loom_st_total_bytes(st), total);
    loom_st_close(st);

    /* saving again, unsharded, into the same directory removes the stale index */
    REQUIRE_OK(ctx, write_specs(ctx, dir, 0, meta, sp, N, data));
    CHECK(!loom_file_exists(ip));
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    CHECK_EQ_INT(loom_st_file_count(st), 1);
    check_contents(ctx, st, sp, N, data);
    loom_st_close(st);
    loom_json_free(meta);
    for (int i = 0; i < N; i++) free(data[i]);
    loom_ctx_free(ctx);
}

/* Re-writes every tensor of an opened checkpoint (declared in name order). */
static loom_status rewrite(loom_ctx *ctx, const loom_safetensors *st, const char *dir,
                           uint64_t max_shard, const loom_json *meta) {
    loom_st_writer *w;
    loom_status s = loom_st_writer_create(ctx, dir, "model", max_shard, meta, &w);
    if (s != LOOM_OK) return s;
    for (size_t i = 0; i < loom_st_count(st) && s == LOOM_OK; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        s = loom_st_writer_declare(ctx, w, t->name, t->dtype, t->ndim, t->shape);
    }
    for (size_t i = 0; i < loom_st_count(st) && s == LOOM_OK; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        s = loom_st_writer_write(ctx, w, t->name, t->dtype, t->data);
    }
    if (s == LOOM_OK) s = loom_st_writer_finish(ctx, w);
    loom_st_writer_free(w);
    return s;
}

TEST(safetensors_writer_matches_hf_files) {
    loom_ctx *ctx = new_ctx();
    /* tiny-qwen3: all F32 with __metadata__ {"format":"pt"} */
    char *src = FIX("models/tiny-qwen3/model.safetensors");
    char *dir = TMP("hf1");
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, src, &st));
    REQUIRE_OK(ctx, rewrite(ctx, st, dir, 0, loom_st_metadata(st, 0)));
    char *out = path2(dir, "model.safetensors");
    CHECK_MSG(files_equal(ctx, src, out), "rewritten tiny-qwen3 differs from the fixture");
    loom_st_close(st);

    /* golden: I64, F32 and I32 without metadata (same-size dtypes in HF's order) */
    src = FIX("golden/tiny-qwen3-moe.safetensors");
    dir = TMP("hf2");
    REQUIRE_OK(ctx, loom_st_open_file(ctx, src, &st));
    REQUIRE_OK(ctx, rewrite(ctx, st, dir, 0, NULL));
    out = path2(dir, "model.safetensors");
    CHECK_MSG(files_equal(ctx, src, out), "rewritten golden file differs from the fixture");
    loom_st_close(st);

    /* the sharded tiny-qwen3-untied: both shards and the index */
    char *sdir = FIX("models/tiny-qwen3-untied");
    dir = TMP("hf3");
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, sdir, "model", &st));
    REQUIRE_OK(ctx, rewrite(ctx, st, dir, 812288, loom_st_metadata(st, 0)));
    const char *leaves[] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                            "model.safetensors.index.json"};
    for (int i = 0; i < 3; i++) {
        CHECK_MSG(files_equal(ctx, path2(sdir, leaves[i]), path2(dir, leaves[i])), "%s differs",
                  leaves[i]);
    }
    loom_st_close(st);
    loom_ctx_free(ctx);
}

/* Whether dir/leaf holds exactly the n bytes of want. */
static bool holds(loom_ctx *ctx, const char *dir, const char *leaf, const void *want, size_t n) {
    size_t len;
    unsigned char *b = read_all(ctx, path2(dir, leaf), &len);
    bool ok = b && len == n && memcmp(b, want, n) == 0;
    free(b);
    return ok;
}

/* Exact bytes of Hugging Face's own serialisation tests (safetensors' Rust
 * crate): an empty file, with metadata, and one F32 tensor. */
TEST(safetensors_writer_hf_reference_bytes) {
    loom_ctx *ctx = new_ctx();
    KEEP(dir, TMP("ref"));
    loom_st_writer *w;
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "empty", 0, NULL, &w));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    CHECK(holds(ctx, dir, "empty.safetensors", "\x08\0\0\0\0\0\0\0{}      ", 16));
    loom_json *m = meta_pt(ctx, "framework", "pt");
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "meta", 0, m, &w));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    loom_json_free(m);
    CHECK(holds(ctx, dir, "meta.safetensors",
                "\x28\0\0\0\0\0\0\0{\"__metadata__\":{\"framework\":\"pt\"}}     ", 48));
    float v[6] = {0, 1, 2, 3, 4, 5};
    unsigned char want[96] = {64};
    memcpy(want + 8, "{\"attn.0\":{\"dtype\":\"F32\",\"shape\":[1,2,3],\"data_offsets\":[0,24]}}",
           64);
    memcpy(want + 72, v, 24);
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "one", 0, NULL, &w));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "attn.0", LOOM_F32, 3, (int64_t[]){1, 2, 3}));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "attn.0", LOOM_F32, v));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    CHECK(holds(ctx, dir, "one.safetensors", want, sizeof want));
    loom_ctx_free(ctx);
}

TEST(safetensors_writer_dtype_conversion) {
    loom_ctx *ctx = new_ctx();
    char *dir = TMP("conv");
    /* big enough that the conversion runs in several chunks */
    const size_t nbig = 3 * 1000 * 1000 + 17;
    float *x = malloc(nbig * sizeof *x);
    for (size_t i = 0; i < nbig; i++)
        x[i] = (float)((double)(int64_t)(rnd() % 2000001) - 1e6) / 997.0f;
    float small[5] = {1.0f, -2.5f, 3.14159f, 65504.f, 1e-8f};
    int32_t i32[4] = {1, -2, 2147483647, -2147483647 - 1};
    loom_st_writer *w;
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "model", 0, NULL, &w));
    REQUIRE_OK(ctx,
               loom_st_writer_declare(ctx, w, "big", LOOM_BF16, 1, (int64_t[]){(int64_t)nbig}));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "h", LOOM_F16, 1, (int64_t[]){5}));
    REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, "ids", LOOM_I64, 2, (int64_t[]){2, 2}));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "big", LOOM_F32, x));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "h", LOOM_F32, small));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "ids", LOOM_I32, i32));
    REQUIRE_OK(ctx, loom_st_writer_finish(ctx, w));
    loom_st_writer_free(w);
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_dir(ctx, dir, "model", &st));
    const loom_st_tensor *t = loom_st_find(st, "big");
    REQUIRE(t && t->dtype == LOOM_BF16 && t->numel == nbig);
    float *y = malloc(nbig * sizeof *y);
    REQUIRE_OK(ctx, loom_st_read(ctx, t, LOOM_F32, y, nbig));
    size_t bad = 0;
    for (size_t i = 0; i < nbig; i++) bad += y[i] != loom_bf16_to_f32(loom_f32_to_bf16(x[i]));
    CHECK_EQ_INT(bad, 0);
    float h[5];
    REQUIRE_OK(ctx, loom_st_read_named(ctx, st, "h", 1, (int64_t[]){5}, LOOM_F32, h));
    for (int i = 0; i < 5; i++) CHECK(h[i] == loom_f16_to_f32(loom_f32_to_f16(small[i])));
    int64_t ids[4];
    int32_t back[4];
    REQUIRE_OK(ctx, loom_st_read_named(ctx, st, "ids", 2, (int64_t[]){2, 2}, LOOM_I64, ids));
    REQUIRE_OK(ctx, loom_st_read_named(ctx, st, "ids", 2, (int64_t[]){2, 2}, LOOM_I32, back));
    for (int i = 0; i < 4; i++) CHECK(ids[i] == i32[i] && back[i] == i32[i]);
    /* I64 that does not fit U8: refused, naming the tensor */
    uint8_t u8[4];
    CHECK(loom_st_read_named(ctx, st, "ids", 2, (int64_t[]){2, 2}, LOOM_U8, u8) == FMT);
    CHECK_CONTAINS(loom_last_error(ctx), "'ids'");
    loom_st_close(st);
    free(x);
    free(y);
    loom_ctx_free(ctx);
}

TEST(safetensors_writer_misuse) {
    loom_ctx *ctx = new_ctx();
    KEEP(dir, TMP("misuse"));
    loom_st_writer *w;
#define INVALID(expr, frag)                                   \
    do {                                                      \
        CHECK((expr) == LOOM_ERR_INVALID_ARG);                \
        CHECK_CONTAINS(loom_last_error(ctx), frag);           \
    } while (0)
    loom_json *bad_meta = loom_json_new_object(ctx);
    REQUIRE_OK(ctx, loom_json_set(ctx, bad_meta, "n", loom_json_new_int(ctx, 3)));
    INVALID(loom_st_writer_create(ctx, dir, "model", 0, bad_meta, &w), "metadata['n']");
    loom_json_free(bad_meta);
    INVALID(loom_st_writer_create(ctx, dir, "a/b", 0, NULL, &w), "base name without '/'");

    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "model", 0, NULL, &w));
    float f[4] = {1, 2, 3.5f, 4};
    const int64_t four[1] = {4};
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "a", LOOM_F32, 1, four));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "b", LOOM_I64, 1, four));
    CHECK_OK(ctx, loom_st_writer_declare(ctx, w, "c", LOOM_F32, 1, four));
    INVALID(loom_st_writer_declare(ctx, w, "a", LOOM_F32, 1, four), "'a' is declared twice");
    INVALID(loom_st_writer_declare(ctx, w, "neg", LOOM_F32, 2, (int64_t[]){2, -1}), "bad shape");
    INVALID(loom_st_writer_declare(ctx, w, "deep", LOOM_F32, 9, (int64_t[9]){1}), "9 dimensions");
    INVALID(loom_st_writer_declare(ctx, w, "huge", LOOM_F64, 2, (int64_t[]){INT64_MAX, 4}),
            "'huge'");
    INVALID(loom_st_writer_declare(ctx, w, "__metadata__", LOOM_F32, 0, NULL), "reserved");
    INVALID(loom_st_writer_declare(ctx, w, "\xff", LOOM_F32, 0, NULL), "not UTF-8");
    INVALID(loom_st_writer_finish(ctx, w), "3 declared tensors not written: 'a', 'b', 'c'");
    INVALID(loom_st_writer_write(ctx, w, "zz", LOOM_F32, f), "'zz' was not declared");
    INVALID(loom_st_writer_write(ctx, w, "b", LOOM_F32, f),
            "'b' written out of order: the next one to write is 'a'");
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "a", LOOM_F32, f));
    INVALID(loom_st_writer_write(ctx, w, "a", LOOM_F32, f), "'a' was already written");
    INVALID(loom_st_writer_declare(ctx, w, "late", LOOM_F32, 1, four),
            "cannot declare 'late' after writing has started");
    /* 3.5 is not an I64: refused, and the tensor can then be written properly */
    CHECK(loom_st_writer_write(ctx, w, "b", LOOM_F32, f) == FMT);
    CHECK_CONTAINS(loom_last_error(ctx), "tensor 'b' (F32 to I64): element 2");
    f[2] = 3;
    CHECK_OK(ctx, loom_st_writer_write(ctx, w, "b", LOOM_F32, f));
    INVALID(loom_st_writer_finish(ctx, w), "1 declared tensor not written: 'c'");
    CHECK_EQ_INT(count_files(dir, ".tmp"), 1);
    loom_st_writer_free(w); /* before finish: the temporary file goes, nothing else appears */
    CHECK_EQ_INT(count_files(dir, ""), 0);
#undef INVALID

    /* sharded, abandoned half-way: no files left either */
    REQUIRE_OK(ctx, loom_st_writer_create(ctx, dir, "model", 16, NULL, &w));
    const char *names[4] = {"t0", "t1", "t2", "t3"};
    for (int i = 0; i < 4; i++)
        REQUIRE_OK(ctx, loom_st_writer_declare(ctx, w, names[i], LOOM_F32, 1, four));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "t0", LOOM_F32, f));
    REQUIRE_OK(ctx, loom_st_writer_write(ctx, w, "t1", LOOM_F32, f));
    CHECK_EQ_INT(count_files(dir, ".tmp"), 2);
    loom_st_writer_free(w);
    CHECK_EQ_INT(count_files(dir, ""), 0);
    loom_ctx_free(ctx);
}

/* ---------------------------------------------------------------------- */
/* Bad sharded checkpoints                                                 */
/* ---------------------------------------------------------------------- */

/* Writes shard d/<leaf> holding one U8 [1] tensor per name. */
static void put_shard(const char *leaf, const char *const *names, int n) {
    char h[1024] = "{", rel[256];
    for (int k = 0; k < n; k++) {
        size_t o = strlen(h);
        snprintf(h + o, sizeof h - o,
                 "%s\"%s\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%d,%d]}", k ? "," : "",
                 names[k], k, k + 1);
    }
    strcat(h, "}");
    size_t len;
    unsigned char *b = mk(h, (size_t)n, &len);
    snprintf(rel, sizeof rel, "d/%s", leaf);
    loom_test_write(rel, b, len);
    free(b);
}

/* Writes d/model.safetensors.index.json (unless NULL) and opens d. */
static void bad_dir(int line, const char *index, loom_status want, const char *frag) {
    loom_ctx *ctx = new_ctx();
    if (index) loom_test_write("d/model.safetensors.index.json", index, strlen(index));
    loom_safetensors *st = NULL;
    loom_status s = loom_st_open_dir(ctx, TMP("d"), "model", &st);
    const char *msg = loom_last_error(ctx);
    if (s != want)
        loom_test_fail(__FILE__, line, "status %s, expected %s (%s)", loom_status_str(s),
                       loom_status_str(want), msg);
    if (!strstr(msg, frag)) loom_test_fail(__FILE__, line, "\"%s\" lacks \"%s\"", msg, frag);
    if (s == LOOM_OK) CHECK(loom_st_count(st) == 3 && loom_st_find(st, "c")->file == 1);
    loom_st_close(st);
    loom_ctx_free(ctx);
}
#define BAD_DIR(index, st, frag) bad_dir(__LINE__, index, st, frag)

#define WM(body) "{\"metadata\":{\"total_size\":3},\"weight_map\":{" body "}}"
#define S1 "model-00001-of-00002.safetensors"
#define S2 "model-00002-of-00002.safetensors"
#define AB1_C2 "\"a\":\"" S1 "\",\"b\":\"" S1 "\",\"c\":\"" S2 "\""

TEST(safetensors_bad_sharded_dirs) {
    loom_ctx *ctx = new_ctx();
    REQUIRE_OK(ctx, loom_mkdirs(ctx, TMP("d")));
    loom_ctx_free(ctx);
    BAD_DIR(NULL, LOOM_ERR_NOT_FOUND, "no model.safetensors or model.safetensors.index.json in");
    put_shard(S1, (const char *[]){"a", "b"}, 2);
    put_shard(S2, (const char *[]){"c"}, 1);
    BAD_DIR(WM(AB1_C2), LOOM_OK, "");                        /* the good case */
    BAD_DIR("{\"weight_map\":{" AB1_C2 "}}", LOOM_OK, ""); /* metadata is optional */
    BAD_DIR(WM("\"a\":\"" S1 "\",\"b\":\"" S1 "\",\"c\":\"model-00003.safetensors\""),
            LOOM_ERR_NOT_FOUND,
            "model.safetensors.index.json names shard 'model-00003.safetensors', which does not "
            "exist in");
    BAD_DIR(WM("\"a\":\"../d/" S1 "\""), FMT, "weight_map['a'] must be the file name");
    BAD_DIR(WM("\"a\":\"..\""), FMT, "without '/' or '..'");
    BAD_DIR(WM("\"a\":\"\""), FMT, "weight_map['a']");
    BAD_DIR(WM("\"a\":3"), FMT, "weight_map['a']");
    BAD_DIR("{\"metadata\":{}}", FMT, "\"weight_map\" object");
    BAD_DIR("[]", FMT, "\"weight_map\" object");
    BAD_DIR("{\"weight_map\":{}, \"metadata\":3}", FMT, "\"metadata\" must be");
    BAD_DIR("{\"weight_map\":{\"a\":", FMT, "model.safetensors.index.json");
    /* mapped to the wrong shard / absent / extra in a shard */
    BAD_DIR(WM("\"a\":\"" S2 "\",\"b\":\"" S1 "\",\"c\":\"" S2 "\""), FMT,
            "maps tensor 'a' to shard '" S2 "', but it is in");
    BAD_DIR(WM(AB1_C2 ",\"x\":\"" S2 "\""), FMT,
            "maps tensor 'x' to shard '" S2 "', which does not contain it");
    BAD_DIR(WM("\"a\":\"" S1 "\",\"c\":\"" S2 "\""), FMT,
            "holds tensor 'b', which the weight_map of");
    /* a tensor in two shards */
    put_shard(S2, (const char *[]){"c", "a"}, 2);
    BAD_DIR(WM(AB1_C2), FMT, "duplicate tensor name 'a': it is in both");
    /* a broken shard: its error names it */
    loom_test_write("d/" S2, "xx", 2);
    BAD_DIR(WM(AB1_C2), FMT, S2 ": truncated: file is 2 bytes");
}

/* ---------------------------------------------------------------------- */
/* Interop with Python's safetensors                                       */
/* ---------------------------------------------------------------------- */

/* The values tests/st_interop.py expects for element i of tensor "layer.<k>.<dtype>". */
static void interop_values(int k, loom_dtype dt, size_t n, void *out) {
    for (size_t i = 0; i < n; i++) {
        int64_t base = ((int64_t)i * 7 + k * 13) % 101;
        double v = (double)(base - 50);
        switch (dt) {
        case LOOM_F64: ((double *)out)[i] = v * 0.25; break;
        case LOOM_F32: ((float *)out)[i] = (float)(v * 0.25); break;
        case LOOM_F16: ((uint16_t *)out)[i] = loom_f32_to_f16((float)(v * 0.25)); break;
        case LOOM_BF16: ((uint16_t *)out)[i] = loom_f32_to_bf16((float)(v * 0.25)); break;
        case LOOM_I64: ((int64_t *)out)[i] = (int64_t)v; break;
        case LOOM_I32: ((int32_t *)out)[i] = (int32_t)v; break;
        case LOOM_I16: ((int16_t *)out)[i] = (int16_t)v; break;
        case LOOM_I8: ((int8_t *)out)[i] = (int8_t)v; break;
        case LOOM_U8: ((uint8_t *)out)[i] = (uint8_t)base; break;
        case LOOM_BOOL: ((uint8_t *)out)[i] = (uint8_t)(((int64_t)i + k) % 2); break;
        default: break;
        }
    }
}

static const spec interop_specs[] = {
    {"layer.0.F64", LOOM_F64, 2, {3, 4}}, {"layer.1.F32", LOOM_F32, 2, {5, 7}},
    {"layer.2.F16", LOOM_F16, 1, {9}},    {"layer.3.I64", LOOM_I64, 2, {2, 3}},
    {"layer.4.I32", LOOM_I32, 1, {11}},   {"layer.5.I16", LOOM_I16, 3, {2, 2, 2}},
    {"layer.6.I8", LOOM_I8, 1, {13}},     {"layer.7.U8", LOOM_U8, 2, {3, 3}},
    {"layer.8.BOOL", LOOM_BOOL, 1, {6}},  {"layer.9.F32", LOOM_F32, 0, {0}},
    {"layer.10.F32", LOOM_F32, 2, {0, 3}}, {"layer.11.I64", LOOM_I64, 1, {300}},
    {"layer.12.F32", LOOM_F32, 2, {40, 50}},
};
#define N_IO (sizeof interop_specs / sizeof interop_specs[0])

/* BF16 (which numpy lacks) among the other 2-byte dtypes */
static const spec interop_bf16_specs[] = {
    {"layer.20.BF16", LOOM_BF16, 2, {4, 3}}, {"layer.21.F16", LOOM_F16, 1, {5}},
    {"layer.22.I16", LOOM_I16, 1, {3}},      {"layer.23.F32", LOOM_F32, 1, {2}},
    {"layer.24.BF16", LOOM_BF16, 0, {0}},    {"layer.25.I8", LOOM_I8, 1, {3}},
    {"layer.26.BF16", LOOM_BF16, 1, {1000}},
};
#define N_BF (sizeof interop_bf16_specs / sizeof interop_bf16_specs[0])

static int k_of(const char *name) { return atoi(name + 6); }

/* The values of specs[] (caller frees each). */
static void interop_data(const spec *sp, size_t n, void **data) {
    for (size_t i = 0; i < n; i++) {
        size_t nb = spec_bytes(&sp[i]);
        data[i] = malloc(nb ? nb : 1);
        interop_values(k_of(sp[i].name), sp[i].dt, nb / loom_dtype_size(sp[i].dt), data[i]);
    }
}

static int run_py(const char *const *argv) {
    char *out = NULL;
    int rc = loom_test_run(&out, argv);
    if (rc != 0 || !out || !strstr(out, "ok"))
        fprintf(stderr, "    st_interop.py %s: exit %d: %s\n", argv[2], rc, out ? out : "");
    free(out);
    return rc;
}

/* Has tests/st_interop.py write specs[] to a file, then checks loom reads
 * every value bit-exactly and that loom's writer reproduces the file. */
static void python_writes(loom_ctx *ctx, const spec *sp, size_t n, const char *leaf) {
    KEEP(pyfile, TMP(leaf));
    const char *argv[64] = {"python3", "tests/st_interop.py", "write", pyfile};
    char args[56][64];
    REQUIRE(n <= 56);
    for (size_t i = 0; i < n; i++) {
        int o = snprintf(args[i], sizeof args[i], "%s=", sp[i].name);
        for (int d = 0; d < sp[i].ndim; d++)
            o += snprintf(args[i] + o, sizeof args[i] - (size_t)o, "%s%lld", d ? "," : "",
                          (long long)sp[i].shape[d]);
        argv[4 + i] = args[i];
    }
    CHECK_EQ_INT(run_py(argv), 0);
    void *want[56];
    interop_data(sp, n, want);
    loom_safetensors *st;
    REQUIRE_OK(ctx, loom_st_open_file(ctx, pyfile, &st));
    check_contents(ctx, st, sp, n, want);
    REQUIRE_OK(ctx, rewrite(ctx, st, TMP("rewrite"), 0, loom_st_metadata(st, 0)));
    CHECK_MSG(files_equal(ctx, pyfile, TMP("rewrite/model.safetensors")),
              "loom's rewrite of %s differs", leaf);
    loom_st_close(st);
    for (size_t i = 0; i < n; i++) free(want[i]);
}

TEST(safetensors_python_interop) {
    const char *probe[] = {"python3", "-c", "import safetensors, numpy", NULL};
    if (loom_test_run(NULL, probe) != 0) SKIP("python3 safetensors/numpy not installed");
    loom_ctx *ctx = new_ctx();
    /* loom writes (one file, then shards of at most 2000 bytes); Python checks */
    void *data[N_IO];
    interop_data(interop_specs, N_IO, data);
    loom_json *meta = meta_pt(ctx, "format", "pt");
    char count[16];
    snprintf(count, sizeof count, "%zu", N_IO);
    for (int i = 0; i < 2; i++) {
        KEEP(dir, TMP(i ? "py-sharded" : "py-single"));
        REQUIRE_OK(ctx, write_specs(ctx, dir, i ? 2000 : 0, meta, interop_specs, N_IO, data));
        CHECK_EQ_INT(count_files(dir, ".safetensors"), i ? 3 : 1);
        const char *argv[] = {"python3", "tests/st_interop.py", "check", dir, "model", count, NULL};
        CHECK_EQ_INT(run_py(argv), 0);
    }
    loom_json_free(meta);
    for (size_t i = 0; i < N_IO; i++) free(data[i]);
    /* Python writes; loom reads the values bit-exactly and writes the same bytes */
    python_writes(ctx, interop_specs, N_IO, "from_numpy");
    python_writes(ctx, interop_bf16_specs, N_BF, "from_serialize_file");
    loom_ctx_free(ctx);
}
