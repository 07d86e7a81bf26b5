/* gate.h — the server's front door: its listen socket, the connection table, and the deadlines
 * on receiving a request.
 *
 * libmicrohttpd 0.9.75 answers a malformed or oversized head with a fixed HTML page and has no
 * hook to replace it, and it has no deadline on a head or a body that trickles in (its timeout
 * is one of silence, which a client sending a byte every few seconds never hits). So the server
 * accepts connections itself: one thread polls the listen socket and every connection whose
 * first head is not whole yet, looks at the bytes with MSG_PEEK (nothing is consumed), checks the
 * head (reqhead.h; a chunked body too, as far as its first 32 KiB) and then either hands the
 * connection, bytes untouched, to libmicrohttpd with MHD_add_connection, or answers the refusal
 * in OpenAI error JSON itself (400, 414, 431, 505; 408 when the head is not whole by its
 * deadline) and closes the connection. A kept-alive connection's next head is checked the same
 * way in the connection's own thread (ds_gate_request_done) when it is still in the socket.
 *
 * The same thread enforces the deadlines on connections libmicrohttpd holds, which it tracks
 * through the phases the server reports (ds_gate_phase): a body must arrive within its deadline
 * of its head, and a kept-alive connection's next head (where it could not be peeked) within the
 * idle timeout plus the head deadline of its last response; past them it is sent 408 and shut
 * down.
 *
 * The table also bounds connections: in all (pending heads and libmicrohttpd's together) and per
 * client address; past either a new connection is closed at once. */
#ifndef DS_GATE_H
#define DS_GATE_H

#include <microhttpd.h>

#include "base/ds_base.h"

typedef struct ds_gate ds_gate;

typedef struct ds_gate_opts {
    const char *host;        /* address to bind ("::" etc. work) */
    int port;                /* 0: any free port */
    int max_connections;     /* table size: open connections at most, all phases */
    int max_per_ip;          /* per client address (0: no limit) */
    double header_timeout_s; /* a new connection's head must be whole this long after accept */
    double body_timeout_s;   /* a body must be whole this long after its head */
    double idle_timeout_s;   /* libmicrohttpd's timeout of silence (for keep-alive deadlines) */
} ds_gate_opts;

/* What a connection held by libmicrohttpd is doing, for its deadlines. */
typedef enum {
    DS_CONN_WAIT = 0, /* between requests (or its head being read): idle + header deadline */
    DS_CONN_BODY,     /* its head is read, its body being received: body deadline */
    DS_CONN_SERVING,  /* the request is whole and being answered: no deadline */
} ds_conn_phase;

/* Binds and listens; nothing is accepted before ds_gate_start. */
int ds_gate_create(const ds_gate_opts *o, ds_gate **out, ds_err *err);
int ds_gate_port(const ds_gate *g);
/* Starts accepting; connections with a whole, well-formed head go to mhd (started with
 * MHD_USE_NO_LISTEN_SOCKET, with ds_gate_notify as its MHD_OPTION_NOTIFY_CONNECTION). */
int ds_gate_start(ds_gate *g, struct MHD_Daemon *mhd, ds_err *err);
/* Stops accepting new connections (the listen socket stays open until ds_gate_free). */
void ds_gate_quiesce(ds_gate *g);
/* Open connections, pending heads included. */
int ds_gate_open(ds_gate *g);
/* Stops the thread, closes pending connections and the listen socket. Call before
 * MHD_stop_daemon; the table itself lives until ds_gate_destroy (after MHD_stop_daemon, whose
 * closing connections still report to it). */
void ds_gate_stop(ds_gate *g);
void ds_gate_destroy(ds_gate *g);

/* MHD_OPTION_NOTIFY_CONNECTION callback (cls: the gate). */
void ds_gate_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                    enum MHD_ConnectionNotificationCode toe);
/* The connection's request moved to phase p (now). */
void ds_gate_phase(struct MHD_Connection *c, ds_conn_phase p);
/* The connection's request ended (libmicrohttpd's completed callback); kept: it completed and
 * the connection stays open (HTTP/1.1, no "close" on either side); body_bytes: its body's bytes
 * as sent (Content-Length framing). When libmicrohttpd has read exactly the requests so far,
 * the next head is still whole in the socket: it is peeked and checked here (in the
 * connection's thread, which would wait for it anyway) like a first one, refused in JSON, cut
 * off with 408 past the head deadline. Otherwise (pipelined bytes already read, chunked bodies)
 * libmicrohttpd reads the connection's later heads unchecked. */
void ds_gate_request_done(struct MHD_Connection *c, int kept, unsigned long long body_bytes);
/* This connection's later heads cannot be peeked (a chunked body, a closing response). */
void ds_gate_untracked(struct MHD_Connection *c);

#endif
