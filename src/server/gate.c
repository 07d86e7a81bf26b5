/* gate.c — accepting connections, checking their first head, deadlines (see gate.h).
 *
 * One thread does it all with poll(): the listen socket, the connections whose head is pending
 * (peeked, never read, so libmicrohttpd later reads every byte itself) and the ones lingering
 * after a refusal. A pending connection's socket gets SO_RCVLOWAT one byte above what was peeked,
 * so poll wakes when more arrives rather than at once for bytes already looked at.
 *
 * Table slots change state under g->mu: FREE -> HEAD (accepted) -> MHD (handed over; freed by
 * libmicrohttpd's close notice) or -> LINGER (refused) -> FREE. Only the gate thread moves a slot
 * out of FREE, HEAD and LINGER, so it reads those without the lock. */
#include "server/gate.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <linux/tcp.h> /* struct tcp_info with tcpi_bytes_received (glibc's lacks it) */
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server/openai.h"
#include "server/reqhead.h"

enum {
    TICK_MS = 250,         /* deadlines on libmicrohttpd's connections are looked at this often */
    LINGER_MS = 2000,      /* a refused connection's input is drained this long, so closing
                              it with unread bytes does not reset it before the answer */
    LINGER_MAX = 1 << 20,  /* ... and this many bytes at most */
    BACKLOG = 1024,        /* the listen socket's queue */
    STALL_MS = 50,         /* a head that woke poll without new bytes waits this long */
    ACCEPT_PAUSE_MS = 100, /* out of file descriptors: accept again after this long */
    CHUNKED_PEEK = 32 * 1024, /* a chunked body is checked as far as this much of it */
    PEEK_MAX = DS_HEAD_MAX_BYTES + CHUNKED_PEEK, /* bytes peeked at most */
};

typedef enum { S_FREE = 0, S_HEAD, S_LINGER, S_MHD } slot_state;

typedef struct conn {
    slot_state state; /* guarded by mu */
    int fd;
    int bound; /* S_MHD: libmicrohttpd reported it started (its socket context is this slot) */
    struct sockaddr_storage addr;
    socklen_t addrlen;
    double deadline;  /* S_HEAD: the head's; S_LINGER: when to close */
    double next_look; /* S_HEAD: not polled before (a stall, see STALL_MS) */
    size_t peeked;    /* S_HEAD: bytes seen at the last look */
    size_t drained;   /* S_LINGER: bytes read and dropped */
    int body_wait;    /* S_HEAD: the head is whole, its chunked body awaited (body deadline) */
    ds_gate *g;
    /* S_MHD, the connection thread's: the wire bytes of its requests so far, for knowing whether
     * libmicrohttpd holds bytes of the next one (then its head cannot be peeked) */
    int track;                 /* 0: not known (chunked, pipelined, closing): no more peeking */
    size_t head_len;           /* the current request's head (with a chunked body), as peeked */
    unsigned long long expect; /* bytes of the requests before it */
    ds_oai_error next_bad;     /* status 0, or: the request pipelined after this one, seen
                                  malformed when this one was peeked */
    _Atomic(double) t_phase;   /* S_MHD: when phase began */
    atomic_int phase;          /* S_MHD: ds_conn_phase */
} conn;

struct ds_gate {
    ds_gate_opts o;
    int lfd; /* listen socket */
    int port;
    int wake[2]; /* a pipe: ds_gate_stop wakes the thread */
    pthread_t th;
    int started;
    atomic_int stop, quiesced;
    struct MHD_Daemon *mhd;
    pthread_mutex_t mu;
    conn *slots; /* [n_slots] the connection table */
    int n_slots;
    atomic_int n_used;
    char *buf;          /* [PEEK_MAX] the gate thread's peek buffer */
    struct pollfd *pfd; /* [n_slots + 2] */
    int *pidx;          /* [n_slots + 2] slot of each pfd entry (-1: not a slot) */
};

/* ---------------------------------------------------------------------------------------------
 * the table */

static int same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return 0;
    if (a->ss_family == AF_INET)
        return !memcmp(&((const struct sockaddr_in *)a)->sin_addr,
                       &((const struct sockaddr_in *)b)->sin_addr, sizeof(struct in_addr));
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr,
                       &((const struct sockaddr_in6 *)b)->sin6_addr, sizeof(struct in6_addr));
    return 0;
}

/* A free slot for a new connection from addr, or NULL when the table or the address's share of
 * it is full (mu held). */
static conn *slot_take(ds_gate *g, const struct sockaddr_storage *addr) {
    conn *free_slot = NULL;
    int same = 0;
    for (int i = 0; i < g->n_slots; i++) {
        conn *c = &g->slots[i];
        if (c->state == S_FREE) {
            if (!free_slot) free_slot = c;
        } else if (g->o.max_per_ip > 0 && same_host(&c->addr, addr)) {
            same++;
        }
    }
    if (!free_slot || (g->o.max_per_ip > 0 && same >= g->o.max_per_ip)) return NULL;
    return free_slot;
}

static void slot_free(ds_gate *g, conn *c) {
    c->state = S_FREE;
    c->fd = -1;
    atomic_fetch_sub(&g->n_used, 1);
}

/* ---------------------------------------------------------------------------------------------
 * answers written by the gate itself */

/* Writes e as a whole HTTP/1.1 response that closes the connection. Best effort: the socket is
 * fresh (or idle), so the few hundred bytes fit its send buffer. */
static void write_error(int fd, const ds_oai_error *e) {
    char *body = ds_oai_error_json(e);
    const char *reason = MHD_get_reason_phrase_for((unsigned)e->status);
    char msg[1024]; /* [1024] head + body: the body is under 900 bytes (message[640] escaped) */
    int n = snprintf(msg, sizeof msg,
                     "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: "
                     "%zu\r\nConnection: close\r\n\r\n%s",
                     e->status, reason && reason[0] ? reason : "Error", body ? strlen(body) : 0,
                     body ? body : "");
    free(body);
    if (n > 0) send(fd, msg, (size_t)DS_MIN(n, (int)sizeof msg - 1), MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void set_rcvlowat(int fd, int n) {
    setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &n, sizeof n);
}

/* Answers a refused head and lingers: the client's unread bytes are drained before the close. */
static void refuse(conn *c, const ds_oai_error *e, double now) {
    write_error(c->fd, e);
    shutdown(c->fd, SHUT_WR);
    set_rcvlowat(c->fd, 1);
    c->state = S_LINGER; /* HEAD -> LINGER: both the gate thread's, no lock needed */
    c->deadline = now + LINGER_MS * 1e-3;
    c->drained = 0;
}

/* ---------------------------------------------------------------------------------------------
 * the gate thread */

static void accept_all(ds_gate *g, double now, double *pause_until) {
    for (;;) {
        struct sockaddr_storage addr;
        socklen_t len = sizeof addr;
        int fd = accept4(g->lfd, (struct sockaddr *)&addr, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                *pause_until = now + ACCEPT_PAUSE_MS * 1e-3;
            return; /* EAGAIN: all taken; others (ECONNABORTED, ...): poll again */
        }
        pthread_mutex_lock(&g->mu);
        conn *c = slot_take(g, &addr);
        if (c) {
            *c = (conn){.state = S_HEAD,
                        .fd = fd,
                        .addr = addr,
                        .addrlen = len,
                        .deadline = now + g->o.header_timeout_s,
                        .g = g};
            atomic_fetch_add(&g->n_used, 1);
        }
        pthread_mutex_unlock(&g->mu);
        if (!c) close(fd); /* full, in all or for this address: closed at once */
    }
}

/* Hands a connection with a whole, good head to libmicrohttpd. */
static void hand_over(ds_gate *g, conn *c, size_t wire, const ds_oai_error *next, double now) {
    set_rcvlowat(c->fd, 1);
    pthread_mutex_lock(&g->mu);
    c->state = S_MHD;
    c->bound = 0;
    c->track = wire > 0;
    c->head_len = wire;
    c->expect = 0;
    c->next_bad = *next;
    atomic_store(&c->t_phase, now);
    atomic_store(&c->phase, DS_CONN_WAIT);
    pthread_mutex_unlock(&g->mu);
    if (MHD_add_connection(g->mhd, c->fd, (const struct sockaddr *)&c->addr, c->addrlen) == MHD_YES)
        return;
    /* refused (MHD's own limit, out of memory): MHD closed the socket */
    pthread_mutex_lock(&g->mu);
    if (c->state == S_MHD && !c->bound) slot_free(g, c);
    pthread_mutex_unlock(&g->mu);
}

typedef enum { V_WAIT = 0, V_PASS, V_REFUSE } verdict;

/* Judges the n bytes peeked from a connection: V_PASS when its head is whole and good and, for
 * a chunked body (unless it waits for "100 Continue"), that body is whole and good too or fills
 * the peek window (libmicrohttpd reads the rest unchecked); V_REFUSE, *e says why; V_WAIT for
 * more. *head_len: the head's size once whole, else 0. On V_PASS: *wire, the bytes of the head
 * and a chunked body (a head alone for other framings; 0 when a chunked body is not whole in b),
 * and *next (status 0 if not), the refusal of a malformed request pipelined behind it in b. */
static verdict judge(const char *b, size_t n, size_t *head_len, size_t *wire, ds_oai_error *e,
                     ds_oai_error *next) {
    next->status = 0;
    *wire = 0;
    ds_head_status st = ds_http_check_head(b, n, DS_HEAD_MAX_BYTES, head_len, e);
    if (st != DS_HEAD_OK) {
        *head_len = 0;
        return st == DS_HEAD_BAD ? V_REFUSE : V_WAIT;
    }
    unsigned f = ds_http_head_flags(b, *head_len);
    unsigned long long end = 0, cl; /* where the request ends, when known and within b */
    size_t body_len = 0, next_len;
    if (f & DS_HEAD_CHUNKED) {
        if (f & DS_HEAD_EXPECT100) return V_PASS;
        st = ds_http_check_chunked(b + *head_len, n - *head_len, &body_len, e);
        if (st == DS_HEAD_BAD) return V_REFUSE;
        if (st != DS_HEAD_OK) return n >= PEEK_MAX ? V_PASS : V_WAIT;
        end = *wire = *head_len + body_len;
    } else {
        *wire = *head_len;
        if (ds_http_head_content_length(b, *head_len, &cl)) end = *head_len + cl;
    }
    if (end && end < n &&
        ds_http_check_head(b + end, n - (size_t)end, DS_HEAD_MAX_BYTES, &next_len, next) !=
            DS_HEAD_BAD)
        next->status = 0;
    return V_PASS;
}

/* The 408 of a request not whole by its deadline (body: its head was, its body was not). */
static void timed_out(ds_oai_error *e, const ds_gate *g, int body) {
    if (body)
        ds_oai_errorf(e, 408, NULL, "request_timeout",
                      "the request body did not arrive whole within %g s of its head",
                      g->o.body_timeout_s);
    else
        ds_oai_errorf(e, 408, NULL, "request_timeout",
                      "the request head did not arrive whole within %g s", g->o.header_timeout_s);
}

static void half_closed(ds_oai_error *e, int body) {
    ds_oai_errorf(e, 400, NULL, "malformed_request",
                  "the connection was closed in the middle of the request %s",
                  body ? "body" : "head");
}

/* More bytes (or a hang-up) on a connection whose head is pending. */
static void look_at_head(ds_gate *g, conn *c, short revents, double now) {
    ssize_t n = recv(c->fd, g->buf, PEEK_MAX, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) { /* closed (or failed) before its head was whole: nothing to answer */
        close(c->fd);
        pthread_mutex_lock(&g->mu);
        slot_free(g, c);
        pthread_mutex_unlock(&g->mu);
        return;
    }
    size_t head_len = 0, wire;
    ds_oai_error e, next;
    verdict v = judge(g->buf, (size_t)n, &head_len, &wire, &e, &next);
    if (v == V_PASS) return hand_over(g, c, wire, &next, now);
    if (v == V_REFUSE) return refuse(c, &e, now);
    if (head_len && !c->body_wait) /* from now on the body's deadline */
        c->body_wait = 1, c->deadline = now + g->o.body_timeout_s;
    if (revents & (POLLRDHUP | POLLHUP | POLLERR)) { /* half a request, and no more will come */
        half_closed(&e, c->body_wait);
        return refuse(c, &e, now);
    }
    /* woken without new bytes (SO_RCVLOWAT not honoured): look again a little later */
    if ((size_t)n == c->peeked) c->next_look = now + STALL_MS * 1e-3;
    c->peeked = (size_t)n;
    set_rcvlowat(c->fd, (int)n + 1);
}

static void drain(ds_gate *g, conn *c) {
    for (;;) {
        ssize_t n = recv(c->fd, g->buf, DS_HEAD_MAX_BYTES, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (n <= 0 || (c->drained += (size_t)n) > LINGER_MAX) {
            c->deadline = 0; /* closed at the next deadline pass */
            return;
        }
    }
}

/* The deadline of a connection libmicrohttpd holds (0: none). */
static double mhd_deadline(const ds_gate *g, conn *c) {
    int p = atomic_load(&c->phase);
    double t = atomic_load(&c->t_phase);
    if (p == DS_CONN_BODY) return t + g->o.body_timeout_s;
    if (p == DS_CONN_WAIT) return t + g->o.idle_timeout_s + g->o.header_timeout_s;
    return 0;
}

/* Connections past their deadline: a pending head gets 408, a lingering one is closed, one of
 * libmicrohttpd's gets 408 and a shutdown (its thread then sees the end and closes it). */
static void deadlines(ds_gate *g, double now) {
    ds_oai_error e;
    pthread_mutex_lock(&g->mu);
    for (int i = 0; i < g->n_slots; i++) {
        conn *c = &g->slots[i];
        if (c->state == S_HEAD && now >= c->deadline) {
            timed_out(&e, g, c->body_wait);
            refuse(c, &e, now);
        } else if (c->state == S_LINGER && now >= c->deadline) {
            close(c->fd);
            slot_free(g, c);
        } else if (c->state == S_MHD && c->bound) {
            double d = mhd_deadline(g, c);
            if (d <= 0 || now < d) continue;
            timed_out(&e, g, atomic_load(&c->phase) == DS_CONN_BODY);
            write_error(c->fd, &e);
            shutdown(c->fd, SHUT_RDWR);
            atomic_store(&c->phase, DS_CONN_SERVING); /* once */
        }
    }
    pthread_mutex_unlock(&g->mu);
}

/* Fills the poll set; returns its size and lowers *wake_ms to the nearest deadline. */
static int poll_set(ds_gate *g, double now, double pause_until, int *wake_ms) {
    int n = 0;
    g->pfd[n] = (struct pollfd){.fd = g->wake[0], .events = POLLIN};
    g->pidx[n++] = -1;
    if (!atomic_load(&g->quiesced) && now >= pause_until) {
        g->pfd[n] = (struct pollfd){.fd = g->lfd, .events = POLLIN};
        g->pidx[n++] = -1;
    }
    for (int i = 0; i < g->n_slots; i++) {
        conn *c = &g->slots[i];
        if (c->state != S_HEAD && c->state != S_LINGER) continue;
        int ms = (int)((c->deadline - now) * 1e3) + 1;
        if (ms < *wake_ms) *wake_ms = DS_MAX(ms, 0);
        if (c->state == S_HEAD && c->next_look > now) {
            *wake_ms = DS_MIN(*wake_ms, (int)((c->next_look - now) * 1e3) + 1);
            continue;
        }
        g->pfd[n] = (struct pollfd){.fd = c->fd, .events = POLLIN | POLLRDHUP};
        g->pidx[n++] = i;
    }
    return n;
}

static void *gate_main(void *arg) {
    ds_gate *g = arg;
    double pause_until = 0;
    while (!atomic_load(&g->stop)) {
        double now = ds_now();
        int wake_ms = TICK_MS;
        int n = poll_set(g, now, pause_until, &wake_ms);
        if (poll(g->pfd, (nfds_t)n, wake_ms) < 0 && errno != EINTR) break;
        now = ds_now();
        for (int k = 0; k < n; k++) {
            short re = g->pfd[k].revents;
            if (!re) continue;
            if (g->pidx[k] < 0) {
                if (g->pfd[k].fd == g->lfd) accept_all(g, now, &pause_until);
                continue; /* the wake pipe: the loop's condition says why */
            }
            conn *c = &g->slots[g->pidx[k]];
            if (c->state == S_HEAD)
                look_at_head(g, c, re, now);
            else if (c->state == S_LINGER)
                drain(g, c);
        }
        deadlines(g, now); /* a scan of the table: cheap next to a wake-up's syscalls */
    }
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * libmicrohttpd's side */

void ds_gate_notify(void *cls, struct MHD_Connection *mc, void **socket_context,
                    enum MHD_ConnectionNotificationCode toe) {
    ds_gate *g = cls;
    pthread_mutex_lock(&g->mu);
    conn *c = *socket_context;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(mc, MHD_CONNECTION_INFO_CONNECTION_FD);
        for (int i = 0; ci && i < g->n_slots && !c; i++)
            if (g->slots[i].state == S_MHD && !g->slots[i].bound &&
                g->slots[i].fd == ci->connect_fd)
                c = &g->slots[i];
        if (c) c->bound = 1, *socket_context = c;
    } else if (c && c->state == S_MHD) {
        slot_free(g, c);
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&g->mu);
}

static conn *conn_of(struct MHD_Connection *mc) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(mc, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

void ds_gate_phase(struct MHD_Connection *mc, ds_conn_phase p) {
    conn *c = conn_of(mc);
    if (!c) return;
    atomic_store(&c->t_phase, ds_now()); /* before the phase: the reaper reads them the other way */
    atomic_store(&c->phase, (int)p);
}

/* ---------------------------------------------------------------------------------------------
 * a kept-alive connection's next head, peeked in its own thread */

void ds_gate_untracked(struct MHD_Connection *mc) {
    conn *c = conn_of(mc);
    if (c) c->track = 0;
}

/* Bytes libmicrohttpd has read from the socket (received, less those still queued), or -1. The
 * queue is read before and after: bytes arriving between the calls would skew the difference, so
 * such a reading is taken again. (A client that sends its next request as soon as it has read a
 * response lands it in this window often enough: the one try that was here lost the connection's
 * tracking then, and libmicrohttpd answered a malformed next request in HTML.) */
static long long consumed(int fd) {
    for (int tries = 0; tries < 16; tries++) {
        struct tcp_info ti;
        socklen_t len = sizeof ti;
        int q0 = 0, q1 = 0;
        if (ioctl(fd, FIONREAD, &q0) || getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) ||
            len < sizeof ti || ioctl(fd, FIONREAD, &q1))
            return -1;
        if (q0 == q1) return (long long)ti.tcpi_bytes_received - q0;
    }
    return -1;
}

/* Waits for fd to be readable (or hung up) until `until` or the gate stops: its poll events, 0
 * when it was not. */
static short wait_readable(ds_gate *g, int fd, double until) {
    for (;;) {
        double now = ds_now();
        if (now >= until || atomic_load(&g->stop)) return 0;
        struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
        int ms = DS_MIN((int)((until - now) * 1e3) + 1, 100); /* the stop flag, now and then */
        if (poll(&p, 1, ms) > 0) return p.revents ? p.revents : POLLIN;
    }
}

/* Refuses a head in the connection's thread: the answer, then the client's bytes drained (so
 * the close does not reset the connection before the answer is read), then libmicrohttpd sees
 * the end of input and closes it. */
static void refuse_here(ds_gate *g, conn *c, const ds_oai_error *e, char *buf) {
    write_error(c->fd, e);
    shutdown(c->fd, SHUT_WR);
    set_rcvlowat(c->fd, 1);
    double until = ds_now() + LINGER_MS * 1e-3;
    for (size_t drained = 0; drained < LINGER_MAX && wait_readable(g, c->fd, until);) {
        ssize_t n = recv(c->fd, buf, DS_HEAD_MAX_BYTES, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) break;
        if (n > 0) drained += (size_t)n;
    }
    shutdown(c->fd, SHUT_RD);
}

/* Peeks the next head as the gate peeks a first one: the idle timeout for its first byte, then
 * the head deadline for the rest. Returns with the head whole and good (libmicrohttpd reads it),
 * or refused, or on a timeout of silence (libmicrohttpd's own then closes the connection). */
static void vet_next_head(ds_gate *g, conn *c) {
    char buf[PEEK_MAX]; /* [PEEK_MAX] the peeked request */
    double until = ds_now() + g->o.idle_timeout_s, first = 0;
    size_t seen = 0;
    int body_wait = 0;
    ds_oai_error e, next;
    for (;;) {
        short re = wait_readable(g, c->fd, until);
        if (!re) {
            if (!first || atomic_load(&g->stop)) break;
            timed_out(&e, g, body_wait);
            refuse_here(g, c, &e, buf);
            break;
        }
        ssize_t n = recv(c->fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        if (n <= 0) break; /* closed: libmicrohttpd sees it too */
        if (!first) first = ds_now(), until = first + g->o.header_timeout_s;
        size_t head_len = 0, wire;
        verdict v = judge(buf, (size_t)n, &head_len, &wire, &e, &next);
        if (v == V_PASS) {
            c->head_len = wire;
            c->track = wire > 0;
            c->next_bad = next;
            break;
        }
        if (v == V_REFUSE || (re & (POLLRDHUP | POLLHUP | POLLERR))) {
            if (v != V_REFUSE) half_closed(&e, head_len > 0);
            refuse_here(g, c, &e, buf);
            break;
        }
        if (head_len && !body_wait) body_wait = 1, until = ds_now() + g->o.body_timeout_s;
        if ((size_t)n == seen) usleep(STALL_MS * 1000); /* SO_RCVLOWAT not honoured */
        seen = (size_t)n;
        set_rcvlowat(c->fd, (int)n + 1);
    }
    set_rcvlowat(c->fd, 1);
}

void ds_gate_request_done(struct MHD_Connection *mc, int kept, unsigned long long body_bytes) {
    conn *c = conn_of(mc);
    if (!c || !c->track) return;
    c->expect += c->head_len + body_bytes;
    long long got = consumed(c->fd);
    if (kept && c->next_bad.status && got > (long long)c->expect) {
        /* libmicrohttpd holds the pipelined next request, seen malformed when this one was
         * peeked: refused now, after this response, before libmicrohttpd answers it in HTML
         * (its answer then finds the socket shut) */
        write_error(c->fd, &c->next_bad);
        shutdown(c->fd, SHUT_RDWR);
        c->track = 0;
        return;
    }
    c->next_bad.status = 0;
    /* libmicrohttpd read exactly the requests so far: the next head is all still in the socket */
    if (!kept || got != (long long)c->expect) {
        c->track = 0;
        return;
    }
    atomic_store(&c->phase, DS_CONN_SERVING); /* deadlines are this thread's own for now */
    vet_next_head(c->g, c);
    atomic_store(&c->t_phase, ds_now());
    atomic_store(&c->phase, DS_CONN_WAIT);
}

/* ---------------------------------------------------------------------------------------------
 * life cycle */

static int listen_on(ds_gate *g, ds_err *err) {
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", g->o.port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICSERV | AI_PASSIVE},
                    *ai = NULL;
    int rc = getaddrinfo(g->o.host, port_s, &hints, &ai);
    if (rc) return ds_errf(err, "--host %s: %s", g->o.host, gai_strerror(rc));
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
    }
    if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, BACKLOG)) {
        int e = errno;
        if (fd >= 0) close(fd);
        freeaddrinfo(ai);
        return ds_errf(err, "could not listen on %s:%d (%s; is the port in use?)", g->o.host,
                       g->o.port, strerror(e));
    }
    freeaddrinfo(ai);
    struct sockaddr_storage a;
    socklen_t len = sizeof a;
    g->port = g->o.port;
    if (!getsockname(fd, (struct sockaddr *)&a, &len))
        g->port = ntohs(a.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a)->sin6_port
                                                : ((struct sockaddr_in *)&a)->sin_port);
    g->lfd = fd;
    return DS_OK;
}

int ds_gate_create(const ds_gate_opts *o, ds_gate **out, ds_err *err) {
    *out = NULL;
    ds_gate *g = ds_calloc(1, sizeof *g, err);
    if (!g) return DS_ERR;
    g->o = *o;
    g->lfd = g->wake[0] = g->wake[1] = -1;
    g->n_slots = DS_MAX(o->max_connections, 1);
    pthread_mutex_init(&g->mu, NULL);
    g->slots = calloc((size_t)g->n_slots, sizeof *g->slots);
    g->buf = malloc(PEEK_MAX);
    g->pfd = calloc((size_t)g->n_slots + 2, sizeof *g->pfd);
    g->pidx = calloc((size_t)g->n_slots + 2, sizeof *g->pidx);
    if (!g->slots || !g->buf || !g->pfd || !g->pidx || pipe2(g->wake, O_CLOEXEC | O_NONBLOCK)) {
        ds_gate_destroy(g);
        return ds_errf(err, "server: out of memory (or file descriptors) for the connection "
                            "table");
    }
    for (int i = 0; i < g->n_slots; i++) g->slots[i].fd = -1;
    if (listen_on(g, err)) {
        ds_gate_destroy(g);
        return DS_ERR;
    }
    *out = g;
    return DS_OK;
}

int ds_gate_port(const ds_gate *g) {
    return g->port;
}

int ds_gate_start(ds_gate *g, struct MHD_Daemon *mhd, ds_err *err) {
    g->mhd = mhd;
    if (pthread_create(&g->th, NULL, gate_main, g))
        return ds_errf(err, "server: could not start the accepting thread");
    g->started = 1;
    return DS_OK;
}

void ds_gate_quiesce(ds_gate *g) {
    atomic_store(&g->quiesced, 1);
    if (g->wake[1] >= 0 && write(g->wake[1], "q", 1) < 0) { /* full: the thread is awake anyway */
    }
}

int ds_gate_open(ds_gate *g) {
    return atomic_load(&g->n_used);
}

void ds_gate_stop(ds_gate *g) {
    if (!g || !g->started) return;
    atomic_store(&g->stop, 1);
    if (write(g->wake[1], "s", 1) < 0) { /* full: the thread is awake anyway */
    }
    pthread_join(g->th, NULL);
    g->started = 0;
    pthread_mutex_lock(&g->mu);
    for (int i = 0; i < g->n_slots; i++)
        if (g->slots[i].state == S_HEAD || g->slots[i].state == S_LINGER) {
            close(g->slots[i].fd);
            slot_free(g, &g->slots[i]);
        }
    pthread_mutex_unlock(&g->mu);
}

void ds_gate_destroy(ds_gate *g) {
    if (!g) return;
    ds_gate_stop(g);
    if (g->lfd >= 0) close(g->lfd);
    for (int i = 0; i < 2; i++)
        if (g->wake[i] >= 0) close(g->wake[i]);
    pthread_mutex_destroy(&g->mu);
    free(g->slots);
    free(g->buf);
    free(g->pfd);
    free(g->pidx);
    free(g);
}
