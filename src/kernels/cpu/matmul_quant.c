/* matmul_quant.c — products with quantized weights (kernels.h defines them), and the ptpc_fp8
 * quantizers.
 *
 * FP8 (w8a8): the activations become E4M3 values (exact in f32) with one scale a token, the codes
 * widen exactly to f32, and the product of two E4M3 values is exact in f32, so only the order of
 * the additions separates this from the GPU's tensor cores. Each output is
 * (sum * s_t) * scale[r], in that order, on every backend.
 * MXFP4 (w4a16 on the GPU; f32 activations here): each code times its E8M0 scale is exact in f32.
 *
 * The order of the additions is matmul.c's (lane l of V accumulates columns c = l (mod V) in
 * increasing c, then a fixed tree), and so are the two strategies:
 *  - streaming (T <= T_STREAM, decode): memory-bound. Tiles of 4 rows x up to 3 tokens read the
 *    packed weights front to back and convert them in registers (matmul_quant_simd.c); with more
 *    than one token tile the rows go in chunks of KC_STREAM columns that stay in L1.
 *  - blocked (larger T, prefill): each thread widens a block of rows x KC_BLOCK columns into an f32
 *    panel once and runs matmul.c's f32 tile for every token tile over it.
 * Both give every token the bits of T = 1. For FP8 the activations are quantized once a call
 * (ds_ptpc_quantize_act's definition, times DS_FP8_XSCALE: see matmul_quant.h).
 *
 * Scratch: the blocked path allocates like matmul.c's (and streams if that fails). The streaming
 * FP8 path keeps its quantized activations ([T][K] floats, T <= 16: K can be 35840, too big for a
 * stack) in a grow-only buffer per calling thread, freed when the thread ends; if it cannot be
 * allocated, the product converts the activations on the fly instead (slowly, the same bits). */
#include "kernels/cpu/matmul_quant.h"

#include "kernels/shared/quant.h"

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum {
    T_STREAM = 16,   /* up to this many tokens: the streaming path (matmul.c's) */
    NB_STREAM = 16,  /* streaming: rows per unit of work handed to a thread */
    KC_STREAM = 512, /* streaming, T > DS_QNT: columns per chunk; a multiple of 32 (and of 16,
                        act_stream's blocks) */
    NB_MAX = 64,     /* blocked: rows per block */
    NB_MIN = 16,     /* blocked: fewer rows per block when that keeps every thread busy */
    KC_BLOCK = 1024, /* blocked: columns per block; a multiple of 32 */
    T_CHUNK = 512,   /* blocked: tokens per call of the blocked driver */
};
#define PAR_MIN_MACS (1 << 16)

/* ---- the quantizers (definitions) ------------------------------------------------------------ */

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

/* ---- portable path (8 lanes, a multiply and an add, as matmul.c's) --------------------------- */

/* A weight code's value times 2^-120, as the SIMD paths read it (matmul_quant.h). */
static float fp8_w_scalar(uint8_t b) {
    return ds_bits_f32(ds_fp8_w_bits(b));
}

static float mx_w_scalar(const uint8_t *w, const uint8_t *ws, int c) {
    const uint8_t byte = w[c / 2];
    return ds_fp4_to_f32((c & 1) ? (uint8_t)(byte >> 4) : (uint8_t)(byte & 15)) *
           ds_e8m0_to_f32(ws[c / DS_MXFP4_GROUP]);
}

static float amax_scalar(const float *x, int n) {
    float m = 0.0f;
    for (int c = 0; c < n; c++) m = fmaxf(m, fabsf(x[c]));
    return m;
}

static float act1_scalar(float v) {
    return ds_e4m3_to_f32(ds_f32_to_e4m3(v)) * DS_FP8_XSCALE;
}

static void act_scalar(float *xq, const float *x, int n, float inv) {
    for (int c = 0; c < n; c++) xq[c] = act1_scalar(x[c] * inv);
}

/* matmul.c's trees: 8 lanes (l, l+4), (l, l+2), (0, 1); 16 lanes first (l, l+8). */
static float hsum_lanes(const float *a, int V) {
    float b[8];
    for (int l = 0; l < 8; l++) b[l] = V == 16 ? a[l] + a[l + 8] : a[l];
    float s[4];
    for (int l = 0; l < 4; l++) s[l] = b[l] + b[l + 4];
    float u0 = s[0] + s[2], u1 = s[1] + s[3];
    return u0 + u1;
}

static void tile_scalar(int mr, int nt, int fp8, const uint8_t *w, size_t ldw, const uint8_t *ws,
                        size_t ldws, const float *x, size_t ldx, int kc, float *part, size_t ldp,
                        int first, float *y, size_t ldy) {
    float acc[DS_QMR][DS_QNT][8];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int l = 0; l < 8; l++)
                acc[i][j][l] = first ? 0.0f : part[(size_t)j * ldp + (size_t)i * 8 + (size_t)l];
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < kc; c++) {
            const uint8_t *wi = w + (size_t)i * ldw;
            const float wv = fp8 ? fp8_w_scalar(wi[c]) : mx_w_scalar(wi, ws + (size_t)i * ldws, c);
            for (int j = 0; j < nt; j++) acc[i][j][c % 8] += x[(size_t)j * ldx + (size_t)c] * wv;
        }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) {
            if (y)
                y[(size_t)j * ldy + (size_t)i] = hsum_lanes(acc[i][j], 8);
            else
                memcpy(part + (size_t)j * ldp + (size_t)i * 8, acc[i][j], sizeof acc[i][j]);
        }
}

static void panel_scalar(int fp8, float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                         const uint8_t *ws, size_t ldws, int nr, int kc) {
    const int kcp = (kc + 7) & ~7;
    for (int i = 0; i < nr; i++) {
        const uint8_t *wi = w + (size_t)i * ldw;
        float *p = panel + (size_t)i * ldp;
        for (int c = 0; c < kc; c++)
            p[c] = fp8 ? fp8_w_scalar(wi[c]) : mx_w_scalar(wi, ws + (size_t)i * ldws, c);
        for (int c = kc; c < kcp; c++) p[c] = 0.0f;
    }
}

static void panel_fp8_scalar(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                             const uint8_t *ws, size_t ldws, int nr, int kc) {
    panel_scalar(1, panel, ldp, w, ldw, ws, ldws, nr, kc);
}
static void panel_mx_scalar(float *panel, size_t ldp, const uint8_t *w, size_t ldw,
                            const uint8_t *ws, size_t ldws, int nr, int kc) {
    panel_scalar(0, panel, ldp, w, ldw, ws, ldws, nr, kc);
}

#define SCALAR_QTILES(MR_, NT_)                                                                    \
    static void tile_fp8_scalar_##MR_##_##NT_(                                                     \
        const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws, const float *x, size_t ldx,  \
        int kc, float *part, size_t ldp, int first, float *y, size_t ldy) {                        \
        tile_scalar(MR_, NT_, 1, w, ldw, ws, ldws, x, ldx, kc, part, ldp, first, y, ldy);          \
    }                                                                                              \
    static void tile_mx_scalar_##MR_##_##NT_(                                                      \
        const uint8_t *w, size_t ldw, const uint8_t *ws, size_t ldws, const float *x, size_t ldx,  \
        int kc, float *part, size_t ldp, int first, float *y, size_t ldy) {                        \
        tile_scalar(MR_, NT_, 0, w, ldw, ws, ldws, x, ldx, kc, part, ldp, first, y, ldy);          \
    }
#define QTILES_FOR_MR(GEN, MR_) GEN(MR_, 1) GEN(MR_, 2) GEN(MR_, 3)
QTILES_FOR_MR(SCALAR_QTILES, 1)
QTILES_FOR_MR(SCALAR_QTILES, 2)
QTILES_FOR_MR(SCALAR_QTILES, 3)
QTILES_FOR_MR(SCALAR_QTILES, 4)

#define QROW(K, MR_)                                                                               \
    { tile_##K##_scalar_##MR_##_1, tile_##K##_scalar_##MR_##_2, tile_##K##_scalar_##MR_##_3 }
#define QTABLE(K)                                                                                  \
    { QROW(K, 1), QROW(K, 2), QROW(K, 3), QROW(K, 4) }
static const ds_qops qops_scalar = {.lanes = 8,
                                    .fp8 = QTABLE(fp8),
                                    .mx = QTABLE(mx),
                                    .panel_fp8 = panel_fp8_scalar,
                                    .panel_mx = panel_mx_scalar,
                                    .amax = amax_scalar,
                                    .act = act_scalar,
                                    .act_stream = act_scalar};

static const ds_qops *qops_for(ds_isa isa) {
    return isa == DS_ISA_AVX512 ? &ds_qops_avx512
           : isa == DS_ISA_AVX2 ? &ds_qops_avx2
                                : &qops_scalar;
}

/* ---- scratch of the streaming FP8 path ------------------------------------------------------- */

static pthread_once_t g_key_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_key;
static int g_key_ok;
static int g_force_fallback;

void ds_matmul_quant_force_fallback(int on) {
    g_force_fallback = on;
}

static void make_key(void) {
    g_key_ok = pthread_key_create(&g_key, free) == 0;
}

/* This thread's buffer of at least n floats (64-byte aligned), or NULL. Layout: a 64-byte header
 * holding the capacity in floats, then the floats. */
static float *scratch_floats(size_t n) {
    pthread_once(&g_key_once, make_key);
    if (!g_key_ok || g_force_fallback) return NULL;
    char *p = pthread_getspecific(g_key);
    if (p && *(size_t *)p >= n) return (float *)(p + 64);
    const size_t cap = (n + 16383) & ~(size_t)16383;
    char *q = ds_aligned_alloc(64 + cap * sizeof(float), NULL);
    if (!q || pthread_setspecific(g_key, q) != 0) {
        free(q);
        return NULL;
    }
    free(p);
    *(size_t *)q = cap;
    return (float *)(q + 64);
}

/* ---- drivers --------------------------------------------------------------------------------- */

/* y[t][r] = (sum * st[t]) * scale[r] for t < T, rows [r0, r0 + nr), from y = sum * 2^-8 (the
 * scaled operands of the FP8 tiles; the multiplication by 2^8 is exact). */
static void fp8_scale_rows(float *y, int ldy, int T, int r0, int nr, const float *st,
                           const float *scale) {
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)t * (size_t)ldy;
        for (int r = r0; r < r0 + nr; r++) yt[r] = ((yt[r] * DS_FP8_SUMSCALE) * st[t]) * scale[r];
    }
}

/* The bytes of one row of data and of scales (MXFP4), and the offsets of column c0 in them. */
typedef struct qlayout {
    int fp8;
    size_t rb, srb;
} qlayout;

static qlayout layout_of(const ds_mat *w) {
    const int fp8 = w->dtype == DS_DT_F8_E4M3;
    return (qlayout){fp8, fp8 ? (size_t)w->cols : (size_t)w->cols / 2,
                     fp8 ? 0 : (size_t)w->cols / DS_MXFP4_GROUP};
}
static const uint8_t *w_at(const ds_mat *w, qlayout L, int r, int c0) {
    return (const uint8_t *)w->data + (size_t)r * L.rb + (size_t)(L.fp8 ? c0 : c0 / 2);
}
static const uint8_t *ws_at(const ds_mat *w, qlayout L, int r, int c0) {
    return L.fp8 ? NULL : (const uint8_t *)w->scale + (size_t)r * L.srb + (size_t)(c0 / 32);
}

/* Streaming over the packed weights; x is the f32 activations (MXFP4) or the scaled E4M3 values
 * of the activations with token scales st (FP8). */
static void qstream(const ds_qops *q, float *y, int ldy, const float *x, int ldx, int T,
                    const ds_mat *w, const float *st) {
    const int N = w->rows, K = w->cols, V = q->lanes;
    const qlayout L = layout_of(w);
    const int nblocks = (N + NB_STREAM - 1) / NB_STREAM;
    const int kc = T <= DS_QNT ? K : DS_MIN(K, KC_STREAM);
    const int nk = (K + kc - 1) / kc;
    const double macs = (double)N * (double)K * (double)T;
#pragma omp parallel if (nblocks > 1 && macs >= PAR_MIN_MACS)
    {
        /* part: [T][DS_QMR][V] lane accumulators of one row group between K chunks */
        float part[T_STREAM * DS_QMR * DS_QLANES_MAX] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            const int r0 = b * NB_STREAM, nr = DS_MIN(NB_STREAM, N - r0);
            for (int i0 = 0; i0 < nr; i0 += DS_QMR) {
                const int mr = DS_MIN(DS_QMR, nr - i0);
                for (int kb = 0; kb < nk; kb++) {
                    const int c0 = kb * kc, kcb = DS_MIN(kc, K - c0);
                    for (int t0 = 0; t0 < T; t0 += DS_QNT) {
                        const int nt = DS_MIN(DS_QNT, T - t0);
                        float *yt =
                            kb == nk - 1 ? y + (size_t)t0 * (size_t)ldy + (size_t)(r0 + i0) : NULL;
                        const ds_qtile_fn f =
                            L.fp8 ? q->fp8[mr - 1][nt - 1] : q->mx[mr - 1][nt - 1];
                        f(w_at(w, L, r0 + i0, c0), L.rb, ws_at(w, L, r0 + i0, c0), L.srb,
                          x + (size_t)t0 * (size_t)ldx + c0, (size_t)ldx, kcb,
                          nk > 1 ? part + (size_t)t0 * DS_QMR * (size_t)V : NULL,
                          (size_t)DS_QMR * (size_t)V, kb == 0, yt, (size_t)ldy);
                    }
                }
            }
            if (L.fp8) fp8_scale_rows(y, ldy, T, r0, nr, st, w->scale);
        }
    }
}

/* FP8 without scratch: each output sums in the lane order of the isa's tiles (V lanes; the terms
 * are exact, so a multiply and an add give a fused multiply-add's result), quantizing each
 * activation as it is used. */
static void fp8_on_the_fly(int V, float *y, int ldy, const float *x, int ldx, int T,
                           const ds_mat *w) {
    const int N = w->rows, K = w->cols;
    float st[T_STREAM], inv[T_STREAM];
    for (int t = 0; t < T; t++) {
        st[t] = ds_ptpc_scale(amax_scalar(x + (size_t)t * (size_t)ldx, K));
        inv[t] = 1.0f / st[t];
    }
#pragma omp parallel for schedule(static) if ((double)N * K * T >= PAR_MIN_MACS)
    for (int r = 0; r < N; r++) {
        const uint8_t *wr = (const uint8_t *)w->data + (size_t)r * (size_t)K;
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * (size_t)ldx;
            float acc[DS_QLANES_MAX] = {0};
            for (int c = 0; c < K; c++)
                acc[c % V] += act1_scalar(xt[c] * inv[t]) * fp8_w_scalar(wr[c]);
            y[(size_t)t * (size_t)ldy + r] =
                ((hsum_lanes(acc, V) * DS_FP8_SUMSCALE) * st[t]) * ((const float *)w->scale)[r];
        }
    }
}

static void stream_entry(const ds_qops *q, float *y, int ldy, const float *x, int ldx, int T,
                         const ds_mat *w) {
    const int K = w->cols;
    if (w->dtype == DS_DT_MXFP4) {
        qstream(q, y, ldy, x, ldx, T, w, NULL);
        return;
    }
    float *xq = scratch_floats((size_t)T * (size_t)K); /* [T][K] */
    if (!xq) {
        fp8_on_the_fly(q->lanes, y, ldy, x, ldx, T, w);
        return;
    }
    float st[T_STREAM];
    for (int t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * (size_t)ldx;
        st[t] = ds_ptpc_scale(q->amax(xt, K));
        q->act_stream(xq + (size_t)t * (size_t)K, xt, K, 1.0f / st[t]);
    }
    qstream(q, y, ldy, xq, K, T, w, st);
}

/* What the threads of the blocked strategy share. */
typedef struct qblock_ctx {
    const ds_qops *q;
    ds_mm_tile_fn tiles[DS_QMR][DS_QNT]; /* matmul.c's f32 tiles of the isa */
    const ds_mat *w;
    qlayout L;
    int T, K, nb, kc, nk;
    size_t ldpanel;
    float *xp; /* [nk][T][kc]: block kb at kb*T*kc, token stride = that block's width */
    float *st; /* FP8: [T] token scales */
    float *y;
    int ldy;
} qblock_ctx;

/* Token t of x into xp: copied (MXFP4) or quantized (FP8, its scale into st[t]). */
static void qblock_prep_token(const qblock_ctx *b, const float *x, int ldx, int t) {
    const float *xt = x + (size_t)t * (size_t)ldx;
    float inv = 1.0f;
    if (b->L.fp8) {
        b->st[t] = ds_ptpc_scale(b->q->amax(xt, b->K));
        inv = 1.0f / b->st[t];
    }
    for (int kb = 0; kb < b->nk; kb++) {
        const int c0 = kb * b->kc, kcb = DS_MIN(b->kc, b->K - c0);
        float *dst = b->xp + (size_t)kb * (size_t)b->T * (size_t)b->kc + (size_t)t * (size_t)kcb;
        if (b->L.fp8)
            b->q->act(dst, xt + c0, kcb, inv);
        else
            memcpy(dst, xt + c0, (size_t)kcb * sizeof(float));
    }
}

/* Rows [r0, r0 + nr) for every token: each K block widened into panel ([nb][ldpanel]) once, the
 * lane accumulators waiting in part ([T][nb][V]) between K blocks. */
static void qblock_rows(const qblock_ctx *b, int r0, int nr, float *panel, float *part) {
    const int V = b->q->lanes, T = b->T;
    for (int kb = 0; kb < b->nk; kb++) {
        const int c0 = kb * b->kc, kcb = DS_MIN(b->kc, b->K - c0);
        (b->L.fp8 ? b->q->panel_fp8 : b->q->panel_mx)(panel, b->ldpanel, w_at(b->w, b->L, r0, c0),
                                                      b->L.rb, ws_at(b->w, b->L, r0, c0), b->L.srb,
                                                      nr, kcb);
        const float *xs = b->xp + (size_t)kb * (size_t)T * (size_t)b->kc; /* [T][kcb] */
        for (int t0 = 0; t0 < T; t0 += DS_QNT) {
            const int nt = DS_MIN(DS_QNT, T - t0);
            float *yt = kb == b->nk - 1 ? b->y + (size_t)t0 * (size_t)b->ldy + (size_t)r0 : NULL;
            for (int i0 = 0; i0 < nr; i0 += DS_QMR) {
                const int mr = DS_MIN(DS_QMR, nr - i0);
                float *pt =
                    b->nk > 1 ? part + ((size_t)t0 * (size_t)b->nb + (size_t)i0) * (size_t)V : NULL;
                b->tiles[mr - 1][nt - 1](panel + (size_t)i0 * b->ldpanel, b->ldpanel,
                                         xs + (size_t)t0 * (size_t)kcb, (size_t)kcb, kcb, pt,
                                         (size_t)b->nb * (size_t)V, kb == 0, yt ? yt + i0 : NULL,
                                         (size_t)b->ldy);
            }
        }
    }
    if (b->L.fp8) fp8_scale_rows(b->y, b->ldy, T, r0, nr, b->st, b->w->scale);
}

static void qblocked(const ds_qops *q, ds_isa isa, float *y, int ldy, const float *x, int ldx,
                     int T, const ds_mat *w) {
    qblock_ctx b = {.q = q, .w = w, .L = layout_of(w), .T = T, .K = w->cols, .y = y, .ldy = ldy};
    const int N = w->rows, V = q->lanes, nth = omp_get_max_threads();
    for (int i = 0; i < DS_QMR; i++)
        for (int j = 0; j < DS_QNT; j++) b.tiles[i][j] = ds_matmul_f32_tile(isa, i + 1, j + 1);
    /* Rows per block: NB_MAX, halved while that leaves fewer than two blocks per thread. */
    b.nb = NB_MAX;
    while (b.nb > NB_MIN && (N + b.nb - 1) / b.nb < 2 * nth) b.nb /= 2;
    const int nblocks = (N + b.nb - 1) / b.nb;
    b.kc = DS_MIN(KC_BLOCK, b.K);
    b.nk = (b.K + b.kc - 1) / b.kc;
    b.ldpanel = (size_t)((b.kc + V - 1) / V * V);
    /* part: per thread [T][nb][V]; panel: per thread [nb][ldpanel]; st: [T] */
    const size_t part_n = b.nk > 1 ? (size_t)T * (size_t)b.nb * (size_t)V : 0;
    const size_t panel_n = (size_t)b.nb * b.ldpanel;
    float st[T_CHUNK];
    b.st = st;
    b.xp = ds_aligned_alloc((size_t)T * (size_t)b.K * sizeof(float), NULL);
    float *part = ds_aligned_alloc((size_t)nth * part_n * sizeof(float), NULL);
    float *panel = ds_aligned_alloc((size_t)nth * panel_n * sizeof(float), NULL);
    if (!b.xp || !part || !panel) { /* out of memory: streaming needs no such buffers, same bits */
        free(b.xp);
        free(part);
        free(panel);
        for (int t0 = 0; t0 < T; t0 += T_STREAM)
            stream_entry(q, y + (size_t)t0 * (size_t)ldy, ldy, x + (size_t)t0 * (size_t)ldx, ldx,
                         DS_MIN(T_STREAM, T - t0), w);
        return;
    }
#pragma omp parallel
    {
        const int me = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) qblock_prep_token(&b, x, ldx, t);
#pragma omp for schedule(static)
        for (int blk = 0; blk < nblocks; blk++)
            qblock_rows(&b, blk * b.nb, DS_MIN(b.nb, N - blk * b.nb), panel + (size_t)me * panel_n,
                        part + (size_t)me * part_n);
    }
    free(b.xp);
    free(part);
    free(panel);
}

void ds_matmul_quant(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w) {
    const ds_isa isa = ds_kernels_isa();
    const ds_qops *q = qops_for(isa);
    if (T <= T_STREAM) {
        stream_entry(q, y, ldy, x, ldx, T, w);
        return;
    }
    for (int t0 = 0; t0 < T; t0 += T_CHUNK)
        qblocked(q, isa, y + (size_t)t0 * (size_t)ldy, ldy, x + (size_t)t0 * (size_t)ldx, ldx,
                 DS_MIN(T_CHUNK, T - t0), w);
}
