/* test_cuda_kv_rows.c — the FP8 and BF16 latent caches on the GPU (docs/quantization.md §4, §5)
 * against the CPU on the same rows: the GPU's stored bytes are the CPU's (kernels/shared/kv_row.h)
 * exactly, an expanded segment's gathered values are the CPU's dequantized ones exactly, and the
 * absorbed attention over such a pool (block per head, all heads a block, tensor cores) matches
 * the CPU kernel over the same pool. */
#include "cuda_check.h"

/* v [R + dr] <- the values of a stored row of dtype dt */
static void dq_row(int dt, float *v, const uint8_t *row, int R, int dr) {
    for (int i = 0; i < R + dr; i++) v[i] = ds_kv_row_value(dt, row, R, i);
}
static const char *dt_name(int dt) {
    return dt == DS_KV_FP8 ? "fp8" : "bf16";
}

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
static void check_store_gather(ds_cu *c, int dt, int n, int R, int dr) {
    const int row = R + dr, n_pool = n + 5;
    const size_t rb = ds_kv_row_bytes(dt, R, dr);
    float *x = kv_rows(n, R, dr);
    int32_t *dst = malloc((size_t)n * 4);
    /* a permutation into the pool, from its end (a stride sharing a factor with n_pool would
     * send two rows to one place, and which write lands there last would be a race) */
    for (int i = 0; i < n; i++) dst[i] = (int32_t)(n_pool - 1 - i);
    uint8_t *ref = calloc((size_t)n_pool, rb), *got = malloc((size_t)n_pool * rb);
    for (int i = 0; i < n; i++)
        ds_kv_row_store(dt, ref + (size_t)dst[i] * rb, x + (size_t)i * row, R, dr);
    uint8_t *dpool = dev(c, ref, (size_t)n_pool * rb); /* rows not written keep the CPU's bytes */
    for (int i = 0; i < n; i++) poison(c, dpool + (size_t)dst[i] * rb, rb);
    float *dx = dev(c, x, (size_t)n * row * 4);
    int32_t *ddst = dev(c, dst, (size_t)n * 4);
    ds_err err = {{0}};
    if (ds_cu_kv_store(c, dt, dpool, rb, ddst, dx, (size_t)row, n, R, dr, &err)) DIE("%s", err.msg);
    fetch(c, got, dpool, (size_t)n_pool * rb);
    size_t bad = 0;
    for (size_t b = 0; b < (size_t)n_pool * rb; b++) bad += got[b] != ref[b];
    char what[160];
    snprintf(what, sizeof what, "kv %s store R=%d dr=%d: bytes differing", dt_name(dt), R, dr);
    report(what, (double)bad, 0);
    /* gather every written row back */
    float *cl = malloc((size_t)n * R * 4), *kr = malloc((size_t)n * dr * 4);
    float *gcl = malloc((size_t)n * R * 4), *gkr = malloc((size_t)n * dr * 4);
    for (int i = 0; i < n; i++) {
        float *v = malloc((size_t)row * 4);
        dq_row(dt, v, ref + (size_t)dst[i] * rb, R, dr);
        memcpy(cl + (size_t)i * R, v, (size_t)R * 4),
            memcpy(kr + (size_t)i * dr, v + R, (size_t)dr * 4);
        free(v);
    }
    float *dcl = dev(c, NULL, (size_t)n * R * 4), *dkr = dev(c, NULL, (size_t)n * dr * 4);
    poison(c, dcl, (size_t)n * R * 4), poison(c, dkr, (size_t)n * dr * 4);
    if (ds_cu_kv_gather(c, dt, dcl, dkr, dpool, rb, ddst, n, R, dr, &err)) DIE("%s", err.msg);
    fetch(c, gcl, dcl, (size_t)n * R * 4), fetch(c, gkr, dkr, (size_t)n * dr * 4);
    snprintf(what, sizeof what, "kv %s gather R=%d dr=%d: words differing", dt_name(dt), R, dr);
    report(what,
           (double)(words_differ(gcl, cl, (size_t)n * R) + words_differ(gkr, kr, (size_t)n * dr)),
           0);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dx), ds_cu_dealloc(ddst), ds_cu_dealloc(dcl),
        ds_cu_dealloc(dkr);
    free(x), free(dst), free(ref), free(got), free(cl), free(kr), free(gcl), free(gkr);
}

/* The smallest gap, over every query row, between its two highest scores (float64, over the
 * dequantized rows): how near the one-row softmax of a large q_amp comes to a tie. */
static double top_gap(int dt, const float *qbar, const float *qr, const uint8_t *pool,
                      const int32_t *tables, const int *bt_off, const int *lens, const int *pos0,
                      int n_seq, int Ha, int R, int dr, int bs, float scale) {
    const size_t rb = ds_kv_row_bytes(dt, R, dr);
    double gap = INFINITY;
    float *v = malloc((size_t)(R + dr) * 4); /* [R + dr] one dequantized row */
    for (int z = 0, t = 0; z < n_seq; z++)
        for (int k = 0; k < lens[z]; k++, t++)
            for (int h = 0; h < Ha; h++) {
                const float *qb = qbar + ((size_t)t * Ha + h) * R,
                            *qp = qr + ((size_t)t * Ha + h) * dr;
                double b1 = -INFINITY, b2 = -INFINITY;
                for (int j = 0; j <= pos0[z] + k; j++) {
                    const int32_t pg = tables[bt_off[z] + j / bs];
                    dq_row(dt, v, pool + ((size_t)pg * bs + j % bs) * rb, R, dr);
                    double d = 0;
                    for (int i = 0; i < R; i++) d += (double)qb[i] * v[i];
                    for (int i = 0; i < dr; i++) d += (double)qp[i] * v[R + i];
                    d *= scale;
                    if (d > b1)
                        b2 = b1, b1 = d;
                    else if (d > b2)
                        b2 = d;
                }
                if (b2 > -INFINITY) gap = DS_MIN(gap, b1 - b2);
            }
    free(v);
    return gap;
}

/* The absorbed kernel over the pool dpool (rows of dtype dt, rb bytes) into got [T][Ha][R]. */
static void run_absorbed(ds_cu *c, float *got, const void *dpool, int dt, size_t rb, int T, int Ha,
                         int R, int dr, const float *dq, const float *dqr, const int32_t *dtables,
                         const int32_t *dbt, const int32_t *dpos, int max_ctx, int bs, float scale,
                         int all_heads) {
    float *dout = dev(c, NULL, (size_t)T * Ha * R * 4);
    poison(c, dout, (size_t)T * Ha * R * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_all_heads(c, all_heads >= 3 ? 0 : all_heads);
    ds_cu_set_mla_decode_tc(c, all_heads >= 3);
    ds_cu_set_mla_decode_tc_tile(c, all_heads == 4 || all_heads == 5 ? 64 : 32);
    ds_cu_set_mla_decode_tc_warps(c, all_heads == 5 ? 16 : 8);
    ds_cu_set_mla_decode_ws(c, all_heads >= 6);
    ds_cu_set_mla_ws_oconv(c, all_heads == 7);
    if (ds_cu_mla_attend_absorbed_batch(c, dout, dq, dqr, dr, T, Ha, R, dr, dpool, dt, dtables, dbt,
                                        dpos, max_ctx, bs, rb, scale, &err))
        DIE("%s", err.msg);
    ds_cu_set_mla_all_heads(c, 0);
    ds_cu_set_mla_decode_tc(c, 0);
    ds_cu_set_mla_decode_tc_tile(c, 32);
    ds_cu_set_mla_decode_tc_warps(c, 8);
    ds_cu_set_mla_decode_ws(c, 0);
    ds_cu_set_mla_ws_oconv(c, 0);
    fetch(c, got, dout, (size_t)T * Ha * R * 4);
    ds_cu_dealloc(dout);
}

/* Set around FP8 runs whose tiles' scales are rounded to powers of two in the stored rows (see
 * check_q_batch). */
static int g_pow2_scales;

/* Absorbed MLA over an FP8 or BF16 pool (dt) for several sequences in one launch, against the CPU
 * kernel over the same pool one sequence at a time, and against the same GPU kernel over the
 * dequantized rows in f32 (the FP8 and BF16 templates widen in registers and otherwise run the
 * f32 one's arithmetic in its order, so the two agree bit for bit, however ill-conditioned the
 * softmax). all_heads as in
 * test_cuda_mla.c's check_mla_batch. q_amp scales the queries: the rows' magnitudes span 1e-3 ..
 * 1e6 (kv_rows), so at q_amp 1 the scores are ~1e4 apart and the softmax picks one row, where a
 * near tie between two rows amplifies the CPU's and the GPU's different summation orders (a
 * relative 1e-7 of a 1e4 score moves the weights by 1e-3): such a run (R over one tile) is
 * compared with the f32 kernel alone. A small q_amp keeps the softmax spread over several rows and
 * the comparison with the CPU at f32 rounding. all_heads 3: on tensor cores (BF16 operands: 1e-2
 * from the CPU; the BF16 rows reach the same BF16 values as the f32 rows', so the same bits; the
 * FP8 rows' codes enter unrounded, their scales elsewhere: below). */
static void check_q_batch(ds_cu *c, int dt, const int *lens, const int *pos0, int n_seq, int Ha,
                          int R, int dr, int all_heads, float q_amp) {
    enum { BS = 16 };
    const int row = R + dr;
    const size_t rb = ds_kv_row_bytes(dt, R, dr);
    int T, max_ctx, bt_off[64], tok_bt[512], tok_pos[512];
    int32_t *tables;
    const int pages =
        mla_batch_layout(lens, pos0, n_seq, BS, bt_off, tok_bt, tok_pos, &T, &max_ctx, &tables);
    float *x = kv_rows(pages * BS, R, dr);
    uint8_t *pool = malloc((size_t)pages * BS * rb);
    for (int i = 0; i < pages * BS; i++)
        ds_kv_row_store(dt, pool + (size_t)i * rb, x + (size_t)i * row, R, dr);
    if (dt == DS_KV_FP8 && g_pow2_scales) /* each tile's scale to its nearest power of two */
        for (int i = 0; i < pages * BS; i++)
            for (int j = 0; j < ds_kv_fp8_tiles(R); j++) {
                uint8_t *at = pool + (size_t)i * rb + R + 4 * j;
                float s;
                memcpy(&s, at, 4);
                s = exp2f(rintf(log2f(s)));
                memcpy(at, &s, 4);
            }
    float *qbar = rand_f32((size_t)T * Ha * R, -0.2f * q_amp, 0.2f * q_amp),
          *qr = rand_f32((size_t)T * Ha * dr, -q_amp, q_amp);
    float *ref = malloc((size_t)T * Ha * R * 4), *got = malloc((size_t)T * Ha * R * 4);
    const float scale = 1.0f / sqrtf(192.0f);
    for (int z = 0, t0 = 0; z < n_seq; t0 += lens[z], z++) {
        ds_latent_view kv = {pool, tables + bt_off[z], BS, row, R, dt};
        size_t at = (size_t)t0 * Ha;
        ds_mla_attend_absorbed(ref + at * R, qbar + at * R, qr + at * dr, lens[z], Ha, R, dr, &kv,
                               pos0[z], pos0[z] + lens[z], 1, scale);
    }
    /* the same rows dequantized, as an f32 pool [pages * BS][R + dr] */
    float *deq = malloc((size_t)pages * BS * row * 4), *got32 = malloc((size_t)T * Ha * R * 4);
    for (int i = 0; i < pages * BS; i++)
        dq_row(dt, deq + (size_t)i * row, pool + (size_t)i * rb, R, dr);
    uint8_t *dpool = dev(c, pool, (size_t)pages * BS * rb);
    float *dpool32 = dev(c, deq, (size_t)pages * BS * row * 4);
    int32_t *dtables = dev(c, tables, (size_t)pages * 4), *dbt = dev(c, tok_bt, (size_t)T * 4);
    int32_t *dpos = dev(c, tok_pos, (size_t)T * 4);
    float *dq = dev(c, qbar, (size_t)T * Ha * R * 4), *dqr = dev(c, qr, (size_t)T * Ha * dr * 4);
    run_absorbed(c, got, dpool, dt, rb, T, Ha, R, dr, dq, dqr, dtables, dbt, dpos, max_ctx, BS,
                 scale, all_heads);
    run_absorbed(c, got32, dpool32, 0, (size_t)row * 4, T, Ha, R, dr, dq, dqr, dtables, dbt, dpos,
                 max_ctx, BS, scale, all_heads);
    char what[160];
    const char *form = all_heads == 7
                           ? " (tensor cores, warp-specialized, FP8 scores from the codes)"
                       : all_heads == 6 ? " (tensor cores, warp-specialized)"
                       : all_heads == 5 ? " (tensor cores, 64-row tiles, 16 warps)"
                       : all_heads == 4 ? " (tensor cores, 64-row tiles)"
                       : all_heads == 3 ? " (tensor cores)"
                       : all_heads      ? " (all heads)"
                                        : "";
    snprintf(what, sizeof what, "mla absorbed %s kv %d seqs Ha=%d R=%d q*%g%s", dt_name(dt), n_seq,
             Ha, R, q_amp, form);
    const double cpu_err = rel_err(got, ref, 1, (size_t)T * Ha * R, (size_t)T * Ha * R);
    if (q_amp < 1.0f || R <= DS_KV_FP8_TILE) /* (the one-row softmax: see above) */
        report(what, cpu_err, all_heads >= 3 ? 1e-2 : 1e-5);
    else
        printf(
            "  (%s vs the CPU: rel err %.2e; the closest two best scores of a query %.3g "
            "apart)\n",
            what, cpu_err,
            top_gap(dt, qbar, qr, pool, tables, bt_off, lens, pos0, n_seq, Ha, R, dr, BS, scale));
    /* FP8 rows on tensor cores: the codes enter the products exactly and their scales on the
     * query's and P's side (mla_decode_tc.cu), where the f32 pool's rows are c s rounded to BF16
     * and P unscaled, so the two differ by BF16 roundings (the CPU check above holds). With the
     * scales powers of two (g_pow2_scales) both forms multiply the same BF16 values in the same
     * order (32-row tiles: the f32 pool's own; the scores' k-steps are grouped otherwise, so f32
     * rounding apart, which may move a weight across a BF16 rounding boundary now and then): each
     * output row (a token's head) against the f32 pool's, so that a row of small values is held
     * to its own scale, not the largest rows' */
    const int f8tc = dt == DS_KV_FP8 && all_heads >= 3;
    if (f8tc && g_pow2_scales && q_amp < 1.0f && (all_heads == 3 || all_heads >= 6)) {
        double worst = 0;
        for (size_t i = 0; i < (size_t)T * Ha; i++)
            worst = DS_MAX(worst, rel_err(got + i * R, got32 + i * R, 1, (size_t)R, (size_t)R));
        snprintf(what, sizeof what,
                 "mla absorbed %s kv Ha=%d R=%d q*%g%s, scales 2^k: each row vs f32 rows",
                 dt_name(dt), Ha, R, q_amp, form);
        report(what, worst, 5e-3);
    }
    /* (64-row tiles are for quantized rows only: the f32 pool's run takes 32-row tiles, whose
     * online softmax rescales at other rows, so the bits differ; the CPU check above holds) */
    if (!f8tc && (all_heads < 4 || all_heads == 6)) {
        snprintf(what, sizeof what, "mla absorbed %s kv Ha=%d R=%d q*%g%s: vs f32 words",
                 dt_name(dt), Ha, R, q_amp, form);
        report(what, (double)words_differ(got, got32, (size_t)T * Ha * R), 0);
    }
    /* warp-specialized: the 8-warp 32-row kernel's products, softmax and orders, so its words;
     * with the FP8 scores from the staged codes (7) each k-step adds its 16 channels in another
     * order, so f32 rounding apart, which may move a softmax weight across a BF16 rounding now
     * and then (2^-8 of one weight) */
    if (all_heads >= 6) {
        run_absorbed(c, got32, dpool, dt, rb, T, Ha, R, dr, dq, dqr, dtables, dbt, dpos, max_ctx,
                     BS, scale, 3);
        const int raw = all_heads == 7 && dt == DS_KV_FP8;
        snprintf(what, sizeof what, "mla absorbed %s kv Ha=%d R=%d q*%g%s: vs 8 warps%s",
                 dt_name(dt), Ha, R, q_amp, form, raw ? "" : ", words");
        if (raw)
            report(what, rel_err(got, got32, 1, (size_t)T * Ha * R, (size_t)T * Ha * R), 1e-3);
        else
            report(what, (double)words_differ(got, got32, (size_t)T * Ha * R), 0);
    }
    /* 16 warps a block: the 8-warp kernel's products and maxima in its order; only a head's sum
     * of P is added in other groups (16 threads a head instead of 8), so f32 rounding apart */
    if (all_heads == 5) {
        run_absorbed(c, got32, dpool, dt, rb, T, Ha, R, dr, dq, dqr, dtables, dbt, dpos, max_ctx,
                     BS, scale, 4);
        snprintf(what, sizeof what, "mla absorbed %s kv Ha=%d R=%d q*%g%s: vs 8 warps", dt_name(dt),
                 Ha, R, q_amp, form);
        report(what, rel_err(got, got32, 1, (size_t)T * Ha * R, (size_t)T * Ha * R), 1e-6);
    }
    ds_cu_dealloc(dpool), ds_cu_dealloc(dpool32), ds_cu_dealloc(dtables), ds_cu_dealloc(dbt);
    ds_cu_dealloc(dpos), ds_cu_dealloc(dq), ds_cu_dealloc(dqr);
    free(tables), free(x), free(pool), free(qbar), free(qr), free(ref), free(got), free(deq),
        free(got32);
}

void checks_kv_rows(ds_cu *c) {
    for (int dt = DS_KV_FP8; dt <= DS_KV_BF16; dt++) {
        check_store_gather(c, dt, 37, 512, 64);
        check_store_gather(c, dt, 9, 30, 6);  /* one short tile, rows not a multiple of 4 values */
        check_store_gather(c, dt, 5, 200, 8); /* a full tile and a partial one */
        static const int lens[] = {1, 1, 3, 1}, pos[] = {700, 40, 300, 0};
        /* q*1e-4: scores of a few units; q*1: one row takes the softmax (compared with the f32
         * kernel only) */
        static const float amp[] = {1e-4f, 1.0f};
        for (int a = 0; a < 2; a++) {
            check_q_batch(c, dt, lens, pos, 4, 8, 512, 64, 0, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 8, 512, 64, 2, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 2, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 0, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 3, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 16, 512, 64, 3, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 4, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 16, 512, 64, 4, amp[a]);
        }
        check_q_batch(c, dt, lens, pos, 4, 2, 30, 6, 0, 1.0f); /* scalar loads */
        /* one long context on tensor cores: 132 splits of ten tiles, each ring's stages reused */
        static const int llen[] = {1}, lpos[] = {40000};
        check_q_batch(c, dt, llen, lpos, 1, 32, 512, 64, 3, 1e-4f);
        check_q_batch(c, dt, llen, lpos, 1, 32, 512, 64, 4, 1e-4f);
        if (dt == DS_KV_BF16) { /* 16 warps a block (BF16 rows, 64-row tiles) */
            for (int a = 0; a < 2; a++) {
                check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 5, amp[a]);
                check_q_batch(c, dt, lens, pos, 4, 16, 512, 64, 5, amp[a]);
            }
            check_q_batch(c, dt, llen, lpos, 1, 32, 512, 64, 5, 1e-4f);
        }
        /* the warp-specialized form (FP8 and BF16 rows; the long context takes every split's
         * tiles through the ring of four) */
        for (int a = 0; a < 2; a++) {
            check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 6, amp[a]);
            check_q_batch(c, dt, lens, pos, 4, 16, 512, 64, 6, amp[a]);
        }
        check_q_batch(c, dt, llen, lpos, 1, 32, 512, 64, 6, 1e-4f);
        check_q_batch(c, dt, llen, lpos, 1, 16, 512, 64, 6, 1e-4f);
        if (dt == DS_KV_FP8) { /* that form's FP8 scores from the staged codes (OCV) */
            for (int a = 0; a < 2; a++) {
                check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, 7, amp[a]);
                check_q_batch(c, dt, lens, pos, 4, 16, 512, 64, 7, amp[a]);
            }
            check_q_batch(c, dt, llen, lpos, 1, 32, 512, 64, 7, 1e-4f);
            check_q_batch(c, dt, llen, lpos, 1, 16, 512, 64, 7, 1e-4f);
        }
        if (dt == DS_KV_FP8) { /* each output row of the tensor-core forms (above) */
            g_pow2_scales = 1;
            for (int ah = 3; ah <= 7; ah += ah == 3 ? 3 : 1) {
                check_q_batch(c, dt, lens, pos, 4, 32, 512, 64, ah, 1e-4f);
                check_q_batch(c, dt, lens, pos, 4, 16, 512, 64, ah, 1e-4f);
                check_q_batch(c, dt, llen, lpos, 1, 32, 512, 64, ah, 1e-4f);
            }
            g_pow2_scales = 0;
        }
    }
}
