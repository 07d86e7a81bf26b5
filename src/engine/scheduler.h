/* scheduler.h — decides what runs in each step: continuous batching over two pools (MLA latent
 * pages and KDA state slots), chunked prefill, preemption by recompute.
 *
 * Policy (nano-vllm / vLLM style, adapted to recurrent state):
 *  - Running sequences in decode get one token each, oldest first. A sequence that needs a new
 *    page and cannot get one preempts the YOUNGEST running sequence (its pages and slot are freed,
 *    it goes back to the waiting queue at its arrival position and is recomputed later); if the
 *    needy sequence is itself the youngest, it is the one preempted. The oldest request is kept.
 *  - Then prompts (running sequences still in prefill, then waiting ones in arrival order) get
 *    chunks while the step's token budget, max_num_seqs and the pools allow. A waiting sequence is
 *    admitted only if a slot and the pages for its first chunk are free.
 *  - Prompt chunks are cut only at absolute multiples of chunk_tokens and at the prompt's end (a
 *    preempted sequence's recompute cuts there too). A sequence's prompt is always split at the
 *    same positions whatever else is in the batch and whatever the prefix cache holds, so its
 *    numerics — and its greedy output — depend on neither. Checkpoint rungs are a subset of these
 *    cuts, so a step that ends on a rung leaves the slot holding exactly the state a checkpoint
 *    needs. A chunk that does not fit the remaining budget waits for the next step; a lone
 *    chunk larger than the whole budget is impossible because chunk_tokens <=
 *    max_num_batched_tokens.
 *  - FCFS admission: a waiting sequence is never overtaken by a younger one (no starvation).
 *  - With a prefix cache, admission first resumes the sequence from the deepest cached prefix
 *    (shared pages + a checkpoint fork, see cache/prefix.h) and then needs pages only for the
 *    rest; a release gives shared pages back tail first, so the page LRU evicts prefixes from
 *    their ends.
 */
#ifndef DS_SCHEDULER_H
#define DS_SCHEDULER_H

#include "base/ds_base.h"
#include "cache/pages.h"
#include "cache/prefix.h"
#include "cache/sequence.h"
#include "cache/state.h"

typedef struct ds_sched_opts {
    int block_size, max_num_seqs, max_num_batched_tokens, chunk_tokens;
} ds_sched_opts;

/* One sequence's part of a step: tokens[pos0 .. pos0+n) run now; `sample` is set when the last
 * of them is the sequence's last token (the step's logits produce its next token). */
typedef struct ds_sched_item {
    ds_seq *seq;
    int pos0, n;
    int sample;
} ds_sched_item;

typedef struct ds_scheduler ds_scheduler;

int ds_sched_create(const ds_sched_opts *o, ds_page_pool *pages, ds_slot_pool *slots,
                    ds_scheduler **out, ds_err *err);
void ds_sched_free(ds_scheduler *s); /* frees every sequence still held */
/* Turns prefix caching on (px not owned; NULL turns it off). Set before adding sequences. */
void ds_sched_set_prefix(ds_scheduler *s, ds_prefix *px);

/* Adds a new sequence (status WAITING). Fails if it can never fit the pools. */
int ds_sched_add(ds_scheduler *s, ds_seq *seq, ds_err *err);
/* Plans one step into items[0..*n_items) (capacity max_num_seqs). Sequences preempted while
 * planning are reported in preempted[0..*n_preempted) (capacity max_num_seqs) so the caller can
 * count them. A slot newly given to a sequence is zeroed by the slot pool. */
void ds_sched_schedule(ds_scheduler *s, ds_sched_item *items, int *n_items, ds_seq **preempted,
                       int *n_preempted);
/* After the step ran: n_computed += n for each item. */
/* Pipelined steps (P micro-batch groups in flight): from now on schedule only sequences of group
 * g of n_groups; admission puts newcomers into g, and only g's sequences are preempted (the
 * others have a step in flight). n_groups <= 1: every sequence, as without pipelining. */
void ds_sched_set_group(ds_scheduler *s, int g, int n_groups);

/* Drafts at admission: fn(ctx, q) is called for a sequence being admitted with exactly one token
 * left to compute (a prefix hit one token short of its end) and may append drafts to it (setting
 * q->n_spec), so that its first step — the one that forks the checkpoint — is already a verify.
 * Every rank of a job must propose the same drafts. */
void ds_sched_set_admit_drafts(ds_scheduler *s, int (*fn)(void *ctx, ds_seq *q), void *ctx);

void ds_sched_commit(ds_scheduler *s, const ds_sched_item *items, int n_items);
/* Removes a sequence (finished or aborted) from the scheduler and returns its pages and slot.
 * The caller still owns seq (ds_seq_free). */
void ds_sched_remove(ds_scheduler *s, ds_seq *seq, ds_seq_status final_status);
int ds_sched_n_running(const ds_scheduler *s);
int ds_sched_n_waiting(const ds_scheduler *s);
/* Visits every held sequence (for abort-all at shutdown). */
int ds_sched_collect(const ds_scheduler *s, ds_seq **out, int cap);
/* Running sequences of the current group into out[0..return) (at most cap): what a test may
 * preempt (ds_sched_preempt). */
int ds_sched_running(const ds_scheduler *s, ds_seq **out, int cap);
/* Preempts running sequence v of the current group now, exactly as the pools running dry would
 * (pages and slot freed, back among the waiting by arrival, recomputed from its prompt later),
 * so that a test can replay one run's preemptions in another (tests/cachefuzz). Only between
 * steps, never for a sequence with a step in flight. v need not be the youngest running one, so
 * the waiting may for a while hold a sequence older than a running one (the FCFS order the
 * scheduler keeps); with pools that hold every sequence, as such a test's have, it is admitted
 * again at the next step. Returns 1 when v was preempted, 0 when it is not running in the current
 * group. */
int ds_sched_preempt(ds_scheduler *s, ds_seq *v);

#endif
