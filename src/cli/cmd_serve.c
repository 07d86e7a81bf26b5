/* cmd_serve.c — `deltaserve serve`: load a model into the engine and serve the OpenAI API.
 *
 * The HTTP server listens before the model loads (so /health can say 503 while it does), is
 * attached to the engine once the engine runs, and shuts down on SIGINT/SIGTERM in the order
 * http.h asks: stop accepting, let the engine finish or abort what runs (a grace period), join the
 * connections, free the engine. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/commands.h"
#include "transport/comm.h"
#include "transport/launch.h"
#include "parallel/pipeline.h"
#include "engine/engine.h"
#include "server/http.h"

/* Signals: while the model loads there is nothing to clean up, so a signal ends the process the
 * default way (a big checkpoint can take minutes; Ctrl-C must work). Once serving, the handler
 * only writes to a pipe that main waits on, and main does the orderly shutdown. */
static volatile sig_atomic_t g_loading = 1;
static int g_sig_pipe[2] = {-1, -1};

static void on_signal(int sig) {
    if (g_loading) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    int saved = errno;
    char b = (char)sig;
    ssize_t w = write(g_sig_pipe[1], &b, 1);
    (void)w;
    errno = saved;
}

/* "2G", "512M", "1.5GiB", "1073741824" -> bytes. Suffixes K, M, G, T are powers of 1024, with an
 * optional "i" and "B"/"b". */
static int parse_bytes(const char *s, size_t *out, ds_err *err) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || v < 0) return ds_errf(err, "expected a size such as 2G, got '%s'", s);
    double mult = 1;
    switch (*end) {
    case 'k':
    case 'K':
        mult = 1024.0, end++;
        break;
    case 'm':
    case 'M':
        mult = 1024.0 * 1024, end++;
        break;
    case 'g':
    case 'G':
        mult = 1024.0 * 1024 * 1024, end++;
        break;
    case 't':
    case 'T':
        mult = 1024.0 * 1024 * 1024 * 1024, end++;
        break;
    default:
        break;
    }
    if (mult > 1 && *end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return ds_errf(err, "expected a size such as 2G, got '%s'", s);
    if (v * mult > (double)SIZE_MAX / 2) return ds_errf(err, "size '%s' is too large", s);
    *out = (size_t)(v * mult);
    return DS_OK;
}

/* The last path component of dir (trailing slashes ignored; "." resolved). malloc'd. */
static char *folder_name(const char *dir) {
    char buf[PATH_MAX];
    const char *p = realpath(dir, buf) ? buf : dir;
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') n--;
    size_t b = n;
    while (b > 0 && p[b - 1] != '/') b--;
    return strndup(p + b, n - b);
}

/* Prints the address to reach and a request to paste into a shell. */
static void print_ready(const char *host, int port, const char *name, int max_model_len,
                        const char *api_key) {
    /* a wildcard bind is reached through loopback; an IPv6 literal needs brackets in a URL */
    const char *h = strcmp(host, "0.0.0.0") == 0 ? "127.0.0.1"
                    : strcmp(host, "::") == 0    ? "::1"
                                                 : host;
    int v6 = strchr(h, ':') != NULL;
    char base[300];
    snprintf(base, sizeof base, "http://%s%s%s:%d", v6 ? "[" : "", h, v6 ? "]" : "", port);
    printf("[deltaserve] ready: serving '%s' (max_model_len %d) at %s/v1\n", name, max_model_len,
           base);
    printf("[deltaserve] try:\n  curl %s/v1/chat/completions -H 'Content-Type: application/json'",
           base);
    if (api_key) printf(" \\\n    -H 'Authorization: Bearer %s'", api_key);
    printf(" \\\n    -d '{\"model\": \"%s\", \"messages\": [{\"role\": \"user\", \"content\": "
           "\"Hello!\"}], \"max_tokens\": 32}'\n",
           name);
    fflush(stdout);
}

/* ---- the speculation test oracle (--speculative-test-oracle) -----------------------------------
 * Invariant 6 must hold at every accepted count from 0 to k, which a real draft reaches only by
 * luck. The oracle knows each prompt's true greedy output (JSON lines {"prompt": [ids], "output":
 * [ids]}) and drafts it right for `want` positions and wrong after, with want cycling 0..k. */
typedef struct oracle_entry {
    int32_t *prompt, *out; /* [n_prompt], [n_out] */
    int n_prompt, n_out;
} oracle_entry;

typedef struct oracle {
    oracle_entry *e; /* [n] */
    int n;
    unsigned long calls;
} oracle;

static int oracle_drafts(void *ctx, const int32_t *tokens, int n_tokens, int k, int32_t *drafts) {
    oracle *o = ctx;
    const oracle_entry *best = NULL;
    for (int i = 0; i < o->n; i++) {
        const oracle_entry *x = &o->e[i];
        if (x->n_prompt <= n_tokens && (!best || x->n_prompt > best->n_prompt) &&
            !memcmp(x->prompt, tokens, (size_t)x->n_prompt * sizeof(int32_t)))
            best = x;
    }
    if (!best) return 0;
    int g = n_tokens - best->n_prompt, want = (int)(o->calls++ % (unsigned long)(k + 1));
    for (int i = 0; i < k; i++) {
        int32_t truth = g + i < best->n_out ? best->out[g + i] : 0;
        drafts[i] = i < want ? truth : truth > 0 ? truth - 1 : truth + 1;
    }
    return k;
}

static int ids_of(json_t *a, int32_t **out, int *n, ds_err *err) {
    if (!json_is_array(a)) return ds_errf(err, "expected a list of token ids");
    *n = (int)json_array_size(a);
    *out = ds_malloc((size_t)(*n ? *n : 1) * sizeof(int32_t), err);
    if (!*out) return DS_ERR;
    for (int i = 0; i < *n; i++) {
        json_t *v = json_array_get(a, (size_t)i);
        if (!json_is_integer(v)) return ds_errf(err, "token id %d is not an integer", i);
        (*out)[i] = (int32_t)json_integer_value(v);
    }
    return DS_OK;
}

static int oracle_load(const char *path, oracle *o, ds_err *err) {
    memset(o, 0, sizeof *o);
    FILE *f = fopen(path, "r");
    if (!f) return ds_errf(err, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    int rc = DS_OK, lineno = 0;
    while (rc == DS_OK && getline(&line, &cap, f) > 0) {
        lineno++;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        oracle_entry *ne = realloc(o->e, (size_t)(o->n + 1) * sizeof *ne);
        if (!j || !ne) {
            rc = ds_errf(err, "%s:%d: %s", path, lineno, j ? "out of memory" : je.text);
        } else {
            o->e = ne;
            oracle_entry *x = &o->e[o->n];
            memset(x, 0, sizeof *x);
            o->n++;
            if (ids_of(json_object_get(j, "prompt"), &x->prompt, &x->n_prompt, err) ||
                ids_of(json_object_get(j, "output"), &x->out, &x->n_out, err))
                rc = ds_err_prefix(err, "%s:%d", path, lineno);
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    return rc;
}

static void oracle_free(oracle *o) {
    for (int i = 0; i < o->n; i++) {
        free(o->e[i].prompt);
        free(o->e[i].out);
    }
    free(o->e);
}

/* A rank other than the head: no HTTP, just the engine in lock step with the head until the head's
 * stop reaches it. Signals are the head's business (mpirun forwards them to every rank). */
static int serve_rank(const ds_engine_opts *eo, ds_comm *comm) {
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGUSR1, SIG_IGN);
    ds_err err = {{0}};
    ds_engine *e = NULL;
    if (ds_engine_create(eo, &e, &err) || ds_engine_start(e, &err)) {
        fprintf(stderr, "serve: %s: %s\n", comm->who, err.msg);
        ds_engine_free(e);
        return ds_comm_finish(comm, 1);
    }
    ds_engine_join(e);
    ds_engine_free(e);
    return ds_comm_finish(comm, 0);
}

int ds_cmd_serve(int argc, char **argv) {
    static oracle orc; /* outlives the engine; freed on the way out */
    ds_engine_opts eo;
    ds_engine_opts_default(&eo);
    const char *model_dir = NULL, *host = "127.0.0.1", *api_key = NULL, *served = NULL;
    const char *kv_mem = NULL, *ckpt_mem = NULL, *off_ram = NULL, *off_disk_bytes = NULL;
    const char *off_disk_dir = NULL, *off_remote = NULL;
    int prefix_caching = eo.enable_prefix_caching,
        ckpt_interval = eo.state_checkpoint_interval_tokens;
    int port = 8000, max_num_seqs = eo.max_num_seqs, max_batched = eo.max_num_batched_tokens;
    int block_size = eo.block_size, max_model_len = eo.max_model_len, max_queue = eo.max_queue;
    double kv_fraction = eo.kv_cache_fraction, grace = 5.0;
    int64_t seed = (int64_t)eo.seed;
    const char *spec_method = "none", *draft_dir = NULL, *partition = "", *relay = "partial-sum";
    const char *oracle_path = NULL;
    static const char *const RELAYS[] = {"partial-sum", "plain", NULL};
    int tp = 1, pp = 1;
    int spec_k = eo.num_speculative_tokens;
    int batch_invariant = eo.batch_invariant, enforce_eager = 0;
    if (eo.device < 0) {
        fprintf(stderr, "serve: DS_DEVICE=%s: expected cpu, cuda or auto\n", getenv("DS_DEVICE"));
        return 2;
    }
    const char *device = ds_device_names[eo.device];
    static const char *const SPEC_METHODS[] = {"none", "dspark", "ngram", NULL};
    ds_arg opts[] = {
        {"model", "m", DS_ARG_STRING, &model_dir, "DIR", "checkpoint folder", .required = 1},
        DS_OPT("host", NULL, DS_ARG_STRING, &host, "ADDR", "address to bind"),
        DS_OPT("port", NULL, DS_ARG_INT, &port, "N", "port to listen on (0: any free port)"),
        DS_OPT("api-key", NULL, DS_ARG_STRING, &api_key, "KEY",
               "require 'Authorization: Bearer KEY' on /v1/* (default: open)"),
        DS_OPT("served-model-name", NULL, DS_ARG_STRING, &served, "NAME",
               "model name clients send (default: the model folder's name)"),
        DS_OPT("max-num-seqs", NULL, DS_ARG_INT, &max_num_seqs, "N", "running sequences at most"),
        DS_OPT("max-num-batched-tokens", NULL, DS_ARG_INT, &max_batched, "N",
               "tokens per engine step at most"),
        DS_OPT("block-size", NULL, DS_ARG_INT, &block_size, "N", "tokens per MLA page"),
        DS_OPT("kv-cache-memory", NULL, DS_ARG_STRING, &kv_mem, "BYTES",
               "memory for MLA pages + KDA state slots, e.g. 2G (default: a fraction of free)"),
        DS_OPT("kv-cache-fraction", NULL, DS_ARG_FLOAT, &kv_fraction, "F",
               "fraction of free memory for the caches when --kv-cache-memory is not given"),
        DS_OPT("max-model-len", NULL, DS_ARG_INT, &max_model_len, "N",
               "context limit (0: the model's, capped by the cache)"),
        DS_OPT("max-queue", NULL, DS_ARG_INT, &max_queue, "N",
               "waiting requests beyond which new ones get 503"),
        DS_OPT("seed", NULL, DS_ARG_I64, &seed, "S", "base seed for requests without one"),
        {"device", NULL, DS_ARG_STRING, &device, "D",
         "cpu, cuda (weights and caches in GPU memory; under MPI rank r uses GPU r mod count) or "
         "auto (cuda when built with it and a GPU is present)",
         .choices = ds_device_names},
        DS_OPT("batch-invariant", NULL, DS_ARG_BOOL, &batch_invariant, NULL,
               "CUDA: every matmul streams the weights with f32 activations, so a request's output "
               "never depends on its batch (the CPU always is); slower prefill"),
        DS_OPT("enforce-eager", NULL, DS_ARG_BOOL, &enforce_eager, NULL,
               "CUDA: no CUDA graphs (by default each decode / verify shape is captured once and "
               "replayed, also under -pp)"),
        {"speculative-method", "method", DS_ARG_STRING, &spec_method, "M",
         "speculative decoding: dspark (draft model) or ngram (prompt lookup)",
         .choices = SPEC_METHODS},
        DS_OPT("num-speculative-tokens", NULL, DS_ARG_INT, &spec_k, "K",
               "drafts verified per step"),
        DS_OPT("draft-model", NULL, DS_ARG_STRING, &draft_dir, "DIR",
               "DSpark draft checkpoint (default: MODEL/draft)"),
        {"draft-tap-relay", NULL, DS_ARG_STRING, &relay, "R",
         "DSpark under -pp: partial-sum (one [tokens, hidden] sum per stage boundary) or plain "
         "(every tap sent to the last stage)",
         .choices = RELAYS},
        DS_OPT("speculative-test-oracle", NULL, DS_ARG_STRING, &oracle_path, "FILE",
               "testing: draft from known greedy outputs (JSON lines {prompt, output} of token "
               "ids), right for 0..k positions in turn, instead of the method's drafts"),
        DS_OPT("enable-prefix-caching", NULL, DS_ARG_BOOL, &prefix_caching, NULL,
               "reuse cached MLA pages and KDA checkpoints of shared prompt prefixes"),
        DS_OPT("state-checkpoint-interval-tokens", NULL, DS_ARG_INT, &ckpt_interval, "N",
               "KDA checkpoint spacing in tokens, snapped to --block-size; prompts are cut into "
               "steps of this size (capped by --max-num-batched-tokens), caching on or off"),
        DS_OPT("state-checkpoint-memory", NULL, DS_ARG_STRING, &ckpt_mem, "BYTES",
               "memory for KDA checkpoint slots, e.g. 64M"),
        DS_OPT("kv-offload-ram", NULL, DS_ARG_STRING, &off_ram, "BYTES",
               "host-RAM offload tier size (default: off)"),
        DS_OPT("kv-offload-disk-dir", NULL, DS_ARG_STRING, &off_disk_dir, "DIR",
               "local-disk offload tier folder (default: off)"),
        DS_OPT("kv-offload-disk-bytes", NULL, DS_ARG_STRING, &off_disk_bytes, "BYTES",
               "disk tier size limit (default: unlimited)"),
        DS_OPT("kv-offload-remote", NULL, DS_ARG_STRING, &off_remote, "URL",
               "remote offload tier, redis://host:port (default: off)"),
        DS_OPT("shutdown-timeout", NULL, DS_ARG_FLOAT, &grace, "SEC",
               "on SIGINT/SIGTERM, let running requests finish this long, then abort them"),
        DS_OPT("tensor-parallel-size", "tp", DS_ARG_INT, &tp, "T",
               "tensor-parallel ranks per stage (MPI; re-launches through mpirun)"),
        DS_OPT("pipeline-parallel-size", "pp", DS_ARG_INT, &pp, "P", "pipeline stages"),
        DS_OPT("pp-layer-partition", NULL, DS_ARG_STRING, &partition, "N,N,...",
               "layers per stage (default: even, remainder to the middle stages)"),
    };
    ds_args a = {"deltaserve serve",
                 "Serve an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions\n"
                 "(streaming SSE), /v1/models, /health, /metrics, /tokenize, /detokenize.",
                 opts, (int)DS_ARRAY_LEN(opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    ds_err err = {{0}};
    if (port < 0 || port > 65535 || max_num_seqs < 1 || max_batched < 1 || block_size < 1 ||
        max_model_len < 0 || max_queue < 1 || kv_fraction <= 0 || kv_fraction > 1 || grace < 0) {
        fprintf(stderr, "serve: need 0 <= --port <= 65535, --max-num-seqs, "
                        "--max-num-batched-tokens, --block-size, --max-queue >= 1, "
                        "--max-model-len >= 0, 0 < --kv-cache-fraction <= 1, "
                        "--shutdown-timeout >= 0\n");
        return 2;
    }
    size_t kv_bytes = 0;
    struct {
        const char *flag, *value;
        size_t *dest;
    } sizes[] = {{"--kv-cache-memory", kv_mem, &kv_bytes},
                 {"--state-checkpoint-memory", ckpt_mem, &eo.state_checkpoint_memory},
                 {"--kv-offload-ram", off_ram, &eo.kv_offload_ram_bytes},
                 {"--kv-offload-disk-bytes", off_disk_bytes, &eo.kv_offload_disk_bytes}};
    for (size_t i = 0; i < DS_ARRAY_LEN(sizes); i++) {
        if (sizes[i].value && parse_bytes(sizes[i].value, sizes[i].dest, &err)) {
            fprintf(stderr, "serve: %s: %s\n", sizes[i].flag, err.msg);
            return 2;
        }
    }
    if (ckpt_interval < 1) {
        fprintf(stderr, "serve: need --state-checkpoint-interval-tokens >= 1\n");
        return 2;
    }
    eo.model_dir = model_dir;
    eo.kv_cache_memory = kv_bytes;
    eo.kv_cache_fraction = kv_fraction;
    eo.block_size = block_size;
    eo.max_num_seqs = max_num_seqs;
    eo.max_num_batched_tokens = max_batched;
    eo.max_model_len = max_model_len;
    eo.max_queue = max_queue;
    eo.seed = (uint64_t)seed;
    eo.device = ds_device_from_name(device);
    eo.batch_invariant = batch_invariant;
    eo.enforce_eager = enforce_eager;
    eo.speculative_method = !strcmp(spec_method, "dspark")  ? DS_SPEC_DSPARK
                            : !strcmp(spec_method, "ngram") ? DS_SPEC_NGRAM
                                                            : DS_SPEC_NONE;
    eo.num_speculative_tokens = spec_k;
    eo.draft_model_dir = draft_dir;
    eo.draft_tap_relay = !strcmp(relay, "plain") ? DS_RELAY_PLAIN : DS_RELAY_PARTIAL_SUM;
    if (oracle_path) {
        if (oracle_load(oracle_path, &orc, &err)) {
            fprintf(stderr, "serve: --speculative-test-oracle: %s\n", err.msg);
            oracle_free(&orc);
            return 2;
        }
        if (eo.speculative_method == DS_SPEC_NONE) eo.speculative_method = DS_SPEC_NGRAM;
        eo.test.spec_drafts = oracle_drafts;
        eo.test.spec_ctx = &orc;
    }
    eo.enable_prefix_caching = prefix_caching;
    eo.state_checkpoint_interval_tokens = ckpt_interval;
    eo.kv_offload_disk_dir = off_disk_dir;
    eo.kv_offload_remote = off_remote;

    /* Tensor / pipeline parallelism: checked once here, then (unless mpirun started us) the job
     * is started under mpirun as a child; every rank comes back through this function. */
    int counts[DS_MAX_LAYERS];
    const char *wr = getenv("OMPI_COMM_WORLD_RANK");
    int rank0 = !wr || atoi(wr) == 0;
    if (ds_pp_check_split(model_dir, tp, pp, partition, counts, &err)) {
        if (rank0) fprintf(stderr, "serve: %s\n", err.msg);
        return 2;
    }
    if (tp * pp > 1 && !ds_comm_under_mpirun()) {
        int st = 1;
        if (ds_launch_mpirun_supervised(tp * pp, argc, argv, &st, &err)) {
            fprintf(stderr, "serve: %s\n", err.msg);
            return 1;
        }
        return st;
    }
    /* A rank that hangs must end the job: ranks wait at most this long for each other (an idle
     * head still sends a plan every second). */
    if (tp * pp > 1 && !getenv("DS_COMM_TIMEOUT_S")) setenv("DS_COMM_TIMEOUT_S", "60", 1);
    ds_comm *comm = NULL;
    if (ds_comm_init(tp, pp, &comm, &err)) {
        fprintf(stderr, "serve: %s\n", err.msg);
        return ds_comm_finish(comm, 1);
    }
    eo.comm = comm;
    eo.pp_layer_counts = counts;
    if (comm->rank != 0) {
        int st = serve_rank(&eo, comm);
        oracle_free(&orc);
        return st;
    }

    char *name = served ? strdup(served) : folder_name(model_dir);
    if (!name || !name[0] || pipe(g_sig_pipe)) {
        fprintf(stderr, "serve: could not set up (%s)\n", name ? strerror(errno) : "out of memory");
        free(name);
        return 1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL); /* a job's launcher stops it this way (transport/launch.h) */
    signal(SIGPIPE, SIG_IGN);      /* a client that hangs up is an error return, not a kill */

    ds_server_opts so;
    ds_server_opts_default(&so);
    so.host = host;
    so.port = port;
    so.api_key = api_key;
    so.served_model_name = name;
    ds_server *srv = NULL;
    ds_engine *e = NULL;
    int status = 1;
    if (ds_server_create(&so, &srv, &err)) {
        fprintf(stderr, "serve: %s\n", err.msg);
        goto out;
    }
    printf("[deltaserve] listening on %s:%d; loading %s (/health answers 503 until ready)\n", host,
           ds_server_port(srv), model_dir);
    fflush(stdout);
    if (ds_engine_create(&eo, &e, &err) || ds_engine_start(e, &err)) {
        fprintf(stderr, "serve: %s%s%s\n", comm->size > 1 ? comm->who : "",
                comm->size > 1 ? ": " : "", err.msg);
        goto out;
    }
    ds_server_attach(srv, e);
    g_loading = 0;
    print_ready(host, ds_server_port(srv), name, ds_engine_max_model_len(e), api_key);

    char sig = 0;
    while (read(g_sig_pipe[0], &sig, 1) < 0 && errno == EINTR) continue;
    printf("[deltaserve] %s: shutting down (running requests get up to %.1f s)\n",
           sig == SIGINT    ? "SIGINT"
           : sig == SIGUSR1 ? "SIGUSR1"
                            : "SIGTERM",
           grace);
    fflush(stdout);
    ds_server_quiesce(srv);
    ds_engine_stop(e, grace);
    /* every stream now has its last events; give slow readers a moment to take them */
    int left = ds_server_drain(srv, 2.0);
    if (left) printf("[deltaserve] closing %d connection(s) still writing\n", left);
    status = 0;
out:
    /* the server's connection threads may still use the engine: they are joined first */
    ds_server_free(srv);
    if (e) ds_engine_free(e);
    free(name);
    if (status == 0) printf("[deltaserve] stopped\n");
    oracle_free(&orc);
    return ds_comm_finish(comm, status);
}
