/* model.c — loading a model: its config, the backend it runs on (chosen once, model/backend.h),
 * this stage's and this rank's share of the weights, bound from the checkpoint or drawn
 * (--load-format random); the per-sequence state's sizes; and a step's inputs checked and its
 * plan made before the backend runs it (the forward passes themselves: src/backend/cpu,
 * src/backend/cuda). */
#include "model/model_impl.h"
#include "model/backend.h"
#include "kernels/shared/kv_row.h"
#include "kernels/shared/rand_hash.h"

#include "base/devmem.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

const char *const ds_device_names[] = {"cpu", "cuda", "auto", NULL};

int ds_device_from_name(const char *name) {
    for (int i = 0; ds_device_names[i]; i++)
        if (!strcmp(name, ds_device_names[i])) return i;
    return -1;
}

/* DS_DEVICE / DS_BATCH_INVARIANT in the environment (see model.h); an unknown device name gives
 * -1, which the model load reports. */
static int env_device(void) {
    const char *d = getenv("DS_DEVICE");
    return !d || !*d ? DS_DEVICE_CPU : ds_device_from_name(d);
}

void ds_model_opts_default(ds_model_opts *o) {
    o->device = env_device();
    o->device_index = 0;
    const char *bi = getenv("DS_BATCH_INVARIANT");
    o->batch_invariant = bi && *bi && strcmp(bi, "0") != 0;
    o->load_random = 0;
    o->enforce_eager = 0;
    o->random_seed = 0;
    o->kda_chunk = 64;
    o->kda_chunked_min = 16;
    o->mla_expanded_min = 32;
    o->hf_kl_router_quirk = 0;
    o->quantization = DS_QUANT_NONE;
    o->quantization_exclude = NULL;
    o->kv_dtype = DS_KV_F32;
    o->layer_begin = 0;
    o->layer_end = 0;
    o->tp_rank = 0;
    o->tp_size = 1;
    o->allreduce = NULL;
    o->allreduce_ctx = NULL;
    o->allgather = NULL;
    o->allgather_ctx = NULL;
}

int ds_model_tp_check(const ds_config *c, int T, ds_err *err) {
    if (T < 1) return ds_errf(err, "tensor parallel size %d: must be at least 1", T);
    char bad[768] = "";
    size_t len = 0;
#define TP_NEED(cond, ...)                                                                         \
    if (!(cond) && len < sizeof bad)                                                               \
        len += (size_t)snprintf(bad + len, sizeof bad - len, __VA_ARGS__);
    TP_NEED(!c->num_kda_layers || c->kda_num_heads % T == 0, "; %d KDA heads", c->kda_num_heads)
    TP_NEED(!c->num_mla_layers || c->num_attention_heads % T == 0, "; %d MLA heads",
            c->num_attention_heads)
    TP_NEED(c->num_experts % T == 0, "; %d routed experts", c->num_experts)
    TP_NEED(c->intermediate_size % T == 0, "; dense intermediate size %d", c->intermediate_size)
    TP_NEED((c->moe_intermediate_size * c->num_shared_experts) % T == 0,
            "; shared-expert intermediate size %d",
            c->moe_intermediate_size * c->num_shared_experts)
#undef TP_NEED
    if (len)
        return ds_errf(err, "tensor parallel size %d does not divide the model's %s", T, bad + 2);
    return DS_OK;
}

const ds_config *ds_model_config(const ds_model *m) {
    return &m->cfg;
}
/* Host views of the embedding and lm_head (the DSpark draft reads them): none when the rank holds
 * a vocabulary slice, or when random weights exist only in GPU memory. */
const ds_mat *ds_model_embed(const ds_model *m) {
    if (m->tp_size > 1 || ds_model_rand_mat(m, &m->embed)) return NULL;
    return &m->embed;
}
const ds_mat *ds_model_lm_head(const ds_model *m) {
    return ds_model_rand_mat(m, &m->lm_head_full) ? NULL : &m->lm_head_full;
}
int ds_model_on_device(const ds_model *m) {
    return m->be->device_memory;
}
const ds_dmem *ds_model_dmem(const ds_model *m) {
    return m->be->dmem ? m->be->dmem(m) : NULL;
}
size_t ds_model_device_mem_free(const ds_model *m) {
    return m->be->mem_free(m);
}
const char *ds_model_device_name(const ds_model *m) {
    return m->be->device_name(m);
}
void ds_model_profile_report(const ds_model *m, FILE *f, const char *title) {
    m->be->profile_report(m, f, title);
}
double ds_model_profile_gemm_tflops(const ds_model *m, double *ms_per_step) {
    *ms_per_step = 0;
    return m->be->profile_gemm_tflops(m, ms_per_step);
}
int ds_model_device_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    return m->be->limits(m, copy_gbs, gemm_tflops, err);
}
void ds_model_set_draw_wait(ds_model *m, void (*fn)(void *ctx), void *ctx) {
    m->draw_wait = fn;
    m->draw_wait_ctx = ctx;
}
void ds_model_draw_wait(const ds_model *m) {
    if (m->draw_wait) m->draw_wait(m->draw_wait_ctx);
}
size_t ds_model_weight_bytes(const ds_model *m) {
    return m->weight_bytes;
}

int ds_model_own(ds_model *m, void *p, ds_err *err) {
    if (m->n_owned == m->cap_owned) {
        int cap = m->cap_owned ? 2 * m->cap_owned : 256;
        void **n = realloc(m->owned, (size_t)cap * sizeof *n);
        if (!n) return ds_errf(err, "out of memory");
        m->owned = n;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return DS_OK;
}

#define FLOAT_TYPES ((1u << DS_DT_F32) | (1u << DS_DT_F16) | (1u << DS_DT_BF16))

/* ---- random weights (--load-format random) ----------------------------------------------------
 * Every tensor the config implies, drawn from a hash of (seed, tensor name, element index in the
 * whole tensor), so a tensor's values do not depend on load order or on which rank binds which
 * slice of it: pipeline stages and tensor-parallel ranks hold the one-process model. Matrices are
 * BF16, uniform with variance 1/cols of the whole tensor (activations keep their scale through
 * the stack); on the GPU they are never made on the host: the data pointer is a ds_rand_mat and
 * the CUDA backend fills device memory itself, with the same values. Vectors follow their role:
 * norms 1, A_log log U(1,16), the rest small. */

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

/* Rows [r0, r0+rows) x columns [c0, c0+cols) of the tensor `name` of full_cols columns. */
static int rand_mat(ds_model *m, const char *name, int rows, int cols, int r0, int c0,
                    int full_cols, ds_mat *out, ds_err *err) {
    size_t n = (size_t)rows * (size_t)cols;
    const uint64_t key = name_hash(name) ^ m->opts.random_seed;
    const float a = sqrtf(3.0f / (float)(full_cols > 0 ? full_cols : 1));
    *out = (ds_mat){NULL, DS_DT_BF16, rows, cols, NULL};
    m->weight_bytes += n * 2;
    if (m->be->device_memory) { /* filled on the device */
        ds_rand_mat *d = ds_malloc(sizeof *d, err);
        if (!d || ds_model_own(m, d, err)) {
            free(d);
            return DS_ERR;
        }
        *d = (ds_rand_mat){DS_RAND_MAGIC, m, key, r0, c0, full_cols, a, 0};
        out->data = d;
        return DS_OK;
    }
    uint16_t *p = ds_aligned_alloc(n * 2 + 2, err);
    if (!p || ds_model_own(m, p, err)) {
        free(p);
        return DS_ERR;
    }
    for (size_t i = 0; i < (size_t)rows; i++)
        for (size_t j = 0; j < (size_t)cols; j++)
            p[i * cols + j] = ds_f32_to_bf16(
                a * ds_hash_uniform(key, ((size_t)r0 + i) * (size_t)full_cols + (size_t)c0 + j));
    out->data = p;
    return DS_OK;
}

const ds_rand_mat *ds_model_rand_mat(const ds_model *m, const ds_mat *w) {
    /* on a GPU with random weights every bound matrix is one (the check reads no element) */
    if (!m->random || !m->be->device_memory || !w->data) return NULL;
    const ds_rand_mat *d = w->data;
    return d->magic == DS_RAND_MAGIC && d->owner == m ? d : NULL;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static int rand_vec(ds_model *m, const char *name, size_t n, float **out, ds_err *err) {
    float *v = ds_malloc((n ? n : 1) * sizeof(float), err);
    if (!v || ds_model_own(m, v, err)) {
        free(v);
        return DS_ERR;
    }
    uint64_t key = name_hash(name) ^ m->opts.random_seed;
    for (size_t i = 0; i < n; i++) {
        float u = ds_hash_uniform(key, i);
        if (ends_with(name, "A_log"))
            v[i] = logf(8.5f + 7.5f * u); /* log U(1, 16) */
        else if (ends_with(name, "conv1d.weight"))
            v[i] = 0.5f * u;
        else if (ends_with(name, "res_proj.weight") || ends_with(name, "dt_bias"))
            v[i] = 0.1f * u;
        else /* norm weights */
            v[i] = 1.0f + 0.05f * u;
    }
    m->weight_bytes += n * sizeof(float);
    m->vec_floats += n;
    *out = v;
    return DS_OK;
}

/* Binds a matrix [rows][cols] in its file dtype, as the file has it. */
static int bind_file(ds_model *m, const char *name, int rows, int cols, ds_mat *out, ds_err *err) {
    const ds_tensor *t;
    int64_t shape[2] = {rows, cols};
    if (ds_st_get(m->st, name, FLOAT_TYPES, 2, shape, &t, err)) return DS_ERR;
    *out = (ds_mat){t->data, t->dtype, rows, cols, NULL};
    return DS_OK;
}

/* Bytes a bound matrix holds (codes and scales of quantized ones). */
static size_t held_bytes(const ds_mat *w) {
    return (size_t)w->rows * (ds_mat_row_bytes(w) + ds_mat_scale_row_bytes(w));
}

/* Rows [r0, r0+nr) x columns [c0, c0+nc) of the matrix `name` [rows][cols]: a column-parallel
 * split keeps rows, a row-parallel split columns. Rows of a file tensor are a view into the
 * mapped file; a column slice is copied in its file dtype (a matrix has no row stride); a weight
 * ptpc_fp8 quantizes becomes FP8 codes and scales made from its whole rows (docs/quantization.md
 * §3), so every split holds the codes of the unsplit matrix. */
static int bind_slice(ds_model *m, const char *name, int rows, int cols, int r0, int nr, int c0,
                      int nc, ds_mat *out, ds_err *err) {
    const int q = ds_quant_wants(m, name, DS_DT_BF16);
    if (m->random) {
        if (!q) return rand_mat(m, name, nr, nc, r0, c0, cols, out, err);
        if (m->be->device_memory) { /* drawn and quantized on the device */
            size_t before = m->weight_bytes;
            if (rand_mat(m, name, nr, nc, r0, c0, cols, out, err)) return DS_ERR;
            out->dtype = DS_DT_F8_E4M3;
            m->weight_bytes = before + (size_t)nr * ((size_t)nc + sizeof(float));
            return DS_OK;
        }
        ds_mat full; /* whole rows, for their scales; freed once quantized */
        size_t before = m->weight_bytes;
        if (rand_mat(m, name, nr, cols, r0, 0, cols, &full, err)) return DS_ERR;
        m->n_owned--; /* rand_mat's buffer is the last the model took */
        int rc = ds_quant_ptpc(m, &full, c0, nc, out, err);
        free((void *)full.data);
        m->weight_bytes = before + (rc ? 0 : held_bytes(out));
        return rc;
    }
    ds_mat full;
    if (bind_file(m, name, rows, cols, &full, err)) return DS_ERR;
    ds_mat part = ds_mat_rows(&full, r0, nr);
    if (ds_quant_wants(m, name, full.dtype)) {
        if (ds_quant_ptpc(m, &part, c0, nc, out, err)) return DS_ERR;
    } else if (nc == cols) {
        *out = part;
    } else {
        size_t es = ds_dtype_size(full.dtype), row = (size_t)nc * es;
        char *p = ds_aligned_alloc((size_t)nr * row, err);
        if (!p || ds_model_own(m, p, err)) {
            free(p);
            return DS_ERR;
        }
        for (int r = 0; r < nr; r++)
            memcpy(p + (size_t)r * row, (const char *)part.data + ((size_t)r * cols + c0) * es,
                   row);
        *out = (ds_mat){p, full.dtype, nr, nc, NULL};
    }
    m->weight_bytes += held_bytes(out);
    return DS_OK;
}

/* The whole matrix [rows][cols]. */
static int bind_mat(ds_model *m, const char *name, int rows, int cols, ds_mat *out, ds_err *err) {
    return bind_slice(m, name, rows, cols, 0, rows, 0, cols, out, err);
}

/* Rows [r0, r0+nr) (column-parallel split). */
static int bind_mat_rows(ds_model *m, const char *name, int rows, int cols, int r0, int nr,
                         ds_mat *out, ds_err *err) {
    return bind_slice(m, name, rows, cols, r0, nr, 0, cols, out, err);
}

/* Columns [c0, c0+nc) (row-parallel split). */
static int bind_mat_cols(ds_model *m, const char *name, int rows, int cols, int c0, int nc,
                         ds_mat *out, ds_err *err) {
    return bind_slice(m, name, rows, cols, 0, rows, c0, nc, out, err);
}

/* Keeps elements [off, off+n) of a vector bound by bind_vec, moved to its start (the buffer stays
 * owned by the model; its tail is unused). */
static void keep_slice(float *v, size_t off, size_t n) {
    if (off) memmove(v, v + off, n * sizeof(float));
}

/* Reads a small float tensor of the given shape into a new f32 vector owned by the model. */
static int bind_vec(ds_model *m, const char *name, int ndim, const int64_t *shape, float **out,
                    ds_err *err) {
    if (m->random) {
        size_t n = 1;
        for (int i = 0; i < ndim; i++) n *= (size_t)shape[i];
        return rand_vec(m, name, n, out, err);
    }
    const ds_tensor *t;
    if (ds_st_get(m->st, name, FLOAT_TYPES, ndim, shape, &t, err)) return DS_ERR;
    float *v = ds_malloc((size_t)t->numel * sizeof(float), err);
    if (!v || ds_model_own(m, v, err)) {
        free(v);
        return DS_ERR;
    }
    if (ds_tensor_to_f32(t, v, err)) return DS_ERR;
    m->weight_bytes += t->nbytes;
    m->vec_floats += (size_t)t->numel;
    *out = v;
    return DS_OK;
}

static int bind_vec1(ds_model *m, const char *name, int n, float **out, ds_err *err) {
    int64_t shape[1] = {n};
    return bind_vec(m, name, 1, shape, out, err);
}

/* AttnRes: the norm weight and the [1, D] projection fold into one vector (docs/model.md §6.2). */
static int bind_res_pair(ds_model *m, const char *norm, const char *proj, float **out,
                         ds_err *err) {
    int D = m->cfg.hidden_size;
    float *n, *p;
    int64_t pshape[2] = {1, D};
    if (bind_vec1(m, norm, D, &n, err) || bind_vec(m, proj, 2, pshape, &p, err)) return DS_ERR;
    for (int d = 0; d < D; d++) n[d] *= p[d];
    m->vec_floats -= (size_t)D; /* the two are one vector from here on */
    *out = n;
    return DS_OK;
}

#define NAME(buf, ...) snprintf(buf, sizeof buf, __VA_ARGS__)

/* KDA under tensor parallelism: this rank keeps heads [r*Hl, (r+1)*Hl), i.e. channels
 * [r*Pl, (r+1)*Pl) of every per-channel tensor (projections, convs, gates, dt_bias) and columns of
 * o_proj; the low-rank inputs f_a / g_a and o_norm (per head-dim) are replicated. */
static int bind_kda(ds_model *m, const char *pre, kda_w *w, ds_err *err) {
    const ds_config *c = &m->cfg;
    int D = c->hidden_size, H = c->kda_num_heads, dk = c->kda_head_dim, P = H * dk;
    int W = c->short_conv_kernel_size;
    int Hl = m->Hk, Pl = Hl * dk, p0 = m->tp_rank * Pl;
    char n[512];
    if (NAME(n, "%sq_proj.weight", pre), bind_mat_rows(m, n, P, D, p0, Pl, &w->q, err))
        return DS_ERR;
    if (NAME(n, "%sk_proj.weight", pre), bind_mat_rows(m, n, P, D, p0, Pl, &w->k, err))
        return DS_ERR;
    if (NAME(n, "%sv_proj.weight", pre), bind_mat_rows(m, n, P, D, p0, Pl, &w->v, err))
        return DS_ERR;
    int64_t conv_shape[3] = {P, 1, W};
    if (NAME(n, "%sq_conv1d.weight", pre), bind_vec(m, n, 3, conv_shape, &w->q_conv, err))
        return DS_ERR;
    if (NAME(n, "%sk_conv1d.weight", pre), bind_vec(m, n, 3, conv_shape, &w->k_conv, err))
        return DS_ERR;
    if (NAME(n, "%sv_conv1d.weight", pre), bind_vec(m, n, 3, conv_shape, &w->v_conv, err))
        return DS_ERR;
    keep_slice(w->q_conv, (size_t)p0 * W, (size_t)Pl * W);
    keep_slice(w->k_conv, (size_t)p0 * W, (size_t)Pl * W);
    keep_slice(w->v_conv, (size_t)p0 * W, (size_t)Pl * W);
    if (NAME(n, "%sf_a_proj.weight", pre), bind_mat(m, n, dk, D, &w->f_a, err)) return DS_ERR;
    if (NAME(n, "%sf_b_proj.weight", pre), bind_mat_rows(m, n, P, dk, p0, Pl, &w->f_b, err))
        return DS_ERR;
    if (NAME(n, "%sdt_bias", pre), bind_vec1(m, n, P, &w->dt_bias, err)) return DS_ERR;
    keep_slice(w->dt_bias, (size_t)p0, (size_t)Pl);
    /* A_log ships as [1,1,Hk,1] (Kimi-Linear) or [>=Hk] padded with zeros (K3): take the first
     * Hk entries of the flattened tensor (docs/model.md §10 trap 3). */
    NAME(n, "%sA_log", pre);
    if (m->random) {
        if (rand_vec(m, n, (size_t)H, &w->A_log, err)) return DS_ERR;
        keep_slice(w->A_log, (size_t)m->tp_rank * Hl, (size_t)Hl);
        goto after_alog;
    }
    const ds_tensor *t = ds_st_find(m->st, n);
    if (!t) return ds_errf(err, "checkpoint: missing tensor '%s'", n);
    if (t->numel < H)
        return ds_errf(err,
                       "%s: tensor '%s': expected at least %d elements (one per KDA head), "
                       "found %lld",
                       t->file, n, H, (long long)t->numel);
    int64_t alog_shape[DS_MAX_DIMS];
    for (int i = 0; i < t->ndim; i++) alog_shape[i] = t->shape[i];
    if (bind_vec(m, n, t->ndim, alog_shape, &w->A_log, err)) return DS_ERR;
    keep_slice(w->A_log, (size_t)m->tp_rank * Hl, (size_t)Hl);
after_alog:
    if (NAME(n, "%sb_proj.weight", pre), bind_mat_rows(m, n, H, D, m->tp_rank * Hl, Hl, &w->b, err))
        return DS_ERR;
    if (c->use_full_rank_gate) {
        if (NAME(n, "%sg_proj.weight", pre), bind_mat_rows(m, n, P, D, p0, Pl, &w->g, err))
            return DS_ERR;
    } else {
        if (NAME(n, "%sg_a_proj.weight", pre), bind_mat(m, n, dk, D, &w->g_a, err)) return DS_ERR;
        if (NAME(n, "%sg_b_proj.weight", pre), bind_mat_rows(m, n, P, dk, p0, Pl, &w->g_b, err))
            return DS_ERR;
    }
    if (NAME(n, "%so_norm.weight", pre), bind_vec1(m, n, dk, &w->o_norm, err)) return DS_ERR;
    if (NAME(n, "%so_proj.weight", pre), bind_mat_cols(m, n, D, P, p0, Pl, &w->o, err))
        return DS_ERR;
    return DS_OK;
}

/* MLA under tensor parallelism: this rank keeps heads [r*Hl, (r+1)*Hl) of q / q_b, kv_b, the
 * output gate (rows) and o_proj (columns). q_a and kv_a are replicated: the latent row is shared by
 * all heads, so every rank computes and caches all of it. */
static int bind_mla(ds_model *m, const char *pre, mla_w *w, ds_err *err) {
    const ds_config *c = &m->cfg;
    int D = c->hidden_size, Ha = c->num_attention_heads, R = c->kv_lora_rank;
    int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dvh = c->v_head_dim;
    int Hl = m->Ha, h0 = m->tp_rank * Hl, dq = dn + dr;
    char n[512];
    if (c->q_lora_rank) {
        if (NAME(n, "%sq_a_proj.weight", pre), bind_mat(m, n, c->q_lora_rank, D, &w->q_a, err))
            return DS_ERR;
        if (NAME(n, "%sq_a_layernorm.weight", pre),
            bind_vec1(m, n, c->q_lora_rank, &w->q_a_norm, err))
            return DS_ERR;
        if (NAME(n, "%sq_b_proj.weight", pre),
            bind_mat_rows(m, n, Ha * dq, c->q_lora_rank, h0 * dq, Hl * dq, &w->q_b, err))
            return DS_ERR;
    } else {
        if (NAME(n, "%sq_proj.weight", pre),
            bind_mat_rows(m, n, Ha * dq, D, h0 * dq, Hl * dq, &w->q, err))
            return DS_ERR;
    }
    if (NAME(n, "%skv_a_proj_with_mqa.weight", pre), bind_mat(m, n, R + dr, D, &w->kv_a, err))
        return DS_ERR;
    if (NAME(n, "%skv_a_layernorm.weight", pre), bind_vec1(m, n, R, &w->kv_a_norm, err))
        return DS_ERR;
    if (NAME(n, "%skv_b_proj.weight", pre),
        bind_mat_rows(m, n, Ha * (dn + dvh), R, h0 * (dn + dvh), Hl * (dn + dvh), &w->kv_b, err))
        return DS_ERR;
    if (NAME(n, "%so_proj.weight", pre),
        bind_mat_cols(m, n, D, Ha * dvh, h0 * dvh, Hl * dvh, &w->o, err))
        return DS_ERR;
    if (c->mla_use_output_gate) {
        if (NAME(n, "%sg_proj.weight", pre),
            bind_mat_rows(m, n, Ha * dvh, D, h0 * dvh, Hl * dvh, &w->g, err))
            return DS_ERR;
    }
    return DS_OK;
}

/* A routed expert's matrix base.{weight | weight_packed + weight_scale}: MXFP4 as published when
 * the config says so and the checkpoint packs it (compressed-tensors may leave an expert BF16),
 * else the float weight. */
static int bind_expert(ds_model *m, const char *base, int rows, int cols, ds_mat *out,
                       ds_err *err) {
    char n[512];
    if (m->random && m->cfg.mxfp4_experts) {
        NAME(n, "%s.weight_packed", base);
        return ds_quant_rand_mxfp4(m, name_hash(n) ^ m->opts.random_seed, rows, cols, out, err);
    }
    if (!m->random) {
        if (m->cfg.mxfp4_experts) {
            if (ds_quant_bind_mxfp4(m, base, rows, cols, out, err)) return DS_ERR;
            if (out->data) return DS_OK;
        } else if (NAME(n, "%s.weight_packed", base), ds_st_find(m->st, n)) {
            return ds_errf(err,
                           "tensor '%s' is packed, but config.json has no quantization_config "
                           "saying how (MXFP4 checkpoints state compressed-tensors "
                           "mxfp4-pack-quantized)",
                           n);
        }
    }
    NAME(n, "%s.weight", base);
    return bind_mat(m, n, rows, cols, out, err);
}

static int bind_ffn(ds_model *m, const char *pre, int layer, ffn_w *w, ds_err *err) {
    const ds_config *c = &m->cfg;
    int D = c->hidden_size;
    char n[512];
    w->is_moe = ds_config_layer_is_moe(c, layer);
    if (!w->is_moe) { /* gate/up column-parallel, down row-parallel */
        int I = c->intermediate_size, Il = m->I_dense, i0 = m->tp_rank * Il;
        /* the published checkpoints say mlp.*; transformers' save_pretrained writes the dense
         * layer under block_sparse_moe.* */
        const char *mlp = "mlp";
        if (!m->random && (NAME(n, "%smlp.gate_proj.weight", pre), !ds_st_find(m->st, n)) &&
            (NAME(n, "%sblock_sparse_moe.gate_proj.weight", pre), ds_st_find(m->st, n)))
            mlp = "block_sparse_moe";
        if (NAME(n, "%s%s.gate_proj.weight", pre, mlp),
            bind_mat_rows(m, n, I, D, i0, Il, &w->gate, err))
            return DS_ERR;
        if (NAME(n, "%s%s.up_proj.weight", pre, mlp),
            bind_mat_rows(m, n, I, D, i0, Il, &w->up, err))
            return DS_ERR;
        if (NAME(n, "%s%s.down_proj.weight", pre, mlp),
            bind_mat_cols(m, n, D, I, i0, Il, &w->down, err))
            return DS_ERR;
        return DS_OK;
    }
    int E = c->num_experts, Ie = c->moe_intermediate_size;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : D;
    if (NAME(n, "%sblock_sparse_moe.gate.weight", pre), bind_mat(m, n, E, D, &w->router, err))
        return DS_ERR;
    NAME(n, "%sblock_sparse_moe.gate.e_score_correction_bias", pre);
    w->router_bias = NULL;
    if (!m->random && ds_st_find(m->st, n) && bind_vec1(m, n, E, &w->router_bias, err))
        return DS_ERR;
    w->w1 = ds_calloc((size_t)E * 3, sizeof(ds_mat), err);
    if (!w->w1 || ds_model_own(m, w->w1, err)) return DS_ERR;
    w->w3 = w->w1 + E;
    w->w2 = w->w1 + 2 * E;
    /* Experts are split whole across TP ranks (block [e0, e1) here); the others stay unbound. */
    for (int e = m->e0; e < m->e1; e++) {
        if (NAME(n, "%sblock_sparse_moe.experts.%d.w1", pre, e),
            bind_expert(m, n, Ie, Hin, &w->w1[e], err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.experts.%d.w3", pre, e),
            bind_expert(m, n, Ie, Hin, &w->w3[e], err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.experts.%d.w2", pre, e),
            bind_expert(m, n, Hin, Ie, &w->w2[e], err))
            return DS_ERR;
    }
    if (c->num_shared_experts > 0) { /* split like the dense MLP */
        int Is = Ie * c->num_shared_experts, Il = m->I_sh, i0 = m->tp_rank * Il;
        if (NAME(n, "%sblock_sparse_moe.shared_experts.gate_proj.weight", pre),
            bind_mat_rows(m, n, Is, D, i0, Il, &w->sh_gate, err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.shared_experts.up_proj.weight", pre),
            bind_mat_rows(m, n, Is, D, i0, Il, &w->sh_up, err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.shared_experts.down_proj.weight", pre),
            bind_mat_cols(m, n, D, Is, i0, Il, &w->sh_down, err))
            return DS_ERR;
    }
    if (c->routed_expert_hidden_size) {
        int Dl = c->routed_expert_hidden_size;
        if (NAME(n, "%sblock_sparse_moe.routed_expert_down_proj.weight", pre),
            bind_mat(m, n, Dl, D, &w->lat_down, err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.routed_expert_up_proj.weight", pre),
            bind_mat(m, n, D, Dl, &w->lat_up, err))
            return DS_ERR;
        if (c->latent_moe_use_norm) {
            if (NAME(n, "%sblock_sparse_moe.routed_expert_norm.weight", pre),
                bind_vec1(m, n, Dl, &w->lat_norm, err))
                return DS_ERR;
        }
    }
    return DS_OK;
}

/* The layer range and this rank's tensor-parallel share of every split dimension. */
static int plan_shares(ds_model *m, ds_err *err) {
    const ds_config *c = &m->cfg;
    int V = c->vocab_size, L = c->num_hidden_layers;
    m->l0 = m->opts.layer_begin;
    m->l1 = m->opts.layer_end ? m->opts.layer_end : L;
    if (m->l0 < 0 || m->l1 > L || m->l0 >= m->l1)
        return ds_errf(err, "layer range [%d, %d) is not inside the model's %d layers", m->l0,
                       m->l1, L);
    m->tp_rank = m->opts.tp_rank;
    m->tp_size = m->opts.tp_size > 0 ? m->opts.tp_size : 1;
    if (m->tp_rank < 0 || m->tp_rank >= m->tp_size)
        return ds_errf(err, "tensor parallel rank %d is outside [0, %d)", m->tp_rank, m->tp_size);
    if (m->tp_size > 1 && (!m->opts.allreduce || !m->opts.allgather))
        return ds_errf(err, "tensor parallel size %d needs an all-reduce and an all-gather",
                       m->tp_size);
    if (ds_model_tp_check(c, m->tp_size, err)) return DS_ERR;
    m->Hk = c->kda_num_heads / m->tp_size;
    m->Ha = c->num_attention_heads / m->tp_size;
    m->I_dense = c->intermediate_size / m->tp_size;
    m->I_sh = c->moe_intermediate_size * c->num_shared_experts / m->tp_size;
    m->e0 = m->tp_rank * (c->num_experts / m->tp_size);
    m->e1 = m->e0 + c->num_experts / m->tp_size;
    m->vp = (V + m->tp_size - 1) / m->tp_size;
    m->v0 = DS_MIN(V, m->tp_rank * m->vp);
    m->nv = DS_MIN(V, m->v0 + m->vp) - m->v0;
    return DS_OK;
}

/* The embedding lives on the first stage, the final mix, norm and lm_head on the last, each rank
 * holding its block of vocabulary rows; a tied lm_head is the embedding, so the last stage binds
 * it too. The full lm_head is also bound as a view (mapped, touched only if the DSpark draft on
 * this rank reads it). */
static int bind_ends(ds_model *m, ds_err *err) {
    const ds_config *c = &m->cfg;
    int D = c->hidden_size, V = c->vocab_size;
    int first = m->l0 == 0, last = m->l1 == c->num_hidden_layers;
    const char *wp = c->weight_prefix;
    char n[512];
    const char *head = c->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    if ((first || (last && c->tie_word_embeddings)) &&
        (NAME(n, "%smodel.embed_tokens.weight", wp),
         bind_mat_rows(m, n, V, D, m->v0, m->nv, &m->embed, err)))
        return DS_ERR;
    if (last && c->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else if (last && (NAME(n, "%slm_head.weight", wp),
                        bind_mat_rows(m, n, V, D, m->v0, m->nv, &m->lm_head, err))) {
        return DS_ERR;
    }
    if (last && m->random && m->tp_size == 1) {
        m->lm_head_full = m->lm_head; /* drawing it twice would only double the memory */
    } else if (last) {
        size_t counted = m->weight_bytes;
        if (NAME(n, "%s%s", wp, head), bind_mat(m, n, V, D, &m->lm_head_full, err)) return DS_ERR;
        m->weight_bytes = counted;
    }
    if (last && (NAME(n, "%smodel.norm.weight", wp), bind_vec1(m, n, D, &m->final_norm, err)))
        return DS_ERR;
    if (last && c->attn_res_block_size > 0) {
        char n2[512];
        NAME(n, "%smodel.output_attn_res_norm.weight", wp);
        NAME(n2, "%smodel.output_attn_res_proj.weight", wp);
        if (bind_res_pair(m, n, n2, &m->out_res_np, err)) return DS_ERR;
    }
    return DS_OK;
}

/* The layers of this stage, [l0, l1); counts its KDA and MLA layers. */
static int bind_layers(ds_model *m, ds_err *err) {
    const ds_config *c = &m->cfg;
    int D = c->hidden_size;
    const char *wp = c->weight_prefix;
    char n[512];
    m->layers = ds_calloc((size_t)c->num_hidden_layers, sizeof(layer_w), err);
    if (!m->layers) return DS_ERR;
    int n_kda = 0, n_mla = 0;
    for (int i = m->l0; i < m->l1; i++) {
        layer_w *lw = &m->layers[i];
        char pre[256], apre[300];
        snprintf(pre, sizeof pre, "%smodel.layers.%d.", wp, i);
        snprintf(apre, sizeof apre, "%sself_attn.", pre);
        lw->kind = c->layer_kind[i];
        if (NAME(n, "%sinput_layernorm.weight", pre), bind_vec1(m, n, D, &lw->in_norm, err))
            return DS_ERR;
        if (NAME(n, "%spost_attention_layernorm.weight", pre),
            bind_vec1(m, n, D, &lw->post_norm, err))
            return DS_ERR;
        if (c->attn_res_block_size > 0) {
            char n2[512];
            NAME(n, "%sself_attention_res_norm.weight", pre);
            NAME(n2, "%sself_attention_res_proj.weight", pre);
            if (bind_res_pair(m, n, n2, &lw->attn_res_np, err)) return DS_ERR;
            NAME(n, "%smlp_res_norm.weight", pre);
            NAME(n2, "%smlp_res_proj.weight", pre);
            if (bind_res_pair(m, n, n2, &lw->mlp_res_np, err)) return DS_ERR;
        }
        if (lw->kind == DS_LAYER_KDA) {
            lw->kind_idx = n_kda++;
            if (bind_kda(m, apre, &lw->kda, err)) return DS_ERR;
        } else {
            lw->kind_idx = n_mla++;
            if (bind_mla(m, apre, &lw->mla, err)) return DS_ERR;
        }
        if (bind_ffn(m, pre, i, &lw->ffn, err)) return DS_ERR;
    }
    m->n_kda = n_kda;
    m->n_mla = n_mla;
    return DS_OK;
}

int ds_model_load(const char *dir, const ds_model_opts *opts, ds_model **out, ds_err *err) {
    *out = NULL;
    ds_kernels_init();
    ds_model *m = ds_calloc(1, sizeof *m, err);
    if (!m) return DS_ERR;
    if (opts)
        m->opts = *opts;
    else
        ds_model_opts_default(&m->opts);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (ds_config_load(path, &m->cfg, err)) goto fail;
    m->random = m->opts.load_random;
    if (ds_quant_check_opts(&m->opts, err)) goto fail;
    if (m->opts.quantization_exclude) { /* the caller's string need not outlive the load */
        size_t len = strlen(m->opts.quantization_exclude) + 1;
        char *x = ds_malloc(len, err);
        if (x) memcpy(x, m->opts.quantization_exclude, len);
        if (!x || ds_model_own(m, x, err)) {
            free(x);
            goto fail;
        }
        m->opts.quantization_exclude = x;
    }
    if (!m->random && ds_st_open_dir(dir, &m->st, err)) goto fail;
    /* the backend first, chosen once: random weights are made where they will live */
    int dev = m->opts.device;
    if (dev != DS_DEVICE_CPU && dev != DS_DEVICE_CUDA && dev != DS_DEVICE_AUTO) {
        ds_errf(err, "device %d: expected cpu, cuda or auto (DS_DEVICE=%s)", dev,
                getenv("DS_DEVICE") ? getenv("DS_DEVICE") : "");
        goto fail;
    }
    if (!(m->be = ds_backend_find(dev, err)) || plan_shares(m, err) || bind_ends(m, err) ||
        bind_layers(m, err) || m->be->attach(m, m->opts.device_index, err))
        goto fail;
    *out = m;
    return DS_OK;
fail:
    ds_err_prefix(err, "loading model from %s", dir);
    ds_model_free(m);
    return DS_ERR;
}

void ds_model_free(ds_model *m) {
    if (!m) return;
    if (m->be) m->be->detach(m);
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    if (m->st) ds_st_close(m->st);
    free(m);
}

static double mat_elems(const ds_mat *w) {
    return w->data ? (double)w->rows * (double)w->cols : 0.0;
}
static double mat_bytes(const ds_mat *w) {
    return w->data ? (double)w->rows * (double)(ds_mat_row_bytes(w) + ds_mat_scale_row_bytes(w))
                   : 0.0;
}

/* Weights one token passes through in the layers (k of E experts), as elements and bytes. */
static void layer_traffic(const ds_model *m, double *elems, double *bytes) {
    const ds_config *c = &m->cfg;
    *elems = *bytes = 0;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        const layer_w *lw = &m->layers[i];
        const kda_w *k = &lw->kda;
        const mla_w *a = &lw->mla;
        const ffn_w *f = &lw->ffn;
        const ds_mat *mats[] = {
            &k->q,       &k->k,     &k->v,       &k->f_a,      &k->f_b,   &k->b,    &k->g,
            &k->g_a,     &k->g_b,   &k->o,       &a->q,        &a->q_a,   &a->q_b,  &a->kv_a,
            &a->kv_b,    &a->o,     &a->g,       &f->gate,     &f->up,    &f->down, &f->router,
            &f->sh_gate, &f->sh_up, &f->sh_down, &f->lat_down, &f->lat_up};
        for (size_t j = 0; j < DS_ARRAY_LEN(mats); j++) {
            *elems += mat_elems(mats[j]);
            *bytes += mat_bytes(mats[j]);
        }
        if (f->is_moe) {
            /* experts are the same shape: one token reads k of them, on average k * (share of
             * the experts held here) on this rank */
            int e0 = m->e0;
            double k = c->num_experts_per_token * (double)(m->e1 - m->e0) / c->num_experts;
            double e = mat_elems(&f->w1[e0]) + mat_elems(&f->w3[e0]) + mat_elems(&f->w2[e0]);
            double b = mat_bytes(&f->w1[e0]) + mat_bytes(&f->w3[e0]) + mat_bytes(&f->w2[e0]);
            *elems += e * k;
            *bytes += b * k;
        }
    }
}

double ds_model_decode_bytes(const ds_model *m) {
    double e, b;
    layer_traffic(m, &e, &b);
    return b + mat_bytes(&m->lm_head) + (double)m->cfg.hidden_size * ds_dtype_size(m->embed.dtype);
}

double ds_model_decode_state_bytes(const ds_model *m, int context) {
    /* the f32 vectors, one sequence's KDA state (conv tails and recurrent state, read and then
     * written: counted once), and its MLA latent rows at this context (as stored) */
    double floats = (double)m->vec_floats + (double)ds_model_slot_floats(m);
    return floats * sizeof(float) + (double)m->n_mla * (double)(context > 0 ? context : 0) *
                                        (double)ds_model_latent_row_bytes(m);
}

double ds_model_token_flops(const ds_model *m, int with_lm_head) {
    double e, b;
    layer_traffic(m, &e, &b);
    return 2.0 * (e + (with_lm_head ? mat_elems(&m->lm_head) : 0.0));
}

/* ---- per-sequence state -----------------------------------------------------------------------
 */

size_t ds_model_slot_floats(const ds_model *m) {
    return (size_t)m->n_kda * (ds_model_conv_floats(m) + ds_model_rec_floats(m));
}

int ds_model_latent_row(const ds_model *m) {
    return m->cfg.kv_lora_rank + m->cfg.qk_rope_head_dim;
}

size_t ds_model_latent_row_bytes(const ds_model *m) {
    return ds_kv_row_bytes(m->opts.kv_dtype, m->cfg.kv_lora_rank, m->cfg.qk_rope_head_dim);
}

int ds_model_kv_dtype(const ds_model *m) {
    return m->opts.kv_dtype;
}

int ds_kv_pool_layers(const ds_model *m) {
    return m->n_mla;
}

int ds_kv_pool_init(ds_kv_pool *p, const ds_model *m, int n_pages, int block_size, ds_err *err) {
    memset(p, 0, sizeof *p);
    p->dm = ds_model_dmem(m);
    p->n_layers = m->n_mla;
    p->n_pages = n_pages;
    p->block_size = block_size;
    p->row = ds_model_latent_row(m);
    p->row_bytes = ds_model_latent_row_bytes(m);
    p->kv_dtype = ds_model_kv_dtype(m);
    p->layer = ds_calloc((size_t)(p->n_layers ? p->n_layers : 1), sizeof(uint8_t *), err);
    if (!p->layer) return DS_ERR;
    for (int j = 0; j < p->n_layers; j++) {
        /* calloc: large pools come straight from mmap, so untouched pages cost no memory */
        size_t bytes = (size_t)n_pages * block_size * p->row_bytes;
        const int dev = ds_dmem_on_device(p->dm);
        p->layer[j] = dev ? ds_dmem_alloc(p->dm, bytes, err)
                          : ds_calloc((size_t)n_pages * block_size, p->row_bytes, err);
        if (p->layer[j] && dev) ds_dmem_zero(p->dm, p->layer[j], bytes);
        if (!p->layer[j]) {
            ds_kv_pool_free(p);
            return DS_ERR;
        }
    }
    return DS_OK;
}

void ds_kv_pool_free(ds_kv_pool *p) {
    if (p->layer)
        for (int j = 0; j < p->n_layers; j++) ds_dmem_free(p->dm, p->layer[j]);
    free(p->layer);
    memset(p, 0, sizeof *p);
}

int ds_model_forward(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq, ds_err *err) {
    return ds_model_forward_stage(m, pool, seqs, n_seq, NULL, NULL, err);
}

int ds_model_first_layer(const ds_model *m) {
    return m->l0;
}
int ds_model_end_layer(const ds_model *m) {
    return m->l1;
}
int ds_model_max_banks(const ds_model *m) {
    int L = m->cfg.num_hidden_layers, N = m->cfg.attn_res_block_size;
    return N > 0 ? (L + N - 1) / N + 1 : 0;
}

/* ---- the step: its inputs checked, its plan made, then the backend ---------------------------
 */

/* Segment q's inputs, as model.h promises them to the backends. */
static int check_segment(const ds_model *m, const ds_seq_batch *sb, int q, ds_err *err) {
    if (sb->n <= 0 || sb->pos0 < 0 || sb->n_logits < 0 || sb->n_logits > sb->n)
        return ds_errf(err, "forward: segment %d has n=%d pos0=%d n_logits=%d", q, sb->n, sb->pos0,
                       sb->n_logits);
    for (int t = 0; t < sb->n; t++)
        if (sb->tokens[t] < 0 || sb->tokens[t] >= m->cfg.vocab_size)
            return ds_errf(err, "forward: token id %d at index %d is outside [0, %d)",
                           sb->tokens[t], t, m->cfg.vocab_size);
    return DS_OK;
}

int ds_model_forward_stage(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
                           const ds_stage_io *in, ds_stage_io *out, ds_err *err) {
    if ((m->l0 > 0 && !in) || (m->l1 < m->cfg.num_hidden_layers && !out))
        return ds_errf(err, "forward: stage [%d, %d) needs its %s tensors", m->l0, m->l1,
                       m->l0 > 0 && !in ? "incoming" : "outgoing");
    if (in && in->n_banks > ds_model_max_banks(m))
        return ds_errf(err, "forward: %d banked AttnRes blocks arrived, at most %d exist",
                       in->n_banks, ds_model_max_banks(m));
    const size_t n = (size_t)(n_seq ? n_seq : 1);
    int *off = ds_malloc(n * sizeof(int) + 2 * n, err); /* off [n], then the two flags [n] each */
    if (!off) return DS_ERR;
    uint8_t *expanded = (uint8_t *)(off + n), *chunked = expanded + n;
    ds_step_plan plan = {0, off, expanded, chunked, 0};
    const int last = m->l1 == m->cfg.num_hidden_layers;
    for (int q = 0; q < n_seq; q++) {
        const ds_seq_batch *sb = &seqs[q];
        if (check_segment(m, sb, q, err)) {
            free(off);
            return DS_ERR;
        }
        off[q] = plan.T;
        plan.T += sb->n;
        /* the two forms every backend chooses between (model/backend.h) */
        expanded[q] = m->n_mla > 0 && sb->n >= m->opts.mla_expanded_min;
        chunked[q] = m->n_kda > 0 && sb->n >= m->opts.kda_chunked_min && !sb->state_rows;
        plan.draws |= last && sb->draws && sb->argmax && sb->n_logits;
    }
    int rc = plan.T ? m->be->forward(m, &plan, pool, seqs, n_seq, in, out, err) : DS_OK;
    free(off);
    return rc;
}
