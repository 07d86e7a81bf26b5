/* attnres.cu — the AttnRes mix: a softmax over the candidates' scores, then their weighted sum. */
#include "kernels/cuda/common.cuh"

/* ---- AttnRes ----------------------------------------------------------------------------------
 * One block per token: each candidate's RMS and its dot with np (block sums), a softmax over the
 * m candidates, then the mix. cands: device array of m pointers to [T][D]. */
__global__ void attnres_mix_k(float *out, const float *const *cands, int m, const float *np, int D,
                              float eps) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    __shared__ float alpha[32];
    for (int j = 0; j < m; j++) {
        const float *x = cands[j] + (size_t)t * D;
        float ss = 0.0f, dot = 0.0f;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            ss += x[i] * x[i];
            dot += x[i] * np[i];
        }
        ss = block_sum(ss);
        dot = block_sum(dot);
        if (threadIdx.x == 0) alpha[j] = dot / sqrtf(ss / (float)D + eps);
    }
    __syncthreads();
    float mx = -INFINITY, sum = 0.0f;
    for (int j = 0; j < m; j++) mx = fmaxf(mx, alpha[j]);
    float a[32];
    for (int j = 0; j < m; j++) sum += (a[j] = expf(alpha[j] - mx));
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < m; j++) acc += a[j] / sum * cands[j][(size_t)t * D + i];
        out[(size_t)t * D + i] = acc;
    }
}

extern "C" int ds_cu_attnres_mix(ds_cu *c, float *out, const float *const *cands, int m,
                                 const float *np, int T, int D, float eps, ds_err *err) {
    if (m < 1 || m > 32) return ds_errf(err, "cuda: attnres: %d candidates (1..32)", m);
    if (T <= 0) return DS_OK;
    launch_k(c, attnres_mix_k, T, 256, 0, out, cands, m, np, D, eps);
    CU_TRY(cudaGetLastError(), "attnres");
    return DS_OK;
}
