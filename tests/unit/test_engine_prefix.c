/* test_engine_prefix.c — prefix caching with KDA checkpoints (invariant 5): the hash chain and the
 * token-id confirmation (collisions forced through a test hook), then whole engines whose warm
 * runs must give exactly the greedy tokens of a cold run with prefix caching off — for hits that
 * end on a page, on a chunk and on a rung, prompts shorter than a page, forks followed by decode,
 * 32 concurrent requests sharing a system prompt, eviction pressure and forced collisions. */
#include "engine_harness.h"

#include "base/devmem.h"
#include "cache/prefix.h"
#include "engine/scheduler.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- a fake device for the state seam --------------------------------------------------------
 * "Device" memory that the host cannot touch: mmap'd PROT_NONE, opened only inside the fake
 * device's copy and zero operations. With its handle given to them (g_dev), the index's checkpoint
 * pool and the latent pool are
 * such memory, so any path that reads or writes them directly instead of through base/devmem.h
 * (as a GPU would require) dies with SIGSEGV and fails the test. */
enum { FD_MAX = 16 };
static struct {
    char *p;
    size_t n;
} g_fd[FD_MAX];
static int g_fd_copies, g_fd_zeros;

static size_t fd_round(size_t n) {
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}
static int fd_find(const void *p) {
    for (int i = 0; i < FD_MAX; i++)
        if (g_fd[i].p && (const char *)p >= g_fd[i].p && (const char *)p < g_fd[i].p + g_fd[i].n)
            return i;
    return -1;
}
static void fd_open(const void *p, int rw) {
    int i = fd_find(p);
    if (i >= 0) mprotect(g_fd[i].p, g_fd[i].n, rw ? PROT_READ | PROT_WRITE : PROT_NONE);
}
static void *fd_alloc(void *ctx, size_t n, ds_err *err) {
    for (int i = 0; i < FD_MAX; i++)
        if (!g_fd[i].p) {
            void *p = mmap(NULL, fd_round(n), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) break;
            g_fd[i].p = p;
            g_fd[i].n = fd_round(n);
            return p;
        }
    ds_errf(err, "fake device: out of regions");
    return NULL;
}
static void fd_release(void *ctx, void *p) {
    int i = fd_find(p);
    if (i < 0) return;
    munmap(g_fd[i].p, g_fd[i].n);
    g_fd[i].p = NULL;
}
static void fd_copy(void *ctx, void *dst, const void *src, size_t n) {
    fd_open(dst, 1), fd_open(src, 1);
    memcpy(dst, src, n);
    fd_open(dst, 0), fd_open(src, 0);
    g_fd_copies++;
}
static void fd_zero(void *ctx, void *p, size_t n) {
    fd_open(p, 1);
    memset(p, 0, n);
    fd_open(p, 0);
    g_fd_zeros++;
}
/* Its page-locked host memory: mapped pages (so that free() on one would crash the test),
 * counted in and out. */
static struct {
    void *p;
    size_t n;
} g_pin[8];
static int g_pins, g_unpins;
static void *fd_host_alloc(size_t n, ds_err *err) {
    for (int i = 0; i < 8; i++)
        if (!g_pin[i].p) {
            void *p =
                mmap(NULL, fd_round(n), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) break;
            g_pin[i].p = p, g_pin[i].n = fd_round(n);
            g_pins++;
            return p;
        }
    ds_errf(err, "fake device: out of pinned regions");
    return NULL;
}
static void fd_host_release(void *p) {
    for (int i = 0; i < 8; i++)
        if (g_pin[i].p == p) {
            munmap(p, g_pin[i].n);
            g_pin[i].p = NULL;
            g_unpins++;
        }
}
static const ds_dmem_ops g_fake_device = {fd_alloc, fd_release,    fd_copy,
                                          fd_zero,  fd_host_alloc, fd_host_release};
static const ds_dmem g_fake_dm = {&g_fake_device, NULL}; /* its memory, as a model gives it */
static int g_dev;         /* the px_world below keeps its state on the fake device */
static ds_offload *g_off; /* and, when set, hands finished prefixes to this offload tier */

/* The memory the px_world's state lives in: the fake device's with g_dev, else the host's. */
static const ds_dmem *pw_dm(void) {
    return g_dev ? &g_fake_dm : NULL;
}

/* ---- the index alone ------------------------------------------------------------------------ */

typedef struct px_world {
    ds_page_pool *pages;
    ds_kv_pool kv;
    float *layer0;   /* [n_pages][bs][row] */
    uint8_t *lay[1]; /* the pool's view of layer0: opaque rows of row_bytes */
    ds_prefix *px;
} px_world;

enum { PW_BS = 4, PW_ROW = 2, PW_PAGES = 16, PW_SLOT = 8 };

static void pw_init(px_world *w, int hash_bits, int n_ckpt) {
    ds_err err = {{0}};
    assert_int_equal(ds_page_pool_create(PW_PAGES, &w->pages, &err), DS_OK);
    size_t lb = (size_t)PW_PAGES * PW_BS * PW_ROW * sizeof(float);
    w->layer0 = g_dev ? ds_dmem_alloc(pw_dm(), lb, &err) : calloc(1, lb);
    assert_non_null(w->layer0);
    if (g_dev) ds_dmem_zero(pw_dm(), w->layer0, lb);
    w->lay[0] = (uint8_t *)w->layer0;
    w->kv.layer = w->lay;
    w->kv.row_bytes = PW_ROW * sizeof(float);
    w->kv.n_layers = 1;
    w->kv.n_pages = PW_PAGES;
    w->kv.block_size = PW_BS;
    w->kv.row = PW_ROW;
    w->kv.dm = pw_dm();
    ds_prefix_opts o = {PW_BS, 8, n_ckpt, 42, hash_bits, pw_dm(), PW_BS};
    if (ds_prefix_create(&o, PW_SLOT, w->pages, &w->kv, g_off, &w->px, &err))
        fail_msg("%s", err.msg);
}

static void pw_free(px_world *w) {
    ds_prefix_free(w->px);
    assert_int_equal(ds_page_n_bad(w->pages), 0);
    ds_page_pool_free(w->pages);
    if (g_dev)
        ds_dmem_free(pw_dm(), w->layer0);
    else
        free(w->layer0);
}

/* Runs q's whole prompt as if by the engine: admission match, pages for the rest, steps cut at
 * rungs (filing after each), then release. slot_val fills the "state" after each step so that a
 * checkpoint's contents say which step it came from. Returns the matched depth. */
static int pw_run(px_world *w, ds_seq *q, float *fork_out) {
    int d = ds_prefix_match(w->px, q);
    float slot_h[PW_SLOT] = {0}; /* the state as the host writes it */
    ds_err err = {{0}};
    float *slot = g_dev ? ds_dmem_alloc(pw_dm(), sizeof slot_h, &err) : slot_h; /* where it lives */
    assert_non_null(slot);
    if (g_dev) ds_dmem_zero(pw_dm(), slot, sizeof slot_h);
    if (ds_prefix_take_fork(w->px, q, slot) && fork_out)
        ds_dmem_copy(pw_dm(), fork_out, slot, sizeof slot_h);
    ds_seq_reserve_blocks(q, q->n_tokens / PW_BS + 1);
    while (q->n_blocks * PW_BS < q->n_tokens)
        q->block_table[q->n_blocks++] = ds_page_alloc(w->pages);
    while (q->n_computed < q->n_prompt) {
        int end = q->n_prompt;
        for (int i = 0; i < q->n_rungs; i++)
            if (q->rungs[i] > q->n_computed) {
                end = DS_MIN(end, q->rungs[i]);
                break;
            }
        q->n_computed = end;
        /* a step starting at a rung before that rung is filed would have to hold */
        int rung = 0;
        for (int i = 0; i < q->n_rungs; i++) rung |= q->rungs[i] == end;
        assert_int_equal(ds_prefix_would_hold(w->px, q, end), rung);
        for (int i = 0; i < PW_SLOT; i++) slot_h[i] = (float)(end * 100 + i);
        if (g_dev) ds_dmem_copy(pw_dm(), slot, slot_h, sizeof slot_h);
        ds_prefix_on_computed(w->px, q, slot);
        assert_false(ds_prefix_would_hold(w->px, q, end));
    }
    if (g_off) { /* latent rows saying which block they belong to, then the tier stores them */
        for (int b = 0; b < q->n_blocks; b++) {
            float rows[PW_BS * PW_ROW];
            for (int i = 0; i < PW_BS * PW_ROW; i++) rows[i] = (float)(b * 100 + i) + 0.5f;
            ds_dmem_copy(pw_dm(), w->layer0 + (size_t)q->block_table[b] * PW_BS * PW_ROW, rows,
                         sizeof rows);
        }
        ds_prefix_on_finish(w->px, q);
    }
    ds_prefix_release(w->px, q);
    for (int b = q->n_blocks - 1; b >= 0; b--) ds_page_unref(w->pages, q->block_table[b]);
    q->n_blocks = 0;
    if (g_dev) ds_dmem_free(pw_dm(), slot);
    return d;
}

static ds_seq *pw_seq(const int32_t *t, int n) {
    ds_err err = {{0}};
    ds_seq *q = ds_seq_new(1, t, n, n + 4, &err);
    assert_non_null(q);
    return q;
}

/* The chain: a block's hash depends on its tokens and on everything before it; a repeat of a
 * prompt resumes from the deepest rung with the exact state filed there, sharing the pages. */
static void test_hash_chain_and_hit(void **st) {
    (void)st;
    px_world w;
    pw_init(&w, 0, 4);
    int32_t a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
    uint64_t ha[2], hb[2], hab[2], hba[2], ha2[2];
    ds_prefix_hash_block(w.px, NULL, a, ha);
    ds_prefix_hash_block(w.px, NULL, a, ha2);
    ds_prefix_hash_block(w.px, NULL, b, hb);
    ds_prefix_hash_block(w.px, ha, b, hab);
    ds_prefix_hash_block(w.px, hb, a, hba);
    assert_memory_equal(ha, ha2, 16);
    assert_memory_not_equal(ha, hb, 16);
    assert_memory_not_equal(hab, hb, 16); /* same tokens, another parent */
    assert_memory_not_equal(hab, hba, 16);

    int32_t p[14];
    for (int i = 0; i < 14; i++) p[i] = 10 + i;
    ds_seq *q1 = pw_seq(p, 14);
    assert_int_equal(pw_run(&w, q1, NULL), 0);
    /* rungs: interval 8, end 12 (both 14/4*4 and 13/4*4) */
    assert_int_equal(q1->n_rungs, 2);
    assert_int_equal(q1->rungs[0], 8);
    assert_int_equal(q1->rungs[1], 12);
    int32_t pages1[3];
    memcpy(pages1, q1->block_table, sizeof pages1);
    ds_prefix_stats s;
    ds_prefix_get_stats(w.px, &s);
    assert_int_equal(s.ckpt_kept, 2);
    assert_int_equal(s.pages_filed, 3);
    assert_int_equal(ds_page_n_cached_idle(w.pages), 3);

    ds_seq *q2 = pw_seq(p, 14);
    float fork[PW_SLOT];
    assert_int_equal(pw_run(&w, q2, fork), 12);
    assert_memory_equal(q2->block_table, pages1, sizeof pages1); /* shared, not copied */
    for (int i = 0; i < PW_SLOT; i++) assert_true(fork[i] == (float)(1200 + i));

    /* a prompt of 13 tokens can use at most 12: the same rung */
    ds_seq *q3 = pw_seq(p, 13);
    assert_int_equal(pw_run(&w, q3, fork), 12);
    /* a prompt diverging in its third block resumes at the rung at 8 */
    int32_t p4[14];
    memcpy(p4, p, sizeof p4);
    p4[9] = 999;
    ds_seq *q4 = pw_seq(p4, 14);
    assert_int_equal(pw_run(&w, q4, fork), 8);
    for (int i = 0; i < PW_SLOT; i++) assert_true(fork[i] == (float)(800 + i));
    /* shorter than a page: nothing to share */
    ds_seq *q5 = pw_seq(p, 3);
    assert_int_equal(pw_run(&w, q5, NULL), 0);
    ds_prefix_get_stats(w.px, &s);
    assert_int_equal(s.forks, 3);
    assert_int_equal(s.collisions, 0);
    ds_seq_free(q1);
    ds_seq_free(q2);
    ds_seq_free(q3);
    ds_seq_free(q4);
    ds_seq_free(q5);
    pw_free(&w);
}

/* Demand rungs: a lookup that finds pages deeper than any checkpoint (q1 had no rung at 12)
 * makes its own sequence file one there, so the next sequence sharing that much resumes there. */
static void test_demand_rung(void **st) {
    (void)st;
    px_world w;
    pw_init(&w, 0, 4);
    int32_t p[24], p2[24], p3[24];
    for (int i = 0; i < 24; i++) p[i] = 3 * i + 1;
    ds_seq *q1 = pw_seq(p, 23); /* rungs 8, 16, 20; pages up to 20 */
    assert_int_equal(pw_run(&w, q1, NULL), 0);
    memcpy(p2, p, sizeof p2);
    p2[13] = 999; /* shares pages [0, 12) with q1 */
    ds_seq *q2 = pw_seq(p2, 20);
    assert_int_equal(pw_run(&w, q2, NULL), 8);
    assert_int_equal(q2->rungs[1], 12); /* 8, 12 (demand), 16, 20 */
    memcpy(p3, p, sizeof p3);
    p3[14] = 555;
    ds_seq *q3 = pw_seq(p3, 20);
    float fork[PW_SLOT];
    assert_int_equal(pw_run(&w, q3, fork), 12);
    for (int i = 0; i < PW_SLOT; i++) assert_true(fork[i] == (float)(1200 + i));
    ds_seq_free(q1);
    ds_seq_free(q2);
    ds_seq_free(q3);
    pw_free(&w);
}

/* With 1-bit hashes nearly every block collides with another; token and parent confirmation
 * must turn every collision into a miss: a lookup never returns a depth whose tokens differ. */
static void test_forced_collisions(void **st) {
    (void)st;
    px_world w;
    pw_init(&w, 1, 8);
    int32_t fam[3][20];
    for (int f = 0; f < 3; f++)
        for (int i = 0; i < 20; i++) fam[f][i] = 100 * f + i;
    for (int round = 0; round < 2; round++)
        for (int f = 0; f < 3; f++) {
            ds_seq *q = pw_seq(fam[f], 20);
            float fork[PW_SLOT];
            int d = pw_run(&w, q, fork);
            if (d > 0) /* whatever was served is this family's own state at that depth */
                for (int i = 0; i < PW_SLOT; i++) assert_true(fork[i] == (float)(d * 100 + i));
            ds_seq_free(q);
        }
    ds_prefix_stats s;
    ds_prefix_get_stats(w.px, &s);
    assert_true(s.collisions > 0);
    pw_free(&w);
}

/* The same scenarios with the checkpoint and latent pools in memory the host cannot touch (the
 * fake device above): hits, demand rungs, forks and collisions give the same states, every copy
 * goes through the fake device's operations, and every region is given back. */
/* Logits buffers: page-locked from the device when its memory is asked, and each freed by the
 * release it came with, whatever handle frees it; plain memory without a device. */
static void test_pinned_host_memory(void **st) {
    (void)st;
    ds_err err = {{0}};
    int pins = g_pins, unpins = g_unpins;
    float *a = ds_dmem_host_alloc(&g_fake_dm, 1000 * sizeof(float), &err);
    float *b = ds_dmem_host_alloc(&g_fake_dm, 10, &err);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(g_pins, pins + 2);
    for (int i = 0; i < 1000; i++) a[i] = (float)i; /* host-writable */
    assert_true(a[999] == 999.0f);
    ds_dmem_host_free(&g_fake_dm, b);
    assert_int_equal(g_unpins, unpins + 1);
    ds_dmem_host_free(NULL, a); /* freed without the device: still its own release, not free() */
    assert_int_equal(g_unpins, unpins + 2);
    float *c = ds_dmem_host_alloc(NULL, 100, &err); /* no device: plain memory */
    assert_non_null(c);
    assert_int_equal(g_pins, pins + 2);
    ds_dmem_host_free(NULL, c);
    assert_int_equal(g_unpins, unpins + 2);
}

static void test_state_on_device(void **st) {
    g_dev = 1;
    g_fd_copies = g_fd_zeros = 0;
    test_hash_chain_and_hit(st);
    test_demand_rung(st);
    test_forced_collisions(st);
    g_dev = 0;
    assert_true(g_fd_copies > 20); /* checkpoints filed and forked, slots written and read */
    assert_true(g_fd_zeros > 0);
    for (int i = 0; i < FD_MAX; i++) assert_null(g_fd[i].p);
}

/* The offload tier with device state: a prompt's pages and checkpoints go to host RAM (read out
 * of device memory through the seam); a second index on fresh device pools, sharing only that
 * tier, resumes a repeat of the prompt from it with the exact state filed, and the latent rows
 * come back into its device pool. */
static void test_offload_on_device(void **st) {
    (void)st;
    g_dev = 1;
    ds_err err = {{0}};
    ds_offload_opts oo = {.ram_bytes = 1u << 20, .model_id = "fake-device", .layer_hi = 1};
    assert_int_equal(ds_offload_create(&oo, &g_off, &err), DS_OK);
    int32_t p[14];
    for (int i = 0; i < 14; i++) p[i] = 40 + i;
    px_world a, b;
    pw_init(&a, 0, 4);
    ds_seq *q1 = pw_seq(p, 14);
    assert_int_equal(pw_run(&a, q1, NULL), 0);
    pw_free(&a);
    pw_init(&b, 0, 4); /* fresh pools and index; only the RAM tier remembers */
    ds_seq *q2 = pw_seq(p, 14);
    assert_int_equal(ds_prefix_match(b.px, q2), 12);
    for (int blk = 0; blk < 3; blk++) { /* the rows came back into this index's device pages */
        float rows[PW_BS * PW_ROW];
        ds_dmem_copy(pw_dm(), rows, b.layer0 + (size_t)q2->block_table[blk] * PW_BS * PW_ROW,
                     sizeof rows);
        for (int i = 0; i < PW_BS * PW_ROW; i++)
            assert_true(rows[i] == (float)(blk * 100 + i) + 0.5f);
    }
    float *slot = ds_dmem_alloc(pw_dm(), PW_SLOT * sizeof(float), &err), fork[PW_SLOT];
    assert_non_null(slot);
    assert_int_equal(ds_prefix_take_fork(b.px, q2, slot), 1);
    ds_dmem_copy(pw_dm(), fork, slot, sizeof fork);
    for (int i = 0; i < PW_SLOT; i++) assert_true(fork[i] == (float)(1200 + i));
    ds_prefix_stats s;
    ds_prefix_get_stats(b.px, &s);
    assert_int_equal(s.page_loads, 3);
    assert_true(s.ckpt_loads >= 1);
    ds_prefix_release(b.px, q2);
    for (int blk = q2->n_blocks - 1; blk >= 0; blk--) ds_page_unref(b.pages, q2->block_table[blk]);
    q2->n_blocks = 0;
    ds_dmem_free(pw_dm(), slot);
    ds_seq_free(q1);
    ds_seq_free(q2);
    pw_free(&b);
    ds_offload_free(g_off);
    g_off = NULL;
    g_dev = 0;
    for (int i = 0; i < FD_MAX; i++) assert_null(g_fd[i].p);
}

/* ---- issue 30, cases 1 and 2: a load owns its buffer until it is installed ------------------ */

/* A sequence that files its prompt's blocks and a checkpoint at 8 (state `val` + i) and rows
 * `rowval` + ..., then is dropped without finishing (as an aborted request is): nothing of it
 * reaches the tier until an eviction stores it. */
static void pw_file_unfinished(px_world *w, const int32_t *t, int n, float val, float rowval) {
    ds_seq *q = pw_seq(t, n);
    ds_prefix_match(w->px, q); /* plans its rungs */
    ds_seq_reserve_blocks(q, n / PW_BS + 1);
    while (q->n_blocks * PW_BS < n) q->block_table[q->n_blocks++] = ds_page_alloc(w->pages);
    for (int b = 0; b < q->n_blocks; b++) {
        float rows[PW_BS * PW_ROW];
        for (int i = 0; i < PW_BS * PW_ROW; i++) rows[i] = rowval - (float)(b * 100 + i);
        ds_dmem_copy(pw_dm(), w->layer0 + (size_t)q->block_table[b] * PW_BS * PW_ROW, rows,
                     sizeof rows);
    }
    float slot_h[PW_SLOT];
    for (int i = 0; i < PW_SLOT; i++) slot_h[i] = val + (float)i;
    q->n_computed = 8;
    ds_prefix_on_computed(w->px, q, slot_h);
    q->n_computed = n;
    ds_prefix_on_computed(w->px, q, slot_h);
    ds_prefix_release(w->px, q);
    for (int b = q->n_blocks - 1; b >= 0; b--) ds_page_unref(w->pages, q->block_table[b]);
    q->n_blocks = 0;
    ds_seq_free(q);
}

/* Case 1: A's checkpoint at 8 comes back from the RAM tier while the only checkpoint slot holds
 * B's, which was never stored; taking the slot stores B's on the way out. The fork must be A's
 * state (the store once went through the buffer holding A's, and filed B's state under A). */
static void test_tier_checkpoint_load_owns_buffer(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_offload_opts oo = {.ram_bytes = 1u << 20, .model_id = "case1", .layer_hi = 1};
    assert_int_equal(ds_offload_create(&oo, &g_off, &err), DS_OK);
    px_world w;
    pw_init(&w, 0, 1); /* one checkpoint slot */
    int32_t a[12], b[12];
    for (int i = 0; i < 12; i++) a[i] = 1 + i, b[i] = 500 + i;
    ds_seq *qa = pw_seq(a, 12);
    assert_int_equal(pw_run(&w, qa, NULL), 0); /* files A's state at 8 (800 + i), stores it */
    ds_seq_free(qa);
    pw_file_unfinished(&w, b, 12, -7000.0f, -1.0f); /* B's takes the slot; A's stays in RAM */
    ds_prefix_stats s0;
    ds_prefix_get_stats(w.px, &s0);
    float fork[PW_SLOT];
    qa = pw_seq(a, 12);
    assert_int_equal(pw_run(&w, qa, fork), 8);
    for (int i = 0; i < PW_SLOT; i++) assert_true(fork[i] == (float)(800 + i));
    ds_prefix_stats s1;
    ds_prefix_get_stats(w.px, &s1);
    assert_int_equal(s1.ckpt_loads - s0.ckpt_loads, 1);
    assert_int_equal(s1.ckpt_evicted - s0.ckpt_evicted, 1);
    assert_int_equal(s1.reentries, 0);
    ds_seq_free(qa);
    pw_free(&w);
    ds_offload_free(g_off);
    g_off = NULL;
}

/* Case 2: A's pages come back from the RAM tier into a pool whose only idle pages belong to
 * sequences that never finished; each page taken stores one of theirs on the way out. A's pages
 * must hold A's rows (the store once went through the buffer holding A's page). */
static void test_tier_page_load_owns_buffer(void **st) {
    (void)st;
    ds_err err = {{0}};
    ds_offload_opts oo = {.ram_bytes = 1u << 20, .model_id = "case2", .layer_hi = 1};
    assert_int_equal(ds_offload_create(&oo, &g_off, &err), DS_OK);
    px_world w;
    pw_init(&w, 0, 8);
    int32_t a[12];
    for (int i = 0; i < 12; i++) a[i] = 1 + i;
    ds_seq *qa = pw_seq(a, 12);
    pw_run(&w, qa, NULL); /* A's rows b*100 + i + 0.5, stored when it finished */
    ds_seq_free(qa);
    for (int k = 0; k < PW_PAGES / 4; k++) { /* four unfinished prompts of 4 pages: A's go */
        int32_t t[16];
        for (int i = 0; i < 16; i++) t[i] = 1000 * (k + 1) + i;
        pw_file_unfinished(&w, t, 16, -100.0f * (float)(k + 1), -5000.0f * (float)(k + 1));
    }
    ds_prefix_stats s0;
    ds_prefix_get_stats(w.px, &s0);
    assert_true(s0.pages_evicted >= 3);
    qa = pw_seq(a, 12);
    int d = ds_prefix_match(w.px, qa);
    assert_int_equal(d, 8);
    for (int b = 0; b < d / PW_BS; b++) {
        float rows[PW_BS * PW_ROW];
        ds_dmem_copy(pw_dm(), rows, w.layer0 + (size_t)qa->block_table[b] * PW_BS * PW_ROW,
                     sizeof rows);
        for (int i = 0; i < PW_BS * PW_ROW; i++)
            assert_true(rows[i] == (float)(b * 100 + i) + 0.5f);
    }
    ds_prefix_stats s1;
    ds_prefix_get_stats(w.px, &s1);
    assert_true(s1.page_loads - s0.page_loads >= 2);
    assert_int_equal(s1.reentries, 0);
    ds_prefix_release(w.px, qa);
    for (int b = qa->n_blocks - 1; b >= 0; b--) ds_page_unref(w.pages, qa->block_table[b]);
    qa->n_blocks = 0;
    ds_seq_free(qa);
    pw_free(&w);
    ds_offload_free(g_off);
    g_off = NULL;
}

/* ---- whole engines -------------------------------------------------------------------------- */

#define KV_MEM (8u << 20)

typedef struct warm_case {
    int n_prompt;
    uint64_t seed;
    int want_hit; /* tokens the second run must resume from */
} warm_case;

/* Each prompt twice on a warm engine: the second resumes exactly want_hit tokens deep, and both
 * give the cold engine's tokens. */
static void test_warm_equals_cold(void **st) {
    (void)st;
    /* page 16, prompts cut every 48 tokens (the rung interval; the step budget is 64) and at
     * their ends; only blocks of whole 48-token steps are filed, and a repeat resumes at the
     * deepest rung short of its last token (docs/prefix-cache.md) */
    const warm_case cases[] = {
        {33, 1, 0},  /* shorter than one step: nothing filed */
        {48, 8, 0},  /* one whole step, but the last token must run: its rung at 48 is too deep */
        {49, 9, 48}, /* one step and one token: the fork is the whole prefill */
        {65, 3, 48}, /* a step and a partial one: the partial one's rows are never filed */
        {60, 4, 48},  {96, 10, 48}, /* two whole steps: the rung at 96 is one token too deep */
        {97, 11, 96}, {10, 5, 0},   /* shorter than a page */
        {17, 7, 0},
    };
    enum { GEN = 24 };
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *cold = h_start(&o);
    h_opts(&o, 1, KV_MEM);
    ds_engine *warm = h_start(&o);
    for (size_t c = 0; c < DS_ARRAY_LEN(cases); c++) {
        int32_t p[128], ref[GEN], out[GEN];
        h_prompt(p, cases[c].n_prompt, cases[c].seed);
        h_run(cold, p, cases[c].n_prompt, GEN, ref);
        h_run(warm, p, cases[c].n_prompt, GEN, out);
        assert_memory_equal(out, ref, sizeof ref);
        ds_engine_stats s0 = h_stats(warm);
        h_run(warm, p, cases[c].n_prompt, GEN, out);
        ds_engine_stats s1 = h_stats(warm);
        print_message("prompt %d: hit %llu tokens\n", cases[c].n_prompt,
                      (unsigned long long)(s1.prefix_hit_tokens - s0.prefix_hit_tokens));
        assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, cases[c].want_hit);
        assert_int_equal(s1.forks - s0.forks, cases[c].want_hit ? 1 : 0);
        assert_memory_equal(out, ref, sizeof ref);
    }
    /* a prompt sharing 50 tokens with the 60-token one resumes at its rung at 48 */
    int32_t p[128], ref[GEN], out[GEN];
    h_prompt(p, 60, 4);
    for (int i = 50; i < 70; i++) p[i] = (int32_t)(i * 7 % 700);
    h_run(cold, p, 70, GEN, ref);
    ds_engine_stats s0 = h_stats(warm);
    h_run(warm, p, 70, GEN, out);
    ds_engine_stats s1 = h_stats(warm);
    assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, 48);
    assert_memory_equal(out, ref, sizeof ref);
    assert_int_equal(s1.ckpt_dropped, 0);
    h_assert_idle(warm);
    h_stop(cold);
    h_stop(warm);
}

/* ---- issue 30, cases 4 and 5: bit-identical logprobs, not only tokens ----------------------- */

/* Case 4: a multi-turn follow-up (the first turn's prompt, its answer, a new question) on a warm
 * engine gives the cold engine's logprobs to the bit. Before, the answer's blocks — computed by
 * decode steps — were filed and served to the follow-up's prompt, whose rows then differed in the
 * last bits from prefill-computed ones. Case 5: the first request on a caching engine equals a
 * non-caching engine's (rungs once added cuts), and so does the same request with n-gram
 * speculation (a verify row once differed from a decode row). */
static void test_logprobs_bit_exact(void **st) {
    (void)st;
    enum { N1 = 150, GEN = 40, EXTRA = 30 };
    int32_t p1[N1], t1[GEN], t1c[GEN], p2[N1 + GEN + EXTRA], t2[GEN], t2c[GEN];
    float l1[GEN], l1c[GEN], l2[GEN], l2c[GEN];
    for (int i = 0; i < N1; i++) p1[i] = (int32_t)(11 + 13 * (i % 7)); /* n-gram drafts exist */
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *cold = h_start(&o);
    h_opts(&o, 1, KV_MEM);
    ds_engine *warm = h_start(&o);
    h_opts(&o, 1, KV_MEM);
    o.speculative_method = DS_SPEC_NGRAM;
    o.num_speculative_tokens = 3;
    ds_engine *spec = h_start(&o);
    h_run_lp(cold, p1, N1, GEN, t1c, l1c);
    h_run_lp(warm, p1, N1, GEN, t1, l1);
    assert_memory_equal(t1, t1c, sizeof t1);
    assert_memory_equal(l1, l1c, sizeof l1); /* case 5: caching on changes no bit */
    h_run_lp(spec, p1, N1, GEN, t1, l1);
    ds_engine_stats ss = h_stats(spec);
    assert_true(ss.spec_verifies > 0); /* rows ran as verifies, drafts riding on them */
    assert_memory_equal(t1, t1c, sizeof t1);
    assert_memory_equal(l1, l1c, sizeof l1); /* nor does speculation */
    memcpy(p2, p1, sizeof p1);
    memcpy(p2 + N1, t1c, sizeof t1c);
    h_prompt(p2 + N1 + GEN, EXTRA, 77);
    int n2 = N1 + GEN + EXTRA;
    h_run_lp(cold, p2, n2, GEN, t2c, l2c);
    ds_engine_stats s0 = h_stats(warm);
    h_run_lp(warm, p2, n2, GEN, t2, l2);
    ds_engine_stats s1 = h_stats(warm);
    print_message("follow-up: hit %llu of %d tokens\n",
                  (unsigned long long)(s1.prefix_hit_tokens - s0.prefix_hit_tokens), n2);
    assert_true(s1.prefix_hit_tokens - s0.prefix_hit_tokens >= 144); /* the first turn's steps */
    assert_memory_equal(t2, t2c, sizeof t2);
    assert_memory_equal(l2, l2c, sizeof l2); /* case 4 */
    h_run_lp(spec, p2, n2, GEN, t2, l2);
    assert_memory_equal(t2, t2c, sizeof t2);
    assert_memory_equal(l2, l2c, sizeof l2);
    h_stop(spec);
    h_stop(warm);
    h_stop(cold);
}

/* The same invariants with the FP8 and the BF16 latent cache (docs/quantization.md §4): a prefix
 * hit, a fork, speculation and a multi-turn follow-up compute exactly what a cold engine of the
 * same dtype does, since every attention reads the stored rows, this step's own included. And the
 * dtype is really on: its logprobs are not the f32 engine's. */
static void test_warm_equals_cold_fp8(void **st) {
    h_kv_dtype = DS_KV_FP8;
    test_warm_equals_cold(st);
    h_kv_dtype = DS_KV_F32;
}
static void test_warm_equals_cold_bf16(void **st) {
    h_kv_dtype = DS_KV_BF16;
    test_warm_equals_cold(st);
    h_kv_dtype = DS_KV_F32;
}

static void logprobs_bit_exact_dtype(void **st, int dt) {
    enum { N = 150, GEN = 40 };
    int32_t p[N], t32[GEN], t8[GEN];
    float l32[GEN], l8[GEN];
    for (int i = 0; i < N; i++) p[i] = (int32_t)(11 + 13 * (i % 7));
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *e = h_start(&o);
    h_run_lp(e, p, N, GEN, t32, l32);
    h_stop(e);
    h_kv_dtype = dt;
    h_opts(&o, 0, KV_MEM);
    e = h_start(&o);
    h_run_lp(e, p, N, GEN, t8, l8);
    h_stop(e);
    int differ = 0;
    for (int i = 0; i < GEN && !differ; i++) differ = t8[i] != t32[i] || l8[i] != l32[i];
    assert_true(differ);
    test_logprobs_bit_exact(st);
    h_kv_dtype = DS_KV_F32;
}
static void test_logprobs_bit_exact_fp8(void **st) {
    logprobs_bit_exact_dtype(st, DS_KV_FP8);
}
static void test_logprobs_bit_exact_bf16(void **st) {
    logprobs_bit_exact_dtype(st, DS_KV_BF16);
}

/* Drafts for the fork test: the cold continuation ref with the first `good` drafts right and the
 * rest wrong, so a verify accepts exactly `good` of them (the last token of the prompt sits at
 * n_prompt - 1; drafts proposed for length len continue ref at len - n_prompt). */
typedef struct fork_oracle {
    const int32_t *ref;
    int n_ref, n_prompt, good, calls_at_prompt;
} fork_oracle;

static int fork_oracle_drafts(void *ctx, const int32_t *t, int len, int k, int32_t *d) {
    (void)t;
    fork_oracle *o = ctx;
    int at = len - o->n_prompt;
    if (at == 0) o->calls_at_prompt++;
    int n = 0;
    for (; n < k && at + n < o->n_ref; n++)
        d[n] = n < o->good ? o->ref[at + n] : (o->ref[at + n] + 1) % 700;
    return n;
}

/* A fork on a verify step (issue 6): a repeat of a prompt of 16 m + 1 tokens resumes from the
 * checkpoint at 16 m, one token short of its end, so its first step — the one that copies the
 * checkpoint into its slot — is already a verify with drafts riding on the last prompt token.
 * Output equals the cold engine's (no prefix caching, no speculation) for n-gram drafts on a
 * repetitive prompt and for oracle drafts forcing every accepted count 0..k on that first verify
 * (each count rolls the forked KDA state back to a different row). */
static void test_fork_on_verify(void **st) {
    (void)st;
    enum { NP = 49, GEN = 24, K = 4 }; /* a repeat resumes at the rung at 48: one token short */
    int32_t p[NP], ref[GEN], out[GEN];
    for (int i = 0; i < NP; i++) p[i] = (int32_t)(11 + 13 * (i % 7)); /* n-gram drafts exist */
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *cold = h_start(&o);
    h_run(cold, p, NP, GEN, ref);
    h_stop(cold);

    fork_oracle orc = {ref, GEN, NP, 0, 0};
    for (int method = 0; method < 2; method++) {
        h_opts(&o, 1, KV_MEM);
        o.speculative_method = DS_SPEC_NGRAM;
        o.num_speculative_tokens = K;
        if (method == 1) {
            o.test.spec_drafts = fork_oracle_drafts;
            o.test.spec_ctx = &orc;
        }
        ds_engine *e = h_start(&o);
        h_run(e, p, NP, GEN, out); /* cold: files the checkpoint at 48 */
        assert_memory_equal(out, ref, sizeof ref);
        for (int good = 0; good <= (method ? K : 0); good++) {
            orc.good = good;
            orc.calls_at_prompt = 0;
            ds_engine_stats s0 = h_stats(e);
            h_run(e, p, NP, GEN, out);
            ds_engine_stats s1 = h_stats(e);
            print_message("%s drafts, %d right: hit %llu, fork verifies %llu, accepted %llu\n",
                          method ? "oracle" : "n-gram", good,
                          (unsigned long long)(s1.prefix_hit_tokens - s0.prefix_hit_tokens),
                          (unsigned long long)(s1.spec_fork_verifies - s0.spec_fork_verifies),
                          (unsigned long long)(s1.spec_accepted_at[0] - s0.spec_accepted_at[0]));
            assert_memory_equal(out, ref, sizeof ref);
            assert_int_equal(s1.prefix_hit_tokens - s0.prefix_hit_tokens, NP - 1);
            assert_int_equal(s1.forks - s0.forks, 1);
            assert_int_equal(s1.spec_fork_verifies - s0.spec_fork_verifies, 1);
            assert_int_equal(s1.ckpt_holds, 0);
            if (method) assert_int_equal(orc.calls_at_prompt, 1); /* drafted at admission */
        }
        h_assert_idle(e);
        h_stop(e);
    }
}

static void test_fork_on_verify_fp8(void **st) {
    h_kv_dtype = DS_KV_FP8;
    test_fork_on_verify(st);
    h_kv_dtype = DS_KV_F32;
}
static void test_fork_on_verify_bf16(void **st) {
    h_kv_dtype = DS_KV_BF16;
    test_fork_on_verify(st);
    h_kv_dtype = DS_KV_F32;
}

/* 32 requests sharing an 80-token system prompt, all submitted at once (8 run at a time): every
 * one gives its cold tokens, and the later ones resume from the shared prefix. */
static void test_shared_system_prompt(void **st) {
    (void)st;
    enum { N = 32, SYS = 80, GEN = 12 };
    int32_t(*p)[160] = calloc(N, sizeof *p);
    int n[N];
    for (int i = 0; i < N; i++) {
        h_prompt(p[i], SYS, 77);
        n[i] = SYS + 3 + (i * 5) % 40;
        h_prompt(p[i] + SYS, n[i] - SYS, 1000 + (uint64_t)i);
    }
    int32_t(*ref)[GEN] = calloc(N, sizeof *ref);
    ds_engine_opts o;
    h_opts(&o, 0, KV_MEM);
    ds_engine *cold = h_start(&o);
    for (int i = 0; i < N; i++) h_run(cold, p[i], n[i], GEN, ref[i]);
    h_stop(cold);

    h_opts(&o, 1, KV_MEM);
    ds_engine *warm = h_start(&o);
    h_req *r = calloc(N, sizeof *r);
    for (int i = 0; i < N; i++) h_submit(warm, p[i], n[i], GEN, &r[i]);
    for (int i = 0; i < N; i++) {
        h_wait(&r[i]);
        assert_int_equal(r[i].n[0], GEN);
        assert_memory_equal(r[i].tokens[0], ref[i], sizeof ref[i]);
    }
    ds_engine_stats s = h_stats(warm);
    print_message("shared prompt: %llu of %llu tokens from cache, %llu forks\n",
                  (unsigned long long)s.prefix_hit_tokens,
                  (unsigned long long)s.prefix_query_tokens, (unsigned long long)s.forks);
    assert_true(s.forks >= N / 2);
    assert_true(s.prefix_hit_tokens >= (uint64_t)(N / 2) * 64);
    h_stop(warm);
    free(p);
    free(ref);
    free(r);
}

/* Tiny pools: few pages beyond what the running sequences need and four checkpoint slots, so
 * cached pages and checkpoints are evicted all the time; outputs stay cold-exact. Then the same
 * with 3-bit hashes, so collisions happen everywhere and must all be misses. */
static void run_pressure(int hash_bits) {
    enum { N = 24, GEN = 10 };
    int32_t(*p)[128] = calloc(N, sizeof *p);
    int n[N];
    for (int i = 0; i < N; i++) {
        int fam = i % 2;
        h_prompt(p[i], 64, 300 + (uint64_t)fam);
        n[i] = 40 + (i * 13) % 60;
        if (n[i] > 64) h_prompt(p[i] + 64, n[i] - 64, 400 + (uint64_t)i);
    }
    int32_t(*ref)[GEN] = calloc(N, sizeof *ref);
    size_t mem = 360u << 10; /* a few pages beyond what four running sequences need */
    ds_engine_opts o;
    h_opts(&o, 0, mem);
    o.max_num_seqs = 4;
    o.state_checkpoint_interval_tokens = 16; /* prompts cut (and rungs) every page */
    ds_engine *cold = h_start(&o);
    for (int i = 0; i < N; i++) h_run(cold, p[i], n[i], GEN, ref[i]);
    h_stop(cold);

    h_opts(&o, 1, mem);
    o.max_num_seqs = 4;
    o.state_checkpoint_interval_tokens = 16;
    o.test.prefix_hash_bits = hash_bits;
    o.state_checkpoint_memory = 4 * h_slot_bytes(); /* four checkpoint slots */
    ds_engine *warm = h_start(&o);
    h_req *r = calloc(N, sizeof *r);
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) h_submit(warm, p[i], n[i], GEN, &r[i]);
        for (int i = 0; i < N; i++) {
            h_wait(&r[i]);
            assert_memory_equal(r[i].tokens[0], ref[i], sizeof ref[i]);
        }
    }
    ds_engine_stats s = h_stats(warm);
    print_message("pressure (hash bits %d): hits %llu tokens, forks %llu, ckpt kept %llu evicted "
                  "%llu dropped %llu, pages evicted %llu, collisions %llu, preemptions %llu\n",
                  hash_bits, (unsigned long long)s.prefix_hit_tokens, (unsigned long long)s.forks,
                  (unsigned long long)s.ckpt_kept, (unsigned long long)s.ckpt_evicted,
                  (unsigned long long)s.ckpt_dropped, (unsigned long long)s.prefix_pages_evicted,
                  (unsigned long long)s.prefix_collisions, (unsigned long long)s.preemptions_total);
    assert_int_equal(s.ckpt_slots_total, 4);
    if (hash_bits) {
        assert_true(s.prefix_collisions > 0);
    } else {
        assert_true(s.ckpt_evicted > 0);
        assert_true(s.prefix_pages_evicted > 0);
        assert_true(s.forks > 0);
    }
    h_stop(warm);
    free(p);
    free(ref);
    free(r);
}

static void test_eviction_pressure(void **st) {
    (void)st;
    run_pressure(0);
}

static void test_engine_collisions(void **st) {
    (void)st;
    run_pressure(3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash_chain_and_hit),
        cmocka_unit_test(test_demand_rung),
        cmocka_unit_test(test_state_on_device),
        cmocka_unit_test(test_offload_on_device),
        cmocka_unit_test(test_pinned_host_memory),
        cmocka_unit_test(test_forced_collisions),
        cmocka_unit_test(test_warm_equals_cold),
        cmocka_unit_test(test_shared_system_prompt),
        cmocka_unit_test(test_eviction_pressure),
        cmocka_unit_test(test_engine_collisions),
        cmocka_unit_test(test_fork_on_verify),
        cmocka_unit_test(test_logprobs_bit_exact),
        cmocka_unit_test(test_tier_checkpoint_load_owns_buffer),
        cmocka_unit_test(test_tier_page_load_owns_buffer),
        cmocka_unit_test(test_warm_equals_cold_fp8),
        cmocka_unit_test(test_warm_equals_cold_bf16),
        cmocka_unit_test(test_logprobs_bit_exact_fp8),
        cmocka_unit_test(test_logprobs_bit_exact_bf16),
        cmocka_unit_test(test_fork_on_verify_fp8),
        cmocka_unit_test(test_fork_on_verify_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
