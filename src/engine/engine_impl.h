/* engine_impl.h — the engine's private state and the functions its files share. The engine is
 * split the way nano-vllm and vLLM v1 split theirs: setup.c (options, pools, prefix caching,
 * create/free, the thread), request.c (submit, abort, the inbox, a request's lifetime and its
 * events), sampling.c (stop ids, where a row is drawn, choosing and delivering a token), spec.c
 * (draft proposers, verify, drafts riding on sequences, the DSpark taps), ranks.c (the messages of
 * a TP x PP job and the tap relays), step.c (a step's launch and completion, the engine thread's
 * loop) and stats.c (the snapshot /metrics reads).
 *
 * Threads: the HTTP threads call submit/abort, which only touch the inbox under `mu`; the engine
 * thread owns everything else (scheduler, sequences, pools) without locking.
 *
 * Speculative decoding's one name for "drafts proposed per verify" is num_speculative_tokens (the
 * option's name); a step's item carries up to that many drafts plus its own token, so the per-item
 * row buffers below hold num_speculative_tokens + 1 rows. ds_seq.n_spec is another quantity: the
 * drafts riding on one sequence now (at most num_speculative_tokens). */
#ifndef DS_ENGINE_IMPL_H
#define DS_ENGINE_IMPL_H

#include "engine/engine.h"

#include "cache/offload.h"
#include "cache/prefix.h"
#include "engine/scheduler.h"
#include "engine/textout.h"
#include "model/draft.h"
#include "model/model.h"
#include "parallel/pipeline.h"
#include "sample/sampler.h"
#include "text/grammar.h"
#include "transport/comm.h"
#include "transport/xfer.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

struct pd_rank; /* pd.c */
typedef struct request request;

/* One of a request's n choices: a sequence of its own. */
typedef struct choice {
    request *req;
    int index; /* which choice of req (0..n-1) */
    ds_seq *seq;
    ds_rng rng;
    ds_token_counts counts; /* generated tokens, for presence/frequency penalties */
    ds_textout text;
    int n_generated;
    int in_sched; /* added to the scheduler (so it must be removed from it) */
    int done;
    int32_t drafts[DS_MAX_SPEC]; /* [n_drafts] proposed continuation after the last token */
    int n_drafts;
    int busy; /* its sequence has a step in flight (launched, outcome not yet applied) */
    /* constrained decoding (request grammar): the output's place in the grammar and its mask
     * [ds_grammars_mask_words]; made on the sampling rank at the choice's first sample */
    ds_matcher *gm;
    uint32_t *gmask;
    int gm_broken; /* the grammar could not be followed (said on stderr): eos is forced */
} choice;

struct request {
    int64_t id;
    ds_request_spec spec; /* prompt points into `prompt` */
    int32_t *prompt;      /* [n_prompt] own copy */
    choice *choices;      /* [n] */
    int n_done;
    int aborted;
    int owns_stop;      /* a mirrored request (not the head): spec.params.stop strings are ours */
    uint64_t seed_base; /* choice i draws from seed_base + i */
    ds_kv_pull *kv_import; /* P/D consumer: blocks to install before admission (owned) */
    request *next;         /* inbox / live list */
};

/* One step between its launch (schedule, forward, the sampling rank's choices) and its completion
 * (every rank applies the outcome). Without pipelining a step completes right after it is
 * launched; with P pipeline stages P steps are in flight, each for its own group of sequences,
 * and a step's outcome is applied when its group's turn comes again. Rows: R =
 * num_speculative_tokens + 1. */
typedef struct inflight {
    int active, n_items, n_prompt_tokens;
    double t0;
    ds_sched_item *items;           /* [max_num_seqs] */
    int32_t (*vt)[DS_MAX_SPEC + 1]; /* [max_num_seqs][R] tokens to deliver */
    ds_logprobs_out *vlp;           /* [max_num_seqs][R] */
    int *va;                        /* [max_num_seqs] accepted drafts, -1: not a verify */
    int32_t (*dr)[DS_MAX_SPEC];     /* [max_num_seqs][num_speculative_tokens] the next drafts */
    int *n_dr;                      /* [max_num_seqs] */
    float *state_rows; /* [max_num_seqs][R][slot floats] KDA slot after each verify row */
} inflight;

struct ds_engine {
    ds_engine_opts opts;
    char *model_dir;
    ds_model *model;
    ds_tokenizer *tok;
    int chat_format;
    ds_kv_pool kv;
    const ds_dmem *dm; /* the model's memory: slots, pages and verify rows (NULL: the host's) */
    ds_page_pool *pages;
    ds_slot_pool *slots;
    ds_prefix *prefix;   /* NULL when prefix caching is off */
    ds_offload *offload; /* NULL when no tier is configured */
    ds_scheduler *sched;
    int max_model_len;
    int V;

    pthread_t thread;
    int started;
    pthread_mutex_t mu;
    pthread_cond_t wake;
    request *inbox, *inbox_tail; /* submitted, not yet seen by the engine thread */
    int64_t *aborts;             /* [n_aborts] ids to abort */
    int n_aborts, cap_aborts;
    int n_queued; /* requests in inbox + waiting, for the queue limit */
    int stopping;
    double stop_deadline;
    int64_t next_id;

    request *live; /* engine thread only: requests with choices not yet done */

    /* step buffers, engine thread only; R = num_speculative_tokens + 1 rows per item */
    inflight *fl;      /* [n_fl] steps in flight, used round robin */
    int n_fl;          /* P with pipelined stages, else 1 */
    uint64_t micro;    /* steps launched so far */
    int chunk_tokens;  /* prompt cut spacing (scheduler.h) */
    int64_t *deferred; /* [n_deferred] aborts of requests with a step in flight */
    int n_deferred, cap_deferred;
    ds_seq **preempted; /* [max_num_seqs] */
    /* tests (force_preempt): the choices the head's hook preempts before the next step is
     * planned, as (request id, choice index); in a job they travel in the step plan */
    int64_t *forced_req; /* [max_num_seqs] */
    int32_t *forced_ch;  /* [max_num_seqs] */
    int n_forced;
    /* launches in a row that planned nothing while requests were live, since when, and whether
     * that stall has been reported (step.c: watch_idle) */
    uint64_t idle_launches;
    double idle_t0;
    int stall_reported;
    ds_seq_batch *batch; /* [max_num_seqs] */
    float *logits;       /* [max_num_seqs][R][V] */
    int32_t *argmax;     /* [max_num_seqs][R] greedy tokens picked beside the logits */
    /* rows the model draws where their logits are (ds_seq_batch.draws), [max_num_seqs][R]; their
     * penalised counts [cap_dcounts] and stop ids [max_num_seqs][DS_MAX_STOP + 1] */
    ds_row_draw *draws;
    ds_token_count *dcounts;
    size_t cap_dcounts;
    int32_t *dstops;
    uint32_t *dallow; /* [max_num_seqs][R][ceil(vocab / 32)] constrained rows' masks, made at
                         the first step that draws one (eng_allow_rows) */
    ds_sample_scratch **scratch; /* [n_scratch]: one per sampling thread */
    int n_scratch;
    /* The constrained rows' masks beside the forward (sampling.c): on a GPU the host is free
     * while a step runs, so a thread of its own fills them then, and the backend waits for them
     * before the draws read them (ds_model_set_draw_wait). */
    int mask_async;
    pthread_t mask_thread;
    pthread_mutex_t mask_mu;
    pthread_cond_t mask_cv;    /* a job posted, or done */
    struct inflight *mask_job; /* the step whose masks are being made (NULL: none) */
    int mask_stop;
    /* seconds of constrained decoding not yet in stats (added as each step completes): making
     * masks (either thread; the mask thread's are read only after eng_masks_wait), the step
     * waiting for them, and the matchers taking chosen tokens */
    double g_mask_s, g_wait_s, g_accept_s;

    /* speculative decoding: drafts proposed per verify (0: off; opts.num_speculative_tokens
     * when a method is on) */
    int num_speculative_tokens;
    ds_draft *draft; /* dspark */
    /* a step's proposals, gathered for one ds_draft_propose_batch: item, block table, position of
     * the last context row, anchor of each ([max_num_seqs]); drafts
     * [max_num_seqs][num_speculative_tokens] */
    int *prop_item, *prop_p;
    const int32_t **prop_table;
    int32_t *prop_anchor, *prop_drafts;
    ds_draft_ctx_write *ctx_w; /* [max_num_seqs] a step's context writes, made together */
    ds_draft_cache dcache;     /* the draft's latent rows, addressed by the same pages */
    float *taps;               /* [sum of item tokens][n_taps][D] this step's draft taps */
    /* DSpark taps in a job: every rank knows the tap layers; stage s holds taps [j0, j1) */
    int n_taps;                                       /* taps this rank captures (0: none) */
    int n_tap_ids;                                    /* taps of the draft */
    int tap_ids[DS_MAX_LAYERS + 1];                   /* [n_taps] target_layer_ids */
    int tap_j0[DS_MAX_LAYERS], tap_j1[DS_MAX_LAYERS]; /* [n_stages] each stage's tap range */
    ds_draft *draft_ctx; /* partial-sum relay on an earlier stage: context_proj only */
    float *relay;        /* [tokens][D] partial sum, or packed taps of one stage */
    size_t relay_cap;    /* floats */
    int32_t *after;      /* [after_cap] a sequence's tokens after a step, for drafting */
    size_t after_cap;
    size_t taps_cap; /* floats */

    ds_engine_stats stats; /* guarded by mu */

    /* constrained decoding: llguidance over the model's vocabulary, made on first use (g_tried)
     * under gmu; g_why says why it could not be (the library is absent) */
    pthread_mutex_t gmu;
    ds_grammars *grammars;
    int g_tried;
    char g_why[1024];

    /* tensor / pipeline parallelism (opts.comm); dist = 0 for one process */
    ds_comm *comm;
    int dist;
    int head;         /* world rank 0: takes submits, emits events */
    int sampler;      /* this rank samples: last stage, TP rank 0 */
    int sampler_rank; /* world rank of the sampling rank */
    int last_stage;   /* this rank computes logits */
    ds_pp_bufs ppb;   /* stage-boundary buffers */

    /* P/D (pd.c) */
    ds_xfer_server *xfer;    /* producer: the store consumers pull from */
    ds_xfer_client *xclient; /* consumer: this rank's connections to producers, its buffers */
    uint64_t kv_seed;        /* the prefix cache's model identity (TP width included) */
    uint64_t kv_xseed; /* the same without the TP width: what a transfer's two ends must share */
    struct pd_rank *pd_ranks; /* [comm size] every rank of this job as a transfer names it */
};

/* ---- request.c: requests, choices, events ---------------------------------------------------- */

/* A request with its choices and their sequences (prompt copied); id and seed fixed by the caller.
 * The head makes one per submit; the other ranks of a job make the same from the step plan. */
request *eng_request_new(ds_engine *e, const ds_request_spec *spec, int64_t id, uint64_t seed_base,
                         ds_err *err);
void eng_request_free(request *r);
/* Sends a choice's event to its client (a no-op on a rank other than the head). */
void eng_emit(choice *ch, int32_t token, const char *text, size_t len, const ds_logprobs_out *lp,
              ds_finish finish);
/* Ends a choice: removes its sequence, flushes held text, sends the final event. When the last
 * choice ends, the request leaves the live list and is freed. */
void eng_finish_choice(ds_engine *e, choice *ch, ds_finish why);
void eng_abort_request(ds_engine *e, request *r);
/* Aborts requests whose step completed since their abort came in. */
void eng_retry_deferred_aborts(ds_engine *e);
/* Head (tests): asks the force_preempt hook which running sequences of the group about to be
 * scheduled to preempt, into e->forced_* (the step plan carries them to the other ranks). */
void eng_ask_force(ds_engine *e);
/* Moves the inbox into the scheduler and applies aborts. Returns 1 when the engine should exit. */
int eng_take_inbox(ds_engine *e);

/* ---- sampling.c: the sampling glue ------------------------------------------------------------
 */

/* Penalised counts a step's draws of one choice need: each row's table and the drafts before it. */
size_t eng_draw_counts_need(const choice *ch, int n_rows);
/* How the coming step gets a choice's tokens: picked greedy beside the logits, drawn where the
 * logits are, or (neither) its rows come back to be sampled here. */
int eng_picks_greedy(const ds_engine *e, const choice *ch);
int eng_model_draws(const choice *ch);
/* allow: eng_allow_rows(e, i) for a constrained choice (its rows' masks), else NULL. */
void eng_set_draws(ds_engine *e, choice *ch, const int32_t *drafts, int n_rows, ds_row_draw *d,
                   ds_token_count *counts, int32_t *stops, uint32_t *allow);
/* The allowed-ids bitmasks of every constrained item of f that the model draws (its rows' draws
 * point at them: eng_set_draws), computed side by side once the batch is built. */
void eng_grammar_masks(ds_engine *e, inflight *f);
/* The masks of f's constrained rows: made now, or (mask_async) handed to the mask thread, in
 * which case eng_masks_wait returns once they are made. */
void eng_masks_post(ds_engine *e, inflight *f);
void eng_masks_wait(ds_engine *e);
int eng_masks_start(ds_engine *e, ds_err *err); /* the mask thread, where mask_async */
void eng_masks_stop(ds_engine *e);
/* Item i's room for its rows' allowed-ids bitmasks, [R][ceil(vocab / 32)] (made at the first
 * call), or NULL when there is no memory (the rows then come back to be sampled here). */
uint32_t *eng_allow_rows(ds_engine *e, int i);
int32_t eng_choose(ds_engine *e, choice *ch, float *row, const int32_t *pick, int drawn,
                   ds_sample_scratch *sc, int ahead, ds_logprobs_out *lp);
int eng_deliver(ds_engine *e, choice *ch, int32_t tok, const ds_logprobs_out *lp, int in_seq);
/* The sampling rank's tokens of every sampled item of step f (verifies row by row). */
void eng_sample_items(ds_engine *e, inflight *f);

/* ---- spec.c: speculative decoding -------------------------------------------------------------
 */

int eng_setup_taps(ds_engine *e, const char *dir, ds_err *err);
int eng_admit_drafts(void *ctx, ds_seq *q); /* ds_sched_set_admit_drafts's hook */
void eng_attach_drafts(ds_engine *e);
void eng_detach_drafts(ds_engine *e);
int eng_verify(ds_engine *e, choice *ch, ds_sched_item *it, float *rows, const int32_t *picks,
               int drawn, ds_sample_scratch *sc, int32_t *toks, ds_logprobs_out *lps);
void eng_count_verify(ds_engine *e, int n_drafts, int a);
/* The sampling rank after a step's tokens: the draft's context rows and the next drafts of every
 * sampled item (n_taps: the taps this step captured). */
void eng_propose(ds_engine *e, inflight *f, int n_taps);

/* ---- pd.c: prefill/decode disaggregation (docs/pd.md) -----------------------------------------
 */

int eng_pd_setup(ds_engine *e, ds_err *err);
void eng_pd_free(ds_engine *e);
/* Producer: files the finished choice's prompt blocks under its request's transfer id. */
void eng_pd_export(ds_engine *e, choice *ch);
/* Consumer: puts a request's pulled blocks into the offload tier (before its admission). */
void eng_pd_install(ds_engine *e, request *r);
/* A pulled transfer through the step plan (ranks.c): the head's pull says where the producer is
 * and hands on part 0's front (header, prompt, rank table; 0 when p is NULL); another rank
 * verifies the front and pulls the parts it needs itself (NULL when refused or a pull failed, the
 * reason printed: that rank then misses, and with it the job). */
int eng_pd_plan_info(const ds_kv_pull *p, const char **host, uint64_t *id, const void **front,
                     size_t *front_len);
ds_kv_pull *eng_pd_pull_rank(ds_engine *e, const char *host, uint64_t id, const void *front,
                             size_t front_len, const int32_t *prompt, int n_prompt);

/* ---- ranks.c: the rank protocol of a TP x PP job ----------------------------------------------
 */

/* A lock-step job cannot go on without this rank: say why and end every rank (non-zero). */
void eng_dist_fatal(ds_engine *e, const char *what, const char *msg);
void eng_plan_exchange(ds_engine *e, request **in, int64_t *ab, int *n_ab, int *stopping,
                       int *abort_all, int heartbeat);
void eng_outcome_send(ds_engine *e, inflight *f);
void eng_outcome_take(ds_engine *e, inflight *f);
void eng_relay_taps(ds_engine *e, int n_items);

/* ---- step.c and stats.c -----------------------------------------------------------------------
 */

void *eng_main(void *arg); /* the engine thread */
void eng_update_queue_stats(ds_engine *e);

#endif
