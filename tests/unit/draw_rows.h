/* draw_rows.h — rows of logits for the sampler's exact-definition checks, shared by the host
 * test (test_sample_sampler.c) and the GPU's (tests/cuda/test_cuda_sample.c), which link
 * different helpers. */
#ifndef DS_TEST_DRAW_ROWS_H
#define DS_TEST_DRAW_ROWS_H

#include "base/ds_base.h"

#include <math.h>

enum { DRAW_ROW_SHAPES = 6 };

/* x[V] of one shape: 0 smooth; 1 logits on a grid of 1/4 (hundreds of ties a value); 2 peaked;
 * 3 NaN and -inf sprinkled; 4 a few values only; 5 very flat (a small spread). */
static inline void draw_row_fill(float *x, int V, int shape, ds_rng *rng) {
    for (int i = 0; i < V; i++) {
        double z = ds_rng_normal(rng);
        x[i] = shape == 1   ? (float)(floor(z * 4.0) / 4.0)
               : shape == 4 ? (float)(i % 5)
               : shape == 5 ? (float)(z * 0.01)
                            : (float)(2.0 * z);
    }
    if (shape == 2)
        for (int j = 0; j < 9; j++) x[(j * 977 + 5) % V] = 9.0f + 0.25f * (float)(j % 3);
    if (shape == 3)
        for (int i = 0; i < V; i += 37) x[i] = i % 74 ? NAN : -INFINITY;
}

#endif
