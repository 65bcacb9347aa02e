/* TensorBoard event files: TFRecord framing, CRC32C and the few protobuf
 * fields of Event and Summary (tfevents.h). */
#include "tfevents.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct loom_tfevents {
    FILE *f;
    char *path;
};

uint32_t loom_crc32c(uint32_t crc, const void *data, size_t n) {
    const uint8_t *p = data;
    crc = ~crc;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/* ---- protobuf: the wire types loom needs ---- */

static void pb_varint(loom_sb *sb, uint64_t v) {
    char b[10];
    size_t n = 0;
    do {
        b[n] = (char)(v & 0x7f);
        v >>= 7;
        if (v) b[n] = (char)(b[n] | 0x80);
        n++;
    } while (v);
    loom_sb_append(sb, b, n);
}

/* field number and wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32) */
static void pb_key(loom_sb *sb, unsigned field, unsigned wire) {
    pb_varint(sb, (uint64_t)field << 3 | wire);
}

static void pb_fixed(loom_sb *sb, uint64_t v, int bytes) {
    char b[8];
    for (int i = 0; i < bytes; i++) b[i] = (char)(v >> (8 * i) & 0xff);
    loom_sb_append(sb, b, (size_t)bytes);
}

static void pb_bytes(loom_sb *sb, unsigned field, const void *data, size_t n) {
    pb_key(sb, field, 2);
    pb_varint(sb, n);
    loom_sb_append(sb, data, n);
}

static void pb_double(loom_sb *sb, unsigned field, double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    pb_key(sb, field, 1);
    pb_fixed(sb, u, 8);
}

static void pb_float(loom_sb *sb, unsigned field, float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    pb_key(sb, field, 5);
    pb_fixed(sb, u, 4);
}

void loom_tfevents_encode(loom_sb *sb, double wall_time, int64_t step, const char *file_version,
                          const loom_tb_scalar *v, size_t n) {
    pb_double(sb, 1, wall_time);
    pb_key(sb, 2, 0);
    pb_varint(sb, (uint64_t)step); /* int64: two's complement, 10 bytes when negative */
    if (file_version) {
        pb_bytes(sb, 3, file_version, strlen(file_version));
        return;
    }
    loom_sb summary, value;
    loom_sb_init(&summary);
    loom_sb_init(&value);
    for (size_t i = 0; i < n; i++) {
        value.len = 0;
        pb_bytes(&value, 1, v[i].tag, strlen(v[i].tag));
        pb_float(&value, 2, (float)v[i].value);
        pb_bytes(&summary, 1, value.buf, value.len);
    }
    if (summary.failed || value.failed)
        sb->failed = true;
    else
        pb_bytes(sb, 5, summary.buf ? summary.buf : "", summary.len);
    loom_sb_free(&summary);
    loom_sb_free(&value);
}

void loom_tfrecord_frame(loom_sb *sb, const void *data, size_t n) {
    char len[8];
    for (int i = 0; i < 8; i++) len[i] = (char)((uint64_t)n >> (8 * i) & 0xff);
    loom_sb_append(sb, len, 8);
    pb_fixed(sb, loom_crc32c_mask(loom_crc32c(0, len, 8)), 4);
    loom_sb_append(sb, data, n);
    pb_fixed(sb, loom_crc32c_mask(loom_crc32c(0, data, n)), 4);
}

static double wall_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Frames one event and writes it; flushes. */
static loom_status write_event(loom_ctx *ctx, loom_tfevents *w, int64_t step,
                               const char *file_version, const loom_tb_scalar *v, size_t n) {
    loom_sb ev, rec;
    loom_sb_init(&ev);
    loom_sb_init(&rec);
    loom_tfevents_encode(&ev, wall_now(), step, file_version, v, n);
    if (!ev.failed) loom_tfrecord_frame(&rec, ev.buf, ev.len);
    loom_status st = LOOM_OK;
    if (ev.failed || rec.failed)
        st = loom_errf(ctx, LOOM_ERR_OOM, "%s: out of memory encoding an event", w->path);
    else if (fwrite(rec.buf, 1, rec.len, w->f) != rec.len || fflush(w->f) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: write failed: %s", w->path, strerror(errno));
    loom_sb_free(&ev);
    loom_sb_free(&rec);
    return st;
}

loom_status loom_tfevents_open(loom_ctx *ctx, const char *dir, loom_tfevents **out) {
    *out = NULL;
    if (!dir || !*dir) return loom_errf(ctx, LOOM_ERR_INVALID_ARG, "--tensorboard-dir is empty");
    loom_status st = loom_mkdirs(ctx, dir);
    if (st) return loom_err_prefix(ctx, "--tensorboard-dir");
    char host[256] = "localhost";
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "localhost");
    host[sizeof host - 1] = '\0';
    for (char *p = host; *p; p++)
        if (*p == '/') *p = '_';
    loom_tfevents *w = loom_calloc(ctx, 1, sizeof *w, "event file writer");
    if (!w) return LOOM_ERR_OOM;
    const long long t = (long long)time(NULL);
    int fd = -1;
    for (int k = 0; k < 1000 && fd < 0; k++) {
        char name[400];
        if (k)
            snprintf(name, sizeof name, "events.out.tfevents.%lld.%s.%d", t, host, k);
        else
            snprintf(name, sizeof name, "events.out.tfevents.%lld.%s", t, host);
        free(w->path);
        if (!(w->path = loom_path_join(ctx, dir, name))) {
            free(w);
            return LOOM_ERR_OOM;
        }
        /* O_EXCL: another run's file of the same second is never touched */
        fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0 || !(w->f = fdopen(fd, "wb"))) {
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: cannot create the event file: %s", w->path,
                       strerror(errno));
        if (fd >= 0) close(fd);
        free(w->path);
        free(w);
        return st;
    }
    if ((st = write_event(ctx, w, 0, "brain.Event:2", NULL, 0))) {
        loom_tfevents_close(NULL, w);
        return st;
    }
    *out = w;
    return LOOM_OK;
}

const char *loom_tfevents_path(const loom_tfevents *w) { return w->path; }

loom_status loom_tfevents_write(loom_ctx *ctx, loom_tfevents *w, int64_t step,
                                const loom_tb_scalar *v, size_t n) {
    return write_event(ctx, w, step, NULL, v, n);
}

loom_status loom_tfevents_close(loom_ctx *ctx, loom_tfevents *w) {
    if (!w) return LOOM_OK;
    loom_status st = LOOM_OK;
    if (fclose(w->f) != 0)
        st = loom_errf(ctx, LOOM_ERR_IO, "%s: close failed: %s", w->path, strerror(errno));
    free(w->path);
    free(w);
    return st;
}
