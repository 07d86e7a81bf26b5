/* engine.c — the step loop: schedule -> forward -> sample -> emit (nano-vllm's division of labour:
 * the scheduler decides, the model runs, this file owns requests and their outputs).
 *
 * Threads: the HTTP threads call submit/abort, which only touch the inbox under `mu`; the engine
 * thread owns everything else (scheduler, sequences, pools) without locking. */
#include "engine/engine.h"

#include "base/devmem.h"

#include "cache/offload.h"
#include "cache/identity.h"
#include "cache/prefix.h"
#include "transport/comm.h"
#include "parallel/pipeline.h"
#include "sample/sampler.h"
#include "engine/scheduler.h"
#include "engine/textout.h"
#include "text/chat.h"
#include "model/draft.h"
#include "model/model.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

typedef struct request request;

/* One of a request's n choices: a sequence of its own. */
typedef struct choice {
    request *req;
    int index;
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
    request *next;      /* inbox / live list */
};

/* One step between its launch (schedule, forward, the sampling rank's choices) and its completion
 * (every rank applies the outcome). Without pipelining a step completes right after it is
 * launched; with P pipeline stages P steps are in flight, each for its own group of sequences,
 * and a step's outcome is applied when its group's turn comes again. */
typedef struct inflight {
    int active, n_items, n_prompt_tokens;
    double t0;
    ds_sched_item *items;           /* [max_num_seqs] */
    int32_t (*vt)[DS_MAX_SPEC + 1]; /* [max_num_seqs][k+1] tokens to deliver */
    ds_logprobs_out *vlp;           /* [max_num_seqs][k+1] */
    int *va;                        /* [max_num_seqs] accepted drafts, -1: not a verify */
    int32_t (*dr)[DS_MAX_SPEC];     /* [max_num_seqs][k] the next drafts */
    int *n_dr;                      /* [max_num_seqs] */
    float *state_rows; /* [max_num_seqs][k+1][slot floats] KDA slot after each verify row */
} inflight;

struct ds_engine {
    ds_engine_opts opts;
    char *model_dir;
    ds_model *model;
    ds_tokenizer *tok;
    int chat_format;
    ds_kv_pool kv;
    int on_device; /* the model, slots, pages and verify rows are on the GPU */
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

    /* step buffers, engine thread only */
    inflight *fl;      /* [n_fl] steps in flight, used round robin */
    int n_fl;          /* P with pipelined stages, else 1 */
    uint64_t micro;    /* steps launched so far */
    int chunk_tokens;  /* prompt cut spacing (scheduler.h) */
    int64_t *deferred; /* [n_deferred] aborts of requests with a step in flight */
    int n_deferred, cap_deferred;
    ds_seq **preempted;  /* [max_num_seqs] */
    ds_seq_batch *batch; /* [max_num_seqs] */
    float *logits;       /* [max_num_seqs][k+1][V] */
    int32_t *argmax;     /* [max_num_seqs][k+1] greedy tokens picked beside the logits */
    /* rows the model draws where their logits are (ds_seq_batch.draws), [max_num_seqs][k+1]; their
     * penalised counts [cap_dcounts] and stop ids [max_num_seqs][DS_MAX_STOP + 1] */
    ds_row_draw *draws;
    ds_token_count *dcounts;
    size_t cap_dcounts;
    int32_t *dstops;
    ds_sample_scratch **scratch; /* [n_scratch]: one per sampling thread */
    int n_scratch;

    /* speculative decoding (k = 0: off) */
    int k;
    ds_draft *draft; /* dspark */
    /* a step's proposals, gathered for one ds_draft_propose_batch: item, block table, position of
     * the last context row, anchor of each ([max_num_seqs]); drafts [max_num_seqs][k] */
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

    /* tensor / pipeline parallelism (opts.comm); dist = 0 for one process */
    ds_comm *comm;
    int dist;
    int head;         /* world rank 0: takes submits, emits events */
    int sampler;      /* this rank samples: last stage, TP rank 0 */
    int sampler_rank; /* world rank of the sampling rank */
    int last_stage;   /* this rank computes logits */
    ds_pp_bufs ppb;   /* stage-boundary buffers */
};

void ds_engine_opts_default(ds_engine_opts *o) {
    memset(o, 0, sizeof *o);
    ds_model_opts mo; /* the device defaults (DS_DEVICE, DS_BATCH_INVARIANT) */
    ds_model_opts_default(&mo);
    o->device = mo.device; /* -1 for a DS_DEVICE nobody knows: the model load reports it */
    o->batch_invariant = mo.batch_invariant;
    o->kv_cache_fraction = 0.3;
    o->block_size = 16;
    o->max_num_seqs = 64;
    o->max_num_batched_tokens = 2048;
    o->max_queue = 1024;
    o->num_speculative_tokens = 7;
    o->enable_prefix_caching = 1;
    o->state_checkpoint_interval_tokens = 256;
    o->state_checkpoint_memory = (size_t)64 << 20;
    o->kv_offload_remote_timeout_ms = 100;
}

void ds_request_params_default(ds_request_params *p) {
    memset(p, 0, sizeof *p);
    ds_sample_params_default(&p->sample);
    p->max_tokens = 16;
    p->logprobs = -1;
    p->n = 1;
    p->skip_special_tokens = 1;
}

const char *ds_finish_name(ds_finish f) {
    switch (f) {
    case DS_FINISH_STOP:
        return "stop";
    case DS_FINISH_LENGTH:
        return "length";
    case DS_FINISH_ABORT:
        return "abort";
    case DS_FINISH_ERROR:
        return "error";
    default:
        return "none";
    }
}

const ds_tokenizer *ds_engine_tokenizer(const ds_engine *e) {
    return e->tok;
}
int ds_engine_max_model_len(const ds_engine *e) {
    return e->max_model_len;
}
const char *ds_engine_model_dir(const ds_engine *e) {
    return e->model_dir;
}
int ds_engine_chat_format(const ds_engine *e) {
    return e->chat_format;
}

/* MemAvailable from /proc/meminfo, in bytes (0 when unknown). */
static size_t mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    size_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %zu kB", &kb) == 1) break;
    fclose(f);
    return kb * 1024;
}

/* Splits the memory budget between KDA state slots and MLA pages: every running sequence needs
 * one slot, so slots for max_num_seqs come first (at most half the budget); the rest is pages. */
static int size_pools(ds_engine *e, ds_err *err) {
    const ds_config *c = ds_model_config(e->model);
    size_t budget = e->opts.kv_cache_memory;
    if (!budget) {
        /* on a GPU the pools take device memory: a fraction of what is free there */
        size_t avail = e->on_device ? ds_model_device_mem_free(e->model) : mem_available();
        budget = (size_t)(e->opts.kv_cache_fraction * (double)avail);
    }
    size_t slot_bytes = ds_model_slot_floats(e->model) * sizeof(float);
    size_t page_bytes = (size_t)ds_kv_pool_layers(e->model) * e->opts.block_size *
                        (size_t)ds_model_latent_row(e->model) * sizeof(float);
    if (slot_bytes == 0) slot_bytes = 1;
    if (page_bytes == 0) page_bytes = 1;
    size_t n_slots = DS_MIN((size_t)e->opts.max_num_seqs, budget / 2 / slot_bytes);
    if (n_slots < 1)
        return ds_errf(err, "kv cache memory %zu bytes cannot hold one KDA state slot (%zu bytes)",
                       budget, slot_bytes);
    size_t n_pages = (budget - n_slots * slot_bytes) / page_bytes;
    /* In a job every rank must hold the same number of slots and pages (they run one schedule),
     * and a stage's layers need less than the whole model's: the job takes the smallest count. */
    if (e->dist) {
        uint64_t ns = n_slots, np = n_pages;
        if (ds_comm_min_u64(e->comm, &ns, err) || ds_comm_min_u64(e->comm, &np, err)) return DS_ERR;
        n_slots = ns;
        n_pages = np;
    }
    size_t min_pages = (size_t)(e->opts.max_num_batched_tokens / e->opts.block_size + 2);
    if (n_pages < min_pages)
        return ds_errf(err,
                       "kv cache memory %zu bytes leaves %zu pages; at least %zu are needed "
                       "(raise --kv-cache-memory or lower --max-num-batched-tokens)",
                       budget, n_pages, min_pages);
    if (n_pages > (size_t)1 << 30) n_pages = (size_t)1 << 30;
    int cap = (int)DS_MIN(n_pages * (size_t)e->opts.block_size, (size_t)INT32_MAX / 2);
    e->max_model_len = e->opts.max_model_len ? e->opts.max_model_len : cap;
    if (c->max_position_embeddings > 0 && e->max_model_len > c->max_position_embeddings)
        e->max_model_len = (int)c->max_position_embeddings;
    if (e->max_model_len > cap) e->max_model_len = cap;
    if (ds_kv_pool_init(&e->kv, e->model, (int)n_pages, e->opts.block_size, err) ||
        ds_page_pool_create((int)n_pages, &e->pages, err) ||
        ds_slot_pool_create_on(e->on_device, (int)n_slots, ds_model_slot_floats(e->model),
                               &e->slots, err))
        return DS_ERR;
    if (e->head)
        fprintf(stderr,
                "[deltaserve] kv budget %.1f MiB: %zu KDA state slots x %.2f MiB + %zu MLA pages x "
                "%.1f KiB (block %d) -> max %zu concurrent sequences, %zu tokens in cache, "
                "max_model_len %d\n",
                budget / 1048576.0, n_slots, slot_bytes / 1048576.0, n_pages, page_bytes / 1024.0,
                e->opts.block_size, n_slots, n_pages * e->opts.block_size, e->max_model_len);
    return DS_OK;
}

static void dist_fatal(ds_engine *e, const char *what, const char *msg);

/* Will this rank load a DSpark draft (setup_spec)? */
static int will_draft(const ds_engine *e) {
    return e->opts.speculative_method == DS_SPEC_DSPARK && !e->opts.test.spec_drafts && e->sampler;
}

/* The smallest v over the job's ranks (prefix.h's agreement on offload hits). */
static int agree_min(void *ctx, int v) {
    ds_engine *e = ctx;
    ds_err err = {{0}};
    uint64_t x = v > 0 ? (uint64_t)v : 0;
    if (ds_comm_min_u64(e->comm, &x, &err)) dist_fatal(e, "offload agreement", err.msg);
    return (int)x;
}

/* The prompt cut spacing: the rung interval snapped down to a page (at least one). */
static int chunk_of(const ds_engine_opts *o) {
    int iv = o->state_checkpoint_interval_tokens > 0 ? o->state_checkpoint_interval_tokens : 256;
    return DS_MAX(o->block_size, iv / o->block_size * o->block_size);
}

/* Prefix caching and the offload tier. Every hash is seeded with the model's identity, and
 * offload keys carry it too, so two models never share entries. With a tier that outlives the
 * process (disk, Redis) the identity is a digest of the weights' bytes (cache/identity.h: a
 * fine-tune of the same shape is another model); otherwise the config and weight size suffice.
 * It also names what changes the cached numbers besides the weights: the device, the
 * batch-invariant mode, the tensor-parallel width (each rank keeps its own slice and sums in its
 * own order) and the prompt cut spacing (docs/prefix-cache.md). */
static int setup_prefix(ds_engine *e, ds_err *err) {
    const ds_engine_opts *o = &e->opts;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", e->model_dir);
    size_t len = 0;
    char *cfg = ds_read_file(path, &len, NULL);
    uint64_t id[8] = {XXH3_64bits_withSeed(cfg ? cfg : "", cfg ? len : 0,
                                           (uint64_t)ds_model_weight_bytes(e->model))};
    free(cfg);
    int persistent = (o->kv_offload_disk_dir && o->kv_offload_disk_dir[0]) ||
                     (o->kv_offload_remote && o->kv_offload_remote[0]);
    if (persistent && e->head && ds_checkpoint_digest(e->model_dir, id + 1, err)) return DS_ERR;
    id[3] = (uint64_t)e->on_device;
    id[4] = (uint64_t)o->batch_invariant;
    id[5] = (uint64_t)(e->comm ? e->comm->tp_size : 1);
    id[6] = (uint64_t)e->chunk_tokens;
    id[7] = 1; /* the numeric contract's version */
    uint64_t seed = XXH3_64bits(id, sizeof id);
    /* one identity for the whole job (each rank holds a different share of the weights) */
    if (e->dist && ds_comm_bcast(e->comm, &seed, sizeof seed, err)) return DS_ERR;
    char model_id[32];
    snprintf(model_id, sizeof model_id, "%016llx", (unsigned long long)seed);
    if (o->kv_offload_ram_bytes || (o->kv_offload_disk_dir && o->kv_offload_disk_dir[0]) ||
        (o->kv_offload_remote && o->kv_offload_remote[0])) {
        /* each rank stores and loads its own stage's layers and TP slice (layout version 1) */
        ds_offload_opts oo = {.ram_bytes = o->kv_offload_ram_bytes,
                              .disk_dir = o->kv_offload_disk_dir,
                              .disk_bytes = o->kv_offload_disk_bytes,
                              .remote = o->kv_offload_remote,
                              .remote_timeout_ms = o->kv_offload_remote_timeout_ms,
                              .model_id = model_id,
                              .layer_lo = ds_model_first_layer(e->model),
                              .layer_hi = ds_model_end_layer(e->model),
                              .tp_rank = e->comm ? e->comm->tp_rank : 0,
                              /* 2: pages also carry the DSpark draft's rows (setup_spec) */
                              .layout = will_draft(e) ? 2 : 1};
        if (ds_offload_create(&oo, &e->offload, err)) return DS_ERR;
    }
    size_t slot_bytes = DS_MAX(ds_model_slot_floats(e->model) * sizeof(float), 1);
    size_t n_ckpt = o->state_checkpoint_memory / slot_bytes;
    if (n_ckpt > (1u << 20)) n_ckpt = 1u << 20;
    if (e->dist) { /* the same checkpoint slots on every rank, as for the pools */
        uint64_t nc = n_ckpt;
        if (ds_comm_min_u64(e->comm, &nc, err)) return DS_ERR;
        n_ckpt = nc;
    }
    ds_prefix_opts po = {o->block_size,
                         o->state_checkpoint_interval_tokens,
                         (int)n_ckpt,
                         seed,
                         o->test.prefix_hash_bits,
                         e->on_device,
                         e->chunk_tokens};
    if (ds_prefix_create(&po, ds_model_slot_floats(e->model), e->pages, &e->kv, e->offload,
                         &e->prefix, err))
        return DS_ERR;
    ds_sched_set_prefix(e->sched, e->prefix);
    if (e->dist) ds_prefix_set_agree(e->prefix, agree_min, e);
    int rung = ds_prefix_rung_interval(e->prefix);
    if (e->head)
        fprintf(
            stderr,
            "[deltaserve] prefix caching on: %zu KDA checkpoint slots (%.1f MiB), rungs every %d "
            "tokens%s%s%s\n",
            n_ckpt, (double)(n_ckpt * slot_bytes) / 1048576.0, rung,
            o->kv_offload_ram_bytes ? ", offload to RAM" : "",
            o->kv_offload_disk_dir && o->kv_offload_disk_dir[0] ? ", to disk" : "",
            o->kv_offload_remote && o->kv_offload_remote[0] ? ", to Redis" : "");
    return DS_OK;
}

/* Which taps each stage holds ([tap_j0, tap_j1) of the ascending tap list: a stage's layers are
 * contiguous, and the embedding tap -1 is the first stage's), and what this rank needs to capture
 * and relay them. */
static int setup_taps(ds_engine *e, const char *dir, ds_err *err) {
    ds_draft_config dc;
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (ds_draft_config_load(path, &dc, err)) return DS_ERR;
    int nt = dc.num_target_layers, P = e->comm ? e->comm->n_stages : 1;
    if (nt < 1 || nt > DS_MAX_LAYERS + 1) return ds_errf(err, "%d taps", nt);
    memcpy(e->tap_ids, dc.target_layer_ids, (size_t)nt * sizeof(int));
    e->n_tap_ids = nt;
    for (int st = 0; st < P; st++) {
        int lo = 0, hi = ds_model_config(e->model)->num_hidden_layers;
        if (P > 1) ds_pp_stage_range(e->opts.pp_layer_counts, st, &lo, &hi);
        if (st == 0) lo = -1; /* the embedding tap */
        int j0 = 0, j1 = 0;   /* the taps are ascending: the stage's are one run of them */
        while (j0 < nt && e->tap_ids[j0] < lo) j0++;
        for (j1 = j0; j1 < nt && e->tap_ids[j1] < hi; j1++) continue;
        e->tap_j0[st] = j0;
        e->tap_j1[st] = j1;
    }
    int stage = e->comm ? e->comm->stage : 0, tp = e->comm ? e->comm->tp_rank : 0;
    int own = e->tap_j1[stage] > e->tap_j0[stage];
    /* The sampling rank captures its own taps (and, relayed plainly, holds everyone's); an earlier
     * stage's TP rank 0 captures its own for the relay (its TP peers hold the same stream). */
    e->n_taps = e->sampler || (tp == 0 && own) ? nt : 0;
    if (e->dist && P > 1 && tp == 0 && !e->last_stage &&
        e->opts.draft_tap_relay == DS_RELAY_PARTIAL_SUM &&
        ds_draft_load_context_only(dir, e->model, &e->draft_ctx, err))
        return DS_ERR;
    return DS_OK;
}

/* Speculative decoding: k drafts per verify; dspark loads its draft next to the target and keeps
 * its latent rows in a cache addressed by the target's own pages (so a shared prefix page shares
 * its draft rows too). */
static int admit_drafts(void *ctx, ds_seq *q);

static int setup_spec(ds_engine *e, ds_err *err) {
    const ds_engine_opts *o = &e->opts;
    const int S = o->max_num_seqs; /* sequences a step may hold: proposals at once, at most */
    if (o->num_speculative_tokens < 1 || o->num_speculative_tokens > DS_MAX_SPEC)
        return ds_errf(err, "--num-speculative-tokens must be in [1, %d], got %d", DS_MAX_SPEC,
                       o->num_speculative_tokens);
    e->k = o->num_speculative_tokens;
    /* In a job only the sampling rank drafts (its drafts reach the others with its tokens); the
     * earlier stages' TP rank 0 capture their taps and relay them (see setup_taps). */
    if (o->speculative_method == DS_SPEC_DSPARK && !o->test.spec_drafts) {
        char dir[4096];
        if (o->draft_model_dir)
            snprintf(dir, sizeof dir, "%s", o->draft_model_dir);
        else
            snprintf(dir, sizeof dir, "%s/draft", e->model_dir);
        if (e->sampler && (ds_draft_load(dir, e->model, &e->draft, err) ||
                           ds_draft_cache_init_seqs(&e->dcache, e->draft, ds_page_n_total(e->pages),
                                                    e->opts.block_size, e->k, S, err)))
            return ds_err_prefix(err, "--draft-model %s", dir);
        if (e->draft) {
            e->prop_item = ds_malloc((size_t)S * sizeof(int), err);
            e->prop_p = ds_malloc((size_t)S * sizeof(int), err);
            e->prop_table = ds_malloc((size_t)S * sizeof(int32_t *), err);
            e->prop_anchor = ds_malloc((size_t)S * sizeof(int32_t), err);
            e->prop_drafts = ds_malloc((size_t)S * e->k * sizeof(int32_t), err);
            e->ctx_w = ds_malloc((size_t)S * sizeof(ds_draft_ctx_write), err);
            if (!e->prop_item || !e->prop_p || !e->prop_table || !e->prop_anchor ||
                !e->prop_drafts || !e->ctx_w)
                return DS_ERR;
        }
        /* the draft's rows of a page travel with the page through the offload tiers */
        if (e->draft && e->prefix &&
            ds_prefix_add_page_rows(e->prefix, e->dcache.layer, e->dcache.n_layers, e->dcache.row,
                                    err))
            return DS_ERR;
        if (setup_taps(e, dir, err)) return ds_err_prefix(err, "--draft-model %s", dir);
    } else if (o->speculative_method != DS_SPEC_NGRAM && o->speculative_method != DS_SPEC_DSPARK) {
        return ds_errf(err, "unknown speculative method %d", o->speculative_method);
    }
    if (e->head) /* (the draft lives on the sampling rank: where it runs is said there) */
        fprintf(stderr, "[deltaserve] speculative decoding: %s, k = %d\n",
                o->speculative_method == DS_SPEC_DSPARK ? "dspark" : "ngram", e->k);
    if (e->draft)
        fprintf(stderr, "[deltaserve] DSpark draft on the %s\n",
                ds_draft_on_device(e->draft) ? "GPU, beside the target" : "CPU");
    return DS_OK;
}

int ds_engine_create(const ds_engine_opts *opts, ds_engine **out, ds_err *err) {
    *out = NULL;
    ds_engine *e = ds_calloc(1, sizeof *e, err);
    if (!e) return DS_ERR;
    e->opts = *opts;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->wake, NULL);
    e->next_id = 1;
    e->model_dir = strdup(opts->model_dir ? opts->model_dir : "");
    if (opts->block_size < 1 || opts->max_num_seqs < 1 || opts->max_num_batched_tokens < 1) {
        ds_errf(err, "engine: --block-size, --max-num-seqs and --max-num-batched-tokens must be "
                     "positive");
        goto fail;
    }
    ds_chat_format fmt;
    ds_model_opts mo;
    ds_model_opts_default(&mo);
    mo.device = opts->device;
    mo.batch_invariant = opts->batch_invariant;
    mo.enforce_eager = opts->enforce_eager;
    /* one GPU per rank of a job: rank r of this host uses device r (the backend wraps it modulo
     * the devices present, so a job can also share one GPU) */
    const char *local = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
    if (local && opts->comm && opts->comm->size > 1) mo.device_index = atoi(local);
    e->comm = opts->comm;
    e->dist = e->comm && e->comm->size > 1;
    e->head = !e->comm || e->comm->rank == 0;
    e->last_stage = !e->comm || e->comm->stage == e->comm->n_stages - 1;
    e->sampler = e->last_stage && (!e->comm || e->comm->tp_rank == 0);
    e->sampler_rank = e->comm ? (e->comm->n_stages - 1) * e->comm->tp_size : 0;
    if (e->dist) {
        if (e->comm->n_stages > 1 && !opts->pp_layer_counts) {
            ds_errf(err, "engine: a pipeline-parallel job needs the layer partition");
            goto fail;
        }
        ds_pp_rank_opts(e->comm, opts->pp_layer_counts, &mo);
    }
    if (ds_model_load(e->model_dir, &mo, &e->model, err) ||
        ds_tok_load(e->model_dir, &e->tok, err) || ds_chat_format_from_dir(e->model_dir, &fmt, err))
        goto fail;
    e->on_device = ds_model_on_device(e->model);
    e->chat_format = (int)fmt;
    e->V = ds_model_config(e->model)->vocab_size;
    if (size_pools(e, err)) goto fail;
    /* Prompt chunks cut at fixed positions (see scheduler.h): multiples of the checkpoint
     * interval (snapped to a page), capped by the step budget. The cuts are the same with prefix
     * caching on or off, so turning it on changes no request's numbers. */
    e->chunk_tokens = DS_MIN(opts->max_num_batched_tokens, chunk_of(opts));
    ds_sched_opts so = {opts->block_size, opts->max_num_seqs, opts->max_num_batched_tokens,
                        e->chunk_tokens};
    if (ds_sched_create(&so, e->pages, e->slots, &e->sched, err)) goto fail;
    if (opts->enable_prefix_caching && setup_prefix(e, err)) goto fail;
    if (opts->speculative_method != DS_SPEC_NONE && setup_spec(e, err)) goto fail;
    /* only a prefix hit resumes a sequence one token short of its end */
    if (e->k && e->prefix) ds_sched_set_admit_drafts(e->sched, admit_drafts, e);
    int S = opts->max_num_seqs, rows = e->k + 1;
    /* With pipelined stages P steps are in flight (DESIGN.md, "Process model"). */
    e->n_fl = e->dist && e->comm->n_stages > 1 && !opts->pp_lock_step ? e->comm->n_stages : 1;
    e->fl = ds_calloc((size_t)e->n_fl, sizeof *e->fl, err);
    if (!e->fl) goto fail;
    for (int q = 0; q < e->n_fl; q++) {
        inflight *f = &e->fl[q];
        f->items = ds_calloc((size_t)S, sizeof *f->items, err);
        f->vt = ds_calloc((size_t)S, sizeof *f->vt, err);
        f->vlp = ds_calloc((size_t)S * rows, sizeof *f->vlp, err);
        f->va = ds_calloc((size_t)S, sizeof *f->va, err);
        f->dr = ds_calloc((size_t)S, sizeof *f->dr, err);
        f->n_dr = ds_calloc((size_t)S, sizeof *f->n_dr, err);
        /* on the model's device: the forward writes them, the rollback copies one into a slot */
        f->state_rows =
            e->k ? ds_dmem_alloc(
                       e->on_device,
                       (size_t)S * rows * ds_model_slot_floats(e->model) * sizeof(float) + 1, err)
                 : NULL;
        if (!f->items || !f->vt || !f->vlp || !f->va || !f->dr || !f->n_dr ||
            (e->k && !f->state_rows))
            goto fail;
    }
    e->preempted = ds_calloc((size_t)S, sizeof *e->preempted, err);
    e->batch = ds_calloc((size_t)S, sizeof *e->batch, err);
    /* page-locked when the model is on a GPU: the step downloads its logits here */
    e->logits = ds_dmem_host_alloc((size_t)S * rows * e->V * sizeof(float), err);
    e->argmax = ds_malloc((size_t)S * rows * sizeof(int32_t), err);
    e->draws = ds_calloc((size_t)S * rows, sizeof *e->draws, err);
    e->dstops = ds_malloc((size_t)S * (DS_MAX_STOP + 1) * sizeof(int32_t), err);
    e->n_scratch = DS_MAX(1, DS_MIN(omp_get_max_threads(), 16));
    e->scratch = ds_calloc((size_t)e->n_scratch, sizeof *e->scratch, err);
    if (!e->preempted || !e->batch || !e->logits || !e->argmax || !e->draws || !e->dstops ||
        !e->scratch)
        goto fail;
    for (int t = 0; t < e->n_scratch; t++)
        if (!(e->scratch[t] = ds_sample_scratch_new(e->V, err))) goto fail;
    *out = e;
    return DS_OK;
fail:
    ds_engine_free(e);
    return DS_ERR;
}

/* ---- events ---------------------------------------------------------------------------------- */

static void emit(choice *ch, int32_t token, const char *text, size_t len, const ds_logprobs_out *lp,
                 ds_finish finish) {
    request *r = ch->req;
    ds_token_event ev = {0};
    ev.index = ch->index;
    ev.token = token;
    ev.text = text ? text : "";
    ev.text_len = text ? len : 0;
    if (lp && r->spec.params.logprobs >= 0 && token >= 0) {
        ev.logprob = lp->logprob;
        ev.n_top = lp->n_top;
        ev.top_ids = lp->top_ids;
        ev.top_logprobs = lp->top_logprobs;
    }
    ev.finish = finish;
    ev.n_prompt = r->spec.n_prompt;
    ev.n_generated = ch->n_generated;
    if (r->spec.on_event) r->spec.on_event(r->spec.user, &ev); /* NULL: mirrored on a non-head */
}

static void request_free(request *r) {
    if (!r) return;
    for (int i = 0; i < r->spec.params.n; i++) {
        choice *ch = &r->choices[i];
        if (ch->seq) ds_seq_free(ch->seq);
        ds_token_counts_free(&ch->counts);
        ds_textout_free(&ch->text);
    }
    free(r->choices);
    free(r->prompt);
    if (r->owns_stop)
        for (int i = 0; i < r->spec.params.n_stop; i++) free(r->spec.params.stop[i]);
    free(r);
}

/* Ends a choice: removes its sequence, flushes held text, sends the final event. When the last
 * choice ends, the request leaves the live list and is freed. */
static void finish_choice(ds_engine *e, choice *ch, ds_finish why) {
    if (ch->done) return;
    ch->done = 1;
    if (ch->seq) {
        /* a finished prefix is worth keeping beyond the device pools */
        if (ch->in_sched && e->prefix && why != DS_FINISH_ABORT)
            ds_prefix_on_finish(e->prefix, ch->seq);
        if (ch->in_sched)
            ds_sched_remove(e->sched, ch->seq,
                            why == DS_FINISH_ABORT ? DS_SEQ_ABORTED : DS_SEQ_FINISHED);
        ds_seq_free(ch->seq);
        ch->seq = NULL;
    }
    const char *tail = NULL;
    size_t tail_len = 0;
    if (why != DS_FINISH_ABORT) ds_textout_flush(&ch->text, &tail, &tail_len);
    emit(ch, -1, tail, tail_len, NULL, why);
    request *r = ch->req;
    pthread_mutex_lock(&e->mu);
    e->stats.finished[why]++;
    pthread_mutex_unlock(&e->mu);
    if (++r->n_done == r->spec.params.n) {
        for (request **p = &e->live; *p; p = &(*p)->next)
            if (*p == r) {
                *p = r->next;
                break;
            }
        request_free(r);
    }
}

static void abort_request(ds_engine *e, request *r) {
    int n = r->spec.params.n;
    for (int i = 0; i < n; i++) {
        if (r->choices[i].done) continue;
        /* finishing the last open choice frees r: decide before, never read r after */
        int last = r->n_done == n - 1;
        finish_choice(e, &r->choices[i], DS_FINISH_ABORT);
        if (last) return;
    }
}

/* ---- submit / abort (any thread) --------------------------------------------------------------
 */

/* A request with its choices and their sequences (prompt copied); id and seed fixed by the caller.
 * The head makes one per submit; the other ranks of a job make the same from the step plan. */
static request *request_new(ds_engine *e, const ds_request_spec *spec, int64_t id,
                            uint64_t seed_base, ds_err *err) {
    const ds_request_params *p = &spec->params;
    request *r = ds_calloc(1, sizeof *r, err);
    if (!r) return NULL;
    r->spec = *spec;
    r->id = id;
    r->seed_base = seed_base;
    r->prompt = ds_malloc((size_t)spec->n_prompt * sizeof(int32_t), err);
    r->choices = ds_calloc((size_t)p->n, sizeof(choice), err);
    if (!r->prompt || !r->choices) {
        request_free(r);
        return NULL;
    }
    memcpy(r->prompt, spec->prompt, (size_t)spec->n_prompt * sizeof(int32_t));
    r->spec.prompt = r->prompt;
    int max_len = spec->n_prompt + p->max_tokens;
    if (max_len > e->max_model_len) max_len = e->max_model_len;
    for (int i = 0; i < p->n; i++) {
        choice *ch = &r->choices[i];
        ch->req = r;
        ch->index = i;
        ds_rng_seed(&ch->rng, seed_base + (uint64_t)i);
        ch->seq = ds_seq_new(id, r->prompt, spec->n_prompt, max_len, err);
        if (!ch->seq || ds_token_counts_init(&ch->counts, err) ||
            ds_textout_init(&ch->text, p->stop, p->n_stop, err)) {
            request_free(r);
            return NULL;
        }
        ch->seq->owner = ch;
    }
    return r;
}

int64_t ds_engine_submit(ds_engine *e, const ds_request_spec *spec, int *why, ds_err *err) {
    int dummy;
    if (!why) why = &dummy;
    *why = DS_SUBMIT_INVALID;
    const ds_request_params *p = &spec->params;
    if (spec->n_prompt < 1) return ds_errf(err, "the prompt is empty"), -1;
    if (p->n < 1 || p->max_tokens < 1 || p->n_stop > DS_MAX_STOP ||
        p->n_stop_token_ids > DS_MAX_STOP || p->logprobs > DS_MAX_LOGPROBS || !spec->on_event)
        return ds_errf(err, "invalid request parameters"), -1;
    for (int i = 0; i < spec->n_prompt; i++)
        if (spec->prompt[i] < 0 || spec->prompt[i] >= e->V)
            return ds_errf(err, "prompt token %d at index %d is outside [0, %d)", spec->prompt[i],
                           i, e->V),
                   -1;
    if (spec->n_prompt >= e->max_model_len)
        return ds_errf(err,
                       "the prompt has %d tokens; this model's maximum context length is %d "
                       "tokens (room is needed for at least one generated token)",
                       spec->n_prompt, e->max_model_len),
               -1;
    pthread_mutex_lock(&e->mu);
    int64_t id = e->next_id++;
    uint64_t seed_base =
        p->has_seed ? p->seed : e->opts.seed ^ (uint64_t)id * 0x9e3779b97f4a7c15ull;
    pthread_mutex_unlock(&e->mu);
    request *r = request_new(e, spec, id, seed_base, err);
    if (!r) return -1;
    pthread_mutex_lock(&e->mu);
    if (e->stopping || e->n_queued >= e->opts.max_queue) {
        int stopping = e->stopping;
        pthread_mutex_unlock(&e->mu);
        request_free(r);
        *why = DS_SUBMIT_FULL;
        return ds_errf(err, stopping ? "the server is shutting down"
                                     : "the request queue is full; retry later"),
               -1;
    }
    r->id = id;
    if (e->inbox_tail)
        e->inbox_tail->next = r;
    else
        e->inbox = r;
    e->inbox_tail = r;
    e->n_queued++;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    *why = 0;
    return id;
}

void ds_engine_abort(ds_engine *e, int64_t id) {
    pthread_mutex_lock(&e->mu);
    if (e->n_aborts == e->cap_aborts) {
        int cap = e->cap_aborts ? 2 * e->cap_aborts : 64;
        int64_t *n = realloc(e->aborts, (size_t)cap * sizeof *n);
        if (!n) { /* cannot record it: the request simply runs to completion */
            pthread_mutex_unlock(&e->mu);
            return;
        }
        e->aborts = n;
        e->cap_aborts = cap;
    }
    e->aborts[e->n_aborts++] = id;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

/* ---- the step loop (engine thread) ------------------------------------------------------------
 */

static void plan_exchange(ds_engine *e, request **in, int64_t *ab, int *n_ab, int *stopping,
                          int *abort_all, int heartbeat);

static int request_busy(const request *r) {
    for (int i = 0; i < r->spec.params.n; i++)
        if (r->choices[i].busy) return 1;
    return 0;
}

/* Aborts request `id` now, or (a step of it is in flight) once that step completes: the same
 * decision on every rank, so the ranks stay in step. Unknown ids are ignored. */
static void abort_or_defer(ds_engine *e, int64_t id) {
    for (request *r = e->live; r; r = r->next) {
        if (r->id != id) continue;
        if (!request_busy(r)) {
            abort_request(e, r);
        } else {
            if (e->n_deferred == e->cap_deferred) {
                int cap = e->cap_deferred ? 2 * e->cap_deferred : 16;
                int64_t *d = realloc(e->deferred, (size_t)cap * sizeof *d);
                if (!d) return; /* cannot keep it: the request runs to its end */
                e->deferred = d;
                e->cap_deferred = cap;
            }
            e->deferred[e->n_deferred++] = id;
        }
        return;
    }
}

static void retry_deferred_aborts(ds_engine *e) {
    int n = e->n_deferred;
    e->n_deferred = 0;
    for (int i = 0; i < n; i++) abort_or_defer(e, e->deferred[i]);
}

/* Moves the inbox into the scheduler and applies aborts. Returns 1 when the engine should exit. */
static int take_inbox(ds_engine *e) {
    request *in = NULL;
    int n_ab = 0, stopping = 0, abort_all = 0, heartbeat = 0;
    int64_t ab[256];
    if (e->head) {
        pthread_mutex_lock(&e->mu);
        for (;;) {
            int idle = !e->inbox && !e->n_aborts && !e->live;
            if (!idle || e->stopping) break;
            if (!e->dist) {
                pthread_cond_wait(&e->wake, &e->mu);
                continue;
            }
            /* In a job an idle head still sends an (empty) plan every second: the other ranks'
             * waits stay short, so DS_COMM_TIMEOUT_S can tell a hung rank from an idle server. */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += 1;
            if (pthread_cond_timedwait(&e->wake, &e->mu, &until) == ETIMEDOUT) {
                heartbeat = !e->inbox && !e->n_aborts && !e->live && !e->stopping;
                break;
            }
        }
        in = e->inbox;
        e->inbox = e->inbox_tail = NULL;
        n_ab = DS_MIN(e->n_aborts, 256);
        if (n_ab) { /* e->aborts is NULL until the first abort: memcpy(NULL, 0) is UB */
            memcpy(ab, e->aborts, (size_t)n_ab * sizeof *ab);
            memmove(e->aborts, e->aborts + n_ab, (size_t)(e->n_aborts - n_ab) * sizeof *ab);
            e->n_aborts -= n_ab;
        }
        stopping = e->stopping;
        abort_all = stopping && ds_now() >= e->stop_deadline;
        pthread_mutex_unlock(&e->mu);
    }
    /* In a job the other ranks wait here for the head's plan (idle ranks included). */
    if (e->dist) plan_exchange(e, &in, ab, &n_ab, &stopping, &abort_all, heartbeat);

    while (in) {
        request *r = in;
        in = in->next;
        r->next = e->live;
        e->live = r;
        int n = r->spec.params.n;
        for (int i = 0; i < n; i++) {
            ds_err err;
            choice *ch = &r->choices[i];
            if (ds_sched_add(e->sched, ch->seq, &err) == DS_OK) {
                ch->in_sched = 1;
            } else {
                /* cannot ever fit the pools: fail this choice cleanly */
                ds_seq_free(ch->seq);
                ch->seq = NULL;
                int last = r->n_done == n - 1; /* then finish_choice frees r */
                finish_choice(e, ch, DS_FINISH_ERROR);
                if (last) break;
            }
        }
    }
    for (int a = 0; a < n_ab; a++) abort_or_defer(e, ab[a]);
    if (abort_all) /* aborting frees r (and only r): take its successor first */
        for (request *r = e->live, *next; r; r = next) {
            next = r->next;
            abort_or_defer(e, r->id);
        }
    return stopping && !e->live;
}

/* The tokens that end a choice: eos (unless ignored) and the request's stop ids. */
static int stop_ids_of(const ds_engine *e, const ds_request_params *p, int32_t *ids) {
    int n = 0;
    if (!p->ignore_eos) ids[n++] = ds_model_config(e->model)->eos_token_id;
    for (int i = 0; i < p->n_stop_token_ids; i++) ids[n++] = p->stop_token_ids[i];
    return n;
}

/* Can the model pick this choice's tokens of the coming step itself (ds_seq_batch.argmax), so
 * that its logits need not come back? When every row the step samples for it is a plain argmax
 * for its sampler (ds_sample_is_argmax); rows further ahead only allow stops more, so the first
 * row decides for all. */
static int picks_greedy(const ds_engine *e, const choice *ch) {
    const ds_request_params *p = &ch->req->spec.params;
    int32_t stop_ids[DS_MAX_STOP + 1];
    const ds_sample_params sp = p->sample;
    return ds_sample_is_argmax(&sp, ch->n_generated >= p->min_tokens, stop_ids_of(e, p, stop_ids),
                               p->logprobs);
}

/* Can the model draw this choice's tokens of the coming step where the logits are
 * (ds_seq_batch.draws), so that the rows need not come back? Every sampled row can, except where
 * logprobs are wanted (they read the whole row). */
static int model_draws(const choice *ch) {
    return ch->req->spec.params.logprobs < 0;
}

/* Penalised counts a step's draws of one choice need: each row's table and the drafts before it. */
static size_t draw_counts_need(const choice *ch, int n_rows) {
    const ds_request_params *p = &ch->req->spec.params;
    if (p->sample.presence_penalty == 0 && p->sample.frequency_penalty == 0) return 0;
    return (size_t)n_rows * ((size_t)ch->counts.n + (size_t)n_rows);
}

/* Row j of a choice's step, as ds_row_draw: the uniform plain decoding would draw for its token
 * (the RNG is only peeked: choose moves it as each row is taken), the counts of the tokens
 * generated before it (the choice's, then the drafts at rows 0..j-1, which are its tokens if row j
 * is reached at all), and the stop ids masked while min_tokens is not reached. counts: room for
 * draw_counts_need entries; stops: room for DS_MAX_STOP + 1. */
static void set_draws(const ds_engine *e, const choice *ch, const int32_t *drafts, int n_rows,
                      ds_row_draw *d, ds_token_count *counts, int32_t *stops) {
    const ds_request_params *p = &ch->req->spec.params;
    const ds_sample_params sp = p->sample;
    int n_stop = stop_ids_of(e, p, stops), penalise = draw_counts_need(ch, 1) > 0;
    ds_rng rng = ch->rng;
    for (int j = 0; j < n_rows; j++) {
        int allow_stop = ch->n_generated + j >= p->min_tokens, n = 0;
        d[j] = (ds_row_draw){sp, 0, NULL, 0, stops, allow_stop ? 0 : n_stop};
        if (ds_sample_draws_uniform(&sp)) d[j].u = ds_rng_uniform(&rng);
        if (!penalise) continue;
        for (int i = 0; i < ch->counts.cap; i++)
            if (ch->counts.slots[i].id >= 0) counts[n++] = ch->counts.slots[i];
        for (int t = 0; t < j; t++) { /* the drafts before row j, merged: one entry an id */
            int at = 0;
            while (at < n && counts[at].id != drafts[t]) at++;
            if (at == n) counts[n++] = (ds_token_count){drafts[t], 0};
            counts[at].count++;
        }
        d[j].counts = counts;
        d[j].n_counts = n;
        counts += n;
    }
}

/* Samples a choice's next token from one logits row, or takes the token the model picked for it
 * (row NULL, *pick): its greedy token (picks_greedy) or its draw (drawn: set_draws, which gave
 * it this row's uniform; the RNG moves past it here, as ds_sample_token would have moved it).
 * `ahead` tokens of this step were already chosen (and counted) before it, so min_tokens and
 * penalties see exactly what plain decoding would. Draws from the choice's own RNG. */
static int32_t choose(ds_engine *e, choice *ch, float *row, const int32_t *pick, int drawn,
                      ds_sample_scratch *sc, int ahead, ds_logprobs_out *lp) {
    const ds_request_params *p = &ch->req->spec.params;
    int32_t stop_ids[DS_MAX_STOP + 1];
    int n_stop = stop_ids_of(e, p, stop_ids);
    const ds_sample_params sp = p->sample;
    int allow_stop = ch->n_generated + ahead >= p->min_tokens;
    int32_t tok =
        row ? ds_sample_token(row, e->V, &sp, &ch->counts, allow_stop, stop_ids, n_stop, &ch->rng,
                              sc, p->logprobs >= 0 ? lp : NULL, p->logprobs > 0 ? p->logprobs : 0)
            : *pick;
    if (!row && drawn && ds_sample_draws_uniform(&sp)) (void)ds_rng_uniform(&ch->rng);
    ds_token_counts_add(&ch->counts, tok);
    return tok;
}

/* Hands a chosen token to the client: appends it to the sequence (unless a verify already holds
 * it there as an accepted draft), feeds the text, emits the event, and finishes the choice on a
 * stop or the length limit. Returns 1 when the choice finished (it may be freed by then). */
static int deliver(ds_engine *e, choice *ch, int32_t tok, const ds_logprobs_out *lp, int in_seq) {
    const ds_request_params *p = &ch->req->spec.params;
    int32_t stop_ids[DS_MAX_STOP + 1];
    int n_stop = stop_ids_of(e, p, stop_ids);
    int allow_stop = ch->n_generated >= p->min_tokens;
    ch->n_generated++;
    ds_err err;
    ds_seq *s = ch->seq;
    int is_stop_tok = 0;
    for (int i = 0; i < n_stop; i++) is_stop_tok |= tok == stop_ids[i];
    if (!in_seq && ds_seq_append(s, tok, &err)) {
        finish_choice(e, ch, DS_FINISH_ERROR);
        return 1;
    }
    pthread_mutex_lock(&e->mu);
    e->stats.generation_tokens_total++;
    pthread_mutex_unlock(&e->mu);
    const char *delta = NULL;
    size_t dlen = 0;
    int stopped = 0;
    if (!(is_stop_tok && allow_stop) &&
        !(p->skip_special_tokens && ds_tok_is_special(e->tok, tok))) {
        size_t blen = 0;
        const char *bytes = ds_tok_token_bytes(e->tok, tok, &blen);
        ds_textout_push(&ch->text, bytes ? bytes : "", bytes ? blen : 0, &delta, &dlen, &stopped);
    }
    ds_finish fin = DS_FINISH_NONE;
    if ((is_stop_tok && allow_stop) || stopped)
        fin = DS_FINISH_STOP;
    else if (ch->n_generated >= p->max_tokens || s->n_tokens >= s->max_len)
        fin = DS_FINISH_LENGTH;
    emit(ch, tok, delta, dlen, lp, DS_FINISH_NONE);
    if (fin == DS_FINISH_NONE) return 0;
    finish_choice(e, ch, fin);
    return 1;
}

/* Prompt lookup: the continuation that followed the latest earlier occurrence of the sequence's
 * last n tokens (n = 3, 2, 1), up to k tokens. */
static int ngram_propose(const int32_t *t, int n_tokens, int k, int32_t *out) {
    for (int n = 3; n >= 1; n--) {
        if (n_tokens <= n) continue;
        const int32_t *tail = t + n_tokens - n;
        for (int at = n_tokens - n - 1; at >= 0; at--) {
            if (memcmp(t + at, tail, (size_t)n * sizeof *t)) continue;
            int m = 0;
            while (m < k && at + n + m < n_tokens) {
                out[m] = t[at + n + m];
                m++;
            }
            if (m > 0) return m;
        }
    }
    return 0;
}

/* Drafts a choice's sequence may carry now: room for them and the token after them, within the
 * request's limits. */
static int draft_room(const request *r, const choice *ch, const ds_seq *s) {
    return DS_MIN(s->max_len - s->n_tokens - 1, r->spec.params.max_tokens - ch->n_generated - 1);
}

/* Appends up to n drafts behind s's last token; s->n_spec = how many went on. */
static void append_drafts(ds_seq *s, const int32_t *drafts, int n) {
    ds_err err;
    int j = 0;
    while (j < n && ds_seq_append(s, drafts[j], &err) == DS_OK) j++;
    s->n_spec = j;
}

/* The scheduler's admission hook (ds_sched_set_admit_drafts): q resumes one token short of its
 * end, so its first step can be a verify — the step that also forks its checkpoint. Drafts come
 * from what every rank of a job can reproduce: the choice's own pending drafts (a decode that was
 * preempted keeps the ones proposed after its last token) or a draft-free method (n-gram, the test
 * oracle). A DSpark draft needs the last token's taps, which no step has computed yet. */
static int admit_drafts(void *ctx, ds_seq *q) {
    ds_engine *e = ctx;
    choice *ch = q->owner;
    int room = DS_MIN(draft_room(ch->req, ch, q), e->k);
    if (room <= 0) return 0;
    int32_t d[DS_MAX_SPEC];
    int n = 0;
    if (ch->n_drafts)
        memcpy(d, ch->drafts, (size_t)(n = ch->n_drafts) * sizeof *d);
    else if (e->opts.test.spec_drafts)
        n = e->opts.test.spec_drafts(e->opts.test.spec_ctx, q->tokens, q->n_tokens, e->k, d);
    else if (e->opts.speculative_method == DS_SPEC_NGRAM)
        n = ngram_propose(q->tokens, q->n_tokens, e->k, d);
    append_drafts(q, d, DS_MIN(DS_MAX(n, 0), room));
    return q->n_spec;
}

/* Puts each decoding choice's drafts behind its last token, as many as its limits allow. */
static void attach_drafts(ds_engine *e) {
    for (request *r = e->live; r; r = r->next)
        for (int i = 0; i < r->spec.params.n; i++) {
            choice *ch = &r->choices[i];
            ds_seq *s = ch->seq;
            if (ch->done || ch->busy || !s || !ch->in_sched || s->status != DS_SEQ_RUNNING ||
                !ch->n_drafts || s->n_computed != s->n_tokens - 1)
                continue;
            append_drafts(s, ch->drafts, DS_MIN(ch->n_drafts, draft_room(r, ch, s)));
        }
}

/* Drops drafts that did not run this step (their sequence was not scheduled). */
static void detach_drafts(ds_engine *e) {
    for (request *r = e->live; r; r = r->next)
        for (int i = 0; i < r->spec.params.n; i++) {
            ds_seq *s = r->choices[i].seq;
            /* a choice in flight keeps its drafts: its step's outcome settles them */
            if (!r->choices[i].done && !r->choices[i].busy && s && s->n_spec) {
                s->n_tokens -= s->n_spec;
                s->n_spec = 0;
            }
        }
}

/* Verify (MODEL_SPEC §8.8): sample every row in order with the request's own sampler; a draft
 * is accepted while it equals the token sampled at its row. Sampling each row exactly as plain
 * decoding would is the lossless rule for drafts proposed deterministically: it accepts draft d
 * with probability p(d) and otherwise draws from p without d. Greedy is the same rule at T = 0,
 * so greedy output equals plain decoding. Returns the accepted count a; toks[0..a] are the
 * tokens to deliver (a accepted drafts and the correction or bonus). */
static int verify(ds_engine *e, choice *ch, ds_sched_item *it, float *rows, const int32_t *picks,
                  int drawn, ds_sample_scratch *sc, int32_t *toks, ds_logprobs_out *lps) {
    ds_seq *s = it->seq;
    int k = s->n_spec, a = 0;
    for (;;) {
        toks[a] = choose(e, ch, rows ? rows + (size_t)a * e->V : NULL, picks ? picks + a : NULL,
                         drawn, sc, a, &lps[a]);
        if (a == k || toks[a] != s->tokens[it->pos0 + 1 + a]) break;
        a++;
    }
    return a;
}

static void count_verify(ds_engine *e, int k, int a) {
    pthread_mutex_lock(&e->mu);
    e->stats.spec_verifies++;
    e->stats.spec_draft_tokens += (uint64_t)k;
    e->stats.spec_accepted_tokens += (uint64_t)a;
    e->stats.spec_emitted_tokens += (uint64_t)a + 1;
    for (int i = 0; i < a; i++) e->stats.spec_accepted_at[i]++;
    pthread_mutex_unlock(&e->mu);
}

/* Taps of item rows [0, n_keep) packed as [n_taps][n_keep][D] at the start of its buffer. */
static void pack_taps(float *taps, int n_taps, int n, int n_keep, int D) {
    for (int j = 1; j < n_taps && n_keep < n; j++)
        memmove(taps + (size_t)j * n_keep * D, taps + (size_t)j * n * D,
                (size_t)n_keep * D * sizeof(float));
}

/* ---- messages of a TP x PP job ----------------------------------------------------------------
 * Two messages per step, point to point (ds_comm_post / ds_comm_take): the head's plan before the
 * step (new requests, aborts, stop), and the sampling rank's outcome after it (per sampled item:
 * accepted count, tokens, logprobs, then the drafts for the next step). Every rank applies them
 * in the same order, so schedulers, pools, prefix caches and texts stay identical everywhere. */
enum { TAG_PLAN = 1, TAG_OUTCOME = 2 }; /* byte messages between ranks (ds_comm_post) */

typedef struct wbuf {
    char *p;
    size_t n, cap;
    int oom;
} wbuf;

static void put(wbuf *w, const void *x, size_t n) {
    if (w->oom) return;
    if (w->n + n > w->cap) {
        size_t cap = DS_MAX(2 * w->cap, w->n + n + 256);
        char *q = realloc(w->p, cap);
        if (!q) {
            w->oom = 1;
            return;
        }
        w->p = q;
        w->cap = cap;
    }
    memcpy(w->p + w->n, x, n);
    w->n += n;
}

typedef struct rbuf {
    const char *p;
    size_t n, off;
    int bad; /* read past the end: a protocol bug, ends the job */
} rbuf;

static void get(rbuf *r, void *x, size_t n) {
    if (r->bad || r->off + n > r->n) {
        r->bad = 1;
        memset(x, 0, n);
        return;
    }
    memcpy(x, r->p + r->off, n);
    r->off += n;
}

/* A lock-step job cannot go on without this rank: say why and end every rank (non-zero). */
static void dist_fatal(ds_engine *e, const char *what, const char *msg) {
    fprintf(stderr, "[deltaserve] %s: %s: %s\n", e->comm->who, what, msg);
    ds_comm_finish(e->comm, 1); /* aborts the job; does not return under MPI */
    abort();
}

typedef struct plan_hdr {
    int32_t stopping, abort_all, n_new, n_aborts;
    int32_t heartbeat; /* an idle head's plan: every rank answers, so a hung one is found */
} plan_hdr;

/* Head: sends the requests of `in` (its own objects), the aborts and the stop flags.
 * Others: receive them and build the same requests into *in. */
static void plan_exchange(ds_engine *e, request **in, int64_t *ab, int *n_ab, int *stopping,
                          int *abort_all, int heartbeat) {
    ds_err err = {{0}};
    wbuf w = {0};
    void *blob = NULL;
    size_t n = 0;
    if (e->head) {
        plan_hdr h = {*stopping, *abort_all, 0, *n_ab, heartbeat};
        for (request *r = *in; r; r = r->next) h.n_new++;
        put(&w, &h, sizeof h);
        for (request *r = *in; r; r = r->next) {
            ds_request_params p = r->spec.params;
            for (int i = 0; i < DS_MAX_STOP; i++) p.stop[i] = NULL;
            put(&w, &r->id, sizeof r->id);
            put(&w, &r->seed_base, sizeof r->seed_base);
            put(&w, &r->spec.n_prompt, sizeof r->spec.n_prompt);
            put(&w, &p, sizeof p);
            for (int i = 0; i < p.n_stop; i++) {
                uint32_t len = (uint32_t)strlen(r->spec.params.stop[i]);
                put(&w, &len, sizeof len);
                put(&w, r->spec.params.stop[i], len);
            }
            put(&w, r->prompt, (size_t)r->spec.n_prompt * sizeof(int32_t));
        }
        put(&w, ab, (size_t)*n_ab * sizeof *ab);
        if (w.oom) dist_fatal(e, "step plan", "out of memory");
        blob = w.p;
        n = w.n;
    }
    /* A message to each rank rather than a broadcast: with pipelined stages the ranks read a
     * step's plan at different times, and the head must not wait for the last of them. */
    if (e->head) {
        for (int r = 1; r < e->comm->size; r++)
            if (ds_comm_post(e->comm, r, TAG_PLAN, blob, n, &err))
                dist_fatal(e, "step plan", err.msg);
        free(w.p);
        /* Broadcasts of a few bytes complete at the head even when a rank is stuck, so an idle
         * head would never notice: a heartbeat makes every rank broadcast in turn, and a rank
         * that does not is named by the timeout (DS_COMM_TIMEOUT_S). */
        uint64_t one = 1;
        if (heartbeat && ds_comm_min_u64(e->comm, &one, &err)) dist_fatal(e, "heartbeat", err.msg);
        return;
    }
    if (ds_comm_take(e->comm, 0, TAG_PLAN, &blob, &n, &err)) dist_fatal(e, "step plan", err.msg);
    rbuf rb = {blob, n, 0, 0};
    plan_hdr h;
    get(&rb, &h, sizeof h);
    if (!rb.bad && h.heartbeat) {
        uint64_t one = 1;
        if (ds_comm_min_u64(e->comm, &one, &err)) dist_fatal(e, "heartbeat", err.msg);
    }
    *stopping = h.stopping;
    *abort_all = h.abort_all;
    request *head = NULL, **tail = &head;
    for (int q = 0; q < h.n_new && !rb.bad; q++) {
        ds_request_spec spec = {0};
        int64_t id;
        uint64_t seed_base;
        get(&rb, &id, sizeof id);
        get(&rb, &seed_base, sizeof seed_base);
        get(&rb, &spec.n_prompt, sizeof spec.n_prompt);
        get(&rb, &spec.params, sizeof spec.params);
        if (spec.params.n_stop < 0 || spec.params.n_stop > DS_MAX_STOP) rb.bad = 1;
        for (int i = 0; i < spec.params.n_stop && !rb.bad; i++) {
            uint32_t len = 0;
            get(&rb, &len, sizeof len);
            if (len > rb.n - rb.off) {
                rb.bad = 1;
                break;
            }
            spec.params.stop[i] = strndup(rb.p + rb.off, len);
            rb.off += len;
            if (!spec.params.stop[i]) dist_fatal(e, "step plan", "out of memory");
        }
        if (spec.n_prompt < 1 || (size_t)spec.n_prompt * sizeof(int32_t) > rb.n - rb.off)
            rb.bad = 1;
        if (rb.bad) break;
        spec.prompt = (const int32_t *)(rb.p + rb.off); /* request_new copies it */
        rb.off += (size_t)spec.n_prompt * sizeof(int32_t);
        spec.on_event = NULL;
        request *r = request_new(e, &spec, id, seed_base, &err);
        if (!r) dist_fatal(e, "step plan", err.msg);
        r->owns_stop = 1;
        *tail = r;
        tail = &r->next;
    }
    *n_ab = DS_MIN(h.n_aborts, 256);
    get(&rb, ab, (size_t)*n_ab * sizeof *ab);
    if (rb.bad) dist_fatal(e, "step plan", "malformed message from the head");
    free(blob);
    *in = head;
}

/* The outcome of step f, from the sampling rank to each other rank (per sampled item: accepted
 * count, tokens, logprobs, then the next drafts), as a message of its own: with pipelined stages
 * the ranks take it at different times, so no collective may carry it. */
static void outcome_send(ds_engine *e, inflight *f) {
    ds_err err = {{0}};
    int rows = e->k + 1;
    wbuf w = {0};
    for (int i = 0; i < f->n_items; i++) {
        if (!f->items[i].sample) continue;
        int cnt = f->va[i] < 0 ? 1 : f->va[i] + 1;
        put(&w, &f->va[i], sizeof f->va[i]);
        put(&w, f->vt[i], (size_t)cnt * sizeof(int32_t));
        put(&w, &f->vlp[(size_t)i * rows], (size_t)cnt * sizeof *f->vlp);
        put(&w, &f->n_dr[i], sizeof f->n_dr[i]);
        put(&w, f->dr[i], (size_t)f->n_dr[i] * sizeof(int32_t));
    }
    if (w.oom) dist_fatal(e, "step outcome", "out of memory");
    for (int r = 0; r < e->comm->size; r++)
        if (r != e->comm->rank && ds_comm_post(e->comm, r, TAG_OUTCOME, w.p, w.n, &err))
            dist_fatal(e, "step outcome", err.msg);
    free(w.p);
}

static void outcome_take(ds_engine *e, inflight *f) {
    ds_err err = {{0}};
    int rows = e->k + 1;
    void *blob = NULL;
    size_t n = 0;
    if (ds_comm_take(e->comm, e->sampler_rank, TAG_OUTCOME, &blob, &n, &err))
        dist_fatal(e, "step outcome", err.msg);
    rbuf rb = {blob, n, 0, 0};
    for (int i = 0; i < f->n_items && !rb.bad; i++) {
        f->va[i] = -1;
        if (!f->items[i].sample) continue;
        get(&rb, &f->va[i], sizeof f->va[i]);
        if (f->va[i] < -1 || f->va[i] > e->k) rb.bad = 1;
        int cnt = f->va[i] < 0 ? 1 : f->va[i] + 1;
        get(&rb, f->vt[i], (size_t)cnt * sizeof(int32_t));
        get(&rb, &f->vlp[(size_t)i * rows], (size_t)cnt * sizeof *f->vlp);
        get(&rb, &f->n_dr[i], sizeof f->n_dr[i]);
        if (f->n_dr[i] < 0 || f->n_dr[i] > e->k) rb.bad = 1;
        if (!rb.bad) get(&rb, f->dr[i], (size_t)f->n_dr[i] * sizeof(int32_t));
    }
    if (rb.bad || rb.off != rb.n) dist_fatal(e, "step outcome", "malformed message");
    free(blob);
}

static float *relay_buf(ds_engine *e, size_t n) {
    if (n > e->relay_cap) {
        float *b = realloc(e->relay, n * sizeof(float));
        if (!b) dist_fatal(e, "tap relay", "out of memory");
        e->relay = b;
        e->relay_cap = n;
    }
    return e->relay;
}

/* DSpark in a pipeline job, after the forward: brings the taps of earlier stages to the draft on
 * the sampling rank, along the TP-rank-0 ranks of each stage. Partial-sum relay: every stage
 * receives the running sum of W_context[:, tap] . tap from the one before (zeros on the first),
 * adds its own taps' products and hands it on; the last stage adds its own, leaving the whole
 * context (before context_norm) in e->relay [tokens][D]. Plain relay: each earlier stage with
 * taps sends them ([its taps][tokens][D], item by item) to the last stage, which unpacks them into
 * its own tap buffer as if it had captured them. */
static void relay_taps(ds_engine *e, int n_items) {
    ds_comm *c = e->comm;
    int P = c->n_stages, st = c->stage, D = ds_model_config(e->model)->hidden_size;
    int j0 = e->tap_j0[st], j1 = e->tap_j1[st], n_all = e->n_tap_ids;
    if (P == 1 || c->tp_rank != 0 || !n_all) return; /* no draft taps (setup_taps) */
    ds_err err = {{0}};
    size_t T = 0;
    for (int i = 0; i < n_items; i++) T += (size_t)e->batch[i].n;
    if (e->opts.draft_tap_relay == DS_RELAY_PARTIAL_SUM) {
        float *acc = relay_buf(e, T * D);
        if (st > 0) {
            if (ds_comm_recv(c, st - 1, acc, T * D, &err)) dist_fatal(e, "tap relay", err.msg);
        } else {
            memset(acc, 0, T * D * sizeof(float));
        }
        ds_draft *d = e->last_stage ? e->draft : e->draft_ctx;
        if (j1 > j0) {
            size_t tap_off = 0, off = 0;
            for (int i = 0; i < n_items; i++) {
                int n = e->batch[i].n;
                if (ds_draft_context_add(d, n, j0, j1, e->taps + tap_off + (size_t)j0 * n * D,
                                         acc + off * D, &err))
                    dist_fatal(e, "tap relay", err.msg);
                tap_off += (size_t)n * n_all * D;
                off += (size_t)n;
            }
        }
        if (!e->last_stage && ds_comm_send(c, st + 1, acc, T * D, &err))
            dist_fatal(e, "tap relay", err.msg);
        return;
    }
    /* plain */
    if (!e->last_stage) {
        if (j1 <= j0) return;
        float *pk = relay_buf(e, (size_t)(j1 - j0) * T * D), *w = pk;
        size_t tap_off = 0;
        for (int i = 0; i < n_items; i++) {
            size_t rows = (size_t)e->batch[i].n * D;
            memcpy(w, e->taps + tap_off + (size_t)j0 * rows,
                   (size_t)(j1 - j0) * rows * sizeof(float));
            w += (size_t)(j1 - j0) * rows;
            tap_off += rows * n_all;
        }
        if (ds_comm_send(c, P - 1, pk, (size_t)(j1 - j0) * T * D, &err))
            dist_fatal(e, "tap relay", err.msg);
        return;
    }
    for (int q = 0; q < P - 1; q++) {
        int a = e->tap_j0[q], b = e->tap_j1[q];
        if (b <= a) continue;
        float *pk = relay_buf(e, (size_t)(b - a) * T * D), *r = pk;
        if (ds_comm_recv(c, q, pk, (size_t)(b - a) * T * D, &err))
            dist_fatal(e, "tap relay", err.msg);
        size_t tap_off = 0;
        for (int i = 0; i < n_items; i++) {
            size_t rows = (size_t)e->batch[i].n * D;
            memcpy(e->taps + tap_off + (size_t)a * rows, r, (size_t)(b - a) * rows * sizeof(float));
            r += (size_t)(b - a) * rows;
            tap_off += rows * n_all;
        }
    }
}

/* The drafts for a choice after its step: the tokens it has once the outcome is applied are
 * tokens[0 .. n_keep) and then `next`. Proposed by the sampling rank at launch, so that they can
 * travel with the outcome. */
static int draft_after(ds_engine *e, ds_seq *s, const ds_sched_item *it, int n_keep, int32_t next,
                       int32_t *out) {
    int k = e->k, len = it->pos0 + n_keep + 1;
    if ((size_t)len > e->after_cap) { /* grown, not allocated per call: this runs every step */
        int32_t *b = realloc(e->after, (size_t)len * sizeof *b);
        if (!b) return 0; /* no drafts: costs speed, never output */
        e->after = b;
        e->after_cap = (size_t)len;
    }
    int32_t *t = e->after;
    memcpy(t, s->tokens, (size_t)(len - 1) * sizeof *t);
    t[len - 1] = next;
    int n = e->opts.test.spec_drafts
                ? e->opts.test.spec_drafts(e->opts.test.spec_ctx, t, len, k, out)
                : ngram_propose(t, len, k, out);
    return DS_MAX(0, DS_MIN(n, k));
}

/* Schedules and runs one step for the sequences of group g (every sequence when not pipelined);
 * the sampling rank chooses the tokens, writes the draft's context, proposes the next drafts and
 * sends the outcome. f stays inactive when there was nothing to run. */
static void launch(ds_engine *e, inflight *f, int g) {
    int n_items = 0, n_pre = 0;
    ds_sched_set_group(e->sched, g, e->n_fl);
    if (e->k) attach_drafts(e);
    ds_sched_schedule(e->sched, f->items, &n_items, e->preempted, &n_pre);
    if (n_pre) {
        pthread_mutex_lock(&e->mu);
        e->stats.preemptions_total += (uint64_t)n_pre;
        pthread_mutex_unlock(&e->mu);
    }
    f->n_items = n_items;
    f->active = 0;
    if (!n_items) {
        if (e->k) detach_drafts(e);
        return;
    }
    f->t0 = ds_now();
    f->n_prompt_tokens = 0;
    int rows = e->k + 1;
    const ds_config *c = ds_model_config(e->model);
    int n_taps = e->n_taps, D = c->hidden_size;
    size_t slot_n = ds_model_slot_floats(e->model), tap_need = 0;
    for (int i = 0; i < n_items; i++) tap_need += (size_t)f->items[i].n * n_taps * D;
    if (tap_need > e->taps_cap) {
        float *t = realloc(e->taps, tap_need * sizeof(float));
        if (!t) { /* no taps this step: the draft context lags, outputs stay exact */
            if (e->dist) dist_fatal(e, "draft taps", "out of memory"); /* the relay needs them */
            n_taps = 0;
        } else {
            e->taps = t;
            e->taps_cap = tap_need;
        }
    }
    /* room for the draws' penalised counts, before any pointer into it is taken */
    size_t dc_need = 0;
    for (int i = 0; e->sampler && i < n_items; i++) {
        ds_seq *s = f->items[i].seq;
        if (f->items[i].sample) dc_need += draw_counts_need(s->owner, s->n_spec + 1);
    }
    int draws_ok = 1; /* without the room, rows come back whole and are sampled here */
    if (dc_need > e->cap_dcounts) {
        ds_token_count *dc = realloc(e->dcounts, dc_need * sizeof *dc);
        if (dc) {
            e->dcounts = dc;
            e->cap_dcounts = dc_need;
        } else {
            draws_ok = 0;
        }
    }
    size_t tap_off = 0, dc_off = 0;
    for (int i = 0; i < n_items; i++) {
        ds_sched_item *it = &f->items[i];
        ds_seq *s = it->seq;
        choice *ch = s->owner;
        ch->busy = 1;
        int verify_rows = s->n_spec ? s->n_spec + 1 : 1;
        int want_logits = it->sample && e->last_stage;
        /* a greedy choice gets its tokens picked beside the logits, which then stay there; a
         * sampled one (on the sampling rank) gets them drawn there */
        int greedy = want_logits && picks_greedy(e, ch);
        int drawn = want_logits && !greedy && e->sampler && draws_ok && model_draws(ch);
        if (drawn) {
            set_draws(e, ch, s->tokens + it->pos0 + 1, verify_rows, e->draws + (size_t)i * rows,
                      e->dcounts + dc_off, e->dstops + (size_t)i * (DS_MAX_STOP + 1));
            dc_off += draw_counts_need(ch, verify_rows);
        }
        e->batch[i] = (ds_seq_batch){
            .tokens = s->tokens + it->pos0,
            .n = it->n,
            .pos0 = it->pos0,
            .slot = ds_slot_data(e->slots, s->slot),
            .block_table = s->block_table,
            .logits = want_logits && !greedy && !drawn ? e->logits + (size_t)i * rows * e->V : NULL,
            .argmax = greedy || drawn ? e->argmax + (size_t)i * rows : NULL,
            .draws = drawn ? e->draws + (size_t)i * rows : NULL,
            .n_logits = want_logits ? verify_rows : 0,
            .tap_layers = n_taps ? e->tap_ids : NULL,
            .n_taps = n_taps,
            .taps = n_taps ? e->taps + tap_off : NULL,
            .state_rows = s->n_spec ? f->state_rows + (size_t)i * rows * slot_n : NULL,
        };
        tap_off += (size_t)it->n * n_taps * D;
        if (it->pos0 < s->n_prompt) f->n_prompt_tokens += DS_MIN(it->n, s->n_prompt - it->pos0);
        /* A sequence resumed from a checkpoint starts from a copy of it: before any kernel reads
         * its slot, whatever kind of step this is (prefill, decode or verify). */
        if (e->prefix && ds_prefix_would_hold(e->prefix, s, it->pos0)) {
            pthread_mutex_lock(&e->mu);
            e->stats.ckpt_holds++;
            pthread_mutex_unlock(&e->mu);
        }
        if (e->prefix && ds_prefix_take_fork(e->prefix, s, e->batch[i].slot) && s->n_spec) {
            pthread_mutex_lock(&e->mu);
            e->stats.spec_fork_verifies++;
            pthread_mutex_unlock(&e->mu);
        }
    }
    f->active = 1;
    ds_err err = {{0}};
    int frc = e->dist ? ds_pp_step(e->comm, e->model, &e->kv, e->batch, n_items, &e->ppb, &err)
                      : ds_model_forward(e->model, &e->kv, e->batch, n_items, &err);
    if (frc) {
        /* In a job the ranks would diverge: end it. Alone, only a bug can bring us here (inputs
         * were validated at submit): fail the batch's requests rather than the server. */
        if (e->dist) dist_fatal(e, "forward", err.msg);
        fprintf(stderr, "[deltaserve] forward failed: %s\n", err.msg);
        for (int i = 0; i < n_items; i++) {
            choice *ch = f->items[i].seq->owner;
            ch->busy = 0;
            finish_choice(e, ch, DS_FINISH_ERROR);
        }
        f->active = 0;
        if (e->k) detach_drafts(e);
        return;
    }
    if (e->dist) relay_taps(e, n_items);
    if (e->sampler) {
        /* Every sampled item's tokens: a verify samples its rows until a draft is rejected, a
         * plain item samples one. */
        int summed =
            e->dist && e->comm->n_stages > 1 && e->opts.draft_tap_relay == DS_RELAY_PARTIAL_SUM;
        /* The tokens first, the items side by side when more than one samples on the host (at
         * V = 163840 a row costs ~1 ms of one core): each choice samples from its own rows with
         * its own RNG and counts, so neither the order nor the thread changes what it draws. */
        int n_host = 0;
        for (int i = 0; i < n_items; i++) n_host += f->items[i].sample && e->batch[i].logits;
#pragma omp parallel for schedule(dynamic) num_threads(e->n_scratch) if (n_host > 1)
        for (int i = 0; i < n_items; i++) {
            ds_sched_item *it = &f->items[i];
            choice *ch = it->seq->owner;
            ds_sample_scratch *sc = e->scratch[omp_get_thread_num()];
            float *lg = e->batch[i].logits;            /* or NULL, and then: */
            const int32_t *picks = e->batch[i].argmax; /* the greedy tokens */
            f->va[i] = -1;
            if (!it->sample) continue;
            int drawn = e->batch[i].draws != NULL;
            if (it->seq->n_spec)
                f->va[i] =
                    verify(e, ch, it, lg, picks, drawn, sc, f->vt[i], f->vlp + (size_t)i * rows);
            else
                f->vt[i][0] = choose(e, ch, lg, picks, drawn, sc, 0, &f->vlp[(size_t)i * rows]);
        }
        tap_off = 0;
        size_t off = 0;
        int n_prop = 0, n_ctx = 0; /* DSpark proposals and context writes gathered */
        for (int i = 0; i < n_items; i++) {
            ds_sched_item *it = &f->items[i];
            ds_seq *s = it->seq;
            int n_run = e->batch[i].n;
            f->n_dr[i] = 0;
            /* positions the step keeps: a verify only its accepted ones */
            int n_keep = f->va[i] >= 0 ? f->va[i] + 1 : it->n;
            /* The draft's context rows for the positions kept (later ones are rewritten when
             * they are recomputed), written below for every item together, before it drafts
             * from them. */
            if (n_taps && e->draft) {
                ds_draft_ctx_write *cw = &e->ctx_w[n_ctx++];
                *cw = (ds_draft_ctx_write){s->block_table, it->pos0, n_keep, NULL, NULL};
                if (summed) {
                    cw->sum = e->relay + off * D;
                } else {
                    pack_taps(e->taps + tap_off, n_taps, n_run, n_keep, D);
                    cw->taps = e->taps + tap_off;
                }
            }
            tap_off += (size_t)n_run * n_taps * D;
            off += (size_t)n_run;
            if (it->sample && e->k) {
                int32_t next = f->vt[i][f->va[i] < 0 ? 0 : f->va[i]];
                if (e->draft && !e->opts.test.spec_drafts) { /* proposed below, all together */
                    e->prop_item[n_prop] = i;
                    e->prop_table[n_prop] = s->block_table;
                    e->prop_p[n_prop] = it->pos0 + n_keep - 1; /* the last context row */
                    e->prop_anchor[n_prop++] = next;
                } else {
                    f->n_dr[i] = draft_after(e, s, it, n_keep, next, f->dr[i]);
                }
            }
        }
        if (n_ctx && ds_draft_write_context_batch(e->draft, &e->dcache, n_ctx, e->ctx_w, &err))
            fprintf(stderr, "[deltaserve] draft context: %s\n", err.msg);
        /* The DSpark proposals of every sampled item in as few passes as the draft cache's spare
         * slots allow: each item's context rows were written above, and a proposal reads only
         * its own sequence's rows. */
        for (int c0 = 0, m; c0 < n_prop; c0 += m) {
            m = DS_MIN(n_prop - c0, e->dcache.max_seqs);
            int rc =
                ds_draft_propose_batch(e->draft, &e->dcache, m, e->prop_table + c0, e->prop_p + c0,
                                       e->prop_anchor + c0, e->k, e->prop_drafts, NULL, &err);
            if (rc) fprintf(stderr, "[deltaserve] draft: %s\n", err.msg); /* speed, not output */
            for (int j = 0; j < m; j++) {
                int i = e->prop_item[c0 + j];
                f->n_dr[i] = rc ? 0 : e->k;
                if (!rc)
                    memcpy(f->dr[i], e->prop_drafts + (size_t)j * e->k,
                           (size_t)e->k * sizeof(int32_t));
            }
        }
        if (e->dist) outcome_send(e, f);
    }
    if (e->k) detach_drafts(e);
}

/* Applies step f's outcome on this rank: KDA rollback and truncation of verifies, the commit,
 * prefix-cache filing, the tokens (events on the head), the next drafts. */
static void complete(ds_engine *e, inflight *f) {
    if (!f->active) return;
    f->active = 0;
    int n_items = f->n_items, rows = e->k + 1;
    size_t slot_n = ds_model_slot_floats(e->model);
    if (!e->sampler) outcome_take(e, f);
    for (int i = 0; i < n_items; i++) {
        ds_sched_item *it = &f->items[i];
        ds_seq *s = it->seq;
        ((choice *)s->owner)->busy = 0;
        if (!it->sample || f->va[i] < 0) continue;
        /* a verify: roll the KDA slot back to the last accepted row and shrink the item to what
         * was accepted, so the commit below (and the prefix cache) only see accepted tokens */
        int a = f->va[i];
        count_verify(e, it->n - 1, a);
        ds_dmem_copy(ds_slot_data(e->slots, s->slot),
                     f->state_rows + ((size_t)i * rows + a) * slot_n, slot_n * sizeof(float));
        s->n_tokens = it->pos0 + 1 + a; /* the accepted drafts stay, the rest go */
        s->n_spec = 0;
        it->n = a + 1;
    }
    ds_sched_commit(e->sched, f->items, n_items);
    /* File the pages and rung checkpoints this step completed, before sampling appends tokens
     * (the slot now summarises exactly n_computed tokens). */
    if (e->prefix)
        for (int i = 0; i < n_items; i++) {
            ds_seq *s = f->items[i].seq;
            if (s->status == DS_SEQ_RUNNING)
                ds_prefix_on_computed(e->prefix, s, ds_slot_data(e->slots, s->slot));
        }
    for (int i = 0; i < n_items; i++) {
        ds_sched_item *it = &f->items[i];
        if (!it->sample) continue;
        choice *ch = it->seq->owner;
        int finished = 0, cnt = f->va[i] < 0 ? 1 : f->va[i] + 1;
        for (int j = 0; j < cnt && !finished; j++)
            finished = deliver(e, ch, f->vt[i][j], &f->vlp[(size_t)i * rows + j], j < cnt - 1);
        if (finished || !e->k) continue;
        ch->n_drafts = f->n_dr[i];
        memcpy(ch->drafts, f->dr[i], (size_t)f->n_dr[i] * sizeof(int32_t));
        pthread_mutex_lock(&e->mu);
        e->stats.spec_draft_digest =
            (uint32_t)XXH64(ch->drafts, (size_t)ch->n_drafts * 4, e->stats.spec_draft_digest);
        pthread_mutex_unlock(&e->mu);
    }
    pthread_mutex_lock(&e->mu);
    e->stats.prompt_tokens_total += (uint64_t)f->n_prompt_tokens;
    e->stats.steps_total++;
    e->stats.step_seconds_total += ds_now() - f->t0;
    pthread_mutex_unlock(&e->mu);
}

static void update_queue_stats(ds_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->n_queued = ds_sched_n_waiting(e->sched);
    for (request *r = e->inbox; r; r = r->next) e->n_queued++;
    e->stats.running = ds_sched_n_running(e->sched);
    e->stats.waiting = e->n_queued;
    e->stats.pages_total = ds_page_n_total(e->pages);
    e->stats.pages_used = e->stats.pages_total - ds_page_n_free(e->pages);
    e->stats.slots_total = ds_slot_n_total(e->slots);
    e->stats.slots_used = e->stats.slots_total - ds_slot_n_free(e->slots);
    e->stats.pages_cached_idle = ds_page_n_cached_idle(e->pages);
    if (e->prefix) {
        ds_prefix_stats ps;
        ds_prefix_get_stats(e->prefix, &ps);
        e->stats.prefix_query_tokens = ps.query_tokens;
        e->stats.prefix_hit_tokens = ps.hit_tokens;
        e->stats.ckpt_kept = ps.ckpt_kept;
        e->stats.ckpt_dropped = ps.ckpt_dropped;
        e->stats.ckpt_evicted = ps.ckpt_evicted;
        e->stats.forks = ps.forks;
        e->stats.prefix_pages_evicted = ps.pages_evicted;
        e->stats.prefix_collisions = ps.collisions;
        e->stats.ckpt_slots_total = ps.ckpt_total;
        e->stats.ckpt_slots_used = ps.ckpt_used;
    }
    if (e->offload) {
        ds_offload_stats os;
        ds_offload_get_stats(e->offload, &os);
        e->stats.offload_stores = os.stores;
        e->stats.offload_loads_ram = os.loads_ram;
        e->stats.offload_loads_disk = os.loads_disk;
        e->stats.offload_loads_remote = os.loads_remote;
        e->stats.offload_misses = os.misses;
        e->stats.offload_bad = os.bad;
        e->stats.offload_remote_errors = os.remote_errors;
    }
    pthread_mutex_unlock(&e->mu);
}

/* The step loop. Step m completes step m - n_fl (the last one of the same group) first, then takes
 * the head's plan and launches; without pipelining (n_fl = 1) every step completes right after
 * its launch. */
static void *engine_main(void *arg) {
    ds_engine *e = arg;
    for (;;) {
        inflight *f = &e->fl[e->micro % (uint64_t)e->n_fl];
        complete(e, f);
        retry_deferred_aborts(e);
        if (e->head && e->opts.test.step) e->opts.test.step(e->opts.test.step_ctx, e->micro);
        if (take_inbox(e)) break;
        update_queue_stats(e);
        launch(e, f, (int)(e->micro % (uint64_t)e->n_fl));
        e->micro++;
        if (e->n_fl == 1) complete(e, f);
        update_queue_stats(e);
    }
    update_queue_stats(e);
    return NULL;
}

int ds_engine_start(ds_engine *e, ds_err *err) {
    if (pthread_create(&e->thread, NULL, engine_main, e))
        return ds_errf(err, "engine: cannot start the step-loop thread");
    e->started = 1;
    return DS_OK;
}

void ds_engine_stop(ds_engine *e, double grace_s) {
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    e->stop_deadline = ds_now() + grace_s;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    if (e->started) {
        pthread_join(e->thread, NULL);
        e->started = 0;
    }
}

void ds_engine_join(ds_engine *e) {
    if (e->started) {
        pthread_join(e->thread, NULL);
        e->started = 0;
    }
}

void ds_engine_get_stats(ds_engine *e, ds_engine_stats *s) {
    pthread_mutex_lock(&e->mu);
    *s = e->stats;
    pthread_mutex_unlock(&e->mu);
}

void ds_engine_free(ds_engine *e) {
    if (!e) return;
    if (e->started) ds_engine_stop(e, 0);
    /* requests that never reached the engine thread still get their final events */
    while (e->inbox) {
        request *r = e->inbox;
        e->inbox = r->next;
        r->next = e->live;
        e->live = r;
    }
    while (e->live) abort_request(e, e->live);
    if (e->sched) ds_sched_free(e->sched);
    ds_prefix_free(e->prefix);
    ds_offload_free(e->offload);
    ds_slot_pool_free(e->slots);
    ds_page_pool_free(e->pages);
    ds_kv_pool_free(&e->kv);
    for (int t = 0; e->scratch && t < e->n_scratch; t++) ds_sample_scratch_free(e->scratch[t]);
    free(e->scratch);
    if (e->draft) {
        ds_draft_cache_free(&e->dcache);
        ds_draft_free(e->draft);
    }
    for (int q = 0; e->fl && q < e->n_fl; q++) {
        inflight *f = &e->fl[q];
        free(f->items);
        free(f->vt);
        free(f->vlp);
        free(f->va);
        free(f->dr);
        free(f->n_dr);
        ds_dmem_free(e->on_device, f->state_rows);
    }
    free(e->fl);
    free(e->deferred);
    free(e->taps);
    free(e->preempted);
    free(e->batch);
    ds_dmem_host_free(e->logits);
    free(e->argmax);
    free(e->draws);
    free(e->dcounts);
    free(e->dstops);
    free(e->aborts);
    ds_pp_bufs_free(&e->ppb);
    ds_draft_free(e->draft_ctx);
    free(e->relay);
    free(e->after);
    free(e->prop_item);
    free(e->prop_p);
    free(e->prop_table);
    free(e->prop_anchor);
    free(e->prop_drafts);
    free(e->ctx_w);
    ds_tok_free(e->tok);
    ds_model_free(e->model);
    free(e->model_dir);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->wake);
    free(e);
}
