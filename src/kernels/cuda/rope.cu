/* rope.cu — RoPE on GPT-J pairs (the DSpark draft's YaRN rows). */
#include "kernels/cuda/common.cuh"

/* ---- RoPE (the DSpark draft's YaRN rows) ------------------------------------------------------
 * Row r of x: lanes (2i, 2i+1) turned by cs[r / per][i] = {cos, sin} (GPT-J pairs, as the CPU
 * draft's rope_apply); the products rounded apart (no fused multiply-add), as the CPU's are. */
__global__ void rope_pairs_k(float *x, int ldx, int rows, int per, const float *cs, int half) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (i >= half || r >= rows) return;
    float *xr = x + (size_t)r * ldx;
    const float *c = cs + ((size_t)(r / per) * half + i) * 2;
    const float a = xr[2 * i], b = xr[2 * i + 1];
    xr[2 * i] = __fsub_rn(__fmul_rn(a, c[0]), __fmul_rn(b, c[1]));
    xr[2 * i + 1] = __fadd_rn(__fmul_rn(a, c[1]), __fmul_rn(b, c[0]));
}

extern "C" int ds_cu_rope_pairs(ds_cu *c, float *x, int ldx, int rows, int per, const float *cs,
                                int half, ds_err *err) {
    if (rows <= 0 || half <= 0) return DS_OK;
    if (per < 1 || rows > 65535) return ds_errf(err, "cuda: rope over %d rows (per %d)", rows, per);
    launch_k(c, rope_pairs_k, dim3((unsigned)((half + 63) / 64), (unsigned)rows), 64, 0, x, ldx,
             rows, per, cs, half);
    CU_TRY(cudaGetLastError(), "rope");
    return DS_OK;
}
