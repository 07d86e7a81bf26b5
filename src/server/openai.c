/* openai.c — OpenAI request parsing/validation and response, chunk and logprob building.
 *
 * Parsing reads the body once with jansson, checks each field's type and range (the message names
 * the field), and copies what the engine needs into a ds_oai_request that owns its memory: the
 * stop strings must outlive the request inside the engine, so nothing points into the JSON tree.
 * Building turns copied engine events into the JSON objects of each endpoint. Token bytes are not
 * always valid UTF-8 (a token may hold half a character), and JSON strings must be, so every
 * model-made string goes through ds_oai_json_string_lossy. */
#include "server/openai.h"

#include "io/jsonutil.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A logprob JSON can carry: -inf (a token the sampler masked) becomes this, as vLLM does. */
#define LOGPROB_FLOOR (-9999.0)

/* ---------------------------------------------------------------------------------------------
 * errors */

int ds_oai_errorf(ds_oai_error *e, int status, const char *param, const char *code, const char *fmt,
                  ...) {
    if (!e) return DS_ERR;
    memset(e, 0, sizeof *e);
    e->status = status;
    snprintf(e->type, sizeof e->type, "%s",
             status >= 500 ? "server_error" : "invalid_request_error");
    if (param) snprintf(e->param, sizeof e->param, "%s", param);
    if (code) snprintf(e->code, sizeof e->code, "%s", code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return DS_ERR;
}

char *ds_oai_error_json(const ds_oai_error *e) {
    json_t *o = json_object();
    json_object_set_new(
        o, "message", ds_oai_json_string_lossy(e->message, strnlen(e->message, sizeof e->message)));
    json_object_set_new(o, "type", json_string(e->type));
    json_object_set_new(o, "param", e->param[0] ? json_string(e->param) : json_null());
    json_object_set_new(o, "code", e->code[0] ? json_string(e->code) : json_null());
    return ds_oai_dumps(json_pack("{s:o}", "error", o));
}

/* ---------------------------------------------------------------------------------------------
 * UTF-8 */

/* Length of the valid UTF-8 sequence at b[0..n), or 0 when it is not one (bad lead byte, missing
 * continuation, overlong form, surrogate, or beyond U+10FFFF) — the same rules jansson enforces. */
static size_t utf8_valid_len(const unsigned char *b, size_t n) {
    unsigned c = b[0];
    size_t len;
    unsigned lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
    if (c < 0x80) return 1;
    if (c < 0xc2) return 0;
    if (c < 0xe0)
        len = 2;
    else if (c < 0xf0) {
        len = 3;
        if (c == 0xe0) lo = 0xa0; /* overlong */
        if (c == 0xed) hi = 0x9f; /* surrogates */
    } else if (c < 0xf5) {
        len = 4;
        if (c == 0xf0) lo = 0x90; /* overlong */
        if (c == 0xf4) hi = 0x8f; /* > U+10FFFF */
    } else
        return 0;
    if (len > n || b[1] < lo || b[1] > hi) return 0;
    for (size_t i = 2; i < len; i++)
        if ((b[i] & 0xc0) != 0x80) return 0;
    return len;
}

/* Copies s[0..n) with each invalid byte replaced by U+FFFD. *out malloc'd ([*out_len + 1]). */
static int utf8_lossy(const char *s, size_t n, char **out, size_t *out_len) {
    char *d = malloc(3 * n + 1); /* worst case: every byte becomes 3 */
    if (!d) return DS_ERR;
    const unsigned char *b = (const unsigned char *)s;
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t l = utf8_valid_len(b + i, n - i);
        if (l) {
            memcpy(d + k, b + i, l);
            k += l, i += l;
        } else {
            memcpy(d + k, "\xef\xbf\xbd", 3);
            k += 3, i += 1;
        }
    }
    d[k] = 0;
    *out = d;
    *out_len = k;
    return DS_OK;
}

json_t *ds_oai_json_string_lossy(const char *s, size_t n) {
    json_t *j = json_stringn(s, n); /* the common case: already valid */
    if (j) return j;
    char *d;
    size_t dl;
    if (utf8_lossy(s, n, &d, &dl)) return NULL;
    j = json_stringn(d, dl);
    free(d);
    return j;
}

/* Characters in b[0..n): bytes that are not UTF-8 continuation bytes. Summed over tokens this is
 * the character offset in the joined text even when a character is split across tokens. */
static long long utf8_chars(const char *b, size_t n) {
    long long c = 0;
    for (size_t i = 0; i < n; i++) c += ((unsigned char)b[i] & 0xc0) != 0x80;
    return c;
}

/* ---------------------------------------------------------------------------------------------
 * request parsing */

/* o[key], treating an explicit null as absent (clients send null for "not given"). */
static json_t *field(json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_null(v) ? NULL : v;
}

static int type_error(ds_oai_error *e, const char *key, const char *want, const json_t *v) {
    return ds_oai_errorf(e, 400, key, "invalid_type", "%s: expected %s, got %s", key, want,
                         ds_json_type_name(v));
}

/* Reads an optional integer in [lo, hi]; *set says whether it was given. */
static int get_int(json_t *o, const char *key, long long lo, long long hi, long long *out, int *set,
                   ds_oai_error *e) {
    json_t *v = field(o, key);
    *set = 0;
    if (!v) return DS_OK;
    if (!json_is_integer(v)) return type_error(e, key, "an integer", v);
    long long x = json_integer_value(v);
    if (x < lo || x > hi)
        return ds_oai_errorf(e, 400, key, "invalid_value",
                             "%s: must be between %lld and %lld, got %lld", key, lo, hi, x);
    *out = x;
    *set = 1;
    return DS_OK;
}

/* Reads an optional number in [lo, hi] (lo excluded when lo_open). */
static int get_num(json_t *o, const char *key, double lo, double hi, int lo_open, float *out,
                   ds_oai_error *e) {
    json_t *v = field(o, key);
    if (!v) return DS_OK;
    if (!json_is_number(v)) return type_error(e, key, "a number", v);
    double x = json_number_value(v);
    if (!(lo_open ? x > lo : x >= lo) || !(x <= hi))
        return ds_oai_errorf(e, 400, key, "invalid_value", "%s: must be %s %g and <= %g, got %g",
                             key, lo_open ? ">" : ">=", lo, hi, x);
    *out = (float)x;
    return DS_OK;
}

static int get_bool(json_t *o, const char *key, int *out, ds_oai_error *e) {
    json_t *v = field(o, key);
    if (!v) return DS_OK;
    if (!json_is_boolean(v)) return type_error(e, key, "a boolean", v);
    *out = json_is_true(v);
    return DS_OK;
}

/* Reads an optional string; *out is a malloc'd copy, or stays NULL when absent. */
static int get_str(json_t *o, const char *key, char **out, ds_oai_error *e) {
    json_t *v = field(o, key);
    if (!v) return DS_OK;
    if (!json_is_string(v)) return type_error(e, key, "a string", v);
    /* JSON_ALLOW_NUL lets "\u0000" through: an identifier cut at a NUL would match a prefix */
    if (strlen(json_string_value(v)) != json_string_length(v))
        return ds_oai_errorf(e, 400, key, "invalid_value", "%s: must not contain NUL (\\u0000)",
                             key);
    *out = strndup(json_string_value(v), json_string_length(v));
    if (!*out) return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    return DS_OK;
}

/* A token-id array: every element an integer in [0, vocab_size) (vocab_size 0: unchecked).
 * *ids: [*n] malloc'd. */
static int get_ids(json_t *arr, const char *key, int vocab_size, int32_t **ids, int *n,
                   ds_oai_error *e) {
    size_t len = json_array_size(arr);
    int32_t *v = malloc((len ? len : 1) * sizeof *v);
    if (!v) return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < len; i++) {
        json_t *x = json_array_get(arr, i);
        long long t = json_integer_value(x);
        if (!json_is_integer(x) || t < 0 || t > INT32_MAX || (vocab_size > 0 && t >= vocab_size)) {
            free(v);
            if (!json_is_integer(x))
                return ds_oai_errorf(e, 400, key, "invalid_type",
                                     "%s[%zu]: expected a token id (integer), got %s", key, i,
                                     ds_json_type_name(x));
            return ds_oai_errorf(e, 400, key, "invalid_value",
                                 "%s[%zu]: token id %lld is outside the vocabulary [0, %d)", key, i,
                                 t, vocab_size);
        }
        v[i] = (int32_t)t;
    }
    *ids = v;
    *n = (int)len;
    return DS_OK;
}

/* The completions "prompt": a string, a token-id list, or a one-element list of either. */
static int parse_prompt(json_t *root, int vocab_size, ds_oai_request *r, ds_oai_error *e) {
    json_t *p = field(root, "prompt");
    if (!p)
        return ds_oai_errorf(e, 400, "prompt", "missing_required_parameter",
                             "prompt: this field is required");
    if (json_is_array(p) && json_array_size(p) >= 1) {
        json_t *first = json_array_get(p, 0);
        if (json_is_string(first) || json_is_array(first)) { /* a batch of prompts */
            if (json_array_size(p) > 1)
                return ds_oai_errorf(e, 400, "prompt", "invalid_value",
                                     "prompt: only one prompt per request is supported, got %zu",
                                     json_array_size(p));
            p = first;
        }
    }
    if (json_is_string(p)) {
        r->prompt_len = json_string_length(p);
        r->prompt = malloc(r->prompt_len + 1);
        if (!r->prompt) return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
        memcpy(r->prompt, json_string_value(p), r->prompt_len + 1);
        return DS_OK;
    }
    if (json_is_array(p))
        return get_ids(p, "prompt", vocab_size, &r->prompt_ids, &r->n_prompt_ids, e);
    return type_error(e, "prompt", "a string or a list of token ids", p);
}

static int parse_stop(json_t *root, int vocab_size, ds_request_params *pp, ds_oai_error *e) {
    json_t *s = field(root, "stop");
    if (s) {
        if (!json_is_string(s) && !json_is_array(s))
            return type_error(e, "stop", "a string or a list of strings", s);
        size_t n = json_is_string(s) ? 1 : json_array_size(s);
        if (n > DS_MAX_STOP)
            return ds_oai_errorf(e, 400, "stop", "invalid_value",
                                 "stop: at most %d stop strings, got %zu", DS_MAX_STOP, n);
        for (size_t i = 0; i < n; i++) {
            json_t *x = json_is_string(s) ? s : json_array_get(s, i);
            if (!json_is_string(x))
                return ds_oai_errorf(e, 400, "stop", "invalid_type",
                                     "stop[%zu]: expected a string, got %s", i,
                                     ds_json_type_name(x));
            if (json_string_length(x) == 0) continue; /* matches everywhere: meaningless */
            if (strlen(json_string_value(x)) != json_string_length(x))
                return ds_oai_errorf(e, 400, "stop", "invalid_value",
                                     "stop[%zu]: a stop string cannot contain NUL (\\u0000)", i);
            char *c = strndup(json_string_value(x), json_string_length(x));
            if (!c) return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
            pp->stop[pp->n_stop++] = c;
        }
    }
    json_t *t = field(root, "stop_token_ids");
    if (t) {
        if (!json_is_array(t)) return type_error(e, "stop_token_ids", "a list of token ids", t);
        if (json_array_size(t) > DS_MAX_STOP)
            return ds_oai_errorf(e, 400, "stop_token_ids", "invalid_value",
                                 "stop_token_ids: at most %d ids, got %zu", DS_MAX_STOP,
                                 json_array_size(t));
        int32_t *ids;
        int n;
        if (get_ids(t, "stop_token_ids", vocab_size, &ids, &n, e)) return DS_ERR;
        memcpy(pp->stop_token_ids, ids, (size_t)n * sizeof *ids);
        pp->n_stop_token_ids = n;
        free(ids);
    }
    return DS_OK;
}

/* Chat-only fields: messages, tools, tool_choice, thinking switches. */
static int parse_chat(json_t *root, ds_oai_request *r, ds_oai_error *e) {
    json_t *m = field(root, "messages");
    if (!m)
        return ds_oai_errorf(e, 400, "messages", "missing_required_parameter",
                             "messages: this field is required");
    if (!json_is_array(m)) return type_error(e, "messages", "a list of messages", m);
    if (json_array_size(m) == 0)
        return ds_oai_errorf(e, 400, "messages", "invalid_value",
                             "messages: at least one message is required");
    for (size_t i = 0; i < json_array_size(m); i++)
        if (!json_is_object(json_array_get(m, i)))
            return ds_oai_errorf(e, 400, "messages", "invalid_type",
                                 "messages[%zu]: expected an object, got %s", i,
                                 ds_json_type_name(json_array_get(m, i)));
    r->messages_json = json_dumps(m, JSON_COMPACT);
    json_t *t = field(root, "tools");
    if (t) {
        if (!json_is_array(t)) return type_error(e, "tools", "a list of tools", t);
        if (json_array_size(t)) r->tools_json = json_dumps(t, JSON_COMPACT);
    }
    json_t *tc = field(root, "tool_choice");
    if (tc) {
        if (json_is_string(tc)) {
            const char *v = json_string_value(tc);
            if (strlen(v) != json_string_length(tc))
                return ds_oai_errorf(e, 400, "tool_choice", "invalid_value",
                                     "tool_choice: must not contain NUL (\\u0000)");
            if (strcmp(v, "auto") && strcmp(v, "none") && strcmp(v, "required"))
                return ds_oai_errorf(e, 400, "tool_choice", "invalid_value",
                                     "tool_choice: expected \"auto\", \"none\", \"required\" or a "
                                     "function object, got \"%s\"",
                                     v);
            if (strcmp(v, "auto")) r->tool_choice = strdup(v);
            if (!strcmp(v, "required")) r->tool_choice_json = json_dumps(tc, JSON_ENCODE_ANY);
        } else if (json_is_object(tc)) {
            r->tool_choice = strdup("required"); /* a named function: a call is required */
            r->tool_choice_json = json_dumps(tc, JSON_COMPACT);
        } else {
            return type_error(e, "tool_choice", "a string or an object", tc);
        }
    }
    if (get_bool(root, "parallel_tool_calls", &r->parallel_tool_calls, e)) return DS_ERR;
    if (get_str(root, "reasoning_effort", &r->thinking_effort, e)) return DS_ERR;
    if (get_bool(root, "add_generation_prompt", &r->add_generation_prompt, e)) return DS_ERR;
    json_t *kw = field(root, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw)) return type_error(e, "chat_template_kwargs", "an object", kw);
        /* both spellings are in use (Kimi's "thinking", Qwen-style "enable_thinking") */
        if (get_bool(kw, "thinking", &r->thinking, e) ||
            get_bool(kw, "enable_thinking", &r->thinking, e))
            return DS_ERR;
    }
    if (!r->messages_json || (t && json_array_size(t) && !r->tools_json))
        return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    return DS_OK;
}

/* Everything but JSON syntax. Fills r; on error the caller frees r. */
/* vLLM's kv_transfer_params (null or absent: none). The producer's own answer is passed back by
 * the router as it came, so its fields are checked as this server wrote them. */
static int parse_kv_params(json_t *root, ds_oai_request *r, ds_oai_error *e) {
    json_t *kv = field(root, "kv_transfer_params");
    if (!kv || json_is_null(kv)) return DS_OK;
    if (!json_is_object(kv)) return type_error(e, "kv_transfer_params", "an object", kv);
    json_t *d = json_object_get(kv, "do_remote_decode"),
           *p = json_object_get(kv, "do_remote_prefill");
    if (d && !json_is_boolean(d))
        return type_error(e, "kv_transfer_params.do_remote_decode", "a boolean", d);
    if (p && !json_is_boolean(p))
        return type_error(e, "kv_transfer_params.do_remote_prefill", "a boolean", p);
    r->kv_do_remote_decode = json_is_true(d);
    r->kv_do_remote_prefill = json_is_true(p);
    if (!r->kv_do_remote_prefill) return DS_OK;
    json_t *h = json_object_get(kv, "remote_host"), *pt = json_object_get(kv, "remote_port"),
           *id = json_object_get(kv, "remote_request_id");
    if (!json_is_string(h))
        return type_error(e, "kv_transfer_params.remote_host", "a string", h ? h : json_null());
    if (!json_is_integer(pt) || json_integer_value(pt) < 1 || json_integer_value(pt) > 65535)
        return ds_oai_errorf(e, 400, "kv_transfer_params.remote_port", "invalid_value",
                             "kv_transfer_params.remote_port: expected a port in 1..65535");
    char *end = NULL;
    const char *ids = json_is_string(id) ? json_string_value(id) : "";
    unsigned long long v = strtoull(ids, &end, 16);
    if (strlen(ids) != 16 || *end || v == 0)
        return ds_oai_errorf(e, 400, "kv_transfer_params.remote_request_id", "invalid_value",
                             "kv_transfer_params.remote_request_id: expected the producer's 16 "
                             "hex digits");
    if (!(r->kv_remote_host = strdup(json_string_value(h))))
        return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    r->kv_remote_port = (int)json_integer_value(pt);
    r->kv_remote_id = v;
    return DS_OK;
}

static int parse_fields(json_t *root, const char *served_name, int vocab_size, ds_oai_request *r,
                        ds_oai_error *e) {
    ds_request_params *pp = &r->params;
    int chat = r->kind == DS_OAI_CHAT;
    long long x;
    int set;

    if (get_str(root, "model", &r->model, e)) return DS_ERR;
    if (r->model && served_name && strcmp(r->model, served_name))
        return ds_oai_errorf(e, 404, "model", "model_not_found",
                             "The model `%.200s` does not exist. This server serves `%.200s`.",
                             r->model, served_name);
    if (chat ? parse_chat(root, r, e) : parse_prompt(root, vocab_size, r, e)) return DS_ERR;
    /* both endpoints, as vLLM's: a completion's text can follow a schema as well */
    json_t *rf = field(root, "response_format");
    if (rf) {
        if (!json_is_object(rf)) return type_error(e, "response_format", "an object", rf);
        json_t *ty = json_object_get(rf, "type");
        if (!json_is_string(ty) || strcmp(json_string_value(ty), "text"))
            if (!(r->response_format_json = json_dumps(rf, JSON_COMPACT)))
                return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    }

    /* Unsupported features are refused rather than silently ignored. */
    int echo = 0;
    if (get_bool(root, "echo", &echo, e)) return DS_ERR;
    if (echo)
        return ds_oai_errorf(e, 400, "echo", "unsupported_parameter",
                             "echo: returning the prompt is not supported");
    json_t *suffix = field(root, "suffix");
    if (suffix && (!json_is_string(suffix) || json_string_length(suffix)))
        return ds_oai_errorf(e, 400, "suffix", "unsupported_parameter",
                             "suffix: insertion (suffix) is not supported");
    json_t *bias = field(root, "logit_bias");
    if (bias && (!json_is_object(bias) || json_object_size(bias)))
        return ds_oai_errorf(e, 400, "logit_bias", "unsupported_parameter",
                             "logit_bias: not supported");

    if (get_int(root, "n", 1, DS_OAI_MAX_N, &x, &set, e)) return DS_ERR;
    if (set) pp->n = (int)x;
    if (get_int(root, "best_of", 1, DS_OAI_MAX_N, &x, &set, e)) return DS_ERR;
    if (set && x != pp->n)
        return ds_oai_errorf(e, 400, "best_of", "unsupported_parameter",
                             "best_of: only best_of == n is supported");

    /* max_completion_tokens is the newer chat name; it wins when both are given */
    const int max_cap = 1 << 30;
    if (get_int(root, "max_tokens", 1, max_cap, &x, &set, e)) return DS_ERR;
    if (set) pp->max_tokens = (int)x, r->max_tokens_set = 1;
    if (get_int(root, "max_completion_tokens", 1, max_cap, &x, &set, e)) return DS_ERR;
    if (set) pp->max_tokens = (int)x, r->max_tokens_set = 1;
    if (get_int(root, "min_tokens", 0, max_cap, &x, &set, e)) return DS_ERR;
    if (set) pp->min_tokens = (int)x;
    if (set && r->max_tokens_set && pp->min_tokens > pp->max_tokens)
        return ds_oai_errorf(e, 400, "min_tokens", "invalid_value",
                             "min_tokens: must be <= max_tokens (%d), got %d", pp->max_tokens,
                             pp->min_tokens);

    if (get_num(root, "temperature", 0, 2, 0, &pp->sample.temperature, e) ||
        get_num(root, "top_p", 0, 1, 1, &pp->sample.top_p, e) ||
        get_num(root, "min_p", 0, 1, 0, &pp->sample.min_p, e) ||
        get_num(root, "presence_penalty", -2, 2, 0, &pp->sample.presence_penalty, e) ||
        get_num(root, "frequency_penalty", -2, 2, 0, &pp->sample.frequency_penalty, e))
        return DS_ERR;
    if (get_int(root, "top_k", -1, 1 << 30, &x, &set, e)) return DS_ERR;
    if (set) pp->sample.top_k = x < 0 ? 0 : (int)x; /* vLLM's -1 and 0 both mean off */
    if (get_int(root, "seed", INT64_MIN, INT64_MAX, &x, &set, e)) return DS_ERR;
    if (set) pp->has_seed = 1, pp->seed = (uint64_t)x;

    if (parse_stop(root, vocab_size, pp, e)) return DS_ERR;
    if (get_bool(root, "ignore_eos", &pp->ignore_eos, e) ||
        get_bool(root, "skip_special_tokens", &pp->skip_special_tokens, e) ||
        get_bool(root, "return_token_ids", &r->return_token_ids, e))
        return DS_ERR;

    if (chat) {
        int lp = 0;
        if (get_bool(root, "logprobs", &lp, e)) return DS_ERR;
        if (get_int(root, "top_logprobs", 0, DS_MAX_LOGPROBS, &x, &set, e)) return DS_ERR;
        if (set && x > 0 && !lp)
            return ds_oai_errorf(e, 400, "top_logprobs", "invalid_value",
                                 "top_logprobs: requires logprobs to be true");
        pp->logprobs = lp ? (set ? (int)x : 0) : -1;
    } else {
        if (get_int(root, "logprobs", 0, DS_MAX_LOGPROBS, &x, &set, e)) return DS_ERR;
        pp->logprobs = set ? (int)x : -1;
    }

    if (get_bool(root, "stream", &r->stream, e)) return DS_ERR;
    json_t *so = field(root, "stream_options");
    if (so) {
        if (!json_is_object(so)) return type_error(e, "stream_options", "an object", so);
        if (!r->stream)
            return ds_oai_errorf(e, 400, "stream_options", "invalid_value",
                                 "stream_options: only allowed when stream is true");
        json_t *iu = field(so, "include_usage");
        if (iu && !json_is_boolean(iu))
            return type_error(e, "stream_options.include_usage", "a boolean", iu);
        r->include_usage = json_is_true(iu);
    }
    return parse_kv_params(root, r, e);
}

int ds_oai_parse_request(ds_oai_kind kind, const char *body, size_t len, const char *served_name,
                         int vocab_size, ds_oai_request *out, ds_oai_error *e) {
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->add_generation_prompt = 1;
    out->thinking = 1;
    out->parallel_tool_calls = 1;
    ds_request_params_default(&out->params);
    json_error_t je;
    /* NUL is legal in JSON strings (a prompt may hold one); fields that cannot carry it say so */
    json_t *root = json_loadb(body ? body : "", len, JSON_ALLOW_NUL, &je);
    if (!root)
        return ds_oai_errorf(e, 400, NULL, "invalid_json",
                             "invalid JSON in the request body: %s (line %d, column %d)", je.text,
                             je.line, je.column);
    int rc = DS_OK;
    if (!json_is_object(root))
        rc = ds_oai_errorf(e, 400, NULL, "invalid_json",
                           "the request body must be a JSON object, got %s",
                           ds_json_type_name(root));
    else
        rc = parse_fields(root, served_name, vocab_size, out, e);
    json_decref(root);
    if (rc) {
        ds_oai_request_free(out);
        memset(out, 0, sizeof *out);
    }
    return rc;
}

void ds_oai_request_free(ds_oai_request *r) {
    if (!r) return;
    free(r->model);
    free(r->prompt);
    free(r->prompt_ids);
    free(r->messages_json);
    free(r->tools_json);
    free(r->tool_choice);
    free(r->tool_choice_json);
    free(r->response_format_json);
    free(r->params.grammar);
    r->params.grammar = NULL;
    free(r->thinking_effort);
    free(r->kv_remote_host);
    r->kv_remote_host = NULL;
    for (int i = 0; i < r->params.n_stop; i++) free(r->params.stop[i]);
    r->params.n_stop = 0;
}

int ds_oai_fit_context(ds_oai_request *r, int n_prompt, int max_model_len, ds_oai_error *e) {
    const char *what = r->kind == DS_OAI_CHAT ? "messages" : "prompt";
    ds_request_params *pp = &r->params;
    if (n_prompt <= 0)
        return ds_oai_errorf(e, 400, what, "invalid_value", "%s: the prompt is empty", what);
    if (r->max_tokens_set && (long long)n_prompt + pp->max_tokens > max_model_len)
        return ds_oai_errorf(e, 400, what, "context_length_exceeded",
                             "This model's maximum context length is %d tokens. However, you "
                             "requested %lld tokens (%d in the %s, %d in the completion). Please "
                             "reduce the length of the %s or completion.",
                             max_model_len, (long long)n_prompt + pp->max_tokens, n_prompt, what,
                             pp->max_tokens, what);
    if (n_prompt >= max_model_len)
        return ds_oai_errorf(e, 400, what, "context_length_exceeded",
                             "This model's maximum context length is %d tokens. However, the %s "
                             "has %d tokens, which leaves no room for the completion. Please "
                             "reduce the length of the %s.",
                             max_model_len, what, n_prompt, what);
    if (!r->max_tokens_set) {
        int left = max_model_len - n_prompt;
        pp->max_tokens = r->kind == DS_OAI_COMPLETIONS ? DS_MIN(16, left) : left;
    }
    if (pp->min_tokens > pp->max_tokens) pp->min_tokens = pp->max_tokens;
    return DS_OK;
}

/* ---------------------------------------------------------------------------------------------
 * responses */

static json_t *finish_json(ds_finish f) {
    return f == DS_FINISH_NONE ? json_null() : json_string(ds_finish_name(f));
}

static json_t *logprob_json(float lp) {
    double v = lp;
    if (!isfinite(v) || v < LOGPROB_FLOOR) v = LOGPROB_FLOOR;
    return json_real(v);
}

/* A token's bytes: its text for logprobs (a special's name). Unknown ids give "". */
static const char *token_bytes(const ds_oai_resp_ctx *c, int32_t id, size_t *len) {
    const char *b = c->tok ? ds_tok_token_bytes(c->tok, id, len) : NULL;
    if (!b) *len = 0;
    return b ? b : "";
}

/* Chat logprob entry {token, logprob, bytes} (+ top_logprobs when top != NULL). */
static json_t *chat_lp_entry(const ds_oai_resp_ctx *c, int32_t id, float lp) {
    size_t n;
    const char *b = token_bytes(c, id, &n);
    json_t *bytes = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(bytes, json_integer((unsigned char)b[i]));
    return json_pack("{s:o, s:o, s:o}", "token", ds_oai_json_string_lossy(b, n), "logprob",
                     logprob_json(lp), "bytes", bytes);
}

/* Appends the event's token to a logprobs object in the endpoint's shape:
 *   completions: {tokens: [s], token_logprobs: [f], top_logprobs: [{s: f}], text_offset: [i]}
 *   chat:        {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}
 * *n_chars is the character offset of this token's text and advances past it. */
static int lp_append(const ds_oai_resp_ctx *c, json_t *lp, const ds_oai_event *ev,
                     long long *n_chars) {
    size_t n;
    const char *b = token_bytes(c, ev->token, &n);
    int ok = 1;
    if (c->kind == DS_OAI_CHAT) {
        json_t *entry = chat_lp_entry(c, ev->token, ev->logprob);
        json_t *top = json_array();
        for (int i = 0; i < ev->n_top; i++)
            json_array_append_new(top, chat_lp_entry(c, ev->top_ids[i], ev->top_logprobs[i]));
        ok = entry && !json_object_set_new(entry, "top_logprobs", top) &&
             !json_array_append_new(json_object_get(lp, "content"), entry);
    } else {
        json_t *top = json_object();
        for (int i = 0; i < ev->n_top; i++) {
            size_t tn, kn;
            const char *tb = token_bytes(c, ev->top_ids[i], &tn);
            char *key;
            if (utf8_lossy(tb, tn, &key, &kn)) return DS_ERR;
            /* two ids can share a (lossy) string; the more likely one, listed first, wins */
            if (!json_object_getn(top, key, kn))
                json_object_setn_new(top, key, kn, logprob_json(ev->top_logprobs[i]));
            free(key);
        }
        ok =
            !json_array_append_new(json_object_get(lp, "tokens"), ds_oai_json_string_lossy(b, n)) &&
            !json_array_append_new(json_object_get(lp, "token_logprobs"),
                                   logprob_json(ev->logprob)) &&
            !json_array_append_new(json_object_get(lp, "top_logprobs"), top) &&
            !json_array_append_new(json_object_get(lp, "text_offset"), json_integer(*n_chars));
    }
    if (c->keep_special || !c->tok || !ds_tok_is_special(c->tok, ev->token))
        *n_chars += utf8_chars(b, n);
    return ok ? DS_OK : DS_ERR;
}

static json_t *lp_new(ds_oai_kind kind) {
    if (kind == DS_OAI_CHAT) return json_pack("{s:[]}", "content");
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs",
                     "text_offset");
}

int ds_oai_choice_add(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev,
                      ds_err *err) {
    if (ev->text_len) {
        if (ch->len + ev->text_len + 1 > ch->cap) {
            size_t cap = DS_MAX(2 * ch->cap, ch->len + ev->text_len + 64);
            char *t = realloc(ch->text, cap);
            if (!t) return ds_errf(err, "out of memory for the response text");
            ch->text = t, ch->cap = cap;
        }
        memcpy(ch->text + ch->len, ev->text, ev->text_len);
        ch->len += ev->text_len;
        ch->text[ch->len] = 0;
    }
    if (c->token_ids && ev->token >= 0) {
        if (!ch->token_ids && !(ch->token_ids = json_array()))
            return ds_errf(err, "out of memory for token ids");
        if (json_array_append_new(ch->token_ids, json_integer(ev->token)))
            return ds_errf(err, "out of memory for token ids");
    }
    if (c->logprobs >= 0 && ev->token >= 0) {
        if (!ch->logprobs && !(ch->logprobs = lp_new(c->kind)))
            return ds_errf(err, "out of memory for logprobs");
        if (lp_append(c, ch->logprobs, ev, &ch->n_chars))
            return ds_errf(err, "out of memory for logprobs");
    }
    if (ds_oai_parsing(c) && ds_oai_parse_event(c, ch, ev, err)) return DS_ERR;
    ch->n_generated = DS_MAX(ch->n_generated, ev->n_generated);
    if (ev->finish != DS_FINISH_NONE) ch->finish = ev->finish;
    return DS_OK;
}

void ds_oai_choice_free(ds_oai_choice *ch) {
    if (!ch) return;
    free(ch->text);
    json_decref(ch->logprobs);
    json_decref(ch->token_ids);
    if (ch->tp) ds_tp_free(ch->tp);
    if (ch->tpo) ds_tp_out_free(ch->tpo);
    free(ch->tp);
    free(ch->tpo);
    memset(ch, 0, sizeof *ch);
}

static json_t *usage_json(int n_prompt, int n_completion) {
    return json_pack("{s:i, s:i, s:i}", "prompt_tokens", n_prompt, "completion_tokens",
                     n_completion, "total_tokens", n_prompt + n_completion);
}

/* {id, object, created, model} shared by every response and chunk. */
static json_t *envelope(const ds_oai_resp_ctx *c, const char *object) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", c->id, "object", object, "created",
                     (json_int_t)c->created, "model", c->model);
}

json_t *ds_oai_response(const ds_oai_resp_ctx *c, const ds_oai_choice *choices, int n,
                        int n_prompt) {
    int chat = c->kind == DS_OAI_CHAT;
    json_t *r = envelope(c, chat ? "chat.completion" : "text_completion");
    json_t *arr = json_array();
    int n_completion = 0;
    for (int i = 0; i < n; i++) {
        const ds_oai_choice *ch = &choices[i];
        json_t *text = ds_oai_json_string_lossy(ch->text ? ch->text : "", ch->len);
        json_t *o = json_pack("{s:i}", "index", i);
        if (chat && ds_oai_parsing(c)) {
            json_decref(text);
            json_object_set_new(o, "message", ds_oai_parsed_message(c, ch));
        } else if (chat)
            json_object_set_new(o, "message",
                                json_pack("{s:s, s:o}", "role", "assistant", "content", text));
        else
            json_object_set_new(o, "text", text);
        json_t *lp = ch->logprobs       ? json_incref(ch->logprobs)
                     : c->logprobs >= 0 ? lp_new(c->kind) /* asked for, but no token came */
                                        : json_null();
        json_object_set_new(o, "logprobs", lp);
        json_object_set_new(o, "finish_reason",
                            chat && ds_oai_parsing(c) ? ds_oai_parsed_finish(ch, ch->finish)
                                                      : finish_json(ch->finish));
        if (c->token_ids)
            json_object_set_new(o, "token_ids",
                                ch->token_ids ? json_incref(ch->token_ids) : json_array());
        json_array_append_new(arr, o);
        n_completion += ch->n_generated;
    }
    json_object_set_new(r, "choices", arr);
    json_object_set_new(r, "usage", usage_json(n_prompt, n_completion));
    return r;
}

/* A parsed chat choice's chunks for one event (steals lp): one per delta of the parser's output
 * (ds_oai_parsed_deltas), the first with the logprobs and token ids, the last with the finish;
 * one chunk with an empty delta when only those are to be sent; NULL when nothing is. */
static json_t *parsed_chunks(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev,
                             json_t *lp) {
    ds_err err;
    if (ch->tpo) ds_tp_out_clear(ch->tpo);
    json_t *deltas = NULL;
    if (ds_oai_parse_event(c, ch, ev, &err) || !(deltas = ds_oai_parsed_deltas(c, ch))) {
        json_decref(lp);
        return NULL;
    }
    int with_ids = c->token_ids && ev->token >= 0;
    if (!json_array_size(deltas)) {
        if (!lp && ev->finish == DS_FINISH_NONE && !with_ids) {
            json_decref(deltas);
            return NULL;
        }
        json_array_append_new(deltas, json_object());
    }
    json_t *out = json_array();
    size_t n = json_array_size(deltas);
    for (size_t k = 0; k < n; k++) {
        json_t *r = envelope(c, "chat.completion.chunk");
        json_t *o = json_pack("{s:i, s:O}", "index", ev->index, "delta", json_array_get(deltas, k));
        json_object_set_new(o, "logprobs", k == 0 && lp ? json_incref(lp) : json_null());
        json_object_set_new(o, "finish_reason",
                            ds_oai_parsed_finish(ch, k + 1 == n ? ev->finish : DS_FINISH_NONE));
        if (c->token_ids)
            json_object_set_new(o, "token_ids",
                                k == 0 && ev->token >= 0 ? json_pack("[i]", (int)ev->token)
                                                         : json_array());
        json_object_set_new(r, "choices", json_pack("[o]", o));
        json_array_append_new(out, r);
    }
    json_decref(deltas);
    json_decref(lp);
    if (n == 1) { /* the common case: a plain chunk */
        json_t *one = json_incref(json_array_get(out, 0));
        json_decref(out);
        return one;
    }
    return out;
}

json_t *ds_oai_chunk(const ds_oai_resp_ctx *c, ds_oai_choice *ch, const ds_oai_event *ev) {
    json_t *lp = NULL;
    if (c->logprobs >= 0 && ev->token >= 0) {
        lp = lp_new(c->kind);
        if (!lp || lp_append(c, lp, ev, &ch->n_chars)) {
            json_decref(lp);
            return NULL;
        }
    }
    ch->n_generated = DS_MAX(ch->n_generated, ev->n_generated);
    if (ev->finish != DS_FINISH_NONE) ch->finish = ev->finish;
    if (ds_oai_parsing(c)) return parsed_chunks(c, ch, ev, lp);
    if (!ev->text_len && !lp && ev->finish == DS_FINISH_NONE && !(c->token_ids && ev->token >= 0))
        return NULL;

    int chat = c->kind == DS_OAI_CHAT;
    json_t *r = envelope(c, chat ? "chat.completion.chunk" : "text_completion");
    json_t *text = ds_oai_json_string_lossy(ev->text ? ev->text : "", ev->text_len);
    json_t *o = json_pack("{s:i}", "index", ev->index);
    if (chat) {
        /* the closing chunk of a choice has an empty delta, as OpenAI sends it */
        json_t *delta = json_object();
        if (ev->text_len || ev->finish == DS_FINISH_NONE) json_object_set(delta, "content", text);
        json_object_set_new(o, "delta", delta);
        json_decref(text);
    } else {
        json_object_set_new(o, "text", text);
    }
    json_object_set_new(o, "logprobs", lp ? lp : json_null());
    json_object_set_new(o, "finish_reason", finish_json(ev->finish));
    if (c->token_ids)
        json_object_set_new(o, "token_ids",
                            ev->token >= 0 ? json_pack("[i]", (int)ev->token) : json_array());
    json_object_set_new(r, "choices", json_pack("[o]", o));
    return r;
}

json_t *ds_oai_chunk_role(const ds_oai_resp_ctx *c, int index) {
    json_t *r = envelope(c, "chat.completion.chunk");
    json_t *o = json_pack("{s:i, s:{s:s, s:s}, s:n, s:n}", "index", index, "delta", "role",
                          "assistant", "content", "", "logprobs", "finish_reason");
    json_object_set_new(r, "choices", json_pack("[o]", o));
    return r;
}

json_t *ds_oai_chunk_usage(const ds_oai_resp_ctx *c, int n_prompt, int n_completion) {
    json_t *r = envelope(c, c->kind == DS_OAI_CHAT ? "chat.completion.chunk" : "text_completion");
    json_object_set_new(r, "choices", json_array());
    json_object_set_new(r, "usage", usage_json(n_prompt, n_completion));
    return r;
}

char *ds_oai_dumps(json_t *j) {
    if (!j) return NULL;
    char *s = json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(9));
    json_decref(j);
    return s;
}

char *ds_oai_sse(json_t *j, size_t *len) {
    if (json_is_array(j)) { /* several chunks: one event each */
        char *all = NULL;
        size_t n_all = 0;
        for (size_t i = 0; i < json_array_size(j); i++) {
            size_t n;
            char *one = ds_oai_sse(json_incref(json_array_get(j, i)), &n);
            char *t = one ? realloc(all, n_all + n + 1) : NULL;
            if (!t) {
                free(one);
                free(all);
                json_decref(j);
                return NULL;
            }
            all = t;
            memcpy(all + n_all, one, n + 1);
            n_all += n;
            free(one);
        }
        json_decref(j);
        *len = n_all;
        return all ? all : strdup("");
    }
    char *s = ds_oai_dumps(j);
    if (!s) return NULL;
    size_t n = strlen(s);
    char *out = malloc(n + 9);
    if (out) {
        memcpy(out, "data: ", 6);
        memcpy(out + 6, s, n);
        memcpy(out + 6 + n, "\n\n", 3);
        *len = n + 8;
    }
    free(s);
    return out;
}

/* The body as a JSON object, or a 400 naming what is wrong with it. */
static json_t *body_json(const char *body, size_t len, ds_oai_error *e) {
    json_error_t je;
    json_t *j = json_loadb(body ? body : "", len, JSON_ALLOW_NUL, &je);
    if (!j) {
        ds_oai_errorf(e, 400, NULL, "invalid_json",
                      "invalid JSON in the request body: %s (line %d, column %d)", je.text, je.line,
                      je.column);
        return NULL;
    }
    if (!json_is_object(j)) {
        json_decref(j);
        ds_oai_errorf(e, 400, NULL, "invalid_json", "the request body must be a JSON object");
        return NULL;
    }
    return j;
}

int ds_oai_parse_tokenize(const char *body, size_t len, const char *served_name, int vocab_size,
                          ds_oai_request *out, int *add_special, ds_oai_error *e) {
    memset(out, 0, sizeof *out);
    *add_special = 0;
    json_t *j = body_json(body, len, e);
    if (!j) return DS_ERR;
    int has_prompt = json_object_get(j, "prompt") != NULL;
    if (!has_prompt && !json_object_get(j, "messages")) {
        json_decref(j);
        return ds_oai_errorf(e, 400, "prompt", "missing_required_parameter",
                             "either prompt (text or token ids) or messages is required");
    }
    json_t *as = json_object_get(j, "add_special_tokens");
    if (as && !json_is_boolean(as) && !json_is_null(as)) {
        json_decref(j);
        return ds_oai_errorf(e, 400, "add_special_tokens", "invalid_type",
                             "add_special_tokens: expected a boolean");
    }
    *add_special = json_is_true(as);
    /* reuse the generation parser for the prompt/messages forms and the model check; the
     * sampling fields it also reads are absent here and take their defaults */
    json_t *sub = json_object();
    const char *keys[] = {
        "model", "prompt", "messages", "tools", "add_generation_prompt", "chat_template_kwargs"};
    for (size_t i = 0; sub && i < DS_ARRAY_LEN(keys); i++)
        if (json_object_get(j, keys[i])) json_object_set(sub, keys[i], json_object_get(j, keys[i]));
    json_decref(j);
    char *txt = sub ? ds_oai_dumps(sub) : NULL; /* steals sub */
    if (!txt) return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    int rc = ds_oai_parse_request(has_prompt ? DS_OAI_COMPLETIONS : DS_OAI_CHAT, txt, strlen(txt),
                                  served_name, vocab_size, out, e);
    free(txt);
    return rc;
}

int ds_oai_parse_detokenize(const char *body, size_t len, const char *served_name, int vocab_size,
                            int32_t **ids, int *n, ds_oai_error *e) {
    *ids = NULL;
    *n = 0;
    json_t *j = body_json(body, len, e);
    if (!j) return DS_ERR;
    json_t *model = json_object_get(j, "model");
    if (json_is_string(model) && strlen(json_string_value(model)) != json_string_length(model)) {
        json_decref(j);
        return ds_oai_errorf(e, 400, "model", "invalid_value",
                             "model: must not contain NUL (\\u0000)");
    }
    if (served_name && json_is_string(model) && strcmp(json_string_value(model), served_name)) {
        ds_oai_errorf(e, 404, "model", "model_not_found", "The model `%.200s` does not exist.",
                      json_string_value(model));
        json_decref(j);
        return DS_ERR;
    }
    json_t *t = json_object_get(j, "tokens");
    if (!json_is_array(t)) {
        json_decref(j);
        return ds_oai_errorf(e, 400, "tokens", "invalid_type",
                             "tokens: expected a list of token ids");
    }
    size_t cnt = json_array_size(t);
    if (cnt > INT32_MAX / 2) {
        json_decref(j);
        return ds_oai_errorf(e, 400, "tokens", "invalid_value", "tokens: too many ids");
    }
    int32_t *out = malloc((cnt ? cnt : 1) * sizeof *out);
    if (!out) {
        json_decref(j);
        return ds_oai_errorf(e, 500, NULL, NULL, "out of memory");
    }
    for (size_t i = 0; i < cnt; i++) {
        json_t *x = json_array_get(t, i);
        long long v = json_integer_value(x);
        if (!json_is_integer(x) || v < 0 || v >= vocab_size) {
            free(out);
            json_decref(j);
            return ds_oai_errorf(e, 400, "tokens", "invalid_value",
                                 "tokens[%zu]: expected a token id in [0, %d)", i, vocab_size);
        }
        out[i] = (int32_t)v;
    }
    json_decref(j);
    *ids = out;
    *n = (int)cnt;
    return DS_OK;
}
