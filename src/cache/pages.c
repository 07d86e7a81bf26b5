/* pages.c — bookkeeping of the MLA latent page pool.
 *
 * Free pages sit on a stack, so alloc and the last unref are O(1) and a page freed just now is the
 * next one handed out (its memory is still warm in cache). Refcounts let prefix caching share a
 * full page between sequences; a page returns to the stack only when its last holder lets go.
 *
 * A ref or unref of a page that is not held (refcount 0) or not in the pool is a caller bug. It
 * must not corrupt the free stack (pushing a page twice would hand it to two sequences), so it is
 * ignored and counted; tests assert the counter stays at zero. */
#include "cache/pages.h"

#include <stdlib.h>

struct ds_page_pool {
    int n_pages;
    int32_t *refcount;   /* [n_pages] holders of each page; 0 = on the free stack */
    int32_t *free_stack; /* [n_pages] ids of free pages in free_stack[0 .. n_free) */
    int n_free;
    uint64_t n_bad; /* refs/unrefs of free or out-of-range pages (bugs), for tests */
};

int ds_page_pool_create(int n_pages, ds_page_pool **out, ds_err *err) {
    *out = NULL;
    if (n_pages < 1) return ds_errf(err, "page pool: need at least 1 page, got %d", n_pages);
    ds_page_pool *p = ds_calloc(1, sizeof *p, err);
    if (!p) return DS_ERR;
    p->refcount = ds_calloc((size_t)n_pages, sizeof *p->refcount, err);
    p->free_stack = ds_malloc((size_t)n_pages * sizeof *p->free_stack, err);
    if (!p->refcount || !p->free_stack) {
        ds_page_pool_free(p);
        return DS_ERR;
    }
    p->n_pages = n_pages;
    /* Low ids on top, so a fresh pool hands out 0, 1, 2, ... (predictable in tests and logs). */
    for (int i = 0; i < n_pages; i++) p->free_stack[i] = n_pages - 1 - i;
    p->n_free = n_pages;
    *out = p;
    return DS_OK;
}

void ds_page_pool_free(ds_page_pool *p) {
    if (!p) return;
    free(p->refcount);
    free(p->free_stack);
    free(p);
}

int ds_page_alloc(ds_page_pool *p) {
    if (p->n_free == 0) return -1;
    int page = p->free_stack[--p->n_free];
    p->refcount[page] = 1;
    return page;
}

static int held(const ds_page_pool *p, int page) {
    return page >= 0 && page < p->n_pages && p->refcount[page] > 0;
}

void ds_page_ref(ds_page_pool *p, int page) {
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
    if (--p->refcount[page] == 0) p->free_stack[p->n_free++] = page;
}

int ds_page_refcount(const ds_page_pool *p, int page) {
    if (page < 0 || page >= p->n_pages) return 0;
    return p->refcount[page];
}

int ds_page_n_free(const ds_page_pool *p) {
    return p->n_free;
}

int ds_page_n_total(const ds_page_pool *p) {
    return p->n_pages;
}

uint64_t ds_page_n_bad(const ds_page_pool *p) {
    return p->n_bad;
}
