/* elementwise.cu — the forward's glue kernels: the embedding, SwiGLU, add/mul/sigmoid, row
 * moves and strided copies, random weights (the CPU's hash) and the BF16 transpose. */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/quant.h"
#include "kernels/shared/rand_hash.h"

/* ---- embedding, norms, activations -------------------------------------------------------- */

/* Rows [v0, v0 + nv) of the vocabulary live in e; a token outside them embeds as zeros (the
 * vocabulary-parallel slice: the TP all-reduce then gives every rank the whole embedding). */
__global__ void embed_k(float *out, const __nv_bfloat16 *e, const int32_t *ids, int D, int v0,
                        int nv) {
    PDL_ENTRY();
    int t = blockIdx.x, id = ids[t] - v0;
    const __nv_bfloat16 *row = e + (size_t)id * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x)
        out[(size_t)t * D + c] = id >= 0 && id < nv ? __bfloat162float(row[c]) : 0.0f;
}

extern "C" void ds_cu_embed(ds_cu *c, float *out, const ds_cu_mat *e, const int32_t *ids, int T) {
    ds_cu_embed_range(c, out, e, ids, T, 0);
}

extern "C" void ds_cu_embed_range(ds_cu *c, float *out, const ds_cu_mat *e, const int32_t *ids,
                                  int T, int v0) {
    if (T <= 0) return;
    launch_k(c, embed_k, T, 256, 0, out, (const __nv_bfloat16 *)e->data, ids, e->cols, v0, e->rows);
    note_launch(c);
}

__global__ void swiglu_k(float *out, const float *gate, const float *up, size_t n) {
    PDL_ENTRY();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = act_pair(gate[i], up[i], 0, 0.0f, 0.0f);
}

extern "C" void ds_cu_swiglu(ds_cu *c, float *out, const float *gate, const float *up, size_t n) {
    if (!n) return;
    launch_k(c, swiglu_k, (unsigned)((n + 255) / 256), 256, 0, out, gate, up, n);
    note_launch(c);
}

/* ---- the rest of the forward's glue: elementwise, strided norms, row gathers --------------- */

#define ELEMWISE(name, body)                                                                       \
    __global__ void name##_k(float *y, const float *x, size_t n, float a, float b) {               \
        PDL_ENTRY();                                                                               \
        size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (i < n) {                                                                               \
            body;                                                                                  \
        }                                                                                          \
    }
ELEMWISE(add, y[i] += x[i])
ELEMWISE(mul, y[i] *= x[i])
ELEMWISE(sigmoid, y[i] = 1.0f / (1.0f + expf(-y[i])))
/* sigmoid then mul as one launch: the same operations, so the same bits */
ELEMWISE(mul_sigmoid, y[i] *= 1.0f / (1.0f + expf(-x[i])))
#undef ELEMWISE

#define ELEMWISE_LAUNCH(name, y, x, n, a, b)                                                       \
    do {                                                                                           \
        if (!(n)) return;                                                                          \
        launch_k(c, name##_k, (unsigned)(((n) + 255) / 256), 256, 0, y, x, n, a, b);               \
        note_launch(c);                                                                            \
    } while (0)

extern "C" void ds_cu_add(ds_cu *c, float *y, const float *x, size_t n) {
    ELEMWISE_LAUNCH(add, y, x, n, 0.0f, 0.0f);
}
extern "C" void ds_cu_mul(ds_cu *c, float *y, const float *x, size_t n) {
    ELEMWISE_LAUNCH(mul, y, x, n, 0.0f, 0.0f);
}
extern "C" void ds_cu_sigmoid(ds_cu *c, float *x, size_t n) {
    ELEMWISE_LAUNCH(sigmoid, x, x, n, 0.0f, 0.0f);
}
extern "C" void ds_cu_mul_sigmoid(ds_cu *c, float *y, const float *x, size_t n) {
    ELEMWISE_LAUNCH(mul_sigmoid, y, x, n, 0.0f, 0.0f);
}

/* dst[dst_rows ? dst_rows[i] : i][:width] = src[src_rows ? src_rows[i] : i][:width] */
__global__ void move_rows_k(float *dst, size_t ldd, const int32_t *dst_rows, const float *src,
                            size_t lds, const int32_t *src_rows, int width) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const size_t di = dst_rows ? (size_t)dst_rows[i] : (size_t)i;
    const size_t si = src_rows ? (size_t)src_rows[i] : (size_t)i;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[di * ldd + c] = src[si * lds + c];
}

extern "C" int ds_cu_move_rows(ds_cu *c, float *dst, size_t ldd, const int32_t *dst_rows,
                               const float *src, size_t lds, const int32_t *src_rows, int n,
                               int width, ds_err *err) {
    for (int i0 = 0; i0 < n; i0 += 1 << 30) {
        int m = DS_MIN(n - i0, 1 << 30);
        launch_k(c, move_rows_k, (unsigned)m, 128, 0, dst_rows ? dst : dst + (size_t)i0 * ldd, ldd,
                 dst_rows ? dst_rows + i0 : NULL, src_rows ? src : src + (size_t)i0 * lds, lds,
                 src_rows ? src_rows + i0 : NULL, width);
        CU_TRY(cudaGetLastError(), "move rows");
    }
    return DS_OK;
}

/* A kernel, not cudaMemcpy2DAsync: inside a captured step a copy node ends programmatic launch
 * (the kernel after it cannot start under its tail) and costs a copy engine's latency; MLA's
 * decode chain had one per layer. */
__global__ void copy_2d_k(float *dst, size_t ldd, const float *src, size_t lds, size_t width,
                          size_t rows) {
    PDL_ENTRY();
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) /* a block a row (no division) */
        for (size_t col = threadIdx.x; col < width; col += blockDim.x)
            dst[r * ldd + col] = src[r * lds + col];
}

extern "C" int ds_cu_copy_2d(ds_cu *c, float *dst, size_t ldd, const float *src, size_t lds,
                             size_t width, size_t rows, ds_err *err) {
    if (!rows || !width) return DS_OK;
    launch_k(c, copy_2d_k, (unsigned)DS_MIN(rows, (size_t)c->n_sm * 16),
             (unsigned)DS_MIN((width + 31) / 32 * 32, (size_t)256), 0, dst, ldd, src, lds, width,
             rows);
    CU_TRY(cudaGetLastError(), "2d copy");
    return DS_OK;
}

extern "C" int ds_cu_copy_any(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err) {
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream), "copy");
    CU_TRY(cudaStreamSynchronize(c->stream), "copy");
    return DS_OK;
}

/* Random weights made in place (ds_cu_fill_random_bf16): element i of the [rows][cols] slice from
 * its index g in the whole tensor, the CPU's value (rand_hash.h). */
__global__ void fill_random_bf16_k(__nv_bfloat16 *d, size_t rows, size_t cols,
                                   unsigned long long key, size_t row0, size_t col0,
                                   size_t full_cols, float scale) {
    PDL_ENTRY();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * cols;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t g = (row0 + i / cols) * full_cols + col0 + i % cols; /* (a load-time kernel) */
        d[i] = __float2bfloat16_rn(scale * ds_hash_uniform(key, g));
    }
}

extern "C" int ds_cu_fill_random_bf16(ds_cu *c, uint16_t *d, size_t rows, size_t cols, uint64_t key,
                                      size_t row0, size_t col0, size_t full_cols, float scale,
                                      ds_err *err) {
    if (!rows || !cols) return DS_OK;
    launch_k(c, fill_random_bf16_k, 4096, 256, 0, (__nv_bfloat16 *)d, rows, cols,
             (unsigned long long)key, row0, col0, full_cols, scale);
    CU_TRY(cudaGetLastError(), "random weights");
    return DS_OK;
}

/* Random MXFP4 weights made in place (ds_cu_fill_random_mxfp4): code byte i and scale byte j of
 * the slice from their indices in the whole tensor, the CPU's draw (rand_hash.h). */
__global__ void fill_random_mxfp4_k(uint8_t *codes, uint8_t *scales, size_t rows, size_t cols,
                                    unsigned long long key, size_t row0, size_t col0,
                                    size_t full_cols, int e2) {
    PDL_ENTRY();
    const size_t nb = cols / 2, ns = cols / DS_MXFP4_GROUP;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * nb;
         i += (size_t)gridDim.x * blockDim.x)
        codes[i] = ds_rand_mxfp4_code(key, (row0 + i / nb) * (full_cols / 2) + col0 / 2 + i % nb);
    for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < rows * ns;
         j += (size_t)gridDim.x * blockDim.x)
        scales[j] = ds_rand_mxfp4_scale(
            key, (row0 + j / ns) * (full_cols / DS_MXFP4_GROUP) + col0 / DS_MXFP4_GROUP + j % ns,
            e2);
}

extern "C" int ds_cu_fill_random_mxfp4(ds_cu *c, uint8_t *codes, uint8_t *scales, size_t rows,
                                       size_t cols, uint64_t key, size_t row0, size_t col0,
                                       size_t full_cols, int e2, ds_err *err) {
    if (!rows || !cols) return DS_OK;
    if (cols % DS_MXFP4_GROUP || col0 % DS_MXFP4_GROUP || full_cols % DS_MXFP4_GROUP)
        return ds_errf(err, "cuda: random mxfp4: columns %zu at %zu of %zu (groups of 32)", cols,
                       col0, full_cols);
    launch_k(c, fill_random_mxfp4_k, 4096, 256, 0, codes, scales, rows, cols,
             (unsigned long long)key, row0, col0, full_cols, e2);
    CU_TRY(cudaGetLastError(), "random mxfp4 weights");
    return DS_OK;
}

__global__ void transpose_u16_k(uint16_t *dst, const uint16_t *src, int rows, int cols) {
    PDL_ENTRY();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols) return;
    const int r = (int)(i / cols), c = (int)(i % cols);
    dst[(size_t)c * rows + r] = src[i];
}

extern "C" int ds_cu_transpose_bf16(ds_cu *c, uint16_t *dst, const uint16_t *src, int rows,
                                    int cols, ds_err *err) {
    size_t n = (size_t)rows * cols;
    if (!n) return DS_OK;
    launch_k(c, transpose_u16_k, (unsigned)((n + 255) / 256), 256, 0, dst, src, rows, cols);
    CU_TRY(cudaGetLastError(), "transpose");
    return DS_OK;
}
