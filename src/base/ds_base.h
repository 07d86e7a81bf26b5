/* ds_base.h — error reporting, checked allocation and number conversions shared by every module.
 *
 * Error convention: a function that can fail returns int (DS_OK = 0, DS_ERR = -1) or a pointer
 * (NULL on failure) and writes a human-readable message into the caller's ds_err. Only main()
 * decides to exit. Messages name the file, key or tensor and say what was expected vs found. */
#ifndef DS_BASE_H
#define DS_BASE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define DS_OK  0
#define DS_ERR (-1)

typedef struct ds_err {
    char msg[1024];
} ds_err;

/* Writes a formatted message into err (if err is non-NULL) and returns DS_ERR. */
int ds_errf(ds_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepends "prefix: " to an existing message, for adding context on the way up. */
int ds_err_prefix(ds_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* malloc/calloc that report failure through err instead of aborting. */
void *ds_malloc(size_t n, ds_err *err);
void *ds_calloc(size_t n, size_t size, ds_err *err);
/* 64-byte aligned allocation (for SIMD); free with free(). */
void *ds_aligned_alloc(size_t n, ds_err *err);

/* Reads a whole file into a NUL-terminated heap buffer. */
char *ds_read_file(const char *path, size_t *len_out, ds_err *err);

/* A growing NUL-terminated string for building text (JSON headers, grammars). Zero-initialise;
 * a failed allocation latches oom and later appends do nothing; the caller frees p. */
typedef struct ds_sbuf {
    char *p; /* [cap] NUL-terminated, [len] used */
    size_t len, cap;
    int oom;
} ds_sbuf;
void ds_sbuf_put(ds_sbuf *b, const char *s, size_t n);
void ds_sbuf_puts(ds_sbuf *b, const char *s);
void ds_sbuf_printf(ds_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Monotonic wall time in seconds. */
double ds_now(void);

/* Number conversions. bf16 is the upper half of an f32; f32->bf16 rounds to nearest even. */
static inline float ds_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t ds_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
float ds_f16_to_f32(uint16_t h);
uint16_t ds_f32_to_f16(float f);

/* Deterministic RNG (splitmix64 seeding + xoshiro256**), identical on every platform. */
typedef struct ds_rng {
    uint64_t s[4];
} ds_rng;
void ds_rng_seed(ds_rng *r, uint64_t seed);
uint64_t ds_rng_next(ds_rng *r);
double ds_rng_uniform(ds_rng *r); /* [0, 1) with 53 bits */
double ds_rng_normal(ds_rng *r);  /* standard normal (Box-Muller, no cached second value) */

#define DS_MIN(a, b)    ((a) < (b) ? (a) : (b))
#define DS_MAX(a, b)    ((a) > (b) ? (a) : (b))
#define DS_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

#endif
