/* pages.c — bookkeeping of the MLA latent page pool.
 *
 * Free pages sit on a stack, so alloc and the last unref are O(1) and a page freed just now is the
 * next one handed out (its memory is still warm in cache). Refcounts let prefix caching share a
 * full page between sequences; a page returns to the stack only when its last holder lets go.
 *
 * Cached pages (filed by the prefix index) with no holder sit on a doubly linked LRU list instead:
 * released ones join at the tail, ds_page_alloc evicts from the head only when the stack is empty,
 * and a ref takes a page off the list wherever it is. Sequences release their pages tail first
 * (scheduler.c), so a parent page is always more recent than its children and eviction eats
 * prefixes from their ends.
 *
 * A ref or unref of a page that is not held (refcount 0) or not in the pool is a caller bug. It
 * must not corrupt the free stack (pushing a page twice would hand it to two sequences), so it is
 * ignored and counted; tests assert the counter stays at zero. */
#include "cache/pages.h"

#include <stdlib.h>

struct ds_page_pool {
    int n_pages;
    int32_t *refcount;   /* [n_pages] holders of each page; 0 = free or idle-cached */
    int32_t *free_stack; /* [n_pages] ids of free pages in free_stack[0 .. n_free) */
    int n_free;
    uint8_t *cached;            /* [n_pages] filed by the prefix index */
    int32_t *prev, *next;       /* [n_pages] LRU links of idle cached pages; -1 = none */
    int32_t lru_head, lru_tail; /* head = least recently released */
    int n_lru;
    ds_page_evict_fn evict;
    void *evict_user;
    uint64_t n_bad; /* refs/unrefs of free or out-of-range pages (bugs), for tests */
};

int ds_page_pool_create(int n_pages, ds_page_pool **out, ds_err *err) {
    *out = NULL;
    if (n_pages < 1) return ds_errf(err, "page pool: need at least 1 page, got %d", n_pages);
    ds_page_pool *p = ds_calloc(1, sizeof *p, err);
    if (!p) return DS_ERR;
    p->refcount = ds_calloc((size_t)n_pages, sizeof *p->refcount, err);
    p->free_stack = ds_malloc((size_t)n_pages * sizeof *p->free_stack, err);
    p->cached = ds_calloc((size_t)n_pages, 1, err);
    p->prev = ds_malloc((size_t)n_pages * sizeof *p->prev, err);
    p->next = ds_malloc((size_t)n_pages * sizeof *p->next, err);
    if (!p->refcount || !p->free_stack || !p->cached || !p->prev || !p->next) {
        ds_page_pool_free(p);
        return DS_ERR;
    }
    p->n_pages = n_pages;
    /* Low ids on top, so a fresh pool hands out 0, 1, 2, ... (predictable in tests and logs). */
    for (int i = 0; i < n_pages; i++) p->free_stack[i] = n_pages - 1 - i;
    for (int i = 0; i < n_pages; i++) p->prev[i] = p->next[i] = -1;
    p->n_free = n_pages;
    p->lru_head = p->lru_tail = -1;
    *out = p;
    return DS_OK;
}

void ds_page_pool_free(ds_page_pool *p) {
    if (!p) return;
    free(p->refcount);
    free(p->free_stack);
    free(p->cached);
    free(p->prev);
    free(p->next);
    free(p);
}

static void lru_push_tail(ds_page_pool *p, int page) {
    p->prev[page] = p->lru_tail;
    p->next[page] = -1;
    if (p->lru_tail >= 0)
        p->next[p->lru_tail] = page;
    else
        p->lru_head = page;
    p->lru_tail = page;
    p->n_lru++;
}

static void lru_unlink(ds_page_pool *p, int page) {
    if (p->prev[page] >= 0)
        p->next[p->prev[page]] = p->next[page];
    else
        p->lru_head = p->next[page];
    if (p->next[page] >= 0)
        p->prev[p->next[page]] = p->prev[page];
    else
        p->lru_tail = p->prev[page];
    p->prev[page] = p->next[page] = -1;
    p->n_lru--;
}

static int idle_cached(const ds_page_pool *p, int page) {
    return page >= 0 && page < p->n_pages && p->refcount[page] == 0 && p->cached[page];
}

int ds_page_alloc(ds_page_pool *p) {
    int page;
    if (p->n_free > 0) {
        page = p->free_stack[--p->n_free];
    } else if (p->lru_head >= 0) {
        page = p->lru_head;
        lru_unlink(p, page);
        p->cached[page] = 0;
        if (p->evict) p->evict(p->evict_user, page);
    } else {
        return -1;
    }
    p->refcount[page] = 1;
    return page;
}

static int held(const ds_page_pool *p, int page) {
    return page >= 0 && page < p->n_pages && p->refcount[page] > 0;
}

void ds_page_ref(ds_page_pool *p, int page) {
    if (idle_cached(p, page)) {
        lru_unlink(p, page);
        p->refcount[page] = 1;
        return;
    }
    /* Reviving a free page would leave it on the free stack while in use. */
    if (!held(p, page)) {
        p->n_bad++;
        return;
    }
    p->refcount[page]++;
}

void ds_page_unref(ds_page_pool *p, int page) {
    if (!held(p, page)) {
        p->n_bad++;
        return;
    }
    if (--p->refcount[page] > 0) return;
    if (p->cached[page])
        lru_push_tail(p, page);
    else
        p->free_stack[p->n_free++] = page;
}

int ds_page_refcount(const ds_page_pool *p, int page) {
    if (page < 0 || page >= p->n_pages) return 0;
    return p->refcount[page];
}

int ds_page_n_free(const ds_page_pool *p) {
    return p->n_free + p->n_lru;
}

int ds_page_n_total(const ds_page_pool *p) {
    return p->n_pages;
}

int ds_page_n_cached_idle(const ds_page_pool *p) {
    return p->n_lru;
}

void ds_page_set_cached(ds_page_pool *p, int page, int cached) {
    if (page < 0 || page >= p->n_pages) {
        p->n_bad++;
        return;
    }
    if (cached) {
        if (p->refcount[page] == 0)
            p->n_bad++; /* a free page holds nothing worth caching */
        else
            p->cached[page] = 1;
        return;
    }
    if (idle_cached(p, page)) {
        lru_unlink(p, page);
        p->free_stack[p->n_free++] = page;
    }
    p->cached[page] = 0;
}

void ds_page_set_evict_hook(ds_page_pool *p, ds_page_evict_fn fn, void *user) {
    p->evict = fn;
    p->evict_user = user;
}

uint64_t ds_page_n_bad(const ds_page_pool *p) {
    return p->n_bad;
}
