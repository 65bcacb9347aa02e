/* A per-kernel GPU time profile of any CUDA program, through CUPTI's activity
 * records (the lent GPU machines have no Nsight Systems). Build with
 * `make CUDA=1 BUILD=build-cuda build-cuda/libloom_kprof.so`, then
 *
 *   LD_PRELOAD=build-cuda/libloom_kprof.so build-cuda/loom train ...
 *
 * At exit it prints to stderr, for the window it recorded: kernels grouped by
 * name (calls, total ms, mean us, share of kernel time), memory copies and
 * sets by direction, and how much of the window the GPU was idle (the union
 * of all records against the window's span: host synchronisations, launch
 * gaps). LOOM_KPROF_SKIP=N leaves out the first N kernels (warm-up, model
 * loading); LOOM_KPROF_TOP=K prints K kernels (default 40); LOOM_KPROF_GAPS=K
 * prints the K largest sums of idle time by the records before and after
 * each gap (default none). Names are
 * mangled: pipe through c++filt.
 *
 * Several processes (loom's --nproc-per-node workers): LOOM_KPROF_OUT=path
 * writes each report to path with %r replaced by the process's RANK (0
 * without one) instead of stderr, and LOOM_KPROF_SKIP=N0,N1,... gives each
 * rank its own count. A process that saw no kernels (the launcher) writes
 * nothing. Under NCCL the two-process runs of 2026-11-28 slowed to a fifth
 * with the tracer; LOOM_KPROF_COPIES=0 leaves memory copies and sets out of
 * the trace (kernels only), to see whether those records are the cause. */
#define _POSIX_C_SOURCE 200809L
#include <cupti.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *name;
    uint64_t calls, ns;
} kgroup;

typedef struct {
    uint64_t start, end;
    int what; /* a kernel group, or -1 - copy kind, or -100 for a memset */
} span;

typedef struct { /* GPU idle between two records, summed by their names */
    int before, after;
    uint64_t calls, ns;
} gap;

static kgroup *groups;
static size_t ngroups, capgroups;
static span *spans;
static size_t nspans, capspans;
static uint64_t copy_ns[11], copy_n[11], copy_bytes[11], set_ns, set_n;
static uint64_t kernels_seen, skip;
static struct {
    uint64_t bytes, calls, ns;
} sets[64]; /* memsets by size */
static size_t nsets;

static void add_span(uint64_t s, uint64_t e, int what) {
    if (nspans == capspans) {
        capspans = capspans ? 2 * capspans : 65536;
        span *p = realloc(spans, capspans * sizeof *spans);
        if (!p) abort();
        spans = p;
    }
    spans[nspans++] = (span){s, e, what};
}

static int add_kernel(const char *name, uint64_t ns) {
    for (size_t i = 0; i < ngroups; i++)
        if (!strcmp(groups[i].name, name)) {
            groups[i].calls++, groups[i].ns += ns;
            return (int)i;
        }
    if (ngroups == capgroups) {
        capgroups = capgroups ? 2 * capgroups : 256;
        kgroup *p = realloc(groups, capgroups * sizeof *groups);
        if (!p) abort();
        groups = p;
    }
    groups[ngroups++] = (kgroup){strdup(name ? name : "?"), 1, ns};
    return (int)ngroups - 1;
}

static void CUPTIAPI buffer_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *size = 16u << 20;
    *buf = aligned_alloc(64, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                      size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
            if (kernels_seen++ < skip) continue;
            add_span(k->start, k->end, add_kernel(k->name, k->end - k->start));
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
            if (kernels_seen < skip) continue;
            const unsigned kind = m->copyKind < 11 ? m->copyKind : 0;
            copy_ns[kind] += m->end - m->start, copy_n[kind]++, copy_bytes[kind] += m->bytes;
            add_span(m->start, m->end, -1 - (int)kind);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)rec;
            if (kernels_seen < skip) continue;
            set_ns += m->end - m->start, set_n++;
            size_t k = 0;
            while (k < nsets && sets[k].bytes != m->bytes) k++;
            if (k < 64) {
                if (k == nsets) sets[nsets++].bytes = m->bytes;
                sets[k].calls++, sets[k].ns += m->end - m->start;
            }
            add_span(m->start, m->end, -100);
        }
    }
    free(buf);
}

static int by_time(const void *a, const void *b) {
    const kgroup *x = a, *y = b;
    return x->ns < y->ns ? 1 : x->ns > y->ns ? -1 : 0;
}

static const char *what_name(int w) {
    static const char *kinds[11] = {"memcpy ?",    "memcpy HtoD", "memcpy DtoH", "memcpy HtoA",
                                    "memcpy AtoH", "memcpy AtoA", "memcpy AtoD", "memcpy DtoA",
                                    "memcpy DtoD", "memcpy HtoH", "memcpy PtoP"};
    if (w >= 0) return groups[w].name;
    if (w == -100) return "memset";
    return kinds[-1 - w];
}

static int by_gap(const void *a, const void *b) {
    const gap *x = a, *y = b;
    return x->ns < y->ns ? 1 : x->ns > y->ns ? -1 : 0;
}

static int by_start(const void *a, const void *b) {
    const span *x = a, *y = b;
    return x->start < y->start ? -1 : x->start > y->start;
}

__attribute__((constructor)) static void kprof_start(void) {
    const char *e = getenv("LOOM_KPROF_SKIP"), *r = getenv("RANK");
    long rank = r ? strtol(r, NULL, 10) : 0;
    for (; e && rank > 0; rank--) { /* this rank's entry of N0,N1,... */
        e = strchr(e, ',');
        if (e) e++;
    }
    skip = e ? strtoull(e, NULL, 10) : 0;
    const char *cp = getenv("LOOM_KPROF_COPIES");
    const bool copies = !(cp && !strcmp(cp, "0"));
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
        (copies && (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS ||
                    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET) != CUPTI_SUCCESS)))
        fprintf(stderr, "kprof: CUPTI activity tracing could not be enabled\n");
}

/* Where the report goes: stderr, or LOOM_KPROF_OUT with %r as the rank. */
static FILE *report_file(void) {
    const char *o = getenv("LOOM_KPROF_OUT"), *r = getenv("RANK");
    if (!o || !*o) return stderr;
    char path[4096];
    size_t n = 0;
    for (const char *c = o; *c && n + 24 < sizeof path; c++) {
        if (c[0] == '%' && c[1] == 'r') {
            n += (size_t)snprintf(path + n, sizeof path - n, "%ld", r ? strtol(r, NULL, 10) : 0L);
            c++;
        } else {
            path[n++] = *c;
        }
    }
    path[n] = 0;
    FILE *f = fopen(path, "w");
    if (!f) fprintf(stderr, "kprof: cannot write %s; the report goes to stderr\n", path);
    return f ? f : stderr;
}

__attribute__((destructor)) static void kprof_report(void) {
    cuptiActivityFlushAll(1);
    const char *o = getenv("LOOM_KPROF_OUT");
    if (!kernels_seen && o && *o) return;
    FILE *out = report_file();
    uint64_t total = 0, busy = 0, first = UINT64_MAX, last = 0;
    for (size_t i = 0; i < ngroups; i++) total += groups[i].ns;
    qsort(spans, nspans, sizeof *spans, by_start);
    uint64_t cur_s = 0, cur_e = 0;
    int cur_w = 0;
    gap *gaps = NULL;
    size_t ngaps = 0, capgaps = 0;
    for (size_t i = 0; i < nspans; i++) {
        if (spans[i].start < first) first = spans[i].start;
        if (spans[i].end > last) last = spans[i].end;
        if (i == 0 || spans[i].start > cur_e) {
            if (i > 0) { /* idle from cur_e: by what ended it and what ends it */
                size_t k = 0;
                while (k < ngaps && !(gaps[k].before == cur_w && gaps[k].after == spans[i].what)) k++;
                if (k == ngaps) {
                    if (ngaps == capgaps) {
                        capgaps = capgaps ? 2 * capgaps : 256;
                        gap *p = realloc(gaps, capgaps * sizeof *gaps);
                        if (!p) abort();
                        gaps = p;
                    }
                    gaps[ngaps++] = (gap){cur_w, spans[i].what, 0, 0};
                }
                gaps[k].calls++, gaps[k].ns += spans[i].start - cur_e;
            }
            busy += cur_e - cur_s;
            cur_s = spans[i].start, cur_e = spans[i].end, cur_w = spans[i].what;
        } else if (spans[i].end > cur_e) {
            cur_e = spans[i].end, cur_w = spans[i].what;
        }
    }
    busy += cur_e - cur_s;
    qsort(gaps, ngaps, sizeof *gaps, by_gap);
    const char *tg = getenv("LOOM_KPROF_GAPS");
    size_t topg = tg ? strtoull(tg, NULL, 10) : 0;
    for (size_t i = 0; i < ngaps && i < topg; i++)
        fprintf(out, "kprof: idle %8.3f ms %6llu gaps  after %s  before %s\n", gaps[i].ns / 1e6,
                (unsigned long long)gaps[i].calls, what_name(gaps[i].before), what_name(gaps[i].after));
    free(gaps);
    qsort(groups, ngroups, sizeof *groups, by_time);
    const char *t = getenv("LOOM_KPROF_TOP");
    size_t top = t ? strtoull(t, NULL, 10) : 40;
    fprintf(out, "kprof: %llu kernels (%llu skipped), %.1f ms of kernel time\n",
            (unsigned long long)(kernels_seen > skip ? kernels_seen - skip : 0),
            (unsigned long long)(kernels_seen < skip ? kernels_seen : skip), total / 1e6);
    if (nspans)
        fprintf(out, "kprof: window %.1f ms, GPU busy %.1f ms (%.1f%%), idle %.1f ms\n",
                (last - first) / 1e6, busy / 1e6, 100.0 * busy / (double)(last - first),
                (last - first - busy) / 1e6);
    fprintf(out, "kprof: %8s %10s %9s %6s  %s\n", "calls", "total ms", "mean us", "share", "kernel");
    for (size_t i = 0; i < ngroups && i < top; i++)
        fprintf(out, "kprof: %8llu %10.2f %9.1f %5.1f%%  %s\n", (unsigned long long)groups[i].calls,
                groups[i].ns / 1e6, groups[i].ns / 1e3 / (double)groups[i].calls,
                total ? 100.0 * groups[i].ns / (double)total : 0.0, groups[i].name);
    static const char *kinds[11] = {"?",    "HtoD", "DtoH", "HtoA", "AtoH", "AtoA",
                                    "AtoD", "DtoA", "DtoD", "HtoH", "PtoP"};
    for (int k = 0; k < 11; k++)
        if (copy_n[k])
            fprintf(out, "kprof: memcpy %-5s %8llu calls %10.2f ms %12.1f MB\n", kinds[k],
                    (unsigned long long)copy_n[k], copy_ns[k] / 1e6, copy_bytes[k] / 1e6);
    if (set_n) fprintf(out, "kprof: memset       %8llu calls %10.2f ms\n", (unsigned long long)set_n, set_ns / 1e6);
    for (size_t k = 0; k < nsets; k++)
        fprintf(out, "kprof: memset of %12llu B %8llu calls %10.2f ms\n", (unsigned long long)sets[k].bytes,
                (unsigned long long)sets[k].calls, sets[k].ns / 1e6);
    if (out != stderr) fclose(out);
}
