/* cmd_bench_serve.c — `deltaserve bench serve`: a load generator for a running OpenAI-compatible
 * server, reporting what `vllm bench serve` reports (throughput; mean/median/p99 of TTFT, TPOT,
 * ITL and end-to-end latency).
 *
 * Each of --concurrency client threads takes the next request, waits for its arrival time (all at
 * once, or a Poisson process of --request-rate per second) and sends a streaming completion with
 * ignore_eos, so the number of output tokens is exactly the one asked for; the token counts come
 * from the server's usage chunk. Times are taken as SSE chunks arrive: TTFT at the first chunk
 * with text, ITL between text chunks, TPOT = (E2E - TTFT) / (output tokens - 1). */
#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/commands.h"

enum { PROMPT_ID_RANGE = 256 }; /* random prompts use ids below this: in every vocabulary */

typedef struct bench_req {
    /* input */
    char *prompt_text; /* dataset prompt, or NULL for random ids */
    int input_len;     /* random prompts: tokens */
    int max_tokens;
    double arrival; /* seconds after the start */
    /* result */
    int ok;
    char err[256];
    int prompt_tokens, output_tokens;
    double ttft, e2e;
    double *itl; /* [n_itl] seconds between text chunks */
    int n_itl, cap_itl;
} bench_req;

typedef struct bench {
    const char *url, *model, *api_key;
    const char *response_format; /* JSON object sent with every request (NULL: none); text, parsed
                                  * per request, so that no jansson value is shared by threads */
    bench_req *reqs;             /* [n] */
    int n;
    atomic_int next, done, failed;
    double t0;
    uint64_t seed;
    pthread_mutex_t print_mu;
    int bar_width;
} bench;

/* ---- one streaming request ---- */

typedef struct stream_state {
    bench_req *r;
    double t_start, t_last;
    int got_first, saw_done;
    char *buf; /* [len] bytes not yet parsed (an incomplete SSE event) */
    size_t len, cap;
} stream_state;

static void req_error(bench_req *r, const char *fmt, const char *detail) {
    if (!r->err[0]) snprintf(r->err, sizeof r->err, fmt, detail);
}

/* One SSE event's data payload. */
static void on_sse_data(stream_state *s, const char *data, size_t n) {
    bench_req *r = s->r;
    if (n == 6 && memcmp(data, "[DONE]", 6) == 0) {
        s->saw_done = 1;
        return;
    }
    json_error_t je;
    json_t *j = json_loadb(data, n, JSON_ALLOW_NUL, &je); /* a model may emit a NUL byte */
    if (!j) {
        req_error(r, "bad SSE JSON: %s", je.text);
        return;
    }
    json_t *err = json_object_get(j, "error");
    if (err) req_error(r, "server error: %s", json_string_value(json_object_get(err, "message")));
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    /* a token arrived: text, or (token ids asked for) an id whose bytes do not decode alone */
    if (json_string_length(json_object_get(ch, "text")) > 0 ||
        json_array_size(json_object_get(ch, "token_ids")) > 0) {
        double now = ds_now();
        if (!s->got_first) {
            r->ttft = now - s->t_start;
            s->got_first = 1;
        } else {
            if (r->n_itl == r->cap_itl) {
                int cap = r->cap_itl ? 2 * r->cap_itl : 64;
                double *p = realloc(r->itl, (size_t)cap * sizeof *p);
                if (p) r->itl = p, r->cap_itl = cap;
            }
            if (r->n_itl < r->cap_itl) r->itl[r->n_itl++] = now - s->t_last;
        }
        s->t_last = now;
    }
    json_t *u = json_object_get(j, "usage");
    if (json_is_object(u)) {
        r->prompt_tokens = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
        r->output_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
    }
    json_decref(j);
}

static size_t on_body(char *p, size_t size, size_t nmemb, void *user) {
    stream_state *s = user;
    size_t n = size * nmemb;
    if (s->len + n + 1 > s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 4096;
        while (cap < s->len + n + 1) cap *= 2;
        char *b = realloc(s->buf, cap);
        if (!b) return 0; /* aborts the transfer */
        s->buf = b, s->cap = cap;
    }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
    s->buf[s->len] = 0;
    /* events end with a blank line; lines starting "data:" carry the payload */
    size_t start = 0;
    for (;;) {
        char *end = strstr(s->buf + start, "\n\n");
        if (!end) break;
        size_t ev_end = (size_t)(end - s->buf);
        for (size_t ls = start; ls < ev_end;) {
            char *nl = memchr(s->buf + ls, '\n', ev_end - ls);
            size_t le = nl ? (size_t)(nl - s->buf) : ev_end;
            if (le - ls >= 5 && memcmp(s->buf + ls, "data:", 5) == 0) {
                size_t d = ls + 5;
                if (d < le && s->buf[d] == ' ') d++;
                on_sse_data(s, s->buf + d, le - d);
            }
            ls = le + 1;
        }
        start = ev_end + 2;
    }
    memmove(s->buf, s->buf + start, s->len - start + 1);
    s->len -= start;
    return n;
}

/* Builds the request body: a random-id prompt (seeded by the request's index) or dataset text. */
static char *request_body(const bench *b, int i) {
    const bench_req *r = &b->reqs[i];
    json_t *prompt;
    if (r->prompt_text) {
        prompt = json_string(r->prompt_text);
    } else {
        ds_rng rng;
        ds_rng_seed(&rng, b->seed * 1000003u + (uint64_t)i);
        prompt = json_array();
        for (int k = 0; k < r->input_len; k++)
            json_array_append_new(prompt,
                                  json_integer((json_int_t)(ds_rng_next(&rng) % PROMPT_ID_RANGE)));
    }
    /* return_token_ids: every token then streams a chunk, also one whose bytes make no text yet
     * (a random-weight model samples such ids), so the timings count tokens */
    json_t *j =
        json_pack("{s:s, s:o, s:i, s:b, s:{s:b}, s:b, s:f, s:b}", "model", b->model, "prompt",
                  prompt, "max_tokens", r->max_tokens, "stream", 1, "stream_options",
                  "include_usage", 1, "ignore_eos", 1, "temperature", 0.0, "return_token_ids", 1);
    /* a constrained request still stops at its grammar's end (ignore_eos cannot outlast it), so
     * its output may be shorter than max_tokens: TPOT, not the count, is what compares */
    if (j && b->response_format)
        json_object_set_new(j, "response_format", json_loads(b->response_format, 0, NULL));
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    return s;
}

static void run_one(bench *b, CURL *curl, int i) {
    bench_req *r = &b->reqs[i];
    char url[1024];
    snprintf(url, sizeof url, "%s/v1/completions", b->url);
    char *body = request_body(b, i);
    if (!body) {
        req_error(r, "%s", "could not build the request body");
        return;
    }
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    char auth[512];
    if (b->api_key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", b->api_key);
        h = curl_slist_append(h, auth);
    }
    stream_state s = {.r = r};
    curl_easy_reset(curl);
    curl_easy_setopt(curl, CURLOPT_URL, url);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(curl, CURLOPT_TCP_NODELAY, 1L);
    s.t_start = ds_now();
    CURLcode cc = curl_easy_perform(curl);
    r->e2e = ds_now() - s.t_start;
    long status = 0;
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
    if (cc != CURLE_OK) {
        req_error(r, "%s", curl_easy_strerror(cc));
    } else if (status != 200) {
        char msg[200];
        snprintf(msg, sizeof msg, "HTTP %ld: %.150s", status, s.buf ? s.buf : "");
        req_error(r, "%s", msg);
    } else if (!s.saw_done) {
        req_error(r, "%s", "the stream ended without [DONE]");
    } else if (!s.got_first) {
        req_error(r, "%s", "no text was generated");
    }
    r->ok = !r->err[0];
    free(s.buf);
    free(body);
    curl_slist_free_all(h);
}

static void progress(bench *b) {
    int done = atomic_load(&b->done), failed = atomic_load(&b->failed);
    int w = b->bar_width, fill = b->n ? (int)((long long)done * w / b->n) : w;
    pthread_mutex_lock(&b->print_mu);
    fprintf(stderr, "\r[bench] [");
    for (int k = 0; k < w; k++) fputc(k < fill ? '#' : '.', stderr);
    fprintf(stderr, "] %d/%d (%d failed) %.1fs", done, b->n, failed, ds_now() - b->t0);
    fflush(stderr);
    pthread_mutex_unlock(&b->print_mu);
}

static void *client_thread(void *arg) {
    bench *b = arg;
    CURL *curl = curl_easy_init();
    for (;;) {
        int i = atomic_fetch_add(&b->next, 1);
        if (i >= b->n) break;
        double wait = b->t0 + b->reqs[i].arrival - ds_now();
        if (wait > 0) {
            struct timespec ts = {(time_t)wait, (long)((wait - floor(wait)) * 1e9)};
            nanosleep(&ts, NULL);
        }
        if (curl)
            run_one(b, curl, i);
        else
            req_error(&b->reqs[i], "%s", "curl_easy_init failed");
        if (!b->reqs[i].ok) atomic_fetch_add(&b->failed, 1);
        atomic_fetch_add(&b->done, 1);
        progress(b);
    }
    if (curl) curl_easy_cleanup(curl);
    return NULL;
}

/* ---- statistics ---- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct stat3 {
    double mean, median, p99;
} stat3;

/* Mean, median and 99th percentile (linear interpolation between order statistics, as numpy's
 * default) of v[0..n), in milliseconds. v is sorted in place. */
static stat3 stats_ms(double *v, int n) {
    stat3 s = {0, 0, 0};
    if (n == 0) return s;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++) sum += v[i];
    s.mean = sum / n * 1e3;
    double pct[2] = {50, 99}, *out[2] = {&s.median, &s.p99};
    for (int k = 0; k < 2; k++) {
        double pos = pct[k] / 100 * (n - 1);
        int lo = (int)floor(pos), hi = DS_MIN(lo + 1, n - 1);
        *out[k] = (v[lo] + (v[hi] - v[lo]) * (pos - lo)) * 1e3;
    }
    return s;
}

/* ---- inputs ---- */

static int load_dataset(const char *path, int n, int default_out, bench_req *reqs, ds_err *err) {
    size_t len;
    char *text = ds_read_file(path, &len, err);
    if (!text) return DS_ERR;
    int k = 0, line_no = 0;
    int rc = DS_OK;
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line && k < n;
         line = strtok_r(NULL, "\n", &save)) {
        line_no++;
        if (!line[strspn(line, " \t\r")]) continue;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        json_t *p = json_object_get(j, "prompt");
        json_t *mt = json_object_get(j, "max_tokens");
        if (!json_is_string(p) || (mt && !json_is_integer(mt))) {
            rc = ds_errf(err, "%s:%d: expected {\"prompt\": string, \"max_tokens\": int}", path,
                         line_no);
            json_decref(j);
            break;
        }
        reqs[k].prompt_text = strdup(json_string_value(p));
        reqs[k].max_tokens = mt ? (int)json_integer_value(mt) : default_out;
        json_decref(j);
        k++;
    }
    free(text);
    if (rc == DS_OK && k == 0) rc = ds_errf(err, "%s: no prompts", path);
    /* fewer lines than requests: cycle through them */
    for (int i = k; rc == DS_OK && i < n; i++) {
        reqs[i].prompt_text = strdup(reqs[i % k].prompt_text);
        reqs[i].max_tokens = reqs[i % k].max_tokens;
    }
    return rc;
}

static size_t collect(char *p, size_t size, size_t nmemb, void *user) {
    size_t n = size * nmemb;
    char **buf = (char **)user;
    size_t old = *buf ? strlen(*buf) : 0;
    char *b = realloc(*buf, old + n + 1);
    if (!b) return 0;
    memcpy(b + old, p, n);
    b[old + n] = 0;
    *buf = b;
    return n;
}

/* The served model's name from GET /v1/models. malloc'd, or NULL with err. */
static char *fetch_model_name(const char *url, const char *api_key, ds_err *err) {
    CURL *c = curl_easy_init();
    if (!c) {
        ds_errf(err, "curl_easy_init failed");
        return NULL;
    }
    char u[1024], auth[512];
    snprintf(u, sizeof u, "%s/v1/models", url);
    struct curl_slist *h = NULL;
    if (api_key) {
        snprintf(auth, sizeof auth, "Authorization: Bearer %s", api_key);
        h = curl_slist_append(h, auth);
    }
    char *body = NULL;
    curl_easy_setopt(c, CURLOPT_URL, u);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &body);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 10L);
    CURLcode cc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    curl_slist_free_all(h);
    char *name = NULL;
    if (cc != CURLE_OK) {
        ds_errf(err, "GET %s: %s", u, curl_easy_strerror(cc));
    } else {
        json_t *j = body ? json_loads(body, 0, NULL) : NULL;
        const char *id =
            json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
        if (status == 200 && id)
            name = strdup(id);
        else
            ds_errf(err, "GET %s: HTTP %ld %.200s", u, status, body ? body : "");
        json_decref(j);
    }
    free(body);
    return name;
}

/* ---- the command ---- */

/* What the run measured, over the requests that completed. */
typedef struct bench_summary {
    int completed, failed;
    long long in_tok, out_tok;
    double duration; /* seconds */
    stat3 st[4];     /* ttft, tpot, itl, e2e */
} bench_summary;

static const char *const STAT_NAMES[4] = {"ttft", "tpot", "itl", "e2el"};

/* Counts the completed and failed requests (the first failures said on stderr) and the latency
 * statistics. */
static int bench_summarize(const bench *b, bench_summary *s) {
    int n_itl = 0;
    for (int i = 0; i < b->n; i++) {
        const bench_req *r = &b->reqs[i];
        if (!r->ok) {
            if (s->failed++ < 5) fprintf(stderr, "[bench] request %d failed: %s\n", i, r->err);
            continue;
        }
        s->completed++;
        s->in_tok += r->prompt_tokens;
        s->out_tok += r->output_tokens;
        n_itl += r->n_itl;
    }
    double *vals = malloc((size_t)(DS_MAX(n_itl, b->n) + 1) * sizeof *vals); /* [k] per stat */
    if (!vals) return DS_ERR;
    for (int m = 0; m < 4; m++) {
        int k = 0;
        for (int i = 0; i < b->n; i++) {
            const bench_req *r = &b->reqs[i];
            if (!r->ok) continue;
            if (m == 0) vals[k++] = r->ttft;
            if (m == 1 && r->output_tokens > 1)
                vals[k++] = (r->e2e - r->ttft) / (r->output_tokens - 1);
            if (m == 2)
                for (int q = 0; q < r->n_itl; q++) vals[k++] = r->itl[q];
            if (m == 3) vals[k++] = r->e2e;
        }
        s->st[m] = stats_ms(vals, k);
    }
    free(vals);
    return DS_OK;
}

/* The report, laid out as `vllm bench serve` prints it. */
static void bench_print(const bench_summary *s, int concurrency, double rate) {
    static const char *const titles[4] = {"Time to First Token",
                                          "Time per Output Token (excl. 1st token)",
                                          "Inter-token Latency", "End-to-end Latency"};
    static const char *const abbr[4] = {"TTFT", "TPOT", "ITL", "E2EL"};
    const double duration = s->duration;
    printf("============ Serving Benchmark Result ============\n");
    printf("%-40s %d\n", "Successful requests:", s->completed);
    printf("%-40s %d\n", "Failed requests:", s->failed);
    printf("%-40s %d\n", "Maximum request concurrency:", concurrency);
    if (rate > 0)
        printf("%-40s %.2f\n", "Request rate configured (RPS):", rate);
    else
        printf("%-40s %s\n", "Request rate configured (RPS):", "inf");
    printf("%-40s %.2f\n", "Benchmark duration (s):", duration);
    printf("%-40s %lld\n", "Total input tokens:", s->in_tok);
    printf("%-40s %lld\n", "Total generated tokens:", s->out_tok);
    printf("%-40s %.2f\n", "Request throughput (req/s):", s->completed / duration);
    printf("%-40s %.2f\n", "Output token throughput (tok/s):", s->out_tok / duration);
    printf("%-40s %.2f\n", "Total Token throughput (tok/s):", (s->in_tok + s->out_tok) / duration);
    for (int m = 0; m < 4; m++) {
        int pad = (50 - 2 - (int)strlen(titles[m])) / 2;
        printf("%.*s%s%.*s\n", pad, "--------------------------------------------------", titles[m],
               50 - pad - (int)strlen(titles[m]),
               "--------------------------------------------------");
        char label[64];
        snprintf(label, sizeof label, "Mean %s (ms):", abbr[m]);
        printf("%-40s %.2f\n", label, s->st[m].mean);
        snprintf(label, sizeof label, "Median %s (ms):", abbr[m]);
        printf("%-40s %.2f\n", label, s->st[m].median);
        snprintf(label, sizeof label, "P99 %s (ms):", abbr[m]);
        printf("%-40s %.2f\n", label, s->st[m].p99);
    }
    printf("==================================================\n");
}

/* --out FILE.json: the summary and every request's lengths, TTFT and error. */
static int bench_write_json(const char *out_path, const bench *b, const bench_summary *s,
                            int concurrency, double rate) {
    const double duration = s->duration;
    json_t *j = json_pack("{s:s, s:s, s:i, s:i, s:i, s:f, s:f, s:I, s:I, s:f, s:f, s:f}", "url",
                          b->url, "model", b->model, "num_prompts", b->n, "completed", s->completed,
                          "failed", s->failed, "request_rate", rate, "duration", duration,
                          "total_input_tokens", (json_int_t)s->in_tok, "total_output_tokens",
                          (json_int_t)s->out_tok, "request_throughput", s->completed / duration,
                          "output_throughput", s->out_tok / duration, "total_token_throughput",
                          (s->in_tok + s->out_tok) / duration);
    json_object_set_new(j, "max_concurrency", json_integer(concurrency));
    if (b->response_format)
        json_object_set_new(j, "response_format", json_loads(b->response_format, 0, NULL));
    for (int m = 0; m < 4; m++) {
        char k[48];
        snprintf(k, sizeof k, "mean_%s_ms", STAT_NAMES[m]);
        json_object_set_new(j, k, json_real(s->st[m].mean));
        snprintf(k, sizeof k, "median_%s_ms", STAT_NAMES[m]);
        json_object_set_new(j, k, json_real(s->st[m].median));
        snprintf(k, sizeof k, "p99_%s_ms", STAT_NAMES[m]);
        json_object_set_new(j, k, json_real(s->st[m].p99));
    }
    json_t *il = json_array(), *ol = json_array(), *tt = json_array(), *er = json_array();
    for (int i = 0; i < b->n; i++) {
        const bench_req *r = &b->reqs[i];
        json_array_append_new(il, json_integer(r->prompt_tokens));
        json_array_append_new(ol, json_integer(r->output_tokens));
        json_array_append_new(tt, json_real(r->ok ? r->ttft : 0));
        json_array_append_new(er, json_string(r->err));
    }
    json_object_set_new(j, "input_lens", il);
    json_object_set_new(j, "output_lens", ol);
    json_object_set_new(j, "ttfts", tt);
    json_object_set_new(j, "errors", er);
    int rc = json_dump_file(j, out_path, JSON_INDENT(2));
    json_decref(j);
    if (rc) {
        fprintf(stderr, "bench serve: could not write %s\n", out_path);
        return DS_ERR;
    }
    fprintf(stderr, "[bench] results written to %s\n", out_path);
    return DS_OK;
}

/* Arrival times: all at once (rate 0), or a Poisson process of `rate` requests per second. */
static void bench_arrivals(bench *b, double rate, uint64_t seed) {
    ds_rng rng;
    ds_rng_seed(&rng, seed ^ 0xa5a5a5a5ull);
    double t = 0;
    for (int i = 0; i < b->n; i++) {
        if (rate > 0) t += -log(1.0 - ds_rng_uniform(&rng)) / rate; /* exponential gaps */
        b->reqs[i].arrival = t;
    }
}

/* Random requests' lengths: --input-len / --output-len, or with --random-range-ratio R each drawn
 * uniformly from [L (1 - R), L (1 + R)] (vLLM's meaning), at least 1, from the seed's own stream
 * so that a rerun sends the same mix. */
static void bench_lengths(bench *b, int input_len, int output_len, double ratio, uint64_t seed) {
    ds_rng rng;
    ds_rng_seed(&rng, seed ^ 0x5a5a5a5aull);
    const int lens[2] = {input_len, output_len};
    for (int i = 0; i < b->n; i++) {
        int drawn[2];
        for (int k = 0; k < 2; k++) {
            const double lo = lens[k] * (1.0 - ratio), hi = lens[k] * (1.0 + ratio);
            const int v = (int)floor(lo + (hi - lo + 1.0) * ds_rng_uniform(&rng));
            drawn[k] = ratio > 0 ? DS_MAX(1, DS_MIN(v, (int)floor(hi))) : lens[k];
        }
        b->reqs[i].input_len = drawn[0], b->reqs[i].max_tokens = drawn[1];
    }
}

/* --output-lens-from: each request's max_tokens from the "output_lens" of an earlier run's --out
 * JSON (same --num-prompts, same order), so a run without a response_format generates exactly as
 * many tokens per request as a constrained run did (a grammar may end an output early; with
 * shorter outputs the same admissions cost more per token, which a fair comparison must not
 * count as the mask's cost). */
static int lens_from(const char *path, bench *b, ds_err *err) {
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) return ds_errf(err, "--output-lens-from %s: %s", path, je.text);
    json_t *ol = json_object_get(j, "output_lens");
    int rc = DS_OK;
    if (!json_is_array(ol) || (int)json_array_size(ol) != b->n)
        rc =
            ds_errf(err, "--output-lens-from %s: expected \"output_lens\", an array of %d integers",
                    path, b->n);
    for (int i = 0; rc == DS_OK && i < b->n; i++) {
        json_t *v = json_array_get(ol, (size_t)i);
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 1 << 24)
            rc = ds_errf(err, "--output-lens-from %s: output_lens[%d]: expected an integer >= 1",
                         path, i);
        else
            b->reqs[i].max_tokens = (int)json_integer_value(v);
    }
    json_decref(j);
    return rc;
}

/* The server's base URL: trailing slashes and a "/v1" taken off, into base[cap]. */
static void base_url(const char *url, char *base, size_t cap) {
    snprintf(base, cap, "%s", url);
    size_t bl = strlen(base);
    while (bl && base[bl - 1] == '/') base[--bl] = 0;
    if (bl >= 3 && strcmp(base + bl - 3, "/v1") == 0) base[bl -= 3] = 0;
}

/* --response-format's value (JSON text, or @FILE) as compact JSON text; NULL after saying why. */
static char *response_format(const char *arg) {
    json_error_t je;
    json_t *rf = arg[0] == '@' ? json_load_file(arg + 1, 0, &je) : json_loads(arg, 0, &je);
    char *out = rf && json_is_object(rf) ? json_dumps(rf, JSON_COMPACT) : NULL;
    if (!out)
        fprintf(stderr, "bench serve: --response-format: %s\n",
                !rf                  ? je.text
                : json_is_object(rf) ? "out of memory"
                                     : "expected a JSON object");
    json_decref(rf);
    return out;
}

/* The numeric flags in range; 0 after saying which is not. */
static int numbers_ok(int num_prompts, int concurrency, int input_len, int output_len, double rate,
                      double ratio) {
    const struct {
        const char *flag;
        int value;
    } ints[] = {{"--num-prompts", num_prompts},
                {"--concurrency", concurrency},
                {"--input-len", input_len},
                {"--output-len", output_len}};
    for (size_t i = 0; i < DS_ARRAY_LEN(ints); i++)
        if (ints[i].value < 1) {
            fprintf(stderr, "bench serve: %s: expected at least 1, got %d\n", ints[i].flag,
                    ints[i].value);
            return 0;
        }
    if (rate < 0) {
        fprintf(stderr, "bench serve: --request-rate: expected >= 0, got %g\n", rate);
        return 0;
    }
    if (!(ratio >= 0 && ratio < 1)) {
        fprintf(stderr, "bench serve: --random-range-ratio: expected 0 <= R < 1, got %g\n", ratio);
        return 0;
    }
    return 1;
}

int ds_cmd_bench_serve(int argc, char **argv) {
    const char *url = "http://127.0.0.1:8000", *dataset = NULL, *out_path = NULL, *model = NULL;
    const char *api_key = NULL, *rf_text = NULL, *lens_path = NULL;
    char *rf_dump = NULL;
    int num_prompts = 100, concurrency = 16, input_len = 256, output_len = 64;
    double rate = 0;  /* 0: all at once */
    double ratio = 0; /* 0: every random request of exactly --input-len / --output-len */
    int64_t seed = 0;
    ds_arg opts[] = {
        DS_OPT("url", NULL, DS_ARG_STRING, &url, "URL", "server base URL (without /v1)"),
        DS_OPT("num-prompts", "n", DS_ARG_INT, &num_prompts, "N", "requests to send"),
        DS_OPT("concurrency", "c", DS_ARG_INT, &concurrency, "C", "requests in flight at most"),
        DS_OPT("request-rate", NULL, DS_ARG_FLOAT, &rate, "R",
               "Poisson arrivals at R requests/s (0: all at once)"),
        DS_OPT("input-len", NULL, DS_ARG_INT, &input_len, "L", "random prompt length in tokens"),
        DS_OPT("output-len", NULL, DS_ARG_INT, &output_len, "O", "tokens to generate per request"),
        DS_OPT("random-range-ratio", NULL, DS_ARG_FLOAT, &ratio, "R",
               "random lengths uniform in [L (1 - R), L (1 + R)], 0 <= R < 1 (default 0)"),
        DS_OPT("dataset", NULL, DS_ARG_STRING, &dataset, "FILE.jsonl",
               "prompts instead of random ids: one {\"prompt\", \"max_tokens\"} per line"),
        DS_OPT("model", NULL, DS_ARG_STRING, &model, "NAME", "model name (default: /v1/models)"),
        DS_OPT("api-key", NULL, DS_ARG_STRING, &api_key, "KEY", "bearer key for the server"),
        DS_OPT("seed", NULL, DS_ARG_I64, &seed, "S", "seed of random prompts and arrivals"),
        DS_OPT("response-format", NULL, DS_ARG_STRING, &rf_text, "JSON|@FILE",
               "an OpenAI response_format object sent with every request (constrained decoding's "
               "cost: compare TPOT with a run without it)"),
        DS_OPT("output-lens-from", NULL, DS_ARG_STRING, &lens_path, "FILE.json",
               "each request's output length from an earlier run's --out (e.g. a constrained "
               "run's, for a plain run of the same lengths)"),
        DS_OPT("out", "o", DS_ARG_STRING, &out_path, "FILE.json", "write the results as JSON"),
    };
    ds_args a = {"deltaserve bench serve",
                 "Load-test a running OpenAI-compatible server with streaming completions and\n"
                 "report throughput and TTFT / TPOT / ITL / end-to-end latency (ms).",
                 opts, (int)DS_ARRAY_LEN(opts)};
    /* accept argv as ("serve", flags...) or as ("bench", "serve", flags...) */
    if (argc > 1 && strcmp(argv[1], "serve") == 0) argc--, argv++;
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    if (!numbers_ok(num_prompts, concurrency, input_len, output_len, rate, ratio)) return 2;
    if (rf_text && !(rf_dump = response_format(rf_text))) return 2;
    ds_err err = {{0}};
    curl_global_init(CURL_GLOBAL_DEFAULT);
    char base[1024];
    base_url(url, base, sizeof base);

    bench b;
    memset(&b, 0, sizeof b);
    b.url = base;
    b.api_key = api_key;
    b.response_format = rf_dump;
    b.n = num_prompts;
    b.seed = (uint64_t)seed;
    b.bar_width = 30;
    pthread_mutex_init(&b.print_mu, NULL);
    char *model_name = model ? strdup(model) : fetch_model_name(base, api_key, &err);
    b.reqs = calloc((size_t)num_prompts, sizeof *b.reqs);
    int status = 1;
    pthread_t *th = calloc((size_t)concurrency, sizeof *th);
    if (!model_name || !b.reqs || !th) {
        fprintf(stderr, "bench serve: %s\n", err.msg[0] ? err.msg : "out of memory");
        goto out;
    }
    b.model = model_name;
    if (dataset) {
        if (load_dataset(dataset, num_prompts, output_len, b.reqs, &err)) {
            fprintf(stderr, "bench serve: %s\n", err.msg);
            goto out;
        }
    } else {
        bench_lengths(&b, input_len, output_len, ratio, (uint64_t)seed);
    }
    if (lens_path && lens_from(lens_path, &b, &err)) {
        fprintf(stderr, "bench serve: %s\n", err.msg);
        status = 2;
        goto out;
    }
    bench_arrivals(&b, rate, (uint64_t)seed);

    fprintf(stderr, "[bench] %d requests to %s (model '%s'), concurrency %d, rate %s\n",
            num_prompts, base, model_name, concurrency, rate > 0 ? "poisson" : "inf");
    b.t0 = ds_now();
    int n_threads = DS_MIN(concurrency, num_prompts);
    for (int i = 0; i < n_threads; i++) pthread_create(&th[i], NULL, client_thread, &b);
    for (int i = 0; i < n_threads; i++) pthread_join(th[i], NULL);
    bench_summary sum = {.duration = ds_now() - b.t0};
    fprintf(stderr, "\n");
    if (bench_summarize(&b, &sum)) goto out;
    bench_print(&sum, concurrency, rate);
    if (out_path && bench_write_json(out_path, &b, &sum, concurrency, rate)) goto out;
    status = sum.failed ? 1 : 0;
out:
    for (int i = 0; b.reqs && i < num_prompts; i++) {
        free(b.reqs[i].prompt_text);
        free(b.reqs[i].itl);
    }
    free(b.reqs);
    free(th);
    free(model_name);
    free(rf_dump);
    pthread_mutex_destroy(&b.print_mu);
    curl_global_cleanup();
    return status;
}
