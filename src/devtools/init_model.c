/* init_model.c — random checkpoints in the Hugging Face layout (see init_model.h).
 *
 * Flow: preset -> list of tensor specs (name, dtype, shape, init rule) -> shard plan -> per shard,
 * generate its tensors one at a time into a writer, write the file, free it. Peak memory is one
 * shard plus one tensor, so bench-large (~2 GB) never sits in memory twice. config.json is written
 * last: its presence means the checkpoint is complete (the Makefile uses it as the target). */
#include "devtools/init_model.h"
#include "io/config.h"
#include "io/safetensors.h"
#include "kernels/shared/quant.h"
#include "text/tokenizer.h"

#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

// ------------------------------------------------------------------------------------------------
// Presets: everything that differs between the three checkpoints is a field here; the builders
// below read nothing else.

typedef struct draft_preset {
    int hidden, intermediate, layers, heads;
    int q_lora, kv_lora, dn, dr, dvh;
    int markov_rank;
    int taps[8], n_taps; /* target_layer_ids (0-based layer outputs) */
} draft_preset;

typedef struct preset {
    const char *name, *summary;
    int k3;      /* K3 layout: root kimi_k3 + text_config, weights under "language_model." */
    int vocab;   /* V (embedding / lm_head rows) */
    int n_ranks; /* tokenizer's ordinary tokens; special ids are n_ranks .. n_ranks+255 */
    int hidden, layers, intermediate;
    int situ;          /* hidden_act situ (beta 4, linear beta 25) instead of silu */
    int heads, q_lora; /* MLA heads; q_lora_rank, 0 = single q_proj */
    int kv_lora, dn, dr, dvh;
    int mla_gate; /* mla_use_output_gate */
    int kda_heads, kda_dim, conv;
    int full_attn[16], n_full_attn; /* 1-based MLA layers; every other layer is KDA */
    int gate_lower_bound;           /* K3 forget-gate form, lb = -5 */
    int full_rank_gate;             /* KDA g_proj [P, D] instead of g_a_proj/g_b_proj */
    int alog_len;       /* 0: A_log [1,1,Hk,1] (KL); else [alog_len], first Hk live, rest 0 (K3) */
    ds_dtype o_norm_dt; /* KDA o_norm: F32 in K3, BF16 in KL */
    int experts, topk, moe_inter, shared, first_dense, groups, topk_group;
    double routed_scale;
    const char *topk_method; /* NULL: key absent */
    int latent;              /* routed_expert_hidden_size (with latent_moe_use_norm); 0 = none */
    int attn_res;            /* attn_res_block_size; 0 = off */
    int64_t max_pos;
    int n_shards; /* 1: model.safetensors; >1: that many shards; 0: about SHARD_BYTES each */
    const draft_preset *draft; /* DSpark draft written to OUT/draft/, or NULL */
    int mxfp4; /* routed experts as compressed-tensors MXFP4 (set by the caller, not a preset) */
} preset;

#define SHARD_BYTES ((uint64_t)500 * 1000 * 1000)

// clang-format off
static const draft_preset TINY_DRAFT = {
    .hidden = 64, .intermediate = 128, .layers = 2, .heads = 4,
    .q_lora = 32, .kv_lora = 32, .dn = 16, .dr = 8, .dvh = 16,
    .markov_rank = 16, .taps = {1, 4, 8}, .n_taps = 3,
};

static const preset PRESETS[] = {
    {
        .name = "tiny-k3",
        .summary = "Kimi-K3 layout, 10 layers, D=64, AttnRes + latent MoE, with a DSpark draft",
        .k3 = 1, .vocab = 1024, .n_ranks = 768,
        .hidden = 64, .layers = 10, .intermediate = 96, .situ = 1,
        .heads = 4, .q_lora = 32, .kv_lora = 32, .dn = 16, .dr = 8, .dvh = 16, .mla_gate = 1,
        .kda_heads = 4, .kda_dim = 16, .conv = 4, .full_attn = {4, 8, 9, 10}, .n_full_attn = 4,
        .gate_lower_bound = 1, .full_rank_gate = 1, .alog_len = 8, .o_norm_dt = DS_DT_F32,
        .experts = 8, .topk = 2, .moe_inter = 32, .shared = 1, .first_dense = 1,
        .groups = 2, .topk_group = 1, .routed_scale = 1.0, .topk_method = "noaux_tc",
        .latent = 32, .attn_res = 3, .max_pos = 4096,
        .n_shards = 1, .draft = &TINY_DRAFT,
    },
    {
        .name = "tiny-linear",
        .summary = "Kimi-Linear layout, 8 layers, D=64, two shards",
        .k3 = 0, .vocab = 1024, .n_ranks = 768,
        .hidden = 64, .layers = 8, .intermediate = 128, .situ = 0,
        .heads = 4, .q_lora = 0, .kv_lora = 32, .dn = 16, .dr = 8, .dvh = 16, .mla_gate = 0,
        .kda_heads = 4, .kda_dim = 16, .conv = 4, .full_attn = {4, 8}, .n_full_attn = 2,
        .gate_lower_bound = 0, .full_rank_gate = 0, .alog_len = 0, .o_norm_dt = DS_DT_BF16,
        .experts = 8, .topk = 2, .moe_inter = 32, .shared = 1, .first_dense = 1,
        .groups = 2, .topk_group = 1, .routed_scale = 2.446, .topk_method = NULL,
        .latent = 0, .attn_res = 0, .max_pos = 4096,
        .n_shards = 2, .draft = NULL,
    },
    {
        .name = "bench-large",
        .summary = "Kimi-Linear structure, ~1 B parameters BF16 (~2 GB), 12 layers, D=2048",
        .k3 = 0, .vocab = 65536, .n_ranks = 768, /* ids >= 1024 are unused vocabulary rows */
        .hidden = 2048, .layers = 12, .intermediate = 4096, .situ = 0,
        .heads = 16, .q_lora = 0, .kv_lora = 512, .dn = 128, .dr = 64, .dvh = 128, .mla_gate = 0,
        .kda_heads = 16, .kda_dim = 128, .conv = 4, .full_attn = {4, 8, 12}, .n_full_attn = 3,
        .gate_lower_bound = 0, .full_rank_gate = 0, .alog_len = 0, .o_norm_dt = DS_DT_BF16,
        .experts = 16, .topk = 4, .moe_inter = 512, .shared = 1, .first_dense = 1,
        .groups = 1, .topk_group = 1, .routed_scale = 2.446, .topk_method = NULL,
        .latent = 0, .attn_res = 0, .max_pos = 131072,
        .n_shards = 0, .draft = NULL,
    },
};
// clang-format on

/* Special ids, as offsets from n_ranks (docs/model.md §9.3: 163584 + k). */
enum { SP_BOS = 0, SP_EOS = 2, SP_MEDIA = 21, SP_MASK = 253, SP_PAD = 255 };

static const preset *find_preset(const char *name) {
    for (size_t i = 0; i < DS_ARRAY_LEN(PRESETS); i++)
        if (name && strcmp(PRESETS[i].name, name) == 0) return &PRESETS[i];
    return NULL;
}

const char *const *ds_init_model_presets(void) {
    /* Filled from the table on every call; the values never change, so concurrent calls agree. */
    static const char *names[DS_ARRAY_LEN(PRESETS) + 1];
    for (size_t i = 0; i < DS_ARRAY_LEN(PRESETS); i++) names[i] = PRESETS[i].name;
    names[DS_ARRAY_LEN(PRESETS)] = NULL;
    return names;
}

const char *ds_init_model_describe(const char *name) {
    const preset *p = find_preset(name);
    return p ? p->summary : NULL;
}

static int is_mla_layer(const preset *p, int i) {
    for (int j = 0; j < p->n_full_attn; j++)
        if (p->full_attn[j] == i + 1) return 1;
    return 0;
}

static int is_moe_layer(const preset *p, int i) {
    return p->experts > 0 && i >= p->first_dense; /* moe_layer_freq is 1 in every preset */
}

// ------------------------------------------------------------------------------------------------
// Tensor specs: what to write, without the data.

typedef enum {
    INIT_LINEAR,  /* N(0, 1/sqrt(cols)): projections, embeddings, lm_head, AttnRes proj [1, D] */
    INIT_NORM,    /* 1 + 0.1 N(0,1): RMSNorm weights, so a wrong or missing one shows */
    INIT_ALOG,    /* log U(1,16) for the first `live` entries, 0 after (the K3 padding) */
    INIT_DT_BIAS, /* 0.1 N(0,1) */
    INIT_CONV,    /* 0.5 N(0,1) */
    INIT_BIAS,    /* 0.1 N(0,1): router correction bias, confidence-head bias */
} init_rule;

typedef struct tspec {
    char *name;      /* heap */
    char *seed_name; /* heap; key of the RNG stream: the name, or another tensor's for a copy */
    ds_dtype dtype;
    int ndim;
    int64_t shape[DS_MAX_DIMS];
    int64_t numel, live;
    size_t nbytes;
    init_rule rule;
    int shard;
    /* MXFP4 halves of the BF16 matrix [mx_rows][mx_cols] drawn under seed_name: 1 = the packed
     * codes, 2 = the E8M0 scales (docs/quantization.md §2); 0 = an ordinary tensor */
    int mx;
    int64_t mx_rows, mx_cols;
} tspec;

typedef struct tlist {
    tspec *v; /* [n] in file order */
    int n, cap;
    int oom;
} tlist;

static void tl_free(tlist *l) {
    for (int i = 0; i < l->n; i++) {
        free(l->v[i].name);
        free(l->v[i].seed_name);
    }
    free(l->v);
    memset(l, 0, sizeof *l);
}

#define SHAPE(...)                                                                                 \
    (const int64_t[]){__VA_ARGS__}, (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t))

/* Appends a tensor named by printf(fmt, ...). Returns it, or NULL after an allocation failure
 * (remembered in l->oom and reported once by the caller). */
static tspec *tl_add(tlist *l, init_rule rule, ds_dtype dt, const int64_t *shape, int ndim,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static tspec *tl_add(tlist *l, init_rule rule, ds_dtype dt, const int64_t *shape, int ndim,
                     const char *fmt, ...) {
    if (l->oom) return NULL;
    if (l->n == l->cap) {
        int cap = l->cap ? 2 * l->cap : 256;
        tspec *nv = realloc(l->v, (size_t)cap * sizeof *nv);
        if (!nv) {
            l->oom = 1;
            return NULL;
        }
        l->v = nv;
        l->cap = cap;
    }
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    tspec *t = &l->v[l->n];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    t->seed_name = strdup(name);
    if (!t->name || !t->seed_name) {
        free(t->name);
        free(t->seed_name);
        l->oom = 1;
        return NULL;
    }
    t->rule = rule;
    t->dtype = dt;
    t->ndim = ndim;
    t->numel = 1;
    for (int d = 0; d < ndim; d++) {
        t->shape[d] = shape[d];
        t->numel *= shape[d];
    }
    t->live = t->numel;
    t->nbytes = (size_t)t->numel * ds_dtype_size(dt);
    l->n++;
    return t;
}

#define BF16 DS_DT_BF16
#define F32  DS_DT_F32

/* MLA attention (docs/model.md §4.1), shared by the target and the draft. pre ends in "self_attn.".
 */
static void add_mla(tlist *l, const char *pre, int D, int H, int q_lora, int kv_lora, int dn,
                    int dr, int dvh, int out_gate) {
    if (q_lora) {
        tl_add(l, INIT_LINEAR, BF16, SHAPE(q_lora, D), "%sq_a_proj.weight", pre);
        tl_add(l, INIT_NORM, BF16, SHAPE(q_lora), "%sq_a_layernorm.weight", pre);
        tl_add(l, INIT_LINEAR, BF16, SHAPE(H * (dn + dr), q_lora), "%sq_b_proj.weight", pre);
    } else {
        tl_add(l, INIT_LINEAR, BF16, SHAPE(H * (dn + dr), D), "%sq_proj.weight", pre);
    }
    tl_add(l, INIT_LINEAR, BF16, SHAPE(kv_lora + dr, D), "%skv_a_proj_with_mqa.weight", pre);
    tl_add(l, INIT_NORM, BF16, SHAPE(kv_lora), "%skv_a_layernorm.weight", pre);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(H * (dn + dvh), kv_lora), "%skv_b_proj.weight", pre);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(D, H * dvh), "%so_proj.weight", pre);
    if (out_gate) tl_add(l, INIT_LINEAR, BF16, SHAPE(H * dvh, D), "%sg_proj.weight", pre);
}

/* KDA attention (docs/model.md §3.1). pre ends in "self_attn.". */
static void add_kda(tlist *l, const preset *p, const char *pre) {
    const int D = p->hidden, Hk = p->kda_heads, dk = p->kda_dim, P = Hk * dk;
    static const char qkv[3] = {'q', 'k', 'v'};
    for (int j = 0; j < 3; j++)
        tl_add(l, INIT_LINEAR, BF16, SHAPE(P, D), "%s%c_proj.weight", pre, qkv[j]);
    for (int j = 0; j < 3; j++) /* F32 in both checkpoints' spirit (K3 ships F32) */
        tl_add(l, INIT_CONV, F32, SHAPE(P, 1, p->conv), "%s%c_conv1d.weight", pre, qkv[j]);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(dk, D), "%sf_a_proj.weight", pre);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(P, dk), "%sf_b_proj.weight", pre);
    tl_add(l, INIT_DT_BIAS, F32, SHAPE(P), "%sdt_bias", pre);
    tspec *a = p->alog_len ? tl_add(l, INIT_ALOG, F32, SHAPE(p->alog_len), "%sA_log", pre)
                           : tl_add(l, INIT_ALOG, F32, SHAPE(1, 1, Hk, 1), "%sA_log", pre);
    if (a) a->live = Hk;
    tl_add(l, INIT_LINEAR, BF16, SHAPE(Hk, D), "%sb_proj.weight", pre);
    if (p->full_rank_gate) {
        tl_add(l, INIT_LINEAR, BF16, SHAPE(P, D), "%sg_proj.weight", pre);
    } else {
        tl_add(l, INIT_LINEAR, BF16, SHAPE(dk, D), "%sg_a_proj.weight", pre);
        tl_add(l, INIT_LINEAR, BF16, SHAPE(P, dk), "%sg_b_proj.weight", pre);
    }
    tl_add(l, INIT_NORM, p->o_norm_dt, SHAPE(dk), "%so_norm.weight", pre);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(D, P), "%so_proj.weight", pre);
}

/* SwiGLU/SiTU MLP: dense layer, shared expert, draft MLP (docs/model.md §5.2). */
static void add_mlp(tlist *l, const char *pre, int D, int I) {
    tl_add(l, INIT_LINEAR, BF16, SHAPE(I, D), "%sgate_proj.weight", pre);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(I, D), "%sup_proj.weight", pre);
    tl_add(l, INIT_LINEAR, BF16, SHAPE(D, I), "%sdown_proj.weight", pre);
}

/* base.weight_packed [rows][cols/2] and base.weight_scale [rows][cols/32] (U8): the MXFP4 form of
 * the BF16 matrix base.weight that the BF16 checkpoint of the same seed holds. */
static void add_mxfp4(tlist *l, int rows, int cols, const char *fmt, const char *pre, int e) {
    char base[320];
    snprintf(base, sizeof base, fmt, pre, e);
    for (int half = 1; half <= 2; half++) {
        int per = half == 1 ? 2 : DS_MXFP4_GROUP;
        tspec *t = tl_add(l, INIT_LINEAR, DS_DT_U8, SHAPE(rows, cols / per), "%s.%s", base,
                          half == 1 ? "weight_packed" : "weight_scale");
        if (!t) return;
        char *seed_name = malloc(strlen(base) + 8);
        if (!seed_name) {
            l->oom = 1;
            return;
        }
        sprintf(seed_name, "%s.weight", base);
        free(t->seed_name);
        t->seed_name = seed_name;
        t->mx = half;
        t->mx_rows = rows;
        t->mx_cols = cols;
    }
}

/* Router, optional latent projections, routed and shared experts (docs/model.md §5.3, §5.4).
 * pre ends in "block_sparse_moe.". */
static void add_moe(tlist *l, const preset *p, const char *pre) {
    const int D = p->hidden, E = p->experts, I = p->moe_inter;
    const int H_in = p->latent ? p->latent : D; /* width the routed experts read */
    tl_add(l, INIT_LINEAR, BF16, SHAPE(E, D), "%sgate.weight", pre);
    tl_add(l, INIT_BIAS, F32, SHAPE(E), "%sgate.e_score_correction_bias", pre);
    if (p->latent) {
        tl_add(l, INIT_LINEAR, BF16, SHAPE(p->latent, D), "%srouted_expert_down_proj.weight", pre);
        tl_add(l, INIT_LINEAR, BF16, SHAPE(D, p->latent), "%srouted_expert_up_proj.weight", pre);
        tl_add(l, INIT_NORM, BF16, SHAPE(p->latent), "%srouted_expert_norm.weight", pre);
    }
    for (int e = 0; e < E; e++) {
        if (p->mxfp4) {
            add_mxfp4(l, I, H_in, "%sexperts.%d.w1", pre, e);
            add_mxfp4(l, H_in, I, "%sexperts.%d.w2", pre, e);
            add_mxfp4(l, I, H_in, "%sexperts.%d.w3", pre, e);
            continue;
        }
        tl_add(l, INIT_LINEAR, BF16, SHAPE(I, H_in), "%sexperts.%d.w1.weight", pre, e);
        tl_add(l, INIT_LINEAR, BF16, SHAPE(H_in, I), "%sexperts.%d.w2.weight", pre, e);
        tl_add(l, INIT_LINEAR, BF16, SHAPE(I, H_in), "%sexperts.%d.w3.weight", pre, e);
    }
    if (p->shared) {
        char sp[320];
        snprintf(sp, sizeof sp, "%sshared_experts.", pre);
        add_mlp(l, sp, D, I * p->shared);
    }
}

static const char *weight_prefix(const preset *p) {
    return p->k3 ? "language_model." : "";
}

/* The target model, in the order HF's state dict lists it. */
static void build_target(tlist *l, const preset *p) {
    const char *wp = weight_prefix(p);
    const int D = p->hidden, V = p->vocab;
    char pre[256];
    tl_add(l, INIT_LINEAR, BF16, SHAPE(V, D), "%smodel.embed_tokens.weight", wp);
    for (int i = 0; i < p->layers; i++) {
        char lp[160];
        snprintf(lp, sizeof lp, "%smodel.layers.%d.", wp, i);
        tl_add(l, INIT_NORM, BF16, SHAPE(D), "%sinput_layernorm.weight", lp);
        snprintf(pre, sizeof pre, "%sself_attn.", lp);
        if (is_mla_layer(p, i))
            add_mla(l, pre, D, p->heads, p->q_lora, p->kv_lora, p->dn, p->dr, p->dvh, p->mla_gate);
        else
            add_kda(l, p, pre);
        tl_add(l, INIT_NORM, BF16, SHAPE(D), "%spost_attention_layernorm.weight", lp);
        if (is_moe_layer(p, i)) {
            snprintf(pre, sizeof pre, "%sblock_sparse_moe.", lp);
            add_moe(l, p, pre);
        } else {
            snprintf(pre, sizeof pre, "%smlp.", lp);
            add_mlp(l, pre, D, p->intermediate);
        }
        if (p->attn_res) { /* AttnRes projections [1, D]: N(0,1)/sqrt(D) so mixes are not uniform */
            tl_add(l, INIT_NORM, BF16, SHAPE(D), "%sself_attention_res_norm.weight", lp);
            tl_add(l, INIT_LINEAR, BF16, SHAPE(1, D), "%sself_attention_res_proj.weight", lp);
            tl_add(l, INIT_NORM, BF16, SHAPE(D), "%smlp_res_norm.weight", lp);
            tl_add(l, INIT_LINEAR, BF16, SHAPE(1, D), "%smlp_res_proj.weight", lp);
        }
    }
    tl_add(l, INIT_NORM, BF16, SHAPE(D), "%smodel.norm.weight", wp);
    if (p->attn_res) {
        tl_add(l, INIT_NORM, BF16, SHAPE(D), "%smodel.output_attn_res_norm.weight", wp);
        tl_add(l, INIT_LINEAR, BF16, SHAPE(1, D), "%smodel.output_attn_res_proj.weight", wp);
    }
    tl_add(l, INIT_LINEAR, BF16, SHAPE(V, D), "%slm_head.weight", wp);
}

/* The DSpark draft (docs/model.md §8.2), all BF16. Its embed_tokens is a copy of the target's: it
 * draws from the target embedding's RNG stream, so the bytes are identical. */
static void build_draft(tlist *l, const preset *p) {
    const draft_preset *d = p->draft;
    const int D = d->hidden, V = p->vocab, r = d->markov_rank;
    tl_add(l, INIT_LINEAR, BF16, SHAPE(D, d->n_taps * p->hidden), "context_proj.weight");
    tl_add(l, INIT_NORM, BF16, SHAPE(D), "context_norm.weight");
    tl_add(l, INIT_NORM, BF16, SHAPE(D), "final_norm.weight");
    for (int i = 0; i < d->layers; i++) {
        char lp[64], pre[96];
        snprintf(lp, sizeof lp, "layers.%d.", i);
        tl_add(l, INIT_NORM, BF16, SHAPE(D), "%sinput_layernorm.weight", lp);
        snprintf(pre, sizeof pre, "%sself_attn.", lp);
        add_mla(l, pre, D, d->heads, d->q_lora, d->kv_lora, d->dn, d->dr, d->dvh, 0);
        tl_add(l, INIT_NORM, BF16, SHAPE(D), "%spost_attention_layernorm.weight", lp);
        snprintf(pre, sizeof pre, "%smlp.", lp);
        add_mlp(l, pre, D, d->intermediate);
    }
    tl_add(l, INIT_LINEAR, BF16, SHAPE(V, r), "markov_head.markov_w1.weight");
    tl_add(l, INIT_LINEAR, BF16, SHAPE(V, r), "markov_head.markov_w2.weight");
    tl_add(l, INIT_LINEAR, BF16, SHAPE(1, D + r), "confidence_head.proj.weight");
    tl_add(l, INIT_BIAS, BF16, SHAPE(1), "confidence_head.proj.bias");
    tspec *e = tl_add(l, INIT_LINEAR, BF16, SHAPE(V, p->hidden), "embed_tokens.weight");
    if (e) {
        char *s = malloc(strlen(weight_prefix(p)) + 32);
        if (!s) {
            l->oom = 1;
            return;
        }
        sprintf(s, "%smodel.embed_tokens.weight", weight_prefix(p));
        free(e->seed_name);
        e->seed_name = s;
    }
}

// ------------------------------------------------------------------------------------------------
// Values. Each tensor has its own stream, keyed by (seed, seed_name), cut into CHUNK-element pieces
// that each seed a fresh generator: the result does not depend on thread count or tensor order.

#define CHUNK ((int64_t)1 << 16)

static uint64_t mix64(uint64_t z) { /* splitmix64 finaliser: a bijection that scrambles bits */
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a64(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

static double draw(const tspec *t, ds_rng *rng, int64_t i, double lin_std) {
    switch (t->rule) {
    case INIT_LINEAR:
        return lin_std * ds_rng_normal(rng);
    case INIT_NORM:
        return 1.0 + 0.1 * ds_rng_normal(rng);
    case INIT_ALOG:
        return i < t->live ? log(1.0 + 15.0 * ds_rng_uniform(rng)) : 0.0;
    case INIT_DT_BIAS:
        return 0.1 * ds_rng_normal(rng);
    case INIT_CONV:
        return 0.5 * ds_rng_normal(rng);
    case INIT_BIAS:
        return 0.1 * ds_rng_normal(rng);
    }
    return 0.0;
}

/* out: [t->numel] elements of t->dtype (F32, F16 or BF16), rounded to nearest even. */
static void fill_tensor(const tspec *t, uint64_t seed, void *out);

/* One group of 32 BF16 values to MXFP4, as tools/reference/make_random_ckpt.py rounds: the scale
 * 2^e with e = ceil(log2(amax / 6)) (so the largest magnitude needs at most code 6), each value
 * to the nearest E2M1 magnitude (the smaller one on a tie). codes [32], returns the scale byte. */
static uint8_t mxfp4_group(const uint16_t *w, uint8_t *codes) {
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    double amax = 0;
    for (int i = 0; i < DS_MXFP4_GROUP; i++) amax = fmax(amax, fabs(ds_bf16_to_f32(w[i])));
    int e = (int)ceil(log2(fmax(amax, 1e-30) / 6.0));
    e = e < -127 ? -127 : e > 127 ? 127 : e;
    for (int i = 0; i < DS_MXFP4_GROUP; i++) {
        double x = ds_bf16_to_f32(w[i]) / ldexp(1.0, e);
        int best = 0;
        for (int k = 1; k < 8; k++)
            if (fabs(fabs(x) - mag[k]) < fabs(fabs(x) - mag[best])) best = k;
        codes[i] = (uint8_t)(best | (x < 0 ? 8 : 0));
    }
    return (uint8_t)(e + 127);
}

/* An MXFP4 half (t->mx): draws the BF16 matrix, then keeps its codes or its scales. */
static int fill_mxfp4(const tspec *t, uint64_t seed, uint8_t *out, ds_err *err) {
    tspec b = *t; /* the BF16 matrix it comes from */
    b.dtype = DS_DT_BF16;
    b.ndim = 2;
    b.shape[0] = t->mx_rows;
    b.shape[1] = t->mx_cols;
    b.numel = b.live = t->mx_rows * t->mx_cols;
    b.mx = 0;
    uint16_t *w = ds_malloc((size_t)b.numel * 2, err); /* [mx_rows][mx_cols] */
    if (!w) return DS_ERR;
    fill_tensor(&b, seed, w);
    for (int64_t g = 0; g < b.numel / DS_MXFP4_GROUP; g++) {
        uint8_t codes[DS_MXFP4_GROUP];
        uint8_t sc = mxfp4_group(w + g * DS_MXFP4_GROUP, codes);
        if (t->mx == 2) {
            out[g] = sc;
        } else {
            for (int i = 0; i < DS_MXFP4_GROUP; i += 2)
                out[g * DS_MXFP4_GROUP / 2 + i / 2] = (uint8_t)(codes[i] | (codes[i + 1] << 4));
        }
    }
    free(w);
    return DS_OK;
}

static void fill_tensor(const tspec *t, uint64_t seed, void *out) {
    const uint64_t key = mix64(seed ^ mix64(fnv1a64(t->seed_name)));
    const double lin_std = 1.0 / sqrt((double)t->shape[t->ndim - 1]); /* fan_in = cols */
    const int64_t n_chunks = (t->numel + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) if (n_chunks > 1)
    for (int64_t c = 0; c < n_chunks; c++) {
        ds_rng rng;
        ds_rng_seed(&rng, mix64(key + (uint64_t)c * 0x9e3779b97f4a7c15ull));
        const int64_t i1 = DS_MIN(t->numel, (c + 1) * CHUNK);
        for (int64_t i = c * CHUNK; i < i1; i++) {
            float v = (float)draw(t, &rng, i, lin_std);
            if (t->dtype == DS_DT_F32)
                ((float *)out)[i] = v;
            else if (t->dtype == DS_DT_BF16)
                ((uint16_t *)out)[i] = ds_f32_to_bf16(v);
            else
                ((uint16_t *)out)[i] = ds_f32_to_f16(v);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Files.

static int path_join(char *out, size_t cap, const char *dir, const char *name, ds_err *err) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return ds_errf(err, "%s/%s: path too long", dir, name);
    return DS_OK;
}

static int mkdir_p(const char *dir, ds_err *err) {
    char buf[4096];
    size_t n = strlen(dir);
    if (n == 0 || n >= sizeof buf) return ds_errf(err, "'%s': bad output folder name", dir);
    memcpy(buf, dir, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != 0) continue;
        char c = buf[i];
        buf[i] = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return ds_errf(err, "%s: cannot create folder: %s", buf, strerror(errno));
        buf[i] = c;
    }
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return ds_errf(err, "%s: exists and is not a folder", dir);
    return DS_OK;
}

/* Removes the weight files of an earlier checkpoint in dir (a stale index would win over a fresh
 * single file when the folder is opened), and config.json too when `with_config`. */
static int remove_stale(const char *dir, int with_config, ds_err *err) {
    DIR *d = opendir(dir);
    if (!d) return DS_OK;
    struct dirent *e;
    int rc = DS_OK;
    while (rc == DS_OK && (e = readdir(d)) != NULL) {
        const char *n = e->d_name;
        if (strcmp(n, "model.safetensors") != 0 && strcmp(n, "model.safetensors.index.json") != 0 &&
            fnmatch("model-*-of-*.safetensors", n, 0) != 0 &&
            !(with_config && strcmp(n, "config.json") == 0))
            continue;
        char path[4096];
        rc = path_join(path, sizeof path, dir, n, err);
        if (rc == DS_OK && unlink(path) != 0 && errno != ENOENT)
            rc = ds_errf(err, "%s: cannot remove stale file: %s", path, strerror(errno));
    }
    closedir(d);
    return rc;
}

/* Writes j (pretty, sorted keys, trailing newline as transformers does) and releases it. */
/* data[len] as the whole of the file at path. */
static int write_bytes(const char *path, const char *data, size_t len, ds_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return ds_errf(err, "%s: cannot create: %s", path, strerror(errno));
    int bad = fwrite(data, 1, len, f) != len;
    bad |= fclose(f) != 0;
    return bad ? ds_errf(err, "%s: write failed", path) : DS_OK;
}

static int write_json(json_t *j, const char *path, ds_err *err) {
    if (!j) return ds_errf(err, "%s: out of memory building JSON", path);
    char *s = json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(10));
    json_decref(j);
    size_t n = s ? strlen(s) : 0;
    char *t = s ? realloc(s, n + 2) : NULL; /* the text and a final newline */
    if (!t) {
        free(s);
        return ds_errf(err, "%s: out of memory serialising JSON", path);
    }
    t[n] = '\n';
    t[n + 1] = 0;
    int rc = write_bytes(path, t, n + 1, err);
    free(t);
    return rc;
}

/* Splits the list into shards of about equal bytes (n_req > 0: that many; 0: SHARD_BYTES each)
 * and returns the number used. Tensors stay in order, so each shard is a contiguous run. */
static int plan_shards(tlist *l, int n_req) {
    uint64_t total = 0, cum = 0;
    for (int i = 0; i < l->n; i++) total += l->v[i].nbytes;
    uint64_t n = n_req > 0 ? (uint64_t)n_req : (total + SHARD_BYTES - 1) / SHARD_BYTES;
    if (n < 1) n = 1;
    uint64_t s = 0;
    for (int i = 0; i < l->n; i++) {
        l->v[i].shard = (int)s;
        cum += l->v[i].nbytes;
        if (s + 1 < n && i + 1 < l->n && cum * n >= total * (s + 1)) s++;
    }
    return (int)s + 1;
}

static void shard_name(char *out, size_t cap, int s, int n_shards) {
    if (n_shards == 1)
        snprintf(out, cap, "model.safetensors");
    else
        snprintf(out, cap, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
}

/* Generates and writes every tensor of l into dir, shard by shard, plus the index when sharded. */
static int write_weights(const tlist *l, int n_shards, const char *dir, uint64_t seed,
                         ds_err *err) {
    char file[64], path[4096];
    int i = 0;
    for (int s = 0; s < n_shards; s++) {
        ds_st_writer *w = ds_st_writer_new(err);
        if (!w) return DS_ERR;
        int rc = ds_st_writer_set_metadata(w, "format", "pt", err); /* as torch's save_file */
        for (; rc == DS_OK && i < l->n && l->v[i].shard == s; i++) {
            const tspec *t = &l->v[i];
            void *buf = ds_malloc(t->nbytes, err); /* [numel] of t->dtype */
            if (!buf) {
                rc = DS_ERR;
                break;
            }
            if (t->mx)
                rc = fill_mxfp4(t, seed, buf, err);
            else
                fill_tensor(t, seed, buf);
            if (rc == DS_OK)
                rc = ds_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, buf, err);
            free(buf);
        }
        shard_name(file, sizeof file, s, n_shards);
        if (rc == DS_OK) rc = path_join(path, sizeof path, dir, file, err);
        if (rc == DS_OK) rc = ds_st_writer_write(w, path, err);
        ds_st_writer_free(w);
        if (rc != DS_OK) return rc;
    }
    if (n_shards == 1) return DS_OK;

    /* model.safetensors.index.json: {"metadata": {"total_size": bytes}, "weight_map": {...}} */
    json_t *map = json_object(), *meta = json_object(), *idx = json_object();
    uint64_t total = 0;
    for (int k = 0; k < l->n; k++) {
        shard_name(file, sizeof file, l->v[k].shard, n_shards);
        json_object_set_new(map, l->v[k].name, json_string(file));
        total += l->v[k].nbytes;
    }
    json_object_set_new(meta, "total_size", json_integer((json_int_t)total));
    json_object_set_new(idx, "metadata", meta);
    json_object_set_new(idx, "weight_map", map);
    if (path_join(path, sizeof path, dir, "model.safetensors.index.json", err)) {
        json_decref(idx);
        return DS_ERR;
    }
    return write_json(idx, path, err);
}

// ------------------------------------------------------------------------------------------------
// config.json

static void set_i(json_t *o, const char *k, int64_t v) {
    json_object_set_new(o, k, json_integer((json_int_t)v));
}
static void set_f(json_t *o, const char *k, double v) {
    json_object_set_new(o, k, json_real(v));
}
static void set_s(json_t *o, const char *k, const char *v) {
    json_object_set_new(o, k, json_string(v));
}
static void set_b(json_t *o, const char *k, int v) {
    json_object_set_new(o, k, json_boolean(v));
}
static json_t *str_array(const char *s) {
    json_t *a = json_array();
    json_array_append_new(a, json_string(s));
    return a;
}

/* The kimi_linear text config (docs/model.md §1): the whole file for Kimi-Linear, text_config in
 * K3.
 */
static json_t *text_config_json(const preset *p) {
    json_t *c = json_object(), *la = json_object(), *kda = json_array(), *full = json_array();
    set_s(c, "model_type", "kimi_linear");
    set_i(c, "vocab_size", p->vocab);
    set_i(c, "hidden_size", p->hidden);
    set_i(c, "num_hidden_layers", p->layers);
    set_i(c, "intermediate_size", p->intermediate);
    set_f(c, "rms_norm_eps", 1e-5);
    set_s(c, "hidden_act", p->situ ? "situ" : "silu");
    if (p->situ) {
        set_f(c, "activation_situ_beta", 4.0);
        set_f(c, "activation_situ_linear_beta", 25.0);
    }
    set_i(c, "num_attention_heads", p->heads);
    set_i(c, "num_key_value_heads", p->heads);
    json_object_set_new(c, "q_lora_rank", p->q_lora ? json_integer(p->q_lora) : json_null());
    set_i(c, "kv_lora_rank", p->kv_lora);
    set_i(c, "qk_nope_head_dim", p->dn);
    set_i(c, "qk_rope_head_dim", p->dr);
    set_i(c, "v_head_dim", p->dvh);
    set_b(c, "mla_use_nope", 1);
    if (p->mla_gate) set_b(c, "mla_use_output_gate", 1);
    if (!p->k3) { /* Kimi-Linear's config carries them (unused: the target is NoPE) */
        set_f(c, "rope_theta", 10000.0);
        json_object_set_new(c, "rope_scaling", json_null());
    }
    for (int i = 0; i < p->layers; i++)
        json_array_append_new(is_mla_layer(p, i) ? full : kda, json_integer(i + 1));
    set_i(la, "num_heads", p->kda_heads);
    set_i(la, "head_dim", p->kda_dim);
    set_i(la, "short_conv_kernel_size", p->conv);
    json_object_set_new(la, "kda_layers", kda);
    json_object_set_new(la, "full_attn_layers", full);
    if (p->gate_lower_bound) set_f(la, "gate_lower_bound", -5.0);
    if (p->full_rank_gate) set_b(la, "use_full_rank_gate", 1);
    json_object_set_new(c, "linear_attn_config", la);
    set_i(c, "num_experts", p->experts);
    set_i(c, "num_experts_per_token", p->topk);
    set_i(c, "moe_intermediate_size", p->moe_inter);
    set_i(c, "num_shared_experts", p->shared);
    set_i(c, "first_k_dense_replace", p->first_dense);
    set_i(c, "moe_layer_freq", 1);
    set_s(c, "moe_router_activation_func", "sigmoid");
    set_b(c, "moe_renormalize", 1);
    set_f(c, "routed_scaling_factor", p->routed_scale);
    set_b(c, "use_grouped_topk", 1);
    set_i(c, "num_expert_group", p->groups);
    set_i(c, "topk_group", p->topk_group);
    if (p->topk_method) set_s(c, "topk_method", p->topk_method);
    if (p->latent) {
        set_i(c, "routed_expert_hidden_size", p->latent);
        set_b(c, "latent_moe_use_norm", 1);
    }
    if (p->attn_res) set_i(c, "attn_res_block_size", p->attn_res);
    set_i(c, "num_nextn_predict_layers", 0);
    set_i(c, "max_position_embeddings", p->max_pos);
    set_b(c, "tie_word_embeddings", 0);
    set_s(c, "torch_dtype", "bfloat16");
    return c;
}

static json_t *config_json(const preset *p) {
    json_t *root = p->k3 ? json_object() : text_config_json(p);
    if (p->k3) {
        set_s(root, "model_type", "kimi_k3");
        json_object_set_new(root, "architectures", str_array("KimiK3ForConditionalGeneration"));
        set_i(root, "media_placeholder_token_id", p->n_ranks + SP_MEDIA);
        set_b(root, "tie_word_embeddings", 0);
        set_s(root, "torch_dtype", "bfloat16");
        json_object_set_new(root, "vision_config", json_object());
        json_object_set_new(root, "text_config", text_config_json(p));
    } else {
        json_object_set_new(root, "architectures", str_array("KimiLinearForCausalLM"));
    }
    if (p->mxfp4) { /* as compressed-tensors writes it (docs/quantization.md §2) */
        json_t *q = json_object(), *groups = json_object(), *g0 = json_object();
        json_t *w = json_object(), *targets = json_array();
        set_s(q, "quant_method", "compressed-tensors");
        set_s(q, "format", "mxfp4-pack-quantized");
        set_s(q, "quantization_status", "compressed");
        json_array_append_new(targets, json_string("re:.*block_sparse_moe\\.experts\\..*"));
        json_object_set_new(g0, "targets", targets);
        set_i(w, "num_bits", 4);
        set_s(w, "type", "float");
        set_s(w, "strategy", "group");
        set_i(w, "group_size", DS_MXFP4_GROUP);
        set_b(w, "symmetric", 1);
        json_object_set_new(g0, "weights", w);
        json_object_set_new(g0, "input_activations", json_null());
        set_s(g0, "format", "mxfp4-pack-quantized");
        json_object_set_new(groups, "group_0", g0);
        json_object_set_new(q, "config_groups", groups);
        json_object_set_new(root, "quantization_config", q);
    }
    set_i(root, "bos_token_id", p->n_ranks + SP_BOS);
    set_i(root, "eos_token_id", p->n_ranks + SP_EOS);
    set_i(root, "pad_token_id", p->n_ranks + SP_PAD);
    return root;
}

/* The k3_dspark draft config (docs/model.md §8.1), scaled down. */
static json_t *draft_config_json(const preset *p) {
    const draft_preset *d = p->draft;
    json_t *c = json_object(), *rope = json_object(), *taps = json_array();
    json_object_set_new(c, "architectures", str_array("K3DSparkModel"));
    set_s(c, "model_type", "k3_dspark");
    set_i(c, "hidden_size", d->hidden);
    set_i(c, "intermediate_size", d->intermediate);
    set_i(c, "num_hidden_layers", d->layers);
    set_i(c, "num_attention_heads", d->heads);
    set_i(c, "num_key_value_heads", d->heads);
    set_i(c, "q_lora_rank", d->q_lora);
    set_i(c, "kv_lora_rank", d->kv_lora);
    set_i(c, "qk_nope_head_dim", d->dn);
    set_i(c, "qk_rope_head_dim", d->dr);
    set_i(c, "v_head_dim", d->dvh);
    set_b(c, "mla_use_nope", 0);
    set_b(c, "mla_use_output_gate", 0);
    set_i(c, "vocab_size", p->vocab);
    set_i(c, "draft_vocab_size", p->vocab);
    set_f(c, "rms_norm_eps", 1e-5);
    set_s(c, "hidden_act", "silu");
    set_i(c, "max_position_embeddings", 1048576);
    set_f(c, "rope_theta", 50000.0);
    set_s(rope, "rope_type", "yarn");
    set_f(rope, "factor", 32.0);
    set_i(rope, "original_max_position_embeddings", 32768);
    set_f(rope, "rope_theta", 50000.0);
    set_i(rope, "beta_fast", 32);
    set_i(rope, "beta_slow", 1);
    set_f(rope, "mscale", 1.0);
    set_f(rope, "mscale_all_dim", 1.0);
    json_object_set_new(c, "rope_parameters", rope);
    set_i(c, "num_target_layers", d->n_taps);
    set_i(c, "target_hidden_size", p->hidden);
    set_i(c, "target_num_hidden_layers", p->layers);
    for (int i = 0; i < d->n_taps; i++) json_array_append_new(taps, json_integer(d->taps[i]));
    json_object_set_new(c, "target_layer_ids", taps);
    set_i(c, "mask_token_id", p->n_ranks + SP_MASK);
    set_i(c, "markov_rank", d->markov_rank);
    set_s(c, "markov_head_type", "vanilla");
    set_b(c, "enable_confidence_head", 1);
    set_b(c, "confidence_head_with_markov", 1);
    set_b(c, "tie_word_embeddings", 0);
    set_s(c, "torch_dtype", "bfloat16");
    return c;
}

// ------------------------------------------------------------------------------------------------

/* Builds a tensor list with `build`, then writes it (sharded per n_shards) into dir. */
static int write_model(const preset *p, void (*build)(tlist *, const preset *), int n_shards,
                       const char *dir, uint64_t seed, ds_err *err) {
    tlist l = {0};
    build(&l, p);
    int rc = l.oom ? ds_errf(err, "out of memory listing tensors") : DS_OK;
    if (rc == DS_OK) rc = write_weights(&l, plan_shards(&l, n_shards), dir, seed, err);
    tl_free(&l);
    return rc;
}

int ds_init_model(const char *preset_name, const char *out_dir, uint64_t seed, ds_err *err) {
    return ds_init_model_ex(preset_name, out_dir, seed, 0, err);
}

int ds_init_model_ex(const char *preset_name, const char *out_dir, uint64_t seed, int mxfp4,
                     ds_err *err) {
    const preset *found = find_preset(preset_name);
    preset pv; /* the preset with the caller's choices */
    if (found) {
        pv = *found;
        pv.mxfp4 = mxfp4;
        if (mxfp4 && (!pv.experts || (pv.latent ? pv.latent : pv.hidden) % DS_MXFP4_GROUP ||
                      pv.moe_inter % DS_MXFP4_GROUP))
            return ds_errf(err,
                           "preset '%s': its experts cannot be MXFP4 (no experts, or a "
                           "width not a multiple of %d)",
                           preset_name, DS_MXFP4_GROUP);
    }
    const preset *p = found ? &pv : NULL;
    if (!p) {
        char list[256] = "";
        for (size_t i = 0; i < DS_ARRAY_LEN(PRESETS); i++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "",
                     PRESETS[i].name);
        return ds_errf(err, "unknown preset '%s' (expected one of: %s)",
                       preset_name ? preset_name : "(null)", list);
    }
    char draft_dir[4096], path[4096];
    if (mkdir_p(out_dir, err) || path_join(draft_dir, sizeof draft_dir, out_dir, "draft", err))
        return DS_ERR;
    /* config.json first goes away and comes back last: a folder with config.json is complete. */
    if (remove_stale(out_dir, 1, err) || remove_stale(draft_dir, 1, err)) return DS_ERR;
    rmdir(draft_dir); /* fails harmlessly when the folder holds other files or does not exist */

    if (write_model(p, build_target, p->n_shards, out_dir, seed, err))
        return ds_err_prefix(err, "%s", out_dir);
    if (ds_tok_write_files(out_dir, p->n_ranks, p->k3 ? DS_CHAT_K3 : DS_CHAT_KIMI_LINEAR, err))
        return ds_err_prefix(err, "%s: tokenizer", out_dir);
    if (p->draft) {
        if (mkdir_p(draft_dir, err)) return DS_ERR;
        if (write_model(p, build_draft, 1, draft_dir, seed, err))
            return ds_err_prefix(err, "%s", draft_dir);
        if (path_join(path, sizeof path, draft_dir, "config.json", err) ||
            write_json(draft_config_json(p), path, err))
            return DS_ERR;
    }
    if (path_join(path, sizeof path, out_dir, "config.json", err)) return DS_ERR;
    return write_json(config_json(p), path, err);
}

int ds_init_shape(const char *config_dir, const char *out_dir, ds_err *err) {
    char path[4096];
    ds_config c;
    if (path_join(path, sizeof path, config_dir, "config.json", err) ||
        ds_config_load(path, &c, err))
        return DS_ERR;
    /* the special ids sit at n_ranks + (official id - 163584), bos first (§9.3) */
    const int n_ranks = c.bos_token_id - SP_BOS;
    if (n_ranks < 256 || c.eos_token_id != n_ranks + SP_EOS || c.vocab_size < n_ranks + 256)
        return ds_errf(err,
                       "%s: bos_token_id %d, eos_token_id %d and vocab_size %d are not the layout "
                       "of Kimi's tokenizer (bos = ordinary tokens, eos = bos + %d, vocabulary at "
                       "least bos + 256)",
                       path, c.bos_token_id, c.eos_token_id, c.vocab_size, SP_EOS);
    size_t len = 0;
    char *text = ds_read_file(path, &len, err);
    if (!text) return DS_ERR;
    const ds_chat_format fmt = strcmp(c.model_type, "kimi_k3") ? DS_CHAT_KIMI_LINEAR : DS_CHAT_K3;
    int rc = mkdir_p(out_dir, err) || remove_stale(out_dir, 1, err) ||
                     ds_tok_write_files(out_dir, n_ranks, fmt, err) ||
                     path_join(path, sizeof path, out_dir, "config.json", err) ||
                     write_bytes(path, text, len, err)
                 ? DS_ERR
                 : DS_OK;
    free(text);
    return rc;
}
