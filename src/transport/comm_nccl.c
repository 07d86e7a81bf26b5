/* comm_nccl.c — tensor-parallel sums between GPUs through NCCL (see comm_nccl.h).
 *
 * NCCL is loaded when first asked for (dlopen of libnccl.so.2), not linked: the same binary runs
 * on a machine without it (one GPU, or a host whose NCCL is elsewhere), where the sums stay on
 * the host path and a line says why. */
#include "transport/comm_nccl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(ncclUniqueId) == DS_NCCL_ID_BYTES, "NCCL's unique id is 128 bytes");

struct ds_nccl {
    ncclComm_t comm;
    int device;
};

/* the entry points used, from the loaded library */
static struct {
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*comm_init_rank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*all_reduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t,
                               ncclComm_t, cudaStream_t);
    ncclResult_t (*comm_destroy)(ncclComm_t);
    const char *(*get_error_string)(ncclResult_t);
} g_nccl;
static char g_load_err[256]; /* why loading failed, or "" */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void load_nccl(void) {
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(g_load_err, sizeof g_load_err, "libnccl.so.2 not found (%s)", dlerror());
        return;
    }
    /* (POSIX: a data pointer from dlsym converts to a function pointer) */
    *(void **)&g_nccl.get_unique_id = dlsym(h, "ncclGetUniqueId");
    *(void **)&g_nccl.comm_init_rank = dlsym(h, "ncclCommInitRank");
    *(void **)&g_nccl.all_reduce = dlsym(h, "ncclAllReduce");
    *(void **)&g_nccl.comm_destroy = dlsym(h, "ncclCommDestroy");
    *(void **)&g_nccl.get_error_string = dlsym(h, "ncclGetErrorString");
    if (!g_nccl.get_unique_id || !g_nccl.comm_init_rank || !g_nccl.all_reduce ||
        !g_nccl.comm_destroy || !g_nccl.get_error_string) {
        snprintf(g_load_err, sizeof g_load_err, "libnccl.so.2 lacks an entry point");
        memset(&g_nccl, 0, sizeof g_nccl);
    }
}

static int loaded(ds_err *err) {
    pthread_once(&g_once, load_nccl);
    if (g_nccl.all_reduce) return DS_OK;
    return ds_errf(err, "nccl: %s", g_load_err);
}

int ds_nccl_unique_id(void *id, ds_err *err) {
    if (loaded(err)) return DS_ERR;
    ncclUniqueId u;
    ncclResult_t r = g_nccl.get_unique_id(&u);
    if (r != ncclSuccess) return ds_errf(err, "nccl: unique id: %s", g_nccl.get_error_string(r));
    memcpy(id, &u, sizeof u);
    return DS_OK;
}

int ds_nccl_init(ds_nccl **out, const void *id, int n_ranks, int rank, int device, ds_err *err) {
    *out = NULL;
    if (loaded(err)) return DS_ERR;
    ds_nccl *c = calloc(1, sizeof *c);
    if (!c) return ds_errf(err, "nccl: out of memory");
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess) {
        free(c);
        return ds_errf(err, "nccl: GPU %d: %s", device, cudaGetErrorString(ce));
    }
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclResult_t r = g_nccl.comm_init_rank(&c->comm, n_ranks, u, rank);
    if (r != ncclSuccess) {
        free(c);
        return ds_errf(err, "nccl: joining %d ranks as rank %d on GPU %d: %s", n_ranks, rank,
                       device, g_nccl.get_error_string(r));
    }
    c->device = device;
    *out = c;
    return DS_OK;
}

int ds_nccl_allreduce_sum(ds_nccl *c, float *buf, size_t n, void *stream, ds_err *err) {
    ncclResult_t r =
        g_nccl.all_reduce(buf, buf, n, ncclFloat, ncclSum, c->comm, (cudaStream_t)stream);
    if (r != ncclSuccess)
        return ds_errf(err, "nccl: all-reduce of %zu floats: %s", n, g_nccl.get_error_string(r));
    return DS_OK;
}

void ds_nccl_free(ds_nccl *c) {
    if (!c) return;
    g_nccl.comm_destroy(c->comm);
    free(c);
}
