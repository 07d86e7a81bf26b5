/* http.h — the OpenAI-compatible HTTP server (libmicrohttpd, one thread per connection).
 *
 * Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
 * GET /v1/models, GET /health, GET /metrics, POST /tokenize, POST /detokenize.
 *
 * Life cycle: ds_server_create listens at once and answers 503 (/health included) until
 * ds_server_attach hands it a started engine, so a load balancer can watch a large model load.
 * Shutdown is ds_server_quiesce (no new connections; /health 503), then ds_engine_stop (which
 * delivers every request's final events, ending streams), then ds_server_drain (lets those last
 * chunks reach the clients), then ds_server_free (closes connections, joins their threads), then
 * ds_engine_free.
 *
 * Edges (docs/usage.md, "The HTTP server's edges"): the server accepts connections itself and
 * checks each first request head before libmicrohttpd sees it, answering malformed ones in JSON
 * (gate.h, reqhead.h); framing is checked on the headers (edges.h), so is the API key; connections
 * in all and per address, idle time and the body bytes held at once are bounded (the options
 * below), 503 + Retry-After when full.
 *
 * A request's state is shared by its connection thread and the engine thread and freed by
 * whichever lets go last (a reference count), so a client that disconnects mid-stream aborts its
 * request without either side touching freed memory. */
#ifndef DS_HTTP_H
#define DS_HTTP_H

#include <stddef.h>

#include "base/ds_base.h"
#include "engine/engine.h"

typedef struct ds_server ds_server;

typedef struct ds_server_opts {
    const char *host;               /* address to bind (default "127.0.0.1"); "::" etc. work */
    int port;                       /* 0: any free port (see ds_server_port) */
    const char *api_key;            /* non-NULL: /v1/... require "Authorization: Bearer KEY" */
    const char *served_model_name;  /* the name clients must send as "model" */
    size_t max_body_bytes;          /* larger bodies get 413 (default 16 MiB) */
    double retry_after_s;           /* Retry-After of a 503 when the queue is full (default 1) */
    int max_connections;            /* open connections; past it requests get 503 + Retry-After
                                       and, 64 further on, connections are reset (default 2048) */
    int max_connections_per_ip;     /* per client address; further ones are closed at once
                                       (default 256; 0: no limit) */
    double idle_timeout_s;          /* a connection that sends nothing this long (a half-sent
                                       request, an idle keep-alive) is closed (default 60) */
    size_t max_inflight_body_bytes; /* request bodies buffered at once over all requests; past
                                      it 503 + Retry-After (default 64 MiB) */
    double header_timeout_s;        /* a request head must arrive whole this long after the
                                       connection (or, kept alive, after idle timeout + this
                                       after the last response); past it 408 (default 10) */
    double body_timeout_s;          /* a body must arrive whole this long after its head; past
                                       it 408 (default 60) */
} ds_server_opts;

void ds_server_opts_default(ds_server_opts *o);

/* Binds and starts serving (503 until attached). */
int ds_server_create(const ds_server_opts *o, ds_server **out, ds_err *err);
/* The bound port (useful with port 0). */
int ds_server_port(const ds_server *s);
/* Starts serving requests with a started engine. The engine must outlive the server's use of it:
 * free the server before the engine. */
void ds_server_attach(ds_server *s, ds_engine *e);
/* Stops accepting connections; requests still arriving on open connections get 503. */
void ds_server_quiesce(ds_server *s);
/* Waits up to timeout_s for every generation request to finish writing its response (after
 * ds_engine_stop they all have their final events). Returns how many were still writing. */
int ds_server_drain(ds_server *s, double timeout_s);
/* Closes every connection and joins their threads. Call after ds_engine_stop, so that requests
 * waiting on the engine have had their final events. */
void ds_server_free(ds_server *s);

#endif
