/* mla_flash_wg.cu — expanded MLA attention of prompts (mla_expanded.cu's fused flash kernel) on
 * Hopper's warpgroup MMA. The mma.sync kernel has each of its four warps load every key and value
 * fragment of a tile from shared memory itself (ldmatrix), so a tile's operands cross the
 * shared-memory port four times; wgmma reads the B operand straight from shared memory once for
 * the whole warpgroup. A warpgroup takes 64 query rows of one head (four warps of 16 rows each,
 * as the mma.sync kernel's block), with the same online softmax in registers (mla.cuh's fl_*
 * pieces), the same BF16 rounding of Q, K, V and P and f32 accumulation: a sum in another order,
 * not other arithmetic. Three forms (DS_CUDA_MLA_FLASH 2-4): one warpgroup a block; two sharing
 * each staged tile; two with their products in flight beside the softmax. Fragment layouts as the
 * PTX ISA gives them for wgmma .m64nNk16: A in registers is per warp mma.m16n8k16's A fragment
 * (rows 16 w + g, + 8); the accumulator is per warp mma's C fragment repeated over the N / 8 column
 * tiles. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/mla.cuh"
#include "kernels/cuda/wgmma.cuh"

enum { WG_BQ = 64, WG_BK = FL_BK };

/* Shared memory of a stage: the key tile K-major (wgmma's B of S = Q K^T: N = keys, K = channels)
 * and the value tile MN-major (B of O = P V: K = keys, N = channels, rows as stored), both in
 * wgmma's 128-byte swizzle: blocks of 64 channels, each [64 keys][128 bytes] (8 KB, 1024-byte
 * aligned), the 16-byte chunk c of key row r stored at chunk c ^ (r % 8) of that row:
 *   key n, channel chunk c (8 BF16):   (c / 8) * 8192 + n * 128 + ((c % 8) ^ (n % 8)) * 16
 * the same for a value row. So a K-major descriptor steps 32 bytes a k-step of 16 channels
 * inside a block (8192 bytes to the next block), its stride offset (8 keys) 1024 bytes; an
 * MN-major one steps 2048 bytes a k-step of 16 keys, its stride offset (8 keys) 1024 bytes and
 * its leading offset (the next 64 channels) 8192. (Without the swizzle, in 128-byte core
 * matrices, both products ran at about half mma.sync's speed: bench/RESULTS.md session 45.)
 * A warp's cp.async writes fill four whole 128-byte rows: no bank conflicts. */
template <int DQ, int DV> struct wg_smem {
    static_assert(DQ % 64 == 0 && DV % 64 == 0, "64-channel blocks");
    static constexpr int K_BYTES = WG_BK * DQ * 2, V_BYTES = WG_BK * DV * 2;
    static constexpr size_t BYTES = (size_t)2 * (K_BYTES + V_BYTES) + 1024; /* (+ alignment) */
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Tile kb of keys and values (head h) into a stage's key and value tiles ks, vsm (swizzled; rows
 * past C zero-filled) by NT threads, every piece in flight at once, as one cp.async group */
template <int DQ, int DV, int NT>
static __device__ __forceinline__ void wg_stage(uint8_t *ks, uint8_t *vsm, const uint16_t *Kb,
                                                const uint16_t *Vb, int kb, int C, int Ha, int h,
                                                int tid) {
    constexpr int KP = DQ / 8, VP = DV / 8; /* 16-byte pieces of a key, a value row */
    static_assert((WG_BK * KP) % NT == 0 && (WG_BK * VP) % NT == 0, "tile split");
    const size_t qs = (size_t)Ha * DQ, vs = (size_t)Ha * DV;
#pragma unroll
    for (int x = 0; x < WG_BK * KP / NT; x++) { /* a warp: 4 keys x 8 chunks */
        const int i = tid + x * NT, n = (i >> 3) % WG_BK, c = (i >> 3) / WG_BK * 8 + (i & 7);
        const int row = kb + n;
        cp_async16_zfill(ks + wg_swz(n, c),
                         Kb + (size_t)min(row, C - 1) * qs + (size_t)h * DQ + c * 8, row < C);
    }
#pragma unroll
    for (int x = 0; x < WG_BK * VP / NT; x++) {
        const int i = tid + x * NT, k = (i >> 3) % WG_BK, c = (i >> 3) / WG_BK * 8 + (i & 7);
        const int row = kb + k;
        cp_async16_zfill(vsm + wg_swz(k, c),
                         Vb + (size_t)min(row, C - 1) * vs + (size_t)h * DV + c * 8, row < C);
    }
    cp_async_commit();
}

/* S (+)= Q K^T for one tile: the warp's query fragments qf, the tile's keys at ks (swizzled) */
template <int DQ>
static __device__ __forceinline__ void
wg_scores(float (&sc)[WG_BK / 8][4], const uint32_t (&qf)[DQ / 16][4], const uint8_t *ks) {
    wg_fence();
    wg_mma_n64_first(sc, qf[0], wg_desc(ks, 16, 1024), 0);
#pragma unroll
    for (int kk = 1; kk < DQ / 16; kk++) /* channels 16 kk: 32 bytes into block kk / 4 */
        wg_mma_n64(sc, qf[kk], wg_desc(ks + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024), 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* O += P V for one tile: P's fragments pa, the tile's values at vsm (swizzled) */
template <int DV>
static __device__ __forceinline__ void wg_values(float (&oacc)[DV / 8][4],
                                                 const uint32_t (&pa)[4][4], const uint8_t *vsm) {
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < WG_BK / 16; kk++) /* keys 16 kk: rows 16 kk of each block */
        wg_mma_n128_tb(oacc, pa[kk], wg_desc(vsm + kk * 2048, 8192, 1024), 1);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
#endif

/* o [T][Ha][DV] f32 and lse [T][Ha] (or NULL) from Qb [T][Ha][DQ], Kb [C][Ha][DQ], Vb [C][Ha][DV]
 * (BF16), causal as mla_flash_k (mla_expanded.cu): query t at position p0 + t sees keys j <=
 * p0 + t, j < C. */
/* long: the online softmax keeps each row's maximum, sum and output fragments in registers
 * across the pipelined tiles of keys, as mla_flash_k does. */
/* WGS warpgroups a block (1 or 2), each 64 query rows: two share each staged tile of keys and
 * values, so the tiles cross from L2 once for 128 rows instead of 64. */
template <int DQ, int DV, int WGS>
__global__ void __launch_bounds__(128 * WGS)
    mla_flash_wg_k(float *o, float *lse, const uint16_t *Qb, const uint16_t *Kb, const uint16_t *Vb,
                   int T, int C, int Ha, int p0, int causal, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    PDL_ENTRY();
    typedef wg_smem<DQ, DV> L;
    constexpr int NT = 128 * WGS;
    static_assert(DV == 128 && DQ % 16 == 0 && WG_BK == 64, "the wgmma shapes below");
    extern __shared__ __align__(128) uint8_t wsh_[];
    /* the swizzle's pattern repeats every 1024 bytes: the tiles start on such a boundary */
    uint8_t *wsh = wsh_ + ((1024 - ((uint32_t)__cvta_generic_to_shared(wsh_) & 1023)) & 1023);
    uint8_t *Ks = wsh;                  /* [2] key tiles */
    uint8_t *Vs = wsh + 2 * L::K_BYTES; /* [2] value tiles */
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, q0 = qb * WG_BQ * WGS;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, l4 = lane & 3;
    const int r0 = q0 + wg * WG_BQ + warp * 16 + g, r1 = r0 + 8;
    const int last = min(q0 + WG_BQ * WGS, T) - 1;
    const int n_end = fl_keys(last, T, C, p0, causal); /* the block's keys */
    /* this warpgroup's (fewer, causal, for the first of two; none for rows past T) */
    const int w_last = min(q0 + (wg + 1) * WG_BQ, T) - 1;
    const int w_end = q0 + wg * WG_BQ >= T ? 0 : fl_keys(w_last, T, C, p0, causal);
    auto stage = [&](int kb, int st) {
        wg_stage<DQ, DV, NT>(Ks + st * L::K_BYTES, Vs + st * L::V_BYTES, Kb, Vb, kb, C, Ha, h, tid);
    };
    if (n_end > 0) stage(0, 0);
    uint32_t qf[DQ / 16][4]; /* the warp's queries as A fragments */
    fl_load_q<DQ>(qf, Qb, r0, r1, T, Ha, h, l4);
    const int lim0 = fl_keys(r0, T, C, p0, causal);
    const int lim1 = fl_keys(r1, T, C, p0, causal);
    float oacc[DV / 8][4];
    fl_zero<DV>(oacc);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    for (int kb = 0, it = 0; kb < n_end; kb += WG_BK, it++) {
        const int st = it & 1;
        if (kb + WG_BK < n_end) {
            stage(kb + WG_BK, st ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            cp_async_wait_all();
        }
        /* what cp.async wrote, made visible to wgmma's reads (the async proxy), then to all */
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        if (kb < w_end) { /* (uniform in the warpgroup, as wgmma needs) */
            const uint8_t *ks = Ks + st * L::K_BYTES, *vsm = Vs + st * L::V_BYTES;
            float sc[WG_BK / 8][4];
            uint32_t pa[WG_BK / 16][4];
            wg_scores<DQ>(sc, qf, ks);
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            float a0, a1;
            fl_softmax(sc, m0, m1, l0, l1, a0, a1, kb, lim0, lim1, l4, scale);
            fl_rescale<DV>(oacc, a0, a1);
            fl_pack(sc, pa);
            wg_values<DV>(oacc, pa, vsm);
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
        __syncthreads(); /* this stage is refilled two tiles on */
    }
    fl_store<DV>(o, lse, oacc, m0, m1, l0, l1, r0, r1, T, Ha, h, l4);
#else
    __trap(); /* launched only where ds_cu's sm90 is set: Hopper runs the sm_90a code */
#endif
}

/* The same on two warpgroups a block with each warpgroup's products in flight beside its own
 * softmax (mode 4): per tile j, S_j = Q K_j is issued, then P_{j-1} V_{j-1} behind it; tile j's
 * softmax runs while that product does, and once it is done P_j is packed and the output rescaled
 * by tile j's factors (no register a product is writing is touched meanwhile). So the tensor cores
 * have work queued while the warpgroup exponentiates. Three stages: tile j - 1's values, tile j's
 * keys and tile j + 1 on its way; tile j + 2 goes into the stage of j - 1 once every warpgroup's
 * P_{j-1} V_{j-1} is done (a barrier after the wait). */
/* long: the walk issues, waits and softmaxes in the order above, every warpgroup every tile. */
template <int DQ, int DV>
__global__ void __launch_bounds__(256)
    mla_flash_wgp_k(float *o, float *lse, const uint16_t *Qb, const uint16_t *Kb,
                    const uint16_t *Vb, int T, int C, int Ha, int p0, int causal, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    PDL_ENTRY();
    typedef wg_smem<DQ, DV> L;
    constexpr int NT = 256, NS = 3;
    static_assert(DV == 128 && DQ % 16 == 0 && WG_BK == 64, "the wgmma shapes below");
    extern __shared__ __align__(128) uint8_t wsh_[];
    uint8_t *wsh = wsh_ + ((1024 - ((uint32_t)__cvta_generic_to_shared(wsh_) & 1023)) & 1023);
    uint8_t *Ks = wsh;                   /* [NS] key tiles */
    uint8_t *Vs = wsh + NS * L::K_BYTES; /* [NS] value tiles */
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, q0 = qb * WG_BQ * 2;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
    const int g = lane >> 2, l4 = lane & 3;
    const int r0 = q0 + wg * WG_BQ + warp * 16 + g, r1 = r0 + 8;
    const int last = min(q0 + WG_BQ * 2, T) - 1;
    const int n_end = fl_keys(last, T, C, p0, causal);
    const int n_t = (n_end + WG_BK - 1) / WG_BK; /* tiles */
    auto stage = [&](int t) {
        wg_stage<DQ, DV, NT>(Ks + (t % NS) * L::K_BYTES, Vs + (t % NS) * L::V_BYTES, Kb, Vb,
                             t * WG_BK, C, Ha, h, tid);
    };
    if (n_t > 0) stage(0);
    if (n_t > 1) stage(1);
    uint32_t qf[DQ / 16][4];
    fl_load_q<DQ>(qf, Qb, r0, r1, T, Ha, h, l4);
    const int lim0 = fl_keys(r0, T, C, p0, causal);
    const int lim1 = fl_keys(r1, T, C, p0, causal);
    float oacc[DV / 8][4];
    fl_zero<DV>(oacc);
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f, a0 = 1.0f, a1 = 1.0f;
    float sc[WG_BK / 8][4];
    uint32_t pa[WG_BK / 16][4];
    for (int j = 0; j < n_t; j++) {
        if (j + 1 < n_t) /* tile j landed (j + 1 may still be on its way) */
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        else
            cp_async_wait_all();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        /* (both warpgroups take every tile, the first's last fully masked at the diagonal: a
         * branch on the warpgroup made ptxas serialize the wgmma) */
        wg_scores<DQ>(sc, qf, Ks + (j % NS) * L::K_BYTES);
        if (j >= 1) wg_values<DV>(oacc, pa, Vs + ((j - 1) % NS) * L::V_BYTES);
        if (j >= 1) /* S_j done, P_{j-1} V_{j-1} still running */
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        else
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        fl_softmax(sc, m0, m1, l0, l1, a0, a1, j * WG_BK, lim0, lim1, l4, scale);
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        __syncthreads(); /* every warpgroup is done with tile j - 1: tile j + 2 takes its stage */
        if (j + 2 < n_t) stage(j + 2);
        fl_pack(sc, pa);
        fl_rescale<DV>(oacc, a0, a1); /* (no product in flight: the next P V adds to it) */
    }
    if (n_t >= 1) { /* the last tile's P V */
        wg_values<DV>(oacc, pa, Vs + ((n_t - 1) % NS) * L::V_BYTES);
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    fl_store<DV>(o, lse, oacc, m0, m1, l0, l1, r0, r1, T, Ha, h, l4);
#else
    __trap(); /* launched only where ds_cu's sm90 is set: Hopper runs the sm_90a code */
#endif
}

int mla_flash_wg_launch(ds_cu *c, float *o, float *lse, const uint16_t *Qb, const uint16_t *Kb,
                        const uint16_t *Vb, int T, int C, int Ha, int p0, int causal, float scale,
                        int form, ds_err *err) {
    typedef wg_smem<192, 128> L;
    const size_t pipe_bytes = (size_t)3 * (L::K_BYTES + L::V_BYTES) + 1024; /* three stages */
    if (!c->mla_wg_smem) { /* once: prefills are never captured */
        CU_TRY(cudaFuncSetAttribute(mla_flash_wg_k<192, 128, 1>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::BYTES),
               "mla (fused, wgmma): shared memory");
        CU_TRY(cudaFuncSetAttribute(mla_flash_wg_k<192, 128, 2>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::BYTES),
               "mla (fused, wgmma): shared memory");
        CU_TRY(cudaFuncSetAttribute(mla_flash_wgp_k<192, 128>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)pipe_bytes),
               "mla (fused, wgmma): shared memory");
        c->mla_wg_smem = 1;
    }
    const unsigned rows = WG_BQ * (form >= 2 ? 2 : 1);
    const dim3 grid((unsigned)((T + rows - 1) / rows), (unsigned)Ha);
    if (form == 3)
        launch_k(c, mla_flash_wgp_k<192, 128>, grid, 256, pipe_bytes, o, lse, Qb, Kb, Vb, T, C, Ha,
                 p0, causal, scale);
    else
        launch_k(c, form == 2 ? mla_flash_wg_k<192, 128, 2> : mla_flash_wg_k<192, 128, 1>, grid,
                 2 * rows, L::BYTES, o, lse, Qb, Kb, Vb, T, C, Ha, p0, causal, scale);
    CU_TRY(cudaGetLastError(), "mla (fused, wgmma)");
    return DS_OK;
}
