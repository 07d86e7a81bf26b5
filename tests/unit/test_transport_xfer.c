/* The P/D blob transfer over UCX (transport/xfer.h), a server and pulls in one process on the
 * loopback: the bytes arrive whole, a blob is pulled at most once, an unknown id and a dead port
 * fail with a message, a blob nobody pulls is freed when its time runs out or when a consumer
 * releases it, and a pull that races the filing waits for it. The client keeps its connection
 * and its buffers for the next pulls (counted, and the bytes still right; the bytes come on the
 * connection's data path), pulls from many
 * threads at once, survives a producer restarted on the same port behind a kept connection, and
 * outlives none of its buffers' users (one given back after the client's free). */
#include "transport/xfer.h"
#include "testutil.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static ds_xfer_client *g_c; /* each test's client (setup / teardown) */

static int client_up(void **st) {
    (void)st;
    ds_err err;
    return ds_xfer_client_create(&g_c, &err);
}

static int client_down(void **st) {
    (void)st;
    ds_xfer_client_free(g_c);
    g_c = NULL;
    return 0;
}

static void *pattern(size_t n, uint32_t seed) {
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)((i * 2654435761u + seed) >> 7);
    return b;
}

/* Pulls id (n bytes of pattern(n, seed)), one of `pulls` that share it, from port through g_c
 * and checks every byte. */
static void pull_shared_and_check(int port, uint64_t id, int pulls, size_t n, uint32_t seed) {
    void *got;
    size_t len;
    ds_err err = {{0}};
    assert_int_equal(
        ds_xfer_pull_shared(g_c, "127.0.0.1", port, id, pulls, n, 5000, &got, &len, &err), DS_OK);
    void *want = pattern(n, seed);
    assert_int_equal(len, n);
    assert_memory_equal(got, want, n);
    free(want);
    ds_xfer_buf_free(got);
}

static void pull_and_check(int port, uint64_t id, size_t n, uint32_t seed) {
    pull_shared_and_check(port, id, 1, n, seed);
}

static void test_pull_once(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 200, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    assert_true(port > 0);
    size_t n = (size_t)3 << 20; /* 3 MiB: many UCX fragments */
    assert_int_equal(ds_xfer_server_put(s, 42, pattern(n, 7), n, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 43, pattern(10, 9), 10, 60000, &err), DS_OK);
    ds_xfer_stats xs;
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.held, 2);
    assert_int_equal(xs.held_bytes, n + 10);

    void *got;
    size_t len;
    pull_and_check(port, 42, n, 7);
    /* pulled once: a second pull finds nothing and says so */
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 42, 10000, &got, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "not held"));
    assert_null(got);
    /* the server counts a pull once its send has completed, which can be just after the client
     * has returned */
    for (int i = 0; i < 200; i++) {
        ds_xfer_server_stats(s, &xs);
        if (xs.served + xs.not_found >= 2) break;
        usleep(10000);
    }
    assert_int_equal(xs.held, 1);
    assert_int_equal(xs.served, 1);
    assert_int_equal(xs.not_found, 1);
    ds_xfer_server_free(s); /* frees blob 43, never pulled (ASan's leak check sees it) */
}

static void test_expiry(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 5, pattern(100, 1), 100, 50, &err), DS_OK);
    ds_xfer_stats xs;
    for (int i = 0; i < 40; i++) { /* the serving thread sweeps at least every 100 ms */
        usleep(25000);
        ds_xfer_server_stats(s, &xs);
        if (xs.expired) break;
    }
    assert_int_equal(xs.expired, 1);
    assert_int_equal(xs.held, 0);
    assert_int_equal(xs.held_bytes, 0);
    void *got;
    size_t len;
    assert_int_equal(
        ds_xfer_pull(g_c, "127.0.0.1", ds_xfer_server_port(s), 5, 5000, &got, &len, &err), DS_ERR);
    ds_xfer_server_free(s);
}

/* A part that several ranks of a consumer's job need: held until as many pulls as the first one
 * said have been answered, each whole; a look (0 pulls) leaves it held and uncounted; a release
 * frees a shared blob whatever its count. */
static void test_shared_pulls(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    size_t n = (size_t)1 << 20;
    assert_int_equal(ds_xfer_server_put(s, 21, pattern(n, 3), n, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 22, pattern(700, 5), 700, 60000, &err), DS_OK);
    ds_xfer_stats xs;
    pull_shared_and_check(port, 21, 0, n, 3); /* a look: counts nothing */
    for (int i = 0; i < 3; i++) {
        ds_xfer_server_stats(s, &xs);
        assert_int_equal(xs.held, 2); /* still there for the pulls to come */
        pull_shared_and_check(port, 21, 3, n, 3);
    }
    /* (a pull is counted once its send has completed, which can be just after the client has
     * returned: a loaded machine saw 3 here) */
    for (int i = 0; i < 200 && (ds_xfer_server_stats(s, &xs), xs.served < 4); i++) usleep(10000);
    assert_int_equal(xs.held, 1);
    assert_int_equal(xs.held_bytes, 700);
    assert_int_equal(xs.served, 4);
    void *got;
    size_t len;
    assert_int_equal(ds_xfer_pull_shared(g_c, "127.0.0.1", port, 21, 3, 0, 5000, &got, &len, &err),
                     DS_ERR);
    assert_non_null(strstr(err.msg, "not held"));
    /* one of two pulls answered, then a release (the job refused it): freed now */
    pull_shared_and_check(port, 22, 2, 700, 5);
    assert_int_equal(ds_xfer_release(g_c, "127.0.0.1", port, 22, 5000, &err), DS_OK);
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.held, 0);
    assert_int_equal(xs.released, 1);
    assert_int_equal(ds_xfer_pull_shared(g_c, "127.0.0.1", port, 22, 2, 0, 5000, &got, &len, &err),
                     DS_ERR);
    assert_int_equal(ds_xfer_pull_shared(g_c, "127.0.0.1", port, 22, -1, 0, 5000, &got, &len, &err),
                     DS_ERR);
    /* a blob larger than the pull allows is refused before any memory is taken for it, and the
     * producer serves the next pull */
    assert_int_equal(ds_xfer_server_put(s, 23, pattern(5000, 1), 5000, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 24, pattern(300, 2), 300, 60000, &err), DS_OK);
    err.msg[0] = 0;
    assert_int_equal(
        ds_xfer_pull_shared(g_c, "127.0.0.1", port, 23, 1, 4999, 5000, &got, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "5000 bytes, more than the 4999"));
    pull_and_check(port, 24, 300, 2);
    ds_xfer_server_free(s);
}

/* A release frees a held blob at once (counted), after which it cannot be pulled; releasing an
 * id that is not held is an error naming it, and frees nothing else. */
static void test_release(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    assert_int_equal(ds_xfer_server_put(s, 11, pattern(5000, 2), 5000, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 12, pattern(300, 4), 300, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_release(g_c, "127.0.0.1", port, 11, 5000, &err), DS_OK);
    ds_xfer_stats xs;
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.released, 1);
    assert_int_equal(xs.held, 1);
    assert_int_equal(xs.held_bytes, 300);
    assert_int_equal(xs.served, 0);
    void *got;
    size_t len;
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 11, 5000, &got, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "not held"));
    err.msg[0] = 0;
    assert_int_equal(ds_xfer_release(g_c, "127.0.0.1", port, 99, 5000, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "0000000000000063"));
    /* the other blob is untouched and still pulls whole */
    pull_and_check(port, 12, 300, 4);
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.held, 0);
    assert_int_equal(xs.released, 1);
    ds_xfer_server_free(s);
}

typedef struct late_put {
    ds_xfer_server *s;
} late_put;

static void *put_later(void *arg) {
    late_put *lp = arg;
    usleep(100000);
    ds_err err;
    ds_xfer_server_put(lp->s, 77, pattern(1000, 3), 1000, 60000, &err);
    return NULL;
}

static void test_pull_waits_for_filing(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 2000, &s, &err), DS_OK);
    late_put lp = {s};
    pthread_t t;
    pthread_create(&t, NULL, put_later, &lp);
    pull_and_check(ds_xfer_server_port(s), 77, 1000, 3); /* before the filing: it waits */
    pthread_join(t, NULL);
    ds_xfer_server_free(s);
}

static void test_no_server(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    /* a port that was just free: listen, note it, close */
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    ds_xfer_server_free(s);
    void *got;
    size_t len;
    double t0 = ds_now();
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 1, 3000, &got, &len, &err), DS_ERR);
    assert_true(ds_now() - t0 < 5.0);
    assert_non_null(strstr(err.msg, "127.0.0.1"));
}

/* Three pulls of one producer: one connection, kept (the producer sees one open), the second and
 * third sent over it; the third, smaller, lands in the second's buffer once that is given back,
 * and every pull's bytes are its own blob's (a kept buffer's old bytes would show). A release
 * rides the same connection. */
static void test_connection_and_buffers_kept(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    const size_t n[3] = {(size_t)5 << 20, (size_t)3 << 20, 70000};
    for (int i = 0; i < 3; i++)
        assert_int_equal(ds_xfer_server_put(s, 20 + i, pattern(n[i], 30 + i), n[i], 60000, &err),
                         DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 29, pattern(10, 1), 10, 60000, &err), DS_OK);
    void *got[3];
    size_t len;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 20 + i, 10000, &got[i], &len, &err),
                         DS_OK);
        void *want = pattern(n[i], 30 + i);
        assert_int_equal(len, n[i]);
        assert_memory_equal(got[i], want, n[i]);
        free(want);
        if (i == 1) { /* the first stays out; the second goes back for the third */
            ds_xfer_buf_free(got[1]);
            got[1] = NULL;
        }
    }
    assert_true(got[2] != got[0]);
    ds_xfer_client_stats cs;
    ds_xfer_client_get_stats(g_c, &cs);
    assert_int_equal(cs.connects, 1);
    assert_int_equal(cs.reuses, 2);
    assert_int_equal(cs.buf_reuses, 1);
    assert_int_equal(cs.idle_conns, 1);
    assert_int_equal(cs.data_path, 3); /* the bytes came on the data path, not the stream */
    assert_int_equal(ds_xfer_release(g_c, "127.0.0.1", port, 29, 5000, &err), DS_OK);
    ds_xfer_client_get_stats(g_c, &cs);
    assert_int_equal(cs.connects, 1);
    assert_int_equal(cs.reuses, 3);
    ds_xfer_stats xs;
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.conns, 1);
    assert_int_equal(xs.released, 1);
    ds_xfer_buf_free(got[0]);
    ds_xfer_buf_free(got[2]);
    ds_xfer_client_get_stats(g_c, &cs);
    assert_true(cs.idle_bytes >= n[0] + n[1]); /* all three kept: well under the bound */
    /* the client's free closes its connection; the producer then closes its side */
    ds_xfer_client_free(g_c);
    g_c = NULL;
    for (int i = 0; i < 300 && (ds_xfer_server_stats(s, &xs), xs.conns); i++) usleep(10000);
    assert_int_equal(xs.conns, 0);
    assert_int_equal(xs.served, 3);
    assert_int_equal(xs.errors, 0);
    ds_xfer_server_free(s);
}

typedef struct puller {
    int port, k;
    int ok;
} puller;

static void *pull_thread(void *arg) {
    puller *p = arg;
    p->ok = 1;
    for (int j = 0; j < 4; j++) {
        uint64_t id = 1000 + (uint64_t)p->k * 10 + (uint64_t)j;
        size_t n = 100000 + (size_t)p->k * 7919 + (size_t)j * 131;
        void *got;
        size_t len;
        ds_err err;
        if (ds_xfer_pull(g_c, "127.0.0.1", p->port, id, 20000, &got, &len, &err)) {
            p->ok = 0;
            continue;
        }
        void *want = pattern(n, (uint32_t)id);
        p->ok &= len == n && !memcmp(got, want, n);
        free(want);
        ds_xfer_buf_free(got);
    }
    return NULL;
}

/* Four threads pull four blobs each from one producer at once through one client: every blob
 * arrives whole and is its own, and connections are shared out, never more than the threads. */
static void test_threads_pull_at_once(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 2000, &s, &err), DS_OK);
    enum { T = 4 };
    for (int k = 0; k < T; k++)
        for (int j = 0; j < 4; j++) {
            uint64_t id = 1000 + (uint64_t)k * 10 + (uint64_t)j;
            size_t n = 100000 + (size_t)k * 7919 + (size_t)j * 131;
            assert_int_equal(ds_xfer_server_put(s, id, pattern(n, (uint32_t)id), n, 60000, &err),
                             DS_OK);
        }
    puller p[T];
    pthread_t t[T];
    for (int k = 0; k < T; k++) {
        p[k] = (puller){ds_xfer_server_port(s), k, 0};
        pthread_create(&t[k], NULL, pull_thread, &p[k]);
    }
    for (int k = 0; k < T; k++) {
        pthread_join(t[k], NULL);
        assert_true(p[k].ok);
    }
    ds_xfer_client_stats cs;
    ds_xfer_client_get_stats(g_c, &cs);
    assert_true(cs.connects >= 1 && cs.connects <= T);
    assert_int_equal(cs.connects + cs.reuses, 4 * T);
    ds_xfer_stats xs;
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.held, 0);
    ds_xfer_server_free(s);
}

/* A consumer that gives up in the middle of a pull (its deadline passes between the header and
 * the bytes; its connection is dropped): the producer's send to it fails or goes nowhere, the
 * blob is not served twice, the producer serves the next consumer, and nothing of the abandoned
 * send outlives the server (ASan's LeakSanitizer watches the buffer a parked send held). */
static void test_consumer_gives_up_mid_pull(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    size_t n = (size_t)8 << 20;
    assert_int_equal(ds_xfer_server_put(s, 31, pattern(n, 6), n, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 32, pattern(4000, 8), 4000, 60000, &err), DS_OK);
    ds_xfer_server_test_stall(s, 1500);
    void *got = NULL;
    size_t len = 0;
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 31, 400, &got, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "timed out"));
    assert_null(got);
    ds_xfer_server_test_stall(s, 0);
    ds_xfer_stats xs;
    for (int i = 0; i < 1000 && (ds_xfer_server_stats(s, &xs), xs.served + xs.errors < 1); i++)
        usleep(10000); /* the stalled send ends: delivered into nothing, or failed */
    assert_int_equal(xs.served + xs.errors, 1);
    assert_int_equal(xs.held, 1); /* 31 went with its pull, whatever became of the send */
    ds_xfer_client *c2;
    assert_int_equal(ds_xfer_client_create(&c2, &err), DS_OK);
    assert_int_equal(ds_xfer_pull(c2, "127.0.0.1", port, 32, 5000, &got, &len, &err), DS_OK);
    void *want = pattern(4000, 8);
    assert_int_equal(len, 4000);
    assert_memory_equal(got, want, 4000);
    free(want);
    ds_xfer_buf_free(got);
    assert_int_equal(ds_xfer_pull(c2, "127.0.0.1", port, 31, 2000, &got, &len, &err), DS_ERR);
    ds_xfer_client_free(c2);
    ds_xfer_server_free(s);
}

/* The producer stops and another starts on the same port: the client's kept connection is dead,
 * and the next pull still succeeds (one retry on a new connection), not a failure. */
static void test_producer_restarted_behind_kept_connection(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    assert_int_equal(ds_xfer_server_put(s, 1, pattern(1000, 1), 1000, 60000, &err), DS_OK);
    pull_and_check(port, 1, 1000, 1);
    ds_xfer_server_free(s);
    int rc = DS_ERR;
    for (int i = 0; i < 50 && rc; i++) { /* the port may take a moment to be free again */
        rc = ds_xfer_server_create("127.0.0.1", port, 0, &s, &err);
        if (rc) usleep(100000);
    }
    assert_int_equal(rc, DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 2, pattern(2000, 2), 2000, 60000, &err), DS_OK);
    pull_and_check(port, 2, 2000, 2);
    ds_xfer_client_stats cs;
    ds_xfer_client_get_stats(g_c, &cs);
    assert_int_equal(cs.connects, 2);
    assert_true(cs.retries <= 1); /* the dead connection is found before or by the request */
    ds_xfer_server_free(s);
}

/* A buffer given back twice (a caller's bug) is kept once: the second is refused with a message,
 * not a second entry in the idle list that two later pulls would both receive into. */
static void test_buffer_given_back_twice(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    for (uint64_t id = 1; id <= 3; id++)
        assert_int_equal(ds_xfer_server_put(s, id, pattern(1000, (uint32_t)id), 1000, 60000, &err),
                         DS_OK);
    void *got;
    size_t len;
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 1, 5000, &got, &len, &err), DS_OK);
    ds_xfer_buf_free(got);
    ds_xfer_buf_free(got); /* refused */
    ds_xfer_client_stats cs;
    ds_xfer_client_get_stats(g_c, &cs);
    assert_int_equal(cs.idle_bytes, (size_t)2 << 20); /* one 2 MiB mapping, kept once */
    void *a, *b;
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 2, 5000, &a, &len, &err), DS_OK);
    assert_int_equal(ds_xfer_pull(g_c, "127.0.0.1", port, 3, 5000, &b, &len, &err), DS_OK);
    assert_true(a != b);
    void *want = pattern(1000, 2);
    assert_memory_equal(a, want, 1000);
    free(want);
    ds_xfer_buf_free(a);
    ds_xfer_buf_free(b);
    ds_xfer_server_free(s);
}

/* A buffer given back after its client was freed (a pulled transfer still waiting for its
 * request's admission when the engine stops) is unmapped then, and the client with it: ASan and
 * LeakSanitizer see a use after free or a leak if not. */
static void test_buffer_outlives_client(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_client *c;
    assert_int_equal(ds_xfer_client_create(&c, &err), DS_OK);
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 0, &s, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 3, pattern(4096, 3), 4096, 60000, &err), DS_OK);
    void *got;
    size_t len;
    assert_int_equal(
        ds_xfer_pull(c, "127.0.0.1", ds_xfer_server_port(s), 3, 5000, &got, &len, &err), DS_OK);
    ds_xfer_client_free(c);
    void *want = pattern(4096, 3);
    assert_memory_equal(got, want, 4096); /* still the client's, still readable */
    free(want);
    ds_xfer_buf_free(got);
    ds_xfer_server_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_pull_once, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_expiry, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_release, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_shared_pulls, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_pull_waits_for_filing, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_no_server, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_connection_and_buffers_kept, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_threads_pull_at_once, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_producer_restarted_behind_kept_connection, client_up,
                                        client_down),
        cmocka_unit_test_setup_teardown(test_consumer_gives_up_mid_pull, client_up, client_down),
        cmocka_unit_test_setup_teardown(test_buffer_given_back_twice, client_up, client_down),
        cmocka_unit_test(test_buffer_outlives_client),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
