/* test_cuda_matmul_fp8.c — ptpc FP8 (docs/quantization.md): the device quantizers bit for bit
 * against the CPU's, the FP8 products (streamed, batch-invariant, tensor cores) against a float64
 * sum of the dequantized terms and against the CPU's ds_matmul, and their timings. */
#include "cuda_check.h"

#include "kernels/shared/quant.h"

/* The weights' quantizer on the device against ds_ptpc_quantize (a column slice, a zero row, a row
 * with values that land on ties), codes and scales bit for bit; and the activations' against
 * ds_ptpc_quantize_act. */
static void check_ptpc_quantize(ds_cu *c, int rows, int cols, int c0, int nc) {
    uint16_t *w = rand_bf16((size_t)rows * cols, -0.3f, 0.3f);
    for (int j = 0; j < cols; j++) w[j] = 0; /* row 0: all zeros, the minimum scale */
    if (rows > 1) /* row 1: multiples of 1/64 up to 448 / 64, many exact ties after scaling */
        for (int j = 0; j < cols; j++)
            w[(size_t)cols + j] = ds_f32_to_bf16((float)(j % 449) / 64.0f);
    uint8_t *ref = malloc((size_t)rows * nc), *got = malloc((size_t)rows * nc);
    float *sref = malloc((size_t)rows * 4), *sgot = malloc((size_t)rows * 4);
    ds_mat hw = {w, DS_DT_BF16, rows, cols, NULL};
    ds_ptpc_quantize(ref, sref, &hw, c0, nc);
    uint16_t *dw = dev(c, w, (size_t)rows * cols * 2);
    uint8_t *dq = dev(c, NULL, (size_t)rows * nc);
    float *ds = dev(c, NULL, (size_t)rows * 4);
    ds_err err = {{0}};
    if (ds_cu_ptpc_quantize_bf16(c, dq, ds, dw, rows, cols, c0, nc, &err) || ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    fetch(c, got, dq, (size_t)rows * nc);
    fetch(c, sgot, ds, (size_t)rows * 4);
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)rows * nc; i++) bad += got[i] != ref[i];
    for (int r = 0; r < rows; r++) bad += memcmp(&sgot[r], &sref[r], 4) != 0;
    char what[128];
    snprintf(what, sizeof what, "ptpc quantize %d x %d cols [%d, %d): codes, scales differing",
             rows, cols, c0, c0 + nc);
    report(what, (double)bad, 0.0);
    /* the activations: the same rows as f32 */
    const int T = rows, K = cols, ldq = (K + 15) / 16 * 16;
    float *x = malloc((size_t)T * K * 4), *xq = malloc((size_t)T * K * 4),
          *st = malloc((size_t)T * 4);
    for (size_t i = 0; i < (size_t)T * K; i++) x[i] = ds_bf16_to_f32(w[i]) * 3.7f;
    ds_ptpc_quantize_act(xq, st, x, K, T, K);
    float *dx = dev(c, x, (size_t)T * K * 4), *dst = dev(c, NULL, (size_t)T * 4);
    uint8_t *dxq = dev(c, NULL, (size_t)T * ldq);
    uint8_t *gq = malloc((size_t)T * ldq);
    float *gst = malloc((size_t)T * 4);
    if (ds_cu_ptpc_quantize_act(c, dxq, ldq, dst, dx, K, T, K, &err) || ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    fetch(c, gq, dxq, (size_t)T * ldq);
    fetch(c, gst, dst, (size_t)T * 4);
    bad = 0;
    for (int t = 0; t < T; t++) {
        bad += memcmp(&gst[t], &st[t], 4) != 0;
        for (int j = 0; j < ldq; j++) {
            const float v = j < K ? ds_e4m3_to_f32(gq[(size_t)t * ldq + j]) : 0.0f;
            const float r = j < K ? xq[(size_t)t * K + j] : 0.0f;
            bad += memcmp(&v, &r, 4) != 0 || (j >= K && gq[(size_t)t * ldq + j]);
        }
    }
    snprintf(what, sizeof what, "ptpc quantize activations %d x %d: values, scales differing", T,
             K);
    report(what, (double)bad, 0.0);
    ds_cu_dealloc(dw), ds_cu_dealloc(dq), ds_cu_dealloc(ds), ds_cu_dealloc(dx);
    ds_cu_dealloc(dst), ds_cu_dealloc(dxq);
    free(w), free(ref), free(got), free(sref), free(sgot), free(x), free(xq), free(st), free(gq);
    free(gst);
}

/* The device's E4M3 rounding (the conversion unit on sm_89+) against quant.h's, bit for bit,
 * through the activations' quantizer: every row's largest magnitude is 448, so its scale is 1
 * and its codes are e4m3 of the values themselves. The values: every exponent a code can take
 * and below (random mantissas), every tie between neighbouring codes (subnormal and normal) and a
 * value just either side of it, the saturation region up to 448, signed zeros. */
static void check_e4m3_rounding(ds_cu *c) {
    enum { T = 16, K = 4096 };
    float *x = malloc((size_t)T * K * 4), *xq = malloc((size_t)T * K * 4), *st = malloc(T * 4);
    uint32_t h = 0x9e3779b9u;
    size_t n = 0;
    for (int t = 0; t < T; t++) x[(size_t)t * K] = (t & 1) ? -448.0f : 448.0f;
    for (int code = 0; code < 126; code++) { /* the tie above each code, and its neighbours */
        const float a = ds_e4m3_to_f32((uint8_t)code), b = ds_e4m3_to_f32((uint8_t)(code + 1));
        const float mid = 0.5f * (a + b); /* exact: a and b have few bits */
        const float v[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, 1e9f)};
        for (int i = 0; i < 3; i++)
            for (int sgn = 0; sgn < 2; sgn++) {
                const size_t at = 1 + n / (K - 1) * K + n % (K - 1);
                x[at] = sgn ? -v[i] : v[i], n++;
            }
    }
    for (; n < (size_t)T * (K - 1); n++) { /* random bits: exponents 2^-24 .. 2^8, either sign */
        h ^= h << 13, h ^= h >> 17, h ^= h << 5;
        const uint32_t e = 103u + h % 33u, bits = (h & 0x80000000u) | (e << 23) | (h >> 9);
        float v;
        memcpy(&v, &bits, 4);
        if (fabsf(v) > 448.0f) v = copysignf(448.0f - (float)(h % 16), v);
        if (n % 997 == 0) v = (n & 1) ? -0.0f : 0.0f;
        x[1 + n / (K - 1) * K + n % (K - 1)] = v;
    }
    ds_ptpc_quantize_act(xq, st, x, K, T, K);
    float *dx = dev(c, x, (size_t)T * K * 4), *dst = dev(c, NULL, T * 4);
    uint8_t *dq = dev(c, NULL, (size_t)T * K), *gq = malloc((size_t)T * K);
    ds_err err = {{0}};
    if (ds_cu_ptpc_quantize_act(c, dq, K, dst, dx, K, T, K, &err) || ds_cu_sync(c, &err))
        DIE("%s", err.msg);
    fetch(c, gq, dq, (size_t)T * K);
    size_t bad = 0;
    for (size_t i = 0; i < (size_t)T * K; i++) {
        const float v = ds_e4m3_to_f32(gq[i]);
        bad += memcmp(&v, &xq[i], 4) != 0 || gq[i] != ds_f32_to_e4m3(x[i]);
        if (st[i / K] != 1.0f) DIE("e4m3 rounding: row %zu's scale is %g, not 1", i / K, st[i / K]);
    }
    report("e4m3 rounding of 65,536 values (ties, subnormals, saturation): codes differing",
           (double)bad, 0.0);
    ds_cu_dealloc(dx), ds_cu_dealloc(dst), ds_cu_dealloc(dq);
    free(x), free(xq), free(st), free(gq);
}

/* y = x W^T on the device into host out [T][ldy] (y poisoned first): mode 1 batch invariance,
 * 2 the same with K split to one step a warp, 3 / 4 with K's split forced to 8 / 1 parts where
 * the rule splits it (ds_cu_set_f8_split), 5 one token a warp a row (ds_cu_set_f8_rows; every
 * other mode has that form off), 6 K whole from 2 tokens (ds_cu_set_f8_whole_k), 8 on wgmma
 * (ds_cu_set_f8_wg: up to 8 tokens, whole 64-column steps; else the default); waves > 0: a
 * product that quantizes its tokens in at most that many blocks an SM (the same sums). */
static void mm8_mode(ds_cu *c, float *out, float *dy, int ldy, const float *dx, int ldx, int T,
                     const ds_cu_mat *m, int mode, int waves) {
    ds_err err = {{0}};
    poison(c, dy, (size_t)T * ldy * 4);
    ds_cu_set_batch_invariant(c, mode >= 1 && mode != 7 && mode != 8);
    ds_cu_set_f8_wg(c, mode == 8);
    ds_cu_set_f8_lt_unit(c, mode == 7);
    ds_cu_set_f8_split_min(c, mode == 2);
    ds_cu_set_f8_split(c, mode == 3 ? 8 : mode == 4 ? 1 : 0);
    ds_cu_set_f8_gemv_waves(c, waves);
    ds_cu_set_f8_rows(c, mode == 5 ? 0 : -1);
    ds_cu_set_f8_whole_k(c, mode == 6 ? 2 : 0);
    if (ds_cu_matmul(c, dy, ldy, dx, ldx, T, m, &err) || ds_cu_sync(c, &err)) DIE("%s", err.msg);
    ds_cu_set_batch_invariant(c, 0);
    ds_cu_set_f8_wg(c, 0);
    ds_cu_set_f8_lt_unit(c, 0);
    ds_cu_set_f8_split_min(c, 0);
    ds_cu_set_f8_split(c, 0);
    ds_cu_set_f8_gemv_waves(c, 0);
    ds_cu_set_f8_rows(c, 0);
    ds_cu_set_f8_whole_k(c, 0);
    fetch(c, out, dy, (size_t)T * ldy * 4);
}

/* y = x W^T with W FP8 against a float64 sum of the dequantized terms (the CPU's activation codes
 * and scales: exactly the GPU's) and against the CPU's ds_matmul. mode 0: the default choice
 * (streamed up to 2 rows, tensor cores above); 1: batch invariance (always streamed); 2: the same
 * with K split down to one step a warp (ds_cu_set_f8_split_min); 7: tensor cores with unit scales
 * and the scales' own pass (ds_cu_set_f8_lt_unit; mode 0 gives cuBLASLt the scales where it has
 * an algorithm for them). */
static void check_matmul_fp8(ds_cu *c, int T, int N, int K, int pad, int mode, double tol) {
    const int ldx = K + pad, ldy = N + pad;
    float *x = rand_f32((size_t)T * ldx, -2, 2);
    uint16_t *wb = rand_bf16((size_t)N * K, -0.05f, 0.05f);
    uint8_t *q = malloc((size_t)N * K);
    float *sr = malloc((size_t)N * 4);
    ds_mat hb = {wb, DS_DT_BF16, N, K, NULL};
    ds_ptpc_quantize(q, sr, &hb, 0, K);
    ds_mat hw = {q, DS_DT_F8_E4M3, N, K, sr};
    float *cpu = calloc((size_t)T * ldy, 4), *got = calloc((size_t)T * ldy, 4);
    double *ref = calloc((size_t)T * ldy, sizeof(double));
    float *xq = malloc((size_t)T * K * 4), *st = malloc((size_t)T * 4);
    ds_ptpc_quantize_act(xq, st, x, ldx, T, K);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < N; r++) {
            double s = 0.0;
            for (int j = 0; j < K; j++)
                s += (double)xq[(size_t)t * K + j] * ds_e4m3_to_f32(q[(size_t)r * K + j]);
            ref[(size_t)t * ldy + r] = s * st[t] * sr[r];
        }
    float *reff = calloc((size_t)T * ldy, 4);
    for (size_t i = 0; i < (size_t)T * ldy; i++) reff[i] = (float)ref[i];
    ds_matmul(cpu, ldy, x, ldx, T, &hw);
    float *dx = dev(c, x, (size_t)T * ldx * 4), *dy = dev(c, NULL, (size_t)T * ldy * 4);
    uint8_t *dq = dev(c, q, (size_t)N * K);
    float *dsr = dev(c, sr, (size_t)N * 4);
    ds_cu_mat m = {(const uint16_t *)dq, N, K, DS_CU_FP8, dsr, NULL, 0};
    const long vec0 = ds_cu_f8_lt_vec_runs(c);
    mm8_mode(c, got, dy, ldy, dx, ldx, T, &m, mode, 0);
    const long vec = ds_cu_f8_lt_vec_runs(c) - vec0;
    char what[128];
    if (mode == 7 && vec) report("matmul fp8: unit scales asked, cuBLASLt scaled", 1.0, 0.0);
    if (mode == 0 && T > 2)
        printf("matmul fp8 T=%d N=%d K=%d: scales %s\n", T, N, K,
               vec ? "applied by cuBLASLt (outer vectors)"
                   : "not by cuBLASLt (their own pass, or the streaming kernel)");
    const char *form = mode == 2   ? " (invariant, K split to 1 step)"
                       : mode == 3 ? " (invariant, K in 8 parts)"
                       : mode == 4 ? " (invariant, K whole)"
                       : mode == 5 ? " (a warp a row)"
                       : mode == 6 ? " (K whole from 2 tokens)"
                       : mode == 7 ? " (unit scales, then their pass)"
                       : mode == 8 ? " (wgmma)"
                       : mode      ? " (invariant)"
                                   : "";
    snprintf(what, sizeof what, "matmul fp8 T=%d N=%d K=%d%s%s: vs float64", T, N, K,
             pad ? " (strided)" : "", form);
    report(what, rel_err(got, reff, (size_t)T, (size_t)N, (size_t)ldy), tol);
    snprintf(what, sizeof what, "matmul fp8 T=%d N=%d K=%d%s%s: vs the CPU", T, N, K,
             pad ? " (strided)" : "", form);
    report(what, rel_err(got, cpu, (size_t)T, (size_t)N, (size_t)ldy), tol);
    if ((T <= 8 || mode) && mode != 5 &&
        mode != 7) { /* more blocks, each fewer tiles: the same bits */
        float *rg = malloc((size_t)T * ldy * 4);
        mm8_mode(c, rg, dy, ldy, dx, ldx, T, &m, mode, 4);
        size_t bad = 0;
        for (int t = 0; t < T; t++)
            bad += words_differ(rg + (size_t)t * ldy, got + (size_t)t * ldy, (size_t)N);
        snprintf(what, sizeof what,
                 "matmul fp8 T=%d N=%d K=%d%s%s: 4 blocks an SM, words differing", T, N, K,
                 pad ? " (strided)" : "", form);
        report(what, (double)bad, 0.0);
        free(rg);
    }
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dq), ds_cu_dealloc(dsr);
    free(x), free(wb), free(q), free(sr), free(cpu), free(got), free(ref), free(reff), free(xq);
    free(st);
}

/* A stack of an FP8 and a BF16 run (ptpc's KDA input stack with b_proj excluded) writes both
 * column ranges of one output. */
static void check_matmul_runs(ds_cu *c, int T, int N1, int N2, int K) {
    float *x = rand_f32((size_t)T * K, -1, 1);
    uint16_t *wb = rand_bf16((size_t)(N1 + N2) * K, -0.05f, 0.05f);
    uint8_t *q = malloc((size_t)N1 * K);
    float *sr = malloc((size_t)N1 * 4);
    ds_mat h1 = {wb, DS_DT_BF16, N1, K, NULL};
    ds_ptpc_quantize(q, sr, &h1, 0, K);
    const int ldy = N1 + N2;
    float *ref = calloc((size_t)T * ldy, 4), *got = calloc((size_t)T * ldy, 4);
    ds_mat m1 = {q, DS_DT_F8_E4M3, N1, K, sr}, m2 = {wb + (size_t)N1 * K, DS_DT_BF16, N2, K, NULL};
    ds_matmul(ref, ldy, x, K, T, &m1);
    ds_matmul(ref + N1, ldy, x, K, T, &m2);
    float *dx = dev(c, x, (size_t)T * K * 4), *dy = dev(c, NULL, (size_t)T * ldy * 4);
    uint8_t *dq = dev(c, q, (size_t)N1 * K);
    float *dsr = dev(c, sr, (size_t)N1 * 4);
    uint16_t *dw2 = dev(c, wb + (size_t)N1 * K, (size_t)N2 * K * 2);
    poison(c, dy, (size_t)T * ldy * 4);
    ds_cu_mat runs[2] = {{(const uint16_t *)dq, N1, K, DS_CU_FP8, dsr, NULL, 0},
                         {dw2, N2, K, DS_CU_BF16, NULL, NULL, 0}};
    ds_cu_mat m = {NULL, N1 + N2, K, DS_CU_BF16, NULL, runs, 2};
    ds_err err = {{0}};
    if (ds_cu_matmul(c, dy, ldy, dx, K, T, &m, &err) || ds_cu_sync(c, &err)) DIE("%s", err.msg);
    fetch(c, got, dy, (size_t)T * ldy * 4);
    char what[96];
    snprintf(what, sizeof what, "matmul fp8 | bf16 stack T=%d N=%d+%d K=%d", T, N1, N2, K);
    report(what, rel_err(got, ref, (size_t)T, (size_t)ldy, (size_t)ldy), T > 2 ? 1e-2 : 1e-5);
    ds_cu_dealloc(dx), ds_cu_dealloc(dy), ds_cu_dealloc(dq), ds_cu_dealloc(dsr), ds_cu_dealloc(dw2);
    free(x), free(wb), free(q), free(sr), free(ref), free(got);
}

void checks_matmul_fp8(ds_cu *c) {
    check_e4m3_rounding(c);
    check_ptpc_quantize(c, 37, 200, 0, 200);
    check_ptpc_quantize(c, 64, 2304, 768, 768); /* a TP column slice: the whole row's scale */
    static const int Ts[] = {1, 2, 7, 64, 300};
    for (size_t i = 0; i < DS_ARRAY_LEN(Ts); i++) {
        const int T = Ts[i];
        /* streamed sums: f32 in a fixed order; tensor cores (T > 2, 16-byte aligned rows of y:
         * not N = 333): cuBLASLt's FP8 accumulation, measured at 1.1e-4 */
        check_matmul_fp8(c, T, 333, 2304, 0, 0, 1e-5);
        check_matmul_fp8(c, T, 96, 1024, 8, 0, T > 2 ? 1e-3 : 1e-5);
        if (T > 2) check_matmul_fp8(c, T, 96, 1024, 8, 7, 1e-3);
        check_matmul_fp8(c, T, 77, 200, 3, 0, 1e-5); /* K % 16 != 0: the one-code kernel */
        check_matmul_fp8(c, T, 333, 2304, 0, 1, 1e-5);
        check_matmul_fp8(c, T, 333, 2304, 0, 2, 1e-5);
        check_matmul_fp8(c, T, 96, 1024, 8, 2, 1e-5);
    }
    /* K's split forced (an experiment's knob): 12544 rows the rule splits 4 ways on 132 SMs */
    check_matmul_fp8(c, 1, 12544, 2304, 0, 3, 1e-5);
    check_matmul_fp8(c, 1, 12544, 2304, 0, 4, 1e-5);
    check_matmul_fp8(c, 7, 12544, 2304, 0, 3, 1e-5);
    /* one token a warp a row, each of its shapes (R, U by K), strided rows, the largest K */
    check_matmul_fp8(c, 1, 333, 2304, 0, 5, 1e-5);
    check_matmul_fp8(c, 1, 96, 1024, 8, 5, 1e-5);
    check_matmul_fp8(c, 1, 301, 1536, 5, 5, 1e-5);
    check_matmul_fp8(c, 1, 2304, 4096, 0, 5, 1e-5);
    check_matmul_fp8(c, 1, 130, 11264, 0, 5, 1e-5);
    check_matmul_fp8(c, 1, 12544, 2304, 0, 5, 1e-5);
    check_matmul_fp8(c, 2, 12544, 2304, 0, 6, 1e-5); /* K whole at 2 tokens */
    check_matmul_fp8(c, 2, 333, 2304, 0, 6, 1e-5);
    /* on wgmma (E4M3 tensor cores; their own sums, a 64-column partial at a time): one tile,
     * tiles split along K (2, 8 and 16 slices, the last block adding them), strided rows, 1 to 8
     * tokens, the largest K; the re-run above checks that every split gives the same bits. The
     * tensor core's own sums of E4M3 products are narrower than f32: 6e-5 off float64 at one
     * token on an H100 (bench/RESULTS.md session 49), so 3e-4 (a wrong term or row gives ~1) */
    static const int Tw[] = {1, 2, 7, 8};
    for (size_t i = 0; i < DS_ARRAY_LEN(Tw); i++) {
        check_matmul_fp8(c, Tw[i], 333, 2304, 0, 8, 3e-4);
        check_matmul_fp8(c, Tw[i], 12544, 2304, 0, 8, 3e-4);
        check_matmul_fp8(c, Tw[i], 2304, 4096, 0, 8, 3e-4);
        check_matmul_fp8(c, Tw[i], 96, 1024, 8, 8, 3e-4);
    }
    check_matmul_fp8(c, 1, 130, 11264, 0, 8, 3e-4);
    check_matmul_fp8(c, 3, 77, 200, 3, 8, 1e-5); /* K % 64 != 0: the other forms */
    check_matmul_runs(c, 1, 96, 32, 512);
    check_matmul_runs(c, 64, 96, 32, 512);
}

/* ---- timings ----------------------------------------------------------------------------------
 */

typedef struct mm8_ctx {
    float *y, *x;
    ds_cu_mat w;
    int T;
} mm8_ctx;
static void run_mm8(ds_cu *c, void *p) {
    mm8_ctx *m = p;
    ds_err err;
    if (ds_cu_matmul(c, m->y, m->w.rows, m->x, m->w.cols, m->T, &m->w, &err)) DIE("%s", err.msg);
}

/* one matmul of N x K at T tokens, BF16 and FP8: ms and weight bytes per second */
static void bench_pair(ds_cu *c, int N, int K, int T, double copy_gbs) {
    ds_err err = {{0}};
    uint16_t *wb = ds_cu_alloc(c, (size_t)N * K * 2, &err);
    uint8_t *q = ds_cu_alloc(c, (size_t)N * K, &err);
    float *sr = ds_cu_alloc(c, (size_t)N * 4, &err);
    float *x = ds_cu_alloc(c, (size_t)T * K * 4, &err),
          *y = ds_cu_alloc(c, (size_t)T * N * 4, &err);
    if (!wb || !q || !sr || !x || !y ||
        ds_cu_fill_random_bf16(c, wb, (size_t)N, (size_t)K, 11, 0, 0, (size_t)K, 0.03f, &err) ||
        ds_cu_ptpc_quantize_bf16(c, q, sr, wb, N, K, 0, K, &err))
        DIE("%s", err.msg);
    float *h = rand_f32((size_t)T * K, -1, 1);
    if (ds_cu_upload(c, x, h, (size_t)T * K * 4, &err)) DIE("%s", err.msg);
    free(h);
    mm8_ctx mb = {y, x, {wb, N, K, DS_CU_BF16, NULL, NULL, 0}, T};
    mm8_ctx m8 = {y, x, {(const uint16_t *)q, N, K, DS_CU_FP8, sr, NULL, 0}, T};
    const double msb = median_ms(c, run_mm8, &mb, 3, 20);
    const long lt0 = ds_cu_f8_lt_vec_runs(c);
    const double ms8 = median_ms(c, run_mm8, &m8, 3, 20);
    /* the FP8 product went through cuBLASLt with the scales as its outer vectors */
    const int lt = ds_cu_f8_lt_vec_runs(c) > lt0;
    /* other forms of the streaming products (up to 8 tokens): {rows: blocks an SM a warp a row
     * (-1: off, the tiles; -2: on wgmma; -3: on wgmma, the codes made first (ptpc_act_k); one
     * token only), the tiles' blocks an SM} */
    static const struct {
        int rows, waves;
        const char *name;
    } forms[] = {{-2, 0, "on wgmma"},
                 {-3, 0, "on wgmma, codes first"},
                 {-1, 0, "the tiles"},
                 {-1, 4, "the tiles, 4 blocks an SM"},
                 {2, 0, "a warp a row, 2 blocks an SM"},
                 {8, 0, "a warp a row, 8 blocks an SM"}};
    double msr[DS_ARRAY_LEN(forms)] = {0};
    for (size_t f = 0; f < DS_ARRAY_LEN(forms) && T <= 8; f++) {
        if (forms[f].rows >= 0 && T > 1) continue;
        ds_cu_set_f8_wg(c, forms[f].rows <= -2);
        ds_cu_set_f8_prequant(c, forms[f].rows == -3);
        ds_cu_set_f8_rows(c, forms[f].rows < 0 ? -1 : forms[f].rows);
        ds_cu_set_f8_gemv_waves(c, forms[f].waves);
        msr[f] = median_ms(c, run_mm8, &m8, 3, 20);
    }
    ds_cu_set_f8_wg(c, 0);
    ds_cu_set_f8_prequant(c, 0);
    ds_cu_set_f8_rows(c, 0);
    ds_cu_set_f8_gemv_waves(c, 0);
    const double bb = (double)N * K * 2, b8 = (double)N * K + 4.0 * N;
    const double fl = 2.0 * N * K * T;
    printf("bench matmul %5d x %5d T=%-5d bf16 %.4f ms (%.0f GB/s, %.0f%% of copy, %.0f TFLOP/s) | "
           "fp8%s %.4f ms (%.0f GB/s, %.0f%% of copy, %.0f TFLOP/s)\n",
           N, K, T, msb, bb / (msb * 1e-3) / 1e9, 100.0 * bb / (msb * 1e-3) / 1e9 / copy_gbs,
           fl / (msb * 1e-3) / 1e12, lt ? " (cuBLASLt, scaled)" : "", ms8, b8 / (ms8 * 1e-3) / 1e9,
           100.0 * b8 / (ms8 * 1e-3) / 1e9 / copy_gbs, fl / (ms8 * 1e-3) / 1e12);
    for (size_t f = 0; f < DS_ARRAY_LEN(forms); f++)
        if (msr[f] > 0)
            printf("bench matmul %5d x %5d T=%-5d fp8 %s %.4f ms (%.0f%% of copy)\n", N, K, T,
                   forms[f].name, msr[f], 100.0 * b8 / (msr[f] * 1e-3) / 1e9 / copy_gbs);
    ds_cu_dealloc(wb), ds_cu_dealloc(q), ds_cu_dealloc(sr), ds_cu_dealloc(x), ds_cu_dealloc(y);
}

void bench_matmul_fp8(ds_cu *c, const cuda_ceilings *ceil) {
    /* decode shapes of the 48B model (KDA's q|k|v|f_a|g_a stack, o_proj, the dense MLP's
     * gate|up, a shared expert's down) and a large one */
    static const int shapes[][2] = {
        {12544, 2304}, {2304, 4096}, {2304, 9216}, {18432, 2304}, {16384, 7168}};
    for (size_t i = 0; i < DS_ARRAY_LEN(shapes); i++) {
        for (int T = 1; T <= 2; T++) bench_pair(c, shapes[i][0], shapes[i][1], T, ceil->copy_gbs);
        /* the vendor's tensor-core GEMMs on the same weights at 16 tokens (cuBLAS BF16, cuBLASLt
         * FP8): what FP8 tensor cores (wgmma) reach streaming these matrices, a peer for the
         * one-token kernels' copy fraction (the bytes are the same) */
        bench_pair(c, shapes[i][0], shapes[i][1], 16, ceil->copy_gbs);
    }
    /* prefill: tensor cores */
    bench_pair(c, 8192, 8192, 8192, ceil->copy_gbs);
    bench_pair(c, 18432, 2304, 8192, ceil->copy_gbs);
    bench_pair(c, 2304, 9216, 8192, ceil->copy_gbs);
}
