/* Regression tests for engine bugs found by the sanitizer run (make test-asan) and the soak.
 *
 * 1. eng_abort_request() (src/engine/request.c) read the request after finishing its last open
 * choice, which frees it (heap-use-after-free on every abort: client disconnects, shutdown). Aborts
 * of requests with one and with several choices, queued and running, must give each choice exactly
 * one final "abort" event and leave the pools empty; under ASan a stray read fails the test.
 * 2. eng_take_inbox() passed e->aborts (NULL before the first abort) to memcpy with a zero length,
 *    which is undefined behaviour (UBSan: "null pointer passed as argument 2"): any request at
 *    all runs that path, so every test here covers it. */
#include "engine_harness.h"

#include <unistd.h>

static ds_engine *start_engine(void) {
    ds_engine_opts o;
    ds_engine_opts_default(&o);
    o.model_dir = h_model_dir();
    o.max_num_seqs = 4;
    o.max_num_batched_tokens = 64;
    o.kv_cache_memory = 8u << 20;
    return h_start(&o);
}

static int64_t submit(ds_engine *e, int n_prompt, int n_choices, int max_tokens, h_req *f) {
    int32_t prompt[64];
    for (int i = 0; i < n_prompt; i++) prompt[i] = (int32_t)(7 + 13 * i) % 700;
    ds_request_spec spec = {0};
    spec.prompt = prompt;
    spec.n_prompt = n_prompt;
    ds_request_params_default(&spec.params);
    spec.params.n = n_choices;
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = 1;
    return h_submit_spec(e, &spec, f);
}

/* Every choice of every aborted request ends exactly once, with "abort" unless it had already
 * finished by length. */
static void test_abort_multi_choice(void **state) {
    (void)state;
    ds_engine *e = start_engine();
    enum { N = 8 };
    h_req f[N];
    int64_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = submit(e, 10 + 5 * i, 1 + i % 3, 200, &f[i]);
    /* some at once (still queued), the rest once they run */
    for (int i = 0; i < N; i += 2) ds_engine_abort(e, ids[i]);
    usleep(50000);
    for (int i = 1; i < N; i += 2) ds_engine_abort(e, ids[i]);
    ds_engine_abort(e, ids[0]); /* twice: the second is an unknown id by now */
    for (int i = 0; i < N; i++) {
        h_wait(&f[i]);
        for (int c = 0; c < f[i].n_choices; c++) {
            assert_int_equal(f[i].n_finals[c], 1);
            assert_true(f[i].why[c] == DS_FINISH_ABORT ||
                        (f[i].why[c] == DS_FINISH_LENGTH && f[i].n_seen[c] == 200));
        }
    }
    ds_engine_stats st;
    ds_engine_get_stats(e, &st);
    assert_true(st.finished[DS_FINISH_ABORT] >= N); /* at least one choice of each */
    h_assert_no_sequences(e);
    ds_engine_stop(e, 1.0);
    ds_engine_free(e);
}

/* Shutdown without grace aborts every live request (abort_request in a loop over e->live). */
static void test_stop_aborts_live(void **state) {
    (void)state;
    ds_engine *e = start_engine();
    h_req f[3];
    for (int i = 0; i < 3; i++) submit(e, 20, 3 - i, 400, &f[i]);
    usleep(20000);
    ds_engine_stop(e, 0.0);
    for (int i = 0; i < 3; i++) {
        h_wait(&f[i]);
        for (int c = 0; c < f[i].n_choices; c++) {
            assert_int_equal(f[i].n_finals[c], 1);
            assert_int_equal(f[i].why[c], DS_FINISH_ABORT);
        }
    }
    ds_engine_free(e);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_abort_multi_choice),
        cmocka_unit_test(test_stop_aborts_live),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
