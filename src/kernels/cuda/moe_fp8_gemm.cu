/* moe_fp8_gemm.cu — a long step's (prefill's) routed experts held as ptpc FP8, on FP8 tensor cores
 * through cuBLASLt: the same plan as the BF16 experts' cuBLAS path (moe_tensor.cu: experts cut
 * into buckets by row count, each expert a panel of its bucket's rows), the routed rows quantized
 * per token as they are gathered into the panels, each bucket one pointer-array batch of
 * E4M3 x E4M3 products with f32 sums, and the scales applied after, in the order the CPU and the
 * tile kernel (moe_fp8.cu) apply them: gate/up (sum * s_t) * s_r, the activation in f32, its row
 * quantized per token and expert, down (sum * s_a) * s_r inside the combine. The tensor cores'
 * FP8 sums are not exact f32 (docs/quantization.md §3: what that costs against the CPU). Without a
 * pointer-array algorithm for FP8 (a cuBLASLt that has none), one call an expert from the same
 * plan. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/lt.cuh"
#include "kernels/cuda/fp8_stream.cuh"
#include "kernels/cuda/moe.cuh"
#include "kernels/shared/quant.h"

/* the largest of a and v's components' magnitudes */
static __device__ __forceinline__ float amax4(float a, float4 v) {
    return fmaxf(fmaxf(a, fmaxf(fabsf(v.x), fabsf(v.y))), fmaxf(fabsf(v.z), fabsf(v.w)));
}

/* The block's row of n4 x 4 values v4 (global or shared memory), amax this thread's share of
 * their largest magnitude: the row's ptpc scale (returned) and its codes q [4 n4] — the
 * activations' quantizer of moe_fp8.cu and matmul_fp8.cu (the same codes). */
static __device__ __forceinline__ float f8g_quant_row(uint8_t *q, const float4 *v4, int n4,
                                                      float amax) {
    amax = block_max(amax); /* (its barriers also order v4 in shared memory) */
    const float s = ds_ptpc_scale(amax), inv = 1.0f / s;
    uint32_t *dst = (uint32_t *)q;
    for (int c4 = threadIdx.x; c4 < n4; c4 += blockDim.x) {
        const float4 v = v4[c4];
        dst[c4] = (uint32_t)f8_code(v.x * inv) | (uint32_t)f8_code(v.y * inv) << 8 |
                  (uint32_t)f8_code(v.z * inv) << 16 | (uint32_t)f8_code(v.w * inv) << 24;
    }
    return s;
}

/* Token t = blockIdx.x of x [T][D] quantized once: its codes into xt [T][D], its scale st[t]
 * (the gather below copies them to the token's k routed rows, where each routed row quantized
 * its token again before). D % 4 == 0, x 16-byte aligned. */
__global__ void __launch_bounds__(256)
    moe_f8g_quant_k(uint8_t *xt, float *st, const float *x, int D) {
    PDL_ENTRY();
    const size_t t = blockIdx.x;
    const float4 *xr = (const float4 *)(x + t * D);
    float amax = 0.0f;
    for (int c4 = threadIdx.x; c4 < D / 4; c4 += blockDim.x) amax = amax4(amax, xr[c4]);
    const float s = f8g_quant_row(xt + t * D, xr, D / 4, amax);
    if (threadIdx.x == 0) st[t] = s;
}

/* Routed row i < n (perm order) of this rank, a warp each (MOE_GATHER_ROWS a block): its token
 * perm[i] / k's codes (xt) into panel row slot[i] of xq [pr][D] (the products' B operand), the
 * token's scale into xs[slot[i]]. D % 16 == 0. */
__global__ void moe_f8g_gather_k(uint8_t *xq, float *xs, const uint8_t *xt, const float *st, int D,
                                 const int32_t *perm, const int32_t *slot, int k, int n) {
    PDL_ENTRY();
    const int i = blockIdx.x * MOE_GATHER_ROWS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (i >= n) return;
    const int r = slot[i], t = perm[i] / k;
    warp_copy16(xq + (size_t)r * D, xt + (size_t)t * D, D / 16, lane);
    if (lane == 0) xs[r] = st[t];
}

/* Routed row i (blockIdx.x) of expert e (start[e] <= i < start[e + 1]) at panel row r = slot[i]:
 * gate and up from the f32 sums h [pr][2I] as (sum * xs[r]) * gs[e][n], the activation in f32,
 * the row quantized into aq [pr][I] (codes) and as[r]. I % 4 == 0; shared memory I floats. */
__global__ void __launch_bounds__(256)
    moe_f8g_act_k(uint8_t *aq, float *as, const float *h, const float *xs, const float *gs,
                  const int32_t *start, int E, const int32_t *slot, int I, moe_act act) {
    PDL_ENTRY();
    extern __shared__ float4 av4[]; /* [I / 4] the row's activations */
    const int i = blockIdx.x, r = slot[i];
    int lo = 0, hi = E; /* the last e with start[e] <= i: experts without rows share its start */
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (start[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    const float st = xs[r];
    const size_t hg = (size_t)r * 2 * I; /* the row's gate sums; up's I after */
    const float4 *sg4 = (const float4 *)(gs + (size_t)lo * 2 * I), *su4 = sg4 + I / 4;
    float amax = 0.0f;
    for (int c4 = threadIdx.x; c4 < I / 4; c4 += blockDim.x) {
        const float4 g = load4(h, hg + 4 * c4), u = load4(h, hg + I + 4 * c4), sg = sg4[c4],
                     su = su4[c4];
        const float4 v = make_float4(
            act_pair((g.x * st) * sg.x, (u.x * st) * su.x, act.situ, act.beta, act.lin_beta),
            act_pair((g.y * st) * sg.y, (u.y * st) * su.y, act.situ, act.beta, act.lin_beta),
            act_pair((g.z * st) * sg.z, (u.z * st) * su.z, act.situ, act.beta, act.lin_beta),
            act_pair((g.w * st) * sg.w, (u.w * st) * su.w, act.situ, act.beta, act.lin_beta));
        av4[c4] = v;
        amax = amax4(amax, v);
    }
    const float sa = f8g_quant_row(aq + (size_t)r * I, av4, I / 4, amax);
    if (threadIdx.x == 0) as[r] = sa;
}

int moe_f8_experts_gemm(ds_cu *c, float *out, const float *x, const float *w, const int32_t *idx,
                        int T, int k, int E, int e0, int D, int I, const uint8_t *gu_codes,
                        const float *gu_scales, const uint8_t *dn_codes, const float *dn_scales,
                        moe_act act, int accumulate, int *done, ds_err *err) {
    *done = 0;
    cublasLtHandle_t h = (cublasLtHandle_t)lt_handle(c);
    if (!h) return DS_OK; /* no cuBLASLt: the tile kernel */
    const int rows = T * k;
    const int n_chunks = rows >= 1024 ? (rows + MOE_GCHUNK - 1) / MOE_GCHUNK : 0;
    /* the layout first (its own scratch, so that the tile path's stays untouched if this one
     * declines): start [E+1], perm [rows], active [E], n [1], hist [n_chunks][E], inv [rows],
     * slot [rows], panel [E] */
    const size_t ni = (size_t)E + 1 + rows + E + 1 + (size_t)n_chunks * E;
    const size_t isz[4] = {ni * 4, (size_t)rows * 4, (size_t)rows * 4, (size_t)E * 4};
    void *ib[4];
    if (carve_scratch(c, &c->moegi, &c->moegi_bytes, isz, ib, 4, "moe fp8 gemm layout", err))
        return DS_ERR;
    int32_t *start = (int32_t *)ib[0], *perm = start + E + 1, *active = perm + rows;
    int32_t *n_active = active + E, *hist = n_active + 1;
    int32_t *inv = (int32_t *)ib[1], *slot = (int32_t *)ib[2], *dpanel = (int32_t *)ib[3];
    ds_cu_prof_mark(c, "moe group");
    moe_group_rows(c, idx, rows, e0, E, n_chunks, start, perm, active, n_active, hist);
    CU_TRY(cudaGetLastError(), "moe fp8 gemm: group");
    moe_plan pl;
    if (moe_plan_make(c, start, E, &pl, err)) return DS_ERR;
    const size_t pr = pl.pr;
    /* xq [pr][D] codes | xs [pr] | h [pr][2I] f32 sums | aq [pr][I] codes | as [pr] | y [pr][D]
     * sums, f32 (BF16 with expert_bf16_out, as the BF16 experts' GEMMs write theirs) | pointer
     * arrays [6][E] | xt [T][D] codes, st [T]: each token quantized once. Gate/up's sums stay f32
     * whatever expert_bf16_out says: the activation's codes are made from them, and BF16 sums moved
     * one code in ~30 a rounding (1.5e-2 off the CPU's experts at random weights against 3e-3;
     * bench/RESULTS.md session 46) */
    const int y16 = c->expert_bf16_out > 0;
    const size_t ysz = y16 ? 2 : 4; /* y's elements' bytes */
    const size_t sz[9] = {pr * D,
                          pr * 4,
                          pr * 2 * I * 4,
                          pr * I,
                          pr * 4,
                          pr * D * ysz,
                          (size_t)6 * E * sizeof(void *),
                          (size_t)T * D,
                          (size_t)T * 4};
    void *b[9];
    if (carve_scratch(c, &c->moeg, &c->moeg_bytes, sz, b, 9, "moe fp8 gemm scratch", err))
        return DS_ERR;
    uint8_t *xq = (uint8_t *)b[0], *aq = (uint8_t *)b[3];
    float *xs = (float *)b[1], *as = (float *)b[4];
    float *hb = (float *)b[2];
    char *y = (char *)b[5];
    void **dptrs = (void **)b[6];
    const size_t per_gu = (size_t)2 * I * D, per_dn = (size_t)D * I;
    for (int i = 0; i < pl.n_act; i++) { /* in bucket order */
        const int e = pl.order[i];
        const size_t p0 = (size_t)pl.panel[e];
        pl.ptrs[i] = gu_codes + (size_t)e * per_gu;
        pl.ptrs[E + i] = xq + p0 * D;
        pl.ptrs[2 * E + i] = hb + p0 * 2 * I;
        pl.ptrs[3 * E + i] = dn_codes + (size_t)e * per_dn;
        pl.ptrs[4 * E + i] = aq + p0 * I;
        pl.ptrs[5 * E + i] = y + p0 * D * ysz;
    }
    ds_cu_prof_mark(c, "moe gemm: gather x");
    if (moe_plan_send(c, &pl, E, start, dpanel, dptrs, slot, err)) return DS_ERR;
    if (pl.n_local > 0) {
        uint8_t *xt = (uint8_t *)b[7];
        float *st = (float *)b[8];
        launch_k(c, moe_f8g_quant_k, (unsigned)T, 256, 0, xt, st, x, D);
        launch_k(c, moe_f8g_gather_k,
                 (unsigned)((pl.n_local + MOE_GATHER_ROWS - 1) / MOE_GATHER_ROWS),
                 32 * MOE_GATHER_ROWS, 0, xq, xs, (const uint8_t *)xt, (const float *)st, D,
                 (const int32_t *)perm, (const int32_t *)slot, k, pl.n_local);
    }
    CU_TRY(cudaGetLastError(), "moe fp8 gemm: gather");
    ds_cu_prof_mark(c, "moe gemm: gate/up");
    /* FLOPs counted for the routed rows only (not the panels' padding) */
    const char *prof = prof_gemm_open(c);
    for (int bk = 0; bk < pl.n_bk && pl.n_local > 0; bk++) {
        const int i0 = pl.bk_first[bk], cnt = pl.bk_first[bk + 1] - i0;
        if (lt_batched(c, h, CUDA_R_8F_E4M3, 2 * I, pl.bk_rows[bk], D, cnt, 0, dptrs + i0,
                       pl.ptrs + i0, E, done, err))
            return DS_ERR;
        if (!*done) { /* no algorithm: the tile kernel redoes the experts from x */
            prof_gemm_close(c, prof, 0.0);
            return DS_OK;
        }
    }
    prof_gemm_close(c, prof, 2.0 * pl.n_local * 2 * I * D);
    ds_cu_prof_mark(c, "moe gemm: act");
    if (pl.n_local > 0)
        launch_k(c, moe_f8g_act_k, (unsigned)pl.n_local, 256, (size_t)I * sizeof(float), aq, as,
                 (const float *)hb, (const float *)xs, gu_scales, (const int32_t *)start, E,
                 (const int32_t *)slot, I, act);
    CU_TRY(cudaGetLastError(), "moe fp8 gemm: act");
    ds_cu_prof_mark(c, "moe gemm: down");
    prof = prof_gemm_open(c);
    for (int bk = 0; bk < pl.n_bk && pl.n_local > 0; bk++) {
        const int i0 = pl.bk_first[bk], cnt = pl.bk_first[bk + 1] - i0;
        if (lt_batched(c, h, CUDA_R_8F_E4M3, D, pl.bk_rows[bk], I, cnt, y16, dptrs + 3 * E + i0,
                       pl.ptrs + 3 * E + i0, E, done, err))
            return DS_ERR;
        if (!*done) { /* likewise */
            prof_gemm_close(c, prof, 0.0);
            return DS_OK;
        }
    }
    prof_gemm_close(c, prof, 2.0 * pl.n_local * D * I);
    ds_cu_prof_mark(c, "moe gemm: combine");
    if (moe_inverse(c, inv, perm, slot, rows, pl.n_local, err)) return DS_ERR;
    if (ds_cu_side_join(c, err)) return DS_ERR; /* out: see ds_cu_moe_experts */
    moe_combine_slots(c, out, y, y16, inv, w, as, dn_scales, idx, e0, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe fp8 gemm: combine");
    *done = 1;
    c->expert_gemm_runs++;
    return DS_OK;
}
