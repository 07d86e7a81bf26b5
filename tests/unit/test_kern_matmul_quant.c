/* test_kern_matmul_quant.c — the element conversions of kernels/shared/quant.h (exhaustively
 * where the format is small) and ds_matmul with FP8 E4M3 (ptpc_fp8) and MXFP4 weights against
 * float64 references of the dequantized math, on every instruction-set path this CPU supports.
 *
 * FP8's reference quantizes the activations exactly as docs/quantization.md § 3 defines
 * (ds_ptpc_quantize_act), sums the exact products in double and applies s_t then s_r; MXFP4's sums
 * x * fp4 * 2^(scale - 127) in double. What is left is the f32 accumulation: <= 1e-5 relative to
 * the largest output. Each token's row must also be bit-identical to its T = 1 result whatever T
 * (streaming up to 16 tokens, the blocked strategy above, two blocked chunks at 600), with one
 * thread or two, and FP8's slow fallback (no scratch) must give the same bits. */
#include "testutil.h"

#include "kernels/cpu/kernels.h"
#include "kernels/cpu/matmul_quant.h"
#include "kernels/shared/quant.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int k_T[] = {1, 2, 3, 5, 16, 17, 40, 600};
enum { TMAX = 600 };
/* {rows, cols}: FP8 takes any cols (odd tails, over one streaming chunk of 512, over two blocked
 * K blocks of 1024); MXFP4 multiples of 32. Rows: not multiples of 4, several row blocks. */
static const int k_fp8_shapes[][2] = {{1, 1},    {3, 5},    {13, 17},  {19, 300},
                                      {37, 515}, {150, 64}, {21, 2085}};
static const int k_mx_shapes[][2] = {{1, 32},    {3, 64},   {13, 96},  {19, 544},
                                     {37, 1056}, {150, 64}, {21, 2080}};

static int supported_isas(ds_isa *out) {
    int n = 0;
    for (int i = DS_ISA_SCALAR; i <= DS_ISA_AVX512; i++)
        if (ds_isa_supported((ds_isa)i)) out[n++] = (ds_isa)i;
    return n;
}

/* ---- element conversions --------------------------------------------------------------------- */

static double e4m3_formula(int b) {
    const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    const double mag = e == 0 ? m / 8.0 * ldexp(1.0, -6) : (1.0 + m / 8.0) * ldexp(1.0, e - 7);
    return s ? -mag : mag;
}

static void test_e4m3_decode_all(void **state) {
    (void)state;
    for (int b = 0; b < 256; b++) {
        const float v = ds_e4m3_to_f32((uint8_t)b);
        if ((b & 0x7f) == 0x7f) {
            assert_true(isnan(v));
            continue;
        }
        assert_true((double)v == e4m3_formula(b));
        assert_int_equal(signbit(v) != 0, b >> 7); /* -0 included */
    }
    assert_true(ds_e4m3_to_f32(0x7e) == 448.0f);
    assert_true(ds_e4m3_to_f32(0x08) == 0.015625f);     /* smallest normal 2^-6 */
    assert_true(ds_e4m3_to_f32(0x01) == 1.0f / 512.0f); /* smallest subnormal 2^-9 */
    assert_true(ds_e4m3_to_f32(0x07) == 7.0f / 512.0f); /* largest subnormal */
}

static void test_e4m3_round_trip(void **state) {
    (void)state;
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7f) == 0x7f) continue;
        assert_int_equal(ds_f32_to_e4m3(ds_e4m3_to_f32((uint8_t)b)), b);
    }
}

/* The code nearest to x by brute force in double: ties to the even code, saturating. */
static int e4m3_nearest(float x) {
    const double a = fabs((double)x);
    int best = 0;
    double bd = INFINITY;
    for (int b = 0; b < 0x7f; b++) {
        const double d = fabs(e4m3_formula(b) - a);
        if (d < bd || (d == bd && (b & 1) == 0)) {
            bd = d;
            best = b;
        }
    }
    if (a >= 448.0) best = 0x7e;
    return best | (signbit(x) ? 0x80 : 0);
}

static void test_e4m3_rounding(void **state) {
    (void)state;
    /* Every midpoint between consecutive finite magnitudes goes to the even code; one ulp either
     * side goes to the nearer one. This covers the subnormal grid and its border with the normals.
     */
    for (int b = 0; b < 0x7e; b++) {
        const float lo = ds_e4m3_to_f32((uint8_t)b), hi = ds_e4m3_to_f32((uint8_t)(b + 1));
        const float mid = (lo + hi) * 0.5f; /* exact */
        const int even = (b & 1) ? b + 1 : b;
        for (int sgn = 0; sgn < 2; sgn++) {
            const float s = sgn ? -1.0f : 1.0f;
            const int sb = sgn ? 0x80 : 0;
            assert_int_equal(ds_f32_to_e4m3(s * mid), even | sb);
            assert_int_equal(ds_f32_to_e4m3(s * nextafterf(mid, 0.0f)), b | sb);
            assert_int_equal(ds_f32_to_e4m3(s * nextafterf(mid, INFINITY)), (b + 1) | sb);
        }
    }
    /* Saturation: never NaN by rounding. */
    const float sat[] = {448.0f, 449.0f, 463.99f, 464.0f, 480.0f, 1e30f, INFINITY};
    for (size_t i = 0; i < DS_ARRAY_LEN(sat); i++) {
        assert_int_equal(ds_f32_to_e4m3(sat[i]), 0x7e);
        assert_int_equal(ds_f32_to_e4m3(-sat[i]), 0xfe);
    }
    assert_int_equal(ds_f32_to_e4m3(NAN), 0x7f);
    assert_int_equal(ds_f32_to_e4m3(0.0f), 0x00);
    assert_int_equal(ds_f32_to_e4m3(-0.0f), 0x80);
    assert_int_equal(ds_f32_to_e4m3(1.0f / 1024.0f), 0x00); /* half the smallest subnormal: even */
    assert_int_equal(ds_f32_to_e4m3(3.0f / 1024.0f), 0x02); /* 1.5 x 2^-9: to even 2 x 2^-9 */
    assert_int_equal(ds_f32_to_e4m3(1e-30f), 0x00);
    /* Random magnitudes over the whole range (2^-14 .. 2^10) against the brute-force nearest. */
    ds_rng rng;
    ds_rng_seed(&rng, 31);
    for (int i = 0; i < 200000; i++) {
        const float x =
            (float)((ds_rng_uniform(&rng) < 0.5 ? -1 : 1) *
                    ldexp(1.0 + ds_rng_uniform(&rng), (int)(ds_rng_uniform(&rng) * 24) - 14));
        const int got = ds_f32_to_e4m3(x), want = e4m3_nearest(x);
        if (got != want) fail_msg("e4m3(%.9g) = 0x%02x, want 0x%02x", (double)x, got, want);
    }
}

static void test_fp4_e8m0(void **state) {
    (void)state;
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    for (int c = 0; c < 16; c++) {
        const float v = ds_fp4_to_f32((uint8_t)c);
        assert_true((double)v == ((c & 8) ? -mag[c & 7] : mag[c & 7]));
        assert_int_equal(signbit(v) != 0, (c & 8) != 0);
        assert_true(ds_fp4_to_f32((uint8_t)(c | 0xf0)) == v); /* only the low nibble counts */
    }
    for (int b = 0; b < 255; b++)
        assert_true((double)ds_e8m0_to_f32((uint8_t)b) == ldexp(1.0, b - 127));
    /* Layout: element 2i in the low nibble of byte i, one scale per 32 elements. */
    uint8_t codes[2][32], scales[2][2];
    for (int r = 0; r < 2; r++) {
        for (int i = 0; i < 32; i++) codes[r][i] = (uint8_t)((i * 7 + r) & 0xff);
        scales[r][0] = (uint8_t)(120 + r);
        scales[r][1] = (uint8_t)(130 - r);
    }
    for (int r = 0; r < 2; r++)
        for (int c = 0; c < 64; c++) {
            const uint8_t byte = codes[r][c / 2];
            const double want =
                ds_fp4_to_f32((c & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 15)) *
                ldexp(1.0, scales[r][c / 32] - 127);
            assert_true((double)ds_mxfp4_at(&codes[0][0], &scales[0][0], 64, r, c) == want);
        }
}

/* The SIMD activation quantizer (DS_FP8_XSCALE x e4m3 value) agrees bit for bit with the
 * definition; its streaming form holds the same values, each whole block of 16 columns in the AVX2
 * tile's order (0,2,4,6,1,3,5,7 and the same plus 8), the tail in place. */
static void test_act_quantizer_simd(void **state) {
    (void)state;
    if (!ds_isa_supported(DS_ISA_AVX2)) skip();
    enum { N = 4099 };
    float *x = malloc(N * sizeof(float)), *got = malloc(N * sizeof(float));
    float *ref = malloc(N * sizeof(float)), *perm = malloc(N * sizeof(float));
    static const int k_pos[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
    ds_rng rng;
    ds_rng_seed(&rng, 8);
    for (int i = 0; i < N; i++)
        x[i] = (float)(ds_rng_normal(&rng) * ldexp(1.0, (int)(ds_rng_uniform(&rng) * 40) - 20));
    /* every code's value and midpoint, and the specials */
    for (int b = 0; b < 127; b++) {
        x[2 * b] = ds_e4m3_to_f32((uint8_t)b) * ((b & 1) ? -1.0f : 1.0f);
        x[2 * b + 1] = b < 126
                           ? (ds_e4m3_to_f32((uint8_t)b) + ds_e4m3_to_f32((uint8_t)(b + 1))) * 0.5f
                           : 470.0f;
    }
    x[300] = INFINITY;
    x[301] = -INFINITY;
    x[302] = NAN;
    x[303] = -0.0f;
    x[304] = 1e-40f; /* an f32 subnormal */
    x[305] = 3.4e38f;
    for (int inv_i = 0; inv_i < 2; inv_i++) {
        const float inv = inv_i ? 1.0f : 0.37f;
        ds_qops_avx2.act(got, x, N, inv);
        for (int i = 0; i < N; i++) {
            ref[i] = ds_e4m3_to_f32(ds_f32_to_e4m3(x[i] * inv)) * DS_FP8_XSCALE;
            if (isnan(ref[i])) {
                assert_true(isnan(got[i]));
                continue;
            }
            if (memcmp(&got[i], &ref[i], 4) != 0)
                fail_msg("act(%.9g * %g) = %.9g, want %.9g", (double)x[i], (double)inv,
                         (double)got[i], (double)ref[i]);
        }
        ds_qops_avx2.act_stream(perm, x, N, inv);
        for (int i = 0; i < N; i++) {
            const int src = i < N / 16 * 16 ? i / 16 * 16 + k_pos[i % 16] : i;
            if (memcmp(&perm[i], &got[src], 4) != 0)
                fail_msg("act_stream[%d] = %.9g, want act[%d] = %.9g", i, (double)perm[i], src,
                         (double)got[src]);
        }
    }
    float amax = 0.0f;
    for (int i = 0; i < N; i++) amax = fmaxf(amax, fabsf(x[i]));
    assert_true(ds_qops_avx2.amax(x, N) == amax);
    float amax7 = 0.0f; /* below one vector */
    for (int i = 1; i < 8; i++) amax7 = fmaxf(amax7, fabsf(x[i]));
    assert_true(ds_qops_avx2.amax(x + 1, 7) == amax7);
    free(x);
    free(got);
    free(ref);
    free(perm);
}

/* ---- products -------------------------------------------------------------------------------- */

/* A quantized matrix plus the values the reference uses: FP8 the E4M3 values of the codes (the row
 * scale apart), MXFP4 the full dequantized W. */
typedef struct qmat {
    ds_mat m;
    uint8_t *codes;
    void *scales;
    double *val; /* [rows][cols] */
} qmat;

static qmat make_fp8(ds_rng *rng, int R, int C) {
    qmat q;
    float *wf = malloc((size_t)R * C * sizeof(float));
    for (int r = 0; r < R; r++) {
        const double mag = ldexp(1.0, (r % 7) - 3); /* rows of different magnitudes */
        for (int c = 0; c < C; c++) /* every 11th tiny: subnormal codes (0x01..0x07) and zeros */
            wf[(size_t)r * C + c] = (float)(ds_rng_normal(rng) * mag * (c % 11 == 5 ? 1e-4 : 1.0));
    }
    q.codes = malloc((size_t)R * C);
    q.scales = malloc((size_t)R * sizeof(float));
    const ds_mat src = {wf, DS_DT_F32, R, C, NULL};
    ds_ptpc_quantize(q.codes, q.scales, &src, 0, C);
    q.val = malloc((size_t)R * C * sizeof(double));
    int subnormal = 0;
    for (size_t i = 0; i < (size_t)R * C; i++) {
        q.val[i] = ds_e4m3_to_f32(q.codes[i]);
        subnormal += (q.codes[i] & 0x78) == 0 && (q.codes[i] & 7) != 0;
    }
    assert_true(R * C < 50 || subnormal > 0);
    q.m = (ds_mat){q.codes, DS_DT_F8_E4M3, R, C, q.scales};
    free(wf);
    return q;
}

static qmat make_mx(ds_rng *rng, int R, int C) {
    qmat q;
    q.codes = malloc((size_t)R * C / 2);
    q.scales = malloc((size_t)R * C / 32);
    for (size_t i = 0; i < (size_t)R * C / 2; i++) q.codes[i] = (uint8_t)(ds_rng_next(rng) & 0xff);
    uint8_t *sc = q.scales;
    for (size_t i = 0; i < (size_t)R * C / 32; i++) sc[i] = (uint8_t)(121 + ds_rng_next(rng) % 12);
    q.val = malloc((size_t)R * C * sizeof(double));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) q.val[(size_t)r * C + c] = ds_mxfp4_at(q.codes, sc, C, r, c);
    q.m = (ds_mat){q.codes, DS_DT_MXFP4, R, C, q.scales};
    return q;
}

static void free_qmat(qmat *q) {
    free(q->codes);
    free(q->scales);
    free(q->val);
}

/* ref [T][R] in double: the definitions of kernels.h. */
static void reference(double *ref, const qmat *q, const float *x, int ldx, int T) {
    const int R = q->m.rows, C = q->m.cols, fp8 = q->m.dtype == DS_DT_F8_E4M3;
    float *xq = malloc(((size_t)T * C + 1) * sizeof(float)),
          *st = malloc((size_t)T * sizeof(float));
    if (fp8) ds_ptpc_quantize_act(xq, st, x, ldx, T, C);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) {
            double acc = 0;
            for (int c = 0; c < C; c++) {
                const double xv = fp8 ? xq[(size_t)t * C + c] : x[(size_t)t * ldx + c];
                acc += xv * q->val[(size_t)r * C + c];
            }
            ref[(size_t)t * R + r] =
                fp8 ? acc * (double)st[t] * (double)((const float *)q->scales)[r] : acc;
        }
    free(xq);
    free(st);
}

static float *rand_x(ds_rng *rng, size_t n) {
    float *v = malloc((n + 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) /* every 13th tiny: subnormal FP8 activations */
        v[i] = (float)(ds_rng_normal(rng) * (1.0 + (double)(i % 5)) * (i % 13 == 6 ? 1e-3 : 1.0));
    return v;
}

/* y1 [TMAX][R]: each token alone (T = 1), checked against the reference. */
static void run_single(float *y1, const qmat *q, const float *x, int ldx, const double *ref,
                       const char *what) {
    const int R = q->m.rows;
    for (int t = 0; t < TMAX; t++)
        ds_matmul(y1 + (size_t)t * R, R, x + (size_t)t * ldx, ldx, 1, &q->m);
    const double err = ds_test_rel_err(y1, ref, (size_t)TMAX * R);
    if (!(err <= 1e-5)) fail_msg("%s T=1: rel err %g", what, err);
}

/* Every T of k_T: strides respected and each token's row the bits of y1. */
static void run_batches(const float *y1, const qmat *q, const float *x, int ldx, float *y, int ldy,
                        const char *what) {
    const int R = q->m.rows;
    for (size_t ti = 0; ti < DS_ARRAY_LEN(k_T); ti++) {
        const int T = k_T[ti];
        for (size_t i = 0; i < (size_t)TMAX * ldy; i++) y[i] = 12345.0f;
        ds_matmul(y, ldy, x, ldx, T, &q->m);
        for (int t = 0; t < T; t++) {
            if (memcmp(y + (size_t)t * ldy, y1 + (size_t)t * R, (size_t)R * sizeof(float)) != 0)
                fail_msg("%s: token %d differs between T=1 and T=%d", what, t, T);
            for (int r = R; r < ldy; r++) assert_true(y[(size_t)t * ldy + r] == 12345.0f);
        }
        assert_true(T == TMAX || y[(size_t)T * ldy] == 12345.0f);
    }
    /* one thread (other row blocks) */
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    ds_matmul(y, ldy, x + (size_t)7 * ldx, ldx, 40, &q->m);
    omp_set_num_threads(saved);
    for (int t = 0; t < 40; t++)
        assert_memory_equal(y + (size_t)t * ldy, y1 + (size_t)(t + 7) * R,
                            (size_t)R * sizeof(float));
}

static void check_kind(int fp8) {
    ds_rng rng;
    ds_rng_seed(&rng, fp8 ? 4242 : 777);
    ds_isa isas[3];
    const int nisa = supported_isas(isas);
    const int(*shapes)[2] = fp8 ? k_fp8_shapes : k_mx_shapes;
    for (size_t s = 0; s < DS_ARRAY_LEN(k_fp8_shapes); s++) {
        const int R = shapes[s][0], C = shapes[s][1], ldx = C + 3, ldy = R + 5;
        float *x = rand_x(&rng, (size_t)TMAX * ldx);
        float *y = malloc((size_t)TMAX * ldy * sizeof(float));
        float *y1 = malloc((size_t)TMAX * R * sizeof(float));
        float *yprev = malloc((size_t)TMAX * R * sizeof(float));
        double *ref = malloc((size_t)TMAX * R * sizeof(double));
        qmat q = fp8 ? make_fp8(&rng, R, C) : make_mx(&rng, R, C);
        reference(ref, &q, x, ldx, TMAX);
        for (int ii = 0; ii < nisa; ii++) {
            char what[96];
            snprintf(what, sizeof what, "%s %s R=%d C=%d", fp8 ? "fp8" : "mxfp4",
                     ds_isa_name(isas[ii]), R, C);
            ds_kernels_force_isa(isas[ii]);
            run_single(y1, &q, x, ldx, ref, what);
            run_batches(y1, &q, x, ldx, y, ldy, what);
            if (fp8) {
                /* without scratch: converted on the fly, the same bits */
                ds_matmul_quant_force_fallback(1);
                for (int T = 1; T <= 16; T += 15) {
                    ds_matmul(y, ldy, x + (size_t)3 * ldx, ldx, T, &q.m);
                    for (int t = 0; t < T; t++)
                        if (memcmp(y + (size_t)t * ldy, y1 + (size_t)(t + 3) * R, (size_t)R * 4))
                            fail_msg("%s: fallback differs, token %d of %d", what, t, T);
                }
                ds_matmul_quant_force_fallback(0);
                /* The portable and AVX2 paths both sum 8 lanes of exact products: same bits. */
                if (ii > 0 && isas[ii - 1] == DS_ISA_SCALAR && isas[ii] == DS_ISA_AVX2)
                    assert_memory_equal(y1, yprev, (size_t)TMAX * R * sizeof(float));
            }
            memcpy(yprev, y1, (size_t)TMAX * R * sizeof(float));
        }
        free_qmat(&q);
        free(x);
        free(y);
        free(y1);
        free(yprev);
        free(ref);
    }
    ds_kernels_force_isa(DS_ISA_AVX512);
}

static void test_matmul_fp8(void **state) {
    (void)state;
    check_kind(1);
}

static void test_matmul_mxfp4(void **state) {
    (void)state;
    check_kind(0);
}

/* A row slice of a quantized matrix (scales follow) gives the matching rows of the whole. */
static void test_quant_rows(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 5);
    const int R = 40, C = 96, T = 4;
    float *x = rand_x(&rng, (size_t)T * C);
    float yall[4 * 40], ypart[4 * 23];
    for (int fp8 = 0; fp8 < 2; fp8++) {
        qmat q = fp8 ? make_fp8(&rng, R, C) : make_mx(&rng, R, C);
        const ds_mat s = ds_mat_rows(&q.m, 9, 23);
        ds_matmul(yall, R, x, C, T, &q.m);
        ds_matmul(ypart, 23, x, C, T, &s);
        for (int t = 0; t < T; t++)
            assert_memory_equal(ypart + t * 23, yall + t * R + 9, 23 * sizeof(float));
        free_qmat(&q);
    }
    free(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_decode_all),    cmocka_unit_test(test_e4m3_round_trip),
        cmocka_unit_test(test_e4m3_rounding),      cmocka_unit_test(test_fp4_e8m0),
        cmocka_unit_test(test_act_quantizer_simd), cmocka_unit_test(test_matmul_fp8),
        cmocka_unit_test(test_matmul_mxfp4),       cmocka_unit_test(test_quant_rows),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
