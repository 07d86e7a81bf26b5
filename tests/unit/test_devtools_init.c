/* test_devtools_init.c — init-model writes checkpoints in the published layouts (docs/model.md §1,
 * §3.1, §4.1, §5, §6.1, §7, §8.1, §8.2): read back through the real config and safetensors loaders,
 * every tensor's name, dtype and shape is what the spec tables say, the K3 A_log padding is zero,
 * tiny-linear is sharded with a consistent index, and the bytes depend only on (preset, seed). */
#include "testutil.h"

#include "io/config.h"
#include "devtools/init_model.h"
#include "io/safetensors.h"
#include "text/tokenizer.h"

#include <ftw.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char *g_root; /* temp folder holding every checkpoint of this test */
static char g_k3[4096], g_kl[4096];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(path);
}

static void path_in(char *out, size_t cap, const char *dir, const char *name) {
    if ((size_t)snprintf(out, cap, "%s/%s", dir, name) >= cap) fail_msg("%s: path too long", dir);
}

static int file_exists(const char *dir, const char *name) {
    char p[4096];
    path_in(p, sizeof p, dir, name);
    return access(p, F_OK) == 0;
}

static void init_ok(const char *preset, const char *dir, uint64_t seed) {
    ds_err err = {{0}};
    int rc = ds_init_model(preset, dir, seed, &err);
    if (rc != DS_OK) fail_msg("ds_init_model(%s, %s): %s", preset, dir, err.msg);
}

static int setup(void **state) {
    (void)state;
    g_root = ds_test_tmpdir();
    if (!g_root) return -1;
    path_in(g_k3, sizeof g_k3, g_root, "k3");
    path_in(g_kl, sizeof g_kl, g_root, "kl");
    ds_err err = {{0}};
    if (ds_init_model("tiny-k3", g_k3, 0, &err) || ds_init_model("tiny-linear", g_kl, 0, &err)) {
        fprintf(stderr, "setup: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    if (g_root) nftw(g_root, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(g_root);
    return 0;
}

static ds_st *open_dir(const char *dir) {
    ds_st *st = NULL;
    ds_err err = {{0}};
    if (ds_st_open_dir(dir, &st, &err) != DS_OK) fail_msg("ds_st_open_dir(%s): %s", dir, err.msg);
    return st;
}

/* Asserts tensor `name` exists with exactly this dtype and shape (ndim taken from the list). */
#define EXPECT(st, name, dt, ...)                                                                  \
    expect_tensor(st, name, dt, (const int64_t[]){__VA_ARGS__},                                    \
                  (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

static const ds_tensor *expect_tensor(const ds_st *st, const char *name, ds_dtype dt,
                                      const int64_t *shape, int ndim) {
    const ds_tensor *t = NULL;
    ds_err err = {{0}};
    if (ds_st_get(st, name, 1u << dt, ndim, shape, &t, &err) != DS_OK) fail_msg("%s", err.msg);
    return t;
}

static void expect_absent(const ds_st *st, const char *name) {
    if (ds_st_find(st, name)) fail_msg("%s should not exist", name);
}

static float *to_f32(const ds_tensor *t) {
    float *v = malloc((size_t)t->numel * sizeof *v);
    ds_err err = {{0}};
    assert_non_null(v);
    assert_int_equal(ds_tensor_to_f32(t, v, &err), DS_OK);
    return v;
}

/* Mean and standard deviation of a tensor's values. */
static void stats(const ds_tensor *t, double *mean, double *sd) {
    float *v = to_f32(t);
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < t->numel; i++) {
        assert_true(isfinite(v[i]));
        s += v[i];
        s2 += (double)v[i] * v[i];
    }
    *mean = s / (double)t->numel;
    *sd = sqrt(fmax(0.0, s2 / (double)t->numel - *mean * *mean));
    free(v);
}

/* The F32 tensors of the K3 checkpoint (docs/model.md §10 trap 4); everything else is BF16. */
static int k3_is_f32(const char *name) {
    static const char *const suffix[] = {"conv1d.weight", ".dt_bias", ".A_log", "o_norm.weight",
                                         "e_score_correction_bias"};
    size_t n = strlen(name);
    for (size_t i = 0; i < DS_ARRAY_LEN(suffix); i++) {
        size_t k = strlen(suffix[i]);
        if (n >= k && strcmp(name + n - k, suffix[i]) == 0) return 1;
    }
    return 0;
}

/* ---- presets ----------------------------------------------------------------------------------
 */

static void test_presets(void **state) {
    (void)state;
    const char *const *p = ds_init_model_presets();
    assert_string_equal(p[0], "tiny-k3");
    assert_string_equal(p[1], "tiny-linear");
    assert_string_equal(p[2], "bench-large");
    assert_null(p[3]);
    for (int i = 0; i < 3; i++) assert_non_null(ds_init_model_describe(p[i]));
    assert_null(ds_init_model_describe("huge"));

    ds_err err = {{0}};
    char dir[4096];
    path_in(dir, sizeof dir, g_root, "bad");
    assert_int_equal(ds_init_model("huge", dir, 0, &err), DS_ERR);
    assert_non_null(strstr(err.msg, "'huge'"));
    assert_non_null(strstr(err.msg, "tiny-linear"));
}

/* ---- tiny-k3 ----------------------------------------------------------------------------------
 */

static void test_k3_config(void **state) {
    (void)state;
    char path[4096];
    ds_config c;
    ds_err err = {{0}};
    path_in(path, sizeof path, g_k3, "config.json");
    if (ds_config_load(path, &c, &err) != DS_OK) fail_msg("%s", err.msg);
    assert_string_equal(c.model_type, "kimi_k3");
    assert_string_equal(c.weight_prefix, "language_model.");
    assert_int_equal(c.vocab_size, 1024);
    assert_int_equal(c.hidden_size, 64);
    assert_int_equal(c.num_hidden_layers, 10);
    assert_int_equal(c.intermediate_size, 96);
    assert_float_equal(c.rms_norm_eps, 1e-5f, 1e-12);
    assert_int_equal(c.hidden_act, DS_ACT_SITU);
    assert_float_equal(c.situ_beta, 4.0f, 0);
    assert_float_equal(c.situ_linear_beta, 25.0f, 0);
    assert_int_equal(c.num_attention_heads, 4);
    assert_int_equal(c.q_lora_rank, 32);
    assert_int_equal(c.kv_lora_rank, 32);
    assert_int_equal(c.qk_nope_head_dim, 16);
    assert_int_equal(c.qk_rope_head_dim, 8);
    assert_int_equal(c.v_head_dim, 16);
    assert_true(c.mla_use_nope);
    assert_true(c.mla_use_output_gate);
    assert_int_equal(c.kda_num_heads, 4);
    assert_int_equal(c.kda_head_dim, 16);
    assert_int_equal(c.short_conv_kernel_size, 4);
    assert_true(c.has_gate_lower_bound);
    assert_float_equal(c.gate_lower_bound, -5.0f, 0);
    assert_true(c.use_full_rank_gate);
    static const int mla[10] = {0, 0, 0, 1, 0, 0, 0, 1, 1, 1}; /* full_attn_layers [4,8,9,10] */
    for (int i = 0; i < 10; i++)
        assert_int_equal(c.layer_kind[i], mla[i] ? DS_LAYER_MLA : DS_LAYER_KDA);
    assert_int_equal(c.num_kda_layers, 6);
    assert_int_equal(c.num_mla_layers, 4);
    assert_int_equal(c.num_experts, 8);
    assert_int_equal(c.num_experts_per_token, 2);
    assert_int_equal(c.moe_intermediate_size, 32);
    assert_int_equal(c.num_shared_experts, 1);
    assert_int_equal(c.first_k_dense_replace, 1);
    assert_int_equal(c.moe_layer_freq, 1);
    assert_true(c.moe_renormalize);
    assert_float_equal(c.routed_scaling_factor, 1.0f, 0);
    assert_true(c.use_grouped_topk);
    assert_int_equal(c.num_expert_group, 2);
    assert_int_equal(c.topk_group, 1);
    assert_int_equal(c.routed_expert_hidden_size, 32);
    assert_true(c.latent_moe_use_norm);
    assert_int_equal(c.attn_res_block_size, 3);
    assert_int_equal(c.num_nextn_predict_layers, 0);
    assert_int_equal(c.max_position_embeddings, 4096);
    assert_false(c.tie_word_embeddings);
    assert_int_equal(c.bos_token_id, 768);
    assert_int_equal(c.eos_token_id, 770);
    assert_int_equal(c.pad_token_id, 1023);
    assert_false(ds_config_layer_is_moe(&c, 0));
    assert_true(ds_config_layer_is_moe(&c, 9));

    /* Root keys the loader does not keep. */
    json_error_t je;
    json_t *r = json_load_file(path, 0, &je);
    assert_non_null(r);
    assert_int_equal(json_integer_value(json_object_get(r, "media_placeholder_token_id")), 789);
    assert_string_equal(json_string_value(json_array_get(json_object_get(r, "architectures"), 0)),
                        "KimiK3ForConditionalGeneration");
    assert_true(json_is_object(json_object_get(r, "vision_config")));
    json_t *tc = json_object_get(r, "text_config");
    assert_string_equal(json_string_value(json_object_get(tc, "model_type")), "kimi_linear");
    assert_string_equal(json_string_value(json_object_get(tc, "topk_method")), "noaux_tc");
    json_decref(r);
}

static void test_k3_tensors(void **state) {
    (void)state;
    ds_st *st = open_dir(g_k3);
    const char *m = "language_model.model.";
    char n[256];
#define T(fmt, ...) (snprintf(n, sizeof n, fmt, __VA_ARGS__), n)
    const ds_dtype B = DS_DT_BF16, F = DS_DT_F32;

    /* 5 model-level + 10 x 6 per layer + 6 KDA x 14 + 4 MLA x 8 + dense 3 + 9 MoE x 32 */
    assert_int_equal(ds_st_count(st), 5 + 60 + 84 + 32 + 3 + 288);
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *t = ds_st_at(st, i);
        assert_int_equal(strncmp(t->name, "language_model.", 15), 0);
        if (t->dtype != (k3_is_f32(t->name) ? F : B)) fail_msg("%s: wrong dtype", t->name);
    }

    EXPECT(st, T("%sembed_tokens.weight", m), B, 1024, 64);
    EXPECT(st, "language_model.lm_head.weight", B, 1024, 64);
    EXPECT(st, T("%snorm.weight", m), B, 64);
    EXPECT(st, T("%soutput_attn_res_norm.weight", m), B, 64);
    EXPECT(st, T("%soutput_attn_res_proj.weight", m), B, 1, 64);

    for (int i = 0; i < 10; i++) { /* every layer: pre-norms and the two AttnRes pairs */
        EXPECT(st, T("%slayers.%d.input_layernorm.weight", m, i), B, 64);
        EXPECT(st, T("%slayers.%d.post_attention_layernorm.weight", m, i), B, 64);
        EXPECT(st, T("%slayers.%d.self_attention_res_norm.weight", m, i), B, 64);
        EXPECT(st, T("%slayers.%d.self_attention_res_proj.weight", m, i), B, 1, 64);
        EXPECT(st, T("%slayers.%d.mlp_res_norm.weight", m, i), B, 64);
        EXPECT(st, T("%slayers.%d.mlp_res_proj.weight", m, i), B, 1, 64);
    }

    static const int kda_layers[] = {0, 6}; /* first and last KDA layer */
    for (size_t k = 0; k < DS_ARRAY_LEN(kda_layers); k++) {
        int i = kda_layers[k];
        const char *qkv[] = {"q", "k", "v"};
        for (int j = 0; j < 3; j++) {
            EXPECT(st, T("%slayers.%d.self_attn.%s_proj.weight", m, i, qkv[j]), B, 64, 64);
            EXPECT(st, T("%slayers.%d.self_attn.%s_conv1d.weight", m, i, qkv[j]), F, 64, 1, 4);
        }
        EXPECT(st, T("%slayers.%d.self_attn.f_a_proj.weight", m, i), B, 16, 64);
        EXPECT(st, T("%slayers.%d.self_attn.f_b_proj.weight", m, i), B, 64, 16);
        EXPECT(st, T("%slayers.%d.self_attn.dt_bias", m, i), F, 64);
        EXPECT(st, T("%slayers.%d.self_attn.b_proj.weight", m, i), B, 4, 64);
        EXPECT(st, T("%slayers.%d.self_attn.g_proj.weight", m, i), B, 64, 64);
        expect_absent(st, T("%slayers.%d.self_attn.g_a_proj.weight", m, i));
        EXPECT(st, T("%slayers.%d.self_attn.o_norm.weight", m, i), F, 16);
        EXPECT(st, T("%slayers.%d.self_attn.o_proj.weight", m, i), B, 64, 64);

        /* A_log [8]: 4 live heads log(U(1,16)) in [0, ln 16), then zeros (the K3 trap). */
        const ds_tensor *a = EXPECT(st, T("%slayers.%d.self_attn.A_log", m, i), F, 8);
        const float *av = a->data;
        for (int h = 0; h < 4; h++) assert_true(av[h] > 0.0f && av[h] < logf(16.0f));
        for (int h = 4; h < 8; h++) assert_true(av[h] == 0.0f);
        assert_true(av[0] != av[1]);
    }
    EXPECT(st, T("%slayers.0.mlp.gate_proj.weight", m), B, 96, 64);
    EXPECT(st, T("%slayers.0.mlp.up_proj.weight", m), B, 96, 64);
    EXPECT(st, T("%slayers.0.mlp.down_proj.weight", m), B, 64, 96);
    expect_absent(st, T("%slayers.0.block_sparse_moe.gate.weight", m));

    static const int mla_layers[] = {3, 9};
    for (size_t k = 0; k < DS_ARRAY_LEN(mla_layers); k++) {
        int i = mla_layers[k];
        EXPECT(st, T("%slayers.%d.self_attn.q_a_proj.weight", m, i), B, 32, 64);
        EXPECT(st, T("%slayers.%d.self_attn.q_a_layernorm.weight", m, i), B, 32);
        EXPECT(st, T("%slayers.%d.self_attn.q_b_proj.weight", m, i), B, 4 * 24, 32);
        EXPECT(st, T("%slayers.%d.self_attn.kv_a_proj_with_mqa.weight", m, i), B, 40, 64);
        EXPECT(st, T("%slayers.%d.self_attn.kv_a_layernorm.weight", m, i), B, 32);
        EXPECT(st, T("%slayers.%d.self_attn.kv_b_proj.weight", m, i), B, 4 * 32, 32);
        EXPECT(st, T("%slayers.%d.self_attn.o_proj.weight", m, i), B, 64, 64);
        EXPECT(st, T("%slayers.%d.self_attn.g_proj.weight", m, i), B, 64, 64);
        expect_absent(st, T("%slayers.%d.self_attn.q_proj.weight", m, i));
        expect_absent(st, T("%slayers.%d.self_attn.A_log", m, i));
    }

    for (int i = 1; i < 10; i += 8) { /* MoE layers 1 and 9 (latent MoE) */
        char pre[160];
        snprintf(pre, sizeof pre, "%slayers.%d.block_sparse_moe.", m, i);
        EXPECT(st, T("%sgate.weight", pre), B, 8, 64);
        EXPECT(st, T("%sgate.e_score_correction_bias", pre), F, 8);
        EXPECT(st, T("%srouted_expert_down_proj.weight", pre), B, 32, 64);
        EXPECT(st, T("%srouted_expert_up_proj.weight", pre), B, 64, 32);
        EXPECT(st, T("%srouted_expert_norm.weight", pre), B, 32);
        EXPECT(st, T("%sexperts.0.w1.weight", pre), B, 32, 32);
        EXPECT(st, T("%sexperts.7.w2.weight", pre), B, 32, 32);
        EXPECT(st, T("%sexperts.7.w3.weight", pre), B, 32, 32);
        expect_absent(st, T("%sexperts.8.w1.weight", pre));
        EXPECT(st, T("%sshared_experts.gate_proj.weight", pre), B, 32, 64);
        EXPECT(st, T("%sshared_experts.up_proj.weight", pre), B, 32, 64);
        EXPECT(st, T("%sshared_experts.down_proj.weight", pre), B, 64, 32);
    }

    /* Values follow their init rule: N(0, 1/sqrt(cols)), norms 1 + 0.1 N, AttnRes proj N/sqrt(D).
     */
    double mean, sd;
    stats(ds_st_find(st, T("%sembed_tokens.weight", m)), &mean, &sd);
    assert_true(fabs(mean) < 0.01 && fabs(sd - 0.125) < 0.01);
    stats(ds_st_find(st, "language_model.lm_head.weight"), &mean, &sd);
    assert_true(fabs(sd - 0.125) < 0.01);
    stats(ds_st_find(st, T("%slayers.0.mlp.down_proj.weight", m)), &mean, &sd);
    assert_true(fabs(sd - 1.0 / sqrt(96.0)) < 0.01);
    stats(ds_st_find(st, T("%slayers.2.input_layernorm.weight", m)), &mean, &sd);
    assert_true(fabs(mean - 1.0) < 0.05 && sd > 0.05 && sd < 0.15);
    stats(ds_st_find(st, T("%slayers.2.self_attn.q_conv1d.weight", m)), &mean, &sd);
    assert_true(fabs(sd - 0.5) < 0.05);
    stats(ds_st_find(st, T("%slayers.4.self_attention_res_proj.weight", m)), &mean, &sd);
    assert_true(sd > 0.06 && sd < 0.2);
    /* Each tensor has its own stream: embed_tokens and lm_head differ. */
    const ds_tensor *e = ds_st_find(st, T("%sembed_tokens.weight", m));
    const ds_tensor *h = ds_st_find(st, "language_model.lm_head.weight");
    assert_memory_not_equal(e->data, h->data, e->nbytes);
#undef T
    ds_st_close(st);
}

static void test_k3_draft(void **state) {
    (void)state;
    char dir[4096], path[4096];
    path_in(dir, sizeof dir, g_k3, "draft");
    path_in(path, sizeof path, dir, "config.json");
    ds_draft_config d;
    ds_err err = {{0}};
    if (ds_draft_config_load(path, &d, &err) != DS_OK) fail_msg("%s", err.msg);
    assert_int_equal(d.hidden_size, 64);
    assert_int_equal(d.intermediate_size, 128);
    assert_int_equal(d.num_hidden_layers, 2);
    assert_int_equal(d.num_attention_heads, 4);
    assert_int_equal(d.q_lora_rank, 32);
    assert_int_equal(d.kv_lora_rank, 32);
    assert_int_equal(d.qk_nope_head_dim, 16);
    assert_int_equal(d.qk_rope_head_dim, 8);
    assert_int_equal(d.v_head_dim, 16);
    assert_int_equal(d.vocab_size, 1024);
    assert_float_equal(d.rms_norm_eps, 1e-5f, 1e-12);
    assert_float_equal(d.rope_theta, 50000.0, 0);
    assert_float_equal(d.rope_factor, 32.0, 0);
    assert_int_equal(d.rope_original_max_position_embeddings, 32768);
    assert_int_equal(d.num_target_layers, 3);
    assert_int_equal(d.target_hidden_size, 64);
    assert_int_equal(d.target_num_hidden_layers, 10);
    assert_int_equal(d.target_layer_ids[0], 1);
    assert_int_equal(d.target_layer_ids[1], 4);
    assert_int_equal(d.target_layer_ids[2], 8);
    assert_int_equal(d.mask_token_id, 768 + 253);
    assert_int_equal(d.markov_rank, 16);

    ds_st *st = open_dir(dir);
    const ds_dtype B = DS_DT_BF16;
    assert_int_equal(ds_st_count(st), 3 + 2 * 12 + 5); /* the 68-tensor manifest, scaled */
    for (int i = 0; i < ds_st_count(st); i++) assert_int_equal(ds_st_at(st, i)->dtype, B);
    EXPECT(st, "context_proj.weight", B, 64, 3 * 64);
    EXPECT(st, "context_norm.weight", B, 64);
    EXPECT(st, "final_norm.weight", B, 64);
    EXPECT(st, "layers.1.input_layernorm.weight", B, 64);
    EXPECT(st, "layers.1.post_attention_layernorm.weight", B, 64);
    EXPECT(st, "layers.1.self_attn.q_a_proj.weight", B, 32, 64);
    EXPECT(st, "layers.1.self_attn.q_a_layernorm.weight", B, 32);
    EXPECT(st, "layers.1.self_attn.q_b_proj.weight", B, 4 * 24, 32);
    EXPECT(st, "layers.1.self_attn.kv_a_proj_with_mqa.weight", B, 40, 64);
    EXPECT(st, "layers.1.self_attn.kv_a_layernorm.weight", B, 32);
    EXPECT(st, "layers.1.self_attn.kv_b_proj.weight", B, 4 * 32, 32);
    EXPECT(st, "layers.1.self_attn.o_proj.weight", B, 64, 64);
    expect_absent(st, "layers.1.self_attn.g_proj.weight");
    EXPECT(st, "layers.0.mlp.gate_proj.weight", B, 128, 64);
    EXPECT(st, "layers.0.mlp.down_proj.weight", B, 64, 128);
    EXPECT(st, "markov_head.markov_w1.weight", B, 1024, 16);
    EXPECT(st, "markov_head.markov_w2.weight", B, 1024, 16);
    EXPECT(st, "confidence_head.proj.weight", B, 1, 64 + 16);
    EXPECT(st, "confidence_head.proj.bias", B, 1);
    const ds_tensor *de = EXPECT(st, "embed_tokens.weight", B, 1024, 64);

    /* The draft's embedding is a byte-for-byte copy of the target's. */
    ds_st *tgt = open_dir(g_k3);
    const ds_tensor *te = ds_st_find(tgt, "language_model.model.embed_tokens.weight");
    assert_non_null(te);
    assert_int_equal(te->nbytes, de->nbytes);
    assert_memory_equal(te->data, de->data, te->nbytes);
    ds_st_close(tgt);
    ds_st_close(st);
}

/* ---- tiny-linear ------------------------------------------------------------------------------
 */

static void test_linear_config(void **state) {
    (void)state;
    char path[4096];
    ds_config c;
    ds_err err = {{0}};
    path_in(path, sizeof path, g_kl, "config.json");
    if (ds_config_load(path, &c, &err) != DS_OK) fail_msg("%s", err.msg);
    assert_string_equal(c.model_type, "kimi_linear");
    assert_string_equal(c.weight_prefix, "");
    assert_int_equal(c.vocab_size, 1024);
    assert_int_equal(c.hidden_size, 64);
    assert_int_equal(c.num_hidden_layers, 8);
    assert_int_equal(c.intermediate_size, 128);
    assert_int_equal(c.hidden_act, DS_ACT_SILU);
    assert_int_equal(c.q_lora_rank, 0);
    assert_int_equal(c.kv_lora_rank, 32);
    assert_false(c.mla_use_output_gate);
    assert_false(c.has_gate_lower_bound);
    assert_false(c.use_full_rank_gate);
    for (int i = 0; i < 8; i++)
        assert_int_equal(c.layer_kind[i], (i == 3 || i == 7) ? DS_LAYER_MLA : DS_LAYER_KDA);
    assert_int_equal(c.num_experts, 8);
    assert_int_equal(c.num_experts_per_token, 2);
    assert_float_equal(c.routed_scaling_factor, 2.446f, 1e-6);
    assert_int_equal(c.num_expert_group, 2);
    assert_int_equal(c.topk_group, 1);
    assert_int_equal(c.routed_expert_hidden_size, 0);
    assert_int_equal(c.attn_res_block_size, 0);
    assert_int_equal(c.bos_token_id, 768);
    assert_int_equal(c.eos_token_id, 770);
    assert_int_equal(c.pad_token_id, 1023);
}

static void test_linear_tensors(void **state) {
    (void)state;
    ds_st *st = open_dir(g_kl);
    const ds_dtype B = DS_DT_BF16, F = DS_DT_F32;
    /* 3 model-level + 8 x 2 norms + 6 KDA x 15 + 2 MLA x 5 + dense 3 + 7 MoE x 29 */
    assert_int_equal(ds_st_count(st), 3 + 16 + 90 + 10 + 3 + 203);
    EXPECT(st, "model.embed_tokens.weight", B, 1024, 64);
    EXPECT(st, "lm_head.weight", B, 1024, 64);
    EXPECT(st, "model.norm.weight", B, 64);
    expect_absent(st, "language_model.model.embed_tokens.weight");
    expect_absent(st, "model.output_attn_res_norm.weight");
    expect_absent(st, "model.layers.0.self_attention_res_proj.weight");

    /* KDA layer 1: low-rank output gate, A_log [1,1,4,1] all live, F32 conv and dt_bias. */
    EXPECT(st, "model.layers.1.self_attn.q_proj.weight", B, 64, 64);
    EXPECT(st, "model.layers.1.self_attn.v_conv1d.weight", F, 64, 1, 4);
    EXPECT(st, "model.layers.1.self_attn.f_a_proj.weight", B, 16, 64);
    EXPECT(st, "model.layers.1.self_attn.f_b_proj.weight", B, 64, 16);
    EXPECT(st, "model.layers.1.self_attn.dt_bias", F, 64);
    EXPECT(st, "model.layers.1.self_attn.b_proj.weight", B, 4, 64);
    EXPECT(st, "model.layers.1.self_attn.g_a_proj.weight", B, 16, 64);
    EXPECT(st, "model.layers.1.self_attn.g_b_proj.weight", B, 64, 16);
    expect_absent(st, "model.layers.1.self_attn.g_proj.weight");
    EXPECT(st, "model.layers.1.self_attn.o_norm.weight", B, 16);
    EXPECT(st, "model.layers.1.self_attn.o_proj.weight", B, 64, 64);
    const ds_tensor *a = EXPECT(st, "model.layers.1.self_attn.A_log", F, 1, 1, 4, 1);
    for (int h = 0; h < 4; h++) {
        float v = ((const float *)a->data)[h];
        assert_true(v > 0.0f && v < logf(16.0f));
    }

    /* MLA layer 7 (the last): single q_proj, no output gate. */
    EXPECT(st, "model.layers.7.self_attn.q_proj.weight", B, 4 * 24, 64);
    expect_absent(st, "model.layers.7.self_attn.q_a_proj.weight");
    EXPECT(st, "model.layers.7.self_attn.kv_a_proj_with_mqa.weight", B, 40, 64);
    EXPECT(st, "model.layers.7.self_attn.kv_a_layernorm.weight", B, 32);
    EXPECT(st, "model.layers.7.self_attn.kv_b_proj.weight", B, 4 * 32, 32);
    EXPECT(st, "model.layers.7.self_attn.o_proj.weight", B, 64, 64);
    expect_absent(st, "model.layers.7.self_attn.g_proj.weight");

    EXPECT(st, "model.layers.0.mlp.gate_proj.weight", B, 128, 64);
    EXPECT(st, "model.layers.0.mlp.down_proj.weight", B, 64, 128);
    EXPECT(st, "model.layers.5.block_sparse_moe.gate.weight", B, 8, 64);
    EXPECT(st, "model.layers.5.block_sparse_moe.gate.e_score_correction_bias", F, 8);
    EXPECT(st, "model.layers.5.block_sparse_moe.experts.3.w1.weight", B, 32, 64);
    EXPECT(st, "model.layers.5.block_sparse_moe.experts.3.w2.weight", B, 64, 32);
    EXPECT(st, "model.layers.5.block_sparse_moe.experts.3.w3.weight", B, 32, 64);
    EXPECT(st, "model.layers.5.block_sparse_moe.shared_experts.down_proj.weight", B, 64, 32);
    expect_absent(st, "model.layers.5.block_sparse_moe.routed_expert_norm.weight");
    ds_st_close(st);
}

static void test_linear_shards(void **state) {
    (void)state;
    assert_false(file_exists(g_kl, "model.safetensors"));
    assert_true(file_exists(g_kl, "model-00001-of-00002.safetensors"));
    assert_true(file_exists(g_kl, "model-00002-of-00002.safetensors"));
    assert_false(file_exists(g_kl, "model-00003-of-00002.safetensors"));
    assert_false(file_exists(g_kl, "draft"));

    char path[4096];
    path_in(path, sizeof path, g_kl, "model.safetensors.index.json");
    json_error_t je;
    json_t *idx = json_load_file(path, 0, &je);
    assert_non_null(idx);
    json_t *map = json_object_get(idx, "weight_map");
    ds_st *st = open_dir(g_kl);
    assert_int_equal(json_object_size(map), ds_st_count(st));

    /* Every tensor lives in the file the index names; both shards hold tensors; sizes add up. */
    int per_file[2] = {0, 0};
    int64_t total = 0;
    for (int i = 0; i < ds_st_count(st); i++) {
        const ds_tensor *t = ds_st_at(st, i);
        const char *f = json_string_value(json_object_get(map, t->name));
        assert_non_null(f);
        const char *base = strrchr(t->file, '/');
        assert_string_equal(base ? base + 1 : t->file, f);
        per_file[strcmp(f, "model-00002-of-00002.safetensors") == 0]++;
        total += (int64_t)t->nbytes;
    }
    assert_true(per_file[0] > 0 && per_file[1] > 0);
    json_t *ts = json_object_get(json_object_get(idx, "metadata"), "total_size");
    assert_int_equal(json_integer_value(ts), total);
    json_decref(idx);
    ds_st_close(st);
}

static void test_tokenizer_files(void **state) {
    (void)state;
    const char *dirs[2] = {g_k3, g_kl};
    for (int k = 0; k < 2; k++) {
        ds_tokenizer *tok = NULL;
        ds_err err = {{0}};
        if (ds_tok_load(dirs[k], &tok, &err) != DS_OK) fail_msg("%s", err.msg);
        assert_int_equal(ds_tok_n_ranks(tok), 768);
        assert_int_equal(ds_tok_vocab_size(tok), 1024);
        assert_int_equal(ds_tok_eos_id(tok), 770);
        ds_tok_free(tok);
    }
}

/* ---- determinism and rewriting ----------------------------------------------------------------
 */

static int same_file(const char *a_dir, const char *b_dir, const char *name) {
    char pa[4096], pb[4096];
    size_t na = 0, nb = 0;
    path_in(pa, sizeof pa, a_dir, name);
    path_in(pb, sizeof pb, b_dir, name);
    char *a = ds_read_file(pa, &na, NULL), *b = ds_read_file(pb, &nb, NULL);
    assert_non_null(a);
    assert_non_null(b);
    int same = na == nb && memcmp(a, b, na) == 0;
    free(a);
    free(b);
    return same;
}

static void test_determinism(void **state) {
    (void)state;
    char again[4096], other[4096], kl_again[4096];
    path_in(again, sizeof again, g_root, "k3_again");
    path_in(other, sizeof other, g_root, "k3_seed1");
    path_in(kl_again, sizeof kl_again, g_root, "kl_again");
    init_ok("tiny-k3", again, 0);
    init_ok("tiny-k3", other, 1);
    init_ok("tiny-linear", kl_again, 0);

    assert_true(same_file(g_k3, again, "model.safetensors"));
    assert_true(same_file(g_k3, again, "config.json"));
    assert_true(same_file(g_k3, again, "draft/model.safetensors"));
    assert_true(same_file(g_k3, again, "draft/config.json"));
    assert_true(same_file(g_k3, again, "tiktoken.model"));
    assert_true(same_file(g_kl, kl_again, "model-00001-of-00002.safetensors"));
    assert_true(same_file(g_kl, kl_again, "model-00002-of-00002.safetensors"));
    assert_true(same_file(g_kl, kl_again, "model.safetensors.index.json"));

    assert_false(same_file(g_k3, other, "model.safetensors"));
    assert_false(same_file(g_k3, other, "draft/model.safetensors"));
    assert_true(same_file(g_k3, other, "config.json"));
    /* A different seed changes values, not layout. */
    ds_st *a = open_dir(g_k3), *b = open_dir(other);
    assert_int_equal(ds_st_count(a), ds_st_count(b));
    const ds_tensor *ta = ds_st_find(a, "language_model.model.layers.3.self_attn.kv_b_proj.weight");
    const ds_tensor *tb = ds_st_find(b, "language_model.model.layers.3.self_attn.kv_b_proj.weight");
    assert_int_equal(ta->nbytes, tb->nbytes);
    assert_memory_not_equal(ta->data, tb->data, ta->nbytes);
    ds_st_close(a);
    ds_st_close(b);
}

/* Writing one preset over another leaves no stale weights that a loader would pick up. */
static void test_overwrite(void **state) {
    (void)state;
    char dir[4096];
    path_in(dir, sizeof dir, g_root, "swap");
    init_ok("tiny-k3", dir, 0);
    init_ok("tiny-linear", dir, 0);
    assert_false(file_exists(dir, "model.safetensors"));
    assert_false(file_exists(dir, "draft/config.json"));
    ds_st *st = open_dir(dir);
    assert_non_null(ds_st_find(st, "model.embed_tokens.weight"));
    ds_st_close(st);

    init_ok("tiny-k3", dir, 0);
    assert_false(file_exists(dir, "model.safetensors.index.json"));
    assert_false(file_exists(dir, "model-00001-of-00002.safetensors"));
    assert_true(same_file(g_k3, dir, "model.safetensors"));
    assert_true(same_file(g_k3, dir, "draft/model.safetensors"));
}

/* ---- the init-model command (needs the deltaserve executable: $DS_BIN) -------------------------
 */

/* Runs `$DS_BIN args 2>&1`; returns the exit status and the output in out[cap]. */
static int run_cli(const char *args, char *out, size_t cap) {
    const char *bin = getenv("DS_BIN");
    if (!bin || access(bin, X_OK) != 0)
        fail_msg("DS_BIN (%s) is not an executable deltaserve", bin ? bin : "unset");
    char cmd[8192];
    if ((size_t)snprintf(cmd, sizeof cmd, "'%s' %s 2>&1", bin, args) >= sizeof cmd) fail();
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_cli(void **state) {
    (void)state;
    char dir[4096], args[8192], out[16384];
    path_in(dir, sizeof dir, g_root, "cli");
    snprintf(args, sizeof args, "init-model --preset tiny-k3 --out '%s'", dir);
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    assert_true(same_file(g_k3, dir, "model.safetensors")); /* default seed 0 */
    assert_true(same_file(g_k3, dir, "config.json"));

    /* A non-empty folder needs --force; --seed=7 changes the weights. */
    snprintf(args, sizeof args, "init-model -p tiny-k3 -o '%s' --seed=7", dir);
    assert_int_equal(run_cli(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "--force"));
    snprintf(args, sizeof args, "init-model -p tiny-k3 -o '%s' --seed=7 --force", dir);
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    assert_false(same_file(g_k3, dir, "model.safetensors"));

    snprintf(args, sizeof args, "init-model --out '%s' --seed abc", dir);
    assert_int_equal(run_cli(args, out, sizeof out), 2);
    assert_non_null(strstr(out, "--seed: expected an integer, got 'abc'"));
    assert_int_equal(run_cli("init-model --out x --preset huge", out, sizeof out), 2);
    assert_non_null(strstr(out, "--preset: expected one of tiny-k3, tiny-linear, bench-large"));
    assert_int_equal(run_cli("init-model --out x --frobnicate 1", out, sizeof out), 2);
    assert_non_null(strstr(out, "unknown flag '--frobnicate'"));
    assert_int_equal(run_cli("init-model --seed 3", out, sizeof out), 2);
    assert_non_null(strstr(out, "--out is required"));

    assert_int_equal(run_cli("init-model --help", out, sizeof out), 0);
    assert_non_null(strstr(out, "bench-large"));
    assert_non_null(strstr(out, "--seed N"));
    assert_non_null(strstr(out, "(default: 0)"));
    assert_int_equal(run_cli("--help", out, sizeof out), 0);
    assert_non_null(strstr(out, "init-model"));
    assert_int_equal(run_cli("frobnicate", out, sizeof out), 2);
    assert_non_null(strstr(out, "unknown command 'frobnicate'"));
    assert_int_equal(run_cli("serve", out, sizeof out), 2); /* --model is required */
    assert_non_null(strstr(out, "--model"));
}

/* The device flags: bad values are refused with what was wrong; asking for a GPU where there is
 * none (a build without the backend, or no device) is an error that says so, never a crash;
 * random weights need only config.json and run. */
static void test_cli_device(void **state) {
    (void)state;
    char args[8192], out[16384];
    snprintf(args, sizeof args, "bench --model '%s' --batch-sizes 1,x", g_k3);
    assert_int_equal(run_cli(args, out, sizeof out), 2);
    assert_non_null(strstr(out, "--batch-sizes '1,x'"));
    snprintf(args, sizeof args, "bench --model '%s' --device gpu", g_k3);
    assert_int_equal(run_cli(args, out, sizeof out), 2);
    assert_non_null(strstr(out, "--device: expected one of cpu, cuda, auto"));
    snprintf(args, sizeof args,
             "bench --model '%s' --device cuda --prompt-tokens 8 --decode-steps 2 --reps 1", g_k3);
    assert_int_equal(run_cli(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "device cuda"));
    snprintf(args, sizeof args, "logits --model '%s' --token-ids 1,2 --out /dev/null --device cuda",
             g_k3);
    assert_int_equal(run_cli(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "device cuda"));
    snprintf(args, sizeof args, "serve --model '%s' --port 0 --device cuda", g_k3);
    assert_int_equal(run_cli(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "device cuda"));
    /* an unknown DS_DEVICE is named, not silently taken for the CPU */
    char env_args[8300];
    snprintf(env_args, sizeof env_args, "serve --model '%s' --port 0", g_k3);
    setenv("DS_DEVICE", "gpu", 1);
    int rc = run_cli(env_args, out, sizeof out);
    unsetenv("DS_DEVICE");
    assert_int_equal(rc, 2);
    assert_non_null(strstr(out, "DS_DEVICE=gpu"));
    /* random weights: a folder with only config.json */
    char dir[4096], cfg[4200], src[4200];
    path_in(dir, sizeof dir, g_root, "config-only");
    assert_int_equal(mkdir(dir, 0755), 0);
    snprintf(src, sizeof src, "%s/config.json", g_k3);
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    ds_err err = {{0}};
    size_t len;
    char *text = ds_read_file(src, &len, &err);
    assert_non_null(text);
    FILE *f = fopen(cfg, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, len, f), len);
    fclose(f);
    free(text);
    snprintf(args, sizeof args,
             "bench --model '%s' --load-format random --prompt-tokens 8 --decode-steps 2 --reps 1 "
             "--batch-sizes 1,2",
             dir);
    assert_int_equal(run_cli(args, out, sizeof out), 0);
    assert_non_null(strstr(out, "(random weights)"));
    assert_non_null(strstr(out, "decode batch 2"));
    snprintf(args, sizeof args, "bench --model '%s' --prompt-tokens 8", dir); /* no weights */
    assert_int_equal(run_cli(args, out, sizeof out), 1);
    assert_non_null(strstr(out, "safetensors"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_presets),       cmocka_unit_test(test_k3_config),
        cmocka_unit_test(test_k3_tensors),    cmocka_unit_test(test_k3_draft),
        cmocka_unit_test(test_linear_config), cmocka_unit_test(test_linear_tensors),
        cmocka_unit_test(test_linear_shards), cmocka_unit_test(test_tokenizer_files),
        cmocka_unit_test(test_determinism),   cmocka_unit_test(test_overwrite),
        cmocka_unit_test(test_cli),           cmocka_unit_test(test_cli_device),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
