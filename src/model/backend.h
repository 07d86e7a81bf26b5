/* backend.h — the seam between the model and the device it runs on: one table of operations
 * (ds_backend_ops) a backend, chosen once when the model loads (ds_backend_find, in
 * src/backend/registry.c), as calm picks its forward and ggml installs a backend interface.
 * model.c and model_draft.c reach a device only through this table; each backend keeps its
 * per-model state (its copy of the weights, scratch, step buffers) behind m->be_ctx. The CPU
 * backend lives in src/backend/cpu, the CUDA one in src/backend/cuda.
 *
 * Per-step decisions that every backend makes alike (which MLA form, which KDA form a segment
 * takes) are made once above the backends, in model.c, and handed down as a ds_step_plan.
 *
 * (This header names the model's types by their struct tags, so that it does not include
 * model.h: model.c includes it, and model.h must not come back here.) */
#ifndef DS_MODEL_BACKEND_H
#define DS_MODEL_BACKEND_H

#include "base/ds_base.h"

#include <stdint.h>
#include <stdio.h>

struct ds_model;
struct ds_kv_pool;
struct ds_seq_batch;
struct ds_stage_io;
struct ds_draft;
struct ds_draft_cache;
struct ds_draft_ctx_write;

/* What model.c decided about a step, after validating its segments (ds_model_forward_stage). */
typedef struct ds_step_plan {
    int T;          /* tokens of the step in all (> 0) */
    const int *off; /* [n_seq] the first row of each segment among the T, in segment order */
    /* [n_seq] 1: the segment's MLA runs in the expanded form (the model has MLA layers and the
     * segment has at least opts.mla_expanded_min tokens); 0: the absorbed form, consecutive
     * absorbed segments as one run */
    const uint8_t *mla_expanded;
    /* [n_seq] 1: the segment's KDA recurrence may run in chunks (the model has KDA layers, the
     * segment has at least opts.kda_chunked_min tokens and keeps no verify state rows); 0: the
     * recurrent form (a backend whose chunked kernel cannot take the shape also runs it so) */
    const uint8_t *kda_chunked;
    /* some segment's rows are drawn (ds_seq_batch.draws with argmax and logit rows) and this is
     * the last stage: a backend that draws on the host makes that memory before the step */
    int draws;
} ds_step_plan;

typedef struct ds_backend_ops {
    const char *name; /* "cpu", "cuda" (ds_device_names) */
    /* 1: the per-sequence state the engine allocates (KDA slots, the latent pool, verify rows)
     * is device memory (base/devmem.h), and random weights are drawn on the device (model.c
     * binds ds_rand_mat descriptors instead of elements) */
    int device_memory;
    /* is the backend's device present? (device auto) */
    int (*available)(void);
    /* Takes the bound weights of m (m->layers [l0, l1), embed, lm_head, ...) where they run and
     * sets m->be_ctx; on failure leaves m->be_ctx NULL (and frees what it made). */
    int (*attach)(struct ds_model *m, int device_index, ds_err *err);
    /* Frees m->be_ctx (nothing when NULL) and sets it NULL. */
    void (*detach)(struct ds_model *m);
    /* One step of n_seq segments, validated by model.c and described by plan; in / out as
     * ds_model_forward_stage's. */
    int (*forward)(struct ds_model *m, const ds_step_plan *plan, struct ds_kv_pool *pool,
                   struct ds_seq_batch *seqs, int n_seq, const struct ds_stage_io *in,
                   struct ds_stage_io *out, ds_err *err);
    size_t (*mem_free)(const struct ds_model *m); /* free device memory in bytes (0: none) */
    /* The memory m's state lives in (base/devmem.h): the device m is attached to, or NULL (the
     * host's; also a NULL entry) */
    const struct ds_dmem *(*dmem)(const struct ds_model *m);
    const char *(*device_name)(const struct ds_model *m);
    /* copy bandwidth (GB/s) and BF16 GEMM rate (TFLOP/s) of the device, measured now */
    int (*limits)(const struct ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err);
    void (*profile_report)(const struct ds_model *m, FILE *f, const char *title);
    /* *ms_per_step is 0 on entry */
    double (*profile_gemm_tflops)(const struct ds_model *m, double *ms_per_step);

    /* The DSpark draft beside the target on the device; NULL entries: the draft runs on the host
     * (model_draft.c). draft_create uploads the draft's weights and sets d->dev, or leaves it
     * NULL (the draft then runs on the host); the others are called only with d->dev set.
     * write_context and propose are the device forms of ds_draft_write_context_batch and
     * ds_draft_propose_batch, their arguments already checked by model_draft.c. */
    int (*draft_create)(struct ds_draft *d, const struct ds_model *target, ds_err *err);
    void (*draft_free)(struct ds_draft *d);
    int (*draft_write_context)(struct ds_draft *d, struct ds_draft_cache *c, int n_items,
                               const struct ds_draft_ctx_write *w, ds_err *err);
    int (*draft_propose)(struct ds_draft *d, struct ds_draft_cache *c, int n,
                         const int32_t *const *block_tables, const int *ps, const int32_t *anchors,
                         int T, int32_t *drafts, float *block_logits, ds_err *err);
} ds_backend_ops;

/* The backend of device (DS_DEVICE_CPU, DS_DEVICE_CUDA, or DS_DEVICE_AUTO: CUDA when this build
 * has it and a GPU is present, else the CPU); NULL with a message when this build has none for
 * it. Defined in src/backend/registry.c, the one place that knows which backends are built. */
const ds_backend_ops *ds_backend_find(int device, ds_err *err);

#endif
