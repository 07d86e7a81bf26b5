/* kv_rows.cu — the quantized latent cache's rows (docs/quantization.md §4, §5) on the GPU: storing
 * a step's latent rows into the pool as FP8 or BF16, and reading an expanded segment's context
 * back as f32. The rows' forms and their rounding are kernels/shared/kv_row.h's, the same code the
 * CPU runs, so a row written on either side holds the same bytes. (f32 pools move their rows with
 * ds_cu_move_rows.) */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/kv_row.h"

enum { KV_ROW_THREADS = 128 };

/* Block i stores src row i ([R + dr] floats, rows lds apart) as pool row dst_rows[i]
 * (row_bytes apart). A tile's largest magnitude comes from an atomic max over the bits of the
 * magnitudes (non-negative floats order as their bits); NaN is skipped, as on the CPU. */
__global__ void __launch_bounds__(KV_ROW_THREADS)
    kv_fp8_store_k(uint8_t *pool, size_t row_bytes, const int32_t *dst_rows, const float *src,
                   size_t lds, int R, int dr) {
    __shared__ unsigned amax[64]; /* [tiles] (R <= 8192) */
    PDL_ENTRY();
    const int i = blockIdx.x, tid = threadIdx.x, nt = ds_kv_fp8_tiles(R);
    const float *x = src + (size_t)i * lds;
    uint8_t *row = pool + (size_t)dst_rows[i] * row_bytes;
    for (int j = tid; j < nt; j += blockDim.x) amax[j] = 0u;
    __syncthreads();
    for (int k = tid; k < R; k += blockDim.x) {
        const float a = fabsf(x[k]);
        if (a == a) atomicMax(&amax[k / DS_KV_FP8_TILE], __float_as_uint(a));
    }
    __syncthreads();
    for (int k = tid; k < R; k += blockDim.x) {
        const float s = ds_ptpc_scale(__uint_as_float(amax[k / DS_KV_FP8_TILE]));
        row[k] = ds_f32_to_e4m3(x[k] * (1.0f / s));
    }
    for (int j = tid; j < nt; j += blockDim.x) {
        const float s = ds_ptpc_scale(__uint_as_float(amax[j]));
        memcpy(row + R + 4 * (size_t)j, &s, 4);
    }
    const int ra = ds_kv_fp8_rope_at(R);
    for (int k = tid; k < dr; k += blockDim.x) {
        const uint16_t h = ds_kv_bf16(x[R + k]);
        memcpy(row + ra + 2 * (size_t)k, &h, 2);
    }
    for (size_t b = (size_t)ra + 2 * (size_t)dr + tid; b < row_bytes; b += blockDim.x) row[b] = 0;
}

/* Block i stores src row i as BF16 pool row dst_rows[i]: ds_kv_bf16_row's bytes, a value a
 * thread at a time (the padding zeroed). */
__global__ void __launch_bounds__(KV_ROW_THREADS)
    kv_bf16_store_k(uint8_t *pool, size_t row_bytes, const int32_t *dst_rows, const float *src,
                    size_t lds, int n_vals) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const float *x = src + (size_t)i * lds;
    uint16_t *row = (uint16_t *)(pool + (size_t)dst_rows[i] * row_bytes);
    for (int k = threadIdx.x; 2 * (size_t)k < row_bytes; k += blockDim.x)
        row[k] = k < n_vals ? ds_kv_bf16(x[k]) : (uint16_t)0;
}

extern "C" int ds_cu_kv_store(ds_cu *c, int dtype, uint8_t *pool, size_t row_bytes,
                              const int32_t *dst_rows, const float *src, size_t lds, int n, int R,
                              int dr, ds_err *err) {
    if (n <= 0) return DS_OK;
    if (dtype == DS_KV_BF16) {
        launch_k(c, kv_bf16_store_k, (unsigned)n, KV_ROW_THREADS, 0, pool, row_bytes, dst_rows, src,
                 lds, R + dr);
    } else if (dtype == DS_KV_FP8) {
        if (ds_kv_fp8_tiles(R) > 64) return ds_errf(err, "cuda: fp8 kv cache: R %d over 8192", R);
        launch_k(c, kv_fp8_store_k, (unsigned)n, KV_ROW_THREADS, 0, pool, row_bytes, dst_rows, src,
                 lds, R, dr);
    } else {
        return ds_errf(err, "cuda: kv store: dtype %d is not a quantized row", dtype);
    }
    CU_TRY(cudaGetLastError(), "kv store");
    return DS_OK;
}

/* Block i: c [i][R], kr [i][dr] <- the values of pool row rows[i] (FP8 or BF16: BF16). */
template <bool BF16>
__global__ void __launch_bounds__(KV_ROW_THREADS)
    kv_gather_k(float *cl, float *kr, const uint8_t *pool, size_t row_bytes, const int32_t *rows,
                int R, int dr) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const uint8_t *row = pool + (size_t)rows[i] * row_bytes;
    for (int k = threadIdx.x; k < R + dr; k += blockDim.x) {
        const float v = ds_kv_row_value(BF16 ? DS_KV_BF16 : DS_KV_FP8, row, R, k);
        if (k < R)
            cl[(size_t)i * R + k] = v;
        else
            kr[(size_t)i * dr + k - R] = v;
    }
}

extern "C" int ds_cu_kv_gather(ds_cu *c, int dtype, float *cl, float *kr, const uint8_t *pool,
                               size_t row_bytes, const int32_t *rows, int n, int R, int dr,
                               ds_err *err) {
    if (n <= 0) return DS_OK;
    if (dtype != DS_KV_FP8 && dtype != DS_KV_BF16)
        return ds_errf(err, "cuda: kv gather: dtype %d is not a quantized row", dtype);
    launch_k(c, dtype == DS_KV_BF16 ? kv_gather_k<true> : kv_gather_k<false>, (unsigned)n,
             KV_ROW_THREADS, 0, cl, kr, pool, row_bytes, rows, R, dr);
    CU_TRY(cudaGetLastError(), "kv gather");
    return DS_OK;
}
