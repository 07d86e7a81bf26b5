/* backend/cuda/forward.c — the forward pass on the CUDA backend (issue 9).
 *
 * The seam is the one calm uses: ds_model_forward_stage hands a step to this file when the model
 * was attached to a GPU, and everything above it — scheduler, prefix cache, offload, speculation,
 * pipeline stages, server — is shared with the CPU. The data flow is model.c's run_step, op for
 * op, with each op a kernel of kernels/cuda on device buffers:
 *   embed -> for each layer: [AttnRes mix] -> RMSNorm -> KDA | MLA -> [AttnRes mix] -> RMSNorm ->
 *   dense MLP | MoE -> ... -> [output AttnRes mix] -> final RMSNorm -> lm_head.
 *
 * Memory: the weights are uploaded once at attach (BF16 matrices, f32 vectors); the latent pool,
 * the KDA slots and the verify rows are device memory the engine allocated through base/devmem.h.
 * Per step the host builds every index the step needs (token ids, segment offsets, pool rows,
 * block tables, state pointers, AttnRes candidate lists) in two arenas and uploads each once;
 * tokens come from the host and logits, hidden states and taps go back to it.
 *
 * Under tensor parallelism a GPU would need NCCL (not built yet), so attach refuses tp_size > 1;
 * pipeline stages work, their tensors crossing through the host as on the CPU. */
#include "model/model_impl.h"
#include "model/draft_impl.h"

#include "base/devmem.h"
#include "kernels/cuda/cuda_kernels.h"
#ifdef DS_HAVE_NCCL
#include "transport/comm_nccl.h"
#endif

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the process's device -------------------------------------------------------------------
 * One GPU per process (a job runs one rank per GPU); every model attached in the process shares
 * its stream, so a state copy made by the engine is ordered with the steps around it. */
static ds_cu *g_cu;
static int g_cu_refs, g_cu_index = -1;
static char g_copy_err[sizeof(ds_err)]; /* the first failed state copy, reported by the next step */

static void *dm_alloc(size_t bytes, ds_err *err) {
    return ds_cu_bind(g_cu, err) ? NULL : ds_cu_alloc(g_cu, bytes, err);
}
static void dm_release(void *p) {
    ds_err e;
    ds_cu_bind(g_cu, &e); /* (a failure here also fails the free, which has nothing to report) */
    ds_cu_dealloc(p);
}
static void dm_copy(void *dst, const void *src, size_t bytes) {
    ds_err e;
    if ((ds_cu_bind(g_cu, &e) || ds_cu_copy_any(g_cu, dst, src, bytes, &e)) && !g_copy_err[0])
        snprintf(g_copy_err, sizeof g_copy_err, "%s", e.msg);
}
static void dm_zero(void *p, size_t bytes) {
    ds_err e;
    if ((ds_cu_bind(g_cu, &e) || ds_cu_fill_bytes(g_cu, p, 0, bytes, &e)) && !g_copy_err[0])
        snprintf(g_copy_err, sizeof g_copy_err, "%s", e.msg);
}
static const ds_dmem_ops g_dmem = {dm_alloc, dm_release,       dm_copy,
                                   dm_zero,  ds_cu_host_alloc, ds_cu_host_free};

int ds_cuda_available(void) {
    if (g_cu) return 1;
    ds_cu *c = NULL;
    ds_err e;
    if (ds_cu_create(0, &c, &e)) return 0;
    ds_cu_free(c);
    return 1;
}

/* ---- weights on the device ------------------------------------------------------------------ */

typedef struct cu_kda {
    /* [3P + nf + Hk][D]: every projection of the layer's input stacked — q, k, v, f_a (and g_a,
     * with the low-rank gate: nf = 2 dk, else dk) and b — so that a decode step streams them in
     * one launch instead of three (bits unchanged: each output row is its own dot product) */
    ds_cu_mat in;
    int nf;
    ds_cu_mat f_b, g, g_b, o;
    float *conv;                     /* [3][P][W]: q, k and v short-conv weights */
    float *dt_bias, *A_log, *o_norm; /* [P], [Hk], [dk] */
} cu_kda;

typedef struct cu_mla {
    ds_cu_mat q, q_a, q_b, kv_a, kv_b, o, g;
    ds_cu_mat ukT; /* [Ha][R][dn]: W_UK_h^T per head, q̄_h = ukT_h qN_h as a matmul */
    float *q_a_norm, *kv_a_norm; /* [Rq], [R] */
} cu_mla;

typedef struct cu_ffn {
    ds_cu_mat gu, down;       /* dense MLP: [2I][D] gate and up stacked, [D][I] */
    ds_cu_mat sh_gu, sh_down; /* shared experts likewise */
    ds_cu_mat router, lat_down, lat_up;
    float *router_bias, *lat_norm; /* [E] or NULL, [Hin] or NULL */
    uint16_t *gate_up; /* [E][2 Ie][Hin] BF16: an expert's gate rows, then its up rows */
    uint16_t *e_down;  /* [E][Hin][Ie] BF16 */
} cu_ffn;

typedef struct cu_layer {
    float *in_norm, *post_norm, *attn_res_np, *mlp_res_np; /* [D] */
    cu_kda kda;
    cu_mla mla;
    cu_ffn ffn;
} cu_layer;

enum { KDA_FUSE_MAX = 2 }; /* see kda_fused */

typedef struct ds_cuda_model {
    ds_cu *c;
    cu_layer *layers; /* [L]; [l0, l1) uploaded */
    ds_cu_mat embed, lm_head;
    float *final_norm, *out_res_np;
    void **allocs; /* every device allocation of the weights */
    int n_allocs, cap_allocs;
    size_t weight_bytes;
    const ds_model *m; /* the model these are the weights of */
    uint16_t *conv;    /* host staging for dtype conversion, conv_cap elements */
    size_t conv_cap;
    /* per-step buffers, grown on demand */
    float *sc; /* device scratch, sc_cap floats */
    size_t sc_cap;
    int32_t *iarena; /* device int32 indices, icap */
    size_t icap;
    void **parena; /* device pointer tables, pcap */
    size_t pcap;
    float *stage; /* device copies of state a caller kept in host memory, stage_cap floats */
    size_t stage_cap;
    uint64_t own_epoch; /* bumped when sc, the arenas or stage move (graphs point into them) */
    uint64_t graph_epoch;
    struct cu_graph_entry {
        struct graph_key {
            int n_seq, T, n_lg, any_rows, ctx_cap, nb_in;
        } key;
        ds_cu_graph *g; /* NULL: capture failed, run this shape eagerly */
    } graphs[64];
    int n_graphs;
    uint64_t graph_replays, graph_failures;
    int kda_fuse_max; /* decode steps of up to this many sequences take KDA's fused kernel */
    float *tp_host;   /* tensor parallelism: collectives staged through the host, tp_cap floats */
    size_t tp_cap;
    /* a step's draws (draw_rows): per logits row its draw and token ([n_lg] each, NULL: not
     * drawn), and for the device the draws' numbers, edits and tokens; *_cap elements each */
    const ds_row_draw **draw_d;
    int32_t **draw_out;
    ds_cu_draw *draw_cu;
    int32_t *draw_ed, *draw_tok;
    size_t draw_d_cap, draw_out_cap, draw_cu_cap, draw_ed_cap, draw_tok_cap;
    int32_t *h_i; /* host staging of the two arenas */
    size_t h_icap;
    void **h_p;
    size_t h_pcap;
    int *h_kda; /* [2][n_seq] chunked KDA's segment starts and lengths, h_kda_cap ints */
    size_t h_kda_cap;
    void *nccl; /* ds_nccl *: the TP group's sums on the GPUs, or NULL (through the host) */
} ds_cuda_model;

/* Does this model's KDA shape fit ds_cu_kda_decode_fused (see kda_fused)? */
static int kda_fuse_fits(const ds_model *m, const ds_cuda_model *cm, const cu_kda *w) {
    const ds_config *c = &m->cfg;
    return !c->use_full_rank_gate &&
           ds_cu_kda_decode_fits(cm->c, c->kda_head_dim, c->short_conv_kernel_size, w->f_b.cols,
                                 w->g_b.cols);
}

static int keep(ds_cuda_model *cm, void *p, ds_err *err) {
    if (cm->n_allocs == cm->cap_allocs) {
        int cap = cm->cap_allocs ? 2 * cm->cap_allocs : 256;
        void **a = realloc(cm->allocs, (size_t)cap * sizeof *a);
        if (!a) {
            ds_cu_dealloc(p);
            return ds_errf(err, "cuda: out of host memory");
        }
        cm->allocs = a;
        cm->cap_allocs = cap;
    }
    cm->allocs[cm->n_allocs++] = p;
    return DS_OK;
}

static void *dev_alloc(ds_cuda_model *cm, size_t bytes, ds_err *err) {
    void *p = ds_cu_alloc(cm->c, bytes, err);
    if (!p || keep(cm, p, err)) return NULL;
    cm->weight_bytes += bytes;
    return p;
}

/* src (n elements of dtype dt) as BF16 in device memory at dst. BF16 goes up as it is; F32 and F16
 * are rounded to BF16 (the CUDA matmuls read BF16 weights). */
static int upload_bf16(ds_cuda_model *cm, uint16_t *dst, const void *src, ds_dtype dt, size_t n,
                       ds_err *err) {
    if (dt == DS_DT_BF16) return ds_cu_upload(cm->c, dst, src, n * 2, err);
    if (n > cm->conv_cap) {
        uint16_t *b = realloc(cm->conv, n * sizeof *b);
        if (!b) return ds_errf(err, "cuda: out of host memory converting %zu weights", n);
        cm->conv = b;
        cm->conv_cap = n;
    }
    for (size_t i = 0; i < n; i++) {
        float f =
            dt == DS_DT_F32 ? ((const float *)src)[i] : ds_f16_to_f32(((const uint16_t *)src)[i]);
        cm->conv[i] = ds_f32_to_bf16(f);
    }
    return ds_cu_upload(cm->c, dst, cm->conv, n * 2, err);
}

/* w's elements into device memory at d (BF16): uploaded, or drawn there for random weights. */
static int fill_mat(ds_cuda_model *cm, uint16_t *d, const ds_mat *w, ds_err *err) {
    size_t n = (size_t)w->rows * w->cols;
    const ds_rand_mat *r = ds_model_rand_mat(cm->m, w);
    if (r) /* --load-format random: drawn here, never on the host */
        return ds_cu_fill_random_bf16(cm->c, d, (size_t)w->rows, (size_t)w->cols, r->key,
                                      (size_t)r->row0, (size_t)r->col0, (size_t)r->full_cols,
                                      r->scale, err);
    return upload_bf16(cm, d, w->data, w->dtype, n, err);
}

static int up_mat(ds_cuda_model *cm, const ds_mat *w, ds_cu_mat *out, ds_err *err) {
    memset(out, 0, sizeof *out);
    if (!w->data || !w->rows || !w->cols) return DS_OK;
    uint16_t *d = dev_alloc(cm, (size_t)w->rows * w->cols * 2, err);
    if (!d || fill_mat(cm, d, w, err)) return DS_ERR;
    *out = (ds_cu_mat){d, w->rows, w->cols};
    return DS_OK;
}

/* Matrices of equal width stacked into one ([sum of rows][cols]): projections of the same input
 * become one weight-streaming launch (q, k and v; the two low-rank gate inputs; gate and up). */
static int up_stack(ds_cuda_model *cm, const ds_mat *const *ws, int n, ds_cu_mat *out,
                    ds_err *err) {
    int rows = 0, cols = ws[0]->cols;
    for (int i = 0; i < n; i++) {
        if (ws[i]->cols != cols || !ws[i]->data)
            return ds_errf(err, "cuda: stacking matrices of widths %d and %d", cols, ws[i]->cols);
        rows += ws[i]->rows;
    }
    uint16_t *d = dev_alloc(cm, (size_t)rows * cols * 2, err);
    if (!d) return DS_ERR;
    *out = (ds_cu_mat){d, rows, cols};
    for (int i = 0; i < n; i++) {
        if (fill_mat(cm, d, ws[i], err)) return DS_ERR;
        d += (size_t)ws[i]->rows * cols;
    }
    return DS_OK;
}

static int up_vec(ds_cuda_model *cm, const float *v, size_t n, float **out, ds_err *err) {
    *out = NULL;
    if (!v || !n) return DS_OK;
    float *d = dev_alloc(cm, n * sizeof(float), err);
    if (!d || ds_cu_upload(cm->c, d, v, n * sizeof(float), err)) return DS_ERR;
    *out = d;
    return DS_OK;
}

static int up_kda(ds_cuda_model *cm, const ds_model *m, const kda_w *w, cu_kda *d, ds_err *err) {
    const ds_config *c = &m->cfg;
    size_t P = (size_t)m->Hk * c->kda_head_dim, W = (size_t)c->short_conv_kernel_size;
    const int lowrank = !c->use_full_rank_gate;
    const ds_mat *in[6] = {&w->q, &w->k, &w->v, &w->f_a, lowrank ? &w->g_a : &w->b, &w->b};
    d->nf = w->f_a.rows * (lowrank ? 2 : 1);
    d->conv = dev_alloc(cm, 3 * P * W * sizeof(float), err);
    if (!d->conv || up_stack(cm, in, lowrank ? 6 : 5, &d->in, err) ||
        up_mat(cm, &w->f_b, &d->f_b, err) || up_mat(cm, &w->g, &d->g, err) ||
        up_mat(cm, &w->g_b, &d->g_b, err) || up_mat(cm, &w->o, &d->o, err) ||
        ds_cu_upload(cm->c, d->conv, w->q_conv, P * W * sizeof(float), err) ||
        ds_cu_upload(cm->c, d->conv + P * W, w->k_conv, P * W * sizeof(float), err) ||
        ds_cu_upload(cm->c, d->conv + 2 * P * W, w->v_conv, P * W * sizeof(float), err) ||
        up_vec(cm, w->dt_bias, P, &d->dt_bias, err) ||
        up_vec(cm, w->A_log, (size_t)m->Hk, &d->A_log, err) ||
        up_vec(cm, w->o_norm, (size_t)c->kda_head_dim, &d->o_norm, err))
        return DS_ERR;
    return DS_OK;
}

static int up_mla(ds_cuda_model *cm, const ds_model *m, const mla_w *w, cu_mla *d, ds_err *err) {
    const ds_config *c = &m->cfg;
    int Ha = m->Ha, R = c->kv_lora_rank, dn = c->qk_nope_head_dim, dvh = c->v_head_dim;
    if (up_mat(cm, &w->q, &d->q, err) || up_mat(cm, &w->q_a, &d->q_a, err) ||
        up_mat(cm, &w->q_b, &d->q_b, err) || up_mat(cm, &w->kv_a, &d->kv_a, err) ||
        up_mat(cm, &w->kv_b, &d->kv_b, err) || up_mat(cm, &w->o, &d->o, err) ||
        up_mat(cm, &w->g, &d->g, err) ||
        up_vec(cm, w->q_a_norm, (size_t)c->q_lora_rank, &d->q_a_norm, err) ||
        up_vec(cm, w->kv_a_norm, (size_t)R, &d->kv_a_norm, err))
        return DS_ERR;
    /* W_UK_h = kv_b rows [h (dn+dvh), h (dn+dvh) + dn), [dn][R]; its transpose [R][dn], made on
     * the device from the uploaded kv_b */
    uint16_t *t = dev_alloc(cm, (size_t)Ha * R * dn * 2, err); /* [Ha][R][dn] */
    if (!t) return DS_ERR;
    for (int h = 0; h < Ha; h++)
        if (ds_cu_transpose_bf16(cm->c, t + (size_t)h * R * dn,
                                 d->kv_b.data + (size_t)h * (dn + dvh) * R, dn, R, err))
            return DS_ERR;
    d->ukT = (ds_cu_mat){t, R, dn}; /* head h's at data + h R dn */
    return DS_OK;
}

static int up_ffn(ds_cuda_model *cm, const ds_model *m, const ffn_w *w, cu_ffn *d, ds_err *err) {
    const ds_config *c = &m->cfg;
    const ds_mat *gu[2] = {&w->gate, &w->up}, *sgu[2] = {&w->sh_gate, &w->sh_up};
    if (!w->is_moe) return up_stack(cm, gu, 2, &d->gu, err) || up_mat(cm, &w->down, &d->down, err);
    /* the router sees every expert; the weights are this rank's experts [e0, e1) only */
    int E = c->num_experts, El = m->e1 - m->e0, Ie = c->moe_intermediate_size;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : c->hidden_size;
    if (up_mat(cm, &w->router, &d->router, err) ||
        up_vec(cm, w->router_bias, (size_t)E, &d->router_bias, err) ||
        (c->num_shared_experts > 0 && up_stack(cm, sgu, 2, &d->sh_gu, err)) ||
        up_mat(cm, &w->sh_down, &d->sh_down, err) || up_mat(cm, &w->lat_down, &d->lat_down, err) ||
        up_mat(cm, &w->lat_up, &d->lat_up, err) ||
        up_vec(cm, w->lat_norm, (size_t)Hin, &d->lat_norm, err))
        return DS_ERR;
    size_t per = (size_t)Ie * Hin; /* elements of one expert matrix */
    d->gate_up = dev_alloc(cm, (size_t)El * 2 * per * 2, err);
    d->e_down = dev_alloc(cm, (size_t)El * per * 2, err);
    if (!d->gate_up || !d->e_down) return DS_ERR;
    for (int e = m->e0; e < m->e1; e++) {
        const ds_mat *w1 = &w->w1[e], *w3 = &w->w3[e], *w2 = &w->w2[e];
        size_t l = (size_t)(e - m->e0); /* its place among this rank's experts */
        if (fill_mat(cm, d->gate_up + l * 2 * per, w1, err) ||
            fill_mat(cm, d->gate_up + (l * 2 + 1) * per, w3, err) ||
            fill_mat(cm, d->e_down + l * per, w2, err))
            return DS_ERR;
    }
    return DS_OK;
}

static void drop_graphs(struct ds_cuda_model *cm);

void ds_cuda_model_detach(ds_model *m) {
    ds_cuda_model *cm = m->cu;
    if (!cm) return;
    for (int i = 0; i < cm->n_allocs; i++) ds_cu_dealloc(cm->allocs[i]);
    drop_graphs(cm);
    ds_cu_dealloc(cm->sc);
    ds_cu_dealloc(cm->stage);
    ds_cu_dealloc(cm->iarena);
    ds_cu_dealloc(cm->parena);
    free(cm->allocs);
    free(cm->layers);
    free(cm->conv);
    free(cm->h_i);
    free(cm->h_p);
    free(cm->tp_host);
    free(cm->draw_d);
    free(cm->draw_out);
    free(cm->draw_cu);
    free(cm->draw_ed);
    free(cm->draw_tok);
    free(cm->h_kda);
#ifdef DS_HAVE_NCCL
    ds_nccl_free(cm->nccl);
#endif
    free(cm);
    m->cu = NULL;
    if (--g_cu_refs == 0) {
        ds_dmem_install(NULL);
        ds_cu_free(g_cu);
        g_cu = NULL;
        g_cu_index = -1;
    }
}

/* A DS_CUDA_* switch: unset or empty means dflt, a number above 0 on, anything else off. */
static int env_flag(const char *name, int dflt) {
    const char *v = getenv(name);
    return v && *v ? atoi(v) > 0 : dflt;
}

/* Tensor parallelism across GPUs: the TP group's sums through NCCL when every rank of the group
 * has a GPU of its own (DS_NCCL=0: never). Every rank of the group decides the same way from the
 * same all-gathered facts, so either all of them join or none does; when none does (ranks that
 * share a GPU, no NCCL in the build, a failed bootstrap) the sums keep going through the host
 * and MPI, with a line saying why. Collective over the TP group, like the load. */
static void setup_nccl(ds_model *m, ds_cuda_model *cm, int device) {
#ifdef DS_HAVE_NCCL
    const int T = m->tp_size;
    if (T <= 1 || !env_flag("DS_NCCL", 1) || !m->opts.allgather) return;
    /* me: [0] host id, [1] GPU, [2] got an id (tp rank 0), [3 ..] the id: floats carry the bits */
    enum { NW = 3 + DS_NCCL_ID_BYTES / 4 };
    float me[NW] = {0}, *all = malloc((size_t)T * NW * sizeof(float));
    if (!all) return;
    char host[256] = {0};
    gethostname(host, sizeof host - 1);
    uint32_t hh = 2166136261u; /* FNV-1a of the host name */
    for (const char *p = host; *p; p++) hh = (hh ^ (uint8_t)*p) * 16777619u;
    memcpy(&me[0], &hh, 4);
    me[1] = (float)device;
    ds_err err = {{0}};
    if (m->tp_rank == 0 && !ds_nccl_unique_id(&me[3], &err)) me[2] = 1.0f;
    if (m->opts.allgather(m->opts.allgather_ctx, me, NW, all)) {
        free(all);
        return; /* the comm layer names the failure */
    }
    const char *why = NULL; /* (tp rank 0, the one that prints, knows why it made no id) */
    if (all[2] != 1.0f) why = err.msg[0] ? err.msg : "no NCCL id from tp rank 0";
    for (int i = 0; i < T && !why; i++)
        for (int j = 0; j < i && !why; j++)
            if (!memcmp(&all[(size_t)i * NW], &all[(size_t)j * NW], 2 * sizeof(float)))
                why = "ranks of the TP group share a GPU";
    ds_nccl *nc = NULL;
    if (!why && ds_nccl_init(&nc, &all[3], T, m->tp_rank, device, &err)) why = err.msg;
    cm->nccl = nc;
    free(all);
    if (why && m->tp_rank == 0)
        fprintf(stderr, "[deltaserve] tensor-parallel sums through the host (%s)\n", why);
#else
    (void)device;
    if (m->tp_size > 1 && m->tp_rank == 0)
        fprintf(stderr,
                "[deltaserve] tensor-parallel sums through the host (built without NCCL)\n");
    (void)cm;
#endif
}

/* What the kernels support, checked at load so that a model they cannot run is refused with its
 * reason before any memory is taken, not at its first step. */
static int check_shapes(const ds_model *m, ds_err *err) {
    const ds_config *c = &m->cfg;
    int dk = c->kda_head_dim, W = c->short_conv_kernel_size;
    if (m->n_kda && dk != 16 && dk != 32 && dk != 64 && dk != 128)
        return ds_errf(err, "device cuda: KDA head dim %d (the kernels take 16, 32, 64 or 128)",
                       dk);
    if (m->n_kda && (W < 1 || W > 8))
        return ds_errf(err, "device cuda: short conv kernel size %d (1..8)", W);
    if (c->num_experts &&
        (c->num_experts_per_token > 64 || (c->use_grouped_topk && c->num_expert_group > 64)))
        return ds_errf(err, "device cuda: %d experts per token, %d groups (at most 64 each)",
                       c->num_experts_per_token, c->num_expert_group);
    if (c->attn_res_block_size > 0 && ds_model_max_banks(m) + 1 > 32)
        return ds_errf(err, "device cuda: %d AttnRes blocks (the mix takes at most 31)",
                       ds_model_max_banks(m));
    return DS_OK;
}

int ds_cuda_model_attach(ds_model *m, int device_index, ds_err *err) {
    const ds_config *c = &m->cfg;
    if (check_shapes(m, err)) return DS_ERR;
    int n_dev = ds_cu_device_count();
    if (n_dev < 1) return ds_errf(err, "device cuda: no GPU found");
    device_index %= n_dev; /* more ranks than GPUs share them */
    if (g_cu && g_cu_index != device_index)
        return ds_errf(err, "device cuda: this process already uses GPU %d, asked for %d",
                       g_cu_index, device_index);
    if (!g_cu) {
        if (ds_cu_create(device_index, &g_cu, err)) return ds_err_prefix(err, "device cuda");
        g_cu_index = device_index;
        ds_dmem_install(&g_dmem);
    }
    g_cu_refs++;
    ds_cuda_model *cm = calloc(1, sizeof *cm);
    if (cm) cm->m = m;
    if (!cm) {
        m->cu = NULL;
        if (--g_cu_refs == 0) {
            ds_dmem_install(NULL);
            ds_cu_free(g_cu);
            g_cu = NULL;
        }
        return ds_errf(err, "cuda: out of host memory");
    }
    m->cu = cm;
    cm->c = g_cu;
    ds_cu_set_batch_invariant(cm->c, m->opts.batch_invariant);
    /* the faster paths are on unless turned off (for comparisons); the profile is opt-in */
    ds_cu_set_expert_gemm(cm->c, env_flag("DS_CUDA_EXPERT_GEMM", 1));
    ds_cu_set_expert_mma(cm->c, env_flag("DS_CUDA_EXPERT_MMA", 1));
    ds_cu_set_expert_tc(cm->c, env_flag("DS_CUDA_EXPERT_TC", 1));
    { /* tuning knobs (0: the kernels' defaults) */
        const char *mn = getenv("DS_CUDA_EXPERT_MMA_MIN"), *gt = getenv("DS_CUDA_GEMV_MAX_T");
        ds_cu_set_expert_mma_min(cm->c, mn && *mn ? atoi(mn) : 0);
        ds_cu_set_gemv_max_t(cm->c, gt && *gt ? atoi(gt) : 0);
    }
    ds_cu_set_mla_gemm(cm->c, env_flag("DS_CUDA_MLA_GEMM", 1));
    ds_cu_set_mla_flash(cm->c, env_flag("DS_CUDA_MLA_FLASH", 1));
    ds_cu_set_early_experts(cm->c, env_flag("DS_CUDA_EARLY_EXPERTS", 1));
    ds_cu_set_wide_early(cm->c, env_flag("DS_CUDA_WIDE_EARLY", 1));
    ds_cu_set_gemv_wide(cm->c, env_flag("DS_CUDA_GEMV_WIDE", 1));
    ds_cu_set_conv_fixed(cm->c, env_flag("DS_CUDA_CONV_FIXED", 1));
    /* sequences up to which a decode step's KDA middle is one kernel (0: never) */
    const char *kf = getenv("DS_CUDA_KDA_FUSED");
    cm->kda_fuse_max = kf && *kf ? atoi(kf) : KDA_FUSE_MAX;
    { /* chunked KDA on tensor cores: 1 TF32, 3 3xTF32 (ds_cu_set_kda_tc) */
        /* 3xTF32 by default: f32's accuracy (checked at 1e-4) and faster than f32 on CUDA cores
         * (8192 tokens x 32 heads: 1.97 against 2.83 ms on the H200). TF32 (1.66 ms) is off by
         * 3.0e-4 alone, a quarter of FLA's chunk_kda on f32 inputs, but through the bundled
         * model (80 tokens, no batch invariance) it took the GPU's logits from 8.1e-3 to 1.2e-2
         * off the CPU's and TP 2's from 6.1e-3 to 2.5e-2 off one GPU's (bench/RESULTS.md). */
        const char *tc = getenv("DS_CUDA_KDA_TC");
        int mode = 3;
        if (tc && *tc) {
            if (!strcmp(tc, "0") || !strcmp(tc, "1") || !strcmp(tc, "3"))
                mode = atoi(tc);
            else
                fprintf(
                    stderr,
                    "[deltaserve] DS_CUDA_KDA_TC=%s: 0 (f32), 1 (TF32) or 3 (3xTF32); using 3\n",
                    tc);
        }
        ds_cu_set_kda_tc(cm->c, mode);
    }
    /* a side stream for independent chains within a step (ds_cu_side_begin) */
    ds_err side_err;
    if (ds_cu_set_side(cm->c, env_flag("DS_CUDA_SIDE", 1), &side_err)) /* not fatal */
        fprintf(stderr, "[deltaserve] %s: one stream per step\n", side_err.msg);
    ds_cu_set_mla_all_heads(cm->c, env_flag("DS_CUDA_MLA_ALL_HEADS", 1));
    ds_cu_prof_enable(cm->c, env_flag("DS_CUDA_PROFILE", 0));
    const char *skip = getenv("DS_CUDA_SKIP");
    if (skip && *skip) {
        fprintf(stderr,
                "[deltaserve] DS_CUDA_SKIP=%s: those kernels are left out (results are "
                "wrong; for timing only)\n",
                skip);
        if (ds_cu_set_skip(cm->c, skip, err)) goto fail;
    }
    int L = c->num_hidden_layers, D = c->hidden_size;
    cm->layers = calloc((size_t)L, sizeof *cm->layers);
    if (!cm->layers) {
        ds_errf(err, "cuda: out of host memory");
        goto fail;
    }
    if (up_mat(cm, &m->embed, &cm->embed, err) || up_mat(cm, &m->lm_head, &cm->lm_head, err) ||
        up_vec(cm, m->final_norm, (size_t)D, &cm->final_norm, err) ||
        up_vec(cm, m->out_res_np, (size_t)D, &cm->out_res_np, err))
        goto fail;
    for (int i = m->l0; i < m->l1; i++) {
        const layer_w *lw = &m->layers[i];
        cu_layer *d = &cm->layers[i];
        if (up_vec(cm, lw->in_norm, (size_t)D, &d->in_norm, err) ||
            up_vec(cm, lw->post_norm, (size_t)D, &d->post_norm, err) ||
            up_vec(cm, lw->attn_res_np, (size_t)D, &d->attn_res_np, err) ||
            up_vec(cm, lw->mlp_res_np, (size_t)D, &d->mlp_res_np, err) ||
            (lw->kind == DS_LAYER_KDA ? up_kda(cm, m, &lw->kda, &d->kda, err)
                                      : up_mla(cm, m, &lw->mla, &d->mla, err)) ||
            up_ffn(cm, m, &lw->ffn, &d->ffn, err))
            goto fail;
    }
    free(cm->conv);
    cm->conv = NULL;
    cm->conv_cap = 0;
    for (int i = m->l0; kf && *kf && i < m->l1; i++) /* asked for: say whether it applies */
        if (m->layers[i].kind == DS_LAYER_KDA) {
            fprintf(stderr, "[deltaserve] DS_CUDA_KDA_FUSED=%s: %s\n", kf,
                    !kda_fuse_fits(m, cm, &cm->layers[i].kda)
                        ? "this model's KDA shape does not fit the fused decode kernel"
                    : cm->kda_fuse_max > 0
                        ? "decode steps of that many sequences or fewer take the fused KDA kernel"
                        : "the fused KDA decode kernel is off");
            break;
        }
    setup_nccl(m, cm, device_index);
    return ds_cu_sync(cm->c, err);
fail:
    ds_err_prefix(err, "device cuda: uploading the weights");
    ds_cuda_model_detach(m);
    return DS_ERR;
}

size_t ds_cuda_model_mem_free(const ds_model *m) {
    return ds_cu_mem_free(m->cu->c);
}

void ds_cuda_model_profile_report(const ds_model *m, FILE *f, const char *title) {
    ds_cu_prof_report(m->cu->c, f, title);
}

double ds_cuda_model_profile_gemm_tflops(const ds_model *m, double *ms_per_step) {
    return ds_cu_prof_gemm_tflops(m->cu->c, ms_per_step);
}

int ds_cuda_model_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    return ds_cu_measure_limits(m->cu->c, copy_gbs, gemm_tflops, err);
}

const char *ds_cuda_model_device_name(const ds_model *m) {
    return ds_cu_device_name(m->cu->c);
}

/* ---- one step ---------------------------------------------------------------------------------
 */

typedef struct cstep {
    ds_model *m;
    ds_cuda_model *cm;
    ds_cu *c;
    ds_kv_pool *pool;
    ds_seq_batch *seqs;
    int n_seq, T;
    const int *off; /* [n_seq] first row of each segment */
    size_t used;    /* scratch floats taken */
    int overflow;   /* a take did not fit: the estimate is short (a bug); nothing was launched */
    /* device views into the index arenas */
    const int32_t *ids;      /* [T] */
    const int32_t *seg_off;  /* [n_seq + 1] */
    const int32_t *lat_dst;  /* [T] pool row of each token's latent */
    const int32_t *bt;       /* block tables, sequence q's at bt + bt_off[q] */
    const int32_t *ctx_rows; /* pool rows of an expanded segment's context, q's at ctx_off[q] */
    const int32_t *lg_rows;  /* [n_lg] rows of x that want logits */
    const int32_t *tok_bt;   /* [T] where each token's block table starts in bt */
    const int32_t *tok_pos;  /* [T] each token's position in its sequence */
    int *bt_off, *ctx_off;   /* [n_seq] host */
    int n_lg;
    int any_rows;              /* some segment keeps verify state rows */
    float *const *S;           /* [n_kda][n_seq] recurrent state of each KDA layer, per sequence */
    float *const *S_rows;      /* [n_kda][n_seq] its verify rows, or NULL entries */
    float *const *tails;       /* [n_kda][n_seq] short-conv tails (q's; k's and v's follow) */
    float *const *tail_rows;   /* [n_kda][n_seq] their verify rows, or NULL entries */
    const float *const *cands; /* [nb_max + 1][nb_max + 1] AttnRes candidate lists */
    int nb_max;
    int ctx_cap; /* absorbed attention's context bound: a power of two >= every context */
    float *P, *x, *a, *bank, *xr, *lg; /* the step's long-lived buffers (run_step) */
    uint64_t *am; /* [n_lg][am_parts] keys of the greedy token of each row of lg (in parts) */
    int am_parts;
} cstep;

/* Opens a profiled interval (DS_CUDA_PROFILE=1; see ds_cu_prof_mark). */
#define PROF(s, label) ds_cu_prof_mark((s)->c, label)

static float *take(cstep *s, size_t n) {
    n = (n + 15) & ~(size_t)15; /* 64-byte alignment for the vector loads */
    if (s->overflow || s->used + n > s->cm->sc_cap) {
        s->overflow = 1;
        return s->cm->sc; /* unused: every caller checks TAKEN before launching */
    }
    float *p = s->cm->sc + s->used;
    s->used += n;
    return p;
}

/* After a group of takes: a short scratch estimate is reported, never written past. */
#define TAKEN()                                                                                    \
    do {                                                                                           \
        if (s->overflow)                                                                           \
            return ds_errf(err,                                                                    \
                           "forward: internal error: the cuda scratch estimate (%zu floats) "      \
                           "is short",                                                             \
                           s->cm->sc_cap);                                                         \
    } while (0)

/* Scratch floats one step takes at most (mirrors the take calls below, 16 floats of slack each). */
static size_t cuda_step_need(const ds_model *m, const ds_seq_batch *seqs, int n_seq, int T) {
    const ds_config *c = &m->cfg;
    size_t t = (size_t)T, D = (size_t)c->hidden_size, L = (size_t)c->num_hidden_layers;
    size_t N = (size_t)c->attn_res_block_size, pad = 16;
    size_t base = 3 * t * D + (N ? ((L + N - 1) / N + 1) * (t * D + pad) : 0) + 6 * pad;
    size_t H = (size_t)m->Hk, dk = (size_t)c->kda_head_dim, P = H * dk;
    size_t kda = m->n_kda ? 9 * t * P + 2 * t * dk + 2 * t * H + 11 * pad : 0; /* kda_forward */
    size_t mla = 0;
    if (m->n_mla) {
        size_t Ha = (size_t)m->Ha, R = (size_t)c->kv_lora_rank;
        size_t dn = (size_t)c->qk_nope_head_dim, dr = (size_t)c->qk_rope_head_dim;
        size_t dvh = (size_t)c->v_head_dim, seg = 0, short_rows = 0;
        for (int q = 0; q < n_seq; q++) {
            size_t ctx = (size_t)seqs[q].pos0 + (size_t)seqs[q].n;
            if (seqs[q].n >= m->opts.mla_expanded_min)
                seg = DS_MAX(seg, ctx * (R + dr + 2 * Ha * (dn + dvh)) + 5 * pad);
            else
                short_rows += (size_t)seqs[q].n; /* absorbed runs hold at most these rows */
        }
        seg = DS_MAX(seg, short_rows * Ha * (dr + 2 * R) + 3 * pad);
        mla = t * Ha * (dn + dr) + t * (R + dr) + 2 * t * Ha * dvh + t * (size_t)c->q_lora_rank +
              5 * pad + seg;
    }
    size_t ffn = 2 * t * (size_t)c->intermediate_size + 2 * pad;
    if (c->num_experts) {
        size_t E = (size_t)c->num_experts, K = (size_t)c->num_experts_per_token;
        size_t Hin = c->routed_expert_hidden_size ? (size_t)c->routed_expert_hidden_size : D;
        size_t Is = (size_t)c->moe_intermediate_size * (size_t)c->num_shared_experts;
        ffn = DS_MAX(ffn, t * E + 2 * t * K + 2 * t * Hin + t * D + 2 * t * Is + 8 * pad);
        /* (mlp: one [T][2I] buffer, as the dense estimate above) */
    }
    size_t lg = 0;
    if (m->l1 == (int)L) {
        size_t nl = 0;
        for (int q = 0; q < n_seq; q++) nl += (size_t)ds_seq_logit_rows(&seqs[q]);
        /* xr, lg and the greedy tokens' keys (ds_cu_argmax_parts: rows x parts <= rows + 264) */
        lg = nl * (D + (size_t)m->vp) + 2 * (nl + 264) + 3 * pad;
    }
    return base + lg + DS_MAX(DS_MAX(kda, mla), ffn);
}

/* Grows a device buffer (contents not kept), with room for the next, slightly larger need. */
static int grow_dev(ds_cu *c, void **p, size_t *cap, size_t need, size_t elem, ds_err *err) {
    if (need <= *cap) return DS_OK;
    need += need / 4;
    ds_cu_dealloc(*p);
    *p = ds_cu_alloc(c, need * elem, err);
    *cap = *p ? need : 0;
    return *p ? DS_OK : DS_ERR;
}

/* Moves of the step's buffers (graphs captured before point into the old ones). */
static uint64_t g_moves;

/* grow_dev for a buffer the step's graphs read or write: a move drops them. */
static int grow(ds_cu *c, void **p, size_t *cap, size_t need, size_t elem, ds_err *err) {
    if (need <= *cap) return DS_OK;
    g_moves++;
    return grow_dev(c, p, cap, need, elem, err);
}

static int grow_host(void **p, size_t *cap, size_t need, size_t elem, ds_err *err) {
    if (need <= *cap) return DS_OK;
    void *b = realloc(*p, need * elem);
    if (!b)
        return ds_errf(err, "cuda: out of host memory (%zu bytes of step indices)", need * elem);
    *p = b;
    *cap = need;
    return DS_OK;
}

/* Builds every index of the step on the host and uploads them in two copies. */
static int build_indices(cstep *s, ds_err *err) {
    ds_model *m = s->m;
    ds_cuda_model *cm = s->cm;
    const ds_config *c = &m->cfg;
    int n_seq = s->n_seq, T = s->T, D = c->hidden_size;
    int bs = s->pool ? s->pool->block_size : 1;
    /* int arena: ids [T] | seg_off [n_seq+1] | lat_dst [T] | block tables | ctx rows | lg rows */
    size_t ni = (size_t)4 * T + n_seq + 1, nbt = 0, nctx = 0, nlg = 0;
    for (int q = 0; q < n_seq; q++) {
        const ds_seq_batch *sb = &s->seqs[q];
        int ctx = sb->pos0 + sb->n;
        if (m->n_mla) {
            nbt += (size_t)(ctx + bs - 1) / bs;
            if (sb->n >= m->opts.mla_expanded_min) nctx += (size_t)ctx;
        }
        nlg += (size_t)ds_seq_logit_rows(sb);
    }
    ni += nbt + nctx + nlg;
    int nb_max = ds_model_max_banks(m);
    size_t np = (size_t)4 * m->n_kda * n_seq + (size_t)(nb_max + 1) * (nb_max + 1);
    if (grow_host((void **)&cm->h_i, &cm->h_icap, ni + 1, sizeof(int32_t), err) ||
        grow_host((void **)&cm->h_p, &cm->h_pcap, np + 1, sizeof(void *), err) ||
        grow(s->c, (void **)&cm->iarena, &cm->icap, ni + 1, sizeof(int32_t), err) ||
        grow(s->c, (void **)&cm->parena, &cm->pcap, np + 1, sizeof(void *), err))
        return DS_ERR;
    /* int arena: the regions whose size depends only on the step's shape first, so that a captured
     * graph finds them where it saw them: ids [T] | seg_off [n_seq+1] | lat_dst [T] | tok_bt [T] |
     * tok_pos [T] | lg_rows [n_lg] | block tables | expanded segments' context rows */
    int32_t *hi = cm->h_i;
    size_t seg_at = (size_t)T, lat_at = seg_at + (size_t)n_seq + 1, tokbt_at = lat_at + (size_t)T;
    size_t tokpos_at = tokbt_at + (size_t)T, lg_at = tokpos_at + (size_t)T;
    size_t bt_at = lg_at + nlg, ctx_at = bt_at + nbt, at = ctx_at + nctx;
    for (int q = 0; q < n_seq; q++)
        memcpy(hi + s->off[q], s->seqs[q].tokens, (size_t)s->seqs[q].n * sizeof(int32_t));
    for (int q = 0; q <= n_seq; q++) hi[seg_at + q] = q < n_seq ? s->off[q] : T;
    size_t bt = bt_at, cx = ctx_at;
    s->n_lg = 0;
    for (int q = 0; q < n_seq; q++) {
        const ds_seq_batch *sb = &s->seqs[q];
        s->bt_off[q] = (int)(bt - bt_at);
        s->ctx_off[q] = (int)(cx - ctx_at);
        for (int t = 0; t < sb->n; t++) {
            int p = sb->pos0 + t, r = s->off[q] + t;
            hi[lat_at + r] = m->n_mla ? sb->block_table[p / bs] * bs + p % bs : 0;
            hi[tokbt_at + r] = s->bt_off[q];
            hi[tokpos_at + r] = p;
        }
        for (int i = 0, nl = ds_seq_logit_rows(sb); i < nl; i++)
            hi[lg_at + s->n_lg++] = s->off[q] + sb->n - nl + i;
        if (!m->n_mla) continue;
        int np_q = (sb->pos0 + sb->n + bs - 1) / bs;
        memcpy(hi + bt, sb->block_table, (size_t)np_q * sizeof(int32_t));
        bt += (size_t)np_q;
        if (sb->n >= m->opts.mla_expanded_min)
            for (int p = 0; p < sb->pos0 + sb->n; p++)
                hi[cx++] = sb->block_table[p / bs] * bs + p % bs;
    }
    /* pointer arena: S [n_kda][n_seq] | S_rows [n_kda][n_seq] | tails [n_kda][n_seq] |
     * tail rows [n_kda][n_seq] | cands */
    void **hp = cm->h_p;
    size_t conv_n = ds_model_conv_floats(m), rec_n = ds_model_rec_floats(m);
    s->any_rows = 0;
    for (int j = 0; j < m->n_kda; j++)
        for (int q = 0; q < n_seq; q++) {
            const ds_seq_batch *sb = &s->seqs[q];
            size_t off = (size_t)m->n_kda * conv_n + (size_t)j * rec_n;
            hp[(size_t)j * n_seq + q] = sb->slot + off;
            hp[(size_t)(m->n_kda + j) * n_seq + q] = sb->state_rows ? sb->state_rows + off : NULL;
            s->any_rows |= sb->state_rows != NULL;
            /* the layer's q tail; k's and v's follow it (slot layout, model_impl.h) */
            size_t toff = (size_t)j * conv_n;
            hp[(size_t)(2 * m->n_kda + j) * n_seq + q] = sb->slot + toff;
            hp[(size_t)(3 * m->n_kda + j) * n_seq + q] =
                sb->state_rows ? sb->state_rows + toff : NULL;
        }
    size_t cand_at = (size_t)4 * m->n_kda * n_seq;
    s->nb_max = nb_max;
    int max_ctx = 1;
    for (int q = 0; q < n_seq; q++) max_ctx = DS_MAX(max_ctx, s->seqs[q].pos0 + s->seqs[q].n);
    for (s->ctx_cap = 256; s->ctx_cap < max_ctx; s->ctx_cap *= 2) {
    }
    /* scratch layout: P, x, a, then the banks (see run_layers) */
    size_t TD = (size_t)T * D, TDp = (TD + 15) & ~(size_t)15;
    float *P = cm->sc, *bank = cm->sc + 3 * TDp;
    for (int nb = 0; nb <= nb_max; nb++) {
        void **row = hp + cand_at + (size_t)nb * (nb_max + 1);
        for (int j = 0; j < nb; j++) row[j] = bank + (size_t)j * TDp;
        row[nb] = P;
    }
    if (ds_cu_upload(s->c, cm->iarena, hi, at * sizeof(int32_t), err) ||
        ds_cu_upload(s->c, cm->parena, hp, np * sizeof(void *), err))
        return DS_ERR;
    s->ids = cm->iarena;
    s->seg_off = cm->iarena + seg_at;
    s->lat_dst = cm->iarena + lat_at;
    s->bt = cm->iarena + bt_at;
    s->ctx_rows = cm->iarena + ctx_at;
    s->lg_rows = cm->iarena + lg_at;
    s->tok_bt = cm->iarena + tokbt_at;
    s->tok_pos = cm->iarena + tokpos_at;
    s->tails = (float *const *)cm->parena + (size_t)2 * m->n_kda * n_seq;
    s->tail_rows = (float *const *)cm->parena + (size_t)3 * m->n_kda * n_seq;
    s->S = (float *const *)cm->parena;
    s->S_rows = (float *const *)cm->parena + (size_t)m->n_kda * n_seq;
    s->cands = (const float *const *)(cm->parena + cand_at);
    return DS_OK;
}

#define TRY(x)                                                                                     \
    do {                                                                                           \
        if (x) return DS_ERR;                                                                      \
    } while (0)

/* out[T][D] = KDA(xn) (model.c kda_forward). */
/* Host staging for tensor-parallel collectives (until NCCL): at least n floats. */
static float *tp_stage(cstep *s, size_t n, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    if (grow_host((void **)&cm->tp_host, &cm->tp_cap, n, sizeof(float), err)) return NULL;
    return cm->tp_host;
}

/* dbuf[n] (device) <- its sum over the TP group, as the CPU's tp_sum: through the host and the
 * comm's all-reduce (NCCL would keep it on the GPUs; not built yet). Nothing on one rank. */
static int tp_sum(cstep *s, float *dbuf, size_t n, ds_err *err) {
    const ds_model *m = s->m;
    if (m->tp_size == 1) return DS_OK;
#ifdef DS_HAVE_NCCL
    if (s->cm->nccl) /* on the stream: no host round trip, and capturable */
        return ds_nccl_allreduce_sum(s->cm->nccl, dbuf, n, ds_cu_stream(s->c), err);
#endif
    float *h = tp_stage(s, n, err);
    if (!h || ds_cu_download(s->c, h, dbuf, n * sizeof(float), err)) return DS_ERR;
    if (m->opts.allreduce(m->opts.allreduce_ctx, h, n))
        return ds_errf(err, "forward: a tensor-parallel all-reduce failed");
    return ds_cu_upload(s->c, dbuf, h, n * sizeof(float), err);
}

/* Does segment z run in chunks? The CPU's rule (long enough, no verify rows), where the GPU's
 * chunked kernel has the head size. */
static int kda_chunk_eligible(const cstep *s, int z) {
    const ds_model *m = s->m;
    return m->n_kda && s->seqs[z].n >= m->opts.kda_chunked_min && !s->seqs[z].state_rows &&
           ds_cu_kda_chunked_supports(m->cfg.kda_head_dim, m->cfg.kda_head_dim);
}
static int kda_chunked_segments(const cstep *s) {
    int n = 0;
    for (int z = 0; z < s->n_seq; z++) n += kda_chunk_eligible(s, z);
    return n;
}

/* A decode step's KDA middle as one kernel (ds_cu_kda_decode_fused: the same bits as the seven
 * launches it replaces) when every sequence brings one token and keeps no rollback rows, up to
 * kda_fuse_max sequences (KDA_FUSE_MAX, DS_CUDA_KDA_FUSED; 0: never). Each cluster stages its
 * head's f_b and g_b rows, which the batched matmuls read once for all sequences: on the H200 at
 * the 48B shape (bench/RESULTS.md, session 14) a step took 2.529-2.553 ms against 2.588-2.616
 * at batch 1, 3.989-4.029 against 4.013-4.045 at 2, but 5.81 against 5.69-5.72 at 4 and 8.68
 * against 8.47-8.48 at 8. */
static int kda_fused(const cstep *s, const cu_kda *w) {
    if (s->any_rows || s->n_seq > s->cm->kda_fuse_max || s->T != s->n_seq ||
        !kda_fuse_fits(s->m, s->cm, w))
        return 0;
    for (int z = 0; z < s->n_seq; z++)
        if (s->seqs[z].n != 1 || kda_chunk_eligible(s, z)) return 0;
    return 1;
}

static int kda_forward(cstep *s, const layer_w *lw, const cu_kda *w, const float *xn, float *out,
                       ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    int T = s->T, D = c->hidden_size, H = s->m->Hk, dk = c->kda_head_dim, P = H * dk;
    int W = c->short_conv_kernel_size, nf = w->nf, ld = 3 * P + nf + H;
    size_t mark = s->used;
    float *pre = take(s, (size_t)T * ld); /* [T][3P | nf | H]: q, k, v before the conv, f_a x
                                              (then g_a x), b x */
    float *q = take(s, (size_t)T * P);    /* [T][H][dk] */
    float *k = take(s, (size_t)T * P);    /* [T][H][dk] */
    float *v = take(s, (size_t)T * P);    /* [T][H][dv] */
    float *g = take(s, (size_t)T * P);    /* [T][H][dk] log decay */
    float *gt = take(s, (size_t)T * P);   /* [T][H][dv] the output gate */
    float *beta = take(s, (size_t)T * H); /* [T][H] */
    float *o = take(s, (size_t)T * P);    /* [T][H][dv] f_b's output, then the recurrence's */
    const float *fa = pre + 3 * P, *braw = fa + nf;
    TAKEN();
    size_t slot_n = ds_model_slot_floats(s->m), at = (size_t)lw->kind_idx * s->n_seq;
    /* q, k and v in one weight stream, then every segment's three convs in one launch, each on
     * its own tails (and, for a verify, the tails after each token) */
    PROF(s, "kda qkv");
    TRY(ds_cu_matmul(cu, pre, ld, xn, D, T, &w->in, err));
    int fused = kda_fused(s, w);
    if (fused) {
        PROF(s, "kda recurrence");
        const ds_cu_kda_decode kd = {.pre = pre,
                                     .ld = ld,
                                     .fa_off = 3 * P,
                                     .ga_off = 3 * P + dk, /* g_a x: fa's second half */
                                     .b_off = 3 * P + nf,
                                     .conv_w = w->conv,
                                     .tails = s->tails + at,
                                     .f_b = w->f_b.data,
                                     .g_b = w->g_b.data,
                                     .Kf = w->f_b.cols,
                                     .Kg = w->g_b.cols,
                                     .A_log = w->A_log,
                                     .dt_bias = w->dt_bias,
                                     .o_norm = w->o_norm,
                                     .lower_bound_form = c->has_gate_lower_bound,
                                     .lb = c->gate_lower_bound,
                                     .q_scale = 1.0f / sqrtf((float)dk),
                                     .eps = 1e-6f,
                                     .norm_eps = c->rms_norm_eps,
                                     .S = s->S + at,
                                     .y = q, /* o_proj's input, as the gated norm below writes */
                                     .n_seq = s->n_seq,
                                     .H = H,
                                     .dk = dk,
                                     .W = W};
        TRY(ds_cu_kda_decode_fused(cu, &kd, err));
    } else {
        /* the decay gate and beta (from f_a x and b x), then the output gate, on the side
         * stream, beside the convs of q, k and v; joined before the recurrence */
        PROF(s, "kda gates, beta");
        TRY(ds_cu_side_begin(cu, err));
        int rc = ds_cu_matmul(cu, o, P, fa, ld, T, &w->f_b, err);
        if (!rc)
            ds_cu_kda_gate(cu, g, o, T, H, dk, w->A_log, w->dt_bias, c->has_gate_lower_bound,
                           c->gate_lower_bound, beta, braw, ld);
        if (!rc && c->use_full_rank_gate)
            rc = ds_cu_matmul(cu, gt, P, xn, D, T, &w->g, err);
        else if (!rc) /* g_a x sits in fa's second half */
            rc = ds_cu_matmul(cu, gt, P, fa + dk, ld, T, &w->g_b, err);
        TRY(ds_cu_side_end(cu, err));
        TRY(rc);
        PROF(s, "kda conv+l2norm");
        ds_cu_conv_batch cb = {3,
                               P,
                               W,
                               pre,
                               ld,
                               q,
                               (size_t)(k - q),
                               w->conv,
                               s->tails + at,
                               s->any_rows ? s->tail_rows + at : NULL,
                               slot_n,
                               s->seg_off,
                               s->n_seq,
                               T};
        if (v - k != k - q)
            return ds_errf(err, "forward: internal error: q, k, v not evenly spaced");
        TRY(ds_cu_short_conv_silu_batch(cu, &cb, err));
        ds_cu_l2norm_heads2(cu, q, 1.0f / sqrtf((float)dk), k, 1.0f, T, H, dk, 1e-6f);
        TRY(ds_cu_side_join(cu, err));
        /* every segment in one launch, each on its own state (and rows, for a verify); long
         * segments without rows in chunks instead, as on the CPU (model.c kda_forward) */
        const int n_chunked = kda_chunked_segments(s);
        PROF(s, "kda recurrence");
        TRY(ds_cu_kda_recurrent_batch(cu, o, q, k, v, g, beta, s->seg_off, s->S + at,
                                      s->any_rows ? s->S_rows + at : NULL, slot_n, s->n_seq, H, dk,
                                      dk, n_chunked ? s->m->opts.kda_chunked_min : 0, err));
        if (n_chunked) {
            ds_cuda_model *cm = s->cm;
            if (grow_host((void **)&cm->h_kda, &cm->h_kda_cap, 2 * (size_t)s->n_seq, sizeof(int),
                          err))
                return DS_ERR;
            int *start = cm->h_kda, *len = cm->h_kda + s->n_seq; /* length 0: not chunked */
            for (int z = 0; z < s->n_seq; z++) {
                start[z] = s->off[z];
                len[z] = kda_chunk_eligible(s, z) ? s->seqs[z].n : 0;
            }
            TRY(ds_cu_kda_chunked(cu, o, q, k, v, g, beta, start, len, s->S + at, s->n_seq, H, dk,
                                  dk, err));
        }
    }
    PROF(s, "kda out gate, norm");
    if (!fused) ds_cu_gated_rmsnorm_heads(cu, q, o, gt, w->o_norm, T, H, dk, c->rms_norm_eps);
    PROF(s, "kda o_proj");
    TRY(ds_cu_matmul(cu, out, D, q, P, T, &w->o, err));
    TRY(tp_sum(s, out, (size_t)T * D, err));
    s->used = mark;
    return DS_OK;
}

/* out[T][D] = MLA(xn), writing this step's latent rows into the pool (model.c mla_forward). */
static int mla_forward(cstep *s, const layer_w *lw, const cu_mla *w, const float *xn, float *out,
                       ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    int T = s->T, D = c->hidden_size, Ha = s->m->Ha, R = c->kv_lora_rank;
    int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dvh = c->v_head_dim, dq = dn + dr;
    int row = R + dr, Rq = c->q_lora_rank, bs = s->pool->block_size;
    float *pool = s->pool->layer[lw->kind_idx];
    size_t mark = s->used;
    float *q = take(s, (size_t)T * Ha * dq);         /* [T][Ha][dn+dr] */
    float *kv = take(s, (size_t)T * row);            /* [T][R+dr] this step's latent rows */
    float *o = take(s, (size_t)T * Ha * dvh);        /* [T][Ha][dvh] */
    float *qa = Rq ? take(s, (size_t)T * Rq) : NULL; /* [T][Rq] */
    /* [T][Ha*dvh] sigmoid(x W_g): the output gate */
    float *gt = c->mla_use_output_gate ? take(s, (size_t)T * Ha * dvh) : NULL;
    TAKEN();
    PROF(s, "mla q, kv_a");
    /* this step's latent rows (kv_a, its norm, into the pool) on the side stream, beside the
     * queries; joined before attending */
    TRY(ds_cu_side_begin(cu, err));
    int rc = ds_cu_matmul(cu, kv, row, xn, D, T, &w->kv_a, err);
    if (!rc) ds_cu_rmsnorm_ld(cu, kv, row, kv, row, w->kv_a_norm, T, R, 1e-6f);
    if (!rc)
        rc = ds_cu_move_rows(cu, pool, (size_t)row, s->lat_dst, kv, (size_t)row, NULL, T, row, err);
    TRY(ds_cu_side_end(cu, err));
    TRY(rc);
    if (Rq) {
        TRY(ds_cu_matmul(cu, qa, Rq, xn, D, T, &w->q_a, err));
        ds_cu_rmsnorm(cu, qa, qa, w->q_a_norm, T, Rq, 1e-6f);
        TRY(ds_cu_matmul(cu, q, Ha * dq, qa, Rq, T, &w->q_b, err));
    } else {
        TRY(ds_cu_matmul(cu, q, Ha * dq, xn, D, T, &w->q, err));
    }
    TRY(ds_cu_side_join(cu, err));
    float scale = 1.0f / sqrtf((float)dq);
    int run0 = -1; /* consecutive short segments: one absorbed run (as on the CPU) */
    for (int qi = 0; qi <= s->n_seq; qi++) {
        int expanded = qi < s->n_seq && s->seqs[qi].n >= s->m->opts.mla_expanded_min;
        if (run0 >= 0 && (qi == s->n_seq || expanded)) {
            int r_start = s->off[run0], Tr = s->off[qi - 1] + s->seqs[qi - 1].n - r_start;
            size_t m2 = s->used;
            float *qbar = take(s, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            float *obar = take(s, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            TAKEN();
            const float *qs = q + (size_t)r_start * Ha * dq;
            PROF(s, "mla absorbed q, o");
            /* q̄_h = W_UK_h^T qN_h, every head in one launch */
            TRY(ds_cu_matmul_heads(cu, qbar, Ha * R, R, qs, Ha * dq, dq, Tr, &w->ukT,
                                   (size_t)R * dn, Ha, err));
            /* the run's sequences in one launch; the context bound is the step's power-of-two
             * cap, so that a graph stays valid while the contexts grow under it */
            PROF(s, "mla absorbed attend");
            /* the rope part of each query read in place (stride dq) */
            TRY(ds_cu_mla_attend_absorbed_batch(cu, obar, qbar, qs + dn, dq, Tr, Ha, R, dr, pool,
                                                s->bt, s->tok_bt + r_start, s->tok_pos + r_start,
                                                s->ctx_cap, bs, row, scale, err));

            PROF(s, "mla absorbed q, o");
            /* o_h = W_UV_h ō_h: kv_b rows [h (dn+dvh) + dn, +dvh), every head in one launch */
            ds_cu_mat uv = {w->kv_b.data + (size_t)dn * R, dvh, R};
            TRY(ds_cu_matmul_heads(cu, o + (size_t)r_start * Ha * dvh, Ha * dvh, dvh, obar, Ha * R,
                                   R, Tr, &uv, (size_t)(dn + dvh) * R, Ha, err));
            s->used = m2;
            run0 = -1;
        }
        if (qi == s->n_seq) break;
        if (!expanded) {
            if (run0 < 0) run0 = qi;
            continue;
        }
        const ds_seq_batch *sb = &s->seqs[qi];
        int n = sb->n, pos0 = sb->pos0, ctx = pos0 + n, r0 = s->off[qi];
        size_t m2 = s->used;
        float *cl = take(s, (size_t)ctx * R);                /* [ctx][R] */
        float *kr = take(s, (size_t)ctx * dr);               /* [ctx][dr] */
        float *kvb = take(s, (size_t)ctx * Ha * (dn + dvh)); /* [ctx][Ha][dn+dvh] */
        float *kn = take(s, (size_t)ctx * Ha * dn);          /* [ctx][Ha][dn] */
        float *vv = take(s, (size_t)ctx * Ha * dvh);         /* [ctx][Ha][dvh] */
        TAKEN();
        const int32_t *rows = s->ctx_rows + s->ctx_off[qi];
        PROF(s, "mla expanded kv_b");
        TRY(ds_cu_move_rows(cu, cl, (size_t)R, NULL, pool, (size_t)row, rows, ctx, R, err));
        TRY(ds_cu_move_rows(cu, kr, (size_t)dr, NULL, pool + R, (size_t)row, rows, ctx, dr, err));
        TRY(ds_cu_matmul(cu, kvb, Ha * (dn + dvh), cl, R, ctx, &w->kv_b, err));
        TRY(ds_cu_copy_2d(cu, kn, (size_t)dn, kvb, (size_t)(dn + dvh), (size_t)dn, (size_t)ctx * Ha,
                          err));
        TRY(ds_cu_copy_2d(cu, vv, (size_t)dvh, kvb + dn, (size_t)(dn + dvh), (size_t)dvh,
                          (size_t)ctx * Ha, err));
        PROF(s, "mla expanded attend");
        TRY(ds_cu_mla_attend_expanded(cu, o + (size_t)r0 * Ha * dvh, q + (size_t)r0 * Ha * dq, kn,
                                      kr, vv, n, ctx, Ha, dn, dr, dvh, pos0, 1, scale, err));
        s->used = m2;
    }
    PROF(s, "mla gate, o_proj");
    if (gt) {
        TRY(ds_cu_matmul(cu, gt, Ha * dvh, xn, D, T, &w->g, err));
        ds_cu_sigmoid(cu, gt, (size_t)T * Ha * dvh);
        ds_cu_mul(cu, o, gt, (size_t)T * Ha * dvh);
    }
    TRY(ds_cu_matmul(cu, out, D, o, Ha * dvh, T, &w->o, err));
    TRY(tp_sum(s, out, (size_t)T * D, err));
    s->used = mark;
    return DS_OK;
}

/* y[T][rows of down] = down act(gate x, up x) — dense MLP and shared experts; gu is gate and up
 * stacked ([2I][D]), so both come from one weight stream. */
static int mlp_in(cstep *s, const ds_cu_mat *gu, const ds_cu_mat *down, const float *x, int T,
                  float *y, float *h, ds_err *err) {
    const ds_config *c = &s->m->cfg;
    int D = gu->cols, I = gu->rows / 2;
    TRY(ds_cu_matmul(s->c, h, 2 * I, x, D, T, gu, err));
    ds_cu_act_pairs(s->c, h, T, I, c->hidden_act == DS_ACT_SITU, c->situ_beta, c->situ_linear_beta);
    TRY(ds_cu_matmul(s->c, y, down->rows, h, 2 * I, T, down, err));
    return DS_OK;
}

static int mlp(cstep *s, const ds_cu_mat *gu, const ds_cu_mat *down, const float *x, int T,
               float *y, ds_err *err) {
    size_t mark = s->used;
    float *h = take(s, (size_t)T * gu->rows); /* [T][2I]: gate | up, then act in the gate half */
    TAKEN();
    TRY(mlp_in(s, gu, down, x, T, y, h, err));
    s->used = mark;
    return DS_OK;
}

/* out[T][D] = FFN(xn) (model.c ffn_forward). */
static int ffn_forward(cstep *s, const cu_ffn *w, int is_moe, const float *xn, float *out,
                       ds_err *err) {
    const ds_config *c = &s->m->cfg;
    ds_cu *cu = s->c;
    int T = s->T, D = c->hidden_size;
    if (!is_moe) {
        PROF(s, "dense mlp");
        TRY(mlp(s, &w->gu, &w->down, xn, T, out, err));
        return tp_sum(s, out, (size_t)T * D, err);
    }
    int E = c->num_experts, K = c->num_experts_per_token, Ie = c->moe_intermediate_size;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : D;
    int latent = c->routed_expert_hidden_size > 0, shared = c->num_shared_experts > 0;
    int e0 = s->m->e0, El = s->m->e1 - s->m->e0; /* this rank's experts */
    size_t mark = s->used;
    float *z = take(s, (size_t)T * E);                            /* [T][E] router logits */
    float *wt = take(s, (size_t)T * K);                           /* [T][K] combine weights */
    int32_t *idx = (int32_t *)take(s, (size_t)T * K);             /* [T][K] chosen experts */
    float *u = latent ? take(s, (size_t)T * Hin) : NULL;          /* [T][Hin] expert input */
    float *acc = latent ? take(s, (size_t)T * Hin) : out;         /* [T][Hin] routed sum */
    float *sh = latent && shared ? take(s, (size_t)T * D) : NULL; /* [T][D] */
    /* [T][2 Is] the shared experts' gate | up, held for the whole call (they run beside) */
    float *hs = shared && !latent ? take(s, (size_t)T * w->sh_gu.rows) : NULL;
    TAKEN();
    /* Without a latent the shared experts go first, straight into out, and the routed sum is
     * added onto them by the expert kernel (a + b == b + a: the CPU's sum, bit for bit). They
     * run on the side stream, beside the router and the routed experts (the expert kernel
     * joins before it adds onto out). */
    PROF(s, "moe shared experts");
    if (shared && !latent) {
        TRY(ds_cu_side_begin(cu, err));
        int rc = mlp_in(s, &w->sh_gu, &w->sh_down, xn, T, out, hs, err);
        TRY(ds_cu_side_end(cu, err));
        TRY(rc);
    }
    PROF(s, "moe router");
    TRY(ds_cu_matmul(cu, z, E, xn, D, T, &w->router, err));
    TRY(ds_cu_moe_route(cu, idx, wt, z, w->router_bias, T, E, K,
                        c->use_grouped_topk ? c->num_expert_group : 1, c->topk_group,
                        c->moe_renormalize, c->routed_scaling_factor, s->m->opts.hf_kl_router_quirk,
                        err));
    const float *ein = xn;
    if (latent) {
        TRY(ds_cu_matmul(cu, u, Hin, xn, D, T, &w->lat_down, err));
        ein = u;
    }
    PROF(s, "moe routed experts");
    int situ = c->hidden_act == DS_ACT_SITU, chunk = 65535 / K;
    for (int t0 = 0; t0 < T; t0 += chunk) { /* the expert kernel takes 65535 routed rows */
        int n = DS_MIN(chunk, T - t0);
        TRY(ds_cu_moe_experts(cu, acc + (size_t)t0 * Hin, ein + (size_t)t0 * Hin,
                              idx + (size_t)t0 * K, wt + (size_t)t0 * K, n, K, El, e0, Hin, Ie,
                              w->gate_up, w->e_down, situ, c->situ_beta, c->situ_linear_beta,
                              shared && !latent, err));
    }
    TRY(ds_cu_side_join(cu, err)); /* (already, unless no expert kernel ran) */
    PROF(s, "moe combine");
    if (latent) {
        /* the latent norm is nonlinear: the routed sum is completed first (as on the CPU) */
        TRY(tp_sum(s, acc, (size_t)T * Hin, err));
        if (w->lat_norm) ds_cu_rmsnorm(cu, acc, acc, w->lat_norm, T, Hin, c->rms_norm_eps);
        TRY(ds_cu_matmul(cu, out, D, acc, Hin, T, &w->lat_up, err));
        if (shared) {
            TRY(mlp(s, &w->sh_gu, &w->sh_down, xn, T, sh, err));
            TRY(tp_sum(s, sh, (size_t)T * D, err));
            ds_cu_add(cu, out, sh, (size_t)T * D);
        }
    } else {
        TRY(tp_sum(s, out, (size_t)T * D, err)); /* routed + shared partials in one all-reduce */
    }
    s->used = mark;
    return DS_OK;
}

/* Copies the stream after `layer` (-1: the embedding) to the segments that asked for it. */
static int save_hidden(cstep *s, int layer, const float *h, ds_err *err) {
    int D = s->m->cfg.hidden_size;
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        size_t rows = (size_t)sb->n * D;
        const float *src = h + (size_t)s->off[q] * D;
        if (sb->hidden && layer >= 0)
            TRY(ds_cu_download(s->c, sb->hidden + (size_t)layer * rows, src, rows * sizeof(float),
                               err));
        for (int j = 0; j < sb->n_taps; j++)
            if (sb->tap_layers[j] == layer)
                TRY(ds_cu_download(s->c, sb->taps + (size_t)j * rows, src, rows * sizeof(float),
                                   err));
    }
    return DS_OK;
}

static int wants_hidden(const cstep *s) {
    for (int q = 0; q < s->n_seq; q++)
        if (s->seqs[q].hidden || s->seqs[q].n_taps) return 1;
    return 0;
}

/* The step's launches, from the embedding (or the stream that arrived) to the logits in lg: no
 * host synchronisation inside, so that it can be captured as a graph (hidden states and taps,
 * downloaded per layer, are the exception: such steps never are). */
static int run_body(cstep *s, int nb, ds_err *err) {
    ds_model *m = s->m;
    ds_cuda_model *cm = s->cm;
    ds_cu *cu = s->c;
    const ds_config *c = &m->cfg;
    int T = s->T, D = c->hidden_size, N = c->attn_res_block_size;
    size_t TD = (size_t)T * D, TDp = (TD + 15) & ~(size_t)15;
    float *P = s->P, *x = s->x, *a = s->a, *bank = s->bank;
    int hid = wants_hidden(s);
    if (m->l0 == 0) {
        PROF(s, "embed");
        ds_cu_embed_range(cu, P, &cm->embed, s->ids, T, m->v0); /* this rank's vocabulary */
        TRY(tp_sum(s, P, (size_t)T * D, err));
        if (hid) TRY(save_hidden(s, -1, P, err));
    }
    const int nbx = s->nb_max + 1;
    /* Without AttnRes, each residual add is fused with the norm that reads its result: the FFN's
     * add waits (pending) for the next layer's input norm, or the final norm. */
    int pending = 0;
    for (int i = m->l0; i < m->l1; i++) {
        const layer_w *lw = &m->layers[i];
        const cu_layer *dw = &cm->layers[i];
        PROF(s, "norms, residual, attnres");
        if (N == 0 && pending) {
            ds_cu_add_rmsnorm(cu, x, P, a, dw->in_norm, T, D, c->rms_norm_eps);
            pending = 0;
        } else if (N > 0) {
            /* mix first, then bank P: layer 0 banks the embedding (MODEL_SPEC §6.3) */
            TRY(ds_cu_attnres_mix(cu, x, s->cands + (size_t)nb * nbx, nb + 1, dw->attn_res_np, T, D,
                                  c->rms_norm_eps, err));
            int banks = i % N == 0;
            if (banks) TRY(ds_cu_copy_d2d(cu, bank + (size_t)nb++ * TDp, P, TD * 4, err));
            ds_cu_rmsnorm(cu, x, x, dw->in_norm, T, D, c->rms_norm_eps);
        } else {
            ds_cu_rmsnorm(cu, x, P, dw->in_norm, T, D, c->rms_norm_eps);
        }
        TRY(lw->kind == DS_LAYER_KDA ? kda_forward(s, lw, &dw->kda, x, a, err)
                                     : mla_forward(s, lw, &dw->mla, x, a, err));
        PROF(s, "norms, residual, attnres");
        if (N > 0 && i % N == 0)
            TRY(ds_cu_copy_d2d(cu, P, a, TD * 4, err));
        else if (N > 0)
            ds_cu_add(cu, P, a, TD);
        if (N > 0) {
            TRY(ds_cu_attnres_mix(cu, x, s->cands + (size_t)nb * nbx, nb + 1, dw->mlp_res_np, T, D,
                                  c->rms_norm_eps, err));
            ds_cu_rmsnorm(cu, x, x, dw->post_norm, T, D, c->rms_norm_eps);
        } else {
            ds_cu_add_rmsnorm(cu, x, P, a, dw->post_norm, T, D, c->rms_norm_eps);
        }
        TRY(ffn_forward(s, &dw->ffn, lw->ffn.is_moe, x, a, err));
        PROF(s, "norms, residual, attnres");
        if (N == 0 && !hid)
            pending = 1; /* P += a happens in the next norm (this stage's or the final one) */
        else
            ds_cu_add(cu, P, a, TD);
        if (hid) TRY(save_hidden(s, i, P, err));
    }
    if (pending && m->l1 < c->num_hidden_layers) ds_cu_add(cu, P, a, TD); /* P goes on whole */
    if (m->l1 < c->num_hidden_layers) return DS_OK; /* the stream and banks go on (run_step) */
    PROF(s, "final norm, lm_head");
    if (N > 0) {
        TRY(ds_cu_attnres_mix(cu, x, s->cands + (size_t)nb * nbx, nb + 1, cm->out_res_np, T, D,
                              c->rms_norm_eps, err));
        ds_cu_rmsnorm(cu, x, x, cm->final_norm, T, D, c->rms_norm_eps);
    } else if (pending) {
        ds_cu_add_rmsnorm(cu, x, P, a, cm->final_norm, T, D, c->rms_norm_eps);
    } else {
        ds_cu_rmsnorm(cu, x, P, cm->final_norm, T, D, c->rms_norm_eps);
    }
    if (s->n_lg) { /* this rank's block of the vocabulary: [n_lg][vp] */
        TRY(ds_cu_move_rows(cu, s->xr, (size_t)D, NULL, x, (size_t)D, s->lg_rows, s->n_lg, D, err));
        TRY(ds_cu_matmul(cu, s->lg, m->vp, s->xr, D, s->n_lg, &cm->lm_head, err));
        /* every row's greedy token, inside the step (and its graph) whether or not a sequence
         * wants it this time: a graph serves steps of the same shape whatever their sampling,
         * and the pass is ~1% of lm_head's (it reads the logits once, from L2 at small batches) */
        if (m->tp_size == 1) {
            PROF(s, "greedy tokens");
            ds_cu_argmax_rows(cu, s->am, s->lg, s->n_lg, m->vp, s->am_parts);
        }
    }
    return DS_OK;
}

/* ---- draws (ds_seq_batch.draws) --------------------------------------------------------------
 * On one GPU the rows are drawn where they are (ds_cu_draw_rows: the host's definition, the same
 * token); a TP group's rows are gathered on the host anyway, and drawn there. */

/* Rows of the step's logits (in segment order) that are drawn: *n of them, their draws d[*n]
 * and where their tokens go out[*n], in s->draw_* (grown here). */
static int draw_rows(cstep *s, int *n, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    int cnt = 0;
    for (int q = 0; q < s->n_seq; q++)
        if (s->seqs[q].draws && s->seqs[q].argmax) cnt += ds_seq_logit_rows(&s->seqs[q]);
    *n = cnt;
    if (!cnt) return DS_OK;
    if (grow_host((void **)&cm->draw_d, &cm->draw_d_cap, (size_t)s->n_lg,
                  sizeof(const ds_row_draw *), err) ||
        grow_host((void **)&cm->draw_out, &cm->draw_out_cap, (size_t)s->n_lg, sizeof(int32_t *),
                  err))
        return DS_ERR;
    for (int q = 0, r = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        int drawn = sb->draws && sb->argmax;
        for (int i = 0; i < ds_seq_logit_rows(sb); i++, r++) {
            cm->draw_d[r] = drawn ? &sb->draws[i] : NULL;
            cm->draw_out[r] = drawn ? &sb->argmax[i] : NULL;
        }
    }
    return DS_OK;
}

size_t ds_cuda_pack_draw(const ds_row_draw *d, int V, int row, size_t at, int32_t *edits,
                         struct ds_cu_draw *out) {
    const ds_sample_params *p = &d->p;
    const ds_draw_numbers nb = ds_sample_numbers(p, V); /* what sampler.c's draw() reads */
    *out = (ds_cu_draw){
        .u = d->u,
        .inv_t = nb.inv_t,
        .top_p = p->top_p,
        .min_w = nb.min_w,
        .presence = d->n_counts ? p->presence_penalty : 0.0f,
        .frequency = d->n_counts ? p->frequency_penalty : 0.0f,
        .greedy = nb.greedy,
        .top_k = nb.top_k,
        .row = row,
        .edits = (int)at,
        .n_counts = d->n_counts,
        .n_mask = d->n_mask,
    };
    size_t e = at;
    for (int i = 0; i < d->n_counts; i++) {
        edits[e++] = d->counts[i].id;
        edits[e++] = d->counts[i].count;
    }
    for (int i = 0; i < d->n_mask; i++) edits[e++] = d->mask[i];
    return e - at;
}

/* A TP group's gathered rows all [Tp][n_lg][vp] (host): its draws, on the host. */
static int draw_gathered(cstep *s, const float *all, ds_err *err) {
    int n;
    TRY(draw_rows(s, &n, err));
    if (n)
        ds_model_draw_host(s->m, all, (size_t)s->n_lg * s->m->vp, s->m->vp, s->n_lg, s->cm->draw_d,
                           s->cm->draw_out);
    return DS_OK;
}

/* One GPU: the step's drawn rows of s->lg, drawn there; 4 bytes a row come back. */
static int draw_on_device(cstep *s, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    const ds_model *m = s->m;
    int n, V = m->cfg.vocab_size;
    TRY(draw_rows(s, &n, err));
    if (!n) return DS_OK;
    size_t n_edits = 0;
    for (int r = 0; r < s->n_lg; r++)
        if (cm->draw_d[r]) n_edits += 2 * (size_t)cm->draw_d[r]->n_counts + cm->draw_d[r]->n_mask;
    if (grow_host((void **)&cm->draw_cu, &cm->draw_cu_cap, (size_t)n, sizeof(ds_cu_draw), err) ||
        grow_host((void **)&cm->draw_ed, &cm->draw_ed_cap, DS_MAX(n_edits, 1), sizeof(int32_t),
                  err) ||
        grow_host((void **)&cm->draw_tok, &cm->draw_tok_cap, (size_t)n, sizeof(int32_t), err))
        return DS_ERR;
    size_t e = 0;
    for (int r = 0, j = 0; r < s->n_lg; r++)
        if (cm->draw_d[r])
            e += ds_cuda_pack_draw(cm->draw_d[r], V, r, e, cm->draw_ed, &cm->draw_cu[j++]);
    TRY(ds_cu_draw_rows(cm->c, cm->draw_tok, s->lg, (size_t)m->vp, V, cm->draw_cu, n, cm->draw_ed,
                        e, err));
    for (int r = 0, j = 0; r < s->n_lg; r++)
        if (cm->draw_d[r]) *cm->draw_out[r] = cm->draw_tok[j++];
    return DS_OK;
}

/* ---- graphs --------------------------------------------------------------------------------
 * A decode or verify step (every segment short, no per-layer downloads) is replayed from a graph
 * captured the second time its shape is seen (the first runs eagerly, growing every buffer the
 * shape needs, so that the capture allocates nothing). What a step's launches depend on is its
 * key; everything else they read from the index arenas, uploaded before each launch. When any
 * buffer a graph points into moves, every graph is dropped. */
typedef struct graph_key graph_key;
enum { MAX_GRAPHS = 64 };

static int graphable(const cstep *s) {
    const ds_model *m = s->m;
    /* (tensor parallelism through the host cannot be captured; through NCCL it can) */
    if (m->opts.enforce_eager || (m->tp_size > 1 && !s->cm->nccl) || s->T > 1024 || wants_hidden(s))
        return 0;
    for (int q = 0; q < s->n_seq; q++)
        if (m->n_mla && s->seqs[q].n >= m->opts.mla_expanded_min) return 0;
    return !kda_chunked_segments(s); /* its chunk table is built on the host per step */
}

static void drop_graphs(ds_cuda_model *cm) {
    for (int i = 0; i < cm->n_graphs; i++) ds_cu_graph_free(cm->graphs[i].g);
    cm->n_graphs = 0;
}

static int run_graphed(cstep *s, int nb_in, ds_err *err) {
    ds_cuda_model *cm = s->cm;
    uint64_t epoch = ds_cu_epoch(s->c) + g_moves;
    if (epoch != cm->graph_epoch) {
        drop_graphs(cm);
        cm->graph_epoch = epoch;
    }
    graph_key k = {s->n_seq, s->T, s->n_lg, s->any_rows, s->ctx_cap, nb_in};
    for (int i = 0; i < cm->n_graphs; i++)
        if (!memcmp(&cm->graphs[i].key, &k, sizeof k)) {
            if (!cm->graphs[i].g) return run_body(s, nb_in, err); /* capture failed once */
            cm->graph_replays++;
            return ds_cu_graph_launch(s->c, cm->graphs[i].g, err);
        }
    /* first sight: eagerly (this step's result), then capture the same launches for the next */
    size_t used = s->used;
    TRY(run_body(s, nb_in, err));
    if (ds_cu_epoch(s->c) + g_moves != epoch) { /* the eager run grew a buffer */
        drop_graphs(cm);
        cm->graph_epoch = ds_cu_epoch(s->c) + g_moves;
    }
    if (cm->n_graphs == MAX_GRAPHS) drop_graphs(cm);
    ds_cu_graph *g = NULL;
    ds_err cap_err;
    s->used = used;
    if (!ds_cu_capture_begin(s->c, &cap_err)) {
        int rc = run_body(s, nb_in, &cap_err);
        ds_cu_graph *got = NULL;
        int rc2 = ds_cu_capture_end(s->c, &got, &cap_err);
        if (!rc && !rc2)
            g = got;
        else
            ds_cu_graph_free(got);
    }
    if (!g) cm->graph_failures++; /* this shape stays eager */
    cm->graphs[cm->n_graphs++] = (struct cu_graph_entry){k, g};
    return DS_OK;
}

static int run_step(cstep *s, const ds_stage_io *in, ds_stage_io *out, ds_err *err) {
    ds_model *m = s->m;
    ds_cuda_model *cm = s->cm;
    ds_cu *cu = s->c;
    const ds_config *c = &m->cfg;
    int T = s->T, D = c->hidden_size, N = c->attn_res_block_size;
    size_t TD = (size_t)T * D, TDp = (TD + 15) & ~(size_t)15;
    /* the buffers that outlive the layers come first, at addresses fixed by the shape */
    s->P = take(s, TD);   /* [T][D] residual stream, or the block-local sum with AttnRes */
    s->x = take(s, TD);   /* [T][D] mixer / FFN input */
    s->a = take(s, TD);   /* [T][D] sublayer output */
    s->bank = take(s, 0); /* [nb_max][T][D] banked AttnRes blocks (build_indices' layout) */
    s->used += (size_t)s->nb_max * TDp;
    s->xr = take(s, (size_t)s->n_lg * D);     /* [n_lg][D] rows that want logits */
    s->lg = take(s, (size_t)s->n_lg * m->vp); /* [n_lg][vp] their logits (this rank's
vocabulary block; all of V on one) */
    s->am_parts = ds_cu_argmax_parts(s->n_lg, m->vp);
    s->am = (uint64_t *)take(s, 2 * (size_t)s->n_lg * s->am_parts); /* (8 bytes: 2 floats) */
    if (s->used > cm->sc_cap) s->overflow = 1;
    TAKEN();
    int nb = 0;
    if (m->l0 > 0) {
        /* a later stage: the stream and the banked blocks arrive from the previous one */
        TRY(ds_cu_upload(cu, s->P, in->h, TD * sizeof(float), err));
        nb = in->n_banks;
        for (int j = 0; j < nb; j++)
            TRY(ds_cu_upload(cu, s->bank + (size_t)j * TDp, in->banks + (size_t)j * TD,
                             TD * sizeof(float), err));
    }
    int nb_out = nb; /* the blocks banked by the end of this stage */
    for (int i = m->l0; N > 0 && i < m->l1; i++) nb_out += i % N == 0;
    if (graphable(s))
        TRY(run_graphed(s, nb, err));
    else
        TRY(run_body(s, nb, err));
    if (m->l1 < c->num_hidden_layers) { /* not the last stage: hand the stream and the banks on */
        TRY(ds_cu_download(cu, out->h, s->P, TD * sizeof(float), err));
        out->n_banks = nb_out;
        for (int j = 0; j < nb_out; j++)
            TRY(ds_cu_download(cu, out->banks + (size_t)j * TD, s->bank + (size_t)j * TDp,
                               TD * sizeof(float), err));
        return ds_cu_sync(cu, err);
    }
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        if (sb->final_hidden)
            TRY(ds_cu_download(cu, sb->final_hidden, s->x + (size_t)s->off[q] * D,
                               (size_t)sb->n * D * sizeof(float), err));
    }
    int r = 0, V = c->vocab_size;
    if (m->tp_size > 1 && s->n_lg) {
        /* every rank's block, gathered as on the CPU (logits_flush): all [Tp][n_lg][vp] */
        size_t nm = (size_t)s->n_lg * m->vp;
        float *mine = tp_stage(s, nm * (1 + (size_t)m->tp_size), err);
        if (!mine || ds_cu_download(cu, mine, s->lg, nm * sizeof(float), err)) return DS_ERR;
        float *all = mine + nm;
        if (m->opts.allgather(m->opts.allgather_ctx, mine, nm, all))
            return ds_errf(err, "forward: a tensor-parallel all-gather failed");
        TRY(draw_gathered(s, all, err));
        for (int q = 0; q < s->n_seq; q++) {
            ds_seq_batch *sb = &s->seqs[q];
            for (int i = 0; i < ds_seq_logit_rows(sb); i++, r++) {
                if (sb->argmax && !sb->draws)
                    sb->argmax[i] = ds_argmax_blocks(all + (size_t)r * m->vp,
                                                     (size_t)s->n_lg * m->vp, m->vp, V);
                for (int t = 0; sb->logits && t < m->tp_size; t++) {
                    int v0 = DS_MIN(V, t * m->vp), nv = DS_MIN(V, v0 + m->vp) - v0;
                    memcpy(sb->logits + (size_t)i * V + v0, all + ((size_t)t * s->n_lg + r) * m->vp,
                           (size_t)nv * sizeof(float));
                }
            }
        }
        return ds_cu_sync(cu, err);
    }
    int any_am = 0;
    for (int q = 0; q < s->n_seq; q++) any_am |= s->seqs[q].argmax && s->seqs[q].n_logits;
    uint64_t *keys = NULL; /* [n_lg][am_parts] on the host */
    if (any_am) {          /* the step's greedy tokens (run_body), a few bytes a row to the host */
        const size_t nk = (size_t)s->n_lg * s->am_parts;
        if (!(keys = (uint64_t *)tp_stage(s, 2 * nk, err))) return DS_ERR;
        TRY(ds_cu_download(cu, keys, s->am, nk * sizeof(uint64_t), err));
    }
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        int nl = ds_seq_logit_rows(sb);
        if (sb->logits && nl)
            TRY(ds_cu_download(cu, sb->logits, s->lg + (size_t)r * V,
                               (size_t)nl * V * sizeof(float), err));
        r += nl;
    }
    TRY(draw_on_device(s, err)); /* after the downloads: the draws edit the rows in place */
    TRY(ds_cu_sync(cu, err));
    r = 0;
    for (int q = 0; keys && q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        int nl = ds_seq_logit_rows(sb);
        for (int i = 0; sb->argmax && !sb->draws && i < nl; i++)
            sb->argmax[i] = ds_cu_argmax_token(keys + (size_t)(r + i) * s->am_parts, s->am_parts);
        r += nl;
    }
    return DS_OK;
}

/* Callers that keep a sequence's KDA slot or verify rows in host memory (the CLI's generate, the
 * tests) get them staged: copied to the device before the step and back after it. The engine's
 * pools are device memory already, and pass straight through. host_side [n_seq] marks which. */
static int stage_state(ds_model *m, ds_seq_batch *dev, const ds_seq_batch *seqs, int n_seq,
                       int back, ds_err *err) {
    /* dev starts as a copy of seqs and a staged sequence's pointers are rewritten to the staging
     * buffer, so the way back tells the staged ones by dev != seqs without asking the driver */
    ds_cuda_model *cm = m->cu;
    size_t slot_n = ds_model_slot_floats(m), need = 0;
    if (!slot_n) return DS_OK;
    if (back) {
        for (int q = 0; q < n_seq; q++) {
            if (dev[q].slot != seqs[q].slot)
                TRY(ds_cu_download(cm->c, seqs[q].slot, dev[q].slot, slot_n * sizeof(float), err));
            if (dev[q].state_rows != seqs[q].state_rows)
                TRY(ds_cu_download(cm->c, seqs[q].state_rows, dev[q].state_rows,
                                   (size_t)seqs[q].n * slot_n * sizeof(float), err));
        }
        return DS_OK;
    }
    for (int q = 0; q < n_seq; q++) { /* host pointers: marked NULL in dev until staged */
        if (seqs[q].slot && !ds_cu_is_device_ptr(seqs[q].slot)) {
            need += slot_n;
            dev[q].slot = NULL;
        }
        if (seqs[q].state_rows && !ds_cu_is_device_ptr(seqs[q].state_rows)) {
            need += (size_t)seqs[q].n * slot_n;
            dev[q].state_rows = NULL;
        }
    }
    if (!need) return DS_OK;
    if (grow(cm->c, (void **)&cm->stage, &cm->stage_cap, need, sizeof(float), err)) return DS_ERR;
    float *at = cm->stage;
    for (int q = 0; q < n_seq; q++) {
        if (seqs[q].slot && !dev[q].slot) {
            TRY(ds_cu_upload(cm->c, at, seqs[q].slot, slot_n * sizeof(float), err));
            dev[q].slot = at;
            at += slot_n;
        }
        if (seqs[q].state_rows && !dev[q].state_rows) { /* written by the step, not read */
            dev[q].state_rows = at;
            at += (size_t)seqs[q].n * slot_n;
        }
    }
    return DS_OK;
}

int ds_cuda_forward_stage(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs_in, int n_seq,
                          const int *off, int T, const ds_stage_io *in, ds_stage_io *out,
                          ds_err *err) {
    ds_cuda_model *cm = m->cu;
    if (ds_cu_bind(cm->c, err)) return DS_ERR; /* the engine steps in its own thread */
    if (g_copy_err[0]) {
        ds_errf(err, "forward: an earlier state copy on the GPU failed: %.900s", g_copy_err);
        g_copy_err[0] = 0;
        return DS_ERR;
    }
    if (m->n_mla && (!pool || !pool->on_device))
        return ds_errf(err, "forward: the model is on the GPU but its latent pool is not");
    for (int q = 0; q < n_seq; q++)
        if (m->n_mla && !seqs_in[q].block_table)
            return ds_errf(err, "forward: segment %d has no block table", q);
    for (int q = 0; q < n_seq; q++)
        if (m->n_kda && !seqs_in[q].slot)
            return ds_errf(err, "forward: segment %d has no KDA state slot", q);
    int *hoff = malloc((size_t)2 * (n_seq ? n_seq : 1) * sizeof(int));
    ds_seq_batch *seqs = malloc((size_t)(n_seq ? n_seq : 1) * sizeof *seqs);
    if (!hoff || !seqs) {
        free(hoff);
        free(seqs);
        return ds_errf(err, "forward: out of memory");
    }
    memcpy(seqs, seqs_in, (size_t)n_seq * sizeof *seqs);
    cstep s = {0};
    s.m = m;
    s.cm = cm;
    s.c = cm->c;
    s.pool = pool;
    s.seqs = seqs;
    s.n_seq = n_seq;
    s.T = T;
    s.off = off;
    s.bt_off = hoff;
    s.ctx_off = hoff + n_seq;
    size_t need = cuda_step_need(m, seqs, n_seq, T);
    int rc = grow(cm->c, (void **)&cm->sc, &cm->sc_cap, need, sizeof(float), err);
    if (!rc) rc = stage_state(m, seqs, seqs_in, n_seq, 0, err);
    if (!rc) rc = build_indices(&s, err);
    if (!rc) rc = run_step(&s, in, out, err);
    if (!rc) ds_cu_prof_step_end(cm->c);
    if (!rc) rc = stage_state(m, seqs, seqs_in, n_seq, 1, err);
    free(hoff);
    free(seqs);
    if (rc) ds_err_prefix(err, "forward on %s", ds_cu_device_name(cm->c));
    return rc;
}

/* ---- the DSpark draft on the GPU (model_draft.c's device path) -------------------------------
 * The same data flow as the CPU draft (model_draft.c's header), through this backend's kernels:
 * the block pass's matmuls, norms, absorbed MLA over the draft's paged latent rows (the spare
 * pages of a proposal included), the target's lm_head over the block and the Markov walk's bias
 * and argmax all stay on the GPU; what crosses to the host is the taps in (as the target's step
 * returned them), a few row indices, and one 8-byte key a part of each walk step out. Its weights
 * are uploaded into the target's allocations (freed with the target, which outlives the draft
 * anyway). */

typedef struct cu_draft_layer {
    float *in_norm, *post_norm; /* [D] */
    cu_mla mla;                 /* q or q_a / q_b, kv_a, kv_b (with ukT), o; g unused */
    ds_cu_mat gate, up, down;
} cu_draft_layer;

struct ds_draft_dev {
    ds_cuda_model *cm;
    ds_cu_mat embed, lm_head; /* [V][D] each (the target's where it holds them whole) */
    ds_cu_mat *ctx_blocks;    /* [n_taps] W_context[:, tap j], [D][Dt] */
    float *context_norm, *final_norm;
    cu_draft_layer *layers; /* [L] */
    ds_cu_mat markov_w1, markov_w2;
    float *buf; /* device scratch, buf_cap floats, carved per call */
    size_t buf_cap;
    int32_t *ibuf; /* device indices, ibuf_cap ints */
    size_t ibuf_cap;
    int32_t *hi; /* host staging of those indices, hi_cap ints */
    size_t hi_cap;
    float *hcs; /* host rotations [max rows][dr/2][2], hcs_cap floats */
    size_t hcs_cap;
    uint64_t *hk; /* a walk step's argmax part keys [n][parts], hk_cap */
    size_t hk_cap;
};

int ds_draft_dev_create(ds_draft *d, const ds_model *target, ds_err *err) {
    ds_cuda_model *cm = target->cu;
    if (!cm || !env_flag("DS_DRAFT_DEVICE", 1)) return DS_OK;
    const ds_draft_config *c = &d->cfg;
    ds_draft_dev *g = calloc(1, sizeof *g);
    if (!g) return ds_errf(err, "draft on the GPU: out of host memory");
    d->dev = g;
    g->cm = cm;
    /* the draft reads the whole vocabulary's lm_head: the target's where this rank holds all of
     * it, else (a vocabulary-parallel rank) a copy of the whole from the host's view */
    if (cm->lm_head.data && target->v0 == 0 && target->nv == c->vocab_size)
        g->lm_head = cm->lm_head;
    else if (up_mat(cm, d->lm_head, &g->lm_head, err))
        return DS_ERR;
    int L = c->num_hidden_layers, n_taps = c->num_target_layers;
    g->layers = calloc((size_t)L, sizeof *g->layers);
    g->ctx_blocks = calloc((size_t)n_taps, sizeof *g->ctx_blocks);
    if (!g->layers || !g->ctx_blocks) return ds_errf(err, "draft on the GPU: out of host memory");
    /* the target's embedding where this stage holds all of it, else the draft's own copy */
    if (cm->embed.data && target->v0 == 0 && target->nv == c->vocab_size)
        g->embed = cm->embed;
    else if (up_mat(cm, d->embed, &g->embed, err))
        return DS_ERR;
    for (int j = 0; j < n_taps; j++)
        if (up_mat(cm, &d->ctx_blocks[j], &g->ctx_blocks[j], err)) return DS_ERR;
    if (up_vec(cm, d->context_norm, (size_t)c->hidden_size, &g->context_norm, err) ||
        up_vec(cm, d->final_norm, (size_t)c->hidden_size, &g->final_norm, err) ||
        up_mat(cm, &d->markov_w1, &g->markov_w1, err) ||
        up_mat(cm, &d->markov_w2, &g->markov_w2, err))
        return DS_ERR;
    for (int l = 0; l < L; l++) {
        const draft_layer *w = &d->layers[l];
        cu_draft_layer *x = &g->layers[l];
        /* up_mla's model: the draft's heads, all of them on this one process */
        ds_model shape = {0};
        shape.cfg.kv_lora_rank = c->kv_lora_rank;
        shape.cfg.qk_nope_head_dim = c->qk_nope_head_dim;
        shape.cfg.v_head_dim = c->v_head_dim;
        shape.cfg.q_lora_rank = c->q_lora_rank;
        shape.Ha = c->num_attention_heads;
        mla_w mw = {w->q, w->q_a, w->q_b, w->q_a_norm, w->kv_a, w->kv_a_norm, w->kv_b, w->o, {0}};
        if (up_mla(cm, &shape, &mw, &x->mla, err) ||
            up_vec(cm, w->in_norm, (size_t)c->hidden_size, &x->in_norm, err) ||
            up_vec(cm, w->post_norm, (size_t)c->hidden_size, &x->post_norm, err) ||
            up_mat(cm, &w->gate, &x->gate, err) || up_mat(cm, &w->up, &x->up, err) ||
            up_mat(cm, &w->down, &x->down, err))
            return DS_ERR;
    }
    return ds_cu_sync(cm->c, err);
}

void ds_draft_dev_free(ds_draft *d) {
    ds_draft_dev *g = d->dev;
    if (!g) return;
    ds_cu_dealloc(g->buf);
    ds_cu_dealloc(g->ibuf);
    free(g->hi);
    free(g->hcs);
    free(g->hk);
    free(g->layers);
    free(g->ctx_blocks);
    free(g);
    d->dev = NULL;
}

/* Cuts n device buffers of sizes[i] floats out of the draft's scratch (grown when short, contents
 * not kept), each on a 64-byte boundary. */
static int dev_carve(ds_draft_dev *g, const size_t *sizes, float **bufs, int n, ds_err *err) {
    size_t need = 0;
    for (int i = 0; i < n; i++) need += (sizes[i] + 15) & ~(size_t)15;
    /* (grow_dev: no graph of the target's step reads the draft's buffers) */
    if (grow_dev(g->cm->c, (void **)&g->buf, &g->buf_cap, need, sizeof(float), err)) return DS_ERR;
    float *p = g->buf;
    for (int i = 0; i < n; i++) {
        bufs[i] = p;
        p += (sizes[i] + 15) & ~(size_t)15;
    }
    return DS_OK;
}

/* The n host indices in g->hi to the device (g->ibuf at offset at); returns their device copy. */
static const int32_t *dev_indices(ds_draft_dev *g, size_t at, size_t n, ds_err *err) {
    if (grow_dev(g->cm->c, (void **)&g->ibuf, &g->ibuf_cap, at + n, sizeof(int32_t), err) ||
        ds_cu_upload(g->cm->c, g->ibuf + at, g->hi + at, n * sizeof(int32_t), err))
        return NULL;
    return g->ibuf + at;
}

static int host_room(ds_draft_dev *g, size_t n_idx, size_t n_cs, ds_err *err) {
    if (grow_host((void **)&g->hi, &g->hi_cap, n_idx, sizeof(int32_t), err) ||
        grow_host((void **)&g->hcs, &g->hcs_cap, n_cs, sizeof(float), err))
        return DS_ERR;
    return DS_OK;
}

/* kv [n][R+dr] (W_kva's output) -> [RMSNorm(c) | RoPE(kR)] with cs [n][dr/2][2] (device). */
static int dev_finish_latent(ds_draft *d, const cu_draft_layer *w, float *kv, const float *cs,
                             int n, ds_err *err) {
    const ds_draft_config *c = &d->cfg;
    int R = c->kv_lora_rank, dr = c->qk_rope_head_dim, row = R + dr;
    ds_cu *cu = d->dev->cm->c;
    ds_cu_rmsnorm_ld(cu, kv, row, kv, row, w->mla.kv_a_norm, n, R, c->rms_norm_eps);
    return ds_cu_rope_pairs(cu, kv + R, row, n, 1, cs, dr / 2, err);
}

int ds_draft_dev_write_context(ds_draft *d, ds_draft_cache *c, int n_items,
                               const ds_draft_ctx_write *w, ds_err *err) {
    ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, Dt = cf->target_hidden_size, nt = cf->num_target_layers;
    int dr = cf->qk_rope_head_dim, row = cf->kv_lora_rank + dr, bs = c->block_size;
    const int taps = w[0].taps != NULL; /* (every item the same kind: checked by the caller) */
    int N = 0;                          /* the items' rows stacked, item i's from its offset on */
    for (int i = 0; i < n_items; i++) N += w[i].n;
    size_t in_n = taps ? (size_t)nt * N * Dt : (size_t)N * D;
    size_t sizes[5] = {in_n, (size_t)N * D, (size_t)N * D, (size_t)N * row, (size_t)N * dr};
    float *b[5];
    if (dev_carve(g, sizes, b, 5, err) || host_room(g, (size_t)N, (size_t)N * dr, err))
        return DS_ERR;
    /* in: taps [nt][N][Dt] or sums [N][D]; tmp, ctx [N][D]; kv [N][row]; cs [N][dr/2][2] */
    float *in = b[0], *tmp = b[1], *ctx = b[2], *kv = b[3], *cs = b[4];
    for (int i = 0, off = 0; i < n_items; off += w[i].n, i++) {
        const size_t ni = (size_t)w[i].n;
        if (taps)
            for (int j = 0; j < nt; j++)
                TRY(ds_cu_upload(cu, in + ((size_t)j * N + off) * Dt, w[i].taps + j * ni * Dt,
                                 ni * Dt * sizeof(float), err));
        else
            TRY(ds_cu_upload(cu, in + (size_t)off * D, w[i].sum, ni * D * sizeof(float), err));
        ds_draft_rope_table(d, g->hcs + (size_t)off * dr, w[i].pos0, w[i].n);
        for (int t = 0; t < w[i].n; t++) {
            const int p = w[i].pos0 + t;
            g->hi[off + t] = w[i].block_table[p / bs] * bs + p % bs; /* its row in a layer */
        }
    }
    if (taps) { /* the sum over taps in tap order, as the CPU's context_add */
        for (int j = 0; j < nt; j++) {
            TRY(ds_cu_matmul(cu, j ? tmp : ctx, D, in + (size_t)j * N * Dt, Dt, N,
                             &g->ctx_blocks[j], err));
            if (j) ds_cu_add(cu, ctx, tmp, (size_t)N * D);
        }
        ds_cu_rmsnorm(cu, ctx, ctx, g->context_norm, N, D, cf->rms_norm_eps);
    } else {
        ds_cu_rmsnorm(cu, ctx, in, g->context_norm, N, D, cf->rms_norm_eps);
    }
    TRY(ds_cu_upload(cu, cs, g->hcs, (size_t)N * dr * sizeof(float), err));
    const int32_t *dst = dev_indices(g, 0, (size_t)N, err);
    if (!dst) return DS_ERR;
    for (int l = 0; l < cf->num_hidden_layers; l++) {
        const cu_draft_layer *lw = &g->layers[l];
        TRY(ds_cu_matmul(cu, kv, row, ctx, D, N, &lw->mla.kv_a, err));
        TRY(dev_finish_latent(d, lw, kv, cs, N, err));
        TRY(ds_cu_move_rows(cu, c->layer[l], (size_t)row, dst, kv, (size_t)row, NULL, N, row, err));
    }
    return ds_cu_sync(cu, err);
}

int ds_draft_dev_propose(ds_draft *d, ds_draft_cache *c, int n, const int32_t *const *block_tables,
                         const int *ps, const int32_t *anchors, int T, int32_t *drafts,
                         float *block_logits, ds_err *err) {
    ds_draft_dev *g = d->dev;
    ds_cu *cu = g->cm->c;
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, V = cf->vocab_size, Ha = cf->num_attention_heads;
    int R = cf->kv_lora_rank, dn = cf->qk_nope_head_dim, dr = cf->qk_rope_head_dim, dq = dn + dr;
    int dvh = cf->v_head_dim, Rq = cf->q_lora_rank, I = cf->intermediate_size, r = cf->markov_rank;
    int row = R + dr, bs = c->block_size, NT = n * T;
    float eps = cf->rms_norm_eps;
    size_t TD = (size_t)NT * D;
    const int parts = ds_cu_argmax_parts(n, V);
    /* rows b T + t (sequence b, block row t) through the block pass; the final norm's rows are
     * reordered to t n + b so that each walk step's n rows of U are contiguous */
    size_t sizes[] = {
        TD,
        TD,
        TD,                         /* h, x, a [NT][D] */
        (size_t)NT * (Rq ? Rq : 1), /* qa [NT][Rq] */
        (size_t)NT * Ha * dq,       /* q [NT][Ha][dq] */
        (size_t)NT * row,           /* kv [NT][row]: the blocks' latent rows */
        (size_t)NT * Ha * dr,       /* qr [NT][Ha][dr] */
        (size_t)NT * Ha * R,
        (size_t)NT * Ha * R,   /* qbar, obar [NT][Ha][R] */
        (size_t)NT * Ha * dvh, /* o [NT][Ha][dvh] */
        (size_t)NT * I,
        (size_t)NT * I,        /* g, u [NT][I] */
        (size_t)NT * dr,       /* cs [NT][dr/2][2] */
        (size_t)NT * V,        /* U [T][n][V] */
        (size_t)n * r,         /* w1 [n][r] */
        (size_t)n * V,         /* bias [n][V] */
        2 * (size_t)n * parts, /* a walk step's part keys [n][parts] (8 bytes each) */
        TD,                    /* xr [T][n][D]: the normed rows in walk order */
    };
    float *b[DS_ARRAY_LEN(sizes)];
    TRY(dev_carve(g, sizes, b, (int)DS_ARRAY_LEN(sizes), err));
    float *h = b[0], *x = b[1], *a = b[2], *qa = b[3], *q = b[4], *kv = b[5], *qr = b[6];
    float *qbar = b[7], *obar = b[8], *o = b[9], *gg = b[10], *u = b[11], *cs = b[12], *U = b[13];
    float *w1 = b[14], *bias = b[15], *xr = b[17];
    uint64_t *keys = (uint64_t *)b[16];
    /* each sequence's view: its context pages for rows 0..p, then its spare slot's pages (as
     * spare_table); the context rows of the page holding p+1 are copied into the slot's first
     * spare page. Host indices: ids [NT] | tables (sequence b's full_b + n_spare) | copy src
     * [n_copy] | copy dst [n_copy] | block rows [NT] | walk order [NT] */
    size_t n_tab = 0, n_copy = 0;
    for (int q0 = 0; q0 < n; q0++) {
        const int full = (ps[q0] + 1) / bs;
        n_tab += (size_t)full + c->n_spare;
        n_copy += (size_t)(ps[q0] + 1 - full * bs);
    }
    const size_t at_tab = (size_t)NT, at_src = at_tab + n_tab, at_dst = at_src + n_copy;
    const size_t at_blk = at_dst + n_copy, at_ord = at_blk + NT, n_idx = at_ord + NT;
    TRY(host_room(g, n_idx, (size_t)NT * dr, err));
    if (grow_host((void **)&g->hk, &g->hk_cap, (size_t)n * parts, sizeof(uint64_t), err))
        return DS_ERR;
    uint64_t *hk = g->hk;
    int32_t *hi = g->hi;
    size_t tab = at_tab, cp = 0;
    for (int s0 = 0; s0 < n; s0++) {
        const int p = ps[s0], full = (p + 1) / bs, nc = (p + 1) - full * bs;
        const int32_t *bt = block_tables[s0];
        int32_t *my = hi + tab;
        hi[(size_t)s0 * T] = anchors[s0];
        for (int t = 1; t < T; t++) hi[(size_t)s0 * T + t] = cf->mask_token_id;
        for (int k = 0; k < full; k++) my[k] = bt[k];
        for (int k = 0; k < c->n_spare; k++)
            my[full + k] = c->n_pages + s0 * c->n_spare + k; /* this sequence's spare slot */
        for (int i = 0; i < nc; i++, cp++) {
            const int pos = full * bs + i;
            hi[at_src + cp] = bt[pos / bs] * bs + pos % bs;
            hi[at_dst + cp] = my[pos / bs] * bs + pos % bs;
        }
        for (int t = 0; t < T; t++) {
            const int pos = p + 1 + t;
            hi[at_blk + (size_t)s0 * T + t] = my[pos / bs] * bs + pos % bs;
            hi[at_ord + (size_t)t * n + s0] = s0 * T + t;
        }
        ds_draft_rope_table(d, g->hcs + (size_t)s0 * T * dr, p + 1, T);
        tab += (size_t)full + c->n_spare;
    }
    const int32_t *di = dev_indices(g, 0, n_idx, err);
    if (!di) return DS_ERR;
    const int32_t *ids = di, *csrc = di + at_src, *cdst = di + at_dst, *blk = di + at_blk;
    const int32_t *ord = di + at_ord;
    TRY(ds_cu_upload(cu, cs, g->hcs, (size_t)NT * dr * sizeof(float), err));
    ds_cu_embed(cu, h, &g->embed, ids, NT);
    for (int l = 0; l < cf->num_hidden_layers; l++) {
        const cu_draft_layer *w = &g->layers[l];
        const cu_mla *m = &w->mla;
        float *pool = c->layer[l];
        if (n_copy)
            TRY(ds_cu_move_rows(cu, pool, (size_t)row, cdst, pool, (size_t)row, csrc, (int)n_copy,
                                row, err));
        ds_cu_rmsnorm(cu, x, h, w->in_norm, NT, D, eps);
        /* MLA (block_attention): queries, the blocks' latent rows into the spare pages, absorbed
         * attention over context and block (non-causal, a launch per sequence: each its own
         * view), the output projection */
        if (Rq) {
            TRY(ds_cu_matmul(cu, qa, Rq, x, D, NT, &m->q_a, err));
            ds_cu_rmsnorm(cu, qa, qa, m->q_a_norm, NT, Rq, eps);
            TRY(ds_cu_matmul(cu, q, Ha * dq, qa, Rq, NT, &m->q_b, err));
        } else {
            TRY(ds_cu_matmul(cu, q, Ha * dq, x, D, NT, &m->q, err));
        }
        TRY(ds_cu_matmul(cu, kv, row, x, D, NT, &m->kv_a, err));
        TRY(dev_finish_latent(d, w, kv, cs, NT, err));
        TRY(ds_cu_move_rows(cu, pool, (size_t)row, blk, kv, (size_t)row, NULL, NT, row, err));
        /* qR turns at its own row's position (trap 9): row t h of qr at cs row t */
        TRY(ds_cu_copy_2d(cu, qr, (size_t)dr, q + dn, (size_t)dq, (size_t)dr, (size_t)NT * Ha,
                          err));
        TRY(ds_cu_rope_pairs(cu, qr, dr, NT * Ha, Ha, cs, dr / 2, err));
        TRY(ds_cu_matmul_heads(cu, qbar, Ha * R, R, q, Ha * dq, dq, NT, &m->ukT, (size_t)R * dn, Ha,
                               err));
        const int32_t *table = di + at_tab; /* sequence s0's, then the next one's */
        for (int s0 = 0; s0 < n; s0++) {
            const size_t r0 = (size_t)s0 * T * Ha;
            TRY(ds_cu_mla_attend_absorbed(cu, obar + r0 * R, qbar + r0 * R, qr + r0 * dr, T, Ha, R,
                                          dr, pool, table, bs, row, ps[s0] + 1, ps[s0] + 1 + T, 0,
                                          (float)d->yarn.softmax_scale, err));
            table += (ps[s0] + 1) / bs + c->n_spare;
        }
        ds_cu_mat uv = {m->kv_b.data + (size_t)dn * R, dvh, R};
        TRY(ds_cu_matmul_heads(cu, o, Ha * dvh, dvh, obar, Ha * R, R, NT, &uv,
                               (size_t)(dn + dvh) * R, Ha, err));
        TRY(ds_cu_matmul(cu, a, D, o, Ha * dvh, NT, &m->o, err));
        ds_cu_add(cu, h, a, TD);
        /* SwiGLU MLP */
        ds_cu_rmsnorm(cu, x, h, w->post_norm, NT, D, eps);
        TRY(ds_cu_matmul(cu, gg, I, x, D, NT, &w->gate, err));
        TRY(ds_cu_matmul(cu, u, I, x, D, NT, &w->up, err));
        ds_cu_swiglu(cu, gg, gg, u, (size_t)NT * I);
        TRY(ds_cu_matmul(cu, a, D, gg, I, NT, &w->down, err));
        ds_cu_add(cu, h, a, TD);
    }
    ds_cu_rmsnorm(cu, x, h, g->final_norm, NT, D, eps);
    TRY(ds_cu_move_rows(cu, xr, (size_t)D, NULL, x, (size_t)D, ord, NT, D, err));
    TRY(ds_cu_matmul(cu, U, V, xr, D, NT, &g->lm_head, err));
    if (block_logits) /* [n][T][V] for the caller, from walk order */
        for (int s0 = 0; s0 < n; s0++)
            for (int t = 0; t < T; t++)
                TRY(ds_cu_download(cu, block_logits + ((size_t)s0 * T + t) * V,
                                   U + ((size_t)t * n + s0) * V, (size_t)V * sizeof(float), err));
    /* the Markov walks, a step for all n together: row k's logits plus W2 · W1[previous token],
     * the argmax the next token */
    for (int s0 = 0; s0 < n; s0++) hi[s0] = anchors[s0];
    for (int k = 0; k < T; k++) {
        const int32_t *dprev = dev_indices(g, 0, (size_t)n, err);
        if (!dprev) return DS_ERR;
        ds_cu_embed(cu, w1, &g->markov_w1, dprev, n);
        TRY(ds_cu_matmul(cu, bias, V, w1, r, n, &g->markov_w2, err));
        ds_cu_add(cu, bias, U + (size_t)k * n * V, (size_t)n * V);
        ds_cu_argmax_rows(cu, keys, bias, n, V, parts);
        TRY(ds_cu_download(cu, hk, keys, (size_t)n * parts * sizeof(uint64_t), err));
        TRY(ds_cu_sync(cu, err));
        for (int s0 = 0; s0 < n; s0++)
            hi[s0] = drafts[(size_t)s0 * T + k] =
                ds_cu_argmax_token(hk + (size_t)s0 * parts, parts);
    }
    return DS_OK;
}
