/* upload.c — a model's weights on the GPU: BF16 matrices (converted from F32 / F16 on the host,
 * or drawn on the device for random weights), f32 vectors, and the stacked and transposed forms
 * the step's kernels read (q, k, v and the gates' inputs as one matrix; gate and up; W_UK
 * transposed per head). Every allocation is the model's, freed at detach. */
#include "backend/cuda/internal.h"

#include <math.h>

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

/* An FP8 (ptpc) matrix: codes [rows][cols] and scales [rows]. Checkpoint weights come quantized
 * by the loader (uploaded as they are); random ones are drawn in BF16 on the device, whole rows
 * (the scale is the whole row's even for a column slice), and quantized there, bit for bit
 * ds_ptpc_quantize, a band of rows at a time. */
static int fill_fp8(ds_cuda_model *cm, uint8_t *codes, float *scales, const ds_mat *w,
                    ds_err *err) {
    const ds_rand_mat *r = ds_model_rand_mat(cm->m, w);
    if (!r)
        return ds_cu_upload(cm->c, codes, w->data, (size_t)w->rows * w->cols, err) ||
               ds_cu_upload(cm->c, scales, w->scale, (size_t)w->rows * sizeof(float), err);
    const size_t fc = (size_t)r->full_cols;
    const int band = (int)DS_MAX((size_t)1, ((size_t)64 << 20) / (fc * 2));
    uint16_t *tmp =
        ds_cu_alloc(cm->c, (size_t)DS_MIN(band, w->rows) * fc * 2, err); /* [band][fc] */
    if (!tmp) return DS_ERR;
    int rc = DS_OK;
    for (int r0 = 0; r0 < w->rows && !rc; r0 += band) {
        const int n = DS_MIN(band, w->rows - r0);
        rc = ds_cu_fill_random_bf16(cm->c, tmp, (size_t)n, fc, r->key, (size_t)(r->row0 + r0), 0,
                                    fc, r->scale, err) ||
             ds_cu_ptpc_quantize_bf16(cm->c, codes + (size_t)r0 * w->cols, scales + r0, tmp, n,
                                      (int)fc, (int)r->col0, w->cols, err);
    }
    if (!rc) rc = ds_cu_sync(cm->c, err);
    ds_cu_dealloc(tmp);
    return rc;
}

/* An MXFP4 matrix: codes [rows][cols/2] and scales [rows][cols/32], uploaded packed or drawn on
 * the device (rand_hash.h). */
static int fill_mxfp4(ds_cuda_model *cm, uint8_t *codes, uint8_t *scales, const ds_mat *w,
                      ds_err *err) {
    const ds_rand_mat *r = ds_model_rand_mat(cm->m, w);
    if (r)
        return ds_cu_fill_random_mxfp4(cm->c, codes, scales, (size_t)w->rows, (size_t)w->cols,
                                       r->key, (size_t)r->row0, (size_t)r->col0,
                                       (size_t)r->full_cols, r->e2, err);
    return ds_cu_upload(cm->c, codes, w->data, (size_t)w->rows * (w->cols / 2), err) ||
           ds_cu_upload(cm->c, scales, w->scale, (size_t)w->rows * (w->cols / 32), err);
}

int cuda_up_mat(ds_cuda_model *cm, const ds_mat *w, ds_cu_mat *out, ds_err *err) {
    memset(out, 0, sizeof *out);
    if (!w->data || !w->rows || !w->cols) return DS_OK;
    if (w->dtype == DS_DT_F8_E4M3) {
        uint8_t *d = dev_alloc(cm, (size_t)w->rows * w->cols, err);
        float *sc = d ? dev_alloc(cm, (size_t)w->rows * sizeof(float), err) : NULL;
        if (!sc || fill_fp8(cm, d, sc, w, err)) return DS_ERR;
        *out = (ds_cu_mat){(const uint16_t *)d, w->rows, w->cols, DS_CU_FP8, sc, NULL, 0};
        return DS_OK;
    }
    if (w->dtype == DS_DT_MXFP4)
        return ds_errf(err, "cuda: an MXFP4 matrix outside the routed experts");
    uint16_t *d = dev_alloc(cm, (size_t)w->rows * w->cols * 2, err);
    if (!d || fill_mat(cm, d, w, err)) return DS_ERR;
    *out = (ds_cu_mat){d, w->rows, w->cols, DS_CU_BF16, NULL, NULL, 0};
    return DS_OK;
}

/* Matrices of equal width stacked into one ([sum of rows][cols]): projections of the same input
 * become one weight-streaming launch (q, k and v; the two low-rank gate inputs; gate and up).
 * BF16 rows (and FP8 codes with their scales) follow one another; a stack whose members differ
 * in dtype (ptpc with an excluded member: KDA's b_proj) is uploaded as runs, one stack for each
 * stretch of members in one format (runs [n], the caller's storage; a launch a run), each product
 * writing its columns of one output. */
static int up_stack(ds_cuda_model *cm, const ds_mat *const *ws, int n, ds_cu_mat *out,
                    ds_cu_mat *runs, ds_err *err) {
    int rows = 0, cols = ws[0]->cols, mixed = 0;
    const ds_dtype dt = ws[0]->dtype;
    for (int i = 0; i < n; i++) {
        if (ws[i]->cols != cols || !ws[i]->data)
            return ds_errf(err, "cuda: stacking matrices of widths %d and %d", cols, ws[i]->cols);
        rows += ws[i]->rows;
        mixed |= (ws[i]->dtype == DS_DT_F8_E4M3) != (dt == DS_DT_F8_E4M3);
    }
    if (mixed) { /* each stretch of members in one format a stack of its own */
        int nr = 0;
        for (int i = 0, j; i < n; i = j) {
            const int f8 = ws[i]->dtype == DS_DT_F8_E4M3;
            for (j = i + 1; j < n && (ws[j]->dtype == DS_DT_F8_E4M3) == f8; j++) {
            }
            if (up_stack(cm, ws + i, j - i, &runs[nr++], NULL, err)) return DS_ERR;
        }
        *out = (ds_cu_mat){NULL, rows, cols, DS_CU_BF16, NULL, runs, nr};
        return DS_OK;
    }
    if (dt == DS_DT_F8_E4M3) {
        uint8_t *d = dev_alloc(cm, (size_t)rows * cols, err);
        float *sc = d ? dev_alloc(cm, (size_t)rows * sizeof(float), err) : NULL;
        if (!sc) return DS_ERR;
        *out = (ds_cu_mat){(const uint16_t *)d, rows, cols, DS_CU_FP8, sc, NULL, 0};
        for (int i = 0; i < n; i++) {
            if (fill_fp8(cm, d, sc, ws[i], err)) return DS_ERR;
            d += (size_t)ws[i]->rows * cols;
            sc += ws[i]->rows;
        }
        return DS_OK;
    }
    uint16_t *d = dev_alloc(cm, (size_t)rows * cols * 2, err);
    if (!d) return DS_ERR;
    *out = (ds_cu_mat){d, rows, cols, DS_CU_BF16, NULL, NULL, 0};
    for (int i = 0; i < n; i++) {
        if (fill_mat(cm, d, ws[i], err)) return DS_ERR;
        d += (size_t)ws[i]->rows * cols;
    }
    return DS_OK;
}

int cuda_up_vec(ds_cuda_model *cm, const float *v, size_t n, float **out, ds_err *err) {
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
    if (!d->conv || up_stack(cm, in, lowrank ? 6 : 5, &d->in, d->in_runs, err) ||
        cuda_up_mat(cm, &w->f_b, &d->f_b, err) || cuda_up_mat(cm, &w->g, &d->g, err) ||
        cuda_up_mat(cm, &w->g_b, &d->g_b, err) || cuda_up_mat(cm, &w->o, &d->o, err) ||
        ds_cu_upload(cm->c, d->conv, w->q_conv, P * W * sizeof(float), err) ||
        ds_cu_upload(cm->c, d->conv + P * W, w->k_conv, P * W * sizeof(float), err) ||
        ds_cu_upload(cm->c, d->conv + 2 * P * W, w->v_conv, P * W * sizeof(float), err) ||
        cuda_up_vec(cm, w->dt_bias, P, &d->dt_bias, err) ||
        cuda_up_vec(cm, w->A_log, (size_t)m->Hk, &d->A_log, err) ||
        cuda_up_vec(cm, w->o_norm, (size_t)c->kda_head_dim, &d->o_norm, err))
        return DS_ERR;
    return DS_OK;
}

int cuda_up_mla(ds_cuda_model *cm, const ds_model *m, const mla_w *w, cu_mla *d, ds_err *err) {
    const ds_config *c = &m->cfg;
    int Ha = m->Ha, R = c->kv_lora_rank, dn = c->qk_nope_head_dim, dvh = c->v_head_dim;
    if (cuda_up_mat(cm, &w->q, &d->q, err) || cuda_up_mat(cm, &w->q_a, &d->q_a, err) ||
        cuda_up_mat(cm, &w->q_b, &d->q_b, err) || cuda_up_mat(cm, &w->kv_a, &d->kv_a, err) ||
        cuda_up_mat(cm, &w->kv_b, &d->kv_b, err) || cuda_up_mat(cm, &w->o, &d->o, err) ||
        cuda_up_mat(cm, &w->g, &d->g, err) ||
        cuda_up_vec(cm, w->q_a_norm, (size_t)c->q_lora_rank, &d->q_a_norm, err) ||
        cuda_up_vec(cm, w->kv_a_norm, (size_t)R, &d->kv_a_norm, err))
        return DS_ERR;
    if (d->kv_b.dtype != DS_CU_BF16) /* (the loader keeps it BF16: docs/quantization.md) */
        return ds_errf(err, "cuda: MLA kv_b_proj must stay BF16 (per-head matrices)");
    /* W_UK_h = kv_b rows [h (dn+dvh), h (dn+dvh) + dn), [dn][R]; its transpose [R][dn], made on
     * the device from the uploaded kv_b */
    uint16_t *t = dev_alloc(cm, (size_t)Ha * R * dn * 2, err); /* [Ha][R][dn] */
    if (!t) return DS_ERR;
    for (int h = 0; h < Ha; h++)
        if (ds_cu_transpose_bf16(cm->c, t + (size_t)h * R * dn,
                                 d->kv_b.data + (size_t)h * (dn + dvh) * R, dn, R, err))
            return DS_ERR;
    d->ukT = (ds_cu_mat){t, R, dn, DS_CU_BF16, NULL, NULL, 0}; /* head h's at data + h R dn */
    return DS_OK;
}

/* MXFP4 routed experts (Kimi-K3), kept packed: gate then up rows of each expert, then down. */
static int up_experts_mxfp4(ds_cuda_model *cm, const ds_model *m, const ffn_w *w, cu_ffn *d,
                            ds_err *err) {
    const ds_config *c = &m->cfg;
    const int El = m->e1 - m->e0, Ie = c->moe_intermediate_size;
    const int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : c->hidden_size;
    if (Hin % 32 || Ie % 32)
        return ds_errf(err, "cuda: MXFP4 experts of widths %d and %d (multiples of 32)", Hin, Ie);
    const size_t per = (size_t)Ie * Hin; /* values of one expert matrix */
    d->experts_mxfp4 = 1;
    d->gu_codes = dev_alloc(cm, (size_t)El * 2 * per / 2, err);
    d->gu_scales = dev_alloc(cm, (size_t)El * 2 * per / 32, err);
    d->dn_codes = dev_alloc(cm, (size_t)El * per / 2, err);
    d->dn_scales = dev_alloc(cm, (size_t)El * per / 32, err);
    if (!d->gu_codes || !d->gu_scales || !d->dn_codes || !d->dn_scales) return DS_ERR;
    for (int e = m->e0; e < m->e1; e++) {
        const ds_mat *w1 = &w->w1[e], *w3 = &w->w3[e], *w2 = &w->w2[e];
        const size_t l = (size_t)(e - m->e0); /* its place among this rank's experts */
        if (w1->dtype != DS_DT_MXFP4 || w3->dtype != DS_DT_MXFP4 || w2->dtype != DS_DT_MXFP4)
            return ds_errf(err, "cuda: expert %d mixes MXFP4 and other dtypes", e);
        if (fill_mxfp4(cm, d->gu_codes + l * per, d->gu_scales + l * per / 16, w1, err) ||
            fill_mxfp4(cm, d->gu_codes + l * per + per / 2, d->gu_scales + l * per / 16 + per / 32,
                       w3, err) ||
            fill_mxfp4(cm, d->dn_codes + l * per / 2, d->dn_scales + l * per / 32, w2, err))
            return DS_ERR;
    }
    return DS_OK;
}

/* ptpc FP8 routed experts (Kimi-Linear's under --quantization ptpc_fp8): codes and row scales,
 * gate then up rows of each expert, then down. */
static int up_experts_fp8(ds_cuda_model *cm, const ds_model *m, const ffn_w *w, cu_ffn *d,
                          ds_err *err) {
    const ds_config *c = &m->cfg;
    const int El = m->e1 - m->e0, Ie = c->moe_intermediate_size;
    const int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : c->hidden_size;
    if (Hin % 16 || Ie % 16)
        return ds_errf(err, "cuda: FP8 experts of widths %d and %d (multiples of 16)", Hin, Ie);
    const size_t per = (size_t)Ie * Hin; /* values of one expert matrix */
    d->experts_fp8 = 1;
    d->gu_codes = dev_alloc(cm, (size_t)El * 2 * per, err);
    d->gu_scales = dev_alloc(cm, (size_t)El * 2 * Ie * sizeof(float), err);
    d->dn_codes = dev_alloc(cm, (size_t)El * per, err);
    d->dn_scales = dev_alloc(cm, (size_t)El * Hin * sizeof(float), err);
    if (!d->gu_codes || !d->gu_scales || !d->dn_codes || !d->dn_scales) return DS_ERR;
    float *gs = (float *)d->gu_scales, *dsc = (float *)d->dn_scales;
    for (int e = m->e0; e < m->e1; e++) {
        const ds_mat *w1 = &w->w1[e], *w3 = &w->w3[e], *w2 = &w->w2[e];
        const size_t l = (size_t)(e - m->e0); /* its place among this rank's experts */
        if (w1->dtype != DS_DT_F8_E4M3 || w3->dtype != DS_DT_F8_E4M3 || w2->dtype != DS_DT_F8_E4M3)
            return ds_errf(err, "cuda: expert %d mixes FP8 and other dtypes", e);
        if (fill_fp8(cm, d->gu_codes + l * 2 * per, gs + l * 2 * Ie, w1, err) ||
            fill_fp8(cm, d->gu_codes + l * 2 * per + per, gs + l * 2 * Ie + Ie, w3, err) ||
            fill_fp8(cm, d->dn_codes + l * per, dsc + l * Hin, w2, err))
            return DS_ERR;
    }
    return DS_OK;
}

static int up_ffn(ds_cuda_model *cm, const ds_model *m, const ffn_w *w, cu_ffn *d, ds_err *err) {
    const ds_config *c = &m->cfg;
    const ds_mat *gu[2] = {&w->gate, &w->up}, *sgu[2] = {&w->sh_gate, &w->sh_up};
    if (!w->is_moe)
        return up_stack(cm, gu, 2, &d->gu, d->gu_runs, err) ||
               cuda_up_mat(cm, &w->down, &d->down, err);
    /* the router sees every expert; the weights are this rank's experts [e0, e1) only */
    int E = c->num_experts, El = m->e1 - m->e0, Ie = c->moe_intermediate_size;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : c->hidden_size;
    if (cuda_up_mat(cm, &w->router, &d->router, err) ||
        cuda_up_vec(cm, w->router_bias, (size_t)E, &d->router_bias, err) ||
        (c->num_shared_experts > 0 && up_stack(cm, sgu, 2, &d->sh_gu, d->sh_gu_runs, err)) ||
        cuda_up_mat(cm, &w->sh_down, &d->sh_down, err) ||
        cuda_up_mat(cm, &w->lat_down, &d->lat_down, err) ||
        cuda_up_mat(cm, &w->lat_up, &d->lat_up, err) ||
        cuda_up_vec(cm, w->lat_norm, (size_t)Hin, &d->lat_norm, err))
        return DS_ERR;
    size_t per = (size_t)Ie * Hin; /* elements of one expert matrix */
    if (El > 0 && w->w1[m->e0].dtype == DS_DT_MXFP4) return up_experts_mxfp4(cm, m, w, d, err);
    if (El > 0 && w->w1[m->e0].dtype == DS_DT_F8_E4M3) return up_experts_fp8(cm, m, w, d, err);
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

int cuda_upload_weights(ds_cuda_model *cm, const ds_model *m, ds_err *err) {
    const ds_config *c = &m->cfg;
    int L = c->num_hidden_layers, D = c->hidden_size;
    cm->layers = calloc((size_t)L, sizeof *cm->layers);
    if (!cm->layers) return ds_errf(err, "cuda: out of host memory");
    if (cuda_up_mat(cm, &m->embed, &cm->embed, err) ||
        cuda_up_mat(cm, &m->lm_head, &cm->lm_head, err) ||
        cuda_up_vec(cm, m->final_norm, (size_t)D, &cm->final_norm, err) ||
        cuda_up_vec(cm, m->out_res_np, (size_t)D, &cm->out_res_np, err))
        return DS_ERR;
    for (int i = m->l0; i < m->l1; i++) {
        const layer_w *lw = &m->layers[i];
        cu_layer *d = &cm->layers[i];
        if (cuda_up_vec(cm, lw->in_norm, (size_t)D, &d->in_norm, err) ||
            cuda_up_vec(cm, lw->post_norm, (size_t)D, &d->post_norm, err) ||
            cuda_up_vec(cm, lw->attn_res_np, (size_t)D, &d->attn_res_np, err) ||
            cuda_up_vec(cm, lw->mlp_res_np, (size_t)D, &d->mlp_res_np, err) ||
            (lw->kind == DS_LAYER_KDA ? up_kda(cm, m, &lw->kda, &d->kda, err)
                                      : cuda_up_mla(cm, m, &lw->mla, &d->mla, err)) ||
            up_ffn(cm, m, &lw->ffn, &d->ffn, err))
            return DS_ERR;
    }
    free(cm->conv);
    cm->conv = NULL;
    cm->conv_cap = 0;
    return DS_OK;
}
