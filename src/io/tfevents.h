/* TensorBoard event files, written by loom's own code (no TensorFlow, no
 * protobuf library): `tensorboard --logdir DIR` reads them.
 *
 * A file is a sequence of TFRecords:
 *   uint64 length (little-endian), uint32 masked CRC32C of those 8 bytes,
 *   `length` bytes of data, uint32 masked CRC32C of the data,
 * masked(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8. Each record's data
 * is an Event protobuf:
 *   Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
 *             Summary summary = 5; }
 *   Summary { repeated Value value = 1; }
 *   Value   { string tag = 1; float simple_value = 2; }
 * The first event of a file carries file_version "brain.Event:2" only; then
 * one event per logged step with every scalar of that step.
 *
 * File name: events.out.tfevents.<unix time>.<hostname> in the directory
 * (created when missing). An existing file of that name is never reused or
 * overwritten: ".1", ".2", ... is appended instead, so each run adds its own
 * file and TensorBoard shows them together. */
#ifndef LOOM_TFEVENTS_H
#define LOOM_TFEVENTS_H

#include "../core/core.h"

/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78) of data[0..n),
 * continuing from `crc` (0 to start): crc32c("123456789") = 0xE3069283. */
uint32_t loom_crc32c(uint32_t crc, const void *data, size_t n);
/* TFRecord's mask of a CRC. */
static inline uint32_t loom_crc32c_mask(uint32_t crc) {
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* One scalar of an event. */
typedef struct loom_tb_scalar {
    const char *tag;
    double value; /* written as a float (simple_value) */
} loom_tb_scalar;

/* The Event protobuf bytes (not framed) of one event: file_version when not
 * NULL, else a summary of the n scalars. Appends to sb. */
void loom_tfevents_encode(loom_sb *sb, double wall_time, int64_t step, const char *file_version,
                          const loom_tb_scalar *v, size_t n);
/* Appends the TFRecord framing of data[0..n) to sb. */
void loom_tfrecord_frame(loom_sb *sb, const void *data, size_t n);

typedef struct loom_tfevents loom_tfevents;

/* Creates dir (mkdir -p) and a new event file in it, and writes the
 * file_version event. Errors name the directory or file. */
loom_status loom_tfevents_open(loom_ctx *ctx, const char *dir, loom_tfevents **out);
/* The path of the file being written. */
const char *loom_tfevents_path(const loom_tfevents *w);
/* Writes one event with the scalars of `step` and flushes it to the file. */
loom_status loom_tfevents_write(loom_ctx *ctx, loom_tfevents *w, int64_t step,
                                const loom_tb_scalar *v, size_t n);
/* Closes the file (NULL is fine); a failed close is an error naming it. */
loom_status loom_tfevents_close(loom_ctx *ctx, loom_tfevents *w);

#endif /* LOOM_TFEVENTS_H */
