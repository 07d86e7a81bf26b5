/* mla.cuh — what the absorbed and expanded MLA kernels share: the split size, the split
 * softmax and the merge of the splits. */
#ifndef DS_CUDA_MLA_CUH
#define DS_CUDA_MLA_CUH

#include "kernels/cuda/common.cuh"

enum { MLA_CHUNK = 256 };

/* The split kernels' softmax over scores sc[0..n) in shared memory (written before a barrier):
 * returns their max m and, in *sum, the sum of exp(sc - m), with sc overwritten by those
 * exponentials and visible to the whole block on return. */
static __device__ inline float exp_shifted(float *sc, int n, float *sum) {
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += (sc[j] = expf(sc[j] - mx));
    *sum = block_sum(s); /* its barriers also publish the exponentials */
    return mx;
}

/* merges n_split partials per row (part_o [rows][n_split][R], part_ml [rows][n_split][2]: max and
 * sum) into obar [rows][R] (mla_absorbed.cu) */
void mla_merge(ds_cu *c, float *obar, const float *part_o, const float *part_ml, int rows, int R,
               int n_split);

/* ds_cu_mla_attend_absorbed_batch on tensor cores (mla_decode_tc.cu) when the device takes it
 * there (ds_cu_set_mla_decode_tc) and the shape fits (R 512, dr 64, Ha 16 or 32): *done 1 */
int mla_decode_tc(ds_cu *c, float *obar, const float *qbar, const float *qr, int ldqr, int T,
                  int Ha, int R, int dr, const void *pool, int kv_fp8, const int32_t *tables,
                  const int32_t *tok_bt, const int32_t *tok_pos, int max_ctx, int block_size,
                  size_t row_bytes, float scale, int *done, ds_err *err);

#endif
