/* test_engine_prefix_harness.h — shared by test_engine_prefix.c and test_engine_offload.c: a tiny
 * model, engines with prefix caching on or off, greedy requests, and cold references (the same
 * prompt on an engine with prefix caching off). Header-only (static functions): these helpers
 * need ds_engine, which not every test links. */
#ifndef DS_TEST_ENGINE_PREFIX_HARNESS_H
#define DS_TEST_ENGINE_PREFIX_HARNESS_H

#include "engine/engine.h"
#include "devtools/init_model.h"
#include "model/model.h"
#include "testutil.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define H_MAX_GEN 64

static char *g_model;

static const char *h_model_dir(void) {
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

/* Bytes of one KDA state slot of the tiny model (to size checkpoint pools in slots). */
static size_t h_slot_bytes(void) {
    ds_model *m;
    ds_err err = {{0}};
    if (ds_model_load(h_model_dir(), NULL, &m, &err)) fail_msg("%s", err.msg);
    size_t n = ds_model_slot_floats(m) * sizeof(float);
    ds_model_free(m);
    return n;
}

/* What one greedy request's callback collected. */
typedef struct h_req {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int32_t tokens[H_MAX_GEN];
    int n;
    int done;
    ds_finish why;
} h_req;

static void h_on_event(void *user, const ds_token_event *ev) {
    h_req *c = user;
    pthread_mutex_lock(&c->mu);
    if (ev->token >= 0 && c->n < H_MAX_GEN) c->tokens[c->n++] = ev->token;
    if (ev->finish != DS_FINISH_NONE) {
        c->done = 1;
        c->why = ev->finish;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

/* Engine options shared by the tests: block 16, chunk 64 (= max_num_batched_tokens), rungs every
 * 48 tokens. */
static void h_opts(ds_engine_opts *o, int prefix_on, size_t kv_mem) {
    ds_engine_opts_default(o);
    o->model_dir = h_model_dir();
    o->block_size = 16;
    o->max_num_seqs = 8;
    o->max_num_batched_tokens = 64;
    o->kv_cache_memory = kv_mem;
    o->max_model_len = 512;
    o->enable_prefix_caching = prefix_on;
    o->state_checkpoint_interval_tokens = 48;
}

static ds_engine *h_start(const ds_engine_opts *o) {
    ds_engine *e;
    ds_err err = {{0}};
    if (ds_engine_create(o, &e, &err)) fail_msg("%s", err.msg);
    if (ds_engine_start(e, &err)) fail_msg("%s", err.msg);
    return e;
}

static void h_stop(ds_engine *e) {
    ds_engine_stop(e, 1.0);
    ds_engine_free(e);
}

static void h_submit(ds_engine *e, const int32_t *prompt, int n, int max_tokens, h_req *c) {
    ds_request_spec spec = {0};
    spec.prompt = prompt;
    spec.n_prompt = n;
    ds_request_params_default(&spec.params);
    spec.params.sample.temperature = 0.0f;
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = 1; /* every request runs its full length: more decode after forks */
    spec.on_event = h_on_event;
    spec.user = c;
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    int why;
    ds_err err = {{0}};
    if (ds_engine_submit(e, &spec, &why, &err) < 0) fail_msg("submit: %s", err.msg);
}

static void h_wait(h_req *c) {
    pthread_mutex_lock(&c->mu);
    while (!c->done) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

/* Runs one request to completion and returns its tokens in out [max_tokens]. */
static void h_run(ds_engine *e, const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    h_req c;
    h_submit(e, prompt, n, max_tokens, &c);
    h_wait(&c);
    assert_int_equal(c.why, DS_FINISH_LENGTH);
    assert_int_equal(c.n, max_tokens);
    memcpy(out, c.tokens, (size_t)max_tokens * sizeof(int32_t));
}

static void h_prompt(int32_t *ids, int n, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(ds_rng_next(&r) % 700);
}

/* Pages and slots all back (idle cached pages count as free), nothing running. */
static void h_assert_idle(ds_engine *e) {
    ds_engine_stats s;
    for (int i = 0; i < 200; i++) {
        ds_engine_get_stats(e, &s);
        if (!s.pages_used && !s.slots_used && !s.running && !s.waiting) break;
        usleep(10000);
    }
    assert_int_equal(s.pages_used, 0);
    assert_int_equal(s.slots_used, 0);
    assert_int_equal(s.running, 0);
    assert_int_equal(s.waiting, 0);
}

/* Stats once the engine is idle (it refreshes them right after each step). */
static ds_engine_stats h_stats(ds_engine *e) {
    h_assert_idle(e);
    ds_engine_stats s;
    ds_engine_get_stats(e, &s);
    return s;
}

#endif
