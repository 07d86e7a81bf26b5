/* quant.h — the element formats of quantized weights and caches (docs/quantization.md), one
 * definition for the CPU kernels, the CUDA kernels, the loader and the tests, so that every side
 * rounds the same value to the same code.
 *
 *  - FP8 E4M3 (OCP "e4m3fn", the H100/H200 tensor-core type): sign, 4 exponent bits (bias 7),
 *    3 mantissa bits; no infinities; 0x7f / 0xff are NaN; largest finite 448.
 *  - FP4 E2M1 (OCP MX): sign in bit 3, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
 *  - E8M0 (OCP MX scale): the byte b means 2^(b - 127); 255 is NaN (refused at load).
 *  - ptpc scale (per-token / per-channel FP8, vLLM's ptpc_fp8): a row's scale is
 *    max(amax / 448, 1 / (448 * 512)) and its codes are e4m3(x * (1 / scale)). */
#ifndef DS_QUANT_H
#define DS_QUANT_H

#include "kernels/shared/hd.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#define DS_FP8_MAX        448.0f
#define DS_MXFP4_GROUP    32 /* values that share one E8M0 scale */
#define DS_PTPC_MIN_SCALE (1.0f / (448.0f * 512.0f))

static inline DS_HD float ds_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}
static inline DS_HD uint32_t ds_f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

/* The value of an E4M3 code (exact in f32). */
static inline DS_HD float ds_e4m3_to_f32(uint8_t b) {
    uint32_t s = (uint32_t)(b >> 7) << 31, e = (b >> 3) & 15u, m = b & 7u;
    if (e == 15 && m == 7) return ds_bits_f32(s | 0x7fc00000u); /* NaN */
    if (e == 0) {                                               /* subnormal: m * 2^-9 */
        float v = (float)m * (1.0f / 512.0f);
        return ds_bits_f32(s | ds_f32_bits(v));
    }
    return ds_bits_f32(s | ((e + 120u) << 23) | (m << 20));
}

/* The E4M3 code nearest to x (ties to even), saturating to +-448; NaN -> 0x7f. */
static inline DS_HD uint8_t ds_f32_to_e4m3(float x) {
    uint32_t u = ds_f32_bits(x), s = (u >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) return 0x7f;
    if (a >= 464.0f) return (uint8_t)(s | 0x7e); /* 448 and everything that rounds past it */
    if (a < 0.015625f) {                   /* below 2^-6: subnormal grid of 2^-9, ties to even */
        float q = a * 512.0f;              /* exact */
        float r = rintf(q);                /* round half to even in the default mode */
        return (uint8_t)(s | (uint32_t)r); /* r == 8 is the smallest normal 0x08 */
    }
    uint32_t au = ds_f32_bits(a);
    /* keep 3 mantissa bits of 23: round to nearest even on the 20 dropped bits */
    uint32_t lsb = (au >> 20) & 1u;
    au += 0x7ffffu + lsb;
    uint32_t e = (au >> 23) - 120u, m = (au >> 20) & 7u;
    if (e > 15 || (e == 15 && m == 7)) return (uint8_t)(s | 0x7e);
    return (uint8_t)(s | (e << 3) | m);
}

/* The value of an FP4 E2M1 code (low 4 bits of c). */
static inline DS_HD float ds_fp4_to_f32(uint8_t c) {
    /* magnitudes times 2, so the table holds integers */
    const float mag2 = (float)((0x0c08060403020100ull >> (8 * (c & 7))) & 0xff);
    return (c & 8) ? -0.5f * mag2 : 0.5f * mag2;
}

/* 2^(b - 127) (b < 255; 0 gives 2^-127, an f32 subnormal). */
static inline DS_HD float ds_e8m0_to_f32(uint8_t b) {
    return b ? ds_bits_f32((uint32_t)b << 23) : ds_bits_f32(0x00400000u);
}

/* Element (r, c) of an MXFP4 matrix with `cols` columns: codes [rows][cols/2] (element 2i in the
 * low nibble), scales [rows][cols/32]. */
static inline DS_HD float ds_mxfp4_at(const uint8_t *codes, const uint8_t *scales, int cols, int r,
                                      int c) {
    uint8_t byte = codes[(size_t)r * (size_t)(cols / 2) + (size_t)(c / 2)];
    uint8_t code = (c & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 15);
    return ds_fp4_to_f32(code) *
           ds_e8m0_to_f32(
               scales[(size_t)r * (size_t)(cols / DS_MXFP4_GROUP) + (size_t)(c / DS_MXFP4_GROUP)]);
}

/* The ptpc scale of a row whose largest magnitude is amax. */
static inline DS_HD float ds_ptpc_scale(float amax) {
    float s = amax / DS_FP8_MAX;
    return s > DS_PTPC_MIN_SCALE ? s : DS_PTPC_MIN_SCALE;
}

#endif
