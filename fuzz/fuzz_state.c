/* libFuzzer target for the training state's reader (src/io/state_format.h):
 * the piece table of meta.json, the part of a checkpoint no checksum
 * covers.
 *
 * At start a directory gets a real rank_00000.safetensors (tensor "a", 4 x
 * 6, in two pieces with moments; tensor "b", 5 elements, values only). The
 * input is the value of meta.json's "tensors", set into a header that lists
 * that file with its true checksum. Each input is opened and "a" and "b"
 * are read (values and moments): whatever the table says, a read either
 * succeeds (then it assembled every element) or fails with a message naming
 * meta.json; never a write out of bounds (ASan) or a hang. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../src/core/json.h"
#include "../src/io/state_format.h"

#define CHECK(c)                                                                       \
    do {                                                                               \
        if (!(c)) {                                                                    \
            fprintf(stderr, "fuzz_state: check failed: %s (line %d)\n", #c, __LINE__); \
            abort();                                                                   \
        }                                                                              \
    } while (0)

static char dir[64];
static char sha[65];

static void cleanup(void) {
    char p[128];
    snprintf(p, sizeof p, "%s/meta.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/rank_00000.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    snprintf(dir, sizeof dir, "/tmp/loom-fuzz-state-XXXXXX");
    CHECK(mkdtemp(dir));
    atexit(cleanup);
    loom_ctx *ctx;
    CHECK(loom_ctx_create(&ctx) == LOOM_OK);
    char *names[2] = {"a", "b"};
    int64_t shape[2][2] = {{4, 6}, {5, 1}};
    int ndim[2] = {2, 1};
    loom_state_tensors t = {names, shape, ndim, 2};
    loom_state_piece p[3] = {{0, 0, 0, 4, 6, 0, 12, 1}, {0, 0, 0, 4, 6, 12, 12, 1},
                             {1, 0, 0, 5, 1, 0, 5, 0}};
    size_t at[3] = {0, 12, 24};
    static float v[32], m1[32], m2[32];
    for (int i = 0; i < 32; i++) v[i] = (float)i, m1[i] = (float)-i, m2[i] = (float)(i * i);
    float *data[3] = {v, m1, m2};
    CHECK(loom_state_file_write(ctx, dir, 0, &t, p, at, 3, data, true, sha) == LOOM_OK);
    loom_ctx_free(ctx);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 1 << 16) return 0;
    char path[128];
    snprintf(path, sizeof path, "%s/meta.json", dir);
    FILE *f = fopen(path, "wb");
    CHECK(f);
    fprintf(f, "{\"format\": \"loom-training-state\", \"version\": 2, \"world_size\": 1, "
               "\"files\": {\"rank_00000.safetensors\": \"%s\"}, \"tensors\": ", sha);
    fwrite(data, 1, size, f);
    fputs("}", f);
    CHECK(fclose(f) == 0);
    loom_ctx *ctx;
    if (loom_ctx_create(&ctx) != LOOM_OK) return 0;
    loom_state_reader *r = NULL;
    loom_status s = loom_state_open(ctx, dir, &r);
    if (s) {
        CHECK(!r && strstr(loom_last_error(ctx), "meta.json"));
        loom_ctx_free(ctx);
        return 0;
    }
    float full[24];
    for (int k = 0; k < 3; k++) {
        s = loom_state_read(r, "a", 2, 4, 6, k, full);
        CHECK(s == LOOM_OK || strstr(loom_last_error(ctx), "meta.json") ||
              strstr(loom_last_error(ctx), "rank_00000"));
    }
    s = loom_state_read(r, "b", 1, 5, 1, 0, full);
    CHECK(s == LOOM_OK || strstr(loom_last_error(ctx), "meta.json") ||
          strstr(loom_last_error(ctx), "rank_00000"));
    loom_state_close(r);
    loom_ctx_free(ctx);
    return 0;
}
