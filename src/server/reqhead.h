/* reqhead.h — a request head (request line and header fields) checked by RFC 9112 before
 * libmicrohttpd sees it.
 *
 * libmicrohttpd 0.9.75 answers the malformed heads it finds with fixed HTML pages and has no hook
 * to replace them; the server's gate (gate.h) looks at each new connection's head first, with
 * this function, and answers the ones it refuses with the OpenAI error JSON itself. What passes
 * here is what libmicrohttpd parses without complaint. */
#ifndef DS_REQHEAD_H
#define DS_REQHEAD_H

#include <stddef.h>

#include "server/openai.h"

enum {
    DS_HEAD_MAX_BYTES = 16 * 1024, /* a head larger is refused (431; 414 for the request line) */
    DS_HEAD_MAX_FIELDS = 100,      /* header fields at most (431) */
};

typedef enum { DS_HEAD_BAD = -1, DS_HEAD_MORE = 0, DS_HEAD_OK = 1 } ds_head_status;

/* Looks at the first n bytes a connection sent (b[0..n), maybe more than one request).
 * DS_HEAD_OK: the head is whole and well-formed, *head_len its size (the empty line included).
 * DS_HEAD_MORE: no fault so far, but the head is not whole yet.
 * DS_HEAD_BAD: *e says what is wrong — 400 a malformed request line or field (no colon, space
 * before the colon, a control byte, a folded line, a missing or repeated Host in HTTP/1.1),
 * 505 a version other than HTTP/1.0 and 1.1, 414 a request line longer than max_bytes,
 * 431 a longer head or more than DS_HEAD_MAX_FIELDS fields.
 * Each complete line is judged as soon as it arrives, so a bad one is refused at once. */
ds_head_status ds_http_check_head(const char *b, size_t n, size_t max_bytes, size_t *head_len,
                                  ds_oai_error *e);

/* What a whole, checked head (b[0..len)) asks of its body: bit flags. */
enum {
    DS_HEAD_CHUNKED = 1,   /* Transfer-Encoding ending in "chunked" */
    DS_HEAD_EXPECT100 = 2, /* Expect: 100-continue (the body waits for the server's go-ahead) */
};
unsigned ds_http_head_flags(const char *b, size_t len);
/* The body's length by the head's Content-Length (0 without one): 1, or 0 when it is not known
 * (values that differ or are not a decimal number; the server refuses those on the headers). */
int ds_http_head_content_length(const char *b, size_t len, unsigned long long *cl);

/* Looks at the bytes of a chunked body (RFC 9112 §7.1) that arrived so far, b[0..n).
 * DS_HEAD_OK: the body is whole (last chunk and trailer section) and well-formed, *body_len its
 * size on the wire; DS_HEAD_MORE: good so far; DS_HEAD_BAD (400, *e says what): a chunk size
 * that is not hexadecimal or too large, chunk data not followed by its line end, a control byte
 * in an extension, a malformed trailer field. */
ds_head_status ds_http_check_chunked(const char *b, size_t n, size_t *body_len, ds_oai_error *e);

#endif
