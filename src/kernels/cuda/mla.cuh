/* mla.cuh — what the absorbed and expanded MLA kernels share: the split size, the split
 * softmax and the merge of the splits. */
#ifndef DS_CUDA_MLA_CUH
#define DS_CUDA_MLA_CUH

#include "kernels/cuda/common.cuh"
#include "kernels/shared/kv_row.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

enum { MLA_CHUNK = 256 };

/* 2^x on the ex2 unit (what __expf runs on after its multiply by log2 e) */
static __device__ __forceinline__ float fl_ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* ---- the fused expanded attention's pieces (mla_expanded.cu's mma.sync kernel and
 * mla_flash_wg.cu's wgmma ones): tiles of FL_BK keys; a warp's query rows r0 and r1 = r0 + 8 hold
 * scores and outputs in the m16n8 accumulator layout (rows r0 in [.][0..1], r1 in [.][2..3],
 * columns 8 t + 2 l4 (+1)). */
enum { FL_BK = 64 };

/* The keys query row r may see: j < the result (causal: up to its position p0 + r, at most C;
 * none for a row past T) */
static __device__ __forceinline__ int fl_keys(int r, int T, int C, int p0, int causal) {
    return r < T ? (causal ? max(0, min(p0 + r + 1, C)) : C) : 0;
}

/* the output fragments zeroed (no key seen yet) */
template <int DV> static __device__ __forceinline__ void fl_zero(float (&oacc)[DV / 8][4]) {
#pragma unroll
    for (int n = 0; n < DV / 8; n++) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.0f;
}

/* A warp's query rows r0 and r1 of head h from Qb [T][Ha][DQ] (BF16) as m16n8k16 A fragments, one
 * a k-step of 16 channels (zeros for rows past T) */
template <int DQ>
static __device__ __forceinline__ void fl_load_q(uint32_t (&qf)[DQ / 16][4], const uint16_t *Qb,
                                                 int r0, int r1, int T, int Ha, int h, int l4) {
    const size_t qs = (size_t)Ha * DQ;
#pragma unroll
    for (int kk = 0; kk < DQ / 16; kk++) {
        const int c = kk * 16 + l4 * 2;
        const uint16_t *a = Qb + (size_t)r0 * qs + (size_t)h * DQ + c;
        const uint16_t *b = Qb + (size_t)r1 * qs + (size_t)h * DQ + c;
        qf[kk][0] = r0 < T ? *(const uint32_t *)a : 0u;
        qf[kk][1] = r1 < T ? *(const uint32_t *)b : 0u;
        qf[kk][2] = r0 < T ? *(const uint32_t *)(a + 8) : 0u;
        qf[kk][3] = r1 < T ? *(const uint32_t *)(b + 8) : 0u;
    }
}

/* The rows' outputs o (divided by their sums) and, with lse, their log-sum-exp (-inf for a row
 * that saw no key); rows past T are not written */
template <int DV>
static __device__ __forceinline__ void
fl_store(float *o, float *lse, const float (&oacc)[DV / 8][4], float m0, float m1, float l0,
         float l1, int r0, int r1, int T, int Ha, int h, int l4) {
    const size_t vs = (size_t)Ha * DV;
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    if (lse && l4 == 0) { /* (the row's four lanes hold the same m and l) */
        if (r0 < T) lse[(size_t)r0 * Ha + h] = l0 > 0.0f ? m0 + logf(l0) : -INFINITY;
        if (r1 < T) lse[(size_t)r1 * Ha + h] = l1 > 0.0f ? m1 + logf(l1) : -INFINITY;
    }
#pragma unroll
    for (int n = 0; n < DV / 8; n++) {
        const int col = n * 8 + l4 * 2;
        if (r0 < T)
            *(float2 *)(o + (size_t)r0 * vs + (size_t)h * DV + col) =
                make_float2(oacc[n][0] * i0, oacc[n][1] * i0);
        if (r1 < T)
            *(float2 *)(o + (size_t)r1 * vs + (size_t)h * DV + col) =
                make_float2(oacc[n][2] * i1, oacc[n][3] * i1);
    }
}

/* One tile's online softmax for a warp's rows r0 (sc[.][0..1]) and r1 (sc[.][2..3]), keys kb + 8 t
 * + 2 l4 (+1): keys at or past a row's limit masked, the rows' maximum m and sum l updated (in
 * the scaled scores' units), sc exponentiated in place and a0, a1 the factors the output's rows
 * take (fl_rescale) before this tile's P V. Only tiles that reach a limit (the causal diagonal,
 * the context's end) compare. e^(s scale - m) = 2^(s (scale log2 e) - m log2 e): one FFMA and the
 * ex2 unit an element; a masked -inf score gives 2^-inf = 0, and a row that has seen no key yet
 * (maximum -inf: no exp of inf - inf) keeps zeros. */
static __device__ __forceinline__ void fl_softmax(float (&sc)[FL_BK / 8][4], float &m0, float &m1,
                                                  float &l0, float &l1, float &a0, float &a1,
                                                  int kb, int lim0, int lim1, int l4, float scale) {
    if (kb + FL_BK > min(lim0, lim1)) {
#pragma unroll
        for (int t = 0; t < FL_BK / 8; t++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int j = kb + t * 8 + l4 * 2 + e;
                if (j >= lim0) sc[t][e] = -INFINITY;
                if (j >= lim1) sc[t][2 + e] = -INFINITY;
            }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY; /* of the raw scores (scale > 0 keeps order) */
#pragma unroll
    for (int t = 0; t < FL_BK / 8; t++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            mx0 = fmaxf(mx0, sc[t][e]);
            mx1 = fmaxf(mx1, sc[t][2 + e]);
        }
    /* a row's values sit in the 4 lanes of its group */
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0 * scale), mn1 = fmaxf(m1, mx1 * scale);
    a0 = mn0 == -INFINITY ? 1.0f : __expf(m0 - mn0);
    a1 = mn1 == -INFINITY ? 1.0f : __expf(m1 - mn1);
    const float k2 = scale * 1.4426950408889634f;
    const float b0 = mn0 == -INFINITY ? 0.0f : mn0 * 1.4426950408889634f;
    const float b1 = mn1 == -INFINITY ? 0.0f : mn1 * 1.4426950408889634f;
    float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
    for (int t = 0; t < FL_BK / 8; t++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float x0 = fl_ex2(fmaf(sc[t][e], k2, -b0));
            const float x1 = fl_ex2(fmaf(sc[t][2 + e], k2, -b1));
            sc[t][e] = x0, sc[t][2 + e] = x1;
            ps0 += x0, ps1 += x1;
        }
    ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
    ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
    ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
    ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
    l0 = l0 * a0 + ps0, l1 = l1 * a1 + ps1, m0 = mn0, m1 = mn1;
}

/* the output's rows rescaled by the softmax's factors (a0 for row r0, a1 for r1) */
template <int DV>
static __device__ __forceinline__ void fl_rescale(float (&oacc)[DV / 8][4], float a0, float a1) {
#pragma unroll
    for (int n = 0; n < DV / 8; n++)
        oacc[n][0] *= a0, oacc[n][1] *= a0, oacc[n][2] *= a1, oacc[n][3] *= a1;
}

/* P (the exponentiated scores) as the A fragments of O += P V: keys [16 kk, +16) */
static __device__ __forceinline__ void fl_pack(const float (&sc)[FL_BK / 8][4],
                                               uint32_t (&pa)[4][4]) {
#pragma unroll
    for (int kk = 0; kk < FL_BK / 16; kk++) {
        pa[kk][0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
        pa[kk][1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
        pa[kk][2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
        pa[kk][3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
}

/* The fused expanded attention of Kimi's head shape (192 -> 128) on wgmma (mla_flash_wg.cu; the
 * device must be sm_90): the arguments of mla_flash_k (mla_expanded.cu); form 1 or 2 warpgroups
 * (64 query rows each) a block, 3 two with their products pipelined beside the softmax. */
int mla_flash_wg_launch(ds_cu *c, float *o, float *lse, const uint16_t *Qb, const uint16_t *Kb,
                        const uint16_t *Vb, int T, int C, int Ha, int p0, int causal, float scale,
                        int form, ds_err *err);

/* The split kernels' softmax over scores sc[0..n) in shared memory (written before a barrier):
 * returns their max m and, in *sum, the sum of exp(sc - m), with sc overwritten by those
 * exponentials and visible to the whole block on return. */
static __device__ inline float exp_shifted(float *sc, int n, float *sum) {
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += (sc[j] = expf(sc[j] - mx));
    *sum = block_sum(s); /* its barriers also publish the exponentials */
    return mx;
}

/* merges n_split partials per row (part_o [rows][n_split][R], part_ml [rows][n_split][2]: max and
 * sum) into obar [rows][R] (mla_absorbed.cu) */
void mla_merge(ds_cu *c, float *obar, const float *part_o, const float *part_ml, int rows, int R,
               int n_split);

/* FP8 rows (kernels/shared/kv_fp8.h): x[0..V) <- values i0.. of the row at byte `row`,
 * dequantized in registers (V = 4: i0 a multiple of 4 and R of 4, so the four lie in one tile,
 * or all in the rope part). The same f32 values the CPU reads: the codes go through the
 * conversion unit (E4M3 -> F16 -> f32 are exact, as ds_e4m3_to_f32 in a third of its
 * instructions), times the tile's f32 scale. */
template <int V>
static __device__ __forceinline__ void kv_fp8_vals(const uint8_t *row, int R, int i0, float *x) {
    if (V == 4 && i0 < R) {
        const uint32_t q = *(const uint32_t *)(row + i0);
        const float sc = *(const float *)(row + R + 4 * (i0 / DS_KV_FP8_TILE));
        const __half2_raw lo =
            __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(q & 0xffffu), __NV_E4M3);
        const __half2_raw hi =
            __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(q >> 16), __NV_E4M3);
        const float2 a = __half22float2(*(const __half2 *)&lo);
        const float2 b = __half22float2(*(const __half2 *)&hi);
        x[0] = a.x * sc, x[1] = a.y * sc, x[2] = b.x * sc, x[3] = b.y * sc;
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) x[e] = ds_kv_fp8_value(row, R, i0 + e);
    }
}

/* Values i0.. (V of them: 1, or 4 with i0, R and the row's start 4-aligned) of a pool row of
 * dtype KV (DS_KV_*) starting at `at`: floats from the pool's start for f32 rows, bytes for FP8
 * and BF16 ones; the f32 values the CPU reads. */
template <int KV, int V>
static __device__ __forceinline__ void kv_row_vals(const void *pool, size_t at, int R, int i0,
                                                   float *x) {
    if constexpr (KV == DS_KV_FP8) {
        kv_fp8_vals<V>((const uint8_t *)pool + at, R, i0, x);
    } else if constexpr (KV == DS_KV_BF16) {
        const uint16_t *h = (const uint16_t *)((const uint8_t *)pool + at) + i0;
        if constexpr (V == 4) {
            const uint2 u = *(const uint2 *)h;
            x[0] = __uint_as_float(u.x << 16), x[1] = __uint_as_float(u.x & 0xffff0000u);
            x[2] = __uint_as_float(u.y << 16), x[3] = __uint_as_float(u.y & 0xffff0000u);
        } else {
#pragma unroll
            for (int e = 0; e < V; e++) x[e] = ds_kv_bf16_value(h[e]);
        }
    } else if constexpr (V == 4) {
        const float4 y = *(const float4 *)((const float *)pool + at + i0);
        x[0] = y.x, x[1] = y.y, x[2] = y.z, x[3] = y.w;
    } else {
#pragma unroll
        for (int e = 0; e < V; e++) x[e] = ((const float *)pool)[at + i0 + e];
    }
}

/* ds_cu_mla_attend_absorbed_batch on tensor cores (mla_decode_tc.cu) when the device takes it
 * there (ds_cu_set_mla_decode_tc) and the shape fits (R 512, dr 64, Ha 16 or 32): *done 1 */
int mla_decode_tc(ds_cu *c, float *obar, const float *qbar, const float *qr, int ldqr, int T,
                  int Ha, int R, int dr, const void *pool, int kv_dtype, const int32_t *tables,
                  const int32_t *tok_bt, const int32_t *tok_pos, int max_ctx, int block_size,
                  size_t row_bytes, float scale, int *done, ds_err *err);

#endif
