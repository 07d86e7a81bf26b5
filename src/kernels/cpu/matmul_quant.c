/* matmul_quant.c — products with quantized weights (kernels.h defines them), and the ptpc_fp8
 * quantizers.
 *
 * FP8 (w8a8): the activations become E4M3 values (exact in f32) with one scale a token, the codes
 * widen exactly to f32, and the product of two E4M3 values is exact in f32, so only the order of
 * the additions separates this from the GPU's tensor cores. Each output is
 * (sum * s_t) * scale[r], in that order, on every backend.
 * MXFP4 (w4a16 on the GPU; f32 activations here): each code times its E8M0 scale is exact in f32.
 *
 * These first forms widen a block of rows to an f32 panel and run the f32 kernel over it. */
#include "kernels/cpu/matmul_quant.h"

#include "kernels/shared/quant.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

enum { ROWS_PER_PANEL = 64 };

/* Rows [r0, r0+nr) of w as f32 into panel [nr][K]; FP8 codes widen without their scale. */
static void widen_rows(float *panel, const ds_mat *w, int r0, int nr) {
    const int K = w->cols;
    for (int i = 0; i < nr; i++) {
        float *p = panel + (size_t)i * (size_t)K;
        const int r = r0 + i;
        if (w->dtype == DS_DT_F8_E4M3) {
            const uint8_t *row = (const uint8_t *)w->data + (size_t)r * (size_t)K;
            for (int c = 0; c < K; c++) p[c] = ds_e4m3_to_f32(row[c]);
        } else {
            for (int c = 0; c < K; c++) p[c] = ds_mxfp4_at(w->data, w->scale, K, r, c);
        }
    }
}

void ds_ptpc_quantize_act(float *xq, float *s, const float *x, int ldx, int T, int K) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * (size_t)ldx;
        float amax = 0.0f;
        for (int c = 0; c < K; c++) amax = fmaxf(amax, fabsf(xr[c]));
        const float st = ds_ptpc_scale(amax), inv = 1.0f / st;
        s[t] = st;
        for (int c = 0; c < K; c++)
            xq[(size_t)t * (size_t)K + c] = ds_e4m3_to_f32(ds_f32_to_e4m3(xr[c] * inv));
    }
}

static float elem_f32(const ds_mat *w, size_t i) {
    const void *d = w->data;
    if (w->dtype == DS_DT_F32) return ((const float *)d)[i];
    uint16_t h = ((const uint16_t *)d)[i];
    return w->dtype == DS_DT_BF16 ? ds_bf16_to_f32(h) : ds_f16_to_f32(h);
}

void ds_ptpc_quantize(uint8_t *codes, float *scales, const ds_mat *w, int c0, int nc) {
    const int K = w->cols;
#pragma omp parallel for schedule(static) if ((double)w->rows * K >= (1 << 20))
    for (int r = 0; r < w->rows; r++) {
        const size_t base = (size_t)r * (size_t)K;
        float amax = 0.0f;
        for (int c = 0; c < K; c++) amax = fmaxf(amax, fabsf(elem_f32(w, base + (size_t)c)));
        const float s = ds_ptpc_scale(amax), inv = 1.0f / s;
        scales[r] = s;
        for (int c = 0; c < nc; c++)
            codes[(size_t)r * (size_t)nc + c] =
                ds_f32_to_e4m3(elem_f32(w, base + (size_t)(c0 + c)) * inv);
    }
}

void ds_matmul_quant(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w) {
    const int N = w->rows, K = w->cols;
    const int fp8 = w->dtype == DS_DT_F8_E4M3;
    float *panel = malloc((size_t)ROWS_PER_PANEL * (size_t)K * sizeof(float));
    float *xq = fp8 ? malloc((size_t)T * (size_t)K * sizeof(float)) : NULL;
    float *st = fp8 ? malloc((size_t)T * sizeof(float)) : NULL;
    if (!panel || (fp8 && (!xq || !st)))
        abort(); /* a few MB at most: as fatal as a stack overflow */
    if (fp8) ds_ptpc_quantize_act(xq, st, x, ldx, T, K);
    const float *xin = fp8 ? xq : x;
    const int ldin = fp8 ? K : ldx;
    for (int r0 = 0; r0 < N; r0 += ROWS_PER_PANEL) {
        const int nr = DS_MIN(ROWS_PER_PANEL, N - r0);
        widen_rows(panel, w, r0, nr);
        const ds_mat pm = {panel, DS_DT_F32, nr, K, NULL};
        ds_matmul(y + r0, ldy, xin, ldin, T, &pm);
    }
    if (fp8) {
        const float *sc = w->scale;
        for (int t = 0; t < T; t++)
            for (int r = 0; r < N; r++) {
                float *o = y + (size_t)t * (size_t)ldy + r;
                *o = (*o * st[t]) * sc[r];
            }
    }
    free(panel);
    free(xq);
    free(st);
}
