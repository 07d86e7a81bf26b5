/* The whole forward pass against the Python reference's golden files (docs/architecture.md
 * invariant 2), and the consistency properties the engine relies on: prefill-then-decode equals one
 * forward (chunked KDA vs recurrent, expanded MLA vs absorbed), chunked prefill equals one-shot
 * prefill, and a sequence's logits do not depend on what else is in the batch (invariant 7). */
#include "golden_io.h"
#include "devtools/init_model.h"
#include "model/model.h"
#include "kernels/shared/kv_row.h"
#include "testutil.h"

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct fixture {
    char *dir;
    ds_model *m;
    ds_kv_pool pool;
    int32_t *table; /* [n_pages] identity block table */
} fixture;

enum { BLOCK = 16, MAX_CTX = 512 };

static char *g_dirs[4];

/* 0, 1: the tiny presets, built by init-model; 2: the bundled trained model in the repository;
 * 3: tiny-k3 with its routed experts in MXFP4 (init-model --experts mxfp4). */
static const char *preset_dir(int which) {
    static const char *names[4] = {"tiny-k3", "tiny-linear", NULL, "tiny-k3"};
    if (which == 2 && !g_dirs[2]) g_dirs[2] = ds_test_src_path("models/gsm-k3");
    if (!g_dirs[which]) {
        char *tmp = ds_test_tmpdir();
        assert_non_null(tmp);
        char *dir = malloc(strlen(tmp) + 32);
        sprintf(dir, "%s/%s", tmp, names[which]);
        free(tmp);
        ds_err err = {{0}};
        if (ds_init_model_ex(names[which], dir, 0, which == 3, &err))
            fail_msg("init-model: %s", err.msg);
        g_dirs[which] = dir;
    }
    return g_dirs[which];
}

static void open_model(fixture *f, int which, const ds_model_opts *opts) {
    ds_err err = {{0}};
    if (ds_model_load(preset_dir(which), opts, &f->m, &err)) fail_msg("load: %s", err.msg);
    int n_pages = MAX_CTX / BLOCK;
    if (ds_kv_pool_init(&f->pool, f->m, 2 * n_pages, BLOCK, &err)) fail_msg("%s", err.msg);
    f->table = malloc(2 * (size_t)n_pages * sizeof(int32_t));
    /* Pages handed out in a scrambled order, as a real pool would after some churn. */
    for (int i = 0; i < 2 * n_pages; i++) f->table[i] = (i * 7 + 3) % (2 * n_pages);
}

static void close_model(fixture *f) {
    ds_kv_pool_free(&f->pool);
    ds_model_free(f->m);
    free(f->table);
}

static float *new_slot(const ds_model *m) {
    return calloc(ds_model_slot_floats(m), sizeof(float));
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* FNV-1a 64 over every *.safetensors file in sorted name order (as write_golden.py computes). */
static uint64_t checkpoint_hash(const char *dir) {
    DIR *d = opendir(dir);
    assert_non_null(d);
    char *names[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < 64) {
        size_t len = strlen(e->d_name);
        if (len > 12 && !strcmp(e->d_name + len - 12, ".safetensors"))
            names[n++] = strdup(e->d_name);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof *names, cmp_name);
    uint64_t h = 0xcbf29ce484222325ull;
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t len;
        ds_err err;
        unsigned char *buf = (unsigned char *)ds_read_file(path, &len, &err);
        assert_non_null(buf);
        for (size_t j = 0; j < len; j++) h = (h ^ buf[j]) * 0x100000001b3ull;
        free(buf);
        free(names[i]);
    }
    return h;
}

/* kv_dtype (DS_KV_*): the golden was written with that --kv-cache-dtype (its meta.kv_cache_dtype
 * says so), and the model runs with that latent cache. */
static void check_golden_opts(int which, const char *golden_rel, int kv_dtype) {
    char *path = ds_test_src_path(golden_rel);
    char errbuf[512];
    ds_golden *g = ds_golden_load(path, errbuf, sizeof errbuf);
    if (!g) fail_msg("%s: %s", path, errbuf);
    int nd;
    const uint64_t *dims;
    const uint64_t *hash = ds_golden_get(g, "meta.checkpoint_fnv1a64", 3, &nd, &dims);
    assert_non_null(hash);
    uint64_t have = checkpoint_hash(preset_dir(which));
    if (have != hash[0])
        fail_msg("%s was written for another checkpoint (fnv %016llx, init-model gives %016llx): "
                 "regenerate it with tools/reference/write_golden.py",
                 path, (unsigned long long)hash[0], (unsigned long long)have);
    const int32_t *ids = ds_golden_get(g, "input_ids", 1, &nd, &dims);
    assert_non_null(ids);
    int T = (int)dims[0];
    const float *ref_logits = ds_golden_get(g, "logits", 0, &nd, &dims);
    assert_non_null(ref_logits);
    /* the formats the reference ran (docs/quantization.md), run here the same way */
    ds_model_opts o;
    ds_model_opts_default(&o);
    char exclude[1024] = "";
    int qnd;
    const uint64_t *qdims;
    const uint64_t *q = ds_golden_get(g, "meta.quantization", 3, &qnd, &qdims);
    if (q && q[0] == 1) {
        o.quantization = DS_QUANT_PTPC_FP8;
        const int32_t *x = ds_golden_get(g, "meta.quantization_exclude", 1, &qnd, &qdims);
        if (x) { /* the list the reference used, so a default drifting on one side shows */
            assert_true(qdims[0] < sizeof exclude);
            for (uint64_t i = 0; i < qdims[0]; i++) exclude[i] = (char)x[i];
            o.quantization_exclude = exclude;
            if (strcmp(exclude, ds_quant_default_exclude))
                fail_msg("%s: written with exclusion list '%s', the default is '%s'", path, exclude,
                         ds_quant_default_exclude);
        }
    }

    int knd;
    const uint64_t *kdims, *kvd = ds_golden_get(g, "meta.kv_cache_dtype", 3, &knd, &kdims);
    assert_int_equal(kvd ? (int)kvd[0] : 0, kv_dtype);

    fixture f;
    o.kv_dtype = kv_dtype;
    open_model(&f, which, &o);
    const ds_config *c = ds_model_config(f.m);
    int V = c->vocab_size, D = c->hidden_size, L = c->num_hidden_layers;
    assert_int_equal((int)dims[1], V);
    float *logits = malloc((size_t)T * V * sizeof(float));
    float *hidden = malloc((size_t)L * T * D * sizeof(float));
    float *final = malloc((size_t)T * D * sizeof(float));
    float *slot = new_slot(f.m);
    ds_seq_batch sb = {ids,   T,    0, slot, f.table, logits, T,   hidden,
                       final, NULL, 0, NULL, NULL,    NULL,   NULL};
    ds_err err = {{0}};
    if (ds_model_forward(f.m, &f.pool, &sb, 1, &err)) fail_msg("%s", err.msg);
    /* Row error of every layer's output, the final hidden and the logits: err[k][t] with k < L
     * the layers, L the final hidden, L+1 the logits. */
    double *err_rows = malloc((size_t)(L + 2) * T * sizeof(double));
    double worst[DS_MAX_LAYERS + 2];
    for (int k = 0; k < L + 2; k++) {
        char name[64];
        snprintf(name, sizeof name, "hidden.%d", k);
        const float *ref = k < L    ? ds_golden_get(g, name, 0, &nd, &dims)
                           : k == L ? ds_golden_get(g, "final_hidden", 0, &nd, &dims)
                                    : ref_logits;
        assert_non_null(ref);
        const float *got = k < L ? hidden + (size_t)k * T * D : k == L ? final : logits;
        const size_t w = k == L + 1 ? (size_t)V : (size_t)D;
        worst[k] = ds_test_rel_err_f(got, ref, (size_t)T * w);
        for (int t = 0; t < T; t++)
            err_rows[(size_t)k * T + t] = ds_test_rel_err_f(got + t * w, ref + t * w, w);
    }
    /* With quantized activations (ptpc_fp8, the FP8 latent cache) an activation within f32
     * rounding of an E4M3 midpoint rounds one way here and the other way in float64: the row
     * then differs by a code step, and later positions inherit it through the KDA state and the
     * attention. So a quantized golden is written with --min-margin (meta.min_margin): its
     * tokens are drawn so that no such decision comes near a boundary, and every row must then
     * match as tightly as BF16 does. */
    int first = T; /* the first row off by more than 1e-4 in any layer */
    for (int k = 0; k < L + 2; k++)
        for (int t = 0; t < first; t++)
            if (!(err_rows[(size_t)k * T + t] <= 1e-4)) first = t;
    int mnd;
    const uint64_t *mdims;
    const double *margin = ds_golden_get(g, "meta.min_margin", 2, &mnd, &mdims);
    if ((o.quantization != DS_QUANT_NONE || kv_dtype == DS_KV_FP8) && !margin)
        fail_msg("%s: a quantized golden must be written with --min-margin", golden_rel);
    print_message("%s: final hidden rel err %.3g, logits rel err %.3g; rows within 1e-4 before "
                  "the first that is not: %d of %d\n",
                  golden_rel, worst[L], worst[L + 1], first, T);
    if (getenv("DS_VERBOSE"))
        for (int k = 0; k < L; k++) print_message("  layer %d: rel err %.3g\n", k, worst[k]);
    for (int k = 0; k < L + 2; k++)
        if (!(worst[k] <= 1e-4))
            fail_msg("%s: %s rel err %.3g > 1e-4", golden_rel,
                     k < L    ? "a layer's hidden"
                     : k == L ? "final hidden"
                              : "logits",
                     worst[k]);
    free(err_rows);
    free(logits);
    free(hidden);
    free(final);
    free(slot);
    close_model(&f);
    ds_golden_free(g);
    free(path);
}

static void check_golden(int which, const char *golden_rel) {
    check_golden_opts(which, golden_rel, 0);
}

static void test_golden_tiny_k3(void **state) {
    (void)state;
    check_golden(0, "tests/golden/tiny-k3.bin");
}

/* The FP8 latent cache (docs/quantization.md, "FP8 latent cache"): the reference quantizes each
 * row as it is written and attends over the dequantized rows, as the engine does. */
static void test_golden_tiny_k3_kvfp8(void **state) {
    (void)state;
    check_golden_opts(0, "tests/golden/tiny-k3-kvfp8.bin", DS_KV_FP8);
}

static void test_golden_tiny_linear(void **state) {
    (void)state;
    check_golden(1, "tests/golden/tiny-linear.bin");
}

/* The formats of docs/quantization.md against the reference's float64 emulation of them: K3's
 * MXFP4 experts, ptpc_fp8 on both presets (the FP8 latent cache: test_golden_tiny_k3_kvfp8). */
static void test_golden_tiny_k3_mxfp4(void **state) {
    (void)state;
    check_golden(3, "tests/golden/tiny-k3-mxfp4.bin");
}

static void test_golden_ptpc(void **state) {
    (void)state;
    check_golden(0, "tests/golden/tiny-k3-ptpc.bin");
    check_golden(1, "tests/golden/tiny-linear-ptpc.bin");
}

/* The trained bundled model (issue 7) on a few-shot GSM prompt: the C engine runs the weights the
 * trainer wrote as the float64 reference does. */
static void test_golden_gsm_k3(void **state) {
    (void)state;
    check_golden(2, "tests/golden/gsm-k3.bin");
}

static void random_ids(int32_t *ids, int n, int V, uint64_t seed) {
    ds_rng r;
    ds_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(ds_rng_next(&r) % (uint64_t)V);
}

/* Logits of every position from one forward over ids[0..n). */
static float *full_logits(fixture *f, const int32_t *ids, int n) {
    int V = ds_model_config(f->m)->vocab_size;
    float *logits = malloc((size_t)n * V * sizeof(float));
    float *slot = new_slot(f->m);
    ds_seq_batch sb = {ids,  n,    0, slot, f->table, logits, n,   NULL,
                       NULL, NULL, 0, NULL, NULL,     NULL,   NULL};
    ds_err err = {{0}};
    if (ds_model_forward(f->m, &f->pool, &sb, 1, &err)) fail_msg("%s", err.msg);
    free(slot);
    return logits;
}

/* Runs ids[0..n) as the given sequence of step lengths, returning the last token's logits. */
static void stepped_logits(fixture *f, const int32_t *ids, const int *steps, int n_steps,
                           float *out) {
    float *slot = new_slot(f->m);
    int pos = 0;
    for (int s = 0; s < n_steps; s++) {
        int last = s == n_steps - 1;
        ds_seq_batch sb = {ids + pos, steps[s], pos,  slot, f->table, last ? out : NULL,
                           last,      NULL,     NULL, NULL, 0,        NULL,
                           NULL,      NULL,     NULL};
        ds_err err = {{0}};
        if (ds_model_forward(f->m, &f->pool, &sb, 1, &err)) fail_msg("%s", err.msg);
        pos += steps[s];
    }
    free(slot);
}

/* Prefill N then decode token N+1 == one forward over N+1 tokens, for N on and around the KDA
 * chunk (64) and the thresholds where the forward switches algorithms (16, 32). */
static void check_prefill_decode(int which) {
    fixture f;
    open_model(&f, which, NULL);
    int V = ds_model_config(f.m)->vocab_size;
    enum { NMAX = 200 };
    int32_t ids[NMAX];
    random_ids(ids, NMAX, V, 42 + (uint64_t)which);
    float *ref = full_logits(&f, ids, NMAX);
    float *out = malloc((size_t)V * sizeof(float));
    int Ns[] = {1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 199};
    for (size_t i = 0; i < DS_ARRAY_LEN(Ns); i++) {
        int N = Ns[i];
        int steps[2] = {N, 1};
        stepped_logits(&f, ids, steps, 2, out);
        double e = ds_test_rel_err_f(out, ref + (size_t)N * V, (size_t)V);
        if (!(e <= 1e-4)) fail_msg("preset %d: prefill %d + decode 1: rel err %.3g", which, N, e);
    }
    /* A prompt fed in uneven chunks, then several single decode steps. */
    int steps[] = {37, 64, 1, 50, 1, 1, 46};
    stepped_logits(&f, ids, steps, (int)DS_ARRAY_LEN(steps), out);
    double e = ds_test_rel_err_f(out, ref + (size_t)(NMAX - 1) * V, (size_t)V);
    if (!(e <= 1e-4)) fail_msg("preset %d: chunked prefill: rel err %.3g", which, e);
    free(out);
    free(ref);
    close_model(&f);
}

static void test_prefill_decode_k3(void **state) {
    (void)state;
    check_prefill_decode(0);
}

static void test_prefill_decode_linear(void **state) {
    (void)state;
    check_prefill_decode(1);
}

/* Greedy tokens picked beside the logits (ds_seq_batch.argmax): one step of two segments, the
 * first asking for its last 3 rows' logits and tokens, the second for its last 2 rows' tokens
 * alone; each token is ds_argmax of the row a step asking for logits only returns, and the logits
 * asked for alongside are those rows, bit for bit. (On a GPU the tokens come from a kernel and
 * the second segment's rows never reach the host.) */
static void test_greedy_picks(void **state) {
    (void)state;
    fixture f;
    open_model(&f, 2, NULL);
    const ds_config *c = ds_model_config(f.m);
    int V = c->vocab_size, n_pages = MAX_CTX / BLOCK;
    int32_t a[30], b[45];
    random_ids(a, 30, V, 21);
    random_ids(b, 45, V, 22);
    float *ref = malloc((size_t)5 * V * sizeof(float)); /* [3 + 2][V] */
    float *got = malloc((size_t)3 * V * sizeof(float)); /* [3][V] */
    int32_t picks[5] = {-1, -1, -1, -1, -1};
    float *sa = new_slot(f.m), *sb_slot = new_slot(f.m);
    ds_err err = {{0}};
    ds_seq_batch r[2] = {
        {a, 30, 0, sa, f.table, ref, 3, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL},
        {b, 45, 0, sb_slot, f.table + n_pages, ref + (size_t)3 * V, 2, NULL, NULL, NULL, 0, NULL,
         NULL, NULL, NULL}};
    if (ds_model_forward(f.m, &f.pool, r, 2, &err)) fail_msg("%s", err.msg);
    memset(sa, 0, ds_model_slot_floats(f.m) * sizeof(float));
    memset(sb_slot, 0, ds_model_slot_floats(f.m) * sizeof(float));
    ds_seq_batch g[2] = {
        {a, 30, 0, sa, f.table, got, 3, NULL, NULL, NULL, 0, NULL, NULL, picks, NULL},
        {b, 45, 0, sb_slot, f.table + n_pages, NULL, 2, NULL, NULL, NULL, 0, NULL, NULL, picks + 3,
         NULL}};
    if (ds_model_forward(f.m, &f.pool, g, 2, &err)) fail_msg("%s", err.msg);
    assert_memory_equal(got, ref, (size_t)3 * V * sizeof(float));
    for (int i = 0; i < 5; i++) assert_int_equal(picks[i], ds_argmax(ref + (size_t)i * V, V));
    free(sa);
    free(sb_slot);
    free(ref);
    free(got);
    close_model(&f);
}

/* Invariant 7: a sequence's logits are bit-identical alone and inside a batch. */
static void test_batch_invariance(void **state) {
    (void)state;
    fixture f;
    open_model(&f, 0, NULL);
    const ds_config *c = ds_model_config(f.m);
    int V = c->vocab_size, n_pages = MAX_CTX / BLOCK;
    int32_t a[40], b[70];
    random_ids(a, 40, V, 7);
    random_ids(b, 70, V, 8);
    float *alone = malloc((size_t)2 * V * sizeof(float));
    float *batched = malloc((size_t)2 * V * sizeof(float));
    float *sa = new_slot(f.m), *sb_slot = new_slot(f.m);
    ds_err err = {{0}};
    /* alone: prefill 39, decode 1 */
    ds_seq_batch s1 = {a, 39, 0, sa, f.table, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL};
    if (ds_model_forward(f.m, &f.pool, &s1, 1, &err)) fail_msg("%s", err.msg);
    ds_seq_batch s2 = {a + 39, 1,    39, sa,   f.table, alone, 1,   NULL,
                       NULL,   NULL, 0,  NULL, NULL,    NULL,  NULL};
    if (ds_model_forward(f.m, &f.pool, &s2, 1, &err)) fail_msg("%s", err.msg);
    /* batched: same steps, with another sequence's prefill alongside each */
    memset(sa, 0, ds_model_slot_floats(f.m) * sizeof(float));
    ds_seq_batch p1[2] = {
        {b, 50, 0, sb_slot, f.table + n_pages, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL,
         NULL},
        {a, 39, 0, sa, f.table, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL}};
    if (ds_model_forward(f.m, &f.pool, p1, 2, &err)) fail_msg("%s", err.msg);
    ds_seq_batch p2[2] = {
        {b + 50, 20, 50, sb_slot, f.table + n_pages, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL,
         NULL},
        {a + 39, 1, 39, sa, f.table, batched, 1, NULL, NULL, NULL, 0, NULL, NULL, NULL, NULL}};
    if (ds_model_forward(f.m, &f.pool, p2, 2, &err)) fail_msg("%s", err.msg);
    assert_memory_equal(alone, batched, (size_t)V * sizeof(float));
    free(alone);
    free(batched);
    free(sa);
    free(sb_slot);
    close_model(&f);
}

/* Speculative verify with per-token state rows: for every accepted count a in 0..k, rolling the
 * KDA slot back to row a and truncating the latent rows gives the same greedy continuation as
 * plain one-token decoding (docs/architecture.md invariant 6, at the model level). */
static void test_spec_rollback(void **state) {
    (void)state;
    fixture f;
    open_model(&f, 0, NULL);
    const ds_config *c = ds_model_config(f.m);
    int V = c->vocab_size;
    enum { P = 30, G = 40, K = 4 };
    int32_t seq[P + G + K + 2];
    random_ids(seq, P, V, 99);
    size_t slot_n = ds_model_slot_floats(f.m);
    float *logits = malloc((size_t)(K + 1) * V * sizeof(float));
    /* plain greedy: G tokens */
    int32_t plain[G];
    float *slot = new_slot(f.m);
    ds_err err = {{0}};
    ds_seq_batch sb = {seq,  P,    0, slot, f.table, logits, 1,   NULL,
                       NULL, NULL, 0, NULL, NULL,    NULL,   NULL};
    if (ds_model_forward(f.m, &f.pool, &sb, 1, &err)) fail_msg("%s", err.msg);
    int32_t ctx[P + G];
    memcpy(ctx, seq, P * sizeof(int32_t));
    for (int g = 0; g < G; g++) {
        plain[g] = ds_argmax(logits, V);
        ctx[P + g] = plain[g];
        ds_seq_batch d = {ctx + P + g, 1,    P + g, slot, f.table, logits, 1,   NULL,
                          NULL,        NULL, 0,     NULL, NULL,    NULL,   NULL};
        if (ds_model_forward(f.m, &f.pool, &d, 1, &err)) fail_msg("%s", err.msg);
    }
    /* speculative: drafts are the true continuation for `want` positions, then wrong tokens */
    memset(slot, 0, slot_n * sizeof(float));
    sb.slot = slot;
    if (ds_model_forward(f.m, &f.pool, &sb, 1, &err)) fail_msg("%s", err.msg);
    float *rows = malloc((size_t)(K + 1) * slot_n * sizeof(float));
    int32_t out[G + K + 1];
    int n_out = 0, pos = P, round = 0;
    int32_t x0 = ds_argmax(logits, V);
    out[n_out++] = x0;
    int seen[K + 1] = {0};
    while (n_out < G) {
        int want = round++ % (K + 1);
        int32_t win[K + 1];
        win[0] = x0;
        for (int i = 1; i <= K; i++) {
            int idx = n_out - 1 + i; /* index in plain[] of the token at this draft slot */
            int32_t truth = idx < G ? plain[idx] : 0;
            win[i] = i <= want ? truth : (truth + 1 + i) % V;
        }
        ds_seq_batch v = {win,  K + 1, pos, slot, f.table, logits, K + 1, NULL,
                          NULL, NULL,  0,   NULL, rows,    NULL,   NULL};
        if (ds_model_forward(f.m, &f.pool, &v, 1, &err)) fail_msg("%s", err.msg);
        int a = 0;
        while (a < K && win[a + 1] == ds_argmax(logits + (size_t)a * V, V)) a++;
        seen[a]++;
        for (int i = 1; i <= a && n_out < G; i++) out[n_out++] = win[i];
        int32_t bonus = ds_argmax(logits + (size_t)a * V, V);
        if (n_out < G) out[n_out++] = bonus;
        memcpy(slot, rows + (size_t)a * slot_n, slot_n * sizeof(float));
        pos += a + 1;
        x0 = bonus;
    }
    assert_memory_equal(out, plain, G * sizeof(int32_t));
    for (int a = 0; a <= K; a++)
        if (!seen[a]) fail_msg("accepted count %d never happened", a);
    free(rows);
    free(logits);
    free(slot);
    close_model(&f);
}

static void test_bad_tokens(void **state) {
    (void)state;
    fixture f;
    open_model(&f, 1, NULL);
    float *slot = new_slot(f.m);
    int32_t ids[2] = {5, 1 << 20};
    ds_seq_batch sb = {ids,  2,    0, slot, f.table, NULL, 0,   NULL,
                       NULL, NULL, 0, NULL, NULL,    NULL, NULL};
    ds_err err = {{0}};
    assert_int_equal(ds_model_forward(f.m, &f.pool, &sb, 1, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "1048576"));
    free(slot);
    close_model(&f);
}

/* Logits of 12 fixed tokens' last position for the model in dir (opts may be NULL). */
static void last_logits(const char *dir, const ds_model_opts *opts, float *out, ds_err *err,
                        int *rc) {
    fixture f = {0};
    *rc = ds_model_load(dir, opts, &f.m, err);
    if (*rc) return;
    if (ds_kv_pool_init(&f.pool, f.m, 4, BLOCK, err)) fail_msg("%s", err->msg);
    int32_t table[4] = {2, 0, 3, 1};
    float *slot = new_slot(f.m);
    int32_t ids[12] = {1, 5, 9, 100, 7, 7, 300, 2, 11, 64, 65, 800};
    ds_seq_batch sb = {ids,  12,   0, slot, table, out,  1,   NULL,
                       NULL, NULL, 0, NULL, NULL,  NULL, NULL};
    if (ds_model_forward(f.m, &f.pool, &sb, 1, err)) fail_msg("%s", err->msg);
    free(slot);
    ds_kv_pool_free(&f.pool);
    ds_model_free(f.m);
}

/* --load-format random: a folder with only config.json loads; the weights are drawn from the
 * seed (the same seed gives the same logits, another seed others, and neither gives the trained
 * checkpoint's); without random the missing weights are an error that says so. */
static void test_random_weights(void **state) {
    (void)state;
    const char *real = preset_dir(0);
    char *dir = ds_test_tmpdir(); /* config.json only */
    assert_int_equal(ds_test_copy_config(real, dir), 0);
    ds_err err = {{0}};
    int V = 1024, rc;
    float *a = malloc(V * sizeof(float)), *b = malloc(V * sizeof(float));
    float *c = malloc(V * sizeof(float)), *t = malloc(V * sizeof(float));
    last_logits(dir, NULL, a, &err, &rc);
    assert_int_equal(rc, DS_ERR);
    assert_non_null(strstr(err.msg, "safetensors"));
    ds_model_opts o;
    ds_model_opts_default(&o);
    o.load_random = 1;
    last_logits(dir, &o, a, &err, &rc);
    assert_int_equal(rc, DS_OK);
    last_logits(dir, &o, b, &err, &rc);
    assert_int_equal(rc, DS_OK);
    assert_memory_equal(a, b, V * sizeof(float));
    /* the values the CPU draws, on whichever device (DS_DEVICE=cuda: drawn in GPU memory) */
    ds_model_opts oc = o;
    oc.device = DS_DEVICE_CPU;
    last_logits(dir, &oc, c, &err, &rc);
    assert_int_equal(rc, DS_OK);
    double rel = ds_test_rel_err_f(a, c, (size_t)V);
    if (rel > 1e-4) fail_msg("random weights: device vs CPU relative error %.3g", rel);
    o.random_seed = 7;
    last_logits(dir, &o, c, &err, &rc);
    last_logits(real, NULL, t, &err, &rc);
    assert_int_equal(rc, DS_OK);
    double spread = 0, d_seed = 0, d_real = 0;
    for (int i = 0; i < V; i++) {
        assert_true(isfinite(a[i]));
        spread += fabs(a[i] - a[0]);
        d_seed += fabs(a[i] - c[i]);
        d_real += fabs(a[i] - t[i]);
    }
    assert_true(spread > 1e-3 * V); /* not a constant row */
    assert_true(d_seed > 1e-3 * V);
    assert_true(d_real > 1e-3 * V);
    free(a), free(b), free(c), free(t);
    free(dir);
}

/* What a decode step must read besides its matrices, against the checkpoint's own list: every
 * vector it ships (norms, convs, A_log, dt_bias, the router's bias; an AttnRes norm and its [1, D]
 * projection become one vector), one sequence's KDA state and its MLA rows at the context. */
static void test_decode_bytes(void **state) {
    (void)state;
    for (int which = 0; which < 2; which++) {
        const char *dir = preset_dir(which);
        ds_err err = {{0}};
        ds_st *st;
        if (ds_st_open_dir(dir, &st, &err)) fail_msg("%s", err.msg);
        double vec = 0;
        for (int i = 0; i < ds_st_count(st); i++) {
            const ds_tensor *t = ds_st_at(st, i);
            const char *n = t->name;
            if (strstr(n, "res_proj")) continue; /* folded into its norm */
            if (t->ndim == 1 || strstr(n, "conv1d") || strstr(n, "A_log") || strstr(n, "dt_bias"))
                vec += (double)t->numel;
        }
        ds_st_close(st);
        fixture f;
        open_model(&f, which, NULL);
        const ds_config *c = ds_model_config(f.m);
        const int n_kda = c->num_kda_layers, n_mla = c->num_mla_layers;
        const double P = (double)c->kda_num_heads * c->kda_head_dim;
        const double kda = n_kda * (3.0 * (c->short_conv_kernel_size - 1) * P +
                                    (double)c->kda_num_heads * c->kda_head_dim * c->kda_head_dim);
        const double row = (double)c->kv_lora_rank + c->qk_rope_head_dim;
        assert_true(vec > 0 && n_kda > 0 && n_mla > 0);
        assert_float_equal(ds_model_decode_state_bytes(f.m, 0), 4.0 * (vec + kda), 0.5);
        assert_float_equal(ds_model_decode_state_bytes(f.m, 100),
                           4.0 * (vec + kda + 100.0 * n_mla * row), 0.5);
        close_model(&f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_tiny_k3),       cmocka_unit_test(test_golden_tiny_linear),
        cmocka_unit_test(test_golden_tiny_k3_mxfp4), cmocka_unit_test(test_golden_tiny_k3_kvfp8),
        cmocka_unit_test(test_golden_ptpc),          cmocka_unit_test(test_golden_gsm_k3),
        cmocka_unit_test(test_prefill_decode_k3),    cmocka_unit_test(test_prefill_decode_linear),
        cmocka_unit_test(test_batch_invariance),     cmocka_unit_test(test_spec_rollback),
        cmocka_unit_test(test_bad_tokens),           cmocka_unit_test(test_random_weights),
        cmocka_unit_test(test_greedy_picks),         cmocka_unit_test(test_decode_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
