/* toolparse.c — the incremental reasoning / content / tool-call splitter of toolparse.h.
 *
 * The parser keeps the text it cannot place yet in buf and scans it for the markers its state
 * knows. Text before a marker is final; a tail of buf that is the start of a marker waits for the
 * next piece (markers are whole tokens for the model, but the detokenizer may cut them anywhere,
 * and a test does), so how the text is cut never changes the result. Inside a tool-call section
 * everything, markers included, is also copied to raw until a call completes, so a section that
 * fails at any point can go back out as the exact text the model wrote. */
#include "text/toolparse.h"

#include <stdlib.h>
#include <string.h>

enum { TP_REASON, TP_CONTENT, TP_SECTION, TP_ID, TP_ARGS };

/* What a marker does when it matches. */
enum {
    M_DROP,          /* nothing: it goes (XTML structure, a leading <think>) */
    M_THINK_END,     /* the thought ends */
    M_SECTION_BEGIN, /* a tool-call section opens */
    M_SECTION_END,
    M_CALL_BEGIN,
    M_ARGS_BEGIN,
    M_CALL_END,
    M_BAD /* a marker that does not belong here: the section is malformed */
};

typedef struct {
    const char *s;
    int act;
} marker;

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

/* The markers live in state p->state: m[*n] (at most 16). */
static void markers_of(const ds_toolparse *p, marker *m, int *n) {
    int k = 0;
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
        if (put_raw(p, s, n)) return DS_ERR;
        for (size_t i = 0; i < n; i++)
            if (!is_space(s[i])) return malformed(p, o); /* only whitespace between calls */
        return DS_OK;
    default: /* TP_ID, TP_ARGS */
        if (put_raw(p, s, n)) return DS_ERR;
        if (p->state == TP_ID && p->raw_len - p->id_start > 512) return malformed(p, o);
        return DS_OK;
    }
}

/* A copy of s[0..n), NUL-terminated. */
static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n), d[n] = 0;
    return d;
}

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
        if (is_space(name[i]) || name[i] == '<' || name[i] == '>') nn = 0;
    if (!nn) /* the end marker was read: it goes back with the rest */
        return put_raw(p, CALL_END, sizeof CALL_END - 1) ? DS_ERR : malformed(p, o);
    if (o->n_calls == o->calls_cap) {
        int c = o->calls_cap ? 2 * o->calls_cap : 4;
        ds_tp_call *t = realloc(o->calls, (size_t)c * sizeof *t);
        if (!t) return DS_ERR;
        o->calls = t, o->calls_cap = c;
    }
    ds_tp_call *c = &o->calls[o->n_calls];
    c->args_len = p->raw_len - p->args_start;
    c->id = dup_n(id, idn);
    c->name = dup_n(name, nn);
    c->args = dup_n(p->raw + p->args_start, c->args_len);
    if (!c->id || !c->name || !c->args) {
        free(c->id), free(c->name), free(c->args);
        return DS_ERR;
    }
    o->n_calls++;
    p->n_calls++;
    p->raw_len = 0;
    p->state = TP_SECTION;
    return DS_OK;
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
        p->state = TP_SECTION;
        return put_raw(p, m->s, ml);
    case M_SECTION_END:
        /* whitespace after the last call is the section's: it goes with the markers */
        p->raw_len = 0;
        p->state = TP_CONTENT;
        return DS_OK;
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
    default: /* M_BAD */
        *consumed = 0;
        return malformed(p, o);
    }
}

/* Places as much of buf as can be placed now; at the end (final) a marker's start is no longer
 * held, since nothing can complete it. */
static int drain(ds_toolparse *p, ds_tp_out *o, int final) {
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
        if (place_text(p, p->buf + i, at - i, o)) return DS_ERR;
        i = at;
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
