/* moe.cuh — what the routed experts' two files share: the activation a kernel applies as it
 * stages, the wmma kernel's tile sizes, and moe_tensor.cu's entry points. */
#ifndef DS_CUDA_MOE_CUH
#define DS_CUDA_MOE_CUH

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/lt.cuh"

struct moe_act {
    int on, situ;
    float beta, lin_beta;
};

/* four of a row's values (element i, a multiple of 4) from f32 or BF16 outputs */
static __device__ __forceinline__ float4 load4(const float *y, size_t i) {
    return *(const float4 *)(y + i);
}
static __device__ __forceinline__ float4 load4(const __nv_bfloat16 *y, size_t i) {
    const uint2 u = *(const uint2 *)(y + i);
    const float2 a = __bfloat1622float2(*(const __nv_bfloat162 *)&u.x),
                 b = __bfloat1622float2(*(const __nv_bfloat162 *)&u.y);
    return make_float4(a.x, a.y, b.x, b.y);
}

/* One token's ptpc FP8 routed experts on wgmma (matmul_fp8_wg.cu, ds_cu_set_f8_wg's bit 2):
 * whether they fit, and the two passes: h [k][2I] the gate|up sums, then y [k][D], routed row z
 * of expert direct[z] - e0 (gc [E][2I][D], gs [E][2I], dc [E][D][I], ds [E][D]), act between. */
bool fp8_wg_experts_fit(const ds_cu *c, int k, int D, int I, const void *gc, const void *dc);
int fp8_wg_experts(ds_cu *c, float *h, float *y, const float *x, int D, int I, int k,
                   const uint8_t *gc, const float *gs, const uint8_t *dc, const float *ds,
                   const int32_t *direct, int e0, int E, moe_act act, ds_err *err);

enum { MMA_ROWS = 16, MMA_N = 256, MMA_KC = 256, MMA_XLD = MMA_KC + 8, MMA_OLD = MMA_N + 4 };

/* The experts' gathers copy a routed row a warp, MOE_GATHER_ROWS rows a block: a block a row
 * leaves each thread a copy or two, so that issuing and retiring blocks, not the bytes, may set
 * the pace (the gather's profile row was well under the memory's rate: bench/RESULTS.md session
 * 47, which also measures this form against that one). */
enum { MOE_GATHER_ROWS = 8 };
/* n16 16-byte pieces from src to dst by the calling warp (both 16-byte aligned) */
static __device__ __forceinline__ void warp_copy16(void *dst, const void *src, int n16, int lane) {
    const uint4 *s = (const uint4 *)src;
    uint4 *d = (uint4 *)dst;
#pragma unroll 4
    for (int i = lane; i < n16; i += 32) d[i] = s[i];
}

/* The streaming mma kernels' (moe_tensor.cu's BF16, moe_fp8.cu's and moe_mxfp4.cu's) parts
 * around their k loop. A warp takes two 16-row weight tiles m of expert e (erows rows an expert):
 * UP, gate and up rows of act columns c0 .. c0 + 16; DOWN, rows c0 + 16 m .. (clamped to N - 1:
 * the store drops them). moe_mma_row: lane (g, l4)'s row h (g, or g + 8) of tile m. */
template <bool UP>
static __device__ __forceinline__ size_t moe_mma_row(int e, size_t erows, int N, int c0, int g,
                                                     int m, int h) {
    const int row = UP ? m * N + c0 + g + 8 * h : min(c0 + 16 * m + g + 8 * h, N - 1);
    return (size_t)e * erows + row;
}

/* Routed rows p0 + 8 nt + g of x (16-bit elements X [rows][K], rows from r1 on are past the
 * expert's: they read row r0 and xv says so) as the B operands of token tile nt, at the lane's
 * first piece (off uint4 into the row); the accumulators zeroed. */
template <int NT, typename X>
static __device__ __forceinline__ void moe_mma_tokens(const uint4 *(&xr)[NT], bool (&xv)[NT],
                                                      float (&acc)[2][NT][4], const X *x, int K,
                                                      int p0, int r0, int r1, int g, int off) {
    static_assert(sizeof(X) == 2, "16-bit token rows");
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        const int r = p0 + nt * 8 + g;
        xv[nt] = r < r1;
        xr[nt] = (const uint4 *)(x + (size_t)(xv[nt] ? r : r0) * K) + off;
#pragma unroll
        for (int i = 0; i < 4; i++) acc[0][nt][i] = acc[1][nt][i] = 0.0f;
    }
}

/* The streaming mma kernels' store of NT 8-token tiles (moe_tensor.cu's BF16 experts and
 * moe_mxfp4.cu's): accumulator tile m holds rows g (elements 0, 1) and g + 8 (2, 3), tokens
 * 2 l4 and 2 l4 + 1, of the routed rows p0 + 8 nt .. (those from r1 on are padding). UP: tiles 0
 * and 1 are gate and up rows of act column c0 + g (+ 8), whose activation goes out as BF16 act
 * rows [row][ldo]; DOWN: f32 rows [perm row][ldo], weight rows c0 + 16 m + g (+ 8) below N. */
template <int NT, bool UP>
static __device__ __forceinline__ void
moe_mma_store(void *out, int ldo, const float (&acc)[2][NT][4], const int32_t *perm, int p0, int r1,
              int c0, int N, int g, int l4, moe_act act) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int r = p0 + nt * 8 + 2 * l4 + j;
            if (r >= r1) continue;
            if (UP) {
                __nv_bfloat16 *ab = (__nv_bfloat16 *)out + (size_t)r * ldo + c0 + g;
                ab[0] = __float2bfloat16_rn(
                    act_pair(acc[0][nt][j], acc[1][nt][j], act.situ, act.beta, act.lin_beta));
                ab[8] = __float2bfloat16_rn(act_pair(acc[0][nt][2 + j], acc[1][nt][2 + j], act.situ,
                                                     act.beta, act.lin_beta));
            } else {
                float *y = (float *)out + (size_t)perm[r] * ldo;
#pragma unroll
                for (int m = 0; m < 2; m++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int row = c0 + 16 * m + g + 8 * h;
                        if (row < N) y[row] = acc[m][nt][2 * h + j];
                    }
            }
        }
}

/* A long step's expert GEMMs as a few pointer-array batches (moe_tensor.cu): moe_plan_make reads
 * the layout start [E+1] back to the host (a synchronisation: never while a graph is being
 * captured) and cuts the experts with rows into buckets; the caller fills ptrs, then
 * moe_plan_send copies panel and ptrs to dpanel [E] and dptrs [6][E] and writes each routed row's
 * slot [n_local] (its row in the panels); moe_inverse then makes inv [rows] (a routed row's slot,
 * -1 for another rank's expert) for the combine. */
enum { MOE_MAX_BUCKETS = 8 };
struct moe_plan {
    int32_t *order;    /* [n_act] host: the experts with rows, largest first (bucket order) */
    int32_t *panel;    /* [E] host: expert e's first padded row */
    const void **ptrs; /* [6][E] host (pinned): the batches' A, B, C of gate/up, then of down,
                        * entry i for order[i] */
    int bk_first[MOE_MAX_BUCKETS + 1]; /* bucket b: order[bk_first[b] .. bk_first[b + 1]) */
    int bk_rows[MOE_MAX_BUCKETS];      /* ... each with a panel of bk_rows[b] rows */
    int n_bk, n_act, n_local;          /* buckets, experts with rows, routed rows of this rank */
    size_t pr;                         /* padded rows of all panels (at least 1) */
};
int moe_plan_make(ds_cu *c, const int32_t *start, int E, moe_plan *p, ds_err *err);
int moe_plan_send(ds_cu *c, const moe_plan *p, int E, const int32_t *start, int32_t *dpanel,
                  void **dptrs, int32_t *slot, ds_err *err);
int moe_inverse(ds_cu *c, int32_t *inv, const int32_t *perm, const int32_t *slot, int rows,
                int n_local, ds_err *err);
/* out[t] (+)= sum_j w[t][j] y[inv[t k + j]] over the slots of this rank's experts, in order, y
 * [slots][D] f32 or BF16 (y16); with as (the FP8 experts' sums) each row scaled first as
 * (y[r][d] * as[r]) * ds[idx[t k + j] - e0][d]. One block a token (T of them), D % 4 == 0. Launch
 * errors are the caller's to read. */
void moe_combine_slots(ds_cu *c, float *out, const void *y, int y16, const int32_t *inv,
                       const float *w, const float *as, const float *ds, const int32_t *idx, int e0,
                       int T, int k, int D, int accumulate);
/* One bucket's products through cuBLASLt (h: lt_handle's): for its cnt experts i, C_i [n][N]
 * (f32, or BF16 with c16) = B_i [n][K] . A_i [N][K]^T with A and B of type in (E4M3 or BF16),
 * from the pointer arrays dp (device: A at dp[0], B at dp[E], C at dp[2E], this bucket's first
 * entry) as one pointer-array batch, or from hp (the host's) one call an expert where cuBLASLt has
 * no such algorithm (or lt_each asks). *done = 0 where it has none at all. */
int lt_batched(ds_cu *c, cublasLtHandle_t h, cudaDataType_t in, int N, int n, int K, int cnt,
               int c16, void *const *dp, const void *const *hp, int E, int *done, ds_err *err);

/* Rows per local expert, on average, from which the cuBLAS paths win (BF16 and FP8): below it
 * (decode of large batches: a few rows per expert) a cuBLAS call per expert costs more than the
 * streaming kernel reading each expert once, and the host round trip keeps the step out of
 * graphs. */
enum { EXPERT_GEMM_MIN_PER = 64 };

/* The routed experts of a step through cuBLAS (long steps: prefill), rows grouped by expert
 * (start [E+1], perm [T k]); never while a graph is being captured. */
int moe_experts_gemm(ds_cu *c, float *out, const float *x, const float *w, int T, int k, int E,
                     int D, int I, const uint16_t *gate_up, const uint16_t *down, int situ,
                     float situ_beta, float situ_lin_beta, int accumulate, const int32_t *start,
                     const int32_t *perm, ds_err *err);
/* The same for ptpc FP8 experts (moe_fp8_gemm.cu): codes [E][2I][D] and [E][D][I] with their
 * row scales, on FP8 tensor cores through cuBLASLt; groups its rows itself. *done = 0 (nothing
 * written) where cuBLASLt cannot run them: the caller's tile kernel then does. */
int moe_f8_experts_gemm(ds_cu *c, float *out, const float *x, const float *w, const int32_t *idx,
                        int T, int k, int E, int e0, int D, int I, const uint8_t *gu_codes,
                        const float *gu_scales, const uint8_t *dn_codes, const float *dn_scales,
                        moe_act act, int accumulate, int *done, ds_err *err);
/* The grouped experts' up and down passes on the streaming tensor-core kernels: h holds the BF16
 * rows (x [rows][D], then act [rows][I]), y [rows][D] the f32 outputs; ya blocks rows of experts.
 * Launch errors are the caller's to read. */
void moe_tc_experts(ds_cu *c, float *h, float *y, const float *x, int rows, unsigned ya, int D,
                    int I, int E, int k, const uint16_t *gate_up, const uint16_t *down,
                    const int32_t *start, const int32_t *perm, const int32_t *active,
                    const int32_t *n_active, moe_act act);
/* One grouped pass (N outputs, K inputs) on the wmma kernel moe_mma_k, ya blocks rows of experts.
 * Launch errors are the caller's to read. */
void moe_mma_pass(ds_cu *c, float *y, int ldy, const float *x, int ldx, int x_div,
                  const uint16_t *W, int N, int K, const int32_t *start, const int32_t *perm,
                  const int32_t *active, const int32_t *n_active, unsigned ya, moe_act act);

/* The experts' kernels' block rows (grid.y): grouped, one an expert with rows (at most E of the
 * rank's); one token's rows taken straight from idx (direct), one a routed row — all k of them,
 * even where the rank holds fewer than k experts (a local expert may sit in any slot). */
static inline unsigned moe_block_rows(int direct, int rows, int E) {
    return (unsigned)(direct ? rows : DS_MIN(E, rows));
}

/* Routed rows laid out by expert (moe_experts.cu): start [E+1], perm [rows], active [E],
 * n_active [1]; n_chunks > 0 (rows >= 1024): in chunks of 256 rows through hist
 * [n_chunks][E]. Launch errors are the caller's to read. */
enum { MOE_GCHUNK = 256 };
void moe_group_rows(ds_cu *c, const int32_t *idx, int rows, int e0, int E, int n_chunks,
                    int32_t *start, int32_t *perm, int32_t *active, int32_t *n_active,
                    int32_t *hist);
/* out[t] (+)= sum_j w[t][j] y[t k + j] over this rank's experts, slots in order. */
void moe_combine(ds_cu *c, float *out, const float *y, const float *w, const int32_t *idx, int e0,
                 int E, int T, int k, int D, int accumulate);

#endif
