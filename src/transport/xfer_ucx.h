/* xfer_ucx.h — what the transfer server (xfer.c) and client (xfer_client.c) share: the wire's
 * messages and the UCX helpers both sides wait, send, receive and close with. Internal to
 * src/transport. */
#ifndef DS_XFER_UCX_H
#define DS_XFER_UCX_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "base/ds_base.h"

#define XFER_MAGIC   0x31585344u /* "DSX1" little-endian */
#define XFER_VERSION 4u
/* ST_FOUND_TAGGED: found, and the bytes come on the connection's data path (tagged with the id)
 * rather than the stream */
enum { ST_FOUND = 0, ST_NOT_FOUND = 1, ST_VERSION = 2, ST_FOUND_TAGGED = 3 };
/* release: free the blob, send nothing back but the header; hello: the request's pad is the
 * length of the client's data worker's address, which follows it; pull: pad is how many pulls
 * share the blob (0: keep it, 1: this one alone, n: freed once n pulls have been answered) */
enum { OP_PULL = 0, OP_RELEASE = 1, OP_HELLO = 2 };
#define HELLO_MAX_ADDR 65536

typedef struct xreq {
    uint32_t magic, version;
    uint64_t id;
    uint32_t op, pad;
} xreq;
typedef struct xhdr {
    uint32_t magic, status;
    uint64_t len;
} xhdr;

typedef struct ep_state {
    volatile int failed; /* the endpoint's error handler ran (peer gone), or an operation failed */
    /* operations that a cancel did not end (UCX cannot cancel a stream send): the forced close
     * ends them; until then their buffers must live, so hold is freed only after that */
    ucs_status_ptr_t parked[4];
    int n_parked;
    void *hold;                /* a buffer a parked operation may still touch (close_ep frees) */
    void (*hold_free)(void *); /* how: free (the server's blobs), ds_xfer_buf_free (a pull's) */
} ep_state;

/* A nap between progress calls that found nothing to do. */
void xfer_sleep_us(long us);

/* An endpoint's error handler (arg: its ep_state): marks the peer gone. */
void xfer_on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status);

/* Gives up the operation r on worker w (es marked failed): cancelled, given half a second to
 * end, and parked in es for close_ep's forced close when it does not (UCX cannot cancel a stream
 * send), so that a buffer it may still touch outlives it. */
void xfer_abandon(ucp_worker_h w, ucs_status_ptr_t r, ep_state *es);

/* Waits for a non-blocking operation's request (NULL: it completed at once) on worker w.
 * Returns DS_OK, or DS_ERR when it failed, the endpoint failed, or the deadline passed. The
 * operation is then cancelled; one that does not end within half a second (a stream send to a
 * dead peer) is parked in es for close_ep's forced close, never waited on forever: that spin
 * wedged the producer's serving thread when a consumer died during a pull. w2 (may be NULL) is
 * progressed alongside and watch's failure (may be NULL) ends the wait too: a data-path
 * operation watches its connection, whose endpoint is the one that hears of a dead peer. */
int xfer_wait_op_on(ucp_worker_h w, ucp_worker_h w2, const ep_state *watch, ucs_status_ptr_t r,
                    ep_state *es, double deadline);

/* xfer_wait_op_on with w alone. */
int xfer_wait_op(ucp_worker_h w, ucs_status_ptr_t r, ep_state *es, double deadline);

/* buf[len] sent whole on ep's stream, or received whole from it, by the deadline (as
 * xfer_wait_op). */
int xfer_send_all(ucp_worker_h w, ucp_ep_h ep, const void *buf, size_t len, ep_state *es,
                  double deadline);
int xfer_recv_all(ucp_worker_h w, ucp_ep_h ep, void *buf, size_t len, ep_state *es,
                  double deadline);

/* Buffers that operations still running after their endpoint's close may touch (a rendezvous
 * send to a peer that died can outlive even a forced close), each freed once its operations have
 * ended (xfer_graves_reap) or their worker is destroyed (xfer_graves_bury): not leaked, and never
 * freed under a running operation. */
typedef struct xfer_grave {
    ucs_status_ptr_t reqs[4]; /* the operations still running (their requests not freed yet) */
    int n;
    void *hold;
    void (*hold_free)(void *);
    struct xfer_grave *next;
} xfer_grave;

/* Waits (until deadline) for es's parked operations on w, frees them, then frees es->hold once
 * nothing can touch it; what is still running then goes on *graves with its buffer. */
void xfer_settle(ucp_worker_h w, ep_state *es, double deadline, xfer_grave **graves);

/* Closes ep, flushing what was sent (force when the peer is already gone or an operation failed:
 * the forced close completes parked operations), then settles es. */
void xfer_close_ep(ucp_worker_h w, ucp_ep_h ep, ep_state *es, xfer_grave **graves);

/* Frees the buffers of *graves whose operations have ended (their worker progressed by the
 * caller). */
void xfer_graves_reap(xfer_grave **graves);
/* After the graves' worker was destroyed (nothing of it runs any more): frees every buffer. */
void xfer_graves_bury(xfer_grave **graves);

/* features: UCP_FEATURE_STREAM (connections, with wakeups on the server's) or UCP_FEATURE_TAG
 * (the data path). */
int xfer_make_context(uint64_t features, ucp_context_h *ctx, ds_err *err);

/* mode: SINGLE for the serving thread's worker; SERIALIZED for a client connection's, which one
 * thread at a time uses, not always the same one. */
int xfer_make_worker(ucp_context_h ctx, ucs_thread_mode_t mode, ucp_worker_h *w, ds_err *err);

/* host:port -> an IPv4 socket address (names resolved). */
int xfer_resolve(const char *host, int port, struct sockaddr_in *sa, ds_err *err);

#endif
