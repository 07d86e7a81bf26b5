/* context.cu — the ds_cu context: devices, create/free, streams (the side stream), memory and
 * copies, scratch growth and its epoch, CUDA graphs. */
#include "kernels/cuda/common.cuh"

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
        /* Hopper runs the sm_90a code; a later part would JIT the compute_80 PTX, which holds
         * none of the sm_90 paths (clusters, bulk prefetch, PDL's wait, wgmma): off there */
        c->sm90 = p.major == 9;
        c->pdl = c->sm90; /* on by default (ds_cu_set_pdl) */
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
    cudaFree(c->f8_wg_side);
    c->f8_wg_side = NULL, c->f8_wg_side_bytes = 0;
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
    void *f = c->f8_wg_buf;
    c->f8_wg_buf = c->f8_wg_side, c->f8_wg_side = f;
    n = c->f8_wg_bytes;
    c->f8_wg_bytes = c->f8_wg_side_bytes, c->f8_wg_side_bytes = n;
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

/* ---- weights prefetched into L2 (ds_cu_set_l2_prefetch) ---------------------------------------
 * Between two weight products of a decode step run small kernels (norms, the KDA recurrence, the
 * router's choice) during which the memory is idle. A prefetch of the next product's weights on a
 * third stream, made to wait for the previous product (an event: an edge in a graph), runs in that
 * gap. Its kernel only issues bulk prefetches (the copy engine of sm_90's TMA fetches them) and
 * ends; nothing waits for it until the step's end. Only the main stream's products take part: the
 * prefetch stream runs in order, so a prefetch waiting for a side-stream product (the shared
 * experts, which run beside the router and the routed experts) would hold back the main chain's. */
static void pf_free(ds_cu *c) {
    if (!c->pf) return;
    cudaStreamSynchronize(c->pf);
    cudaEventDestroy(c->pf_after);
    cudaEventDestroy(c->pf_join);
    cudaStreamDestroy(c->pf);
    c->pf = NULL;
    c->pf_bytes = 0;
    c->pf_have = c->pf_pending = 0;
}

extern "C" int ds_cu_set_l2_prefetch(ds_cu *c, int mb, ds_err *err) {
    if (mb <= 0 || !c->sm90) {
        pf_free(c);
        return DS_OK;
    }
    if (!c->pf) {
        if (cudaStreamCreateWithFlags(&c->pf, cudaStreamNonBlocking) != cudaSuccess) {
            cudaGetLastError();
            c->pf = NULL;
            return ds_errf(err, "cuda: cannot create the L2 prefetch stream");
        }
        if (cudaEventCreateWithFlags(&c->pf_after, cudaEventDisableTiming) != cudaSuccess ||
            cudaEventCreateWithFlags(&c->pf_join, cudaEventDisableTiming) != cudaSuccess) {
            cudaGetLastError();
            cudaStreamDestroy(c->pf);
            c->pf = NULL;
            return ds_errf(err, "cuda: cannot create the L2 prefetch stream's events");
        }
    }
    c->pf_bytes = (size_t)mb << 20;
    return DS_OK;
}

extern "C" int ds_cu_l2_mark(ds_cu *c, ds_err *err) {
    if (!c->pf_bytes || c->prof || c->on_side) return DS_OK;
    CU_TRY(cudaEventRecord(c->pf_after, c->stream), "L2 prefetch: mark");
    c->pf_have = 1;
    return DS_OK;
}

/* The prefetch of [bytes] at p, PF_CHUNK bytes a thread over as many blocks as that takes: the
 * bulk prefetches go through each SM's copy engine, and one block issuing them all took a chain of
 * these kernels longer than the step (bench/RESULTS.md session 37). Bulk prefetches take 16-byte
 * multiples at 16-byte addresses (the weights' allocations are aligned). */
enum { PF_CHUNK = 32 << 10 };
/* One bulk prefetch of len bytes at p into L2 (sm_90; len a multiple of 16 once masked). */
__device__ __forceinline__ void l2_prefetch_piece(const uint8_t *p, size_t len) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned n = (unsigned)len & ~15u;
    if (n) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(n) : "memory");
#endif
}

__global__ void l2_prefetch_k(const uint8_t *p, size_t bytes) {
    const size_t o = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * PF_CHUNK;
    if (o < bytes) l2_prefetch_piece(p + o, DS_MIN((size_t)PF_CHUNK, bytes - o));
}

int cu_l2_prefetch(ds_cu *c, const void *p, size_t bytes, ds_err *err) {
    if (!c->pf_bytes || c->prof || c->on_side || !c->pf_have || (uintptr_t)p % 16) return DS_OK;
    CU_TRY(cudaStreamWaitEvent(c->pf, c->pf_after, 0), "L2 prefetch: wait");
    const size_t n = DS_MIN(bytes, c->pf_bytes), threads = (n + PF_CHUNK - 1) / PF_CHUNK;
    l2_prefetch_k<<<(unsigned)((threads + 31) / 32), 32, 0, c->pf>>>((const uint8_t *)p, n);
    CU_TRY(cudaGetLastError(), "L2 prefetch");
    c->pf_pending = 1;
    return DS_OK;
}

/* The chosen experts' weights: for each of n routed slots (idx, device memory, written by the
 * kernel marked last), expert e = idx[i] - e0 of this rank's El: up to gu_cap bytes of its
 * [gu_bytes] at gu + e gu_bytes, then up to dn_cap of its [dn_bytes] at dn + e dn_bytes (the
 * second pass reads those later). Slots naming the same expert prefetch it again (a hint; the
 * lines are in L2 by then). */
__global__ void l2_prefetch_experts_k(const int32_t *idx, int n, int e0, int El, const uint8_t *gu,
                                      size_t gu_bytes, size_t gu_cap, const uint8_t *dn,
                                      size_t dn_bytes, size_t dn_cap) {
    const int pass = blockIdx.y; /* 0: gate|up, 1: down */
    const uint8_t *base = pass ? dn : gu;
    const size_t per = pass ? dn_bytes : gu_bytes, cap = DS_MIN(per, pass ? dn_cap : gu_cap);
    const size_t pieces = (cap + PF_CHUNK - 1) / PF_CHUNK;
    const size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= (size_t)n * pieces) return;
    const int e = idx[j / pieces] - e0;
    if (e < 0 || e >= El) return;
    const size_t o = (j % pieces) * PF_CHUNK;
    l2_prefetch_piece(base + (size_t)e * per + o, DS_MIN((size_t)PF_CHUNK, cap - o));
}

extern "C" int ds_cu_l2_prefetch_experts(ds_cu *c, const int32_t *idx, int n, int e0, int El,
                                         const void *gu, size_t gu_bytes, const void *dn,
                                         size_t dn_bytes, ds_err *err) {
    /* (a decode step's few tokens: a prompt's experts stream at the tensor cores' pace) */
    if (!c->pf_bytes || c->prof || c->on_side || !c->pf_have || n <= 0 || n > 64 ||
        (uintptr_t)gu % 16 || (uintptr_t)dn % 16 || gu_bytes % 16 || dn_bytes % 16)
        return DS_OK;
    CU_TRY(cudaStreamWaitEvent(c->pf, c->pf_after, 0), "L2 prefetch: wait");
    const size_t gu_cap = c->pf_bytes / (size_t)n;
    const size_t threads = (size_t)n * ((DS_MIN(gu_cap, gu_bytes) + PF_CHUNK - 1) / PF_CHUNK);
    l2_prefetch_experts_k<<<dim3((unsigned)((threads + 31) / 32), 2), 32, 0, c->pf>>>(
        idx, n, e0, El, (const uint8_t *)gu, gu_bytes, gu_cap, (const uint8_t *)dn, dn_bytes,
        gu_cap / 2);
    CU_TRY(cudaGetLastError(), "L2 prefetch (experts)");
    c->pf_pending = 1;
    return DS_OK;
}

/* The prefetches rejoin the stream (a capture must end with every stream it forked joined). */
static int pf_join(ds_cu *c, ds_err *err) {
    c->pf_have = 0;
    if (!c->pf_pending) return DS_OK;
    c->pf_pending = 0;
    CU_TRY(cudaEventRecord(c->pf_join, c->pf), "L2 prefetch: join");
    CU_TRY(cudaStreamWaitEvent(c->stream, c->pf_join, 0), "L2 prefetch: join");
    return DS_OK;
}

extern "C" void ds_cu_free(ds_cu *c) {
    if (!c) return;
    if (c->on_side) side_swap(c);
    side_free(c);
    pf_free(c);
    cudaStreamSynchronize(c->stream);
    if (c->st_have) cudaEventDestroy(c->st_ev[0]), cudaEventDestroy(c->st_ev[1]);
    cudaFree(c->xb);
    cudaFree(c->f8_wg_buf);
    cudaFree(c->part);
    fp8_free(c);
    cudaFree(c->blas_ws);
    cudaFree(c->moeg);
    cudaFree(c->moegi);
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

extern "C" void ds_cu_set_pdl(ds_cu *c, int on) {
    c->pdl = on && c->sm90;
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
    if (ds_cu_side_join(c, err) || pf_join(c, err)) return DS_ERR;
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

extern "C" int ds_cu_step_mark(ds_cu *c, int end, ds_err *err) {
    if (!c->st_have) {
        CU_TRY(cudaEventCreate(&c->st_ev[0]), "step marks");
        CU_TRY(cudaEventCreate(&c->st_ev[1]), "step marks");
        c->st_have = 1;
    }
    CU_TRY(cudaEventRecord(c->st_ev[end ? 1 : 0], c->stream), "step marks");
    return DS_OK;
}

extern "C" double ds_cu_step_mark_ms(ds_cu *c) {
    float ms = -1.0f;
    if (!c->st_have || cudaEventElapsedTime(&ms, c->st_ev[0], c->st_ev[1]) != cudaSuccess) {
        cudaGetLastError();
        return -1.0;
    }
    return ms;
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

/* Grows a device scratch buffer to at least `need` bytes (contents not kept); the next ds_cu_epoch
 * reports the move. */
int grow_scratch(ds_cu *c, void **p, size_t *cap, size_t need, const char *what, ds_err *err) {
    if (need <= *cap) return DS_OK;
    c->epoch_bump = 1;
    cudaFree(*p);
    *p = NULL;
    *cap = 0;
    CU_TRY(cudaMalloc(p, need), what);
    *cap = need;
    return DS_OK;
}

/* n buffers of sizes[i] bytes laid out in one scratch (each 256-byte aligned), grown to fit; out[i]
 * receive their addresses. */
int carve_scratch(ds_cu *c, void **buf, size_t *cap, const size_t *sizes, void **out, int n,
                  const char *what, ds_err *err) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += (sizes[i] + 255) & ~(size_t)255;
    if (grow_scratch(c, buf, cap, total, what, err)) return DS_ERR;
    char *p = (char *)*buf;
    for (int i = 0; i < n; i++) {
        out[i] = p;
        p += (sizes[i] + 255) & ~(size_t)255;
    }
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

/* ---- CUDA graphs -------------------------------------------------------------------------------
 * A step's launches captured once and replayed: one launch instead of hundreds. */
struct ds_cu_graph {
    cudaGraphExec_t exec;
};

extern "C" uint64_t ds_cu_epoch(ds_cu *c) {
    if (c->epoch_bump) c->epoch++, c->epoch_bump = 0;
    return c->epoch;
}

extern "C" int ds_cu_capture_begin(ds_cu *c, ds_err *err) {
    if (pf_join(c, err)) return DS_ERR; /* no wait inside the capture on an event from before it */
    CU_TRY(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal), "graph capture");
    return DS_OK;
}

extern "C" int ds_cu_capture_end(ds_cu *c, ds_cu_graph **out, ds_err *err) {
    *out = NULL;
    cudaGraph_t g = NULL;
    if (c->on_side) side_swap(c); /* (an error path left it there) */
    /* the side stream and the prefetches rejoin the capture */
    if (ds_cu_side_join(c, err) || pf_join(c, err)) return DS_ERR;
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
