/* pages.h — the pool of MLA latent pages: ids 0..n-1, reference-counted so that pages can be
 * shared between sequences (prefix caching). The memory itself is the model's ds_kv_pool; this
 * module only does the bookkeeping. */
#ifndef DS_PAGES_H
#define DS_PAGES_H

#include "base/ds_base.h"

typedef struct ds_page_pool ds_page_pool;

int ds_page_pool_create(int n_pages, ds_page_pool **out, ds_err *err);
void ds_page_pool_free(ds_page_pool *p);
int ds_page_alloc(ds_page_pool *p);          /* a page with refcount 1, or -1 when none is free */
void ds_page_ref(ds_page_pool *p, int page);  /* +1 */
void ds_page_unref(ds_page_pool *p, int page); /* -1; back to the free list at 0 */
int ds_page_refcount(const ds_page_pool *p, int page);
int ds_page_n_free(const ds_page_pool *p);
int ds_page_n_total(const ds_page_pool *p);
/* Refs/unrefs of a page that was not held (refcount 0) or not in the pool: caller bugs, ignored
 * so that the free list stays sound, and counted here so tests can assert there were none. */
uint64_t ds_page_n_bad(const ds_page_pool *p);

#endif
