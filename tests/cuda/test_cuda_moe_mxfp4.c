/* test_cuda_moe_mxfp4.c — MXFP4 routed experts (docs/quantization.md): the random draw on the
 * device against the CPU's, the experts (streamed, grouped, tensor cores, tensor-parallel halves)
 * against the CPU's expert math, and their timings at Kimi-K3's shape. */
#include "cuda_check.h"

#include "kernels/shared/quant.h"
#include "kernels/shared/rand_hash.h"

/* ds_cu_fill_random_mxfp4 of a slice against ds_rand_mxfp4_code / _scale, byte for byte. */
static void check_fill_mxfp4(ds_cu *c, int rows, int cols, int row0, int col0, int full_cols,
                             int e2) {
    const uint64_t key = 0x1234abcdull;
    const size_t nb = (size_t)rows * cols / 2, ns = (size_t)rows * cols / 32;
    uint8_t *codes = dev(c, NULL, nb), *scales = dev(c, NULL, ns);
    uint8_t *gc = malloc(nb), *gs = malloc(ns);
    ds_err err = {{0}};
    if (ds_cu_fill_random_mxfp4(c, codes, scales, (size_t)rows, (size_t)cols, key, (size_t)row0,
                                (size_t)col0, (size_t)full_cols, e2, &err) ||
        ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    fetch(c, gc, codes, nb);
    fetch(c, gs, scales, ns);
    size_t bad = 0;
    for (int r = 0; r < rows; r++) {
        for (int j = 0; j < cols / 2; j++)
            bad += gc[(size_t)r * (cols / 2) + j] !=
                   ds_rand_mxfp4_code(key, (size_t)(row0 + r) * (full_cols / 2) + col0 / 2 + j);
        for (int j = 0; j < cols / 32; j++)
            bad +=
                gs[(size_t)r * (cols / 32) + j] !=
                ds_rand_mxfp4_scale(key, (size_t)(row0 + r) * (full_cols / 32) + col0 / 32 + j, e2);
    }
    char what[96];
    snprintf(what, sizeof what, "random mxfp4 %d x %d at (%d, %d) of %d: bytes differing", rows,
             cols, row0, col0, full_cols);
    report(what, (double)bad, 0.0);
    ds_cu_dealloc(codes), ds_cu_dealloc(scales);
    free(gc), free(gs);
}

/* Random packed experts: codes uniform, scales 2^-9 .. 2^-5 (values of a few hundredths). */
static uint8_t *rand_bytes(size_t n, int lo, int hi) {
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++)
        b[i] = (uint8_t)(lo + (int)(ds_rng_next(&g_rng) % (uint64_t)(hi - lo + 1)));
    return b;
}

/* codes of +-0.5 alone (each nibble 1 or 9): the E2M1 subnormal, which the streaming kernel's
 * decode makes a BF16 subnormal before the group's scale lifts it (a flush would zero every
 * product) */
static uint8_t *half_codes(size_t n) {
    static const uint8_t b[4] = {0x11, 0x19, 0x91, 0x99};
    uint8_t *p = malloc(n);
    for (size_t i = 0; i < n; i++) p[i] = b[ds_rng_next(&g_rng) % 4];
    return p;
}

/* Routed experts against the CPU composed from its own kernels, as check_moe_experts_mode:
 * per (token, slot) ds_matmul on the expert's MXFP4 gate|up rows, the activation, ds_matmul on
 * its down rows, the weighted sum in slot order. mode 0: the streaming kernel (f32 activations:
 * the CPU's terms, another order of the sums); 1: tensor cores (BF16 activations); 2: the
 * streaming kernel with the activations in one BF16 part (ds_cu_set_fp4_one_part); 3: that with
 * codes of +-0.5 alone. half: this rank holds experts [E/2, E) only. */
static void check_moe_mxfp4(ds_cu *c, int T, int k, int E, int D, int I, int situ, int mode,
                            int half) {
    const int e0 = half ? E / 2 : 0, El = E - e0;
    const size_t gun = (size_t)E * 2 * I * D, dnn = (size_t)E * D * I;
    uint8_t *gc = mode == 3 ? half_codes(gun / 2) : rand_bytes(gun / 2, 0, 255);
    uint8_t *gs = rand_bytes(gun / 32, 118, 122);
    uint8_t *dc = mode == 3 ? half_codes(dnn / 2) : rand_bytes(dnn / 2, 0, 255);
    uint8_t *dsc = rand_bytes(dnn / 32, 118, 122);
    float *x = rand_f32((size_t)T * D, -1, 1), *w = rand_f32((size_t)T * k, 0, 1);
    float *base = rand_f32((size_t)T * D, -1, 1);
    int32_t *idx = malloc((size_t)T * k * 4);
    for (int t = 0; t < T; t++) /* k distinct experts a token */
        for (int j = 0; j < k; j++) {
            int e;
            int dup;
            do {
                e = (int)(ds_rng_next(&g_rng) % (uint64_t)E);
                dup = 0;
                for (int i = 0; i < j; i++) dup |= idx[t * k + i] == e;
            } while (dup);
            idx[t * k + j] = e;
        }
    float *ref = malloc((size_t)T * D * 4), *got = malloc((size_t)T * D * 4);
    float *hgu = malloc((size_t)2 * I * 4), *a = malloc((size_t)I * 4), *yr = malloc((size_t)D * 4);
    for (int t = 0; t < T; t++) {
        float *o = ref + (size_t)t * D;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int j = 0; j < k; j++) {
            const int e = idx[t * k + j];
            if (e < e0) continue; /* another rank's */
            ds_mat mgu = {gc + (size_t)e * 2 * I * D / 2, DS_DT_MXFP4, 2 * I, D,
                          gs + (size_t)e * 2 * I * D / 32};
            ds_mat mdn = {dc + (size_t)e * D * I / 2, DS_DT_MXFP4, D, I,
                          dsc + (size_t)e * D * I / 32};
            ds_matmul(hgu, 2 * I, x + (size_t)t * D, D, 1, &mgu);
            if (situ)
                ds_act_situ(a, hgu, hgu + I, (size_t)I, 4.0f, 6.0f);
            else
                ds_act_swiglu(a, hgu, hgu + I, (size_t)I);
            ds_matmul(yr, D, a, I, 1, &mdn);
            for (int d = 0; d < D; d++) o[d] += w[t * k + j] * yr[d];
        }
    }
    uint8_t *dgc = dev(c, gc + (size_t)e0 * 2 * I * D / 2, (size_t)El * 2 * I * D / 2);
    uint8_t *dgs = dev(c, gs + (size_t)e0 * 2 * I * D / 32, (size_t)El * 2 * I * D / 32);
    uint8_t *ddc = dev(c, dc + (size_t)e0 * D * I / 2, (size_t)El * D * I / 2);
    uint8_t *dds = dev(c, dsc + (size_t)e0 * D * I / 32, (size_t)El * D * I / 32);
    float *dx = dev(c, x, (size_t)T * D * 4), *dw = dev(c, w, (size_t)T * k * 4);
    float *dout = dev(c, base, (size_t)T * D * 4); /* overwritten (accumulate 0) */
    int32_t *didx = dev(c, idx, (size_t)T * k * 4);
    ds_err err = {{0}};
    ds_cu_set_expert_mma(c, mode == 1);
    ds_cu_set_expert_mma_min(c, mode == 1 ? 16 : 0);
    ds_cu_set_fp4_one_part(c, mode >= 2);
    if (ds_cu_moe_experts_mxfp4(c, dout, dx, didx, dw, T, k, El, e0, D, I, dgc, dgs, ddc, dds, situ,
                                4.0f, 6.0f, 0, &err) ||
        ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    ds_cu_set_expert_mma(c, 0);
    ds_cu_set_expert_mma_min(c, 0);
    fetch(c, got, dout, (size_t)T * D * 4);
    char what[160];
    snprintf(what, sizeof what, "moe mxfp4 T=%d k=%d E=%d D=%d I=%d %s%s%s", T, k, E, D, I,
             situ ? "situ" : "swiglu",
             mode == 3   ? " (one part, codes +-0.5)"
             : mode == 2 ? " (one part)"
             : mode      ? " (tensor cores)"
                         : "",
             half ? " (half the experts)" : "");
    /* BF16 activations: the tensor-core path's tolerance */
    report(what, rel_err(got, ref, 1, (size_t)T * D, (size_t)T * D), mode ? 1e-2 : 1e-5);
    if (mode != 1 && T > 1) { /* batch invariance: token 0 alone has the same bits */
        float *one = malloc((size_t)D * 4);
        if (ds_cu_moe_experts_mxfp4(c, dout, dx, didx, dw, 1, k, El, e0, D, I, dgc, dgs, ddc, dds,
                                    situ, 4.0f, 6.0f, 0, &err) ||
            ds_cu_sync(c, &err))
            DIE("%s", err.msg);
        fetch(c, one, dout, (size_t)D * 4);
        snprintf(what, sizeof what, "moe mxfp4 T=%d%s: token 0 alone, words differing", T,
                 mode >= 2 ? " (one part)" : "");
        report(what, (double)words_differ(one, got, (size_t)D), 0.0);
        free(one);
    }
    ds_cu_set_fp4_one_part(c, 0);
    ds_cu_dealloc(dgc), ds_cu_dealloc(dgs), ds_cu_dealloc(ddc), ds_cu_dealloc(dds);
    ds_cu_dealloc(dx), ds_cu_dealloc(dw), ds_cu_dealloc(dout), ds_cu_dealloc(didx);
    free(gc), free(gs), free(dc), free(dsc), free(x), free(w), free(base), free(idx), free(ref);
    free(got), free(hgu), free(a), free(yr);
}

void checks_moe_mxfp4(ds_cu *c) {
    check_fill_mxfp4(c, 7, 256, 0, 0, 256, -6);
    check_fill_mxfp4(c, 5, 96, 3, 64, 320, -3);         /* a slice of rows and columns */
    check_moe_mxfp4(c, 1, 8, 64, 512, 256, 0, 0, 0);    /* one token: rows straight from idx */
    check_moe_mxfp4(c, 1, 7, 8, 512, 256, 0, 0, 1);     /* ... the rank holding fewer experts
                                                           than a token picks */
    check_moe_mxfp4(c, 5, 4, 16, 256, 96, 1, 0, 0);     /* grouped, few rows an expert */
    check_moe_mxfp4(c, 40, 8, 16, 512, 256, 0, 0, 0);   /* grouped, 8 rows a pass */
    check_moe_mxfp4(c, 40, 8, 32, 512, 256, 1, 0, 1);   /* other ranks' rows */
    check_moe_mxfp4(c, 40, 8, 16, 512, 256, 0, 1, 0);   /* tensor cores */
    check_moe_mxfp4(c, 200, 8, 16, 512, 384, 1, 1, 1);  /* ... many rows an expert, TP half */
    check_moe_mxfp4(c, 3, 4, 8, 256, 2048, 1, 0, 0);    /* down pass K split over 4 warps */
    check_moe_mxfp4(c, 1, 16, 32, 3584, 3072, 0, 0, 0); /* Kimi-K3's widths */
    check_moe_mxfp4(c, 20, 4, 32, 3584, 3072, 0, 1, 0);
    /* the one-part streaming form: one token, grouped, split K, K3's widths, TP half, and codes
     * of +-0.5 alone */
    check_moe_mxfp4(c, 1, 8, 64, 512, 256, 0, 2, 0);
    check_moe_mxfp4(c, 40, 8, 16, 512, 256, 1, 2, 0);
    check_moe_mxfp4(c, 3, 4, 8, 256, 2048, 1, 2, 0);
    check_moe_mxfp4(c, 1, 16, 32, 3584, 3072, 0, 2, 0);
    check_moe_mxfp4(c, 40, 8, 32, 512, 256, 1, 2, 1);
    check_moe_mxfp4(c, 1, 8, 64, 512, 256, 0, 3, 0);
    check_moe_mxfp4(c, 5, 4, 16, 256, 96, 1, 3, 0);
}

/* ---- timings ----------------------------------------------------------------------------------
 */

typedef struct mx_ctx {
    float *out, *x, *w;
    int32_t *idx;
    uint8_t *gc, *gs, *dc, *ds;
    int T, k, E, D, I;
} mx_ctx;
static void run_mx(ds_cu *c, void *p) {
    mx_ctx *m = p;
    ds_err err;
    if (ds_cu_moe_experts_mxfp4(c, m->out, m->x, m->idx, m->w, m->T, m->k, m->E, 0, m->D, m->I,
                                m->gc, m->gs, m->dc, m->ds, 0, 0.0f, 0.0f, 0, &err))
        DIE("%s", err.msg);
}

/* Kimi-K3's routed experts (896 of 3584 x 3072, 16 a token): batch 1 and 8 streamed, batches
 * of 64 and 256 on tensor cores; bytes: every expert some token picked, read once. */
void bench_moe_mxfp4(ds_cu *c, const cuda_ceilings *ceil) {
    enum { E = 896, K = 16, D = 3584, I = 3072, TMAX = 256 };
    const size_t per = (size_t)D * I;
    ds_err err = {{0}};
    mx_ctx m = {0};
    m.gc = ds_cu_alloc(c, (size_t)E * per, &err);
    m.gs = ds_cu_alloc(c, (size_t)E * per / 16, &err);
    m.dc = ds_cu_alloc(c, (size_t)E * per / 2, &err);
    m.ds = ds_cu_alloc(c, (size_t)E * per / 32, &err);
    if (!m.gc || !m.gs || !m.dc || !m.ds ||
        ds_cu_fill_random_mxfp4(c, m.gc, m.gs, (size_t)E * 2 * I, D, 21, 0, 0, D, -6, &err) ||
        ds_cu_fill_random_mxfp4(c, m.dc, m.ds, (size_t)E * D, I, 22, 0, 0, I, -6, &err))
        DIE("%s", err.msg);
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
    static const int Ts[] = {1, 8, 64, 256};
    for (size_t i = 0; i < DS_ARRAY_LEN(Ts); i++) {
        m.T = Ts[i];
        memset(used, 0, E);
        int n_used = 0;
        for (int r = 0; r < m.T * K; r++) n_used += !used[ids[r]], used[ids[r]] = 1;
        const int tc = m.T >= 40;
        for (int one = 0; one < (tc ? 1 : 2); one++) { /* streamed: also in one part */
            ds_cu_set_expert_mma(c, tc);
            ds_cu_set_fp4_one_part(c, one);
            const double ms = median_ms(c, run_mx, &m, 3, 20);
            ds_cu_set_expert_mma(c, 0);
            ds_cu_set_fp4_one_part(c, 0);
            const double bytes = (double)n_used * 3 * per * (0.5 + 1.0 / 32);
            printf("bench moe mxfp4 T=%d (%d experts of 896, 3584 x 3072, 16 a token%s): %.4f ms, "
                   "%.0f GB/s (%.0f%% of copy)\n",
                   m.T, n_used,
                   tc    ? ", tensor cores"
                   : one ? ", one part"
                         : "",
                   ms, bytes / (ms * 1e-3) / 1e9,
                   100.0 * bytes / (ms * 1e-3) / 1e9 / ceil->copy_gbs);
        }
    }
    ds_cu_dealloc(m.gc), ds_cu_dealloc(m.gs), ds_cu_dealloc(m.dc), ds_cu_dealloc(m.ds);
    ds_cu_dealloc(m.x), ds_cu_dealloc(m.w), ds_cu_dealloc(m.idx), ds_cu_dealloc(m.out);
    free(ids), free(used);
}
