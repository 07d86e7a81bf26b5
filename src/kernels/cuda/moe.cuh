/* moe.cuh — what the routed experts' two files share: the activation a kernel applies as it
 * stages, the wmma kernel's tile sizes, and moe_tensor.cu's entry points. */
#ifndef DS_CUDA_MOE_CUH
#define DS_CUDA_MOE_CUH

#include "kernels/cuda/common.cuh"

struct moe_act {
    int on, situ;
    float beta, lin_beta;
};

/* One token's weighted sum over its k routed rows, made inside the down pass (one token, rows
 * straight from idx) by the block that finishes an output tile last (last_arrival): out [N] (+)=
 * sum_j w[j] y[j] over this rank's experts, slots in order — moe_combine_k's sums, one launch
 * fewer. out NULL: none (moe_combine runs after). */
struct moe_comb {
    float *out;         /* [N] */
    const float *w;     /* [k] */
    const int32_t *idx; /* [k] global expert ids */
    int *counts;        /* [tiles] last_arrival's counts, one an output tile (grid.x) */
    int k, accumulate;
};

/* The sum for outputs [n0, n1) of this block's tile, once every routed row's block has written
 * its part of y [k][ldy] (every thread of every block calls it once). e0, E: this rank's experts.
 */
static __device__ inline void moe_comb_tile(const moe_comb &cb, const float *y, int ldy, int n0,
                                            int n1, int e0, int E) {
    if (!last_arrival(cb.counts + blockIdx.x, (int)gridDim.y)) return;
    for (int n = n0 + (int)threadIdx.x; n < n1; n += (int)blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < cb.k; j++) {
            const int e = cb.idx[j] - e0;
            if (e >= 0 && e < E) acc += cb.w[j] * __ldcg(y + (size_t)j * ldy + n);
        }
        cb.out[n] = cb.accumulate ? cb.out[n] + acc : acc;
    }
}

enum { MMA_ROWS = 16, MMA_N = 256, MMA_KC = 256, MMA_XLD = MMA_KC + 8, MMA_OLD = MMA_N + 4 };

/* The routed experts of a step through cuBLAS (long steps: prefill), rows grouped by expert
 * (start [E+1], perm [T k]); never while a graph is being captured. */
int moe_experts_gemm(ds_cu *c, float *out, const float *x, const float *w, int T, int k, int E,
                     int D, int I, const uint16_t *gate_up, const uint16_t *down, int situ,
                     float situ_beta, float situ_lin_beta, int accumulate, const int32_t *start,
                     const int32_t *perm, ds_err *err);
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
