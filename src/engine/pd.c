/* pd.c — prefill/decode disaggregation (docs/pd.md): the producer files a prefilled prompt's
 * blocks for one consumer to pull; the consumer verifies them and hands them to its offload tier,
 * so its ordinary prefix-cache lookup resumes the prompt from them. The blocks are exactly the
 * offload tier's entries (MLA pages and KDA checkpoints with their conv tails, keyed by the prefix
 * hash chain), so the path a pulled block takes into a sequence is the tier load that the prefix
 * cache's tests already hold to bit-exactness; nothing here decides what a sequence resumes from.
 *
 * A transfer (one buffer, moved by transport/xfer):
 *   header  {magic "DSPD", version, model identity, layer range, TP rank and width, block size,
 *            cut spacing, page and slot bytes, prompt length, block count, checksum}
 *   prompt  [n_prompt] int32 token ids (a block's key is a prefix of them)
 *   blocks  each {kind 'p'|'c', depth in tokens, prefix hash, layer range, TP rank, payload bytes,
 *            checksum} then the payload
 * Every checksum is XXH3-64 over the header or block header (checksum field zero) and what
 * follows it. A consumer takes all of a transfer or none of it. */
#include "engine/engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define PD_MAGIC   0x44504453u /* "DSPD" */
#define PD_VERSION 1u

typedef struct pd_header {
    uint32_t magic, version;
    uint64_t model;
    int32_t layer_lo, layer_hi, tp_rank, tp_size;
    int32_t block_size, chunk_tokens;
    uint64_t page_bytes, slot_bytes;
    int32_t n_prompt, n_blocks;
    uint64_t checksum; /* over this header (field zero) and the prompt */
} pd_header;

typedef struct pd_block {
    uint8_t kind; /* 'p' a page, 'c' a checkpoint */
    uint8_t pad[3];
    int32_t n_tokens; /* the prefix it summarises: prompt[0, n_tokens) */
    uint64_t hash[2];
    int32_t layer_lo, layer_hi, tp_rank, pad2;
    uint64_t n_bytes;  /* payload bytes after this header */
    uint64_t checksum; /* over this header (field zero) and the payload */
} pd_block;

/* The checksums hash these structs whole: no byte of them may be implicit padding. */
_Static_assert(sizeof(pd_header) == 72, "pd_header has no implicit padding");
_Static_assert(sizeof(pd_block) == 56, "pd_block has no implicit padding");

/* A verified transfer: the buffer as pulled, with the blocks at their offsets. */
struct ds_kv_pull {
    uint8_t *buf; /* [len] */
    size_t len;
    const int32_t *prompt; /* into buf [n_prompt] */
    int n_prompt;
    size_t *off; /* [n_blocks] offsets of each pd_block in buf */
    int n_blocks;
};

void ds_kv_pull_free(ds_kv_pull *p) {
    if (!p) return;
    free(p->buf);
    free(p->off);
    free(p);
}

/* This engine's side of what both ends must agree on. */
static pd_header own_header(const ds_engine *e) {
    pd_header h = {.magic = PD_MAGIC, .version = PD_VERSION};
    h.model = e->kv_seed;
    h.layer_lo = ds_model_first_layer(e->model);
    h.layer_hi = ds_model_end_layer(e->model);
    h.tp_rank = e->comm ? e->comm->tp_rank : 0;
    h.tp_size = e->comm ? e->comm->tp_size : 1;
    h.block_size = e->opts.block_size;
    h.chunk_tokens = e->chunk_tokens;
    h.page_bytes = e->prefix ? ds_prefix_page_bytes(e->prefix) : 0;
    h.slot_bytes = ds_model_slot_floats(e->model) * sizeof(float);
    return h;
}

/* XXH3 over a header (its checksum field zeroed by the caller's copy) and the bytes it covers;
 * 0 only when the hasher's state cannot be made (a checksum then never matches). */
static uint64_t sum_over(const void *head, size_t n_head, const void *data, size_t n_data) {
    XXH3_state_t *st = XXH3_createState();
    if (!st) return 0;
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, head, n_head);
    XXH3_64bits_update(st, data, n_data);
    uint64_t v = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return v;
}

static uint64_t header_sum(pd_header h, const int32_t *prompt) {
    h.checksum = 0;
    return sum_over(&h, sizeof h, prompt, (size_t)h.n_prompt * sizeof(int32_t));
}

static uint64_t block_sum(pd_block b, const void *payload) {
    b.checksum = 0;
    return sum_over(&b, sizeof b, payload, b.n_bytes);
}

/* ---- the producer ----------------------------------------------------------------------------*/

int eng_pd_setup(ds_engine *e, ds_err *err) {
    const ds_engine_opts *o = &e->opts;
    if (o->kv_role == DS_KV_NONE) return DS_OK;
    if (o->kv_role < DS_KV_NONE || o->kv_role > DS_KV_BOTH)
        return ds_errf(err, "kv transfer: unknown role %d", o->kv_role);
    if (e->dist)
        return ds_errf(err, "kv transfer: -tp/-pp with a kv_role is not supported yet (each rank "
                            "would move its own slice; docs/pd.md)");
    if (!e->prefix)
        return ds_errf(err,
                       "kv transfer: a kv_role needs prefix caching (the blocks are the prefix "
                       "cache's; drop --no-enable-prefix-caching)");
    if ((o->kv_role & DS_KV_CONSUMER) && !e->offload)
        return ds_errf(err, "kv transfer: a consumer needs an offload tier to receive blocks into");
    if (o->kv_role & DS_KV_PRODUCER) {
        const char *ip = o->kv_ip && o->kv_ip[0] ? o->kv_ip : "127.0.0.1";
        if (ds_xfer_server_create(ip, o->kv_port, 2000, &e->xfer, err)) return DS_ERR;
        ds_xfer_server_test_stall(e->xfer, o->test.kv_stall_ms);
        fprintf(stderr, "[deltaserve] kv transfer: producer, pulls on %s:%d (UCX)\n", ip,
                ds_xfer_server_port(e->xfer));
    }
    if (o->kv_role & DS_KV_CONSUMER) fprintf(stderr, "[deltaserve] kv transfer: consumer\n");
    return DS_OK;
}

void eng_pd_free(ds_engine *e) {
    ds_xfer_server_free(e->xfer);
    e->xfer = NULL;
}

int ds_engine_kv_role(const ds_engine *e) {
    return e->opts.kv_role;
}

const char *ds_engine_kv_host(const ds_engine *e) {
    return e->opts.kv_ip && e->opts.kv_ip[0] ? e->opts.kv_ip : "127.0.0.1";
}

int ds_engine_kv_port(const ds_engine *e) {
    return e->xfer ? ds_xfer_server_port(e->xfer) : 0;
}

/* A growing transfer buffer. */
typedef struct outbuf {
    uint8_t *b; /* [cap] */
    size_t len, cap;
    int n_blocks, failed;
    const pd_header *h;
} outbuf;

static int out_reserve(outbuf *o, size_t more) {
    if (o->len + more <= o->cap) return DS_OK;
    size_t cap = DS_MAX(o->cap * 2, o->len + more + 4096);
    uint8_t *b = realloc(o->b, cap);
    if (!b) return DS_ERR;
    o->b = b;
    o->cap = cap;
    return DS_OK;
}

static int out_block(void *ctx, char kind, const uint64_t hash[2], int n_tokens, const void *data,
                     size_t n_bytes) {
    outbuf *o = ctx;
    if (out_reserve(o, sizeof(pd_block) + n_bytes)) return o->failed = 1, DS_ERR;
    pd_block b = {(uint8_t)kind,  {0},
                  n_tokens,       {hash[0], hash[1]},
                  o->h->layer_lo, o->h->layer_hi,
                  o->h->tp_rank,  0,
                  n_bytes,        0};
    b.checksum = block_sum(b, data);
    memcpy(o->b + o->len, &b, sizeof b);
    memcpy(o->b + o->len + sizeof b, data, n_bytes);
    o->len += sizeof b + n_bytes;
    o->n_blocks++;
    return DS_OK;
}

void eng_pd_export(ds_engine *e, choice *ch) {
    request *r = ch->req;
    if (!e->xfer || !e->prefix || !r->spec.kv_export_id || ch->index != 0 || !ch->seq) return;
    pd_header h = own_header(e);
    h.n_prompt = r->spec.n_prompt;
    outbuf o = {.h = &h};
    size_t head = sizeof h + (size_t)h.n_prompt * sizeof(int32_t);
    if (out_reserve(&o, head)) return;
    o.len = head;
    int n = ds_prefix_export(e->prefix, ch->seq, out_block, &o);
    if (n < 0 || o.failed) {
        fprintf(stderr, "[deltaserve] kv transfer: export of %016llx failed (out of memory)\n",
                (unsigned long long)r->spec.kv_export_id);
        free(o.b);
        return;
    }
    h.n_blocks = o.n_blocks;
    h.checksum = header_sum(h, r->spec.prompt);
    memcpy(o.b, &h, sizeof h);
    memcpy(o.b + sizeof h, r->spec.prompt, (size_t)h.n_prompt * sizeof(int32_t));
    ds_err err;
    int ttl = e->opts.kv_hold_timeout_ms > 0 ? e->opts.kv_hold_timeout_ms : 120000;
    if (ds_xfer_server_put(e->xfer, r->spec.kv_export_id, o.b, o.len, ttl, &err)) {
        fprintf(stderr, "[deltaserve] %s\n", err.msg);
        return;
    }
    pthread_mutex_lock(&e->mu);
    e->stats.kv_exports++;
    e->stats.kv_export_blocks += (uint64_t)o.n_blocks;
    pthread_mutex_unlock(&e->mu);
}

/* ---- the consumer ----------------------------------------------------------------------------*/

/* Why buf[len] cannot be installed here ("" when it can); p->off filled on success. */
static const char *verify(const ds_engine *e, ds_kv_pull *p, const int32_t *prompt, int n_prompt) {
    pd_header want = own_header(e), h;
    if (p->len < sizeof h) return "truncated header";
    memcpy(&h, p->buf, sizeof h);
    if (h.magic != PD_MAGIC || h.version != PD_VERSION) return "not a deltaserve transfer";
    if (h.n_prompt < 0 || h.n_blocks < 0 ||
        p->len < sizeof h + (size_t)h.n_prompt * sizeof(int32_t))
        return "truncated prompt";
    p->prompt = (const int32_t *)(p->buf + sizeof h);
    if (header_sum(h, p->prompt) != h.checksum) return "header checksum mismatch";
    if (h.model != want.model) return "another model (or cut spacing, dtype, device)";
    if (h.layer_lo != want.layer_lo || h.layer_hi != want.layer_hi || h.tp_rank != want.tp_rank ||
        h.tp_size != want.tp_size)
        return "another layer range or TP layout";
    if (h.block_size != want.block_size || h.chunk_tokens != want.chunk_tokens)
        return "another block size or cut spacing";
    if (h.page_bytes != want.page_bytes || h.slot_bytes != want.slot_bytes)
        return "another page or slot layout (start both with the same --speculative-method)";
    if (h.n_prompt != n_prompt || memcmp(p->prompt, prompt, (size_t)n_prompt * sizeof(int32_t)))
        return "another prompt";
    p->n_prompt = n_prompt;
    p->off = malloc((size_t)DS_MAX(h.n_blocks, 1) * sizeof *p->off);
    if (!p->off) return "out of memory";
    size_t at = sizeof h + (size_t)h.n_prompt * sizeof(int32_t);
    for (int i = 0; i < h.n_blocks; i++) {
        pd_block b;
        if (p->len - at < sizeof b) return "truncated block header";
        memcpy(&b, p->buf + at, sizeof b);
        if (b.n_bytes > p->len - at - sizeof b) return "truncated block";
        if (block_sum(b, p->buf + at + sizeof b) != b.checksum) return "block checksum mismatch";
        if ((b.kind != 'p' && b.kind != 'c') ||
            b.n_bytes != (b.kind == 'p' ? h.page_bytes : h.slot_bytes))
            return "bad block kind or size";
        if (b.n_tokens <= 0 || b.n_tokens > n_prompt || b.n_tokens % h.block_size)
            return "bad block depth";
        if (b.layer_lo != want.layer_lo || b.layer_hi != want.layer_hi || b.tp_rank != want.tp_rank)
            return "block of another layer range or rank";
        p->off[i] = at;
        at += sizeof b + b.n_bytes;
    }
    if (at != p->len) return "trailing bytes";
    p->n_blocks = h.n_blocks;
    return "";
}

static void count_pull(ds_engine *e, int ok, const ds_kv_pull *p) {
    pthread_mutex_lock(&e->mu);
    if (ok) {
        e->stats.kv_pulls++;
        e->stats.kv_pull_blocks += (uint64_t)p->n_blocks;
        e->stats.kv_pull_bytes += p->len;
    } else
        e->stats.kv_pull_failures++;
    pthread_mutex_unlock(&e->mu);
}

int ds_engine_kv_pull(ds_engine *e, const char *host, int port, uint64_t id, const int32_t *prompt,
                      int n_prompt, ds_kv_pull **out, ds_err *err) {
    *out = NULL;
    if (!(e->opts.kv_role & DS_KV_CONSUMER)) {
        count_pull(e, 0, NULL);
        return ds_errf(err, "kv transfer: this server is not a consumer (--kv-transfer-config)");
    }
    ds_kv_pull *p = calloc(1, sizeof *p);
    if (!p) return ds_errf(err, "kv transfer: out of memory");
    int timeout = e->opts.kv_pull_timeout_ms > 0 ? e->opts.kv_pull_timeout_ms : 30000;
    void *buf;
    if (ds_xfer_pull(host, port, id, timeout, &buf, &p->len, err)) {
        free(p);
        count_pull(e, 0, NULL);
        return DS_ERR;
    }
    p->buf = buf;
    /* tests: a byte of the last payload flipped (1), or the transfer cut 1 KiB short (2) */
    if (e->opts.test.kv_corrupt == 1 && p->len) p->buf[p->len - 1] ^= 0x40;
    if (e->opts.test.kv_corrupt == 2) p->len -= DS_MIN(p->len, 1024);
    const char *why = verify(e, p, prompt, n_prompt);
    if (why[0]) {
        ds_kv_pull_free(p);
        count_pull(e, 0, NULL);
        return ds_errf(err, "kv transfer %016llx from %s:%d rejected: %s", (unsigned long long)id,
                       host, port, why);
    }
    count_pull(e, 1, p);
    *out = p;
    return DS_OK;
}

void eng_pd_install(ds_engine *e, request *r) {
    ds_kv_pull *p = r->kv_import;
    r->kv_import = NULL;
    if (!p) return;
    if (e->offload)
        for (int i = 0; i < p->n_blocks; i++) {
            pd_block b;
            memcpy(&b, p->buf + p->off[i], sizeof b);
            ds_offload_put(e->offload, (char)b.kind, b.hash, p->prompt, b.n_tokens,
                           p->buf + p->off[i] + sizeof b, b.n_bytes / 4);
        }
    ds_kv_pull_free(p);
}
