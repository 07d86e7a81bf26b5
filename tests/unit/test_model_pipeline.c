/* Pipeline stages at the model level (docs/architecture.md invariant 3 without MPI): a model split
 * into layer ranges, run stage after stage with the stream and the banked AttnRes blocks handed
 * across, is bit-exact with the whole model — including blocks that open on one stage and close on
 * the next and a boundary right after a block closes. */
#include "devtools/init_model.h"
#include "model/model.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { BLOCK = 16, PAGES = 32, MAXS = 4 };

/* The formats of the run (docs/quantization.md): stages must stay bit-exact with them too, since
 * nothing a stage quantizes depends on where the model is cut. */
static int g_mxfp4, g_quant;

static char *make_model(const char *preset) {
    char *tmp = ds_test_tmpdir();
    char *dir = malloc(strlen(tmp) + 32);
    sprintf(dir, "%s/%s", tmp, preset);
    free(tmp);
    ds_err err = {{0}};
    if (ds_init_model_ex(preset, dir, 0, g_mxfp4, &err)) fail_msg("%s", err.msg);
    return dir;
}

typedef struct stage {
    ds_model *m;
    ds_kv_pool pool;
    float *slot;
} stage;

/* Runs `steps` (prefill, then single tokens) through the stages split at cuts[0..n_cuts);
 * returns the logits of every step's last token: [n_steps][V]. */
static float *run_split(const char *dir, const int *cuts, int n_cuts, const int32_t *ids,
                        const int *steps, int n_steps) {
    int n_st = n_cuts + 1;
    stage st[MAXS];
    ds_err err = {{0}};
    int L = 0, V = 0, D = 0;
    for (int i = 0; i < n_st; i++) {
        ds_model_opts o;
        ds_model_opts_default(&o);
        o.quantization = g_quant;
        o.layer_begin = i ? cuts[i - 1] : 0;
        o.layer_end = i < n_cuts ? cuts[i] : 0;
        if (ds_model_load(dir, &o, &st[i].m, &err)) fail_msg("%s", err.msg);
        if (ds_kv_pool_init(&st[i].pool, st[i].m, PAGES, BLOCK, &err)) fail_msg("%s", err.msg);
        st[i].slot = calloc(ds_model_slot_floats(st[i].m) + 1, sizeof(float));
        const ds_config *c = ds_model_config(st[i].m);
        L = c->num_hidden_layers;
        V = c->vocab_size;
        D = c->hidden_size;
    }
    assert_int_equal(ds_model_end_layer(st[n_st - 1].m), L);
    int32_t table[PAGES];
    for (int i = 0; i < PAGES; i++) table[i] = (i * 5 + 1) % PAGES;
    int maxT = 0;
    for (int s = 0; s < n_steps; s++) maxT = DS_MAX(maxT, steps[s]);
    int nb = ds_model_max_banks(st[0].m) + 1;
    ds_stage_io io[2];
    for (int k = 0; k < 2; k++) {
        io[k].h = malloc((size_t)maxT * D * sizeof(float));
        io[k].banks = malloc((size_t)nb * maxT * D * sizeof(float));
        io[k].n_banks = 0;
    }
    float *out = malloc((size_t)n_steps * V * sizeof(float));
    int pos = 0;
    for (int s = 0; s < n_steps; s++) {
        for (int i = 0; i < n_st; i++) {
            int last = i == n_st - 1;
            ds_seq_batch sb = {
                ids + pos, steps[s], pos,  st[i].slot, table, last ? out + (size_t)s * V : NULL,
                last,      NULL,     NULL, NULL,       0,     NULL,
                NULL,      NULL,     NULL};
            const ds_stage_io *in = i ? &io[(i - 1) % 2] : NULL;
            ds_stage_io *o = last ? NULL : &io[i % 2];
            if (ds_model_forward_stage(st[i].m, &st[i].pool, &sb, 1, in, o, &err))
                fail_msg("%s", err.msg);
        }
        pos += steps[s];
    }
    for (int i = 0; i < n_st; i++) {
        free(st[i].slot);
        ds_kv_pool_free(&st[i].pool);
        ds_model_free(st[i].m);
    }
    for (int k = 0; k < 2; k++) {
        free(io[k].h);
        free(io[k].banks);
    }
    return out;
}

static void check_preset(const char *preset, const int (*splits)[MAXS], int n_splits) {
    char *dir = make_model(preset);
    int32_t ids[120];
    ds_rng r;
    ds_rng_seed(&r, 77);
    for (int i = 0; i < 120; i++) ids[i] = (int32_t)(ds_rng_next(&r) % 700);
    int steps[] = {70, 1, 1, 30, 1};
    int n_steps = (int)DS_ARRAY_LEN(steps);
    float *whole = run_split(dir, NULL, 0, ids, steps, n_steps);
    ds_model *m;
    ds_err err = {{0}};
    if (ds_model_load(dir, NULL, &m, &err)) fail_msg("%s", err.msg);
    int V = ds_model_config(m)->vocab_size;
    ds_model_free(m);
    for (int k = 0; k < n_splits; k++) {
        int n_cuts = 0;
        while (n_cuts < MAXS && splits[k][n_cuts] > 0) n_cuts++;
        float *got = run_split(dir, splits[k], n_cuts, ids, steps, n_steps);
        if (memcmp(got, whole, (size_t)n_steps * V * sizeof(float)))
            fail_msg("%s: split %d (first cut %d) differs from one process", preset, k,
                     splits[k][0]);
        free(got);
    }
    free(whole);
    free(dir);
}

static void test_pipeline_k3(void **state) {
    (void)state;
    /* L = 10, AttnRes blocks of 3 layers (banks at 0, 3, 6, 9); MLA at 3, 7, 8, 9. */
    static const int splits[][MAXS] = {
        {5, 0},       /* PP 2: a block opened at 3 closes on stage 2 (at 6) */
        {3, 0},       /* boundary right before a banking layer */
        {4, 0},       /* boundary right after a block closed */
        {2, 5, 7, 0}, /* PP 4 */
        {3, 6, 9, 0}, /* PP 4, every boundary on a bank */
    };
    check_preset("tiny-k3", splits, (int)DS_ARRAY_LEN(splits));
}

static void test_pipeline_k3_quantized(void **state) {
    (void)state;
    static const int splits[][MAXS] = {{5, 0}, {2, 5, 7, 0}};
    g_mxfp4 = 1;
    g_quant = DS_QUANT_PTPC_FP8;
    check_preset("tiny-k3", splits, (int)DS_ARRAY_LEN(splits));
    g_mxfp4 = 0;
    check_preset("tiny-k3", splits, (int)DS_ARRAY_LEN(splits)); /* BF16 experts to FP8 */
    g_quant = DS_QUANT_NONE;
}

static void test_pipeline_linear(void **state) {
    (void)state;
    static const int splits[][MAXS] = {{4, 0}, {1, 3, 6, 0}};
    check_preset("tiny-linear", splits, (int)DS_ARRAY_LEN(splits));
}

static void test_bad_range(void **state) {
    (void)state;
    char *dir = make_model("tiny-linear");
    ds_model_opts o;
    ds_model_opts_default(&o);
    o.layer_begin = 5;
    o.layer_end = 3;
    ds_model *m;
    ds_err err = {{0}};
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "[5, 3)"));
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pipeline_k3),
        cmocka_unit_test(test_pipeline_linear),
        cmocka_unit_test(test_pipeline_k3_quantized),
        cmocka_unit_test(test_bad_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
