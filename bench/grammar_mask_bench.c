/* grammar_mask_bench.c — what constrained decoding adds to a CPU decode step at batch B: for B
 * outputs each following a JSON schema (one of tests/e2e/test_structured.py's kind, every
 * output its own matcher), per step the mask of every row (llguidance), the mask applied to a
 * [V] row of logits (ds_sample_mask_bits) and the chosen token committed; beside it, the
 * sampler's own cost for the same B rows (ds_sample_token at temperature 1), which a sampled
 * request pays anyway. The tokenizer is a byte-level BPE of N_RANKS tokens trained by
 * ds_tok_write_files (the real K3 vocabulary is 163,840; the largest trainable here is 65,536).
 * Rows run one after another on one thread, as a worst case (the engine samples rows on
 * several threads); times are this thread's CPU time. Not part of the build; from a build folder (e.g. build-h):
 *   gcc -O2 -fopenmp -I../src ../bench/grammar_mask_bench.c -o gbench libds_text.a \
 *       libds_sample.a libds_kern.a libds_io.a libds_base.a -lpcre2-8 -ljansson -ldl -lm -lpthread
 *   ./gbench N_RANKS B STEPS        e.g. ./gbench 65536 32 64
 * Prints ms per step for the grammar part and for sampling, and how many rows were constrained
 * (a row whose output is complete restarts a fresh matcher, so every row stays constrained). */
#include "sample/sampler.h"
#include "text/grammar.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* this thread's CPU time: what a loaded machine (the 2 shared cores here) still measures */
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static const char k_rf[] =
    "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"b\",\"schema\":{\"type\":\"object\","
    "\"properties\":{\"items\":{\"type\":\"array\",\"maxItems\":4,\"items\":{\"type\":\"object\","
    "\"properties\":{\"id\":{\"type\":\"integer\",\"minimum\":0,\"maximum\":9999},\"note\":{"
    "\"type\":\"string\",\"maxLength\":24},\"kind\":{\"enum\":[\"alpha\",\"beta\",\"gamma\"]}},"
    "\"required\":[\"id\",\"note\",\"kind\"],\"additionalProperties\":false}},\"ok\":{\"type\":"
    "\"boolean\"}},\"required\":[\"items\",\"ok\"],\"additionalProperties\":false}}}";

int main(int argc, char **argv) {
    int n_ranks = argc > 1 ? atoi(argv[1]) : 65536, B = argc > 2 ? atoi(argv[2]) : 32;
    int steps = argc > 3 ? atoi(argv[3]) : 64;
    ds_err err = {{0}};
    char dir[] = "/tmp/gbench-XXXXXX";
    ds_tokenizer *t = NULL;
    ds_grammars *g = NULL;
    double t0 = now();
    if (!mkdtemp(dir) || ds_tok_write_files(dir, n_ranks, DS_CHAT_K3, &err) ||
        ds_tok_load(dir, &t, &err)) {
        fprintf(stderr, "tokenizer: %s\n", err.msg);
        return 1;
    }
    double t_tok = now() - t0;
    t0 = now();
    if (ds_grammars_new(t, ds_tok_eos_id(t), 8, &g, &err)) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double t_llg = now() - t0;
    int V = ds_tok_vocab_size(t), W = ds_grammars_mask_words(g);
    ds_grammar_ctx c = {t, DS_CHAT_K3, 0, 0, 0};
    char *lark = NULL;
    if (ds_grammar_from_response_format(&c, k_rf, &lark, &err)) return fprintf(stderr, "%s\n", err.msg), 1;
    t0 = now();
    ds_matcher **m = calloc((size_t)B, sizeof *m);
    for (int b = 0; b < B; b++)
        if (ds_matcher_new(g, lark, &m[b], &err)) return fprintf(stderr, "%s\n", err.msg), 1;
    double t_new = (now() - t0) / B;
    float *logits = malloc((size_t)V * sizeof(float)); /* [V] one row, refilled per row */
    float *row = malloc((size_t)V * sizeof(float));    /* [V] */
    uint32_t *mask = malloc((size_t)W * 4);            /* [W] */
    ds_rng rng;
    ds_rng_seed(&rng, 1);
    for (int i = 0; i < V; i++) logits[i] = (float)(ds_rng_uniform(&rng) * 4.0 - 2.0);
    ds_sample_scratch *sc = ds_sample_scratch_new(V, &err);
    ds_sample_params sp;
    ds_sample_params_default(&sp);
    double t_mask = 0, t_apply = 0, t_commit = 0, t_sample = 0;
    long restarts = 0;
    for (int s = 0; s < steps; s++)
        for (int b = 0; b < B; b++) {
            memcpy(row, logits, (size_t)V * sizeof(float));
            double a = now();
            if (ds_matcher_mask(m[b], mask, &err)) return fprintf(stderr, "%s\n", err.msg), 1;
            double bb = now();
            ds_sample_mask_bits(row, V, mask, V);
            double cc = now();
            int32_t tok = ds_sample_token(row, V, &sp, NULL, 1, NULL, 0, &rng, sc, NULL, 0);
            double d = now();
            if (ds_matcher_consume(m[b], tok, &err)) return fprintf(stderr, "%s\n", err.msg), 1;
            double e = now();
            t_mask += bb - a, t_apply += cc - bb, t_sample += d - cc, t_commit += e - d;
            if (ds_matcher_done(m[b])) { /* complete: a fresh output on this row */
                ds_matcher_free(m[b]);
                if (ds_matcher_new(g, lark, &m[b], &err)) return 1;
                restarts++;
            }
        }
    printf("V %d, batch %d, %d steps; tokenizer trained in %.1f s, llguidance tokenizer %.0f ms, "
           "matcher clone %.0f us\n",
           V, B, steps, t_tok, t_llg * 1e3, t_new * 1e6);
    printf("per step (all %d rows, one thread): mask %.3f ms, apply %.3f ms, commit %.3f ms = "
           "grammar %.3f ms; sampling %.3f ms; %ld outputs completed\n",
           B, t_mask / steps * 1e3, t_apply / steps * 1e3, t_commit / steps * 1e3,
           (t_mask + t_apply + t_commit) / steps * 1e3, t_sample / steps * 1e3, restarts);
    for (int b = 0; b < B; b++) ds_matcher_free(m[b]);
    free(m), free(logits), free(row), free(mask), free(lark);
    ds_sample_scratch_free(sc);
    ds_grammars_free(g);
    ds_tok_free(t);
    return 0;
}
