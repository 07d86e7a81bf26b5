/* matmul.cu — matmuls against BF16 weights: the weight-streaming GEMV kernels (one token to a
 * few), activations rounded to BF16 for cuBLAS, and the cuBLAS glue (plain, per head, BF16). */
#include "kernels/cuda/common.cuh"

/* ---- matmul -----------------------------------------------------------------------------------
 */

/* xb[t][c] = bf16(x[t][c]) for c < K (x row stride ldx, xb packed): a block a row (grid-stride),
 * 16-byte loads where vec (x 16-byte aligned, ldx and K multiples of 4). One thread an element
 * with a 64-bit division for its row was what the GEMMs' rounding cost at prefill. */
__global__ void to_bf16_rows(__nv_bfloat16 *xb, const float *x, int ldx, int K, int T, int vec) {
    PDL_ENTRY();
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *xr = x + (size_t)t * ldx;
        __nv_bfloat16 *dr = xb + (size_t)t * K;
        if (vec)
            for (int c4 = threadIdx.x; c4 < K / 4; c4 += blockDim.x)
                store_bf16x4(dr + 4 * c4, __ldg((const float4 *)xr + c4));
        else
            for (int c = threadIdx.x; c < K; c += blockDim.x) dr[c] = __float2bfloat16_rn(xr[c]);
    }
}

/* launches to_bf16_rows: xb [T][K] packed from x [T][ldx] */
void round_rows(ds_cu *c, __nv_bfloat16 *xb, const float *x, int ldx, int K, int T) {
    const int vec = (uintptr_t)x % 16 == 0 && ldx % 4 == 0 && K % 4 == 0;
    launch_k(c, to_bf16_rows, (unsigned)DS_MIN(T, 1 << 20), K >= 512 ? 256 : 128, 0, xb, x, ldx, K,
             T, vec);
}

/* x [T][ldx] rounded to BF16 into the matmul scratch (columns [0, K), packed K apart): cuBLAS's
 * activation operand. */
static const uint16_t *round_x(ds_cu *c, const float *x, int ldx, int K, int T, ds_err *err) {
    size_t need = (size_t)T * K;
    if (grow_scratch(c, (void **)&c->xb, &c->xb_bytes, need * sizeof(uint16_t), "matmul scratch",
                     err))
        return NULL;
    round_rows(c, (__nv_bfloat16 *)c->xb, x, ldx, K, T);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        ds_errf(err, "cuda: matmul: rounding x: %s", cudaGetErrorString(e));
        return NULL;
    }
    return c->xb;
}

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
template <int TT>
__global__ void __launch_bounds__(256)
    gemv_bf16_k(float *y, int ldy, const float *x, int ldx, const uint16_t *W, int N, int K,
                size_t ys, size_t xs, size_t ws, int S) {
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

/* The same for any K and alignment, one element at a time (the batch-invariant mode's fallback):
 * per token the same order of operations whatever T is. */
__global__ void __launch_bounds__(256)
    gemv_any_k(float *y, int ldy, const float *x, int ldx, const uint16_t *W, int N, int K) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, n = blockIdx.x * 8 + (threadIdx.x >> 5), t = blockIdx.y;
    if (n >= N) return;
    const uint16_t *wr = W + (size_t)n * K;
    const float *xt = x + (size_t)t * ldx;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32) acc += __uint_as_float((uint32_t)wr[k] << 16) * xt[k];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[(size_t)t * ldy + n] = acc;
}

/* Tiles of 8 tokens share one read of W; the remainder runs as its own instance. Each token's
 * dot products take the same operations in every instance, so its bits do not depend on T. */
/* H heads (blockIdx.z): head h's y, x and W start ys, xs and ws elements after head 0's. */
/* Blocks of 256 threads for `rows` rows at S warps a row (8 / S rows a block). */
static long gemv_blocks(long rows, int S) {
    return (rows + 8 / S - 1) / (8 / S);
}

/* Warps per row for an N x K matrix (H of them): more while the rows alone would leave the GPU
 * short of warps (about 32 per SM), as long as each warp keeps a whole 32-lane piece of K. A
 * function of the matrix only (see gemv_bf16_k). */
static int gemv_splits(const ds_cu *c, int N, int K, int H) {
    const long rows = (long)N * H, want = 32L * c->n_sm;
    int S = 1;
    /* (Splitting a matrix of more than a wave of blocks further, so that its last wave is full —
     * KDA's q/k/v at the 48B shape: 1.49 -> 2.98 waves — was measured slower in a batch-1
     * step, bench/RESULTS.md session 9.) */
    while (S < 8 && rows * S < want && K / 8 >= 32 * 2 * S) S *= 2;
    return S;
}

static int gemv_tiles(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                      const uint16_t *W, int N, int K, int H, size_t ys, size_t xs, size_t ws,
                      ds_err *err) {
    const int S = gemv_splits(c, N, K, H);
    const unsigned blocks = (unsigned)gemv_blocks(N, S), hz = (unsigned)H;
    int full = T / 8, rem = T % 8;
    for (int t0 = 0; t0 < full * 8; t0 += 8 * 65535) /* grid.y holds 65535 tiles */
        launch_k(c, gemv_bf16_k<8>, dim3(blocks, (unsigned)DS_MIN(full - t0 / 8, 65535), hz), 256,
                 0, y + (size_t)t0 * ldy, ldy, x + (size_t)t0 * ldx, ldx, W, N, K, ys, xs, ws, S);
    const float *xr = x + (size_t)full * 8 * ldx;
    float *yr = y + (size_t)full * 8 * ldy;
    const dim3 g(blocks, 1, hz);
#define GEMV_REM(TT)                                                                               \
    launch_k(c, gemv_bf16_k<TT>, g, 256, 0, yr, ldy, xr, ldx, W, N, K, ys, xs, ws, S)
    switch (rem) {
    case 0:
        break;
    case 1:
        GEMV_REM(1);
        break;
    case 2:
        GEMV_REM(2);
        break;
    case 3:
        GEMV_REM(3);
        break;
    case 4:
        GEMV_REM(4);
        break;
    case 5:
        GEMV_REM(5);
        break;
    case 6:
        GEMV_REM(6);
        break;
    default:
        GEMV_REM(7);
        break;
    }
#undef GEMV_REM
    CU_TRY(cudaGetLastError(), "matmul (gemv)");
    return DS_OK;
}

extern "C" void ds_cu_set_batch_invariant(ds_cu *c, int on) {
    c->batch_invariant = on;
}

/* Rows up to which a matmul streams its weights (gemv_tiles) rather than calling cuBLAS: in the
 * 48B shape's steps with graphs on the H200 streaming was faster at batch 2 and cuBLAS from 4
 * (bench/RESULTS.md session 12). */
enum { GEMV_MAX_T = 2 };

extern "C" void ds_cu_set_f8_prequant(ds_cu *c, int on) {
    c->f8_prequant = on;
}

extern "C" void ds_cu_set_f8_split_min(ds_cu *c, int steps) {
    c->f8_split_min = steps;
}

extern "C" void ds_cu_set_f8_split(ds_cu *c, int parts) {
    c->f8_split = parts;
}

extern "C" void ds_cu_set_f8_moe_waves(ds_cu *c, int blocks_per_sm) {
    c->f8_moe_waves = blocks_per_sm;
}

extern "C" void ds_cu_set_f8_whole_k(ds_cu *c, int tokens) {
    c->f8_whole_k = tokens;
}

extern "C" void ds_cu_set_f8_rows(ds_cu *c, int blocks_per_sm) {
    c->f8_rows = c->f8_moe_rows = blocks_per_sm;
}

extern "C" void ds_cu_set_f8_moe_rows(ds_cu *c, int blocks_per_sm) {
    c->f8_moe_rows = blocks_per_sm;
}

extern "C" void ds_cu_set_f8_noquant(ds_cu *c, int on) {
    c->f8_noquant = on;
}

extern "C" void ds_cu_set_f8_gemv_waves(ds_cu *c, int blocks_per_sm) {
    c->f8_gemv_waves = blocks_per_sm;
}

extern "C" void ds_cu_set_gemv_max_t(ds_cu *c, int rows) {
    c->gemv_max_t = rows;
}

/* up to how many rows ds_cu_matmul and ds_cu_matmul_heads stream their weights */
static int gemv_rows_max(const ds_cu *c) {
    return c->gemv_max_t > 0 ? c->gemv_max_t : GEMV_MAX_T;
}

/* A stack of mixed dtypes: each run writes its own output columns of y. */
static int matmul_runs(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                       const ds_cu_mat *w, ds_err *err) {
    int row = 0;
    for (int i = 0; i < w->n_runs; i++) {
        if (ds_cu_matmul(c, y + row, ldy, x, ldx, T, &w->runs[i], err)) return DS_ERR;
        row += w->runs[i].rows;
    }
    return DS_OK;
}

static int matmul_one(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                      const ds_cu_mat *w, ds_err *err);

extern "C" int ds_cu_matmul(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                            const ds_cu_mat *w, ds_err *err) {
    if (T <= 0 || w->rows <= 0) return DS_OK;
    if (w->runs) return matmul_runs(c, y, ldy, x, ldx, T, w, err);
    /* a weight stream: its first bytes prefetched into L2 while what runs before it finishes
     * (ds_cu_set_l2_prefetch) */
    const int stream = T <= gemv_rows_max(c) && (w->dtype == DS_CU_BF16 || w->dtype == DS_CU_FP8);
    if (stream && cu_l2_prefetch(c, w->data,
                                 (size_t)w->rows * w->cols * (w->dtype == DS_CU_BF16 ? 2 : 1), err))
        return DS_ERR;
    if (matmul_one(c, y, ldy, x, ldx, T, w, err)) return DS_ERR;
    return stream ? ds_cu_l2_mark(c, err) : DS_OK;
}

static int matmul_one(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                      const ds_cu_mat *w, ds_err *err) {
    const int N = w->rows, K = w->cols;
    if (w->dtype == DS_CU_FP8)
        return matmul_fp8(c, y, ldy, x, ldx, T, w, T <= gemv_rows_max(c) || c->batch_invariant,
                          err);
    if (w->dtype != DS_CU_BF16)
        return ds_errf(err, "cuda: matmul: a %d x %d matrix of dtype %d", N, K, w->dtype);
    const int vec =
        K % 8 == 0 && ldx % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)w->data % 16 == 0;
    if (vec && T == 1 && c->gemv_wide && gemv_splits(c, N, K, 1) == 1 && (size_t)K * 4 <= 48 * 1024)
        return gemv_wide(c, y, x, w->data, N, K, err);
    if (vec && (T <= gemv_rows_max(c) || c->batch_invariant))
        return gemv_tiles(c, y, ldy, x, ldx, T, w->data, N, K, 1, 0, 0, 0, err);
    if (c->batch_invariant) {
        for (int t0 = 0; t0 < T; t0 += 65535)
            launch_k(c, gemv_any_k, dim3((unsigned)((N + 7) / 8), (unsigned)DS_MIN(T - t0, 65535)),
                     256, 0, y + (size_t)t0 * ldy, ldy, x + (size_t)t0 * ldx, ldx, w->data, N, K);
        CU_TRY(cudaGetLastError(), "matmul (gemv, any shape)");
        return DS_OK;
    }
    const uint16_t *xb = round_x(c, x, ldx, K, T, err);
    if (!xb) return DS_ERR;
    /* Row-major y[T][N] is column-major N x T; W[N][K] row-major is column-major K x N, so
     * Y = W^T X with X = xb column-major K x T. */
    const float one = 1.0f, zero = 0.0f;
    const char *prof = prof_gemm_open(c);
    BLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, w->data, CUDA_R_16BF, K,
                          xb, CUDA_R_16BF, K, &zero, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             "matmul");
    prof_gemm_close(c, prof, 2.0 * N * K * T);
    return DS_OK;
}

extern "C" int ds_cu_matmul_heads(ds_cu *c, float *y, int ldy, size_t ys, const float *x, int ldx,
                                  size_t xs, int T, const ds_cu_mat *w, size_t ws, int H,
                                  ds_err *err) {
    const int N = w->rows, K = w->cols;
    if (T <= 0 || N <= 0 || H <= 0) return DS_OK;
    if (w->dtype != DS_CU_BF16 || w->runs) { /* head by head; FP8 scales: N a head */
        const size_t esz = w->dtype == DS_CU_FP8 ? 1 : 2;
        if (w->runs || w->dtype != DS_CU_FP8 || ws % (size_t)K)
            return ds_errf(err, "cuda: per-head matmul of dtype %d", w->dtype);
        for (int h = 0; h < H; h++) {
            ds_cu_mat wh = *w;
            wh.data = (const uint16_t *)((const uint8_t *)w->data + (size_t)h * ws * esz);
            wh.scale = (const float *)w->scale + (size_t)h * (ws / (size_t)K);
            if (ds_cu_matmul(c, y + (size_t)h * ys, ldy, x + (size_t)h * xs, ldx, T, &wh, err))
                return DS_ERR;
        }
        return DS_OK;
    }
    const int vec = K % 8 == 0 && ldx % 4 == 0 && xs % 4 == 0 && ws % 8 == 0 &&
                    (uintptr_t)x % 16 == 0 && (uintptr_t)w->data % 16 == 0;
    if (vec && (T <= gemv_rows_max(c) || c->batch_invariant))
        return gemv_tiles(c, y, ldy, x, ldx, T, w->data, N, K, H, ys, xs, ws, err);
    if (c->batch_invariant || (size_t)ldx < (size_t)(H - 1) * xs + K) {
        for (int h = 0; h < H; h++) { /* head by head, through the plain matmul */
            ds_cu_mat wh = {w->data + (size_t)h * ws, N, K, DS_CU_BF16, NULL, NULL, 0};
            if (ds_cu_matmul(c, y + (size_t)h * ys, ldy, x + (size_t)h * xs, ldx, T, &wh, err))
                return DS_ERR;
        }
        return DS_OK;
    }
    /* every head's rows of x in BF16 at once, then one strided-batched GEMM */
    const uint16_t *xb = round_x(c, x, ldx, ldx, T, err);
    if (!xb) return DS_ERR;
    const float one = 1.0f, zero = 0.0f;
    const char *prof = prof_gemm_open(c);
    BLAS_TRY(cublasGemmStridedBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, w->data,
                                        CUDA_R_16BF, K, (long long)ws, xb, CUDA_R_16BF, ldx,
                                        (long long)xs, &zero, y, CUDA_R_32F, ldy, (long long)ys, H,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             "matmul (heads)");
    prof_gemm_close(c, prof, 2.0 * N * K * T * H);
    return DS_OK;
}

extern "C" int ds_cu_gemm_bf16(ds_cu *c, uint16_t *C, const uint16_t *A, const uint16_t *B, int m,
                               int n, int k, ds_err *err) {
    /* Row-major C[m][n] = A[m][k] B[n][k]^T  <=>  column-major C^T (n x m) = B A^T. */
    const float one = 1.0f, zero = 0.0f;
    BLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, B, CUDA_R_16BF, k, A,
                          CUDA_R_16BF, k, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             "gemm");
    return DS_OK;
}

extern "C" void ds_cu_set_gemv_wide(ds_cu *c, int on) {
    c->gemv_wide = on;
}
