/* model.c — weight binding and the forward pass (MODEL_SPEC §2–§7).
 *
 * Data flow of one step, top to bottom:
 *   embed -> for each layer: [AttnRes mix] -> RMSNorm -> KDA | MLA -> [AttnRes mix] -> RMSNorm ->
 *   dense MLP | MoE -> ... -> [output AttnRes mix] -> final RMSNorm -> lm_head.
 * All tokens of the step go through each weight in one GEMM; per-sequence work (conv tails, the
 * KDA recurrence, MLA attention over the paged latent cache) runs segment by segment. */
#include "model/model_impl.h"
#include "kernels/shared/rand_hash.h"

#include "base/devmem.h"

#include <math.h>
#include <omp.h>
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
    return m->cu != NULL;
}
size_t ds_model_device_mem_free(const ds_model *m) {
    return m->cu ? ds_cuda_model_mem_free(m) : 0;
}
const char *ds_model_device_name(const ds_model *m) {
    static char cpu[64];
    if (m->cu) return ds_cuda_model_device_name(m);
    snprintf(cpu, sizeof cpu, "cpu (%s)", ds_isa_name(ds_kernels_isa()));
    return cpu;
}
void ds_model_profile_report(const ds_model *m, FILE *f, const char *title) {
    if (m->cu) ds_cuda_model_profile_report(m, f, title);
}
double ds_model_profile_gemm_tflops(const ds_model *m, double *ms_per_step) {
    *ms_per_step = 0;
    return m->cu ? ds_cuda_model_profile_gemm_tflops(m, ms_per_step) : 0;
}
int ds_model_device_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    if (!m->cu) return ds_errf(err, "device limits: the model runs on the CPU");
    return ds_cuda_model_limits(m, copy_gbs, gemm_tflops, err);
}
size_t ds_model_weight_bytes(const ds_model *m) {
    return m->weight_bytes;
}

static int own(ds_model *m, void *p, ds_err *err) {
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
    *out = (ds_mat){NULL, DS_DT_BF16, rows, cols};
    m->weight_bytes += n * 2;
    if (m->dev == DS_DEVICE_CUDA) { /* filled on the device */
        ds_rand_mat *d = ds_malloc(sizeof *d, err);
        if (!d || own(m, d, err)) {
            free(d);
            return DS_ERR;
        }
        *d = (ds_rand_mat){DS_RAND_MAGIC, m, key, r0, c0, full_cols, a};
        out->data = d;
        return DS_OK;
    }
    uint16_t *p = ds_aligned_alloc(n * 2 + 2, err);
    if (!p || own(m, p, err)) {
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
    if (!m->random || m->dev != DS_DEVICE_CUDA || !w->data) return NULL;
    const ds_rand_mat *d = w->data;
    return d->magic == DS_RAND_MAGIC && d->owner == m ? d : NULL;
}

static int ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

static int rand_vec(ds_model *m, const char *name, size_t n, float **out, ds_err *err) {
    float *v = ds_malloc((n ? n : 1) * sizeof(float), err);
    if (!v || own(m, v, err)) {
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

/* Binds a matrix [rows][cols] in its file dtype. */
static int bind_mat(ds_model *m, const char *name, int rows, int cols, ds_mat *out, ds_err *err) {
    if (m->random) return rand_mat(m, name, rows, cols, 0, 0, cols, out, err);
    const ds_tensor *t;
    int64_t shape[2] = {rows, cols};
    if (ds_st_get(m->st, name, FLOAT_TYPES, 2, shape, &t, err)) return DS_ERR;
    out->data = t->data;
    out->dtype = t->dtype;
    out->rows = rows;
    out->cols = cols;
    m->weight_bytes += t->nbytes;
    return DS_OK;
}

/* Binds rows [r0, r0+nr) of the matrix [rows][cols] (column-parallel split): a view into the
 * mapped file, no copy. */
static int bind_mat_rows(ds_model *m, const char *name, int rows, int cols, int r0, int nr,
                         ds_mat *out, ds_err *err) {
    if (m->random) return rand_mat(m, name, nr, cols, r0, 0, cols, out, err);
    size_t before = m->weight_bytes;
    if (bind_mat(m, name, rows, cols, out, err)) return DS_ERR;
    if (nr == rows) return DS_OK;
    *out = ds_mat_rows(out, r0, nr);
    m->weight_bytes = before + (size_t)nr * (size_t)cols * ds_dtype_size(out->dtype);
    return DS_OK;
}

/* Binds columns [c0, c0+nc) of the matrix [rows][cols] (row-parallel split). A matrix has no row
 * stride, so the slice is copied, in its file dtype, into memory the model owns. */
static int bind_mat_cols(ds_model *m, const char *name, int rows, int cols, int c0, int nc,
                         ds_mat *out, ds_err *err) {
    if (m->random) return rand_mat(m, name, rows, nc, 0, c0, cols, out, err);
    size_t before = m->weight_bytes;
    ds_mat full;
    if (bind_mat(m, name, rows, cols, &full, err)) return DS_ERR;
    if (nc == cols) {
        *out = full;
        return DS_OK;
    }
    size_t es = ds_dtype_size(full.dtype), row = (size_t)nc * es;
    char *p = ds_aligned_alloc((size_t)rows * row, err);
    if (!p || own(m, p, err)) {
        free(p);
        return DS_ERR;
    }
    for (int r = 0; r < rows; r++)
        memcpy(p + (size_t)r * row, (const char *)full.data + ((size_t)r * cols + c0) * es, row);
    *out = full;
    out->data = p;
    out->cols = nc;
    m->weight_bytes = before + (size_t)rows * row;
    return DS_OK;
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
    if (!v || own(m, v, err)) {
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

/* AttnRes: the norm weight and the [1, D] projection fold into one vector (MODEL_SPEC §6.2). */
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
     * Hk entries of the flattened tensor (MODEL_SPEC §10 trap 3). */
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

static int bind_ffn(ds_model *m, const char *pre, int layer, ffn_w *w, ds_err *err) {
    const ds_config *c = &m->cfg;
    int D = c->hidden_size;
    char n[512];
    w->is_moe = ds_config_layer_is_moe(c, layer);
    if (!w->is_moe) { /* gate/up column-parallel, down row-parallel */
        int I = c->intermediate_size, Il = m->I_dense, i0 = m->tp_rank * Il;
        if (NAME(n, "%smlp.gate_proj.weight", pre),
            bind_mat_rows(m, n, I, D, i0, Il, &w->gate, err))
            return DS_ERR;
        if (NAME(n, "%smlp.up_proj.weight", pre), bind_mat_rows(m, n, I, D, i0, Il, &w->up, err))
            return DS_ERR;
        if (NAME(n, "%smlp.down_proj.weight", pre),
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
    if (!w->w1 || own(m, w->w1, err)) return DS_ERR;
    w->w3 = w->w1 + E;
    w->w2 = w->w1 + 2 * E;
    /* Experts are split whole across TP ranks (block [e0, e1) here); the others stay unbound. */
    for (int e = m->e0; e < m->e1; e++) {
        if (NAME(n, "%sblock_sparse_moe.experts.%d.w1.weight", pre, e),
            bind_mat(m, n, Ie, Hin, &w->w1[e], err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.experts.%d.w3.weight", pre, e),
            bind_mat(m, n, Ie, Hin, &w->w3[e], err))
            return DS_ERR;
        if (NAME(n, "%sblock_sparse_moe.experts.%d.w2.weight", pre, e),
            bind_mat(m, n, Hin, Ie, &w->w2[e], err))
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
    if (!m->random && ds_st_open_dir(dir, &m->st, err)) goto fail;
    /* the device first: random weights are made where they will live */
    m->dev = m->opts.device;
    if (m->dev == DS_DEVICE_AUTO) m->dev = ds_cuda_available() ? DS_DEVICE_CUDA : DS_DEVICE_CPU;
    if (m->dev != DS_DEVICE_CPU && m->dev != DS_DEVICE_CUDA) {
        ds_errf(err, "device %d: expected cpu, cuda or auto (DS_DEVICE=%s)", m->dev,
                getenv("DS_DEVICE") ? getenv("DS_DEVICE") : "");
        goto fail;
    }
    const ds_config *c = &m->cfg;
    int D = c->hidden_size, V = c->vocab_size, L = c->num_hidden_layers;
    const char *wp = c->weight_prefix;
    char n[512];
    m->l0 = m->opts.layer_begin;
    m->l1 = m->opts.layer_end ? m->opts.layer_end : L;
    if (m->l0 < 0 || m->l1 > L || m->l0 >= m->l1) {
        ds_errf(err, "layer range [%d, %d) is not inside the model's %d layers", m->l0, m->l1, L);
        goto fail;
    }
    m->tp_rank = m->opts.tp_rank;
    m->tp_size = m->opts.tp_size > 0 ? m->opts.tp_size : 1;
    if (m->tp_rank < 0 || m->tp_rank >= m->tp_size) {
        ds_errf(err, "tensor parallel rank %d is outside [0, %d)", m->tp_rank, m->tp_size);
        goto fail;
    }
    if (m->tp_size > 1 && (!m->opts.allreduce || !m->opts.allgather)) {
        ds_errf(err, "tensor parallel size %d needs an all-reduce and an all-gather", m->tp_size);
        goto fail;
    }
    if (ds_model_tp_check(c, m->tp_size, err)) goto fail;
    m->Hk = c->kda_num_heads / m->tp_size;
    m->Ha = c->num_attention_heads / m->tp_size;
    m->I_dense = c->intermediate_size / m->tp_size;
    m->I_sh = c->moe_intermediate_size * c->num_shared_experts / m->tp_size;
    m->e0 = m->tp_rank * (c->num_experts / m->tp_size);
    m->e1 = m->e0 + c->num_experts / m->tp_size;
    m->vp = (V + m->tp_size - 1) / m->tp_size;
    m->v0 = DS_MIN(V, m->tp_rank * m->vp);
    m->nv = DS_MIN(V, m->v0 + m->vp) - m->v0;
    int first = m->l0 == 0, last = m->l1 == L;
    /* The embedding lives on the first stage, the final mix, norm and lm_head on the last, each
     * rank holding its block of vocabulary rows; a tied lm_head is the embedding, so the last
     * stage binds it too. The full lm_head is also bound as a view (mapped, touched only if the
     * DSpark draft on this rank reads it). */
    const char *head = c->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight";
    if ((first || (last && c->tie_word_embeddings)) &&
        (NAME(n, "%smodel.embed_tokens.weight", wp),
         bind_mat_rows(m, n, V, D, m->v0, m->nv, &m->embed, err)))
        goto fail;
    if (last && c->tie_word_embeddings) {
        m->lm_head = m->embed;
    } else if (last && (NAME(n, "%slm_head.weight", wp),
                        bind_mat_rows(m, n, V, D, m->v0, m->nv, &m->lm_head, err))) {
        goto fail;
    }
    if (last && m->random && m->tp_size == 1) {
        m->lm_head_full = m->lm_head; /* drawing it twice would only double the memory */
    } else if (last) {
        size_t counted = m->weight_bytes;
        if (NAME(n, "%s%s", wp, head), bind_mat(m, n, V, D, &m->lm_head_full, err)) goto fail;
        m->weight_bytes = counted;
    }
    if (last && (NAME(n, "%smodel.norm.weight", wp), bind_vec1(m, n, D, &m->final_norm, err)))
        goto fail;
    if (last && c->attn_res_block_size > 0) {
        char n2[512];
        NAME(n, "%smodel.output_attn_res_norm.weight", wp);
        NAME(n2, "%smodel.output_attn_res_proj.weight", wp);
        if (bind_res_pair(m, n, n2, &m->out_res_np, err)) goto fail;
    }
    m->layers = ds_calloc((size_t)L, sizeof(layer_w), err);
    if (!m->layers) goto fail;
    int n_kda = 0, n_mla = 0;
    for (int i = m->l0; i < m->l1; i++) {
        layer_w *lw = &m->layers[i];
        char pre[256], apre[300];
        snprintf(pre, sizeof pre, "%smodel.layers.%d.", wp, i);
        snprintf(apre, sizeof apre, "%sself_attn.", pre);
        lw->kind = c->layer_kind[i];
        if (NAME(n, "%sinput_layernorm.weight", pre), bind_vec1(m, n, D, &lw->in_norm, err))
            goto fail;
        if (NAME(n, "%spost_attention_layernorm.weight", pre),
            bind_vec1(m, n, D, &lw->post_norm, err))
            goto fail;
        if (c->attn_res_block_size > 0) {
            char n2[512];
            NAME(n, "%sself_attention_res_norm.weight", pre);
            NAME(n2, "%sself_attention_res_proj.weight", pre);
            if (bind_res_pair(m, n, n2, &lw->attn_res_np, err)) goto fail;
            NAME(n, "%smlp_res_norm.weight", pre);
            NAME(n2, "%smlp_res_proj.weight", pre);
            if (bind_res_pair(m, n, n2, &lw->mlp_res_np, err)) goto fail;
        }
        if (lw->kind == DS_LAYER_KDA) {
            lw->kind_idx = n_kda++;
            if (bind_kda(m, apre, &lw->kda, err)) goto fail;
        } else {
            lw->kind_idx = n_mla++;
            if (bind_mla(m, apre, &lw->mla, err)) goto fail;
        }
        if (bind_ffn(m, pre, i, &lw->ffn, err)) goto fail;
    }
    m->n_kda = n_kda;
    m->n_mla = n_mla;
    if (m->dev == DS_DEVICE_CUDA && ds_cuda_model_attach(m, m->opts.device_index, err)) goto fail;
    *out = m;
    return DS_OK;
fail:
    ds_err_prefix(err, "loading model from %s", dir);
    ds_model_free(m);
    return DS_ERR;
}

void ds_model_free(ds_model *m) {
    if (!m) return;
    if (m->cu) ds_cuda_model_detach(m);
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    free(m->layers);
    free(m->scratch);
    free(m->draw_rows);
    for (int i = 0; i < m->n_draw_sc; i++) ds_sample_scratch_free(m->draw_sc[i]);
    free(m->draw_sc);
    if (m->st) ds_st_close(m->st);
    free(m);
}

static double mat_elems(const ds_mat *w) {
    return w->data ? (double)w->rows * (double)w->cols : 0.0;
}
static double mat_bytes(const ds_mat *w) {
    return mat_elems(w) * (double)ds_dtype_size(w->dtype);
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
     * written: counted once), and its MLA latent rows at this context (all f32) */
    double floats = (double)m->vec_floats + (double)ds_model_slot_floats(m) +
                    (double)m->n_mla * (double)(context > 0 ? context : 0) * ds_model_latent_row(m);
    return floats * sizeof(float);
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

int ds_kv_pool_layers(const ds_model *m) {
    return m->n_mla;
}

int ds_kv_pool_init(ds_kv_pool *p, const ds_model *m, int n_pages, int block_size, ds_err *err) {
    memset(p, 0, sizeof *p);
    p->on_device = m->cu != NULL;
    p->n_layers = m->n_mla;
    p->n_pages = n_pages;
    p->block_size = block_size;
    p->row = ds_model_latent_row(m);
    p->layer = ds_calloc((size_t)(p->n_layers ? p->n_layers : 1), sizeof(float *), err);
    if (!p->layer) return DS_ERR;
    for (int j = 0; j < p->n_layers; j++) {
        /* calloc: large pools come straight from mmap, so untouched pages cost no memory */
        size_t bytes = (size_t)n_pages * block_size * (size_t)p->row * sizeof(float);
        p->layer[j] = p->on_device ? ds_dmem_alloc(1, bytes, err)
                                   : ds_calloc((size_t)n_pages * block_size,
                                               (size_t)p->row * sizeof(float), err);
        if (p->layer[j] && p->on_device) ds_dmem_zero(1, p->layer[j], bytes);
        if (!p->layer[j]) {
            ds_kv_pool_free(p);
            return DS_ERR;
        }
    }
    return DS_OK;
}

void ds_kv_pool_free(ds_kv_pool *p) {
    if (p->layer)
        for (int j = 0; j < p->n_layers; j++) ds_dmem_free(p->on_device, p->layer[j]);
    free(p->layer);
    memset(p, 0, sizeof *p);
}

/* ---- scratch ----------------------------------------------------------------------------------
 */

/* A bump allocator over one growing buffer; reset at the start of every step. */
typedef struct scratch {
    ds_model *m;
    size_t used;
    int overflow;
    size_t need;
} scratch;

static float *sc_take(scratch *s, size_t n) {
    n = (n + 15) & ~(size_t)15; /* keep 64-byte alignment */
    s->need += n;
    if (s->overflow || s->used + n > s->m->scratch_cap) {
        s->overflow = 1;
        return NULL;
    }
    float *p = s->m->scratch + s->used;
    s->used += n;
    return p;
}

/* ---- the step ---------------------------------------------------------------------------------
 */

typedef struct step {
    ds_model *m;
    ds_kv_pool *pool;
    ds_seq_batch *seqs;
    int n_seq;
    int T;                 /* total tokens */
    int *off;              /* [n_seq] first row of each segment */
    const ds_stage_io *in; /* from the previous pipeline stage, or NULL on the first */
    ds_stage_io *out;      /* to the next stage, or NULL on the last */
    scratch sc;
    int tp_failed; /* an all-reduce failed during this step */
} step;

static float *slot_conv(const step *s, int q, int kda_idx) {
    return s->seqs[q].slot + (size_t)kda_idx * ds_model_conv_floats(s->m);
}
static float *slot_rec(const step *s, int q, int kda_idx) {
    return s->seqs[q].slot + (size_t)s->m->n_kda * ds_model_conv_floats(s->m) +
           (size_t)kda_idx * ds_model_rec_floats(s->m);
}

/* Sums a row-parallel partial output over the TP group (nothing to do on one rank). After a
 * failure the step still runs to its end — with wrong numbers — and then reports it: the comm is
 * broken and the caller ends the job. */
static void tp_sum(step *s, float *buf, size_t n) {
    const ds_model *m = s->m;
    if (m->tp_size == 1 || s->tp_failed) return;
    if (m->opts.allreduce(m->opts.allreduce_ctx, buf, n)) s->tp_failed = 1;
}

/* P[T][D] = the embedding rows of ids[T]. Vocabulary-parallel: each rank writes the rows of the
 * tokens in its block and zeros elsewhere, and the sum over the group is exact (one row's value
 * plus zeros), so every rank ends with the whole embedding, as one process has it. */
static void embed_tokens(step *s, const int32_t *ids, float *P) {
    const ds_model *m = s->m;
    int T = s->T, D = m->cfg.hidden_size;
    if (m->tp_size == 1) {
        ds_embed(P, &m->embed, ids, T);
        return;
    }
    for (int t = 0; t < T; t++) {
        int32_t id = ids[t] - m->v0;
        if (id >= 0 && id < m->nv)
            ds_embed(P + (size_t)t * D, &m->embed, &id, 1);
        else
            memset(P + (size_t)t * D, 0, (size_t)D * sizeof(float));
    }
    tp_sum(s, P, (size_t)T * D);
}

/* Rows of logits computed per lm_head matmul: the rows of every segment that asks for logits are
 * gathered, so one matmul streams the V x D weights once for up to LG_CHUNK tokens (one matmul per
 * sequence streamed all of them for every decode token: at V = 65536 that was most of a decode
 * step). The matmul gives each row the same bits whatever else is in its batch. */
enum { LG_CHUNK = 32 };

int ds_model_draw_space(ds_model *m, ds_err *err) {
    if (m->draw_sc) return DS_OK;
    int V = m->cfg.vocab_size, n = omp_get_max_threads();
    m->draw_rows = ds_malloc((size_t)DS_DRAW_CHUNK * V * sizeof(float), err);
    ds_sample_scratch **sc = m->draw_rows ? ds_calloc((size_t)n, sizeof *sc, err) : NULL;
    for (int i = 0; sc && i < n; i++)
        if (!(sc[i] = ds_sample_scratch_new(V, err))) {
            for (int j = 0; j < i; j++) ds_sample_scratch_free(sc[j]);
            free(sc);
            sc = NULL;
        }
    if (!sc) {
        free(m->draw_rows);
        m->draw_rows = NULL;
        return DS_ERR;
    }
    m->draw_sc = sc;
    m->n_draw_sc = n;
    return DS_OK;
}

void ds_model_draw_host(ds_model *m, const float *x, size_t stride, int vp, int n,
                        const ds_row_draw *const *d, int32_t *const *out) {
    int V = m->cfg.vocab_size;
    for (int j0 = 0; j0 < n; j0 += DS_DRAW_CHUNK) {
        int nc = DS_MIN(DS_DRAW_CHUNK, n - j0), nd = 0;
        for (int j = j0; j < j0 + nc; j++) {
            if (!d[j]) continue;
            nd++;
            float *row = m->draw_rows + (size_t)(j - j0) * V; /* the row whole, to be edited */
            for (int v0 = 0, t = 0; v0 < V; v0 += vp, t++)
                memcpy(row + v0, x + (size_t)t * stride + (size_t)j * vp,
                       (size_t)DS_MIN(vp, V - v0) * sizeof(float));
        }
#pragma omp parallel for schedule(dynamic) num_threads(m->n_draw_sc) if (nd > 1)
        for (int j = j0; j < j0 + nc; j++)
            if (d[j])
                *out[j] = ds_sample_row(m->draw_rows + (size_t)(j - j0) * V, V, d[j],
                                        m->draw_sc[omp_get_thread_num()]);
    }
}

/* Writes chunk rows mine[n][vp] (this rank's vocabulary block) to their segments' logits dst[n]
 * [V], their greedy tokens or draws *am[n] (either NULL where not wanted; dr[j] non-NULL: drawn);
 * vocabulary-parallel, the blocks of every rank are all-gathered first. */
static void logits_flush(step *s, int n, float *mine, float *all, float **dst, int32_t **am,
                         const ds_row_draw **dr) {
    ds_model *m = s->m;
    int V = m->cfg.vocab_size, Tp = m->tp_size, vp = m->vp, nd = 0;
    if (Tp == 1) {
        for (int j = 0; j < n; j++) {
            if (dst[j]) memcpy(dst[j], mine + (size_t)j * vp, (size_t)V * sizeof(float));
            if (am[j] && !dr[j]) *am[j] = ds_argmax(mine + (size_t)j * vp, V);
            nd += dr[j] != NULL;
        }
        if (nd) ds_model_draw_host(m, mine, 0, vp, n, dr, am);
        return;
    }
    if (!s->tp_failed && m->opts.allgather(m->opts.allgather_ctx, mine, (size_t)n * vp, all))
        s->tp_failed = 1;
    for (int j = 0; j < n; j++) {
        if (am[j] && !dr[j]) *am[j] = ds_argmax_blocks(all + (size_t)j * vp, (size_t)n * vp, vp, V);
        nd += dr[j] != NULL;
        for (int t = 0; dst[j] && t < Tp; t++) {
            int v0 = DS_MIN(V, t * vp), nv = DS_MIN(V, v0 + vp) - v0;
            memcpy(dst[j] + v0, all + ((size_t)t * n + j) * vp, (size_t)nv * sizeof(float));
        }
    }
    if (nd) ds_model_draw_host(m, all, (size_t)n * vp, vp, n, dr, am);
}

/* The logits every segment asked for (its last n_logits rows of x [T][D]). Vocabulary-parallel,
 * each rank computes its block of V and the blocks are all-gathered: each logit is the same dot
 * product one process computes, so the result is identical. The ranks of a TP group see the same
 * segments, so they flush the same chunks. */
static void compute_logits(step *s, const float *x) {
    const ds_model *m = s->m;
    int V = m->cfg.vocab_size, D = m->cfg.hidden_size, Tp = m->tp_size, vp = m->vp;
    float *xr = sc_take(&s->sc, (size_t)LG_CHUNK * D);    /* [LG_CHUNK][D] gathered rows */
    float *mine = sc_take(&s->sc, (size_t)LG_CHUNK * vp); /* [LG_CHUNK][vp] */
    float *all = Tp > 1 ? sc_take(&s->sc, (size_t)Tp * LG_CHUNK * vp) : NULL; /* [Tp][n][vp] */
    if (s->sc.overflow) return;
    float *dst[LG_CHUNK];
    int32_t *am[LG_CHUNK];
    const ds_row_draw *dr[LG_CHUNK];
    int n = 0;
    for (int q = 0; q < s->n_seq; q++) {
        const ds_seq_batch *sb = &s->seqs[q];
        int nl = ds_seq_logit_rows(sb);
        for (int i = 0; i < nl; i++) {
            memcpy(xr + (size_t)n * D, x + (size_t)(s->off[q] + sb->n - nl + i) * D,
                   (size_t)D * sizeof(float));
            dst[n] = sb->logits ? sb->logits + (size_t)i * V : NULL;
            dr[n] = sb->argmax && sb->draws ? sb->draws + i : NULL;
            am[n++] = sb->argmax ? sb->argmax + i : NULL;
            if (n == LG_CHUNK) {
                ds_matmul(mine, vp, xr, D, n, &m->lm_head);
                logits_flush(s, n, mine, all, dst, am, dr);
                n = 0;
            }
        }
    }
    if (n) {
        ds_matmul(mine, vp, xr, D, n, &m->lm_head);
        logits_flush(s, n, mine, all, dst, am, dr);
    }
}

/* out[T][D] = KDA(xn[T][D]) (MODEL_SPEC §3). */
static void kda_forward(step *s, const layer_w *lw, const float *xn, float *out) {
    const ds_config *c = &s->m->cfg;
    const kda_w *w = &lw->kda;
    int T = s->T, D = c->hidden_size, H = s->m->Hk, dk = c->kda_head_dim, P = H * dk;
    int W = c->short_conv_kernel_size;
    scratch *sc = &s->sc;
    size_t mark = sc->used;
    float *pre = sc_take(sc, (size_t)T * P);  /* [T][P] pre-conv projection */
    float *q = sc_take(sc, (size_t)T * P);    /* [T][H][dk] */
    float *k = sc_take(sc, (size_t)T * P);    /* [T][H][dk] */
    float *v = sc_take(sc, (size_t)T * P);    /* [T][H][dv] */
    float *fa = sc_take(sc, (size_t)T * dk);  /* [T][dk] */
    float *g = sc_take(sc, (size_t)T * P);    /* [T][H][dk] log decay, then reused for the gate */
    float *beta = sc_take(sc, (size_t)T * H); /* [T][H] */
    float *o = sc_take(sc, (size_t)T * P);    /* [T][H][dv] */
    if (sc->overflow) return;
    const ds_mat *proj[3] = {&w->q, &w->k, &w->v};
    const float *conv_w[3] = {w->q_conv, w->k_conv, w->v_conv};
    float *dst[3] = {q, k, v};
    size_t slot_n = ds_model_slot_floats(s->m), tail_n = (size_t)(W - 1) * P;
    for (int j = 0; j < 3; j++) {
        ds_matmul(pre, P, xn, D, T, proj[j]);
        for (int qi = 0; qi < s->n_seq; qi++) {
            const ds_seq_batch *sb = &s->seqs[qi];
            float *tail = slot_conv(s, qi, lw->kind_idx) + (size_t)j * tail_n;
            size_t r = (size_t)s->off[qi] * P;
            float *old = NULL; /* [W-1][P] the tail before this step */
            if (sb->state_rows) {
                old = sc_take(sc, tail_n);
                if (sc->overflow) return;
                memcpy(old, tail, tail_n * sizeof(float));
            }
            ds_short_conv_silu(dst[j] + r, pre + r, sb->n, P, conv_w[j], W, tail);
            /* The tail after token t is rows t-W+2 .. t of (old tail ++ this step's inputs). */
            for (int t = 0; old && t < sb->n; t++) {
                float *dstrow = sb->state_rows + (size_t)t * slot_n + (size_t)(tail - sb->slot);
                for (int i = 0; i < W - 1; i++) {
                    int u = t - (W - 1) + 1 + i;
                    const float *src =
                        u < 0 ? old + (size_t)(u + W - 1) * P : pre + r + (size_t)u * P;
                    memcpy(dstrow + (size_t)i * P, src, (size_t)P * sizeof(float));
                }
            }
            if (old) sc->used -= (tail_n + 15) & ~(size_t)15;
        }
    }
    ds_l2norm_heads(q, T, H, dk, 1e-6f, 1.0f / sqrtf((float)dk));
    ds_l2norm_heads(k, T, H, dk, 1e-6f, 1.0f);
    ds_matmul(fa, dk, xn, D, T, &w->f_a);
    ds_matmul(pre, P, fa, dk, T, &w->f_b);
    ds_kda_gate(g, pre, T, H, dk, w->A_log, w->dt_bias, c->has_gate_lower_bound,
                c->gate_lower_bound);
    ds_matmul(beta, H, xn, D, T, &w->b);
    ds_sigmoid_inplace(beta, (size_t)T * H);
    for (int qi = 0; qi < s->n_seq; qi++) {
        int n = s->seqs[qi].n;
        size_t r = (size_t)s->off[qi] * P;
        float *S = slot_rec(s, qi, lw->kind_idx);
        const ds_seq_batch *sb = &s->seqs[qi];
        if (sb->state_rows) {
            size_t rec_n = (size_t)H * dk * dk;
            float *rows = sc_take(sc, (size_t)n * rec_n); /* [n][H][dk][dv] */
            if (sc->overflow) return;
            ds_kda_recurrent(o + r, q + r, k + r, v + r, g + r, beta + (size_t)s->off[qi] * H, S,
                             rows, n, H, dk, dk);
            for (int t = 0; t < n; t++)
                memcpy(sb->state_rows + (size_t)t * slot_n + (size_t)(S - sb->slot),
                       rows + (size_t)t * rec_n, rec_n * sizeof(float));
            sc->used -= ((size_t)n * rec_n + 15) & ~(size_t)15;
        } else if (n >= s->m->opts.kda_chunked_min)
            ds_kda_chunked(o + r, q + r, k + r, v + r, g + r, beta + (size_t)s->off[qi] * H, S, n,
                           H, dk, dk, s->m->opts.kda_chunk);
        else
            ds_kda_recurrent(o + r, q + r, k + r, v + r, g + r, beta + (size_t)s->off[qi] * H, S,
                             NULL, n, H, dk, dk);
    }
    /* output gate logits into g (no longer needed as decay) */
    if (c->use_full_rank_gate) {
        ds_matmul(g, P, xn, D, T, &w->g);
    } else {
        ds_matmul(fa, dk, xn, D, T, &w->g_a);
        ds_matmul(g, P, fa, dk, T, &w->g_b);
    }
    ds_gated_rmsnorm_heads(q, o, g, w->o_norm, T, H, dk, c->rms_norm_eps);
    ds_matmul(out, D, q, P, T, &w->o);
    tp_sum(s, out, (size_t)T * D);
    sc->used = mark;
}

/* out[T][D] = MLA(xn[T][D]) (MODEL_SPEC §4); writes this step's latent rows into the pool. */
static void mla_forward(step *s, const layer_w *lw, const float *xn, float *out) {
    const ds_config *c = &s->m->cfg;
    const mla_w *w = &lw->mla;
    int T = s->T, D = c->hidden_size, Ha = s->m->Ha, R = c->kv_lora_rank;
    int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dvh = c->v_head_dim, dq = dn + dr;
    int row = R + dr;
    scratch *sc = &s->sc;
    size_t mark = sc->used;
    float *q = sc_take(sc, (size_t)T * Ha * dq);  /* [T][Ha][dn+dr] */
    float *kv = sc_take(sc, (size_t)T * row);     /* [T][R+dr] this step's latent rows */
    float *o = sc_take(sc, (size_t)T * Ha * dvh); /* [T][Ha][dvh] */
    float *qa = c->q_lora_rank ? sc_take(sc, (size_t)T * c->q_lora_rank) : NULL; /* [T][Rq] */
    if (sc->overflow) return;
    if (c->q_lora_rank) {
        ds_matmul(qa, c->q_lora_rank, xn, D, T, &w->q_a);
        ds_rmsnorm(qa, qa, w->q_a_norm, T, c->q_lora_rank, 1e-6f);
        ds_matmul(q, Ha * dq, qa, c->q_lora_rank, T, &w->q_b);
    } else {
        ds_matmul(q, Ha * dq, xn, D, T, &w->q);
    }
    ds_matmul(kv, row, xn, D, T, &w->kv_a);
    for (int t = 0; t < T; t++)
        ds_rmsnorm(kv + (size_t)t * row, kv + (size_t)t * row, w->kv_a_norm, 1, R, 1e-6f);
    ds_latent_view view = {s->pool->layer[lw->kind_idx], NULL, s->pool->block_size, row};
    float scale = 1.0f / sqrtf((float)dq);
    for (int qi = 0; qi < s->n_seq; qi++) {
        const ds_seq_batch *sb = &s->seqs[qi];
        view.block_table = sb->block_table;
        for (int t = 0; t < sb->n; t++)
            memcpy(ds_latent_row(&view, sb->pos0 + t), kv + (size_t)(s->off[qi] + t) * row,
                   (size_t)row * sizeof(float));
    }
    /* Short segments (decodes, verifies) use the absorbed form. Consecutive ones form a run whose
     * query absorption and value up-projection are one GEMM per head over all its rows; only the
     * attention itself is per sequence. Per-row results do not depend on the run's size. */
    int run0 = -1; /* first segment of the open run */
    for (int qi = 0; qi <= s->n_seq; qi++) {
        int expanded = qi < s->n_seq && s->seqs[qi].n >= s->m->opts.mla_expanded_min;
        if (run0 >= 0 && (qi == s->n_seq || expanded)) {
            int r_start = s->off[run0], Tr = s->off[qi - 1] + s->seqs[qi - 1].n - r_start;
            size_t m2 = sc->used;
            float *qr = sc_take(sc, (size_t)Tr * Ha * dr);  /* [Tr][Ha][dr] */
            float *qbar = sc_take(sc, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            float *obar = sc_take(sc, (size_t)Tr * Ha * R); /* [Tr][Ha][R] */
            if (sc->overflow) return;
            const float *qs = q + (size_t)r_start * Ha * dq;
            for (int t = 0; t < Tr; t++)
                for (int h = 0; h < Ha; h++)
                    memcpy(qr + ((size_t)t * Ha + h) * dr, qs + ((size_t)t * Ha + h) * dq + dn,
                           (size_t)dr * sizeof(float));
            for (int h = 0; h < Ha; h++) { /* q̄_h = W_UK_h^T qN_h (MODEL_SPEC §4.4) */
                ds_mat uk = ds_mat_rows(&w->kv_b, h * (dn + dvh), dn);
                ds_matmul_t(qbar + (size_t)h * R, Ha * R, qs + (size_t)h * dq, Ha * dq, Tr, &uk);
            }
            for (int qj = run0; qj < qi; qj++) {
                const ds_seq_batch *sb = &s->seqs[qj];
                size_t at = (size_t)(s->off[qj] - r_start) * Ha;
                view.block_table = sb->block_table;
                ds_mla_attend_absorbed(obar + at * R, qbar + at * R, qr + at * dr, sb->n, Ha, R, dr,
                                       &view, sb->pos0, sb->pos0 + sb->n, 1, scale);
            }
            float *os = o + (size_t)r_start * Ha * dvh;
            for (int h = 0; h < Ha; h++) { /* o_h = W_UV_h ō_h */
                ds_mat uv = ds_mat_rows(&w->kv_b, h * (dn + dvh) + dn, dvh);
                ds_matmul(os + (size_t)h * dvh, Ha * dvh, obar + (size_t)h * R, Ha * R, Tr, &uv);
            }
            sc->used = m2;
            run0 = -1;
        }
        if (qi == s->n_seq) break;
        if (!expanded) {
            if (run0 < 0) run0 = qi;
            continue;
        }
        /* Expanded form: up-project every context latent once for this segment. */
        const ds_seq_batch *sb = &s->seqs[qi];
        int n = sb->n, pos0 = sb->pos0, ctx = pos0 + n, r0 = s->off[qi];
        view.block_table = sb->block_table;
        const float *qs = q + (size_t)r0 * Ha * dq;
        float *os = o + (size_t)r0 * Ha * dvh;
        size_t m2 = sc->used;
        float *cl = sc_take(sc, (size_t)ctx * R);                /* [ctx][R] */
        float *kr = sc_take(sc, (size_t)ctx * dr);               /* [ctx][dr] */
        float *kvb = sc_take(sc, (size_t)ctx * Ha * (dn + dvh)); /* [ctx][Ha][dn+dvh] */
        float *kn = sc_take(sc, (size_t)ctx * Ha * dn);          /* [ctx][Ha][dn] */
        float *vv = sc_take(sc, (size_t)ctx * Ha * dvh);         /* [ctx][Ha][dvh] */
        if (sc->overflow) return;
        for (int t = 0; t < ctx; t++) {
            const float *lr = ds_latent_row(&view, t);
            memcpy(cl + (size_t)t * R, lr, (size_t)R * sizeof(float));
            memcpy(kr + (size_t)t * dr, lr + R, (size_t)dr * sizeof(float));
        }
        ds_matmul(kvb, Ha * (dn + dvh), cl, R, ctx, &w->kv_b);
        for (int t = 0; t < ctx; t++)
            for (int h = 0; h < Ha; h++) {
                const float *src = kvb + ((size_t)t * Ha + h) * (dn + dvh);
                memcpy(kn + ((size_t)t * Ha + h) * dn, src, (size_t)dn * sizeof(float));
                memcpy(vv + ((size_t)t * Ha + h) * dvh, src + dn, (size_t)dvh * sizeof(float));
            }
        ds_mla_attend_expanded(os, qs, kn, kr, vv, n, ctx, Ha, dn, dr, dvh, pos0, 1, scale);
        sc->used = m2;
    }
    if (c->mla_use_output_gate) {
        float *gt = q; /* reuse: [T][Ha*dvh] fits in [T][Ha*dq] */
        ds_matmul(gt, Ha * dvh, xn, D, T, &w->g);
        ds_sigmoid_inplace(gt, (size_t)T * Ha * dvh);
        for (size_t i = 0; i < (size_t)T * Ha * dvh; i++) o[i] *= gt[i];
    }
    ds_matmul(out, D, o, Ha * dvh, T, &w->o);
    tp_sum(s, out, (size_t)T * D);
    sc->used = mark;
}

static void act(const ds_config *c, float *out, const float *gate, const float *up, size_t n) {
    if (c->hidden_act == DS_ACT_SITU)
        ds_act_situ(out, gate, up, n, c->situ_beta, c->situ_linear_beta);
    else
        ds_act_swiglu(out, gate, up, n);
}

/* y[T][D] = W_down act(W_gate x, W_up x) — dense MLP and shared experts. */
static void mlp(step *s, const ds_mat *gate, const ds_mat *up, const ds_mat *down, const float *x,
                int T, float *y) {
    const ds_config *c = &s->m->cfg;
    int D = gate->cols, I = gate->rows;
    size_t mark = s->sc.used;
    float *a = sc_take(&s->sc, (size_t)T * I); /* [T][I] */
    float *b = sc_take(&s->sc, (size_t)T * I); /* [T][I] */
    if (s->sc.overflow) return;
    ds_matmul(a, I, x, D, T, gate);
    ds_matmul(b, I, x, D, T, up);
    act(c, a, a, b, (size_t)T * I);
    ds_matmul(y, down->rows, a, I, T, down);
    s->sc.used = mark;
}

/* out[T][D] = FFN(xn[T][D]) (MODEL_SPEC §5). */
static void ffn_forward(step *s, const layer_w *lw, const float *xn, float *out) {
    const ds_config *c = &s->m->cfg;
    const ffn_w *w = &lw->ffn;
    int T = s->T, D = c->hidden_size;
    if (!w->is_moe) {
        mlp(s, &w->gate, &w->up, &w->down, xn, T, out);
        tp_sum(s, out, (size_t)T * D);
        return;
    }
    int E = c->num_experts, K = c->num_experts_per_token;
    int Hin = c->routed_expert_hidden_size ? c->routed_expert_hidden_size : D;
    scratch *sc = &s->sc;
    size_t mark = sc->used;
    float *z = sc_take(sc, (size_t)T * E);                /* [T][E] router logits */
    float *wt = sc_take(sc, (size_t)T * K);               /* [T][K] combine weights */
    int32_t *idx = (int32_t *)sc_take(sc, (size_t)T * K); /* [T][K] chosen experts */
    float *u = sc_take(sc, (size_t)T * Hin);              /* [T][Hin] expert input */
    float *acc = sc_take(sc, (size_t)T * Hin);            /* [T][Hin] weighted expert sum */
    float *xe = sc_take(sc, (size_t)T * Hin);             /* [Te][Hin] gathered rows */
    float *ye = sc_take(sc, (size_t)T * Hin);             /* [Te][Hin] expert outputs */
    int32_t *rows = (int32_t *)sc_take(sc, (size_t)T);    /* [Te] token of each gathered row */
    float *rw = sc_take(sc, (size_t)T);                   /* [Te] its combine weight */
    if (sc->overflow) return;
    ds_matmul(z, E, xn, D, T, &w->router);
    for (int t = 0; t < T; t++)
        ds_moe_route(idx + (size_t)t * K, wt + (size_t)t * K, z + (size_t)t * E, w->router_bias, E,
                     K, c->use_grouped_topk ? c->num_expert_group : 1, c->topk_group,
                     c->moe_renormalize, c->routed_scaling_factor, s->m->opts.hf_kl_router_quirk);
    if (c->routed_expert_hidden_size)
        ds_matmul(u, Hin, xn, D, T, &w->lat_down);
    else
        memcpy(u, xn, (size_t)T * D * sizeof(float));
    memset(acc, 0, (size_t)T * Hin * sizeof(float));
    /* Experts in id order: a token's sum is accumulated in ascending expert id whatever else is
     * in the batch, so its result does not depend on its neighbours. Under tensor parallelism
     * each rank sums its own experts [e0, e1) and the all-reduce below adds the ranks' sums. */
    for (int e = s->m->e0; e < s->m->e1; e++) {
        int Te = 0;
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                if (idx[(size_t)t * K + j] == e) {
                    rows[Te] = t;
                    rw[Te] = wt[(size_t)t * K + j];
                    memcpy(xe + (size_t)Te * Hin, u + (size_t)t * Hin, (size_t)Hin * sizeof(float));
                    Te++;
                }
        if (!Te) continue;
        mlp(s, &w->w1[e], &w->w3[e], &w->w2[e], xe, Te, ye);
        for (int r = 0; r < Te; r++)
            ds_axpy(acc + (size_t)rows[r] * Hin, rw[r], ye + (size_t)r * Hin, (size_t)Hin);
    }
    int latent = c->routed_expert_hidden_size > 0;
    if (latent) {
        /* The latent norm is nonlinear: the routed sum must be complete before it (MODEL_SPEC
         * §5.4), so it is all-reduced here; up-projection then runs replicated on every rank. */
        tp_sum(s, acc, (size_t)T * Hin);
        if (w->lat_norm) ds_rmsnorm(acc, acc, w->lat_norm, T, Hin, c->rms_norm_eps);
        ds_matmul(out, D, acc, Hin, T, &w->lat_up);
    } else {
        memcpy(out, acc, (size_t)T * D * sizeof(float));
    }
    if (c->num_shared_experts > 0) {
        float *sh = u; /* [T][D] reuse when Hin >= D; else take fresh */
        if (Hin < D) sh = sc_take(sc, (size_t)T * D);
        if (sc->overflow) return;
        mlp(s, &w->sh_gate, &w->sh_up, &w->sh_down, xn, T, sh);
        if (latent) tp_sum(s, sh, (size_t)T * D); /* out is already complete on every rank */
        ds_add(out, sh, (size_t)T * D);
    }
    if (!latent) tp_sum(s, out, (size_t)T * D); /* routed + shared partials in one all-reduce */
    sc->used = mark;
}

/* Copies the stream after `layer` (-1: the embedding) to the segments that asked for it. */
static void save_hidden(step *s, int layer, const float *h) {
    int D = s->m->cfg.hidden_size;
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        size_t rows = (size_t)sb->n * D;
        const float *src = h + (size_t)s->off[q] * D;
        if (sb->hidden && layer >= 0)
            memcpy(sb->hidden + (size_t)layer * rows, src, rows * sizeof(float));
        for (int j = 0; j < sb->n_taps; j++)
            if (sb->tap_layers[j] == layer)
                memcpy(sb->taps + (size_t)j * rows, src, rows * sizeof(float));
    }
}

/* Runs the whole step; returns the scratch floats it needed (0 when the buffer was enough). */
static size_t run_step(step *s) {
    ds_model *m = s->m;
    const ds_config *c = &m->cfg;
    int T = s->T, D = c->hidden_size, L = c->num_hidden_layers, N = c->attn_res_block_size;
    size_t TD = (size_t)T * D;
    s->sc = (scratch){m, 0, 0, 0};
    scratch *sc = &s->sc;
    int n_banks_max = N > 0 ? (L + N - 1) / N + 1 : 0;
    int32_t *ids = (int32_t *)sc_take(sc, (size_t)T); /* [T] */
    float *P = sc_take(sc, TD); /* [T][D] residual stream, or the block-local sum with AttnRes */
    float *x = sc_take(sc, TD); /* [T][D] mixer / FFN input */
    float *a = sc_take(sc, TD); /* [T][D] sublayer output */
    float *bank = n_banks_max ? sc_take(sc, (size_t)n_banks_max * TD) : NULL; /* [nb][T][D] */
    const float **cands = calloc((size_t)n_banks_max + 2, sizeof *cands);
    if (sc->overflow || !cands) {
        free(cands);
        return sc->need + 1;
    }
    int nb = 0; /* banked AttnRes blocks */
    if (m->l0 == 0) {
        for (int q = 0; q < s->n_seq; q++)
            memcpy(ids + s->off[q], s->seqs[q].tokens, (size_t)s->seqs[q].n * sizeof(int32_t));
        embed_tokens(s, ids, P);
        save_hidden(s, -1, P);
    } else {
        /* A later pipeline stage: the stream and the banked blocks arrive from the previous one
         * (MODEL_SPEC §6.4) — a block opened there may close here. */
        memcpy(P, s->in->h, TD * sizeof(float));
        nb = s->in->n_banks;
        if (nb) memcpy(bank, s->in->banks, (size_t)nb * TD * sizeof(float));
    }
    for (int i = m->l0; i < m->l1 && !sc->overflow; i++) {
        const layer_w *lw = &m->layers[i];
        if (N > 0) {
            /* Mix first, then bank P: layer 0 banks the embedding (MODEL_SPEC §6.3, trap 13). */
            for (int j = 0; j < nb; j++) cands[j] = bank + (size_t)j * TD;
            cands[nb] = P;
            ds_attnres_mix(x, cands, nb + 1, lw->attn_res_np, T, D, c->rms_norm_eps);
            int banks = i % N == 0;
            if (banks) memcpy(bank + (size_t)nb++ * TD, P, TD * sizeof(float));
            ds_rmsnorm(x, x, lw->in_norm, T, D, c->rms_norm_eps);
            if (lw->kind == DS_LAYER_KDA)
                kda_forward(s, lw, x, a);
            else
                mla_forward(s, lw, x, a);
            if (banks)
                memcpy(P, a, TD * sizeof(float));
            else
                ds_add(P, a, TD);
            for (int j = 0; j < nb; j++) cands[j] = bank + (size_t)j * TD;
            cands[nb] = P;
            ds_attnres_mix(x, cands, nb + 1, lw->mlp_res_np, T, D, c->rms_norm_eps);
            ds_rmsnorm(x, x, lw->post_norm, T, D, c->rms_norm_eps);
            ffn_forward(s, lw, x, a);
            ds_add(P, a, TD);
        } else {
            ds_rmsnorm(x, P, lw->in_norm, T, D, c->rms_norm_eps);
            if (lw->kind == DS_LAYER_KDA)
                kda_forward(s, lw, x, a);
            else
                mla_forward(s, lw, x, a);
            ds_add(P, a, TD);
            ds_rmsnorm(x, P, lw->post_norm, T, D, c->rms_norm_eps);
            ffn_forward(s, lw, x, a);
            ds_add(P, a, TD);
        }
        save_hidden(s, i, P);
    }
    if (sc->overflow) {
        free(cands);
        return sc->need + 1;
    }
    if (m->l1 < L) { /* not the last stage: hand the stream and the banks on */
        memcpy(s->out->h, P, TD * sizeof(float));
        s->out->n_banks = nb;
        if (nb) memcpy(s->out->banks, bank, (size_t)nb * TD * sizeof(float));
        free(cands);
        return 0;
    }
    if (N > 0) {
        for (int j = 0; j < nb; j++) cands[j] = bank + (size_t)j * TD;
        cands[nb] = P;
        ds_attnres_mix(x, cands, nb + 1, m->out_res_np, T, D, c->rms_norm_eps);
        ds_rmsnorm(x, x, m->final_norm, T, D, c->rms_norm_eps);
    } else {
        ds_rmsnorm(x, P, m->final_norm, T, D, c->rms_norm_eps);
    }
    free(cands);
    for (int q = 0; q < s->n_seq; q++) {
        ds_seq_batch *sb = &s->seqs[q];
        const float *xs = x + (size_t)s->off[q] * D;
        if (sb->final_hidden) memcpy(sb->final_hidden, xs, (size_t)sb->n * D * sizeof(float));
    }
    compute_logits(s, x);
    if (sc->overflow) return sc->need + 1;
    return 0;
}

/* Upper bound, in floats, of the scratch one step takes (mirrors the sc_take calls above; every
 * take is counted with 16 floats of alignment slack). */
static size_t step_need(const step *s) {
    const ds_config *c = &s->m->cfg;
    size_t T = (size_t)s->T, D = (size_t)c->hidden_size, L = (size_t)c->num_hidden_layers;
    size_t N = (size_t)c->attn_res_block_size, pad = 16;
    size_t base = T + 3 * T * D + (N ? ((L + N - 1) / N + 1) * T * D : 0) + 5 * pad;
    size_t H = (size_t)c->kda_num_heads, dk = (size_t)c->kda_head_dim, P = H * dk;
    size_t kda = c->num_kda_layers ? 7 * T * P + T * dk + T * H + 8 * pad : 0;
    size_t rows_max = 0; /* speculative state rows (see kda_forward) */
    for (int q = 0; q < s->n_seq; q++)
        if (s->seqs[q].state_rows)
            rows_max = DS_MAX(rows_max, (size_t)s->seqs[q].n * H * dk * dk +
                                            (size_t)(c->short_conv_kernel_size - 1) * P + 2 * pad);
    if (kda) kda += rows_max;
    size_t mla = 0;
    if (c->num_mla_layers) {
        size_t Ha = (size_t)c->num_attention_heads, R = (size_t)c->kv_lora_rank;
        size_t dn = (size_t)c->qk_nope_head_dim, dr = (size_t)c->qk_rope_head_dim;
        size_t dvh = (size_t)c->v_head_dim;
        size_t seg = 0;
        for (int q = 0; q < s->n_seq; q++) {
            size_t ctx = (size_t)s->seqs[q].pos0 + (size_t)s->seqs[q].n;
            seg = DS_MAX(seg, ctx * (R + dr + 2 * Ha * (dn + dvh)) + 5 * pad); /* expanded */
        }
        seg = DS_MAX(seg, T * Ha * (dr + 2 * R) + 3 * pad); /* one absorbed run */
        mla = T * Ha * (dn + dr) + T * (R + dr) + T * Ha * dvh + T * (size_t)c->q_lora_rank +
              4 * pad + seg;
    }
    size_t ffn = 2 * T * (size_t)c->intermediate_size + 2 * pad;
    if (c->num_experts) {
        size_t E = (size_t)c->num_experts, K = (size_t)c->num_experts_per_token;
        size_t Hin = c->routed_expert_hidden_size ? (size_t)c->routed_expert_hidden_size : D;
        size_t Ie = (size_t)c->moe_intermediate_size, Is = Ie * (size_t)c->num_shared_experts;
        size_t moe = T * E + 2 * T * K + 4 * T * Hin + 2 * T + 9 * pad;
        moe += DS_MAX(2 * T * Ie + 2 * pad, T * D + pad + 2 * T * Is + 2 * pad);
        ffn = DS_MAX(ffn, moe);
    }
    size_t lg = 0; /* the logits chunk (see compute_logits) */
    if (s->m->l1 == (int)L) {
        size_t vp = (size_t)s->m->vp, Tp = (size_t)s->m->tp_size;
        lg = LG_CHUNK * (D + vp + (Tp > 1 ? Tp * vp : 0)) + 3 * pad;
    }
    return base + DS_MAX(DS_MAX(DS_MAX(kda, mla), ffn), lg);
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

int ds_model_forward_stage(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
                           const ds_stage_io *in, ds_stage_io *out, ds_err *err) {
    if ((m->l0 > 0 && !in) || (m->l1 < m->cfg.num_hidden_layers && !out))
        return ds_errf(err, "forward: stage [%d, %d) needs its %s tensors", m->l0, m->l1,
                       m->l0 > 0 && !in ? "incoming" : "outgoing");
    if (in && in->n_banks > ds_model_max_banks(m))
        return ds_errf(err, "forward: %d banked AttnRes blocks arrived, at most %d exist",
                       in->n_banks, ds_model_max_banks(m));
    const ds_config *c = &m->cfg;
    int T = 0;
    int *off = ds_malloc((size_t)(n_seq ? n_seq : 1) * sizeof(int), err);
    if (!off) return DS_ERR;
    for (int q = 0; q < n_seq; q++) {
        ds_seq_batch *sb = &seqs[q];
        if (sb->n <= 0 || sb->pos0 < 0 || sb->n_logits < 0 || sb->n_logits > sb->n) {
            free(off);
            return ds_errf(err, "forward: segment %d has n=%d pos0=%d n_logits=%d", q, sb->n,
                           sb->pos0, sb->n_logits);
        }
        for (int t = 0; t < sb->n; t++)
            if (sb->tokens[t] < 0 || sb->tokens[t] >= c->vocab_size) {
                free(off);
                return ds_errf(err, "forward: token id %d at index %d is outside [0, %d)",
                               sb->tokens[t], t, c->vocab_size);
            }
        off[q] = T;
        T += sb->n;
        /* host draws: on the CPU, and on GPUs of a TP group (the rows are gathered on the host) */
        if (sb->draws && sb->argmax && sb->n_logits && m->l1 == c->num_hidden_layers &&
            (m->dev != DS_DEVICE_CUDA || m->tp_size > 1) && ds_model_draw_space(m, err)) {
            free(off);
            return DS_ERR;
        }
    }
    step s = {m, pool, seqs, n_seq, T, off, in, out, {0}, 0};
    if (T == 0) {
        free(off);
        return DS_OK;
    }
    if (m->cu) {
        int rc = ds_cuda_forward_stage(m, pool, seqs, n_seq, off, T, in, out, err);
        free(off);
        return rc;
    }
    size_t need = step_need(&s);
    if (need > m->scratch_cap) {
        free(m->scratch);
        m->scratch = ds_aligned_alloc(need * sizeof(float), err);
        m->scratch_cap = m->scratch ? need : 0;
        if (!m->scratch) {
            free(off);
            return DS_ERR;
        }
    }
    size_t short_by = run_step(&s);
    free(off);
    if (short_by)
        return ds_errf(err, "forward: internal error: scratch estimate %zu floats, step took %zu",
                       need, short_by - 1);
    if (s.tp_failed) return ds_errf(err, "forward: a tensor-parallel all-reduce failed");
    return DS_OK;
}

#ifndef DS_HAVE_CUDA
/* A build without the CUDA backend: the device cannot be chosen. */
int ds_cuda_model_attach(ds_model *m, int device_index, ds_err *err) {
    (void)m;
    (void)device_index;
    return ds_errf(err, "device cuda: this build has no CUDA backend (build it with `make cuda`)");
}
void ds_cuda_model_detach(ds_model *m) {
    (void)m;
}
int ds_cuda_forward_stage(ds_model *m, ds_kv_pool *pool, ds_seq_batch *seqs, int n_seq,
                          const int *off, int T, const ds_stage_io *in, ds_stage_io *out,
                          ds_err *err) {
    (void)m, (void)pool, (void)seqs, (void)n_seq, (void)off, (void)T, (void)in, (void)out;
    return ds_errf(err, "forward: this build has no CUDA backend");
}
size_t ds_cuda_model_mem_free(const ds_model *m) {
    (void)m;
    return 0;
}
const char *ds_cuda_model_device_name(const ds_model *m) {
    (void)m;
    return "none";
}
int ds_cuda_model_limits(const ds_model *m, double *copy_gbs, double *gemm_tflops, ds_err *err) {
    (void)m, (void)copy_gbs, (void)gemm_tflops;
    return ds_errf(err, "this build has no CUDA backend");
}
int ds_cuda_available(void) {
    return 0;
}
void ds_cuda_model_profile_report(const ds_model *m, FILE *f, const char *title) {
    (void)m, (void)f, (void)title;
}
double ds_cuda_model_profile_gemm_tflops(const ds_model *m, double *ms_per_step) {
    (void)m, (void)ms_per_step;
    return 0;
}
#endif
