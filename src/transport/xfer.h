/* xfer.h — moving a prefilled prompt's state between two servers over UCX (docs/pd.md).
 *
 * The producer side is a store of opaque byte blobs, each filed under a 64-bit transfer id and
 * held until its consumer has pulled it (one pull, or as many as the ranks of a consumer's job
 * that need it say) or its time to live runs out, whichever comes first; a
 * thread of its own answers pulls through a UCX listener (TCP or shared memory here; RDMA on a
 * cluster, with the same calls). The consumer side is a client: a blocking call that asks a
 * producer for an id and receives its bytes, over a connection the client keeps open for the
 * next call to the same producer, into a buffer it keeps warm for the next pull (opening a
 * connection and first-touching a fresh buffer were most of a pull's time: docs/pd.md). What
 * the bytes mean (the blocks, their hashes and checksums) is the engine's business
 * (engine/pd.c); this layer only moves them and says when it could not.
 *
 * Wire (UCX stream; a connection carries any number of requests, one at a time): the client
 * sends {u32 magic "DSX1", u32 version 4, u64 id, u32 op, u32 n}; op 2 (hello, the connection's
 * first request) is followed by n bytes, the UCX address of the client's data worker, and
 * answered with the header alone, status 0 when the server made an endpoint to it (the
 * connection's data path), else 1; op 0 pulls (n: how many pulls share the blob: 0 keeps it
 * held, 1 frees it once answered, k frees it once k pulls have been answered, the first pull's
 * k counting): the server answers {u32 magic, u32 status, u64
 * length} and then length bytes, on the stream (status 0) or as one tagged message (tag = id) on
 * the data path (status 3); op 1 releases: the server frees the blob and answers the header alone
 * (length 0). status 1: no such id (never filed, already pulled, released, or expired); 2: the
 * request's version is not the server's (the server then closes the connection). An id that is
 * not there yet is waited for up to wait_ms, so a call that races the producer's filing still
 * finds it. The data path exists because UCX gives an endpoint made from a socket address, or
 * one that watches for a dead peer, TCP lanes only on one host: the data path's endpoints are
 * made from worker addresses in error mode none (shared memory and CMA between processes here;
 * RDMA on a cluster), and the connection's stream endpoint watches for the dead peer for both. */
#ifndef DS_XFER_H
#define DS_XFER_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"

typedef struct ds_xfer_server ds_xfer_server;

typedef struct ds_xfer_stats {
    int held;           /* blobs waiting to be pulled */
    size_t held_bytes;  /* their bytes */
    uint64_t served;    /* pulls answered with a blob's bytes */
    uint64_t expired;   /* blobs freed unpulled when their time ran out */
    uint64_t not_found; /* pulls of an id that was not there */
    uint64_t errors;    /* pulls that broke off (peer gone, timeout), bad requests */
    uint64_t released;  /* blobs a consumer gave up (released) and so freed before their time */
    int conns;          /* consumers' connections open now */
} ds_xfer_stats;

/* Listens on host:port (port 0: the kernel picks one; ds_xfer_server_port says which) and starts
 * the serving thread. wait_ms: how long a pull waits for an id not yet filed. */
int ds_xfer_server_create(const char *host, int port, int wait_ms, ds_xfer_server **out,
                          ds_err *err);
int ds_xfer_server_port(const ds_xfer_server *s);
/* Files buf[len] (malloc'd; the store owns it from here, also on error) under id, to be freed
 * once pulled or after ttl_ms. Thread-safe. */
int ds_xfer_server_put(ds_xfer_server *s, uint64_t id, void *buf, size_t len, int ttl_ms,
                       ds_err *err);
void ds_xfer_server_stats(ds_xfer_server *s, ds_xfer_stats *st);
/* Tests: wait ms between a pull's header and its bytes (a producer that dies mid-transfer). */
void ds_xfer_server_test_stall(ds_xfer_server *s, int ms);
/* Stops the thread and frees every blob still held. */
void ds_xfer_server_free(ds_xfer_server *s);

/* ---- the consumer's side ---- */
typedef struct ds_xfer_client ds_xfer_client;

typedef struct ds_xfer_client_stats {
    uint64_t connects;   /* connections opened */
    uint64_t reuses;     /* requests sent over a connection kept from an earlier request */
    uint64_t retries;    /* requests resent on a new connection when a kept one had died */
    uint64_t buf_reuses; /* pulls received into a kept buffer (no fresh memory touched) */
    uint64_t data_path;  /* pulls whose bytes came on the connection's data path (below) */
    int idle_conns;      /* connections kept open now */
    size_t idle_bytes;   /* buffer bytes kept for the next pulls now */
} ds_xfer_client_stats;

int ds_xfer_client_create(ds_xfer_client **out, ds_err *err);
/* Closes the kept connections. Buffers still out stay valid until ds_xfer_buf_free. */
void ds_xfer_client_free(ds_xfer_client *c);
void ds_xfer_client_get_stats(ds_xfer_client *c, ds_xfer_client_stats *st);

/* Pulls id from host:port: *buf [*len] is the client's (give it back with ds_xfer_buf_free).
 * Fails with a message naming the peer on a refused or broken connection, an unknown id, or
 * when timeout_ms passes. Safe from any number of threads at once (each call holds a connection
 * of its own, with its own UCX worker, while it runs). A kept connection found dead (the
 * producer restarted) costs one retry on a new one, never a failed pull. */
int ds_xfer_pull(ds_xfer_client *c, const char *host, int port, uint64_t id, int timeout_ms,
                 void **buf, size_t *len, ds_err *err);
/* The same for a blob that `pulls` consumers (the ranks of one job that need the same part)
 * each pull once: the producer frees it once that many pulls have been answered (the first
 * pull's count is the one kept); 0 leaves it held (a look at it: a release or its time to live
 * frees it). A blob of more than max_len bytes (0: any) is refused before any memory is taken
 * for it: what a consumer pulls is named by its clients, so its size must be bounded.
 * ds_xfer_pull is pulls = 1, max_len 0. */
int ds_xfer_pull_shared(ds_xfer_client *c, const char *host, int port, uint64_t id, int pulls,
                        size_t max_len, int timeout_ms, void **buf, size_t *len, ds_err *err);
/* Gives a pulled buffer back to its client, which keeps it (up to a bound) for the next pulls.
 * NULL: nothing. */
void ds_xfer_buf_free(void *buf);
/* Asks host:port to free id unpulled (a consumer that refused a transfer early, so that the
 * producer's other parts do not wait out their time to live). DS_OK when it was held and is now
 * freed; an error (naming the peer) when it was not held or the peer could not be reached. */
int ds_xfer_release(ds_xfer_client *c, const char *host, int port, uint64_t id, int timeout_ms,
                    ds_err *err);

#endif
