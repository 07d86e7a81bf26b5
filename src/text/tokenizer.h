/* tokenizer.h — the tiktoken byte-level BPE tokenizer of the kimi_linear family (docs/model.md
 * §9.1–9.3).
 *
 * A tokenizer folder holds tiktoken.model (one `<base64 bytes> <rank>` line per mergeable token,
 * ranks 0..n_ranks-1) and tokenizer_config.json (`added_tokens_decoder` names the 256 special ids
 * n_ranks..n_ranks+255; unnamed ones are `<|reserved_token_{id}|>`). Encoding cuts the text the
 * way Moonshot's Python wrapper does (400,000-character chunks, runs of more than 25,000
 * whitespace / non-whitespace characters), pre-splits it with the Kimi regex (§9.2, run through
 * PCRE2), then merges each piece by lowest-rank pair. A loaded tokenizer is read-only: any number
 * of threads may encode and decode with it at once. */
#ifndef DS_TOKENIZER_H
#define DS_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "base/ds_base.h"

#define DS_TOK_N_SPECIAL 256 /* special ids follow the mergeable ranks */

typedef struct ds_tokenizer ds_tokenizer;

/* Which chat format (and special-token set) a model uses; see chat.h. */
typedef enum { DS_CHAT_KIMI_LINEAR = 0, DS_CHAT_K3 = 1 } ds_chat_format;

/* Loads DIR/tiktoken.model and DIR/tokenizer_config.json. Errors name file:line or the JSON key. */
int ds_tok_load(const char *dir, ds_tokenizer **out, ds_err *err);
void ds_tok_free(ds_tokenizer *t);

int ds_tok_n_ranks(const ds_tokenizer *t);    /* mergeable tokens (ids 0..n_ranks-1) */
int ds_tok_vocab_size(const ds_tokenizer *t); /* n_ranks + 256 */
/* Ids named by tokenizer_config.json's bos_token / eos_token, or -1 when absent. */
int32_t ds_tok_bos_id(const ds_tokenizer *t);
int32_t ds_tok_eos_id(const ds_tokenizer *t);

/* Encodes len bytes of UTF-8 text. Invalid UTF-8 is an error naming the byte offset. With
 * allow_special, every exact occurrence of a special token's string (longest match) becomes its
 * id and the text between is encoded normally; without it, such strings are ordinary text.
 * *ids: [*n], malloc'd, caller frees (also when *n == 0). */
int ds_tok_encode(const ds_tokenizer *t, const char *text, size_t len, int allow_special,
                  int32_t **ids, int *n, ds_err *err);

/* Concatenates the tokens' bytes (specials by name unless skip_special). The result may end in a
 * partial UTF-8 sequence; *out is malloc'd and NUL-terminated, *len excludes the NUL. */
int ds_tok_decode(const ds_tokenizer *t, const int32_t *ids, int n, int skip_special, char **out,
                  size_t *len, ds_err *err);

/* The bytes of one token (a special's name for special ids), not NUL-terminated; NULL if id is out
 * of range. Valid for the tokenizer's lifetime; for streaming decode. */
const char *ds_tok_token_bytes(const ds_tokenizer *t, int32_t id, size_t *len);
/* The id of the special token whose string is content, or -1. */
int32_t ds_tok_special_id(const ds_tokenizer *t, const char *content);
/* 1 if id is a special id that skip-special decoding drops (tokenizer_config `special: true`, and
 * every reserved slot), else 0. Added tokens marked `special: false` (K2 tool-call markers) give 0.
 */
int ds_tok_is_special(const ds_tokenizer *t, int32_t id);

/* ---- pre-tokenisation (exposed for the vocabulary trainer and tests) ---- */

/* The compiled §9.2 regex. Read-only once made; safe to share between threads. */
typedef struct ds_tok_splitter ds_tok_splitter;
ds_tok_splitter *ds_tok_splitter_new(ds_err *err);
void ds_tok_splitter_free(ds_tok_splitter *s);
/* The PCRE2 pattern actually compiled (for messages and tests). */
const char *ds_tok_splitter_pattern(const ds_tok_splitter *s);
/* Splits text (valid UTF-8, no Moonshot length caps applied) into regex pieces.
 * *spans: [*n][2] malloc'd byte offsets {start, end} of each piece, caller frees. */
int ds_tok_split(const ds_tok_splitter *s, const char *text, size_t len, size_t **spans, int *n,
                 ds_err *err);

/* ---- vocabulary writer for tiny test models (bpe_train.c) ---- */

/* Trains a byte-level BPE vocabulary of exactly n_ranks tokens (the 256 single bytes, then merges
 * learned by pair frequency over the pre-split pieces of a built-in English + CJK corpus;
 * deterministic) and writes DIR/tiktoken.model and DIR/tokenizer_config.json with the special
 * tokens of `family` (§9.3) at n_ranks + (official id - 163584), bos_token, eos_token and
 * chat_format. Every multi-byte token encodes to itself. n_ranks must be
 * 256..DS_TOK_MAX_WRITE_RANKS (past the merges and two-byte tokens, three-byte ones fill it). */
enum { DS_TOK_MAX_WRITE_RANKS = 1 << 22 };
int ds_tok_write_files(const char *dir, int n_ranks, ds_chat_format family, ds_err *err);

#endif
