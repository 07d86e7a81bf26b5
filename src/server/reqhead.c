/* reqhead.c — the request head's grammar (RFC 9112 §2-§5), see reqhead.h. */
#include "server/reqhead.h"

#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

/* tchar of RFC 9110 §5.6.2: the bytes of a method or a field name */
static int is_tchar(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

/* A printable excerpt of a line for an error message: out[64], ASCII, other bytes as '?'. */
static const char *excerpt(const char *s, size_t n, char out[64]) {
    size_t k = n < 40 ? n : 40;
    for (size_t i = 0; i < k; i++) {
        unsigned char c = (unsigned char)s[i];
        out[i] = c < 0x20 || c >= 0x7f || c == '"' || c == '\\' ? '?' : (char)c;
    }
    snprintf(out + k, 64 - k, "%s", n > k ? "..." : "");
    return out;
}

static ds_head_status bad(ds_oai_error *e, int status, const char *code, const char *what,
                          const char *line, size_t n) {
    char ex[64];
    ds_oai_errorf(e, status, NULL, code, "%s: \"%s\"", what, excerpt(line, n, ex));
    /* the client's to fix, though 505 is a 5xx */
    snprintf(e->type, sizeof e->type, "invalid_request_error");
    return DS_HEAD_BAD;
}

/* The request line: method SP target SP HTTP/d.d. *http11: 1 for HTTP/1.1. */
static ds_head_status request_line(const char *s, size_t n, int *http11, ds_oai_error *e) {
    const char *what = "malformed request line (expected METHOD /path HTTP/1.1)";
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)s[i])) i++;
    if (i == 0 || i == n || s[i] != ' ') return bad(e, 400, "malformed_request", what, s, n);
    size_t t = ++i;
    while (i < n && (unsigned char)s[i] > 0x20 && (unsigned char)s[i] < 0x7f) i++; /* ASCII */
    if (i == t || i == n || s[i] != ' ') return bad(e, 400, "malformed_request", what, s, n);
    const char *v = s + i + 1;
    size_t vn = n - i - 1;
    if (vn != 8 || memcmp(v, "HTTP/", 5) || v[5] < '0' || v[5] > '9' || v[6] != '.' || v[7] < '0' ||
        v[7] > '9')
        return bad(e, 400, "malformed_request", what, s, n);
    if (v[5] != '1' || (v[7] != '0' && v[7] != '1'))
        return bad(e, 505, "http_version_not_supported",
                   "HTTP version not supported (use HTTP/1.1 or HTTP/1.0)", v, vn);
    *http11 = v[7] == '1';
    return DS_HEAD_OK;
}

/* A header field line: name ":" value, the value without control bytes but HTAB.
 * *is_host: 1 for a Host field. */
static ds_head_status field_line(const char *s, size_t n, int *is_host, ds_oai_error *e) {
    if (s[0] == ' ' || s[0] == '\t') /* obs-fold: RFC 9112 §5.2 lets a server refuse it */
        return bad(e, 400, "malformed_request",
                   "folded header line (continue no field on a "
                   "second line)",
                   s, n);
    size_t i = 0;
    while (i < n && is_tchar((unsigned char)s[i])) i++;
    if (i == 0 || i == n || s[i] != ':')
        return bad(e, 400, "malformed_request",
                   i < n && (s[i] == ' ' || s[i] == '\t')
                       ? "malformed header line (no space is allowed before the colon)"
                       : "malformed header line (expected Name: value)",
                   s, n);
    *is_host = i == 4 && strncasecmp(s, "host", 4) == 0;
    for (size_t j = i + 1; j < n; j++) {
        unsigned char c = (unsigned char)s[j];
        if ((c < 0x20 && c != '\t') || c == 0x7f)
            return bad(e, 400, "malformed_request",
                       "control byte in a header value (NUL, CR and the like are not allowed)", s,
                       n);
    }
    return DS_HEAD_OK;
}

static ds_head_status too_large(ds_oai_error *e, int in_request_line, size_t max_bytes) {
    if (in_request_line)
        ds_oai_errorf(e, 414, NULL, "uri_too_long",
                      "the request line is longer than %zu bytes: shorten the URL", max_bytes);
    else
        ds_oai_errorf(e, 431, NULL, "request_header_fields_too_large",
                      "the request head is larger than %zu bytes (or has more than %d fields)",
                      max_bytes, DS_HEAD_MAX_FIELDS);
    return DS_HEAD_BAD;
}

ds_head_status ds_http_check_head(const char *b, size_t n, size_t max_bytes, size_t *head_len,
                                  ds_oai_error *e) {
    size_t p = 0;
    int line_no = 0, http11 = 0, n_host = 0;
    for (;;) {
        const char *nl = memchr(b + p, '\n', n - p);
        if (!nl) return n > max_bytes ? too_large(e, line_no == 0, max_bytes) : DS_HEAD_MORE;
        size_t end = (size_t)(nl - b) + 1, len = end - 1 - p;
        if (end > max_bytes) return too_large(e, line_no == 0, max_bytes);
        if (len && b[p + len - 1] == '\r') len--; /* CRLF, or a bare LF (§2.2 allows it) */
        const char *s = b + p;
        p = end;
        if (len == 0) {
            if (line_no == 0) continue; /* empty lines before the request line are ignored */
            if (http11 && n_host != 1)
                return ds_oai_errorf(e, 400, NULL, "malformed_request",
                                     n_host ? "more than one Host header"
                                            : "an HTTP/1.1 request needs a Host header");
            *head_len = end;
            return DS_HEAD_OK;
        }
        int is_host = 0;
        ds_head_status st =
            line_no == 0 ? request_line(s, len, &http11, e) : field_line(s, len, &is_host, e);
        if (st != DS_HEAD_OK) return st;
        n_host += is_host;
        if (line_no++ > DS_HEAD_MAX_FIELDS) return too_large(e, 0, max_bytes);
    }
}

/* The next line of b[p..n): its start *s and length *len without the line end (CRLF or LF);
 * returns the offset after it, or 0 when it is not whole yet. */
static size_t next_line(const char *b, size_t n, size_t p, const char **s, size_t *len) {
    const char *nl = memchr(b + p, '\n', n - p);
    if (!nl) return 0;
    *s = b + p;
    *len = (size_t)(nl - b) - p;
    if (*len && (*s)[*len - 1] == '\r') (*len)--;
    return (size_t)(nl - b) + 1;
}

/* 1 if the field line s[0..n) is named `name` (case-insensitive); *v its value, trimmed. */
static int field_is(const char *s, size_t n, const char *name, const char **v, size_t *vn) {
    size_t k = strlen(name);
    if (n <= k || s[k] != ':' || strncasecmp(s, name, k)) return 0;
    size_t i = k + 1;
    while (i < n && (s[i] == ' ' || s[i] == '\t')) i++;
    while (n > i && (s[n - 1] == ' ' || s[n - 1] == '\t')) n--;
    *v = s + i, *vn = n - i;
    return 1;
}

unsigned ds_http_head_flags(const char *b, size_t len) {
    unsigned f = 0;
    const char *s, *v;
    size_t n, vn;
    for (size_t p = 0, q; (q = next_line(b, len, p, &s, &n)); p = q) {
        if (field_is(s, n, "transfer-encoding", &v, &vn) && vn >= 7 &&
            strncasecmp(v + vn - 7, "chunked", 7) == 0 &&
            (vn == 7 || v[vn - 8] == ',' || v[vn - 8] == ' ' || v[vn - 8] == '\t'))
            f |= DS_HEAD_CHUNKED;
        if (field_is(s, n, "expect", &v, &vn) && vn == 12 && !strncasecmp(v, "100-continue", 12))
            f |= DS_HEAD_EXPECT100;
    }
    return f;
}

int ds_http_head_content_length(const char *b, size_t len, unsigned long long *cl) {
    const char *s, *v;
    size_t n, vn;
    int seen = 0;
    *cl = 0;
    for (size_t p = 0, q; (q = next_line(b, len, p, &s, &n)); p = q) {
        if (!field_is(s, n, "content-length", &v, &vn)) continue;
        unsigned long long x = 0;
        if (vn == 0 || vn > 18) return 0;
        for (size_t i = 0; i < vn; i++) {
            if (v[i] < '0' || v[i] > '9') return 0;
            x = x * 10 + (unsigned)(v[i] - '0');
        }
        if (seen++ && x != *cl) return 0;
        *cl = x;
    }
    return 1;
}

static ds_head_status bad_chunk(ds_oai_error *e, const char *what) {
    ds_oai_errorf(e, 400, NULL, "malformed_request", "malformed chunked body: %s", what);
    return DS_HEAD_BAD;
}

/* A chunk-size line: 1-15 hex digits, then optional whitespace and a ";" extension without
 * control bytes. */
static ds_head_status chunk_size(const char *s, size_t n, unsigned long long *size,
                                 ds_oai_error *e) {
    size_t i = 0;
    *size = 0;
    for (; i < n && isxdigit((unsigned char)s[i]); i++) {
        if (i == 15) return bad_chunk(e, "a chunk size over 15 hexadecimal digits");
        int c = (unsigned char)s[i];
        *size = *size * 16 + (unsigned)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    if (i == 0) return bad_chunk(e, "a chunk size that is not a hexadecimal number");
    while (i < n && (s[i] == ' ' || s[i] == '\t')) i++;
    if (i < n && s[i] != ';') return bad_chunk(e, "text after a chunk size that is no extension");
    for (; i < n; i++)
        if (((unsigned char)s[i] < 0x20 && s[i] != '\t') || s[i] == 0x7f)
            return bad_chunk(e, "a control byte in a chunk extension");
    return DS_HEAD_OK;
}

ds_head_status ds_http_check_chunked(const char *b, size_t n, size_t *body_len, ds_oai_error *e) {
    size_t p = 0, q, len;
    const char *s;
    for (;;) {
        if (!(q = next_line(b, n, p, &s, &len)))
            return n - p > 1024 ? bad_chunk(e, "a chunk size line over 1024 bytes") : DS_HEAD_MORE;
        unsigned long long size;
        if (chunk_size(s, len, &size, e) != DS_HEAD_OK) return DS_HEAD_BAD;
        p = q;
        if (size == 0) break;
        if (n - p < size + 1) return DS_HEAD_MORE; /* its data and at least a LF */
        p += (size_t)size;
        if (b[p] == '\r' && p + 1 == n) return DS_HEAD_MORE;
        if (b[p] != '\n' && (b[p] != '\r' || b[p + 1] != '\n'))
            return bad_chunk(e, "chunk data longer than its size (no line end after it)");
        p += b[p] == '\r' ? 2 : 1;
    }
    for (int n_fields = 0;; n_fields++) { /* the trailer section, then an empty line */
        if (!(q = next_line(b, n, p, &s, &len)))
            return n - p > DS_HEAD_MAX_BYTES ? bad_chunk(e, "a trailer section too large")
                                             : DS_HEAD_MORE;
        p = q;
        if (len == 0) {
            *body_len = p;
            return DS_HEAD_OK;
        }
        int is_host;
        if (n_fields >= DS_HEAD_MAX_FIELDS || field_line(s, len, &is_host, e) != DS_HEAD_OK)
            return bad_chunk(e, "a malformed trailer field");
    }
}
