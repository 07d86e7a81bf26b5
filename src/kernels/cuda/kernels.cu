/* kernels.cu — CUDA kernels with the CPU backend's contracts (see cuda_kernels.h).
 *
 * Built for sm_90a (Hopper) plus PTX for older and newer parts (tools/cuda_build.sh). */
#include "kernels/cuda/cuda_kernels.h"
#include "model/rand_hash.h"

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
    int expert_mma;      /* grouped experts of batches on tensor cores (ds_cu_set_expert_mma) */
    int expert_tc;       /* ...through the streaming tensor-core kernel (ds_cu_set_expert_tc) */
    int mma_min_tokens;  /* ...from this many tokens a step (ds_cu_set_expert_mma_min; 0: 40) */
    int gemv_max_t;      /* matmuls of up to this many rows stream (ds_cu_set_gemv_max_t; 0: 2) */
    int mla_gemm;        /* expanded MLA of long segments through cuBLAS (ds_cu_set_mla_gemm) */
    int mla_all_heads;   /* absorbed MLA with a block per token for all heads (ds_cu_set_...) */
    int mla_flash;       /* that path as one fused kernel where it has one (ds_cu_set_mla_flash) */
    int kda_tc;        /* chunked KDA's scan and outputs on tensor cores: 0 no, 1 TF32, 3 3xTF32 */
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
    void *blas_ws;        /* cuBLAS's workspace, set once so that graph capture allocates nothing */
    struct cu_prof *prof; /* per-op timing when enabled (ds_cu_prof_enable), else NULL */
    int sm90;             /* compute capability 9 or above: thread block clusters */
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
    cudaEvent_t ev_fork, ev_join;
    int side_on, on_side, side_pending;
    void *drawb; /* ds_cu_draw_rows' draws, edits, weights and tokens, drawb_bytes allocated */
    size_t drawb_bytes;
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
 * wait took 0.175 ms off a batch-1 step of the 48B shape (the row norms alone: bench/RESULTS.md).
 * DS_CUDA_PDL=0 turns it off. */
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
static void note_launch(ds_cu *c) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess && c->sticky == cudaSuccess) c->sticky = e;
}

extern "C" int ds_cu_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" int ds_cu_create(int device, ds_cu **out, ds_err *err) {
    *out = NULL;
    int n = 0;
    CU_TRY(cudaGetDeviceCount(&n), "counting devices");
    if (device < 0 || device >= n)
        return ds_errf(err, "cuda: device %d does not exist (%d found)", device, n);
    CU_TRY(cudaSetDevice(device), "selecting the device");
    ds_cu *c = (ds_cu *)calloc(1, sizeof *c);
    if (!c) return ds_errf(err, "cuda: out of memory");
    c->device = device;
    cudaDeviceProp p;
    c->n_sm = 1;
    if (cudaGetDeviceProperties(&p, device) == cudaSuccess && (c->n_sm = p.multiProcessorCount)) {
        snprintf(c->name, sizeof c->name, "%s, %d SMs, %.1f GiB, sm_%d%d", p.name,
                 p.multiProcessorCount, (double)p.totalGlobalMem / (1u << 30), p.major, p.minor);
        const char *pdl = getenv("DS_CUDA_PDL");
        c->pdl = p.major >= 9 && !(pdl && !strcmp(pdl, "0"));
        c->sm90 = p.major >= 9;
    }
    if (cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking) != cudaSuccess) {
        free(c);
        return ds_errf(err, "cuda: cannot create a stream");
    }
    if (cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS ||
        cudaMalloc(&c->blas_ws, (size_t)32 << 20) != cudaSuccess ||
        cublasSetWorkspace(c->blas, c->blas_ws, (size_t)32 << 20) != CUBLAS_STATUS_SUCCESS) {
        cudaStreamDestroy(c->stream);
        free(c);
        return ds_errf(err, "cublas: cannot create a handle");
    }
    *out = c;
    return DS_OK;
}

static void side_free(ds_cu *c) {
    if (!c->side_on) return;
    cudaStreamSynchronize(c->side);
    cublasDestroy(c->blas_side);
    cudaFree(c->blas_ws_side);
    cudaFree(c->xb_side);
    cudaEventDestroy(c->ev_fork);
    cudaEventDestroy(c->ev_join);
    cudaStreamDestroy(c->side);
    c->side_on = 0;
}

/* ---- a second stream inside a step ----------------------------------------------------------
 * A decode step is a chain of small kernels, each waiting for the one before; where two chains
 * do not depend on each other (the shared experts beside the router and routed experts; the
 * decay gates beside the short convs), the second is issued on a side stream that forks from the
 * main one and is joined back before its results are read, so that the two run at once — in
 * graphs too (the fork and join are events, which capture turns into edges). Between begin and
 * end every launch (and cuBLAS call) goes to the side stream, with its own matmul scratch. Off
 * while profiling (events of two streams interleaved would make no per-op times). */
extern "C" int ds_cu_set_side(ds_cu *c, int on, ds_err *err) {
    if (!on) {
        side_free(c);
        return DS_OK;
    }
    if (c->side_on) return DS_OK;
    if (cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking) != cudaSuccess)
        return ds_errf(err, "cuda: cannot create the side stream");
    if (cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&c->ev_join, cudaEventDisableTiming) != cudaSuccess ||
        cublasCreate(&c->blas_side) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(c->blas_side, c->side) != CUBLAS_STATUS_SUCCESS ||
        cudaMalloc(&c->blas_ws_side, (size_t)32 << 20) != cudaSuccess ||
        cublasSetWorkspace(c->blas_side, c->blas_ws_side, (size_t)32 << 20) !=
            CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();
        c->side_on = 1; /* so that side_free releases what was made */
        side_free(c);
        return ds_errf(err, "cuda: cannot set up the side stream");
    }
    c->side_on = 1;
    return DS_OK;
}

static void side_swap(ds_cu *c) {
    cudaStream_t st = c->stream;
    c->stream = c->side, c->side = st;
    cublasHandle_t b = c->blas;
    c->blas = c->blas_side, c->blas_side = b;
    uint16_t *x = c->xb;
    c->xb = c->xb_side, c->xb_side = x;
    size_t n = c->xb_bytes;
    c->xb_bytes = c->xb_side_bytes, c->xb_side_bytes = n;
    c->on_side = !c->on_side;
}

extern "C" int ds_cu_side_begin(ds_cu *c, ds_err *err) {
    if (!c->side_on || c->prof || c->on_side) return DS_OK; /* stays on the main stream */
    if (c->side_pending && ds_cu_side_join(c, err)) return DS_ERR;
    CU_TRY(cudaEventRecord(c->ev_fork, c->stream), "side stream: fork");
    CU_TRY(cudaStreamWaitEvent(c->side, c->ev_fork, 0), "side stream: fork");
    side_swap(c);
    return DS_OK;
}

extern "C" int ds_cu_side_end(ds_cu *c, ds_err *err) {
    if (!c->on_side) return DS_OK;
    cudaError_t e = cudaEventRecord(c->ev_join, c->stream);
    side_swap(c); /* back on the main stream whatever happened */
    if (e != cudaSuccess) return ds_errf(err, "cuda: side stream: %s", cudaGetErrorString(e));
    c->side_pending = 1;
    return DS_OK;
}

extern "C" int ds_cu_side_join(ds_cu *c, ds_err *err) {
    if (!c->side_pending) return DS_OK;
    c->side_pending = 0;
    CU_TRY(cudaStreamWaitEvent(c->stream, c->ev_join, 0), "side stream: join");
    return DS_OK;
}

extern "C" void ds_cu_free(ds_cu *c) {
    if (!c) return;
    if (c->on_side) side_swap(c);
    side_free(c);
    cudaStreamSynchronize(c->stream);
    cudaFree(c->xb);
    cudaFree(c->part);
    cudaFree(c->blas_ws);
    cudaFree(c->moeg);
    cudaFree(c->drawb);
    cudaFree(c->mlag);
    cudaFree(c->kdac);
    free(c->h_kda);
    cudaFreeHost(c->h_moeb);
    ds_cu_prof_enable(c, 0);
    free(c->skip);
    cublasDestroy(c->blas);
    cudaStreamDestroy(c->stream);
    free(c);
}

extern "C" void *ds_cu_stream(ds_cu *c) {
    return (void *)c->stream;
}

extern "C" int ds_cu_bind(ds_cu *c, ds_err *err) {
    CU_TRY(cudaSetDevice(c->device), "selecting the device for this thread");
    return DS_OK;
}

extern "C" int ds_cu_sync(ds_cu *c, ds_err *err) {
    if (c->on_side) side_swap(c); /* (an error path left it there) */
    if (ds_cu_side_join(c, err)) return DS_ERR;
    CU_TRY(cudaStreamSynchronize(c->stream), "stream");
    if (c->sticky != cudaSuccess) {
        cudaError_t e = c->sticky;
        c->sticky = cudaSuccess;
        return ds_errf(err, "cuda: launch: %s", cudaGetErrorString(e));
    }
    CU_TRY(cudaGetLastError(), "last error");
    return DS_OK;
}

extern "C" const char *ds_cu_device_name(const ds_cu *c) {
    return c->name;
}

extern "C" void *ds_cu_alloc(ds_cu *c, size_t bytes, ds_err *err) {
    (void)c;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        ds_errf(err, "cuda: allocating %zu bytes: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

extern "C" void ds_cu_dealloc(void *p) {
    cudaFree(p);
}

extern "C" void *ds_cu_host_alloc(size_t bytes, ds_err *err) {
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        ds_errf(err, "cuda: %zu bytes of page-locked host memory: %s", bytes,
                cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

extern "C" void ds_cu_host_free(void *p) {
    cudaFreeHost(p);
}

extern "C" int ds_cu_upload(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err) {
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream), "upload");
    CU_TRY(cudaStreamSynchronize(c->stream), "upload");
    return DS_OK;
}

extern "C" int ds_cu_download(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err) {
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, c->stream), "download");
    CU_TRY(cudaStreamSynchronize(c->stream), "download");
    return DS_OK;
}

extern "C" int ds_cu_fill_bytes(ds_cu *c, void *dst, int byte, size_t bytes, ds_err *err) {
    CU_TRY(cudaMemsetAsync(dst, byte, bytes, c->stream), "fill");
    return DS_OK;
}

extern "C" int ds_cu_copy_d2d(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err) {
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream), "copy");
    return DS_OK;
}

/* Set by grow_scratch; the next ds_cu_epoch reads and clears it (one stream per process). */
static int g_epoch_bump;

/* Grows a device scratch buffer to at least `need` bytes (contents not kept). */
static int grow_scratch(void **p, size_t *cap, size_t need, const char *what, ds_err *err) {
    if (need <= *cap) return DS_OK;
    g_epoch_bump = 1;
    cudaFree(*p);
    *p = NULL;
    *cap = 0;
    CU_TRY(cudaMalloc(p, need), what);
    *cap = need;
    return DS_OK;
}

/* n buffers of sizes[i] bytes laid out in one scratch (each 256-byte aligned), grown to fit; out[i]
 * receive their addresses. */
static int carve_scratch(void **buf, size_t *cap, const size_t *sizes, void **out, int n,
                         const char *what, ds_err *err) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (sizes[i] + 255) & ~(size_t)255;
    if (grow_scratch(buf, cap, total, what, err)) return DS_ERR;
    char *p = (char *)*buf;
    for (int i = 0; i < n; i++) {
        out[i] = p;
        p += (sizes[i] + 255) & ~(size_t)255;
    }
    return DS_OK;
}

/* ---- matmul -----------------------------------------------------------------------------------
 */

/* Four floats rounded to BF16, stored as one 8-byte word (dst 8-byte aligned). */
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16 *dst, float4 v) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 u;
    u.x = *(uint32_t *)&lo, u.y = *(uint32_t *)&hi;
    *(uint2 *)dst = u;
}

/* xb[t][c] = bf16(x[t][c]) for c < K (x row stride ldx, xb packed): a block a row (grid-stride),
 * 16-byte loads where vec (x 16-byte aligned, ldx and K multiples of 4). One thread an element
 * with a 64-bit division for its row was what the GEMMs' rounding cost at prefill. */
__global__ void to_bf16_rows(__nv_bfloat16 *xb, const float *x, int ldx, int K, int T, int vec) {
    PDL_ENTRY();
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *xr = x + (size_t)t * ldx;
        __nv_bfloat16 *dr = xb + (size_t)t * K;
        if (vec)
            for (int c4 = threadIdx.x; c4 < K / 4; c4 += blockDim.x)
                store_bf16x4(dr + 4 * c4, __ldg((const float4 *)xr + c4));
        else
            for (int c = threadIdx.x; c < K; c += blockDim.x) dr[c] = __float2bfloat16_rn(xr[c]);
    }
}

/* launches to_bf16_rows: xb [T][K] packed from x [T][ldx] */
static void round_rows(ds_cu *c, __nv_bfloat16 *xb, const float *x, int ldx, int K, int T) {
    const int vec = (uintptr_t)x % 16 == 0 && ldx % 4 == 0 && K % 4 == 0;
    launch_k(c, to_bf16_rows, (unsigned)DS_MIN(T, 1 << 20), K >= 512 ? 256 : 128, 0, xb, x, ldx, K,
             T, vec);
}

/* x [T][ldx] rounded to BF16 into the matmul scratch (columns [0, K), packed K apart): cuBLAS's
 * activation operand. */
static const uint16_t *round_x(ds_cu *c, const float *x, int ldx, int K, int T, ds_err *err) {
    size_t need = (size_t)T * K;
    if (grow_scratch((void **)&c->xb, &c->xb_bytes, need * sizeof(uint16_t), "matmul scratch", err))
        return NULL;
    round_rows(c, (__nv_bfloat16 *)c->xb, x, ldx, K, T);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) {
        ds_errf(err, "cuda: matmul: rounding x: %s", cudaGetErrorString(e));
        return NULL;
    }
    return c->xb;
}

/* Eight BF16 weights (one 16-byte load) dotted with eight f32 activations, in a fixed order: the
 * weight-streaming kernels' inner step. */
__device__ __forceinline__ float dot8(uint4 u, const float *x) {
    const float4 a = ((const float4 *)x)[0], b = ((const float4 *)x)[1];
    return __uint_as_float(u.x << 16) * a.x + __uint_as_float(u.x & 0xffff0000u) * a.y +
           __uint_as_float(u.y << 16) * a.z + __uint_as_float(u.y & 0xffff0000u) * a.w +
           __uint_as_float(u.z << 16) * b.x + __uint_as_float(u.z & 0xffff0000u) * b.y +
           __uint_as_float(u.w << 16) * b.z + __uint_as_float(u.w & 0xffff0000u) * b.w;
}

/* Single-token matmul (measured on the H200: at T = 1 it reads the 163840 x 2304 lm_head at 104%
 * of the copy rate where cuBLAS reaches 90%, and small matrices in half cuBLAS's time; at T = 2 it
 * already trails cuBLAS, at T = 8 by 4x, since every warp re-reads all of x): one warp per output
 * row streams that row of W once with 16-byte
 * loads (8 BF16 each) and dots it with every token's f32 x (small, served by L1), accumulating in
 * f32 — the weights are the bytes that matter, and they are read exactly once. */
/* With S > 1 (few rows: the router, the shared experts, o_proj, MLA's small projections), S
 * warps share a row, warp p of them taking the row's 16-byte pieces p, p + S, p + 2S, ... (32
 * lanes wide), and their sums are added in the order p = 0, 1, ..; a block then covers 8 / S
 * rows. S depends on the matrix alone (gemv_splits), never on T, so that a token's bits stay
 * the same whatever the batch. */
template <int TT>
__global__ void __launch_bounds__(256)
    gemv_bf16_k(float *y, int ldy, const float *x, int ldx, const uint16_t *W, int N, int K,
                size_t ys, size_t xs, size_t ws, int S) {
    __shared__ float red[8][TT]; /* [warp][token] partial sums (S > 1) */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * (8 / S) + warp / S, part = warp % S, nk = K / 8, step = 32 * S;
    const int k0 = lane + 32 * part;
    /* The weights are no earlier kernel's output: the first GEMV_PRE loads of this lane's part
     * of its row are issued before waiting for the previous kernel (PDL), so a small matmul's
     * stream is already under way when its input lands. Same loads, same order of sums. (8 or
     * 12 of them at one token, in more registers, were measured slower: bench/RESULTS.md.) */
    enum { GEMV_PRE = 4 };
    const uint4 *wr = (const uint4 *)(W + blockIdx.z * ws + (size_t)min(n, N - 1) * K);
    uint4 pre[GEMV_PRE];
#pragma unroll
    for (int i = 0; i < GEMV_PRE; i++)
        if (k0 + step * i < nk) pre[i] = __ldg(wr + k0 + step * i);
    PDL_ENTRY();
    if (S == 1 && n >= N) return; /* a whole warp leaves together; no block barrier follows */
    x += (size_t)blockIdx.y * TT * ldx + blockIdx.z * xs; /* tile blockIdx.y of TT tokens */
    y += (size_t)blockIdx.y * TT * ldy + blockIdx.z * ys; /* head blockIdx.z */
    float acc[TT];
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
#pragma unroll
    for (int i = 0; i < GEMV_PRE; i++) {
        const int k8 = k0 + step * i;
        if (k8 < nk)
#pragma unroll
            for (int t = 0; t < TT; t++)
                acc[t] += dot8(pre[i], x + (size_t)t * ldx + (size_t)k8 * 8);
    }
#pragma unroll 4
    for (int k8 = k0 + step * GEMV_PRE; k8 < nk; k8 += step) {
        const uint4 u = __ldg(wr + k8);
#pragma unroll
        for (int t = 0; t < TT; t++) acc[t] += dot8(u, x + (size_t)t * ldx + (size_t)k8 * 8);
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float v = acc[t];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (S == 1) {
            if (lane == 0) y[(size_t)t * ldy + n] = v;
        } else if (lane == 0) {
            red[warp][t] = v;
        }
    }
    if (S == 1) return;
    __syncthreads();
    if (part == 0 && lane < TT && n < N) {
        float v = 0.0f;
        for (int p = 0; p < S; p++) v += red[warp + p][lane];
        y[(size_t)lane * ldy + n] = v;
    }
}

/* The same for any K and alignment, one element at a time (the batch-invariant mode's fallback):
 * per token the same order of operations whatever T is. */
__global__ void __launch_bounds__(256)
    gemv_any_k(float *y, int ldy, const float *x, int ldx, const uint16_t *W, int N, int K) {
    PDL_ENTRY();
    const int lane = threadIdx.x & 31, n = blockIdx.x * 8 + (threadIdx.x >> 5), t = blockIdx.y;
    if (n >= N) return;
    const uint16_t *wr = W + (size_t)n * K;
    const float *xt = x + (size_t)t * ldx;
    float acc = 0.0f;
    for (int k = lane; k < K; k += 32) acc += __uint_as_float((uint32_t)wr[k] << 16) * xt[k];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[(size_t)t * ldy + n] = acc;
}

/* Tiles of 8 tokens share one read of W; the remainder runs as its own instance. Each token's
 * dot products take the same operations in every instance, so its bits do not depend on T. */
/* H heads (blockIdx.z): head h's y, x and W start ys, xs and ws elements after head 0's. */
/* Blocks of 256 threads for `rows` rows at S warps a row (8 / S rows a block). */
static long gemv_blocks(long rows, int S) {
    return (rows + 8 / S - 1) / (8 / S);
}

/* Warps per row for an N x K matrix (H of them): more while the rows alone would leave the GPU
 * short of warps (about 32 per SM), as long as each warp keeps a whole 32-lane piece of K. A
 * function of the matrix only (see gemv_bf16_k). */
static int gemv_splits(const ds_cu *c, int N, int K, int H) {
    const long rows = (long)N * H, want = 32L * c->n_sm;
    int S = 1;
    /* (Splitting a matrix of more than a wave of blocks further, so that its last wave is full —
     * KDA's q/k/v at the 48B shape: 1.49 -> 2.98 waves — was measured slower: 2.869 against
     * 2.836 ms a batch-1 step, bench/RESULTS.md session 9.) */
    while (S < 8 && rows * S < want && K / 8 >= 32 * 2 * S) S *= 2;
    return S;
}

static int gemv_tiles(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                      const uint16_t *W, int N, int K, int H, size_t ys, size_t xs, size_t ws,
                      ds_err *err) {
    const int S = gemv_splits(c, N, K, H);
    const unsigned blocks = (unsigned)gemv_blocks(N, S), hz = (unsigned)H;
    int full = T / 8, rem = T % 8;
    for (int t0 = 0; t0 < full * 8; t0 += 8 * 65535) /* grid.y holds 65535 tiles */
        launch_k(c, gemv_bf16_k<8>, dim3(blocks, (unsigned)DS_MIN(full - t0 / 8, 65535), hz), 256,
                 0, y + (size_t)t0 * ldy, ldy, x + (size_t)t0 * ldx, ldx, W, N, K, ys, xs, ws, S);
    const float *xr = x + (size_t)full * 8 * ldx;
    float *yr = y + (size_t)full * 8 * ldy;
    const dim3 g(blocks, 1, hz);
#define GEMV_REM(TT)                                                                               \
    launch_k(c, gemv_bf16_k<TT>, g, 256, 0, yr, ldy, xr, ldx, W, N, K, ys, xs, ws, S)
    switch (rem) {
    case 0:
        break;
    case 1:
        GEMV_REM(1);
        break;
    case 2:
        GEMV_REM(2);
        break;
    case 3:
        GEMV_REM(3);
        break;
    case 4:
        GEMV_REM(4);
        break;
    case 5:
        GEMV_REM(5);
        break;
    case 6:
        GEMV_REM(6);
        break;
    default:
        GEMV_REM(7);
        break;
    }
#undef GEMV_REM
    CU_TRY(cudaGetLastError(), "matmul (gemv)");
    return DS_OK;
}

static int gemv_wide(ds_cu *c, float *y, const float *x, const uint16_t *W, int N, int K,
                     ds_err *err);
/* a weight GEMM's own profile interval (defined with the profile, at the end) */
static const char *prof_gemm_open(ds_cu *c);
static void prof_gemm_close(ds_cu *c, const char *prev, double flops);

extern "C" void ds_cu_set_batch_invariant(ds_cu *c, int on) {
    c->batch_invariant = on;
}

/* Rows up to which a matmul streams its weights (gemv_tiles) rather than calling cuBLAS: the 48B
 * shape's steps with graphs on the H200, streaming / cuBLAS for the rows above one: batch 2
 * 4.007 / 4.111 ms, 4 6.632 / 5.668, 8 10.97 / 8.45, 16 20.58 / 14.16. */
enum { GEMV_MAX_T = 2 };

extern "C" void ds_cu_set_gemv_max_t(ds_cu *c, int rows) {
    c->gemv_max_t = rows;
}

/* up to how many rows ds_cu_matmul and ds_cu_matmul_heads stream their weights */
static int gemv_rows_max(const ds_cu *c) {
    return c->gemv_max_t > 0 ? c->gemv_max_t : GEMV_MAX_T;
}

extern "C" int ds_cu_matmul(ds_cu *c, float *y, int ldy, const float *x, int ldx, int T,
                            const ds_cu_mat *w, ds_err *err) {
    const int N = w->rows, K = w->cols;
    if (T <= 0 || N <= 0) return DS_OK;
    const int vec =
        K % 8 == 0 && ldx % 4 == 0 && (uintptr_t)x % 16 == 0 && (uintptr_t)w->data % 16 == 0;
    if (vec && T == 1 && c->gemv_wide && gemv_splits(c, N, K, 1) == 1 && (size_t)K * 4 <= 48 * 1024)
        return gemv_wide(c, y, x, w->data, N, K, err);
    if (vec && (T <= gemv_rows_max(c) || c->batch_invariant))
        return gemv_tiles(c, y, ldy, x, ldx, T, w->data, N, K, 1, 0, 0, 0, err);
    if (c->batch_invariant) {
        for (int t0 = 0; t0 < T; t0 += 65535)
            launch_k(c, gemv_any_k, dim3((unsigned)((N + 7) / 8), (unsigned)DS_MIN(T - t0, 65535)),
                     256, 0, y + (size_t)t0 * ldy, ldy, x + (size_t)t0 * ldx, ldx, w->data, N, K);
        CU_TRY(cudaGetLastError(), "matmul (gemv, any shape)");
        return DS_OK;
    }
    const uint16_t *xb = round_x(c, x, ldx, K, T, err);
    if (!xb) return DS_ERR;
    /* Row-major y[T][N] is column-major N x T; W[N][K] row-major is column-major K x N, so
     * Y = W^T X with X = xb column-major K x T. */
    const float one = 1.0f, zero = 0.0f;
    const char *prof = prof_gemm_open(c);
    BLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, w->data, CUDA_R_16BF, K,
                          xb, CUDA_R_16BF, K, &zero, y, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             "matmul");
    prof_gemm_close(c, prof, 2.0 * N * K * T);
    return DS_OK;
}

extern "C" int ds_cu_matmul_heads(ds_cu *c, float *y, int ldy, size_t ys, const float *x, int ldx,
                                  size_t xs, int T, const ds_cu_mat *w, size_t ws, int H,
                                  ds_err *err) {
    const int N = w->rows, K = w->cols;
    if (T <= 0 || N <= 0 || H <= 0) return DS_OK;
    const int vec = K % 8 == 0 && ldx % 4 == 0 && xs % 4 == 0 && ws % 8 == 0 &&
                    (uintptr_t)x % 16 == 0 && (uintptr_t)w->data % 16 == 0;
    if (vec && (T <= gemv_rows_max(c) || c->batch_invariant))
        return gemv_tiles(c, y, ldy, x, ldx, T, w->data, N, K, H, ys, xs, ws, err);
    if (c->batch_invariant || (size_t)ldx < (size_t)(H - 1) * xs + K) {
        for (int h = 0; h < H; h++) { /* head by head, through the plain matmul */
            ds_cu_mat wh = {w->data + (size_t)h * ws, N, K};
            if (ds_cu_matmul(c, y + (size_t)h * ys, ldy, x + (size_t)h * xs, ldx, T, &wh, err))
                return DS_ERR;
        }
        return DS_OK;
    }
    /* every head's rows of x in BF16 at once, then one strided-batched GEMM */
    const uint16_t *xb = round_x(c, x, ldx, ldx, T, err);
    if (!xb) return DS_ERR;
    const float one = 1.0f, zero = 0.0f;
    const char *prof = prof_gemm_open(c);
    BLAS_TRY(cublasGemmStridedBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, N, T, K, &one, w->data,
                                        CUDA_R_16BF, K, (long long)ws, xb, CUDA_R_16BF, ldx,
                                        (long long)xs, &zero, y, CUDA_R_32F, ldy, (long long)ys, H,
                                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             "matmul (heads)");
    prof_gemm_close(c, prof, 2.0 * N * K * T * H);
    return DS_OK;
}

extern "C" int ds_cu_gemm_bf16(ds_cu *c, uint16_t *C, const uint16_t *A, const uint16_t *B, int m,
                               int n, int k, ds_err *err) {
    /* Row-major C[m][n] = A[m][k] B[n][k]^T  <=>  column-major C^T (n x m) = B A^T. */
    const float one = 1.0f, zero = 0.0f;
    BLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, B, CUDA_R_16BF, k, A,
                          CUDA_R_16BF, k, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                          CUBLAS_GEMM_DEFAULT),
             "gemm");
    return DS_OK;
}

/* ---- embedding, norms, activations -------------------------------------------------------- */

/* Rows [v0, v0 + nv) of the vocabulary live in e; a token outside them embeds as zeros (the
 * vocabulary-parallel slice: the TP all-reduce then gives every rank the whole embedding). */
__global__ void embed_k(float *out, const __nv_bfloat16 *e, const int32_t *ids, int D, int v0,
                        int nv) {
    PDL_ENTRY();
    int t = blockIdx.x, id = ids[t] - v0;
    const __nv_bfloat16 *row = e + (size_t)id * D;
    for (int c = threadIdx.x; c < D; c += blockDim.x)
        out[(size_t)t * D + c] = id >= 0 && id < nv ? __bfloat162float(row[c]) : 0.0f;
}

extern "C" void ds_cu_embed(ds_cu *c, float *out, const ds_cu_mat *e, const int32_t *ids, int T) {
    ds_cu_embed_range(c, out, e, ids, T, 0);
}

extern "C" void ds_cu_embed_range(ds_cu *c, float *out, const ds_cu_mat *e, const int32_t *ids,
                                  int T, int v0) {
    if (T <= 0) return;
    launch_k(c, embed_k, T, 256, 0, out, (const __nv_bfloat16 *)e->data, ids, e->cols, v0, e->rows);
    note_launch(c);
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024). */
__device__ float block_sum(float v) {
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

/* Values per thread a row norm keeps in registers (D up to 12 x 256 = 3072 in one pass). */
enum { NORM_V = 12 };

/* y = w * v / rms(v) for a row held in registers, v[i] at column threadIdx.x + i blockDim.x
 * (zeros past D): each thread's squares summed in column order, as the looping form does. */
__device__ __forceinline__ void norm_row_regs(float *yr, const float (&v)[NORM_V],
                                              const float (&w)[NORM_V], int D, float eps) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_V; i++)
        if (threadIdx.x + i * blockDim.x < D) ss += v[i] * v[i];
    const float inv = rsqrtf(block_sum(ss) / (float)D + eps);
#pragma unroll
    for (int i = 0; i < NORM_V; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < D) yr[c] = w[i] * (v[i] * inv);
    }
}

/* A row norm's weights (no earlier kernel's output) into registers, laid out as norm_row_regs
 * takes them: loaded before the wait for the previous kernel, so that a decode step's chain of
 * norms does not wait on them after it. */
__device__ __forceinline__ void norm_weights_regs(float (&wv)[NORM_V], const float *w, int D) {
#pragma unroll
    for (int i = 0; i < NORM_V; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        wv[i] = c < D ? w[c] : 0.0f;
    }
}

/* Maximum over the block, likewise (exact: the order does not matter). */
__device__ float block_max(float v) {
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

/* y[t] = w * x[t] / rms(x[t]) for row t = blockIdx.x; rows ldx / ldy apart. */
__global__ void rmsnorm_ld_k(float *y, int ldy, const float *x, int ldx, const float *w, int D,
                             float eps) {
    float wv[NORM_V];
    const bool in_regs = D <= NORM_V * (int)blockDim.x;
    if (in_regs) norm_weights_regs(wv, w, D);
    PDL_ENTRY();
    const float *xr = x + (size_t)blockIdx.x * ldx;
    float *yr = y + (size_t)blockIdx.x * ldy;
    float ss = 0.0f;
    if (in_regs) { /* as add_rmsnorm_k; y may be x */
        float v[NORM_V];
#pragma unroll
        for (int i = 0; i < NORM_V; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            v[i] = c < D ? xr[c] : 0.0f;
        }
        norm_row_regs(yr, v, wv, D, eps);
        return;
    }
    for (int c = threadIdx.x; c < D; c += blockDim.x) ss += xr[c] * xr[c];
    float inv = rsqrtf(block_sum(ss) / (float)D + eps);
    for (int c = threadIdx.x; c < D; c += blockDim.x) yr[c] = w[c] * (xr[c] * inv);
}

extern "C" void ds_cu_rmsnorm(ds_cu *c, float *y, const float *x, const float *w, int T, int D,
                              float eps) {
    if (T <= 0) return;
    launch_k(c, rmsnorm_ld_k, T, 256, 0, y, D, x, D, w, D, eps); /* packed rows */
    note_launch(c);
}

/* act(gate, up): SiLU(g) u, or SiTU (MODEL_SPEC) — one definition for every kernel that applies
 * it, so that fused and separate passes give the same bits. */
__device__ __forceinline__ float act_pair(float g, float u, int situ, float beta, float lin_beta) {
    if (situ) {
        const float phi = lin_beta > 0.0f ? lin_beta * tanhf(u / lin_beta) : u;
        return beta * tanhf(g / beta) / (1.0f + expf(-g)) * phi;
    }
    return g / (1.0f + expf(-g)) * u;
}

/* act_pair on four gate and four up values */
__device__ __forceinline__ float4 act_pair4(float4 g, float4 u, int situ, float beta,
                                            float lin_beta) {
    return make_float4(
        act_pair(g.x, u.x, situ, beta, lin_beta), act_pair(g.y, u.y, situ, beta, lin_beta),
        act_pair(g.z, u.z, situ, beta, lin_beta), act_pair(g.w, u.w, situ, beta, lin_beta));
}

__global__ void swiglu_k(float *out, const float *gate, const float *up, size_t n) {
    PDL_ENTRY();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = act_pair(gate[i], up[i], 0, 0.0f, 0.0f);
}

extern "C" void ds_cu_swiglu(ds_cu *c, float *out, const float *gate, const float *up, size_t n) {
    if (!n) return;
    launch_k(c, swiglu_k, (unsigned)((n + 255) / 256), 256, 0, out, gate, up, n);
    note_launch(c);
}

/* ---- the rest of the forward's glue: elementwise, strided norms, row gathers --------------- */

#define ELEMWISE(name, body)                                                                       \
    __global__ void name##_k(float *y, const float *x, size_t n, float a, float b) {               \
        PDL_ENTRY();                                                                               \
        size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;                                  \
        if (i < n) {                                                                               \
            body;                                                                                  \
        }                                                                                          \
    }
ELEMWISE(add, y[i] += x[i])
ELEMWISE(mul, y[i] *= x[i])
ELEMWISE(sigmoid, y[i] = 1.0f / (1.0f + expf(-y[i])))
ELEMWISE(axpy, y[i] += a * x[i])
#undef ELEMWISE

#define ELEMWISE_LAUNCH(name, y, x, n, a, b)                                                       \
    do {                                                                                           \
        if (!(n)) return;                                                                          \
        launch_k(c, name##_k, (unsigned)(((n) + 255) / 256), 256, 0, y, x, n, a, b);               \
        note_launch(c);                                                                            \
    } while (0)

extern "C" void ds_cu_add(ds_cu *c, float *y, const float *x, size_t n) {
    ELEMWISE_LAUNCH(add, y, x, n, 0.0f, 0.0f);
}
extern "C" void ds_cu_mul(ds_cu *c, float *y, const float *x, size_t n) {
    ELEMWISE_LAUNCH(mul, y, x, n, 0.0f, 0.0f);
}
extern "C" void ds_cu_sigmoid(ds_cu *c, float *x, size_t n) {
    ELEMWISE_LAUNCH(sigmoid, x, x, n, 0.0f, 0.0f);
}
extern "C" void ds_cu_axpy(ds_cu *c, float *y, float a, const float *x, size_t n) {
    ELEMWISE_LAUNCH(axpy, y, x, n, a, 0.0f);
}

__global__ void situ_k(float *out, const float *gate, const float *up, size_t n, float beta,
                       float lin_beta) {
    PDL_ENTRY();
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = act_pair(gate[i], up[i], 1, beta, lin_beta);
}

extern "C" void ds_cu_situ(ds_cu *c, float *out, const float *gate, const float *up, size_t n,
                           float beta, float lin_beta) {
    if (!n) return;
    launch_k(c, situ_k, (unsigned)((n + 255) / 256), 256, 0, out, gate, up, n, beta, lin_beta);
    note_launch(c);
}

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

/* P += a, then y = w ⊙ P / rms(P): a residual add and the next norm in one pass. */
__global__ void add_rmsnorm_k(float *y, float *P, const float *a, const float *w, int D,
                              float eps) {
    float wv[NORM_V];
    const bool in_regs = D <= NORM_V * (int)blockDim.x;
    if (in_regs) norm_weights_regs(wv, w, D);
    PDL_ENTRY();
    float *pr = P + (size_t)blockIdx.x * D;
    const float *ar = a + (size_t)blockIdx.x * D;
    float *yr = y + (size_t)blockIdx.x * D;
    float ss = 0.0f;
    if (in_regs) { /* the row in registers: every load in flight at once */
        float v[NORM_V];
#pragma unroll
        for (int i = 0; i < NORM_V; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            v[i] = c < D ? pr[c] + ar[c] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < NORM_V; i++) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < D) pr[c] = v[i];
        }
        norm_row_regs(yr, v, wv, D, eps);
        return;
    }
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float v = pr[c] + ar[c];
        pr[c] = v;
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss) / (float)D + eps);
    for (int c = threadIdx.x; c < D; c += blockDim.x) yr[c] = w[c] * (pr[c] * inv);
}

extern "C" void ds_cu_add_rmsnorm(ds_cu *c, float *y, float *P, const float *a, const float *w,
                                  int T, int D, float eps) {
    if (T <= 0) return;
    launch_k(c, add_rmsnorm_k, T, 256, 0, y, P, a, w, D, eps);
    note_launch(c);
}

extern "C" void ds_cu_rmsnorm_ld(ds_cu *c, float *y, int ldy, const float *x, int ldx,
                                 const float *w, int T, int D, float eps) {
    if (T <= 0) return;
    launch_k(c, rmsnorm_ld_k, T, 256, 0, y, ldy, x, ldx, w, D, eps);
    note_launch(c);
}

/* dst[dst_rows ? dst_rows[i] : i][:width] = src[src_rows ? src_rows[i] : i][:width] */
__global__ void move_rows_k(float *dst, size_t ldd, const int32_t *dst_rows, const float *src,
                            size_t lds, const int32_t *src_rows, int width) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const size_t di = dst_rows ? (size_t)dst_rows[i] : (size_t)i;
    const size_t si = src_rows ? (size_t)src_rows[i] : (size_t)i;
    for (int c = threadIdx.x; c < width; c += blockDim.x) dst[di * ldd + c] = src[si * lds + c];
}

extern "C" int ds_cu_move_rows(ds_cu *c, float *dst, size_t ldd, const int32_t *dst_rows,
                               const float *src, size_t lds, const int32_t *src_rows, int n,
                               int width, ds_err *err) {
    for (int i0 = 0; i0 < n; i0 += 1 << 30) {
        int m = DS_MIN(n - i0, 1 << 30);
        launch_k(c, move_rows_k, (unsigned)m, 128, 0, dst_rows ? dst : dst + (size_t)i0 * ldd, ldd,
                 dst_rows ? dst_rows + i0 : NULL, src_rows ? src : src + (size_t)i0 * lds, lds,
                 src_rows ? src_rows + i0 : NULL, width);
        CU_TRY(cudaGetLastError(), "move rows");
    }
    return DS_OK;
}

/* A kernel, not cudaMemcpy2DAsync: inside a captured step a copy node ends programmatic launch
 * (the kernel after it cannot start under its tail) and costs a copy engine's latency; MLA's
 * decode chain had one per layer. */
__global__ void copy_2d_k(float *dst, size_t ldd, const float *src, size_t lds, size_t width,
                          size_t rows) {
    PDL_ENTRY();
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) /* a block a row (no division) */
        for (size_t col = threadIdx.x; col < width; col += blockDim.x)
            dst[r * ldd + col] = src[r * lds + col];
}

extern "C" int ds_cu_copy_2d(ds_cu *c, float *dst, size_t ldd, const float *src, size_t lds,
                             size_t width, size_t rows, ds_err *err) {
    if (!rows || !width) return DS_OK;
    launch_k(c, copy_2d_k, (unsigned)DS_MIN(rows, (size_t)c->n_sm * 16),
             (unsigned)DS_MIN((width + 31) / 32 * 32, (size_t)256), 0, dst, ldd, src, lds, width,
             rows);
    CU_TRY(cudaGetLastError(), "2d copy");
    return DS_OK;
}

extern "C" int ds_cu_copy_any(ds_cu *c, void *dst, const void *src, size_t bytes, ds_err *err) {
    CU_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->stream), "copy");
    CU_TRY(cudaStreamSynchronize(c->stream), "copy");
    return DS_OK;
}

/* Random weights made in place (ds_cu_fill_random_bf16): element i of the [rows][cols] slice from
 * its index g in the whole tensor, the CPU's value (rand_hash.h). */
__global__ void fill_random_bf16_k(__nv_bfloat16 *d, size_t rows, size_t cols,
                                   unsigned long long key, size_t row0, size_t col0,
                                   size_t full_cols, float scale) {
    PDL_ENTRY();
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < rows * cols;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t g = (row0 + i / cols) * full_cols + col0 + i % cols; /* (a load-time kernel) */
        d[i] = __float2bfloat16_rn(scale * ds_hash_uniform(key, g));
    }
}

extern "C" int ds_cu_fill_random_bf16(ds_cu *c, uint16_t *d, size_t rows, size_t cols, uint64_t key,
                                      size_t row0, size_t col0, size_t full_cols, float scale,
                                      ds_err *err) {
    if (!rows || !cols) return DS_OK;
    launch_k(c, fill_random_bf16_k, 4096, 256, 0, (__nv_bfloat16 *)d, rows, cols,
             (unsigned long long)key, row0, col0, full_cols, scale);
    CU_TRY(cudaGetLastError(), "random weights");
    return DS_OK;
}

__global__ void transpose_u16_k(uint16_t *dst, const uint16_t *src, int rows, int cols) {
    PDL_ENTRY();
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * cols) return;
    const int r = (int)(i / cols), c = (int)(i % cols);
    dst[(size_t)c * rows + r] = src[i];
}

extern "C" int ds_cu_transpose_bf16(ds_cu *c, uint16_t *dst, const uint16_t *src, int rows,
                                    int cols, ds_err *err) {
    size_t n = (size_t)rows * cols;
    if (!n) return DS_OK;
    launch_k(c, transpose_u16_k, (unsigned)((n + 255) / 256), 256, 0, dst, src, rows, cols);
    CU_TRY(cudaGetLastError(), "transpose");
    return DS_OK;
}

extern "C" int ds_cu_is_device_ptr(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* clear it: a plain host pointer is not an error */
        return 0;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

extern "C" size_t ds_cu_mem_free(ds_cu *c) {
    (void)c;
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) != cudaSuccess) return 0;
    return f;
}

/* ---- KDA inputs: short conv, gates, head norms ------------------------------------------------
 */

/* One thread per channel walks the tokens in order with its window of the last W inputs in
 * registers (W <= 8), then writes the new tail. */
__global__ void short_conv_silu_k(float *out, const float *in, int T, int C, const float *w, int W,
                                  float *tail) {
    PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[8]; /* win[j]: input at position t - (W-1) + j */
    for (int j = 0; j < W - 1; j++) win[j] = tail[(size_t)j * C + c];
    const float *wc = w + (size_t)c * W;
    for (int t = 0; t < T; t++) {
        win[W - 1] = in[(size_t)t * C + c];
        float acc = 0.0f;
        for (int j = 0; j < W; j++) acc += wc[j] * win[j];
        out[(size_t)t * C + c] = acc / (1.0f + expf(-acc));
        for (int j = 0; j < W - 1; j++) win[j] = win[j + 1];
    }
    for (int j = 0; j < W - 1; j++) tail[(size_t)j * C + c] = win[j];
}

/* Every sequence of a step, and q, k and v together, in one launch: block (channel tile, sequence
 * z, projection j and time chunk) walks its chunk of tokens [seg_off[z], seg_off[z+1]) of
 * projection j (see ds_cu_conv_batch); with rollback rows it also writes the tail after each
 * token. A chunk's window starts from the inputs before it, so long prefills run in parallel over
 * time; chunks are at least W-1 tokens, so only chunk 0 ever reads the old tail, and chunk 0
 * writes the new one after its own reads.
 * WT: the kernel width when known at compile time (0: b.W at run time). With a run-time width the
 * window is indexed at run time and lives in local memory (ptxas: a 32-byte stack frame), and each
 * token's input load waits behind the previous token's store; with WT the window is registers and
 * the inputs of CONV_AHEAD tokens are loaded before any of them is used (the model's default;
 * DS_CUDA_CONV_FIXED=0 gives the run-time form: an 8192-token prompt of the 48B shape 221.6
 * against 226.5-227.2 ms, a batch-1 step 2.620-2.624 against 2.622-2.642 ms on the H200). The
 * same operations in the same order either way. */
enum { CONV_AHEAD = 4 };
template <int WT> __global__ void short_conv_batch_k(ds_cu_conv_batch b, int n_chunks) {
    PDL_ENTRY();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, z = blockIdx.y;
    const int j = blockIdx.z % b.n_proj, ch = blockIdx.z / b.n_proj;
    const int C = b.C, W = WT ? WT : b.W;
    if (c >= C) return;
    const int t0 = b.seg_off[z], t1 = b.seg_off[z + 1];
    const int per = max((t1 - t0 + n_chunks - 1) / n_chunks, W - 1);
    const int a0 = t0 + ch * per, a1 = min(t1, a0 + per);
    if (ch > 0 && a0 >= a1) return;        /* chunk 0 runs even on no tokens: it owns the tail */
    const size_t tn = (size_t)(W - 1) * C; /* one projection's tail */
    float *tail = b.tails[z] + j * tn, *R = b.rows && b.rows[z] ? b.rows[z] + j * tn : NULL;
    const float *in = b.in + (size_t)j * C;
    float *out = b.out + j * b.out_stride;
    constexpr int WM = WT ? WT : 8; /* the window's size as the compiler sees it */
    float win[WM];                  /* win[i]: the input at position t - (W-1) + i */
#pragma unroll
    for (int i = 0; i < WM - 1; i++) {
        if (!WT && i >= W - 1) break;
        const int p = a0 - (W - 1) + i; /* before the segment: the tail (tail[i] is t0-(W-1)+i) */
        win[i] = p >= t0 ? in[(size_t)p * b.ld_in + c] : tail[(size_t)(p - t0 + W - 1) * C + c];
    }
    float wc[WM];
#pragma unroll
    for (int i = 0; i < WM; i++)
        if (WT || i < W) wc[i] = b.w[((size_t)j * C + c) * W + i];
    constexpr int AHEAD = WT ? CONV_AHEAD : 1;
    for (int ta = a0; ta < a1; ta += AHEAD) {
        float nx[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; u++)
            nx[u] = ta + u < a1 ? in[(size_t)(ta + u) * b.ld_in + c] : 0.0f;
#pragma unroll
        for (int u = 0; u < AHEAD; u++) {
            const int t = ta + u;
            if (t >= a1) break;
            win[W - 1] = nx[u];
            float acc = 0.0f;
#pragma unroll
            for (int i = 0; i < WM; i++)
                if (WT || i < W) acc += wc[i] * win[i];
            out[(size_t)t * C + c] = acc / (1.0f + expf(-acc));
#pragma unroll
            for (int i = 0; i < WM - 1; i++)
                if (WT || i < W - 1) win[i] = win[i + 1];
            if (R)
#pragma unroll
                for (int i = 0; i < WM - 1; i++)
                    if (WT || i < W - 1)
                        R[(size_t)(t - t0) * b.rows_stride + (size_t)i * C + c] = win[i];
        }
    }
    if (ch > 0) return;
    float nt[WM]; /* the new tail: the inputs at t1 - (W-1) + i, read before any is written */
#pragma unroll
    for (int i = 0; i < WM - 1; i++) {
        if (!WT && i >= W - 1) break;
        const int p = t1 - (W - 1) + i;
        nt[i] = p >= t0 ? in[(size_t)p * b.ld_in + c] : tail[(size_t)(p - t0 + W - 1) * C + c];
    }
#pragma unroll
    for (int i = 0; i < WM - 1; i++) {
        if (!WT && i >= W - 1) break;
        tail[(size_t)i * C + c] = nt[i];
    }
}

extern "C" int ds_cu_short_conv_silu_batch(ds_cu *c, const ds_cu_conv_batch *b, ds_err *err) {
    if (b->W < 1 || b->W > 8) return ds_errf(err, "cuda: short conv kernel size %d (1..8)", b->W);
    if (b->n_proj < 1 || b->n_proj > 3)
        return ds_errf(err, "cuda: short conv: %d projections (1..3)", b->n_proj);
    if (b->n_seq <= 0 || b->C <= 0) return DS_OK;
    /* time chunks of ~64 tokens of the longest segment, at most 256 — bounded by T - n_seq + 1,
     * every other segment having a token (an empty one only costs parallelism, never a result:
     * any count of chunks gives the same bits). From T alone a decode step of 256 sequences
     * launched four blocks for every one with work, 0.15 against 0.02 ms a layer at 64 on the
     * H200 (eager profile, "kda conv+l2norm"). */
    const int longest = DS_MAX(1, b->n_tokens - b->n_seq + 1);
    const int n_chunks = DS_MAX(1, DS_MIN(256, longest / 64));
    launch_k(
        c, c->conv_fixed && b->W == 4 ? short_conv_batch_k<4> : short_conv_batch_k<0>,
        dim3((unsigned)((b->C + 127) / 128), (unsigned)b->n_seq, (unsigned)(b->n_proj * n_chunks)),
        128, 0, *b, n_chunks);
    CU_TRY(cudaGetLastError(), "short conv (batch)");
    return DS_OK;
}

extern "C" int ds_cu_short_conv_silu(ds_cu *c, float *out, const float *in, int T, int C,
                                     const float *w, int W, float *tail, ds_err *err) {
    if (W < 1 || W > 8) return ds_errf(err, "cuda: short conv kernel size %d (1..8)", W);
    if (T <= 0 || C <= 0) return DS_OK;
    launch_k(c, short_conv_silu_k, (C + 127) / 128, 128, 0, out, in, T, C, w, W, tail);
    CU_TRY(cudaGetLastError(), "short conv");
    return DS_OK;
}

/* The log decay of a channel from f_b's output plus its bias (x) and a = e^A_log: kda_gate_k's
 * and the fused decode's one expression, so that both give the same bits. */
__device__ __forceinline__ float kda_decay(float x, float a, int lower_bound_form, float lb) {
    return lower_bound_form ? lb / (1.0f + expf(-a * x))
                            : -a * (fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))));
}

/* thread x of the grid takes column hc = x of every row t = blockIdx.y (+ gridDim.y ...): no
 * division an element */
__global__ void kda_gate_k(float *g, const float *f, int T, int H, int dk, const float *A_log,
                           const float *dt_bias, int lower_bound_form, float lb, float *beta,
                           const float *b_in, int ld_b) {
    const int P = H * dk, hc = blockIdx.x * blockDim.x + threadIdx.x, h = hc / dk;
    /* the layer's parameters before the wait for the previous kernel (they are weights) */
    const bool live = hc < P;
    const float a_log = live ? A_log[h] : 0.0f, bias = live ? dt_bias[hc] : 0.0f;
    PDL_ENTRY();
    if (!live) return;
    const float a = expf(a_log);
    for (int t = blockIdx.y; t < T; t += gridDim.y) {
        if (beta && hc < H) /* as ds_cu_sigmoid: the same bits */
            beta[(size_t)t * H + hc] = 1.0f / (1.0f + expf(-b_in[(size_t)t * ld_b + hc]));
        const size_t i = (size_t)t * P + hc;
        g[i] = kda_decay(f[i] + bias, a, lower_bound_form, lb);
    }
}

extern "C" void ds_cu_kda_gate(ds_cu *c, float *g, const float *f, int T, int H, int dk,
                               const float *A_log, const float *dt_bias, int lower_bound_form,
                               float lb, float *beta, const float *b_in, int ld_b) {
    const int P = H * dk;
    if (T <= 0 || P <= 0) return;
    launch_k(c, kda_gate_k, dim3((unsigned)((P + 255) / 256), (unsigned)DS_MIN(T, 65535)), 256, 0,
             g, f, T, H, dk, A_log, dt_bias, lower_bound_form, lb, beta, b_in, ld_b);
    note_launch(c);
}

/* One warp per row of d (a head): the sum of squares by shuffles, then the scaled row. */
/* Rows [rows, 2 rows) of the grid, when x2 is given, are x2's, scaled by scale2 (q and k in one
 * launch). */
__global__ void l2norm_heads_k(float *x, int rows, int d, float eps, float scale, float *x2,
                               float scale2) {
    PDL_ENTRY();
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int lane = threadIdx.x & 31;
    if (row >= (x2 ? 2 * rows : rows)) return;
    if (row >= rows) {
        row -= rows;
        x = x2;
        scale = scale2;
    }
    float *xr = x + (size_t)row * d, ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += xr[i] * xr[i];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float s = scale / sqrtf(ss + eps); /* eps inside the root of the plain sum (§10 trap 1) */
    for (int i = lane; i < d; i += 32) xr[i] *= s;
}

extern "C" void ds_cu_l2norm_heads(ds_cu *c, float *x, int T, int H, int d, float eps,
                                   float scale) {
    int rows = T * H;
    if (rows <= 0) return;
    launch_k(c, l2norm_heads_k, (rows + 7) / 8, 256, 0, x, rows, d, eps, scale, (float *)NULL,
             0.0f);
    note_launch(c);
}

extern "C" void ds_cu_l2norm_heads2(ds_cu *c, float *x, float scale, float *x2, float scale2, int T,
                                    int H, int d, float eps) {
    int rows = T * H;
    if (rows <= 0) return;
    launch_k(c, l2norm_heads_k, (2 * rows + 7) / 8, 256, 0, x, rows, d, eps, scale, x2, scale2);
    note_launch(c);
}

__global__ void gated_rmsnorm_heads_k(float *y, const float *o, const float *gate, const float *w,
                                      int rows, int d, float eps) {
    enum { GW = 8 }; /* weights a lane holds from before the wait (d <= 256) */
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    float wv[GW];
#pragma unroll
    for (int m = 0; m < GW; m++) wv[m] = lane + 32 * m < d ? w[lane + 32 * m] : 0.0f;
    PDL_ENTRY();
    if (row >= rows) return;
    const size_t off = (size_t)row * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) ss += o[off + i] * o[off + i];
    for (int k = 16; k > 0; k >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, k);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
    for (int m = 0; m < GW; m++) {
        const int i = lane + 32 * m;
        if (i < d) y[off + i] = o[off + i] * r * wv[m] / (1.0f + expf(-gate[off + i]));
    }
    for (int i = lane + 32 * GW; i < d; i += 32)
        y[off + i] = o[off + i] * r * w[i] / (1.0f + expf(-gate[off + i]));
}

extern "C" void ds_cu_gated_rmsnorm_heads(ds_cu *c, float *y, const float *o, const float *gate,
                                          const float *w, int T, int H, int d, float eps) {
    int rows = T * H;
    if (rows <= 0) return;
    launch_k(c, gated_rmsnorm_heads_k, (rows + 7) / 8, 256, 0, y, o, gate, w, rows, d, eps);
    note_launch(c);
}

/* ---- AttnRes ----------------------------------------------------------------------------------
 * One block per token: each candidate's RMS and its dot with np (block sums), a softmax over the
 * m candidates, then the mix. cands: device array of m pointers to [T][D]. */
__global__ void attnres_mix_k(float *out, const float *const *cands, int m, const float *np, int D,
                              float eps) {
    PDL_ENTRY();
    const int t = blockIdx.x;
    __shared__ float alpha[32];
    for (int j = 0; j < m; j++) {
        const float *x = cands[j] + (size_t)t * D;
        float ss = 0.0f, dot = 0.0f;
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            ss += x[i] * x[i];
            dot += x[i] * np[i];
        }
        ss = block_sum(ss);
        dot = block_sum(dot);
        if (threadIdx.x == 0) alpha[j] = dot / sqrtf(ss / (float)D + eps);
    }
    __syncthreads();
    float mx = -INFINITY, sum = 0.0f;
    for (int j = 0; j < m; j++) mx = fmaxf(mx, alpha[j]);
    float a[32];
    for (int j = 0; j < m; j++) sum += (a[j] = expf(alpha[j] - mx));
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < m; j++) acc += a[j] / sum * cands[j][(size_t)t * D + i];
        out[(size_t)t * D + i] = acc;
    }
}

extern "C" int ds_cu_attnres_mix(ds_cu *c, float *out, const float *const *cands, int m,
                                 const float *np, int T, int D, float eps, ds_err *err) {
    if (m < 1 || m > 32) return ds_errf(err, "cuda: attnres: %d candidates (1..32)", m);
    if (T <= 0) return DS_OK;
    launch_k(c, attnres_mix_k, T, 256, 0, out, cands, m, np, D, eps);
    CU_TRY(cudaGetLastError(), "attnres");
    return DS_OK;
}

/* cp.async: 16-byte copies global -> shared that run on while the thread goes on */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
/* rows x COLS floats (COLS a multiple of 4) from src, rows lds apart, into dst, rows ldd apart
 * (both 16-byte aligned): 16-byte pieces, thread threadIdx.x of NT taking every NT-th */
template <int COLS, int NT>
__device__ __forceinline__ void cp_async_rows(float *dst, int ldd, const float *src, size_t lds,
                                              int rows) {
    static_assert(COLS % 4 == 0, "16-byte pieces");
    for (int i = threadIdx.x; i < rows * (COLS / 4); i += NT) {
        const int r = i / (COLS / 4), c = (i % (COLS / 4)) * 4;
        cp_async16(dst + r * ldd + c, src + (size_t)r * lds + c);
    }
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

/* ---- MLA, absorbed, over the paged latent cache ---------------------------------------------
 * Split over the context (flash-decoding): block (query row q = t*Ha + h, split s) takes rows
 * [s*MLA_CHUNK, ...) of what q sees: their scores in shared memory (a warp per row, lanes across
 * the R + dr latent entries), its own max m and sum l of exp(score - m), and the unnormalised
 * partial o = sum exp(score - m) c over its rows (threads across R). A second kernel merges the
 * splits: M = max m_s, o = sum o_s e^{m_s - M} / sum l_s e^{m_s - M}. Every head still reads the
 * rows on its own (an all-heads block was tried and measured slower: bench/RESULTS.md). */
enum { MLA_CHUNK = 256 };

/* The split kernels' softmax over scores sc[0..n) in shared memory (written before a barrier):
 * returns their max m and, in *sum, the sum of exp(sc - m), with sc overwritten by those
 * exponentials and visible to the whole block on return. */
__device__ float exp_shifted(float *sc, int n, float *sum) {
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += (sc[j] = expf(sc[j] - mx));
    *sum = block_sum(s); /* its barriers also publish the exponentials */
    return mx;
}

/* BATCH: query token t belongs to its own sequence, at position tok_pos[t] with its block table
 * at table + tok_bt[t] (causal); otherwise one sequence, pos0 / n_ctx / causal as given.
 * V: floats per load (4 when R, dr and row are multiples of 4: a row is then 16-byte aligned).
 * A decode step attends over a few hundred rows per head, so this kernel is bound by load latency,
 * not bandwidth: at batch 1 of the 48B shape the first version (a warp per row, one 4-byte word
 * per lane per trip, a trip per 32 words) took 33 us a layer. Each lane now issues all its loads
 * for MLA_RW rows before using any (MLA_KV vectors per row per trip), and the output pass has
 * every thread sum 16-byte columns over a share of the rows with many loads in flight, the shares
 * added in a fixed order. */
enum { MLA_RW = 4, MLA_KV = 5 }; /* rows a warp scores at once; vectors a lane loads per row */
template <int V> __device__ __forceinline__ float dot_v(const float *a, const float *b) {
    if constexpr (V == 4) {
        const float4 x = *(const float4 *)a, y = *(const float4 *)b;
        return x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
    } else {
        return *a * *b;
    }
}
/* the latent rows and both query parts can be read as float4 (16-byte aligned) */
static int mla_vec4(int R, int dr, int row, int ldqr, const float *qbar, const float *qr,
                    const float *pool) {
    return R % 4 == 0 && dr % 4 == 0 && row % 4 == 0 && ldqr % 4 == 0 &&
           ((uintptr_t)qbar | (uintptr_t)qr | (uintptr_t)pool) % 16 == 0;
}
template <bool BATCH, int V>
__global__ void __launch_bounds__(256, 4) /* 4 blocks an SM: a batch-1 step's 512 in one wave */
    mla_split_k(float *part_o, float *part_ml, const float *qbar, const float *qr, int ldqr, int Ha,
                int R, int dr, const float *pool, const int32_t *table, int bs, int row, int pos0,
                int n_ctx, int causal, float scale, int n_split, const int32_t *tok_bt,
                const int32_t *tok_pos, int chunk) {
    __shared__ float sc[MLA_CHUNK];  /* chunk <= MLA_CHUNK rows per split */
    __shared__ size_t ro[MLA_CHUNK]; /* where each of those rows starts in the pool */
    __shared__ float red[256 * V]; /* [groups][R] the output pass's shares (groups * R <= 256 V) */
    const int q = blockIdx.x, t = q / Ha, s = blockIdx.y, tid = threadIdx.x;
    /* Before waiting for the previous kernel (PDL): the positions and block tables (the host
     * uploads them before a step; no kernel writes them) and from them the split's row offsets.
     * (An L2 prefetch of the rows here as well was measured slower: bench/RESULTS.md.) */
    int n;
    if (BATCH) {
        n = __ldcg(tok_pos + t) + 1;
        table += __ldcg(tok_bt + t);
    } else {
        n = causal ? min(pos0 + t + 1, n_ctx) : n_ctx; /* never past the cache's rows */
    }
    const int j0 = s * chunk, j1 = min(n, j0 + chunk);
    for (int j = j0 + tid; j < j1; j += blockDim.x)
        ro[j - j0] = ((size_t)__ldcg(table + j / bs) * bs + j % bs) * row;
    PDL_ENTRY();
    __syncthreads(); /* ro[] is the block's */
    float *po = part_o + ((size_t)q * n_split + s) * R,
          *pml = part_ml + ((size_t)q * n_split + s) * 2;
    if (j0 >= j1) { /* nothing visible in this split: an empty partial */
        for (int i = tid; i < R; i += blockDim.x) po[i] = 0.0f;
        if (tid == 0) pml[0] = -INFINITY, pml[1] = 0.0f;
        return;
    }
    const float *qb = qbar + (size_t)q * R, *qp = qr + (size_t)q * ldqr;
    const int lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5, nv = (R + dr) / V, nvb = R / V;
    /* a warp scores rows jb .. jb + MLA_RW - 1; each row's sum in a fixed order */
    for (int jb = j0 + wid * MLA_RW; jb < j1; jb += nw * MLA_RW) {
        size_t at[MLA_RW];
        float d[MLA_RW];
#pragma unroll
        for (int r = 0; r < MLA_RW; r++) at[r] = ro[min(jb + r, j1 - 1) - j0], d[r] = 0.0f;
        for (int v0 = 0; v0 < nv; v0 += 32 * MLA_KV)
#pragma unroll
            for (int k = 0; k < MLA_KV; k++) {
                const int v = v0 + 32 * k + lane;
                if (v < nv) {
                    const float *qv = v < nvb ? qb + (size_t)v * V : qp + (size_t)(v - nvb) * V;
#pragma unroll
                    for (int r = 0; r < MLA_RW; r++)
                        d[r] += dot_v<V>(qv, pool + at[r] + (size_t)v * V);
                }
            }
#pragma unroll
        for (int r = 0; r < MLA_RW; r++) {
            float x = d[r];
            for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            const int j = jb + r;
            if (lane == 0 && j < j1) sc[j - j0] = x * scale;
        }
    }
    __syncthreads();
    float sum;
    const float mx = exp_shifted(sc, j1 - j0, &sum);
    /* o = sum_j sc[j] c_j: threads across the R / V column vectors, the block's remaining threads
     * in `groups` row shares (rows g, g + groups, ...), added in order of g */
    const int nj = j1 - j0, ncv = R / V, across = min(ncv, (int)blockDim.x),
              groups = blockDim.x / across, g = tid / across;
    if (g < groups)
        for (int cv = tid % across; cv < ncv; cv += across) {
            float acc[V];
#pragma unroll
            for (int e = 0; e < V; e++) acc[e] = 0.0f;
#pragma unroll 16
            for (int jj = g; jj < nj; jj += groups) {
                const float p = sc[jj], *cj = pool + ro[jj] + (size_t)cv * V;
                if constexpr (V == 4) {
                    const float4 x = *(const float4 *)cj;
                    acc[0] += p * x.x, acc[1] += p * x.y, acc[2] += p * x.z, acc[3] += p * x.w;
                } else {
                    acc[0] += p * *cj;
                }
            }
#pragma unroll
            for (int e = 0; e < V; e++) {
                if (groups == 1)
                    po[(size_t)cv * V + e] = acc[e];
                else
                    red[(size_t)g * R + (size_t)cv * V + e] = acc[e];
            }
        }
    if (groups > 1) {
        __syncthreads();
        for (int i = tid; i < R; i += blockDim.x) {
            float o = 0.0f;
            for (int gg = 0; gg < groups; gg++) o += red[(size_t)gg * R + i];
            po[i] = o;
        }
    }
    if (tid == 0) pml[0] = mx, pml[1] = sum;
}

/* Block (query row q, 128 outputs blockIdx.y): a thread per output. Its loads over the splits
 * are unrolled so that several are in flight: one at a time, a decode step's merge (16 splits)
 * took 4.3 us, ncu measured, most of it waiting on L2 in turn. The sums run in split order. */
enum { MLA_MERGE_THREADS = 128 };
__global__ void __launch_bounds__(MLA_MERGE_THREADS)
    mla_merge_k(float *obar, const float *part_o, const float *part_ml, int R, int n_split) {
    PDL_ENTRY();
    const int q = blockIdx.x, i = blockIdx.y * MLA_MERGE_THREADS + threadIdx.x;
    if (i >= R) return;
    const float *ml = part_ml + (size_t)q * n_split * 2, *po = part_o + (size_t)q * n_split * R + i;
    float M = -INFINITY;
#pragma unroll 8
    for (int s = 0; s < n_split; s++) M = fmaxf(M, ml[2 * s]);
    float L = 0.0f, acc = 0.0f;
#pragma unroll 8
    for (int s = 0; s < n_split; s++) {
        const float l = ml[2 * s + 1], o = po[(size_t)s * R];
        if (l > 0.0f) {
            const float e = expf(ml[2 * s] - M);
            L += l * e;
            acc += o * e;
        }
    }
    obar[(size_t)q * R + i] = acc / L;
}

static void mla_merge(ds_cu *c, float *obar, const float *part_o, const float *part_ml, int rows,
                      int R, int n_split) {
    launch_k(c, mla_merge_k,
             dim3((unsigned)rows, (unsigned)((R + MLA_MERGE_THREADS - 1) / MLA_MERGE_THREADS)),
             MLA_MERGE_THREADS, 0, obar, part_o, part_ml, R, n_split);
}

extern "C" int ds_cu_mla_attend_absorbed(ds_cu *c, float *obar, const float *qbar, const float *qr,
                                         int T, int Ha, int R, int dr, const float *pool,
                                         const int32_t *block_table, int block_size, int row,
                                         int pos0, int n_ctx, int causal, float scale,
                                         ds_err *err) {
    if (T <= 0 || Ha <= 0) return DS_OK;
    const int n_max = causal ? DS_MIN(pos0 + T, n_ctx) : n_ctx;
    if (n_max <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
    const int n_split = (n_max + MLA_CHUNK - 1) / MLA_CHUNK, rows = T * Ha;
    size_t need = (size_t)rows * n_split * ((size_t)R + 2);
    if (grow_scratch((void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch", err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
    launch_k(
        c, mla_vec4(R, dr, row, dr, qbar, qr, pool) ? mla_split_k<false, 4> : mla_split_k<false, 1>,
        dim3((unsigned)rows, (unsigned)n_split), 256, 0, part_o, part_ml, qbar, qr, dr, Ha, R, dr,
        pool, block_table, block_size, row, pos0, n_ctx, causal, scale, n_split,
        (const int32_t *)NULL, (const int32_t *)NULL, (int)MLA_CHUNK);
    CU_TRY(cudaGetLastError(), "mla");
    mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
    CU_TRY(cudaGetLastError(), "mla merge");
    return DS_OK;
}

/* ---- absorbed MLA, all heads of a token in one block ------------------------------------------
 * The block-per-head kernel above reads every latent row once per head (32 times at Ha = 32): at
 * batch 256 that was most of a decode step's traffic. Here block (token t, split s) copies each
 * tile of 16 rows of its split once into shared memory (cp.async) and works on it as two small
 * matrix products held in registers, every head at once:
 *   scores S [Ha][16] = Q [Ha][rq] C [16][rq]^T: thread tiles of 4 heads x 4 rows over a slice of
 *     the rq columns (slices = 256 / Ha lanes side by side, summed by shuffles), 16-byte loads;
 *   an online softmax per head (a half-warp a head: max and sum by shuffles);
 *   O [Ha][R] += P [Ha][16] C [16][R]: thread tiles of 4 heads x OT outputs (4 floats every
 *     4 L apart, L = 1024 / Ha threads a head group, so a warp's loads are consecutive).
 * The version before (a thread a head's outputs, one dot product at a time) issued a scalar
 * shared load for every FMA and waited on shared memory: 1.7 ms a layer at batch 256, context 512.
 * The partials are merged by mla_merge_k as before. */
enum { MLA_AH_THREADS = 256, MLA_AH_SUB = 16, MLA_AH_MIN_ROWS = 64 };

extern "C" void ds_cu_set_mla_all_heads(ds_cu *c, int on) {
    c->mla_all_heads = on;
}

/* Shared memory of mla_allheads_k, floats: q [Ha][rq] | rows [SUB][rq] | p [SUB][Ha] | m, l,
 * alpha [Ha] each. (No padding: a quarter-warp's 16-byte loads are consecutive in every phase.)
 * At Ha = 32, rq = 576: 113 KB, two blocks an SM. */
static size_t mla_ah_floats(int Ha, int rq) {
    return (size_t)(Ha + MLA_AH_SUB) * rq + (size_t)MLA_AH_SUB * Ha + 3 * (size_t)Ha;
}

template <int OT>
__global__ void __launch_bounds__(MLA_AH_THREADS, 2)
    mla_allheads_k(float *part_o, float *part_ml, const float *qbar, const float *qr, int ldqr,
                   int Ha, int R, int dr, const float *pool, const int32_t *tables,
                   const int32_t *tok_bt, const int32_t *tok_pos, int bs, int row, float scale,
                   int n_split, int per) {
    PDL_ENTRY();
    extern __shared__ float sh[];
    const int t = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, rq = R + dr, ld = rq;
    float *qs = sh, *cs = qs + (size_t)Ha * ld, *pt = cs + (size_t)MLA_AH_SUB * ld;
    float *m_sh = pt + MLA_AH_SUB * Ha, *l_sh = m_sh + Ha, *a_sh = l_sh + Ha;
    const int32_t *table = tables + tok_bt[t];
    const int n = tok_pos[t] + 1, j0 = s * per, j1 = min(n, j0 + per);
    for (int i = tid; i < Ha * (rq / 4); i += MLA_AH_THREADS) { /* every head's [q̄ | qR] */
        const int hh = i / (rq / 4), c = (i % (rq / 4)) * 4;
        const float *src = c < R ? qbar + ((size_t)t * Ha + hh) * R + c
                                 : qr + ((size_t)t * Ha + hh) * ldqr + c - R;
        *(float4 *)(qs + (size_t)hh * ld + c) = *(const float4 *)src;
    }
    if (tid < Ha) m_sh[tid] = -INFINITY, l_sh[tid] = 0.0f;
    /* the score tile: slice sl of the columns' 16-byte quads, heads 4 th.., rows 4 tr.. */
    const int slices = MLA_AH_THREADS / Ha, sl = tid % slices, tile = tid / slices;
    const int tr = tile % (MLA_AH_SUB / 4), th = tile / (MLA_AH_SUB / 4);
    /* the output tile: heads 4 hg.., floats 4 (lo + L k) .. + 3 for k < OT / 4 */
    const int L = MLA_AH_THREADS / (Ha / 4), hg = tid / L, lo = tid % L;
    float acc[4][OT];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int o = 0; o < OT; o++) acc[i][o] = 0.0f;
    for (int a = j0; a < j1; a += MLA_AH_SUB) {
        const int nr = min(MLA_AH_SUB, j1 - a);
        __syncthreads(); /* the previous tile and its p are used up (and q is staged) */
        for (int i = tid; i < nr * (rq / 4); i += MLA_AH_THREADS) {
            const int j = i / (rq / 4), c = (i % (rq / 4)) * 4, p = a + j;
            cp_async16(cs + (size_t)j * ld + c,
                       pool + ((size_t)table[p / bs] * bs + p % bs) * row + c);
        }
        cp_async_commit();
        cp_async_wait_all();
        __syncthreads();
        { /* scores */
            float d[4][4] = {};
            for (int q4 = sl; q4 < rq / 4; q4 += slices) {
                float4 qv[4], cv[4];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    qv[i] = *(const float4 *)(qs + (size_t)(4 * th + i) * ld + 4 * q4);
                    cv[i] = *(const float4 *)(cs + (size_t)(4 * tr + i) * ld + 4 * q4);
                }
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        d[i][j] += qv[i].x * cv[j].x + qv[i].y * cv[j].y + qv[i].z * cv[j].z +
                                   qv[i].w * cv[j].w;
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    for (int m = 1; m < slices; m <<= 1)
                        d[i][j] += __shfl_xor_sync(0xffffffffu, d[i][j], m);
            if (sl == 0)
#pragma unroll
                for (int i = 0; i < 4; i++)
#pragma unroll
                    for (int j = 0; j < 4; j++) { /* raw scores for now, p after the softmax */
                        const int jj = 4 * tr + j;
                        pt[jj * Ha + 4 * th + i] = jj < nr ? d[i][j] * scale : -INFINITY;
                    }
        }
        __syncthreads();
        /* online softmax: a half-warp a head, lane j of it row j */
        for (int h = 2 * (tid / 32) + (tid % 32) / 16; h < Ha; h += 2 * (MLA_AH_THREADS / 32)) {
            const int j = tid % 16;
            const float sc = pt[j * Ha + h];
            float cmax = sc;
            for (int m = 8; m; m >>= 1) cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, m));
            const float m_old = m_sh[h], m_new = fmaxf(m_old, cmax); /* finite: nr >= 1 */
            const float p = j < nr ? expf(sc - m_new) : 0.0f;
            float ps = p;
            for (int m = 8; m; m >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, m);
            pt[j * Ha + h] = p;
            if (j == 0) {
                const float alpha = expf(m_old - m_new); /* 0 at the first tile */
                a_sh[h] = alpha, l_sh[h] = l_sh[h] * alpha + ps, m_sh[h] = m_new;
            }
        }
        __syncthreads();
        { /* outputs */
            const float4 al = *(const float4 *)(a_sh + 4 * hg);
            const float av[4] = {al.x, al.y, al.z, al.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int o = 0; o < OT; o++) acc[i][o] *= av[i];
            for (int j = 0; j < nr; j++) {
                const float4 p4 = *(const float4 *)(pt + j * Ha + 4 * hg);
                const float pv[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
                for (int k = 0; k < OT / 4; k++) {
                    const float4 c4 = *(const float4 *)(cs + (size_t)j * ld + 4 * (lo + L * k));
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        acc[i][4 * k] += pv[i] * c4.x, acc[i][4 * k + 1] += pv[i] * c4.y;
                        acc[i][4 * k + 2] += pv[i] * c4.z, acc[i][4 * k + 3] += pv[i] * c4.w;
                    }
                }
            }
        }
    }
    /* an empty split leaves zeros, l = 0: the merge skips it */
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float *po = part_o + (((size_t)t * Ha + 4 * hg + i) * n_split + s) * R;
#pragma unroll
        for (int k = 0; k < OT / 4; k++)
            *(float4 *)(po + 4 * (lo + L * k)) =
                make_float4(acc[i][4 * k], acc[i][4 * k + 1], acc[i][4 * k + 2], acc[i][4 * k + 3]);
    }
    __syncthreads(); /* (m and l of a split with no rows are their initial values) */
    if (tid < Ha) {
        float *pml = part_ml + (((size_t)t * Ha + tid) * n_split + s) * 2;
        pml[0] = m_sh[tid], pml[1] = l_sh[tid];
    }
}

extern "C" int ds_cu_mla_attend_absorbed_batch(ds_cu *c, float *obar, const float *qbar,
                                               const float *qr, int ldqr, int T, int Ha, int R,
                                               int dr, const float *pool, const int32_t *tables,
                                               const int32_t *tok_bt, const int32_t *tok_pos,
                                               int max_ctx, int block_size, int row, float scale,
                                               ds_err *err) {
    if (T <= 0 || Ha <= 0) return DS_OK;
    if (max_ctx <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
    const int rows = T * Ha;
    /* all heads per block: splits of `per` rows (a multiple of the 16-row tile, at least 64 so that
     * staging every head's query stays a fraction of the rows read), aiming at two blocks per SM;
     * a step with fewer blocks than SMs (small batches, short contexts) has more parallelism in
     * the block-per-head path, where the re-read latents come from L2 anyway */
    const int want = (2 * c->n_sm + T - 1) / T;
    int per = (max_ctx + want - 1) / want;
    per = max(MLA_AH_MIN_ROWS, (per + MLA_AH_SUB - 1) / MLA_AH_SUB * MLA_AH_SUB);
    const int ah_split = (max_ctx + per - 1) / per;
    /* the kernel's tiles: 4-head groups, 256 / Ha column slices in a warp (Ha a power of two,
     * 8..256), OT = R Ha / 1024 outputs a head a thread (4, 8 or 16 registers' worth) */
    const int ot = (int)((long)R * Ha / 1024);
    const int ah_shape = Ha >= 8 && Ha <= MLA_AH_THREADS && (Ha & (Ha - 1)) == 0 &&
                         (long)R * Ha % 1024 == 0 && (ot == 4 || ot == 8 || ot == 16) &&
                         mla_vec4(R, dr, row, ldqr, qbar, qr, pool);
    const size_t ah_smem = mla_ah_floats(Ha, R + dr) * sizeof(float);
    if (c->mla_all_heads && !c->batch_invariant && ah_shape && ah_smem <= 200 * 1024 &&
        (c->mla_all_heads == 2 || (long)T * ah_split >= c->n_sm)) {
        const int n_split = ah_split;
        size_t need = (size_t)rows * n_split * ((size_t)R + 2);
        if (grow_scratch((void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch",
                         err))
            return DS_ERR;
        float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
        auto kernel = ot == 16  ? mla_allheads_k<16>
                      : ot == 8 ? mla_allheads_k<8>
                                : mla_allheads_k<4>;
        static size_t smem_set[3]; /* raised once per size, before any capture can be open */
        size_t *set = &smem_set[ot == 16 ? 2 : ot == 8 ? 1 : 0];
        if (ah_smem > *set) {
            CU_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)ah_smem),
                   "mla (all heads): shared memory");
            *set = ah_smem;
        }
        launch_k(c, kernel, dim3((unsigned)T, (unsigned)n_split), MLA_AH_THREADS, ah_smem, part_o,
                 part_ml, qbar, qr, ldqr, Ha, R, dr, pool, tables, tok_bt, tok_pos, block_size, row,
                 scale, n_split, per);
        CU_TRY(cudaGetLastError(), "mla (all heads)");
        mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
        CU_TRY(cudaGetLastError(), "mla merge");
        return DS_OK;
    }
    /* splits of MLA_CHUNK rows, or shorter (down to 32) when a small batch would leave SMs idle:
     * at batch 1 a block per head and 256 rows was latency-bound at ~280 us a layer. Batch
     * invariance keeps MLA_CHUNK: the merge's order must not depend on the batch. */
    int chunk = MLA_CHUNK;
    if (!c->batch_invariant) {
        /* (aiming at 2 or 8 blocks an SM instead: slower or the same, bench/RESULTS.md) */
        const long want = 4L * c->n_sm; /* blocks */
        const long fit = ((long)max_ctx * rows + want - 1) / want;
        chunk = (int)DS_MAX(32L, DS_MIN((long)MLA_CHUNK, (fit + 31) / 32 * 32));
    }
    const int n_split = (max_ctx + chunk - 1) / chunk;
    size_t need = (size_t)rows * n_split * ((size_t)R + 2);
    if (grow_scratch((void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch", err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * R;
    launch_k(
        c, mla_vec4(R, dr, row, ldqr, qbar, qr, pool) ? mla_split_k<true, 4> : mla_split_k<true, 1>,
        dim3((unsigned)rows, (unsigned)n_split), 256, 0, part_o, part_ml, qbar, qr, ldqr, Ha, R, dr,
        pool, tables, block_size, row, 0, 0, 1, scale, n_split, tok_bt, tok_pos, chunk);
    CU_TRY(cudaGetLastError(), "mla (batch)");
    mla_merge(c, obar, part_o, part_ml, rows, R, n_split);
    CU_TRY(cudaGetLastError(), "mla merge");
    return DS_OK;
}

/* Expanded MLA (prefill), the same split-and-merge: block (q = t*Ha + h, split s) scores its rows
 * j as q_N . kN[j][h] + q_R . kR[j], then sums p_j v[j][h]; mla_merge_k merges the splits. */
__global__ void mla_exp_split_k(float *part_o, float *part_ml, const float *q, const float *kN,
                                const float *kR, const float *v, int Ha, int dn, int dr, int dvh,
                                int pos0, int n_ctx, int causal, float scale, int n_split) {
    PDL_ENTRY();
    __shared__ float sc[MLA_CHUNK];
    const int qi = blockIdx.x, t = qi / Ha, h = qi % Ha, s = blockIdx.y;
    const int n = causal ? min(pos0 + t + 1, n_ctx) : n_ctx;
    const int j0 = s * MLA_CHUNK, j1 = min(n, j0 + MLA_CHUNK);
    float *po = part_o + ((size_t)qi * n_split + s) * dvh;
    float *pml = part_ml + ((size_t)qi * n_split + s) * 2;
    if (j0 >= j1) {
        for (int i = threadIdx.x; i < dvh; i += blockDim.x) po[i] = 0.0f;
        if (threadIdx.x == 0) pml[0] = -INFINITY, pml[1] = 0.0f;
        return;
    }
    const float *qn = q + (size_t)qi * (dn + dr), *qp = qn + dn;
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = j0 + wid; j < j1; j += nw) {
        const float *kn = kN + ((size_t)j * Ha + h) * dn, *kr = kR + (size_t)j * dr;
        float d = 0.0f;
        for (int i = lane; i < dn; i += 32) d += qn[i] * kn[i];
        for (int i = lane; i < dr; i += 32) d += qp[i] * kr[i];
        for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (lane == 0) sc[j - j0] = d * scale;
    }
    __syncthreads();
    float sum;
    const float mx = exp_shifted(sc, j1 - j0, &sum);
    for (int i = threadIdx.x; i < dvh; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = j0; j < j1; j++) acc += sc[j - j0] * v[((size_t)j * Ha + h) * dvh + i];
        po[i] = acc;
    }
    if (threadIdx.x == 0) pml[0] = mx, pml[1] = sum;
}

/* ---- expanded MLA through tensor cores (long prefill segments) -----------------------------
 * Per chunk of query rows, per head (one strided-batched cuBLAS call for all heads): scores
 * S_h = Q_h K_h^T with K_h = [kN_h | kR], a row softmax (causal, scaled) into BF16 P, then
 * O_h = P_h V_h. Operands in BF16 with F32 accumulation; the context a chunk can see bounds both
 * GEMMs, so the causal half is never computed. */
extern "C" void ds_cu_set_mla_gemm(ds_cu *c, int on) {
    c->mla_gemm = on;
}

enum { MLA_GEMM_MIN_ROWS = 128 };

/* Kb[j][h][:] = bf16([kN[j][h][0..dn) | kR[j][0..dr)]): a block a key row j (grid-stride) */
__global__ void mla_kcat_k(__nv_bfloat16 *Kb, const float *kN, const float *kR, int C, int Ha,
                           int dn, int dr) {
    PDL_ENTRY();
    const int dq = dn + dr;
    for (int j = blockIdx.x; j < C; j += gridDim.x) {
        __nv_bfloat16 *kb = Kb + (size_t)j * Ha * dq;
        const float *kn = kN + (size_t)j * Ha * dn, *kr = kR + (size_t)j * dr;
        for (int e = threadIdx.x; e < Ha * dq; e += blockDim.x) {
            const int h = e / dq, c = e - h * dq;
            kb[e] = __float2bfloat16_rn(c < dn ? kn[h * dn + c] : kr[c - dn]);
        }
    }
}

/* P[h][t][j] = softmax_j(scale S[h][t][j]) over the j < n(t) a query may see, zero after: block
 * (t, h) of a chunk whose first query sits at position p0. */
__global__ void mla_softmax_k(__nv_bfloat16 *P, const float *S, int Tq, int Ce, int p0, int n_ctx,
                              int causal, float scale) {
    PDL_ENTRY();
    const int t = blockIdx.x, h = blockIdx.y;
    const float *sr = S + ((size_t)h * Tq + t) * Ce;
    __nv_bfloat16 *pr = P + ((size_t)h * Tq + t) * Ce;
    const int n = causal ? min(p0 + t + 1, min(n_ctx, Ce)) : min(n_ctx, Ce);
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) mx = fmaxf(mx, sr[j] * scale);
    mx = block_max(mx);
    float s = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) s += expf(sr[j] * scale - mx);
    const float inv = 1.0f / block_sum(s);
    for (int j = threadIdx.x; j < Ce; j += blockDim.x)
        pr[j] = __float2bfloat16_rn(j < n ? expf(sr[j] * scale - mx) * inv : 0.0f);
}

/* ---- expanded MLA in one fused kernel (flash attention) --------------------------------------
 * The cuBLAS path above writes every score (f32) and probability (BF16) of a chunk to memory and
 * reads them back: at 8192 tokens x 32 heads that traffic, not the products, was its time (47 ms
 * of a 290 ms prefill). Here block (64 query rows, head) keeps everything on chip: its 4 warps
 * hold 16 query rows each as BF16 tensor-core fragments (mma.sync m16n8k16, f32 accumulation),
 * walk the visible keys in tiles of 64, and keep the running maximum, sum and output of each row
 * in registers (online softmax). The tiles of keys and values go by cp.async into one of two
 * stages as they lie in memory (rows past C zero-filled), the next on its way while this one is
 * multiplied, and the fragments come out by ldmatrix — K's as stored, V's transposed by
 * ldmatrix.trans. (Staged by plain loads and stores, V transposed by the stores, the kernel took
 * 5.39 ms at 8192 tokens x 32 heads; pipelined so, 3.76 ms, the same bits.) The same BF16
 * rounding of Q, K, V and P as the cuBLAS path.
 * Fragment layouts as the PTX ISA gives them for m16n8k16: lane = 4 g + l4 holds A's rows g and
 * g + 8 at columns 2 l4 (+1) and 2 l4 + 8 (+1); B's column g at rows 2 l4 (+1) and 2 l4 + 8
 * (+1); C's rows g and g + 8 at columns 2 l4 (+1). */
enum { FL_BQ = 64, FL_BK = 64 };

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi); /* .x (lo) in the low half */
    return *(uint32_t *)&v;
}

template <int DQ, int DV> struct fl_smem {
    static constexpr int KLD = DQ + 8, VLD = DV + 8; /* row strides 4 banks apart: conflict-free */
    static constexpr int K_ELEMS = FL_BK * KLD, V_ELEMS = FL_BK * VLD;
    static constexpr size_t BYTES = (size_t)2 * (K_ELEMS + V_ELEMS) * sizeof(uint16_t);
};

__device__ __forceinline__ void cp_async16_zfill(void *smem, const void *gmem, bool valid) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

/* o [T][Ha][DV] f32 from Qb [T][Ha][DQ], Kb [C][Ha][DQ], Vb [C][Ha][DV] (BF16); query t sits at
 * position p0 + t and, causal, sees keys j <= p0 + t (and j < C). */
template <int DQ, int DV>
__global__ void __launch_bounds__(128)
    mla_flash_k(float *o, const uint16_t *Qb, const uint16_t *Kb, const uint16_t *Vb, int T, int C,
                int Ha, int p0, int causal, float scale) {
    PDL_ENTRY();
    typedef fl_smem<DQ, DV> L;
    constexpr int KP = DQ / 8, VP = DV / 8; /* 16-byte pieces of a key row, of a value row */
    /* threads (8 warps sharing each tile, 128 query rows: 3.73 against 3.47 ms) */
    constexpr int NT = 128;
    static_assert((FL_BK * KP) % NT == 0 && (FL_BK * VP) % NT == 0, "tile split");
    static_assert(FL_BK % 16 == 0 && DQ % 16 == 0 && DV % 16 == 0, "ldmatrix tiles");
    extern __shared__ __align__(16) uint16_t fsh[];
    uint16_t *Ks = fsh;                  /* [2][FL_BK][KLD] keys as stored */
    uint16_t *Vs = fsh + 2 * L::K_ELEMS; /* [2][FL_BK][VLD] values as stored */
    /* the longest (last) query blocks first: causal work grows with the position */
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, q0 = qb * FL_BQ;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, l4 = lane & 3;
    const size_t qs = (size_t)Ha * DQ, vs = (size_t)Ha * DV;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8; /* this thread's two query rows */
    const int last = min(q0 + FL_BQ, T) - 1;
    const int n_end = causal ? min(C, p0 + last + 1) : C;
    /* tile kb into stage st: every thread's pieces in flight at once */
    auto stage = [&](int kb, int st) {
        uint16_t *ks = Ks + st * L::K_ELEMS, *vsm = Vs + st * L::V_ELEMS;
#pragma unroll
        for (int x = 0; x < FL_BK * KP / NT; x++) {
            const int i = tid + x * NT, j = i / KP, c8 = i % KP, row = kb + j;
            cp_async16_zfill(ks + j * L::KLD + c8 * 8,
                             Kb + (size_t)min(row, C - 1) * qs + (size_t)h * DQ + c8 * 8, row < C);
        }
#pragma unroll
        for (int x = 0; x < FL_BK * VP / NT; x++) {
            const int i = tid + x * NT, j = i / VP, d8 = i % VP, row = kb + j;
            cp_async16_zfill(vsm + j * L::VLD + d8 * 8,
                             Vb + (size_t)min(row, C - 1) * vs + (size_t)h * DV + d8 * 8, row < C);
        }
        cp_async_commit();
    };
    if (n_end > 0) stage(0, 0); /* on its way while the queries load */
    uint32_t qf[DQ / 16][4];    /* the warp's queries as A fragments */
#pragma unroll
    for (int kk = 0; kk < DQ / 16; kk++) {
        const int c = kk * 16 + l4 * 2;
        const uint16_t *a = Qb + (size_t)r0 * qs + (size_t)h * DQ + c;
        const uint16_t *b = Qb + (size_t)r1 * qs + (size_t)h * DQ + c;
        qf[kk][0] = r0 < T ? *(const uint32_t *)a : 0u;
        qf[kk][1] = r1 < T ? *(const uint32_t *)b : 0u;
        qf[kk][2] = r0 < T ? *(const uint32_t *)(a + 8) : 0u;
        qf[kk][3] = r1 < T ? *(const uint32_t *)(b + 8) : 0u;
    }
    /* keys each row may see (none for rows past T) */
    const int lim0 = r0 < T ? (causal ? min(p0 + r0 + 1, C) : C) : 0;
    const int lim1 = r1 < T ? (causal ? min(p0 + r1 + 1, C) : C) : 0;
    float oacc[DV / 8][4];
#pragma unroll
    for (int n = 0; n < DV / 8; n++) oacc[n][0] = oacc[n][1] = oacc[n][2] = oacc[n][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    /* ldmatrix: lane L gives the address of row L % 8 of matrix L / 8 */
    const int mi = lane >> 3, mr = lane & 7;
    for (int kb = 0, it = 0; kb < n_end; kb += FL_BK, it++) {
        const int st = it & 1;
        if (kb + FL_BK < n_end) { /* the next tile into the other stage, then wait for this one */
            stage(kb + FL_BK, st ^ 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            cp_async_wait_all();
        }
        __syncthreads();
        const uint16_t *ks = Ks + st * L::K_ELEMS, *vsm = Vs + st * L::V_ELEMS;
        float sc[FL_BK / 8][4]; /* scores: rows r0 (0, 1) and r1 (2, 3), keys kb + 8 t + 2 l4 */
#pragma unroll
        for (int t = 0; t < FL_BK / 8; t++) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < DQ / 16; kk++)
#pragma unroll
            for (int t = 0; t < FL_BK / 8; t += 2) {
                /* matrices: keys of tile t (+1 for mi >= 2), channels kk 16 (+8 for odd mi) */
                uint32_t b[4];
                ldsm_x4(b, ks + ((t + (mi >> 1)) * 8 + mr) * L::KLD + kk * 16 + (mi & 1) * 8);
                mma_16816(sc[t], qf[kk], b[0], b[1]);
                mma_16816(sc[t + 1], qf[kk], b[2], b[3]);
            }
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int t = 0; t < FL_BK / 8; t++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int j = kb + t * 8 + l4 * 2 + e;
                sc[t][e] = j < lim0 ? sc[t][e] * scale : -INFINITY;
                sc[t][2 + e] = j < lim1 ? sc[t][2 + e] * scale : -INFINITY;
                mx0 = fmaxf(mx0, sc[t][e]);
                mx1 = fmaxf(mx1, sc[t][2 + e]);
            }
        /* a row's values sit in the 4 lanes of its group */
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        /* a row that has seen nothing yet keeps zeros (max -inf: no exp of inf - inf) */
        const float a0 = mn0 == -INFINITY ? 1.0f : __expf(m0 - mn0);
        const float a1 = mn1 == -INFINITY ? 1.0f : __expf(m1 - mn1);
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int t = 0; t < FL_BK / 8; t++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float x0 = mn0 == -INFINITY ? 0.0f : __expf(sc[t][e] - mn0);
                const float x1 = mn1 == -INFINITY ? 0.0f : __expf(sc[t][2 + e] - mn1);
                sc[t][e] = x0, sc[t][2 + e] = x1;
                ps0 += x0, ps1 += x1;
            }
        ps0 += __shfl_xor_sync(0xffffffffu, ps0, 1);
        ps0 += __shfl_xor_sync(0xffffffffu, ps0, 2);
        ps1 += __shfl_xor_sync(0xffffffffu, ps1, 1);
        ps1 += __shfl_xor_sync(0xffffffffu, ps1, 2);
        l0 = l0 * a0 + ps0, l1 = l1 * a1 + ps1, m0 = mn0, m1 = mn1;
#pragma unroll
        for (int n = 0; n < DV / 8; n++)
            oacc[n][0] *= a0, oacc[n][1] *= a0, oacc[n][2] *= a1, oacc[n][3] *= a1;
            /* O += P V: the score tiles 2 kk and 2 kk + 1 are the A fragment of keys [16 kk, +16)
             */
#pragma unroll
        for (int kk = 0; kk < FL_BK / 16; kk++) {
            const uint32_t pa[4] = {pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]),
                                    pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]),
                                    pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]),
                                    pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < DV / 8; n += 2) {
                /* matrices: keys kk 16 (+8 for odd mi), value columns of tile n (+1 for mi >= 2),
                 * transposed: lane 4 g + l4 gets keys 2 l4, 2 l4 + 1 of column g */
                uint32_t b[4];
                ldsm_x4_trans(b,
                              vsm + (kk * 16 + (mi & 1) * 8 + mr) * L::VLD + (n + (mi >> 1)) * 8);
                mma_16816(oacc[n], pa, b[0], b[1]);
                mma_16816(oacc[n + 1], pa, b[2], b[3]);
            }
        }
        __syncthreads(); /* this stage is refilled two tiles on */
    }
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int n = 0; n < DV / 8; n++) {
        const int col = n * 8 + l4 * 2;
        if (r0 < T)
            *(float2 *)(o + (size_t)r0 * vs + (size_t)h * DV + col) =
                make_float2(oacc[n][0] * i0, oacc[n][1] * i0);
        if (r1 < T)
            *(float2 *)(o + (size_t)r1 * vs + (size_t)h * DV + col) =
                make_float2(oacc[n][2] * i1, oacc[n][3] * i1);
    }
}

extern "C" void ds_cu_set_mla_flash(ds_cu *c, int on) {
    c->mla_flash = on;
}

static int mla_expanded_gemm(ds_cu *c, float *o, const float *q, const float *kN, const float *kR,
                             const float *v, int T, int n_ctx, int Ha, int dn, int dr, int dvh,
                             int pos0, int causal, float scale, ds_err *err) {
    const int dq = dn + dr, C = n_ctx;
    const int flash = c->mla_flash && dq == 192 && dvh == 128; /* Kimi's MLA (the instance) */
    /* query rows per chunk: S (f32) and P (bf16) of all heads within ~1.5 GB */
    const int Tq = (int)DS_MAX(1, DS_MIN((size_t)T, ((size_t)3 << 29) / ((size_t)Ha * C * 6)));
    /* Kb [C][Ha][dq], Vb [C][Ha][dvh], Qb [T][Ha][dq] bf16 | S [Ha][Tq][C] f32 | P likewise bf16
     * (the last two not with the fused kernel) */
    const size_t sz[5] = {(size_t)C * Ha * dq * 2, (size_t)C * Ha * dvh * 2,
                          (size_t)T * Ha * dq * 2, (size_t)Ha * Tq * C * 4,
                          (size_t)Ha * Tq * C * 2};
    void *b[5];
    if (carve_scratch(&c->mlag, &c->mlag_bytes, sz, b, flash ? 3 : 5, "mla gemm scratch", err))
        return DS_ERR;
    __nv_bfloat16 *Kb = (__nv_bfloat16 *)b[0], *Vb = (__nv_bfloat16 *)b[1];
    __nv_bfloat16 *Qb = (__nv_bfloat16 *)b[2], *P = (__nv_bfloat16 *)b[4];
    float *S = (float *)b[3];
    launch_k(c, mla_kcat_k, (unsigned)DS_MIN(C, 1 << 20), 256, 0, Kb, kN, kR, C, Ha, dn, dr);
    CU_TRY(cudaGetLastError(), "mla gemm: keys");
    round_rows(c, Vb, v, Ha * dvh, Ha * dvh, C);
    round_rows(c, Qb, q, Ha * dq, Ha * dq, T);
    CU_TRY(cudaGetLastError(), "mla gemm: values, queries");
    if (flash) {
        static int smem_set; /* once: prefills are never captured */
        if (!smem_set) {
            CU_TRY(cudaFuncSetAttribute(mla_flash_k<192, 128>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        (int)fl_smem<192, 128>::BYTES),
                   "mla (fused): shared memory");
            smem_set = 1;
        }
        launch_k(c, mla_flash_k<192, 128>, dim3((unsigned)((T + FL_BQ - 1) / FL_BQ), (unsigned)Ha),
                 128, fl_smem<192, 128>::BYTES, o, (const uint16_t *)Qb, (const uint16_t *)Kb,
                 (const uint16_t *)Vb, T, C, Ha, pos0, causal, scale);
        CU_TRY(cudaGetLastError(), "mla (fused)");
        return DS_OK;
    }
    const float one = 1.0f, zero = 0.0f;
    for (int t0 = 0; t0 < T; t0 += Tq) {
        const int tq = DS_MIN(Tq, T - t0);
        const int Ce = causal ? DS_MIN(C, pos0 + t0 + tq) : C; /* what this chunk can see */
        if (Ce <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
        /* S_h^T (Ce x tq, column-major) = K_h (Ce x dq) Q_h^T: rows of K and Q are Ha*dq apart */
        BLAS_TRY(cublasGemmStridedBatchedEx(
                     c->blas, CUBLAS_OP_T, CUBLAS_OP_N, Ce, tq, dq, &one, Kb, CUDA_R_16BF, Ha * dq,
                     (long long)dq, Qb + (size_t)t0 * Ha * dq, CUDA_R_16BF, Ha * dq, (long long)dq,
                     &zero, S, CUDA_R_32F, Ce, (long long)tq * Ce, Ha, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
                 "mla gemm: scores");
        launch_k(c, mla_softmax_k, dim3((unsigned)tq, (unsigned)Ha), 256, 0, P, S, tq, Ce,
                 pos0 + t0, n_ctx, causal, scale);
        CU_TRY(cudaGetLastError(), "mla gemm: softmax");
        /* O_h^T (dvh x tq) = V_h^T (dvh x Ce) P_h^T (Ce x tq); O rows are Ha*dvh apart */
        BLAS_TRY(cublasGemmStridedBatchedEx(
                     c->blas, CUBLAS_OP_N, CUBLAS_OP_N, dvh, tq, Ce, &one, Vb, CUDA_R_16BF,
                     Ha * dvh, (long long)dvh, P, CUDA_R_16BF, Ce, (long long)tq * Ce, &zero,
                     o + (size_t)t0 * Ha * dvh, CUDA_R_32F, Ha * dvh, (long long)dvh, Ha,
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "mla gemm: values");
    }
    return DS_OK;
}

extern "C" int ds_cu_mla_attend_expanded(ds_cu *c, float *o, const float *q, const float *kN,
                                         const float *kR, const float *v, int T, int n_ctx, int Ha,
                                         int dn, int dr, int dvh, int pos0, int causal, float scale,
                                         ds_err *err) {
    if (T <= 0 || Ha <= 0) return DS_OK;
    if (c->mla_gemm && !c->batch_invariant && T >= MLA_GEMM_MIN_ROWS)
        return mla_expanded_gemm(c, o, q, kN, kR, v, T, n_ctx, Ha, dn, dr, dvh, pos0, causal, scale,
                                 err);
    const int n_max = causal ? DS_MIN(pos0 + T, n_ctx) : n_ctx;
    if (n_max <= 0) return ds_errf(err, "cuda: mla: no context rows to attend to");
    const int n_split = (n_max + MLA_CHUNK - 1) / MLA_CHUNK, rows = T * Ha;
    size_t need = (size_t)rows * n_split * ((size_t)dvh + 2);
    if (grow_scratch((void **)&c->part, &c->part_bytes, need * sizeof(float), "mla scratch", err))
        return DS_ERR;
    float *part_o = c->part, *part_ml = c->part + (size_t)rows * n_split * dvh;
    launch_k(c, mla_exp_split_k, dim3((unsigned)rows, (unsigned)n_split), 256, 0, part_o, part_ml,
             q, kN, kR, v, Ha, dn, dr, dvh, pos0, n_ctx, causal, scale, n_split);
    CU_TRY(cudaGetLastError(), "mla expanded");
    mla_merge(c, o, part_o, part_ml, rows, dvh, n_split);
    CU_TRY(cudaGetLastError(), "mla expanded merge");
    return DS_OK;
}

/* ---- MoE router --------------------------------------------------------------------------------
 * One block per token: sigmoid and selection scores in parallel into shared memory, then the
 * selection exactly as the CPU makes it (group scores as the sum of each group's two best, top
 * groups, then top k with ties to the lower index): without groups, warp 0 in k rounds; with
 * groups, one thread. */
__device__ static int top_insert_d(float *val, int32_t *id, int count, int n, float v, int32_t i) {
    if (count == n && !(v > val[n - 1])) return count;
    int pos = count < n ? count : n - 1;
    while (pos > 0 && v > val[pos - 1]) {
        val[pos] = val[pos - 1];
        id[pos] = id[pos - 1];
        pos--;
    }
    val[pos] = v;
    id[pos] = i;
    return count < n ? count + 1 : count;
}

__global__ void moe_route_k(int32_t *idx, float *w, const float *z, const float *bias, int E, int k,
                            int n_group, int topk_group, int renormalize, float scale,
                            int hf_kl_quirk) {
    PDL_ENTRY();
    extern __shared__ float rs[]; /* s [E] | sel [E] */
    float *sv = rs, *sel = rs + E;
    const int t = blockIdx.x;
    const float *zt = z + (size_t)t * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        sv[e] = 1.0f / (1.0f + expf(-zt[e]));
        float x = bias ? sv[e] + bias[e] : sv[e];
        sel[e] = isnan(x) ? -INFINITY : x; /* a NaN logit is never preferred to a real one */
    }
    __syncthreads();
    int32_t *it = idx + (size_t)t * k;
    float *wt = w + (size_t)t * k;
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
        const int G = n_group, gsize = E / G;
        float gval[64];
        int32_t gid[64];
        int ng = 0;
        for (int g = 0; g < G; g++) {
            const float *gs = sel + (size_t)g * gsize;
            float t1 = -INFINITY, t2 = -INFINITY;
            for (int e = 0; e < gsize; e++) {
                if (gs[e] > t1) {
                    t2 = t1;
                    t1 = gs[e];
                } else if (gs[e] > t2) {
                    t2 = gs[e];
                }
            }
            ng = top_insert_d(gval, gid, ng, topk_group, gsize >= 2 ? t1 + t2 : t1, g);
        }
        for (int g = 0; g < G; g++) {
            int kept = 0;
            for (int j = 0; j < ng; j++) kept |= gid[j] == g;
            if (kept) continue;
            for (int e = 0; e < gsize; e++)
                sel[(size_t)g * gsize + e] = hf_kl_quirk ? 0.0f : -INFINITY;
        }
    }
    float val[64];
    if (grouped || E > 1024)
        for (int e = 0; e < E; e++) count = top_insert_d(val, it, count, k, sel[e], e);
    float sum = 0.0f;
    for (int j = 0; j < k; j++) {
        if (j >= count) {
            it[j] = 0;
            wt[j] = 0.0f;
            continue;
        }
        const int e = it[j];
        wt[j] = hf_kl_quirk && bias ? sv[e] + bias[e] : sv[e];
        sum += wt[j];
    }
    if (renormalize && k > 1) {
        const float den = sum + 1e-20f;
        for (int j = 0; j < k; j++) wt[j] = wt[j] / den * scale;
    } else {
        for (int j = 0; j < k; j++) wt[j] *= scale;
    }
}

extern "C" int ds_cu_moe_route(ds_cu *c, int32_t *idx, float *w, const float *z, const float *bias,
                               int T, int E, int k, int n_group, int topk_group, int renormalize,
                               float scale, int hf_kl_quirk, ds_err *err) {
    if (k < 1 || k > 64 || n_group > 64)
        return ds_errf(err, "cuda: moe route: k %d, %d groups (at most 64 each)", k, n_group);
    if (T <= 0) return DS_OK;
    size_t smem = 2 * (size_t)E * sizeof(float);
    if (smem > 48 * 1024)
        CU_TRY(cudaFuncSetAttribute(moe_route_k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)smem),
               "moe route: shared memory");
    launch_k(c, moe_route_k, T, 128, smem, idx, w, z, bias, E, k, n_group, topk_group, renormalize,
             scale, hf_kl_quirk);
    CU_TRY(cudaGetLastError(), "moe route");
    return DS_OK;
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
enum { MOE_GCHUNK = 256 };

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

/* y[perm row][n] = W_e[n] . x[row's input] for every row of active expert e = active[blockIdx.y]:
 * each warp streams MOE_NPW weight rows n once (16-byte loads, several in flight) for up to 8 of
 * the expert's rows at a time, staged in shared memory once per block: a block covers 8 MOE_NPW
 * outputs, so the staging (re-read from L2 by every block) is a quarter of what it was with one
 * output per warp — at batch 256 that traffic, twice the weights', bounded the kernel. A row's
 * dot product takes the same operations however many rows share the pass, so its bits do not
 * depend on the batch. x rows: x + (perm / x_div) * ldx; K % 8 == 0. With act (the down
 * projection), a row of x is gate | up ([2K]) and act(gate, up) is what gets staged: the
 * activation pass of its own is gone, with the same bits (act_pair). */
struct moe_act {
    int on, situ;
    float beta, lin_beta;
};

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
 * wave that ncu timed at 16 us for 37.8 MB against 23 us for the up pass's 75.5 MB. A row's sum
 * takes the same operations whatever NPW is. */
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
 * shape (it takes KDA's q/k/v, MLA's queries and lm_head) a batch-1 step took 2.648-2.667 ms
 * against 2.673-2.695 through gemv_bf16_k (three pairs in two calls). */
__device__ int32_t g_row_zero[1]; /* gemv_wide's routing: every block row is "expert" 0 */

static int gemv_wide(ds_cu *c, float *y, const float *x, const uint16_t *W, int N, int K,
                     ds_err *err) {
    static int32_t *zero;
    if (!zero) CU_TRY(cudaGetSymbolAddress((void **)&zero, g_row_zero), "gemv (wide)");
    const moe_act none = {0, 0, 0.0f, 0.0f};
    launch_k(c, moe_grouped_k<1, 4>, dim3((unsigned)((N + 31) / 32), 1), 256, (size_t)K * 4, y, N,
             x, K, 1, W, N, K, (const int32_t *)NULL, (const int32_t *)NULL, (const int32_t *)NULL,
             (const int32_t *)NULL, 1, none, (const int32_t *)zero, 0, 1, c->wide_early);
    CU_TRY(cudaGetLastError(), "gemv (wide)");
    return DS_OK;
}

/* N outputs for ya block rows, smem bytes of staging a block */
static moe_grouped_fn moe_grouped_pick(ds_cu *c, int rpm, int N, unsigned ya, size_t smem) {
    static int per_sm[MOE_GROUPED_N]; /* blocks an SM holds, for the smem last asked about */
    static size_t per_sm_smem[MOE_GROUPED_N];
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

/* ---- routed experts on tensor cores inside a step (decode of large batches) ------------------
 * The grouped kernel above does one f32 FMA per weight per routed row: at batch 64-256 (a few
 * rows per expert) that is compute, not the weight stream, that bounds it. Here the same grouping
 * feeds BF16 tensor cores (wmma 16 x 16 x 16, f32 accumulation): block (256 output columns,
 * active expert) takes up to 16 of the expert's rows at a time, stages them as BF16 in chunks of
 * MMA_KC along K, and each warp multiplies them with two 16-column tiles of weights read straight
 * from global memory (a weight row is K-contiguous: the column-major B operand). Everything on
 * the device, so a step stays capturable. Activations are rounded to BF16, as in cuBLAS's path;
 * not with batch invariance. N % 256 == 0 and K % 16 == 0. */
enum { MMA_ROWS = 16, MMA_N = 256, MMA_KC = 256, MMA_XLD = MMA_KC + 8, MMA_OLD = MMA_N + 4 };

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
            const int row = UP ? m * N + c0 + g + 8 * h : min(c0 + 16 * m + g + 8 * h, N - 1);
            wr[m][h] = (const uint4 *)(W + ((size_t)e * erows + row) * K) + 2 * l4;
        }
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    for (int p0 = r0; p0 < r1; p0 += 8 * NT) {
        float acc[2][NT][4];
        const uint4 *xr[NT];
        bool xv[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int r = p0 + nt * 8 + g;
            xv[nt] = r < r1;
            xr[nt] = (const uint4 *)(xb + (size_t)(xv[nt] ? r : r0) * K) + 2 * l4;
#pragma unroll
            for (int i = 0; i < 4; i++) acc[0][nt][i] = acc[1][nt][i] = 0.0f;
        }
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
        /* C: rows g (elements 0, 1) and g + 8 (2, 3) of a tile, tokens 2 l4 and 2 l4 + 1 */
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
                    ab[8] = __float2bfloat16_rn(act_pair(acc[0][nt][2 + j], acc[1][nt][2 + j],
                                                         act.situ, act.beta, act.lin_beta));
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
}

/* MINB: blocks an SM ptxas must allow. Left to itself it gave the 16- and 32-token forms 98 and
 * 130 registers (2 and 1 blocks of 8 warps an SM); held to 3 and 2 blocks (80 and 128, a few
 * spilled bytes) the 48B shape's batch-256 experts went from 72% to 82% of copy (1.191 -> 1.044
 * ms), the step 57.5 -> 54.1 ms. The 8-token form keeps its 64 registers (4 blocks) either way. */
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
/* Rows per local expert, on average, from which the tensor-core path wins: below it (decode of
 * large batches: a few rows per expert) a cuBLAS call per expert costs more than the streaming
 * kernel reading each expert once, and the host round trip keeps the step out of graphs. */
enum { EXPERT_GEMM_MIN_PER = 64 };
/* Tokens from which a step's grouped experts run on tensor cores (below, the weight stream bounds
 * the f32 kernel anyway, and its grid — 32 weight rows a block against 128 or 256 — balances
 * the fewer active experts better). 48B shape, steps with graphs on the H200, f32 kernel / the
 * streaming mma one: batch 16 14.20 / 16.69 ms, 24 19.39 / 21.14, 32 23.40 / 24.86, 48 34.62 /
 * 30.15, 64 40.88 / 34.86. */
enum { MOE_MMA_MIN_TOKENS = 40 };

extern "C" void ds_cu_set_expert_gemm(ds_cu *c, int on) {
    c->expert_gemm = on;
}

/* The tensor-core path's element-wise kernels take a row a block and 16-byte loads: x 16-byte
 * aligned and D, I multiples of 8 (moe_experts_gemm's callers); y and out are its own scratch and
 * the model's rows. One thread an element with 64-bit divisions for the row took the activation
 * 0.36 ms a layer for 0.67 GB at the 48B shape's 8192-token prompt. */

/* xg[slot[i]] = bf16(x[perm[i] / k]): the routed rows' inputs in expert order, in panels. */
__global__ void moe_gather_bf16_k(__nv_bfloat16 *xg, const float *x, int D, const int32_t *perm,
                                  const int32_t *slot, int k) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const float4 *xr = (const float4 *)(x + (size_t)(perm[i] / k) * D);
    __nv_bfloat16 *dst = xg + (size_t)slot[i] * D;
    for (int c4 = threadIdx.x; c4 < D / 4; c4 += blockDim.x) store_bf16x4(dst + 4 * c4, xr[c4]);
}

/* slot[i] = panel[e] + (i - start[e]) for the rows i of expert e = blockIdx.x: each expert's rows
 * at the head of its own panel (the padded layout of the batched GEMMs). */
__global__ void moe_slot_k(int32_t *slot, const int32_t *start, const int32_t *panel) {
    PDL_ENTRY();
    const int e = blockIdx.x, r0 = start[e], r1 = start[e + 1];
    for (int i = r0 + threadIdx.x; i < r1; i += blockDim.x) slot[i] = panel[e] + (i - r0);
}

/* ab[i][c] = bf16(act(h[i][c], h[i][I + c])), row i = blockIdx.x */
__global__ void moe_act_bf16_k(__nv_bfloat16 *ab, const float *h, int I, int situ, float beta,
                               float lin_beta) {
    PDL_ENTRY();
    const size_t i = blockIdx.x;
    const float4 *g = (const float4 *)(h + i * 2 * I), *u = g + I / 4;
    for (int c4 = threadIdx.x; c4 < I / 4; c4 += blockDim.x) {
        store_bf16x4(ab + i * I + 4 * c4, act_pair4(g[c4], u[c4], situ, beta, lin_beta));
    }
}

/* inv[perm[i]] = slot[i]: where routed row perm[i]'s output sits in y. */
__global__ void moe_inverse_k(int32_t *inv, const int32_t *perm, const int32_t *slot, int rows) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows) inv[perm[i]] = slot[i];
}

/* out[t] (+)= sum_j w[t][j] y[inv[t k + j]], slots in order (the combine of moe_combine_k);
 * token t = blockIdx.x */
__global__ void moe_combine_perm_k(float *out, const float *y, const int32_t *inv, const float *w,
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
            const float4 v = ((const float4 *)(y + (size_t)r * D))[d4];
            acc.x += wj * v.x, acc.y += wj * v.y, acc.z += wj * v.z, acc.w += wj * v.w;
        }
        if (accumulate) {
            const float4 p = o[d4];
            acc = make_float4(p.x + acc.x, p.y + acc.y, p.z + acc.z, p.w + acc.w);
        }
        o[d4] = acc;
    }
}

/* Is the stream recording a graph? (This path reads the layout on the host, which a capture
 * cannot; nor can the profile's events.) */
static int capturing(ds_cu *c) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(c->stream, &st) != cudaSuccess ||
           st != cudaStreamCaptureStatusNone;
}

/* With the layout on the host, the experts' GEMMs run as a few pointer-array batches: experts
 * sorted by their row counts are cut into buckets (a new one where a count falls under 4/5 of
 * the bucket's first), each expert gets a panel of its bucket's largest count (rounded to 16
 * rows; its own rows first, the rest never read), and each bucket is one batched GEMM for
 * gate/up and one for down. Balanced routing is one bucket; skewed routing (random weights, or
 * a hot expert) a handful — where a cuBLAS call per expert was host-bound (56-91 TFLOP/s at
 * E = 256) and one padded batch would have padded every expert to the hottest. */
enum { MOE_MAX_BUCKETS = 8 };

static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static int moe_experts_gemm(ds_cu *c, float *out, const float *x, const float *w, int T, int k,
                            int E, int D, int I, const uint16_t *gate_up, const uint16_t *down,
                            int situ, float situ_beta, float situ_lin_beta, int accumulate,
                            const int32_t *start, const int32_t *perm, ds_err *err) {
    const int rows = T * k;
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
    int32_t *hs = (int32_t *)c->h_moeb, *order = hs + E + 1, *panel = order + E;
    const void **ptrs = (const void **)((char *)c->h_moeb + ptr_at);
    uint64_t *keys = (uint64_t *)((char *)c->h_moeb + key_at);
    ds_cu_prof_mark(c, "moe gemm: layout to host");
    CU_TRY(cudaMemcpyAsync(hs, start, (size_t)(E + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost,
                           c->stream),
           "moe: expert layout");
    CU_TRY(cudaStreamSynchronize(c->stream), "moe: expert layout");
    const int n_local = hs[E]; /* rows of this rank's experts, the first of perm */
    /* experts with rows, by count (largest first; ties by id, so the plan is deterministic):
     * one sort of keys (INT32_MAX - count, id) */
    int n_act = 0;
    for (int e = 0; e < E; e++)
        if (hs[e + 1] > hs[e])
            keys[n_act++] =
                (uint64_t)(uint32_t)(INT32_MAX - (hs[e + 1] - hs[e])) << 32 | (uint32_t)e;
    qsort(keys, (size_t)n_act, sizeof *keys, cmp_u64);
    for (int i = 0; i < n_act; i++) order[i] = (int)(uint32_t)keys[i];
    int bk_first[MOE_MAX_BUCKETS + 1], bk_rows[MOE_MAX_BUCKETS], n_bk = 0;
    size_t pr = 0; /* padded rows of all panels */
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
    /* xg [pr][D] bf16 | ab [pr][I] bf16 | h [pr][2I] f32 | y [pr][D] f32 | inv [rows] |
     * slot [rows] | panel [E] | pointer arrays [6][E] */
    const size_t sz[8] = {
        pr * D * 2,       pr * I * 2,       pr * 2 * I * 4, pr * D * 4,
        (size_t)rows * 4, (size_t)rows * 4, (size_t)E * 4,  (size_t)6 * E * sizeof(void *)};
    void *b[8];
    if (carve_scratch(&c->moeg, &c->moeg_bytes, sz, b, 8, "moe gemm scratch", err)) return DS_ERR;
    __nv_bfloat16 *xg = (__nv_bfloat16 *)b[0], *ab = (__nv_bfloat16 *)b[1];
    float *h = (float *)b[2], *y = (float *)b[3];
    int32_t *inv = (int32_t *)b[4], *slot = (int32_t *)b[5], *dpanel = (int32_t *)b[6];
    void **dptrs = (void **)b[7];
    const size_t per_gu = (size_t)2 * I * D, per_dn = (size_t)D * I;
    for (int i = 0; i < n_act; i++) { /* in bucket order */
        const int e = order[i];
        ptrs[i] = gate_up + (size_t)e * per_gu;
        ptrs[E + i] = xg + (size_t)panel[e] * D;
        ptrs[2 * E + i] = h + (size_t)panel[e] * 2 * I;
        ptrs[3 * E + i] = down + (size_t)e * per_dn;
        ptrs[4 * E + i] = ab + (size_t)panel[e] * I;
        ptrs[5 * E + i] = y + (size_t)panel[e] * D;
    }
    CU_TRY(cudaMemcpyAsync(dpanel, panel, (size_t)E * 4, cudaMemcpyHostToDevice, c->stream),
           "moe: panels");
    CU_TRY(cudaMemcpyAsync(dptrs, ptrs, (size_t)6 * E * sizeof(void *), cudaMemcpyHostToDevice,
                           c->stream),
           "moe: panels");
    ds_cu_prof_mark(c, "moe gemm: gather x");
    launch_k(c, moe_slot_k, E, 256, 0, slot, start, dpanel);
    if (n_local > 0) launch_k(c, moe_gather_bf16_k, n_local, 256, 0, xg, x, D, perm, slot, k);
    CU_TRY(cudaGetLastError(), "moe gather");
    const float one = 1.0f, zero = 0.0f;
    ds_cu_prof_mark(c, "moe gemm: gate/up");
    /* FLOPs counted for the routed rows only (not the panels' padding) */
    const char *prof = prof_gemm_open(c);
    for (int bk = 0; bk < n_bk; bk++) { /* H_e [n][2I] = X_e [n][D] W_gu,e^T */
        const int i0 = bk_first[bk], cnt = bk_first[bk + 1] - i0;
        BLAS_TRY(cublasGemmBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, 2 * I, bk_rows[bk], D, &one,
                                     (const void *const *)(dptrs + i0), CUDA_R_16BF, D,
                                     (const void *const *)(dptrs + E + i0), CUDA_R_16BF, D, &zero,
                                     dptrs + 2 * E + i0, CUDA_R_32F, 2 * I, cnt, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT),
                 "moe up (batched gemm)");
    }
    prof_gemm_close(c, prof, 2.0 * n_local * 2 * I * D);
    ds_cu_prof_mark(c, "moe gemm: act");
    launch_k(c, moe_act_bf16_k, (unsigned)pr, 256, 0, ab, h, I, situ, situ_beta,
             situ_lin_beta); /* (padding rows: never read) */
    CU_TRY(cudaGetLastError(), "moe act (gemm)");
    ds_cu_prof_mark(c, "moe gemm: down");
    prof = prof_gemm_open(c);
    for (int bk = 0; bk < n_bk; bk++) { /* Y_e [n][D] = A_e [n][I] W_down,e^T */
        const int i0 = bk_first[bk], cnt = bk_first[bk + 1] - i0;
        BLAS_TRY(cublasGemmBatchedEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, D, bk_rows[bk], I, &one,
                                     (const void *const *)(dptrs + 3 * E + i0), CUDA_R_16BF, I,
                                     (const void *const *)(dptrs + 4 * E + i0), CUDA_R_16BF, I,
                                     &zero, dptrs + 5 * E + i0, CUDA_R_32F, D, cnt,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "moe down (batched gemm)");
    }
    prof_gemm_close(c, prof, 2.0 * n_local * D * I);
    ds_cu_prof_mark(c, "moe gemm: combine");
    CU_TRY(cudaMemsetAsync(inv, 0xff, (size_t)rows * sizeof(int32_t), c->stream), "moe inverse");
    if (n_local > 0)
        launch_k(c, moe_inverse_k, (n_local + 255) / 256, 256, 0, inv, perm, slot, n_local);
    CU_TRY(cudaGetLastError(), "moe inverse");
    if (ds_cu_side_join(c, err)) return DS_ERR; /* out: see ds_cu_moe_experts */
    launch_k(c, moe_combine_perm_k, (unsigned)T, 256, 0, out, y, inv, w, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe combine (gemm)");
    return DS_OK;
}

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
    if (grow_scratch((void **)&c->part, &c->part_bytes, (nf + ni) * sizeof(float), "moe scratch",
                     err))
        return DS_ERR;
    float *h = c->part, *y = c->part + hf;
    if (grouped) {
        int32_t *start = (int32_t *)(c->part + nf), *perm = start + E + 1, *active = perm + rows;
        int32_t *n_active = active + E, *hist = n_active + 1;
        const unsigned ya = (unsigned)DS_MIN(E, rows); /* at most this many experts have rows */
        /* One token picks K distinct experts: its rows need no grouping (no launch for it, and
         * one dependent load less before the weights stream); the kernels take the routed rows
         * straight from idx. */
        const int32_t *direct = T == 1 ? idx : NULL;
        ds_cu_prof_mark(c, "moe group");
        if (direct) {
        } else if (n_chunks) {
            launch_k(c, moe_hist_k, n_chunks, 256, (size_t)E * sizeof(int32_t), idx, rows, e0, E,
                     hist);
            launch_k(c, moe_scan_k, 1, 256, ((size_t)E + 1) * sizeof(int32_t), hist, n_chunks, E,
                     start, active, n_active);
            launch_k(c, moe_place_k, n_chunks, 32, (size_t)E * sizeof(int32_t), idx, rows, e0, E,
                     hist, perm);
        } else {
            launch_k(c, moe_group_k, 1, 256, ((size_t)E + 1) * sizeof(int32_t), idx, rows, e0, E,
                     start, perm, active, n_active);
        }
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
        static int smem_set; /* once, before any capture can be open */
        if (!smem_set) {
            for (int i = 0; i < MOE_GROUPED_N; i++)
                CU_TRY(cudaFuncSetAttribute((const void *)moe_grouped_fns[i].fn,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int)MOE_SMEM),
                       "moe: shared memory");
            smem_set = 1;
        }
        const moe_grouped_fn up_k = moe_grouped_pick(c, rpm, 2 * I, ya, (size_t)rp_up * D * 4),
                             dn_k = moe_grouped_pick(c, rpm, D, ya, (size_t)rp_dn * I * 4);
        const moe_act none = {0, 0, 0.0f, 0.0f}, act = {1, situ, situ_beta, situ_lin_beta};
        if (tc) {
            __nv_bfloat16 *xb = (__nv_bfloat16 *)h, *ab = xb + (size_t)rows * D;
            /* tokens a pass from the rows an active expert has on average (more: another pass
             * over its weights) */
            const int per = (rows + (int)ya - 1) / (int)ya, nt = per <= 4 ? 0 : per <= 12 ? 1 : 2;
            launch_k(c, moe_gather_rows_k, (unsigned)rows, 128, 0, xb, x, D, perm, start, E, k);
            launch_k(c, moe_tc_up[nt], dim3((unsigned)((I + 127) / 128), ya), 256, 0, (void *)ab, I,
                     (const __nv_bfloat16 *)xb, gate_up, I, D, start, perm, active, n_active, act);
            launch_k(c, moe_tc_dn[nt], dim3((unsigned)((D + 255) / 256), ya), 256, 0, (void *)y, D,
                     (const __nv_bfloat16 *)ab, down, D, I, start, perm, active, n_active, none);
            CU_TRY(cudaGetLastError(), "moe experts (tensor cores)");
        } else {
            if (mma)
                launch_k(c, moe_mma_k, dim3((unsigned)(2 * I / MMA_N), ya), 256, 0, h, 2 * I, x, D,
                         k, gate_up, 2 * I, D, start, perm, active, n_active, none);
            else
                launch_k(c, up_k.fn, dim3((unsigned)((2 * I + up_k.rows - 1) / up_k.rows), ya), 256,
                         (size_t)rp_up * D * 4, h, 2 * I, x, D, k, gate_up, 2 * I, D, start, perm,
                         active, n_active, rp_up, none, direct, e0, E, 0);
            CU_TRY(cudaGetLastError(), "moe up (grouped)");
            /* h's rows are gate | up, one per routed row: the down pass applies act as it stages */
            if (mma)
                launch_k(c, moe_mma_k, dim3((unsigned)(D / MMA_N), ya), 256, 0, y, D, h, 2 * I, 1,
                         down, D, I, start, perm, active, n_active, act);
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
    launch_k(c, moe_combine_k, (unsigned)(((size_t)T * D + 255) / 256), 256, 0, out, y, w, idx, e0,
             E, T, k, D, accumulate);
    CU_TRY(cudaGetLastError(), "moe combine");
    return DS_OK;
}

/* ---- RoPE (the DSpark draft's YaRN rows) ------------------------------------------------------
 * Row r of x: lanes (2i, 2i+1) turned by cs[r / per][i] = {cos, sin} (GPT-J pairs, as the CPU
 * draft's rope_apply); the products rounded apart (no fused multiply-add), as the CPU's are. */
__global__ void rope_pairs_k(float *x, int ldx, int rows, int per, const float *cs, int half) {
    PDL_ENTRY();
    const int i = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (i >= half || r >= rows) return;
    float *xr = x + (size_t)r * ldx;
    const float *c = cs + ((size_t)(r / per) * half + i) * 2;
    const float a = xr[2 * i], b = xr[2 * i + 1];
    xr[2 * i] = __fsub_rn(__fmul_rn(a, c[0]), __fmul_rn(b, c[1]));
    xr[2 * i + 1] = __fadd_rn(__fmul_rn(a, c[1]), __fmul_rn(b, c[0]));
}

extern "C" int ds_cu_rope_pairs(ds_cu *c, float *x, int ldx, int rows, int per, const float *cs,
                                int half, ds_err *err) {
    if (rows <= 0 || half <= 0) return DS_OK;
    if (per < 1 || rows > 65535) return ds_errf(err, "cuda: rope over %d rows (per %d)", rows, per);
    launch_k(c, rope_pairs_k, dim3((unsigned)((half + 63) / 64), (unsigned)rows), 64, 0, x, ldx,
             rows, per, cs, half);
    CU_TRY(cudaGetLastError(), "rope");
    return DS_OK;
}

/* ---- greedy sampling ---------------------------------------------------------------------------
 * ds_argmax in one pass: each element becomes a 64-bit key, its value's bits ordered as the floats
 * are (above) and its index inverted (below), so the largest key is the largest value at its
 * lowest index; NaN is key 0, which never wins, and a row of NaN gives 0. -0 becomes +0 first,
 * since ds_argmax finds them equal. A block takes one part of a row (ds_cu_argmax_parts), 4 loads
 * in flight a thread; the host takes the largest of a row's part keys (ds_cu_argmax_token). */
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
    if (v != v) return 0ull;
    if (v == 0.0f) v = 0.0f;
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* -inf is 0x007fffff: above NaN's 0 */
    return ((unsigned long long)u << 32) | (unsigned)~i;
}

enum { ARGMAX_THREADS = 256, ARGMAX_MIN_PART = 4096 };

__global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_k(unsigned long long *keys, const float *x, int V, int part_len) {
    PDL_ENTRY();
    const float *xr = x + (size_t)blockIdx.y * V;
    const int nt = ARGMAX_THREADS, end = min(V, (blockIdx.x + 1) * part_len);
    unsigned long long best = 0ull;
    int i = blockIdx.x * part_len + threadIdx.x;
    for (; i + 3 * nt < end; i += 4 * nt) {
        const float v0 = xr[i], v1 = xr[i + nt], v2 = xr[i + 2 * nt], v3 = xr[i + 3 * nt];
        best = max(max(best, argmax_key(v0, i)), argmax_key(v1, i + nt));
        best = max(max(best, argmax_key(v2, i + 2 * nt)), argmax_key(v3, i + 3 * nt));
    }
    for (; i < end; i += nt) best = max(best, argmax_key(xr[i], i));
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    __shared__ unsigned long long red[ARGMAX_THREADS / 32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    if (lane == 0) red[wid] = best;
    __syncthreads();
    if (threadIdx.x) return;
    for (int w = 1; w < ARGMAX_THREADS / 32; w++) best = max(best, red[w]);
    keys[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = best;
}

extern "C" int ds_cu_argmax_parts(int rows, int V) {
    /* two blocks an SM of an H200 (132), parts of at least ARGMAX_MIN_PART values */
    const int want = (264 + rows - 1) / DS_MAX(rows, 1);
    return DS_MAX(1, DS_MIN(want, (V + ARGMAX_MIN_PART - 1) / ARGMAX_MIN_PART));
}

extern "C" void ds_cu_argmax_rows(ds_cu *c, uint64_t *keys, const float *x, int rows, int V,
                                  int parts) {
    if (rows <= 0 || V <= 0 || parts <= 0) return;
    const int part_len = (V + parts - 1) / parts;
    launch_k(c, argmax_k, dim3((unsigned)parts, (unsigned)rows), ARGMAX_THREADS, 0,
             (unsigned long long *)keys, x, V, part_len);
    note_launch(c);
}

/* ---- sampling ------------------------------------------------------------------------------
 * ds_sample_row's definition (engine/sampler.c, draw()) computed by one block of DRAW_THREADS a
 * row: the same float operations for the edits and the weights (every one rounded as written:
 * no contraction into FMAs), integer masses, so every sum is exact and no order of adding
 * changes a bit. The kept prefix of the candidate order (logit descending, id ascending) is
 * found by radix selection over the logits' ordered bits, a byte a pass (counts for top-k,
 * masses for top-p), and the ties at the boundary in id order; the draw is the first id, in id
 * order, whose prefix mass passes floor(u * S). The weights are stored once and re-read. */
enum { DRAW_THREADS = 1024, DRAW_WARPS = DRAW_THREADS / 32 };

/* engine/sampler.c's exp_nonpos, operation for operation */
__device__ __forceinline__ float draw_exp(float x) {
    const bool ok = x >= -87.0f;
    const float xc = ok ? x : -87.0f;
    const float n = __fsub_rn(__fadd_rn(__fmul_rn(xc, 1.44269504f), 12582912.0f), 12582912.0f);
    const float r =
        __fsub_rn(__fsub_rn(xc, __fmul_rn(n, 0.693145751953125f)), __fmul_rn(n, 1.42860677e-6f));
    float p = 1.0f / 5040;
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 720);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 120);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 24);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f / 6);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    const float scale = __int_as_float(((int)n + 127) << 23);
    return ok ? __fmul_rn(p, scale) : 0.0f;
}

__device__ __forceinline__ unsigned long long draw_mass(float w) {
    return (unsigned long long)__float2ll_rz(__fmul_rn(w, 0x1p40f)); /* sampler.c's mass_of */
}

/* a logit's place in the candidate order: larger first; -0 and +0 equal (candidates hold no NaN) */
__device__ __forceinline__ unsigned draw_key(float v) {
    if (v == 0.0f) v = 0.0f;
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

struct draw_bound { /* ids up to here in the candidate order: key > k, or key == k and id <= id */
    unsigned k;
    int id;
    bool on;
};
__device__ __forceinline__ bool draw_within(const draw_bound &b, unsigned key, int i) {
    return !b.on || key > b.k || (key == b.k && i <= b.id);
}

/* v summed over the block (every thread gets it). */
__device__ unsigned long long draw_block_sum(unsigned long long v, unsigned long long *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    unsigned long long t = 0;
    for (int w = 0; w < DRAW_WARPS; w++) t += red[w]; /* exact: the order is immaterial */
    return t;
}

/* What element i (logit xi, weight wi) adds in a pass: MODE 0 a count, 1 its mass (both only for
 * candidates inside lim whose key matches pre under pmask), 2 its mass when also wi >= min_w. */
template <int MODE>
__device__ __forceinline__ unsigned long long draw_val(float xi, float wi, int i,
                                                       const draw_bound &lim, unsigned pre,
                                                       unsigned pmask, float min_w) {
    const unsigned long long m = draw_mass(wi);
    if (!m) return 0;
    const unsigned key = draw_key(xi);
    if ((key & pmask) != pre || !draw_within(lim, key, i)) return 0;
    if (MODE == 2 && !(wi >= min_w)) return 0;
    return MODE == 0 ? 1ull : m;
}

/* The elements a thread takes in order for draw_find: a contiguous run of `per` ids (a multiple
 * of 4 when V is, so that the run is read as float4). */
__device__ __forceinline__ int draw_per(int V) {
    const int per = (V + DRAW_THREADS - 1) / DRAW_THREADS;
    return (V & 3) ? per : (per + 3) & ~3;
}

/* The first id, in id order, whose inclusive prefix of draw_val passes r (r < the row's total):
 * each thread sums its run, a block scan of the runs finds the thread that holds r, and that
 * thread walks its run. Loads are independent of the sums, so they stay in flight. */
template <int MODE>
__device__ int draw_find(const float *x, const float *w, int V, const draw_bound &lim, unsigned pre,
                         unsigned pmask, float min_w, unsigned long long r, unsigned long long *red,
                         int *found) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, per = draw_per(V);
    const int i0 = min(V, threadIdx.x * per), i1 = min(V, i0 + per);
    unsigned long long tot = 0;
    if (!(V & 3)) {
        const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)w;
#pragma unroll 4
        for (int j = i0 >> 2; j < i1 >> 2; j++) {
            const float4 a = x4[j], b = w4[j];
            const int i = 4 * j;
            tot += draw_val<MODE>(a.x, b.x, i, lim, pre, pmask, min_w) +
                   draw_val<MODE>(a.y, b.y, i + 1, lim, pre, pmask, min_w) +
                   draw_val<MODE>(a.z, b.z, i + 2, lim, pre, pmask, min_w) +
                   draw_val<MODE>(a.w, b.w, i + 3, lim, pre, pmask, min_w);
        }
    } else {
#pragma unroll 4
        for (int i = i0; i < i1; i++) tot += draw_val<MODE>(x[i], w[i], i, lim, pre, pmask, min_w);
    }
    unsigned long long inc = tot; /* inclusive scan over the warp, then the warps before */
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += t;
    }
    __syncthreads();
    if (lane == 31) red[wid] = inc;
    if (threadIdx.x == 0) *found = -1;
    __syncthreads();
    unsigned long long acc = inc - tot;
    for (int v = 0; v < wid; v++) acc += red[v];
    if (tot && r >= acc && r < acc + tot) /* this thread holds it */
        for (int i = i0; i < i1; i++) {
            acc += draw_val<MODE>(x[i], w[i], i, lim, pre, pmask, min_w);
            if (r < acc) {
                *found = i;
                break;
            }
        }
    __syncthreads();
    return *found;
}

/* A logit's coarse bin for draw_select: 256 bins over the candidates' span of logits (a weight
 * of at least 2^-40 is (x - max) / T >= -27.73), in the candidate order — monotone in the key,
 * equal logits in one bin. Only a guide: the exact key decides within the bin. */
__device__ __forceinline__ unsigned draw_cbin(float xi, float mx, float scale) {
    const float d = __fmul_rn(__fsub_rn(mx, xi), scale);
    return d < 255.0f ? (unsigned)d : 255u;
}

/* Radix selection: the key of the element where the running total (in the candidate order, over
 * candidates within lim) first reaches goal — counts (MODE 0) or masses (1). On return *goal is
 * what is still to reach among the elements of that key, in id order. A first pass over coarse
 * bins of the logits' span (spread, so shared atomics rarely collide) picks a bin; four passes
 * over the key's bytes, counting only that bin's elements, pick the key. */
template <int MODE>
__device__ unsigned draw_select(const float *x, const float *w, int V, const draw_bound &lim,
                                float mx, float scale, unsigned long long *goal,
                                unsigned long long *hist) {
    unsigned pre = 0, pmask = 0, cb = 0;
    for (int pass = 0; pass < 5; pass++) {
        const int shift = 32 - 8 * pass; /* pass 0: the coarse bins */
        for (int b = threadIdx.x; b < 256; b += DRAW_THREADS) hist[b] = 0;
        __syncthreads();
        auto add = [&](float xi, float wi, int i) {
            const unsigned long long v = draw_val<MODE>(xi, wi, i, lim, pre, pmask, 0.0f);
            if (!v) return;
            const unsigned c = draw_cbin(xi, mx, scale);
            if (pass == 0)
                atomicAdd(&hist[c], v);
            else if (c == cb)
                atomicAdd(&hist[(draw_key(xi) >> shift) & 255u], v);
        };
        if (!(V & 3)) {
            const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)w;
#pragma unroll 2
            for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
                const float4 a = x4[j], b = w4[j];
                add(a.x, b.x, 4 * j), add(a.y, b.y, 4 * j + 1);
                add(a.z, b.z, 4 * j + 2), add(a.w, b.w, 4 * j + 3);
            }
        } else {
            for (int i = threadIdx.x; i < V; i += DRAW_THREADS) add(x[i], w[i], i);
        }
        __syncthreads();
        /* the bin where the goal is reached, in the candidate order (every thread alike): the
         * coarse bins from 0 (the largest logits) up, the key's bytes from 255 down */
        unsigned long long acc = 0;
        int b;
        if (pass == 0) {
            for (b = 0; b < 255 && acc + hist[b] < *goal; b++) acc += hist[b];
            cb = (unsigned)b;
        } else {
            for (b = 255; b > 0 && acc + hist[b] < *goal; b--) acc += hist[b];
            pre |= (unsigned)b << shift;
            pmask |= 255u << shift;
        }
        __syncthreads(); /* everyone has read hist before the next pass clears it */
        *goal -= acc;
    }
    return pre;
}

/* sum over the block of draw_val<MODE> (float4 loads where V allows) */
template <int MODE>
__device__ unsigned long long draw_total(const float *x, const float *w, int V,
                                         const draw_bound &lim, float min_w,
                                         unsigned long long *red) {
    unsigned long long t = 0;
    if (!(V & 3)) {
        const float4 *x4 = (const float4 *)x, *w4 = (const float4 *)w;
#pragma unroll 4
        for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
            const float4 a = x4[j], b = w4[j];
            const int i = 4 * j;
            t += draw_val<MODE>(a.x, b.x, i, lim, 0u, 0u, min_w) +
                 draw_val<MODE>(a.y, b.y, i + 1, lim, 0u, 0u, min_w) +
                 draw_val<MODE>(a.z, b.z, i + 2, lim, 0u, 0u, min_w) +
                 draw_val<MODE>(a.w, b.w, i + 3, lim, 0u, 0u, min_w);
        }
    } else {
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS)
            t += draw_val<MODE>(x[i], w[i], i, lim, 0u, 0u, min_w);
    }
    return draw_block_sum(t, red);
}

__global__ void __launch_bounds__(DRAW_THREADS, 1)
    draw_k(int *tokens, float *x, size_t ld, int V, const ds_cu_draw *draws, const int *edits,
           float *wbuf) {
    PDL_ENTRY();
    __shared__ unsigned long long hist[256], red[DRAW_WARPS];
    __shared__ float mxs[DRAW_WARPS];
    __shared__ int found;
    const ds_cu_draw d = draws[blockIdx.x];
    float *xr = x + (size_t)d.row * ld;
    float *w = wbuf + (size_t)blockIdx.x * V;
    /* the edits: penalties, then the stops masked (sampler.c's edit_logits) */
    const int *cnt = edits + d.edits, *mask = cnt + 2 * d.n_counts;
    if (d.presence != 0.0f || d.frequency != 0.0f)
        for (int j = threadIdx.x; j < d.n_counts; j += DRAW_THREADS) {
            const int id = cnt[2 * j], c = cnt[2 * j + 1];
            if (id < 0 || id >= V) continue;
            const float v = __fsub_rn(xr[id], __fmul_rn(d.frequency, (float)c));
            xr[id] = __fsub_rn(v, d.presence);
        }
    __syncthreads();
    for (int j = threadIdx.x; j < d.n_mask; j += DRAW_THREADS)
        if (mask[j] >= 0 && mask[j] < V) xr[mask[j]] = -INFINITY;
    __syncthreads();
    /* the maximum and the argmax (ds_argmax: the lowest id among the largest, NaN ignored) */
    float mx = -INFINITY;
    unsigned long long best = 0;
    const bool vec = !(V & 3);
    if (vec) {
        const float4 *x4 = (const float4 *)xr;
#pragma unroll 4
        for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
            const float4 a = x4[j];
            mx = fmaxf(fmaxf(mx, a.x), fmaxf(a.y, fmaxf(a.z, a.w)));
            best = max(max(best, argmax_key(a.x, 4 * j)), argmax_key(a.y, 4 * j + 1));
            best = max(max(best, argmax_key(a.z, 4 * j + 2)), argmax_key(a.w, 4 * j + 3));
        }
    } else {
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
            mx = fmaxf(mx, xr[i]);
            best = max(best, argmax_key(xr[i], i));
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    }
    if ((threadIdx.x & 31) == 0) {
        mxs[threadIdx.x >> 5] = mx;
        red[threadIdx.x >> 5] = best;
    }
    __syncthreads();
    for (int v = 0; v < DRAW_WARPS; v++) {
        mx = fmaxf(mx, mxs[v]);
        best = max(best, red[v]);
    }
    if (d.greedy || !(mx > -INFINITY) || mx == INFINITY) {
        if (threadIdx.x == 0) tokens[blockIdx.x] = best ? (int)~(unsigned)best : 0;
        return;
    }
    /* the weights, stored once; the candidates counted and their mass summed on the way */
    unsigned long long n_cand = 0, s_all = 0;
    if (vec) {
        const float4 *x4 = (const float4 *)xr;
        float4 *w4 = (float4 *)w;
#pragma unroll 4
        for (int j = threadIdx.x; j < V >> 2; j += DRAW_THREADS) {
            const float4 a = x4[j];
            float4 b;
            b.x = draw_exp(__fmul_rn(__fsub_rn(a.x, mx), d.inv_t));
            b.y = draw_exp(__fmul_rn(__fsub_rn(a.y, mx), d.inv_t));
            b.z = draw_exp(__fmul_rn(__fsub_rn(a.z, mx), d.inv_t));
            b.w = draw_exp(__fmul_rn(__fsub_rn(a.w, mx), d.inv_t));
            w4[j] = b;
            const unsigned long long m0 = draw_mass(b.x), m1 = draw_mass(b.y);
            const unsigned long long m2 = draw_mass(b.z), m3 = draw_mass(b.w);
            n_cand += (m0 != 0) + (m1 != 0) + (m2 != 0) + (m3 != 0);
            s_all += m0 + m1 + m2 + m3;
        }
    } else {
        for (int i = threadIdx.x; i < V; i += DRAW_THREADS) {
            const float wi = draw_exp(__fmul_rn(__fsub_rn(xr[i], mx), d.inv_t));
            w[i] = wi;
            n_cand += draw_mass(wi) != 0;
            s_all += draw_mass(wi);
        }
    }
    n_cand = draw_block_sum(n_cand, red);
    s_all = draw_block_sum(s_all, red);
    draw_bound lim = {0u, 0, false};
    const float cscale = __fmul_rn(d.inv_t, 256.0f / 27.8f); /* draw_cbin's: 27.8 > 40 ln 2 */
    /* top-k binds only when there are more candidates than k */
    if (d.top_k > 0 && n_cand > (unsigned long long)d.top_k) {
        unsigned long long goal = (unsigned long long)d.top_k;
        const unsigned k = draw_select<0>(xr, w, V, lim, mx, cscale, &goal, hist);
        const int id = draw_find<0>(xr, w, V, lim, k, 0xffffffffu, 0.0f, goal - 1, red, &found);
        lim = {k, id, true};
    }
    if (d.top_p < 1.0f) {
        const unsigned long long kept = lim.on ? draw_total<1>(xr, w, V, lim, 0.0f, red) : s_all;
        unsigned long long goal =
            (unsigned long long)__double2ll_rz(__dmul_rn((double)d.top_p, __ull2double_rn(kept)));
        if (!goal) goal = 1;
        const unsigned k = draw_select<1>(xr, w, V, lim, mx, cscale, &goal, hist);
        const int id = draw_find<1>(xr, w, V, lim, k, 0xffffffffu, 0.0f, goal - 1, red, &found);
        lim = {k, id, true};
    }
    const unsigned long long S =
        lim.on || d.min_w > 0.0f ? draw_total<2>(xr, w, V, lim, d.min_w, red) : s_all;
    unsigned long long r = (unsigned long long)__double2ll_rz(__dmul_rn(d.u, __ull2double_rn(S)));
    if (r >= S) r = S - 1;
    const int tok = draw_find<2>(xr, w, V, lim, 0u, 0u, d.min_w, r, red, &found);
    if (threadIdx.x == 0) tokens[blockIdx.x] = tok;
}

extern "C" int ds_cu_draw_rows(ds_cu *c, int32_t *tokens, float *x, size_t ld, int V,
                               const ds_cu_draw *d, int n, const int32_t *edits, size_t n_edits,
                               ds_err *err) {
    if (n <= 0) return DS_OK;
    void *b[4];
    const size_t sz[4] = {(size_t)n * sizeof *d, DS_MAX(n_edits, (size_t)1) * sizeof *edits,
                          (size_t)n * V * sizeof(float), (size_t)n * sizeof(int32_t)};
    if (carve_scratch(&c->drawb, &c->drawb_bytes, sz, b, 4, "draw scratch", err)) return DS_ERR;
    CU_TRY(cudaMemcpyAsync(b[0], d, sz[0], cudaMemcpyHostToDevice, c->stream), "draws up");
    if (n_edits)
        CU_TRY(cudaMemcpyAsync(b[1], edits, n_edits * sizeof *edits, cudaMemcpyHostToDevice,
                               c->stream),
               "draw edits up");
    launch_k(c, draw_k, dim3((unsigned)n), DRAW_THREADS, 0, (int *)b[3], x, ld, V,
             (const ds_cu_draw *)b[0], (const int *)b[1], (float *)b[2]);
    CU_TRY(cudaGetLastError(), "draw");
    CU_TRY(cudaMemcpyAsync(tokens, b[3], sz[3], cudaMemcpyDeviceToHost, c->stream), "tokens down");
    return ds_cu_sync(c, err);
}

/* ---- KDA recurrence ---------------------------------------------------------------------------
 * Each (head, value column) is independent. A thread keeps DK / SPLIT entries of its column of S
 * in registers for the whole call (S is read and written once), SPLIT neighbouring lanes sharing
 * a column and adding their partial dot products with a shuffle (SPLIT 2 at DK 128 keeps the
 * column in registers without spilling). Per token the block stages q, k and exp(g) in shared
 * memory. Blocks: (head, column tile, sequence); a batch of sequences is one launch. */
/* One token of the recurrence for a thread's DP entries s of a state column (entries c0 + c),
 * SPLIT neighbouring lanes sharing the column: decay by ds, predict v from the decayed state
 * (with k), write k (beta err)^T, read with q; returns the column's output (every lane of the
 * SPLIT has it). kda_run's and the fused decode's one step, so that both give the same bits. */
template <int DP, int SPLIT>
__device__ __forceinline__ float kda_token(float (&s)[DP], const float *qs, const float *ks,
                                           const float *ds, int c0, float vt, float bt, bool live) {
    float e = 0.0f;
#pragma unroll
    for (int c = 0; c < DP; c++) {
        s[c] *= ds[c0 + c];
        e += ks[c0 + c] * s[c];
    }
#pragma unroll
    for (int m = 1; m < SPLIT; m <<= 1) e += __shfl_xor_sync(0xffffffffu, e, m);
    const float err_v = live ? bt * (vt - e) : 0.0f;
    float acc = 0.0f;
#pragma unroll
    for (int c = 0; c < DP; c++) {
        s[c] += ks[c0 + c] * err_v;
        acc += qs[c0 + c] * s[c];
    }
#pragma unroll
    for (int m = 1; m < SPLIT; m <<= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
    return acc;
}

/* DVC: dv when known at compile time (0: run time). With dv a run-time value the state's 64
 * entries a thread had 64 addresses, kept live from the loads to the stores: 234 registers a
 * thread at DK 128, two blocks an SM, and a decode step's recurrences at 62% of the copy rate
 * (batch 256 at the 48B shape). With it each entry is a constant offset from one address: 168
 * registers, three blocks (four, at 128 registers, spilled 208 bytes). */
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

/* ---- KDA decode in one kernel (ds_cu_kda_decode_fused) ------------------------------------------
 * At batch 1 every kernel of the step is a chain of latencies after its wait for the one before
 * (bench/RESULTS.md, sessions 8-9), and KDA's middle was seven of them: the convs, the head
 * norms, f_b's and g_b's matmuls, the gate, the recurrence and the gated output norm (13 us a
 * layer of the 48B shape's step on the H200, by the what-if). Here a cluster of KDF_CL blocks per
 * (head, sequence) does all of them: block r of the cluster owns a quarter of the head — the
 * convs of its q, k and v channels (their tails: one writer each), f_b's and g_b's rows of its
 * channels and the recurrence of its value columns — and hands the q, k and decay values every
 * block needs to the others' shared memory (distributed shared memory), as it does the
 * recurrence's outputs for the output norm. A block per head did the same work in 13.5 us: one
 * SM then reads and writes the head's 64 KB state and 64 KB of weights alone. Its state, conv
 * weights and tails are read, and its f_b and g_b rows start on their way to shared memory
 * (cp.async), before the wait for the previous kernel. Each value takes the operations of the
 * kernel it stands in for (short_conv_batch_k, l2norm_heads_k, stream_rows_dot through a warp's
 * shuffle tree, kda_gate_k, kda_run at SPLIT 2, gated_rmsnorm_heads_k), so the bits are the
 * same as theirs. */
enum { KDF_DK = 128, KDF_CL = 4, KDF_THREADS = 128, KDF_K_MAX = 128 };
enum { KDF_Q = KDF_DK / KDF_CL }; /* channels (and value columns) a block owns: 32 */

/* the dynamic shared memory: the block's f_b rows then its g_b rows, BF16 */
static size_t kdf_smem(int Kf, int Kg) {
    return (size_t)KDF_Q * (Kf + Kg) * sizeof(uint16_t);
}

template <int W>
__global__ void __launch_bounds__(KDF_THREADS) kda_decode_fused_k(ds_cu_kda_decode d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 /* (launched in clusters of KDF_CL) */
    namespace cg = cooperative_groups;
    constexpr int DK = KDF_DK, Q = KDF_Q, SPLIT = 2, DP = DK / SPLIT;
    static_assert(KDF_THREADS == 4 * Q && Q == 32, "a warp per 32 rows of a block's share");
    static_assert(KDF_K_MAX <= 32 * 8, "f_b's and g_b's rows: one 16-byte piece a lane");
    static_assert(KDF_K_MAX <= KDF_THREADS, "f_a x and g_a x: one element a thread");
    extern __shared__ uint4 kdf_dyn[]; /* [Q][Kf] f_b's rows, then [Q][Kg] g_b's */
    __shared__ __align__(16) float fas[KDF_K_MAX], gas[KDF_K_MAX]; /* f_a x, g_a x */
    /* the head's q and k after the conv (then their norms), e^g: every block's whole copy */
    __shared__ __align__(16) float qs[DK], ks[DK], ds[DK], os[DK];
    __shared__ float vs[Q], gts[Q], beta_s; /* this block's v, output gate */
    cg::cluster_group cl = cg::this_cluster();
    const int r = (int)cl.block_rank(), h = blockIdx.x / KDF_CL, z = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int P = d.H * DK, Kf = d.Kf, Kg = d.Kg, q0 = r * Q; /* this block's channels q0 + .. */
    const uint16_t *fbw = (const uint16_t *)kdf_dyn, *gbw = fbw + (size_t)Q * Kf;
    /* the recurrence: threads 0..63, two a value column q0 + col */
    const bool rec = tid < SPLIT * Q;
    const int col = q0 + (tid & 63) / SPLIT, part = tid % SPLIT, c0 = part * DP;
    /* before the wait: nothing of this step writes these (as kda_run's state; the tails are
     * this kernel's alone within a step) */
    /* this thread's column from row c0 on: entry c at Sc[c DK], a constant offset (an address
     * worked out per entry took four instructions and a register each) */
    float *Sc = d.S[z] + (size_t)h * DK * DK + (size_t)c0 * DK + col;
    float s[DP];
#pragma unroll
    for (int c = 0; c < DP; c++) s[c] = __ldcg(Sc + c * DK); /* (threads 64.. repeat 0..63's) */
    {
        uint16_t *dst = (uint16_t *)kdf_dyn;
        const uint16_t *fb = d.f_b + (size_t)(h * DK + q0) * Kf;
        const uint16_t *gb = d.g_b + (size_t)(h * DK + q0) * Kg;
        /* (trip counts bounded at compile time: a run-time loop here was unrolled with its
         * remainders into more code than the rest of the kernel) */
        constexpr int PT = Q * KDF_K_MAX / 8 / KDF_THREADS; /* pieces a thread, at most */
#pragma unroll
        for (int u = 0; u < PT; u++) {
            const int i = tid + u * KDF_THREADS;
            if (i < Q * Kf / 8) cp_async16(dst + i * 8, fb + i * 8);
        }
        dst += (size_t)Q * Kf;
#pragma unroll
        for (int u = 0; u < PT; u++) {
            const int i = tid + u * KDF_THREADS;
            if (i < Q * Kg / 8) cp_async16(dst + i * 8, gb + i * 8);
        }
        cp_async_commit();
    }
    /* thread tid < 3 Q: projection j = tid / Q's channel q0 + tid % Q */
    const bool cv = tid < 3 * Q;
    const int j = tid / Q, cc = h * DK + q0 + tid % Q;
    float *tail = d.tails[z];
    const size_t tn = (size_t)(W - 1) * P; /* one projection's tail */
    float wc[W], win[W];
    if (cv) {
#pragma unroll
        for (int i = 0; i < W; i++) wc[i] = d.conv_w[((size_t)j * P + cc) * W + i];
#pragma unroll
        for (int i = 0; i < W - 1; i++) win[i] = __ldcg(tail + j * tn + (size_t)i * P + cc);
    }
    /* lane l < 8 of warp w holds the bias of f_b row q0 + 8 w + l, the rows the warp sums */
    const float bias = lane < 8 ? d.dt_bias[h * DK + q0 + 8 * warp + lane] : 0.0f;
    const float a_log = d.A_log[h], nw = d.o_norm[q0 + lane];
    /* every block of the cluster has started before any writes into another's shared memory */
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
    PDL_ENTRY();
    const float *pre = d.pre + (size_t)z * d.ld;
    if (tid < Kf) fas[tid] = pre[d.fa_off + tid]; /* (Kf, Kg <= KDF_THREADS) */
    if (tid < Kg) gas[tid] = pre[d.ga_off + tid];
    if (tid == 0) beta_s = 1.0f / (1.0f + expf(-pre[d.b_off + h])); /* as kda_gate_k */
    float cout = 0.0f; /* the conv (short_conv_batch_k at one token); the new tail at the end */
    if (cv) {
        win[W - 1] = pre[(size_t)j * P + cc];
        float acc = 0.0f;
#pragma unroll
        for (int i = 0; i < W; i++) acc += wc[i] * win[i];
        cout = acc / (1.0f + expf(-acc));
    }
    cp_async_wait_all();
    __syncthreads();
    asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
    if (cv && j < 2) /* q and k to every block */
        for (int b = 0; b < KDF_CL; b++)
            cl.map_shared_rank(j == 0 ? qs : ks, b)[q0 + tid % Q] = cout;
    else if (cv)
        vs[tid % Q] = cout;
    /* f_b's and g_b's rows q0 + 8 warp + i (stream_rows_dot's order: lane l's pieces l, l + 32,
     * .., then the shuffle tree); the decay gate (kda_gate_k) and its exponential (as kda_run
     * stages it) to every block */
    const float a = expf(a_log);
    float f[8], gt[8]; /* rows 8 warp + i: the partial sums side by side, then their trees */
    /* A lane has one piece of a row at most (K <= 32 x 8): its sum is 0 + that piece, or 0.
     * Lanes past the row compute a piece they then drop (no branch a row). */
    const bool fl_on = lane < Kf / 8, gl_on = lane < Kg / 8;
    const int fk = fl_on ? lane : 0, gk = gl_on ? lane : 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int n = 8 * warp + i; /* of this block's Q rows */
        const float fv = dot8(((const uint4 *)(fbw + (size_t)n * Kf))[fk], fas + (size_t)fk * 8);
        const float gv = dot8(((const uint4 *)(gbw + (size_t)n * Kg))[gk], gas + (size_t)gk * 8);
        f[i] = fl_on ? 0.0f + fv : 0.0f;
        gt[i] = gl_on ? 0.0f + gv : 0.0f;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            f[i] += __shfl_xor_sync(0xffffffffu, f[i], o);
            gt[i] += __shfl_xor_sync(0xffffffffu, gt[i], o);
        }
    float fl = 0.0f, gl = 0.0f; /* lane l < 8 takes row 8 warp + l */
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (lane == i) fl = f[i], gl = gt[i];
    if (lane < 8) {
        const int n = 8 * warp + lane;
        const float eg = expf(kda_decay(fl + bias, a, d.lower_bound_form, d.lb));
        for (int b = 0; b < KDF_CL; b++) cl.map_shared_rank(ds, b)[q0 + n] = eg;
        gts[n] = gl;
    }
    cl.sync(); /* every block's q, k and e^g in place */
    /* Every warp runs the shuffles below, whatever part of the result it keeps: a shuffle
     * under a branch the compiler cannot see is warp-uniform gets a second, collective copy of
     * the code around it (the recurrence was in the kernel twice). */
    /* q's and k's head norms (l2norm_heads_k: a warp a row; each block its own copy). Warps 2
     * and 3 sum e^g (read-only here) and keep nothing. */
    {
        const float *xr = warp == 0 ? qs : warp == 1 ? ks : ds;
        float ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss += xr[i] * xr[i];
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float sc = (warp == 0 ? d.q_scale : 1.0f) / sqrtf(ss + d.eps);
        if (warp < 2)
            for (int i = lane; i < DK; i += 32) (warp == 0 ? qs : ks)[i] *= sc;
    }
    __syncthreads();
    /* the recurrence at one token (kda_run), this block's value columns (warps 2 and 3 repeat
     * 0 and 1 and keep nothing) */
    const float acc = kda_token<DP, SPLIT>(s, qs, ks, ds, c0, vs[col - q0], beta_s, true);
    if (rec && part == 0)
        for (int b = 0; b < KDF_CL; b++) cl.map_shared_rank(os, b)[col] = acc;
    /* (A cluster barrier's release is a GPU-wide memory barrier on this hardware: it waits for
     * every store still in flight. The state's and the tails' stores, read only by the next
     * step, go after the last one.) */
    cl.sync(); /* the head's outputs in every block (and no block reads another's memory after) */
    if (rec)
#pragma unroll
        for (int c = 0; c < DP; c++) Sc[c * DK] = s[c];
    if (cv)
#pragma unroll
        for (int i = 0; i < W - 1; i++) tail[j * tn + (size_t)i * P + cc] = win[i + 1];
    /* the gated output norm (gated_rmsnorm_heads_k: a warp a row), this block's columns: warp
     * 0's to keep */
    {
        float ss = 0.0f;
        for (int i = lane; i < DK; i += 32) ss += os[i] * os[i];
        for (int k = 16; k > 0; k >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, k);
        const float rr = 1.0f / sqrtf(ss / (float)DK + d.norm_eps);
        if (warp == 0)
            d.y[((size_t)z * d.H + h) * DK + q0 + lane] =
                os[q0 + lane] * rr * nw / (1.0f + expf(-gts[lane]));
    }
#endif
}

extern "C" int ds_cu_kda_decode_fits(const ds_cu *c, int dk, int W, int Kf, int Kg) {
    return c->sm90 && dk == KDF_DK && W == 4 && Kf > 0 && Kf % 8 == 0 && Kf <= KDF_K_MAX &&
           Kg > 0 && Kg % 8 == 0 && Kg <= KDF_K_MAX;
}

extern "C" int ds_cu_kda_decode_fused(ds_cu *c, const ds_cu_kda_decode *d, ds_err *err) {
    if (!ds_cu_kda_decode_fits(c, d->dk, d->W, d->Kf, d->Kg))
        return ds_errf(err,
                       "cuda: kda decode (fused): head dim %d, conv width %d, f_b and g_b of "
                       "%d and %d columns (128, 4, multiples of 8 up to 128; sm_90)",
                       d->dk, d->W, d->Kf, d->Kg);
    if (d->n_seq <= 0 || d->H <= 0) return DS_OK;
    if (d->n_seq > 65535) return ds_errf(err, "cuda: kda decode (fused): %d sequences", d->n_seq);
    if ((uintptr_t)d->f_b % 16 || (uintptr_t)d->g_b % 16)
        return ds_errf(err, "cuda: kda decode (fused): f_b or g_b not 16-byte aligned");
    launch_cluster_k(c, kda_decode_fused_k<4>, dim3((unsigned)(d->H * KDF_CL), (unsigned)d->n_seq),
                     KDF_THREADS, kdf_smem(d->Kf, d->Kg), KDF_CL, *d);
    CU_TRY(cudaGetLastError(), "kda decode (fused)");
    return DS_OK;
}

/* ---- KDA in chunks (prefill) ------------------------------------------------------------------
 * Within a chunk of L <= 64 tokens starting from state S0, with G_t the running sum of the log
 * decays g (per key channel, inclusive of token t; G decreases), the recurrence unrolls to
 *   u_i = beta_i (v_i - S0^T (k_i e^{G_i})) - sum_{j<i} A_ij u_j,
 *         A_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}                      (j < i)
 *   o_t = S0^T (q_t e^{G_t}) + sum_{i<=t} P_ti u_i,  P_ti = sum_c q_tc k_ic e^{G_tc - G_ic}
 *   S_L = e^{G_L} S0 + sum_i (k_i e^{G_L - G_i}) u_i^T
 * so with (I + A) the unit lower-triangular matrix, U = Ut - W S0 where Ut = (I + A)^-1 diag(beta)
 * V and W = (I + A)^-1 diag(beta) (K e^G). Every exponent is a difference G_later - G_earlier <= 0,
 * so nothing overflows however strong the decay. Pass 1 (a block per chunk and head, all chunks
 * at once) builds W, Ut, Qp = Q e^G, Kc = K e^{G_L - G}, P and e^{G_L}; pass 2 (a block per head,
 * column group and sequence) walks its sequence's chunks in order: two small products per chunk,
 * the state's 32 columns kept in registers; pass 3 (a block per chunk and head, all at once) the
 * outputs. */
enum { KC = 64 };
/* pass 1's output per (chunk, head): W, Ut, Qp, Kc [KC][KD], P [KC][KC], gL [KD] */
__host__ __device__ constexpr size_t kda_ch_floats(int KD) {
    return (size_t)4 * KC * KD + (size_t)KC * KC + KD;
}

struct kda_chunk {
    int t0, len, seg; /* its tokens [t0, t0 + len) of segment seg */
};

/* Built with -DDS_KDA_PREP_CLOCKS (tools/device/pack_devbin.sh's timing build), pass 1 adds up
 * the cycles its blocks spend in each phase (thread 0's clock between barriers) for
 * ds_cu_kda_prep_clocks; otherwise the marks are nothing. */
#ifdef DS_KDA_PREP_CLOCKS
__device__ unsigned long long g_kda_prep_clk[6];
#define KDA_CLK_START() long long clk_last_ = clock64()
#define KDA_CLK_MARK(k)                                                                            \
    do {                                                                                           \
        if (threadIdx.x == 0) {                                                                    \
            const long long t_ = clock64();                                                        \
            atomicAdd(&g_kda_prep_clk[k], (unsigned long long)(t_ - clk_last_));                   \
            clk_last_ = t_;                                                                        \
        }                                                                                          \
    } while (0)
#define KDA_CLK_SYNC_MARK(k)                                                                       \
    do {                                                                                           \
        __syncthreads();                                                                           \
        KDA_CLK_MARK(k);                                                                           \
    } while (0)
#else
#define KDA_CLK_START()
#define KDA_CLK_MARK(k)
#define KDA_CLK_SYNC_MARK(k)
#endif

extern "C" int ds_cu_kda_prep_clocks(double cycles[6]) {
#ifdef DS_KDA_PREP_CLOCKS
    unsigned long long h[6];
    if (cudaMemcpyFromSymbol(h, g_kda_prep_clk, sizeof h) != cudaSuccess) return -1;
    for (int i = 0; i < 6; i++) cycles[i] = (double)h[i];
    static const unsigned long long zero[6] = {0};
    cudaMemcpyToSymbol(g_kda_prep_clk, zero, sizeof zero);
    return 0;
#else
    (void)cycles;
    return -1;
#endif
}

/* Pass 1's shared memory: keys, queries and running log2 decays channel-major (a thread's four
 * rows of one channel are one 16-byte load), rows KPS apart; A (beta_i A_ij) later overlays the
 * queries. */
enum { KPS = KC + 4 };
template <int KD> constexpr size_t kda_prep_smem() {
    return ((size_t)3 * KD * KPS + KC) * sizeof(float);
}

/* The 4-row tile pair (ti > tj) of the strictly lower part that thread n < 120 of pass 1 takes
 * (a chunk of 64 rows has 16 tiles: 120 pairs below the diagonal, 16 on it) */
static_assert(KC == 64, "pass 1 maps 120 + 16 tiles of a 64-row chunk onto 256 threads");
__device__ __forceinline__ void kda_tile_pair(int n, int &ti, int &tj) {
    ti = 1;
    while (n >= ti) n -= ti, ti++;
    tj = n;
}

template <int KD>
__global__ void __launch_bounds__(256, 2)
    kda_chunk_prep_k(float *out, const float *q, const float *k, const float *v, const float *g,
                     const float *beta, const kda_chunk *chunks, int H) {
    PDL_ENTRY();
    KDA_CLK_START();
    constexpr float LOG2E = 1.4426950408889634f;
    extern __shared__ float ksh[];
    float *Kt = ksh;           /* [KD][KPS] keys, channel-major */
    float *Gt = Kt + KD * KPS; /* [KD][KPS] running sums of the log decays, times log2(e) */
    float *Qt = Gt + KD * KPS; /* [KD][KPS] queries; then [KC][KPS] A (beta_i A_ij, j < i) */
    float *bs = Qt + KD * KPS; /* [KC] beta */
    const kda_chunk ch = chunks[blockIdx.x];
    const int h = blockIdx.y, L = ch.len, tid = threadIdx.x;
    const size_t row0 = (size_t)ch.t0 * H + h; /* token t of the chunk, head h: (row0 + t H) KD */
    float *o = out + ((size_t)blockIdx.x * H + h) * kda_ch_floats(KD);
    float *W = o, *Ut = W + KC * KD, *Qp = Ut + KC * KD, *Kc = Qp + KC * KD;
    float *P = Kc + KC * KD, *gL = P + KC * KC;
    /* 1. keys, queries and decays into shared memory, transposed (rows past L: zeros): 16-byte
     *    loads, eight in flight a thread; a warp takes 8 rows x 4 pieces of 4 channels (64
     *    contiguous bytes a row from memory, at most two lanes to a bank in shared memory) */
    {
        constexpr int V4 = KD / 4, GROUPS = (KC / 8) * (V4 / 4), N4 = 3 * GROUPS * 32, B = 8;
        for (int base = tid; base < N4; base += 256 * B) {
            float4 r[B];
#pragma unroll
            for (int u = 0; u < B; u++) {
                const int i = base + u * 256, arr = i / (GROUPS * 32), gi = (i / 32) % GROUPS;
                const int lane = i % 32, t = (gi % (KC / 8)) * 8 + lane % 8;
                const int c4 = (gi / (KC / 8)) * 4 + lane / 8;
                const float *src = arr == 0 ? k : arr == 1 ? q : g;
                r[u] = i < N4 && t < L
                           ? __ldg((const float4 *)(src + (row0 + (size_t)t * H) * KD) + c4)
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int u = 0; u < B; u++) {
                const int i = base + u * 256, arr = i / (GROUPS * 32), gi = (i / 32) % GROUPS;
                const int lane = i % 32, t = (gi % (KC / 8)) * 8 + lane % 8;
                const int c4 = (gi / (KC / 8)) * 4 + lane / 8;
                if (i >= N4) break;
                float *dst = (arr == 0 ? Kt : arr == 1 ? Qt : Gt) + 4 * c4 * KPS + t;
                dst[0] = r[u].x, dst[KPS] = r[u].y, dst[2 * KPS] = r[u].z, dst[3 * KPS] = r[u].w;
            }
        }
        for (int t = tid; t < KC; t += 256) bs[t] = t < L ? beta[row0 + (size_t)t * H] : 0.0f;
    }
    __syncthreads();
    KDA_CLK_MARK(0); /* staged */
    if (tid < KD) {  /* running sums down each channel, in log2 units */
        float acc = 0.0f;
        for (int t = 0; t < KC; t++) {
            acc += Gt[tid * KPS + t];
            Gt[tid * KPS + t] = acc * LOG2E;
        }
    }
    __syncthreads();
    KDA_CLK_MARK(1); /* running sums */
    /* 2. A_ij = sum_c k_ic k_jc e^{G_ic - G_jc} (j < i) and P_ij = sum_c q_ic k_jc e^{..} (j <= i)
     *    in 4 x 4 tiles. Tiles below the diagonal (ti > tj, threads 0..119) factor the exponent
     *    through r = 4 ti, the tile's first row: e^{G_i - G_r} e^{G_r - G_j}, both <= 0 since
     *    j < r <= i (decays only shrink), so nothing overflows and the inner loop is 32 FMAs on
     *    8 exponentials. The 16 tiles on the diagonal (threads 128..255: a tile and a 1/8 of the
     *    channels each, summed by shuffles) take the exponent element by element. */
    float a[4][4] = {}, p[4][4] = {};
    int ti = 0, tj = 0;
    if (tid < 120) {
        kda_tile_pair(tid, ti, tj);
        const int r = 4 * ti;
#pragma unroll 2
        for (int c = 0; c < KD; c++) {
            const float4 gi = *(const float4 *)(Gt + c * KPS + r),
                         ki = *(const float4 *)(Kt + c * KPS + r),
                         qi = *(const float4 *)(Qt + c * KPS + r),
                         gj = *(const float4 *)(Gt + c * KPS + 4 * tj),
                         kj = *(const float4 *)(Kt + c * KPS + 4 * tj);
            const float gr = gi.x; /* row r's own: e^{G_r - G_r} = 1 */
            const float ei[4] = {1.0f, exp2f(gi.y - gr), exp2f(gi.z - gr), exp2f(gi.w - gr)};
            const float kr[4] = {ki.x * ei[0], ki.y * ei[1], ki.z * ei[2], ki.w * ei[3]};
            const float qr[4] = {qi.x * ei[0], qi.y * ei[1], qi.z * ei[2], qi.w * ei[3]};
            const float kl[4] = {kj.x * exp2f(gr - gj.x), kj.y * exp2f(gr - gj.y),
                                 kj.z * exp2f(gr - gj.z), kj.w * exp2f(gr - gj.w)};
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y < 4; y++) a[x][y] += kr[x] * kl[y], p[x][y] += qr[x] * kl[y];
        }
    } else if (tid >= 128) {
        constexpr int CPS = KD / 8; /* channels per slice */
        const int d = (tid - 128) >> 3, s = tid & 7, r = 4 * d;
        ti = tj = d;
#pragma unroll 2
        for (int c = s * CPS; c < (s + 1) * CPS; c++) {
            const float4 g4 = *(const float4 *)(Gt + c * KPS + r),
                         k4 = *(const float4 *)(Kt + c * KPS + r),
                         q4 = *(const float4 *)(Qt + c * KPS + r);
            const float gv[4] = {g4.x, g4.y, g4.z, g4.w}, kv[4] = {k4.x, k4.y, k4.z, k4.w},
                        qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
            for (int x = 0; x < 4; x++)
#pragma unroll
                for (int y = 0; y <= x; y++) {
                    const float e = kv[y] * exp2f(gv[x] - gv[y]);
                    if (y < x) a[x][y] += kv[x] * e;
                    p[x][y] += qv[x] * e;
                }
        }
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y <= x; y++)
#pragma unroll
                for (int m = 1; m < 8; m <<= 1) {
                    a[x][y] += __shfl_xor_sync(0xffffffffu, a[x][y], m);
                    p[x][y] += __shfl_xor_sync(0xffffffffu, p[x][y], m);
                }
    }
    /* a tile's owner stores it (a diagonal tile's eight lanes hold the same sums: the first) */
    const bool owner = tid < 120 || (tid >= 128 && (tid & 7) == 0);
    KDA_CLK_SYNC_MARK(2); /* A and P (a barrier of its own only when timed) */
    /* V's rows for the second half of the solve, requested now: on their way while P, Qp and Kc
     * are written (V is read nowhere else, so they come from memory) */
    float x[KC];
    if (tid >= KD && tid < 2 * KD)
#pragma unroll
        for (int i = 0; i < KC; i++)
            x[i] = i < L ? __ldg(v + (row0 + (size_t)i * H) * KD + tid - KD) : 0.0f;
    /* 3. P (zeros above the diagonal and past L), e^{G_L}, Qp = Q e^G and Kc = K e^{G_L - G} */
    if (owner)
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int i = 4 * ti + x, j = 4 * tj + y;
                if (j <= i) P[i * KC + j] = i < L ? p[x][y] : 0.0f;
            }
    for (int e = tid; e < KC * KC; e += 256)
        if (e % KC > e / KC) P[e] = 0.0f;
    if (tid < KD) gL[tid] = exp2f(Gt[tid * KPS + L - 1]);
    for (int i = tid; i < KC * KD; i += 256) {
        const int t = i / KD, c = i % KD;
        const float gt = Gt[c * KPS + t], gl = Gt[c * KPS + L - 1];
        Qp[i] = Qt[c * KPS + t] * exp2f(gt); /* zero past L: so is the staged query */
        Kc[i] = Kt[c * KPS + t] * exp2f(gl - gt);
    }
    __syncthreads(); /* the queries are read: A takes their place */
    KDA_CLK_MARK(3); /* P, Qp, Kc written */
    float *As = Qt;  /* [KC][KPS] */
    if (owner)
#pragma unroll
        for (int x = 0; x < 4; x++)
#pragma unroll
            for (int y = 0; y < 4; y++) {
                const int i = 4 * ti + x, j = 4 * tj + y;
                if (j < i) As[i * KPS + j] = bs[i] * a[x][y];
            }
    __syncthreads();
    KDA_CLK_MARK(4); /* A stored */
    /* 4. the solve: thread col < KD takes column col of diag(beta) K e^G (-> W), the others column
     *    col - KD of diag(beta) V (-> Ut); forward substitution down the 64 rows in registers. */
    if (tid < 2 * KD) {
        const int col = tid;
#pragma unroll
        for (int i = 0; i < KC; i++)
            x[i] = col < KD ? (i < L ? bs[i] * Kt[col * KPS + i] * exp2f(Gt[col * KPS + i]) : 0.0f)
                            : bs[i] * x[i]; /* (beta is 0 past L) */
#pragma unroll
        for (int i = 1; i < KC; i++) {
            float r = x[i];
#pragma unroll
            for (int j = 0; j < i; j++) r -= As[i * KPS + j] * x[j];
            x[i] = r;
        }
        float *dst = col < KD ? W + col : Ut + col - KD;
#pragma unroll
        for (int i = 0; i < KC; i++) dst[i * KD] = x[i];
    }
    KDA_CLK_SYNC_MARK(5); /* the solve */
}

/* State columns and threads per block: a thread's 2 x 4 U entries and 4 x 4 state entries reuse
 * each shared-memory load 8 and 16 times (512 threads halve that: shared memory is what the scan
 * waits on). */
enum { KS_BV = 32, KS_NT = 256 };

/* Pass 2's shared memory: two stages of a chunk's operands (W, Kc, Ut, e^{G_L}), then the state's
 * columns and U. The tensor-core form pads Kc, Ut, the state and U so that its fragment loads
 * (lanes 4 g + l4 reading rows l4 and columns g) fall on 32 different banks. */
template <int KD, bool TC> struct kda_scan_smem {
    static constexpr int WLD = KD + 4;                 /* W: a warp's 8 rows on 8 bank quads */
    static constexpr int KLD = TC ? KD + 8 : KD;       /* Kc */
    static constexpr int ULD = TC ? KS_BV + 8 : KS_BV; /* Ut, the state and U */
    static constexpr int STAGE = KC * WLD + KC * KLD + KC * ULD + KD;
    static constexpr size_t BYTES = ((size_t)2 * STAGE + KD * ULD + KC * ULD) * sizeof(float);
};

/* Chunk ci's operands (head h, columns [cg, cg + KS_BV)) into stage s of pass 2's shared memory,
 * every thread its share of 16-byte cp.async pieces (one commit group). */
template <int KD, bool TC>
__device__ __forceinline__ void kda_scan_stage(float *ssh, int s, const float *prep, int ci, int H,
                                               int h, int cg) {
    using SM = kda_scan_smem<KD, TC>;
    const float *pr = prep + ((size_t)ci * H + h) * kda_ch_floats(KD);
    float *W = ssh + s * SM::STAGE, *Kc = W + KC * SM::WLD, *Ut = Kc + KC * SM::KLD,
          *gL = Ut + KC * SM::ULD;
    /* W's and Kc's pieces interleaved: copied one matrix after the other (cp_async_rows twice),
     * the TF32 chunked KDA took 1.670 against 1.624 ms at 8192 tokens x 32 heads */
    for (int i = threadIdx.x; i < KC * KD / 4; i += KS_NT) {
        const int r = i / (KD / 4), c = (i % (KD / 4)) * 4;
        cp_async16(W + r * SM::WLD + c, pr + r * KD + c);
        cp_async16(Kc + r * SM::KLD + c, pr + 3 * KC * KD + r * KD + c);
    }
    cp_async_rows<KS_BV, KS_NT>(Ut, SM::ULD, pr + KC * KD + cg, KD, KC);
    for (int i = threadIdx.x; i < KD / 4; i += KS_NT)
        cp_async16(gL + 4 * i, pr + 4 * KC * KD + KC * KC + 4 * i);
    cp_async_commit();
}

/* Pass 2: block (head h, columns [BV cg, +BV), sequence z) walks z's chunks in order, keeping
 * only what is sequential: U = Ut - W S0 and the next state; it leaves each chunk's starting
 * state and U for pass 3. A chunk's W, Kc, Ut columns and e^{G_L} (75 KB, from memory: pass 1's
 * output is far larger than L2) are copied into shared memory with cp.async while the chunk
 * before is computed (two stages): the version that loaded them as it went spent ~12 us a chunk
 * waiting on memory for ~2 us of arithmetic. */
template <int KD>
__global__ void __launch_bounds__(KS_NT)
    kda_chunk_scan_k(float *states, float *ug, const float *prep, const kda_chunk *chunks,
                     const int *seg_chunk0, float *const *S, int H) {
    PDL_ENTRY();
    using SM = kda_scan_smem<KD, false>;
    /* U rows and state channels per thread (8 threads across the 32 columns) */
    constexpr int WLD = SM::WLD, RP = KC * 8 / KS_NT, NCH = KD * 8 / KS_NT;
    extern __shared__ float ssh[];
    float *Ss = ssh + 2 * SM::STAGE; /* [KD][KS_BV] the state's columns, as of this chunk */
    float *Us = Ss + KD * KS_BV;     /* [KC][KS_BV] this chunk's U */
    const int h = blockIdx.x, cg = blockIdx.y * KS_BV, z = blockIdx.z, tid = threadIdx.x;
    float *Sh = S[z] + (size_t)h * KD * KD;     /* [dk][dv] */
    const int q = tid / 8, col = (tid % 8) * 4; /* U: rows RP q..; state: channels NCH q.. */
    float st[NCH][4];                           /* state entries (channel NCH q + x, col + y) */
#pragma unroll
    for (int x = 0; x < NCH; x++) {
        const float4 s4 = *(const float4 *)(Sh + (size_t)(NCH * q + x) * KD + cg + col);
        st[x][0] = s4.x, st[x][1] = s4.y, st[x][2] = s4.z, st[x][3] = s4.w;
        *(float4 *)(Ss + (NCH * q + x) * KS_BV + col) = s4;
    }
    const int c0 = seg_chunk0[z], c1 = seg_chunk0[z + 1];
    if (c0 < c1) kda_scan_stage<KD, false>(ssh, 0, prep, c0, H, h, cg);
    for (int ci = c0; ci < c1; ci++) {
        const int s = (ci - c0) & 1;
        const float *W = ssh + s * SM::STAGE, *Kc = W + KC * WLD, *Ut = Kc + KC * KD;
        const float *gL = Ut + KC * KS_BV;
        cp_async_wait_all();
        __syncthreads(); /* stage s has landed for all; everyone is done with the last chunk */
        if (ci + 1 < c1) kda_scan_stage<KD, false>(ssh, s ^ 1, prep, ci + 1, H, h, cg);
        float *sg = states + ((size_t)ci * H + h) * KD * KD; /* the state this chunk starts from */
#pragma unroll
        for (int x = 0; x < NCH; x++)
            *(float4 *)(sg + (size_t)(NCH * q + x) * KD + cg + col) =
                make_float4(st[x][0], st[x][1], st[x][2], st[x][3]);
        { /* U = Ut - W S0: rows RP q .., columns col .. col+3 */
            float u[RP][4] = {};
#pragma unroll 4
            for (int c = 0; c < KD; c += 4) {
                float wa[RP][4];
#pragma unroll
                for (int r = 0; r < RP; r++) {
                    const float4 w4 = *(const float4 *)(W + (RP * q + r) * WLD + c);
                    wa[r][0] = w4.x, wa[r][1] = w4.y, wa[r][2] = w4.z, wa[r][3] = w4.w;
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float4 s4 = *(const float4 *)(Ss + (c + e) * KS_BV + col);
#pragma unroll
                    for (int r = 0; r < RP; r++) {
                        u[r][0] += wa[r][e] * s4.x, u[r][1] += wa[r][e] * s4.y;
                        u[r][2] += wa[r][e] * s4.z, u[r][3] += wa[r][e] * s4.w;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < RP; r++) {
                const int row = RP * q + r;
                const float4 t4 = *(const float4 *)(Ut + row * KS_BV + col);
                const float4 uv =
                    make_float4(t4.x - u[r][0], t4.y - u[r][1], t4.z - u[r][2], t4.w - u[r][3]);
                *(float4 *)(Us + row * KS_BV + col) = uv;
                *(float4 *)(ug + ((size_t)ci * H + h) * KC * KD + (size_t)row * KD + cg + col) = uv;
            }
        }
        __syncthreads(); /* U is whole; every read of Ss is done */
        { /* S0 <- e^{G_L} S0 + Kc^T U (rows past the chunk's length are zeros in Kc and U) */
#pragma unroll
            for (int x = 0; x < NCH; x++) {
                const float gl = gL[NCH * q + x];
#pragma unroll
                for (int y = 0; y < 4; y++) st[x][y] *= gl;
            }
#pragma unroll 8
            for (int i = 0; i < KC; i++) {
                const float4 u4 = *(const float4 *)(Us + i * KS_BV + col);
#pragma unroll
                for (int x = 0; x < NCH; x++) {
                    const float kv = Kc[i * KD + NCH * q + x];
                    st[x][0] += kv * u4.x, st[x][1] += kv * u4.y;
                    st[x][2] += kv * u4.z, st[x][3] += kv * u4.w;
                }
            }
#pragma unroll
            for (int x = 0; x < NCH; x++)
                *(float4 *)(Ss + (NCH * q + x) * KS_BV + col) =
                    make_float4(st[x][0], st[x][1], st[x][2], st[x][3]);
        }
    }
#pragma unroll
    for (int x = 0; x < NCH; x++)
        *(float4 *)(Sh + (size_t)(NCH * q + x) * KD + cg + col) =
            make_float4(st[x][0], st[x][1], st[x][2], st[x][3]);
}

/* Pass 3: block (chunk, head) computes O = Qp S0 + P U for its tokens, every chunk at once: a
 * thread takes ROWS rows and 4 columns; S0 and U rows are read by every warp (L1 serves them),
 * Qp and P rows are the same across a warp's lanes (broadcast). */
template <int KD>
__global__ void __launch_bounds__(256)
    kda_chunk_out_k(float *o, const float *states, const float *ug, const float *prep,
                    const kda_chunk *chunks, int H) {
    PDL_ENTRY();
    constexpr int LANES = KD / 4;          /* threads across the columns */
    constexpr int ROWS = KC * LANES / 256; /* rows per thread: 8 (KD 128) or 4 (KD 64) */
    const kda_chunk ch = chunks[blockIdx.x];
    const int h = blockIdx.y, tid = threadIdx.x;
    const int r0 = (tid / LANES) * ROWS, col = (tid % LANES) * 4;
    const size_t at = (size_t)blockIdx.x * H + h;
    const float *pr = prep + at * kda_ch_floats(KD);
    const float *Qp = pr + 2 * KC * KD, *P = pr + 4 * KC * KD;
    const float *S0 = states + at * KD * KD, *U = ug + at * KC * KD;
    if (r0 >= ch.len) return;
    float acc[ROWS][4];
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
        for (int y = 0; y < 4; y++) acc[r][y] = 0.0f;
#pragma unroll 8
    for (int c = 0; c < KD; c++) {
        const float4 sv = __ldg((const float4 *)(S0 + (size_t)c * KD + col));
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float qv = __ldg(Qp + (r0 + r) * KD + c);
            acc[r][0] += qv * sv.x, acc[r][1] += qv * sv.y;
            acc[r][2] += qv * sv.z, acc[r][3] += qv * sv.w;
        }
    }
    const int i_end = min(ch.len, r0 + ROWS); /* P is lower triangular: i <= t */
    for (int i = 0; i < i_end; i++) {
        const float4 uv = __ldg((const float4 *)(U + (size_t)i * KD + col));
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            const float pv = __ldg(P + (r0 + r) * KC + i); /* zero where i > t */
            acc[r][0] += pv * uv.x, acc[r][1] += pv * uv.y;
            acc[r][2] += pv * uv.z, acc[r][3] += pv * uv.w;
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        const int t = r0 + r;
        if (t >= ch.len) break;
        *(float4 *)(o + ((size_t)(ch.t0 + t) * H + h) * KD + col) =
            make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    }
}

/* Pass 3 on TF32 tensor cores (ds_cu_set_kda_tc: 1, or 3 with the operands split, the model's
 * default): the same two products, O = Qp S0 + P U, as mma.sync m16n8k8 with f32 accumulation, the
 * operands rounded to TF32 (10-bit mantissa: ~1e-3 relative error instead of f32's 1e-7). Block
 * (chunk, head), 8 warps: rows 16 (w mod 4) + [0, 16), half the columns each. S0 and U (the B
 * operands, read by every warp) are copied into shared memory once with cp.async, padded so that a
 * fragment's loads fall on 32 banks; Qp and P rows (A, one warp's own) come straight from memory.
 * Rows past the chunk's length are zeros in Qp, P and U (passes 1 and 2 write them so), so no
 * operand needs a mask; only the stores do. Fragment layouts as the PTX ISA gives them for m16n8k8
 * TF32: lane = 4 g + l4 holds A's (g, l4), (g + 8, l4), (g, l4 + 4), (g + 8, l4 + 4); B's (l4, g),
 * (l4 + 4, g); C's (g, 2 l4 (+1)) and (g + 8, 2 l4 (+1)). */
__device__ __forceinline__ uint32_t to_tf32(float x) {
    uint32_t r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 3xTF32 (PREC 3): x = hi + lo, both TF32, and a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi: about
 * f32's accuracy on tensor cores (the a_lo b_lo term, ~2^-22 relative, is left out). PREC 1 is
 * plain TF32. An A fragment is split once and serves every column tile. */
__device__ __forceinline__ void tf32_split(float x, uint32_t &hi, uint32_t &lo) {
    hi = to_tf32(x);
    lo = to_tf32(x - __uint_as_float(hi));
}

template <int PREC> struct tf32_a {
    uint32_t hi[4], lo[4]; /* lo unused at PREC 1 */
    __device__ __forceinline__ tf32_a(float a0, float a1, float a2, float a3) {
        const float a[4] = {a0, a1, a2, a3};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if constexpr (PREC == 3)
                tf32_split(a[i], hi[i], lo[i]);
            else
                hi[i] = to_tf32(a[i]);
        }
    }
};

template <int PREC>
__device__ __forceinline__ void mma_tf32x(float (&d)[4], const tf32_a<PREC> &a, float b0,
                                          float b1) {
    if constexpr (PREC == 3) {
        uint32_t h0, l0, h1, l1;
        tf32_split(b0, h0, l0);
        tf32_split(b1, h1, l1);
        mma_tf32(d, a.lo, h0, h1); /* the small terms first */
        mma_tf32(d, a.hi, l0, l1);
        mma_tf32(d, a.hi, h0, h1);
    } else {
        mma_tf32(d, a.hi, to_tf32(b0), to_tf32(b1));
    }
}

/* One k-step of 8 for a warp's 16 rows and NT 8-column tiles: acc += A B with A row-major in
 * global memory (a: this lane's A(g, l4), rows lda apart) and B row-major in shared memory (b:
 * this lane's B(l4, g), rows ldb apart, tiles 8 columns apart). */
template <int NT, int PREC>
__device__ __forceinline__ void tf32_kstep(float (&acc)[NT][4], const float *a, int lda,
                                           const float *b, int ldb) {
    const tf32_a<PREC> af(__ldg(a), __ldg(a + 8 * lda), __ldg(a + 4), __ldg(a + 8 * lda + 4));
#pragma unroll
    for (int n = 0; n < NT; n++) mma_tf32x<PREC>(acc[n], af, b[n * 8], b[4 * ldb + n * 8]);
}

/* pass 3's shared memory on tensor cores: S0 [KD][KD + 8] and U [KC][KD + 8] */
template <int KD> constexpr size_t kda_out_tc_smem() {
    return (size_t)(KD + KC) * (KD + 8) * sizeof(float);
}

template <int KD, int PREC>
__global__ void __launch_bounds__(256)
    kda_chunk_out_tc_k(float *o, const float *states, const float *ug, const float *prep,
                       const kda_chunk *chunks, int H) {
    PDL_ENTRY();
    constexpr int BLD = KD + 8; /* S0 and U rows in shared memory */
    constexpr int NT = KD / 16; /* 8-column tiles a warp holds (half the columns) */
    extern __shared__ float osh[];
    float *S0s = osh;           /* [KD][BLD] */
    float *Us = S0s + KD * BLD; /* [KC][BLD] */
    const kda_chunk ch = chunks[blockIdx.x];
    const int h = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, l4 = lane & 3, r0 = 16 * (warp & 3), c0 = (KD / 2) * (warp >> 2);
    const size_t at = (size_t)blockIdx.x * H + h;
    const float *pr = prep + at * kda_ch_floats(KD);
    const float *Qp = pr + 2 * KC * KD, *P = pr + 4 * KC * KD;
    const float *S0 = states + at * KD * KD, *U = ug + at * KC * KD;
    cp_async_rows<KD, 256>(S0s, BLD, S0, KD, KD);
    cp_async_rows<KD, 256>(Us, BLD, U, KD, KC);
    cp_async_commit();
    cp_async_wait_all();
    __syncthreads();
    if (r0 >= ch.len) return; /* (no block barrier follows) */
    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
        /* Qp S0: k over the KD key channels */
#pragma unroll 4
    for (int k0 = 0; k0 < KD; k0 += 8)
        tf32_kstep<NT, PREC>(acc, Qp + (size_t)(r0 + g) * KD + k0 + l4, KD,
                             S0s + (k0 + l4) * BLD + c0 + g, BLD);
    /* P U: k over the chunk's tokens, up to this warp's last row (P is lower triangular) */
    for (int k0 = 0; k0 < r0 + 16; k0 += 8)
        tf32_kstep<NT, PREC>(acc, P + (size_t)(r0 + g) * KC + k0 + l4, KC,
                             Us + (k0 + l4) * BLD + c0 + g, BLD);
    const int t0 = r0 + g, t1 = t0 + 8;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const int col = c0 + n * 8 + 2 * l4;
        if (t0 < ch.len)
            *(float2 *)(o + ((size_t)(ch.t0 + t0) * H + h) * KD + col) =
                make_float2(acc[n][0], acc[n][1]);
        if (t1 < ch.len)
            *(float2 *)(o + ((size_t)(ch.t0 + t1) * H + h) * KD + col) =
                make_float2(acc[n][2], acc[n][3]);
    }
}

/* Pass 2 on TF32 tensor cores (with ds_cu_set_kda_tc): the same walk and staging, both products
 * as mma.sync m16n8k8 with f32 accumulation (the operands rounded to TF32). The state stays in
 * the accumulators of the second product: warp w holds channels 16 (w mod M2) + [0, 16) of
 * N2 8-column tiles, M2 = KD / 16 tiles of channels. */
template <int KD, int PREC>
__global__ void __launch_bounds__(KS_NT)
    kda_chunk_scan_tc_k(float *states, float *ug, const float *prep, const kda_chunk *chunks,
                        const int *seg_chunk0, float *const *S, int H) {
    PDL_ENTRY();
    using SM = kda_scan_smem<KD, true>;
    constexpr int WLD = SM::WLD, KLD = SM::KLD, ULD = SM::ULD;
    constexpr int M2 = KD / 16, N2 = 4 * M2 / 8; /* channel tiles; column tiles a warp holds */
    extern __shared__ float ssh[];
    float *Ss = ssh + 2 * SM::STAGE; /* [KD][ULD] the state's columns, as of this chunk */
    float *Us = Ss + KD * ULD;       /* [KC][ULD] this chunk's U */
    const int h = blockIdx.x, cg = blockIdx.y * KS_BV, z = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, l4 = lane & 3;
    float *Sh = S[z] + (size_t)h * KD * KD; /* [dk][dv] */
    /* second product's tile: channels m2 + g (+ 8), columns n2 + 8 n + 2 l4 (+ 1) */
    const int m2 = 16 * (warp % M2), n2 = 8 * N2 * (warp / M2);
    /* first product's tile: U rows m1 + g (+ 8), columns n1 + 8 n + 2 l4 (+ 1), n < 2 */
    const int m1 = 16 * (warp & 3), n1 = 16 * (warp >> 2);
    float st[N2][4];
#pragma unroll
    for (int n = 0; n < N2; n++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int ch = m2 + g + 8 * hh, cl = n2 + 8 * n + 2 * l4;
            const float2 v2 = *(const float2 *)(Sh + (size_t)ch * KD + cg + cl);
            st[n][2 * hh] = v2.x, st[n][2 * hh + 1] = v2.y;
            *(float2 *)(Ss + ch * ULD + cl) = v2;
        }
    const int c0 = seg_chunk0[z], c1 = seg_chunk0[z + 1];
    if (c0 < c1) kda_scan_stage<KD, true>(ssh, 0, prep, c0, H, h, cg);
    for (int ci = c0; ci < c1; ci++) {
        const int s = (ci - c0) & 1;
        const float *W = ssh + s * SM::STAGE, *Kc = W + KC * WLD, *Ut = Kc + KC * KLD;
        const float *gL = Ut + KC * ULD;
        cp_async_wait_all();
        __syncthreads(); /* stage s has landed for all; everyone is done with the last chunk */
        if (ci + 1 < c1) kda_scan_stage<KD, true>(ssh, s ^ 1, prep, ci + 1, H, h, cg);
        float *sg = states + ((size_t)ci * H + h) * KD * KD; /* the state this chunk starts from */
#pragma unroll
        for (int n = 0; n < N2; n++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
                *(float2 *)(sg + (size_t)(m2 + g + 8 * hh) * KD + cg + n2 + 8 * n + 2 * l4) =
                    make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
        { /* U = Ut - W S0 */
            float acc[2][4] = {};
#pragma unroll 4
            for (int k0 = 0; k0 < KD; k0 += 8) {
                const float *wa = W + (m1 + g) * WLD + k0 + l4;
                const tf32_a<PREC> af(wa[0], wa[8 * WLD], wa[4], wa[8 * WLD + 4]);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    const float *sb = Ss + (k0 + l4) * ULD + n1 + 8 * n + g;
                    mma_tf32x<PREC>(acc[n], af, sb[0], sb[4 * ULD]);
                }
            }
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = m1 + g + 8 * hh, cl = n1 + 8 * n + 2 * l4;
                    const float2 t2 = *(const float2 *)(Ut + row * ULD + cl);
                    const float2 u2 = make_float2(t2.x - acc[n][2 * hh], t2.y - acc[n][2 * hh + 1]);
                    *(float2 *)(Us + row * ULD + cl) = u2;
                    *(float2 *)(ug + ((size_t)ci * H + h) * KC * KD + (size_t)row * KD + cg + cl) =
                        u2;
                }
        }
        __syncthreads(); /* U is whole; every read of Ss is done */
        { /* S0 <- e^{G_L} S0 + Kc^T U (rows past the chunk's length are zeros in Kc and U) */
            const float gl0 = gL[m2 + g], gl1 = gL[m2 + g + 8];
#pragma unroll
            for (int n = 0; n < N2; n++)
                st[n][0] *= gl0, st[n][1] *= gl0, st[n][2] *= gl1, st[n][3] *= gl1;
#pragma unroll 2
            for (int k0 = 0; k0 < KC; k0 += 8) {
                const float *ka = Kc + (k0 + l4) * KLD + m2 + g; /* A = Kc^T: A(m, k) = Kc(k, m) */
                const tf32_a<PREC> af(ka[0], ka[8], ka[4 * KLD], ka[4 * KLD + 8]);
#pragma unroll
                for (int n = 0; n < N2; n++) {
                    const float *ub = Us + (k0 + l4) * ULD + n2 + 8 * n + g;
                    mma_tf32x<PREC>(st[n], af, ub[0], ub[4 * ULD]);
                }
            }
#pragma unroll
            for (int n = 0; n < N2; n++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++)
                    *(float2 *)(Ss + (m2 + g + 8 * hh) * ULD + n2 + 8 * n + 2 * l4) =
                        make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
        }
    }
#pragma unroll
    for (int n = 0; n < N2; n++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            *(float2 *)(Sh + (size_t)(m2 + g + 8 * hh) * KD + cg + n2 + 8 * n + 2 * l4) =
                make_float2(st[n][2 * hh], st[n][2 * hh + 1]);
}

extern "C" void ds_cu_set_conv_fixed(ds_cu *c, int on) {
    c->conv_fixed = on;
}

extern "C" void ds_cu_set_gemv_wide(ds_cu *c, int on) {
    c->gemv_wide = on;
}

extern "C" void ds_cu_set_early_experts(ds_cu *c, int on) {
    c->early_experts = on;
}

extern "C" void ds_cu_set_wide_early(ds_cu *c, int on) {
    c->wide_early = on;
}

extern "C" void ds_cu_set_kda_tc(ds_cu *c, int mode) {
    c->kda_tc = mode == 3 ? 3 : mode > 0 ? 1 : 0;
}

extern "C" int ds_cu_kda_chunked_supports(int dk, int dv) {
    return dk == dv && (dk == 64 || dk == 128);
}

/* the tensor-core passes' shared memory above the default 48 KB */
template <int KD, int PREC> static cudaError_t kda_tc_attrs() {
    cudaError_t e = cudaFuncSetAttribute(kda_chunk_out_tc_k<KD, PREC>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)kda_out_tc_smem<KD>());
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(kda_chunk_scan_tc_k<KD, PREC>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)kda_scan_smem<KD, true>::BYTES);
    return e;
}

template <int KD>
static int kda_chunked_run(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                           const float *g, const float *beta, const kda_chunk *tab,
                           const int *first, float *prep, float *states, float *ug, int n_ch,
                           float *const *S, int n_seq, int H, ds_err *err) {
    const size_t smem1 = kda_prep_smem<KD>();
    static int smem_set; /* once per head size; chunked steps are never captured */
    if (!smem_set) {
        CU_TRY(cudaFuncSetAttribute(kda_chunk_prep_k<KD>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1),
               "chunked kda: shared memory");
        CU_TRY(cudaFuncSetAttribute(kda_chunk_scan_k<KD>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    (int)kda_scan_smem<KD, false>::BYTES),
               "chunked kda: shared memory");
        CU_TRY((kda_tc_attrs<KD, 1>()), "chunked kda: shared memory");
        CU_TRY((kda_tc_attrs<KD, 3>()), "chunked kda: shared memory");
        smem_set = 1;
    }
    ds_cu_prof_mark(c, "kda chunks: prepare");
    launch_k(c, kda_chunk_prep_k<KD>, dim3((unsigned)n_ch, (unsigned)H), 256, smem1, prep, q, k, v,
             g, beta, tab, H);
    CU_TRY(cudaGetLastError(), "chunked kda (prepare)");
    ds_cu_prof_mark(c, "kda chunks: scan");
    const dim3 sgrid((unsigned)H, KD / KS_BV, (unsigned)n_seq), ogrid((unsigned)n_ch, (unsigned)H);
    if (c->kda_tc == 3)
        launch_k(c, kda_chunk_scan_tc_k<KD, 3>, sgrid, KS_NT, kda_scan_smem<KD, true>::BYTES,
                 states, ug, prep, tab, first, S, H);
    else if (c->kda_tc)
        launch_k(c, kda_chunk_scan_tc_k<KD, 1>, sgrid, KS_NT, kda_scan_smem<KD, true>::BYTES,
                 states, ug, prep, tab, first, S, H);
    else
        launch_k(c, kda_chunk_scan_k<KD>, dim3((unsigned)H, KD / KS_BV, (unsigned)n_seq), KS_NT,
                 kda_scan_smem<KD, false>::BYTES, states, ug, prep, tab, first, S, H);
    CU_TRY(cudaGetLastError(), "chunked kda (scan)");
    ds_cu_prof_mark(c, "kda chunks: outputs");
    if (c->kda_tc == 3)
        launch_k(c, kda_chunk_out_tc_k<KD, 3>, ogrid, 256, kda_out_tc_smem<KD>(), o, states, ug,
                 prep, tab, H);
    else if (c->kda_tc)
        launch_k(c, kda_chunk_out_tc_k<KD, 1>, ogrid, 256, kda_out_tc_smem<KD>(), o, states, ug,
                 prep, tab, H);
    else
        launch_k(c, kda_chunk_out_k<KD>, dim3((unsigned)n_ch, (unsigned)H), 256, 0, o, states, ug,
                 prep, tab, H);
    CU_TRY(cudaGetLastError(), "chunked kda (outputs)");
    return DS_OK;
}

extern "C" int ds_cu_kda_chunked(ds_cu *c, float *o, const float *q, const float *k, const float *v,
                                 const float *g, const float *beta, const int *seg_start,
                                 const int *seg_len, float *const *S, int n_seq, int H, int dk,
                                 int dv, ds_err *err) {
    if (!ds_cu_kda_chunked_supports(dk, dv))
        return ds_errf(err, "cuda: chunked kda: head dims %d x %d (64 or 128, square)", dk, dv);
    if (n_seq <= 0 || H <= 0) return DS_OK;
    if (capturing(c)) return ds_errf(err, "cuda: chunked kda cannot run inside a graph capture");
    int n_ch = 0;
    for (int z = 0; z < n_seq; z++) n_ch += (seg_len[z] + KC - 1) / KC;
    if (!n_ch) return DS_OK;
    /* the chunk table and each sequence's first chunk (a sequence with no tokens has none):
     * built here, uploaded with the step */
    const size_t tab_bytes = (size_t)n_ch * sizeof(kda_chunk), c0_bytes = (n_seq + 1) * sizeof(int);
    /* prep [n_ch][H][kda_ch_floats] | table [n_ch] then first [n_seq + 1] | states at the chunks'
     * starts [n_ch][H][dk][dv] | U [n_ch][H][KC][dv] */
    const size_t sz[4] = {(size_t)n_ch * H * kda_ch_floats(dk) * sizeof(float),
                          tab_bytes + c0_bytes, (size_t)n_ch * H * dk * dv * sizeof(float),
                          (size_t)n_ch * H * KC * dv * sizeof(float)};
    void *b[4];
    const void *was = c->kdac;
    const size_t was_bytes = c->kdac_bytes;
    if (carve_scratch(&c->kdac, &c->kdac_bytes, sz, b, 4, "chunked kda scratch", err))
        return DS_ERR;
    if (c->kdac != was || c->kdac_bytes != was_bytes) c->kda_tab_dev = NULL; /* moved: stale */
    /* host: [0, nb) the table last uploaded, [nb, 2 nb) this call's */
    const size_t nb = tab_bytes + c0_bytes;
    if (c->h_kda_bytes < 2 * nb) {
        void *p = realloc(c->h_kda, 2 * nb);
        if (!p) return ds_errf(err, "cuda: out of host memory");
        c->h_kda = p;
        c->h_kda_bytes = 2 * nb;
    }
    kda_chunk *tab = (kda_chunk *)((char *)c->h_kda + nb);
    int *first = (int *)((char *)c->h_kda + nb + tab_bytes);
    int at = 0;
    for (int z = 0; z < n_seq; z++) {
        first[z] = at;
        for (int t = 0; t < seg_len[z]; t += KC)
            tab[at++] = kda_chunk{seg_start[z] + t, DS_MIN(KC, seg_len[z] - t), z};
    }
    first[n_seq] = at;
    /* A step's KDA layers share one table: uploaded (and waited for, since the host copy is
     * rewritten by the next call) only when it differs from the one on the device — once per
     * step instead of once per layer. */
    if (c->kda_tab_dev != b[1] || c->kda_tab_bytes != nb || memcmp(c->h_kda, tab, nb)) {
        memcpy(c->h_kda, tab, nb);
        c->kda_tab_dev = NULL; /* until the copy below has landed */
        CU_TRY(cudaMemcpyAsync(b[1], c->h_kda, nb, cudaMemcpyHostToDevice, c->stream),
               "kda chunk table");
        CU_TRY(cudaStreamSynchronize(c->stream), "kda chunk table");
        c->kda_tab_dev = b[1], c->kda_tab_bytes = nb;
    }
    const kda_chunk *dtab = (const kda_chunk *)b[1];
    const int *dfirst = (const int *)((const char *)b[1] + tab_bytes);
    float *prep = (float *)b[0], *states = (float *)b[2], *ug = (float *)b[3];
    if (dk == 64)
        return kda_chunked_run<64>(c, o, q, k, v, g, beta, dtab, dfirst, prep, states, ug, n_ch, S,
                                   n_seq, H, err);
    return kda_chunked_run<128>(c, o, q, k, v, g, beta, dtab, dfirst, prep, states, ug, n_ch, S,
                                n_seq, H, err);
}

/* The two ceilings every GPU figure is reported against, measured now: the device-to-device copy
 * rate (bytes read + written, 1 GiB buffers, median of 10) and cuBLAS's BF16 GEMM rate (8192^3,
 * median of 5). */
extern "C" int ds_cu_measure_limits(ds_cu *c, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    const size_t cb = (size_t)1 << 30;
    const int n = 8192;
    void *a = NULL, *b = NULL;
    float times[10];
    CU_TRY(cudaMalloc(&a, cb), "limits");
    if (cudaMalloc(&b, cb) != cudaSuccess) {
        cudaFree(a);
        return ds_errf(err, "cuda: limits: cannot allocate 2 GiB");
    }
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    cudaMemsetAsync(a, 0x3c, cb, c->stream);
    cudaMemsetAsync(b, 0, cb, c->stream);
    for (int i = 0; i < 12; i++) {
        cudaEventRecord(e0, c->stream);
        cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, c->stream);
        cudaEventRecord(e1, c->stream);
        cudaEventSynchronize(e1);
        if (i >= 2) cudaEventElapsedTime(&times[i - 2], e0, e1);
    }
    qsort(times, 10, sizeof(float), [](const void *x, const void *y) {
        float u = *(const float *)x, v = *(const float *)y;
        return (u > v) - (u < v);
    });
    *copy_gbs = 2.0 * (double)cb / (times[5] * 1e-3) / 1e9;
    /* the GEMM reuses the two buffers: A, B [n][n] BF16 (128 MiB each), C in the rest of b.
     * Random operands, as a model's are: on a constant fill (the copy's) the tensor cores draw
     * less power and this H200 ran 885 TFLOP/s against 806 on random data. */
    uint16_t *A = (uint16_t *)a, *B = (uint16_t *)a + (size_t)n * n, *C = (uint16_t *)b;
    int rc = ds_cu_fill_random_bf16(c, A, 2 * (size_t)n, n, 0x6c696d697473ull, 0, 0, n, 1.0f, err);
    for (int i = 0; i < 7 && rc == DS_OK; i++) {
        cudaEventRecord(e0, c->stream);
        rc = ds_cu_gemm_bf16(c, C, A, B, n, n, n, err);
        cudaEventRecord(e1, c->stream);
        cudaEventSynchronize(e1);
        if (i >= 2) cudaEventElapsedTime(&times[i - 2], e0, e1);
    }
    if (rc == DS_OK) {
        qsort(times, 5, sizeof(float), [](const void *x, const void *y) {
            float u = *(const float *)x, v = *(const float *)y;
            return (u > v) - (u < v);
        });
        *gemm_tflops = 2.0 * n * (double)n * n / (times[2] * 1e-3) / 1e12;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    if (rc) return rc;
    CU_TRY(cudaGetLastError(), "limits");
    return DS_OK;
}

/* ---- CUDA graphs -------------------------------------------------------------------------------
 * A step's launches captured once and replayed: one launch instead of hundreds. */
struct ds_cu_graph {
    cudaGraphExec_t exec;
};

extern "C" uint64_t ds_cu_epoch(ds_cu *c) {
    if (g_epoch_bump) c->epoch++, g_epoch_bump = 0;
    return c->epoch;
}

extern "C" int ds_cu_capture_begin(ds_cu *c, ds_err *err) {
    CU_TRY(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal), "graph capture");
    return DS_OK;
}

extern "C" int ds_cu_capture_end(ds_cu *c, ds_cu_graph **out, ds_err *err) {
    *out = NULL;
    cudaGraph_t g = NULL;
    if (c->on_side) side_swap(c);               /* (an error path left it there) */
    if (ds_cu_side_join(c, err)) return DS_ERR; /* the side stream rejoins the capture */
    cudaError_t e = cudaStreamEndCapture(c->stream, &g);
    if (e != cudaSuccess) {
        if (g) cudaGraphDestroy(g);
        cudaGetLastError();
        return ds_errf(err, "cuda: graph capture: %s", cudaGetErrorString(e));
    }
    ds_cu_graph *gr = (ds_cu_graph *)calloc(1, sizeof *gr);
    if (!gr) {
        cudaGraphDestroy(g);
        return ds_errf(err, "cuda: out of host memory");
    }
    e = cudaGraphInstantiate(&gr->exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        free(gr);
        cudaGetLastError();
        return ds_errf(err, "cuda: graph instantiate: %s", cudaGetErrorString(e));
    }
    *out = gr;
    return DS_OK;
}

extern "C" int ds_cu_graph_launch(ds_cu *c, ds_cu_graph *g, ds_err *err) {
    CU_TRY(cudaGraphLaunch(g->exec, c->stream), "graph launch");
    return DS_OK;
}

extern "C" void ds_cu_graph_free(ds_cu_graph *g) {
    if (!g) return;
    cudaGraphExecDestroy(g->exec);
    free(g);
}

/* ---- timing ------------------------------------------------------------------------------------
 */

struct ds_cu_timer {
    cudaEvent_t a, b;
};

extern "C" ds_cu_timer *ds_cu_timer_start(ds_cu *c) {
    ds_cu_timer *t = (ds_cu_timer *)calloc(1, sizeof *t);
    if (!t) return NULL;
    cudaEventCreate(&t->a);
    cudaEventCreate(&t->b);
    cudaEventRecord(t->a, c->stream);
    return t;
}

extern "C" double ds_cu_timer_stop(ds_cu *c, ds_cu_timer *t) {
    if (!t) return -1.0;
    cudaEventRecord(t->b, c->stream);
    cudaEventSynchronize(t->b);
    float ms = -1.0f;
    cudaEventElapsedTime(&ms, t->a, t->b);
    cudaEventDestroy(t->a);
    cudaEventDestroy(t->b);
    free(t);
    return ms;
}

/* ---- per-op profile ------------------------------------------------------------------------- */
enum { PROF_EVENTS = 8192, PROF_LABELS = 96 };
struct cu_prof {
    cudaEvent_t ev[PROF_EVENTS + 1]; /* a step's marks, then the step's end */
    const char *at[PROF_EVENTS];     /* [n] the label each mark opened */
    int n;
    const char *label[PROF_LABELS]; /* [n_labels] distinct labels, first-seen order */
    double ms[PROF_LABELS];         /* [n_labels] device time summed over steps */
    long count[PROF_LABELS];        /* [n_labels] intervals summed */
    int n_labels, steps, dropped;
    const char *cur;   /* the label of the interval open now (NULL before a step's first mark) */
    double step_flops; /* the FLOPs of this step's weight GEMMs so far (prof_gemm_close) */
    double gemm_flops; /* ... summed over the steps since the last report */
};

/* Every weight GEMM that cuBLAS runs is timed under this label of its own (the caller's label
 * resumes after it), so that a profile can say how fast the GEMMs themselves ran. */
static const char PROF_GEMM[] = "cuBLAS weight GEMMs";

static void prof_clear(cu_prof *p) { /* the sums start over; a step's pending marks stay */
    memset(p->ms, 0, sizeof p->ms);
    memset(p->count, 0, sizeof p->count);
    p->n_labels = p->steps = p->dropped = 0;
    p->gemm_flops = 0;
}

extern "C" void ds_cu_prof_enable(ds_cu *c, int on) {
    if (on && !c->prof) {
        cu_prof *p = (cu_prof *)calloc(1, sizeof *p);
        if (!p) return; /* a profile is best effort: no memory, no profile */
        for (int i = 0; i <= PROF_EVENTS; i++)
            if (cudaEventCreate(&p->ev[i]) != cudaSuccess) {
                for (int j = 0; j < i; j++) cudaEventDestroy(p->ev[j]);
                cudaGetLastError();
                free(p);
                return;
            }
        c->prof = p;
    } else if (!on && c->prof) {
        for (int i = 0; i <= PROF_EVENTS; i++) cudaEventDestroy(c->prof->ev[i]);
        free(c->prof);
        c->prof = NULL;
    }
}

extern "C" int ds_cu_set_skip(ds_cu *c, const char *labels, ds_err *err) {
    free(c->skip);
    c->skip = NULL;
    c->skipping = 0;
    if (!labels || !*labels) return DS_OK;
    if (!(c->skip = strdup(labels))) return ds_errf(err, "cuda: out of host memory");
    return DS_OK;
}

/* Is label one of the ';'-separated names in list? */
static int label_listed(const char *list, const char *label) {
    const size_t n = strlen(label);
    for (const char *at = list; at && *at;) {
        const char *end = strchr(at, ';');
        const size_t len = end ? (size_t)(end - at) : strlen(at);
        if (len == n && !strncmp(at, label, n)) return 1;
        at = end ? end + 1 : NULL;
    }
    return 0;
}

/* Opens an interval under label (no what-if bookkeeping: see ds_cu_prof_mark). */
static void prof_open(ds_cu *c, const char *label) {
    cu_prof *p = c->prof;
    if (!p || capturing(c)) return;
    if (p->n == PROF_EVENTS) { /* the step's remaining time goes to its last label */
        p->dropped++;
        return;
    }
    if (cudaEventRecord(p->ev[p->n], c->stream) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    p->at[p->n++] = p->cur = label;
}

extern "C" void ds_cu_prof_mark(ds_cu *c, const char *label) {
    if (c->skip) c->skipping = label_listed(c->skip, label);
    prof_open(c, label);
}

/* A weight GEMM's interval: prof_gemm_open before the cuBLAS call returns the caller's label,
 * prof_gemm_close after it reopens that label and counts the call's FLOPs. The what-if's skip
 * state is the caller's throughout (cuBLAS calls are never left out anyway). */
static const char *prof_gemm_open(ds_cu *c) {
    cu_prof *p = c->prof;
    if (!p || capturing(c)) return NULL;
    const char *prev = p->cur ? p->cur : "(before the first label)";
    prof_open(c, PROF_GEMM);
    return prev;
}

static void prof_gemm_close(ds_cu *c, const char *prev, double flops) {
    if (!prev) return;
    c->prof->step_flops += flops;
    prof_open(c, prev);
}

extern "C" void ds_cu_prof_step_end(ds_cu *c) {
    c->skipping = 0; /* what follows a step (sampling, copies) is never left out */
    cu_prof *p = c->prof;
    if (!p || !p->n || capturing(c)) return;
    const double flops = p->step_flops;
    p->step_flops = 0, p->cur = NULL;
    if (cudaEventRecord(p->ev[p->n], c->stream) != cudaSuccess ||
        cudaEventSynchronize(p->ev[p->n]) != cudaSuccess) {
        cudaGetLastError();
        p->n = 0;
        return;
    }
    p->gemm_flops += flops;
    for (int i = 0; i < p->n; i++) {
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, p->ev[i], p->ev[i + 1]) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        int l = 0;
        while (l < p->n_labels && p->label[l] != p->at[i] && strcmp(p->label[l], p->at[i])) l++;
        if (l == p->n_labels) {
            if (l == PROF_LABELS) continue;
            p->label[p->n_labels++] = p->at[i];
        }
        p->ms[l] += ms;
        p->count[l]++;
    }
    p->n = 0;
    p->steps++;
}

extern "C" void ds_cu_prof_report(ds_cu *c, FILE *f, const char *title) {
    cu_prof *p = c->prof;
    if (!p || !p->steps || !f) {
        if (p) prof_clear(p);
        return;
    }
    int order[PROF_LABELS];
    double total = 0.0;
    for (int i = 0; i < p->n_labels; i++) order[i] = i, total += p->ms[i];
    for (int i = 1; i < p->n_labels; i++) /* by time, largest first */
        for (int j = i; j > 0 && p->ms[order[j]] > p->ms[order[j - 1]]; j--) {
            int t = order[j];
            order[j] = order[j - 1];
            order[j - 1] = t;
        }
    fprintf(f, "profile: %s — %d steps, %.3f ms device time per step%s\n", title, p->steps,
            total / p->steps, p->dropped ? " (marks dropped: raise PROF_EVENTS)" : "");
    fprintf(f, "  %-24s %12s %8s %10s\n", "op", "ms/step", "share", "calls/step");
    for (int i = 0; i < p->n_labels; i++) {
        int l = order[i];
        fprintf(f, "  %-24s %12.4f %7.1f%% %10.1f\n", p->label[l], p->ms[l] / p->steps,
                total > 0 ? 100.0 * p->ms[l] / total : 0.0, (double)p->count[l] / p->steps);
    }
    double gemm_ms;
    const double tf = ds_cu_prof_gemm_tflops(c, &gemm_ms);
    if (tf > 0)
        fprintf(f, "  %s: %.3f TFLOP a step in %.3f ms, %.1f TFLOP/s\n", PROF_GEMM,
                p->gemm_flops / p->steps / 1e12, gemm_ms, tf);
    prof_clear(p);
}

extern "C" double ds_cu_prof_gemm_tflops(ds_cu *c, double *ms_per_step) {
    cu_prof *p = c->prof;
    *ms_per_step = 0;
    if (!p || !p->steps || p->gemm_flops <= 0) return 0;
    for (int l = 0; l < p->n_labels; l++)
        if (p->label[l] == PROF_GEMM) *ms_per_step = p->ms[l] / p->steps;
    return *ms_per_step > 0 ? p->gemm_flops / p->steps / (*ms_per_step * 1e-3) / 1e12 : 0;
}
