/* edges.h — the HTTP server's checks at its edges: a request's message framing (RFC 9112 §6),
 * made on its headers before any body byte is read, the API key, and the process's open-file
 * limit.
 *
 * libmicrohttpd 0.9.75 takes the first of several Content-Length headers (the rest of the body
 * would then be read as the next request: request smuggling behind a proxy that picks another)
 * and reads a body of an unknown transfer coding until the client closes (a hang). The server
 * refuses both here, at once, and closes the connection. */
#ifndef DS_EDGES_H
#define DS_EDGES_H

#include <microhttpd.h>

#include "server/openai.h"

/* DS_OK when the framing is one the server reads; else DS_ERR with *e the answer: 400 for
 * differing Content-Length headers, Content-Length together with Transfer-Encoding, or "chunked"
 * not the last coding or repeated; 501 for any other coding ("gzip", "identity", ...).
 * Repeated Content-Length headers with one value are accepted as one (RFC 9112 §6.3 allows it). */
int ds_http_check_framing(struct MHD_Connection *c, ds_oai_error *e);

/* Each connection is a socket: lifts the soft open-file limit toward `want` (up to the hard
 * one), so the server's connection limit, not the default 1024 files, is what binds. */
void ds_http_raise_fd_limit(int want);

/* 1 when the request carries "Authorization: Bearer KEY" with this key (compared in constant
 * time, so response times do not tell how much of a guess was right). */
int ds_http_authorized(struct MHD_Connection *c, const char *key);

#endif
