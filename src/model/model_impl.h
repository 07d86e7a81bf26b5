/* model_impl.h — the inside of ds_model, shared by model.c (loading, binding) and the backends that
 * run it (src/backend/cpu, src/backend/cuda): bound weights, the stage and tensor-parallel share,
 * and state sizes. Nothing outside src/model and src/backend includes this. */
#ifndef DS_MODEL_IMPL_H
#define DS_MODEL_IMPL_H

#include "model/model.h"

/* ---- weights --------------------------------------------------------------------------------- */

typedef struct kda_w {
    ds_mat q, k, v;                  /* [P][D] */
    float *q_conv, *k_conv, *v_conv; /* [P][W] f32 */
    ds_mat f_a, f_b;                 /* [dk][D], [P][dk] */
    float *dt_bias;                  /* [P] */
    float *A_log;                    /* [Hk] (first Hk entries of the checkpoint tensor) */
    ds_mat b;                        /* [Hk][D] */
    ds_mat g, g_a, g_b;              /* full rank [P][D], or low rank [dk][D] + [P][dk] */
    float *o_norm;                   /* [dk] */
    ds_mat o;                        /* [D][P] */
} kda_w;

typedef struct mla_w {
    ds_mat q;         /* [Ha*(dn+dr)][D] when q_lora_rank == 0 */
    ds_mat q_a, q_b;  /* [Rq][D], [Ha*(dn+dr)][Rq] */
    float *q_a_norm;  /* [Rq] */
    ds_mat kv_a;      /* [R+dr][D] */
    float *kv_a_norm; /* [R] */
    ds_mat kv_b;      /* [Ha*(dn+dvh)][R] */
    ds_mat o;         /* [D][Ha*dvh] */
    ds_mat g;         /* [Ha*dvh][D] output gate (K3) */
} mla_w;

typedef struct ffn_w {
    int is_moe;
    ds_mat gate, up, down;          /* dense: [I][D], [I][D], [D][I] */
    ds_mat router;                  /* [E][D] */
    float *router_bias;             /* [E] or NULL */
    ds_mat *w1, *w3, *w2;           /* [E] each: [Ie][Hin], [Ie][Hin], [Hin][Ie] */
    ds_mat sh_gate, sh_up, sh_down; /* shared experts: [Ie*ns][D], .., [D][Ie*ns]; rows 0 if none */
    ds_mat lat_down, lat_up;        /* latent MoE: [Dlat][D], [D][Dlat] */
    float *lat_norm;                /* [Dlat] or NULL */
} ffn_w;

typedef struct layer_w {
    int kind;         /* ds_layer_kind */
    int kind_idx;     /* index among layers of the same kind (state slot / latent pool index) */
    float *in_norm;   /* [D] */
    float *post_norm; /* [D] */
    float *attn_res_np, *mlp_res_np; /* [D] norm ⊙ proj, AttnRes only */
    kda_w kda;
    mla_w mla;
    ffn_w ffn;
} layer_w;

struct ds_model {
    ds_config cfg;
    ds_model_opts opts;
    ds_st *st;
    ds_mat embed;        /* [nv][D] this rank's vocabulary rows [v0, v0+nv) (all V when T = 1) */
    ds_mat lm_head;      /* [nv][D] likewise */
    ds_mat lm_head_full; /* [V][D] a view of the whole lm_head (last stage), for the draft */
    float *final_norm;   /* [D] */
    float *out_res_np;   /* [D] AttnRes output mix, or NULL */
    layer_w *layers;     /* [L]; only [l0, l1) are bound */
    int l0, l1;          /* this stage's layers (all of them without pipeline parallelism) */
    int n_kda, n_mla;    /* KDA / MLA layers among them */
    /* tensor parallelism: this rank's share (the whole model when tp_size == 1) */
    int tp_rank, tp_size;
    int Hk, Ha;        /* KDA heads, MLA heads on this rank */
    int I_dense, I_sh; /* dense-MLP and shared-expert intermediate rows on this rank */
    int e0, e1;        /* routed experts [e0, e1) on this rank */
    int v0, nv, vp;    /* vocabulary rows [v0, v0+nv) on this rank; vp = ceil(V / T) per rank */
    void **owned;      /* every f32 vector converted at load */
    int n_owned, cap_owned;
    size_t weight_bytes;
    size_t vec_floats; /* floats in the f32 vectors held (norms, convs, gates' biases): read every
                          step */
    /* where it runs: the backend chosen at load (model/backend.h) and its state for this model
     * (its copy of the weights, scratch and step buffers), or NULL before attach */
    const struct ds_backend_ops *be;
    void *be_ctx;
    void (*draw_wait)(void *ctx); /* ds_model_set_draw_wait */
    void *draw_wait_ctx;
    int random; /* --load-format random: weights drawn, not read */
};

/* Floats per KDA layer in a state slot, for this rank's m->Hk heads: conv tails [3][W-1][P], then
 * the recurrent state [Hk][dk][dv]. */
static inline size_t ds_model_conv_floats(const ds_model *m) {
    const ds_config *c = &m->cfg;
    return (size_t)3 * (size_t)(c->short_conv_kernel_size - 1) * (size_t)(m->Hk * c->kda_head_dim);
}
static inline size_t ds_model_rec_floats(const ds_model *m) {
    const ds_config *c = &m->cfg;
    return (size_t)m->Hk * (size_t)c->kda_head_dim * (size_t)c->kda_head_dim;
}

/* Keeps p (malloc'd) until the model is freed; frees nothing on failure. */
int ds_model_own(ds_model *m, void *p, ds_err *err);

/* ---- quantization at load (model_quant.c; docs/quantization.md) -------------------------------
 */
/* Does ptpc_fp8 quantize the tensor `name` of file dtype dt under m's options? */
int ds_quant_wants(const ds_model *m, const char *name, ds_dtype dt);
/* The options' quantization fields are coherent (else a message naming the flag). */
int ds_quant_check_opts(const ds_model_opts *o, ds_err *err);
/* out = columns [c0, c0+nc) of w (every row) in FP8 with scales from w's whole rows; memory owned
 * by m. */
int ds_quant_ptpc(ds_model *m, const ds_mat *w, int c0, int nc, ds_mat *out, ds_err *err);
/* Binds base.weight_packed / base.weight_scale ([rows][cols/2], [rows][cols/32] U8) as an MXFP4
 * matrix; out->data NULL (and DS_OK) when the checkpoint has no packed tensor of that name. */
int ds_quant_bind_mxfp4(ds_model *m, const char *base, int rows, int cols, ds_mat *out,
                        ds_err *err);
/* A random MXFP4 matrix drawn from key (on the host, or as a descriptor for a device backend). */
int ds_quant_rand_mxfp4(ds_model *m, uint64_t key, int rows, int cols, ds_mat *out, ds_err *err);

/* A random matrix that only the device holds (--load-format random on a backend with
 * device_memory; model.c): the ds_mat's data points to this instead of elements. Element (i, j)
 * of the rank's [rows][cols] slice is element (row0 + i, col0 + j) of the full [.][full_cols]
 * tensor, drawn from key and its index there, times scale — the values the CPU draws, whichever
 * rank holds which slice. */
typedef struct ds_rand_mat {
    uint64_t magic; /* DS_RAND_MAGIC */
    const struct ds_model *owner;
    uint64_t key;
    int64_t row0, col0, full_cols;
    float scale;
    /* the ds_mat's dtype says what to make: BF16 (the draw itself), F8_E4M3 (the BF16 draw,
     * then ptpc-quantized with the scales of whole rows of the full tensor), MXFP4 (codes and
     * scales from ds_rand_mxfp4_code / ds_rand_mxfp4_scale with this e2) */
    int e2;
} ds_rand_mat;
#define DS_RAND_MAGIC 0x72616e646d617431ull
/* w's descriptor when it is such a matrix of m, else NULL. */
const ds_rand_mat *ds_model_rand_mat(const ds_model *m, const ds_mat *w);

#endif
