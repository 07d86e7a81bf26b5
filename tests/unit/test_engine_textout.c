/* test_engine_textout.c — stop strings across token boundaries, hold-back and release, UTF-8
 * repair, flush; every expected delta written by hand. */
#include "testutil.h"

#include "engine/textout.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FFFD "\xEF\xBF\xBD"

static void init(ds_textout *t, char *const *stops, int n) {
    ds_err err = {{0}};
    if (ds_textout_init(t, stops, n, &err) != DS_OK) fail_msg("%s", err.msg);
}

/* Pushes one token and checks the delta and the stopped flag. */
static void push(ds_textout *t, const char *bytes, const char *want, int want_stopped) {
    const char *d = NULL;
    size_t n = 99;
    int stopped = -1;
    assert_int_equal(ds_textout_push(t, bytes, strlen(bytes), &d, &n, &stopped), DS_OK);
    if (n != strlen(want) || memcmp(d, want, n))
        fail_msg("after \"%s\": delta \"%.*s\", want \"%s\"", bytes, (int)n, d, want);
    assert_int_equal(stopped, want_stopped);
}

static void flush(ds_textout *t, const char *want) {
    const char *d = NULL;
    size_t n = 99;
    assert_int_equal(ds_textout_flush(t, &d, &n), 0);
    if (n != strlen(want) || memcmp(d, want, n))
        fail_msg("flush: \"%.*s\", want \"%s\"", (int)n, d, want);
}

static void test_no_stops(void **state) {
    (void)state;
    ds_textout t;
    init(&t, NULL, 0);
    push(&t, "Hello", "Hello", 0);
    push(&t, ", world", ", world", 0);
    push(&t, "", "", 0);
    flush(&t, "");
    ds_textout_free(&t);
}

static void test_stop_across_tokens(void **state) {
    (void)state;
    char *stops[] = {"world"};
    ds_textout t;
    init(&t, stops, 1);
    /* Two tokens: "wor" waits, then "ld" completes; the text after it is dropped. */
    push(&t, "hello wor", "hello ", 0);
    push(&t, "ld! more", "", 1);
    push(&t, "again", "", 1); /* nothing after a stop */
    flush(&t, "");
    ds_textout_free(&t);

    /* Three tokens, with text before the stop in the last one's neighbour. */
    char *end[] = {"<END>"};
    init(&t, end, 1);
    push(&t, "ab<E", "ab", 0);
    push(&t, "N", "", 0);
    push(&t, "D>cd", "", 1);
    ds_textout_free(&t);

    /* The stop string inside one token: the part before it comes out. */
    init(&t, end, 1);
    push(&t, "x", "x", 0);
    push(&t, "yz<END>tail", "yz", 1);
    ds_textout_free(&t);
}

static void test_stop_prefix_of_another(void **state) {
    (void)state;
    /* "ab" completes first whichever order they are given in, and however the text is cut. */
    char *a[] = {"abc", "ab"}, *b[] = {"ab", "abc"};
    for (int order = 0; order < 2; order++) {
        ds_textout t;
        init(&t, order ? b : a, 2);
        push(&t, "xa", "x", 0);
        push(&t, "bc", "", 1);
        ds_textout_free(&t);
        init(&t, order ? b : a, 2);
        push(&t, "xabcy", "x", 1);
        ds_textout_free(&t);
    }
    /* "bc" ends before "abcd" does: the text keeps "a", in one token or in four. */
    char *c[] = {"abcd", "bc"};
    ds_textout t;
    init(&t, c, 2);
    push(&t, "abcd", "a", 1);
    ds_textout_free(&t);
    init(&t, c, 2);
    push(&t, "a", "", 0);
    push(&t, "b", "", 0);
    push(&t, "c", "a", 1);
    ds_textout_free(&t);
    /* At an equal end the longer one wins: "xab" and "ab" both end at b. */
    char *d[] = {"ab", "xab"};
    init(&t, d, 2);
    push(&t, "1x", "1", 0);
    push(&t, "ab", "", 1);
    ds_textout_free(&t);
}

static void test_release_on_mismatch(void **state) {
    (void)state;
    char *stops[] = {"STOP"};
    ds_textout t;
    init(&t, stops, 1);
    push(&t, "ST", "", 0);
    push(&t, "AR", "STAR", 0); /* "STA" is no longer a start of "STOP" */
    push(&t, "S", "", 0);
    flush(&t, "S"); /* at finish the held text is final */
    ds_textout_free(&t);

    /* A partial match that falls back to a shorter one: "aa" + "a" still ends in "aa". */
    char *aab[] = {"aab"};
    init(&t, aab, 1);
    push(&t, "aa", "", 0);
    push(&t, "a", "a", 0);
    push(&t, "c", "aac", 0);
    push(&t, "aaa", "a", 0);
    push(&t, "b!", "", 1);
    ds_textout_free(&t);

    /* Empty stop strings are ignored. */
    char *empty[] = {"", "q"};
    init(&t, empty, 2);
    push(&t, "ab", "ab", 0);
    push(&t, "cq", "c", 1);
    ds_textout_free(&t);
}

static void test_utf8_split(void **state) {
    (void)state;
    ds_textout t;
    init(&t, NULL, 0);
    /* U+1F600 in four single-byte tokens, then "é" (C3 A9) in two. */
    push(&t, "a\xF0", "a", 0);
    push(&t, "\x9F", "", 0);
    push(&t, "\x98", "", 0);
    push(&t, "\x80", "\xF0\x9F\x98\x80", 0);
    push(&t, "\xC3", "", 0);
    push(&t, "\xA9z", "\xC3\xA9z", 0);
    ds_textout_free(&t);

    /* A stop string with a multi-byte character matches across the split. */
    char *stops[] = {"\xC3\xA9!"};
    init(&t, stops, 1);
    push(&t, "caf\xC3", "caf", 0);
    push(&t, "\xA9", "", 0);
    push(&t, "!", "", 1);
    ds_textout_free(&t);
}

static void test_invalid_bytes(void **state) {
    (void)state;
    ds_textout t;
    init(&t, NULL, 0);
    push(&t,
         "a\xFF"
         "b",
         "a" FFFD "b", 0);
    /* A truncated 3-byte sequence is one U+FFFD, then the byte that broke it counts anew. */
    push(&t, "\xE2\x82", "", 0);
    push(&t, "x", FFFD "x", 0);
    push(&t, "\xE2\x82\xC3\xA9", FFFD "\xC3\xA9", 0);
    /* Overlong (C0 AF), surrogate (ED A0 80), stray continuation, past U+10FFFF (F4 90). */
    push(&t, "\xC0\xAF", FFFD FFFD, 0);
    push(&t, "\xED\xA0\x80", FFFD FFFD FFFD, 0);
    push(&t, "\x80", FFFD, 0);
    push(&t, "\xF4\x90\x80\x80", FFFD FFFD FFFD FFFD, 0);
    /* Overlong 3- and 4-byte forms (E0 80..9F, F0 80..8F). */
    push(&t, "\xE0\x9F\xBF", FFFD FFFD FFFD, 0);
    push(&t, "\xF0\x8F\xBF\xBF", FFFD FFFD FFFD FFFD, 0);
    /* The largest valid code points of each length pass unchanged. */
    push(&t, "\x7F\xDF\xBF\xEF\xBF\xBF\xF4\x8F\xBF\xBF", "\x7F\xDF\xBF\xEF\xBF\xBF\xF4\x8F\xBF\xBF",
         0);
    ds_textout_free(&t);

    /* Invalid bytes in a stop string are repaired the same way, so it still matches. */
    char *stops[] = {"x\xFFy"};
    init(&t, stops, 1);
    push(&t, "1x", "1", 0);
    push(&t, "\xFF", "", 0);
    push(&t, "y2", "", 1);
    ds_textout_free(&t);
}

static void test_flush(void **state) {
    (void)state;
    char *stops[] = {"c!"};
    ds_textout t;
    init(&t, stops, 1);
    /* "c" might start "c!" and E2 82 is an unfinished character: both wait for flush. */
    push(&t, "abc\xE2\x82", "ab", 0);
    flush(&t, "c" FFFD);
    ds_textout_free(&t);

    /* A flushed U+FFFD can itself complete a stop string; the flush then says so. */
    char *rep[] = {"z" FFFD};
    init(&t, rep, 1);
    push(&t, "az\xE2", "a", 0);
    const char *d;
    size_t n;
    assert_int_equal(ds_textout_flush(&t, &d, &n), 1);
    assert_int_equal(n, 0);
    ds_textout_free(&t);
}

/* Long text through many stop strings: output equals the input cut at the first stop string
 * completed, whatever the token sizes. */
static void test_cuts_agree(void **state) {
    (void)state;
    char *stops[] = {"needle", "haystack!", "dle,"};
    static const char text[] = "the nee-dle in the haystack is a needle, said nobody";
    size_t cut = (size_t)(strstr(text, "needle") - text); /* it ends before "dle," does */
    for (size_t tok = 1; tok <= 7; tok++) {
        ds_textout t;
        init(&t, stops, 3);
        char out[128];
        size_t len = 0;
        int stopped = 0;
        for (size_t i = 0; i < sizeof text - 1 && !stopped; i += tok) {
            const char *d;
            size_t n;
            size_t k = DS_MIN(tok, sizeof text - 1 - i);
            assert_int_equal(ds_textout_push(&t, text + i, k, &d, &n, &stopped), DS_OK);
            memcpy(out + len, d, n);
            len += n;
        }
        assert_true(stopped);
        assert_int_equal(len, cut);
        assert_memory_equal(out, text, len);
        ds_textout_free(&t);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_stops),
        cmocka_unit_test(test_stop_across_tokens),
        cmocka_unit_test(test_stop_prefix_of_another),
        cmocka_unit_test(test_release_on_mismatch),
        cmocka_unit_test(test_utf8_split),
        cmocka_unit_test(test_invalid_bytes),
        cmocka_unit_test(test_flush),
        cmocka_unit_test(test_cuts_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
