/* xfer.h — moving a prefilled prompt's state between two servers over UCX (docs/pd.md).
 *
 * The producer side is a store of opaque byte blobs, each filed under a 64-bit transfer id and
 * held until one consumer has pulled it or its time to live runs out, whichever comes first; a
 * thread of its own answers pulls through a UCX listener (TCP or shared memory here; RDMA on a
 * cluster, with the same calls). The consumer side is one blocking call that connects, asks for
 * an id and receives its bytes. What the bytes mean (the blocks, their hashes and checksums) is
 * the engine's business (engine/pd.c); this layer only moves them and says when it could not.
 *
 * Wire (UCX stream): the client sends {u32 magic "DSX1", u32 version 2, u64 id, u32 op, u32 0};
 * op 0 pulls: the server answers {u32 magic, u32 status, u64 length} and then length bytes;
 * op 1 releases: the server frees the blob and answers the header alone (length 0). status 0:
 * found; 1: no such id (never filed, already pulled, released, or expired). An id that is not
 * there yet is waited for up to wait_ms, so a call that races the producer's filing still finds
 * it. */
#ifndef DS_XFER_H
#define DS_XFER_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"

typedef struct ds_xfer_server ds_xfer_server;

typedef struct ds_xfer_stats {
    int held;           /* blobs waiting to be pulled */
    size_t held_bytes;  /* their bytes */
    uint64_t served;    /* blobs pulled (and freed) */
    uint64_t expired;   /* blobs freed unpulled when their time ran out */
    uint64_t not_found; /* pulls of an id that was not there */
    uint64_t errors;    /* pulls that broke off (peer gone, timeout) */
    uint64_t released;  /* blobs a consumer gave up (released) and so freed before their time */
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

/* Pulls id from host:port: *buf (malloc'd, the caller frees) [*len]. Fails with a message naming
 * the peer on a refused or broken connection, an unknown id, or when timeout_ms passes. Safe from
 * any number of threads at once (each call has its own UCX worker). */
int ds_xfer_pull(const char *host, int port, uint64_t id, int timeout_ms, void **buf, size_t *len,
                 ds_err *err);
/* Asks host:port to free id unpulled (a consumer that refused a transfer early, so that the
 * producer's other parts do not wait out their time to live). DS_OK when it was held and is now
 * freed; an error (naming the peer) when it was not held or the peer could not be reached. */
int ds_xfer_release(const char *host, int port, uint64_t id, int timeout_ms, ds_err *err);

#endif
