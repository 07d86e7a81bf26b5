/* chat_kimi_linear.c — the Kimi-Linear chat format (the K2-Instruct Jinja template), rendered to
 * one string that is encoded with special strings allowed; see chat.h. */
#include "text/chat_impl.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char k_default_system[] = "You are a helpful assistant provided by Moonshot-AI.";

/* ------------------------------------------------------------------------------------------------
 * Kimi-Linear (K2-Instruct Jinja), docs/model.md §9.4 */

static void kl_content(render *r, json_t *m) {
    json_t *c = json_object_get(m, "content");
    if (json_is_string(c))
        ds_chat_put(r, json_string_value(c), json_string_length(c));
    else if (json_is_array(c))
        for (size_t k = 0; k < json_array_size(c); k++) {
            json_t *tx = json_object_get(json_array_get(c, k), "text");
            ds_chat_put(r, json_string_value(tx), json_string_length(tx));
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

int ds_chat_render_kimi_linear(render *r, json_t *msgs, json_t *tools, const ds_chat_opts *o,
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
        ds_chat_puts(r, "<|im_system|>tool_declare<|im_middle|>");
        ds_chat_py_dumps(r, tools, 1, 0);
        ds_chat_puts(r, "<|im_end|>");
    }
    for (size_t i = 0; i < nm && rc == DS_OK; i++) {
        json_t *m = json_array_get(msgs, i);
        const char *role = ds_chat_role(m), *name = ds_chat_truthy(m, "name");
        if (i == 0 && strcmp(role, "system")) {
            ds_chat_puts(r, "<|im_system|>system<|im_middle|>");
            ds_chat_puts(r, o->default_system_prompt ? o->default_system_prompt : k_default_system);
            ds_chat_puts(r, "<|im_end|>");
        }
        const char *head = !strcmp(role, "user")        ? "<|im_user|>"
                           : !strcmp(role, "assistant") ? "<|im_assistant|>"
                                                        : "<|im_system|>";
        ds_chat_puts(r, head);
        ds_chat_puts(r, name ? name : role);
        ds_chat_puts(r, "<|im_middle|>");
        json_t *tc = json_object_get(m, "tool_calls");
        if (!strcmp(role, "assistant") && json_is_array(tc) && json_array_size(tc)) {
            if (kl_content_truthy(m)) kl_content(r, m);
            ds_chat_puts(r, "<|tool_calls_section_begin|>");
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
                ds_chat_puts(r, "<|tool_call_begin|>");
                ds_chat_puts(r, ids[n_ids].ours);
                ds_chat_puts(r, "<|tool_call_argument_begin|>");
                n_ids++;
                /* arguments: a string verbatim; an object as Jinja's tojson; absent as {}. */
                if (json_is_string(args))
                    ds_chat_put(r, json_string_value(args), json_string_length(args));
                else if (json_is_object(args))
                    ds_chat_py_dumps(r, args, 0, 0);
                else
                    ds_chat_puts(r, "{}");
                ds_chat_puts(r, "<|tool_call_end|>");
            }
            ds_chat_puts(r, "<|tool_calls_section_end|>");
        } else if (!strcmp(role, "tool")) {
            const char *id = json_string_value(json_object_get(m, "tool_call_id"));
            for (size_t k = n_ids; id && k-- > 0;)
                if (ids[k].orig && !strcmp(ids[k].orig, id)) {
                    id = ids[k].ours;
                    break;
                }
            ds_chat_puts(r, "## Return of ");
            ds_chat_puts(r, id ? id : "");
            ds_chat_puts(r, "\n");
            kl_content(r, m);
        } else {
            kl_content(r, m);
        }
        ds_chat_puts(r, "<|im_end|>");
    }
    if (rc == DS_OK && o->add_generation_prompt)
        ds_chat_puts(r, "<|im_assistant|>assistant<|im_middle|>");
    for (size_t k = 0; k < n_ids; k++) free(ids[k].ours);
    free(ids);
    return rc;
}
