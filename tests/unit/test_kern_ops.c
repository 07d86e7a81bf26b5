/* test_kern_ops.c — norms, activations, vector updates, argmax, the MoE router and the AttnRes mix
 * against float64 references and hand-checkable cases, on every instruction-set path this CPU
 * supports. */
#include "testutil.h"

#include "kernels/cpu/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int supported_isas(ds_isa *out) {
    int n = 0;
    for (int i = DS_ISA_SCALAR; i <= DS_ISA_AVX512; i++)
        if (ds_isa_supported((ds_isa)i)) out[n++] = (ds_isa)i;
    return n;
}

static float *rand_vec(ds_rng *rng, size_t n, double sd) {
    float *v = malloc((n + 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = (float)(sd * ds_rng_normal(rng));
    return v;
}

#define CHECK_REL(got, ref, n, tol, ...)                                                           \
    do {                                                                                           \
        double err_ = ds_test_rel_err((got), (ref), (n));                                          \
        if (!(err_ <= (tol))) fail_msg(__VA_ARGS__, err_);                                         \
    } while (0)

static double sigmoid_d(double x) {
    return 1.0 / (1.0 + exp(-x));
}

/* ---- norms ----------------------------------------------------------------------------------- */

static void test_rmsnorm(void **state) {
    (void)state;
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    ds_rng rng;
    ds_rng_seed(&rng, 11);
    static const int dims[] = {1, 7, 37, 300};
    for (int ii = 0; ii < nisa; ii++) {
        ds_kernels_force_isa(isas[ii]);
        /* By hand: x = (3, 4), mean(x^2) = 12.5, w = (1, 2), eps = 0 -> (3, 8) / sqrt(12.5). */
        float x2[2] = {3, 4}, w2[2] = {1, 2}, y2[2];
        ds_rmsnorm(y2, x2, w2, 1, 2, 0.0f);
        assert_float_equal(y2[0], 0.8485281374f, 1e-6);
        assert_float_equal(y2[1], 2.2627416998f, 1e-6);
        for (size_t di = 0; di < DS_ARRAY_LEN(dims); di++) {
            const int T = 5, D = dims[di];
            const float eps = 1e-5f;
            float *x = rand_vec(&rng, (size_t)T * D, 3.0), *w = rand_vec(&rng, (size_t)D, 1.0);
            float *y = malloc((size_t)T * D * sizeof(float));
            double *ref = malloc((size_t)T * D * sizeof(double));
            for (int t = 0; t < T; t++) {
                double ss = 0;
                for (int d = 0; d < D; d++) ss += (double)x[t * D + d] * x[t * D + d];
                double r = 1.0 / sqrt(ss / D + eps);
                for (int d = 0; d < D; d++) ref[t * D + d] = (double)w[d] * x[t * D + d] * r;
            }
            ds_rmsnorm(y, x, w, T, D, eps);
            CHECK_REL(y, ref, (size_t)T * D, 1e-6, "rmsnorm %s D=%d: %g", ds_isa_name(isas[ii]), D);
            ds_rmsnorm(x, x, w, T, D, eps); /* in place */
            assert_memory_equal(x, y, (size_t)T * D * sizeof(float));
            free(x);
            free(w);
            free(y);
            free(ref);
        }
    }
}

static void test_l2norm_heads(void **state) {
    (void)state;
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    ds_rng rng;
    ds_rng_seed(&rng, 12);
    for (int ii = 0; ii < nisa; ii++) {
        ds_kernels_force_isa(isas[ii]);
        /* By hand: (3, 4) / sqrt(25 + 0) = (0.6, 0.8); the second head (0, 0) stays 0 with eps > 0.
         */
        float h[4] = {3, 4, 0, 0};
        ds_l2norm_heads(h, 1, 2, 2, 0.0f, 1.0f);
        assert_float_equal(h[0], 0.6f, 1e-7);
        assert_float_equal(h[1], 0.8f, 1e-7);
        float z[2] = {0, 0};
        ds_l2norm_heads(z, 1, 1, 2, 1e-6f, 1.0f);
        assert_true(z[0] == 0.0f && z[1] == 0.0f);

        const int T = 3, H = 4, d = 37;
        const float eps = 1e-6f, scale = 0.125f;
        float *x = rand_vec(&rng, (size_t)T * H * d, 2.0);
        double *ref = malloc((size_t)T * H * d * sizeof(double));
        for (int i = 0; i < T * H; i++) {
            double ss = 0;
            for (int c = 0; c < d; c++) ss += (double)x[i * d + c] * x[i * d + c];
            /* eps inside the root of the sum (not the mean), then the scale. */
            for (int c = 0; c < d; c++) ref[i * d + c] = x[i * d + c] / sqrt(ss + eps) * scale;
        }
        ds_l2norm_heads(x, T, H, d, eps, scale);
        CHECK_REL(x, ref, (size_t)T * H * d, 1e-6, "l2norm %s: %g", ds_isa_name(isas[ii]));
        free(x);
        free(ref);
    }
}

static void test_gated_rmsnorm_heads(void **state) {
    (void)state;
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    ds_rng rng;
    ds_rng_seed(&rng, 13);
    for (int ii = 0; ii < nisa; ii++) {
        ds_kernels_force_isa(isas[ii]);
        /* By hand: o = (3, 4), w = (1, 1), gate = (0, 0) -> (3, 4) / sqrt(12.5) * 0.5. */
        float o2[2] = {3, 4}, g2[2] = {0, 0}, w2[2] = {1, 1}, y2[2];
        ds_gated_rmsnorm_heads(y2, o2, g2, w2, 1, 1, 2, 0.0f);
        assert_float_equal(y2[0], 0.4242640687f, 1e-6);
        assert_float_equal(y2[1], 0.5656854249f, 1e-6);

        const int T = 2, H = 3, d = 45;
        const float eps = 1e-5f;
        const size_t n = (size_t)T * H * d;
        float *o = rand_vec(&rng, n, 1.5), *g = rand_vec(&rng, n, 4.0);
        float *w = rand_vec(&rng, (size_t)d, 1.0), *y = malloc(n * sizeof(float));
        double *ref = malloc(n * sizeof(double));
        for (int i = 0; i < T * H; i++) {
            double ss = 0;
            for (int c = 0; c < d; c++) ss += (double)o[i * d + c] * o[i * d + c];
            double r = 1.0 / sqrt(ss / d + eps);
            for (int c = 0; c < d; c++)
                ref[i * d + c] = o[i * d + c] * r * w[c] * sigmoid_d(g[i * d + c]);
        }
        ds_gated_rmsnorm_heads(y, o, g, w, T, H, d, eps);
        CHECK_REL(y, ref, n, 2e-6, "gated rmsnorm %s: %g", ds_isa_name(isas[ii]));
        free(o);
        free(g);
        free(w);
        free(y);
        free(ref);
    }
}

/* ---- vector updates and activations ---------------------------------------------------------- */

static void test_add_axpy(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 14);
    const size_t n = 1003;
    float *x = rand_vec(&rng, n, 1.0), *y = rand_vec(&rng, n, 1.0);
    float *y0 = malloc(n * sizeof(float));
    memcpy(y0, y, n * sizeof(float));
    ds_add(y, x, n);
    for (size_t i = 0; i < n; i++) assert_true(y[i] == y0[i] + x[i]);
    memcpy(y, y0, n * sizeof(float));
    ds_axpy(y, -0.75f, x, n);
    for (size_t i = 0; i < n; i++) assert_true(y[i] == y0[i] + -0.75f * x[i]);
    free(x);
    free(y);
    free(y0);
}

/* Inputs that cover the branches: tiny, around the tanh switch (|x| = 0.25, and 1 = 0.25 * beta),
 * moderate, and saturating ones. */
static float *act_inputs(ds_rng *rng, size_t n) {
    static const float fixed[] = {0.0f,   -0.0f, 1e-6f,  -3e-4f, 0.2499f, 0.2501f, -0.25f,
                                  0.99f,  1.01f, -1.0f,  4.0f,   -6.5f,   9.5f,    20.0f,
                                  -30.0f, 87.0f, -88.0f, 100.0f, -100.0f};
    float *v = rand_vec(rng, n, 3.0);
    for (size_t i = 0; i < DS_ARRAY_LEN(fixed) && i < n; i++) v[i * 7 % n] = fixed[i];
    return v;
}

/* |got - ref| <= tol * |ref| element by element, where |ref| is not tiny. */
static void check_elementwise(const float *got, const double *ref, size_t n, double tol,
                              const char *what, ds_isa isa) {
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - ref[i]);
        if (!(err <= tol * fabs(ref[i]) + 1e-30) && fabs(ref[i]) > 1e-30)
            fail_msg("%s %s [%zu]: got %.9g want %.9g", what, ds_isa_name(isa), i, got[i], ref[i]);
    }
}

static void test_activations(void **state) {
    (void)state;
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    ds_rng rng;
    ds_rng_seed(&rng, 15);
    const size_t n = 1000 + 13;
    float *a = act_inputs(&rng, n), *b = act_inputs(&rng, n);
    for (size_t i = 0; i < n; i++) b[i] *= 0.1f; /* up projections: small values matter too */
    float *out = malloc(n * sizeof(float));
    double *ref = malloc(n * sizeof(double));
    for (int ii = 0; ii < nisa; ii++) {
        ds_kernels_force_isa(isas[ii]);
        /* sigmoid, also exact at 0 */
        memcpy(out, a, n * sizeof(float));
        ds_sigmoid_inplace(out, n);
        for (size_t i = 0; i < n; i++) ref[i] = sigmoid_d(a[i]);
        check_elementwise(out, ref, n, 2e-6, "sigmoid", isas[ii]);
        float half = 0.0f;
        ds_sigmoid_inplace(&half, 1);
        assert_true(half == 0.5f);

        ds_act_swiglu(out, a, b, n);
        for (size_t i = 0; i < n; i++) ref[i] = a[i] * sigmoid_d(a[i]) * b[i];
        check_elementwise(out, ref, n, 3e-6, "swiglu", isas[ii]);

        /* K3: beta = 4, lin_beta = 25; and without the linear clamp. */
        ds_act_situ(out, a, b, n, 4.0f, 25.0f);
        for (size_t i = 0; i < n; i++)
            ref[i] = 4.0 * tanh(a[i] / 4.0) * sigmoid_d(a[i]) * 25.0 * tanh(b[i] / 25.0);
        check_elementwise(out, ref, n, 4e-6, "situ", isas[ii]);
        ds_act_situ(out, a, b, n, 4.0f, 0.0f);
        for (size_t i = 0; i < n; i++) ref[i] = 4.0 * tanh(a[i] / 4.0) * sigmoid_d(a[i]) * b[i];
        check_elementwise(out, ref, n, 4e-6, "situ(no lin)", isas[ii]);
        /* Large up values saturate at lin_beta: phi(1000) = 25 tanh(40) = 25. */
        float g1 = 50.0f, u1 = 1000.0f, o1;
        ds_act_situ(&o1, &g1, &u1, 1, 4.0f, 25.0f);
        assert_float_equal(o1, 100.0f, 1e-4); /* 4 tanh(12.5) sigmoid(50) 25 tanh(40) */

        /* Output aliasing the gate input. */
        float *al = malloc(n * sizeof(float));
        memcpy(al, a, n * sizeof(float));
        ds_act_swiglu(al, al, b, n);
        ds_act_swiglu(out, a, b, n);
        assert_memory_equal(al, out, n * sizeof(float));
        free(al);
    }
    /* A long array (split between threads) gives the same values as element-wise calls. */
    ds_kernels_force_isa(DS_ISA_AVX512);
    const size_t big = 200003;
    float *ga = rand_vec(&rng, big, 3.0), *gb = rand_vec(&rng, big, 1.0);
    float *go = malloc(big * sizeof(float));
    ds_act_situ(go, ga, gb, big, 4.0f, 25.0f);
    for (size_t i = 0; i < big; i += 9973) {
        float one;
        ds_act_situ(&one, ga + i, gb + i, 1, 4.0f, 25.0f);
        assert_true(one == go[i]);
    }
    free(ga);
    free(gb);
    free(go);
    free(a);
    free(b);
    free(out);
    free(ref);
}

static void test_argmax(void **state) {
    (void)state;
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    const int n = 1000 + 37;
    float *x = malloc((size_t)n * sizeof(float));
    for (int ii = 0; ii < nisa; ii++) {
        ds_kernels_force_isa(isas[ii]);
        for (int i = 0; i < n; i++) x[i] = (float)((i * 37) % 101) - 50.0f;
        /* ties: the maximum 50 occurs many times; the first is the lowest i with i*37 % 101 == 100
         */
        int first = 0;
        while ((first * 37) % 101 != 100) first++;
        assert_int_equal(ds_argmax(x, n), first);
        x[n - 1] = 51.0f; /* in the tail */
        assert_int_equal(ds_argmax(x, n), n - 1);
        x[5] = 51.0f; /* tie with the tail: lower index wins */
        assert_int_equal(ds_argmax(x, n), 5);
        x[2] = NAN; /* NaNs never win */
        x[700] = NAN;
        assert_int_equal(ds_argmax(x, n), 5);
        for (int i = 0; i < n; i++) x[i] = -INFINITY;
        x[400] = -1e30f;
        assert_int_equal(ds_argmax(x, n), 400);
        x[400] = -INFINITY;
        assert_int_equal(ds_argmax(x, n), 0);
        float one = 3.0f;
        assert_int_equal(ds_argmax(&one, 1), 0);
        float z[3] = {-0.0f, 0.0f, -1.0f}; /* -0 == +0: the first */
        assert_int_equal(ds_argmax(z, 3), 0);
    }
    free(x);
}

/* ds_argmax_blocks over a row split in blocks (vocabulary-parallel logits as gathered: block t at
 * t * stride, the last block cut) equals ds_argmax over the row laid out flat: random rows with
 * ties inside and across blocks, NaN blocks, -inf everywhere. */
static void test_argmax_blocks(void **state) {
    (void)state;
    enum { N = 1000, BL = 251, NB = (N + BL - 1) / BL, STRIDE = 300 };
    float flat[N], split[NB * STRIDE];
    ds_rng rng;
    ds_rng_seed(&rng, 12);
    for (int trial = 0; trial < 400; trial++) {
        int kind = trial % 5;
        for (int i = 0; i < N; i++) {
            float v = (float)(ds_rng_next(&rng) % 17); /* many ties */
            if (kind == 1 && i < 2 * BL) v = NAN;      /* the first two blocks NaN */
            if (kind == 2) v = -INFINITY;
            if (kind == 3 && i >= BL) v = NAN;           /* only the first block has numbers */
            if (kind == 4) v = i < BL ? NAN : -INFINITY; /* NaN, then -inf: the first -inf */
            flat[i] = v;
        }
        for (int i = 0; i < NB * STRIDE; i++) split[i] = 99.0f; /* never read */
        for (int i = 0; i < N; i++) split[(i / BL) * STRIDE + i % BL] = flat[i];
        assert_int_equal(ds_argmax_blocks(split, STRIDE, BL, N), ds_argmax(flat, N));
    }
    for (int i = 0; i < N; i++) flat[i] = NAN;
    for (int i = 0; i < N; i++) split[(i / BL) * STRIDE + i % BL] = flat[i];
    assert_int_equal(ds_argmax_blocks(split, STRIDE, BL, N), 0);
}

/* ---- router ---------------------------------------------------------------------------------- */

static float logit(double p) {
    return (float)log(p / (1.0 - p));
}

static void test_route_plain(void **state) {
    (void)state;
    /* scores s = sigmoid(z) chosen directly */
    const double p[8] = {0.10, 0.70, 0.30, 0.90, 0.50, 0.20, 0.60, 0.40};
    float z[8];
    for (int e = 0; e < 8; e++) z[e] = logit(p[e]);
    int32_t idx[3];
    float w[3];
    ds_moe_route(idx, w, z, NULL, 8, 3, 1, 1, 1, 2.5f, 0);
    assert_int_equal(idx[0], 3);
    assert_int_equal(idx[1], 1);
    assert_int_equal(idx[2], 6);
    const double sum = 0.9 + 0.7 + 0.6;
    assert_float_equal(w[0], 0.9 / sum * 2.5, 1e-6);
    assert_float_equal(w[1], 0.7 / sum * 2.5, 1e-6);
    assert_float_equal(w[2], 0.6 / sum * 2.5, 1e-6);
    assert_float_equal(w[0] + w[1] + w[2], 2.5, 1e-6); /* weights sum to the scale */

    /* no renormalisation: the raw scores times the scale */
    ds_moe_route(idx, w, z, NULL, 8, 3, 1, 1, 0, 2.0f, 0);
    assert_float_equal(w[0], 1.8, 1e-6);
    assert_float_equal(w[2], 1.2, 1e-6);
    /* k = 1 never renormalises */
    ds_moe_route(idx, w, z, NULL, 8, 1, 1, 1, 1, 1.0f, 0);
    assert_int_equal(idx[0], 3);
    assert_float_equal(w[0], 0.9, 1e-6);

    /* ties go to the lower index */
    float flat[6] = {0.5f, 1.0f, 1.0f, 0.5f, 1.0f, 1.0f};
    int32_t ti[3];
    float tw[3];
    ds_moe_route(ti, tw, flat, NULL, 6, 3, 1, 1, 1, 1.0f, 0);
    assert_int_equal(ti[0], 1);
    assert_int_equal(ti[1], 2);
    assert_int_equal(ti[2], 4);
}

static void test_route_bias(void **state) {
    (void)state;
    const double p[6] = {0.80, 0.75, 0.10, 0.20, 0.70, 0.30};
    float z[6];
    for (int e = 0; e < 6; e++) z[e] = logit(p[e]);
    /* The bias lifts expert 2 (s + b = 0.9) above experts 1 and 4 but not above 0 (0.8 + 0.2). */
    const float bias[6] = {0.2f, 0.0f, 0.8f, 0.0f, 0.0f, 0.0f};
    int32_t idx[2];
    float w[2];
    ds_moe_route(idx, w, z, bias, 6, 2, 1, 1, 1, 1.0f, 0);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 2);
    /* ...but the combine weights are the unbiased scores 0.8 and 0.1. */
    assert_float_equal(w[0], 0.8 / 0.9, 1e-6);
    assert_float_equal(w[1], 0.1 / 0.9, 1e-6);

    /* HF-KL quirk: same selection, biased weights 1.0 and 0.9. */
    ds_moe_route(idx, w, z, bias, 6, 2, 1, 1, 1, 1.0f, 1);
    assert_int_equal(idx[0], 0);
    assert_int_equal(idx[1], 2);
    assert_float_equal(w[0], 1.0 / 1.9, 1e-6);
    assert_float_equal(w[1], 0.9 / 1.9, 1e-6);
}

static void test_route_groups(void **state) {
    (void)state;
    /* 4 groups of 2: g0 = {0.95, 0.05} (sum 1.00), g1 = {0.60, 0.55} (1.15),
     * g2 = {0.50, 0.52} (1.02), g3 = {0.10, 0.20} (0.30). With topk_group = 2, groups 1 and 2 stay:
     * expert 0 (the best single score) is masked. */
    const double p[8] = {0.95, 0.05, 0.60, 0.55, 0.50, 0.52, 0.10, 0.20};
    float z[8];
    for (int e = 0; e < 8; e++) z[e] = logit(p[e]);
    int32_t idx[3];
    float w[3];
    ds_moe_route(idx, w, z, NULL, 8, 3, 4, 2, 1, 1.0f, 0);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 3);
    assert_int_equal(idx[2], 5);
    assert_float_equal(w[0] + w[1] + w[2], 1.0, 1e-6);
    assert_float_equal(w[0], 0.60 / (0.60 + 0.55 + 0.52), 1e-6);
    /* Without grouping expert 0 wins. */
    ds_moe_route(idx, w, z, NULL, 8, 3, 1, 1, 1, 1.0f, 0);
    assert_int_equal(idx[0], 0);

    /* Negative biased scores: unbiased routing never picks a masked expert; the quirk fills masked
     * groups with 0, which beats every kept expert's negative s + b. */
    const float bias[8] = {-2, -2, -2, -2, -2, -2, -2, -2};
    ds_moe_route(idx, w, z, bias, 8, 3, 4, 2, 1, 1.0f, 0);
    assert_int_equal(idx[0], 2);
    assert_int_equal(idx[1], 3);
    assert_int_equal(idx[2], 5);
    ds_moe_route(idx, w, z, bias, 8, 3, 4, 2, 1, 1.0f, 1);
    assert_int_equal(idx[0], 0); /* masked experts 0, 1, 6, 7 all score 0: lowest indices first */
    assert_int_equal(idx[1], 1);
    assert_int_equal(idx[2], 6);
    /* their weights are the biased, unmasked s + b (negative), renormalised */
    const double q0 = 0.95 - 2, q1 = 0.05 - 2, q6 = 0.10 - 2, qs = q0 + q1 + q6;
    assert_float_equal(w[0], q0 / qs, 1e-5);
    assert_float_equal(w[2], q6 / qs, 1e-5);
}

/* Randomised check of the full rule against a float64 transcription of docs/model.md §5.3. */
static void test_route_random(void **state) {
    (void)state;
    ds_rng rng;
    ds_rng_seed(&rng, 16);
    enum { E = 64, K = 6, G = 8, TG = 3 };
    for (int it = 0; it < 50; it++) {
        float z[E], bias[E];
        for (int e = 0; e < E; e++) {
            z[e] = (float)(2.0 * ds_rng_normal(&rng));
            bias[e] = (float)(0.1 * ds_rng_normal(&rng));
        }
        double s[E], sel[E];
        for (int e = 0; e < E; e++) {
            s[e] = 1.0 / (1.0 + exp(-(double)z[e]));
            sel[e] = s[e] + bias[e];
        }
        double gs[G];
        for (int g = 0; g < G; g++) {
            double a = -1e300, b = -1e300;
            for (int e = g * (E / G); e < (g + 1) * (E / G); e++) {
                if (sel[e] > a) {
                    b = a;
                    a = sel[e];
                } else if (sel[e] > b) {
                    b = sel[e];
                }
            }
            gs[g] = a + b;
        }
        int keep[G] = {0};
        for (int r = 0; r < TG; r++) {
            int best = -1;
            for (int g = 0; g < G; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        int chosen[E] = {0}, ref_idx[K];
        double ref_w[K], sum = 0;
        for (int j = 0; j < K; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (keep[e / (E / G)] && !chosen[e] && (best < 0 || sel[e] > sel[best])) best = e;
            chosen[best] = 1;
            ref_idx[j] = best;
            ref_w[j] = s[best];
            sum += s[best];
        }
        int32_t idx[K];
        float w[K];
        ds_moe_route(idx, w, z, bias, E, K, G, TG, 1, 2.446f, 0);
        float wsum = 0;
        for (int j = 0; j < K; j++) {
            assert_int_equal(idx[j], ref_idx[j]);
            assert_float_equal(w[j], ref_w[j] / sum * 2.446, 1e-6);
            wsum += w[j];
        }
        assert_float_equal(wsum, 2.446, 1e-5);
        /* one group kept of one: grouped and plain top-k agree */
        int32_t i1[K], i2[K];
        float w1[K], w2[K];
        ds_moe_route(i1, w1, z, bias, E, K, 1, 1, 1, 1.0f, 0);
        ds_moe_route(i2, w2, z, bias, E, K, G, G, 1, 1.0f, 0);
        assert_memory_equal(i1, i2, sizeof i1);
        assert_memory_equal(w1, w2, sizeof w1);
    }
}

/* ---- AttnRes mix ----------------------------------------------------------------------------- */

static void test_attnres(void **state) {
    (void)state;
    ds_isa isas[3];
    int nisa = supported_isas(isas);
    ds_rng rng;
    ds_rng_seed(&rng, 17);
    for (int ii = 0; ii < nisa; ii++) {
        ds_kernels_force_isa(isas[ii]);
        /* One candidate: the identity, bit for bit. */
        const int T = 3, D = 37;
        float *c0 = rand_vec(&rng, (size_t)T * D, 5.0), *np = rand_vec(&rng, (size_t)D, 1.0);
        float *out = malloc((size_t)T * D * sizeof(float));
        const float *one[1] = {c0};
        ds_attnres_mix(out, one, 1, np, T, D, 1e-5f);
        assert_memory_equal(out, c0, (size_t)T * D * sizeof(float));

        /* Two candidates by hand, eps = 0, np = (1, 1):
         * V0 = (1, 1): rms 1, score 2.  V1 = (2, 0): rms sqrt(2), score 2/sqrt(2) = sqrt(2).
         * alpha0 = 1 / (1 + e^(sqrt(2) - 2)) = 0.642398...; out = (alpha0 + 2 alpha1, alpha0). */
        const float v0[2] = {1, 1}, v1[2] = {2, 0}, np2[2] = {1, 1};
        const float *two[2] = {v0, v1};
        float o2[2];
        ds_attnres_mix(o2, two, 2, np2, 1, 2, 0.0f);
        const double a0 = 1.0 / (1.0 + exp(sqrt(2.0) - 2.0));
        assert_float_equal(a0, 0.6423983, 1e-6);
        assert_float_equal(o2[0], a0 + 2.0 * (1.0 - a0), 1e-6);
        assert_float_equal(o2[1], a0, 1e-6);

        /* Random, three candidates of different scales, against float64. */
        float *c1 = rand_vec(&rng, (size_t)T * D, 0.5), *c2 = rand_vec(&rng, (size_t)T * D, 2.0);
        const float *three[3] = {c0, c1, c2};
        const float eps = 1e-5f;
        double *ref = malloc((size_t)T * D * sizeof(double));
        for (int t = 0; t < T; t++) {
            double sc[3], mx = -1e300, sum = 0;
            for (int j = 0; j < 3; j++) {
                const float *v = three[j] + t * D;
                double ss = 0, dp = 0;
                for (int d = 0; d < D; d++) {
                    ss += (double)v[d] * v[d];
                    dp += (double)v[d] * np[d];
                }
                sc[j] = dp / sqrt(ss / D + eps);
                if (sc[j] > mx) mx = sc[j];
            }
            for (int j = 0; j < 3; j++) sum += exp(sc[j] - mx);
            for (int d = 0; d < D; d++) {
                double acc = 0;
                for (int j = 0; j < 3; j++) acc += exp(sc[j] - mx) / sum * three[j][t * D + d];
                ref[t * D + d] = acc;
            }
        }
        ds_attnres_mix(out, three, 3, np, T, D, eps);
        CHECK_REL(out, ref, (size_t)T * D, 1e-5, "attnres %s: %g", ds_isa_name(isas[ii]));
        free(c0);
        free(c1);
        free(c2);
        free(np);
        free(out);
        free(ref);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_l2norm_heads),
        cmocka_unit_test(test_gated_rmsnorm_heads),
        cmocka_unit_test(test_add_axpy),
        cmocka_unit_test(test_activations),
        cmocka_unit_test(test_argmax),
        cmocka_unit_test(test_argmax_blocks),
        cmocka_unit_test(test_route_plain),
        cmocka_unit_test(test_route_bias),
        cmocka_unit_test(test_route_groups),
        cmocka_unit_test(test_route_random),
        cmocka_unit_test(test_attnres),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
