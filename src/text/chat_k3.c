/* chat_k3.c — the K3 chat format ("XTML" of encoding_k3.py): markers as ids, every other piece a
 * segment encoded on its own; tools, tool results in call order, and response_format; see chat.h.
 */
#include "text/chat_impl.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------------
 * K3 XTML, docs/model.md §9.5 (encoding_k3.py) */

/* Python's str.isspace() over UTF-8, for the reference's `.strip()` emptiness tests. */
static int is_blank(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        uint32_t cp;
        size_t w;
        if (c < 0x80)
            cp = c, w = 1;
        else if (c < 0xE0 && i + 1 < n)
            cp = (c & 0x1Fu) << 6 | (s[i + 1] & 0x3F), w = 2;
        else if (c < 0xF0 && i + 2 < n)
            cp = (c & 0x0Fu) << 12 | (s[i + 1] & 0x3Fu) << 6 | (s[i + 2] & 0x3F), w = 3;
        else
            return 0;
        int sp = (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 ||
                 cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 ||
                 cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
        if (!sp) return 0;
        i += w;
    }
    return 1;
}

/* ` key="value"` as four text segments, value escaped (& first, then "). */
static void k3_attr(render *r, const char *key, const char *val, size_t vlen) {
    size_t start = r->len;
    ds_chat_put(r, " ", 1);
    ds_chat_puts(r, key); /* argument names come from the request: any length */
    ds_chat_seg_close(r, start, SEG_TEXT);
    ds_chat_text(r, "=\"");
    size_t extra = 0;
    for (size_t i = 0; i < vlen; i++) extra += val[i] == '&' ? 4 : val[i] == '"' ? 5 : 0;
    char *esc = malloc(vlen + extra + 1);
    if (!esc) {
        r->oom = 1;
        return;
    }
    size_t o = 0;
    for (size_t i = 0; i < vlen; i++) {
        if (val[i] == '&')
            memcpy(esc + o, "&amp;", 5), o += 5;
        else if (val[i] == '"')
            memcpy(esc + o, "&quot;", 6), o += 6;
        else
            esc[o++] = val[i];
    }
    ds_chat_textn(r, esc, o);
    free(esc);
    ds_chat_text(r, "\"");
}

typedef struct {
    const char *key, *val; /* val NUL-terminated unless vlen is given */
    size_t vlen;
} attr;

static void k3_open(render *r, const char *tag, const attr *a, int na) {
    ds_chat_marker(r, "<|open|>");
    ds_chat_text(r, tag);
    for (int k = 0; k < na; k++)
        k3_attr(r, a[k].key, a[k].val, a[k].vlen ? a[k].vlen : strlen(a[k].val));
    ds_chat_marker(r, "<|sep|>");
}

static void k3_close(render *r, const char *tag) {
    ds_chat_marker(r, "<|close|>");
    ds_chat_text(r, tag);
    ds_chat_marker(r, "<|sep|>");
}

static void k3_end_message(render *r) {
    k3_close(r, "message");
    ds_chat_marker(r, "<|end_of_msg|>");
}

/* Content: a string is one segment; each text part of an array is its own segment. */
static void k3_content(render *r, json_t *m) {
    json_t *c = json_object_get(m, "content");
    if (json_is_string(c))
        ds_chat_textn(r, json_string_value(c), json_string_length(c));
    else if (json_is_array(c))
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *tx = json_object_get(json_array_get(c, k), "text");
            ds_chat_textn(r, json_string_value(tx), json_string_length(tx));
        }
}

static void k3_system_note(render *r, const char *type, const char *body) {
    attr a[2] = {{"role", "system", 0}, {"type", type, 0}};
    k3_open(r, "message", a, 2);
    ds_chat_text(r, body); /* the reference strips the body; none of ours has outer whitespace */
    k3_end_message(r);
}

static void k3_tool_declare(render *r, json_t *tools, int dynamic) {
    attr a[2] = {{"role", "system", 0}, {"type", "tool-declare", 0}};
    k3_open(r, "message", a, 2);
    /* One segment: header, compact deep-sorted JSON, fence. */
    size_t start = r->len;
    ds_chat_puts(r, dynamic ? "## New Tools Available\n"
                              "The system dynamically extends the toolset via lazy-loading.\n"
                              "You have access to all existing and extended tools.\n"
                              "Here are the specs for the extended tools.\n\n```json\n"
                            : "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
                              "```json\n");
    ds_chat_py_dumps(r, tools, 1, 1);
    ds_chat_puts(r, "\n```");
    ds_chat_seg_close(r, start, SEG_TEXT);
    k3_end_message(r);
}

static const char *xtml_type(json_t *v) {
    switch (json_typeof(v)) {
    case JSON_TRUE:
    case JSON_FALSE:
        return "boolean";
    case JSON_NULL:
        return "null";
    case JSON_INTEGER:
    case JSON_REAL:
        return "number";
    case JSON_STRING:
        return "string";
    case JSON_OBJECT:
        return "object";
    default:
        return "array";
    }
}

/* One tool call: arguments as XTML <argument> elements, or a raw <json> block when the string
 * does not parse (normalize_tool_arguments). */
static int k3_call(render *r, json_t *call, size_t index, const char *where, ds_err *err) {
    json_t *fn = json_object_get(call, "function");
    json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
    char ib[32];
    snprintf(ib, sizeof ib, "%zu", index);
    attr a[2] = {{"tool", json_string_value(name), json_string_length(name)}, {"index", ib, 0}};
    k3_open(r, "call", a, 2);
    json_t *parsed = NULL;
    const char *raw = NULL;
    size_t raw_len = 0;
    if (json_is_object(args))
        parsed = json_incref(args);
    else if (json_is_string(args) && !is_blank(json_string_value(args), json_string_length(args))) {
        json_error_t je;
        parsed = json_loadb(json_string_value(args), json_string_length(args),
                            JSON_DECODE_ANY | JSON_ALLOW_NUL, &je);
        if (!parsed) {
            raw = json_string_value(args);
            raw_len = json_string_length(args);
        } else if (!json_is_object(parsed)) {
            ds_errf(err, "%s.function.arguments: expected a JSON object, found %s", where,
                    ds_chat_type_name(parsed));
            json_decref(parsed);
            return DS_ERR;
        }
    }
    if (raw) {
        attr t[1] = {{"type", "object", 0}};
        k3_open(r, "json", t, 1);
        ds_chat_textn(r, raw, raw_len);
        k3_close(r, "json");
    } else if (parsed) {
        const char *key;
        json_t *val;
        json_object_foreach(parsed, key, val) {
            attr t[2] = {{"key", key, 0}, {"type", xtml_type(val), 0}};
            k3_open(r, "argument", t, 2);
            if (json_is_string(val))
                ds_chat_textn(r, json_string_value(val), json_string_length(val));
            else {
                size_t start = r->len;
                ds_chat_py_dumps(r, val, 0,
                                 0); /* _xtml_value: json.dumps with default separators */
                ds_chat_seg_close(r, start, SEG_TEXT);
            }
            k3_close(r, "argument");
        }
    }
    json_decref(parsed);
    k3_close(r, "call");
    return DS_OK;
}

static void k3_assistant(render *r, json_t *m, int thinking, int *rc, int i, ds_err *err) {
    if (thinking) {
        /* message.get("reasoning_content") or message.get("reasoning"), kept if not blank. */
        json_t *rv = json_object_get(m, "reasoning_content");
        if (!json_is_string(rv) || !json_string_length(rv)) rv = json_object_get(m, "reasoning");
        k3_open(r, "think", NULL, 0);
        if (json_is_string(rv) && !is_blank(json_string_value(rv), json_string_length(rv)))
            ds_chat_textn(r, json_string_value(rv), json_string_length(rv));
        k3_close(r, "think");
    }
    k3_open(r, "response", NULL, 0);
    k3_content(r, m);
    k3_close(r, "response");
    json_t *tc = json_object_get(m, "tool_calls");
    if (json_is_array(tc) && json_array_size(tc)) {
        k3_open(r, "tools", NULL, 0);
        for (size_t k = 0; k < json_array_size(tc) && *rc == DS_OK; k++) {
            char where[96];
            snprintf(where, sizeof where, "messages[%d].tool_calls[%zu]", i, k);
            *rc = k3_call(r, json_array_get(tc, k), k + 1, where, err);
        }
        k3_close(r, "tools");
    }
}

/* encode_k3's normalize_xtml_tool_result_messages: a run of consecutive tool messages whose
 * tool_call_ids all match the latest assistant's tool_calls is put in call order and takes the
 * matched call's function name. order: [n] message indices in render order; tool_name: [n]
 * resolved name per message index or NULL; pos_all: [n] scratch. */
static void k3_order_tool_results(json_t *msgs, size_t *order, const char **tool_name,
                                  size_t *pos_all) {
    size_t n = json_array_size(msgs);
    json_t *calls = NULL; /* tool_calls of the latest assistant message */
    for (size_t i = 0; i < n; i++) order[i] = i, tool_name[i] = NULL;
    for (size_t i = 0; i < n;) {
        json_t *m = json_array_get(msgs, i);
        if (!strcmp(ds_chat_role(m), "assistant")) {
            calls = json_object_get(m, "tool_calls");
            i++;
            continue;
        }
        if (strcmp(ds_chat_role(m), "tool")) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && !strcmp(ds_chat_role(json_array_get(msgs, j)), "tool")) j++;
        /* Position (1-based) of each message's call; 0 = unmatched. First id occurrence wins. */
        size_t *pos = pos_all + i; /* [j - i] */
        int all = 1;
        for (size_t k = i; k < j; k++) {
            json_t *tm = json_array_get(msgs, k);
            json_t *idv = json_object_get(tm, "tool_call_id");
            if (!idv) idv = json_object_get(tm, "id");
            pos[k - i] = 0;
            for (size_t c = 0; json_is_string(idv) && json_is_array(calls) &&
                               c < json_array_size(calls) && !pos[k - i];
                 c++) {
                json_t *cid = json_object_get(json_array_get(calls, c), "id");
                if (json_is_string(cid) && !strcmp(json_string_value(cid), json_string_value(idv)))
                    pos[k - i] = c + 1;
            }
            if (!pos[k - i]) all = 0;
        }
        if (all) {
            /* Stable insertion sort of this run by call position. */
            for (size_t a = i + 1; a < j; a++) {
                size_t p = pos[a - i], idx = order[a], b = a;
                for (; b > i && pos[b - 1 - i] > p; b--) {
                    pos[b - i] = pos[b - 1 - i];
                    order[b] = order[b - 1];
                }
                pos[b - i] = p;
                order[b] = idx;
            }
            for (size_t k = i; k < j; k++) {
                json_t *fn = json_object_get(json_array_get(calls, pos[k - i] - 1), "function");
                tool_name[order[k]] = json_string_value(json_object_get(fn, "name"));
            }
        }
        i = j;
    }
}

/* The JSON schema a response_format of type json_schema carries (extract_response_schema). */
static json_t *k3_response_schema(json_t *rf) {
    json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js)) return js;
    json_t *s = json_object_get(js, "schema");
    if (s) return s;
    s = json_object_get(js, "json_schema");
    return s ? s : js;
}

/* The thinking-effort system note (with thinking on and an effort given). */
static int k3_thinking_effort(render *r, const ds_chat_opts *o, ds_err *err) {
    if (!o->thinking || !o->thinking_effort) return DS_OK;
    const char *e = o->thinking_effort;
    if (strcmp(e, "low") && strcmp(e, "medium") && strcmp(e, "high") && strcmp(e, "max"))
        return ds_errf(err, "thinking_effort \"%s\": expected low, medium, high or max", e);
    char body[512];
    snprintf(body, sizeof body,
             "`thinking_effort` guides on how much to think in your thinking channel (not "
             "including the response channel), supported values include `low`, `medium`, "
             "`high`, and `max`.\nNow the system is invoked with `thinking_effort=%s`.",
             e);
    k3_system_note(r, "thinking-effort", body);
    return DS_OK;
}

/* messages[i], a tool result, the tool_index-th since the latest assistant's tool_calls (calls).
 * Its tool's name: the matched call's (tname), else its "tool" or "name", else that of
 * calls[tool_index - 1]. */
static int k3_tool_result(render *r, json_t *m, size_t i, const char *tname, json_t *calls,
                          size_t tool_index, ds_err *err) {
    if (!tname) {
        json_t *tv = json_object_get(m, "tool");
        if (!tv) tv = json_object_get(m, "name");
        tname = json_string_value(tv);
    }
    if (!tname && json_is_array(calls) && tool_index <= json_array_size(calls)) {
        json_t *fn = json_object_get(json_array_get(calls, tool_index - 1), "function");
        tname = json_string_value(json_object_get(fn, "name"));
    }
    if (!tname)
        return ds_errf(err,
                       "messages[%zu]: a tool result needs a tool name: set \"name\", or "
                       "a \"tool_call_id\" matching the preceding assistant's tool_calls",
                       i);
    char ib[32];
    snprintf(ib, sizeof ib, "%zu", tool_index);
    attr a[3] = {{"role", "tool", 0}, {"tool", tname, 0}, {"index", ib, 0}};
    k3_open(r, "message", a, 3);
    k3_content(r, m);
    k3_end_message(r);
    return DS_OK;
}

/* The messages in render order: order[n] message indices, resolved[n] tool names
 * (k3_order_tool_results). */
static int k3_messages(render *r, json_t *msgs, const size_t *order, const char **resolved,
                       const ds_chat_opts *o, ds_err *err) {
    size_t n = json_array_size(msgs);
    int rc = DS_OK;
    json_t *calls = NULL; /* latest assistant tool_calls */
    size_t tool_index = 0;
    for (size_t k = 0; k < n && rc == DS_OK; k++) {
        size_t i = order[k];
        json_t *m = json_array_get(msgs, i);
        const char *role = ds_chat_role(m), *name = ds_chat_truthy(m, "name");
        if (!strcmp(role, "user") || !strcmp(role, "system")) {
            json_t *st = json_object_get(m, "tools");
            if (!strcmp(role, "system") && json_is_array(st) && json_array_size(st)) {
                k3_tool_declare(r, st, 1);
                continue;
            }
            attr a[2] = {{"role", role, 0}, {"name", name, 0}};
            k3_open(r, "message", a, name ? 2 : 1);
            k3_content(r, m);
            k3_end_message(r);
        } else if (!strcmp(role, "tool")) {
            tool_index++;
            rc = k3_tool_result(r, m, i, resolved[i], calls, tool_index, err);
        } else { /* assistant */
            calls = json_object_get(m, "tool_calls");
            tool_index = 0;
            attr a[2] = {{"role", "assistant", 0}, {"name", name, 0}};
            k3_open(r, "message", a, name ? 2 : 1);
            k3_assistant(r, m, o->thinking, &rc, (int)i, err);
            k3_end_message(r);
        }
    }
    return rc;
}

/* The tool_choice system note ("required" or "none"; auto says nothing). */
static void k3_tool_choice(render *r, const ds_chat_opts *o) {
    if (o->tool_choice && !strcmp(o->tool_choice, "required"))
        k3_system_note(r, "tool-choice",
                       "The system is invoked with `tool_choice=required`.\nYou MUST call tools "
                       "in the next message.");
    else if (o->tool_choice && !strcmp(o->tool_choice, "none"))
        k3_system_note(r, "tool-choice",
                       "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any "
                       "tools in the next message.");
}

/* The response_format system message: json_object asks for raw JSON, json_schema also gives the
 * schema; other types say nothing. */
static int k3_response_format(render *r, const char *rf_json, ds_err *err) {
    json_error_t je;
    json_t *rf = json_loads(rf_json, JSON_DECODE_ANY, &je);
    if (!rf)
        return ds_errf(err, "response_format: invalid JSON at line %d column %d: %s", je.line,
                       je.column, je.text);
    json_t *ty = json_is_object(rf) ? json_object_get(rf, "type") : rf;
    const char *t = json_string_value(ty);
    static const char k_raw[] = "The system is invoked with `response_format=%s`.\nYour "
                                "response must be raw JSON data without markdown code blocks "
                                "(```json) or any additional formatting.";
    char head[512];
    if (t && !strcmp(t, "json_object")) {
        snprintf(head, sizeof head, k_raw, "json_object");
        k3_system_note(r, "response-format", head);
    } else if (t && !strcmp(t, "json_schema")) {
        json_t *schema = json_is_object(rf) ? k3_response_schema(rf) : NULL;
        attr a[2] = {{"role", "system", 0}, {"type", "response-format", 0}};
        k3_open(r, "message", a, 2);
        size_t start = r->len;
        snprintf(head, sizeof head, k_raw, "json_schema");
        ds_chat_puts(r, head);
        ds_chat_puts(r, "\nThe JSON data must match the following schema:\n```json\n");
        if (schema)
            ds_chat_py_dumps(r, schema, 1, 1);
        else
            ds_chat_puts(r, "null");
        ds_chat_puts(r, "\n```");
        ds_chat_seg_close(r, start, SEG_TEXT);
        k3_end_message(r);
    }
    json_decref(rf);
    return DS_OK;
}

int ds_chat_render_k3(render *r, json_t *msgs, json_t *tools, const ds_chat_opts *o, ds_err *err) {
    size_t n = json_array_size(msgs);
    if (json_is_array(tools) && json_array_size(tools)) k3_tool_declare(r, tools, 0);
    if (k3_thinking_effort(r, o, err)) return DS_ERR;
    size_t *order = malloc((n ? n : 1) * sizeof *order);            /* [n] render order */
    const char **resolved = malloc((n ? n : 1) * sizeof *resolved); /* [n] matched tool names */
    size_t *scratch = malloc((n ? n : 1) * sizeof *scratch);        /* [n] */
    if (!order || !resolved || !scratch) {
        free(order);
        free(resolved);
        free(scratch);
        return ds_errf(err, "chat: out of memory");
    }
    k3_order_tool_results(msgs, order, resolved, scratch);
    free(scratch);
    int rc = k3_messages(r, msgs, order, resolved, o, err);
    free(order);
    free(resolved);
    if (rc != DS_OK) return rc;
    k3_tool_choice(r, o);
    if (o->response_format_json && k3_response_format(r, o->response_format_json, err))
        return DS_ERR;
    if (o->add_generation_prompt) {
        attr a[1] = {{"role", "assistant", 0}};
        k3_open(r, "message", a, 1);
        k3_open(r, o->thinking ? "think" : "response", NULL, 0);
    }
    return DS_OK;
}
