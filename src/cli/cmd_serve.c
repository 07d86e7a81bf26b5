/* cmd_serve.c — `deltaserve serve`: load a model into the engine and serve the OpenAI API.
 *
 * The HTTP server listens before the model loads (so /health can say 503 while it does), is
 * attached to the engine once the engine runs, and shuts down on SIGINT/SIGTERM in the order
 * http.h asks: stop accepting, let the engine finish or abort what runs (a grace period), join the
 * connections, free the engine. */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/args.h"
#include "cli/commands.h"
#include "cli/engine_flags.h"
#include "cli/ranks.h"
#include "engine/engine.h"
#include "server/http.h"
#include "transport/comm.h"

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

/* serve's flags: the engine's (engine_flags.h) and the HTTP server's, the scheduler's and the
 * caches'. */
typedef struct serve_flags {
    ds_engine_flags f;
    const char *host, *api_key, *served;
    const char *ckpt_mem, *off_ram, *off_disk_bytes, *inflight;
    int port, max_conns, max_conns_ip;
    double idle_timeout;
    double header_timeout, body_timeout;
    int64_t seed;
    double grace;
} serve_flags;

enum { SERVE_OWN_FLAGS = 23 }; /* entries serve_table adds to the engine's */

/* Writes serve's flags into out[DS_ENGINE_FLAGS_MAX + SERVE_OWN_FLAGS]; returns how many. */
static int serve_table(serve_flags *s, ds_arg *out) {
    ds_engine_opts *eo = &s->f.eo;
    int n = ds_engine_flags_table(&s->f, out);
    ds_arg own[SERVE_OWN_FLAGS] = {
        DS_OPT("host", NULL, DS_ARG_STRING, &s->host, "ADDR", "address to bind"),
        DS_OPT("port", NULL, DS_ARG_INT, &s->port, "N", "port to listen on (0: any free port)"),
        DS_OPT("api-key", NULL, DS_ARG_STRING, &s->api_key, "KEY",
               "require 'Authorization: Bearer KEY' on /v1/* (default: open)"),
        DS_OPT("served-model-name", NULL, DS_ARG_STRING, &s->served, "NAME",
               "model name clients send (default: the model folder's name)"),
        DS_OPT("max-num-seqs", NULL, DS_ARG_INT, &eo->max_num_seqs, "N",
               "running sequences at most"),
        DS_OPT("max-num-batched-tokens", NULL, DS_ARG_INT, &eo->max_num_batched_tokens, "N",
               "tokens per engine step at most"),
        DS_OPT("block-size", NULL, DS_ARG_INT, &eo->block_size, "N", "tokens per MLA page"),
        DS_OPT("max-queue", NULL, DS_ARG_INT, &eo->max_queue, "N",
               "waiting requests beyond which new ones get 503"),
        DS_OPT("seed", NULL, DS_ARG_I64, &s->seed, "S", "base seed for requests without one"),
        DS_OPT("enable-prefix-caching", NULL, DS_ARG_BOOL, &eo->enable_prefix_caching, NULL,
               "reuse cached MLA pages and KDA checkpoints of shared prompt prefixes"),
        DS_OPT("state-checkpoint-interval-tokens", NULL, DS_ARG_INT,
               &eo->state_checkpoint_interval_tokens, "N",
               "KDA checkpoint spacing in tokens, snapped to --block-size; prompts are cut into "
               "steps of this size (capped by --max-num-batched-tokens), caching on or off"),
        DS_OPT("state-checkpoint-memory", NULL, DS_ARG_STRING, &s->ckpt_mem, "BYTES",
               "memory for KDA checkpoint slots, e.g. 64M"),
        DS_OPT("kv-offload-ram", NULL, DS_ARG_STRING, &s->off_ram, "BYTES",
               "host-RAM offload tier size (default: off)"),
        DS_OPT("kv-offload-disk-dir", NULL, DS_ARG_STRING, &eo->kv_offload_disk_dir, "DIR",
               "local-disk offload tier folder (default: off)"),
        DS_OPT("kv-offload-disk-bytes", NULL, DS_ARG_STRING, &s->off_disk_bytes, "BYTES",
               "disk tier size limit (default: unlimited)"),
        DS_OPT("kv-offload-remote", NULL, DS_ARG_STRING, &eo->kv_offload_remote, "URL",
               "remote offload tier, redis://host:port (default: off)"),
        DS_OPT("max-connections", NULL, DS_ARG_INT, &s->max_conns, "N",
               "open connections at most; past it requests get 503 + Retry-After"),
        DS_OPT("max-connections-per-ip", NULL, DS_ARG_INT, &s->max_conns_ip, "N",
               "open connections per client address (0: no limit); more are closed at once"),
        DS_OPT("http-idle-timeout", NULL, DS_ARG_FLOAT, &s->idle_timeout, "SEC",
               "close a connection that sends nothing this long (half-sent requests, keep-alive)"),
        DS_OPT("http-header-timeout", NULL, DS_ARG_FLOAT, &s->header_timeout, "SEC",
               "a request head must arrive whole this long after connecting; past it 408"),
        DS_OPT("http-body-timeout", NULL, DS_ARG_FLOAT, &s->body_timeout, "SEC",
               "a request body must arrive whole this long after its head; past it 408"),
        DS_OPT("max-inflight-body-bytes", NULL, DS_ARG_STRING, &s->inflight, "BYTES",
               "request bodies buffered at once, over all requests; past it 503 + Retry-After "
               "(default: 64M)"),
        DS_OPT("shutdown-timeout", NULL, DS_ARG_FLOAT, &s->grace, "SEC",
               "on SIGINT/SIGTERM, let running requests finish this long, then abort them"),
    };
    memcpy(out + n, own, sizeof own);
    return n + SERVE_OWN_FLAGS;
}

/* Checks serve's own flags and writes them into the engine's options; errors name the flag. */
static int serve_apply(serve_flags *s, ds_err *err) {
    ds_engine_opts *eo = &s->f.eo;
    const struct {
        const char *flag;
        int value, min;
    } ints[] = {{"--port", s->port, 0},
                {"--max-num-seqs", eo->max_num_seqs, 1},
                {"--max-num-batched-tokens", eo->max_num_batched_tokens, 1},
                {"--block-size", eo->block_size, 1},
                {"--max-queue", eo->max_queue, 1},
                {"--max-connections", s->max_conns, 1},
                {"--max-connections-per-ip", s->max_conns_ip, 0},
                {"--state-checkpoint-interval-tokens", eo->state_checkpoint_interval_tokens, 1}};
    for (size_t i = 0; i < DS_ARRAY_LEN(ints); i++)
        if (ints[i].value < ints[i].min)
            return ds_errf(err, "%s: expected at least %d, got %d", ints[i].flag, ints[i].min,
                           ints[i].value);
    if (s->port > 65535) return ds_errf(err, "--port: expected at most 65535, got %d", s->port);
    if (s->idle_timeout <= 0)
        return ds_errf(err, "--http-idle-timeout: expected > 0, got %g", s->idle_timeout);
    if (s->header_timeout <= 0)
        return ds_errf(err, "--http-header-timeout: expected > 0, got %g", s->header_timeout);
    if (s->body_timeout <= 0)
        return ds_errf(err, "--http-body-timeout: expected > 0, got %g", s->body_timeout);
    if (s->grace < 0) return ds_errf(err, "--shutdown-timeout: expected >= 0, got %g", s->grace);
    const struct {
        const char *flag, *value;
        size_t *dest;
    } sizes[] = {{"--state-checkpoint-memory", s->ckpt_mem, &eo->state_checkpoint_memory},
                 {"--kv-offload-ram", s->off_ram, &eo->kv_offload_ram_bytes},
                 {"--kv-offload-disk-bytes", s->off_disk_bytes, &eo->kv_offload_disk_bytes}};
    for (size_t i = 0; i < DS_ARRAY_LEN(sizes); i++)
        if (sizes[i].value && ds_parse_bytes(sizes[i].value, sizes[i].dest, err))
            return ds_err_prefix(err, "%s", sizes[i].flag);
    eo->seed = (uint64_t)s->seed;
    return DS_OK;
}

/* Installs the shutdown signals: SIGINT/SIGTERM/SIGUSR1 write to g_sig_pipe. */
static void serve_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGUSR1, &sa, NULL); /* a job's launcher stops it this way (transport/launch.h) */
    signal(SIGPIPE, SIG_IGN);      /* a client that hangs up is an error return, not a kill */
}

/* Waits for a shutdown signal, then stops in http.h's order. */
static void serve_until_signal(ds_server *srv, ds_engine *e, double grace) {
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
}

/* The head rank: the HTTP server, the engine, and the orderly shutdown. Returns the status. */
static int serve_head(serve_flags *s) {
    const ds_engine_opts *eo = &s->f.eo;
    ds_comm *comm = eo->comm;
    ds_err err = {{0}};
    char *name = s->served ? strdup(s->served) : folder_name(eo->model_dir);
    if (!name || !name[0] || pipe(g_sig_pipe)) {
        fprintf(stderr, "serve: could not set up (%s)\n", name ? strerror(errno) : "out of memory");
        free(name);
        return 1;
    }
    serve_signals();
    ds_server_opts so;
    ds_server_opts_default(&so);
    so.host = s->host;
    so.port = s->port;
    so.api_key = s->api_key;
    so.served_model_name = name;
    so.max_connections = s->max_conns;
    so.max_connections_per_ip = s->max_conns_ip;
    so.idle_timeout_s = s->idle_timeout;
    so.header_timeout_s = s->header_timeout;
    so.body_timeout_s = s->body_timeout;
    if (s->inflight && ds_parse_bytes(s->inflight, &so.max_inflight_body_bytes, &err)) {
        fprintf(stderr, "serve: --max-inflight-body-bytes: %s\n", err.msg);
        free(name);
        return 2;
    }
    ds_server *srv = NULL;
    ds_engine *e = NULL;
    int status = 1;
    if (ds_server_create(&so, &srv, &err)) {
        fprintf(stderr, "serve: %s\n", err.msg);
        goto out;
    }
    printf("[deltaserve] listening on %s:%d; loading %s (/health answers 503 until ready)\n",
           s->host, ds_server_port(srv), eo->model_dir);
    fflush(stdout);
    if (ds_engine_create(eo, &e, &err) || ds_engine_start(e, &err)) {
        fprintf(stderr, "serve: %s%s%s\n", comm->size > 1 ? comm->who : "",
                comm->size > 1 ? ": " : "", err.msg);
        goto out;
    }
    ds_server_attach(srv, e);
    g_loading = 0;
    print_ready(s->host, ds_server_port(srv), name, ds_engine_max_model_len(e), s->api_key);
    serve_until_signal(srv, e, s->grace);
    status = 0;
out:
    /* the server's connection threads may still use the engine: they are joined first */
    ds_server_free(srv);
    if (e) ds_engine_free(e);
    free(name);
    if (status == 0) printf("[deltaserve] stopped\n");
    return status;
}

int ds_cmd_serve(int argc, char **argv) {
    static serve_flags s; /* its test hooks' state outlives the engine */
    memset(&s, 0, sizeof s);
    if (ds_engine_flags_init(&s.f, "serve")) return 2;
    s.host = "127.0.0.1";
    s.port = 8000;
    s.grace = 5.0;
    ds_server_opts dso; /* the HTTP limits' defaults */
    ds_server_opts_default(&dso);
    s.max_conns = dso.max_connections;
    s.max_conns_ip = dso.max_connections_per_ip;
    s.idle_timeout = dso.idle_timeout_s;
    s.header_timeout = dso.header_timeout_s;
    s.body_timeout = dso.body_timeout_s;
    s.seed = (int64_t)s.f.eo.seed;
    ds_arg opts[DS_ENGINE_FLAGS_MAX + SERVE_OWN_FLAGS];
    ds_args a = {"deltaserve serve",
                 "Serve an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions\n"
                 "(streaming SSE), /v1/models, /health, /metrics, /tokenize, /detokenize.",
                 opts, serve_table(&s, opts)};
    int rc;
    if (ds_args_parse_cli(&a, argc, argv, &rc)) return rc;
    ds_err err = {{0}};
    if (ds_engine_flags_apply(&s.f, &a, &err) || serve_apply(&s, &err)) {
        if (!ds_rank_quiet()) fprintf(stderr, "serve: %s\n", err.msg);
        ds_engine_flags_free(&s.f);
        return 2;
    }
    /* Tensor / pipeline parallelism: checked once here, then (unless mpirun started us) the job
     * is started under mpirun as a child; every rank comes back through this function. */
    if ((rc = ds_engine_flags_job(&s.f, 1, argc, argv)) >= 0) {
        ds_engine_flags_free(&s.f);
        return rc;
    }
    ds_comm *comm = s.f.eo.comm;
    if (comm->rank != 0) return ds_engine_flags_run_rank(&s.f);
    int status = serve_head(&s);
    ds_engine_flags_free(&s.f);
    return ds_comm_finish(comm, status);
}
