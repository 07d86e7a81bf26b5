/* fp8_rows.cuh — one token's FP8 products a warp a row, on the CUDA cores (docs/quantization.md
 * §3, "one token a warp a row"): the form of BF16's gemv_bf16_k for ptpc FP8 weights, used by the
 * dense product (matmul_fp8.cu) and one token's routed experts (moe_fp8.cu) when batch invariance
 * is off. The tensor-core tiles of fp8_stream.cuh give a warp 16 rows, so a decode product has a
 * few warps an SM, each waiting on its own dependent chain (Nsight Compute, RESULTS sessions
 * 32-35); a warp a row has as many warps as rows, as the BF16 kernel that streams at the copy rate.
 *
 * The math is the w8a8 of quantization.md: the token's row quantized per token (its codes'
 * values), each code times code exact and the sums in f32 — here FFMA on f32 operands made by bits:
 * an E4M3 code's sign to bit 31 and its exponent and mantissa to bits 26..20 is the f32 whose
 * value is the code's times 2^-120 (subnormal codes become subnormal f32, exact without flushing:
 * the build has no fast math). The token's values are kept times 2^64, so that every product
 * (2^-74 .. 2^-38 in magnitude) is a normal f32 and exact; the sum times 2^56 is the row's sum.
 * The sums' order differs from the tiles' (and between T = 1 and larger batches): this form is
 * for batch invariance off only. */
#pragma once

#include "kernels/cuda/fp8_stream.cuh"

/* the token's values are kept times F8R_X_SCALE; a sum times F8R_Y_SCALE is the row's */
#define F8R_X_SCALE 18446744073709551616.0f /* 2^64 */
#define F8R_Y_SCALE 72057594037927936.0f    /* 2^56 */

/* Where column c of the token's row lives in the block's shared copy (floats): lane l's 16
 * columns of its piece p = 32 j + l, [16 p, 16 p + 16), are four float4 at j 128 + q 32 + l
 * (q = 0..3), so that a warp's 32 lanes read 32 consecutive float4 (no bank conflicts). The copy
 * spans whole groups of 512 columns: f8r_smem floats. */
static __device__ __forceinline__ int f8r_xidx(int c) {
    const int p = c >> 4, i = c & 15;
    return (p >> 5) * 512 + (i >> 2) * 128 + (p & 31) * 4 + (i & 3);
}

/* the shared copy's bytes for a row of K columns (the last group of 512 partly unused) */
static inline size_t f8r_smem(int K) {
    return ((size_t)K + 511) / 512 * 512 * sizeof(float);
}

/* the f32 of a code's value times 2^64 */
static __device__ __forceinline__ float f8r_xval(uint16_t f16) {
    return __half2float(__ushort_as_half(f16)) * F8R_X_SCALE;
}

/* the f32 (times 2^64) of column c of a row of codes as f8_x_put wrote it (ptpc_act_k, the norms)
 */
static __device__ __forceinline__ float f8r_xh(const uint16_t *q, int c) {
#ifdef DS_F8_MMA_E4M3
    return f8r_xval(
        (uint16_t)(f8x2_f16_cvt(((const uint8_t *)q)[2 * (c & ~15) + (c & 15)]) & 0xffffu));
#else
    return f8r_xval(q[c]);
#endif
}

/* The block's shared copy of the token (xs4, f8r_smem(K) bytes): its codes xh (as f8_x_put wrote
 * them) and scale *xs when a norm made them, else row v(c), c < K, quantized here per token
 * (f8_quant_put: the scale and codes ptpc_act_k writes). Every thread of the block calls it; the
 * copy is complete on return (a barrier). Returns the scale. */
template <typename V>
static __device__ __forceinline__ float f8r_stage(float4 *xs4, float *st_sh, int K,
                                                  const uint16_t *xh, const float *xs, V v) {
    float *xsh = (float *)xs4;
    if (xh) {
        for (int c = threadIdx.x; c < K; c += blockDim.x) xsh[f8r_xidx(c)] = f8r_xh(xh, c);
        if (threadIdx.x == 0) *st_sh = *xs;
    } else {
        const float s = f8_quant_put(
            K, v, [xsh](int c, float q) { xsh[f8r_xidx(c)] = f8r_xval(f8_code_f16(q)); });
        if (threadIdx.x == 0) *st_sh = s;
    }
    __syncthreads();
    return *st_sh;
}

/* four codes (one word, the lowest byte the first column) as f32 times 2^-120 */
static __device__ __forceinline__ float4 f8r_w4(uint32_t w) {
    return make_float4(__uint_as_float(((w << 24) & 0x80000000u) | ((w << 20) & 0x07f00000u)),
                       __uint_as_float(((w << 16) & 0x80000000u) | ((w << 12) & 0x07f00000u)),
                       __uint_as_float(((w << 8) & 0x80000000u) | ((w << 4) & 0x07f00000u)),
                       __uint_as_float((w & 0x80000000u) | ((w >> 4) & 0x07f00000u)));
}

static __device__ __forceinline__ float f8r_dot4(float acc, uint32_t w, float4 x) {
    const float4 f = f8r_w4(w);
    return fmaf(f.w, x.w, fmaf(f.z, x.z, fmaf(f.y, x.y, fmaf(f.x, x.x, acc))));
}

/* a [U][R]: pieces p0, p0 + 32, .. p0 + 32 (U - 1) of R rows (zeros from np on); the first U of
 * a lane (p0 = lane) may be loaded before a kernel's wait: weights are no earlier kernel's output
 */
template <int R, int U>
static __device__ __forceinline__ void f8r_load(uint4 (&a)[U][R], const uint4 *const (&w)[R],
                                                int np, int p0) {
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int r = 0; r < R; r++)
            a[u][r] = p0 + 32 * u < np ? __ldg(w[r] + p0 + 32 * u) : make_uint4(0u, 0u, 0u, 0u);
}

/* acc[r] += row r (w[r]: its 16-byte pieces) dotted with the token (xs4: the shared copy as
 * float4), lane's pieces p = lane, lane + 32, .. < np (np = K / 16): U of them a row loaded
 * together, for R rows at once, before any is used; a holds the first U already (f8r_load with
 * p0 = lane). Each lane's sum runs over its pieces in order, words x, y, z, w of a piece; the
 * lanes' sums are added by f8r_reduce. */
template <int R, int U>
static __device__ __forceinline__ void f8r_rows(float (&acc)[R], uint4 (&a)[U][R],
                                                const uint4 *const (&w)[R], const float4 *xs4,
                                                int np, int lane) {
    for (int p0 = lane; p0 - lane < np; p0 += 32 * U) {
        if (p0 != lane) f8r_load<R, U>(a, w, np, p0);
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int p = p0 + 32 * u;
            if (p >= np) break;
            const float4 *xp = xs4 + (p >> 5) * 128 + (p & 31);
            const float4 x0 = xp[0], x1 = xp[32], x2 = xp[64], x3 = xp[96];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float s = acc[r];
                s = f8r_dot4(s, a[u][r].x, x0);
                s = f8r_dot4(s, a[u][r].y, x1);
                s = f8r_dot4(s, a[u][r].z, x2);
                acc[r] = f8r_dot4(s, a[u][r].w, x3);
            }
        }
    }
}

/* w [R]: rows n .. n + R - 1 of W (rows of K codes; past N the last row, whose sums go nowhere) */
template <int R>
static __device__ __forceinline__ void f8r_point(const uint4 *(&w)[R], const uint8_t *W, int n,
                                                 int N, int K) {
#pragma unroll
    for (int r = 0; r < R; r++) w[r] = (const uint4 *)(W + (size_t)min(n + r, N - 1) * K);
}

/* the warp's sum of each row (every lane gets it) */
template <int R> static __device__ __forceinline__ void f8r_reduce(float (&acc)[R]) {
#pragma unroll
    for (int r = 0; r < R; r++)
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}

/* A warp's rows of W: n, n + 1, .. n + R - 1, then stride further, up to N, each
 * y[row] = ((sum * 2^56) * st) * sr[row] with the token's shared copy xs4; w and a point at and
 * hold the first rows' first pieces (f8r_point, f8r_load), and each next rows' first pieces are
 * requested before this one's sums are added. */
template <int R, int U>
static __device__ __forceinline__ void
f8r_walk(float *y, const uint8_t *W, const float *sr, int N, int K, int n, int stride, float st,
         const uint4 *(&w)[R], uint4 (&a)[U][R], const float4 *xs4) {
    const int lane = threadIdx.x & 31, np = K / 16;
    for (; n < N; n += stride) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] = 0.0f;
        f8r_rows<R, U>(acc, a, w, xs4, np, lane);
        if (n + stride < N) {
            f8r_point<R>(w, W, n + stride, N, K);
            f8r_load<R, U>(a, w, np, lane);
        }
        f8r_reduce<R>(acc);
#pragma unroll
        for (int r = 0; r < R; r++)
            if (lane == r && n + r < N) y[n + r] = ((acc[r] * F8R_Y_SCALE) * st) * sr[n + r];
    }
}

/* Rows a warp takes at once and pieces a row loaded together, by K: six to eight 16-byte loads in
 * flight a lane (R U), a row's pieces a lane at most U where K allows (a 2304-wide row is 4.5). */
#define F8R_DISPATCH(K, KERNEL_RU)                                                                 \
    ((K) <= 1024   ? KERNEL_RU(4, 2)                                                               \
     : (K) <= 2048 ? KERNEL_RU(2, 4)                                                               \
     : (K) <= 3072 ? KERNEL_RU(1, 6)                                                               \
                   : KERNEL_RU(1, 8))

/* Largest K whose token row (f8r_smem) fits the default 48 KB beside the kernels' static bytes. */
enum { F8R_K_MAX = 11264 };

/* Whether one token's product of K columns (codes at W) takes this form: on (rows: the context's
 * f8_rows or f8_moe_rows, ds_cu_set_f8_rows), batch invariance off, whole 16-byte pieces, the row
 * within F8R_K_MAX. */
static inline bool f8r_fits(const ds_cu *c, int rows, int K, const void *W) {
    return rows >= 0 && !c->batch_invariant && K % 16 == 0 && K <= F8R_K_MAX &&
           (uintptr_t)W % 16 == 0;
}
