/* test_cuda_elementwise.c — the glue kernels against the CPU: the embedding, SwiGLU, the
 * experts' activation pairs, pitched copies. */
#include "cuda_check.h"

static void check_embed(ds_cu *c, int V, int D, int T) {
    uint16_t *e = rand_bf16((size_t)V * D, -1, 1);
    int32_t *ids = malloc((size_t)T * sizeof *ids);
    for (int t = 0; t < T; t++) ids[t] = (int32_t)(ds_rng_next(&g_rng) % (uint64_t)V);
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    ds_mat he = {e, DS_DT_BF16, V, D, NULL};
    ds_embed(ref, &he, ids, T);
    uint16_t *de = dev(c, e, (size_t)V * D * 2);
    int32_t *dids = dev(c, ids, (size_t)T * 4);
    float *dout = dev(c, NULL, (size_t)T * D * 4);
    poison(c, dout, (size_t)T * D * 4);
    ds_cu_mat m = {de, V, D, DS_CU_BF16, NULL, NULL, 0};
    ds_cu_embed(c, dout, &m, dids, T);
    fetch(c, got, dout, (size_t)T * D * 4);
    char what[96];
    snprintf(what, sizeof what, "embed V=%d D=%d T=%d", V, D, T);
    report(what, rel_err(got, ref, (size_t)T, (size_t)D, (size_t)D), 0.0);
    ds_cu_dealloc(de), ds_cu_dealloc(dids), ds_cu_dealloc(dout);
    free(e), free(ids), free(ref), free(got);
}

static void check_swiglu(ds_cu *c, size_t n) {
    float *g = rand_f32(n, -6, 6), *u = rand_f32(n, -2, 2);
    float *ref = malloc(n * 4), *got = malloc(n * 4);
    ds_act_swiglu(ref, g, u, n);
    float *dg = dev(c, g, n * 4), *du = dev(c, u, n * 4), *dout = dev(c, NULL, n * 4);
    poison(c, dout, n * 4);
    ds_cu_swiglu(c, dout, dg, du, n);
    fetch(c, got, dout, n * 4);
    char what[96];
    snprintf(what, sizeof what, "swiglu n=%zu", n);
    report(what, rel_err(got, ref, 1, n, n), 1e-5);
    ds_cu_dealloc(dg), ds_cu_dealloc(du), ds_cu_dealloc(dout);
    free(g), free(u), free(ref), free(got);
}

/* h [rows][2I] (gate | up) -> act in the gate half, in place; the up half untouched. */
static void check_act_pairs(ds_cu *c, int rows, int I) {
    size_t n = (size_t)rows * 2 * I, half = (size_t)rows * I;
    float *h = rand_f32(n, -6, 6), *g = malloc(half * 4), *u = malloc(half * 4);
    float *ref = malloc(half * 4), *got = malloc(n * 4), *gg = malloc(half * 4);
    for (size_t r = 0; r < (size_t)rows; r++) {
        memcpy(g + r * I, h + r * 2 * I, (size_t)I * 4);
        memcpy(u + r * I, h + r * 2 * I + I, (size_t)I * 4);
    }
    ds_act_swiglu(ref, g, u, half);
    float *dh = dev(c, h, n * 4);
    ds_cu_act_pairs(c, dh, rows, I, 0, 0.0f, 0.0f);
    fetch(c, got, dh, n * 4);
    int up_kept = 1;
    for (size_t r = 0; r < (size_t)rows; r++) {
        memcpy(gg + r * I, got + r * 2 * I, (size_t)I * 4);
        up_kept &= !memcmp(got + r * 2 * I + I, u + r * I, (size_t)I * 4);
    }
    char what[96];
    snprintf(what, sizeof what, "act pairs rows=%d I=%d (swiglu)", rows, I);
    report(what, up_kept ? rel_err(gg, ref, 1, half, half) : INFINITY, 1e-5);
    ds_cu_dealloc(dh);
    free(h), free(g), free(u), free(ref), free(got), free(gg);
}

/* y *= sigmoid(x) in one launch: the words of ds_cu_sigmoid then ds_cu_mul, x kept. */
static void check_mul_sigmoid(ds_cu *c, size_t n) {
    float *x = rand_f32(n, -30, 30), *y = rand_f32(n, -4, 4);
    float *ref = malloc(n * 4), *got = malloc(n * 4), *xk = malloc(n * 4);
    float *dx = dev(c, x, n * 4), *dy = dev(c, y, n * 4);
    ds_cu_sigmoid(c, dx, n);
    ds_cu_mul(c, dy, dx, n);
    fetch(c, ref, dy, n * 4);
    float *dx2 = dev(c, x, n * 4), *dy2 = dev(c, y, n * 4);
    ds_cu_mul_sigmoid(c, dy2, dx2, n);
    fetch(c, got, dy2, n * 4);
    fetch(c, xk, dx2, n * 4);
    size_t moved = 0;
    for (size_t i = 0; i < n; i++) moved += got[i] != y[i];
    char what[96];
    snprintf(what, sizeof what, "mul sigmoid n=%zu: words differing from sigmoid, mul", n);
    /* every word the same, x untouched, and y changed (not a no-op) */
    report(what,
           (double)words_differ(got, ref, n) + (memcmp(xk, x, n * 4) ? 1.0 : 0.0) +
               (moved < n / 2 ? 1.0 : 0.0),
           0.0);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dx2), ds_cu_dealloc(dy2);
    free(x), free(y), free(ref), free(got), free(xk);
}

/* A pitched copy (rows x width out of rows of lds into rows of ldd), exact. */
static void check_copy_2d(ds_cu *c, size_t rows, size_t width, size_t lds, size_t ldd) {
    float *src = rand_f32(rows * lds, -1, 1), *got = malloc(rows * ldd * 4);
    float *ref = rand_f32(rows * ldd, -1, 1); /* what lies between the rows stays */
    float *ds = dev(c, src, rows * lds * 4), *dd = dev(c, ref, rows * ldd * 4);
    for (size_t r = 0; r < rows; r++) memcpy(ref + r * ldd, src + r * lds + 3, width * 4);
    ds_err err = {{0}};
    if (ds_cu_copy_2d(c, dd, ldd, ds + 3, lds, width, rows, &err)) DIE("%s", err.msg);
    fetch(c, got, dd, rows * ldd * 4);
    char what[96];
    snprintf(what, sizeof what, "copy 2d %zu x %zu (pitches %zu, %zu)", rows, width, lds, ldd);
    report(what, memcmp(got, ref, rows * ldd * 4) ? INFINITY : 0.0, 0);
    ds_cu_dealloc(ds), ds_cu_dealloc(dd);
    free(src), free(got), free(ref);
}

/* the embedding */
void checks_embed(ds_cu *c) {
    check_embed(c, 1000, 2304, 13);
}

/* SwiGLU and the activation pairs */
void checks_act(ds_cu *c) {
    check_swiglu(c, 1000003);
    check_act_pairs(c, 3, 1024);   /* a decode step's shared experts */
    check_act_pairs(c, 66000, 40); /* more rows than a grid's y: the row loop */
    check_mul_sigmoid(c, 100003);  /* MLA's output gate */
}

/* pitched copies */
void checks_copy(ds_cu *c) {
    check_copy_2d(c, 32, 64, 192, 64);      /* a narrow strided copy (few rows) */
    check_copy_2d(c, 70000, 128, 256, 130); /* prefill's keys: a grid-stride loop */
}
