/* prefix.c — the prefix index, checkpoint rungs and forks (see prefix.h for the contract).
 *
 * Data: entries live in a growable array (freed ones on a free list) and are found through a
 * chained hash table on their 128-bit hash. Block tokens of entry e are toks[e][0 .. block_size).
 * Checkpoints are slots of a private ds_slot_pool; filed, unpinned ones sit on an LRU list and the
 * head is evicted when a rung needs a slot and none is free. A checkpoint pinned by a pending fork
 * is off the list, so it cannot vanish between admission and the copy in the first step.
 *
 * Why the chain check is sound: an entry is removed only when nothing hangs below it (no children,
 * no pins), so an entry's parent index always names the very entry it was filed under; a lookup
 * that checks tokens and parent at every level has therefore matched the whole prefix token by
 * token, whatever the hash does. */
#include "cache/prefix.h"

#include "base/devmem.h"

#include "cache/sequence.h"

#include <stdlib.h>
#include <xxhash.h>

#define MAX_CKPT_PROBES 3 /* offload lookups of checkpoints per admission */

typedef struct entry {
    uint64_t hash[2];
    int32_t parent;     /* entry index, -1 for a first block */
    int32_t depth;      /* blocks from the root: the entry summarises tokens [0, depth*bs) */
    int32_t page;       /* device page with this block's latents; -1 none */
    int32_t ckpt;       /* checkpoint slot: state after depth*bs tokens; -1 none */
    int32_t n_children; /* entries whose parent this is */
    int32_t pins;       /* live sequences whose chain passes through here */
    int32_t hnext;      /* next in the hash bucket, or in the free list */
    uint8_t used, page_stored, ckpt_stored, demand;
} entry;

struct ds_prefix {
    ds_prefix_opts o;
    int bs, interval;
    int chunk;   /* the scheduler's cut spacing */
    int granule; /* lcm(chunk, bs): rungs are multiples of it (cuts that are page boundaries) */
    ds_page_pool *pages;            /* not owned */
    ds_kv_pool *kv;                 /* not owned */
    ds_offload *off;                /* not owned; may be NULL */
    int (*agree)(void *ctx, int v); /* min of v over a job's ranks (NULL: one process) */
    void *agree_ctx;
    /* rows other caches keep per page (the DSpark draft's latents), offloaded with the page */
    float **xlayer; /* [n_xlayers] each [>= n_pages][bs][xrow], not owned */
    int n_xlayers, xrow;
    entry *ents;   /* [cap] */
    int32_t *toks; /* [cap][bs] block tokens of each entry */
    int cap, n_used, free_head;
    int32_t *buckets; /* [n_buckets] first entry of each chain, -1 none */
    int n_buckets;
    int32_t *page_entry; /* [n_pages] entry whose block the page holds, -1 none */
    /* checkpoints */
    ds_slot_pool *ck; /* NULL when checkpoints are off */
    int n_ck;
    size_t slot_floats;
    int32_t *ck_entry;          /* [n_ck] owning entry, -1 free */
    int32_t *ck_pins;           /* [n_ck] pending forks */
    int32_t *ck_prev, *ck_next; /* [n_ck] LRU of filed unpinned checkpoints */
    int32_t ck_head, ck_tail;
    /* scratch. Loads and stores have separate buffers: a load's payload sits in its buffer
     * until it is installed, and installing it takes a page or a checkpoint slot, which may
     * evict another one whose store runs right then (issue 30: the store used to overwrite the
     * payload being loaded, and another prefix's state was filed under this one). A store only
     * ever writes st_*, a load only ld_*, and neither path calls the other. */
    uint8_t *hbuf;    /* [16 + 4*bs] hash input */
    int32_t *ld_kbuf; /* [cap_ld_kbuf] a load's key: the prefix's tokens */
    int cap_ld_kbuf;
    uint8_t *ld_pbuf; /* [page_bytes] a page read from the offload tier, until scattered */
    uint8_t *st_pbuf; /* [page_bytes] a page gathered for a store */
    float *ld_sbuf;   /* [slot_floats] a checkpoint read from the offload tier, until copied */
    float *st_sbuf;   /* [slot_floats] a checkpoint staged for a store (it may be device memory) */
    int loading;      /* a load holds ld_* (checked: a store never runs inside a store) */
    int storing;
    int32_t *tbuf; /* [cap_tbuf] a store's key: the prefix's tokens */
    int cap_tbuf;
    ds_prefix_stats st;
};

/* ---- hashing and the index ------------------------------------------------------------------ */

void ds_prefix_hash_block(const ds_prefix *px, const uint64_t *parent, const int32_t *tokens,
                          uint64_t out[2]) {
    uint64_t p[2] = {parent ? parent[0] : 0, parent ? parent[1] : 0};
    memcpy(px->hbuf, p, 16);
    memcpy(px->hbuf + 16, tokens, (size_t)px->bs * sizeof(int32_t));
    XXH128_hash_t h = XXH3_128bits_withSeed(px->hbuf, 16 + (size_t)px->bs * 4, px->o.seed);
    out[0] = h.low64;
    out[1] = h.high64;
    if (px->o.test_hash_bits > 0 && px->o.test_hash_bits < 64) {
        out[0] &= ((uint64_t)1 << px->o.test_hash_bits) - 1;
        out[1] = 0;
    }
}

/* The blocks of a prompt of n tokens that the index may hold (docs/prefix-cache.md): a prompt is
 * cut at multiples of chunk and at its end, so rows below n snapped down to a multiple of chunk
 * lie in whole chunk-sized steps, computed the way every prompt that shares them computes them.
 * Rows of the prompt's last, partial step were computed in a step only prompts of exactly n
 * tokens make (and no checkpoint can sit among them), and rows past n come from decode steps,
 * whose numerics no prompt reproduces: neither is ever filed. */
static int fileable_blocks(const ds_prefix *px, int n_prompt) {
    return n_prompt / px->chunk * px->chunk / px->bs;
}

static int bucket(const ds_prefix *px, const uint64_t h[2]) {
    return (int)((h[0] ^ h[1]) & (uint64_t)(px->n_buckets - 1));
}

static int find(const ds_prefix *px, const uint64_t h[2]) {
    for (int e = px->buckets[bucket(px, h)]; e >= 0; e = px->ents[e].hnext)
        if (px->ents[e].hash[0] == h[0] && px->ents[e].hash[1] == h[1]) return e;
    return -1;
}

static int grow(ds_prefix *px) {
    int cap = px->cap ? 2 * px->cap : 256;
    entry *ne = realloc(px->ents, (size_t)cap * sizeof *ne);
    if (!ne) return DS_ERR;
    px->ents = ne;
    int32_t *nt = realloc(px->toks, (size_t)cap * px->bs * sizeof *nt);
    if (!nt) return DS_ERR;
    px->toks = nt;
    for (int i = cap - 1; i >= px->cap; i--) {
        px->ents[i].used = 0;
        px->ents[i].hnext = px->free_head;
        px->free_head = i;
    }
    px->cap = cap;
    /* keep chains short: as many buckets as entries */
    if (px->n_buckets < cap) {
        int32_t *nb = malloc((size_t)cap * sizeof *nb);
        if (!nb) return DS_OK; /* longer chains, still correct */
        free(px->buckets);
        px->buckets = nb;
        px->n_buckets = cap;
        for (int i = 0; i < cap; i++) nb[i] = -1;
        for (int e = 0; e < px->cap; e++) {
            if (!px->ents[e].used) continue;
            int b = bucket(px, px->ents[e].hash);
            px->ents[e].hnext = nb[b];
            nb[b] = e;
        }
    }
    return DS_OK;
}

/* A new entry for block `depth` (1-based) under parent, with no page or checkpoint yet. */
static int new_entry(ds_prefix *px, const uint64_t h[2], int parent, int depth,
                     const int32_t *tokens) {
    if (px->free_head < 0 && grow(px) != DS_OK) return -1;
    int e = px->free_head;
    px->free_head = px->ents[e].hnext;
    entry *en = &px->ents[e];
    *en = (entry){{h[0], h[1]}, parent, depth, -1, -1, 0, 0, -1, 1, 0, 0, 0};
    memcpy(px->toks + (size_t)e * px->bs, tokens, (size_t)px->bs * sizeof(int32_t));
    int b = bucket(px, h);
    en->hnext = px->buckets[b];
    px->buckets[b] = e;
    if (parent >= 0) px->ents[parent].n_children++;
    px->n_used++;
    return e;
}

/* Removes e, and then its ancestors, while each holds nothing and nothing hangs below it. */
static void maybe_remove(ds_prefix *px, int e) {
    while (e >= 0) {
        entry *en = &px->ents[e];
        if (!en->used || en->page >= 0 || en->ckpt >= 0 || en->n_children > 0 || en->pins > 0)
            return;
        int32_t *p = &px->buckets[bucket(px, en->hash)];
        while (*p != e) p = &px->ents[*p].hnext;
        *p = en->hnext;
        en->used = 0;
        en->hnext = px->free_head;
        px->free_head = e;
        px->n_used--;
        int parent = en->parent;
        if (parent >= 0) px->ents[parent].n_children--;
        e = parent;
    }
}

/* Grows *buf to hold n int32s. */
static int32_t *grow_i32(int32_t **buf, int *cap, int n) {
    if (n > *cap) {
        int32_t *t = realloc(*buf, (size_t)n * sizeof *t);
        if (!t) return NULL;
        *buf = t;
        *cap = n;
    }
    return *buf;
}

/* The key an entry is kept under in the offload tier, into *buf: the tokens [0, depth*bs) it
 * summarises (from `tokens`, or gathered up its parent chain when NULL). Returns the count, -1
 * when out of memory. */
static int entry_key(ds_prefix *px, int e, const int32_t *tokens, int32_t **buf, int *cap) {
    const entry *en = &px->ents[e];
    int n = en->depth * px->bs;
    if (!grow_i32(buf, cap, n)) return -1;
    if (tokens)
        memcpy(*buf, tokens, (size_t)n * sizeof(int32_t));
    else
        for (int a = e; a >= 0; a = px->ents[a].parent)
            memcpy(*buf + (size_t)(px->ents[a].depth - 1) * px->bs, px->toks + (size_t)a * px->bs,
                   (size_t)px->bs * sizeof(int32_t));
    return n;
}

/* ---- pages and the offload tier ------------------------------------------------------------- */

/* Bytes of a page's payload: the latent pool's rows as stored (f32 or FP8: opaque bytes here,
 * kv->row_bytes a row; a multiple of 4), then the extra f32 rows. */
static size_t page_bytes(const ds_prefix *px) {
    return (size_t)px->kv->n_layers * px->bs * px->kv->row_bytes +
           (size_t)px->n_xlayers * px->bs * px->xrow * sizeof(float);
}

/* buf [n_layers][bs][row_bytes] (then the extra rows [n_xlayers][bs][xrow] f32) <-> the page's
 * rows in every MLA layer of the latent pool */
static void page_gather(ds_prefix *px, int page, uint8_t *buf) {
    size_t n = (size_t)px->bs * px->kv->row_bytes, xn = (size_t)px->bs * px->xrow;
    uint8_t *x = buf + (size_t)px->kv->n_layers * n;
    for (int j = 0; j < px->kv->n_layers; j++)
        ds_dmem_copy(px->o.dm, buf + j * n, px->kv->layer[j] + (size_t)page * n, n);
    for (int j = 0; j < px->n_xlayers; j++)
        ds_dmem_copy(px->o.dm, x + j * xn * sizeof(float), px->xlayer[j] + (size_t)page * xn,
                     xn * sizeof(float));
}

static void page_scatter(ds_prefix *px, int page, const uint8_t *buf) {
    size_t n = (size_t)px->bs * px->kv->row_bytes, xn = (size_t)px->bs * px->xrow;
    const uint8_t *x = buf + (size_t)px->kv->n_layers * n;
    for (int j = 0; j < px->kv->n_layers; j++)
        ds_dmem_copy(px->o.dm, px->kv->layer[j] + (size_t)page * n, buf + j * n, n);
    for (int j = 0; j < px->n_xlayers; j++)
        ds_dmem_copy(px->o.dm, px->xlayer[j] + (size_t)page * xn, x + j * xn * sizeof(float),
                     xn * sizeof(float));
}

int ds_prefix_add_page_rows(ds_prefix *px, float **layers, int n_layers, int row, ds_err *err) {
    size_t n = DS_MAX((size_t)px->kv->n_layers * px->bs * px->kv->row_bytes +
                          (size_t)n_layers * px->bs * row * sizeof(float),
                      1);
    uint8_t *ld = realloc(px->ld_pbuf, n);
    if (ld) px->ld_pbuf = ld;
    uint8_t *st = ld ? realloc(px->st_pbuf, n) : NULL;
    if (st) px->st_pbuf = st;
    if (!ld || !st) return ds_errf(err, "prefix cache: out of memory for page rows");
    px->xlayer = layers;
    px->n_xlayers = n_layers;
    px->xrow = row;
    return DS_OK;
}

/* Stores run from eviction hooks in the middle of a load, so they touch only st_* and tbuf
 * (which no load uses) and never start a load. */
static void store_page(ds_prefix *px, int e, const int32_t *tokens) {
    entry *en = &px->ents[e];
    if (!ds_offload_enabled(px->off) || en->page < 0 || en->page_stored) return;
    int nk = entry_key(px, e, tokens, &px->tbuf, &px->cap_tbuf);
    if (nk < 0) return;
    if (px->storing) { /* impossible by construction; a miss later is harmless, a clobber not */
        px->st.reentries++;
        return;
    }
    px->storing = 1;
    page_gather(px, en->page, px->st_pbuf);
    ds_offload_put(px->off, 'p', en->hash, px->tbuf, nk, px->st_pbuf, page_bytes(px) / 4);
    px->storing = 0;
    en->page_stored = 1;
}

static void store_ckpt(ds_prefix *px, int e, const int32_t *tokens) {
    entry *en = &px->ents[e];
    if (!ds_offload_enabled(px->off) || en->ckpt < 0 || en->ckpt_stored) return;
    int nk = entry_key(px, e, tokens, &px->tbuf, &px->cap_tbuf);
    if (nk < 0) return;
    if (px->storing) {
        px->st.reentries++;
        return;
    }
    px->storing = 1;
    /* staged on the host: the checkpoint may be device memory */
    ds_dmem_copy(px->o.dm, px->st_sbuf, ds_slot_data(px->ck, en->ckpt),
                 px->slot_floats * sizeof(float));
    ds_offload_put(px->off, 'c', en->hash, px->tbuf, nk, px->st_sbuf, px->slot_floats);
    px->storing = 0;
    en->ckpt_stored = 1;
}

/* The page pool is about to reuse an idle cached page: offload it and forget it. */
static void on_page_evict(void *user, int page) {
    ds_prefix *px = user;
    int e = px->page_entry[page];
    px->page_entry[page] = -1;
    if (e < 0) return;
    store_page(px, e, NULL);
    px->ents[e].page = -1;
    px->st.pages_evicted++;
    maybe_remove(px, e);
}

static void attach_page(ds_prefix *px, int e, int page) {
    px->ents[e].page = page;
    px->page_entry[page] = e;
    ds_page_set_cached(px->pages, page, 1);
}

/* An offload lookup; in a job it counts as a hit only where every rank hit, since each rank's
 * tiers hold its own layers and may have evicted differently, and the ranks must take the same
 * decision. */
static int off_get(ds_prefix *px, char kind, const uint64_t h[2], const int32_t *tokens, int n,
                   void *out, size_t n_floats) {
    int hit = ds_offload_get(px->off, kind, h, tokens, n, out, n_floats);
    return px->agree ? px->agree(px->agree_ctx, hit) : hit;
}

void ds_prefix_set_agree(ds_prefix *px, int (*agree)(void *ctx, int v), void *ctx) {
    px->agree = agree;
    px->agree_ctx = ctx;
}

/* A load's key (entry_key's layout) into ld_kbuf, which no store touches. */
static int load_key(ds_prefix *px, const int32_t *tokens, int depth) {
    int n = depth * px->bs;
    if (!grow_i32(&px->ld_kbuf, &px->cap_ld_kbuf, n)) return -1;
    memcpy(px->ld_kbuf, tokens, (size_t)n * sizeof(int32_t));
    return n;
}

/* A page for block `depth` of tokens[0 .. depth*bs) loaded from the offload tier: a new held
 * page (refcount 1) with its latents written, or -1 on a miss or when no page can be had. The
 * payload is read into ld_pbuf before a page is taken, so a miss never evicts anything, and it
 * stays there (no store writes ld_pbuf) until it is scattered into the page. */

static int load_page(ds_prefix *px, const uint64_t h[2], const int32_t *tokens, int depth) {
    if (!ds_offload_enabled(px->off)) return -1;
    if (px->loading || px->storing) {
        px->st.reentries++;
        return -1;
    }
    int nk = load_key(px, tokens, depth);
    if (nk < 0) return -1;
    px->loading = 1;
    int page = -1;
    if (off_get(px, 'p', h, px->ld_kbuf, nk, px->ld_pbuf, page_bytes(px) / 4)) {
        page = ds_page_alloc(px->pages); /* may evict (and store) an idle page: st_pbuf */
        if (page >= 0) {
            page_scatter(px, page, px->ld_pbuf);
            px->st.page_loads++;
        }
    }
    px->loading = 0;
    return page;
}

/* ---- checkpoints ---------------------------------------------------------------------------- */

static void ck_unlink(ds_prefix *px, int c) {
    if (px->ck_prev[c] >= 0)
        px->ck_next[px->ck_prev[c]] = px->ck_next[c];
    else
        px->ck_head = px->ck_next[c];
    if (px->ck_next[c] >= 0)
        px->ck_prev[px->ck_next[c]] = px->ck_prev[c];
    else
        px->ck_tail = px->ck_prev[c];
    px->ck_prev[c] = px->ck_next[c] = -1;
}

static void ck_append(ds_prefix *px, int c) {
    px->ck_prev[c] = px->ck_tail;
    px->ck_next[c] = -1;
    if (px->ck_tail >= 0)
        px->ck_next[px->ck_tail] = c;
    else
        px->ck_head = c;
    px->ck_tail = c;
}

/* A checkpoint slot for entry e: a free one, else the least recently used unpinned one (its
 * state offloaded first). -1 when every slot is pinned by a pending fork. */
static int ck_take(ds_prefix *px, int e) {
    if (!px->ck) return -1;
    int c = ds_slot_alloc(px->ck);
    if (c < 0 && px->ck_head >= 0) {
        int v = px->ck_head;
        int ve = px->ck_entry[v];
        store_ckpt(px, ve, NULL);
        ck_unlink(px, v);
        px->ents[ve].ckpt = -1;
        px->ck_entry[v] = -1;
        ds_slot_release(px->ck, v);
        px->st.ckpt_evicted++;
        maybe_remove(px, ve);
        c = ds_slot_alloc(px->ck);
    }
    if (c < 0) return -1;
    px->ck_entry[c] = e;
    px->ck_pins[c] = 0;
    px->ents[e].ckpt = c;
    ck_append(px, c);
    return c;
}

static void ck_pin(ds_prefix *px, int c) {
    if (px->ck_pins[c]++ == 0) ck_unlink(px, c);
}

static void ck_unpin(ds_prefix *px, int c) {
    if (--px->ck_pins[c] == 0) ck_append(px, c); /* just used: most recent */
}

/* ---- rungs ---------------------------------------------------------------------------------- */

static int has_rung(const ds_seq *q, int pos) {
    for (int i = 0; i < q->n_rungs; i++)
        if (q->rungs[i] == pos) return 1;
    return 0;
}

static void add_rung(ds_seq *q, int pos) {
    if (pos <= 0 || has_rung(q, pos)) return;
    if (q->n_rungs == q->cap_rungs) {
        int cap = q->cap_rungs ? 2 * q->cap_rungs : 8;
        int32_t *r = realloc(q->rungs, (size_t)cap * sizeof *r);
        if (!r) return; /* one checkpoint fewer; nothing breaks */
        q->rungs = r;
        q->cap_rungs = cap;
    }
    int i = q->n_rungs++;
    while (i > 0 && q->rungs[i - 1] > pos) {
        q->rungs[i] = q->rungs[i - 1];
        i--;
    }
    q->rungs[i] = pos;
}

/* Rungs that depend on the prompt alone, all of them cuts the scheduler makes anyway (multiples
 * of the granule): every interval, and the deepest one a repeat of the same prompt can resume
 * from (at most n_prompt - 1). */
static void plan_rungs(ds_prefix *px, ds_seq *q) {
    if (q->rungs_planned || !px->ck) return;
    q->rungs_planned = 1;
    int top = fileable_blocks(px, q->n_prompt) * px->bs;
    for (int r = px->interval; r <= top; r += px->interval) add_rung(q, r);
    add_rung(q, DS_MIN(top, q->n_prompt - 1) / px->granule * px->granule);
}

/* ---- public --------------------------------------------------------------------------------- */

int ds_prefix_create(const ds_prefix_opts *o, size_t slot_floats, ds_page_pool *pages,
                     ds_kv_pool *kv, ds_offload *off, ds_prefix **out, ds_err *err) {
    *out = NULL;
    if (o->block_size < 1 || kv->block_size != o->block_size)
        return ds_errf(err, "prefix cache: block size %d does not match the latent pool's %d",
                       o->block_size, kv->block_size);
    ds_prefix *px = ds_calloc(1, sizeof *px, err);
    if (!px) return DS_ERR;
    px->o = *o;
    px->bs = o->block_size;
    int iv = o->interval_tokens > 0 ? o->interval_tokens : 256;
    px->chunk = o->chunk_tokens > 0 ? o->chunk_tokens : px->bs;
    int g = px->chunk, b = px->bs; /* lcm(chunk, bs) */
    while (b) {
        int t = g % b;
        g = b;
        b = t;
    }
    px->granule = px->chunk / g * px->bs;
    px->interval = DS_MAX(px->granule, iv / px->granule * px->granule);
    px->pages = pages;
    px->kv = kv;
    px->off = off;
    px->free_head = -1;
    px->slot_floats = slot_floats;
    px->ck_head = px->ck_tail = -1;
    int n_pages = ds_page_n_total(pages);
    px->page_entry = ds_malloc((size_t)n_pages * sizeof *px->page_entry, err);
    px->hbuf = ds_malloc(16 + (size_t)px->bs * 4, err);
    px->ld_pbuf = ds_malloc(DS_MAX(page_bytes(px), 1), err);
    px->st_pbuf = ds_malloc(DS_MAX(page_bytes(px), 1), err);
    px->ld_sbuf = ds_malloc(DS_MAX(slot_floats, 1) * sizeof(float), err);
    px->st_sbuf = ds_malloc(DS_MAX(slot_floats, 1) * sizeof(float), err);
    px->n_buckets = 256;
    px->buckets = ds_malloc((size_t)px->n_buckets * sizeof *px->buckets, err);
    if (!px->page_entry || !px->hbuf || !px->ld_pbuf || !px->st_pbuf || !px->ld_sbuf ||
        !px->st_sbuf || !px->buckets)
        goto fail;
    for (int i = 0; i < n_pages; i++) px->page_entry[i] = -1;
    for (int i = 0; i < px->n_buckets; i++) px->buckets[i] = -1;
    if (o->n_ckpt_slots > 0) {
        int n = o->n_ckpt_slots;
        if (ds_slot_pool_create_on(o->dm, n, slot_floats, &px->ck, err)) goto fail;
        px->n_ck = n;
        px->ck_entry = ds_malloc((size_t)n * sizeof(int32_t), err);
        px->ck_pins = ds_calloc((size_t)n, sizeof(int32_t), err);
        px->ck_prev = ds_malloc((size_t)n * sizeof(int32_t), err);
        px->ck_next = ds_malloc((size_t)n * sizeof(int32_t), err);
        if (!px->ck_entry || !px->ck_pins || !px->ck_prev || !px->ck_next) goto fail;
        for (int i = 0; i < n; i++) px->ck_entry[i] = px->ck_prev[i] = px->ck_next[i] = -1;
    }
    ds_page_set_evict_hook(pages, on_page_evict, px);
    *out = px;
    return DS_OK;
fail:
    ds_err_prefix(err, "prefix cache");
    ds_prefix_free(px);
    return DS_ERR;
}

void ds_prefix_free(ds_prefix *px) {
    if (!px) return;
    if (px->pages) {
        ds_page_set_evict_hook(px->pages, NULL, NULL);
        /* idle cached pages go back to the free stack: nothing will look them up again */
        for (int e = 0; e < px->cap; e++)
            if (px->ents[e].used && px->ents[e].page >= 0)
                ds_page_set_cached(px->pages, px->ents[e].page, 0);
    }
    ds_slot_pool_free(px->ck);
    free(px->ck_entry);
    free(px->ck_pins);
    free(px->ck_prev);
    free(px->ck_next);
    free(px->ents);
    free(px->toks);
    free(px->buckets);
    free(px->page_entry);
    free(px->hbuf);
    free(px->ld_pbuf);
    free(px->st_pbuf);
    free(px->ld_sbuf);
    free(px->st_sbuf);
    free(px->tbuf);
    free(px->ld_kbuf);
    free(px);
}

int ds_prefix_match(ds_prefix *px, ds_seq *q) {
    const int bs = px->bs;
    plan_rungs(px, q);
    if (q->n_computed != 0 || q->n_blocks != 0 || !px->ck) return 0;
    /* the last token must run to give logits; only fileable blocks are ever in the index */
    int max_blocks = DS_MIN((q->n_tokens - 1) / bs, fileable_blocks(px, q->n_prompt));
    if (max_blocks <= 0 || ds_seq_reserve_blocks(q, max_blocks) != DS_OK) return 0;

    /* 1. Walk the chain as far as pages exist (on device, or loadable), pinning as we go. */
    int k = 0, best = 0, parent = -1;
    uint64_t h[2], hp[2] = {0, 0};
    for (; k < max_blocks; k++) {
        const int32_t *t = q->tokens + (size_t)k * bs;
        ds_prefix_hash_block(px, k ? hp : NULL, t, h);
        int e = find(px, h);
        if (e >= 0) {
            entry *en = &px->ents[e];
            if (en->parent != parent ||
                memcmp(px->toks + (size_t)e * bs, t, (size_t)bs * sizeof(int32_t)) != 0) {
                px->st.collisions++;
                break;
            }
            en->pins++; /* before any page is taken: an eviction must not remove e */
            if (en->page >= 0) {
                ds_page_ref(px->pages, en->page);
            } else {
                int page = load_page(px, h, q->tokens, k + 1);
                if (page < 0) {
                    en->pins--;
                    maybe_remove(px, e);
                    break;
                }
                attach_page(px, e, page);
                en->page_stored = 1;
            }
        } else {
            int page = load_page(px, h, q->tokens, k + 1);
            if (page < 0) break;
            e = new_entry(px, h, parent, k + 1, t);
            if (e < 0) {
                ds_page_unref(px->pages, page);
                break;
            }
            attach_page(px, e, page);
            px->ents[e].page_stored = 1;
            px->ents[e].pins++;
        }
        q->block_table[k] = px->ents[e].page;
        q->entry[k] = e;
        if (px->ents[e].ckpt >= 0) best = k + 1;
        parent = e;
        hp[0] = h[0];
        hp[1] = h[1];
    }
    /* Pin the chosen checkpoint at once: taking a slot below may evict unpinned ones. */
    int ckpt = best ? px->ents[q->entry[best - 1]].ckpt : -1;
    if (ckpt >= 0) ck_pin(px, ckpt);

    /* 2. A deeper checkpoint from the offload tier, probed only where one is likely filed. The
     *    state is read into ld_sbuf first, so a miss evicts nothing, and it stays there until it
     *    is copied into its slot. */
    for (int j = k, probes = 0; j > best && probes < MAX_CKPT_PROBES; j--) {
        int e = q->entry[j - 1];
        if (!ds_offload_enabled(px->off) || !(px->ents[e].ckpt_stored || has_rung(q, j * bs)))
            continue;
        probes++;
        if (px->loading || px->storing) {
            px->st.reentries++;
            break;
        }
        int nk = load_key(px, q->tokens, j);
        if (nk < 0) break;
        px->loading = 1;
        int c = -1,
            hit = off_get(px, 'c', px->ents[e].hash, px->ld_kbuf, nk, px->ld_sbuf, px->slot_floats);
        if (hit) {
            c = ck_take(px, e); /* may evict (and store) another checkpoint: st_sbuf */
            if (c >= 0)
                ds_dmem_copy(px->o.dm, ds_slot_data(px->ck, c), px->ld_sbuf,
                             px->slot_floats * sizeof(float));
        }
        px->loading = 0;
        if (!hit) continue;
        if (c < 0) break; /* every slot pinned */
        px->ents[e].ckpt_stored = 1;
        px->st.ckpt_loads++;
        if (ckpt >= 0) ck_unpin(px, ckpt);
        ckpt = c;
        ck_pin(px, ckpt);
        best = j;
        break;
    }

    /* 3. Pages past the checkpoint: ask for a rung at the deepest cut among them, so the next
     *    sequence passing can resume that deep; this one passes it too, so it files it itself.
     *    Only granule multiples qualify: every prompt is cut there, so the rung adds no cut. */
    int dj = k * bs / px->granule * px->granule / bs;
    if (dj > best) px->ents[q->entry[dj - 1]].demand = 1;
    for (int j = best + 1; j <= k; j++)
        if (px->ents[q->entry[j - 1]].demand && (j * bs) % px->granule == 0) add_rung(q, j * bs);

    /* 4. Keep [0, best) and give back the rest, tail first (it will be recomputed). */
    for (int j = k - 1; j >= best; j--) {
        int e = q->entry[j];
        ds_page_unref(px->pages, q->block_table[j]);
        px->ents[e].pins--;
        maybe_remove(px, e);
    }
    q->n_blocks = q->n_filed = best;
    if (best == 0) return 0;
    q->fork_ckpt = ckpt; /* pinned above */
    q->n_computed = best * bs;
    q->settled = q->n_computed;
    return q->n_computed;
}

void ds_prefix_admitted(ds_prefix *px, const ds_seq *q) {
    px->st.query_tokens += (uint64_t)q->n_tokens;
    px->st.hit_tokens += (uint64_t)q->n_computed;
}

void ds_prefix_release(ds_prefix *px, ds_seq *q) {
    if (q->fork_ckpt >= 0) ck_unpin(px, q->fork_ckpt);
    q->fork_ckpt = -1;
    for (int b = q->n_filed - 1; b >= 0; b--) {
        int e = q->entry[b];
        px->ents[e].pins--;
        maybe_remove(px, e);
    }
    q->n_filed = 0;
    q->chain_broken = 0;
}

int ds_prefix_take_fork(ds_prefix *px, ds_seq *q, float *slot) {
    if (q->fork_ckpt < 0) return 0;
    ds_dmem_copy(px->o.dm, slot, ds_slot_data(px->ck, q->fork_ckpt),
                 px->slot_floats * sizeof(float));
    ck_unpin(px, q->fork_ckpt);
    q->fork_ckpt = -1;
    px->st.forks++;
    return 1;
}

int ds_prefix_would_hold(const ds_prefix *px, const ds_seq *q, int pos0) {
    (void)px;
    return pos0 > q->settled && has_rung(q, pos0);
}

void ds_prefix_on_computed(ds_prefix *px, ds_seq *q, const float *slot) {
    const int bs = px->bs;
    q->settled = q->n_computed;
    /* only blocks computed in whole chunk-sized prompt steps (fileable_blocks) */
    int full = DS_MIN(q->n_computed / bs, fileable_blocks(px, q->n_prompt));
    if (ds_seq_reserve_blocks(q, full) != DS_OK) return;
    while (!q->chain_broken && q->n_filed < full) {
        int i = q->n_filed;
        int parent = i ? q->entry[i - 1] : -1;
        const int32_t *t = q->tokens + (size_t)i * bs;
        uint64_t h[2];
        ds_prefix_hash_block(px, parent >= 0 ? px->ents[parent].hash : NULL, t, h);
        int e = find(px, h);
        if (e >= 0) {
            if (px->ents[e].parent != parent ||
                memcmp(px->toks + (size_t)e * bs, t, (size_t)bs * 4) != 0) {
                /* the hash names another prefix: this chain cannot be filed any further */
                px->st.collisions++;
                q->chain_broken = 1;
                break;
            }
            /* already filed (by a sequence that computed it too); adopt our page if it has none */
            if (px->ents[e].page < 0) attach_page(px, e, q->block_table[i]);
        } else {
            e = new_entry(px, h, parent, i + 1, t);
            if (e < 0) {
                q->chain_broken = 1;
                break;
            }
            attach_page(px, e, q->block_table[i]);
            px->st.pages_filed++;
        }
        px->ents[e].pins++;
        q->entry[i] = e;
        q->n_filed++;
    }
    int d = q->n_computed;
    if (d % bs != 0 || !has_rung(q, d)) return;
    if (q->n_filed < d / bs || !px->ck) {
        px->st.ckpt_dropped++;
        return;
    }
    int e = q->entry[d / bs - 1];
    px->ents[e].demand = 0;
    if (px->ents[e].ckpt >= 0) return; /* someone filed this rung already */
    int c = ck_take(px, e);
    if (c < 0) {
        px->st.ckpt_dropped++;
        return;
    }
    ds_dmem_copy(px->o.dm, ds_slot_data(px->ck, c), slot, px->slot_floats * sizeof(float));
    px->ents[e].ckpt_stored = 0;
    px->st.ckpt_kept++;
}

void ds_prefix_on_finish(ds_prefix *px, ds_seq *q) {
    if (!ds_offload_enabled(px->off)) return;
    for (int b = 0; b < q->n_filed; b++) {
        store_page(px, q->entry[b], q->tokens);
        store_ckpt(px, q->entry[b], q->tokens);
    }
}

int ds_prefix_export(ds_prefix *px, const ds_seq *q, ds_prefix_sink sink, void *ctx) {
    if (px->loading || px->storing) { /* the staging buffers are busy: impossible at a finish */
        px->st.reentries++;
        return -1;
    }
    int n = 0;
    size_t slot_bytes = px->slot_floats * sizeof(float);
    for (int b = 0; b < q->n_filed; b++) {
        const entry *en = &px->ents[q->entry[b]];
        int nk = en->depth * px->bs;
        if (en->page >= 0) {
            page_gather(px, en->page, px->st_pbuf);
            if (sink(ctx, 'p', en->hash, nk, px->st_pbuf, page_bytes(px))) return -1;
            n++;
        }
        if (en->ckpt >= 0) {
            ds_dmem_copy(px->o.dm, px->st_sbuf, ds_slot_data(px->ck, en->ckpt), slot_bytes);
            if (sink(ctx, 'c', en->hash, nk, px->st_sbuf, slot_bytes)) return -1;
            n++;
        }
    }
    return n;
}

void ds_prefix_export_counts(const ds_prefix *px, const ds_seq *q, int *n_pages, int *n_ckpts) {
    *n_pages = *n_ckpts = 0;
    for (int b = 0; b < q->n_filed; b++) {
        const entry *en = &px->ents[q->entry[b]];
        *n_pages += en->page >= 0;
        *n_ckpts += en->ckpt >= 0;
    }
}

size_t ds_prefix_page_bytes(const ds_prefix *px) {
    return page_bytes(px);
}

void ds_prefix_get_stats(const ds_prefix *px, ds_prefix_stats *s) {
    *s = px->st;
    s->ckpt_total = px->ck ? ds_slot_n_total(px->ck) : 0;
    s->ckpt_used = px->ck ? s->ckpt_total - ds_slot_n_free(px->ck) : 0;
    s->entries = px->n_used;
}

int ds_prefix_rung_interval(const ds_prefix *px) {
    return px->interval;
}
