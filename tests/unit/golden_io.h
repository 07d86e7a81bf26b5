/* golden_io.h — reader for the golden files written by tools/reference/write_golden.py.
 *
 * Format (all little endian; tools/reference/README.md is the normative description):
 *   "DSGOLDEN" (8 bytes) | u32 version = 1 | u32 n_entries |
 *   n_entries x { u16 name_len | name bytes (no NUL) | u8 dtype | u8 ndim | u64 dims[ndim] | raw
 * data } dtype: 0 = f32, 1 = i32, 2 = f64, 3 = u64. Data is row-major, prod(dims) elements (1 if
 * ndim = 0).
 *
 * Plain C11 + libc (+ POSIX opendir for ds_golden_checkpoint_fnv1a64). Every size is validated: a
 * truncated or malformed file gives NULL and a message in errbuf, never a crash. Each entry's data
 * is copied into its own malloc'd (hence suitably aligned) buffer, so the pointer from
 * ds_golden_get may be cast to const float * / const int32_t * / const double * / const uint64_t *.
 */
#ifndef DS_GOLDEN_IO_H
#define DS_GOLDEN_IO_H

#include <stddef.h>
#include <stdint.h>

enum { DS_GOLDEN_F32 = 0, DS_GOLDEN_I32 = 1, DS_GOLDEN_F64 = 2, DS_GOLDEN_U64 = 3 };
#define DS_GOLDEN_MAX_NDIM 16

typedef struct ds_golden ds_golden;

/* Loads the whole file. NULL on error, with a message naming the file and the problem in errbuf
 * (errbuf may be NULL when errlen is 0). */
ds_golden *ds_golden_load(const char *path, char *errbuf, size_t errlen);

/* The data of entry `name` if present with exactly `dtype`, else NULL. ndim / dims (may be NULL)
 * receive its rank and its dims array (owned by g). */
const void *ds_golden_get(const ds_golden *g, const char *name, int dtype, int *ndim,
                          const uint64_t **dims);

/* Element count of entry `name` (any dtype), or 0 when absent. */
uint64_t ds_golden_numel(const ds_golden *g, const char *name);

/* Number of entries and the i-th entry's name (in file order), for listings. */
int ds_golden_count(const ds_golden *g);
const char *ds_golden_name(const ds_golden *g, int i);

void ds_golden_free(ds_golden *g);

/* FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3), incremental. */
#define DS_FNV1A64_INIT UINT64_C(0xcbf29ce484222325)
uint64_t ds_fnv1a64_update(uint64_t h, const void *data, size_t n);

/* FNV-1a 64 over the bytes of every *.safetensors file in `dir`, files taken in strcmp order of
 * their names, hashed as one stream — the value write_golden.py stores in
 * "meta.checkpoint_fnv1a64". Returns 0 on success, -1 (message in errbuf) on error or when there is
 * no such file. */
int ds_golden_checkpoint_fnv1a64(const char *dir, uint64_t *out, char *errbuf, size_t errlen);

#endif
