/* test_engine_grammar.c — constrained decoding through the whole engine (no HTTP) on the tiny
 * random-weight model: every output follows its grammar (sampled, several choices), and under
 * speculation drafts the grammar forbids are rejected at their row (none accepted, output
 * unchanged) while drafts equal to the plain output are accepted (same tokens, fewer forwards).
 * Skipped when llguidance cannot be loaded. */
#include "engine_harness.h"

#include "text/tokenizer.h"

#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char k_grammar[] = "start: /[a-c]{3,9}/ \" \" /[0-9]{1,4}/";

static int g_async; /* the masks beside the forward (what a GPU does), on the CPU */

static ds_engine *start(int method, int k, void *hook, void *ctx) {
    ds_engine_opts o;
    ds_engine_opts_default(&o);
    o.model_dir = h_model_dir();
    o.block_size = 16;
    o.max_num_seqs = 8;
    o.max_num_batched_tokens = 256;
    o.kv_cache_memory = 32u << 20;
    o.speculative_method = method;
    if (k) o.num_speculative_tokens = k;
    o.test.spec_drafts = hook;
    o.test.spec_ctx = ctx;
    o.test.async_masks = g_async;
    return h_start(&o);
}

/* Skips the test when the engine cannot do constrained decoding here. */
static int ready(ds_engine *e) {
    ds_err err = {{0}};
    if (ds_engine_grammar_ready(e, &err)) return 1;
    print_message("llguidance unavailable, skipped: %s\n", err.msg);
    return 0;
}

static void submit(ds_engine *e, const int32_t *prompt, int n, float t, int n_choices,
                   uint64_t seed, h_req *c) {
    ds_request_spec spec = {0};
    spec.prompt = prompt;
    spec.n_prompt = n;
    ds_request_params_default(&spec.params);
    spec.params.max_tokens = 64;
    spec.params.sample.temperature = t;
    spec.params.n = n_choices;
    spec.params.has_seed = 1;
    spec.params.seed = seed;
    spec.params.grammar = (char *)k_grammar;
    h_submit_spec(e, &spec, c);
}

/* Choice i's text matches the grammar in full and it ended on the grammar's eos. */
static void assert_follows(h_req *c, int i) {
    regex_t re;
    assert_int_equal(regcomp(&re, "^[a-c]{3,9} [0-9]{1,4}$", REG_EXTENDED | REG_NOSUB), 0);
    char text[H_MAX_TEXT + 1];
    memcpy(text, c->text[i], c->text_len[i]);
    text[c->text_len[i]] = 0;
    if (regexec(&re, text, 0, NULL, 0))
        fail_msg("choice %d: \"%s\" is outside the grammar", i, text);
    regfree(&re);
    assert_int_equal(c->why[i], DS_FINISH_STOP);
}

static void test_sampled_outputs_follow(void **state) {
    (void)state;
    ds_engine *e = start(DS_SPEC_NONE, 0, NULL, NULL);
    if (!ready(e)) {
        h_stop(e);
        skip();
    }
    int32_t prompt[20];
    h_prompt(prompt, 20, 3);
    h_req *cs = calloc(6, sizeof *cs);
    for (int r = 0; r < 6; r++) submit(e, prompt, 20, r ? 1.0f : 0.0f, r ? 3 : 1, 10 + r, &cs[r]);
    int distinct = 0;
    char first[H_MAX_TEXT] = "";
    for (int r = 0; r < 6; r++) {
        h_wait(&cs[r]);
        for (int i = 0; i < cs[r].n_choices; i++) {
            assert_follows(&cs[r], i);
            if (!first[0]) memcpy(first, cs[r].text[i], cs[r].text_len[i]);
            distinct += strncmp(first, cs[r].text[i], cs[r].text_len[i]) != 0;
        }
    }
    assert_true(distinct > 0); /* sampled, not one forced string */
    free(cs);
    h_assert_idle(e);
    h_stop(e);
}

/* The n-th continuation of the plain run (ref), or a token the grammar never allows. */
typedef struct oracle {
    const int32_t *ref;
    int n_ref, n_prompt;
    int32_t forbidden; /* >= 0: propose only this */
} oracle;

static int oracle_drafts(void *ctx, const int32_t *tokens, int n_tokens, int k, int32_t *out) {
    (void)tokens;
    oracle *o = ctx;
    int at = n_tokens - o->n_prompt, n = 0;
    while (n < k && (o->forbidden >= 0 || at + n < o->n_ref))
        out[n] = o->forbidden >= 0 ? o->forbidden : o->ref[at + n], n++;
    return n;
}

static void test_speculation_checks_drafts(void **state) {
    (void)state;
    enum { K = 4 };
    int32_t prompt[24];
    h_prompt(prompt, 24, 7);
    ds_engine *e = start(DS_SPEC_NONE, 0, NULL, NULL);
    if (!ready(e)) {
        h_stop(e);
        skip();
    }
    int32_t z = ds_tok_special_id(ds_engine_tokenizer(e), "<|sep|>"); /* never in the grammar */
    assert_true(z >= 0);
    h_req ref;
    submit(e, prompt, 24, 1.0f, 1, 99, &ref); /* sampled: the verify's draws must match it */
    h_wait(&ref);
    assert_follows(&ref, 0);
    h_stop(e);

    for (int forbid = 0; forbid < 2; forbid++) {
        oracle o = {ref.tokens[0], ref.n[0], 24, forbid ? z : -1};
        e = start(DS_SPEC_NGRAM, K, oracle_drafts, &o);
        h_req c;
        submit(e, prompt, 24, 1.0f, 1, 99, &c);
        h_wait(&c);
        assert_follows(&c, 0);
        /* lossless: the same tokens as without speculation */
        assert_int_equal(c.n[0], ref.n[0]);
        assert_memory_equal(c.tokens[0], ref.tokens[0], (size_t)ref.n[0] * sizeof(int32_t));
        ds_engine_stats st = h_stats(e);
        print_message("%s drafts: %llu proposed, %llu accepted\n", forbid ? "forbidden" : "plain",
                      (unsigned long long)st.spec_draft_tokens,
                      (unsigned long long)st.spec_accepted_tokens);
        assert_true(st.spec_draft_tokens > 0);
        if (forbid) /* every draft is forbidden at its row: none accepted */
            assert_int_equal(st.spec_accepted_tokens, 0);
        else /* the plain output's own tokens: accepted (the last rows may run past the end) */
            assert_true(st.spec_accepted_tokens * 2 > st.spec_draft_tokens);
        h_stop(e);
    }
}

/* The masks made by a thread of their own while the forward runs, the backend waiting for them
 * before its draws (a GPU's path, ds_model_set_draw_wait): the same tokens as made before the
 * forward, for sampled choices, several at once, and under speculation. */
static void test_masks_beside_the_forward(void **state) {
    (void)state;
    enum { R = 5, K = 3 };
    int32_t prompt[20];
    h_prompt(prompt, 20, 5);
    h_req *cs[2];
    for (int a = 0; a < 2; a++) {
        g_async = a;
        ds_engine *e = start(DS_SPEC_NONE, 0, NULL, NULL);
        if (!ready(e)) {
            h_stop(e);
            g_async = 0;
            skip();
        }
        cs[a] = calloc(R, sizeof *cs[a]);
        for (int r = 0; r < R; r++)
            submit(e, prompt, 20, r ? 0.9f : 0.0f, r ? 2 : 1, 40 + r, &cs[a][r]);
        for (int r = 0; r < R; r++) h_wait(&cs[a][r]);
        h_assert_idle(e);
        h_stop(e);
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < cs[0][r].n_choices; i++) {
            assert_follows(&cs[1][r], i);
            assert_int_equal(cs[1][r].n[i], cs[0][r].n[i]);
            assert_memory_equal(cs[1][r].tokens[i], cs[0][r].tokens[i],
                                (size_t)cs[0][r].n[i] * sizeof(int32_t));
        }
    /* speculation: each row's mask as the matcher stands after the drafts before it */
    oracle o = {cs[0][1].tokens[0], cs[0][1].n[0], 20, -1};
    g_async = 1;
    ds_engine *e = start(DS_SPEC_NGRAM, K, oracle_drafts, &o);
    h_req c;
    submit(e, prompt, 20, 0.9f, 1, 41, &c);
    h_wait(&c);
    assert_int_equal(c.n[0], cs[0][1].n[0]);
    assert_memory_equal(c.tokens[0], cs[0][1].tokens[0], (size_t)c.n[0] * sizeof(int32_t));
    assert_true(h_stats(e).spec_accepted_tokens > 0);
    h_stop(e);
    g_async = 0;
    free(cs[0]);
    free(cs[1]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sampled_outputs_follow),
        cmocka_unit_test(test_speculation_checks_drafts),
        cmocka_unit_test(test_masks_beside_the_forward),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
