/* Regression tests for engine bugs found by the sanitizer run (make test-asan) and the soak.
 *
 * 1. abort_request() read the request after finishing its last open choice, which frees it
 *    (heap-use-after-free on every abort: client disconnects, shutdown). Aborts of requests with
 *    one and with several choices, queued and running, must give each choice exactly one final
 *    "abort" event and leave the pools empty; under ASan a stray read fails the test.
 * 2. take_inbox() passed e->aborts (NULL before the first abort) to memcpy with a zero length,
 *    which is undefined behaviour (UBSan: "null pointer passed as argument 2"): any request at
 *    all runs that path, so every test here covers it. */
#include "engine/engine.h"
#include "devtools/init_model.h"
#include "testutil.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *g_model;

static const char *model_dir(void) {
    if (!g_model) {
        char *tmp = ds_test_tmpdir();
        g_model = malloc(strlen(tmp) + 16);
        sprintf(g_model, "%s/tiny-k3", tmp);
        free(tmp);
        ds_err err = {{0}};
        if (ds_init_model("tiny-k3", g_model, 0, &err)) fail_msg("%s", err.msg);
    }
    return g_model;
}

/* Final events of one request, per choice. */
typedef struct finals {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_choices, n_final;
    int count[4];     /* [choice] final events seen */
    ds_finish why[4]; /* [choice] */
    int n_tokens[4];  /* [choice] tokens seen */
} finals;

static void on_event(void *user, const ds_token_event *ev) {
    finals *f = user;
    pthread_mutex_lock(&f->mu);
    if (ev->token >= 0) f->n_tokens[ev->index]++;
    if (ev->finish != DS_FINISH_NONE) {
        f->count[ev->index]++;
        f->why[ev->index] = ev->finish;
        f->n_final++;
        pthread_cond_broadcast(&f->cv);
    }
    pthread_mutex_unlock(&f->mu);
}

static void wait_final(finals *f) {
    pthread_mutex_lock(&f->mu);
    while (f->n_final < f->n_choices) pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
}

static ds_engine *start_engine(void) {
    ds_engine_opts o;
    ds_engine_opts_default(&o);
    o.model_dir = model_dir();
    o.max_num_seqs = 4;
    o.max_num_batched_tokens = 64;
    o.kv_cache_memory = 8u << 20;
    ds_engine *e;
    ds_err err = {{0}};
    if (ds_engine_create(&o, &e, &err)) fail_msg("%s", err.msg);
    if (ds_engine_start(e, &err)) fail_msg("%s", err.msg);
    return e;
}

static int64_t submit(ds_engine *e, int n_prompt, int n_choices, int max_tokens, finals *f) {
    int32_t prompt[64];
    for (int i = 0; i < n_prompt; i++) prompt[i] = (int32_t)(7 + 13 * i) % 700;
    ds_request_spec spec = {0};
    spec.prompt = prompt;
    spec.n_prompt = n_prompt;
    ds_request_params_default(&spec.params);
    spec.params.n = n_choices;
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = 1;
    spec.on_event = on_event;
    spec.user = f;
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->n_choices = n_choices;
    int why;
    ds_err err = {{0}};
    int64_t id = ds_engine_submit(e, &spec, &why, &err);
    if (id <= 0) fail_msg("submit: %s", err.msg);
    return id;
}

static void assert_pools_empty(ds_engine *e) {
    ds_engine_stats s;
    for (int i = 0; i < 300; i++) { /* stats are updated after the engine's step */
        ds_engine_get_stats(e, &s);
        if (!s.slots_used && !s.running && !s.waiting) break;
        usleep(10000);
    }
    assert_int_equal(s.slots_used, 0);
    assert_int_equal(s.running, 0);
    assert_int_equal(s.waiting, 0);
}

/* Every choice of every aborted request ends exactly once, with "abort" unless it had already
 * finished by length. */
static void test_abort_multi_choice(void **state) {
    (void)state;
    ds_engine *e = start_engine();
    enum { N = 8 };
    finals f[N];
    int64_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = submit(e, 10 + 5 * i, 1 + i % 3, 200, &f[i]);
    /* some at once (still queued), the rest once they run */
    for (int i = 0; i < N; i += 2) ds_engine_abort(e, ids[i]);
    usleep(50000);
    for (int i = 1; i < N; i += 2) ds_engine_abort(e, ids[i]);
    ds_engine_abort(e, ids[0]); /* twice: the second is an unknown id by now */
    for (int i = 0; i < N; i++) {
        wait_final(&f[i]);
        for (int c = 0; c < f[i].n_choices; c++) {
            assert_int_equal(f[i].count[c], 1);
            assert_true(f[i].why[c] == DS_FINISH_ABORT ||
                        (f[i].why[c] == DS_FINISH_LENGTH && f[i].n_tokens[c] == 200));
        }
    }
    ds_engine_stats st;
    ds_engine_get_stats(e, &st);
    assert_true(st.finished[DS_FINISH_ABORT] >= N); /* at least one choice of each */
    assert_pools_empty(e);
    ds_engine_stop(e, 1.0);
    ds_engine_free(e);
}

/* Shutdown without grace aborts every live request (abort_request in a loop over e->live). */
static void test_stop_aborts_live(void **state) {
    (void)state;
    ds_engine *e = start_engine();
    finals f[3];
    for (int i = 0; i < 3; i++) submit(e, 20, 3 - i, 400, &f[i]);
    usleep(20000);
    ds_engine_stop(e, 0.0);
    for (int i = 0; i < 3; i++) {
        wait_final(&f[i]);
        for (int c = 0; c < f[i].n_choices; c++) {
            assert_int_equal(f[i].count[c], 1);
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
