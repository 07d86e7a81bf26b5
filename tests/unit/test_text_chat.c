/* test_text_chat.c — chat rendering against strings written by hand from docs/model.md §9.4 / §9.5
 * (and encoding_k3.py for K3 details), then the ids of markers and segment-wise encoding. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/chat.h"
#include "testutil.h"

#define KL DS_CHAT_KIMI_LINEAR
#define K3 DS_CHAT_K3

static ds_tokenizer *tok_kl, *tok_k3;

static int setup(void **state) {
    (void)state;
    ds_err err = {{0}};
    char *d = ds_test_src_path("tests/golden/tok/vocab768_kimi_linear");
    if (ds_tok_load(d, &tok_kl, &err) != DS_OK) fail_msg("%s", err.msg);
    free(d);
    d = ds_test_src_path("tests/golden/tok/vocab2048_k3");
    if (ds_tok_load(d, &tok_k3, &err) != DS_OK) fail_msg("%s", err.msg);
    free(d);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    ds_tok_free(tok_kl);
    ds_tok_free(tok_k3);
    return 0;
}

static void expect_text(ds_chat_format fmt, const char *msgs, const char *tools,
                        const ds_chat_opts *o, const char *want) {
    char *got = NULL;
    ds_err err = {{0}};
    if (ds_chat_render_text(NULL, fmt, msgs, tools, o, &got, &err) != DS_OK)
        fail_msg("render: %s", err.msg);
    if (strcmp(got, want)) {
        size_t k = 0;
        while (got[k] && got[k] == want[k]) k++;
        fail_msg("rendered text differs at byte %zu:\n got: %s\nwant: %s", k, got + k, want + k);
    }
    free(got);
}

static void expect_error(ds_chat_format fmt, const char *msgs, const char *tools,
                         const ds_chat_opts *o, const char *want) {
    int32_t *ids = NULL;
    int n = -1;
    ds_err err = {{0}};
    assert_int_equal(
        ds_chat_render(fmt == K3 ? tok_k3 : tok_kl, fmt, msgs, tools, o, &ids, &n, &err), DS_ERR);
    assert_null(ids);
    if (!strstr(err.msg, want)) fail_msg("error \"%s\" lacks \"%s\"", err.msg, want);
}

static int32_t *render_ids(const ds_tokenizer *t, ds_chat_format fmt, const char *msgs,
                           const char *tools, const ds_chat_opts *o, int *n) {
    int32_t *ids = NULL;
    ds_err err = {{0}};
    if (ds_chat_render(t, fmt, msgs, tools, o, &ids, n, &err) != DS_OK)
        fail_msg("render: %s", err.msg);
    return ids;
}

static int count_id(const int32_t *ids, int n, int32_t id) {
    int c = 0;
    for (int i = 0; i < n; i++) c += ids[i] == id;
    return c;
}

/* ---- Kimi-Linear ---- */

static const char k_sys_user[] = "[{\"role\": \"system\", \"content\": \"You are terse.\"},"
                                 " {\"role\": \"user\", \"content\": \"Is 123 a prime?\"}]";

static void test_kl_system_user(void **state) {
    (void)state;
    expect_text(KL, k_sys_user, NULL, NULL,
                "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
                "<|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>");
    ds_chat_opts o;
    ds_chat_opts_default(&o);
    o.add_generation_prompt = 0;
    expect_text(KL, k_sys_user, NULL, &o,
                "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
                "<|im_user|>user<|im_middle|>Is 123 a prime?<|im_end|>");
}

static void test_kl_multi_turn_default_system(void **state) {
    (void)state;
    const char *m = "[{\"role\": \"user\", \"content\": \"Hi\", \"name\": \"ann\"},"
                    " {\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": "
                    "\"Hello\"}, {\"type\": \"text\", \"text\": \" there\"}]},"
                    " {\"role\": \"user\", \"content\": \"Bye\"}]";
    expect_text(KL, m, NULL, NULL,
                "<|im_system|>system<|im_middle|>You are a helpful assistant provided by "
                "Moonshot-AI.<|im_end|>"
                "<|im_user|>ann<|im_middle|>Hi<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>Hello there<|im_end|>"
                "<|im_user|>user<|im_middle|>Bye<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>");
    ds_chat_opts o;
    ds_chat_opts_default(&o);
    o.default_system_prompt = "Be brief.";
    expect_text(KL, "[{\"role\": \"user\", \"content\": null}]", NULL, &o,
                "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
                "<|im_user|>user<|im_middle|><|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>");
    expect_text(KL, "[]", NULL, &o, "<|im_assistant|>assistant<|im_middle|>");
}

static const char k_tools[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": "
    "\"Get weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": "
    "{\"type\": \"string\", \"minLength\": 1.0}}, \"required\": [\"city\"]}}}]";

static const char k_tool_conv[] =
    "[{\"role\": \"user\", \"content\": \"Weather in Paris?\"},"
    " {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"call_1\", \"type\": "
    "\"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": "
    "\"{\\\"city\\\": \\\"Paris\\\", \\\"days\\\": 2}\"}}]},"
    " {\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": \"{\\\"temp\\\": 18}\"},"
    " {\"role\": \"assistant\", \"content\": \"18 C.\"},"
    " {\"role\": \"user\", \"content\": \"And Rome?\"},"
    " {\"role\": \"assistant\", \"content\": \"Checking.\", \"tool_calls\": [{\"id\": "
    "\"functions.get_weather:1\", \"type\": \"function\", \"function\": {\"name\": "
    "\"get_weather\", \"arguments\": {\"city\": \"Rome\"}}}]},"
    " {\"role\": \"tool\", \"name\": \"get_weather\", \"tool_call_id\": "
    "\"functions.get_weather:1\", \"content\": \"20\"}]";

static void test_kl_tools_and_calls(void **state) {
    (void)state;
    /* Tools JSON compact in the given key order (Jinja tojson with (',', ':')); call ids
     * functions.NAME:n counted over the conversation; tool results point at them. */
    expect_text(KL, k_tool_conv, k_tools, NULL,
                "<|im_system|>tool_declare<|im_middle|>[{\"type\":\"function\",\"function\":"
                "{\"name\":\"get_weather\",\"description\":\"Get weather\",\"parameters\":"
                "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\","
                "\"minLength\":1.0}},\"required\":[\"city\"]}}}]<|im_end|>"
                "<|im_system|>system<|im_middle|>You are a helpful assistant provided by "
                "Moonshot-AI.<|im_end|>"
                "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
                "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                "{\"city\": \"Paris\", \"days\": 2}<|tool_call_end|><|tool_calls_section_end|>"
                "<|im_end|>"
                "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n"
                "{\"temp\": 18}<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>18 C.<|im_end|>"
                "<|im_user|>user<|im_middle|>And Rome?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>Checking.<|tool_calls_section_begin|>"
                "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
                "{\"city\": \"Rome\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
                "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\n"
                "20<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|>");
}

/* Kimi-Linear encodes the whole string with specials allowed: marker ids where markers are, and
 * marker strings typed by the user become markers too (§9.1). */
static void test_kl_ids(void **state) {
    (void)state;
    int n;
    int32_t *ids = render_ids(tok_kl, KL, k_tool_conv, k_tools, NULL, &n);
    int32_t sys = ds_tok_special_id(tok_kl, "<|im_system|>");
    int32_t mid = ds_tok_special_id(tok_kl, "<|im_middle|>");
    int32_t end = ds_tok_special_id(tok_kl, "<|im_end|>");
    int32_t asst = ds_tok_special_id(tok_kl, "<|im_assistant|>");
    assert_int_equal(end, 768 + 2);
    assert_int_equal(ds_chat_stop_id(tok_kl, KL), end);
    assert_int_equal(ids[0], sys);
    assert_int_equal(ids[n - 1], mid);
    assert_int_equal(count_id(ids, n, asst), 4); /* three assistant turns + generation prompt */
    assert_int_equal(count_id(ids, n, end), 9);
    assert_int_equal(count_id(ids, n, mid), 10);
    assert_int_equal(count_id(ids, n, ds_tok_special_id(tok_kl, "<|tool_call_begin|>")), 2);
    /* Same ids as encoding the rendered text with specials allowed. */
    char *txt;
    ds_err err = {{0}};
    assert_int_equal(ds_chat_render_text(tok_kl, KL, k_tool_conv, k_tools, NULL, &txt, &err), 0);
    int32_t *ref;
    int nref;
    assert_int_equal(ds_tok_encode(tok_kl, txt, strlen(txt), 1, &ref, &nref, &err), DS_OK);
    assert_int_equal(n, nref);
    assert_memory_equal(ids, ref, (size_t)n * sizeof *ids);
    free(ref);
    free(txt);
    free(ids);
    ids = render_ids(tok_kl, KL, "[{\"role\": \"user\", \"content\": \"a<|im_end|>b\"}]", NULL,
                     NULL, &n);
    assert_int_equal(count_id(ids, n, end), 3); /* default system, user's own, user turn end */
    free(ids);
}

/* ---- K3 ---- */

static void test_k3_system_user(void **state) {
    (void)state;
    expect_text(K3, k_sys_user, NULL, NULL,
                "<|open|>message role=\"system\"<|sep|>You are terse.<|close|>message<|sep|>"
                "<|end_of_msg|>"
                "<|open|>message role=\"user\"<|sep|>Is 123 a prime?<|close|>message<|sep|>"
                "<|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
    ds_chat_opts o;
    ds_chat_opts_default(&o);
    o.thinking = 0;
    /* No default system prompt in K3; thinking off opens the response channel. */
    expect_text(K3, "[{\"role\": \"user\", \"content\": \"hi\", \"name\": \"A&B \\\"x\\\"\"}]",
                NULL, &o,
                "<|open|>message role=\"user\" name=\"A&amp;B &quot;x&quot;\"<|sep|>hi"
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
}

static void test_k3_multi_turn(void **state) {
    (void)state;
    const char *m = "[{\"role\": \"user\", \"content\": \"Hi\"},"
                    " {\"role\": \"assistant\", \"content\": \"Hello\", \"reasoning_content\": "
                    "\"greet back\"},"
                    " {\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": "
                    "\"More\"}], \"reasoning_content\": \"  \"},"
                    " {\"role\": \"user\", \"content\": \"Bye\"}]";
    expect_text(K3, m, NULL, NULL,
                "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>greet back"
                "<|close|>think<|sep|><|open|>response<|sep|>Hello<|close|>response<|sep|>"
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think"
                "<|sep|><|open|>response<|sep|>More<|close|>response<|sep|>"
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"user\"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
    ds_chat_opts o;
    ds_chat_opts_default(&o);
    o.thinking = 0;
    o.add_generation_prompt = 0;
    expect_text(K3, m, NULL, &o,
                "<|open|>message role=\"user\"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>Hello"
                "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>More"
                "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"user\"<|sep|>Bye<|close|>message<|sep|><|end_of_msg|>");
}

static const char k_k3_tool_conv_text[] =
    "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the available "
    "tools, described in JSONSchema.\n\n```json\n[{\"function\":{\"description\":\"Get weather\","
    "\"name\":\"get_weather\",\"parameters\":{\"properties\":{\"city\":{\"minLength\":1.0,"
    "\"type\":\"string\"}},\"required\":[\"city\"],\"type\":\"object\"}},\"type\":\"function\"}]"
    "\n```<|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"user\"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|>"
    "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
    "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>"
    "<|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>"
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>{\"temp\": 18}"
    "<|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|>"
    "<|open|>response<|sep|>18 C.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"user\"<|sep|>And Rome?<|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|><|close|>think<|sep|>"
    "<|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
    "<|open|>call tool=\"get_weather\" index=\"1\"<|sep|>"
    "<|open|>argument key=\"city\" type=\"string\"<|sep|>Rome<|close|>argument<|sep|>"
    "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>20"
    "<|close|>message<|sep|><|end_of_msg|>"
    "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";

static void test_k3_tools_and_calls(void **state) {
    (void)state;
    expect_text(K3, k_tool_conv, k_tools, NULL, k_k3_tool_conv_text);
}

/* Results arriving out of call order are put back in order and named after their calls; argument
 * values typed and printed as Python's json.dumps; unparseable arguments go in a json block. */
static void test_k3_tool_results_order_and_arguments(void **state) {
    (void)state;
    const char *m =
        "[{\"role\": \"assistant\", \"content\": null, \"tool_calls\": ["
        "{\"id\": \"a\", \"type\": \"function\", \"function\": {\"name\": \"fa\", \"arguments\": "
        "\"{\\\"n\\\": 1.5, \\\"big\\\": 1e16, \\\"small\\\": 1e-5, \\\"f\\\": 100.0, "
        "\\\"z\\\": -0.0, \\\"t\\\": true, \\\"nil\\\": null, \\\"arr\\\": [1, 2.0, "
        "\\\"\\u00e9\\\"], "
        "\\\"obj\\\": {\\\"b\\\": 1, \\\"a\\\": \\\"x\\\\n\\\"}, \\\"s\\\": \\\"<|open|>\\\"}\"}},"
        "{\"id\": \"b\", \"type\": \"function\", \"function\": {\"name\": \"fb\", \"arguments\": "
        "\"{not json\"}},"
        "{\"id\": \"c\", \"type\": \"function\", \"function\": {\"name\": \"fc\", \"arguments\": "
        "\"  \"}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"c\", \"content\": \"rc\"},"
        " {\"role\": \"tool\", \"tool_call_id\": \"a\", \"name\": \"stale\", \"content\": \"ra\"},"
        " {\"role\": \"tool\", \"tool_call_id\": \"b\", \"content\": \"rb\"}]";
    ds_chat_opts o;
    ds_chat_opts_default(&o);
    o.thinking = 0;
    o.add_generation_prompt = 0;
    expect_text(K3, m, NULL, &o,
                "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"
                "<|close|>response<|sep|><|open|>tools<|sep|>"
                "<|open|>call tool=\"fa\" index=\"1\"<|sep|>"
                "<|open|>argument key=\"n\" type=\"number\"<|sep|>1.5<|close|>argument<|sep|>"
                "<|open|>argument key=\"big\" type=\"number\"<|sep|>1e+16<|close|>argument<|sep|>"
                "<|open|>argument key=\"small\" type=\"number\"<|sep|>1e-05<|close|>argument"
                "<|sep|>"
                "<|open|>argument key=\"f\" type=\"number\"<|sep|>100.0<|close|>argument<|sep|>"
                "<|open|>argument key=\"z\" type=\"number\"<|sep|>-0.0<|close|>argument<|sep|>"
                "<|open|>argument key=\"t\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>"
                "<|open|>argument key=\"nil\" type=\"null\"<|sep|>null<|close|>argument<|sep|>"
                "<|open|>argument key=\"arr\" type=\"array\"<|sep|>[1, 2.0, \"\xc3\xa9\"]"
                "<|close|>argument<|sep|>"
                "<|open|>argument key=\"obj\" type=\"object\"<|sep|>{\"b\": 1, \"a\": \"x\\n\"}"
                "<|close|>argument<|sep|>"
                "<|open|>argument key=\"s\" type=\"string\"<|sep|><|open|><|close|>argument<|sep|>"
                "<|close|>call<|sep|>"
                "<|open|>call tool=\"fb\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>"
                "{not json<|close|>json<|sep|><|close|>call<|sep|>"
                "<|open|>call tool=\"fc\" index=\"3\"<|sep|><|close|>call<|sep|>"
                "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"tool\" tool=\"fa\" index=\"1\"<|sep|>ra<|close|>message"
                "<|sep|><|end_of_msg|>"
                "<|open|>message role=\"tool\" tool=\"fb\" index=\"2\"<|sep|>rb<|close|>message"
                "<|sep|><|end_of_msg|>"
                "<|open|>message role=\"tool\" tool=\"fc\" index=\"3\"<|sep|>rc<|close|>message"
                "<|sep|><|end_of_msg|>");
    /* Argument names of any length survive as attribute text. */
    char key[101], msg[512], *txt;
    memset(key, 'k', 100);
    key[100] = 0;
    snprintf(msg, sizeof msg,
             "[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"function\": "
             "{\"name\": \"f\", \"arguments\": {\"%s\": 1}}}]}]",
             key);
    ds_err err = {{0}};
    assert_int_equal(ds_chat_render_text(NULL, K3, msg, NULL, &o, &txt, &err), DS_OK);
    char want[160];
    snprintf(want, sizeof want, "argument key=\"%s\" type=\"number\"<|sep|>1<", key);
    assert_non_null(strstr(txt, want));
    free(txt);
    /* An unmatched id leaves the run as given; names come from `name`, then call order. */
    const char *m2 = "[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": ["
                     "{\"id\": \"a\", \"function\": {\"name\": \"fa\", \"arguments\": \"{}\"}},"
                     "{\"id\": \"b\", \"function\": {\"name\": \"fb\", \"arguments\": \"{}\"}}]},"
                     " {\"role\": \"tool\", \"tool_call_id\": \"zz\", \"content\": \"1\"},"
                     " {\"role\": \"tool\", \"name\": \"named\", \"content\": \"2\"}]";
    expect_text(K3, m2, NULL, &o,
                "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"
                "<|close|>response<|sep|><|open|>tools<|sep|>"
                "<|open|>call tool=\"fa\" index=\"1\"<|sep|><|close|>call<|sep|>"
                "<|open|>call tool=\"fb\" index=\"2\"<|sep|><|close|>call<|sep|>"
                "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"tool\" tool=\"fa\" index=\"1\"<|sep|>1<|close|>message"
                "<|sep|><|end_of_msg|>"
                "<|open|>message role=\"tool\" tool=\"named\" index=\"2\"<|sep|>2<|close|>message"
                "<|sep|><|end_of_msg|>");
}

static void test_k3_system_notes(void **state) {
    (void)state;
    ds_chat_opts o;
    ds_chat_opts_default(&o);
    o.thinking_effort = "high";
    o.tool_choice = "required";
    o.response_format_json = "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"r\", "
                             "\"schema\": {\"type\": \"object\", \"properties\": {}}}}";
    expect_text(K3, "[{\"role\": \"user\", \"content\": \"go\"}]", NULL, &o,
                "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>"
                "`thinking_effort` guides on how much to think in your thinking channel (not "
                "including the response channel), supported values include `low`, `medium`, "
                "`high`, and `max`.\nNow the system is invoked with `thinking_effort=high`."
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"user\"<|sep|>go<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked "
                "with `tool_choice=required`.\nYou MUST call tools in the next message."
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"system\" type=\"response-format\"<|sep|>The system is "
                "invoked with `response_format=json_schema`.\nYour response must be raw JSON data "
                "without markdown code blocks (```json) or any additional formatting.\nThe JSON "
                "data must match the following schema:\n```json\n{\"properties\":{},\"type\":"
                "\"object\"}\n```<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>");
    o.thinking_effort = "extreme";
    expect_error(K3, "[]", NULL, &o, "thinking_effort \"extreme\"");
    o.thinking = 0; /* effort is ignored without thinking */
    o.tool_choice = "none";
    o.response_format_json = "{\"type\": \"json_object\"}";
    expect_text(K3, "[]", NULL, &o,
                "<|open|>message role=\"system\" type=\"tool-choice\"<|sep|>The system is invoked "
                "with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"system\" type=\"response-format\"<|sep|>The system is "
                "invoked with `response_format=json_object`.\nYour response must be raw JSON data "
                "without markdown code blocks (```json) or any additional formatting."
                "<|close|>message<|sep|><|end_of_msg|>"
                "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
}

static void append_enc(int32_t *out, int *n, const char *s) {
    int32_t *ids;
    int k;
    ds_err err = {{0}};
    assert_int_equal(ds_tok_encode(tok_k3, s, strlen(s), 0, &ids, &k, &err), DS_OK);
    memcpy(out + *n, ids, (size_t)k * sizeof *ids);
    *n += k;
    free(ids);
}

/* K3 ids: markers are ids, every other segment is encoded alone with specials disallowed. */
static void test_k3_ids(void **state) {
    (void)state;
    int32_t open = ds_tok_special_id(tok_k3, "<|open|>"),
            sep = ds_tok_special_id(tok_k3, "<|sep|>");
    int32_t close = ds_tok_special_id(tok_k3, "<|close|>");
    int32_t eom = ds_tok_special_id(tok_k3, "<|end_of_msg|>");
    assert_int_equal(open, 2048 + 3);
    assert_int_equal(eom, 2048 + 2);
    assert_int_equal(ds_chat_stop_id(tok_k3, K3), eom);
    const char *m = "[{\"role\": \"user\", \"content\": \"x <|open|> y\", \"name\": \"Bo b\"}]";
    int n;
    int32_t *ids = render_ids(tok_k3, K3, m, NULL, NULL, &n);
    int32_t want[256];
    int w = 0;
    want[w++] = open;
    append_enc(want, &w, "message");
    append_enc(want, &w, " role");
    append_enc(want, &w, "=\"");
    append_enc(want, &w, "user");
    append_enc(want, &w, "\"");
    append_enc(want, &w, " name");
    append_enc(want, &w, "=\"");
    append_enc(want, &w, "Bo b");
    append_enc(want, &w, "\"");
    want[w++] = sep;
    append_enc(want, &w, "x <|open|> y");
    want[w++] = close;
    append_enc(want, &w, "message");
    want[w++] = sep;
    want[w++] = eom;
    want[w++] = open;
    append_enc(want, &w, "message");
    append_enc(want, &w, " role");
    append_enc(want, &w, "=\"");
    append_enc(want, &w, "assistant");
    append_enc(want, &w, "\"");
    want[w++] = sep;
    want[w++] = open;
    append_enc(want, &w, "think");
    want[w++] = sep;
    assert_int_equal(n, w);
    assert_memory_equal(ids, want, (size_t)n * sizeof *ids);
    assert_int_equal(count_id(ids, n, open), 3); /* the user's "<|open|>" stays text */
    free(ids);
    /* The whole tool conversation decodes back to its text, with 8 message ends. */
    char *txt;
    ds_err err = {{0}};
    assert_int_equal(ds_chat_render_text(tok_k3, K3, k_tool_conv, k_tools, NULL, &txt, &err), 0);
    ids = render_ids(tok_k3, K3, k_tool_conv, k_tools, NULL, &n);
    assert_int_equal(count_id(ids, n, eom), 8);
    char *back;
    size_t bl;
    assert_int_equal(ds_tok_decode(tok_k3, ids, n, 0, &back, &bl, &err), DS_OK);
    assert_string_equal(back, txt);
    free(back);
    free(ids);
    free(txt);
    /* Seams matter: `="(` would be one regex piece in the joined text, but `="` and `(x` are
     * separate segments, so the ids differ from encoding the joined text. */
    const char *m2 = "[{\"role\": \"user\", \"content\": \"hi\", \"name\": \"(x).\"}]";
    assert_int_equal(ds_chat_render_text(tok_k3, K3, m2, NULL, NULL, &txt, &err), 0);
    ids = render_ids(tok_k3, K3, m2, NULL, NULL, &n);
    int32_t *joined;
    int nj;
    assert_int_equal(ds_tok_encode(tok_k3, txt, strlen(txt), 1, &joined, &nj, &err), DS_OK);
    assert_true(n != nj || memcmp(ids, joined, (size_t)n * sizeof *ids) != 0);
    assert_int_equal(ds_tok_decode(tok_k3, ids, n, 0, &back, &bl, &err), DS_OK);
    assert_string_equal(back, txt);
    free(back);
    free(joined);
    free(ids);
    free(txt);
    /* A K3 prompt needs K3 markers. */
    ids = NULL;
    assert_int_equal(ds_chat_render(tok_kl, K3, "[]", NULL, NULL, &ids, &n, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "<|open|>"));
}

/* K3 against Moonshot's own encoder (encoding_k3.py, run by make_chat_golden.py): same text and,
 * segment by segment through tiktoken, the same ids — covering reordered tool results, argument
 * typing, json blocks, dynamic tool declarations, reasoning, and the system notes. */
static void test_k3_matches_reference_encoder(void **state) {
    (void)state;
    char *path = ds_test_src_path("tests/golden/tok/chat_k3.json");
    json_error_t je;
    json_t *g = json_load_file(path, 0, &je);
    if (!g) fail_msg("%s:%d: %s", path, je.line, je.text);
    free(path);
    assert_true(json_array_size(g) >= 4);
    size_t i;
    json_t *c;
    json_array_foreach(g, i, c) {
        char *m = json_dumps(json_object_get(c, "messages"), 0);
        json_t *tj = json_object_get(c, "tools"), *o = json_object_get(c, "opts");
        char *tools = json_is_null(tj) ? NULL : json_dumps(tj, 0);
        ds_chat_opts op;
        ds_chat_opts_default(&op);
        if (json_object_get(o, "thinking"))
            op.thinking = json_is_true(json_object_get(o, "thinking"));
        if (json_object_get(o, "add_generation_prompt"))
            op.add_generation_prompt = json_is_true(json_object_get(o, "add_generation_prompt"));
        op.tool_choice = json_string_value(json_object_get(o, "tool_choice"));
        op.thinking_effort = json_string_value(json_object_get(o, "thinking_effort"));
        json_t *rfj = json_object_get(o, "response_format");
        char *rf = rfj ? json_dumps(rfj, 0) : NULL;
        op.response_format_json = rf;
        char *text;
        ds_err err = {{0}};
        if (ds_chat_render_text(tok_k3, K3, m, tools, &op, &text, &err) != DS_OK)
            fail_msg("case %zu: %s", i, err.msg);
        assert_string_equal(text, json_string_value(json_object_get(c, "text")));
        int n;
        int32_t *ids = render_ids(tok_k3, K3, m, tools, &op, &n);
        json_t *want = json_object_get(c, "ids");
        assert_int_equal(n, json_array_size(want));
        for (int k = 0; k < n; k++)
            if (ids[k] != json_integer_value(json_array_get(want, (size_t)k)))
                fail_msg("case %zu id %d: got %d, reference %lld", i, k, ids[k],
                         json_integer_value(json_array_get(want, (size_t)k)));
        free(ids);
        free(text);
        free(rf);
        free(tools);
        free(m);
    }
    json_decref(g);
}

/* ---- errors and format detection ---- */

static void test_bad_messages(void **state) {
    (void)state;
    for (int f = 0; f < 2; f++) {
        ds_chat_format fmt = f ? K3 : KL;
        expect_error(fmt, "{\"role\": \"user\"}", NULL, NULL,
                     "messages: expected a JSON array, found an object");
        expect_error(fmt, "[{\"role\": \"user\"", NULL, NULL, "messages: invalid JSON");
        expect_error(fmt, "[{\"content\": \"x\"}]", NULL, NULL, "messages[0].role: missing");
        expect_error(fmt, "[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"bot\"}]", NULL,
                     NULL, "messages[1].role: unknown role \"bot\"");
        expect_error(fmt, "[{\"role\": 3}]", NULL, NULL,
                     "messages[0].role: expected a string, found a number");
        expect_error(fmt, "[{\"role\": \"user\", \"content\": 5}]", NULL, NULL,
                     "messages[0].content: expected a string, null or an array of text parts, "
                     "found a number");
        expect_error(fmt,
                     "[{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", "
                     "\"image_url\": {}}]}]",
                     NULL, NULL,
                     "messages[0].content[0].type: expected \"text\", found "
                     "\"image_url\"");
        expect_error(fmt, "[{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]", NULL, NULL,
                     "messages[0].content[0].text");
        expect_error(fmt, "[{\"role\": \"user\", \"content\": \"\", \"name\": 1}]", NULL, NULL,
                     "messages[0].name: expected a string");
        expect_error(fmt,
                     "[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": "
                     "\"1\", \"function\": {\"arguments\": \"{}\"}}]}]",
                     NULL, NULL, "messages[0].tool_calls[0].function.name");
        expect_error(fmt, "[]", "{\"a\": 1}", NULL, "tools: expected a JSON array");
        expect_error(fmt, "[\"hi\"]", NULL, NULL,
                     "messages[0]: expected an object, found a "
                     "string");
    }
    expect_error(K3, "[{\"role\": \"tool\", \"content\": \"x\"}]", NULL, NULL,
                 "messages[0]: a tool result needs a tool name");
    expect_error(K3,
                 "[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"1\", "
                 "\"function\": {\"name\": \"f\", \"arguments\": \"[1, 2]\"}}]}]",
                 NULL, NULL,
                 "messages[0].tool_calls[0].function.arguments: expected a JSON object, found an "
                 "array");
}

static void write(const char *dir, const char *name, const char *body) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    assert_int_equal(ds_test_write_file(p, body, strlen(body)), 0);
}

static void test_format_from_dir(void **state) {
    (void)state;
    ds_err err = {{0}};
    ds_chat_format f = KL;
    char *d = ds_test_src_path("tests/golden/tok/vocab2048_k3");
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_OK);
    assert_int_equal(f, K3);
    free(d);
    d = ds_test_src_path("tests/golden/tok/vocab768_kimi_linear");
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_OK);
    assert_int_equal(f, KL);
    free(d);
    d = ds_test_tmpdir();
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "cannot tell the chat format"));
    write(d, "config.json",
          "{\"model_type\": \"kimi_k3\", \"text_config\": {\"model_type\": "
          "\"kimi_linear\"}}");
    f = KL;
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_OK);
    assert_int_equal(f, K3);
    write(d, "config.json", "{\"model_type\": \"kimi_linear\"}");
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_OK);
    assert_int_equal(f, KL);
    write(d, "config.json", "{\"model_type\": \"llama\"}");
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "model_type \"llama\""));
    write(d, "tokenizer_config.json", "{\"chat_format\": \"k3\"}"); /* wins over config.json */
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_OK);
    assert_int_equal(f, K3);
    write(d, "tokenizer_config.json", "{\"chat_format\": \"chatml\"}");
    assert_int_equal(ds_chat_format_from_dir(d, &f, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "chat_format \"chatml\""));
    free(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kl_system_user),
        cmocka_unit_test(test_kl_multi_turn_default_system),
        cmocka_unit_test(test_kl_tools_and_calls),
        cmocka_unit_test(test_kl_ids),
        cmocka_unit_test(test_k3_system_user),
        cmocka_unit_test(test_k3_multi_turn),
        cmocka_unit_test(test_k3_tools_and_calls),
        cmocka_unit_test(test_k3_tool_results_order_and_arguments),
        cmocka_unit_test(test_k3_system_notes),
        cmocka_unit_test(test_k3_ids),
        cmocka_unit_test(test_k3_matches_reference_encoder),
        cmocka_unit_test(test_bad_messages),
        cmocka_unit_test(test_format_from_dir),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
