/* chat.c — chat templates of the kimi_linear family (MODEL_SPEC §9.4 Kimi-Linear, §9.5 K3).
 *
 * Both formats render into a list of segments over one text buffer: K3 needs the segments because
 * its reference (encoding_k3.py) tokenizes each segment separately — markers as special ids, every
 * other piece (tag name, " key", "=\"", value, "\"", content) as ordinary text on its own, which
 * changes BPE at the seams. Kimi-Linear's Jinja output is one string encoded with specials allowed.
 * JSON that lands in the prompt is printed the way Python's json.dumps prints it (ensure_ascii off,
 * float repr, chosen separators), since that is what the references feed the model. */
#include "text/chat.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char k_default_system[] = "You are a helpful assistant provided by Moonshot-AI.";

void ds_chat_opts_default(ds_chat_opts *o) {
    memset(o, 0, sizeof *o);
    o->add_generation_prompt = 1;
    o->thinking = 1;
}

/* ------------------------------------------------------------------------------------------------
 * Segments over one growing text buffer */

typedef enum { SEG_TEXT, SEG_MARKER, SEG_TEXT_SPECIALS } seg_kind;

typedef struct {
    size_t off, len; /* bytes text[off .. off+len) */
    seg_kind kind;   /* SEG_TEXT: specials not allowed; SEG_MARKER: one special id by name */
} seg;

typedef struct {
    char *text; /* [cap] the rendered prompt, markers by name; NUL-terminated */
    size_t len, cap;
    seg *segs; /* [scap] */
    int n, scap;
    int oom;
} render;

static void put(render *r, const char *s, size_t n) {
    if (r->oom) return;
    if (r->len + n + 1 > r->cap) {
        size_t cap = DS_MAX(2 * r->cap, r->len + n + 1);
        cap = DS_MAX(cap, 256);
        char *p = realloc(r->text, cap);
        if (!p) {
            r->oom = 1;
            return;
        }
        r->text = p;
        r->cap = cap;
    }
    memcpy(r->text + r->len, s, n);
    r->len += n;
    r->text[r->len] = 0;
}

static void puts_(render *r, const char *s) {
    put(r, s, strlen(s));
}

/* Makes the bytes written since `start` one segment; empty text adds nothing (as the reference's
 * _segment does). */
static void seg_close(render *r, size_t start, seg_kind kind) {
    if (r->oom || r->len == start) return;
    if (r->n == r->scap) {
        int cap = r->scap ? 2 * r->scap : 64;
        seg *p = realloc(r->segs, (size_t)cap * sizeof *p);
        if (!p) {
            r->oom = 1;
            return;
        }
        r->segs = p;
        r->scap = cap;
    }
    r->segs[r->n++] = (seg){start, r->len - start, kind};
}

static void seg_add(render *r, seg_kind kind, const char *s, size_t n) {
    size_t start = r->len;
    put(r, s, n);
    seg_close(r, start, kind);
}

static void text(render *r, const char *s) {
    seg_add(r, SEG_TEXT, s, strlen(s));
}
static void textn(render *r, const char *s, size_t n) {
    seg_add(r, SEG_TEXT, s, n);
}
static void marker(render *r, const char *name) {
    seg_add(r, SEG_MARKER, name, strlen(name));
}

/* ------------------------------------------------------------------------------------------------
 * Python-compatible json.dumps */

/* repr(float): the shortest digits that read back to x, fixed notation for exponents -4..15,
 * otherwise d.ddde+XX; integral values keep ".0". */
static void py_float(render *r, double x) {
    char buf[64], digits[32], out[64];
    if (x == 0) {
        puts_(r, signbit(x) ? "-0.0" : "0.0");
        return;
    }
    if (!isfinite(x)) { /* jansson never produces these; kept for completeness */
        puts_(r, isnan(x) ? "NaN" : x > 0 ? "Infinity" : "-Infinity");
        return;
    }
    for (int p = 1; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    /* buf = [-]d[.ddd]e[+-]XX */
    const char *s = buf;
    int neg = *s == '-', nd = 0;
    if (neg) s++;
    for (; *s && *s != 'e'; s++)
        if (*s != '.') digits[nd++] = *s;
    int e = atoi(s + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    size_t o = 0;
    if (neg) out[o++] = '-';
    if (e >= -4 && e < 16) {
        int decpt = e + 1;
        if (decpt <= 0) {
            o += (size_t)sprintf(out + o, "0.");
            for (int k = 0; k < -decpt; k++) out[o++] = '0';
            o += (size_t)sprintf(out + o, "%s", digits);
        } else if (decpt >= nd) {
            o += (size_t)sprintf(out + o, "%s", digits);
            for (int k = nd; k < decpt; k++) out[o++] = '0';
            o += (size_t)sprintf(out + o, ".0");
        } else {
            o += (size_t)sprintf(out + o, "%.*s.%s", decpt, digits, digits + decpt);
        }
    } else {
        out[o++] = digits[0];
        if (nd > 1) o += (size_t)sprintf(out + o, ".%s", digits + 1);
        o += (size_t)sprintf(out + o, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
    put(r, out, o);
}

static void py_string(render *r, const char *s, size_t n) {
    put(r, "\"", 1);
    size_t run = 0; /* bytes copied verbatim in one go */
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = NULL;
        char ubuf[8];
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c == '\b')
            esc = "\\b";
        else if (c == '\f')
            esc = "\\f";
        else if (c < 0x20)
            snprintf(ubuf, sizeof ubuf, "\\u%04x", c), esc = ubuf;
        if (!esc) continue;
        put(r, s + run, i - run);
        puts_(r, esc);
        run = i + 1;
    }
    put(r, s + run, n - run);
    put(r, "\"", 1);
}

static int cmp_keys(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* json.dumps(v, ensure_ascii=False, separators=(",", ":") if compact else (", ", ": "),
 * sort_keys=sort) — with sort applied at every depth, which is deep_sort_dict + dumps. */
static void py_dumps(render *r, json_t *v, int compact, int sort) {
    const char *item_sep = compact ? "," : ", ", *kv_sep = compact ? ":" : ": ";
    switch (json_typeof(v)) {
    case JSON_NULL:
        puts_(r, "null");
        break;
    case JSON_TRUE:
        puts_(r, "true");
        break;
    case JSON_FALSE:
        puts_(r, "false");
        break;
    case JSON_INTEGER: {
        char b[32];
        snprintf(b, sizeof b, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        puts_(r, b);
        break;
    }
    case JSON_REAL:
        py_float(r, json_real_value(v));
        break;
    case JSON_STRING:
        py_string(r, json_string_value(v), json_string_length(v));
        break;
    case JSON_ARRAY: {
        put(r, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) puts_(r, item_sep);
            py_dumps(r, json_array_get(v, i), compact, sort);
        }
        put(r, "]", 1);
        break;
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(v), k = 0;
        const char **keys = malloc((n ? n : 1) * sizeof *keys); /* [n] in print order */
        if (!keys) {
            r->oom = 1;
            return;
        }
        const char *key;
        json_t *val;
        json_object_foreach(v, key, val) keys[k++] = key;
        if (sort) qsort(keys, n, sizeof *keys, cmp_keys);
        put(r, "{", 1);
        for (k = 0; k < n; k++) {
            if (k) puts_(r, item_sep);
            py_string(r, keys[k], strlen(keys[k]));
            puts_(r, kv_sep);
            py_dumps(r, json_object_get(v, keys[k]), compact, sort);
        }
        put(r, "}", 1);
        free(keys);
        break;
    }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Message checks shared by both formats */

static const char *type_name(json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    default:
        return "null";
    }
}

/* A string field that may be absent or null; anything else is an error naming the key. */
static int opt_string(json_t *obj, const char *key, const char **out, size_t *len,
                      const char *where, ds_err *err) {
    json_t *v = json_object_get(obj, key);
    *out = NULL;
    if (len) *len = 0;
    if (!v || json_is_null(v)) return DS_OK;
    if (!json_is_string(v))
        return ds_errf(err, "%s.%s: expected a string, found %s", where, key, type_name(v));
    *out = json_string_value(v);
    if (len) *len = json_string_length(v);
    return DS_OK;
}

/* Validates messages[i] and returns its role (one of the four). */
static int check_message(json_t *m, int i, const char **role, ds_err *err) {
    char where[48];
    snprintf(where, sizeof where, "messages[%d]", i);
    if (!json_is_object(m))
        return ds_errf(err, "%s: expected an object, found %s", where, type_name(m));
    json_t *rv = json_object_get(m, "role");
    if (!rv) return ds_errf(err, "%s.role: missing", where);
    if (!json_is_string(rv))
        return ds_errf(err, "%s.role: expected a string, found %s", where, type_name(rv));
    *role = json_string_value(rv);
    if (strcmp(*role, "system") && strcmp(*role, "user") && strcmp(*role, "assistant") &&
        strcmp(*role, "tool"))
        return ds_errf(err,
                       "%s.role: unknown role \"%s\" (expected system, user, assistant or tool)",
                       where, *role);
    json_t *c = json_object_get(m, "content");
    if (c && !json_is_null(c) && !json_is_string(c)) {
        if (!json_is_array(c))
            return ds_errf(err,
                           "%s.content: expected a string, null or an array of text parts, "
                           "found %s",
                           where, type_name(c));
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *p = json_array_get(c, k);
            if (!json_is_object(p))
                return ds_errf(err, "%s.content[%zu]: expected an object, found %s", where, k,
                               type_name(p));
            json_t *ty = json_object_get(p, "type"), *tx = json_object_get(p, "text");
            if (!json_is_string(ty) || strcmp(json_string_value(ty), "text"))
                return ds_errf(err, "%s.content[%zu].type: expected \"text\", found %s%s%s", where,
                               k, json_is_string(ty) ? "\"" : "",
                               json_is_string(ty) ? json_string_value(ty) : "no string",
                               json_is_string(ty) ? "\"" : "");
            if (!json_is_string(tx))
                return ds_errf(err, "%s.content[%zu].text: expected a string, found %s", where, k,
                               tx ? type_name(tx) : "nothing");
        }
    }
    const char *s;
    if (opt_string(m, "name", &s, NULL, where, err) < 0) return DS_ERR;
    if (opt_string(m, "tool_call_id", &s, NULL, where, err) < 0) return DS_ERR;
    json_t *tc = json_object_get(m, "tool_calls");
    if (tc && !json_is_null(tc)) {
        if (!json_is_array(tc))
            return ds_errf(err, "%s.tool_calls: expected an array, found %s", where, type_name(tc));
        for (size_t k = 0; k < json_array_size(tc); k++) {
            json_t *call = json_array_get(tc, k), *fn = json_object_get(call, "function");
            char cw[96];
            snprintf(cw, sizeof cw, "%s.tool_calls[%zu]", where, k);
            if (!json_is_object(call))
                return ds_errf(err, "%s: expected an object, found %s", cw, type_name(call));
            if (!json_is_object(fn))
                return ds_errf(err, "%s.function: expected an object, found %s", cw,
                               fn ? type_name(fn) : "nothing");
            json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
            if (!json_is_string(name))
                return ds_errf(err, "%s.function.name: expected a string, found %s", cw,
                               name ? type_name(name) : "nothing");
            if (args && !json_is_null(args) && !json_is_string(args) && !json_is_object(args))
                return ds_errf(err,
                               "%s.function.arguments: expected a JSON string or an object, "
                               "found %s",
                               cw, type_name(args));
            if (opt_string(call, "id", &s, NULL, cw, err) < 0) return DS_ERR;
        }
    }
    if (opt_string(m, "reasoning_content", &s, NULL, where, err) < 0) return DS_ERR;
    return DS_OK;
}

static int parse_inputs(const char *messages_json, const char *tools_json, json_t **msgs,
                        json_t **tools, ds_err *err) {
    json_error_t je;
    *tools = NULL;
    *msgs = json_loads(messages_json ? messages_json : "", JSON_ALLOW_NUL, &je);
    if (!*msgs)
        return ds_errf(err, "messages: invalid JSON at line %d column %d: %s", je.line, je.column,
                       je.text);
    if (!json_is_array(*msgs)) {
        ds_errf(err, "messages: expected a JSON array, found %s", type_name(*msgs));
        goto fail;
    }
    for (size_t i = 0; i < json_array_size(*msgs); i++) {
        const char *role;
        if (check_message(json_array_get(*msgs, i), (int)i, &role, err) < 0) goto fail;
    }
    if (tools_json) {
        *tools = json_loads(tools_json, JSON_ALLOW_NUL | JSON_DECODE_ANY, &je);
        if (!*tools) {
            ds_errf(err, "tools: invalid JSON at line %d column %d: %s", je.line, je.column,
                    je.text);
            goto fail;
        }
        if (!json_is_array(*tools) && !json_is_null(*tools)) {
            ds_errf(err, "tools: expected a JSON array, found %s", type_name(*tools));
            goto fail;
        }
    }
    return DS_OK;
fail:
    json_decref(*msgs);
    json_decref(*tools);
    *msgs = *tools = NULL;
    return DS_ERR;
}

static const char *role_of(json_t *m) {
    return json_string_value(json_object_get(m, "role"));
}

/* A non-empty string field (Jinja/Python truthiness), else NULL. */
static const char *truthy_string(json_t *m, const char *key) {
    json_t *v = json_object_get(m, key);
    return json_is_string(v) && json_string_length(v) ? json_string_value(v) : NULL;
}

/* ------------------------------------------------------------------------------------------------
 * Kimi-Linear (K2-Instruct Jinja), MODEL_SPEC §9.4 */

static void kl_content(render *r, json_t *m) {
    json_t *c = json_object_get(m, "content");
    if (json_is_string(c))
        put(r, json_string_value(c), json_string_length(c));
    else if (json_is_array(c))
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *tx = json_object_get(json_array_get(c, k), "text");
            put(r, json_string_value(tx), json_string_length(tx));
        }
}

static int kl_content_truthy(json_t *m) {
    json_t *c = json_object_get(m, "content");
    return (json_is_string(c) && json_string_length(c)) || (json_is_array(c) && json_array_size(c));
}

typedef struct {
    const char *orig; /* tool_calls[].id as given, or NULL */
    char *ours;       /* functions.{name}:{n} */
} call_id;

static int render_kimi_linear(render *r, json_t *msgs, json_t *tools, const ds_chat_opts *o,
                              ds_err *err) {
    size_t nm = json_array_size(msgs);
    /* Tool-call ids are rendered as functions.{name}:{n}, n counting calls across the whole
     * conversation from 0 (the form K2 models emit and are trained on). A tool result whose
     * tool_call_id names an earlier call is rewritten to that call's id so the pair still
     * matches when a client used its own ids. */
    call_id *ids = NULL; /* [n_ids] */
    size_t n_ids = 0, cap_ids = 0;
    int rc = DS_OK;
    if (json_is_array(tools) && json_array_size(tools)) {
        puts_(r, "<|im_system|>tool_declare<|im_middle|>");
        py_dumps(r, tools, 1, 0);
        puts_(r, "<|im_end|>");
    }
    for (size_t i = 0; i < nm && rc == DS_OK; i++) {
        json_t *m = json_array_get(msgs, i);
        const char *role = role_of(m), *name = truthy_string(m, "name");
        if (i == 0 && strcmp(role, "system")) {
            puts_(r, "<|im_system|>system<|im_middle|>");
            puts_(r, o->default_system_prompt ? o->default_system_prompt : k_default_system);
            puts_(r, "<|im_end|>");
        }
        const char *head = !strcmp(role, "user")        ? "<|im_user|>"
                           : !strcmp(role, "assistant") ? "<|im_assistant|>"
                                                        : "<|im_system|>";
        puts_(r, head);
        puts_(r, name ? name : role);
        puts_(r, "<|im_middle|>");
        json_t *tc = json_object_get(m, "tool_calls");
        if (!strcmp(role, "assistant") && json_is_array(tc) && json_array_size(tc)) {
            if (kl_content_truthy(m)) kl_content(r, m);
            puts_(r, "<|tool_calls_section_begin|>");
            for (size_t k = 0; k < json_array_size(tc); k++) {
                json_t *call = json_array_get(tc, k), *fn = json_object_get(call, "function");
                json_t *args = json_object_get(fn, "arguments");
                const char *fname = json_string_value(json_object_get(fn, "name"));
                if (n_ids == cap_ids) {
                    cap_ids = cap_ids ? 2 * cap_ids : 16;
                    call_id *g = realloc(ids, cap_ids * sizeof *g);
                    if (!g) {
                        rc = ds_errf(err, "chat: out of memory");
                        break;
                    }
                    ids = g;
                }
                size_t idl = strlen(fname) + 32;
                ids[n_ids].orig = json_string_value(json_object_get(call, "id"));
                ids[n_ids].ours = malloc(idl);
                if (!ids[n_ids].ours) {
                    rc = ds_errf(err, "chat: out of memory");
                    break;
                }
                snprintf(ids[n_ids].ours, idl, "functions.%s:%zu", fname, n_ids);
                puts_(r, "<|tool_call_begin|>");
                puts_(r, ids[n_ids].ours);
                puts_(r, "<|tool_call_argument_begin|>");
                n_ids++;
                /* arguments: a string verbatim; an object as Jinja's tojson; absent as {}. */
                if (json_is_string(args))
                    put(r, json_string_value(args), json_string_length(args));
                else if (json_is_object(args))
                    py_dumps(r, args, 0, 0);
                else
                    puts_(r, "{}");
                puts_(r, "<|tool_call_end|>");
            }
            puts_(r, "<|tool_calls_section_end|>");
        } else if (!strcmp(role, "tool")) {
            const char *id = json_string_value(json_object_get(m, "tool_call_id"));
            for (size_t k = n_ids; id && k-- > 0;)
                if (ids[k].orig && !strcmp(ids[k].orig, id)) {
                    id = ids[k].ours;
                    break;
                }
            puts_(r, "## Return of ");
            puts_(r, id ? id : "");
            puts_(r, "\n");
            kl_content(r, m);
        } else {
            kl_content(r, m);
        }
        puts_(r, "<|im_end|>");
    }
    if (rc == DS_OK && o->add_generation_prompt) puts_(r, "<|im_assistant|>assistant<|im_middle|>");
    for (size_t k = 0; k < n_ids; k++) free(ids[k].ours);
    free(ids);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * K3 XTML, MODEL_SPEC §9.5 (encoding_k3.py) */

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
    put(r, " ", 1);
    puts_(r, key); /* argument names come from the request: any length */
    seg_close(r, start, SEG_TEXT);
    text(r, "=\"");
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
    textn(r, esc, o);
    free(esc);
    text(r, "\"");
}

typedef struct {
    const char *key, *val; /* val NUL-terminated unless vlen is given */
    size_t vlen;
} attr;

static void k3_open(render *r, const char *tag, const attr *a, int na) {
    marker(r, "<|open|>");
    text(r, tag);
    for (int k = 0; k < na; k++)
        k3_attr(r, a[k].key, a[k].val, a[k].vlen ? a[k].vlen : strlen(a[k].val));
    marker(r, "<|sep|>");
}

static void k3_close(render *r, const char *tag) {
    marker(r, "<|close|>");
    text(r, tag);
    marker(r, "<|sep|>");
}

static void k3_end_message(render *r) {
    k3_close(r, "message");
    marker(r, "<|end_of_msg|>");
}

/* Content: a string is one segment; each text part of an array is its own segment. */
static void k3_content(render *r, json_t *m) {
    json_t *c = json_object_get(m, "content");
    if (json_is_string(c))
        textn(r, json_string_value(c), json_string_length(c));
    else if (json_is_array(c))
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *tx = json_object_get(json_array_get(c, k), "text");
            textn(r, json_string_value(tx), json_string_length(tx));
        }
}

static void k3_system_note(render *r, const char *type, const char *body) {
    attr a[2] = {{"role", "system", 0}, {"type", type, 0}};
    k3_open(r, "message", a, 2);
    text(r, body); /* the reference strips the body; none of ours has outer whitespace */
    k3_end_message(r);
}

static void k3_tool_declare(render *r, json_t *tools, int dynamic) {
    attr a[2] = {{"role", "system", 0}, {"type", "tool-declare", 0}};
    k3_open(r, "message", a, 2);
    /* One segment: header, compact deep-sorted JSON, fence. */
    size_t start = r->len;
    puts_(r, dynamic ? "## New Tools Available\n"
                       "The system dynamically extends the toolset via lazy-loading.\n"
                       "You have access to all existing and extended tools.\n"
                       "Here are the specs for the extended tools.\n\n```json\n"
                     : "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
                       "```json\n");
    py_dumps(r, tools, 1, 1);
    puts_(r, "\n```");
    seg_close(r, start, SEG_TEXT);
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
                    type_name(parsed));
            json_decref(parsed);
            return DS_ERR;
        }
    }
    if (raw) {
        attr t[1] = {{"type", "object", 0}};
        k3_open(r, "json", t, 1);
        textn(r, raw, raw_len);
        k3_close(r, "json");
    } else if (parsed) {
        const char *key;
        json_t *val;
        json_object_foreach(parsed, key, val) {
            attr t[2] = {{"key", key, 0}, {"type", xtml_type(val), 0}};
            k3_open(r, "argument", t, 2);
            if (json_is_string(val))
                textn(r, json_string_value(val), json_string_length(val));
            else {
                size_t start = r->len;
                py_dumps(r, val, 0, 0); /* _xtml_value: json.dumps with default separators */
                seg_close(r, start, SEG_TEXT);
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
            textn(r, json_string_value(rv), json_string_length(rv));
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
        if (!strcmp(role_of(m), "assistant")) {
            calls = json_object_get(m, "tool_calls");
            i++;
            continue;
        }
        if (strcmp(role_of(m), "tool")) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && !strcmp(role_of(json_array_get(msgs, j)), "tool")) j++;
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

static int render_k3(render *r, json_t *msgs, json_t *tools, const ds_chat_opts *o, ds_err *err) {
    size_t n = json_array_size(msgs);
    int rc = DS_OK;
    if (json_is_array(tools) && json_array_size(tools)) k3_tool_declare(r, tools, 0);
    if (o->thinking && o->thinking_effort) {
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
    }
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
    json_t *calls = NULL; /* latest assistant tool_calls */
    size_t tool_index = 0;
    for (size_t k = 0; k < n && rc == DS_OK; k++) {
        size_t i = order[k];
        json_t *m = json_array_get(msgs, i);
        const char *role = role_of(m), *name = truthy_string(m, "name");
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
            const char *tname = resolved[i];
            if (!tname) {
                json_t *tv = json_object_get(m, "tool");
                if (!tv) tv = json_object_get(m, "name");
                tname = json_string_value(tv);
            }
            if (!tname && json_is_array(calls) && tool_index <= json_array_size(calls)) {
                json_t *fn = json_object_get(json_array_get(calls, tool_index - 1), "function");
                tname = json_string_value(json_object_get(fn, "name"));
            }
            if (!tname) {
                rc = ds_errf(err,
                             "messages[%zu]: a tool result needs a tool name: set \"name\", or "
                             "a \"tool_call_id\" matching the preceding assistant's tool_calls",
                             i);
                break;
            }
            char ib[32];
            snprintf(ib, sizeof ib, "%zu", tool_index);
            attr a[3] = {{"role", "tool", 0}, {"tool", tname, 0}, {"index", ib, 0}};
            k3_open(r, "message", a, 3);
            k3_content(r, m);
            k3_end_message(r);
        } else { /* assistant */
            calls = json_object_get(m, "tool_calls");
            tool_index = 0;
            attr a[2] = {{"role", "assistant", 0}, {"name", name, 0}};
            k3_open(r, "message", a, name ? 2 : 1);
            k3_assistant(r, m, o->thinking, &rc, (int)i, err);
            k3_end_message(r);
        }
    }
    free(order);
    free(resolved);
    if (rc != DS_OK) return rc;
    if (o->tool_choice && !strcmp(o->tool_choice, "required"))
        k3_system_note(r, "tool-choice",
                       "The system is invoked with `tool_choice=required`.\nYou MUST call tools "
                       "in the next message.");
    else if (o->tool_choice && !strcmp(o->tool_choice, "none"))
        k3_system_note(r, "tool-choice",
                       "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any "
                       "tools in the next message.");
    if (o->response_format_json) {
        json_error_t je;
        json_t *rf = json_loads(o->response_format_json, JSON_DECODE_ANY, &je);
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
            puts_(r, head);
            puts_(r, "\nThe JSON data must match the following schema:\n```json\n");
            if (schema)
                py_dumps(r, schema, 1, 1);
            else
                puts_(r, "null");
            puts_(r, "\n```");
            seg_close(r, start, SEG_TEXT);
            k3_end_message(r);
        }
        json_decref(rf);
    }
    if (o->add_generation_prompt) {
        attr a[1] = {{"role", "assistant", 0}};
        k3_open(r, "message", a, 1);
        k3_open(r, o->thinking ? "think" : "response", NULL, 0);
    }
    return DS_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Entry points */

static int render_prompt(ds_chat_format fmt, const char *messages_json, const char *tools_json,
                         const ds_chat_opts *opts, render *r, ds_err *err) {
    ds_chat_opts def;
    if (!opts) {
        ds_chat_opts_default(&def);
        opts = &def;
    }
    if (fmt != DS_CHAT_KIMI_LINEAR && fmt != DS_CHAT_K3)
        return ds_errf(err, "chat: unknown chat format %d", (int)fmt);
    json_t *msgs, *tools;
    if (parse_inputs(messages_json, tools_json, &msgs, &tools, err) < 0) return DS_ERR;
    memset(r, 0, sizeof *r);
    int rc = fmt == DS_CHAT_K3 ? render_k3(r, msgs, tools, opts, err)
                               : render_kimi_linear(r, msgs, tools, opts, err);
    if (rc == DS_OK && fmt == DS_CHAT_KIMI_LINEAR && !r->oom) {
        /* The whole Jinja output is one segment encoded with specials allowed. */
        free(r->segs);
        r->segs = NULL;
        r->n = 0;
        if (r->len) {
            r->segs = malloc(sizeof *r->segs);
            if (!r->segs)
                r->oom = 1;
            else
                r->segs[0] = (seg){0, r->len, SEG_TEXT_SPECIALS}, r->n = 1, r->scap = 1;
        }
    }
    if (rc == DS_OK && r->oom) rc = ds_errf(err, "chat: out of memory");
    if (rc == DS_OK && !r->text) {
        r->text = calloc(1, 1);
        if (!r->text) rc = ds_errf(err, "chat: out of memory");
    }
    json_decref(msgs);
    json_decref(tools);
    if (rc != DS_OK) {
        free(r->text);
        free(r->segs);
        memset(r, 0, sizeof *r);
    }
    return rc;
}

int ds_chat_render_text(const ds_tokenizer *t, ds_chat_format fmt, const char *messages_json,
                        const char *tools_json, const ds_chat_opts *opts, char **text_out,
                        ds_err *err) {
    (void)t;
    render r;
    *text_out = NULL;
    if (render_prompt(fmt, messages_json, tools_json, opts, &r, err) < 0) return DS_ERR;
    free(r.segs);
    *text_out = r.text;
    return DS_OK;
}

int ds_chat_render(const ds_tokenizer *t, ds_chat_format fmt, const char *messages_json,
                   const char *tools_json, const ds_chat_opts *opts, int32_t **ids, int *n,
                   ds_err *err) {
    render r;
    *ids = NULL;
    *n = 0;
    if (render_prompt(fmt, messages_json, tools_json, opts, &r, err) < 0) return DS_ERR;
    int32_t *out = NULL; /* [cap] */
    int cnt = 0, cap = 0, rc = DS_OK;
    for (int s = 0; s < r.n && rc == DS_OK; s++) {
        seg *g = &r.segs[s];
        int32_t *part = NULL, single;
        int np = 0;
        if (g->kind == SEG_MARKER) {
            char name[64];
            snprintf(name, sizeof name, "%.*s", (int)g->len, r.text + g->off);
            single = ds_tok_special_id(t, name);
            if (single < 0) {
                rc = ds_errf(err,
                             "chat: the tokenizer has no special token %s (needed by the %s "
                             "chat format)",
                             name, fmt == DS_CHAT_K3 ? "K3" : "Kimi-Linear");
                break;
            }
            part = &single;
            np = 1;
        } else if (ds_tok_encode(t, r.text + g->off, g->len, g->kind == SEG_TEXT_SPECIALS, &part,
                                 &np, err) < 0) {
            rc = ds_err_prefix(err, "chat");
            break;
        }
        if (cnt + np > cap) {
            cap = DS_MAX(2 * cap, cnt + np + 256);
            int32_t *g2 = realloc(out, (size_t)cap * sizeof *g2);
            if (!g2)
                rc = ds_errf(err, "chat: out of memory");
            else
                out = g2;
        }
        if (rc == DS_OK) memcpy(out + cnt, part, (size_t)np * sizeof *part);
        cnt += np;
        if (part != &single) free(part);
    }
    free(r.text);
    free(r.segs);
    if (rc != DS_OK) {
        free(out);
        return DS_ERR;
    }
    *ids = out ? out : malloc(sizeof(int32_t));
    if (!*ids) return ds_errf(err, "chat: out of memory");
    *n = cnt;
    return DS_OK;
}

int32_t ds_chat_stop_id(const ds_tokenizer *t, ds_chat_format fmt) {
    return ds_tok_special_id(t, fmt == DS_CHAT_K3 ? "<|end_of_msg|>" : "<|im_end|>");
}

/* Reads one string key of DIR/FILE: 1 found, 0 absent (file or key), DS_ERR on bad JSON. */
static int read_key(const char *dir, const char *file, const char *key, char *out, size_t cap,
                    ds_err *err) {
    size_t dl = strlen(dir) + strlen(file) + 2;
    char *path = malloc(dl);
    if (!path) return ds_errf(err, "out of memory");
    snprintf(path, dl, "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    if (!f) {
        free(path);
        return 0;
    }
    fclose(f);
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    int rc = 0;
    if (!root)
        rc = ds_errf(err, "%s:%d: invalid JSON: %s", path, je.line, je.text);
    else {
        json_t *v = json_object_get(root, key);
        if (v && !json_is_string(v))
            rc = ds_errf(err, "%s: %s: expected a string, found %s", path, key, type_name(v));
        else if (v) {
            snprintf(out, cap, "%s", json_string_value(v));
            rc = 1;
        }
    }
    json_decref(root);
    free(path);
    return rc;
}

int ds_chat_format_from_dir(const char *dir, ds_chat_format *out, ds_err *err) {
    char v[64];
    int rc = read_key(dir, "tokenizer_config.json", "chat_format", v, sizeof v, err);
    if (rc < 0) return DS_ERR;
    if (rc == 1) {
        if (!strcmp(v, "k3"))
            *out = DS_CHAT_K3;
        else if (!strcmp(v, "kimi_linear"))
            *out = DS_CHAT_KIMI_LINEAR;
        else
            return ds_errf(err,
                           "%s/tokenizer_config.json: chat_format \"%s\": expected "
                           "\"kimi_linear\" or \"k3\"",
                           dir, v);
        return DS_OK;
    }
    rc = read_key(dir, "config.json", "model_type", v, sizeof v, err);
    if (rc < 0) return DS_ERR;
    if (rc == 0)
        return ds_errf(err,
                       "%s: cannot tell the chat format: no chat_format in "
                       "tokenizer_config.json and no model_type in config.json",
                       dir);
    if (!strcmp(v, "kimi_k3"))
        *out = DS_CHAT_K3;
    else if (!strcmp(v, "kimi_linear"))
        *out = DS_CHAT_KIMI_LINEAR;
    else
        return ds_errf(err,
                       "%s/config.json: model_type \"%s\": expected \"kimi_linear\" or "
                       "\"kimi_k3\"",
                       dir, v);
    return DS_OK;
}
