/* test_cache_pools.c — the MLA page pool and the KDA slot pool: allocation order, exhaustion,
 * refcounted sharing, guarded misuse, slot zeroing and alignment. */
#include "testutil.h"

#include "cache/pages.h"
#include "cache/state.h"

#include <stdint.h>
#include <stdlib.h>

static void test_pages_alloc_exhaust_reuse(void **st) {
    (void)st;
    ds_err err;
    ds_page_pool *p;
    assert_int_equal(ds_page_pool_create(5, &p, &err), DS_OK);
    assert_int_equal(ds_page_n_total(p), 5);
    assert_int_equal(ds_page_n_free(p), 5);
    int seen[5] = {0};
    for (int i = 0; i < 5; i++) {
        int pg = ds_page_alloc(p);
        assert_int_equal(pg, i); /* a fresh pool hands out ids in order */
        assert_int_equal(ds_page_refcount(p, pg), 1);
        seen[pg]++;
        assert_int_equal(ds_page_n_free(p), 4 - i);
    }
    for (int i = 0; i < 5; i++) assert_int_equal(seen[i], 1);
    assert_int_equal(ds_page_alloc(p), -1);
    assert_int_equal(ds_page_alloc(p), -1); /* still -1, the count did not go negative */
    assert_int_equal(ds_page_n_free(p), 0);

    /* Freed pages come back last-in first-out. */
    ds_page_unref(p, 3);
    ds_page_unref(p, 1);
    assert_int_equal(ds_page_refcount(p, 3), 0);
    assert_int_equal(ds_page_n_free(p), 2);
    assert_int_equal(ds_page_alloc(p), 1);
    assert_int_equal(ds_page_alloc(p), 3);
    assert_int_equal(ds_page_alloc(p), -1);
    assert_int_equal(ds_page_n_bad(p), 0);
    ds_page_pool_free(p);
}

static void test_pages_sharing(void **st) {
    (void)st;
    ds_err err;
    ds_page_pool *p;
    assert_int_equal(ds_page_pool_create(3, &p, &err), DS_OK);
    int a = ds_page_alloc(p);
    ds_page_ref(p, a);
    ds_page_ref(p, a);
    assert_int_equal(ds_page_refcount(p, a), 3);
    ds_page_unref(p, a);
    ds_page_unref(p, a);
    /* One holder is left: the page must not be free yet. */
    assert_int_equal(ds_page_refcount(p, a), 1);
    assert_int_equal(ds_page_n_free(p), 2);
    ds_page_unref(p, a);
    assert_int_equal(ds_page_n_free(p), 3);
    assert_int_equal(ds_page_n_bad(p), 0);
    ds_page_pool_free(p);
}

static void test_pages_misuse_guarded(void **st) {
    (void)st;
    ds_err err;
    ds_page_pool *p;
    assert_int_equal(ds_page_pool_create(2, &p, &err), DS_OK);
    int a = ds_page_alloc(p);
    ds_page_unref(p, a);
    ds_page_unref(p, a); /* double free: must not push the page twice */
    ds_page_ref(p, a);   /* reviving a free page */
    ds_page_unref(p, 7); /* out of range */
    ds_page_unref(p, -1);
    assert_int_equal(ds_page_n_bad(p), 4);
    assert_int_equal(ds_page_n_free(p), 2);
    assert_int_equal(ds_page_refcount(p, a), 0);
    /* Had the double free gone through, the same page would come out twice here. */
    int x = ds_page_alloc(p), y = ds_page_alloc(p);
    assert_true(x >= 0 && y >= 0 && x != y);
    assert_int_equal(ds_page_alloc(p), -1);
    ds_page_pool_free(p);

    assert_int_equal(ds_page_pool_create(0, &p, &err), DS_ERR);
    assert_null(p);
    assert_true(strlen(err.msg) > 0);
}

static void test_slots(void **st) {
    (void)st;
    ds_err err;
    ds_slot_pool *p;
    const size_t F = 37; /* not a multiple of 16: slots must still start on 64-byte lines */
    assert_int_equal(ds_slot_pool_create(3, F, &p, &err), DS_OK);
    assert_int_equal(ds_slot_n_total(p), 3);
    assert_int_equal(ds_slot_floats(p), F);
    int s[3];
    for (int i = 0; i < 3; i++) {
        s[i] = ds_slot_alloc(p);
        assert_int_equal(s[i], i);
        float *d = ds_slot_data(p, s[i]);
        assert_int_equal((uintptr_t)d % 64, 0);
        for (size_t k = 0; k < F; k++) assert_true(d[k] == 0.0f);
        for (size_t k = 0; k < F; k++) d[k] = (float)(i * 100 + (int)k + 1);
    }
    assert_int_equal(ds_slot_alloc(p), -1);
    assert_int_equal(ds_slot_n_free(p), 0);
    /* Writing every slot in full must not have spilled into a neighbour. */
    for (int i = 0; i < 3; i++) {
        float *d = ds_slot_data(p, s[i]);
        assert_true(d[0] == (float)(i * 100 + 1) && d[F - 1] == (float)(i * 100 + (int)F));
    }
    /* A reused slot comes back zeroed, its neighbours untouched. */
    ds_slot_release(p, s[1]);
    assert_int_equal(ds_slot_n_free(p), 1);
    int r = ds_slot_alloc(p);
    assert_int_equal(r, s[1]);
    float *d = ds_slot_data(p, r);
    for (size_t k = 0; k < F; k++) assert_true(d[k] == 0.0f);
    assert_true(ds_slot_data(p, s[2])[0] == 201.0f);

    ds_slot_release(p, r);
    ds_slot_release(p, r);  /* double release */
    ds_slot_release(p, 99); /* out of range */
    assert_int_equal(ds_slot_n_bad(p), 2);
    assert_int_equal(ds_slot_n_free(p), 1);
    ds_slot_release(p, s[0]);
    ds_slot_release(p, s[2]);
    assert_int_equal(ds_slot_n_free(p), 3);
    int x = ds_slot_alloc(p), y = ds_slot_alloc(p), z = ds_slot_alloc(p);
    assert_true(x != y && y != z && x != z);
    assert_int_equal(ds_slot_alloc(p), -1);
    ds_slot_pool_free(p);

    assert_int_equal(ds_slot_pool_create(0, 8, &p, &err), DS_ERR);
    assert_null(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pages_alloc_exhaust_reuse),
        cmocka_unit_test(test_pages_sharing),
        cmocka_unit_test(test_pages_misuse_guarded),
        cmocka_unit_test(test_slots),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
