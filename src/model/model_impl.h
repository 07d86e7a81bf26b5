/* model_impl.h — the inside of ds_model, shared by the CPU forward (model.c) and the CUDA one
 * (backend/cuda/forward.c): bound weights, the stage and tensor-parallel share, and state sizes. Nothing
 * outside src/model includes this. */
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
    /* scratch, grown on demand */
    float *scratch;
    size_t scratch_cap;
    struct ds_cuda_model *cu; /* the weights on the GPU and its step buffers, or NULL (CPU) */
    int dev;                  /* DS_DEVICE_CPU or DS_DEVICE_CUDA, decided at load */
    int random;               /* --load-format random: weights drawn, not read */
    /* host draws (ds_model_draw_host), made at the first step that asks for one */
    float *draw_rows;            /* [DS_DRAW_CHUNK][V] the rows, whole */
    ds_sample_scratch **draw_sc; /* [n_draw_sc] one a thread */
    int n_draw_sc;
};

enum { DS_DRAW_CHUNK = 32 }; /* rows drawn on the host side by side */

/* Makes the host draws' memory (once). */
int ds_model_draw_space(ds_model *m, ds_err *err);
/* Draws n rows on the host (ds_seq_batch.draws): row j's logits are in blocks of vp values (the
 * last cut at V), block t at x + t * stride + j * vp (one block of V: vp = V). d[j] NULL: not
 * drawn; otherwise *out[j] receives the token. Rows side by side on the OpenMP threads: each draw
 * depends only on its row and its own uniform. */
void ds_model_draw_host(ds_model *m, const float *x, size_t stride, int vp, int n,
                        const ds_row_draw *const *d, int32_t *const *out);

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

/* A random matrix that only the device holds (--load-format random on a GPU; model.c): the
 * ds_mat's data points to this instead of elements. Element (i, j) of the rank's [rows][cols]
 * slice is element (row0 + i, col0 + j) of the full [.][full_cols] tensor, drawn from key and its
 * index there, times scale — the values the CPU draws, whichever rank holds which slice. */
typedef struct ds_rand_mat {
    uint64_t magic; /* DS_RAND_MAGIC */
    const struct ds_model *owner;
    uint64_t key;
    int64_t row0, col0, full_cols;
    float scale;
} ds_rand_mat;
#define DS_RAND_MAGIC 0x72616e646d617431ull
/* w's descriptor when it is such a matrix of m, else NULL. */
const ds_rand_mat *ds_model_rand_mat(const ds_model *m, const ds_mat *w);

/* The CUDA backend (backend/cuda/forward.c; in builds without it these report that). attach uploads the
 * bound weights and installs device memory (base/devmem.h); forward runs one step of n_seq
 * segments (validated by the caller, off [n_seq] their first rows, T tokens in all). */
int ds_cuda_model_attach(ds_model *m, int device_index, ds_err *err);
void ds_cuda_model_detach(ds_model *m);
int ds_cuda_forward_stage(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
                          const int *off, int T, const ds_stage_io *in, ds_stage_io *out,
                          ds_err *err);
size_t ds_cuda_model_mem_free(const ds_model *m);
const char *ds_cuda_model_device_name(const ds_model *m);
int ds_cuda_model_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err);
void ds_cuda_model_profile_report(const ds_model *m, FILE *f, const char *title);
double ds_cuda_model_profile_gemm_tflops(const ds_model *m, double *ms_per_step);
int ds_cuda_available(void); /* built with the backend and a device present */
/* Row `row`'s draw d as the GPU's draw kernel reads it (ds_cu_draw_rows): *out, and its edits
 * (penalised (id, count) pairs, then masked ids) written at edits[at..]; returns how many. */
struct ds_cu_draw;
size_t ds_cuda_pack_draw(const ds_row_draw *d, int V, int row, size_t at, int32_t *edits,
                         struct ds_cu_draw *out);

#endif
