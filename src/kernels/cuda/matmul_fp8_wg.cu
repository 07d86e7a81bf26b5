/* matmul_fp8_wg.cu — decode's ptpc FP8 products (up to 8 tokens) on Hopper's FP8 tensor cores
 * through wgmma (ds_cu_set_f8_wg; docs/quantization.md §3). The other forms (fp8_stream.cuh's
 * tiles, fp8_rows.cuh's warp a row) turn every code into F16 or f32 first: `mma.sync` on E4M3 is
 * itself converted to F16 by ptxas on sm_90 (F2FP and two HMMA a k32 mma), and only wgmma runs
 * E4M3 natively. Here the codes go from the load straight into the tensor core, no instruction
 * touching them: a warpgroup owns 64 weight rows, each lane loading 16 bytes of its rows g and
 * g + 8 a 64-column step (the four warps' A fragments of two m64n8k32 wgmma, A from registers),
 * and the block's tokens, quantized per token in shared memory (B, K-major, no swizzle), are the
 * 8 columns. The w8a8 math of §3: each product exact, the sums in f32 — each step's pair of wgmma
 * from zero, its sums then added in f32 registers (the tensor core's own accumulation of E4M3
 * products is narrower than f32, as DeepSeek-V3's report found; promoting each 64-column partial
 * bounds what that costs: bench/RESULTS.md session 49 measures it). The order of the sums is
 * this kernel's own (not the tiles'): a form for batch invariance off.
 *
 * A block is one warpgroup on a 64-row tile and a slice of K: block (x, p) takes steps
 * [p ns / S, (p + 1) ns / S) of tile x (S by the matrix: enough blocks for one wave with every
 * load in flight). One token: each block quantizes it itself (the scale from the whole row, the
 * codes of its slice) while its first weights are in flight; more tokens (each block would read
 * every token's whole row): ptpc_act_k writes their codes first and each block copies its
 * slice's, its weights requested before it waits for them (PDL). With S > 1 each block
 * writes its partial sums, and the last of a tile's blocks to finish (a count a tile, left at zero
 * for the next call) adds them in order p = 0, 1, .. and writes y: the same sums whatever the
 * blocks' timing.
 *
 * One token's routed experts (ptpc FP8, moe_fp8.cu) take the same kernel with a grid row z a
 * routed row: expert direct[z]'s matrix, the block's input row z / x_div (through act for the
 * down pass: rows [gate | up]), its output row z. */
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fp8_stream.cuh"
#include "kernels/cuda/moe.cuh"

enum { F8WG_D = 8 };      /* 64-column steps in flight a lane (8 registers each) */
enum { F8WG_S_MAX = 16 }; /* K slices a tile */
/* the tokens' codes a block stages, at most (T times its slice, and F8WG_PAD); tiles a split
 * product may have (its counts lead the scratch) */
enum : size_t { F8WG_XSH_MAX = 96 * 1024, F8WG_PAD = 128, F8WG_CNT = 4096 };

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* Byte of token n's column c in B (T token rows): column c = 64 s + 16 l4 + 8 h + 4 half + t is
 * k = 16 half + 4 l4 + t of step s's wgmma h — the k that lane l4's A fragment gives the weights'
 * bytes 8 h + 4 half + t of its 16 (a0, a1: half 0; a2, a3: half 1) — so B's block (s, h) is two
 * core matrices (k 0-15, 16-31), each T rows of 16 bytes, 32 T bytes a block. Rows past T read
 * whatever follows (their columns are not stored; F8WG_PAD keeps the last block's in bounds). */
static __device__ __forceinline__ int f8wg_xbyte(int c, int n, int T) {
    const int s = c >> 6, l4 = (c >> 4) & 3, h = (c >> 3) & 1, half = (c >> 2) & 1, t = c & 3;
    return ((s * 2 + h) * 2 + half) * 16 * T + n * 16 + 4 * l4 + t;
}

/* B's descriptor for block (s, h) at shared address xs: no swizzle, the two core matrices 16 T
 * bytes apart along K (the leading byte offset). N = 8 is one 8-row group, so the stride byte
 * offset (between groups along N) is never used; it is given the same 16 T, so the layout reads
 * the same whichever of the two fields a reader takes for K. */
static __device__ __forceinline__ uint64_t f8wg_desc(uint32_t xs, int blk, int T) {
    const uint32_t a = xs + (uint32_t)(blk * 32 * T), o = (uint32_t)(16 * T) >> 4;
    return (uint64_t)((a & 0x3ffffu) >> 4) | (uint64_t)o << 16 | (uint64_t)o << 32;
}

/* d (+)= A B, m64n8k32 E4M3 x E4M3 -> f32, A from registers (this warp's m16n8k32 fragment);
 * ACC 0 writes d (it needs no zeroing: no instruction but the wgmma defines it) */
template <int ACC>
static __device__ __forceinline__ void f8wg_mma(float (&d)[4], uint32_t a0, uint32_t a1,
                                                uint32_t a2, uint32_t a3, uint64_t desc) {
    if (ACC)
        asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, %8, 1, 1, 1;\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, %8, 0, 1, 1;\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc));
}
#endif

/* y[t][r] = ((sum_c e4m3(x_t[c]) q[r][c]) * s_t) * sr[r] for t < T <= 8: x [T][ldx] f32
 * (quantized here, per token), W [N][K] codes, sr [N]. K % 64 == 0. Block (x, p, z): rows
 * [64 x, + 64), slice p of S; part [Z][S][T][N] f32 and cnt [Z][tiles] (zeros) when S > 1. xq:
 * the tokens' codes [T][K] and scales xst [T] ptpc_act_k wrote, or NULL (quantized here).
 * direct (T = 1): z is routed row z, of expert direct[z] - e0 (W [E][N][K], sr [E][N]; another
 * rank's: nothing), input row z / x_div (act.on: act of its [gate | up] halves of K), output row
 * z of y. */
__global__ void __launch_bounds__(128, 4)
    gemv_f8wg_k(float *y, int ldy, const float *x, int ldx, const uint8_t *W, const float *sr,
                int N, int K, int T, int S, float *part, int *cnt, const uint8_t *xq,
                const float *xst, const int32_t *direct, int e0, int E, int x_div, moe_act act) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) uint8_t f8wg_x[]; /* [slice / 32][2][T][16] B (f8wg_xbyte) */
    __shared__ float st_sh[8];                         /* [T] the tokens' scales */
    __shared__ int last;                               /* this block sums the tile's slices */
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, l4 = lane & 3;
    const int ns = K / 64, p = (int)blockIdx.y;
    const int s0 = p * ns / S, s1 = (p + 1) * ns / S, n_i = s1 - s0; /* this block's steps */
    const int ra = (int)blockIdx.x * 64 + warp * 16 + g, z = (int)blockIdx.z;
    if (direct) { /* the router's choice: read after the wait */
        PDL_ENTRY();
        const int e = direct[z] - e0;
        if (e < 0 || e >= E) return; /* (every block of this routed row) */
        W += (size_t)e * N * K, sr += (size_t)e * N;
        x += (size_t)(z / x_div) * ldx, y += (size_t)z * ldy;
    }
    /* this lane's 16 bytes of rows ra and ra + 8 at step s: w[4 s] (rows past N read row N - 1,
     * whose sums are not stored) */
    const uint4 *wa = (const uint4 *)(W + (size_t)min(ra, N - 1) * K) + l4;
    const uint4 *wb = (const uint4 *)(W + (size_t)min(ra + 8, N - 1) * K) + l4;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 a[F8WG_D][2]; /* the steps in flight: rows ra, ra + 8 */
#pragma unroll
    for (int u = 0; u < F8WG_D; u++) { /* weights: requested before the wait (PDL) */
        a[u][0] = u < n_i ? __ldg(wa + 4 * (s0 + u)) : zero;
        a[u][1] = u < n_i ? __ldg(wb + 4 * (s0 + u)) : zero;
    }
    if (!direct) PDL_ENTRY();
    /* the tokens' codes of columns [64 s0, 64 s1): copied (4 codes at a time: f8wg_xbyte keeps
     * them together), or made here per token (the scale from the whole row) */
    for (int n = 0; xq && n < T; n++) {
        const uint8_t *qr = xq + (size_t)n * K + 64 * s0;
        for (int c = 4 * tid; c < 64 * n_i; c += 4 * 128)
            *(uint32_t *)(f8wg_x + f8wg_xbyte(c, n, T)) = __ldg((const uint32_t *)(qr + c));
        if (tid == 0) st_sh[n] = xst[n];
    }
    for (int n = 0; !xq && n < T; n++) {
        const float *xr = x + (size_t)n * ldx;
        auto val = [xr, K, act](int c) {
            return act.on ? act_pair(xr[c], xr[K + c], act.situ, act.beta, act.lin_beta) : xr[c];
        };
        float amax = 0.0f;
        for (int c0 = tid; c0 < K; c0 += F8_QB * 128) {
            float v[F8_QB];
#pragma unroll
            for (int i = 0; i < F8_QB; i++) v[i] = c0 + i * 128 < K ? val(c0 + i * 128) : 0.0f;
#pragma unroll
            for (int i = 0; i < F8_QB; i++) amax = fmaxf(amax, fabsf(v[i]));
        }
        amax = block_max(amax);
        const float st = ds_ptpc_scale(amax), inv = 1.0f / st; /* (as f8_quant_put) */
        if (tid == 0) st_sh[n] = st;
        for (int c = tid; c < 64 * n_i; c += 128)
            f8wg_x[f8wg_xbyte(c, n, T)] = f8_code(val(64 * s0 + c) * inv);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* to the tensor cores */
    __syncthreads();
    const uint32_t xs = (uint32_t)__cvta_generic_to_shared(f8wg_x);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int i0 = 0; i0 < n_i; i0 += F8WG_D) {
#pragma unroll
        for (int u = 0; u < F8WG_D; u++) {
            const int i = i0 + u;
            if (i >= n_i) break; /* (uniform over the block) */
            float d[4];
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            f8wg_mma<0>(d, a[u][0].x, a[u][1].x, a[u][0].y, a[u][1].y, f8wg_desc(xs, 2 * i, T));
            f8wg_mma<1>(d, a[u][0].z, a[u][1].z, a[u][0].w, a[u][1].w, f8wg_desc(xs, 2 * i + 1, T));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            acc[0] += d[0], acc[1] += d[1], acc[2] += d[2], acc[3] += d[3];
            if (i + F8WG_D < n_i) { /* (its registers now free) */
                a[u][0] = __ldg(wa + 4 * (s0 + i + F8WG_D));
                a[u][1] = __ldg(wb + 4 * (s0 + i + F8WG_D));
            }
        }
    }
    /* C: rows ra (acc 0, 1) and ra + 8 (2, 3), tokens 2 l4 + j */
    if (S > 1) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int t = 2 * l4 + j;
            if (t >= T) continue;
            float *pr = part + (((size_t)z * S + p) * T + t) * N;
            if (ra < N) pr[ra] = acc[j];
            if (ra + 8 < N) pr[ra + 8] = acc[2 + j];
        }
        __threadfence(); /* the partials visible before the count says so */
        __syncthreads();
        int *ct = cnt + (size_t)z * gridDim.x + blockIdx.x;
        if (tid == 0) last = atomicAdd(ct, 1) == S - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        if (tid == 0) *ct = 0; /* for the next call (every other block has counted) */
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int t = 2 * l4 + j;
            acc[j] = acc[2 + j] = 0.0f;
            if (t >= T) continue;
            for (int q = 0; q < S; q++) { /* in order of the slices: the same bits every call */
                const float *pr = part + (((size_t)z * S + q) * T + t) * N;
                if (ra < N) acc[j] += __ldcg(pr + ra);
                if (ra + 8 < N) acc[2 + j] += __ldcg(pr + ra + 8);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int t = 2 * l4 + j;
        if (t >= T) continue;
        if (ra < N) y[(size_t)t * ldy + ra] = (acc[j] * st_sh[t]) * sr[ra];
        if (ra + 8 < N) y[(size_t)t * ldy + ra + 8] = (acc[2 + j] * st_sh[t]) * sr[ra + 8];
    }
#endif
}

/* K slices a tile: up to four blocks an SM in one wave, at least F8WG_D steps a slice */
static int f8wg_slices(const ds_cu *c, int N, int K) {
    const int tiles = (N + 63) / 64, ns = K / 64;
    int S = 1;
    while (S < F8WG_S_MAX && tiles * 2 * S <= 4 * c->n_sm && ns / (2 * S) >= F8WG_D) S *= 2;
    return S;
}

/* the shared memory of a block: T tokens' codes of its slice, and F8WG_PAD */
static size_t f8wg_smem(int T, int K, int S) {
    return (size_t)T * 64 * ((K / 64 + S - 1) / S) + F8WG_PAD;
}

/* Whether Z matrices of N x K at T tokens fit the kernel: whole 64-column steps, a slice's codes
 * within F8WG_XSH_MAX, the counts of a split product within F8WG_CNT */
static bool f8wg_shape_fits(const ds_cu *c, int T, int Z, int N, int K) {
    if (K % 64) return false;
    const int S = f8wg_slices(c, N, K);
    return f8wg_smem(T, K, S) <= F8WG_XSH_MAX &&
           (S == 1 || (size_t)Z * ((N + 63) / 64) <= F8WG_CNT);
}

/* Whether a product of T tokens takes this form: asked, batch invariance off, Hopper, 16-byte
 * aligned codes, a shape that fits. */
bool fp8_wg_fits(const ds_cu *c, int T, int N, int K, const void *W) {
    return (c->f8_wg & 1) && !c->batch_invariant && c->sm90 && T >= 1 && T <= 8 &&
           (uintptr_t)W % 16 == 0 && f8wg_shape_fits(c, T, 1, N, K);
}

/* the launch for Z matrices (Z routed rows with direct, else one) */
static int f8wg_launch(ds_cu *c, float *y, int ldy, const float *x, int ldx, const uint8_t *xq,
                       const float *xst, int T, const uint8_t *W, const float *sr, int N, int K,
                       int Z, const int32_t *direct, int e0, int E, int x_div, moe_act act,
                       ds_err *err) {
    const int tiles = (N + 63) / 64, S = f8wg_slices(c, N, K);
    if (!c->f8_wg_smem) { /* once, before any capture can be open */
        CU_TRY(cudaFuncSetAttribute((const void *)gemv_f8wg_k,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)F8WG_XSH_MAX),
               "matmul fp8 (wgmma): shared memory");
        c->f8_wg_smem = 1;
    }
    float *part = NULL;
    int *cnt = NULL;
    if (S > 1) { /* the tiles' counts [F8WG_CNT] (zeros between calls), then partials
                    [Z][S][T][N] f32; the buffer is this stream's (the side stream has its own) */
        const size_t need = F8WG_CNT * 4 + (size_t)Z * S * T * N * 4;
        const int grew = need > c->f8_wg_bytes;
        if (grow_scratch(c, &c->f8_wg_buf, &c->f8_wg_bytes, need, "matmul fp8 (wgmma)", err))
            return DS_ERR;
        if (grew) CU_TRY(cudaMemsetAsync(c->f8_wg_buf, 0, F8WG_CNT * 4, c->stream), "memset");
        cnt = (int *)c->f8_wg_buf;
        part = (float *)((char *)c->f8_wg_buf + F8WG_CNT * 4);
    }
    launch_k(c, gemv_f8wg_k, dim3((unsigned)tiles, (unsigned)S, (unsigned)Z), 128,
             f8wg_smem(T, K, S), y, ldy, x, ldx, W, sr, N, K, T, S, part, cnt, xq, xst, direct, e0,
             E, x_div, act);
    CU_TRY(cudaGetLastError(), "matmul fp8 (wgmma)");
    return DS_OK;
}

int fp8_wg(ds_cu *c, float *y, int ldy, const float *x, int ldx, const uint8_t *xq,
           const float *xst, int T, const ds_cu_mat *w, ds_err *err) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    return f8wg_launch(c, y, ldy, x, ldx, xq, xst, T, (const uint8_t *)w->data,
                       (const float *)w->scale, w->rows, w->cols, 1, (const int32_t *)NULL, 0, 0, 1,
                       none, err);
}

bool fp8_wg_experts_fit(const ds_cu *c, int k, int D, int I, const void *gc, const void *dc) {
    return (c->f8_wg & 2) && !c->batch_invariant && c->sm90 &&
           ((uintptr_t)gc | (uintptr_t)dc) % 16 == 0 && f8wg_shape_fits(c, 1, k, 2 * I, D) &&
           f8wg_shape_fits(c, 1, k, D, I);
}

int fp8_wg_experts(ds_cu *c, float *h, float *y, const float *x, int D, int I, int k,
                   const uint8_t *gc, const float *gs, const uint8_t *dc, const float *ds,
                   const int32_t *direct, int e0, int E, moe_act act, ds_err *err) {
    const moe_act none = {0, 0, 0.0f, 0.0f};
    if (f8wg_launch(c, h, 2 * I, x, D, (const uint8_t *)NULL, (const float *)NULL, 1, gc, gs, 2 * I,
                    D, k, direct, e0, E, k, none, err))
        return DS_ERR;
    return f8wg_launch(c, y, D, h, 2 * I, (const uint8_t *)NULL, (const float *)NULL, 1, dc, ds, D,
                       I, k, direct, e0, E, 1, act, err);
}

extern "C" void ds_cu_set_f8_wg(ds_cu *c, int which) {
    c->f8_wg = which;
}
