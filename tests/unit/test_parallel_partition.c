/* The rules a distributed job is laid out by: the pipeline layer partition (even, remainder to
 * the middle stages, or --pp-layer-partition), the AttnRes blocks crossing a boundary, the MLA
 * head padding per TP rank, and the start-up refusal of a TP size that does not divide. */
#include "parallel/pipeline.h"
#include "parallel/tp.h"
#include "devtools/init_model.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void expect_counts(int L, int P, const char *spec, const int *want) {
    int got[16];
    ds_err err = {{0}};
    if (ds_pp_partition(L, P, spec, got, &err)) fail_msg("%d over %d: %s", L, P, err.msg);
    assert_memory_equal(got, want, (size_t)P * sizeof(int));
}

static void test_even_partition(void **state) {
    (void)state;
    expect_counts(10, 4, NULL, (const int[]){2, 3, 3, 2});
    expect_counts(10, 2, "", (const int[]){5, 5});
    expect_counts(10, 3, NULL, (const int[]){3, 4, 3});
    expect_counts(8, 3, NULL,
                  (const int[]){3, 3, 2}); /* uncentred: the first stage, not the last */
    expect_counts(11, 4, NULL, (const int[]){3, 3, 3, 2});
    expect_counts(9, 4, NULL, (const int[]){2, 3, 2, 2});
    expect_counts(8, 8, NULL, (const int[]){1, 1, 1, 1, 1, 1, 1, 1});
    expect_counts(93, 8, NULL, (const int[]){11, 12, 12, 12, 12, 12, 11, 11});
    expect_counts(7, 1, NULL, (const int[]){7});
    int c[16], b, e;
    ds_err err = {{0}};
    assert_int_equal(ds_pp_partition(3, 4, NULL, c, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "4 stages for 3 layers"));
    ds_pp_partition(10, 4, NULL, c, &err);
    ds_pp_stage_range(c, 0, &b, &e);
    assert_true(b == 0 && e == 2);
    ds_pp_stage_range(c, 2, &b, &e);
    assert_true(b == 5 && e == 8);
    ds_pp_stage_range(c, 3, &b, &e);
    assert_true(b == 8 && e == 10);
}

static void test_given_partition(void **state) {
    (void)state;
    expect_counts(10, 4, "2,3,3,2", (const int[]){2, 3, 3, 2});
    expect_counts(10, 4, "1,1,1,7", (const int[]){1, 1, 1, 7});
    int c[16];
    ds_err err = {{0}};
    assert_int_equal(ds_pp_partition(10, 4, "1,2,3", c, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "3 entries for -pp 4"));
    assert_int_equal(ds_pp_partition(10, 4, "5,5,1,1", c, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "sums to 12 layers, the model has 10"));
    assert_int_equal(ds_pp_partition(10, 2, "5,x", c, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "bad entry at 'x'"));
    assert_int_equal(ds_pp_partition(10, 2, "0,10", c, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "bad entry at '0,10'"));
    assert_int_equal(ds_pp_partition(10, 2, "5,4,1", c, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "more than the 2 stages"));
}

static void test_banks_before(void **state) {
    (void)state;
    /* N = 3: banks at layers 0, 3, 6, 9 (docs/model.md §6.3); a boundary before layer i carries the
     * blocks banked by layers < i. */
    assert_int_equal(ds_pp_banks_before(3, 1), 1);
    assert_int_equal(ds_pp_banks_before(3, 3), 1);
    assert_int_equal(ds_pp_banks_before(3, 4), 2);
    assert_int_equal(ds_pp_banks_before(3, 7), 3);
    assert_int_equal(ds_pp_banks_before(3, 9), 3);
    assert_int_equal(ds_pp_banks_before(12, 13), 2); /* K3 */
    assert_int_equal(ds_pp_banks_before(0, 5), 0);   /* AttnRes off */
}

static void test_mla_padding(void **state) {
    (void)state;
    static const int cases[][2] = {{24, 32},   {12, 16},   {16, 16}, {32, 32}, {64, 64},
                                   {128, 128}, {1, 16},    {17, 32}, {48, 64}, {96, 128},
                                   {130, 256}, {256, 256}, {0, 0}};
    for (size_t i = 0; i < DS_ARRAY_LEN(cases); i++)
        if (ds_tp_mla_padded_heads(cases[i][0]) != cases[i][1])
            fail_msg("%d heads per rank: padded to %d, want %d", cases[i][0],
                     ds_tp_mla_padded_heads(cases[i][0]), cases[i][1]);
    /* K3: 96 MLA heads over T = 4 and 8 ranks. */
    assert_int_equal(ds_tp_mla_padded_heads(96 / 4), 32);
    assert_int_equal(ds_tp_mla_padded_heads(96 / 8), 16);
}

static void test_tp_check_dir(void **state) {
    (void)state;
    char *tmp = ds_test_tmpdir();
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/lin", tmp);
    ds_err err = {{0}};
    if (ds_init_model("tiny-linear", dir, 0, &err)) fail_msg("%s", err.msg);
    assert_int_equal(ds_tp_check_dir(dir, 2, &err), DS_OK);
    assert_int_equal(ds_tp_check_dir(dir, 4, &err), DS_OK);
    assert_int_equal(ds_tp_check_dir(dir, 8, &err), DS_ERR);
    assert_non_null(strstr(err.msg,
                           "tensor parallel size 8 does not divide the model's 4 KDA heads; "
                           "4 MLA heads"));
    assert_null(strstr(err.msg, "experts")); /* 8 experts divide by 8 */
    free(tmp);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_even_partition), cmocka_unit_test(test_given_partition),
        cmocka_unit_test(test_banks_before),   cmocka_unit_test(test_mla_padding),
        cmocka_unit_test(test_tp_check_dir),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
