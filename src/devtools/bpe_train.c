/* bpe_train.c — a tiny, deterministic byte-level BPE trainer that writes a tokenizer folder
 * (tiktoken.model + tokenizer_config.json) for the small models the tests and `init-model` build.
 *
 * Training is the textbook loop over the pre-split pieces of a built-in corpus: count adjacent
 * token pairs weighted by piece frequency, turn the most frequent pair into a new token, repeat.
 * tiktoken encodes by "merge the lowest-rank pair whose concatenation is a token", not by replaying
 * merges, so a learned token is only kept if that rule, run on the token's own bytes, produces it;
 * since later tokens rank higher they can never break an earlier token's derivation. When the
 * corpus runs out of pairs the vocabulary is filled with two-byte tokens (always derivable). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer.h"

/* Written for this project: a few KB of plain English with numbers, code and contractions, and a
 * little Chinese and Japanese, so that common words, digits and CJK pieces all get merges. */
static const char k_corpus[] =
    "The quick brown fox jumps over the lazy dog. The dog doesn't mind; it's been a long day.\n"
    "A tokenizer turns text into numbers that a language model can read. It first cuts the text "
    "into pieces: words, numbers, spaces and punctuation. Then it merges the bytes of each piece "
    "into larger tokens, choosing the pair with the lowest rank every time, until no pair is left "
    "in the table. The same text always gives the same tokens, and decoding the tokens gives the "
    "text back, byte for byte.\n"
    "In the morning we walked to the market to buy bread, apples, cheese and coffee. The weather "
    "was cold but clear, and the river was quiet under the old stone bridge. We'll come back in "
    "the spring, when the trees are green again and the days are longer.\n"
    "Question: what is 12 + 30? Answer: 42. Question: how many days are in a week? Answer: 7.\n"
    "She said, \"I'm sure they're right, but we've got to check the numbers again.\" He replied "
    "that he'd already checked them twice, and that the total was 1,234,567 dollars.\n"
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\n"
    "int main(void) {\n    printf(\"hello, world\\n\");\n    return 0;\n}\n"
    "The model reads one token at a time and predicts the next one. A chat model also sees "
    "special markers that say who is speaking: the system, the user, the assistant or a tool. "
    "When the assistant wants to call a tool, it writes the name of the tool and its arguments "
    "as JSON, for example {\"city\": \"Paris\", \"unit\": \"celsius\"}, and waits for the result.\n"
    "Good evening! How are you today? I am fine, thank you. Would you like some tea or coffee? "
    "Yes, please. No, thanks. Maybe later. Let's meet at 9:30 on Monday, 3 March 2025.\n"
    "Computers store text as bytes. Every character of every language has a number, and UTF-8 "
    "writes that number with one to four bytes. English letters take one byte each, most "
    "European accents take two, and Chinese or Japanese characters usually take three.\n"
    "The history of the city goes back more than two thousand years. Its people were farmers, "
    "traders and builders; they made roads, walls and harbours, and many of those are still used "
    "today. Visitors come from all over the world to see the museums, the gardens and the sea.\n"
    "Learning to cook is mostly practice. Start with simple things: boil the water, add the "
    "pasta, stir it now and then, and taste it before you drain it. Salt matters more than you "
    "think, and fresh herbs make a plain dish feel new.\n"
    "Small numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 4096 65536. Prices: $3.50, "
    "$12.99, 20% off. Times: 10:45, 23:59. Versions: v1.2.3, 2.0-beta.\n"
    "THE END OF THE FIRST PART. Chapter Two: What They Found.\n"
    "It was late when they reached the house. The lights were off, the door wasn't locked, and "
    "there was a letter on the table. They didn't open it at first; they looked at each other, "
    "then at the letter, and then at the window, where the rain had started again.\n"
    "你好，世界！今天天气很好，我们去公园散步吧。我喜欢学习中文，也喜欢看书和听音乐。"
    "这个模型可以理解中文和英文。人工智能正在改变世界。\n"
    "こんにちは、世界。今日はいい天気ですね。私は本を読むのが好きです。\n"
    "Thank you for reading. Have a nice day, and see you again soon!\n";

/* ------------------------------------------------------------------------------------------------
 * A growing vocabulary: token bytes plus a hash index for "is this byte string a token?". */

typedef struct {
    unsigned char *blob; /* [bcap] every token's bytes, in rank order */
    uint32_t *off;       /* [cap + 1] token r is blob[off[r] .. off[r+1]) */
    int32_t *slots;      /* [n_slots] open addressing, rank or -1 */
    uint32_t n_slots;
    int n, cap;
    size_t bcap;
} vocab;

static uint64_t vhash(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
    return h ^ (h >> 31);
}

static int32_t vocab_find(const vocab *v, const unsigned char *p, size_t n) {
    uint32_t mask = v->n_slots - 1, i = (uint32_t)vhash(p, n) & mask;
    for (; v->slots[i] >= 0; i = (i + 1) & mask) {
        int32_t r = v->slots[i];
        if (v->off[r + 1] - v->off[r] == n && memcmp(v->blob + v->off[r], p, n) == 0) return r;
    }
    return -1;
}

static int vocab_add(vocab *v, const unsigned char *p, size_t n, ds_err *err) {
    if (v->off[v->n] + n > v->bcap) {
        size_t cap = 2 * (v->off[v->n] + n);
        unsigned char *b = realloc(v->blob, cap);
        if (!b) return ds_errf(err, "bpe_train: out of memory");
        v->blob = b;
        v->bcap = cap;
    }
    memcpy(v->blob + v->off[v->n], p, n);
    v->off[v->n + 1] = v->off[v->n] + (uint32_t)n;
    uint32_t mask = v->n_slots - 1, i = (uint32_t)vhash(p, n) & mask;
    while (v->slots[i] >= 0) i = (i + 1) & mask;
    v->slots[i] = v->n++;
    return DS_OK;
}

/* tiktoken's rule on p[0..n) with the vocabulary plus one candidate token (cand, ranked after all
 * others): 1 if it ends as the single candidate token. Quadratic, but tokens are short. */
static int derives_to_candidate(const vocab *v, const unsigned char *p, size_t n) {
    size_t start[64]; /* [parts + 1] part boundaries; candidates are at most 64 bytes */
    if (n > 63) return 0;
    size_t parts = n;
    for (size_t i = 0; i <= n; i++) start[i] = i;
    int32_t cand = v->n;
    while (parts > 1) {
        int32_t best = -1;
        size_t at = 0;
        for (size_t i = 0; i + 1 < parts; i++) {
            size_t a = start[i], b = start[i + 2];
            int32_t r = (a == 0 && b == n) ? cand : vocab_find(v, p + a, b - a);
            if (r >= 0 && (best < 0 || r < best)) best = r, at = i;
        }
        if (best < 0) return 0;
        memmove(start + at + 1, start + at + 2, (parts - at - 1) * sizeof *start);
        parts--;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------------------
 * Pair counting over the unique pieces ("words"). */

typedef struct {
    int32_t *sym; /* [len] current token ids of this piece */
    int len;
    int count; /* occurrences in the corpus */
} word;

typedef struct {
    uint64_t *keys; /* [n] (a << 32 | b), 0 = empty (pair (0,0) is stored as key+1 below) */
    int64_t *counts;
    uint32_t n;
} pair_table;

static int cmp_spans(const void *x, const void *y, void *ctx) {
    const size_t *a = x, *b = y;
    size_t la = a[1] - a[0], lb = b[1] - b[0];
    int c = memcmp((const char *)ctx + a[0], (const char *)ctx + b[0], DS_MIN(la, lb));
    return c ? c : (la > lb) - (la < lb);
}

/* Picks the most frequent pair not banned (ties: smallest (a, b)); 0 if none. */
static int best_pair(const word *w, int nw, pair_table *pt, const uint64_t *banned, int nbanned,
                     int32_t *a, int32_t *b) {
    memset(pt->keys, 0, pt->n * sizeof *pt->keys);
    uint32_t mask = pt->n - 1;
    for (int k = 0; k < nw; k++)
        for (int i = 0; i + 1 < w[k].len; i++) {
            uint64_t key = ((uint64_t)(uint32_t)w[k].sym[i] << 32 | (uint32_t)w[k].sym[i + 1]) + 1;
            uint32_t h = (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 40) & mask;
            while (pt->keys[h] && pt->keys[h] != key) h = (h + 1) & mask;
            if (!pt->keys[h]) pt->keys[h] = key, pt->counts[h] = 0;
            pt->counts[h] += w[k].count;
        }
    uint64_t best = 0;
    int64_t best_count = 0;
    for (uint32_t h = 0; h < pt->n; h++) {
        if (!pt->keys[h]) continue;
        int skip = 0;
        for (int k = 0; k < nbanned && !skip; k++) skip = banned[k] == pt->keys[h];
        if (skip) continue;
        if (pt->counts[h] > best_count || (pt->counts[h] == best_count && pt->keys[h] < best))
            best = pt->keys[h], best_count = pt->counts[h];
    }
    if (!best) return 0;
    *a = (int32_t)((best - 1) >> 32);
    *b = (int32_t)(uint32_t)(best - 1);
    return 1;
}

static void apply_merge(word *w, int nw, int32_t a, int32_t b, int32_t ab) {
    for (int k = 0; k < nw; k++) {
        int o = 0;
        for (int i = 0; i < w[k].len; i++) {
            if (i + 1 < w[k].len && w[k].sym[i] == a && w[k].sym[i + 1] == b) {
                w[k].sym[o++] = ab;
                i++;
            } else {
                w[k].sym[o++] = w[k].sym[i];
            }
        }
        w[k].len = o;
    }
}

/* Learns the vocabulary into v (which holds the 256 bytes on entry). */
static int train(vocab *v, int n_ranks, ds_err *err) {
    ds_tok_splitter *sp = ds_tok_splitter_new(err);
    if (!sp) return DS_ERR;
    size_t *spans = NULL; /* [np][2] */
    int np = 0, rc = DS_ERR, nw = 0, nbanned = 0;
    word *w = NULL;
    pair_table pt = {0};
    uint64_t *banned = NULL; /* [max_banned] pairs whose token tiktoken could not derive */
    int max_banned = 4096;
    if (ds_tok_split(sp, k_corpus, sizeof k_corpus - 1, &spans, &np, err) < 0) goto out;
    qsort_r(spans, (size_t)np, 2 * sizeof *spans, cmp_spans, (void *)k_corpus);
    w = ds_calloc((size_t)np, sizeof *w, err);
    pt.n = 1;
    while (pt.n < 4u * sizeof k_corpus) pt.n *= 2;
    pt.keys = ds_malloc(pt.n * sizeof *pt.keys, err);
    pt.counts = ds_malloc(pt.n * sizeof *pt.counts, err);
    banned = ds_malloc((size_t)max_banned * sizeof *banned, err);
    if (!w || !pt.keys || !pt.counts || !banned) goto out;
    for (int i = 0; i < np; i++) {
        size_t *s = spans + 2 * i;
        if (nw && cmp_spans(s - 2, s, (void *)k_corpus) == 0) {
            w[nw - 1].count++;
            continue;
        }
        w[nw].len = (int)(s[1] - s[0]);
        w[nw].count = 1;
        w[nw].sym = ds_malloc((size_t)w[nw].len * sizeof *w[nw].sym, err);
        if (!w[nw].sym) goto out;
        for (int k = 0; k < w[nw].len; k++) w[nw].sym[k] = (unsigned char)k_corpus[s[0] + k];
        nw++;
    }
    int32_t a, b;
    while (v->n < n_ranks && nbanned < max_banned &&
           best_pair(w, nw, &pt, banned, nbanned, &a, &b)) {
        size_t la = v->off[a + 1] - v->off[a], lb = v->off[b + 1] - v->off[b];
        unsigned char cat[128]; /* [la + lb] */
        if (la + lb > sizeof cat) {
            banned[nbanned++] = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1;
            continue;
        }
        memcpy(cat, v->blob + v->off[a], la);
        memcpy(cat + la, v->blob + v->off[b], lb);
        int32_t ab = vocab_find(v, cat, la + lb);
        if (ab < 0) {
            if (!derives_to_candidate(v, cat, la + lb)) {
                banned[nbanned++] = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) + 1;
                continue;
            }
            ab = v->n;
            if (vocab_add(v, cat, la + lb, err) < 0) goto out;
        }
        /* An existing token (same bytes reached by another split) is reused, not duplicated. */
        apply_merge(w, nw, a, b, ab);
    }
    rc = DS_OK;
out:
    for (int k = 0; k < nw; k++) free(w[k].sym);
    free(w);
    free(pt.keys);
    free(pt.counts);
    free(banned);
    free(spans);
    ds_tok_splitter_free(sp);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Special tokens of each family (docs/model.md §9.3): offset from n_ranks, name, `special` flag. */

typedef struct {
    int offset;
    const char *name;
    int special;
} special_def;

static const special_def k_kimi_linear_specials[] = {
    {0, "[BOS]", 1},
    {1, "[EOS]", 1},
    {2, "<|im_end|>", 1},
    {3, "<|im_user|>", 1},
    {4, "<|im_assistant|>", 1},
    {6, "<|start_header_id|>", 1},
    {7, "<|end_header_id|>", 1},
    {9, "[EOT]", 1},
    {10, "<|im_system|>", 1},
    /* Tool-call markers are added tokens with special: false, so skip-special decoding keeps them
     * and a tool-call parser can still see them. */
    {11, "<|tool_calls_section_begin|>", 0},
    {12, "<|tool_calls_section_end|>", 0},
    {13, "<|tool_call_begin|>", 0},
    {14, "<|tool_call_argument_begin|>", 0},
    {15, "<|tool_call_end|>", 0},
    {17, "<|im_middle|>", 1},
    {18, "<|media_begin|>", 1},
    {19, "<|media_content|>", 1},
    {20, "<|media_end|>", 1},
    {21, "<|media_pad|>", 1},
    {254, "[UNK]", 1},
    {255, "[PAD]", 1},
};

static const special_def k_k3_specials[] = {
    {0, "[BOS]", 1},
    {1, "[EOS]", 1},
    {2, "<|end_of_msg|>", 1},
    {3, "<|open|>", 1},
    {4, "<|close|>", 1},
    {5, "<|sep|>", 1},
    {6, "[start_header_id]", 1},
    {7, "[end_header_id]", 1},
    {9, "[EOT]", 1},
    {18, "<|media_begin|>", 1},
    {19, "<|media_content|>", 1},
    {20, "<|media_end|>", 1},
    {21, "<|media_pad|>", 1},
    {254, "[UNK]", 1},
    {255, "[PAD]", 1},
};

static void b64_encode(const unsigned char *p, size_t n, char *out) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t w = (uint32_t)p[i] << 16 | (i + 1 < n ? (uint32_t)p[i + 1] << 8 : 0) |
                     (i + 2 < n ? p[i + 2] : 0);
        out[o++] = tab[w >> 18];
        out[o++] = tab[(w >> 12) & 63];
        out[o++] = i + 1 < n ? tab[(w >> 6) & 63] : '=';
        out[o++] = i + 2 < n ? tab[w & 63] : '=';
    }
    out[o] = 0;
}

static int write_model(const char *dir, const vocab *v, ds_err *err) {
    size_t dl = strlen(dir);
    char *path = ds_malloc(dl + 32, err);
    if (!path) return DS_ERR;
    snprintf(path, dl + 32, "%s/tiktoken.model", dir);
    FILE *f = fopen(path, "wb");
    if (!f) {
        ds_errf(err, "%s: cannot create", path);
        free(path);
        return DS_ERR;
    }
    char line[256];
    for (int r = 0; r < v->n; r++) {
        b64_encode(v->blob + v->off[r], v->off[r + 1] - v->off[r], line);
        fprintf(f, "%s %d\n", line, r);
    }
    int bad = ferror(f) | fclose(f);
    int rc = bad ? ds_errf(err, "%s: write failed", path) : DS_OK;
    free(path);
    return rc;
}

static int write_config(const char *dir, int n_ranks, ds_chat_format family, ds_err *err) {
    const special_def *defs = family == DS_CHAT_K3 ? k_k3_specials : k_kimi_linear_specials;
    size_t nd =
        family == DS_CHAT_K3 ? DS_ARRAY_LEN(k_k3_specials) : DS_ARRAY_LEN(k_kimi_linear_specials);
    json_t *root = json_object(), *dec = json_object();
    char key[32];
    for (size_t i = 0; i < nd; i++) {
        snprintf(key, sizeof key, "%d", n_ranks + defs[i].offset);
        json_object_set_new(dec, key,
                            json_pack("{s:s, s:b, s:b, s:b, s:b, s:b}", "content", defs[i].name,
                                      "lstrip", 0, "normalized", 0, "rstrip", 0, "single_word", 0,
                                      "special", defs[i].special));
    }
    json_object_set_new(root, "added_tokens_decoder", dec);
    json_object_set_new(root, "bos_token", json_string("[BOS]"));
    /* The generation stop token (id n_ranks + 2), which config.json's eos_token_id names too. */
    json_object_set_new(root, "eos_token",
                        json_string(family == DS_CHAT_K3 ? "<|end_of_msg|>" : "<|im_end|>"));
    json_object_set_new(root, "pad_token", json_string("[PAD]"));
    json_object_set_new(root, "unk_token", json_string("[UNK]"));
    json_object_set_new(root, "chat_format",
                        json_string(family == DS_CHAT_K3 ? "k3" : "kimi_linear"));
    json_object_set_new(root, "tokenizer_class", json_string("TikTokenTokenizer"));
    size_t dl = strlen(dir);
    char *path = ds_malloc(dl + 32, err);
    int rc = DS_ERR;
    if (path) {
        snprintf(path, dl + 32, "%s/tokenizer_config.json", dir);
        rc = json_dump_file(root, path, JSON_INDENT(2)) == 0
                 ? DS_OK
                 : ds_errf(err, "%s: cannot write", path);
        free(path);
    }
    json_decref(root);
    return rc;
}

int ds_tok_write_files(const char *dir, int n_ranks, ds_chat_format family, ds_err *err) {
    if (n_ranks < 256 || n_ranks > DS_TOK_MAX_WRITE_RANKS)
        return ds_errf(err, "bpe_train: n_ranks %d outside 256..%d", n_ranks,
                       DS_TOK_MAX_WRITE_RANKS);
    if (family != DS_CHAT_KIMI_LINEAR && family != DS_CHAT_K3)
        return ds_errf(err, "bpe_train: unknown chat format %d", (int)family);
    vocab v = {0};
    int rc = DS_ERR;
    v.cap = n_ranks;
    v.off = ds_calloc((size_t)n_ranks + 1, sizeof *v.off, err);
    v.n_slots = 1024;
    while (v.n_slots < 2u * (uint32_t)n_ranks) v.n_slots *= 2;
    v.slots = ds_malloc(v.n_slots * sizeof *v.slots, err);
    if (!v.off || !v.slots) goto out;
    memset(v.slots, 0xff, v.n_slots * sizeof *v.slots);
    for (int b = 0; b < 256; b++) {
        unsigned char c = (unsigned char)b;
        if (vocab_add(&v, &c, 1, err) < 0) goto out;
    }
    if (train(&v, n_ranks, err) < 0) goto out;
    /* Fill-up: two-byte tokens, printable ASCII first. A two-byte token is one merge of two single
     * bytes, so tiktoken always derives it. Then (vocabularies of real models' size, e.g.
     * 163,584 ranks) three-byte tokens the same way: once every two-byte token ranks before
     * them, either first merge of x y z leaves a pair whose bytes are the token. */
    for (int pass = 0; pass < 2 && v.n < n_ranks; pass++)
        for (int x = 0; x < 256 && v.n < n_ranks; x++)
            for (int y = 0; y < 256 && v.n < n_ranks; y++) {
                int printable = x >= 0x20 && x < 0x7f && y >= 0x20 && y < 0x7f;
                if (printable != (pass == 0)) continue;
                unsigned char pr[2] = {(unsigned char)x, (unsigned char)y};
                if (vocab_find(&v, pr, 2) < 0 && vocab_add(&v, pr, 2, err) < 0) goto out;
            }
    for (int pass = 0; pass < 2 && v.n < n_ranks; pass++)
        for (int t = 0; t < 1 << 24 && v.n < n_ranks; t++) {
            unsigned char tr[3] = {(unsigned char)(t >> 16), (unsigned char)(t >> 8),
                                   (unsigned char)t};
            int printable = 1;
            for (int k = 0; k < 3; k++) printable &= tr[k] >= 0x20 && tr[k] < 0x7f;
            if (printable != (pass == 0)) continue;
            if (vocab_find(&v, tr, 3) < 0 && vocab_add(&v, tr, 3, err) < 0) goto out;
        }
    if (write_model(dir, &v, err) < 0) goto out;
    rc = write_config(dir, n_ranks, family, err);
out:
    free(v.blob);
    free(v.off);
    free(v.slots);
    return rc;
}
