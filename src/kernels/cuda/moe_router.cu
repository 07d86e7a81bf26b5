/* moe_router.cu — the MoE router: sigmoid scores, group-limited top-k, the weights (the CPU's
 * selection, kernels/shared/moe_topk.h). */
#include "kernels/cuda/common.cuh"
#include "kernels/shared/moe_topk.h"

/* ---- MoE router --------------------------------------------------------------------------------
 * One block per token: sigmoid and selection scores in parallel into shared memory, then the
 * selection exactly as the CPU makes it (group scores as the sum of each group's two best, top
 * groups, then top k with ties to the lower index): without groups, warp 0 in k rounds; with
 * groups, one thread. Every list the serial part reads and writes (the chosen ids, their
 * weights, the insertion's values, the groups') sits in shared memory, and the ids and weights go
 * out in one copy at the end: kept in the outputs in global memory, each of the serial part's
 * reads of a value it had just written waited a trip to L2, one after another. */
/* floats of that scratch after s and sel: ids, weights, values, group scores, group ids (64
 * each: k and the groups are at most 64) */
enum { ROUTE_SCRATCH = 5 * 64 };
__global__ void moe_route_k(int32_t *idx, float *w, const float *z, const float *bias, int E, int k,
                            int n_group, int topk_group, int renormalize, float scale,
                            int hf_kl_quirk) {
    PDL_ENTRY();
    extern __shared__ float rs[]; /* s [E] | sel [E] | ROUTE_SCRATCH */
    float *sv = rs, *sel = rs + E;
    int32_t *it = (int32_t *)(rs + 2 * E);                         /* [64] the chosen ids, then: */
    float *wt = rs + 2 * E + 64, *val = wt + 64, *gval = val + 64; /* [64] each */
    int32_t *gid = (int32_t *)(gval + 64);                         /* [64] */
    const int t = blockIdx.x;
    const float *zt = z + (size_t)t * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        sv[e] = 1.0f / (1.0f + expf(-zt[e]));
        float x = bias ? sv[e] + bias[e] : sv[e];
        sel[e] = isnan(x) ? -INFINITY : x; /* a NaN logit is never preferred to a real one */
    }
    __syncthreads();
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
        count = DS_MIN(k, E);
    } else {
        if (threadIdx.x >= 32) return;
    }
    if (threadIdx.x == 0) {
        if (grouped) ds_moe_mask_groups(sel, E, n_group, topk_group, hf_kl_quirk, gval, gid);
        if (grouped || E > 1024)
            for (int e = 0; e < E; e++) count = ds_top_insert(val, it, count, k, sel[e], e);
        ds_moe_weights(it, wt, sv, bias, count, k, renormalize, scale, hf_kl_quirk);
    }
    __syncwarp();
    for (int j = threadIdx.x; j < k; j += 32) { /* warp 0 */
        idx[(size_t)t * k + j] = it[j];
        w[(size_t)t * k + j] = wt[j];
    }
}

extern "C" int ds_cu_moe_route(ds_cu *c, int32_t *idx, float *w, const float *z, const float *bias,
                               int T, int E, int k, int n_group, int topk_group, int renormalize,
                               float scale, int hf_kl_quirk, ds_err *err) {
    if (k < 1 || k > 64 || n_group > 64)
        return ds_errf(err, "cuda: moe route: k %d, %d groups (at most 64 each)", k, n_group);
    if (T <= 0) return DS_OK;
    size_t smem = (2 * (size_t)E + ROUTE_SCRATCH) * sizeof(float);
    if (smem > 48 * 1024)
        CU_TRY(cudaFuncSetAttribute(moe_route_k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem),
               "moe route: shared memory");
    launch_k(c, moe_route_k, T, 128, smem, idx, w, z, bias, E, k, n_group, topk_group, renormalize,
             scale, hf_kl_quirk);
    CU_TRY(cudaGetLastError(), "moe route");
    return DS_OK;
}
