/* cmd_bench.c — `deltaserve bench --model DIR`: prompt and decode throughput of the forward pass,
 * each reported against this machine's limits measured in the same run (a read-bandwidth loop and
 * an FMA loop), so every figure says how far it is from the hardware. With -tp / -pp the same
 * steps run on every rank of the job, each step ending as the engine's do: the last stage's
 * greedy tokens broadcast to every rank (the next step's input depends on them). */
#include "cli/args.h"
#include "devtools/bench_limits.h"
#include "base/devmem.h"
#include "cli/commands.h"
#include "cli/ranks.h"
#include "parallel/pipeline.h"
#include "sample/sampler.h"
#include "model/model.h"

#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BENCH_BLOCK = 64 };

enum { MAX_BATCHES = 8 };

typedef struct bench_result {
    double prompt_tps, prompt_gflops;
    double prompt_gemm_tflops, prompt_gemm_ms; /* its cuBLAS weight GEMMs alone (profile on) */
    int n_batches;
    int batch[MAX_BATCHES];
    double decode_tps[MAX_BATCHES], decode_gbs[MAX_BATCHES], decode_gflops[MAX_BATCHES];
    double decode_ms[MAX_BATCHES]; /* per step: the time per output token of each sequence */
    /* --full-logits: sampling a step's rows on the host, ms, on one thread and on sample_threads */
    double sample_ms1[MAX_BATCHES], sample_msn[MAX_BATCHES];
    int sample_threads;
    /* FNV-1a of every greedy token of the decode steps, in order: the same model gives the same
     * tokens alone or split over ranks (the tests compare them); 0 when the steps drew or
     * returned logits */
    uint64_t ids_hash[MAX_BATCHES];
} bench_result;

/* ms to sample B rows of logits [B][V] (temperature 1, top-p 0.95: a typical sampled request)
 * on nt threads, as the engine does a step's rows (a scratch a thread, an RNG a row). */
static double time_sampling(float *logits, int B, int V, int nt, ds_err *err) {
    ds_sample_scratch *sc[16] = {0};
    nt = DS_MAX(1, DS_MIN(nt, 16));
    double ms = -1;
    for (int t = 0; t < nt; t++)
        if (!(sc[t] = ds_sample_scratch_new(V, err))) goto out;
    ds_sample_params p;
    ds_sample_params_default(&p);
    p.top_p = 0.95f;
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = ds_now();
#pragma omp parallel for schedule(dynamic) num_threads(nt)
        for (int b = 0; b < B; b++) {
            ds_rng rng;
            ds_rng_seed(&rng, (uint64_t)b + 1);
            ds_sample_token(logits + (size_t)b * V, V, &p, NULL, 1, NULL, 0, &rng,
                            sc[omp_get_thread_num()], NULL, 0);
        }
        best = DS_MIN(best, ds_now() - t0);
    }
    ms = best * 1e3;
out:
    for (int t = 0; t < nt; t++) ds_sample_scratch_free(sc[t]);
    return ms;
}

/* This rank's part of the job and its stage hand-over buffers; root is the world rank whose
 * greedy tokens every rank receives after a step (the last stage's first TP rank). */
typedef struct bench_job {
    ds_rank r;
    ds_pp_bufs io;
    int root;
    int chunk; /* prompts run in forwards of at most this many tokens (chunked prefill); 0: one */
    int zero_fill; /* decode contexts left as the pool starts them (zeros) instead of prefilled */
} bench_job;

/* One forward step of the whole job over sb[n]; picks[n_picks] (the last stage's greedy tokens,
 * or NULL) then reach every rank, as sampled tokens do in the engine. */
static int job_step(bench_job *j, ds_kv_pool *pool, ds_seq_batch *sb, int n, int32_t *picks,
                    int n_picks, ds_err *err) {
    if (ds_pp_step(j->r.comm, j->r.m, pool, sb, n, &j->io, err)) return DS_ERR;
    if (j->r.comm->size == 1) return DS_OK;
    if (picks) return ds_comm_bcast_from(j->r.comm, j->root, picks, n_picks * sizeof *picks, err);
    return ds_comm_barrier(j->r.comm, err); /* the step ends on every rank together */
}

/* v <- its sum over every rank of the job (each rank broadcasts its own in turn: once, at start).
 */
static int job_sum(ds_comm *c, double *v, ds_err *err) {
    if (c->size == 1) return DS_OK;
    double sum = 0;
    for (int r = 0; r < c->size; r++) {
        double x = r == c->rank ? *v : 0;
        if (ds_comm_bcast_from(c, r, &x, sizeof x, err)) return DS_ERR;
        sum += x;
    }
    *v = sum;
    return DS_OK;
}

/* "12.3%" of lim into buf, or "-" where no fraction is reported (lim 0). */
static const char *pct(char *buf, size_t cap, double v, double lim) {
    if (lim > 0)
        snprintf(buf, cap, "%.1f%%", 100 * v / lim);
    else
        snprintf(buf, cap, "-");
    return buf;
}

/* KDA state slots where the model keeps them: device memory on a GPU (the forward would
 * otherwise stage host slots through the bus every step). */
static float *alloc_slots(ds_model *m, size_t n, ds_err *err) {
    size_t bytes = DS_MAX(n * ds_model_slot_floats(m) * sizeof(float), 1);
    float *p = ds_dmem_alloc(ds_model_dmem(m), bytes, err);
    if (p) ds_dmem_zero(ds_model_dmem(m), p, bytes);
    return p;
}

/* Decode `steps` tokens for each of B sequences (after a short prompt each), one batched
 * forward per step; returns seconds per step (best of the steps after the first). Each step ends
 * with every sequence's greedy token on the host, picked beside the logits as the server does for
 * greedy requests, or (full_logits) with every row of logits on the host, as a request that
 * samples or wants logprobs needs them, or (sampled) with every row's token drawn where the
 * logits are (temperature 1, top-p 0.95), as the server does for a sampled request. */
/* One sequence's T prompt tokens ids[T] through the job from position 0, in forwards of at most
 * j->chunk tokens (all at once when 0), the last chunk's last row of logits into logits[V] (the
 * last stage's; NULL: none) — a request's time to first token under chunked prefill. */
static int run_chunks(bench_job *j, ds_kv_pool *pool, const int32_t *ids, int T, float *slot,
                      const int32_t *table, float *logits, ds_err *err) {
    for (int p0 = 0, n; p0 < T; p0 += n) {
        n = j->chunk > 0 ? DS_MIN(j->chunk, T - p0) : T;
        const int want = p0 + n == T && j->r.last && logits;
        ds_seq_batch sb = {.tokens = ids + p0,
                           .n = n,
                           .pos0 = p0,
                           .slot = slot,
                           .block_table = table,
                           .logits = want ? logits : NULL,
                           .n_logits = want};
        if (job_step(j, pool, &sb, 1, NULL, 0, err)) return DS_ERR;
    }
    return DS_OK;
}

static int run_decode(bench_job *j, int B, int prompt, int steps, int full_logits, int sampled,
                      double *sec_per_step, bench_result *res, int slot, ds_err *err) {
    ds_model *m = j->r.m;
    const int last = j->r.last; /* only the last stage has logits */
    const ds_config *c = ds_model_config(m);
    int ctx = prompt + steps + 1, pages_per = (ctx + BENCH_BLOCK - 1) / BENCH_BLOCK;
    ds_kv_pool pool;
    if (ds_kv_pool_init(&pool, m, B * pages_per, BENCH_BLOCK, err)) return DS_ERR;
    int rc = DS_ERR;
    size_t slot_n = ds_model_slot_floats(m);
    float *slots = alloc_slots(m, (size_t)B, err);                            /* [B][slot] */
    int32_t *table = ds_malloc((size_t)B * pages_per * sizeof(int32_t), err); /* [B][pages] */
    int32_t *ids = ds_malloc((size_t)B * ctx * sizeof(int32_t), err);         /* [B][ctx] */
    ds_seq_batch *sb = ds_calloc((size_t)B, sizeof *sb, err);
    float *logits = ds_dmem_host_alloc(ds_model_dmem(m), (size_t)B * c->vocab_size * sizeof(float),
                                       err);                       /* [B][V] */
    int32_t *picks = ds_calloc((size_t)B, sizeof(int32_t), err);   /* [B] */
    ds_row_draw *draws = ds_calloc((size_t)B, sizeof *draws, err); /* [B] */
    if (!slots || !table || !ids || !sb || !logits || !picks || !draws) goto out;
    for (int i = 0; i < B * pages_per; i++) table[i] = i;
    ds_rng rng;
    ds_rng_seed(&rng, 1);
    for (int i = 0; i < B * ctx; i++) ids[i] = (int32_t)(ds_rng_next(&rng) % 256);
    for (int b = 0; b < B; b++) {
        sb[b] = (ds_seq_batch){.tokens = ids + (size_t)b * ctx,
                               .n = prompt,
                               .slot = slots + (size_t)b * slot_n,
                               .block_table = table + (size_t)b * pages_per};
    }
    /* the context, a few sequences per forward (as the scheduler's token budget would), or each
     * in chunks when it is longer than --prefill-chunk; --decode-fill zeros leaves the rows and
     * states zero: a step reads the same bytes, and a million-token prefill takes minutes */
    for (int b0 = 0, nb; !j->zero_fill && b0 < B; b0 += nb) {
        nb = DS_MAX(1, DS_MIN(B - b0, 8192 / prompt));
        if (j->chunk > 0 && prompt > j->chunk) {
            nb = 1;
            if (run_chunks(j, &pool, sb[b0].tokens, prompt, sb[b0].slot, sb[b0].block_table, NULL,
                           err))
                goto out;
        } else if (job_step(j, &pool, sb + b0, nb, NULL, 0, err))
            goto out;
    }
    ds_model_profile_report(m, NULL, NULL); /* the profile is of the decode steps only */
    double best = 1e30;
    res->ids_hash[slot] = full_logits || sampled ? 0 : 0xcbf29ce484222325ull; /* FNV offset */
    for (int s = 0; s < steps; s++) {
        for (int b = 0; b < B; b++) {
            sb[b].tokens = ids + (size_t)b * ctx + prompt + s;
            sb[b].n = 1;
            sb[b].pos0 = prompt + s;
            sb[b].logits = last && full_logits ? logits + (size_t)b * c->vocab_size : NULL;
            sb[b].argmax = last && !full_logits ? picks + b : NULL;
            sb[b].n_logits = last;
            if (last && sampled) {
                ds_sample_params_default(&draws[b].p);
                draws[b].p.top_p = 0.95f;
                draws[b].u = ds_rng_uniform(&rng);
                sb[b].draws = draws + b;
            }
        }
        double t0 = ds_now();
        if (job_step(j, &pool, sb, B, picks, B, err)) goto out;
        double dt = ds_now() - t0;
        if (s > 0 && dt < best) best = dt;
        for (int b = 0; !full_logits && !sampled && b < B; b++)
            for (int k = 0; k < 4; k++)
                res->ids_hash[slot] =
                    (res->ids_hash[slot] ^ (((uint32_t)picks[b] >> (8 * k)) & 0xff)) *
                    0x100000001b3ull;
    }
    *sec_per_step = best;
    if (full_logits && last) { /* what the host then does with the rows */
        res->sample_ms1[slot] = time_sampling(logits, B, c->vocab_size, 1, err);
        res->sample_msn[slot] = time_sampling(logits, B, c->vocab_size, res->sample_threads, err);
        if (res->sample_ms1[slot] < 0 || res->sample_msn[slot] < 0) goto out;
    }
    rc = DS_OK;
out:
    ds_dmem_free(ds_model_dmem(m), slots);
    free(table);
    free(ids);
    free(sb);
    ds_dmem_host_free(ds_model_dmem(m), logits);
    free(picks);
    free(draws);
    ds_kv_pool_free(&pool);
    return rc;
}

static int run_prompt(bench_job *j, int T, int reps, double *sec, ds_err *err) {
    ds_model *m = j->r.m;
    const ds_config *c = ds_model_config(m);
    int pages = (T + BENCH_BLOCK - 1) / BENCH_BLOCK;
    ds_kv_pool pool;
    if (ds_kv_pool_init(&pool, m, pages, BENCH_BLOCK, err)) return DS_ERR;
    int rc = DS_ERR;
    float *slot = alloc_slots(m, 1, err); /* [slot] */
    int32_t *table = ds_malloc((size_t)pages * sizeof(int32_t), err);
    int32_t *ids = ds_malloc((size_t)T * sizeof(int32_t), err);
    float *logits = ds_malloc((size_t)c->vocab_size * sizeof(float), err);
    if (!slot || !table || !ids || !logits) goto out;
    for (int i = 0; i < pages; i++) table[i] = i;
    ds_rng rng;
    ds_rng_seed(&rng, 2);
    for (int i = 0; i < T; i++) ids[i] = (int32_t)(ds_rng_next(&rng) % 256);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        ds_dmem_zero(ds_model_dmem(m), slot, ds_model_slot_floats(m) * sizeof(float));
        if (j->r.comm->size > 1 && ds_comm_barrier(j->r.comm, err)) goto out; /* start together */
        double t0 = ds_now();
        if (run_chunks(j, &pool, ids, T, slot, table, logits, err)) goto out;
        double dt = ds_now() - t0;
        if (dt < best) best = dt;
        if (r == 0 && reps > 1) ds_model_profile_report(m, NULL, NULL); /* warm reps only */
    }
    *sec = best;
    rc = DS_OK;
out:
    ds_dmem_free(ds_model_dmem(m), slot);
    free(table);
    free(ids);
    free(logits);
    ds_kv_pool_free(&pool);
    return rc;
}

/* "1,8,64" -> batch sizes; 0 and a message on a bad list. */
static int parse_batches(const char *list, int *out, ds_err *err) {
    int n = 0;
    const char *p = list;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 4096 || (*end && *end != ','))
            return ds_errf(err, "--batch-sizes '%s': expected numbers 1..4096 separated by commas",
                           list),
                   0;
        if (n == MAX_BATCHES)
            return ds_errf(err, "--batch-sizes '%s': at most %d sizes", list, MAX_BATCHES), 0;
        out[n++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (!n) ds_errf(err, "--batch-sizes is empty");
    return n;
}

/* bench's flags. */
typedef struct bench_flags {
    const char *model_dir, *json_path, *device, *load_format, *batch_list, *partition;
    const char *quant, *quant_exclude, *kv_dtype, *fill;
    int prompt_tokens, steps, reps, batch_invariant, decode_ctx;
    int enforce_eager, full_logits, sampled, tp, pp, chunk;
} bench_flags;

/* What one run measured besides the results: the machine's limits and a token's costs, summed
 * over the ranks. */
typedef struct bench_costs {
    double t_load;   /* seconds to load the model */
    double bw, peak; /* bytes/s (GB/s) and GFLOP/s of this machine (reporting rank) */
    double flops_prompt, flops_decode;
    double weight_bytes, state_bytes; /* a batch-1 decode step's reads */
    int threads, gpu, report, alone;  /* report: this rank prints; alone: a job of one */
} bench_costs;

static const char *const FORMATS[] = {"safetensors", "random", NULL};
static const char *const FILLS[] = {"prefill", "zeros", NULL};

enum { BENCH_FLAGS = 21 }; /* entries bench_table writes */

static int bench_table(bench_flags *f, ds_arg *out) {
    ds_arg table[BENCH_FLAGS] = {
        {"model", "m", DS_ARG_STRING, &f->model_dir, "DIR", "checkpoint folder", .required = 1},
        DS_OPT("prompt-tokens", NULL, DS_ARG_INT, &f->prompt_tokens, "N", "prompt length measured"),
        DS_OPT("decode-steps", NULL, DS_ARG_INT, &f->steps, "N", "decode steps per batch size"),
        DS_OPT("decode-context", NULL, DS_ARG_INT, &f->decode_ctx, "N",
               "prompt tokens each sequence holds before the decode steps"),
        {"decode-fill", NULL, DS_ARG_STRING, &f->fill, "F",
         "how the decode context is made: prefill (its tokens run through the model) or zeros "
         "(rows and states left zero, no forward: the steps read the same bytes; for contexts "
         "whose prefill would take minutes)",
         .choices = FILLS},
        DS_OPT("batch-sizes", NULL, DS_ARG_STRING, &f->batch_list, "B,B,..",
               "decode batch sizes measured"),
        DS_OPT("reps", NULL, DS_ARG_INT, &f->reps, "N", "prompt repetitions (best is kept)"),
        DS_OPT("prefill-chunk", NULL, DS_ARG_INT, &f->chunk, "N",
               "run prompts and contexts in forwards of at most N tokens (chunked prefill, as "
               "long contexts need; default 0: the whole prompt in one)"),
        {"device", NULL, DS_ARG_STRING, &f->device, "D", "cpu, cuda or auto",
         .choices = ds_device_names},
        DS_OPT("batch-invariant", NULL, DS_ARG_BOOL, &f->batch_invariant, NULL,
               "CUDA: weight-streaming matmuls for every batch size (see serve --help)"),
        DS_OPT("enforce-eager", NULL, DS_ARG_BOOL, &f->enforce_eager, NULL,
               "CUDA: no CUDA graphs (decode steps are replayed from graphs by default)"),
        DS_OPT("full-logits", NULL, DS_ARG_BOOL, &f->full_logits, NULL,
               "decode steps return every row's logits to the host (as sampled requests need) "
               "instead of its greedy token"),
        DS_OPT("sampled", NULL, DS_ARG_BOOL, &f->sampled, NULL,
               "decode steps draw every row's token where the logits are (temperature 1, top-p "
               "0.95), as for a sampled request"),
        {"load-format", NULL, DS_ARG_STRING, &f->load_format, "F",
         "safetensors, or random: weights drawn for config.json's shape (no files read; made in "
         "GPU memory on cuda)",
         .choices = FORMATS},
        {"quantization", "q", DS_ARG_STRING, &f->quant, "Q",
         "weights: none or ptpc_fp8 (see serve --help)", .choices = ds_quant_names},
        DS_OPT("quantization-exclude", NULL, DS_ARG_STRING, &f->quant_exclude, "A,B,..",
               "ptpc_fp8: name fragments kept unquantized (see serve --help)"),
        {"kv-cache-dtype", NULL, DS_ARG_STRING, &f->kv_dtype, "T",
         "MLA latent cache: auto (f32 rows), fp8 or bf16 (see serve --help)",
         .choices = ds_kv_dtype_names},
        DS_OPT("tensor-parallel-size", "tp", DS_ARG_INT, &f->tp, "T", "tensor-parallel ranks"),
        DS_OPT("pipeline-parallel-size", "pp", DS_ARG_INT, &f->pp, "P", "pipeline stages"),
        DS_OPT("pp-layer-partition", NULL, DS_ARG_STRING, &f->partition, "2,3,3,2",
               "layers per stage (default: even, remainder to the middle stages)"),
        DS_OPT("json", NULL, DS_ARG_STRING, &f->json_path, "FILE",
               "also write the results as JSON"),
    };
    memcpy(out, table, sizeof table);
    return BENCH_FLAGS;
}

/* The machine's limits, measured by the reporting rank while the others wait (ranks may share a
 * GPU), and what a token costs the whole job: FLOPs and a batch-1 step's reads (the weights,
 * then the sequence's state and the f32 vectors, at the shortest context a timed step has:
 * decode_ctx + 1 rows, the fewest bytes), summed over the ranks. */
static int bench_measure_costs(bench_job *job, const bench_flags *f, bench_costs *c, ds_err *err) {
    ds_model *m = job->r.m;
    ds_comm *comm = job->r.comm;
    c->report = comm->rank == job->root;
    c->alone = comm->size == 1;
    c->gpu = ds_model_on_device(m);
    c->threads = omp_get_max_threads();
    if (c->report && c->gpu) {
        double tf;
        if (ds_model_device_limits(m, &c->bw, &tf, err)) return DS_ERR;
        c->peak = tf * 1e3; /* GFLOP/s */
    } else if (c->report) {
        c->bw = ds_bench_read_bandwidth((size_t)1 << 30, c->threads);
        c->peak = ds_bench_fma_peak(c->threads);
    }
    if (!c->alone && ds_comm_barrier(comm, err)) return DS_ERR;
    c->flops_prompt = ds_model_token_flops(m, 0);
    c->flops_decode = ds_model_token_flops(m, 1);
    c->weight_bytes = ds_model_decode_bytes(m);
    c->state_bytes = ds_model_decode_state_bytes(m, f->decode_ctx + 1);
    if (job_sum(comm, &c->flops_prompt, err) || job_sum(comm, &c->flops_decode, err) ||
        job_sum(comm, &c->weight_bytes, err) || job_sum(comm, &c->state_bytes, err))
        return DS_ERR;
    return DS_OK;
}

/* The prompt case, then a decode case per batch size, into r. */
static int bench_cases(bench_job *job, const bench_flags *f, const bench_costs *c, bench_result *r,
                       ds_err *err) {
    ds_model *m = job->r.m;
    const double step_bytes = c->weight_bytes + c->state_bytes;
    double sec;
    if (run_prompt(job, f->prompt_tokens, f->reps, &sec, err)) return DS_ERR;
    char title[48];
    snprintf(title, sizeof title, "prompt %d", f->prompt_tokens);
    r->prompt_gemm_tflops = ds_model_profile_gemm_tflops(m, &r->prompt_gemm_ms);
    if (c->report) ds_model_profile_report(m, stderr, title);
    r->prompt_tps = f->prompt_tokens / sec;
    r->prompt_gflops = c->flops_prompt * f->prompt_tokens / sec / 1e9;
    for (int i = 0; i < r->n_batches; i++) {
        int B = r->batch[i];
        if (run_decode(job, B, f->decode_ctx, f->steps, f->full_logits, f->sampled, &sec, r, i,
                       err))
            return DS_ERR;
        snprintf(title, sizeof title, "decode batch %d", B);
        if (c->report) ds_model_profile_report(m, stderr, title);
        r->decode_ms[i] = sec * 1e3;
        r->decode_tps[i] = B / sec;
        /* batch 1 reads every active weight once per token; larger batches share the reads, so
         * only batch 1 is reported as bandwidth */
        r->decode_gbs[i] = B == 1 ? step_bytes / sec / 1e9 : 0;
        r->decode_gflops[i] = c->flops_decode * B / sec / 1e9;
    }
    return DS_OK;
}

/* The report's head: the job, the model, the limits and a token's bytes. */
static void bench_print_head(const bench_flags *f, const bench_costs *c, const ds_model *m,
                             const ds_comm *comm, int random) {
    if (!c->alone) /* the limits are one device's: fractions of them only for one process */
        printf("ranks: %d (tp %d x pp %d), this rank: %s; GB/s and GFLOP/s summed over the ranks, "
               "no fractions of one device's limits\n",
               comm->size, f->tp, f->pp, comm->who);
    printf("deltaserve bench  model=%s%s  device=%s  weights=%.2f GB (loaded in %.1f s)  "
           "quantization=%s  kv-cache-dtype=%s\n",
           f->model_dir, random ? " (random weights)" : "", ds_model_device_name(m),
           ds_model_weight_bytes(m) / 1e9, c->t_load, f->quant, f->kv_dtype);
    if (c->gpu)
        printf("limits: device copy %.0f GB/s, cuBLAS BF16 GEMM %.0f TFLOP/s; %s%s%s\n", c->bw,
               c->peak / 1e3, f->enforce_eager ? "eager" : "CUDA graphs",
               f->batch_invariant ? ", batch-invariant matmuls" : "",
               f->full_logits ? ", decode returns full logits"
               : f->sampled   ? ", decode draws tokens (T 1, top-p 0.95)"
                              : ", decode returns greedy tokens");
    else
        printf("limits: read bandwidth %.2f GB/s, FMA peak %.1f GFLOP/s (%d threads)\n", c->bw,
               c->peak, c->threads);
    printf("decode bytes per token at batch 1: %.3f GB (weights %.3f GB; state and vectors %.1f MB "
           "at context %d)\n",
           (c->weight_bytes + c->state_bytes) / 1e9, c->weight_bytes / 1e9, c->state_bytes / 1e6,
           f->decode_ctx + 1);
}

/* The table of cases, then the GEMM profile and host sampling lines when measured. */
static void bench_print_cases(const bench_flags *f, const bench_costs *c, const ds_model *m,
                              const bench_result *r) {
    printf("%-18s %12s %10s %12s %10s %12s %10s\n", "case", "tokens/s", "ms/step", "GB/s",
           c->gpu ? "of copy" : "of read", "GFLOP/s", c->gpu ? "of GEMM" : "of peak");
    char name[48], gbs[24], fb[16], fp[16];
    const double bw_lim = c->alone ? c->bw : 0, peak_lim = c->alone ? c->peak : 0;
    snprintf(name, sizeof name, "prompt %d", f->prompt_tokens);
    printf("%-18s %12.1f %10.2f %12s %10s %12.1f %10s\n", name, r->prompt_tps,
           1e3 * f->prompt_tokens / r->prompt_tps, "-", "-", r->prompt_gflops,
           pct(fp, sizeof fp, r->prompt_gflops, peak_lim));
    for (int i = 0; i < r->n_batches; i++) {
        snprintf(name, sizeof name, "decode batch %d", r->batch[i]);
        snprintf(gbs, sizeof gbs, r->decode_gbs[i] > 0 ? "%.2f" : "-", r->decode_gbs[i]);
        printf("%-18s %12.1f %10.3f %12s %10s %12.1f %10s\n", name, r->decode_tps[i],
               r->decode_ms[i], gbs,
               r->decode_gbs[i] > 0 ? pct(fb, sizeof fb, r->decode_gbs[i], bw_lim) : "-",
               r->decode_gflops[i], pct(fp, sizeof fp, r->decode_gflops[i], peak_lim));
    }
    if (r->prompt_gemm_tflops > 0)
        printf("prompt %d's cuBLAS weight GEMMs alone (profile): %.2f ms a prompt, %.1f TFLOP/s "
               "(%s of GEMM)\n",
               f->prompt_tokens, r->prompt_gemm_ms, r->prompt_gemm_tflops,
               pct(fp, sizeof fp, r->prompt_gemm_tflops * 1e3, peak_lim));
    for (int i = 0; f->full_logits && i < r->n_batches; i++)
        printf("host sampling batch %d (T 1, top-p 0.95, V %d): %.3f ms on 1 thread, %.3f ms on "
               "%d\n",
               r->batch[i], ds_model_config(m)->vocab_size, r->sample_ms1[i], r->sample_msn[i],
               r->sample_threads);
}

/* --json FILE: the results as one JSON object. */
static int bench_write_json(const bench_flags *f, const bench_costs *c, const ds_model *m,
                            int random, const bench_result *r, ds_err *err) {
    FILE *o = fopen(f->json_path, "w");
    if (!o) return ds_errf(err, "%s: cannot write", f->json_path);
    const double peak = c->peak, bw = c->bw;
    fprintf(o,
            "{\"model\": \"%s\", \"device\": \"%s\", \"quantization\": \"%s\", "
            "\"kv_cache_dtype\": \"%s\", \"random_weights\": %d, \"threads\": %d, "
            "\"cuda_graphs\": %d, \"batch_invariant\": %d, \"tp\": %d, \"pp\": %d, "
            "\"bw_gbs\": %.3f, \"peak_gflops\": %.3f, \"prompt_tokens\": %d, "
            "\"prompt_tps\": %.3f, \"prompt_gflops\": %.3f, \"prompt_frac_peak\": %.4f, "
            "\"prompt_gemm_tflops\": %.3f, \"prompt_gemm_frac_peak\": %.4f, "
            "\"decode_context\": %d, \"decode_fill\": \"%s\", \"decode_steps\": %d, "
            "\"prefill_chunk\": %d, \"decode\": [",
            f->model_dir, ds_model_device_name(m), f->quant, f->kv_dtype, random, c->threads,
            c->gpu && !f->enforce_eager, f->batch_invariant, f->tp, f->pp, bw, peak,
            f->prompt_tokens, r->prompt_tps, r->prompt_gflops,
            c->alone ? r->prompt_gflops / peak : 0, r->prompt_gemm_tflops,
            c->alone && peak > 0 ? r->prompt_gemm_tflops * 1e3 / peak : 0, f->decode_ctx, f->fill,
            f->steps, f->chunk);
    for (int i = 0; i < r->n_batches; i++)
        fprintf(o,
                "%s{\"batch\": %d, \"tps\": %.3f, \"ms_per_step\": %.4f, \"gbs\": %.3f, "
                "\"frac_bw\": %.4f, \"gflops\": %.3f, \"ids_hash\": \"%016llx\"}",
                i ? ", " : "", r->batch[i], r->decode_tps[i], r->decode_ms[i], r->decode_gbs[i],
                c->alone ? r->decode_gbs[i] / bw : 0, r->decode_gflops[i],
                (unsigned long long)r->ids_hash[i]);
    fprintf(o, "]}\n");
    fclose(o);
    return DS_OK;
}

/* Checks the numeric flags (errors name the flag) and reads the batch sizes into r. */
static int bench_check(const bench_flags *f, bench_result *r, ds_err *err) {
    const struct {
        const char *flag;
        int value, min;
    } ints[] = {{"--prompt-tokens", f->prompt_tokens, 1},
                {"--decode-steps", f->steps, 2},
                {"--reps", f->reps, 1},
                {"--decode-context", f->decode_ctx, 1},
                {"--prefill-chunk", f->chunk, 0}};
    for (size_t i = 0; i < DS_ARRAY_LEN(ints); i++)
        if (ints[i].value < ints[i].min)
            return ds_errf(err, "%s: expected at least %d, got %d", ints[i].flag, ints[i].min,
                           ints[i].value);
    return (r->n_batches = parse_batches(f->batch_list, r->batch, err)) ? DS_OK : DS_ERR;
}

int ds_cmd_bench(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "serve")) return ds_cmd_bench_serve(argc - 1, argv + 1);
    ds_model_opts mo;
    ds_model_opts_default(&mo); /* the device defaults (DS_DEVICE, DS_BATCH_INVARIANT) */
    bench_flags f = {.device = ds_device_names[mo.device < 0 ? DS_DEVICE_CPU : mo.device],
                     .load_format = "safetensors",
                     .quant = "none",
                     .kv_dtype = "auto",
                     .fill = "prefill",
                     .batch_list = "1,16",
                     .partition = "",
                     .prompt_tokens = 512,
                     .steps = 8,
                     .reps = 2,
                     .batch_invariant = mo.batch_invariant,
                     .decode_ctx = 32,
                     .enforce_eager = mo.enforce_eager,
                     .tp = 1,
                     .pp = 1};
    ds_arg opts[BENCH_FLAGS];
    ds_args a = {
        "deltaserve bench",
        "Prompt tokens/s at --prompt-tokens and decode tokens/s at each --batch-sizes,\n"
        "with achieved GB/s and GFLOP/s as fractions of this machine's limits measured in\n"
        "the same run: on the CPU a read-bandwidth loop and an FMA loop, on a GPU the\n"
        "device copy rate and cuBLAS's BF16 GEMM rate.\n"
        "On a GPU, DS_CUDA_PROFILE=1 also prints each op's device time per step of every case\n"
        "(with --enforce-eager: a graph replay has no per-op times).\n"
        "With -tp / -pp it runs on T x P ranks under MPI (re-launching itself through mpirun\n"
        "unless started by it; rank r of a host uses GPU r mod count); the last stage's first\n"
        "rank reports, bytes and FLOPs summed over the ranks.\n"
        "`deltaserve bench serve --help`: the load generator for a running server.",
        opts, bench_table(&f, opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    ds_err err = {{0}};
    bench_result r = {0};
    if (bench_check(&f, &r, &err)) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 2;
    }
    int counts[DS_MAX_LAYERS];
    if ((rc = ds_rank_prepare("bench", f.model_dir, f.tp, f.pp, f.partition, counts, argc, argv)) >=
        0)
        return rc;
    mo.device = ds_device_from_name(f.device);
    mo.batch_invariant = f.batch_invariant;
    mo.enforce_eager = f.enforce_eager;
    mo.load_random = !strcmp(f.load_format, "random");
    mo.quantization = ds_quant_from_name(f.quant);
    mo.quantization_exclude = f.quant_exclude;
    mo.kv_dtype = ds_kv_dtype_from_name(f.kv_dtype);
    bench_job job;
    memset(&job, 0, sizeof job);
    bench_costs c = {0};
    c.t_load = ds_now();
    if (ds_rank_open(f.model_dir, f.tp, f.pp, counts, &mo, &job.r, &err)) goto fail;
    c.t_load = ds_now() - c.t_load;
    job.root = (f.pp - 1) * f.tp;
    job.chunk = f.chunk;
    job.zero_fill = !strcmp(f.fill, "zeros");
    if (bench_measure_costs(&job, &f, &c, &err)) goto fail;
    r.sample_threads = DS_MIN(c.threads, 16); /* the engine's sampling threads */
    if (bench_cases(&job, &f, &c, &r, &err)) goto fail;
    if (c.report) {
        bench_print_head(&f, &c, job.r.m, job.r.comm, mo.load_random);
        bench_print_cases(&f, &c, job.r.m, &r);
        if (f.json_path && bench_write_json(&f, &c, job.r.m, mo.load_random, &r, &err)) goto fail;
    }
    ds_pp_bufs_free(&job.io);
    ds_model_free(job.r.m);
    return ds_comm_finish(job.r.comm, 0);
fail:
    if (job.r.comm && job.r.comm->size > 1 &&
        strncmp(err.msg, job.r.comm->who, strlen(job.r.comm->who)))
        fprintf(stderr, "bench: %s: %s\n", job.r.comm->who, err.msg);
    else
        fprintf(stderr, "bench: %s\n", err.msg);
    ds_pp_bufs_free(&job.io);
    ds_model_free(job.r.m);
    return job.r.comm ? ds_comm_finish(job.r.comm, 1) : 1;
}
