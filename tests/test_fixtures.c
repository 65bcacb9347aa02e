/* The repository's fixtures (tests/fixtures) against the shared checkout
 * they were copied from (../shared/fixtures, beside the clone): every file
 * but README.md byte for byte, so a regenerated shared set cannot leave the
 * tests comparing with stale references. Without ../shared the check is
 * skipped and says so. tools/sync_fixtures.sh copies them again. */
#include <dirent.h>
#include <stdlib.h>

#include "harness.h"

/* The in-repository sets and their shared twins; a set the repository does
 * not have (yet) is not checked. */
static const struct {
    const char *repo, *shared;
} sets[] = {
    {"tests/fixtures", "../shared/fixtures"},
    {"tests/fixtures_qwen3_5", "../shared/fixtures_qwen3_5"},
};

/* Compares every file under repo/rel with shared/rel (README.md at the top
 * excepted); each one that differs or is missing there is appended to
 * drifted (one per line). Returns the number of files compared. */
static int compare_tree(loom_ctx *ctx, const char *repo, const char *shared, const char *rel,
                        loom_sb *drifted) {
    char dir[2048];
    snprintf(dir, sizeof dir, "%s%s%s", repo, *rel ? "/" : "", rel);
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (de->d_name[0] == '.') continue;
        if (!*rel && !strcmp(de->d_name, "README.md")) continue; /* the repository's own */
        char sub[1024], mine[4096], twin[4096];
        snprintf(sub, sizeof sub, "%s%s%s", rel, *rel ? "/" : "", de->d_name);
        snprintf(mine, sizeof mine, "%s/%s", repo, sub);
        snprintf(twin, sizeof twin, "%s/%s", shared, sub);
        if (loom_dir_exists(mine)) {
            n += compare_tree(ctx, repo, shared, sub, drifted);
            continue;
        }
        n++;
        char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        loom_status sa = loom_read_file(ctx, mine, 0, &a, &la);
        loom_status sb = loom_file_exists(twin) ? loom_read_file(ctx, twin, 0, &b, &lb) : LOOM_ERR_NOT_FOUND;
        if (sa != LOOM_OK || sb != LOOM_OK || la != lb || memcmp(a, b, la) != 0)
            loom_sb_printf(drifted, "  %s (%s)\n", mine,
                           sa != LOOM_OK   ? "unreadable"
                           : sb != LOOM_OK ? "not in the shared set"
                                           : "differs");
        free(a);
        free(b);
    }
    closedir(d);
    return n;
}

TEST(fixtures_match_shared) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    int checked_sets = 0;
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++) {
        if (!loom_dir_exists(sets[i].repo)) continue;
        if (!loom_dir_exists(sets[i].shared)) continue;
        checked_sets++;
        loom_sb drifted = {0};
        int n = compare_tree(ctx, sets[i].repo, sets[i].shared, "", &drifted);
        CHECK_MSG(n > 0, "no files under %s", sets[i].repo);
        char *list = loom_sb_take(&drifted);
        CHECK_MSG(!list || !*list,
                  "%s has drifted from %s:\n%s  re-sync: bash tools/sync_fixtures.sh %s %s",
                  sets[i].repo, sets[i].shared, list ? list : "", sets[i].shared, sets[i].repo);
        free(list);
    }
    loom_ctx_free(ctx);
    if (!checked_sets)
        SKIP("no ../shared/fixtures beside the checkout: the drift check of tests/fixtures "
             "against it is skipped");
}

/* The comparison itself finds a changed byte, a missing twin and nothing
 * else (README.md at the top is the repository's own). */
TEST(fixtures_drift_detected) {
    loom_ctx *ctx;
    REQUIRE(loom_ctx_create(&ctx) == LOOM_OK);
    char repo[1024], shared[1024];
    snprintf(repo, sizeof repo, "%s/repo", loom_test_tmpdir());
    snprintf(shared, sizeof shared, "%s/shared", loom_test_tmpdir());
    static const char *const files[] = {"models/m/config.json", "golden/g.json", "MANIFEST.json"};
    for (int side = 0; side < 2; side++) {
        const char *root = side ? shared : repo;
        for (int i = 0; i < 3; i++) {
            char p[2048];
            snprintf(p, sizeof p, "%s/%s", root, files[i]);
            char *slash = strrchr(p, '/');
            *slash = 0;
            REQUIRE_OK(ctx, loom_mkdirs(ctx, p));
            *slash = '/';
            REQUIRE_OK(ctx, loom_write_file_atomic(ctx, p, "{\"a\": 1}\n", 9));
        }
        char p[2048];
        snprintf(p, sizeof p, "%s/README.md", root);
        REQUIRE_OK(ctx, loom_write_file_atomic(ctx, p, side ? "theirs\n" : "ours\n", side ? 7 : 5));
    }
    loom_sb d = {0};
    CHECK_EQ_INT(compare_tree(ctx, repo, shared, "", &d), 3);
    char *list = loom_sb_take(&d);
    CHECK_MSG(!list || !*list, "identical trees reported: %s", list);
    free(list);

    char p[2048];
    snprintf(p, sizeof p, "%s/golden/g.json", shared);
    REQUIRE_OK(ctx, loom_write_file_atomic(ctx, p, "{\"a\": 2}\n", 9)); /* same size, one byte */
    snprintf(p, sizeof p, "%s/repo/models/m/extra.bin", loom_test_tmpdir());
    REQUIRE_OK(ctx, loom_write_file_atomic(ctx, p, "x", 1));
    CHECK_EQ_INT(compare_tree(ctx, repo, shared, "", &d), 4);
    list = loom_sb_take(&d);
    CHECK_CONTAINS(list, "repo/golden/g.json (differs)");
    CHECK_CONTAINS(list, "repo/models/m/extra.bin (not in the shared set)");
    CHECK_MSG(!strstr(list, "config.json") && !strstr(list, "README"), "reported: %s", list);
    free(list);
    loom_ctx_free(ctx);
}
