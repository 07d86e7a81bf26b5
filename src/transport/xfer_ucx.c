/* xfer_ucx.c — the UCX helpers of the transfer's two sides (xfer_ucx.h): waiting for an
 * operation with a deadline (cancelling and parking what does not end), stream sends and
 * receives, closing an endpoint, contexts, workers and addresses. */
#include "transport/xfer_ucx.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void xfer_sleep_us(long us) {
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

void xfer_on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    (void)status;
    ((ep_state *)arg)->failed = 1;
}

void xfer_abandon(ucp_worker_h w, ucs_status_ptr_t r, ep_state *es) {
    es->failed = 1;
    ucp_request_cancel(w, r);
    double until = ds_now() + 0.5;
    while (ucp_request_check_status(r) == UCS_INPROGRESS && ds_now() < until)
        if (!ucp_worker_progress(w)) xfer_sleep_us(20);
    if (ucp_request_check_status(r) != UCS_INPROGRESS)
        ucp_request_free(r);
    else if (es->n_parked < (int)(sizeof es->parked / sizeof es->parked[0]))
        es->parked[es->n_parked++] = r;
    else
        ucp_request_free(r); /* UCX frees it when it completes */
}

int xfer_wait_op_on(ucp_worker_h w, ucp_worker_h w2, const ep_state *watch, ucs_status_ptr_t r,
                    ep_state *es, double deadline) {
    if (r == NULL) return DS_OK;
    if (UCS_PTR_IS_ERR(r)) {
        es->failed = 1;
        return DS_ERR;
    }
    ucs_status_t st;
    while ((st = ucp_request_check_status(r)) == UCS_INPROGRESS) {
        if (es->failed || (watch && watch->failed) || ds_now() > deadline) {
            xfer_abandon(w, r, es);
            return DS_ERR;
        }
        unsigned n = ucp_worker_progress(w);
        if (w2) n += ucp_worker_progress(w2);
        if (!n) xfer_sleep_us(20);
    }
    ucp_request_free(r);
    if (st != UCS_OK) es->failed = 1;
    return st == UCS_OK ? DS_OK : DS_ERR;
}

int xfer_wait_op(ucp_worker_h w, ucs_status_ptr_t r, ep_state *es, double deadline) {
    return xfer_wait_op_on(w, NULL, NULL, r, es, deadline);
}

int xfer_send_all(ucp_worker_h w, ucp_ep_h ep, const void *buf, size_t len, ep_state *es,
                  double deadline) {
    ucp_request_param_t p = {.op_attr_mask = 0};
    return xfer_wait_op(w, ucp_stream_send_nbx(ep, buf, len, &p), es, deadline);
}

int xfer_recv_all(ucp_worker_h w, ucp_ep_h ep, void *buf, size_t len, ep_state *es,
                  double deadline) {
    size_t got = 0;
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = UCP_STREAM_RECV_FLAG_WAITALL};
    return xfer_wait_op(w, ucp_stream_recv_nbx(ep, buf, len, &got, &p), es, deadline);
}

void xfer_settle(ucp_worker_h w, ep_state *es, double deadline, xfer_grave **graves) {
    xfer_grave g = {.n = 0};
    for (int i = 0; i < es->n_parked; i++) {
        while (ucp_request_check_status(es->parked[i]) == UCS_INPROGRESS && ds_now() < deadline)
            if (!ucp_worker_progress(w)) xfer_sleep_us(20);
        if (ucp_request_check_status(es->parked[i]) == UCS_INPROGRESS && es->hold)
            g.reqs[g.n++] = es->parked[i]; /* watched until it ends: its buffer waits */
        else
            ucp_request_free(es->parked[i]);
    }
    es->n_parked = 0;
    xfer_grave *node = g.n ? malloc(sizeof *node) : NULL;
    if (node) {
        *node = g;
        node->hold = es->hold;
        node->hold_free = es->hold_free;
        node->next = *graves;
        *graves = node;
    } else if (g.n) { /* no memory to watch them: their buffer stays (a leak, not a write into
                         freed memory); UCX frees the requests when they end */
        for (int i = 0; i < g.n; i++) ucp_request_free(g.reqs[i]);
    } else if (es->hold)
        es->hold_free(es->hold);
    es->hold = NULL;
}

void xfer_graves_reap(xfer_grave **graves) {
    for (xfer_grave **p = graves; *p;) {
        xfer_grave *g = *p;
        int live = 0;
        for (int i = 0; i < g->n; i++)
            live += ucp_request_check_status(g->reqs[i]) == UCS_INPROGRESS;
        if (live) {
            p = &g->next;
            continue;
        }
        for (int i = 0; i < g->n; i++) ucp_request_free(g->reqs[i]);
        g->hold_free(g->hold);
        *p = g->next;
        free(g);
    }
}

void xfer_graves_bury(xfer_grave **graves) {
    while (*graves) {
        xfer_grave *g = *graves;
        *graves = g->next;
        g->hold_free(g->hold); /* (the requests went with their worker) */
        free(g);
    }
}

void xfer_close_ep(ucp_worker_h w, ucp_ep_h ep, ep_state *es, xfer_grave **graves) {
    ucp_request_param_t p = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                             .flags = es->failed ? UCP_EP_CLOSE_FLAG_FORCE : 0};
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
    double deadline = ds_now() + 2.0;
    if (r && !UCS_PTR_IS_ERR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS && ds_now() < deadline)
            if (!ucp_worker_progress(w)) xfer_sleep_us(20);
        ucp_request_free(r);
    }
    xfer_settle(w, es, deadline, graves);
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

int xfer_make_context(uint64_t features, ucp_context_h *ctx, ds_err *err) {
    pthread_once(&g_reuse_once, set_reuseaddr);
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) return ds_errf(err, "UCX: cannot read config");
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = features};
    ucs_status_t st = ucp_init(&p, cfg, ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) return ds_errf(err, "UCX: ucp_init failed: %s", ucs_status_string(st));
    return DS_OK;
}

int xfer_make_worker(ucp_context_h ctx, ucs_thread_mode_t mode, ucp_worker_h *w, ds_err *err) {
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = mode};
    ucs_status_t st = ucp_worker_create(ctx, &wp, w);
    if (st != UCS_OK) return ds_errf(err, "UCX: worker: %s", ucs_status_string(st));
    return DS_OK;
}

int xfer_resolve(const char *host, int port, struct sockaddr_in *sa, ds_err *err) {
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
