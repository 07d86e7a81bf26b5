/* lt.cuh — one product's cuBLASLt descriptors, as the FP8 dense products (matmul_fp8.cu) and the
 * routed experts' batches (moe_tensor.cu, moe_fp8_gemm.cu) make them: operands of one type (E4M3
 * or BF16) in the TN layout FP8 wants (row-major y[n][N] is column-major N x n = A (K x N,
 * transposed) times B (K x n)), f32 compute without FP8's fast accumulation (each block's sums
 * promoted into f32: the CPU's sums as far as the tensor cores allow), and the heuristic's best
 * algorithm within the context's cuBLAS workspace. */
#ifndef DS_CUDA_LT_CUH
#define DS_CUDA_LT_CUH

#include "kernels/cuda/common.cuh"

#include <cublasLt.h>

struct lt_op {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
};

/* The descriptors of y [n][ldd] (dt: CUDA_R_32F or CUDA_R_16BF) = B [n][K] . A [N][K]^T, A and B
 * of type in (CUDA_R_8F_E4M3 or CUDA_R_16BF); their attributes beyond these (scales, batches) are
 * the caller's, before lt_algo. 1 when made (lt_free either way). */
static inline int lt_make(lt_op *o, cudaDataType_t in, int N, int n, int K, int ldd,
                          cudaDataType_t dt) {
    const cublasOperation_t tA = CUBLAS_OP_T, tB = CUBLAS_OP_N;
    const int8_t fast = 0;
    *o = lt_op{};
    return cublasLtMatmulDescCreate(&o->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == 0 &&
           cublasLtMatmulDescSetAttribute(o->op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA) ==
               0 &&
           cublasLtMatmulDescSetAttribute(o->op, CUBLASLT_MATMUL_DESC_TRANSB, &tB, sizeof tB) ==
               0 &&
           cublasLtMatmulDescSetAttribute(o->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                          sizeof fast) == 0 &&
           cublasLtMatrixLayoutCreate(&o->la, in, K, N, K) == 0 &&
           cublasLtMatrixLayoutCreate(&o->lb, in, K, n, K) == 0 &&
           cublasLtMatrixLayoutCreate(&o->ld, dt, N, n, ldd) == 0;
}

/* The workspace a product may use: context.cu's cuBLAS workspace of the stream it runs on. */
enum : size_t { LT_WS = (size_t)32 << 20 };
static inline void *lt_ws(ds_cu *c) {
    return c->on_side ? c->blas_ws_side : c->blas_ws;
}

/* The heuristic's first algorithm for the descriptors as they stand: 1 when there is one. */
static inline int lt_algo(cublasLtHandle_t h, lt_op *o, cublasLtMatmulHeuristicResult_t *res) {
    const size_t ws_bytes = LT_WS;
    int found = 0;
    return cublasLtMatmulPreferenceCreate(&o->pref) == 0 &&
           cublasLtMatmulPreferenceSetAttribute(o->pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws_bytes, sizeof ws_bytes) == 0 &&
           cublasLtMatmulAlgoGetHeuristic(h, o->op, o->la, o->lb, o->ld, o->ld, o->pref, 1, res,
                                          &found) == 0 &&
           found > 0;
}

static inline void lt_free(lt_op *o) {
    if (o->pref) cublasLtMatmulPreferenceDestroy(o->pref);
    if (o->ld) cublasLtMatrixLayoutDestroy(o->ld);
    if (o->lb) cublasLtMatrixLayoutDestroy(o->lb);
    if (o->la) cublasLtMatrixLayoutDestroy(o->la);
    if (o->op) cublasLtMatmulDescDestroy(o->op);
    *o = lt_op{};
}

#endif
