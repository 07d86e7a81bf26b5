/* matmul_fp8.cu — products with ptpc FP8 weights (docs/quantization.md): the activations'
 * per-token quantizer, the weight-streaming FP8 kernel (decode, batch invariance), FP8 tensor
 * cores through cuBLASLt with the scales applied after, and the weights' quantizer (load time).
 *
 * Every term e4m3(x) * e4m3(w) is exact in f32, so the sums differ from the CPU's
 * (kernels/cpu/matmul_quant.c) only in their order; both then apply (sum * s_t) * s_r. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_rows.cuh"
#include "kernels/cuda/lt.cuh"
#include "kernels/cuda/fp8_stream.cuh"
#include "kernels/shared/quant.h"

#include <cuda_fp8.h>

/* Activations: s[t] and codes xq [T][ldq] (columns [K, ldq) zero) for the tensor cores, or with
 * xh the codes' values in F16 (exact), xh [T][K] (the streaming kernels' operand), instead. */
__global__ void __launch_bounds__(256) ptpc_act_k(uint8_t *xq, int ldq, uint16_t *xh, float *s,
                                                  const float *x, int ldx, int T, int K) {
    PDL_ENTRY();
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *xr = x + (size_t)t * ldx;
        if (xh) {
            const float st = f8_quant_row(xh + (size_t)t * K, K, [xr](int c) { return xr[c]; });
            if (threadIdx.x == 0) s[t] = st;
            continue;
        }
        float amax = 0.0f;
        for (int c = threadIdx.x; c < K; c += blockDim.x) amax = fmaxf(amax, fabsf(xr[c]));
        amax = block_max(amax);
        const float st = ds_ptpc_scale(amax), inv = 1.0f / st;
        if (threadIdx.x == 0) s[t] = st;
        for (int c = threadIdx.x; c < ldq; c += blockDim.x)
            xq[(size_t)t * ldq + c] = c < K ? f8_code(xr[c] * inv) : (uint8_t)0;
    }
}

/* Weights (BF16 rows of full_cols): scale over the whole row, codes of columns [c0, c0 + nc). */
__global__ void __launch_bounds__(256)
    ptpc_weight_k(uint8_t *codes, float *scales, const uint16_t *src, int rows, int full_cols,
                  int c0, int nc) {
    PDL_ENTRY();
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const uint16_t *sr = src + (size_t)r * full_cols;
        float amax = 0.0f;
        for (int c = threadIdx.x; c < full_cols; c += blockDim.x)
            amax = fmaxf(amax, fabsf(__uint_as_float((uint32_t)sr[c] << 16)));
        amax = block_max(amax);
        const float st = ds_ptpc_scale(amax), inv = 1.0f / st;
        if (threadIdx.x == 0) scales[r] = st;
        for (int c = threadIdx.x; c < nc; c += blockDim.x)
            codes[(size_t)r * nc + c] = f8_code(__uint_as_float((uint32_t)sr[c0 + c] << 16) * inv);
    }
}

extern "C" int ds_cu_ptpc_quantize_bf16(ds_cu *c, uint8_t *codes, float *scales,
                                        const uint16_t *src, int rows, int full_cols, int c0,
                                        int nc, ds_err *err) {
    if (rows <= 0 || nc <= 0) return DS_OK;
    launch_k(c, ptpc_weight_k, (unsigned)DS_MIN(rows, 1 << 16), 256, 0, codes, scales, src, rows,
             full_cols, c0, nc);
    CU_TRY(cudaGetLastError(), "ptpc: weights");
    return DS_OK;
}

extern "C" int ds_cu_ptpc_quantize_act(ds_cu *c, uint8_t *xq, int ldq, float *s, const float *x,
                                       int ldx, int T, int K, ds_err *err) {
    if (T <= 0) return DS_OK;
    launch_k(c, ptpc_act_k, (unsigned)DS_MIN(T, 1 << 16), 256, 0, xq, ldq, (uint16_t *)NULL, s, x,
             ldx, T, K);
    CU_TRY(cudaGetLastError(), "ptpc: activations");
    return DS_OK;
}

/* ---- the streaming kernel ---------------------------------------------------------------------
 * fp8_stream.cuh's tiles: a warp a 16-row tile (S warps along K, their partial sums added in the
 * order p = 0, 1, ..), a block row's pass up to 8 tokens as the mma's columns. With xh NULL the
 * block quantizes its tokens' rows itself into shared memory (f8_quant_row, the same values
 * ptpc_act_k writes): a decode step's product is then one kernel, whose first weights load before
 * its wait. A token's sum takes the same steps whatever else the pass holds (batch invariance). */
__global__ void __launch_bounds__(256)
    gemv_f8m_k(float *y, int ldy, const float *x, int ldx, const uint16_t *xh, const float *xs,
               const uint8_t *W, const float *sr, int N, int K, int S, int T, int noq) {
    extern __shared__ uint4 f8_xdyn[]; /* [nt][K] F16 code values of the pass's tokens (no xh) */
    __shared__ float4 red[8][32];      /* [warp][lane] partial sums (S > 1) */
    __shared__ float st_sh[8];         /* the pass's token scales (no xh) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, l4 = lane & 3;
    const int part = warp % S, t0 = blockIdx.y * 8, nt = min(8, T - t0);
    const int nb = ((N + 15) / 16 + 8 / S - 1) / (8 / S); /* blocks' worth of tiles */
    uint4 a[F8_U][2];
    {
        const f8_trows r = f8_tile_rows(W, 0, N, K, S, blockIdx.x);
        f8_load(a, r.w0, r.w1, part, S, K / 64);
    }
    PDL_ENTRY();
    const uint16_t *xb = xh ? xh + (size_t)t0 * K : (const uint16_t *)f8_xdyn;
    const float *st = xh ? xs + t0 : st_sh;
    if (!xh) {
        for (int t = 0; t < nt && !noq; t++) {
            const float *xr = x + (size_t)(t0 + t) * ldx;
            const float s =
                f8_quant_row((uint16_t *)f8_xdyn + (size_t)t * K, K, [xr](int c) { return xr[c]; });
            if (threadIdx.x == 0) st_sh[t] = s;
        }
        if (noq && threadIdx.x < nt) st_sh[threadIdx.x] = 1.0f; /* (a what-if: codes unset) */
        __syncthreads();
    }
    const uint4 *xr = g < nt ? (const uint4 *)(xb + (size_t)g * K) + 2 * l4 : NULL;
    /* (a grid smaller than nb, when the block quantizes: each block's tiles one after another;
     * the next tile's first steps are requested before this one's sums are added) */
    for (int b = blockIdx.x; b < nb; b += gridDim.x) {
        const int n0 = (b * (8 / S) + warp / S) * 16 + g, n1 = n0 + 8;
        const f8_trows r = f8_tile_rows(W, 0, N, K, S, b);
        const uint4 *w0 = r.w0, *w1 = r.w1;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        f8_tile(acc, a, w0, w1, xr, part, S, K, l4);
        if (b + (int)gridDim.x < nb) {
            const f8_trows m = f8_tile_rows(W, 0, N, K, S, b + gridDim.x);
            f8_load(a, m.w0, m.w1, part, S, K / 64);
        }
        if (!f8_split_sum(acc, red, S, part)) continue;
#pragma unroll
        for (int j = 0; j < 2; j++) { /* C: rows g (acc 0, 1), g + 8 (2, 3); columns 2 l4 + j */
            const int t = 2 * l4 + j;
            if (t >= nt) continue;
            float *yr = y + (size_t)(t0 + t) * ldy;
            if (n0 < N) yr[n0] = (acc[j] * st[t]) * sr[n0];
            if (n1 < N) yr[n1] = (acc[2 + j] * st[t]) * sr[n1];
        }
    }
}

/* One token, a warp a row (fp8_rows.cuh; batch invariance off): each block quantizes the token
 * into shared memory (or reads the codes xh, scale *xs, a norm wrote), then its warps take R rows
 * at a time, grid-stride, the next rows' first pieces requested before this one's sums are added.
 */
template <int R, int U>
__global__ void __launch_bounds__(256, 4)
    gemv_f8r_k(float *y, const float *x, const uint16_t *xh, const float *xs, const uint8_t *W,
               const float *sr, int N, int K) {
    extern __shared__ float4 f8r_x4[]; /* [f8r_smem(K) / 16] the token's values times 2^64, in
                                          f8r_xidx's order */
    __shared__ float st_sh;
    const int n = ((int)blockIdx.x * 8 + (threadIdx.x >> 5)) * R;
    const uint4 *w[R];
    uint4 a[U][R];
    f8r_point<R>(w, W, n, N, K);
    f8r_load<R, U>(a, w, K / 16, threadIdx.x & 31);
    PDL_ENTRY();
    const float st = f8r_stage(f8r_x4, &st_sh, K, xh, xs, [x](int c) { return x[c]; });
    f8r_walk<R, U>(y, W, sr, N, K, n, (int)gridDim.x * 8 * R, st, w, a, f8r_x4);
}

/* Any K and alignment, one code at a time (a warp a row, a token a block row): the fallback. */
__global__ void __launch_bounds__(256)
    gemv_fp8_any_k(float *y, int ldy, const uint16_t *xh, const float *st, const uint8_t *W,
                   const float *sr, int N, int K) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, n = blockIdx.x * 8 + (threadIdx.x >> 5), t = blockIdx.y;
    if (n >= N) return;
    const uint8_t *wr = W + (size_t)n * K;
    const uint16_t *xt = xh + (size_t)t * K;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32)
#ifdef DS_F8_MMA_E4M3 /* (the operand holds the codes: f8_x_put) */
        acc +=
            ds_e4m3_to_f32(wr[k]) * ds_e4m3_to_f32(((const uint8_t *)xt)[2 * (k & ~15) + (k & 15)]);
#else
        acc += ds_e4m3_to_f32(wr[k]) * __half2float(__ushort_as_half(xt[k]));
#endif
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[(size_t)t * ldy + n] = (acc * st[t]) * sr[n];
}

/* y[t][r] = (y[t][r] * s_t) * s_r after the tensor cores' unit-scale product */
__global__ void fp8_scale_k(float *y, int ldy, const float *st, const float *sr, int N, int T) {
    PDL_ENTRY();
    for (int t = blockIdx.y; t < T; t += gridDim.y)
        for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < N; r += gridDim.x * blockDim.x) {
            float *o = y + (size_t)t * ldy + r;
            *o = (*o * st[t]) * sr[r];
        }
}

/* Shared memory for a pass that quantizes its own tokens, at most (else ptpc_act_k first). */
enum : size_t { F8_XSH_MAX = 36 * 1024 };

/* y = x W^T through the streaming kernels; xh/st: x already quantized (NULL: T <= 8 tokens whose
 * rows fit F8_XSH_MAX, quantized by the kernel). */
static int fp8_gemv(ds_cu *c, float *y, int ldy, const float *x, int ldx, const uint16_t *xh,
                    const float *st, int T, const ds_cu_mat *w, ds_err *err) {
    const int N = w->rows, K = w->cols;
    const uint8_t *W = (const uint8_t *)w->data;
    const float *sr = (const float *)w->scale;
    if (K % 16 || (uintptr_t)W % 16) {
        for (int t0 = 0; t0 < T; t0 += 65535)
            launch_k(c, gemv_fp8_any_k,
                     dim3((unsigned)((N + 7) / 8), (unsigned)DS_MIN(T - t0, 65535)), 256, 0,
                     y + (size_t)t0 * ldy, ldy, xh + (size_t)t0 * K, st + t0, W, sr, N, K);
        CU_TRY(cudaGetLastError(), "matmul fp8 (gemv, any shape)");
        return DS_OK;
    }
    const int S = f8_splits_for(c, N, K, T);
    /* blocks' worth of tiles; a block that quantizes its tokens does so once, for as many tiles
     * as one wave of blocks (two a multiprocessor) leaves it */
    unsigned bx = (unsigned)(((N + 15) / 16 + 8 / S - 1) / (8 / S));
    if (!xh) bx = DS_MIN(bx, (unsigned)((c->f8_gemv_waves > 0 ? c->f8_gemv_waves : 2) * c->n_sm));
    const size_t smem = xh ? 0 : ((size_t)T * K * 2 + 15) / 16 * 16;
    for (int t0 = 0; t0 < T; t0 += 8 * 65535)
        launch_k(c, gemv_f8m_k, dim3(bx, (unsigned)DS_MIN((T - t0 + 7) / 8, 65535)), 256, smem,
                 y + (size_t)t0 * ldy, ldy, x + (size_t)t0 * ldx, ldx,
                 xh ? xh + (size_t)t0 * K : (const uint16_t *)NULL, xh ? st + t0 : st, W, sr, N, K,
                 S, T - t0, c->f8_noquant);
    CU_TRY(cudaGetLastError(), "matmul fp8 (gemv)");
    return DS_OK;
}

/* One token a warp a row (gemv_f8r_k): xh/xs the codes a norm wrote, or NULL (the blocks
 * quantize x). Whether it applies: f8r_fits. */
static int fp8_rows(ds_cu *c, float *y, const float *x, const uint16_t *xh, const float *xs,
                    const ds_cu_mat *w, ds_err *err) {
    const int N = w->rows, K = w->cols, per_sm = c->f8_rows > 0 ? c->f8_rows : 4;
    const uint8_t *W = (const uint8_t *)w->data;
    const float *sr = (const float *)w->scale;
    const size_t smem = f8r_smem(K);
#define F8R_LAUNCH(R, U)                                                                           \
    launch_k(c, gemv_f8r_k<R, U>, (unsigned)DS_MIN((N + 8 * (R)-1) / (8 * (R)), per_sm * c->n_sm), \
             256, smem, y, x, xh, xs, W, sr, N, K)
    F8R_DISPATCH(K, F8R_LAUNCH);
#undef F8R_LAUNCH
    CU_TRY(cudaGetLastError(), "matmul fp8 (a warp a row)");
    return DS_OK;
}

/* ---- FP8 tensor cores through cuBLASLt --------------------------------------------------------
 * Row-major y[T][N] is column-major N x T = W (K x N column-major, transposed) times xq (K x T
 * column-major): the TN layout FP8 needs. Unit scales and f32 output, then fp8_scale_k. The
 * handle is made at the first such product (never inside a capture: the engine runs every shape
 * eagerly first). */
struct fp8_lt {
    cublasLtHandle_t h;
};

extern "C" void fp8_free(ds_cu *c) {
    if (!c->lt) return;
    cublasLtDestroy(((fp8_lt *)c->lt)->h);
    free(c->lt);
    c->lt = NULL;
}

void *lt_handle(ds_cu *c) {
    if (!c->lt) {
        fp8_lt *l = (fp8_lt *)calloc(1, sizeof *l);
        if (!l || cublasLtCreate(&l->h) != CUBLAS_STATUS_SUCCESS) {
            free(l);
            return NULL;
        }
        c->lt = l;
    }
    return (void *)((fp8_lt *)c->lt)->h;
}

static int fp8_gemm(ds_cu *c, float *y, int ldy, const uint8_t *xq, const float *st, int T,
                    const ds_cu_mat *w, int *done, ds_err *err) {
    *done = 0;
    const int N = w->rows, K = w->cols;
    /* FP8 tensor cores want 16-byte aligned operands and rows (else: the streaming kernel) */
    if ((uintptr_t)y % 16 || ldy % 4 || (uintptr_t)xq % 16) return DS_OK;
    cublasLtHandle_t h = (cublasLtHandle_t)lt_handle(c);
    if (!h) return DS_OK; /* no cuBLASLt: the streaming kernel */
    const int32_t vec = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    const void *sa = w->scale, *sb = st;
    cublasStatus_t st_run = CUBLAS_STATUS_SUCCESS;
    int scaled = 0; /* the scales applied by cuBLASLt itself */
    /* pass 0: the row and token scales as cuBLASLt's outer-vector scales (applied as it writes
     * y: no second pass over it); pass 1 (no such algorithm, or f8_lt_unit): unit scales, then
     * fp8_scale_k */
    for (int pass = c->f8_lt_unit ? 1 : 0; pass < 2 && !*done; pass++) {
        lt_op o;
        cublasLtMatmulHeuristicResult_t res;
        const int ok = lt_make(&o, CUDA_R_8F_E4M3, N, T, K, ldy, CUDA_R_32F) &&
                       (pass == 1 ||
                        (cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                                        &vec, sizeof vec) == 0 &&
                         cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                                        &vec, sizeof vec) == 0 &&
                         cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                        &sa, sizeof sa) == 0 &&
                         cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                        &sb, sizeof sb) == 0)) &&
                       lt_algo(h, &o, &res);
        if (ok) {
            const float one = 1.0f, zero = 0.0f;
            const char *prof = prof_gemm_open(c);
            st_run = cublasLtMatmul(h, o.op, &one, w->data, o.la, xq, o.lb, &zero, y, o.ld, y, o.ld,
                                    &res.algo, lt_ws(c), LT_WS, c->stream);
            prof_gemm_close(c, prof, 2.0 * N * K * T);
            /* (an algorithm the heuristic offers but the call refuses: the next pass) */
            if (st_run == CUBLAS_STATUS_SUCCESS) *done = 1, scaled = pass == 0;
        }
        lt_free(&o);
        if (ok && st_run != CUBLAS_STATUS_SUCCESS && st_run != CUBLAS_STATUS_NOT_SUPPORTED &&
            st_run != CUBLAS_STATUS_INVALID_VALUE)
            return ds_errf(err, "cublasLt: matmul fp8 %d x %d x %d: status %d", N, T, K,
                           (int)st_run);
    }
    if (!*done) return DS_OK; /* the streaming kernel */
    c->f8_lt_vec_runs += scaled;
    if (scaled) return DS_OK;
    launch_k(c, fp8_scale_k, dim3((unsigned)((N + 255) / 256), (unsigned)DS_MIN(T, 65535)), 256, 0,
             y, ldy, st, (const float *)w->scale, N, T);
    CU_TRY(cudaGetLastError(), "matmul fp8 (scales)");
    return DS_OK;
}

extern "C" void ds_cu_set_f8_lt_unit(ds_cu *c, int on) {
    c->f8_lt_unit = on;
}

extern "C" long ds_cu_f8_lt_vec_runs(const ds_cu *c) {
    return c->f8_lt_vec_runs;
}

/* ds_cu_matmul for an FP8 w (matmul.cu hands it here); stream: up to how many rows the weights
 * stream (or always, with batch invariance). */
int matmul_fp8(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T, const ds_cu_mat *w,
               int stream, ds_err *err) {
    const int K = w->cols;
    const int mma = K % 16 == 0 && (uintptr_t)w->data % 16 == 0;
    const int tc = !stream && mma;
    /* decode: one kernel, quantizing its tokens as it goes (unless f8_prequant); on wgmma (when
     * asked) every call of up to 8 tokens, within the streaming bound or above it */
    const int wg = fp8_wg_fits(c, T, w->rows, K, w->data);
    if (wg && T == 1 && !c->f8_prequant) /* one token: quantized in every block */
        return fp8_wg(c, y, ldy, x, ldx, (const uint8_t *)NULL, (const float *)NULL, T, w, err);
    if (!tc && T == 1 && f8r_fits(c, c->f8_rows, K, w->data) && !c->f8_prequant)
        return fp8_rows(c, y, x, NULL, NULL, w, err);
    if (!wg && !tc && mma && T <= 8 && (size_t)T * K * 2 <= F8_XSH_MAX && !c->f8_prequant)
        return fp8_gemv(c, y, ldy, x, ldx, (const uint16_t *)NULL, (const float *)NULL, T, w, err);
    /* scratch (per stream: the side stream has its own): s [T] f32, then xq [T][K] codes for the
     * tensor cores and the wgmma form, or xh [T][K] F16 code values for the streaming kernels */
    const size_t s_bytes = ((size_t)T * 4 + 255) & ~(size_t)255;
    const size_t need = s_bytes + (size_t)T * K * (tc || wg ? 1 : 2);
    if (grow_scratch(c, (void **)&c->xb, &c->xb_bytes, need, "matmul scratch", err)) return DS_ERR;
    float *st = (float *)c->xb;
    void *xbuf = (char *)c->xb + s_bytes;
    if (wg) { /* up to 8 tokens: their codes first, each block copying its slice's */
        launch_k(c, ptpc_act_k, (unsigned)T, 256, 0, (uint8_t *)xbuf, K, (uint16_t *)NULL, st, x,
                 ldx, T, K);
        CU_TRY(cudaGetLastError(), "matmul fp8 (activations)");
        return fp8_wg(c, y, ldy, x, ldx, (const uint8_t *)xbuf, st, T, w, err);
    }
    if (tc) {
        launch_k(c, ptpc_act_k, (unsigned)DS_MIN(T, 1 << 16), 256, 0, (uint8_t *)xbuf, K,
                 (uint16_t *)NULL, st, x, ldx, T, K);
        CU_TRY(cudaGetLastError(), "matmul fp8 (activations)");
        int done;
        if (fp8_gemm(c, y, ldy, (const uint8_t *)xbuf, st, T, w, &done, err)) return DS_ERR;
        if (done) return DS_OK;
        /* no tensor-core algorithm: the codes' values for the streaming kernel instead */
        if (grow_scratch(c, (void **)&c->xb, &c->xb_bytes, s_bytes + (size_t)T * K * 2,
                         "matmul scratch", err))
            return DS_ERR;
        st = (float *)c->xb;
        xbuf = (char *)c->xb + s_bytes;
    }
    launch_k(c, ptpc_act_k, (unsigned)DS_MIN(T, 1 << 16), 256, 0, (uint8_t *)NULL, 0,
             (uint16_t *)xbuf, st, x, ldx, T, K);
    CU_TRY(cudaGetLastError(), "matmul fp8 (activations)");
    return fp8_gemv(c, y, ldy, x, ldx, (const uint16_t *)xbuf, st, T, w, err);
}
