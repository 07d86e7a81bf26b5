/* test_cuda_matmul.c — the matmuls (streamed, through cuBLAS, per head, batch-invariant) against
 * the CPU's, and their timings at decode shapes. */
#include "cuda_check.h"

static void check_matmul(ds_cu *c, int T, int N, int K, int pad, double tol) {
    int ldx = K + pad, ldy = N + pad;
    float *x = rand_f32((size_t)T * ldx, -1, 1);
    uint16_t *w = rand_bf16((size_t)N * K, -0.05f, 0.05f);
    float *ref = calloc((size_t)T * ldy, sizeof *ref), *got = calloc((size_t)T * ldy, sizeof *got);
    ds_mat hw = {w, DS_DT_BF16, N, K, NULL};
    ds_matmul(ref, ldy, x, ldx, T, &hw);
    float *dx = dev(c, x, (size_t)T * ldx * 4), *dy = dev(c, NULL, (size_t)T * ldy * 4);
    uint16_t *dw = dev(c, w, (size_t)N * K * 2);
    poison(c, dy, (size_t)T * ldy * 4);
    ds_cu_mat m = {dw, N, K, DS_CU_BF16, NULL, NULL, 0};
    ds_err err = {{0}};
    if (ds_cu_matmul(c, dy, ldy, dx, ldx, T, &m, &err)) DIE("%s", err.msg);
    fetch(c, got, dy, (size_t)T * ldy * 4);
    char what[96];
    snprintf(what, sizeof what, "matmul T=%d N=%d K=%d%s", T, N, K, pad ? " (strided)" : "");
    report(what, rel_err(got, ref, (size_t)T, (size_t)N, (size_t)ldy), tol);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dw);
    free(x), free(w), free(ref), free(got);
}

/* H per-head matmuls in one call (y_h = x_h W_h^T at head strides) against the CPU head by head. */
static void check_matmul_heads(ds_cu *c, int T, int H, int N, int K, int invariant, double tol) {
    int ldx = H * K, ldy = H * N;
    float *x = rand_f32((size_t)T * ldx, -1, 1);
    uint16_t *w = rand_bf16((size_t)H * N * K, -0.05f, 0.05f);
    float *ref = calloc((size_t)T * ldy, 4), *got = calloc((size_t)T * ldy, 4);
    for (int h = 0; h < H; h++) {
        ds_mat hw = {w + (size_t)h * N * K, DS_DT_BF16, N, K, NULL};
        ds_matmul(ref + (size_t)h * N, ldy, x + (size_t)h * K, ldx, T, &hw);
    }
    float *dx = dev(c, x, (size_t)T * ldx * 4), *dy = dev(c, NULL, (size_t)T * ldy * 4);
    uint16_t *dw = dev(c, w, (size_t)H * N * K * 2);
    poison(c, dy, (size_t)T * ldy * 4);
    ds_cu_mat m = {dw, N, K, DS_CU_BF16, NULL, NULL, 0};
    ds_err err = {{0}};
    ds_cu_set_batch_invariant(c, invariant);
    if (ds_cu_matmul_heads(c, dy, ldy, (size_t)N, dx, ldx, (size_t)K, T, &m, (size_t)N * K, H,
                           &err))
        DIE("%s", err.msg);
    ds_cu_set_batch_invariant(c, 0);
    fetch(c, got, dy, (size_t)T * ldy * 4);
    char what[96];
    snprintf(what, sizeof what, "matmul heads T=%d H=%d N=%d K=%d%s", T, H, N, K,
             invariant ? " (invariant)" : "");
    report(what, rel_err(got, ref, (size_t)T, (size_t)ldy, (size_t)ldy), tol);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dw);
    free(x), free(w), free(ref), free(got);
}

/* The batch-invariant mode's promise: a token's output bits are the same at every T. */
static void check_matmul_invariance(ds_cu *c, int N, int K) {
    enum { T = 21 };
    float *x = rand_f32((size_t)T * K, -1, 1);
    uint16_t *w = rand_bf16((size_t)N * K, -0.05f, 0.05f);
    float *all = malloc((size_t)T * N * 4), *one = malloc((size_t)N * 4);
    float *dx = dev(c, x, (size_t)T * K * 4), *dy = dev(c, NULL, (size_t)T * N * 4);
    uint16_t *dw = dev(c, w, (size_t)N * K * 2);
    ds_cu_mat m = {dw, N, K, DS_CU_BF16, NULL, NULL, 0};
    ds_err err = {{0}};
    ds_cu_set_batch_invariant(c, 1);
    if (ds_cu_matmul(c, dy, N, dx, K, T, &m, &err)) DIE("%s", err.msg);
    fetch(c, all, dy, (size_t)T * N * 4);
    int same = 1;
    for (int t = 0; t < T; t++) { /* token t alone, from the same row of x */
        if (ds_cu_matmul(c, dy, N, dx + (size_t)t * K, K, 1, &m, &err)) DIE("%s", err.msg);
        fetch(c, one, dy, (size_t)N * 4);
        same &= !memcmp(one, all + (size_t)t * N, (size_t)N * 4);
    }
    ds_cu_set_batch_invariant(c, 0);
    char what[96];
    snprintf(what, sizeof what, "matmul invariant N=%d K=%d: T=1 bits == T=%d bits", N, K, T);
    report(what, same ? 0.0 : 1.0, 0.0);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dw);
    free(x), free(w), free(all), free(one);
}

/* Weights prefetched into L2 (ds_cu_set_l2_prefetch) are a hint: a chain of one-token products
 * (BF16 and FP8; one on the side stream; a mark as the routed experts leave; "experts" chosen by
 * an index, some outside the rank's range) gives the same words
 * with it as without, run eagerly and as a captured graph replayed twice, and every output is
 * written (poisoned first). */
static void chain(ds_cu *c, float *const *y, const float *x, const ds_cu_mat *w,
                  const int32_t *idx) {
    ds_err err = {{0}};
    /* "experts" 4 blocks of w[0]'s rows, idx naming some outside this rank's 1 .. 4 */
    const size_t blk = (size_t)w[0].rows / 4 * w[0].cols * 2;
    if (ds_cu_matmul(c, y[0], w[0].rows, x, w[0].cols, 1, &w[0], &err) ||
        ds_cu_l2_prefetch_experts(c, idx, 6, 1, 4, w[0].data, blk / 2, w[0].data, blk / 2, &err) ||
        ds_cu_side_begin(c, &err) ||
        ds_cu_matmul(c, y[1], w[1].rows, y[0], w[1].cols, 1, &w[1], &err) ||
        ds_cu_side_end(c, &err) || ds_cu_l2_mark(c, &err) ||
        ds_cu_matmul(c, y[2], w[2].rows, y[0], w[2].cols, 1, &w[2], &err) ||
        ds_cu_side_join(c, &err) ||
        ds_cu_matmul(c, y[3], w[3].rows, y[1], w[3].cols, 1, &w[3], &err))
        DIE("%s", err.msg);
}
static void check_l2_prefetch(ds_cu *c) {
    /* [rows][cols] of each product: BF16 2304 -> 4096 -> (side) 2304, FP8 4096 -> 1024, BF16
     * 2304 -> 512; the prefetch capped below the largest */
    static const int rc[4][2] = {{4096, 2304}, {2304, 4096}, {1024, 4096}, {512, 2304}};
    float *x = rand_f32(2304, -1, 1);
    float *dx = dev(c, x, 2304 * 4), *dy[4];
    void *dw[4];
    ds_cu_mat w[4];
    float *ref[4], *got[4];
    for (int i = 0; i < 4; i++) {
        const size_t n = (size_t)rc[i][0] * rc[i][1];
        dy[i] = dev(c, NULL, (size_t)rc[i][0] * 4);
        ref[i] = malloc((size_t)rc[i][0] * 4), got[i] = malloc((size_t)rc[i][0] * 4);
        if (i == 2) { /* FP8 codes (any byte but NaN's) and per-row scales */
            uint8_t *q = malloc(n);
            for (size_t j = 0; j < n; j++) q[j] = (uint8_t)urand(0.0f, 126.0f);
            float *sc = rand_f32((size_t)rc[i][0], 0.001f, 0.002f);
            dw[i] = dev(c, q, n);
            w[i] = (ds_cu_mat){
                dw[i], rc[i][0], rc[i][1], DS_CU_FP8, dev(c, sc, (size_t)rc[i][0] * 4), NULL, 0};
            free(q), free(sc);
        } else {
            uint16_t *b = rand_bf16(n, -0.05f, 0.05f);
            dw[i] = dev(c, b, n * 2);
            w[i] = (ds_cu_mat){dw[i], rc[i][0], rc[i][1], DS_CU_BF16, NULL, NULL, 0};
            free(b);
        }
    }
    static const int32_t ids[6] = {0, 1, 4, 5, 2, 3};
    int32_t *didx = dev(c, ids, sizeof ids);
    ds_err err = {{0}};
    if (ds_cu_set_side(c, 1, &err)) DIE("%s", err.msg);
    for (int pf = 0; pf < 2; pf++) {
        if (ds_cu_set_l2_prefetch(c, pf ? 4 : 0, &err)) DIE("%s", err.msg);
        for (int graph = 0; graph < 2; graph++) {
            for (int i = 0; i < 4; i++) poison(c, dy[i], (size_t)rc[i][0] * 4);
            if (!graph) {
                chain(c, dy, dx, w, didx);
            } else {
                ds_cu_graph *g = NULL;
                if (ds_cu_capture_begin(c, &err)) DIE("%s", err.msg);
                chain(c, dy, dx, w, didx);
                if (ds_cu_capture_end(c, &g, &err) || ds_cu_graph_launch(c, g, &err) ||
                    ds_cu_graph_launch(c, g, &err))
                    DIE("%s", err.msg);
                ds_cu_graph_free(g);
            }
            if (ds_cu_sync(c, &err)) DIE("%s", err.msg);
            size_t differ = 0, unset = 0;
            for (int i = 0; i < 4; i++) {
                fetch(c, pf || graph ? got[i] : ref[i], dy[i], (size_t)rc[i][0] * 4);
                for (int r = 0; r < rc[i][0]; r++) {
                    unset += isnan(pf || graph ? got[i][r] : ref[i][r]);
                    if (pf || graph) differ += memcmp(&got[i][r], &ref[i][r], 4) != 0;
                }
            }
            if (!pf && !graph) {
                if (unset) DIE("l2 prefetch check: %zu outputs unwritten", unset);
                continue;
            }
            char what[96];
            snprintf(what, sizeof what, "matmul chain, L2 prefetch %s, %s: words differing",
                     pf ? "on" : "off", graph ? "graph" : "eager");
            report(what, (double)(differ + unset), 0.0);
        }
    }
    if (ds_cu_set_l2_prefetch(c, 0, &err) || ds_cu_set_side(c, 0, &err)) DIE("%s", err.msg);
    for (int i = 0; i < 4; i++) {
        ds_cu_dealloc(dy[i]), ds_cu_dealloc(dw[i]);
        if (w[i].scale) ds_cu_dealloc((void *)w[i].scale);
        free(ref[i]), free(got[i]);
    }
    ds_cu_dealloc(dx), ds_cu_dealloc(didx);
    free(x);
}

typedef struct mm_ctx {
    float *y, *x;
    ds_cu_mat w[4]; /* rotated: each more than L2 on its own */
    int T, i;
} mm_ctx;
static void run_mm(ds_cu *c, void *p) {
    mm_ctx *x = p;
    ds_err err;
    x->i = (x->i + 1) % 4;
    if (ds_cu_matmul(c, x->y, x->w[x->i].rows, x->x, x->w[x->i].cols, x->T, &x->w[x->i], &err))
        DIE("%s", err.msg);
}

/* the matmul checks, in their order of old (one random stream feeds every check) */
void checks_matmul(ds_cu *c) {
    /* T = 1 with K % 8 == 0: the f32 GEMV (held to f32 accuracy); else cuBLAS on BF16 x */
    check_matmul(c, 1, 4096, 2304, 0, 1e-5);
    check_matmul(c, 1, 12576, 2304, 0, 1e-5); /* KDA's stacked inputs at the 48B shape */
    ds_cu_set_gemv_wide(c, 1); /* the same through the experts' kernel, and its bits */
    check_matmul(c, 1, 12576, 2304, 0, 1e-5);
    check_matmul(c, 1, 5003, 2048, 4, 1e-5); /* tail rows; one warp a row on 132 SMs */
    check_matmul_invariance(c, 5000, 2304);
    ds_cu_set_wide_early(c, 1); /* its first weights before the wait: the same sums */
    check_matmul(c, 1, 5003, 2048, 4, 1e-5);
    check_matmul(c, 1, 12576, 2304, 0, 1e-5);
    check_matmul_invariance(c, 5000, 2304);
    ds_cu_set_wide_early(c, 0);
    ds_cu_set_gemv_wide(c, 0);
    check_matmul(c, 1, 1003, 2048, 4, 1e-5);
    check_matmul(c, 2, 1003, 2048, 4, 1e-2);
    check_matmul(c, 3, 1003, 2048, 4, 1e-2);
    check_matmul(c, 8, 163840, 256, 0, 1e-2);
    check_matmul(c, 7, 1000, 333, 0, 1e-2);
    check_matmul(c, 64, 2304, 4096, 0, 1e-2);
    check_matmul(c, 5, 257, 130, 3, 1e-2);
    check_matmul_heads(c, 1, 32, 512, 128, 0, 1e-5);
    check_matmul_heads(c, 5, 4, 128, 512, 1, 1e-5);
    check_matmul_heads(c, 9, 4, 128, 512, 0, 1e-2);
    check_matmul_invariance(c, 1000, 2304);
    /* few rows: warps share a row (split K), the router's shape and a tiny one */
    check_matmul(c, 1, 256, 2304, 0, 1e-5);
    check_matmul(c, 1, 5, 4096, 0, 1e-5);
    check_matmul_invariance(c, 256, 2304);
    check_matmul_invariance(c, 77, 100); /* K % 8 != 0: the element-wise kernel */
    check_l2_prefetch(c);
}

/* decode-shaped matmuls against the copy and GEMM ceilings */
void bench_matmul(ds_cu *c, const cuda_ceilings *ceil) {
    double ms;
    const double copy_gbs = ceil->copy_gbs;
    const double gemm_tf = ceil->gemm_tf;
    /* 3. decode-shaped matmuls at Kimi-Linear-48B-A3B's hidden size 2304: bytes a step must
     *    read (the weights, BF16) over time, against the copy ceiling */
    static const int shapes[][2] = {{4096, 2304}, {2304, 4096}, {163840, 2304}};
    static const int Ts[] = {1, 2, 8, 64, 256};
    for (size_t si = 0; si < DS_ARRAY_LEN(shapes); si++) {
        int N = shapes[si][0], K = shapes[si][1];
        mm_ctx mc = {0};
        uint16_t *w = rand_bf16((size_t)N * K, -0.05f, 0.05f);
        for (int i = 0; i < 4; i++)
            mc.w[i] = (ds_cu_mat){dev(c, w, (size_t)N * K * 2), N, K, DS_CU_BF16, NULL, NULL, 0};
        free(w);
        float *x = rand_f32((size_t)256 * K, -1, 1);
        mc.x = dev(c, x, (size_t)256 * K * 4);
        free(x);
        mc.y = dev(c, NULL, (size_t)256 * N * 4);
        for (size_t ti = 0; ti < DS_ARRAY_LEN(Ts); ti++) {
            mc.T = Ts[ti];
            ms = median_ms(c, run_mm, &mc, 3, 30);
            double bytes = (double)N * K * 2 + (double)mc.T * (K * 4 + N * 4);
            double flops = 2.0 * N * (double)K * mc.T;
            printf("bench matmul N=%d K=%d T=%d: %.4f ms, %.0f GB/s (%.0f%% of copy), %.1f "
                   "TFLOP/s (%.1f%% of gemm)\n",
                   N, K, mc.T, ms, bytes / (ms * 1e-3) / 1e9,
                   100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs, flops / (ms * 1e-3) / 1e12,
                   100.0 * flops / (ms * 1e-3) / 1e12 / gemm_tf);
        }
        for (int i = 0; i < 4; i++) ds_cu_dealloc((void *)mc.w[i].data);
        ds_cu_dealloc(mc.x), ds_cu_dealloc(mc.y);
    }
}
