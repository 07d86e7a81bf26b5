/* pd.c — prefill/decode disaggregation (docs/pd.md): the producer files a prefilled prompt's
 * blocks for one consumer to pull; the consumer verifies them and hands them to its offload tier,
 * so its ordinary prefix-cache lookup resumes the prompt from them. The blocks are exactly the
 * offload tier's entries (MLA pages and KDA checkpoints with their conv tails, keyed by the prefix
 * hash chain), so the path a pulled block takes into a sequence is the tier load that the prefix
 * cache's tests already hold to bit-exactness; nothing here decides what a sequence resumes from.
 *
 * Under -tp/-pp every rank of the producer files its own slice (its layers, its TP share of the
 * KDA heads) as one *part* in a transfer store of its own; every part carries the producer's rank
 * table (each part's port, layers, TP rank). The consumer's head pulls part 0 (its table says
 * where the rest are), verifies the layout, and pulls the other parts it needs itself; the step
 * plan then hands the other ranks of its job the table (part 0's front, not its blocks), and each
 * pulls the parts *it* needs straight from the producer's ranks: those holding heads of its KDA
 * layers, the first part holding each of its MLA layers (the latent rows are the same on every TP
 * rank), and the draft's rows when its pages carry them. Every rank knows both tables, so it
 * tells the producer how many of the consumer's ranks pull each part (xfer.h: the part is freed
 * after that many), and the head releases the parts no rank needs. Each rank then cuts its own
 * slice out of its parts (its layers, its heads: layouts may differ on the two sides) and files
 * it in its own offload tier under its own hashes. A rank that cannot pull or build a block
 * misses it, and since a job's offload hit needs every rank's hit, the whole job then recomputes
 * from there.
 *
 * A part (one buffer, moved by transport/xfer):
 *   header  {magic "DSPD", version, model identity, layer range, TP rank and width, block size,
 *            cut spacing, page, draft-row and slot bytes, prompt length, block count, part index
 *            and count, checksum}
 *   prompt  [n_prompt] int32 token ids (a block's key is a prefix of them)
 *   ranks   [n_parts] pd_rank: each part of the producer's job (part = world rank): its port,
 *           layer range, TP rank, and the bytes of the draft's rows its pages end with (0: none)
 *   blocks  each {kind 'p'|'c', depth in tokens, prefix hash, layer range, TP rank, payload bytes,
 *            checksum} then the payload
 * Every checksum is XXH3-64 over the header or block header (checksum field zero) and what
 * follows it. A consumer takes all of a transfer (every part) or none of it.
 *
 * Payloads are the offload tier's: a page is [n_mla][bs][row_bytes] for the part's MLA layers,
 * then (on the producer's sampling rank with DSpark) the draft's rows [x_bytes]; a checkpoint is
 * conv tails [n_kda][3][W-1][Hk*dk] then recurrent states [n_kda][Hk][dk][dk] for the part's KDA
 * layers and its heads [tp_rank*Hk, (tp_rank+1)*Hk), Hk = H / tp_size. Latent rows are the same
 * on every TP rank (the latent is shared by all heads), so any part holding a layer serves it. */
#include "engine/engine_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define PD_MAGIC        0x44504453u /* "DSPD" */
#define PD_VERSION      3u
#define PD_MAX_PARTS    4096
#define PD_MAX_TP       63   /* a layer's TP ranks are a bitmask */
#define PD_RANK_PULL_MS 5000 /* a non-head rank's pull, at most (pull_part) */

typedef struct pd_header {
    uint32_t magic, version;
    uint64_t model; /* e->kv_xseed: the model's numbers, whatever the TP width */
    int32_t layer_lo, layer_hi, tp_rank, tp_size;
    int32_t block_size, chunk_tokens;
    uint64_t page_bytes, slot_bytes;
    uint64_t x_bytes; /* the last x_bytes of a page are the DSpark draft's rows (0: none) */
    int32_t n_prompt, n_blocks;
    int32_t part, n_parts; /* this part's world rank in the producer's job; the job's ranks */
    uint64_t checksum;     /* over this header (field zero), the prompt and the rank table */
} pd_header;

/* One rank of a job as a transfer names it (the producer's table travels in every part; a
 * consumer keeps its own job's, e->pd_ranks). */
typedef struct pd_rank {
    int32_t port;               /* its transfer store's port (0: a consumer's rank) */
    int32_t layer_lo, layer_hi; /* its layers */
    int32_t tp_rank;
    int32_t x; /* bytes of the DSpark draft's rows at the end of its pages (0: none) */
} pd_rank;

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
_Static_assert(sizeof(pd_header) == 88, "pd_header has no implicit padding");
_Static_assert(sizeof(pd_block) == 56, "pd_block has no implicit padding");
_Static_assert(sizeof(pd_rank) == 20, "pd_rank has no implicit padding");

/* One producer rank's part, verified: the buffer as pulled, with its blocks indexed by depth. */
typedef struct pd_part {
    uint8_t *buf; /* [len]; the transfer client's when pulled (ds_xfer_buf_free), else malloc'd */
    int pulled;
    size_t len;
    pd_header h;
    const int32_t *prompt; /* into buf [h.n_prompt] */
    const pd_rank *ranks;  /* into buf [h.n_parts] */
    int *at;               /* [2][n_depths + 1]: block index of the page ([0]) / checkpoint ([1])
                              covering prompt[0, d * block_size), -1 for none */
    size_t *off;           /* [h.n_blocks] offsets of each pd_block in buf */
} pd_part;

/* A verified transfer on one rank: the producer's rank table and the parts this rank needs. */
struct ds_kv_pull {
    pd_part *parts; /* [n_parts] in part (producer world rank) order; one this rank does not
                       need is absent (buf NULL) */
    int n_parts;
    int n_depths;        /* n_prompt / block_size */
    int n_blocks;        /* over the parts present */
    size_t len;          /* bytes over the parts present */
    double wire_seconds; /* the parts' pulls (ds_xfer_pull calls), summed */
    char host[256];      /* the producer's, as the request named it */
    uint64_t id;
    uint8_t *front; /* [front_len] part 0's header, prompt and rank table (what the step
                       plan sends the other ranks of a consumer's job) */
    size_t front_len;
    pd_header h0;          /* part 0's header */
    const int32_t *prompt; /* into front [h0.n_prompt] */
    const pd_rank *ranks;  /* into front [n_parts] */
};

static void part_free(pd_part *q) {
    if (!q->buf)
        ;
    else if (q->pulled)
        ds_xfer_buf_free(q->buf);
    else
        free(q->buf);
    free(q->at);
    free(q->off);
    memset(q, 0, sizeof *q);
}

void ds_kv_pull_free(ds_kv_pull *p) {
    if (!p) return;
    for (int i = 0; i < p->n_parts; i++) part_free(&p->parts[i]);
    free(p->parts);
    free(p->front);
    free(p);
}

/* Layers of `kind` among [a, b). */
static int n_kind(const ds_config *c, int a, int b, int kind) {
    int n = 0;
    for (int l = a; l < b; l++) n += c->layer_kind[l] == kind;
    return n;
}

/* Bytes of the MLA rows of a page and of a checkpoint, for layers [lo, hi) at TP width T. */
static void part_sizes(const ds_engine *e, int lo, int hi, int T, size_t *mla, size_t *slot) {
    const ds_config *c = ds_model_config(e->model);
    size_t Hk = (size_t)c->kda_num_heads / (size_t)T, dk = (size_t)c->kda_head_dim;
    size_t W1 = (size_t)c->short_conv_kernel_size - 1;
    *mla = (size_t)n_kind(c, lo, hi, DS_LAYER_MLA) * (size_t)e->opts.block_size *
           ds_model_latent_row_bytes(e->model);
    *slot =
        (size_t)n_kind(c, lo, hi, DS_LAYER_KDA) * (3 * W1 * Hk * dk + Hk * dk * dk) * sizeof(float);
}

/* This rank's side of what both ends must agree on. */
static pd_header own_header(const ds_engine *e) {
    pd_header h = {.magic = PD_MAGIC, .version = PD_VERSION};
    h.model = e->kv_xseed;
    h.layer_lo = ds_model_first_layer(e->model);
    h.layer_hi = ds_model_end_layer(e->model);
    h.tp_rank = e->comm ? e->comm->tp_rank : 0;
    h.tp_size = e->comm ? e->comm->tp_size : 1;
    h.block_size = e->opts.block_size;
    h.chunk_tokens = e->chunk_tokens;
    h.page_bytes = e->prefix ? ds_prefix_page_bytes(e->prefix) : 0;
    h.slot_bytes = ds_model_slot_floats(e->model) * sizeof(float);
    size_t mla, slot;
    part_sizes(e, h.layer_lo, h.layer_hi, h.tp_size, &mla, &slot);
    h.x_bytes = h.page_bytes > mla ? h.page_bytes - mla : 0;
    h.part = e->comm ? e->comm->rank : 0;
    h.n_parts = e->comm ? e->comm->size : 1;
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

/* after: the prompt and the rank table, which follow the header */
static uint64_t header_sum(pd_header h, const void *after) {
    h.checksum = 0;
    return sum_over(&h, sizeof h, after,
                    (size_t)h.n_prompt * sizeof(int32_t) + (size_t)h.n_parts * sizeof(pd_rank));
}

static uint64_t block_sum(pd_block b, const void *payload) {
    b.checksum = 0;
    return sum_over(&b, sizeof b, payload, b.n_bytes);
}

/* ---- the producer ----------------------------------------------------------------------------*/

/* Every rank's table entry (pd_rank), on every rank (each field of rank r's is the smallest of
 * r's value and everyone else's UINT64_MAX): a producer's parts carry the table, a consumer's
 * ranks count from it who pulls what. */
static int gather_ranks(ds_engine *e, ds_err *err) {
    int n = e->comm ? e->comm->size : 1;
    e->pd_ranks = ds_calloc((size_t)n, sizeof(pd_rank), err);
    if (!e->pd_ranks) return DS_ERR;
    pd_header me = own_header(e);
    const int32_t mine[5] = {e->xfer ? ds_xfer_server_port(e->xfer) : 0, me.layer_lo, me.layer_hi,
                             me.tp_rank, (int32_t)DS_MIN(me.x_bytes, (uint64_t)INT32_MAX)};
    for (int r = 0; r < n; r++) {
        int32_t f[5];
        for (int k = 0; k < 5; k++) {
            uint64_t v = (!e->comm || e->comm->rank == r) ? (uint64_t)mine[k] : UINT64_MAX;
            if (e->dist && ds_comm_min_u64(e->comm, &v, err)) return DS_ERR;
            f[k] = (int32_t)v;
        }
        e->pd_ranks[r] = (pd_rank){f[0], f[1], f[2], f[3], f[4]};
    }
    return DS_OK;
}

int eng_pd_setup(ds_engine *e, ds_err *err) {
    const ds_engine_opts *o = &e->opts;
    if (o->kv_role == DS_KV_NONE) return DS_OK;
    if (o->kv_role < DS_KV_NONE || o->kv_role > DS_KV_BOTH)
        return ds_errf(err, "kv transfer: unknown role %d", o->kv_role);
    if (!e->prefix)
        return ds_errf(err,
                       "kv transfer: a kv_role needs prefix caching (the blocks are the prefix "
                       "cache's; drop --no-enable-prefix-caching)");
    if ((o->kv_role & DS_KV_CONSUMER) && !e->offload)
        return ds_errf(err, "kv transfer: a consumer needs an offload tier to receive blocks into");
    const ds_config *c = ds_model_config(e->model);
    if (e->comm && e->comm->tp_size > PD_MAX_TP)
        return ds_errf(err, "kv transfer: at most %d TP ranks", PD_MAX_TP);
    if (c->num_hidden_layers > DS_MAX_LAYERS)
        return ds_errf(err, "kv transfer: more than %d layers", DS_MAX_LAYERS);
    if (o->kv_role & DS_KV_PRODUCER) {
        /* every rank serves its own part; the head on kv_port, the others on free ports */
        const char *ip = o->kv_ip && o->kv_ip[0] ? o->kv_ip : "127.0.0.1";
        if (ds_xfer_server_create(ip, e->head ? o->kv_port : 0, 2000, &e->xfer, err)) return DS_ERR;
        ds_xfer_server_test_stall(e->xfer, o->test.kv_stall_ms);
        if (e->head)
            fprintf(stderr, "[deltaserve] kv transfer: producer, pulls on %s:%d (UCX)%s\n", ip,
                    ds_xfer_server_port(e->xfer),
                    e->dist ? ", every rank serving its own slice" : "");
    }
    if (o->kv_role & DS_KV_CONSUMER) { /* every rank pulls the parts it needs */
        if (ds_xfer_client_create(&e->xclient, err)) return DS_ERR;
        if (e->head)
            fprintf(stderr, "[deltaserve] kv transfer: consumer%s\n",
                    e->dist ? ", every rank pulling its own slice" : "");
    }
    return gather_ranks(e, err);
}

void eng_pd_free(ds_engine *e) {
    ds_xfer_server_free(e->xfer);
    e->xfer = NULL;
    ds_xfer_client_free(e->xclient); /* a pull still held by a request keeps its buffer */
    e->xclient = NULL;
    free(e->pd_ranks);
    e->pd_ranks = NULL;
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

int ds_engine_kv_tp_size(const ds_engine *e) {
    return e->comm ? e->comm->tp_size : 1;
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

/* Every rank of a producer's job runs this at the same finish (the plan carries the transfer id)
 * and files its own part under the id in its own store. */
void eng_pd_export(ds_engine *e, choice *ch) {
    request *r = ch->req;
    if (!e->xfer || !e->prefix || !r->spec.kv_export_id || ch->index != 0 || !ch->seq) return;
    const double t0 = ds_now();
    pd_header h = own_header(e);
    h.n_prompt = r->spec.n_prompt;
    outbuf o = {.h = &h};
    size_t n_prompt = (size_t)h.n_prompt * sizeof(int32_t);
    size_t head = sizeof h + n_prompt + (size_t)h.n_parts * sizeof(pd_rank);
    /* sized once: growing a 100 MB part by doubling copies it and holds up to twice its bytes */
    int n_pages, n_ckpts;
    ds_prefix_export_counts(e->prefix, ch->seq, &n_pages, &n_ckpts);
    size_t whole = head + (size_t)n_pages * (sizeof(pd_block) + h.page_bytes) +
                   (size_t)n_ckpts * (sizeof(pd_block) + h.slot_bytes);
    if (out_reserve(&o, whole)) {
        fprintf(stderr, "[deltaserve] kv transfer: no memory for %zu bytes of %016llx\n", whole,
                (unsigned long long)r->spec.kv_export_id);
        return;
    }
    o.len = head;
    int n = ds_prefix_export(e->prefix, ch->seq, out_block, &o);
    if (n < 0 || o.failed) {
        fprintf(stderr, "[deltaserve] kv transfer: export of %016llx failed (out of memory)\n",
                (unsigned long long)r->spec.kv_export_id);
        free(o.b);
        return;
    }
    h.n_blocks = o.n_blocks;
    memcpy(o.b + sizeof h, r->spec.prompt, n_prompt);
    memcpy(o.b + sizeof h + n_prompt, e->pd_ranks, (size_t)h.n_parts * sizeof(pd_rank));
    h.checksum = header_sum(h, o.b + sizeof h);
    memcpy(o.b, &h, sizeof h);
    ds_err err;
    int ttl = e->opts.kv_hold_timeout_ms > 0 ? e->opts.kv_hold_timeout_ms : 120000;
    const size_t len = o.len; /* (the store owns o.b from here) */
    if (ds_xfer_server_put(e->xfer, r->spec.kv_export_id, o.b, o.len, ttl, &err)) {
        fprintf(stderr, "[deltaserve] %s\n", err.msg);
        return;
    }
    pthread_mutex_lock(&e->mu);
    e->stats.kv_exports++;
    e->stats.kv_export_blocks += (uint64_t)o.n_blocks;
    e->stats.kv_export_bytes += len;
    e->stats.kv_export_seconds += ds_now() - t0;
    pthread_mutex_unlock(&e->mu);
}

/* ---- the consumer: verifying -----------------------------------------------------------------*/

/* Bytes of a part's front: its header, prompt and rank table. */
static size_t front_bytes(const pd_header *h) {
    return sizeof *h + (size_t)h->n_prompt * sizeof(int32_t) + (size_t)h->n_parts * sizeof(pd_rank);
}

/* Why q (its buf and len set; a front alone will do) cannot be a part of a transfer of
 * prompt[n_prompt] to this engine ("" when it can). q's prompt and ranks are set once the
 * header's checksum held (the table is then the producer's), its header on success. */
static const char *verify_header(const ds_engine *e, pd_part *q, const int32_t *prompt,
                                 int n_prompt) {
    pd_header want = own_header(e), h;
    const ds_config *c = ds_model_config(e->model);
    if (q->len < sizeof h) return "truncated header";
    memcpy(&h, q->buf, sizeof h);
    if (h.magic != PD_MAGIC || h.version != PD_VERSION) return "not a deltaserve transfer";
    if (h.n_prompt < 0 || h.n_blocks < 0 || h.n_parts < 1 || h.n_parts > PD_MAX_PARTS ||
        q->len < front_bytes(&h))
        return "truncated prompt";
    if (header_sum(h, q->buf + sizeof h) != h.checksum) return "header checksum mismatch";
    q->prompt = (const int32_t *)(q->buf + sizeof h);
    q->ranks = (const pd_rank *)(q->prompt + h.n_prompt);
    if (h.model != want.model) return "another model (or cut spacing, dtype, device)";
    if (h.tp_size < 1 || h.tp_size > PD_MAX_TP || h.tp_rank < 0 || h.tp_rank >= h.tp_size ||
        c->kda_num_heads % h.tp_size || h.layer_lo < 0 || h.layer_lo >= h.layer_hi ||
        h.layer_hi > c->num_hidden_layers || h.part < 0 || h.part >= h.n_parts)
        return "another layer range or TP layout";
    if (h.block_size != want.block_size || h.chunk_tokens != want.chunk_tokens)
        return "another block size or cut spacing";
    size_t mla, slot;
    part_sizes(e, h.layer_lo, h.layer_hi, h.tp_size, &mla, &slot);
    if (h.page_bytes != mla + h.x_bytes || h.slot_bytes != slot)
        return "another page or slot layout (start both with the same --speculative-method)";
    if (h.n_prompt != n_prompt || memcmp(q->prompt, prompt, (size_t)n_prompt * sizeof(int32_t)))
        return "another prompt";
    q->h = h;
    return "";
}

static const char *verify_part(const ds_engine *e, pd_part *q, const int32_t *prompt,
                               int n_prompt) {
    const char *why = verify_header(e, q, prompt, n_prompt);
    if (why[0]) return why;
    const pd_header *h = &q->h;
    int nd = n_prompt / h->block_size;
    q->off = malloc((size_t)DS_MAX(h->n_blocks, 1) * sizeof *q->off);
    q->at = malloc(2 * ((size_t)nd + 1) * sizeof *q->at);
    if (!q->off || !q->at) return "out of memory";
    for (int i = 0; i < 2 * (nd + 1); i++) q->at[i] = -1;
    size_t at = front_bytes(h);
    for (int i = 0; i < h->n_blocks; i++) {
        pd_block b;
        if (q->len - at < sizeof b) return "truncated block header";
        memcpy(&b, q->buf + at, sizeof b);
        if (b.n_bytes > q->len - at - sizeof b) return "truncated block";
        if (block_sum(b, q->buf + at + sizeof b) != b.checksum) return "block checksum mismatch";
        if ((b.kind != 'p' && b.kind != 'c') ||
            b.n_bytes != (b.kind == 'p' ? h->page_bytes : h->slot_bytes))
            return "bad block kind or size";
        if (b.n_tokens <= 0 || b.n_tokens > n_prompt || b.n_tokens % h->block_size)
            return "bad block depth";
        int *slot = &q->at[(b.kind == 'c') * (nd + 1) + b.n_tokens / h->block_size];
        if (*slot >= 0) return "bad block depth";
        *slot = i;
        if (b.layer_lo != h->layer_lo || b.layer_hi != h->layer_hi || b.tp_rank != h->tp_rank)
            return "block of another layer range or rank";
        q->off[i] = at;
        at += sizeof b + b.n_bytes;
    }
    if (at != q->len) return "trailing bytes";
    return "";
}

/* Takes part 0's front (its header h verified) as the transfer's rank table: a copy of its
 * bytes, and room for every part. */
static const char *adopt_front(ds_kv_pull *p, const pd_header *h, const uint8_t *src) {
    const pd_header h0 = *h; /* (h may be in p->parts, which moves) */
    const size_t n = front_bytes(&h0);
    if (!(p->front = malloc(n))) return "out of memory";
    memcpy(p->front, src, n);
    p->front_len = n;
    p->h0 = h0;
    p->prompt = (const int32_t *)(p->front + sizeof h0);
    p->ranks = (const pd_rank *)(p->prompt + h0.n_prompt);
    if (p->n_parts < h0.n_parts) {
        pd_part *all = realloc(p->parts, (size_t)h0.n_parts * sizeof *all);
        if (!all) return "out of memory";
        memset(all + p->n_parts, 0, (size_t)(h0.n_parts - p->n_parts) * sizeof *all);
        p->parts = all;
    }
    p->n_parts = h0.n_parts;
    return "";
}

/* Why the producer's rank table (part 0's) cannot make a whole transfer to this engine ("" when
 * it can): one TP width, part 0 as its own header says, every layer covered once by each TP
 * rank, and the DSpark draft's rows in one part exactly when this job drafts. */
static const char *verify_layout(const ds_engine *e, const ds_kv_pull *p) {
    const ds_config *c = ds_model_config(e->model);
    const pd_header *h0 = &p->h0;
    const int T = h0->tp_size;
    int x = 0;
    for (int i = 0; i < p->n_parts; i++) {
        const pd_rank *r = &p->ranks[i];
        if (r->tp_rank < 0 || r->tp_rank >= T || r->layer_lo < 0 || r->layer_lo >= r->layer_hi ||
            r->layer_hi > c->num_hidden_layers || r->port <= 0 || r->port > 65535)
            return "another layer range or TP layout";
        x += r->x != 0;
    }
    const pd_rank *r0 = &p->ranks[0];
    if (h0->part != 0 || r0->layer_lo != h0->layer_lo || r0->layer_hi != h0->layer_hi ||
        r0->tp_rank != h0->tp_rank || (uint64_t)r0->x != h0->x_bytes)
        return "parts of another layout (the producer's ranks disagree)";
    for (int l = 0; l < c->num_hidden_layers; l++) {
        uint64_t seen = 0;
        for (int i = 0; i < p->n_parts; i++) {
            const pd_rank *r = &p->ranks[i];
            if (l < r->layer_lo || l >= r->layer_hi) continue;
            if (seen >> r->tp_rank & 1) return "parts that overlap";
            seen |= 1ull << r->tp_rank;
        }
        if (seen != (1ull << T) - 1) return "parts that miss a layer or a TP rank";
    }
    int drafts = e->opts.speculative_method == DS_SPEC_DSPARK && !e->opts.test.spec_drafts;
    if (x > 1 || drafts != (x == 1))
        return "another page or slot layout (start both with the same --speculative-method)";
    return "";
}

/* Why part i (verified on its own) does not fit the table ("" when it does). */
static const char *verify_member(const ds_engine *e, const ds_kv_pull *p, const pd_part *q, int i) {
    const pd_header *h = &q->h;
    const pd_rank *r = &p->ranks[i];
    if (h->part != i || h->n_parts != p->n_parts || h->tp_size != p->h0.tp_size ||
        h->layer_lo != r->layer_lo || h->layer_hi != r->layer_hi || h->tp_rank != r->tp_rank ||
        (uint64_t)r->x != h->x_bytes)
        return "parts of another layout (the producer's ranks disagree)";
    pd_header mine = own_header(e);
    if (h->x_bytes && mine.x_bytes && h->x_bytes != mine.x_bytes)
        return "another page or slot layout (start both with the same --speculative-method)";
    return "";
}

/* ---- the consumer: who pulls what ------------------------------------------------------------*/

/* The first part holding layer l (its latent rows are the same on every TP rank: the one part
 * every consumer rank takes them from), -1 for none. */
static int first_holder(const ds_kv_pull *p, int l) {
    for (int i = 0; i < p->n_parts; i++)
        if (l >= p->ranks[i].layer_lo && l < p->ranks[i].layer_hi) return i;
    return -1;
}

/* Does rank c of this consumer's job need part i: for the KDA heads it holds of c's layers, as
 * the first holder of one of c's MLA layers, or for the draft's rows when c's pages carry them? */
static int needs(const ds_engine *e, const ds_kv_pull *p, const pd_rank *c, int i) {
    const ds_config *cfg = ds_model_config(e->model);
    const pd_rank *q = &p->ranks[i];
    if (c->x && q->x) return 1;
    const int H = cfg->kda_num_heads, Hc = H / ds_engine_kv_tp_size(e), Hq = H / p->h0.tp_size;
    for (int l = DS_MAX(c->layer_lo, q->layer_lo); l < DS_MIN(c->layer_hi, q->layer_hi); l++) {
        if (cfg->layer_kind[l] == DS_LAYER_KDA) {
            if (c->tp_rank * Hc < (q->tp_rank + 1) * Hq && q->tp_rank * Hq < (c->tp_rank + 1) * Hc)
                return 1;
        } else if (cfg->layer_kind[l] == DS_LAYER_MLA && first_holder(p, l) == i)
            return 1;
    }
    return 0;
}

/* What a rank's pull of part i tells the producer (xfer.h): how many of the job's ranks pull it
 * — for part 0 in a job of several ranks, not counting the head, whose first look at it (to
 * learn the table) was uncounted. */
static int pulls_of(const ds_engine *e, const ds_kv_pull *p, int i) {
    const int n = e->comm ? e->comm->size : 1;
    int k = 0;
    for (int r = 0; r < n; r++) k += needs(e, p, &e->pd_ranks[r], i);
    if (i == 0 && n > 1) k -= needs(e, p, &e->pd_ranks[0], 0);
    return k;
}

/* ---- the consumer: pulling -------------------------------------------------------------------*/

/* The head gives a transfer up, or finds parts no rank needs: asks the producer's ranks to free
 * the parts with release[i] set now, not when hold_timeout_s runs out, and counts those that
 * were freed. */
static void release_parts(ds_engine *e, const ds_kv_pull *p, const pd_rank *table, int n,
                          const uint8_t *release) {
    int freed = 0;
    for (int i = 0; i < n; i++) {
        if (!release[i]) continue;
        ds_err rerr = {{0}};
        if (ds_xfer_release(e->xclient, p->host, table[i].port, p->id, 2000, &rerr) == DS_OK)
            freed++;
        else
            fprintf(stderr, "[deltaserve] kv transfer %016llx: release of part %d: %s\n",
                    (unsigned long long)p->id, i, rerr.msg);
    }
    pthread_mutex_lock(&e->mu);
    e->stats.kv_released += (uint64_t)freed;
    pthread_mutex_unlock(&e->mu);
}

/* A pull installed (ok, p), or failed for reason (DS_KV_FAIL_*). */
static void count_pull(ds_engine *e, int ok, const ds_kv_pull *p, int reason) {
    pthread_mutex_lock(&e->mu);
    if (ok) {
        e->stats.kv_pulls++;
        e->stats.kv_pull_blocks += (uint64_t)p->n_blocks;
        e->stats.kv_pull_bytes += p->len;
        e->stats.kv_pull_seconds += p->wire_seconds;
    } else {
        e->stats.kv_pull_failures++;
        e->stats.kv_pull_fail_by[reason]++;
    }
    pthread_mutex_unlock(&e->mu);
}

/* The reason of a refusal why (a verify_* answer or a local failure) of a part that was pulled;
 * one that was not is DS_KV_FAIL_UNAVAILABLE. The verify_* answers that name a transfer of
 * another model, layout or prompt all begin "another"; the rest say the parts are malformed. */
static int refusal_reason(const char *why) {
    if (!strncmp(why, "another", 7)) return DS_KV_FAIL_MISMATCH;
    if (!strcmp(why, "out of memory")) return DS_KV_FAIL_LOCAL;
    return DS_KV_FAIL_DAMAGED;
}

/* The most bytes a part of a transfer of this prompt can have: its front (PD_MAX_PARTS table
 * entries), then at each of the prompt's block depths a page and a checkpoint of the whole model
 * at TP 1 (no part holds more), with their headers and the draft's rows. A part announced larger
 * is refused before any memory is taken for it (a client names the producer). */
static size_t part_bound(const ds_engine *e, const ds_kv_pull *p) {
    const ds_config *c = ds_model_config(e->model);
    size_t mla, slot;
    part_sizes(e, 0, c->num_hidden_layers, 1, &mla, &slot);
    size_t x = 0; /* the draft's rows: the size the job's sampling rank has (verified equal) */
    for (int r = 0; r < (e->comm ? e->comm->size : 1); r++)
        x = DS_MAX(x, (size_t)DS_MAX(e->pd_ranks[r].x, 0));
    const size_t bs = (size_t)e->opts.block_size, nd = (size_t)p->n_depths + 1;
    const size_t front =
        sizeof(pd_header) + nd * bs * sizeof(int32_t) + PD_MAX_PARTS * sizeof(pd_rank);
    return front + nd * (2 * sizeof(pd_block) + mla + x + slot);
}

/* Pulls part i of the transfer from port, as one of `pulls` (xfer.h), and verifies it (against
 * the table once it is known); "" on success, else why not (err filled when the pull itself
 * failed). */
static const char *pull_part(ds_engine *e, ds_kv_pull *p, int i, int port, int pulls,
                             const int32_t *prompt, int n_prompt, ds_err *err) {
    pd_part *q = &p->parts[i];
    int timeout = e->opts.kv_pull_timeout_ms > 0 ? e->opts.kv_pull_timeout_ms : 30000;
    /* a rank other than the head pulls inside the step loop, where its whole job waits for it:
     * the producer answered the head a moment ago, so a part that does not come within seconds
     * is given up (the job recomputes) rather than holding every running request */
    if (!e->head) timeout = DS_MIN(timeout, PD_RANK_PULL_MS);
    void *buf;
    const double t0 = ds_now();
    if (ds_xfer_pull_shared(e->xclient, p->host, port, p->id, pulls, part_bound(e, p), timeout,
                            &buf, &q->len, err))
        return err->msg;
    p->wire_seconds += ds_now() - t0;
    q->buf = buf;
    q->pulled = 1;
    /* tests: in the last part (of a producer's job: its last rank's), a byte of the last payload
     * flipped (1), or the part cut 1 KiB short (2) */
    int n_parts = p->n_parts;
    if (i == 0 && q->len >= sizeof(pd_header)) {
        pd_header h;
        memcpy(&h, q->buf, sizeof h);
        n_parts = h.n_parts;
    }
    if (i == n_parts - 1 && e->opts.test.kv_corrupt == 1 && q->len) q->buf[q->len - 1] ^= 0x40;
    if (i == n_parts - 1 && e->opts.test.kv_corrupt == 2) q->len -= DS_MIN(q->len, 1024);
    const char *why = verify_part(e, q, prompt, n_prompt);
    if (!why[0] && p->ranks) why = verify_member(e, p, q, i);
    if (why[0]) return why;
    p->n_blocks += q->h.n_blocks;
    p->len += q->len;
    return "";
}

/* This rank's parts of p (its table known) that it does not have yet. */
static const char *pull_own(ds_engine *e, ds_kv_pull *p, const int32_t *prompt, int n_prompt,
                            uint8_t *tried, ds_err *perr) {
    const pd_rank *me = &e->pd_ranks[e->comm ? e->comm->rank : 0];
    for (int i = 0; i < p->n_parts; i++) {
        if (p->parts[i].buf || !needs(e, p, me, i)) continue;
        if (tried) tried[i] = 1;
        const char *why =
            pull_part(e, p, i, p->ranks[i].port, pulls_of(e, p, i), prompt, n_prompt, perr);
        if (why[0]) return why;
    }
    return "";
}

static ds_kv_pull *new_pull(ds_engine *e, const char *host, uint64_t id, int n_prompt) {
    ds_kv_pull *p = calloc(1, sizeof *p);
    if (!p || !(p->parts = calloc(1, sizeof *p->parts))) {
        free(p);
        return NULL;
    }
    p->n_parts = 1;
    p->n_depths = n_prompt / e->opts.block_size;
    snprintf(p->host, sizeof p->host, "%s", host ? host : "");
    p->id = id;
    return p;
}

int ds_engine_kv_pull(ds_engine *e, const char *host, int port, uint64_t id, const int32_t *prompt,
                      int n_prompt, ds_kv_pull **out, ds_err *err) {
    *out = NULL;
    if (!(e->opts.kv_role & DS_KV_CONSUMER)) {
        count_pull(e, 0, NULL, DS_KV_FAIL_LOCAL);
        return ds_errf(err, "kv transfer: this server is not a consumer (--kv-transfer-config)");
    }
    if (!e->head || !e->xclient) {
        count_pull(e, 0, NULL, DS_KV_FAIL_LOCAL);
        return ds_errf(err, "kv transfer: only the job's head takes a transfer's parameters");
    }
    ds_kv_pull *p = new_pull(e, host, id, n_prompt);
    if (!p) {
        count_pull(e, 0, NULL, DS_KV_FAIL_LOCAL);
        return ds_errf(err, "kv transfer: out of memory");
    }
    /* part 0 first: its table says where the others are and who needs what. A job of one rank
     * takes it; in a larger one the head only looks (other ranks may need it too). */
    const int single = !e->comm || e->comm->size == 1;
    ds_err perr = {{0}};
    const char *why = pull_part(e, p, 0, port, single ? 1 : 0, prompt, n_prompt, &perr);
    int pulled = why != perr.msg; /* a pull that failed says so itself (it names the peer) */
    /* the producer's table, once part 0's header checksum held (even if the part is refused) */
    const pd_rank *table = p->parts[0].ranks;
    int n = 0;
    if (table) {
        pd_header h;
        memcpy(&h, p->parts[0].buf, sizeof h);
        n = h.n_parts;
    }
    uint8_t *flag = calloc((size_t)n + 1, 1); /* [n]: pulled by the head / to be released */
    if (!flag) why = "out of memory";
    if (!why[0]) why = adopt_front(p, &p->parts[0].h, p->parts[0].buf);
    if (!why[0]) why = verify_layout(e, p);
    if (!why[0]) why = verify_member(e, p, &p->parts[0], 0);
    if (!why[0]) {
        why = pull_own(e, p, prompt, n_prompt, flag, &perr);
        pulled = why != perr.msg;
    }
    if (why[0]) {
        if (flag) { /* every part the producer may still hold, now: not part 0 or a part the
                       head took alone (pulled as the only pull of it) */
            for (int i = 0; i < n; i++)
                flag[i] = !(i == 0 && single) && !(flag[i] && p->ranks && pulls_of(e, p, i) == 1);
            release_parts(e, p, table, n, flag);
        }
        if (pulled)
            ds_errf(err, "kv transfer %016llx from %s:%d rejected: %s", (unsigned long long)id,
                    host, port, why);
        else
            ds_errf(err, "%s", perr.msg);
        free(flag);
        ds_kv_pull_free(p);
        count_pull(e, 0, NULL, pulled ? refusal_reason(why) : DS_KV_FAIL_UNAVAILABLE);
        return DS_ERR;
    }
    /* parts that no rank of this job needs (part 0: none but the head, which has it) */
    int idle = 0;
    for (int i = 0; i < n; i++) idle |= flag[i] = (i > 0 || !single) && pulls_of(e, p, i) == 0;
    if (idle) release_parts(e, p, table, n, flag);
    free(flag);
    count_pull(e, 1, p, 0);
    *out = p;
    return DS_OK;
}

/* ---- the step plan: a transfer to every rank of the consumer's job --------------------------*/

int eng_pd_plan_info(const ds_kv_pull *p, const char **host, uint64_t *id, const void **front,
                     size_t *front_len) {
    if (!p) return 0;
    *host = p->host;
    *id = p->id;
    *front = p->front;
    *front_len = p->front_len;
    return 1;
}

ds_kv_pull *eng_pd_pull_rank(ds_engine *e, const char *host, uint64_t id, const void *front,
                             size_t front_len, const int32_t *prompt, int n_prompt) {
    ds_kv_pull *p = new_pull(e, host, id, n_prompt);
    const char *why = p ? "" : "out of memory";
    ds_err perr = {{0}};
    uint8_t *copy = p ? malloc(DS_MAX(front_len, 1)) : NULL; /* aligned, unlike the plan's */
    if (!copy) why = "out of memory";
    if (!why[0]) {
        memcpy(copy, front, front_len);
        pd_part f = {.buf = copy, .len = front_len};
        why = verify_header(e, &f, prompt, n_prompt);
        if (!why[0] && front_len != front_bytes(&f.h)) why = "a front of another length";
        if (!why[0]) why = adopt_front(p, &f.h, copy);
    }
    free(copy);
    if (!why[0]) why = verify_layout(e, p);
    if (!why[0] && !e->xclient) why = "this rank has no transfer client";
    if (!why[0]) why = pull_own(e, p, prompt, n_prompt, NULL, &perr);
    if (why[0]) { /* this rank then misses, and the job recomputes */
        fprintf(stderr, "[deltaserve] %s: kv transfer %016llx: %s\n", e->comm ? e->comm->who : "",
                (unsigned long long)id, why);
        ds_kv_pull_free(p);
        return NULL;
    }
    return p;
}

/* ---- the consumer: this rank's slice into its offload tier ------------------------------------*/

/* The block of `kind` (0 page, 1 checkpoint) at depth d of part q: its payload, or NULL (also
 * for a part this rank did not pull). */
static const uint8_t *payload(const ds_kv_pull *p, const pd_part *q, int kind, int d) {
    if (!q->at) return NULL;
    int i = q->at[kind * (p->n_depths + 1) + d];
    return i < 0 ? NULL : q->buf + q->off[i] + sizeof(pd_block);
}

/* This rank's page at depth d into out[own page bytes]: the MLA rows of each of its layers from
 * the first part holding that layer (the one this rank pulled for it), then the draft's rows from
 * the part that has them. 0 when a piece is missing. */
static int build_page(const ds_engine *e, const ds_kv_pull *p, int d, const pd_header *me,
                      uint8_t *out) {
    const ds_config *c = ds_model_config(e->model);
    size_t rows = (size_t)e->opts.block_size * ds_model_latent_row_bytes(e->model), at = 0;
    for (int l = me->layer_lo; l < me->layer_hi; l++) {
        if (c->layer_kind[l] != DS_LAYER_MLA) continue;
        const int i = first_holder(p, l);
        const uint8_t *src = i < 0 ? NULL : payload(p, &p->parts[i], 0, d);
        if (!src) return 0;
        src += (size_t)n_kind(c, p->ranks[i].layer_lo, l, DS_LAYER_MLA) * rows;
        memcpy(out + at, src, rows);
        at += rows;
    }
    if (!me->x_bytes) return 1;
    for (int i = 0; i < p->n_parts; i++) {
        const pd_part *q = &p->parts[i];
        const uint8_t *src = q->h.x_bytes == me->x_bytes ? payload(p, q, 0, d) : NULL;
        if (src) {
            memcpy(out + at, src + q->h.page_bytes - q->h.x_bytes, me->x_bytes);
            return 1;
        }
    }
    return 0;
}

/* This rank's checkpoint at depth d into out[own slot floats]: for each of its KDA layers and
 * each of its heads, the head's conv-tail channels and recurrent state from the part of the TP
 * rank that holds that head there. 0 when a piece is missing. */
static int build_ckpt(const ds_engine *e, const ds_kv_pull *p, int d, const pd_header *me,
                      float *out) {
    const ds_config *c = ds_model_config(e->model);
    const size_t H = (size_t)c->kda_num_heads, dk = (size_t)c->kda_head_dim;
    const size_t W1 = (size_t)c->short_conv_kernel_size - 1, Hc = H / (size_t)me->tp_size;
    const size_t c0 = (size_t)me->tp_rank * Hc,
                 nkc = (size_t)n_kind(c, me->layer_lo, me->layer_hi, DS_LAYER_KDA);
    float *conv_c = out, *rec_c = out + nkc * 3 * W1 * Hc * dk;
    for (int l = me->layer_lo; l < me->layer_hi; l++) {
        if (c->layer_kind[l] != DS_LAYER_KDA) continue;
        size_t kc = (size_t)n_kind(c, me->layer_lo, l, DS_LAYER_KDA);
        for (size_t h = c0; h < c0 + Hc; h++) {
            const pd_part *q = NULL;
            const float *src = NULL;
            /* the part by the table (one this rank did not pull is absent: no payload) */
            for (int i = 0; i < p->n_parts && !src; i++) {
                const pd_rank *r = &p->ranks[i];
                q = &p->parts[i];
                if (l >= r->layer_lo && l < r->layer_hi &&
                    h / (H / (size_t)p->h0.tp_size) == (size_t)r->tp_rank)
                    src = (const float *)payload(p, q, 1, d);
            }
            if (!src) return 0;
            size_t Hq = H / (size_t)q->h.tp_size, p0 = (size_t)q->h.tp_rank * Hq;
            size_t kp = (size_t)n_kind(c, q->h.layer_lo, l, DS_LAYER_KDA);
            size_t nkp = (size_t)n_kind(c, q->h.layer_lo, q->h.layer_hi, DS_LAYER_KDA);
            /* conv tails [n_kda][3][W-1][Hk*dk]: dk channels per head in each of 3(W-1) rows */
            for (size_t j = 0; j < 3 * W1; j++)
                memcpy(conv_c + (kc * 3 * W1 + j) * Hc * dk + (h - c0) * dk,
                       src + (kp * 3 * W1 + j) * Hq * dk + (h - p0) * dk, dk * sizeof(float));
            /* recurrent states [n_kda][Hk][dk][dk] after all the conv tails */
            const float *rec_p = src + nkp * 3 * W1 * Hq * dk;
            memcpy(rec_c + (kc * Hc + (h - c0)) * dk * dk, rec_p + (kp * Hq + (h - p0)) * dk * dk,
                   dk * dk * sizeof(float));
        }
    }
    return 1;
}

/* Every rank, at the request's admission: its slice of every pulled block into its offload tier,
 * under its own hash chain (the hash seed names the TP width, so it may differ from the
 * producer's) and the prompt as the key. */
void eng_pd_install(ds_engine *e, request *r) {
    ds_kv_pull *p = r->kv_import;
    r->kv_import = NULL;
    if (!p) return;
    pd_header me = own_header(e);
    size_t slot_floats = ds_model_slot_floats(e->model);
    uint8_t *page = malloc(DS_MAX(me.page_bytes, 1));
    float *slot = malloc(DS_MAX(slot_floats, 1) * sizeof(float));
    const int32_t *prompt = p->prompt;
    uint64_t h[2] = {0, 0};
    int bs = e->opts.block_size, missed = 0;
    for (int d = 1; e->offload && e->prefix && page && slot && d <= p->n_depths; d++) {
        ds_prefix_hash_block(e->prefix, d > 1 ? h : NULL, prompt + (size_t)(d - 1) * bs, h);
        int has_p = 0, has_c = 0;
        for (int i = 0; i < p->n_parts; i++) {
            has_p |= payload(p, &p->parts[i], 0, d) != NULL;
            has_c |= payload(p, &p->parts[i], 1, d) != NULL;
        }
        if (has_p && !(missed |= !build_page(e, p, d, &me, page)))
            ds_offload_put(e->offload, 'p', h, prompt, d * bs, page, me.page_bytes / 4);
        if (has_c && !(missed |= !build_ckpt(e, p, d, &me, slot)))
            ds_offload_put(e->offload, 'c', h, prompt, d * bs, slot, slot_floats);
    }
    if (missed) /* the job's agreement on offload hits turns this into a miss on every rank */
        fprintf(stderr, "[deltaserve] %s: kv transfer: a block lacks this rank's slice\n",
                e->comm ? e->comm->who : "");
    free(page);
    free(slot);
    ds_kv_pull_free(p);
}
