/* grammar.h — constrained decoding: a grammar compiled for the model's vocabulary gives, before
 * each sampled token, the set of tokens that keep the output inside the grammar (a bitmask over
 * the vocabulary), and follows the tokens chosen. Structured outputs (response_format json_object
 * / json_schema) and enforced tool calls (tool_choice required / a named function) are grammars.
 *
 * The engine behind it is llguidance (github.com/guidance-ai/llguidance), loaded at run time with
 * dlopen from its PyPI wheel (the wheel's _lib.abi3.so exports llguidance's C ABI, llg_*): no
 * Debian package carries a grammar library, and the Rust crates cannot be fetched to build one
 * (docs/structured-outputs.md says more). When the library cannot be loaded the server still
 * serves everything else; a constrained request gets an error that says why.
 *
 * Grammars are llguidance Lark text (a JSON schema is `start: %json{...}`), built from the OpenAI
 * request by ds_grammar_from_* below. Compiled grammars are kept by their text in a bounded LRU
 * cache shared by every thread: a request whose grammar was seen before only clones the compiled
 * one. */
#ifndef DS_GRAMMAR_H
#define DS_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"
#include "text/tokenizer.h"

typedef struct ds_grammars ds_grammars; /* llguidance's tokenizer for one vocabulary + the cache */
typedef struct ds_matcher ds_matcher;   /* one output's position in its grammar */

/* Loads llguidance (once per process) and builds its view of t's vocabulary: ids 0..n_ranks-1 by
 * their bytes, every special id as a special token (never matched by grammar text: a grammar
 * names one as <[id]>). eos: the token the grammar's end allows (and forces once nothing else
 * can follow). cache_cap: compiled grammars kept (>= 1). The library is looked for at
 * $DS_LLGUIDANCE_LIB, else in the llguidance package of `python3` (ds_grammar_lib_path). */
int ds_grammars_new(const ds_tokenizer *t, int32_t eos, int cache_cap, ds_grammars **out,
                    ds_err *err);
void ds_grammars_free(ds_grammars *g); /* no matcher of g may remain */

/* Words (32 tokens each) of a mask: ceil(vocab / 32). */
int ds_grammars_mask_words(const ds_grammars *g);

/* Compiles the Lark text (or finds it in the cache) and gives a matcher at its start. A grammar
 * that does not compile is an error naming llguidance's reason. Thread-safe. */
int ds_matcher_new(ds_grammars *g, const char *lark, ds_matcher **out, ds_err *err);
/* Only checks that the text compiles (and caches it): a request's grammar is checked when it
 * arrives, so that a bad schema is a 400 rather than a failed generation. */
int ds_grammar_check(ds_grammars *g, const char *lark, ds_err *err);
void ds_matcher_free(ds_matcher *m); /* NULL is fine */

/* The tokens allowed next: mask[words] (ds_grammars_mask_words), bit i%32 of word i/32 set for
 * an allowed id. Only eos once the grammar is complete and nothing can follow. */
int ds_matcher_mask(ds_matcher *m, uint32_t *mask, ds_err *err);
/* Moves past the chosen token (one the mask allowed; eos once the grammar is done is a no-op). */
int ds_matcher_consume(ds_matcher *m, int32_t tok, ds_err *err);
/* Undoes the last n consumed tokens. */
int ds_matcher_rollback(ds_matcher *m, int n, ds_err *err);
/* How many of toks[n], in order, the grammar accepts from here (without moving). */
int ds_matcher_validate(ds_matcher *m, const int32_t *toks, int n, ds_err *err);
/* 1 once the grammar has ended (only eos may follow, or eos was consumed). */
int ds_matcher_done(const ds_matcher *m);

/* Upper bounds (seconds) of the compile-time histogram's buckets, ascending; +Inf implied. */
#define DS_GRAMMAR_COMPILE_BUCKETS 12
extern const double ds_grammar_compile_bounds[DS_GRAMMAR_COMPILE_BUCKETS];

/* The cache's counters since ds_grammars_new. Every miss is one compile by llguidance, which
 * either succeeds (compiles) or refuses the grammar (compile_failures: not cached, so the same
 * bad grammar compiles again next time). */
typedef struct ds_grammar_stats {
    uint64_t hits, misses, evictions; /* misses = compiles + compile_failures */
    int entries;
    uint64_t compiles, compile_failures;
    double compile_seconds; /* summed over every compile, failed ones included */
    uint64_t compile_buckets[DS_GRAMMAR_COMPILE_BUCKETS + 1]; /* [i]: compiles that took
        (bounds[i-1], bounds[i]] seconds; the last one longer than every bound */
} ds_grammar_stats;
void ds_grammars_stats(ds_grammars *g, ds_grammar_stats *s);

/* Where the library is looked for (the path, or an explanation of why none was found), for
 * messages and docs; out[n]. */
int ds_grammar_lib_path(char *out, size_t n, ds_err *err);

/* ---- grammars from an OpenAI request (pure text; grammar_build.c) ---- */

/* What the generation prompt left open, so the grammar writes what the chat format expects
 * before the constrained part. fmt: ds_chat_format; thinking: a K3 prompt that opened the
 * thought (the grammar closes it at once: the constrained answer is the whole output). */
typedef struct ds_grammar_ctx {
    const ds_tokenizer *tok;
    int fmt;
    int thinking;
    int parallel;  /* parallel_tool_calls: "required" may make several calls (else exactly one) */
    int call_base; /* K2 sections: calls in the conversation before this message (the first
                      call's id is functions.NAME:call_base) */
} ds_grammar_ctx;

/* The most calls one message may make under tool_choice "required" with parallel_tool_calls:
 * the grammar numbers its calls, so they are spelled out up to a bound. */
#define DS_GRAMMAR_MAX_CALLS 16

/* response_format (the request's JSON object): "text" gives *lark = NULL; "json_object" any
 * JSON object; "json_schema" its json_schema.schema. A malformed object or schema is an error
 * naming the field (response_format.json_schema.schema ...). *lark malloc'd. */
int ds_grammar_from_response_format(const ds_grammar_ctx *c, const char *rf_json, char **lark,
                                    ds_err *err);
/* tool_choice "required" (tool_choice_json NULL or "\"required\"") or a named function
 * ({"type":"function","function":{"name":...}}), written in the chat format's tool-call syntax
 * (K3 XTML, K2 sections), each call's arguments as JSON following its function's `parameters`
 * schema. "required": 1 to DS_GRAMMAR_MAX_CALLS calls, each of any of the tools, in one section
 * (exactly one when c->parallel is 0); named: exactly one call of that function (as vLLM).
 * tools_json: the request's tools array. */
int ds_grammar_from_tools(const ds_grammar_ctx *c, const char *tools_json,
                          const char *tool_choice_json, char **lark, ds_err *err);

#endif
