/* chat.h — OpenAI-style messages -> prompt token ids, in the two chat formats of the family.
 *
 * DS_CHAT_KIMI_LINEAR (docs/model.md §9.4): the K2-Instruct Jinja template, rendered to one string
 * and encoded with special strings allowed (so marker strings typed by a user become markers).
 * DS_CHAT_K3 (§9.5): the "XTML" of encoding_k3.py; markers <|open|> <|sep|> <|close|>
 * <|end_of_msg|> are emitted as ids and every other segment (tag names, attributes, content) is
 * encoded on its own with specials NOT allowed, exactly segment by segment as the reference does.
 *
 * messages_json: a JSON array of {role: system|user|assistant|tool, content: string | null |
 * [{type: "text", text}], name?, tool_calls?: [{id, type: "function", function: {name,
 * arguments: JSON string}}], tool_call_id?, reasoning_content? (K3)}. tools_json: a JSON array of
 * OpenAI tool objects, or NULL. Errors name the message index and key. */
#ifndef DS_CHAT_H
#define DS_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"
#include "text/tokenizer.h"

typedef struct ds_chat_opts {
    int add_generation_prompt; /* default 1 */
    int thinking;              /* K3: think channel on (default 1); ignored by Kimi-Linear */
    const char *default_system_prompt; /* Kimi-Linear, when messages[0] is not system; NULL =
                                          "You are a helpful assistant provided by Moonshot-AI." */
    const char *thinking_effort;       /* K3 + thinking: low|medium|high|max, or NULL */
    const char *tool_choice;           /* K3: "required" / "none" add a system note; NULL = auto */
    const char *response_format_json;  /* K3: OpenAI response_format object as JSON, or NULL */
} ds_chat_opts;

/* The defaults above. Passing opts = NULL to the functions below means the same. */
void ds_chat_opts_default(ds_chat_opts *o);

/* Renders and tokenizes. *ids: [*n], malloc'd, caller frees. */
int ds_chat_render(const ds_tokenizer *t, ds_chat_format fmt, const char *messages_json,
                   const char *tools_json, const ds_chat_opts *opts, int32_t **ids, int *n,
                   ds_err *err);

/* The same prompt as text, markers written by name (debugging and tests). t may be NULL.
 * *text: malloc'd, NUL-terminated. */
int ds_chat_render_text(const ds_tokenizer *t, ds_chat_format fmt, const char *messages_json,
                        const char *tools_json, const ds_chat_opts *opts, char **text, ds_err *err);

/* The chat format of a model folder: tokenizer_config.json "chat_format" ("kimi_linear" | "k3")
 * if present, else config.json "model_type" (kimi_k3 -> K3, kimi_linear -> Kimi-Linear). */
int ds_chat_format_from_dir(const char *dir, ds_chat_format *out, ds_err *err);

/* The id that ends an assistant turn in this format (163586 in the full vocabulary), or -1. */
int32_t ds_chat_stop_id(const ds_tokenizer *t, ds_chat_format fmt);

#endif
