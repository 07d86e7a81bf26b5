/* norm.cu — row norms: RMSNorm (strided, fused with a residual add), the per-head L2 norm and
 * the gated per-head RMSNorm of KDA's output. */
#include "kernels/cuda/common.cuh"

/* Values per thread a row norm keeps in registers (D up to 12 x 256 = 3072 in one pass). */
enum { NORM_V = 12 };

/* y = w * v / rms(v) for a row held in registers, v[i] at column threadIdx.x + i blockDim.x
 * (zeros past D): each thread's squares summed in column order, as the looping form does. */
__device__ __forceinline__ void norm_row_regs(float *yr, const float (&v)[NORM_V],
                                              const float (&w)[NORM_V], int D, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_V; i++)
        if (threadIdx.x + i * blockDim.x < D) ss += v[i] * v[i];
    const float inv = rsqrtf(block_sum(ss) / (float)D + eps);
#pragma unroll
    for (int i = 0; i < NORM_V; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < D) yr[c] = w[i] * (v[i] * inv);
    }
}

/* A row norm's weights (no earlier kernel's output) into registers, laid out as norm_row_regs
 * takes them: loaded before the wait for the previous kernel, so that a decode step's chain of
 * norms does not wait on them after it. */
__device__ __forceinline__ void norm_weights_regs(float (&wv)[NORM_V], const float *w, int D) {
#pragma unroll
    for (int i = 0; i < NORM_V; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        wv[i] = c < D ? w[c] : 0.0f;
    }
}

/* y[t] = w * x[t] / rms(x[t]) for row t = blockIdx.x; rows ldx / ldy apart. */
__global__ void rmsnorm_ld_k(float *y, int ldy, const float *x, int ldx, const float *w, int D,
                             float eps) {
    float wv[NORM_V];
    const bool in_regs = D <= NORM_V * (int)blockDim.x;
    if (in_regs) norm_weights_regs(wv, w, D);
    PDL_ENTRY();
    const float *xr = x + (size_t)blockIdx.x * ldx;
    float *yr = y + (size_t)blockIdx.x * ldy;
    float ss = 0.0f;
    if (in_regs) { /* as add_rmsnorm_k; y may be x */
        float v[NORM_V];
#pragma unroll
        for (int i = 0; i < NORM_V; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            v[i] = c < D ? xr[c] : 0.0f;
        }
        norm_row_regs(yr, v, wv, D, eps);
        return;
    }
    for (int c = threadIdx.x; c < D; c += blockDim.x) ss += xr[c] * xr[c];
    float inv = rsqrtf(block_sum(ss) / (float)D + eps);
    for (int c = threadIdx.x; c < D; c += blockDim.x) yr[c] = w[c] * (xr[c] * inv);
}

extern "C" void ds_cu_rmsnorm(ds_cu *c, float *y, const float *x, const float *w, int T, int D,
                              float eps) {
    if (T <= 0) return;
    launch_k(c, rmsnorm_ld_k, T, 256, 0, y, D, x, D, w, D, eps); /* packed rows */
    note_launch(c);
}

/* P += a, then y = w ⊙ P / rms(P): a residual add and the next norm in one pass. */
__global__ void add_rmsnorm_k(float *y, float *P, const float *a, const float *w, int D,
                              float eps) {
    float wv[NORM_V];
    const bool in_regs = D <= NORM_V * (int)blockDim.x;
    if (in_regs) norm_weights_regs(wv, w, D);
    PDL_ENTRY();
    float *pr = P + (size_t)blockIdx.x * D;
    const float *ar = a + (size_t)blockIdx.x * D;
    float *yr = y + (size_t)blockIdx.x * D;
    float ss = 0.0f;
    if (in_regs) { /* the row in registers: every load in flight at once */
        float v[NORM_V];
#pragma unroll
        for (int i = 0; i < NORM_V; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            v[i] = c < D ? pr[c] + ar[c] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < NORM_V; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < D) pr[c] = v[i];
        }
        norm_row_regs(yr, v, wv, D, eps);
        return;
    }
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float v = pr[c] + ar[c];
        pr[c] = v;
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / (float)D + eps);
    for (int c = threadIdx.x; c < D; c += blockDim.x) yr[c] = w[c] * (pr[c] * inv);
}

extern "C" void ds_cu_add_rmsnorm(ds_cu *c, float *y, float *P, const float *a, const float *w,
                                  int T, int D, float eps) {
    if (T <= 0) return;
    launch_k(c, add_rmsnorm_k, T, 256, 0, y, P, a, w, D, eps);
    note_launch(c);
}

extern "C" void ds_cu_rmsnorm_ld(ds_cu *c, float *y, int ldy, const float *x, int ldx,
                                 const float *w, int T, int D, float eps) {
    if (T <= 0) return;
    launch_k(c, rmsnorm_ld_k, T, 256, 0, y, ldy, x, ldx, w, D, eps);
    note_launch(c);
}

/* One warp per row of d (a head): the sum of squares by shuffles, then the scaled row. */
/* Rows [rows, 2 rows) of the grid, when x2 is given, are x2's, scaled by scale2 (q and k in one
 * launch). */
__global__ void l2norm_heads_k(float *x, int rows, int d, float eps, float scale, float *x2,
                               float scale2) {
    PDL_ENTRY();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= (x2 ? 2 * rows : rows)) return;
    if (row >= rows) {
        row -= rows;
        x = x2;
        scale = scale2;
    }
    float *xr = x + (size_t)row * d, ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += xr[i] * xr[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float s = scale / sqrtf(ss + eps); /* eps inside the root of the plain sum (§10 trap 1) */
    for (int i = lane; i < d; i += 32) xr[i] *= s;
}

extern "C" void ds_cu_l2norm_heads(ds_cu *c, float *x, int T, int H, int d, float eps,
                                   float scale) {
    int rows = T * H;
    if (rows <= 0) return;
    launch_k(c, l2norm_heads_k, (rows + 7) / 8, 256, 0, x, rows, d, eps, scale, (float *)NULL,
             0.0f);
    note_launch(c);
}

extern "C" void ds_cu_l2norm_heads2(ds_cu *c, float *x, float scale, float *x2, float scale2, int T,
                                    int H, int d, float eps) {
    int rows = T * H;
    if (rows <= 0) return;
    launch_k(c, l2norm_heads_k, (2 * rows + 7) / 8, 256, 0, x, rows, d, eps, scale, x2, scale2);
    note_launch(c);
}

__global__ void gated_rmsnorm_heads_k(float *y, const float *o, const float *gate, const float *w,
                                      int rows, int d, float eps) {
    enum { GW = 8 }; /* weights a lane holds from before the wait (d <= 256) */
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    float wv[GW];
#pragma unroll
    for (int m = 0; m < GW; m++) wv[m] = lane + 32 * m < d ? w[lane + 32 * m] : 0.0f;
    PDL_ENTRY();
    if (row >= rows) return;
    const size_t off = (size_t)row * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += o[off + i] * o[off + i];
    for (int k = 16; k > 0; k >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, k);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int m = 0; m < GW; m++) {
        const int i = lane + 32 * m;
        if (i < d) y[off + i] = o[off + i] * r * wv[m] / (1.0f + expf(-gate[off + i]));
    }
    for (int i = lane + 32 * GW; i < d; i += 32)
        y[off + i] = o[off + i] * r * w[i] / (1.0f + expf(-gate[off + i]));
}

extern "C" void ds_cu_gated_rmsnorm_heads(ds_cu *c, float *y, const float *o, const float *gate,
                                          const float *w, int T, int H, int d, float eps) {
    int rows = T * H;
    if (rows <= 0) return;
    launch_k(c, gated_rmsnorm_heads_k, (rows + 7) / 8, 256, 0, y, o, gate, w, rows, d, eps);
    note_launch(c);
}
