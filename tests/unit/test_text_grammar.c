/* test_text_grammar.c — the llguidance wrapper on a byte-level vocabulary (256 single-byte
 * tokens, then the 256 specials): masks allow exactly the tokens the grammar allows, the cache
 * hits / evicts as its LRU says, the OpenAI grammars compile and accept exactly the text the chat
 * formats' output parser reads. Skipped when llguidance cannot be loaded (it is installed by
 * `make deps`; the server then answers constrained requests with an error). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "text/grammar.h"
#include "text/toolparse.h"

typedef struct fixture {
    ds_tokenizer *tok;
    ds_grammars *g;
    int32_t eos;
} fixture;

static fixture fx[2]; /* [0]: K3 specials, [1]: Kimi-Linear (K2) specials */

static int setup(void **state) {
    (void)state;
    for (int f = 0; f < 2; f++) {
        ds_err err = {{0}};
        char *dir = ds_test_tmpdir();
        if (ds_tok_write_files(dir, 256, f ? DS_CHAT_KIMI_LINEAR : DS_CHAT_K3, &err) ||
            ds_tok_load(dir, &fx[f].tok, &err)) {
            fprintf(stderr, "tokenizer: %s\n", err.msg);
            free(dir);
            return -1;
        }
        free(dir);
        fx[f].eos = ds_tok_eos_id(fx[f].tok);
        if (ds_grammars_new(fx[f].tok, fx[f].eos, 2, &fx[f].g, &err)) {
            fprintf(stderr, "llguidance unavailable, grammar tests skipped: %s\n", err.msg);
            fx[f].g = NULL;
        }
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    for (int f = 0; f < 2; f++) {
        ds_grammars_free(fx[f].g);
        ds_tok_free(fx[f].tok);
    }
    return 0;
}

static int32_t id_of(const ds_tokenizer *t, const char *s) {
    ds_err err;
    int32_t *ids = NULL;
    int n = 0;
    assert_int_equal(ds_tok_encode(t, s, strlen(s), 1, &ids, &n, &err), DS_OK);
    assert_int_equal(n, 1);
    int32_t id = ids[0];
    free(ids);
    return id;
}

/* The ids the mask allows, ascending, into out[cap]; their count. */
static int allowed(ds_matcher *m, const ds_grammars *g, int32_t *out, int cap) {
    ds_err err;
    int W = ds_grammars_mask_words(g), n = 0;
    uint32_t *mask = calloc((size_t)W, 4);
    assert_int_equal(ds_matcher_mask(m, mask, &err), DS_OK);
    for (int i = 0; i < W * 32; i++)
        if (mask[i / 32] >> (i % 32) & 1) {
            if (n < cap) out[n] = i;
            n++;
        }
    free(mask);
    return n;
}

static void test_mask_exact(void **state) {
    (void)state;
    fixture *F = &fx[0];
    if (!F->g) skip();
    ds_err err;
    ds_matcher *m;
    assert_int_equal(ds_matcher_new(F->g, "start: \"ab\" | \"ac\"", &m, &err), DS_OK);
    int32_t a = id_of(F->tok, "a"), b = id_of(F->tok, "b"), c = id_of(F->tok, "c"), got[8];
    assert_int_equal(allowed(m, F->g, got, 8), 1);
    assert_int_equal(got[0], a);
    assert_false(ds_matcher_done(m));
    assert_int_equal(ds_matcher_consume(m, a, &err), DS_OK);
    assert_int_equal(allowed(m, F->g, got, 8), 2);
    assert_int_equal(got[0], DS_MIN(b, c));
    assert_int_equal(got[1], DS_MAX(b, c));
    assert_int_equal(ds_matcher_consume(m, c, &err), DS_OK);
    /* complete: only eos, and the matcher says so */
    assert_int_equal(allowed(m, F->g, got, 8), 1);
    assert_int_equal(got[0], F->eos);
    assert_true(ds_matcher_done(m));
    assert_int_equal(ds_matcher_consume(m, F->eos, &err), DS_OK); /* the forced eos is taken */
    assert_true(ds_matcher_done(m));
    /* back one token: b and c again; a token outside the mask is refused */
    assert_int_equal(ds_matcher_rollback(m, 1, &err), DS_OK);
    assert_int_equal(allowed(m, F->g, got, 8), 2);
    int32_t seq[3] = {b, F->eos, a};
    assert_int_equal(ds_matcher_validate(m, seq, 3, &err), 2);
    assert_int_equal(ds_matcher_consume(m, a, &err), DS_ERR);
    ds_matcher_free(m);
}

static void test_json_enum_mask(void **state) {
    (void)state;
    fixture *F = &fx[0];
    if (!F->g) skip();
    ds_err err;
    ds_grammar_ctx c = {F->tok, DS_CHAT_K3, 0, 0, 0};
    char *lark = NULL;
    assert_int_equal(ds_grammar_from_response_format(
                         &c,
                         "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\",\"schema\":"
                         "{\"enum\":[\"up\",\"down\"]}}}",
                         &lark, &err),
                     DS_OK);
    ds_matcher *m;
    assert_int_equal(ds_matcher_new(F->g, lark, &m, &err), DS_OK);
    int32_t got[8];
    assert_int_equal(allowed(m, F->g, got, 8), 1);
    assert_int_equal(got[0], id_of(F->tok, "\""));
    assert_int_equal(ds_matcher_consume(m, got[0], &err), DS_OK);
    assert_int_equal(allowed(m, F->g, got, 8), 2); /* u or d */
    assert_int_equal(got[0], DS_MIN(id_of(F->tok, "u"), id_of(F->tok, "d")));
    ds_matcher_free(m);
    free(lark);
}

static void test_cache_lru(void **state) {
    (void)state;
    fixture *F = &fx[1]; /* its own cache (capacity 2), untouched by the other tests */
    if (!F->g) skip();
    ds_err err;
    ds_grammar_stats s0, s;
    ds_grammars_stats(F->g, &s0);
    ds_matcher *m1, *m2;
    assert_int_equal(ds_matcher_new(F->g, "start: \"x\"", &m1, &err), DS_OK);
    assert_int_equal(ds_matcher_new(F->g, "start: \"x\"", &m2, &err), DS_OK);
    ds_grammars_stats(F->g, &s);
    assert_int_equal(s.misses - s0.misses, 1);
    assert_int_equal(s.hits - s0.hits, 1);
    /* two clones are independent */
    assert_int_equal(ds_matcher_consume(m1, id_of(F->tok, "x"), &err), DS_OK);
    assert_true(ds_matcher_done(m1));
    assert_false(ds_matcher_done(m2));
    ds_matcher_free(m1);
    ds_matcher_free(m2);
    assert_int_equal(ds_grammar_check(F->g, "start: \"y\"", &err), DS_OK);
    assert_int_equal(ds_grammar_check(F->g, "start: \"x\"", &err), DS_OK); /* x most recent */
    assert_int_equal(ds_grammar_check(F->g, "start: \"z\"", &err), DS_OK); /* evicts y */
    assert_int_equal(ds_grammar_check(F->g, "start: \"x\"", &err), DS_OK); /* still there */
    ds_grammars_stats(F->g, &s);
    assert_int_equal(s.entries, 2);
    assert_int_equal(s.evictions - s0.evictions, 1);
    assert_int_equal(s.misses - s0.misses, 3);
    assert_int_equal(s.hits - s0.hits, 3);
    /* a bad grammar is an error with llguidance's reason, and is not cached */
    err.msg[0] = 0;
    assert_int_equal(ds_grammar_check(F->g, "start: nowhere", &err), DS_ERR);
    assert_true(strlen(err.msg) > 0);
    ds_grammars_stats(F->g, &s);
    assert_int_equal(s.entries, 2);
    /* every miss compiled: three grammars, one refusal, each timed in one bucket */
    assert_int_equal(s.compiles - s0.compiles, 3);
    assert_int_equal(s.compile_failures - s0.compile_failures, 1);
    assert_int_equal(s.misses - s0.misses, 4);
    uint64_t timed = 0, timed0 = 0;
    for (int b = 0; b <= DS_GRAMMAR_COMPILE_BUCKETS; b++)
        timed += s.compile_buckets[b], timed0 += s0.compile_buckets[b];
    assert_int_equal(timed - timed0, 4);
    assert_true(s.compile_seconds > s0.compile_seconds);
}

/* Single flight: threads that ask for one grammar at the same moment get it from one compile (the
 * others wait for it and count hits), each with a matcher of its own. */
enum { SF_THREADS = 8 };
static pthread_barrier_t sf_bar;
static const char k_sf_lark[] = "start: /[a-m]{3,40}/ \"!\" /[n-z]{2,30}/";
static void *sf_thread(void *arg) {
    ds_matcher **m = arg;
    ds_err err;
    pthread_barrier_wait(&sf_bar);
    if (ds_matcher_new(fx[0].g, k_sf_lark, m, &err)) *m = NULL;
    return NULL;
}

static void test_cache_single_flight(void **state) {
    (void)state;
    fixture *F = &fx[0];
    if (!F->g) skip();
    ds_grammar_stats s0, s;
    ds_grammars_stats(F->g, &s0);
    pthread_t th[SF_THREADS];
    ds_matcher *m[SF_THREADS];
    pthread_barrier_init(&sf_bar, NULL, SF_THREADS);
    for (int i = 0; i < SF_THREADS; i++) pthread_create(&th[i], NULL, sf_thread, &m[i]);
    for (int i = 0; i < SF_THREADS; i++) pthread_join(th[i], NULL);
    pthread_barrier_destroy(&sf_bar);
    ds_grammars_stats(F->g, &s);
    assert_int_equal(s.compiles - s0.compiles, 1);
    assert_int_equal(s.hits - s0.hits, SF_THREADS - 1);
    ds_err err;
    for (int i = 0; i < SF_THREADS; i++) {
        assert_non_null(m[i]);
        /* each matcher its own: the i-th walks its own text */
        for (int k = 0; k < 3 + i; k++)
            assert_int_equal(ds_matcher_consume(m[i], id_of(F->tok, "b"), &err), DS_OK);
        assert_false(ds_matcher_done(m[i]));
        ds_matcher_free(m[i]);
    }
}

/* Encodes text (specials by name), checks the grammar accepts every token and then ends. */
static void accepts_all(fixture *F, const char *lark, const char *text) {
    ds_err err;
    int32_t *ids = NULL;
    int n = 0;
    assert_int_equal(ds_tok_encode(F->tok, text, strlen(text), 1, &ids, &n, &err), DS_OK);
    ds_matcher *m;
    if (ds_matcher_new(F->g, lark, &m, &err)) fail_msg("%s\n%s", err.msg, lark);
    int k = ds_matcher_validate(m, ids, n, &err);
    if (k != n) fail_msg("accepted %d of %d tokens of %s\n%s", k, n, text, lark);
    for (int i = 0; i < n; i++) assert_int_equal(ds_matcher_consume(m, ids[i], &err), DS_OK);
    assert_true(ds_matcher_done(m));
    ds_matcher_free(m);
    free(ids);
}

static const char k_tools[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":"
    "\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"maxLength\":5}},\"required\":"
    "[\"city\"],\"additionalProperties\":false}}},{\"type\":\"function\",\"function\":{\"name\":"
    "\"add\",\"parameters\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},"
    "\"required\":[\"a\"],\"additionalProperties\":false}}}]";

static void test_tool_grammars(void **state) {
    (void)state;
    if (!fx[0].g || !fx[1].g) skip();
    ds_err err;
    char *lark = NULL;
    /* K3, thinking: the thought closes, then one XTML call with a json block */
    ds_grammar_ctx c3 = {fx[0].tok, DS_CHAT_K3, 1, 0, 0};
    assert_int_equal(ds_grammar_from_tools(&c3, k_tools, "\"required\"", &lark, &err), DS_OK);
    accepts_all(&fx[0], lark,
                "<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"add\" "
                "index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>{\"a\": 12}<|close|>json"
                "<|sep|><|close|>call<|sep|><|close|>tools<|sep|>");
    free(lark);
    /* named: only that tool's call rule */
    assert_int_equal(
        ds_grammar_from_tools(&c3, k_tools,
                              "{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}",
                              &lark, &err),
        DS_OK);
    assert_non_null(strstr(lark, "call_0_0"));
    assert_null(strstr(lark, "call_1_"));  /* add is tools[1] */
    assert_null(strstr(lark, "call_0_1")); /* one call, also with parallel_tool_calls */
    free(lark);
    /* K2 sections */
    ds_grammar_ctx c2 = {fx[1].tok, DS_CHAT_KIMI_LINEAR, 0, 0, 0};
    assert_int_equal(ds_grammar_from_tools(&c2, k_tools, NULL, &lark, &err), DS_OK);
    accepts_all(&fx[1], lark,
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                "<|tool_call_argument_begin|>{\"city\": \"Pa\\\"ri\"}<|tool_call_end|>"
                "<|tool_calls_section_end|>");
    free(lark);
    /* errors name the field */
    assert_int_equal(
        ds_grammar_from_tools(
            &c3, k_tools, "{\"type\":\"function\",\"function\":{\"name\":\"nope\"}}", &lark, &err),
        DS_ERR);
    assert_non_null(strstr(err.msg, "tool_choice.function.name"));
    assert_int_equal(
        ds_grammar_from_response_format(
            &c3, "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\"}}", &lark, &err),
        DS_ERR);
    assert_non_null(strstr(err.msg, "response_format.json_schema.schema"));
    assert_int_equal(ds_grammar_from_response_format(&c3, "{\"type\":\"yaml\"}", &lark, &err),
                     DS_ERR);
    assert_non_null(strstr(err.msg, "response_format.type"));
    assert_int_equal(ds_grammar_from_response_format(&c3, "{\"type\":\"text\"}", &lark, &err),
                     DS_OK);
    assert_null(lark);
}

/* How many tokens of text (specials by name) the grammar accepts from its start. */
static int accepted_prefix(fixture *F, const char *lark, const char *text, int *n_tokens) {
    ds_err err;
    int32_t *ids = NULL;
    assert_int_equal(ds_tok_encode(F->tok, text, strlen(text), 1, &ids, n_tokens, &err), DS_OK);
    ds_matcher *m;
    if (ds_matcher_new(F->g, lark, &m, &err)) fail_msg("%s\n%s", err.msg, lark);
    int k = ds_matcher_validate(m, ids, *n_tokens, &err);
    ds_matcher_free(m);
    free(ids);
    return k;
}

/* The output parser's calls of text (K3: XTML; else K2 sections), as "id name args;" each. */
static void parsed_calls(const char *text, int xtml, char *out, size_t cap) {
    ds_tp_opts o = {1, 0, xtml};
    ds_toolparse p;
    ds_tp_out r = {0};
    ds_err err;
    ds_tp_init(&p, &o);
    assert_int_equal(ds_tp_feed(&p, text, strlen(text), &r, &err), DS_OK);
    assert_int_equal(ds_tp_finish(&p, &r, &err), DS_OK);
    out[0] = 0;
    for (int i = 0; i < r.n_calls; i++)
        snprintf(out + strlen(out), cap - strlen(out), "%s %s %s;", r.calls[i].id, r.calls[i].name,
                 r.calls[i].args);
    assert_int_equal(r.content_len, 0); /* nothing left over as text */
    ds_tp_out_free(&r);
    ds_tp_free(&p);
}

/* tool_choice required with parallel_tool_calls: several calls (any tools, numbered in order) in
 * one section, each one's arguments by its own schema, up to DS_GRAMMAR_MAX_CALLS; without it, or
 * for a named function, exactly one. */
static void test_parallel_tool_calls(void **state) {
    (void)state;
    if (!fx[0].g || !fx[1].g) skip();
    ds_err err;
    char *one = NULL, *many = NULL, got[512];
    int n;
    /* K3, thinking off: two calls of different tools */
    static const char two3[] =
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" "
        "index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>{\"city\": \"Oslo\"}<|close|>"
        "json<|sep|><|close|>call<|sep|><|open|>call tool=\"add\" index=\"2\"<|sep|><|open|>json "
        "type=\"object\"<|sep|>{\"a\": -3}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools"
        "<|sep|>";
    ds_grammar_ctx p3 = {fx[0].tok, DS_CHAT_K3, 0, 1, 0}, s3 = {fx[0].tok, DS_CHAT_K3, 0, 0, 0};
    assert_int_equal(ds_grammar_from_tools(&p3, k_tools, "\"required\"", &many, &err), DS_OK);
    assert_int_equal(ds_grammar_from_tools(&s3, k_tools, "\"required\"", &one, &err), DS_OK);
    accepts_all(&fx[0], many, two3);
    parsed_calls(two3, 1, got, sizeof got);
    assert_string_equal(got, "functions.get_weather:0 get_weather {\"city\": \"Oslo\"};"
                             "functions.add:1 add {\"a\": -3};");
    /* parallel_tool_calls false: the tools section must close after the first call; the
     * parallel grammar refuses the second call's arguments by add's schema, not get_weather's */
    int first = (int)(strstr(two3, "<|open|>call tool=\"add\"") - two3);
    char *head = strndup(two3, (size_t)first);
    int n_head;
    int k_head = accepted_prefix(&fx[0], one, head, &n_head);
    assert_int_equal(k_head, n_head);
    assert_int_equal(accepted_prefix(&fx[0], one, two3, &n), n_head);
    free(head);
    char *swapped = strdup(two3);
    memcpy(strstr(swapped, "{\"a\""), "{\"b\"", 4); /* add has no b */
    assert_true(accepted_prefix(&fx[0], many, swapped, &n) < n);
    free(swapped);
    free(one), free(many);
    /* a named function: one call, whatever parallel_tool_calls says */
    assert_int_equal(
        ds_grammar_from_tools(
            &p3, k_tools, "{\"type\":\"function\",\"function\":{\"name\":\"add\"}}", &one, &err),
        DS_OK);
    static const char add_add[] =
        "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"add\" index=\"1\"<|sep|>"
        "<|open|>json type=\"object\"<|sep|>{\"a\": 1}<|close|>json<|sep|><|close|>call<|sep|>"
        "<|open|>call tool=\"add\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>"
        "{\"a\": 2}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";
    assert_true(accepted_prefix(&fx[0], one, add_add, &n) < n);
    free(one);
    /* K2 sections: ids count the conversation's calls (3 came before), up to the cap */
    ds_grammar_ctx p2 = {fx[1].tok, DS_CHAT_KIMI_LINEAR, 0, 1, 3};
    assert_int_equal(ds_grammar_from_tools(&p2, k_tools, "\"required\"", &many, &err), DS_OK);
    char text[8192] = "<|tool_calls_section_begin|>";
    for (int k = 0; k < DS_GRAMMAR_MAX_CALLS; k++)
        snprintf(text + strlen(text), sizeof text - strlen(text),
                 "<|tool_call_begin|>functions.add:%d<|tool_call_argument_begin|>{\"a\": %d}"
                 "<|tool_call_end|>",
                 3 + k, k);
    size_t body = strlen(text);
    strcat(text, "<|tool_calls_section_end|>");
    accepts_all(&fx[1], many, text);
    parsed_calls(text, 0, got, sizeof got);
    assert_non_null(strstr(got, "functions.add:3 add {\"a\": 0};functions.add:4 add {\"a\": 1};"));
    /* one more call is refused at its first token; a repeated number too */
    int n_body;
    text[body] = 0;
    int k_body = accepted_prefix(&fx[1], many, text, &n_body);
    assert_int_equal(k_body, n_body);
    snprintf(text + body, sizeof text - body,
             "<|tool_call_begin|>functions.add:%d<|tool_call_argument_begin|>{\"a\": 0}"
             "<|tool_call_end|><|tool_calls_section_end|>",
             3 + DS_GRAMMAR_MAX_CALLS);
    assert_int_equal(accepted_prefix(&fx[1], many, text, &n), n_body);
    static const char wrong_id[] =
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:3<|tool_call_argument_begin|>"
        "{\"a\": 0}<|tool_call_end|><|tool_call_begin|>functions.add:3<|tool_call_argument_begin|>"
        "{\"a\": 0}<|tool_call_end|><|tool_calls_section_end|>";
    assert_true(accepted_prefix(&fx[1], many, wrong_id, &n) < n);
    free(many);
}

static void test_response_format_accepts(void **state) {
    (void)state;
    if (!fx[0].g) skip();
    ds_err err;
    char *lark = NULL;
    ds_grammar_ctx c = {fx[0].tok, DS_CHAT_K3, 1, 0, 0};
    assert_int_equal(ds_grammar_from_response_format(&c, "{\"type\":\"json_object\"}", &lark, &err),
                     DS_OK);
    accepts_all(&fx[0], lark,
                "<|close|>think<|sep|><|open|>response<|sep|>{\"k\": [1, 2.5, \"\\n\"], \"z\": "
                "null}");
    /* not an object: refused at the first byte */
    ds_matcher *m;
    assert_int_equal(ds_matcher_new(fx[0].g, lark, &m, &err), DS_OK);
    int32_t *ids = NULL;
    int n = 0;
    assert_int_equal(ds_tok_encode(fx[0].tok, "<|close|>think<|sep|><|open|>response<|sep|>[1]", 47,
                                   1, &ids, &n, &err),
                     DS_OK);
    assert_int_equal(ds_matcher_validate(m, ids, n, &err), n - 3);
    free(ids);
    ds_matcher_free(m);
    free(lark);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mask_exact),
        cmocka_unit_test(test_json_enum_mask),
        cmocka_unit_test(test_cache_lru),
        cmocka_unit_test(test_cache_single_flight),
        cmocka_unit_test(test_tool_grammars),
        cmocka_unit_test(test_parallel_tool_calls),
        cmocka_unit_test(test_response_format_accepts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
