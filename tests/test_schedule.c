/* Pipeline schedules: every rank's steps, run together under the pipeline's
 * data dependencies, complete without deadlock; each (chunk, micro-batch)
 * runs forward once, then backward once; 1F1B keeps at most pp - rank
 * micro-batches in flight. */
#include <stdlib.h>

#include "../src/parallel/schedule.h"
#include "harness.h"

enum { MAXR = 8, MAXV = 4, MAXMB = 16 };

static bool simulate(int pp, int vpp, int nmb) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_pp_step *s[MAXR];
    int n[MAXR], pos[MAXR] = {0};
    /* done[v][mb]: 1 forward done, 2 backward done, by virtual stage */
    static int fdone[MAXR * MAXV][MAXMB], bdone[MAXR * MAXV][MAXMB];
    memset(fdone, 0, sizeof fdone);
    memset(bdone, 0, sizeof bdone);
    for (int r = 0; r < pp; r++)
        if (loom_pp_schedule(ctx, pp, vpp, r, nmb, &s[r], &n[r])) return false;
    const int V = pp * vpp;
    bool progress = true, ok = true;
    while (progress) {
        progress = false;
        for (int r = 0; r < pp; r++) {
            if (pos[r] == n[r]) continue;
            loom_pp_step st = s[r][pos[r]];
            int v = st.chunk * pp + r, mb = st.mb;
            bool ready = st.forward ? (v == 0 || fdone[v - 1][mb])
                                    : (fdone[v][mb] && (v == V - 1 || bdone[v + 1][mb]));
            if (!ready) continue;
            if (st.forward) {
                if (fdone[v][mb]++) ok = false; /* twice */
            } else {
                if (bdone[v][mb]++) ok = false;
            }
            pos[r]++;
            progress = true;
        }
    }
    for (int r = 0; r < pp; r++) {
        if (pos[r] != n[r] || n[r] != 2 * nmb * vpp) ok = false;
        if (vpp == 1 && loom_pp_max_in_flight(s[r], n[r], vpp) > pp - r) ok = false;
        free(s[r]);
    }
    for (int v = 0; v < V; v++)
        for (int mb = 0; mb < nmb; mb++)
            if (fdone[v][mb] != 1 || bdone[v][mb] != 1) ok = false;
    loom_ctx_free(ctx);
    return ok;
}

TEST(schedule_runs_without_deadlock) {
    for (int pp = 1; pp <= 4; pp++)
        for (int vpp = 1; vpp <= 3; vpp++)
            for (int nmb = 1; nmb <= 12; nmb++) {
                if (vpp > 1 && nmb % pp) continue;
                CHECK_MSG(simulate(pp, vpp, nmb), "pp=%d vpp=%d nmb=%d", pp, vpp, nmb);
            }
}

TEST(schedule_1f1b_shape) {
    loom_ctx *ctx;
    loom_ctx_create(&ctx);
    loom_pp_step *s;
    int n;
    /* pp=4, rank 1, 6 micro-batches: 2 warm-up forwards, then F B pairs */
    REQUIRE_OK(ctx, loom_pp_schedule(ctx, 4, 1, 1, 6, &s, &n));
    const char *want = "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5";
    char got[128] = "";
    for (int i = 0; i < n; i++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%c%d", i ? " " : "",
                 s[i].forward ? 'F' : 'B', s[i].mb);
    CHECK_STR(got, want);
    free(s);
    CHECK(loom_pp_schedule(ctx, 2, 2, 0, 3, &s, &n) == LOOM_ERR_CONFIG);
    CHECK_CONTAINS(loom_last_error(ctx), "micro-batches (3) to be a multiple of pp=2");
    loom_ctx_free(ctx);
}
