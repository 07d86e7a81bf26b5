/* matmul_quant_simd.c — the AVX2 and AVX-512 halves of the quantized products (matmul_quant.c
 * drives them): tiles that convert the packed weights in registers, the widening of a block into
 * an f32 panel, and the activations' FP8 quantization.
 *
 * Every tile sums in matmul.c's order (lane l of V accumulates columns c = l (mod V) in increasing
 * c with one fused multiply-add each, then matmul.c's horizontal tree), so a token's result is the
 * same bits whether its weights were converted here or widened into a panel first.
 *
 * Conversions, all exact:
 *  - FP8 E4M3 -> f32 by moving bits (ds_fp8_w_bits: sign-extend, shift by 20, mask), which is the
 *    value times 2^-120; the activations carry 2^112 (DS_FP8_XSCALE), so each sum is the true one
 *    times 2^-8 exactly (matmul_quant.h). The AVX2 tile makes the same bits 16 codes at a time
 *    without shifts (avx2_fp8_16), in an order within the block that the activations follow.
 *  - MXFP4: AVX-512 looks each nibble up in a 16-entry table already multiplied by the group's
 *    E8M0 scale (vpermps with 16 lanes). AVX2's vpermps has 8 entries: the magnitude (bits 0..2) is
 *    looked up in an 8-entry scaled table and the sign (bit 3) XORed in; each lane's nibble comes
 *    from a broadcast dword and a variable shift, so it sits at bits 0..3 and (shifted left by 28)
 *    the sign lands on bit 31 — with bits 28..30 of the table entries pre-XORed by the magnitude,
 *    one XOR places the sign and undoes them. */
#include "kernels/cpu/matmul_quant.h"
#include "kernels/cpu/simd_sum.h"

#include "kernels/shared/quant.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* The FP4 E2M1 magnitudes, then the signed values (code order). */
static const float k_fp4_mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
static const float k_fp4_val[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* The E8M0 scales as f32 bits (ds_e8m0_to_f32), so that a group's scale is one broadcast load. */
#define E8(b)    ((b) ? (uint32_t)(b) << 23 : 0x00400000u)
#define E8x4(b)  E8(b), E8((b) + 1), E8((b) + 2), E8((b) + 3)
#define E8x16(b) E8x4(b), E8x4((b) + 4), E8x4((b) + 8), E8x4((b) + 12)
#define E8x64(b) E8x16(b), E8x16((b) + 16), E8x16((b) + 32), E8x16((b) + 48)
static const uint32_t k_e8m0_bits[256] = {E8x64(0), E8x64(64), E8x64(128), E8x64(192)};

/* ---- AVX2 + FMA + F16C ----------------------------------------------------------------------- */
/* (target attributes, avx2_mask and matmul.c's summing tree: simd_sum.h) */

/* 8 FP8 codes -> their values times 2^-120 (ds_fp8_w_bits). */
AVX2_INLINE __m256 avx2_fp8_8(const uint8_t *p) {
    const __m256i d = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_slli_epi32(d, 20), _mm256_set1_epi32((int)0x87F00000u)));
}

/* 16 FP8 codes -> their values times 2^-120 (ds_fp8_w_bits), codes 0,2,4,6,1,3,5,7 in w0 and the
 * same plus 8 in w1 (AVX2_FP8_POS, the order the streaming activations follow: act_stream_avx2).
 * The 16 bytes go to both 128-bit lanes; vpmaddubsw multiplies the unsigned constant bytes by the
 * signed codes and adds pairs, so with (16, 0) the low lane's words are 16 * sext(even code) and
 * with (0, 16) the high lane's 16 * sext(odd code) (within -2048..2032: no saturation): bits 15..11
 * the sign, 10..4 exponent and mantissa. The AND leaves the high half of ds_fp8_w_bits and
 * unpacking under zeros makes the f32. No shift: 4 ops for 16 codes where widening each byte to a
 * dword first takes 6 (vpmovsxbd, vpslld, vpand on two vectors), and the shifts compete with the
 * FMAs' port neighbours on AVX2 machines that split 256-bit ops. */
AVX2_INLINE void avx2_fp8_16(const uint8_t *p, __m256 *w0, __m256 *w1) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i k = _mm256_setr_epi8(16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 0,
                                       16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16);
    const __m256i h =
        _mm256_and_si256(_mm256_maddubs_epi16(k, v), _mm256_set1_epi16((short)0x87F0));
    const __m256i z = _mm256_setzero_si256();
    *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
    *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
}

/* The same 16 codes as four 128-bit vectors, the low and high halves of avx2_fp8_16's: e0 codes
 * 0,2,4,6, o0 1,3,5,7, e1 and o1 the same plus 8. The even codes go through vpmaddubsw as there;
 * an odd code is the high byte of its 16-bit word, so one arithmetic shift right by 4 gives
 * 16 * sext(code) plus the even code's top nibble in bits 0..3, which the AND clears. Half the
 * work on the multiplier, half on the shifter: faster than either alone where the FMAs leave
 * little room (one token). */
AVX2_INLINE void avx2_fp8_16x4(const uint8_t *p, __m128 *e0, __m128 *o0, __m128 *e1, __m128 *o1) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    const __m128i k = _mm_setr_epi8(16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0, 16, 0);
    const __m128i m = _mm_set1_epi16((short)0x87F0), z = _mm_setzero_si128();
    const __m128i e = _mm_and_si128(_mm_maddubs_epi16(k, v), m);
    const __m128i o = _mm_and_si128(_mm_srai_epi16(v, 4), m);
    *e0 = _mm_castsi128_ps(_mm_unpacklo_epi16(z, e));
    *o0 = _mm_castsi128_ps(_mm_unpacklo_epi16(z, o));
    *e1 = _mm_castsi128_ps(_mm_unpackhi_epi16(z, e));
    *o1 = _mm_castsi128_ps(_mm_unpackhi_epi16(z, o));
}

/* Position p of avx2_fp8_16's vectors (and of the FP8 tile's accumulators) holds lane
 * AVX2_FP8_POS[p]; AVX2_FP8_LANE[l] is where lane l sits. */
#define AVX2_FP8_POS  _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)
#define AVX2_FP8_LANE _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)

/* The first n (< 8) codes, zeros after, reading nothing past code n-1. */
AVX2_INLINE __m256 avx2_fp8_tail(const uint8_t *p, int n) {
    uint8_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n);
    return avx2_fp8_8(tmp);
}

/* The 8-entry table of one MXFP4 group: magnitude m times the scale, bits 28..30 XORed by m. */
AVX2_INLINE __m256 avx2_mx_table(uint8_t scale) {
    const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(k_fp4_mag),
                                   _mm256_castsi256_ps(_mm256_set1_epi32((int)k_e8m0_bits[scale])));
    const __m256i m28 =
        _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
    return _mm256_xor_ps(t, _mm256_castsi256_ps(m28));
}

/* Elements 8v .. 8v+7 of a group (4 bytes at p) through the table. */
AVX2_INLINE __m256 avx2_mx_8(const uint8_t *p, __m256 table) {
    int32_t d;
    memcpy(&d, p, 4);
    const __m256i idx =
        _mm256_srlv_epi32(_mm256_set1_epi32(d), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256 v = _mm256_permutevar8x32_ps(table, idx);
    return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

/* Finish or park the accumulators of a tile (matmul.c's layout of part). */
#define TILE_FINISH(V_, HSUM, STORE)                                                               \
    for (int i = 0; i < mr; i++)                                                                   \
        for (int j = 0; j < nt; j++) {                                                             \
            if (y)                                                                                 \
                y[(size_t)j * ldy + (size_t)i] = HSUM(acc[i][j]);                                  \
            else                                                                                   \
                STORE(part + (size_t)j * ldp + (size_t)i * V_, acc[i][j]);                         \
        }

/* The whole 16-column blocks of one token's tile (avx2_tile_fp8's loop, the same sums in the same
 * order) through avx2_fp8_16x4, each accumulator as its two 128-bit halves; for short rows it
 * prefetches the rows DS_QMR further on (the streaming driver's next tile; a prefetch past the
 * matrix cannot fault).
 * Returns the columns done. */
#define AVX2_FP8_PREFETCH_ROW 4096 /* bytes: the longest row whose next group is prefetched */
AVX2_INLINE int avx2_fp8_blocks_t1(const int mr, const uint8_t *w, size_t ldw, const float *x,
                                   int kc, __m256 acc[DS_QMR][DS_QNT]) {
    __m128 ae[DS_QMR], ao[DS_QMR]; /* lanes 0,2,4,6 and 1,3,5,7 of row i */
    for (int i = 0; i < mr; i++) {
        ae[i] = _mm256_castps256_ps128(acc[i][0]);
        ao[i] = _mm256_extractf128_ps(acc[i][0], 1);
    }
    int c = 0;
    for (; c + 16 <= kc; c += 16) {
        const __m128 x0 = _mm_loadu_ps(x + c), x1 = _mm_loadu_ps(x + c + 4);
        const __m128 x2 = _mm_loadu_ps(x + c + 8), x3 = _mm_loadu_ps(x + c + 12);
        for (int i = 0; i < mr; i++) {
            __m128 e0, o0, e1, o1;
            /* the same columns of the next row group: a short row of codes (K bytes) leaves the
             * hardware's stream prefetch warming up for much of it; long rows it serves better
             * alone (the lines fetched a whole group ahead would be evicted before use) */
            if (ldw <= AVX2_FP8_PREFETCH_ROW)
                _mm_prefetch((const char *)((uintptr_t)w + (size_t)(i + DS_QMR) * ldw + (size_t)c),
                             _MM_HINT_T0);
            avx2_fp8_16x4(w + (size_t)i * ldw + (size_t)c, &e0, &o0, &e1, &o1);
            ae[i] = _mm_fmadd_ps(x0, e0, ae[i]);
            ao[i] = _mm_fmadd_ps(x1, o0, ao[i]);
            ae[i] = _mm_fmadd_ps(x2, e1, ae[i]);
            ao[i] = _mm_fmadd_ps(x3, o1, ao[i]);
        }
    }
    for (int i = 0; i < mr; i++) acc[i][0] = _mm256_set_m128(ao[i], ae[i]);
    return c;
}

AVX2_INLINE void avx2_tile_fp8(const int mr, const int nt, const uint8_t *w, size_t ldw,
                               const float *x, size_t ldx, int kc, float *part, size_t ldp,
                               int first, float *y, size_t ldy) {
    /* [row][token]: lane l sums columns c = l (mod 8); over whole 16-column blocks lane l sits at
     * position AVX2_FP8_LANE[l] (the order of avx2_fp8_16 and of x there), after them in place */
    __m256 acc[DS_QMR][DS_QNT];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            acc[i][j] =
                first ? _mm256_setzero_ps()
                      : _mm256_permutevar8x32_ps(
                            _mm256_loadu_ps(part + (size_t)j * ldp + (size_t)i * 8), AVX2_FP8_POS);
    int c = 0;
    if (nt == 1) /* 128-bit halves: (low, high) of acc[i][0] in (ae[i], ao[i]) */
        c = avx2_fp8_blocks_t1(mr, w, ldw, x, kc, acc);
    for (; c + 16 <= kc; c += 16)
        for (int i = 0; i < mr; i++) {
            __m256 w0, w1;
            avx2_fp8_16(w + (size_t)i * ldw + (size_t)c, &w0, &w1);
            for (int j = 0; j < nt; j++) {
                const float *xj = x + (size_t)j * ldx + (size_t)c;
                acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xj), w0, acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(xj + 8), w1, acc[i][j]);
            }
        }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm256_permutevar8x32_ps(acc[i][j], AVX2_FP8_LANE);
    for (; c < kc; c += 8) {
        const int n = DS_MIN(8, kc - c);
        const __m256i m = avx2_mask(n);
        for (int i = 0; i < mr; i++) {
            const uint8_t *wi = w + (size_t)i * ldw + (size_t)c;
            const __m256 wv = n == 8 ? avx2_fp8_8(wi) : avx2_fp8_tail(wi, n);
            for (int j = 0; j < nt; j++)
                acc[i][j] = _mm256_fmadd_ps(_mm256_maskload_ps(x + (size_t)j * ldx + (size_t)c, m),
                                            wv, acc[i][j]);
        }
    }
    TILE_FINISH(8, avx2_hsum, _mm256_storeu_ps)
}

AVX2_INLINE void avx2_tile_mx(const int mr, const int nt, const uint8_t *w, size_t ldw,
                              const uint8_t *ws, size_t ldws, const float *x, size_t ldx, int kc,
                              float *part, size_t ldp, int first, float *y, size_t ldy) {
    __m256 acc[DS_QMR][DS_QNT];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            acc[i][j] = first ? _mm256_setzero_ps()
                              : _mm256_loadu_ps(part + (size_t)j * ldp + (size_t)i * 8);
    for (int g = 0; g < kc / DS_MXFP4_GROUP; g++)
        for (int i = 0; i < mr; i++) {
            const __m256 table = avx2_mx_table(ws[(size_t)i * ldws + (size_t)g]);
            const uint8_t *wi = w + (size_t)i * ldw + (size_t)g * 16;
            for (int v = 0; v < 4; v++) {
                const __m256 wv = avx2_mx_8(wi + 4 * v, table);
                for (int j = 0; j < nt; j++)
                    acc[i][j] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(x + (size_t)j * ldx + (size_t)(g * 32 + 8 * v)), wv,
                        acc[i][j]);
            }
        }
    TILE_FINISH(8, avx2_hsum, _mm256_storeu_ps)
}

static AVX2_FN void panel_fp8_avx2(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                                   const uint8_t *ws, size_t ldws, int nr, int kc) {
    (void)ws;
    (void)ldws;
    for (int i = 0; i < nr; i++) {
        const uint8_t *row = w + (size_t)i * ldw;
        float *dst = panel + (size_t)i * ldp;
        int c = 0;
        for (; c + 16 <= kc; c += 16) {
            _mm256_storeu_ps(dst + c, avx2_fp8_8(row + c));
            _mm256_storeu_ps(dst + c + 8, avx2_fp8_8(row + c + 8));
        }
        for (; c < kc; c += 8)
            _mm256_storeu_ps(dst + c,
                             kc - c >= 8 ? avx2_fp8_8(row + c) : avx2_fp8_tail(row + c, kc - c));
    }
}

static AVX2_FN void panel_mx_avx2(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                                  const uint8_t *ws, size_t ldws, int nr, int kc) {
    for (int i = 0; i < nr; i++)
        for (int g = 0; g < kc / DS_MXFP4_GROUP; g++) {
            const __m256 table = avx2_mx_table(ws[(size_t)i * ldws + (size_t)g]);
            const uint8_t *src = w + (size_t)i * ldw + (size_t)g * 16;
            float *dst = panel + (size_t)i * ldp + (size_t)g * 32;
            for (int v = 0; v < 4; v++)
                _mm256_storeu_ps(dst + 8 * v, avx2_mx_8(src + 4 * v, table));
        }
}

static AVX2_FN float amax_avx2(const float *x, int n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    int c = 0;
    /* max_ps returns its second operand when either is NaN: the running max, as fmaxf would */
    for (; c + 8 <= n; c += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + c), abs), m);
    float lanes[8], r = 0.0f;
    _mm256_storeu_ps(lanes, m);
    for (int l = 0; l < 8; l++) r = fmaxf(r, lanes[l]);
    for (; c < n; c++) r = fmaxf(r, fabsf(x[c]));
    return r;
}

/* DS_FP8_XSCALE * e4m3(v) for 8 values v = x * inv, with ds_f32_to_e4m3's rounding (nearest, ties
 * to even; the 2^-9 grid below 2^-6; saturation at 448; NaN stays NaN). */
AVX2_INLINE __m256 avx2_e4m3_round(__m256 v) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    const __m256 a = _mm256_andnot_ps(sign, v);
    const __m256 sub = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)),
                                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                     _mm256_set1_ps(1.0f / 512.0f));
    __m256i u = _mm256_castps_si256(a);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff), lsb));
    u = _mm256_and_si256(u, _mm256_set1_epi32((int)0xfff00000u));
    __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(u), sub,
                                _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ));
    r = _mm256_min_ps(r, _mm256_set1_ps(DS_FP8_MAX));
    r = _mm256_blendv_ps(r, a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)); /* NaN */
    return _mm256_or_ps(_mm256_mul_ps(r, _mm256_set1_ps(DS_FP8_XSCALE)), _mm256_and_ps(v, sign));
}

static AVX2_FN void act_avx2(float *xq, const float *x, int n, float inv) {
    const __m256 vi = _mm256_set1_ps(inv);
    int c = 0;
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(xq + c, avx2_e4m3_round(_mm256_mul_ps(_mm256_loadu_ps(x + c), vi)));
    if (c < n) {
        const __m256i m = avx2_mask(n - c);
        _mm256_maskstore_ps(xq + c, m,
                            avx2_e4m3_round(_mm256_mul_ps(_mm256_maskload_ps(x + c, m), vi)));
    }
}

/* act_avx2 in the order the AVX2 FP8 tile reads (matmul_quant.h, ds_qact_fn): each whole block of
 * 16 columns as 0,2,4,6,1,3,5,7, 8,10,12,14,9,11,13,15 (AVX2_FP8_POS), the last n % 16 in place.
 * The tile's K chunks start at multiples of 16, so the blocks are the same in every chunk. */
static AVX2_FN void act_stream_avx2(float *xq, const float *x, int n, float inv) {
    const __m256 vi = _mm256_set1_ps(inv);
    int c = 0;
    for (; c + 16 <= n; c += 16) {
        const __m256 a = avx2_e4m3_round(_mm256_mul_ps(_mm256_loadu_ps(x + c), vi));
        const __m256 b = avx2_e4m3_round(_mm256_mul_ps(_mm256_loadu_ps(x + c + 8), vi));
        _mm256_storeu_ps(xq + c, _mm256_permutevar8x32_ps(a, AVX2_FP8_POS));
        _mm256_storeu_ps(xq + c + 8, _mm256_permutevar8x32_ps(b, AVX2_FP8_POS));
    }
    if (c < n) act_avx2(xq + c, x + c, n - c, inv);
}

#define AVX2_QTILES(MR_, NT_)                                                                      \
    static AVX2_FN void tile_fp8_avx2_##MR_##_##NT_(                                               \
        const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws, const float *x, size_t ldx,  \
        int kc, float *part, size_t ldp, int first, float *y, size_t ldy) {                        \
        (void)ws;                                                                                  \
        (void)ldws;                                                                                \
        avx2_tile_fp8(MR_, NT_, w, ldw, x, ldx, kc, part, ldp, first, y, ldy);                     \
    }                                                                                              \
    static AVX2_FN void tile_mx_avx2_##MR_##_##NT_(                                                \
        const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws, const float *x, size_t ldx,  \
        int kc, float *part, size_t ldp, int first, float *y, size_t ldy) {                        \
        avx2_tile_mx(MR_, NT_, w, ldw, ws, ldws, x, ldx, kc, part, ldp, first, y, ldy);            \
    }

/* ---- AVX-512 (F, BW, VL) --------------------------------------------------------------------- */
/* The first n (<= 16) FP8 codes -> values times 2^-120, zeros after; masked bytes are not read. */
AVX512_INLINE __m512 avx512_fp8_16(const uint8_t *p, int n) {
    const __mmask16 m = avx512_mask(n);
    const __m512i d = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p));
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_slli_epi32(d, 20), _mm512_set1_epi32((int)0x87F00000u)));
}

/* One MXFP4 group (16 bytes at p) through the 16-entry scaled table: elements 0..15, 16..31. */
AVX512_INLINE void avx512_mx_32(const uint8_t *p, __m512 table, __m512 *w0, __m512 *w1) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), f = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(v, f), hi = _mm_and_si128(_mm_srli_epi16(v, 4), f);
    *w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table);
    *w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table);
}

AVX512_INLINE __m512 avx512_mx_table(uint8_t scale) {
    return _mm512_mul_ps(_mm512_loadu_ps(k_fp4_val),
                         _mm512_castsi512_ps(_mm512_set1_epi32((int)k_e8m0_bits[scale])));
}

AVX512_INLINE void avx512_tile_fp8(const int mr, const int nt, const uint8_t *w, size_t ldw,
                                   const float *x, size_t ldx, int kc, float *part, size_t ldp,
                                   int first, float *y, size_t ldy) {
    __m512 acc[DS_QMR][DS_QNT]; /* [row][token], lane l sums columns c = l (mod 16) */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            acc[i][j] = first ? _mm512_setzero_ps()
                              : _mm512_loadu_ps(part + (size_t)j * ldp + (size_t)i * 16);
    for (int c = 0; c < kc; c += 16) {
        const int n = DS_MIN(16, kc - c);
        const __mmask16 m = (__mmask16)((1u << n) - 1u);
        for (int i = 0; i < mr; i++) {
            const __m512 wv = avx512_fp8_16(w + (size_t)i * ldw + (size_t)c, n);
            for (int j = 0; j < nt; j++)
                acc[i][j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + (size_t)j * ldx + c), wv,
                                            acc[i][j]);
        }
    }
    TILE_FINISH(16, avx512_hsum, _mm512_storeu_ps)
}

AVX512_INLINE void avx512_tile_mx(const int mr, const int nt, const uint8_t *w, size_t ldw,
                                  const uint8_t *ws, size_t ldws, const float *x, size_t ldx,
                                  int kc, float *part, size_t ldp, int first, float *y,
                                  size_t ldy) {
    __m512 acc[DS_QMR][DS_QNT];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            acc[i][j] = first ? _mm512_setzero_ps()
                              : _mm512_loadu_ps(part + (size_t)j * ldp + (size_t)i * 16);
    for (int g = 0; g < kc / DS_MXFP4_GROUP; g++)
        for (int i = 0; i < mr; i++) {
            __m512 w0, w1;
            avx512_mx_32(w + (size_t)i * ldw + (size_t)g * 16,
                         avx512_mx_table(ws[(size_t)i * ldws + (size_t)g]), &w0, &w1);
            for (int j = 0; j < nt; j++) {
                const float *xj = x + (size_t)j * ldx + (size_t)g * 32;
                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xj), w0, acc[i][j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_loadu_ps(xj + 16), w1, acc[i][j]);
            }
        }
    TILE_FINISH(16, avx512_hsum, _mm512_storeu_ps)
}

static AVX512_FN void panel_fp8_avx512(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                                       const uint8_t *ws, size_t ldws, int nr, int kc) {
    (void)ws;
    (void)ldws;
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < kc; c += 16)
            _mm512_storeu_ps(panel + (size_t)i * ldp + (size_t)c,
                             avx512_fp8_16(w + (size_t)i * ldw + (size_t)c, DS_MIN(16, kc - c)));
}

static AVX512_FN void panel_mx_avx512(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                                      const uint8_t *ws, size_t ldws, int nr, int kc) {
    for (int i = 0; i < nr; i++)
        for (int g = 0; g < kc / DS_MXFP4_GROUP; g++) {
            __m512 w0, w1;
            avx512_mx_32(w + (size_t)i * ldw + (size_t)g * 16,
                         avx512_mx_table(ws[(size_t)i * ldws + (size_t)g]), &w0, &w1);
            float *dst = panel + (size_t)i * ldp + (size_t)g * 32;
            _mm512_storeu_ps(dst, w0);
            _mm512_storeu_ps(dst + 16, w1);
        }
}

#define AVX512_QTILES(MR_, NT_)                                                                    \
    static AVX512_FN void tile_fp8_avx512_##MR_##_##NT_(                                           \
        const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws, const float *x, size_t ldx,  \
        int kc, float *part, size_t ldp, int first, float *y, size_t ldy) {                        \
        (void)ws;                                                                                  \
        (void)ldws;                                                                                \
        avx512_tile_fp8(MR_, NT_, w, ldw, x, ldx, kc, part, ldp, first, y, ldy);                   \
    }                                                                                              \
    static AVX512_FN void tile_mx_avx512_##MR_##_##NT_(                                            \
        const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws, const float *x, size_t ldx,  \
        int kc, float *part, size_t ldp, int first, float *y, size_t ldy) {                        \
        avx512_tile_mx(MR_, NT_, w, ldw, ws, ldws, x, ldx, kc, part, ldp, first, y, ldy);          \
    }

/* ---- the tables ------------------------------------------------------------------------------ */
#define QTILES_FOR_MR(GEN, MR_) GEN(MR_, 1) GEN(MR_, 2) GEN(MR_, 3)
#define ALL_QTILES(GEN)                                                                            \
    QTILES_FOR_MR(GEN, 1) QTILES_FOR_MR(GEN, 2) QTILES_FOR_MR(GEN, 3) QTILES_FOR_MR(GEN, 4)
ALL_QTILES(AVX2_QTILES)
ALL_QTILES(AVX512_QTILES)

#define QROW(K, P, MR_)                                                                            \
    { tile_##K##_##P##_##MR_##_1, tile_##K##_##P##_##MR_##_2, tile_##K##_##P##_##MR_##_3 }
#define QTABLE(K, P)                                                                               \
    { QROW(K, P, 1), QROW(K, P, 2), QROW(K, P, 3), QROW(K, P, 4) }

/* The AVX2 amax and activation rounding serve AVX-512 too: they are exact, so any width gives the
 * same values. The AVX-512 FP8 tile reads its activations in place. */
const ds_qops ds_qops_avx2 = {.lanes = 8,
                              .fp8 = QTABLE(fp8, avx2),
                              .mx = QTABLE(mx, avx2),
                              .panel_fp8 = panel_fp8_avx2,
                              .panel_mx = panel_mx_avx2,
                              .amax = amax_avx2,
                              .act = act_avx2,
                              .act_stream = act_stream_avx2};
const ds_qops ds_qops_avx512 = {.lanes = 16,
                                .fp8 = QTABLE(fp8, avx512),
                                .mx = QTABLE(mx, avx512),
                                .panel_fp8 = panel_fp8_avx512,
                                .panel_mx = panel_mx_avx512,
                                .amax = amax_avx2,
                                .act = act_avx2,
                                .act_stream = act_avx2};
