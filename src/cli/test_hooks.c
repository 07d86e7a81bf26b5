/* test_hooks.c — see test_hooks.h. The speculation test oracle: invariant 6 must hold at every
 * accepted count from 0 to k, which a real draft reaches only by luck. The oracle knows each
 * prompt's true greedy output (JSON lines {"prompt": [ids], "output": [ids]}) and drafts it right
 * for `want` positions and wrong after, with want cycling 0..k. */
#include "cli/test_hooks.h"

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct oracle_entry {
    int32_t *prompt, *out; /* [n_prompt], [n_out] */
    int n_prompt, n_out;
} oracle_entry;

struct ds_test_oracle {
    oracle_entry *e; /* [n] */
    int n;
    unsigned long calls;
};

static int oracle_drafts(void *ctx, const int32_t *tokens, int n_tokens, int k, int32_t *drafts) {
    ds_test_oracle *o = ctx;
    const oracle_entry *best = NULL;
    for (int i = 0; i < o->n; i++) {
        const oracle_entry *x = &o->e[i];
        if (x->n_prompt <= n_tokens && (!best || x->n_prompt > best->n_prompt) &&
            !memcmp(x->prompt, tokens, (size_t)x->n_prompt * sizeof(int32_t)))
            best = x;
    }
    if (!best) return 0;
    int g = n_tokens - best->n_prompt, want = (int)(o->calls++ % (unsigned long)(k + 1));
    for (int i = 0; i < k; i++) {
        int32_t truth = g + i < best->n_out ? best->out[g + i] : 0;
        drafts[i] = i < want ? truth : truth > 0 ? truth - 1 : truth + 1;
    }
    return k;
}

static int ids_of(json_t *a, int32_t **out, int *n, ds_err *err) {
    if (!json_is_array(a)) return ds_errf(err, "expected a list of token ids");
    *n = (int)json_array_size(a);
    *out = ds_malloc((size_t)(*n ? *n : 1) * sizeof(int32_t), err);
    if (!*out) return DS_ERR;
    for (int i = 0; i < *n; i++) {
        json_t *v = json_array_get(a, (size_t)i);
        if (!json_is_integer(v)) return ds_errf(err, "token id %d is not an integer", i);
        (*out)[i] = (int32_t)json_integer_value(v);
    }
    return DS_OK;
}

static int oracle_load(const char *path, ds_test_oracle *o, ds_err *err) {
    FILE *f = fopen(path, "r");
    if (!f) return ds_errf(err, "%s: %s", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    int rc = DS_OK, lineno = 0;
    while (rc == DS_OK && getline(&line, &cap, f) > 0) {
        lineno++;
        json_error_t je;
        json_t *j = json_loads(line, 0, &je);
        oracle_entry *ne = realloc(o->e, (size_t)(o->n + 1) * sizeof *ne);
        if (!j || !ne) {
            rc = ds_errf(err, "%s:%d: %s", path, lineno, j ? "out of memory" : je.text);
        } else {
            o->e = ne;
            oracle_entry *x = &o->e[o->n];
            memset(x, 0, sizeof *x);
            o->n++;
            if (ids_of(json_object_get(j, "prompt"), &x->prompt, &x->n_prompt, err) ||
                ids_of(json_object_get(j, "output"), &x->out, &x->n_out, err))
                rc = ds_err_prefix(err, "%s:%d", path, lineno);
        }
        json_decref(j);
    }
    free(line);
    fclose(f);
    return rc;
}

int ds_test_flags_table(ds_test_flags *t, ds_arg *out) {
    ds_arg table[DS_TEST_FLAGS_MAX] = {
        DS_TEST_OPT("speculative-test-oracle", DS_ARG_STRING, &t->oracle_path, "FILE",
                    "testing: draft from known greedy outputs (JSON lines {prompt, output} of "
                    "token ids), right for 0..k positions in turn, instead of the method's drafts"),
        DS_TEST_OPT("prefix-hash-bits", DS_ARG_INT, &t->prefix_hash_bits, "N",
                    "testing: the prefix cache keeps N hash bits, forcing collisions (0: all)"),
        DS_TEST_OPT("test-kv-corrupt", DS_ARG_INT, &t->kv_corrupt, "M",
                    "testing: a P/D consumer damages every transfer it pulls: 1 flips a byte, 2 "
                    "cuts it short"),
        DS_TEST_OPT("test-kv-stall-ms", DS_ARG_INT, &t->kv_stall_ms, "MS",
                    "testing: a P/D producer pauses MS between a pull's header and its bytes"),
        DS_TEST_OPT("test-async-masks", DS_ARG_INT, &t->async_masks, "0|1",
                    "testing: constrained decoding's masks made beside the forward, as on a GPU"),
    };
    memcpy(out, table, sizeof table);
    return DS_TEST_FLAGS_MAX;
}

int ds_test_flags_apply(ds_test_flags *t, ds_engine_opts *eo, ds_err *err) {
    if (t->prefix_hash_bits < 0 || t->prefix_hash_bits > 64)
        return ds_errf(err, "--prefix-hash-bits: expected 0..64, got %d", t->prefix_hash_bits);
    eo->test.prefix_hash_bits = t->prefix_hash_bits;
    if (t->kv_corrupt < 0 || t->kv_corrupt > 2)
        return ds_errf(err, "--test-kv-corrupt: expected 0..2, got %d", t->kv_corrupt);
    eo->test.kv_corrupt = t->kv_corrupt;
    if (t->kv_stall_ms < 0) return ds_errf(err, "--test-kv-stall-ms: expected MS >= 0");
    eo->test.kv_stall_ms = t->kv_stall_ms;
    if (t->async_masks < 0 || t->async_masks > 1)
        return ds_errf(err, "--test-async-masks: expected 0 or 1, got %d", t->async_masks);
    eo->test.async_masks = t->async_masks;
    if (!t->oracle_path) return DS_OK;
    t->oracle = ds_calloc(1, sizeof *t->oracle, err);
    if (!t->oracle) return DS_ERR;
    if (oracle_load(t->oracle_path, t->oracle, err))
        return ds_err_prefix(err, "--speculative-test-oracle");
    if (eo->speculative_method == DS_SPEC_NONE) eo->speculative_method = DS_SPEC_NGRAM;
    eo->test.spec_drafts = oracle_drafts;
    eo->test.spec_ctx = t->oracle;
    return DS_OK;
}

void ds_test_flags_free(ds_test_flags *t) {
    ds_test_oracle *o = t->oracle;
    if (!o) return;
    for (int i = 0; i < o->n; i++) {
        free(o->e[i].prompt);
        free(o->e[i].out);
    }
    free(o->e);
    free(o);
    t->oracle = NULL;
}
