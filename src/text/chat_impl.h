/* chat_impl.h — what chat.c shares with the two renderers (chat_kimi_linear.c, chat_k3.c): the
 * segment buffer a prompt is rendered into, Python-compatible json.dumps, and the message
 * accessors. Internal to text/. */
#ifndef DS_CHAT_IMPL_H
#define DS_CHAT_IMPL_H

#include <jansson.h>

#include "text/chat.h"

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

/* Appends bytes to the text (no segment); on allocation failure r->oom is set and writes stop. */
void ds_chat_put(render *r, const char *s, size_t n);
void ds_chat_puts(render *r, const char *s);
/* Makes the bytes written since `start` one segment; empty text adds nothing. */
void ds_chat_seg_close(render *r, size_t start, seg_kind kind);
void ds_chat_text(render *r, const char *s);            /* one SEG_TEXT segment */
void ds_chat_textn(render *r, const char *s, size_t n); /* one SEG_TEXT segment */
void ds_chat_marker(render *r, const char *name);       /* one SEG_MARKER segment */
/* json.dumps(v, ensure_ascii=False, separators=compact ? (",", ":") : (", ", ": "),
 * sort_keys=sort), sort applied at every depth. */
void ds_chat_py_dumps(render *r, json_t *v, int compact, int sort);

const char *ds_chat_type_name(json_t *v);               /* "an object", "a number", ... */
const char *ds_chat_role(json_t *m);                    /* a checked message's role */
const char *ds_chat_truthy(json_t *m, const char *key); /* a non-empty string field, or NULL */

/* The two formats: msgs and tools already checked (tools may be NULL or JSON null). */
int ds_chat_render_kimi_linear(render *r, json_t *msgs, json_t *tools, const ds_chat_opts *o,
                               ds_err *err);
int ds_chat_render_k3(render *r, json_t *msgs, json_t *tools, const ds_chat_opts *o, ds_err *err);

#endif
