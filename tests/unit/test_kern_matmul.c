/* test_kern_matmul.c — ds_matmul, ds_matmul_t, ds_mat_rows and ds_embed against float64 references,
 * on every instruction-set path this CPU supports, for F32, F16 and BF16 weights.
 *
 * The references use the weights as the kernel sees them (already rounded to the file dtype), so
 * the only error left is the f32 accumulation: <= 1e-5 relative to the largest output. Sizes are
 * deliberately awkward (rows and columns not multiples of 8 or 16, more columns than one K block
 * of either strategy, more rows than one row block) and T covers decode (1..3: one token tile),
 * small batches (5, 16: streaming in column chunks) and a prefill-like 37 (the blocked strategy:
 * packed x, widened panel, K blocks, partial token tiles). */
#include "testutil.h"

#include "kernels/cpu/kernels.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static const ds_dtype k_dtypes[] = {DS_DT_F32, DS_DT_F16, DS_DT_BF16};
static const int k_T[] = {1, 2, 3, 5, 16, 37};
/* {rows, cols}: single element; under one vector; odd; over one streaming chunk (512 columns);
 * several row blocks with a ragged last one; over two blocked K blocks (1024 columns). */
static const int k_shapes[][2] = {{1, 1},    {3, 5},    {13, 17},  {19, 300},
                                  {37, 515}, {150, 64}, {21, 2085}};

/* A weight matrix in dtype dt plus its values as the kernel sees them. */
typedef struct test_mat {
    ds_mat m;
    void *data;  /* [rows][cols] in dt */
    double *val; /* [rows][cols] the rounded values */
} test_mat;

static test_mat make_mat(ds_rng *rng, ds_dtype dt, int rows, int cols) {
    test_mat t;
    size_t n = (size_t)rows * (size_t)cols;
    size_t es = dt == DS_DT_F32 ? 4 : 2;
    t.data = malloc(n * es + 1);
    t.val = malloc((n + 1) * sizeof(double));
    for (size_t i = 0; i < n; i++) {
        float f = (float)ds_rng_normal(rng);
        if (dt == DS_DT_F32) {
            ((float *)t.data)[i] = f;
            t.val[i] = f;
        } else if (dt == DS_DT_BF16) {
            uint16_t h = ds_f32_to_bf16(f);
            ((uint16_t *)t.data)[i] = h;
            t.val[i] = ds_bf16_to_f32(h);
        } else {
            uint16_t h = ds_f32_to_f16(f);
            ((uint16_t *)t.data)[i] = h;
            t.val[i] = ds_f16_to_f32(h);
        }
    }
    t.m = (ds_mat){t.data, dt, rows, cols, NULL};
    return t;
}

static void free_mat(test_mat *t) {
    free(t->data);
    free(t->val);
}

static float *rand_vec(ds_rng *rng, size_t n) {
    float *v = malloc((n + 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = (float)ds_rng_normal(rng);
    return v;
}

/* The paths this CPU can run. */
static int supported_isas(ds_isa *out) {
    int n = 0;
    for (int i = DS_ISA_SCALAR; i <= DS_ISA_AVX512; i++)
        if (ds_isa_supported((ds_isa)i)) out[n++] = (ds_isa)i;
    return n;
}

/* Runs first: nothing has chosen a path yet, so DS_ISA is still read. */
static void test_isa_selection(void **state) {
    (void)state;
    setenv("DS_ISA", "scalar", 1);
    ds_kernels_init();
    assert_int_equal(ds_kernels_isa(), DS_ISA_SCALAR);
    setenv("DS_ISA", "avx2", 1);
    ds_kernels_init(); /* idempotent: the environment is read once */
    assert_int_equal(ds_kernels_isa(), DS_ISA_SCALAR);
    unsetenv("DS_ISA");
    assert_true(ds_isa_supported(DS_ISA_SCALAR));
    assert_true(ds_isa_supported(ds_kernels_isa()));
    assert_string_equal(ds_isa_name(DS_ISA_SCALAR), "scalar");
    assert_string_equal(ds_isa_name(DS_ISA_AVX2), "avx2");
    assert_string_equal(ds_isa_name(DS_ISA_AVX512), "avx512");
    ds_isa isas[3];
    int n = supported_isas(isas);
    for (int i = 0; i < n; i++) {
        ds_kernels_force_isa(isas[i]);
        assert_int_equal(ds_kernels_isa(), isas[i]);
    }
    /* An unsupported request falls back to the best supported path below it, never above. */
    ds_kernels_force_isa(DS_ISA_AVX512);
    assert_int_equal(ds_kernels_isa(), isas[n - 1]);
}

static void test_matmul_vs_reference(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 1234);
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    for (size_t s = 0; s < DS_ARRAY_LEN(k_shapes); s++) {
        const int R = k_shapes[s][0], C = k_shapes[s][1];
        const int Tmax = 37, ldx = C + 3, ldy = R + 5;
        float *x = rand_vec(&rng, (size_t)Tmax * (size_t)ldx);
        float *y = malloc((size_t)Tmax * (size_t)ldy * sizeof(float));
        double *ref = malloc((size_t)Tmax * (size_t)R * sizeof(double));
        float *got = malloc((size_t)Tmax * (size_t)R * sizeof(float));
        for (size_t d = 0; d < DS_ARRAY_LEN(k_dtypes); d++) {
            test_mat w = make_mat(&rng, k_dtypes[d], R, C);
            for (int t = 0; t < Tmax; t++)
                for (int r = 0; r < R; r++) {
                    double acc = 0;
                    for (int c = 0; c < C; c++)
                        acc += (double)x[(size_t)t * ldx + c] * w.val[(size_t)r * C + c];
                    ref[(size_t)t * R + r] = acc;
                }
            for (int ii = 0; ii < nisa; ii++) {
                ds_kernels_force_isa(isas[ii]);
                for (size_t ti = 0; ti < DS_ARRAY_LEN(k_T); ti++) {
                    const int T = k_T[ti];
                    for (size_t i = 0; i < (size_t)Tmax * ldy; i++) y[i] = 12345.0f;
                    ds_matmul(y, ldy, x, ldx, T, &w.m);
                    for (int t = 0; t < T; t++) {
                        memcpy(got + (size_t)t * R, y + (size_t)t * ldy, (size_t)R * sizeof(float));
                        for (int r = R; r < ldy; r++) /* the stride gap is not written */
                            assert_true(y[(size_t)t * ldy + r] == 12345.0f);
                    }
                    assert_true(T == Tmax ||
                                y[(size_t)T * ldy] == 12345.0f); /* rows past T untouched */
                    double err = ds_test_rel_err(got, ref, (size_t)T * R);
                    if (!(err <= 1e-5))
                        fail_msg("matmul %s %s R=%d C=%d T=%d: rel err %g", ds_isa_name(isas[ii]),
                                 ds_dtype_name(k_dtypes[d]), R, C, T, err);
                }
            }
            free_mat(&w);
        }
        free(x);
        free(y);
        free(ref);
        free(got);
    }
    ds_kernels_force_isa(DS_ISA_AVX512);
}

/* A token's output must not depend on the batch it is computed in, on the strategy (decode vs
 * blocked) or on the thread count: bit-identical, not merely close. */
static void test_matmul_batch_invariant(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 99);
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    const int R = 45, C = 1500, T = 37;
    float *x = rand_vec(&rng, (size_t)T * C);
    float *yb = malloc((size_t)T * R * sizeof(float)), *yb1 = malloc((size_t)T * R * sizeof(float));
    float *y1 = malloc((size_t)R * sizeof(float));
    float *y1t = malloc((size_t)R * sizeof(float));
    for (size_t d = 0; d < DS_ARRAY_LEN(k_dtypes); d++) {
        test_mat w = make_mat(&rng, k_dtypes[d], R, C);
        for (int ii = 0; ii < nisa; ii++) {
            ds_kernels_force_isa(isas[ii]);
            ds_matmul(yb, R, x, C, T, &w.m);
            for (int t = 0; t < T; t++) {
                ds_matmul(y1, R, x + (size_t)t * C, C, 1, &w.m);
                if (memcmp(y1, yb + (size_t)t * R, (size_t)R * sizeof(float)) != 0)
                    fail_msg("%s %s: token %d differs between T=1 and T=%d", ds_isa_name(isas[ii]),
                             ds_dtype_name(k_dtypes[d]), t, T);
            }
            /* One thread (other row blocks), and a batch of 5 starting mid-way (a different
             * token-tile alignment). */
            int saved = omp_get_max_threads();
            omp_set_num_threads(1);
            ds_matmul(y1t, R, x + (size_t)11 * C, C, 1, &w.m);
            ds_matmul(yb1, R, x, C, T, &w.m);
            omp_set_num_threads(saved);
            assert_memory_equal(y1t, yb + (size_t)11 * R, (size_t)R * sizeof(float));
            assert_memory_equal(yb1, yb, (size_t)T * R * sizeof(float));
            float y5[5 * 45];
            ds_matmul(y5, R, x + (size_t)7 * C, C, 5, &w.m);
            assert_memory_equal(y5, yb + (size_t)7 * R, sizeof y5);
        }
        free_mat(&w);
    }
    free(x);
    free(yb);
    free(yb1);
    free(y1);
    free(y1t);
    ds_kernels_force_isa(DS_ISA_AVX512);
}

/* A prompt longer than one blocked chunk (512 tokens) gives each token the same bits as T = 1. */
static void test_matmul_long_prompt(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 7);
    const int R = 7, C = 33, T = 515;
    float *x = rand_vec(&rng, (size_t)T * C), *y = malloc((size_t)T * R * sizeof(float));
    test_mat w = make_mat(&rng, DS_DT_BF16, R, C);
    ds_matmul(y, R, x, C, T, &w.m);
    for (int t = 0; t < T; t += 3) {
        float y1[7];
        ds_matmul(y1, R, x + (size_t)t * C, C, 1, &w.m);
        assert_memory_equal(y1, y + (size_t)t * R, sizeof y1);
    }
    free_mat(&w);
    free(x);
    free(y);
}

/* A row slice is a matrix of its own: same numbers as the matching rows of the whole product. */
static void test_mat_rows(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 5);
    const int R = 40, C = 70, T = 4;
    float *x = rand_vec(&rng, (size_t)T * C);
    float yall[4 * 40], ypart[4 * 40];
    for (size_t d = 0; d < DS_ARRAY_LEN(k_dtypes); d++) {
        test_mat w = make_mat(&rng, k_dtypes[d], R, C);
        ds_mat s = ds_mat_rows(&w.m, 9, 23);
        assert_int_equal(s.rows, 23);
        assert_int_equal(s.cols, C);
        assert_int_equal(s.dtype, k_dtypes[d]);
        ds_matmul(yall, R, x, C, T, &w.m);
        ds_matmul(ypart, 23, x, C, T, &s);
        for (int t = 0; t < T; t++)
            assert_memory_equal(ypart + t * 23, yall + t * R + 9, 23 * sizeof(float));
        free_mat(&w);
    }
    free(x);
}

static void test_matmul_t_vs_reference(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 77);
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    /* {rows, cols}: cols below a vector, between vectors, several 32-column blocks + a tail. */
    static const int shapes[][2] = {{1, 1}, {7, 5}, {33, 13}, {64, 100}, {129, 67}};
    for (size_t s = 0; s < DS_ARRAY_LEN(shapes); s++) {
        const int R = shapes[s][0], C = shapes[s][1], Tmax = 37, ldx = R + 2, ldy = C + 3;
        float *x = rand_vec(&rng, (size_t)Tmax * ldx);
        float *y = malloc((size_t)Tmax * ldy * sizeof(float));
        double *ref = malloc((size_t)Tmax * C * sizeof(double));
        float *got = malloc((size_t)Tmax * C * sizeof(float));
        for (size_t d = 0; d < DS_ARRAY_LEN(k_dtypes); d++) {
            test_mat w = make_mat(&rng, k_dtypes[d], R, C);
            for (int t = 0; t < Tmax; t++)
                for (int c = 0; c < C; c++) {
                    double acc = 0;
                    for (int r = 0; r < R; r++)
                        acc += (double)x[(size_t)t * ldx + r] * w.val[(size_t)r * C + c];
                    ref[(size_t)t * C + c] = acc;
                }
            for (int ii = 0; ii < nisa; ii++) {
                ds_kernels_force_isa(isas[ii]);
                for (size_t ti = 0; ti < DS_ARRAY_LEN(k_T); ti++) {
                    const int T = k_T[ti];
                    for (size_t i = 0; i < (size_t)Tmax * ldy; i++) y[i] = -7.0f;
                    ds_matmul_t(y, ldy, x, ldx, T, &w.m);
                    for (int t = 0; t < T; t++) {
                        memcpy(got + (size_t)t * C, y + (size_t)t * ldy, (size_t)C * sizeof(float));
                        for (int c = C; c < ldy; c++) assert_true(y[(size_t)t * ldy + c] == -7.0f);
                    }
                    double err = ds_test_rel_err(got, ref, (size_t)T * C);
                    if (!(err <= 1e-5))
                        fail_msg("matmul_t %s %s R=%d C=%d T=%d: rel err %g", ds_isa_name(isas[ii]),
                                 ds_dtype_name(k_dtypes[d]), R, C, T, err);
                }
            }
            free_mat(&w);
        }
        free(x);
        free(y);
        free(ref);
        free(got);
    }
    ds_kernels_force_isa(DS_ISA_AVX512);
}

static void test_embed(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 3);
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    const int V = 11, D = 21;
    const int32_t ids[] = {3, 0, 10, 3, -1, 11};
    float out[6 * 21];
    for (size_t d = 0; d < DS_ARRAY_LEN(k_dtypes); d++) {
        test_mat e = make_mat(&rng, k_dtypes[d], V, D);
        for (int ii = 0; ii < nisa; ii++) {
            ds_kernels_force_isa(isas[ii]);
            for (size_t i = 0; i < DS_ARRAY_LEN(out); i++) out[i] = 99.0f;
            ds_embed(out, &e.m, ids, 6);
            for (int t = 0; t < 6; t++)
                for (int c = 0; c < D; c++) {
                    /* Widening is exact; an id outside the table gives a zero row. */
                    double want = (ids[t] >= 0 && ids[t] < V) ? e.val[(size_t)ids[t] * D + c] : 0.0;
                    assert_true((double)out[t * D + c] == want);
                }
        }
        free_mat(&e);
    }
    ds_kernels_force_isa(DS_ISA_AVX512);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_isa_selection),
        cmocka_unit_test(test_matmul_vs_reference),
        cmocka_unit_test(test_matmul_batch_invariant),
        cmocka_unit_test(test_matmul_long_prompt),
        cmocka_unit_test(test_mat_rows),
        cmocka_unit_test(test_matmul_t_vs_reference),
        cmocka_unit_test(test_embed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
