/* timeline.cu — a kernel timeline through CUPTI's activity API (DS_CUDA_TIMELINE in the engine):
 * every kernel the process runs, graph nodes included, with its start and end on the device's
 * clock and its stream, written as CSV — where the per-op profile (eager steps, serialised) and
 * the what-ifs (kernels left out) cannot see: the gaps between a graphed step's kernels and what
 * overlaps what. Nsight Systems records the same, but the GPU machines have only Nsight Compute;
 * libcupti ships with the CUDA toolkit and is opened here only when asked for (dlopen), so that a
 * build or a run without it loses nothing else. tools/timeline_step.py reads the file. */
#include "kernels/cuda/common.cuh"

#include <cupti.h>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>

typedef CUptiResult (*cupti_register_fn)(CUpti_BuffersCallbackRequestFunc,
                                         CUpti_BuffersCallbackCompleteFunc);
typedef CUptiResult (*cupti_kind_fn)(CUpti_ActivityKind);
typedef CUptiResult (*cupti_next_fn)(uint8_t *, size_t, CUpti_Activity **);
typedef CUptiResult (*cupti_flush_fn)(uint32_t);

/* process-wide, as CUPTI's activity buffers are */
static struct {
    void *lib;
    FILE *f;
    pthread_mutex_t mu;
    cupti_kind_fn enable, disable;
    cupti_next_fn next;
    cupti_flush_fn flush;
} g_tl = {NULL, NULL, PTHREAD_MUTEX_INITIALIZER, NULL, NULL, NULL, NULL};

enum { TL_BUF = 16 << 20 }; /* bytes a CUPTI activity buffer */

static void CUPTIAPI tl_requested(uint8_t **buf, size_t *size, size_t *max_records) {
    *buf = (uint8_t *)aligned_alloc(8, TL_BUF);
    *size = *buf ? TL_BUF : 0;
    *max_records = 0; /* as many as fit */
}

static void CUPTIAPI tl_completed(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size,
                                  size_t valid) {
    (void)ctx, (void)stream, (void)size;
    CUpti_Activity *r = NULL;
    pthread_mutex_lock(&g_tl.mu);
    while (g_tl.f && g_tl.next(buf, valid, &r) == CUPTI_SUCCESS)
        if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)r;
            fprintf(g_tl.f, "%llu,%llu,%u,%s\n", (unsigned long long)k->start,
                    (unsigned long long)(k->end - k->start), k->streamId, k->name ? k->name : "?");
        }
    pthread_mutex_unlock(&g_tl.mu);
    free(buf);
}

extern "C" void ds_cu_timeline_close(void) {
    if (!g_tl.f) return;
    g_tl.flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    g_tl.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    pthread_mutex_lock(&g_tl.mu);
    fclose(g_tl.f);
    g_tl.f = NULL;
    pthread_mutex_unlock(&g_tl.mu);
}

extern "C" int ds_cu_timeline_open(const char *path, ds_err *err) {
    if (g_tl.f) return DS_OK; /* (one timeline a process) */
    if (!g_tl.lib && !(g_tl.lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_LOCAL)) &&
        !(g_tl.lib = dlopen("libcupti.so", RTLD_NOW | RTLD_LOCAL)))
        return ds_errf(err, "cuda: timeline: cannot open libcupti (%s)", dlerror());
    cupti_register_fn reg = (cupti_register_fn)dlsym(g_tl.lib, "cuptiActivityRegisterCallbacks");
    g_tl.enable = (cupti_kind_fn)dlsym(g_tl.lib, "cuptiActivityEnable");
    g_tl.disable = (cupti_kind_fn)dlsym(g_tl.lib, "cuptiActivityDisable");
    g_tl.next = (cupti_next_fn)dlsym(g_tl.lib, "cuptiActivityGetNextRecord");
    g_tl.flush = (cupti_flush_fn)dlsym(g_tl.lib, "cuptiActivityFlushAll");
    if (!reg || !g_tl.enable || !g_tl.disable || !g_tl.next || !g_tl.flush)
        return ds_errf(err, "cuda: timeline: libcupti lacks the activity API");
    FILE *f = fopen(path, "w");
    if (!f) return ds_errf(err, "cuda: timeline: cannot write %s: %s", path, strerror(errno));
    fprintf(f, "start_ns,dur_ns,stream,name\n");
    CUptiResult r = reg(tl_requested, tl_completed);
    if (r == CUPTI_SUCCESS) {
        g_tl.f = f; /* (before the first buffer can complete) */
        r = g_tl.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    }
    if (r != CUPTI_SUCCESS) {
        g_tl.f = NULL;
        fclose(f);
        return ds_errf(err, "cuda: timeline: CUPTI refused the kernel activity (error %d)", (int)r);
    }
    atexit(ds_cu_timeline_close); /* the records still buffered when the process ends */
    return DS_OK;
}
