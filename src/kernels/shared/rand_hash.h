/* rand_hash.h — the one definition of a random weight's value (--load-format random), shared by
 * the CPU loader (model/model.c) and the GPU's fill kernel (kernels/cuda/elementwise.cu), so that
 * both draw the same model. */
#ifndef DS_RAND_HASH_H
#define DS_RAND_HASH_H

#include "kernels/shared/hd.h"

#include <stdint.h>

/* Uniform in [-1, 1) from (key, i): splitmix64's finalizer over key + (i + 1) * golden ratio. */
static inline DS_HD float ds_hash_uniform(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

#endif
