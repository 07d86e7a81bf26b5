/* kv_fp8.cu — the FP8 latent cache's rows (docs/quantization.md, "FP8 latent cache") on the GPU:
 * storing a step's latent rows into the pool, and reading an expanded segment's context back as
 * f32. The row's form and its rounding are kernels/shared/kv_fp8.h's, the same code the CPU runs,
 * so a row written on either side holds the same bytes. */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/kv_fp8.h"

enum { KV_FP8_THREADS = 128 };

/* Block i stores src row i ([R + dr] floats, rows lds apart) as pool row dst_rows[i]
 * (row_bytes apart). A tile's largest magnitude comes from an atomic max over the bits of the
 * magnitudes (non-negative floats order as their bits); NaN is skipped, as on the CPU. */
__global__ void __launch_bounds__(KV_FP8_THREADS)
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

extern "C" int ds_cu_kv_fp8_store(ds_cu *c, uint8_t *pool, size_t row_bytes,
                                  const int32_t *dst_rows, const float *src, size_t lds, int n,
                                  int R, int dr, ds_err *err) {
    if (n <= 0) return DS_OK;
    if (ds_kv_fp8_tiles(R) > 64) return ds_errf(err, "cuda: fp8 kv cache: R %d over 8192", R);
    launch_k(c, kv_fp8_store_k, (unsigned)n, KV_FP8_THREADS, 0, pool, row_bytes, dst_rows, src, lds,
             R, dr);
    CU_TRY(cudaGetLastError(), "fp8 kv store");
    return DS_OK;
}

/* Block i: c [i][R], kr [i][dr] <- the values of pool row rows[i]. */
__global__ void __launch_bounds__(KV_FP8_THREADS)
    kv_fp8_gather_k(float *cl, float *kr, const uint8_t *pool, size_t row_bytes,
                    const int32_t *rows, int R, int dr) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const uint8_t *row = pool + (size_t)rows[i] * row_bytes;
    for (int k = threadIdx.x; k < R + dr; k += blockDim.x) {
        const float v = ds_kv_fp8_value(row, R, k);
        if (k < R)
            cl[(size_t)i * R + k] = v;
        else
            kr[(size_t)i * dr + k - R] = v;
    }
}

extern "C" int ds_cu_kv_fp8_gather(ds_cu *c, float *cl, float *kr, const uint8_t *pool,
                                   size_t row_bytes, const int32_t *rows, int n, int R, int dr,
                                   ds_err *err) {
    if (n <= 0) return DS_OK;
    launch_k(c, kv_fp8_gather_k, (unsigned)n, KV_FP8_THREADS, 0, cl, kr, pool, row_bytes, rows, R,
             dr);
    CU_TRY(cudaGetLastError(), "fp8 kv gather");
    return DS_OK;
}
