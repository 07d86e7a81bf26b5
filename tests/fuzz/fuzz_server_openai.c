/* fuzz_server_openai.c — libFuzzer target for the HTTP request bodies of /v1/completions and
 * /v1/chat/completions (src/server/openai.c, src/text/chat.c): everything the server does with a
 * body before the engine sees it, then the response builders on made-up events. Every input is
 * also fed to the /tokenize and /detokenize body parsers.
 *
 * Input: first byte = flags (bit 0: chat, else completions; bit 1: the K3 vocabulary and chat
 * format, else Kimi-Linear's; bits 2-4: how many events per choice to fake), then the body.
 * Invariants: a rejected body gives a 4xx whose JSON is the OpenAI error object naming a message;
 * an accepted one has its parameters inside their documented ranges, and its prompt renders or is
 * rejected with a message; every response and stream chunk built from it is valid JSON. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>

#include "fuzzutil.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "server/openai.h"

#define MAX_MODEL_LEN 1024

static ds_tokenizer *g_tok[2]; /* [0] Kimi-Linear vocab768, [1] K3 vocab2048 */

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *sub[2] = {"vocab768_kimi_linear", "vocab2048_k3"};
    for (int i = 0; i < 2; i++) {
        char dir[1024];
        snprintf(dir, sizeof dir, "%s/tests/golden/tok/%s", DS_SOURCE_DIR, sub[i]);
        ds_err err;
        if (ds_tok_load(dir, &g_tok[i], &err) != DS_OK) fz_fail("loading %s: %s", dir, err.msg);
    }
    return 0;
}

/* A JSON text that must parse back (every body the server sends). */
static void check_json_text(const char *s, size_t n, const char *what) {
    if (!s) fz_fail("%s: NULL", what);
    json_error_t je;
    json_t *j = json_loadb(s, n, JSON_ALLOW_NUL, &je); /* "\u0000" is valid JSON */
    /* jansson cannot hold a NUL in an object key (a top_logprobs key can be the token "\0"),
     * though "\u0000" is valid JSON there too */
    if (!j && strstr(je.text, "NUL byte in object key")) return;
    if (!j) fz_fail("%s is not valid JSON (%s): %.200s", what, je.text, s);
    json_decref(j);
}

static void check_error(const ds_oai_error *e) {
    if (e->status < 400 || e->status >= 500)
        fz_fail("a body was rejected with status %d", e->status);
    if (!e->message[0]) fz_fail("error without a message");
    char *js = ds_oai_error_json(e);
    if (!js) fz_fail("ds_oai_error_json gave NULL");
    json_t *j = json_loads(js, 0, NULL);
    json_t *o = j ? json_object_get(j, "error") : NULL;
    if (!o || !json_is_string(json_object_get(o, "message")) ||
        !json_is_string(json_object_get(o, "type")) || !json_object_get(o, "param") ||
        !json_object_get(o, "code"))
        fz_fail("error JSON lacks the OpenAI shape: %s", js);
    json_decref(j);
    free(js);
}

static void check_params(const ds_oai_request *q) {
    const ds_request_params *p = &q->params;
    if (p->n < 1 || p->n > DS_OAI_MAX_N) fz_fail("n = %d accepted", p->n);
    if (p->n_stop < 0 || p->n_stop > DS_MAX_STOP) fz_fail("n_stop = %d", p->n_stop);
    for (int i = 0; i < p->n_stop; i++)
        if (!p->stop[i]) fz_fail("stop[%d] is NULL", i);
    if (p->n_stop_token_ids < 0 || p->n_stop_token_ids > DS_MAX_STOP)
        fz_fail("n_stop_token_ids = %d", p->n_stop_token_ids);
    if (p->logprobs < -1 || p->logprobs > DS_MAX_LOGPROBS) fz_fail("logprobs = %d", p->logprobs);
    if (!(p->sample.temperature >= 0) || !(p->sample.top_p >= 0 && p->sample.top_p <= 1) ||
        p->sample.top_k < -1 || !(p->sample.min_p >= 0 && p->sample.min_p <= 1))
        fz_fail("sampling out of range: t %g p %g k %d min_p %g", p->sample.temperature,
                p->sample.top_p, p->sample.top_k, p->sample.min_p);
    if (q->kind == DS_OAI_COMPLETIONS && !q->prompt == !q->prompt_ids)
        fz_fail("completions need exactly one of prompt / prompt_ids");
    if (q->kind == DS_OAI_CHAT && !q->messages_json) fz_fail("chat without messages");
}

/* Fakes n_ev events per choice (tokens taken from the prompt) and builds the response, or the
 * stream chunks, checking that each is valid JSON. */
static void build_responses(ds_oai_request *q, const ds_tokenizer *tok, const int32_t *ids,
                            int n_ids, int n_ev) {
    ds_oai_resp_ctx c = {.kind = q->kind,
                         .id = "id-1",
                         .model = "tiny",
                         .created = 1700000000,
                         .logprobs = q->params.logprobs,
                         .tok = tok,
                         .keep_special = !q->params.skip_special_tokens,
                         .token_ids = q->return_token_ids};
    /* the chat output parse as the server sets it (tools, thinking: K3's format) */
    if (q->kind == DS_OAI_CHAT) ds_oai_parse_opts(&c, q, DS_CHAT_K3);
    int n = q->params.n;
    ds_oai_choice ch[DS_OAI_MAX_N];
    memset(ch, 0, sizeof ch);
    for (int i = 0; i < n; i++) {
        if (q->stream && q->kind == DS_OAI_CHAT) {
            size_t len;
            char *s = ds_oai_sse(ds_oai_chunk_role(&c, i), &len);
            if (!s || len < 8) fz_fail("role chunk");
            check_json_text(s + 6, len - 8, "role chunk");
            free(s);
        }
        for (int k = 0; k <= n_ev; k++) {
            ds_oai_event ev;
            memset(&ev, 0, sizeof ev);
            ev.index = i;
            ev.token = k < n_ev ? ids[(i + k) % n_ids] : -1;
            ev.logprob = -0.5f * (float)k;
            ev.n_top = q->params.logprobs > 0 ? q->params.logprobs : 0;
            for (int t = 0; t < ev.n_top; t++) {
                ev.top_ids[t] = ids[(i + k + t) % n_ids];
                ev.top_logprobs[t] = -(float)t;
            }
            size_t blen = 0;
            const char *b = ev.token >= 0 ? ds_tok_token_bytes(tok, ev.token, &blen) : NULL;
            ev.text = b ? b : "";
            ev.text_len = b ? blen : 0;
            ev.finish = k < n_ev ? DS_FINISH_NONE : (ds_finish)(1 + (i + k) % 4);
            ev.n_prompt = n_ids;
            ev.n_generated = k;
            if (q->stream) {
                json_t *j = ds_oai_chunk(&c, &ch[i], &ev);
                if (j) {
                    size_t len;
                    char *s = ds_oai_sse(j, &len);
                    if (!s || len < 8 || memcmp(s, "data: ", 6) != 0) fz_fail("bad SSE framing");
                    check_json_text(s + 6, len - 8, "stream chunk");
                    free(s);
                }
            } else {
                ds_err err;
                if (ds_oai_choice_add(&c, &ch[i], &ev, &err) != DS_OK)
                    fz_fail("choice_add: %s", err.msg);
            }
        }
    }
    char *s = q->stream ? ds_oai_dumps(ds_oai_chunk_usage(&c, n_ids, n * n_ev))
                        : ds_oai_dumps(ds_oai_response(&c, ch, n, n_ids));
    check_json_text(s, s ? strlen(s) : 0, q->stream ? "usage chunk" : "response");
    free(s);
    for (int i = 0; i < n; i++) ds_oai_choice_free(&ch[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int flags = data[0];
    ds_oai_kind kind = (flags & 1) ? DS_OAI_CHAT : DS_OAI_COMPLETIONS;
    const ds_tokenizer *tok = g_tok[(flags >> 1) & 1];
    ds_chat_format fmt = (flags & 2) ? DS_CHAT_K3 : DS_CHAT_KIMI_LINEAR;
    int n_ev = (flags >> 2) & 7;
    /* the server hands the parser a buffer it owns: copy, so ASan sees its true end */
    char *body = malloc(size);
    if (!body) fz_fail("out of memory");
    memcpy(body, data + 1, size - 1);
    ds_oai_request q;
    ds_oai_error e;
    memset(&e, 0, sizeof e);
    int rc = ds_oai_parse_request(kind, body, size - 1, "tiny", ds_tok_vocab_size(tok), &q, &e);
    fz_note("parse", rc, e.message);
    if (rc == DS_OK) { /* an accepted "model" is the served name whole, not a prefix cut at NUL */
        json_t *bj = json_loadb(body, size - 1, JSON_ALLOW_NUL, NULL);
        json_t *m = json_object_get(bj, "model");
        if (json_is_string(m) && json_string_length(m) != strlen("tiny"))
            fz_fail("accepted model of %zu bytes", json_string_length(m));
        json_decref(bj);
    }
    /* the same bytes as /tokenize and /detokenize bodies */
    {
        ds_oai_request tq;
        ds_oai_error te;
        memset(&te, 0, sizeof te);
        int add_special = -1;
        int trc = ds_oai_parse_tokenize(body, size - 1, "tiny", ds_tok_vocab_size(tok), &tq,
                                        &add_special, &te);
        if (trc == DS_OK) {
            if (add_special != 0 && add_special != 1) fz_fail("add_special %d", add_special);
            ds_oai_request_free(&tq);
        } else {
            check_error(&te);
        }
        int32_t *dids = NULL;
        int dn = -1;
        memset(&te, 0, sizeof te);
        trc = ds_oai_parse_detokenize(body, size - 1, "tiny", ds_tok_vocab_size(tok), &dids, &dn,
                                      &te);
        if (trc == DS_OK) {
            for (int i = 0; i < dn; i++)
                if (dids[i] < 0 || dids[i] >= ds_tok_vocab_size(tok))
                    fz_fail("detokenize accepted id %d", dids[i]);
        } else if (dids || dn != 0) {
            fz_fail("detokenize failed but returned ids");
        } else {
            check_error(&te);
        }
        free(dids);
    }
    free(body);
    if (rc != DS_OK) {
        check_error(&e);
        return 0;
    }
    check_params(&q);
    int32_t *ids = NULL;
    int n = 0;
    ds_err err;
    err.msg[0] = 0;
    if (kind == DS_OAI_CHAT) {
        ds_chat_opts o;
        ds_chat_opts_default(&o);
        o.add_generation_prompt = q.add_generation_prompt;
        o.thinking = q.thinking;
        o.thinking_effort = q.thinking_effort;
        o.tool_choice = q.tool_choice;
        o.response_format_json = q.response_format_json;
        rc = ds_chat_render(tok, fmt, q.messages_json, q.tools_json, &o, &ids, &n, &err);
    } else if (q.prompt_ids) {
        for (int i = 0; i < q.n_prompt_ids; i++)
            if (q.prompt_ids[i] < 0 || q.prompt_ids[i] >= ds_tok_vocab_size(tok))
                fz_fail("prompt id %d accepted", q.prompt_ids[i]);
        ids = malloc(((size_t)q.n_prompt_ids + 1) * sizeof *ids);
        if (!ids) fz_fail("out of memory");
        memcpy(ids, q.prompt_ids, (size_t)q.n_prompt_ids * sizeof *ids);
        n = q.n_prompt_ids;
        rc = DS_OK;
    } else {
        rc = ds_tok_encode(tok, q.prompt, q.prompt_len, 1, &ids, &n, &err);
    }
    fz_note("prompt", rc, err.msg);
    if (rc != DS_OK && !err.msg[0]) fz_fail("prompt rejected without a message");
    if (rc == DS_OK) {
        memset(&e, 0, sizeof e);
        if (ds_oai_fit_context(&q, n, MAX_MODEL_LEN, &e) != DS_OK) {
            check_error(&e);
        } else {
            if (q.params.max_tokens < 1 || n + q.params.max_tokens > MAX_MODEL_LEN ||
                q.params.min_tokens > q.params.max_tokens)
                fz_fail("fit_context: max_tokens %d, min_tokens %d, prompt %d", q.params.max_tokens,
                        q.params.min_tokens, n);
            build_responses(&q, tok, ids, n, n_ev);
        }
    }
    free(ids);
    ds_oai_request_free(&q);
    return 0;
}
