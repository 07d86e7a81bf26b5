/* draft.h — the DSpark speculative draft (k3_dspark, docs/model.md §8), on the host or beside a
 * target on a GPU (the target's backend's draft path, src/backend/cuda/draft.c: the same steps
 * through that backend's kernels).
 *
 * The draft is a small MLA stack that reads the target's hidden states instead of its own tokens:
 *   1. context: every position j the target processes yields ctx_j = RMSNorm(W_context ·
 *      concat(target taps at j)); each draft layer caches one latent row per position from it
 *      (ds_draft_write_context).
 *   2. proposal: the block [anchor, mask, ..., mask] at positions p+1..p+T runs through the layers
 *      (non-causal inside the block, attending to context rows 0..p), the target's lm_head gives
 *      logits U[T][V], and a rank-r Markov walk turns them into T draft tokens (ds_draft_propose).
 *
 * The draft borrows the target's embed_tokens and lm_head (ds_model_embed / ds_model_lm_head): the
 * target must outlive the draft. Like ds_model, a ds_draft keeps scratch buffers, so one thread at
 * a time may use it; the per-sequence latent rows live in a ds_draft_cache owned by the caller. */
#ifndef DS_DRAFT_H
#define DS_DRAFT_H

#include "model/model.h"

typedef struct ds_draft ds_draft;

/* Loads DIR (config.json + safetensors of a k3_dspark draft) for `target`. Rejects a draft that
 * does not fit the target: hidden sizes (target_hidden_size and the draft's own, since it embeds
 * with the target's table), vocabulary, tap ids outside the target's layers, a different
 * target_num_hidden_layers. Binds every weight with its dtype and shape checked; a leading
 * "model." on tensor names is accepted. */
int ds_draft_load(const char *dir, const ds_model *target, ds_draft **out, ds_err *err);
/* Only what an earlier pipeline stage needs for the partial-sum tap relay: the config and
 * context_proj (ds_draft_context_add); every other call fails on it. On a stage without the
 * target's embedding, ds_draft_load binds the draft checkpoint's own embed_tokens copy. */
int ds_draft_load_context_only(const char *dir, const ds_model *target, ds_draft **out,
                               ds_err *err);
void ds_draft_free(ds_draft *d);
/* Does the draft run on the target's GPU? (Whenever the target does, unless DS_DRAFT_DEVICE=0;
 * then the caches ds_draft_cache_init makes are device memory.) */
int ds_draft_on_device(const ds_draft *d);
const ds_draft_config *ds_draft_config_of(const ds_draft *d);

/* The target layers to tap (target_layer_ids, ascending; -1 = embedding output), in the order
 * ds_draft_write_context expects them: pass both to ds_seq_batch's tap_layers / n_taps. */
int ds_draft_n_taps(const ds_draft *d);
const int *ds_draft_tap_layers(const ds_draft *d);

/* ---- RoPE / YaRN (docs/model.md §8.6) ---------------------------------------------------------
 */
typedef struct ds_yarn {
    int lo, hi; /* correction range: dims < lo keep inv_i, dims >= hi get inv_i / factor */
    double softmax_scale;  /* (dn+dr)^-1/2 * yarn_mscale(factor, mscale_all_dim)^2 */
    double cos_sin_mscale; /* yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) */
} ds_yarn;

/* Computes the YaRN table of config c: inv_freq [qk_rope_head_dim / 2] (may be NULL) and *y.
 * Without YaRN (factor <= 1) inv_freq is plain RoPE and lo = hi = 0. */
int ds_draft_yarn(const ds_draft_config *c, double *inv_freq, ds_yarn *y, ds_err *err);
/* The table the loaded draft uses (inv_freq [qk_rope_head_dim / 2]). */
const double *ds_draft_inv_freq(const ds_draft *d, ds_yarn *y);

/* ---- per-sequence latent cache ----------------------------------------------------------------
 */
/* One paged pool per draft layer: layer[l] holds [n_pages + n_spare * max_seqs][block_size][row]
 * floats, row = kv_lora_rank + qk_rope_head_dim, addressed through the sequence's block table like
 * ds_kv_pool. Pages n_pages.. are the proposals' own, n_spare for each of max_seqs at once: a
 * block pass copies the last, partly filled context page there and appends its block rows behind
 * it, so the attention kernel sees context and block as one paged sequence without a write into
 * the sequence's pages. */
typedef struct ds_draft_cache {
    float **layer; /* [n_layers] pointers (in dm's memory) */
    /* the target's GPU memory when the draft runs there (base/devmem.h copies reach the rows), or
     * NULL: the host's */
    const ds_dmem *dm;
    int n_layers, n_pages, n_spare, block_size, row;
    int max_block; /* largest T ds_draft_propose accepts with this cache */
    int max_seqs;  /* most sequences one ds_draft_propose_batch takes (a spare slot each) */
} ds_draft_cache;

/* ds_draft_cache_init_seqs for one sequence a proposal. */
int ds_draft_cache_init(ds_draft_cache *c, const ds_draft *d, int n_pages, int block_size,
                        int max_block, ds_err *err);
/* A cache with spare pages for max_seqs proposals at once (ds_draft_propose_batch): layer l holds
 * [n_pages + n_spare * max_seqs][block_size][row] floats. */
int ds_draft_cache_init_seqs(ds_draft_cache *c, const ds_draft *d, int n_pages, int block_size,
                             int max_block, int max_seqs, ds_err *err);
void ds_draft_cache_free(ds_draft_cache *c);

/* ---- forward ----------------------------------------------------------------------------------
 */
/* ctx [n][D] = RMSNorm_{context_norm}(W_context · concat_j taps[j]) for n positions
 * (docs/model.md §8.4); taps: [n_taps][n][target D], as ds_model_forward's tap capture writes them.
 */
int ds_draft_context(ds_draft *d, int n, const float *taps, float *ctx, ds_err *err);

/* Computes the ctx rows of positions pos0..pos0+n-1 from taps [n_taps][n][D] and writes every
 * draft layer's latent row [RMSNorm(kv[0:R]) | RoPE_pos(kv[R:R+dr])] at those positions. Rows of
 * rejected verify tokens are overwritten by the next call that covers their positions, so writing
 * ahead is harmless. block_table: pages covering positions [0, pos0+n). */
int ds_draft_write_context(ds_draft *d, ds_draft_cache *c, const int32_t *block_table, int pos0,
                           int n, const float *taps, ds_err *err);

/* acc [n][D] += W_context[:, tap j] taps[j - j0] for the taps j in [j0, j1) (taps
 * [j1-j0][n][Dt]), one tap at a time in tap order. The context is this sum over every tap before
 * context_norm; built on one rank or stage by stage (each stage adding its own taps and handing
 * acc on), it comes out the same to the bit, since the additions happen in the same order. */
int ds_draft_context_add(ds_draft *d, int n, int j0, int j1, const float *taps, float *acc,
                         ds_err *err);
/* ds_draft_write_context from a finished sum [n][D] (all taps added) instead of the taps. */
int ds_draft_write_context_sum(ds_draft *d, ds_draft_cache *c, const int32_t *block_table, int pos0,
                               int n, const float *sum, ds_err *err);
/* One sequence's context rows for ds_draft_write_context_batch: positions pos0..pos0+n-1 through
 * block_table, from taps [n_taps][n][Dt] or (taps NULL) a finished sum [n][D]. */
typedef struct ds_draft_ctx_write {
    const int32_t *block_table;
    int pos0, n;
    const float *taps, *sum;
} ds_draft_ctx_write;
/* The context writes of n_items sequences (a step's), every item of the same kind (taps or
 * sums), their rows through each matmul together (on the GPU one pass and one synchronisation;
 * on the CPU up to 512 rows a pass): each item's rows come out exactly as written alone. */
int ds_draft_write_context_batch(ds_draft *d, ds_draft_cache *c, int n_items,
                                 const ds_draft_ctx_write *w, ds_err *err);

/* Proposes T tokens after context rows 0..p (p = the last position the target has processed,
 * whose ctx row is written; the anchor, the token the target just produced, sits at p+1).
 * drafts [T] receive d_1..d_T; block_logits [T][V] (or NULL) receive U, the block's lm_head
 * logits before the Markov bias. The block's own latent rows stay in the cache's spare pages.
 * block_table: pages covering positions [0, p]. 1 <= T <= c->max_block. */
int ds_draft_propose(ds_draft *d, ds_draft_cache *c, const int32_t *block_table, int p,
                     int32_t anchor, int T, int32_t *drafts, float *block_logits, ds_err *err);
/* ds_draft_propose for n <= c->max_seqs sequences at once: sequence b's context through
 * block_tables[b] (rows 0..ps[b]), its anchor anchors[b], its drafts drafts[b T .. b T + T) and
 * (block_logits not NULL) its U at block_logits + b T V. On the CPU the block pass runs all n T
 * rows through each matmul together — a row's bits do not depend on the others, so each sequence
 * gets exactly the drafts ds_draft_propose gives it alone — and the walks step together. */
int ds_draft_propose_batch(ds_draft *d, ds_draft_cache *c, int n,
                           const int32_t *const *block_tables, const int *ps,
                           const int32_t *anchors, int T, int32_t *drafts, float *block_logits,
                           ds_err *err);

#endif
