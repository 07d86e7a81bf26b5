/* test_server_openai.c — the OpenAI wire format without an engine: request JSON -> params (every
 * field and every validation error, with its status and the field named), context fitting, and
 * response / stream chunk / logprob / SSE / metrics text building. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/metrics.h"
#include "server/openai.h"
#include "testutil.h"

#define VOCAB 2304 /* n_ranks 2048 + 256 specials, as in the golden K3 tokenizer */

static ds_tokenizer *tok;

static int setup(void **state) {
    (void)state;
    ds_err err = {{0}};
    char *d = ds_test_src_path("tests/golden/tok/vocab2048_k3");
    if (ds_tok_load(d, &tok, &err) != DS_OK) fail_msg("%s", err.msg);
    free(d);
    assert_int_equal(ds_tok_vocab_size(tok), VOCAB);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    ds_tok_free(tok);
    return 0;
}

static void parse_ok(ds_oai_kind kind, const char *body, ds_oai_request *r) {
    ds_oai_error e;
    if (ds_oai_parse_request(kind, body, strlen(body), "tiny", VOCAB, r, &e) != DS_OK)
        fail_msg("parse failed (%d): %s\nbody: %s", e.status, e.message, body);
}

/* Parses body and expects an error with this status, param and a message containing want. */
static void parse_err(ds_oai_kind kind, const char *body, int status, const char *param,
                      const char *want) {
    ds_oai_request r;
    ds_oai_error e;
    memset(&e, 0, sizeof e);
    int rc = ds_oai_parse_request(kind, body, strlen(body), "tiny", VOCAB, &r, &e);
    if (rc != DS_ERR) fail_msg("expected an error for %s", body);
    if (e.status != status)
        fail_msg("status %d, want %d for %s (%s)", e.status, status, body, e.message);
    if (strcmp(e.param, param ? param : ""))
        fail_msg("param '%s', want '%s' for %s", e.param, param ? param : "", body);
    if (!strstr(e.message, want))
        fail_msg("message \"%s\" lacks \"%s\" (%s)", e.message, want, body);
    assert_null(r.prompt);
    assert_null(r.messages_json);
    assert_int_equal(r.params.n_stop, 0);
}

/* ---- request parsing ---- */

static void test_completion_defaults(void **state) {
    (void)state;
    ds_oai_request r;
    parse_ok(DS_OAI_COMPLETIONS, "{\"model\": \"tiny\", \"prompt\": \"Hello\"}", &r);
    assert_string_equal(r.prompt, "Hello");
    assert_string_equal(r.model, "tiny");
    assert_null(r.prompt_ids);
    assert_int_equal(r.max_tokens_set, 0);
    assert_true(r.params.sample.temperature == 1.0f);
    assert_true(r.params.sample.top_p == 1.0f);
    assert_int_equal(r.params.n, 1);
    assert_int_equal(r.params.logprobs, -1);
    assert_int_equal(r.params.skip_special_tokens, 1);
    assert_int_equal(r.params.has_seed, 0);
    assert_int_equal(r.stream, 0);
    ds_oai_request_free(&r);
    /* no model at all is accepted (the served one is meant) */
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": \"x\", \"model\": null}", &r);
    assert_null(r.model);
    ds_oai_request_free(&r);
}

static void test_completion_mapping(void **state) {
    (void)state;
    ds_oai_request r;
    parse_ok(DS_OAI_COMPLETIONS,
             "{\"prompt\": \"Hi\", \"max_tokens\": 7, \"temperature\": 0.5, \"top_p\": 0.9, "
             "\"top_k\": 5, \"min_p\": 0.1, \"seed\": -3, \"stop\": [\"a\", \"\", \"bc\"], "
             "\"stop_token_ids\": [5, 2000], \"ignore_eos\": true, \"min_tokens\": 2, "
             "\"presence_penalty\": 0.25, \"frequency_penalty\": -1.5, \"logprobs\": 3, \"n\": 4, "
             "\"stream\": true, \"stream_options\": {\"include_usage\": true}, "
             "\"skip_special_tokens\": false, \"echo\": false, \"user\": \"u1\"}",
             &r);
    const ds_request_params *p = &r.params;
    assert_int_equal(r.max_tokens_set, 1);
    assert_int_equal(p->max_tokens, 7);
    assert_true(p->sample.temperature == 0.5f);
    assert_true(p->sample.top_p == 0.9f);
    assert_int_equal(p->sample.top_k, 5);
    assert_true(p->sample.min_p == 0.1f);
    assert_int_equal(p->has_seed, 1);
    assert_true(p->seed == (uint64_t)-3);
    assert_int_equal(p->n_stop, 2); /* the empty stop string is dropped */
    assert_string_equal(p->stop[0], "a");
    assert_string_equal(p->stop[1], "bc");
    assert_int_equal(p->n_stop_token_ids, 2);
    assert_int_equal(p->stop_token_ids[0], 5);
    assert_int_equal(p->stop_token_ids[1], 2000);
    assert_int_equal(p->ignore_eos, 1);
    assert_int_equal(p->min_tokens, 2);
    assert_true(p->sample.presence_penalty == 0.25f);
    assert_true(p->sample.frequency_penalty == -1.5f);
    assert_int_equal(p->logprobs, 3);
    assert_int_equal(p->n, 4);
    assert_int_equal(p->skip_special_tokens, 0);
    assert_int_equal(r.stream, 1);
    assert_int_equal(r.include_usage, 1);
    ds_oai_request_free(&r);

    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": \"x\", \"stop\": \"END\", \"top_k\": -1}", &r);
    assert_int_equal(r.params.n_stop, 1);
    assert_string_equal(r.params.stop[0], "END");
    assert_int_equal(r.params.sample.top_k, 0); /* vLLM's -1 = off */
    ds_oai_request_free(&r);
}

static void test_prompt_forms(void **state) {
    (void)state;
    ds_oai_request r;
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": [1, 2, 2303]}", &r);
    assert_null(r.prompt);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[2], 2303);
    ds_oai_request_free(&r);
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": \"a\\u0000b\"}", &r); /* NUL is legal JSON */
    assert_int_equal(r.prompt_len, 3);
    assert_memory_equal(r.prompt, "a\0b", 4);
    ds_oai_request_free(&r);
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": [\"one\"]}", &r);
    assert_string_equal(r.prompt, "one");
    ds_oai_request_free(&r);
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": [[7, 8]]}", &r);
    assert_int_equal(r.n_prompt_ids, 2);
    assert_int_equal(r.prompt_ids[0], 7);
    ds_oai_request_free(&r);
    parse_err(DS_OAI_COMPLETIONS, "{\"prompt\": [\"a\", \"b\"]}", 400, "prompt",
              "only one prompt per request");
    parse_err(DS_OAI_COMPLETIONS, "{\"prompt\": [1, 2304]}", 400, "prompt",
              "prompt[1]: token id 2304 is outside the vocabulary [0, 2304)");
    parse_err(DS_OAI_COMPLETIONS, "{\"prompt\": [1, -1]}", 400, "prompt", "prompt[1]");
    parse_err(DS_OAI_COMPLETIONS, "{\"prompt\": [1, \"x\"]}", 400, "prompt",
              "prompt[1]: expected a token id");
    parse_err(DS_OAI_COMPLETIONS, "{\"prompt\": 5}", 400, "prompt",
              "prompt: expected a string or a list of token ids, got integer");
    parse_err(DS_OAI_COMPLETIONS, "{\"max_tokens\": 5}", 400, "prompt",
              "prompt: this field is required");
}

static void test_chat_mapping(void **state) {
    (void)state;
    ds_oai_request r;
    parse_ok(DS_OAI_CHAT,
             "{\"model\": \"tiny\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
             "\"max_tokens\": 9, \"max_completion_tokens\": 5, \"logprobs\": true, "
             "\"top_logprobs\": 4, \"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
             "\"f\"}}], \"tool_choice\": \"required\", \"chat_template_kwargs\": {\"thinking\": "
             "false}, \"reasoning_effort\": \"low\"}",
             &r);
    assert_string_equal(r.messages_json, "[{\"role\":\"user\",\"content\":\"hi\"}]");
    assert_int_equal(r.params.max_tokens, 5); /* max_completion_tokens wins */
    assert_int_equal(r.params.logprobs, 4);
    assert_non_null(r.tools_json);
    assert_non_null(strstr(r.tools_json, "\"name\":\"f\""));
    assert_string_equal(r.tool_choice, "required");
    assert_int_equal(r.thinking, 0);
    assert_string_equal(r.thinking_effort, "low");
    assert_int_equal(r.add_generation_prompt, 1);
    ds_oai_request_free(&r);

    parse_ok(DS_OAI_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
             "\"logprobs\": true, \"tool_choice\": \"auto\"}",
             &r);
    assert_int_equal(r.params.logprobs, 0); /* logprobs alone: the sampled token only */
    assert_null(r.tool_choice);             /* auto is the default */
    assert_int_equal(r.thinking, 1);
    ds_oai_request_free(&r);
    parse_ok(DS_OAI_CHAT,
             "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
             "\"logprobs\": false}",
             &r);
    assert_int_equal(r.params.logprobs, -1);
    ds_oai_request_free(&r);
}

static void test_errors(void **state) {
    (void)state;
    const ds_oai_kind C = DS_OAI_COMPLETIONS, H = DS_OAI_CHAT;
    parse_err(C, "{\"prompt\": \"x\"", 400, NULL, "invalid JSON");
    parse_err(C, "", 400, NULL, "invalid JSON");
    parse_err(C, "[1, 2]", 400, NULL, "must be a JSON object, got array");
    parse_err(C, "{\"prompt\": \"x\", \"model\": \"gpt-4\"}", 404, "model",
              "`gpt-4` does not exist");
    parse_err(C, "{\"prompt\": \"x\", \"model\": 5}", 400, "model",
              "model: expected a string, got integer");
    /* a NUL would cut the name to the served one: refused, naming the field */
    parse_err(C, "{\"prompt\": \"x\", \"model\": \"tiny\\u0000x\"}", 400, "model",
              "model: must not contain NUL");
    parse_err(H, "{\"messages\": [{}], \"reasoning_effort\": \"high\\u0000\"}", 400,
              "reasoning_effort", "must not contain NUL");
    parse_err(C, "{\"prompt\": \"x\", \"temperature\": \"hot\"}", 400, "temperature",
              "temperature: expected a number, got string");
    parse_err(C, "{\"prompt\": \"x\", \"temperature\": 2.5}", 400, "temperature",
              "temperature: must be");
    parse_err(C, "{\"prompt\": \"x\", \"temperature\": -0.1}", 400, "temperature", "got -0.1");
    parse_err(C, "{\"prompt\": \"x\", \"top_p\": 0}", 400, "top_p", "top_p: must be > 0");
    parse_err(C, "{\"prompt\": \"x\", \"top_p\": 1.01}", 400, "top_p", "top_p");
    parse_err(C, "{\"prompt\": \"x\", \"top_k\": -2}", 400, "top_k", "top_k: must be between -1");
    parse_err(C, "{\"prompt\": \"x\", \"top_k\": 1.5}", 400, "top_k",
              "top_k: expected an integer, got number");
    parse_err(C, "{\"prompt\": \"x\", \"min_p\": 1.5}", 400, "min_p", "min_p");
    parse_err(C, "{\"prompt\": \"x\", \"max_tokens\": 0}", 400, "max_tokens",
              "max_tokens: must be between 1");
    parse_err(C, "{\"prompt\": \"x\", \"max_tokens\": \"10\"}", 400, "max_tokens",
              "max_tokens: expected an integer, got string");
    parse_err(C, "{\"prompt\": \"x\", \"max_tokens\": 2.5}", 400, "max_tokens",
              "expected an integer");
    parse_err(C, "{\"prompt\": \"x\", \"n\": 0}", 400, "n", "n: must be between 1 and 16, got 0");
    parse_err(C, "{\"prompt\": \"x\", \"n\": 17}", 400, "n", "got 17");
    parse_err(C, "{\"prompt\": \"x\", \"logprobs\": 21}", 400, "logprobs",
              "logprobs: must be between 0 and 20");
    parse_err(C, "{\"prompt\": \"x\", \"logprobs\": true}", 400, "logprobs",
              "logprobs: expected an integer, got boolean");
    parse_err(H, "{\"messages\": [{}], \"logprobs\": 3}", 400, "logprobs",
              "logprobs: expected a boolean, got integer");
    parse_err(H, "{\"messages\": [{}], \"logprobs\": true, \"top_logprobs\": 21}", 400,
              "top_logprobs", "top_logprobs: must be between 0 and 20");
    parse_err(H, "{\"messages\": [{}], \"top_logprobs\": 2}", 400, "top_logprobs",
              "requires logprobs");
    parse_err(C, "{\"prompt\": \"x\", \"stop\": 5}", 400, "stop",
              "stop: expected a string or a list");
    parse_err(C, "{\"prompt\": \"x\", \"stop\": [\"a\", 1]}", 400, "stop",
              "stop[1]: expected a string");
    parse_err(
        C,
        "{\"prompt\": \"x\", \"stop\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\","
        "\"10\",\"11\",\"12\",\"13\",\"14\",\"15\",\"16\",\"17\"]}",
        400, "stop", "at most 16 stop strings, got 17");
    parse_err(C, "{\"prompt\": \"x\", \"stop\": [\"a\\u0000b\"]}", 400, "stop",
              "stop[0]: a stop string cannot contain NUL");
    parse_err(C, "{\"prompt\": \"x\", \"stop_token_ids\": \"x\"}", 400, "stop_token_ids",
              "stop_token_ids: expected a list");
    parse_err(C, "{\"prompt\": \"x\", \"stop_token_ids\": [99999]}", 400, "stop_token_ids",
              "stop_token_ids[0]: token id 99999 is outside");
    parse_err(C, "{\"prompt\": \"x\", \"ignore_eos\": \"yes\"}", 400, "ignore_eos",
              "ignore_eos: expected a boolean, got string");
    parse_err(C, "{\"prompt\": \"x\", \"min_tokens\": -1}", 400, "min_tokens", "min_tokens");
    parse_err(C, "{\"prompt\": \"x\", \"min_tokens\": 10, \"max_tokens\": 5}", 400, "min_tokens",
              "min_tokens: must be <= max_tokens (5), got 10");
    parse_err(C, "{\"prompt\": \"x\", \"presence_penalty\": 3}", 400, "presence_penalty",
              "presence_penalty");
    parse_err(C, "{\"prompt\": \"x\", \"frequency_penalty\": \"a\"}", 400, "frequency_penalty",
              "frequency_penalty: expected a number");
    parse_err(C, "{\"prompt\": \"x\", \"seed\": \"abc\"}", 400, "seed",
              "seed: expected an integer");
    parse_err(C, "{\"prompt\": \"x\", \"stream\": \"true\"}", 400, "stream",
              "stream: expected a boolean");
    parse_err(C, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", 400,
              "stream_options", "only allowed when stream is true");
    parse_err(C, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": 1}", 400,
              "stream_options", "stream_options: expected an object");
    parse_err(C,
              "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"include_usage\": 1}}",
              400, "stream_options.include_usage", "expected a boolean");
    parse_err(C, "{\"prompt\": \"x\", \"echo\": true}", 400, "echo", "echo: returning the prompt");
    parse_err(C, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 10}}", 400, "logit_bias",
              "not supported");
    parse_err(C, "{\"prompt\": \"x\", \"suffix\": \"end\"}", 400, "suffix", "not supported");
    parse_err(C, "{\"prompt\": \"x\", \"n\": 2, \"best_of\": 3}", 400, "best_of", "best_of");
    parse_err(H, "{\"model\": \"tiny\"}", 400, "messages", "messages: this field is required");
    parse_err(H, "{\"messages\": []}", 400, "messages", "at least one message");
    parse_err(H, "{\"messages\": \"hi\"}", 400, "messages",
              "messages: expected a list of messages, got string");
    parse_err(H, "{\"messages\": [1]}", 400, "messages",
              "messages[0]: expected an object, got integer");
    parse_err(H, "{\"messages\": [{}], \"tool_choice\": \"sometimes\"}", 400, "tool_choice",
              "got \"sometimes\"");
    parse_err(H, "{\"messages\": [{}], \"tools\": {}}", 400, "tools", "tools: expected a list");
    parse_err(H, "{\"messages\": [{}], \"chat_template_kwargs\": {\"thinking\": 1}}", 400,
              "thinking", "thinking: expected a boolean");
}

static void test_error_json(void **state) {
    (void)state;
    ds_oai_error e;
    assert_int_equal(ds_oai_errorf(&e, 404, "model", "model_not_found", "no %s", "such"), DS_ERR);
    char *s = ds_oai_error_json(&e);
    json_t *j = json_loads(s, 0, NULL);
    assert_non_null(j);
    json_t *o = json_object_get(j, "error");
    assert_string_equal(json_string_value(json_object_get(o, "message")), "no such");
    assert_string_equal(json_string_value(json_object_get(o, "type")), "invalid_request_error");
    assert_string_equal(json_string_value(json_object_get(o, "param")), "model");
    assert_string_equal(json_string_value(json_object_get(o, "code")), "model_not_found");
    json_decref(j);
    free(s);
    ds_oai_errorf(&e, 503, NULL, NULL, "busy");
    s = ds_oai_error_json(&e);
    j = json_loads(s, 0, NULL);
    o = json_object_get(j, "error");
    assert_string_equal(json_string_value(json_object_get(o, "type")), "server_error");
    assert_true(json_is_null(json_object_get(o, "param")));
    assert_true(json_is_null(json_object_get(o, "code")));
    json_decref(j);
    free(s);
}

static void test_fit_context(void **state) {
    (void)state;
    ds_oai_request r;
    ds_oai_error e;
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": \"x\", \"max_tokens\": 200}", &r);
    assert_int_equal(ds_oai_fit_context(&r, 100, 300, &e), DS_OK);
    assert_int_equal(r.params.max_tokens, 200); /* exactly fills the context: allowed */
    assert_int_equal(ds_oai_fit_context(&r, 101, 300, &e), DS_ERR);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.code, "context_length_exceeded");
    assert_non_null(strstr(e.message, "maximum context length is 300 tokens"));
    assert_non_null(
        strstr(e.message, "requested 301 tokens (101 in the prompt, 200 in the completion)"));
    ds_oai_request_free(&r);

    /* defaults: completions 16 (capped by what is left), chat the rest of the context */
    parse_ok(DS_OAI_COMPLETIONS, "{\"prompt\": \"x\", \"min_tokens\": 50}", &r);
    assert_int_equal(ds_oai_fit_context(&r, 10, 300, &e), DS_OK);
    assert_int_equal(r.params.max_tokens, 16);
    assert_int_equal(r.params.min_tokens, 16); /* clamped */
    assert_int_equal(ds_oai_fit_context(&r, 295, 300, &e), DS_OK);
    assert_int_equal(r.params.max_tokens, 5);
    assert_int_equal(ds_oai_fit_context(&r, 300, 300, &e), DS_ERR);
    assert_non_null(strstr(e.message, "the prompt has 300 tokens"));
    assert_int_equal(ds_oai_fit_context(&r, 0, 300, &e), DS_ERR);
    assert_non_null(strstr(e.message, "prompt: the prompt is empty"));
    ds_oai_request_free(&r);
    parse_ok(DS_OAI_CHAT, "{\"messages\": [{}]}", &r);
    assert_int_equal(ds_oai_fit_context(&r, 120, 300, &e), DS_OK);
    assert_int_equal(r.params.max_tokens, 180);
    ds_oai_request_free(&r);
}

/* ---- responses ---- */

static void test_lossy_strings(void **state) {
    (void)state;
    json_t *j = ds_oai_json_string_lossy("a\xe4\xb8", 3); /* a + 2 bytes of a 3-byte char */
    assert_string_equal(json_string_value(j), "a\xef\xbf\xbd\xef\xbf\xbd");
    json_decref(j);
    j = ds_oai_json_string_lossy("\xe4\xb8\xad!", 4); /* valid: unchanged */
    assert_string_equal(json_string_value(j), "\xe4\xb8\xad!");
    json_decref(j);
    j = ds_oai_json_string_lossy("\xed\xa0\x80"
                                 "x\xc0\xaf",
                                 6); /* surrogate, overlong */
    assert_string_equal(json_string_value(j), "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbdx\xef\xbf\xbd"
                                              "\xef\xbf\xbd");
    json_decref(j);
    j = ds_oai_json_string_lossy("a\0b", 3); /* NUL is valid JSON text (escaped) */
    assert_int_equal(json_string_length(j), 3);
    json_decref(j);
}

static int32_t id_of(const char *piece) {
    int32_t *ids = NULL;
    int n = 0;
    ds_err err;
    if (ds_tok_encode(tok, piece, strlen(piece), 0, &ids, &n, &err) || n != 1)
        fail_msg("'%s' is not one token (%d)", piece, n);
    int32_t id = ids[0];
    free(ids);
    return id;
}

/* The id whose bytes are exactly b[0..n) (single bytes are tokens in every vocabulary). */
static int32_t id_of_bytes(const char *b, size_t n) {
    for (int32_t id = 0; id < ds_tok_n_ranks(tok); id++) {
        size_t len;
        const char *t = ds_tok_token_bytes(tok, id, &len);
        if (t && len == n && memcmp(t, b, n) == 0) return id;
    }
    fail_msg("no token has these %zu bytes", n);
    return -1;
}

static ds_oai_event ev_tok(int index, int32_t token, const char *text, float lp) {
    ds_oai_event ev;
    memset(&ev, 0, sizeof ev);
    ev.index = index;
    ev.token = token;
    ev.text = text;
    ev.text_len = strlen(text);
    ev.logprob = lp;
    return ev;
}

static void test_completion_response(void **state) {
    (void)state;
    /* two single-byte tokens and one 2-byte character split over two byte tokens */
    int32_t a = id_of("a"), b = id_of("b");
    int32_t hi = id_of_bytes("\xc3", 1), lo = id_of_bytes("\xa9", 1);
    ds_oai_resp_ctx c = {DS_OAI_COMPLETIONS, "cmpl-1", "tiny", 1700000000, 2, tok, 0, 0,
                         {0, 0, 0},          0,        0};
    ds_oai_choice ch[2];
    memset(ch, 0, sizeof ch);
    ds_err err;
    ds_oai_event ev = ev_tok(0, a, "a", -0.5f);
    ev.n_top = 2;
    ev.top_ids[0] = a, ev.top_logprobs[0] = -0.5f;
    ev.top_ids[1] = b, ev.top_logprobs[1] = -1.25f;
    ev.n_generated = 1;
    assert_int_equal(ds_oai_choice_add(&c, &ch[0], &ev, &err), DS_OK);
    ev = ev_tok(0, hi, "", -INFINITY); /* byte token 0xc3: first half of "é", text held back */
    ev.n_generated = 2;
    assert_int_equal(ds_oai_choice_add(&c, &ch[0], &ev, &err), DS_OK);
    ev = ev_tok(0, lo, "\xc3\xa9", -2.0f);
    ev.n_generated = 3;
    assert_int_equal(ds_oai_choice_add(&c, &ch[0], &ev, &err), DS_OK);
    ev = ev_tok(0, b, "b", -0.125f);
    ev.n_generated = 4;
    assert_int_equal(ds_oai_choice_add(&c, &ch[0], &ev, &err), DS_OK);
    ev = ev_tok(0, -1, "", 0);
    ev.finish = DS_FINISH_LENGTH;
    ev.n_generated = 4;
    assert_int_equal(ds_oai_choice_add(&c, &ch[0], &ev, &err), DS_OK);
    ev = ev_tok(1, b, "b", -0.1f);
    ev.n_generated = 1;
    ds_oai_choice_add(&c, &ch[1], &ev, &err);
    ev = ev_tok(1, -1, "", 0);
    ev.finish = DS_FINISH_STOP;
    ev.n_generated = 1;
    ds_oai_choice_add(&c, &ch[1], &ev, &err);

    json_t *r = ds_oai_response(&c, ch, 2, 6);
    assert_string_equal(json_string_value(json_object_get(r, "object")), "text_completion");
    assert_string_equal(json_string_value(json_object_get(r, "id")), "cmpl-1");
    assert_int_equal(json_integer_value(json_object_get(r, "created")), 1700000000);
    json_t *c0 = json_array_get(json_object_get(r, "choices"), 0);
    assert_int_equal(json_integer_value(json_object_get(c0, "index")), 0);
    assert_string_equal(json_string_value(json_object_get(c0, "text")), "a\xc3\xa9"
                                                                        "b");
    assert_string_equal(json_string_value(json_object_get(c0, "finish_reason")), "length");
    json_t *lp = json_object_get(c0, "logprobs");
    json_t *toks = json_object_get(lp, "tokens");
    assert_int_equal(json_array_size(toks), 4);
    assert_string_equal(json_string_value(json_array_get(toks, 0)), "a");
    assert_string_equal(json_string_value(json_array_get(toks, 1)), "\xef\xbf\xbd"); /* half */
    json_t *tl = json_object_get(lp, "token_logprobs");
    assert_true(json_real_value(json_array_get(tl, 0)) == -0.5);
    assert_true(json_real_value(json_array_get(tl, 1)) == -9999.0); /* -inf is not JSON */
    /* text_offset counts characters: "a" 0, 0xc3 starts "é" at 1, 0xa9 continues it (still 2),
     * "b" at 2 */
    json_t *off = json_object_get(lp, "text_offset");
    assert_int_equal(json_integer_value(json_array_get(off, 0)), 0);
    assert_int_equal(json_integer_value(json_array_get(off, 1)), 1);
    assert_int_equal(json_integer_value(json_array_get(off, 2)), 2);
    assert_int_equal(json_integer_value(json_array_get(off, 3)), 2);
    json_t *top0 = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    assert_int_equal(json_object_size(top0), 2);
    assert_true(json_real_value(json_object_get(top0, "b")) == -1.25);
    json_t *c1 = json_array_get(json_object_get(r, "choices"), 1);
    assert_int_equal(json_integer_value(json_object_get(c1, "index")), 1);
    assert_string_equal(json_string_value(json_object_get(c1, "finish_reason")), "stop");
    json_t *u = json_object_get(r, "usage");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 6);
    assert_int_equal(json_integer_value(json_object_get(u, "completion_tokens")), 5);
    assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")), 11);
    json_decref(r);
    ds_oai_choice_free(&ch[0]);
    ds_oai_choice_free(&ch[1]);
}

static void test_chat_response_and_chunks(void **state) {
    (void)state;
    int32_t a = id_of("a"), b = id_of("b");
    ds_oai_resp_ctx c = {DS_OAI_CHAT, "chatcmpl-9", "tiny", 5, 1, tok, 0, 0, {0, 0, 0}, 0, 0};
    ds_oai_choice ch;
    memset(&ch, 0, sizeof ch);
    ds_err err;
    ds_oai_event ev = ev_tok(0, a, "a", -0.25f);
    ev.n_top = 1;
    ev.top_ids[0] = b, ev.top_logprobs[0] = -3.0f;
    ds_oai_choice_add(&c, &ch, &ev, &err);
    ev = ev_tok(0, -1, "", 0);
    ev.finish = DS_FINISH_STOP;
    ev.n_generated = 1;
    ds_oai_choice_add(&c, &ch, &ev, &err);
    json_t *r = ds_oai_response(&c, &ch, 1, 3);
    assert_string_equal(json_string_value(json_object_get(r, "object")), "chat.completion");
    json_t *c0 = json_array_get(json_object_get(r, "choices"), 0);
    json_t *msg = json_object_get(c0, "message");
    assert_string_equal(json_string_value(json_object_get(msg, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "a");
    json_t *content = json_object_get(json_object_get(c0, "logprobs"), "content");
    assert_int_equal(json_array_size(content), 1);
    json_t *e0 = json_array_get(content, 0);
    assert_string_equal(json_string_value(json_object_get(e0, "token")), "a");
    assert_true(json_real_value(json_object_get(e0, "logprob")) == -0.25);
    assert_int_equal(json_integer_value(json_array_get(json_object_get(e0, "bytes"), 0)), 'a');
    json_t *t0 = json_array_get(json_object_get(e0, "top_logprobs"), 0);
    assert_string_equal(json_string_value(json_object_get(t0, "token")), "b");
    assert_true(json_real_value(json_object_get(t0, "logprob")) == -3.0);
    json_decref(r);
    ds_oai_choice_free(&ch);

    /* stream chunks */
    memset(&ch, 0, sizeof ch);
    json_t *role = ds_oai_chunk_role(&c, 2);
    json_t *rc0 = json_array_get(json_object_get(role, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(role, "object")),
                        "chat.completion.chunk");
    assert_int_equal(json_integer_value(json_object_get(rc0, "index")), 2);
    assert_string_equal(json_string_value(json_object_get(json_object_get(rc0, "delta"), "role")),
                        "assistant");
    json_decref(role);

    c.logprobs = -1;
    ev = ev_tok(0, a, "", -1); /* held-back text, no logprobs wanted: nothing to send */
    assert_null(ds_oai_chunk(&c, &ch, &ev));
    ev = ev_tok(0, b, "ab", -1);
    json_t *k = ds_oai_chunk(&c, &ch, &ev);
    json_t *k0 = json_array_get(json_object_get(k, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(k0, "delta"), "content")),
                        "ab");
    assert_true(json_is_null(json_object_get(k0, "finish_reason")));
    assert_true(json_is_null(json_object_get(k0, "logprobs")));
    json_decref(k);
    ev = ev_tok(0, -1, "", 0);
    ev.finish = DS_FINISH_LENGTH;
    ev.n_generated = 2;
    k = ds_oai_chunk(&c, &ch, &ev);
    k0 = json_array_get(json_object_get(k, "choices"), 0);
    assert_int_equal(json_object_size(json_object_get(k0, "delta")), 0); /* closing delta: {} */
    assert_string_equal(json_string_value(json_object_get(k0, "finish_reason")), "length");
    assert_int_equal(ch.n_generated, 2);
    assert_int_equal(ch.finish, DS_FINISH_LENGTH);

    size_t n;
    char *sse = ds_oai_sse(k, &n);
    assert_int_equal(n, strlen(sse));
    assert_memory_equal(sse, "data: {\"id\":\"chatcmpl-9\"", 24);
    assert_string_equal(sse + n - 2, "\n\n");
    assert_null(strchr(sse, '\n') == sse + n - 2 ? NULL : "newline inside the event");
    json_t *back = json_loadb(sse + 6, n - 8, 0, NULL);
    assert_non_null(back);
    json_decref(back);
    free(sse);

    json_t *u = ds_oai_chunk_usage(&c, 3, 7);
    assert_int_equal(json_array_size(json_object_get(u, "choices")), 0);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(u, "usage"), "total_tokens")), 10);
    json_decref(u);
}

static void test_completion_chunk_logprobs(void **state) {
    (void)state;
    int32_t a = id_of("a");
    ds_oai_resp_ctx c = {DS_OAI_COMPLETIONS, "cmpl-2", "tiny", 5, 0, tok, 0, 0, {0, 0, 0}, 0, 0};
    ds_oai_choice ch;
    memset(&ch, 0, sizeof ch);
    /* a held-back token still sends its logprobs (with empty text) */
    ds_oai_event ev = ev_tok(3, a, "", -0.75f);
    json_t *k = ds_oai_chunk(&c, &ch, &ev);
    assert_non_null(k);
    json_t *k0 = json_array_get(json_object_get(k, "choices"), 0);
    assert_int_equal(json_integer_value(json_object_get(k0, "index")), 3);
    assert_string_equal(json_string_value(json_object_get(k0, "text")), "");
    json_t *lp = json_object_get(k0, "logprobs");
    assert_string_equal(json_string_value(json_array_get(json_object_get(lp, "tokens"), 0)), "a");
    assert_int_equal(json_object_size(json_array_get(json_object_get(lp, "top_logprobs"), 0)), 0);
    json_decref(k);
    ev = ev_tok(3, a, "aa", -0.75f);
    k = ds_oai_chunk(&c, &ch, &ev);
    k0 = json_array_get(json_object_get(k, "choices"), 0);
    lp = json_object_get(k0, "logprobs");
    /* offsets continue across chunks */
    assert_int_equal(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 0)), 1);
    json_decref(k);
}

static void test_metrics_text(void **state) {
    (void)state;
    ds_err err;
    ds_metrics *m = ds_metrics_new(&err);
    assert_non_null(m);
    ds_metrics_observe(m, DS_HIST_TTFT, 0.003);
    ds_metrics_observe(m, DS_HIST_TTFT, 0.5);
    ds_metrics_observe(m, DS_HIST_TTFT, 10000.0);
    ds_metrics_observe(m, DS_HIST_ITL, 0.02);
    ds_engine_stats st;
    memset(&st, 0, sizeof st);
    st.running = 3;
    st.waiting = 2;
    st.pages_total = 200;
    st.pages_used = 50;
    st.slots_total = 8;
    st.slots_used = 2;
    st.prompt_tokens_total = 1234;
    st.generation_tokens_total = 99;
    st.preemptions_total = 4;
    st.finished[DS_FINISH_STOP] = 7;
    st.finished[DS_FINISH_ABORT] = 1;
    size_t len;
    char *t = ds_metrics_render(m, &st, "ti\"ny", &len, &err);
    assert_non_null(t);
    assert_int_equal(len, strlen(t));
#define HAS(s)                                                                                     \
    do {                                                                                           \
        if (!strstr(t, s)) fail_msg("metrics lack: %s\n%s", s, t);                                 \
    } while (0)
    HAS("# TYPE deltaserve:num_requests_running gauge\n");
    HAS("deltaserve:num_requests_running{model_name=\"ti\\\"ny\"} 3\n");
    HAS("deltaserve:num_requests_waiting{model_name=\"ti\\\"ny\"} 2\n");
    HAS("deltaserve:kv_cache_usage_perc{model_name=\"ti\\\"ny\"} 0.25\n");
    HAS("deltaserve:state_slot_usage_perc{model_name=\"ti\\\"ny\"} 0.25\n");
    HAS("deltaserve:prompt_tokens_total{model_name=\"ti\\\"ny\"} 1234\n");
    HAS("deltaserve:generation_tokens_total{model_name=\"ti\\\"ny\"} 99\n");
    HAS("deltaserve:num_preemptions_total{model_name=\"ti\\\"ny\"} 4\n");
    HAS("deltaserve:request_success_total{model_name=\"ti\\\"ny\",finished_reason=\"stop\"} 7\n");
    HAS("deltaserve:request_success_total{model_name=\"ti\\\"ny\",finished_reason=\"length\"} 0\n");
    HAS("deltaserve:request_success_total{model_name=\"ti\\\"ny\",finished_reason=\"abort\"} 1\n");
    HAS("# TYPE deltaserve:time_to_first_token_seconds histogram\n");
    /* cumulative buckets */
    HAS("deltaserve:time_to_first_token_seconds_bucket{model_name=\"ti\\\"ny\",le=\"0.001\"} 0\n");
    HAS("deltaserve:time_to_first_token_seconds_bucket{model_name=\"ti\\\"ny\",le=\"0.005\"} 1\n");
    HAS("deltaserve:time_to_first_token_seconds_bucket{model_name=\"ti\\\"ny\",le=\"0.25\"} 1\n");
    HAS("deltaserve:time_to_first_token_seconds_bucket{model_name=\"ti\\\"ny\",le=\"0.5\"} 2\n");
    HAS("deltaserve:time_to_first_token_seconds_bucket{model_name=\"ti\\\"ny\",le=\"2560\"} 2\n");
    HAS("deltaserve:time_to_first_token_seconds_bucket{model_name=\"ti\\\"ny\",le=\"+Inf\"} 3\n");
    HAS("deltaserve:time_to_first_token_seconds_count{model_name=\"ti\\\"ny\"} 3\n");
    HAS("deltaserve:time_to_first_token_seconds_sum{model_name=\"ti\\\"ny\"} 10000.503");
    HAS("deltaserve:inter_token_latency_seconds_count{model_name=\"ti\\\"ny\"} 1\n");
    HAS("deltaserve:inter_token_latency_seconds_bucket{model_name=\"ti\\\"ny\",le=\"0.01\"} 0\n");
    HAS("deltaserve:inter_token_latency_seconds_bucket{model_name=\"ti\\\"ny\",le=\"0.025\"} 1\n");
    HAS("deltaserve:e2e_request_latency_seconds_count{model_name=\"ti\\\"ny\"} 0\n");
    /* vLLM's names for the same numbers (its dashboards query these), and its older aliases */
    HAS("# TYPE vllm:num_requests_running gauge\n");
    HAS("vllm:num_requests_running{model_name=\"ti\\\"ny\"} 3\n");
    HAS("vllm:prompt_tokens_total{model_name=\"ti\\\"ny\"} 1234\n");
    HAS("vllm:generation_tokens_total{model_name=\"ti\\\"ny\"} 99\n");
    HAS("vllm:kv_cache_usage_perc{model_name=\"ti\\\"ny\"} 0.25\n");
    HAS("vllm:gpu_cache_usage_perc{model_name=\"ti\\\"ny\"} 0.25\n");
    HAS("vllm:time_to_first_token_seconds_count{model_name=\"ti\\\"ny\"} 3\n");
    HAS("vllm:time_per_output_token_seconds_count{model_name=\"ti\\\"ny\"} 1\n");
    HAS("vllm:request_success_total{model_name=\"ti\\\"ny\",finished_reason=\"stop\"} 7\n");
#undef HAS
    free(t);
    ds_metrics_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion_defaults),
        cmocka_unit_test(test_completion_mapping),
        cmocka_unit_test(test_prompt_forms),
        cmocka_unit_test(test_chat_mapping),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_error_json),
        cmocka_unit_test(test_fit_context),
        cmocka_unit_test(test_lossy_strings),
        cmocka_unit_test(test_completion_response),
        cmocka_unit_test(test_chat_response_and_chunks),
        cmocka_unit_test(test_completion_chunk_logprobs),
        cmocka_unit_test(test_metrics_text),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
