/* openai.h — the OpenAI wire format, without HTTP and without the engine: request JSON ->
 * ds_request_params (with every validation error the API promises), and token events -> response
 * JSON, stream chunks (SSE) and logprobs in each endpoint's shape.
 *
 * Errors follow OpenAI: {"error": {"message", "type", "param", "code"}} with an HTTP status. A
 * message names the field it is about ("temperature: expected a number, got string"), and param
 * carries the field's name, so a client can point at it.
 *
 * Everything here is pure (no globals, no threads): the HTTP layer calls it from any connection
 * thread, and the unit test (tests/unit/test_server_openai.c) drives it without an engine. */
#ifndef DS_OPENAI_H
#define DS_OPENAI_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"
#include "engine/engine.h"
#include "text/tokenizer.h"
#include "text/toolparse.h"

#define DS_OAI_MAX_N 16 /* choices per request */

typedef enum { DS_OAI_COMPLETIONS = 0, DS_OAI_CHAT = 1 } ds_oai_kind;

/* An error to send back: HTTP status and the fields of the OpenAI error object. */
typedef struct ds_oai_error {
    int status;     /* 400, 401, 404, 405, 413, 500, 503 */
    char type[32];  /* "invalid_request_error" for 4xx, "server_error" for 5xx */
    char param[64]; /* the offending field, "" -> null */
    char code[32];  /* e.g. "model_not_found", "" -> null */
    char message[640];
} ds_oai_error;

/* Fills e (type from the status) and returns DS_ERR, so a parser can `return ds_oai_errorf(...)`.
 * param and code may be NULL. */
int ds_oai_errorf(ds_oai_error *e, int status, const char *param, const char *code, const char *fmt,
                  ...) __attribute__((format(printf, 5, 6)));
/* {"error": {...}} as compact JSON; malloc'd, NUL-terminated. Never NULL on valid input. */
char *ds_oai_error_json(const ds_oai_error *e);

/* A parsed /v1/completions or /v1/chat/completions body. Owns every pointer in it. */
typedef struct ds_oai_request {
    ds_oai_kind kind;
    char *model; /* as sent, NULL when absent */
    /* completions: exactly one of prompt / prompt_ids is set */
    char *prompt; /* [prompt_len] UTF-8 text (NUL-terminated; may hold NULs) */
    size_t prompt_len;
    int32_t *prompt_ids; /* [n_prompt_ids] token ids given by the client */
    int n_prompt_ids;
    /* chat: arguments for ds_chat_render */
    char *messages_json;        /* the "messages" array, re-serialised */
    char *tools_json;           /* the "tools" array, or NULL */
    char *tool_choice;          /* "auto" | "none" | "required", or NULL */
    char *tool_choice_json;     /* "required" or a named function as sent (JSON), or NULL */
    char *response_format_json; /* the "response_format" object, or NULL */
    char *thinking_effort;      /* "reasoning_effort", or NULL */
    int add_generation_prompt;  /* default 1 */
    int thinking;               /* chat_template_kwargs.thinking (default 1) */
    int parallel_tool_calls;    /* default 1; 0: one call per message (the grammar of an
                                   enforced tool_choice makes one; auto keeps the first) */
    /* both */
    ds_request_params params; /* params.stop[] and params.grammar are this struct's own */
    int max_tokens_set;       /* 0: ds_oai_fit_context picks the default */
    int stream, include_usage;
    int return_token_ids; /* vLLM's extension: choices carry "token_ids" (generated ids) */
    /* vLLM's kv_transfer_params (P/D, docs/pd.md): do_remote_decode asks a producer to hold the
     * prompt's blocks; do_remote_prefill tells a consumer to pull them from remote_host:
     * remote_port, transfer remote_request_id (16 hex digits) */
    int kv_do_remote_decode, kv_do_remote_prefill;
    char *kv_remote_host;
    int kv_remote_port;
    uint64_t kv_remote_id;
    uint64_t kv_export_id; /* producer: the transfer id given to this request (0: none) */
} ds_oai_request;

/* Parses and validates a request body of len bytes. served_name: the model name this server
 * answers to (a different "model" is a 404 model_not_found; NULL accepts any). vocab_size bounds
 * token ids in the prompt and stop_token_ids (0: unchecked). On error the request is left empty
 * (nothing to free) and e says why. Unknown fields are ignored, as OpenAI clients send extras. */
int ds_oai_parse_request(ds_oai_kind kind, const char *body, size_t len, const char *served_name,
                         int vocab_size, ds_oai_request *out, ds_oai_error *e);
void ds_oai_request_free(ds_oai_request *r);

/* /tokenize: {"prompt": text or ids} or {"messages": [...]} (+ "model", "tools",
 * "add_generation_prompt", "chat_template_kwargs", "add_special_tokens"). Fills out like the
 * generation parser (kind: completions for a prompt, chat for messages; no sampling fields) and
 * *add_special. On error nothing is left to free and e says why. */
int ds_oai_parse_tokenize(const char *body, size_t len, const char *served_name, int vocab_size,
                          ds_oai_request *out, int *add_special, ds_oai_error *e);
/* /detokenize: {"tokens": [ids in [0, vocab_size)], "model"?} -> *ids [*n] (malloc'd). */
int ds_oai_parse_detokenize(const char *body, size_t len, const char *served_name, int vocab_size,
                            int32_t **ids, int *n, ds_oai_error *e);

/* Checks the tokenized prompt against the context limit and settles max_tokens: an explicit one
 * must satisfy n_prompt + max_tokens <= max_model_len (else 400 naming both lengths); without one,
 * completions get OpenAI's 16 and chat gets the rest of the context, either capped by what is left.
 * An empty prompt is a 400. min_tokens is clamped to max_tokens. */
int ds_oai_fit_context(ds_oai_request *r, int n_prompt, int max_model_len, ds_oai_error *e);

/* /v1/models' "capabilities" of the served model: chat_format, tool_calls, parallel_tool_calls,
 * tool_choice (the values served: required / function only with constrained decoding), reasoning,
 * structured_outputs (llguidance loaded). */
json_t *ds_oai_capabilities(ds_engine *e);

/* Structured outputs (structured.c): the grammar of a request's response_format (chat or
 * completion), or of a chat request's tool_choice "required" / named function (which wins when
 * both are given), compiled once here so that a bad schema is a 400 naming the field, into
 * r->params.grammar. A request that needs one while the grammar library is unavailable is a 400
 * saying so. Nothing to do: DS_OK, NULL. */
int ds_oai_build_grammar(ds_engine *e, ds_oai_request *r, ds_oai_error *oe);

/* ---- responses ---- */

/* What every response of one request shares. */
typedef struct ds_oai_resp_ctx {
    ds_oai_kind kind;
    const char *id;          /* "cmpl-..." / "chatcmpl-..." */
    const char *model;       /* served name */
    long long created;       /* unix seconds */
    int logprobs;            /* -1: none; else the top-k count asked for */
    const ds_tokenizer *tok; /* token strings for logprobs; may be NULL when logprobs < 0 */
    int keep_special;        /* skip_special_tokens was false: specials' names are in the text */
    int token_ids;           /* return_token_ids: each choice (or chunk) lists its token ids */
    /* chat: what to split out of the generated text (oai_parse.c); all 0: the text as it is */
    ds_tp_opts parse;
    int parse_specials; /* feed the names of skipped special tokens to the parser (K3's XTML) */
    int one_call;       /* parallel_tool_calls false: a message's calls after its first are dropped
                           (tool_choice auto, as vLLM; an enforced choice makes only one anyway) */
} ds_oai_resp_ctx;

/* The parse options of a chat request: tool calls when tools are given and tool_choice is not
 * "none"; reasoning (and K3's XTML markers) with thinking on in the K3 format. fmt:
 * ds_chat_format. Sets c->parse, c->parse_specials and c->one_call. */
void ds_oai_parse_opts(ds_oai_resp_ctx *c, const ds_oai_request *r, int fmt);

/* One engine event, copied off the engine thread (the engine's pointers die with the callback). */
typedef struct ds_oai_event {
    int index;     /* choice */
    int32_t token; /* -1: none */
    float logprob;
    int n_top;
    int32_t top_ids[DS_MAX_LOGPROBS];
    float top_logprobs[DS_MAX_LOGPROBS];
    ds_finish finish;
    int n_prompt, n_generated;
    const char *text; /* [text_len] newly final text */
    size_t text_len;
} ds_oai_event;

/* One choice as it is built, for the whole response (non-streaming) or across chunks. */
typedef struct ds_oai_choice {
    char *text; /* [len] accumulated text (non-streaming only), NUL-terminated */
    size_t len, cap;
    json_t *logprobs;  /* non-streaming: the choice's logprobs object so far, or NULL */
    json_t *token_ids; /* non-streaming with return_token_ids: the ids so far, or NULL */
    long long n_chars; /* characters of token text so far: the next token's text_offset */
    ds_finish finish;
    int n_generated;
    ds_toolparse *tp; /* chat with c->parse: the choice's parser (made at its first event) */
    ds_tp_out *tpo;   /* non-streaming: all the parser produced; streaming: scratch per chunk */
    int n_calls;      /* tool calls out so far (a stream's next call index) */
} ds_oai_choice;

/* Adds an event to a choice of a non-streaming response (text, logprobs, finish). */
int ds_oai_choice_add(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev,
                      ds_err *err);
void ds_oai_choice_free(ds_oai_choice *ch);

/* The whole non-streaming response for choices[0..n): text_completion or chat.completion, with
 * usage {prompt_tokens, completion_tokens = sum of the choices' n_generated, total_tokens}. */
json_t *ds_oai_response(const ds_oai_resp_ctx *c, const ds_oai_choice *choices, int n,
                        int n_prompt);

/* The stream chunk for one event of choice ch (which tracks text offsets and the finish), or NULL
 * when the event carries nothing to send (no text, no logprobs, no finish). A parsed chat choice
 * (ds_oai_parsing) may give a JSON array of chunks instead (a tool call's two fragments), which
 * ds_oai_sse sends as one event each. */
json_t *ds_oai_chunk(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev);
/* Chat only: the first chunk of a choice, delta {"role": "assistant", "content": ""}. */
json_t *ds_oai_chunk_role(const ds_oai_resp_ctx *c, int index);
/* The last chunk with stream_options.include_usage: empty choices and the usage. */
json_t *ds_oai_chunk_usage(const ds_oai_resp_ctx *c, int n_prompt, int n_completion);

/* Parsing (oai_parse.c). Whether the context splits the text at all. */
int ds_oai_parsing(const ds_oai_resp_ctx *c);
/* Feeds an event's text (and a skipped special's name, with c->parse_specials) to the choice's
 * parser, appending to ch->tpo; at the event's finish the parser is flushed. */
int ds_oai_parse_event(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev,
                       ds_err *err);
/* The chat message of a parsed choice: content (null when empty), reasoning_content (with
 * reasoning on), tool_calls (when any). */
json_t *ds_oai_parsed_message(const ds_oai_resp_ctx *c, const ds_oai_choice *ch);
/* The deltas of what the parser produced for one chunk (ch->tpo), in order: [reasoning/content
 * delta], then per call {index, id, type, function{name, arguments: ""}} and {index,
 * function{arguments}} as OpenAI streams them. An array of delta objects (maybe empty). */
json_t *ds_oai_parsed_deltas(const ds_oai_resp_ctx *c, ds_oai_choice *ch);
/* finish_reason of a parsed choice: "tool_calls" when a call came out and it stopped. */
json_t *ds_oai_parsed_finish(const ds_oai_choice *ch, ds_finish f);

/* "data: <compact json>\n\n"; steals j; an array of chunks becomes one event each, in order.
 * malloc'd, *len set. NULL only when out of memory. */
char *ds_oai_sse(json_t *j, size_t *len);
/* Compact JSON text of j (floats with 9 significant digits: enough for any f32); steals j. */
char *ds_oai_dumps(json_t *j);

/* A JSON string from bytes that may not be valid UTF-8 (a token can hold part of a character):
 * invalid bytes become U+FFFD. Never NULL except out of memory. */
json_t *ds_oai_json_string_lossy(const char *s, size_t n);

#endif
