/* fuzz_server_reqhead.c — libFuzzer target for the request-head checker the server's gate runs
 * on every connection's bytes before libmicrohttpd sees them (src/server/reqhead.c).
 *
 * Input: the bytes a client sent. The limit is a small one (256) half the time (first byte odd),
 * so the size refusals are reached, else the server's.
 * After an accepted head, the rest is also checked as a chunked body (with the head's flags).
 * Invariants: a refusal is 400, 414, 431 or 505 with a message and OpenAI-shaped error JSON; an
 * accepted head (or chunked body) ends with its empty line within the bytes and the limit, is
 * accepted alone with the same length, and one byte less of it is "not whole yet", never a
 * verdict. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "server/reqhead.h"

/* An accepted head or body b[0..len) of n bytes: whole alone, and "not whole" one byte short. */
static void check_whole(const char *b, size_t n, size_t len, size_t max, int body) {
    size_t len2 = 0;
    ds_oai_error e;
    if (len < (body ? 3 : 2) || len > n || len > max || b[len - 1] != '\n')
        fz_fail("accepted %s of %zu bytes out of %zu (limit %zu)", body ? "body" : "head", len, n,
                max);
    ds_head_status st = body ? ds_http_check_chunked(b, len, &len2, &e)
                             : ds_http_check_head(b, len, max, &len2, &e);
    if (st != DS_HEAD_OK || len2 != len) fz_fail("accepted alone differently (%zu)", len);
    st = body ? ds_http_check_chunked(b, len - 1, &len2, &e)
              : ds_http_check_head(b, len - 1, max, &len2, &e);
    if (st != DS_HEAD_MORE) fz_fail("one byte short got a verdict: %s", e.message);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t max = size && (data[0] & 1) ? 256 : DS_HEAD_MAX_BYTES;
    const char *b = (const char *)data;
    size_t len = 0;
    ds_oai_error e;
    memset(&e, 0, sizeof e);
    ds_head_status st = ds_http_check_head(b, size, max, &len, &e);
    fz_note("reqhead", st == DS_HEAD_BAD, e.message);
    if (st == DS_HEAD_BAD) {
        if (e.status != 400 && e.status != 414 && e.status != 431 && e.status != 505)
            fz_fail("refused with status %d", e.status);
        if (!e.message[0]) fz_fail("a refusal without a message");
        char *js = ds_oai_error_json(&e);
        json_t *j = js ? json_loads(js, 0, NULL) : NULL;
        if (!j || !json_is_string(json_object_get(json_object_get(j, "error"), "message")))
            fz_fail("refusal JSON lacks the OpenAI shape: %s", js ? js : "(null)");
        json_decref(j);
        free(js);
    } else if (st == DS_HEAD_OK) {
        check_whole(b, size, len, max, 0);
        unsigned f = ds_http_head_flags(b, len);
        if (f & ~(unsigned)(DS_HEAD_CHUNKED | DS_HEAD_EXPECT100)) fz_fail("flags %x", f);
        unsigned long long cl;
        if (ds_http_head_content_length(b, len, &cl) && cl > 999999999999999999ull)
            fz_fail("Content-Length %llu over 18 digits", cl);
        size_t blen = 0;
        ds_head_status bs = ds_http_check_chunked(b + len, size - len, &blen, &e);
        if (bs == DS_HEAD_OK) check_whole(b + len, size - len, blen, (size_t)-1, 1);
        if (bs == DS_HEAD_BAD && (e.status != 400 || !strstr(e.message, "chunked")))
            fz_fail("a chunked body refused with %d: %s", e.status, e.message);
    } else if (st != DS_HEAD_MORE) {
        fz_fail("status %d", (int)st);
    } else if (size > max) {
        fz_fail("%zu bytes over the limit %zu without a verdict", size, max);
    }
    return 0;
}
