/* strtab.h — an open-addressing string hash table that maps a name to an index into its owner's
 * array (the safetensors reader's and writer's tensors: a checkpoint can hold ~100k). The owner
 * supplies the names through name_at(), so the table stores only indices. Internal to io/. */
#ifndef DS_STRTAB_H
#define DS_STRTAB_H

#include "base/ds_base.h"

typedef const char *(*ds_name_at_fn)(const void *ctx, int i);

typedef struct ds_strtab {
    int *slot;  /* [cap] index + 1 into the owner's array; 0 = empty */
    size_t cap; /* power of two, kept >= 2 x n so probes stay short */
    int n;
} ds_strtab;

/* The index stored under key, or -1. */
int ds_strtab_find(const ds_strtab *t, const char *key, ds_name_at_fn name_at, const void *ctx);

/* Inserts idx under key. Returns -1 when inserted, the existing index when key is already there,
 * -2 when out of memory. */
int ds_strtab_insert(ds_strtab *t, int idx, const char *key, ds_name_at_fn name_at, const void *ctx,
                     ds_err *err);

void ds_strtab_free(ds_strtab *t);

#endif
