/* kv_fp8.h — one row of the FP8 MLA latent cache (docs/quantization.md, "FP8 latent cache"), one
 * definition for the CPU kernels, the CUDA kernels and the tests, so that a row written on either
 * side holds the same bytes and reads back as the same floats.
 *
 * A latent row [c (R values) | kR (dr values)] is stored as
 *
 *   bytes [0, R)                      c codes, E4M3; tile j = values [128 j, 128 j + 128)
 *   bytes [R, R + 4 ceil(R/128))      f32 scale of each tile: ds_ptpc_scale(amax of the tile)
 *   then 2 dr bytes                   kR in BF16 (round to nearest even)
 *   padding to a multiple of 16 bytes (zeros)
 *
 * A c value is e4m3(x * (1 / s)) and reads back as f32(e4m3 value * s); a kR value reads back as
 * its BF16 value. 656 bytes at R = 512, dr = 64. */
#ifndef DS_KV_FP8_H
#define DS_KV_FP8_H

#include "kernels/shared/quant.h"

#include <stddef.h>
#include <stdint.h>

#define DS_KV_FP8_TILE 128 /* c values that share one scale */

/* Tiles (scales) of a row with R latent values. */
static inline DS_HD int ds_kv_fp8_tiles(int R) {
    return (R + DS_KV_FP8_TILE - 1) / DS_KV_FP8_TILE;
}
/* Where the rope part starts in a row. */
static inline DS_HD int ds_kv_fp8_rope_at(int R) {
    return R + 4 * ds_kv_fp8_tiles(R);
}
/* Bytes of one stored row (a multiple of 16, so every row of a pool starts 16-byte aligned). */
static inline DS_HD size_t ds_kv_fp8_row_bytes(int R, int dr) {
    size_t n = (size_t)ds_kv_fp8_rope_at(R) + 2 * (size_t)dr;
    return (n + 15) & ~(size_t)15;
}

/* BF16 of x, round to nearest even (a NaN stays a quiet NaN): base/ds_base.h's ds_f32_to_bf16,
 * compiled for the device too. */
static inline DS_HD uint16_t ds_kv_bf16(float x) {
    uint32_t u = ds_f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline DS_HD float ds_kv_bf16_value(uint16_t h) {
    return ds_bits_f32((uint32_t)h << 16);
}

/* Tile j's scale of a stored row (R latent values). */
static inline DS_HD float ds_kv_fp8_scale(const uint8_t *row, int R, int j) {
    float s;
    memcpy(&s, row + R + 4 * (size_t)j, 4);
    return s;
}

/* Value i (< R + dr) of a stored row, as every attention reads it. */
static inline DS_HD float ds_kv_fp8_value(const uint8_t *row, int R, int i) {
    if (i < R) return ds_e4m3_to_f32(row[i]) * ds_kv_fp8_scale(row, R, i / DS_KV_FP8_TILE);
    uint16_t h;
    memcpy(&h, row + ds_kv_fp8_rope_at(R) + 2 * (size_t)(i - R), 2);
    return ds_kv_bf16_value(h);
}

/* The scale of a tile of n values x[0..n). The largest magnitude ignores NaN. */
static inline DS_HD float ds_kv_fp8_tile_scale(const float *x, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    return ds_ptpc_scale(amax);
}

/* Stores one tile: codes[i] = e4m3(x[i] * (1 / s)) for i < n, s (the tile's scale) at *scale. */
static inline DS_HD void ds_kv_fp8_put_tile(uint8_t *codes, uint8_t *scale, const float *x, int n,
                                            float s) {
    const float inv = 1.0f / s;
    for (int i = 0; i < n; i++) codes[i] = ds_f32_to_e4m3(x[i] * inv);
    memcpy(scale, &s, 4);
}

/* row [ds_kv_fp8_row_bytes(R, dr)] <- the stored form of x [R + dr] (padding zeroed). */
static inline DS_HD void ds_kv_fp8_quant_row(uint8_t *row, const float *x, int R, int dr) {
    const int nt = ds_kv_fp8_tiles(R), ra = ds_kv_fp8_rope_at(R);
    for (int j = 0; j < nt; j++) {
        const int a = j * DS_KV_FP8_TILE, n = R - a < DS_KV_FP8_TILE ? R - a : DS_KV_FP8_TILE;
        ds_kv_fp8_put_tile(row + a, row + R + 4 * (size_t)j, x + a, n,
                           ds_kv_fp8_tile_scale(x + a, n));
    }
    for (int i = 0; i < dr; i++) {
        const uint16_t h = ds_kv_bf16(x[R + i]);
        memcpy(row + ra + 2 * (size_t)i, &h, 2);
    }
    for (size_t b = (size_t)ra + 2 * (size_t)dr; b < ds_kv_fp8_row_bytes(R, dr); b++) row[b] = 0;
}

/* x [R + dr] <- the values a stored row reads back as. */
static inline DS_HD void ds_kv_fp8_dequant_row(float *x, const uint8_t *row, int R, int dr) {
    for (int i = 0; i < R + dr; i++) x[i] = ds_kv_fp8_value(row, R, i);
}

#endif
