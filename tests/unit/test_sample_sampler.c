/* test_sample_sampler.c — the sampler against hand-worked cases, double-precision references and
 * chi-square bounds on seeded draws (fixed seeds: each bound either holds or the code is wrong;
 * the critical values are the 0.1% tails). */
#include "testutil.h"

#include "draw_rows.h"

#include "sample/sampler.h"
#include "kernels/cpu/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static ds_sample_params params(float t, float top_p, int top_k, float min_p) {
    ds_sample_params p;
    ds_sample_params_default(&p);
    p.temperature = t;
    p.top_p = top_p;
    p.top_k = top_k;
    p.min_p = min_p;
    return p;
}

static ds_sample_scratch *scratch_for(int V) {
    ds_err err = {{0}};
    ds_sample_scratch *s = ds_sample_scratch_new(V, &err);
    if (!s) fail_msg("%s", err.msg);
    return s;
}

/* One plain draw: no counts, stops or logprobs; logits are copied so the caller's stay raw. */
static int32_t draw1(const float *logits, int V, const ds_sample_params *p, ds_rng *rng,
                     ds_sample_scratch *s, float *work) {
    memcpy(work, logits, (size_t)V * sizeof(float));
    return ds_sample_token(work, V, p, NULL, 1, NULL, 0, rng, s, NULL, 0);
}

/* counts[V] of n draws with one seed. */
static void histogram(const float *logits, int V, const ds_sample_params *p, uint64_t seed, int n,
                      int *counts) {
    ds_sample_scratch *s = scratch_for(V);
    float *work = malloc((size_t)V * sizeof(float));
    ds_rng rng;
    ds_rng_seed(&rng, seed);
    memset(counts, 0, (size_t)V * sizeof(int));
    for (int i = 0; i < n; i++) {
        int32_t t = draw1(logits, V, p, &rng, s, work);
        assert_true(t >= 0 && t < V);
        counts[t]++;
    }
    free(work);
    ds_sample_scratch_free(s);
}

/* Pearson chi-square of counts against probs (which need not be normalised); a token of
 * probability 0 that was drawn fails at once. *df: categories - 1. */
static double chi_square(const int *counts, const double *probs, int V, int n, int *df) {
    double z = 0, chi = 0;
    for (int i = 0; i < V; i++) z += probs[i];
    *df = -1;
    for (int i = 0; i < V; i++) {
        if (probs[i] == 0) {
            if (counts[i])
                fail_msg("token %d has probability 0 but was drawn %d times", i, counts[i]);
            continue;
        }
        double e = n * probs[i] / z;
        chi += (counts[i] - e) * (counts[i] - e) / e;
        (*df)++;
    }
    return chi;
}

/* The 0.999 quantile of chi-square with df degrees of freedom (regularised incomplete gamma,
 * solved by bisection), for the df these tests use. */
static double chi_crit(int df) {
    static const double q[] = {0,     10.83, 13.82, 16.27, 18.47, 20.52, 22.46,
                               24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
                               36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31};
    if (df < 1 || df >= (int)DS_ARRAY_LEN(q)) fail_msg("no critical value for df %d", df);
    return q[df];
}

static void softmax_d(const float *logits, int V, double t, double *out) {
    double mx = -INFINITY, z = 0;
    for (int i = 0; i < V; i++) mx = fmax(mx, logits[i]);
    for (int i = 0; i < V; i++) z += out[i] = exp((logits[i] - mx) / t);
    for (int i = 0; i < V; i++) out[i] /= z;
}

/* ---- greedy ------------------------------------------------------------------------------------
 */

static void test_greedy_ties(void **state) {
    (void)state;
    const float l[6] = {0.5f, 2.0f, 1.0f, 2.0f, -1.0f, 2.0f};
    ds_sample_scratch *s = scratch_for(6);
    float work[6];
    ds_rng rng, before;
    ds_rng_seed(&rng, 5);
    before = rng;
    ds_sample_params p = params(0.0f, 1.0f, 0, 0.0f);
    assert_int_equal(draw1(l, 6, &p, &rng, s, work), 1);
    /* Greedy draws nothing, so a request's later random draws do not depend on earlier greedy
     * steps' count. */
    assert_memory_equal(&rng, &before, sizeof rng);
    /* top_k = 1 orders ties by id as greedy does, whatever the temperature. */
    p = params(1.5f, 1.0f, 1, 0.0f);
    for (int i = 0; i < 50; i++) assert_int_equal(draw1(l, 6, &p, &rng, s, work), 1);
    ds_sample_scratch_free(s);
}

static void test_top_k_one_is_greedy(void **state) {
    (void)state;
    enum { V = 1000 };
    float l[V], work[V];
    ds_rng rng;
    ds_rng_seed(&rng, 77);
    ds_sample_scratch *s = scratch_for(V);
    for (int trial = 0; trial < 20; trial++) {
        int best = 0;
        for (int i = 0; i < V; i++) {
            l[i] = (float)(2.0 * ds_rng_normal(&rng));
            if (l[i] > l[best]) best = i;
        }
        ds_sample_params p = params(1.3f, 1.0f, 1, 0.0f);
        assert_int_equal(draw1(l, V, &p, &rng, s, work), best);
        p = params(0.0f, 1.0f, 0, 0.0f);
        assert_int_equal(draw1(l, V, &p, &rng, s, work), best);
    }
    ds_sample_scratch_free(s);
}

/* ---- the distribution --------------------------------------------------------------------------
 */

static void test_temperature_frequencies(void **state) {
    (void)state;
    enum { V = 8, N = 20000 };
    const float l[V] = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, 1.5f, -1.0f, 0.7f};
    int counts[V], df;
    double want[V];
    for (int ti = 0; ti < 2; ti++) {
        const float t = ti ? 1.0f : 0.7f;
        ds_sample_params p = params(t, 1.0f, 0, 0.0f);
        histogram(l, V, &p, 1234 + ti, N, counts);
        softmax_d(l, V, t, want);
        double chi = chi_square(counts, want, V, N, &df);
        if (!(chi < chi_crit(df))) fail_msg("T %.1f: chi-square %.1f (df %d)", t, chi, df);
        /* The test can tell temperatures apart: against the other temperature it fails. */
        softmax_d(l, V, ti ? 0.7 : 1.0, want);
        assert_true(chi_square(counts, want, V, N, &df) > 100.0);
    }
}

/* probs written by hand, scattered over ids so that order in memory is not order of mass. */
static const double P6[6] = {0.06, 0.25, 0.04, 0.4, 0.1, 0.15}; /* by size: 3, 1, 5, 4, 0, 2 */

static void expect_kept(const ds_sample_params *p, const int *kept, int n_kept, uint64_t seed) {
    enum { V = 6, N = 20000 };
    float l[V];
    for (int i = 0; i < V; i++) l[i] = (float)log(P6[i]);
    int counts[V], df;
    double want[V] = {0};
    for (int j = 0; j < n_kept; j++) want[kept[j]] = P6[kept[j]];
    histogram(l, V, p, seed, N, counts);
    double chi = n_kept > 1 ? chi_square(counts, want, V, N, &df) : 0;
    if (n_kept == 1)
        assert_int_equal(counts[kept[0]], N);
    else if (!(chi < chi_crit(df)))
        fail_msg("chi-square %.1f (df %d)", chi, df);
}

static void test_top_p(void **state) {
    (void)state;
    /* 0.4 < 0.6 <= 0.4 + 0.25: the smallest prefix reaching 0.6 is {3, 1}. */
    ds_sample_params p = params(1.0f, 0.6f, 0, 0.0f);
    expect_kept(&p, (int[]){3, 1}, 2, 1);
    /* 0.65 < 0.7 <= 0.8: {3, 1, 5}. */
    p.top_p = 0.7f;
    expect_kept(&p, (int[]){3, 1, 5}, 3, 2);
    /* Below the first token's mass only it is left. */
    p.top_p = 0.3f;
    expect_kept(&p, (int[]){3}, 1, 3);
    /* With top_k = 3 the mass renormalises over 0.8: 0.5 < 0.78 <= 0.8125 keeps {3, 1}, where
     * top_p = 0.78 alone keeps three. */
    p = params(1.0f, 0.78f, 3, 0.0f);
    expect_kept(&p, (int[]){3, 1}, 2, 4);
    p.top_k = 0;
    expect_kept(&p, (int[]){3, 1, 5}, 3, 5);
    /* top_k alone. */
    p = params(1.0f, 1.0f, 4, 0.0f);
    expect_kept(&p, (int[]){3, 1, 5, 4}, 4, 6);
}

/* 64 tokens, more than the selection sorts directly, so its partitioning decides: the token of
 * rank r (0 = best) has weight 64 - r and sits at id 37 r mod 64. The weights of the top m sum to
 * 64 m - m (m - 1) / 2 out of 2080. */
static void test_top_p_partitioned(void **state) {
    (void)state;
    enum { V = 64, N = 20000 };
    float l[V];
    for (int r = 0; r < V; r++) l[(37 * r) % V] = (float)log(64.0 - r);
    struct {
        float top_p;
        int top_k, kept; /* in rank order */
    } cases[] = {
        {0.5f, 0, 19},   /* 999 < 1040 <= 1045 */
        {0.45f, 25, 10}, /* over the top 25's 1300: 540 < 585 <= 595 */
        {1.0f, 17, 17},
    };
    for (size_t c = 0; c < DS_ARRAY_LEN(cases); c++) {
        ds_sample_params p = params(1.0f, cases[c].top_p, cases[c].top_k, 0.0f);
        int counts[V], df;
        double want[V] = {0};
        for (int r = 0; r < cases[c].kept; r++) want[(37 * r) % V] = 64.0 - r;
        histogram(l, V, &p, 20 + c, N, counts);
        double chi = chi_square(counts, want, V, N, &df);
        if (!(chi < chi_crit(df))) fail_msg("case %zu: chi-square %.1f (df %d)", c, chi, df);
    }
}

static void test_min_p(void **state) {
    (void)state;
    /* min_p 0.2: floor 0.08 of p_max 0.4 keeps 0.4, 0.25, 0.15, 0.1. */
    ds_sample_params p = params(1.0f, 1.0f, 0, 0.2f);
    expect_kept(&p, (int[]){3, 1, 5, 4}, 4, 7);
    /* min_p 0.5: floor 0.2 keeps 0.4, 0.25. */
    p.min_p = 0.5f;
    expect_kept(&p, (int[]){3, 1}, 2, 8);
    /* After top_p 0.85 ({3, 1, 5, 4}), min_p 0.3 (floor 0.12) leaves {3, 1, 5}. */
    p = params(1.0f, 0.85f, 0, 0.3f);
    expect_kept(&p, (int[]){3, 1, 5}, 3, 9);
}

/* ---- a real vocabulary -------------------------------------------------------------------------
 */

enum { BIG_V = 163840 };

/* Orders ids by descending logit, ties by id (the sampler's order), for the references. */
static const float *g_key;
static int cmp_key(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (g_key[i] != g_key[j]) return g_key[i] > g_key[j] ? -1 : 1;
    return (i > j) - (i < j);
}

static int32_t *sorted_ids(const float *l, int V) {
    int32_t *ids = malloc((size_t)V * sizeof *ids);
    for (int i = 0; i < V; i++) ids[i] = i;
    g_key = l;
    qsort(ids, (size_t)V, sizeof *ids, cmp_key);
    return ids;
}

/* Marks in[V] the ids top-k / top-p keep, computed by a full sort in double. */
static int reference_kept(const float *l, int V, float t, int top_k, double top_p, char *in) {
    double *pr = malloc((size_t)V * sizeof *pr);
    softmax_d(l, V, t, pr);
    int32_t *ids = sorted_ids(l, V);
    int n = top_k > 0 ? top_k : V;
    double kept = 0, acc = 0;
    for (int j = 0; j < n; j++) kept += pr[ids[j]];
    int m = 0;
    while (m < n) {
        acc += pr[ids[m++]];
        if (acc >= top_p * kept) break;
    }
    memset(in, 0, (size_t)V);
    for (int j = 0; j < m; j++) in[ids[j]] = 1;
    free(ids);
    free(pr);
    return m;
}

static void check_membership(const float *l, float t, int top_k, double top_p, int n, uint64_t seed,
                             int min_kept, int max_kept) {
    n = DS_TEST_REPS(n);
    char *in = malloc(BIG_V);
    int m = reference_kept(l, BIG_V, t, top_k, top_p, in);
    if (m < min_kept || m > max_kept)
        fail_msg("reference keeps %d, test wants %d..%d", m, min_kept, max_kept);
    ds_sample_params p = params(t, (float)top_p, top_k, 0.0f);
    int *counts = malloc(BIG_V * sizeof(int));
    histogram(l, BIG_V, &p, seed, n, counts);
    int distinct = 0;
    for (int i = 0; i < BIG_V; i++) {
        if (counts[i] && !in[i])
            fail_msg("token %d drawn %d times, outside the kept set", i, counts[i]);
        distinct += counts[i] > 0;
    }
    /* The draws spread over the kept set rather than sticking to its top. */
    assert_true(distinct >= DS_MIN(m, n / 4) / 2);
    free(counts);
    free(in);
}

static void test_large_vocab_sets(void **state) {
    (void)state;
    float *l = malloc(BIG_V * sizeof(float));
    ds_rng rng;
    ds_rng_seed(&rng, 99);
    for (int i = 0; i < BIG_V; i++) l[i] = (float)ds_rng_normal(&rng);
    /* A peaked distribution: 12 scattered tokens far above a normal background. */
    float *peak = malloc(BIG_V * sizeof(float));
    memcpy(peak, l, BIG_V * sizeof(float));
    for (int j = 0; j < 12; j++) peak[(j * 40009 + 17) % BIG_V] = 12.0f + 0.1f * (float)j;
    check_membership(peak, 1.0f, 0, 0.9, 600, 1, 2, 12);
    check_membership(peak, 1.0f, 5, 0.99, 600, 2, 5, 5);
    /* Flat: top-p must keep a large part of the vocabulary, and top-k a middle-sized set. */
    check_membership(l, 1.0f, 0, 0.5, 300, 3, 20000, 100000);
    check_membership(l, 1.0f, 300, 1.0, 600, 4, 300, 300);
    check_membership(l, 0.5f, 2000, 0.7, 600, 5, 100, 2000);
    free(peak);
    free(l);
}

/* The real vocabulary size through every path (speed is measured by benchmarks, not here): each
 * draw is inside the vocabulary, and greedy equals the argmax. */
static void test_large_vocab(void **state) {
    (void)state;
    float *l = malloc(BIG_V * sizeof(float)), *work = malloc(BIG_V * sizeof(float));
    ds_rng rng;
    ds_rng_seed(&rng, 3);
    for (int i = 0; i < BIG_V; i++) l[i] = (float)(2.0 * ds_rng_normal(&rng));
    ds_sample_scratch *s = scratch_for(BIG_V);
    const ds_sample_params cases[] = {params(1.0f, 1.0f, 0, 0.0f),   params(1.0f, 0.95f, 0, 0.0f),
                                      params(1.5f, 0.999f, 0, 0.0f), params(0.7f, 1.0f, 50, 0.0f),
                                      params(1.0f, 0.9f, 50, 0.05f), params(0.0f, 1.0f, 0, 0.0f)};
    for (size_t c = 0; c < DS_ARRAY_LEN(cases); c++) {
        enum { N = 40 };
        ds_logprobs_out lp;
        for (int i = 0; i < N; i++) {
            memcpy(work, l, BIG_V * sizeof(float));
            int32_t t = ds_sample_token(work, BIG_V, &cases[c], NULL, 1, NULL, 0, &rng, s, &lp, 20);
            assert_true(t >= 0 && t < BIG_V);
            if (cases[c].temperature == 0.0f) assert_int_equal(t, ds_argmax(l, BIG_V));
        }
    }
    ds_sample_scratch_free(s);
    free(work);
    free(l);
}

/* ---- the exact definition ------------------------------------------------------------------
 * ds_sample_row's token is defined exactly (sampler.h), so that a GPU computing the same returns
 * the same token. The reference below is that definition done the slow way — a full sort of the
 * candidates, prefix sums in order — against the histogram and quickselect of the sampler, on
 * rows with many equal logits (ties decided by id), NaN, -inf and uniforms at both ends. */

static uint64_t ref_mass(float w) {
    return (uint64_t)(int64_t)(w * 0x1p40f);
}

static int32_t reference_draw(const float *x, int V, const ds_sample_params *p, double u) {
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (x[i] > mx) mx = x[i];
    if (!(mx > -INFINITY) || mx == INFINITY || !(p->temperature >= 1e-5f)) return ds_argmax(x, V);
    float *w = malloc((size_t)V * sizeof *w);
    ds_sample_weights(w, x, V, mx, 1.0f / p->temperature);
    int32_t *ids = malloc((size_t)V * sizeof *ids); /* the candidates: ids with mass (no NaN) */
    int n = 0;
    for (int i = 0; i < V; i++)
        if (ref_mass(w[i]) > 0) ids[n++] = i;
    g_key = x;
    qsort(ids, (size_t)n, sizeof *ids, cmp_key);
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;
    if (p->top_p < 1.0f) {
        uint64_t kept = 0, acc = 0;
        for (int j = 0; j < n; j++) kept += ref_mass(w[ids[j]]);
        uint64_t goal = (uint64_t)((double)p->top_p * (double)kept);
        if (!goal) goal = 1;
        int m = 0;
        while (m < n && acc < goal) acc += ref_mass(w[ids[m++]]);
        n = m;
    }
    char *in = calloc((size_t)V, 1);
    float min_w = p->min_p > 0 ? DS_MIN(p->min_p, 1.0f) : 0.0f;
    for (int j = 0; j < n; j++) in[ids[j]] = w[ids[j]] >= min_w;
    uint64_t S = 0, acc = 0;
    for (int i = 0; i < V; i++) S += in[i] ? ref_mass(w[i]) : 0;
    uint64_t r = (uint64_t)(u * (double)S);
    if (r >= S) r = S - 1;
    int32_t tok = -1;
    for (int i = 0; i < V && tok < 0; i++)
        if (in[i] && r < (acc += ref_mass(w[i]))) tok = i;
    free(in);
    free(ids);
    free(w);
    return tok;
}

static void test_row_draw_exact(void **state) {
    (void)state;
    enum { V = 6000 };
    float *x = malloc(V * sizeof(float)), *work = malloc(V * sizeof(float));
    ds_sample_scratch *s = scratch_for(V);
    ds_rng rng;
    ds_rng_seed(&rng, 41);
    const ds_sample_params cases[] = {
        params(1.0f, 1.0f, 0, 0.0f),  params(0.8f, 0.9f, 0, 0.0f),   params(1.0f, 0.5f, 0, 0.0f),
        params(1.3f, 1.0f, 40, 0.0f), params(1.0f, 0.7f, 300, 0.0f), params(0.6f, 0.95f, 0, 0.05f),
        params(1.0f, 1.0f, 0, 0.3f),  params(2.0f, 0.999f, 7, 0.0f), params(1.0f, 0.0f, 0, 0.0f),
        params(0.05f, 0.9f, 0, 0.0f),
    };
    const double us[] = {0.0, 0.5, 0.999999, 1.0 - 0x1p-53};
    int n_checked = 0, distinct_tok = 0, last_tok = -1;
    for (int shape = 0; shape < DRAW_ROW_SHAPES; shape++) {
        draw_row_fill(x, V, shape, &rng);
        for (size_t c = 0; c < DS_ARRAY_LEN(cases); c++)
            for (int k = 0; k < 12; k++) {
                double u = k < 4 ? us[k] : ds_rng_uniform(&rng);
                ds_row_draw d = {cases[c], u, NULL, 0, NULL, 0, NULL, 0};
                memcpy(work, x, V * sizeof(float));
                int32_t got = ds_sample_row(work, V, &d, s),
                        want = reference_draw(x, V, &cases[c], u);
                if (got != want)
                    fail_msg("shape %d case %zu u %.17g: sampler %d, definition %d", shape, c, u,
                             got, want);
                n_checked++;
                distinct_tok += got != last_tok;
                last_tok = got;
            }
    }
    assert_true(n_checked == DRAW_ROW_SHAPES * (int)DS_ARRAY_LEN(cases) * 12);
    assert_true(distinct_tok > n_checked / 4); /* the cases do not all collapse on one token */
    free(work);
    free(x);
    ds_sample_scratch_free(s);
}

/* The row form with counts and a mask is ds_sample_token's edits: the same token for the same
 * uniform, and the same edited logits. */
static void test_row_draw_edits(void **state) {
    (void)state;
    enum { V = 500 };
    float x[V], a[V], b[V];
    ds_rng rng, r2;
    ds_rng_seed(&rng, 5);
    for (int i = 0; i < V; i++) x[i] = (float)ds_rng_normal(&rng);
    ds_token_counts c = {0};
    for (int i = 0; i < 40; i++) ds_token_counts_add(&c, (i * 37) % 61);
    const int32_t stops[] = {3, 17, 17, 499};
    ds_sample_scratch *s = scratch_for(V);
    for (int t = 0; t < 3; t++) {
        ds_sample_params p = params(t == 0 ? 0.0f : 0.9f, t == 2 ? 0.8f : 1.0f, 0, 0.0f);
        p.presence_penalty = 0.7f;
        p.frequency_penalty = 0.35f;
        /* flat compact list of the counts, as the engine hands them to a GPU */
        ds_token_count flat[64];
        int n = 0;
        for (int i = 0; i < c.cap; i++)
            if (c.slots[i].id >= 0) flat[n++] = c.slots[i];
        for (int allow = 0; allow < 2; allow++) {
            ds_rng_seed(&r2, 77 + t);
            double u = ds_sample_draws_uniform(&p) ? ds_rng_uniform(&r2) : 0;
            ds_rng_seed(&r2, 77 + t);
            memcpy(a, x, sizeof x);
            memcpy(b, x, sizeof x);
            int32_t want = ds_sample_token(a, V, &p, &c, allow, stops, 4, &r2, s, NULL, 0);
            ds_row_draw d = {p, u, flat, n, stops, allow ? 0 : 4, NULL, 0};
            int32_t got = ds_sample_row(b, V, &d, s);
            assert_int_equal(got, want);
            assert_memory_equal(a, b, sizeof a);
            if (!allow) assert_true(b[17] == -INFINITY && got != 17);
            assert_true(b[0] < x[0]); /* id 0 was generated: penalised */
        }
    }
    ds_token_counts_free(&c);
    ds_sample_scratch_free(s);
}

/* ---- penalties, stops, logprobs ----------------------------------------------------------------
 */

static void test_token_counts(void **state) {
    (void)state;
    ds_err err = {{0}};
    ds_token_counts c;
    assert_int_equal(ds_token_counts_init(&c, &err), DS_OK);
    /* ids that share low bits, spread over the vocabulary, enough to grow the table twice. */
    for (int i = 0; i < 300; i++)
        for (int k = 0; k <= i % 3; k++) assert_int_equal(ds_token_counts_add(&c, i * 512), DS_OK);
    assert_int_equal(c.n, 300);
    for (int i = 0; i < 300; i++) assert_int_equal(ds_token_counts_get(&c, i * 512), i % 3 + 1);
    assert_int_equal(ds_token_counts_get(&c, 1), 0);
    assert_int_equal(ds_token_counts_get(&c, 163839), 0);
    assert_int_equal(ds_token_counts_add(&c, -4), DS_ERR);
    ds_token_counts_clear(&c);
    assert_int_equal(c.n, 0);
    assert_int_equal(ds_token_counts_get(&c, 512), 0);
    assert_int_equal(ds_token_counts_add(&c, 512), DS_OK);
    assert_int_equal(ds_token_counts_get(&c, 512), 1);
    ds_token_counts_free(&c);
    /* A zeroed map works without init. */
    ds_token_counts z = {0};
    assert_int_equal(ds_token_counts_get(&z, 3), 0);
    assert_int_equal(ds_token_counts_add(&z, 3), DS_OK);
    assert_int_equal(ds_token_counts_get(&z, 3), 1);
    ds_token_counts_free(&z);
}

static void test_penalties(void **state) {
    (void)state;
    ds_token_counts c = {0};
    for (int k = 0; k < 3; k++) ds_token_counts_add(&c, 0);
    ds_token_counts_add(&c, 1);
    ds_token_counts_add(&c, 3);
    ds_token_counts_add(&c, 3);
    ds_token_counts_add(&c, 99); /* beyond V: ignored */
    ds_sample_scratch *s = scratch_for(4);
    ds_rng rng;
    ds_rng_seed(&rng, 1);
    const float raw[4] = {2.0f, 1.8f, 1.5f, 0.0f};
    float l[4];
    ds_sample_params p = params(0.0f, 1.0f, 0, 0.0f);
    memcpy(l, raw, sizeof l);
    assert_int_equal(ds_sample_token(l, 4, &p, &c, 1, NULL, 0, &rng, s, NULL, 0), 0);
    /* frequency 0.2: 2.0 - 3 * 0.2 = 1.4, 1.8 - 0.2 = 1.6, 1.5, 0 - 0.4: token 1 wins. */
    p.frequency_penalty = 0.2f;
    memcpy(l, raw, sizeof l);
    assert_int_equal(ds_sample_token(l, 4, &p, &c, 1, NULL, 0, &rng, s, NULL, 0), 1);
    assert_float_equal(l[0], 1.4f, 1e-6);
    assert_float_equal(l[1], 1.6f, 1e-6);
    assert_float_equal(l[2], 1.5f, 1e-6);
    assert_float_equal(l[3], -0.4f, 1e-6);
    /* + presence 0.5 on every generated token: 0.9, 1.1, 1.5, -0.9: token 2 wins. */
    p.presence_penalty = 0.5f;
    memcpy(l, raw, sizeof l);
    assert_int_equal(ds_sample_token(l, 4, &p, &c, 1, NULL, 0, &rng, s, NULL, 0), 2);
    assert_float_equal(l[0], 0.9f, 1e-6);
    assert_float_equal(l[3], -0.9f, 1e-6);
    /* Negative presence rewards repetition: 3 + 0 = 3 for token 0, 2.8, 1.5, 1.0. */
    p.frequency_penalty = 0.0f;
    p.presence_penalty = -1.0f;
    memcpy(l, raw, sizeof l);
    assert_int_equal(ds_sample_token(l, 4, &p, &c, 1, NULL, 0, &rng, s, NULL, 0), 0);
    assert_float_equal(l[3], 1.0f, 1e-6);
    ds_sample_scratch_free(s);
    ds_token_counts_free(&c);
}

/* ds_sample_is_argmax says yes exactly when the sampler's token is the raw logits' argmax
 * whatever the counts, stop mask and RNG hold: the engine then takes the token the model picked
 * beside the logits (on a GPU) and never calls the sampler. Each condition it checks is shown to
 * matter: with it broken, the sampled token here differs from the argmax. */
static void test_is_argmax(void **state) {
    (void)state;
    const float raw[4] = {2.0f, 1.8f, 1.5f, 0.0f}; /* argmax 0 */
    const int32_t stops[2] = {0, 3};
    ds_token_counts c = {0};
    for (int k = 0; k < 3; k++) ds_token_counts_add(&c, 0);
    ds_sample_scratch *s = scratch_for(4);
    const float temps[] = {0.0f, 1e-6f, 1.0f};
    const float pens[] = {0.0f, 0.5f};
    const int lps[] = {-1, 0, 2};
    int yes = 0, no = 0;
    for (size_t ti = 0; ti < DS_ARRAY_LEN(temps); ti++)
        for (size_t pi = 0; pi < DS_ARRAY_LEN(pens); pi++)
            for (size_t fi = 0; fi < DS_ARRAY_LEN(pens); fi++)
                for (int allow = 0; allow < 2; allow++)
                    for (int n_stop = 0; n_stop <= 2; n_stop += 2)
                        for (size_t li = 0; li < DS_ARRAY_LEN(lps); li++) {
                            ds_sample_params p = params(temps[ti], 1.0f, 0, 0.0f);
                            p.presence_penalty = pens[pi];
                            p.frequency_penalty = pens[fi];
                            int want = temps[ti] < 1e-5f && pens[pi] == 0 && pens[fi] == 0 &&
                                       (allow || !n_stop) && lps[li] < 0;
                            int got = ds_sample_is_argmax(&p, allow, n_stop, lps[li]);
                            assert_int_equal(got, want);
                            yes += got;
                            no += !got;
                            ds_rng rng, before;
                            ds_rng_seed(&rng, 7 + (uint64_t)ti);
                            before = rng;
                            float l[4];
                            ds_logprobs_out lp;
                            memcpy(l, raw, sizeof l);
                            int32_t t = ds_sample_token(l, 4, &p, &c, allow, stops, n_stop, &rng, s,
                                                        lps[li] >= 0 ? &lp : NULL,
                                                        lps[li] > 0 ? lps[li] : 0);
                            if (got) { /* the argmax, and nothing drawn */
                                assert_int_equal(t, ds_argmax(raw, 4));
                                assert_memory_equal(&rng, &before, sizeof rng);
                            }
                            /* a penalty on token 0 (counted 3 times) or its stop mask moves
                             * greedy off the argmax: the predicate must have said no */
                            if (temps[ti] < 1e-5f && (pens[pi] || pens[fi] || (!allow && n_stop)))
                                assert_int_not_equal(t, ds_argmax(raw, 4));
                        }
    assert_true(yes > 0 && no > yes);
    ds_sample_scratch_free(s);
    ds_token_counts_free(&c);
}

static void test_stop_mask(void **state) {
    (void)state;
    const float raw[4] = {1.0f, 5.0f, 3.0f, 4.0f};
    const int32_t stops[4] = {1, 3, -1, 77}; /* out-of-range ids are ignored */
    float l[4];
    ds_sample_scratch *s = scratch_for(4);
    ds_rng rng;
    ds_rng_seed(&rng, 2);
    ds_sample_params p = params(0.0f, 1.0f, 0, 0.0f);
    memcpy(l, raw, sizeof l);
    assert_int_equal(ds_sample_token(l, 4, &p, NULL, 0, stops, 4, &rng, s, NULL, 0), 2);
    assert_true(isinf(l[1]) && l[1] < 0 && isinf(l[3]) && l[3] < 0);
    assert_float_equal(l[2], 3.0f, 0);
    memcpy(l, raw, sizeof l);
    assert_int_equal(ds_sample_token(l, 4, &p, NULL, 1, stops, 4, &rng, s, NULL, 0), 1);
    /* Sampling never picks a masked id although they hold most of the mass. */
    p.temperature = 1.0f;
    int seen[4] = {0};
    for (int i = 0; i < 2000; i++) {
        memcpy(l, raw, sizeof l);
        seen[ds_sample_token(l, 4, &p, NULL, 0, stops, 4, &rng, s, NULL, 0)]++;
    }
    assert_int_equal(seen[1] + seen[3], 0);
    assert_true(seen[0] > 0 && seen[2] > seen[0]);
    ds_sample_scratch_free(s);
}

static void test_logprobs(void **state) {
    (void)state;
    enum { V = 1000 };
    float raw[V], l[V];
    ds_rng rng;
    ds_rng_seed(&rng, 8);
    for (int i = 0; i < V; i++) raw[i] = (float)(3.0 * ds_rng_normal(&rng));
    /* Ties at the top, so the order by id is exercised: the maximum 14 at 500, 10, 20; 13.5 at 7
     * and 3. */
    raw[500] = raw[10] = raw[20] = 14.0f;
    raw[7] = raw[3] = 13.5f;
    double mx = 14.0, z = 0;
    for (int i = 0; i < V; i++) z += exp(raw[i] - mx);
    double lse = mx + log(z);
    int32_t *order = sorted_ids(raw, V);
    const int32_t head[5] = {10, 20, 500, 3, 7};
    for (int j = 0; j < 5; j++) assert_int_equal(order[j], head[j]);

    /* Penalties, a stop mask and temperature change what is drawn but not the logprobs. */
    ds_token_counts c = {0};
    for (int k = 0; k < 5; k++) ds_token_counts_add(&c, 10);
    ds_token_counts_add(&c, 42);
    ds_sample_params p = params(0.8f, 0.9f, 0, 0.0f);
    p.frequency_penalty = 2.0f;
    p.presence_penalty = 0.5f;
    const int32_t stop = 20;
    ds_sample_scratch *s = scratch_for(V);
    for (int trial = 0; trial < 30; trial++) {
        memcpy(l, raw, sizeof l);
        ds_logprobs_out lp;
        memset(&lp, 0xab, sizeof lp);
        int32_t t = ds_sample_token(l, V, &p, &c, 0, &stop, 1, &rng, s, &lp, 20);
        assert_true(t != 10 && t != 20); /* penalised down by 10.5, masked */
        assert_float_equal(lp.logprob, raw[t] - lse, 1e-5);
        assert_int_equal(lp.n_top, 20);
        for (int j = 0; j < 20; j++) {
            assert_int_equal(lp.top_ids[j], order[j]);
            assert_float_equal(lp.top_logprobs[j], raw[order[j]] - lse, 1e-5);
        }
    }
    /* No alternatives asked: just the sampled token's; greedy works the same way. */
    p = params(0.0f, 1.0f, 0, 0.0f);
    memcpy(l, raw, sizeof l);
    ds_logprobs_out lp;
    assert_int_equal(ds_sample_token(l, V, &p, NULL, 1, NULL, 0, &rng, s, &lp, 0), 10);
    assert_int_equal(lp.n_top, 0);
    assert_float_equal(lp.logprob, 14.0 - lse, 1e-5);
    /* More asked than the vocabulary holds. */
    memcpy(l, raw, 5 * sizeof(float));
    ds_sample_token(l, 5, &p, NULL, 1, NULL, 0, &rng, s, &lp, 20);
    assert_int_equal(lp.n_top, 5);
    assert_int_equal(lp.top_ids[0], 3);
    ds_sample_scratch_free(s);
    ds_token_counts_free(&c);
    free(order);
}

/* ---- reproducibility ---------------------------------------------------------------------------
 */

static void draw_seq(const float *l, int V, const ds_sample_params *p, ds_rng *rng, int n,
                     int32_t *out, ds_sample_scratch *s, float *work) {
    for (int i = 0; i < n; i++) out[i] = draw1(l, V, p, rng, s, work);
}

static void test_seeds(void **state) {
    (void)state;
    enum { V = 2000, N = 64 };
    float l[V], work[V];
    ds_rng rng;
    ds_rng_seed(&rng, 4);
    for (int i = 0; i < V; i++) l[i] = (float)ds_rng_normal(&rng);
    ds_sample_scratch *s = scratch_for(V);
    const ds_sample_params cases[] = {params(1.0f, 1.0f, 0, 0.0f), params(0.9f, 0.95f, 100, 0.0f)};
    for (size_t c = 0; c < DS_ARRAY_LEN(cases); c++) {
        int32_t a[N], b[N], other[N], mixed[N];
        ds_rng r1, r2, r3, r4;
        ds_rng_seed(&r1, 42);
        ds_rng_seed(&r2, 42);
        ds_rng_seed(&r3, 43);
        draw_seq(l, V, &cases[c], &r1, N, a, s, work);
        draw_seq(l, V, &cases[c], &r2, N, b, s, work);
        draw_seq(l, V, &cases[c], &r3, N, other, s, work);
        assert_memory_equal(a, b, sizeof a);
        assert_memory_not_equal(a, other, sizeof a);
        /* Interleaved with another request's draws (as in a batch), seed 42 gives the same. */
        ds_rng_seed(&r1, 42);
        ds_rng_seed(&r4, 7);
        for (int i = 0; i < N; i++) {
            mixed[i] = draw1(l, V, &cases[c], &r1, s, work);
            draw1(l, V, &cases[(c + 1) % 2], &r4, s, work);
        }
        assert_memory_equal(a, mixed, sizeof a);
    }
    ds_sample_scratch_free(s);
}

/* Constrained decoding's bitmask: only allowed ids are ever drawn (ids at or past n_allow never,
 * whatever their bits), greedy takes the best allowed one, and whole words (all allowed, all
 * forbidden) are treated as the bits say. */
static void test_allow_bitmask(void **state) {
    (void)state;
    enum { V = 200 };
    float x[V], row[V];
    uint32_t allow[(V + 31) / 32] = {0};
    const int ok[] = {3, 40, 64, 65, 95, 150, 190}; /* 190: past n_allow, so never */
    for (int i = 0; i < V; i++) x[i] = (float)((i * 37) % 11) * 0.3f;
    for (size_t k = 0; k < sizeof ok / sizeof ok[0]; k++) allow[ok[k] / 32] |= 1u << (ok[k] % 32);
    allow[1] = 0xFFFFFFFFu; /* 32..63 all allowed */
    x[100] = 50.0f;         /* the best logit, forbidden */
    ds_err err;
    ds_sample_scratch *sc = ds_sample_scratch_new(V, &err);
    ds_rng rng;
    ds_rng_seed(&rng, 5);
    int seen_word = 0;
    for (int t = 0; t < 400; t++) {
        ds_sample_params p;
        ds_sample_params_default(&p);
        p.temperature = t == 0 ? 0.0f : 2.0f;
        ds_row_draw d = {p, ds_rng_uniform(&rng), NULL, 0, NULL, 0, allow, 180};
        memcpy(row, x, sizeof row);
        int32_t tok = ds_sample_row(row, V, &d, sc);
        assert_true(tok >= 0 && tok < 180);
        assert_true(allow[tok / 32] >> (tok % 32) & 1u);
        seen_word |= tok >= 32 && tok < 64 && tok != 40;
        if (t == 0) { /* greedy: the largest allowed logit, lowest id among equals */
            int best = -1;
            for (int i = 0; i < 180; i++)
                if ((allow[i / 32] >> (i % 32) & 1u) && (best < 0 || x[i] > x[best])) best = i;
            assert_int_equal(tok, best);
        }
    }
    assert_true(seen_word);
    ds_sample_scratch_free(sc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_ties),
        cmocka_unit_test(test_top_k_one_is_greedy),
        cmocka_unit_test(test_temperature_frequencies),
        cmocka_unit_test(test_top_p),
        cmocka_unit_test(test_top_p_partitioned),
        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_large_vocab_sets),
        cmocka_unit_test(test_large_vocab),
        cmocka_unit_test(test_row_draw_exact),
        cmocka_unit_test(test_row_draw_edits),
        cmocka_unit_test(test_token_counts),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_stop_mask),
        cmocka_unit_test(test_is_argmax),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_seeds),
        cmocka_unit_test(test_allow_bitmask),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
