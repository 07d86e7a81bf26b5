/* kv_row.h — the stored forms of an MLA latent row [c (R values) | kR (dr values)], one
 * definition for the CPU kernels, the CUDA kernels, the engine and the tests
 * (docs/quantization.md §4, "The latent cache's dtypes"):
 *
 *   DS_KV_F32   [R + dr] f32: the values as computed (--kv-cache-dtype auto)
 *   DS_KV_FP8   kv_fp8.h's row: E4M3 codes with a scale a 128 values, kR in BF16 (656 bytes at
 *               R 512, dr 64)
 *   DS_KV_BF16  [R + dr] BF16, round to nearest even, padded to 16 bytes (1,152 bytes at K3's
 *               shape): what a BF16 model's cache holds in vLLM and SGLang, half the f32 bytes
 *               that a long context's decode reads
 *
 * Every attention reads a row's values as f32 (FP8: the dequantized products; BF16: the exact
 * widening), so a row reads back the same on every backend. The value of a dtype is its index
 * in ds_kv_dtype_names (model.h), --kv-cache-dtype's choices. */
#ifndef DS_KV_ROW_H
#define DS_KV_ROW_H

#include "kernels/shared/kv_fp8.h"

enum { DS_KV_F32 = 0, DS_KV_FP8 = 1, DS_KV_BF16 = 2 };

/* Bytes of one stored row of dtype dt (a multiple of 16 but for f32 rows of odd widths, which
 * the CPU's kernels read as floats). */
static inline DS_HD size_t ds_kv_row_bytes(int dt, int R, int dr) {
    if (dt == DS_KV_FP8) return ds_kv_fp8_row_bytes(R, dr);
    if (dt == DS_KV_BF16) return (2 * (size_t)(R + dr) + 15) & ~(size_t)15;
    return (size_t)(R + dr) * sizeof(float);
}

/* row [ds_kv_row_bytes(DS_KV_BF16, R, dr)] <- x [R + dr] in BF16 (padding zeroed). */
static inline DS_HD void ds_kv_bf16_row(uint8_t *row, const float *x, int R, int dr) {
    for (int i = 0; i < R + dr; i++) {
        const uint16_t h = ds_kv_bf16(x[i]);
        memcpy(row + 2 * (size_t)i, &h, 2);
    }
    for (size_t b = 2 * (size_t)(R + dr); b < ds_kv_row_bytes(DS_KV_BF16, R, dr); b++) row[b] = 0;
}

/* Value i (< R + dr) of a stored BF16 row. */
static inline DS_HD float ds_kv_bf16_row_value(const uint8_t *row, int i) {
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)i, 2);
    return ds_kv_bf16_value(h);
}

/* row [ds_kv_row_bytes(dt, R, dr)] <- the stored form of x [R + dr] in dtype dt. */
static inline DS_HD void ds_kv_row_store(int dt, uint8_t *row, const float *x, int R, int dr) {
    if (dt == DS_KV_FP8)
        ds_kv_fp8_quant_row(row, x, R, dr);
    else if (dt == DS_KV_BF16)
        ds_kv_bf16_row(row, x, R, dr);
    else
        memcpy(row, x, (size_t)(R + dr) * sizeof(float));
}

/* Value i (< R + dr) of a stored row of dtype dt, as every attention reads it. */
static inline DS_HD float ds_kv_row_value(int dt, const uint8_t *row, int R, int i) {
    if (dt == DS_KV_FP8) return ds_kv_fp8_value(row, R, i);
    if (dt == DS_KV_BF16) return ds_kv_bf16_row_value(row, i);
    float v;
    memcpy(&v, row + 4 * (size_t)i, 4);
    return v;
}

#endif
