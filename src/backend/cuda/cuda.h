/* cuda.h — the CUDA backend: the forward pass and the DSpark draft on one GPU a process, through
 * kernels/cuda. The backend registry (src/backend/registry.c) hands out its table when the build
 * has it (`make cuda`). */
#ifndef DS_BACKEND_CUDA_H
#define DS_BACKEND_CUDA_H

#include "model/backend.h"
#include "sample/sampler.h"

extern const ds_backend_ops ds_cuda_backend;

/* Row `row`'s draw d as the GPU's draw kernel reads it (ds_cu_draw_rows): *out, and its edits
 * (penalised (id, count) pairs, then masked ids) written at edits[at..]; returns how many.
 * (draw.c; tests/cuda packs its cases with it, as the model does.) */
struct ds_cu_draw;
size_t ds_cuda_pack_draw(const ds_row_draw *d, int V, int row, size_t at, int32_t *edits,
                         struct ds_cu_draw *out);

#endif
