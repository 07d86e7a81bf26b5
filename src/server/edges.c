/* edges.c — Content-Length and Transfer-Encoding checks, the open-file limit, the API key
 * (see edges.h). */
#include "server/edges.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>

typedef struct framing {
    int n_cl;         /* Content-Length headers */
    int cl_differ;    /* two of them differ */
    const char *cl;   /* the first one's value */
    int n_te;         /* transfer codings, over all Transfer-Encoding headers */
    int chunked_at;   /* index of the last "chunked" coding, or -1 */
    int n_chunked;    /* how many "chunked" codings */
    int empty_te;     /* an empty coding (",," or an empty header) */
    char unknown[32]; /* [32] the first coding other than chunked, for the message */
} framing;

/* One coding of a Transfer-Encoding list: p[0..n) without surrounding whitespace. */
static void add_coding(framing *f, const char *p, size_t n) {
    if (n == 0)
        f->empty_te = 1;
    else if (n == 7 && strncasecmp(p, "chunked", 7) == 0)
        f->chunked_at = f->n_te, f->n_chunked++;
    else if (!f->unknown[0])
        snprintf(f->unknown, sizeof f->unknown, "%.*s", (int)(n < 24 ? n : 24), p);
    f->n_te++;
}

static enum MHD_Result on_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                 const char *value) {
    (void)kind;
    framing *f = cls;
    if (!value) value = "";
    if (strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0) {
        if (f->n_cl++ == 0)
            f->cl = value;
        else if (strcmp(f->cl, value))
            f->cl_differ = 1;
    } else if (strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0) {
        for (const char *p = value;;) { /* codings separated by commas, with optional spaces */
            while (*p == ' ' || *p == '\t') p++;
            size_t n = strcspn(p, ","), m = n;
            while (m && (p[m - 1] == ' ' || p[m - 1] == '\t')) m--;
            add_coding(f, p, m);
            if (!p[n]) break;
            p += n + 1;
        }
    }
    return MHD_YES;
}

int ds_http_check_framing(struct MHD_Connection *c, ds_oai_error *e) {
    framing f = {.chunked_at = -1};
    MHD_get_connection_values(c, MHD_HEADER_KIND, on_header, &f);
    if (f.cl_differ)
        return ds_oai_errorf(e, 400, NULL, "invalid_request",
                             "two Content-Length headers with different values");
    if (f.n_te && f.n_cl)
        return ds_oai_errorf(e, 400, NULL, "invalid_request",
                             "both Transfer-Encoding and Content-Length: send only one");
    if (f.n_te && (f.empty_te || f.n_chunked > 1 || (f.n_chunked && f.chunked_at != f.n_te - 1)))
        return ds_oai_errorf(e, 400, NULL, "invalid_request",
                             "Transfer-Encoding: chunked must be the last coding, and only once");
    if (f.unknown[0]) {
        ds_oai_errorf(e, 501, NULL, "unsupported_transfer_encoding",
                      "Transfer-Encoding '%s' is not supported: send the body plain or "
                      "chunked",
                      f.unknown);
        /* the client's to fix, though 501 is a 5xx */
        snprintf(e->type, sizeof e->type, "invalid_request_error");
        return DS_ERR;
    }
    return DS_OK;
}

void ds_http_raise_fd_limit(int want) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur >= (rlim_t)want) return;
    rl.rlim_cur =
        rl.rlim_max == RLIM_INFINITY || rl.rlim_max > (rlim_t)want ? (rlim_t)want : rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl); /* best effort: the old limit still works, only lower */
}

/* Constant-time comparison, so the key cannot be guessed byte by byte from response times. */
static int key_equal(const char *a, size_t alen, const char *b) {
    size_t blen = strlen(b);
    unsigned char d = alen != blen;
    for (size_t i = 0; i < alen; i++) d |= (unsigned char)(a[i] ^ b[i % (blen ? blen : 1)]);
    return d == 0;
}

int ds_http_authorized(struct MHD_Connection *c, const char *key) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7)) return 0;
    h += 7;
    while (*h == ' ') h++;
    size_t n = strlen(h);
    while (n && h[n - 1] == ' ') n--;
    return key_equal(h, n, key);
}
