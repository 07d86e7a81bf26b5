/* safetensors.h — read-only, mmap-backed access to a checkpoint's tensors (one file or a sharded
 * set named by model.safetensors.index.json), and a writer used by init-model.
 *
 * Every header is validated when opened: JSON well formed, every entry has
 * dtype/shape/data_offsets, offsets lie inside the file, are consistent with dtype x shape, and no
 * two tensors overlap. */
#ifndef DS_SAFETENSORS_H
#define DS_SAFETENSORS_H

#include "base/ds_base.h"

typedef enum {
    DS_DT_F32 = 0,
    DS_DT_F16,
    DS_DT_BF16,
    DS_DT_U8,
    DS_DT_I8,
    DS_DT_I32,
    DS_DT_I64,
    DS_DT_F64,
    DS_DT_F8_E4M3, /* OCP e4m3fn (kernels/shared/quant.h) */
    DS_DT_COUNT,   /* the dtypes a safetensors file can hold end here */
    /* A weight format, never a file dtype: MXFP4, two FP4 E2M1 codes a byte with one E8M0 scale
     * per 32 values (ds_mat.scale). Element size 0: size such matrices with ds_mat_bytes. */
    DS_DT_MXFP4
} ds_dtype;

/* "F32", "BF16", ... as safetensors spells them; "MXFP4" */
const char *ds_dtype_name(ds_dtype dt);
size_t ds_dtype_size(ds_dtype dt);

#define DS_MAX_DIMS 8

typedef struct ds_tensor {
    const char *name;
    const char *file; /* path of the file it lives in */
    ds_dtype dtype;
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    int64_t numel;
    const void *data; /* points into the mmap */
    size_t nbytes;
} ds_tensor;

typedef struct ds_st ds_st; /* an open checkpoint: one or more mmapped files */

/* Opens DIR/model.safetensors.index.json if present, else DIR/model.safetensors, else the single
 * *.safetensors file in DIR. */
int ds_st_open_dir(const char *dir, ds_st **out, ds_err *err);
/* Opens one .safetensors file. */
int ds_st_open_file(const char *path, ds_st **out, ds_err *err);
void ds_st_close(ds_st *st);

int ds_st_count(const ds_st *st);
const ds_tensor *ds_st_at(const ds_st *st, int i);
/* NULL when absent. */
const ds_tensor *ds_st_find(const ds_st *st, const char *name);
/* A "__metadata__" value (first file that has the key), NULL when absent. */
const char *ds_st_metadata(const ds_st *st, const char *key);

/* Finds `name` and checks it: dtype must be one of the bits set in dtype_mask (1u << ds_dtype),
 * ndim and shape must match exactly (shape entries < 0 are wildcards). On mismatch, the message
 * names the file, the tensor, the expected and the found dtype/shape. */
int ds_st_get(const ds_st *st, const char *name, unsigned dtype_mask, int ndim,
              const int64_t *shape, const ds_tensor **out, ds_err *err);

/* Converts any float tensor (F32/F16/BF16/F64) to f32 into dst[numel]. */
int ds_tensor_to_f32(const ds_tensor *t, float *dst, ds_err *err);

/* Writer: collects tensors in memory order, then writes one file (header padded to 8 bytes). */
typedef struct ds_st_writer ds_st_writer;
ds_st_writer *ds_st_writer_new(ds_err *err);
/* Copies nbytes of data. */
int ds_st_writer_add(ds_st_writer *w, const char *name, ds_dtype dtype, int ndim,
                     const int64_t *shape, const void *data, ds_err *err);
/* Adds (or replaces) a "__metadata__" string entry; written first in the header. */
int ds_st_writer_set_metadata(ds_st_writer *w, const char *key, const char *value, ds_err *err);
/* Writes path (via a temporary file and rename). Tensor data is laid out largest element size
 * first, so every tensor is aligned to its element size; the header keeps insertion order. */
int ds_st_writer_write(ds_st_writer *w, const char *path, ds_err *err);
size_t ds_st_writer_bytes(const ds_st_writer *w);
void ds_st_writer_free(ds_st_writer *w);

#endif
