/* devmem.h — the memory per-sequence state lives in: the host's, or the GPU's when the model runs
 * on the CUDA backend (issue 9). The KDA slot and checkpoint pools, the MLA latent pool and the
 * verify rows are allocated, copied and zeroed through here, so the engine and the caches above
 * the model run unchanged on either device.
 *
 * Which memory is a handle, ds_dmem, that the model gives out (ds_model_dmem: the CUDA backend's
 * device, its operations with the device as their context) and that everything holding a model's
 * state keeps beside it; a NULL handle (or one without operations) is plain host memory. Copies
 * take any direction: with unified addressing the backend tells host from device pointers itself.
 * A copy or fill that fails on the device is recorded by the backend and reported by the next
 * forward step. */
#ifndef DS_DEVMEM_H
#define DS_DEVMEM_H

#include "base/ds_base.h"

/* A device's memory operations; ctx is the ds_dmem's context given with them. */
typedef struct ds_dmem_ops {
    void *(*alloc)(void *ctx, size_t bytes, ds_err *err);
    void (*release)(void *ctx, void *p);
    void (*copy)(void *ctx, void *dst, const void *src, size_t bytes); /* done when it returns */
    void (*zero)(void *ctx, void *p, size_t bytes);                    /* device memory only */
    /* page-locked host memory (the device copies it at full speed); release stays valid after
     * the device is gone */
    void *(*host_alloc)(size_t bytes, ds_err *err);
    void (*host_release)(void *p);
} ds_dmem_ops;

/* The memory a model's state lives in: a device's operations and their context. NULL, or ops
 * NULL: the host's. */
typedef struct ds_dmem {
    const ds_dmem_ops *ops;
    void *ctx;
} ds_dmem;

/* 1 when d is a device's memory, 0 for the host's. */
int ds_dmem_on_device(const ds_dmem *d);
/* Host d: 64-byte aligned host memory; else device memory. */
void *ds_dmem_alloc(const ds_dmem *d, size_t bytes, ds_err *err);
void ds_dmem_free(const ds_dmem *d, void *p);
/* Host d: memcpy; else the device's copy (either pointer may be host or device memory). */
void ds_dmem_copy(const ds_dmem *d, void *dst, const void *src, size_t bytes);
void ds_dmem_zero(const ds_dmem *d, void *p, size_t bytes);
/* Host memory that a step copies results into (logits): page-locked when d is a device's, so that
 * a download of the logits of a large batch (670 MB at batch 1024) runs at the bus's rate instead
 * of through the driver's bounce buffer; plain aligned memory otherwise. Free it with
 * ds_dmem_host_free, which finds the release that belongs to the block (the device may be gone
 * by then). */
void *ds_dmem_host_alloc(const ds_dmem *d, size_t bytes, ds_err *err);
void ds_dmem_host_free(const ds_dmem *d, void *p);

#endif
