/* The DSpark draft (docs/model.md §8) against the float64 reference's golden
 * (tools/reference/write_draft_golden.py -> tests/golden/tiny-k3-draft.bin), and the properties the
 * engine relies on: context rows do not depend on how the target's steps were cut, proposals do
 * not depend on the cache's paging, YaRN follows §8.6 for the tiny and the published K3 configs,
 * and drafts that do not fit their target are refused. */
#include "golden_io.h"
#include "base/devmem.h"
#include "model/draft.h"
#include "devtools/init_model.h"
#include "testutil.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { MAX_BLOCK = 8, MAX_CTX = 128 };

static char *g_dir;       /* tiny-k3 target; its draft in g_dir/draft */
static ds_golden *g_gold; /* tests/golden/tiny-k3-draft.bin */

/* ---- fixture -----------------------------------------------------------------------------------
 */

static uint64_t hash_folder(uint64_t h, const char *dir) {
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
    for (int i = 0; i < n; i++) /* strcmp order, as Python's sorted() of ASCII names */
        for (int j = i + 1; j < n; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t len;
        ds_err err;
        void *buf = ds_read_file(path, &len, &err);
        assert_non_null(buf);
        h = ds_fnv1a64_update(h, buf, len);
        free(buf);
        free(names[i]);
    }
    return h;
}

static int setup(void **state) {
    (void)state;
    char *tmp = ds_test_tmpdir();
    if (!tmp) return -1;
    g_dir = malloc(strlen(tmp) + 16);
    sprintf(g_dir, "%s/tiny-k3", tmp);
    free(tmp);
    ds_err err = {{0}};
    if (ds_init_model("tiny-k3", g_dir, 0, &err)) {
        fprintf(stderr, "init-model: %s\n", err.msg);
        return -1;
    }
    char *path = ds_test_src_path("tests/golden/tiny-k3-draft.bin");
    char eb[512];
    g_gold = ds_golden_load(path, eb, sizeof eb);
    if (!g_gold) fprintf(stderr, "%s: %s\n", path, eb);
    free(path);
    return g_gold ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    ds_golden_free(g_gold);
    free(g_dir);
    return 0;
}

static const void *gold(const char *name, int dtype, const uint64_t **dims) {
    int nd;
    const void *p = ds_golden_get(g_gold, name, dtype, &nd, dims);
    if (!p) fail_msg("golden has no entry %s of dtype %d", name, dtype);
    return p;
}

typedef struct fx {
    ds_model *m;
    ds_draft *d;
    ds_kv_pool pool;
    int32_t table[MAX_CTX]; /* scrambled page order, as a pool hands pages out after churn */
} fx;

static void open_fx(fx *f, int block) {
    ds_err err = {{0}};
    if (ds_model_load(g_dir, NULL, &f->m, &err)) fail_msg("target: %s", err.msg);
    char dd[4096];
    snprintf(dd, sizeof dd, "%s/draft", g_dir);
    if (ds_draft_load(dd, f->m, &f->d, &err)) fail_msg("draft: %s", err.msg);
    int n_pages = MAX_CTX / block;
    if (ds_kv_pool_init(&f->pool, f->m, n_pages, block, &err)) fail_msg("%s", err.msg);
    for (int i = 0; i < n_pages; i++) f->table[i] = (i * 7 + 3) % n_pages; /* n_pages: 2^k */
}

static void close_fx(fx *f) {
    ds_kv_pool_free(&f->pool);
    ds_draft_free(f->d);
    ds_model_free(f->m);
}

/* Runs the target over ids[0..n) in steps of the given lengths, writing the draft context of every
 * step from that step's taps, as the engine does for prefill chunks and verify passes. last_logits
 * [V] (or NULL) receives the logits of the last token. */
static void run_context(fx *f, ds_draft_cache *c, const int32_t *ids, const int *steps, int n_steps,
                        float *all_taps, float *last_logits) {
    const ds_config *tc = ds_model_config(f->m);
    int D = tc->hidden_size, nt = ds_draft_n_taps(f->d);
    float *slot = calloc(ds_model_slot_floats(f->m) + 1, sizeof(float));
    int pos = 0, total = 0;
    for (int s = 0; s < n_steps; s++) total += steps[s];
    for (int s = 0; s < n_steps; s++) {
        int n = steps[s], last = s == n_steps - 1 && last_logits;
        float *taps = malloc((size_t)nt * n * D * sizeof(float)); /* [n_taps][n][D] */
        ds_seq_batch sb = {ids + pos, n,    pos,  slot, f->table, last ? last_logits : NULL,
                           last,      NULL, NULL, NULL, 0,        NULL,
                           NULL,      NULL, NULL};
        sb.tap_layers = ds_draft_tap_layers(f->d);
        sb.n_taps = nt;
        sb.taps = taps;
        ds_err err = {{0}};
        if (ds_model_forward(f->m, &f->pool, &sb, 1, &err)) fail_msg("forward: %s", err.msg);
        if (ds_draft_write_context(f->d, c, f->table, pos, n, taps, &err))
            fail_msg("write_context: %s", err.msg);
        if (all_taps) /* gather into [n_taps][total][D] */
            for (int j = 0; j < nt; j++)
                memcpy(all_taps + ((size_t)j * total + pos) * D, taps + (size_t)j * n * D,
                       (size_t)n * D * sizeof(float));
        free(taps);
        pos += n;
    }
    free(slot);
}

/* Layer l of a draft cache in host memory (a copy: the cache is device memory when the target
 * runs on a GPU, which the draft then runs beside); free() it. */
static float *cache_layer(const ds_draft_cache *c, int l) {
    size_t n = (size_t)(c->n_pages + c->n_spare) * c->block_size * c->row;
    float *h = malloc(n * sizeof(float));
    assert_non_null(h);
    ds_dmem_copy(c->dm, h, c->layer[l], n * sizeof(float));
    return h;
}

static void check_rel(const char *what, const float *a, const float *ref, size_t n, double tol) {
    double e = ds_test_rel_err_f(a, ref, n);
    if (getenv("DS_VERBOSE")) print_message("%s: rel err %.3g\n", what, e);
    if (!(e <= tol)) fail_msg("%s: rel err %.3g > %.3g", what, e, tol);
}

/* ---- golden ------------------------------------------------------------------------------------
 */

static void test_golden(void **state) {
    (void)state;
    const uint64_t *dims;
    const uint64_t *hash = gold("meta.checkpoint_fnv1a64", DS_GOLDEN_U64, &dims);
    char dd[4096];
    snprintf(dd, sizeof dd, "%s/draft", g_dir);
    uint64_t have = hash_folder(hash_folder(DS_FNV1A64_INIT, g_dir), dd);
    if (have != hash[0])
        fail_msg("tiny-k3-draft.bin was written for another checkpoint (fnv %016llx, init-model "
                 "gives %016llx): regenerate it with tools/reference/write_draft_golden.py",
                 (unsigned long long)hash[0], (unsigned long long)have);
    const int32_t *ids = gold("input_ids", DS_GOLDEN_I32, &dims);
    int n = (int)dims[0];
    int32_t anchor = *(const int32_t *)gold("anchor", DS_GOLDEN_I32, &dims);

    fx f;
    open_fx(&f, 16);
    const ds_config *tc = ds_model_config(f.m);
    const ds_draft_config *dc = ds_draft_config_of(f.d);
    int D = tc->hidden_size, V = tc->vocab_size, nt = ds_draft_n_taps(f.d);
    int row = dc->kv_lora_rank + dc->qk_rope_head_dim;
    const int32_t *gl = gold("tap_layers", DS_GOLDEN_I32, &dims);
    assert_int_equal((int)dims[0], nt);
    for (int j = 0; j < nt; j++) assert_int_equal(ds_draft_tap_layers(f.d)[j], gl[j]);

    /* Target taps, then the context rows and every layer's cache rows. */
    ds_draft_cache c;
    ds_err err = {{0}};
    if (ds_draft_cache_init(&c, f.d, MAX_CTX / 16, 16, MAX_BLOCK, &err)) fail_msg("%s", err.msg);
    float *taps = malloc((size_t)nt * n * D * sizeof(float));
    float *logits = malloc((size_t)V * sizeof(float));
    run_context(&f, &c, ids, &n, 1, taps, logits);
    check_rel("taps", taps, gold("taps", DS_GOLDEN_F32, &dims), (size_t)nt * n * D, 1e-4);
    assert_int_equal(ds_argmax(logits, V), anchor);
    float *ctx = malloc((size_t)n * D * sizeof(float));
    if (ds_draft_context(f.d, n, taps, ctx, &err)) fail_msg("%s", err.msg);
    check_rel("ctx", ctx, gold("ctx", DS_GOLDEN_F32, &dims), (size_t)n * D, 1e-4);
    float *rows = malloc((size_t)n * row * sizeof(float));
    for (int l = 0; l < dc->num_hidden_layers; l++) {
        float *lay = cache_layer(&c, l);
        ds_latent_view v = {lay, f.table, 16, row, 0, 0};
        for (int t = 0; t < n; t++)
            memcpy(rows + (size_t)t * row, ds_latent_row(&v, t), (size_t)row * sizeof(float));
        free(lay);
        char name[32];
        snprintf(name, sizeof name, "latent.%d", l);
        check_rel(name, rows, gold(name, DS_GOLDEN_F32, &dims), (size_t)n * row, 1e-4);
    }

    /* Block logits and drafts: T = 4 and 7 after the anchor, and T = 7 after another anchor whose
     * walk a broken Markov chain would get wrong (see the writer's printed check). */
    struct {
        const char *pre;
        int32_t x0;
        int T;
    } cases[3] = {{"", anchor, 4}, {"", anchor, 7}, {"alt.", 0, 7}};
    cases[2].x0 = *(const int32_t *)gold("alt.anchor", DS_GOLDEN_I32, &dims);
    float *U = malloc((size_t)MAX_BLOCK * V * sizeof(float));
    for (int k = 0; k < 3; k++) {
        int T = cases[k].T;
        int32_t drafts[MAX_BLOCK];
        if (ds_draft_propose(f.d, &c, f.table, n - 1, cases[k].x0, T, drafts, U, &err))
            fail_msg("propose: %s", err.msg);
        char name[64];
        snprintf(name, sizeof name, "%sblock_logits.T%d", cases[k].pre, T);
        const float *ref = gold(name, DS_GOLDEN_F32, &dims);
        assert_int_equal((int)dims[0], T);
        check_rel(name, U, ref, (size_t)T * V, 1e-4);
        snprintf(name, sizeof name, "%sdrafts.T%d", cases[k].pre, T);
        const int32_t *rd = gold(name, DS_GOLDEN_I32, &dims);
        for (int t = 0; t < T; t++)
            if (drafts[t] != rd[t])
                fail_msg("%s[%d]: engine %d, reference %d", name, t, drafts[t], rd[t]);
        /* Without block_logits the same drafts come out (U then lives in scratch). */
        int32_t again[MAX_BLOCK];
        if (ds_draft_propose(f.d, &c, f.table, n - 1, cases[k].x0, T, again, NULL, &err))
            fail_msg("propose: %s", err.msg);
        assert_memory_equal(again, drafts, (size_t)T * sizeof(int32_t));
    }
    free(U);
    free(rows);
    free(ctx);
    free(logits);
    free(taps);
    ds_draft_cache_free(&c);
    close_fx(&f);
}

/* ---- invariants --------------------------------------------------------------------------------
 */

/* Context written in pieces equals context written at once. Draft alone: the same taps handed
 * over in two calls (prefill chunk, then the rest) give the same cache rows up to fp32 rounding.
 * Whole pipeline: the target run as prefill 13 + steps 5, 1, 21 (chunked vs recurrent KDA,
 * expanded vs absorbed MLA) gives context rows within the golden tolerance of one prefill — the
 * docs/model.md §12 invariant "ctx row identical whether produced by prefill or by a verify pass".
 */
static void test_context_chunks(void **state) {
    (void)state;
    const uint64_t *dims;
    const int32_t *ids = gold("input_ids", DS_GOLDEN_I32, &dims);
    int n = (int)dims[0];
    fx f;
    open_fx(&f, 16);
    const ds_draft_config *dc = ds_draft_config_of(f.d);
    int row = dc->kv_lora_rank + dc->qk_rope_head_dim, L = dc->num_hidden_layers;
    int nt = ds_draft_n_taps(f.d), D = dc->target_hidden_size;
    size_t per_layer = (size_t)(MAX_CTX / 16) * 16 * row;
    ds_draft_cache one, two, steps;
    ds_err err = {{0}};
    if (ds_draft_cache_init(&one, f.d, MAX_CTX / 16, 16, MAX_BLOCK, &err) ||
        ds_draft_cache_init(&two, f.d, MAX_CTX / 16, 16, MAX_BLOCK, &err) ||
        ds_draft_cache_init(&steps, f.d, MAX_CTX / 16, 16, MAX_BLOCK, &err))
        fail_msg("%s", err.msg);
    float *taps = malloc((size_t)nt * n * D * sizeof(float)); /* [n_taps][n][D] */
    run_context(&f, &one, ids, &n, 1, taps, NULL);

    int cut = 13;
    float *part = malloc((size_t)nt * n * D * sizeof(float));
    for (int piece = 0; piece < 2; piece++) {
        int p0 = piece ? cut : 0, len = piece ? n - cut : cut;
        for (int j = 0; j < nt; j++) /* slice rows [p0, p0+len) of every tap */
            memcpy(part + (size_t)j * len * D, taps + ((size_t)j * n + p0) * D,
                   (size_t)len * D * sizeof(float));
        if (ds_draft_write_context(f.d, &two, f.table, p0, len, part, &err))
            fail_msg("%s", err.msg);
    }
    for (int l = 0; l < L; l++) {
        float *a = cache_layer(&two, l), *b = cache_layer(&one, l);
        check_rel("draft context in two calls vs one", a, b, per_layer, 1e-6);
        free(a), free(b);
    }

    int cuts[4] = {13, 5, 1, n - 19};
    run_context(&f, &steps, ids, cuts, 4, NULL, NULL);
    for (int l = 0; l < L; l++) {
        float *a = cache_layer(&steps, l), *b = cache_layer(&one, l);
        check_rel("target steps + draft context vs one prefill", a, b, per_layer, 1e-4);
        free(a), free(b);
    }
    int32_t d1[MAX_BLOCK], d2[MAX_BLOCK], d3[MAX_BLOCK];
    if (ds_draft_propose(f.d, &one, f.table, n - 1, 100, 7, d1, NULL, &err) ||
        ds_draft_propose(f.d, &two, f.table, n - 1, 100, 7, d2, NULL, &err) ||
        ds_draft_propose(f.d, &steps, f.table, n - 1, 100, 7, d3, NULL, &err))
        fail_msg("%s", err.msg);
    assert_memory_equal(d1, d2, sizeof(int32_t) * 7);
    assert_memory_equal(d1, d3, sizeof(int32_t) * 7);
    free(part);
    free(taps);
    ds_draft_cache_free(&one);
    ds_draft_cache_free(&two);
    ds_draft_cache_free(&steps);
    close_fx(&f);
}

/* Proposals for several sequences in one call: three contexts of different lengths in different
 * pages of one cache, proposed alone and all at once (each in its own spare slot) — the same
 * drafts and block logits to the bit; more sequences than the cache's slots is refused. The
 * three contexts written in one ds_draft_write_context_batch (into a second cache) give the same
 * proposals again; items of mixed kinds are refused. */
static void test_batch_propose(void **state) {
    (void)state;
    const uint64_t *dims;
    const int32_t *ids = gold("input_ids", DS_GOLDEN_I32, &dims);
    int n = (int)dims[0];
    fx f;
    open_fx(&f, 16);
    const ds_draft_config *dc = ds_draft_config_of(f.d);
    int nt = ds_draft_n_taps(f.d), D = dc->target_hidden_size, V = dc->vocab_size;
    enum { NS = 3, P = MAX_CTX / 16, T = 7 };
    ds_draft_cache tmp, c, c2;
    ds_err err = {{0}};
    if (ds_draft_cache_init(&tmp, f.d, P, 16, MAX_BLOCK, &err) ||
        ds_draft_cache_init_seqs(&c, f.d, NS * P, 16, MAX_BLOCK, NS, &err) ||
        ds_draft_cache_init_seqs(&c2, f.d, NS * P, 16, MAX_BLOCK, NS, &err))
        fail_msg("%s", err.msg);
    assert_int_equal(c.max_seqs, NS);
    float *taps = malloc((size_t)nt * n * D * sizeof(float)); /* [n_taps][n][D] */
    run_context(&f, &tmp, ids, &n, 1, taps, NULL);
    int32_t tabs[NS][P], anchors[NS] = {100, 7, 333};
    const int32_t *tp[NS];
    int ps[NS];
    float *part[NS];
    ds_draft_ctx_write cw[NS];
    for (int b = 0; b < NS; b++) {
        for (int i = 0; i < P; i++) tabs[b][i] = b * P + f.table[i];
        tp[b] = tabs[b];
        int len = n - 6 * b; /* rows [0, len) of every tap */
        ps[b] = len - 1;
        part[b] = malloc((size_t)nt * len * D * sizeof(float));
        for (int j = 0; j < nt; j++)
            memcpy(part[b] + (size_t)j * len * D, taps + (size_t)j * n * D,
                   (size_t)len * D * sizeof(float));
        if (ds_draft_write_context(f.d, &c, tabs[b], 0, len, part[b], &err))
            fail_msg("%s", err.msg);
        cw[b] = (ds_draft_ctx_write){tabs[b], 0, len, part[b], NULL};
    }
    if (ds_draft_write_context_batch(f.d, &c2, NS, cw, &err)) fail_msg("%s", err.msg);
    int32_t alone[NS][T], together[NS][T];
    float *Ua = malloc((size_t)NS * T * V * sizeof(float));
    float *Ub = malloc((size_t)NS * T * V * sizeof(float));
    for (int b = 0; b < NS; b++)
        if (ds_draft_propose(f.d, &c, tabs[b], ps[b], anchors[b], T, alone[b],
                             Ua + (size_t)b * T * V, &err))
            fail_msg("%s", err.msg);
    if (ds_draft_propose_batch(f.d, &c, NS, tp, ps, anchors, T, &together[0][0], Ub, &err))
        fail_msg("%s", err.msg);
    assert_memory_equal(together, alone, sizeof alone);
    assert_memory_equal(Ub, Ua, (size_t)NS * T * V * sizeof(float));
    if (ds_draft_propose_batch(f.d, &c2, NS, tp, ps, anchors, T, &together[0][0], Ub, &err))
        fail_msg("%s", err.msg);
    assert_memory_equal(together, alone, sizeof alone);
    assert_memory_equal(Ub, Ua, (size_t)NS * T * V * sizeof(float));
    cw[1].sum = cw[1].taps, cw[1].taps = NULL; /* a sum among taps */
    assert_int_equal(ds_draft_write_context_batch(f.d, &c2, NS, cw, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "item 1: give taps or a sum"));
    /* the three differ (their contexts and anchors do), so a mix-up would show */
    assert_true(memcmp(alone[0], alone[1], sizeof alone[0]) ||
                memcmp(alone[1], alone[2], sizeof alone[0]));
    const int32_t *tp4[4] = {tp[0], tp[1], tp[2], tp[0]};
    int ps4[4] = {ps[0], ps[1], ps[2], ps[0]};
    int32_t an4[4] = {1, 2, 3, 4}, d4[4 * T];
    assert_int_equal(ds_draft_propose_batch(f.d, &c, 4, tp4, ps4, an4, T, d4, NULL, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "4 sequences (cache allows 1..3)"));
    free(Ua), free(Ub), free(taps);
    for (int b = 0; b < NS; b++) free(part[b]);
    ds_draft_cache_free(&tmp);
    ds_draft_cache_free(&c);
    ds_draft_cache_free(&c2);
    close_fx(&f);
}

/* The block pass reads the context through the caller's pages and its own spare pages; the page
 * size (and so where p falls inside a page) must not change a single bit of the result. Block 1:
 * every context page is whole; 8: p+1 = 40 ends a page; 16: p falls mid-page; 64: p is in the
 * first page. */
static void test_paging_invariance(void **state) {
    (void)state;
    const uint64_t *dims;
    const int32_t *ids = gold("input_ids", DS_GOLDEN_I32, &dims);
    int n = (int)dims[0];
    static const int blocks[4] = {16, 1, 8, 64};
    float *U0 = NULL;
    int32_t d0[MAX_BLOCK];
    for (int b = 0; b < 4; b++) {
        fx f;
        open_fx(&f, blocks[b]);
        int V = ds_model_config(f.m)->vocab_size;
        ds_draft_cache c;
        ds_err err = {{0}};
        if (ds_draft_cache_init(&c, f.d, MAX_CTX / blocks[b], blocks[b], MAX_BLOCK, &err))
            fail_msg("%s", err.msg);
        run_context(&f, &c, ids, &n, 1, NULL, NULL);
        float *U = malloc((size_t)MAX_BLOCK * V * sizeof(float));
        int32_t d[MAX_BLOCK];
        if (ds_draft_propose(f.d, &c, f.table, n - 1, 100, MAX_BLOCK, d, U, &err))
            fail_msg("%s", err.msg);
        /* A shorter context (p = 20) through the same cache reads only rows 0..20. */
        int32_t dshort[4];
        if (ds_draft_propose(f.d, &c, f.table, 20, 7, 4, dshort, NULL, &err))
            fail_msg("%s", err.msg);
        if (!U0) {
            U0 = U;
            memcpy(d0, d, sizeof d0);
        } else {
            if (memcmp(U, U0, (size_t)MAX_BLOCK * V * sizeof(float)))
                fail_msg("block %d: logits differ from block 16 (rel %.3g)", blocks[b],
                         ds_test_rel_err_f(U, U0, (size_t)MAX_BLOCK * V));
            assert_memory_equal(d, d0, sizeof d0);
            free(U);
        }
        ds_draft_cache_free(&c);
        close_fx(&f);
    }
    free(U0);
}

/* ---- YaRN (docs/model.md §8.6) -----------------------------------------------------------------
 */

/* The published Kimi-K3-DSpark config.json (docs/model.md §8.1). */
static const char K3_DRAFT_JSON[] =
    "{\"architectures\":[\"K3DSparkModel\"],\"model_type\":\"k3_dspark\",\"hidden_size\":7168,"
    "\"intermediate_size\":14336,\"num_hidden_layers\":5,\"num_attention_heads\":64,"
    "\"num_key_value_heads\":64,\"q_lora_rank\":1536,\"kv_lora_rank\":512,"
    "\"qk_nope_head_dim\":128,\"qk_rope_head_dim\":64,\"v_head_dim\":128,\"mla_use_nope\":false,"
    "\"mla_use_output_gate\":false,\"vocab_size\":163840,\"draft_vocab_size\":163840,"
    "\"rms_norm_eps\":1e-5,\"max_position_embeddings\":1048576,\"rope_theta\":50000,"
    "\"rope_parameters\":{\"rope_type\":\"yarn\",\"factor\":32,"
    "\"original_max_position_embeddings\":32768,\"rope_theta\":50000,\"beta_fast\":32,"
    "\"beta_slow\":1,\"mscale\":1.0,\"mscale_all_dim\":1.0},\"num_target_layers\":5,"
    "\"target_hidden_size\":7168,\"target_num_hidden_layers\":93,"
    "\"target_layer_ids\":[2,23,47,71,89],\"mask_token_id\":163837,\"markov_rank\":256,"
    "\"markov_head_type\":\"vanilla\",\"enable_confidence_head\":true,"
    "\"confidence_head_with_markov\":true}";

static void test_yarn(void **state) {
    (void)state;
    ds_draft_config c;
    ds_err err = {{0}};
    if (ds_draft_config_parse(K3_DRAFT_JSON, "k3 draft", &c, &err)) fail_msg("%s", err.msg);
    double inv[32];
    ds_yarn y;
    if (ds_draft_yarn(&c, inv, &y, &err)) fail_msg("%s", err.msg);
    assert_int_equal(y.lo, 15);
    assert_int_equal(y.hi, 26);
    /* 192^-1/2 * (0.1 ln 32 + 1)^2 */
    assert_true(fabs(y.softmax_scale - 0.130861) < 5e-7);
    assert_true(fabs(y.cos_sin_mscale - 1.0) < 1e-15);
    for (int i = 0; i < 32; i++) {
        double base = pow(50000.0, -2.0 * i / 64.0);
        double want = i <= 15   ? base
                      : i >= 26 ? base / 32.0
                                : base * (1 - (i - 15) / 11.0 * 31 / 32);
        if (fabs(inv[i] - want) > 1e-12 * base)
            fail_msg("K3 inv_freq[%d] = %.17g, want %.17g", i, inv[i], want);
    }

    /* tiny draft: r = 8 -> dim(32) = 1.88, dim(1) = 3.16 -> lo 1, hi 4; scale 24^-1/2 * mscale^2 */
    fx f;
    open_fx(&f, 16);
    const double *tiny = ds_draft_inv_freq(f.d, &y);
    assert_int_equal(y.lo, 1);
    assert_int_equal(y.hi, 4);
    double m = 0.1 * log(32.0) + 1.0;
    assert_true(fabs(y.softmax_scale - m * m / sqrt(24.0)) < 1e-12);
    const uint64_t *dims;
    const int32_t *lohi = gold("yarn.lo_hi", DS_GOLDEN_I32, &dims);
    assert_int_equal(lohi[0], 1);
    assert_int_equal(lohi[1], 4);
    const double *ref = gold("yarn.inv_freq", DS_GOLDEN_F64, &dims);
    assert_int_equal((int)dims[0], 4);
    for (int i = 0; i < 4; i++) assert_true(fabs(tiny[i] - ref[i]) <= 1e-15 * ref[i] + 1e-300);
    assert_true(fabs(y.softmax_scale -
                     *(const double *)gold("yarn.softmax_scale", DS_GOLDEN_F64, &dims)) < 1e-14);
    close_fx(&f);

    /* no rope_parameters: plain RoPE, unscaled softmax */
    c.rope_factor = 1.0;
    if (ds_draft_yarn(&c, inv, &y, &err)) fail_msg("%s", err.msg);
    assert_int_equal(y.lo, 0);
    assert_true(fabs(inv[31] - pow(50000.0, -62.0 / 64.0)) < 1e-20);
    assert_true(fabs(y.softmax_scale - 1.0 / sqrt(192.0)) < 1e-15);
}

/* ---- rejections --------------------------------------------------------------------------------
 */

/* Writes DIR/draft-bad with the good draft's weights and its config.json changed by `edit`, then
 * expects ds_draft_load to fail with a message containing `needle`. */
static void expect_rejected(ds_model *m, void (*edit)(json_t *), const char *weights_name,
                            const char *needle) {
    char good[4096], bad[4096], path[4200], src[4200];
    snprintf(good, sizeof good, "%s/draft", g_dir);
    snprintf(bad, sizeof bad, "%s/draft-bad", g_dir);
    if (mkdir(bad, 0755) != 0) assert_int_equal(errno, EEXIST);
    snprintf(src, sizeof src, "%s/config.json", good);
    json_error_t je;
    json_t *cfg = json_load_file(src, 0, &je);
    assert_non_null(cfg);
    edit(cfg);
    snprintf(path, sizeof path, "%s/config.json", bad);
    assert_int_equal(json_dump_file(cfg, path, JSON_INDENT(2)), 0);
    json_decref(cfg);
    snprintf(path, sizeof path, "%s/model.safetensors", bad);
    unlink(path);
    snprintf(src, sizeof src, "%s/%s", good, weights_name);
    assert_int_equal(symlink(src, path), 0);
    ds_draft *d = NULL;
    ds_err err = {{0}};
    int rc = ds_draft_load(bad, m, &d, &err);
    if (rc == DS_OK) fail_msg("draft accepted, expected a message with '%s'", needle);
    assert_null(d);
    if (!strstr(err.msg, needle)) fail_msg("message '%s' lacks '%s'", err.msg, needle);
}

static void edit_tap_too_deep(json_t *c) {
    /* Consistent by itself (a 20-layer target), but the target has 10. */
    json_object_set_new(c, "target_num_hidden_layers", json_integer(20));
    json_t *ids = json_object_get(c, "target_layer_ids");
    json_array_set_new(ids, 2, json_integer(12));
}
static void edit_target_hidden(json_t *c) {
    json_object_set_new(c, "target_hidden_size", json_integer(32));
}
static void edit_hidden(json_t *c) {
    json_object_set_new(c, "hidden_size", json_integer(32));
}
static void edit_vocab(json_t *c) {
    json_object_set_new(c, "vocab_size", json_integer(2048));
    json_object_set_new(c, "draft_vocab_size", json_integer(2048));
}
static void edit_target_layers(json_t *c) {
    json_object_set_new(c, "target_num_hidden_layers", json_integer(93));
}
static void edit_intermediate(json_t *c) {
    json_object_set_new(c, "intermediate_size", json_integer(96));
}
static void edit_fc_norm(json_t *c) {
    json_object_set_new(c, "fc_norm", json_true());
}
static void edit_none(json_t *c) {
    (void)c;
}

static void test_rejects(void **state) {
    (void)state;
    ds_model *m;
    ds_err err = {{0}};
    if (ds_model_load(g_dir, NULL, &m, &err)) fail_msg("%s", err.msg);
    expect_rejected(m, edit_tap_too_deep, "model.safetensors", "target_layer_ids[2] = 12");
    expect_rejected(m, edit_target_hidden, "model.safetensors", "target_hidden_size = 32");
    expect_rejected(m, edit_hidden, "model.safetensors", "hidden_size = 32");
    expect_rejected(m, edit_vocab, "model.safetensors", "vocab_size = 2048");
    expect_rejected(m, edit_target_layers, "model.safetensors", "target_num_hidden_layers = 93");
    expect_rejected(m, edit_intermediate, "model.safetensors", "layers.0.mlp.gate_proj.weight");
    expect_rejected(m, edit_fc_norm, "model.safetensors", "fc_norm");
    /* weights from another checkpoint: the target's file has no context_proj */
    expect_rejected(m, edit_none, "../model.safetensors", "context_proj.weight");
    ds_model_free(m);
}

/* A "model." prefix on every tensor name (some exports add it, §8.2) loads and gives the same
 * drafts; bad propose arguments are refused, not crashed on. */
static void test_prefix_and_args(void **state) {
    (void)state;
    char good[4096], pre[4096], path[4200];
    snprintf(good, sizeof good, "%s/draft", g_dir);
    snprintf(pre, sizeof pre, "%s/draft-prefixed", g_dir);
    if (mkdir(pre, 0755) != 0) assert_int_equal(errno, EEXIST);
    ds_st *st;
    ds_err err = {{0}};
    size_t len;
    snprintf(path, sizeof path, "%s/config.json", good);
    char *cfg = ds_read_file(path, &len, &err);
    assert_non_null(cfg);
    snprintf(path, sizeof path, "%s/config.json", pre);
    assert_int_equal(ds_test_write_file(path, cfg, len), 0);
    free(cfg);
    snprintf(path, sizeof path, "%s/model.safetensors", good);
    if (ds_st_open_file(path, &st, &err)) fail_msg("%s", err.msg);
    ds_st_writer *w = ds_st_writer_new(&err);
    assert_non_null(w);
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *t = ds_st_at(st, i);
        char name[512];
        snprintf(name, sizeof name, "model.%s", t->name);
        if (ds_st_writer_add(w, name, t->dtype, t->ndim, t->shape, t->data, &err))
            fail_msg("%s", err.msg);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", pre);
    if (ds_st_writer_write(w, path, &err)) fail_msg("%s", err.msg);
    ds_st_writer_free(w);
    ds_st_close(st);

    const uint64_t *dims;
    const int32_t *ids = gold("input_ids", DS_GOLDEN_I32, &dims);
    int n = (int)dims[0];
    fx f;
    open_fx(&f, 16);
    ds_draft *dp;
    if (ds_draft_load(pre, f.m, &dp, &err)) fail_msg("prefixed draft: %s", err.msg);
    ds_draft_cache c1, c2;
    if (ds_draft_cache_init(&c1, f.d, MAX_CTX / 16, 16, MAX_BLOCK, &err) ||
        ds_draft_cache_init(&c2, dp, MAX_CTX / 16, 16, MAX_BLOCK, &err))
        fail_msg("%s", err.msg);
    run_context(&f, &c1, ids, &n, 1, NULL, NULL);
    ds_draft *plain = f.d;
    f.d = dp;
    run_context(&f, &c2, ids, &n, 1, NULL, NULL);
    f.d = plain;
    int32_t d1[7], d2[7];
    if (ds_draft_propose(plain, &c1, f.table, n - 1, 100, 7, d1, NULL, &err) ||
        ds_draft_propose(dp, &c2, f.table, n - 1, 100, 7, d2, NULL, &err))
        fail_msg("%s", err.msg);
    assert_memory_equal(d1, d2, sizeof d1);

    int32_t d[MAX_BLOCK + 1];
    int V = ds_model_config(f.m)->vocab_size;
    assert_int_equal(ds_draft_propose(plain, &c1, f.table, n - 1, 5, MAX_BLOCK + 1, d, NULL, &err),
                     DS_ERR);
    assert_non_null(strstr(err.msg, "T = 9"));
    assert_int_equal(ds_draft_propose(plain, &c1, f.table, n - 1, 5, 0, d, NULL, &err), DS_ERR);
    assert_int_equal(ds_draft_propose(plain, &c1, f.table, n - 1, V, 4, d, NULL, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "anchor id 1024"));
    assert_int_equal(ds_draft_propose(plain, &c1, f.table, n - 1, -1, 4, d, NULL, &err), DS_ERR);
    assert_int_equal(ds_draft_write_context(plain, &c1, f.table, 0, 0, NULL, &err), DS_ERR);
    ds_draft_cache_free(&c1);
    ds_draft_cache_free(&c2);
    ds_draft_free(dp);
    close_fx(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_context_chunks),
        cmocka_unit_test(test_paging_invariance),
        cmocka_unit_test(test_batch_propose),
        cmocka_unit_test(test_yarn),
        cmocka_unit_test(test_rejects),
        cmocka_unit_test(test_prefix_and_args),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
