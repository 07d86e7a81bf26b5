/* rand_hash.h — the one definition of a random weight's value (--load-format random), shared by
 * the CPU loader (model/model.c) and the GPU's fill kernel (kernels/cuda/elementwise.cu), so that
 * both draw the same model. */
#ifndef DS_RAND_HASH_H
#define DS_RAND_HASH_H

#include "kernels/shared/hd.h"

#include <stdint.h>

/* splitmix64's finalizer over key + (i + 1) * golden ratio. */
static inline DS_HD uint64_t ds_hash64(uint64_t key, uint64_t i) {
    uint64_t z = key + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1) from (key, i). */
static inline DS_HD float ds_hash_uniform(uint64_t key, uint64_t i) {
    return (float)((double)(ds_hash64(key, i) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* A random MXFP4 matrix (--load-format random with MXFP4 experts): byte i of its packed codes (two
 * uniform E2M1 codes), and scale byte j for values of typical magnitude 2^e2 (e2 = the binary
 * exponent of the scale a BF16 matrix of that shape is drawn with): 2^(e2 - 1) or 2^e2 a group,
 * so that code magnitudes (mean ~2) give values of about that size. i and j index the whole
 * tensor ([rows][cols/2] and [rows][cols/32]). */
static inline DS_HD uint8_t ds_rand_mxfp4_code(uint64_t key, uint64_t i) {
    return (uint8_t)(ds_hash64(key, i) >> 56);
}
static inline DS_HD uint8_t ds_rand_mxfp4_scale(uint64_t key, uint64_t j, int e2) {
    return (uint8_t)(127 + e2 - 1 + (int)((ds_hash64(key ^ 0x5ca1e5ca1e5ca1e5ull, j) >> 63)));
}

#endif
