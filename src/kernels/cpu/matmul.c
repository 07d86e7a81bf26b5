/* matmul.c — products with a weight matrix kept in its file dtype: y = x W^T (ds_matmul, every
 * projection), y = x W (ds_matmul_t, MLA absorption) and the embedding lookup.
 *
 * ds_matmul: how one dot product is summed is the same in every configuration.
 * Output y[t][r] is the horizontal sum, in a fixed tree, of V lane accumulators (V = 8 for AVX2 and
 * the portable path, 16 for AVX-512); lane l accumulates x[t][c] * W[r][c] for c = l (mod V) in
 * increasing c, and the last partial vector of a row is padded with zeros. Tiling, the K blocking,
 * the f32 panel, the thread count and T only decide when each step runs, never the order of the
 * additions, so a token's result is bit-identical whatever else is in the batch
 * (docs/architecture.md invariant 7) and whichever of the decode/prefill strategies below is taken.
 *
 * Two strategies, both built on one register-blocked micro-kernel (a tile of up to 4 rows x 3
 * tokens: 12 independent FMA chains, 7 loads per 12 FMAs):
 *  - streaming (T <= T_STREAM, decode and small batches): memory-bound. Each thread owns a
 *    contiguous range of rows and reads them 4 at a time, front to back, straight from the weights,
 *    widening bf16 (zero-extend + shift) or f16 (F16C) to f32 in registers. With more than one
 *    token tile the 4 rows go in chunks of KC_STREAM columns that stay in L1 for every tile, so
 *    each weight byte comes from memory once.
 *  - blocked (larger T, prefill): compute-bound. x is copied into K-block-major order; each thread
 *    widens a block of up to NB_MAX rows x KC_BLOCK columns into an f32 panel (L2) once and runs
 *    every token tile over it; the lane accumulators of a tile wait in a per-thread buffer between
 *    K blocks, which keeps the addition order above intact.
 * Measured (bench/RESULTS.md, "Figures moved out of source comments"): one token streams a bf16
 * matrix faster than a plain read loop, and prompts run at about half the FMA peak. */
#include "kernels/cpu/kernels.h"
#include "kernels/cpu/matmul_quant.h"
#include "kernels/cpu/simd_sum.h"
#include "kernels/shared/quant.h"

#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

enum {
    MR = 4,          /* rows per micro-kernel tile */
    NT = 3,          /* tokens per micro-kernel tile */
    T_STREAM = 16,   /* up to this many tokens: the streaming path */
    NB_STREAM = 16,  /* streaming: rows per unit of work handed to a thread */
    KC_STREAM = 512, /* streaming, T > NT: columns per chunk (4 rows of it stay in L1) */
    NB_MAX = 64,     /* blocked: rows per block (the f32 panel, NB x KC_BLOCK, stays in L2) */
    NB_MIN = 16,     /* blocked: fewer rows per block when that keeps every thread busy */
    KC_BLOCK = 1024, /* blocked: columns per block; a multiple of 16 */
    T_CHUNK = 512,   /* blocked: tokens per call of the blocked driver */
    MAX_LANES = 16,  /* widest path (AVX-512) */
    TN_COLS = 32,    /* ds_matmul_t: output columns per tile (4 AVX2 vectors) */
    TN_TOK = 2,      /* ds_matmul_t: tokens per tile */
};
/* Below this many multiply-adds a parallel region costs more than it saves. */
#define PAR_MIN_MACS (1 << 16)

/* The weight source of a tile: the file dtype, or an f32 panel (SRC_F32). */
enum { SRC_F32 = 0, SRC_F16 = 1, SRC_BF16 = 2 };

static int src_of(ds_dtype dt) {
    return dt == DS_DT_F32 ? SRC_F32 : dt == DS_DT_F16 ? SRC_F16 : SRC_BF16;
}
static size_t src_size(int src) {
    return src == SRC_F32 ? 4 : 2;
}

size_t ds_mat_row_bytes(const ds_mat *w) {
    if (w->dtype == DS_DT_MXFP4) return (size_t)w->cols / 2;
    return (size_t)w->cols * ds_dtype_size(w->dtype);
}

size_t ds_mat_scale_row_bytes(const ds_mat *w) {
    if (w->dtype == DS_DT_MXFP4) return (size_t)w->cols / DS_MXFP4_GROUP;
    return w->dtype == DS_DT_F8_E4M3 ? sizeof(float) : 0;
}

ds_mat ds_mat_rows(const ds_mat *w, int row0, int n) {
    ds_mat m = *w;
    m.data = (const char *)w->data + (size_t)row0 * ds_mat_row_bytes(w);
    if (w->scale) m.scale = (const char *)w->scale + (size_t)row0 * ds_mat_scale_row_bytes(w);
    m.rows = n;
    return m;
}

/* One micro-kernel call: rows i < mr of W (row i at w + i*ldw elements), tokens j < nt of x (token
 * j at x + j*ldx), columns [0, kc). part, when non-NULL, holds the lane accumulators of this tile
 * between K blocks: the V-lane vector of (token j, row i) at part + j*ldp + i*V (64-byte aligned).
 * first: start from zero (else from part); y non-NULL: finish the sums into y[j*ldy + i] (else
 * park them in part). */
typedef void (*tile_fn)(const void *w, size_t ldw, const float *x, size_t ldx, int kc, float *part,
                        size_t ldp, int first, float *y, size_t ldy);
/* Widens rows i < nr, columns [0, kc) of W (src, row stride ldw elements) into panel[i][0..] (row
 * stride ldp floats), writing zeros up to the next multiple of the lane count. Meanwhile it
 * prefetches next_bytes of each of the next_rows rows at next + i*next_ld (the block widened after
 * this one): the rows are read one slice at a time, a pattern the hardware prefetchers miss. */
typedef void (*panel_fn)(float *panel, size_t ldp, const void *w, size_t ldw, int src, int nr,
                         int kc, const char *next, size_t next_ld, int next_rows,
                         size_t next_bytes);

typedef struct simd_ops {
    int lanes;
    tile_fn tiles[3][MR][NT]; /* [src][mr-1][nt-1] */
    panel_fn panel;
} simd_ops;

/* ---- portable path --------------------------------------------------------------------------- */
/* Mirrors the SIMD order with 8 lanes (a multiply and an add instead of a fused multiply-add). */

static float load_w_scalar(int src, const void *w, size_t i) {
    if (src == SRC_F32) return ((const float *)w)[i];
    uint16_t h = ((const uint16_t *)w)[i];
    return src == SRC_BF16 ? ds_bf16_to_f32(h) : ds_f16_to_f32(h);
}

/* The same reduction tree as the SIMD paths: lanes l and l+4, then l and l+2, then 0 and 1. */
static float hsum8_scalar(const float *a) {
    float s[4];
    for (int l = 0; l < 4; l++) s[l] = a[l] + a[l + 4];
    float u0 = s[0] + s[2], u1 = s[1] + s[3];
    return u0 + u1;
}

static void tile_scalar(int mr, int nt, int src, const void *w, size_t ldw, const float *x,
                        size_t ldx, int kc, float *part, size_t ldp, int first, float *y,
                        size_t ldy) {
    float acc[MR][NT][8];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int l = 0; l < 8; l++)
                acc[i][j][l] = first ? 0.0f : part[(size_t)j * ldp + (size_t)i * 8 + (size_t)l];
    for (int c = 0; c < kc; c += 8) {
        const int n = DS_MIN(8, kc - c);
        for (int i = 0; i < mr; i++) {
            float wv[8];
            for (int l = 0; l < n; l++)
                wv[l] = load_w_scalar(src, w, (size_t)i * ldw + (size_t)(c + l));
            for (int j = 0; j < nt; j++)
                for (int l = 0; l < n; l++)
                    acc[i][j][l] += x[(size_t)j * ldx + (size_t)(c + l)] * wv[l];
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) {
            if (y)
                y[(size_t)j * ldy + (size_t)i] = hsum8_scalar(acc[i][j]);
            else
                memcpy(part + (size_t)j * ldp + (size_t)i * 8, acc[i][j], sizeof acc[i][j]);
        }
}

static void panel_scalar(float *panel, size_t ldp, const void *w, size_t ldw, int src, int nr,
                         int kc, const char *next, size_t next_ld, int next_rows,
                         size_t next_bytes) {
    const int kcp = (kc + 7) & ~7;
    for (int i = 0; i < nr; i++) {
        for (int c = 0; c < kc; c++)
            panel[(size_t)i * ldp + (size_t)c] = load_w_scalar(src, w, (size_t)i * ldw + (size_t)c);
        for (int c = kc; c < kcp; c++) panel[(size_t)i * ldp + (size_t)c] = 0.0f;
    }
}

#define SCALAR_TILE(MR_, NT_, SRC_)                                                                \
    static void tile_scalar_##MR_##_##NT_##_##SRC_(const void *w, size_t ldw, const float *x,      \
                                                   size_t ldx, int kc, float *part, size_t ldp,    \
                                                   int first, float *y, size_t ldy) {              \
        tile_scalar(MR_, NT_, SRC_, w, ldw, x, ldx, kc, part, ldp, first, y, ldy);                 \
    }

/* ---- AVX2 + FMA + F16C ----------------------------------------------------------------------- */
/* (target attributes, avx2_mask and the summing tree: simd_sum.h) */

AVX2_INLINE __m256 avx2_load_w(int src, const void *p) {
    if (src == SRC_F32) return _mm256_loadu_ps((const float *)p);
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (src == SRC_F16) return _mm256_cvtph_ps(h);
    /* bf16 is the high half of an f32: zero-extend to 32 bits and shift into place. */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The first n (< 8) elements, zeros after; reads nothing past element n-1, since the last row of
 * an mmapped tensor may end at the end of the mapping. */
AVX2_INLINE __m256 avx2_load_w_tail(int src, const void *p, int n) {
    if (src == SRC_F32) return _mm256_maskload_ps((const float *)p, avx2_mask(n));
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)n * 2);
    return avx2_load_w(src, tmp);
}

AVX2_INLINE void avx2_tile(const int mr, const int nt, const int src, const void *w, size_t ldw,
                           const float *x, size_t ldx, int kc, float *part, size_t ldp, int first,
                           float *y, size_t ldy) {
    const char *wb = (const char *)w;
    const size_t es = src_size(src);
    __m256 acc[MR][NT]; /* [row][token], lane l sums columns c = l (mod 8) */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            acc[i][j] = first ? _mm256_setzero_ps()
                              : _mm256_load_ps(part + (size_t)j * ldp + (size_t)i * 8);
    const int nfull = kc / 8, rem = kc % 8;
    for (int v = 0; v < nfull; v++) {
        const size_t c = (size_t)v * 8;
        __m256 xv[NT];
        for (int j = 0; j < nt; j++) xv[j] = _mm256_loadu_ps(x + (size_t)j * ldx + c);
        for (int i = 0; i < mr; i++) {
            const __m256 wv = avx2_load_w(src, wb + ((size_t)i * ldw + c) * es);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm256_fmadd_ps(xv[j], wv, acc[i][j]);
        }
    }
    if (rem) {
        const size_t c = (size_t)nfull * 8;
        const __m256i m = avx2_mask(rem);
        __m256 xv[NT];
        for (int j = 0; j < nt; j++) xv[j] = _mm256_maskload_ps(x + (size_t)j * ldx + c, m);
        for (int i = 0; i < mr; i++) {
            const __m256 wv = avx2_load_w_tail(src, wb + ((size_t)i * ldw + c) * es, rem);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm256_fmadd_ps(xv[j], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) {
            if (y)
                y[(size_t)j * ldy + (size_t)i] = avx2_hsum(acc[i][j]);
            else
                _mm256_store_ps(part + (size_t)j * ldp + (size_t)i * 8, acc[i][j]);
        }
}

static AVX2_FN void panel_avx2(float *panel, size_t ldp, const void *w, size_t ldw, int src, int nr,
                               int kc, const char *next, size_t next_ld, int next_rows,
                               size_t next_bytes) {
    const size_t es = src_size(src);
    const int nfull = kc / 8, rem = kc % 8;
    for (int i = 0; i < nr; i++) {
        if (i < next_rows)
            for (size_t b = 0; b < next_bytes; b += 64)
                _mm_prefetch(next + (size_t)i * next_ld + b, _MM_HINT_T0);
        const char *row = (const char *)w + (size_t)i * ldw * es;
        float *dst = panel + (size_t)i * ldp;
        for (int v = 0; v < nfull; v++)
            _mm256_storeu_ps(dst + v * 8, avx2_load_w(src, row + (size_t)v * 8 * es));
        if (rem)
            _mm256_storeu_ps(dst + nfull * 8,
                             avx2_load_w_tail(src, row + (size_t)nfull * 8 * es, rem));
    }
}

#define AVX2_TILE(MR_, NT_, SRC_)                                                                  \
    static AVX2_FN void tile_avx2_##MR_##_##NT_##_##SRC_(                                          \
        const void *w, size_t ldw, const float *x, size_t ldx, int kc, float *part, size_t ldp,    \
        int first, float *y, size_t ldy) {                                                         \
        avx2_tile(MR_, NT_, SRC_, w, ldw, x, ldx, kc, part, ldp, first, y, ldy);                   \
    }

/* ---- AVX-512 (F, BW, VL): the AVX2 path with 16 lanes ---------------------------------------- */
AVX512_INLINE __m512 avx512_load_w(int src, const void *p) {
    if (src == SRC_F32) return _mm512_loadu_ps(p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (src == SRC_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The first n (< 16) elements, zeros after; masked loads do not fault on the lanes left out. */
AVX512_INLINE __m512 avx512_load_w_tail(int src, const void *p, int n) {
    const __mmask16 m = avx512_mask(n);
    if (src == SRC_F32) return _mm512_maskz_loadu_ps(m, p);
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    if (src == SRC_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

AVX512_INLINE void avx512_tile(const int mr, const int nt, const int src, const void *w, size_t ldw,
                               const float *x, size_t ldx, int kc, float *part, size_t ldp,
                               int first, float *y, size_t ldy) {
    const char *wb = (const char *)w;
    const size_t es = src_size(src);
    __m512 acc[MR][NT]; /* [row][token], lane l sums columns c = l (mod 16) */
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            acc[i][j] = first ? _mm512_setzero_ps()
                              : _mm512_load_ps(part + (size_t)j * ldp + (size_t)i * 16);
    const int nfull = kc / 16, rem = kc % 16;
    for (int v = 0; v < nfull; v++) {
        const size_t c = (size_t)v * 16;
        __m512 xv[NT];
        for (int j = 0; j < nt; j++) xv[j] = _mm512_loadu_ps(x + (size_t)j * ldx + c);
        for (int i = 0; i < mr; i++) {
            const __m512 wv = avx512_load_w(src, wb + ((size_t)i * ldw + c) * es);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_fmadd_ps(xv[j], wv, acc[i][j]);
        }
    }
    if (rem) {
        const size_t c = (size_t)nfull * 16;
        const __mmask16 m = avx512_mask(rem);
        __m512 xv[NT];
        for (int j = 0; j < nt; j++) xv[j] = _mm512_maskz_loadu_ps(m, x + (size_t)j * ldx + c);
        for (int i = 0; i < mr; i++) {
            const __m512 wv = avx512_load_w_tail(src, wb + ((size_t)i * ldw + c) * es, rem);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_fmadd_ps(xv[j], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++) {
            if (y)
                y[(size_t)j * ldy + (size_t)i] = avx512_hsum(acc[i][j]);
            else
                _mm512_store_ps(part + (size_t)j * ldp + (size_t)i * 16, acc[i][j]);
        }
}

static AVX512_FN void panel_avx512(float *panel, size_t ldp, const void *w, size_t ldw, int src,
                                   int nr, int kc, const char *next, size_t next_ld, int next_rows,
                                   size_t next_bytes) {
    const size_t es = src_size(src);
    const int nfull = kc / 16, rem = kc % 16;
    for (int i = 0; i < nr; i++) {
        if (i < next_rows)
            for (size_t b = 0; b < next_bytes; b += 64)
                _mm_prefetch(next + (size_t)i * next_ld + b, _MM_HINT_T0);
        const char *row = (const char *)w + (size_t)i * ldw * es;
        float *dst = panel + (size_t)i * ldp;
        for (int v = 0; v < nfull; v++)
            _mm512_storeu_ps(dst + v * 16, avx512_load_w(src, row + (size_t)v * 16 * es));
        if (rem)
            _mm512_storeu_ps(dst + nfull * 16,
                             avx512_load_w_tail(src, row + (size_t)nfull * 16 * es, rem));
    }
}

#define AVX512_TILE(MR_, NT_, SRC_)                                                                \
    static AVX512_FN void tile_avx512_##MR_##_##NT_##_##SRC_(                                      \
        const void *w, size_t ldw, const float *x, size_t ldx, int kc, float *part, size_t ldp,    \
        int first, float *y, size_t ldy) {                                                         \
        avx512_tile(MR_, NT_, SRC_, w, ldw, x, ldx, kc, part, ldp, first, y, ldy);                 \
    }

/* ---- the instantiated tiles ------------------------------------------------------------------ */
#define TILES_FOR_MR(GEN, MR_, SRC_) GEN(MR_, 1, SRC_) GEN(MR_, 2, SRC_) GEN(MR_, 3, SRC_)
#define TILES_FOR_SRC(GEN, SRC_)                                                                   \
    TILES_FOR_MR(GEN, 1, SRC_)                                                                     \
    TILES_FOR_MR(GEN, 2, SRC_) TILES_FOR_MR(GEN, 3, SRC_) TILES_FOR_MR(GEN, 4, SRC_)
#define ALL_TILES(GEN) TILES_FOR_SRC(GEN, 0) TILES_FOR_SRC(GEN, 1) TILES_FOR_SRC(GEN, 2)
ALL_TILES(SCALAR_TILE)
ALL_TILES(AVX2_TILE)
ALL_TILES(AVX512_TILE)

#define TILE_ROW(P, MR_, SRC_)                                                                     \
    { tile_##P##_##MR_##_1_##SRC_, tile_##P##_##MR_##_2_##SRC_, tile_##P##_##MR_##_3_##SRC_ }
#define TILE_SRC(P, SRC_)                                                                          \
    { TILE_ROW(P, 1, SRC_), TILE_ROW(P, 2, SRC_), TILE_ROW(P, 3, SRC_), TILE_ROW(P, 4, SRC_) }
#define TILE_TABLE(P)                                                                              \
    { TILE_SRC(P, 0), TILE_SRC(P, 1), TILE_SRC(P, 2) }

static const simd_ops ops_scalar = {8, TILE_TABLE(scalar), panel_scalar};
static const simd_ops ops_avx2 = {8, TILE_TABLE(avx2), panel_avx2};
static const simd_ops ops_avx512 = {16, TILE_TABLE(avx512), panel_avx512};

static const simd_ops *ops_for(ds_isa isa) {
    return isa == DS_ISA_AVX512 ? &ops_avx512 : isa == DS_ISA_AVX2 ? &ops_avx2 : &ops_scalar;
}

ds_mm_tile_fn ds_matmul_f32_tile(ds_isa isa, int mr, int nt) {
    return ops_for(isa)->tiles[SRC_F32][mr - 1][nt - 1];
}

/* ---- ds_matmul driver ------------------------------------------------------------------------ */

/* Small T: each thread streams the rows of its row blocks, 4 at a time, straight from the weights
 * (the access pattern the hardware prefetchers follow best). With more than one token tile the rows
 * are taken in chunks of KC_STREAM columns; a chunk, once in L1, serves every token tile. */
static void matmul_stream(const simd_ops *ops, float *y, int ldy, const float *x, int ldx, int T,
                          const ds_mat *w) {
    const int N = w->rows, K = w->cols, V = ops->lanes, src = src_of(w->dtype);
    const size_t es = src_size(src);
    const char *wbytes = (const char *)w->data;
    const int nblocks = (N + NB_STREAM - 1) / NB_STREAM;
    const int kc = T <= NT ? K : DS_MIN(K, KC_STREAM);
    const int nk = (K + kc - 1) / kc;
    const double macs = (double)N * (double)K * (double)T;
#pragma omp parallel if (nblocks > 1 && macs >= PAR_MIN_MACS)
    {
        /* part: [T][MR][V] lane accumulators of one row group between K chunks (T <= T_STREAM) */
        float part[T_STREAM * MR * MAX_LANES] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            const int r0 = b * NB_STREAM, nr = DS_MIN(NB_STREAM, N - r0);
            for (int i0 = 0; i0 < nr; i0 += MR) {
                const int mr = DS_MIN(MR, nr - i0);
                const char *wr = wbytes + (size_t)(r0 + i0) * (size_t)K * es;
                for (int kb = 0; kb < nk; kb++) {
                    const int c0 = kb * kc, kcb = DS_MIN(kc, K - c0);
                    for (int t0 = 0; t0 < T; t0 += NT) {
                        const int nt = DS_MIN(NT, T - t0);
                        float *yt =
                            kb == nk - 1 ? y + (size_t)t0 * (size_t)ldy + (size_t)(r0 + i0) : NULL;
                        ops->tiles[src][mr - 1][nt - 1](
                            wr + (size_t)c0 * es, (size_t)K, x + (size_t)t0 * (size_t)ldx + c0,
                            (size_t)ldx, kcb, nk > 1 ? part + (size_t)t0 * MR * (size_t)V : NULL,
                            (size_t)MR * (size_t)V, kb == 0, yt, (size_t)ldy);
                    }
                }
            }
        }
    }
}

/* Blocked: x is first copied into xp, block-major ([block][T][kc], the last block narrower), so
 * that the slab of one K block is contiguous: with the power-of-two row strides of hidden sizes,
 * every token's slice would otherwise land in the same few cache sets. Then each thread, for each
 * of its row blocks and each K block, widens the weight block into its f32 panel and runs every
 * token tile over it. */
static void matmul_blocked(const simd_ops *ops, float *y, int ldy, const float *x, int ldx, int T,
                           const ds_mat *w) {
    const int N = w->rows, K = w->cols, V = ops->lanes, src = src_of(w->dtype);
    const size_t es = src_size(src);
    const char *wbytes = (const char *)w->data;
    const int nth = omp_get_max_threads();
    /* Rows per block: NB_MAX, halved while that leaves fewer than two blocks per thread. */
    int nb = NB_MAX;
    while (nb > NB_MIN && (N + nb - 1) / nb < 2 * nth) nb /= 2;
    const int nblocks = (N + nb - 1) / nb;
    const int kc = DS_MIN(KC_BLOCK, K);
    const int nk = (K + kc - 1) / kc;
    const size_t ldpanel = (size_t)((kc + V - 1) / V * V);
    /* xp: [nk][T][kc] packed x (block kb at kb*T*kc, token stride = that block's width);
     * part: per thread [T][nb][V] lane accumulators between K blocks;
     * panel: per thread [nb][ldpanel] the widened weight block. */
    const size_t part_n = nk > 1 ? (size_t)T * (size_t)nb * (size_t)V : 0;
    const size_t panel_n = (size_t)nb * ldpanel;
    float *xp = ds_aligned_alloc((size_t)T * (size_t)K * sizeof(float), NULL);
    float *part = ds_aligned_alloc((size_t)nth * part_n * sizeof(float), NULL);
    float *panel = ds_aligned_alloc((size_t)nth * panel_n * sizeof(float), NULL);
    if (!xp || !part || !panel) { /* out of memory: streaming needs no buffers, same result */
        free(xp);
        free(part);
        free(panel);
        for (int t0 = 0; t0 < T; t0 += T_STREAM)
            matmul_stream(ops, y + (size_t)t0 * (size_t)ldy, ldy, x + (size_t)t0 * (size_t)ldx, ldx,
                          DS_MIN(T_STREAM, T - t0), w);
        return;
    }

#pragma omp parallel
    {
        const int me = omp_get_thread_num();
        float *my_part = part + (size_t)me * part_n, *my_panel = panel + (size_t)me * panel_n;
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++)
            for (int kb = 0; kb < nk; kb++) {
                const int c0 = kb * kc, kcb = DS_MIN(kc, K - c0);
                memcpy(xp + (size_t)kb * (size_t)T * (size_t)kc + (size_t)t * (size_t)kcb,
                       x + (size_t)t * (size_t)ldx + (size_t)c0, (size_t)kcb * sizeof(float));
            }
#pragma omp for schedule(static)
        for (int b = 0; b < nblocks; b++) {
            const int r0 = b * nb, nr = DS_MIN(nb, N - r0);
            for (int kb = 0; kb < nk; kb++) {
                const int c0 = kb * kc, kcb = DS_MIN(kc, K - c0);
                /* the block widened next: same rows, next columns; else the next rows' first */
                const char *next = NULL;
                int next_rows = 0;
                size_t next_bytes = 0;
                if (kb + 1 < nk) {
                    next = wbytes + ((size_t)r0 * (size_t)K + (size_t)(c0 + kc)) * es;
                    next_rows = nr;
                    next_bytes = (size_t)DS_MIN(kc, K - c0 - kc) * es;
                } else if (b + 1 < nblocks) {
                    next = wbytes + (size_t)(r0 + nb) * (size_t)K * es;
                    next_rows = DS_MIN(nb, N - r0 - nb);
                    next_bytes = (size_t)kc * es;
                }
                ops->panel(my_panel, ldpanel, wbytes + ((size_t)r0 * (size_t)K + (size_t)c0) * es,
                           (size_t)K, src, nr, kcb, next, (size_t)K * es, next_rows, next_bytes);
                const float *xs = xp + (size_t)kb * (size_t)T * (size_t)kc; /* [T][kcb] */
                for (int t0 = 0; t0 < T; t0 += NT) {
                    const int nt = DS_MIN(NT, T - t0);
                    float *yt = kb == nk - 1 ? y + (size_t)t0 * (size_t)ldy + (size_t)r0 : NULL;
                    for (int i0 = 0; i0 < nr; i0 += MR) {
                        const int mr = DS_MIN(MR, nr - i0);
                        float *pt =
                            nk > 1 ? my_part + ((size_t)t0 * (size_t)nb + (size_t)i0) * (size_t)V
                                   : NULL;
                        ops->tiles[SRC_F32][mr - 1][nt - 1](
                            my_panel + (size_t)i0 * ldpanel, ldpanel, xs + (size_t)t0 * (size_t)kcb,
                            (size_t)kcb, kcb, pt, (size_t)nb * (size_t)V, kb == 0,
                            yt ? yt + i0 : NULL, (size_t)ldy);
                    }
                }
            }
        }
    }
    free(xp);
    free(part);
    free(panel);
}

void ds_matmul(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w) {
    const int N = w->rows, K = w->cols;
    if (T <= 0 || N <= 0) return;
    if (K <= 0) {
        for (int t = 0; t < T; t++) memset(y + (size_t)t * (size_t)ldy, 0, (size_t)N * sizeof *y);
        return;
    }
    if (w->dtype == DS_DT_F8_E4M3 || w->dtype == DS_DT_MXFP4) {
        ds_matmul_quant(y, ldy, x, ldx, T, w);
        return;
    }
    const simd_ops *ops = ops_for(ds_kernels_isa());
    if (T <= T_STREAM) {
        matmul_stream(ops, y, ldy, x, ldx, T, w);
        return;
    }
    /* Long prompts go T_CHUNK tokens at a time, which bounds the packed copy of x (T_CHUNK x K
     * floats) while a weight element still serves 2 * T_CHUNK flops per read. */
    for (int t0 = 0; t0 < T; t0 += T_CHUNK)
        matmul_blocked(ops, y + (size_t)t0 * (size_t)ldy, ldy, x + (size_t)t0 * (size_t)ldx, ldx,
                       DS_MIN(T_CHUNK, T - t0), w);
}

/* ---- ds_matmul_t: y = x W, the outer-product form -------------------------------------------- */
/* Each output y[t][c] sums x[t][r] * W[r][c] over r in increasing order with one fused multiply-add
 * per term (a multiply and an add on the portable path), whatever the tiling. */

static void matmul_t_scalar(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w) {
    const int R = w->rows, C = w->cols, src = src_of(w->dtype);
#pragma omp parallel for schedule(static) if ((double)T * R * C >= PAR_MIN_MACS && T > 1)
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)t * (size_t)ldy;
        for (int c = 0; c < C; c++) yt[c] = 0.0f;
        for (int r = 0; r < R; r++) {
            const float a = x[(size_t)t * (size_t)ldx + (size_t)r];
            for (int c = 0; c < C; c++)
                yt[c] += a * load_w_scalar(src, w->data, (size_t)r * (size_t)C + (size_t)c);
        }
    }
}

/* nv vectors of 8 columns starting at w (row stride ldw elements) x nt tokens, summed over R rows;
 * tail (< 8, or 0 for none) is the number of live columns in the last vector. */
AVX2_INLINE void avx2_tile_t(const int nv, const int nt, const int src, const void *w, size_t ldw,
                             int R, const float *x, size_t ldx, float *y, size_t ldy, int tail) {
    const char *wb = (const char *)w;
    const size_t es = src_size(src);
    __m256 acc[4][TN_TOK]; /* [column vector][token] */
    for (int v = 0; v < nv; v++)
        for (int j = 0; j < nt; j++) acc[v][j] = _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m256 wv[4];
        for (int v = 0; v < nv; v++) {
            const char *p = wb + ((size_t)r * ldw + (size_t)v * 8) * es;
            wv[v] = (tail && v == nv - 1) ? avx2_load_w_tail(src, p, tail) : avx2_load_w(src, p);
        }
        for (int j = 0; j < nt; j++) {
            const __m256 xb = _mm256_broadcast_ss(x + (size_t)j * ldx + (size_t)r);
            for (int v = 0; v < nv; v++) acc[v][j] = _mm256_fmadd_ps(xb, wv[v], acc[v][j]);
        }
    }
    for (int j = 0; j < nt; j++)
        for (int v = 0; v < nv; v++) {
            float *p = y + (size_t)j * ldy + (size_t)v * 8;
            if (tail && v == nv - 1)
                _mm256_maskstore_ps(p, avx2_mask(tail), acc[v][j]);
            else
                _mm256_storeu_ps(p, acc[v][j]);
        }
}

static AVX2_FN void avx2_t_block(int src, const void *w, size_t ldw, int R, int ncols,
                                 const float *x, size_t ldx, float *y, size_t ldy, int nt) {
    if (ncols == TN_COLS) {
        if (nt == 2)
            avx2_tile_t(4, 2, src, w, ldw, R, x, ldx, y, ldy, 0);
        else
            avx2_tile_t(4, 1, src, w, ldw, R, x, ldx, y, ldy, 0);
        return;
    }
    /* A narrow last block: one vector at a time, the last one partial. */
    for (int c = 0; c < ncols; c += 8) {
        const int tail = ncols - c < 8 ? ncols - c : 0;
        const void *wc = (const char *)w + (size_t)c * src_size(src);
        if (nt == 2)
            avx2_tile_t(1, 2, src, wc, ldw, R, x, ldx, y + c, ldy, tail);
        else
            avx2_tile_t(1, 1, src, wc, ldw, R, x, ldx, y + c, ldy, tail);
    }
}

AVX512_INLINE void avx512_tile_t(const int nv, const int nt, const int src, const void *w,
                                 size_t ldw, int R, const float *x, size_t ldx, float *y,
                                 size_t ldy, int tail) {
    const char *wb = (const char *)w;
    const size_t es = src_size(src);
    __m512 acc[2][TN_TOK]; /* [column vector][token] */
    for (int v = 0; v < nv; v++)
        for (int j = 0; j < nt; j++) acc[v][j] = _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
        __m512 wv[2];
        for (int v = 0; v < nv; v++) {
            const char *p = wb + ((size_t)r * ldw + (size_t)v * 16) * es;
            wv[v] =
                (tail && v == nv - 1) ? avx512_load_w_tail(src, p, tail) : avx512_load_w(src, p);
        }
        for (int j = 0; j < nt; j++) {
            const __m512 xb = _mm512_set1_ps(x[(size_t)j * ldx + (size_t)r]);
            for (int v = 0; v < nv; v++) acc[v][j] = _mm512_fmadd_ps(xb, wv[v], acc[v][j]);
        }
    }
    for (int j = 0; j < nt; j++)
        for (int v = 0; v < nv; v++) {
            float *p = y + (size_t)j * ldy + (size_t)v * 16;
            if (tail && v == nv - 1)
                _mm512_mask_storeu_ps(p, avx512_mask(tail), acc[v][j]);
            else
                _mm512_storeu_ps(p, acc[v][j]);
        }
}

static AVX512_FN void avx512_t_block(int src, const void *w, size_t ldw, int R, int ncols,
                                     const float *x, size_t ldx, float *y, size_t ldy, int nt) {
    if (ncols == TN_COLS) {
        if (nt == 2)
            avx512_tile_t(2, 2, src, w, ldw, R, x, ldx, y, ldy, 0);
        else
            avx512_tile_t(2, 1, src, w, ldw, R, x, ldx, y, ldy, 0);
        return;
    }
    for (int c = 0; c < ncols; c += 16) {
        const int tail = ncols - c < 16 ? ncols - c : 0;
        const void *wc = (const char *)w + (size_t)c * src_size(src);
        if (nt == 2)
            avx512_tile_t(1, 2, src, wc, ldw, R, x, ldx, y + c, ldy, tail);
        else
            avx512_tile_t(1, 1, src, wc, ldw, R, x, ldx, y + c, ldy, tail);
    }
}

void ds_matmul_t(float *y, int ldy, const float *x, int ldx, int T, const ds_mat *w) {
    const ds_isa isa = ds_kernels_isa();
    const int R = w->rows, C = w->cols;
    if (T <= 0 || C <= 0) return;
    if (isa == DS_ISA_SCALAR) {
        matmul_t_scalar(y, ldy, x, ldx, T, w);
        return;
    }
    const int src = src_of(w->dtype);
    const size_t es = src_size(src);
    const int nblk = (C + TN_COLS - 1) / TN_COLS;
#pragma omp parallel for schedule(static) if (nblk > 1 && (double)T * R * C >= PAR_MIN_MACS)
    for (int b = 0; b < nblk; b++) {
        const int c0 = b * TN_COLS, nc = DS_MIN(TN_COLS, C - c0);
        const void *wc = (const char *)w->data + (size_t)c0 * es;
        for (int t0 = 0; t0 < T; t0 += TN_TOK) {
            const int nt = DS_MIN(TN_TOK, T - t0);
            const float *xt = x + (size_t)t0 * (size_t)ldx;
            float *yt = y + (size_t)t0 * (size_t)ldy + (size_t)c0;
            if (isa == DS_ISA_AVX512)
                avx512_t_block(src, wc, (size_t)C, R, nc, xt, (size_t)ldx, yt, (size_t)ldy, nt);
            else
                avx2_t_block(src, wc, (size_t)C, R, nc, xt, (size_t)ldx, yt, (size_t)ldy, nt);
        }
    }
}

/* ---- embedding ------------------------------------------------------------------------------- */

static AVX2_FN void widen_row_avx2(float *dst, const void *src_row, int src, int n) {
    const size_t es = src_size(src);
    int c = 0;
    for (; c + 8 <= n; c += 8)
        _mm256_storeu_ps(dst + c, avx2_load_w(src, (const char *)src_row + (size_t)c * es));
    if (c < n)
        _mm256_maskstore_ps(dst + c, avx2_mask(n - c),
                            avx2_load_w_tail(src, (const char *)src_row + (size_t)c * es, n - c));
}

void ds_embed(float *out, const ds_mat *e, const int32_t *ids, int T) {
    const ds_isa isa = ds_kernels_isa();
    const int D = e->cols, src = src_of(e->dtype);
    const size_t es = src_size(src);
#pragma omp parallel for schedule(static) if ((double)T * D >= (1 << 18))
    for (int t = 0; t < T; t++) {
        float *o = out + (size_t)t * (size_t)D;
        /* An id outside the table (a caller bug, or hostile input that slipped past the tokenizer)
         * yields a zero row rather than a read outside the mapping. */
        if (ids[t] < 0 || ids[t] >= e->rows) {
            memset(o, 0, (size_t)D * sizeof *o);
            continue;
        }
        const void *row = (const char *)e->data + (size_t)ids[t] * (size_t)D * es;
        if (isa != DS_ISA_SCALAR) { /* widening is exact, so the AVX2 helper serves AVX-512 too */
            widen_row_avx2(o, row, src, D);
        } else {
            for (int c = 0; c < D; c++) o[c] = load_w_scalar(src, row, (size_t)c);
        }
    }
}
