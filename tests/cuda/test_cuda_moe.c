/* test_cuda_moe.c — the MoE router and the routed experts (every path: per row, grouped,
 * tensor cores, cuBLAS, tensor-parallel halves) against the CPU; the experts' timings. */
#include "cuda_check.h"

/* Router: the same experts (exactly) and weights (to f32 rounding) as the CPU, token by token;
 * ties are made likely by quantising the logits. */
static void check_moe_route(ds_cu *c, int T, int E, int k, int n_group, int topk_group, int quirk,
                            int ties) {
    float *z = rand_f32((size_t)T * E, -4, 4), *bias = rand_f32((size_t)E, -0.1f, 0.1f);
    if (ties)
        for (size_t i = 0; i < (size_t)T * E; i++) z[i] = roundf(z[i]);
    int32_t *iref = malloc((size_t)T * k * 4), *igot = malloc((size_t)T * k * 4);
    float *wref = malloc((size_t)T * k * 4), *wgot = malloc((size_t)T * k * 4);
    for (int t = 0; t < T; t++)
        ds_moe_route(iref + (size_t)t * k, wref + (size_t)t * k, z + (size_t)t * E,
                     ties ? NULL : bias, E, k, n_group, topk_group, 1, 2.5f, quirk);
    float *dz = dev(c, z, (size_t)T * E * 4), *db = dev(c, bias, (size_t)E * 4);
    int32_t *di = dev(c, NULL, (size_t)T * k * 4);
    float *dw = dev(c, NULL, (size_t)T * k * 4);
    poison(c, dw, (size_t)T * k * 4);
    ds_err err = {{0}};
    if (ds_cu_moe_route(c, di, dw, dz, ties ? NULL : db, T, E, k, n_group, topk_group, 1, 2.5f,
                        quirk, &err))
        DIE("%s", err.msg);
    fetch(c, igot, di, (size_t)T * k * 4);
    fetch(c, wgot, dw, (size_t)T * k * 4);
    int same = !memcmp(igot, iref, (size_t)T * k * 4);
    char what[96];
    snprintf(what, sizeof what, "moe route T=%d E=%d k=%d groups %d/%d%s%s: weights", T, E, k,
             topk_group, n_group, quirk ? " quirk" : "", ties ? " ties" : "");
    report(what, same ? rel_err(wgot, wref, 1, (size_t)T * k, (size_t)T * k) : INFINITY, 1e-6);
    if (!same) printf("       (expert ids differ from the CPU's)\n");
    ds_cu_dealloc(dz), ds_cu_dealloc(db), ds_cu_dealloc(di), ds_cu_dealloc(dw);
    free(z), free(bias), free(iref), free(igot), free(wref), free(wgot);
}

/* Routed experts' random inputs, drawn in this order from the shared stream: gate|up weights gu
 * [E][2I][D] and down dn [E][D][I] (BF16), x [T][D], routing weights w [T][k], the output's
 * starting values base [T][D] (accumulate mode) and expert ids idx [T][k] in [0, E). */
typedef struct moe_inputs {
    uint16_t *gu, *dn;
    float *x, *w, *base;
    int32_t *idx;
} moe_inputs;

static moe_inputs moe_inputs_draw(int T, int k, int E, int D, int I) {
    moe_inputs m;
    m.gu = rand_bf16((size_t)E * 2 * I * D, -0.1f, 0.1f);
    m.dn = rand_bf16((size_t)E * D * I, -0.1f, 0.1f);
    m.x = rand_f32((size_t)T * D, -1, 1), m.w = rand_f32((size_t)T * k, 0, 1);
    m.base = rand_f32((size_t)T * D, -1, 1);
    m.idx = malloc((size_t)T * k * 4);
    for (int i = 0; i < T * k; i++) m.idx[i] = (int32_t)(ds_rng_next(&g_rng) % (uint64_t)E);
    return m;
}

static void moe_inputs_free(moe_inputs *m) {
    free(m->gu), free(m->dn), free(m->x), free(m->w), free(m->base), free(m->idx);
}

/* Routed experts against the CPU composed from its own kernels: per (token, slot) the expert's
 * gate and up rows (ds_matmul on BF16), the activation, the down projection, then the weighted
 * sum in slot order. */
/* gemm: the tensor-core path for long steps (activations in BF16: held to 1e-2; 5: with its down
 * pass writing BF16, 6: gate/up's too, ds_cu_set_expert_bf16_out; errors printed beside mode 1's;
 * 7: mode 6 as cuBLASLt batches, ds_cu_set_expert_lt; 8: mode 2 (skewed) likewise).
 * half: this rank holds experts [E/2, E) only, as under tensor parallelism: rows routed to the
 * others add nothing. */
static void check_moe_experts_mode(ds_cu *c, int T, int k, int E, int D, int I, int situ, int gemm,
                                   int half) {
    const int e0 = half ? E / 2 : 0, El = E - e0;
    moe_inputs in = moe_inputs_draw(T, k, E, D, I);
    uint16_t *gu = in.gu, *dn = in.dn;
    float *x = in.x, *w = in.w, *base = in.base;
    int32_t *idx = in.idx;
    if (gemm == 2 || gemm == 8) /* skewed: most rows on one local expert (several buckets) */
        for (int i = 0; i < T * k; i += 3) idx[i] = e0;
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    float *hgu = malloc((size_t)2 * I * 4), *a = malloc((size_t)I * 4), *yr = malloc((size_t)D * 4);
    for (int t = 0; t < T; t++) {
        float *o = ref + (size_t)t * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int j = 0; j < k; j++) {
            int e = idx[t * k + j];
            if (e < e0) continue; /* another rank's */
            ds_mat mgu = {gu + (size_t)e * 2 * I * D, DS_DT_BF16, 2 * I, D, NULL};
            ds_mat mdn = {dn + (size_t)e * D * I, DS_DT_BF16, D, I, NULL};
            ds_matmul(hgu, 2 * I, x + (size_t)t * D, D, 1, &mgu);
            if (situ)
                ds_act_situ(a, hgu, hgu + I, (size_t)I, 4.0f, 6.0f);
            else
                ds_act_swiglu(a, hgu, hgu + I, (size_t)I);
            ds_matmul(yr, D, a, I, 1, &mdn);
            for (int d = 0; d < D; d++) o[d] += w[t * k + j] * yr[d];
        }
        for (int d = 0; d < D; d++) o[d] += base[(size_t)t * D + d]; /* accumulate mode */
    }
    uint16_t *dgu = dev(c, gu + (size_t)e0 * 2 * I * D, (size_t)El * 2 * I * D * 2);
    uint16_t *ddn = dev(c, dn + (size_t)e0 * D * I, (size_t)El * D * I * 2);
    float *dx = dev(c, x, (size_t)T * D * 4), *dw = dev(c, w, (size_t)T * k * 4);
    float *dout = dev(c, base, (size_t)T * D * 4);
    int32_t *didx = dev(c, idx, (size_t)T * k * 4);
    ds_err err = {{0}};
    ds_cu_set_expert_gemm(c, gemm == 1 || gemm == 2 || gemm >= 5);
    ds_cu_set_expert_bf16_out(c, gemm == 5 ? 1 : gemm == 6 || gemm == 7 ? 2 : 0);
    ds_cu_set_expert_lt(c, gemm >= 7);
    const long lt0 = ds_cu_expert_lt_runs(c);
    ds_cu_set_expert_mma(c, gemm >= 3);
    ds_cu_set_expert_tc(c, gemm == 4);
    ds_cu_set_expert_mma_min(c, gemm >= 3 ? 16 : 0); /* (the engine's is 40 tokens) */
    if (ds_cu_moe_experts(c, dout, dx, didx, dw, T, k, El, e0, D, I, dgu, ddn, situ, 4.0f, 6.0f, 1,
                          &err))
        DIE("%s", err.msg);
    ds_cu_set_expert_gemm(c, 0);
    ds_cu_set_expert_bf16_out(c, 0);
    ds_cu_set_expert_mma(c, 0);
    ds_cu_set_expert_tc(c, 0);
    ds_cu_set_expert_mma_min(c, 0);
    ds_cu_set_expert_lt(c, 0);
    fetch(c, got, dout, (size_t)T * D * 4);
    if ((gemm >= 7) != (ds_cu_expert_lt_runs(c) > lt0)) /* which path ran */
        report(gemm >= 7 ? "moe experts: the cuBLASLt batches ran" : "moe experts: no cuBLASLt",
               1.0, 0.0);
    char what[160];
    snprintf(what, sizeof what, "moe experts T=%d k=%d E=%d D=%d I=%d %s%s%s", T, k, E, D, I,
             situ ? "situ" : "swiglu",
             gemm == 8   ? " (gemm, skewed, cuBLASLt)"
             : gemm == 7 ? " (gemm, BF16 outputs, cuBLASLt)"
             : gemm == 6 ? " (gemm, BF16 outputs)"
             : gemm == 5 ? " (gemm, BF16 down outputs)"
             : gemm == 4 ? " (tensor cores, streaming)"
             : gemm == 3 ? " (tensor cores)"
             : gemm == 2 ? " (gemm, skewed)"
             : gemm      ? " (gemm)"
                         : "",
             half ? " (half the experts)" : "");
    report(what, rel_err(got, ref, 1, (size_t)T * D, (size_t)T * D), gemm ? 1e-2 : 1e-5);
    ds_cu_dealloc(dgu), ds_cu_dealloc(ddn), ds_cu_dealloc(dx), ds_cu_dealloc(dw);
    ds_cu_dealloc(dout), ds_cu_dealloc(didx);
    moe_inputs_free(&in);
    free(ref), free(got), free(hgu), free(a), free(yr);
}

/* The cuBLAS path's gather from x rounded once (ds_cu_set_expert_x16) against its gather from the
 * f32 rows, on the same inputs (BF16 outputs, accumulate): the same words, so 0 differing. */
static void check_moe_x16_words(ds_cu *c, int T, int k, int E, int D, int I) {
    moe_inputs in = moe_inputs_draw(T, k, E, D, I);
    uint16_t *gu = in.gu, *dn = in.dn;
    float *x = in.x, *w = in.w, *base = in.base;
    int32_t *idx = in.idx;
    float *got[2] = {malloc((size_t)T * D * 4), malloc((size_t)T * D * 4)};
    uint16_t *dgu = dev(c, gu, (size_t)E * 2 * I * D * 2), *ddn = dev(c, dn, (size_t)E * D * I * 2);
    float *dx = dev(c, x, (size_t)T * D * 4), *dw = dev(c, w, (size_t)T * k * 4);
    float *dout[2] = {dev(c, base, (size_t)T * D * 4), dev(c, base, (size_t)T * D * 4)};
    int32_t *didx = dev(c, idx, (size_t)T * k * 4);
    ds_err err = {{0}};
    ds_cu_set_expert_gemm(c, 1);
    ds_cu_set_expert_bf16_out(c, 2);
    for (int x16 = 0; x16 < 2; x16++) {
        ds_cu_set_expert_x16(c, x16);
        if (ds_cu_moe_experts(c, dout[x16], dx, didx, dw, T, k, E, 0, D, I, dgu, ddn, 0, 0.0f, 0.0f,
                              1, &err))
            DIE("%s", err.msg);
        fetch(c, got[x16], dout[x16], (size_t)T * D * 4);
    }
    ds_cu_set_expert_gemm(c, 0);
    ds_cu_set_expert_bf16_out(c, 0);
    ds_cu_set_expert_x16(c, 0);
    char what[128];
    snprintf(what, sizeof what,
             "moe experts T=%d k=%d E=%d (gemm): x rounded once, words differing", T, k, E);
    report(what, (double)words_differ(got[1], got[0], (size_t)T * D), 0);
    ds_cu_dealloc(dgu), ds_cu_dealloc(ddn), ds_cu_dealloc(dx), ds_cu_dealloc(dw);
    ds_cu_dealloc(dout[0]), ds_cu_dealloc(dout[1]), ds_cu_dealloc(didx);
    moe_inputs_free(&in);
    free(got[0]), free(got[1]);
}

static void check_moe_experts(ds_cu *c, int T, int k, int E, int D, int I, int situ) {
    check_moe_experts_mode(c, T, k, E, D, I, situ, 0, 0);
}

/* Routed experts at the 48B widths (256 experts of 2304 x 1024, 8 a token), T tokens with
 * distinct experts each: bytes = every expert some token picked, read once (gate, up, down). */
typedef struct moe_ctx {
    float *out, *x, *w;
    int32_t *idx;
    uint16_t *gu, *dn;
    int T;
} moe_ctx;
static void run_moe(ds_cu *c, void *p) {
    moe_ctx *m = p;
    ds_err err;
    if (ds_cu_moe_experts(c, m->out, m->x, m->idx, m->w, m->T, 8, 256, 0, 2304, 1024, m->gu, m->dn,
                          0, 0.0f, 0.0f, 0, &err))
        DIE("%s", err.msg);
}

/* the router and the routed experts */
void checks_moe(ds_cu *c) {
    check_moe_route(c, 7, 256, 8, 8, 4, 0, 0);
    check_moe_route(c, 5, 64, 6, 1, 1, 0, 0);
    check_moe_route(c, 9, 32, 4, 4, 2, 1, 0);
    check_moe_route(c, 6, 48, 5, 1, 1, 0, 1);
    check_moe_experts(c, 3, 8, 64, 2304, 256, 0);
    /* one token: its routed rows straight from idx, no grouping (the 48B widths; SiTU with other
     * ranks' rows) */
    check_moe_experts(c, 1, 8, 256, 2304, 1024, 0);
    /* the down pass reading its routing before the wait: one token (direct rows), grouped rows */
    ds_cu_set_early_experts(c, 1);
    check_moe_experts(c, 1, 8, 256, 2304, 1024, 0);
    check_moe_experts(c, 40, 8, 64, 512, 256, 0);
    ds_cu_set_early_experts(c, 0);
    check_moe_experts_mode(c, 1, 8, 64, 512, 256, 1, 0, 1);
    /* one token, the rank holding fewer experts than a token picks (local ones in any slot) */
    check_moe_experts_mode(c, 1, 7, 8, 512, 256, 0, 0, 1);
    check_moe_experts(c, 5, 2, 4, 200, 72, 1);
    check_moe_experts(c, 40, 8, 64, 512, 256, 0); /* grouped: ~5 rows per expert */
    check_moe_experts(c, 6, 3, 5, 100, 36, 1);    /* D % 8 != 0: one row at a time */
    /* tensor cores from 64 rows per expert on average: padded panels, batched GEMMs */
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 1, 0); /* 2400 rows */
    check_moe_experts_mode(c, 600, 8, 64, 256, 128, 1, 1, 0); /* 4800 rows, SiTU */
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 5, 0); /* BF16 down outputs */
    check_moe_experts_mode(c, 600, 8, 64, 256, 128, 1, 5, 0);
    check_moe_experts_mode(c, 200, 8, 32, 512, 256, 0, 5, 1); /* ... half the experts */
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 6, 0); /* gate/up's outputs in BF16 too */
    check_moe_experts_mode(c, 600, 8, 64, 256, 128, 1, 6, 0);
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 2, 0); /* skewed: several size buckets */
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 7, 0); /* as cuBLASLt batches */
    check_moe_experts_mode(c, 600, 8, 64, 256, 128, 1, 7, 0);
    check_moe_experts_mode(c, 200, 8, 32, 512, 256, 0, 7, 1);
    check_moe_experts_mode(c, 300, 8, 32, 512, 256, 0, 8, 0);
    check_moe_x16_words(c, 300, 8, 32, 512, 256);
    check_moe_experts_mode(c, 40, 8, 64, 512, 256, 0, 0, 1);  /* TP: half the experts */
    check_moe_experts_mode(c, 6, 3, 8, 100, 36, 1, 0, 1);     /* ... one row at a time */
    check_moe_experts_mode(c, 200, 8, 32, 512, 256, 0, 1, 1); /* ... tensor cores (16 local) */
    check_moe_experts_mode(c, 160, 8, 64, 512, 256, 0, 0, 0); /* >= 1024 rows: chunked layout */
    check_moe_experts_mode(c, 700, 6, 48, 256, 128, 1, 0, 1); /* ... with other ranks' rows */
    /* a batch's grouped experts on tensor cores: few rows per expert, more than 16 for some,
     * other ranks' rows, a K that is not a whole number of 256-wide chunks */
    check_moe_experts_mode(c, 40, 8, 64, 512, 256, 0, 3, 0);
    check_moe_experts_mode(c, 256, 8, 32, 768, 384, 1, 3, 1);
    check_moe_experts_mode(c, 16, 8, 64, 2304, 1024, 0, 3, 0); /* the 48B widths, batch 16 */
    /* the same through the streaming tensor-core kernel: 8, 16 and 32 tokens a pass (more rows
     * than that on an expert: another pass), other ranks' rows, SiTU, the 48B widths */
    check_moe_experts_mode(c, 40, 8, 64, 512, 256, 0, 4, 0);
    check_moe_experts_mode(c, 256, 8, 32, 768, 384, 1, 4, 1);
    check_moe_experts_mode(c, 16, 8, 64, 2304, 1024, 0, 4, 0);
    check_moe_experts_mode(c, 200, 8, 16, 512, 192, 1, 4, 0); /* ~100 rows an expert */
    check_moe_experts_mode(c, 64, 8, 256, 2304, 1024, 1, 4, 1);
    check_moe_experts_mode(c, 256, 8, 256, 2304, 1024, 0, 4, 0); /* 16 tokens a pass */
}

/* routed experts at decode batches */
void bench_moe(ds_cu *c, const cuda_ceilings *ceil) {
    ds_err err = {{0}};
    double ms;
    const double copy_gbs = ceil->copy_gbs;
    /* 4d. routed experts at batch 1 and 8 (graph-free launches, so launch gaps included) */
    {
        const size_t per = (size_t)2304 * 1024;
        moe_ctx mc = {0};
        mc.gu = ds_cu_alloc(c, 256 * 2 * per * 2, &err);
        mc.dn = ds_cu_alloc(c, 256 * per * 2, &err);
        if (!mc.gu || !mc.dn ||
            ds_cu_fill_random_bf16(c, mc.gu, 256 * 2 * per, 1, 7, 0, 0, 1, 0.03f, &err) ||
            ds_cu_fill_random_bf16(c, mc.dn, 256 * per, 1, 8, 0, 0, 1, 0.03f, &err))
            DIE("%s", err.msg);
        float *h = rand_f32((size_t)8 * 2304, -1, 1);
        mc.x = dev(c, h, (size_t)8 * 2304 * 4);
        free(h);
        h = rand_f32(64, 0, 1);
        mc.w = dev(c, h, 64 * 4);
        free(h);
        int32_t ids[64]; /* 37 i mod 256: 64 distinct experts (37 is odd) */
        for (int i = 0; i < 64; i++) ids[i] = (int32_t)((i * 37) % 256);
        mc.idx = dev(c, ids, sizeof ids);
        mc.out = dev(c, NULL, (size_t)8 * 2304 * 4);
        static const int mts[] = {1, 8};
        for (size_t i = 0; i < DS_ARRAY_LEN(mts); i++) {
            mc.T = mts[i];
            ms = median_ms(c, run_moe, &mc, 3, 20);
            double bytes = (double)mc.T * 8 * 3 * per * 2;
            printf("bench moe experts T=%d (8 of 256, 2304 x 1024): %.4f ms, %.0f GB/s (%.0f%% of "
                   "copy)\n",
                   mc.T, ms, bytes / (ms * 1e-3) / 1e9,
                   100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        }
        /* batches: random routing (the bytes: every expert some token picked), the wmma kernel
         * against the streaming one */
        ds_cu_set_expert_mma(c, 1);
        static const int bts[] = {64, 256};
        for (size_t i = 0; i < DS_ARRAY_LEN(bts); i++) {
            const int T = bts[i];
            int32_t *bid = malloc((size_t)T * 8 * 4);
            int used[256] = {0}, n_used = 0;
            for (int t = 0; t < T; t++) /* 8 distinct experts a token */
                for (int j = 0; j < 8; j++) {
                    int e, dup;
                    do {
                        e = (int)(ds_rng_next(&g_rng) % 256), dup = 0;
                        for (int q = 0; q < j; q++) dup |= bid[t * 8 + q] == e;
                    } while (dup);
                    bid[t * 8 + j] = e;
                    n_used += !used[e], used[e] = 1;
                }
            float *hx = rand_f32((size_t)T * 2304, -1, 1), *hw = rand_f32((size_t)T * 8, 0, 1);
            moe_ctx bc = mc;
            bc.T = T, bc.x = dev(c, hx, (size_t)T * 2304 * 4), bc.w = dev(c, hw, (size_t)T * 32);
            bc.idx = dev(c, bid, (size_t)T * 32), bc.out = dev(c, NULL, (size_t)T * 2304 * 4);
            for (int tc = 0; tc <= 1; tc++) {
                ds_cu_set_expert_tc(c, tc);
                ms = median_ms(c, run_moe, &bc, 3, 20);
                double bytes = (double)n_used * 3 * per * 2;
                printf("bench moe experts T=%d (%d experts, %s): %.4f ms, %.0f GB/s (%.0f%% of "
                       "copy)\n",
                       T, n_used, tc ? "streaming mma" : "wmma", ms, bytes / (ms * 1e-3) / 1e9,
                       100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
            }
            ds_cu_set_expert_tc(c, 0);
            ds_cu_dealloc(bc.x), ds_cu_dealloc(bc.w), ds_cu_dealloc(bc.idx), ds_cu_dealloc(bc.out);
            free(hx), free(hw), free(bid);
        }
        ds_cu_set_expert_mma(c, 0);
        ds_cu_dealloc(mc.gu), ds_cu_dealloc(mc.dn), ds_cu_dealloc(mc.x), ds_cu_dealloc(mc.w);
        ds_cu_dealloc(mc.idx), ds_cu_dealloc(mc.out);
    }
}
