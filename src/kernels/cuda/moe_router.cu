/* moe_router.cu — the MoE router: sigmoid scores, group-limited top-k, the weights (the CPU's
 * selection, kernels/shared/moe_topk.h). */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/moe_topk.h"

/* ---- MoE router --------------------------------------------------------------------------------
 * One block per token: sigmoid and selection scores in parallel into shared memory, then the
 * selection exactly as the CPU makes it (group scores as the sum of each group's two best, top
 * groups, then top k with ties to the lower index): without groups, warp 0 in k rounds; with
 * groups, one thread. */
__global__ void moe_route_k(int32_t *idx, float *w, const float *z, const float *bias, int E, int k,
                            int n_group, int topk_group, int renormalize, float scale,
                            int hf_kl_quirk) {
    PDL_ENTRY();
    extern __shared__ float rs[]; /* s [E] | sel [E] */
    float *sv = rs, *sel = rs + E;
    const int t = blockIdx.x;
    const float *zt = z + (size_t)t * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        sv[e] = 1.0f / (1.0f + expf(-zt[e]));
        float x = bias ? sv[e] + bias[e] : sv[e];
        sel[e] = isnan(x) ? -INFINITY : x; /* a NaN logit is never preferred to a real one */
    }
    __syncthreads();
    int32_t *it = idx + (size_t)t * k;
    float *wt = w + (size_t)t * k;
    const int grouped = n_group > 1 && topk_group > 0 && topk_group < n_group && E % n_group == 0;
    int count = 0;
    if (!grouped && E <= 1024) {
        /* Warp 0 takes the k best in turn: each lane its best untaken expert among e = lane + 32 i,
         * then a shuffle reduction; larger value first, the lower id on a tie — the order (and
         * set) the CPU's insertion gives, in k rounds of ~40 instructions instead of a serial
         * insertion over all E. */
        if (threadIdx.x >= 32) return;
        const int lane = threadIdx.x;
        uint32_t taken = 0;
        for (int j = 0; j < k && j < E; j++) {
            float bv = 0.0f;
            int be = -1;
            for (int i = 0, e = lane; e < E; i++, e += 32)
                if (!(taken >> i & 1) && (be < 0 || sel[e] > bv)) bv = sel[e], be = e;
            for (int o = 16; o > 0; o >>= 1) {
                float ov = __shfl_xor_sync(0xffffffffu, bv, o);
                int oe = __shfl_xor_sync(0xffffffffu, be, o);
                if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
            }
            if (be % 32 == lane) taken |= 1u << (be / 32);
            if (lane == 0) it[j] = be;
        }
        if (lane != 0) return;
        count = DS_MIN(k, E);
    } else {
        if (threadIdx.x != 0) return;
    }
    if (grouped) {
        float gval[64];
        int32_t gid[64];
        ds_moe_mask_groups(sel, E, n_group, topk_group, hf_kl_quirk, gval, gid);
    }
    float val[64];
    if (grouped || E > 1024)
        for (int e = 0; e < E; e++) count = ds_top_insert(val, it, count, k, sel[e], e);
    ds_moe_weights(it, wt, sv, bias, count, k, renormalize, scale, hf_kl_quirk);
}

extern "C" int ds_cu_moe_route(ds_cu *c, int32_t *idx, float *w, const float *z, const float *bias,
                               int T, int E, int k, int n_group, int topk_group, int renormalize,
                               float scale, int hf_kl_quirk, ds_err *err) {
    if (k < 1 || k > 64 || n_group > 64)
        return ds_errf(err, "cuda: moe route: k %d, %d groups (at most 64 each)", k, n_group);
    if (T <= 0) return DS_OK;
    size_t smem = 2 * (size_t)E * sizeof(float);
    if (smem > 48 * 1024)
        CU_TRY(cudaFuncSetAttribute(moe_route_k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem),
               "moe route: shared memory");
    launch_k(c, moe_route_k, T, 128, smem, idx, w, z, bias, E, k, n_group, topk_group, renormalize,
             scale, hf_kl_quirk);
    CU_TRY(cudaGetLastError(), "moe route");
    return DS_OK;
}
