/* test_cuda_mla.c — MLA against the CPU: absorbed (one sequence, a step's batch, all heads a
 * block) and expanded (split, cuBLAS, fused); the MLA timings. */
#include "cuda_check.h"

/* Absorbed MLA over a paged pool whose block table is shuffled (pages out of order). */
static void check_mla(ds_cu *c, int T, int Ha, int R, int dr, int pos0, int n_ctx, int causal) {
    enum { BS = 16 };
    int rowf = R + dr, n_rows = n_ctx, n_pages = n_rows / BS + 2;
    float *pool = rand_f32((size_t)n_pages * BS * rowf, -1, 1);
    int32_t *table = malloc((size_t)n_pages * 4);
    for (int i = 0; i < n_pages; i++) table[i] = (int32_t)((i * 7 + 3) % n_pages);
    float *qbar = rand_f32((size_t)T * Ha * R, -0.2f, 0.2f),
          *qr = rand_f32((size_t)T * Ha * dr, -1, 1);
    float *ref = malloc((size_t)T * Ha * R * 4), *got = malloc((size_t)T * Ha * R * 4);
    ds_latent_view kv = {pool, table, BS, rowf, R, 0};
    float scale = 1.0f / sqrtf(192.0f);
    ds_mla_attend_absorbed(ref, qbar, qr, T, Ha, R, dr, &kv, pos0, n_ctx, causal, scale);
    float *dpool = dev(c, pool, (size_t)n_pages * BS * rowf * 4);
    int32_t *dtable = dev(c, table, (size_t)n_pages * 4);
    float *dq = dev(c, qbar, (size_t)T * Ha * R * 4), *dqr = dev(c, qr, (size_t)T * Ha * dr * 4);
    float *dout = dev(c, NULL, (size_t)T * Ha * R * 4);
    poison(c, dout, (size_t)T * Ha * R * 4);
    ds_err err = {{0}};
    if (ds_cu_mla_attend_absorbed(c, dout, dq, dqr, T, Ha, R, dr, dpool, dtable, BS, rowf, pos0,
                                  n_ctx, causal, scale, &err))
        DIE("%s", err.msg);
    fetch(c, got, dout, (size_t)T * Ha * R * 4);
    char what[96];
    snprintf(what, sizeof what, "mla absorbed T=%d Ha=%d R=%d %s %d", T, Ha, R,
             causal ? "causal from" : "context", causal ? pos0 : n_ctx);
    report(what, rel_err(got, ref, 1, (size_t)T * Ha * R, (size_t)T * Ha * R), 1e-5);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dtable), ds_cu_dealloc(dq), ds_cu_dealloc(dqr);
    ds_cu_dealloc(dout);
    free(pool), free(table), free(qbar), free(qr), free(ref), free(got);
}

/* Absorbed MLA for several sequences' tokens in one launch, each against its own block table and
 * positions, against the CPU one sequence at a time. */
/* all_heads: a block per token for every head (each latent row read once): 2 always, 1 when the
 * step fills the GPU (ds_cu_set_mla_all_heads); 3: on tensor cores (ds_cu_set_mla_decode_tc, BF16
 * operands: 1e-2). The splits are merged as check_merge_warps says (ds_cu_set_mla_merge_warps). */
static int check_merge_warps;
static void check_mla_batch(ds_cu *c, const int *lens, const int *pos0, int n_seq, int Ha, int R,
                            int dr, int all_heads) {
    enum { BS = 16 };
    int rowf = R + dr, T, max_ctx, bt_off[256], tok_bt[512], tok_pos[512];
    int32_t *tables; /* a scrambled permutation of the pool's pages */
    const int pages =
        mla_batch_layout(lens, pos0, n_seq, BS, bt_off, tok_bt, tok_pos, &T, &max_ctx, &tables);
    float *pool = rand_f32((size_t)pages * BS * rowf, -1, 1);
    float *qbar = rand_f32((size_t)T * Ha * R, -0.2f, 0.2f),
          *qr = rand_f32((size_t)T * Ha * dr, -1, 1);
    float *ref = malloc((size_t)T * Ha * R * 4), *got = malloc((size_t)T * Ha * R * 4);
    float scale = 1.0f / sqrtf(192.0f);
    for (int z = 0, t0 = 0; z < n_seq; t0 += lens[z], z++) {
        ds_latent_view kv = {pool, tables + bt_off[z], BS, rowf, R, 0};
        size_t at = (size_t)t0 * Ha;
        ds_mla_attend_absorbed(ref + at * R, qbar + at * R, qr + at * dr, lens[z], Ha, R, dr, &kv,
                               pos0[z], pos0[z] + lens[z], 1, scale);
    }
    float *dpool = dev(c, pool, (size_t)pages * BS * rowf * 4);
    int32_t *dtables = dev(c, tables, (size_t)pages * 4), *dbt = dev(c, tok_bt, (size_t)T * 4);
    int32_t *dpos = dev(c, tok_pos, (size_t)T * 4);
    /* the rope parts on the device at a wider stride, as the model passes them (read in place
     * from the full query rows) */
    const int ldqr = dr + 12;
    float *qrs = calloc((size_t)T * Ha * ldqr, 4); /* [T][Ha][ldqr] */
    for (size_t i = 0; i < (size_t)T * Ha; i++) memcpy(qrs + i * ldqr, qr + i * dr, (size_t)dr * 4);
    float *dq = dev(c, qbar, (size_t)T * Ha * R * 4), *dqr = dev(c, qrs, (size_t)T * Ha * ldqr * 4);
    float *dout = dev(c, NULL, (size_t)T * Ha * R * 4);
    poison(c, dout, (size_t)T * Ha * R * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_all_heads(c, all_heads >= 3 ? 0 : all_heads);
    ds_cu_set_mla_decode_tc(c, all_heads >= 3);
    ds_cu_set_mla_merge_warps(c, check_merge_warps);
    if (ds_cu_mla_attend_absorbed_batch(c, dout, dq, dqr, ldqr, T, Ha, R, dr, dpool, 0, dtables,
                                        dbt, dpos, max_ctx, BS, (size_t)rowf * 4, scale, &err))
        DIE("%s", err.msg);
    ds_cu_set_mla_all_heads(c, 0);
    ds_cu_set_mla_decode_tc(c, 0);
    ds_cu_set_mla_merge_warps(c, 0);
    fetch(c, got, dout, (size_t)T * Ha * R * 4);
    char what[96];
    snprintf(what, sizeof what, "mla absorbed batch %d seqs Ha=%d R=%d%s%s", n_seq, Ha, R,
             all_heads == 3 ? " (tensor cores)"
             : all_heads    ? " (all heads)"
                            : "",
             check_merge_warps ? ", merge warps" : "");
    report(what, rel_err(got, ref, 1, (size_t)T * Ha * R, (size_t)T * Ha * R),
           all_heads >= 3 ? 1e-2 : 1e-5);
    ds_cu_dealloc(dpool), ds_cu_dealloc(dtables), ds_cu_dealloc(dbt), ds_cu_dealloc(dpos);
    ds_cu_dealloc(dq), ds_cu_dealloc(dqr), ds_cu_dealloc(dout);
    free(tables), free(pool), free(qbar), free(qr), free(qrs), free(ref), free(got);
}

/* gemm: the tensor-core path for long segments (BF16 operands and probabilities: 2e-2): 1 through
 * cuBLAS, 2 the fused kernel on mma.sync, 3 the fused kernel on wgmma (sm_90; else 2 again), 4
 * on wgmma with two warpgroups a block, 5 the same with its products beside the softmax. */
static void check_mla_expanded_mode(ds_cu *c, int T, int Ha, int dn, int dr, int dvh, int pos0,
                                    int n_ctx, int causal, int gemm) {
    size_t nq = (size_t)T * Ha * (dn + dr), nk = (size_t)n_ctx * Ha * dn, nr = (size_t)n_ctx * dr;
    size_t nv = (size_t)n_ctx * Ha * dvh, no = (size_t)T * Ha * dvh;
    float *q = rand_f32(nq, -0.3f, 0.3f), *kN = rand_f32(nk, -1, 1), *kR = rand_f32(nr, -1, 1);
    float *v = rand_f32(nv, -1, 1), *ref = malloc(no * 4), *got = malloc(no * 4);
    float scale = 1.0f / sqrtf((float)(dn + dr));
    ds_mla_attend_expanded(ref, q, kN, kR, v, T, n_ctx, Ha, dn, dr, dvh, pos0, causal, scale);
    float *dq = dev(c, q, nq * 4), *dkN = dev(c, kN, nk * 4), *dkR = dev(c, kR, nr * 4);
    float *dv_ = dev(c, v, nv * 4), *dout = dev(c, NULL, no * 4);
    poison(c, dout, no * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_gemm(c, gemm != 0);
    ds_cu_set_mla_flash(c, gemm >= 2 ? gemm - 1 : 0); /* fused, where the head shape has one */
    if (ds_cu_mla_attend_expanded(c, dout, dq, dkN, dkR, dv_, T, n_ctx, Ha, dn, dr, dvh, pos0,
                                  causal, scale, &err))
        DIE("%s", err.msg);
    ds_cu_set_mla_gemm(c, 0);
    ds_cu_set_mla_flash(c, 0);
    fetch(c, got, dout, no * 4);
    char what[96];
    snprintf(what, sizeof what, "mla expanded T=%d Ha=%d ctx %d%s%s", T, Ha, n_ctx,
             causal ? " causal" : "",
             gemm == 5   ? " (fused, wgmma x2 pipelined)"
             : gemm == 4 ? " (fused, wgmma x2)"
             : gemm == 3 ? " (fused, wgmma)"
             : gemm == 2 ? " (fused)"
             : gemm == 1 ? " (gemm)"
                         : "");
    report(what, rel_err(got, ref, 1, no, no), gemm ? 2e-2 : 1e-5);
    ds_cu_dealloc(dq), ds_cu_dealloc(dkN), ds_cu_dealloc(dkR), ds_cu_dealloc(dv_);
    ds_cu_dealloc(dout);
    free(q), free(kN), free(kR), free(v), free(ref), free(got);
}

/* A long context's expanded attention a block of keys at a time (the fused kernel's log-sum-exp
 * rows, ds_cu_mla_merge_lse), blocks of cb keys: against the CPU at the fused kernel's 2e-2, and
 * against the same kernel over the whole context (only the blocks' own maxima differ, which
 * moves the BF16 rounding of the probabilities: 5e-3). A block that starts after a query's
 * position is none of its business (lse -inf, weight 0). */
static void check_mla_blocks(ds_cu *c, int T, int Ha, int pos0, int cb, int flash) {
    const int dn = 128, dr = 64, dvh = 128, n_ctx = pos0 + T;
    size_t nq = (size_t)T * Ha * (dn + dr), nk = (size_t)n_ctx * Ha * dn, nr = (size_t)n_ctx * dr;
    size_t nv = (size_t)n_ctx * Ha * dvh, no = (size_t)T * Ha * dvh, nl = (size_t)T * Ha;
    float *q = rand_f32(nq, -0.3f, 0.3f), *kN = rand_f32(nk, -1, 1), *kR = rand_f32(nr, -1, 1);
    float *v = rand_f32(nv, -1, 1), *ref = malloc(no * 4), *got = malloc(no * 4);
    float *whole = malloc(no * 4);
    float scale = 1.0f / sqrtf((float)(dn + dr));
    ds_mla_attend_expanded(ref, q, kN, kR, v, T, n_ctx, Ha, dn, dr, dvh, pos0, 1, scale);
    float *dq = dev(c, q, nq * 4), *dkN = dev(c, kN, nk * 4), *dkR = dev(c, kR, nr * 4);
    float *dv_ = dev(c, v, nv * 4), *dout = dev(c, NULL, no * 4), *dob = dev(c, NULL, no * 4);
    float *dla = dev(c, NULL, nl * 4), *dlb = dev(c, NULL, nl * 4);
    poison(c, dout, no * 4);
    ds_err err = {{0}};
    ds_cu_set_mla_gemm(c, 1);
    ds_cu_set_mla_flash(c, flash); /* 1 mma.sync, 2 wgmma, 3 wgmma x2, 4 pipelined */
    if (!ds_cu_mla_lse_ok(c, T, dn, dr, dvh)) DIE("mla blocks: T=%d has no fused kernel", T);
    for (int k0 = 0; k0 < n_ctx; k0 += cb) {
        const int n = DS_MIN(cb, n_ctx - k0);
        if (ds_cu_mla_attend_expanded_lse(c, k0 ? dob : dout, k0 ? dlb : dla, dq,
                                          dkN + (size_t)k0 * Ha * dn, dkR + (size_t)k0 * dr,
                                          dv_ + (size_t)k0 * Ha * dvh, T, n, Ha, dn, dr, dvh,
                                          pos0 - k0, 1, scale, &err) ||
            (k0 && ds_cu_mla_merge_lse(c, dout, dla, dob, dlb, T * Ha, dvh, &err)))
            DIE("%s", err.msg);
    }
    fetch(c, got, dout, no * 4);
    if (ds_cu_mla_attend_expanded(c, dout, dq, dkN, dkR, dv_, T, n_ctx, Ha, dn, dr, dvh, pos0, 1,
                                  scale, &err))
        DIE("%s", err.msg);
    fetch(c, whole, dout, no * 4);
    ds_cu_set_mla_gemm(c, 0);
    ds_cu_set_mla_flash(c, 0);
    char what[96];
    const char *form = flash == 4   ? " (wgmma x2 pipelined)"
                       : flash == 3 ? " (wgmma x2)"
                       : flash == 2 ? " (wgmma)"
                                    : "";
    snprintf(what, sizeof what, "mla expanded T=%d ctx %d in blocks of %d%s", T, n_ctx, cb, form);
    report(what, rel_err(got, ref, 1, no, no), 2e-2);
    snprintf(what, sizeof what, "mla expanded T=%d ctx %d blocks of %d: vs whole%s", T, n_ctx, cb,
             form);
    report(what, rel_err(got, whole, 1, no, no), 5e-3);
    ds_cu_dealloc(dq), ds_cu_dealloc(dkN), ds_cu_dealloc(dkR), ds_cu_dealloc(dv_);
    ds_cu_dealloc(dout), ds_cu_dealloc(dob), ds_cu_dealloc(dla), ds_cu_dealloc(dlb);
    free(q), free(kN), free(kR), free(v), free(ref), free(got), free(whole);
}

static void check_mla_expanded(ds_cu *c, int T, int Ha, int dn, int dr, int dvh, int pos0,
                               int n_ctx, int causal) {
    check_mla_expanded_mode(c, T, Ha, dn, dr, dvh, pos0, n_ctx, causal, 0);
}

typedef struct mla_ctx {
    float *obar, *qbar, *qr, *pool;
    int32_t *table;
    int Ha, n_ctx;
} mla_ctx;
static void run_mla(ds_cu *c, void *p) {
    mla_ctx *x = p;
    ds_err err;
    if (ds_cu_mla_attend_absorbed(c, x->obar, x->qbar, x->qr, 1, x->Ha, 512, 64, x->pool, x->table,
                                  16, 576, x->n_ctx - 1, x->n_ctx, 1, 0.07f, &err))
        DIE("%s", err.msg);
}

/* Absorbed MLA of a decode batch: one token for each of n_seq sequences of n_ctx rows */
typedef struct mla_batch_ctx {
    float *obar, *qbar, *qr;
    void *pool;
    int32_t *tables, *tok_bt, *tok_pos;
    int n_seq, n_ctx;
    int kvd; /* the rows' dtype (DS_KV_*: f32 2,304 bytes, FP8 656, BF16 1,152) */
} mla_batch_ctx;
static void run_mla_batch(ds_cu *c, void *p) {
    mla_batch_ctx *x = p;
    ds_err err;
    if (ds_cu_mla_attend_absorbed_batch(c, x->obar, x->qbar, x->qr, 64, x->n_seq, 32, 512, 64,
                                        x->pool, x->kvd, x->tables, x->tok_bt, x->tok_pos, x->n_ctx,
                                        16, ds_kv_row_bytes(x->kvd, 512, 64), 0.07f, &err))
        DIE("%s", err.msg);
}

/* absorbed and expanded MLA */
void checks_mla(ds_cu *c) {
    check_mla(c, 1, 16, 512, 64, 700, 701, 1);
    check_mla(c, 5, 4, 512, 64, 40, 45, 1);
    check_mla(c, 4, 3, 512, 64, 30, 32, 1); /* the last two queries are capped at n_ctx */
    check_mla(c, 3, 2, 64, 16, 0, 37, 0);
    check_mla(c, 3, 2, 30, 6, 0, 37, 0);       /* rows not a multiple of 4 floats: scalar loads */
    check_mla(c, 2, 4, 512, 64, 0, 1000, 0);   /* 4 splits, one partial */
    check_mla(c, 3, 2, 512, 64, 255, 258, 1);  /* token 0 ends on a split's last row */
    check_mla(c, 2, 64, 512, 64, 300, 302, 1); /* 64 heads: the block-per-head fallback */
    check_mla_expanded(c, 40, 4, 128, 64, 128, 0, 40, 1);  /* a first prompt chunk */
    check_mla_expanded(c, 33, 3, 64, 32, 64, 300, 333, 1); /* a later chunk, 2 splits */
    check_mla_expanded(c, 5, 2, 32, 16, 48, 0, 600, 0);
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 1); /* a prompt, tensor cores */
    /* the fused kernel: a prompt, a later chunk (a partial last block of queries and keys), not
     * causal (every row sees all keys), one short of a block */
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 2);
    check_mla_expanded_mode(c, 130, 3, 128, 64, 128, 77, 207, 1, 2);
    check_mla_expanded_mode(c, 150, 2, 128, 64, 128, 0, 170, 0, 2);
    check_mla_expanded_mode(c, 129, 5, 128, 64, 128, 1, 130, 1, 2);
    check_mla_expanded_mode(c, 40, 2, 128, 64, 128, 590, 630, 1, 2); /* partial key tiles */
    /* the same on wgmma */
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 3);
    check_mla_expanded_mode(c, 130, 3, 128, 64, 128, 77, 207, 1, 3);
    check_mla_expanded_mode(c, 150, 2, 128, 64, 128, 0, 170, 0, 3);
    check_mla_expanded_mode(c, 129, 5, 128, 64, 128, 1, 130, 1, 3);
    check_mla_expanded_mode(c, 40, 2, 128, 64, 128, 590, 630, 1, 3);
    /* ... two warpgroups a block */
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 4);
    check_mla_expanded_mode(c, 130, 3, 128, 64, 128, 77, 207, 1, 4);
    check_mla_expanded_mode(c, 150, 2, 128, 64, 128, 0, 170, 0, 4);
    check_mla_expanded_mode(c, 129, 5, 128, 64, 128, 1, 130, 1, 4);
    check_mla_expanded_mode(c, 40, 2, 128, 64, 128, 590, 630, 1, 4);
    /* ... pipelined */
    check_mla_expanded_mode(c, 300, 4, 128, 64, 128, 0, 300, 1, 5);
    check_mla_expanded_mode(c, 130, 3, 128, 64, 128, 77, 207, 1, 5);
    check_mla_expanded_mode(c, 150, 2, 128, 64, 128, 0, 170, 0, 5);
    check_mla_expanded_mode(c, 129, 5, 128, 64, 128, 1, 130, 1, 5);
    check_mla_expanded_mode(c, 40, 2, 128, 64, 128, 590, 630, 1, 5);
    check_mla_expanded_mode(c, 64, 2, 128, 64, 128, 0, 64, 1, 5); /* a single tile */
    /* a long context a block of keys at a time (DS_CUDA_MLA_CTX_BLOCK): blocks of 256 over 100
     * earlier tokens and 200 queries (the second block starts after the first 156 queries'
     * positions), and blocks of 1000 that divide nothing evenly */
    check_mla_blocks(c, 200, 3, 100, 256, 1);
    check_mla_blocks(c, 150, 2, 2900, 1000, 1);
    check_mla_blocks(c, 200, 3, 100, 256, 2);
    check_mla_blocks(c, 150, 2, 2900, 1000, 2);
    check_mla_blocks(c, 200, 3, 100, 256, 3);
    check_mla_blocks(c, 150, 2, 2900, 1000, 3);
    check_mla_blocks(c, 200, 3, 100, 256, 4);
    check_mla_blocks(c, 150, 2, 2900, 1000, 4);
    check_mla_expanded_mode(c, 200, 3, 64, 32, 64, 500, 700, 1, 1); /* a later chunk */
    check_mla_expanded_mode(c, 130, 2, 32, 16, 48, 0, 1000, 0, 1);  /* not causal */
}

/* absorbed MLA over a step's sequences, each check with both merges of the splits */
static void checks_mla_batch_once(ds_cu *c);
void checks_mla_batch(ds_cu *c) {
    for (check_merge_warps = 0; check_merge_warps < 2; check_merge_warps++)
        checks_mla_batch_once(c);
    check_merge_warps = 0;
}

static void checks_mla_batch_once(ds_cu *c) {
    int mlens[4] = {1, 3, 1, 5}, mpos[4] = {0, 300, 700, 17};
    check_mla_batch(c, mlens, mpos, 4, 8, 512, 64, 0);
    check_mla_batch(c, mlens, mpos, 4, 8, 512, 64, 2);
    int dlens[3] = {1, 1, 1}, dpos[3] = {1000, 5, 257}; /* decode rows across splits */
    check_mla_batch(c, dlens, dpos, 3, 32, 512, 64, 2);
    check_mla_batch(c, dlens, dpos, 3, 32, 512, 64, 0); /* a block per head (batch 1) */
    check_mla_batch(c, mlens, mpos, 4, 2, 30, 6, 0);    /* scalar loads */
    int blens[160], bpos[160]; /* a decode batch that fills the GPU: splits of > 64 rows */
    for (int i = 0; i < 160; i++) blens[i] = 1 + (i % 7 == 0), bpos[i] = (i * 397) % 1200;
    check_mla_batch(c, blens, bpos, 160, 16, 512, 64, 1);
    /* on tensor cores: empty and partial splits and tiles, several tokens of one sequence, both
     * head counts, and one long context (132 splits of several tiles) */
    check_mla_batch(c, dlens, dpos, 3, 32, 512, 64, 3);
    check_mla_batch(c, dlens, dpos, 3, 16, 512, 64, 3);
    check_mla_batch(c, mlens, mpos, 4, 16, 512, 64, 3);
    int llen[1] = {1}, lpos[1] = {20000};
    check_mla_batch(c, llen, lpos, 1, 32, 512, 64, 3);
}

/* expanded MLA over a prompt: cuBLAS against the fused kernel */
void bench_mla_expanded(ds_cu *c, const cuda_ceilings *ceil) {
    ds_err err = {{0}};
    (void)ceil;
    /* 4c. expanded MLA over a prompt: 8192 tokens, 32 heads of 128 + 64 / 128 (causal), the
     *     cuBLAS path against the fused kernel; FLOPs: the causal half of QK^T and PV */
    {
        const int T = 8192, Ha = 32, dn = 128, dr = 64, dvh = 128;
        size_t nq = (size_t)T * Ha * (dn + dr), nk = (size_t)T * Ha * dn, nv = (size_t)T * Ha * dvh;
        float *h = rand_f32(nq, -0.3f, 0.3f);
        float *dq = dev(c, h, nq * 4), *dk = dev(c, h, nk * 4),
              *dr_ = dev(c, h, (size_t)T * dr * 4);
        float *dv_ = dev(c, h, nv * 4), *dout = dev(c, NULL, nv * 4);
        free(h);
        double flops = 2.0 * (double)T * T / 2 * Ha * (dn + dr + dvh);
        for (int fused = 0; fused < 5; fused++) { /* cuBLAS, mma.sync, wgmma (x2, pipelined) */
            ds_cu_set_mla_gemm(c, 1);
            ds_cu_set_mla_flash(c, fused);
            double best = 1e30;
            for (int r = 0; r < 3; r++) {
                ds_cu_timer *tm = ds_cu_timer_start(c);
                if (ds_cu_mla_attend_expanded(c, dout, dq, dk, dr_, dv_, T, T, Ha, dn, dr, dvh, 0,
                                              1, 0.07f, &err))
                    DIE("%s", err.msg);
                double t = ds_cu_timer_stop(c, tm);
                if (r && t < best) best = t;
            }
            printf("bench mla expanded prefill T=8192 Ha=32 (%s): %.3f ms, %.0f TFLOP/s\n",
                   fused == 4   ? "fused, wgmma x2 pipelined"
                   : fused == 3 ? "fused, wgmma x2"
                   : fused == 2 ? "fused, wgmma"
                   : fused      ? "fused"
                                : "cublas",
                   best, flops / (best * 1e-3) / 1e12);
        }
        ds_cu_set_mla_gemm(c, 0);
        ds_cu_set_mla_flash(c, 0);
        ds_cu_dealloc(dq), ds_cu_dealloc(dk), ds_cu_dealloc(dr_), ds_cu_dealloc(dv_);
        ds_cu_dealloc(dout);
    }
}

/* 5c. one decode token over a long context (32K, 128K, 1M rows), 32 heads: the all-heads f32
 *     kernel against the tensor-core one, f32, FP8 and BF16 rows; the bytes that must be read:
 *     every row once. Pages in order; the pool is a 64 MB random block of whole rows repeated.
 *     DS_BENCH_MLA_LONG="bf16 1048576": that dtype and length only, tensor cores only (for a
 *     profiler: tools/device/ncu_tcd.sh). */
/* The timing build (pack_devbin.sh's DS_DEVBIN_CLOCKS): where the warp-specialized form's warps
 * spent their cycles over the last 12 calls, by phase (shares of each group's cycles, and each
 * group's cycles a call, all its warps summed); nothing in other builds. */
static void tcw_phases(void) {
    double now[10];
    if (ds_cu_mla_tcw_clocks(now)) return;
    static const char *phase[10] = {"LAND wait", "convert", "scores",    "S barrier", "softmax",
                                    "FULL wait", "outputs", "O barrier", "stage",     "convert"};
    for (int grp = 0; grp < 2; grp++) {
        double tot = 0;
        for (int i = 5 * grp; i < 5 * grp + 5; i++) tot += now[i];
        printf("bench mla warp-specialized phases, %s warps (%.4g cycles a call, all warps):",
               grp ? "O" : "S", tot / 12.0);
        for (int i = 5 * grp; i < 5 * grp + 5; i++)
            printf(" %s %.1f%%", phase[i], tot > 0 ? 100.0 * now[i] / tot : 0.0);
        printf("\n");
    }
}

/* The same call GRAPH_CALLS times back to back from one graph, the replay's time a call: a call's
 * own launches and the event around it left out, as FlashInfer's peer is timed
 * (tools/device/flashinfer_mla_bench.py): what the kernels take where a decode step's graph
 * runs them. */
enum { GRAPH_CALLS = 20 };
static void run_graph(ds_cu *c, void *p) {
    ds_err err;
    if (ds_cu_graph_launch(c, p, &err)) DIE("%s", err.msg);
}
static void graph_ms(ds_cu *c, mla_batch_ctx *bc, const char *dtn, const char *tag) {
    ds_err err = {{0}};
    ds_cu_graph *g = NULL;
    if (ds_cu_capture_begin(c, &err)) DIE("%s", err.msg);
    for (int i = 0; i < GRAPH_CALLS; i++) run_mla_batch(c, bc);
    if (ds_cu_capture_end(c, &g, &err)) DIE("%s", err.msg);
    const double ms = median_ms(c, run_graph, g, 1, 5); /* a replay: GRAPH_CALLS calls */
    printf(
        "bench mla absorbed decode 1 x %d rows, Ha=32, %s rows (tensor cores, warp-specialized%s, "
        "graph of %d): %.4f ms a call\n",
        bc->n_ctx, dtn, tag, GRAPH_CALLS, ms / GRAPH_CALLS);
    ds_cu_graph_free(g);
}

static void bench_mla_long(ds_cu *c, double copy_gbs) {
    static const int ctxs[] = {32768, 131072, 1048576};
    ds_err err = {{0}};
    const size_t block = (size_t)64 << 20;
    uint8_t *h = (uint8_t *)rand_f32(block / 4, -1, 1);
    const char *only = getenv("DS_BENCH_MLA_LONG");
    char only_dt[16] = "";
    int only_ctx = 0;
    if (only && sscanf(only, "%15s %d", only_dt, &only_ctx) != 2)
        DIE("DS_BENCH_MLA_LONG: %s", only);
    for (int kvd = DS_KV_F32; kvd <= DS_KV_BF16; kvd++)
        for (size_t i = 0; i < DS_ARRAY_LEN(ctxs); i++) {
            mla_batch_ctx bc = {0};
            bc.n_seq = 1, bc.n_ctx = ctxs[i], bc.kvd = kvd;
            const int f8 = kvd == DS_KV_FP8;
            const char *dtn = f8 ? "fp8" : kvd == DS_KV_BF16 ? "bf16" : "f32";
            const size_t rb = ds_kv_row_bytes(kvd, 512, 64), bytes = (size_t)bc.n_ctx * rb;
            if (kvd == DS_KV_BF16 && i == 0) /* finite BF16 values: exponents below 128 */
                for (size_t k = 0; k < block / 2; k++) ((uint16_t *)h)[k] &= 0xbfffu;
            if (f8 && i == 0) /* valid rows once: codes of h's bytes (0x7f/0xff, NaN, made
                               * finite), scales 1 */
                for (size_t r = 0; r < block / rb; r++) {
                    uint8_t *row = h + r * rb;
                    for (int k = 0; k < 512; k++) row[k] &= 0x7e;
                    for (int k = 0; k < 4; k++) memcpy(row + 512 + 4 * k, &(float){1.0f}, 4);
                    memset(row + 528, 0x3f, 128); /* rope: BF16 0x3f3f, ~0.75 */
                }
            if (only && (strcmp(only_dt, dtn) || only_ctx != bc.n_ctx)) continue;
            bc.pool = dev(c, NULL, bytes);
            const size_t piece = block / rb * rb; /* whole rows */
            for (size_t at = 0; at < bytes; at += piece)
                if (ds_cu_upload(c, (uint8_t *)bc.pool + at, h, DS_MIN(piece, bytes - at), &err))
                    DIE("%s", err.msg);
            const int pages = bc.n_ctx / 16;
            int32_t *tb = malloc((size_t)pages * 4), zero = 0, pos = bc.n_ctx - 1;
            if (!tb) DIE("out of memory");
            for (int p = 0; p < pages; p++) tb[p] = p;
            bc.tables = dev(c, tb, (size_t)pages * 4), bc.tok_bt = dev(c, &zero, 4);
            bc.tok_pos = dev(c, &pos, 4);
            free(tb);
            float *q = rand_f32((size_t)32 * 512, -0.1f, 0.1f);
            bc.qbar = dev(c, q, (size_t)32 * 512 * 4), bc.qr = dev(c, q, (size_t)32 * 64 * 4);
            free(q);
            bc.obar = dev(c, NULL, (size_t)32 * 512 * 4);
            /* tc 0: the f32 all-heads kernel; 1: tensor cores; 2: with 64-row tiles (quantized
             * rows); 3: and 16 warps a block (BF16 rows); 4: the warp-specialized form; 5: its FP8
             * scores from the staged codes, each output warp converting its own columns */
            const int n_tc = kvd == DS_KV_F32 ? 2 : kvd == DS_KV_FP8 ? 6 : 5;
            for (int tc = only ? 1 : 0; tc < n_tc; tc++) {
                if (kvd == DS_KV_FP8 && tc == 3) continue; /* (16 warps: BF16 rows only) */
                ds_cu_set_mla_all_heads(c, tc ? 0 : 2);
                ds_cu_set_mla_decode_tc(c, tc > 0);
                ds_cu_set_mla_decode_tc_tile(c, tc == 2 || tc == 3 ? 64 : 32);
                ds_cu_set_mla_decode_tc_warps(c, tc == 3 ? 16 : 8);
                ds_cu_set_mla_decode_ws(c, tc >= 4);
                ds_cu_set_mla_ws_oconv(c, tc == 5);
                double clk[10];
                ds_cu_mla_tcw_clocks(clk); /* (zeroes them) */
                const double ms = median_ms(c, run_mla_batch, &bc, 2, 10);
                printf("bench mla absorbed decode 1 x %d rows, Ha=32, %s rows (%s): %.4f ms, "
                       "%.0f GB/s of cache (%.0f%% of copy)\n",
                       bc.n_ctx, dtn,
                       tc == 5   ? "tensor cores, warp-specialized, FP8 scores from the codes"
                       : tc == 4 ? "tensor cores, warp-specialized"
                       : tc == 3 ? "tensor cores, 64-row tiles, 16 warps"
                       : tc == 2 ? "tensor cores, 64-row tiles"
                       : tc      ? "tensor cores"
                                 : "all heads, f32",
                       ms, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
                if (tc >= 4) tcw_phases();
                if (tc == 4) {
                    graph_ms(c, &bc, dtn, "");
                    /* the same with the splits merged by warps (mla_merge_w_k) */
                    ds_cu_set_mla_merge_warps(c, 1);
                    const double mw = median_ms(c, run_mla_batch, &bc, 2, 10);
                    printf("bench mla absorbed decode 1 x %d rows, Ha=32, %s rows (tensor cores, "
                           "warp-specialized, merge warps): %.4f ms\n",
                           bc.n_ctx, dtn, mw);
                    graph_ms(c, &bc, dtn, ", merge warps");
                    ds_cu_set_mla_merge_warps(c, 0);
                }
            }
            ds_cu_set_mla_all_heads(c, 0);
            ds_cu_set_mla_decode_tc(c, 0);
            ds_cu_set_mla_decode_tc_tile(c, 32);
            ds_cu_set_mla_decode_tc_warps(c, 8);
            ds_cu_set_mla_decode_ws(c, 0);
            ds_cu_set_mla_ws_oconv(c, 0);
            ds_cu_dealloc(bc.pool), ds_cu_dealloc(bc.tables), ds_cu_dealloc(bc.tok_bt);
            ds_cu_dealloc(bc.tok_pos), ds_cu_dealloc(bc.qbar), ds_cu_dealloc(bc.qr);
            ds_cu_dealloc(bc.obar);
        }
    free(h);
}

/* absorbed MLA at decode: one sequence, then batches */
void bench_mla_absorbed(ds_cu *c, const cuda_ceilings *ceil) {
    double ms;
    const double copy_gbs = ceil->copy_gbs;
    /* 5. MLA absorbed decode, one token, 32 heads (Kimi-Linear), R 512 + dr 64, f32 cache; the
     *    bytes that must be read: the context's latent rows once */
    static const int ctxs[] = {4096, 32768};
    for (size_t i = 0; i < DS_ARRAY_LEN(ctxs); i++) {
        mla_ctx mc = {0};
        mc.Ha = 32, mc.n_ctx = ctxs[i];
        int pages = mc.n_ctx / 16;
        float *h = rand_f32((size_t)mc.n_ctx * 576, -1, 1);
        mc.pool = dev(c, h, (size_t)mc.n_ctx * 576 * 4);
        free(h);
        int32_t *tb = malloc((size_t)pages * 4);
        for (int p = 0; p < pages; p++) tb[p] = (int32_t)((p * 7 + 3) % pages);
        mc.table = dev(c, tb, (size_t)pages * 4);
        free(tb);
        h = rand_f32((size_t)32 * 512, -0.1f, 0.1f);
        mc.qbar = dev(c, h, (size_t)32 * 512 * 4), mc.qr = dev(c, h, (size_t)32 * 64 * 4);
        free(h);
        mc.obar = dev(c, NULL, (size_t)32 * 512 * 4);
        ms = median_ms(c, run_mla, &mc, 3, 20);
        double bytes = (double)mc.n_ctx * 576 * 4;
        printf("bench mla absorbed decode Ha=32, %d context rows: %.4f ms, %.0f GB/s of cache "
               "(%.0f%% of copy)\n",
               mc.n_ctx, ms, bytes / (ms * 1e-3) / 1e9,
               100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        ds_cu_dealloc(mc.pool), ds_cu_dealloc(mc.table), ds_cu_dealloc(mc.qbar);
        ds_cu_dealloc(mc.qr), ds_cu_dealloc(mc.obar);
    }
    /* 5b. a decode batch's MLA: 64 and 256 sequences of 512 rows, every head's query against its
     *     own sequence (pages scattered through one pool), all heads a block against a block a
     *     head */
    static const int bseqs[] = {64, 256};
    for (size_t i = 0; i < DS_ARRAY_LEN(bseqs); i++) {
        mla_batch_ctx bc = {0};
        bc.n_seq = bseqs[i], bc.n_ctx = 512;
        const int per_seq = bc.n_ctx / 16, pages = bc.n_seq * per_seq;
        float *h = rand_f32((size_t)pages * 16 * 576, -1, 1);
        bc.pool = dev(c, h, (size_t)pages * 16 * 576 * 4);
        free(h);
        int32_t *tb = malloc((size_t)pages * 4), *bt = malloc((size_t)bc.n_seq * 4),
                *pos = malloc((size_t)bc.n_seq * 4);
        if (!tb || !bt || !pos) DIE("out of memory");
        for (int p = 0; p < pages; p++) tb[p] = (int32_t)(((long)p * 7 + 3) % pages);
        for (int z = 0; z < bc.n_seq; z++) bt[z] = z * per_seq, pos[z] = bc.n_ctx - 1;
        bc.tables = dev(c, tb, (size_t)pages * 4), bc.tok_bt = dev(c, bt, (size_t)bc.n_seq * 4);
        bc.tok_pos = dev(c, pos, (size_t)bc.n_seq * 4);
        free(tb), free(bt), free(pos);
        h = rand_f32((size_t)bc.n_seq * 32 * 512, -0.1f, 0.1f);
        bc.qbar = dev(c, h, (size_t)bc.n_seq * 32 * 512 * 4);
        bc.qr = dev(c, h, (size_t)bc.n_seq * 32 * 64 * 4);
        free(h);
        bc.obar = dev(c, NULL, (size_t)bc.n_seq * 32 * 512 * 4);
        for (int ah = 2; ah >= 0; ah -= 2) {
            ds_cu_set_mla_all_heads(c, ah);
            ms = median_ms(c, run_mla_batch, &bc, 3, 20);
            const double bytes = (double)bc.n_seq * bc.n_ctx * 576 * 4;
            printf("bench mla absorbed decode batch %d x %d rows, Ha=32 (%s): %.4f ms, %.0f GB/s "
                   "of cache (%.0f%% of copy)\n",
                   bc.n_seq, bc.n_ctx, ah ? "all heads" : "a block a head", ms,
                   bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        }
        ds_cu_set_mla_all_heads(c, 0);
        ds_cu_dealloc(bc.pool), ds_cu_dealloc(bc.tables), ds_cu_dealloc(bc.tok_bt);
        ds_cu_dealloc(bc.tok_pos), ds_cu_dealloc(bc.qbar), ds_cu_dealloc(bc.qr);
        ds_cu_dealloc(bc.obar);
    }
    bench_mla_long(c, copy_gbs);
}
