/* toolparse.c — the incremental reasoning / content / tool-call splitter of toolparse.h.
 *
 * The parser keeps the text it cannot place yet in buf and scans it for the markers its state
 * knows. Text before a marker is final; a tail of buf that is the start of a marker waits for the
 * next piece (markers are whole tokens for the model, but the detokenizer may cut them anywhere,
 * and a test does), so how the text is cut never changes the result. Inside a tool-call section
 * everything, markers included, is also copied to raw until a call completes, so a section that
 * fails at any point can go back out as the exact text the model wrote. */
#include "text/toolparse.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    TP_REASON,
    TP_CONTENT,
    TP_SECTION, /* K2: between calls */
    TP_ID,
    TP_ARGS,
    TP_XSEC,  /* K3: in <tools>, between calls */
    TP_XHDR,  /* the attributes of <call ...> */
    TP_XBODY, /* in a call, between arguments */
    TP_XAHDR, /* the attributes of <argument ...> or <json ...> */
    TP_XVAL,  /* an argument's value */
    TP_XJSON  /* a <json> block's text */
};

/* What a marker does when it matches. */
enum {
    M_DROP,          /* nothing: it goes (XTML structure, a leading <think>) */
    M_THINK_END,     /* the thought ends */
    M_SECTION_BEGIN, /* a tool-call section opens */
    M_SECTION_END,
    M_CALL_BEGIN,
    M_ARGS_BEGIN,
    M_CALL_END,
    M_XSEC_BEGIN, /* K3 */
    M_XSEC_END,
    M_XCALL_BEGIN,
    M_XHDR_END,
    M_XARG_BEGIN,
    M_XJSON_BEGIN,
    M_XARG_END,
    M_XJSON_END,
    M_XCALL_END,
    M_BAD /* a marker that does not belong here: the section is malformed */
};

typedef struct {
    const char *s;
    int act;
} marker;

/* The longest call id and tag attributes taken: past them the section is malformed. */
#define MAX_ID  512
#define MAX_HDR 1024

#define SEC_BEGIN  "<|tool_calls_section_begin|>"
#define SEC_END    "<|tool_calls_section_end|>"
#define CALL_BEGIN "<|tool_call_begin|>"
#define ARGS_BEGIN "<|tool_call_argument_begin|>"
#define CALL_END   "<|tool_call_end|>"

/* XTML's structure around the thought and the answer; a lone marker last, so that the longer
 * sequences win when they match (longest match at a position). */
static const marker k_xtml_drop[] = {{"<|open|>response<|sep|>", M_DROP},
                                     {"<|close|>response<|sep|>", M_DROP},
                                     {"<|close|>message<|sep|>", M_DROP},
                                     {"<|open|>", M_DROP},
                                     {"<|close|>", M_DROP},
                                     {"<|sep|>", M_DROP},
                                     {"<|end_of_msg|>", M_DROP}};

/* The tokens the markers are made of: XTML's (k_xtml_drop's lone entries; no token is named
 * like its longer ones), the K2 tool-call section's and the thought's (K2-Thinking's <think> and
 * </think> are tokens of their own). */
int ds_tp_is_marker(const char *name, size_t n) {
    static const char *const k2[] = {SEC_BEGIN, SEC_END,   CALL_BEGIN, ARGS_BEGIN,
                                     CALL_END,  "<think>", "</think>"};
    for (size_t i = 0; i < DS_ARRAY_LEN(k_xtml_drop) + DS_ARRAY_LEN(k2); i++) {
        const char *s =
            i < DS_ARRAY_LEN(k_xtml_drop) ? k_xtml_drop[i].s : k2[i - DS_ARRAY_LEN(k_xtml_drop)];
        if (strlen(s) == n && !memcmp(s, name, n)) return 1;
    }
    return 0;
}

/* K3's call markers in state p->state, appended to m[*k]. */
static void markers_xtml(const ds_toolparse *p, marker *m, int *k) {
    static const marker xsec[] = {{"<|open|>call", M_XCALL_BEGIN},
                                  {"<|close|>tools<|sep|>", M_XSEC_END},
                                  {"<|open|>", M_BAD},
                                  {"<|close|>", M_BAD}};
    static const marker xhdr[] = {
        {"<|sep|>", M_XHDR_END}, {"<|open|>", M_BAD}, {"<|close|>", M_BAD}};
    static const marker xbody[] = {{"<|open|>argument", M_XARG_BEGIN},
                                   {"<|open|>json", M_XJSON_BEGIN},
                                   {"<|close|>call<|sep|>", M_XCALL_END},
                                   {"<|open|>", M_BAD},
                                   {"<|close|>", M_BAD}};
    static const marker xval[] = {
        {"<|close|>argument<|sep|>", M_XARG_END}, {"<|open|>", M_BAD}, {"<|close|>", M_BAD}};
    static const marker xjson[] = {
        {"<|close|>json<|sep|>", M_XJSON_END}, {"<|open|>", M_BAD}, {"<|close|>", M_BAD}};
    const marker *t = NULL;
    size_t n = 0;
    if (p->state == TP_CONTENT && p->o.tools) {
        m[(*k)++] = (marker){"<|open|>tools<|sep|>", M_XSEC_BEGIN};
        return;
    }
    if (p->state == TP_XSEC) t = xsec, n = DS_ARRAY_LEN(xsec);
    if (p->state == TP_XHDR || p->state == TP_XAHDR) t = xhdr, n = DS_ARRAY_LEN(xhdr);
    if (p->state == TP_XBODY) t = xbody, n = DS_ARRAY_LEN(xbody);
    if (p->state == TP_XVAL) t = xval, n = DS_ARRAY_LEN(xval);
    if (p->state == TP_XJSON) t = xjson, n = DS_ARRAY_LEN(xjson);
    for (size_t i = 0; i < n; i++) m[(*k)++] = t[i];
}

/* The markers live in state p->state: m[*n] (at most 16). */
static void markers_of(const ds_toolparse *p, marker *m, int *n) {
    int k = 0;
    if (p->o.xtml) markers_xtml(p, m, &k);
    int text_state = p->state == TP_REASON || p->state == TP_CONTENT;
    if (p->state == TP_REASON) {
        m[k++] = (marker){"</think>", M_THINK_END};
        if (p->o.xtml) m[k++] = (marker){"<|close|>think<|sep|>", M_THINK_END};
        if (p->at_start) m[k++] = (marker){"<think>", M_DROP};
    }
    if (p->state == TP_CONTENT && p->o.tools) m[k++] = (marker){SEC_BEGIN, M_SECTION_BEGIN};
    if (text_state && p->o.xtml)
        for (size_t i = 0; i < DS_ARRAY_LEN(k_xtml_drop); i++) m[k++] = k_xtml_drop[i];
    if (p->state == TP_SECTION) {
        m[k++] = (marker){CALL_BEGIN, M_CALL_BEGIN};
        m[k++] = (marker){SEC_END, M_SECTION_END};
        m[k++] = (marker){SEC_BEGIN, M_BAD};
        m[k++] = (marker){ARGS_BEGIN, M_BAD};
        m[k++] = (marker){CALL_END, M_BAD};
    } else if (p->state == TP_ID) {
        m[k++] = (marker){ARGS_BEGIN, M_ARGS_BEGIN};
        m[k++] = (marker){CALL_BEGIN, M_BAD};
        m[k++] = (marker){CALL_END, M_BAD};
        m[k++] = (marker){SEC_BEGIN, M_BAD};
        m[k++] = (marker){SEC_END, M_BAD};
    } else if (p->state == TP_ARGS) {
        m[k++] = (marker){CALL_END, M_CALL_END};
        m[k++] = (marker){CALL_BEGIN, M_BAD};
        m[k++] = (marker){ARGS_BEGIN, M_BAD};
        m[k++] = (marker){SEC_BEGIN, M_BAD};
        m[k++] = (marker){SEC_END, M_BAD};
    }
    *n = k;
}

/* Appends s[0..n) to the growable buffer *b [*len, *cap]. */
static int grow_append(char **b, size_t *len, size_t *cap, const char *s, size_t n) {
    if (!n) return DS_OK;
    if (*len + n + 1 > *cap) {
        size_t c = DS_MAX(2 * *cap, *len + n + 64);
        char *t = realloc(*b, c);
        if (!t) return DS_ERR;
        *b = t, *cap = c;
    }
    memcpy(*b + *len, s, n);
    *len += n;
    (*b)[*len] = 0;
    return DS_OK;
}

static int put_content(ds_tp_out *o, const char *s, size_t n) {
    return grow_append(&o->content, &o->content_len, &o->content_cap, s, n);
}

static int put_raw(ds_toolparse *p, const char *s, size_t n) {
    return grow_append(&p->raw, &p->raw_len, &p->raw_cap, s, n);
}

static int is_space(char c) {
    return c == ' ' || c == '\n' || c == '\r' || c == '\t';
}

/* The section failed: its text since the last parsed call goes out as content. */
static int malformed(ds_toolparse *p, ds_tp_out *o) {
    int rc = put_content(o, p->raw, p->raw_len);
    p->raw_len = 0;
    p->state = TP_CONTENT;
    return rc;
}

/* Text before the next marker: where it goes depends on the state. */
static int place_text(ds_toolparse *p, const char *s, size_t n, ds_tp_out *o) {
    if (!n) return DS_OK;
    p->at_start = 0;
    switch (p->state) {
    case TP_REASON:
        return grow_append(&o->reasoning, &o->reasoning_len, &o->reasoning_cap, s, n);
    case TP_CONTENT:
        return put_content(o, s, n);
    case TP_SECTION:
    case TP_XSEC:
    case TP_XBODY:
        if (put_raw(p, s, n)) return DS_ERR;
        for (size_t i = 0; i < n; i++)
            if (!is_space(s[i])) return malformed(p, o); /* only whitespace between calls */
        return DS_OK;
    default: /* TP_ID, TP_ARGS, and XTML's tag attributes and values */
        if (put_raw(p, s, n)) return DS_ERR;
        if (p->state == TP_ID && p->raw_len - p->id_start > MAX_ID) return malformed(p, o);
        if ((p->state == TP_XHDR || p->state == TP_XAHDR) && p->raw_len - p->hdr_start > MAX_HDR)
            return malformed(p, o);
        return DS_OK;
    }
}

/* How much of the text s[0..n) the state can take before it fails: the byte that breaks a section
 * is the last one it takes, and the rest is read again in the content state, so a failure falls on
 * the same byte however the text was cut. */
static size_t place_limit(const ds_toolparse *p, const char *s, size_t n) {
    size_t w = 0, used;
    switch (p->state) {
    case TP_SECTION:
    case TP_XSEC:
    case TP_XBODY: /* whitespace only */
        while (w < n && is_space(s[w])) w++;
        return w < n ? w + 1 : n;
    case TP_ID:
        used = p->raw_len - p->id_start;
        return used <= MAX_ID ? MAX_ID - used + 1 : 1;
    case TP_XHDR:
    case TP_XAHDR:
        used = p->raw_len - p->hdr_start;
        return used <= MAX_HDR ? MAX_HDR - used + 1 : 1;
    default:
        return n;
    }
}

/* A copy of s[0..n), NUL-terminated. */
static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n), d[n] = 0;
    return d;
}

static int push_call(ds_toolparse *p, ds_tp_out *o, const char *id, size_t idn, const char *name,
                     size_t nn, const char *args, size_t an);

/* The call whose id is raw[id_start..id_end) and arguments raw[args_start..raw_len) is complete:
 * out goes a call, or, when the id names no function, the section is malformed. */
static int commit_call(ds_toolparse *p, size_t id_end, ds_tp_out *o) {
    const char *id = p->raw + p->id_start;
    size_t idn = id_end - p->id_start;
    while (idn && is_space(*id)) id++, idn--;
    while (idn && is_space(id[idn - 1])) idn--;
    const char *name = id;
    size_t nn = idn;
    if (nn > 10 && !memcmp(name, "functions.", 10)) name += 10, nn -= 10;
    size_t colon = nn;
    while (colon > 0 && name[colon - 1] >= '0' && name[colon - 1] <= '9') colon--;
    if (colon > 0 && colon < nn && name[colon - 1] == ':') nn = colon - 1; /* ":IDX" */
    for (size_t i = 0; i < nn; i++)
        if (is_space(name[i]) || (unsigned char)name[i] < 0x20 || name[i] == '<' || name[i] == '>')
            nn = 0; /* (a control byte, NUL among them, ends no name a C string can hold) */
    if (!nn)        /* the end marker was read: it goes back with the rest */
        return put_raw(p, CALL_END, sizeof CALL_END - 1) ? DS_ERR : malformed(p, o);
    if (push_call(p, o, id, idn, name, nn, p->raw + p->args_start, p->raw_len - p->args_start))
        return DS_ERR;
    p->state = TP_SECTION;
    return DS_OK;
}

/* Out goes a call; the section's text so far is consumed by it. */
static int push_call(ds_toolparse *p, ds_tp_out *o, const char *id, size_t idn, const char *name,
                     size_t nn, const char *args, size_t an) {
    if (o->n_calls == o->calls_cap) {
        int c = o->calls_cap ? 2 * o->calls_cap : 4;
        ds_tp_call *t = realloc(o->calls, (size_t)c * sizeof *t);
        if (!t) return DS_ERR;
        o->calls = t, o->calls_cap = c;
    }
    ds_tp_call *c = &o->calls[o->n_calls];
    c->args_len = an;
    c->id = dup_n(id, idn);
    c->name = dup_n(name, nn);
    c->args = dup_n(args, an);
    if (!c->id || !c->name || !c->args) {
        free(c->id), free(c->name), free(c->args);
        return DS_ERR;
    }
    o->n_calls++;
    p->n_calls++;
    p->sec_calls++;
    p->raw_len = 0;
    return DS_OK;
}

/* A section closed: after calls, whitespace after the last one goes with the markers; a section
 * without a call is text, as the model wrote it. */
static int section_end(ds_toolparse *p, const marker *m, size_t ml, ds_tp_out *o) {
    if (!p->sec_calls) return put_raw(p, m->s, ml) ? DS_ERR : malformed(p, o);
    p->raw_len = 0;
    p->state = TP_CONTENT;
    return DS_OK;
}

/* The value of attribute key in the tag attributes h[0..n) (` key="value"`, &quot; and &amp;
 * unescaped), malloc'd, or NULL when absent. */
static char *attr_value(const char *h, size_t n, const char *key) {
    size_t kl = strlen(key);
    for (size_t i = 0; i + kl + 2 <= n; i++) {
        if ((i && !is_space(h[i - 1])) || memcmp(h + i, key, kl) || h[i + kl] != '=' ||
            h[i + kl + 1] != '"')
            continue;
        const char *v = h + i + kl + 2, *end = memchr(v, '"', n - (size_t)(v - h));
        if (!end) return NULL;
        char *out = malloc((size_t)(end - v) + 1);
        if (!out) return NULL;
        size_t k = 0;
        for (const char *c = v; c < end;) {
            if (end - c >= 6 && !memcmp(c, "&quot;", 6))
                out[k++] = '"', c += 6;
            else if (end - c >= 5 && !memcmp(c, "&amp;", 5))
                out[k++] = '&', c += 5;
            else
                out[k++] = *c++;
        }
        out[k] = 0;
        return out;
    }
    return NULL;
}

static int put_args(ds_toolparse *p, const char *s, size_t n) {
    return grow_append(&p->args, &p->args_len, &p->args_cap, s, n);
}

/* s[0..n) as a JSON string (quotes, backslashes and control characters escaped). */
static int put_args_json_string(ds_toolparse *p, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    int rc = put_args(p, "\"", 1);
    for (size_t i = 0; i < n && !rc; i++) {
        unsigned char c = (unsigned char)s[i];
        char e[7] = {'\\', 0};
        if (c == '"' || c == '\\')
            e[1] = (char)c, rc = put_args(p, e, 2);
        else if (c == '\n')
            rc = put_args(p, "\\n", 2);
        else if (c == '\t')
            rc = put_args(p, "\\t", 2);
        else if (c == '\r')
            rc = put_args(p, "\\r", 2);
        else if (c < 0x20) {
            memcpy(e + 1, "u00", 3), e[4] = hex[c >> 4], e[5] = hex[c & 15];
            rc = put_args(p, e, 6);
        } else
            rc = put_args(p, s + i, 1);
    }
    return rc ? rc : put_args(p, "\"", 1);
}

/* A K3 call marker matched (on_marker's part for XTML). */
static int on_xtml_marker(ds_toolparse *p, const marker *m, size_t ml, ds_tp_out *o,
                          int *consumed) {
    const char *hdr = p->raw ? p->raw + p->hdr_start : ""; /* raw is NULL before any text */
    size_t hn = p->raw ? p->raw_len - p->hdr_start : 0;
    int rc = DS_OK;
    switch (m->act) {
    case M_XSEC_BEGIN:
        p->raw_len = 0;
        p->sec_calls = 0;
        p->state = TP_XSEC;
        return put_raw(p, m->s, ml);
    case M_XSEC_END:
        return section_end(p, m, ml, o);
    case M_XCALL_BEGIN:
    case M_XARG_BEGIN:
    case M_XJSON_BEGIN:
        if (put_raw(p, m->s, ml)) return DS_ERR;
        p->hdr_start = p->raw_len;
        p->xstring = m->act == M_XJSON_BEGIN ? -1 : 0; /* -1: a json block */
        p->state = m->act == M_XCALL_BEGIN ? TP_XHDR : TP_XAHDR;
        return DS_OK;
    case M_XHDR_END:
        free(p->xkey);
        p->xkey = NULL;
        if (p->state == TP_XHDR) { /* <call tool="NAME" index="i"> */
            free(p->xname);
            p->xname = attr_value(hdr, hn, "tool");
            p->args_len = 0;
            if (!p->xname || !p->xname[0] || put_args(p, "{", 1)) break;
            p->state = TP_XBODY;
        } else if (p->xstring < 0) { /* <json type="object"> */
            p->state = TP_XJSON;
        } else { /* <argument key="K" type="T"> */
            char *ty = attr_value(hdr, hn, "type");
            p->xkey = attr_value(hdr, hn, "key");
            p->xstring = !ty || !strcmp(ty, "string");
            free(ty);
            if (!p->xkey) break;
            p->state = TP_XVAL;
        }
        if (put_raw(p, m->s, ml)) return DS_ERR;
        p->hdr_start = p->raw_len; /* the value starts here */
        return DS_OK;
    case M_XARG_END:
    case M_XJSON_END: {
        const char *v = hdr;
        size_t vn = hn;
        if (m->act == M_XJSON_END) { /* the block is the arguments */
            p->args_len = 0;
            rc = put_args(p, v, vn);
        } else {
            if (p->args_len > 1) rc = put_args(p, ", ", 2);
            rc = rc ? rc : put_args_json_string(p, p->xkey, strlen(p->xkey));
            rc = rc ? rc : put_args(p, ": ", 2);
            if (!p->xstring) { /* JSON as written, trimmed; nothing at all is null */
                while (vn && is_space(*v)) v++, vn--;
                while (vn && is_space(v[vn - 1])) vn--;
                rc = rc ? rc : vn ? put_args(p, v, vn) : put_args(p, "null", 4);
            } else
                rc = rc ? rc : put_args_json_string(p, v, vn);
        }
        if (rc || put_raw(p, m->s, ml)) return DS_ERR;
        p->xstring = m->act == M_XJSON_END ? -2 : 0; /* -2: the call's arguments are whole */
        p->state = TP_XBODY;
        return DS_OK;
    }
    case M_XCALL_END: {
        if (p->xstring != -2 && put_args(p, "}", 1)) return DS_ERR;
        char id[300];
        int idn = snprintf(id, sizeof id, "functions.%.256s:%d", p->xname, p->n_calls);
        if (push_call(p, o, id, (size_t)idn, p->xname, strlen(p->xname), p->args, p->args_len))
            return DS_ERR;
        p->state = TP_XSEC;
        return DS_OK;
    }
    }
    /* a tag without its attributes: the marker goes back with the rest */
    *consumed = 1;
    return put_raw(p, m->s, ml) ? DS_ERR : malformed(p, o);
}

/* Marker m (of length ml) matched: act on it. *consumed = 0 when it is left in buf for the next
 * state to read (a marker that breaks a section is text there). */
static int on_marker(ds_toolparse *p, const marker *m, size_t ml, ds_tp_out *o, int *consumed) {
    *consumed = 1;
    p->at_start = 0;
    switch (m->act) {
    case M_DROP:
        return DS_OK;
    case M_THINK_END:
        p->state = TP_CONTENT;
        return DS_OK;
    case M_SECTION_BEGIN:
        p->raw_len = 0;
        p->sec_calls = 0;
        p->state = TP_SECTION;
        return put_raw(p, m->s, ml);
    case M_SECTION_END:
        return section_end(p, m, ml, o);
    case M_CALL_BEGIN:
        if (put_raw(p, m->s, ml)) return DS_ERR;
        p->id_start = p->raw_len;
        p->state = TP_ID;
        return DS_OK;
    case M_ARGS_BEGIN:
        if (put_raw(p, m->s, ml)) return DS_ERR;
        p->args_start = p->raw_len; /* the id ends where this marker starts */
        p->state = TP_ARGS;
        return DS_OK;
    case M_CALL_END:
        return commit_call(p, p->args_start - (sizeof ARGS_BEGIN - 1), o);
    case M_BAD:
        *consumed = 0;
        return malformed(p, o);
    default:
        return on_xtml_marker(p, m, ml, o, consumed);
    }
}

/* Places as much of buf as can be placed now; at the end (final) a marker's start is no longer
 * held, since nothing can complete it. */
static int drain(ds_toolparse *p, ds_tp_out *o, int final) {
    if (!p->buf) return DS_OK; /* nothing was ever fed */
    marker m[16];
    size_t i = 0; /* buf[0..i) is already placed */
    for (;;) {
        int nm;
        markers_of(p, m, &nm);
        size_t at = p->len, best_len = 0;
        const marker *best = NULL;
        int partial = 0;
        for (size_t k = i; k < p->len && !best && !partial; k++) {
            if (p->buf[k] != '<') continue;
            size_t rest = p->len - k;
            for (int j = 0; j < nm; j++) {
                size_t ml = strlen(m[j].s);
                if (rest >= ml && !memcmp(p->buf + k, m[j].s, ml)) {
                    if (ml > best_len) best = &m[j], best_len = ml;
                } else if (!final && rest < ml && !memcmp(p->buf + k, m[j].s, rest))
                    partial = 1; /* a longer marker may still complete here */
            }
            if (best || partial) at = k;
        }
        int st = p->state, as = p->at_start;
        size_t take = DS_MIN(at - i, place_limit(p, p->buf + i, at - i));
        if (place_text(p, p->buf + i, take, o)) return DS_ERR;
        i += take;
        if (p->state != st || p->at_start != as) continue; /* other markers apply now */
        if (partial || !best) break; /* hold the possible marker; or all placed */
        int consumed;
        if (on_marker(p, best, best_len, o, &consumed)) return DS_ERR;
        if (consumed) i += best_len;
    }
    memmove(p->buf, p->buf + i, p->len - i);
    p->len -= i;
    return DS_OK;
}

void ds_tp_init(ds_toolparse *p, const ds_tp_opts *o) {
    memset(p, 0, sizeof *p);
    p->o = *o;
    p->state = o->reasoning ? TP_REASON : TP_CONTENT;
    p->at_start = 1;
}

int ds_tp_feed(ds_toolparse *p, const char *s, size_t n, ds_tp_out *out, ds_err *err) {
    if (grow_append(&p->buf, &p->len, &p->cap, s, n) || drain(p, out, 0))
        return ds_errf(err, "out of memory parsing the generated text");
    return DS_OK;
}

int ds_tp_finish(ds_toolparse *p, ds_tp_out *out, ds_err *err) {
    /* what is held is a marker's start that never completed: text of the state it is in */
    int rc = drain(p, out, 1);
    if (!rc) rc = place_text(p, p->buf, p->len, out);
    p->len = 0;
    if (!rc && p->state >= TP_SECTION) rc = malformed(p, out);
    if (rc) return ds_errf(err, "out of memory parsing the generated text");
    return DS_OK;
}

void ds_tp_free(ds_toolparse *p) {
    free(p->buf);
    free(p->raw);
    free(p->xname);
    free(p->xkey);
    free(p->args);
    memset(p, 0, sizeof *p);
}

void ds_tp_out_clear(ds_tp_out *out) {
    for (int i = 0; i < out->n_calls; i++) {
        free(out->calls[i].id);
        free(out->calls[i].name);
        free(out->calls[i].args);
    }
    out->n_calls = 0;
    out->content_len = out->reasoning_len = 0;
    if (out->content) out->content[0] = 0;
    if (out->reasoning) out->reasoning[0] = 0;
}

void ds_tp_out_free(ds_tp_out *out) {
    ds_tp_out_clear(out);
    free(out->content);
    free(out->reasoning);
    free(out->calls);
    memset(out, 0, sizeof *out);
}
