/* moe_tensor.cu — the routed experts on tensor cores: in a step (wmma, and the streaming
 * mma.sync kernels for batches) and through cuBLAS for long steps (prefill). */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/moe.cuh"

/* ---- routed experts on tensor cores inside a step (decode of large batches) ------------------
 * The grouped kernel above does one f32 FMA per weight per routed row: at batch 64-256 (a few
 * rows per expert) that is compute, not the weight stream, that bounds it. Here the same grouping
 * feeds BF16 tensor cores (wmma 16 x 16 x 16, f32 accumulation): block (256 output columns,
 * active expert) takes up to 16 of the expert's rows at a time, stages them as BF16 in chunks of
 * MMA_KC along K, and each warp multiplies them with two 16-column tiles of weights read straight
 * from global memory (a weight row is K-contiguous: the column-major B operand). Everything on
 * the device, so a step stays capturable. Activations are rounded to BF16, as in cuBLAS's path;
 * not with batch invariance. N % 256 == 0 and K % 16 == 0. */

__global__ void __launch_bounds__(256)
    moe_mma_k(float *y, int ldy, const float *x, int ldx, int x_div, const uint16_t *W, int N,
              int K, const int32_t *start, const int32_t *perm, const int32_t *active,
              const int32_t *n_active, moe_act act) {
    PDL_ENTRY();
    __shared__ __align__(32) __nv_bfloat16 xs[MMA_ROWS * MMA_XLD]; /* [16][KC+8] this K chunk */
    __shared__ __align__(32) float os[MMA_ROWS * MMA_OLD];         /* [16][256+4] the outputs */
    if ((int)blockIdx.y >= *n_active) return;
    const int e = active[blockIdx.y], tid = threadIdx.x, warp = tid >> 5;
    const int n0 = blockIdx.x * MMA_N + warp * 32; /* this warp's two 16-column tiles */
    const __nv_bfloat16 *W0 = (const __nv_bfloat16 *)W + ((size_t)e * N + n0) * K;
    const __nv_bfloat16 *W1 = W0 + (size_t)16 * K;
    const int r0 = start[e], r1 = start[e + 1];
    for (int c0 = r0; c0 < r1; c0 += MMA_ROWS) {
        const int nr = min(MMA_ROWS, r1 - c0);
        nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc0, acc1;
        nvcuda::wmma::fill_fragment(acc0, 0.0f);
        nvcuda::wmma::fill_fragment(acc1, 0.0f);
        for (int kc = 0; kc < K; kc += MMA_KC) {
            const int kn = min(MMA_KC, K - kc);
            __syncthreads(); /* the previous chunk (or pass) is done with xs */
            for (int i = tid; i < MMA_ROWS * kn; i += blockDim.x) {
                const int r = i / kn, col = i % kn;
                float v = 0.0f;
                if (r < nr) {
                    const float *xr = x + (size_t)(perm[c0 + r] / x_div) * ldx + kc + col;
                    v = act.on ? act_pair(xr[0], xr[K], act.situ, act.beta, act.lin_beta) : xr[0];
                }
                xs[r * MMA_XLD + col] = __float2bfloat16_rn(v);
            }
            __syncthreads();
#pragma unroll 4
            for (int k0 = 0; k0 < kn; k0 += 16) {
                nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16,
                                       nvcuda::wmma::row_major>
                    a;
                nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16,
                                       nvcuda::wmma::col_major>
                    b0, b1;
                nvcuda::wmma::load_matrix_sync(a, xs + k0, MMA_XLD);
                nvcuda::wmma::load_matrix_sync(b0, W0 + kc + k0, K);
                nvcuda::wmma::load_matrix_sync(b1, W1 + kc + k0, K);
                nvcuda::wmma::mma_sync(acc0, a, b0, acc0);
                nvcuda::wmma::mma_sync(acc1, a, b1, acc1);
            }
        }
        nvcuda::wmma::store_matrix_sync(os + warp * 32, acc0, MMA_OLD, nvcuda::wmma::mem_row_major);
        nvcuda::wmma::store_matrix_sync(os + warp * 32 + 16, acc1, MMA_OLD,
                                        nvcuda::wmma::mem_row_major);
        __syncthreads();
        for (int i = tid; i < nr * MMA_N; i += blockDim.x) {
            const int r = i / MMA_N, col = i % MMA_N;
            y[(size_t)perm[c0 + r] * ldy + blockIdx.x * MMA_N + col] = os[r * MMA_OLD + col];
        }
    }
}

void moe_mma_pass(ds_cu *c, float *y, int ldy, const float *x, int ldx, int x_div,
                  const uint16_t *W, int N, int K, const int32_t *start, const int32_t *perm,
                  const int32_t *active, const int32_t *n_active, unsigned ya, moe_act act) {
    launch_k(c, moe_mma_k, dim3((unsigned)(N / MMA_N), ya), 256, 0, y, ldy, x, ldx, x_div, W, N, K,
             start, perm, active, n_active, act);
}

extern "C" void ds_cu_set_expert_mma(ds_cu *c, int on) {
    c->expert_mma = on;
}

/* ---- routed experts of batches on tensor cores, streaming (decode of 40+ tokens) -------------
 * The weights are the bytes: at batch 64-256 a layer's active experts are most of its 3.6 GB
 * (48B shape) and each has a few rows, so the kernel must stream weights at the copy rate and
 * treat the products as nearly free. Each warp holds two 16-row tiles of weights as the A operand
 * of mma.sync m16n8k16, loaded straight from memory as 16-byte pieces (no shared memory, no
 * barriers); the tokens are B (n = 8 a tile, NT tiles a pass), BF16 rows in expert order read
 * through L1. A dot product may take its k in any order, so long as A and B agree: lane 4 g + l4
 * loads k [16 l4, 16 l4 + 16) of a 64-wide step for weight rows g, g + 8 and token g, and its
 * four mma read those pieces' pairs in the same order on both sides (the PTX fragment layout
 * then sums every k exactly once). UP: rows c and I + c of gate_up sit in the same lane's
 * accumulators (tiles 0 and 1), so the activation is applied in registers and BF16 act rows come
 * out (no [rows][2I] round trip); DOWN: the f32 rows y[perm row] for moe_combine_k. Not with batch
 * invariance (BF16 activations, as moe_mma_k). K % 64 == 0, N % 16 == 0. */
__device__ __forceinline__ uint4
ldg_stream(const uint4 *p) { /* weights: read once, not kept in L1 */
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

template <int NT, bool UP>
__device__ __forceinline__ void moe_tc_body(void *out, int ldo, const __nv_bfloat16 *xb,
                                            const uint16_t *W, int N, int K, const int32_t *start,
                                            const int32_t *perm, const int32_t *active,
                                            const int32_t *n_active, moe_act act) {
    if ((int)blockIdx.y >= *n_active) return;
    const int e = active[blockIdx.y], r0 = start[e], r1 = start[e + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, l4 = lane & 3;
    /* UP: act columns [c0, c0 + 16) (gate rows c0.., up rows N + c0..); DOWN: rows [c0, c0 + 32) */
    const int c0 = (blockIdx.x * 8 + warp) * (UP ? 16 : 32);
    if (c0 >= N) return;
    const size_t erows = UP ? 2 * (size_t)N : (size_t)N;
    const uint4 *wr[2][2]; /* [tile][row g, g + 8], at this lane's first piece */
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            wr[m][h] = (const uint4 *)(W + moe_mma_row<UP>(e, erows, N, c0, g, m, h) * K) + 2 * l4;
        }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int p0 = r0; p0 < r1; p0 += 8 * NT) {
        float acc[2][NT][4];
        const uint4 *xr[NT];
        bool xv[NT];
        moe_mma_tokens<NT>(xr, xv, acc, xb, K, p0, r0, r1, g, 2 * l4);
#pragma unroll 2
        for (int k8 = 0; k8 < K / 8; k8 += 8) { /* a 64-wide step: 8 pieces of 8 a row */
            uint4 a[2][2][2], b[NT][2];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int p = 0; p < 2; p++) a[m][h][p] = ldg_stream(wr[m][h] + k8 + p);
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int p = 0; p < 2; p++) b[nt][p] = xv[nt] ? __ldg(xr[nt] + k8 + p) : zero;
#pragma unroll
            for (int p = 0; p < 2; p++)
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    const uint32_t lo[4] = {a[m][0][p].x, a[m][1][p].x, a[m][0][p].y, a[m][1][p].y},
                                   hi[4] = {a[m][0][p].z, a[m][1][p].z, a[m][0][p].w, a[m][1][p].w};
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        mma_16816(acc[m][nt], lo, b[nt][p].x, b[nt][p].y);
                        mma_16816(acc[m][nt], hi, b[nt][p].z, b[nt][p].w);
                    }
                }
        }
        moe_mma_store<NT, UP>(out, ldo, acc, perm, p0, r1, c0, N, g, l4, act);
    }
}

/* MINB: blocks an SM ptxas must allow. Left to itself it gave the 16- and 32-token forms 98 and
 * 130 registers (2 and 1 blocks of 8 warps an SM); held to 3 and 2 blocks (80 and 128, a few
 * spilled bytes) the 48B shape's batch-256 experts and step were faster (bench/RESULTS.md
 * session 12). The 8-token form keeps its 64 registers (4 blocks) either way. */
template <int NT, bool UP, int MINB>
__global__ void __launch_bounds__(256, MINB)
    moe_tc_k(void *out, int ldo, const __nv_bfloat16 *xb, const uint16_t *W, int N, int K,
             const int32_t *start, const int32_t *perm, const int32_t *active,
             const int32_t *n_active, moe_act act) {
    PDL_ENTRY();
    moe_tc_body<NT, UP>(out, ldo, xb, W, N, K, start, perm, active, n_active, act);
}
template <bool UP>
__global__ void __launch_bounds__(256)
    moe_tc1_k(void *out, int ldo, const __nv_bfloat16 *xb, const uint16_t *W, int N, int K,
              const int32_t *start, const int32_t *perm, const int32_t *active,
              const int32_t *n_active, moe_act act) {
    PDL_ENTRY();
    moe_tc_body<1, UP>(out, ldo, xb, W, N, K, start, perm, active, n_active, act);
}

/* xb[i] = bf16(x[perm[i] / k]) for this rank's routed rows i < start[E], in expert order */
__global__ void moe_gather_rows_k(__nv_bfloat16 *xb, const float *x, int D, const int32_t *perm,
                                  const int32_t *start, int E, int k) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    if (i >= start[E]) return;
    const float4 *xr = (const float4 *)(x + (size_t)(perm[i] / k) * D);
    for (int c4 = threadIdx.x; c4 < D / 4; c4 += blockDim.x)
        store_bf16x4(xb + (size_t)i * D + 4 * c4, xr[c4]);
}

/* The kernels per direction for 8, 16 and 32 tokens a pass (a lane's accumulators 8 NT floats) */
typedef void (*moe_tc_ptr)(void *, int, const __nv_bfloat16 *, const uint16_t *, int, int,
                           const int32_t *, const int32_t *, const int32_t *, const int32_t *,
                           moe_act);
static const moe_tc_ptr moe_tc_up[3] = {moe_tc1_k<true>, moe_tc_k<2, true, 3>,
                                        moe_tc_k<4, true, 2>},
                        moe_tc_dn[3] = {moe_tc1_k<false>, moe_tc_k<2, false, 3>,
                                        moe_tc_k<4, false, 2>};

void moe_tc_experts(ds_cu *c, float *h, float *y, const float *x, int rows, unsigned ya, int D,
                    int I, int E, int k, const uint16_t *gate_up, const uint16_t *down,
                    const int32_t *start, const int32_t *perm, const int32_t *active,
                    const int32_t *n_active, moe_act act) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    __nv_bfloat16 *xb = (__nv_bfloat16 *)h, *ab = xb + (size_t)rows * D;
    /* tokens a pass from the rows an active expert has on average (more: another pass over its
     * weights) */
    const int per = (rows + (int)ya - 1) / (int)ya, nt = per <= 4 ? 0 : per <= 12 ? 1 : 2;
    launch_k(c, moe_gather_rows_k, (unsigned)rows, 128, 0, xb, x, D, perm, start, E, k);
    launch_k(c, moe_tc_up[nt], dim3((unsigned)((I + 127) / 128), ya), 256, 0, (void *)ab, I,
             (const __nv_bfloat16 *)xb, gate_up, I, D, start, perm, active, n_active, act);
    launch_k(c, moe_tc_dn[nt], dim3((unsigned)((D + 255) / 256), ya), 256, 0, (void *)y, D,
             (const __nv_bfloat16 *)ab, down, D, I, start, perm, active, n_active, none);
}

extern "C" void ds_cu_set_expert_tc(ds_cu *c, int on) {
    c->expert_tc = on;
}

extern "C" void ds_cu_set_expert_mma_min(ds_cu *c, int tokens) {
    c->mma_min_tokens = tokens;
}

/* ---- routed experts through tensor cores (long steps: prefill) ------------------------------
 * With thousands of routed rows each expert has tens to hundreds of them: after grouping, its rows
 * of x (in BF16) are one GEMM against its gate/up weights and one against its down weights, a
 * cuBLAS call each, and the combine reads the results through the inverse permutation. The
 * expert layout crosses to the host (one small copy) for the calls' sizes, so these steps are
 * never captured in graphs; and cuBLAS picks algorithms by size, so batch invariance keeps the
 * streaming kernel. */
extern "C" void ds_cu_set_expert_gemm(ds_cu *c, int on) {
    c->expert_gemm = on;
}

extern "C" void ds_cu_set_expert_bf16_out(ds_cu *c, int on) {
    c->expert_bf16_out = on;
}

extern "C" long ds_cu_expert_gemm_runs(const ds_cu *c) {
    return c->expert_gemm_runs;
}

extern "C" void ds_cu_set_expert_lt(ds_cu *c, int on) {
    c->expert_lt = on;
}

extern "C" long ds_cu_expert_lt_runs(const ds_cu *c) {
    return c->expert_lt_runs;
}

extern "C" void ds_cu_set_lt_each(ds_cu *c, int on) {
    c->lt_each = on;
}

extern "C" void ds_cu_set_expert_x16(ds_cu *c, int on) {
    c->expert_x16 = on;
}

/* The tensor-core path's element-wise kernels take a row a block and 16-byte loads: x 16-byte
 * aligned and D, I multiples of 8 (moe_experts_gemm's callers); y and out are its own scratch and
 * the model's rows. One thread an element with 64-bit divisions for the row ran the activation
 * far under the copy rate at the 48B shape's 8192-token prompt (bench/RESULTS.md session 10). */

/* xg[slot[i]] = bf16(x[perm[i] / k]): the routed rows' inputs in expert order, in panels. */
__global__ void moe_gather_bf16_k(__nv_bfloat16 *xg, const float *x, int D, const int32_t *perm,
                                  const int32_t *slot, int k) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const float4 *xr = (const float4 *)(x + (size_t)(perm[i] / k) * D);
    __nv_bfloat16 *dst = xg + (size_t)slot[i] * D;
    for (int c4 = threadIdx.x; c4 < D / 4; c4 += blockDim.x) store_bf16x4(dst + 4 * c4, xr[c4]);
}

/* The same from x already rounded to BF16 (xr [T][D], D a multiple of 8): routed row i < n a warp
 * (MOE_GATHER_ROWS a block), 16-byte copies */
__global__ void moe_gather_x16_k(__nv_bfloat16 *xg, const __nv_bfloat16 *xr, int D,
                                 const int32_t *perm, const int32_t *slot, int k, int n) {
    PDL_ENTRY();
    const int i = blockIdx.x * MOE_GATHER_ROWS + (threadIdx.x >> 5);
    if (i >= n) return;
    warp_copy16(xg + (size_t)slot[i] * D, xr + (size_t)(perm[i] / k) * D, D / 8, threadIdx.x & 31);
}

/* slot[i] = panel[e] + (i - start[e]) for the rows i of expert e = blockIdx.x: each expert's rows
 * at the head of its own panel (the padded layout of the batched GEMMs). */
__global__ void moe_slot_k(int32_t *slot, const int32_t *start, const int32_t *panel) {
    PDL_ENTRY();
    const int e = blockIdx.x, r0 = start[e], r1 = start[e + 1];
    for (int i = r0 + threadIdx.x; i < r1; i += blockDim.x) slot[i] = panel[e] + (i - r0);
}

/* ab[i][c] = bf16(act(h[i][c], h[i][I + c])), row i = blockIdx.x; H f32 or BF16
 * (ds_cu_set_expert_bf16_out 2) */
template <typename H>
__global__ void moe_act_bf16_k(__nv_bfloat16 *ab, const H *h, int I, int situ, float beta,
                               float lin_beta) {
    PDL_ENTRY();
    const size_t i = blockIdx.x, g = i * 2 * I, u = g + I;
    for (int c4 = threadIdx.x; c4 < I / 4; c4 += blockDim.x)
        store_bf16x4(ab + i * I + 4 * c4,
                     act_pair4(load4(h, g + 4 * c4), load4(h, u + 4 * c4), situ, beta, lin_beta));
}

/* inv[perm[i]] = slot[i]: where routed row perm[i]'s output sits in y. */
__global__ void moe_inverse_k(int32_t *inv, const int32_t *perm, const int32_t *slot, int rows) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows) inv[perm[i]] = slot[i];
}

/* out[t] (+)= sum_j w[t][j] y[inv[t k + j]], slots in order (the combine of moe_combine_k);
 * token t = blockIdx.x; Y f32 or BF16 (ds_cu_set_expert_bf16_out). SC (the FP8 experts' sums):
 * each row r's values scaled first as (y[r][d] * as[r]) * ds[e][d], e = idx[t k + j] - e0 — the
 * tile path's down outputs, the same operations. */
template <typename Y, bool SC>
__global__ void moe_combine_perm_k(float *out, const Y *y, const int32_t *inv, const float *w,
                                   const float *as, const float *ds, const int32_t *idx, int e0,
                                   int k, int D, int accumulate) {
    PDL_ENTRY();
    const size_t t = blockIdx.x;
    float4 *o = (float4 *)(out + t * D);
    for (int d4 = threadIdx.x; d4 < D / 4; d4 += blockDim.x) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int j = 0; j < k; j++) { /* inv < 0: another rank's expert */
            const int32_t r = inv[t * k + j];
            if (r < 0) continue;
            const float wj = w[t * k + j];
            float4 v = load4(y, (size_t)r * D + 4 * (size_t)d4);
            if constexpr (SC) {
                const float sa = as[r];
                const float4 sd = ((const float4 *)(ds + (size_t)(idx[t * k + j] - e0) * D))[d4];
                v = make_float4((v.x * sa) * sd.x, (v.y * sa) * sd.y, (v.z * sa) * sd.z,
                                (v.w * sa) * sd.w);
            }
            acc.x += wj * v.x, acc.y += wj * v.y, acc.z += wj * v.z, acc.w += wj * v.w;
        }
        if (accumulate) {
            const float4 p = o[d4];
            acc = make_float4(p.x + acc.x, p.y + acc.y, p.z + acc.z, p.w + acc.w);
        }
        o[d4] = acc;
    }
}

void moe_combine_slots(ds_cu *c, float *out, const void *y, int y16, const int32_t *inv,
                       const float *w, const float *as, const float *ds, const int32_t *idx, int e0,
                       int T, int k, int D, int accumulate) {
#define MOE_COMBINE(Y, SC)                                                                         \
    launch_k(c, moe_combine_perm_k<Y, SC>, (unsigned)T, 256, 0, out, (const Y *)y, inv, w, as, ds, \
             idx, e0, k, D, accumulate)
    if (as && y16)
        MOE_COMBINE(__nv_bfloat16, true);
    else if (as)
        MOE_COMBINE(float, true);
    else if (y16)
        MOE_COMBINE(__nv_bfloat16, false);
    else
        MOE_COMBINE(float, false);
#undef MOE_COMBINE
}

/* With the layout on the host, the experts' GEMMs run as a few pointer-array batches: experts
 * sorted by their row counts are cut into buckets (a new one where a count falls under 4/5 of
 * the bucket's first), each expert gets a panel of its bucket's largest count (rounded to 16
 * rows; its own rows first, the rest never read), and each bucket is one batched GEMM for
 * gate/up and one for down. Balanced routing is one bucket; skewed routing (random weights, or
 * a hot expert) a handful — where a cuBLAS call per expert was host-bound at E = 256 and one
 * padded batch would have padded every expert to the hottest. The FP8 experts' cuBLASLt path
 * (moe_fp8_gemm.cu) runs on the same plan. */

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* The plan's buckets from the layout hs [E+1] (keys [E]: scratch): the experts with rows into
 * order [*n_act] by count (largest first; ties by id), bucket b holding order[bk_first[b] ..
 * bk_first[b + 1]) at bk_rows[b] padded rows each, panel[e] expert e's first padded row. Returns
 * the buckets; *pr: the padded rows of all panels (at least 1). */
static int moe_buckets(const int32_t *hs, int E, uint64_t *keys, int32_t *order, int32_t *panel,
                       int *bk_first, int *bk_rows, int *n_act_out, size_t *pr_out) {
    /* experts with rows, by count (largest first; ties by id, so the plan is deterministic):
     * one sort of keys (INT32_MAX - count, id) */
    int n_act = 0;
    for (int e = 0; e < E; e++)
        if (hs[e + 1] > hs[e])
            keys[n_act++] =
                (uint64_t)(uint32_t)(INT32_MAX - (hs[e + 1] - hs[e])) << 32 | (uint32_t)e;
    qsort(keys, (size_t)n_act, sizeof *keys, cmp_u64);
    for (int i = 0; i < n_act; i++) order[i] = (int)(uint32_t)keys[i];
    int n_bk = 0;
    size_t pr = 0;
    for (int i = 0; i < n_act; i++) {
        const int e = order[i], n = hs[e + 1] - hs[e];
        if (n_bk == 0 || (n * 5 < bk_rows[n_bk - 1] * 4 && n_bk < MOE_MAX_BUCKETS)) {
            bk_first[n_bk] = i;
            bk_rows[n_bk++] = (n + 15) / 16 * 16;
        }
        panel[e] = (int32_t)pr;
        pr += (size_t)bk_rows[n_bk - 1];
    }
    bk_first[n_bk] = n_act;
    if (!pr) pr = 1;
    *n_act_out = n_act, *pr_out = pr;
    return n_bk;
}

/* The n_local routed rows of x [T][D] (f32) into their slots of the panels xg, rounded to BF16:
 * each from its f32 row, or (expert_x16) x rounded once into xr [T][D] and the rows copied from
 * it (the same words: the same rounding, done once) */
static void moe_gather(ds_cu *c, __nv_bfloat16 *xg, __nv_bfloat16 *xr, const float *x, int T, int D,
                       const int32_t *perm, const int32_t *slot, int k, int n_local) {
    if (n_local <= 0) return;
    if (c->expert_x16) {
        round_rows(c, xr, x, D, D, T);
        launch_k(c, moe_gather_x16_k, (n_local + MOE_GATHER_ROWS - 1) / MOE_GATHER_ROWS,
                 32 * MOE_GATHER_ROWS, 0, xg, (const __nv_bfloat16 *)xr, D, perm, slot, k, n_local);
    } else {
        launch_k(c, moe_gather_bf16_k, n_local, 256, 0, xg, x, D, perm, slot, k);
    }
}

/* One bucket's products: for its cnt experts i, C_i [n][N] (f32, or BF16 with c16) = B_i [n][K]
 * . A_i [N][K]^T, A and B of type in (E4M3 codes or BF16) — column-major, A_i K x N transposed and
 * B_i K x n (the TN layout FP8 wants), unit scales. dp: the device's pointer arrays at this bucket
 * (A at dp[0], B at dp[E], C at dp[2E]), hp the host's. *done = 0 where cuBLASLt has no algorithm
 * at all (the caller's fallback).
 */
int lt_batched(ds_cu *c, cublasLtHandle_t h, cudaDataType_t in, int N, int n, int K, int cnt,
               int c16, void *const *dp, const void *const *hp, int E, int *done, ds_err *err) {
    const uint32_t ptr_mode = CUBLASLT_BATCH_MODE_POINTER_ARRAY;
    const int32_t batch = cnt;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    *done = 0;
    /* pass 0: one pointer-array batch; pass 1 (no such algorithm): one call an expert */
    for (int pass = c->lt_each ? 1 : 0; pass < 2 && !*done && st == CUBLAS_STATUS_SUCCESS; pass++) {
        lt_op o;
        cublasLtMatmulHeuristicResult_t res;
        int ok = lt_make(&o, in, N, n, K, N, c16 ? CUDA_R_16BF : CUDA_R_32F);
        cublasLtMatrixLayout_t lay[3] = {o.la, o.lb, o.ld};
        for (int m = 0; m < 3 && ok && pass == 0; m++)
            ok = cublasLtMatrixLayoutSetAttribute(lay[m], CUBLASLT_MATRIX_LAYOUT_BATCH_MODE,
                                                  &ptr_mode, sizeof ptr_mode) == 0 &&
                 cublasLtMatrixLayoutSetAttribute(lay[m], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                  &batch, sizeof batch) == 0;
        if (ok && lt_algo(h, &o, &res)) {
            if (pass == 0)
                st = cublasLtMatmul(h, o.op, &one, (const void *)dp, o.la, (const void *)(dp + E),
                                    o.lb, &zero, (const void *)(dp + 2 * E), o.ld,
                                    (void *)(dp + 2 * E), o.ld, &res.algo, lt_ws(c), LT_WS,
                                    c->stream);
            else
                for (int i = 0; i < cnt && st == CUBLAS_STATUS_SUCCESS; i++)
                    st = cublasLtMatmul(h, o.op, &one, hp[i], o.la, hp[E + i], o.lb, &zero,
                                        hp[2 * E + i], o.ld, (void *)hp[2 * E + i], o.ld, &res.algo,
                                        lt_ws(c), LT_WS, c->stream);
            if (st == CUBLAS_STATUS_SUCCESS) *done = 1;
            /* (an algorithm the heuristic offers but the batched call refuses: pass 1) */
            else if (pass == 0 &&
                     (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE))
                st = CUBLAS_STATUS_SUCCESS;
        }
        lt_free(&o);
    }
    if (st != CUBLAS_STATUS_SUCCESS)
        return ds_errf(err, "cublasLt: moe experts %d x %d x %d (%d experts): status %d", N, n, K,
                       cnt, (int)st);
    return DS_OK;
}

int moe_plan_make(ds_cu *c, const int32_t *start, int E, moe_plan *p, ds_err *err) {
    /* host plan: start [E+1] | order [E] | panel [E] | then 6 pointer arrays [E] (A, B, C of
     * gate/up, then of down, in bucket order) | sort keys [E]. Pinned: the layout comes back and
     * the plan goes out as plain DMA while the host goes on (it is rewritten only after the next
     * call's synchronisation, when these copies are done). */
    const size_t ints = (size_t)3 * E + 1, ptr_at = (ints * 4 + 15) & ~(size_t)15,
                 key_at = ptr_at + (size_t)6 * E * sizeof(void *),
                 plan_bytes = key_at + (size_t)E * sizeof(uint64_t);
    if (c->h_moeb_bytes < plan_bytes) {
        CU_TRY(cudaStreamSynchronize(c->stream), "moe: plan buffer"); /* the old one is idle */
        cudaFreeHost(c->h_moeb);
        c->h_moeb = NULL, c->h_moeb_bytes = 0;
        CU_TRY(cudaMallocHost(&c->h_moeb, plan_bytes), "moe: plan buffer");
        c->h_moeb_bytes = plan_bytes;
    }
    int32_t *hs = (int32_t *)c->h_moeb;
    p->order = hs + E + 1, p->panel = p->order + E;
    p->ptrs = (const void **)((char *)c->h_moeb + ptr_at);
    uint64_t *keys = (uint64_t *)((char *)c->h_moeb + key_at);
    ds_cu_prof_mark(c, "moe gemm: layout to host");
    CU_TRY(cudaMemcpyAsync(hs, start, (size_t)(E + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                           c->stream),
           "moe: expert layout");
    CU_TRY(cudaStreamSynchronize(c->stream), "moe: expert layout");
    p->n_local = hs[E]; /* rows of this rank's experts, the first of perm */
    p->n_bk =
        moe_buckets(hs, E, keys, p->order, p->panel, p->bk_first, p->bk_rows, &p->n_act, &p->pr);
    return DS_OK;
}

int moe_plan_send(ds_cu *c, const moe_plan *p, int E, const int32_t *start, int32_t *dpanel,
                  void **dptrs, int32_t *slot, ds_err *err) {
    CU_TRY(cudaMemcpyAsync(dpanel, p->panel, (size_t)E * 4, cudaMemcpyHostToDevice, c->stream),
           "moe: panels");
    CU_TRY(cudaMemcpyAsync(dptrs, p->ptrs, (size_t)6 * E * sizeof(void *), cudaMemcpyHostToDevice,
                           c->stream),
           "moe: panels");
    launch_k(c, moe_slot_k, E, 256, 0, slot, start, (const int32_t *)dpanel);
    CU_TRY(cudaGetLastError(), "moe: slots");
    return DS_OK;
}

int moe_inverse(ds_cu *c, int32_t *inv, const int32_t *perm, const int32_t *slot, int rows,
                int n_local, ds_err *err) {
    CU_TRY(cudaMemsetAsync(inv, 0xff, (size_t)rows * sizeof(int32_t), c->stream), "moe inverse");
    if (n_local > 0)
        launch_k(c, moe_inverse_k, (n_local + 255) / 256, 256, 0, inv, perm, slot, n_local);
    CU_TRY(cudaGetLastError(), "moe inverse");
    return DS_OK;
}

int moe_experts_gemm(ds_cu *c, float *out, const float *x, const float *w, int T, int k, int E,
                     int D, int I, const uint16_t *gate_up, const uint16_t *down, int situ,
                     float situ_beta, float situ_lin_beta, int accumulate, const int32_t *start,
                     const int32_t *perm, ds_err *err) {
    const int rows = T * k;
    moe_plan pl;
    if (moe_plan_make(c, start, E, &pl, err)) return DS_ERR;
    const int n_local = pl.n_local, n_bk = pl.n_bk;
    const size_t pr = pl.pr; /* padded rows of all panels */
    const int32_t *order = pl.order, *panel = pl.panel, *bk_first = pl.bk_first,
                  *bk_rows = pl.bk_rows;
    const void **ptrs = pl.ptrs;
    /* xg [pr][D] bf16 | ab [pr][I] bf16 | h [pr][2I] f32 (bf16 with expert_bf16_out 2) |
     * y [pr][D] f32 (bf16 with expert_bf16_out) | inv [rows] | slot [rows] | panel [E] |
     * pointer arrays [6][E] | xr [T][D] bf16 (with expert_x16: moe_gather) */
    const int y16 = c->expert_bf16_out > 0, h16 = c->expert_bf16_out > 1;
    const size_t hsz = h16 ? 2 : 4, ysz = y16 ? 2 : 4; /* their elements' bytes */
    const size_t sz[9] = {pr * D * 2,
                          pr * I * 2,
                          pr * 2 * I * hsz,
                          pr * D * ysz,
                          (size_t)rows * 4,
                          (size_t)rows * 4,
                          (size_t)E * 4,
                          (size_t)6 * E * sizeof(void *),
                          c->expert_x16 ? (size_t)T * D * 2 : 0};
    void *b[9];
    if (carve_scratch(c, &c->moeg, &c->moeg_bytes, sz, b, 9, "moe gemm scratch", err))
        return DS_ERR;
    __nv_bfloat16 *xg = (__nv_bfloat16 *)b[0], *ab = (__nv_bfloat16 *)b[1];
    char *h = (char *)b[2], *y = (char *)b[3];
    int32_t *inv = (int32_t *)b[4], *slot = (int32_t *)b[5], *dpanel = (int32_t *)b[6];
    void **dptrs = (void **)b[7];
    const size_t per_gu = (size_t)2 * I * D, per_dn = (size_t)D * I;
    for (int i = 0; i < pl.n_act; i++) { /* in bucket order */
        const int e = order[i];
        ptrs[i] = gate_up + (size_t)e * per_gu;
        ptrs[E + i] = xg + (size_t)panel[e] * D;
        ptrs[2 * E + i] = h + (size_t)panel[e] * 2 * I * hsz;
        ptrs[3 * E + i] = down + (size_t)e * per_dn;
        ptrs[4 * E + i] = ab + (size_t)panel[e] * I;
        ptrs[5 * E + i] = y + (size_t)panel[e] * D * ysz;
    }
    ds_cu_prof_mark(c, "moe gemm: gather x");
    if (moe_plan_send(c, &pl, E, start, dpanel, dptrs, slot, err)) return DS_ERR;
    moe_gather(c, xg, (__nv_bfloat16 *)b[8], x, T, D, perm, slot, k, n_local);
    CU_TRY(cudaGetLastError(), "moe gather");
    const float one = 1.0f, zero = 0.0f;
    ds_cu_prof_mark(c, "moe gemm: gate/up");
    /* FLOPs counted for the routed rows only (not the panels' padding) */
    const char *prof = prof_gemm_open(c);
    cublasLtHandle_t lt = c->expert_lt ? (cublasLtHandle_t)lt_handle(c) : NULL;
    int lt_done = lt != NULL;           /* every bucket so far through cuBLASLt (expert_lt) */
    for (int bk = 0; bk < n_bk; bk++) { /* H_e [n][2I] = X_e [n][D] W_gu,e^T */
        const int i0 = bk_first[bk], cnt = bk_first[bk + 1] - i0;
        int done = 0;
        if (lt && lt_batched(c, lt, CUDA_R_16BF, 2 * I, bk_rows[bk], D, cnt, h16, dptrs + i0,
                             ptrs + i0, E, &done, err))
            return DS_ERR;
        lt_done &= done;
        if (!done)
            BLAS_TRY(cublasGemmBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, bk_rows[bk], D,
                                         &one, (const void *const *)(dptrs + i0), CUDA_R_16BF, D,
                                         (const void *const *)(dptrs + E + i0), CUDA_R_16BF, D,
                                         &zero, dptrs + 2 * E + i0, h16 ? CUDA_R_16BF : CUDA_R_32F,
                                         2 * I, cnt, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "moe up (batched gemm)");
    }
    prof_gemm_close(c, prof, 2.0 * n_local * 2 * I * D);
    ds_cu_prof_mark(c, "moe gemm: act");
    if (h16) /* (padding rows: never read) */
        launch_k(c, moe_act_bf16_k<__nv_bfloat16>, (unsigned)pr, 256, 0, ab,
                 (const __nv_bfloat16 *)h, I, situ, situ_beta, situ_lin_beta);
    else
        launch_k(c, moe_act_bf16_k<float>, (unsigned)pr, 256, 0, ab, (const float *)h, I, situ,
                 situ_beta, situ_lin_beta);
    CU_TRY(cudaGetLastError(), "moe act (gemm)");
    ds_cu_prof_mark(c, "moe gemm: down");
    prof = prof_gemm_open(c);
    for (int bk = 0; bk < n_bk; bk++) { /* Y_e [n][D] = A_e [n][I] W_down,e^T */
        const int i0 = bk_first[bk], cnt = bk_first[bk + 1] - i0;
        int done = 0;
        if (lt && lt_batched(c, lt, CUDA_R_16BF, D, bk_rows[bk], I, cnt, y16, dptrs + 3 * E + i0,
                             ptrs + 3 * E + i0, E, &done, err))
            return DS_ERR;
        lt_done &= done;
        if (!done)
            BLAS_TRY(cublasGemmBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, D, bk_rows[bk], I, &one,
                                         (const void *const *)(dptrs + 3 * E + i0), CUDA_R_16BF, I,
                                         (const void *const *)(dptrs + 4 * E + i0), CUDA_R_16BF, I,
                                         &zero, dptrs + 5 * E + i0, y16 ? CUDA_R_16BF : CUDA_R_32F,
                                         D, cnt, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "moe down (batched gemm)");
    }
    prof_gemm_close(c, prof, 2.0 * n_local * D * I);
    ds_cu_prof_mark(c, "moe gemm: combine");
    if (moe_inverse(c, inv, perm, slot, rows, n_local, err)) return DS_ERR;
    if (ds_cu_side_join(c, err)) return DS_ERR; /* out: see ds_cu_moe_experts */
    moe_combine_slots(c, out, y, y16, inv, w, NULL, NULL, NULL, 0, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe combine (gemm)");
    c->expert_gemm_runs++;
    c->expert_lt_runs += lt_done;
    return DS_OK;
}
