/* engine.h — the serving engine: requests in, token events out.
 *
 * One engine thread runs the step loop (schedule -> forward -> sample -> emit). Other threads (the
 * HTTP server) submit requests and abort them; every call here except ds_engine_create/free is
 * thread-safe. Results come back as events through the request's callback, called on the engine
 * thread: the callback must be quick and must not call back into the engine except
 * ds_engine_abort. Every submitted request receives exactly one final event per choice
 * (finish != DS_FINISH_NONE), also when it is aborted or the engine stops; after the last
 * choice's final event the engine never touches the request's callback or user pointer again. */
#ifndef DS_ENGINE_H
#define DS_ENGINE_H

#include "base/ds_base.h"
#include "sample/sampler.h"
#include "text/grammar.h"
#include "text/tokenizer.h"

typedef struct ds_engine ds_engine;

enum { DS_SPEC_NONE = 0, DS_SPEC_DSPARK = 1, DS_SPEC_NGRAM = 2 };
#define DS_MAX_SPEC 16

/* What tests put into an engine, in one place (all zero in production; the CLI's flags for them
 * are hidden from --help). */
typedef struct ds_test_hooks {
    /* when set, drafts come from this function instead of the speculative method: up to
     * num_speculative_tokens of them into drafts, returning how many */
    int (*spec_drafts)(void *ctx, const int32_t *tokens, int n_tokens, int num_speculative_tokens,
                       int32_t *drafts);
    void *spec_ctx;
    /* tests/cachefuzz: called on the head's engine thread at the top of every step-loop
     * iteration, before new requests and aborts are taken in, with the number of steps launched
     * so far. It may call ds_engine_submit and ds_engine_abort, so a workload whose arrivals and
     * aborts are keyed to steps runs the same interleaving every time. */
    void (*step)(void *ctx, uint64_t steps);
    void *step_ctx;
    int prefix_hash_bits; /* > 0: the prefix cache keeps this many hash bits, forcing collisions */
    /* P/D consumer, before a pulled transfer is verified (docs/pd.md): 1 flips a byte of its last
     * block (corrupted in flight), 2 cuts it 1 KiB short (truncated) */
    int kv_corrupt;
    int kv_stall_ms; /* P/D producer: pause between a pull's header and its bytes */
    /* 1: the grammar masks are made beside the forward on the CPU too (what a GPU does: a
     * thread of their own, the backend waiting for them before its draws) */
    int async_masks;
    /* > 0: the page pool holds at most this many pages, whatever kv_cache_memory buys (a test
     * short of pages names a count: under -pp one byte budget buys each stage another one) */
    int max_pages;
    /* tests/cachefuzz, preemption (both on the head's engine thread, as a step is planned):
     * `preempted` is told of every sequence the pools running dry preempt (its request, choice
     * and the tokens it had generated); `force_preempt` is asked, before each step is planned,
     * for every running sequence of the group about to be scheduled that has no step in flight,
     * and 1 preempts it there (ds_sched_preempt): a cold run replays a cached run's preemptions
     * at the same points, whose recompute must then give the same bits. In a job both are set
     * on the head alone: its answers travel in the step plan, and every rank preempts them. */
    void (*preempted)(void *ctx, int64_t req_id, int choice, int n_generated);
    int (*force_preempt)(void *ctx, int64_t req_id, int choice, int n_generated);
    void *preempt_ctx;
    /* while `hold` returns 1 no step is planned, as a scheduling fault would leave requests
     * waiting (one process only: it is asked on the engine's own thread); stall_seconds > 0
     * replaces DS_STALL_S, how long nothing may be planned while requests are live before the
     * engine reports a stall */
    int (*hold)(void *ctx);
    void *hold_ctx;
    double stall_seconds;
} ds_test_hooks;

/* Seconds without a planned step, requests live and nothing in flight, after which the engine
 * reports a stall (stderr once, ds_engine_stats.stalls_total) and waits 1 ms a round from then
 * on instead of spinning a core. The scheduler always plans the oldest request (scheduler.c), so
 * this is a fault, never load. */
#define DS_STALL_S 10.0

/* Why a consumer's pull failed (ds_engine_stats.kv_pull_fail_by; the prompt is recomputed):
 * the pull itself (the producer unreachable, the transfer unknown or expired, a timeout, a
 * connection broken off), a part that failed its checks (checksums, truncation, malformed), a
 * part of another model, layout or prompt, or this server (not a consumer, out of memory). */
enum { DS_KV_FAIL_UNAVAILABLE, DS_KV_FAIL_DAMAGED, DS_KV_FAIL_MISMATCH, DS_KV_FAIL_LOCAL };
#define DS_KV_FAIL_NAMES                                                                           \
    { "unavailable", "damaged", "mismatch", "local" }

/* Prefill/decode disaggregation roles (docs/pd.md), vLLM's kv_role. */
enum { DS_KV_NONE = 0, DS_KV_PRODUCER = 1, DS_KV_CONSUMER = 2, DS_KV_BOTH = 3 };

typedef struct ds_engine_opts {
    const char *model_dir;
    int device;          /* DS_DEVICE_CPU (default), DS_DEVICE_CUDA or DS_DEVICE_AUTO */
    int batch_invariant; /* CUDA: a row's result never depends on its batch (model.h) */
    int enforce_eager;   /* CUDA: no graphs (model.h) */
    int quantization;    /* DS_QUANT_* (model.h; docs/quantization.md) */
    const char *quantization_exclude; /* name fragments kept unquantized; NULL: the default */
    int kv_dtype;               /* --kv-cache-dtype: DS_KV_* (ds_model_opts.kv_dtype) */
    int load_random;            /* --load-format dummy: weights drawn, none read (model.h) */
    size_t kv_cache_memory;     /* bytes for MLA pages + KDA slots; 0: kv_cache_fraction of free */
    double kv_cache_fraction;   /* default 0.3 */
    int block_size;             /* tokens per MLA page (default 16) */
    int max_num_seqs;           /* running sequences at most (default 64) */
    int max_num_batched_tokens; /* tokens per step at most (default 2048) */
    int max_model_len;          /* context limit; 0: min(max_position_embeddings, capacity) */
    int max_queue;              /* waiting requests beyond which submit fails (default 1024) */
    uint64_t seed;              /* base seed for requests without one */
    /* speculative decoding */
    int speculative_method;      /* DS_SPEC_NONE, DS_SPEC_DSPARK or DS_SPEC_NGRAM */
    int num_speculative_tokens;  /* drafts proposed per verify (default 7) */
    const char *draft_model_dir; /* dspark: the draft checkpoint (default MODEL/draft) */
    /* prefix caching (cache/prefix.h) */
    int enable_prefix_caching;            /* default 1 */
    int state_checkpoint_interval_tokens; /* rung spacing, snapped to block_size (default 256);
                                             also the prompt cut spacing (scheduler.h) */
    size_t state_checkpoint_memory;       /* bytes of KDA checkpoint slots (default 64 MiB) */
    /* offload tier (cache/offload.h); each is off when 0 / NULL */
    size_t kv_offload_ram_bytes;
    const char *kv_offload_disk_dir;
    size_t kv_offload_disk_bytes;     /* 0: unlimited */
    const char *kv_offload_remote;    /* "redis://host:port" */
    int kv_offload_remote_timeout_ms; /* default 100 */
    /* Tensor / pipeline parallelism (docs/parallelism.md, "Process model"): this rank's ds_comm
     * (NULL: one process) and the layers of each stage ([comm->n_stages], NULL: one stage). Every
     * rank of the job creates an engine; they run the same schedule in lock step: the head (world
     * rank 0, the only one whose submit/abort are used) broadcasts new requests and aborts before
     * each step, the sampling rank (last stage, TP rank 0) broadcasts the tokens it chose and the
     * next drafts after it. */
    struct ds_comm *comm;
    const int *pp_layer_counts;
    /* DSpark under pipeline parallelism: how the taps of earlier stages reach the draft on the
     * last stage. DS_RELAY_PARTIAL_SUM (default): each stage adds W_context[:, its taps] . taps
     * into one running [tokens][D] sum handed on with the stream, so a boundary carries one such
     * tensor whatever the depth; DS_RELAY_PLAIN: each stage sends its raw taps to the last. Both
     * give the same drafts to the bit. */
    int draft_tap_relay;
    /* With P > 1 stages, P steps are in flight (one per group of sequences) so that every stage
     * computes at once; pp_lock_step runs one step at a time instead (slower; for comparison). */
    int pp_lock_step;
    /* prefill/decode disaggregation (docs/pd.md; --kv-transfer-config) */
    int kv_role;            /* DS_KV_*; a producer never proposes drafts */
    const char *kv_ip;      /* producer: the transfer listener's address, also advertised */
    int kv_port;            /* producer: its port (0: a free one) */
    int kv_hold_timeout_ms; /* producer: an unpulled transfer is freed after this (120000) */
    int kv_pull_timeout_ms; /* consumer: a pull that takes longer fails (30000) */
    ds_test_hooks test;     /* tests only; all zero in production */
} ds_engine_opts;

enum { DS_RELAY_PARTIAL_SUM = 0, DS_RELAY_PLAIN = 1 };

void ds_engine_opts_default(ds_engine_opts *o);

#define DS_MAX_STOP 16

typedef struct ds_request_params {
    ds_sample_params sample; /* how a token is drawn (sample/sampler.h: the one type from the
                                request's JSON to the draw kernels; its defaults are there) */
    int has_seed;
    uint64_t seed;
    int max_tokens; /* default 16; capped by the context limit */
    int min_tokens; /* default 0: stop tokens and strings are ignored before this */
    int ignore_eos;
    int32_t stop_token_ids[DS_MAX_STOP];
    int n_stop_token_ids;
    char *stop[DS_MAX_STOP]; /* stop strings (owned by the caller until the request finishes) */
    int n_stop;
    int logprobs;            /* -1: none; k >= 0: the sampled token's logprob and top-k others */
    int n;                   /* choices (default 1) */
    int skip_special_tokens; /* default 1 */
    /* constrained decoding (text/grammar.h): the llguidance Lark grammar every choice's output
     * follows, owned by the caller until the request finishes like the stop strings; NULL: none.
     * Its end forces eos (a stop even with ignore_eos), and min_tokens does not apply. */
    char *grammar;
} ds_request_params;

void ds_request_params_default(ds_request_params *p);

typedef enum {
    DS_FINISH_NONE = 0,
    DS_FINISH_STOP,   /* eos, a stop token or a stop string */
    DS_FINISH_LENGTH, /* max_tokens or the context limit */
    DS_FINISH_ABORT,  /* aborted by the client or by shutdown */
    DS_FINISH_ERROR,
} ds_finish;

const char *ds_finish_name(ds_finish f); /* "stop", "length", "abort", "error" */

typedef struct ds_token_event {
    int index;        /* which choice (0..n-1) */
    int32_t token;    /* -1 on a final event that carries no token */
    const char *text; /* newly final text of this choice (may be empty: text held back while it
                         could still become a stop string, or a partial UTF-8 character) */
    size_t text_len;
    float logprob; /* of the sampled token, when logprobs >= 0 */
    int n_top;
    const int32_t *top_ids;    /* [n_top] */
    const float *top_logprobs; /* [n_top] */
    ds_finish finish;
    int n_prompt, n_generated; /* counts so far, for usage */
} ds_token_event;

typedef void (*ds_event_fn)(void *user, const ds_token_event *ev);

typedef struct ds_kv_pull ds_kv_pull;

typedef struct ds_request_spec {
    const int32_t *prompt; /* [n_prompt], copied by submit */
    int n_prompt;
    ds_request_params params;
    ds_event_fn on_event;
    void *user;
    /* P/D (docs/pd.md). Producer: when the request ends (stop or length), its prompt's filed
     * blocks are held under this transfer id for a consumer to pull (0: not). Consumer: blocks
     * pulled and verified by ds_engine_kv_pull, put into the offload tier before the request is
     * admitted, so its prefix-cache lookup finds them; submit takes ownership (also on failure). */
    uint64_t kv_export_id;
    ds_kv_pull *kv_import;
} ds_request_spec;

int ds_engine_create(const ds_engine_opts *opts, ds_engine **out, ds_err *err);
int ds_engine_start(ds_engine *e, ds_err *err); /* starts the step-loop thread */

/* Queues a request. Returns its id (> 0), or -1 with err: DS_SUBMIT_FULL when the queue is full
 * (the server answers 503), DS_SUBMIT_INVALID for a request that can never run (too long). */
#define DS_SUBMIT_FULL    (-2)
#define DS_SUBMIT_INVALID (-3)
int64_t ds_engine_submit(ds_engine *e, const ds_request_spec *spec, int *why, ds_err *err);
/* Aborts a queued or running request; its final events follow. Unknown ids are ignored. */
void ds_engine_abort(ds_engine *e, int64_t id);
/* Stops accepting, aborts what is left after grace_s seconds, joins the thread. */
void ds_engine_stop(ds_engine *e, double grace_s);
/* A rank other than the head: waits until the head's stop reaches the step loop and it ends. */
void ds_engine_join(ds_engine *e);
void ds_engine_free(ds_engine *e);

/* P/D (engine/pd.c, docs/pd.md). The role, and where a producer's transfers are pulled from. */
int ds_engine_kv_role(const ds_engine *e);
const char *ds_engine_kv_host(const ds_engine *e);
int ds_engine_kv_port(const ds_engine *e);
int ds_engine_kv_tp_size(const ds_engine *e);
/* Consumer, on the caller's thread: pulls transfer id from host:port and verifies every block
 * against this engine (model identity, layer range, TP rank, page and slot sizes, the prompt's
 * tokens, each block's checksum). DS_OK with *out for ds_request_spec.kv_import; DS_ERR with the
 * reason when anything is missing, late, truncated or mismatched, counted as a pull failure: the
 * caller then submits without it and the prompt is recomputed. */
int ds_engine_kv_pull(ds_engine *e, const char *host, int port, uint64_t id, const int32_t *prompt,
                      int n_prompt, ds_kv_pull **out, ds_err *err);
void ds_kv_pull_free(ds_kv_pull *p);

const ds_tokenizer *ds_engine_tokenizer(const ds_engine *e);
/* Checks that a request's grammar compiles (loading llguidance on first use and caching the
 * compiled grammar), so that a bad one is refused before it is submitted. Thread-safe. An error
 * says why: the grammar's fault, or the library's absence (ds_engine_grammar_ready). */
int ds_engine_grammar_check(ds_engine *e, const char *lark, ds_err *err);
/* 1 when constrained decoding is available (the library loaded), else 0 and err says why. */
int ds_engine_grammar_ready(ds_engine *e, ds_err *err);
int ds_engine_max_model_len(const ds_engine *e);
const char *ds_engine_model_dir(const ds_engine *e);
int ds_engine_chat_format(const ds_engine *e); /* ds_chat_format */

/* Snapshot for /metrics and the tests. */
typedef struct ds_engine_stats {
    int running, waiting, preempted_now;
    int pages_total, pages_used, slots_total, slots_used;
    uint64_t prompt_tokens_total, generation_tokens_total, preemptions_total;
    uint64_t finished[5]; /* by ds_finish */
    uint64_t steps_total;
    double step_seconds_total; /* time inside forward + sampling */
    uint64_t stalls_total;     /* DS_STALL_S without a planned step while requests were live */
    /* prefix caching: tokens of admitted prompts looked up, and resumed from the cache */
    uint64_t prefix_query_tokens, prefix_hit_tokens;
    uint64_t ckpt_kept, ckpt_dropped, ckpt_evicted, forks; /* checkpoint rungs, see prefix.h */
    uint64_t ckpt_holds; /* steps that started on a rung not yet filed (ds_prefix_would_hold) */
    uint64_t prefix_pages_evicted, prefix_collisions;
    int ckpt_slots_total, ckpt_slots_used, pages_cached_idle;
    /* offload tier */
    uint64_t offload_stores, offload_loads_ram, offload_loads_disk, offload_loads_remote;
    uint64_t offload_misses, offload_bad, offload_remote_errors;
    /* speculative decoding: verify steps, drafts proposed / accepted, tokens they emitted */
    uint64_t spec_verifies, spec_draft_tokens, spec_accepted_tokens, spec_emitted_tokens;
    uint64_t spec_accepted_at[DS_MAX_SPEC]; /* drafts accepted at position i (0-based) */
    uint64_t spec_fork_verifies; /* verifies that were also a sequence's first step after a
                                    prefix hit (the checkpoint forked before the kernels ran) */
    /* P/D (docs/pd.md): producer transfers filed, held now, freed unpulled, sent whole, whose
     * send broke off (the consumer died or stalled: freed, not held); consumer pulls that were
     * installed, that failed (the prompt recomputed), and the blocks and bytes installed, and
     * the seconds the installed ones' bytes took on the wire (their pulls' calls alone, not the
     * checks: bytes / seconds is the transfer's rate) */
    uint64_t kv_exports, kv_export_blocks, kv_expired, kv_served, kv_send_errors;
    /* producer: the bytes of the parts filed and the seconds their export took (gathering the
     * blocks from the pools, on a GPU device to host, and checksumming them; on the engine
     * thread, so decode waits for it) */
    uint64_t kv_export_bytes;
    double kv_export_seconds;
    int kv_held;
    uint64_t kv_pulls, kv_pull_failures, kv_pull_blocks, kv_pull_bytes;
    /* the failures by reason (DS_KV_FAIL_*): what an operator needs to tell a producer that is
     * gone from one that serves another model */
    uint64_t kv_pull_fail_by[4];
    double kv_pull_seconds;
    uint64_t kv_released; /* parts of refused transfers that the producer freed when asked */
    /* consumer: connections to producers opened, and requests sent over one kept from an
     * earlier request (transport/xfer.h) */
    uint64_t kv_connects, kv_conn_reuses;
    uint32_t spec_draft_digest; /* checksum over every draft proposed, in order: two runs that
                                   drafted the same tokens agree (a test of the tap relays) */
    /* constrained decoding: this process's grammar cache (the HTTP threads' checks and, where
     * this rank samples, the engine's matchers); zero until the first constrained request */
    ds_grammar_stats grammar;
    /* and its time on the engine's side (what a step pays for its masks): making them, the part
     * of that the step waited for (all of it when made before the forward; none when the forward
     * hid it), and the matchers taking the chosen tokens (after the forward, always waited for) */
    double grammar_mask_seconds, grammar_wait_seconds, grammar_accept_seconds;
} ds_engine_stats;
void ds_engine_get_stats(ds_engine *e, ds_engine_stats *s);

#endif
