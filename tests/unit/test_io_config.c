/* test_io_config.c — config.json parsing (docs/model.md §1, §2) and the DSpark draft config (§8.1).
 *
 * The good configs are modelled on the published Kimi-Linear-48B-A3B and K3 tables; each bad
 * input is a one-key mutation of a good config (made with jansson), so a failure points at exactly
 * the rule under test. */
#include "testutil.h"

#include "io/config.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- builders ---------------------------------------------------------------------------- */

/* 1-based layer lists: every `every`-th layer plus `extra` is MLA, the rest KDA. */
static void set_layer_lists(json_t *lin, int L, int every, const int *extra, int nextra) {
    json_t *kda = json_array(), *mla = json_array();
    for (int i = 1; i <= L; i++) {
        int is_mla = i % every == 0;
        for (int j = 0; j < nextra; j++) is_mla |= extra[j] == i;
        json_array_append_new(is_mla ? mla : kda, json_integer(i));
    }
    json_object_set_new(lin, "kda_layers", kda);
    json_object_set_new(lin, "full_attn_layers", mla);
}

static const char *const KL_JSON =
    "{\"architectures\": [\"KimiLinearForCausalLM\"], \"model_type\": \"kimi_linear\","
    " \"vocab_size\": 163840, \"hidden_size\": 2304, \"num_hidden_layers\": 27,"
    " \"intermediate_size\": 9216, \"rms_norm_eps\": 1e-05, \"hidden_act\": \"silu\","
    " \"num_attention_heads\": 32, \"num_key_value_heads\": 32, \"q_lora_rank\": null,"
    " \"kv_lora_rank\": 512, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64,"
    " \"v_head_dim\": 128, \"mla_use_nope\": true, \"rope_theta\": 10000.0, \"rope_scaling\": null,"
    " \"linear_attn_config\": {\"num_heads\": 32, \"head_dim\": 128,"
    "   \"short_conv_kernel_size\": 4},"
    " \"num_experts\": 256, \"num_experts_per_token\": 8, \"moe_intermediate_size\": 1024,"
    " \"num_shared_experts\": 1, \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1,"
    " \"moe_router_activation_func\": \"sigmoid\", \"moe_renormalize\": true,"
    " \"routed_scaling_factor\": 2.446, \"use_grouped_topk\": true, \"num_expert_group\": 1,"
    " \"topk_group\": 1, \"num_nextn_predict_layers\": 0, \"model_max_length\": 1048576,"
    " \"tie_word_embeddings\": false, \"bos_token_id\": 163584, \"eos_token_id\": 163585,"
    " \"pad_token_id\": 163839}";

static json_t *kl_root(void) {
    json_error_t je;
    json_t *r = json_loads(KL_JSON, 0, &je);
    assert_non_null(r);
    static const int last[] = {27};
    set_layer_lists(json_object_get(r, "linear_attn_config"), 27, 4, last, 1);
    return r;
}

static const char *const K3_JSON =
    "{\"architectures\": [\"KimiK3ForConditionalGeneration\"], \"model_type\": \"kimi_k3\","
    " \"bos_token_id\": 163584, \"eos_token_id\": 163586,"
    " \"media_placeholder_token_id\": 163605, \"tie_word_embeddings\": false,"
    " \"vision_config\": {\"hidden_size\": 1152},"
    " \"text_config\": {\"model_type\": \"kimi_linear\", \"vocab_size\": 163840,"
    "  \"hidden_size\": 7168, \"num_hidden_layers\": 93, \"intermediate_size\": 33792,"
    "  \"rms_norm_eps\": 1e-05, \"hidden_act\": \"situ\", \"activation_situ_beta\": 4.0,"
    "  \"activation_situ_linear_beta\": 25.0, \"num_attention_heads\": 96,"
    "  \"num_key_value_heads\": 96, \"q_lora_rank\": 1536, \"kv_lora_rank\": 512,"
    "  \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64, \"v_head_dim\": 128,"
    "  \"mla_use_nope\": true, \"mla_use_output_gate\": true,"
    "  \"linear_attn_config\": {\"num_heads\": 96, \"head_dim\": 128,"
    "    \"short_conv_kernel_size\": 4, \"gate_lower_bound\": -5.0, \"use_full_rank_gate\": true},"
    "  \"num_experts\": 896, \"num_experts_per_token\": 16, \"moe_intermediate_size\": 3072,"
    "  \"num_shared_experts\": 2, \"first_k_dense_replace\": 1, \"moe_layer_freq\": 1,"
    "  \"moe_router_activation_func\": \"sigmoid\", \"moe_renormalize\": true,"
    "  \"routed_scaling_factor\": 1.0, \"use_grouped_topk\": true, \"num_expert_group\": 1,"
    "  \"topk_group\": 1, \"topk_method\": \"noaux_tc\", \"routed_expert_hidden_size\": 3584,"
    "  \"latent_moe_use_norm\": true, \"attn_res_block_size\": 12,"
    "  \"num_nextn_predict_layers\": 0, \"max_position_embeddings\": 1048576,"
    "  \"eos_token_id\": 163585, \"pad_token_id\": 163839}}";

static json_t *k3_root(void) {
    json_error_t je;
    json_t *r = json_loads(K3_JSON, 0, &je);
    assert_non_null(r);
    /* full_attn_layers [4, 8, ..., 88, 92, 93]: 92 is a multiple of 4, 93 the extra */
    static const int last[] = {93};
    set_layer_lists(json_object_get(json_object_get(r, "text_config"), "linear_attn_config"), 93, 4,
                    last, 1);
    return r;
}

/* Serialises and parses `root` (consumed) under the name "config.json". */
static int parse_root(json_t *root, ds_config *c, ds_err *e) {
    char *s = json_dumps(root, 0);
    assert_non_null(s);
    memset(e, 0, sizeof *e);
    int rc = ds_config_parse(s, "config.json", c, e);
    free(s);
    json_decref(root);
    return rc;
}

static void assert_contains(const char *msg, const char *needle) {
    if (!strstr(msg, needle)) fail_msg("message \"%s\" does not contain \"%s\"", msg, needle);
}

/* Expects DS_ERR with every needle in the message. */
static void expect_err(json_t *root, const char *n1, const char *n2) {
    ds_config c;
    ds_err e;
    int rc = parse_root(root, &c, &e);
    if (rc != DS_ERR) fail_msg("expected an error containing '%s'", n1);
    if (getenv("DS_TEST_VERBOSE")) fprintf(stderr, "%s\n", e.msg);
    assert_contains(e.msg, n1);
    if (n2) assert_contains(e.msg, n2);
}

static json_t *k3_text(json_t *r) {
    return json_object_get(r, "text_config");
}

/* ---- good configs ------------------------------------------------------------------------ */

static void test_kimi_linear(void **state) {
    (void)state;
    ds_config c;
    ds_err e;
    assert_int_equal(parse_root(kl_root(), &c, &e), DS_OK);
    assert_string_equal(c.model_type, "kimi_linear");
    assert_string_equal(c.weight_prefix, "");
    assert_int_equal(c.vocab_size, 163840);
    assert_int_equal(c.hidden_size, 2304);
    assert_int_equal(c.num_hidden_layers, 27);
    assert_int_equal(c.intermediate_size, 9216);
    assert_float_equal(c.rms_norm_eps, 1e-5f, 1e-12);
    assert_int_equal(c.hidden_act, DS_ACT_SILU);
    assert_float_equal(c.situ_beta, 1.0f, 0);        /* absent -> 1.0 */
    assert_float_equal(c.situ_linear_beta, 0.0f, 0); /* absent -> identity */
    assert_int_equal(c.num_attention_heads, 32);
    assert_int_equal(c.q_lora_rank, 0); /* null -> single q_proj */
    assert_int_equal(c.kv_lora_rank, 512);
    assert_int_equal(c.qk_nope_head_dim, 128);
    assert_int_equal(c.qk_rope_head_dim, 64);
    assert_int_equal(c.v_head_dim, 128);
    assert_int_equal(c.mla_use_nope, 1);
    assert_int_equal(c.mla_use_output_gate, 0);
    assert_int_equal(c.kda_num_heads, 32);
    assert_int_equal(c.kda_head_dim, 128);
    assert_int_equal(c.short_conv_kernel_size, 4);
    assert_int_equal(c.has_gate_lower_bound, 0);
    assert_int_equal(c.use_full_rank_gate, 0);
    /* MLA at 0-based 3, 7, ..., 23 and 26 (docs/model.md §2) */
    for (int i = 0; i < 27; i++) {
        int mla = (i + 1) % 4 == 0 || i == 26;
        assert_int_equal(c.layer_kind[i], mla ? DS_LAYER_MLA : DS_LAYER_KDA);
    }
    assert_int_equal(c.num_kda_layers, 20);
    assert_int_equal(c.num_mla_layers, 7);
    assert_int_equal(c.num_experts, 256);
    assert_int_equal(c.num_experts_per_token, 8);
    assert_int_equal(c.moe_intermediate_size, 1024);
    assert_int_equal(c.num_shared_experts, 1);
    assert_float_equal(c.routed_scaling_factor, 2.446f, 1e-6);
    assert_int_equal(c.routed_expert_hidden_size, 0);
    assert_int_equal(c.attn_res_block_size, 0);
    assert_int_equal(c.max_position_embeddings, 1048576); /* from model_max_length */
    assert_int_equal(c.bos_token_id, 163584);
    assert_int_equal(c.eos_token_id, 163585);
    assert_int_equal(c.pad_token_id, 163839);
    /* dense layer 0, MoE 1..26 */
    assert_int_equal(ds_config_layer_is_moe(&c, 0), 0);
    assert_int_equal(ds_config_layer_is_moe(&c, 1), 1);
    assert_int_equal(ds_config_layer_is_moe(&c, 26), 1);
    assert_int_equal(ds_config_layer_is_moe(&c, 27), 0);
}

static void test_k3_nested(void **state) {
    (void)state;
    json_t *r = k3_root();
    json_object_del(k3_text(r), "pad_token_id");
    json_object_set_new(k3_text(r), "pad_token_id", json_integer(7)); /* root has none: fallback */
    ds_config c;
    ds_err e;
    assert_int_equal(parse_root(r, &c, &e), DS_OK);
    assert_string_equal(c.model_type, "kimi_k3");
    assert_string_equal(c.weight_prefix, "language_model.");
    assert_int_equal(c.hidden_size, 7168);
    assert_int_equal(c.num_hidden_layers, 93);
    assert_int_equal(c.hidden_act, DS_ACT_SITU);
    assert_float_equal(c.situ_beta, 4.0f, 0);
    assert_float_equal(c.situ_linear_beta, 25.0f, 0);
    assert_int_equal(c.q_lora_rank, 1536);
    assert_int_equal(c.mla_use_output_gate, 1);
    assert_int_equal(c.kda_num_heads, 96);
    assert_int_equal(c.has_gate_lower_bound, 1);
    assert_float_equal(c.gate_lower_bound, -5.0f, 0);
    assert_int_equal(c.use_full_rank_gate, 1);
    assert_int_equal(c.num_kda_layers, 69);
    assert_int_equal(c.num_mla_layers, 24);
    assert_int_equal(c.layer_kind[3], DS_LAYER_MLA);
    assert_int_equal(c.layer_kind[87], DS_LAYER_MLA);
    assert_int_equal(c.layer_kind[88], DS_LAYER_KDA);
    assert_int_equal(c.layer_kind[90], DS_LAYER_KDA);
    assert_int_equal(c.layer_kind[91], DS_LAYER_MLA); /* the last two are both MLA */
    assert_int_equal(c.layer_kind[92], DS_LAYER_MLA);
    assert_int_equal(c.num_experts, 896);
    assert_int_equal(c.num_experts_per_token, 16);
    assert_int_equal(c.num_shared_experts, 2);
    assert_float_equal(c.routed_scaling_factor, 1.0f, 0);
    assert_int_equal(c.routed_expert_hidden_size, 3584);
    assert_int_equal(c.latent_moe_use_norm, 1);
    assert_int_equal(c.attn_res_block_size, 12);
    assert_int_equal(c.max_position_embeddings, 1048576);
    assert_int_equal(c.eos_token_id, 163586); /* root wins over text_config's 163585 */
    assert_int_equal(c.bos_token_id, 163584);
    assert_int_equal(c.pad_token_id, 7);
    assert_int_equal(ds_config_layer_is_moe(&c, 0), 0);
    assert_int_equal(ds_config_layer_is_moe(&c, 1), 1);
    assert_int_equal(ds_config_layer_is_moe(&c, 92), 1);
}

/* Where §1 lists two defaults, each family takes its own config class's value. */
static void test_defaults(void **state) {
    (void)state;
    static const char *const drop[] = {
        "rms_norm_eps", "routed_scaling_factor", "first_k_dense_replace", "bos_token_id",
        "eos_token_id", "pad_token_id",          "num_key_value_heads",   "hidden_act",
        "vocab_size",   "moe_layer_freq"};
    json_t *r = kl_root();
    for (size_t i = 0; i < DS_ARRAY_LEN(drop); i++) json_object_del(r, drop[i]);
    json_object_del(json_object_get(r, "linear_attn_config"), "num_heads");
    json_object_del(json_object_get(r, "linear_attn_config"), "short_conv_kernel_size");
    json_object_set_new(r, "num_experts", json_null()); /* null -> no MoE */
    json_object_set_new(r, "num_attention_heads", json_integer(16));
    ds_config c;
    ds_err e;
    assert_int_equal(parse_root(r, &c, &e), DS_OK);
    assert_float_equal(c.rms_norm_eps, 1e-5f, 1e-12);
    assert_float_equal(c.routed_scaling_factor, 2.446f, 1e-6);
    assert_int_equal(c.first_k_dense_replace, 1);
    assert_int_equal(c.bos_token_id, 163584);
    assert_int_equal(c.eos_token_id, 163586);
    assert_int_equal(c.pad_token_id, 163839);
    assert_int_equal(c.num_key_value_heads, 16); /* = Ha */
    assert_int_equal(c.kda_num_heads, 16);       /* = Ha */
    assert_int_equal(c.short_conv_kernel_size, 4);
    assert_int_equal(c.hidden_act, DS_ACT_SILU);
    assert_int_equal(c.vocab_size, 163840);
    assert_int_equal(c.moe_layer_freq, 1);
    assert_int_equal(c.num_experts, 0);
    for (int i = 0; i < 27; i++) assert_int_equal(ds_config_layer_is_moe(&c, i), 0);

    r = k3_root();
    json_t *t = k3_text(r);
    for (size_t i = 0; i < 3; i++) json_object_del(t, drop[i]);
    json_object_del(t, "activation_situ_beta");
    json_object_set_new(t, "activation_situ_linear_beta", json_null());
    json_object_set_new(t, "attn_res_block_size", json_null());
    json_object_set_new(t, "routed_expert_hidden_size", json_null());
    json_object_del(json_object_get(t, "linear_attn_config"), "gate_lower_bound");
    assert_int_equal(parse_root(r, &c, &e), DS_OK);
    assert_float_equal(c.rms_norm_eps, 1e-6f, 1e-13);
    assert_float_equal(c.routed_scaling_factor, 1.0f, 0);
    assert_int_equal(c.first_k_dense_replace, 0);
    assert_int_equal(ds_config_layer_is_moe(&c, 0), 1);
    assert_float_equal(c.situ_beta, 1.0f, 0);
    assert_float_equal(c.situ_linear_beta, 0.0f, 0);
    assert_int_equal(c.attn_res_block_size, 0);
    assert_int_equal(c.routed_expert_hidden_size, 0);
    assert_int_equal(c.has_gate_lower_bound, 0);
}

static void test_moe_layer_freq(void **state) {
    (void)state;
    json_t *r = kl_root();
    json_object_set_new(r, "moe_layer_freq", json_integer(2));
    json_object_set_new(r, "first_k_dense_replace", json_integer(3));
    ds_config c;
    ds_err e;
    assert_int_equal(parse_root(r, &c, &e), DS_OK);
    int expect[8] = {0, 0, 0, 0, 1, 0, 1, 0};
    for (int i = 0; i < 8; i++) assert_int_equal(ds_config_layer_is_moe(&c, i), expect[i]);
    assert_int_equal(ds_config_layer_is_moe(&c, -1), 0);
}

static void test_deepseek_aliases(void **state) {
    (void)state;
    json_t *r = kl_root();
    static const char *const drop[] = {
        "num_experts",     "num_experts_per_token",      "num_expert_group",
        "moe_renormalize", "moe_router_activation_func", "num_shared_experts"};
    for (size_t i = 0; i < DS_ARRAY_LEN(drop); i++) json_object_del(r, drop[i]);
    json_object_set_new(r, "n_routed_experts", json_integer(64));
    json_object_set_new(r, "num_experts_per_tok", json_integer(6));
    json_object_set_new(r, "n_group", json_integer(8));
    json_object_set_new(r, "topk_group", json_integer(4));
    json_object_set_new(r, "norm_topk_prob", json_false());
    json_object_set_new(r, "scoring_func", json_string("sigmoid"));
    json_object_set_new(r, "n_shared_experts", json_integer(2));
    ds_config c;
    ds_err e;
    assert_int_equal(parse_root(json_deep_copy(r), &c, &e), DS_OK);
    assert_int_equal(c.num_experts, 64);
    assert_int_equal(c.num_experts_per_token, 6);
    assert_int_equal(c.num_expert_group, 8);
    assert_int_equal(c.topk_group, 4);
    assert_int_equal(c.moe_renormalize, 0);
    assert_int_equal(c.num_shared_experts, 2);

    json_t *r2 = json_deep_copy(r);
    json_object_set_new(r2, "scoring_func", json_string("softmax"));
    expect_err(r2, "scoring_func", "softmax");
    r2 = json_deep_copy(r);
    json_object_set_new(r2, "num_experts", json_integer(32)); /* disagrees with n_routed_experts */
    expect_err(r2, "num_experts", "n_routed_experts");
    json_decref(r);
}

/* ---- bad configs ------------------------------------------------------------------------- */

static void test_malformed_json(void **state) {
    (void)state;
    ds_config c;
    ds_err e;
    assert_int_equal(ds_config_parse("{\"model_type\": \"kimi_linear\",\n \"hidden_size\": }",
                                     "dir/config.json", &c, &e),
                     DS_ERR);
    assert_contains(e.msg, "dir/config.json");
    assert_contains(e.msg, "line 2");
    assert_int_equal(ds_config_parse("[1, 2]", "config.json", &c, &e), DS_ERR);
    assert_contains(e.msg, "array");
}

static void test_missing_keys(void **state) {
    (void)state;
    static const char *const required[] = {
        "hidden_size",         "num_hidden_layers",  "intermediate_size",
        "num_attention_heads", "kv_lora_rank",       "qk_nope_head_dim",
        "v_head_dim",          "linear_attn_config", "model_type"};
    for (size_t i = 0; i < DS_ARRAY_LEN(required); i++) {
        json_t *r = kl_root();
        json_object_del(r, required[i]);
        char want[96];
        snprintf(want, sizeof want, "missing required key '%s'", required[i]);
        expect_err(r, "config.json", want);
    }
    json_t *r = kl_root();
    json_object_del(json_object_get(r, "linear_attn_config"), "kda_layers");
    expect_err(r, "missing required key 'linear_attn_config.kda_layers'", NULL);
    r = kl_root();
    json_object_del(json_object_get(r, "linear_attn_config"), "head_dim");
    expect_err(r, "linear_attn_config.head_dim", NULL);
    r = k3_root();
    json_object_del(k3_text(r), "hidden_size");
    expect_err(r, "missing required key 'text_config.hidden_size'", NULL);
    r = k3_root();
    json_object_del(r, "text_config");
    expect_err(r, "missing required key 'text_config'", NULL);
    /* MoE keys are required only with experts */
    r = kl_root();
    json_object_del(r, "moe_intermediate_size");
    expect_err(r, "moe_intermediate_size", NULL);
}

static void test_wrong_types(void **state) {
    (void)state;
    json_t *r = kl_root();
    json_object_set_new(r, "hidden_size", json_string("2304"));
    expect_err(r, "'hidden_size': expected integer, found string", NULL);
    r = kl_root();
    json_object_set_new(r, "hidden_size", json_real(2304.5));
    expect_err(r, "hidden_size", "real");
    r = kl_root();
    json_object_set_new(r, "mla_use_nope", json_integer(1));
    expect_err(r, "'mla_use_nope': expected boolean, found integer", NULL);
    r = kl_root();
    json_object_set_new(r, "rms_norm_eps", json_string("1e-5"));
    expect_err(r, "rms_norm_eps", "expected number, found string");
    r = kl_root();
    json_object_set_new(r, "linear_attn_config", json_array());
    expect_err(r, "linear_attn_config", "expected object, found array");
    r = kl_root();
    json_object_set_new(json_object_get(r, "linear_attn_config"), "kda_layers", json_string("1"));
    expect_err(r, "linear_attn_config.kda_layers", "expected array");
    r = kl_root();
    json_array_set_new(json_object_get(json_object_get(r, "linear_attn_config"), "kda_layers"), 0,
                       json_string("1"));
    expect_err(r, "kda_layers", "string");
    r = k3_root();
    json_object_set_new(k3_text(r), "num_experts", json_string("many"));
    expect_err(r, "text_config.num_experts", "string");
    /* an integral real is an integer */
    r = kl_root();
    json_object_set_new(r, "hidden_size", json_real(2304.0));
    ds_config c;
    ds_err e;
    assert_int_equal(parse_root(r, &c, &e), DS_OK);
    assert_int_equal(c.hidden_size, 2304);
}

static void test_model_type(void **state) {
    (void)state;
    json_t *r = kl_root();
    json_object_set_new(r, "model_type", json_string("llama"));
    expect_err(r, "model_type", "llama");
    r = k3_root();
    json_object_set_new(r, "model_type", json_string("kimi_linear")); /* nested needs kimi_k3 */
    expect_err(r, "model_type", "kimi_k3");
    r = k3_root();
    json_object_set_new(k3_text(r), "model_type", json_string("deepseek_v3"));
    expect_err(r, "text_config.model_type", "deepseek_v3");
}

static void test_layer_lists(void **state) {
    (void)state;
    /* layer 5 (1-based) in neither list */
    json_t *r = kl_root();
    json_t *kda = json_object_get(json_object_get(r, "linear_attn_config"), "kda_layers");
    assert_int_equal(json_integer_value(json_array_get(kda, 3)), 5);
    json_array_remove(kda, 3);
    expect_err(r, "layer 5 ", "neither");
    /* out of range */
    r = kl_root();
    json_array_append_new(
        json_object_get(json_object_get(r, "linear_attn_config"), "full_attn_layers"),
        json_integer(28));
    expect_err(r, "full_attn_layers", "28");
    r = kl_root();
    json_array_append_new(json_object_get(json_object_get(r, "linear_attn_config"), "kda_layers"),
                          json_integer(0));
    expect_err(r, "kda_layers", "layer 0 out of range");
    /* in both */
    r = kl_root();
    json_array_append_new(json_object_get(json_object_get(r, "linear_attn_config"), "kda_layers"),
                          json_integer(4));
    expect_err(r, "layer 4 ", "both");
    /* twice in one list */
    r = kl_root();
    json_array_append_new(json_object_get(json_object_get(r, "linear_attn_config"), "kda_layers"),
                          json_integer(1));
    expect_err(r, "kda_layers", "twice");
    /* K3 nested: the path names text_config */
    r = k3_root();
    json_t *lin = json_object_get(k3_text(r), "linear_attn_config");
    json_array_append_new(json_object_get(lin, "full_attn_layers"), json_integer(94));
    expect_err(r, "text_config.linear_attn_config.full_attn_layers", "94");
}

static void test_consistency(void **state) {
    (void)state;
    json_t *r = kl_root();
    json_object_set_new(r, "num_experts_per_token", json_integer(300));
    expect_err(r, "num_experts_per_token", "300");
    r = kl_root();
    json_object_set_new(r, "num_expert_group", json_integer(3)); /* 256 % 3 != 0 */
    expect_err(r, "num_expert_group", "divide");
    r = kl_root();
    json_object_set_new(r, "num_expert_group", json_integer(4));
    json_object_set_new(r, "topk_group", json_integer(5));
    expect_err(r, "topk_group", "5");
    r = kl_root();
    json_object_set_new(r, "num_expert_group", json_integer(64)); /* groups of 4 experts */
    json_object_set_new(r, "topk_group", json_integer(1));        /* only 4 reachable, k = 8 */
    expect_err(r, "num_experts_per_token", "topk_group");
    r = kl_root();
    json_object_set_new(r, "num_hidden_layers", json_integer(300));
    expect_err(r, "num_hidden_layers", "300");
    r = kl_root();
    json_object_set_new(r, "hidden_size", json_integer(0));
    expect_err(r, "hidden_size", "found 0");
    r = kl_root();
    json_object_set_new(r, "hidden_act", json_string("gelu"));
    expect_err(r, "hidden_act", "gelu");
    r = kl_root();
    json_object_set_new(r, "activation_situ_beta", json_real(-1.0));
    expect_err(r, "activation_situ_beta", NULL);
    r = kl_root();
    json_object_set_new(r, "kv_lora_rank", json_null()); /* null with MLA layers present */
    expect_err(r, "kv_lora_rank", "MLA");
    r = kl_root();
    json_object_set_new(r, "hidden_size", json_integer(1LL << 40));
    expect_err(r, "hidden_size", "int");
}

static void test_load_file(void **state) {
    (void)state;
    char *dir = ds_test_tmpdir();
    assert_non_null(dir);
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_t *r = k3_root();
    char *s = json_dumps(r, JSON_INDENT(2));
    json_decref(r);
    assert_int_equal(ds_test_write_file(path, s, strlen(s)), 0);
    free(s);
    ds_config c;
    ds_err e;
    assert_int_equal(ds_config_load(path, &c, &e), DS_OK);
    assert_int_equal(c.num_mla_layers, 24);
    /* a broken file names its path and the position */
    const char *bad = "{\n  \"model_type\": \"kimi_linear\",\n  \"hidden_size\": 12,,\n}";
    assert_int_equal(ds_test_write_file(path, bad, strlen(bad)), 0);
    assert_int_equal(ds_config_load(path, &c, &e), DS_ERR);
    assert_contains(e.msg, path);
    assert_contains(e.msg, "line 3");
    unlink(path);
    assert_int_equal(ds_config_load(path, &c, &e), DS_ERR);
    assert_contains(e.msg, path);
    rmdir(dir);
    free(dir);
}

/* ---- DSpark draft ------------------------------------------------------------------------ */

static const char *const DRAFT_JSON =
    "{\"hidden_size\": 7168, \"intermediate_size\": 14336, \"num_hidden_layers\": 5,"
    " \"num_attention_heads\": 64, \"num_key_value_heads\": 64, \"q_lora_rank\": 1536,"
    " \"kv_lora_rank\": 512, \"qk_nope_head_dim\": 128, \"qk_rope_head_dim\": 64,"
    " \"v_head_dim\": 128, \"mla_use_nope\": false, \"mla_use_output_gate\": false,"
    " \"vocab_size\": 163840, \"draft_vocab_size\": 163840, \"rms_norm_eps\": 1e-05,"
    " \"max_position_embeddings\": 1048576, \"rope_theta\": 50000,"
    " \"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 32,"
    "   \"original_max_position_embeddings\": 32768, \"rope_theta\": 50000, \"beta_fast\": 32,"
    "   \"beta_slow\": 1, \"mscale\": 1.0, \"mscale_all_dim\": 1.0},"
    " \"num_target_layers\": 5, \"target_hidden_size\": 7168, \"target_num_hidden_layers\": 93,"
    " \"target_layer_ids\": [2, 23, 47, 71, 89], \"mask_token_id\": 163837,"
    " \"markov_rank\": 256, \"markov_head_type\": \"vanilla\", \"enable_confidence_head\": true,"
    " \"confidence_head_with_markov\": true}";

static json_t *draft_root(void) {
    json_error_t je;
    json_t *r = json_loads(DRAFT_JSON, 0, &je);
    assert_non_null(r);
    return r;
}

static int parse_draft(json_t *root, ds_draft_config *c, ds_err *e) {
    char *s = json_dumps(root, 0);
    memset(e, 0, sizeof *e);
    int rc = ds_draft_config_parse(s, "draft/config.json", c, e);
    free(s);
    json_decref(root);
    return rc;
}

static void expect_draft_err(json_t *root, const char *n1, const char *n2) {
    ds_draft_config c;
    ds_err e;
    if (parse_draft(root, &c, &e) != DS_ERR) fail_msg("expected an error containing '%s'", n1);
    if (getenv("DS_TEST_VERBOSE")) fprintf(stderr, "%s\n", e.msg);
    assert_contains(e.msg, "draft/config.json");
    assert_contains(e.msg, n1);
    if (n2) assert_contains(e.msg, n2);
}

static void test_draft(void **state) {
    (void)state;
    ds_draft_config c;
    ds_err e;
    assert_int_equal(parse_draft(draft_root(), &c, &e), DS_OK);
    assert_int_equal(c.hidden_size, 7168);
    assert_int_equal(c.num_hidden_layers, 5);
    assert_int_equal(c.num_attention_heads, 64);
    assert_int_equal(c.q_lora_rank, 1536);
    assert_int_equal(c.kv_lora_rank, 512);
    assert_float_equal(c.rope_theta, 50000.0, 0);
    assert_float_equal(c.rope_factor, 32.0, 0);
    assert_float_equal(c.rope_beta_fast, 32.0, 0);
    assert_float_equal(c.rope_beta_slow, 1.0, 0);
    assert_float_equal(c.rope_mscale_all_dim, 1.0, 0);
    assert_int_equal(c.rope_original_max_position_embeddings, 32768);
    assert_int_equal(c.num_target_layers, 5);
    int ids[5] = {2, 23, 47, 71, 89};
    for (int i = 0; i < 5; i++) assert_int_equal(c.target_layer_ids[i], ids[i]);
    assert_int_equal(c.mask_token_id, 163837);
    assert_int_equal(c.markov_rank, 256);
    assert_int_equal(c.fc_norm, 0);
    assert_int_equal(c.aux_hidden_stream_attn_res, 0);

    /* older rope_scaling spelling, TorchSpec keys, -1 tap */
    json_t *r = draft_root();
    json_t *rp = json_deep_copy(json_object_get(r, "rope_parameters"));
    json_object_del(rp, "rope_type");
    json_object_set_new(rp, "type", json_string("yarn"));
    json_object_set_new(rp, "factor", json_real(8.0));
    json_object_del(rp, "mscale_all_dim");
    json_object_del(r, "rope_parameters");
    json_object_set_new(r, "rope_scaling", rp);
    json_object_set_new(r, "fc_norm", json_true());
    json_object_set_new(r, "aux_hidden_stream", json_string("attn_res"));
    json_array_set_new(json_object_get(r, "target_layer_ids"), 0, json_integer(-1));
    assert_int_equal(parse_draft(r, &c, &e), DS_OK);
    assert_float_equal(c.rope_factor, 8.0, 0);
    assert_float_equal(c.rope_mscale_all_dim, 0.0, 0); /* DeepSeek default */
    assert_int_equal(c.fc_norm, 1);
    assert_int_equal(c.aux_hidden_stream_attn_res, 1);
    assert_int_equal(c.target_layer_ids[0], -1);

    /* no rope parameters: plain RoPE */
    r = draft_root();
    json_object_del(r, "rope_parameters");
    assert_int_equal(parse_draft(r, &c, &e), DS_OK);
    assert_float_equal(c.rope_factor, 1.0, 0);
}

static void test_draft_bad(void **state) {
    (void)state;
    json_t *r = draft_root();
    json_array_append_new(json_object_get(r, "target_layer_ids"), json_integer(90));
    expect_draft_err(r, "target_layer_ids", "expected 5 entries");
    r = draft_root();
    json_array_set_new(json_object_get(r, "target_layer_ids"), 2, json_integer(23));
    expect_draft_err(r, "target_layer_ids", "ascending");
    r = draft_root();
    json_array_set_new(json_object_get(r, "target_layer_ids"), 4, json_integer(93));
    expect_draft_err(r, "target_layer_ids", "93");
    r = draft_root();
    json_array_set_new(json_object_get(r, "target_layer_ids"), 0, json_integer(-2));
    expect_draft_err(r, "target_layer_ids", "-2");
    r = draft_root();
    json_object_set_new(r, "mask_token_id", json_integer(163840));
    expect_draft_err(r, "mask_token_id", "163840");
    r = draft_root();
    json_object_set_new(r, "markov_rank", json_integer(0));
    expect_draft_err(r, "markov_rank", NULL);
    r = draft_root();
    json_object_del(r, "kv_lora_rank");
    expect_draft_err(r, "kv_lora_rank", "GQA");
    r = draft_root();
    json_object_set_new(r, "mla_use_nope", json_true());
    expect_draft_err(r, "mla_use_nope", NULL);
    r = draft_root();
    json_object_set_new(r, "aux_hidden_stream", json_string("residual"));
    expect_draft_err(r, "aux_hidden_stream", "residual");
    r = draft_root();
    json_object_set_new(r, "draft_vocab_size", json_integer(32000));
    expect_draft_err(r, "draft_vocab_size", "32000");
    r = draft_root();
    json_object_set_new(json_object_get(r, "rope_parameters"), "rope_type", json_string("llama3"));
    expect_draft_err(r, "rope_parameters.rope_type", "llama3");
    r = draft_root();
    json_object_del(r, "mask_token_id");
    expect_draft_err(r, "missing required key 'mask_token_id'", NULL);
    r = draft_root();
    json_object_set_new(r, "num_target_layers", json_string("5"));
    expect_draft_err(r, "num_target_layers", "string");
}

/* The shipped shapes under configs/ parse as the model notes list them, MXFP4 included. */
static void test_shipped_configs(void **state) {
    (void)state;
    ds_config c;
    ds_err err = {{0}};
    char *p = ds_test_src_path("configs/kimi-k3-slice4/config.json");
    if (ds_config_load(p, &c, &err)) fail_msg("%s", err.msg);
    free(p);
    assert_int_equal(c.hidden_size, 7168);
    assert_int_equal(c.num_experts, 896);
    assert_int_equal(c.routed_expert_hidden_size, 3584);
    assert_int_equal(c.mxfp4_experts, 1);
    assert_int_equal(c.num_kda_layers, 3);
    p = ds_test_src_path("configs/kimi-linear-48b-a3b/config.json");
    if (ds_config_load(p, &c, &err)) fail_msg("%s", err.msg);
    free(p);
    assert_int_equal(c.hidden_size, 2304);
    assert_int_equal(c.mxfp4_experts, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kimi_linear),
        cmocka_unit_test(test_k3_nested),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_moe_layer_freq),
        cmocka_unit_test(test_deepseek_aliases),
        cmocka_unit_test(test_malformed_json),
        cmocka_unit_test(test_missing_keys),
        cmocka_unit_test(test_wrong_types),
        cmocka_unit_test(test_model_type),
        cmocka_unit_test(test_layer_lists),
        cmocka_unit_test(test_consistency),
        cmocka_unit_test(test_load_file),
        cmocka_unit_test(test_draft),
        cmocka_unit_test(test_draft_bad),
        cmocka_unit_test(test_shipped_configs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
