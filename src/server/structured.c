/* structured.c — a request's constrained decoding (openai.h: ds_oai_build_grammar): the
 * grammar text from text/grammar.h's builders, checked against the engine's llguidance (which
 * also caches the compiled grammar for the engine's first sample), errors as OpenAI 400s. */
#include "server/openai.h"

#include "text/chat.h"
#include "text/grammar.h"

#include <stdlib.h>
#include <string.h>

/* The request field an error is about: tool_choice's grammar, else response_format's. */
static int grammar_error(ds_oai_error *oe, const char *param, const ds_err *err) {
    return ds_oai_errorf(oe, 400, param, "invalid_value", "%s", err->msg);
}

/* Tool calls in the conversation's assistant messages: K2's call ids count calls over the whole
 * conversation, so the first one this message makes is functions.NAME:<this many>. */
static int calls_before(const char *messages_json) {
    json_error_t je;
    json_t *msgs = messages_json ? json_loads(messages_json, 0, &je) : NULL;
    size_t n = 0;
    for (size_t i = 0; i < json_array_size(msgs); i++) {
        json_t *m = json_array_get(msgs, i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (role && !strcmp(role, "assistant"))
            n += json_array_size(json_object_get(m, "tool_calls"));
    }
    json_decref(msgs);
    return (int)DS_MIN(n, (size_t)1000000);
}

int ds_oai_build_grammar(ds_engine *e, ds_oai_request *r, ds_oai_error *oe) {
    free(r->params.grammar);
    r->params.grammar = NULL;
    /* a completion has no chat turn: no thinking before the answer, no tools */
    const int chat = r->kind == DS_OAI_CHAT;
    int fmt = ds_engine_chat_format(e);
    ds_grammar_ctx c = {ds_engine_tokenizer(e), fmt,
                        chat && fmt == DS_CHAT_K3 && r->thinking && r->add_generation_prompt,
                        r->parallel_tool_calls, 0};
    ds_err err = {{0}};
    const char *param = NULL;
    char *lark = NULL;
    if (r->tool_choice_json && r->tools_json) { /* enforced calls win over response_format */
        param = "tool_choice";
        if (fmt != DS_CHAT_K3) c.call_base = calls_before(r->messages_json);
        if (ds_grammar_from_tools(&c, r->tools_json, r->tool_choice_json, &lark, &err))
            return grammar_error(oe, param, &err);
    } else if (r->tool_choice_json) {
        return ds_oai_errorf(oe, 400, "tool_choice", "invalid_value",
                             "tool_choice: a required or named tool call needs \"tools\"");
    } else if (r->response_format_json) {
        param = "response_format";
        if (ds_grammar_from_response_format(&c, r->response_format_json, &lark, &err))
            return grammar_error(oe, param, &err);
    }
    if (!lark) return DS_OK;
    if (!ds_engine_grammar_ready(e, &err)) {
        free(lark);
        return ds_oai_errorf(oe, 400, param, "unsupported_value",
                             "%s: constrained decoding is not available on this server: %s", param,
                             err.msg);
    }
    if (ds_engine_grammar_check(e, lark, &err)) {
        free(lark);
        ds_oai_errorf(oe, 400, param, "invalid_value", "%s: the schema cannot be compiled: %s",
                      param, err.msg);
        return DS_ERR;
    }
    r->params.grammar = lark;
    return DS_OK;
}

json_t *ds_oai_capabilities(ds_engine *e) {
    /* what the chat endpoint does with this model's output (oai_parse.c): tool calls in either
     * format (K2 sections, K3 XTML), several per message (parallel_tool_calls false keeps one);
     * only K3 thinks; constrained decoding when llguidance loads, and with it the enforced
     * tool_choice values */
    int k3 = ds_engine_chat_format(e) == DS_CHAT_K3, so = ds_engine_grammar_ready(e, NULL);
    json_t *choices = so ? json_pack("[s, s, s, s]", "auto", "none", "required", "function")
                         : json_pack("[s, s]", "auto", "none");
    return json_pack("{s:s, s:b, s:b, s:o, s:b, s:b}", "chat_format", k3 ? "k3" : "kimi_linear",
                     "tool_calls", 1, "parallel_tool_calls", 1, "tool_choice", choices, "reasoning",
                     k3, "structured_outputs", so);
}
