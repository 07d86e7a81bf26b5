/* kda.cuh — KDA device steps shared by the separate kernels and the fused decode, so that both
 * give the same bits: the decay of a channel and one token of the recurrence. */
#ifndef DS_CUDA_KDA_CUH
#define DS_CUDA_KDA_CUH

#include "kernels/cuda/common.cuh"

/* The log decay of a channel from f_b's output plus its bias (x) and a = e^A_log: kda_gate_k's
 * and the fused decode's one expression, so that both give the same bits. */
static __device__ __forceinline__ float kda_decay(float x, float a, int lower_bound_form,
                                                  float lb) {
    return lower_bound_form ? lb / (1.0f + expf(-a * x))
                            : -a * (fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
}

/* One token of the recurrence for a thread's DP entries s of a state column (entries c0 + c),
 * SPLIT neighbouring lanes sharing the column: decay by ds, predict v from the decayed state
 * (with k), write k (beta err)^T, read with q; returns the column's output (every lane of the
 * SPLIT has it). kda_run's and the fused decode's one step, so that both give the same bits. */
template <int DP, int SPLIT>
__device__ __forceinline__ float kda_token(float (&s)[DP], const float *qs, const float *ks,
                                           const float *ds, int c0, float vt, float bt, bool live) {
    float e = 0.0f;
#pragma unroll
    for (int c = 0; c < DP; c++) {
        s[c] *= ds[c0 + c];
        e += ks[c0 + c] * s[c];
    }
#pragma unroll
    for (int m = 1; m < SPLIT; m <<= 1) e += __shfl_xor_sync(0xffffffffu, e, m);
    const float err_v = live ? bt * (vt - e) : 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < DP; c++) {
        s[c] += ks[c0 + c] * err_v;
        acc += qs[c0 + c] * s[c];
    }
#pragma unroll
    for (int m = 1; m < SPLIT; m <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    return acc;
}

#endif
