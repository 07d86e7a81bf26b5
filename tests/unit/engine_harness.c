/* engine_harness.c — whole engines on a tiny model for the engine's tests (engine_harness.h). */
#include "engine_harness.h"

#include "devtools/init_model.h"
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *g_model;

const char *h_model_dir(void) {
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

size_t h_slot_bytes(void) {
    ds_model *m;
    ds_err err = {{0}};
    if (ds_model_load(h_model_dir(), NULL, &m, &err)) fail_msg("%s", err.msg);
    size_t n = ds_model_slot_floats(m) * sizeof(float);
    ds_model_free(m);
    return n;
}

void h_req_init(h_req *c, int n_choices) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    c->n_choices = n_choices;
}

void h_on_event(void *user, const ds_token_event *ev) {
    h_req *c = user;
    int i = ev->index;
    pthread_mutex_lock(&c->mu);
    if (ev->token >= 0) {
        c->n_seen[i]++;
        if (c->n[i] < H_MAX_GEN) {
            c->tokens[i][c->n[i]] = ev->token;
            c->logprobs[i][c->n[i]++] = ev->logprob;
        }
    }
    if (ev->text_len && c->text_len[i] + ev->text_len < sizeof c->text[0]) {
        memcpy(c->text[i] + c->text_len[i], ev->text, ev->text_len);
        c->text_len[i] += ev->text_len;
    }
    if (ev->finish != DS_FINISH_NONE) {
        c->n_finals[i]++;
        c->why[i] = ev->finish;
        c->n_final++;
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
}

void h_wait(h_req *c) {
    pthread_mutex_lock(&c->mu);
    while (c->n_final < c->n_choices) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

ds_engine *h_start(const ds_engine_opts *o) {
    ds_engine *e;
    ds_err err = {{0}};
    if (ds_engine_create(o, &e, &err)) fail_msg("%s", err.msg);
    if (ds_engine_start(e, &err)) fail_msg("%s", err.msg);
    return e;
}

void h_stop(ds_engine *e) {
    ds_engine_stop(e, 1.0);
    ds_engine_free(e);
}

int64_t h_submit_spec(ds_engine *e, ds_request_spec *spec, h_req *c) {
    spec->on_event = h_on_event;
    spec->user = c;
    h_req_init(c, spec->params.n);
    int why;
    ds_err err = {{0}};
    int64_t id = ds_engine_submit(e, spec, &why, &err);
    if (id <= 0) fail_msg("submit: %s", err.msg);
    return id;
}

int h_kv_dtype;

void h_opts(ds_engine_opts *o, int prefix_on, size_t kv_mem) {
    ds_engine_opts_default(o);
    o->model_dir = h_model_dir();
    o->block_size = 16;
    o->max_num_seqs = 8;
    o->max_num_batched_tokens = 64;
    o->kv_cache_memory = kv_mem;
    o->max_model_len = 0; /* the most the model and the cache allow */
    o->enable_prefix_caching = prefix_on;
    o->state_checkpoint_interval_tokens = 48;
    o->kv_dtype = h_kv_dtype;
}

/* A greedy request's spec (eos ignored); logprobs -1: none, >= 0: wanted. */
static ds_request_spec greedy_spec(const int32_t *prompt, int n, int max_tokens, int logprobs) {
    ds_request_spec spec = {0};
    spec.prompt = prompt;
    spec.n_prompt = n;
    ds_request_params_default(&spec.params);
    spec.params.sample.temperature = 0.0f;
    spec.params.max_tokens = max_tokens;
    spec.params.ignore_eos = 1;
    spec.params.logprobs = logprobs;
    return spec;
}

void h_submit(ds_engine *e, const int32_t *prompt, int n, int max_tokens, h_req *c) {
    ds_request_spec spec = greedy_spec(prompt, n, max_tokens, -1);
    h_submit_spec(e, &spec, c);
}

void h_run(ds_engine *e, const int32_t *prompt, int n, int max_tokens, int32_t *out) {
    h_req *c = malloc(sizeof *c);
    h_submit(e, prompt, n, max_tokens, c);
    h_wait(c);
    assert_int_equal(c->why[0], DS_FINISH_LENGTH);
    assert_int_equal(c->n[0], max_tokens);
    memcpy(out, c->tokens[0], (size_t)max_tokens * sizeof(int32_t));
    free(c);
}

void h_run_lp(ds_engine *e, const int32_t *prompt, int n, int gen, int32_t *tok, float *lp) {
    h_req *c = malloc(sizeof *c);
    ds_request_spec spec = greedy_spec(prompt, n, gen, 0);
    h_submit_spec(e, &spec, c);
    h_wait(c);
    assert_int_equal(c->n[0], gen);
    memcpy(tok, c->tokens[0], (size_t)gen * sizeof *tok);
    memcpy(lp, c->logprobs[0], (size_t)gen * sizeof *lp);
    free(c);
}

void h_prompt(int32_t *ids, int n, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(ds_rng_next(&r) % 700);
}

static void assert_idle(ds_engine *e, int pages) {
    ds_engine_stats s;
    for (int i = 0; i < 300; i++) { /* the engine thread updates stats after its step */
        ds_engine_get_stats(e, &s);
        if ((!pages || !s.pages_used) && !s.slots_used && !s.running && !s.waiting) break;
        usleep(10000);
    }
    if (pages) assert_int_equal(s.pages_used, 0);
    assert_int_equal(s.slots_used, 0);
    assert_int_equal(s.running, 0);
    assert_int_equal(s.waiting, 0);
}

void h_assert_no_sequences(ds_engine *e) {
    assert_idle(e, 0);
}

void h_assert_idle(ds_engine *e) {
    assert_idle(e, 1);
}

ds_engine_stats h_stats(ds_engine *e) {
    h_assert_idle(e);
    ds_engine_stats s;
    ds_engine_get_stats(e, &s);
    return s;
}
