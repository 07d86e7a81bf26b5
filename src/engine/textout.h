/* textout.h — one choice's token bytes in, text deltas out, as an OpenAI stream wants them.
 *
 * Every delta is valid UTF-8: a multi-byte character split across tokens is held until its last
 * byte arrives, and bytes that cannot be UTF-8 become U+FFFD (one per maximal invalid subpart, as
 * Python's errors="replace" does). No delta ever holds a stop string or text that may still turn
 * into one: a tail of the text that is the start of a stop string waits until it either completes
 * (then it and everything after it are dropped and the choice is "stopped") or stops matching
 * (then it is released). Stop strings are matched on the decoded text across token boundaries,
 * with a KMP automaton per stop string, so the cost is linear in the bytes pushed. When several
 * could match, the one that completes first wins (at equal ends, the longer one), which does not
 * depend on how the text was cut into tokens. */
#ifndef DS_TEXTOUT_H
#define DS_TEXTOUT_H

#include "base/ds_base.h"

typedef struct ds_textout_stop {
    char *s;      /* [len] the stop string, as valid UTF-8 */
    size_t len;   /* > 0 */
    size_t *fail; /* [len] KMP: fail[i] = longest proper border of s[0..i] */
    size_t state; /* bytes of s matched by the end of the text so far */
} ds_textout_stop;

typedef struct ds_textout {
    ds_textout_stop *stops; /* [n_stops], empty strings left out */
    int n_stops;
    char *buf; /* [cap]: buf[0..emitted) the last delta, buf[emitted..len) held text */
    size_t len, cap, emitted;
    unsigned char part[4]; /* an incomplete UTF-8 sequence: part[0..have) of `need` bytes */
    int have, need;
    int stopped; /* a stop string completed: nothing more comes out */
} ds_textout;

/* stops[n_stops]: the request's stop strings (copied; empty ones ignored; invalid UTF-8 in them
 * is replaced the way the text's is, so they still match what the text shows). */
int ds_textout_init(ds_textout *t, char *const *stops, int n_stops, ds_err *err);

/* Feeds n bytes of one token (ds_tok_token_bytes; the caller leaves out special tokens when
 * skip_special_tokens). *delta / *delta_len: the text that became final (may be empty), valid
 * until the next call on t. *stopped = 1 once a stop string has completed; the delta then ends
 * just before it, and later pushes yield nothing. DS_ERR only when memory runs out: those bytes
 * are then lost and the delta is empty. */
int ds_textout_push(ds_textout *t, const char *bytes, size_t n, const char **delta,
                    size_t *delta_len, int *stopped);

/* At finish (length, eos, stop token, abort): releases what was held, an incomplete character as
 * U+FFFD. Returns 1 if that U+FFFD completed a stop string (the delta then ends before it). */
int ds_textout_flush(ds_textout *t, const char **delta, size_t *delta_len);

void ds_textout_free(ds_textout *t);

#endif
