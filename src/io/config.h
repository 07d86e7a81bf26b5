/* config.h — config.json -> ds_config for kimi_linear and Kimi-K3 (text model under text_config),
 * and the DSpark draft config (k3_dspark). docs/model.md §1 and §8.1 list every key and its
 * default. The 1-based layer lists of linear_attn_config are converted to 0-based here, once. */
#ifndef DS_CONFIG_H
#define DS_CONFIG_H

#include "base/ds_base.h"

#define DS_MAX_LAYERS 256
#define DS_MAX_TAPS   16


typedef enum { DS_ACT_SILU = 0, DS_ACT_SITU = 1 } ds_act;
typedef enum { DS_LAYER_KDA = 0, DS_LAYER_MLA = 1 } ds_layer_kind;

typedef struct ds_config {
    char model_type[32];    /* root model_type: "kimi_linear" or "kimi_k3" */
    char weight_prefix[32]; /* "" for kimi_linear, "language_model." for kimi_k3 */
    int vocab_size, hidden_size, num_hidden_layers, intermediate_size;
    float rms_norm_eps;
    ds_act hidden_act;
    float situ_beta;        /* activation_situ_beta, absent -> 1.0 */
    float situ_linear_beta; /* activation_situ_linear_beta; 0 means absent -> identity up branch */
    /* MLA */
    int num_attention_heads, num_key_value_heads;
    int q_lora_rank; /* 0: single q_proj */
    int kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    int mla_use_nope, mla_use_output_gate;
    double rope_theta;
    /* KDA (linear_attn_config) */
    int kda_num_heads, kda_head_dim, short_conv_kernel_size;
    int has_gate_lower_bound; /* gate_lower_bound present -> K3 sigmoid form */
    float gate_lower_bound;
    int use_full_rank_gate;
    uint8_t layer_kind[DS_MAX_LAYERS]; /* ds_layer_kind per 0-based layer */
    int num_kda_layers, num_mla_layers;
    /* FFN / MoE */
    int num_experts; /* 0: no MoE */
    int num_experts_per_token, moe_intermediate_size, num_shared_experts;
    int first_k_dense_replace, moe_layer_freq;
    int moe_renormalize;
    float routed_scaling_factor;
    int use_grouped_topk, num_expert_group, topk_group;
    int routed_expert_hidden_size; /* 0: no latent MoE */
    int latent_moe_use_norm;
    int attn_res_block_size; /* 0: AttnRes off */
    int num_nextn_predict_layers;
    int64_t max_position_embeddings;
    int tie_word_embeddings;
    int bos_token_id, eos_token_id, pad_token_id; /* from the root, falling back to text_config */
    /* quantization_config (docs/quantization.md): 1 when the checkpoint's routed experts are
     * compressed-tensors MXFP4 (w{1,2,3}.weight_packed + weight_scale, groups of 32); any other
     * method is refused at parse time. 0: every weight is a float dtype. */
    int mxfp4_experts;
} ds_config;

/* Reads DIR/config.json (path given). Errors name the file and key, expected vs found. */
int ds_config_load(const char *path, ds_config *cfg, ds_err *err);
/* Same, from a JSON string; `what` names the source in error messages. */
int ds_config_parse(const char *json, const char *what, ds_config *cfg, ds_err *err);

/* Layer i is MoE (vs dense MLP) per docs/model.md §2. */
int ds_config_layer_is_moe(const ds_config *cfg, int layer);

/* DSpark draft config (docs/model.md §8.1). */
typedef struct ds_draft_config {
    int hidden_size, intermediate_size, num_hidden_layers, num_attention_heads;
    int q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    int vocab_size;
    float rms_norm_eps;
    double rope_theta;
    /* YaRN */
    double rope_factor, rope_beta_fast, rope_beta_slow, rope_mscale, rope_mscale_all_dim;
    int64_t rope_original_max_position_embeddings;
    int num_target_layers, target_hidden_size, target_num_hidden_layers;
    int target_layer_ids[DS_MAX_TAPS]; /* -1 = embedding output */
    int mask_token_id, markov_rank;
    int fc_norm;
    int aux_hidden_stream_attn_res; /* aux_hidden_stream == "attn_res" */
} ds_draft_config;

int ds_draft_config_load(const char *path, ds_draft_config *cfg, ds_err *err);
int ds_draft_config_parse(const char *json, const char *what, ds_draft_config *cfg, ds_err *err);

#endif
