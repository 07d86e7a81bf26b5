/* xfer_client.c — the consumer's side of the transfer (xfer.h): pulls and releases over kept
 * connections, into kept buffers.
 *
 * The client keeps each connection it opened (a UCX worker and endpoint of its own, and the
 * worker of its data path) in an idle list once its request has been answered, for the next
 * request to the same peer, and keeps the buffers it received into (mapped once, handed out
 * again best-fit), so a pull neither connects nor first-touches fresh memory when an earlier one
 * already did. */
#include "transport/xfer.h"
#include "transport/xfer_ucx.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum {
    IDLE_CONNS_MAX = 32,  /* connections kept open over all peers */
    BUF_ALIGN = 2u << 20, /* buffers are mapped in 2 MiB steps (fewer sizes to fit) */
};
/* Buffer bytes kept for the next pulls: a 32K-token transfer of the bundled model is 124 MB. */
#define IDLE_BYTES_MAX ((size_t)256 << 20)

/* A receive buffer: one mapping, this header first, the bytes after it. */
typedef struct rbuf {
    uint64_t magic;   /* RBUF_MAGIC while handed out (0 while kept idle) */
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
    if (xfer_make_context(UCP_FEATURE_STREAM, &c->ctx, err)) {
        free(c);
        return DS_ERR;
    }
    if (xfer_make_context(UCP_FEATURE_TAG, &c->dctx, err)) {
        ucp_cleanup(c->ctx);
        free(c);
        return DS_ERR;
    }
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return DS_OK;
}

static void count(ds_xfer_client *c, uint64_t *field) {
    pthread_mutex_lock(&c->mu);
    (*field)++;
    pthread_mutex_unlock(&c->mu);
}

static void conn_drop(cconn *k) {
    xfer_grave *graves = NULL; /* the connection's own workers go next: then nothing runs */
    if (k->ep) xfer_close_ep(k->w, k->ep, &k->es, &graves);
    xfer_settle(k->dw, &k->des, ds_now() + 2.0, &graves); /* a cancelled receive into a pull's
                                                             buffer */
    ucp_worker_destroy(k->w);
    ucp_worker_destroy(k->dw);
    xfer_graves_bury(&graves);
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
    if (b->magic != RBUF_MAGIC) { /* given back twice, or never a pull's: leak, never corrupt */
        fprintf(stderr, "[deltaserve] kv transfer: %p is not a pulled buffer (given back twice?)\n",
                p);
        return;
    }
    b->magic = 0; /* until buf_take hands it out again */
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

/* Sends rq (then more[n_more], when given) on k's stream and receives the answer's header into
 * *h, checking that it is one of ours and of our version. *answered: the header arrived (a
 * failure before it, on a kept connection, is retried on a new one). */
static int exchange(cconn *k, const xreq *rq, const void *more, size_t n_more, double deadline,
                    const char *peer, xhdr *h, int *answered, ds_err *err) {
    *answered = 0;
    if (xfer_send_all(k->w, k->ep, rq, sizeof *rq, &k->es, deadline) ||
        (more && xfer_send_all(k->w, k->ep, more, n_more, &k->es, deadline)) ||
        xfer_recv_all(k->w, k->ep, h, sizeof *h, &k->es, deadline))
        return ds_errf(err, "kv transfer: %s: %s", peer,
                       ds_now() > deadline ? "timed out" : "connection failed");
    *answered = 1;
    if (h->magic != XFER_MAGIC) return ds_errf(err, "kv transfer: %s: not a deltaserve peer", peer);
    if (h->status == ST_VERSION)
        return ds_errf(err,
                       "kv transfer: %s speaks another version of the transfer protocol (this "
                       "server's is %u)",
                       peer, XFER_VERSION);
    return DS_OK;
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
    int answered;
    int rc = exchange(k, &rq, addr, n, deadline, peer, &h, &answered, err);
    ucp_worker_release_address(k->dw, addr);
    if (rc) return DS_ERR;
    k->tagged = h.status == ST_FOUND;
    return DS_OK;
}

static int conn_open(ds_xfer_client *c, const struct sockaddr_in *sa, const char *peer,
                     double deadline, cconn **out, ds_err *err) {
    cconn *k = calloc(1, sizeof *k);
    if (!k) return ds_errf(err, "kv transfer: out of memory");
    k->sa = *sa;
    if (xfer_make_worker(c->ctx, UCS_THREAD_MODE_SERIALIZED, &k->w, err)) {
        free(k);
        return DS_ERR;
    }
    if (xfer_make_worker(c->dctx, UCS_THREAD_MODE_SERIALIZED, &k->dw, err)) {
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
        .err_handler = {.cb = xfer_on_ep_error, .arg = &k->es}};
    if (ucp_ep_create(k->w, &ep, &k->ep) != UCS_OK) {
        k->ep = NULL;
        conn_drop(k);
        return ds_errf(err, "kv transfer: cannot connect to %s", peer);
    }
    count(c, &c->st.connects);
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
static int request_on(ds_xfer_client *c, cconn *k, uint64_t id, uint32_t op, uint32_t pulls,
                      size_t max_len, double deadline, const char *peer, void **buf, size_t *len,
                      int *answered, ds_err *err) {
    xreq rq = {XFER_MAGIC, XFER_VERSION, id, op, pulls};
    xhdr h;
    ucp_worker_h w = k->w;
    ep_state *es = &k->es;
    if (exchange(k, &rq, NULL, 0, deadline, peer, &h, answered, err)) return DS_ERR;
    const int tagged = h.status == ST_FOUND_TAGGED;
    if (h.status != ST_FOUND && !(tagged && k->tagged && buf))
        return ds_errf(err,
                       "kv transfer: %s: transfer %016llx not held (pulled, expired or never "
                       "filed)",
                       peer, (unsigned long long)id);
    if (!buf) return DS_OK;         /* released */
    if (max_len && h.len > max_len) /* (the connection goes: its bytes are not taken) */
        return ds_errf(err,
                       "kv transfer: %s: transfer %016llx is %llu bytes, more than the %zu this "
                       "pull allows",
                       peer, (unsigned long long)id, (unsigned long long)h.len, max_len);
    void *b = buf_take(c, h.len);
    if (!b)
        return ds_errf(err, "kv transfer: out of memory for %llu bytes", (unsigned long long)h.len);
    int rc = DS_OK;
    if (tagged) { /* on the data path, tagged with the id */
        count(c, &c->st.data_path);
        ucp_request_param_t p = {.op_attr_mask = 0};
        es = &k->des;
        rc = xfer_wait_op_on(k->dw, w, &k->es,
                             ucp_tag_recv_nbx(k->dw, b, h.len, id, UINT64_MAX, &p), es, deadline);
    } else if (h.len)
        rc = xfer_recv_all(w, k->ep, b, h.len, es, deadline);
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
                   uint32_t pulls, size_t max_len, int timeout_ms, void **buf, size_t *len,
                   ds_err *err) {
    char peer[160];
    snprintf(peer, sizeof peer, "%s:%d", host ? host : "?", port);
    struct sockaddr_in sa;
    if (xfer_resolve(host, port, &sa, err)) return DS_ERR;
    const double deadline = ds_now() + timeout_ms / 1e3;
    for (int attempt = 0;; attempt++) {
        cconn *k = attempt ? NULL : conn_take(c, &sa);
        const int kept = k != NULL;
        if (!k && conn_open(c, &sa, peer, deadline, &k, err)) return DS_ERR;
        if (kept) count(c, &c->st.reuses);
        int answered;
        int rc = request_on(c, k, id, op, pulls, max_len, deadline, peer, buf, len, &answered, err);
        if (rc == DS_OK) {
            conn_keep(c, k);
            return DS_OK;
        }
        conn_drop(k); /* never reused after a failure: the stream's framing is lost */
        /* a kept connection whose peer went away (a producer restarted on the same port) fails
         * before any answer: once more on a new connection, within the same deadline */
        if (!kept || answered || ds_now() > deadline) return DS_ERR;
        count(c, &c->st.retries);
    }
}

int ds_xfer_pull_shared(ds_xfer_client *c, const char *host, int port, uint64_t id, int pulls,
                        size_t max_len, int timeout_ms, void **buf, size_t *len, ds_err *err) {
    *buf = NULL;
    *len = 0;
    if (pulls < 0) return ds_errf(err, "kv transfer: %d pulls of a transfer", pulls);
    return request(c, host, port, id, OP_PULL, (uint32_t)pulls, max_len, timeout_ms, buf, len, err);
}

int ds_xfer_pull(ds_xfer_client *c, const char *host, int port, uint64_t id, int timeout_ms,
                 void **buf, size_t *len, ds_err *err) {
    return ds_xfer_pull_shared(c, host, port, id, 1, 0, timeout_ms, buf, len, err);
}

int ds_xfer_release(ds_xfer_client *c, const char *host, int port, uint64_t id, int timeout_ms,
                    ds_err *err) {
    return request(c, host, port, id, OP_RELEASE, 0, 0, timeout_ms, NULL, NULL, err);
}
