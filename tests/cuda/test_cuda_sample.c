/* test_cuda_sample.c — greedy (argmax keys) and the draws (ds_cu_draw_rows against
 * ds_sample_row, token for token); the draws' timings. */
#include "cuda_check.h"
#include "../unit/draw_rows.h"

/* Greedy choice of every row, ties and NaN included, exactly as the CPU. */
static void check_argmax(ds_cu *c, int rows, int V, int parts) {
    float *x = rand_f32((size_t)rows * V, -5, 5);
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * V;
        if (r % 8 == 1) /* a tie: the same maximum at two places */
            xr[V / 3] = xr[2 * V / 3] = 9.0f;
        if (r % 8 == 2) /* NaN scattered in */
            for (int i = 0; i < V; i += 7) xr[i] = NAN;
        if (r % 8 == 4) /* -0 and +0 the largest: equal, so the first of them */
            for (int i = 0; i < V; i++)
                xr[i] = i == V / 2 ? -0.0f : i == V / 4 ? 0.0f : -xr[i] * xr[i] - 1;
        if (r % 8 == 5) /* -0 first, then +0 */
            for (int i = 0; i < V; i++) xr[i] = i == V / 5 ? -0.0f : i == V - 1 ? 0.0f : -1.0f;
        if (r % 8 == 6) /* all -inf but for NaN in front: the first -inf */
            for (int i = 0; i < V; i++) xr[i] = i < V / 3 ? NAN : -INFINITY;
        if (r % 8 == 7 && r == rows - 1) /* a row of NaN */
            for (int i = 0; i < V; i++) xr[i] = NAN;
    }
    int32_t *ref = malloc((size_t)rows * 4), *got = malloc((size_t)rows * 4);
    for (int r = 0; r < rows; r++) ref[r] = ds_argmax(x + (size_t)r * V, V);
    float *dx = dev(c, x, (size_t)rows * V * 4);
    if (!parts) parts = ds_cu_argmax_parts(rows, V);
    uint64_t *dkeys = dev(c, NULL, (size_t)rows * parts * 8),
             *keys = malloc((size_t)rows * parts * 8);
    ds_cu_argmax_rows(c, dkeys, dx, rows, V, parts);
    fetch(c, keys, dkeys, (size_t)rows * parts * 8);
    for (int r = 0; r < rows; r++) got[r] = ds_cu_argmax_token(keys + (size_t)r * parts, parts);
    int bad = 0;
    for (int r = 0; r < rows; r++) bad += got[r] != ref[r];
    char what[96];
    snprintf(what, sizeof what, "argmax rows=%d V=%d in %d parts (%d rows differ)", rows, V, parts,
             bad);
    report(what, bad ? INFINITY : 0.0, 0.0);
    ds_cu_dealloc(dx), ds_cu_dealloc(dkeys);
    free(x), free(ref), free(got), free(keys);
}

/* ---- draws: ds_cu_draw_rows against ds_sample_row, token for token ---- */

/* The parameters of draw i (a cycle of top-k, top-p, min-p, penalties, masks, greedy, grammar
 * bitmasks) and its counts, mask and allowed ids (storage of the caller; allow: [(V + 31) / 32]).
 */
static ds_row_draw draw_case(int i, int V, double u, ds_token_count *counts, int32_t *mask,
                             uint32_t *allow) {
    ds_sample_params p;
    ds_sample_params_default(&p);
    const float temps[] = {1.0f, 0.8f, 1.3f, 0.05f, 2.0f, 0.0f};
    const float top_ps[] = {1.0f, 0.9f, 0.5f, 0.999f, 1.0f, 0.0f};
    const int top_ks[] = {0, 0, 40, 0, 300, 7, 1};
    p.temperature = temps[i % 6];
    p.top_p = top_ps[(i / 2) % 6];
    p.top_k = top_ks[(i / 3) % 7];
    p.min_p = i % 5 == 3 ? 0.05f : 0.0f;
    ds_row_draw d = {p, u, NULL, 0, NULL, 0, NULL, 0};
    if (i % 4 == 1) { /* penalties over a few generated ids */
        d.p.presence_penalty = 0.5f;
        d.p.frequency_penalty = 0.25f;
        for (int j = 0; j < 6; j++) counts[j] = (ds_token_count){(j * 7919 + i) % V, 1 + j % 3};
        counts[6] = (ds_token_count){-1, 4}; /* an empty slot: skipped */
        d.counts = counts;
        d.n_counts = 7;
    }
    if (i % 3 == 2) { /* stops masked, one twice and one outside the vocabulary */
        mask[0] = (i * 31) % V, mask[1] = mask[0], mask[2] = V + 3, mask[3] = (i * 17 + 1) % V;
        d.mask = mask;
        d.n_mask = 4;
    }
    if (i % 5 == 4) { /* constrained decoding: a bitmask of allowed ids (one id, or a scatter),
                         the last few ids beyond n_allow, so forbidden whatever their bits */
        int one = i % 10 == 4;
        for (int w = 0; w < (V + 31) / 32; w++)
            allow[w] = one ? 0u : 0x11011001u * (uint32_t)(w * 2654435761u | 1u);
        if (one) allow[((i * 37) % V) / 32] |= 1u << ((i * 37) % V % 32);
        d.allow = allow;
        d.n_allow = one ? V : V - 5;
    }
    return d;
}

static void check_draws(ds_cu *c, int rows, int V) {
    ds_rng rng;
    ds_rng_seed(&rng, (uint64_t)rows * 131 + (uint64_t)V);
    size_t nx = (size_t)rows * V;
    float *x = malloc(nx * 4), *work = malloc((size_t)V * 4);
    for (int r = 0; r < rows; r++) draw_row_fill(x + (size_t)r * V, V, r % DRAW_ROW_SHAPES, &rng);
    ds_token_count(*counts)[8] = calloc((size_t)rows, sizeof *counts);
    int32_t(*mask)[4] = calloc((size_t)rows, sizeof *mask);
    ds_row_draw *d = malloc((size_t)rows * sizeof *d);
    ds_cu_draw *cd = malloc((size_t)rows * sizeof *cd);
    const int W = (V + 31) / 32;
    uint32_t *allow = calloc((size_t)rows * W, 4); /* [rows][W] */
    int32_t *ed = malloc((size_t)rows * (18 + W) * 4), *got = malloc((size_t)rows * 4);
    int32_t *ref = malloc((size_t)rows * 4);
    const double ends[] = {0.0, 1.0 - 0x1p-53};
    size_t ne = 0;
    ds_err err = {{0}};
    ds_sample_scratch *sc = ds_sample_scratch_new(V, &err);
    for (int r = 0; r < rows; r++) {
        double u = r % 7 < 2 ? ends[r % 7] : ds_rng_uniform(&rng);
        d[r] = draw_case(r, V, u, counts[r], mask[r], allow + (size_t)r * W);
        memcpy(work, x + (size_t)r * V, (size_t)V * 4);
        ref[r] = ds_sample_row(work, V, &d[r], sc);
        ne += ds_cuda_pack_draw(&d[r], V, r, ne, ed, &cd[r]); /* as the model packs them */
    }
    float *dx = dev(c, x, nx * 4);
    if (ds_cu_draw_rows(c, got, dx, (size_t)V, V, cd, rows, ed, ne, &err)) DIE("%s", err.msg);
    int bad = 0, first = -1;
    for (int r = 0; r < rows; r++)
        if (got[r] != ref[r] && bad++ == 0) first = r;
    char what[128];
    snprintf(what, sizeof what, "draws rows=%d V=%d (%d differ%s)", rows, V, bad,
             bad ? ", see below" : "");
    report(what, bad ? INFINITY : 0.0, 0.0);
    if (bad)
        printf("  first: row %d (shape %d, T %g, top_p %g, top_k %d, min_p %g, u %.17g): GPU %d, "
               "CPU %d\n",
               first, first % DRAW_ROW_SHAPES, d[first].p.temperature, d[first].p.top_p,
               d[first].p.top_k, d[first].p.min_p, d[first].u, got[first], ref[first]);
    ds_cu_dealloc(dx);
    ds_sample_scratch_free(sc);
    free(x), free(work), free(counts), free(mask), free(d), free(cd), free(ed), free(got);
    free(ref), free(allow);
}

typedef struct draw_ctx {
    float *x; /* [256][V] device */
    int V, rows;
    ds_sample_params p;
    ds_cu_draw d[256];
    int32_t tok[256];
} draw_ctx;

static void run_draw(ds_cu *c, void *ctx) {
    draw_ctx *dc = ctx;
    ds_err err = {{0}};
    if (ds_cu_draw_rows(c, dc->tok, dc->x, (size_t)dc->V, dc->V, dc->d, dc->rows, NULL, 0, &err))
        DIE("%s", err.msg);
}

/* greedy rows */
void checks_argmax(ds_cu *c) {
    check_argmax(c, 8, 163840, 0); /* parts as the model takes them */
    check_argmax(c, 8, 163840, 1);
    check_argmax(c, 1, 163840, 0);
    check_argmax(c, 300, 5003, 0);
    check_argmax(c, 12, 100, 7); /* parts of 15, the last one short */
}

/* greedy rows again, then the draws */
void checks_draws(ds_cu *c) {
    check_argmax(c, 12, 100, 0);
    check_draws(c, 84, 6000);   /* every case of draw_case over every row shape, twice */
    check_draws(c, 24, 163840); /* the 48B vocabulary */
    check_draws(c, 7, 33);      /* fewer ids than threads */
}

/* draws at the 48B vocabulary against one host thread */
void bench_draw(ds_cu *c, const cuda_ceilings *ceil) {
    double ms;
    (void)ceil;
    /* 6. draws at the 48B vocabulary: the whole call (draws and edits up, tokens down) on rows of
     *    N(0, 2) logits — near-flat, the sampler's worst case — against one host thread */
    for (int top = 0; top < 2; top++) {
        static const int rows_of[] = {1, 8, 64, 256};
        const int V = 163840;
        ds_rng rng;
        ds_rng_seed(&rng, 7);
        draw_ctx dc = {0};
        dc.V = V;
        float *h = malloc((size_t)256 * V * 4);
        for (size_t i = 0; i < (size_t)256 * V; i++) h[i] = (float)(2.0 * ds_rng_normal(&rng));
        dc.x = dev(c, h, (size_t)256 * V * 4);
        for (int r = 0; r < 256; r++) {
            ds_sample_params_default(&dc.p);
            dc.p.top_p = top ? 0.95f : 1.0f;
            dc.d[r] =
                (ds_cu_draw){ds_rng_uniform(&rng), 1.0f, dc.p.top_p, 0, 0, 0, 0, 0, r, 0, 0, 0, 0};
        }
        ds_err e2 = {{0}};
        ds_sample_scratch *sc = ds_sample_scratch_new(V, &e2);
        float *work = malloc((size_t)V * 4);
        double t0 = ds_now();
        for (int r = 0; r < 8; r++) {
            memcpy(work, h + (size_t)r * V, (size_t)V * 4);
            ds_row_draw rd = {dc.p, dc.d[r].u, NULL, 0, NULL, 0, NULL, 0};
            (void)ds_sample_row(work, V, &rd, sc);
        }
        double host_ms = (ds_now() - t0) * 1e3 / 8;
        for (size_t i = 0; i < DS_ARRAY_LEN(rows_of); i++) {
            dc.rows = rows_of[i];
            ms = median_ms(c, run_draw, &dc, 2, 10);
            printf("bench draw V=%d top_p %.2f, %d row(s): %.3f ms (host, one thread: %.3f ms a "
                   "row)\n",
                   V, dc.p.top_p, dc.rows, ms, host_ms);
        }
        ds_cu_dealloc(dc.x);
        ds_sample_scratch_free(sc);
        free(h), free(work);
    }
}
