/* prefix.h — prefix caching with recurrent state: full MLA pages filed under a chained hash, KDA
 * checkpoints filed at rungs, and resuming a new sequence from the deepest prefix that has both.
 *
 * Index: one entry per cached block, keyed by h_i = XXH3-128(seed; h_{i-1} || tokens of block i)
 * with h_0 = 0 and the seed naming the model. An entry stores its block's token ids and its
 * parent entry, and a lookup accepts it only when both match what the walk came from, so a hash
 * collision is a miss, never another user's prefix. An entry lives while it holds a page, holds a
 * checkpoint, has children, or lies on a live sequence's chain (pinned); parents therefore always
 * outlive their children and the parent link stays sound.
 *
 * Pages: a filed page is marked cached in the page pool; unreferenced it stays cached until the
 * pool evicts it (LRU), when this module offloads it (if a tier is set) and forgets it.
 * Checkpoints: copies of a sequence's slot taken right after a step ended exactly on a rung,
 * kept in their own slot pool with LRU eviction. Rungs are cuts the scheduler makes anyway
 * (multiples of chunk_tokens that are page boundaries), so the cache never changes how a prompt is
 * cut: every interval_tokens, the deepest one a repeat of the prompt can resume from, and demand
 * rungs (depths where a lookup found pages but no checkpoint). Only blocks computed in whole
 * chunk-sized prompt steps are filed, never rows of decode steps (docs/prefix-cache.md).
 *
 * All calls come from the engine thread (the scheduler and the step loop). */
#ifndef DS_PREFIX_H
#define DS_PREFIX_H

#include "base/ds_base.h"
#include "cache/offload.h"
#include "cache/pages.h"
#include "cache/state.h"
#include "model/model.h"

#include "cache/sequence.h"
typedef struct ds_prefix ds_prefix;

typedef struct ds_prefix_opts {
    int block_size;
    int interval_tokens; /* rung spacing; snapped down to block_size (at least one page) */
    int n_ckpt_slots;    /* checkpoint pool size; 0 disables checkpoints (and thus hits) */
    uint64_t seed;       /* model identity, mixed into every hash */
    int test_hash_bits;  /* tests only: > 0 keeps this many low hash bits, forcing collisions */
    /* the memory of the checkpoint slots and the latent pool (base/devmem.h: the model's, NULL
     * the host's); must outlive the cache */
    const ds_dmem *dm;
    int chunk_tokens; /* the scheduler's cut spacing (0: block_size); rungs fall on its
                         multiples, so they never add cuts */
} ds_prefix_opts;

typedef struct ds_prefix_stats {
    uint64_t query_tokens, hit_tokens; /* over admitted sequences: tokens looked up / resumed */
    uint64_t ckpt_kept;                /* rung checkpoints filed */
    uint64_t ckpt_dropped; /* rungs reached that could not be filed (pool pinned, chain broken) */
    uint64_t ckpt_evicted; /* filed checkpoints evicted for room (LRU) */
    uint64_t forks;        /* checkpoints copied into a sequence's slot */
    uint64_t pages_filed, pages_evicted, collisions;
    uint64_t page_loads, ckpt_loads; /* from the offload tier */
    uint64_t reentries; /* a load or store started inside another (a bug; tests assert 0) */
    int ckpt_total, ckpt_used, entries;
} ds_prefix_stats;

/* kv: the latent pool whose pages are offloaded; off: may be NULL. Installs the page pool's
 * evict hook. slot_floats: size of one KDA slot. */
int ds_prefix_create(const ds_prefix_opts *o, size_t slot_floats, ds_page_pool *pages,
                     ds_kv_pool *kv, ds_offload *off, ds_prefix **out, ds_err *err);
void ds_prefix_free(ds_prefix *px);
/* In a TP x PP job: agree(ctx, v) returns the smallest v over all ranks (a collective every rank
 * reaches in the same order, since all run the same schedule). Offload hits go through it. */
/* Rows another cache keeps per MLA page (the DSpark draft's context latents: layers[j] holds
 * [n_pages...][block_size][row] floats, addressed by the same page ids): offloaded and loaded
 * with the page, so a prefix that comes back from a tier brings its draft context too. */
int ds_prefix_add_page_rows(ds_prefix *px, float **layers, int n_layers, int row, ds_err *err);
void ds_prefix_set_agree(ds_prefix *px, int (*agree)(void *ctx, int v), void *ctx);

/* out = hash of a block given its parent's hash (NULL for the root). */
void ds_prefix_hash_block(const ds_prefix *px, const uint64_t *parent, const int32_t *tokens,
                          uint64_t out[2]);

/* At admission of a sequence holding nothing (n_computed 0, no pages): plans its rungs, finds
 * the deepest usable prefix (pages and a checkpoint, at most n_tokens - 1 tokens, loading missing
 * pieces from the offload tier) and gives it to q: shared pages (ref'd) in its block table,
 * n_computed = depth, fork_ckpt = the pinned checkpoint. Returns the depth in tokens (0: none). */
int ds_prefix_match(ds_prefix *px, ds_seq *q);
/* The sequence matched above was admitted (counts the query and the hit). */
void ds_prefix_admitted(ds_prefix *px, const ds_seq *q);
/* Drops q's claims on the index (chain pins, a pending fork). Its pages are the caller's. */
void ds_prefix_release(ds_prefix *px, ds_seq *q);
/* Before q's first step after a hit: copies the checkpoint into slot [slot_floats]. 1 if done. */
int ds_prefix_take_fork(ds_prefix *px, ds_seq *q, float *slot);
/* After a step committed: files q's newly full blocks and, when n_computed is one of its rungs,
 * a checkpoint copied from slot (the state after exactly n_computed tokens). */
void ds_prefix_on_computed(ds_prefix *px, ds_seq *q, const float *slot);
/* Would a step of q starting at pos0 have to wait for a checkpoint? 1 when pos0 is one of q's
 * rungs and the step that ended there has not been filed yet (ds_prefix_on_computed). The engine
 * files in each step's completion, before the sequence's next step is planned, so this never
 * happens; the engine counts it (the `checkpoint holds` metric) to show that it does not. */
int ds_prefix_would_hold(const ds_prefix *px, const ds_seq *q, int pos0);
/* q finished: hands its filed pages and checkpoints to the offload tier (if any). */
void ds_prefix_on_finish(ds_prefix *px, ds_seq *q);
/* Hands q's filed blocks to another server (prefill/decode disaggregation, docs/pd.md): for each
 * filed page and each checkpoint still held, in chain order, sink gets its kind ('p' / 'c', as in
 * the offload tier), prefix hash, the depth in tokens (its key is q->tokens[0, n_tokens)) and the
 * payload exactly as the offload tier would store it. The payload pointer is valid during the
 * call only. Returns the number of blocks, or -1 when sink failed. */
typedef int (*ds_prefix_sink)(void *ctx, char kind, const uint64_t hash[2], int n_tokens,
                              const void *data, size_t n_bytes);
int ds_prefix_export(ds_prefix *px, const ds_seq *q, ds_prefix_sink sink, void *ctx);
/* What ds_prefix_export(px, q, ...) would hand out: *n_pages pages, *n_ckpts checkpoints (so a
 * caller sizes its buffer once instead of growing it). */
void ds_prefix_export_counts(const ds_prefix *px, const ds_seq *q, int *n_pages, int *n_ckpts);
/* Bytes of a page's payload in the offload tier and in a transfer. */
size_t ds_prefix_page_bytes(const ds_prefix *px);
void ds_prefix_get_stats(const ds_prefix *px, ds_prefix_stats *s);
/* Tokens between interval rungs: the interval snapped to a multiple of lcm(chunk, block). */
int ds_prefix_rung_interval(const ds_prefix *px);

#endif
