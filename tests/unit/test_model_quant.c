/* The loader's quantized formats (docs/quantization.md): K3's MXFP4 experts as published, their
 * refusals, transformers' naming of the dense layer, and which weights ptpc_fp8 quantizes.
 *
 * MXFP4 is checked differentially: the same checkpoint rewritten with every packed expert widened
 * to F32 (exact: code times scale is an f32) must give the logits of the packed one, so any slip in
 * nibble order, scale indexing or expert slicing shows. The Python reference's golden
 * (tests/unit/test_model_forward.c) checks the pair against float64 too. */
#include "devtools/init_model.h"
#include "io/safetensors.h"
#include "kernels/shared/quant.h"
#include "model/model_impl.h"
#include "testutil.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const int32_t IDS[] = {1,  5,  9,   300, 400, 17, 22,  99,  512, 3,  77, 640, 12, 13,
                              14, 15, 201, 202, 7,   8,  600, 601, 44,  45, 46, 47,  48, 49,
                              50, 51, 52,  53,  54,  55, 56,  57,  58,  59, 60, 61};
#define N_IDS ((int)DS_ARRAY_LEN(IDS))

static char *g_tmp;

static char *path2(const char *dir, const char *name) {
    char *p = malloc(strlen(dir) + strlen(name) + 2);
    sprintf(p, "%s/%s", dir, name);
    return p;
}

static char *make(const char *name, const char *preset, int mxfp4) {
    char *dir = path2(g_tmp, name);
    ds_err err = {{0}};
    if (ds_init_model_ex(preset, dir, 0, mxfp4, &err)) fail_msg("%s", err.msg);
    return dir;
}

/* Logits [N_IDS][V] of one prefill (the expanded / chunked forms, with a short continuation so the
 * recurrent / absorbed ones run too); NULL with the load error in err. */
static float *logits_of(const char *dir, const ds_model_opts *o, int *V, ds_err *err) {
    ds_model *m;
    if (ds_model_load(dir, o, &m, err)) return NULL;
    *V = ds_model_config(m)->vocab_size;
    ds_kv_pool pool;
    float *slot = calloc(ds_model_slot_floats(m), sizeof(float));
    float *out = calloc((size_t)N_IDS * *V, sizeof(float));
    int32_t table[8] = {3, 1, 4, 0, 5, 2, 6, 7};
    assert_int_equal(ds_kv_pool_init(&pool, m, 8, 16, err), DS_OK);
    const int first = N_IDS - 3;
    for (int pos = 0; pos < N_IDS;) {
        int n = pos ? 1 : first;
        ds_seq_batch sb = {IDS + pos, n,    pos,  slot, table, out + (size_t)pos * *V,
                           n,         NULL, NULL, NULL, 0,     NULL,
                           NULL,      NULL, NULL};
        if (ds_model_forward(m, &pool, &sb, 1, err)) fail_msg("%s", err->msg);
        pos += n;
    }
    ds_kv_pool_free(&pool);
    free(slot);
    ds_model_free(m);
    return out;
}

static float *logits(const char *dir, const ds_model_opts *o, int *V) {
    ds_err err = {{0}};
    float *l = logits_of(dir, o, V, &err);
    if (!l) fail_msg("%s", err.msg);
    return l;
}

/* ---- rewriting checkpoints ----------------------------------------------------------------------
 */
/* What to do with one tensor of a copy: the callback fills *dt/shape/data (data malloc'd, or NULL
 * to drop the tensor) and may rename it. */
typedef void (*rewrite_fn)(const ds_st *st, const ds_tensor *t, char *name, ds_dtype *dt,
                           int64_t *shape, void **data);

static void copy_checkpoint(const char *from, const char *to, rewrite_fn fn, json_t *config) {
    ds_err err = {{0}};
    ds_st *st;
    if (ds_st_open_dir(from, &st, &err)) fail_msg("%s", err.msg);
    ds_st_writer *w = ds_st_writer_new(&err);
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *t = ds_st_at(st, i);
        char name[512];
        snprintf(name, sizeof name, "%s", t->name);
        ds_dtype dt = t->dtype;
        int64_t shape[DS_MAX_DIMS];
        memcpy(shape, t->shape, sizeof shape);
        void *data = malloc(t->nbytes + 1);
        memcpy(data, t->data, t->nbytes);
        if (fn) fn(st, t, name, &dt, shape, &data);
        if (data && ds_st_writer_add(w, name, dt, t->ndim, shape, data, &err))
            fail_msg("%s", err.msg);
        free(data);
    }
    char *p = path2(to, "model.safetensors");
    mkdir(to, 0755);
    if (ds_st_writer_write(w, p, &err)) fail_msg("%s", err.msg);
    free(p);
    ds_st_writer_free(w);
    ds_st_close(st);
    p = path2(to, "config.json");
    assert_int_equal(json_dump_file(config, p, 0), 0);
    free(p);
}

static json_t *config_of(const char *dir) {
    char *p = path2(dir, "config.json");
    json_t *c = json_load_file(p, 0, NULL);
    free(p);
    assert_non_null(c);
    return c;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* MXFP4 experts widened to F32 .weight tensors (the scales are dropped with them). */
static void widen_experts(const ds_st *st, const ds_tensor *t, char *name, ds_dtype *dt,
                          int64_t *shape, void **data) {
    if (ends_with(name, ".weight_scale")) {
        free(*data);
        *data = NULL;
        return;
    }
    if (!ends_with(name, ".weight_packed")) return;
    char sn[512];
    snprintf(sn, sizeof sn, "%.*s.weight_scale", (int)(strlen(name) - 14), name);
    const ds_tensor *s = ds_st_find(st, sn);
    assert_non_null(s);
    int rows = (int)t->shape[0], cols = (int)t->shape[1] * 2;
    float *v = malloc((size_t)rows * cols * sizeof(float));
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            v[(size_t)r * cols + c] = ds_mxfp4_at(t->data, s->data, cols, r, c);
    free(*data);
    *data = v;
    *dt = DS_DT_F32;
    shape[1] = cols;
    name[strlen(name) - 14] = 0;
    strcat(name, ".weight");
}

static void test_mxfp4_equals_widened(void **state) {
    (void)state;
    char *mx = make("mx", "tiny-k3", 1), *wide = path2(g_tmp, "wide");
    json_t *cfg = config_of(mx);
    json_object_del(cfg, "quantization_config");
    copy_checkpoint(mx, wide, widen_experts, cfg);
    json_decref(cfg);
    int V;
    float *a = logits(mx, NULL, &V), *b = logits(wide, NULL, &V);
    double rel = ds_test_rel_err_f(a, b, (size_t)N_IDS * V);
    print_message("MXFP4 vs widened F32: rel %.3g\n", rel);
    assert_true(rel <= 1e-5);
    /* and they are not the BF16 experts they were rounded from (the format is really read) */
    char *bf = make("bf", "tiny-k3", 0);
    float *c = logits(bf, NULL, &V);
    assert_true(ds_test_rel_err_f(a, c, (size_t)N_IDS * V) > 1e-3);
    /* packed in memory: the experts' bytes are a quarter of BF16's (plus 1/32 for scales) */
    ds_model *m1, *m2;
    ds_err err = {{0}};
    assert_int_equal(ds_model_load(mx, NULL, &m1, &err), DS_OK);
    assert_int_equal(ds_model_load(bf, NULL, &m2, &err), DS_OK);
    const ds_mat *e1 = &m1->layers[1].ffn.w1[0], *e2 = &m2->layers[1].ffn.w1[0];
    assert_int_equal(e1->dtype, DS_DT_MXFP4);
    assert_int_equal(e2->dtype, DS_DT_BF16);
    assert_true(ds_model_weight_bytes(m1) < ds_model_weight_bytes(m2));
    ds_model_free(m1);
    ds_model_free(m2);
    free(a);
    free(b);
    free(c);
    free(mx);
    free(wide);
    free(bf);
}

/* ---- refusals ----------------------------------------------------------------------------------
 */
static void expect_load_error(const char *dir, const char *needle) {
    ds_model *m = NULL;
    ds_err err = {{0}};
    int rc = ds_model_load(dir, NULL, &m, &err);
    if (rc == DS_OK) fail_msg("%s loaded; expected an error containing '%s'", dir, needle);
    if (!strstr(err.msg, needle)) fail_msg("error '%s' does not name '%s'", err.msg, needle);
}

static void nan_scale(const ds_st *st, const ds_tensor *t, char *name, ds_dtype *dt, int64_t *shape,
                      void **data) {
    (void)st, (void)t, (void)dt, (void)shape;
    if (strstr(name, "layers.2.block_sparse_moe.experts.3.w2.weight_scale"))
        ((uint8_t *)*data)[5] = 255;
}

static void test_mxfp4_refusals(void **state) {
    (void)state;
    char *mx = make("mx2", "tiny-k3", 1), *bad = path2(g_tmp, "bad");
    json_t *cfg = config_of(mx);
    /* a NaN scale names the tensor */
    copy_checkpoint(mx, bad, nan_scale, cfg);
    expect_load_error(bad, "experts.3.w2.weight_scale");
    /* packed tensors without a quantization_config */
    json_t *plain = json_deep_copy(cfg);
    json_object_del(plain, "quantization_config");
    copy_checkpoint(mx, bad, NULL, plain);
    expect_load_error(bad, "quantization_config");
    /* other methods, formats and group sizes are named */
    static const char *const bad_q[][2] = {
        {"{\"quant_method\": \"awq\", \"bits\": 4}", "\"awq\" is not supported"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"nvfp4-pack-quantized\"}",
         "nvfp4-pack-quantized"},
        {"{\"quant_method\": \"compressed-tensors\", \"format\": \"mxfp4-pack-quantized\", "
         "\"config_groups\": {\"g\": {\"weights\": {\"group_size\": 16}}}}",
         "group_size 16"},
        {"{\"format\": \"mxfp4-pack-quantized\"}", "quant_method"},
    };
    for (size_t i = 0; i < DS_ARRAY_LEN(bad_q); i++) {
        json_t *c = json_deep_copy(cfg);
        json_object_set_new(c, "quantization_config", json_loads(bad_q[i][0], 0, NULL));
        copy_checkpoint(mx, bad, NULL, c);
        json_decref(c);
        expect_load_error(bad, bad_q[i][1]);
    }
    json_decref(plain);
    json_decref(cfg);
    free(mx);
    free(bad);
}

/* ---- transformers' dense-layer naming ----------------------------------------------------------
 */
static void dense_as_moe(const ds_st *st, const ds_tensor *t, char *name, ds_dtype *dt,
                         int64_t *shape, void **data) {
    (void)st, (void)t, (void)dt, (void)shape;
    char *p = strstr(name, "layers.0.mlp.");
    if (!p) return;
    char rest[256];
    snprintf(rest, sizeof rest, "%s", p + strlen("layers.0.mlp."));
    sprintf(p, "layers.0.block_sparse_moe.%s", rest);
}

static void test_dense_layer_names(void **state) {
    (void)state;
    char *src = make("kl", "tiny-linear", 0), *tf = path2(g_tmp, "tf");
    json_t *cfg = config_of(src);
    copy_checkpoint(src, tf, dense_as_moe, cfg);
    json_decref(cfg);
    int V;
    float *a = logits(src, NULL, &V), *b = logits(tf, NULL, &V);
    assert_memory_equal(a, b, (size_t)N_IDS * V * sizeof(float));
    free(a);
    free(b);
    free(src);
    free(tf);
}

/* ---- ptpc_fp8 ----------------------------------------------------------------------------------
 */
static void test_ptpc_scope(void **state) {
    (void)state;
    char *dir = make("k3p", "tiny-k3", 0);
    ds_model_opts o;
    ds_model_opts_default(&o);
    o.quantization = DS_QUANT_PTPC_FP8;
    ds_model *m;
    ds_err err = {{0}};
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_OK);
    const layer_w *kda = &m->layers[0], *mla = &m->layers[3], *moe = &m->layers[1];
    assert_int_equal(kda->kda.q.dtype, DS_DT_F8_E4M3);
    assert_int_equal(kda->kda.o.dtype, DS_DT_F8_E4M3);
    assert_int_equal(kda->kda.b.dtype, DS_DT_BF16); /* excluded by default */
    assert_int_equal(mla->mla.q_b.dtype, DS_DT_F8_E4M3);
    assert_int_equal(mla->mla.kv_b.dtype, DS_DT_BF16); /* never */
    assert_int_equal(moe->ffn.router.dtype, DS_DT_BF16);
    assert_int_equal(moe->ffn.w2[0].dtype, DS_DT_F8_E4M3); /* BF16 experts become FP8 */
    assert_int_equal(moe->ffn.lat_up.dtype, DS_DT_F8_E4M3);
    assert_int_equal(m->embed.dtype, DS_DT_BF16);
    assert_int_equal(m->lm_head.dtype, DS_DT_BF16);
    /* the codes are the quantizer's, from the checkpoint's rows */
    ds_st *st;
    assert_int_equal(ds_st_open_dir(dir, &st, &err), DS_OK);
    const ds_tensor *t = ds_st_find(st, "language_model.model.layers.0.self_attn.o_proj.weight");
    assert_non_null(t);
    ds_mat w = {t->data, t->dtype, (int)t->shape[0], (int)t->shape[1], NULL};
    uint8_t *codes = malloc((size_t)w.rows * w.cols);
    float *scales = malloc((size_t)w.rows * sizeof(float));
    ds_ptpc_quantize(codes, scales, &w, 0, w.cols);
    assert_memory_equal(codes, kda->kda.o.data, (size_t)w.rows * w.cols);
    assert_memory_equal(scales, kda->kda.o.scale, (size_t)w.rows * sizeof(float));
    free(codes);
    free(scales);
    ds_st_close(st);
    ds_model_free(m);
    /* an empty list quantizes the router and b_proj too, but never kv_b_proj or the tables */
    o.quantization_exclude = "";
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_OK);
    assert_int_equal(m->layers[1].ffn.router.dtype, DS_DT_F8_E4M3);
    assert_int_equal(m->layers[0].kda.b.dtype, DS_DT_F8_E4M3);
    assert_int_equal(m->layers[3].mla.kv_b.dtype, DS_DT_BF16);
    assert_int_equal(m->lm_head.dtype, DS_DT_BF16);
    ds_model_free(m);
    /* a fragment list of our own: only q_proj of the KDA layers stays BF16 */
    o.quantization_exclude = "self_attn.q_proj,nothing-matches-this";
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_OK);
    assert_int_equal(m->layers[0].kda.q.dtype, DS_DT_BF16);
    assert_int_equal(m->layers[0].kda.k.dtype, DS_DT_F8_E4M3);
    assert_int_equal(m->layers[1].ffn.router.dtype, DS_DT_F8_E4M3);
    ds_model_free(m);
    /* the exclusion list means nothing without the method */
    o.quantization = DS_QUANT_NONE;
    assert_int_equal(ds_model_load(dir, &o, &m, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "--quantization-exclude"));
    free(dir);
}

/* Quantized logits stay near BF16's on the bundled model (trained: its distributions are peaked,
 * unlike a random model's), and the same run twice gives the same bits. */
static void test_ptpc_close_to_bf16(void **state) {
    (void)state;
    char *dir = ds_test_src_path("models/gsm-k3");
    ds_model_opts o;
    ds_model_opts_default(&o);
    int V;
    float *a = logits(dir, &o, &V);
    o.quantization = DS_QUANT_PTPC_FP8;
    float *b = logits(dir, &o, &V), *c = logits(dir, &o, &V);
    assert_memory_equal(b, c, (size_t)N_IDS * V * sizeof(float));
    int agree = 0;
    for (int t = 0; t < N_IDS; t++)
        agree += ds_argmax(a + (size_t)t * V, V) == ds_argmax(b + (size_t)t * V, V);
    double rel = ds_test_rel_err_f(b, a, (size_t)N_IDS * V);
    print_message("gsm-k3 ptpc_fp8 vs BF16: top-1 %d/%d, rel %.3g\n", agree, N_IDS, rel);
    assert_true(rel > 1e-4); /* it is quantized */
    assert_true(agree >= N_IDS * 7 / 10);
    free(a);
    free(b);
    free(c);
    free(dir);
}

int main(void) {
    g_tmp = ds_test_tmpdir();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mxfp4_equals_widened), cmocka_unit_test(test_mxfp4_refusals),
        cmocka_unit_test(test_dense_layer_names),    cmocka_unit_test(test_ptpc_scope),
        cmocka_unit_test(test_ptpc_close_to_bf16),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    free(g_tmp);
    return rc;
}
