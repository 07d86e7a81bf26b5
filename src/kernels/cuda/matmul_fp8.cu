/* matmul_fp8.cu — products with ptpc FP8 weights (docs/quantization.md): the activations'
 * per-token quantizer, the weight-streaming FP8 kernel (decode, batch invariance), FP8 tensor
 * cores through cuBLASLt with the scales applied after, and the weights' quantizer (load time).
 *
 * Every term e4m3(x) * e4m3(w) is exact in f32, so the sums differ from the CPU's
 * (kernels/cpu/matmul_quant.c) only in their order; both then apply (sum * s_t) * s_r. */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/quant.h"

#include <cublasLt.h>
#include <cuda_fp8.h>

/* the streaming kernels' activations are the codes' values times this (see e4m3_raw) */
#define FP8_X_SCALE 0x1p119f

/* ---- quantizers -------------------------------------------------------------------------------
 * One block a row (grid-stride over rows). The scale and codes are ds_ptpc_quantize's: the
 * largest magnitude is exact whatever the order of the maxima, 1.0f / s is IEEE division (the
 * build has no fast math), and the codes come from quant.h's one definition. */

/* Activations: s[t] and codes xq [T][ldq] (columns [K, ldq) zero), or with xf the codes' values
 * times FP8_X_SCALE in BF16 (exact: four significant bits), xf [T][K] (the streaming kernels'
 * operand: half the bytes of f32, which every warp re-reads), instead. */
__global__ void __launch_bounds__(256) ptpc_act_k(uint8_t *xq, int ldq, uint16_t *xf, float *s,
                                                  const float *x, int ldx, int T, int K) {
    PDL_ENTRY();
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *xr = x + (size_t)t * ldx;
        float amax = 0.0f;
        for (int c = threadIdx.x; c < K; c += blockDim.x) amax = fmaxf(amax, fabsf(xr[c]));
        amax = block_max(amax);
        const float st = ds_ptpc_scale(amax), inv = 1.0f / st;
        if (threadIdx.x == 0) s[t] = st;
        if (xf) {
            for (int c = threadIdx.x; c < K; c += blockDim.x)
                xf[(size_t)t * K + c] =
                    (uint16_t)(ds_f32_bits(ds_e4m3_to_f32(ds_f32_to_e4m3(xr[c] * inv)) *
                                           FP8_X_SCALE) >>
                               16); /* exact: the low bits are zero */
        } else {
            for (int c = threadIdx.x; c < ldq; c += blockDim.x)
                xq[(size_t)t * ldq + c] = c < K ? ds_f32_to_e4m3(xr[c] * inv) : (uint8_t)0;
        }
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
            codes[(size_t)r * nc + c] =
                ds_f32_to_e4m3(__uint_as_float((uint32_t)sr[c0 + c] << 16) * inv);
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
 * gemv_bf16_k's form with FP8 weights: one warp a row (S warps sharing a short matrix's row,
 * their partial sums added in order p = 0, 1, ..), 16-byte loads of 16 codes each widened exactly
 * (E4M3 -> F16 -> F32, both exact), the activations' f32 code values (xf) served by L1. The
 * order of a token's operations does not depend on T, so batch invariance holds. */

/* The streaming kernels widen codes with integer operations rather than the conversion units
 * (E4M3 -> F16 -> F32 took three conversions a pair and bound the kernel well below the copy
 * rate): the code's low seven bits placed at bit 20 of an f32 give its magnitude times 2^-120
 * (subnormal codes as f32 subnormals, exact), the sign goes to bit 31. The activations' values
 * come scaled by 2^119 (ptpc_act_k's xf: at most 448 * 2^119, finite), so each product is the
 * exact term times 1/2 and every partial sum is the unscaled one times 1/2 (all in f32's normal
 * range): the result, doubled, has the bits of the unscaled f32 sums. */

/* code j (0..3) of a word as its value times 2^-120 */
template <int J> static __device__ __forceinline__ float e4m3_raw(uint32_t w) {
    const uint32_t mag = J < 3 ? (w << (20 - 8 * J)) : (w >> 4);
    const uint32_t sgn = J < 3 ? (w << (24 - 8 * J)) : w;
    return __uint_as_float((mag & 0x07f00000u) | (sgn & 0x80000000u));
}

/* 16 E4M3 codes dotted with 16 scaled BF16 values (x 16-byte aligned), in a fixed order */
static __device__ __forceinline__ float dot16_e4m3(uint4 u, const uint16_t *x) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
    const uint4 xa = ((const uint4 *)x)[0], xb = ((const uint4 *)x)[1];
    const uint32_t xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint32_t p = xv[2 * i], q = xv[2 * i + 1];
        acc += e4m3_raw<0>(w[i]) * __uint_as_float(p << 16) +
               e4m3_raw<1>(w[i]) * __uint_as_float(p & 0xffff0000u) +
               e4m3_raw<2>(w[i]) * __uint_as_float(q << 16) +
               e4m3_raw<3>(w[i]) * __uint_as_float(q & 0xffff0000u);
    }
    return acc;
}

template <int TT>
__global__ void __launch_bounds__(256)
    gemv_fp8_k(float *y, int ldy, const uint16_t *xf, const float *st, const uint8_t *W,
               const float *sr, int N, int K, int S) {
    __shared__ float red[8][TT]; /* [warp][token] partial sums (S > 1) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * (8 / S) + warp / S, part = warp % S, nk = K / 16, step = 32 * S;
    const int k0 = lane + 32 * part;
    /* the weights are no earlier kernel's output: the first pieces load before the wait */
    enum { PRE = 2 };
    const uint4 *wr = (const uint4 *)(W + (size_t)min(n, N - 1) * K);
    uint4 pre[PRE];
#pragma unroll
    for (int i = 0; i < PRE; i++)
        if (k0 + step * i < nk) pre[i] = __ldg(wr + k0 + step * i);
    PDL_ENTRY();
    if (S == 1 && n >= N) return;
    xf += (size_t)blockIdx.y * TT * K;
    st += (size_t)blockIdx.y * TT;
    y += (size_t)blockIdx.y * TT * ldy;
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
#pragma unroll
    for (int i = 0; i < PRE; i++) {
        const int k16 = k0 + step * i;
        if (k16 < nk)
#pragma unroll
            for (int t = 0; t < TT; t++)
                acc[t] += dot16_e4m3(pre[i], xf + (size_t)t * K + k16 * 16);
    }
#pragma unroll 4
    for (int k16 = k0 + step * PRE; k16 < nk; k16 += step) {
        const uint4 u = __ldg(wr + k16);
#pragma unroll
        for (int t = 0; t < TT; t++) acc[t] += dot16_e4m3(u, xf + (size_t)t * K + k16 * 16);
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (S == 1) {
            if (lane == 0) y[(size_t)t * ldy + n] = ((v * 2.0f) * st[t]) * sr[n];
        } else if (lane == 0) {
            red[warp][t] = v;
        }
    }
    if (S == 1) return;
    __syncthreads();
    if (part == 0 && lane < TT && n < N) {
        float v = 0.0f;
        for (int p = 0; p < S; p++) v += red[warp + p][lane];
        y[(size_t)lane * ldy + n] = ((v * 2.0f) * st[lane]) * sr[n];
    }
}

/* Any K and alignment, one code at a time (a warp a row, a token a block row): the fallback. */
__global__ void __launch_bounds__(256)
    gemv_fp8_any_k(float *y, int ldy, const uint16_t *xf, const float *st, const uint8_t *W,
                   const float *sr, int N, int K) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, n = blockIdx.x * 8 + (threadIdx.x >> 5), t = blockIdx.y;
    if (n >= N) return;
    const uint8_t *wr = W + (size_t)n * K;
    const uint16_t *xt = xf + (size_t)t * K;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32)
        acc += e4m3_raw<0>(wr[k]) * __uint_as_float((uint32_t)xt[k] << 16);
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[(size_t)t * ldy + n] = ((acc * 2.0f) * st[t]) * sr[n];
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

/* Warps a row, as matmul.cu's gemv_splits: a function of the matrix alone. */
static int fp8_splits(const ds_cu *c, int N, int K) {
    const long want = 32L * c->n_sm;
    int S = 1;
    while (S < 8 && (long)N * S < want && K / 16 >= 32 * 2 * S) S *= 2;
    return S;
}

static int fp8_gemv(ds_cu *c, float *y, int ldy, const uint16_t *xf, const float *st, int T,
                    const ds_cu_mat *w, ds_err *err) {
    const int N = w->rows, K = w->cols;
    const uint8_t *W = (const uint8_t *)w->data;
    const float *sr = (const float *)w->scale;
    if (K % 16 || (uintptr_t)W % 16) {
        for (int t0 = 0; t0 < T; t0 += 65535)
            launch_k(c, gemv_fp8_any_k,
                     dim3((unsigned)((N + 7) / 8), (unsigned)DS_MIN(T - t0, 65535)), 256, 0,
                     y + (size_t)t0 * ldy, ldy, xf + (size_t)t0 * K, st + t0, W, sr, N, K);
        CU_TRY(cudaGetLastError(), "matmul fp8 (gemv, any shape)");
        return DS_OK;
    }
    const int S = fp8_splits(c, N, K);
    const unsigned blocks = (unsigned)((N + 8 / S - 1) / (8 / S));
    const int full = T / 8, rem = T % 8;
    for (int t0 = 0; t0 < full * 8; t0 += 8 * 65535)
        launch_k(c, gemv_fp8_k<8>, dim3(blocks, (unsigned)DS_MIN(full - t0 / 8, 65535)), 256, 0,
                 y + (size_t)t0 * ldy, ldy, xf + (size_t)t0 * K, st + t0, W, sr, N, K, S);
    const size_t t0 = (size_t)full * 8;
    float *yr = y + t0 * ldy;
    const uint16_t *xr = xf + t0 * K;
    const float *sr_t = st + t0;
#define FP8_REM(TT)                                                                                \
    launch_k(c, gemv_fp8_k<TT>, dim3(blocks, 1), 256, 0, yr, ldy, xr, sr_t, W, sr, N, K, S)
    switch (rem) {
    case 0:
        break;
    case 1:
        FP8_REM(1);
        break;
    case 2:
        FP8_REM(2);
        break;
    case 3:
        FP8_REM(3);
        break;
    case 4:
        FP8_REM(4);
        break;
    case 5:
        FP8_REM(5);
        break;
    case 6:
        FP8_REM(6);
        break;
    default:
        FP8_REM(7);
        break;
    }
#undef FP8_REM
    CU_TRY(cudaGetLastError(), "matmul fp8 (gemv)");
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

static int fp8_gemm(ds_cu *c, float *y, int ldy, const uint8_t *xq, const float *st, int T,
                    const ds_cu_mat *w, int *done, ds_err *err) {
    *done = 0;
    const int N = w->rows, K = w->cols;
    /* FP8 tensor cores want 16-byte aligned operands and rows (else: the streaming kernel) */
    if ((uintptr_t)y % 16 || ldy % 4 || (uintptr_t)xq % 16) return DS_OK;
    if (!c->lt) {
        fp8_lt *l = (fp8_lt *)calloc(1, sizeof *l);
        if (!l || cublasLtCreate(&l->h) != CUBLAS_STATUS_SUCCESS) {
            free(l);
            return DS_OK; /* no cuBLASLt: the streaming kernel */
        }
        c->lt = l;
    }
    cublasLtHandle_t h = ((fp8_lt *)c->lt)->h;
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
    const int8_t fast = 0;
    void *ws = c->on_side ? c->blas_ws_side : c->blas_ws;
    const size_t ws_bytes = (size_t)32 << 20; /* context.cu's cuBLAS workspace, same stream */
    cublasLtMatmulHeuristicResult_t res;
    int found = 0, ok = 0;
    if (cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA) == 0 &&
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB) == 0 &&
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast) ==
            0 &&
        cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, N, K) == 0 &&
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, T, K) == 0 &&
        cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, N, T, ldy) == 0 &&
        cublasLtMatmulPreferenceCreate(&pref) == 0 &&
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &ws_bytes, sizeof ws_bytes) == 0 &&
        cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &res, &found) == 0 &&
        found > 0)
        ok = 1;
    cublasStatus_t st_run = CUBLAS_STATUS_SUCCESS;
    if (ok) {
        const float one = 1.0f, zero = 0.0f;
        const char *prof = prof_gemm_open(c);
        st_run = cublasLtMatmul(h, op, &one, w->data, la, xq, lb, &zero, y, ld, y, ld, &res.algo,
                                ws, ws_bytes, c->stream);
        prof_gemm_close(c, prof, 2.0 * N * K * T);
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    if (!ok || st_run == CUBLAS_STATUS_NOT_SUPPORTED) return DS_OK; /* the streaming kernel */
    if (st_run != CUBLAS_STATUS_SUCCESS)
        return ds_errf(err, "cublasLt: matmul fp8 %d x %d x %d: status %d", N, T, K, (int)st_run);
    launch_k(c, fp8_scale_k, dim3((unsigned)((N + 255) / 256), (unsigned)DS_MIN(T, 65535)), 256, 0,
             y, ldy, st, (const float *)w->scale, N, T);
    CU_TRY(cudaGetLastError(), "matmul fp8 (scales)");
    *done = 1;
    return DS_OK;
}

/* ds_cu_matmul for an FP8 w (matmul.cu hands it here); stream: up to how many rows the weights
 * stream (or always, with batch invariance). */
int matmul_fp8(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T, const ds_cu_mat *w,
               int stream, ds_err *err) {
    const int K = w->cols;
    const int tc = !stream && K % 16 == 0 && (uintptr_t)w->data % 16 == 0;
    /* scratch (per stream: the side stream has its own): s [T] f32, then xq [T][K] codes for the
     * tensor cores or xf [T][K] scaled BF16 values for the streaming kernel */
    const size_t s_bytes = ((size_t)T * 4 + 255) & ~(size_t)255;
    const size_t need = s_bytes + (size_t)T * K * (tc ? 1 : 2);
    if (grow_scratch(c, (void **)&c->xb, &c->xb_bytes, need, "matmul scratch", err)) return DS_ERR;
    float *st = (float *)c->xb;
    void *xbuf = (char *)c->xb + s_bytes;
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
    return fp8_gemv(c, y, ldy, (const uint16_t *)xbuf, st, T, w, err);
}
