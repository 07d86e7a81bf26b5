/* testutil.h — small helpers shared by the C tests (cmocka). */
#ifndef DS_TESTUTIL_H
#define DS_TESTUTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

/* max_i |a_i - b_i| / max(max_i |b_i|, tiny): relative error against a reference's scale. */
double ds_test_rel_err(const float *a, const double *b, size_t n);
double ds_test_rel_err_f(const float *a, const float *b, size_t n);
/* A fresh temporary directory (mkdtemp under $TMPDIR or /tmp); caller frees the string. */
char *ds_test_tmpdir(void);
/* Writes a file; returns 0 on success. */
int ds_test_write_file(const char *path, const void *data, size_t n);
/* from_dir/config.json copied into to_dir (a folder for --load-format random); 0 on success. */
int ds_test_copy_config(const char *from_dir, const char *to_dir);
/* $DS_SOURCE_DIR/rel (or ./rel); caller frees. */
char *ds_test_src_path(const char *rel);

/* n repetitions in the plain build, a quarter of them under the sanitizers (several times slower):
 * that run is there for memory errors and undefined behaviour on every path, while the
 * statistical power of a repetition-heavy test comes from the plain build's run. */
#ifdef __SANITIZE_ADDRESS__
#define DS_TEST_SANITIZED 1
#else
#define DS_TEST_SANITIZED 0
#endif
#define DS_TEST_REPS(n) (DS_TEST_SANITIZED ? ((n) + 3) / 4 : (n))

#endif
