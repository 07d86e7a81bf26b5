/* pages.h — the pool of MLA latent pages: ids 0..n-1, reference-counted so that pages can be
 * shared between sequences (prefix caching). The memory itself is the model's ds_kv_pool; this
 * module only does the bookkeeping.
 *
 * A page may be marked cached (the prefix index files its contents under a hash). A cached page
 * whose last holder lets go is not freed: it waits on an LRU list, still holding its contents,
 * until either a sequence takes it again (ds_page_ref revives it) or ds_page_alloc runs out of
 * free pages and evicts it, least recently released first, after telling the evict hook. */
#ifndef DS_PAGES_H
#define DS_PAGES_H

#include "base/ds_base.h"

typedef struct ds_page_pool ds_page_pool;

/* Called by ds_page_alloc just before an unreferenced cached page is reused; the page's contents
 * are still intact during the call (so they can be offloaded). The page is no longer cached after
 * the call. */
typedef void (*ds_page_evict_fn)(void *user, int page);

int ds_page_pool_create(int n_pages, ds_page_pool **out, ds_err *err);
void ds_page_pool_free(ds_page_pool *p);
/* A page with refcount 1: a free one first, else the LRU cached one (evicted), else -1. */
int ds_page_alloc(ds_page_pool *p);
void ds_page_ref(ds_page_pool *p, int page);   /* +1; revives an unreferenced cached page */
void ds_page_unref(ds_page_pool *p, int page); /* -1; at 0: to the LRU if cached, else freed */
int ds_page_refcount(const ds_page_pool *p, int page);
/* Pages ds_page_alloc can hand out: free ones plus unreferenced cached ones. */
int ds_page_n_free(const ds_page_pool *p);
int ds_page_n_total(const ds_page_pool *p);
/* Unreferenced cached pages (on the LRU list), a subset of ds_page_n_free. */
int ds_page_n_cached_idle(const ds_page_pool *p);
/* Marks a held or idle-cached page cached (1) or not (0). Uncaching an idle page frees it. */
void ds_page_set_cached(ds_page_pool *p, int page, int cached);
void ds_page_set_evict_hook(ds_page_pool *p, ds_page_evict_fn fn, void *user);
/* Refs/unrefs of a page that was not held (refcount 0 and not cached) or not in the pool: caller
 * bugs, ignored so that the free list stays sound, and counted so tests can assert none. */
uint64_t ds_page_n_bad(const ds_page_pool *p);

#endif
