/* fuzz_text_toolparse.c — libFuzzer target for the reasoning / content / tool-call splitter
 * (text/toolparse.h) on arbitrary generated text.
 *
 * Input: first byte = mode (bit 0: tools, bit 1: reasoning, bit 2: xtml), second byte = the seed
 * of the cuts, then the text. Invariants: the text fed whole and fed in pieces (cut where a small
 * generator seeded by the second byte says) gives the same content, reasoning and calls; with
 * tools only and no call parsed, the content is the text byte for byte; every call has a
 * non-empty name. */
#include <stdlib.h>
#include <string.h>

#include "fuzzutil.h"
#include "text/toolparse.h"

typedef struct {
    ds_tp_out all; /* everything, accumulated across pieces */
    char *calls;   /* [calls_len] "id\x01name\x01args\x02" per call */
    size_t calls_len;
} run;

static void add_calls(run *r, ds_tp_out *o) {
    for (int i = 0; i < o->n_calls; i++) {
        ds_tp_call *c = &o->calls[i];
        if (!c->name[0]) fz_fail("a call with an empty name");
        size_t il = strlen(c->id), nl = strlen(c->name), need = il + nl + c->args_len + 3;
        r->calls = realloc(r->calls, r->calls_len + need);
        if (!r->calls) fz_fail("out of memory");
        char *d = r->calls + r->calls_len;
        memcpy(d, c->id, il), d += il, *d++ = 1;
        memcpy(d, c->name, nl), d += nl, *d++ = 1;
        memcpy(d, c->args, c->args_len), d += c->args_len, *d++ = 2;
        r->calls_len += need;
    }
}

/* Appends src[0..n) to *dst [*len]. */
static void append(char **dst, size_t *len, const char *src, size_t n) {
    if (!n) return;
    *dst = realloc(*dst, *len + n + 1);
    if (!*dst) fz_fail("out of memory");
    memcpy(*dst + *len, src, n);
    *len += n;
}

/* Moves what one piece gave into the run's totals. */
static void absorb(run *r, ds_tp_out *out) {
    add_calls(r, out);
    append(&r->all.content, &r->all.content_len, out->content, out->content_len);
    append(&r->all.reasoning, &r->all.reasoning_len, out->reasoning, out->reasoning_len);
    r->all.n_calls += out->n_calls;
    ds_tp_out_clear(out);
}

/* Feeds text[0..n) in pieces: cut after each byte where the generator (seed) says so; seed 0:
 * one piece. */
static void parse(const ds_tp_opts *o, const char *text, size_t n, unsigned seed, run *r) {
    ds_toolparse p;
    ds_tp_out out = {0};
    ds_err err;
    memset(r, 0, sizeof *r);
    ds_tp_init(&p, o);
    unsigned x = seed * 2654435761u + 1;
    size_t at = 0;
    for (size_t i = 1; i <= n; i++) {
        x = x * 1103515245u + 12345u;
        if (i < n && (!seed || (x >> 16) % 5)) continue;
        if (ds_tp_feed(&p, text + at, i - at, &out, &err)) fz_fail("feed: %s", err.msg);
        at = i;
        absorb(r, &out);
    }
    if (ds_tp_finish(&p, &out, &err)) fz_fail("finish: %s", err.msg);
    absorb(r, &out);
    ds_tp_out_free(&out);
    ds_tp_free(&p);
}

static int same(const char *a, size_t an, const char *b, size_t bn) {
    return an == bn && (!an || !memcmp(a, b, an));
}

static void run_free(run *r) {
    free(r->all.content);
    free(r->all.reasoning);
    free(r->calls);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    ds_tp_opts o = {data[0] & 1, (data[0] >> 1) & 1, (data[0] >> 2) & 1};
    const char *text = (const char *)data + 2;
    size_t n = size - 2;
    run whole, cut;
    parse(&o, text, n, 0, &whole);
    parse(&o, text, n, data[1] + 1u, &cut);
    if (!same(whole.all.content, whole.all.content_len, cut.all.content, cut.all.content_len))
        fz_fail("content differs between whole and cut");
    if (!same(whole.all.reasoning, whole.all.reasoning_len, cut.all.reasoning,
              cut.all.reasoning_len))
        fz_fail("reasoning differs between whole and cut");
    if (!same(whole.calls, whole.calls_len, cut.calls, cut.calls_len))
        fz_fail("calls differ between whole and cut");
    if (o.tools && !o.reasoning && !o.xtml && !whole.all.n_calls &&
        !same(whole.all.content, whole.all.content_len, text, n))
        fz_fail("text without a call came back changed");
    run_free(&whole);
    run_free(&cut);
    return 0;
}
