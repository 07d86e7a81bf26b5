/* xfer.c — the blob store and its UCX server, and the client that pulls (xfer.h).
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
 * pull at a time (a pull is one contiguous send).
 *
 * The client keeps each connection it opened (a UCX worker and endpoint of its own) in an idle
 * list once its request has been answered, for the next request to the same peer, and keeps the
 * buffers it received into (mapped once, handed out again best-fit), so a pull neither connects
 * nor first-touches fresh memory when an earlier one already did. */
#include "transport/xfer.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define XFER_MAGIC   0x31585344u /* "DSX1" little-endian */
#define XFER_VERSION 3u
/* ST_FOUND_TAGGED: found, and the bytes come on the connection's data path (tagged with the id)
 * rather than the stream */
enum { ST_FOUND = 0, ST_NOT_FOUND = 1, ST_VERSION = 2, ST_FOUND_TAGGED = 3 };
/* release: free the blob, send nothing back but the header; hello: the request's pad is the
 * length of the client's data worker's address, which follows it */
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

typedef struct blob {
    uint64_t id;
    void *buf; /* [len] bytes, owned */
    size_t len;
    double expires; /* ds_now() seconds */
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
    struct sconn *live;    /* serving thread only: open connections */
};

/* ---- shared helpers ---------------------------------------------------------------------------*/

static void sleep_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

typedef struct ep_state {
    volatile int failed; /* the endpoint's error handler ran (peer gone), or an operation failed */
    /* operations that a cancel did not end (UCX cannot cancel a stream send): the forced close
     * ends them; until then their buffers must live, so hold is freed only after that */
    ucs_status_ptr_t parked[4];
    int n_parked;
    void *hold;                /* a buffer a parked operation may still touch (close_ep frees) */
    void (*hold_free)(void *); /* how: free (the server's blobs), ds_xfer_buf_free (a pull's) */
} ep_state;

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    (void)status;
    ((ep_state *)arg)->failed = 1;
}

/* Waits for a non-blocking operation's request (NULL: it completed at once) on worker w.
 * Returns DS_OK, or DS_ERR when it failed, the endpoint failed, or the deadline passed. The
 * operation is then cancelled; one that does not end within half a second (a stream send to a
 * dead peer) is parked in es for close_ep's forced close, never waited on forever: that spin
 * wedged the producer's serving thread when a consumer died during a pull. w2 (may be NULL) is
 * progressed alongside and watch's failure (may be NULL) ends the wait too: a data-path
 * operation watches its connection, whose endpoint is the one that hears of a dead peer. */
static int wait_op_on(ucp_worker_h w, ucp_worker_h w2, const ep_state *watch, ucs_status_ptr_t r,
                      ep_state *es, double deadline) {
    if (r == NULL) return DS_OK;
    if (UCS_PTR_IS_ERR(r)) {
        es->failed = 1;
        return DS_ERR;
    }
    ucs_status_t st;
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        if (es->failed || (watch && watch->failed) || ds_now() > deadline) {
            es->failed = 1;
            ucp_request_cancel(w, r);
            double until = ds_now() + 0.5;
            while (ucp_request_check_status(r) == UCS_INPROGRESS && ds_now() < until)
                if (!ucp_worker_progress(w)) sleep_us(20);
            if (ucp_request_check_status(r) != UCS_INPROGRESS)
                ucp_request_free(r);
            else if (es->n_parked < (int)(sizeof es->parked / sizeof es->parked[0]))
                es->parked[es->n_parked++] = r;
            else
                ucp_request_free(r); /* UCX frees it when it completes */
            return DS_ERR;
        }
        unsigned n = ucp_worker_progress(w);
        if (w2) n += ucp_worker_progress(w2);
        if (!n) sleep_us(20);
    }
    ucp_request_free(r);
    if (st != UCS_OK) es->failed = 1;
    return st == UCS_OK ? DS_OK : DS_ERR;
}

static int wait_op(ucp_worker_h w, ucs_status_ptr_t r, ep_state *es, double deadline) {
    return wait_op_on(w, NULL, NULL, r, es, deadline);
}

static int send_all(ucp_worker_h w, ucp_ep_h ep, const void *buf, size_t len, ep_state *es,
                    double deadline) {
    ucp_request_param_t p = {.op_attr_mask = 0};
    return wait_op(w, ucp_stream_send_nbx(ep, buf, len, &p), es, deadline);
}

static int recv_all(ucp_worker_h w, ucp_ep_h ep, void *buf, size_t len, ep_state *es,
                    double deadline) {
    size_t got = 0;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_STREAM_RECV_FLAG_WAITALL};
    return wait_op(w, ucp_stream_recv_nbx(ep, buf, len, &got, &p), es, deadline);
}

/* Waits (until deadline) for es's parked operations on w, frees them, then frees es->hold once
 * nothing can touch it. */
static void settle(ucp_worker_h w, ep_state *es, double deadline) {
    int live = 0;
    for (int i = 0; i < es->n_parked; i++) {
        while (ucp_request_check_status(es->parked[i]) == UCS_INPROGRESS && ds_now() < deadline)
            if (!ucp_worker_progress(w)) sleep_us(20);
        live += ucp_request_check_status(es->parked[i]) == UCS_INPROGRESS;
        ucp_request_free(es->parked[i]); /* UCX frees a live one when it completes */
    }
    es->n_parked = 0;
    if (!live && es->hold)
        es->hold_free(es->hold); /* else leaked: better than a write into
                                    freed memory */
    es->hold = NULL;
}

/* Closes ep, flushing what was sent (force when the peer is already gone or an operation failed:
 * the forced close completes parked operations), then settles es. */
static void close_ep(ucp_worker_h w, ucp_ep_h ep, ep_state *es) {
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = es->failed ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    double deadline = ds_now() + 2.0;
    if (r && !UCS_PTR_IS_ERR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS && ds_now() < deadline)
            if (!ucp_worker_progress(w)) sleep_us(20);
        ucp_request_free(r);
    }
    settle(w, es, deadline);
}

/* A producer restarted on its port must bind at once, as an HTTP server does: the connections
 * of the one before (closed by it first, since consumers keep theirs open) linger in TIME_WAIT on
 * that port for a minute. UCX reads this switch of its TCP connection manager from the
 * environment only (ucp_config_modify does not reach it), so it is set there, once, before the
 * process's first UCX context, unless the user set it. */
static pthread_once_t g_reuse_once = PTHREAD_ONCE_INIT;
static void set_reuseaddr(void) {
    setenv("UCX_TCP_CM_REUSEADDR", "y", 0);
}

/* features: UCP_FEATURE_STREAM (connections, with wakeups on the server's) or UCP_FEATURE_TAG
 * (the data path). */
static int make_context(uint64_t features, ucp_context_h *ctx, ds_err *err) {
    pthread_once(&g_reuse_once, set_reuseaddr);
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) return ds_errf(err, "UCX: cannot read config");
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = features};
    ucs_status_t st = ucp_init(&p, cfg, ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) return ds_errf(err, "UCX: ucp_init failed: %s", ucs_status_string(st));
    return DS_OK;
}

/* mode: SINGLE for the serving thread's worker; SERIALIZED for a client connection's, which one
 * thread at a time uses, not always the same one. */
static int make_worker(ucp_context_h ctx, ucs_thread_mode_t mode, ucp_worker_h *w, ds_err *err) {
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = mode};
    ucs_status_t st = ucp_worker_create(ctx, &wp, w);
    if (st != UCS_OK) return ds_errf(err, "UCX: worker: %s", ucs_status_string(st));
    return DS_OK;
}

/* host:port -> an IPv4 socket address (names resolved). */
static int resolve(const char *host, int port, struct sockaddr_in *sa, ds_err *err) {
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)port);
    if (!host || !host[0] || !strcmp(host, "0.0.0.0")) {
        sa->sin_addr.s_addr = htonl(INADDR_ANY);
        return DS_OK;
    }
    if (inet_pton(AF_INET, host, &sa->sin_addr) == 1) return DS_OK;
    struct addrinfo hints = {.ai_family = AF_INET}, *ai = NULL;
    if (getaddrinfo(host, NULL, &hints, &ai) || !ai)
        return ds_errf(err, "kv transfer: cannot resolve host '%s'", host);
    sa->sin_addr = ((struct sockaddr_in *)ai->ai_addr)->sin_addr;
    freeaddrinfo(ai);
    return DS_OK;
}

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

/* Takes the blob filed under id out of the store (NULL when absent), freeing expired ones. */
static blob *take_blob(ds_xfer_server *s, uint64_t id) {
    blob *found = NULL;
    double now = ds_now();
    pthread_mutex_lock(&s->mu);
    for (blob **p = &s->blobs; *p;) {
        blob *b = *p;
        if (!found && b->id == id) {
            found = b;
            *p = b->next;
            s->st.held--;
            s->st.held_bytes -= b->len;
        } else if (b->expires < now) {
            *p = b->next;
            s->st.held--;
            s->st.held_bytes -= b->len;
            s->st.expired++;
            free(b->buf);
            free(b);
        } else
            p = &b->next;
    }
    pthread_mutex_unlock(&s->mu);
    return found;
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
 * an endpoint to it from the server's data worker; the answer says it is there (ST_FOUND), or
 * ST_NOT_FOUND when it could not be made (the bytes then come on the stream). */
static void serve_hello(ds_xfer_server *s, sconn *c, uint32_t n, double deadline) {
    void *addr = n && n <= HELLO_MAX_ADDR ? malloc(n) : NULL;
    if (!addr || recv_all(s->worker, c->ep, addr, n, &c->es, deadline)) {
        free(addr);
        count(s, &s->st.errors);
        c->es.failed = 1; /* a hello without its address: the framing is lost */
        return;
    }
    int ok = 0;
    if (!c->dep) {
        ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                            UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                              .address = addr,
                              .err_mode = UCP_ERR_HANDLING_MODE_NONE};
        ok = ucp_ep_create(s->dworker, &ep, &c->dep) == UCS_OK;
        if (!ok) c->dep = NULL;
    }
    free(addr);
    xhdr h = {XFER_MAGIC, ok ? ST_FOUND : ST_NOT_FOUND, 0};
    send_all(s->worker, c->ep, &h, sizeof h, &c->es, deadline);
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
            send_all(s->worker, c->ep, &h, sizeof h, &c->es, deadline);
        }
        c->es.failed = 1; /* the stream's framing cannot be trusted from here */
        return;
    }
    if (rq.op == OP_HELLO) {
        serve_hello(s, c, rq.pad, deadline);
        return;
    }
    blob *b = take_blob(s, rq.id);
    for (double until = ds_now() + s->wait_ms / 1e3; !b && ds_now() < until && !c->es.failed;) {
        ucp_worker_progress(s->worker);
        sleep_us(1000);
        b = take_blob(s, rq.id);
    }
    /* a release: the consumer gave it up, so it is freed now (not at its timeout), counted at
     * once, and answered with the header alone */
    const int released = b && rq.op == OP_RELEASE;
    if (released) {
        free(b->buf);
        free(b);
        b = NULL;
        count(s, &s->st.released);
    }
    const int tagged = b && b->len && c->dep;
    xhdr h = {XFER_MAGIC, b || released ? (tagged ? ST_FOUND_TAGGED : ST_FOUND) : ST_NOT_FOUND,
              b ? b->len : 0};
    int rc = send_all(s->worker, c->ep, &h, sizeof h, &c->es, deadline);
    for (double until = ds_now() + s->stall_ms / 1e3; !rc && !released && ds_now() < until;) {
        ucp_worker_progress(s->worker);
        sleep_us(1000);
    }
    /* a send's completion means UCX is done with the buffer (the connection stays open, so what
     * is in flight still arrives): the blob can go as soon as its send has completed */
    if (!rc && tagged) {
        ucp_request_param_t p = {.op_attr_mask = 0};
        rc = wait_op_on(s->dworker, s->worker, &c->es,
                        ucp_tag_send_nbx(c->dep, b->buf, b->len, rq.id, &p), &c->des, deadline);
        if (rc) c->es.failed = 1; /* the connection goes with its data path */
    } else if (!rc && b && b->len)
        rc = send_all(s->worker, c->ep, b->buf, b->len, &c->es, deadline);
    if (!released) count(s, rc ? &s->st.errors : b ? &s->st.served : &s->st.not_found);
    if (b) {
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
        ucp_request_cancel(s->worker, c->rr);
        c->es.failed = 1;
        if (c->es.n_parked < (int)(sizeof c->es.parked / sizeof c->es.parked[0]))
            c->es.parked[c->es.n_parked++] = c->rr;
        else
            ucp_request_free(c->rr);
        c->rr = NULL;
    }
    if (c->dep) { /* force: its peer may be gone, and error mode none would not say so */
        c->des.failed = 1;
        close_ep(s->dworker, c->dep, &c->des);
    }
    close_ep(s->worker, c->ep, &c->es);
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
                          .err_handler = {.cb = on_ep_error, .arg = &c->es}};
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
        blob *none = take_blob(s, 0); /* sweeps expired blobs (id 0 is never filed) */
        (void)none;
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
    if (resolve(host, port, &sa, err) ||
        make_context(UCP_FEATURE_STREAM | UCP_FEATURE_WAKEUP, &s->ctx, err) ||
        make_worker(s->ctx, UCS_THREAD_MODE_SINGLE, &s->worker, err) ||
        make_context(UCP_FEATURE_TAG, &s->dctx, err) ||
        make_worker(s->dctx, UCS_THREAD_MODE_SINGLE, &s->dworker, err))
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
    *b = (blob){id, buf, len, ds_now() + ttl_ms / 1e3, NULL};
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
    for (blob *b = s->blobs, *n; b; b = n) {
        n = b->next;
        free(b->buf);
        free(b);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- the client ------------------------------------------------------------------------------*/

enum {
    IDLE_CONNS_MAX = 32,  /* connections kept open over all peers */
    BUF_ALIGN = 2u << 20, /* buffers are mapped in 2 MiB steps (fewer sizes to fit) */
};
/* Buffer bytes kept for the next pulls: a 32K-token transfer of the bundled model is 124 MB. */
#define IDLE_BYTES_MAX ((size_t)256 << 20)

/* A receive buffer: one mapping, this header first, the bytes after it. */
typedef struct rbuf {
    uint64_t magic;   /* RBUF_MAGIC while the client's */
    size_t map_bytes; /* the mapping, header included */
    ds_xfer_client *owner;
    struct rbuf *next; /* in the idle list */
    uint8_t pad[32];   /* the bytes start 64 bytes in */
} rbuf;
_Static_assert(sizeof(rbuf) == 64, "the bytes after an rbuf are 64-byte aligned");
#define RBUF_MAGIC 0x4655425258534400ull /* "\0DSXRBUF" */

/* A connection to one producer (a worker of its own, so pulls on several threads run at once). */
typedef struct cconn {
    struct sockaddr_in sa;
    ucp_worker_h w;
    ucp_ep_h ep;
    ep_state es;     /* the endpoint's error handler writes here: the struct stays put */
    ucp_worker_h dw; /* the data path's worker: the producer sends a pull's bytes to it */
    ep_state des;    /* its operations (a parked receive, its buffer) */
    int tagged;      /* the producer made its end of the data path (the hello's answer) */
    struct cconn *next;
} cconn;

struct ds_xfer_client {
    ucp_context_h ctx;
    ucp_context_h dctx; /* the data path's (tag matching, no wakeups: shared memory and CMA) */
    pthread_mutex_t mu; /* guards everything below */
    cconn *idle;        /* connections kept for their peer's next request, newest first */
    int n_idle;
    rbuf *bufs; /* buffers kept for the next pulls */
    size_t idle_bytes;
    int out;    /* buffers handed out and not yet given back */
    int closed; /* ds_xfer_client_free ran: the last buffer back frees the struct */
    ds_xfer_client_stats st;
};

int ds_xfer_client_create(ds_xfer_client **out, ds_err *err) {
    *out = NULL;
    ds_xfer_client *c = calloc(1, sizeof *c);
    if (!c) return ds_errf(err, "kv transfer: out of memory");
    if (make_context(UCP_FEATURE_STREAM, &c->ctx, err)) {
        free(c);
        return DS_ERR;
    }
    if (make_context(UCP_FEATURE_TAG, &c->dctx, err)) {
        ucp_cleanup(c->ctx);
        free(c);
        return DS_ERR;
    }
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return DS_OK;
}

static void conn_drop(cconn *k) {
    if (k->ep) close_ep(k->w, k->ep, &k->es);
    settle(k->dw, &k->des, ds_now() + 2.0); /* a cancelled receive into a pull's buffer */
    ucp_worker_destroy(k->w);
    ucp_worker_destroy(k->dw);
    free(k);
}

/* c->mu held, c->closed: nothing is out any more, so the struct goes. */
static void client_destroy(ds_xfer_client *c) {
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_destroy(&c->mu);
    ucp_cleanup(c->ctx);
    ucp_cleanup(c->dctx);
    free(c);
}

void ds_xfer_client_free(ds_xfer_client *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    cconn *conns = c->idle;
    rbuf *bufs = c->bufs;
    c->idle = NULL;
    c->bufs = NULL;
    c->n_idle = 0;
    c->idle_bytes = 0;
    c->closed = 1;
    pthread_mutex_unlock(&c->mu);
    for (cconn *k = conns, *n; k; k = n) {
        n = k->next;
        conn_drop(k);
    }
    for (rbuf *b = bufs, *n; b; b = n) {
        n = b->next;
        munmap(b, b->map_bytes);
    }
    pthread_mutex_lock(&c->mu);
    if (!c->out)
        client_destroy(c);
    else
        pthread_mutex_unlock(&c->mu); /* the last ds_xfer_buf_free destroys it */
}

void ds_xfer_client_get_stats(ds_xfer_client *c, ds_xfer_client_stats *st) {
    pthread_mutex_lock(&c->mu);
    *st = c->st;
    st->idle_conns = c->n_idle;
    st->idle_bytes = c->idle_bytes;
    pthread_mutex_unlock(&c->mu);
}

/* A buffer of at least len bytes: the smallest kept one that fits, else a new mapping. */
static void *buf_take(ds_xfer_client *c, size_t len) {
    pthread_mutex_lock(&c->mu);
    rbuf **best = NULL;
    for (rbuf **p = &c->bufs; *p; p = &(*p)->next)
        if ((*p)->map_bytes - sizeof(rbuf) >= len &&
            (!best || (*p)->map_bytes < (*best)->map_bytes))
            best = p;
    rbuf *b = NULL;
    if (best) {
        b = *best;
        *best = b->next;
        c->idle_bytes -= b->map_bytes;
        c->st.buf_reuses++;
    }
    c->out += b != NULL;
    pthread_mutex_unlock(&c->mu);
    if (!b) {
        size_t bytes = (sizeof(rbuf) + len + BUF_ALIGN - 1) / BUF_ALIGN * BUF_ALIGN;
        void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) return NULL;
        b = m;
        b->map_bytes = bytes;
        b->owner = c;
        pthread_mutex_lock(&c->mu);
        c->out++;
        pthread_mutex_unlock(&c->mu);
    }
    b->magic = RBUF_MAGIC;
    b->next = NULL;
    return b + 1;
}

void ds_xfer_buf_free(void *p) {
    if (!p) return;
    rbuf *b = (rbuf *)p - 1;
    ds_xfer_client *c = b->owner;
    pthread_mutex_lock(&c->mu);
    c->out--;
    if (!c->closed && b->map_bytes <= IDLE_BYTES_MAX) {
        /* kept, newest first; the oldest go while the kept bytes are over the bound */
        b->next = c->bufs;
        c->bufs = b;
        c->idle_bytes += b->map_bytes;
        b = NULL;
        while (c->idle_bytes > IDLE_BYTES_MAX) {
            rbuf **p2 = &c->bufs;
            while ((*p2)->next) p2 = &(*p2)->next;
            rbuf *old = *p2;
            *p2 = NULL;
            c->idle_bytes -= old->map_bytes;
            munmap(old, old->map_bytes);
        }
    }
    if (b) munmap(b, b->map_bytes);
    if (c->closed && !c->out)
        client_destroy(c);
    else
        pthread_mutex_unlock(&c->mu);
}

static void buf_hold_free(void *p) {
    ds_xfer_buf_free(p);
}

/* A kept connection to sa (NULL when none). */
static cconn *conn_take(ds_xfer_client *c, const struct sockaddr_in *sa) {
    pthread_mutex_lock(&c->mu);
    cconn *k = NULL;
    for (cconn **p = &c->idle; *p; p = &(*p)->next)
        if ((*p)->sa.sin_addr.s_addr == sa->sin_addr.s_addr && (*p)->sa.sin_port == sa->sin_port) {
            k = *p;
            *p = k->next;
            c->n_idle--;
            break;
        }
    pthread_mutex_unlock(&c->mu);
    if (k) { /* a peer that went away since shows here (its error handler runs in progress) */
        while (ucp_worker_progress(k->w)) {
        }
        if (k->es.failed) {
            conn_drop(k);
            k = NULL;
        }
    }
    return k;
}

/* Keeps k, whose request was answered whole, for its peer's next one. */
static void conn_keep(ds_xfer_client *c, cconn *k) {
    cconn *drop = NULL;
    pthread_mutex_lock(&c->mu);
    k->next = c->idle;
    c->idle = k;
    if (++c->n_idle > IDLE_CONNS_MAX) { /* the oldest goes */
        cconn **p = &c->idle;
        while ((*p)->next) p = &(*p)->next;
        drop = *p;
        *p = NULL;
        c->n_idle--;
    }
    pthread_mutex_unlock(&c->mu);
    if (drop) conn_drop(drop);
}

/* Tells the producer at the other end of k the address of k's data worker, so that it sends
 * pulls' bytes there (shared memory or CMA between processes of one host, where a connection made
 * from a socket address gets TCP only). A producer that could not reach it says so, and its
 * bytes then come on the stream. */
static int hello(cconn *k, double deadline, const char *peer, ds_err *err) {
    ucp_address_t *addr;
    size_t n;
    if (ucp_worker_get_address(k->dw, &addr, &n) != UCS_OK || n > HELLO_MAX_ADDR)
        return ds_errf(err, "kv transfer: UCX: no address for the data worker");
    xreq rq = {XFER_MAGIC, XFER_VERSION, 0, OP_HELLO, (uint32_t)n};
    xhdr h;
    int rc = send_all(k->w, k->ep, &rq, sizeof rq, &k->es, deadline) ||
             send_all(k->w, k->ep, addr, n, &k->es, deadline) ||
             recv_all(k->w, k->ep, &h, sizeof h, &k->es, deadline);
    ucp_worker_release_address(k->dw, addr);
    if (rc)
        return ds_errf(err, "kv transfer: %s: %s", peer,
                       ds_now() > deadline ? "timed out" : "connection failed");
    if (h.magic != XFER_MAGIC) return ds_errf(err, "kv transfer: %s: not a deltaserve peer", peer);
    if (h.status == ST_VERSION)
        return ds_errf(err,
                       "kv transfer: %s speaks another version of the transfer protocol (this "
                       "server's is %u)",
                       peer, XFER_VERSION);
    k->tagged = h.status == ST_FOUND;
    return DS_OK;
}

static int conn_open(ds_xfer_client *c, const struct sockaddr_in *sa, const char *peer,
                     double deadline, cconn **out, ds_err *err) {
    cconn *k = calloc(1, sizeof *k);
    if (!k) return ds_errf(err, "kv transfer: out of memory");
    k->sa = *sa;
    if (make_worker(c->ctx, UCS_THREAD_MODE_SERIALIZED, &k->w, err)) {
        free(k);
        return DS_ERR;
    }
    if (make_worker(c->dctx, UCS_THREAD_MODE_SERIALIZED, &k->dw, err)) {
        ucp_worker_destroy(k->w);
        free(k);
        return DS_ERR;
    }
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
        .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
        .sockaddr = {.addr = (const struct sockaddr *)&k->sa, .addrlen = sizeof k->sa},
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = on_ep_error, .arg = &k->es}};
    if (ucp_ep_create(k->w, &ep, &k->ep) != UCS_OK) {
        k->ep = NULL;
        conn_drop(k);
        return ds_errf(err, "kv transfer: cannot connect to %s", peer);
    }
    pthread_mutex_lock(&c->mu);
    c->st.connects++;
    pthread_mutex_unlock(&c->mu);
    if (hello(k, deadline, peer, err)) {
        conn_drop(k);
        return DS_ERR;
    }
    *out = k;
    return DS_OK;
}

/* One request on connection k: request, header, payload (a release: the header alone; buf
 * NULL). *answered: the header arrived (a failure before it, on a kept connection, is retried
 * on a new one). */
static int request_on(ds_xfer_client *c, cconn *k, uint64_t id, uint32_t op, double deadline,
                      const char *peer, void **buf, size_t *len, int *answered, ds_err *err) {
    xreq rq = {XFER_MAGIC, XFER_VERSION, id, op, 0};
    xhdr h;
    ucp_worker_h w = k->w;
    ep_state *es = &k->es;
    *answered = 0;
    if (send_all(w, k->ep, &rq, sizeof rq, es, deadline) ||
        recv_all(w, k->ep, &h, sizeof h, es, deadline))
        return ds_errf(err, "kv transfer: %s: %s", peer,
                       ds_now() > deadline ? "timed out" : "connection failed");
    *answered = 1;
    if (h.magic != XFER_MAGIC) return ds_errf(err, "kv transfer: %s: not a deltaserve peer", peer);
    if (h.status == ST_VERSION)
        return ds_errf(err,
                       "kv transfer: %s speaks another version of the transfer protocol "
                       "(this server's is %u)",
                       peer, XFER_VERSION);
    const int tagged = h.status == ST_FOUND_TAGGED;
    if (h.status != ST_FOUND && !(tagged && k->tagged && buf))
        return ds_errf(err,
                       "kv transfer: %s: transfer %016llx not held (pulled, expired or never "
                       "filed)",
                       peer, (unsigned long long)id);
    if (!buf) return DS_OK; /* released */
    void *b = buf_take(c, h.len);
    if (!b)
        return ds_errf(err, "kv transfer: out of memory for %llu bytes", (unsigned long long)h.len);
    int rc = DS_OK;
    if (tagged) { /* on the data path, tagged with the id */
        pthread_mutex_lock(&c->mu);
        c->st.data_path++;
        pthread_mutex_unlock(&c->mu);
        ucp_request_param_t p = {.op_attr_mask = 0};
        es = &k->des;
        rc = wait_op_on(k->dw, w, &k->es, ucp_tag_recv_nbx(k->dw, b, h.len, id, UINT64_MAX, &p), es,
                        deadline);
    } else if (h.len)
        rc = recv_all(w, k->ep, b, h.len, es, deadline);
    if (rc) {
        es->hold = b; /* a parked receive may still write it until it is settled */
        es->hold_free = buf_hold_free;
        return ds_errf(err, "kv transfer: %s: %s after the header", peer,
                       ds_now() > deadline ? "timed out" : "connection broke");
    }
    *buf = b;
    *len = h.len;
    return DS_OK;
}

/* Runs one request to host:port on a kept connection (or a new one) and keeps the connection
 * when the request was answered whole. */
static int request(ds_xfer_client *c, const char *host, int port, uint64_t id, uint32_t op,
                   int timeout_ms, void **buf, size_t *len, ds_err *err) {
    char peer[160];
    snprintf(peer, sizeof peer, "%s:%d", host ? host : "?", port);
    struct sockaddr_in sa;
    if (resolve(host, port, &sa, err)) return DS_ERR;
    const double deadline = ds_now() + timeout_ms / 1e3;
    for (int attempt = 0;; attempt++) {
        cconn *k = attempt ? NULL : conn_take(c, &sa);
        const int kept = k != NULL;
        if (!k && conn_open(c, &sa, peer, deadline, &k, err)) return DS_ERR;
        if (kept) {
            pthread_mutex_lock(&c->mu);
            c->st.reuses++;
            pthread_mutex_unlock(&c->mu);
        }
        int answered;
        int rc = request_on(c, k, id, op, deadline, peer, buf, len, &answered, err);
        if (rc == DS_OK) {
            conn_keep(c, k);
            return DS_OK;
        }
        conn_drop(k); /* never reused after a failure: the stream's framing is lost */
        /* a kept connection whose peer went away (a producer restarted on the same port) fails
         * before any answer: once more on a new connection, within the same deadline */
        if (!kept || answered || ds_now() > deadline) return DS_ERR;
        pthread_mutex_lock(&c->mu);
        c->st.retries++;
        pthread_mutex_unlock(&c->mu);
    }
}

int ds_xfer_pull(ds_xfer_client *c, const char *host, int port, uint64_t id, int timeout_ms,
                 void **buf, size_t *len, ds_err *err) {
    *buf = NULL;
    *len = 0;
    return request(c, host, port, id, OP_PULL, timeout_ms, buf, len, err);
}

int ds_xfer_release(ds_xfer_client *c, const char *host, int port, uint64_t id, int timeout_ms,
                    ds_err *err) {
    return request(c, host, port, id, OP_RELEASE, timeout_ms, NULL, NULL, err);
}
