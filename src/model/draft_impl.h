/* draft_impl.h — the inside of ds_draft, shared by the CPU draft (model_draft.c) and its GPU path
 * (backend/cuda/forward.c). Nothing outside src/model includes this. */
#ifndef DS_DRAFT_IMPL_H
#define DS_DRAFT_IMPL_H

#include "model/draft.h"

/* ---- weights ------------------------------------------------------------------------------ */

typedef struct draft_layer {
    float *in_norm, *post_norm; /* [D] */
    ds_mat q;                   /* [Ha*(dn+dr)][D] when q_lora_rank == 0 */
    ds_mat q_a, q_b;            /* [Rq][D], [Ha*(dn+dr)][Rq] */
    float *q_a_norm;            /* [Rq] */
    ds_mat kv_a;                /* [R+dr][D] */
    float *kv_a_norm;           /* [R] */
    ds_mat kv_b;                /* [Ha*(dn+dvh)][R]: per head W_UK [dn][R] then W_UV [dvh][R] */
    ds_mat o;                   /* [D][Ha*dvh] */
    ds_mat gate, up, down;      /* [I][D], [I][D], [D][I] */
} draft_layer;

struct ds_draft {
    ds_draft_config cfg;
    ds_st *st;
    const ds_mat *embed, *lm_head; /* the target's, [V][D] each */
    ds_mat own_embed;              /* [V][D] the checkpoint's copy, where the target has none */
    ds_mat context_proj;           /* [D][n_taps*Dt] */
    ds_mat *ctx_blocks;            /* [n_taps] W_context[:, tap j] as [D][Dt] matrices */
    void *ctx_block_data;          /* their storage (copies, in the checkpoint's dtype) */
    int context_only;              /* loaded for the partial-sum tap relay: context_proj only */
    float *context_norm;           /* [D] */
    float *final_norm;             /* [D] */
    draft_layer *layers;           /* [L] */
    ds_mat markov_w1, markov_w2;   /* [V][r] each */
    float *vecs;                   /* every norm weight, widened to f32 at load */
    double *inv_freq;              /* [dr/2] YaRN-corrected inverse frequencies */
    ds_yarn yarn;
    /* scratch, grown on demand */
    float *scratch; /* see carve() */
    size_t scratch_cap;
    int32_t *table; /* block table of one proposal's view (context pages + spare pages) */
    size_t table_cap;
    /* the same draft on the target's GPU (backend/cuda/forward.c), or NULL: then write_context and
     * propose run there, and the caches it makes are device memory */
    struct ds_draft_dev *dev;
};

/* cs [n][dr/2][2]: {cos, sin} * mscale of positions pos0 .. pos0+n-1 (YaRN), as the CPU path
 * turns its rows. */
void ds_draft_rope_table(const ds_draft *d, float *cs, int pos0, int n);

#ifdef DS_HAVE_CUDA
typedef struct ds_draft_dev ds_draft_dev;
/* The draft on the target's GPU (backend/cuda/forward.c): its weights uploaded (they live as long as the
 * target's; a vocabulary-parallel rank also uploads the whole lm_head), d->dev set. Returns DS_OK
 * leaving d->dev NULL for a target on the CPU or with DS_DRAFT_DEVICE=0. */
int ds_draft_dev_create(ds_draft *d, const ds_model *target, ds_err *err);
void ds_draft_dev_free(ds_draft *d);
/* The device forms of ds_draft_write_context_batch (every item's rows in one pass; inputs in
 * host memory) and of ds_draft_propose_batch (n sequences in one block pass, sequence b in the
 * cache's spare slot b; the walks step together, one synchronisation a step); the cache's layers
 * are device memory. Same contracts as the CPU's (arguments already checked there). */
int ds_draft_dev_write_context(ds_draft *d, ds_draft_cache *c, int n_items,
                               const ds_draft_ctx_write *w, ds_err *err);
int ds_draft_dev_propose(ds_draft *d, ds_draft_cache *c, int n, const int32_t *const *block_tables,
                         const int *ps, const int32_t *anchors, int T, int32_t *drafts,
                         float *block_logits, ds_err *err);
#endif

#endif
