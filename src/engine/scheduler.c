/* scheduler.c — continuous batching with chunked prefill and preemption by recompute.
 *
 * What a sequence needs next is read off two counters: its tokens [0, n_tokens) and how many of
 * them the model has already consumed, n_computed. The uncomputed range [n_computed, n_tokens) is
 *   - one token long for a sequence in decode (the token sampled last step), and
 *   - longer for a prompt, or for a preempted sequence that must recompute prompt + generated.
 * Either way the next item is [n_computed, min(n_tokens, next multiple of chunk_tokens)), and it
 * samples exactly when it reaches n_tokens. A decode item is just the one-token case of the same
 * rule, so a recomputing sequence needs no special path: its last chunk ends at n_tokens and
 * samples its next token, because that last token had never been fed to the model.
 *
 * Ordering invariant (it is what makes FCFS and the no-starvation argument hold): every running
 * sequence is older than every waiting one. Admission takes the oldest waiting sequence, a new
 * sequence is the youngest of all, and preemption always evicts the youngest running one — each
 * keeps the invariant. Consequence: the oldest held sequence gets an item in every step (given
 * max_num_batched_tokens >= max_num_seqs - 1 + chunk_tokens), because it goes first for budget
 * among prefills and may evict anyone else to get pages, so it always finishes.
 *
 * Pipelined (micro-batch groups, one step of each in flight), a step may only touch its own
 * group's sequences, yet the youngest running sequence may be in another group. Then the one
 * short of pages asks for it (seq->evict) and waits; that group's next step preempts it before
 * planning anything, and the pages are there at the asker's next step. Evicting within one's own
 * group instead (or evicting oneself while a younger one runs elsewhere) would break the rule
 * above: two recomputing prompts, one per group, each holding half the pool and each waiting for
 * the other's pages, stalled forever (cache_fuzz seed 300104 at -pp 2, short of pages). While a
 * sequence waits for pages no group admits newcomers, or they would take the pages freed for it.
 *
 * The two lists are arrays sorted by arrival; every operation is O(held sequences). */
#include "engine/scheduler.h"

#include <stdlib.h>

/* ---- scheduler state --------------------------------------------------------------------- */

struct ds_scheduler {
    ds_sched_opts o;
    ds_page_pool *pages; /* not owned */
    ds_slot_pool *slots; /* not owned */
    ds_prefix *prefix;   /* not owned; NULL: prefix caching off */
    ds_seq **running;    /* [max_num_seqs] oldest first; each holds a slot and its pages */
    int n_running;
    ds_seq **waiting; /* [cap_waiting] oldest first; none holds a slot or a page */
    int n_waiting, cap_waiting;
    uint64_t next_arrival;
    int cur_group, n_groups; /* pipelined steps: schedule only group cur_group of n_groups */
    uint64_t page_stall;     /* bit g: at group g's last step a running sequence of it was left
                                waiting for pages */
    int (*admit_drafts)(void *ctx, ds_seq *q); /* see ds_sched_set_admit_drafts; NULL: none */
    void *admit_ctx;
};

void ds_sched_set_admit_drafts(ds_scheduler *s, int (*fn)(void *ctx, ds_seq *q), void *ctx) {
    s->admit_drafts = fn;
    s->admit_ctx = ctx;
}

void ds_sched_set_group(ds_scheduler *s, int g, int n_groups) {
    s->cur_group = g;
    s->n_groups = n_groups;
}

/* May this step touch q (pipelined: only its own group's sequences)? */
static int in_group(const ds_scheduler *s, const ds_seq *q) {
    return s->n_groups <= 1 || q->group == s->cur_group;
}

int ds_sched_create(const ds_sched_opts *o, ds_page_pool *pages, ds_slot_pool *slots,
                    ds_scheduler **out, ds_err *err) {
    *out = NULL;
    if (!pages || !slots) return ds_errf(err, "scheduler: page and slot pools are required");
    if (o->block_size < 1) return ds_errf(err, "scheduler: block_size %d < 1", o->block_size);
    if (o->max_num_seqs < 1) return ds_errf(err, "scheduler: max_num_seqs %d < 1", o->max_num_seqs);
    if (o->chunk_tokens < 1) return ds_errf(err, "scheduler: chunk_tokens %d < 1", o->chunk_tokens);
    /* A chunk bigger than a whole step could never run. */
    if (o->max_num_batched_tokens < o->chunk_tokens)
        return ds_errf(err, "scheduler: max_num_batched_tokens %d < chunk_tokens %d",
                       o->max_num_batched_tokens, o->chunk_tokens);
    ds_scheduler *s = ds_calloc(1, sizeof *s, err);
    if (!s) return DS_ERR;
    s->running = ds_calloc((size_t)o->max_num_seqs, sizeof *s->running, err);
    if (!s->running) {
        free(s);
        return DS_ERR;
    }
    s->o = *o;
    s->pages = pages;
    s->slots = slots;
    *out = s;
    return DS_OK;
}

void ds_sched_set_prefix(ds_scheduler *s, ds_prefix *px) {
    s->prefix = px;
}

/* Gives back everything the sequence holds; it then needs recomputing from position 0. With
 * prefix caching, pages go back tail first, so that among cached pages a prefix's end is always
 * older than its start and the page LRU evicts leaves before the parents they hang from. */
static void release_resources(ds_scheduler *s, ds_seq *q) {
    if (s->prefix) {
        ds_prefix_release(s->prefix, q);
        for (int b = q->n_blocks - 1; b >= 0; b--) ds_page_unref(s->pages, q->block_table[b]);
    } else {
        for (int b = 0; b < q->n_blocks; b++) ds_page_unref(s->pages, q->block_table[b]);
    }
    q->n_blocks = 0;
    if (q->slot >= 0) ds_slot_release(s->slots, q->slot);
    q->slot = -1;
}

void ds_sched_free(ds_scheduler *s) {
    if (!s) return;
    for (int i = 0; i < s->n_running; i++) {
        release_resources(s, s->running[i]);
        ds_seq_free(s->running[i]);
    }
    for (int i = 0; i < s->n_waiting; i++) {
        release_resources(s, s->waiting[i]);
        ds_seq_free(s->waiting[i]);
    }
    free(s->running);
    free(s->waiting);
    free(s);
}

/* Index at which q goes to keep list[0..n) sorted by arrival. */
static int sorted_pos(ds_seq *const *list, int n, const ds_seq *q) {
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (list[mid]->arrival < q->arrival)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static void list_insert(ds_seq **list, int *n, ds_seq *q) {
    int at = sorted_pos(list, *n, q);
    memmove(list + at + 1, list + at, (size_t)(*n - at) * sizeof *list);
    list[at] = q;
    (*n)++;
}

static int list_remove(ds_seq **list, int *n, const ds_seq *q) {
    for (int i = 0; i < *n; i++) {
        if (list[i] != q) continue;
        memmove(list + i, list + i + 1, (size_t)(*n - i - 1) * sizeof *list);
        (*n)--;
        return 1;
    }
    return 0;
}

/* Sizes the waiting queue for every held sequence plus one, so that a preemption (which moves a
 * running sequence there while planning, where nothing may fail) never needs to grow it. */
static int waiting_reserve(ds_scheduler *s, ds_err *err) {
    int want = s->n_running + s->n_waiting + 1;
    if (want <= s->cap_waiting) return DS_OK;
    int cap = DS_MAX(want, s->cap_waiting ? 2 * s->cap_waiting : 64);
    ds_seq **w = realloc(s->waiting, (size_t)cap * sizeof *w);
    if (!w) return ds_errf(err, "scheduler: out of memory growing the waiting queue to %d", cap);
    s->waiting = w;
    s->cap_waiting = cap;
    return DS_OK;
}

static int blocks_for(const ds_scheduler *s, int n_positions) {
    return (n_positions + s->o.block_size - 1) / s->o.block_size;
}

int ds_sched_add(ds_scheduler *s, ds_seq *seq, ds_err *err) {
    if (seq->n_tokens < 1 || seq->n_computed != 0 || seq->n_blocks != 0 || seq->slot != -1)
        return ds_errf(err, "sequence %lld: not a fresh sequence", (long long)seq->id);
    /* The prompt's last chunk samples a token, which needs a place to go. */
    if (seq->n_tokens >= seq->max_len)
        return ds_errf(err, "sequence %lld: %d tokens leave no room below max_len %d",
                       (long long)seq->id, seq->n_tokens, seq->max_len);
    /* Pages for every position it may ever hold must fit the pool, or it could be preempted
     * forever; with that, the oldest sequence can always take what it needs from younger ones. */
    int need = blocks_for(s, seq->max_len);
    if (need > ds_page_n_total(s->pages))
        return ds_errf(
            err, "sequence %lld: max_len %d needs %d pages of %d tokens, the pool has %d",
            (long long)seq->id, seq->max_len, need, s->o.block_size, ds_page_n_total(s->pages));
    if (waiting_reserve(s, err) != DS_OK) return DS_ERR;
    seq->arrival = s->next_arrival++;
    seq->status = DS_SEQ_WAITING;
    list_insert(s->waiting, &s->n_waiting, seq);
    return DS_OK;
}

/* ---- planning a step --------------------------------------------------------------------- */

typedef struct plan {
    ds_sched_item *items; /* [max_num_seqs] */
    int n_items;
    ds_seq **preempted; /* [max_num_seqs] */
    int n_preempted;
    int budget; /* tokens left in this step */
} plan;

static int item_end(const ds_scheduler *s, const ds_seq *q) {
    return ds_seq_next_cut(q, s->o.chunk_tokens, s->o.block_size);
}

static void emit(plan *pl, ds_seq *q, int end) {
    int n = end - q->n_computed;
    pl->items[pl->n_items++] = (ds_sched_item){q, q->n_computed, n, end == q->n_tokens};
    pl->budget -= n;
}

static void drop_drafts(ds_seq *q) {
    q->n_tokens -= q->n_spec;
    q->n_spec = 0;
}

/* Evicts a running sequence: drops an item already planned for it this step (refunding its
 * tokens), frees its pages and slot, and files it back among the waiting by arrival. */
static void preempt(ds_scheduler *s, plan *pl, ds_seq *v) {
    for (int i = 0; i < pl->n_items; i++) {
        if (pl->items[i].seq != v) continue;
        pl->budget += pl->items[i].n;
        memmove(pl->items + i, pl->items + i + 1,
                (size_t)(pl->n_items - i - 1) * sizeof *pl->items);
        pl->n_items--;
        break;
    }
    list_remove(s->running, &s->n_running, v);
    release_resources(s, v);
    drop_drafts(v); /* drafts are proposals, not tokens to recompute */
    v->n_computed = 0;
    v->settled = 0;
    v->group = -1;
    v->evict = 0;
    v->status = DS_SEQ_PREEMPTED;
    list_insert(s->waiting, &s->n_waiting, v); /* has room: see waiting_reserve */
    pl->preempted[pl->n_preempted++] = v;
}

int ds_sched_running(const ds_scheduler *s, ds_seq **out, int cap) {
    int n = 0;
    for (int i = 0; i < s->n_running && n < cap; i++)
        if (in_group(s, s->running[i])) out[n++] = s->running[i];
    return n;
}

int ds_sched_preempt(ds_scheduler *s, ds_seq *v) {
    int i = 0;
    while (i < s->n_running && s->running[i] != v) i++;
    if (i == s->n_running || !in_group(s, v)) return 0;
    ds_seq *one[1];
    plan pl = {NULL, 0, one, 0, 0}; /* no step planned yet: nothing to refund */
    preempt(s, &pl, v);
    return 1;
}

static int grow_table(ds_seq *q, int need) {
    return ds_seq_reserve_blocks(q, need);
}

static uint64_t group_bit(const ds_scheduler *s) {
    return 1ull << (s->cur_group & 63);
}

/* Pipelined: asks the sequences of other groups younger than q (and than every sequence of q's
 * group: the youngest first, never past one of q's own) to go, until their pages would cover
 * `missing`. Each is preempted when its group is next scheduled. */
static void ask_evictions(ds_scheduler *s, const ds_seq *q, int missing) {
    for (int i = s->n_running - 1; i >= 0 && missing > 0; i--) {
        ds_seq *v = s->running[i];
        if (v == q || in_group(s, v)) break;
        v->evict = 1;
        missing -= v->n_blocks;
    }
}

/* Makes q's block table cover positions [0, end), evicting the youngest running sequence while
 * the pool is dry. When q itself is the youngest: with may_evict_self it is evicted (a decode
 * cannot wait without blocking its elders' pages forever); otherwise it keeps what it has and
 * waits. When the youngest is another group's, it is asked to go (ask_evictions) and q waits.
 * Returns DS_OK when covered; DS_ERR otherwise (q may then be PREEMPTED). */
static int take_pages(ds_scheduler *s, plan *pl, ds_seq *q, int end, int may_evict_self) {
    int need = blocks_for(s, end);
    if (grow_table(q, need) != DS_OK) return DS_ERR;
    while (q->n_blocks < need) {
        int page = ds_page_alloc(s->pages);
        if (page >= 0) {
            q->block_table[q->n_blocks++] = page;
            continue;
        }
        ds_seq *youngest = s->running[s->n_running - 1]; /* q runs: the list is not empty */
        if (youngest == q && may_evict_self) {
            preempt(s, pl, q);
            return DS_ERR;
        }
        if (youngest == q || !in_group(s, youngest)) {
            if (youngest != q) ask_evictions(s, q, need - q->n_blocks);
            s->page_stall |= group_bit(s); /* no group admits anyone while q waits for pages */
            return DS_ERR;
        }
        preempt(s, pl, youngest);
    }
    return DS_OK;
}

void ds_sched_schedule(ds_scheduler *s, ds_sched_item *items, int *n_items, ds_seq **preempted,
                       int *n_preempted) {
    plan pl = {items, 0, preempted, 0, s->o.max_num_batched_tokens};

    /* 0. Pipelined: those of this group an older sequence elsewhere asked to go (take_pages). */
    s->page_stall &= ~group_bit(s);
    /*    (one whose asker has ended since, leaving it the oldest, stays: the oldest always runs) */
    for (int i = s->n_running - 1; i >= 0; i--) {
        ds_seq *v = s->running[i];
        if (v->evict && i == 0) v->evict = 0;
        if (v->evict && in_group(s, v)) preempt(s, &pl, v);
    }

    /* 1. Decodes, oldest first: one token each. A sequence evicted here is always younger than
     *    the one evicting it, so it has no item yet, and the loop index stays valid (evictions
     *    only remove entries after i, or i itself when it is the last). */
    for (int i = 0; i < s->n_running && pl.budget > 0; i++) {
        ds_seq *q = s->running[i];
        /* a decode: the last token, plus the drafts riding on it (a verify) */
        if (!in_group(s, q) || q->n_tokens - q->n_spec - q->n_computed != 1) continue;
        if (take_pages(s, &pl, q, q->n_tokens, 1) == DS_OK) emit(&pl, q, q->n_tokens);
    }

    /* 2. Running prompts (and recomputes), oldest first. One that does not fit the budget waits
     *    while younger ones may still fit. One short of pages evicts younger running sequences,
     *    even decodes already planned above: the older request is the one kept. */
    int stalled = 0;
    for (int i = 0; i < s->n_running; i++) {
        ds_seq *q = s->running[i];
        if (!in_group(s, q) || q->n_tokens - q->n_spec - q->n_computed <= 1) continue;
        int end = item_end(s, q);
        if (end - q->n_computed > pl.budget || take_pages(s, &pl, q, end, 0) != DS_OK) {
            stalled = 1;
            continue;
        }
        emit(&pl, q, end);
    }

    /* 3. Admission, strictly in arrival order, never by evicting. Skipped when a running prompt
     *    stalled (a newcomer would take the budget or pages its elder is waiting for), when a
     *    sequence of another group was left waiting for pages at that group's last step (the
     *    same, across groups), and when this step evicted someone (the pools are tight;
     *    re-admitting the evicted at once would only throw its work away again). */
    int in_g = 0; /* pipelined: a group takes newcomers up to its share of all sequences, so
                     that the groups in flight stay about the same size */
    if (s->n_groups > 1)
        for (int i = 0; i < s->n_running; i++) in_g += s->running[i]->group == s->cur_group;
    while (!stalled && pl.n_preempted == 0 && !(s->page_stall & ~group_bit(s)) &&
           s->n_waiting > 0) {
        ds_seq *q = s->waiting[0];
        if (s->n_running >= s->o.max_num_seqs || ds_slot_n_free(s->slots) == 0) break;
        if (s->n_groups > 1 && in_g * s->n_groups >= s->n_running + s->n_waiting) break;
        in_g++;
        /* Resume from the deepest cached prefix: shared pages, n_computed past them. */
        if (s->prefix) ds_prefix_match(s->prefix, q);
        /* Resumed one token short of its end (a cached prompt, or a preempted decode): its first
         * step may be a verify, drafts riding on the last token; that item is cut nowhere. */
        if (s->admit_drafts && q->n_tokens - q->n_computed == 1) {
            s->admit_drafts(s->admit_ctx, q);
            /* drafts are a bonus: they never keep a sequence from being admitted */
            if (q->n_spec && (q->n_tokens - q->n_computed > pl.budget ||
                              blocks_for(s, q->n_tokens) - q->n_blocks > ds_page_n_free(s->pages)))
                drop_drafts(q);
        }
        int end = q->n_spec ? q->n_tokens : item_end(s, q), nb = blocks_for(s, end);
        if (end - q->n_computed > pl.budget || nb - q->n_blocks > ds_page_n_free(s->pages) ||
            grow_table(q, nb) != DS_OK) {
            release_resources(s, q); /* the hit, if any, is looked up again next time */
            q->n_computed = 0;
            drop_drafts(q); /* proposed again when it is admitted */
            break;
        }
        if (s->prefix) ds_prefix_admitted(s->prefix, q);
        q->slot = ds_slot_alloc(s->slots);
        while (q->n_blocks < nb) q->block_table[q->n_blocks++] = ds_page_alloc(s->pages);
        q->status = DS_SEQ_RUNNING;
        q->group = s->n_groups > 1 ? s->cur_group : -1;
        list_remove(s->waiting, &s->n_waiting, q);
        list_insert(s->running, &s->n_running, q);
        emit(&pl, q, end);
    }

    *n_items = pl.n_items;
    *n_preempted = pl.n_preempted;
}

/* The caller must not remove or free a sequence between planning a step and committing it. */
void ds_sched_commit(ds_scheduler *s, const ds_sched_item *items, int n_items) {
    (void)s;
    for (int i = 0; i < n_items; i++) {
        ds_seq *q = items[i].seq;
        /* A stale item (its sequence preempted or removed since) must not advance anything. */
        if (q->status != DS_SEQ_RUNNING || items[i].pos0 != q->n_computed ||
            q->n_computed + items[i].n > q->n_tokens)
            continue;
        q->n_computed += items[i].n;
    }
}

void ds_sched_remove(ds_scheduler *s, ds_seq *seq, ds_seq_status final_status) {
    if (!list_remove(s->running, &s->n_running, seq)) list_remove(s->waiting, &s->n_waiting, seq);
    release_resources(s, seq);
    seq->status = final_status;
}

int ds_sched_n_running(const ds_scheduler *s) {
    return s->n_running;
}

int ds_sched_n_waiting(const ds_scheduler *s) {
    return s->n_waiting;
}

int ds_sched_collect(const ds_scheduler *s, ds_seq **out, int cap) {
    int n = 0;
    for (int i = 0; i < s->n_running && n < cap; i++) out[n++] = s->running[i];
    for (int i = 0; i < s->n_waiting && n < cap; i++) out[n++] = s->waiting[i];
    return n;
}
