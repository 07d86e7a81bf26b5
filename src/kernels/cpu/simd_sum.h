/* simd_sum.h — inside kernels/cpu: the target attributes of the AVX2 and AVX-512 paths, their lane
 * masks, and the one fixed tree in which a product's lane accumulators are summed. matmul.c's
 * tiles and the quantized tiles of matmul_quant_simd.c both finish their sums here, which is what
 * makes a token's result the same bits whether its weights were converted in registers or widened
 * into an f32 panel first (and the portable path's hsum8_scalar mirrors the AVX2 tree). */
#ifndef DS_SIMD_SUM_H
#define DS_SIMD_SUM_H

#include <immintrin.h>

#define AVX2_FN     __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))
#define AVX512_FN   __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define AVX512_INLINE                                                                              \
    static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx2,fma,"       \
                                                       "f16c")))

/* Lanes l < n set. */
AVX2_INLINE __m256i avx2_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Fixed tree: (l, l+4), then (l, l+2), then (0, 1). */
AVX2_INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lanes l < n set (n <= 16). */
AVX512_INLINE __mmask16 avx512_mask(int n) {
    return (__mmask16)((1u << n) - 1u);
}

/* Fixed tree: (l, l+8), then the AVX2 tree. */
AVX512_INLINE float avx512_hsum(__m512 v) {
    const __m256 lo = _mm512_castps512_ps256(v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return avx2_hsum(_mm256_add_ps(lo, hi));
}

#endif
