/* chat.c — chat templates of the kimi_linear family (docs/model.md §9.4 Kimi-Linear, §9.5 K3).
 *
 * Both formats render into a list of segments over one text buffer: K3 needs the segments because
 * its reference (encoding_k3.py) tokenizes each segment separately — markers as special ids, every
 * other piece (tag name, " key", "=\"", value, "\"", content) as ordinary text on its own, which
 * changes BPE at the seams. Kimi-Linear's Jinja output is one string encoded with specials allowed.
 * JSON that lands in the prompt is printed the way Python's json.dumps prints it (ensure_ascii off,
 * float repr, chosen separators), since that is what the references feed the model. */
#include "text/chat_impl.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ds_chat_opts_default(ds_chat_opts *o) {
    memset(o, 0, sizeof *o);
    o->add_generation_prompt = 1;
    o->thinking = 1;
}

/* ------------------------------------------------------------------------------------------------
 * Segments over one growing text buffer */

void ds_chat_put(render *r, const char *s, size_t n) {
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

void ds_chat_puts(render *r, const char *s) {
    ds_chat_put(r, s, strlen(s));
}

/* Makes the bytes written since `start` one segment; empty text adds nothing (as the reference's
 * _segment does). */
void ds_chat_seg_close(render *r, size_t start, seg_kind kind) {
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
    ds_chat_put(r, s, n);
    ds_chat_seg_close(r, start, kind);
}

void ds_chat_text(render *r, const char *s) {
    seg_add(r, SEG_TEXT, s, strlen(s));
}
void ds_chat_textn(render *r, const char *s, size_t n) {
    seg_add(r, SEG_TEXT, s, n);
}
void ds_chat_marker(render *r, const char *name) {
    seg_add(r, SEG_MARKER, name, strlen(name));
}

/* ------------------------------------------------------------------------------------------------
 * Python-compatible json.dumps */

/* repr(float): the shortest digits that read back to x, fixed notation for exponents -4..15,
 * otherwise d.ddde+XX; integral values keep ".0". */
static void py_float(render *r, double x) {
    char buf[64], digits[32], out[64];
    if (x == 0) {
        ds_chat_puts(r, signbit(x) ? "-0.0" : "0.0");
        return;
    }
    if (!isfinite(x)) { /* jansson never produces these; kept for completeness */
        ds_chat_puts(r, isnan(x) ? "NaN" : x > 0 ? "Infinity" : "-Infinity");
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
    ds_chat_put(r, out, o);
}

static void py_string(render *r, const char *s, size_t n) {
    ds_chat_put(r, "\"", 1);
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
        ds_chat_put(r, s + run, i - run);
        ds_chat_puts(r, esc);
        run = i + 1;
    }
    ds_chat_put(r, s + run, n - run);
    ds_chat_put(r, "\"", 1);
}

static int cmp_keys(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* json.dumps(v, ensure_ascii=False, separators=(",", ":") if compact else (", ", ": "),
 * sort_keys=sort) — with sort applied at every depth, which is deep_sort_dict + dumps. */
void ds_chat_py_dumps(render *r, json_t *v, int compact, int sort) {
    const char *item_sep = compact ? "," : ", ", *kv_sep = compact ? ":" : ": ";
    switch (json_typeof(v)) {
    case JSON_NULL:
        ds_chat_puts(r, "null");
        break;
    case JSON_TRUE:
        ds_chat_puts(r, "true");
        break;
    case JSON_FALSE:
        ds_chat_puts(r, "false");
        break;
    case JSON_INTEGER: {
        char b[32];
        snprintf(b, sizeof b, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
        ds_chat_puts(r, b);
        break;
    }
    case JSON_REAL:
        py_float(r, json_real_value(v));
        break;
    case JSON_STRING:
        py_string(r, json_string_value(v), json_string_length(v));
        break;
    case JSON_ARRAY: {
        ds_chat_put(r, "[", 1);
        for (size_t i = 0; i < json_array_size(v); i++) {
            if (i) ds_chat_puts(r, item_sep);
            ds_chat_py_dumps(r, json_array_get(v, i), compact, sort);
        }
        ds_chat_put(r, "]", 1);
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
        ds_chat_put(r, "{", 1);
        for (k = 0; k < n; k++) {
            if (k) ds_chat_puts(r, item_sep);
            py_string(r, keys[k], strlen(keys[k]));
            ds_chat_puts(r, kv_sep);
            ds_chat_py_dumps(r, json_object_get(v, keys[k]), compact, sort);
        }
        ds_chat_put(r, "}", 1);
        free(keys);
        break;
    }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Message checks shared by both formats */

const char *ds_chat_type_name(json_t *v) {
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
        return ds_errf(err, "%s.%s: expected a string, found %s", where, key, ds_chat_type_name(v));
    *out = json_string_value(v);
    if (len) *len = json_string_length(v);
    return DS_OK;
}

/* Validates messages[i] and returns its role (one of the four). */
static int check_message(json_t *m, int i, const char **role, ds_err *err) {
    char where[48];
    snprintf(where, sizeof where, "messages[%d]", i);
    if (!json_is_object(m))
        return ds_errf(err, "%s: expected an object, found %s", where, ds_chat_type_name(m));
    json_t *rv = json_object_get(m, "role");
    if (!rv) return ds_errf(err, "%s.role: missing", where);
    if (!json_is_string(rv))
        return ds_errf(err, "%s.role: expected a string, found %s", where, ds_chat_type_name(rv));
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
                           where, ds_chat_type_name(c));
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *p = json_array_get(c, k);
            if (!json_is_object(p))
                return ds_errf(err, "%s.content[%zu]: expected an object, found %s", where, k,
                               ds_chat_type_name(p));
            json_t *ty = json_object_get(p, "type"), *tx = json_object_get(p, "text");
            if (!json_is_string(ty) || strcmp(json_string_value(ty), "text"))
                return ds_errf(err, "%s.content[%zu].type: expected \"text\", found %s%s%s", where,
                               k, json_is_string(ty) ? "\"" : "",
                               json_is_string(ty) ? json_string_value(ty) : "no string",
                               json_is_string(ty) ? "\"" : "");
            if (!json_is_string(tx))
                return ds_errf(err, "%s.content[%zu].text: expected a string, found %s", where, k,
                               tx ? ds_chat_type_name(tx) : "nothing");
        }
    }
    const char *s;
    if (opt_string(m, "name", &s, NULL, where, err) < 0) return DS_ERR;
    if (opt_string(m, "tool_call_id", &s, NULL, where, err) < 0) return DS_ERR;
    json_t *tc = json_object_get(m, "tool_calls");
    if (tc && !json_is_null(tc)) {
        if (!json_is_array(tc))
            return ds_errf(err, "%s.tool_calls: expected an array, found %s", where,
                           ds_chat_type_name(tc));
        for (size_t k = 0; k < json_array_size(tc); k++) {
            json_t *call = json_array_get(tc, k), *fn = json_object_get(call, "function");
            char cw[96];
            snprintf(cw, sizeof cw, "%s.tool_calls[%zu]", where, k);
            if (!json_is_object(call))
                return ds_errf(err, "%s: expected an object, found %s", cw,
                               ds_chat_type_name(call));
            if (!json_is_object(fn))
                return ds_errf(err, "%s.function: expected an object, found %s", cw,
                               fn ? ds_chat_type_name(fn) : "nothing");
            json_t *name = json_object_get(fn, "name"), *args = json_object_get(fn, "arguments");
            if (!json_is_string(name))
                return ds_errf(err, "%s.function.name: expected a string, found %s", cw,
                               name ? ds_chat_type_name(name) : "nothing");
            if (args && !json_is_null(args) && !json_is_string(args) && !json_is_object(args))
                return ds_errf(err,
                               "%s.function.arguments: expected a JSON string or an object, "
                               "found %s",
                               cw, ds_chat_type_name(args));
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
        ds_errf(err, "messages: expected a JSON array, found %s", ds_chat_type_name(*msgs));
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
            ds_errf(err, "tools: expected a JSON array, found %s", ds_chat_type_name(*tools));
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

const char *ds_chat_role(json_t *m) {
    return json_string_value(json_object_get(m, "role"));
}

/* A non-empty string field (Jinja/Python truthiness), else NULL. */
const char *ds_chat_truthy(json_t *m, const char *key) {
    json_t *v = json_object_get(m, key);
    return json_is_string(v) && json_string_length(v) ? json_string_value(v) : NULL;
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
    int rc = fmt == DS_CHAT_K3 ? ds_chat_render_k3(r, msgs, tools, opts, err)
                               : ds_chat_render_kimi_linear(r, msgs, tools, opts, err);
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
            rc = ds_errf(err, "%s: %s: expected a string, found %s", path, key,
                         ds_chat_type_name(v));
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
