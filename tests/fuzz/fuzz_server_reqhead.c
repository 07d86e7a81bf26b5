/* fuzz_server_reqhead.c — libFuzzer target for the request-head checker the server's gate runs
 * on every connection's bytes before libmicrohttpd sees them (src/server/reqhead.c).
 *
 * Input: the bytes a client sent. The limit is a small one (256) half the time (first byte odd),
 * so the size refusals are reached, else the server's.
 * Invariants: a refusal is 400, 414, 431 or 505 with a message and OpenAI-shaped error JSON; an
 * accepted head ends with its empty line within the bytes and the limit, is accepted alone with
 * the same length, and one byte less of it is "not whole yet", never a verdict. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "server/reqhead.h"

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
        if (len < 2 || len > size || len > max || b[len - 1] != '\n')
            fz_fail("accepted head of %zu bytes out of %zu (limit %zu)", len, size, max);
        size_t len2 = 0;
        if (ds_http_check_head(b, len, max, &len2, &e) != DS_HEAD_OK || len2 != len)
            fz_fail("the head alone is not accepted with its length %zu", len);
        if (ds_http_check_head(b, len - 1, max, &len2, &e) != DS_HEAD_MORE)
            fz_fail("a head one byte short got a verdict: %s", e.message);
    } else if (st != DS_HEAD_MORE) {
        fz_fail("status %d", (int)st);
    } else if (size > max) {
        fz_fail("%zu bytes over the limit %zu without a verdict", size, max);
    }
    return 0;
}
