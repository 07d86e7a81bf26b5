/* strtab.c — see strtab.h. */
#include "io/strtab.h"

#include <stdlib.h>
#include <string.h>

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a, then a final mix for the low bits */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

int ds_strtab_find(const ds_strtab *t, const char *key, ds_name_at_fn name_at, const void *ctx) {
    if (!t->cap) return -1;
    for (size_t i = hash_str(key) & (t->cap - 1);; i = (i + 1) & (t->cap - 1)) {
        int s = t->slot[i];
        if (!s) return -1;
        if (strcmp(name_at(ctx, s - 1), key) == 0) return s - 1;
    }
}

static void ds_strtab_put_slot(ds_strtab *t, int idx, const char *key) {
    size_t i = hash_str(key) & (t->cap - 1);
    while (t->slot[i]) i = (i + 1) & (t->cap - 1);
    t->slot[i] = idx + 1;
}

int ds_strtab_insert(ds_strtab *t, int idx, const char *key, ds_name_at_fn name_at, const void *ctx,
                     ds_err *err) {
    int found = ds_strtab_find(t, key, name_at, ctx);
    if (found >= 0) return found;
    if ((size_t)(t->n + 1) * 2 > t->cap) {
        size_t ncap = t->cap ? t->cap * 2 : 64;
        int *ns = ds_calloc(ncap, sizeof *ns, err);
        if (!ns) return -2;
        int *old = t->slot;
        size_t ocap = t->cap;
        t->slot = ns;
        t->cap = ncap;
        for (size_t i = 0; i < ocap; i++)
            if (old[i]) ds_strtab_put_slot(t, old[i] - 1, name_at(ctx, old[i] - 1));
        free(old);
    }
    ds_strtab_put_slot(t, idx, key);
    t->n++;
    return -1;
}

void ds_strtab_free(ds_strtab *t) {
    free(t->slot);
    memset(t, 0, sizeof *t);
}
