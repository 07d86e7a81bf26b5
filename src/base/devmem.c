/* devmem.c — host or device memory for per-sequence state (see devmem.h). */
#include "base/devmem.h"

#include <pthread.h>
#include <stdlib.h>

static const ds_dmem_ops *g_ops; /* the installed device, or NULL */
static void *g_ctx;              /* its context */

/* The page-locked blocks handed out, each with the release that belongs to it (a block may be
 * freed after its device's operations were uninstalled). Few: one logits buffer per engine. */
enum { MAX_PINNED = 64 };
static struct {
    void *p;
    void (*release)(void *p);
} g_pinned[MAX_PINNED];
static pthread_mutex_t g_pinned_mu = PTHREAD_MUTEX_INITIALIZER;

void ds_dmem_install(const ds_dmem_ops *ops, void *ctx) {
    g_ops = ops;
    g_ctx = ops ? ctx : NULL;
}

void *ds_dmem_installed(const ds_dmem_ops *ops) {
    return ops && g_ops == ops ? g_ctx : NULL;
}

void *ds_dmem_alloc(int on_device, size_t bytes, ds_err *err) {
    if (!on_device) return ds_aligned_alloc(bytes ? bytes : 1, err);
    if (!g_ops) {
        ds_errf(err, "device memory asked for, but no device backend is in use");
        return NULL;
    }
    return g_ops->alloc(g_ctx, bytes, err);
}

void ds_dmem_free(int on_device, void *p) {
    if (!p) return;
    if (on_device && g_ops)
        g_ops->release(g_ctx, p);
    else
        free(p);
}

void ds_dmem_copy(void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return;
    if (g_ops)
        g_ops->copy(g_ctx, dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

void ds_dmem_zero(int on_device, void *p, size_t bytes) {
    if (!bytes) return;
    if (on_device && g_ops)
        g_ops->zero(g_ctx, p, bytes);
    else
        memset(p, 0, bytes);
}

void *ds_dmem_host_alloc(size_t bytes, ds_err *err) {
    if (!bytes) bytes = 1;
    const ds_dmem_ops *ops = g_ops;
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

void ds_dmem_host_free(void *p) {
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
