/* moe_fp8.cu — routed experts held as ptpc FP8 (docs/quantization.md §3: Kimi-Linear's BF16
 * experts under --quantization ptpc_fp8): E4M3 codes with an f32 scale a row. As on the CPU
 * (backend/cpu/layers.c's expert MLP through kernels/cpu/matmul_quant.c) a routed row's input is
 * quantized per token, gate and up are y = (sum * s_t) * s_r with the sum in f32, the activation
 * runs in f32, and its row is quantized again (per token and expert) before the down product.
 * Every term e4m3 * e4m3 is exact in f32, so the results differ from the CPU's only in the order
 * of the sums (and so, rarely, in an activation code a rounding apart).
 *
 * Both paths run on F16 tensor cores (every E4M3 value is exact in F16, each product exact, f32
 * accumulation: the w8a8 math), the weights converted in registers: decode and batch invariance
 * through the weight-streaming kernel (matmul_fp8.cu's scheme, K split across warps), batches
 * through the tile kernel (moe_mxfp4.cu's). Grouping and combine are moe_experts.cu's. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_rows.cuh"
#include "kernels/cuda/fp8_stream.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/shared/quant.h"

#include <cuda_fp8.h>

/* ---- quantizers -------------------------------------------------------------------------------
 * One block a row. Block row i reads source row (perm ? perm[i] : i) / div and writes row
 * (sorted ? i : perm ? perm[i] : i); rows i >= *count (when given) and rows of another rank's
 * expert (direct: row i's expert) are skipped. ACT: the source row is [gate | up] of 2K values
 * and the quantized row is act(gate, up). The codes' values are written in F16 (exact), the mma
 * kernels' operands. Scale and codes: ds_ptpc_scale, 1.0f / s
 * (IEEE division: the build has no fast math) and quant.h's rounding, as the CPU. */
template <bool ACT>
__global__ void __launch_bounds__(256)
    moe_f8_quant_k(uint16_t *q, float *s, const float *x, int ldx, int K, const int32_t *perm,
                   int div, int sorted, const int32_t *count, const int32_t *direct, int e0, int E,
                   moe_act act) {
    PDL_ENTRY();
    extern __shared__ float vsh[]; /* [K] the row's values (ACT) */
    const int i = blockIdx.x;
    if (count && i >= *count) return;
    if (direct && (direct[i] - e0 < 0 || direct[i] - e0 >= E)) return;
    const int r = perm ? perm[i] : i, dst = sorted ? i : r;
    const float *xr = x + (size_t)(r / div) * ldx;
    float amax = 0.0f;
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        float v = xr[c];
        if (ACT) v = act_pair(v, xr[K + c], act.situ, act.beta, act.lin_beta), vsh[c] = v;
        amax = fmaxf(amax, fabsf(v));
    }
    amax = block_max(amax); /* (its barrier also orders vsh) */
    const float st = ds_ptpc_scale(amax), inv = 1.0f / st;
    if (threadIdx.x == 0) s[dst] = st;
    uint16_t *qr = q + (size_t)dst * K;
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        const float v = ACT ? vsh[c] : xr[c];
        f8_x_put(qr, c, v * inv);
    }
}

/* ---- the streaming kernel ---------------------------------------------------------------------
 * fp8_stream.cuh's tiles over an active expert's routed rows (or, one token, routed row
 * blockIdx.y straight from idx): a warp a 16-row tile of the expert's weights (S warps sharing it
 * along K, their partial sums added in order p = 0, 1, ..), up to 8 routed rows a pass as the mma's
 * columns. A column does not depend on the others, and S on the matrix alone, so a row's result is
 * the same whatever else the step holds (batch invariance). With xh NULL (one token) the block
 * quantizes its routed row's source itself, through act when act.on (x rows [gate | up] of 2K):
 * the same values moe_f8_quant_k writes, and two kernels fewer in a decode step. */
__global__ void __launch_bounds__(256)
    moe_f8m_k(float *y, int ldy, const float *x, int ldx, moe_act act, const uint16_t *xh,
              const float *xs, int x_div, const uint8_t *Wc, const float *Ws, int N, int K, int S,
              const int32_t *start, const int32_t *perm, const int32_t *active,
              const int32_t *n_active, const int32_t *direct, int e0, int E, int noq, int early) {
    /* early (one token's down pass, ds_cu_set_early_experts): the routing is two kernels old (the
     * up pass came between), so it and the first tile's weights are read before the wait */
    if (!early) PDL_ENTRY();
    extern __shared__ uint4 f8m_xdyn[]; /* [K] the routed row's F16 code values (no xh) */
    __shared__ float4 red[8][32];       /* [warp][lane] partial sums (S > 1) */
    __shared__ float st_sh;             /* its scale (no xh) */
    int e, r0, r1;
    if (direct) { /* block row y is routed row y (one token) */
        e = direct[blockIdx.y] - e0;
        if (e < 0 || e >= E) return;
        r0 = blockIdx.y, r1 = r0 + 1;
    } else {
        if ((int)blockIdx.y >= *n_active) return;
        e = active[blockIdx.y], r0 = start[e], r1 = start[e + 1];
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, l4 = lane & 3;
    const int part = warp % S, nb = ((N + 15) / 16 + 8 / S - 1) / (8 / S);
    uint4 a[F8_U][2]; /* the steps in flight (fp8_stream.cuh) */
    /* One token: the first tile's weights are requested before the row is quantized, so that
     * their trip to memory overlaps the quantizer's (the same loads, in the same order). */
    const bool pre = !xh && (int)blockIdx.x < nb;
    if (pre) {
        const f8_trows r = f8_tile_rows(Wc, (size_t)e * N, N, K, S, blockIdx.x);
        f8_load(a, r.w0, r.w1, part, S, K / 64);
    }
    if (early) PDL_ENTRY();
    if (!xh && noq) { /* (a what-if: the codes left unset) */
        if (threadIdx.x == 0) st_sh = 1.0f;
    } else if (!xh) { /* direct: the one routed row r0 */
        const float *xr = x + (size_t)(r0 / x_div) * ldx;
        const float s = f8_quant_row((uint16_t *)f8m_xdyn, K, [xr, act, K](int c) {
            return act.on ? act_pair(xr[c], xr[K + c], act.situ, act.beta, act.lin_beta) : xr[c];
        });
        if (threadIdx.x == 0) st_sh = s;
        __syncthreads();
    }
    /* (a grid smaller than nb, when the block quantizes: each block's tiles one after another;
     * the next tile's first steps are requested before this one's sums are added) */
    bool have = pre; /* a holds the first steps of the tile about to be multiplied */
    for (int b = blockIdx.x; b < nb; b += gridDim.x) {
        const int n0 = (b * (8 / S) + warp / S) * 16 + g, n1 = n0 + 8;
        const f8_trows r = f8_tile_rows(Wc, (size_t)e * N, N, K, S, b);
        const uint4 *w0 = r.w0, *w1 = r.w1;
        for (int p0 = r0; p0 < r1; p0 += 8) {
            const int nt = min(8, r1 - p0);
            const int rg = g < nt ? (direct ? p0 + g : perm[p0 + g]) : 0;
            const uint16_t *xrow = xh ? xh + (size_t)(rg / x_div) * K : (const uint16_t *)f8m_xdyn;
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const uint4 *xq = g < nt ? (const uint4 *)xrow + 2 * l4 : NULL;
            if (!have) f8_load(a, w0, w1, part, S, K / 64);
            f8_tile(acc, a, w0, w1, xq, part, S, K, l4);
            have = false;
            if (!xh && b + (int)gridDim.x < nb) { /* one routed row: one pass a tile */
                const f8_trows m = f8_tile_rows(Wc, (size_t)e * N, N, K, S, b + gridDim.x);
                f8_load(a, m.w0, m.w1, part, S, K / 64);
                have = true;
            }
            if (!f8_split_sum(acc, red, S, part)) continue;
#pragma unroll
            for (int j = 0; j < 2; j++) { /* C: rows g (acc 0, 1), g + 8 (2, 3); columns 2 l4 + j */
                const int t = 2 * l4 + j;
                if (t >= nt) continue;
                const int r = direct ? p0 + t : perm[p0 + t];
                const float st = xh ? xs[r / x_div] : st_sh;
                float *yr = y + (size_t)r * ldy;
                if (n0 < N) yr[n0] = (acc[j] * st) * Ws[(size_t)e * N + n0];
                if (n1 < N) yr[n1] = (acc[2 + j] * st) * Ws[(size_t)e * N + n1];
            }
        }
    }
}

/* ---- one token, a warp a row (fp8_rows.cuh; batch invariance off) ------------------------------
 * Block row y is routed row y's expert (direct); each block quantizes the row's source (through
 * act when act.on: x rows [gate | up] of 2K) into shared memory, or reads the codes xh / *xs a norm
 * wrote, then its warps take R of the expert's N rows at a time, grid-stride. */
template <int R, int U>
__global__ void __launch_bounds__(256, 4)
    moe_f8r_k(float *y, int ldy, const float *x, int ldx, moe_act act, const uint16_t *xh,
              const float *xs, int x_div, const uint8_t *Wc, const float *Ws, int N, int K,
              const int32_t *direct, int e0, int E) {
    extern __shared__ float4 f8r_x4[]; /* [f8r_smem(K) / 16] the row's values times 2^64, in
                                          f8r_xidx's order */
    __shared__ float st_sh;
    PDL_ENTRY(); /* (direct is the router's output: nothing is read before the wait) */
    const int e = direct[blockIdx.y] - e0, r0 = blockIdx.y;
    if (e < 0 || e >= E) return; /* another rank's expert: the combine skips it */
    const uint8_t *We = Wc + (size_t)e * N * K;
    const int n = ((int)blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
    const uint4 *w[R];
    uint4 a[U][R];
    f8r_point<R>(w, We, n, N, K);
    f8r_load<R, U>(a, w, K / 16, threadIdx.x & 31); /* (requested before the row is quantized) */
    const float *xr = x + (size_t)(r0 / x_div) * ldx;
    const float st = f8r_stage(f8r_x4, &st_sh, K, xh, xs, [xr, act, K](int c) {
        return act.on ? act_pair(xr[c], xr[K + c], act.situ, act.beta, act.lin_beta) : xr[c];
    });
    f8r_walk<R, U>(y + (size_t)r0 * ldy, We, Ws + (size_t)e * N, N, K, n, (int)gridDim.x * 8 * R,
                   st, w, a, f8r_x4);
}

/* ---- tensor cores (batches) -------------------------------------------------------------------
 * moe_mxfp4.cu's moe_tc4_k with rows of codes: a 128-wide step of a row is 128 bytes, lane
 * 4 g + l4 loading its 32 (two 16-byte loads) and the same 32 columns of its token's F16 row;
 * eight codes at a time become F16 pairs (cvt: exact) and feed m16n8k16 F16 mma with f32
 * accumulation, A and B in the same permuted column order. UP applies the scales and act and
 * writes f32 act rows (quantized next); DOWN writes (sum * s_row) * s_r. */
/* eight codes (words lo, hi) as four F16 pairs in column order */
static __device__ __forceinline__ uint4 f8x8_f16(uint32_t lo, uint32_t hi) {
    return make_uint4(f8x2_f16(lo & 0xffffu), f8x2_f16(lo >> 16), f8x2_f16(hi & 0xffffu),
                      f8x2_f16(hi >> 16));
}

template <int NT, bool UP>
__global__ void __launch_bounds__(256)
    moe_tc8_k(float *out, int ldo, const uint16_t *xh, const float *xs, const uint8_t *Wc,
              const float *Ws, int N, int K, const int32_t *start, const int32_t *perm,
              const int32_t *active, const int32_t *n_active, moe_act act) {
    PDL_ENTRY();
    if ((int)blockIdx.y >= *n_active) return;
    const int e = active[blockIdx.y], r0 = start[e], r1 = start[e + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, l4 = lane & 3;
    const int c0 = (blockIdx.x * 8 + warp) * (UP ? 16 : 32);
    if (c0 >= N) return;
    const size_t erows = UP ? 2 * (size_t)N : (size_t)N;
    const uint4 *wr[2][2]; /* [tile][row g, g + 8], at this lane's piece of the first step */
    float sw[2][2];        /* their scales */
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const size_t rr = moe_mma_row<UP>(e, erows, N, c0, g, m, h);
            wr[m][h] = (const uint4 *)(Wc + rr * K) + 2 * l4;
            sw[m][h] = Ws[rr];
        }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int p0 = r0; p0 < r1; p0 += 8 * NT) {
        float acc[2][NT][4];
        const uint4 *xr[NT];
        bool xv[NT];
        moe_mma_tokens<NT>(xr, xv, acc, xh, K, p0, r0, r1, g, 4 * l4);
        for (int s = 0; s < K / 128; s++) {
            uint4 a[2][2][2]; /* [tile][row][half of the 32 codes] */
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int q = 0; q < 2; q++) a[m][h][q] = __ldg(wr[m][h] + 8 * s + q);
#pragma unroll
            for (int p = 0; p < 4; p++) { /* codes [8 p, 8 p + 8) of the lane's 32 */
                uint4 b[NT];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    /* (E4M3 build: the operand holds codes, f8_x_put; columns [8 p, 8 p + 8)
                     * of the lane's 32 are 8 bytes of its 16-column piece p / 2) */
#ifdef DS_F8_MMA_E4M3
                    const uint2 c8 =
                        *(const uint2 *)((const uint8_t *)(xr[nt] + 16 * s + 2 * (p >> 1)) +
                                         8 * (p & 1));
                    b[nt] = xv[nt] ? f8x8_f16(c8.x, c8.y) : zero;
#else
                    b[nt] = xv[nt] ? __ldg(xr[nt] + 16 * s + p) : zero;
#endif
                }
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint4 q0 = a[m][0][p >> 1], q1 = a[m][1][p >> 1];
                    const uint4 d0 = (p & 1) ? f8x8_f16(q0.z, q0.w) : f8x8_f16(q0.x, q0.y);
                    const uint4 d1 = (p & 1) ? f8x8_f16(q1.z, q1.w) : f8x8_f16(q1.x, q1.y);
                    const uint32_t lo[4] = {d0.x, d1.x, d0.y, d1.y},
                                   hi[4] = {d0.z, d1.z, d0.w, d1.w};
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        mma_16816_f16(acc[m][nt], lo, b[nt].x, b[nt].y);
                        mma_16816_f16(acc[m][nt], hi, b[nt].z, b[nt].w);
                    }
                }
            }
        }
        /* C: rows g (elements 0, 1) and g + 8 (2, 3) of a tile, tokens 2 l4 and 2 l4 + 1 */
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int r = p0 + nt * 8 + 2 * l4 + j;
                if (r >= r1) continue;
                const float st = xs[r];
                if (UP) {
                    float *ar = out + (size_t)r * ldo + c0 + g;
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        ar[8 * h] = act_pair((acc[0][nt][2 * h + j] * st) * sw[0][h],
                                             (acc[1][nt][2 * h + j] * st) * sw[1][h], act.situ,
                                             act.beta, act.lin_beta);
                } else {
                    float *yr = out + (size_t)perm[r] * ldo;
#pragma unroll
                    for (int m = 0; m < 2; m++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int row = c0 + 16 * m + g + 8 * h;
                            if (row < N) yr[row] = (acc[m][nt][2 * h + j] * st) * sw[m][h];
                        }
                }
            }
    }
}

typedef void (*moe_tc8_ptr)(float *, int, const uint16_t *, const float *, const uint8_t *,
                            const float *, int, int, const int32_t *, const int32_t *,
                            const int32_t *, const int32_t *, moe_act);
static const moe_tc8_ptr moe_tc8_up[3] = {moe_tc8_k<1, true>, moe_tc8_k<2, true>,
                                          moe_tc8_k<4, true>},
                         moe_tc8_dn[3] = {moe_tc8_k<1, false>, moe_tc8_k<2, false>,
                                          moe_tc8_k<4, false>};

/* Tokens from which a step's FP8 experts run on tensor cores (the BF16 experts' bound). */
enum { MOE_F8_MMA_MIN = 40 };

typedef struct f8_w {
    const uint8_t *gc, *dc; /* gate_up codes [E][2I][D], down codes [E][D][I] */
    const float *gs, *ds;   /* their row scales [E][2I], [E][D] */
} f8_w;

/* a step's buffers (moe scratch): xq [nx][D] (x quantized), xs [nx]; h [rows][2I] f32 (the
 * streaming up pass's output, or the tensor cores' act rows [rows][I]); aq [rows][I], as [rows]
 * (act quantized); y [rows][D] f32 */
typedef struct f8_buf {
    uint16_t *xq, *aq;
    float *xs, *as, *h, *y;
} f8_buf;

typedef struct f8_rows {
    const int32_t *start, *perm, *active, *n_active, *direct;
    unsigned ya;
    int e0, E;
} f8_rows;

/* the two passes on tensor cores */
static void f8_tc(ds_cu *c, const f8_buf *b, const float *x, int rows, int D, int I, int k,
                  const f8_w *w, const f8_rows *g, moe_act act) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    const int per = (rows + (int)g->ya - 1) / (int)g->ya, nt = per <= 4 ? 0 : per <= 12 ? 1 : 2;
    const int32_t *count = g->start + g->E;
    launch_k(c, moe_f8_quant_k<false>, (unsigned)rows, 256, 0, b->xq, b->xs, x, D, D, g->perm, k, 1,
             count, (const int32_t *)NULL, 0, 0, none);
    launch_k(c, moe_tc8_up[nt], dim3((unsigned)((I + 127) / 128), g->ya), 256, 0, b->h, I,
             (const uint16_t *)b->xq, (const float *)b->xs, w->gc, w->gs, I, D, g->start, g->perm,
             g->active, g->n_active, act);
    launch_k(c, moe_f8_quant_k<false>, (unsigned)rows, 256, 0, b->aq, b->as, (const float *)b->h, I,
             I, (const int32_t *)NULL, 1, 1, count, (const int32_t *)NULL, 0, 0, none);
    launch_k(c, moe_tc8_dn[nt], dim3((unsigned)((D + 255) / 256), g->ya), 256, 0, b->y, D,
             (const uint16_t *)b->aq, (const float *)b->as, w->dc, w->ds, D, I, g->start, g->perm,
             g->active, g->n_active, none);
}

/* the two passes through the streaming kernel; one token (direct): each block quantizes its own
 * routed row (x, then act of h) */
static void f8_stream(ds_cu *c, const f8_buf *b, const float *x, int T, int rows, int D, int I,
                      int k, const f8_w *w, const f8_rows *g, moe_act act) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    const int su = f8_splits_for(c, 2 * I, D, T), sd = f8_splits_for(c, D, I, T);
    const unsigned bu = (unsigned)(((2 * I + 15) / 16 + 8 / su - 1) / (8 / su)),
                   bd = (unsigned)(((D + 15) / 16 + 8 / sd - 1) / (8 / sd));
    if (g->direct && f8r_fits(c, c->f8_moe_rows, D, w->gc) &&
        f8r_fits(c, c->f8_moe_rows, I, w->dc)) {
        /* a warp a row: blocks a routed row's worth, at most f8_moe_rows an SM over the k rows */
        const unsigned per_sm = c->f8_moe_rows > 0 ? (unsigned)c->f8_moe_rows : 4u;
        const unsigned cap = DS_MAX(1u, per_sm * (unsigned)c->n_sm / g->ya);
#define F8R_UP(R, U)                                                                               \
    launch_k(c, moe_f8r_k<R, U>,                                                                   \
             dim3(DS_MIN((unsigned)((2 * I + 8 * (R)-1) / (8 * (R))), cap), g->ya), 256,           \
             f8r_smem(D), b->h, 2 * I, x, D, none, (const uint16_t *)NULL, (const float *)NULL, k, \
             w->gc, w->gs, 2 * I, D, g->direct, g->e0, g->E)
#define F8R_DN(R, U)                                                                               \
    launch_k(c, moe_f8r_k<R, U>,                                                                   \
             dim3(DS_MIN((unsigned)((D + 8 * (R)-1) / (8 * (R))), cap), g->ya), 256, f8r_smem(I),  \
             b->y, D, (const float *)b->h, 2 * I, act, (const uint16_t *)NULL,                     \
             (const float *)NULL, 1, w->dc, w->ds, D, I, g->direct, g->e0, g->E)
        F8R_DISPATCH(D, F8R_UP);
        F8R_DISPATCH(I, F8R_DN);
#undef F8R_UP
#undef F8R_DN
        return;
    }
    if (g->direct) { /* a block quantizes once for its tiles: one wave of blocks (two an SM, or
                      * f8_moe_waves: more blocks, each quantizing, fewer tiles a block) */
        const unsigned per_sm = c->f8_moe_waves > 0 ? (unsigned)c->f8_moe_waves : 2u;
        const unsigned cap = DS_MAX(1u, per_sm * (unsigned)c->n_sm / g->ya);
        const size_t xu = ((size_t)D * 2 + 15) / 16 * 16, xd = ((size_t)I * 2 + 15) / 16 * 16;
        launch_k(c, moe_f8m_k, dim3(DS_MIN(bu, cap), g->ya), 256, xu, b->h, 2 * I, x, D, none,
                 (const uint16_t *)NULL, (const float *)NULL, k, w->gc, w->gs, 2 * I, D, su,
                 g->start, g->perm, g->active, g->n_active, g->direct, g->e0, g->E, c->f8_noquant,
                 0);
        launch_k(c, moe_f8m_k, dim3(DS_MIN(bd, cap), g->ya), 256, xd, b->y, D, (const float *)b->h,
                 2 * I, act, (const uint16_t *)NULL, (const float *)NULL, 1, w->dc, w->ds, D, I, sd,
                 g->start, g->perm, g->active, g->n_active, g->direct, g->e0, g->E, c->f8_noquant,
                 c->early_experts);
        return;
    }
    launch_k(c, moe_f8_quant_k<false>, (unsigned)T, 256, 0, b->xq, b->xs, x, D, D,
             (const int32_t *)NULL, 1, 0, (const int32_t *)NULL, (const int32_t *)NULL, 0, 0, none);
    launch_k(c, moe_f8m_k, dim3(bu, g->ya), 256, 0, b->h, 2 * I, x, D, none,
             (const uint16_t *)b->xq, (const float *)b->xs, k, w->gc, w->gs, 2 * I, D, su, g->start,
             g->perm, g->active, g->n_active, g->direct, g->e0, g->E, 0, 0);
    /* act rows quantized, this rank's, through perm */
    launch_k(c, moe_f8_quant_k<true>, (unsigned)rows, 256, (size_t)I * sizeof(float), b->aq, b->as,
             (const float *)b->h, 2 * I, I, g->perm, 1, 0, g->start + g->E, (const int32_t *)NULL,
             g->e0, g->E, act);
    launch_k(c, moe_f8m_k, dim3(bd, g->ya), 256, 0, b->y, D, (const float *)b->h, 2 * I, none,
             (const uint16_t *)b->aq, (const float *)b->as, 1, w->dc, w->ds, D, I, sd, g->start,
             g->perm, g->active, g->n_active, g->direct, g->e0, g->E, 0, 0);
}

extern "C" int ds_cu_moe_experts_fp8(ds_cu *c, float *out, const float *x, const int32_t *idx,
                                     const float *w, int T, int k, int E, int e0, int D, int I,
                                     const uint8_t *gu_codes, const float *gu_scales,
                                     const uint8_t *dn_codes, const float *dn_scales, int situ,
                                     float situ_beta, float situ_lin_beta, int accumulate,
                                     ds_err *err) {
    if (T <= 0 || k <= 0) return DS_OK;
    const int rows = T * k;
    if (rows > 65535) return ds_errf(err, "cuda: moe fp8: %d routed rows (at most 65535)", rows);
    if (D % 16 || I % 16 || E <= 0 || (size_t)I * 4 > 48 * 1024)
        return ds_errf(err, "cuda: moe fp8: widths %d and %d (multiples of 16 wanted)", D, I);
    if ((uintptr_t)gu_codes % 16 || (uintptr_t)dn_codes % 16)
        return ds_errf(err, "cuda: moe fp8: codes not 16-byte aligned");
    const moe_act act = {1, situ, situ_beta, situ_lin_beta};
    /* long steps (prefill): FP8 tensor cores through cuBLASLt, where it can run them */
    if (T > 1 && c->expert_gemm && !c->batch_invariant && rows >= EXPERT_GEMM_MIN_PER * E &&
        (uintptr_t)out % 16 == 0 && (uintptr_t)x % 16 == 0 && !capturing(c)) {
        int done = 0;
        if (moe_f8_experts_gemm(c, out, x, w, idx, T, k, E, e0, D, I, gu_codes, gu_scales, dn_codes,
                                dn_scales, act, accumulate, &done, err))
            return DS_ERR;
        if (done) return DS_OK;
    }
    const int n_chunks = rows >= 1024 ? (rows + MOE_GCHUNK - 1) / MOE_GCHUNK : 0;
    /* one token: the blocks quantize their routed rows themselves, unless f8_prequant asks for
     * the quantizers first (what that costs the experts: docs/quantization.md §3) */
    const int direct = T == 1 && !c->f8_prequant;
    const int tc = !direct && c->expert_mma && !c->batch_invariant && D % 128 == 0 &&
                   I % 128 == 0 &&
                   T >= (c->mma_min_tokens > 0 ? c->mma_min_tokens : MOE_F8_MMA_MIN);
    const size_t nx = tc ? (size_t)rows : (size_t)T; /* quantized input rows */
    /* see f8_buf; ints: start [E+1], perm [rows], active [E], n [1], hist [n_chunks][E] */
    const size_t sizes[7] = {nx * D * 2,
                             nx * 4,
                             (size_t)rows * 2 * I * 4,
                             (size_t)rows * I * 2,
                             (size_t)rows * 4,
                             (size_t)rows * D * 4,
                             ((size_t)E + 1 + rows + E + 1 + (size_t)n_chunks * E) * 4};
    void *p[7];
    if (carve_scratch(c, (void **)&c->part, &c->part_bytes, sizes, p, 7, "moe scratch", err))
        return DS_ERR;
    const f8_buf b = {(uint16_t *)p[0], (uint16_t *)p[3], (float *)p[1],
                      (float *)p[4],    (float *)p[2],    (float *)p[5]};
    int32_t *start = (int32_t *)p[6], *perm = start + E + 1, *active = perm + rows;
    int32_t *n_active = active + E, *hist = n_active + 1;
    const f8_rows g = {
        start, perm, active, n_active, direct ? idx : NULL, moe_block_rows(direct, rows, E), e0, E};
    ds_cu_prof_mark(c, "moe group");
    if (!direct) moe_group_rows(c, idx, rows, e0, E, n_chunks, start, perm, active, n_active, hist);
    CU_TRY(cudaGetLastError(), "moe fp8 group");
    ds_cu_prof_mark(c, "moe fp8 experts");
    const f8_w fw = {gu_codes, dn_codes, gu_scales, dn_scales};
    if (tc) {
        f8_tc(c, &b, x, rows, D, I, k, &fw, &g, act);
    } else if (direct && fp8_wg_experts_fit(c, k, D, I, gu_codes, dn_codes)) {
        if (fp8_wg_experts(c, b.h, b.y, x, D, I, k, gu_codes, gu_scales, dn_codes, dn_scales, idx,
                           e0, E, act, err))
            return DS_ERR;
    } else {
        f8_stream(c, &b, x, T, rows, D, I, k, &fw, &g, act);
    }
    CU_TRY(cudaGetLastError(), tc ? "moe fp8 (tensor cores)" : "moe fp8 (streaming)");
    if (ds_cu_side_join(c, err)) return DS_ERR; /* out: see ds_cu_moe_experts */
    ds_cu_prof_mark(c, "moe combine");
    moe_combine(c, out, b.y, w, idx, e0, E, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe fp8 combine");
    return DS_OK;
}
