/* draft_impl.h — the inside of ds_draft, shared by the host draft (model_draft.c) and the device
 * path a backend gives it (ds_backend_ops.draft_*; src/backend/cuda/draft.c). Nothing outside
 * src/model and src/backend includes this. */
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
    /* the target's backend, and the same draft on its device (be->draft_create), or NULL: with
     * it, write_context and propose run there (be->draft_*), and the caches made are device
     * memory */
    const struct ds_backend_ops *be;
    void *dev;
    const ds_dmem *dm; /* the target's memory (ds_model_dmem), where the caches live with dev */
};

/* cs [n][dr/2][2]: {cos, sin} * mscale of positions pos0 .. pos0+n-1 (YaRN), as the host path
 * turns its rows. */
void ds_draft_rope_table(const ds_draft *d, float *cs, int pos0, int n);

#endif
