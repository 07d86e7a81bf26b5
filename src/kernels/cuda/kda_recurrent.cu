/* kda_recurrent.cu — the KDA recurrence token by token, its state in registers (decode, short
 * prompts); one sequence or a batch in one launch. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/kda.cuh"

/* ---- KDA recurrence ---------------------------------------------------------------------------
 * Each (head, value column) is independent. A thread keeps DK / SPLIT entries of its column of S
 * in registers for the whole call (S is read and written once), SPLIT neighbouring lanes sharing
 * a column and adding their partial dot products with a shuffle (SPLIT 2 at DK 128 keeps the
 * column in registers without spilling). Per token the block stages q, k and exp(g) in shared
 * memory. Blocks: (head, column tile, sequence); a batch of sequences is one launch. */

/* DVC: dv when known at compile time (0: run time). With dv a run-time value the state's 64
 * entries a thread had 64 addresses, kept live from the loads to the stores: far more registers
 * a thread at DK 128, two blocks an SM, and a batch-256 decode step's recurrences well under the
 * copy rate. With it each entry is a constant offset from one address: three blocks an SM (four
 * spill; bench/RESULTS.md session 18). */
template <int DK, int SPLIT, int DVC>
__device__ void kda_run(float *o, const float *q, const float *k, const float *v, const float *g,
                        const float *beta, float *Sh, float *S_rows, size_t rows_stride, int t0,
                        int t1, int H, int dv_rt, int h, int col, bool live, int part) {
    constexpr int DP = DK / SPLIT;     /* state entries of the column this thread holds */
    constexpr int PF = (DK + 31) / 32; /* q/k/g entries a thread stages per token, at most */
    const int dv = DVC ? DVC : dv_rt;
    __shared__ float qs[DK], ks[DK], ds[DK];
    float s[DP];
    const int c0 = part * DP;
    float *Sc = Sh + (size_t)c0 * dv + col; /* this thread's entry c at Sc[c dv] */
#pragma unroll
    for (int c = 0; c < DP; c++) s[c] = live ? __ldcg(Sc + (size_t)c * dv) : 0.0f;
    /* The state is read before waiting for the previous kernel (PDL): no kernel of this step
     * writes it before this one (the chunked kernel runs after; forks and restores are copies
     * done before the step), and every earlier kernel is complete here — this one starts only
     * once the one before it has passed its own wait. Through L2 (__ldcg), not a stale L1. A
     * decode step's recurrences waited on their state's latency after the wait. */
    PDL_ENTRY();
    /* token t + 1's inputs are loaded into registers while token t computes: a prefill walks
     * thousands of tokens in order, and waiting on each token's loads was most of its time */
    float nq[PF], nk[PF], ng[PF], nv = 0.0f, nb = 0.0f;
    auto fetch = [&](int t) {
        const size_t th = (size_t)t * H + h;
#pragma unroll
        for (int i = 0; i < PF; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < DK) nq[i] = q[th * DK + c], nk[i] = k[th * DK + c], ng[i] = g[th * DK + c];
        }
        if (live) nv = v[th * dv + col], nb = beta[th];
    };
    if (t0 < t1) fetch(t0);
    for (int t = t0; t < t1; t++) {
        const size_t th = (size_t)t * H + h;
        __syncthreads();
#pragma unroll
        for (int i = 0; i < PF; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < DK) qs[c] = nq[i], ks[c] = nk[i], ds[c] = expf(ng[i]);
        }
        const float vt = nv, bt = nb;
        if (t + 1 < t1) fetch(t + 1);
        __syncthreads();
        const float acc = kda_token<DP, SPLIT>(s, qs, ks, ds, c0, vt, bt, live);
        if (live) {
            if (part == 0) o[th * dv + col] = acc;
            if (S_rows) {
                float *R = S_rows + (size_t)(t - t0) * rows_stride + (size_t)h * DK * dv +
                           (size_t)c0 * dv + col;
#pragma unroll
                for (int c = 0; c < DP; c++) R[(size_t)c * dv] = s[c];
            }
        }
    }
    if (live)
#pragma unroll
        for (int c = 0; c < DP; c++) Sc[(size_t)c * dv] = s[c];
}

/* Sequence blockIdx.z: tokens [off[z], off[z+1]) of the packed q/k/v/g/beta/o, its state S[z]
 * ([H][DK][dv]) and optional rows S_rows[z] ([tokens][H][DK][dv]). */
template <int DK, int SPLIT, int DVC>
__global__ void __launch_bounds__(128)
    kda_batch_k(float *o, const float *q, const float *k, const float *v, const float *g,
                const float *beta, const int32_t *off, float *const *S, float *const *S_rows,
                size_t rows_stride, int H, int dv, int skip_from) {
    /* (the wait for the previous kernel is in kda_run, after the state's loads; off, S and
     * S_rows were uploaded before the step) */
    const int h = blockIdx.x, z = blockIdx.z, part = threadIdx.x % SPLIT;
    const int col = blockIdx.y * (blockDim.x / SPLIT) + threadIdx.x / SPLIT;
    /* long segments without rows are the chunked kernel's (ds_cu_kda_recurrent_batch) */
    if (skip_from > 0 && off[z + 1] - off[z] >= skip_from && !(S_rows && S_rows[z])) return;
    float *Sh = S[z] + (size_t)h * DK * dv;
    /* a NULL entry: this sequence keeps no rows */
    kda_run<DK, SPLIT, DVC>(o, q, k, v, g, beta, Sh, S_rows ? S_rows[z] : NULL, rows_stride, off[z],
                            off[z + 1], H, dv, h, col, col < dv, part);
}

/* One sequence, arguments by value (no device arrays to fill). */
template <int DK, int SPLIT, int DVC>
__global__ void __launch_bounds__(128)
    kda_one_k(float *o, const float *q, const float *k, const float *v, const float *g,
              const float *beta, float *S, float *S_rows, int T, int H, int dv) {
    /* (the wait for the previous kernel is in kda_run, after the state's loads) */
    const int h = blockIdx.x, part = threadIdx.x % SPLIT;
    const int col = blockIdx.y * (blockDim.x / SPLIT) + threadIdx.x / SPLIT;
    kda_run<DK, SPLIT, DVC>(o, q, k, v, g, beta, S + (size_t)h * DK * dv, S_rows,
                            (size_t)H * DK * dv, 0, T, H, dv, h, col, col < dv, part);
}

/* Threads per block and columns per block for a head dim. (More, smaller blocks at batch 1 —
 * four lanes a column, or 64 threads a block — were measured no faster: bench/RESULTS.md.) */
static void kda_shape(int dk, int dv, int *threads, int *cols) {
    int split = dk == 128 ? 2 : 1;
    int want = dv * split;
    *threads = want >= 128 ? 128 : (want + 31) / 32 * 32;
    *cols = *threads / split;
}

extern "C" int ds_cu_kda_recurrent(ds_cu *c, float *o, const float *q, const float *k,
                                   const float *v, const float *g, const float *beta, float *S,
                                   float *S_rows, int T, int H, int dk, int dv, ds_err *err) {
    if (T <= 0 || H <= 0) return DS_OK;
    int threads, cols;
    kda_shape(dk, dv, &threads, &cols);
    dim3 grid((unsigned)H, (unsigned)((dv + cols - 1) / cols));
    switch (dk) {
    case 16:
        launch_k(c, kda_one_k<16, 1, 0>, grid, threads, 0, o, q, k, v, g, beta, S, S_rows, T, H,
                 dv);
        break;
    case 32:
        launch_k(c, kda_one_k<32, 1, 0>, grid, threads, 0, o, q, k, v, g, beta, S, S_rows, T, H,
                 dv);
        break;
    case 64:
        launch_k(c, kda_one_k<64, 1, 0>, grid, threads, 0, o, q, k, v, g, beta, S, S_rows, T, H,
                 dv);
        break;
    case 128:
        launch_k(c, dv == 128 ? kda_one_k<128, 2, 128> : kda_one_k<128, 2, 0>, grid, threads, 0, o,
                 q, k, v, g, beta, S, S_rows, T, H, dv);
        break;
    default:
        return ds_errf(err, "cuda: kda_recurrent: head dim %d (16, 32, 64 or 128 supported)", dk);
    }
    CU_TRY(cudaGetLastError(), "kda_recurrent");
    return DS_OK;
}

extern "C" int ds_cu_kda_recurrent_batch(ds_cu *c, float *o, const float *q, const float *k,
                                         const float *v, const float *g, const float *beta,
                                         const int32_t *seg_off, float *const *S,
                                         float *const *S_rows, size_t rows_stride, int n_seq, int H,
                                         int dk, int dv, int skip_from, ds_err *err) {
    if (!rows_stride) rows_stride = (size_t)H * dk * dv;
    if (n_seq <= 0 || H <= 0) return DS_OK;
    int threads, cols;
    kda_shape(dk, dv, &threads, &cols);
    dim3 grid((unsigned)H, (unsigned)((dv + cols - 1) / cols), (unsigned)n_seq);
    switch (dk) {
    case 16:
        launch_k(c, kda_batch_k<16, 1, 0>, grid, threads, 0, o, q, k, v, g, beta, seg_off, S,
                 S_rows, rows_stride, H, dv, skip_from);
        break;
    case 32:
        launch_k(c, kda_batch_k<32, 1, 0>, grid, threads, 0, o, q, k, v, g, beta, seg_off, S,
                 S_rows, rows_stride, H, dv, skip_from);
        break;
    case 64:
        launch_k(c, kda_batch_k<64, 1, 0>, grid, threads, 0, o, q, k, v, g, beta, seg_off, S,
                 S_rows, rows_stride, H, dv, skip_from);
        break;
    case 128:
        launch_k(c, dv == 128 ? kda_batch_k<128, 2, 128> : kda_batch_k<128, 2, 0>, grid, threads, 0,
                 o, q, k, v, g, beta, seg_off, S, S_rows, rows_stride, H, dv, skip_from);
        break;
    default:
        return ds_errf(err, "cuda: kda_recurrent: head dim %d (16, 32, 64 or 128 supported)", dk);
    }
    CU_TRY(cudaGetLastError(), "kda_recurrent_batch");
    return DS_OK;
}
