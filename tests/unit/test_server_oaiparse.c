/* test_server_oaiparse.c — chat output parsed into reasoning_content / content / tool_calls
 * (oai_parse.c): the whole response's message written by hand, and the stream's chunks, which
 * must have OpenAI's fragment shapes and reassemble to exactly that message. The events are made
 * by hand (the bundled model writes no tool calls), with K3's special tokens as ids. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/openai.h"
#include "testutil.h"
#include "text/chat.h"

#define SB "<|tool_calls_section_begin|>"
#define SE "<|tool_calls_section_end|>"
#define CB "<|tool_call_begin|>"
#define AB "<|tool_call_argument_begin|>"
#define CE "<|tool_call_end|>"

static ds_tokenizer *tok;
static int markers_in_content; /* the case returns a malformed section as text */

static int setup(void **state) {
    (void)state;
    ds_err err = {{0}};
    char *d = ds_test_src_path("tests/golden/tok/vocab2048_k3");
    if (ds_tok_load(d, &tok, &err) != DS_OK) fail_msg("%s", err.msg);
    free(d);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    ds_tok_free(tok);
    return 0;
}

/* A piece of generated output: text, or (when it starts with "<|" and names a special id of the
 * K3 tokenizer, e.g. "<|close|>") that special token with no text, as skip_special_tokens sends
 * it. The K2 tool-call markers are not special there (special: false): they stay text. */
static ds_oai_event piece(const char *p, int last) {
    ds_oai_event ev;
    memset(&ev, 0, sizeof ev);
    int32_t id = ds_tok_special_id(tok, p);
    if (id >= 0 && ds_tok_is_special(tok, id)) {
        ev.token = id;
        ev.text = "";
    } else {
        ev.token = 7; /* some ordinary id */
        ev.text = p;
        ev.text_len = strlen(p);
    }
    if (last) ev.finish = DS_FINISH_STOP;
    ev.n_generated = 1;
    return ev;
}

/* The request's parse options from a body. */
static ds_oai_resp_ctx ctx_for(const char *body, int fmt) {
    ds_oai_request r;
    ds_oai_error e;
    if (ds_oai_parse_request(DS_OAI_CHAT, body, strlen(body), NULL, 0, &r, &e))
        fail_msg("%s", e.message);
    ds_oai_resp_ctx c = {.kind = DS_OAI_CHAT,
                         .id = "chatcmpl-1",
                         .model = "tiny",
                         .created = 5,
                         .logprobs = -1,
                         .tok = tok};
    ds_oai_parse_opts(&c, &r, fmt);
    ds_oai_request_free(&r);
    return c;
}

/* Non-streaming: the message of pieces[0..n) (the last one finishes), and *finish. */
static json_t *whole(const ds_oai_resp_ctx *c, const char *const *pieces, int n, char *finish) {
    ds_oai_choice ch;
    memset(&ch, 0, sizeof ch);
    ds_err err;
    for (int i = 0; i < n; i++) {
        ds_oai_event ev = piece(pieces[i], i == n - 1);
        assert_int_equal(ds_oai_choice_add(c, &ch, &ev, &err), DS_OK);
    }
    json_t *r = ds_oai_response(c, &ch, 1, 3);
    json_t *c0 = json_array_get(json_object_get(r, "choices"), 0);
    snprintf(finish, 32, "%s", json_string_value(json_object_get(c0, "finish_reason")));
    json_t *m = json_incref(json_object_get(c0, "message"));
    json_decref(r);
    ds_oai_choice_free(&ch);
    return m;
}

/* Appends s to the string field key of o (creating it). */
static void append_str(json_t *o, const char *key, const char *s) {
    const char *old = json_string_value(json_object_get(o, key));
    char *t = malloc(strlen(old ? old : "") + strlen(s) + 1);
    sprintf(t, "%s%s", old ? old : "", s);
    json_object_set_new(o, key, json_string(t));
    free(t);
}

/* One chunk's delta into the message being reassembled, checking the fragments' shapes. */
static void apply_delta(json_t *msg, json_t *delta) {
    const char *s;
    if ((s = json_string_value(json_object_get(delta, "content")))) {
        if (!markers_in_content) assert_null(strstr(s, "<|")); /* no marker leaks */
        append_str(msg, "content", s);
    }
    if ((s = json_string_value(json_object_get(delta, "reasoning_content"))))
        append_str(msg, "reasoning_content", s);
    json_t *tcs = json_object_get(delta, "tool_calls");
    for (size_t i = 0; i < json_array_size(tcs); i++) {
        json_t *f = json_array_get(tcs, i), *fn = json_object_get(f, "function");
        size_t idx = (size_t)json_integer_value(json_object_get(f, "index"));
        json_t *calls = json_object_get(msg, "tool_calls");
        if (!calls) json_object_set_new(msg, "tool_calls", calls = json_array());
        if (json_object_get(f, "id")) { /* a call's first fragment: all but the arguments */
            assert_int_equal(idx, json_array_size(calls));
            assert_string_equal(json_string_value(json_object_get(f, "type")), "function");
            assert_string_equal(json_string_value(json_object_get(fn, "arguments")), "");
            json_array_append_new(calls, json_deep_copy(f));
            json_object_del(json_array_get(calls, idx), "index");
        } else { /* then argument pieces: index and function.arguments only */
            assert_int_equal(json_object_size(f), 2);
            assert_int_equal(json_object_size(fn), 1);
            json_t *call = json_array_get(calls, idx);
            assert_non_null(call);
            append_str(json_object_get(call, "function"), "arguments",
                       json_string_value(json_object_get(fn, "arguments")));
        }
    }
}

/* Streaming: the chunks of pieces[0..n) reassembled to a message, and *finish (the last chunk's).
 */
static json_t *streamed(const ds_oai_resp_ctx *c, const char *const *pieces, int n, char *finish) {
    ds_oai_choice ch;
    memset(&ch, 0, sizeof ch);
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    finish[0] = 0;
    for (int i = 0; i < n; i++) {
        ds_oai_event ev = piece(pieces[i], i == n - 1);
        json_t *k = ds_oai_chunk(c, &ch, &ev);
        if (!k) continue;
        json_t *list = json_is_array(k) ? json_incref(k) : json_pack("[O]", k);
        for (size_t j = 0; j < json_array_size(list); j++) {
            json_t *c0 = json_array_get(json_object_get(json_array_get(list, j), "choices"), 0);
            assert_false(finish[0]); /* nothing after the finish */
            apply_delta(msg, json_object_get(c0, "delta"));
            const char *f = json_string_value(json_object_get(c0, "finish_reason"));
            if (f) snprintf(finish, 32, "%s", f);
        }
        size_t len; /* arrays go out as one SSE event per chunk */
        char *sse = ds_oai_sse(json_incref(k), &len);
        int events = 0;
        for (const char *p = sse; (p = strstr(p, "data: ")); p++) events++;
        assert_int_equal(events, (int)json_array_size(list));
        free(sse);
        json_decref(list);
        json_decref(k);
    }
    ds_oai_choice_free(&ch);
    /* the whole response's nulls: no content / thought at all */
    if (!json_object_get(msg, "content")) json_object_set_new(msg, "content", json_null());
    if (c->parse.reasoning && !json_object_get(msg, "reasoning_content"))
        json_object_set_new(msg, "reasoning_content", json_null());
    return msg;
}

/* Parses pieces both ways: the message must equal want (JSON text) and the stream must
 * reassemble to it; both finish with want_finish. */
static void check(const ds_oai_resp_ctx *c, const char *const *pieces, int n, const char *want,
                  const char *want_finish) {
    char f1[32], f2[32];
    json_t *w = json_loads(want, 0, NULL);
    assert_non_null(w);
    json_t *m = whole(c, pieces, n, f1), *s = streamed(c, pieces, n, f2);
    char *ms = json_dumps(m, JSON_SORT_KEYS), *ss = json_dumps(s, JSON_SORT_KEYS);
    if (!json_equal(m, w)) fail_msg("message %s\nwant    %s", ms, want);
    if (!json_equal(s, w)) fail_msg("stream %s\nwant   %s", ss, want);
    assert_string_equal(f1, want_finish);
    assert_string_equal(f2, want_finish);
    free(ms), free(ss);
    json_decref(w), json_decref(m), json_decref(s);
}

static const char k_tools_body[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": "
    "\"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": {}}}]";

static void test_tool_calls(void **state) {
    (void)state;
    char body[512];
    snprintf(body, sizeof body, "%s}", k_tools_body);
    ds_oai_resp_ctx c = ctx_for(body, DS_CHAT_KIMI_LINEAR);
    assert_true(c.parse.tools);
    assert_false(c.parse.reasoning);
    const char *p[] = {"Let me ",
                       "check.",
                       SB,
                       CB,
                       "functions.get_weather",
                       ":0",
                       AB,
                       "{\"city\": \"Par",
                       "is\", \"n\": {\"a\": [1, \"}\"]}}",
                       CE,
                       "\n",
                       CB,
                       "functions.get_time:1",
                       AB,
                       "{}",
                       CE,
                       SE,
                       ""};
    check(&c, p, DS_ARRAY_LEN(p),
          "{\"role\": \"assistant\", \"content\": \"Let me check.\", \"tool_calls\": ["
          "{\"id\": \"functions.get_weather:0\", \"type\": \"function\", \"function\": {\"name\": "
          "\"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\", \\\"n\\\": {\\\"a\\\": "
          "[1, \\\"}\\\"]}}\"}},"
          "{\"id\": \"functions.get_time:1\", \"type\": \"function\", \"function\": {\"name\": "
          "\"get_time\", \"arguments\": \"{}\"}}]}",
          "tool_calls");
    /* only calls: content is null */
    const char *q[] = {SB CB "functions.f:0" AB "{\"x\": 1}" CE SE};
    check(&c, q, 1,
          "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": "
          "\"functions.f:0\", \"type\": \"function\", \"function\": {\"name\": \"f\", "
          "\"arguments\": \"{\\\"x\\\": 1}\"}}]}",
          "tool_calls");
}

/* parallel_tool_calls false: only the message's first call goes out (tool_choice auto), whole
 * and streamed; the finish stays "tool_calls". */
static void test_one_call(void **state) {
    (void)state;
    char body[512];
    snprintf(body, sizeof body, "%s, \"parallel_tool_calls\": false}", k_tools_body);
    ds_oai_resp_ctx c = ctx_for(body, DS_CHAT_KIMI_LINEAR);
    assert_true(c.one_call);
    const char *p[] = {SB CB "functions.f:0" AB "{\"x\": 1}" CE, CB "functions.g:1" AB "{}" CE,
                       CB "functions.h:2" AB "{}" CE SE};
    check(&c, p, DS_ARRAY_LEN(p),
          "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": "
          "\"functions.f:0\", \"type\": \"function\", \"function\": {\"name\": \"f\", "
          "\"arguments\": \"{\\\"x\\\": 1}\"}}]}",
          "tool_calls");
    snprintf(body, sizeof body, "%s, \"parallel_tool_calls\": true}", k_tools_body);
    assert_false(ctx_for(body, DS_CHAT_KIMI_LINEAR).one_call);
}

static void test_malformed_and_off(void **state) {
    (void)state;
    char body[512];
    snprintf(body, sizeof body, "%s}", k_tools_body);
    ds_oai_resp_ctx c = ctx_for(body, DS_CHAT_KIMI_LINEAR);
    /* a call that never closes: text, finish as it was */
    const char *p[] = {"a", SB, CB, "functions.f:0", AB, "{\"x\": "};
    markers_in_content = 1;
    check(&c, p, DS_ARRAY_LEN(p),
          "{\"role\": \"assistant\", \"content\": \"a" SB CB "functions.f:0" AB "{\\\"x\\\": \"}",
          "stop");
    markers_in_content = 0;
    /* tool_choice none, or no tools: the text as it is, markers and all */
    snprintf(body, sizeof body, "%s, \"tool_choice\": \"none\"}", k_tools_body);
    ds_oai_resp_ctx off = ctx_for(body, DS_CHAT_KIMI_LINEAR);
    assert_false(ds_oai_parsing(&off));
    ds_oai_resp_ctx none =
        ctx_for("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", DS_CHAT_KIMI_LINEAR);
    assert_false(ds_oai_parsing(&none));
    char f[32];
    const char *q[] = {"a", SB CB "functions.f:0" AB "{}" CE SE};
    json_t *m = whole(&off, q, 2, f);
    assert_string_equal(json_string_value(json_object_get(m, "content")),
                        "a" SB CB "functions.f:0" AB "{}" CE SE);
    assert_null(json_object_get(m, "tool_calls"));
    assert_string_equal(f, "stop");
    json_decref(m);
}

static void test_reasoning_k3(void **state) {
    (void)state;
    const char *body = "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}";
    ds_oai_resp_ctx c = ctx_for(body, DS_CHAT_K3);
    assert_true(c.parse.reasoning && c.parse.xtml && c.parse_specials);
    assert_false(c.parse.tools);
    const char *p[] = {"Two ",    "and two.",  "<|close|>", "think",   "<|sep|>",       "<|open|>",
                       "respon",  "se",        "<|sep|>",   "Four.",   "<|close|>",     "response",
                       "<|sep|>", "<|close|>", "message",   "<|sep|>", "<|end_of_msg|>"};
    check(&c, p, DS_ARRAY_LEN(p),
          "{\"role\": \"assistant\", \"content\": \"Four.\", \"reasoning_content\": \"Two and "
          "two.\"}",
          "stop");
    /* specials the parser does not read (a media marker; a random model's reserved ids, seen on
     * the GPU) stay out of the thought and the answer, as skip_special_tokens asks */
    const char *r[] = {"Two ",    "<|media_pad|>", "and two.",  "<|close|>", "think",
                       "<|sep|>", "<|open|>",      "response",  "<|sep|>",   "[EOT]",
                       "Four.",   "<|media_end|>", "<|close|>", "response",  "<|sep|>"};
    check(&c, r, DS_ARRAY_LEN(r),
          "{\"role\": \"assistant\", \"content\": \"Four.\", \"reasoning_content\": \"Two and "
          "two.\"}",
          "stop");
    /* the thought never ends (a length finish in real use): all of it is reasoning */
    const char *q[] = {"Hmm, ", "<|close|>", "thi"};
    check(&c, q, DS_ARRAY_LEN(q),
          "{\"role\": \"assistant\", \"content\": null, \"reasoning_content\": \"Hmm, thi\"}",
          "stop");
    /* thinking off: nothing is parsed */
    ds_oai_resp_ctx off = ctx_for("{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], "
                                  "\"chat_template_kwargs\": {\"thinking\": false}}",
                                  DS_CHAT_K3);
    assert_false(ds_oai_parsing(&off));
    /* Kimi-Linear does not think */
    ds_oai_resp_ctx kl = ctx_for(body, DS_CHAT_KIMI_LINEAR);
    assert_false(ds_oai_parsing(&kl));
}

static void test_k3_tool_calls(void **state) {
    (void)state;
    char body[512];
    snprintf(body, sizeof body, "%s}", k_tools_body);
    ds_oai_resp_ctx c = ctx_for(body, DS_CHAT_K3);
    assert_true(c.parse.tools && c.parse.reasoning && c.parse.xtml && c.parse_specials);
    /* the structure's special tokens come as ids with no text, as skip_special_tokens has it */
    const char *p[] = {"Need ",
                       "weather.",
                       "<|close|>",
                       "think",
                       "<|sep|>",
                       "<|open|>",
                       "response",
                       "<|sep|>",
                       "Checking.",
                       "<|close|>",
                       "response",
                       "<|sep|>",
                       "<|open|>",
                       "tools",
                       "<|sep|>",
                       "<|open|>",
                       "call tool=\"get_weather\" index=\"1\"",
                       "<|sep|>",
                       "<|open|>",
                       "argument key=\"city\" type=\"string\"",
                       "<|sep|>",
                       "Par",
                       "is",
                       "<|close|>",
                       "argument",
                       "<|sep|>",
                       "<|close|>",
                       "call",
                       "<|sep|>",
                       "<|close|>",
                       "tools",
                       "<|sep|>",
                       "<|close|>",
                       "message",
                       "<|sep|>",
                       "<|end_of_msg|>"};
    check(&c, p, DS_ARRAY_LEN(p),
          "{\"role\": \"assistant\", \"content\": \"Checking.\", \"reasoning_content\": "
          "\"Need weather.\", \"tool_calls\": [{\"id\": \"functions.get_weather:0\", \"type\": "
          "\"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
          "\"{\\\"city\\\": \\\"Paris\\\"}\"}}]}",
          "tool_calls");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tool_calls),        cmocka_unit_test(test_one_call),
        cmocka_unit_test(test_malformed_and_off), cmocka_unit_test(test_reasoning_k3),
        cmocka_unit_test(test_k3_tool_calls),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
