/* sequence.h — one request's tokens and the memory that holds its state: the block table of MLA
 * latent pages, the KDA state slot, and the prefix cache's bookkeeping of what it has filed.
 * Below both the scheduler (engine/scheduler.h), which decides when a sequence runs, and the
 * prefix cache (cache/prefix.h), which files and matches its blocks; neither includes the other.
 */
#ifndef DS_SEQUENCE_H
#define DS_SEQUENCE_H

#include "base/ds_base.h"

typedef struct ds_seq ds_seq;

typedef enum {
    DS_SEQ_WAITING = 0,
    DS_SEQ_RUNNING,
    DS_SEQ_PREEMPTED, /* waiting again, to be recomputed */
    DS_SEQ_FINISHED,
    DS_SEQ_ABORTED,
} ds_seq_status;

struct ds_seq {
    int64_t id;
    uint64_t arrival; /* submission order; smaller = older */
    int32_t *tokens;  /* [cap] prompt followed by generated tokens */
    int n_tokens, cap;
    int n_prompt;
    int n_computed;       /* tokens already summarised by the slot and written to pages */
    int32_t *block_table; /* [cap_blocks] page ids covering positions [0, n_blocks*block_size) */
    int n_blocks, cap_blocks;
    int slot;   /* KDA state slot, -1 when none */
    int n_spec; /* trailing tokens that are speculative drafts, not yet accepted: they run
                   with the token before them as one verify item and never alone */
    ds_seq_status status;
    /* prefix caching (cache/prefix.c owns these; all empty when it is off) */
    int32_t *entry;   /* [cap_blocks] prefix-index entry of block b, for b < n_filed */
    int n_filed;      /* blocks [0, n_filed) are filed in (or were matched from) the index */
    int chain_broken; /* a block's hash was taken by other tokens: file nothing further */
    int32_t *rungs;   /* [cap_rungs] ascending positions where a checkpoint is filed */
    int n_rungs, cap_rungs;
    int rungs_planned;
    int fork_ckpt; /* checkpoint slot copied into `slot` before the next step; -1 none */
    int settled;   /* n_computed when the prefix cache last filed for it (or the matched depth):
                      every rung up to here has had its checkpoint filed */
    int max_len;   /* n_tokens never exceeds this (prompt + max_tokens, capped by context) */
    int group;     /* pipelined steps: the micro-batch group it runs in (-1: none yet) */
    int evict;     /* pipelined steps: an older sequence of another group needs its pages; it is
                      preempted when its own group is next scheduled (its step is in flight) */
    void *owner;   /* the engine's per-request data */
};

/* The end of q's next step from n_computed: the cut rule of the numeric contract (scheduler.c). */
int ds_seq_next_cut(const ds_seq *q, int chunk_tokens, int block_size);
/* Creates a sequence holding a copy of the prompt. */
ds_seq *ds_seq_new(int64_t id, const int32_t *prompt, int n_prompt, int max_len, ds_err *err);
int ds_seq_append(ds_seq *s, int32_t token, ds_err *err);
void ds_seq_free(ds_seq *s);
/* Grows the block table (and the parallel prefix entries) to hold n blocks. */
int ds_seq_reserve_blocks(ds_seq *s, int n);

#endif
