/* test_text_tokenizer.c — the tiktoken tokenizer against independent references.
 *
 * Goldens in tests/golden/tok/ come from make_golden.py: regex pieces from Python `regex` running
 * the original `&&` pattern, and ids from tiktoken's Rust core on the committed vocabularies. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "text/tokenizer.h"
#include "testutil.h"

#define GOLDEN "tests/golden/tok/"

static json_t *load_json(const char *rel) {
    char *path = ds_test_src_path(rel);
    json_error_t je;
    json_t *j = json_load_file(path, JSON_ALLOW_NUL, &je);
    if (!j) fail_msg("%s:%d: %s", path, je.line, je.text);
    free(path);
    return j;
}

static ds_tokenizer *load_tok(const char *rel_dir) {
    char *dir = ds_test_src_path(rel_dir);
    ds_tokenizer *t = NULL;
    ds_err err = {{0}};
    if (ds_tok_load(dir, &t, &err) != DS_OK) fail_msg("load %s: %s", dir, err.msg);
    free(dir);
    return t;
}

static int32_t *encode_ok(const ds_tokenizer *t, const char *s, size_t len, int allow, int *n) {
    int32_t *ids = NULL;
    ds_err err = {{0}};
    if (ds_tok_encode(t, s, len, allow, &ids, n, &err) != DS_OK) fail_msg("encode: %s", err.msg);
    return ids;
}

/* Pieces of the PCRE2 rewrite == pieces of the original intersection pattern (Python regex V1). */
static void test_split_matches_intersection_pattern(void **state) {
    (void)state;
    ds_err err = {{0}};
    ds_tok_splitter *sp = ds_tok_splitter_new(&err);
    assert_non_null(sp);
    json_t *g = load_json(GOLDEN "splits.json");
    assert_true(json_array_size(g) > 400);
    size_t i;
    json_t *c;
    int checked_pieces = 0;
    json_array_foreach(g, i, c) {
        json_t *text = json_object_get(c, "text"), *pieces = json_object_get(c, "pieces");
        const char *s = json_string_value(text);
        size_t *spans;
        int n;
        assert_int_equal(ds_tok_split(sp, s, json_string_length(text), &spans, &n, &err), DS_OK);
        if ((size_t)n != json_array_size(pieces))
            fail_msg("case %zu: %d pieces, expected %zu (text \"%s\")", i, n,
                     json_array_size(pieces), s);
        for (int k = 0; k < n; k++) {
            json_t *p = json_array_get(pieces, (size_t)k);
            size_t len = spans[2 * k + 1] - spans[2 * k];
            if (len != json_string_length(p) || memcmp(s + spans[2 * k], json_string_value(p), len))
                fail_msg("case %zu piece %d: got \"%.*s\", expected \"%s\"", i, k, (int)len,
                         s + spans[2 * k], json_string_value(p));
            checked_pieces++;
        }
        free(spans);
    }
    assert_true(checked_pieces > 3000);
    json_decref(g);
    ds_tok_splitter_free(sp);
}

/* docs/model.md §9.2 / §12: "、" (Script=Common, scx includes Han) stays out of Han runs. */
static void test_split_han_script_vector(void **state) {
    (void)state;
    ds_err err = {{0}};
    ds_tok_splitter *sp = ds_tok_splitter_new(&err);
    assert_non_null(sp);
    const char *s = "你好、世界々";
    size_t *spans;
    int n;
    assert_int_equal(ds_tok_split(sp, s, strlen(s), &spans, &n, &err), DS_OK);
    assert_int_equal(n, 3);
    assert_int_equal(spans[1], 6);  /* 你好 */
    assert_int_equal(spans[3], 9);  /* 、 */
    assert_int_equal(spans[5], 18); /* 世界々 */
    free(spans);
    assert_non_null(strstr(ds_tok_splitter_pattern(sp), "(?!\\p{sc:Han})"));
    ds_tok_splitter_free(sp);
}

static uint64_t fnv_ids(const int32_t *ids, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)ids[i]) * 1099511628211ull;
    return h;
}

static void check_ids(const char *what, size_t i, const int32_t *ids, int n, json_t *want) {
    if ((size_t)n != json_array_size(want))
        fail_msg("%s case %zu: %d ids, tiktoken gives %zu", what, i, n, json_array_size(want));
    for (int k = 0; k < n; k++)
        if (ids[k] != json_integer_value(json_array_get(want, (size_t)k)))
            fail_msg("%s case %zu id %d: got %d, tiktoken gives %lld", what, i, k, ids[k],
                     json_integer_value(json_array_get(want, (size_t)k)));
}

/* BPE ids equal tiktoken's on the same vocabulary and pattern, with and without specials. */
static void check_ids_golden(const char *vocab) {
    char rel[256];
    snprintf(rel, sizeof rel, GOLDEN "%s", vocab);
    ds_tokenizer *t = load_tok(rel);
    snprintf(rel, sizeof rel, GOLDEN "ids_%s.json", vocab);
    json_t *g = load_json(rel), *splits = load_json(GOLDEN "splits.json");
    json_t *ord = json_object_get(g, "ordinary"), *spc = json_object_get(g, "special");
    assert_int_equal(json_array_size(ord), json_array_size(splits));
    size_t i;
    json_t *c;
    json_array_foreach(splits, i, c) {
        json_t *text = json_object_get(c, "text");
        int n;
        int32_t *ids = encode_ok(t, json_string_value(text), json_string_length(text), 0, &n);
        check_ids("ordinary", i, ids, n, json_array_get(ord, i));
        free(ids);
        ids = encode_ok(t, json_string_value(text), json_string_length(text), 1, &n);
        check_ids("special", i, ids, n, json_array_get(spc, i));
        free(ids);
    }
    /* Long inputs: Moonshot's 25,000-run and 400,000-chunk cuts. */
    json_array_foreach(json_object_get(g, "long"), i, c) {
        const char *unit = json_string_value(json_object_get(c, "unit"));
        const char *suffix = json_string_value(json_object_get(c, "suffix"));
        size_t ul = strlen(unit), sl = strlen(suffix);
        long rep = (long)json_integer_value(json_object_get(c, "repeat"));
        char *s = malloc(ul * (size_t)rep + sl + 1);
        for (long r = 0; r < rep; r++) memcpy(s + ul * (size_t)r, unit, ul);
        memcpy(s + ul * (size_t)rep, suffix, sl + 1);
        int n;
        int32_t *ids = encode_ok(t, s, ul * (size_t)rep + sl, 0, &n);
        assert_int_equal(n, json_integer_value(json_object_get(c, "n")));
        char hex[32];
        snprintf(hex, sizeof hex, "%016llx", (unsigned long long)fnv_ids(ids, n));
        if (strcmp(hex, json_string_value(json_object_get(c, "fnv"))))
            fail_msg("long case %zu (\"%s\" x %ld): id hash %s, tiktoken gives %s", i, unit, rep,
                     hex, json_string_value(json_object_get(c, "fnv")));
        check_ids("long head", i, ids, 16, json_object_get(c, "head"));
        check_ids("long tail", i, ids + n - 16, 16, json_object_get(c, "tail"));
        free(ids);
        free(s);
    }
    json_decref(g);
    json_decref(splits);
    ds_tok_free(t);
}

static void test_ids_match_tiktoken_768(void **state) {
    (void)state;
    check_ids_golden("vocab768_kimi_linear");
}

static void test_ids_match_tiktoken_2048(void **state) {
    (void)state;
    check_ids_golden("vocab2048_k3");
}

static void roundtrip(const ds_tokenizer *t, const char *s, size_t len, int allow) {
    int n;
    int32_t *ids = encode_ok(t, s, len, allow, &n);
    char *out;
    size_t olen;
    ds_err err = {{0}};
    assert_int_equal(ds_tok_decode(t, ids, n, 0, &out, &olen, &err), DS_OK);
    if (olen != len || memcmp(out, s, len))
        fail_msg("round trip differs for \"%.*s\"", (int)len, s);
    free(out);
    free(ids);
}

/* Writes the UTF-8 of cp into p; returns its length. */
static int put_utf8(char *p, uint32_t cp) {
    if (cp < 0x80) return p[0] = (char)cp, 1;
    if (cp < 0x800) return p[0] = (char)(0xC0 | cp >> 6), p[1] = (char)(0x80 | (cp & 63)), 2;
    if (cp < 0x10000) {
        p[0] = (char)(0xE0 | cp >> 12);
        p[1] = (char)(0x80 | ((cp >> 6) & 63));
        p[2] = (char)(0x80 | (cp & 63));
        return 3;
    }
    p[0] = (char)(0xF0 | cp >> 18);
    p[1] = (char)(0x80 | ((cp >> 12) & 63));
    p[2] = (char)(0x80 | ((cp >> 6) & 63));
    p[3] = (char)(0x80 | (cp & 63));
    return 4;
}

/* decode(encode(s)) == s on the corpus, on random valid UTF-8, and on long single-class runs. */
static void test_roundtrip(void **state) {
    (void)state;
    ds_tokenizer *t = load_tok(GOLDEN "vocab768_kimi_linear");
    json_t *splits = load_json(GOLDEN "splits.json");
    size_t i;
    json_t *c;
    json_array_foreach(splits, i, c) {
        json_t *text = json_object_get(c, "text");
        roundtrip(t, json_string_value(text), json_string_length(text), 0);
        roundtrip(t, json_string_value(text), json_string_length(text), 1);
    }
    json_decref(splits);
    ds_rng rng;
    ds_rng_seed(&rng, 7);
    char buf[4 * 64];
    for (int k = 0; k < 3000; k++) {
        int len = 0, m = 1 + (int)(ds_rng_next(&rng) % 64);
        for (int j = 0; j < m; j++) {
            uint64_t r = ds_rng_next(&rng);
            uint32_t cp;
            switch (r % 4) {
            case 0:
                cp = (uint32_t)(r >> 8) % 0x80;
                break;
            case 1:
                cp = 0x80 + (uint32_t)(r >> 8) % 0x780;
                break;
            case 2:
                cp = 0x800 + (uint32_t)(r >> 8) % 0xF800;
                break;
            default:
                cp = 0x10000 + (uint32_t)(r >> 8) % 0x100000;
                break;
            }
            if (cp >= 0xD800 && cp < 0xE000) cp -= 0x1000; /* no surrogates */
            len += put_utf8(buf + len, cp);
        }
        roundtrip(t, buf, (size_t)len, (int)(k & 1));
    }
    /* 60,000 two-byte letters (over the JIT's stack on one match) and a 30,000-space run. */
    size_t big = 120000;
    char *s = malloc(big + 1);
    for (size_t j = 0; j < big; j += 2) s[j] = (char)0xC3, s[j + 1] = (char)0xA9; /* é */
    roundtrip(t, s, big, 0);
    memset(s, ' ', 30000);
    roundtrip(t, s, 30000, 0);
    free(s);
    ds_tok_free(t);
}

/* Specials: ids, names, longest match, allow/disallow, skip-special decoding. */
static void test_specials(void **state) {
    (void)state;
    ds_tokenizer *t = load_tok(GOLDEN "vocab768_kimi_linear");
    ds_err err = {{0}};
    assert_int_equal(ds_tok_n_ranks(t), 768);
    assert_int_equal(ds_tok_vocab_size(t), 1024);
    assert_int_equal(ds_tok_special_id(t, "<|im_end|>"), 770);
    assert_int_equal(ds_tok_eos_id(t), 770);
    assert_int_equal(ds_tok_bos_id(t), 768);
    assert_int_equal(ds_tok_special_id(t, "<|im_middle|>"), 768 + 17);
    assert_int_equal(ds_tok_special_id(t, "<|reserved_token_773|>"), 773);
    assert_int_equal(ds_tok_special_id(t, "<|im_end"), -1);
    assert_int_equal(ds_tok_special_id(t, "<|open|>"), -1);
    assert_true(ds_tok_is_special(t, 770));
    assert_false(ds_tok_is_special(t, 768 + 13)); /* <|tool_call_begin|>: special false */
    assert_false(ds_tok_is_special(t, 100));
    size_t len;
    const char *b = ds_tok_token_bytes(t, 768 + 13, &len);
    assert_int_equal(len, strlen("<|tool_call_begin|>"));
    assert_memory_equal(b, "<|tool_call_begin|>", len);
    assert_null(ds_tok_token_bytes(t, 1024, &len));
    assert_null(ds_tok_token_bytes(t, -1, &len));

    const char *s = "hi<|im_end|><|im_end|>x<|tool_call_begin|>";
    int n;
    int32_t *ids = encode_ok(t, s, strlen(s), 1, &n);
    assert_true(n >= 5);
    assert_int_equal(ids[n - 1], 768 + 13);
    assert_int_equal(ids[n - 3], 770);
    assert_int_equal(ids[n - 4], 770);
    char *out;
    assert_int_equal(ds_tok_decode(t, ids, n, 1, &out, &len, &err), DS_OK);
    assert_string_equal(out, "hix<|tool_call_begin|>"); /* im_end dropped, tool marker kept */
    free(out);
    free(ids);
    ids = encode_ok(t, s, strlen(s), 0, &n);
    for (int k = 0; k < n; k++) assert_true(ids[k] < 768);
    free(ids);

    int32_t bad[2] = {5, 1024};
    assert_int_equal(ds_tok_decode(t, bad, 2, 0, &out, &len, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "1024"));
    assert_non_null(strstr(err.msg, "position 1"));
    ds_tok_free(t);
}

static char *write_dir(const char *model, const char *config) {
    char *dir = ds_test_tmpdir();
    char path[512];
    snprintf(path, sizeof path, "%s/tiktoken.model", dir);
    assert_int_equal(ds_test_write_file(path, model, strlen(model)), 0);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    assert_int_equal(ds_test_write_file(path, config, strlen(config)), 0);
    return dir;
}

/* A byte-only vocabulary (all 256 bytes) plus "ab", in tiktoken.model text. */
static char *byte_model(const char *extra_lines) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    char *m = malloc(256 * 16 + strlen(extra_lines) + 1), *p = m;
    for (int b = 0; b < 256; b++) p += sprintf(p, "%c%c== %d\n", tab[b >> 2], tab[(b & 3) << 4], b);
    strcpy(p, extra_lines);
    return m;
}

/* Longest match among specials that prefix each other; custom names; reserved fill-in. */
static void test_special_longest_match(void **state) {
    (void)state;
    char *model = byte_model("YWI= 256\n"); /* "ab" */
    char *dir = write_dir(model, "{\"added_tokens_decoder\": {"
                                 "\"257\": {\"content\": \"<x>\", \"special\": true},"
                                 "\"258\": {\"content\": \"<x>y\", \"special\": true},"
                                 "\"259\": {\"content\": \"ab\", \"special\": false}},"
                                 "\"eos_token\": {\"content\": \"<x>\"}}");
    ds_tokenizer *t = NULL;
    ds_err err = {{0}};
    assert_int_equal(ds_tok_load(dir, &t, &err), DS_OK);
    assert_int_equal(ds_tok_eos_id(t), 257);
    assert_int_equal(ds_tok_bos_id(t), -1);
    assert_int_equal(ds_tok_special_id(t, "<|reserved_token_260|>"), 260);
    int n;
    int32_t *ids = encode_ok(t, "<x>y<x>ab", 9, 1, &n);
    assert_int_equal(n, 3);
    assert_int_equal(ids[0], 258); /* longest */
    assert_int_equal(ids[1], 257);
    assert_int_equal(ids[2], 259); /* added token wins over the rank-256 merge */
    free(ids);
    ids = encode_ok(t, "<x>y<x>ab", 9, 0, &n);
    assert_int_equal(ids[n - 1], 256); /* ordinary text: "ab" merges to rank 256 */
    free(ids);
    ds_tok_free(t);
    free(dir);
    free(model);
}

static void expect_load_error(const char *model, const char *config, const char *want1,
                              const char *want2) {
    char *dir = write_dir(model, config);
    ds_tokenizer *t = NULL;
    ds_err err = {{0}};
    assert_int_equal(ds_tok_load(dir, &t, &err), DS_ERR);
    assert_null(t);
    if (!strstr(err.msg, want1) || (want2 && !strstr(err.msg, want2)))
        fail_msg("error \"%s\" should mention \"%s\" and \"%s\"", err.msg, want1,
                 want2 ? want2 : "");
    free(dir);
}

static void test_load_errors(void **state) {
    (void)state;
    const char *cfg = "{}";
    char *m;
    m = byte_model("YW*= 256\n");
    expect_load_error(m, cfg, "tiktoken.model:257", "base64");
    free(m);
    m = byte_model("YWI= 300\n");
    expect_load_error(m, cfg, "tiktoken.model:257", "rank 300 out of range");
    free(m);
    m = byte_model("YWI= 5\n");
    expect_load_error(m, cfg, "tiktoken.model:257", "line 6");
    free(m);
    m = byte_model("YQ== 256\n"); /* "a" again */
    expect_load_error(m, cfg, "tiktoken.model:257", "duplicate");
    free(m);
    m = byte_model("YWI=256\n");
    expect_load_error(m, cfg, "tiktoken.model:257", "<base64> <rank>");
    free(m);
    m = byte_model("YWI= 2x\n");
    expect_load_error(m, cfg, "tiktoken.model:257", "not a number");
    free(m);
    m = byte_model("");
    expect_load_error(m, "{\"added_tokens_decoder\": {\"10\": {\"content\": \"<a>\"}}}",
                      "added_tokens_decoder[\"10\"]", "256..511");
    expect_load_error(m, "{\"added_tokens_decoder\": {\"300\": {\"content\": 5}}}",
                      "added_tokens_decoder[\"300\"].content", NULL);
    expect_load_error(m,
                      "{\"added_tokens_decoder\": {\"300\": {\"content\": \"<a>\"},"
                      " \"301\": {\"content\": \"<a>\"}}}",
                      "\"<a>\" is used twice", NULL);
    /* One id under two spellings (found by fuzz_text_load: the first name leaked) */
    expect_load_error(m,
                      "{\"added_tokens_decoder\": {\"300\": {\"content\": \"<a>\"},"
                      " \"0300\": {\"content\": \"<b>\"}}}",
                      "token id 300 is given twice", NULL);
    expect_load_error(m,
                      "{\"added_tokens_decoder\": {\"300\": {\"content\": \"<a>\"},"
                      " \" 300\": {\"content\": \"<b>\"}}}",
                      "key \" 300\" is not a token id", NULL);
    expect_load_error(m, "{\"added_tokens_decoder\": {\"+300\": {\"content\": \"<a>\"}}}",
                      "key \"+300\" is not a token id", NULL);
    expect_load_error(m, "{\"eos_token\": \"<nope>\"}", "eos_token \"<nope>\"", NULL);
    expect_load_error(m, "{\"added_tokens_decoder\": [", "tokenizer_config.json:1", NULL);
    free(m);
}

static void test_encode_rejects_invalid_utf8(void **state) {
    (void)state;
    ds_tokenizer *t = load_tok(GOLDEN "vocab768_kimi_linear");
    struct {
        const char *s;
        size_t len;
        const char *want;
    } cases[] = {
        {"ab\xff"
         "cd",
         5, "byte offset 2"},
        {"abc\xc0\xaf", 5, "byte offset 3"},       /* overlong '/' */
        {"\xed\xa0\x80", 3, "byte offset 0"},      /* surrogate U+D800 */
        {"hello \xe4\xbd", 8, "byte offset 6"},    /* truncated */
        {"x\xf4\x90\x80\x80", 5, "byte offset 1"}, /* > U+10FFFF */
    };
    for (size_t k = 0; k < DS_ARRAY_LEN(cases); k++) {
        int32_t *ids = NULL;
        int n = -1;
        ds_err err = {{0}};
        assert_int_equal(ds_tok_encode(t, cases[k].s, cases[k].len, 1, &ids, &n, &err), DS_ERR);
        assert_null(ids);
        if (!strstr(err.msg, cases[k].want))
            fail_msg("case %zu: \"%s\" lacks \"%s\"", k, err.msg, cases[k].want);
    }
    int n;
    int32_t *ids = encode_ok(t, "", 0, 1, &n);
    assert_int_equal(n, 0);
    free(ids);
    ds_tok_free(t);
}

/* The trainer is deterministic (reproduces the committed vocabularies), fast, and every token it
 * makes is what tiktoken's merge rule derives from the token's own bytes. */
static void compare_files(const char *a, const char *b) {
    size_t la, lb;
    ds_err err = {{0}};
    char *x = ds_read_file(a, &la, &err), *y = ds_read_file(b, &lb, &err);
    assert_non_null(x);
    assert_non_null(y);
    if (la != lb || memcmp(x, y, la)) fail_msg("%s differs from %s", a, b);
    free(x);
    free(y);
}

static int cmp_tok(const void *a, const void *b, void *ctx) {
    const ds_tokenizer *t = ctx;
    size_t la, lb;
    const char *x = ds_tok_token_bytes(t, *(const int32_t *)a, &la);
    const char *y = ds_tok_token_bytes(t, *(const int32_t *)b, &lb);
    int c = memcmp(x, y, DS_MIN(la, lb));
    return c ? c : (la > lb) - (la < lb);
}

/* Rank of p[0..n) by binary search over the ranks sorted by bytes; -1 if none. */
static int32_t find_rank(const ds_tokenizer *t, const int32_t *sorted, int nr, const char *p,
                         size_t n) {
    int lo = 0, hi = nr - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        size_t l;
        const char *x = ds_tok_token_bytes(t, sorted[mid], &l);
        int c = memcmp(x, p, DS_MIN(l, n));
        if (!c) c = (l > n) - (l < n);
        if (!c) return sorted[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return -1;
}

static void check_trainer(int n_ranks, ds_chat_format fam, const char *golden) {
    char *dir = ds_test_tmpdir();
    ds_err err = {{0}};
    assert_int_equal(ds_tok_write_files(dir, n_ranks, fam, &err), DS_OK);
    char a[512];
    const char *files[2] = {"tiktoken.model", "tokenizer_config.json"};
    for (int k = 0; golden && k < 2; k++) {
        snprintf(a, sizeof a, "%s/%s", dir, files[k]);
        char rel[256];
        snprintf(rel, sizeof rel, GOLDEN "%s/%s", golden, files[k]);
        char *g = ds_test_src_path(rel);
        compare_files(a, g);
        free(g);
    }
    ds_tokenizer *t = NULL;
    assert_int_equal(ds_tok_load(dir, &t, &err), DS_OK);
    assert_int_equal(ds_tok_n_ranks(t), n_ranks);
    /* Independent naive tiktoken merge on each token's bytes must end in that single token. */
    int32_t *sorted = malloc((size_t)n_ranks * sizeof *sorted);
    for (int r = 0; r < n_ranks; r++) sorted[r] = r;
    qsort_r(sorted, (size_t)n_ranks, sizeof *sorted, cmp_tok, t);
    int multi = 0;
    for (int r = 0; r < n_ranks; r++) {
        size_t n;
        const char *p = ds_tok_token_bytes(t, r, &n);
        if (n == 1) {
            assert_int_equal((unsigned char)p[0], r); /* bytes first, in byte order */
            continue;
        }
        multi++;
        size_t start[80], parts = n;
        assert_true(n < 80);
        for (size_t i = 0; i <= n; i++) start[i] = i;
        while (parts > 1) {
            int32_t best = -1;
            size_t at = 0;
            for (size_t i = 0; i + 1 < parts; i++) {
                int32_t q = find_rank(t, sorted, n_ranks, p + start[i], start[i + 2] - start[i]);
                if (q >= 0 && (best < 0 || q < best)) best = q, at = i;
            }
            if (best < 0) fail_msg("rank %d (\"%.*s\") is not derivable by merges", r, (int)n, p);
            memmove(start + at + 1, start + at + 2, (parts - at - 1) * sizeof *start);
            parts--;
        }
    }
    assert_int_equal(multi, n_ranks - 256);
    /* Family specials at n_ranks + (official id - 163584). */
    if (fam == DS_CHAT_K3) {
        assert_int_equal(ds_tok_special_id(t, "<|end_of_msg|>"), n_ranks + 2);
        assert_int_equal(ds_tok_special_id(t, "<|open|>"), n_ranks + 3);
        assert_int_equal(ds_tok_special_id(t, "<|close|>"), n_ranks + 4);
        assert_int_equal(ds_tok_special_id(t, "<|sep|>"), n_ranks + 5);
        assert_int_equal(ds_tok_special_id(t, "<|im_end|>"), -1);
    } else {
        assert_int_equal(ds_tok_special_id(t, "<|im_end|>"), n_ranks + 2);
        assert_int_equal(ds_tok_special_id(t, "<|im_user|>"), n_ranks + 3);
        assert_int_equal(ds_tok_special_id(t, "<|im_assistant|>"), n_ranks + 4);
        assert_int_equal(ds_tok_special_id(t, "<|im_system|>"), n_ranks + 10);
        assert_int_equal(ds_tok_special_id(t, "<|tool_calls_section_begin|>"), n_ranks + 11);
        assert_int_equal(ds_tok_special_id(t, "<|im_middle|>"), n_ranks + 17);
    }
    assert_int_equal(ds_tok_special_id(t, "[PAD]"), n_ranks + 255);
    assert_int_equal(ds_tok_eos_id(t), n_ranks + 2);
    free(sorted);
    ds_tok_free(t);
    free(dir);
}

static void test_trainer_768_kimi_linear(void **state) {
    (void)state;
    check_trainer(768, DS_CHAT_KIMI_LINEAR, "vocab768_kimi_linear");
}

static void test_trainer_2048_k3(void **state) {
    (void)state;
    check_trainer(2048, DS_CHAT_K3, "vocab2048_k3");
}

/* A real model's vocabulary size (Kimi's 163,584 ranks): past the two-byte tokens three-byte ones
 * fill it, each still derivable by merges (check_trainer), and text round-trips. */
static void test_trainer_kimi_size(void **state) {
    (void)state;
    check_trainer(163584, DS_CHAT_KIMI_LINEAR, NULL);
    char *dir = ds_test_tmpdir();
    ds_err err = {{0}};
    assert_int_equal(ds_tok_write_files(dir, 163584, DS_CHAT_KIMI_LINEAR, &err), DS_OK);
    ds_tokenizer *t = NULL;
    assert_int_equal(ds_tok_load(dir, &t, &err), DS_OK);
    size_t n;
    const char *p = ds_tok_token_bytes(t, 163583, &n);
    assert_int_equal(n, 3); /* the last rank is a three-byte token */
    (void)p;
    const char text[] = "Mia has 23 apples; \xe4\xbd\xa0\xe5\xa5\xbd \x01\x7f end";
    int nid;
    int32_t *ids = encode_ok(t, text, sizeof text - 1, 0, &nid);
    char *back = NULL;
    size_t len = 0;
    assert_int_equal(ds_tok_decode(t, ids, nid, 0, &back, &len, &err), DS_OK);
    assert_int_equal(len, sizeof text - 1);
    assert_memory_equal(back, text, len);
    free(back);
    free(ids);
    ds_tok_free(t);
    free(dir);
}

static void test_trainer_bad_args(void **state) {
    (void)state;
    ds_err err = {{0}};
    assert_int_equal(ds_tok_write_files("/nonexistent-dir-xyz", 768, DS_CHAT_K3, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "/nonexistent-dir-xyz/tiktoken.model"));
    assert_int_equal(ds_tok_write_files("/tmp", 100, DS_CHAT_K3, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "100"));
    assert_int_equal(ds_tok_write_files("/tmp", DS_TOK_MAX_WRITE_RANKS + 1, DS_CHAT_K3, &err),
                     DS_ERR);
    assert_non_null(strstr(err.msg, "outside 256.."));
}

/* Throughput on ~2 MB of mixed text (printed, not asserted: machines differ). */
static void test_encode_speed(void **state) {
    (void)state;
    ds_tokenizer *t = load_tok(GOLDEN "vocab2048_k3");
    json_t *splits = load_json(GOLDEN "splits.json");
    size_t cap = 2u << 20, len = 0;
    char *s = malloc(cap + 4096);
    while (len < cap) {
        size_t i;
        json_t *c;
        json_array_foreach(splits, i, c) {
            json_t *text = json_object_get(c, "text");
            memcpy(s + len, json_string_value(text), json_string_length(text));
            len += json_string_length(text);
            s[len++] = '\n';
            if (len >= cap) break;
        }
    }
    double t0 = ds_now();
    int n;
    int32_t *ids = encode_ok(t, s, len, 1, &n);
    double dt = ds_now() - t0;
    printf("encode: %.2f MB in %.3f s (%.1f MB/s, %d tokens)\n", len / 1e6, dt, len / 1e6 / dt, n);
    assert_true(n > (int)(len / 16));
    free(ids);
    free(s);
    json_decref(splits);
    ds_tok_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split_matches_intersection_pattern),
        cmocka_unit_test(test_split_han_script_vector),
        cmocka_unit_test(test_ids_match_tiktoken_768),
        cmocka_unit_test(test_ids_match_tiktoken_2048),
        cmocka_unit_test(test_roundtrip),
        cmocka_unit_test(test_specials),
        cmocka_unit_test(test_special_longest_match),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_encode_rejects_invalid_utf8),
        cmocka_unit_test(test_trainer_768_kimi_linear),
        cmocka_unit_test(test_trainer_2048_k3),
        cmocka_unit_test(test_trainer_kimi_size),
        cmocka_unit_test(test_trainer_bad_args),
        cmocka_unit_test(test_encode_speed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
