/* state.c — the KDA state slot pool.
 *
 * All slots live in one 64-byte aligned block allocated at creation, so a step never allocates
 * and every slot starts on a cache line (slot_floats is rounded up to a multiple of 16 floats for
 * the stride; callers still see exactly slot_floats floats). Free slots sit on a stack: O(1)
 * alloc and release. Zeroing happens in alloc, where a sequence is about to start from the zero
 * state, not in release, so a released slot's contents could later serve as a checkpoint.
 *
 * Releasing a slot that is not in use is a caller bug; it would put the slot on the stack twice
 * and hand it to two sequences, so it is ignored and counted (tests assert the count is 0). */
#include "cache/state.h"

#include "base/devmem.h"

#include <stdlib.h>

struct ds_slot_pool {
    int n_slots;
    const ds_dmem *dm;   /* where data lives (GPU memory when the model runs on CUDA) */
    size_t slot_floats;  /* floats a caller may use in one slot */
    size_t stride;       /* floats between slot starts: slot_floats rounded up to 64 bytes */
    float *data;         /* [n_slots][stride], 64-byte aligned */
    uint8_t *in_use;     /* [n_slots] */
    int32_t *free_stack; /* [n_slots] ids of free slots in free_stack[0 .. n_free) */
    int n_free;
    uint64_t n_bad; /* releases of free or out-of-range slots (bugs), for tests */
};

int ds_slot_pool_create(int n_slots, size_t slot_floats, ds_slot_pool **out, ds_err *err) {
    return ds_slot_pool_create_on(NULL, n_slots, slot_floats, out, err);
}

int ds_slot_pool_create_on(const ds_dmem *dm, int n_slots, size_t slot_floats, ds_slot_pool **out,
                           ds_err *err) {
    *out = NULL;
    if (n_slots < 1) return ds_errf(err, "slot pool: need at least 1 slot, got %d", n_slots);
    size_t stride = (slot_floats + 15) & ~(size_t)15;
    if (stride != 0 && (size_t)n_slots > SIZE_MAX / sizeof(float) / stride)
        return ds_errf(err, "slot pool: %d slots of %zu floats overflow size_t", n_slots,
                       slot_floats);
    ds_slot_pool *p = ds_calloc(1, sizeof *p, err);
    if (!p) return DS_ERR;
    p->dm = dm;
    p->data = ds_dmem_alloc(dm, (size_t)n_slots * stride * sizeof(float), err);
    p->in_use = ds_calloc((size_t)n_slots, 1, err);
    p->free_stack = ds_malloc((size_t)n_slots * sizeof *p->free_stack, err);
    if (!p->data || !p->in_use || !p->free_stack) {
        ds_err_prefix(err, "slot pool of %d x %zu floats", n_slots, slot_floats);
        ds_slot_pool_free(p);
        return DS_ERR;
    }
    p->n_slots = n_slots;
    p->slot_floats = slot_floats;
    p->stride = stride;
    for (int i = 0; i < n_slots; i++) p->free_stack[i] = n_slots - 1 - i; /* 0 on top */
    p->n_free = n_slots;
    *out = p;
    return DS_OK;
}

void ds_slot_pool_free(ds_slot_pool *p) {
    if (!p) return;
    ds_dmem_free(p->dm, p->data);
    free(p->in_use);
    free(p->free_stack);
    free(p);
}

int ds_slot_alloc(ds_slot_pool *p) {
    if (p->n_free == 0) return -1;
    int slot = p->free_stack[--p->n_free];
    p->in_use[slot] = 1;
    ds_dmem_zero(p->dm, p->data + (size_t)slot * p->stride, p->slot_floats * sizeof(float));
    return slot;
}

void ds_slot_release(ds_slot_pool *p, int slot) {
    if (slot < 0 || slot >= p->n_slots || !p->in_use[slot]) {
        p->n_bad++;
        return;
    }
    p->in_use[slot] = 0;
    p->free_stack[p->n_free++] = slot;
}

float *ds_slot_data(ds_slot_pool *p, int slot) {
    if (slot < 0 || slot >= p->n_slots) return NULL;
    return p->data + (size_t)slot * p->stride;
}

int ds_slot_n_free(const ds_slot_pool *p) {
    return p->n_free;
}

int ds_slot_n_total(const ds_slot_pool *p) {
    return p->n_slots;
}

size_t ds_slot_floats(const ds_slot_pool *p) {
    return p->slot_floats;
}

uint64_t ds_slot_n_bad(const ds_slot_pool *p) {
    return p->n_bad;
}
