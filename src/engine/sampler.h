/* sampler.h — turns one row of logits into a token: temperature, top-k, top-p, min-p, with a
 * per-request RNG so a seeded request gives the same tokens whatever else is in the batch. */
#ifndef DS_SAMPLER_H
#define DS_SAMPLER_H

#include "base/ds_base.h"

typedef struct ds_sampling {
    float temperature; /* 0: greedy */
    float top_p;       /* 1: off */
    int top_k;         /* 0 or <0: off */
    float min_p;       /* 0: off */
} ds_sampling;

void ds_sampling_default(ds_sampling *s);

/* Samples from logits[V] (modified in place: scaled and masked). scratch: [V] floats and
 * idx: [V] ints of caller memory. Greedy (temperature 0) takes the lowest-index maximum. */
int32_t ds_sample(float *logits, int V, const ds_sampling *p, ds_rng *rng, float *scratch,
                  int32_t *idx);

#endif
