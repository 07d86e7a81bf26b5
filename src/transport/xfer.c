/* xfer.c — the blob store and its UCX server (xfer.h; the client is xfer_client.c).
 *
 * UCX's client-server mode: the server's worker owns a listener on a socket address; a new
 * connection arrives as a connection request, which the serving thread turns into an endpoint
 * that stays open for the connection's next requests (a receive for the next request is posted
 * on each); requests are answered with the stream API (ucp_stream_send_nbx /
 * ucp_stream_recv_nbx). Such an endpoint gets TCP lanes only on one host, so each connection
 * also has a data path: the client's hello names a worker of its own, the server makes an
 * endpoint to it from a second worker (a context without wakeups, error mode none: UCX then
 * picks shared memory and CMA here, RDMA on a cluster), and a pull's bytes go there as one tagged
 * message while the stream endpoint watches for a dead peer. The serving thread sleeps on the
 * stream worker's event fd between requests, so an idle producer costs nothing; it serves one
 * pull at a time (a pull is one contiguous send). */
#include "transport/xfer.h"
#include "transport/xfer_ucx.h"

#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct blob {
    uint64_t id;
    void *buf; /* [len] bytes, owned */
    size_t len;
    double expires; /* ds_now() seconds */
    uint32_t left;  /* pulls still to be answered before it goes (0: not counted yet) */
    struct blob *next;
} blob;

typedef struct pending_conn {
    ucp_conn_request_h req;
    struct pending_conn *next;
} pending_conn;

struct ds_xfer_server {
    ucp_context_h ctx;
    ucp_worker_h worker;
    /* the data path: a context without wakeups and a worker whose endpoints (made from the
     * consumers' worker addresses, error mode none) may use shared memory and CMA, which UCX
     * gives neither a waking context nor a peer-watching endpoint */
    ucp_context_h dctx;
    ucp_worker_h dworker;
    ucp_listener_h listener;
    int port, wait_ms, efd;
    int stall_ms; /* tests: a pause between a pull's header and its bytes */
    pthread_t thread;
    int started;
    volatile int stop;
    pthread_mutex_t mu; /* guards blobs and st */
    blob *blobs;
    ds_xfer_stats st;
    pending_conn *pending; /* serving thread only (the listener callback runs inside progress) */
    xfer_grave *graves;    /* serving thread only: sends to dead consumers that still run */
    struct sconn *live;    /* serving thread only: open connections */
};

/* ---- the server ------------------------------------------------------------------------------*/

static void on_conn(ucp_conn_request_h req, void *arg) {
    ds_xfer_server *s = arg;
    pending_conn *c = malloc(sizeof *c);
    if (!c) {
        ucp_listener_reject(s->listener, req);
        return;
    }
    c->req = req;
    c->next = s->pending;
    s->pending = c;
}

/* Takes the blob at *p out of the store (s->mu held). */
static void store_remove(ds_xfer_server *s, blob **p) {
    blob *b = *p;
    *p = b->next;
    s->st.held--;
    s->st.held_bytes -= b->len;
}

/* The blob filed under id (NULL when absent), freeing expired ones. A pull's `pulls` (xfer.h)
 * says whether this answer is its last: then (and for a release) it is taken out of the store
 * (*gone set), else it stays there for the pulls still to come. Only the serving thread frees
 * blobs, so one left in the store stays valid while this thread sends it. */
static blob *take_blob(ds_xfer_server *s, uint64_t id, int release, uint32_t pulls, int *gone) {
    blob *found = NULL;
    double now = ds_now();
    *gone = 0;
    pthread_mutex_lock(&s->mu);
    for (blob **p = &s->blobs; *p;) {
        blob *b = *p;
        if (!found && b->id == id) {
            found = b;
            if (!release && pulls != 1) {
                if (!b->left) b->left = pulls; /* the first counted pull says how many */
                if (pulls == 0 || b->left > 1) {
                    if (pulls) b->left--;
                    p = &b->next;
                    continue;
                }
            }
            *gone = 1;
            store_remove(s, p);
        } else if (b->expires < now) {
            store_remove(s, p);
            s->st.expired++;
            free(b->buf);
            free(b);
        } else
            p = &b->next;
    }
    pthread_mutex_unlock(&s->mu);
    return found;
}

/* Takes b (a blob take_blob left in the store) out of it. */
static void unlink_blob(ds_xfer_server *s, blob *b) {
    pthread_mutex_lock(&s->mu);
    for (blob **p = &s->blobs; *p; p = &(*p)->next)
        if (*p == b) {
            store_remove(s, p);
            break;
        }
    pthread_mutex_unlock(&s->mu);
}

static void count(ds_xfer_server *s, uint64_t *field) {
    pthread_mutex_lock(&s->mu);
    (*field)++;
    pthread_mutex_unlock(&s->mu);
}

/* A consumer's open connection on the serving thread: its endpoint and the receive posted for
 * its next request. */
typedef struct sconn {
    ucp_ep_h ep;
    ep_state es;  /* the endpoint's error handler writes here: the struct stays put */
    ucp_ep_h dep; /* the data path to the client's data worker (NULL: bytes on the stream) */
    ep_state des;
    xreq rq;             /* the next request, received into here */
    size_t got;          /* bytes of it (UCX's out-parameter) */
    ucs_status_ptr_t rr; /* the posted receive (NULL: none in flight) */
    int have;            /* rq holds a whole request, not answered yet */
    struct sconn *next;
} sconn;

/* Posts the receive of c's next request (c->have when it was there already). */
static void post_request_recv(sconn *c) {
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_STREAM_RECV_FLAG_WAITALL};
    ucs_status_ptr_t r = ucp_stream_recv_nbx(c->ep, &c->rq, sizeof c->rq, &c->got, &p);
    if (r == NULL)
        c->have = 1;
    else if (UCS_PTR_IS_ERR(r))
        c->es.failed = 1;
    else
        c->rr = r;
}

/* Has c's posted receive ended? Sets c->have (a request arrived) or c->es.failed. */
static void check_request_recv(sconn *c) {
    if (!c->rr) return;
    ucs_status_t st = ucp_request_check_status(c->rr);
    if (st == UCS_INPROGRESS) return;
    ucp_request_free(c->rr);
    c->rr = NULL;
    if (st == UCS_OK)
        c->have = 1;
    else
        c->es.failed = 1;
}

/* A client's hello: its data worker's address (n bytes) follows. The connection's data path is
 * an endpoint to it from the server's data worker; the answer says whether the connection has
 * one (ST_FOUND) or not (ST_NOT_FOUND: it could not be made, and the bytes come on the stream),
 * which is what decides how this connection's pulls are answered. */
static void serve_hello(ds_xfer_server *s, sconn *c, uint32_t n, double deadline) {
    void *addr = n && n <= HELLO_MAX_ADDR ? malloc(n) : NULL;
    if (!addr || xfer_recv_all(s->worker, c->ep, addr, n, &c->es, deadline)) {
        free(addr);
        count(s, &s->st.errors);
        c->es.failed = 1; /* a hello without its address: the framing is lost */
        return;
    }
    if (!c->dep) {
        ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                              .address = addr,
                              .err_mode = UCP_ERR_HANDLING_MODE_NONE};
        if (ucp_ep_create(s->dworker, &ep, &c->dep) != UCS_OK) c->dep = NULL;
    }
    free(addr);
    xhdr h = {XFER_MAGIC, c->dep ? ST_FOUND : ST_NOT_FOUND, 0};
    xfer_send_all(s->worker, c->ep, &h, sizeof h, &c->es, deadline);
}

/* Answers c's request (c->rq): the blob (or not-found), or a release. A failure marks c->es. */
static void serve_request(ds_xfer_server *s, sconn *c) {
    xreq rq = c->rq;
    c->have = 0;
    double deadline = ds_now() + 60.0;
    if (rq.magic != XFER_MAGIC || rq.version != XFER_VERSION) {
        count(s, &s->st.errors);
        if (rq.magic == XFER_MAGIC) { /* a peer of another version: say so before closing */
            xhdr h = {XFER_MAGIC, ST_VERSION, 0};
            xfer_send_all(s->worker, c->ep, &h, sizeof h, &c->es, deadline);
        }
        c->es.failed = 1; /* the stream's framing cannot be trusted from here */
        return;
    }
    if (rq.op == OP_HELLO) {
        serve_hello(s, c, rq.pad, deadline);
        return;
    }
    const int release = rq.op == OP_RELEASE;
    int gone;
    blob *b = take_blob(s, rq.id, release, rq.pad, &gone);
    for (double until = ds_now() + s->wait_ms / 1e3; !b && ds_now() < until && !c->es.failed;) {
        ucp_worker_progress(s->worker);
        xfer_sleep_us(1000);
        b = take_blob(s, rq.id, release, rq.pad, &gone);
    }
    /* a release: the consumer gave it up, so it is freed now (not at its timeout), counted at
     * once, and answered with the header alone */
    const int released = b && release;
    if (released) {
        free(b->buf);
        free(b);
        b = NULL;
        count(s, &s->st.released);
    }
    const int tagged = b && b->len && c->dep;
    xhdr h = {XFER_MAGIC, b || released ? (tagged ? ST_FOUND_TAGGED : ST_FOUND) : ST_NOT_FOUND,
              b ? b->len : 0};
    int rc = xfer_send_all(s->worker, c->ep, &h, sizeof h, &c->es, deadline);
    for (double until = ds_now() + s->stall_ms / 1e3; !rc && !released && ds_now() < until;) {
        ucp_worker_progress(s->worker);
        xfer_sleep_us(1000);
    }
    /* a send's completion means UCX is done with the buffer (the connection stays open, so what
     * is in flight still arrives): the blob can go as soon as its send has completed */
    if (!rc && tagged) {
        ucp_request_param_t p = {.op_attr_mask = 0};
        rc =
            xfer_wait_op_on(s->dworker, s->worker, &c->es,
                            ucp_tag_send_nbx(c->dep, b->buf, b->len, rq.id, &p), &c->des, deadline);
        if (rc) c->es.failed = 1; /* the connection goes with its data path */
    } else if (!rc && b && b->len)
        rc = xfer_send_all(s->worker, c->ep, b->buf, b->len, &c->es, deadline);
    if (!released) count(s, rc ? &s->st.errors : b ? &s->st.served : &s->st.not_found);
    if (b && rc && !gone) { /* a failed send takes a shared blob with it (its job recomputes) */
        unlink_blob(s, b);
        gone = 1;
    }
    if (b && gone) {
        if (rc) { /* a parked send may still read it until the forced close */
            ep_state *es = tagged ? &c->des : &c->es;
            es->hold = b->buf;
            es->hold_free = free;
        } else
            free(b->buf);
        free(b);
    }
}

static void conn_close(ds_xfer_server *s, sconn *c) {
    if (c->rr) { /* the receive of a next request that will not come */
        xfer_abandon(s->worker, c->rr, &c->es);
        c->rr = NULL;
    }
    if (c->dep) { /* force: its peer may be gone, and error mode none would not say so */
        c->des.failed = 1;
        xfer_close_ep(s->dworker, c->dep, &c->des, &s->graves);
    }
    xfer_close_ep(s->worker, c->ep, &c->es, &s->graves);
    free(c);
    pthread_mutex_lock(&s->mu);
    s->st.conns--;
    pthread_mutex_unlock(&s->mu);
}

/* A new consumer connection: an endpoint, and the receive of its first request. */
static void conn_accept(ds_xfer_server *s, ucp_conn_request_h creq) {
    sconn *c = calloc(1, sizeof *c);
    if (!c) {
        ucp_listener_reject(s->listener, creq);
        count(s, &s->st.errors);
        return;
    }
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .conn_request = creq,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = xfer_on_ep_error, .arg = &c->es}};
    if (ucp_ep_create(s->worker, &ep, &c->ep) != UCS_OK) {
        free(c);
        count(s, &s->st.errors);
        return;
    }
    pthread_mutex_lock(&s->mu);
    s->st.conns++;
    pthread_mutex_unlock(&s->mu);
    post_request_recv(c);
    c->next = s->live;
    s->live = c;
}

/* One pass over the open connections: answers every request that has arrived, closes those
 * whose peer has gone. Returns whether anything was answered (the loop then looks again before
 * it sleeps). */
static int serve_conns(ds_xfer_server *s) {
    int busy = 0;
    for (sconn **p = &s->live; *p;) {
        sconn *c = *p;
        check_request_recv(c);
        if (c->have && !c->es.failed) {
            serve_request(s, c);
            if (!c->es.failed) post_request_recv(c);
            busy = 1;
        }
        if (c->es.failed) { /* the peer closed or died, or the stream broke */
            *p = c->next;
            conn_close(s, c);
        } else
            p = &c->next;
    }
    return busy;
}

static void *serve_loop(void *arg) {
    ds_xfer_server *s = arg;
    while (!s->stop) {
        while (ucp_worker_progress(s->worker)) {
        }
        while (s->pending) {
            pending_conn *c = s->pending;
            s->pending = c->next;
            conn_accept(s, c->req);
            free(c);
        }
        if (serve_conns(s)) continue;
        ucs_status_t st = ucp_worker_arm(s->worker);
        if (st == UCS_ERR_BUSY) continue;
        struct pollfd pf = {.fd = s->efd, .events = POLLIN};
        poll(&pf, 1, 100); /* wakes for connections and requests; 100 ms bounds stop and expiry */
        int gone;
        blob *none = take_blob(s, 0, 0, 1, &gone); /* sweeps expired blobs (id 0: never filed) */
        (void)none;
        if (s->graves) {
            ucp_worker_progress(s->dworker);
            xfer_graves_reap(&s->graves);
        }
    }
    return NULL;
}

int ds_xfer_server_create(const char *host, int port, int wait_ms, ds_xfer_server **out,
                          ds_err *err) {
    *out = NULL;
    ds_xfer_server *s = calloc(1, sizeof *s);
    if (!s) return ds_errf(err, "kv transfer: out of memory");
    s->wait_ms = wait_ms;
    pthread_mutex_init(&s->mu, NULL);
    struct sockaddr_in sa;
    if (xfer_resolve(host, port, &sa, err) ||
        xfer_make_context(UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP, &s->ctx, err) ||
        xfer_make_worker(s->ctx, UCS_THREAD_MODE_SINGLE, &s->worker, err) ||
        xfer_make_context(UCP_FEATURE_TAG, &s->dctx, err) ||
        xfer_make_worker(s->dctx, UCS_THREAD_MODE_SINGLE, &s->dworker, err))
        goto fail;
    ucp_listener_params_t lp = {
        .field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER,
        .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sizeof sa},
        .conn_handler = {.cb = on_conn, .arg = s}};
    ucs_status_t st = ucp_listener_create(s->worker, &lp, &s->listener);
    if (st != UCS_OK) {
        ds_errf(err, "kv transfer: cannot listen on %s:%d: %s", host ? host : "0.0.0.0", port,
                ucs_status_string(st));
        goto fail;
    }
    ucp_listener_attr_t la = {.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR};
    if (ucp_listener_query(s->listener, &la) != UCS_OK) {
        ds_errf(err, "kv transfer: cannot query the listener's address");
        goto fail;
    }
    s->port = ntohs(((struct sockaddr_in *)&la.sockaddr)->sin_port);
    if (ucp_worker_get_efd(s->worker, &s->efd) != UCS_OK) {
        ds_errf(err, "kv transfer: UCX worker has no event fd");
        goto fail;
    }
    if (pthread_create(&s->thread, NULL, serve_loop, s)) {
        ds_errf(err, "kv transfer: cannot start the serving thread");
        goto fail;
    }
    s->started = 1;
    *out = s;
    return DS_OK;
fail:
    ds_xfer_server_free(s);
    return DS_ERR;
}

int ds_xfer_server_port(const ds_xfer_server *s) {
    return s->port;
}

int ds_xfer_server_put(ds_xfer_server *s, uint64_t id, void *buf, size_t len, int ttl_ms,
                       ds_err *err) {
    blob *b = malloc(sizeof *b);
    if (!b || id == 0) {
        free(b);
        free(buf);
        return ds_errf(err, id ? "kv transfer: out of memory" : "kv transfer: id 0 is reserved");
    }
    *b = (blob){id, buf, len, ds_now() + ttl_ms / 1e3, 0, NULL};
    pthread_mutex_lock(&s->mu);
    b->next = s->blobs;
    s->blobs = b;
    s->st.held++;
    s->st.held_bytes += len;
    pthread_mutex_unlock(&s->mu);
    return DS_OK;
}

void ds_xfer_server_stats(ds_xfer_server *s, ds_xfer_stats *st) {
    pthread_mutex_lock(&s->mu);
    *st = s->st;
    pthread_mutex_unlock(&s->mu);
}

void ds_xfer_server_test_stall(ds_xfer_server *s, int ms) {
    s->stall_ms = ms;
}

void ds_xfer_server_free(ds_xfer_server *s) {
    if (!s) return;
    if (s->started) {
        s->stop = 1;
        pthread_join(s->thread, NULL);
    }
    while (s->pending) {
        pending_conn *c = s->pending;
        s->pending = c->next;
        ucp_listener_reject(s->listener, c->req);
        free(c);
    }
    while (s->live) {
        sconn *c = s->live;
        s->live = c->next;
        c->es.failed = 1; /* force: the consumer may be mid-request */
        conn_close(s, c);
    }
    if (s->listener) ucp_listener_destroy(s->listener);
    if (s->worker) ucp_worker_destroy(s->worker);
    if (s->ctx) ucp_cleanup(s->ctx);
    if (s->dworker) ucp_worker_destroy(s->dworker);
    if (s->dctx) ucp_cleanup(s->dctx);
    xfer_graves_bury(&s->graves); /* both workers are gone: nothing touches them now */
    for (blob *b = s->blobs, *n; b; b = n) {
        n = b->next;
        free(b->buf);
        free(b);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}
