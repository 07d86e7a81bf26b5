/* setup.c — an engine's making and unmaking: option defaults, the split of the memory budget
 * between KDA state slots and MLA pages, prefix caching and the offload tier, speculative decoding,
 * create/free, and starting, stopping and joining the engine thread. */
#include "engine/engine_impl.h"

#include "base/devmem.h"
#include "cache/identity.h"
#include "kernels/shared/kv_row.h"
#include "text/chat.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

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
    o->kv_hold_timeout_ms = 120000;
    o->kv_pull_timeout_ms = 30000;
}

void ds_request_params_default(ds_request_params *p) {
    memset(p, 0, sizeof *p);
    ds_sample_params_default(&p->sample);
    p->max_tokens = 16;
    p->logprobs = -1;
    p->n = 1;
    p->skip_special_tokens = 1;
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
        size_t avail =
            ds_dmem_on_device(e->dm) ? ds_model_device_mem_free(e->model) : mem_available();
        budget = (size_t)(e->opts.kv_cache_fraction * (double)avail);
    }
    size_t slot_bytes = ds_model_slot_floats(e->model) * sizeof(float);
    size_t page_bytes = (size_t)ds_kv_pool_layers(e->model) * e->opts.block_size *
                        ds_model_latent_row_bytes(e->model);
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
    if (e->opts.test.max_pages > 0) n_pages = DS_MIN(n_pages, (size_t)e->opts.test.max_pages);
    size_t min_pages = (size_t)(e->opts.max_num_batched_tokens / e->opts.block_size + 2);
    if (n_pages < min_pages)
        return ds_errf(err,
                       "kv cache memory %zu bytes leaves %zu pages; at least %zu are needed "
                       "(raise --kv-cache-memory or lower --max-num-batched-tokens)",
                       budget, n_pages, min_pages);
    if (n_pages > (size_t)1 << 30) n_pages = (size_t)1 << 30;
    int cap = (int)DS_MIN(n_pages * (size_t)e->opts.block_size, (size_t)INT32_MAX / 2);
    /* asked for (as vLLM: more than the model's positions or than the cache holds is an error,
     * not a silent cut), else the most both allow */
    const int asked = e->opts.max_model_len;
    if (asked && c->max_position_embeddings > 0 && asked > c->max_position_embeddings)
        return ds_errf(err,
                       "--max-model-len %d is more than the model's max_position_embeddings %lld "
                       "(config.json)",
                       asked, (long long)c->max_position_embeddings);
    if (asked > cap)
        return ds_errf(err,
                       "--max-model-len %d is more than the %d tokens the kv cache holds (raise "
                       "--kv-cache-memory or lower --max-model-len)",
                       asked, cap);
    e->max_model_len = asked ? asked : cap;
    if (c->max_position_embeddings > 0 && e->max_model_len > c->max_position_embeddings)
        e->max_model_len = (int)c->max_position_embeddings;
    if (ds_kv_pool_init(&e->kv, e->model, (int)n_pages, e->opts.block_size, err) ||
        ds_page_pool_create((int)n_pages, &e->pages, err) ||
        ds_slot_pool_create_on(e->dm, (int)n_slots, ds_model_slot_floats(e->model), &e->slots, err))
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

/* Will this rank load a DSpark draft (setup_spec)? */
static int will_draft(const ds_engine *e) {
    return e->opts.speculative_method == DS_SPEC_DSPARK && !e->opts.test.spec_drafts && e->sampler;
}

/* The smallest v over the job's ranks (prefix.h's agreement on offload hits). */
static int agree_min(void *ctx, int v) {
    ds_engine *e = ctx;
    ds_err err = {{0}};
    uint64_t x = v > 0 ? (uint64_t)v : 0;
    if (ds_comm_min_u64(e->comm, &x, &err)) eng_dist_fatal(e, "offload agreement", err.msg);
    return (int)x;
}

/* The prompt cut spacing: the rung interval snapped down to a page (at least one). */
static int chunk_of(const ds_engine_opts *o) {
    int iv = o->state_checkpoint_interval_tokens > 0 ? o->state_checkpoint_interval_tokens : 256;
    return DS_MAX(o->block_size, iv / o->block_size * o->block_size);
}

/* Prefix caching and the offload tier. Every hash is seeded with the model's identity, and
 * offload keys carry it too, so two models never share entries. With a tier that outlives the
 * process (disk, Redis), and in P/D (blocks from another server), the identity is a digest of
 * the weights' bytes (cache/identity.h: a fine-tune of the same shape is another model);
 * otherwise the config and weight size suffice.
 * It also names what changes the cached numbers besides the weights: the device, the
 * batch-invariant mode, the tensor-parallel width (each rank keeps its own slice and sums in its
 * own order), the prompt cut spacing (docs/prefix-cache.md) and the latent cache dtype
 * (docs/quantization.md, "FP8 latent cache"). */
static int setup_prefix(ds_engine *e, ds_err *err) {
    const ds_engine_opts *o = &e->opts;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", e->model_dir);
    size_t len = 0;
    char *cfg = ds_read_file(path, &len, NULL);
    uint64_t id[9] = {XXH3_64bits_withSeed(cfg ? cfg : "", cfg ? len : 0,
                                           (uint64_t)ds_model_weight_bytes(e->model))};
    /* P/D's identity names the weights by their files' size (a rank's weight bytes are its
     * share) and, below, by their digest */
    uint64_t xid0 =
        XXH3_64bits_withSeed(cfg ? cfg : "", cfg ? len : 0, ds_checkpoint_file_bytes(e->model_dir));
    free(cfg);
    int persistent = (o->kv_offload_disk_dir && o->kv_offload_disk_dir[0]) ||
                     (o->kv_offload_remote && o->kv_offload_remote[0]);
    /* the weights by their contents (identity.h) where keys outlive the process, and in P/D,
     * where another server's blocks arrive: both sides of a transfer compute it, whatever tiers
     * either keeps (a consumer with a disk tier once refused every transfer of a producer
     * without one, and two checkpoints of one size would have passed for the same model) */
    if ((persistent || o->kv_role != DS_KV_NONE) && e->head &&
        ds_checkpoint_digest(e->model_dir, id + 1, err))
        return DS_ERR;
    id[3] = (uint64_t)ds_dmem_on_device(e->dm); /* the bit: the same id as before on either */
    id[4] = (uint64_t)o->batch_invariant;
    id[5] = (uint64_t)(e->comm ? e->comm->tp_size : 1);
    id[6] = (uint64_t)e->chunk_tokens;
    id[7] = 1; /* the numeric contract's version */
    /* the weights' format: the same checkpoint quantized otherwise computes other states */
    const char *qx = o->quantization_exclude ? o->quantization_exclude : "";
    id[8] = o->quantization ? XXH3_64bits_withSeed(qx, strlen(qx), (uint64_t)o->quantization) : 0;
    uint64_t seed = XXH3_64bits(id, sizeof id);
    /* P/D: the identity of the numbers whatever the TP width and share (docs/pd.md) */
    id[0] = xid0;
    id[5] = 1;
    uint64_t xseed = XXH3_64bits(id, sizeof id);
    /* the cache dtype: a page of one form is never read as another's (the f32 seed stays what
     * it was, so earlier f32 entries on disk or in Redis keep their keys; so does FP8's) */
    const int kvd = ds_model_kv_dtype(e->model);
    if (kvd != DS_KV_F32) {
        char tag[48];
        const int n = snprintf(tag, sizeof tag, "kv-cache-dtype %s", ds_kv_dtype_names[kvd]);
        seed = XXH3_64bits_withSeed(tag, (size_t)n, seed);
        xseed = XXH3_64bits_withSeed(tag, (size_t)n, xseed);
    }
    /* one identity for the whole job (each rank holds a different share of the weights) */
    if (e->dist && (ds_comm_bcast(e->comm, &seed, sizeof seed, err) ||
                    ds_comm_bcast(e->comm, &xseed, sizeof xseed, err)))
        return DS_ERR;
    e->kv_seed = seed;
    e->kv_xseed = xseed;
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
                         e->dm,
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

/* Speculative decoding: num_speculative_tokens drafts per verify; dspark loads its draft next to
 * the target and keeps its latent rows in a cache addressed by the target's own pages (so a shared
 * prefix page shares its draft rows too). */
static int setup_spec(ds_engine *e, ds_err *err) {
    const ds_engine_opts *o = &e->opts;
    const int S = o->max_num_seqs; /* sequences a step may hold: proposals at once, at most */
    if (o->num_speculative_tokens < 1 || o->num_speculative_tokens > DS_MAX_SPEC)
        return ds_errf(err, "--num-speculative-tokens must be in [1, %d], got %d", DS_MAX_SPEC,
                       o->num_speculative_tokens);
    e->num_speculative_tokens = o->num_speculative_tokens;
    /* In a job only the sampling rank drafts (its drafts reach the others with its tokens); the
     * earlier stages' TP rank 0 capture their taps and relay them (see eng_setup_taps). */
    if (o->speculative_method == DS_SPEC_DSPARK && !o->test.spec_drafts) {
        char dir[4096];
        if (o->draft_model_dir)
            snprintf(dir, sizeof dir, "%s", o->draft_model_dir);
        else
            snprintf(dir, sizeof dir, "%s/draft", e->model_dir);
        if (e->sampler &&
            (ds_draft_load(dir, e->model, &e->draft, err) ||
             ds_draft_cache_init_seqs(&e->dcache, e->draft, ds_page_n_total(e->pages),
                                      e->opts.block_size, e->num_speculative_tokens, S, err)))
            return ds_err_prefix(err, "--draft-model %s", dir);
        if (e->draft) {
            e->prop_item = ds_malloc((size_t)S * sizeof(int), err);
            e->prop_p = ds_malloc((size_t)S * sizeof(int), err);
            e->prop_table = ds_malloc((size_t)S * sizeof(int32_t *), err);
            e->prop_anchor = ds_malloc((size_t)S * sizeof(int32_t), err);
            e->prop_drafts =
                ds_malloc((size_t)S * e->num_speculative_tokens * sizeof(int32_t), err);
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
        if (eng_setup_taps(e, dir, err)) return ds_err_prefix(err, "--draft-model %s", dir);
    } else if (o->speculative_method != DS_SPEC_NGRAM && o->speculative_method != DS_SPEC_DSPARK) {
        return ds_errf(err, "unknown speculative method %d", o->speculative_method);
    }
    if (e->head) /* (the draft lives on the sampling rank: where it runs is said there) */
        fprintf(stderr, "[deltaserve] speculative decoding: %s, num_speculative_tokens = %d\n",
                o->speculative_method == DS_SPEC_DSPARK ? "dspark" : "ngram",
                e->num_speculative_tokens);
    if (e->draft)
        fprintf(stderr, "[deltaserve] DSpark draft on the %s\n",
                ds_draft_on_device(e->draft) ? "GPU, beside the target" : "CPU");
    return DS_OK;
}

static int alloc_step_buffers(ds_engine *e, ds_err *err);

int ds_engine_create(const ds_engine_opts *opts, ds_engine **out, ds_err *err) {
    *out = NULL;
    ds_engine *e = ds_calloc(1, sizeof *e, err);
    if (!e) return DS_ERR;
    e->opts = *opts;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->gmu, NULL);
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
    mo.quantization = opts->quantization;
    mo.quantization_exclude = opts->quantization_exclude;
    mo.kv_dtype = opts->kv_dtype;
    mo.load_random = opts->load_random;
    /* one GPU per rank of a job: rank r of this host uses device r (the backend wraps it modulo
     * the devices present, so a job can also share one GPU) */
    if (opts->comm && opts->comm->size > 1) mo.device_index = ds_comm_local_rank(opts->comm);
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
    e->dm = ds_model_dmem(e->model);
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
    /* a P/D consumer receives its pulled blocks into the RAM tier (docs/pd.md) */
    if ((opts->kv_role & DS_KV_CONSUMER) && !e->opts.kv_offload_ram_bytes)
        e->opts.kv_offload_ram_bytes = (size_t)512 << 20;
    if (opts->enable_prefix_caching && setup_prefix(e, err)) goto fail;
    if (opts->speculative_method != DS_SPEC_NONE && setup_spec(e, err)) goto fail;
    /* only a prefix hit resumes a sequence one token short of its end */
    if (e->num_speculative_tokens && e->prefix)
        ds_sched_set_admit_drafts(e->sched, eng_admit_drafts, e);
    if (eng_pd_setup(e, err) || alloc_step_buffers(e, err)) goto fail;
    *out = e;
    return DS_OK;
fail:
    ds_engine_free(e);
    return DS_ERR;
}

/* The steps in flight and the step buffers (engine_impl.h gives their shapes). */
static int alloc_step_buffers(ds_engine *e, ds_err *err) {
    const ds_engine_opts *opts = &e->opts;
    int S = opts->max_num_seqs, rows = e->num_speculative_tokens + 1;
    /* With pipelined stages P steps are in flight (docs/parallelism.md, "Process model"). */
    e->n_fl = e->dist && e->comm->n_stages > 1 && !opts->pp_lock_step ? e->comm->n_stages : 1;
    e->fl = ds_calloc((size_t)e->n_fl, sizeof *e->fl, err);
    if (!e->fl) return DS_ERR;
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
            e->num_speculative_tokens
                ? ds_dmem_alloc(
                      e->dm, (size_t)S * rows * ds_model_slot_floats(e->model) * sizeof(float) + 1,
                      err)
                : NULL;
        if (!f->items || !f->vt || !f->vlp || !f->va || !f->dr || !f->n_dr ||
            (e->num_speculative_tokens && !f->state_rows))
            return DS_ERR;
    }
    e->preempted = ds_calloc((size_t)S, sizeof *e->preempted, err);
    e->forced_req = ds_calloc((size_t)S, sizeof *e->forced_req, err);
    e->forced_ch = ds_calloc((size_t)S, sizeof *e->forced_ch, err);
    e->batch = ds_calloc((size_t)S, sizeof *e->batch, err);
    /* page-locked when the model is on a GPU: the step downloads its logits here */
    e->logits = ds_dmem_host_alloc(e->dm, (size_t)S * rows * e->V * sizeof(float), err);
    e->argmax = ds_malloc((size_t)S * rows * sizeof(int32_t), err);
    e->draws = ds_calloc((size_t)S * rows, sizeof *e->draws, err);
    e->dstops = ds_malloc((size_t)S * (DS_MAX_STOP + 1) * sizeof(int32_t), err);
    e->n_scratch = DS_MAX(1, DS_MIN(omp_get_max_threads(), 16));
    e->scratch = ds_calloc((size_t)e->n_scratch, sizeof *e->scratch, err);
    if (!e->preempted || !e->forced_req || !e->forced_ch || !e->batch || !e->logits || !e->argmax ||
        !e->draws || !e->dstops || !e->scratch)
        return DS_ERR;
    for (int t = 0; t < e->n_scratch; t++)
        if (!(e->scratch[t] = ds_sample_scratch_new(e->V, err))) return DS_ERR;
    /* one process on a GPU: the host is free while a step runs (a job's ranks keep the masks
     * on the step's path: its sampling rank's forward is a pipeline stage's) */
    const char *beside = getenv("DS_MASKS_BESIDE"); /* 0: before the forward (comparisons) */
    e->mask_async = e->sampler && !e->dist && !(beside && *beside && atoi(beside) <= 0) &&
                    (ds_model_on_device(e->model) || e->opts.test.async_masks);
    return eng_masks_start(e, err);
}

int ds_engine_start(ds_engine *e, ds_err *err) {
    if (pthread_create(&e->thread, NULL, eng_main, e))
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
    while (e->live) eng_abort_request(e, e->live);
    eng_masks_stop(e);
    if (e->sched) ds_sched_free(e->sched);
    eng_pd_free(e);
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
        ds_dmem_free(e->dm, f->state_rows);
    }
    free(e->fl);
    free(e->deferred);
    free(e->taps);
    free(e->preempted);
    free(e->forced_req);
    free(e->forced_ch);
    free(e->batch);
    ds_dmem_host_free(e->dm, e->logits);
    free(e->argmax);
    free(e->draws);
    free(e->dcounts);
    free(e->dstops);
    free(e->dallow);
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
    ds_grammars_free(e->grammars); /* after the requests: no matcher is left */
    pthread_mutex_destroy(&e->gmu);
    pthread_cond_destroy(&e->wake);
    free(e);
}
