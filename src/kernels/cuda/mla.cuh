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
