/* test_cuda_kv_fp8.c — the FP8 latent cache on the GPU (docs/quantization.md, "FP8 latent cache")
 * against the CPU on the same rows: the GPU's stored bytes are the CPU's (ds_kv_fp8_quant_row)
 * exactly, an expanded segment's gathered values are the CPU's dequantized ones exactly, and the
 * absorbed attention over an FP8 pool (block per head and all heads a block) matches the CPU kernel
 * over the same pool. */
#include "cuda_check.h"

/* [n][R + dr] latent values whose 128-value tiles span many magnitudes (so each tile's scale
 * differs), with one all-zero tile (the floor scale) and a NaN-free range past 448 * scale. */
static float *kv_rows(int n, int R, int dr) {
    const int row = R + dr;
    float *x = rand_f32((size_t)n * row, -1, 1);
    for (int i = 0; i < n; i++)
        for (int k = 0; k < R; k++) {
            const int tile = k / DS_KV_FP8_TILE;
            x[(size_t)i * row + k] *=
                i == 1 && tile == 0 ? 0.0f : powf(10.0f, (float)(i % 7 - 3 + tile));
        }
    return x;
}

/* The stored bytes of n rows scattered to the pool rows dst (a permutation), GPU vs CPU, then
 * those rows gathered back as floats. */
static void check_store_gather(ds_cu *c, int n, int R, int dr) {
    const int row = R + dr, n_pool = n + 5;
    const size_t rb = ds_kv_fp8_row_bytes(R, dr);
    float *x = kv_rows(n, R, dr);
    int32_t *dst = malloc((size_t)n * 4);
    /* a permutation into the pool, from its end (a stride sharing a factor with n_pool would
     * send two rows to one place, and which write lands there last would be a race) */
    for (int i = 0; i < n; i++) dst[i] = (int32_t)(n_pool - 1 - i);
    uint8_t *ref = calloc((size_t)n_pool, rb), *got = malloc((size_t)n_pool * rb);
    for (int i = 0; i < n; i++)
        ds_kv_fp8_quant_row(ref + (size_t)dst[i] * rb, x + (size_t)i * row, R, dr);
    uint8_t *dpool = dev(c, ref, (size_t)n_pool * rb); /* rows not written keep the CPU's bytes */
    for (int i = 0; i < n; i++) poison(c, dpool + (size_t)dst[i] * rb, rb);
    float *dx = dev(c, x, (size_t)n * row * 4);
    int32_t *ddst = dev(c, dst, (size_t)n * 4);
    ds_err err = {{0}};
    if (ds_cu_kv_fp8_store(c, dpool, rb, ddst, dx, (size_t)row, n, R, dr, &err)) DIE("%s", err.msg);
    fetch(c, got, dpool, (size_t)n_pool * rb);
    size_t bad = 0;
    for (size_t b = 0; b < (size_t)n_pool * rb; b++) bad += got[b] != ref[b];
    char what[96];
    snprintf(what, sizeof what, "kv fp8 store R=%d dr=%d: bytes differing", R, dr);
    report(what, (double)bad, 0);
    /* gather every written row back */
    float *cl = malloc((size_t)n * R * 4), *kr = malloc((size_t)n * dr * 4);
    float *gcl = malloc((size_t)n * R * 4), *gkr = malloc((size_t)n * dr * 4);
    for (int i = 0; i < n; i++) {
        float *v = malloc((size_t)row * 4);
        ds_kv_fp8_dequant_row(v, ref + (size_t)dst[i] * rb, R, dr);
        memcpy(cl + (size_t)i * R, v, (size_t)R * 4),
            memcpy(kr + (size_t)i * dr, v + R, (size_t)dr * 4);
        free(v);
    }
    float *dcl = dev(c, NULL, (size_t)n * R * 4), *dkr = dev(c, NULL, (size_t)n * dr * 4);
    poison(c, dcl, (size_t)n * R * 4), poison(c, dkr, (size_t)n * dr * 4);
    if (ds_cu_kv_fp8_gather(c, dcl, dkr, dpool, rb, ddst, n, R, dr, &err)) DIE("%s", err.msg);
    fetch(c, gcl, dcl, (size_t)n * R * 4), fetch(c, gkr, dkr, (size_t)n * dr * 4);
    snprintf(what, sizeof what, "kv fp8 gather R=%d dr=%d: words differing", R, dr);
    report(what,
           (double)(words_differ(gcl, cl, (size_t)n * R) + words_differ(gkr, kr, (size_t)n * dr)),
           0);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dx), ds_cu_dealloc(ddst), ds_cu_dealloc(dcl),
        ds_cu_dealloc(dkr);
    free(x), free(dst), free(ref), free(got), free(cl), free(kr), free(gcl), free(gkr);
}

/* Absorbed MLA over an FP8 pool for several sequences in one launch, against the CPU kernel over
 * the same pool one sequence at a time. all_heads as in test_cuda_mla.c's check_mla_batch. */
static void check_fp8_batch(ds_cu *c, const int *lens, const int *pos0, int n_seq, int Ha, int R,
                            int dr, int all_heads) {
    enum { BS = 16 };
    const int row = R + dr;
    const size_t rb = ds_kv_fp8_row_bytes(R, dr);
    int T = 0, max_ctx = 0, pages = 0, bt_off[64], tok_bt[512], tok_pos[512];
    for (int z = 0; z < n_seq; z++) {
        int ctx = pos0[z] + lens[z];
        bt_off[z] = pages;
        pages += (ctx + BS - 1) / BS;
        max_ctx = DS_MAX(max_ctx, ctx);
        for (int t = 0; t < lens[z]; t++) tok_bt[T + t] = bt_off[z], tok_pos[T + t] = pos0[z] + t;
        T += lens[z];
    }
    int32_t *tables = malloc((size_t)pages * 4);
    for (int i = 0; i < pages; i++) tables[i] = (int32_t)((i * 7 + 3) % pages);
    float *x = kv_rows(pages * BS, R, dr);
    uint8_t *pool = malloc((size_t)pages * BS * rb);
    for (int i = 0; i < pages * BS; i++)
        ds_kv_fp8_quant_row(pool + (size_t)i * rb, x + (size_t)i * row, R, dr);
    float *qbar = rand_f32((size_t)T * Ha * R, -0.2f, 0.2f),
          *qr = rand_f32((size_t)T * Ha * dr, -1, 1);
    float *ref = malloc((size_t)T * Ha * R * 4), *got = malloc((size_t)T * Ha * R * 4);
    const float scale = 1.0f / sqrtf(192.0f);
    for (int z = 0, t0 = 0; z < n_seq; t0 += lens[z], z++) {
        ds_latent_view kv = {pool, tables + bt_off[z], BS, row, R, 1};
        size_t at = (size_t)t0 * Ha;
        ds_mla_attend_absorbed(ref + at * R, qbar + at * R, qr + at * dr, lens[z], Ha, R, dr, &kv,
                               pos0[z], pos0[z] + lens[z], 1, scale);
    }
    uint8_t *dpool = dev(c, pool, (size_t)pages * BS * rb);
    int32_t *dtables = dev(c, tables, (size_t)pages * 4), *dbt = dev(c, tok_bt, (size_t)T * 4);
    int32_t *dpos = dev(c, tok_pos, (size_t)T * 4);
    float *dq = dev(c, qbar, (size_t)T * Ha * R * 4), *dqr = dev(c, qr, (size_t)T * Ha * dr * 4);
    float *dout = dev(c, NULL, (size_t)T * Ha * R * 4);
    poison(c, dout, (size_t)T * Ha * R * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_all_heads(c, all_heads);
    if (ds_cu_mla_attend_absorbed_batch(c, dout, dq, dqr, dr, T, Ha, R, dr, dpool, 1, dtables, dbt,
                                        dpos, max_ctx, BS, rb, scale, &err))
        DIE("%s", err.msg);
    ds_cu_set_mla_all_heads(c, 0);
    fetch(c, got, dout, (size_t)T * Ha * R * 4);
    char what[96];
    snprintf(what, sizeof what, "mla absorbed fp8 kv %d seqs Ha=%d R=%d%s", n_seq, Ha, R,
             all_heads ? " (all heads)" : "");
    report(what, rel_err(got, ref, 1, (size_t)T * Ha * R, (size_t)T * Ha * R), 1e-5);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dtables), ds_cu_dealloc(dbt), ds_cu_dealloc(dpos);
    ds_cu_dealloc(dq), ds_cu_dealloc(dqr), ds_cu_dealloc(dout);
    free(tables), free(x), free(pool), free(qbar), free(qr), free(ref), free(got);
}

void checks_kv_fp8(ds_cu *c) {
    check_store_gather(c, 37, 512, 64);
    check_store_gather(c, 9, 30, 6);  /* one short tile, rows not a multiple of 4 values */
    check_store_gather(c, 5, 200, 8); /* a full tile and a partial one */
    static const int lens[] = {1, 1, 3, 1}, pos[] = {700, 40, 300, 0};
    check_fp8_batch(c, lens, pos, 4, 8, 512, 64, 0);
    check_fp8_batch(c, lens, pos, 4, 8, 512, 64, 2);
    check_fp8_batch(c, lens, pos, 4, 32, 512, 64, 2);
    check_fp8_batch(c, lens, pos, 4, 32, 512, 64, 0);
    check_fp8_batch(c, lens, pos, 4, 2, 30, 6, 0); /* scalar loads */
}
