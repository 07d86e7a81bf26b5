/* devmem.c — host or device memory for per-sequence state (see devmem.h). */
#include "base/devmem.h"

#include <pthread.h>
#include <stdlib.h>

/* The page-locked blocks handed out, each with the release that belongs to it (a block may be
 * freed after its device is gone). Few: one logits buffer per engine. */
enum { MAX_PINNED = 64 };
static struct {
    void *p;
    void (*release)(void *p);
} g_pinned[MAX_PINNED];
static pthread_mutex_t g_pinned_mu = PTHREAD_MUTEX_INITIALIZER;

int ds_dmem_on_device(const ds_dmem *d) {
    return d && d->ops;
}

void *ds_dmem_alloc(const ds_dmem *d, size_t bytes, ds_err *err) {
    if (!ds_dmem_on_device(d)) return ds_aligned_alloc(bytes ? bytes : 1, err);
    return d->ops->alloc(d->ctx, bytes, err);
}

void ds_dmem_free(const ds_dmem *d, void *p) {
    if (!p) return;
    if (ds_dmem_on_device(d))
        d->ops->release(d->ctx, p);
    else
        free(p);
}

void ds_dmem_copy(const ds_dmem *d, void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return;
    if (ds_dmem_on_device(d))
        d->ops->copy(d->ctx, dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

void ds_dmem_zero(const ds_dmem *d, void *p, size_t bytes) {
    if (!bytes) return;
    if (ds_dmem_on_device(d))
        d->ops->zero(d->ctx, p, bytes);
    else
        memset(p, 0, bytes);
}

void *ds_dmem_host_alloc(const ds_dmem *d, size_t bytes, ds_err *err) {
    if (!bytes) bytes = 1;
    const ds_dmem_ops *ops = ds_dmem_on_device(d) ? d->ops : NULL;
    if (ops && ops->host_alloc && ops->host_release) {
        pthread_mutex_lock(&g_pinned_mu);
        int slot = -1;
        for (int i = 0; i < MAX_PINNED && slot < 0; i++)
            if (!g_pinned[i].p) slot = i;
        void *p = NULL;
        if (slot >= 0) {
            /* page-locked memory is an optimisation: on failure, plain memory below */
            ds_err ignored = {{0}};
            p = ops->host_alloc(bytes, &ignored);
            if (p) g_pinned[slot].p = p, g_pinned[slot].release = ops->host_release;
        }
        pthread_mutex_unlock(&g_pinned_mu);
        if (p) return p;
    }
    return ds_aligned_alloc(bytes, err);
}

void ds_dmem_host_free(const ds_dmem *d, void *p) {
    (void)d; /* the block's own release is kept with it: d may be another, or its device gone */
    if (!p) return;
    void (*release)(void *) = NULL;
    pthread_mutex_lock(&g_pinned_mu);
    for (int i = 0; i < MAX_PINNED; i++)
        if (g_pinned[i].p == p) {
            release = g_pinned[i].release;
            g_pinned[i].p = NULL;
            break;
        }
    pthread_mutex_unlock(&g_pinned_mu);
    if (release)
        release(p);
    else
        free(p);
}
