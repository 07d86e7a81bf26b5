/* gemv.cuh — the BF16 weight-streaming GEMV's block (one token to a few), shared by matmul.cu's
 * gemv_bf16_k and the MoE router's fused kernel (moe_router.cu), so that both make the same sums in
 * the same order: a router's logits have the same bits whichever of the two made them. */
#ifndef DS_CUDA_GEMV_CUH
#define DS_CUDA_GEMV_CUH

#include "kernels/cuda/common.cuh"

/* Single-token matmul (measured on the H200: at T = 1 it reads the 163840 x 2304 lm_head at 104%
 * of the copy rate where cuBLAS reaches 90%, and small matrices in half cuBLAS's time; at T = 2 it
 * already trails cuBLAS, at T = 8 by 4x, since every warp re-reads all of x): one warp per output
 * row streams that row of W once with 16-byte
 * loads (8 BF16 each) and dots it with every token's f32 x (small, served by L1), accumulating in
 * f32 — the weights are the bytes that matter, and they are read exactly once. */
/* With S > 1 (few rows: the router, the shared experts, o_proj, MLA's small projections), S
 * warps share a row, warp p of them taking the row's 16-byte pieces p, p + S, p + 2S, ... (32
 * lanes wide), and their sums are added in the order p = 0, 1, ..; a block then covers 8 / S
 * rows. S depends on the matrix alone (gemv_splits), never on T, so that a token's bits stay
 * the same whatever the batch. */
/* A block's part of y (returning early where S == 1 leaves a warp nothing: a caller that goes on
 * after it must not rely on every thread having written). */
template <int TT>
static __device__ __forceinline__ void gemv_bf16_block(float *y, int ldy, const float *x, int ldx,
                                                       const uint16_t *W, int N, int K, size_t ys,
                                                       size_t xs, size_t ws, int S) {
    __shared__ float red[8][TT]; /* [warp][token] partial sums (S > 1) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * (8 / S) + warp / S, part = warp % S, nk = K / 8, step = 32 * S;
    const int k0 = lane + 32 * part;
    /* The weights are no earlier kernel's output: the first GEMV_PRE loads of this lane's part
     * of its row are issued before waiting for the previous kernel (PDL), so a small matmul's
     * stream is already under way when its input lands. Same loads, same order of sums. (8 or
     * 12 of them at one token, in more registers, were measured slower: bench/RESULTS.md.) */
    enum { GEMV_PRE = 4 };
    const uint4 *wr = (const uint4 *)(W + blockIdx.z * ws + (size_t)min(n, N - 1) * K);
    uint4 pre[GEMV_PRE];
#pragma unroll
    for (int i = 0; i < GEMV_PRE; i++)
        if (k0 + step * i < nk) pre[i] = __ldg(wr + k0 + step * i);
    PDL_ENTRY();
    if (S == 1 && n >= N) return; /* a whole warp leaves together; no block barrier follows */
    x += (size_t)blockIdx.y * TT * ldx + blockIdx.z * xs; /* tile blockIdx.y of TT tokens */
    y += (size_t)blockIdx.y * TT * ldy + blockIdx.z * ys; /* head blockIdx.z */
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
#pragma unroll
    for (int i = 0; i < GEMV_PRE; i++) {
        const int k8 = k0 + step * i;
        if (k8 < nk)
#pragma unroll
            for (int t = 0; t < TT; t++)
                acc[t] += dot8(pre[i], x + (size_t)t * ldx + (size_t)k8 * 8);
    }
#pragma unroll 4
    for (int k8 = k0 + step * GEMV_PRE; k8 < nk; k8 += step) {
        const uint4 u = __ldg(wr + k8);
#pragma unroll
        for (int t = 0; t < TT; t++) acc[t] += dot8(u, x + (size_t)t * ldx + (size_t)k8 * 8);
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (S == 1) {
            if (lane == 0) y[(size_t)t * ldy + n] = v;
        } else if (lane == 0) {
            red[warp][t] = v;
        }
    }
    if (S == 1) return;
    __syncthreads();
    if (part == 0 && lane < TT && n < N) {
        float v = 0.0f;
        for (int p = 0; p < S; p++) v += red[warp + p][lane];
        y[(size_t)lane * ldy + n] = v;
    }
}

/* Blocks of 256 threads for `rows` rows at S warps a row (8 / S rows a block). */
static inline long gemv_blocks(long rows, int S) {
    return (rows + 8 / S - 1) / (8 / S);
}

/* Warps per row for an N x K matrix (H of them): more while the rows alone would leave the GPU
 * short of warps (about 32 per SM), as long as each warp keeps a whole 32-lane piece of K. A
 * function of the matrix only (see gemv_bf16_k). */
static inline int gemv_splits(const ds_cu *c, int N, int K, int H) {
    const long rows = (long)N * H, want = 32L * c->n_sm;
    int S = 1;
    /* (Splitting a matrix of more than a wave of blocks further, so that its last wave is full —
     * KDA's q/k/v at the 48B shape: 1.49 -> 2.98 waves — was measured slower in a batch-1
     * step, bench/RESULTS.md session 9.) */
    while (S < 8 && rows * S < want && K / 8 >= 32 * 2 * S) S *= 2;
    return S;
}

/* Rows up to which a matmul streams its weights (gemv_tiles) rather than calling cuBLAS: in the
 * 48B shape's steps with graphs on the H200 streaming was faster at batch 2 and cuBLAS from 4
 * (bench/RESULTS.md session 12). */
enum { GEMV_MAX_T = 2 };

/* up to how many rows ds_cu_matmul and ds_cu_matmul_heads stream their weights */
static inline int gemv_rows_max(const ds_cu *c) {
    return c->gemv_max_t > 0 ? c->gemv_max_t : GEMV_MAX_T;
}

#endif
