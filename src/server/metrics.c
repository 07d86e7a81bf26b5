/* metrics.c — fixed-bucket histograms and the Prometheus text format.
 *
 * Buckets are stored per bucket (not cumulative) so an observation touches one counter; the
 * renderer accumulates them into Prometheus's cumulative `le` form. Bucket bounds reach down to a
 * millisecond because a small model on a CPU answers that fast, and up to hours for long jobs. */
#include "server/metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BUCKETS 32

typedef struct hist_def {
    const char *name; /* without the prefix */
    const char *help;
    const double *bounds; /* [n_bounds] ascending upper bounds; +Inf is implied */
    int n_bounds;
} hist_def;

static const double TTFT_BOUNDS[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                     0.25,  0.5,   0.75, 1.0,  2.5,  5.0,  7.5,  10.0,
                                     20.0,  40.0,  80.0, 160., 640., 2560.};
static const double ITL_BOUNDS[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1,
                                    0.15,  0.2,    0.3,   0.4,  0.5,   0.75, 1.0,   2.5,
                                    5.0,   7.5,    10.0,  20.0, 40.0,  80.0};
static const double E2E_BOUNDS[] = {0.01, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,  1.5,
                                    2.0,  2.5,  5.0,  10.0, 15.0, 20.0, 30.0, 40.0,
                                    50.0, 60.0, 120., 240., 480., 960., 1920, 7680.0};

static const hist_def HISTS[DS_HIST_COUNT] = {
    {"time_to_first_token_seconds", "Time from request arrival to its first generated token.",
     TTFT_BOUNDS, (int)DS_ARRAY_LEN(TTFT_BOUNDS)},
    {"inter_token_latency_seconds", "Time between consecutive tokens of a choice.", ITL_BOUNDS,
     (int)DS_ARRAY_LEN(ITL_BOUNDS)},
    {"e2e_request_latency_seconds", "Time from request arrival to its last event.", E2E_BOUNDS,
     (int)DS_ARRAY_LEN(E2E_BOUNDS)},
};

typedef struct hist {
    uint64_t counts[MAX_BUCKETS + 1]; /* [n_bounds + 1]: counts[i] for bounds[i-1] < x <= bounds[i],
                                         the last one for x > every bound */
    double sum;
    uint64_t count;
} hist;

struct ds_metrics {
    pthread_mutex_t mu;
    hist h[DS_HIST_COUNT];
};

ds_metrics *ds_metrics_new(ds_err *err) {
    ds_metrics *m = ds_calloc(1, sizeof *m, err);
    if (!m) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    return m;
}

void ds_metrics_free(ds_metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void ds_metrics_observe(ds_metrics *m, ds_hist_id id, double seconds) {
    const hist_def *d = &HISTS[id];
    int b = 0;
    while (b < d->n_bounds && seconds > d->bounds[b]) b++;
    pthread_mutex_lock(&m->mu);
    m->h[id].counts[b]++;
    m->h[id].sum += seconds;
    m->h[id].count++;
    pthread_mutex_unlock(&m->mu);
}

/* A growing text buffer; a failed allocation sticks (oom) and the render returns NULL. */
typedef struct textbuf {
    char *s;
    size_t len, cap;
    int oom;
    const char *pfx; /* the metric names' prefix: "vllm:" or "deltaserve:" */
} textbuf;

__attribute__((format(printf, 2, 3))) static void tb_printf(textbuf *t, const char *fmt, ...) {
    if (t->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(t->s + t->len, t->cap - t->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            t->oom = 1;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = DS_MAX(2 * t->cap, t->len + (size_t)n + 1);
        char *s = realloc(t->s, cap);
        if (!s) {
            t->oom = 1;
            return;
        }
        t->s = s, t->cap = cap;
    }
}

static void metric_head(textbuf *t, const char *name, const char *type, const char *help) {
    tb_printf(t, "# HELP %s%s %s\n# TYPE %s%s %s\n", t->pfx, name, help, t->pfx, name, type);
}

static void gauge(textbuf *t, const char *name, const char *help, const char *labels, double v) {
    metric_head(t, name, "gauge", help);
    tb_printf(t, "%s%s{%s} %.17g\n", t->pfx, name, labels, v);
}

static void counter(textbuf *t, const char *name, const char *help, const char *labels, double v) {
    metric_head(t, name, "counter", help);
    tb_printf(t, "%s%s{%s} %.17g\n", t->pfx, name, labels, v);
}

/* The labels every sample carries: model_name="NAME", the value escaped as the exposition format
 * wants (backslash, quote and newline). labels[cap]. */
static void format_labels(char *labels, size_t cap, const char *model_name) {
    snprintf(labels, cap, "model_name=\"");
    size_t k = strlen(labels);
    for (const char *p = model_name; *p && k < cap - 4; p++) {
        if (*p == '\\' || *p == '"') labels[k++] = '\\';
        if (*p == '\n') {
            labels[k++] = '\\';
            labels[k++] = 'n';
        } else {
            labels[k++] = *p;
        }
    }
    labels[k++] = '"';
    labels[k] = 0;
}

/* The engine's load and totals: running / waiting requests, pool use, tokens, steps. */
static void render_engine(textbuf *t, const ds_engine_stats *st, const char *labels) {
    gauge(t, "num_requests_running", "Requests in the running batch.", labels, st->running);
    gauge(t, "num_requests_waiting", "Requests waiting to be scheduled.", labels, st->waiting);
    gauge(t, "kv_cache_usage_perc", "Fraction of MLA latent pages in use (1 = full).", labels,
          st->pages_total ? (double)st->pages_used / st->pages_total : 0.0);
    gauge(t, "state_slot_usage_perc", "Fraction of KDA state slots in use (1 = full).", labels,
          st->slots_total ? (double)st->slots_used / st->slots_total : 0.0);
    counter(t, "prompt_tokens_total", "Prompt tokens processed.", labels,
            (double)st->prompt_tokens_total);
    counter(t, "generation_tokens_total", "Tokens generated.", labels,
            (double)st->generation_tokens_total);
    counter(t, "num_preemptions_total", "Sequences preempted (to be recomputed).", labels,
            (double)st->preemptions_total);
    counter(t, "engine_steps_total", "Engine steps run.", labels, (double)st->steps_total);
    counter(t, "engine_stalls_total",
            "Times nothing could be scheduled for 10 s while requests waited (a fault: the "
            "server's log says what was held).",
            labels, (double)st->stalls_total);
    gauge(t, "kv_transfer_held", "P/D producer: transfers held for a consumer to pull.", labels,
          st->kv_held);
    counter(t, "engine_step_seconds_total", "Seconds spent in forward passes and sampling.", labels,
            st->step_seconds_total);
    counter(t, "kv_transfer_export_seconds_total",
            "P/D producer: seconds spent gathering transfers' blocks from the pools (device to "
            "host on a GPU) and checksumming them; export_bytes_total / this is its rate.",
            labels, st->kv_export_seconds);
    counter(t, "kv_transfer_pull_seconds_total",
            "P/D consumer: seconds the installed transfers took on the wire (their pulls alone; "
            "pull_bytes_total / this is the transfer rate).",
            labels, st->kv_pull_seconds);
}

/* P/D consumer: its failed pulls, one series a reason (DS_KV_FAIL_*). */
static void render_pull_failures(textbuf *t, const ds_engine_stats *st, const char *labels) {
    metric_head(t, "kv_transfer_pull_failure_reasons_total", "counter",
                "P/D consumer: failed pulls by reason (unavailable: the producer, the transfer or "
                "the connection; damaged: a part failed its checks; mismatch: another model, "
                "layout or prompt; local: this server).");
    static const char *const why[4] = DS_KV_FAIL_NAMES;
    _Static_assert(DS_ARRAY_LEN(why) == DS_ARRAY_LEN(st->kv_pull_fail_by), "a name a reason");
    for (size_t i = 0; i < DS_ARRAY_LEN(why); i++)
        tb_printf(t, "%skv_transfer_pull_failure_reasons_total{%s,reason=\"%s\"} %llu\n", t->pfx,
                  labels, why[i], (unsigned long long)st->kv_pull_fail_by[i]);
}

/* The counters of the prefix cache, the offload tiers and speculative decoding (uint64_t fields
 * of ds_engine_stats, by offset), the accepted drafts by position, the draft digest, and the
 * finished requests by reason. */
static void render_counters(textbuf *t, const ds_engine_stats *st, const char *labels) {
    /* prefix caching and offload: what the cache kept and why */
    static const struct {
        const char *name, *help;
        size_t off;
    } CACHE[] = {
        {"prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
         offsetof(ds_engine_stats, prefix_query_tokens)},
        {"prefix_cache_hits_total", "Prompt tokens resumed from the prefix cache.",
         offsetof(ds_engine_stats, prefix_hit_tokens)},
        {"state_checkpoints_kept_total", "KDA checkpoint rungs filed.",
         offsetof(ds_engine_stats, ckpt_kept)},
        {"state_checkpoints_dropped_total", "KDA checkpoint rungs not filed (no budget).",
         offsetof(ds_engine_stats, ckpt_dropped)},
        {"state_checkpoints_evicted_total", "KDA checkpoints evicted (least recently used).",
         offsetof(ds_engine_stats, ckpt_evicted)},
        {"prefix_cache_forks_total", "Sequences resumed by forking a checkpoint.",
         offsetof(ds_engine_stats, forks)},
        {"prefix_cache_checkpoint_holds_total",
         "Steps that started on a checkpoint rung before that checkpoint was filed (a design "
         "that files asynchronously must hold them; deltaserve files in each step's completion, "
         "before the sequence's next step, so this stays 0 — also under pipeline parallelism).",
         offsetof(ds_engine_stats, ckpt_holds)},
        {"prefix_cache_pages_evicted_total", "Cached MLA pages evicted.",
         offsetof(ds_engine_stats, prefix_pages_evicted)},
        {"kv_offload_stores_total", "Pages and checkpoints written to the offload tiers.",
         offsetof(ds_engine_stats, offload_stores)},
        {"kv_offload_loads_ram_total", "Loads served by the RAM tier.",
         offsetof(ds_engine_stats, offload_loads_ram)},
        {"kv_offload_loads_disk_total", "Loads served by the disk tier.",
         offsetof(ds_engine_stats, offload_loads_disk)},
        {"kv_offload_loads_remote_total", "Loads served by the remote (Redis) tier.",
         offsetof(ds_engine_stats, offload_loads_remote)},
        {"kv_offload_misses_total", "Offload lookups that found nothing.",
         offsetof(ds_engine_stats, offload_misses)},
        {"kv_offload_bad_entries_total", "Offload entries rejected by their checksum.",
         offsetof(ds_engine_stats, offload_bad)},
        {"kv_offload_remote_errors_total", "Errors talking to the remote tier.",
         offsetof(ds_engine_stats, offload_remote_errors)},
        {"kv_transfer_exports_total",
         "P/D producer: prefilled prompts whose blocks were held for a consumer (docs/pd.md).",
         offsetof(ds_engine_stats, kv_exports)},
        {"kv_transfer_export_blocks_total", "P/D producer: blocks (pages, checkpoints) held.",
         offsetof(ds_engine_stats, kv_export_blocks)},
        {"kv_transfer_export_bytes_total",
         "P/D producer: bytes of the transfers held (this rank's part of each).",
         offsetof(ds_engine_stats, kv_export_bytes)},
        {"kv_transfer_expired_total", "P/D producer: transfers freed unpulled after the timeout.",
         offsetof(ds_engine_stats, kv_expired)},
        {"kv_transfer_served_total", "P/D producer: transfers sent whole to a consumer.",
         offsetof(ds_engine_stats, kv_served)},
        {"kv_transfer_send_errors_total",
         "P/D producer: pulls that broke off (consumer gone or stalled); the transfer was freed.",
         offsetof(ds_engine_stats, kv_send_errors)},
        {"kv_transfer_pulls_total", "P/D consumer: transfers pulled, verified and installed.",
         offsetof(ds_engine_stats, kv_pulls)},
        {"kv_transfer_pull_failures_total",
         "P/D consumer: transfers missing, late, truncated or mismatched; the prompt was "
         "recomputed instead.",
         offsetof(ds_engine_stats, kv_pull_failures)},
        {"kv_transfer_pull_blocks_total", "P/D consumer: blocks installed from transfers.",
         offsetof(ds_engine_stats, kv_pull_blocks)},
        {"kv_transfer_pull_bytes_total",
         "P/D consumer: bytes of the transfers installed (its head's parts: every rank of a job "
         "pulls the parts it needs itself).",
         offsetof(ds_engine_stats, kv_pull_bytes)},
        {"kv_transfer_releases_total",
         "P/D consumer: parts of transfers it refused early, or that no rank of its job "
         "needed, that it asked the producer's ranks to free (instead of holding them until "
         "their timeout), and they did.",
         offsetof(ds_engine_stats, kv_released)},
        {"kv_transfer_connections_total",
         "P/D consumer: connections opened to producers (each is kept for the same producer's "
         "next pulls).",
         offsetof(ds_engine_stats, kv_connects)},
        {"kv_transfer_connection_reuses_total",
         "P/D consumer: pulls and releases sent over a connection kept from an earlier one.",
         offsetof(ds_engine_stats, kv_conn_reuses)},
        {"spec_decode_num_verifies_total", "Speculative verify steps (one forward each).",
         offsetof(ds_engine_stats, spec_verifies)},
        {"spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified.",
         offsetof(ds_engine_stats, spec_draft_tokens)},
        {"spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
         offsetof(ds_engine_stats, spec_accepted_tokens)},
        {"spec_decode_num_emitted_tokens_total",
         "Tokens emitted by verify steps (accepted drafts plus one); divided by verifies it is "
         "the tokens per forward.",
         offsetof(ds_engine_stats, spec_emitted_tokens)},
        {"spec_decode_num_fork_verifies_total",
         "Verify steps that were a sequence's first step after a prefix-cache hit (resumed one "
         "token short of its end, drafts riding on that token).",
         offsetof(ds_engine_stats, spec_fork_verifies)},
    };
    for (size_t i = 0; i < DS_ARRAY_LEN(CACHE); i++)
        counter(t, CACHE[i].name, CACHE[i].help, labels,
                (double)*(const uint64_t *)((const char *)st + CACHE[i].off));

    render_pull_failures(t, st, labels);

    metric_head(t, "spec_decode_num_accepted_tokens_per_pos", "counter",
                "Draft tokens accepted, by position in the draft block.");
    for (int i = 0; i < DS_MAX_SPEC; i++)
        tb_printf(t, "%sspec_decode_num_accepted_tokens_per_pos{%s,position=\"%d\"} %llu\n", t->pfx,
                  labels, i, (unsigned long long)st->spec_accepted_at[i]);

    gauge(t, "spec_decode_draft_digest",
          "Checksum of every draft token proposed so far, in order (equal in two runs that drafted "
          "the same tokens).",
          labels, (double)st->spec_draft_digest);

    metric_head(t, "request_success_total", "counter", "Finished requests by finish reason.");
    for (ds_finish f = DS_FINISH_STOP; f <= DS_FINISH_ERROR; f++)
        tb_printf(t, "%srequest_success_total{%s,finished_reason=\"%s\"} %llu\n", t->pfx, labels,
                  ds_finish_name(f), (unsigned long long)st->finished[f]);
}

/* One histogram h, cumulative as Prometheus wants, under the name `name`. */
static void render_hist(textbuf *t, const char *name, const hist_def *d, const hist *h,
                        const char *labels) {
    metric_head(t, name, "histogram", d->help);
    uint64_t cum = 0;
    for (int b = 0; b < d->n_bounds; b++) {
        cum += h->counts[b];
        tb_printf(t, "%s%s_bucket{%s,le=\"%g\"} %llu\n", t->pfx, name, labels, d->bounds[b],
                  (unsigned long long)cum);
    }
    tb_printf(t, "%s%s_bucket{%s,le=\"+Inf\"} %llu\n", t->pfx, name, labels,
              (unsigned long long)h->count);
    tb_printf(t, "%s%s_sum{%s} %.17g\n", t->pfx, name, labels, h->sum);
    tb_printf(t, "%s%s_count{%s} %llu\n", t->pfx, name, labels, (unsigned long long)h->count);
}

/* Constrained decoding's grammar cache (text/grammar.h): compiles, hits, refusals, and how long
 * llguidance took to compile. */
static void render_grammar(textbuf *t, const ds_engine_stats *st, const char *labels) {
    const ds_grammar_stats *g = &st->grammar;
    counter(t, "grammar_compiles_total",
            "Grammars (JSON schemas, enforced tool calls) compiled by llguidance: cache misses.",
            labels, (double)g->compiles);
    counter(t, "grammar_compile_failures_total",
            "Grammars llguidance refused to compile (the request got a 400 naming the reason).",
            labels, (double)g->compile_failures);
    counter(t, "grammar_cache_hits_total",
            "Lookups (a request's check, a choice's matcher) that found the grammar compiled.",
            labels, (double)g->hits);
    counter(t, "grammar_cache_evictions_total", "Compiled grammars evicted (least recently used).",
            labels, (double)g->evictions);
    gauge(t, "grammar_cache_entries", "Compiled grammars in the cache.", labels, g->entries);
    static const hist_def def = {"grammar_compile_seconds",
                                 "Time llguidance took to compile a grammar (failures included).",
                                 ds_grammar_compile_bounds, DS_GRAMMAR_COMPILE_BUCKETS};
    _Static_assert(DS_GRAMMAR_COMPILE_BUCKETS <= MAX_BUCKETS, "the histogram holds the buckets");
    hist h = {{0}, g->compile_seconds, g->compiles + g->compile_failures};
    memcpy(h.counts, g->compile_buckets, sizeof g->compile_buckets);
    render_hist(t, def.name, &def, &h, labels);
    counter(t, "grammar_mask_seconds_total",
            "Seconds spent making the token masks of constrained rows (beside the forward where "
            "the model is on a GPU).",
            labels, st->grammar_mask_seconds);
    counter(t, "grammar_mask_wait_seconds_total",
            "Seconds steps waited for their masks (the part of the masks' time a step paid).",
            labels, st->grammar_wait_seconds);
    counter(t, "grammar_accept_seconds_total",
            "Seconds the grammars took to accept the chosen tokens (after each step).", labels,
            st->grammar_accept_seconds);
}

/* The latency histograms, from one snapshot taken under the lock. */
static void render_histograms(textbuf *t, const hist *snap, const char *labels) {
    for (int i = 0; i < DS_HIST_COUNT; i++)
        render_hist(t, HISTS[i].name, &HISTS[i], &snap[i], labels);
}

/* The names older vLLM versions (and the Grafana dashboard in vLLM's examples) query, for
 * numbers that are exported above under their current names. */
static void render_vllm_legacy(textbuf *t, const ds_engine_stats *st, const hist *snap,
                               const char *labels) {
    gauge(t, "gpu_cache_usage_perc", "KV cache usage (1 = full); the same as kv_cache_usage_perc.",
          labels, st->pages_total ? (double)st->pages_used / st->pages_total : 0.0);
    gauge(t, "num_requests_swapped", "Requests swapped out (never: preempted ones recompute).",
          labels, 0.0);
    render_hist(t, "time_per_output_token_seconds", &HISTS[DS_HIST_ITL], &snap[DS_HIST_ITL],
                labels);
}

char *ds_metrics_render(ds_metrics *m, const ds_engine_stats *st, const char *model_name,
                        size_t *len, ds_err *err) {
    textbuf t = {0};
    t.cap = 8192;
    t.s = malloc(t.cap);
    if (!t.s) {
        ds_errf(err, "out of memory rendering metrics");
        return NULL;
    }
    char labels[600];
    format_labels(labels, sizeof labels, model_name);
    hist snap[DS_HIST_COUNT];
    pthread_mutex_lock(&m->mu);
    memcpy(snap, m->h, sizeof snap);
    pthread_mutex_unlock(&m->mu);
    /* vLLM's names, so its dashboards and alerts work unchanged; then the same numbers as
     * deltaserve:, the names of earlier releases */
    static const char *const PREFIXES[] = {"vllm:", "deltaserve:"};
    for (size_t i = 0; i < DS_ARRAY_LEN(PREFIXES); i++) {
        t.pfx = PREFIXES[i];
        render_engine(&t, st, labels);
        render_counters(&t, st, labels);
        render_histograms(&t, snap, labels);
        render_grammar(&t, st, labels);
        if (i == 0) render_vllm_legacy(&t, st, snap, labels);
    }
    if (t.oom) {
        free(t.s);
        ds_errf(err, "out of memory rendering metrics");
        return NULL;
    }
    *len = t.len;
    return t.s;
}
