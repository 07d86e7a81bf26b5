/* test_engine_sched.c — the step scheduler: a hand-checked scenario, the rejection rules, and a
 * randomized simulation of thousands of requests against small pools that checks every step for
 * page ownership, budgets, chunk cuts, FCFS admission, preemption bookkeeping and progress, also
 * pipelined (micro-batch groups with a step in flight each, as under -pp). */
#include "testutil.h"

#include "engine/scheduler.h"

#include <stdio.h>
#include <stdlib.h>

/* ---- helpers ----------------------------------------------------------------------------- */

typedef struct world {
    ds_page_pool *pages;
    ds_slot_pool *slots;
    ds_scheduler *sched;
    ds_sched_opts o;
} world;

static void world_init(world *w, ds_sched_opts o, int n_pages, int n_slots) {
    ds_err err;
    w->o = o;
    assert_int_equal(ds_page_pool_create(n_pages, &w->pages, &err), DS_OK);
    assert_int_equal(ds_slot_pool_create(n_slots, 8, &w->slots, &err), DS_OK);
    int rc = ds_sched_create(&o, w->pages, w->slots, &w->sched, &err);
    if (rc != DS_OK) fail_msg("%s", err.msg);
}

static void world_free(world *w) {
    ds_sched_free(w->sched);
    ds_page_pool_free(w->pages);
    ds_slot_pool_free(w->slots);
}

static ds_seq *new_seq(int64_t id, int n_prompt, int max_len) {
    int32_t prompt[512];
    assert_true(n_prompt <= 512);
    for (int i = 0; i < n_prompt; i++) prompt[i] = (int32_t)(id * 1000 + i);
    ds_err err;
    ds_seq *s = ds_seq_new(id, prompt, n_prompt, max_len, &err);
    assert_non_null(s);
    return s;
}

static ds_seq *add_seq(world *w, int64_t id, int n_prompt, int max_len) {
    ds_seq *s = new_seq(id, n_prompt, max_len);
    ds_err err;
    if (ds_sched_add(w->sched, s, &err) != DS_OK) fail_msg("%s", err.msg);
    return s;
}

typedef struct want {
    ds_seq *seq;
    int pos0, n, sample;
} want;

/* Plans a step and checks it equals exp[0..n_exp) in order, and the preempted list. */
static void expect_step(world *w, const want *exp, int n_exp, ds_seq *const *exp_pre, int n_pre) {
    ds_sched_item items[16];
    ds_seq *pre[16];
    int n_items = -1, n_preempted = -1;
    ds_sched_schedule(w->sched, items, &n_items, pre, &n_preempted);
    assert_int_equal(n_items, n_exp);
    for (int i = 0; i < n_exp; i++) {
        assert_ptr_equal(items[i].seq, exp[i].seq);
        assert_int_equal(items[i].pos0, exp[i].pos0);
        assert_int_equal(items[i].n, exp[i].n);
        assert_int_equal(items[i].sample, exp[i].sample);
    }
    assert_int_equal(n_preempted, n_pre);
    for (int i = 0; i < n_pre; i++) assert_ptr_equal(pre[i], exp_pre[i]);
    ds_sched_commit(w->sched, items, n_items);
    ds_err err;
    for (int i = 0; i < n_items; i++) {
        ds_seq *q = items[i].seq;
        assert_int_equal(q->n_computed, items[i].pos0 + items[i].n);
        if (items[i].sample) assert_int_equal(ds_seq_append(q, 7, &err), DS_OK);
    }
}

static void expect_table(const ds_seq *q, const int *pages, int n) {
    assert_int_equal(q->n_blocks, n);
    for (int i = 0; i < n; i++) assert_int_equal(q->block_table[i], pages[i]);
}

/* ---- hand-checked scenario --------------------------------------------------------------- */

/* block_size 4, chunk 8, 10 tokens a step, 3 running at most, 6 pages, 3 slots.
 * A: prompt 11, max_len 16 (4 pages); B: prompt 3, max_len 8; C: prompt 5, max_len 12. */
static void test_scenario(void **st) {
    (void)st;
    world w;
    world_init(
        &w,
        (ds_sched_opts){
            .block_size = 4, .max_num_seqs = 3, .max_num_batched_tokens = 10, .chunk_tokens = 8},
        6, 3);
    ds_seq *A = add_seq(&w, 1, 11, 16), *B = add_seq(&w, 2, 3, 8), *C = add_seq(&w, 3, 5, 12);
    assert_int_equal(ds_sched_n_waiting(w.sched), 3);

    /* 1: A's first chunk [0,8) takes 8 of 10 tokens; B's whole prompt (3) no longer fits, and C
     *    may not overtake B. */
    expect_step(&w, (want[]){{A, 0, 8, 0}}, 1, NULL, 0);
    expect_table(A, (int[]){0, 1}, 2);
    assert_int_equal(ds_sched_n_running(w.sched), 1);
    assert_int_equal(B->status, DS_SEQ_WAITING);

    /* 2: A's tail [8,11) samples; B is admitted (3 tokens, 1 page); C (5) exceeds the 4 left. */
    expect_step(&w, (want[]){{A, 8, 3, 1}, {B, 0, 3, 1}}, 2, NULL, 0);
    expect_table(A, (int[]){0, 1, 2}, 3);
    expect_table(B, (int[]){3}, 1);

    /* 3: two decodes, then C is admitted with the last two pages. */
    expect_step(&w, (want[]){{A, 11, 1, 1}, {B, 3, 1, 1}, {C, 0, 5, 1}}, 3, NULL, 0);
    expect_table(C, (int[]){4, 5}, 2);
    assert_int_equal(ds_page_n_free(w.pages), 0);
    assert_int_equal(ds_slot_n_free(w.slots), 0);
    assert_int_equal(C->n_tokens, 6);

    /* 4: A at position 12 needs a 4th page: the youngest, C, is evicted (pages 4, 5 freed; the
     *    last freed is reused first). B at position 4 needs a 2nd page and gets the other one.
     *    No admission in a step that evicted. */
    expect_step(&w, (want[]){{A, 12, 1, 1}, {B, 4, 1, 1}}, 2, (ds_seq *[]){C}, 1);
    expect_table(A, (int[]){0, 1, 2, 5}, 4);
    expect_table(B, (int[]){3, 4}, 2);
    assert_int_equal(C->status, DS_SEQ_PREEMPTED);
    assert_int_equal(C->n_computed, 0);
    assert_int_equal(C->n_blocks, 0);
    assert_int_equal(C->slot, -1);
    assert_int_equal(C->n_tokens, 6); /* its generated token is kept and will be recomputed */
    assert_int_equal(ds_slot_n_free(w.slots), 1);
    assert_int_equal(ds_sched_n_waiting(w.sched), 1);

    /* 5: C would need 2 pages for its 6 tokens; none is free. */
    expect_step(&w, (want[]){{A, 13, 1, 1}, {B, 5, 1, 1}}, 2, NULL, 0);
    expect_step(&w, (want[]){{A, 14, 1, 1}, {B, 6, 1, 1}}, 2, NULL, 0);
    assert_int_equal(A->n_tokens, 16);
    assert_int_equal(B->n_tokens, 8);
    ds_sched_remove(w.sched, A, DS_SEQ_FINISHED);
    ds_sched_remove(w.sched, B, DS_SEQ_FINISHED);
    assert_int_equal(A->status, DS_SEQ_FINISHED);
    assert_int_equal(ds_page_n_free(w.pages), 6);
    ds_seq_free(A);
    ds_seq_free(B);

    /* 7: C recomputes its prompt, cut at its end as when it first ran (so those rows come out
     *    the same), then its generated token, and samples its next token. */
    expect_step(&w, (want[]){{C, 0, 5, 0}}, 1, NULL, 0);
    expect_step(&w, (want[]){{C, 5, 1, 1}}, 1, NULL, 0);
    assert_int_equal(C->n_tokens, 7);
    expect_step(&w, (want[]){{C, 6, 1, 1}}, 1, NULL, 0);

    /* Removing a waiting sequence; ds_sched_free frees the one still held (C). */
    ds_seq *D = add_seq(&w, 4, 2, 4);
    ds_sched_remove(w.sched, D, DS_SEQ_ABORTED);
    assert_int_equal(D->status, DS_SEQ_ABORTED);
    assert_int_equal(ds_sched_n_waiting(w.sched), 0);
    ds_seq_free(D);
    ds_seq *all[4];
    assert_int_equal(ds_sched_collect(w.sched, all, 4), 1);
    assert_ptr_equal(all[0], C);
    assert_int_equal(ds_page_n_bad(w.pages), 0);
    assert_int_equal(ds_slot_n_bad(w.slots), 0);
    ds_sched_free(w.sched);
    assert_int_equal(ds_page_n_free(w.pages), 6);
    assert_int_equal(ds_slot_n_free(w.slots), 3);
    ds_page_pool_free(w.pages);
    ds_slot_pool_free(w.slots);
}

/* bs 4, chunk 8, 9 tokens a step, 8 pages, 2 slots. A (prompt 16, max_len 32) outgrows the pool
 * while B (prompt 12, max_len 20) runs: B evicts itself in decode, stalls (keeping its pages) in
 * a recompute chunk, is evicted by A, and finally recomputes in chunks cut at 8 and at its
 * prompt's end (12), with one sample at its end. */
static void test_recompute_chunks(void **st) {
    (void)st;
    world w;
    world_init(
        &w,
        (ds_sched_opts){
            .block_size = 4, .max_num_seqs = 2, .max_num_batched_tokens = 9, .chunk_tokens = 8},
        8, 2);
    ds_seq *A = add_seq(&w, 1, 16, 32), *B = add_seq(&w, 2, 12, 20);
    expect_step(&w, (want[]){{A, 0, 8, 0}}, 1, NULL, 0); /* 1 token left: B's 8 wait */
    expect_step(&w, (want[]){{A, 8, 8, 1}}, 1, NULL, 0);
    expect_step(&w, (want[]){{A, 16, 1, 1}, {B, 0, 8, 0}}, 2, NULL, 0);
    expect_table(A, (int[]){0, 1, 2, 3, 4}, 5);
    expect_table(B, (int[]){5, 6}, 2);
    expect_step(&w, (want[]){{A, 17, 1, 1}, {B, 8, 4, 1}}, 2, NULL, 0);
    assert_int_equal(ds_page_n_free(w.pages), 0);
    /* B's decode at position 12 needs a 4th page; B is the youngest, so B goes. */
    expect_step(&w, (want[]){{A, 18, 1, 1}}, 1, (ds_seq *[]){B}, 1);
    assert_int_equal(B->n_tokens, 13);
    /* B back in with [0,8) (no sample) on the pages it freed, last freed first. */
    expect_step(&w, (want[]){{A, 19, 1, 1}, {B, 0, 8, 0}}, 2, NULL, 0);
    expect_table(B, (int[]){7, 6}, 2);
    /* A takes the last free page; B's [8,13) needs 2 more and, being the youngest, waits
     * without evicting itself and without losing its 8 computed tokens. */
    expect_step(&w, (want[]){{A, 20, 1, 1}}, 1, NULL, 0);
    assert_int_equal(B->status, DS_SEQ_RUNNING);
    assert_int_equal(B->n_computed, 8);
    expect_table(B, (int[]){7, 6}, 2);
    expect_step(&w, (want[]){{A, 21, 1, 1}}, 1, NULL, 0);
    expect_step(&w, (want[]){{A, 22, 1, 1}}, 1, NULL, 0);
    expect_step(&w, (want[]){{A, 23, 1, 1}}, 1, NULL, 0);
    /* A at position 24 needs a 7th page: B, younger, is evicted. */
    expect_step(&w, (want[]){{A, 24, 1, 1}}, 1, (ds_seq *[]){B}, 1);
    expect_table(A, (int[]){0, 1, 2, 3, 4, 5, 6}, 7);
    ds_sched_remove(w.sched, A, DS_SEQ_FINISHED);
    ds_seq_free(A);
    expect_step(&w, (want[]){{B, 0, 8, 0}}, 1, NULL, 0);
    expect_step(&w, (want[]){{B, 8, 4, 0}}, 1, NULL, 0); /* cut at its prompt's end */
    expect_step(&w, (want[]){{B, 12, 1, 1}}, 1, NULL, 0);
    expect_step(&w, (want[]){{B, 13, 1, 1}}, 1, NULL, 0);
    assert_int_equal(B->n_tokens, 15);
    world_free(&w);
}

/* A test's preemption (ds_sched_preempt: tests/cachefuzz replays one run's preemptions in
 * another) does what the pools running dry do: the older sequence may be the one preempted, its
 * pages go back, it recomputes prompt + generated cut as before, and only a running sequence of
 * the current group can be preempted. */
static void test_forced_preempt(void **st) {
    (void)st;
    world w;
    world_init(
        &w,
        (ds_sched_opts){
            .block_size = 4, .max_num_seqs = 2, .max_num_batched_tokens = 16, .chunk_tokens = 8},
        16, 2);
    ds_seq *A = add_seq(&w, 1, 10, 32), *B = add_seq(&w, 2, 6, 20);
    ds_seq *run[4];
    assert_int_equal(ds_sched_running(w.sched, run, 4), 0);
    assert_int_equal(ds_sched_preempt(w.sched, A), 0); /* waiting: nothing to preempt */
    expect_step(&w, (want[]){{A, 0, 8, 0}, {B, 0, 6, 1}}, 2, NULL, 0);
    expect_step(&w, (want[]){{B, 6, 1, 1}, {A, 8, 2, 1}}, 2, NULL, 0); /* decodes first */
    expect_step(&w, (want[]){{A, 10, 1, 1}, {B, 7, 1, 1}}, 2, NULL, 0);
    assert_int_equal(ds_sched_running(w.sched, run, 4), 2);
    assert_ptr_equal(run[0], A);
    assert_ptr_equal(run[1], B);
    const int free_before = ds_page_n_free(w.pages);
    assert_int_equal(ds_sched_preempt(w.sched, A), 1); /* the older one, which the pools never do */
    assert_int_equal(A->status, DS_SEQ_PREEMPTED);
    assert_int_equal(A->n_computed, 0);
    assert_int_equal(A->n_tokens, 12); /* prompt 10 + the two tokens it generated */
    assert_int_equal(ds_page_n_free(w.pages), free_before + 3);
    assert_int_equal(ds_sched_preempt(w.sched, A), 0);
    assert_int_equal(ds_sched_running(w.sched, run, 4), 1);
    /* back at the next step, recomputing [0, 8), then [8, 10) to its prompt's end, then the
     * generated tokens [10, 12), sampling at 12 */
    expect_step(&w, (want[]){{B, 8, 1, 1}, {A, 0, 8, 0}}, 2, NULL, 0);
    expect_step(&w, (want[]){{B, 9, 1, 1}, {A, 8, 2, 0}}, 2, NULL, 0);
    expect_step(&w, (want[]){{B, 10, 1, 1}, {A, 10, 2, 1}}, 2, NULL, 0);
    assert_int_equal(A->n_tokens, 13);
    world_free(&w);
}

/* ---- rejections ---------------------------------------------------------------------------- */

static void test_rejections(void **st) {
    (void)st;
    ds_err err;
    ds_page_pool *pages;
    ds_slot_pool *slots;
    ds_scheduler *s;
    assert_int_equal(ds_page_pool_create(6, &pages, &err), DS_OK);
    assert_int_equal(ds_slot_pool_create(2, 4, &slots, &err), DS_OK);
    ds_sched_opts o = {
        .block_size = 4, .max_num_seqs = 2, .max_num_batched_tokens = 10, .chunk_tokens = 12};
    err.msg[0] = 0;
    assert_int_equal(ds_sched_create(&o, pages, slots, &s, &err), DS_ERR);
    assert_null(s);
    assert_non_null(strstr(err.msg, "chunk_tokens"));
    o.chunk_tokens = 10;
    o.block_size = 0;
    assert_int_equal(ds_sched_create(&o, pages, slots, &s, &err), DS_ERR);
    o.block_size = 4;
    o.max_num_seqs = 0;
    assert_int_equal(ds_sched_create(&o, pages, slots, &s, &err), DS_ERR);
    o.max_num_seqs = 2;
    assert_int_equal(ds_sched_create(&o, pages, slots, &s, &err), DS_OK);

    /* 6 pages of 4 tokens: max_len 24 fits exactly, 25 never can. */
    ds_seq *ok = new_seq(1, 3, 24), *big = new_seq(2, 3, 25), *full = new_seq(3, 5, 5);
    assert_int_equal(ds_sched_add(s, ok, &err), DS_OK);
    err.msg[0] = 0;
    assert_int_equal(ds_sched_add(s, big, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "pages"));
    assert_int_equal(ds_sched_add(s, full, &err), DS_ERR); /* no room for a generated token */
    assert_int_equal(ds_sched_n_waiting(s), 1);
    ds_seq_free(big);
    ds_seq_free(full);

    assert_null(ds_seq_new(4, (int32_t[]){1, 2, 3}, 3, 2, &err)); /* prompt beyond max_len */
    assert_null(ds_seq_new(5, NULL, 0, 8, &err));
    /* Appending grows the buffer up to max_len and refuses beyond. */
    ds_seq *g = new_seq(6, 1, 40);
    for (int i = 1; i < 40; i++) assert_int_equal(ds_seq_append(g, i, &err), DS_OK);
    assert_int_equal(ds_seq_append(g, 99, &err), DS_ERR);
    assert_int_equal(g->n_tokens, 40);
    for (int i = 1; i < 40; i++) assert_int_equal(g->tokens[i], i);
    ds_seq_free(g);

    ds_sched_free(s); /* frees `ok` too */
    assert_int_equal(ds_page_n_free(pages), 6);
    ds_page_pool_free(pages);
    ds_slot_pool_free(slots);
}

/* ---- randomized simulation ----------------------------------------------------------------- */

typedef struct rec {
    int64_t add_step;
    int held_at_add; /* sequences already held when it arrived */
    int64_t last_item_step;
    int n_samples;
    ds_seq_status prev_status;
    int recomputing; /* preempted since its last sample */
    int in_flight;   /* pipelined: an item of it is planned and not yet completed */
    int prev_group;  /* its group before this step's plan */
} rec;

typedef struct sim_cfg {
    ds_sched_opts o;
    int n_pages, n_slots, n_requests, max_held, max_prompt, max_gen;
    double p_abort, p_eos;
    uint64_t seed;
    int groups; /* > 1: pipelined, as the engine runs P stages: step m plans group m % groups, and
                   its items complete `groups` steps later, just before that group's next plan */
} sim_cfg;

static int irand(ds_rng *r, int lo, int hi) { /* [lo, hi] */
    return lo + (int)(ds_rng_next(r) % (uint64_t)(hi - lo + 1));
}

static void drop(world *w, ds_seq *q, ds_seq_status st) {
    ds_sched_remove(w->sched, q, st);
    assert_int_equal(q->status, st);
    assert_int_equal(q->n_blocks, 0);
    assert_int_equal(q->slot, -1);
    free(q->owner);
    ds_seq_free(q);
}

typedef struct sim_counts {
    int finished;
    long long recompute_samples, max_wait;
} sim_counts;

/* The items of a step complete: the commit, a token for each sampling item, and the ends. */
static void complete_items(world *w, const sim_cfg *c, ds_rng *rng, const ds_sched_item *items,
                           int n_items, int64_t step, sim_counts *k) {
    const int ct = c->o.chunk_tokens, G = DS_MAX(1, c->groups);
    ds_sched_commit(w->sched, items, n_items);
    for (int i = 0; i < n_items; i++) {
        ds_seq *q = items[i].seq;
        rec *r = q->owner;
        r->in_flight = 0;
        assert_int_equal(q->n_computed, items[i].pos0 + items[i].n);
        if (!items[i].sample) continue;
        k->recompute_samples += r->recomputing;
        r->recomputing = 0;
        ds_err err;
        assert_int_equal(ds_seq_append(q, (int32_t)q->n_tokens, &err), DS_OK);
        r->n_samples++;
        /* Every sample produced exactly one token: none lost or doubled by a recompute. */
        assert_int_equal(r->n_samples, q->n_tokens - q->n_prompt);
        if (q->n_tokens == q->max_len || ds_rng_uniform(rng) < c->p_eos) {
            long long waited = step - r->add_step;
            k->max_wait = DS_MAX(k->max_wait, waited);
            /* Each older request, then this one, advances every step while it is the oldest;
             * a request needs at most max_len decodes plus one recompute pass of chunks.
             * Pipelined, a step of its group comes every G steps, and one short of pages that
             * another group holds waits a round of the groups for them (twice for a stretch of
             * victims that alternates between groups). */
            long long per =
                2LL * (c->max_prompt + c->max_gen + 1) + (c->max_prompt + c->max_gen) / ct + 2;
            if (G > 1) per *= 4LL * G;
            assert_true(waited <= (long long)(r->held_at_add + 1) * per);
            drop(w, q, DS_SEQ_FINISHED);
            k->finished++;
        }
    }
}

/* Runs the simulation; returns the most sequences seen running at once. */
static int run_sim(const sim_cfg *c) {
    world w;
    world_init(&w, c->o, c->n_pages, c->n_slots);
    const ds_sched_opts *o = &c->o;
    const int bs = o->block_size, ct = o->chunk_tokens, cap = o->max_num_seqs;
    /* With this much budget the oldest request's chunk always fits after every decode. */
    const int oldest_always_runs = o->max_num_batched_tokens >= cap - 1 + ct;
    const int max_len_cap = c->n_pages * bs;
    ds_rng rng;
    ds_rng_seed(&rng, c->seed);

    int *owner = malloc((size_t)c->n_pages * sizeof *owner);          /* [n_pages] */
    uint8_t *slot_used = malloc((size_t)c->n_slots);                  /* [n_slots] */
    ds_seq **held = malloc((size_t)(c->max_held + 1) * sizeof *held); /* [max_held + 1] */
    const int G = DS_MAX(1, c->groups);
    ds_sched_item *fl = malloc((size_t)G * cap * sizeof *fl); /* [G][max_num_seqs] in flight */
    int *n_fl = calloc((size_t)G, sizeof *n_fl);              /* [G] */
    ds_seq **pre = malloc((size_t)cap * sizeof *pre);         /* [max_num_seqs] */
    int added = 0, aborted = 0, in_flight = 0;
    long long preemptions = 0;
    sim_counts k = {0};
    int64_t step = 0;
    int max_run_seen = 0;

    while (added < c->n_requests || ds_sched_n_running(w.sched) + ds_sched_n_waiting(w.sched) ||
           in_flight) {
        /* The group's last step completes before it is planned again. */
        const int g = (int)(step % G);
        ds_sched_item *items = fl + (size_t)g * cap;
        complete_items(&w, c, &rng, items, n_fl[g], step, &k);
        in_flight -= n_fl[g];
        n_fl[g] = 0;
        /* Arrivals: bursts of up to 3, while the queue is below max_held. */
        int n_new = irand(&rng, 0, 3);
        for (int k = 0; k < n_new && added < c->n_requests; k++) {
            int n_held = ds_sched_n_running(w.sched) + ds_sched_n_waiting(w.sched);
            if (n_held >= c->max_held) break;
            int P = irand(&rng, 1, c->max_prompt);
            int gen = irand(&rng, 1, c->max_gen); /* DS_MIN evaluates twice */
            int max_len = DS_MIN(P + gen, max_len_cap);
            ds_seq *q = new_seq(added + 1, P, max_len);
            rec *r = calloc(1, sizeof *r);
            *r = (rec){.add_step = step, .held_at_add = n_held, .last_item_step = -1};
            q->owner = r;
            ds_err err;
            if (ds_sched_add(w.sched, q, &err) != DS_OK) fail_msg("%s", err.msg);
            added++;
        }
        /* Aborts of random held sequences, running or waiting. */
        int n_held = ds_sched_collect(w.sched, held, c->max_held + 1);
        /* (pipelined, a step is one group's: aborts come at the same rate a round of them) */
        if (n_held > 0 && ds_rng_uniform(&rng) < c->p_abort / G) {
            ds_seq *v = held[irand(&rng, 0, n_held - 1)];
            if (!((rec *)v->owner)->in_flight) { /* (the engine defers those) */
                drop(&w, v, DS_SEQ_ABORTED);
                aborted++;
                n_held = ds_sched_collect(w.sched, held, c->max_held + 1);
            }
        }
        assert_int_equal(n_held, ds_sched_n_running(w.sched) + ds_sched_n_waiting(w.sched));
        ds_seq *oldest = NULL;
        for (int i = 0; i < n_held; i++) {
            rec *r = held[i]->owner;
            r->prev_status = held[i]->status;
            r->prev_group = held[i]->group;
            if (!oldest || held[i]->arrival < oldest->arrival) oldest = held[i];
        }

        int n_items = -1, n_pre = -1;
        if (G > 1) ds_sched_set_group(w.sched, g, G);
        ds_sched_schedule(w.sched, items, &n_items, pre, &n_pre);
        step++;

        /* -- budgets and items -- */
        assert_true(n_items >= 0 && n_items <= cap);
        assert_true(n_pre >= 0 && n_pre <= cap);
        int n_run = ds_sched_n_running(w.sched);
        assert_true(n_run <= cap && n_run <= c->n_slots);
        max_run_seen = DS_MAX(max_run_seen, n_run);
        int tokens = 0;
        for (int i = 0; i < n_items; i++) {
            ds_sched_item *it = &items[i];
            ds_seq *q = it->seq;
            rec *r = q->owner;
            assert_int_equal(q->status, DS_SEQ_RUNNING);
            assert_true(r->last_item_step != step); /* one item per sequence */
            assert_false(r->in_flight);             /* none while another is in flight */
            if (G > 1) assert_int_equal(q->group, g);
            r->last_item_step = step;
            r->in_flight = 1;
            assert_int_equal(it->pos0, q->n_computed);
            int end = it->pos0 + it->n;
            /* The cut depends only on the sequence: the next multiple of chunk_tokens, the end of
             * its prompt, or its end. */
            int want_end = DS_MIN(q->n_tokens, (it->pos0 / ct + 1) * ct);
            if (q->n_prompt > it->pos0) want_end = DS_MIN(want_end, q->n_prompt);
            assert_int_equal(end, want_end);
            assert_true(it->n >= 1);
            assert_int_equal(it->sample, end == q->n_tokens);
            /* Pages cover [0, end), and no more than that is held. */
            assert_true(q->n_blocks * bs >= end);
            assert_true((q->n_blocks - 1) * bs < end);
            tokens += it->n;
        }
        assert_true(tokens <= o->max_num_batched_tokens);
        if (n_held > 0 && G == 1) assert_true(n_items > 0);

        /* -- preemptions -- */
        for (int i = 0; i < n_pre; i++) {
            ds_seq *q = pre[i];
            assert_int_equal(q->status, DS_SEQ_PREEMPTED);
            assert_int_equal(((rec *)q->owner)->prev_status, DS_SEQ_RUNNING);
            assert_true(((rec *)q->owner)->last_item_step != step);
            assert_int_equal(q->n_computed, 0);
            assert_int_equal(q->n_blocks, 0);
            assert_int_equal(q->slot, -1);
            assert_true(q != oldest); /* the oldest request is kept */
            /* only this group's: the others' have a step in flight */
            if (G > 1) assert_int_equal(((rec *)q->owner)->prev_group, g);
            assert_false(((rec *)q->owner)->in_flight);
            ((rec *)q->owner)->recomputing = 1;
        }
        preemptions += n_pre;

        /* -- ownership: each page and slot held by at most one running sequence, none leaked -- */
        n_held = ds_sched_collect(w.sched, held, c->max_held + 1);
        for (int p = 0; p < c->n_pages; p++) owner[p] = -1;
        memset(slot_used, 0, (size_t)c->n_slots);
        int pages_used = 0, slots_used = 0;
        uint64_t max_run_arrival = 0, min_wait_arrival = UINT64_MAX;
        for (int i = 0; i < n_held; i++) {
            ds_seq *q = held[i];
            if (q->status == DS_SEQ_RUNNING) {
                /* (pipelined: one another group's sequence asked to go is on its way out; those
                 * asked at once go at their groups' next steps, and no group admits meanwhile) */
                if (!q->evict) max_run_arrival = DS_MAX(max_run_arrival, q->arrival + 1);
                assert_true(q->slot >= 0 && q->slot < c->n_slots && !slot_used[q->slot]);
                slot_used[q->slot] = 1;
                slots_used++;
                assert_true(q->n_blocks * bs >= q->n_computed);
                for (int b = 0; b < q->n_blocks; b++) {
                    int p = q->block_table[b];
                    assert_true(p >= 0 && p < c->n_pages);
                    assert_int_equal(owner[p], -1);
                    assert_int_equal(ds_page_refcount(w.pages, p), 1);
                    owner[p] = i;
                    pages_used++;
                }
            } else {
                assert_true(q->status == DS_SEQ_WAITING || q->status == DS_SEQ_PREEMPTED);
                min_wait_arrival = DS_MIN(min_wait_arrival, q->arrival + 1);
                assert_int_equal(q->n_blocks, 0);
                assert_int_equal(q->slot, -1);
                assert_int_equal(q->n_computed, 0);
            }
        }
        assert_int_equal(n_run, slots_used);
        assert_int_equal(pages_used + ds_page_n_free(w.pages), c->n_pages);
        assert_int_equal(slots_used + ds_slot_n_free(w.slots), c->n_slots);
        /* FCFS: every running sequence is older than every waiting one. */
        if (max_run_arrival && min_wait_arrival != UINT64_MAX)
            assert_true(max_run_arrival < min_wait_arrival);

        /* -- work conservation: a running sequence left out had no room -- */
        int left = o->max_num_batched_tokens - tokens;
        for (int i = 0; i < n_held; i++) {
            ds_seq *q = held[i];
            if (q->status != DS_SEQ_RUNNING || ((rec *)q->owner)->last_item_step == step ||
                (G > 1 && q->group != g))
                continue;
            int end = DS_MIN(q->n_tokens, (q->n_computed / ct + 1) * ct);
            int pages_short = (end + bs - 1) / bs > q->n_blocks && ds_page_n_free(w.pages) == 0;
            assert_true(end - q->n_computed > left || pages_short);
        }
        /* ... and so did the oldest waiting one, unless admission was closed this step (an
         * eviction, or a running sequence left out). */
        if (G == 1 && n_held > n_run && n_pre == 0 && n_items == n_run) {
            ds_seq *q = held[n_run]; /* collect lists running first, then waiting by arrival */
            int end = DS_MIN(q->n_tokens, ct);
            assert_true(n_run == cap || end > left || ds_slot_n_free(w.slots) == 0 ||
                        (end + bs - 1) / bs > ds_page_n_free(w.pages));
        }

        /* -- progress: the oldest request advances in every step (pipelined: the bound on each
         *    request's wait, in complete_items) -- */
        if (oldest && oldest_always_runs && G == 1)
            assert_int_equal(((rec *)oldest->owner)->last_item_step, step);
        n_fl[g] = n_items;
        in_flight += n_items;
        if (G == 1) { /* the step completes before the next arrivals */
            complete_items(&w, c, &rng, items, n_items, step, &k);
            in_flight = n_fl[g] = 0;
        }

        assert_int_equal(ds_page_n_bad(w.pages), 0);
        assert_int_equal(ds_slot_n_bad(w.slots), 0);
        assert_true(step < 2000000); /* no livelock */
    }

    assert_int_equal(k.finished + aborted, c->n_requests);
    assert_int_equal(ds_page_n_free(w.pages), c->n_pages);
    assert_int_equal(ds_slot_n_free(w.slots), c->n_slots);
    assert_true(preemptions > 0);
    assert_true(k.recompute_samples > 0); /* some recompute ended by sampling a fresh token */
    assert_true(aborted > 0 && k.finished > aborted);
    print_message(
        "    %d requests, %lld steps, %lld preemptions, %d aborted, max wait %lld steps\n",
        c->n_requests, (long long)step, preemptions, aborted, k.max_wait);
    free(owner);
    free(slot_used);
    free(held);
    free(fl);
    free(n_fl);
    free(pre);
    world_free(&w);
    return max_run_seen;
}

/* Small blocks, chunk a multiple of the block, fewer slots than running places. */
static sim_cfg tight_pages(void) {
    return (sim_cfg){
        .o = {.block_size = 4, .max_num_seqs = 8, .max_num_batched_tokens = 48, .chunk_tokens = 32},
        .n_pages = 110,
        .n_slots = 6,
        .n_requests = 3000,
        .max_held = 40,
        .max_prompt = 300,
        .max_gen = 100,
        .p_abort = 0.01,
        .p_eos = 0.01,
        .seed = 1};
}

static void test_sim_tight_pages(void **st) {
    (void)st;
    sim_cfg c = tight_pages();
    assert_int_equal(run_sim(&c), c.n_slots); /* slots were the binding limit */
}

/* Chunks that straddle pages, a budget too small to always fit a chunk after the decodes, and
 * max_len capped by the pool. */
static sim_cfg odd_sizes(void) {
    return (sim_cfg){.o = {.block_size = 16,
                           .max_num_seqs = 6,
                           .max_num_batched_tokens = 24,
                           .chunk_tokens = 20},
                     .n_pages = 24,
                     .n_slots = 8,
                     .n_requests = 2000,
                     .max_held = 30,
                     .max_prompt = 300,
                     .max_gen = 120,
                     .p_abort = 0.01,
                     .p_eos = 0.02,
                     .seed = 7};
}

static void test_sim_odd_sizes(void **st) {
    (void)st;
    sim_cfg c = odd_sizes();
    run_sim(&c);
}

/* Many short requests: max_num_seqs, not slots or pages, is what limits the batch. */
static void test_sim_many_short(void **st) {
    (void)st;
    sim_cfg c = {
        .o = {.block_size = 8, .max_num_seqs = 4, .max_num_batched_tokens = 40, .chunk_tokens = 16},
        .n_pages = 30,
        .n_slots = 16,
        .n_requests = 3000,
        .max_held = 40,
        .max_prompt = 40,
        .max_gen = 60,
        .p_abort = 0.01,
        .p_eos = 0.02,
        .seed = 3};
    assert_int_equal(run_sim(&c), c.o.max_num_seqs);
}

/* Pipelined (two and three groups in flight) short of pages: a sequence short of pages that the
 * youngest sequence of another group holds asks for it and waits a round of the groups, never
 * evicting its own group's older sequences or itself instead. Evicting within its own group let
 * two recomputing prompts, one per group, each wait for the other's pages forever. */
static void test_sim_pipelined(void **st) {
    (void)st;
    sim_cfg c = tight_pages();
    c.seed = 11;
    c.groups = 2;
    run_sim(&c);
    c = odd_sizes();
    c.seed = 12;
    c.groups = 3;
    run_sim(&c);
}

/* Rungs never cut prompt chunks (the prefix cache files checkpoints only at cuts the scheduler
 * makes anyway), so a request's numerics do not depend on the cache. bs 4, chunk 8, 32 tokens a
 * step: rungs at 4 and 12 still give items [0,8) [8,16) [16,18). */
static void test_rungs_add_no_cut(void **st) {
    (void)st;
    world w;
    world_init(
        &w,
        (ds_sched_opts){
            .block_size = 4, .max_num_seqs = 2, .max_num_batched_tokens = 32, .chunk_tokens = 8},
        8, 2);
    ds_seq *A = new_seq(1, 18, 24);
    A->rungs = malloc(2 * sizeof(int32_t));
    A->rungs[0] = 4;
    A->rungs[1] = 12;
    A->n_rungs = A->cap_rungs = 2;
    ds_err err;
    assert_int_equal(ds_sched_add(w.sched, A, &err), DS_OK);
    /* rungs add no cut: the prompt is cut at multiples of 8 and at its end only, as it would be
     * without a prefix cache (docs/prefix-cache.md) */
    expect_step(&w, (want[]){{A, 0, 8, 0}}, 1, NULL, 0);
    expect_step(&w, (want[]){{A, 8, 8, 0}}, 1, NULL, 0);
    expect_step(&w, (want[]){{A, 16, 2, 1}}, 1, NULL, 0);
    expect_step(&w, (want[]){{A, 18, 1, 1}}, 1, NULL, 0);
    world_free(&w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scenario),         cmocka_unit_test(test_recompute_chunks),
        cmocka_unit_test(test_rejections),       cmocka_unit_test(test_sim_tight_pages),
        cmocka_unit_test(test_sim_odd_sizes),    cmocka_unit_test(test_sim_many_short),
        cmocka_unit_test(test_rungs_add_no_cut), cmocka_unit_test(test_forced_preempt),
        cmocka_unit_test(test_sim_pipelined),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
