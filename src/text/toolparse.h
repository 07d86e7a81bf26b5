/* toolparse.h — splits a chat model's generated text into reasoning, answer and tool calls, fed
 * piece by piece as the detokenizer releases it, so a stream and a whole response come out of the
 * same code (feeding a text in one piece or in any cut gives the same result once reassembled).
 *
 * Formats (docs/model.md §9.4, §9.5):
 *  - tool calls, Kimi K2 / Kimi-Linear: <|tool_calls_section_begin|>, then per call
 *    <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>
 *    (whitespace between calls allowed), then <|tool_calls_section_end|>;
 *  - tool calls, K3 XTML (with `xtml`): <|open|>tools<|sep|>, per call
 *    <|open|>call tool="NAME" index="i"<|sep|>, its arguments as
 *    <|open|>argument key="K" type="T"<|sep|>VALUE<|close|>argument<|sep|> (a string raw, any
 *    other type as JSON) or one <|open|>json type="object"<|sep|>JSON<|close|>json<|sep|>, then
 *    <|close|>call<|sep|>; then <|close|>tools<|sep|>. The arguments come out as one JSON object
 *    and the id as functions.NAME:N (N counting this output's calls from 0);
 *  - reasoning: the text starts in the thought (the generation prompt opened it) and the thought
 *    ends at </think> (K2-Thinking) or <|close|>think<|sep|> (K3's XTML); a leading <think> is
 *    dropped. With `xtml`, K3's structural markers around the answer (<|open|>response<|sep|>,
 *    <|close|>response<|sep|>, <|close|>message<|sep|>, and a lone <|open|>, <|close|>, <|sep|>
 *    or <|end_of_msg|>) are dropped, as skip_special_tokens drops those special tokens.
 *
 * A call comes out whole when its <|tool_call_end|> arrives (its id, name and arguments at once),
 * so a section that turns out malformed (text between calls, an id without a name, a section or
 * call that never closes) can still come back as plain content, byte for byte: nothing the model
 * wrote is dropped except the markers of calls that parsed. Calls already out stay out.
 *
 * Pure: no globals, no threads; one parser per choice. */
#ifndef DS_TOOLPARSE_H
#define DS_TOOLPARSE_H

#include <stddef.h>

#include "base/ds_base.h"

/* One parsed tool call. Every string malloc'd and NUL-terminated. */
typedef struct ds_tp_call {
    char *id;   /* the model's id, "functions.NAME:IDX" */
    char *name; /* NAME */
    char *args; /* [args_len] the arguments as written (normally a JSON object) */
    size_t args_len;
} ds_tp_call;

/* What came out: appended to by every feed until the caller clears it (a stream clears it after
 * each chunk; a whole response keeps it to the end). */
typedef struct ds_tp_out {
    char *content; /* [content_len] answer text */
    size_t content_len, content_cap;
    char *reasoning; /* [reasoning_len] thought text */
    size_t reasoning_len, reasoning_cap;
    ds_tp_call *calls; /* [n_calls] */
    int n_calls, calls_cap;
} ds_tp_out;

typedef struct ds_tp_opts {
    int tools;     /* parse tool-call sections (else their markers are text) */
    int reasoning; /* the text starts in the thought */
    int xtml;      /* K3: drop XTML markers, end the thought at <|close|>think<|sep|> */
} ds_tp_opts;

typedef struct ds_toolparse {
    ds_tp_opts o;
    int state; /* TP_* in toolparse.c */
    char *buf; /* [len] text fed but not yet placed (a possible marker prefix, an open call) */
    size_t len, cap;
    char *raw; /* [raw_len] the open section's text since its last parsed call: content again if
                  the section turns out malformed */
    size_t raw_len, raw_cap;
    size_t id_start, args_start; /* the open call's id and arguments: offsets in raw */
    int at_start;                /* nothing placed yet (a leading <think> is dropped) */
    int n_calls;                 /* calls parsed so far */
    int sec_calls;               /* calls parsed in the open section */
    /* K3 XTML calls: the open call's name, its arguments as a JSON object so far, and the open
     * argument's key and type */
    size_t hdr_start; /* the open tag's attributes: offset in raw */
    char *xname, *xkey;
    int xstring; /* the open argument is a string (its value gets quoted) */
    char *args;  /* [args_len] "{\"k\": v, ..." being built */
    size_t args_len, args_cap;
} ds_toolparse;

void ds_tp_init(ds_toolparse *p, const ds_tp_opts *o);
/* Feeds n bytes of text; what becomes final is appended to out. DS_ERR only when memory runs out
 * (err says so). */
int ds_tp_feed(ds_toolparse *p, const char *s, size_t n, ds_tp_out *out, ds_err *err);
/* The text ended: held text goes out (an unterminated section or call as content, an unterminated
 * thought as reasoning). */
int ds_tp_finish(ds_toolparse *p, ds_tp_out *out, ds_err *err);
void ds_tp_free(ds_toolparse *p);
/* Is a special token of this name (n bytes) one of the markers the parser reads (XTML's
 * <|open|> <|close|> <|sep|> <|end_of_msg|>, the K2 tool-call section's, <think> and </think>)?
 * The others (reserved ids, media markers) stay out of the text when skip_special_tokens says
 * so. */
int ds_tp_is_marker(const char *name, size_t n);

/* Empties out (keeps its buffers); ds_tp_out_free releases them. */
void ds_tp_out_clear(ds_tp_out *out);
void ds_tp_out_free(ds_tp_out *out);

#endif
