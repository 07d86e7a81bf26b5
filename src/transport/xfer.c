/* xfer.c — the blob store and its UCX server, and the pull (xfer.h).
 *
 * UCX's client-server mode: the server's worker owns a listener on a socket address; a new
 * connection arrives as a connection request, which the serving thread turns into an endpoint and
 * answers with the stream API (ucp_stream_send_nbx / ucp_stream_recv_nbx). UCX picks the
 * transport itself (shared memory between processes of one host, TCP otherwise here; RDMA where
 * the hardware has it). The serving thread sleeps on the worker's event fd between requests, so
 * an idle producer costs nothing; it serves one pull at a time (a pull is one contiguous send). */
#include "transport/xfer.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <ucp/api/ucp.h>

#define XFER_MAGIC   0x31585344u /* "DSX1" little-endian */
#define XFER_VERSION 2u
enum { ST_FOUND = 0, ST_NOT_FOUND = 1 };
enum { OP_PULL = 0, OP_RELEASE = 1 }; /* release: free the blob, send nothing back but the header */

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
    ucp_listener_h listener;
    int port, wait_ms, efd;
    int stall_ms; /* tests: a pause between a pull's header and its bytes */
    pthread_t thread;
    int started;
    volatile int stop;
    pthread_mutex_t mu; /* guards blobs and st */
    blob *blobs;
    ds_xfer_stats st;
    pending_conn *conns; /* serving thread only (the listener callback runs inside progress) */
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
    void *hold; /* a buffer a parked operation may still touch (freed by close_ep) */
} ep_state;

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    (void)status;
    ((ep_state *)arg)->failed = 1;
}

/* Waits for a non-blocking operation's request (NULL: it completed at once). Returns DS_OK, or
 * DS_ERR when it failed, the endpoint failed, or the deadline passed. The operation is then
 * cancelled; one that does not end within half a second (a stream send to a dead peer) is parked
 * in es for close_ep's forced close, never waited on forever: that spin wedged the producer's
 * serving thread when a consumer died during a pull. */
static int wait_op(ucp_worker_h w, ucs_status_ptr_t r, ep_state *es, double deadline) {
    if (r == NULL) return DS_OK;
    if (UCS_PTR_IS_ERR(r)) {
        es->failed = 1;
        return DS_ERR;
    }
    ucs_status_t st;
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        if (es->failed || ds_now() > deadline) {
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
        if (!ucp_worker_progress(w)) sleep_us(20);
    }
    ucp_request_free(r);
    if (st != UCS_OK) es->failed = 1;
    return st == UCS_OK ? DS_OK : DS_ERR;
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

/* Closes ep, flushing what was sent (force when the peer is already gone or an operation failed:
 * the forced close completes parked operations), then frees es->hold once nothing can touch it. */
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
    int live = 0;
    for (int i = 0; i < es->n_parked; i++) {
        while (ucp_request_check_status(es->parked[i]) == UCS_INPROGRESS && ds_now() < deadline)
            if (!ucp_worker_progress(w)) sleep_us(20);
        live += ucp_request_check_status(es->parked[i]) == UCS_INPROGRESS;
        ucp_request_free(es->parked[i]); /* UCX frees a live one when it completes */
    }
    es->n_parked = 0;
    if (!live) free(es->hold); /* else leaked: better than a write into freed memory */
    es->hold = NULL;
}

static int make_context(int wakeup, ucp_context_h *ctx, ds_err *err) {
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) return ds_errf(err, "UCX: cannot read config");
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_STREAM | (wakeup ? UCP_FEATURE_WAKEUP : 0)};
    ucs_status_t st = ucp_init(&p, cfg, ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) return ds_errf(err, "UCX: ucp_init failed: %s", ucs_status_string(st));
    return DS_OK;
}

static int make_worker(ucp_context_h ctx, ucp_worker_h *w, ds_err *err) {
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
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
    c->next = s->conns;
    s->conns = c;
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

/* Answers one connection: reads the id, sends the blob (or not-found), closes. */
static void serve_conn(ds_xfer_server *s, ucp_conn_request_h creq) {
    ep_state es = {0};
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .conn_request = creq,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = on_ep_error, .arg = &es}};
    ucp_ep_h e;
    if (ucp_ep_create(s->worker, &ep, &e) != UCS_OK) {
        count(s, &s->st.errors);
        return;
    }
    xreq rq;
    double deadline = ds_now() + 10.0;
    if (recv_all(s->worker, e, &rq, sizeof rq, &es, deadline) || rq.magic != XFER_MAGIC ||
        rq.version != XFER_VERSION) {
        count(s, &s->st.errors);
        close_ep(s->worker, e, &es);
        return;
    }
    blob *b = take_blob(s, rq.id);
    for (double until = ds_now() + s->wait_ms / 1e3; !b && ds_now() < until && !es.failed;) {
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
    xhdr h = {XFER_MAGIC, b || released ? ST_FOUND : ST_NOT_FOUND, b ? b->len : 0};
    deadline = ds_now() + 60.0;
    int rc = send_all(s->worker, e, &h, sizeof h, &es, deadline);
    for (double until = ds_now() + s->stall_ms / 1e3; !rc && !released && ds_now() < until;) {
        ucp_worker_progress(s->worker);
        sleep_us(1000);
    }
    if (!rc && b && b->len) rc = send_all(s->worker, e, b->buf, b->len, &es, deadline);
    /* the peer closes once it has everything; wait for that so the flush cannot cut it short */
    if (!rc) {
        char c;
        recv_all(s->worker, e, &c, 1, &es, ds_now() + 5.0);
    }
    if (!released) count(s, rc ? &s->st.errors : b ? &s->st.served : &s->st.not_found);
    if (b) {
        es.hold = b->buf; /* a parked send may still read it until the forced close */
        free(b);
    }
    close_ep(s->worker, e, &es);
}

static void *serve_loop(void *arg) {
    ds_xfer_server *s = arg;
    while (!s->stop) {
        while (ucp_worker_progress(s->worker)) {
        }
        while (s->conns) {
            pending_conn *c = s->conns;
            s->conns = c->next;
            serve_conn(s, c->req);
            free(c);
        }
        ucs_status_t st = ucp_worker_arm(s->worker);
        if (st == UCS_ERR_BUSY) continue;
        struct pollfd pf = {.fd = s->efd, .events = POLLIN};
        poll(&pf, 1, 100); /* wakes for new connections; 100 ms bounds the stop and expiry */
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
    if (resolve(host, port, &sa, err) || make_context(1, &s->ctx, err) ||
        make_worker(s->ctx, &s->worker, err))
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
    while (s->conns) {
        pending_conn *c = s->conns;
        s->conns = c->next;
        ucp_listener_reject(s->listener, c->req);
        free(c);
    }
    if (s->listener) ucp_listener_destroy(s->listener);
    if (s->worker) ucp_worker_destroy(s->worker);
    if (s->ctx) ucp_cleanup(s->ctx);
    for (blob *b = s->blobs, *n; b; b = n) {
        n = b->next;
        free(b->buf);
        free(b);
    }
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- the pull --------------------------------------------------------------------------------*/

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static ucp_context_h g_ctx;
static ds_err g_ctx_err;
static void init_client_ctx(void) {
    if (make_context(0, &g_ctx, &g_ctx_err)) g_ctx = NULL;
}

/* The call's body once connected: request, header, payload (a release: the header alone; buf
 * NULL). */
static int pull_on(ucp_worker_h w, ucp_ep_h e, ep_state *es, uint64_t id, uint32_t op,
                   double deadline, const char *peer, void **buf, size_t *len, ds_err *err) {
    xreq rq = {XFER_MAGIC, XFER_VERSION, id, op, 0};
    xhdr h;
    if (send_all(w, e, &rq, sizeof rq, es, deadline) || recv_all(w, e, &h, sizeof h, es, deadline))
        return ds_errf(err, "kv transfer: %s: %s", peer,
                       ds_now() > deadline ? "timed out" : "connection failed");
    if (h.magic != XFER_MAGIC) return ds_errf(err, "kv transfer: %s: not a deltaserve peer", peer);
    if (h.status != ST_FOUND)
        return ds_errf(err,
                       "kv transfer: %s: transfer %016llx not held (pulled, expired or never "
                       "filed)",
                       peer, (unsigned long long)id);
    if (!buf) return DS_OK; /* released */
    void *b = malloc(h.len ? h.len : 1);
    if (!b)
        return ds_errf(err, "kv transfer: out of memory for %llu bytes", (unsigned long long)h.len);
    if (h.len && recv_all(w, e, b, h.len, es, deadline)) {
        es->hold = b; /* a parked receive may still write it until close_ep */
        return ds_errf(err, "kv transfer: %s: %s after the header", peer,
                       ds_now() > deadline ? "timed out" : "connection broke");
    }
    *buf = b;
    *len = h.len;
    return DS_OK;
}

/* Connects to host:port and runs one request (pull: buf, len; release: NULL). */
static int call(const char *host, int port, uint64_t id, uint32_t op, int timeout_ms, void **buf,
                size_t *len, ds_err *err) {
    char peer[160];
    snprintf(peer, sizeof peer, "%s:%d", host ? host : "?", port);
    pthread_once(&g_once, init_client_ctx);
    if (!g_ctx) return ds_errf(err, "%s", g_ctx_err.msg);
    struct sockaddr_in sa;
    if (resolve(host, port, &sa, err)) return DS_ERR;
    ucp_worker_h w;
    if (make_worker(g_ctx, &w, err)) return DS_ERR;
    ep_state es = {0};
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                          .flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
                          .sockaddr = {.addr = (const struct sockaddr *)&sa, .addrlen = sizeof sa},
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = on_ep_error, .arg = &es}};
    ucp_ep_h e;
    int rc;
    if (ucp_ep_create(w, &ep, &e) != UCS_OK) {
        rc = ds_errf(err, "kv transfer: cannot connect to %s", peer);
    } else {
        rc = pull_on(w, e, &es, id, op, ds_now() + timeout_ms / 1e3, peer, buf, len, err);
        close_ep(w, e, &es);
    }
    ucp_worker_destroy(w);
    return rc;
}

int ds_xfer_pull(const char *host, int port, uint64_t id, int timeout_ms, void **buf, size_t *len,
                 ds_err *err) {
    *buf = NULL;
    *len = 0;
    return call(host, port, id, OP_PULL, timeout_ms, buf, len, err);
}

int ds_xfer_release(const char *host, int port, uint64_t id, int timeout_ms, ds_err *err) {
    return call(host, port, id, OP_RELEASE, timeout_ms, NULL, NULL, err);
}
