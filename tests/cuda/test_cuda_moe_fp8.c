/* test_cuda_moe_fp8.c — ptpc FP8 routed experts (docs/quantization.md §3): the experts
 * (streamed one token and grouped, tensor cores, tensor-parallel halves) against the CPU's expert
 * math, batch invariance of the streamed form, and their timings at Kimi-Linear's shape. */
#include "cuda_check.h"

#include "kernels/shared/quant.h"

/* n experts' rows x cols matrices drawn in BF16 and quantized as the loader does: codes
 * [n rows][cols], scales [n rows] */
static void rand_fp8(uint8_t **codes, float **scales, size_t nrows, int cols) {
    uint16_t *wb = rand_bf16(nrows * (size_t)cols, -0.05f, 0.05f);
    *codes = malloc(nrows * (size_t)cols);
    *scales = malloc(nrows * 4);
    ds_mat hb = {wb, DS_DT_BF16, (int)nrows, cols, NULL};
    ds_ptpc_quantize(*codes, *scales, &hb, 0, cols);
    free(wb);
}

/* k distinct experts of E a token */
static int32_t *rand_idx(int T, int k, int E) {
    int32_t *idx = malloc((size_t)T * k * 4);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < k; j++) {
            int e, dup;
            do {
                e = (int)(ds_rng_next(&g_rng) % (uint64_t)E);
                dup = 0;
                for (int i = 0; i < j; i++) dup |= idx[t * k + i] == e;
            } while (dup);
            idx[t * k + j] = e;
        }
    return idx;
}

typedef struct f8_experts {
    uint8_t *gc, *dc; /* host: [E][2I][D], [E][D][I] */
    float *gs, *dsc;  /* [E][2I], [E][D] */
    uint8_t *dgc, *ddc;
    float *dgs, *dds; /* device: experts [e0, E) */
} f8_experts;

static void f8_experts_make(ds_cu *c, f8_experts *x, int E, int e0, int D, int I) {
    const int El = E - e0;
    rand_fp8(&x->gc, &x->gs, (size_t)E * 2 * I, D);
    rand_fp8(&x->dc, &x->dsc, (size_t)E * D, I);
    x->dgc = dev(c, x->gc + (size_t)e0 * 2 * I * D, (size_t)El * 2 * I * D);
    x->dgs = dev(c, x->gs + (size_t)e0 * 2 * I, (size_t)El * 2 * I * 4);
    x->ddc = dev(c, x->dc + (size_t)e0 * D * I, (size_t)El * D * I);
    x->dds = dev(c, x->dsc + (size_t)e0 * D, (size_t)El * D * 4);
}

static void f8_experts_free(f8_experts *x) {
    ds_cu_dealloc(x->dgc), ds_cu_dealloc(x->dgs), ds_cu_dealloc(x->ddc), ds_cu_dealloc(x->dds);
    free(x->gc), free(x->gs), free(x->dc), free(x->dsc);
}

/* the device's experts into got [T][D] (mode 1: tensor cores; 2: the quantizers first; 8: one
 * token a warp a row, ds_cu_set_f8_rows; 9: K whole from 2 tokens, ds_cu_set_f8_whole_k; 14: one
 * token on wgmma, ds_cu_set_f8_wg 2; every other mode has those off) */
static void run_f8(ds_cu *c, const f8_experts *fx, float *got, const float *x, const int32_t *idx,
                   const float *w, int T, int k, int E, int e0, int D, int I, int situ, int mode) {
    float *dx = dev(c, x, (size_t)T * D * 4), *dw = dev(c, w, (size_t)T * k * 4);
    float *dout = dev(c, x, (size_t)T * D * 4); /* overwritten (accumulate 0) */
    int32_t *didx = dev(c, idx, (size_t)T * k * 4);
    ds_err err = {{0}};
    ds_cu_set_expert_mma(c, mode == 1);
    ds_cu_set_expert_mma_min(c, mode == 1 ? 16 : 0);
    ds_cu_set_f8_prequant(c, mode == 2);
    ds_cu_set_f8_split_min(c, mode == 3);
    ds_cu_set_f8_moe_waves(c, mode == 4 ? 8 : 0);
    ds_cu_set_f8_split(c, mode == 7 ? 8 : 0);
    ds_cu_set_f8_rows(c, mode == 8 ? 0 : -1);
    ds_cu_set_f8_whole_k(c, mode == 9 ? 2 : 0);
    ds_cu_set_early_experts(c, mode == 10);
    ds_cu_set_expert_gemm(c, mode >= 11 && mode <= 13);
    ds_cu_set_lt_each(c, mode == 12);
    ds_cu_set_expert_bf16_out(c, mode == 13 ? 2 : 0);
    ds_cu_set_f8_wg(c, mode == 14 ? 2 : 0);
    const long runs0 = ds_cu_expert_gemm_runs(c);
    if (ds_cu_moe_experts_fp8(c, dout, dx, didx, dw, T, k, E - e0, e0, D, I, fx->dgc, fx->dgs,
                              fx->ddc, fx->dds, situ, 4.0f, 6.0f, 0, &err) ||
        ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    if ((mode >= 11 && mode <= 13) != (ds_cu_expert_gemm_runs(c) > runs0)) /* which path ran */
        report(mode >= 11 ? "moe fp8: the cuBLASLt path ran" : "moe fp8: no cuBLASLt path", 1.0,
               0.0);
    ds_cu_set_expert_mma(c, 0);
    ds_cu_set_expert_mma_min(c, 0);
    ds_cu_set_f8_prequant(c, 0);
    ds_cu_set_f8_split_min(c, 0);
    ds_cu_set_f8_moe_waves(c, 0);
    ds_cu_set_f8_split(c, 0);
    ds_cu_set_f8_rows(c, 0);
    ds_cu_set_f8_whole_k(c, 0);
    ds_cu_set_early_experts(c, 0);
    ds_cu_set_expert_gemm(c, 0);
    ds_cu_set_lt_each(c, 0);
    ds_cu_set_expert_bf16_out(c, 0);
    ds_cu_set_f8_wg(c, 0);
    fetch(c, got, dout, (size_t)T * D * 4);
    ds_cu_dealloc(dx), ds_cu_dealloc(dw), ds_cu_dealloc(dout), ds_cu_dealloc(didx);
}

/* Routed experts against the CPU composed from its own kernels (backend/cpu/layers.c's expert
 * MLP): per (token, slot) ds_matmul on the expert's FP8 gate|up rows (the token quantized once,
 * as the CPU's gate and up products each quantize it the same way), the activation, ds_matmul on
 * its down rows (the act row quantized), the weighted sum in slot order. The sums' order differs,
 * so an activation code may land a rounding apart: tolerances 1e-3 (a wrong term gives ~1).
 * mode 0: streamed; 1: tensor cores; 2: streamed, the quantizers first (ds_cu_set_f8_prequant);
 * 3: streamed, K split down to one step a warp (ds_cu_set_f8_split_min); 4: streamed, one token's
 * experts in up to 8 blocks an SM (ds_cu_set_f8_moe_waves); 7: streamed, K's split
 * forced to 8 parts where the rule splits it (ds_cu_set_f8_split); 8: one token a warp a row
 * (ds_cu_set_f8_rows, batch invariance off: its own order of sums); 9: K whole from 2 tokens
 * (ds_cu_set_f8_whole_k); 10: one token's down pass reading its routing and first weights
 * before its wait (ds_cu_set_early_experts); 11: a long step's experts on FP8 tensor cores through
 * cuBLASLt (ds_cu_set_expert_gemm: >= 64 routed rows a local expert), pointer-array batches; 12:
 * the same one call an expert (ds_cu_set_lt_each); 13: mode 11 with the down pass's sums
 * written in BF16 (ds_cu_set_expert_bf16_out 2, the engine's default; gate/up's stay f32); 14:
 * one token on wgmma (E4M3 tensor cores, matmul_fp8_wg.cu; its own order of sums). half:
 * this rank holds experts [E/2, E) only. */
static void check_moe_fp8(ds_cu *c, int T, int k, int E, int D, int I, int situ, int mode,
                          int half) {
    const int e0 = half ? E / 2 : 0;
    f8_experts fx;
    f8_experts_make(c, &fx, E, e0, D, I);
    float *x = rand_f32((size_t)T * D, -1, 1), *w = rand_f32((size_t)T * k, 0, 1);
    int32_t *idx = rand_idx(T, k, E);
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    float *hgu = malloc((size_t)2 * I * 4), *a = malloc((size_t)I * 4), *yr = malloc((size_t)D * 4);
    for (int t = 0; t < T; t++) {
        float *o = ref + (size_t)t * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int j = 0; j < k; j++) {
            const int e = idx[t * k + j];
            if (e < e0) continue; /* another rank's */
            ds_mat mgu = {fx.gc + (size_t)e * 2 * I * D, DS_DT_F8_E4M3, 2 * I, D,
                          fx.gs + (size_t)e * 2 * I};
            ds_mat mdn = {fx.dc + (size_t)e * D * I, DS_DT_F8_E4M3, D, I, fx.dsc + (size_t)e * D};
            ds_matmul(hgu, 2 * I, x + (size_t)t * D, D, 1, &mgu);
            if (situ)
                ds_act_situ(a, hgu, hgu + I, (size_t)I, 4.0f, 6.0f);
            else
                ds_act_swiglu(a, hgu, hgu + I, (size_t)I);
            ds_matmul(yr, D, a, I, 1, &mdn);
            for (int d = 0; d < D; d++) o[d] += w[t * k + j] * yr[d];
        }
    }
    run_f8(c, &fx, got, x, idx, w, T, k, E, e0, D, I, situ, mode);
    char what[160];
    snprintf(what, sizeof what, "moe fp8 T=%d k=%d E=%d D=%d I=%d %s%s%s", T, k, E, D, I,
             situ ? "situ" : "swiglu",
             mode == 3    ? " (K split to 1 step)"
             : mode == 7  ? " (K in 8 parts)"
             : mode == 1  ? " (tensor cores)"
             : mode == 8  ? " (a warp a row)"
             : mode == 9  ? " (K whole from 2 tokens)"
             : mode == 11 ? " (cuBLASLt, batches)"
             : mode == 12 ? " (cuBLASLt, an expert a call)"
             : mode == 13 ? " (cuBLASLt, BF16 sums)"
             : mode == 14 ? " (wgmma)"
                          : "",
             half ? " (half the experts)" : "");
    /* cuBLASLt's FP8 accumulation (1.1e-4 on a product, test_cuda_matmul_fp8.c) moves some of
     * the activations' codes a rounding (1/16 of a value) the other way: 3.0-3.5e-3 measured;
     * wgmma's (mode 14) likewise: 1.1-1.4e-3 (session 49) */
    report(what, rel_err(got, ref, 1, (size_t)T * D, (size_t)T * D), mode >= 11 ? 1e-2 : 1e-3);
    if ((mode == 0 || mode == 3 || mode == 7) && T > 1) { /* batch invariance: token 0 alone */
        float *one = malloc((size_t)D * 4);
        run_f8(c, &fx, one, x, idx, w, 1, k, E, e0, D, I, situ, mode);
        snprintf(what, sizeof what, "moe fp8 T=%d: token 0 alone, words differing", T);
        report(what, (double)words_differ(one, got, (size_t)D), 0.0);
        free(one);
    }
    if (mode == 14) { /* again: the slices' sums added in one order whatever the blocks' timing */
        float *again = malloc((size_t)D * 4);
        run_f8(c, &fx, again, x, idx, w, 1, k, E, e0, D, I, situ, 14);
        snprintf(what, sizeof what, "moe fp8 T=1 D=%d (wgmma): again, words differing", D);
        report(what, (double)words_differ(again, got, (size_t)D), 0.0);
        free(again);
    }
    if (mode == 0 && T == 1) { /* the quantizers first (mode 2): the same codes, the same bits */
        float *pre = malloc((size_t)D * 4);
        run_f8(c, &fx, pre, x, idx, w, 1, k, E, e0, D, I, situ, 2);
        snprintf(what, sizeof what, "moe fp8 T=1 D=%d: quantizers first, words differing", D);
        report(what, (double)words_differ(pre, got, (size_t)D), 0.0);
        run_f8(c, &fx, pre, x, idx, w, 1, k, E, e0, D, I, situ, 4); /* more blocks: same sums */
        snprintf(what, sizeof what, "moe fp8 T=1 D=%d: 8 blocks an SM, words differing", D);
        report(what, (double)words_differ(pre, got, (size_t)D), 0.0);
        free(pre);
    }
    f8_experts_free(&fx);
    free(x), free(w), free(idx), free(ref), free(got), free(hgu), free(a), free(yr);
}

void checks_moe_fp8(ds_cu *c) {
    check_moe_fp8(c, 1, 8, 64, 512, 256, 0, 0, 0);   /* one token: rows straight from idx */
    check_moe_fp8(c, 5, 4, 16, 256, 96, 1, 0, 0);    /* grouped, few rows an expert */
    check_moe_fp8(c, 40, 8, 16, 512, 256, 0, 0, 0);  /* grouped, 8 rows a pass */
    check_moe_fp8(c, 40, 8, 32, 512, 256, 1, 0, 1);  /* other ranks' rows */
    check_moe_fp8(c, 40, 8, 16, 512, 256, 0, 1, 0);  /* tensor cores */
    check_moe_fp8(c, 200, 8, 16, 512, 384, 1, 1, 1); /* ... many rows an expert, TP half */
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 0, 0); /* Kimi-Linear's widths */
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 0, 1); /* ... half the experts, one token */
    check_moe_fp8(c, 1, 7, 8, 512, 256, 0, 0, 1);    /* ... fewer than a token picks */
    check_moe_fp8(c, 1, 7, 8, 512, 256, 1, 8, 1);
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 3, 0); /* ... K split further (more warps) */
    check_moe_fp8(c, 40, 8, 16, 512, 256, 1, 3, 0);
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 7, 0); /* ... K's split forced (the grid's waves) */
    check_moe_fp8(c, 6, 8, 32, 2304, 1024, 1, 7, 0);
    check_moe_fp8(c, 20, 8, 32, 2304, 1024, 0, 1, 0);
    /* one token a warp a row: each of its shapes (R, U by K: 512/256, 2304/1024, 3072/2048) */
    check_moe_fp8(c, 1, 8, 64, 512, 256, 0, 8, 0);
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 8, 0);
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 1, 8, 1);
    check_moe_fp8(c, 1, 6, 16, 3072, 2048, 1, 8, 0);
    check_moe_fp8(c, 6, 8, 32, 2304, 1024, 1, 9, 0); /* K whole at batches */
    check_moe_fp8(c, 20, 8, 32, 2304, 1024, 0, 9, 1);
    /* one token's down pass reading its routing before the wait */
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 10, 0);
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 1, 10, 1);
    check_moe_fp8(c, 1, 7, 8, 512, 256, 0, 10, 1);
    /* a long step through cuBLASLt (64 routed rows a local expert on average, so some experts
     * fall in a second bucket): Kimi-Linear's widths, both activations, half the experts, and
     * the tile kernel on the same shape beside it; then an expert a call */
    /* one token on wgmma: Kimi-Linear's widths (the passes split along K over blocks), half the
     * experts, fewer experts than a token picks, SiTU; the re-runs below compare it with itself */
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 0, 14, 0);
    check_moe_fp8(c, 1, 8, 32, 2304, 1024, 1, 14, 1);
    check_moe_fp8(c, 1, 7, 8, 512, 256, 0, 14, 1);
    check_moe_fp8(c, 1, 6, 16, 3072, 2048, 1, 14, 0);
    check_moe_fp8(c, 128, 8, 16, 2304, 1024, 0, 11, 0);
    check_moe_fp8(c, 128, 8, 32, 2304, 1024, 1, 11, 1);
    check_moe_fp8(c, 128, 8, 16, 2304, 1024, 0, 1, 0);
    check_moe_fp8(c, 300, 6, 16, 512, 384, 1, 11, 0);
    check_moe_fp8(c, 300, 6, 16, 512, 384, 0, 12, 1);
    check_moe_fp8(c, 128, 8, 16, 2304, 1024, 0, 13, 0);
    check_moe_fp8(c, 300, 6, 16, 512, 384, 1, 13, 1);
}

/* ---- timings ----------------------------------------------------------------------------------
 */

typedef struct f8_ctx {
    float *out, *x, *w, *gs, *ds;
    int32_t *idx;
    uint8_t *gc, *dc;
    int T, k, E, D, I;
} f8_ctx;
static void run_f8b(ds_cu *c, void *p) {
    f8_ctx *m = p;
    ds_err err;
    if (ds_cu_moe_experts_fp8(c, m->out, m->x, m->idx, m->w, m->T, m->k, m->E, 0, m->D, m->I, m->gc,
                              m->gs, m->dc, m->ds, 0, 0.0f, 0.0f, 0, &err))
        DIE("%s", err.msg);
}

/* Kimi-Linear-48B's routed experts (256 of 2304 x 1024, 8 a token): batch 1 and 8 streamed,
 * batches of 64 and 256 on tensor cores; bytes: every expert some token picked, read once. */
void bench_moe_fp8(ds_cu *c, const cuda_ceilings *ceil) {
    enum { E = 256, K = 8, D = 2304, I = 1024, TMAX = 256 };
    const size_t per = (size_t)D * I;
    ds_err err = {{0}};
    f8_ctx m = {0};
    m.gc = ds_cu_alloc(c, (size_t)E * 2 * per, &err);
    m.gs = ds_cu_alloc(c, (size_t)E * 2 * I * 4, &err);
    m.dc = ds_cu_alloc(c, (size_t)E * per, &err);
    m.ds = ds_cu_alloc(c, (size_t)E * D * 4, &err);
    uint16_t *tmp = ds_cu_alloc(c, (size_t)E * 2 * per * 2, &err); /* BF16 draws */
    if (!m.gc || !m.gs || !m.dc || !m.ds || !tmp ||
        ds_cu_fill_random_bf16(c, tmp, (size_t)E * 2 * I, D, 21, 0, 0, D, 0.03f, &err) ||
        ds_cu_ptpc_quantize_bf16(c, m.gc, m.gs, tmp, E * 2 * I, D, 0, D, &err) ||
        ds_cu_fill_random_bf16(c, tmp, (size_t)E * D, I, 22, 0, 0, I, 0.03f, &err) ||
        ds_cu_ptpc_quantize_bf16(c, m.dc, m.ds, tmp, E * D, I, 0, I, &err) || ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    ds_cu_dealloc(tmp);
    float *h = rand_f32((size_t)TMAX * D, -1, 1);
    m.x = dev(c, h, (size_t)TMAX * D * 4);
    free(h);
    h = rand_f32((size_t)TMAX * K, 0, 1);
    m.w = dev(c, h, (size_t)TMAX * K * 4);
    free(h);
    int32_t *ids = malloc((size_t)TMAX * K * 4);
    uint8_t *used = calloc(E, 1);
    for (int i = 0; i < TMAX * K; i++)
        ids[i] = (int32_t)(((size_t)i * 37 + (size_t)(i / K) * 11) % E);
    m.idx = dev(c, ids, (size_t)TMAX * K * 4);
    m.out = dev(c, NULL, (size_t)TMAX * D * 4);
    m.k = K, m.E = E, m.D = D, m.I = I;
    /* (the first T=1: a warp a row, the default; the second: the tiles; the third: the quantizers
     * first; the fourth: on wgmma) */
    static const int Ts[] = {1, 1, 1, 1, 8, 64, 256};
    for (size_t i = 0; i < DS_ARRAY_LEN(Ts); i++) {
        m.T = Ts[i];
        const int tiles = i == 1, pre = i == 2, wg = i == 3;
        memset(used, 0, E);
        int n_used = 0;
        for (int r = 0; r < m.T * K; r++) n_used += !used[ids[r]], used[ids[r]] = 1;
        const int tc = m.T >= 40;
        ds_cu_set_expert_mma(c, tc);
        ds_cu_set_f8_prequant(c, pre);
        ds_cu_set_f8_rows(c, tiles ? -1 : 0);
        ds_cu_set_f8_wg(c, wg ? 2 : 0);
        const double ms = median_ms(c, run_f8b, &m, 3, 20);
        ds_cu_set_expert_mma(c, 0);
        ds_cu_set_f8_prequant(c, 0);
        ds_cu_set_f8_rows(c, 0);
        ds_cu_set_f8_wg(c, 0);
        const double bytes = (double)n_used * (3.0 * per + 4.0 * (2 * I + D));
        printf("bench moe fp8 T=%d (%d experts of 256, 2304 x 1024, 8 a token%s): %.4f ms, "
               "%.0f GB/s (%.0f%% of copy)\n",
               m.T, n_used,
               tc      ? ", tensor cores"
               : tiles ? ", the tiles"
               : pre   ? ", quantizers first"
               : wg    ? ", wgmma"
                       : "",
               ms, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / ceil->copy_gbs);
    }
    ds_cu_dealloc(m.gc), ds_cu_dealloc(m.gs), ds_cu_dealloc(m.dc), ds_cu_dealloc(m.ds);
    ds_cu_dealloc(m.x), ds_cu_dealloc(m.w), ds_cu_dealloc(m.idx), ds_cu_dealloc(m.out);
    free(ids), free(used);
}
