/* SHA-256 (FIPS 180-4): a streaming digest and the hash of a whole file,
 * for the checksums of checkpoint files. */
#ifndef LOOM_SHA256_H
#define LOOM_SHA256_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h"

typedef struct loom_sha256 {
    uint32_t h[8];       /* the running hash value */
    uint64_t total;      /* bytes hashed so far */
    uint8_t block[64];   /* a partial block */
    size_t fill;         /* its length */
    bool accel;          /* the CPU has SHA instructions (asked by init) */
    bool portable;       /* set after init: never the CPU's SHA instructions (tests) */
} loom_sha256;

void loom_sha256_init(loom_sha256 *s);
/* Whether this CPU hashes through its SHA instructions (x86-64 SHA-NI). */
bool loom_sha256_accelerated(void);
void loom_sha256_update(loom_sha256 *s, const void *data, size_t len);
/* Writes the 32-byte digest; s must be initialised again before reuse. */
void loom_sha256_final(loom_sha256 *s, uint8_t digest[32]);
/* The digest as 64 lowercase hex digits and a NUL. */
void loom_sha256_hex(const uint8_t digest[32], char hex[65]);
/* The hex digest of the file at path, read in chunks; errors name the file. */
loom_status loom_sha256_file(loom_ctx *ctx, const char *path, char hex[65]);

#endif /* LOOM_SHA256_H */
