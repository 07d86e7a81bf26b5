/* state.h — the pool of KDA state slots: each slot holds one sequence's conv tails and recurrent
 * matrices for every KDA layer (ds_model_slot_floats floats). Slots are zeroed when handed out,
 * because a new sequence starts from the zero state. */
#ifndef DS_STATE_H
#define DS_STATE_H

#include "base/devmem.h"
#include "base/ds_base.h"

typedef struct ds_slot_pool ds_slot_pool;

int ds_slot_pool_create(int n_slots, size_t slot_floats, ds_slot_pool **out, ds_err *err);
/* The same in dm's memory (see base/devmem.h; NULL: the host's): on a device, slot data is a
 * device pointer, copied with ds_dmem_copy, never read by the host directly. dm must outlive the
 * pool. */
int ds_slot_pool_create_on(const ds_dmem *dm, int n_slots, size_t slot_floats, ds_slot_pool **out,
                           ds_err *err);
void ds_slot_pool_free(ds_slot_pool *p);
int ds_slot_alloc(ds_slot_pool *p); /* a zeroed slot, or -1 */
void ds_slot_release(ds_slot_pool *p, int slot);
float *ds_slot_data(ds_slot_pool *p, int slot); /* [slot_floats] */
int ds_slot_n_free(const ds_slot_pool *p);
int ds_slot_n_total(const ds_slot_pool *p);
size_t ds_slot_floats(const ds_slot_pool *p);
/* Releases of a slot that was not in use or not in the pool: caller bugs, ignored and counted. */
uint64_t ds_slot_n_bad(const ds_slot_pool *p);

#endif
