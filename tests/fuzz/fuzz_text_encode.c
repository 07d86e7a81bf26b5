/* fuzz_text_encode.c — libFuzzer target for encoding arbitrary bytes with a real vocabulary
 * (tests/golden/tok/vocab768_kimi_linear, or $DS_FUZZ_TOK_DIR).
 *
 * Input: first byte = flags (bit 0: allow_special, bit 1: also decode the input as token ids),
 * then the text. Invariants: encoding fails exactly when the text is not strict UTF-8 (the error
 * names an offset); every id is in range; decode(encode(text)) == text, with or without special
 * tokens; the pre-split pieces tile the text. */
#include <stdio.h>
#include <stdlib.h>

#include "fuzzutil.h"
#include "text/tokenizer.h"

static ds_tokenizer *g_tok;
static ds_tok_splitter *g_split;

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *dir = getenv("DS_FUZZ_TOK_DIR");
    char buf[1024];
    if (!dir || !*dir) {
        snprintf(buf, sizeof buf, "%s/tests/golden/tok/vocab768_kimi_linear", DS_SOURCE_DIR);
        dir = buf;
    }
    ds_err err;
    if (ds_tok_load(dir, &g_tok, &err) != DS_OK) fz_fail("loading %s: %s", dir, err.msg);
    g_split = ds_tok_splitter_new(&err);
    if (!g_split) fz_fail("splitter: %s", err.msg);
    return 0;
}

/* Python's strict UTF-8 (independent of the tokenizer's own check): 1 if valid. */
static int utf8_ok(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t c = s[i], cp, need;
        if (c < 0x80) {
            i++;
            continue;
        }
        if ((c & 0xE0) == 0xC0)
            need = 1, cp = c & 0x1F;
        else if ((c & 0xF0) == 0xE0)
            need = 2, cp = c & 0x0F;
        else if ((c & 0xF8) == 0xF0)
            need = 3, cp = c & 0x07;
        else
            return 0;
        if (i + need >= n) return 0; /* truncated */
        for (uint32_t k = 1; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        static const uint32_t min_cp[4] = {0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[need] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += need + 1;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int flags = data[0];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int V = ds_tok_vocab_size(g_tok);
    int32_t *ids = NULL;
    int n = -1;
    ds_err err;
    int valid = utf8_ok((const uint8_t *)text, len);
    int rc = ds_tok_encode(g_tok, text, len, flags & 1, &ids, &n, &err);
    if ((rc == DS_OK) != valid)
        fz_fail("encode rc %d but the text is %s UTF-8 (%s)", rc, valid ? "valid" : "invalid",
                rc ? err.msg : "");
    if (rc == DS_OK) {
        if (n < 0 || (len && n == 0) || (size_t)n > len) fz_fail("%d ids for %zu bytes", n, len);
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= V) fz_fail("id %d out of range", ids[i]);
        char *out = NULL;
        size_t olen = 0;
        if (ds_tok_decode(g_tok, ids, n, 0, &out, &olen, &err) != DS_OK)
            fz_fail("decode failed: %s", err.msg);
        if (olen != len || memcmp(out, text, len) != 0) fz_fail("decode(encode(text)) != text");
        free(out);
        size_t *spans = NULL;
        int ns = 0;
        if (ds_tok_split(g_split, text, len, &spans, &ns, &err) != DS_OK)
            fz_fail("split failed on valid text: %s", err.msg);
        size_t at = 0;
        for (int i = 0; i < ns; i++) {
            if (spans[2 * i] != at || spans[2 * i + 1] <= spans[2 * i])
                fz_fail("piece %d [%zu, %zu) does not continue at %zu", i, spans[2 * i],
                        spans[2 * i + 1], at);
            at = spans[2 * i + 1];
        }
        if (at != len) fz_fail("pieces end at %zu of %zu bytes", at, len);
        free(spans);
    }
    free(ids);
    if (flags & 2) {
        /* The text's bytes as 16-bit ids, some out of range on purpose. */
        int m = (int)(len / 2);
        int32_t *tid = malloc((size_t)(m ? m : 1) * sizeof *tid);
        if (!tid) fz_fail("out of memory");
        int in_range = 1;
        for (int i = 0; i < m; i++) {
            tid[i] = (int32_t)((uint16_t)(data[1 + 2 * i] | data[2 + 2 * i] << 8)) - 16;
            in_range &= tid[i] >= 0 && tid[i] < V;
        }
        char *out = NULL;
        size_t olen = 0;
        rc = ds_tok_decode(g_tok, tid, m, flags & 4, &out, &olen, &err);
        if ((rc == DS_OK) != in_range) fz_fail("decode rc %d with in_range %d", rc, in_range);
        if (rc == DS_OK && strlen(out) > olen) fz_fail("decode length");
        free(out);
        free(tid);
    }
    return 0;
}
