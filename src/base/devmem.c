/* devmem.c — host or device memory for per-sequence state (see devmem.h). */
#include "base/devmem.h"

#include <stdlib.h>

static const ds_dmem_ops *g_ops; /* the installed device, or NULL */

void ds_dmem_install(const ds_dmem_ops *ops) {
    g_ops = ops;
}

int ds_dmem_have_device(void) {
    return g_ops != NULL;
}

void *ds_dmem_alloc(int on_device, size_t bytes, ds_err *err) {
    if (!on_device) return ds_aligned_alloc(bytes ? bytes : 1, err);
    if (!g_ops) {
        ds_errf(err, "device memory asked for, but no device backend is in use");
        return NULL;
    }
    return g_ops->alloc(bytes, err);
}

void ds_dmem_free(int on_device, void *p) {
    if (!p) return;
    if (on_device && g_ops)
        g_ops->release(p);
    else
        free(p);
}

void ds_dmem_copy(void *dst, const void *src, size_t bytes) {
    if (!bytes || dst == src) return;
    if (g_ops)
        g_ops->copy(dst, src, bytes);
    else
        memcpy(dst, src, bytes);
}

void ds_dmem_zero(int on_device, void *p, size_t bytes) {
    if (!bytes) return;
    if (on_device && g_ops)
        g_ops->zero(p, bytes);
    else
        memset(p, 0, bytes);
}
