/* moe_router.cu — the MoE router: sigmoid scores, group-limited top-k, the weights (the CPU's
 * selection, kernels/shared/moe_topk.h); for a few tokens, the router's product and that choice
 * in one launch. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemv.cuh"
#include "kernels/shared/moe_topk.h"

#define ROUTE_SMEM(E) ((2 * (size_t)(E) + 192) * sizeof(float))

/* ---- MoE router --------------------------------------------------------------------------------
 * One token's choice by one block (every thread calls it): sigmoid and selection scores in
 * parallel into shared memory (rs [ROUTE_SMEM(E)]: s [E] | sel [E] | the serial part's group
 * scores [64], group ids [64] and top values [64], there rather than on a stack), then the selection exactly as the CPU makes
 * it (group scores as the sum of each group's two best, top groups, then top k with ties to the
 * lower index): without groups, warp 0 in k rounds; with groups, one thread. zt is read through L2
 * (__ldcg): in the fused kernel other blocks wrote it in this launch. */
static __device__ __forceinline__ void route_token(int32_t *it, float *wt, const float *zt,
                                                const float *bias, int E, int k, int n_group,
                                                int topk_group, int renormalize, float scale,
                                                int hf_kl_quirk, float *rs) {
    float *sv = rs, *sel = rs + E;
    __syncthreads(); /* (a previous token's choice is done with rs) */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        sv[e] = 1.0f / (1.0f + expf(-__ldcg(zt + e)));
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
        if (lane != 0) return;
        count = DS_MIN(k, E);
    } else {
        if (threadIdx.x != 0) return;
    }
    if (grouped) {
        float *gval = rs + 2 * E;
        int32_t *gid = (int32_t *)(gval + 64);
        ds_moe_mask_groups(sel, E, n_group, topk_group, hf_kl_quirk, gval, gid);
    }
    float *val = rs + 2 * E + 128;
    if (grouped || E > 1024)
        for (int e = 0; e < E; e++) count = ds_top_insert(val, it, count, k, sel[e], e);
    ds_moe_weights(it, wt, sv, bias, count, k, renormalize, scale, hf_kl_quirk);
}

/* What the choice needs besides the logits (the kernels' argument). */
struct route_args {
    int32_t *idx; /* [T][k] */
    float *w;     /* [T][k] */
    const float *bias;
    int E, k, n_group, topk_group, renormalize, hf_kl_quirk;
    float scale;
};

/* one block a token */
__global__ void moe_route_k(const float *z, route_args a) {
    PDL_ENTRY();
    extern __shared__ float rs[]; /* [ROUTE_SMEM(E)] */
    const int t = blockIdx.x;
    route_token(a.idx + (size_t)t * a.k, a.w + (size_t)t * a.k, z + (size_t)t * a.E, a.bias, a.E,
                a.k, a.n_group, a.topk_group, a.renormalize, a.scale, a.hf_kl_quirk, rs);
}

/* The router's product z [TT][E] = x W^T (gemv.cuh's block: the bits of ds_cu_matmul's) and, in
 * the block that finishes it last (last_arrival), every token's choice: a decode step's two
 * dependent launches as one. count: this op's last_arrival count. (The bounds' minimum of one
 * block an SM: without it ptxas held the kernel to 32 registers and spilled in the stream.) */
template <int TT>
__global__ void __launch_bounds__(256, 1)
    router_fused_k(float *z, const float *x, int ldx, const uint16_t *W, int K, int S, int *count,
                   route_args a) {
    extern __shared__ float rs[]; /* [ROUTE_SMEM(E)] */
    gemv_bf16_block<TT>(z, a.E, x, ldx, W, a.E, K, 0, 0, 0, S);
    if (!last_arrival(count, (int)gridDim.x)) return;
    for (int t = 0; t < TT; t++) /* (every thread returns from each, some early) */
        route_token(a.idx + (size_t)t * a.k, a.w + (size_t)t * a.k, z + (size_t)t * a.E, a.bias,
                    a.E, a.k, a.n_group, a.topk_group, a.renormalize, a.scale, a.hf_kl_quirk, rs);
}

static int route_check(int k, int n_group, size_t smem, ds_err *err) {
    if (k < 1 || k > 64 || n_group > 64)
        return ds_errf(err, "cuda: moe route: k %d, %d groups (at most 64 each)", k, n_group);
    if (smem > 200 * 1024) return ds_errf(err, "cuda: moe route: %zu bytes of scores", smem);
    return DS_OK;
}

extern "C" int ds_cu_moe_route(ds_cu *c, int32_t *idx, float *w, const float *z, const float *bias,
                               int T, int E, int k, int n_group, int topk_group, int renormalize,
                               float scale, int hf_kl_quirk, ds_err *err) {
    const size_t smem = ROUTE_SMEM(E);
    if (route_check(k, n_group, smem, err)) return DS_ERR;
    if (T <= 0) return DS_OK;
    if (smem > 48 * 1024)
        CU_TRY(cudaFuncSetAttribute(moe_route_k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem),
               "moe route: shared memory");
    const route_args a = {idx, w, bias, E, k, n_group, topk_group, renormalize, hf_kl_quirk, scale};
    launch_k(c, moe_route_k, T, 128, smem, z, a);
    CU_TRY(cudaGetLastError(), "moe route");
    return DS_OK;
}

extern "C" void ds_cu_set_router_fused(ds_cu *c, int on) {
    c->router_fused = on;
}

/* Tokens up to which the router's product and choice run as one launch: the streaming product's
 * own bound (ds_cu_matmul), and at most 2 (the instances compiled). */
enum { ROUTER_FUSED_MAX_T = 2 };

extern "C" int ds_cu_moe_router(ds_cu *c, float *z, int32_t *idx, float *w, const float *x, int T,
                                const ds_cu_mat *router, const float *bias, int k, int n_group,
                                int topk_group, int renormalize, float scale, int hf_kl_quirk,
                                ds_err *err) {
    const int E = router->rows, K = router->cols;
    const size_t smem = ROUTE_SMEM(E);
    if (route_check(k, n_group, smem, err)) return DS_ERR;
    if (T <= 0) return DS_OK;
    const int vec = K % 8 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)router->data % 16 == 0;
    if (!c->router_fused || router->runs || router->dtype != DS_CU_BF16 || !vec ||
        T > DS_MIN(gemv_rows_max(c), ROUTER_FUSED_MAX_T) || smem > 48 * 1024) {
        if (ds_cu_matmul(c, z, E, x, K, T, router, err)) return DS_ERR;
        return ds_cu_moe_route(c, idx, w, z, bias, T, E, k, n_group, topk_group, renormalize, scale,
                               hf_kl_quirk, err);
    }
    /* the weight stream's first bytes prefetched into L2 meanwhile, as ds_cu_matmul's */
    if (cu_l2_prefetch(c, router->data, (size_t)E * K * 2, err)) return DS_ERR;
    const int S = gemv_splits(c, E, K, 1);
    const route_args a = {idx, w, bias, E, k, n_group, topk_group, renormalize, hf_kl_quirk, scale};
    const unsigned blocks = (unsigned)gemv_blocks(E, S);
    int *count = c->counts + CU_COUNT_ROUTER;
    if (T == 1)
        launch_k(c, router_fused_k<1>, blocks, 256, smem, z, x, K, router->data, K, S, count, a);
    else
        launch_k(c, router_fused_k<2>, blocks, 256, smem, z, x, K, router->data, K, S, count, a);
    CU_TRY(cudaGetLastError(), "moe router (fused)");
    return ds_cu_l2_mark(c, err);
}
