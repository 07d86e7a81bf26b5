/* model_draft.c — the DSpark draft (docs/model.md §8): weight binding, context rows, block pass,
 * Markov walk.
 *
 * Data flow:
 *   write_context: taps [n_taps][n][Dt] -> concat -> W_context -> RMSNorm = ctx [n][D]
 *                  -> per layer: W_kva ctx -> [RMSNorm(c) | RoPE(kR)] -> latent cache rows.
 *   propose:       embed([anchor, M...]) -> per layer: RMSNorm -> MLA (YaRN RoPE, absorbed, over
 *                  context rows and the block's own rows, non-causal) -> += ; RMSNorm -> SwiGLU
 *                  -> += ; final RMSNorm -> target lm_head = U [T][V] -> Markov walk -> drafts.
 * Every norm uses rms_norm_eps (1e-5 in the published draft; the draft has no 1e-6 norms, trap 1).
 */
#include "model/draft_impl.h"
#include "model/backend.h"
#include "model/model_impl.h"

#include "base/devmem.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int ds_draft_on_device(const ds_draft *d) {
    return d->dev != NULL;
}

const ds_draft_config *ds_draft_config_of(const ds_draft *d) {
    return &d->cfg;
}
int ds_draft_n_taps(const ds_draft *d) {
    return d->cfg.num_target_layers;
}
const int *ds_draft_tap_layers(const ds_draft *d) {
    return d->cfg.target_layer_ids;
}
const double *ds_draft_inv_freq(const ds_draft *d, ds_yarn *y) {
    if (y) *y = d->yarn;
    return d->inv_freq;
}

#define FLOAT_TYPES ((1u << DS_DT_F32) | (1u << DS_DT_F16) | (1u << DS_DT_BF16))

/* The checkpoint name of a draft tensor: as given, or with the "model." prefix some exports add
 * (docs/model.md §8.2). */
static const char *resolve(const ds_draft *d, const char *name, char *buf, size_t cap) {
    if (ds_st_find(d->st, name)) return name;
    snprintf(buf, cap, "model.%s", name);
    return ds_st_find(d->st, buf) ? buf
                                  : name; /* absent either way: ds_st_get names the plain one */
}

static int bind_mat(ds_draft *d, const char *name, int rows, int cols, ds_mat *out, ds_err *err) {
    char buf[512];
    const ds_tensor *t;
    int64_t shape[2] = {rows, cols};
    if (ds_st_get(d->st, resolve(d, name, buf, sizeof buf), FLOAT_TYPES, 2, shape, &t, err))
        return DS_ERR;
    *out = (ds_mat){t->data, t->dtype, rows, cols, NULL};
    return DS_OK;
}

/* Widens a [n] norm weight into the next n floats of d->vecs (*next advances). */
static int bind_vec(ds_draft *d, const char *name, int n, float **next, float **out, ds_err *err) {
    char buf[512];
    const ds_tensor *t;
    int64_t shape[1] = {n};
    if (ds_st_get(d->st, resolve(d, name, buf, sizeof buf), FLOAT_TYPES, 1, shape, &t, err) ||
        ds_tensor_to_f32(t, *next, err))
        return DS_ERR;
    *out = *next;
    *next += n;
    return DS_OK;
}

#define NAME(buf, ...) snprintf(buf, sizeof buf, __VA_ARGS__)

static int bind_layer(ds_draft *d, int i, float **vec, draft_layer *w, ds_err *err) {
    const ds_draft_config *c = &d->cfg;
    int D = c->hidden_size, Ha = c->num_attention_heads, R = c->kv_lora_rank, Rq = c->q_lora_rank;
    int dq = c->qk_nope_head_dim + c->qk_rope_head_dim, dr = c->qk_rope_head_dim;
    int dvh = c->v_head_dim, I = c->intermediate_size;
    char n[256];
    if (NAME(n, "layers.%d.input_layernorm.weight", i), bind_vec(d, n, D, vec, &w->in_norm, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.post_attention_layernorm.weight", i),
        bind_vec(d, n, D, vec, &w->post_norm, err))
        return DS_ERR;
    if (Rq) {
        if (NAME(n, "layers.%d.self_attn.q_a_proj.weight", i), bind_mat(d, n, Rq, D, &w->q_a, err))
            return DS_ERR;
        if (NAME(n, "layers.%d.self_attn.q_a_layernorm.weight", i),
            bind_vec(d, n, Rq, vec, &w->q_a_norm, err))
            return DS_ERR;
        if (NAME(n, "layers.%d.self_attn.q_b_proj.weight", i),
            bind_mat(d, n, Ha * dq, Rq, &w->q_b, err))
            return DS_ERR;
    } else if (NAME(n, "layers.%d.self_attn.q_proj.weight", i),
               bind_mat(d, n, Ha * dq, D, &w->q, err)) {
        return DS_ERR;
    }
    if (NAME(n, "layers.%d.self_attn.kv_a_proj_with_mqa.weight", i),
        bind_mat(d, n, R + dr, D, &w->kv_a, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.self_attn.kv_a_layernorm.weight", i),
        bind_vec(d, n, R, vec, &w->kv_a_norm, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.self_attn.kv_b_proj.weight", i),
        bind_mat(d, n, Ha * (c->qk_nope_head_dim + dvh), R, &w->kv_b, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.self_attn.o_proj.weight", i), bind_mat(d, n, D, Ha * dvh, &w->o, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.mlp.gate_proj.weight", i), bind_mat(d, n, I, D, &w->gate, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.mlp.up_proj.weight", i), bind_mat(d, n, I, D, &w->up, err))
        return DS_ERR;
    if (NAME(n, "layers.%d.mlp.down_proj.weight", i), bind_mat(d, n, D, I, &w->down, err))
        return DS_ERR;
    return DS_OK;
}

/* The draft only makes sense next to the target it was trained on: it reads that target's hidden
 * states, embedding and lm_head. */
static int check_against_target(const ds_draft_config *c, const ds_config *t, ds_err *err) {
    if (c->target_hidden_size != t->hidden_size)
        return ds_errf(err, "target_hidden_size = %d, but the target's hidden_size is %d",
                       c->target_hidden_size, t->hidden_size);
    if (c->hidden_size != t->hidden_size)
        return ds_errf(err,
                       "hidden_size = %d differs from the target's %d; the draft embeds its block "
                       "with the target's embed_tokens and decodes with its lm_head",
                       c->hidden_size, t->hidden_size);
    if (c->vocab_size != t->vocab_size)
        return ds_errf(err, "vocab_size = %d differs from the target's %d", c->vocab_size,
                       t->vocab_size);
    for (int j = 0; j < c->num_target_layers; j++)
        if (c->target_layer_ids[j] >= t->num_hidden_layers)
            return ds_errf(err, "target_layer_ids[%d] = %d, but the target has %d layers", j,
                           c->target_layer_ids[j], t->num_hidden_layers);
    if (c->target_num_hidden_layers != t->num_hidden_layers)
        return ds_errf(err, "target_num_hidden_layers = %d, but the target has %d layers",
                       c->target_num_hidden_layers, t->num_hidden_layers);
    if (c->fc_norm)
        return ds_errf(err, "fc_norm = true (per-tap norms of TorchSpec drafts) is not supported");
    if (c->aux_hidden_stream_attn_res)
        return ds_errf(err, "aux_hidden_stream = \"attn_res\" is not supported: the target taps "
                            "the block-local stream (\"prefix\")");
    if (c->qk_rope_head_dim % 2)
        return ds_errf(err, "qk_rope_head_dim = %d: RoPE turns lane pairs, so it must be even",
                       c->qk_rope_head_dim);
    return DS_OK;
}

/* W_context split into one [D][Dt] matrix per tap, so that the context can be summed tap by tap:
 * on one rank for all taps, or stage by stage under pipeline parallelism, with the same
 * arithmetic in the same order either way. */
static int split_context(ds_draft *d, ds_err *err) {
    const ds_draft_config *c = &d->cfg;
    int nt = c->num_target_layers, Dt = c->target_hidden_size, D = c->hidden_size;
    size_t es = ds_dtype_size(d->context_proj.dtype), blk = (size_t)D * Dt * es;
    d->ctx_blocks = ds_calloc((size_t)nt, sizeof *d->ctx_blocks, err);
    d->ctx_block_data = ds_malloc(blk * nt + 1, err);
    if (!d->ctx_blocks || !d->ctx_block_data) return DS_ERR;
    const char *src = d->context_proj.data;
    for (int j = 0; j < nt; j++) {
        char *dst = (char *)d->ctx_block_data + blk * j;
        for (int r = 0; r < D; r++)
            memcpy(dst + (size_t)r * Dt * es, src + ((size_t)r * nt * Dt + (size_t)j * Dt) * es,
                   (size_t)Dt * es);
        d->ctx_blocks[j] = (ds_mat){dst, d->context_proj.dtype, D, Dt, NULL};
    }
    return DS_OK;
}

int ds_draft_load_context_only(const char *dir, const ds_model *target, ds_draft **out,
                               ds_err *err) {
    *out = NULL;
    ds_kernels_init();
    ds_draft *d = ds_calloc(1, sizeof *d, err);
    if (!d) return DS_ERR;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    d->context_only = 1;
    if (ds_draft_config_load(path, &d->cfg, err)) goto fail;
    const ds_draft_config *c = &d->cfg;
    if (check_against_target(c, ds_model_config(target), err)) {
        ds_err_prefix(err, "%s", path);
        goto fail;
    }
    if (ds_st_open_dir(dir, &d->st, err) ||
        bind_mat(d, "context_proj.weight", c->hidden_size,
                 c->num_target_layers * c->target_hidden_size, &d->context_proj, err) ||
        split_context(d, err))
        goto fail;
    *out = d;
    return DS_OK;
fail:
    ds_err_prefix(err, "loading DSpark draft context projection from %s", dir);
    ds_draft_free(d);
    return DS_ERR;
}

int ds_draft_load(const char *dir, const ds_model *target, ds_draft **out, ds_err *err) {
    *out = NULL;
    ds_kernels_init();
    ds_draft *d = ds_calloc(1, sizeof *d, err);
    if (!d) return DS_ERR;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (ds_draft_config_load(path, &d->cfg, err)) goto fail;
    const ds_draft_config *c = &d->cfg;
    if (check_against_target(c, ds_model_config(target), err)) {
        ds_err_prefix(err, "%s", path);
        goto fail;
    }
    if (ds_st_open_dir(dir, &d->st, err)) goto fail;
    d->embed = ds_model_embed(target);
    d->lm_head = ds_model_lm_head(target);
    int D = c->hidden_size, L = c->num_hidden_layers, V = c->vocab_size, r = c->markov_rank;
    /* A later pipeline stage holds no target embedding: the draft's frozen copy stands in. */
    if (!d->embed || !d->embed->data) {
        if (bind_mat(d, "embed_tokens.weight", V, D, &d->own_embed, err)) goto fail;
        d->embed = &d->own_embed;
    }
    if (!d->lm_head || !d->lm_head->data) {
        ds_errf(err, "the target's lm_head is not on this rank (the draft runs on the last stage)");
        goto fail;
    }
    size_t n_vec = 2 * (size_t)D + (size_t)L * (2 * (size_t)D + c->q_lora_rank + c->kv_lora_rank);
    d->vecs = ds_malloc(n_vec * sizeof(float), err);
    d->layers = ds_calloc((size_t)L, sizeof(draft_layer), err);
    d->inv_freq = ds_malloc((size_t)c->qk_rope_head_dim / 2 * sizeof(double), err);
    if (!d->vecs || !d->layers || !d->inv_freq) goto fail;
    float *vec = d->vecs;
    if (bind_mat(d, "context_proj.weight", D, c->num_target_layers * c->target_hidden_size,
                 &d->context_proj, err) ||
        bind_vec(d, "context_norm.weight", D, &vec, &d->context_norm, err) ||
        bind_vec(d, "final_norm.weight", D, &vec, &d->final_norm, err) || split_context(d, err))
        goto fail;
    for (int i = 0; i < L; i++)
        if (bind_layer(d, i, &vec, &d->layers[i], err)) goto fail;
    if (bind_mat(d, "markov_head.markov_w1.weight", V, r, &d->markov_w1, err) ||
        bind_mat(d, "markov_head.markov_w2.weight", V, r, &d->markov_w2, err))
        goto fail;
    /* embed_tokens (a frozen copy of the target's) and confidence_head (training only) are left
     * unread on purpose (docs/model.md §8.2, §8.7). */
    if (ds_draft_yarn(c, d->inv_freq, &d->yarn, err)) goto fail;
    /* a target on a device: the draft beside it, where its backend has a device path */
    d->be = target->be;
    if (d->be->draft_create && d->be->draft_create(d, target, err)) goto fail;
    d->dm = ds_model_dmem(target);
    *out = d;
    return DS_OK;
fail:
    ds_err_prefix(err, "loading DSpark draft from %s", dir);
    ds_draft_free(d);
    return DS_ERR;
}

void ds_draft_free(ds_draft *d) {
    if (!d) return;
    if (d->dev) d->be->draft_free(d);
    if (d->st) ds_st_close(d->st);
    free(d->layers);
    free(d->vecs);
    free(d->inv_freq);
    free(d->scratch);
    free(d->table);
    free(d->ctx_blocks);
    free(d->ctx_block_data);
    free(d);
}

// ---- RoPE / YaRN (docs/model.md §8.6) -----------------------------------------------------------

static double yarn_mscale(double s, double m) {
    return s <= 1.0 ? 1.0 : 0.1 * m * log(s) + 1.0;
}

int ds_draft_yarn(const ds_draft_config *c, double *inv_freq, ds_yarn *y, ds_err *err) {
    int r = c->qk_rope_head_dim;
    double theta = c->rope_theta, s = c->rope_factor;
    if (r < 2 || r % 2 || !(theta > 1.0))
        return ds_errf(err, "YaRN: qk_rope_head_dim = %d (needs even >= 2), rope_theta = %g", r,
                       theta);
    double base_scale = 1.0 / sqrt((double)(c->qk_nope_head_dim + r));
    *y = (ds_yarn){0, 0, base_scale, 1.0};
    if (s <= 1.0) {
        if (inv_freq)
            for (int i = 0; i < r / 2; i++) inv_freq[i] = pow(theta, -2.0 * i / r);
        return DS_OK;
    }
    double L0 = (double)c->rope_original_max_position_embeddings;
    if (!(L0 > 0)) return ds_errf(err, "YaRN: original_max_position_embeddings must be > 0");
    /* dim(n): the rotary dimension whose wavelength fits n turns into L0 positions. Dimensions
     * turning more than beta_fast times keep their frequency; fewer than beta_slow are divided by
     * the factor; a linear ramp blends the ones between. */
    double k = r / (2.0 * log(theta));
    y->lo = DS_MAX((int)floor(k * log(L0 / (2.0 * M_PI * c->rope_beta_fast))), 0);
    y->hi = DS_MIN((int)ceil(k * log(L0 / (2.0 * M_PI * c->rope_beta_slow))), r - 1);
    double hi = y->lo == y->hi ? y->hi + 0.001 : (double)y->hi;
    if (inv_freq)
        for (int i = 0; i < r / 2; i++) {
            double inv = pow(theta, -2.0 * i / r);
            double ramp = (i - y->lo) / (hi - y->lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            inv_freq[i] = inv / s * ramp + inv * (1.0 - ramp);
        }
    double m_all = yarn_mscale(s, c->rope_mscale_all_dim);
    y->softmax_scale = base_scale * m_all * m_all;
    y->cos_sin_mscale = yarn_mscale(s, c->rope_mscale) / m_all;
    return DS_OK;
}

/* cs[t][i] = {cos, sin}(pos0+t) * mscale of lane pair i: cs [n][dr/2][2]. Angles are formed in
 * double so that positions near the 1M context limit keep their low bits. */
void ds_draft_rope_table(const ds_draft *d, float *cs, int pos0, int n) {
    int half = d->cfg.qk_rope_head_dim / 2;
    double m = d->yarn.cos_sin_mscale;
    for (int t = 0; t < n; t++)
        for (int i = 0; i < half; i++) {
            double a = (double)(pos0 + t) * d->inv_freq[i];
            cs[((size_t)t * half + i) * 2] = (float)(cos(a) * m);
            cs[((size_t)t * half + i) * 2 + 1] = (float)(sin(a) * m);
        }
}

/* Turns adjacent lanes (x[2i], x[2i+1]) of x [dr] by pair i's angle (GPT-J / "interleaved"
 * pairing, as ATOM, vLLM and sglang DeepSeek MLA; checked by the golden's block logits). */
static void rope_apply(float *x, const float *cs, int half) {
    for (int i = 0; i < half; i++) {
        float a = x[2 * i], b = x[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

// ---- per-sequence latent cache ------------------------------------------------------------------

int ds_draft_cache_init(ds_draft_cache *c, const ds_draft *d, int n_pages, int block_size,
                        int max_block, ds_err *err) {
    return ds_draft_cache_init_seqs(c, d, n_pages, block_size, max_block, 1, err);
}

int ds_draft_cache_init_seqs(ds_draft_cache *c, const ds_draft *d, int n_pages, int block_size,
                             int max_block, int max_seqs, ds_err *err) {
    memset(c, 0, sizeof *c);
    if (n_pages < 1 || block_size < 1 || max_block < 1 || max_seqs < 1)
        return ds_errf(err,
                       "draft cache: n_pages = %d, block_size = %d, max_block = %d, max_seqs = %d "
                       "(each >= 1)",
                       n_pages, block_size, max_block, max_seqs);
    c->n_layers = d->cfg.num_hidden_layers;
    c->n_pages = n_pages;
    c->block_size = block_size;
    c->max_block = max_block;
    /* a partly filled context page (< block_size rows) plus the block's rows */
    c->n_spare = (block_size - 1 + max_block + block_size - 1) / block_size;
    c->row = d->cfg.kv_lora_rank + d->cfg.qk_rope_head_dim;
    c->dm = d->dev ? d->dm : NULL;
    c->layer = ds_calloc((size_t)c->n_layers, sizeof(float *), err);
    if (!c->layer) return DS_ERR;
    c->max_seqs = max_seqs;
    const size_t bytes = ((size_t)n_pages + (size_t)c->n_spare * max_seqs) * (size_t)block_size *
                         (size_t)c->row * sizeof(float);
    for (int l = 0; l < c->n_layers; l++) {
        /* (as the target's pool: on the host calloc, whose large blocks come straight from mmap
         * as zero pages, so untouched pages cost neither memory nor time — a memset touched
         * every page of a cache sized for the whole pool: 16 s before a DSpark server on this
         * 2-core machine answered, against 0.1 s without the draft) */
        c->layer[l] = ds_dmem_on_device(c->dm)
                          ? ds_dmem_alloc(c->dm, bytes, err)
                          : ds_calloc(bytes / sizeof(float), sizeof(float), err);
        if (!c->layer[l]) {
            ds_draft_cache_free(c);
            return DS_ERR;
        }
        if (ds_dmem_on_device(c->dm)) ds_dmem_zero(c->dm, c->layer[l], bytes);
    }
    return DS_OK;
}

void ds_draft_cache_free(ds_draft_cache *c) {
    if (c->layer)
        for (int l = 0; l < c->n_layers; l++) ds_dmem_free(c->dm, c->layer[l]);
    free(c->layer);
    memset(c, 0, sizeof *c);
}

// ---- scratch ------------------------------------------------------------------------------------

/* Cuts n buffers of sizes[i] floats out of the draft's scratch (grown when short); each starts on
 * a 64-byte boundary. */
static int carve(ds_draft *d, const size_t *sizes, float **bufs, int n, ds_err *err) {
    size_t need = 0;
    for (int i = 0; i < n; i++) need += (sizes[i] + 15) & ~(size_t)15;
    if (need > d->scratch_cap) {
        free(d->scratch);
        d->scratch = ds_aligned_alloc(need * sizeof(float), err);
        d->scratch_cap = d->scratch ? need : 0;
        if (!d->scratch) return DS_ERR;
    }
    float *p = d->scratch;
    for (int i = 0; i < n; i++) {
        bufs[i] = p;
        p += (sizes[i] + 15) & ~(size_t)15;
    }
    return DS_OK;
}

// ---- context (docs/model.md §8.4) ---------------------------------------------------------------

/* acc [n][D] += W_context[:, tap j] taps[j - j0] for j in [j0, j1), one tap at a time, in tap
 * order (taps [j1-j0][n][Dt]; tmp [n][D] scratch). */
static void context_add(const ds_draft *d, int n, int j0, int j1, const float *taps, float *acc,
                        float *tmp) {
    const ds_draft_config *c = &d->cfg;
    int Dt = c->target_hidden_size, D = c->hidden_size;
    for (int j = j0; j < j1; j++) {
        ds_matmul(tmp, D, taps + (size_t)(j - j0) * n * Dt, Dt, n, &d->ctx_blocks[j]);
        ds_add(acc, tmp, (size_t)n * D);
    }
}

/* ctx [n][D] from taps [n_taps][n][Dt]: the sum over taps, then context_norm. */
static void context_rows(const ds_draft *d, int n, const float *taps, float *tmp, float *ctx) {
    const ds_draft_config *c = &d->cfg;
    memset(ctx, 0, (size_t)n * c->hidden_size * sizeof(float));
    context_add(d, n, 0, c->num_target_layers, taps, ctx, tmp);
    ds_rmsnorm(ctx, ctx, d->context_norm, n, c->hidden_size, c->rms_norm_eps);
}

int ds_draft_context(ds_draft *d, int n, const float *taps, float *ctx, ds_err *err) {
    if (n < 1) return ds_errf(err, "draft context: n = %d (>= 1)", n);
    if (d->context_only) return ds_errf(err, "draft context: loaded for the tap relay only");
    size_t sizes[1] = {(size_t)n * d->cfg.hidden_size};
    float *tmp;
    if (carve(d, sizes, &tmp, 1, err)) return DS_ERR;
    context_rows(d, n, taps, tmp, ctx);
    return DS_OK;
}

int ds_draft_context_add(ds_draft *d, int n, int j0, int j1, const float *taps, float *acc,
                         ds_err *err) {
    if (n < 1 || j0 < 0 || j1 > d->cfg.num_target_layers || j0 > j1)
        return ds_errf(err, "draft context_add: n = %d, taps [%d, %d) of %d", n, j0, j1,
                       d->cfg.num_target_layers);
    size_t sizes[1] = {(size_t)n * d->cfg.hidden_size};
    float *tmp;
    if (carve(d, sizes, &tmp, 1, err)) return DS_ERR;
    context_add(d, n, j0, j1, taps, acc, tmp);
    return DS_OK;
}

/* kv [n][R+dr] (raw W_kva output) -> latent rows [RMSNorm_{kv_a_layernorm}(c) | RoPE(kR)], with
 * cs [n][dr/2][2] the rotation of each row's position. */
static void finish_latent(const ds_draft *d, const draft_layer *w, float *kv, const float *cs,
                          int n) {
    const ds_draft_config *c = &d->cfg;
    int R = c->kv_lora_rank, dr = c->qk_rope_head_dim, row = R + dr;
    for (int t = 0; t < n; t++) {
        float *kt = kv + (size_t)t * row;
        ds_rmsnorm(kt, kt, w->kv_a_norm, 1, R, c->rms_norm_eps);
        rope_apply(kt + R, cs + (size_t)t * dr, dr / 2);
    }
}

/* Rows a CPU context write stacks from several items at most (their taps copied together: a
 * bound on that copy; an item longer than this goes alone, uncopied). */
enum { CTX_STACK_ROWS = 512 };

/* Context rows on the CPU for n_items items (checked by the caller) holding N rows in all, every
 * row through each matmul together (a row's bits do not depend on the others: ds_matmul), so
 * each item gets exactly what it would alone: from taps [n_taps][n][Dt] or sums [n][D] (the
 * context before context_norm). */
static int write_context(ds_draft *d, ds_draft_cache *c, int n_items, const ds_draft_ctx_write *w,
                         int N, ds_err *err) {
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, Dt = cf->target_hidden_size, nt = cf->num_target_layers;
    int dr = cf->qk_rope_head_dim, row = cf->kv_lora_rank + dr;
    const int taps = w[0].taps != NULL;
    const size_t in_n = n_items == 1 ? 0 : taps ? (size_t)nt * N * Dt : (size_t)N * D;
    size_t sizes[5] = {
        in_n,            /* the items' inputs stacked: taps [nt][N][Dt] or sums [N][D] */
        (size_t)N * D,   /* tmp [N][D] */
        (size_t)N * D,   /* ctx [N][D] */
        (size_t)N * row, /* kv [N][R+dr] */
        (size_t)N * dr,  /* cs [N][dr/2][2] */
    };
    float *b[5];
    if (carve(d, sizes, b, 5, err)) return DS_ERR;
    float *tmp = b[1], *ctx = b[2], *kv = b[3], *cs = b[4];
    const float *in = taps ? w[0].taps : w[0].sum;
    if (n_items > 1) {
        for (int i = 0, off = 0; i < n_items; off += w[i].n, i++) {
            const size_t ni = (size_t)w[i].n;
            if (taps)
                for (int j = 0; j < nt; j++)
                    memcpy(b[0] + ((size_t)j * N + off) * Dt, w[i].taps + j * ni * Dt,
                           ni * Dt * sizeof(float));
            else
                memcpy(b[0] + (size_t)off * D, w[i].sum, ni * D * sizeof(float));
        }
        in = b[0];
    }
    if (taps)
        context_rows(d, N, in, tmp, ctx);
    else
        ds_rmsnorm(ctx, in, d->context_norm, N, D, cf->rms_norm_eps);
    for (int i = 0, off = 0; i < n_items; off += w[i].n, i++)
        ds_draft_rope_table(d, cs + (size_t)off * dr, w[i].pos0, w[i].n);
    /* ctx feeds W_kva directly: it does not pass through input_layernorm (§8.4). */
    for (int l = 0; l < cf->num_hidden_layers; l++) {
        const draft_layer *lw = &d->layers[l];
        ds_matmul(kv, row, ctx, D, N, &lw->kv_a);
        finish_latent(d, lw, kv, cs, N);
        for (int i = 0, off = 0; i < n_items; off += w[i].n, i++) {
            ds_latent_view view = {c->layer[l], w[i].block_table, c->block_size, row, 0, 0};
            for (int t = 0; t < w[i].n; t++)
                memcpy(ds_latent_row(&view, w[i].pos0 + t), kv + ((size_t)off + t) * row,
                       (size_t)row * sizeof(float));
        }
    }
    return DS_OK;
}

int ds_draft_write_context_batch(ds_draft *d, ds_draft_cache *c, int n_items,
                                 const ds_draft_ctx_write *w, ds_err *err) {
    const ds_draft_config *cf = &d->cfg;
    int row = cf->kv_lora_rank + cf->qk_rope_head_dim;
    if (d->context_only) return ds_errf(err, "draft write_context: loaded for the tap relay only");
    if (c->row != row || c->n_layers != cf->num_hidden_layers)
        return ds_errf(err,
                       "draft write_context: cache of %d layers x %d floats, draft needs %d x %d",
                       c->n_layers, c->row, cf->num_hidden_layers, row);
    for (int i = 0; i < n_items; i++) {
        if (w[i].n < 1 || w[i].pos0 < 0)
            return ds_errf(err, "draft write_context: n = %d, pos0 = %d (need n >= 1, pos0 >= 0)",
                           w[i].n, w[i].pos0);
        if (!w[i].taps == !w[i].sum || !w[i].taps != !w[0].taps)
            return ds_errf(err,
                           "draft write_context: item %d: give taps or a sum, the same kind "
                           "for every item",
                           i);
    }
    if (d->dev) return n_items ? d->be->draft_write_context(d, c, n_items, w, err) : DS_OK;
    for (int i0 = 0, i1; i0 < n_items; i0 = i1) { /* items stacked up to CTX_STACK_ROWS rows */
        int N = w[i0].n;
        for (i1 = i0 + 1; i1 < n_items && N + w[i1].n <= CTX_STACK_ROWS; i1++) N += w[i1].n;
        if (write_context(d, c, i1 - i0, w + i0, N, err)) return DS_ERR;
    }
    return DS_OK;
}

int ds_draft_write_context(ds_draft *d, ds_draft_cache *c, const int32_t *block_table, int pos0,
                           int n, const float *taps, ds_err *err) {
    const ds_draft_ctx_write w = {block_table, pos0, n, taps, NULL};
    return ds_draft_write_context_batch(d, c, 1, &w, err);
}

int ds_draft_write_context_sum(ds_draft *d, ds_draft_cache *c, const int32_t *block_table, int pos0,
                               int n, const float *sum, ds_err *err) {
    const ds_draft_ctx_write w = {block_table, pos0, n, NULL, sum};
    return ds_draft_write_context_batch(d, c, 1, &w, err);
}

// ---- block pass (docs/model.md §8.5) and Markov walk (§8.7) -------------------------------------

/* Buffers of one proposal pass: n sequences of T rows each, rows b T .. b T + T - 1 sequence b's
 * (NT = n T). */
typedef struct block_bufs {
    float *h, *x, *a;   /* [NT][D] stream, normed input, sublayer output */
    float *qa;          /* [NT][Rq] */
    float *q;           /* [NT][Ha][dn+dr] */
    float *kv;          /* [NT][R+dr] the blocks' latent rows */
    float *qr;          /* [NT][Ha][dr] rotated rope part of the queries */
    float *qbar, *obar; /* [NT][Ha][R] queries / outputs in the latent space */
    float *o;           /* [NT][Ha][dvh] */
    float *g, *u;       /* [NT][I] MLP gate / up */
    float *cs;          /* [NT][dr/2][2] rotations of each row's position (p_b+1..p_b+T) */
    float *U;           /* [NT][V] block logits when the caller passes none */
    float *w1, *bias;   /* [n][r] Markov rows of the previous tokens, [n][V] their biases */
} block_bufs;

/* One proposal's view of layer l's rows: its sequence's context pages for positions <= p, then
 * its own spare pages (spare slot b) from the page holding p+1 on. */
typedef struct block_seq {
    ds_latent_view view;
    const int32_t *block_table;
    int p;
} block_seq;

/* The blocks' MLA for layer l: out bb->a [NT][D] from the normed input bb->x; the projections
 * run over all n T rows at once (a row's bits do not depend on the others: ds_matmul), the
 * latent rows and the attention per sequence, through seq[b]'s view. */
static void block_attention(ds_draft *d, int l, block_bufs *bb, const block_seq *seq, int n,
                            int T) {
    const ds_draft_config *c = &d->cfg;
    const draft_layer *w = &d->layers[l];
    int D = c->hidden_size, Ha = c->num_attention_heads, R = c->kv_lora_rank, Rq = c->q_lora_rank;
    int dn = c->qk_nope_head_dim, dr = c->qk_rope_head_dim, dvh = c->v_head_dim, dq = dn + dr;
    int row = R + dr, NT = n * T;
    if (Rq) {
        ds_matmul(bb->qa, Rq, bb->x, D, NT, &w->q_a);
        ds_rmsnorm(bb->qa, bb->qa, w->q_a_norm, NT, Rq, c->rms_norm_eps);
        ds_matmul(bb->q, Ha * dq, bb->qa, Rq, NT, &w->q_b);
    } else {
        ds_matmul(bb->q, Ha * dq, bb->x, D, NT, &w->q);
    }
    ds_matmul(bb->kv, row, bb->x, D, NT, &w->kv_a);
    finish_latent(d, w, bb->kv, bb->cs, NT);
    for (int b = 0; b < n; b++)
        for (int t = 0; t < T; t++)
            memcpy(ds_latent_row(&seq[b].view, seq[b].p + 1 + t),
                   bb->kv + ((size_t)b * T + t) * row, (size_t)row * sizeof(float));
    /* qR turns at its own row's position, like the key it is matched with (trap 9). */
    for (int t = 0; t < NT; t++)
        for (int h = 0; h < Ha; h++) {
            float *qr = bb->qr + ((size_t)t * Ha + h) * dr;
            memcpy(qr, bb->q + ((size_t)t * Ha + h) * dq + dn, (size_t)dr * sizeof(float));
            rope_apply(qr, bb->cs + (size_t)t * dr, dr / 2);
        }
    for (int h = 0; h < Ha; h++) {
        ds_mat uk = ds_mat_rows(&w->kv_b, h * (dn + dvh), dn);
        ds_matmul_t(bb->qbar + (size_t)h * R, Ha * R, bb->q + (size_t)h * dq, Ha * dq, NT, &uk);
    }
    /* Non-causal: every block row sees context rows 0..p and all T block rows (§8.5, trap 15). */
    for (int b = 0; b < n; b++) {
        size_t r0 = (size_t)b * T * Ha;
        ds_mla_attend_absorbed(bb->obar + r0 * R, bb->qbar + r0 * R, bb->qr + r0 * dr, T, Ha, R, dr,
                               &seq[b].view, seq[b].p + 1, seq[b].p + 1 + T, 0,
                               (float)d->yarn.softmax_scale);
    }
    for (int h = 0; h < Ha; h++) {
        ds_mat uv = ds_mat_rows(&w->kv_b, h * (dn + dvh) + dn, dvh);
        ds_matmul(bb->o + (size_t)h * dvh, Ha * dvh, bb->obar + (size_t)h * R, Ha * R, NT, &uv);
    }
    ds_matmul(bb->a, D, bb->o, Ha * dvh, NT, &w->o);
}

/* Proposal b's block table (tab [full + n_spare]): context rows 0..p through the sequence's pages,
 * rows p+1.. in the cache's spare pages of slot b. The page holding p+1 is replaced by the
 * slot's first spare page, which receives a copy of that page's context rows (spare_fill), so
 * context and block read as one paged sequence without a write into the sequence's own pages. */
static void spare_table(const ds_draft_cache *c, const int32_t *block_table, int p, int b,
                        int32_t *tab) {
    int full = (p + 1) / c->block_size; /* pages wholly made of context rows */
    memcpy(tab, block_table, (size_t)full * sizeof(int32_t));
    for (int k = 0; k < c->n_spare; k++) tab[full + k] = c->n_pages + b * c->n_spare + k;
}

/* Copies the context rows of the page holding p+1 into the view's spare page (layer l). */
static void spare_fill(ds_draft_cache *c, int l, const block_seq *q) {
    int bs = c->block_size;
    ds_latent_view seq = {c->layer[l], q->block_table, bs, c->row, 0, 0};
    for (int pos = (q->p + 1) / bs * bs; pos <= q->p; pos++)
        memcpy(ds_latent_row(&q->view, pos), ds_latent_row(&seq, pos),
               (size_t)c->row * sizeof(float));
}

int ds_draft_propose(ds_draft *d, ds_draft_cache *c, const int32_t *block_table, int p,
                     int32_t anchor, int T, int32_t *drafts, float *block_logits, ds_err *err) {
    return ds_draft_propose_batch(d, c, 1, &block_table, &p, &anchor, T, drafts, block_logits, err);
}

int ds_draft_propose_batch(ds_draft *d, ds_draft_cache *c, int n,
                           const int32_t *const *block_tables, const int *ps,
                           const int32_t *anchors, int T, int32_t *drafts, float *block_logits,
                           ds_err *err) {
    const ds_draft_config *cf = &d->cfg;
    int D = cf->hidden_size, V = cf->vocab_size, Ha = cf->num_attention_heads;
    int R = cf->kv_lora_rank, dr = cf->qk_rope_head_dim, dq = cf->qk_nope_head_dim + dr;
    int I = cf->intermediate_size, r = cf->markov_rank;
    if (n < 1 || n > c->max_seqs)
        return ds_errf(err, "draft propose: %d sequences (cache allows 1..%d)", n, c->max_seqs);
    if (T < 1 || T > c->max_block)
        return ds_errf(err, "draft propose: T = %d (cache allows 1..%d)", T, c->max_block);
    for (int b = 0; b < n; b++) {
        if (ps[b] < 0) return ds_errf(err, "draft propose: p = %d (>= 0)", ps[b]);
        /* The anchor comes from the target's argmax, so an id outside the vocabulary is a caller
         * bug: report it rather than clamp it (ATOM clamps because its batches carry padding
         * ids). */
        if (anchors[b] < 0 || anchors[b] >= V)
            return ds_errf(err, "draft propose: anchor id %d is outside [0, %d)", anchors[b], V);
    }
    if (c->row != R + dr || c->n_layers != cf->num_hidden_layers)
        return ds_errf(err, "draft propose: cache of %d layers x %d floats, draft needs %d x %d",
                       c->n_layers, c->row, cf->num_hidden_layers, R + dr);
    if (d->dev)
        return d->be->draft_propose(d, c, n, block_tables, ps, anchors, T, drafts, block_logits,
                                    err);
    const size_t NT = (size_t)n * T, TD = NT * D;
    size_t n_tab = 0; /* the n block tables, each [full_b + n_spare] */
    for (int b = 0; b < n; b++) n_tab += (size_t)(ps[b] + 1) / c->block_size + c->n_spare;
    size_t sizes[] = {
        TD,
        TD,
        TD,                                           /* h, x, a */
        NT * (cf->q_lora_rank ? cf->q_lora_rank : 1), /* qa */
        NT * Ha * dq,                                 /* q */
        NT * (R + dr),                                /* kv */
        NT * Ha * dr,                                 /* qr */
        NT * Ha * R,
        NT * Ha * R,              /* qbar, obar */
        NT * Ha * cf->v_head_dim, /* o */
        NT * I,
        NT * I,                    /* g, u */
        NT * dr,                   /* cs */
        block_logits ? 1 : NT * V, /* U */
        (size_t)n * r,
        (size_t)n * V, /* w1, bias */
        NT,            /* ids (int32) */
        (size_t)n,     /* prev (int32) */
    };
    float *bf[DS_ARRAY_LEN(sizes)];
    if (carve(d, sizes, bf, (int)DS_ARRAY_LEN(sizes), err)) return DS_ERR;
    block_bufs bb = {bf[0], bf[1], bf[2],  bf[3],  bf[4],  bf[5],  bf[6],  bf[7],
                     bf[8], bf[9], bf[10], bf[11], bf[12], bf[13], bf[14], bf[15]};
    if (block_logits) bb.U = block_logits;
    int32_t *ids = (int32_t *)bf[16];  /* [NT] */
    int32_t *prev = (int32_t *)bf[17]; /* [n] */
    if (n_tab > d->table_cap) {
        int32_t *t = realloc(d->table, n_tab * sizeof *t);
        if (!t) return ds_errf(err, "out of memory (draft block tables of %zu pages)", n_tab);
        d->table = t;
        d->table_cap = n_tab;
    }
    block_seq *seq = malloc((size_t)n * sizeof *seq);
    if (!seq) return ds_errf(err, "out of memory (draft views of %d sequences)", n);

    /* Inputs [x0, M, ..., M] at positions p+1..p+T of each sequence, embedded with the target's
     * table. */
    int32_t *tab = d->table;
    for (int b = 0; b < n; b++) {
        ids[(size_t)b * T] = anchors[b];
        for (int t = 1; t < T; t++) ids[(size_t)b * T + t] = cf->mask_token_id;
        ds_draft_rope_table(d, bb.cs + (size_t)b * T * dr, ps[b] + 1, T);
        spare_table(c, block_tables[b], ps[b], b, tab);
        seq[b] = (block_seq){{NULL, tab, c->block_size, c->row, 0, 0}, block_tables[b], ps[b]};
        tab += (ps[b] + 1) / c->block_size + c->n_spare;
    }
    ds_embed(bb.h, d->embed, ids, (int)NT);
    for (int l = 0; l < cf->num_hidden_layers; l++) {
        const draft_layer *w = &d->layers[l];
        for (int b = 0; b < n; b++) {
            seq[b].view.pool = c->layer[l];
            spare_fill(c, l, &seq[b]);
        }
        ds_rmsnorm(bb.x, bb.h, w->in_norm, (int)NT, D, cf->rms_norm_eps);
        block_attention(d, l, &bb, seq, n, T);
        ds_add(bb.h, bb.a, TD);
        ds_rmsnorm(bb.x, bb.h, w->post_norm, (int)NT, D, cf->rms_norm_eps);
        ds_matmul(bb.g, I, bb.x, D, (int)NT, &w->gate);
        ds_matmul(bb.u, I, bb.x, D, (int)NT, &w->up);
        ds_act_swiglu(bb.g, bb.g, bb.u, NT * I);
        ds_matmul(bb.a, D, bb.g, I, (int)NT, &w->down);
        ds_add(bb.h, bb.a, TD);
    }
    free(seq);
    ds_rmsnorm(bb.x, bb.h, d->final_norm, (int)NT, D, cf->rms_norm_eps);
    ds_matmul(bb.U, V, bb.x, D, (int)NT, d->lm_head);

    /* Markov walk: row k-1's logits plus the rank-r bias W2 · W1[x_{k-1}] of the token chosen
     * before it, every sequence's step k together. Only this loop is sequential. */
    for (int b = 0; b < n; b++) prev[b] = anchors[b];
    for (int k = 0; k < T; k++) {
        ds_embed(bb.w1, &d->markov_w1, prev, n);
        ds_matmul(bb.bias, V, bb.w1, r, n, &d->markov_w2);
        for (int b = 0; b < n; b++) {
            float *bias = bb.bias + (size_t)b * V;
            ds_add(bias, bb.U + ((size_t)b * T + k) * V, (size_t)V);
            prev[b] = drafts[(size_t)b * T + k] = ds_argmax(bias, V);
        }
    }
    return DS_OK;
}
