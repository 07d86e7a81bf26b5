/* draw_host.h — drawing a step's sampled rows on the host (ds_seq_batch.draws): the CPU backend
 * draws every row so, the CUDA backend the rows a tensor-parallel group gathered on the host.
 * ds_sample_row on the OpenMP threads, each with its own sampling scratch; the memory is made at
 * the first step that draws and kept by the backend's per-model state. */
#ifndef DS_BACKEND_DRAW_HOST_H
#define DS_BACKEND_DRAW_HOST_H

#include "sample/sampler.h"

enum { DS_DRAW_CHUNK = 32 }; /* rows drawn on the host side by side */

typedef struct ds_host_draws {
    float *rows;            /* [DS_DRAW_CHUNK][V] the rows, whole, to be edited by the draw */
    ds_sample_scratch **sc; /* [n_sc] one a thread */
    int n_sc;
} ds_host_draws;

/* Makes h's memory for vocabulary size V (once; nothing when it exists). */
int ds_host_draws_space(ds_host_draws *h, int V, ds_err *err);
void ds_host_draws_free(ds_host_draws *h);
/* Draws n rows: row j's logits are in blocks of vp values (the last cut at V), block t at
 * x + t * stride + j * vp (one block of V: vp = V). d[j] NULL: not drawn; otherwise *out[j]
 * receives the token. Rows side by side on the OpenMP threads: each draw depends only on its row
 * and its own uniform. */
void ds_host_draws_run(ds_host_draws *h, int V, const float *x, size_t stride, int vp, int n,
                       const ds_row_draw *const *d, int32_t *const *out);

#endif
