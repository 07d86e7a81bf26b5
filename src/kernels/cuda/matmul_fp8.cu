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

/* ---- quantizers -------------------------------------------------------------------------------
 * One block a row (grid-stride over rows). The scale and codes are ds_ptpc_quantize's: the
 * largest magnitude is exact whatever the order of the maxima, 1.0f / s is IEEE division (the
 * build has no fast math), and the codes come from quant.h's one definition. */

/* Activations: s[t] and codes xq [T][ldq] (columns [K, ldq) zero), or with xf the codes' values
 * in F16 (exact), xf [T][K] (the streaming kernel's B operands), instead. */
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
                xf[(size_t)t * K + c] = __half_as_ushort(
                    __float2half_rn(ds_e4m3_to_f32(ds_f32_to_e4m3(xr[c] * inv)))); /* exact */
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
 * Decode is bound by the work of widening codes, not by the bytes (widening in f32 took several
 * integer operations a code), so the weights stream through F16 tensor cores instead: every E4M3
 * value is exact in F16 (one cvt a pair of codes), each product is exact, and the m16n8k16 mma
 * accumulates in f32. A warp takes a tile of 16 rows (S warps sharing a short matrix's tile,
 * their partial sums added in order p = 0, 1, ..) and 8 tokens as the mma's columns: lane
 * 4 g + l4 loads 16 codes of rows g and g + 8 a 64-wide step and token g's same 16 activation
 * values (F16 code values), A and B in one permuted column order. A token's column does not
 * depend on the other columns, so batch invariance holds. */
static __device__ __forceinline__ void mma_16816_f16(float (&d)[4], const uint32_t (&a)[4],
                                                     uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* two E4M3 codes (low byte first) as an F16 pair (exact) */
static __device__ __forceinline__ uint32_t e4m3x2_f16(uint32_t w16) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)w16, __NV_E4M3);
    return (uint32_t)h.x | ((uint32_t)h.y << 16);
}

/* one 64-wide step: codes a0 (row g) and a1 (row g + 8), 16 each; x: token g's 16 values */
static __device__ __forceinline__ void fp8_mma_step(float (&acc)[4], uint4 a0, uint4 a1, uint4 x0,
                                                    uint4 x1) {
    const uint32_t A0[4] = {a0.x, a0.y, a0.z, a0.w}, A1[4] = {a1.x, a1.y, a1.z, a1.w};
    const uint32_t B[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int q = 0; q < 4; q++) { /* codes [4 q, 4 q + 4) of the lane's 16 */
        const uint32_t fr[4] = {e4m3x2_f16(A0[q] & 0xffffu), e4m3x2_f16(A1[q] & 0xffffu),
                                e4m3x2_f16(A0[q] >> 16), e4m3x2_f16(A1[q] >> 16)};
        mma_16816_f16(acc, fr, B[2 * q], B[2 * q + 1]);
    }
}

/* y[t][r] = (sum * st[t]) * sr[r] for tokens [8 blockIdx.y, + 8) below T; xh [T][K] F16 code
 * values; K a multiple of 64, W 16-byte aligned */
__global__ void __launch_bounds__(256)
    gemv_fp8_k(float *y, int ldy, const uint16_t *xh, const float *st, const uint8_t *W,
               const float *sr, int N, int K, int S, int T) {
    __shared__ float4 red[8][32]; /* [warp][lane] partial sums (S > 1) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, l4 = lane & 3;
    const int tile = blockIdx.x * (8 / S) + warp / S, part = warp % S, ns = K / 64;
    const int t0 = blockIdx.y * 8, nt = min(8, T - t0);
    const int r0 = tile * 16 + g, r1 = r0 + 8;
    const uint4 *w0 = (const uint4 *)(W + (size_t)min(r0, N - 1) * K) + l4;
    const uint4 *w1 = (const uint4 *)(W + (size_t)min(r1, N - 1) * K) + l4;
    /* the weights are no earlier kernel's output: the first pieces load before the wait */
    enum { PRE = 2, U = 4 };
    uint4 pa[PRE][2];
#pragma unroll
    for (int i = 0; i < PRE; i++)
        if (part + S * i < ns)
            pa[i][0] = __ldg(w0 + 4 * (part + S * i)), pa[i][1] = __ldg(w1 + 4 * (part + S * i));
    PDL_ENTRY();
    if (S == 1 && tile * 16 >= N) return;
    const bool xv = g < nt;
    const uint4 *xr = (const uint4 *)(xh + (size_t)(t0 + (xv ? g : 0)) * K) + 2 * l4;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < PRE; i++) {
        const int s = part + S * i;
        if (s < ns)
            fp8_mma_step(acc, pa[i][0], pa[i][1], xv ? __ldg(xr + 8 * s) : zero,
                         xv ? __ldg(xr + 8 * s + 1) : zero);
    }
    int s = part + S * PRE;
    for (; s + (U - 1) * S < ns; s += U * S) { /* U steps' loads in flight */
        uint4 a[U][2], xb[U][2];
#pragma unroll
        for (int u = 0; u < U; u++) {
            a[u][0] = __ldg(w0 + 4 * (s + u * S)), a[u][1] = __ldg(w1 + 4 * (s + u * S));
            xb[u][0] = xv ? __ldg(xr + 8 * (s + u * S)) : zero;
            xb[u][1] = xv ? __ldg(xr + 8 * (s + u * S) + 1) : zero;
        }
#pragma unroll
        for (int u = 0; u < U; u++) fp8_mma_step(acc, a[u][0], a[u][1], xb[u][0], xb[u][1]);
    }
    for (; s < ns; s += S)
        fp8_mma_step(acc, __ldg(w0 + 4 * s), __ldg(w1 + 4 * s), xv ? __ldg(xr + 8 * s) : zero,
                     xv ? __ldg(xr + 8 * s + 1) : zero);
    if (S > 1) {
        red[warp][lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        if (part) return;
        acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
        for (int p = 0; p < S; p++) {
            const float4 v = red[warp + p][lane];
            acc[0] += v.x, acc[1] += v.y, acc[2] += v.z, acc[3] += v.w;
        }
        if (tile * 16 >= N) return;
    }
    /* C: rows g (elements 0, 1) and g + 8 (2, 3), tokens 2 l4 and 2 l4 + 1 */
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int t = 2 * l4 + j;
        if (t >= nt) continue;
        float *yt = y + (size_t)(t0 + t) * ldy;
        if (r0 < N) yt[r0] = (acc[j] * st[t0 + t]) * sr[r0];
        if (r1 < N) yt[r1] = (acc[2 + j] * st[t0 + t]) * sr[r1];
    }
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
        acc += ds_e4m3_to_f32(wr[k]) * __half2float(__ushort_as_half(xt[k]));
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

/* Warps a 16-row tile: a function of the matrix alone (enough warps to keep loads in flight). */
static int fp8_splits(const ds_cu *c, int N, int K) {
    const long want = 16L * c->n_sm, tiles = (N + 15) / 16;
    int S = 1;
    while (S < 8 && tiles * S < want && K / 64 >= 4 * S) S *= 2;
    return S;
}

static int fp8_gemv(ds_cu *c, float *y, int ldy, const uint16_t *xh, const float *st, int T,
                    const ds_cu_mat *w, ds_err *err) {
    const int N = w->rows, K = w->cols;
    const uint8_t *W = (const uint8_t *)w->data;
    const float *sr = (const float *)w->scale;
    if (K % 64 || (uintptr_t)W % 16) {
        for (int t0 = 0; t0 < T; t0 += 65535)
            launch_k(c, gemv_fp8_any_k,
                     dim3((unsigned)((N + 7) / 8), (unsigned)DS_MIN(T - t0, 65535)), 256, 0,
                     y + (size_t)t0 * ldy, ldy, xh + (size_t)t0 * K, st + t0, W, sr, N, K);
        CU_TRY(cudaGetLastError(), "matmul fp8 (gemv, any shape)");
        return DS_OK;
    }
    const int S = fp8_splits(c, N, K);
    const unsigned blocks = (unsigned)(((N + 15) / 16 + 8 / S - 1) / (8 / S));
    for (int t0 = 0; t0 < T; t0 += 8 * 65535) {
        const int n = DS_MIN(T - t0, 8 * 65535);
        launch_k(c, gemv_fp8_k, dim3(blocks, (unsigned)((n + 7) / 8)), 256, 0, y + (size_t)t0 * ldy,
                 ldy, xh + (size_t)t0 * K, st + t0, W, sr, N, K, S, n);
    }
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
     * tensor cores or xf [T][K] F16 code values for the streaming kernel */
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
