/* The P/D blob transfer over UCX (transport/xfer.h), a server and pulls in one process on the
 * loopback: the bytes arrive whole, a blob is pulled at most once, an unknown id and a dead port
 * fail with a message, a blob nobody pulls is freed when its time runs out or when a consumer
 * releases it, and a pull that races the filing waits for it. */
#include "transport/xfer.h"
#include "testutil.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *pattern(size_t n, uint32_t seed) {
    uint8_t *b = malloc(n);
    for (size_t i = 0; i < n; i++) b[i] = (uint8_t)((i * 2654435761u + seed) >> 7);
    return b;
}

static void test_pull_once(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_xfer_server *s;
    assert_int_equal(ds_xfer_server_create("127.0.0.1", 0, 200, &s, &err), DS_OK);
    int port = ds_xfer_server_port(s);
    assert_true(port > 0);
    size_t n = (size_t)3 << 20; /* 3 MiB: many UCX fragments */
    void *want = pattern(n, 7);
    assert_int_equal(ds_xfer_server_put(s, 42, pattern(n, 7), n, 60000, &err), DS_OK);
    assert_int_equal(ds_xfer_server_put(s, 43, pattern(10, 9), 10, 60000, &err), DS_OK);
    ds_xfer_stats xs;
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.held, 2);
    assert_int_equal(xs.held_bytes, n + 10);

    void *got;
    size_t len;
    assert_int_equal(ds_xfer_pull("127.0.0.1", port, 42, 10000, &got, &len, &err), DS_OK);
    assert_int_equal(len, n);
    assert_memory_equal(got, want, n);
    free(got);
    /* pulled once: a second pull finds nothing and says so */
    assert_int_equal(ds_xfer_pull("127.0.0.1", port, 42, 10000, &got, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "not held"));
    assert_null(got);
    /* the server counts a pull when its connection has ended, which can be just after the
     * client has returned */
    for (int i = 0; i < 200; i++) {
        ds_xfer_server_stats(s, &xs);
        if (xs.served + xs.not_found >= 2) break;
        usleep(10000);
    }
    assert_int_equal(xs.held, 1);
    assert_int_equal(xs.served, 1);
    assert_int_equal(xs.not_found, 1);
    free(want);
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
    assert_int_equal(ds_xfer_pull("127.0.0.1", ds_xfer_server_port(s), 5, 5000, &got, &len, &err),
                     DS_ERR);
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
    assert_int_equal(ds_xfer_release("127.0.0.1", port, 11, 5000, &err), DS_OK);
    ds_xfer_stats xs;
    ds_xfer_server_stats(s, &xs);
    assert_int_equal(xs.released, 1);
    assert_int_equal(xs.held, 1);
    assert_int_equal(xs.held_bytes, 300);
    assert_int_equal(xs.served, 0);
    void *got;
    size_t len;
    assert_int_equal(ds_xfer_pull("127.0.0.1", port, 11, 5000, &got, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "not held"));
    err.msg[0] = 0;
    assert_int_equal(ds_xfer_release("127.0.0.1", port, 99, 5000, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "0000000000000063"));
    /* the other blob is untouched and still pulls whole */
    assert_int_equal(ds_xfer_pull("127.0.0.1", port, 12, 5000, &got, &len, &err), DS_OK);
    void *want = pattern(300, 4);
    assert_int_equal(len, 300);
    assert_memory_equal(got, want, 300);
    free(got);
    free(want);
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
    void *got;
    size_t len;
    assert_int_equal(ds_xfer_pull("127.0.0.1", ds_xfer_server_port(s), 77, 10000, &got, &len, &err),
                     DS_OK);
    pthread_join(t, NULL);
    void *want = pattern(1000, 3);
    assert_int_equal(len, 1000);
    assert_memory_equal(got, want, 1000);
    free(got);
    free(want);
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
    assert_int_equal(ds_xfer_pull("127.0.0.1", port, 1, 3000, &got, &len, &err), DS_ERR);
    assert_true(ds_now() - t0 < 5.0);
    assert_non_null(strstr(err.msg, "127.0.0.1"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pull_once),
        cmocka_unit_test(test_expiry),
        cmocka_unit_test(test_release),
        cmocka_unit_test(test_pull_waits_for_filing),
        cmocka_unit_test(test_no_server),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
