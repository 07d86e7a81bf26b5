/* test_server_reqhead.c — the request-head checker the server's gate runs before libmicrohttpd
 * (reqhead.c): whole good heads with their exact length, heads not whole yet, and each kind of
 * refusal with its status, code and a message naming the fault. */
#include <string.h>

#include "server/reqhead.h"
#include "testutil.h"

/* Checks s (a C string) and returns the status; *e and *len as the checker left them. */
static ds_head_status check(const char *s, size_t max, size_t *len, ds_oai_error *e) {
    *len = 0;
    memset(e, 0, sizeof *e);
    return ds_http_check_head(s, strlen(s), max, len, e);
}

static void test_good_heads(void **state) {
    (void)state;
    size_t len;
    ds_oai_error e;
    const char *a = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(check(a, 16384, &len, &e), DS_HEAD_OK);
    assert_int_equal(len, strlen(a));
    /* the body and a pipelined request after the head are not part of it */
    const char *b = "POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}GET / HTT";
    assert_int_equal(check(b, 16384, &len, &e), DS_HEAD_OK);
    assert_int_equal(len, strlen(b) - strlen("{}GET / HTT"));
    /* bare LF line ends, empty lines before the request line, HTTP/1.0 without Host,
     * obs-text and tabs in a value, an empty value */
    const char *c = "\r\n\nGET /x?a=%20 HTTP/1.0\nX-A:\t\xc3\xa9 b\t\nX-B:\n\n";
    assert_int_equal(check(c, 16384, &len, &e), DS_HEAD_OK);
    assert_int_equal(len, strlen(c));
}

static void test_not_whole_yet(void **state) {
    (void)state;
    size_t len;
    ds_oai_error e;
    assert_int_equal(check("", 16384, &len, &e), DS_HEAD_MORE);
    assert_int_equal(check("GET /health HT", 16384, &len, &e), DS_HEAD_MORE);
    assert_int_equal(check("GET /health HTTP/1.1\r\nHost: x\r\n", 16384, &len, &e), DS_HEAD_MORE);
    assert_int_equal(check("GET /health HTTP/1.1\r\nHost: x\r\n\r", 16384, &len, &e), DS_HEAD_MORE);
}

static void expect_bad(const char *s, size_t max, int status, const char *code, const char *says) {
    size_t len;
    ds_oai_error e;
    assert_int_equal(check(s, max, &len, &e), DS_HEAD_BAD);
    assert_int_equal(e.status, status);
    assert_string_equal(e.code, code);
    assert_string_equal(e.type, "invalid_request_error"); /* 505 too: the client's to fix */
    if (!strstr(e.message, says)) fail_msg("'%s' not in '%s'", says, e.message);
}

static void test_refusals(void **state) {
    (void)state;
    const char *mr = "malformed_request";
    expect_bad("GET /health HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 16384, 400, mr, "Name: value");
    expect_bad("GET /health HTTP/1.1\r\nX-A : b\r\n", 16384, 400, mr, "before the colon");
    expect_bad("GET /health HTTP/1.1\r\nX-A: b\r\n c\r\n", 16384, 400, mr, "folded");
    /* a NUL inside a value: the length is given, the string is not C's */
    size_t len;
    ds_oai_error e;
    const char nul[] = "GET / HTTP/1.1\r\nX-A: b\0c\r\n\r\n";
    assert_int_equal(ds_http_check_head(nul, sizeof nul - 1, 16384, &len, &e), DS_HEAD_BAD);
    assert_int_equal(e.status, 400);
    assert_non_null(strstr(e.message, "control byte"));
    expect_bad("GET / HTTP/1.1\r\nX-A: b\rc\r\n\r\n", 16384, 400, mr, "control byte");
    expect_bad("GET /health\r\n", 16384, 400, mr, "request line");
    expect_bad("GET  / HTTP/1.1\r\n", 16384, 400, mr, "request line");
    expect_bad("G(T / HTTP/1.1\r\n", 16384, 400, mr, "request line");
    expect_bad("GET / HTTP/1.1 \r\n", 16384, 400, mr, "request line");
    expect_bad("GET / http/1.1\r\n", 16384, 400, mr, "request line");
    expect_bad("GET /\xc3\xa9 HTTP/1.1\r\n", 16384, 400, mr, "GET /?? HTTP"); /* not ASCII */
    expect_bad("GET / HTTP/2.0\r\n", 16384, 505, "http_version_not_supported", "HTTP/2.0");
    expect_bad("GET / HTTP/1.2\r\n", 16384, 505, "http_version_not_supported", "HTTP/1.2");
    /* judged as soon as the line is whole: no need for the rest of the head */
    expect_bad("GET / HTTP/0.9\r\nHost: x\r\n", 16384, 505, "http_version_not_supported", "0.9");
    expect_bad("GET / HTTP/1.1\r\n\r\n", 16384, 400, mr, "needs a Host");
    expect_bad("GET / HTTP/1.1\r\nHost: a\r\nhost: b\r\n\r\n", 16384, 400, mr, "more than one");
}

static void test_sizes(void **state) {
    (void)state;
    char big[400];
    /* a request line longer than the limit: 414, whole or not */
    snprintf(big, sizeof big, "GET /%0200d HTTP/1.1\r\nHost: x\r\n\r\n", 0);
    expect_bad(big, 100, 414, "uri_too_long", "request line");
    snprintf(big, sizeof big, "GET /%0200d", 0);
    expect_bad(big, 100, 414, "uri_too_long", "100 bytes");
    /* a longer head: 431, whole or not; at the limit exactly it passes */
    snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: x\r\nX-A: %0200d\r\n\r\n", 0);
    expect_bad(big, 100, 431, "request_header_fields_too_large", "100 bytes");
    big[60] = 0;
    expect_bad(big, 50, 431, "request_header_fields_too_large", "50 bytes");
    size_t len;
    ds_oai_error e;
    snprintf(big, sizeof big, "GET / HTTP/1.1\r\nHost: x\r\nX-A: %0200d\r\n\r\n", 0);
    assert_int_equal(check(big, strlen(big), &len, &e), DS_HEAD_OK);
    assert_int_equal(check(big, strlen(big) - 1, &len, &e), DS_HEAD_BAD);
    /* too many fields: 100 pass, 101 do not */
    static char many[4096];
    size_t n = (size_t)snprintf(many, sizeof many, "GET / HTTP/1.1\r\nHost: x\r\n");
    for (int i = 1; i < DS_HEAD_MAX_FIELDS; i++)
        n += (size_t)snprintf(many + n, sizeof many - n, "X-%d: y\r\n", i);
    snprintf(many + n, sizeof many - n, "\r\n");
    assert_int_equal(check(many, 16384, &len, &e), DS_HEAD_OK);
    snprintf(many + n, sizeof many - n, "X-Z: y\r\n\r\n");
    expect_bad(many, 16384, 431, "request_header_fields_too_large", "fields");
}

static ds_head_status chunked(const char *s, size_t *len, ds_oai_error *e) {
    *len = 0;
    memset(e, 0, sizeof *e);
    return ds_http_check_chunked(s, strlen(s), len, e);
}

static void test_chunked(void **state) {
    (void)state;
    size_t len;
    ds_oai_error e;
    /* whole: hex sizes either case, an extension, bare LF, a trailer; what follows is not its */
    const char *a = "5\r\nhello\r\nA;x=\"y\"\r\n0123456789\r\n0\r\n\r\nGET / HTTP/1.1";
    assert_int_equal(chunked(a, &len, &e), DS_HEAD_OK);
    assert_int_equal(len, strlen(a) - strlen("GET / HTTP/1.1"));
    const char *b = "3\nabc\n00\nX-T: 1\n\n";
    assert_int_equal(chunked(b, &len, &e), DS_HEAD_OK);
    assert_int_equal(len, strlen(b));
    /* not whole yet: at every cut of a good body */
    for (size_t cut = 0; cut < strlen(a) - strlen("GET / HTTP/1.1"); cut++) {
        char part[64];
        snprintf(part, sizeof part, "%.*s", (int)cut, a);
        assert_int_equal(chunked(part, &len, &e), DS_HEAD_MORE);
    }
    /* malformed */
    const char *bad[][2] = {
        {"zz\r\nabc\r\n0\r\n\r\n", "not a hexadecimal number"},
        {"\r\n", "not a hexadecimal number"},
        {"3\r\nabcd\r\n0\r\n\r\n", "longer than its size"},
        {"3 x\r\nabc\r\n", "no extension"},
        {"3;a\x01\r\nabc\r\n", "control byte"},
        {"1000000000000000\r\n", "15 hexadecimal digits"},
        {"0\r\nNoColon\r\n\r\n", "trailer"},
    };
    for (size_t i = 0; i < DS_ARRAY_LEN(bad); i++) {
        assert_int_equal(chunked(bad[i][0], &len, &e), DS_HEAD_BAD);
        assert_int_equal(e.status, 400);
        if (!strstr(e.message, bad[i][1])) fail_msg("'%s' not in '%s'", bad[i][1], e.message);
    }
    /* a size line that never ends */
    static char longline[1100];
    memset(longline, '0', sizeof longline - 1);
    longline[3] = ';';
    assert_int_equal(chunked(longline, &len, &e), DS_HEAD_BAD);
}

static void test_head_flags(void **state) {
    (void)state;
    const char *a = "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, Chunked \r\n\r\n";
    assert_int_equal(ds_http_head_flags(a, strlen(a)), DS_HEAD_CHUNKED);
    const char *b = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nexpect: 100-Continue\r\n\r\n";
    assert_int_equal(ds_http_head_flags(b, strlen(b)), DS_HEAD_CHUNKED | DS_HEAD_EXPECT100);
    /* "chunked" not the last coding, or only a suffix of one, or in another field: no flag */
    const char *c = "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\nX-TE: chunked\r\n"
                    "Transfer-Encoding: xchunked\r\nContent-Length: 3\r\n\r\n";
    assert_int_equal(ds_http_head_flags(c, strlen(c)), 0);
}

static void test_content_length(void **state) {
    (void)state;
    unsigned long long cl = 99;
    const char *a = "POST / HTTP/1.1\r\nHost: x\r\ncontent-length:  42 \r\n\r\n";
    assert_int_equal(ds_http_head_content_length(a, strlen(a), &cl), 1);
    assert_int_equal(cl, 42);
    const char *none = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(ds_http_head_content_length(none, strlen(none), &cl), 1);
    assert_int_equal(cl, 0);
    const char *same = "POST / HTTP/1.1\r\nContent-Length: 7\r\nContent-Length: 7\r\n\r\n";
    assert_int_equal(ds_http_head_content_length(same, strlen(same), &cl), 1);
    assert_int_equal(cl, 7);
    /* not known: values that differ, a sign, not digits, too many digits */
    const char *bad[] = {"POST / HTTP/1.1\r\nContent-Length: 7\r\nContent-Length: 8\r\n\r\n",
                         "POST / HTTP/1.1\r\nContent-Length: +7\r\n\r\n",
                         "POST / HTTP/1.1\r\nContent-Length: 7x\r\n\r\n",
                         "POST / HTTP/1.1\r\nContent-Length: 1234567890123456789\r\n\r\n"};
    for (size_t i = 0; i < DS_ARRAY_LEN(bad); i++)
        assert_int_equal(ds_http_head_content_length(bad[i], strlen(bad[i]), &cl), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_good_heads),     cmocka_unit_test(test_not_whole_yet),
        cmocka_unit_test(test_refusals),       cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_chunked),        cmocka_unit_test(test_head_flags),
        cmocka_unit_test(test_content_length),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
