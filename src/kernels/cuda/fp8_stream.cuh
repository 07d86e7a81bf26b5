/* fp8_stream.cuh — the FP8 weight-streaming step on F16 tensor cores, one definition for the
 * dense products (matmul_fp8.cu), the routed experts (moe_fp8.cu) and the fused KDA decode
 * (kda_fused.cu), so that a row's sum has the same bits whichever of them computes it.
 *
 * The w8a8 math of docs/quantization.md §3: every E4M3 value is exact in F16 (weights through
 * the conversion unit, activations as their codes' values), each product of two is exact in f32
 * and the mma accumulates in f32. A warp owns a 16-row tile of the weights; a 64-column step of
 * the tile is lane (g, l4)'s 16 codes [16 l4, 16 l4 + 16) of rows g and g + 8 and the same 16
 * columns of column (token) g's F16 row, so that the operands of the m16n8k16 mma hold the
 * columns in one permuted order for A and B alike. D[i][j] depends on row i and column j alone:
 * a row's sum does not depend on the tile's other rows nor the pass's other columns. */
#pragma once

#include "kernels/cuda/common.cuh"
#include "kernels/shared/quant.h"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

/* -DDS_CUDA_F8_MMA (an experiment, checked and slower than the F16 step at batch 1: docs/
 * quantization.md §3): the E4M3 tensor cores where the target has them (sm_89+; the PTX for
 * older parts keeps the F16 step) */
#if defined(DS_CUDA_F8_MMA) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 890)
#define DS_F8_MMA_E4M3 1
#endif
static __device__ __forceinline__ void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4],
                                                     uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* two E4M3 codes (low byte first) as an F16 pair, through the conversion unit */
static __device__ __forceinline__ uint32_t f8x2_f16_cvt(uint32_t w16) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)w16, __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

/* e4m3(v): quant.h's code (nearest, ties to even, saturating at 448; NaN 0x7f), through the
 * conversion unit where the target has one (sm_89+: cvt.rn.satfinite rounds and saturates the
 * same way, which test_cuda_kernels checks bit for bit over every exponent, ties and subnormals),
 * quant.h's integer form elsewhere. In the quantizers of a decode product (every block of it
 * quantizes its token) the integer form was tens of dependent instructions a value. */
static __device__ __forceinline__ uint8_t f8_code(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.0f), "f"(v));
    return (uint8_t)r;
#else
    return ds_f32_to_e4m3(v);
#endif
}

/* the F16 value (exact) of e4m3(v): the streaming kernels' activation operand */
static __device__ __forceinline__ uint16_t f8_code_f16(float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    return (uint16_t)(f8x2_f16_cvt(f8_code(v)) & 0xffffu);
#else
    return __half_as_ushort(__float2half_rn(ds_e4m3_to_f32(ds_f32_to_e4m3(v))));
#endif
}

/* The activations' operand of the streaming kernels, a row of K uint16_t: column c's code as its
 * F16 value at element c, or with the E4M3 tensor cores (-DDS_CUDA_F8_MMA) the code itself at
 * byte 2 (c & ~15) + (c & 15) — the first half of the 32 bytes its 16-column piece has, so that a
 * lane's 16 codes are one 16-byte load where its 16 values were two, with the same pointers. */
static __device__ __forceinline__ void f8_x_put(uint16_t *q, int c, float v) {
#ifdef DS_F8_MMA_E4M3
    ((uint8_t *)q)[2 * (c & ~15) + (c & 15)] = f8_code(v);
#else
    q[c] = f8_code_f16(v);
#endif
}

/* the same F16 pair by bits: each code's sign goes to bit 15 of its half and its exponent and
 * mantissa (7 bits) to bits 13..7, which is the F16 value 2^-8 times the code's (exponent biases
 * 15 and 7; subnormal codes become subnormal halves); times 2^8 (exact) it is the code's value.
 * Codes 0x7f/0xff (NaN) differ, and are never written (the quantizer saturates at 448). */
static __device__ __forceinline__ uint32_t f8x2_f16_bits(uint32_t w16) {
    const uint32_t t = __byte_perm(w16, 0u, 0x1404u); /* code 0 to byte 1, code 1 to byte 3 */
    const uint32_t h = (t & 0x80008000u) | ((t >> 1) & 0x3f803f80u);
    const __half2 v = __hmul2(*(const __half2 *)&h,
                              __halves2half2(__ushort_as_half(0x5c00u), __ushort_as_half(0x5c00u)));
    return *(const uint32_t *)&v;
}

/* The form the kernels use: the conversion unit, or (built with -DDS_CUDA_F8_BITS, an
 * experiment) the bits. The conversion unit is not what holds the FP8 streams back: it reads at
 * the rate of the codes alone, and the bits were slower in the kernels (docs/quantization.md §3;
 * tests/cuda/bench_f8cvt.cu times both). */
static __device__ __forceinline__ uint32_t f8x2_f16(uint32_t w16) {
#ifdef DS_CUDA_F8_BITS
    return f8x2_f16_bits(w16);
#else
    return f8x2_f16_cvt(w16);
#endif
}

#ifdef DS_F8_MMA_E4M3
/* E4M3 tensor cores (sm_89+): A 16 x 32 and B 32 x 8 codes, f32 accumulation. Lane (g, l4) holds
 * A's rows g (a0, a2) and g + 8 (a1, a3) at k [4 l4, 4 l4 + 4) (a0, a1) and [16 + 4 l4, +4)
 * (a2, a3), and B's column g at the same k (b0, b1). */
static __device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], uint32_t a0, uint32_t a1,
                                                      uint32_t a2, uint32_t a3, uint32_t b0,
                                                      uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* one 64-column step on E4M3 tensor cores: the lane's 16 weight codes of a row are codes
 * [0, 4) [4, 8) of the first mma's k slots and [8, 12) [12, 16) of the second's, and its 16
 * activation codes (x0: the operand holds codes in this build, f8_x_put) the same — no conversion
 * at all; x1 is unused */
static __device__ __forceinline__ void f8_mma_step(float (&acc)[4], uint4 a0, uint4 a1, uint4 x0,
                                                   uint4 x1) {
    (void)x1;
    mma_16832_e4m3(acc, a0.x, a1.x, a0.y, a1.y, x0.x, x0.y);
    mma_16832_e4m3(acc, a0.z, a1.z, a0.w, a1.w, x0.z, x0.w);
}
#else
/* one 64-column step: a0, a1 the lane's 16 codes of rows g and g + 8, x0 x1 its 16 F16 values */
static __device__ __forceinline__ void f8_mma_step(float (&acc)[4], uint4 a0, uint4 a1, uint4 x0,
                                                   uint4 x1) {
    const uint32_t A0[4] = {a0.x, a0.y, a0.z, a0.w}, A1[4] = {a1.x, a1.y, a1.z, a1.w};
    const uint32_t B[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int q = 0; q < 4; q++) { /* codes [4 q, 4 q + 4) of the lane's 16 */
        const uint32_t fr[4] = {f8x2_f16(A0[q] & 0xffffu), f8x2_f16(A1[q] & 0xffffu),
                                f8x2_f16(A0[q] >> 16), f8x2_f16(A1[q] >> 16)};
        mma_16816_f16(acc, fr, B[2 * q], B[2 * q + 1]);
    }
}
#endif

/* A warp's 16-row tile in tile-set b (8 / S tiles a block, S warps along K; W's rows from e_off
 * on): the lane's pieces l4 of rows g and g + 8 (clamped to the last row), as f8_load takes them.
 */
struct f8_trows {
    const uint4 *w0, *w1;
};
static __device__ __forceinline__ f8_trows f8_tile_rows(const uint8_t *W, size_t e_off, int N,
                                                        int K, int S, int b) {
    const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, l4 = threadIdx.x & 3;
    const int n0 = (b * (8 / S) + warp / S) * 16 + g;
    return {(const uint4 *)(W + (e_off + min(n0, N - 1)) * K) + l4,
            (const uint4 *)(W + (e_off + min(n0 + 8, N - 1)) * K) + l4};
}

/* Steps in flight a warp: their weights loaded together, then multiplied (the activations, in
 * shared memory or L2, as each step needs them). */
enum { F8_U = 8 };

/* The weights of steps s, s + S, .., s + (U - 1) S of a tile (w0, w1: rows g and g + 8 at the
 * lane's piece l4; zeros past ns). They are no earlier kernel's output: a kernel may load its
 * first ones before its PDL wait. */
template <int U = F8_U>
static __device__ __forceinline__ void f8_load(uint4 (&a)[U][2], const uint4 *w0, const uint4 *w1,
                                               int s, int S, int ns) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int su = s + u * S;
        if (su < ns) {
            a[u][0] = __ldg(w0 + 4 * su), a[u][1] = __ldg(w1 + 4 * su);
        } else {
            a[u][0] = a[u][1] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

/* acc += the tile's rows (w0, w1, see f8_load) dotted with the lane's column: xr its F16 row at
 * piece l4 ((const uint4 *)row + 2 l4; NULL: a zero column), over steps part, part + S, .. < ns
 * in that order (a has the first U of them already); then, by part 0, the narrower last step
 * of a K that is no multiple of 64 (its missing pieces zero). K a multiple of 16. The steps a
 * lane multiplies, and their order, depend on (K, S, part) alone. */
template <int U = F8_U>
static __device__ __forceinline__ void f8_tile(float (&acc)[4], uint4 (&a)[U][2], const uint4 *w0,
                                               const uint4 *w1, const uint4 *xr, int part, int S,
                                               int K, int l4) {
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    const int ns = K / 64;
    for (int s = part; s < ns; s += U * S) {
        if (s != part) f8_load<U>(a, w0, w1, s, S, ns);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int su = s + u * S;
            if (su < ns)
                f8_mma_step(acc, a[u][0], a[u][1], xr ? xr[8 * su] : zero,
                            xr ? xr[8 * su + 1] : zero);
        }
    }
    if (part == 0 && K % 64) {
        const bool tail = 64 * ns + 16 * l4 < K;
        f8_mma_step(acc, tail ? __ldg(w0 + 4 * ns) : zero, tail ? __ldg(w1 + 4 * ns) : zero,
                    xr && tail ? xr[8 * ns] : zero, xr && tail ? xr[8 * ns + 1] : zero);
    }
}

/* The S partial sums of a tile added in the order p = 0, 1, .. into part 0's acc. Every warp of
 * the block calls it (barriers); red is the block's [8 warps][32 lanes]. True for the warp that
 * keeps the sum (part 0). */
static __device__ __forceinline__ bool f8_split_sum(float (&acc)[4], float4 (*red)[32], int S,
                                                    int part) {
    if (S == 1) return true;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); /* the previous tile is done with red */
    red[warp][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    __syncthreads();
    if (part) return false;
    acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    for (int p = 0; p < S; p++) {
        const float4 v = red[warp + p][lane];
        acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
    }
    return true;
}

/* One row of activations quantized per token (docs/quantization.md §3, as ds_ptpc_quantize):
 * put(c, v(c) / scale) for every column c < K, the scale returned. Every thread of the block
 * calls it (block_max's barriers). v(c) gives value c. Each thread takes F8_QB values a round, all
 * loaded before any is used: one after another, a row of the 48B shape's widths was a chain of
 * 9-36 trips to L2 a pass, longer than the product. */
enum { F8_QB = 8 };
template <typename V, typename P>
static __device__ __forceinline__ float f8_quant_put(int K, V v, P put) {
    const int nb = blockDim.x;
    float amax = 0.0f;
    for (int c0 = threadIdx.x; c0 < K; c0 += F8_QB * nb) {
        float val[F8_QB];
#pragma unroll
        for (int i = 0; i < F8_QB; i++) val[i] = c0 + i * nb < K ? v(c0 + i * nb) : 0.0f;
#pragma unroll
        for (int i = 0; i < F8_QB; i++) amax = fmaxf(amax, fabsf(val[i]));
    }
    amax = block_max(amax);
    const float st = ds_ptpc_scale(amax), inv = 1.0f / st; /* (IEEE division: no fast math) */
    for (int c0 = threadIdx.x; c0 < K; c0 += F8_QB * nb) {
        float val[F8_QB];
#pragma unroll
        for (int i = 0; i < F8_QB; i++) val[i] = c0 + i * nb < K ? v(c0 + i * nb) : 0.0f;
#pragma unroll
        for (int i = 0; i < F8_QB; i++)
            if (c0 + i * nb < K) put(c0 + i * nb, val[i] * inv);
    }
    return st;
}

/* ...into q [K] as the streaming kernels' operand (f8_x_put); q may be shared or global memory */
template <typename V>
static __device__ __forceinline__ float f8_quant_row(uint16_t *q, int K, V v) {
    return f8_quant_put(K, v, [q](int c, float s) { f8_x_put(q, c, s); });
}

/* Warps along K for a tile of a matrix of N rows and K columns: enough warps for the loads in
 * flight to cover the memory's latency (about 16 a multiprocessor), at least min_steps (0:
 * F8_SPLIT_MIN) steps each. A function of the matrix and the device alone (batch invariance).
 * (A warp owns 16 rows, so a small matrix has few warps: session 32's Nsight Compute run found
 * the products waiting on their own dependent chains at 4-9 warps an SM; DS_CUDA_F8_SPLIT_MIN
 * below 4 splits K further to measure what more warps give.) */
enum { F8_SPLIT_MIN = 4 };
static inline int f8_splits(int n_sm, int N, int K, int min_steps) {
    const long tiles = (N + 15) / 16, want = 16L * n_sm;
    const int m = min_steps > 0 ? min_steps : F8_SPLIT_MIN;
    int S = 1;
    while (S < 8 && tiles * S < want && K / 64 >= m * 2 * S) S *= 2;
    return S;
}
/* An experiment (DS_CUDA_F8_SPLIT, ds_cu_set_f8_split): where the rule above splits K at all, S
 * forced to `force` (1, 2, 4 or 8; no more parts than K has 64-column steps), to measure the waves:
 * a 12544 x 2304 product at S = 4 is 392 blocks for two an SM's 264 places, 1.5 waves, where S =
 * 8 would be 784, three nearly full ones. Still a function of the matrix (batch invariance), and
 * the fused KDA decode's f_b and g_b, which the rule never splits, are left alone. */
static inline int f8_splits_forced(int n_sm, int N, int K, int min_steps, int force) {
    const int S = f8_splits(n_sm, N, K, min_steps);
    if (force <= 0 || S == 1) return S;
    int F = 1;
    while (F * 2 <= force && F < 8 && K / 64 >= F * 2) F *= 2;
    return F;
}

/* The split a call of T tokens takes: K whole from f8_whole_k tokens with batch invariance off
 * (a batch's routed experts have about a row an expert, so their tiles already fill the grid and
 * a split only adds partial sums: bench/RESULTS.md session 36), else the rule's (or the forced). */
static inline int f8_splits_for(const ds_cu *c, int N, int K, int T) {
    if (!c->batch_invariant && c->f8_whole_k > 0 && T >= c->f8_whole_k && c->f8_split <= 0)
        return 1;
    return f8_splits_forced(c->n_sm, N, K, c->f8_split_min, c->f8_split);
}
