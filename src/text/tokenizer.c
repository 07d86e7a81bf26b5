/* tokenizer.c — tiktoken byte-level BPE with the Kimi pre-tokenisation regex (docs/model.md
 * §9.1–9.3).
 *
 * Sections: UTF-8 and base64 helpers; the rank table (byte string -> rank); the special-token trie;
 * the PCRE2 splitter; loading; encoding (Moonshot caps -> specials -> regex -> BPE); decoding. */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "text/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Moonshot's wrapper (tokenization_kimi.py) feeds tiktoken at most this many code points at a time,
 * and cuts runs of more than MAX_RUN consecutive whitespace or non-whitespace code points, because
 * tiktoken's Rust core panics or goes quadratic beyond them. Both cuts change pre-tokenisation at
 * the cut, so we reproduce them exactly rather than only guarding against the cost. */
#define DS_TOK_MAX_CHUNK 400000
#define DS_TOK_MAX_RUN   25000

/* ------------------------------------------------------------------------------------------------
 * UTF-8 and base64 */

/* Returns the byte offset of the first invalid UTF-8 sequence, or len if all valid. Rejects what
 * Python's strict decoder rejects (overlongs, surrogates, > U+10FFFF, truncation), which is also at
 * least as strict as PCRE2's check, so matching can skip PCRE2's own check. */
static size_t utf8_invalid_at(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF)
            n = 2;
        else if (c == 0xE0)
            n = 3, lo = 0xA0;
        else if (c == 0xED)
            n = 3, hi = 0x9F; /* no UTF-16 surrogates */
        else if (c >= 0xE1 && c <= 0xEF)
            n = 3;
        else if (c == 0xF0)
            n = 4, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3)
            n = 4;
        else if (c == 0xF4)
            n = 4, hi = 0x8F;
        else
            return i;
        if (i + n > len) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k < n; k++)
            if ((s[i + k] & 0xC0) != 0x80) return i;
        i += n;
    }
    return len;
}

/* Decodes the code point at s (valid UTF-8 assumed) and returns its length in bytes. */
static size_t utf8_next(const unsigned char *s, uint32_t *cp) {
    unsigned c = s[0];
    if (c < 0x80) return *cp = c, 1;
    if (c < 0xE0) return *cp = ((c & 0x1Fu) << 6) | (s[1] & 0x3Fu), 2;
    if (c < 0xF0) return *cp = ((c & 0x0Fu) << 12) | ((s[1] & 0x3Fu) << 6) | (s[2] & 0x3Fu), 3;
    *cp = ((c & 0x07u) << 18) | ((s[1] & 0x3Fu) << 12) | ((s[2] & 0x3Fu) << 6) | (s[3] & 0x3Fu);
    return 4;
}

/* Python's str.isspace(): the White_Space set plus U+001C..U+001F (bidi class B/S). The 25,000-run
 * cut uses this, not the regex's \s, so it must be Python's definition. */
static int py_isspace(uint32_t c) {
    if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
    if (c < 0x85) return 0;
    return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
           c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

static int b64_value(int c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Strict standard base64 with padding. out must hold len/4*3 bytes. Returns bytes written or -1. */
static long b64_decode(const char *in, size_t len, unsigned char *out) {
    if (len == 0 || len % 4) return -1;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (in[i + k] == '=' && i + 4 == len && k >= 2) {
                v[k] = 0;
                pad++;
            } else {
                if (pad) return -1; /* data after '=' */
                v[k] = b64_value((unsigned char)in[i + k]);
                if (v[k] < 0) return -1;
            }
        }
        uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | v[3];
        out[o++] = (unsigned char)(w >> 16);
        if (pad < 2) out[o++] = (unsigned char)(w >> 8);
        if (pad < 1) out[o++] = (unsigned char)w;
        /* Non-canonical encodings (stray bits under the padding) would alias another token. */
        if ((pad == 1 && (v[2] & 3)) || (pad == 2 && (v[1] & 15))) return -1;
    }
    return (long)o;
}

/* ------------------------------------------------------------------------------------------------
 * The tokenizer */

typedef struct trie_node {
    int32_t first_child, next_sibling; /* node indices, -1 = none */
    int32_t id;                        /* special id ending here, -1 = none */
    unsigned char byte;
} trie_node;

struct ds_tok_splitter {
    pcre2_code *code;
    int jit; /* 1 if JIT-compiled */
    char *pattern;
};

struct ds_tokenizer {
    int n_ranks, vocab;
    char *blob;       /* [off[vocab]] the bytes of every token, special names included */
    uint32_t *off;    /* [vocab + 1] token id's bytes are blob[off[id] .. off[id+1]) */
    int32_t *slots;   /* [n_slots] open-addressing table of ranks keyed by their bytes; -1 empty */
    uint32_t n_slots; /* power of two, >= 2 * n_ranks */
    int32_t byte_rank[256];            /* rank of each single byte, -1 if the vocab lacks it */
    uint8_t special[DS_TOK_N_SPECIAL]; /* 1 if skipped by skip-special decoding */
    trie_node *trie;                   /* [n_trie] node 0 is the root */
    int n_trie;
    uint8_t special_first[256]; /* 1 if some special string starts with this byte */
    int32_t bos, eos;
    ds_tok_splitter *splitter;
};

static uint64_t hash_bytes(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull ^ (n * 0x9E3779B97F4A7C15ull); /* FNV-1a, length-seeded */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

/* The rank of the byte string p[0..n), or -1. */
static int32_t rank_of(const ds_tokenizer *t, const unsigned char *p, size_t n) {
    uint32_t mask = t->n_slots - 1, i = (uint32_t)hash_bytes(p, n) & mask;
    for (;;) {
        int32_t r = t->slots[i];
        if (r < 0) return -1;
        if (t->off[r + 1] - t->off[r] == n && memcmp(t->blob + t->off[r], p, n) == 0) return r;
        i = (i + 1) & mask;
    }
}

/* Inserts rank r (its bytes already in blob). Returns the rank already holding these bytes, or -1.
 */
static int32_t rank_insert(ds_tokenizer *t, int32_t r) {
    const unsigned char *p = (const unsigned char *)t->blob + t->off[r];
    size_t n = t->off[r + 1] - t->off[r];
    uint32_t mask = t->n_slots - 1, i = (uint32_t)hash_bytes(p, n) & mask;
    while (t->slots[i] >= 0) {
        int32_t q = t->slots[i];
        if (t->off[q + 1] - t->off[q] == n && memcmp(t->blob + t->off[q], p, n) == 0) return q;
        i = (i + 1) & mask;
    }
    t->slots[i] = r;
    return -1;
}

int ds_tok_n_ranks(const ds_tokenizer *t) {
    return t->n_ranks;
}
int ds_tok_vocab_size(const ds_tokenizer *t) {
    return t->vocab;
}
int32_t ds_tok_bos_id(const ds_tokenizer *t) {
    return t->bos;
}
int32_t ds_tok_eos_id(const ds_tokenizer *t) {
    return t->eos;
}

const char *ds_tok_token_bytes(const ds_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->vocab) return NULL;
    if (len) *len = t->off[id + 1] - t->off[id];
    return t->blob + t->off[id];
}

int ds_tok_is_special(const ds_tokenizer *t, int32_t id) {
    return id >= t->n_ranks && id < t->vocab && t->special[id - t->n_ranks];
}

/* ------------------------------------------------------------------------------------------------
 * Special-token trie: longest match of a special string at a position. */

static int trie_add(ds_tokenizer *t, const char *s, size_t n, int32_t id) {
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char b = (unsigned char)s[i];
        int32_t c = t->trie[node].first_child;
        while (c >= 0 && t->trie[c].byte != b) c = t->trie[c].next_sibling;
        if (c < 0) {
            c = t->n_trie++;
            t->trie[c] = (trie_node){-1, t->trie[node].first_child, -1, b};
            t->trie[node].first_child = c;
        }
        node = c;
    }
    if (t->trie[node].id >= 0) return -1; /* duplicate string */
    t->trie[node].id = id;
    return 0;
}

/* Longest special string starting at s[0..n): its id and length, or -1. */
static int32_t trie_match(const ds_tokenizer *t, const unsigned char *s, size_t n, size_t *mlen) {
    int32_t node = 0, best = -1;
    for (size_t i = 0; i < n; i++) {
        int32_t c = t->trie[node].first_child;
        while (c >= 0 && t->trie[c].byte != s[i]) c = t->trie[c].next_sibling;
        if (c < 0) break;
        node = c;
        if (t->trie[node].id >= 0) best = t->trie[node].id, *mlen = i + 1;
    }
    return best;
}

int32_t ds_tok_special_id(const ds_tokenizer *t, const char *content) {
    size_t n = strlen(content), m = 0;
    int32_t id = trie_match(t, (const unsigned char *)content, n, &m);
    return id >= 0 && m == n ? id : -1;
}

/* ------------------------------------------------------------------------------------------------
 * The splitter: docs/model.md §9.2 rewritten for PCRE2.
 *
 * - PCRE2 has no class intersection, so `[X&&[^\p{Han}]]` becomes `(?:(?!\p{Han})[X])` with the
 *   quantifier outside the group (one character per repetition, as in the original).
 * - PCRE2 >= 10.40 reads a bare `\p{Han}` as Script_Extensions, which puts U+3001 "、" (scx Bopo
 * Hang Hani Hira Kana Yiii) into Han runs; tiktoken's Rust regex means Script=Han. `\p{sc:Han}` is
 * the Script property there; older PCRE2 rejects `sc:` but reads bare `\p{Han}` as Script already.
 * - PCRE2's UCP `\s` is \p{Z} plus \h and \v, which adds U+180E (and matches the same set
 *   otherwise); Rust's `\s` is the White_Space property. WS below spells that set out. */
#define WS                                                                                         \
    "\\t\\n\\x{0B}\\f\\r "                                                                         \
    "\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"
#define CONTRACTION "(?i:'s|'t|'re|'ve|'m|'ll|'d)?"

static char *build_pattern(const char *han) {
    char upper[160], lower[160];
    snprintf(upper, sizeof upper, "(?:(?!%s)[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}])", han);
    snprintf(lower, sizeof lower, "(?:(?!%s)[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}])", han);
    size_t cap = 2048;
    char *p = malloc(cap);
    if (!p) return NULL;
    snprintf(p, cap,
             "%s+"                                       /* Han runs */
             "|[^\\r\\n\\p{L}\\p{N}]?%s*%s+" CONTRACTION /* Word, word */
             "|[^\\r\\n\\p{L}\\p{N}]?%s+%s*" CONTRACTION /* WORD */
             "|\\p{N}{1,3}"                              /* digits by threes */
             "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*"        /* punctuation */
             "|[" WS "]*[\\r\\n]+"                       /* newlines */
             "|[" WS "]+(?![^" WS "])"                   /* spaces not before text */
             "|[" WS "]+",
             han, upper, lower, upper, lower);
    return p;
}

ds_tok_splitter *ds_tok_splitter_new(ds_err *err) {
    ds_tok_splitter *s = ds_calloc(1, sizeof *s, err);
    if (!s) return NULL;
    const char *hans[2] = {"\\p{sc:Han}", "\\p{Han}"};
    for (int k = 0; k < 2 && !s->code; k++) {
        free(s->pattern);
        s->pattern = build_pattern(hans[k]);
        if (!s->pattern) break;
        int ec;
        PCRE2_SIZE eo;
        s->code = pcre2_compile((PCRE2_SPTR)s->pattern, PCRE2_ZERO_TERMINATED,
                                PCRE2_UTF | PCRE2_UCP, &ec, &eo, NULL);
        if (!s->code && k == 1) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ec, msg, sizeof msg);
            ds_errf(err, "tokenizer regex: PCRE2 compile failed at offset %zu: %s", (size_t)eo,
                    (char *)msg);
        }
    }
    if (!s->code) {
        if (!s->pattern) ds_errf(err, "tokenizer regex: out of memory");
        ds_tok_splitter_free(s);
        return NULL;
    }
    uint32_t has_jit = 0;
    pcre2_config(PCRE2_CONFIG_JIT, &has_jit);
    s->jit = has_jit && pcre2_jit_compile(s->code, PCRE2_JIT_COMPLETE) == 0;
    return s;
}

void ds_tok_splitter_free(ds_tok_splitter *s) {
    if (!s) return;
    pcre2_code_free(s->code);
    free(s->pattern);
    free(s);
}

const char *ds_tok_splitter_pattern(const ds_tok_splitter *s) {
    return s->pattern;
}

/* Finds the next piece in text[0..len) at or after *pos (text already UTF-8 checked). Returns 1 and
 * the span, 0 at the end, DS_ERR on a matcher failure. */
static int split_next(const ds_tok_splitter *s, pcre2_match_data *md, const char *text, size_t len,
                      size_t pos, size_t *start, size_t *end, ds_err *err) {
    if (pos >= len) return 0;
    int rc = pcre2_match(s->code, (PCRE2_SPTR)text, len, pos, PCRE2_NO_UTF_CHECK, md, NULL);
    /* The JIT's default 32 KiB stack runs out on very long letter runs (each repetition of the
     * lookahead group takes a frame); the interpreter keeps its frames on the heap. */
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
        rc = pcre2_match(s->code, (PCRE2_SPTR)text, len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md,
                         NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return ds_errf(err, "tokenizer regex: match failed at byte %zu: %s", pos, (char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *start = ov[0];
    *end = ov[1];
    return 1;
}

int ds_tok_split(const ds_tok_splitter *s, const char *text, size_t len, size_t **spans, int *n,
                 ds_err *err) {
    *spans = NULL;
    *n = 0;
    size_t bad = utf8_invalid_at((const unsigned char *)text, len);
    if (bad < len) return ds_errf(err, "tokenizer: invalid UTF-8 at byte offset %zu", bad);
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md) return ds_errf(err, "tokenizer: out of memory");
    size_t cap = 0, pos = 0, a, b;
    int cnt = 0, rc;
    size_t *out = NULL; /* [cap][2] */
    while ((rc = split_next(s, md, text, len, pos, &a, &b, err)) == 1) {
        if ((size_t)cnt == cap) {
            cap = cap ? cap * 2 : 64;
            size_t *grown = realloc(out, cap * 2 * sizeof *out);
            if (!grown) {
                rc = ds_errf(err, "tokenizer: out of memory");
                break;
            }
            out = grown;
        }
        out[2 * cnt] = a;
        out[2 * cnt + 1] = b;
        cnt++;
        pos = b;
    }
    pcre2_match_data_free(md);
    if (rc < 0) {
        free(out);
        return DS_ERR;
    }
    *spans = out;
    *n = cnt;
    return DS_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Loading */

void ds_tok_free(ds_tokenizer *t) {
    if (!t) return;
    free(t->blob);
    free(t->off);
    free(t->slots);
    free(t->trie);
    ds_tok_splitter_free(t->splitter);
    free(t);
}

/* Parses tiktoken.model into t->blob/off/slots (ranks only). */
static int load_ranks(ds_tokenizer *t, const char *path, ds_err *err) {
    size_t len;
    char *buf = ds_read_file(path, &len, err);
    if (!buf) return DS_ERR;
    int rc = DS_ERR;
    /* First pass: count entries so that rank bounds are known; the file maps ranks 0..n-1. */
    int n = 0;
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && buf[j] != '\n') j++;
        size_t e = j;
        if (e > i && buf[e - 1] == '\r') e--;
        if (e > i) n++;
        i = j + 1;
    }
    if (n == 0) {
        ds_errf(err, "%s: no tokens (expected lines `<base64> <rank>`)", path);
        goto out;
    }
    t->n_ranks = n;
    t->vocab = n + DS_TOK_N_SPECIAL;
    /* Token bytes are at most 3/4 of the base64 text; specials are appended later. */
    t->blob = ds_malloc(len + 1, err);
    t->off = ds_calloc((size_t)t->vocab + 1, sizeof *t->off, err);
    uint32_t *rank_start = ds_calloc((size_t)n, sizeof *rank_start, err); /* [n] byte offsets */
    uint32_t *rank_len = ds_calloc((size_t)n, sizeof *rank_len, err);     /* [n], 0 = unseen */
    int32_t *rank_line = ds_calloc((size_t)n, sizeof *rank_line, err); /* [n] line of each rank */
    unsigned char *tmp = ds_malloc(len + 1, err); /* [len] decoded bytes in file order */
    if (!t->blob || !t->off || !rank_start || !rank_len || !rank_line || !tmp) goto out2;
    size_t used = 0;
    int line = 0;
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && buf[j] != '\n') j++;
        size_t e = j;
        line++;
        if (e > i && buf[e - 1] == '\r') e--;
        if (e == i) {
            i = j + 1;
            continue;
        }
        size_t sp = i;
        while (sp < e && buf[sp] != ' ') sp++;
        if (sp == e || sp == i || sp + 1 == e) {
            ds_errf(err, "%s:%d: expected `<base64> <rank>`, found \"%.*s\"", path, line,
                    (int)DS_MIN(e - i, 60), buf + i);
            goto out2;
        }
        long nb = b64_decode(buf + i, sp - i, tmp + used);
        if (nb <= 0) {
            ds_errf(err, "%s:%d: invalid base64 token \"%.*s\"", path, line,
                    (int)DS_MIN(sp - i, 60), buf + i);
            goto out2;
        }
        long long r = 0;
        for (size_t k = sp + 1; k < e; k++) {
            if (buf[k] < '0' || buf[k] > '9' || r > (long long)n) {
                ds_errf(err, "%s:%d: rank \"%.*s\" is not a number in 0..%d", path, line,
                        (int)DS_MIN(e - sp - 1, 30), buf + sp + 1, n - 1);
                goto out2;
            }
            r = r * 10 + (buf[k] - '0');
        }
        if (r >= n) {
            ds_errf(err,
                    "%s:%d: rank %lld out of range: the file has %d tokens, so ranks must be "
                    "0..%d with no gaps",
                    path, line, r, n, n - 1);
            goto out2;
        }
        if (rank_len[r]) {
            ds_errf(err, "%s:%d: rank %lld already given on line %d", path, line, r, rank_line[r]);
            goto out2;
        }
        rank_start[r] = (uint32_t)used;
        rank_len[r] = (uint32_t)nb;
        rank_line[r] = line;
        used += (size_t)nb;
        i = j + 1;
    }
    /* Lay the tokens out in rank order so that id -> bytes is off[id]..off[id+1]. */
    size_t o = 0;
    for (int r = 0; r < n; r++) {
        t->off[r] = (uint32_t)o;
        memcpy(t->blob + o, tmp + rank_start[r], rank_len[r]);
        o += rank_len[r];
    }
    t->off[n] = (uint32_t)o;
    t->n_slots = 1024;
    while (t->n_slots < 2u * (uint32_t)n) t->n_slots *= 2;
    t->slots = ds_malloc(t->n_slots * sizeof *t->slots, err);
    if (!t->slots) goto out2;
    memset(t->slots, 0xff, t->n_slots * sizeof *t->slots);
    for (int b = 0; b < 256; b++) t->byte_rank[b] = -1;
    for (int r = 0; r < n; r++) {
        int32_t q = rank_insert(t, r);
        if (q >= 0) {
            ds_errf(err, "%s:%d: token bytes duplicate those of rank %d (line %d)", path,
                    rank_line[r], q, rank_line[q]);
            goto out2;
        }
        if (rank_len[r] == 1) t->byte_rank[(unsigned char)t->blob[t->off[r]]] = r;
    }
    rc = DS_OK;
out2:
    free(rank_start);
    free(rank_len);
    free(rank_line);
    free(tmp);
out:
    free(buf);
    return rc;
}

/* A token name in tokenizer_config.json: a string or an AddedToken object {"content": ...}. */
static const char *token_name(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

/* Reads tokenizer_config.json and lays out the 256 special names after the ranks. */
static int load_specials(ds_tokenizer *t, const char *path, ds_err *err) {
    char *names[DS_TOK_N_SPECIAL] = {0}; /* [256] names from the config, NULL = reserved */
    int rc = DS_ERR;
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    if (!root) return ds_errf(err, "%s:%d: invalid JSON: %s", path, je.line, je.text);
    if (!json_is_object(root)) {
        ds_errf(err, "%s: expected a JSON object at the top level", path);
        goto out;
    }
    for (int k = 0; k < DS_TOK_N_SPECIAL; k++) t->special[k] = 1;
    json_t *dec = json_object_get(root, "added_tokens_decoder");
    if (dec && !json_is_object(dec)) {
        ds_errf(err, "%s: added_tokens_decoder: expected an object of \"<id>\": {...}", path);
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(dec, key, val) {
        char *endp;
        errno = 0;
        long id = strtol(key, &endp, 10);
        /* digits only: strtol would also take " 3" and "+3", two spellings of one id */
        if (!*key || *endp || errno || strspn(key, "0123456789") != strlen(key)) {
            ds_errf(err, "%s: added_tokens_decoder: key \"%s\" is not a token id", path, key);
            goto out;
        }
        if (id < t->n_ranks || id >= t->vocab) {
            ds_errf(err,
                    "%s: added_tokens_decoder[\"%s\"]: id outside the special range %d..%d "
                    "(tiktoken.model has %d ranks)",
                    path, key, t->n_ranks, t->vocab - 1, t->n_ranks);
            goto out;
        }
        json_t *content = json_object_get(val, "content");
        if (!json_is_string(content) || json_string_length(content) == 0) {
            ds_errf(err, "%s: added_tokens_decoder[\"%s\"].content: expected a non-empty string",
                    path, key);
            goto out;
        }
        json_t *sp = json_object_get(val, "special");
        if (sp && !json_is_boolean(sp)) {
            ds_errf(err, "%s: added_tokens_decoder[\"%s\"].special: expected true or false", path,
                    key);
            goto out;
        }
        int k = (int)(id - t->n_ranks);
        if (names[k]) { /* "3" and "03": one id named twice */
            ds_errf(err, "%s: added_tokens_decoder: token id %ld is given twice", path, id);
            goto out;
        }
        names[k] = strdup(json_string_value(content));
        if (!names[k]) {
            ds_errf(err, "out of memory");
            goto out;
        }
        t->special[k] = sp ? json_is_true(sp) : 1; /* unmarked added tokens count as special */
    }
    /* Append the names to the blob (grown to fit) after the rank bytes. */
    size_t extra = 0;
    char reserved[64];
    for (int k = 0; k < DS_TOK_N_SPECIAL; k++)
        extra += names[k] ? strlen(names[k])
                          : (size_t)snprintf(reserved, sizeof reserved, "<|reserved_token_%d|>",
                                             t->n_ranks + k);
    char *blob = realloc(t->blob, t->off[t->n_ranks] + extra + 1);
    if (!blob) {
        ds_errf(err, "out of memory");
        goto out;
    }
    t->blob = blob;
    t->trie = ds_calloc(extra + 1, sizeof *t->trie, err);
    if (!t->trie) goto out;
    t->trie[0] = (trie_node){-1, -1, -1, 0};
    t->n_trie = 1;
    size_t o = t->off[t->n_ranks];
    for (int k = 0; k < DS_TOK_N_SPECIAL; k++) {
        int id = t->n_ranks + k;
        size_t m = names[k]
                       ? strlen(names[k])
                       : (size_t)snprintf(reserved, sizeof reserved, "<|reserved_token_%d|>", id);
        memcpy(t->blob + o, names[k] ? names[k] : reserved, m);
        if (trie_add(t, t->blob + o, m, id) < 0) {
            ds_errf(err, "%s: added_tokens_decoder[\"%d\"]: content \"%.*s\" is used twice", path,
                    id, (int)m, t->blob + o);
            goto out;
        }
        t->special_first[(unsigned char)t->blob[o]] = 1;
        o += m;
        t->off[id + 1] = (uint32_t)o;
    }
    const char *keys[2] = {"bos_token", "eos_token"};
    int32_t *dst[2] = {&t->bos, &t->eos};
    for (int k = 0; k < 2; k++) {
        json_t *v = json_object_get(root, keys[k]);
        *dst[k] = -1;
        if (!v || json_is_null(v)) continue;
        const char *name = token_name(v);
        if (!name) {
            ds_errf(err, "%s: %s: expected a string or {\"content\": ...}", path, keys[k]);
            goto out;
        }
        *dst[k] = ds_tok_special_id(t, name);
        if (*dst[k] < 0) {
            ds_errf(err, "%s: %s \"%s\" is not one of the special tokens", path, keys[k], name);
            goto out;
        }
    }
    rc = DS_OK;
out:
    for (int k = 0; k < DS_TOK_N_SPECIAL; k++) free(names[k]);
    json_decref(root);
    return rc;
}

int ds_tok_load(const char *dir, ds_tokenizer **out, ds_err *err) {
    *out = NULL;
    ds_tokenizer *t = ds_calloc(1, sizeof *t, err);
    if (!t) return DS_ERR;
    size_t dl = strlen(dir);
    char *path = ds_malloc(dl + 32, err);
    if (!path) {
        free(t);
        return DS_ERR;
    }
    snprintf(path, dl + 32, "%s/tiktoken.model", dir);
    int rc = load_ranks(t, path, err);
    if (rc == DS_OK) {
        snprintf(path, dl + 32, "%s/tokenizer_config.json", dir);
        rc = load_specials(t, path, err);
    }
    free(path);
    if (rc == DS_OK) {
        t->splitter = ds_tok_splitter_new(err);
        if (!t->splitter) rc = DS_ERR;
    }
    if (rc != DS_OK) {
        ds_tok_free(t);
        return DS_ERR;
    }
    *out = t;
    return DS_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Encoding */

typedef struct {
    int32_t *ids; /* [cap] output */
    int n, cap;
    /* BPE scratch, grown to the longest piece seen (scap bytes). A part is named by the byte offset
     * where it starts; parts form a linked list in text order. */
    int32_t *tok, *prev, *next; /* [scap] per part: its token, list links (-1 = none) */
    int32_t *prank;             /* [scap] rank of (part, its successor) as queued, -1 = none */
    uint64_t *heap;             /* [hcap] min-heap of (rank << 32 | part) */
    size_t scap, hcap, hn;
} enc_state;

static int push_id(enc_state *st, int32_t id, ds_err *err) {
    if (st->n == st->cap) {
        int cap = st->cap ? st->cap * 2 : 256;
        int32_t *g = realloc(st->ids, (size_t)cap * sizeof *g);
        if (!g) return ds_errf(err, "tokenizer: out of memory");
        st->ids = g;
        st->cap = cap;
    }
    st->ids[st->n++] = id;
    return DS_OK;
}

static void heap_push(enc_state *st, uint64_t v) {
    size_t i = st->hn++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (st->heap[p] <= v) break;
        st->heap[i] = st->heap[p];
        i = p;
    }
    st->heap[i] = v;
}

static uint64_t heap_pop(enc_state *st) {
    uint64_t top = st->heap[0], v = st->heap[--st->hn];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= st->hn) break;
        if (c + 1 < st->hn && st->heap[c + 1] < st->heap[c]) c++;
        if (v <= st->heap[c]) break;
        st->heap[i] = st->heap[c];
        i = c;
    }
    if (st->hn) st->heap[i] = v;
    return top;
}

/* Records the rank of (part i, its successor) and queues the pair if that concatenation is a
 * token. Heap order (rank, part) is "lowest rank, then leftmost": tiktoken's choice each step. */
static void queue_pair(const ds_tokenizer *t, enc_state *st, const unsigned char *p, size_t n,
                       int32_t i) {
    int32_t j = st->next[i];
    st->prank[i] = -1;
    if (j < 0) return;
    size_t end = st->next[j] >= 0 ? (size_t)st->next[j] : n;
    int32_t r = rank_of(t, p + i, end - (size_t)i);
    st->prank[i] = r;
    if (r >= 0) heap_push(st, (uint64_t)r << 32 | (uint32_t)i);
}

/* Byte-pair merges one regex piece p[0..n) and appends its ids. A heap with lazy deletion makes
 * this O(n log n), so 25,000-character pieces stay cheap; the result equals tiktoken's repeated
 * "merge the leftmost lowest-rank pair" scan. */
static int bpe_piece(const ds_tokenizer *t, enc_state *st, const unsigned char *p, size_t n,
                     ds_err *err) {
    int32_t whole = rank_of(t, p, n); /* tiktoken emits a piece that is a token as-is */
    if (whole >= 0) return push_id(st, whole, err);
    if (n > INT32_MAX / 4) return ds_errf(err, "tokenizer: piece of %zu bytes too long", n);
    if (n > st->scap) {
        size_t cap = DS_MAX(n, 2 * st->scap);
        int32_t *tok = realloc(st->tok, cap * sizeof *tok);
        if (tok) st->tok = tok;
        int32_t *prev = realloc(st->prev, cap * sizeof *prev);
        if (prev) st->prev = prev;
        int32_t *next = realloc(st->next, cap * sizeof *next);
        if (next) st->next = next;
        int32_t *prank = realloc(st->prank, cap * sizeof *prank);
        if (prank) st->prank = prank;
        if (!tok || !prev || !next || !prank) return ds_errf(err, "tokenizer: out of memory");
        st->scap = cap;
    }
    /* Each merge queues at most two pairs, on top of the n-1 initial ones. */
    if (3 * n > st->hcap) {
        uint64_t *h = realloc(st->heap, 3 * n * sizeof *h);
        if (!h) return ds_errf(err, "tokenizer: out of memory");
        st->heap = h;
        st->hcap = 3 * n;
    }
    for (size_t i = 0; i < n; i++) {
        st->tok[i] = t->byte_rank[p[i]];
        if (st->tok[i] < 0)
            return ds_errf(err, "tokenizer: byte 0x%02x has no token in tiktoken.model", p[i]);
        st->prev[i] = (int32_t)i - 1;
        st->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    st->hn = 0;
    for (size_t i = 0; i < n; i++) queue_pair(t, st, p, n, (int32_t)i);
    while (st->hn) {
        uint64_t e = heap_pop(st);
        int32_t i = (int32_t)(uint32_t)e, r = (int32_t)(e >> 32);
        /* Spans only grow and byte strings have one rank each, so an entry is current exactly
         * when its rank is still the part's recorded pair rank. */
        if (st->prank[i] != r) continue;
        int32_t j = st->next[i];
        st->tok[i] = r;
        st->prank[j] = -1;
        st->next[i] = st->next[j];
        if (st->next[j] >= 0) st->prev[st->next[j]] = i;
        queue_pair(t, st, p, n, i);
        if (st->prev[i] >= 0) queue_pair(t, st, p, n, st->prev[i]);
    }
    for (int32_t i = 0; i >= 0; i = st->next[i])
        if (push_id(st, st->tok[i], err) < 0) return DS_ERR;
    return DS_OK;
}

/* Regex-splits text[0..len) and BPE-encodes every piece. Like tiktoken's find_iter, text that no
 * alternative matches would be skipped; the Kimi pattern covers every code point, so none is. */
static int encode_ordinary(const ds_tokenizer *t, enc_state *st, pcre2_match_data *md,
                           const char *text, size_t len, ds_err *err) {
    size_t pos = 0, a, b;
    int rc;
    while ((rc = split_next(t->splitter, md, text, len, pos, &a, &b, err)) == 1) {
        if (bpe_piece(t, st, (const unsigned char *)text + a, b - a, err) < 0) return DS_ERR;
        pos = b;
    }
    return rc;
}

/* One capped slice: specials (if allowed) cut it, the rest is ordinary text. */
static int encode_slice(const ds_tokenizer *t, enc_state *st, pcre2_match_data *md,
                        const char *text, size_t len, int allow_special, ds_err *err) {
    if (!allow_special) return encode_ordinary(t, st, md, text, len, err);
    const unsigned char *u = (const unsigned char *)text;
    size_t start = 0;
    for (size_t i = 0; i < len; i++) {
        if (!t->special_first[u[i]]) continue;
        size_t m = 0;
        int32_t id = trie_match(t, u + i, len - i, &m);
        if (id < 0) continue;
        if (encode_ordinary(t, st, md, text + start, i - start, err) < 0) return DS_ERR;
        if (push_id(st, id, err) < 0) return DS_ERR;
        start = i + m;
        i = start - 1;
    }
    return encode_ordinary(t, st, md, text + start, len - start, err);
}

int ds_tok_encode(const ds_tokenizer *t, const char *text, size_t len, int allow_special,
                  int32_t **ids, int *n, ds_err *err) {
    *ids = NULL;
    *n = 0;
    size_t bad = utf8_invalid_at((const unsigned char *)text, len);
    if (bad < len)
        return ds_errf(err, "tokenizer: invalid UTF-8 at byte offset %zu (byte 0x%02x)", bad,
                       (unsigned char)text[bad]);
    enc_state st = {0};
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    int rc = md ? DS_OK : ds_errf(err, "tokenizer: out of memory");
    /* Walk code points, cutting where tokenization_kimi.py cuts: every DS_TOK_MAX_CHUNK code
     * points, and inside each chunk before the (DS_TOK_MAX_RUN+1)-th code point of a same-class
     * run. */
    const unsigned char *u = (const unsigned char *)text;
    size_t i = 0;
    while (rc == DS_OK && i < len) {
        size_t slice_start = i, run = 0;
        int run_space = 0;
        for (long cps = 0; i < len && cps < DS_TOK_MAX_CHUNK; cps++) {
            uint32_t cp;
            size_t w = utf8_next(u + i, &cp);
            int sp = py_isspace(cp);
            if (cps == 0)
                run_space = sp; /* as the Python: a slice starts in its first char's class */
            if (sp != run_space) {
                run = 1;
                run_space = sp;
            } else if (++run > DS_TOK_MAX_RUN) {
                rc = encode_slice(t, &st, md, text + slice_start, i - slice_start, allow_special,
                                  err);
                if (rc != DS_OK) break;
                slice_start = i;
                run = 1;
            }
            i += w;
        }
        if (rc == DS_OK)
            rc = encode_slice(t, &st, md, text + slice_start, i - slice_start, allow_special, err);
    }
    pcre2_match_data_free(md);
    free(st.tok);
    free(st.prev);
    free(st.next);
    free(st.prank);
    free(st.heap);
    if (rc != DS_OK) {
        free(st.ids);
        return DS_ERR;
    }
    *ids = st.ids ? st.ids : malloc(sizeof(int32_t));
    if (!*ids) return ds_errf(err, "tokenizer: out of memory");
    *n = st.n;
    return DS_OK;
}

/* ------------------------------------------------------------------------------------------------
 * Decoding */

int ds_tok_decode(const ds_tokenizer *t, const int32_t *ids, int n, int skip_special, char **out,
                  size_t *len, ds_err *err) {
    *out = NULL;
    if (len) *len = 0;
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->vocab)
            return ds_errf(err, "tokenizer: token id %d at position %d is outside 0..%d", ids[i], i,
                           t->vocab - 1);
        if (skip_special && ds_tok_is_special(t, ids[i])) continue;
        total += t->off[ids[i] + 1] - t->off[ids[i]];
    }
    char *s = ds_malloc(total + 1, err);
    if (!s) return DS_ERR;
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        if (skip_special && ds_tok_is_special(t, ids[i])) continue;
        size_t m = t->off[ids[i] + 1] - t->off[ids[i]];
        memcpy(s + o, t->blob + t->off[ids[i]], m);
        o += m;
    }
    s[o] = 0;
    *out = s;
    if (len) *len = o;
    return DS_OK;
}
