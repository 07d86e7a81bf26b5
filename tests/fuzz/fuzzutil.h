/* fuzzutil.h — helpers shared by the libFuzzer targets in tests/fuzz/ (not a target itself).
 *
 * A target that must hand the code under test a file or a folder writes the input's parts into
 * one private temporary folder, made on first use and removed at exit. Inputs made of several
 * files are one byte string cut at a separator line, so a seed is readable and the fuzzer's
 * mutations keep the separator. */
#ifndef DS_FUZZUTIL_H
#define DS_FUZZUTIL_H

#include <stddef.h>
#include <stdint.h>

/* The private folder (mkdtemp under $TMPDIR or /tmp); aborts if it cannot be made. */
const char *fz_dir(void);
/* Writes n bytes to fz_dir()/name, replacing it; returns the full path (static buffer of the
 * last call). Aborts on I/O errors: those are the harness's fault, not the input's. */
const char *fz_write(const char *name, const void *p, size_t n);
/* Removes fz_dir()/name if present. */
void fz_remove(const char *name);

/* Cuts data at every occurrence of sep into at most max parts (the last part keeps any further
 * separators). part[i] points into data, len[i] its length. Returns the number of parts. */
int fz_split(const uint8_t *data, size_t size, const char *sep, const uint8_t **part, size_t *len,
             int max);

/* A malloc'd NUL-terminated copy of n bytes (the code under test takes C strings). */
char *fz_strndup(const uint8_t *p, size_t n);

/* With DS_FUZZ_VERBOSE set, prints what one input gave (for checking that seeds reach past the
 * first error): "ok" or the error message. */
void fz_note(const char *what, int rc, const char *msg);

/* Stops the process with a message: an invariant the harness checks does not hold. */
void fz_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#endif
