/* matmul_quant.h — ds_matmul of quantized weights (FP8 E4M3 ptpc, MXFP4), inside kernels/cpu:
 * ds_matmul hands such matrices here. Also the pieces the quantized kernels share with matmul.c
 * (its f32 tile, which runs over their widened panels) and the per-ISA operation tables that
 * matmul_quant_simd.c fills. */
#ifndef DS_MATMUL_QUANT_H
#define DS_MATMUL_QUANT_H

#include "kernels/cpu/kernels.h"

/* y = x W^T for w->dtype DS_DT_F8_E4M3 or DS_DT_MXFP4, as kernels.h defines the product. */
void ds_matmul_quant(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w);

/* Tests: nonzero makes the FP8 products take the path they take when the scratch for the
 * quantized activations cannot be allocated (converting on the fly); same bits, slowly. */
void ds_matmul_quant_force_fallback(int on);

enum {
    DS_QMR = 4, /* rows per tile (matmul.c's MR) */
    DS_QNT = 3, /* tokens per tile (matmul.c's NT) */
    DS_QLANES_MAX = 16,
};
/* The FP8 kernels multiply scaled values (both scalings exact, see ds_fp8_w_bits): an activation's
 * E4M3 value times 2^112 by a weight's E4M3 value times 2^-120, so every product, every partial sum
 * and the sum come out times 2^-8, exactly; the caller multiplies the sum by 2^8 back. */
#define DS_FP8_XSCALE   0x1p112f
#define DS_FP8_SUMSCALE 256.0f

/* matmul.c's micro-kernel over f32 weights (its contract is documented there): rows i < mr at
 * w + i*ldw floats, tokens j < nt at x + j*ldx, columns [0, kc); part/first/y as in matmul.c. */
typedef void (*ds_mm_tile_fn)(const void *w, size_t ldw, const float *x, size_t ldx, int kc,
                              float *part, size_t ldp, int first, float *y, size_t ldy);
ds_mm_tile_fn ds_matmul_f32_tile(ds_isa isa, int mr, int nt);

/* A tile straight from the packed weights, with the same order of additions as the f32 tile over
 * the widened rows (lane l of the isa's V sums columns c = l (mod V) in increasing c, the same
 * horizontal tree). w: row i's bytes for column 0 of the range at w + i*ldw; ws: MXFP4 only, row
 * i's E8M0 scale for the range's first group at ws + i*ldws. x: FP8: DS_FP8_XSCALE times the E4M3
 * values of the activations as act_stream orders them (the range starts at a multiple of 16);
 * MXFP4: the f32 activations. kc: FP8 any, MXFP4 a multiple of 32. y
 * receives the bare sums (the FP8 scales are applied by the caller). */
typedef void (*ds_qtile_fn)(const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws,
                            const float *x, size_t ldx, int kc, float *part, size_t ldp, int first,
                            float *y, size_t ldy);
/* Widens rows i < nr, columns [0, kc) into panel[i][0..] (row stride ldp floats), zeros up to the
 * next multiple of the lane count. FP8 codes become their E4M3 value / DS_FP8_XSCALE (exact). */
typedef void (*ds_qpanel_fn)(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                             const uint8_t *ws, size_t ldws, int nr, int kc);
/* max |x[c]| for c < n (NaNs ignored, as fmaxf does). */
typedef float (*ds_qamax_fn)(const float *x, int n);
/* xq[c] = DS_FP8_XSCALE * e4m3(x[c] * inv) as a value, for c < n (act: in place; act_stream: in
 * the order the isa's FP8 tiles read, a permutation within each whole block of 16 columns, so
 * that a tile can widen 16 codes into two vectors without moving them across lanes). */
typedef void (*ds_qact_fn)(float *xq, const float *x, int n, float inv);

typedef struct ds_qops {
    int lanes;
    ds_qtile_fn fp8[DS_QMR][DS_QNT]; /* [mr-1][nt-1] */
    ds_qtile_fn mx[DS_QMR][DS_QNT];
    ds_qpanel_fn panel_fp8, panel_mx;
    ds_qamax_fn amax;
    ds_qact_fn act;        /* for the panels of the blocked path (matmul.c's f32 tiles) */
    ds_qact_fn act_stream; /* for the fp8 tiles */
} ds_qops;

extern const ds_qops ds_qops_avx2, ds_qops_avx512; /* matmul_quant_simd.c */

/* A weight code's E4M3 value times 2^-120 as f32 bits, as every CPU path reads it: the code's
 * sign to bit 31 and its exponent and mantissa to bits 20..26 make an f32 whose exponent field is
 * the E4M3 one (bias 127 against 7: the factor 2^-120), its subnormals f32 subnormals (exact). It
 * is exact for every code but the NaNs 0x7f / 0xff, which come only from a NaN weight and read as
 * +-480. (The f32 subnormals need the default MXCSR: no flush-to-zero / denormals-are-zero.) */
static inline uint32_t ds_fp8_w_bits(uint8_t b) {
    return ((uint32_t)(int32_t)(int8_t)b << 20) & 0x87F00000u;
}

#endif
