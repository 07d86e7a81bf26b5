/* moe_experts.cu — the routed experts: grouping rows by expert, the weight-streaming expert
 * kernels (and the wide one-token GEMV built on them), the combine, and ds_cu_moe_experts, which
 * picks among these, moe_tensor.cu's tensor-core kernels and its cuBLAS path. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.cuh"

/* a[r][i] = act(gate, up) with gate = h[r][i], up = h[r][I + i]; in place into the gate half.
 * Thread x of the grid takes column x of rows blockIdx.y, + gridDim.y, ... (no division). */
__global__ void moe_act_k(float *h, int rows, int I, int situ, float beta, float lin_beta) {
    PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= I) return;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        float *hr = h + (size_t)r * 2 * I;
        hr[c] = act_pair(hr[c], hr[I + c], situ, beta, lin_beta);
    }
}

extern "C" void ds_cu_act_pairs(ds_cu *c, float *h, int rows, int I, int situ, float beta,
                                float lin_beta) {
    if (rows <= 0 || I <= 0) return;
    launch_k(c, moe_act_k, dim3((unsigned)((I + 255) / 256), (unsigned)DS_MIN(rows, 65535)), 256, 0,
             h, rows, I, situ, beta, lin_beta);
    note_launch(c);
}

/* ---- MoE routed experts ------------------------------------------------------------------------
 * A first version for decode-sized batches: every routed (token, slot) row is its own GEMV over
 * its expert's weights (one warp per output, as gemv_bf16_k), so an expert's weights are read
 * once per row routed to it; then the k rows of a token are combined in slot order (no atomics:
 * the same bits every run). Grouping rows by expert for tensor-core GEMMs is the prefill path. */
__global__ void __launch_bounds__(256)
    moe_up_k(float *h, const float *x, const int32_t *idx, int k, int D, int I2,
             const uint16_t *gate_up, int e0, int E) {
    PDL_ENTRY();
    const int r = blockIdx.y, t = r / k, lane = threadIdx.x & 31;
    const int n = blockIdx.x * 8 + (threadIdx.x >> 5), e = idx[r] - e0;
    if (n >= I2 || e < 0 || e >= E) return; /* another rank's expert: the combine skips it */
    const uint16_t *wr = gate_up + ((size_t)e * I2 + n) * D;
    const float *xt = x + (size_t)t * D;
    float acc = 0.0f;
    for (int c = lane; c < D; c += 32) acc += __uint_as_float((uint32_t)wr[c] << 16) * xt[c];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) h[(size_t)r * I2 + n] = acc;
}

__global__ void __launch_bounds__(256)
    moe_down_k(float *y, const float *h, const int32_t *idx, int D, int I, const uint16_t *down,
               int e0, int E) {
    PDL_ENTRY();
    const int r = blockIdx.y, lane = threadIdx.x & 31, d = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int e = idx[r] - e0;
    if (d >= D || e < 0 || e >= E) return;
    const uint16_t *wr = down + ((size_t)e * D + d) * I;
    const float *a = h + (size_t)r * 2 * I;
    float acc = 0.0f;
    for (int c = lane; c < I; c += 32) acc += __uint_as_float((uint32_t)wr[c] << 16) * a[c];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[(size_t)r * D + d] = acc;
}

/* Only this rank's experts [e0, e0 + E) count: under tensor parallelism the others' rows are
 * summed on their ranks and added by the all-reduce. */
__global__ void moe_combine_k(float *out, const float *y, const float *w, const int32_t *idx,
                              int e0, int E, int T, int k, int D, int accumulate) {
    PDL_ENTRY();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)T * D) return;
    const size_t t = i / D, d = i % D;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        const int e = idx[t * k + j] - e0;
        if (e >= 0 && e < E) acc += w[t * k + j] * y[(t * k + j) * D + d];
    }
    out[i] = accumulate ? out[i] + acc : acc;
}

/* Grouping routed rows by expert, so that a step reads each chosen expert's weights once (one row
 * per token per slot re-read them for every row: at batch 256 that was 30 GB a layer). One block:
 * thread e counts expert e's rows, thread 0 lays the experts out in id order, then each thread
 * lists its rows in row order — the same grouping every run, whatever the thread timing.
 * start [E+1] (rows of expert e: perm[start[e] .. start[e+1])), perm [rows], active [E] the
 * experts with rows, n_active [1]. */
__global__ void moe_group_k(const int32_t *idx, int rows, int e0, int E, int32_t *start,
                            int32_t *perm, int32_t *active, int32_t *n_active) {
    PDL_ENTRY();
    extern __shared__ int32_t cnt[]; /* [E + 1] counts, then starts (shared: the serial layout
                                        pass below would otherwise wait on global memory) */
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e + 1] = 0;
    __syncthreads();
    for (int r = threadIdx.x; r < rows; r += blockDim.x) { /* this rank's experts only */
        const int e = idx[r] - e0;
        if (e >= 0 && e < E) atomicAdd(&cnt[e + 1], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) { /* counts are the same whatever the atomics' order */
        int at = 0, na = 0;
        cnt[0] = 0;
        for (int e = 0; e < E; e++) {
            int n = cnt[e + 1];
            if (n) active[na++] = e;
            cnt[e + 1] = at += n;
        }
        *n_active = na;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) start[e] = cnt[e];
    /* each expert's rows in row order: thread e walks the rows it owns */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int at = cnt[e], end = cnt[e + 1];
        for (int r = 0; r < rows && at < end; r++)
            if (idx[r] - e0 == e) perm[at++] = r;
    }
}

/* The same layout for many routed rows (prefill), in three launches instead of one block walking
 * every row per expert: per chunk of MOE_GCHUNK rows the experts' counts (hist [n_chunks][E]);
 * one block turns them into start / active and each chunk's first slot per expert; one warp per
 * chunk places its rows, 32 at a time in row order (lanes of one expert ranked by lane), so perm
 * is exactly moe_group_k's. */
__global__ void moe_hist_k(const int32_t *idx, int rows, int e0, int E, int32_t *hist) {
    PDL_ENTRY();
    extern __shared__ int32_t cnt[]; /* [E] */
    for (int e = threadIdx.x; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    const int r0 = blockIdx.x * MOE_GCHUNK, r1 = min(rows, r0 + MOE_GCHUNK);
    for (int r = r0 + threadIdx.x; r < r1; r += blockDim.x) {
        const int e = idx[r] - e0;
        if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) hist[(size_t)blockIdx.x * E + e] = cnt[e];
}

__global__ void moe_scan_k(int32_t *hist, int n_chunks, int E, int32_t *start, int32_t *active,
                           int32_t *n_active) {
    PDL_ENTRY();
    extern __shared__ int32_t tot[]; /* [E + 1]: counts, then starts */
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int n = 0;
        for (int ch = 0; ch < n_chunks; ch++) n += hist[(size_t)ch * E + e];
        tot[e + 1] = n;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0, na = 0;
        tot[0] = 0;
        for (int e = 0; e < E; e++) {
            const int n = tot[e + 1];
            if (n) active[na++] = e;
            tot[e + 1] = at += n;
        }
        *n_active = na;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= E; e += blockDim.x) start[e] = tot[e];
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* counts -> each chunk's first slot */
        int at = tot[e];
        for (int ch = 0; ch < n_chunks; ch++) {
            const int n = hist[(size_t)ch * E + e];
            hist[(size_t)ch * E + e] = at;
            at += n;
        }
    }
}

__global__ void moe_place_k(const int32_t *idx, int rows, int e0, int E, const int32_t *hist,
                            int32_t *perm) {
    PDL_ENTRY();
    extern __shared__ int32_t base[]; /* [E] this chunk's next slot per expert */
    const int lane = threadIdx.x;
    for (int e = lane; e < E; e += 32) base[e] = hist[(size_t)blockIdx.x * E + e];
    __syncwarp();
    const int r0 = blockIdx.x * MOE_GCHUNK, r1 = min(rows, r0 + MOE_GCHUNK);
    for (int a = r0; a < r1; a += 32) {
        const int r = a + lane;
        int e = r < r1 ? idx[r] - e0 : -1;
        if (e < 0 || e >= E) e = -1; /* another rank's expert, or past the chunk */
        const unsigned same = __match_any_sync(0xffffffffu, e);
        const int rank = __popc(same & ((1u << lane) - 1u));
        if (e >= 0) perm[base[e] + rank] = r;
        __syncwarp();
        if (e >= 0 && rank == 0) base[e] += __popc(same);
        __syncwarp();
    }
}

void moe_group_rows(ds_cu *c, const int32_t *idx, int rows, int e0, int E, int n_chunks,
                    int32_t *start, int32_t *perm, int32_t *active, int32_t *n_active,
                    int32_t *hist) {
    if (n_chunks) {
        launch_k(c, moe_hist_k, n_chunks, 256, (size_t)E * sizeof(int32_t), idx, rows, e0, E, hist);
        launch_k(c, moe_scan_k, 1, 256, ((size_t)E + 1) * sizeof(int32_t), hist, n_chunks, E, start,
                 active, n_active);
        launch_k(c, moe_place_k, n_chunks, 32, (size_t)E * sizeof(int32_t), idx, rows, e0, E, hist,
                 perm);
    } else {
        launch_k(c, moe_group_k, 1, 256, ((size_t)E + 1) * sizeof(int32_t), idx, rows, e0, E, start,
                 perm, active, n_active);
    }
}

void moe_combine(ds_cu *c, float *out, const float *y, const float *w, const int32_t *idx, int e0,
                 int E, int T, int k, int D, int accumulate) {
    launch_k(c, moe_combine_k, (unsigned)(((size_t)T * D + 255) / 256), 256, 0, out, y, w, idx, e0,
             E, T, k, D, accumulate);
}

/* y[perm row][n] = W_e[n] . x[row's input] for every row of active expert e = active[blockIdx.y]:
 * each warp streams MOE_NPW weight rows n once (16-byte loads, several in flight) for up to 8 of
 * the expert's rows at a time, staged in shared memory once per block: a block covers 8 MOE_NPW
 * outputs, so the staging (re-read from L2 by every block) is a quarter of what it was with one
 * output per warp — at batch 256 that traffic, twice the weights', bounded the kernel. A row's
 * dot product takes the same operations however many rows share the pass, so its bits do not
 * depend on the batch. x rows: x + (perm / x_div) * ldx; K % 8 == 0. With act (the down
 * projection), a row of x is gate | up ([2K]) and act(gate, up) is what gets staged: the
 * activation pass of its own is gone, with the same bits (act_pair). */

/* The experts' weight streaming: acc[j][i] += this lane's share of W_j . x_i for NPW weight rows
 * wr[j] (K BF16 each; u0[j], their first pieces, already loaded when lk) and the pass's nr <= RPM
 * x rows xs[i] in shared memory; the warp's shuffle tree follows in the caller. Kept apart from
 * moe_grouped_k so that any other kernel streaming expert rows takes the same operations, and so
 * gives the same bits. */
template <int NPW, int RPM>
__device__ __forceinline__ void
stream_rows_dot(float (&acc)[NPW][RPM], const uint4 (&u0)[NPW], const uint4 *const (&wr)[NPW],
                const float *const (&xs)[RPM], int nr, int K, int lane, bool lk) {
    if (lk)
#pragma unroll
        for (int i = 0; i < RPM; i++)
            if (i < nr)
#pragma unroll
                for (int j = 0; j < NPW; j++) acc[j][i] += dot8(u0[j], xs[i] + (size_t)lane * 8);
#pragma unroll 2
    for (int k8 = lane + 32; k8 < K / 8; k8 += 32) {
        uint4 u[NPW];
#pragma unroll
        for (int j = 0; j < NPW; j++) u[j] = __ldg(wr[j] + k8);
#pragma unroll
        for (int i = 0; i < RPM; i++)
            if (i < nr)
#pragma unroll
                for (int j = 0; j < NPW; j++) acc[j][i] += dot8(u[j], xs[i] + (size_t)k8 * 8);
    }
}
/* RPM: rows a pass holds at most (rp <= RPM), its accumulators' count; NPW: weight rows a warp
 * streams (8 NPW a block) */
template <int RPM, int NPW>
__global__ void __launch_bounds__(256)
    moe_grouped_k(float *y, int ldy, const float *x, int ldx, int x_div, const uint16_t *W, int N,
                  int K, const int32_t *start, const int32_t *perm, const int32_t *active,
                  const int32_t *n_active, int rp, moe_act act, const int32_t *direct, int e0,
                  int E, int early) {
    /* early (the down pass, with ds_cu_set_early_experts; a one-token matmul, whose routing is a
     * constant, with ds_cu_set_wide_early): the routing is at least two kernels old (the up pass
     * came between), so it and the first weights are read before waiting for the previous kernel
     * (through L2); x, the up pass's output, after */
    if (!early) PDL_ENTRY();
    extern __shared__ float4 xsh[]; /* [rp][K] the pass's x rows, staged once for the 8 warps */
    int e, r0, r1;
    if (direct) { /* block row y is routed row y, alone with its expert (ds_cu_moe_experts) */
        e = __ldcg(direct + blockIdx.y) - e0;
        if (e < 0 || e >= E) return; /* another rank's expert */
        r0 = blockIdx.y, r1 = r0 + 1;
    } else {
        if ((int)blockIdx.y >= __ldcg(n_active)) return;
        e = __ldcg(active + blockIdx.y), r0 = __ldcg(start + e), r1 = __ldcg(start + e + 1);
    }
    const int lane = threadIdx.x & 31;
    const int n0 = blockIdx.x * 8 * NPW + (threadIdx.x >> 5) * NPW;
    const uint4 *wr[NPW];
#pragma unroll
    for (int j = 0; j < NPW; j++)
        wr[j] = (const uint4 *)(W + ((size_t)e * N + min(n0 + j, N - 1)) * K);
    /* the first piece of each weight row is requested before the x rows are staged (its
     * latency hidden behind theirs); used by the first pass, reloaded by later ones */
    uint4 u0[NPW];
    const bool lk = lane < K / 8;
#pragma unroll
    for (int j = 0; j < NPW; j++)
        if (lk) u0[j] = __ldg(wr[j] + lane);
    if (early) PDL_ENTRY();
    for (int c0 = r0; c0 < r1; c0 += rp) {
        const int nr = min(rp, r1 - c0);
        __syncthreads(); /* the previous pass is done with xsh */
        for (int i = 0; i < nr; i++) {
            const int r = direct ? c0 + i : perm[c0 + i];
            const float4 *src = (const float4 *)(x + (size_t)(r / x_div) * ldx);
            for (int j = threadIdx.x; j < K / 4; j += blockDim.x) {
                float4 v = src[j];
                if (act.on) v = act_pair4(v, src[K / 4 + j], act.situ, act.beta, act.lin_beta);
                xsh[(size_t)i * (K / 4) + j] = v;
            }
        }
        __syncthreads();
        if (n0 >= N) continue; /* (after the barriers: every warp stages) */
        const float *xs[RPM];
        float acc[NPW][RPM];
#pragma unroll
        for (int i = 0; i < RPM; i++) {
            xs[i] = (const float *)xsh + (size_t)(i < nr ? i : 0) * K;
#pragma unroll
            for (int j = 0; j < NPW; j++) acc[j][i] = 0.0f;
        }
        if (c0 != r0 && lk)
#pragma unroll
            for (int j = 0; j < NPW; j++) u0[j] = __ldg(wr[j] + lane);
        stream_rows_dot<NPW, RPM>(acc, u0, wr, xs, nr, K, lane, lk);
#pragma unroll
        for (int i = 0; i < RPM; i++)
            if (i < nr) { /* (uniform in the warp) */
                const int r = direct ? c0 + i : perm[c0 + i];
#pragma unroll
                for (int j = 0; j < NPW; j++) {
                    float v = acc[j][i];
                    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                    if (lane == 0 && n0 + j < N) y[(size_t)r * ldy + n0 + j] = v;
                }
            }
    }
}

enum : size_t { MOE_SMEM = 160 * 1024 }; /* the grouped kernel's x staging, at most */

/* The grouped kernel's instances: accumulators for rpm rows, and (at one row an expert: batch 1)
 * more weight rows a warp when that keeps the blocks to one wave. At NPW 4 the 48B shape's down
 * pass (2304 outputs x 8 experts) was 576 blocks for 528 places (4 an SM), its last 48 a second
 * wave that left it far slower a byte than the up pass (Nsight Compute: bench/RESULTS.md
 * session 9). A row's sum takes the same operations whatever NPW is. */
typedef void (*moe_grouped_ptr)(float *, int, const float *, int, int, const uint16_t *, int, int,
                                const int32_t *, const int32_t *, const int32_t *, const int32_t *,
                                int, moe_act, const int32_t *, int, int, int);
typedef struct {
    moe_grouped_ptr fn;
    int rpm, rows; /* accumulators; weight rows a block (8 warps x NPW) */
} moe_grouped_fn;
static const moe_grouped_fn moe_grouped_fns[] = {{moe_grouped_k<1, 4>, 1, 32},
                                                 {moe_grouped_k<1, 5>, 1, 40},
                                                 {moe_grouped_k<2, 4>, 2, 32},
                                                 {moe_grouped_k<8, 4>, 8, 32}};
enum { MOE_GROUPED_N = sizeof moe_grouped_fns / sizeof moe_grouped_fns[0] };

/* A one-token matmul of many rows (one warp a row: gemv_splits gives 1) through the routed
 * experts' kernel as one "expert": 4 rows a warp and x staged in shared memory, with the same
 * sums in the same order as gemv_bf16_k (so batch invariance holds). On the H200 at the 48B
 * shape (it takes KDA's q/k/v, MLA's queries and lm_head) a batch-1 step was shorter than
 * through gemv_bf16_k (bench/RESULTS.md session 9). */
__device__ int32_t g_row_zero[1]; /* gemv_wide's routing: every block row is "expert" 0 */

int gemv_wide(ds_cu *c, float *y, const float *x, const uint16_t *W, int N, int K, ds_err *err) {
    if (!c->row_zero)
        CU_TRY(cudaGetSymbolAddress((void **)&c->row_zero, g_row_zero), "gemv (wide)");
    const moe_act none = {0, 0, 0.0f, 0.0f};
    launch_k(c, moe_grouped_k<1, 4>, dim3((unsigned)((N + 31) / 32), 1), 256, (size_t)K * 4, y, N,
             x, K, 1, W, N, K, (const int32_t *)NULL, (const int32_t *)NULL, (const int32_t *)NULL,
             (const int32_t *)NULL, 1, none, (const int32_t *)c->row_zero, 0, 1, c->wide_early);
    CU_TRY(cudaGetLastError(), "gemv (wide)");
    return DS_OK;
}

/* N outputs for ya block rows, smem bytes of staging a block */
static moe_grouped_fn moe_grouped_pick(ds_cu *c, int rpm, int N, unsigned ya, size_t smem) {
    static_assert(MOE_GROUPED_N <= sizeof c->grouped_per_sm / sizeof c->grouped_per_sm[0],
                  "ds_cu holds a count per grouped kernel");
    int *per_sm = c->grouped_per_sm; /* blocks an SM holds, for the smem last asked about */
    size_t *per_sm_smem = c->grouped_per_sm_smem;
    const moe_grouped_fn *first = NULL;
    for (int i = 0; i < MOE_GROUPED_N; i++) {
        const moe_grouped_fn *f = &moe_grouped_fns[i];
        if (f->rpm != rpm) continue;
        if (!first) first = f; /* NPW 4 */
        if (!per_sm[i] || per_sm_smem[i] != smem) {
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm[i], f->fn, 256, smem) !=
                cudaSuccess)
                break;
            per_sm_smem[i] = smem;
        }
        if ((long)((N + f->rows - 1) / f->rows) * ya <= (long)per_sm[i] * c->n_sm) return *f;
    }
    return *first;
}

extern "C" void ds_cu_set_early_experts(ds_cu *c, int on) {
    c->early_experts = on;
}

extern "C" void ds_cu_set_wide_early(ds_cu *c, int on) {
    c->wide_early = on;
}

/* Tokens from which a step's grouped experts run on tensor cores (below, the weight stream bounds
 * the f32 kernel anyway, and its grid — 32 weight rows a block against 128 or 256 — balances
 * the fewer active experts better). 48B shape, steps with graphs on the H200: the f32 kernel was
 * faster up to batch 32, the streaming mma one from 48 (bench/RESULTS.md session 12). */
enum { MOE_MMA_MIN_TOKENS = 40 };

extern "C" int ds_cu_moe_experts(ds_cu *c, float *out, const float *x, const int32_t *idx,
                                 const float *w, int T, int k, int E, int e0, int D, int I,
                                 const uint16_t *gate_up, const uint16_t *down, int situ,
                                 float situ_beta, float situ_lin_beta, int accumulate,
                                 ds_err *err) {
    if (T <= 0 || k <= 0) return DS_OK;
    const int rows = T * k;
    if (rows > 65535) return ds_errf(err, "cuda: moe: %d routed rows (at most 65535)", rows);
    const int grouped = D % 8 == 0 && I % 8 == 0 && (uintptr_t)x % 16 == 0 && E > 0;
    /* floats: h [rows][2I], y [rows][D]; then ints: start [E+1], perm [rows], active [E], n [1],
     * and with many rows hist [n_chunks][E] */
    const int n_chunks = rows >= 1024 ? (rows + MOE_GCHUNK - 1) / MOE_GCHUNK : 0;
    /* h's place also holds moe_tc_k's BF16 rows: x [rows][D], then act [rows][I] */
    const size_t hf = (size_t)rows * DS_MAX(2 * (size_t)I, ((size_t)D + (size_t)I + 1) / 2);
    size_t nf = hf + (size_t)rows * D;
    size_t ni = grouped ? (size_t)E + 1 + rows + E + 1 + (size_t)n_chunks * E : 0;
    if (grow_scratch(c, (void **)&c->part, &c->part_bytes, (nf + ni) * sizeof(float), "moe scratch",
                     err))
        return DS_ERR;
    float *h = c->part, *y = c->part + hf;
    if (grouped) {
        int32_t *start = (int32_t *)(c->part + nf), *perm = start + E + 1, *active = perm + rows;
        int32_t *n_active = active + E, *hist = n_active + 1;
        /* One token picks K distinct experts: its rows need no grouping (no launch for it, and
         * one dependent load less before the weights stream); the kernels take the routed rows
         * straight from idx. */
        const int32_t *direct = T == 1 ? idx : NULL;
        const unsigned ya = moe_block_rows(direct != NULL, rows, E);
        ds_cu_prof_mark(c, "moe group");
        if (!direct)
            moe_group_rows(c, idx, rows, e0, E, n_chunks, start, perm, active, n_active, hist);
        CU_TRY(cudaGetLastError(), "moe group");
        if (!direct && c->expert_gemm && !c->batch_invariant && rows >= EXPERT_GEMM_MIN_PER * E &&
            (uintptr_t)out % 16 == 0 && !capturing(c)) /* (its combine stores 16 bytes) */
            return moe_experts_gemm(c, out, x, w, T, k, E, D, I, gate_up, down, situ, situ_beta,
                                    situ_lin_beta, accumulate, start, perm, err);
        ds_cu_prof_mark(c, "moe grouped experts");
        /* batches on tensor cores, else the f32 streaming kernel (batch invariance, decode) */
        const int batch_tc = !direct && c->expert_mma && !c->batch_invariant &&
                             T >= (c->mma_min_tokens > 0 ? c->mma_min_tokens : MOE_MMA_MIN_TOKENS);
        const int tc = batch_tc && c->expert_tc && D % 64 == 0 && I % 64 == 0;
        const int mma =
            batch_tc && !tc && (2 * I) % MMA_N == 0 && D % MMA_N == 0 && D % 16 == 0 && I % 16 == 0;
        /* rows per pass (rp) and the accumulators the kernel holds for them (rpm): sized to the
         * rows an expert has — one at batch 1 (accumulators for eight took 126 registers a
         * thread and held the SMs to a quarter of their warps, ncu measured), two while a step
         * routes no more rows than there are experts (mostly one each), else eight — never more
         * than T (a token picks an expert once) nor than shared memory holds of x; the bits do
         * not depend on it */
        const int rpm = T == 1 ? 1 : rows <= E ? 2 : 8;
        const int rp_up = DS_MAX(1, DS_MIN(DS_MIN(rpm, T), (int)(MOE_SMEM / ((size_t)D * 4))));
        const int rp_dn = DS_MAX(1, DS_MIN(DS_MIN(rpm, T), (int)(MOE_SMEM / ((size_t)I * 4))));
        if (!c->moe_grouped_smem) { /* once, before any capture can be open */
            for (int i = 0; i < MOE_GROUPED_N; i++)
                CU_TRY(cudaFuncSetAttribute((const void *)moe_grouped_fns[i].fn,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)MOE_SMEM),
                       "moe: shared memory");
            c->moe_grouped_smem = 1;
        }
        const moe_grouped_fn up_k = moe_grouped_pick(c, rpm, 2 * I, ya, (size_t)rp_up * D * 4),
                             dn_k = moe_grouped_pick(c, rpm, D, ya, (size_t)rp_dn * I * 4);
        const moe_act none = {0, 0, 0.0f, 0.0f}, act = {1, situ, situ_beta, situ_lin_beta};
        if (tc) {
            moe_tc_experts(c, h, y, x, rows, ya, D, I, E, k, gate_up, down, start, perm, active,
                           n_active, act);
            CU_TRY(cudaGetLastError(), "moe experts (tensor cores)");
        } else {
            if (mma)
                moe_mma_pass(c, h, 2 * I, x, D, k, gate_up, 2 * I, D, start, perm, active, n_active,
                             ya, none);
            else
                launch_k(c, up_k.fn, dim3((unsigned)((2 * I + up_k.rows - 1) / up_k.rows), ya), 256,
                         (size_t)rp_up * D * 4, h, 2 * I, x, D, k, gate_up, 2 * I, D, start, perm,
                         active, n_active, rp_up, none, direct, e0, E, 0);
            CU_TRY(cudaGetLastError(), "moe up (grouped)");
            /* h's rows are gate | up, one per routed row: the down pass applies act as it stages */
            if (mma)
                moe_mma_pass(c, y, D, h, 2 * I, 1, down, D, I, start, perm, active, n_active, ya,
                             act);
            else
                launch_k(c, dn_k.fn, dim3((unsigned)((D + dn_k.rows - 1) / dn_k.rows), ya), 256,
                         (size_t)rp_dn * I * 4, y, D, h, 2 * I, 1, down, D, I, start, perm, active,
                         n_active, rp_dn, act, direct, e0, E, c->early_experts);
            CU_TRY(cudaGetLastError(), "moe down (grouped)");
        }
    } else {
        launch_k(c, moe_up_k, dim3((unsigned)((2 * I + 7) / 8), (unsigned)rows), 256, 0, h, x, idx,
                 k, D, 2 * I, gate_up, e0, E);
        CU_TRY(cudaGetLastError(), "moe up");
        launch_k(c, moe_act_k, dim3((unsigned)((I + 255) / 256), (unsigned)DS_MIN(rows, 65535)),
                 256, 0, h, rows, I, situ, situ_beta, situ_lin_beta);
        CU_TRY(cudaGetLastError(), "moe act");
        launch_k(c, moe_down_k, dim3((unsigned)((D + 7) / 8), (unsigned)rows), 256, 0, y, h, idx, D,
                 I, down, e0, E);
        CU_TRY(cudaGetLastError(), "moe down");
    }
    /* out may be the shared experts' output, still being written on the side stream */
    if (ds_cu_side_join(c, err)) return DS_ERR;
    ds_cu_prof_mark(c, "moe combine");
    moe_combine(c, out, y, w, idx, e0, E, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe combine");
    return DS_OK;
}
