/* oai_parse.c — chat output split into reasoning_content, content and tool_calls (openai.h), on
 * top of text/toolparse.h. One parser per choice sees the same text pieces whether the response
 * is streamed or not, so the stream's deltas reassemble to the whole message. */
#include "server/openai.h"

#include "text/chat.h"

#include <stdlib.h>
#include <string.h>

void ds_oai_parse_opts(ds_oai_resp_ctx *c, const ds_oai_request *r, int fmt) {
    memset(&c->parse, 0, sizeof c->parse);
    c->parse_specials = 0;
    c->one_call = 0;
    if (r->kind != DS_OAI_CHAT) return;
    c->one_call = !r->parallel_tool_calls;
    c->parse.tools = r->tools_json && !(r->tool_choice && !strcmp(r->tool_choice, "none"));
    /* the K3 generation prompt opens the think element: the text starts in the thought */
    c->parse.reasoning = fmt == DS_CHAT_K3 && r->thinking && r->add_generation_prompt;
    /* K3 writes its calls (and wraps its answer) in XTML */
    c->parse.xtml = fmt == DS_CHAT_K3 && (c->parse.reasoning || c->parse.tools);
    /* skip_special_tokens leaves XTML's markers (special ids) out of the text: the parser gets
     * their names from the token ids instead */
    c->parse_specials = c->parse.xtml && !c->keep_special;
}

int ds_oai_parsing(const ds_oai_resp_ctx *c) {
    return c->kind == DS_OAI_CHAT && (c->parse.tools || c->parse.reasoning);
}

int ds_oai_parse_event(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev,
                       ds_err *err) {
    if (!ch->tp) {
        ch->tp = malloc(sizeof *ch->tp);
        ch->tpo = calloc(1, sizeof *ch->tpo);
        if (!ch->tp || !ch->tpo) {
            free(ch->tp), free(ch->tpo);
            ch->tp = NULL, ch->tpo = NULL;
            return ds_errf(err, "out of memory for the output parser");
        }
        ds_tp_init(ch->tp, &c->parse);
    }
    if (ev->text_len && ds_tp_feed(ch->tp, ev->text, ev->text_len, ch->tpo, err)) return DS_ERR;
    if (c->parse_specials && ev->token >= 0 && c->tok && ds_tok_is_special(c->tok, ev->token)) {
        /* a skipped special token the parser reads: its text is its name (another one, a
         * reserved id say, stays skipped: it is no text of the answer or the thought) */
        size_t n;
        const char *name = ds_tok_token_bytes(c->tok, ev->token, &n);
        if (name && ds_tp_is_marker(name, n) && ds_tp_feed(ch->tp, name, n, ch->tpo, err))
            return DS_ERR;
    }
    if (ev->finish != DS_FINISH_NONE && ds_tp_finish(ch->tp, ch->tpo, err)) return DS_ERR;
    return DS_OK;
}

/* A string, or null when empty. */
static json_t *str_or_null(const char *s, size_t n) {
    return n ? ds_oai_json_string_lossy(s, n) : json_null();
}

static json_t *call_json(const ds_tp_call *k) {
    return json_pack("{s:o, s:s, s:{s:o, s:o}}", "id",
                     ds_oai_json_string_lossy(k->id, strlen(k->id)), "type", "function", "function",
                     "name", ds_oai_json_string_lossy(k->name, strlen(k->name)), "arguments",
                     ds_oai_json_string_lossy(k->args, k->args_len));
}

json_t *ds_oai_parsed_message(const ds_oai_resp_ctx *c, const ds_oai_choice *ch) {
    static const ds_tp_out empty;
    const ds_tp_out *o = ch->tpo ? ch->tpo : &empty;
    json_t *m = json_pack("{s:s, s:o}", "role", "assistant", "content",
                          str_or_null(o->content, o->content_len));
    if (!m) return NULL;
    if (c->parse.reasoning)
        json_object_set_new(m, "reasoning_content", str_or_null(o->reasoning, o->reasoning_len));
    if (o->n_calls) {
        json_t *calls = json_array();
        int n = c->one_call ? 1 : o->n_calls;
        for (int i = 0; i < n; i++) json_array_append_new(calls, call_json(&o->calls[i]));
        json_object_set_new(m, "tool_calls", calls);
    }
    return m;
}

json_t *ds_oai_parsed_deltas(const ds_oai_resp_ctx *c, ds_oai_choice *ch) {
    json_t *arr = json_array();
    const ds_tp_out *o = ch->tpo;
    if (!arr || !o) return arr;
    if (o->reasoning_len || o->content_len) {
        json_t *d = json_object();
        if (o->reasoning_len)
            json_object_set_new(d, "reasoning_content",
                                ds_oai_json_string_lossy(o->reasoning, o->reasoning_len));
        if (o->content_len)
            json_object_set_new(d, "content", ds_oai_json_string_lossy(o->content, o->content_len));
        json_array_append_new(arr, d);
    }
    for (int i = 0; i < o->n_calls && !(c->one_call && ch->n_calls); i++) {
        const ds_tp_call *k = &o->calls[i];
        int idx = ch->n_calls++;
        json_array_append_new(
            arr, json_pack("{s:[{s:i, s:o, s:s, s:{s:o, s:s}}]}", "tool_calls", "index", idx, "id",
                           ds_oai_json_string_lossy(k->id, strlen(k->id)), "type", "function",
                           "function", "name", ds_oai_json_string_lossy(k->name, strlen(k->name)),
                           "arguments", ""));
        json_array_append_new(arr, json_pack("{s:[{s:i, s:{s:o}}]}", "tool_calls", "index", idx,
                                             "function", "arguments",
                                             ds_oai_json_string_lossy(k->args, k->args_len)));
    }
    return arr;
}

json_t *ds_oai_parsed_finish(const ds_oai_choice *ch, ds_finish f) {
    int calls = ch->n_calls || (ch->tpo && ch->tpo->n_calls);
    if (f == DS_FINISH_STOP && calls) return json_string("tool_calls");
    return f == DS_FINISH_NONE ? json_null() : json_string(ds_finish_name(f));
}
