/* elementwise.c — norms, activations, vector updates and argmax on f32 activations.
 *
 * Every op has a portable version (libm for the transcendental functions) and AVX2 / AVX-512
 * versions built on the vector exp below; all are checked against float64 references on every
 * path. Reductions (sums of squares, argmax) run over one row at a time, so a row's result never
 * depends on how many other rows (tokens) are processed with it. Long arrays are split between
 * OpenMP threads; short ones (a decode step) stay on the calling thread, where a parallel region
 * would cost more than the work. */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/simd_sum.h" /* target macros, masks, the summing tree */

#include <immintrin.h>
#include <math.h>
#include <omp.h>

/* Fewer elements than this run on one thread. */
#define PAR_MIN_ELEMS (1 << 16)

/* ---- vector math ----------------------------------------------------------------------------- */
/* exp(x) = 2^n * e^r with n = round(x / ln2) and r = x - n ln2 in [-ln2/2, ln2/2]; ln2 is split in
 * a short head (exact times any n) and a tail so that r carries no rounding error; e^r is its
 * Taylor polynomial to degree 7 (truncation < 6e-9 relative on that interval, below f32
 * resolution). x is clamped to [EXP_LO, EXP_HI], which keeps 2^n a normal float: the result
 * saturates near FLT_MAX above and near FLT_MIN below, harmless for sigmoid, silu and tanh. The
 * clamps are written so that a NaN input stays NaN. */
#define EXP_HI 88.37f
#define EXP_LO -87.33f
#define LOG2E  1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
/* tanh(x) for |x| < TANH_SMALL: the odd Taylor series to x^11 (next term < 1e-10 relative);
 * above it, 1 - 2/(e^{2|x|} + 1), whose cancellation costs at most ~6 ulp at the switch. */
#define TANH_SMALL 0.25f
#define TANH_C3    (-1.0f / 3.0f)
#define TANH_C5    (2.0f / 15.0f)
#define TANH_C7    (-17.0f / 315.0f)
#define TANH_C9    (62.0f / 2835.0f)
#define TANH_C11   (-1382.0f / 155925.0f)

AVX2_INLINE __m256 avx2_exp(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), x); /* min/max return the 2nd operand on NaN */
    x = _mm256_max_ps(_mm256_set1_ps(EXP_LO), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AVX2_INLINE __m256 avx2_sigmoid(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, avx2_exp(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

AVX2_INLINE __m256 avx2_tanh(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 p = _mm256_set1_ps(TANH_C11);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_C9));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_C7));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_C5));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(TANH_C3));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = avx2_exp(_mm256_add_ps(a, a));
    const __m256 big =
        _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    const __m256 big_signed = _mm256_or_ps(big, _mm256_and_ps(sign, x));
    return _mm256_blendv_ps(big_signed, small,
                            _mm256_cmp_ps(a, _mm256_set1_ps(TANH_SMALL), _CMP_LT_OQ));
}

AVX512_INLINE __m512 avx512_exp(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), x);
    x = _mm512_max_ps(_mm512_set1_ps(EXP_LO), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

AVX512_INLINE __m512 avx512_sigmoid(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one,
                         _mm512_add_ps(one, avx512_exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

AVX512_INLINE __m512 avx512_tanh(__m512 x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(x)));
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 p = _mm512_set1_ps(TANH_C11);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_C9));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_C7));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_C5));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_C3));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = avx512_exp(_mm512_add_ps(a, a));
    const __m512 big =
        _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
    const __m512 big_signed = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(big), _mm512_and_si512(sign, _mm512_castps_si512(x))));
    const __mmask16 is_small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SMALL), _CMP_LT_OQ);
    return _mm512_mask_blend_ps(is_small, big_signed, small);
}

static float sigmoid_scalar(float x) {
    return 1.0f / (1.0f + expf(-x));
}

/* ---- sums of squares ------------------------------------------------------------------------- */
/* Four accumulators hide the add latency; they are combined in a fixed order. */

static float sumsq_scalar(const float *x, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}

AVX2_INLINE float avx2_sumsq(const float *x, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 v2 = _mm256_loadu_ps(x + i + 16), v3 = _mm256_loadu_ps(x + i + 24);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
        a2 = _mm256_fmadd_ps(v2, v2, a2);
        a3 = _mm256_fmadd_ps(v3, v3, a3);
    }
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        const __m256 v = _mm256_maskload_ps(x + i, avx2_mask(n - i));
        a1 = _mm256_fmadd_ps(v, v, a1);
    }
    return avx2_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

AVX512_INLINE float avx512_sumsq(const float *x, int n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        const __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        const __m512 v2 = _mm512_loadu_ps(x + i + 32), v3 = _mm512_loadu_ps(x + i + 48);
        a0 = _mm512_fmadd_ps(v0, v0, a0);
        a1 = _mm512_fmadd_ps(v1, v1, a1);
        a2 = _mm512_fmadd_ps(v2, v2, a2);
        a3 = _mm512_fmadd_ps(v3, v3, a3);
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(v, v, a0);
    }
    if (i < n) {
        const __m512 v = _mm512_maskz_loadu_ps(avx512_mask(n - i), x + i);
        a1 = _mm512_fmadd_ps(v, v, a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* ---- row scaling: y = x * s (* w) (* sigmoid(g)) --------------------------------------------- */
/* The one kernel behind the three norms; w and g may be NULL. */

static void scale_row_scalar(float *y, const float *x, float s, const float *w, const float *g,
                             int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i] * s;
        if (w) v *= w[i];
        if (g) v *= sigmoid_scalar(g[i]);
        y[i] = v;
    }
}

AVX2_INLINE __m256 avx2_scale8(__m256 x, __m256 s, const float *w, const float *g, size_t i,
                               __m256i m, int full) {
    __m256 v = _mm256_mul_ps(x, s);
    if (w) v = _mm256_mul_ps(v, full ? _mm256_loadu_ps(w + i) : _mm256_maskload_ps(w + i, m));
    if (g)
        v = _mm256_mul_ps(
            v, avx2_sigmoid(full ? _mm256_loadu_ps(g + i) : _mm256_maskload_ps(g + i, m)));
    return v;
}

static AVX2_FN void scale_row_avx2(float *y, const float *x, float s, const float *w,
                                   const float *g, int n) {
    const __m256 sv = _mm256_set1_ps(s);
    const __m256i all = _mm256_set1_epi32(-1);
    size_t i = 0;
    for (; i + 8 <= (size_t)n; i += 8)
        _mm256_storeu_ps(y + i, avx2_scale8(_mm256_loadu_ps(x + i), sv, w, g, i, all, 1));
    if (i < (size_t)n) {
        const __m256i m = avx2_mask((int)((size_t)n - i));
        _mm256_maskstore_ps(y + i, m, avx2_scale8(_mm256_maskload_ps(x + i, m), sv, w, g, i, m, 0));
    }
}

static AVX512_FN void scale_row_avx512(float *y, const float *x, float s, const float *w,
                                       const float *g, int n) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : avx512_mask(n - i);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), sv);
        if (w) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i));
        if (g) v = _mm512_mul_ps(v, avx512_sigmoid(_mm512_maskz_loadu_ps(m, g + i)));
        _mm512_mask_storeu_ps(y + i, m, v);
    }
}

static AVX2_FN float sumsq_avx2_fn(const float *x, int n) {
    return avx2_sumsq(x, n);
}
static AVX512_FN float sumsq_avx512_fn(const float *x, int n) {
    return avx512_sumsq(x, n);
}

static float sumsq(ds_isa isa, const float *x, int n) {
    return isa == DS_ISA_AVX512 ? sumsq_avx512_fn(x, n)
           : isa == DS_ISA_AVX2 ? sumsq_avx2_fn(x, n)
                                : sumsq_scalar(x, n);
}

static void scale_row(ds_isa isa, float *y, const float *x, float s, const float *w, const float *g,
                      int n) {
    if (isa == DS_ISA_AVX512)
        scale_row_avx512(y, x, s, w, g, n);
    else if (isa == DS_ISA_AVX2)
        scale_row_avx2(y, x, s, w, g, n);
    else
        scale_row_scalar(y, x, s, w, g, n);
}

/* ---- norms ----------------------------------------------------------------------------------- */

void ds_rmsnorm(float *y, const float *x, const float *w, int T, int D, float eps) {
    const ds_isa isa = ds_kernels_isa();
#pragma omp parallel for schedule(static) if (T > 1 && (double)T * D >= PAR_MIN_ELEMS)
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * (size_t)D;
        const float r = 1.0f / sqrtf(sumsq(isa, xt, D) / (float)D + eps);
        scale_row(isa, y + (size_t)t * (size_t)D, xt, r, w, NULL, D);
    }
}

void ds_l2norm_heads(float *x, int T, int H, int d, float eps, float scale) {
    const ds_isa isa = ds_kernels_isa();
    const int rows = T * H;
#pragma omp parallel for schedule(static) if (rows > 1 && (double)rows * d >= PAR_MIN_ELEMS)
    for (int i = 0; i < rows; i++) {
        float *xi = x + (size_t)i * (size_t)d;
        /* eps sits inside the root of the plain sum (not the mean): docs/model.md §10 trap 1. */
        const float s = scale / sqrtf(sumsq(isa, xi, d) + eps);
        scale_row(isa, xi, xi, s, NULL, NULL, d);
    }
}

void ds_gated_rmsnorm_heads(float *y, const float *o, const float *gate, const float *w, int T,
                            int H, int d, float eps) {
    const ds_isa isa = ds_kernels_isa();
    const int rows = T * H;
#pragma omp parallel for schedule(static) if (rows > 1 && (double)rows * d >= PAR_MIN_ELEMS)
    for (int i = 0; i < rows; i++) {
        const size_t off = (size_t)i * (size_t)d;
        const float r = 1.0f / sqrtf(sumsq(isa, o + off, d) / (float)d + eps);
        scale_row(isa, y + off, o + off, r, w, gate + off, d);
    }
}

/* ---- vector updates -------------------------------------------------------------------------- */
/* Plain loops: the compiler vectorises them for the baseline ISA, they are bound by memory, and
 * they give the same bits on every path. */

void ds_add(float *y, const float *x, size_t n) {
#pragma omp parallel for schedule(static) if (n >= 4 * PAR_MIN_ELEMS)
    for (size_t i = 0; i < n; i++) y[i] += x[i];
}

void ds_axpy(float *y, float a, const float *x, size_t n) {
#pragma omp parallel for schedule(static) if (n >= 4 * PAR_MIN_ELEMS)
    for (size_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* ---- activations ----------------------------------------------------------------------------- */
/* Each op is written once per ISA over a range [0, n); the public function splits long arrays into
 * per-thread ranges. Outputs may alias inputs (element i is read before it is written). */

typedef struct act_args {
    int op; /* ACT_* */
    float *out;
    const float *a, *b;
    float beta, lin_beta;
} act_args;
enum { ACT_SIGMOID, ACT_SWIGLU, ACT_SITU };

static void act_scalar(const act_args *p, size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; i++) {
        const float a = p->a[i];
        switch (p->op) {
        case ACT_SIGMOID:
            p->out[i] = sigmoid_scalar(a);
            break;
        case ACT_SWIGLU:
            p->out[i] = a * sigmoid_scalar(a) * p->b[i];
            break;
        default: {
            const float u = p->b[i];
            const float phi = p->lin_beta > 0.0f ? p->lin_beta * tanhf(u / p->lin_beta) : u;
            p->out[i] = p->beta * tanhf(a / p->beta) * sigmoid_scalar(a) * phi;
        }
        }
    }
}

AVX2_INLINE __m256 avx2_act(const act_args *p, __m256 a, __m256 b) {
    if (p->op == ACT_SIGMOID) return avx2_sigmoid(a);
    if (p->op == ACT_SWIGLU) return _mm256_mul_ps(_mm256_mul_ps(a, avx2_sigmoid(a)), b);
    const __m256 beta = _mm256_set1_ps(p->beta), lb = _mm256_set1_ps(p->lin_beta);
    const __m256 phi = p->lin_beta > 0.0f ? _mm256_mul_ps(lb, avx2_tanh(_mm256_div_ps(b, lb))) : b;
    const __m256 g =
        _mm256_mul_ps(_mm256_mul_ps(beta, avx2_tanh(_mm256_div_ps(a, beta))), avx2_sigmoid(a));
    return _mm256_mul_ps(g, phi);
}

static AVX2_FN void act_avx2(const act_args *p, size_t i0, size_t i1) {
    const int two = p->op != ACT_SIGMOID;
    size_t i = i0;
    for (; i + 8 <= i1; i += 8) {
        const __m256 b = two ? _mm256_loadu_ps(p->b + i) : _mm256_setzero_ps();
        _mm256_storeu_ps(p->out + i, avx2_act(p, _mm256_loadu_ps(p->a + i), b));
    }
    if (i < i1) {
        const __m256i m = avx2_mask((int)(i1 - i));
        const __m256 b = two ? _mm256_maskload_ps(p->b + i, m) : _mm256_setzero_ps();
        _mm256_maskstore_ps(p->out + i, m, avx2_act(p, _mm256_maskload_ps(p->a + i, m), b));
    }
}

AVX512_INLINE __m512 avx512_act(const act_args *p, __m512 a, __m512 b) {
    if (p->op == ACT_SIGMOID) return avx512_sigmoid(a);
    if (p->op == ACT_SWIGLU) return _mm512_mul_ps(_mm512_mul_ps(a, avx512_sigmoid(a)), b);
    const __m512 beta = _mm512_set1_ps(p->beta), lb = _mm512_set1_ps(p->lin_beta);
    const __m512 phi =
        p->lin_beta > 0.0f ? _mm512_mul_ps(lb, avx512_tanh(_mm512_div_ps(b, lb))) : b;
    const __m512 g =
        _mm512_mul_ps(_mm512_mul_ps(beta, avx512_tanh(_mm512_div_ps(a, beta))), avx512_sigmoid(a));
    return _mm512_mul_ps(g, phi);
}

static AVX512_FN void act_avx512(const act_args *p, size_t i0, size_t i1) {
    const int two = p->op != ACT_SIGMOID;
    for (size_t i = i0; i < i1; i += 16) {
        const __mmask16 m = i1 - i >= 16 ? (__mmask16)0xffff : avx512_mask((int)(i1 - i));
        const __m512 b = two ? _mm512_maskz_loadu_ps(m, p->b + i) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(p->out + i, m, avx512_act(p, _mm512_maskz_loadu_ps(m, p->a + i), b));
    }
}

static void act_run(const act_args *p, size_t n) {
    const ds_isa isa = ds_kernels_isa();
    void (*fn)(const act_args *, size_t, size_t) = isa == DS_ISA_AVX512 ? act_avx512
                                                   : isa == DS_ISA_AVX2 ? act_avx2
                                                                        : act_scalar;
    if (n < PAR_MIN_ELEMS / 4) { /* transcendental work: worth threads a little earlier */
        fn(p, 0, n);
        return;
    }
#pragma omp parallel
    {
        /* Contiguous ranges on 64-byte boundaries, so no two threads share a cache line. */
        const size_t nth = (size_t)omp_get_num_threads(), me = (size_t)omp_get_thread_num();
        const size_t per = ((n + nth - 1) / nth + 15) & ~(size_t)15;
        const size_t i0 = DS_MIN(n, me * per), i1 = DS_MIN(n, i0 + per);
        if (i0 < i1) fn(p, i0, i1);
    }
}

void ds_sigmoid_inplace(float *x, size_t n) {
    act_args p = {ACT_SIGMOID, x, x, NULL, 0.0f, 0.0f};
    act_run(&p, n);
}

void ds_act_swiglu(float *out, const float *gate, const float *up, size_t n) {
    act_args p = {ACT_SWIGLU, out, gate, up, 0.0f, 0.0f};
    act_run(&p, n);
}

void ds_act_situ(float *out, const float *gate, const float *up, size_t n, float beta,
                 float lin_beta) {
    act_args p = {ACT_SITU, out, gate, up, beta, lin_beta};
    act_run(&p, n);
}

/* ---- argmax ---------------------------------------------------------------------------------- */
/* The largest non-NaN value, lowest index among equals (-0 and +0 count as equal); 0 when n <= 0
 * or every value is NaN. Two passes on the SIMD paths: the maximum, then its first position. */

static float max_scalar(const float *x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

static AVX2_FN float max_avx2(const float *x, int n) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int i = 0;
    /* max(v, m) returns m when v is NaN, so NaNs never win. */
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    m0 = _mm256_max_ps(m0, m1);
    float lanes[8];
    _mm256_storeu_ps(lanes, m0);
    float m = max_scalar(lanes, 8);
    for (; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

static AVX512_FN float max_avx512(const float *x, int n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
        m1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), m1);
    }
    m0 = _mm512_max_ps(m0, m1);
    float lanes[16];
    _mm512_storeu_ps(lanes, m0);
    float m = max_scalar(lanes, 16);
    for (; i < n; i++)
        if (x[i] > m) m = x[i];
    return m;
}

int ds_argmax(const float *x, int n) {
    if (n <= 0) return 0;
    const ds_isa isa = ds_kernels_isa();
    const float m = isa == DS_ISA_AVX512 ? max_avx512(x, n)
                    : isa == DS_ISA_AVX2 ? max_avx2(x, n)
                                         : max_scalar(x, n);
    for (int i = 0; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* all NaN */
}

int ds_argmax_blocks(const float *x, size_t stride, int block_len, int n) {
    int best = -1;
    float bm = -INFINITY;
    for (int v0 = 0, t = 0; v0 < n; v0 += block_len, t++) {
        const float *b = x + (size_t)t * stride;
        int i = ds_argmax(b, DS_MIN(block_len, n - v0));
        /* a block of NaN only (its index 0 then holds NaN) has no candidate; on equal maxima the
         * earlier block holds the lower index */
        if (b[i] == b[i] && (best < 0 || b[i] > bm)) {
            best = v0 + i;
            bm = b[i];
        }
    }
    return best < 0 ? 0 : best;
}
