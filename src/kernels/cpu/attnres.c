/* attnres.c — the AttnRes mix (docs/model.md §6.2), all in f32:
 *
 *   score_j = sum_d (V_j[d] / sqrt(mean(V_j^2) + eps)) * np[d] = rms_j * (V_j . np)
 *   alpha   = softmax_j(score)            (no temperature)
 *   out     = sum_j alpha_j V_j
 *
 * np = norm weight ⊙ projection weight, folded at load. With one candidate the mix is the identity
 * and returns it bit for bit. Per token: one pass over each candidate for (V.V, V.np), then one
 * accumulation pass; tokens are independent and split between threads for prefill. */
#include "kernels/cpu/kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#define AVX2_FN   __attribute__((target("avx2,fma,f16c")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

/* Candidates scored on the stack; more than this (K3 has at most 9) take the heap. */
#define MIX_STACK_CANDS 32

/* ss = V.V, dp = V.np over n elements. */
static void stats_scalar(const float *v, const float *np, int n, float *ss, float *dp) {
    float a = 0.0f, b = 0.0f;
    for (int i = 0; i < n; i++) {
        a += v[i] * v[i];
        b += v[i] * np[i];
    }
    *ss = a;
    *dp = b;
}

/* out = a v (first) or out += a v. */
static void mix_scalar(float *out, float a, const float *v, int n, int first) {
    for (int i = 0; i < n; i++) out[i] = first ? a * v[i] : out[i] + a * v[i];
}

static AVX2_FN float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static AVX2_FN __m256i mask_avx2(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static AVX2_FN void stats_avx2(const float *v, const float *np, int n, float *ss, float *dp) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(v + i), v1 = _mm256_loadu_ps(v + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        b0 = _mm256_fmadd_ps(v0, _mm256_loadu_ps(np + i), b0);
        b1 = _mm256_fmadd_ps(v1, _mm256_loadu_ps(np + i + 8), b1);
    }
    for (; i < n; i += 8) {
        const __m256i m = mask_avx2(n - i); /* all lanes while a full vector remains */
        const __m256 x = _mm256_maskload_ps(v + i, m);
        a0 = _mm256_fmadd_ps(x, x, a0);
        b0 = _mm256_fmadd_ps(x, _mm256_maskload_ps(np + i, m), b0);
    }
    *ss = hsum_avx2(_mm256_add_ps(a0, a1));
    *dp = hsum_avx2(_mm256_add_ps(b0, b1));
}

static AVX2_FN void mix_avx2(float *out, float a, const float *v, int n, int first) {
    const __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        _mm256_storeu_ps(out + i, first ? _mm256_mul_ps(av, x)
                                        : _mm256_fmadd_ps(av, x, _mm256_loadu_ps(out + i)));
    }
    if (i < n) {
        const __m256i m = mask_avx2(n - i);
        const __m256 x = _mm256_maskload_ps(v + i, m);
        _mm256_maskstore_ps(out + i, m,
                            first ? _mm256_mul_ps(av, x)
                                  : _mm256_fmadd_ps(av, x, _mm256_maskload_ps(out + i, m)));
    }
}

static AVX512_FN void stats_avx512(const float *v, const float *np, int n, float *ss, float *dp) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512 v0 = _mm512_loadu_ps(v + i), v1 = _mm512_loadu_ps(v + i + 16);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
        b0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(np + i), b0);
        b1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(np + i + 16), b1);
    }
    for (; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
        a0 = _mm512_fmadd_ps(x, x, a0);
        b0 = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, np + i), b0);
    }
    *ss = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    *dp = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}

static AVX512_FN void mix_avx512(float *out, float a, const float *v, int n, int first) {
    const __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(m, v + i);
        _mm512_mask_storeu_ps(out + i, m,
                              first ? _mm512_mul_ps(av, x)
                                    : _mm512_fmadd_ps(av, x, _mm512_maskz_loadu_ps(m, out + i)));
    }
}

void ds_attnres_mix(float *out, const float *const *cands, int m, const float *np, int T, int D,
                    float eps) {
    if (m <= 0) { /* nothing to mix: a defined (zero) result rather than garbage */
        memset(out, 0, (size_t)T * (size_t)D * sizeof *out);
        return;
    }
    if (m == 1) {
        memcpy(out, cands[0], (size_t)T * (size_t)D * sizeof *out);
        return;
    }
    const ds_isa isa = ds_kernels_isa();
    void (*stats)(const float *, const float *, int, float *, float *) =
        isa == DS_ISA_AVX512 ? stats_avx512
        : isa == DS_ISA_AVX2 ? stats_avx2
                             : stats_scalar;
    void (*mix)(float *, float, const float *, int, int) = isa == DS_ISA_AVX512 ? mix_avx512
                                                           : isa == DS_ISA_AVX2 ? mix_avx2
                                                                                : mix_scalar;
    float *heap = NULL;
    if (m > MIX_STACK_CANDS) {
        heap = malloc((size_t)T * (size_t)m * sizeof(float));
        if (!heap) { /* out of memory: fall back to the last candidate (the running block sum) */
            memcpy(out, cands[m - 1], (size_t)T * (size_t)D * sizeof *out);
            return;
        }
    }
#pragma omp parallel for schedule(static) if (T > 1 && (double)T * D * m >= (1 << 17))
    for (int t = 0; t < T; t++) {
        float alpha_small[MIX_STACK_CANDS];
        float *alpha = heap ? heap + (size_t)t * (size_t)m : alpha_small; /* [m] */
        const size_t off = (size_t)t * (size_t)D;
        float mx = -INFINITY;
        for (int j = 0; j < m; j++) {
            float ss, dp;
            stats(cands[j] + off, np, D, &ss, &dp);
            alpha[j] = dp / sqrtf(ss / (float)D + eps);
            if (alpha[j] > mx) mx = alpha[j];
        }
        float sum = 0.0f;
        for (int j = 0; j < m; j++) {
            alpha[j] = expf(alpha[j] - mx);
            sum += alpha[j];
        }
        for (int j = 0; j < m; j++) mix(out + off, alpha[j] / sum, cands[j] + off, D, j == 0);
    }
    free(heap);
}
