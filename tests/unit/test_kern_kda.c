/* test_kern_kda.c — the KDA kernels (short conv, forget gate, recurrence, chunked form) against
 * plain float64 references written here from docs/model.md §3. */
#include "testutil.h"

#include "kernels/cpu/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-5

static float *fvec(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    assert_non_null(p);
    return p;
}
static double *dvec(size_t n) {
    double *p = calloc(n ? n : 1, sizeof(double));
    assert_non_null(p);
    return p;
}
static void fill_uniform(ds_rng *r, float *x, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(lo + (hi - lo) * ds_rng_uniform(r));
}
static void fill_normal(ds_rng *r, float *x, size_t n, double sd) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(sd * ds_rng_normal(r));
}

/* ---- short conv -------------------------------------------------------------------------------
 */

/* out[t] = silu(Σ_j w[c][j] x[t-W+1+j]) over the sequence tail0 ++ in (tail0: [W-1][C]). */
static void ref_conv(double *out, const float *in, const float *tail0, int T, int C, const float *w,
                     int W) {
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) {
            double u = 0;
            for (int j = 0; j < W; j++) {
                int src = t - (W - 1) + j;
                double x =
                    src >= 0 ? in[(size_t)src * C + c] : tail0[(size_t)(W - 1 + src) * C + c];
                u += (double)w[(size_t)c * W + j] * x;
            }
            out[(size_t)t * C + c] = u / (1 + exp(-u));
        }
}

/* For every split point s, conv(in[0:s]) then conv(in[s:T]) with the carried tail equals the
 * reference over the whole sequence, and the final tail is the last W-1 inputs. Also one token at
 * a time. */
static void check_conv(int T, int C, int W, int zero_tail, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    const int Wm = W - 1;
    float *in = fvec((size_t)T * C), *w = fvec((size_t)C * W), *tail0 = fvec((size_t)Wm * C);
    float *tail = fvec((size_t)Wm * C), *out = fvec((size_t)T * C);
    double *ref = dvec((size_t)T * C);
    fill_normal(&r, in, (size_t)T * C, 1.5);
    fill_normal(&r, w, (size_t)C * W, 0.7);
    if (!zero_tail) fill_normal(&r, tail0, (size_t)Wm * C, 1.5);
    ref_conv(ref, in, tail0, T, C, w, W);
    /* The expected final tail: the last W-1 rows of tail0 ++ in. */
    float *want_tail = fvec((size_t)Wm * C);
    for (int i = 0; i < Wm; i++) {
        int src = T - Wm + i;
        memcpy(want_tail + (size_t)i * C,
               src >= 0 ? in + (size_t)src * C : tail0 + (size_t)(Wm + src) * C,
               sizeof(float) * (size_t)C);
    }
    for (int s = 0; s <= T; s++) {
        memcpy(tail, tail0, sizeof(float) * (size_t)Wm * C);
        memset(out, 0xff, sizeof(float) * (size_t)T * C); /* NaN: every output must be written */
        ds_short_conv_silu(out, in, s, C, w, W, tail);
        ds_short_conv_silu(out + (size_t)s * C, in + (size_t)s * C, T - s, C, w, W, tail);
        double err = ds_test_rel_err(out, ref, (size_t)T * C);
        if (err > TOL) fail_msg("conv T=%d C=%d W=%d split %d: rel err %.3g", T, C, W, s, err);
        assert_memory_equal(tail, want_tail, sizeof(float) * (size_t)Wm * C);
    }
    memcpy(tail, tail0, sizeof(float) * (size_t)Wm * C);
    for (int t = 0; t < T; t++)
        ds_short_conv_silu(out + (size_t)t * C, in + (size_t)t * C, 1, C, w, W, tail);
    assert_true(ds_test_rel_err(out, ref, (size_t)T * C) <= TOL);
    assert_memory_equal(tail, want_tail, sizeof(float) * (size_t)Wm * C);
    free(in), free(w), free(tail0), free(tail), free(out), free(ref), free(want_tail);
}

static void test_conv_carried_tail(void **state) {
    (void)state;
    check_conv(9, 70, 4, 1, 1);   /* two channel tiles (64 + 6), a fresh sequence */
    check_conv(9, 70, 4, 0, 2);   /* resuming a sequence */
    check_conv(6, 5, 1, 0, 3);    /* W = 1: no tail at all */
    check_conv(9, 33, 20, 0, 4);  /* W - 1 > T and more taps than one tap tile */
    check_conv(40, 130, 4, 0, 5); /* enough work for the parallel path */
}

/* ---- forget gate ------------------------------------------------------------------------------
 */

static double softplus_d(double x) {
    return x > 30 ? x + log1p(exp(-x)) : log1p(exp(x));
}

static void test_gate_forms(void **state) {
    (void)state;
    enum { T = 3, H = 2, DK = 24 };
    ds_rng r;
    ds_rng_seed(&r, 11);
    float f[T * H * DK], bias[H * DK], A_log[H] = {-0.7f, 1.3f}, g[T * H * DK];
    fill_normal(&r, f, T * H * DK, 3.0);
    fill_normal(&r, bias, H * DK, 1.0);
    /* Large arguments on both sides: softplus must neither overflow nor lose its linear part. */
    const float big[] = {25.0f, -25.0f, 60.0f, -60.0f, 100.0f, -100.0f, 88.0f, 89.5f, -0.0f, 20.0f};
    for (size_t i = 0; i < DS_ARRAY_LEN(big); i++) f[i * 5] = big[i];
    for (int form = 0; form < 2; form++) {
        const float lb = -5.0f;
        ds_kda_gate(g, f, T, H, DK, A_log, bias, form, lb);
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++)
                for (int c = 0; c < DK; c++) {
                    size_t i = ((size_t)t * H + h) * DK + c;
                    double a = exp((double)A_log[h]), x = (double)f[i] + bias[h * DK + c];
                    double want = form ? lb / (1 + exp(-a * x)) : -a * softplus_d(x);
                    double err = fabs(g[i] - want);
                    if (!(err <= TOL * fabs(want) + 1e-30))
                        fail_msg("gate form %d at %zu (x=%g): got %.9g want %.9g", form, i, x,
                                 (double)g[i], want);
                    assert_true(g[i] <= 0.0f);
                    if (form) assert_true(g[i] >= lb);
                }
    }
}

/* ---- recurrence references --------------------------------------------------------------------
 */

typedef struct kda_case {
    int T, H, dk, dv;
    float *q, *k, *v, *g, *beta, *S0; /* [T][H][dk] x3 (v: dv), [T][H], [H][dk][dv] */
} kda_case;

enum { GATE_MILD, GATE_STRONG, GATE_EXTREME };

/* Inputs as the layer makes them: L2-normalised k and q, q scaled by dk^-1/2, beta in (0,1),
 * g <= 0, and a nonzero incoming state. */
static kda_case make_case(int T, int H, int dk, int dv, int gate, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    kda_case c = {T, H, dk, dv, NULL, NULL, NULL, NULL, NULL, NULL};
    size_t nk = (size_t)T * H * dk;
    c.q = fvec(nk), c.k = fvec(nk), c.g = fvec(nk), c.v = fvec((size_t)T * H * dv);
    c.beta = fvec((size_t)T * H), c.S0 = fvec((size_t)H * dk * dv);
    fill_normal(&r, c.q, nk, 1.0);
    fill_normal(&r, c.k, nk, 1.0);
    fill_normal(&r, c.v, (size_t)T * H * dv, 1.0);
    fill_normal(&r, c.S0, (size_t)H * dk * dv, 0.5);
    for (size_t i = 0; i < (size_t)T * H; i++)
        c.beta[i] = (float)(1 / (1 + exp(-ds_rng_normal(&r))));
    for (size_t i = 0; i < (size_t)T * H; i++) {
        double sq = 0, sk = 0;
        for (int x = 0; x < dk; x++)
            sq += c.q[i * dk + x] * c.q[i * dk + x], sk += c.k[i * dk + x] * c.k[i * dk + x];
        for (int x = 0; x < dk; x++) {
            c.q[i * dk + x] = (float)(c.q[i * dk + x] / sqrt(sq + 1e-6) / sqrt((double)dk));
            c.k[i * dk + x] = (float)(c.k[i * dk + x] / sqrt(sk + 1e-6));
        }
    }
    /* mild: Kimi-Linear-like slow decay; strong: K3's lower-bound gate, down to -5 per step;
     * extreme: every step near -5, so a 64-token chunk's cumulative decay reaches about -300. */
    double lo = gate == GATE_MILD ? -0.05 : gate == GATE_STRONG ? -5.0 : -5.0;
    double hi = gate == GATE_MILD ? 0.0 : gate == GATE_STRONG ? 0.0 : -4.0;
    fill_uniform(&r, c.g, nk, lo, hi);
    return c;
}

static void free_case(kda_case *c) {
    free(c->q), free(c->k), free(c->v), free(c->g), free(c->beta), free(c->S0);
}

/* docs/model.md §3.4 in float64. S: [H][dk][dv] in/out; S_rows (optional): [T][H][dk][dv]. */
static void ref_recurrent(double *o, double *S, double *S_rows, const kda_case *c) {
    const int H = c->H, dk = c->dk, dv = c->dv;
    double *e = dvec((size_t)dv);
    for (int t = 0; t < c->T; t++)
        for (int h = 0; h < H; h++) {
            size_t th = (size_t)t * H + h;
            double *Sh = S + (size_t)h * dk * dv;
            const float *q = c->q + th * dk, *k = c->k + th * dk, *g = c->g + th * dk;
            for (int i = 0; i < dk; i++)
                for (int x = 0; x < dv; x++) Sh[(size_t)i * dv + x] *= exp((double)g[i]);
            for (int x = 0; x < dv; x++) {
                double s = 0;
                for (int i = 0; i < dk; i++) s += k[i] * Sh[(size_t)i * dv + x];
                e[x] = c->v[th * dv + x] - s;
            }
            for (int i = 0; i < dk; i++)
                for (int x = 0; x < dv; x++) Sh[(size_t)i * dv + x] += c->beta[th] * k[i] * e[x];
            for (int x = 0; x < dv; x++) {
                double s = 0;
                for (int i = 0; i < dk; i++) s += q[i] * Sh[(size_t)i * dv + x];
                o[th * dv + x] = s;
            }
            if (S_rows) memcpy(S_rows + th * dk * dv, Sh, sizeof(double) * (size_t)dk * dv);
        }
    free(e);
}

static double *ref_state0(const kda_case *c) {
    size_t n = (size_t)c->H * c->dk * c->dv;
    double *S = dvec(n);
    for (size_t i = 0; i < n; i++) S[i] = c->S0[i];
    return S;
}

/* ---- recurrent --------------------------------------------------------------------------------
 */

static void check_recurrent(int T, int H, int dk, int dv, int gate, uint64_t seed) {
    kda_case c = make_case(T, H, dk, dv, gate, seed);
    size_t ns = (size_t)H * dk * dv, no = (size_t)T * H * dv;
    double *Sref = ref_state0(&c), *oref = dvec(no);
    ref_recurrent(oref, Sref, NULL, &c);
    float *S = fvec(ns), *o = fvec(no);
    memcpy(S, c.S0, sizeof(float) * ns);
    ds_kda_recurrent(o, c.q, c.k, c.v, c.g, c.beta, S, NULL, T, H, dk, dv);
    double eo = ds_test_rel_err(o, oref, no), es = ds_test_rel_err(S, Sref, ns);
    if (eo > TOL || es > TOL)
        fail_msg("recurrent T=%d H=%d dk=%d dv=%d gate=%d: o err %.3g, S err %.3g", T, H, dk, dv,
                 gate, eo, es);
    free(Sref), free(oref), free(S), free(o), free_case(&c);
}

static void test_recurrent_vs_reference(void **state) {
    (void)state;
    for (int gate = GATE_MILD; gate <= GATE_EXTREME; gate++) {
        check_recurrent(37, 3, 16, 40, gate, 100 + gate);  /* one full and one narrow block */
        check_recurrent(9, 2, 128, 128, gate, 110 + gate); /* production head size */
    }
    check_recurrent(1, 1, 8, 5, GATE_STRONG, 120);
}

/* T single-token steps with the carried state give bit-for-bit the one T-token call, and S_rows[t]
 * is the state after t+1 tokens. */
static void test_recurrent_steps_and_rows(void **state) {
    (void)state;
    const int T = 23, H = 3, dk = 16, dv = 40;
    kda_case c = make_case(T, H, dk, dv, GATE_STRONG, 200);
    size_t ns = (size_t)H * dk * dv, no = (size_t)T * H * dv;
    float *S1 = fvec(ns), *S2 = fvec(ns), *S3 = fvec(ns), *o1 = fvec(no), *o2 = fvec(no),
          *o3 = fvec(no), *rows = fvec((size_t)T * ns);
    memcpy(S1, c.S0, sizeof(float) * ns);
    memcpy(S2, c.S0, sizeof(float) * ns);
    memcpy(S3, c.S0, sizeof(float) * ns);
    ds_kda_recurrent(o1, c.q, c.k, c.v, c.g, c.beta, S1, NULL, T, H, dk, dv);
    for (int t = 0; t < T; t++) {
        size_t a = (size_t)t * H;
        ds_kda_recurrent(o2 + a * dv, c.q + a * dk, c.k + a * dk, c.v + a * dv, c.g + a * dk,
                         c.beta + a, S2, NULL, 1, H, dk, dv);
    }
    assert_memory_equal(o1, o2, sizeof(float) * no);
    assert_memory_equal(S1, S2, sizeof(float) * ns);

    ds_kda_recurrent(o3, c.q, c.k, c.v, c.g, c.beta, S3, rows, T, H, dk, dv);
    assert_memory_equal(o1, o3, sizeof(float) * no);
    assert_memory_equal(S1, S3, sizeof(float) * ns);
    assert_memory_equal(rows + (size_t)(T - 1) * ns, S1, sizeof(float) * ns);
    double *Sref = ref_state0(&c), *oref = dvec(no), *rref = dvec((size_t)T * ns);
    ref_recurrent(oref, Sref, rref, &c);
    for (int t = 0; t < T; t++) {
        double err = ds_test_rel_err(rows + (size_t)t * ns, rref + (size_t)t * ns, ns);
        if (err > TOL) fail_msg("S_rows[%d]: rel err %.3g", t, err);
    }
    /* Rolling back to row t and replaying the rest reproduces the full run. */
    const int t_back = 9;
    float *S4 = fvec(ns), *o4 = fvec(no);
    memcpy(S4, rows + (size_t)t_back * ns, sizeof(float) * ns);
    size_t a = (size_t)(t_back + 1) * H;
    ds_kda_recurrent(o4, c.q + a * dk, c.k + a * dk, c.v + a * dv, c.g + a * dk, c.beta + a, S4,
                     NULL, T - t_back - 1, H, dk, dv);
    assert_memory_equal(S4, S1, sizeof(float) * ns);
    assert_memory_equal(o4, o1 + a * dv, sizeof(float) * (no - a * dv));
    free(S1), free(S2), free(S3), free(S4), free(o1), free(o2), free(o3), free(o4), free(rows);
    free(Sref), free(oref), free(rref), free_case(&c);
}

/* ---- chunked ----------------------------------------------------------------------------------
 */

static void check_chunked(int T, int H, int dk, int dv, int chunk, int gate, uint64_t seed) {
    kda_case c = make_case(T, H, dk, dv, gate, seed);
    size_t ns = (size_t)H * dk * dv, no = (size_t)T * H * dv;
    double *Sref = ref_state0(&c), *oref = dvec(no);
    ref_recurrent(oref, Sref, NULL, &c);
    float *S = fvec(ns), *o = fvec(no);
    memcpy(S, c.S0, sizeof(float) * ns);
    memset(o, 0xff, sizeof(float) * no); /* NaN: every output must be written */
    ds_kda_chunked(o, c.q, c.k, c.v, c.g, c.beta, S, T, H, dk, dv, chunk);
    double eo = ds_test_rel_err(o, oref, no), es = ds_test_rel_err(S, Sref, ns);
    if (eo > TOL || es > TOL)
        fail_msg("chunked T=%d H=%d dk=%d dv=%d C=%d gate=%d: o err %.3g, S err %.3g", T, H, dk, dv,
                 chunk, gate, eo, es);
    free(Sref), free(oref), free(S), free(o), free_case(&c);
}

static void test_chunked_vs_recurrence(void **state) {
    (void)state;
    const int Ts[] = {1, 2, 63, 64, 65, 127, 128, 129, 200};
    const int chunks[] = {64, 16};
    for (size_t i = 0; i < DS_ARRAY_LEN(Ts); i++)
        for (size_t j = 0; j < DS_ARRAY_LEN(chunks); j++)
            for (int gate = GATE_MILD; gate <= GATE_EXTREME; gate++)
                check_chunked(Ts[i], 2, 32, 48, chunks[j], gate, 1000 + 31 * i + 7 * j + gate);
}

static void test_chunked_shapes(void **state) {
    (void)state;
    for (int gate = GATE_MILD; gate <= GATE_EXTREME; gate++)
        check_chunked(200, 2, 128, 128, 64, gate, 2000 + gate); /* production head size */
    check_chunked(50, 3, 16, 8, 1, GATE_STRONG, 2010);          /* chunk of one token */
    check_chunked(50, 3, 16, 8, 7, GATE_MILD, 2011);            /* odd chunk, narrow value block */
    check_chunked(30, 1, 24, 70, 100, GATE_STRONG, 2012);       /* chunk longer than T */
}

/* Two chunked calls with the carried state equal one call (the prefill-in-pieces path). */
static void test_chunked_in_pieces(void **state) {
    (void)state;
    const int T = 150, H = 2, dk = 32, dv = 64, cut = 77;
    kda_case c = make_case(T, H, dk, dv, GATE_STRONG, 3000);
    size_t ns = (size_t)H * dk * dv, no = (size_t)T * H * dv;
    double *Sref = ref_state0(&c), *oref = dvec(no);
    ref_recurrent(oref, Sref, NULL, &c);
    float *S = fvec(ns), *o = fvec(no);
    memcpy(S, c.S0, sizeof(float) * ns);
    ds_kda_chunked(o, c.q, c.k, c.v, c.g, c.beta, S, cut, H, dk, dv, 64);
    size_t a = (size_t)cut * H;
    ds_kda_chunked(o + a * dv, c.q + a * dk, c.k + a * dk, c.v + a * dv, c.g + a * dk, c.beta + a,
                   S, T - cut, H, dk, dv, 64);
    assert_true(ds_test_rel_err(o, oref, no) <= TOL);
    assert_true(ds_test_rel_err(S, Sref, ns) <= TOL);
    free(Sref), free(oref), free(S), free(o), free_case(&c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conv_carried_tail),
        cmocka_unit_test(test_gate_forms),
        cmocka_unit_test(test_recurrent_vs_reference),
        cmocka_unit_test(test_recurrent_steps_and_rows),
        cmocka_unit_test(test_chunked_vs_recurrence),
        cmocka_unit_test(test_chunked_shapes),
        cmocka_unit_test(test_chunked_in_pieces),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
