/* common.cuh — what every CUDA kernel file shares: the ds_cu context, the launch helpers
 * (programmatic dependent launch, clusters, the what-if skip), error macros, the scratch
 * buffers' growth, and the device helpers several ops use (block reductions, BF16 packing and
 * dot products, cp.async, the m16n8k16 tensor-core step, the experts' activation). Device
 * helpers are `static __device__` here so that each .cu file compiles its own copy: no
 * relocatable device code. Built for sm_90a plus PTX for other parts (CMakeLists.txt). */
#ifndef DS_CUDA_COMMON_CUH
#define DS_CUDA_COMMON_CUH

#include "kernels/cuda/cuda_kernels.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <mma.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct ds_cu {
    int device;
    int n_sm; /* streaming multiprocessors (how many blocks fill the GPU) */
    cudaStream_t stream;
    cublasHandle_t blas;
    uint16_t *xb; /* activations rounded to BF16 for cuBLAS; xb_bytes allocated */
    size_t xb_bytes;
    float *part; /* split-context attention partials, MoE intermediates; part_bytes allocated */
    size_t part_bytes;
    char name[160];
    cudaError_t sticky;  /* first launch error seen by a void function; reported by ds_cu_sync */
    int batch_invariant; /* every matmul through the weight-streaming kernel (see the header) */
    uint64_t epoch;      /* bumped whenever a scratch buffer moves (captured graphs go stale) */
    int expert_gemm;     /* routed experts of long steps through cuBLAS (ds_cu_set_expert_gemm) */
    int expert_bf16_out; /* ... writing BF16: 1 the down pass, 2 gate/up's too */
    int expert_x16;      /* ... gathering routed rows from x rounded once (ds_cu_set_expert_x16) */
    int expert_mma;      /* grouped experts of batches on tensor cores (ds_cu_set_expert_mma) */
    int expert_tc;       /* ...through the streaming tensor-core kernel (ds_cu_set_expert_tc) */
    int mma_min_tokens;  /* ...from this many tokens a step (ds_cu_set_expert_mma_min; 0: 40) */
    int gemv_max_t;      /* matmuls of up to this many rows stream (ds_cu_set_gemv_max_t; 0: 2) */
    int f8_prequant;     /* FP8 decode products read codes made by the activations' quantizer,
                            not quantize their tokens themselves (ds_cu_set_f8_prequant) */
    int f8_split_min;    /* the FP8 streams' fewest steps a warp along K (0: F8_SPLIT_MIN) */
    int f8_split;        /* ...their split of K forced (0: the rule's; ds_cu_set_f8_split) */
    int f8_moe_waves;    /* one token's FP8 experts: blocks an SM at most (0: 2) */
    int f8_gemv_waves;   /* an FP8 product that quantizes its tokens: blocks an SM (0: 2) */
    int f8_noquant;      /* a what-if: decode's FP8 products skip quantizing their tokens */
    int f8_rows;         /* one token's FP8 products a warp a row: blocks an SM (0: 4; < 0 off) */
    int f8_wg;           /* decode's FP8 products on wgmma: 1 dense, 2 experts (ds_cu_set_f8_wg) */
    int f8_wg_smem;      /* ... its kernel's shared memory raised (once) */
    void *f8_wg_buf;     /* ... its counts and partial sums (matmul_fp8_wg.cu), f8_wg_bytes */
    size_t f8_wg_bytes;
    int f8_moe_rows;     /* the same for one token's routed experts */
    int f8_whole_k;      /* tokens from which the FP8 streams keep K whole (no invariance; 0 off) */
    int mla_gemm;        /* expanded MLA of long segments through cuBLAS (ds_cu_set_mla_gemm) */
    int mla_all_heads;   /* absorbed MLA with a block per token for all heads (ds_cu_set_...) */
    int mla_flash;       /* that path as one fused kernel where it has one (ds_cu_set_mla_flash):
                            1 on mma.sync, 2 on wgmma (sm_90), 3 wgmma x2, 4 that pipelined */
    int mla_ctx_block;   /* context rows a chunk's expanded attention takes at a time (0: all) */
    int mla_decode_tc;   /* absorbed MLA on tensor cores from this many context rows (0: never) */
    int mla_merge_warps; /* absorbed MLA's splits merged with 8 warps a block (mla_merge_w_k) */
    int fp4_one; /* MXFP4 streaming experts: one BF16 part of the activations (ds_cu_set_...) */
    /* the experts' and the FP8 products' cuBLASLt paths (moe_tensor.cu, moe_fp8_gemm.cu,
     * matmul_fp8.cu) */
    int lt_each;           /* the experts one cuBLASLt call each (ds_cu_set_lt_each) */
    long expert_gemm_runs; /* calls the experts' cuBLAS paths completed (ds_cu_expert_gemm_runs) */
    int f8_lt_unit;        /* FP8 products on cuBLASLt with unit scales (ds_cu_set_f8_lt_unit) */
    long f8_lt_vec_runs;   /* ... products it scaled itself (ds_cu_f8_lt_vec_runs) */
    int expert_lt;         /* the BF16 experts' batches through cuBLASLt (ds_cu_set_expert_lt) */
    long expert_lt_runs;   /* ... calls whose every batch ran there (ds_cu_expert_lt_runs) */

    int mla_decode_tc_tile;  /* its tile for FP8 and BF16 rows: 64 rows, else 32 */
    int mla_decode_tc_warps; /* its warps a block for BF16 rows in 64-row tiles: 16, else 8 */
    int mla_decode_ws;       /* its warp-specialized form from this context cap (0: never) */
    int mla_ws_oconv;        /* ...whose FP8 scores come from the staged codes, its output warps
                              * converting their columns (else its score warps convert the tile) */
    int kda_tc;        /* chunked KDA's scan and outputs on tensor cores: 0 no, 1 TF32, 3 3xTF32 */
    int kda_prep_f32;  /* ...and its first pass on CUDA cores even so (ds_cu_set_kda_prep_tc) */
    int kda_out_sep;   /* ...and its outputs in a third pass (ds_cu_set_kda_out_fused) */
    int early_experts; /* the experts' down pass reads its routing early (ds_cu_set_...) */
    int wide_early;    /* one-token matmuls through the experts' kernel load before the wait */
    int gemv_wide;     /* one-token matmuls of many rows 4 rows a warp (ds_cu_set_gemv_wide) */
    int conv_fixed;    /* the short conv with its width at compile time (ds_cu_set_conv_fixed) */
    void *mlag;        /* that path's buffers, mlag_bytes allocated */
    size_t mlag_bytes;
    void *kdac; /* chunked KDA's per-chunk products and chunk table, kdac_bytes allocated */
    size_t kdac_bytes;
    void *h_kda; /* host copy of that chunk table, h_kda_bytes allocated */
    size_t h_kda_bytes;
    const void *kda_tab_dev; /* where the table in h_kda sits on the device (NULL: nowhere) */
    size_t kda_tab_bytes;
    void *moeg;   /* that path's buffers, moeg_bytes allocated */
    void *h_moeb; /* its host-side plan (panels, pointer arrays), h_moeb_bytes allocated */
    size_t h_moeb_bytes;
    size_t moeg_bytes;
    void *moegi; /* the FP8 experts' cuBLASLt path's layout (moe_fp8_gemm.cu), moegi_bytes */
    size_t moegi_bytes;
    void *blas_ws;        /* cuBLAS's workspace, set once so that graph capture allocates nothing */
    struct cu_prof *prof; /* per-op timing when enabled (ds_cu_prof_enable), else NULL */
    int sm90;             /* Hopper (9.x): its sm_90a code runs (clusters, wgmma, PDL) */
    int pdl;              /* launches may overlap the previous kernel's tail (below) */
    char *skip;           /* ';'-separated profile labels whose kernels are not launched */
    int skipping;         /* the current label is one of them (ds_cu_set_skip) */
    /* the side stream (ds_cu_side_begin): its own cuBLAS handle, workspace and matmul scratch,
     * swapped with the main stream's while work is issued there */
    cudaStream_t side;
    cublasHandle_t blas_side;
    void *blas_ws_side;
    uint16_t *xb_side;
    size_t xb_side_bytes;
    void *f8_wg_side; /* the wgmma FP8 products' scratch (f8_wg_buf), f8_wg_side_bytes */
    size_t f8_wg_side_bytes;
    cudaEvent_t ev_fork, ev_join;
    int side_on, on_side, side_pending;
    /* the L2 prefetch stream (ds_cu_set_l2_prefetch): pf_after marks the last weight stream
     * issued, pf_join the prefetches' end; pf_bytes caps one prefetch (0: off); pf_have: a mark
     * since the last join; pf_pending: a prefetch since the last join */
    cudaStream_t pf;
    cudaEvent_t pf_after, pf_join;
    cudaEvent_t st_ev[2]; /* ds_cu_step_mark's marks (st_have: made) */
    int st_have;
    size_t pf_bytes;
    int pf_have, pf_pending;
    void *drawb; /* ds_cu_draw_rows' draws, edits, weights and tokens, drawb_bytes allocated */
    size_t drawb_bytes;
    int epoch_bump; /* set by grow_scratch; the next ds_cu_epoch reads and clears it */
    /* kernels' dynamic shared memory raised above 48 KB (cudaFuncSetAttribute holds per device,
     * so per context): once, before any capture can be open */
    size_t mla_ah_smem[9];   /* the all-heads MLA kernel's bytes, per OT (4, 8, 16) and DS_KV_* */
    size_t mla_tcd_smem[24]; /* the tensor-core decode MLA kernel's: Ha, DS_KV_*, tile, warps */
    size_t mla_tcw_smem[6];  /* its warp-specialized form's, per Ha (16, 32) and BF16 / FP8 rows /
                              * FP8 rows converted by the output warps */
    int mla_flash_smem;      /* the fused expanded MLA kernel's */
    int mla_wg_smem;         /* ... its wgmma form's */
    int moe_grouped_smem;    /* the grouped experts' kernels' */
    int kda_chunk_smem[2];   /* chunked KDA's kernels', per head size (64, 128) */
    /* moe_grouped_pick's blocks an SM holds per grouped kernel, for the smem last asked about */
    int grouped_per_sm[4];
    size_t grouped_per_sm_smem[4];
    int32_t *row_zero; /* gemv_wide's routing (g_row_zero's address on this device; NULL: unread) */
    void *lt;          /* FP8 tensor cores' cuBLASLt handle (matmul_fp8.cu), made at first use */
    int moe_fp4_smem;  /* the MXFP4 experts' streaming kernels' shared memory raised (once) */
};

/* Programmatic dependent launch (sm_90): every kernel is launched allowed to start while the one
 * before it on the stream drains, and every kernel begins by waiting for its predecessor's grid
 * to complete (griddepcontrol.wait: all of its memory visible), then lets its own successor be
 * scheduled. A decode step is hundreds of small launches; this hides each one's launch and ramp
 * behind the previous kernel's last wave, inside graphs too. Before the wait a kernel reads only
 * weights (written at load, followed by a synchronisation) — so that any kernel may follow any
 * other (and cuBLAS's kernels, which never trigger early, are simply waited for) — with one
 * exception: the KDA recurrence reads its state, which only the kernel just before it must not
 * have written (everything earlier is complete by then; see kda_run). Weights loaded before the
 * wait shortened a batch-1 step of the 48B shape (the row norms' share alone: bench/RESULTS.md).
 * ds_cu_set_pdl(c, 0) turns it off. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY()                                                                                \
    asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define PDL_ENTRY()                                                                                \
    do {                                                                                           \
    } while (0)
#endif

/* A launch on the step's stream, with programmatic dependent launch when on; cl > 0 runs the
 * blocks in clusters of cl along x (thread block clusters: sm_90). */
template <typename... P, typename... A>
static void launch_cluster_k(ds_cu *c, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                             unsigned cl, A &&...args) {
    if (c->skipping) return; /* a what-if measurement (ds_cu_set_skip) */
    cudaLaunchAttribute at[2];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = c->pdl;
    at[1].id = cudaLaunchAttributeClusterDimension;
    at[1].val.clusterDim.x = cl;
    at[1].val.clusterDim.y = 1;
    at[1].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = c->stream;
    cfg.attrs = at;
    cfg.numAttrs = cl ? 2 : 1;
    (void)cudaLaunchKernelEx(&cfg, kernel, static_cast<A &&>(args)...); /* seen by the caller's
                                                                          cudaGetLastError */
}

template <typename... P, typename... A>
static void launch_k(ds_cu *c, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                     A &&...args) {
    launch_cluster_k(c, kernel, grid, block, smem, 0u, static_cast<A &&>(args)...);
}

#define CU_TRY(call, what)                                                                         \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) return ds_errf(err, "cuda: %s: %s", what, cudaGetErrorString(e_));  \
    } while (0)

#define BLAS_TRY(call, what)                                                                       \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            return ds_errf(err, "cublas: %s: status %d", what, (int)s_);                           \
    } while (0)

/* A void launcher records its launch error here; the next ds_cu_sync reports it. */
static inline void note_launch(ds_cu *c) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess && c->sticky == cudaSuccess) c->sticky = e;
}

/* a timing build's per-phase cycle counters (a __device__ array, kda_chunked.cu's and
 * mla_decode_tc.cu's): copied into cycles, then zeroed; -1 on a CUDA error */
template <size_t N>
static inline int take_clocks(unsigned long long (&counters)[N], double *cycles) {
    unsigned long long h[N];
    if (cudaMemcpyFromSymbol(h, counters, sizeof h) != cudaSuccess) return -1;
    for (size_t i = 0; i < N; i++) cycles[i] = (double)h[i];
    static const unsigned long long zero[N] = {0};
    return cudaMemcpyToSymbol(counters, zero, sizeof zero) == cudaSuccess ? 0 : -1;
}

/* Is the stream recording a graph? (The experts' cuBLAS path reads their layout on the host, which
 * a capture cannot; nor can the profile's events record.) */
static inline int capturing(ds_cu *c) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(c->stream, &st) != cudaSuccess ||
           st != cudaStreamCaptureStatusNone;
}

/* Grows a device scratch buffer of c's to at least `need` bytes (contents not kept); a move bumps
 * c's graph epoch (context.cu). */
int grow_scratch(ds_cu *c, void **p, size_t *cap, size_t need, const char *what, ds_err *err);
/* n buffers of sizes[i] bytes laid out in one scratch (each 256-byte aligned), grown to fit; out[i]
 * receive their addresses. */
int carve_scratch(ds_cu *c, void **buf, size_t *cap, const size_t *sizes, void **out, int n,
                  const char *what, ds_err *err);
/* launches to_bf16_rows: xb [T][K] packed from x [T][ldx] (matmul.cu) */
void round_rows(ds_cu *c, __nv_bfloat16 *xb, const float *x, int ldx, int K, int T);
/* a one-token matmul of many rows through the routed experts' kernel (moe_experts.cu) */
int gemv_wide(ds_cu *c, float *y, const float *x, const uint16_t *W, int N, int K, ds_err *err);
/* decode's FP8 products on wgmma (matmul_fp8_wg.cu): whether T tokens of N x K codes at W take
 * it, and the product, its tokens quantized in its blocks (xq NULL) or by ptpc_act_k first (xq
 * [T][K] codes, xst [T] scales) */
bool fp8_wg_fits(const ds_cu *c, int T, int N, int K, const void *W);
int fp8_wg(ds_cu *c, float *y, int ldy, const float *x, int ldx, const uint8_t *xq,
           const float *xst, int T, const ds_cu_mat *w, ds_err *err);
/* ds_cu_matmul of an FP8 w (matmul_fp8.cu); stream: through the weight-streaming kernel */
int matmul_fp8(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T, const ds_cu_mat *w,
               int stream, ds_err *err);
/* up to pf_bytes of a weight stream's [bytes] at p prefetched into L2 once the stream marked last
 * (ds_cu_l2_mark) has finished, when the prefetch stream is on (context.cu) */
int cu_l2_prefetch(ds_cu *c, const void *p, size_t bytes, ds_err *err);
/* the FP8 products' cuBLASLt handle, released (matmul_fp8.cu) */
extern "C" void fp8_free(ds_cu *c);
/* ... made at its first use (never inside a capture), NULL where it cannot be: a cublasLtHandle_t
 * (matmul_fp8.cu), the FP8 products' and the experts' batches' */
void *lt_handle(ds_cu *c);
/* a weight GEMM's own profile interval (profile.cu) */
const char *prof_gemm_open(ds_cu *c);
void prof_gemm_close(ds_cu *c, const char *prev, double flops);

/* Four floats rounded to BF16, stored as one 8-byte word (dst 8-byte aligned). */
static __device__ __forceinline__ void store_bf16x4(__nv_bfloat16 *dst, float4 v) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *(uint32_t *)&lo, u.y = *(uint32_t *)&hi;
    *(uint2 *)dst = u;
}

/* Eight BF16 weights (one 16-byte load) dotted with eight f32 activations, in a fixed order: the
 * weight-streaming kernels' inner step. */
static __device__ __forceinline__ float dot8(uint4 u, const float *x) {
    const float4 a = ((const float4 *)x)[0], b = ((const float4 *)x)[1];
    return __uint_as_float(u.x << 16) * a.x + __uint_as_float(u.x & 0xffff0000u) * a.y +
           __uint_as_float(u.y << 16) * a.z + __uint_as_float(u.y & 0xffff0000u) * a.w +
           __uint_as_float(u.z << 16) * b.x + __uint_as_float(u.z & 0xffff0000u) * b.y +
           __uint_as_float(u.w << 16) * b.z + __uint_as_float(u.w & 0xffff0000u) * b.w;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024). */
static __device__ inline float block_sum(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads(); /* part may still be read by a previous call */
    if (lane == 0) part[wid] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Maximum over the block, likewise (exact: the order does not matter). */
static __device__ inline float block_max(float v) {
    __shared__ float part[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    __syncthreads(); /* part may still be read by a previous call */
    if (lane == 0) part[wid] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* act(gate, up): SiLU(g) u, or SiTU (docs/model.md) — one definition for every kernel that applies
 * it, so that fused and separate passes give the same bits. */
static __device__ __forceinline__ float act_pair(float g, float u, int situ, float beta,
                                                 float lin_beta) {
    if (situ) {
        const float phi = lin_beta > 0.0f ? lin_beta * tanhf(u / lin_beta) : u;
        return beta * tanhf(g / beta) / (1.0f + expf(-g)) * phi;
    }
    return g / (1.0f + expf(-g)) * u;
}

/* act_pair on four gate and four up values */
static __device__ __forceinline__ float4 act_pair4(float4 g, float4 u, int situ, float beta,
                                                   float lin_beta) {
    return make_float4(
        act_pair(g.x, u.x, situ, beta, lin_beta), act_pair(g.y, u.y, situ, beta, lin_beta),
        act_pair(g.z, u.z, situ, beta, lin_beta), act_pair(g.w, u.w, situ, beta, lin_beta));
}

/* cp.async: 16-byte copies global -> shared that run on while the thread goes on */
static __device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
/* rows x COLS floats (COLS a multiple of 4) from src, rows lds apart, into dst, rows ldd apart
 * (both 16-byte aligned): 16-byte pieces, thread threadIdx.x of NT taking every NT-th */
template <int COLS, int NT>
static __device__ __forceinline__ void cp_async_rows(float *dst, int ldd, const float *src,
                                                     size_t lds, int rows) {
    static_assert(COLS % 4 == 0, "16-byte pieces");
    for (int i = threadIdx.x; i < rows * (COLS / 4); i += NT) {
        const int r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
        cp_async16(dst + r * ldd + c, src + (size_t)r * lds + c);
    }
}
/* cp.async of 16 bytes, or (valid false) 16 zero bytes written and nothing read */
static __device__ __forceinline__ void cp_async16_zfill(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

/* ldmatrix: four 8 x 8 b16 matrices, lane L giving the address of row L % 8 of matrix L / 8;
 * .trans hands each lane its column pairs instead of row pairs */
static __device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

static __device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
static __device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

static __device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                 uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (lo) in the low half */
    return *(uint32_t *)&v;
}

#endif
