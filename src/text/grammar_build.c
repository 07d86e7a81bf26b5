/* grammar_build.c — the Lark grammars of grammar.h's OpenAI features: response_format (a JSON
 * schema as `%json{...}`) and enforced tool calls (the chat format's call syntax around each
 * tool's `parameters` schema). The text of a grammar is also its cache key, so the same request
 * gives the same text byte for byte (schemas are dumped compactly, in their given key order:
 * llguidance writes object properties in schema order). */
#include "text/grammar.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A Lark string literal of s[n] (JSON's escapes, which Lark reads the same way). */
static void sb_lit(ds_sbuf *b, const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    char *d = j ? json_dumps(j, JSON_ENCODE_ANY) : NULL;
    if (!d)
        b->oom = 1;
    else
        ds_sbuf_puts(b, d);
    free(d);
    json_decref(j);
}

/* A special token by id, as the grammar names it (<[id]>): its text can never match it. */
static int sb_special(ds_sbuf *b, const ds_grammar_ctx *c, const char *name, ds_err *err) {
    int32_t id = ds_tok_special_id(c->tok, name);
    if (id < 0) return ds_errf(err, "the model's tokenizer has no %s token", name);
    ds_sbuf_printf(b, " <[%d]>", (int)id);
    return DS_OK;
}

/* K3 XTML: <|open|>TAG<|sep|> or <|close|>TAG<|sep|>, TAG given as raw text. */
static int k3_mark(ds_sbuf *b, const ds_grammar_ctx *c, int open, const char *tag, ds_err *err) {
    if (sb_special(b, c, open ? "<|open|>" : "<|close|>", err)) return DS_ERR;
    ds_sbuf_puts(b, " ");
    sb_lit(b, tag, strlen(tag));
    return sb_special(b, c, "<|sep|>", err);
}

/* The schema as the grammar embeds it: compact JSON, with llguidance's whitespace fixed to
 * json.dumps' separators unless the schema sets x-guidance itself (free whitespace lets a weak
 * model write blanks until max_tokens). */
static int schema_text(ds_sbuf *b, json_t *schema, const char *where, ds_err *err) {
    if (json_is_true(schema))
        schema = NULL; /* true: any JSON value */
    else if (!json_is_object(schema))
        return ds_errf(err, "%s: expected a JSON schema object", where);
    json_t *s = schema ? json_copy(schema) : json_object();
    if (!s) return ds_errf(err, "out of memory");
    if (!json_object_get(s, "x-guidance"))
        json_object_set_new(s, "x-guidance",
                            json_pack("{s:b, s:s, s:s}", "whitespace_flexible", 0, "item_separator",
                                      ", ", "key_separator", ": "));
    char *d = json_dumps(s, JSON_COMPACT);
    json_decref(s);
    if (!d) return ds_errf(err, "out of memory");
    ds_sbuf_puts(b, "%json ");
    ds_sbuf_puts(b, d);
    free(d);
    return DS_OK;
}

static int finish(ds_sbuf *b, char **lark, ds_err *err) {
    if (b->oom) {
        free(b->p);
        return ds_errf(err, "out of memory");
    }
    *lark = b->p;
    return DS_OK;
}

int ds_grammar_from_response_format(const ds_grammar_ctx *c, const char *rf_json, char **lark,
                                    ds_err *err) {
    *lark = NULL;
    json_error_t je;
    json_t *rf = json_loads(rf_json, 0, &je);
    if (!json_is_object(rf)) {
        json_decref(rf);
        return ds_errf(err, "response_format: expected an object");
    }
    json_t *ty = json_object_get(rf, "type");
    const char *t = json_string_value(ty);
    int rc = DS_OK;
    json_t *schema = NULL;
    if (!t || (strcmp(t, "text") && strcmp(t, "json_object") && strcmp(t, "json_schema")))
        rc = ds_errf(err, "response_format.type: expected \"text\", \"json_object\" or "
                          "\"json_schema\"");
    else if (!strcmp(t, "json_schema")) {
        json_t *js = json_object_get(rf, "json_schema");
        if (!json_is_object(js))
            rc = ds_errf(err, "response_format.json_schema: %s",
                         js ? "expected an object" : "this field is required");
        else if (!(schema = json_object_get(js, "schema")))
            rc = ds_errf(err, "response_format.json_schema.schema: this field is required");
    }
    if (rc || !strcmp(t, "text")) {
        json_decref(rf);
        return rc;
    }
    ds_sbuf b = {0};
    ds_sbuf_puts(&b, "start:");
    if (c->fmt == DS_CHAT_K3 && c->thinking &&
        (k3_mark(&b, c, 0, "think", err) || k3_mark(&b, c, 1, "response", err)))
        rc = DS_ERR;
    ds_sbuf_puts(&b, " body\nbody: ");
    json_t *obj = schema ? NULL : json_pack("{s:s}", "type", "object");
    if (!rc) rc = schema_text(&b, schema ? schema : obj, "response_format.json_schema.schema", err);
    json_decref(obj);
    json_decref(rf);
    if (rc) {
        free(b.p);
        return rc;
    }
    return finish(&b, lark, err);
}

/* Rule args_i: the arguments of tools[i], its `parameters` schema as JSON. */
static int args_rule(ds_sbuf *b, int i, json_t *params, ds_err *err) {
    char where[160];
    snprintf(where, sizeof where, "tools[%d].function.parameters", i);
    ds_sbuf_printf(b, "args_%d: ", i);
    /* no parameters: the function takes none, so its arguments are {} */
    json_t *obj = params ? NULL
                         : json_pack("{s:s, s:{}, s:b}", "type", "object", "properties",
                                     "additionalProperties", 0);
    int rc = schema_text(b, params ? params : obj, where, err);
    json_decref(obj);
    ds_sbuf_puts(b, "\n");
    return rc;
}

/* Rule call_i_k: the message's k-th call (from 0) being one of tool `name` (tools[i]), in the
 * chat format's syntax, its arguments args_i. The position is in the call: K3 numbers a
 * message's calls index="1", "2", ...; K2's id functions.NAME:n counts calls over the whole
 * conversation (c->call_base of them came before this message). */
static int call_rule(ds_sbuf *b, const ds_grammar_ctx *c, int i, int k, const char *name,
                     ds_err *err) {
    ds_sbuf_printf(b, "call_%d_%d:", i, k);
    if (c->fmt == DS_CHAT_K3) {
        ds_sbuf hdr = {0}; /* call tool="NAME" index="k+1", the name escaped as XTML attributes */
        ds_sbuf_puts(&hdr, "call tool=\"");
        for (const char *s = name; *s; s++)
            ds_sbuf_puts(&hdr, *s == '&' ? "&amp;" : *s == '"' ? "&quot;" : (char[2]){*s, 0});
        ds_sbuf_printf(&hdr, "\" index=\"%d\"", k + 1);
        int rc = hdr.oom ? ds_errf(err, "out of memory") : k3_mark(b, c, 1, hdr.p, err);
        free(hdr.p);
        if (rc || k3_mark(b, c, 1, "json type=\"object\"", err)) return DS_ERR;
        ds_sbuf_printf(b, " args_%d", i);
        if (k3_mark(b, c, 0, "json", err) || k3_mark(b, c, 0, "call", err)) return DS_ERR;
    } else {
        if (sb_special(b, c, "<|tool_call_begin|>", err)) return DS_ERR;
        ds_sbuf id = {0};
        ds_sbuf_printf(&id, "functions.");
        ds_sbuf_puts(&id, name);
        ds_sbuf_printf(&id, ":%d", c->call_base + k);
        if (id.oom) return ds_errf(err, "out of memory");
        ds_sbuf_puts(b, " ");
        sb_lit(b, id.p, id.len);
        free(id.p);
        if (sb_special(b, c, "<|tool_call_argument_begin|>", err)) return DS_ERR;
        ds_sbuf_printf(b, " args_%d", i);
        if (sb_special(b, c, "<|tool_call_end|>", err)) return DS_ERR;
    }
    ds_sbuf_puts(b, "\n");
    return DS_OK;
}

/* The named function of tool_choice ({"type":"function","function":{"name":N}}), or NULL for
 * "required". */
static int chosen_name(const char *tc_json, const char **name, json_t **tc, ds_err *err) {
    *name = NULL;
    *tc = NULL;
    if (!tc_json) return DS_OK;
    json_error_t je;
    *tc = json_loads(tc_json, JSON_DECODE_ANY, &je);
    if (json_is_string(*tc) && !strcmp(json_string_value(*tc), "required")) return DS_OK;
    json_t *fn = json_object_get(*tc, "function");
    *name = json_string_value(json_object_get(fn, "name"));
    if (!*name) return ds_errf(err, "tool_choice.function.name: expected the name of a tool");
    return DS_OK;
}

/* The name of tools[i], or NULL when it has none. */
static const char *tool_name(json_t *tools, size_t i) {
    json_t *fn = json_object_get(json_array_get(tools, i), "function");
    return json_string_value(json_object_get(fn, "name"));
}

/* The rules of the calls into b: args_i of every tool allowed (the chosen one, or all), a
 * call_i_k for each of them at each position k < max_calls, and calls_k: a call at position k,
 * then optionally calls_{k+1} (so calls_0 is one to max_calls calls, in order). */
static int call_rules(ds_sbuf *b, const ds_grammar_ctx *c, json_t *tools, const char *only,
                      int max_calls, ds_err *err) {
    int n = 0;
    for (size_t i = 0; i < json_array_size(tools); i++) {
        const char *name = tool_name(tools, i);
        if (!name) return ds_errf(err, "tools[%zu].function.name: expected a string", i);
        if (only && strcmp(only, name)) continue;
        json_t *params =
            json_object_get(json_object_get(json_array_get(tools, i), "function"), "parameters");
        if (args_rule(b, (int)i, params, err)) return DS_ERR;
        for (int k = 0; k < max_calls; k++)
            if (call_rule(b, c, (int)i, k, name, err)) return DS_ERR;
        n++;
    }
    if (!n)
        return only ? ds_errf(err, "tool_choice.function.name: no tool is named \"%s\"", only)
                    : ds_errf(err, "tool_choice: \"required\" needs at least one tool");
    for (int k = 0; k < max_calls; k++) {
        ds_sbuf_printf(b, "calls_%d: (", k);
        for (size_t i = 0, alt = 0; i < json_array_size(tools); i++) {
            if (only && strcmp(only, tool_name(tools, i))) continue;
            ds_sbuf_printf(b, "%scall_%zu_%d", alt++ ? " | " : "", i, k);
        }
        ds_sbuf_puts(b, ")");
        if (k + 1 < max_calls) ds_sbuf_printf(b, " calls_%d?", k + 1);
        ds_sbuf_puts(b, "\n");
    }
    return DS_OK;
}

int ds_grammar_from_tools(const ds_grammar_ctx *c, const char *tools_json,
                          const char *tool_choice_json, char **lark, ds_err *err) {
    *lark = NULL;
    json_error_t je;
    json_t *tools = tools_json ? json_loads(tools_json, 0, &je) : json_array();
    const char *only;
    json_t *tc;
    int rc = chosen_name(tool_choice_json, &only, &tc, err);
    if (!rc && !json_is_array(tools)) rc = ds_errf(err, "tools: expected a list of tools");
    /* a named function is called once (as vLLM does); "required" may call several tools in one
     * message unless parallel_tool_calls is false */
    int max_calls = only || !c->parallel ? 1 : DS_GRAMMAR_MAX_CALLS;
    ds_sbuf rules = {0}, b = {0};
    if (!rc) rc = call_rules(&rules, c, tools, only, max_calls, err);
    if (!rc) {
        ds_sbuf_puts(&b, "start:");
        if (c->fmt == DS_CHAT_K3) {
            /* the generation prompt opened the thought or the response: closed at once */
            rc = k3_mark(&b, c, 0, c->thinking ? "think" : "response", err);
            rc = rc ? rc : k3_mark(&b, c, 1, "tools", err);
        } else {
            rc = sb_special(&b, c, "<|tool_calls_section_begin|>", err);
        }
        ds_sbuf_puts(&b, " calls_0");
        if (!rc)
            rc = c->fmt == DS_CHAT_K3 ? k3_mark(&b, c, 0, "tools", err)
                                      : sb_special(&b, c, "<|tool_calls_section_end|>", err);
        ds_sbuf_puts(&b, "\n");
        if (rules.p) ds_sbuf_puts(&b, rules.p);
    }
    free(rules.p);
    json_decref(tools);
    json_decref(tc);
    if (rc || rules.oom) {
        free(b.p);
        return rc ? rc : ds_errf(err, "out of memory");
    }
    return finish(&b, lark, err);
}
