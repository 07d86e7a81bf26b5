/* devmem.h — the memory per-sequence state lives in: the host's, or the GPU's when the model runs
 * on the CUDA backend (issue 9). The KDA slot and checkpoint pools, the MLA latent pool and the
 * verify rows are allocated, copied and zeroed through here, so the engine and the caches above
 * the model run unchanged on either device.
 *
 * The CUDA backend installs its operations, with its device as their context, when a model is
 * attached to a GPU (one device per process: a second model attached finds it installed here and
 * shares it); until then every call is plain host memory. Copies take any direction: with unified
 * addressing the backend tells host from device pointers itself. A copy or fill that fails on the
 * device is recorded by the backend and reported by the next forward step. */
#ifndef DS_DEVMEM_H
#define DS_DEVMEM_H

#include "base/ds_base.h"

/* A device's memory operations; ctx is the context given to ds_dmem_install with them. */
typedef struct ds_dmem_ops {
    void *(*alloc)(void *ctx, size_t bytes, ds_err *err);
    void (*release)(void *ctx, void *p);
    void (*copy)(void *ctx, void *dst, const void *src, size_t bytes); /* done when it returns */
    void (*zero)(void *ctx, void *p, size_t bytes);                    /* device memory only */
    /* page-locked host memory (the device copies it at full speed); release stays valid after
     * the operations are uninstalled */
    void *(*host_alloc)(size_t bytes, ds_err *err);
    void (*host_release)(void *p);
} ds_dmem_ops;

/* Installs a device's operations and their context (ops NULL: back to host only). */
void ds_dmem_install(const ds_dmem_ops *ops, void *ctx);
/* The context installed with ops, when ops are the ones installed; else NULL. */
void *ds_dmem_installed(const ds_dmem_ops *ops);

/* on_device 0: 64-byte aligned host memory; 1: device memory (an error without a device). */
void *ds_dmem_alloc(int on_device, size_t bytes, ds_err *err);
void ds_dmem_free(int on_device, void *p);
void ds_dmem_copy(void *dst, const void *src, size_t bytes);
void ds_dmem_zero(int on_device, void *p, size_t bytes);
/* Host memory that a step copies results into (logits): page-locked when a device is installed,
 * so that a download of the logits of a large batch (670 MB at batch 1024) runs at the bus's rate
 * instead of through the driver's bounce buffer; plain aligned memory otherwise. Free it with
 * ds_dmem_host_free, whatever is installed by then. */
void *ds_dmem_host_alloc(size_t bytes, ds_err *err);
void ds_dmem_host_free(void *p);

#endif
