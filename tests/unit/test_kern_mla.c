/* test_kern_mla.c — MLA attention, absorbed (over a paged latent cache) and expanded, against a
 * float64 reference of the expanded math (docs/model.md §4.3). The test builds the per-head keys
 * and values from latents with random W_UK / W_UV and does the absorption itself (q̄ = W_UKᵀ qN, o =
 * W_UV ō), so passing also checks the absorption identity of §4.4. */
#include "testutil.h"

#include "kernels/cpu/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-5

typedef struct mla_dims {
    int Ha, R, dr, dn, dvh;
} mla_dims;

/* One attention problem: latents, weights, queries; everything random. */
typedef struct mla_case {
    mla_dims d;
    int n_ctx, T, pos0, causal;
    float scale;
    float *c, *kR;    /* [n_ctx][R], [n_ctx][dr] */
    float *Wuk, *Wuv; /* [Ha][dn][R], [Ha][dvh][R] */
    float *qN, *qR;   /* [T][Ha][dn], [T][Ha][dr] */
} mla_case;

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
static void fill_normal(ds_rng *r, float *x, size_t n, double sd) {
    for (size_t i = 0; i < n; i++) x[i] = (float)(sd * ds_rng_normal(r));
}

static mla_case make_case(mla_dims d, int n_ctx, int T, int pos0, int causal, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    mla_case m = {d,    n_ctx, T,    pos0, causal, (float)(1 / sqrt((double)(d.dn + d.dr))),
                  NULL, NULL,  NULL, NULL, NULL,   NULL};
    m.c = fvec((size_t)n_ctx * d.R), m.kR = fvec((size_t)n_ctx * d.dr);
    m.Wuk = fvec((size_t)d.Ha * d.dn * d.R), m.Wuv = fvec((size_t)d.Ha * d.dvh * d.R);
    m.qN = fvec((size_t)T * d.Ha * d.dn), m.qR = fvec((size_t)T * d.Ha * d.dr);
    fill_normal(&r, m.c, (size_t)n_ctx * d.R, 1.0);
    fill_normal(&r, m.kR, (size_t)n_ctx * d.dr, 1.0);
    fill_normal(&r, m.Wuk, (size_t)d.Ha * d.dn * d.R, 1 / sqrt((double)d.R));
    fill_normal(&r, m.Wuv, (size_t)d.Ha * d.dvh * d.R, 1 / sqrt((double)d.R));
    /* Scores of a few units: the softmax is neither flat nor one-hot. */
    fill_normal(&r, m.qN, (size_t)T * d.Ha * d.dn, 1.5);
    fill_normal(&r, m.qR, (size_t)T * d.Ha * d.dr, 1.5);
    return m;
}

static void free_case(mla_case *m) {
    free(m->c), free(m->kR), free(m->Wuk), free(m->Wuv), free(m->qN), free(m->qR);
}

static int limit(const mla_case *m, int t) {
    return m->causal ? m->pos0 + t + 1 : m->n_ctx;
}

/* §4.3 in float64: o [T][Ha][dvh]; obar [T][Ha][R] = Σ softmax · c (what the absorbed kernel
 * returns before W_UV). */
static void reference(const mla_case *m, double *o, double *obar) {
    const mla_dims d = m->d;
    double *kN = dvec((size_t)m->n_ctx * d.dn), *w = dvec((size_t)m->n_ctx);
    for (int h = 0; h < d.Ha; h++) {
        for (int p = 0; p < m->n_ctx; p++)
            for (int x = 0; x < d.dn; x++) {
                double s = 0;
                for (int r = 0; r < d.R; r++)
                    s += (double)m->Wuk[((size_t)h * d.dn + x) * d.R + r] *
                         m->c[(size_t)p * d.R + r];
                kN[(size_t)p * d.dn + x] = s;
            }
        for (int t = 0; t < m->T; t++) {
            const size_t th = (size_t)t * d.Ha + h;
            const int n = limit(m, t);
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p < n; p++) {
                double s = 0;
                for (int x = 0; x < d.dn; x++) s += m->qN[th * d.dn + x] * kN[(size_t)p * d.dn + x];
                for (int x = 0; x < d.dr; x++)
                    s += (double)m->qR[th * d.dr + x] * m->kR[(size_t)p * d.dr + x];
                w[p] = m->scale * s;
                mx = fmax(mx, w[p]);
            }
            for (int p = 0; p < n; p++) sum += (w[p] = exp(w[p] - mx));
            for (int r = 0; r < d.R; r++) {
                double s = 0;
                for (int p = 0; p < n; p++) s += w[p] / sum * m->c[(size_t)p * d.R + r];
                obar[th * d.R + r] = s;
            }
            for (int x = 0; x < d.dvh; x++) {
                double s = 0;
                for (int r = 0; r < d.R; r++)
                    s += m->Wuv[((size_t)h * d.dvh + x) * d.R + r] * obar[th * d.R + r];
                o[th * d.dvh + x] = s;
            }
        }
    }
    free(kN), free(w);
}

/* Absorbed path over a paged cache: block_size bs, pages in shuffled order inside a larger pool
 * whose other rows are NaN (a read of any row but the n_ctx live ones poisons the output). */
static void run_absorbed(const mla_case *m, int bs, uint64_t seed, float *o, float *obar) {
    const mla_dims d = m->d;
    const int row = d.R + d.dr, nblk = (m->n_ctx + bs - 1) / bs, pool_blocks = 2 * nblk + 3;
    ds_rng r;
    ds_rng_seed(&r, seed);
    int32_t *table = calloc((size_t)nblk, sizeof(int32_t)),
            *perm = calloc((size_t)pool_blocks, sizeof(int32_t));
    float *pool = fvec((size_t)pool_blocks * bs * row);
    assert_non_null(table), assert_non_null(perm);
    for (int i = 0; i < pool_blocks; i++) perm[i] = i;
    for (int i = pool_blocks - 1; i > 0; i--) { /* Fisher-Yates */
        int j = (int)(ds_rng_uniform(&r) * (i + 1));
        int32_t x = perm[i];
        perm[i] = perm[j], perm[j] = x;
    }
    memcpy(table, perm, sizeof(int32_t) * (size_t)nblk);
    for (size_t i = 0; i < (size_t)pool_blocks * bs * row; i++) pool[i] = NAN;
    ds_latent_view kv = {pool, table, bs, row, d.R, 0};
    for (int p = 0; p < m->n_ctx; p++) {
        float *dst = ds_latent_row(&kv, p);
        memcpy(dst, m->c + (size_t)p * d.R, sizeof(float) * (size_t)d.R);
        memcpy(dst + d.R, m->kR + (size_t)p * d.dr, sizeof(float) * (size_t)d.dr);
    }
    /* q̄_h = W_UK_hᵀ qN_h */
    float *qbar = fvec((size_t)m->T * d.Ha * d.R);
    for (int t = 0; t < m->T; t++)
        for (int h = 0; h < d.Ha; h++) {
            const size_t th = (size_t)t * d.Ha + h;
            for (int x = 0; x < d.R; x++) {
                double s = 0;
                for (int y = 0; y < d.dn; y++)
                    s += (double)m->Wuk[((size_t)h * d.dn + y) * d.R + x] * m->qN[th * d.dn + y];
                qbar[th * d.R + x] = (float)s;
            }
        }
    ds_mla_attend_absorbed(obar, qbar, m->qR, m->T, d.Ha, d.R, d.dr, &kv, m->pos0, m->n_ctx,
                           m->causal, m->scale);
    /* o_h = W_UV_h ō_h */
    for (int t = 0; t < m->T; t++)
        for (int h = 0; h < d.Ha; h++) {
            const size_t th = (size_t)t * d.Ha + h;
            for (int x = 0; x < d.dvh; x++) {
                double s = 0;
                for (int y = 0; y < d.R; y++)
                    s += (double)m->Wuv[((size_t)h * d.dvh + x) * d.R + y] * obar[th * d.R + y];
                o[th * d.dvh + x] = (float)s;
            }
        }
    free(table), free(perm), free(pool), free(qbar);
}

/* Expanded path: kN = W_UK c, v = W_UV c per head, q = [qN | qR]. */
static void run_expanded(const mla_case *m, float *o) {
    const mla_dims d = m->d;
    const int dq = d.dn + d.dr;
    float *kN = fvec((size_t)m->n_ctx * d.Ha * d.dn), *v = fvec((size_t)m->n_ctx * d.Ha * d.dvh);
    float *q = fvec((size_t)m->T * d.Ha * dq);
    for (int p = 0; p < m->n_ctx; p++)
        for (int h = 0; h < d.Ha; h++) {
            const float *cp = m->c + (size_t)p * d.R;
            for (int x = 0; x < d.dn; x++) {
                double s = 0;
                for (int r = 0; r < d.R; r++)
                    s += (double)m->Wuk[((size_t)h * d.dn + x) * d.R + r] * cp[r];
                kN[((size_t)p * d.Ha + h) * d.dn + x] = (float)s;
            }
            for (int x = 0; x < d.dvh; x++) {
                double s = 0;
                for (int r = 0; r < d.R; r++)
                    s += (double)m->Wuv[((size_t)h * d.dvh + x) * d.R + r] * cp[r];
                v[((size_t)p * d.Ha + h) * d.dvh + x] = (float)s;
            }
        }
    for (size_t th = 0; th < (size_t)m->T * d.Ha; th++) {
        memcpy(q + th * dq, m->qN + th * d.dn, sizeof(float) * (size_t)d.dn);
        memcpy(q + th * dq + d.dn, m->qR + th * d.dr, sizeof(float) * (size_t)d.dr);
    }
    ds_mla_attend_expanded(o, q, kN, m->kR, v, m->T, m->n_ctx, d.Ha, d.dn, d.dr, d.dvh, m->pos0,
                           m->causal, m->scale);
    free(kN), free(v), free(q);
}

static void check(mla_dims d, int n_ctx, int T, int pos0, int causal, int bs, uint64_t seed) {
    mla_case m = make_case(d, n_ctx, T, pos0, causal, seed);
    const size_t no = (size_t)T * d.Ha * d.dvh, nb = (size_t)T * d.Ha * d.R;
    double *oref = dvec(no), *bref = dvec(nb);
    reference(&m, oref, bref);
    float *oa = fvec(no), *ob = fvec(nb), *oe = fvec(no);
    memset(ob, 0xff, sizeof(float) * nb); /* NaN: every output must be written */
    memset(oe, 0xff, sizeof(float) * no);
    run_absorbed(&m, bs, seed + 1, oa, ob);
    run_expanded(&m, oe);
    double ea = ds_test_rel_err(oa, oref, no), eb = ds_test_rel_err(ob, bref, nb),
           ee = ds_test_rel_err(oe, oref, no);
    if (!(ea <= TOL && eb <= TOL && ee <= TOL))
        fail_msg("MLA Ha=%d R=%d n_ctx=%d T=%d pos0=%d causal=%d bs=%d: absorbed o %.3g, obar "
                 "%.3g; expanded %.3g",
                 d.Ha, d.R, n_ctx, T, pos0, causal, bs, ea, eb, ee);
    free(oref), free(bref), free(oa), free(ob), free(oe), free_case(&m);
}

/* Widths that are not multiples of the 8-wide vectors: every scalar tail runs. */
static const mla_dims ODD = {3, 36, 6, 12, 10};
/* Widths that are: the vector paths run (values of 64 and 32 columns). */
static const mla_dims EVEN = {5, 64, 16, 32, 32};

static void test_causal_decode(void **state) {
    (void)state;
    check(ODD, 37, 1, 36, 1, 5, 1); /* block size 5 does not divide 37 */
    check(EVEN, 37, 1, 36, 1, 5, 2);
    check(EVEN, 300, 1, 299, 1, 16, 3); /* long enough that the keys are split across threads */
    check(ODD, 300, 1, 299, 1, 7, 4);
}

static void test_causal_chunks(void **state) {
    (void)state;
    check(ODD, 37, 5, 32, 1, 5, 10); /* a chunk at the end of the cache */
    check(EVEN, 37, 7, 30, 1, 6, 11);
    check(EVEN, 37, 37, 0, 1, 5, 12);   /* prefill from position 0 */
    check(ODD, 200, 9, 150, 1, 16, 13); /* queries see fewer rows than the cache holds */
    check(EVEN, 150, 20, 130, 1, 3, 14);
}

static void test_non_causal(void **state) {
    (void)state;
    check(ODD, 37, 4, 33, 0, 5, 20); /* a DSpark-style block: every query sees every row */
    check(EVEN, 41, 8, 33, 0, 4, 21);
    check(EVEN, 300, 2, 298, 0, 16, 22);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_causal_decode),
        cmocka_unit_test(test_causal_chunks),
        cmocka_unit_test(test_non_causal),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
