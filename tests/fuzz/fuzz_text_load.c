/* fuzz_text_load.c — libFuzzer target for loading a tokenizer folder (src/text/tokenizer.c):
 * the input is "<tokenizer_config.json>\n--8<-- tiktoken.model\n<tiktoken.model>", written to a
 * folder and loaded with ds_tok_load. A loaded tokenizer must then keep its own promises: every id
 * has bytes, each special name maps back to its id, and a sample text survives encode + decode. */
#include <stdlib.h>

#include "fuzzutil.h"
#include "text/tokenizer.h"

static const char sample[] = "Hello, world! 你好 123 <|im_end|> \n\t  x";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *part[2];
    size_t len[2];
    int n = fz_split(data, size, "\n--8<-- tiktoken.model\n", part, len, 2);
    fz_write("tokenizer_config.json", part[0], len[0]);
    if (n == 2)
        fz_write("tiktoken.model", part[1], len[1]);
    else
        fz_remove("tiktoken.model");
    ds_tokenizer *t = NULL;
    ds_err err;
    err.msg[0] = 0;
    int rc = ds_tok_load(fz_dir(), &t, &err);
    fz_note("tok_load", rc, err.msg);
    if (rc != DS_OK) {
        if (!err.msg[0]) fz_fail("ds_tok_load failed without a message");
        return 0;
    }
    int V = ds_tok_vocab_size(t), R = ds_tok_n_ranks(t);
    if (V != R + DS_TOK_N_SPECIAL) fz_fail("vocab %d != ranks %d + 256", V, R);
    for (int32_t id = 0; id < V; id++) {
        size_t m = 0;
        const char *b = ds_tok_token_bytes(t, id, &m);
        if (!b) fz_fail("id %d has no bytes", id);
        if (id >= R) {
            char *name = fz_strndup((const uint8_t *)b, m);
            if (ds_tok_special_id(t, name) != id) fz_fail("special %d does not map back", id);
            free(name);
        }
    }
    if (ds_tok_token_bytes(t, V, NULL) || ds_tok_token_bytes(t, -1, NULL))
        fz_fail("out-of-range id has bytes");
    for (int special = 0; special < 2; special++) {
        int32_t *ids = NULL;
        int nid = 0;
        /* A vocabulary without every single byte cannot encode everything: that is an error, not
         * a crash. What it does encode must decode to the same bytes. */
        if (ds_tok_encode(t, sample, sizeof sample - 1, special, &ids, &nid, &err) == DS_OK) {
            char *out = NULL;
            size_t olen = 0;
            if (ds_tok_decode(t, ids, nid, 0, &out, &olen, &err) != DS_OK)
                fz_fail("decode of encoded ids failed: %s", err.msg);
            if (olen != sizeof sample - 1 || memcmp(out, sample, olen) != 0)
                fz_fail("encode + decode changed the text");
            free(out);
        }
        free(ids);
    }
    ds_tok_free(t);
    return 0;
}
