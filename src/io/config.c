/* config.c — config.json -> ds_config (kimi_linear, Kimi-K3 text_config) and ds_draft_config
 * (k3_dspark). docs/model.md §1 (keys and defaults), §2 (layer schedule), §8.1 (draft).
 *
 * Every key is read through one small set of typed accessors (the "scope" helpers below) so that
 * every error has the same shape: "<file>: key '<path.to.key>': expected <type>, found <type>" or
 * "<file>: missing required key '<path.to.key>'". JSON null is treated as "absent" for optional
 * keys, because the published configs write `null` for "feature off" (q_lora_rank, num_experts). */
#include "io/config.h"
#include "io/jsonutil.h"
#include "kernels/shared/quant.h"

#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* ---------------------------------------------------------------------------------------------
 * Typed accessors */

/* One JSON object being read: where it came from (file) and its dotted path (for messages). */
typedef struct scope {
    const char *what;   /* file name or other source label */
    const char *prefix; /* "" or "text_config." or "text_config.linear_attn_config." ... */
    const json_t *obj;  /* the object; may be NULL (then every key is absent) */
    ds_err *err;
} scope;

static int sc_type_err(const scope *s, const char *key, const char *expected, const json_t *v) {
    return ds_errf(s->err, "%s: key '%s%s': expected %s, found %s", s->what, s->prefix, key,
                   expected, ds_json_type_name(v));
}

static int sc_missing(const scope *s, const char *key) {
    return ds_errf(s->err, "%s: missing required key '%s%s'", s->what, s->prefix, key);
}

/* Looks up key, falling back to alias (DeepSeek spelling). Null counts as absent. If both
 * spellings are present they must agree, otherwise the config is ambiguous. *name_out gets the
 * spelling that was found (for messages). */
static int sc_lookup(const scope *s, const char *key, const char *alias, const json_t **out,
                     const char **name_out) {
    *out = NULL;
    *name_out = key;
    if (!s->obj) return DS_OK;
    const json_t *v = json_object_get(s->obj, key);
    const json_t *a = alias ? json_object_get(s->obj, alias) : NULL;
    if (v && json_is_null(v)) v = NULL;
    if (a && json_is_null(a)) a = NULL;
    if (v && a && !json_equal((json_t *)v, (json_t *)a))
        return ds_errf(s->err, "%s: keys '%s%s' and '%s%s' (an alias) disagree", s->what, s->prefix,
                       key, s->prefix, alias);
    if (!v && a) {
        v = a;
        *name_out = alias;
    }
    *out = v;
    return DS_OK;
}

/* Integer (an integral real such as 2304.0 is accepted too) that fits in int64. */
static int sc_as_i64(const scope *s, const char *name, const json_t *v, int64_t *out) {
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return DS_OK;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (d == floor(d) && fabs(d) < 9.0e18) {
            *out = (int64_t)d;
            return DS_OK;
        }
        return ds_errf(s->err, "%s: key '%s%s': expected integer, found real %g", s->what,
                       s->prefix, name, d);
    }
    return sc_type_err(s, name, "integer", v);
}

static int sc_i64(const scope *s, const char *key, const char *alias, int required, int64_t def,
                  int64_t *out, int *present) {
    const json_t *v;
    const char *name;
    if (present) *present = 0;
    if (sc_lookup(s, key, alias, &v, &name) != DS_OK) return DS_ERR;
    if (!v) {
        if (required) return sc_missing(s, key);
        *out = def;
        return DS_OK;
    }
    if (sc_as_i64(s, name, v, out) != DS_OK) return DS_ERR;
    if (present) *present = 1;
    return DS_OK;
}

static int sc_int(const scope *s, const char *key, const char *alias, int required, int def,
                  int *out, int *present) {
    int64_t x = 0;
    if (sc_i64(s, key, alias, required, def, &x, present) != DS_OK) return DS_ERR;
    if (x < INT_MIN || x > INT_MAX)
        return ds_errf(s->err, "%s: key '%s%s': value %lld does not fit in an int", s->what,
                       s->prefix, key, (long long)x);
    *out = (int)x;
    return DS_OK;
}

static int sc_num(const scope *s, const char *key, int required, double def, double *out,
                  int *present) {
    const json_t *v;
    const char *name;
    if (present) *present = 0;
    if (sc_lookup(s, key, NULL, &v, &name) != DS_OK) return DS_ERR;
    if (!v) {
        if (required) return sc_missing(s, key);
        *out = def;
        return DS_OK;
    }
    if (!json_is_number(v)) return sc_type_err(s, name, "number", v);
    *out = json_number_value(v);
    if (present) *present = 1;
    return DS_OK;
}

static int sc_bool(const scope *s, const char *key, const char *alias, int def, int *out) {
    const json_t *v;
    const char *name;
    if (sc_lookup(s, key, alias, &v, &name) != DS_OK) return DS_ERR;
    if (!v) {
        *out = def;
        return DS_OK;
    }
    if (!json_is_boolean(v)) return sc_type_err(s, name, "boolean", v);
    *out = json_is_true(v);
    return DS_OK;
}

/* *out is NULL when absent (and not required); the string belongs to the JSON tree. */
static int sc_str(const scope *s, const char *key, const char *alias, int required,
                  const char **out) {
    const json_t *v;
    const char *name;
    *out = NULL;
    if (sc_lookup(s, key, alias, &v, &name) != DS_OK) return DS_ERR;
    if (!v) return required ? sc_missing(s, key) : DS_OK;
    if (!json_is_string(v)) return sc_type_err(s, name, "string", v);
    *out = json_string_value(v);
    return DS_OK;
}

/* A key whose value must be a JSON object (want_array 0) or array (1); *out NULL when absent. */
static int sc_node(const scope *s, const char *key, int required, int want_array,
                   const json_t **out) {
    const json_t *v;
    const char *name;
    if (sc_lookup(s, key, NULL, &v, &name) != DS_OK) return DS_ERR;
    *out = NULL;
    if (!v) return required ? sc_missing(s, key) : DS_OK;
    if (want_array ? !json_is_array(v) : !json_is_object(v))
        return sc_type_err(s, name, want_array ? "array" : "object", v);
    *out = v;
    return DS_OK;
}

static int sc_obj(const scope *s, const char *key, int required, const json_t **out) {
    return sc_node(s, key, required, 0, out);
}

static int sc_arr(const scope *s, const char *key, int required, const json_t **out) {
    return sc_node(s, key, required, 1, out);
}

/* A value that must satisfy lo <= x (<= hi when hi >= lo). */
static int check_range(const scope *s, const char *key, long long x, long long lo, long long hi) {
    if (x < lo || (hi >= lo && x > hi)) {
        if (hi >= lo)
            return ds_errf(s->err, "%s: key '%s%s': expected a value in [%lld, %lld], found %lld",
                           s->what, s->prefix, key, lo, hi, x);
        return ds_errf(s->err, "%s: key '%s%s': expected a value >= %lld, found %lld", s->what,
                       s->prefix, key, lo, x);
    }
    return DS_OK;
}

static json_t *parse_json(const char *json, size_t len, const char *what, ds_err *err) {
    json_error_t je;
    json_t *root = json_loadb(json, len, 0, &je);
    if (!root) {
        ds_errf(err, "%s: malformed JSON at line %d, column %d: %s", what, je.line, je.column,
                je.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        ds_errf(err, "%s: expected a JSON object at the top level, found %s", what,
                ds_json_type_name(root));
        json_decref(root);
        return NULL;
    }
    return root;
}

/* ---------------------------------------------------------------------------------------------
 * Target config */

/* Reads a 1-based layer list into mark[0..L) (0-based), rejecting out-of-range and repeated ids. */
static int read_layer_list(const scope *s, const char *key, int L, uint8_t *mark, int *count) {
    const json_t *arr;
    if (sc_arr(s, key, 1, &arr) != DS_OK) return DS_ERR;
    size_t i;
    const json_t *v;
    *count = 0;
    json_array_foreach(arr, i, v) {
        if (!json_is_integer(v))
            return ds_errf(s->err, "%s: key '%s%s': entry %zu: expected integer, found %s", s->what,
                           s->prefix, key, i, ds_json_type_name(v));
        json_int_t id = json_integer_value(v);
        if (id < 1 || id > L)
            return ds_errf(s->err,
                           "%s: key '%s%s': layer %lld out of range [1, %d] (the list is 1-based; "
                           "num_hidden_layers = %d)",
                           s->what, s->prefix, key, (long long)id, L, L);
        if (mark[id - 1])
            return ds_errf(s->err, "%s: key '%s%s': layer %lld listed twice", s->what, s->prefix,
                           key, (long long)id);
        mark[id - 1] = 1;
        (*count)++;
    }
    return DS_OK;
}

static int parse_layer_kinds(const scope *lin, ds_config *cfg) {
    int L = cfg->num_hidden_layers;
    uint8_t kda[DS_MAX_LAYERS] = {0}, mla[DS_MAX_LAYERS] = {0}; /* [L] 1 if listed */
    int nk, nm;
    if (read_layer_list(lin, "kda_layers", L, kda, &nk) != DS_OK) return DS_ERR;
    if (read_layer_list(lin, "full_attn_layers", L, mla, &nm) != DS_OK) return DS_ERR;
    for (int i = 0; i < L; i++) {
        if (kda[i] && mla[i])
            return ds_errf(lin->err,
                           "%s: layer %d (1-based; 0-based %d) is listed in both '%skda_layers' "
                           "and '%sfull_attn_layers'",
                           lin->what, i + 1, i, lin->prefix, lin->prefix);
        if (!kda[i] && !mla[i])
            return ds_errf(lin->err,
                           "%s: layer %d (1-based; 0-based %d) is in neither '%skda_layers' nor "
                           "'%sfull_attn_layers'",
                           lin->what, i + 1, i, lin->prefix, lin->prefix);
        cfg->layer_kind[i] = kda[i] ? DS_LAYER_KDA : DS_LAYER_MLA;
    }
    cfg->num_kda_layers = nk;
    cfg->num_mla_layers = nm;
    return DS_OK;
}

/* parse_text's part: the sizes and rms_norm_eps. */
static int text_sizes(const scope *t, int k3, ds_config *c) {
    ds_err *err = t->err;
    double d;

    /* Sizes */
    if (sc_int(t, "vocab_size", NULL, 0, 163840, &c->vocab_size, NULL) ||
        sc_int(t, "hidden_size", NULL, 1, 0, &c->hidden_size, NULL) ||
        sc_int(t, "num_hidden_layers", NULL, 1, 0, &c->num_hidden_layers, NULL) ||
        sc_int(t, "intermediate_size", NULL, 1, 0, &c->intermediate_size, NULL))
        return DS_ERR;
    if (check_range(t, "vocab_size", c->vocab_size, 1, -1) ||
        check_range(t, "hidden_size", c->hidden_size, 1, -1) ||
        check_range(t, "num_hidden_layers", c->num_hidden_layers, 1, DS_MAX_LAYERS) ||
        check_range(t, "intermediate_size", c->intermediate_size, 1, -1))
        return DS_ERR;
    if (sc_num(t, "rms_norm_eps", 0, k3 ? 1e-6 : 1e-5, &d, NULL)) return DS_ERR;
    if (!(d > 0 && d < 1))
        return ds_errf(err, "%s: key '%srms_norm_eps': expected a value in (0, 1), found %g",
                       t->what, t->prefix, d);
    c->rms_norm_eps = (float)d;
    return DS_OK;
}

/* parse_text's part: the FFN activation and its betas. */
static int text_activation(const scope *t, ds_config *c) {
    ds_err *err = t->err;
    double d;
    int p;

    /* Activation */
    const char *act;
    if (sc_str(t, "hidden_act", NULL, 0, &act)) return DS_ERR;
    if (!act || strcmp(act, "silu") == 0) {
        c->hidden_act = DS_ACT_SILU;
    } else if (strcmp(act, "situ") == 0) {
        c->hidden_act = DS_ACT_SITU;
    } else {
        return ds_errf(err, "%s: key '%shidden_act': expected \"silu\" or \"situ\", found \"%s\"",
                       t->what, t->prefix, act);
    }
    if (sc_num(t, "activation_situ_beta", 0, 1.0, &d, NULL)) return DS_ERR;
    if (!(d > 0))
        return ds_errf(err, "%s: key '%sactivation_situ_beta': expected > 0, found %g", t->what,
                       t->prefix, d);
    c->situ_beta = (float)d;
    /* Absent -> 0, which the FFN reads as "up branch unchanged" (HF-K3/ATOM; not TF's 1.0). */
    if (sc_num(t, "activation_situ_linear_beta", 0, 0.0, &d, &p)) return DS_ERR;
    if (p && !(d > 0))
        return ds_errf(err, "%s: key '%sactivation_situ_linear_beta': expected > 0, found %g",
                       t->what, t->prefix, d);
    c->situ_linear_beta = (float)d;
    return DS_OK;
}

/* parse_text's part: MLA's heads and ranks; the dimensions are checked by text_layers, once it is
 * known whether any layer is MLA. */
static int text_mla(const scope *t, ds_config *c) {

    /* MLA; dimensions are checked once we know whether any MLA layer exists. */
    if (sc_int(t, "num_attention_heads", NULL, 1, 0, &c->num_attention_heads, NULL)) return DS_ERR;
    if (check_range(t, "num_attention_heads", c->num_attention_heads, 1, -1)) return DS_ERR;
    if (sc_int(t, "num_key_value_heads", NULL, 0, c->num_attention_heads, &c->num_key_value_heads,
               NULL) ||
        sc_int(t, "q_lora_rank", NULL, 0, 0, &c->q_lora_rank, NULL) ||
        sc_bool(t, "mla_use_nope", NULL, 0, &c->mla_use_nope) ||
        sc_bool(t, "mla_use_output_gate", NULL, 0, &c->mla_use_output_gate) ||
        sc_num(t, "rope_theta", 0, 10000.0, &c->rope_theta, NULL))
        return DS_ERR;
    if (check_range(t, "num_key_value_heads", c->num_key_value_heads, 1, -1) ||
        check_range(t, "q_lora_rank", c->q_lora_rank, 0, -1))
        return DS_ERR;
    if (sc_int(t, "kv_lora_rank", NULL, 0, 0, &c->kv_lora_rank, NULL) ||
        sc_int(t, "qk_nope_head_dim", NULL, 0, 0, &c->qk_nope_head_dim, NULL) ||
        sc_int(t, "qk_rope_head_dim", NULL, 0, 0, &c->qk_rope_head_dim, NULL) ||
        sc_int(t, "v_head_dim", NULL, 0, 0, &c->v_head_dim, NULL))
        return DS_ERR;
    return DS_OK;
}

/* parse_text's part: linear_attn_config (KDA) and which layer is KDA or MLA, then the dimensions
 * the present kinds need. */
static int text_layers(const scope *t, ds_config *c) {
    ds_err *err = t->err;
    double d;

    /* KDA: linear_attn_config */
    const json_t *lin_obj;
    if (sc_obj(t, "linear_attn_config", 1, &lin_obj)) return DS_ERR;
    char lin_prefix[96];
    snprintf(lin_prefix, sizeof lin_prefix, "%slinear_attn_config.", t->prefix);
    scope lin = {t->what, lin_prefix, lin_obj, err};
    if (sc_int(&lin, "num_heads", NULL, 0, c->num_attention_heads, &c->kda_num_heads, NULL) ||
        sc_int(&lin, "head_dim", NULL, 0, 0, &c->kda_head_dim, NULL) ||
        sc_int(&lin, "short_conv_kernel_size", NULL, 0, 4, &c->short_conv_kernel_size, NULL) ||
        sc_num(&lin, "gate_lower_bound", 0, 0.0, &d, &c->has_gate_lower_bound) ||
        sc_bool(&lin, "use_full_rank_gate", NULL, 0, &c->use_full_rank_gate))
        return DS_ERR;
    c->gate_lower_bound = (float)d;
    if (parse_layer_kinds(&lin, c)) return DS_ERR;

    if (c->num_kda_layers > 0) {
        const json_t *hd = json_object_get(lin_obj, "head_dim");
        if (!hd || json_is_null(hd)) return sc_missing(&lin, "head_dim");
        if (check_range(&lin, "num_heads", c->kda_num_heads, 1, -1) ||
            check_range(&lin, "head_dim", c->kda_head_dim, 1, -1) ||
            check_range(&lin, "short_conv_kernel_size", c->short_conv_kernel_size, 1, -1))
            return DS_ERR;
    }
    if (c->num_mla_layers > 0) {
        static const char *const need[] = {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim"};
        const int vals[] = {c->kv_lora_rank, c->qk_nope_head_dim, c->qk_rope_head_dim,
                            c->v_head_dim};
        for (size_t i = 0; i < DS_ARRAY_LEN(need); i++) {
            const json_t *v = json_object_get(t->obj, need[i]);
            if (!v || json_is_null(v))
                return ds_errf(err,
                               "%s: missing required key '%s%s' (needed: %d layers are MLA; a "
                               "config without it is not a kimi_linear MLA model)",
                               t->what, t->prefix, need[i], c->num_mla_layers);
            if (check_range(t, need[i], vals[i], 1, -1)) return DS_ERR;
        }
    }
    return DS_OK;
}

/* parse_text's part: the FFN / MoE keys (DeepSeek spellings accepted, as ATOM's
 * _normalize_kimi_config does). */
static int text_moe(const scope *t, int k3, ds_config *c) {
    ds_err *err = t->err;
    double d;

    /* FFN / MoE (DeepSeek spellings accepted, as ATOM's _normalize_kimi_config does) */
    if (sc_int(t, "num_experts", "n_routed_experts", 0, 0, &c->num_experts, NULL) ||
        sc_int(t, "num_experts_per_token", "num_experts_per_tok", 0, 0, &c->num_experts_per_token,
               NULL) ||
        sc_int(t, "moe_intermediate_size", NULL, 0, 0, &c->moe_intermediate_size, NULL) ||
        sc_int(t, "num_shared_experts", "n_shared_experts", 0, 0, &c->num_shared_experts, NULL) ||
        sc_int(t, "first_k_dense_replace", NULL, 0, k3 ? 0 : 1, &c->first_k_dense_replace, NULL) ||
        sc_int(t, "moe_layer_freq", NULL, 0, 1, &c->moe_layer_freq, NULL) ||
        sc_bool(t, "moe_renormalize", "norm_topk_prob", 1, &c->moe_renormalize) ||
        sc_num(t, "routed_scaling_factor", 0, k3 ? 1.0 : 2.446, &d, NULL) ||
        sc_bool(t, "use_grouped_topk", NULL, 1, &c->use_grouped_topk) ||
        sc_int(t, "num_expert_group", "n_group", 0, 1, &c->num_expert_group, NULL) ||
        sc_int(t, "topk_group", NULL, 0, 1, &c->topk_group, NULL) ||
        sc_int(t, "routed_expert_hidden_size", NULL, 0, 0, &c->routed_expert_hidden_size, NULL) ||
        sc_bool(t, "latent_moe_use_norm", NULL, 0, &c->latent_moe_use_norm))
        return DS_ERR;
    c->routed_scaling_factor = (float)d;
    if (!(d > 0))
        return ds_errf(err, "%s: key '%srouted_scaling_factor': expected > 0, found %g", t->what,
                       t->prefix, d);
    const char *scoring;
    if (sc_str(t, "moe_router_activation_func", "scoring_func", 0, &scoring)) return DS_ERR;
    if (scoring && strcmp(scoring, "sigmoid") != 0)
        return ds_errf(err,
                       "%s: key '%smoe_router_activation_func' (or 'scoring_func'): only "
                       "\"sigmoid\" is supported, found \"%s\"",
                       t->what, t->prefix, scoring);
    const char *topk_method;
    if (sc_str(t, "topk_method", NULL, 0, &topk_method)) return DS_ERR;
    if (check_range(t, "num_experts", c->num_experts, 0, -1) ||
        check_range(t, "num_shared_experts", c->num_shared_experts, 0, -1) ||
        check_range(t, "first_k_dense_replace", c->first_k_dense_replace, 0, -1) ||
        check_range(t, "moe_layer_freq", c->moe_layer_freq, 1, -1) ||
        check_range(t, "routed_expert_hidden_size", c->routed_expert_hidden_size, 0, -1))
        return DS_ERR;
    if (c->num_experts > 0) {
        const json_t *v;
        const char *name;
        if (sc_lookup(t, "num_experts_per_token", "num_experts_per_tok", &v, &name)) return DS_ERR;
        if (!v) return sc_missing(t, "num_experts_per_token");
        if (sc_lookup(t, "moe_intermediate_size", NULL, &v, &name)) return DS_ERR;
        if (!v) return sc_missing(t, "moe_intermediate_size");
        if (check_range(t, "num_experts_per_token", c->num_experts_per_token, 1, c->num_experts) ||
            check_range(t, "moe_intermediate_size", c->moe_intermediate_size, 1, -1) ||
            check_range(t, "num_expert_group", c->num_expert_group, 1, c->num_experts) ||
            check_range(t, "topk_group", c->topk_group, 1, c->num_expert_group))
            return DS_ERR;
        if (c->num_experts % c->num_expert_group != 0)
            return ds_errf(err, "%s: key '%snum_expert_group': %d does not divide num_experts = %d",
                           t->what, t->prefix, c->num_expert_group, c->num_experts);
        /* Group-limited routing picks k experts among topk_group groups of E/G experts. */
        if (c->use_grouped_topk && (int64_t)c->topk_group * (c->num_experts / c->num_expert_group) <
                                       c->num_experts_per_token)
            return ds_errf(err,
                           "%s: key '%snum_experts_per_token': %d experts cannot be chosen from "
                           "topk_group = %d groups of %d experts",
                           t->what, t->prefix, c->num_experts_per_token, c->topk_group,
                           c->num_experts / c->num_expert_group);
    }
    return DS_OK;
}

/* parse_text's part: AttnRes, MTP, the context length, tie_word_embeddings and the token ids
 * (`root` supplies these first). */
static int text_context(const scope *root, const scope *t, ds_config *c) {

    /* AttnRes, MTP, context */
    if (sc_int(t, "attn_res_block_size", NULL, 0, 0, &c->attn_res_block_size, NULL) ||
        sc_int(t, "num_nextn_predict_layers", NULL, 0, 0, &c->num_nextn_predict_layers, NULL) ||
        check_range(t, "attn_res_block_size", c->attn_res_block_size, 0, -1) ||
        check_range(t, "num_nextn_predict_layers", c->num_nextn_predict_layers, 0, -1))
        return DS_ERR;
    /* 0 = not stated; the engine then chooses its own limit. */
    if (sc_i64(t, "max_position_embeddings", "model_max_length", 0, 0, &c->max_position_embeddings,
               NULL) ||
        check_range(t, "max_position_embeddings", c->max_position_embeddings, 0, -1))
        return DS_ERR;

    /* tie_word_embeddings and token ids: K3 states them on the root; text_config fills gaps. */
    const scope *first = root, *second = t;
    int tie_root;
    const json_t *tv = root->obj ? json_object_get(root->obj, "tie_word_embeddings") : NULL;
    if (tv && !json_is_null(tv)) {
        if (sc_bool(root, "tie_word_embeddings", NULL, 0, &tie_root)) return DS_ERR;
        c->tie_word_embeddings = tie_root;
    } else if (sc_bool(t, "tie_word_embeddings", NULL, 0, &c->tie_word_embeddings)) {
        return DS_ERR;
    }
    static const char *const ids[] = {"bos_token_id", "eos_token_id", "pad_token_id"};
    static const int defs[] = {163584, 163586, 163839};
    int *outs[] = {&c->bos_token_id, &c->eos_token_id, &c->pad_token_id};
    for (int i = 0; i < 3; i++) {
        int present;
        if (sc_int(first, ids[i], NULL, 0, defs[i], outs[i], &present)) return DS_ERR;
        if (!present && second->obj != first->obj &&
            sc_int(second, ids[i], NULL, 0, defs[i], outs[i], NULL))
            return DS_ERR;
    }
    return DS_OK;
}

/* The group size a compressed-tensors weights scheme states, or -1 (absent). */
static int ct_group(const scope *s, const json_t *obj, const char *key, int *out) {
    const json_t *g = json_object_get(obj, "group_size");
    *out = -1;
    if (!g || json_is_null(g)) return DS_OK;
    if (!json_is_integer(g))
        return ds_errf(s->err, "%s: key '%s.group_size': expected an integer, found %s", s->what,
                       key, ds_json_type_name(g));
    *out = (int)json_integer_value(g);
    return DS_OK;
}

/* quantization_config (root, or text_config's): only compressed-tensors MXFP4 of the routed
 * experts (what Kimi-K3 publishes) is supported; every other method or format is named and
 * refused, so a checkpoint is never read as something it is not. */
static int parse_quant(const scope *root, const scope *t, ds_config *c) {
    const json_t *q = NULL;
    const scope *at = root;
    if (sc_obj(root, "quantization_config", 0, &q)) return DS_ERR;
    if (!q && t->obj != root->obj) {
        if (sc_obj(t, "quantization_config", 0, &q)) return DS_ERR;
        at = t;
    }
    if (!q) return DS_OK;
    scope qs = {at->what, at == t ? "text_config.quantization_config." : "quantization_config.", q,
                at->err};
    const char *method, *fmt;
    if (sc_str(&qs, "quant_method", NULL, 1, &method) || sc_str(&qs, "format", NULL, 0, &fmt))
        return DS_ERR;
    if (strcmp(method, "compressed-tensors") != 0)
        return ds_errf(at->err,
                       "%s: key 'quantization_config.quant_method': \"%s\" is not supported "
                       "(deltaserve reads \"compressed-tensors\" MXFP4 experts; for FP8 of a "
                       "BF16 checkpoint use --quantization ptpc_fp8)",
                       at->what, method);
    int group, g;
    if (ct_group(&qs, q, "quantization_config", &group)) return DS_ERR;
    const json_t *groups = json_object_get(q, "config_groups");
    if (groups && !json_is_null(groups)) {
        if (!json_is_object(groups))
            return ds_errf(at->err,
                           "%s: key 'quantization_config.config_groups': expected an "
                           "object, found %s",
                           at->what, ds_json_type_name(groups));
        const char *gname;
        json_t *gv;
        json_object_foreach((json_t *)groups, gname, gv) {
            if (!json_is_object(gv)) continue;
            const json_t *gf = json_object_get(gv, "format");
            if (gf && json_is_string(gf)) {
                if (fmt && strcmp(fmt, json_string_value(gf)) != 0)
                    return ds_errf(at->err,
                                   "%s: quantization_config: group '%s' has format "
                                   "\"%s\", the config \"%s\" (one format only)",
                                   at->what, gname, json_string_value(gf), fmt);
                fmt = json_string_value(gf);
            }
            const json_t *wts = json_object_get(gv, "weights");
            if (wts && json_is_object(wts)) {
                if (ct_group(&qs, wts, "quantization_config.config_groups.*.weights", &g))
                    return DS_ERR;
                if (g > 0) group = g;
            }
        }
    }
    if (!fmt || strcmp(fmt, "mxfp4-pack-quantized") != 0)
        return ds_errf(at->err,
                       "%s: quantization_config: format \"%s\" is not supported (deltaserve "
                       "reads \"mxfp4-pack-quantized\" routed experts)",
                       at->what, fmt ? fmt : "(none)");
    if (group != -1 && group != DS_MXFP4_GROUP)
        return ds_errf(at->err,
                       "%s: quantization_config: group_size %d is not supported (MXFP4 groups "
                       "are %d values)",
                       at->what, group, DS_MXFP4_GROUP);
    c->mxfp4_experts = 1;
    return DS_OK;
}

/* Reads the text model's keys from `t` (root or root.text_config); `root` supplies token ids.
 * k3 selects the defaults of K3's own config class where docs/model.md §1 lists two defaults
 * (HF-K3 vs transformers), since that is the class that would have read the file. */
static int parse_text(const scope *root, const scope *t, int k3, ds_config *c) {
    if (text_sizes(t, k3, c) || text_activation(t, c) || text_mla(t, c) || text_layers(t, c) ||
        text_moe(t, k3, c) || text_context(root, t, c) || parse_quant(root, t, c))
        return DS_ERR;
    return DS_OK;
}

static int config_from_root(const json_t *root, const char *what, ds_config *cfg, ds_err *err) {
    memset(cfg, 0, sizeof *cfg);
    scope rs = {what, "", root, err};
    const char *mt;
    if (sc_str(&rs, "model_type", NULL, 1, &mt)) return DS_ERR;
    const json_t *text;
    if (sc_obj(&rs, "text_config", 0, &text)) return DS_ERR;
    int k3;
    if (strcmp(mt, "kimi_k3") == 0) {
        if (!text)
            return ds_errf(err,
                           "%s: missing required key 'text_config' (model_type "
                           "\"kimi_k3\" keeps its language model there)",
                           what);
        k3 = 1;
    } else if (strcmp(mt, "kimi_linear") == 0) {
        if (text)
            return ds_errf(err,
                           "%s: key 'model_type': a config with 'text_config' must be "
                           "\"kimi_k3\", found \"kimi_linear\"",
                           what);
        k3 = 0;
    } else {
        return ds_errf(err,
                       "%s: unknown model_type \"%s\" (key 'model_type'; expected \"kimi_linear\" "
                       "or \"kimi_k3\")",
                       what, mt);
    }
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", mt);
    snprintf(cfg->weight_prefix, sizeof cfg->weight_prefix, "%s", k3 ? "language_model." : "");

    scope ts = {what, k3 ? "text_config." : "", k3 ? text : root, err};
    if (k3) {
        const char *tmt;
        if (sc_str(&ts, "model_type", NULL, 0, &tmt)) return DS_ERR;
        if (tmt && strcmp(tmt, "kimi_linear") != 0)
            return ds_errf(err,
                           "%s: unknown model_type \"%s\" in key 'text_config.model_type' "
                           "(expected \"kimi_linear\")",
                           what, tmt);
    }
    return parse_text(&rs, &ts, k3, cfg);
}

int ds_config_parse(const char *json, const char *what, ds_config *cfg, ds_err *err) {
    if (!what) what = "config";
    if (!json || !cfg) return ds_errf(err, "%s: no JSON text given", what);
    json_t *root = parse_json(json, strlen(json), what, err);
    if (!root) return DS_ERR;
    int rc = config_from_root(root, what, cfg, err);
    json_decref(root);
    return rc;
}

int ds_config_load(const char *path, ds_config *cfg, ds_err *err) {
    size_t len;
    char *text = ds_read_file(path, &len, err);
    if (!text) return DS_ERR;
    json_t *root = parse_json(text, len, path, err);
    free(text);
    if (!root) return DS_ERR;
    int rc = config_from_root(root, path, cfg, err);
    json_decref(root);
    return rc;
}

int ds_config_layer_is_moe(const ds_config *cfg, int layer) {
    if (!cfg || layer < 0 || layer >= cfg->num_hidden_layers || cfg->num_experts <= 0) return 0;
    int freq = cfg->moe_layer_freq > 0 ? cfg->moe_layer_freq : 1;
    return layer >= cfg->first_k_dense_replace && layer % freq == 0;
}

/* ---------------------------------------------------------------------------------------------
 * DSpark draft config (docs/model.md §8.1) */

/* rope_parameters (transformers 5.x) or rope_scaling (older) -> YaRN fields. Defaults are those of
 * DeepSeek's YaRN: beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 0 (no attention scaling). */
static int parse_draft_rope(const scope *s, int64_t max_pos, ds_draft_config *c) {
    const json_t *rp;
    const char *key = "rope_parameters";
    if (sc_obj(s, key, 0, &rp)) return DS_ERR;
    if (!rp) {
        key = "rope_scaling";
        if (sc_obj(s, key, 0, &rp)) return DS_ERR;
    }
    c->rope_factor = 1.0;
    c->rope_beta_fast = 32.0;
    c->rope_beta_slow = 1.0;
    c->rope_mscale = 1.0;
    c->rope_mscale_all_dim = 0.0;
    c->rope_original_max_position_embeddings = max_pos;
    int has_theta;
    if (sc_num(s, "rope_theta", 0, 10000.0, &c->rope_theta, &has_theta)) return DS_ERR;
    if (!rp) return DS_OK;

    char prefix[64];
    snprintf(prefix, sizeof prefix, "%s.", key);
    scope r = {s->what, prefix, rp, s->err};
    const char *type;
    if (sc_str(&r, "rope_type", "type", 0, &type)) return DS_ERR;
    if (!has_theta && sc_num(&r, "rope_theta", 0, 10000.0, &c->rope_theta, NULL)) return DS_ERR;
    if (!type || strcmp(type, "default") == 0) return DS_OK;
    if (strcmp(type, "yarn") != 0)
        return ds_errf(s->err,
                       "%s: key '%srope_type': only \"yarn\" or \"default\" is supported for the "
                       "draft, found \"%s\"",
                       s->what, prefix, type);
    if (sc_num(&r, "factor", 0, 1.0, &c->rope_factor, NULL) ||
        sc_num(&r, "beta_fast", 0, 32.0, &c->rope_beta_fast, NULL) ||
        sc_num(&r, "beta_slow", 0, 1.0, &c->rope_beta_slow, NULL) ||
        sc_num(&r, "mscale", 0, 1.0, &c->rope_mscale, NULL) ||
        sc_num(&r, "mscale_all_dim", 0, 0.0, &c->rope_mscale_all_dim, NULL) ||
        sc_i64(&r, "original_max_position_embeddings", NULL, 0, max_pos,
               &c->rope_original_max_position_embeddings, NULL))
        return DS_ERR;
    if (!(c->rope_factor >= 1.0))
        return ds_errf(s->err, "%s: key '%sfactor': expected >= 1, found %g", s->what, prefix,
                       c->rope_factor);
    if (c->rope_factor > 1.0 && c->rope_original_max_position_embeddings <= 0)
        return ds_errf(s->err,
                       "%s: missing required key '%soriginal_max_position_embeddings' (YaRN with "
                       "factor %g needs it, and max_position_embeddings is absent)",
                       s->what, prefix, c->rope_factor);
    return DS_OK;
}

/* draft_from_root's part: which target layers the draft taps (target_layer_ids, ascending, -1
 * for the embedding output) and the target's sizes they imply. */
static int draft_taps(const scope *s, ds_draft_config *c) {
    ds_err *err = s->err;
    const char *what = s->what;
    if (sc_int(s, "num_target_layers", NULL, 1, 0, &c->num_target_layers, NULL) ||
        sc_int(s, "target_hidden_size", NULL, 1, 0, &c->target_hidden_size, NULL) ||
        sc_int(s, "target_num_hidden_layers", NULL, 1, 0, &c->target_num_hidden_layers, NULL) ||
        check_range(s, "num_target_layers", c->num_target_layers, 1, DS_MAX_TAPS) ||
        check_range(s, "target_hidden_size", c->target_hidden_size, 1, -1) ||
        check_range(s, "target_num_hidden_layers", c->target_num_hidden_layers, 1, DS_MAX_LAYERS))
        return DS_ERR;
    const json_t *ids;
    if (sc_arr(s, "target_layer_ids", 1, &ids)) return DS_ERR;
    if ((int)json_array_size(ids) != c->num_target_layers)
        return ds_errf(err,
                       "%s: key 'target_layer_ids': expected %d entries (num_target_layers), "
                       "found %zu",
                       what, c->num_target_layers, json_array_size(ids));
    size_t i;
    const json_t *v;
    json_array_foreach(ids, i, v) {
        if (!json_is_integer(v))
            return ds_errf(err, "%s: key 'target_layer_ids': entry %zu: expected integer, found %s",
                           what, i, ds_json_type_name(v));
        json_int_t id = json_integer_value(v);
        /* -1 taps the embedding output (HF hidden_states[0]); L taps the output of layer L. */
        if (id < -1 || id >= c->target_num_hidden_layers)
            return ds_errf(err,
                           "%s: key 'target_layer_ids': entry %zu = %lld is outside {-1} u [0, "
                           "%d) (target_num_hidden_layers)",
                           what, i, (long long)id, c->target_num_hidden_layers);
        if (i > 0 && id <= c->target_layer_ids[i - 1])
            return ds_errf(err,
                           "%s: key 'target_layer_ids': ids must be strictly ascending, found %d "
                           "then %lld",
                           what, c->target_layer_ids[i - 1], (long long)id);
        c->target_layer_ids[i] = (int)id;
    }
    return DS_OK;
}

static int draft_from_root(const json_t *root, const char *what, ds_draft_config *c, ds_err *err) {
    memset(c, 0, sizeof *c);
    scope s = {what, "", root, err};
    double d;
    /* A GQA draft has no kv_lora_rank: say so plainly rather than failing on some later key. */
    const json_t *kv = json_object_get(root, "kv_lora_rank");
    if (!kv || json_is_null(kv))
        return ds_errf(err,
                       "%s: missing required key 'kv_lora_rank': only MLA DSpark drafts "
                       "(k3_dspark) are supported, not GQA drafts",
                       what);
    if (sc_int(&s, "hidden_size", NULL, 1, 0, &c->hidden_size, NULL) ||
        sc_int(&s, "intermediate_size", NULL, 1, 0, &c->intermediate_size, NULL) ||
        sc_int(&s, "num_hidden_layers", NULL, 1, 0, &c->num_hidden_layers, NULL) ||
        sc_int(&s, "num_attention_heads", NULL, 1, 0, &c->num_attention_heads, NULL) ||
        sc_int(&s, "q_lora_rank", NULL, 0, 0, &c->q_lora_rank, NULL) ||
        sc_int(&s, "kv_lora_rank", NULL, 1, 0, &c->kv_lora_rank, NULL) ||
        sc_int(&s, "qk_nope_head_dim", NULL, 1, 0, &c->qk_nope_head_dim, NULL) ||
        sc_int(&s, "qk_rope_head_dim", NULL, 1, 0, &c->qk_rope_head_dim, NULL) ||
        sc_int(&s, "v_head_dim", NULL, 1, 0, &c->v_head_dim, NULL) ||
        sc_int(&s, "vocab_size", NULL, 0, 163840, &c->vocab_size, NULL))
        return DS_ERR;
    if (check_range(&s, "hidden_size", c->hidden_size, 1, -1) ||
        check_range(&s, "intermediate_size", c->intermediate_size, 1, -1) ||
        check_range(&s, "num_hidden_layers", c->num_hidden_layers, 1, DS_MAX_LAYERS) ||
        check_range(&s, "num_attention_heads", c->num_attention_heads, 1, -1) ||
        check_range(&s, "q_lora_rank", c->q_lora_rank, 0, -1) ||
        check_range(&s, "kv_lora_rank", c->kv_lora_rank, 1, -1) ||
        check_range(&s, "qk_nope_head_dim", c->qk_nope_head_dim, 1, -1) ||
        check_range(&s, "qk_rope_head_dim", c->qk_rope_head_dim, 1, -1) ||
        check_range(&s, "v_head_dim", c->v_head_dim, 1, -1) ||
        check_range(&s, "vocab_size", c->vocab_size, 1, -1))
        return DS_ERR;
    /* The draft has no lm_head of its own: it borrows the target's, so its vocabulary must be the
     * draft's vocabulary too. */
    int dv = 0, has_dv = 0;
    if (sc_int(&s, "draft_vocab_size", NULL, 0, 0, &dv, &has_dv)) return DS_ERR;
    if (has_dv && dv != c->vocab_size)
        return ds_errf(err,
                       "%s: key 'draft_vocab_size' = %d differs from vocab_size = %d; a DSpark "
                       "draft uses the target's lm_head, so they must match",
                       what, dv, c->vocab_size);
    if (sc_num(&s, "rms_norm_eps", 0, 1e-5, &d, NULL)) return DS_ERR;
    if (!(d > 0 && d < 1))
        return ds_errf(err, "%s: key 'rms_norm_eps': expected a value in (0, 1), found %g", what,
                       d);
    c->rms_norm_eps = (float)d;
    const char *act;
    if (sc_str(&s, "hidden_act", NULL, 0, &act)) return DS_ERR;
    if (act && strcmp(act, "silu") != 0)
        return ds_errf(err, "%s: key 'hidden_act': the draft MLP is silu-gated, found \"%s\"", what,
                       act);
    int nope;
    if (sc_bool(&s, "mla_use_nope", NULL, 0, &nope)) return DS_ERR;
    if (nope)
        return ds_errf(err,
                       "%s: key 'mla_use_nope': the DSpark draft rotates its rope lanes; "
                       "expected false, found true",
                       what);
    int64_t max_pos;
    if (sc_i64(&s, "max_position_embeddings", NULL, 0, 0, &max_pos, NULL)) return DS_ERR;
    if (parse_draft_rope(&s, max_pos, c)) return DS_ERR;
    if (!(c->rope_theta > 0))
        return ds_errf(err, "%s: key 'rope_theta': expected > 0, found %g", what, c->rope_theta);

    if (draft_taps(&s, c)) return DS_ERR;

    if (sc_int(&s, "mask_token_id", NULL, 1, 0, &c->mask_token_id, NULL) ||
        check_range(&s, "mask_token_id", c->mask_token_id, 0, c->vocab_size - 1) ||
        sc_int(&s, "markov_rank", NULL, 1, 0, &c->markov_rank, NULL) ||
        check_range(&s, "markov_rank", c->markov_rank, 1, -1) ||
        sc_bool(&s, "fc_norm", NULL, 0, &c->fc_norm))
        return DS_ERR;
    const char *aux;
    if (sc_str(&s, "aux_hidden_stream", NULL, 0, &aux)) return DS_ERR;
    if (!aux || strcmp(aux, "prefix") == 0) {
        c->aux_hidden_stream_attn_res = 0;
    } else if (strcmp(aux, "attn_res") == 0) {
        c->aux_hidden_stream_attn_res = 1;
    } else {
        return ds_errf(err,
                       "%s: key 'aux_hidden_stream': expected \"prefix\" or \"attn_res\", found "
                       "\"%s\"",
                       what, aux);
    }
    return DS_OK;
}

int ds_draft_config_parse(const char *json, const char *what, ds_draft_config *cfg, ds_err *err) {
    if (!what) what = "draft config";
    if (!json || !cfg) return ds_errf(err, "%s: no JSON text given", what);
    json_t *root = parse_json(json, strlen(json), what, err);
    if (!root) return DS_ERR;
    int rc = draft_from_root(root, what, cfg, err);
    json_decref(root);
    return rc;
}

int ds_draft_config_load(const char *path, ds_draft_config *cfg, ds_err *err) {
    size_t len;
    char *text = ds_read_file(path, &len, err);
    if (!text) return DS_ERR;
    json_t *root = parse_json(text, len, path, err);
    free(text);
    if (!root) return DS_ERR;
    int rc = draft_from_root(root, path, cfg, err);
    json_decref(root);
    return rc;
}
